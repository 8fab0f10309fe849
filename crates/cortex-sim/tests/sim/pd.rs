//! Prefill/decode rendezvous for both engines, and clean failures when a leg is missing.

use std::thread;
use std::time::Duration;

use cortex_sim::{Role, SimConfig, SimWorker};
use serde_json::{Value, json};

use crate::support::{post, wait_until};

fn worker(mut cfg: SimConfig, role: Role) -> SimWorker {
    cfg.role = role;
    cfg.pd.bootstrap_timeout = Duration::from_secs(10);
    SimWorker::start(cfg).expect("worker")
}

fn sglang_body(port: u16, room: u64, max: u32) -> Value {
    json!({
        "input_ids": (100..150).collect::<Vec<u32>>(),
        "sampling_params": {"max_new_tokens": max},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    })
}

#[test]
fn sglang_legs_meet_in_either_order() {
    let mut pcfg = SimConfig::sglang();
    pcfg.dp_size = 2;
    let p = worker(pcfg, Role::Prefill);
    let d = worker(SimConfig::sglang(), Role::Decode);
    let port = p.bootstrap_addr().expect("bootstrap listener").port();
    let (pa, da) = (p.http_addr(), d.http_addr());
    let info = crate::support::get(pa, "/server_info").json();
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_eq!(info["disaggregation_bootstrap_port"], port);
    for (room, decode_first) in [(7u64, false), (8u64, true)] {
        let body = sglang_body(port, room, 6);
        let (b1, b2) = (body.clone(), body);
        let (pl, dl) = if decode_first {
            let dl = thread::spawn(move || post(da, "/generate", &b2));
            let pl = thread::spawn(move || post(pa, "/generate", &b1));
            (pl, dl)
        } else {
            let pl = thread::spawn(move || post(pa, "/generate", &b1));
            let dl = thread::spawn(move || post(da, "/generate", &b2));
            (pl, dl)
        };
        let (pr, dr) = (pl.join().expect("prefill"), dl.join().expect("decode"));
        assert_eq!(pr.status, 200, "{}", pr.text());
        assert_eq!(dr.status, 200, "{}", dr.text());
        let (pv, dv) = (pr.json(), dr.json());
        // The prefill leg finishes when the transfer is done, with SGLang's `length(0)`.
        assert_eq!(pv["meta_info"]["finish_reason"], json!({"type": "length", "length": 0}));
        assert_eq!(pv["output_ids"].as_array().expect("ids").len(), 1);
        // The decode leg continues from the prefill's first token.
        assert_eq!(dv["output_ids"][0], pv["output_ids"][0]);
        assert_eq!(dv["output_ids"].as_array().expect("ids").len(), 6);
        // room % dp_size picks the prefill rank.
        assert_eq!(pr.header("x-sim-dp-rank"), Some(if room % 2 == 0 { "0" } else { "1" }));
    }
    // The prefill side cached the prompt (inserted when the transfer finished); the decode side,
    // without `--disaggregation-decode-enable-radix-cache`, holds and announces nothing.
    assert_eq!(p.held_blocks(1).expect("rank").len() + p.held_blocks(0).expect("rank").len(), 6);
    assert!(d.held_blocks(0).expect("rank").is_empty());
    assert_eq!(d.last_seq(0), None, "no events at all, not even the start-up clear");
    p.shutdown();
    d.shutdown();
}

#[test]
fn sglang_missing_leg_fails_after_the_bootstrap_timeout() {
    let mut pcfg = SimConfig::sglang();
    pcfg.role = Role::Prefill;
    pcfg.pd.bootstrap_timeout = Duration::from_millis(200);
    let p = SimWorker::start(pcfg).expect("prefill");
    let mut dcfg = SimConfig::sglang();
    dcfg.role = Role::Decode;
    dcfg.pd.bootstrap_timeout = Duration::from_millis(200);
    let d = SimWorker::start(dcfg).expect("decode");
    let port = p.bootstrap_addr().expect("bootstrap").port();
    // Prefill alone: its request fails once nobody fetched the room.
    let pr = post(p.http_addr(), "/generate", &sglang_body(port, 99, 4));
    assert_eq!(pr.status, 500, "{}", pr.text());
    assert!(pr.text().contains("KV transfer failed"));
    assert_eq!(p.in_flight(0).expect("rank"), 0);
    // Decode alone: it gives up waiting for the room.
    let dr = post(d.http_addr(), "/generate", &sglang_body(port, 100, 4));
    assert_eq!(dr.status, 500, "{}", dr.text());
    assert_eq!(d.in_flight(0).expect("rank"), 0);
    // Decode pointing at nothing listening.
    let dead = post(d.http_addr(), "/generate", &sglang_body(1, 101, 4));
    assert_eq!(dead.status, 500);
    // A disaggregated SGLang worker refuses a request without a room: it cannot serve alone.
    for w in [&p, &d] {
        let r = post(w.http_addr(), "/generate", &json!({"input_ids": [1, 2, 3]}));
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains("without bootstrap room"));
    }
    p.shutdown();
    d.shutdown();
}

fn vllm_prefill(p: &SimWorker, body: &Value) -> Value {
    let mut b = body.clone();
    b["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null});
    b["max_tokens"] = json!(1);
    b["stream"] = json!(false);
    let r = post(p.http_addr(), "/v1/completions", &b);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["kv_transfer_params"].clone()
}

#[test]
fn vllm_decode_pulls_the_prefill_lease() {
    let p = worker(SimConfig::vllm(), Role::Prefill);
    let d = worker(SimConfig::vllm(), Role::Decode);
    let body = json!({"prompt": (1..=40).collect::<Vec<u32>>(), "max_tokens": 5});
    let kv = vllm_prefill(&p, &body);
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(kv["remote_port"], p.bootstrap_addr().expect("side channel").port());
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert_eq!(kv["remote_block_ids"][0].as_array().expect("ids").len(), 3);
    assert!(kv["remote_request_id"].as_str().expect("id").starts_with("cmpl-"));
    assert_eq!(kv["remote_num_tokens"], 40);
    assert_eq!(p.leases(0).expect("rank"), 1, "the prefill blocks stay leased");
    assert!(p.held_blocks(0).expect("rank").iter().all(|b| b.in_use));
    let mut db = body.clone();
    db["kv_transfer_params"] = kv;
    db["stream"] = json!(true);
    let r = post(d.http_addr(), "/v1/completions", &db);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.sse().last().map(String::as_str), Some("[DONE]"));
    assert_eq!(p.leases(0).expect("rank"), 0, "reading the lease frees it");
    assert!(p.held_blocks(0).expect("rank").iter().all(|b| !b.in_use));
    // The decode side cached the transferred prompt blocks (announced when the KV landed).
    let dh = d.held_blocks(0).expect("rank");
    let ph = p.held_blocks(0).expect("rank");
    assert_eq!(
        dh.iter().map(|b| b.hash).take(2).collect::<Vec<_>>(),
        ph.iter().map(|b| b.hash).take(2).collect::<Vec<_>>()
    );
    p.shutdown();
    d.shutdown();
}

#[test]
fn vllm_expired_lease_fails_the_decode_leg() {
    let mut pcfg = SimConfig::vllm();
    pcfg.role = Role::Prefill;
    pcfg.pd.kv_lease = Duration::from_millis(50);
    let p = SimWorker::start(pcfg).expect("prefill");
    let d = worker(SimConfig::vllm(), Role::Decode);
    let body = json!({"prompt": (1..=40).collect::<Vec<u32>>(), "max_tokens": 5});
    let kv = vllm_prefill(&p, &body);
    wait_until("the lease to expire", || p.leases(0).expect("rank") == 0);
    assert!(p.held_blocks(0).expect("rank").iter().all(|b| !b.in_use), "expiry frees the blocks");
    let mut db = body.clone();
    db["kv_transfer_params"] = kv.clone();
    // vLLM's decode side: finish_reason "error" becomes a 500 when not streaming…
    let r = post(d.http_addr(), "/v1/completions", &db);
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.json()["error"]["message"], "Internal server error");
    assert_eq!(d.pd_transfer_failures(), 1);
    // …and, streaming, an error event after the 200 head (after the role preamble for chat).
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 3});
    let mut pchat = chat.clone();
    pchat["kv_transfer_params"] = json!({"do_remote_decode": true});
    pchat["stream"] = json!(false);
    pchat["max_tokens"] = json!(1);
    let pr = post(p.http_addr(), "/v1/chat/completions", &pchat);
    assert_eq!(pr.status, 200, "{}", pr.text());
    wait_until("the chat lease to expire", || p.leases(0).expect("rank") == 0);
    let mut chat = chat;
    chat["kv_transfer_params"] = pr.json()["kv_transfer_params"].clone();
    let r = post(d.http_addr(), "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    let events = r.sse();
    assert_eq!(events.len(), 3, "{events:?}");
    let role: Value = serde_json::from_str(&events[0]).expect("role chunk");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let err: Value = serde_json::from_str(&events[1]).expect("error event");
    assert_eq!(err["error"]["code"], 500);
    assert_eq!(events[2], "[DONE]");
    assert_eq!(d.pd_transfer_failures(), 2);
    // A decode request for another prompt than the prefill's is refused.
    let kv2 = vllm_prefill(&p, &body);
    let mut other = json!({"prompt": (1..=30).collect::<Vec<u32>>(), "max_tokens": 5});
    other["kv_transfer_params"] = kv2;
    assert_eq!(post(d.http_addr(), "/v1/completions", &other).status, 400);
    // Without kv_transfer_params the decode worker simply prefills locally.
    assert_eq!(post(d.http_addr(), "/v1/completions", &body).status, 200);
    let _ = kv;
    p.shutdown();
    d.shutdown();
}

/// Runs one vLLM PD request (prefill leg, then decode leg) and returns the decode answer.
fn vllm_pd(p: &SimWorker, d: &SimWorker, body: &Value) -> Value {
    let mut db = body.clone();
    db["kv_transfer_params"] = vllm_prefill(p, body);
    let r = post(d.http_addr(), "/v1/completions", &db);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn vllm_decode_pulls_only_what_it_lacks_and_reports_it_as_cached() {
    let p = worker(SimConfig::vllm(), Role::Prefill);
    let d = worker(SimConfig::vllm(), Role::Decode);
    let body = json!({"prompt": (1..=64).collect::<Vec<u32>>(), "max_tokens": 2});
    let first = vllm_pd(&p, &d, &body);
    let c1 = d.pd_counters(0).expect("rank");
    assert_eq!((c1.decode_legs, c1.pulled_tokens), (1, 64), "nothing local: the whole prompt is pulled");
    // vLLM counts the pulled tokens as computed: cached_tokens is the transfer (less the last
    // prompt token, which the decode side recomputes).
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 63);
    assert_eq!(p.pd_counters(0).expect("rank").prefill_legs, 1);
    // The same prompt again: the decode worker holds its first 3 blocks (48 tokens; the 4th
    // block holds the last prompt token, never a local hit), so it pulls only the rest.
    let second = vllm_pd(&p, &d, &body);
    let c2 = d.pd_counters(0).expect("rank");
    assert_eq!((c2.decode_legs, c2.pulled_tokens - c1.pulled_tokens), (2, 16));
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 63);
    p.shutdown();
    d.shutdown();
}

fn sglang_pd(p: &SimWorker, d: &SimWorker, body: &Value) -> Value {
    let (pa, da) = (p.http_addr(), d.http_addr());
    let (b1, b2) = (body.clone(), body.clone());
    let pl = thread::spawn(move || post(pa, "/generate", &b1));
    let dl = thread::spawn(move || post(da, "/generate", &b2));
    let (pr, dr) = (pl.join().expect("prefill"), dl.join().expect("decode"));
    assert_eq!(pr.status, 200, "{}", pr.text());
    assert_eq!(dr.status, 200, "{}", dr.text());
    dr.json()
}

#[test]
fn sglang_decode_pulls_what_its_radix_cache_lacks_and_reports_the_prefill_hit() {
    for radix in [false, true] {
        let p = worker(SimConfig::sglang(), Role::Prefill);
        let mut dcfg = SimConfig::sglang();
        if let cortex_sim::EngineConfig::Sglang(o) = &mut dcfg.engine {
            o.decode_radix_cache = radix;
        }
        let d = worker(dcfg, Role::Decode);
        let port = p.bootstrap_addr().expect("bootstrap").port();
        let mut body = sglang_body(port, 1, 2);
        body["input_ids"] = json!((1..=64).collect::<Vec<u32>>());
        let first = sglang_pd(&p, &d, &body);
        assert_eq!(d.pd_counters(0).expect("rank").pulled_tokens, 64);
        assert_eq!(first["meta_info"]["cached_tokens"], 0, "the prefill had nothing cached");
        body["bootstrap_room"] = json!(2);
        let second = sglang_pd(&p, &d, &body);
        let pulled = d.pd_counters(0).expect("rank").pulled_tokens - 64;
        // The prefill side now hits its cached pages (the last page is never a hit); the decode
        // side reports that hit, raised to its own prefix match when it has a radix cache.
        let prefill_hit = 48;
        if radix {
            assert!(pulled < 64, "the radix cache held a prefix: {pulled}");
            assert!(
                first["meta_info"]["cached_tokens"].as_u64() <= second["meta_info"]["cached_tokens"].as_u64()
            );
            assert!(second["meta_info"]["cached_tokens"].as_u64().expect("cached") >= prefill_hit);
        } else {
            assert_eq!(pulled, 64, "without a radix cache every page is transferred again");
            assert_eq!(second["meta_info"]["cached_tokens"], prefill_hit);
            assert!(d.held_blocks(0).expect("rank").is_empty());
        }
        assert_eq!(p.pd_counters(0).expect("rank").prefill_legs, 2);
        p.shutdown();
        d.shutdown();
    }
}
