//! The PD replay (`--pd P,D`): the same workloads onto a disaggregated cluster — P prefill and D
//! decode simulated workers — behind each PD front end in turn: Cortex (cache-aware prefill and
//! decode, decode-only requests), Cortex with load-only decode and no decode-only requests,
//! SGLang's PD router (`--pd-disaggregation`, `cache_aware` prefill, `power_of_two` decode;
//! SGLang workers) and vLLM's toy proxy (vendored `toy_proxy_server.py`, which alternates the
//! prefill and the decode worker; vLLM workers).
//!
//! Key decisions:
//! - **Time to first token is measured end to end**, from the send to the first generated text
//!   in the stream, on the wall clock, times the compression: a disaggregated request's TTFT is
//!   the prefill leg, the transfer and the decode's first step, on two workers, which no single
//!   simulator's clock sees (and a front end may send its head before the first token).
//! - **What the cache saved, and what moved, come from the workers**: the share of prompt tokens
//!   not computed (`1 − Σ computed prompt tokens / Σ prompt tokens`, every worker counting its
//!   prefill work) and the prompt tokens decode legs received over KV transfers. A worker's
//!   reported `cached_tokens` means different things on a vLLM decode worker (it counts the
//!   transfer), an SGLang one (the prefill's hit) and a prefill worker.
//! - Every front end gets a fresh cluster and the same requests; only the front end changes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use cortex_gateway::Running;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use super::bound::Analysis;
use super::cluster::{self, ClusterSpec, Engine, SglangLauncher, Sims};
use super::driver::{self, DriverOptions, Outcome, Send};

/// A disaggregated cluster's shape: `--pd P,D`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdShape {
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
}

impl FromStr for PdShape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (p, d) = s.split_once(',').ok_or_else(|| format!("`{s}`: expected P,D (for example 4,4)"))?;
        let n = |x: &str| x.trim().parse::<usize>().ok().filter(|&n| n > 0);
        match (n(p), n(d)) {
            (Some(prefill), Some(decode)) => Ok(PdShape { prefill, decode }),
            _ => Err(format!("`{s}`: P and D must be positive numbers")),
        }
    }
}

/// Cortex, as a deployment runs it: cache-aware prefill and decode, decode-only requests.
pub const CORTEX: &str = "cortex";
/// Cortex with the decode worker chosen by load (power of two) and every request disaggregated:
/// the peers' decode choice, with Cortex's prefill choice.
pub const CORTEX_LOAD_DECODE: &str = "cortex-load-decode";
/// SGLang's PD router.
pub const SGLANG_PD: &str = "sglang-pd";
/// vLLM's toy proxy.
pub const VLLM_TOY: &str = "vllm-toy";

/// The PD front ends for `engine`, in the order they run.
#[must_use]
pub fn policies(engine: Engine) -> Vec<String> {
    let peer = match engine {
        Engine::Sglang => SGLANG_PD,
        Engine::Vllm => VLLM_TOY,
    };
    [CORTEX, CORTEX_LOAD_DECODE, peer].map(str::to_owned).to_vec()
}

/// Checks `policy` names a PD front end that runs `engine`'s protocol.
///
/// # Errors
/// An unknown name, or a peer of the other engine.
pub fn check(policy: &str, engine: Engine) -> Result<()> {
    match (policy, engine) {
        (CORTEX | CORTEX_LOAD_DECODE, _) | (SGLANG_PD, Engine::Sglang) | (VLLM_TOY, Engine::Vllm) => Ok(()),
        (SGLANG_PD | VLLM_TOY, _) => {
            bail!("--policies: `{policy}` does not speak {}'s PD protocol", engine.name())
        }
        _ => bail!(
            "--policies: `{policy}` is not a PD front end ({CORTEX}, {CORTEX_LOAD_DECODE}, {SGLANG_PD}, {VLLM_TOY})"
        ),
    }
}

/// The label of a PD front end in tables.
#[must_use]
pub fn label(policy: &str, decode_only_max_uncached: u32) -> String {
    match policy {
        CORTEX => format!("cortex (cache-aware decode, decode-only ≤ {decode_only_max_uncached} tokens)"),
        CORTEX_LOAD_DECODE => "cortex (load decode, always disaggregated)".to_owned(),
        SGLANG_PD => "sglang-router PD (cache_aware / power_of_two)".to_owned(),
        VLLM_TOY => "vLLM toy proxy (alternating)".to_owned(),
        other => other.to_owned(),
    }
}

/// One PD front end's results.
#[derive(Clone, Debug, Default)]
pub struct PdResult {
    /// The label.
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Answered with a whole stream.
    pub ok: usize,
    /// Failed.
    pub failed: usize,
    /// End-to-end TTFT (trace ms): p50, p90, p99.
    pub ttft: [f64; 3],
    /// Share of the answered requests' prompt tokens the workers did not compute.
    pub hit: f64,
    /// Prompt tokens decode legs received over KV transfers.
    pub transferred_tokens: u64,
    /// Answered requests by how Cortex served them (`x-cortex-pd`).
    pub pd_modes: std::collections::BTreeMap<String, usize>,
    /// Share of answered requests served decode-only.
    pub decode_only_share: f64,
    /// 99th percentile of how late the dispatcher sent, ms.
    pub late_p99_ms: f64,
    /// Wall-clock seconds of the sending phase.
    pub wall_secs: f64,
    /// A few distinct errors.
    pub errors: Vec<String>,
    /// Each prefill worker's share of the prompt tokens the prefill workers computed.
    pub prefill_shares: Vec<f64>,
    /// Preemptions on the decode workers (a running request's KV freed for want of room).
    pub decode_preemptions: u64,
    /// Cortex: the prefill workers' learned prefill rates against the simulators' true one.
    pub learned_rate: Option<super::metrics::Learned>,
}

impl PdResult {
    /// The JSON form.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "policy": self.label,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "ttft_e2e_ms": {"p50": self.ttft[0], "p90": self.ttft[1], "p99": self.ttft[2]},
            "hit_ratio": self.hit,
            "transferred_tokens": self.transferred_tokens,
            "pd_modes": self.pd_modes,
            "decode_only_share": self.decode_only_share,
            "dispatch_late_p99_ms": self.late_p99_ms,
            "wall_s": self.wall_secs,
            "prefill_token_shares": self.prefill_shares,
            "decode_preemptions": self.decode_preemptions,
            "learned_prefill_rate": self.learned_rate.as_ref().map(super::metrics::Learned::to_json),
            "errors": self.errors,
        })
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What a finished run's workers counted: prompt tokens computed, tokens received by transfer.
fn worker_totals(sims: &Sims) -> (u64, u64) {
    sims.workers
        .iter()
        .filter_map(|w| w.rank_state(0).ok())
        .fold((0, 0), |(c, t), s| (c + s.computed_prompt_tokens, t + s.pd.pulled_tokens))
}

/// Computes one front end's results from what the driver and the workers saw.
#[must_use]
pub fn summarize(
    label: &str,
    analysis: &Analysis,
    outcomes: &[Outcome],
    totals: (u64, u64),
    compression: f64,
    wall: Duration,
) -> PdResult {
    let mut r = PdResult {
        label: label.to_owned(),
        requests: outcomes.len(),
        wall_secs: wall.as_secs_f64(),
        ..PdResult::default()
    };
    let (mut ttfts, mut lates, mut prompt) = (Vec::new(), Vec::new(), 0u64);
    for (i, o) in outcomes.iter().enumerate() {
        lates.push(o.late.as_secs_f64() * 1e3);
        match (o.ok(), o.wall_first_token) {
            (true, Some(t)) => {
                r.ok += 1;
                prompt += analysis.prompt_tokens[i];
                ttfts.push(t.as_secs_f64() * 1e3 * compression);
                if let Some(m) = &o.pd_mode {
                    *r.pd_modes.entry(m.clone()).or_default() += 1;
                }
            }
            _ => {
                r.failed += 1;
                let e = o.error.clone().unwrap_or_else(|| "no generated text in the stream".to_owned());
                if r.errors.len() < 5 && !r.errors.contains(&e) {
                    r.errors.push(e);
                }
            }
        }
    }
    ttfts.sort_by(f64::total_cmp);
    lates.sort_by(f64::total_cmp);
    r.ttft = [percentile(&ttfts, 50.0), percentile(&ttfts, 90.0), percentile(&ttfts, 99.0)];
    r.late_p99_ms = percentile(&lates, 99.0);
    let (computed, transferred) = totals;
    r.hit = if prompt > 0 { 1.0 - (computed as f64 / prompt as f64).min(1.0) } else { 0.0 };
    r.transferred_tokens = transferred;
    let decode_only = r.pd_modes.get("decode_only").copied().unwrap_or(0);
    r.decode_only_share = if r.ok > 0 { decode_only as f64 / r.ok as f64 } else { 0.0 };
    r
}

/// A PD front end in front of a cluster.
enum FrontEnd {
    Cortex(Running),
    Process { addr: SocketAddr, child: Child },
}

impl FrontEnd {
    fn addr(&self) -> SocketAddr {
        match self {
            FrontEnd::Cortex(r) => r.addr,
            FrontEnd::Process { addr, .. } => *addr,
        }
    }

    async fn stop(self) {
        match self {
            FrontEnd::Cortex(r) => r.shutdown().await,
            FrontEnd::Process { mut child, .. } => {
                let _ = child.kill();
                let _ = tokio::task::spawn_blocking(move || child.wait()).await;
            }
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `cmd` (logging to `log`) and waits until `GET path` answers 2xx on `port`.
async fn start_process(mut cmd: Command, port: u16, path: &str, log: &Path, what: &str) -> Result<FrontEnd> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{what} exited with {status}; see {}", log.display());
        }
        if let Ok(uri) = format!("http://{addr}{path}").parse::<http::Uri>()
            && let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), client.get(uri)).await
            && resp.status().is_success()
        {
            let _ = resp.into_body().collect().await;
            return Ok(FrontEnd::Process { addr, child });
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not come up within 120 s; see {}", log.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SGLang's PD router (the Rust router of `sglang-router`) in front of `sims`.
async fn start_sglang_pd(launcher: &SglangLauncher, sims: &Sims, log: &Path) -> Result<FrontEnd> {
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
    cmd.args(["--pd-disaggregation", "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &prom.to_string()])
        .args(["--log-level", "warn"]);
    for w in &sims.workers {
        match w.config().role {
            cortex_sim::Role::Prefill => {
                let boot = w.bootstrap_addr().context("an SGLang prefill worker without a bootstrap port")?;
                cmd.args(["--prefill", &w.base_url(), &boot.port().to_string()]);
            }
            _ => {
                cmd.args(["--decode", &w.base_url()]);
            }
        }
    }
    start_process(cmd, port, "/health", log, "SGLang's PD router").await
}

/// vLLM's toy proxy (its Python needs fastapi, uvicorn and httpx) in front of `sims`.
async fn start_toy(python: &Path, root: &Path, sims: &Sims, log: &Path) -> Result<FrontEnd> {
    let port = free_port()?;
    let mut cmd = Command::new(python);
    cmd.arg(root.join("xtask/assets/vllm/toy_proxy_server.py")).args([
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ]);
    let (mut p_hosts, mut p_ports, mut d_hosts, mut d_ports) = (vec![], vec![], vec![], vec![]);
    for w in &sims.workers {
        let a = w.http_addr();
        let (hosts, ports) = match w.config().role {
            cortex_sim::Role::Prefill => (&mut p_hosts, &mut p_ports),
            _ => (&mut d_hosts, &mut d_ports),
        };
        hosts.push(a.ip().to_string());
        ports.push(a.port().to_string());
    }
    cmd.arg("--prefiller-hosts").args(&p_hosts).arg("--prefiller-ports").args(&p_ports);
    cmd.arg("--decoder-hosts").args(&d_hosts).arg("--decoder-ports").args(&d_ports);
    start_process(cmd, port, "/healthcheck", log, "vLLM's toy proxy").await
}

/// What one PD run needs besides the cluster.
pub struct PdRun<'a> {
    /// The workspace root.
    pub root: &'a Path,
    /// The cluster (with `prefill_workers` set).
    pub spec: &'a ClusterSpec,
    /// Extra scheduler settings for Cortex.
    pub scheduler: &'a str,
    /// Cortex's decode-only threshold.
    pub decode_only_max_uncached: u32,
    /// SGLang's router, when it can run.
    pub sglang: Option<&'a SglangLauncher>,
    /// The Python of vLLM's toy proxy.
    pub python: &'a Path,
    /// The front end's log file.
    pub log: PathBuf,
    /// Give up on one request after this long.
    pub timeout: Duration,
    /// Progress line.
    pub progress: bool,
    /// The trace's compression.
    pub compression: f64,
}

/// Runs `sends` through `policy` on a fresh disaggregated cluster.
///
/// # Errors
/// The cluster or the front end cannot start.
pub async fn run_policy(
    run: &PdRun<'_>,
    policy: &str,
    sends: &[Send],
    analysis: &Analysis,
) -> Result<PdResult> {
    let spec = run.spec.clone();
    let sims = tokio::task::spawn_blocking(move || Sims::start(&spec)).await??;
    let extra = if run.scheduler.trim().is_empty() { String::new() } else { format!(", {}", run.scheduler) };
    let front = match policy {
        CORTEX | CORTEX_LOAD_DECODE => {
            let (decode, sections) = if policy == CORTEX {
                (
                    "cache_aware",
                    format!("pd: {{decode_only_max_uncached: {}}}\n", run.decode_only_max_uncached),
                )
            } else {
                ("power_of_two", String::new())
            };
            let scheduler = format!("prefill_policy: cache_aware, decode_policy: {decode}{extra}");
            cluster::start_cortex(
                run.root,
                &sims,
                run.spec.engine,
                run.spec.block_size,
                "cache_aware",
                &scheduler,
                &sections,
            )
            .await
            .map(FrontEnd::Cortex)
        }
        SGLANG_PD => match run.sglang {
            Some(l) => start_sglang_pd(l, &sims, &run.log).await,
            None => Err(anyhow::anyhow!("SGLang's router is not available")),
        },
        VLLM_TOY => start_toy(run.python, run.root, &sims, &run.log).await,
        other => Err(anyhow::anyhow!("unknown PD front end `{other}`")),
    };
    let front = match front {
        Ok(f) => f,
        Err(e) => {
            tokio::task::spawn_blocking(move || sims.shutdown()).await?;
            return Err(e);
        }
    };
    let label = label(policy, run.decode_only_max_uncached);
    let opts = DriverOptions {
        target: front.addr(),
        targets: Vec::new(),
        timeout: run.timeout,
        progress: run.progress.then(|| label.clone()),
        require_sim_ttft: false,
    };
    let t = Instant::now();
    let outcomes = driver::run(sends, &opts, None).await;
    let wall = t.elapsed();
    // One line per request beside the log, to find what the slowest ones had in common.
    let _ = std::fs::write(
        run.log.with_extension("requests.tsv"),
        requests_tsv(sends, analysis, &outcomes, run.compression),
    );
    let learned = match &front {
        FrontEnd::Cortex(gw) => {
            let view = gw.gateway.control().workers_view();
            // The gateway's whole view at the end, beside its log, for a closer look.
            let _ = std::fs::write(run.log.with_extension("workers.json"), view.to_string());
            Some(super::metrics::Learned::from_views(&[view], &run.spec.timing, run.compression))
        }
        FrontEnd::Process { .. } => None,
    };
    front.stop().await;
    let totals = worker_totals(&sims);
    let computed: Vec<u64> = sims
        .workers
        .iter()
        .filter(|w| w.config().role == cortex_sim::Role::Prefill)
        .map(|w| w.rank_state(0).map_or(0, |s| s.computed_prompt_tokens))
        .collect();
    let decode_preemptions = sims
        .workers
        .iter()
        .filter(|w| w.config().role == cortex_sim::Role::Decode)
        .map(|w| w.rank_state(0).map_or(0, |s| s.preemptions))
        .sum();
    tokio::task::spawn_blocking(move || sims.shutdown()).await?;
    let mut r = summarize(&label, analysis, &outcomes, totals, run.compression, wall);
    let all = computed.iter().sum::<u64>().max(1) as f64;
    r.prefill_shares = computed.iter().map(|&c| c as f64 / all).collect();
    r.learned_rate = learned;
    r.decode_preemptions = decode_preemptions;
    Ok(r)
}

/// Each request's send time, prompt size, workers, mode and end-to-end TTFT, in trace
/// milliseconds.
fn requests_tsv(sends: &[Send], analysis: &Analysis, outcomes: &[Outcome], compression: f64) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3 * compression;
    let mut out = String::from(
        "request\tsent_ms\tprompt_tokens\tprefill_worker\tworker\tpd_mode\tpredicted_hit\thead_ms\tttft_ms\tstatus\n",
    );
    for (i, (s, o)) in sends.iter().zip(outcomes).enumerate() {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
        out.push_str(&format!(
            "{i}\t{:.1}\t{}\t{}\t{}\t{}\t{}\t{:.1}\t{}\t{}\n",
            ms(s.at),
            opt(analysis.prompt_tokens.get(i).map(ToString::to_string)),
            opt(o.prefill_worker.map(|w| w.to_string())),
            opt(o.worker.map(|w| w.to_string())),
            opt(o.pd_mode.clone()),
            opt(o.predicted_hit.map(|h| h.to_string())),
            ms(o.wall_head),
            opt(o.wall_first_token.map(|t| format!("{:.1}", ms(t)))),
            o.status,
        ));
    }
    out
}

/// The Python that runs vLLM's toy proxy: `auto` is the venv `cargo xtask pd-check` creates
/// (with fastapi, uvicorn and httpx), else `python3`.
#[must_use]
pub fn python(root: &Path, spec: &str) -> PathBuf {
    if spec != "auto" {
        return PathBuf::from(spec);
    }
    let venv = root.join("target/pd-check-venv/bin/python");
    if venv.exists() { venv } else { PathBuf::from("python3") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_front_ends() {
        assert_eq!("4,4".parse::<PdShape>(), Ok(PdShape { prefill: 4, decode: 4 }));
        assert_eq!(" 2 , 6 ".parse::<PdShape>(), Ok(PdShape { prefill: 2, decode: 6 }));
        assert!("4".parse::<PdShape>().is_err());
        assert!("0,4".parse::<PdShape>().is_err());
        assert_eq!(policies(Engine::Sglang), [CORTEX, CORTEX_LOAD_DECODE, SGLANG_PD]);
        assert_eq!(policies(Engine::Vllm), [CORTEX, CORTEX_LOAD_DECODE, VLLM_TOY]);
        assert!(check(SGLANG_PD, Engine::Vllm).is_err());
        assert!(check(VLLM_TOY, Engine::Vllm).is_ok());
        assert!(check("cache_aware", Engine::Vllm).is_err());
    }

    #[test]
    fn hit_is_what_no_worker_computed() {
        let analysis = Analysis { prompt_tokens: vec![100, 100], ..Analysis::default() };
        let ok = |mode: &str| Outcome {
            status: 200,
            wall_first_token: Some(Duration::from_millis(10)),
            pd_mode: Some(mode.to_owned()),
            ..Outcome::default()
        };
        let r = summarize(
            "x",
            &analysis,
            &[ok("disaggregated"), ok("decode_only")],
            (50, 120),
            10.0,
            Duration::ZERO,
        );
        assert_eq!((r.ok, r.failed), (2, 0));
        assert!((r.hit - 0.75).abs() < 1e-9);
        assert_eq!(r.transferred_tokens, 120);
        assert!((r.decode_only_share - 0.5).abs() < 1e-9);
        assert!((r.ttft[0] - 100.0).abs() < 1e-9, "wall × compression");
    }
}
