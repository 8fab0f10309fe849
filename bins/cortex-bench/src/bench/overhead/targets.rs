//! The targets of the overhead benchmark, each started in this process on loopback (SGLang's
//! router as a child process): the simulated worker itself, the do-nothing proxy, Cortex, and
//! SGLang's router when it is installed.
//!
//! Key decision: every proxy forwards to the same single simulated SGLang worker (speed 0, so it
//! answers at once), and the two Rust proxies get identical runtimes (a multi-threaded tokio
//! runtime with one worker thread per core), so the only difference between their latencies
//! is what they do per request. Cortex runs as the binary runs it — configured from YAML,
//! with the Prometheus recorder installed and the ledger following the worker's KV events.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cortex_gateway::Running;
use cortex_gateway::config::Config;
use cortex_hash::kv::{DpRank, HolderId};
use cortex_sim::{SimConfig, SimWorker, Timing};
use tokio::runtime::Runtime;

use super::loadgen::{self, Probe};

/// The model name every target serves.
pub const MODEL: &str = "m";
/// Thread name of the do-nothing proxy's runtime (workers and blocking pool).
pub const PASSTHROUGH_THREADS: &str = "bench-passthru";
/// Thread name of Cortex's runtime (workers and blocking pool); its event plane's threads are
/// named `cortex-ingest…`.
pub const CORTEX_THREADS: &str = "bench-cortex";
/// Thread name of the simulated worker.
pub const SIM_THREADS: &str = "cortex-sim";

/// A multi-threaded runtime with one worker per core, as the gateway binary uses.
fn runtime(name: &str) -> Result<Runtime> {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .thread_name(name)
        .enable_all()
        .build()?)
}

/// The simulated SGLang worker (speed 0).
pub fn sim() -> Result<SimWorker> {
    let mut cfg = SimConfig::sglang();
    cfg.model_name = MODEL.to_owned();
    cfg.timing = Timing { speed: 0.0, ..Timing::default() };
    cfg.capacity_blocks = 4096;
    Ok(SimWorker::start(cfg)?)
}

/// The do-nothing proxy on its own runtime.
pub struct Passthrough {
    /// Its address.
    pub addr: SocketAddr,
    _rt: Runtime,
}

impl Passthrough {
    /// Starts it in front of `upstream`.
    ///
    /// # Errors
    /// The runtime or the listener cannot be created.
    pub fn start(upstream: SocketAddr) -> Result<Passthrough> {
        let rt = runtime(PASSTHROUGH_THREADS)?;
        let addr = rt.block_on(super::passthrough::start(upstream))?;
        Ok(Passthrough { addr, _rt: rt })
    }
}

/// Cortex, in process, on its own runtime.
pub struct Cortex {
    /// Its public address.
    pub addr: SocketAddr,
    running: Option<Running>,
    rt: Runtime,
}

impl Cortex {
    /// Starts the gateway in front of the worker whose base URL is `url`, with the Qwen3 files
    /// shipped in `golden/`, and sends `probe` through it until the worker is live and its ledger
    /// READY (a holder becomes READY with its first KV event), as in steady state.
    ///
    /// # Errors
    /// The settings do not validate, the gateway cannot start, or the worker does not become
    /// live with a READY ledger within 30 s.
    pub fn start(
        root: &Path,
        url: &str,
        probe: &Probe,
        prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
    ) -> Result<Cortex> {
        let qwen = root.join("golden/models/qwen3");
        let yaml = format!(
            "listen: '127.0.0.1:0'
models:
  - name: {MODEL}
    engine: sglang
    tokenizer: '{}'
    tokenizer_config: '{}'
    block_size: 16
workers:
  - {{name: w0, url: '{url}', engine: sglang, model: {MODEL}}}
shutdown_grace: 1s
",
            qwen.join("tokenizer.json").display(),
            qwen.join("tokenizer_config.json").display(),
        );
        let settings = Config::parse(&yaml)?.into_settings(root)?;
        let rt = runtime(CORTEX_THREADS)?;
        let running = rt.block_on(cortex_gateway::start(settings, prometheus))?;
        let client = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let snap = running.gateway.control().cluster().load();
            let live = snap
                .workers()
                .iter()
                .find(|w| w.health() == cortex_sched::Health::Healthy)
                .map(|w| w.spec().id);
            if let Some(id) = live {
                if running.ledger_state(HolderId::new(id, DpRank(0))) == Some(cortex_radix::Readiness::Ready)
                {
                    break;
                }
                client.block_on(loadgen::fetch(running.addr, probe))?;
            }
            if Instant::now() > deadline {
                bail!("the gateway's worker did not become live with a READY ledger within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Cortex { addr: running.addr, running: Some(running), rt })
    }
}

impl Drop for Cortex {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ =
                self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), r.shutdown()).await });
        }
    }
}

/// SGLang's router (`sglang-router`, the `smg` executable) as a child process.
pub struct SglangRouter {
    /// Its address.
    pub addr: SocketAddr,
    /// What was run (the worker's URL and the port as placeholders).
    pub command: String,
    /// What the router says its version is (`smg --version`).
    pub version: String,
    child: Child,
}

impl SglangRouter {
    /// The router's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Where an executable named `name` is on `PATH`.
fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl SglangRouter {
    /// How to launch the router, if it is installed: `smg launch`, `sglang-router launch`, or
    /// `python3 -m sglang_router.launch_router`.
    #[must_use]
    pub fn find() -> Option<(PathBuf, Vec<String>)> {
        for exe in ["smg", "sglang-router"] {
            if let Some(p) = which(exe) {
                return Some((p, vec!["launch".to_owned()]));
            }
        }
        let py = which("python3")?;
        let ok = Command::new(&py)
            .args(["-c", "import sglang_router.launch_router"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| (py, vec!["-m".to_owned(), "sglang_router.launch_router".to_owned()]))
    }

    /// Starts the router with the `cache_aware` policy in front of `worker_url` and waits until
    /// it answers `probe` with 200. Its output goes to `log`.
    ///
    /// # Errors
    /// It is not installed, exits, or does not answer within 60 s.
    pub fn start(worker_url: &str, probe: &Probe, log: &Path) -> Result<SglangRouter> {
        let Some((exe, mut args)) = Self::find() else {
            bail!("sglang-router is not installed (pip install sglang-router==0.3.2)");
        };
        let port = free_port()?;
        args.extend(
            [
                "--worker-urls",
                worker_url,
                "--policy",
                "cache_aware",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--log-level",
                "warn",
            ]
            .map(str::to_owned),
        );
        let shown = args
            .join(" ")
            .replace(worker_url, "<worker>")
            .replace(&format!("--port {port}"), "--port <port>");
        let name =
            exe.file_name().map_or_else(|| exe.display().to_string(), |n| n.to_string_lossy().into_owned());
        let command = format!("{name} {shown}");
        let version = if args.first().is_some_and(|a| a == "launch") {
            Command::new(&exe)
                .arg("--version")
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "unknown version".to_owned())
        } else {
            "unknown version".to_owned()
        };
        let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(&exe)
            .args(&args)
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| command.clone())?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut router = SglangRouter { addr, command, version, child };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = router.child.try_wait()? {
                bail!("sglang-router exited with {status} (log: {})", log.display());
            }
            if let Ok(Ok((status, _, _))) = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(2), loadgen::fetch(addr, probe)).await
            }) && status == http::StatusCode::OK
            {
                return Ok(router);
            }
            if Instant::now() > deadline {
                bail!("sglang-router did not answer within 60 s (log: {})", log.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for SglangRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
