//! Shared by the end-to-end test binaries: a gateway (real HTTP, real ZeroMQ ingest) started in
//! process in front of simulated workers on loopback, and the helpers that drive and observe it.
//! Waits poll observable state under a deadline, never a fixed sleep.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses part of it; a failed setup step should panic

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use cortex_gateway::config::Config;
use cortex_gateway::{Running, demo};
use cortex_sim::{Role, SimConfig, SimWorker, Timing};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};

pub(crate) const WAIT: Duration = Duration::from_secs(20);
pub(crate) const MODEL: &str = "m";
/// The admin listener's token: every harness opens an admin listener, where `/debug/*` lives.
pub(crate) const ADMIN_TOKEN: &str = "admin-s3cret";

/// An admin listener on a free loopback port, behind [`ADMIN_TOKEN`].
pub(crate) fn admin_settings() -> cortex_gateway::config::AdminSettings {
    cortex_gateway::config::AdminSettings {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: cortex_proxy::Token::new(ADMIN_TOKEN),
        tls: None,
    }
}

/// `path` is served by the admin listener (the debug views).
fn on_admin(path: &str) -> bool {
    path.starts_with("/debug/") || path.starts_with("/admin/")
}

/// The gateway's YAML sections every test starts from (fast probes, small alignment windows,
/// short ingest timeouts); a test replaces one by naming it.
const SECTIONS: [(&str, &str); 4] = [
    (
        "probes",
        "{health_interval: 200ms, load_interval: 100ms, timeout: 2s, failures_to_remove: 2, successes_to_restore: 1}",
    ),
    ("alignment", "{settle: 100ms, min_samples: 2, window: 4}"),
    ("ingest", "{silence_timeout: 500ms, replay_timeout: 1s}"),
    ("limits", "{max_body: 65536}"),
];

/// A gateway in front of workers `w0`, `w1`, …: in-process [`SimWorker`]s, or whatever else a
/// test binary drives them as (the fault suite's worker processes).
pub(crate) struct Harness<W = SimWorker> {
    pub(crate) sims: Vec<W>,
    pub(crate) gw: Running,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    /// The configuration the gateway was started from (another replica starts from it too).
    pub(crate) yaml: String,
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// The OpenAI error `code` of a gateway error response.
    pub(crate) fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or_default().to_owned()
    }
}

/// A simulated worker of `engine` serving [`MODEL`] instantly (virtual time, speed 0).
pub(crate) fn sim(engine: &str) -> SimConfig {
    let mut c = if engine == "vllm" { SimConfig::vllm() } else { SimConfig::sglang() };
    c.model_name = MODEL.to_owned();
    c.timing = Timing { speed: 0.0, ..Timing::default() };
    c
}

/// A simulated worker that runs in real time: 20 ms per decoded token.
pub(crate) fn slow_sim(engine: &str) -> SimConfig {
    let mut c = sim(engine);
    c.timing = Timing { speed: 1.0, itl_base: Duration::from_millis(20), ..Timing::default() };
    c
}

/// Starts `sims` and a gateway in front of them (workers `w0`, `w1`, … in that order), with
/// [`SECTIONS`] overridden or extended by `sections` (`("limits", "{…}")`, `("mode", "proxy_only")`),
/// and waits until every worker is live.
pub(crate) async fn harness(engine: &str, sims: Vec<SimConfig>, sections: &[(&str, &str)]) -> Harness {
    harness_with(engine, sims, sections, |_| {}, None).await
}

pub(crate) async fn harness_with(
    engine: &str,
    sims: Vec<SimConfig>,
    sections: &[(&str, &str)],
    adjust: impl FnOnce(&mut cortex_gateway::Settings),
    prometheus: Option<PrometheusHandle>,
) -> Harness {
    let sims: Vec<SimWorker> = sims.into_iter().map(|c| SimWorker::start(c).unwrap()).collect();
    let workers: Vec<(String, Role)> = sims.iter().map(|s| (s.base_url(), s.config().role)).collect();
    gateway_in_front(engine, sims, &workers, sections, adjust, prometheus).await
}

/// Starts a gateway in front of running workers, `workers` giving each one's base URL and role
/// in the order of `sims`, and waits until every worker is live.
pub(crate) async fn gateway_in_front<W>(
    engine: &str,
    sims: Vec<W>,
    workers: &[(String, Role)],
    sections: &[(&str, &str)],
    adjust: impl FnOnce(&mut cortex_gateway::Settings),
    prometheus: Option<PrometheusHandle>,
) -> Harness<W> {
    let mut list = String::from(if workers.is_empty() { " []\n" } else { "\n" });
    for (i, (url, role)) in workers.iter().enumerate() {
        let role = match role {
            Role::Unified => "regular",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        list.push_str(&format!(
            "  - {{name: w{i}, url: '{url}', engine: {engine}, model: {MODEL}, role: {role}}}\n"
        ));
    }
    let mut all: Vec<(&str, &str)> = SECTIONS.to_vec();
    // `("model", "{…}")`: more keys of the model's entry (`{cache_salt: load_only}`).
    let model_keys = sections.iter().find(|(k, _)| *k == "model").map_or("{}", |s| s.1);
    for &(key, value) in sections.iter().filter(|(k, _)| *k != "model") {
        match all.iter_mut().find(|(k, _)| *k == key) {
            Some(s) => s.1 = value,
            None => all.push((key, value)),
        }
    }
    let qwen = demo::repo_root().join("golden/models/qwen3");
    let model_keys = model_keys.trim().trim_start_matches('{').trim_end_matches('}');
    let model_keys = if model_keys.trim().is_empty() { String::new() } else { format!(", {model_keys}") };
    let mut yaml = format!(
        "listen: '127.0.0.1:0'
models:
  - {{name: {MODEL}, engine: {engine}, tokenizer: '{}', tokenizer_config: '{}', block_size: 16{model_keys}}}
workers:{list}",
        qwen.join("tokenizer.json").display(),
        qwen.join("tokenizer_config.json").display(),
    );
    for (key, value) in all {
        yaml.push_str(&format!("{key}: {value}\n"));
    }
    let mut settings = Config::parse(&yaml).unwrap().into_settings(&demo::repo_root()).unwrap();
    settings.admin = Some(admin_settings());
    adjust(&mut settings);
    let gw = cortex_gateway::start(settings, prometheus).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let h = Harness { sims, gw, client, yaml };
    h.wait("every worker live", || h.live_workers() >= h.sims.len()).await;
    h
}

/// The process's Prometheus recorder (installed once per test binary: it is global), with the
/// gateway's metric descriptions.
pub(crate) fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = cortex_proxy::telemetry::prometheus_builder().install_recorder().unwrap();
            cortex_proxy::telemetry::describe();
            handle
        })
        .clone()
}

/// The sum of the samples of `name` whose labels include every `(key, value)` of `labels`, in
/// Prometheus text; 0 when there is none.
pub(crate) fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            let (n, l) = series.split_once('{').unwrap_or((series, ""));
            n == name && labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .fold(0.0, |sum, v| sum + v)
}

impl<W> Harness<W> {
    /// Stops the gateway, then the workers. The client's pool is closed first, as a well-behaved
    /// client's would be (a silent spare connection no longer holds the gateway's shutdown:
    /// `e2e_limits.rs` pins that).
    pub(crate) async fn shutdown(self) {
        let Harness { sims, gw, client, .. } = self;
        drop(client);
        gw.shutdown().await;
        drop(sims);
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.gw.addr
    }

    /// The admin listener's address.
    pub(crate) fn admin_addr(&self) -> SocketAddr {
        self.gw.admin_addr.unwrap()
    }

    /// Another gateway replica in front of the same workers, from the same configuration (its
    /// own listener, ledger, event subscriptions and bookings); waits until it sees every
    /// worker live.
    pub(crate) async fn replica(&self) -> Running {
        let mut settings = Config::parse(&self.yaml).unwrap().into_settings(&demo::repo_root()).unwrap();
        settings.admin = Some(admin_settings());
        let gw = cortex_gateway::start(settings, None).await.unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        while gw.gateway.control().live_workers() < self.sims.len() {
            assert!(tokio::time::Instant::now() < deadline, "the replica never saw every worker live");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        gw
    }

    pub(crate) fn live_workers(&self) -> usize {
        self.gw.gateway.control().live_workers()
    }

    pub(crate) async fn wait(&self, what: &str, done: impl FnMut() -> bool) {
        self.wait_within(what, WAIT, done).await;
    }

    /// Polls `done` until it holds; panics after `limit`.
    pub(crate) async fn wait_within(&self, what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + limit;
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A request to any HTTP server (`url` is `http://host:port/path`).
    pub(crate) async fn send_to(&self, method: &str, url: &str, body: Bytes) -> Reply {
        self.caller().send_to(method, url, body).await
    }

    /// What a spawned task needs to send requests to the gateway.
    pub(crate) fn caller(&self) -> Caller {
        Caller { addr: self.addr(), admin: self.admin_addr(), client: self.client.clone() }
    }

    /// A request to the gateway: `/debug/*` to the admin listener (with its token), the rest to
    /// the public one.
    pub(crate) async fn send(&self, method: &str, path: &str, body: Bytes) -> Reply {
        let host = if on_admin(path) { self.admin_addr() } else { self.addr() };
        self.send_to(method, &format!("http://{host}{path}"), body).await
    }

    pub(crate) async fn post(&self, path: &str, v: &Value) -> Reply {
        self.send("POST", path, Bytes::from(v.to_string())).await
    }

    /// `GET /debug/workers`.
    pub(crate) async fn debug_workers(&self) -> Value {
        let r = self.send("GET", "/debug/workers", Bytes::new()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        r.json()
    }

    /// The gateway's dry-run view of a request: (best worker name, its matched tokens).
    pub(crate) async fn best_hit(&self, body: &Value) -> (String, u64) {
        let r = self.post("/debug/route", body).await;
        let v = r.json();
        let first = &v["candidates"][0];
        (
            first["worker"].as_str().unwrap_or_default().to_owned(),
            first["matched_tokens"].as_u64().unwrap_or(0),
        )
    }

    pub(crate) async fn wait_hit(&self, body: &Value, pred: impl Fn(&str, u64) -> bool) -> (String, u64) {
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

    /// The matched tokens `/debug/route` gives `worker` (rank 0) for `body`.
    pub(crate) async fn hit_on(&self, body: &Value, worker: &str) -> u64 {
        let v = self.post("/debug/route", body).await.json();
        v["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(v["excluded"].as_array().into_iter().flatten())
            .find(|c| c["worker"] == worker)
            .and_then(|c| c["matched_tokens"].as_u64())
            .unwrap_or(0)
    }

    /// Waits until `/debug/route` credits `worker` with a hit for `body` (the scheduler mirrors
    /// ledger states every 50 ms, so a holder just turned READY is credited a moment later).
    pub(crate) async fn wait_hit_on(&self, body: &Value, worker: &str) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let hit = self.hit_on(body, worker).await;
            if hit > 0 {
                return hit;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out: no hit for {worker}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The ledger holder of `name`'s rank 0.
    pub(crate) fn holder(&self, name: &str) -> cortex_hash::kv::HolderId {
        let id = self.gw.gateway.control().registry().by_name(name).unwrap().id;
        cortex_hash::kv::HolderId::new(id, cortex_hash::kv::DpRank(0))
    }

    /// The continuous alignment verdict of `name`.
    pub(crate) fn verdict(&self, name: &str) -> cortex_proxy::alignment::Verdict {
        self.gw.gateway.control().verdict(self.gw.gateway.control().registry().by_name(name).unwrap().id)
    }
}

/// The index of worker `name` (`w0`, `w1`, …) in [`Harness::sims`].
pub(crate) fn worker_index(name: &str) -> usize {
    name.trim_start_matches('w').parse().unwrap()
}

impl Harness {
    pub(crate) fn worker(&self, name: &str) -> &SimWorker {
        &self.sims[worker_index(name)]
    }
}

/// Sends requests to the gateway from a spawned task (owns what it needs of the [`Harness`]).
#[derive(Clone)]
pub(crate) struct Caller {
    addr: SocketAddr,
    admin: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Caller {
    /// The HTTP client (for requests whose head and body the test reads apart).
    pub(crate) fn client(&self) -> &Client<HttpConnector, Full<Bytes>> {
        &self.client
    }

    /// A request to `url`; one to a `/debug/*` path carries the admin token.
    pub(crate) async fn send_to(&self, method: &str, url: &str, body: Bytes) -> Reply {
        let mut req = Request::builder().method(method).uri(url).header("content-type", "application/json");
        if url.parse::<http::Uri>().is_ok_and(|u| on_admin(u.path())) {
            req = req.header("authorization", format!("Bearer {ADMIN_TOKEN}"));
        }
        let req = req.body(Full::new(body)).unwrap();
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    pub(crate) async fn post(&self, path: &str, v: &Value) -> Reply {
        let host = if on_admin(path) { self.admin } else { self.addr };
        self.send_to("POST", &format!("http://{host}{path}"), Bytes::from(v.to_string())).await
    }
}

/// `name`'s entry in a `/debug/workers` answer.
pub(crate) fn worker_entry<'a>(dbg: &'a Value, name: &str) -> &'a Value {
    dbg["workers"].as_array().unwrap().iter().find(|w| w["name"] == name).unwrap()
}

/// A long shared prompt: ~400 tokens, so 25 full blocks of 16.
pub(crate) fn long_prompt(tag: &str) -> String {
    let mut s = format!("[{tag}] You are a careful assistant. ");
    for i in 0..60 {
        s.push_str(&format!("Rule {i}: answer briefly, cite sources, and keep calm. "));
    }
    s
}

pub(crate) fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": 8,
           "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "Summarize the rules."}]})
}

pub(crate) fn cached_tokens(r: &Reply) -> u64 {
    let v = r.json();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| v["meta_info"]["cached_tokens"].as_u64())
        .unwrap_or(0)
}
