//! Observability, end to end: every request counted once with its outcome, latencies as
//! histograms, per-worker hits, the JSON access log, and spans at a fake OTLP collector whose
//! `traceparent` the simulated workers receive.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::common::{
    Harness, MODEL, Reply, chat, harness_with, long_prompt, metric, prometheus, sim, slow_sim,
};

/// `cortex_requests_total` of `outcome` (every route and mode).
fn outcomes(text: &str, outcome: &str) -> f64 {
    metric(text, "cortex_requests_total", &[("outcome", outcome)])
}

async fn scrape(h: &Harness) -> String {
    h.send("GET", "/metrics", Bytes::new()).await.body
}

/// Waits until the outcome counter has grown past `before`.
async fn wait_counted(h: &Harness, outcome: &str, before: f64) {
    let deadline = tokio::time::Instant::now() + crate::common::WAIT;
    loop {
        if outcomes(&scrape(h).await, outcome) > before {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no request counted as {outcome}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends `body` to `path` with `headers`.
async fn post_with(h: &Harness, path: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut req = Request::builder()
        .method("POST")
        .uri(format!("http://{}{path}", h.addr()))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = h
        .caller()
        .client()
        .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    Reply { status: parts.status, headers: parts.headers, body: String::from_utf8_lossy(&body).into_owned() }
}

/// Each kind of ending is counted once under its outcome: an answer relayed to its end (`ok`),
/// the worker's own refusal (`rejected`), a gateway error (`error`, with no match mode), a
/// client that left mid-stream or before the answer's head (`client_gone`), and a stream the
/// worker broke (`stream_failed`). (The recorder is shared by the tests of this binary: the
/// counts are compared before and after, at least one more each.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_is_counted_once() {
    let h = harness_with("vllm", vec![slow_sim("vllm")], &[], |_| {}, Some(prometheus())).await;
    let body = chat(&long_prompt("outcomes"), false);
    let before = scrape(&h).await;

    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    wait_counted(&h, "ok", outcomes(&before, "ok")).await;

    // The worker refuses (its own 400): passed on, and counted as rejected.
    h.worker("w0").fail_next(400, 1);
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    wait_counted(&h, "rejected", outcomes(&before, "rejected")).await;

    // A gateway error before any decision: no match mode.
    let unknown = json!({"model": "no-such-model", "prompt": "hi", "max_tokens": 2});
    let r = h.post("/v1/completions", &unknown).await;
    assert!(r.status.is_client_error(), "{}", r.body);
    let text = scrape(&h).await;
    assert!(
        metric(
            &text,
            "cortex_requests_total",
            &[("route", "completions"), ("mode", "none"), ("outcome", "error")]
        ) > metric(
            &before,
            "cortex_requests_total",
            &[("route", "completions"), ("mode", "none"), ("outcome", "error")]
        ),
        "{text}"
    );

    // The client reads the head and the first chunk of a stream, then leaves.
    let gone_before = outcomes(&scrape(&h).await, "client_gone");
    let mut stream = chat(&long_prompt("outcomes"), true);
    stream["max_tokens"] = json!(200);
    let req = Request::builder()
        .method("POST")
        .uri(format!("http://{}/v1/chat/completions", h.addr()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(stream.to_string())))
        .unwrap();
    let resp = h.caller().client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut b = resp.into_body();
    let first = b.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
    drop(b);
    wait_counted(&h, "client_gone", gone_before).await;

    // The client leaves before the answer's head: the worker holds the request. (The stream
    // left above is aborted on the worker first, so that the request seen below is this one.)
    h.wait("the worker is idle", || h.worker("w0").in_flight_http() == 0).await;
    let gone_before = outcomes(&scrape(&h).await, "client_gone");
    h.worker("w0").stall();
    let task = tokio::spawn({
        let (c, b) = (h.caller(), body.clone());
        async move { c.post("/v1/chat/completions", &b).await.status }
    });
    h.wait("the worker got the request", || h.worker("w0").in_flight_http() > 0).await;
    task.abort();
    wait_counted(&h, "client_gone", gone_before).await;
    h.worker("w0").resume();

    // The worker dies mid-stream: the stream ends with an error event, counted as stream_failed.
    let failed_before = outcomes(&scrape(&h).await, "stream_failed");
    h.worker("w0").die_mid_stream(2, 1);
    let r = h.post("/v1/chat/completions", &stream).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.contains("error"), "{}", r.body);
    wait_counted(&h, "stream_failed", failed_before).await;
    h.shutdown().await;
}

/// Latencies are histograms with their own buckets (never summaries), the hit counters carry
/// the worker, the hit rate's denominator is there, and counters of known label values exist
/// before anything happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histograms_and_per_worker_hits() {
    let h = harness_with("sglang", vec![sim("sglang"), sim("sglang")], &[], |_| {}, Some(prometheus())).await;
    let fresh = scrape(&h).await;
    for series in [
        "cortex_fallback_total{reason=\"watermark\"} ",
        "cortex_requests_total{route=\"generate\",mode=\"fallback_p2c\",outcome=\"client_gone\"} ",
        "cortex_pd_fallbacks_total{reason=\"transfer_failed\"} ",
        "cortex_realized_hit_tokens_total{worker=\"w1\"} ",
        // (Presence only: the recorder is shared with other tests' gateways, whose own w0 may
        // be down when they scrape.)
        "cortex_worker_admissible{worker=\"w0\"} ",
        "cortex_worker_kv_usage_ratio{",
    ] {
        assert!(fresh.contains(series), "{series} missing from a fresh scrape:\n{fresh}");
    }
    let body = chat(&long_prompt("histograms"), false);
    let first = h.post("/v1/chat/completions", &body).await;
    let holder = first.header("x-cortex-assigned-worker").to_owned();
    h.wait_hit(&body, |w, hit| w == holder && hit > 0).await;
    let before = scrape(&h).await;
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.header("x-cortex-assigned-worker"), holder);
    let predicted: f64 = r.header("x-cortex-cache-hit-tokens").parse().unwrap();
    let text = scrape(&h).await;
    let grew = |name: &str| {
        metric(&text, name, &[("worker", &holder)]) - metric(&before, name, &[("worker", &holder)])
    };
    assert!(grew("cortex_predicted_hit_tokens_total") >= predicted, "{text}");
    assert!(grew("cortex_realized_hit_tokens_total") > 0.0, "{text}");
    assert!(grew("cortex_prompt_tokens_total") >= grew("cortex_realized_hit_tokens_total"), "{text}");
    for bucket in [
        "cortex_routing_decision_seconds_bucket{le=\"0.000005\"}",
        "cortex_tokenize_seconds_bucket{le=",
        "cortex_hash_seconds_bucket{le=\"0.000001\"}",
        "cortex_first_byte_seconds_bucket{route=\"chat_completions\",le=\"0.005\"}",
        "cortex_request_duration_seconds_bucket{route=\"chat_completions\",outcome=\"ok\",le=\"600\"}",
        "cortex_upstream_head_seconds_bucket{le=",
    ] {
        assert!(text.contains(bucket), "{bucket} missing:\n{text}");
    }
    assert!(!text.contains("quantile="), "a summary is rendered:\n{text}");
    // A streaming answer's first chunk counts how far the decision's estimated time to first
    // token was from it, in the histogram and on the worker's rank in /debug/workers.
    let r = h.post("/v1/chat/completions", &chat(&long_prompt("estimate"), true)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let worker = r.header("x-cortex-assigned-worker").to_owned();
    let text = scrape(&h).await;
    assert!(text.contains("cortex_ttft_estimate_error_seconds_bucket{le=\"0.005\"}"), "{text}");
    let view = h.debug_workers().await;
    let w = view["workers"].as_array().into_iter().flatten().find(|w| w["name"] == worker.as_str());
    let e = &w.expect("the assigned worker")["ranks"][0]["learned"]["estimate_error"];
    assert!(e["samples"].as_u64().is_some_and(|n| n >= 1), "{view}");
    assert!(e["abs_p50_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{view}");
    h.shutdown().await;
}

/// The lines the `cortex::access` target wrote in this process (a global subscriber, installed
/// once: the tests of this binary run on many threads).
fn access_lines() -> &'static Mutex<Vec<String>> {
    static LINES: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    LINES.get_or_init(|| {
        use tracing_subscriber::Layer;
        use tracing_subscriber::layer::SubscriberExt;
        struct Capture;
        impl<S: tracing::Subscriber> Layer<S> for Capture {
            fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
                struct M(String);
                impl tracing::field::Visit for M {
                    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                        if f.name() == "message" {
                            self.0 = format!("{v:?}");
                        }
                    }
                }
                let mut m = M(String::new());
                event.record(&mut m);
                access_lines().lock().unwrap().push(m.0);
            }
        }
        let filter = tracing_subscriber::filter::Targets::new()
            .with_target(cortex_proxy::observe::ACCESS_TARGET, tracing::Level::INFO);
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(Capture.with_filter(filter)),
        );
        Mutex::new(Vec::new())
    })
}

/// The JSON access line of the request `id`, once written.
fn access_line(id: &str) -> Option<Value> {
    access_lines()
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["request_id"] == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_access_log_has_a_line_per_request() {
    access_lines();
    let h = harness_with(
        "vllm",
        vec![sim("vllm"), sim("vllm")],
        &[("access_log", "{format: json}")],
        |_| {},
        None,
    )
    .await;
    let body = chat(&long_prompt("access"), false);
    let r = post_with(&h, "/v1/chat/completions", &body, &[("x-request-id", "access-log-1")]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let find = || access_line("access-log-1");
    h.wait("the access line", || find().is_some()).await;
    let line = find().unwrap();
    assert_eq!(line["model"], MODEL, "{line}");
    assert_eq!(line["route"], "chat_completions", "{line}");
    assert_eq!(line["worker"], r.header("x-cortex-assigned-worker"), "{line}");
    assert_eq!(line["rank"], 0, "{line}");
    assert_eq!(line["mode"], r.header("x-cortex-match-mode"), "{line}");
    assert_eq!(line["predicted_hit_tokens"].to_string(), r.header("x-cortex-cache-hit-tokens"), "{line}");
    assert!(line["realized_hit_tokens"].is_u64(), "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["outcome"], "ok", "{line}");
    assert!(line["duration_ms"].as_f64().unwrap() >= line["first_byte_ms"].as_f64().unwrap(), "{line}");
    // A gateway error has its line too, with no worker.
    let r = post_with(
        &h,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
        &[("x-request-id", "access-log-2")],
    )
    .await;
    assert!(r.status.is_client_error());
    let find2 = || access_line("access-log-2");
    h.wait("the error's access line", || find2().is_some()).await;
    let line = find2().unwrap();
    assert_eq!((line["outcome"].as_str(), line["worker"].is_null()), (Some("error"), true), "{line}");
    // Every attempt failed: no answer head names a worker, but the line names the last one tried
    // (it had none, `attempts` 2, a probe's finding).
    for s in &h.sims {
        s.fail_next(500, 1);
    }
    let r = post_with(&h, "/v1/chat/completions", &body, &[("x-request-id", "access-log-3")]).await;
    assert!(r.status.is_server_error(), "{}", r.body);
    let find3 = || access_line("access-log-3");
    h.wait("the failed request's access line", || find3().is_some()).await;
    let line = find3().unwrap();
    assert_eq!(line["attempts"], 2, "{line}");
    assert!(line["worker"] == "w0" || line["worker"] == "w1", "{line}");
    assert_eq!(line["rank"], 0, "{line}");
    h.shutdown().await;
}

/// A fake OTLP/HTTP collector on loopback: every JSON body POSTed to `/v1/traces`.
async fn collector() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got: Arc<Mutex<Vec<Value>>> = Arc::default();
    let g = Arc::clone(&got);
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let g = Arc::clone(&g);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let g = Arc::clone(&g);
                    async move {
                        let path = req.uri().path().to_owned();
                        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        if path == "/v1/traces"
                            && let Ok(v) = serde_json::from_slice::<Value>(&body)
                        {
                            g.lock().unwrap().push(v);
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(s);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
            });
        }
    });
    (addr, got)
}

/// Every span the collector received.
fn spans(got: &Mutex<Vec<Value>>) -> Vec<Value> {
    got.lock()
        .unwrap()
        .iter()
        .flat_map(|v| v["resourceSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|r| r["scopeSpans"].as_array().cloned().unwrap_or_default())
        .flat_map(|s| s["spans"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    span["attributes"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["key"] == key))
        .map_or(&Value::Null, |x| &x["value"])
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// Sends a traced request (the client's own `traceparent`), waits for the spans of the trace,
/// and returns the request span and its client spans by leg.
async fn traced(
    h: &Harness,
    got: &Mutex<Vec<Value>>,
    client_span: &str,
    body: &Value,
) -> (Reply, Value, Vec<Value>) {
    let tp = format!("00-{TRACE}-{client_span}-01");
    let r = post_with(h, "/v1/chat/completions", body, &[("traceparent", &tp)]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let request_span = || {
        spans(got)
            .into_iter()
            .find(|s| s["traceId"] == TRACE && s["kind"] == 2 && s["parentSpanId"] == client_span)
    };
    h.wait("the request span at the collector", || request_span().is_some()).await;
    let rs = request_span().unwrap();
    let children =
        || spans(got).into_iter().filter(|s| s["parentSpanId"] == rs["spanId"]).collect::<Vec<_>>();
    (r, rs.clone(), children())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_and_the_worker_sees_its_parent() {
    let (addr, got) = collector().await;
    let tracing = format!("{{endpoint: 'http://{addr}', sample_ratio: 0.0}}");
    let h =
        harness_with("vllm", vec![sim("vllm"), sim("vllm")], &[("tracing", &tracing)], |_| {}, None).await;
    let body = chat(&long_prompt("traced"), false);
    let (r, rs, _) = traced(&h, &got, "00f067aa0ba902b7", &body).await;
    let worker = r.header("x-cortex-assigned-worker").to_owned();
    assert_eq!(attr(&rs, "cortex.worker")["stringValue"], worker.as_str(), "{rs}");
    assert_eq!(attr(&rs, "cortex.model")["stringValue"], MODEL, "{rs}");
    assert_eq!(attr(&rs, "cortex.match_mode")["stringValue"], r.header("x-cortex-match-mode"), "{rs}");
    assert_eq!(attr(&rs, "cortex.rank")["intValue"], "0", "{rs}");
    assert!(attr(&rs, "cortex.predicted_hit_tokens")["intValue"].is_string(), "{rs}");
    // The attempt's span (exported when its answer was relayed) is the worker's parent.
    let attempt = || spans(&got).into_iter().find(|s| s["parentSpanId"] == rs["spanId"] && s["kind"] == 3);
    h.wait("the attempt span", || attempt().is_some()).await;
    let a = attempt().unwrap();
    assert_eq!(attr(&a, "cortex.worker")["stringValue"], worker.as_str(), "{a}");
    let expected = format!("00-{TRACE}-{}-01", a["spanId"].as_str().unwrap());
    assert!(
        h.worker(&worker).traceparents().contains(&expected),
        "{:?} vs {expected}",
        h.worker(&worker).traceparents()
    );
    // Not sampled by the client, and the ratio is 0: no span, and the client's own header goes on.
    let before = spans(&got).len();
    let tp = format!("00-{TRACE}-00f067aa0ba90200-00");
    let r = post_with(&h, "/v1/chat/completions", &body, &[("traceparent", &tp)]).await;
    assert_eq!(r.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(700)).await; // longer than an export batch waits
    assert_eq!(spans(&got).len(), before, "an unsampled request made spans");
    let w = r.header("x-cortex-assigned-worker");
    assert_eq!(h.worker(w).traceparents().last(), Some(&tp));
    // A graceful shutdown sends what is queued: the spans of a request just answered arrive
    // before it returns.
    let last_span = "00f067aa0ba902ff";
    let r = post_with(
        &h,
        "/v1/chat/completions",
        &body,
        &[("traceparent", &format!("00-{TRACE}-{last_span}-01"))],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    h.shutdown().await;
    assert!(
        spans(&got).iter().any(|s| s["parentSpanId"] == last_span),
        "the last request's span was not flushed"
    );
}

async fn pd_legs_are_traced(engine: &str) {
    let (addr, got) = collector().await;
    let tracing = format!("{{endpoint: 'http://{addr}'}}");
    let role = |r| {
        let mut c = sim(engine);
        c.role = r;
        c
    };
    let (p, d) = (cortex_sim::Role::Prefill, cortex_sim::Role::Decode);
    let h = harness_with(
        engine,
        vec![role(p), role(p), role(d), role(d)],
        &[("tracing", &tracing)],
        |_| {},
        None,
    )
    .await;
    let body = chat(&long_prompt(&format!("pd traced {engine}")), false);
    let (r, rs, _) = traced(&h, &got, "00f067aa0ba902b8", &body).await;
    assert_eq!(r.header("x-cortex-pd"), "disaggregated", "{:?}", r.headers);
    assert_eq!(attr(&rs, "cortex.pd")["stringValue"], "disaggregated", "{rs}");
    let (pw, dw) =
        (r.header("x-cortex-prefill-worker").to_owned(), r.header("x-cortex-assigned-worker").to_owned());
    assert_eq!(attr(&rs, "cortex.prefill_worker")["stringValue"], pw.as_str(), "{rs}");
    for (leg, worker) in [("prefill", &pw), ("decode", &dw)] {
        let span = || {
            spans(&got)
                .into_iter()
                .find(|s| s["parentSpanId"] == rs["spanId"] && attr(s, "cortex.leg")["stringValue"] == leg)
        };
        h.wait("the leg's span", || span().is_some()).await;
        let s = span().unwrap();
        assert_eq!(attr(&s, "cortex.worker")["stringValue"], worker.as_str(), "{s}");
        let expected = format!("00-{TRACE}-{}-01", s["spanId"].as_str().unwrap());
        let seen = h.worker(worker).traceparents();
        assert!(seen.contains(&expected), "{engine} {leg} worker {worker} saw {seen:?}, not {expected}");
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_legs_are_traced_vllm() {
    pd_legs_are_traced("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_legs_are_traced_sglang() {
    pd_legs_are_traced("sglang").await;
}

/// The values of every sample of `name` whose `worker` label is `worker`, in Prometheus text.
fn samples(text: &str, name: &str, worker: &str) -> Vec<f64> {
    let label = format!("worker=\"{worker}\"");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| series.split_once('{').is_some_and(|(n, l)| n == name && l.contains(&label)))
        .filter_map(|(_, v)| v.parse().ok())
        .collect()
}

/// A worker removed through the admin API takes its gauges out of `/metrics` (its counters
/// stay): the remaining worker's are there and say it is not admissible, so the largest
/// `cortex_worker_admissible` of the instance is 0, as `CortexNoAdmissibleWorker` needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_workers_gauges_leave_metrics() {
    let h = harness_with("vllm", vec![sim("vllm")], &[], |_| {}, Some(prometheus())).await;
    // Named by no other test of this binary: they share the recorder.
    let gone = "gone-x5";
    let extra = cortex_sim::SimWorker::start(sim("vllm")).unwrap();
    let admin = |method: &str, path: &str, body: Option<Value>| {
        Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", h.admin_addr()))
            .header("authorization", format!("Bearer {}", crate::common::ADMIN_TOKEN))
            .body(Full::new(body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string()))))
            .unwrap()
    };
    let new = json!({"name": gone, "url": extra.base_url(), "engine": "vllm", "model": MODEL});
    let resp = h.client.request(admin("POST", "/admin/workers", Some(new))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    h.wait("the added worker is live", || h.live_workers() == 2).await;
    let deadline = tokio::time::Instant::now() + crate::common::WAIT;
    loop {
        let text = scrape(&h).await;
        let ready = metric(&text, "cortex_ledger_state", &[("worker", gone), ("state", "ready")]);
        if samples(&text, "cortex_worker_admissible", gone) == [1.0]
            && samples(&text, "cortex_worker_live", gone) == [1.0]
            && ready == 1.0
            && !samples(&text, "cortex_worker_inflight_requests", gone).is_empty()
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the added worker's gauges never showed it ready:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The remaining worker leaves the live pool: the next requests (and their KV events) all
    // go to the worker about to be removed, after the scrape above saw its event counts.
    h.worker("w0").set_healthy(false);
    h.wait("w0 left the live pool", || h.live_workers() == 1).await;
    let batches_before = samples(&scrape(&h).await, "cortex_event_batches_total", gone).iter().sum::<f64>();
    for i in 0..4 {
        let body = json!({"model": MODEL, "prompt": long_prompt(&format!("before its removal {i}")), "max_tokens": 2});
        assert_eq!(post_with(&h, "/v1/completions", &body, &[]).await.status, StatusCode::OK);
    }
    let holder = h.holder(gone);
    let published = || extra.last_seq(0).map_or(0, |s| s + 1);
    h.wait("every batch the worker published is applied", || {
        h.gw.ingest.status(holder).is_some_and(|st| st.batches == published())
    })
    .await;
    // One request is in flight across the removal (its worker stalled until then): when it
    // ends, its hit counters are the removed worker's, not a worker named "".
    extra.stall();
    let in_flight = tokio::spawn({
        let client = h.client.clone();
        let body = json!({"model": MODEL, "prompt": long_prompt("across the removal"), "max_tokens": 2});
        let uri = format!("http://{}/v1/completions", h.addr());
        async move {
            let req = Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            let status = resp.status();
            resp.into_body().collect().await.unwrap();
            status
        }
    });
    h.wait("the request reached the worker", || extra.in_flight(0).unwrap_or(0) > 0).await;
    let resp = h.client.request(admin("DELETE", &format!("/admin/workers/{gone}"), None)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    h.wait("the removed worker left the pool", || h.live_workers() == 0).await;
    // The event plane lets go of it asynchronously: until it has, a batch the resumed request
    // publishes could still be applied (under CI load it was, once: 5 batches counted for 4).
    h.wait("its events are no longer followed", || h.gw.ingest.status(holder).is_none()).await;
    // What it had published when it was removed (the stalled request publishes after).
    let published_when_removed = published();
    extra.resume();
    assert_eq!(in_flight.await.unwrap(), StatusCode::OK);
    let text = scrape(&h).await;
    assert!(!text.contains("worker=\"\""), "a series under no worker name:\n{text}");
    // Its final event counts are counted, though it left the registry before this scrape.
    let batches = samples(&text, "cortex_event_batches_total", gone).iter().sum::<f64>();
    assert!(batches > batches_before, "{batches} after {batches_before}");
    assert_eq!(batches, published_when_removed as f64, "{text}");
    let series: Vec<&str> =
        text.lines().filter(|l| !l.starts_with('#') && l.contains(&format!("worker=\"{gone}\""))).collect();
    assert!(
        series.iter().all(|l| l.split(['{', ' ']).next().is_some_and(|n| n.ends_with("_total"))),
        "{text}"
    );
    assert!(
        series.iter().any(|l| l.starts_with("cortex_prompt_tokens_total{")),
        "its counters stay:\n{text}"
    );
    assert_eq!(samples(&text, "cortex_worker_admissible", "w0"), [0.0], "{text}");
    assert_eq!(samples(&text, "cortex_worker_live", "w0"), [0.0], "{text}");
    assert_eq!(samples(&text, "cortex_worker_aligned", "w0").len(), 1, "{text}");
    assert_eq!(samples(&text, "cortex_ledger_state", "w0").len(), 4, "{text}");
    let admissible: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("cortex_worker_admissible{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
        .collect();
    assert_eq!(admissible, [0.0], "max by (instance) (cortex_worker_admissible) must be 0:\n{text}");
    // Each per-worker gauge is described once, before its samples.
    for name in ["cortex_worker_admissible", "cortex_ledger_state"] {
        assert_eq!(text.matches(&format!("# TYPE {name} gauge\n")).count(), 1, "{text}");
        assert_eq!(text.matches(&format!("# HELP {name} ")).count(), 1, "{text}");
    }
    h.shutdown().await;
    extra.shutdown();
}

/// An answer its client reads nothing of (an HTTP/2 stream whose window is 0) is given up after
/// `client_write_timeout` and counted at once: in `cortex_client_write_timeouts_total`, and as
/// `client_gone`, never as the worker's `stream_failed` (the client's body may never be polled
/// or dropped again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_given_up_on_its_client_is_client_gone() {
    let h = harness_with(
        "vllm",
        vec![slow_sim("vllm")],
        &[],
        |s| s.proxy.limits.client_write_timeout = Duration::from_millis(300),
        Some(prometheus()),
    )
    .await;
    let before = scrape(&h).await;
    let timeouts = |text: &str| metric(text, "cortex_client_write_timeouts_total", &[("scope", "answer")]);
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(h.addr()).await.unwrap());
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .initial_stream_window_size(0)
        .handshake(io)
        .await
        .unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut body = chat(&long_prompt("never read"), true);
    body["max_tokens"] = json!(200);
    let req = Request::builder()
        .method("POST")
        .uri("http://x/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let stalled = send.send_request(req).await.unwrap();
    assert_eq!(stalled.status(), StatusCode::OK);
    let deadline = tokio::time::Instant::now() + crate::common::WAIT;
    let text = loop {
        let text = scrape(&h).await;
        if timeouts(&text) > timeouts(&before) {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "never given up:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Counted as it was given up, though the stream is still open and its body never polled.
    // (The recorder is shared by this binary's tests, which run at once: only counts that grow
    // are compared.)
    assert!(outcomes(&text, "client_gone") > outcomes(&before, "client_gone"), "{text}");
    drop(stalled);
    driver.abort();
    h.shutdown().await;
}
