//! `cargo xtask soak-gateway`: 10^6 requests through the real `cortex-gateway` binary (release)
//! onto simulated workers in their own processes, with prefix churn, event gaps (replayed and
//! not), publisher restarts and one worker `kill -9` and restart on its ports per minute; then
//! the verdict: the gateway's RSS flat over the second half, the ledger's live bytes within its
//! budget, no failure the kills do not explain, every ledger READY at the end.
//!
//! Key decisions:
//! - Everything runs as it ships: the binaries are built in release by the command and started
//!   as processes on loopback, every listener bound on port 0 by its owner and reported; a
//!   restart reuses the reported ports. The soak reads only what an operator can see: the
//!   gateway's `/proc/PID/status`, its `/metrics`, and the answers.
//! - Closed loop at a fixed concurrency: a soak measures memory and correctness over a volume of
//!   requests, not latency under a rate; the rate achieved is reported.
//! - Faults run on their own thread on a fixed schedule (no randomness: a run is reproducible);
//!   the verdict's rules are pure functions in [`verdict`], tested there.
//!
//! Modules: [`prompts`] (the requests), [`load`] (the senders), [`procs`] (the processes),
//! [`verdict`] (flatness, attribution, the metrics text).

pub mod load;
pub mod procs;
pub mod prompts;
pub mod verdict;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cortex_gateway::config::parse_duration;
use serde_json::{Value, json};
use tokio::time::Instant;
use xtask::net::{Proc, free_port, http};

use load::Progress;
use procs::Sim;
use prompts::Workload;
use verdict::{Failure, Outage};

/// The served model of each engine's workers.
const MODELS: [(&str, &str); 2] = [("vllm", "soak-vllm"), ("sglang", "soak-sglang")];

/// The flags of `cargo xtask soak-gateway`.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "soak-gateway")]
pub struct Args {
    /// Requests to send (a quick smoke: `--requests 20000`).
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: u64,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Simulated workers, each its own process, vLLM and SGLang alternately (w0 vLLM, w1 SGLang…).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// KV capacity of each simulated worker, in 16-token pages: small enough that eviction never
    /// stops, large enough that a served request's blocks outlive the gateway's alignment check
    /// (`alignment.settle`, 500 ms) at the soak's rate.
    #[arg(long, default_value_t = 8192)]
    pub capacity_blocks: usize,
    /// Shared prefixes alive at once.
    #[arg(long, default_value_t = 64)]
    pub prefixes: u64,
    /// Requests between two retirements of a shared prefix (the churn).
    #[arg(long, default_value_t = 20)]
    pub churn_every: u64,
    /// The gateway's `ledger.byte_budget`, KiB: below what the workers' capacity would take
    /// (`--capacity-blocks` × workers × 96 B), so the budget's eviction runs too.
    #[arg(long, default_value_t = 2048)]
    pub ledger_budget_kib: u64,
    /// One worker (round robin) is killed with SIGKILL and restarted on its ports this often.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub restart_every: Duration,
    /// An event gap (dropped batches) on one worker this often, with replay answered and not in
    /// turn.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub gap_every: Duration,
    /// One worker's event publisher restarts this often.
    #[arg(long, default_value = "45s", value_parser = parse_duration)]
    pub publisher_restart_every: Duration,
    /// How long every ledger may take to be READY once the load stops.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub ready_deadline: Duration,
    /// The largest `(max - min) / min` of the gateway's smoothed RSS over the second half.
    #[arg(long, default_value_t = 0.10)]
    pub rss_tolerance: f64,
    /// Where logs, the configuration, `samples.csv` and `report.json` go (default:
    /// `target/soak-gateway`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run the `cortex-gateway` and `cortex-sim` binaries in this directory instead of building
    /// them (`cargo build --release`).
    #[arg(long, value_name = "DIR")]
    pub bins: Option<PathBuf>,
}

/// RSS samples (one a second) averaged for the flatness verdict.
const SMOOTH_WINDOW: usize = 10;

/// How long after a killed worker is back its failures are still explained by the kill (the
/// gateway sees it healthy again at its next probes).
const KILL_GRACE: Duration = Duration::from_secs(5);

/// One sample a second.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Duration,
    rss: u64,
    ledger_bytes: Option<f64>,
    ledger_blocks: Option<f64>,
    done: u64,
    failed: u64,
}

/// What the fault thread did.
#[derive(Debug, Default)]
struct FaultLog {
    outages: Vec<Outage>,
    gaps_replayed: u64,
    gaps_unreplayed: u64,
    batches_dropped: u64,
    publisher_restarts: u64,
    /// Faults the harness could not inject (a worker refused or was unreachable).
    errors: Vec<String>,
}

/// Runs the soak from the command line.
///
/// # Errors
/// The soak could not run (build, start-up); a soak that ran and failed its verdict returns
/// `ExitCode::FAILURE` with the reasons printed.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn cli(root: &Path, args: &Args) -> Result<ExitCode> {
    let target = xtask::target_dir(root);
    let out = args.out.clone().unwrap_or_else(|| target.join("soak-gateway"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bins = if let Some(dir) = &args.bins {
        dir.clone()
    } else {
        eprintln!("==> cargo build --release -p cortex-gateway -p cortex-sim --bins");
        let status = Command::new(xtask::cargo())
            .args(["build", "--release", "--quiet", "-p", "cortex-gateway", "-p", "cortex-sim", "--bins"])
            .current_dir(root)
            .status()
            .context("running cargo build")?;
        if !status.success() {
            bail!("cargo build --release -p cortex-gateway -p cortex-sim failed");
        }
        target.join("release")
    };
    let report = soak(root, &bins, &out, args)?;
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("report.json"), &text)?;
    println!("{}", summary(&report));
    println!("report: {}", out.join("report.json").display());
    let failures: Vec<&str> = report["verdict"]["failures"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if failures.is_empty() {
        println!("soak-gateway: PASS");
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &failures {
            eprintln!("soak-gateway: FAIL: {f}");
        }
        Ok(ExitCode::FAILURE)
    }
}

fn gateway_yaml(root: &Path, public: SocketAddr, sims: &[Sim], budget_kib: u64) -> String {
    let qwen = root.join("golden/models/qwen3");
    let mut yaml = format!("listen: '{public}'\nmodels:\n");
    for (engine, model) in MODELS {
        let _ = writeln!(
            yaml,
            "  - {{name: {model}, engine: {engine}, tokenizer: '{}', tokenizer_config: '{}', block_size: 16}}",
            qwen.join("tokenizer.json").display(),
            qwen.join("tokenizer_config.json").display(),
        );
    }
    yaml.push_str("workers:\n");
    for s in sims {
        let model = MODELS.iter().find(|(e, _)| *e == s.engine).map_or("", |m| m.1);
        let _ = writeln!(
            yaml,
            "  - {{name: {}, url: 'http://{}', engine: {}, model: {model}}}",
            s.name, s.http, s.engine
        );
    }
    // Probes fast enough that a killed worker leaves and rejoins within a second or two; a
    // replay that has not finished in a second is abandoned (the ledger is rebuilt).
    let _ = write!(
        yaml,
        "probes: {{health_interval: 250ms, load_interval: 250ms, timeout: 1s, failures_to_remove: 2, successes_to_restore: 1}}
ingest: {{replay_timeout: 1s}}
ledger: {{byte_budget: {budget_kib}KiB}}
access_log: {{format: off}}
"
    );
    yaml
}

/// The ledger state of each worker named in `names` (`None`: no holder).
fn ledger_states(metrics: &str, names: &[String]) -> Vec<(String, Option<String>)> {
    let samples = verdict::samples(metrics, "cortex_ledger_state");
    names
        .iter()
        .map(|n| {
            let state = samples
                .iter()
                .find(|s| verdict::label(s, "worker") == Some(n.as_str()) && s.1 >= 1.0)
                .and_then(|s| verdict::label(s, "state"))
                .map(str::to_owned);
            (n.clone(), state)
        })
        .collect()
}

fn scrape(public: SocketAddr) -> Option<String> {
    http(public, "GET", "/metrics", None).ok().filter(|a| a.status == 200).map(|a| a.text())
}

/// Polls until every worker's ledger is READY or `deadline` passes; returns how long it took,
/// or the states at the deadline.
fn wait_all_ready(public: SocketAddr, names: &[String], deadline: Duration) -> Result<Duration, String> {
    let start = std::time::Instant::now();
    loop {
        let states = scrape(public).map(|m| ledger_states(&m, names)).unwrap_or_default();
        if states.len() == names.len() && states.iter().all(|(_, s)| s.as_deref() == Some("ready")) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > deadline {
            return Err(states
                .iter()
                .map(|(n, s)| format!("{n}: {}", s.as_deref().unwrap_or("no holder")))
                .collect::<Vec<_>>()
                .join(", "));
        }
        // A poll interval: readiness is what the metrics say.
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[allow(clippy::print_stderr, clippy::too_many_lines)]
fn soak(root: &Path, bins: &Path, out: &Path, args: &Args) -> Result<Value> {
    let load_before = crate::bench::machine::load_average();
    let sim_args: Vec<String> = ["--speed", "0", "--block-size", "16", "--capacity-blocks"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([args.capacity_blocks.to_string()])
        .collect();
    let mut sims = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let (engine, model) = MODELS[i % MODELS.len()];
        sims.push(Sim::start(&bins.join("cortex-sim"), &format!("w{i}"), engine, model, &sim_args, out)?);
    }
    let names: Vec<String> = sims.iter().map(|s| s.name.clone()).collect();
    let public: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let config = out.join("gateway.yaml");
    std::fs::write(&config, gateway_yaml(root, public, &sims, args.ledger_budget_kib))?;
    let gateway: Proc =
        procs::start_gateway(&bins.join("cortex-gateway"), &config, public, &out.join("gateway.log"))?;
    let pid = gateway.child.id();
    wait_all_ready(public, &names, Duration::from_secs(60)).map_err(|s| {
        anyhow::anyhow!("the ledgers were not READY before the load: {s}\n{}", gateway.tail())
    })?;
    eprintln!(
        "==> {} requests at concurrency {} through the gateway (pid {pid}) onto {} workers; logs in {}",
        args.requests,
        args.concurrency,
        names.len(),
        out.display()
    );

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let start = Instant::now();
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::new(Mutex::new(Vec::new()));
    let sims = Arc::new(Mutex::new(sims));
    let sampler = {
        let (progress, stop, samples) = (Arc::clone(&progress), Arc::clone(&stop), Arc::clone(&samples));
        let total = args.requests;
        std::thread::spawn(move || sample_loop(pid, public, start, total, &progress, &stop, &samples))
    };
    let faults = {
        let (stop, sims) = (Arc::clone(&stop), Arc::clone(&sims));
        let a = args.clone();
        std::thread::spawn(move || fault_loop(&a, start, &stop, &sims))
    };
    let models: Vec<String> = MODELS.iter().map(|m| m.1.to_owned()).collect();
    let workload = Workload {
        prefixes: args.prefixes,
        churn_every: args.churn_every,
        prefix_words: 96,
        suffix_words: 16,
    };
    let mut interrupted = false;
    let failures: Vec<Failure> = rt.block_on(async {
        let load = load::run(
            public,
            &models,
            workload,
            args.requests,
            args.concurrency,
            start,
            Arc::clone(&progress),
        );
        tokio::pin!(load);
        tokio::select! {
            f = &mut load => f,
            _ = tokio::signal::ctrl_c() => {
                interrupted = true;
                progress.stop.store(true, Ordering::SeqCst);
                load.await
            }
        }
    });
    let duration = start.elapsed();
    stop.store(true, Ordering::SeqCst);
    let faults = faults.join().map_err(|_| anyhow::anyhow!("the fault thread panicked"))?;
    let _ = sampler.join();
    if interrupted {
        bail!("interrupted after {:.0} s; every process started was stopped", duration.as_secs_f64());
    }
    let ready = wait_all_ready(public, &names, args.ready_deadline);
    let metrics = scrape(public).unwrap_or_default();
    let mut gateway = gateway;
    let gateway_exit = gateway.child.try_wait().ok().flatten();
    let load_after = crate::bench::machine::load_average();
    let samples = samples.lock().map(|s| s.clone()).unwrap_or_default();
    write_samples(&out.join("samples.csv"), &samples)?;

    // The verdict.
    let mut failed_checks = Vec::new();
    let rss: Vec<f64> = samples.iter().map(|s| s.rss as f64).collect();
    let half = rss.len() / 2;
    let minmax = |xs: &[f64]| {
        (
            xs.iter().copied().fold(f64::INFINITY, f64::min),
            xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let (first_min, first_max) = minmax(&rss[..half]);
    let (second_min, second_max) = minmax(&rss[half..]);
    let flat = verdict::second_half_flatness(&rss, SMOOTH_WINDOW);
    match flat {
        Some(f) if f.spread <= args.rss_tolerance => {}
        Some(f) => failed_checks.push(format!(
            "RSS over the second half moved {:.1} % (smoothed {:.1} → {:.1} MiB), more than {:.0} %",
            f.spread * 100.0,
            f.min / MIB,
            f.max / MIB,
            args.rss_tolerance * 100.0
        )),
        None => failed_checks.push("too few RSS samples for a verdict".to_owned()),
    }
    let budget = (args.ledger_budget_kib * 1024) as f64;
    let ledger_max = samples.iter().filter_map(|s| s.ledger_bytes).fold(0.0, f64::max);
    let blocks_at_max =
        samples.iter().find(|s| s.ledger_bytes == Some(ledger_max)).and_then(|s| s.ledger_blocks);
    if ledger_max > budget {
        failed_checks
            .push(format!("ledger live bytes reached {ledger_max:.0}, over the budget of {budget:.0}"));
    }
    if samples.iter().all(|s| s.ledger_bytes.is_none()) {
        failed_checks.push("cortex_ledger_live_bytes was never read".to_owned());
    }
    let mut by_class: Vec<(String, &str, u64)> = Vec::new();
    let mut unexplained = 0u64;
    for f in &failures {
        let cause = if verdict::explained_by(f, &faults.outages, KILL_GRACE).is_some() {
            "worker kill"
        } else {
            unexplained += 1;
            "unexplained"
        };
        match by_class.iter_mut().find(|(c, k, _)| *c == f.class && *k == cause) {
            Some(e) => e.2 += 1,
            None => by_class.push((f.class.clone(), cause, 1)),
        }
    }
    let failed_total = progress.failed.load(Ordering::SeqCst);
    // Failures beyond the kept ones were not judged: they count as unexplained.
    unexplained += failed_total.saturating_sub(failures.len() as u64);
    if unexplained > 0 {
        let first = failures
            .iter()
            .find(|f| verdict::explained_by(f, &faults.outages, KILL_GRACE).is_none())
            .map(|f| format!(" (first: request {} at {:.1} s, {})", f.index, f.start.as_secs_f64(), f.class))
            .unwrap_or_default();
        failed_checks.push(format!("{unexplained} failed request(s) no worker kill explains{first}"));
    }
    let ready_after = match &ready {
        Ok(d) => Some(d.as_secs_f64()),
        Err(states) => {
            failed_checks.push(format!(
                "not every ledger READY {} s after the load: {states}",
                args.ready_deadline.as_secs()
            ));
            None
        }
    };
    let log = std::fs::read_to_string(out.join("gateway.log")).unwrap_or_default();
    let panics = log.lines().filter(|l| l.contains("panicked at")).count();
    let misaligned = log.lines().filter(|l| l.contains("worker misaligned")).count();
    if panics > 0 {
        failed_checks
            .push(format!("the gateway logged {panics} panic(s); see {}", out.join("gateway.log").display()));
    }
    if let Some(status) = gateway_exit {
        failed_checks.push(format!("the gateway exited during the soak ({status})"));
    }
    let done = progress.done.load(Ordering::SeqCst);
    if done < args.requests {
        failed_checks.push(format!("only {done} of {} requests were answered", args.requests));
    }
    if !faults.errors.is_empty() {
        failed_checks.push(format!(
            "{} fault(s) could not be injected (first: {})",
            faults.errors.len(),
            faults.errors[0]
        ));
    }
    let group = |name: &str, key: &str| -> Value {
        verdict::sum_by(&metrics, name, key).into_iter().map(|(k, v)| (k, json!(v))).collect()
    };
    Ok(json!({
        "command": format!(
            "cargo xtask soak-gateway --requests {} --concurrency {} --workers {} --capacity-blocks {} --prefixes {} --churn-every {} --ledger-budget-kib {} --restart-every {}s --gap-every {}s --publisher-restart-every {}s",
            args.requests, args.concurrency, args.workers, args.capacity_blocks, args.prefixes,
            args.churn_every, args.ledger_budget_kib, args.restart_every.as_secs_f64(),
            args.gap_every.as_secs_f64(), args.publisher_restart_every.as_secs_f64()
        ),
        "machine": {
            "cores": std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "requests": args.requests,
        "answered": done,
        "duration_s": duration.as_secs_f64(),
        "requests_per_s": done as f64 / duration.as_secs_f64(),
        "rss_mib": {
            "first_half_min": first_min / MIB, "first_half_max": first_max / MIB,
            "second_half_min": second_min / MIB, "second_half_max": second_max / MIB,
            "second_half_smoothed_min": flat.map(|f| f.min / MIB),
            "second_half_smoothed_max": flat.map(|f| f.max / MIB),
            "second_half_spread": flat.map(|f| f.spread),
            "tolerance": args.rss_tolerance,
            "smoothing_window_s": SMOOTH_WINDOW,
        },
        "ledger": {
            "budget_bytes": budget,
            "live_bytes_max": ledger_max,
            "blocks_at_max": blocks_at_max,
            "bytes_per_block_at_max": blocks_at_max.filter(|b| *b > 0.0).map(|b| ledger_max / b),
            "live_bytes_end": verdict::samples(&metrics, "cortex_ledger_live_bytes").first().map(|s| s.1),
            "evictions": group("cortex_ledger_evictions_total", "reason"),
        },
        "failures": {
            "total": failed_total,
            "unexplained": unexplained,
            "by_class": by_class.iter().map(|(c, k, n)| json!({"class": c, "cause": k, "count": n})).collect::<Vec<_>>(),
        },
        "faults": {
            "worker_kills": faults.outages.len(),
            "kills": faults.outages.iter().map(|o| json!({
                "worker": o.worker, "killed_s": o.killed.as_secs_f64(), "back_s": o.back.as_secs_f64()
            })).collect::<Vec<_>>(),
            "gaps_with_replay": faults.gaps_replayed,
            "gaps_without_replay": faults.gaps_unreplayed,
            "batches_dropped": faults.batches_dropped,
            "publisher_restarts": faults.publisher_restarts,
            "not_injected": faults.errors,
        },
        "gateway": {
            "requests_by_outcome": group("cortex_requests_total", "outcome"),
            "requests_by_mode": group("cortex_requests_total", "mode"),
            "upstream_errors_by_class": group("cortex_upstream_errors_total", "class"),
            "retries": verdict::samples(&metrics, "cortex_retries_total").iter().map(|s| s.1).sum::<f64>(),
            "event_transitions_by_reason": group("cortex_event_transitions_total", "reason"),
            "log_panics": panics,
            "log_misaligned_warnings": misaligned,
        },
        "ready_at_end_after_s": ready_after,
        "verdict": {"failures": failed_checks},
    }))
}

const MIB: f64 = 1024.0 * 1024.0;

#[allow(clippy::print_stderr)]
fn sample_loop(
    pid: u32,
    public: SocketAddr,
    start: Instant,
    total: u64,
    progress: &Progress,
    stop: &AtomicBool,
    samples: &Mutex<Vec<Sample>>,
) {
    let mut next = start.into_std();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        next += Duration::from_secs(1);
        if let Some(wait) = next.checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(wait);
        }
        let Some(rss) = procs::rss_bytes(pid) else { break };
        let metrics = scrape(public).unwrap_or_default();
        let gauge = |name: &str| verdict::samples(&metrics, name).first().map(|s| s.1);
        let s = Sample {
            at: start.elapsed(),
            rss,
            ledger_bytes: gauge("cortex_ledger_live_bytes"),
            ledger_blocks: gauge("cortex_ledger_blocks"),
            done: progress.done.load(Ordering::Relaxed), // a counter
            failed: progress.failed.load(Ordering::Relaxed), // a counter
        };
        if let Ok(mut v) = samples.lock() {
            v.push(s);
        }
        n += 1;
        if n.is_multiple_of(10) {
            eprintln!(
                "  {:>5.0} s  answered {}/{total}  failed {}  gateway RSS {:.1} MiB  ledger {:.2} MiB",
                s.at.as_secs_f64(),
                s.done,
                s.failed,
                s.rss as f64 / MIB,
                s.ledger_bytes.unwrap_or(0.0) / MIB
            );
        }
    }
}

fn write_samples(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut csv = String::from("seconds,gateway_rss_bytes,ledger_live_bytes,ledger_blocks,answered,failed\n");
    let opt = |v: Option<f64>| v.map_or(String::new(), |b| format!("{b:.0}"));
    for s in samples {
        let _ = writeln!(
            csv,
            "{:.1},{},{},{},{},{}",
            s.at.as_secs_f64(),
            s.rss,
            opt(s.ledger_bytes),
            opt(s.ledger_blocks),
            s.done,
            s.failed
        );
    }
    std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))
}

/// The fault schedule, until `stop`: a kill and restart every `restart_every` (round robin over
/// the workers), a gap every `gap_every` (round robin, replay answered on even gaps and refused
/// on odd ones, turned back on a few seconds later), a publisher restart every
/// `publisher_restart_every`.
#[allow(clippy::print_stderr)]
fn fault_loop(args: &Args, start: Instant, stop: &AtomicBool, sims: &Mutex<Vec<Sim>>) -> FaultLog {
    let mut log = FaultLog::default();
    let n = args.workers.max(1);
    let (mut kills, mut gaps, mut pubs) = (0usize, 0usize, 0usize);
    let at = |period: Duration, k: usize| period * u32::try_from(k + 1).unwrap_or(u32::MAX);
    let mut replay_off: Option<(usize, Duration)> = None;
    let note = |log: &mut FaultLog, r: Result<()>| {
        if let Err(e) = r {
            eprintln!("  fault not injected: {e:#}");
            log.errors.push(format!("{e:#}"));
        }
    };
    while !stop.load(Ordering::SeqCst) {
        // A poll interval of the schedule.
        std::thread::sleep(Duration::from_millis(50));
        let now = start.elapsed();
        let Ok(mut sims) = sims.lock() else { break };
        if let Some((w, until)) = replay_off
            && now >= until
        {
            note(&mut log, sims[w].replay(true));
            replay_off = None;
        }
        if now >= at(args.restart_every, kills) {
            let w = kills % n;
            kills += 1;
            let killed = start.elapsed();
            sims[w].kill();
            let r = sims[w].restart();
            let back = start.elapsed();
            eprintln!(
                "  {:>5.0} s  killed {} (kill -9), back on its ports after {:.2} s",
                killed.as_secs_f64(),
                sims[w].name,
                (back - killed).as_secs_f64()
            );
            log.outages.push(Outage { worker: sims[w].name.clone(), killed, back });
            if replay_off.is_some_and(|(r, _)| r == w) {
                replay_off = None; // the new process answers replays
            }
            note(&mut log, r);
        }
        if now >= at(args.gap_every, gaps) && replay_off.is_none() {
            let w = gaps % n;
            let count = 1 + (gaps % 3) as u64;
            let replayed = gaps % 2 == 0;
            gaps += 1;
            if !replayed {
                let r = sims[w].replay(false);
                let ok = r.is_ok();
                note(&mut log, r);
                if !ok {
                    continue;
                }
                replay_off = Some((w, now + Duration::from_secs(3)));
            }
            let r = sims[w].drop_batches(count);
            if r.is_ok() {
                log.batches_dropped += count;
                if replayed {
                    log.gaps_replayed += 1;
                } else {
                    log.gaps_unreplayed += 1;
                }
            }
            note(&mut log, r);
        }
        if now >= at(args.publisher_restart_every, pubs) {
            let w = (pubs + 1) % n;
            pubs += 1;
            let r = sims[w].restart_publisher();
            if r.is_ok() {
                log.publisher_restarts += 1;
            }
            note(&mut log, r);
        }
    }
    if let Some((w, _)) = replay_off
        && let Ok(sims) = sims.lock()
    {
        note(&mut log, sims[w].replay(true));
    }
    log
}

fn summary(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "requests {} answered in {:.0} s ({:.0} req/s); load average {:.2} → {:.2}",
        r["answered"],
        f(&r["duration_s"]),
        f(&r["requests_per_s"]),
        f(&r["machine"]["load_average_before"]),
        f(&r["machine"]["load_average_after"]),
    );
    let m = &r["rss_mib"];
    let _ = writeln!(
        s,
        "gateway RSS (MiB): first half {:.1}–{:.1}, second half {:.1}–{:.1}; smoothed second half {:.1}–{:.1} ({:.1} %)",
        f(&m["first_half_min"]),
        f(&m["first_half_max"]),
        f(&m["second_half_min"]),
        f(&m["second_half_max"]),
        f(&m["second_half_smoothed_min"]),
        f(&m["second_half_smoothed_max"]),
        f(&m["second_half_spread"]) * 100.0
    );
    let l = &r["ledger"];
    let _ = writeln!(
        s,
        "ledger live bytes: max {:.0} of a {:.0} budget ({:.0} blocks, {:.0} B each); evictions {}",
        f(&l["live_bytes_max"]),
        f(&l["budget_bytes"]),
        f(&l["blocks_at_max"]),
        f(&l["bytes_per_block_at_max"]),
        l["evictions"]
    );
    let _ = writeln!(
        s,
        "failures: {} ({} unexplained) {}",
        r["failures"]["total"], r["failures"]["unexplained"], r["failures"]["by_class"]
    );
    let fl = &r["faults"];
    let _ = writeln!(
        s,
        "faults: {} worker kills, {} gaps replayed, {} not, {} batches dropped, {} publisher restarts",
        fl["worker_kills"],
        fl["gaps_with_replay"],
        fl["gaps_without_replay"],
        fl["batches_dropped"],
        fl["publisher_restarts"]
    );
    let g = &r["gateway"];
    let _ = writeln!(
        s,
        "gateway: outcomes {}, modes {}, upstream errors {}, retries {}, event transitions {}",
        g["requests_by_outcome"],
        g["requests_by_mode"],
        g["upstream_errors_by_class"],
        g["retries"],
        g["event_transitions_by_reason"]
    );
    let _ = write!(s, "every ledger READY {} s after the load", r["ready_at_end_after_s"]);
    s
}
