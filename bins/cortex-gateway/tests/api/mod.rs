//! The API edge as a client and an upstream gateway see it: each route's error format, client
//! faults named clearly, the admin listener's debug views, the public bearer token, TLS on both
//! listeners with a certificate reload, `/v1/models` from the workers, and the cache flush.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use crate::common::{ADMIN_TOKEN, MODEL, Reply, harness, harness_with, long_prompt, sim, slow_sim};

/// A simulated worker whose context is 256 tokens: a long prompt is refused by the worker.
fn short_context(engine: &str) -> cortex_sim::SimConfig {
    let mut c = sim(engine);
    c.max_model_len = 256;
    c
}

/// Prompt tokens worker `w0` has computed so far (unchanged: no request reached it).
fn computed(h: &crate::common::Harness) -> u64 {
    h.sims[0].rank_state(0).unwrap().computed_prompt_tokens
}

/// The OpenAI error object of `r`, checked to have exactly OpenAI's fields.
fn openai_error(r: &Reply) -> Value {
    let v = r.json();
    let e = &v["error"];
    assert!(e.is_object(), "{}", r.body);
    let mut keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message", "param", "type"], "{}", r.body);
    assert_eq!(v.as_object().unwrap().len(), 1, "only `error`: {}", r.body);
    e.clone()
}

/// SGLang's native error object of `r`: `{"error": {"message", "code"}}`.
fn sglang_error(r: &Reply) -> Value {
    let v = r.json();
    let e = &v["error"];
    let mut keys: Vec<&str> =
        e.as_object().unwrap_or_else(|| panic!("{}", r.body)).keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message"], "{}", r.body);
    e.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_route_answers_a_worker_s_refusal_in_its_own_format() {
    for engine in ["sglang", "vllm"] {
        let h = harness(engine, vec![short_context(engine)], &[]).await;
        let long = long_prompt("too long");
        let chat = json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": long}]});
        let completion = json!({"model": MODEL, "max_tokens": 8, "prompt": long});
        for (path, body) in [("/v1/chat/completions", &chat), ("/v1/completions", &completion)] {
            for stream in [false, true] {
                let mut body = body.clone();
                body["stream"] = json!(stream);
                let r = h.post(path, &body).await;
                assert_eq!(r.status, StatusCode::BAD_REQUEST, "{engine} {path}: {}", r.body);
                // SGLang's own `{"object": "error", "code": 400}` is rewritten: the worker's
                // message is kept, Cortex's class is the code.
                let e = openai_error(&r);
                assert_eq!(e["code"], "context_length_exceeded", "{engine} {path}");
                assert_eq!(e["type"], "invalid_request_error");
                assert!(e["message"].as_str().unwrap().contains("maximum context length"), "{e}");
                assert_eq!(r.header("x-cortex-assigned-worker"), "w0");
                assert_eq!(r.header("content-type"), "application/json");
            }
        }
        if engine == "sglang" {
            let generate = json!({"text": long, "sampling_params": {"max_new_tokens": 8}});
            let r = h.post("/generate", &generate).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
            let e = sglang_error(&r);
            assert_eq!(e["code"], "context_length_exceeded");
            assert!(e["message"].as_str().unwrap().contains("maximum context length"), "{e}");
            // Cortex's own errors on /generate are SGLang's format too.
            let r = h.post("/generate", &json!({"sampling_params": {}})).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST);
            assert_eq!(sglang_error(&r)["code"], "invalid_request");
        }
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_refusal_is_an_openai_error_too() {
    let mut p = short_context("sglang");
    p.role = cortex_sim::Role::Prefill;
    let mut d = short_context("sglang");
    d.role = cortex_sim::Role::Decode;
    let h = harness("sglang", vec![p, d], &[]).await;
    let body = json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": long_prompt("pd")}]});
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    let e = openai_error(&r);
    assert_eq!(e["code"], "context_length_exceeded", "{}", r.body);
    assert!(e["message"].as_str().unwrap().contains("maximum context length"), "{e}");
    // Attributed as an answer is: the pair's mode, the decision's match mode and hit.
    assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-match-mode"), "load_aware", "{:?}", r.headers);
    assert_eq!(r.header("x-cortex-cache-hit-tokens"), "0", "{:?}", r.headers);
    // Refused, the legs stored nothing: neither engine owes an event, neither ledger goes STALE
    // past `silence_timeout` (500 ms here).
    let until = tokio::time::Instant::now() + Duration::from_millis(1_500);
    while tokio::time::Instant::now() < until {
        for w in ["w0", "w1"] {
            assert_eq!(
                h.gw.ledger_state(h.holder(w)),
                Some(cortex_radix::Readiness::Ready),
                "{w} went STALE"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_generate_stream_ends_with_sglang_s_error_event() {
    let h = harness("sglang", vec![slow_sim("sglang")], &[]).await;
    h.sims[0].die_mid_stream(3, 1);
    let body =
        json!({"text": "a stream that breaks", "stream": true, "sampling_params": {"max_new_tokens": 12}});
    let r = h.post("/generate", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    let event = r
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .find(|d| d.contains("\"error\""))
        .unwrap_or_else(|| panic!("no error event: {}", r.body));
    let v: Value = serde_json::from_str(event).unwrap();
    assert_eq!(v, json!({"error": {"message": v["error"]["message"], "code": "server_error"}}), "{event}");
    assert!(v["error"]["message"].as_str().unwrap().contains("stream broke"), "{event}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_faults_and_unserved_routes_are_refused_clearly() {
    let h = harness("vllm", vec![sim("vllm")], &[]).await;
    let before = computed(&h);
    for (body, says) in [
        (json!({"model": MODEL, "messages": []}), "`messages` is empty"),
        (json!({"model": MODEL}), "`messages` is required"),
        (json!({"model": MODEL, "messages": [{"content": "hi"}]}), "`messages[0].role` is required"),
    ] {
        let r = h.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.body);
        let e = openai_error(&r);
        assert_eq!(e["code"], "invalid_request", "{body}");
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    assert_eq!(computed(&h), before, "no fault reached the worker");
    // SGLang's native route for a vLLM model: refused by Cortex, in SGLang's format.
    let r = h.post("/generate", &json!({"model": MODEL, "text": "hi"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    let e = sglang_error(&r);
    assert_eq!(e["code"], "unsupported_route");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("/generate") && message.contains("vllm") && message.contains("/v1/completions"),
        "{e}"
    );
    // `/tokenize` is Cortex's own: a `/generate`-shaped body is tokenized as the completion's
    // prompt would be, for a vLLM model too.
    let text = h.post("/tokenize", &json!({"model": MODEL, "text": "hello world"})).await;
    let prompt = h.post("/tokenize", &json!({"model": MODEL, "prompt": "hello world"})).await;
    assert_eq!(text.status, StatusCode::OK, "{}", text.body);
    assert_eq!(prompt.status, StatusCode::OK, "{}", prompt.body);
    let (t, p): (Value, Value) = (text.json(), prompt.json());
    assert!(t["count"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t, p);
    // Its vocabulary check holds there too.
    let r = h.post("/tokenize", &json!({"model": MODEL, "input_ids": [u32::MAX]})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(r.body.contains("out of the vocabulary"), "{}", r.body);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_model_names_the_models_served() {
    let h = harness_with(
        "sglang",
        vec![sim("sglang")],
        &[],
        |s| assert!(s.models.add_adapter("m-sql", "/adapters/sql", MODEL)),
        None,
    )
    .await;
    let r = h.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    let e = openai_error(&r);
    assert_eq!(e["code"], "model_required");
    assert!(e["message"].as_str().unwrap().contains("m, m-sql"), "{e}");
    // SGLang's native route, whose clients seldom name a model, goes to the only SGLang model.
    let r = h.post("/generate", &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = h.post("/v1/completions", &json!({"model": "gpt-9", "prompt": "hi"})).await;
    assert_eq!(
        (r.status, openai_error(&r)["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("model_not_found"))
    );
    h.shutdown().await;
}

/// A request with `Authorization: Bearer <token>` (none when `token` is `None`).
async fn call(
    client: &crate::common::Harness,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Reply {
    call_with(client, method, url, token, body, &[]).await
}

/// [`call`] with more request headers.
async fn call_with(
    client: &crate::common::Harness,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Reply {
    let mut b = Request::builder().method(method).uri(url).header("content-type", "application/json");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string())))).unwrap();
    let resp = client.client.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    Reply { status: parts.status, headers: parts.headers, body: String::from_utf8_lossy(&body).into_owned() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_lives_on_the_admin_listener_behind_its_token() {
    let h = harness("sglang", vec![sim("sglang")], &[]).await;
    let (public, admin) = (h.addr(), h.admin_addr());
    let route = json!({"model": MODEL, "prompt": "hi"});
    for (method, path) in [("GET", "/debug/workers"), ("POST", "/debug/route")] {
        let body = (method == "POST").then_some(&route);
        let r = call(&h, method, &format!("http://{public}{path}"), Some(ADMIN_TOKEN), body).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path} on the public listener: {}", r.body);
        let longer = format!("{ADMIN_TOKEN}x");
        let shorter = &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1];
        for token in [None, Some("wrong"), Some(longer.as_str()), Some(shorter)] {
            let r = call(&h, method, &format!("http://{admin}{path}"), token, body).await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{path} with {token:?}");
            assert_eq!(openai_error(&r)["code"], "unauthorized");
            // xrouter.md's header contract holds on the admin listener too.
            assert_eq!(r.header("www-authenticate"), "Bearer", "{path} with {token:?}");
            assert!(r.header("x-request-id").starts_with("cortex-"), "{path} with {token:?}");
        }
        let r = call(&h, method, &format!("http://{admin}{path}"), Some(ADMIN_TOKEN), body).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
        assert!(r.header("x-request-id").starts_with("cortex-"), "{path}");
        // A client's own id is kept, on successes and errors alike.
        let url = format!("http://{admin}{path}");
        let mine = [("x-request-id", "admin-call-7")];
        let r = call_with(&h, method, &url, Some(ADMIN_TOKEN), body, &mine).await;
        assert_eq!((r.status, r.header("x-request-id")), (StatusCode::OK, "admin-call-7"), "{path}");
        let r = call_with(&h, method, &url, None, body, &mine).await;
        assert_eq!((r.status, r.header("x-request-id")), (StatusCode::UNAUTHORIZED, "admin-call-7"));
    }
    // A known admin path with another method: 405 with the path's methods in `Allow`.
    for (method, path, allow) in [
        ("PUT", "/admin/workers", "GET, POST"),
        ("DELETE", "/admin/workers", "GET, POST"),
        ("POST", "/debug/workers", "GET"),
        ("GET", "/debug/route", "POST"),
        ("GET", "/admin/cache/flush", "POST"),
        ("GET", "/admin/workers/w0", "DELETE"),
    ] {
        let r = call(&h, method, &format!("http://{admin}{path}"), Some(ADMIN_TOKEN), None).await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}: {}", r.body);
        assert_eq!(openai_error(&r)["code"], "method_not_allowed", "{method} {path}");
        assert_eq!(r.header("allow"), allow, "{method} {path}");
        assert!(r.header("x-request-id").starts_with("cortex-"), "{method} {path}");
    }
    let r = call(&h, "GET", &format!("http://{admin}/admin/nope"), Some(ADMIN_TOKEN), None).await;
    assert_eq!((r.status, openai_error(&r)["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_refuses_a_worker_that_could_never_serve() {
    let h = harness("sglang", vec![sim("sglang")], &[]).await;
    let url = format!("http://{}/admin/workers", h.admin_addr());
    let taken = h.worker("w0").base_url().to_owned();
    let new = |name: &str, url: &str, engine: &str| json!({"name": name, "url": url, "engine": engine, "model": MODEL});
    for (body, says) in [
        (new("", "http://127.0.0.1:1", "sglang"), "worker name \"\" must not be empty"),
        (new("a b", "http://127.0.0.1:1", "sglang"), "worker name \"a b\" must not contain whitespace"),
        (
            new("x", "http://127.0.0.1:1", "vllm"),
            &format!("worker `x` runs vllm, but its model `{MODEL}` is configured for sglang"),
        ),
        (new("x", "http://127.0.0.1:1/v1", "sglang"), "must be the engine's base URL"),
        (new("x", "http://127.0.0.1:1?a=b", "sglang"), "must be the engine's base URL"),
        (new("x", &taken, "sglang"), "is the address of worker `w0` already"),
    ] {
        let r = call(&h, "POST", &url, Some(ADMIN_TOKEN), Some(&body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.body);
        let e = openai_error(&r);
        assert_eq!(e["code"], "invalid_request", "{body}");
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {}", r.body);
    }
    assert_eq!(h.gw.gateway.control().registry().snapshot().len(), 1, "nothing refused was added");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_api_requires_its_bearer_token_when_one_is_set() {
    let h = harness_with(
        "sglang",
        vec![sim("sglang")],
        &[],
        |s| s.proxy.auth = Some(cortex_proxy::Token::new("public-s3cret")),
        None,
    )
    .await;
    let url = |p: &str| format!("http://{}{p}", h.addr());
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2});
    let before = computed(&h);
    for token in [None, Some("public-s3cre"), Some("public-s3cretx"), Some(ADMIN_TOKEN)] {
        let r = call(&h, "POST", &url("/v1/completions"), token, Some(&body)).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert_eq!(r.header("www-authenticate"), "Bearer");
        assert_eq!(openai_error(&r)["code"], "unauthorized");
        let r = call(&h, "GET", &url("/v1/models"), token, None).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    let r = call(&h, "POST", &url("/generate"), None, Some(&json!({"text": "hi"}))).await;
    assert_eq!(
        (r.status, sglang_error(&r)["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthorized"))
    );
    assert_eq!(computed(&h), before, "nothing unauthenticated reached the worker");
    let r = call(&h, "POST", &url("/v1/completions"), Some("public-s3cret"), Some(&body)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(computed(&h) > before);
    // Probes stay open.
    for p in ["/health/live", "/health/ready"] {
        assert_eq!(call(&h, "GET", &url(p), None, None).await.status, StatusCode::OK, "{p}");
    }
    h.shutdown().await;
}

/// Workers whose engines require an API key (`--api-key`; the simulator refuses what the engine
/// refuses) are discovered, polled and served with the model's `worker_api_key_env`, in place of
/// the client's own `Authorization` (forwarded unchanged when no worker key is set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_require_an_api_key_get_the_model_s_key() {
    for engine in ["sglang", "vllm"] {
        let mut keyed = sim(engine);
        keyed.api_key = Some(format!("{engine}-worker-key"));
        let key = cortex_proxy::WorkerKey::new(&format!("{engine}-worker-key")).unwrap();
        // Discovery, the load polls and the health probes all went through: the worker is live.
        let h = harness_with(
            engine,
            vec![keyed],
            &[],
            |s| assert!(s.models.set_worker_api_key(MODEL, key)),
            None,
        )
        .await;
        let url = |p: &str| format!("http://{}{p}", h.addr());
        let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2});
        let before = computed(&h);
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let r = call(&h, "POST", &url("/v1/completions"), Some("the-client-s-own"), Some(&body)).await;
            assert_eq!(r.status, StatusCode::OK, "{engine}: {}", r.body);
        }
        assert!(computed(&h) > before, "{engine}: the worker computed the prompts");
        // `/v1/models` is the workers' own list, fetched with the key.
        let r = call(&h, "GET", &url("/v1/models"), None, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.json()["data"][0]["id"], MODEL, "{}", r.body);
        if engine == "sglang" {
            let r = call(&h, "POST", &url("/generate"), None, Some(&json!({"text": "hi"}))).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        }
        // The worker itself refuses a request without its key, or with the client's token.
        let worker = format!("{}/v1/completions", h.sims[0].base_url());
        for token in [None, Some("the-client-s-own")] {
            let r = call(&h, "POST", &worker, token, Some(&body)).await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{engine} {token:?}: {}", r.body);
        }
        h.shutdown().await;
    }
}

/// A worker whose engine wants an API key Cortex does not send, or refuses the one it sends,
/// stays out of the pool, and its `last_error` says which and names the setting (a probe found
/// a vLLM worker live with every request refused, `last_error` empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refusing_cortex_s_key_says_so() {
    for (engine, ours, says) in [
        ("vllm", None, "requires an API key"),
        ("vllm", Some("wrong"), "refuses its model's worker API key"),
        ("sglang", None, "requires an API key"),
        ("sglang", Some("wrong"), "refuses its model's worker API key"),
    ] {
        let mut keyed = sim(engine);
        keyed.api_key = Some("right".into());
        let worker = cortex_sim::SimWorker::start(keyed).unwrap();
        let qwen = cortex_gateway::demo::repo_root().join("golden/models/qwen3");
        let yaml = format!(
            "listen: '127.0.0.1:0'
models:
  - {{name: {MODEL}, engine: {engine}, tokenizer: '{}', tokenizer_config: '{}', block_size: 16}}
workers:
  - {{name: w0, url: '{}', engine: {engine}, model: {MODEL}}}
probes: {{health_interval: 100ms, load_interval: 100ms, timeout: 2s}}
",
            qwen.join("tokenizer.json").display(),
            qwen.join("tokenizer_config.json").display(),
            worker.base_url(),
        );
        let mut settings = cortex_gateway::config::Config::parse(&yaml)
            .unwrap()
            .into_settings(&cortex_gateway::demo::repo_root())
            .unwrap();
        if let Some(k) = ours {
            assert!(settings.models.set_worker_api_key(MODEL, cortex_proxy::WorkerKey::new(k).unwrap()));
        }
        let gw = cortex_gateway::start(settings, None).await.unwrap();
        let record = gw.gateway.control().registry().by_name("w0").unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let error = loop {
            if let Some(e) = record.status().last_error.filter(|e| e.contains("401")) {
                break e;
            }
            assert!(tokio::time::Instant::now() < deadline, "{engine} {ours:?}: {:?}", record.status());
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(error.contains(says) && error.contains("worker_api_key_env"), "{engine} {ours:?}: {error}");
        assert!(!error.contains("right") && !error.contains("wrong"), "no key is shown: {error}");
        assert_eq!(
            gw.gateway.control().live_workers(),
            0,
            "{engine} {ours:?}: a refusing worker is not live"
        );
        gw.shutdown().await;
    }
}

/// A self-signed certificate for `localhost`, written as `name.cert.pem` and `name.key.pem` in
/// `dir`; its DER.
fn write_pair(dir: &std::path::Path, cert: &str, key: &str) -> rustls::pki_types::CertificateDer<'static> {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    // The key first: a reload between the two writes sees a mismatched pair and keeps the old.
    std::fs::write(dir.join(key), c.signing_key.serialize_pem()).unwrap();
    std::fs::write(dir.join(cert), c.cert.pem()).unwrap();
    c.cert.der().clone()
}

/// `GET path` over TLS to `addr`, trusting only `trusted`: the status, or the error.
async fn https_get(
    addr: std::net::SocketAddr,
    trusted: &rustls::pki_types::CertificateDer<'static>,
    path: &str,
    token: Option<&str>,
) -> Result<StatusCode, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.map_err(|e| format!("handshake: {e}"))?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = Request::get(format!("https://localhost{path}")).header("host", "localhost");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp =
        send.send_request(req.body(Full::new(Bytes::new())).unwrap()).await.map_err(|e| e.to_string())?;
    Ok(resp.status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_both_listeners_with_a_certificate_reload() {
    let dir = std::env::temp_dir().join(format!("cortex-e2e-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let old = write_pair(&dir, "cert.pem", "key.pem");
    let tls = cortex_proxy::TlsConfig {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        reload_interval: Duration::from_millis(100),
    };
    let h = harness_with(
        "sglang",
        vec![sim("sglang")],
        &[],
        |s| {
            s.tls = Some(tls.clone());
            s.admin.as_mut().unwrap().tls = Some(tls.clone());
        },
        None,
    )
    .await;
    let (public, admin) = (h.addr(), h.admin_addr());
    assert_eq!(https_get(public, &old, "/health/live", None).await, Ok(StatusCode::OK));
    assert_eq!(https_get(admin, &old, "/admin/workers", Some(ADMIN_TOKEN)).await, Ok(StatusCode::OK));
    assert_eq!(https_get(admin, &old, "/admin/workers", None).await, Ok(StatusCode::UNAUTHORIZED));
    // Plain HTTP is not answered on either listener.
    for addr in [public, admin] {
        let plain = tokio::time::timeout(
            Duration::from_secs(5),
            h.client.request(
                Request::get(format!("http://{addr}/health/live")).body(Full::new(Bytes::new())).unwrap(),
            ),
        )
        .await
        .expect("the listener closes a plain connection");
        assert!(plain.is_err(), "plain HTTP was answered on {addr}");
    }
    // Renewed on disk: both listeners pick the new pair up; a client trusting only the old one
    // is refused.
    let new = write_pair(&dir, "cert.pem", "key.pem");
    for (addr, path, token) in [(public, "/health/live", None), (admin, "/admin/workers", Some(ADMIN_TOKEN))]
    {
        let deadline = tokio::time::Instant::now() + crate::common::WAIT;
        loop {
            let got = https_get(addr, &new, path, token).await;
            if got == Ok(StatusCode::OK) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{addr} never served the renewed certificate: {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let refused = https_get(addr, &old, path, token).await;
        assert!(refused.as_ref().is_err_and(|e| e.starts_with("handshake")), "{refused:?}");
    }
    // A broken file on disk never replaces the pair in service.
    std::fs::write(dir.join("key.pem"), "not a key").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(https_get(public, &new, "/health/live", None).await, Ok(StatusCode::OK));
    h.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_models_lists_what_the_workers_serve() {
    // A configured adapter no worker serves is not listed.
    let h = harness_with(
        "vllm",
        vec![sim("vllm")],
        &[],
        |s| assert!(s.models.add_adapter("m-sql", "/adapters/sql", MODEL)),
        None,
    )
    .await;
    let r = h.send("GET", "/v1/models", Bytes::new()).await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{v}");
    // The worker's own entry (vLLM reports its context length and owner).
    assert_eq!(data[0]["id"], MODEL);
    assert_eq!(data[0]["owned_by"], "vllm");
    assert_eq!(data[0]["max_model_len"], 32_768);
    // Every answer carries a request id, the ones Cortex makes itself too.
    for path in ["/v1/models", "/health/ready", "/health/live", "/metrics"] {
        let r = h.send("GET", path, Bytes::new()).await;
        assert!(r.header("x-request-id").starts_with("cortex-"), "{path}");
    }
    let id = h.gw.gateway.control().registry().by_name("w0").unwrap().id;
    h.gw.gateway.control().leave(id);
    let r = h.send("GET", "/v1/models", Bytes::new()).await;
    assert_eq!(r.json(), json!({"object": "list", "data": []}));
    h.shutdown().await;
}

/// `POST /admin/cache/flush` with the admin token.
async fn flush(h: &crate::common::Harness, query: &str) -> Value {
    let r = call(
        h,
        "POST",
        &format!("http://{}/admin/cache/flush{query}", h.admin_addr()),
        Some(ADMIN_TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    r.json()
}

fn ledger_blocks(h: &crate::common::Harness) -> u64 {
    h.gw.gateway.control().ledger().stats().blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_flush_fans_out_and_the_ledger_empties() {
    let h = harness("sglang", vec![slow_sim("sglang")], &[]).await;
    let r = h.post("/v1/chat/completions", &crate::common::chat(&long_prompt("flush"), false)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    h.wait("the ledger holds the prompt", || ledger_blocks(&h) > 0).await;
    // While a request runs, SGLang refuses: reported as the worker answered, with why.
    let caller = h.caller();
    let long = json!({"model": MODEL, "prompt": "keep decoding", "max_tokens": 100, "stream": true});
    let running = tokio::spawn(async move { caller.post("/v1/completions", &long).await });
    h.wait("the long request runs", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
    let busy = flush(&h, "").await;
    let w = &busy["workers"][0];
    assert_eq!(
        (w["worker"].as_str(), w["status"].as_u64(), w["flushed"].as_bool()),
        (Some("w0"), Some(400), Some(false)),
        "{busy}"
    );
    assert_eq!(w["route"], "/flush_cache");
    assert!(w["answer"].as_str().unwrap().contains("Cache not flushed"), "{busy}");
    assert!(w["note"].as_str().unwrap().contains("idle"), "{busy}");
    assert_eq!(busy["flushed"], 0);
    assert_eq!(running.await.unwrap().status, StatusCode::OK);
    h.wait("the worker is idle", || h.sims[0].in_flight(0).unwrap_or(1) == 0).await;
    let idle = flush(&h, "?worker=w0").await;
    assert_eq!(idle["workers"][0]["status"], 200, "{idle}");
    assert_eq!(idle["flushed"], 1);
    assert!(idle["ledger"]["blocks_before"].as_u64() > Some(0), "{idle}");
    // The answer waits for the worker's clear event: the ledger it reports is the emptied one.
    assert_eq!(
        (idle["ledger"]["blocks_after"].as_u64(), idle["ledger"]["cleared"].as_bool()),
        (Some(0), Some(true)),
        "{idle}"
    );
    assert_eq!(ledger_blocks(&h), 0);
    let r = call(
        &h,
        "POST",
        &format!("http://{}/admin/cache/flush?worker=nope", h.admin_addr()),
        Some(ADMIN_TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r =
        call(&h, "POST", &format!("http://{}/admin/cache/flush", h.addr()), Some(ADMIN_TOKEN), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "not on the public listener");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_query_parameters_are_checked_and_unknown_workers_named() {
    let h = harness("sglang", vec![slow_sim("sglang")], &[]).await;
    let admin = h.admin_addr();
    let r = h.post("/v1/chat/completions", &crate::common::chat(&long_prompt("typo"), false)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    h.wait("the ledger holds the prompt", || ledger_blocks(&h) > 0).await;
    let route = json!({"model": MODEL, "prompt": "hi"});
    for (method, path, body, says) in [
        ("POST", "/admin/cache/flush?workers=w0", None, "query parameter `workers` is unknown"),
        ("POST", "/admin/cache/flush?worker=", None, "query parameter `worker` must not be empty"),
        ("POST", "/admin/cache/flush?worker=w0&worker=w0", None, "`worker` is given twice"),
        (
            "GET",
            "/admin/workers?verbose=1",
            None,
            "`verbose` is unknown: /admin/workers takes no query parameter",
        ),
        ("GET", "/debug/workers?worker=w0", None, "`worker` is unknown"),
        ("DELETE", "/admin/workers/w0?force=1", None, "`force` is unknown"),
        (
            "POST",
            "/debug/route?rout=generate",
            Some(&route),
            "`rout` is unknown: /debug/route takes only `route`",
        ),
        (
            "POST",
            "/debug/route?route=bogus",
            Some(&route),
            "`route` must be generate, chat_completions, completions, not `bogus`",
        ),
    ] {
        let r = call(&h, method, &format!("http://{admin}{path}"), Some(ADMIN_TOKEN), body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{method} {path}: {}", r.body);
        let e = openai_error(&r);
        assert_eq!(e["code"], "invalid_request", "{method} {path}");
        assert!(e["message"].as_str().unwrap().contains(says), "{method} {path}: {}", r.body);
    }
    // Nothing was flushed and nothing removed by a refused call.
    assert!(ledger_blocks(&h) > 0);
    assert!(h.gw.gateway.control().registry().by_name("w0").is_some());
    // The route given is the one the body is parsed as.
    let url = format!("http://{admin}/debug/route?route=chat_completions");
    let r = call(&h, "POST", &url, Some(ADMIN_TOKEN), Some(&route)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "a completion body read as a chat: {}", r.body);
    assert!(openai_error(&r)["message"].as_str().unwrap().contains("messages"), "{}", r.body);
    let url = format!("http://{admin}/debug/route?route=completions");
    assert_eq!(call(&h, "POST", &url, Some(ADMIN_TOKEN), Some(&route)).await.status, StatusCode::OK);
    // A worker that does not exist is named, not reported as a missing route.
    for (method, path) in [("DELETE", "/admin/workers/nope"), ("POST", "/admin/cache/flush?worker=nope")] {
        let r = call(&h, method, &format!("http://{admin}{path}"), Some(ADMIN_TOKEN), None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{method} {path}: {}", r.body);
        let e = openai_error(&r);
        assert_eq!(e["code"], "not_found");
        assert_eq!(e["message"], "no worker named `nope` exists", "{method} {path}");
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_flush_reports_the_dev_mode_route() {
    let mut dev = sim("vllm");
    if let cortex_sim::EngineConfig::Vllm(o) = &mut dev.engine {
        o.dev_mode = true;
    }
    let h = harness("vllm", vec![sim("vllm"), dev], &[]).await;
    let r = h
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": long_prompt("vllm flush"), "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = flush(&h, "").await;
    let (w0, w1) = (&v["workers"][0], &v["workers"][1]);
    assert_eq!((w0["worker"].as_str(), w0["status"].as_u64()), (Some("w0"), Some(404)), "{v}");
    assert_eq!(w0["route"], "/reset_prefix_cache");
    assert!(w0["note"].as_str().unwrap().contains("VLLM_SERVER_DEV_MODE"), "{v}");
    assert_eq!(
        (w1["worker"].as_str(), w1["status"].as_u64(), w1["flushed"].as_bool()),
        (Some("w1"), Some(200), Some(true)),
        "{v}"
    );
    assert_eq!(v["flushed"], 1);
    h.shutdown().await;
}
