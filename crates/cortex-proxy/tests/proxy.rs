//! The proxy where it is made: the request path against fake engines on loopback (`fake/`), and
//! the accept loop's connection limits.
//!
//! - Planning: the dry run (`/debug/route`) chooses the holder the real request gets, for
//!   requests with cache hits, an adapter named in `lora_path`, pinned ranks and routing keys,
//!   and books nothing; a rank the client pins is the rank booked, reported and checked.
//! - Capacity: SGLang's running-request limit from `/server_info` and `/v1/loads`, vLLM's from
//!   the configuration, shown with its source, and acted on by the watermark.
//! - The `manual` policy's idle assignments are swept.
//! - The request path: admission, body limits, retries before the first byte, the request's own
//!   errors passed through, SSE relayed untouched or ended with an error event, the header set.
//! - The connection: one deadline for both HTTP versions while no request is in flight, the head
//!   size limit, the connection cap, request smuggling, shutdown at its deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails loudly

mod fake;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use cortex_hash::Engine;
use cortex_hash::kv::WorkerId;
use cortex_proxy::alignment::Verdict;
use cortex_proxy::config::Limits;
use cortex_proxy::error::Body;
use cortex_proxy::gateway::STICKY_SWEEP_EVERY;
use cortex_proxy::request::{self, Route};
use cortex_proxy::{Ask, Gateway, GatewayParts};
use cortex_radix::{Ledger, LedgerConfig};
use cortex_sched::{
    Assignment, Health, HealthPolicy, ManualConfig, PolicyConfig, PoolPolicies, Role, SchedConfig, Watermark,
    WorkerSpec,
};
use fake::{ADAPTER, FakeConfig, MODEL, Options, prompt, start, worker_entry};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

fn completion(p: &str) -> Value {
    json!({"model": MODEL, "prompt": p, "max_tokens": 2})
}

fn sched(policy: PolicyConfig) -> SchedConfig {
    let d = SchedConfig::default();
    SchedConfig { pools: PoolPolicies { regular: policy, ..d.pools }, ..d }
}

/// A request to send: (path, headers, body, the (worker, rank) it must get).
type Case = (&'static str, Vec<(&'static str, &'static str)>, Value, (&'static str, u16));

/// The first candidate of a dry run: (worker, rank).
fn first(dry: &Value) -> (String, u16) {
    let c = &dry["candidates"][0];
    (c["worker"].as_str().unwrap_or_default().to_owned(), c["rank"].as_u64().map_or(u16::MAX, |r| r as u16))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dry_run_chooses_what_the_request_gets_and_books_nothing() {
    // cache_aware over w0 (two ranks) and w1 (one): each request has a single best holder.
    let workers = vec![FakeConfig::new(Engine::Sglang).dp(2), FakeConfig::new(Engine::Sglang)];
    let h = start(Options::new(Engine::Sglang, workers)).await;
    let adapter =
        json!({"text": prompt("adapter"), "lora_path": ADAPTER, "sampling_params": {"max_new_tokens": 2}});
    h.fakes[1].prime(Route::Completions, 0, &completion(&prompt("hit")));
    h.fakes[0].prime(Route::Generate, 1, &adapter);
    h.fakes[1].prime(Route::Completions, 0, &completion(&prompt("pin0")));
    h.fakes[0].prime(
        Route::ChatCompletions,
        0,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": prompt("chat")}]}),
    );
    let mut pin0 = completion(&prompt("pin0"));
    pin0["routed_dp_rank"] = json!(0);
    // (path, headers, body, the holder it must get): all but the rank-1 pin have a cache hit.
    let cases: Vec<Case> = vec![
        ("/v1/completions", vec![], completion(&prompt("hit")), ("w1", 0)),
        // SGLang names the adapter in `lora_path`: its blocks are in the adapter's namespace.
        ("/generate", vec![], adapter.clone(), ("w0", 1)),
        // Pinned to rank 0 in the body: the best rank-0 holder.
        ("/v1/completions", vec![], pin0, ("w1", 0)),
        // Pinned to rank 1 by header: only w0 has one.
        ("/v1/completions", vec![("x-data-parallel-rank", "1")], completion(&prompt("pin1")), ("w0", 1)),
        (
            "/v1/chat/completions",
            vec![],
            json!({"model": MODEL, "messages": [{"role": "user", "content": prompt("chat")}]}),
            ("w0", 0),
        ),
    ];
    for (path, headers, body, want) in cases {
        let dry = h.dry(path, &headers, &body).await;
        assert_eq!(dry["decided"], Value::Null, "{dry}");
        assert!(
            h.booked().iter().all(|&(_, _, req, tok)| req == 0 && tok == 0),
            "the dry run booked: {:?}",
            h.booked()
        );
        let real = h.post(path, &headers, &body).await;
        assert_eq!(real.status, StatusCode::OK, "{path}: {}", real.text());
        assert_eq!(first(&dry), real.assigned(), "{path} {body}: the dry run chose another holder: {dry}");
        assert_eq!(real.assigned(), (want.0.to_owned(), want.1), "{path} {body}");
        let hit = real.header("x-cortex-assigned-rank") != "1" || path == "/generate";
        assert_eq!(real.header("x-cortex-match-mode") == "exact_kv_events", hit, "{path} {body}");
        assert_eq!(dry["cache_hit_tokens"].to_string(), real.header("x-cortex-cache-hit-tokens"), "{dry}");
    }
    h.shutdown().await;

    // consistent_hashing: the routing key header decides, in the dry run as in the request.
    let workers = vec![FakeConfig::new(Engine::Vllm); 3];
    let mut opts = Options::new(Engine::Vllm, workers);
    opts.sched = sched(PolicyConfig::ConsistentHashing);
    let h = start(opts).await;
    let mut holders = std::collections::HashSet::new();
    for i in 0..12 {
        let key = format!("user-{i}");
        let headers = [("x-cortex-routing-key", key.as_str())];
        let body = completion(&format!("question {i}"));
        let dry = h.dry("/v1/completions", &headers, &body).await;
        assert_eq!(dry["reason"], "policy", "a key was seen: {dry}");
        let real = h.post("/v1/completions", &headers, &body).await;
        assert_eq!(real.status, StatusCode::OK);
        assert_eq!(first(&dry), real.assigned(), "key {key}: {dry}");
        holders.insert(real.assigned());
    }
    assert!(holders.len() > 1, "twelve keys all hashed to one worker: the test would not tell keys apart");
    h.shutdown().await;
}

async fn a_pinned_rank_is_booked_reported_and_checked(engine: Engine) {
    let h = start(Options::new(engine, vec![FakeConfig::new(engine).dp(2)])).await;
    let p = prompt("pinned");
    // Rank 0 holds the prompt: the scheduler's own choice is rank 0.
    h.fakes[0].prime(Route::Completions, 0, &completion(&p));
    assert_eq!(first(&h.dry("/v1/completions", &[], &completion(&p)).await), ("w0".to_owned(), 0));
    let (mut body, headers): (Value, Vec<(&str, &str)>) = match engine {
        Engine::Sglang => {
            let mut b = completion(&p);
            b["routed_dp_rank"] = json!(1);
            (b, vec![])
        }
        _ => (completion(&p), vec![("X-data-parallel-rank", "1")]),
    };
    // While the pinned request is in flight, rank 1 carries its booking.
    body["stream"] = json!(true);
    h.fakes[0].hold();
    let sent = Bytes::from(body.to_string());
    let in_flight = h.spawn_send(h.request("POST", "/v1/completions", &headers, sent.clone()));
    h.wait("the pinned request reached the worker", || h.fakes[0].served().len() == 1).await;
    let id = h.id("w0");
    let booked: Vec<u32> = h.booked().iter().filter(|b| b.0 == id).map(|b| b.2).collect();
    assert_eq!(booked, vec![0, 1], "booked on the pinned rank only");
    h.fakes[0].release();
    let r = in_flight.await.unwrap();
    assert_eq!((r.status, r.header("x-cortex-assigned-rank")), (StatusCode::OK, "1"));
    assert!(r.body.ends_with(b"data: [DONE]\n\n"));
    let seen = &h.fakes[0].served()[0];
    assert_eq!(seen.rank, 1, "served on the pinned rank");
    match engine {
        Engine::Sglang => assert_eq!(seen.body, sent, "a body that pins its rank is forwarded byte for byte"),
        _ => assert_eq!(seen.headers["x-data-parallel-rank"], "1"),
    }
    // The alignment checks look at rank 1, which now holds the prompt: the verdict holds (checked
    // against rank 0's prediction, every realized hit would fall short).
    body["stream"] = json!(false);
    for _ in 0..2 {
        let r = h.post("/v1/completions", &headers, &body).await;
        assert_eq!((r.status, r.header("x-cortex-assigned-rank")), (StatusCode::OK, "1"), "{}", r.text());
    }
    h.wait("a continuous verdict on w0", || h.gateway.control().verdict(id) != Verdict::Unknown).await;
    assert_eq!(h.gateway.control().verdict(id), Verdict::Aligned);
    // A rank no worker has is the client's mistake, said as such.
    let mut wrong = completion(&p);
    wrong["routed_dp_rank"] = json!(5);
    let r = h.post("/v1/completions", &[], &wrong).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(r.text().contains("rank 5"), "{}", r.text());
    // A body and a header that disagree, too.
    let r = h
        .post(
            "/v1/completions",
            &[("x-data-parallel-rank", "0")],
            &json!({"model": MODEL, "prompt": "x", "routed_dp_rank": 1}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_sglang_rank_is_booked_reported_and_checked() {
    a_pinned_rank_is_booked_reported_and_checked(Engine::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_vllm_rank_is_booked_reported_and_checked() {
    a_pinned_rank_is_booked_reported_and_checked(Engine::Vllm).await;
}

/// A decision puts only the first `cortex_sched::RANKED` admissible holders in order. A rank
/// the client pins must still get that rank's best holder when it ranks below them: here 17
/// holders of other ranks hold the whole prompt, (w1, 1) half of it and (w0, 1) none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_rank_gets_its_best_holder_beyond_the_ranked_head() {
    let workers = vec![FakeConfig::new(Engine::Sglang).dp(17), FakeConfig::new(Engine::Sglang).dp(2)];
    let h = start(Options::new(Engine::Sglang, workers)).await;
    let half = prompt("far");
    let whole = format!("{half}{}", prompt("far, continued"));
    for rank in (0..17).filter(|&r| r != 1) {
        h.fakes[0].prime(Route::Completions, rank, &completion(&whole));
    }
    h.fakes[1].prime(Route::Completions, 0, &completion(&whole));
    h.fakes[1].prime(Route::Completions, 1, &completion(&half));
    let pinned = [("x-data-parallel-rank", "1")];
    // Each decision breaks its ties with another rotation, so the holders beyond the head fall
    // in another order each time.
    for _ in 0..12 {
        let dry = h.dry("/v1/completions", &pinned, &completion(&whole)).await;
        assert_eq!(first(&dry), ("w1".to_owned(), 1), "{dry}");
        let real = h.post("/v1/completions", &pinned, &completion(&whole)).await;
        assert_eq!(real.status, StatusCode::OK, "{}", real.text());
        assert_eq!(real.assigned(), ("w1".to_owned(), 1));
        assert_eq!(real.header("x-cortex-match-mode"), "exact_kv_events");
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_capacity_is_discovered_shown_and_counted_by_the_watermark() {
    let w = FakeConfig { server_info_max_running: Some(2), ..FakeConfig::new(Engine::Sglang) };
    let mut opts = Options::new(Engine::Sglang, vec![w.clone(), w]);
    // The watermark at half the limit: one request in flight on a worker that runs two.
    opts.sched.watermark = Watermark { inflight_fraction: 0.5, ..opts.sched.watermark };
    let h = start(opts).await;
    let (p, q) = (completion(&prompt("p")), prompt("q"));
    h.fakes[0].prime(Route::Completions, 0, &p);
    h.fakes[0].prime(Route::Completions, 0, &completion(&q));
    let dry = h.dry("/v1/completions", &[], &p).await;
    assert_eq!((dry["mode"].as_str(), first(&dry)), (Some("exact_kv_events"), ("w0".to_owned(), 0)), "{dry}");
    // One request in flight on w0 reaches half of its two: affinity is given up for the next.
    h.fakes[0].hold();
    let stream = json!({"model": MODEL, "prompt": q, "max_tokens": 2, "stream": true});
    let held = h.spawn_send(h.request("POST", "/v1/completions", &[], Bytes::from(stream.to_string())));
    h.wait("the held request is on w0", || h.fakes[0].served().len() == 1).await;
    let dry = h.dry("/v1/completions", &[], &p).await;
    assert_eq!(
        (dry["mode"].as_str(), dry["reason"].as_str()),
        (Some("load_aware"), Some("watermark")),
        "{dry}"
    );
    h.fakes[0].release();
    held.await.unwrap();
    let dbg = h.debug_workers().await;
    assert_eq!(
        worker_entry(&dbg, "w0")["max_running_requests"],
        json!({"value": 2, "source": "server_info"})
    );
    // A per-rank report in /v1/loads replaces the discovered value.
    h.fakes[0].report_max_running(3);
    let deadline = tokio::time::Instant::now() + fake::WAIT;
    loop {
        let dbg = h.debug_workers().await;
        if worker_entry(&dbg, "w0")["max_running_requests"] == json!({"value": 3, "source": "v1_loads"}) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the /v1/loads report was not taken: {dbg}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let snap = h.gateway.control().cluster().load();
    assert_eq!(snap.worker(h.id("w0")).unwrap().spec().capacity.max_running_requests, 3);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_capacity_is_configured_or_the_default() {
    let configured = FakeConfig { configured_max_running: Some(5), ..FakeConfig::new(Engine::Vllm) };
    let h = start(Options::new(Engine::Vllm, vec![configured, FakeConfig::new(Engine::Vllm)])).await;
    let dbg = h.debug_workers().await;
    assert_eq!(worker_entry(&dbg, "w0")["max_running_requests"], json!({"value": 5, "source": "config"}));
    assert_eq!(worker_entry(&dbg, "w1")["max_running_requests"], json!({"value": 256, "source": "default"}));
    let snap = h.gateway.control().cluster().load();
    assert_eq!(snap.worker(h.id("w0")).unwrap().spec().capacity.max_running_requests, 5);
    h.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn idle_manual_assignments_are_swept() {
    let manual = ManualConfig { max_idle: Duration::ZERO, assignment: Assignment::MinLoad };
    let (gw, _events) = Gateway::new(GatewayParts {
        config: cortex_proxy::ProxyConfig::default(),
        models: fake::models(Engine::Sglang),
        ledger: Ledger::new(LedgerConfig::default()),
        sched: sched(PolicyConfig::Manual(manual)),
        health: HealthPolicy::default(),
        prometheus: None,
    })
    .unwrap();
    // The planner reads only the scheduler's view: one worker in it is enough to plan.
    gw.control().cluster().upsert(WorkerSpec::new(WorkerId(7), MODEL, Engine::Sglang), Health::Healthy);
    for key in ["session-1", "session-2"] {
        let mut headers = HeaderMap::new();
        headers.insert("x-cortex-routing-key", key.parse().unwrap());
        let facts = request::parse(Route::Generate, br#"{"model": "m", "text": "hello"}"#).unwrap();
        gw.planner().plan(&Ask::new(facts, &headers).unwrap(), Role::Regular).await.unwrap();
    }
    assert_eq!(gw.planner().sticky_assignments(), 2);
    gw.start_background();
    // Virtual time (the test runs paused): a sweep interval passes, the maintenance loop ticking
    // every 50 ms meanwhile.
    tokio::time::sleep(STICKY_SWEEP_EVERY + Duration::from_secs(1)).await;
    assert_eq!(gw.planner().sticky_assignments(), 0, "the idle assignments were not swept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_answers_429_when_the_queue_is_full_and_503_after_the_queue_timeout() {
    for (max_queue, status, code) in [
        (0, StatusCode::TOO_MANY_REQUESTS, "gateway_overloaded"),
        (4, StatusCode::SERVICE_UNAVAILABLE, "queue_timeout"),
    ] {
        let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
        opts.proxy.limits = Limits {
            max_concurrent: 1,
            max_queue,
            queue_timeout: Duration::from_millis(100),
            ..Limits::default()
        };
        let h = start(opts).await;
        h.fakes[0].hold();
        let stream = json!({"model": MODEL, "prompt": "a", "stream": true});
        let held = h.spawn_send(h.request("POST", "/v1/completions", &[], Bytes::from(stream.to_string())));
        h.wait("the first request holds the only slot", || h.fakes[0].served().len() == 1).await;
        let r = h.post("/v1/completions", &[], &completion("b")).await;
        assert_eq!(r.status, status, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], code);
        assert_eq!(r.header("retry-after"), "1");
        h.fakes[0].release();
        assert!(held.await.unwrap().body.ends_with(b"data: [DONE]\n\n"));
        // The slot is free again.
        assert_eq!(h.post("/v1/completions", &[], &completion("c")).await.status, StatusCode::OK);
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limits_and_wrong_methods_get_client_errors() {
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.limits =
        Limits { max_body_bytes: 1024, body_read_timeout: Duration::from_millis(200), ..Limits::default() };
    let h = start(opts).await;
    let r = h.post("/v1/completions", &[], &completion(&"x".repeat(2000))).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("request_too_large"))
    );
    // A declared length beyond the limit is refused at once: no `100 Continue` is sent, and a
    // client that waits for one before its body gets the 413 without sending it.
    let mut c = TcpStream::connect(h.addr).await.unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 41943040\r\nexpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 512];
    let n = tokio::time::timeout(fake::WAIT, c.read(&mut head)).await.expect("answered at once").unwrap();
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    // The body stays unread and the connection ends after the answer, which says so.
    assert!(head.to_ascii_lowercase().contains("\r\nconnection: close\r\n"), "{head}");
    let r = h.send(h.request("POST", "/v1/completions", &[], Bytes::from_static(b"{\"model\": "))).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_json"))
    );
    let r = h.post("/v1/completions", &[], &json!({"model": "gpt-9", "prompt": "x"})).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("model_not_found"))
    );
    let r = h.get("/v1/completions").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    // Probes may use HEAD: the head alone.
    for path in ["/health/live", "/health/ready"] {
        let r = h.send(h.request("HEAD", path, &[], Bytes::new())).await;
        assert_eq!((r.status, r.body.len()), (StatusCode::OK, 0), "HEAD {path}");
        let r = h.send(h.request("POST", path, &[], Bytes::new())).await;
        assert_eq!((r.status, r.header("allow")), (StatusCode::METHOD_NOT_ALLOWED, "GET, HEAD"), "{path}");
    }
    let r = h.get("/debug/route").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    let msg = r.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(msg.contains("POST") && msg.contains("body"), "{msg}");
    // A body that never arrives: 408 after the body timeout, and the worker never sees it.
    let mut c = TcpStream::connect(h.addr).await.unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"").await.unwrap();
    let mut resp = vec![0u8; 4096];
    let n = tokio::time::timeout(fake::WAIT, c.read(&mut resp))
        .await
        .expect("no answer to a stalled body")
        .unwrap();
    let resp = String::from_utf8_lossy(&resp[..n]);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(h.fakes[0].served().is_empty());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_the_first_byte_moves_the_request_and_the_requests_own_error_does_not() {
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang); 2])).await;
    let p = completion(&prompt("retry"));
    h.fakes[0].prime(Route::Completions, 0, &p);
    // w0 holds the prompt and is tried first; its 503 sends the request to w1.
    h.fakes[0].fail_next(&[503]);
    let r = h.post("/v1/completions", &[], &p).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.assigned().0, "w1");
    assert_eq!(h.fakes[0].served().len(), 1);
    let dbg = h.debug_workers().await;
    assert_eq!(worker_entry(&dbg, "w0")["cooldown"], "server_error", "{dbg}");
    h.shutdown().await;

    // The request's own error (a 400) is passed through as the worker wrote it, from the worker
    // that answered, and no other worker is tried.
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang); 2])).await;
    h.fakes[0].prime(Route::Completions, 0, &p);
    h.fakes[0].fail_next(&[400]);
    let r = h.post("/v1/completions", &[], &p).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.text().contains("scripted 400"), "{}", r.text());
    assert_eq!(r.assigned(), ("w0".to_owned(), 0));
    assert!(h.fakes[1].served().is_empty());
    h.shutdown().await;

    // With one attempt allowed, the worker's failure is the answer, with what it said.
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang); 2]);
    opts.proxy.retry.max_attempts = 1;
    let h = start(opts).await;
    h.fakes[0].prime(Route::Completions, 0, &p);
    h.fakes[0].fail_next(&[503]);
    let r = h.post("/v1/completions", &[], &p).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(r.text().contains("scripted 503"), "{}", r.text());
    assert_eq!(r.header("retry-after"), "1", "Cortex's own: the worker gave none");
    assert!(h.fakes[1].served().is_empty());
    // A worker's 429 keeps the worker's `Retry-After` (the fake says 7 s), not Cortex's 1
    // (w0 cools down: either worker may take it).
    for f in &h.fakes {
        f.fail_next(&[429]);
    }
    let r = h.post("/v1/completions", &[], &p).await;
    assert_eq!((r.status, r.header("retry-after")), (StatusCode::TOO_MANY_REQUESTS, "7"), "{}", r.text());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_relayed_untouched_and_a_broken_one_ends_with_an_error_event() {
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "stream": true});
    let r = h.post("/v1/completions", &[], &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), "text/event-stream");
    let events: Vec<&str> = r.text().leak().split_inclusive("\n\n").collect();
    assert_eq!(events.len(), 4, "two chunks, the usage, [DONE]: {events:?}");
    assert!(events[0].starts_with("data: {") && events[0].contains("\"text\":\"o\""), "{events:?}");
    assert!(events[2].contains("\"usage\""), "{events:?}");
    assert_eq!(events[3], "data: [DONE]\n\n");
    // The worker breaks after its first chunk reached the client: the client keeps it, and the
    // stream ends with an error event instead of the rest.
    h.fakes[0].hold();
    h.fakes[0].break_stream_after(1);
    let resp = h
        .client
        .request(h.request("POST", "/v1/completions", &[], Bytes::from(body.to_string())))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut rest = resp.into_body();
    let first = rest.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: {\"object\""), "{first:?}");
    h.fakes[0].release();
    let text = String::from_utf8(rest.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.starts_with("data: {\"error\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    h.shutdown().await;
    // Broken in the middle of an event, after a whole one (a fresh gateway: the break cooled
    // the worker down): the client gets whole events only — the first, then the error event
    // (the half event is dropped, never glued to the error).
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    h.fakes[0].hold();
    h.fakes[0].break_stream_mid_event_after(1);
    let resp = h
        .client
        .request(h.request("POST", "/v1/completions", &[], Bytes::from(body.to_string())))
        .await
        .unwrap();
    let mut rest = resp.into_body();
    let mut text =
        String::from_utf8(rest.frame().await.unwrap().unwrap().into_data().unwrap().to_vec()).unwrap();
    h.fakes[0].release();
    text.push_str(std::str::from_utf8(&rest.collect().await.unwrap().to_bytes()).unwrap());
    let events: Vec<&str> = text.split_inclusive("\n\n").collect();
    assert_eq!(events.len(), 3, "the first event, the error, [DONE]: {text}");
    assert!(events[0].starts_with("data: {\"object\"") && events[0].contains("\"text\":\"o\""), "{text}");
    let error: serde_json::Value =
        serde_json::from_str(events[1].trim().trim_start_matches("data: ")).unwrap();
    assert_eq!(error["error"]["code"], "server_error", "{text}");
    assert_eq!(events[2], "data: [DONE]\n\n");
    h.shutdown().await;
}

/// With the public API's own token on, Cortex's token is Cortex's: it is checked and removed,
/// and the workers never see it (without `auth`, the header goes to the workers unchanged: see
/// `the_header_set_forwarded_and_answered`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cortex_s_own_token_never_reaches_the_workers() {
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.auth = Some(cortex_proxy::Token::new("gateway-token"));
    let h = start(opts).await;
    let r = h.post("/v1/completions", &[("authorization", "Bearer wrong")], &completion("hello")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(h.fakes[0].served().is_empty(), "nothing unauthenticated is forwarded");
    let r =
        h.post("/v1/completions", &[("authorization", "Bearer gateway-token")], &completion("hello")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let seen = &h.fakes[0].served()[0];
    assert!(!seen.headers.contains_key("authorization"), "{:?}", seen.headers);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_set_forwarded_and_answered() {
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    let headers = [
        ("x-request-id", "rid-42"),
        ("authorization", "Bearer worker-key"),
        ("proxy-authorization", "Basic gateway"),
        ("te", "trailers"),
        ("x-custom", "kept"),
    ];
    let r = h.post("/v1/completions", &headers, &completion("hello")).await;
    assert_eq!(r.status, StatusCode::OK);
    let seen = &h.fakes[0].served()[0];
    assert_eq!(seen.headers["x-request-id"], "rid-42");
    assert_eq!(seen.headers["authorization"], "Bearer worker-key");
    assert_eq!(seen.headers["x-custom"], "kept");
    assert_eq!(seen.headers["content-type"], "application/json");
    assert!(
        !seen.headers.contains_key("proxy-authorization") && !seen.headers.contains_key("te"),
        "{:?}",
        seen.headers
    );
    // Headers a `Connection` header names are this hop's, in both directions: the client's
    // never reach the worker, the worker's (the fake names `x-fake-hop`) never reach the client.
    let r2 = h
        .post("/v1/completions", &[("connection", "x-client-hop"), ("x-client-hop", "1")], &completion("hop"))
        .await;
    assert_eq!(r2.status, StatusCode::OK);
    let seen = &h.fakes[0].served()[1];
    assert!(!seen.headers.contains_key("x-client-hop"), "{:?}", seen.headers);
    assert!(!r2.headers.contains_key("x-fake-hop"), "{:?}", r2.headers);
    for name in [
        "x-cortex-cache-hit-tokens",
        "x-cortex-assigned-worker",
        "x-cortex-assigned-rank",
        "x-cortex-match-mode",
    ] {
        assert!(!r.header(name).is_empty(), "{name} missing: {:?}", r.headers);
    }
    assert_eq!(r.header("x-request-id"), "rid-42");
    assert_eq!(r.header("x-cortex-assigned-worker"), "w0");
    // A request without an id gets one, the same upstream and back.
    let r = h.post("/v1/completions", &[], &completion("hello again")).await;
    let id = r.header("x-request-id").to_owned();
    assert!(id.starts_with("cortex-"), "{id}");
    assert_eq!(h.fakes[0].served()[2].headers["x-request-id"], id.as_str());
    // Gateway errors carry the id too.
    let r = h
        .post("/v1/completions", &[("x-request-id", "rid-43")], &json!({"model": "nope", "prompt": "x"}))
        .await;
    assert_eq!((r.status, r.header("x-request-id")), (StatusCode::NOT_FOUND, "rid-43"));
    h.shutdown().await;
}

async fn ok(_req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    ok_body().await
}

async fn ok_body() -> Result<Response<Body>, Infallible> {
    Ok(Response::new(
        http_body_util::Full::new(bytes::Bytes::from_static(b"ok")).map_err(|e| match e {}).boxed_unsync(),
    ))
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_and_one_that_asks_is_served() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let limits = Limits { header_read_timeout: Duration::from_millis(300), ..Limits::default() };
    let server = tokio::spawn(async move {
        cortex_proxy::server::serve_with(listener, None, ok, &limits, Duration::from_secs(1), async {
            let _ = stopped.await;
        })
        .await;
    });

    // Silent: the gateway closes it (EOF) after the timeout, not never.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf))
        .await
        .expect("the silent connection was not closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "the gateway answered a connection that sent nothing");

    // A request on another connection is served.
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut resp)).await.unwrap().unwrap();
    let resp = String::from_utf8_lossy(&resp);
    assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with("ok"), "{resp}");

    let _ = stop.send(());
    server.await.unwrap();
}

/// A server of `handler` under `limits` on loopback, and what stops it.
struct Server {
    addr: std::net::SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve<H, Fut>(limits: Limits, grace: Duration, handler: H) -> Server
where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        cortex_proxy::server::serve_with(listener, None, handler, &limits, grace, async {
            let _ = stopped.await;
        })
        .await;
    });
    Server { addr, stop, task }
}

impl Server {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

/// Reads until the peer closes the connection (EOF or reset); what it sent before. Panics if it
/// is still open after [`fake::WAIT`].
async fn closed(c: &mut TcpStream) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + fake::WAIT;
    loop {
        match tokio::time::timeout_at(deadline, c.read(&mut buf)).await {
            Err(_) => panic!("the connection is still open: {}", String::from_utf8_lossy(&seen)),
            Ok(Ok(0) | Err(_)) => return seen,
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// One HTTP/1.1 exchange on a fresh connection that asks to close: everything the server sent.
async fn exchange(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(raw).await.unwrap();
    String::from_utf8_lossy(&closed(&mut c).await).into_owned()
}

/// An HTTP/2 connection (prior knowledge) to `addr`: its request sender and the task driving it,
/// which ends when the connection does.
async fn h2(
    addr: std::net::SocketAddr,
) -> (hyper::client::conn::http2::SendRequest<http_body_util::Full<Bytes>>, tokio::task::JoinHandle<()>) {
    let io = hyper_util::rt::TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await.unwrap();
    (
        send,
        tokio::spawn(async move {
            let _ = conn.await;
        }),
    )
}

fn h2_get(headers: &[(&str, String)]) -> Request<http_body_util::Full<Bytes>> {
    let mut b = Request::builder().uri("http://x/");
    for (k, v) in headers {
        b = b.header(*k, v.as_str());
    }
    b.body(http_body_util::Full::new(Bytes::new())).unwrap()
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty HTTP/2 SETTINGS frame.
const H2_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// Issue 19, row 1: hyper-util's protocol detection and HTTP/2 had no timeout, so connections
/// could be held forever. A connection must deliver a request's headers within
/// `header_read_timeout` while none of its requests is in flight, on both versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_connections_without_a_request_are_closed_at_the_header_read_timeout() {
    let limits = Limits { header_read_timeout: Duration::from_millis(300), ..Limits::default() };
    let srv = serve(limits, Duration::from_secs(1), ok).await;
    // The preface, one byte at a time: closed, whether during detection or after it.
    let mut dribbler = TcpStream::connect(srv.addr).await.unwrap();
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + fake::WAIT;
    let mut sent = 0;
    loop {
        tokio::select! {
            r = dribbler.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            },
            () = tokio::time::sleep(Duration::from_millis(100)), if sent < H2_PREFACE.len() => {
                if dribbler.write_all(&H2_PREFACE[sent..=sent]).await.is_err() {
                    break;
                }
                sent += 1;
            }
            () = tokio::time::sleep_until(deadline) => panic!("a dribbled preface kept its connection open"),
        }
    }
    // The preface and SETTINGS, then silence: the server's SETTINGS and GOAWAY, then closed.
    let mut silent = TcpStream::connect(srv.addr).await.unwrap();
    silent.write_all(&[H2_PREFACE, H2_SETTINGS].concat()).await.unwrap();
    closed(&mut silent).await;
    // A client that asks is served; its connection, idle afterwards, is closed too. A request
    // answered slower than the timeout is not cut: the deadline runs only while none is in
    // flight.
    let slow = |_req: Request<Incoming>| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        ok_body().await
    };
    let slow_srv = serve(limits_ms(300), Duration::from_secs(1), slow).await;
    for addr in [srv.addr, slow_srv.addr] {
        let (mut send, conn) = h2(addr).await;
        let resp = send.send_request(h2_get(&[])).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        tokio::time::timeout(fake::WAIT, conn).await.expect("an idle HTTP/2 connection stayed open").unwrap();
        // HTTP/1.1 keep-alive alike.
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let got = String::from_utf8_lossy(&closed(&mut c).await).into_owned();
        assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("ok"), "{got}");
    }
    srv.stop().await;
    slow_srv.stop().await;
}

fn limits_ms(header_read_timeout: u64) -> Limits {
    Limits { header_read_timeout: Duration::from_millis(header_read_timeout), ..Limits::default() }
}

/// Issue 19, row 8: a request whose headers never complete is not answered (no 408): the
/// connection is closed at `header_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_never_completes_is_closed_without_an_answer() {
    let srv = serve(limits_ms(300), Duration::from_secs(1), ok).await;
    let got = exchange(srv.addr, b"GET / HTTP/1.1\r\nhost: x\r\nx-unfinished: ").await;
    assert_eq!(got, "", "a client that sent no complete head got an answer");
    srv.stop().await;
}

/// Issue 19, row 2: a 100 KiB request header was accepted and forwarded. Heads beyond
/// `max_header_bytes` (64 KiB by default) get 431 on both versions; heads within it are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_over_max_header_bytes_get_431_on_both_versions() {
    assert_eq!(Limits::default().max_header_bytes, 64 * 1024);
    let srv = serve(Limits::default(), Duration::from_secs(1), ok).await;
    let head = |kib: usize| {
        format!("GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: {}\r\n\r\n", "a".repeat(kib * 1024))
    };
    let got = exchange(srv.addr, head(100).as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 431"), "{got}");
    let got = exchange(srv.addr, head(40).as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // HTTP/1.1: up to 100 header fields are served, more get 431.
    let fields = |n: usize| {
        let mut h = String::from("GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n");
        for i in 2..n {
            h.push_str(&format!("x-f{i}: v\r\n"));
        }
        h + "\r\n"
    };
    let got = exchange(srv.addr, fields(100).as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 200"), "100 fields: {got}");
    let got = exchange(srv.addr, fields(101).as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 431"), "101 fields: {got}");
    let (mut send, _conn) = h2(srv.addr).await;
    let resp = send.send_request(h2_get(&[("x-big", "a".repeat(100 * 1024))])).await.unwrap();
    assert_eq!(resp.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let (mut send, _conn) = h2(srv.addr).await;
    let resp = send.send_request(h2_get(&[("x-big", "a".repeat(40 * 1024))])).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "40 KiB is within the configured limit");
    srv.stop().await;
}

/// Issue 19, row 9: no cap on open connections. Beyond `max_connections` a new connection is
/// closed at once; when one closes, the next is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_are_closed_at_once() {
    let limits =
        Limits { max_connections: 2, header_read_timeout: Duration::from_secs(60), ..Limits::default() };
    let srv = serve(limits, Duration::from_secs(1), ok).await;
    // Two keep-alive connections, each answered once (so both are accepted and held).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(srv.addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(fake::WAIT, c.read(&mut buf)).await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        held.push(c);
    }
    // A third is closed without an answer.
    let got = exchange(srv.addr, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    assert_eq!(got, "", "a connection beyond max_connections was served");
    // One of the two leaves: a new connection is served once the server has seen it go.
    drop(held.pop());
    let deadline = tokio::time::Instant::now() + fake::WAIT;
    loop {
        let got = exchange(srv.addr, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
        if got.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no connection served after one closed");
    }
    srv.stop().await;
}

/// A client that asks for an answer and never reads a byte of it (its socket buffer full, on
/// either HTTP version) held its connection, and so a `max_connections` slot, for as long as it
/// kept the socket open. A write that waits `client_write_timeout` now ends the connection: the
/// only slot serves the next client, and the stalled socket is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_that_is_never_read_gives_its_connection_back() {
    // Far beyond what the loopback socket buffers of both ends hold.
    let big = Bytes::from(vec![b'x'; 64 << 20]);
    let handler = move |_req: Request<Incoming>| {
        let big = big.clone();
        async move {
            Ok::<_, Infallible>(Response::new(
                http_body_util::Full::new(big).map_err(|e| match e {}).boxed_unsync(),
            ))
        }
    };
    // HTTP/2 by hand (prior knowledge), so that nothing reads: the preface, windows opened wide
    // (the stall is the socket's, not flow control's), and `GET /` with `:authority: x`.
    let mut h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2.extend_from_slice(&[0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 4, 0x7f, 0xff, 0xff, 0xff]);
    h2.extend_from_slice(&[0, 0, 4, 8, 0, 0, 0, 0, 0, 0x7f, 0xfe, 0xff, 0xff]);
    h2.extend_from_slice(&[0, 0, 6, 1, 5, 0, 0, 0, 1, 0x82, 0x86, 0x84, 0x41, 0x01, b'x']);
    for (version, ask) in [("HTTP/1.1", b"GET / HTTP/1.1\r\nhost: x\r\n\r\n".to_vec()), ("HTTP/2", h2)] {
        let limits = Limits {
            max_connections: 1,
            client_write_timeout: Duration::from_millis(300),
            header_read_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let srv = serve(limits, Duration::from_secs(1), handler.clone()).await;
        let mut stalled = TcpStream::connect(srv.addr).await.unwrap();
        stalled.write_all(&ask).await.unwrap();
        // The next client is served once the stalled connection has been given up.
        let deadline = tokio::time::Instant::now() + fake::WAIT;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let got = exchange(srv.addr, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
            if got.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{version}: the stalled connection kept the only slot"
            );
        }
        // What was buffered is readable, then the connection ends.
        let mut buf = vec![0u8; 1 << 16];
        let ended = tokio::time::timeout(fake::WAIT, async {
            while let Ok(n) = stalled.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "{version}: the stalled connection is still open");
        srv.stop().await;
    }
}

/// A client that reads slowly but steadily is never cut, however long its answer waits behind a
/// full socket: a full socket becomes writable again only once much of it has drained, so a write
/// waits far longer than `client_write_timeout` while the client takes bytes all along. Its
/// progress is seen in the socket's unsent bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_slowly_but_steadily_is_never_cut() {
    let size = 6 << 20;
    let handler = move |_req: Request<Incoming>| async move {
        Ok::<_, Infallible>(Response::new(
            http_body_util::Full::new(Bytes::from(vec![b'x'; size])).map_err(|e| match e {}).boxed_unsync(),
        ))
    };
    let limits = Limits { client_write_timeout: Duration::from_millis(300), ..Limits::default() };
    let srv = serve(limits, Duration::from_secs(1), handler).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 << 10).unwrap();
    let mut c = socket.connect(srv.addr).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    // About 1.6 MB/s: the 6 MiB answer takes about 4 s, while the gateway's socket stays full.
    let (mut got, mut buf) = (0usize, vec![0u8; 16 << 10]);
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(ended.is_ok(), "the answer never ended");
    assert!(got > size, "cut after {got} bytes of {size}");
    srv.stop().await;
}

/// Issue 19, row 9: request smuggling. What hyper refuses (400) and what it neutralizes: with
/// both `Transfer-Encoding: chunked` and `Content-Length` the body is read as chunked and the
/// connection closed after the answer, so a request hidden after the body is never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_smuggling_is_refused_or_cannot_desynchronize() {
    let served = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = std::sync::Arc::clone(&served);
    let recording = move |req: Request<Incoming>| {
        let seen = std::sync::Arc::clone(&seen);
        async move {
            seen.lock().unwrap().push(req.uri().path().to_owned());
            let _ = req.into_body().collect().await;
            ok_body().await
        }
    };
    let srv = serve(Limits::default(), Duration::from_secs(1), recording).await;
    for (what, raw) in [
        (
            "conflicting Content-Length",
            &b"POST /cl HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 30\r\n\r\nabc"[..],
        ),
        (
            "Transfer-Encoding not ending in chunked",
            b"POST /te HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
        ),
        (
            "Transfer-Encoding on HTTP/1.0",
            b"POST /te10 HTTP/1.0\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
    ] {
        let got = exchange(srv.addr, raw).await;
        assert!(got.starts_with("HTTP/1.1 400"), "{what}: {got}");
    }
    // Chunked wins over the length, and the connection closes after the one answer.
    let raw = b"POST /te-cl HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let got = exchange(srv.addr, raw).await;
    assert_eq!(got.matches("HTTP/1.1 ").count(), 1, "{got}");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(*served.lock().unwrap(), ["/te-cl"], "only the outer request was served");
    srv.stop().await;
}

/// Issue 19, row 8: graceful shutdown logged its deadline but left the connections it had not
/// drained running. At the deadline what is left is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_closes_what_is_left_at_its_deadline() {
    // A response whose body never ends.
    let endless =
        |_req: Request<Incoming>| async { Ok::<_, Infallible>(Response::new(Endless.boxed_unsync())) };
    let srv = serve(Limits::default(), Duration::from_millis(300), endless).await;
    let mut c = TcpStream::connect(srv.addr).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(fake::WAIT, c.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    srv.stop().await;
    // The stream in flight is cut: the client sees its connection close.
    closed(&mut c).await;
}

/// A response body that never ends (nor sends anything).
struct Endless;

impl hyper::body::Body for Endless {
    type Data = Bytes;
    type Error = cortex_proxy::error::BodyError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

/// Issue 19, row 3: a request took its admission slot before its body was read, so clients
/// sending bodies slowly starved every other request (503 `queue_timeout`). A request now asks
/// for its slot once its body is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_holds_a_connection_never_a_slot() {
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.limits = Limits {
        max_concurrent: 1,
        max_queue: 4,
        queue_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let h = start(opts).await;
    // The slow client's handler is reading its body once hyper sends `100 Continue` (the body's
    // first poll): on the old order it held the only slot by then.
    let mut slow = TcpStream::connect(h.addr).await.unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(fake::WAIT, slow.read(&mut buf)).await.unwrap().unwrap();
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    slow.write_all(b"{\"mo").await.unwrap();
    let r = h.post("/v1/completions", &[], &completion("a normal request")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    drop(slow);
    h.shutdown().await;
}

/// A client that never reads its answer (an HTTP/2 stream whose window it never opens) held its
/// admission slot, its booking and the worker's request for as long as it kept the connection
/// alive. After `client_write_timeout` the answer is given up: the only slot serves the next
/// request. With a window of 1 byte (a first frame handed over, the next never asked for), the
/// stalled stream is then reset when the client reads again; with a window of 0 the server may
/// never ask for a frame at all, and the answer is given up all the same. A connection holding
/// nothing but given-up answers is closed at once (the idle timeout here is a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_client_never_reads_is_given_up() {
    for window in [1, 0] {
        let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
        opts.proxy.limits = Limits {
            max_concurrent: 1,
            max_queue: 4,
            queue_timeout: Duration::from_secs(3),
            client_write_timeout: Duration::from_millis(400),
            header_read_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let h = start(opts).await;
        let io = hyper_util::rt::TokioIo::new(TcpStream::connect(h.addr).await.unwrap());
        let (mut send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(window)
            .handshake(io)
            .await
            .unwrap();
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let body = json!({"model": MODEL, "prompt": "never read", "max_tokens": 2, "stream": true});
        let req = Request::builder()
            .method("POST")
            .uri("http://x/v1/completions")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let stalled = send.send_request(req).await.unwrap();
        assert_eq!(stalled.status(), StatusCode::OK);
        // The stalled answer holds the only slot: the next request waits for it.
        let started = std::time::Instant::now();
        let r = h.post("/v1/completions", &[], &completion("after the stall")).await;
        assert_eq!(r.status, StatusCode::OK, "window {window}: {}", r.text());
        assert!(started.elapsed() >= Duration::from_millis(300), "it waited for the stalled answer");
        if window > 0 {
            // The stalled stream ends with an error once the client reads again.
            let mut rest = stalled.into_body();
            let ended = tokio::time::timeout(fake::WAIT, async {
                loop {
                    match rest.frame().await {
                        Some(Ok(_)) => {}
                        Some(Err(_)) => return true,
                        None => return false,
                    }
                }
            })
            .await
            .unwrap();
            assert!(ended, "the stalled stream is reset, never ended as if complete");
        } else {
            // The stream is still open (hyper resets it only when it next writes to it), and
            // nothing else is in flight on its connection: the connection is closed.
            tokio::time::timeout(fake::WAIT, driver).await.expect("the connection was closed").unwrap();
            h.shutdown().await;
            continue;
        }
        driver.abort();
        h.shutdown().await;
    }
}

/// A client that opens many streams and reads none (windows of 0) while its connection stays
/// busy (here a request whose body never ends): after 8 answers given up, the connection is
/// closed, with the streams hyper kept open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_with_many_answers_given_up_is_closed() {
    /// A request body that never ends.
    struct Endless;
    impl hyper::body::Body for Endless {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
            std::task::Poll::Pending
        }
    }
    type Either = http_body_util::Either<http_body_util::Full<Bytes>, Endless>;
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.limits = Limits {
        client_write_timeout: Duration::from_millis(300),
        // Neither the idle path nor the body's timeout can close it within the test.
        header_read_timeout: Duration::from_secs(120),
        body_read_timeout: Duration::from_secs(120),
        ..Limits::default()
    };
    let h = start(opts).await;
    let io = hyper_util::rt::TokioIo::new(TcpStream::connect(h.addr).await.unwrap());
    let (send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .initial_stream_window_size(0)
        .handshake::<_, Either>(io)
        .await
        .unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let request = |body: Either| {
        Request::builder()
            .method("POST")
            .uri("http://x/v1/completions")
            .header("content-type", "application/json")
            .body(body)
            .unwrap()
    };
    // In flight all along: its body never ends.
    let busy = tokio::spawn(send.clone().send_request(request(Either::Right(Endless))));
    let ask = |i: usize| {
        let body =
            json!({"model": MODEL, "prompt": format!("never read {i}"), "max_tokens": 2, "stream": true});
        request(Either::Left(http_body_util::Full::new(Bytes::from(body.to_string()))))
    };
    let mut held = Vec::new();
    for i in 0..7 {
        held.push(send.clone().send_request(ask(i)).await.unwrap());
    }
    // Seven given up: the connection stays, and takes requests.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!driver.is_finished(), "closed before 8 answers were given up");
    held.push(send.clone().send_request(ask(7)).await.expect("a request after 7 given up"));
    // The eighth closes it: GOAWAY (no new request is taken), while the busy request is not cut.
    let deadline = tokio::time::Instant::now() + fake::WAIT;
    while send.clone().send_request(ask(8)).await.is_ok() {
        assert!(tokio::time::Instant::now() < deadline, "still taking requests after 8 answers given up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!busy.is_finished(), "the busy request was cut");
    busy.abort();
    driver.abort();
    drop(held);
    h.shutdown().await;
}

/// An HTTP/2 frame, by hand.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let n = u32::try_from(payload.len()).unwrap();
    let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A streaming completion on HTTP/2 `stream`, by hand (HPACK without Huffman: `:method POST`,
/// `:scheme http`, `:path`, `:authority x`, `content-type`).
fn h2_post(stream: u32, prompt: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86, 0x04, 15];
    block.extend_from_slice(b"/v1/completions");
    block.extend_from_slice(&[0x01, 0x01, b'x', 0x0f, 0x10, 16]);
    block.extend_from_slice(b"application/json");
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true}).to_string();
    let mut out = h2_frame(1, 0x4, stream, &block);
    out.extend(h2_frame(0, 0x1, stream, body.as_bytes()));
    out
}

/// Reads HTTP/2 frames from `c` until `stream` ends (a DATA or HEADERS frame with END_STREAM);
/// `seen` keeps what was read past it.
async fn h2_until_end(c: &mut TcpStream, seen: &mut Vec<u8>, stream: u32) {
    let mut buf = [0u8; 8192];
    loop {
        let mut at = 0;
        while at + 9 <= seen.len() {
            let len =
                (usize::from(seen[at]) << 16) | (usize::from(seen[at + 1]) << 8) | usize::from(seen[at + 2]);
            if at + 9 + len > seen.len() {
                break;
            }
            let (kind, flags) = (seen[at + 3], seen[at + 4]);
            let id =
                u32::from_be_bytes([seen[at + 5], seen[at + 6], seen[at + 7], seen[at + 8]]) & 0x7fff_ffff;
            at += 9 + len;
            if id == stream && (kind == 0 || kind == 1) && flags & 1 == 1 {
                seen.drain(..at);
                return;
            }
        }
        seen.drain(..at);
        let n = tokio::time::timeout(fake::WAIT, c.read(&mut buf)).await.expect("a frame").unwrap();
        assert!(n > 0, "the connection closed before stream {stream} ended");
        seen.extend_from_slice(&buf[..n]);
    }
}

/// A stream whose window its client keeps shut is given up even while the client keeps other
/// streams of the connection busy (each of which counts as the connection's progress): its own
/// frame may wait at most 4 `client_write_timeout`s. Its booking is then released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_stream_beside_busy_ones_is_given_up_all_the_same() {
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.limits = Limits {
        client_write_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_secs(60),
        ..Limits::default()
    };
    let h = start(opts).await;
    let mut c = TcpStream::connect(h.addr).await.unwrap();
    let mut ask = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    ask.extend(h2_frame(4, 0, 0, &[0, 4, 0, 0, 0, 0]));
    ask.extend(h2_post(1, "kept shut"));
    c.write_all(&ask).await.unwrap();
    let booked = |dbg: &Value| worker_entry(dbg, "w0")["ranks"][0]["booked_requests"].as_u64();
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    let (mut stream, mut released) = (3u32, None);
    // Busy streams, one after another, each read whole (its window opened), for 3 s.
    while started.elapsed() < Duration::from_secs(3) {
        let mut one = h2_post(stream, &format!("busy {stream}"));
        one.extend(h2_frame(8, 0, stream, &(1u32 << 20).to_be_bytes()));
        c.write_all(&one).await.unwrap();
        h2_until_end(&mut c, &mut seen, stream).await;
        stream += 2;
        if released.is_none() && booked(&h.debug_workers().await) == Some(0) {
            released = Some(started.elapsed());
        }
    }
    let at = released.expect("the shut stream kept its booking while the others flowed");
    assert!(at >= Duration::from_millis(300), "given up too soon: {at:?}");
    h.shutdown().await;
}

/// A connection closed because its client left an answer unread is closed gracefully: an answer
/// that finished in the same moment reaches the client whole (its last frames were queued, not
/// yet written, when its request stopped counting). HTTP/2 by hand, so that one stream's window
/// stays shut while the other's is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_finished_beside_a_given_up_one_is_delivered_whole() {
    for round in 0..3 {
        let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
        opts.proxy.limits = Limits {
            client_write_timeout: Duration::from_millis(300),
            header_read_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let h = start(opts).await;
        // Both streams stop after their first event until released.
        h.fakes[0].hold();
        let mut c = TcpStream::connect(h.addr).await.unwrap();
        let mut ask = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        // Every stream's window 0, then stream 3's opened: stream 1 is never read.
        ask.extend(h2_frame(4, 0, 0, &[0, 4, 0, 0, 0, 0]));
        ask.extend(h2_post(1, &format!("never read {round}")));
        ask.extend(h2_post(3, &format!("read whole {round}")));
        ask.extend(h2_frame(8, 0, 3, &(1u32 << 20).to_be_bytes()));
        c.write_all(&ask).await.unwrap();
        // Stream 1 is given up (300 ms) while stream 3 is in flight; then stream 3 finishes,
        // and the connection, holding only the given-up answer, is closed.
        tokio::time::sleep(Duration::from_millis(800)).await;
        h.fakes[0].release();
        let mut seen = Vec::new();
        let mut buf = [0u8; 8192];
        let closed = tokio::time::timeout(fake::WAIT, async {
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "round {round}: the connection was not closed");
        let (mut at, mut ended) = (0, false);
        while at + 9 <= seen.len() {
            let len =
                (usize::from(seen[at]) << 16) | (usize::from(seen[at + 1]) << 8) | usize::from(seen[at + 2]);
            let (kind, flags) = (seen[at + 3], seen[at + 4]);
            let stream =
                u32::from_be_bytes([seen[at + 5], seen[at + 6], seen[at + 7], seen[at + 8]]) & 0x7fff_ffff;
            ended |= stream == 3 && (kind == 0 || kind == 1) && flags & 1 == 1;
            at += 9 + len;
        }
        assert!(ended, "round {round}: stream 3's answer was cut ({} bytes seen)", seen.len());
        h.shutdown().await;
    }
}

/// Issue 19, row 8: token ids beyond the model's vocabulary were forwarded unchecked. They are
/// refused with 400 before anything reaches a worker, on every route that takes ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_out_of_the_vocabulary_are_refused() {
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    let max = i64::from(
        h.gateway
            .planner()
            .model_for(&request::parse(Route::Completions, br#"{"model":"m","prompt":"x"}"#).unwrap())
            .unwrap()
            .max_token_id(),
    );
    assert!(max > 150_000, "Qwen3's vocabulary: {max}");
    for (path, body) in [
        ("/v1/completions", json!({"model": MODEL, "prompt": [1, 2, max + 1], "max_tokens": 2})),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [[1, 2], [3, 4_000_000_000_u64]], "max_tokens": 2}),
        ),
        (
            "/generate",
            json!({"model": MODEL, "input_ids": [5, max + 7], "sampling_params": {"max_new_tokens": 2}}),
        ),
        ("/tokenize", json!({"model": MODEL, "prompt": [max + 1]})),
        ("/debug/route", json!({"model": MODEL, "prompt": [max + 1]})),
    ] {
        let r = h.post(path, &[], &body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} {body}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_request", "{}", r.text());
        assert!(
            r.json()["error"]["message"].as_str().unwrap_or_default().contains("vocabulary"),
            "{}",
            r.text()
        );
    }
    assert!(h.fakes[0].served().is_empty(), "an out-of-vocabulary request reached the worker");
    // The largest id is fine.
    let r =
        h.post("/v1/completions", &[], &json!({"model": MODEL, "prompt": [1, max], "max_tokens": 2})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    h.shutdown().await;
}

/// Issue 19, row 8: `/tokenize` was not admission-controlled. It takes a slot like a routed
/// request (its tokenization costs the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_takes_an_admission_slot() {
    let mut opts = Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)]);
    opts.proxy.limits = Limits { max_concurrent: 1, max_queue: 0, ..Limits::default() };
    let h = start(opts).await;
    h.fakes[0].hold();
    let stream = json!({"model": MODEL, "prompt": "a", "stream": true});
    let held = h.spawn_send(h.request("POST", "/v1/completions", &[], Bytes::from(stream.to_string())));
    h.wait("the first request holds the only slot", || h.fakes[0].served().len() == 1).await;
    let r = h.post("/tokenize", &[], &json!({"model": MODEL, "prompt": "hello world"})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "gateway_overloaded");
    h.fakes[0].release();
    assert!(held.await.unwrap().body.ends_with(b"data: [DONE]\n\n"));
    let r = h.post("/tokenize", &[], &json!({"model": MODEL, "prompt": "hello world"})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    h.shutdown().await;
}
