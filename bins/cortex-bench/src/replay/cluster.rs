//! The systems under test: a fresh simulated cluster per policy, and in front of it either
//! Cortex's gateway in this process (real HTTP listener, real ZeroMQ ingest) or SGLang's router
//! as a child process.
//!
//! Key decisions:
//! - Cortex is started exactly as a deployment starts it: a YAML document parsed and validated by
//!   `cortex_gateway::config`, then `cortex_gateway::start`. Only the scheduler policy differs
//!   between Cortex runs. A run starts sending only when every worker is healthy, its model
//!   profile confirmed and its KV-event PUB has the gateway's subscriber (observable state,
//!   never a fixed sleep). The ledger itself turns READY at each worker's first batch (the
//!   engine's start-up batch was published before anyone listened, and is replayed then).
//! - SGLang's router does not say which worker served a request, so each simulated worker gets
//!   a transparent relay in this process; the relay records the `x-request-id` the router
//!   forwards, and that is how its load per worker is measured — at routing time, as Cortex's
//!   `x-cortex-assigned-worker` header gives it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use cortex_gateway::Running;
use cortex_gateway::config::Config;
use cortex_hash::kv::{DpRank, HolderId};
use cortex_sim::{SimConfig, SimWorker, Timing};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The served model name of every replay.
pub const MODEL: &str = "replay";

/// The simulated engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// SGLang 0.5.23 (radix cache; what SGLang's router fronts).
    Sglang,
    /// vLLM 0.33 (block pool).
    Vllm,
}

impl Engine {
    /// `sglang` or `vllm`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Engine::Sglang => "sglang",
            Engine::Vllm => "vllm",
        }
    }
}

/// What every simulated worker of a run looks like.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Workers.
    pub workers: usize,
    /// Engine.
    pub engine: Engine,
    /// Tokens per page.
    pub block_size: usize,
    /// KV capacity per worker, in pages.
    pub capacity_blocks: usize,
    /// Virtual-time model (speed included).
    pub timing: Timing,
    /// Longest request the workers accept.
    pub max_model_len: usize,
    /// Requests running at once per worker.
    pub max_running: usize,
    /// Token budget of one step (chunked prefill).
    pub max_batched_tokens: usize,
    /// A disaggregated cluster: this many of the workers (the first ones) are prefill workers,
    /// the rest decode workers; `None`: every worker is regular.
    pub prefill_workers: Option<usize>,
    /// SGLang decode workers keep a radix cache (`--disaggregation-decode-enable-radix-cache`).
    pub decode_radix_cache: bool,
}

/// A fresh simulated cluster.
pub struct Sims {
    /// The workers, `w0`, `w1`, … in order.
    pub workers: Vec<SimWorker>,
}

impl std::fmt::Debug for Sims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sims").field("workers", &self.workers.len()).finish()
    }
}

impl Sims {
    /// Starts `spec.workers` workers (each binds everything before this returns).
    ///
    /// # Errors
    /// A worker cannot start.
    pub fn start(spec: &ClusterSpec) -> Result<Sims> {
        let mut workers = Vec::with_capacity(spec.workers);
        for i in 0..spec.workers {
            let mut c = match spec.engine {
                Engine::Sglang => SimConfig::sglang(),
                Engine::Vllm => SimConfig::vllm(),
            };
            c.model_name = MODEL.to_owned();
            c.block_size = spec.block_size;
            c.capacity_blocks = spec.capacity_blocks;
            c.timing = spec.timing;
            c.max_model_len = spec.max_model_len;
            c.max_running = spec.max_running;
            c.max_batched_tokens = spec.max_batched_tokens;
            if let Some(p) = spec.prefill_workers {
                c.role = if i < p { cortex_sim::Role::Prefill } else { cortex_sim::Role::Decode };
                if let cortex_sim::EngineConfig::Sglang(o) = &mut c.engine {
                    o.decode_radix_cache = spec.decode_radix_cache;
                }
            }
            workers.push(SimWorker::start(c).with_context(|| format!("starting simulated worker w{i}"))?);
        }
        Ok(Sims { workers })
    }

    /// Stops every worker (blocking: joins their threads).
    pub fn shutdown(self) {
        for w in self.workers {
            w.shutdown();
        }
    }
}

/// Cortex's gateway in front of `sims` (each with its simulated role), with scheduler policy
/// `policy`, the extra scheduler settings `scheduler` (YAML flow-map entries, may be empty) and
/// extra top-level sections `sections` (YAML lines, may be empty).
///
/// # Errors
/// The configuration does not validate, or the gateway does not become ready in time.
pub async fn start_cortex(
    root: &Path,
    sims: &Sims,
    engine: Engine,
    block_size: usize,
    policy: &str,
    scheduler: &str,
    sections: &str,
) -> Result<Running> {
    let yaml = cortex_yaml(root, sims, engine, block_size, policy, scheduler, sections);
    let settings = Config::parse(&yaml)?.into_settings(root)?;
    let running = cortex_gateway::start(settings, None).await?;
    let names: Vec<String> = (0..sims.workers.len()).map(|i| format!("w{i}")).collect();
    let ready = || {
        names.iter().all(|n| {
            let Some(w) = running.gateway.control().registry().by_name(n) else { return false };
            w.status().alignment.allows_exact_routing()
        }) && sims.workers.iter().all(|s| s.subscribed(0))
            && running.gateway.control().live_workers() == names.len()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        if Instant::now() > deadline {
            let states: Vec<String> = names
                .iter()
                .map(|n| match running.gateway.control().registry().by_name(n) {
                    None => format!("{n}: unknown"),
                    Some(w) => format!(
                        "{n}: alignment {:?}, ledger {:?}",
                        w.status().alignment,
                        running.ledger_state(HolderId::new(w.id, DpRank(0)))
                    ),
                })
                .collect();
            running.shutdown().await;
            bail!(
                "the gateway did not see every worker healthy, confirmed and subscribed within 60 s: {}",
                states.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(running)
}

/// The YAML configuration of a Cortex gateway in front of `sims` (see [`start_cortex`]).
#[must_use]
pub fn cortex_yaml(
    root: &Path,
    sims: &Sims,
    engine: Engine,
    block_size: usize,
    policy: &str,
    scheduler: &str,
    sections: &str,
) -> String {
    let mut extra = if scheduler.trim().is_empty() { String::new() } else { format!(", {scheduler}") };
    // `cache_aware_v1` is the first wave's default: this gateway's bookings alone, and its bound.
    if policy == "cache_aware_v1" {
        for (key, value) in [("load_signals", "booked"), ("bounded_load_epsilon", "0.25")] {
            if !scheduler.contains(key) {
                extra.push_str(&format!(", {key}: {value}"));
            }
        }
    }
    let mut workers = String::new();
    for (i, s) in sims.workers.iter().enumerate() {
        let role = match s.config().role {
            cortex_sim::Role::Unified => "regular",
            cortex_sim::Role::Prefill => "prefill",
            cortex_sim::Role::Decode => "decode",
        };
        workers.push_str(&format!(
            "  - {{name: w{i}, url: '{}', engine: {}, model: {MODEL}, role: {role}}}\n",
            s.base_url(),
            engine.name()
        ));
    }
    let qwen = root.join("golden/models/qwen3");
    format!(
        "listen: '127.0.0.1:0'
models:
  - name: {MODEL}
    engine: {engine}
    tokenizer: '{tok}'
    tokenizer_config: '{cfg}'
    block_size: {block_size}
workers:
{workers}scheduler: {{policy: {policy}{extra}}}
probes: {{health_interval: 1s, load_interval: 250ms}}
{sections}",
        engine = engine.name(),
        tok = qwen.join("tokenizer.json").display(),
        cfg = qwen.join("tokenizer_config.json").display(),
    )
}

/// Which worker each request id went to (filled by the relays).
pub type Seen = Arc<Mutex<HashMap<String, usize>>>;

/// How to launch SGLang's router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SglangLauncher {
    /// An `smg` executable (`smg launch …`).
    Smg(PathBuf),
    /// A Python with the `sglang_router` module (`python -m sglang_router.launch_router …`).
    Python(PathBuf),
}

impl SglangLauncher {
    /// What `--sglang-router` says: `auto` looks for `smg` on `PATH`, then for a `python3` that
    /// imports `sglang_router`; `off` never runs it; a path names an `smg` executable or a
    /// Python interpreter.
    ///
    /// # Errors
    /// Why it cannot run (absent, disabled, or the path is neither), to print when skipping it.
    pub fn find(spec: &str) -> Result<SglangLauncher, String> {
        match spec {
            "off" => Err("disabled with --sglang-router off".to_owned()),
            "auto" => {
                if let Some(smg) = which("smg").filter(|p| is_sglang_smg(p)) {
                    return Ok(SglangLauncher::Smg(smg));
                }
                for py in ["python3", "python"] {
                    if let Some(p) = which(py).filter(|p| python_has_router(p)) {
                        return Ok(SglangLauncher::Python(p));
                    }
                }
                Err("not installed: no `smg` of sglang-router on PATH and no python3 that imports sglang_router (`pip install sglang-router==0.3.2`, or pass --sglang-router <path to smg or python>)".to_owned())
            }
            path => {
                let p = PathBuf::from(path);
                if python_has_router(&p) {
                    Ok(SglangLauncher::Python(p))
                } else if is_sglang_smg(&p) {
                    Ok(SglangLauncher::Smg(p))
                } else {
                    Err(format!(
                        "`{path}` is neither sglang-router's smg nor a Python that imports sglang_router"
                    ))
                }
            }
        }
    }

    /// The version it reports.
    #[must_use]
    pub fn version(&self) -> String {
        let out = match self {
            SglangLauncher::Smg(p) => Command::new(p).arg("--version").output(),
            SglangLauncher::Python(p) => Command::new(p)
                .args([
                    "-c",
                    "import importlib.metadata as m; print('sglang-router', m.version('sglang-router'))",
                ])
                .output(),
        };
        out.ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

fn is_sglang_smg(p: &Path) -> bool {
    Command::new(p)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("sgl-model-gateway"))
}

fn python_has_router(p: &Path) -> bool {
    Command::new(p)
        .args(["-c", "import sglang_router.launch_router"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// SGLang's router (a child process) with a relay in front of each worker.
pub struct SglangRouter {
    /// Its public address.
    pub addr: SocketAddr,
    /// Request id → worker index.
    pub seen: Seen,
    child: Child,
    relays: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for SglangRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SglangRouter").field("addr", &self.addr).finish_non_exhaustive()
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts SGLang's router with its `cache_aware` policy in front of `sims` (through relays),
/// logging to `log`, and waits until it reports every worker healthy.
///
/// # Errors
/// It cannot be started or does not become ready within 120 s.
pub async fn start_sglang(launcher: &SglangLauncher, sims: &Sims, log: &Path) -> Result<SglangRouter> {
    let seen: Seen = Arc::new(Mutex::new(HashMap::new()));
    let mut relays = Vec::new();
    let mut urls = Vec::new();
    for (i, w) in sims.workers.iter().enumerate() {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        urls.push(format!("http://{}", listener.local_addr()?));
        relays.push(tokio::spawn(relay(listener, w.http_addr(), i, Arc::clone(&seen))));
    }
    let port = free_port()?;
    let prom = free_port()?;
    let mut cmd = match launcher {
        SglangLauncher::Smg(p) => {
            let mut c = Command::new(p);
            c.arg("launch");
            c
        }
        SglangLauncher::Python(p) => {
            let mut c = Command::new(p);
            c.args(["-m", "sglang_router.launch_router"]);
            c
        }
    };
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", "cache_aware"])
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &prom.to_string()])
        .args(["--log-level", "warn", "--health-check-interval-secs", "5"])
        .arg("--worker-urls")
        .args(&urls);
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting SGLang's router ({launcher:?})"))?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut router = SglangRouter { addr, seen, child, relays };
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(status)) = router.child.try_wait() {
            bail!("SGLang's router exited with {status}; see {}", log.display());
        }
        if let Ok(uri) = format!("http://{addr}/readiness").parse::<http::Uri>()
            && let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), client.get(uri)).await
        {
            let ok = resp.status().is_success();
            let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if ok && v["healthy_workers"].as_u64() == Some(sims.workers.len() as u64) {
                return Ok(router);
            }
        }
        if Instant::now() > deadline {
            router.stop().await;
            bail!(
                "SGLang's router did not report {} healthy workers within 120 s; see {}",
                sims.workers.len(),
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl SglangRouter {
    /// Kills the router process (the one this run started) and stops the relays.
    pub async fn stop(mut self) {
        let _ = self.child.kill();
        let mut child = self.child;
        let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        for r in self.relays.drain(..) {
            r.abort();
            let _ = r.await;
        }
    }
}

/// Forwards every request on `listener` to `upstream` unchanged, noting `x-request-id` → `index`.
async fn relay(listener: TcpListener, upstream: SocketAddr, index: usize, seen: Seen) {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(http);
    let mut conns = tokio::task::JoinSet::new();
    while let Ok((stream, _)) = listener.accept().await {
        let _ = stream.set_nodelay(true);
        let (client, seen) = (client.clone(), Arc::clone(&seen));
        conns.spawn(async move {
            let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let (client, seen) = (client.clone(), Arc::clone(&seen));
                async move { forward(&client, upstream, index, &seen, req).await }
            });
            let _ =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
    conns.shutdown().await;
}

async fn forward(
    client: &Client<HttpConnector, Full<Bytes>>,
    upstream: SocketAddr,
    index: usize,
    seen: &Seen,
    req: http::Request<Incoming>,
) -> Result<http::Response<Incoming>, String> {
    let (mut parts, body) = req.into_parts();
    if let Some(id) = parts.headers.get("x-request-id").and_then(|v| v.to_str().ok())
        && let Ok(mut m) = seen.lock()
    {
        m.insert(id.to_owned(), index);
    }
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    let path = parts.uri.path_and_query().map_or("/", http::uri::PathAndQuery::as_str);
    parts.uri =
        format!("http://{upstream}{path}").parse().map_err(|e: http::uri::InvalidUri| e.to_string())?;
    client.request(http::Request::from_parts(parts, Full::new(body))).await.map_err(|e| e.to_string())
}
