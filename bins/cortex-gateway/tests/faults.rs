//! Fault injection, end to end: the gateway (real HTTP, real ZeroMQ ingest) in front of simulated
//! workers in processes of their own on loopback ([`process`]), with small probe and ingest
//! timeouts so that each fault plays out in a second or two. Workers are killed with `SIGKILL`
//! mid-stream and while idle, restarted on the same ports, made to lose event batches with and
//! without replay, to restart their publisher, to flap their health (faults go in through each
//! worker's `POST /sim/fault`); the gateway is overloaded and sent SIGTERM with streams in flight.
//!
//! Each test states the invariant it holds in its doc comment. The ones every test checks on its
//! way: no over-predicted hit (a response's `x-cortex-cache-hit-tokens`, capped as the engine
//! counts, never exceeds the cached tokens the worker reports), and no request lost before its
//! first byte while another worker can serve it. Waits poll observable state under generous
//! deadlines (`common::WAIT`); nothing asserts how long anything took.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)] // a test fails loudly

mod common;
mod process;

use std::time::Duration;

use bytes::Bytes;
use common::{Caller, Harness, MODEL, Reply, chat, long_prompt, metric, prometheus};
use cortex_ingest::Reason;
use cortex_radix::Readiness;
use cortex_sched::BreakerState;
use cortex_sim::Fault;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use process::{SimProcess, harness};
use serde_json::{Value, json};

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

/// The harness of this suite: worker processes.
type Procs = Harness<SimProcess>;

/// A worker's circuit breaker, and whether it is cooling down, now.
fn failure_state(h: &Procs, worker: cortex_hash::kv::WorkerId) -> Option<(BreakerState, bool)> {
    let c = h.gw.gateway.control();
    let snap = c.cluster().load();
    snap.worker(worker).map(|e| {
        let now = c.clock().now();
        (e.state().breaker(now), e.state().cooldown(now).is_some())
    })
}

/// Sends fresh prompts (`prefix 0`, `prefix 1`, …) until one is served by `holder`, at most 50.
async fn takes_fresh_prompts(h: &Procs, holder: &str, prefix: &str) {
    for i in 0..50 {
        let r = served(h, &chat(&format!("{prefix} {i}"), false)).await;
        if r.header("x-cortex-assigned-worker") == holder {
            return;
        }
    }
    panic!("the restarted worker got no traffic");
}

/// Sends `body`, which must succeed, and checks it was not over-predicted.
async fn served(h: &Procs, body: &Value) -> Reply {
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_not_over_predicted(&r);
    r
}

/// The response head of a streamed completion (the body left to read).
async fn open_stream(
    c: &Caller,
    addr: std::net::SocketAddr,
    prompt: &str,
) -> http::Response<hyper::body::Incoming> {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": true});
    let req = Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    c.client().request(req).await.unwrap()
}

/// The rest of a response's body; a body that fails (its connection cut) ends with what was read
/// and `<body error: …>`, which no assertion on a whole stream accepts.
async fn rest(resp: http::Response<hyper::body::Incoming>) -> String {
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => text.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
            Err(e) => {
                text.extend_from_slice(format!("<body error: {e}>").as_bytes());
                break;
            }
        }
    }
    String::from_utf8_lossy(&text).into_owned()
}

/// Invariant: a worker killed mid-stream breaks only its own streams — each ends with an SSE
/// error event and `[DONE]` — while the other worker's stream finishes untouched, no request
/// sent afterwards fails (those that pick the dead worker are retried before their first byte),
/// and the dead worker leaves the live pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_breaks_only_its_own_streams() {
    let mut h =
        harness("vllm", vec![process::slow_sim("vllm"), process::slow_sim("vllm")], &sections(&[]), None)
            .await;
    let c = h.caller();
    // Streams until one runs on the other worker: the next usually goes to the idle one (the
    // first is booked), but the cost model may send a few more to the same worker first.
    let worker = |r: &http::Response<_>| r.headers()["x-cortex-assigned-worker"].to_str().unwrap().to_owned();
    let first = open_stream(&c, h.addr(), "stream 0").await;
    let victim = worker(&first);
    let mut on_victim = vec![first];
    let other = loop {
        let s = open_stream(&c, h.addr(), &format!("stream {}", on_victim.len())).await;
        if worker(&s) != victim {
            break s;
        }
        on_victim.push(s);
        assert!(on_victim.len() < 8, "every stream went to {victim}: {}", h.debug_workers().await);
    };
    h.kill(&victim);
    for s in on_victim {
        let broken = rest(s).await;
        assert!(broken.contains("data: {\"error\""), "{broken}");
        assert!(broken.ends_with("data: [DONE]\n\n"), "{broken}");
    }
    for i in 0..10 {
        served(&h, &chat(&format!("after the kill {i}"), false)).await;
    }
    let whole = rest(other).await;
    assert!(!whole.contains("\"error\""), "{whole}");
    assert!(whole.ends_with("data: [DONE]\n\n"), "{whole}");
    h.wait("the dead worker left the pool", || h.live_workers() == 1).await;
    h.shutdown().await;
}

/// Invariant: a worker killed while idle costs no request — every request sent from the kill on
/// succeeds, before and after the worker is found dead — and its ledger is pruned once it left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_idle_loses_no_request() {
    let mut h =
        harness("sglang", vec![process::sim("sglang"), process::sim("sglang")], &sections(&[]), None).await;
    let body = chat(&long_prompt("idle kill"), false);
    let holder = served(&h, &body).await.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    let id = h.holder(&holder);
    h.kill(&holder);
    // The cached prompt points at the dead worker first: it is retried elsewhere.
    let r = served(&h, &body).await;
    assert_ne!(r.header("x-cortex-assigned-worker"), holder);
    let mut i = 0;
    while h.live_workers() == 2 {
        served(&h, &chat(&format!("while it is found dead {i}"), false)).await;
        i += 1;
        assert!(i < 1000, "the dead worker never left the pool");
    }
    h.wait("its ledger was pruned", || h.gw.ledger_state(id).is_none()).await;
    served(&h, &body).await;
    h.shutdown().await;
}

/// Invariant (issue 19, row 6): a worker that failed under load and opened its circuit breaker
/// gets traffic again as soon as it is rediscovered healthy — its breaker and cooldown judged the
/// instance that died. The restarted engine's empty cache is never credited with the old
/// instance's blocks, and it rejoins within a few probe periods with its ledger READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_on_its_port_rejoins_with_a_closed_breaker_and_an_empty_ledger() {
    let sched = "{breaker_failures: 1, breaker_open_for: 600s}";
    let mut h = harness(
        "vllm",
        vec![process::sim("vllm"), process::sim("vllm")],
        &sections(&[("scheduler", sched)]),
        None,
    )
    .await;
    let body = chat(&long_prompt("restart"), false);
    let holder = served(&h, &body).await.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    let worker_id = h.holder(&holder).worker;
    // The worker fails under load before it dies: the prompt's hit sends the request to it, its
    // 500 opens the breaker (one fault), and the request is served elsewhere.
    h.inject(&holder, &Fault::FailNext { status: 500, count: 1 }).await;
    let r = served(&h, &body).await;
    assert_ne!(r.header("x-cortex-assigned-worker"), holder);
    assert_eq!(failure_state(&h, worker_id).map(|s| s.0), Some(BreakerState::Open));
    h.kill(&holder);
    h.wait("the dead worker left the pool", || h.live_workers() == 1).await;
    h.restart(&holder);
    h.wait("the restarted worker rejoined", || h.live_workers() == 2).await;
    let holder_id = h.holder(&holder);
    h.wait("its ledger is READY", || h.gw.ledger_state(holder_id) == Some(Readiness::Ready)).await;
    assert_eq!(
        failure_state(&h, worker_id),
        Some((BreakerState::Closed, false)),
        "breaker and cooldown of the dead instance"
    );
    // Its cache is empty: the prompt is not credited to it.
    assert_eq!(h.hit_on(&body, &holder).await, 0);
    served(&h, &body).await;
    // It takes traffic: fresh prompts are load-balanced onto it.
    takes_fresh_prompts(&h, &holder, "after the restart").await;
    h.shutdown().await;
}

/// A worker killed and restarted on its port faster than its health probes notice (here they run
/// every 30 s) kept the breaker its predecessor opened for `breaker_open_for`, taking no traffic.
/// A probe or load poll that finds its address refusing connections takes it out at once; it is
/// then probed at the load polls' pace and rediscovered when it answers: breaker and cooldown
/// reset, ledger rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_between_two_health_probes_is_rediscovered() {
    let sched = "{breaker_failures: 1, breaker_open_for: 600s}";
    let probes = "{health_interval: 30s, load_interval: 100ms, timeout: 1s, failures_to_remove: 3, successes_to_restore: 1}";
    let mut h = harness(
        "vllm",
        vec![process::sim("vllm"), process::sim("vllm")],
        &sections(&[("scheduler", sched), ("probes", probes)]),
        None,
    )
    .await;
    let body = chat(&long_prompt("fast restart"), false);
    let holder = served(&h, &body).await.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    let worker_id = h.holder(&holder).worker;
    h.inject(&holder, &Fault::FailNext { status: 500, count: 1 }).await;
    served(&h, &body).await;
    assert_eq!(failure_state(&h, worker_id).map(|s| s.0), Some(BreakerState::Open));
    h.kill(&holder);
    // A load poll finds the address refusing: the worker leaves at once (no health probe fails
    // in this time).
    h.wait("the killed worker left at once", || h.live_workers() == 1).await;
    h.restart(&holder);
    h.wait("the breaker of the killed instance reset", || {
        failure_state(&h, worker_id) == Some((BreakerState::Closed, false))
    })
    .await;
    let holder_id = h.holder(&holder);
    h.wait("its ledger is READY", || h.gw.ledger_state(holder_id) == Some(Readiness::Ready)).await;
    assert_eq!(h.hit_on(&body, &holder).await, 0, "the new process's cache is empty");
    takes_fresh_prompts(&h, &holder, "after the fast restart").await;
    h.shutdown().await;
}

/// Invariant: an event gap never makes the ledger over-count. With replay the missing batches
/// are fetched and the holder is READY with the gap's blocks; without replay (here: replay off,
/// so the request times out) the holder is cleared and READY again, under-counting only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_gaps_are_replayed_or_cleared_never_over_counted() {
    let h = harness("vllm", vec![process::sim("vllm")], &sections(&[]), None).await;
    let holder = h.holder("w0");
    let status = |h: &Procs| h.gw.ingest.status(holder).unwrap();
    let first = chat(&long_prompt("gap one"), false);
    served(&h, &first).await;
    h.wait_hit_on(&first, "w0").await;
    // A lost batch, replayed: the prompt it stored is known.
    h.inject("w0", &Fault::DropBatches { rank: 0, count: 1 }).await;
    let lost = chat(&long_prompt("gap lost, replayed"), false);
    served(&h, &lost).await;
    served(&h, &chat(&long_prompt("gap next"), false)).await;
    h.wait("the gap was replayed", || status(&h).transitions(Reason::ReplayOk) >= 2).await;
    h.wait("READY", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
    h.wait_hit_on(&lost, "w0").await;
    served(&h, &lost).await;
    // Replay off: the gap cannot be filled, the holder is cleared and rebuilt.
    h.inject("w0", &Fault::Replay { rank: 0, enabled: false }).await;
    h.inject("w0", &Fault::DropBatches { rank: 0, count: 1 }).await;
    served(&h, &chat(&long_prompt("gap lost for good"), false)).await;
    let after = chat(&long_prompt("gap after"), false);
    served(&h, &after).await;
    h.wait("the unreplayable gap was cleared", || status(&h).transitions(Reason::ReplayTimeout) >= 1).await;
    h.wait("READY again", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
    // Whatever the ledger credits now, the worker has: every prompt, sent again, holds.
    for body in [&first, &lost, &after] {
        served(&h, body).await;
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
    let h = harness("vllm", vec![process::sim("vllm")], &sections(&[]), Some(prometheus())).await;
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
    h.inject("w0", &Fault::RestartPublisher { rank: 0 }).await;
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
    let h = harness(
        "sglang",
        vec![process::sim("sglang"), process::sim("sglang")],
        &sections(&[]),
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
        h.inject("w0", &Fault::Health { healthy: false }).await;
        h.wait("w0 left the pool", || h.live_workers() == 1).await;
        served(&h, &chat(&format!("while w0 is away {flap}"), false)).await;
        h.inject("w0", &Fault::Health { healthy: true }).await;
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

/// Invariant: overload is refused with the gateway's own 429 (queue full) or 503 (queue timeout)
/// and nothing else; admitted requests succeed; and the gateway serves normally once the burst
/// is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_429_or_503_and_passes() {
    let limits = "{max_concurrent: 2, max_queue: 2, queue_timeout: 300ms}";
    let h = harness("vllm", vec![process::slow_sim("vllm")], &sections(&[("limits", limits)]), None).await;
    let c = h.caller();
    let burst: Vec<_> = (0..12)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                c.post(
                    "/v1/completions",
                    &json!({"model": MODEL, "prompt": format!("burst {i}"), "max_tokens": 10}),
                )
                .await
            })
        })
        .collect();
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    for t in burst {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            200 => {}
            429 => assert_eq!(r.error_code(), "gateway_overloaded", "{}", r.body),
            503 => assert_eq!(r.error_code(), "queue_timeout", "{}", r.body),
            s => panic!("unexpected {s}: {}", r.body),
        }
        *by_status.entry(r.status.as_u16()).or_default() += 1;
    }
    assert!(by_status.get(&200).copied().unwrap_or(0) >= 2, "{by_status:?}");
    assert!(by_status.get(&429).copied().unwrap_or(0) >= 1, "{by_status:?}");
    let r = h
        .post("/v1/completions", &json!({"model": MODEL, "prompt": "after the burst", "max_tokens": 2}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    h.shutdown().await;
}

/// The gateway binary in front of `sim` with a 30 s shutdown grace, serving and ready: the
/// process, its address, its configuration file and a client.
async fn gateway_process(
    sim: &SimProcess,
    name: &str,
) -> (
    Killed,
    std::net::SocketAddr,
    std::path::PathBuf,
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
) {
    use std::io::BufRead;
    let qwen = cortex_gateway::demo::repo_root().join("golden/models/qwen3");
    let yaml = format!(
        "listen: '127.0.0.1:0'\nshutdown_grace: 30s\nmodels:\n  - {{name: {MODEL}, engine: vllm, tokenizer: '{}', tokenizer_config: '{}', block_size: 16}}\nworkers:\n  - {{name: w0, url: '{}', engine: vllm, model: {MODEL}}}\n",
        qwen.join("tokenizer.json").display(),
        qwen.join("tokenizer_config.json").display(),
        sim.base_url()
    );
    let path = std::env::temp_dir().join(format!("cortex-faults-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    let mut child = Killed(
        std::process::Command::new(env!("CARGO_BIN_EXE_cortex-gateway"))
            .args(["--config", path.to_str().unwrap(), "--log", "info"])
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The bound address, from the log line that says the gateway serves.
    let stderr = child.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(addr) = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next()) {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr: std::net::SocketAddr = rx.recv_timeout(common::WAIT).unwrap().parse().unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        let req = Request::get(format!("http://{addr}/health/ready")).body(Full::new(Bytes::new())).unwrap();
        if client.request(req).await.is_ok_and(|r| r.status() == StatusCode::OK) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the gateway never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (child, addr, path, client)
}

/// Sends `signal` to `child`.
fn signal(child: &Killed, signal: &str) {
    let status =
        std::process::Command::new("kill").args([signal, &child.0.id().to_string()]).status().unwrap();
    assert!(status.success());
}

/// Waits for `child` to exit (at most `within`): its status.
async fn exit_of(child: &mut Killed, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "the gateway did not exit within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A streamed completion of at most `max_tokens` through `addr`: its answer's head.
async fn stream(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
    addr: std::net::SocketAddr,
    max_tokens: u32,
) -> hyper::Response<hyper::body::Incoming> {
    let body = json!({"model": MODEL, "prompt": "a long answer", "max_tokens": max_tokens, "stream": true});
    let req = Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp
}

/// Invariant: SIGTERM to the gateway's process stops it accepting at once, lets the streams in
/// flight finish whole (no error event), and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_streams_in_flight_finish() {
    let sim = SimProcess::start(process::slow_sim("vllm"));
    let (mut child, addr, path, client) = gateway_process(&sim, "sigterm").await;
    let resp = stream(&client, addr, 40).await;
    signal(&child, "-TERM");
    let whole = rest(resp).await;
    assert!(!whole.contains("\"error\""), "{whole}");
    assert!(whole.ends_with("data: [DONE]\n\n"), "{whole}");
    let exit = exit_of(&mut child, common::WAIT).await;
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_file(&path);
    drop(sim);
}

/// Invariant: a second signal during the shutdown grace exits at once (an operator's second
/// Ctrl-C), cutting a stream that would have run far longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let sim = SimProcess::start(process::slow_sim("vllm"));
    let (mut child, addr, path, client) = gateway_process(&sim, "second-signal").await;
    let _long = stream(&client, addr, 4000).await;
    signal(&child, "-TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(child.0.try_wait().unwrap().is_none(), "the first signal waits for the stream");
    signal(&child, "-INT");
    let exit = exit_of(&mut child, Duration::from_secs(5)).await;
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_file(&path);
    drop(sim);
}

/// Invariant of the harness: a killed worker is a process ended by `SIGKILL` whose HTTP port
/// then refuses connections, and its restart serves on the same port again.
#[test]
fn a_killed_worker_process_is_gone_until_restarted_on_its_port() {
    use std::io::{Read, Write};
    use std::os::unix::process::ExitStatusExt;
    let health = |w: &SimProcess| -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect(w.base_url().trim_start_matches("http://"))?;
        s.write_all(b"GET /health HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n")?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    };
    let mut w = SimProcess::start(process::sim("vllm"));
    let url = w.base_url();
    assert!(w.exit_status().is_none(), "the worker process exited");
    assert!(health(&w).unwrap().starts_with("HTTP/1.1 200"));
    w.kill();
    assert_eq!(w.exit_status().and_then(|s| s.signal()), Some(9), "not killed by SIGKILL");
    let refused = health(&w).expect_err("a killed worker answered");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}");
    w.restart();
    assert_eq!(w.base_url(), url);
    assert!(health(&w).unwrap().starts_with("HTTP/1.1 200"));
}

/// Invariant of the harness: the over-prediction check every test relies on fails on a hit
/// claimed beyond what the worker reports cached, and passes one within it.
#[test]
fn the_over_prediction_check_fails_on_an_over_claimed_hit() {
    let reply = |claimed: u64, cached: u64| {
        let mut headers = http::HeaderMap::new();
        headers.insert("x-cortex-cache-hit-tokens", claimed.into());
        let usage =
            json!({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": cached}}});
        Reply { status: StatusCode::OK, headers, body: usage.to_string() }
    };
    // Within what was cached: passes (a panic here fails the test).
    assert_not_over_predicted(&reply(48, 48));
    // 100 prompt tokens: at most 96 can be a hit, so 200 is capped to 96.
    assert_not_over_predicted(&reply(200, 96));
    // Capped to 96, still above 80: fails, and says why.
    let over = std::panic::catch_unwind(|| assert_not_over_predicted(&reply(200, 80)));
    let why = over.expect_err("a hit claimed beyond the cached tokens must fail the check");
    let why = why.downcast_ref::<String>().map(String::as_str).or(why.downcast_ref::<&str>().copied());
    assert!(why.is_some_and(|w| w.contains("over-predicted hit")), "{why:?}");
}

/// Kills the child when dropped, so a failing assertion never leaves a gateway running.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
