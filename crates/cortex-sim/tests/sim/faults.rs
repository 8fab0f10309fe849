//! Every fault does what it says, through the handle and through `POST /sim/fault`.

use cortex_sim::{Fault, SimConfig, SimWorker};
use serde_json::{Value, json};

use crate::support::{TIMEOUT, dealer, get, post, recv, replay, sub, wait_until};

fn prompt(base: u32) -> Value {
    json!({"prompt": (base..base + 40).collect::<Vec<u32>>(), "max_tokens": 3})
}

#[test]
fn error_statuses_for_the_next_requests() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let addr = w.http_addr();
    w.fail_next(503, 2);
    for _ in 0..2 {
        let r = post(addr, "/v1/completions", &prompt(1));
        assert_eq!(r.status, 503);
        assert_eq!(r.header("retry-after"), Some("2"));
        assert_eq!(r.json()["error"]["code"], 503);
    }
    assert_eq!(post(addr, "/v1/completions", &prompt(1)).status, 200);
    for status in [429, 500] {
        let f = post(addr, "/sim/fault", &json!({"fail_next": {"status": status, "count": 1}}));
        assert_eq!(f.status, 200, "{}", f.text());
        assert_eq!(post(addr, "/v1/completions", &prompt(1)).status, status);
        assert_eq!(post(addr, "/v1/completions", &prompt(1)).status, 200);
    }
    assert_eq!(post(addr, "/sim/fault", &json!({"health": {"healthy": false}})).status, 200);
    assert_eq!(get(addr, "/health").status, 503);
    w.set_healthy(true);
    assert_eq!(get(addr, "/health").status, 200);
    assert_eq!(post(addr, "/sim/fault", &json!({"no_such_fault": 1})).status, 400);
    w.shutdown();
}

#[test]
fn stall_holds_requests_until_resumed_and_flush_is_refused_meanwhile() {
    let w = SimWorker::start(SimConfig::sglang()).expect("worker");
    let addr = w.http_addr();
    assert_eq!(post(addr, "/sim/fault", &json!("stall")).status, 200);
    let t = std::thread::spawn(move || {
        post(
            addr,
            "/generate",
            &json!({"input_ids": (1..40).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 2}}),
        )
    });
    wait_until("the request to wait", || w.rank_state(0).expect("rank").waiting == 1);
    // SGLang refuses to flush while requests are queued or running.
    let f = post(addr, "/flush_cache", &json!({}));
    assert_eq!(f.status, 400, "{}", f.text());
    assert!(matches!(w.flush_cache(), Err(cortex_sim::SimError::FlushRefused)));
    assert_eq!(w.rank_state(0).expect("rank").running, 0, "stalled: nothing is scheduled");
    w.inject(&Fault::Resume).expect("resume");
    let r = t.join().expect("request");
    assert_eq!(r.status, 200);
    assert!(!w.held_blocks(0).expect("rank").is_empty());
    let ctx = zmq::Context::new();
    let s = sub(&ctx, w.event_endpoints()[0].publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    assert_eq!(get(addr, "/flush_cache").status, 200);
    assert!(w.held_blocks(0).expect("rank").is_empty());
    let m = recv(&s);
    let b = cortex_events_sglang::decode_wire(&m[2]).expect("batch");
    assert_eq!(b.events, vec![cortex_events_sglang::WireEvent::AllBlocksCleared]);
    w.shutdown();
}

#[test]
fn die_mid_stream_cuts_the_connection() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let addr = w.http_addr();
    w.die_mid_stream(3, 1);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": (1..20).collect::<Vec<u32>>(), "max_tokens": 10, "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert!(!r.complete, "the chunked body never ends");
    let ev = r.sse();
    assert_eq!(ev.len(), 3, "three token chunks, then nothing: {ev:?}");
    assert!(!ev.iter().any(|e| e == "[DONE]"));
    wait_until("the cut request to be aborted", || w.in_flight(0).expect("rank") == 0);
    // Non-streaming: the connection closes without a response body.
    w.inject(&Fault::DieMidStream { after_tokens: 2, count: 1 }).expect("fault");
    let cut = crate::support::request(
        addr,
        "POST",
        "/v1/completions",
        &[],
        Some(&json!({"prompt": "hi", "max_tokens": 10}).to_string()),
    );
    assert_eq!((cut.status, cut.body.len()), (0, 0), "closed without a response: {cut:?}");
    // The next request is fine.
    let ok = post(
        addr,
        "/v1/completions",
        &json!({"prompt": (1..20).collect::<Vec<u32>>(), "max_tokens": 10, "stream": true}),
    );
    assert!(ok.complete);
    assert_eq!(ok.sse().last().map(String::as_str), Some("[DONE]"));
    w.shutdown();
}

#[test]
fn dropped_batches_leave_a_gap_that_replay_fills() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let addr = w.http_addr();
    let ctx = zmq::Context::new();
    let ep = w.event_endpoints()[0];
    let s = sub(&ctx, ep.publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    w.drop_next_batches(0, 1).expect("fault");
    post(addr, "/v1/completions", &json!({"prompt": (1..=16).collect::<Vec<u32>>(), "max_tokens": 1}));
    post(addr, "/v1/completions", &json!({"prompt": (100..=116).collect::<Vec<u32>>(), "max_tokens": 1}));
    let first = recv(&s);
    assert_eq!(first[1], 1u64.to_be_bytes(), "seq 0 was dropped: the subscriber sees a gap");
    let d = dealer(&ctx, ep.replay.expect("replay"));
    let got = replay(&d, 0);
    let seqs: Vec<Vec<u8>> = got.iter().map(|m| m[2].clone()).collect();
    assert_eq!(seqs, vec![0u64.to_be_bytes().to_vec(), 1u64.to_be_bytes().to_vec(), vec![0xff; 8]]);
    assert_eq!(got[0][1], b"", "vLLM 0.33 replies carry the (empty) topic frame");

    // Replay off: a request gets no reply; with replay back on, the first thing to arrive is the
    // answer to the next request.
    w.set_replay(0, false).expect("fault");
    d.send_multipart([&b""[..], &0u64.to_be_bytes()], 0).expect("send");
    wait_until("the request to be ignored", || w.rank_state(0).expect("rank").replay_ignored == 1);
    w.set_replay(0, true).expect("fault");
    let only_end = replay(&d, 1000);
    assert_eq!(only_end.len(), 1, "the request sent while replay was off got nothing");

    // Restart: the sequence starts again at 0 and nothing is announced.
    w.restart_publisher(0).expect("fault");
    post(addr, "/v1/completions", &json!({"prompt": (300..=316).collect::<Vec<u32>>(), "max_tokens": 1}));
    let m = recv(&s);
    assert_eq!(m[1], 0u64.to_be_bytes());
    let b = cortex_events_vllm::decode_wire(&m[2]).expect("batch");
    assert!(
        matches!(b.events[..], [cortex_events_vllm::WireEvent::BlockStored(_)]),
        "no AllBlocksCleared: {:?}",
        b.events
    );
    assert_eq!(replay(&d, 0).len(), 2, "the ring restarted too: seq 0 and the end marker");
    // Flush through the admin endpoint: vLLM's AllBlocksCleared.
    assert_eq!(post(addr, "/sim/fault", &json!("flush_cache")).status, 200);
    let m = recv(&s);
    assert_eq!(
        cortex_events_vllm::decode_wire(&m[2]).expect("batch").events,
        vec![cortex_events_vllm::WireEvent::AllBlocksCleared]
    );
    let state = get(addr, "/sim/state").json();
    assert_eq!(state["ranks"][0]["blocks"], json!([]));
    assert_eq!(state["ranks"][0]["subscribed"], true);
    w.shutdown();
}

#[test]
fn vllm_serves_reset_prefix_cache_only_in_dev_mode() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    assert_eq!(post(w.http_addr(), "/reset_prefix_cache", &json!({})).status, 404, "not in dev mode");
    w.shutdown();
    let mut cfg = SimConfig::vllm();
    if let cortex_sim::EngineConfig::Vllm(o) = &mut cfg.engine {
        o.dev_mode = true;
    }
    let w = SimWorker::start(cfg).expect("worker");
    assert_eq!(post(w.http_addr(), "/v1/completions", &prompt(1)).status, 200);
    let r = post(w.http_addr(), "/reset_prefix_cache", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(w.held_blocks(0).expect("rank").is_empty());
    w.shutdown();
}
