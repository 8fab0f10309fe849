//! Fault injection, end to end: the gateway (real HTTP, real ZeroMQ ingest) in front of simulated
//! workers on loopback, with small probe and ingest timeouts so that each fault plays out in a
//! second or two.
//!
//! Each test states the invariant it holds in its doc comment. The ones every test checks on its
//! way: no over-predicted hit (a response's `x-cortex-cache-hit-tokens`, capped as the engine
//! counts, never exceeds the cached tokens the worker reports), and no request lost before its
//! first byte while another worker can serve it. Waits poll observable state under generous
//! deadlines (`common::WAIT`); nothing asserts how long anything took.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)] // a test fails loudly

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Harness, Reply, chat, harness, harness_with, long_prompt, metric, prometheus};
use cortex_ingest::Reason;
use cortex_radix::Readiness;
use cortex_sched::BreakerState;
use http::StatusCode;
use serde_json::Value;

/// Probes every 100 ms, a worker out after 2 failed probes and back after 1 good one; a replay
/// that has not finished in 500 ms is abandoned.
const FAST: [(&str, &str); 3] = [
    (
        "probes",
        "{health_interval: 100ms, load_interval: 100ms, timeout: 1s, failures_to_remove: 2, successes_to_restore: 1}",
    ),
    ("ingest", "{silence_timeout: 2s, replay_timeout: 500ms}"),
    ("alignment", "{settle: 50ms, min_samples: 3, window: 50, tolerance: 0.2}"),
];

/// Block size of the harness's model.
const BLOCK: u64 = 16;

fn sections<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut all = FAST.to_vec();
    all.extend_from_slice(extra);
    all
}

/// The invariant every served response holds: the hit the gateway claimed (capped as the engine
/// counts: whole blocks, never the last token) is at most the hit the worker reports.
fn assert_not_over_predicted(r: &Reply) {
    let v = r.json();
    let usage = if v["usage"].is_object() { &v["usage"] } else { &v["meta_info"] };
    let (Some(prompt), Some(cached)) = (
        usage["prompt_tokens"].as_u64(),
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().or_else(|| usage["cached_tokens"].as_u64()),
    ) else {
        return;
    };
    let claimed: u64 = r.header("x-cortex-cache-hit-tokens").parse().unwrap_or(0);
    let capped = claimed.min(prompt.saturating_sub(1) / BLOCK * BLOCK);
    assert!(
        capped <= cached,
        "over-predicted hit: claimed {claimed} (capped {capped}), worker cached {cached}"
    );
}

/// Sends `body`, which must succeed, and checks it was not over-predicted.
async fn served(h: &Harness, body: &Value) -> Reply {
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_not_over_predicted(&r);
    r
}

/// Invariant (issue 19, row 6): a worker that failed under load and opened its circuit breaker
/// gets traffic again as soon as it is rediscovered healthy — its breaker and cooldown judged the
/// instance that died. The restarted engine's empty cache is never credited with the old
/// instance's blocks, and it rejoins within a few probe periods with its ledger READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_on_its_port_rejoins_with_a_closed_breaker_and_an_empty_ledger() {
    let sched = "{breaker_failures: 1, breaker_open_for: 600s}";
    let mut h =
        harness("vllm", vec![common::sim("vllm"), common::sim("vllm")], &sections(&[("scheduler", sched)]))
            .await;
    let body = chat(&long_prompt("restart"), false);
    let holder = served(&h, &body).await.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    let worker_id = h.holder(&holder).worker;
    let state = |h: &Harness| {
        let c = h.gw.gateway.control();
        let snap = c.cluster().load();
        snap.worker(worker_id).map(|e| {
            let now = c.clock().now();
            (e.state().breaker(now), e.state().cooldown(now).is_some())
        })
    };
    // The worker fails under load before it dies: the prompt's hit sends the request to it, its
    // 500 opens the breaker (one fault), and the request is served elsewhere.
    h.worker(&holder).fail_next(500, 1);
    let r = served(&h, &body).await;
    assert_ne!(r.header("x-cortex-assigned-worker"), holder);
    assert_eq!(state(&h).map(|s| s.0), Some(BreakerState::Open));
    h.kill(&holder);
    h.wait("the dead worker left the pool", || h.live_workers() == 1).await;
    h.restart(&holder);
    h.wait("the restarted worker rejoined", || h.live_workers() == 2).await;
    let holder_id = h.holder(&holder);
    h.wait("its ledger is READY", || h.gw.ledger_state(holder_id) == Some(Readiness::Ready)).await;
    assert_eq!(state(&h), Some((BreakerState::Closed, false)), "breaker and cooldown of the dead instance");
    // Its cache is empty: the prompt is not credited to it.
    assert_eq!(h.hit_on(&body, &holder).await, 0);
    served(&h, &body).await;
    // It takes traffic: fresh prompts are load-balanced onto it.
    let mut i = 0;
    loop {
        let r = served(&h, &chat(&format!("after the restart {i}"), false)).await;
        if r.header("x-cortex-assigned-worker") == holder {
            break;
        }
        i += 1;
        assert!(i < 50, "the restarted worker got no traffic");
    }
    h.shutdown().await;
}

/// Invariant (issue 19, row 7): a ledger rebuild is not a misalignment. After a publisher
/// restart (sequence back to 0, the engine keeping its cache) the ledger is cleared; prompts the
/// engine still has are served as hits the rebuilt ledger does not know, and the worker never
/// announces them again. The alignment checks must not count those against the worker: it stays
/// aligned, and exact routing works again for what it publishes afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restart_rebuilds_the_ledger_without_a_misalignment() {
    let h = harness_with("vllm", vec![common::sim("vllm")], &sections(&[]), |_| {}, Some(prometheus())).await;
    let holder = h.holder("w0");
    let checks = |text: &str| metric(text, "cortex_alignment_checks_total", &[("worker", "w0")]);
    let old: Vec<Value> =
        (0..3).map(|i| chat(&long_prompt(&format!("before the restart {i}")), false)).collect();
    for body in &old {
        served(&h, body).await;
        h.wait_hit_on(body, "w0").await;
        served(&h, body).await;
    }
    h.wait("aligned", || h.verdict("w0") == cortex_proxy::alignment::Verdict::Aligned).await;
    h.worker("w0").restart_publisher(0).unwrap();
    served(&h, &chat(&long_prompt("the first batch after the restart"), false)).await;
    h.wait("the restart was seen", || h.gw.ingest.status(holder).unwrap().transitions(Reason::Restart) >= 1)
        .await;
    h.wait("READY", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
    // The engine still has the old prompts; the rebuilt ledger does not.
    for body in &old {
        assert_eq!(h.hit_on(body, "w0").await, 0);
        for _ in 0..3 {
            let r = served(&h, body).await;
            assert!(common::cached_tokens(&r) > 0, "the engine kept its cache: {}", r.body);
        }
    }
    // Fresh prompts after them: once their checks are in, the old prompts' are too (they were
    // armed earlier, with the same settle delay).
    let text = h.send("GET", "/metrics", Bytes::new()).await.body;
    let before = checks(&text);
    for i in 0..4 {
        served(&h, &chat(&long_prompt(&format!("after the restart {i}")), false)).await;
    }
    let deadline = tokio::time::Instant::now() + common::WAIT;
    while checks(&h.send("GET", "/metrics", Bytes::new()).await.body) < before + 4.0 {
        assert!(tokio::time::Instant::now() < deadline, "the fresh prompts' checks never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        h.verdict("w0"),
        cortex_proxy::alignment::Verdict::Aligned,
        "a rebuild counted as a misalignment"
    );
    // Exact routing works for what the worker publishes after the rebuild.
    let fresh = chat(&long_prompt("after the restart 0"), false);
    h.wait_hit_on(&fresh, "w0").await;
    let r = served(&h, &fresh).await;
    assert_eq!(r.header("x-cortex-match-mode"), "exact_kv_events");
    h.shutdown().await;
}

/// Invariant (issue 19, row 5): a worker whose health flaps leaves and rejoins each time within a
/// few probe periods, no request fails meanwhile (the other worker serves), and every rejoin's
/// event-plane transition (its replay from 0) reaches `cortex_event_transitions_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_worker_rejoins_each_time_and_every_transition_is_counted() {
    let h = harness_with(
        "sglang",
        vec![common::sim("sglang"), common::sim("sglang")],
        &sections(&[]),
        |_| {},
        Some(prometheus()),
    )
    .await;
    let holder = h.holder("w0");
    let rejoins = |text: &str| {
        ["replay_ok", "cold_start"]
            .iter()
            .map(|r| {
                metric(
                    text,
                    "cortex_event_transitions_total",
                    &[("worker", "w0"), ("rank", "0"), ("reason", r)],
                )
            })
            .sum::<f64>()
    };
    h.wait("READY", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
    let mut counted = rejoins(&h.send("GET", "/metrics", Bytes::new()).await.body);
    for flap in 0..3 {
        h.worker("w0").set_healthy(false);
        h.wait("w0 left the pool", || h.live_workers() == 1).await;
        served(&h, &chat(&format!("while w0 is away {flap}"), false)).await;
        h.worker("w0").set_healthy(true);
        h.wait("w0 is back", || h.live_workers() == 2).await;
        h.wait("its ledger is READY", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
        let now = rejoins(&h.send("GET", "/metrics", Bytes::new()).await.body);
        assert!(
            now > counted,
            "flap {flap}: the rejoin's transition was not counted ({now} after {counted})"
        );
        counted = now;
    }
    h.shutdown().await;
}
