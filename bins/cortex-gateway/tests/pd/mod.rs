//! Disaggregated clusters end to end: the gateway in front of simulated prefill and decode
//! workers of both engines (and, where a test needs the fallback, a regular worker). Each test
//! states the invariant it holds; every wait is on observable state (the simulators' counters,
//! the ledger), never on time.

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};

use crate::common::{
    Harness, MODEL, Reply, harness, harness_with, long_prompt, metric, prometheus, sim, slow_sim,
};

fn role(engine: &str, role: cortex_sim::Role) -> cortex_sim::SimConfig {
    let mut c = sim(engine);
    c.role = role;
    c
}

fn prefill(engine: &str) -> cortex_sim::SimConfig {
    role(engine, cortex_sim::Role::Prefill)
}

fn decode(engine: &str) -> cortex_sim::SimConfig {
    role(engine, cortex_sim::Role::Decode)
}

/// Prefill and decode legs the workers `names` counted.
fn legs(h: &Harness, names: &[&str]) -> (u64, u64) {
    names
        .iter()
        .map(|n| h.worker(n).pd_counters(0).unwrap())
        .fold((0, 0), |(p, d), c| (p + c.prefill_legs, d + c.decode_legs))
}

fn assert_disaggregated(r: &Reply, what: &str, prefills: &[&str], decodes: &[&str]) {
    assert_eq!(r.status, StatusCode::OK, "{what}: {}", r.body);
    assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{what}");
    assert!(prefills.contains(&r.header("x-cortex-prefill-worker")), "{what}: {:?}", r.headers);
    assert_eq!(r.header("x-cortex-prefill-rank"), "0", "{what}");
    assert!(decodes.contains(&r.header("x-cortex-assigned-worker")), "{what}: {:?}", r.headers);
    assert!(!r.header("x-cortex-match-mode").is_empty(), "{what}");
    assert!(!r.header("x-cortex-cache-hit-tokens").is_empty(), "{what}");
}

/// Every route of the engine, streaming and not, is served by a pair: the answer is the decode
/// worker's (the engine's shape, a whole stream), both legs happened on the workers, and the
/// headers name both; a repeated long prompt goes to the prefill worker that holds it, with its
/// exact hit in the header.
async fn every_route_disaggregated(engine: &str) {
    let h = harness_with(
        engine,
        vec![prefill(engine), prefill(engine), decode(engine), decode(engine)],
        &[],
        |_| {},
        Some(prometheus()),
    )
    .await;
    let (p, d) = (["w0", "w1"], ["w2", "w3"]);
    let mut cases = vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "hello there"}]}),
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5})),
    ];
    if engine == "sglang" {
        cases.push((
            "/generate",
            json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 5}}),
        ));
    }
    let mut sent = 0;
    for (path, body) in cases {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let what = format!("{engine} {path} stream={stream}");
            let r = h.post(path, &body).await;
            sent += 1;
            assert_disaggregated(&r, &what, &p, &d);
            if stream {
                assert!(r.body.starts_with("data: "), "{what}: {}", r.body);
                assert!(r.body.ends_with("data: [DONE]\n\n"), "{what}: {}", r.body);
                assert!(!r.body.contains("\"error\""), "{what}: {}", r.body);
            } else {
                let v = r.json();
                let text = v["choices"][0]["text"]
                    .as_str()
                    .or_else(|| v["choices"][0]["message"]["content"].as_str())
                    .or_else(|| v["text"].as_str());
                assert!(text.is_some_and(|t| !t.is_empty()), "{what}: {}", r.body);
            }
            let want = (sent, sent);
            h.wait(&format!("{what}: both legs counted"), || {
                let (pl, dl) = legs(&h, &["w0", "w1", "w2", "w3"]);
                (pl, dl) == want
            })
            .await;
        }
    }
    // A long prompt, twice: the second request's prefill goes where the first one left it.
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": long_prompt(engine)}, {"role": "user", "content": "Go."}]});
    let first = h.post("/v1/chat/completions", &body).await;
    assert_disaggregated(&first, "first long prompt", &p, &d);
    let holder = first.header("x-cortex-prefill-worker").to_owned();
    let hit = h.wait_hit_on(&body, &holder).await;
    let second = h.post("/v1/chat/completions", &body).await;
    assert_disaggregated(&second, "second long prompt", &p, &d);
    assert_eq!(second.header("x-cortex-prefill-worker"), holder, "{:?}", second.headers);
    assert_eq!(second.header("x-cortex-match-mode"), "exact_kv_events");
    assert_eq!(second.header("x-cortex-cache-hit-tokens"), hit.to_string());
    // The dry run explains both choices.
    let dry = h.post("/debug/route", &body).await.json();
    assert_eq!(dry["candidates"][0]["worker"], holder.as_str(), "{dry}");
    assert!(dry["pd"]["decode"]["candidates"].as_array().is_some_and(|c| c.len() == 2), "{dry}");
    assert_eq!(dry["pd"]["regular"], Value::Null, "{dry}");
    let m = h.send("GET", "/metrics", Bytes::new()).await.body;
    assert!(
        metric(&m, "cortex_pd_requests_total", &[("outcome", "served"), ("pd", "disaggregated")]) >= 2.0,
        "{m}"
    );
    assert!(m.contains("cortex_pd_first_byte_seconds"), "{m}");
    assert!(m.contains("cortex_pd_prefill_seconds"), "{m}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_disaggregated_sglang() {
    every_route_disaggregated("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_disaggregated_vllm() {
    every_route_disaggregated("vllm").await;
}

/// A prefill worker that dies while its leg runs costs the client nothing: its leg fails, the
/// decode leg waiting for it is cancelled at once (never left to its bootstrap timeout), and a
/// new pair serves the request.
async fn a_prefill_worker_dying_is_replaced(engine: &str) {
    let mut h = harness(
        engine,
        vec![slow_sim_role(engine, cortex_sim::Role::Prefill), prefill(engine), decode(engine)],
        &[("scheduler", "{prefill_policy: round_robin}")],
    )
    .await;
    h.sims[0].stall();
    let body = |i: usize| json!({"model": MODEL, "prompt": format!("story {i}"), "max_tokens": 4});
    // Round robin: one of the first two requests meets the stalled worker w0.
    let caller = h.caller();
    let first = tokio::spawn(async move { caller.post("/v1/completions", &body(0)).await });
    let caller = h.caller();
    let second = tokio::spawn(async move { caller.post("/v1/completions", &body(1)).await });
    h.wait("a leg waits on the stalled prefill worker", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
    let dead = h.sims.remove(0);
    dead.shutdown();
    for r in [first.await.unwrap(), second.await.unwrap()] {
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{:?}", r.headers);
        assert_eq!(r.header("x-cortex-prefill-worker"), "w1", "{:?}", r.headers);
    }
    // The decode worker served both requests (it was not blamed for the prefill worker's death).
    assert_eq!(h.sims[1].pd_counters(0).unwrap().decode_legs, 2);
    h.shutdown().await;
}

/// Waits until the dry run of `body` satisfies `done`; returns it.
async fn wait_dry(h: &Harness, body: &Value, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + crate::common::WAIT;
    loop {
        let dry = h.post("/debug/route", body).await.json();
        if done(&dry) {
            return dry;
        }
        assert!(tokio::time::Instant::now() < deadline, "the dry run never got there: {dry}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until no worker of `h` is cooling down.
async fn wait_no_cooldown(h: &Harness) {
    let deadline = tokio::time::Instant::now() + crate::common::WAIT;
    loop {
        let dbg = h.debug_workers().await;
        if dbg["workers"].as_array().unwrap().iter().all(|w| w["cooldown"].is_null()) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "a worker stays in cooldown: {dbg}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

fn slow_sim_role(engine: &str, r: cortex_sim::Role) -> cortex_sim::SimConfig {
    let mut c = slow_sim(engine);
    c.role = r;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_dying_is_replaced_sglang() {
    a_prefill_worker_dying_is_replaced("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_dying_is_replaced_vllm() {
    a_prefill_worker_dying_is_replaced("vllm").await;
}

/// A decode leg whose KV transfer fails after the prefill succeeded is run again on one worker
/// with a cold prefill (a regular worker when the model has one; vLLM: else a decode worker
/// prefilling locally), visibly: `x-cortex-pd: fallback_single`, streaming or not (a streaming
/// answer's error event comes after its `200` head, and is still before the first byte).
async fn a_failed_transfer_falls_back(engine: &str, with_regular: bool) {
    // Without a regular worker, the other decode worker prefills alone (the one whose transfer
    // failed is not chosen again for the request). No cooldown, so each round starts alike.
    let mut sims = vec![prefill(engine), decode(engine)];
    sims.push(if with_regular { sim(engine) } else { decode(engine) });
    let h = harness(
        engine,
        sims,
        &[("scheduler", "{cooldown_server_error: 1ms, breaker_failures: 0, decode_policy: round_robin}")],
    )
    .await;
    for stream in [false, true] {
        h.sims[1].inject(&cortex_sim::Fault::FailTransfers { count: 1 }).unwrap();
        if !with_regular {
            h.sims[2].inject(&cortex_sim::Fault::FailTransfers { count: 1 }).unwrap();
        }
        let before = [h.sims[1].pd_transfer_failures(), h.sims[2].pd_transfer_failures()];
        // The previous round's blame (a 1 ms cooldown) is over before this round starts.
        wait_no_cooldown(&h).await;
        let body = json!({"model": MODEL, "prompt": format!("transfer {stream}"), "max_tokens": 4, "stream": stream});
        let r = h.post("/v1/completions", &body).await;
        let what = format!("{engine} regular={with_regular} stream={stream}");
        assert_eq!(r.status, StatusCode::OK, "{what}: {}", r.body);
        assert!(
            !r.body.contains("\"error\""),
            "{what}: the failed leg's error never reaches the client: {}",
            r.body
        );
        assert_eq!(r.header("x-cortex-pd"), "fallback_single", "{what}: {:?}", r.headers);
        assert_eq!(r.header("x-cortex-prefill-worker"), "", "{what}: one worker served it");
        let after = [h.sims[1].pd_transfer_failures(), h.sims[2].pd_transfer_failures()];
        let failed: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
        assert_eq!(
            failed.len(),
            1,
            "{what}: one transfer failed on a decode worker ({before:?} → {after:?})"
        );
        let failed_name = format!("w{}", failed[0] + 1);
        if with_regular {
            assert_eq!(r.header("x-cortex-assigned-worker"), "w2", "{what}");
        } else {
            // The other decode worker served it alone, prefilling locally.
            assert!(["w1", "w2"].contains(&r.header("x-cortex-assigned-worker")), "{what}");
            assert_ne!(r.header("x-cortex-assigned-worker"), failed_name, "{what}");
            // Disarm the fault the other worker did not use, so the next round starts alike.
            for s in &h.sims[1..] {
                s.inject(&cortex_sim::Fault::FailTransfers { count: 0 }).unwrap();
            }
        }
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transfer_falls_back_to_a_regular_worker_sglang() {
    a_failed_transfer_falls_back("sglang", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transfer_falls_back_to_a_regular_worker_vllm() {
    a_failed_transfer_falls_back("vllm", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transfer_falls_back_to_the_decode_worker_alone_vllm() {
    a_failed_transfer_falls_back("vllm", false).await;
}

/// With every prefill worker out of the pool, requests are served by one worker, visibly; with
/// no worker that can serve alone (SGLang decode workers need a prefill), the client gets a
/// clear 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_prefill_worker_down_falls_back_or_says_why() {
    let h = harness("vllm", vec![prefill("vllm"), decode("vllm")], &[]).await;
    h.sims[0].set_healthy(false);
    h.wait("the prefill worker left the pool", || h.live_workers() == 1).await;
    let r = h.post("/v1/completions", &json!({"model": MODEL, "prompt": "alone", "max_tokens": 3})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.header("x-cortex-pd"), "fallback_single", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-assigned-worker"), "w1");
    h.shutdown().await;

    let h = harness("sglang", vec![prefill("sglang"), decode("sglang")], &[]).await;
    h.sims[0].set_healthy(false);
    h.wait("the prefill worker left the pool", || h.live_workers() == 1).await;
    let r = h.post("/v1/completions", &json!({"model": MODEL, "prompt": "alone", "max_tokens": 3})).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert!(r.body.contains("no worker is available"), "{}", r.body);
    assert_eq!(h.sims[1].client_gone() + legs(&h, &["w1"]).1, 0, "nothing was sent to the decode worker");
    h.shutdown().await;
}

/// A decode worker that dies mid-stream ends that client's stream with a well-formed SSE error
/// event (never a replay: the first byte is out); other requests are not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_dying_mid_stream_ends_only_that_stream() {
    let h =
        harness("vllm", vec![prefill("vllm"), slow_sim_role("vllm", cortex_sim::Role::Decode)], &[]).await;
    h.sims[1].die_mid_stream(3, 1);
    let body = |p: &str| json!({"model": MODEL, "prompt": p, "max_tokens": 12, "stream": true});
    let (first, second) = (body("first stream"), body("second stream"));
    let (a, b) = tokio::join!(h.post("/v1/completions", &first), async {
        // The second stream starts once the first is decoding (the fault hits the first).
        h.wait("first stream decoding", || h.sims[1].in_flight(0).unwrap_or(0) > 0).await;
        h.post("/v1/completions", &second).await
    });
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.header("x-cortex-pd"), "disaggregated");
    assert!(a.body.contains("data: {\"error\""), "{}", a.body);
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    assert_eq!(b.status, StatusCode::OK);
    assert!(!b.body.contains("\"error\""), "{}", b.body);
    assert!(b.body.ends_with("data: [DONE]\n\n"), "{}", b.body);
    h.shutdown().await;
}

/// A client that leaves before its first byte cancels both legs: the workers see their
/// connections close (their abort counters move), and nothing is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_cancels_both_legs() {
    use std::io::Write;
    let h =
        harness("sglang", vec![slow_sim_role("sglang", cortex_sim::Role::Prefill), decode("sglang")], &[])
            .await;
    h.sims[0].stall();
    let body = json!({"model": MODEL, "prompt": "a client that leaves", "max_tokens": 4}).to_string();
    let mut conn = std::net::TcpStream::connect(h.addr()).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    h.wait("the prefill leg is queued", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
    h.wait("the decode leg waits for its room", || h.sims[1].in_flight_http() > 0).await;
    drop(conn);
    h.wait("the prefill worker saw its leg cancelled", || h.sims[0].client_gone() >= 1).await;
    h.wait("the decode worker saw its leg cancelled", || h.sims[1].client_gone() >= 1).await;
    h.sims[0].resume();
    assert_eq!(legs(&h, &["w0", "w1"]), (0, 0), "neither leg completed");
    h.shutdown().await;
}

/// The decode leg of an SGLang pair fails at once: the prefill leg, which would otherwise wait
/// for its decode side until the bootstrap timeout, is cancelled at once, and another pair
/// serves the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_leg_is_not_left_waiting_for_a_decode_that_failed() {
    let h = harness(
        "sglang",
        vec![slow_sim_role("sglang", cortex_sim::Role::Prefill), decode("sglang"), decode("sglang")],
        &[("scheduler", "{decode_policy: round_robin}")],
    )
    .await;
    h.sims[1].fail_next(503, 1);
    // Round robin over the decode workers: one of two requests meets the failing one.
    for i in 0..2 {
        let r = h
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("a pair {i}"), "max_tokens": 3}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.header("x-cortex-pd"), "disaggregated");
        assert_eq!(r.header("x-cortex-assigned-worker"), "w2", "the failing decode worker served nothing");
    }
    // The dispatch whose decode leg failed: its prefill leg was cancelled, not left waiting.
    h.wait("the abandoned prefill leg was cancelled", || h.sims[0].client_gone() >= 1).await;
    h.shutdown().await;
}

/// Decode workers are not judged by what they cannot report: after traffic, no PD worker is
/// marked misaligned (a vLLM decode worker counts pulled tokens as cached; an SGLang decode
/// worker without a radix cache publishes nothing).
async fn pd_workers_stay_aligned(engine: &str) {
    let h = harness(engine, vec![prefill(engine), decode(engine)], &[]).await;
    let body = json!({"model": MODEL, "max_tokens": 3, "messages": [{"role": "system", "content": long_prompt("aligned")}, {"role": "user", "content": "Go."}]});
    for _ in 0..8 {
        let r = h.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    h.wait_hit_on(&body, "w0").await;
    for _ in 0..4 {
        h.post("/v1/chat/completions", &body).await;
    }
    for w in ["w0", "w1"] {
        assert!(
            !matches!(h.verdict(w), cortex_proxy::alignment::Verdict::Misaligned(_)),
            "{w}: {:?}",
            h.verdict(w)
        );
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_workers_stay_aligned_sglang() {
    pd_workers_stay_aligned("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_workers_stay_aligned_vllm() {
    pd_workers_stay_aligned("vllm").await;
}

/// A rank pinned by the client cannot be honoured on a disaggregated model: refused, clearly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_rank_is_refused_for_a_disaggregated_model() {
    let h = harness("sglang", vec![prefill("sglang"), decode("sglang")], &[]).await;
    let r = h.post("/generate", &json!({"text": "x", "routed_dp_rank": 0})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(r.body.contains("disaggregated"), "{}", r.body);
    h.shutdown().await;
}

/// Cache-aware decode choice (vLLM: a decode worker pulls only the blocks it lacks, and
/// publishes the ones it holds): a long prompt repeated goes to the decode worker that holds it,
/// which pulls less the second time; with `pd.decode_only_max_uncached`, a decode worker that
/// lacks at most that many tokens serves the request alone (`x-cortex-pd: decode_only`, no
/// prefill leg), while a request it lacks more of is disaggregated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_is_chosen_by_cache_and_skipped_prefill_when_little_is_missing() {
    let h = harness(
        "vllm",
        vec![prefill("vllm"), prefill("vllm"), decode("vllm"), decode("vllm")],
        &[("pd", "{decode_only_max_uncached: 64}")],
    )
    .await;
    let chat = |system: &str, user: &str| json!({"model": MODEL, "max_tokens": 3, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    let pulled = |h: &Harness, w: &str| h.worker(w).pd_counters(0).unwrap().pulled_tokens;
    // A long system prompt, first: nobody holds it, so it is disaggregated and the decode
    // worker pulls the whole prompt.
    let first = chat(&long_prompt("decode choice"), "First question?");
    let r = h.post("/v1/chat/completions", &first).await;
    assert_disaggregated(&r, "first", &["w0", "w1"], &["w2", "w3"]);
    let d = r.header("x-cortex-assigned-worker").to_owned();
    let first_pull = pulled(&h, &d);
    assert!(first_pull > 300, "the first decode leg pulled the whole prompt ({first_pull})");
    // The next turn shares the long prefix and adds a user message of more than 64 tokens: once
    // the decode worker's announced blocks are in the ledger (and its holder READY), it is the
    // decode choice, and it pulls only the new part.
    let second =
        chat(&long_prompt("decode choice"), &"Now a much longer second question, please. ".repeat(12));
    let dry = wait_dry(&h, &second, |dry| {
        dry["pd"]["decode"]["candidates"][0]["worker"] == d.as_str()
            && dry["pd"]["decode"]["candidates"][0]["matched_tokens"].as_u64() > Some(0)
    })
    .await;
    assert_eq!(dry["pd"]["decode_only"]["chosen"], false, "{dry}");
    let r = h.post("/v1/chat/completions", &second).await;
    assert_disaggregated(&r, "second", &["w0", "w1"], &[d.as_str()]);
    let second_pull = pulled(&h, &d) - first_pull;
    assert!(0 < second_pull && second_pull < first_pull / 2, "pulled {second_pull} after {first_pull}");
    // The same request again: the decode worker lacks at most a block: it serves alone.
    let prefill_legs = legs(&h, &["w0", "w1"]).0;
    // Once the second turn's blocks are in the ledger, the dry run says the decode worker alone.
    let dry = wait_dry(&h, &second, |dry| dry["pd"]["decode_only"]["chosen"] == true).await;
    assert_eq!(dry["pd"]["decode"]["candidates"][0]["worker"], d.as_str(), "{dry}");
    let r = h.post("/v1/chat/completions", &second).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.header("x-cortex-pd"), "decode_only", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-assigned-worker"), d);
    assert_eq!(r.header("x-cortex-prefill-worker"), "");
    assert!(r.header("x-cortex-cache-hit-tokens").parse::<u64>().unwrap() > 0);
    assert_eq!(legs(&h, &["w0", "w1"]).0, prefill_legs, "no prefill leg");
    h.shutdown().await;
}

/// When every leg's worker is rate limited, the client gets the last refusing worker's own
/// `Retry-After` (the simulator says 2 s), as a regular request does, not the gateway's 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_pair_passes_the_worker_s_retry_after_on() {
    for engine in ["vllm", "sglang"] {
        let h = harness(engine, vec![prefill(engine), decode(engine)], &[]).await;
        for s in &h.sims {
            s.fail_next(429, 100);
        }
        let r =
            h.post("/v1/completions", &json!({"model": MODEL, "prompt": "limited", "max_tokens": 3})).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{engine}: {}", r.body);
        assert_eq!(r.header("retry-after"), "2", "{engine}: {:?}", r.headers);
        // The workers are cooled down for what they asked (2 s), not the configured 5 s: a
        // client that obeys the Retry-After is served.
        for s in &h.sims {
            s.fail_next(429, 0);
        }
        tokio::time::sleep(std::time::Duration::from_millis(2_300)).await;
        let again = json!({"model": MODEL, "prompt": "again", "max_tokens": 3});
        let r = h.post("/v1/completions", &again).await;
        assert_eq!(r.status, StatusCode::OK, "{engine}: {}", r.body);
        h.shutdown().await;
    }
}

/// An SGLang decode worker without `--disaggregation-decode-enable-radix-cache` keeps no prefix
/// and announces nothing: the requests it decodes owe no KV event, so its ledger stays READY
/// past `silence_timeout` (500 ms here). A probe found every such decode worker STALE a
/// timeout after its first request (out of routing with `unready_holders: excluded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_decode_worker_without_its_radix_cache_owes_no_event() {
    let h = harness("sglang", vec![prefill("sglang"), decode("sglang")], &[]).await;
    for i in 0..3 {
        let body = json!({"model": MODEL, "prompt": crate::common::long_prompt(&format!("decoded {i}")), "max_tokens": 3});
        let r = h.post("/v1/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{:?}", r.headers);
    }
    let until = tokio::time::Instant::now() + std::time::Duration::from_millis(1_500);
    while tokio::time::Instant::now() < until {
        for w in ["w0", "w1"] {
            let state = h.gw.ledger_state(h.holder(w));
            assert_eq!(
                state,
                Some(cortex_radix::Readiness::Ready),
                "{w}: {:?}",
                h.gw.ingest.status(h.holder(w))
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    h.shutdown().await;
}

/// An SGLang pair's prefill worker whose KV events are all lost is caught: its prefill leg may
/// still be running when the decode worker answers (the commit does not wait for it), and the
/// decode worker's first token shows the prompt was computed, so the prefill worker owes its
/// events from then. A probe found it READY through 20 streaming requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_worker_whose_events_are_lost_is_caught() {
    // A prefill worker slower to end its answer than the decode worker is to answer.
    let h =
        harness("sglang", vec![slow_sim_role("sglang", cortex_sim::Role::Prefill), decode("sglang")], &[])
            .await;
    // Lost on the wire, and its replay does not answer (else the silence's probe repairs them).
    h.sims[0].drop_next_batches(0, 1_000).unwrap();
    h.sims[0].set_replay(0, false).unwrap();
    for i in 0..3 {
        let body = json!({"model": MODEL, "prompt": long_prompt(&format!("prefilled {i}")), "max_tokens": 1, "stream": true});
        let r = h.post("/v1/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.header("x-cortex-prefill-worker"), "w0", "{:?}", r.headers);
    }
    let prefill_holder = h.holder("w0");
    h.wait("the prefill worker turns STALE", || {
        h.gw.ledger_state(prefill_holder) == Some(cortex_radix::Readiness::Stale)
    })
    .await;
    h.shutdown().await;
}

/// A disaggregated request whose decode worker is removed while it runs is answered naming
/// that worker (and its prefill worker), as they were when it was dispatched: not `""` (a
/// probe's finding; the access log and the hit counters read the same names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_answer_names_its_workers_after_one_is_removed() {
    let h = harness("vllm", vec![prefill("vllm"), decode("vllm")], &[]).await;
    h.sims[1].stall();
    let running = tokio::spawn({
        let caller = h.caller();
        let body = json!({"model": MODEL, "prompt": long_prompt("removed while decoding"), "max_tokens": 3});
        async move { caller.post("/v1/completions", &body).await }
    });
    h.wait("the decode leg reached its worker", || h.sims[1].in_flight(0).unwrap_or(0) > 0).await;
    let r = h.send("DELETE", "/admin/workers/w1", Bytes::new()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    h.sims[1].resume();
    let r = running.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-assigned-worker"), "w1", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-prefill-worker"), "w0", "{:?}", r.headers);
    h.shutdown().await;
}

/// A vLLM prefill worker that answers without `kv_transfer_params` (here a regular worker,
/// without a KV connector, registered as a prefill worker) leaves the decode worker to compute
/// the prompt: the answer names no prefill worker, and its hit is the decode worker's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_prefill_without_transfer_params_is_not_named_as_the_prefill_worker() {
    let sims: Vec<cortex_sim::SimWorker> =
        [sim("vllm"), decode("vllm")].into_iter().map(|c| cortex_sim::SimWorker::start(c).unwrap()).collect();
    let workers =
        vec![(sims[0].base_url(), cortex_sim::Role::Prefill), (sims[1].base_url(), cortex_sim::Role::Decode)];
    let h = crate::common::gateway_in_front("vllm", sims, &workers, &[], |_| {}, None).await;
    let r = h
        .post("/v1/completions", &json!({"model": MODEL, "prompt": "no connector here", "max_tokens": 3}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.header("x-cortex-pd"), "fallback_single", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-assigned-worker"), "w1");
    assert_eq!(r.header("x-cortex-prefill-worker"), "", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-prefill-rank"), "", "{:?}", r.headers);
    h.shutdown().await;
}

/// A vLLM prefill worker whose KV is gone before any decode worker can pull it (its lease
/// expires at once): every pair fails in the transfer, and the decode worker's answer ("Internal
/// server error") cannot say whose fault it was. Both ends are blamed, so the prefill worker
/// cools down too, and the requests are served by a decode worker prefilling locally instead of
/// every decode worker cooling down in turn (before: 502s and 503s at a few requests a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_whose_transfers_fail_does_not_take_the_decode_workers_down() {
    let mut leaky = slow_sim_role("vllm", cortex_sim::Role::Prefill);
    leaky.pd.kv_lease = std::time::Duration::from_millis(1);
    let d = || slow_sim_role("vllm", cortex_sim::Role::Decode);
    let h = harness("vllm", vec![leaky, d(), d()], &[]).await;
    for i in 0..8 {
        let r = h
            .post(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("lease {i}"), "max_tokens": 3}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "request {i}: {}", r.body);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let failed: u64 = h.sims.iter().map(cortex_sim::SimWorker::pd_transfer_failures).sum();
    assert!(failed > 0, "no transfer failed: the test did not test anything");
    h.shutdown().await;
}
