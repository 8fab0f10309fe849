//! End to end: the gateway (real HTTP, real ZeroMQ ingest) in front of simulated vLLM and SGLang
//! workers on loopback. Tests wait on observable state (the ledger, `/debug/route`, the workers'
//! own counters), never on fixed sleeps.

#![allow(clippy::unwrap_used, clippy::print_stdout)] // test helpers: a failed setup step should panic

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use cortex_gateway::config::Config;
use cortex_gateway::{Running, demo};
use cortex_sim::{SimConfig, SimWorker, Timing};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
const MODEL: &str = "m";

struct Harness {
    sims: Vec<SimWorker>,
    gw: Running,
    client: Client<HttpConnector, Full<Bytes>>,
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

fn sim(engine: &str) -> SimConfig {
    let mut c = if engine == "vllm" { SimConfig::vllm() } else { SimConfig::sglang() };
    c.model_name = MODEL.to_owned();
    c.timing = Timing { speed: 0.0, ..Timing::default() };
    c
}

async fn harness(engine: &str, sims: Vec<SimConfig>, extra: &str) -> Harness {
    harness_with(engine, sims, extra, |_| {}, None).await
}

async fn harness_with(
    engine: &str,
    sims: Vec<SimConfig>,
    extra: &str,
    adjust: impl FnOnce(&mut cortex_gateway::Settings),
    prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
) -> Harness {
    let sims: Vec<SimWorker> = sims.into_iter().map(|c| SimWorker::start(c).unwrap()).collect();
    let mut workers = String::new();
    for (i, s) in sims.iter().enumerate() {
        workers.push_str(&format!(
            "  - {{name: w{i}, url: '{}', engine: {engine}, model: {MODEL}}}\n",
            s.base_url()
        ));
    }
    let qwen = demo::repo_root().join("golden/models/qwen3");
    let yaml = format!(
        "listen: '127.0.0.1:0'
models:
  - name: {MODEL}
    engine: {engine}
    tokenizer: '{}'
    tokenizer_config: '{}'
    block_size: 16
workers:
{workers}probes: {{health_interval: 200ms, load_interval: 100ms, timeout: 2s, failures_to_remove: 2, successes_to_restore: 1}}
alignment: {{settle: 100ms, min_samples: 2, window: 4}}
ingest: {{silence_timeout: 500ms, replay_timeout: 1s}}
limits: {{max_body: 65536}}
{extra}",
        qwen.join("tokenizer.json").display(),
        qwen.join("tokenizer_config.json").display(),
    );
    let mut settings = Config::parse(&yaml).unwrap().into_settings(&demo::repo_root()).unwrap();
    adjust(&mut settings);
    let gw = cortex_gateway::start(settings, prometheus).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let h = Harness { sims, gw, client };
    h.wait("every worker live", || h.live_workers() == h.sims.len()).await;
    h
}

impl Harness {
    fn addr(&self) -> SocketAddr {
        self.gw.addr
    }

    fn live_workers(&self) -> usize {
        self.gw
            .gateway
            .cluster()
            .load()
            .workers()
            .iter()
            .filter(|w| w.health() == cortex_sched::Health::Healthy)
            .count()
    }

    async fn wait(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn send(&self, method: &str, path: &str, body: Bytes) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr()))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    async fn post(&self, path: &str, v: &Value) -> Reply {
        self.send("POST", path, Bytes::from(v.to_string())).await
    }

    /// The gateway's dry-run view of a request: (best worker name, its matched tokens).
    async fn best_hit(&self, body: &Value) -> (String, u64) {
        let r = self.post("/debug/route", body).await;
        let v = r.json();
        let first = &v["candidates"][0];
        (
            first["worker"].as_str().unwrap_or_default().to_owned(),
            first["matched_tokens"].as_u64().unwrap_or(0),
        )
    }

    async fn wait_hit(&self, body: &Value, pred: impl Fn(&str, u64) -> bool) -> (String, u64) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (w, hit) = self.best_hit(body).await;
            if pred(&w, hit) {
                return (w, hit);
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out: ledger view {w} {hit}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn worker(&self, name: &str) -> &SimWorker {
        &self.sims[name.trim_start_matches('w').parse::<usize>().unwrap()]
    }
}

/// A long shared prompt: ~400 tokens, so 25 full blocks of 16.
fn long_prompt(tag: &str) -> String {
    let mut s = format!("[{tag}] You are a careful assistant. ");
    for i in 0..60 {
        s.push_str(&format!("Rule {i}: answer briefly, cite sources, and keep calm. "));
    }
    s
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": 8,
           "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "Summarize the rules."}]})
}

fn cached_tokens(r: &Reply) -> u64 {
    let v = r.json();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| v["meta_info"]["cached_tokens"].as_u64())
        .unwrap_or(0)
}

/// The seed's Phase 1 acceptance on one engine, at concurrency 1.
async fn phase1(engine: &str) {
    let h = harness(engine, vec![sim(engine), sim(engine)], "").await;
    let body = chat(&long_prompt(engine), false);
    let first = h.post("/v1/chat/completions", &body).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let holder = first.header("x-cortex-assigned-worker").to_owned();
    // The first request's blocks become visible in the ledger.
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    for i in 0..5 {
        let r = h.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("x-cortex-assigned-worker"), holder, "repeat {i} left the holder");
        assert_eq!(r.header("x-cortex-match-mode"), "exact_kv_events");
        let predicted: u64 = r.header("x-cortex-cache-hit-tokens").parse().unwrap();
        let realized = cached_tokens(&r);
        assert!(predicted >= 16 * 20, "predicted {predicted}");
        // The worker counts the last block as a miss: at most one block less than the ledger.
        assert!(
            realized <= predicted && predicted - realized <= 16,
            "predicted {predicted}, worker says {realized}"
        );
        assert!(realized > 0);
    }
    // Flush the holder's cache: the hit disappears.
    h.worker(&holder).flush_cache().unwrap();
    h.wait_hit(&body, |_, hit| hit == 0).await;
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.header("x-cortex-cache-hit-tokens"), "0");
    assert_ne!(r.header("x-cortex-match-mode"), "exact_kv_events");
    assert_eq!(cached_tokens(&r), 0);
    // Profiles were confirmed and no continuous check failed.
    let workers = h.post("/debug/route", &body).await;
    assert_eq!(workers.status, StatusCode::OK);
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phase1_acceptance_vllm() {
    phase1("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phase1_acceptance_sglang() {
    phase1("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_ledger_is_routed_by_load_and_says_so() {
    let h = harness("sglang", vec![sim("sglang"), sim("sglang")], "").await;
    let body = chat(&long_prompt("stale"), false);
    let first = h.post("/v1/chat/completions", &body).await;
    let holder = first.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    // The holder stops stepping while a request runs: busy and silent, so its ledger is STALE.
    h.worker(&holder).stall();
    let gw = h.gw.addr;
    let stuck = tokio::spawn({
        let client = h.client.clone();
        // The same prompt: the exact hit sends it to the (now stalled) holder.
        let b = Bytes::from(body.to_string());
        async move {
            let req = Request::post(format!("http://{gw}/v1/chat/completions")).body(Full::new(b)).unwrap();
            let _ = client.request(req).await;
        }
    });
    let id = h.gw.gateway.registry().by_name(&holder).unwrap().id;
    let holder_id = cortex_hash::kv::HolderId::new(id, cortex_hash::kv::DpRank(0));
    h.wait("the holder turns STALE", || h.gw.ledger_state(holder_id) == Some(cortex_radix::Readiness::Stale))
        .await;
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_ne!(r.header("x-cortex-match-mode"), "exact_kv_events");
    assert_eq!(r.header("x-cortex-cache-hit-tokens"), "0");
    h.worker(&holder).resume();
    let _ = stuck.await;
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_workers_get_no_exact_routing() {
    // w0: the gateway's profile; w1: another template; w2: another block size.
    let same = sim("vllm");
    let mut other_template = sim("vllm");
    other_template.chat_template = Some(
        "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
            .to_owned(),
    );
    let mut other_block = sim("vllm");
    other_block.block_size = 32;
    let h = harness("vllm", vec![same, other_template, other_block], "").await;
    let verdict = |name: &str| {
        let w = h.gw.gateway.registry().by_name(name).unwrap();
        w.status().alignment
    };
    h.wait("discovery of every worker", || {
        ["w0", "w1", "w2"]
            .iter()
            .all(|n| !matches!(verdict(n), cortex_hash::profile::Alignment::Unconfirmed(_)))
    })
    .await;
    assert_eq!(verdict("w0"), cortex_hash::profile::Alignment::Confirmed);
    let cortex_hash::profile::Alignment::Mismatch(m1) = verdict("w1") else {
        panic!("w1 {:?}", verdict("w1"))
    };
    assert!(m1.iter().any(|m| m.field == "tokens"), "{m1:?}");
    let cortex_hash::profile::Alignment::Mismatch(m2) = verdict("w2") else {
        panic!("w2 {:?}", verdict("w2"))
    };
    assert!(m2.iter().any(|m| m.field == "block_size"), "{m2:?}");
    // Requests that land on a misaligned worker are never exact, however often repeated.
    for i in 0..12 {
        let r = h.post("/v1/chat/completions", &chat(&long_prompt("mis"), false)).await;
        assert_eq!(r.status, StatusCode::OK);
        if r.header("x-cortex-assigned-worker") != "w0" {
            assert_ne!(r.header("x-cortex-match-mode"), "exact_kv_events", "request {i}");
        }
    }
    let dbg = h.send("GET", "/debug/workers", Bytes::new()).await.json();
    let ledger_of = |name: &str| {
        dbg["workers"].as_array().unwrap().iter().find(|w| w["name"] == name).unwrap()["ranks"][0]["ledger"]
            .clone()
    };
    assert_eq!(ledger_of("w1"), "disabled");
    assert_eq!(ledger_of("w2"), "disabled");
    h.gw.shutdown().await;
}

async fn every_route(engine: &str) {
    let h = harness(engine, vec![sim(engine)], "").await;
    let cases = [
        ("/v1/chat/completions", chat("hello there", false)),
        ("/v1/chat/completions", chat("hello there", true)),
        ("/v1/completions", json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5})),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": true}),
        ),
        ("/generate", json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 5}})),
        (
            "/generate",
            json!({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 5}, "stream": true}),
        ),
    ];
    for (path, body) in cases {
        if engine == "vllm" && path == "/generate" {
            continue;
        }
        let stream = body["stream"].as_bool().unwrap_or(false);
        let r = h.post(path, &body).await;
        assert_eq!(r.status, StatusCode::OK, "{engine} {path} stream={stream}: {}", r.body);
        assert!(!r.header("x-cortex-assigned-worker").is_empty());
        assert!(!r.header("x-cortex-match-mode").is_empty());
        assert!(!r.header("x-request-id").is_empty());
        if stream {
            assert!(r.body.starts_with("data: "), "{}", r.body);
            assert!(r.body.ends_with("data: [DONE]\n\n"), "{engine} {path}: {}", r.body);
        } else {
            assert!(r.json().is_object() || r.json().is_array(), "{}", r.body);
        }
    }
    // The gateway's own endpoints.
    let t = h.post("/tokenize", &json!({"model": MODEL, "prompt": "hello world"})).await;
    assert_eq!(t.json()["tokens"], json!([14990, 1879]));
    let models = h.send("GET", "/v1/models", Bytes::new()).await;
    assert_eq!(models.json()["data"][0]["id"], MODEL);
    assert_eq!(h.send("GET", "/health/live", Bytes::new()).await.status, StatusCode::OK);
    assert_eq!(h.send("GET", "/health/ready", Bytes::new()).await.status, StatusCode::OK);
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_vllm() {
    every_route("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_sglang() {
    every_route("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_only_that_stream_with_an_error_event() {
    let mut slow = sim("vllm");
    slow.timing = Timing { speed: 1.0, itl_base: Duration::from_millis(20), ..Timing::default() };
    let h = harness("vllm", vec![slow], "").await;
    h.sims[0].die_mid_stream(3, 1);
    let body = |p: &str| json!({"model": MODEL, "prompt": p, "max_tokens": 12, "stream": true});
    let (first, second) = (body("first stream"), body("second stream"));
    let (a, b) = tokio::join!(h.post("/v1/completions", &first), async {
        // Start the second stream once the first one is in flight (the fault hits the first).
        h.wait("first stream in flight", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
        h.post("/v1/completions", &second).await
    });
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.body.contains("data: {\"error\""), "{}", a.body);
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    assert_eq!(b.status, StatusCode::OK);
    assert!(!b.body.contains("\"error\""), "{}", b.body);
    assert!(b.body.ends_with("data: [DONE]\n\n"));
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_moves_the_request_elsewhere() {
    let h = harness("sglang", vec![sim("sglang"), sim("sglang")], "").await;
    h.sims[0].fail_next(429, 1);
    let req = |i: usize| json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 2});
    let cooldown_of_w0 = |dbg: &Value| {
        dbg["workers"].as_array().unwrap().iter().find(|w| w["name"] == "w0").unwrap()["cooldown"].clone()
    };
    // Every request succeeds: the one that meets the 429 is retried on the other worker.
    let mut i = 0;
    loop {
        let r = h.post("/v1/completions", &req(i)).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        i += 1;
        if cooldown_of_w0(&h.send("GET", "/debug/workers", Bytes::new()).await.json()) == "rate_limited" {
            assert_eq!(r.header("x-cortex-assigned-worker"), "w1", "the refused request moved to w1");
            break;
        }
        assert!(i < 20, "w0 was never tried");
    }
    // While w0 cools down, the next requests go elsewhere.
    for j in 0..4 {
        let r = h.post("/v1/completions", &req(100 + j)).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("x-cortex-assigned-worker"), "w1");
    }
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_client_errors() {
    let h = harness("vllm", vec![sim("vllm")], "").await;
    let big = Bytes::from(vec![b' '; 70_000]);
    let r = h.send("POST", "/v1/completions", big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    let r = h.send("POST", "/v1/completions", Bytes::from_static(b"{\"model\": ")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["code"], "invalid_json");
    let r = h.post("/v1/completions", &json!({"model": "gpt-9", "prompt": "x"})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = h.send("GET", "/v1/completions", Bytes::new()).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    let r = h.send("GET", "/nope", Bytes::new()).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_hashing_differently_is_caught_by_the_published_hashes() {
    // The worker's PYTHONHASHSEED differs from what the profile assumes: nothing discovery can
    // read says so, but the engine hashes it publishes differ from the recipe's prediction.
    let mut seeded = sim("vllm");
    if let cortex_sim::EngineConfig::Vllm(o) = &mut seeded.engine {
        o.none_hash_seed = cortex_sim::formats::NoneHashSeed::PythonHashSeed("0".into());
    }
    let h = harness("vllm", vec![seeded], "").await;
    let id = h.gw.gateway.registry().by_name("w0").unwrap().id;
    let mut i = 0;
    while !matches!(h.gw.gateway.verdict(id), cortex_proxy::alignment::Verdict::Misaligned(_)) {
        let r = h.post("/v1/chat/completions", &chat(&long_prompt(&format!("seed {i}")), false)).await;
        assert_eq!(r.status, StatusCode::OK);
        i += 1;
        assert!(i < 40, "never flagged: {:?}", h.gw.gateway.verdict(id));
        tokio::time::sleep(Duration::from_millis(150)).await; // let each block check run (settle 100ms)
    }
    let cortex_proxy::alignment::Verdict::Misaligned(why) = h.gw.gateway.verdict(id) else { unreachable!() };
    assert!(why.contains("engine hashes"), "{why}");
    h.gw.gateway.sync_ledger_states();
    let body = chat(&long_prompt("after"), false);
    h.post("/v1/chat/completions", &body).await;
    let r = h.post("/v1/chat/completions", &body).await;
    assert_ne!(r.header("x-cortex-match-mode"), "exact_kv_events");
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_adds_lists_and_removes_workers() {
    let admin_listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let h = harness_with(
        "sglang",
        vec![sim("sglang")],
        "",
        |s| s.admin = Some((admin_listen, "s3cret".into())),
        None,
    )
    .await;
    let admin = h.gw.admin_addr.unwrap();
    let extra = SimWorker::start(sim("sglang")).unwrap();
    let call = |method: &str, path: &str, token: Option<&str>, body: Option<Value>| {
        let mut b = Request::builder().method(method).uri(format!("http://{admin}{path}"));
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        let req = b.body(Full::new(body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string())))).unwrap();
        let client = h.client.clone();
        async move {
            let resp = client.request(req).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null))
        }
    };
    let new = json!({"name": "extra", "url": extra.base_url(), "engine": "sglang", "model": MODEL});
    assert_eq!(call("POST", "/admin/workers", None, Some(new.clone())).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        call("POST", "/admin/workers", Some("wrong"), Some(new.clone())).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, body) = call("POST", "/admin/workers", Some("s3cret"), Some(new.clone())).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(
        call("POST", "/admin/workers", Some("s3cret"), Some(new)).await.0,
        StatusCode::BAD_REQUEST,
        "duplicate name"
    );
    h.wait("the added worker is live", || h.live_workers() == 2).await;
    let (_, list) = call("GET", "/admin/workers", Some("s3cret"), None).await;
    assert_eq!(list["workers"].as_array().unwrap().len(), 2);
    // The admin API is not on the public listener.
    assert_eq!(h.send("GET", "/admin/workers", Bytes::new()).await.status, StatusCode::NOT_FOUND);
    let (status, _) = call("DELETE", "/admin/workers/extra", Some("s3cret"), None).await;
    assert_eq!(status, StatusCode::OK);
    h.wait("the removed worker left the pool", || h.live_workers() == 1).await;
    assert!(h.gw.gateway.registry().by_name("extra").is_none());
    h.gw.shutdown().await;
    extra.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_leaves_the_pool_and_comes_back_syncing() {
    let h = harness("vllm", vec![sim("vllm"), sim("vllm")], "").await;
    let body = chat(&long_prompt("health"), false);
    let first = h.post("/v1/chat/completions", &body).await;
    let holder_name = first.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder_name && hit > 0).await;
    let id = h.gw.gateway.registry().by_name(&holder_name).unwrap().id;
    let holder = cortex_hash::kv::HolderId::new(id, cortex_hash::kv::DpRank(0));
    assert!(h.gw.gateway.ledger().dump(holder).is_some_and(|d| !d.blocks.is_empty()));
    // Its health probe fails: out of the pool first, then its ledger entries are pruned.
    h.worker(&holder_name).set_healthy(false);
    h.wait("the worker left the pool", || h.live_workers() == 1).await;
    h.wait("its ledger entries were pruned", || h.gw.gateway.ledger().dump(holder).is_none()).await;
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_ne!(r.header("x-cortex-assigned-worker"), holder_name);
    // It comes back: rediscovered, its ledger rebuilt from a fresh subscription.
    h.worker(&holder_name).set_healthy(true);
    h.wait("the worker is back", || h.live_workers() == 2).await;
    h.wait("its ledger is followed again", || h.gw.ledger_state(holder).is_some()).await;
    h.gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_streams_finish() {
    let mut slow = sim("sglang");
    slow.timing = Timing { speed: 1.0, itl_base: Duration::from_millis(20), ..Timing::default() };
    let h = harness("sglang", vec![slow], "shutdown_grace: 10s\n").await;
    let addr = h.addr();
    let stream = {
        let client = h.client.clone();
        let body = Bytes::from(
            json!({"model": MODEL, "prompt": "a long answer", "max_tokens": 25, "stream": true}).to_string(),
        );
        tokio::spawn(async move {
            let req = Request::post(format!("http://{addr}/v1/completions")).body(Full::new(body)).unwrap();
            let resp = client.request(req).await.unwrap();
            String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
        })
    };
    h.wait("the stream is in flight", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
    let Harness { sims, gw, .. } = h;
    gw.shutdown().await;
    let body = stream.await.unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "the in-flight stream finished: {body}");
    assert!(!body.contains("\"error\""));
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    drop(sims);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_describe_routing_ledger_and_workers() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().unwrap();
    cortex_proxy::telemetry::describe();
    let h = harness_with("vllm", vec![sim("vllm")], "", |_| {}, Some(handle)).await;
    let body = chat(&long_prompt("metrics"), false);
    h.post("/v1/chat/completions", &body).await;
    h.wait_hit(&body, |_, hit| hit > 0).await;
    h.post("/v1/chat/completions", &body).await;
    let m = h.send("GET", "/metrics", Bytes::new()).await;
    assert_eq!(m.status, StatusCode::OK);
    for name in [
        "cortex_requests_total",
        "cortex_routing_decision_seconds",
        "cortex_tokenize_seconds",
        "cortex_hash_seconds",
        "cortex_ledger_state",
        "cortex_ledger_live_bytes",
        "cortex_worker_live",
        "cortex_worker_aligned",
        "cortex_predicted_hit_tokens_total",
        "cortex_realized_hit_tokens_total",
    ] {
        assert!(m.body.contains(name), "{name} missing from /metrics:\n{}", m.body);
    }
    assert!(m.body.contains("mode=\"exact_kv_events\""), "{}", m.body);
    h.gw.shutdown().await;
}
