//! `cargo xtask replay`: routing quality on a real trace. Replays request streams open loop, at
//! their own timestamps compressed in time, through a router in front of a fresh simulated
//! cluster per policy — Cortex's gateway in this process with each of its policies, and SGLang's
//! router when it is installed — and reports the share of prompt tokens served from cache
//! against the infinite-cache bound, simulated TTFT, load imbalance and failures, as a table, a
//! JSON file and SVG plots under `target/replay/`.
//!
//! Key decisions:
//! - Fixed, printed defaults (8 workers; each caches 1/16 of the workload's unique pages; trace
//!   time 10× faster than real time; the first 2,000 Mooncake requests), so results are
//!   comparable run to run and cannot be tuned away; every knob is a flag.
//! - The simulators' virtual clock runs at the trace's clock (speed = 1/compression), so a
//!   simulated second is a trace second and queueing is modeled; their cost model is scaled by
//!   the text expansion (one text token stands for 512/`chunk_tokens` trace tokens): prefill
//!   cost per token and the chunked-prefill budget, so prompts cost what the trace's prompts
//!   would.
//! - Every policy gets the same text requests and a cold cluster; the front end is the only
//!   thing that changes.
//!
//! Modules: [`text`] (ids → text), [`workload`] (trace and generators), [`bound`] (tokens,
//! pages, the bound), [`cluster`] (simulators, Cortex, SGLang's router), [`driver`] (the
//! open-loop sender), [`metrics`], [`svg`], [`report`].

pub mod bound;
pub mod cluster;
pub mod driver;
pub mod metrics;
pub mod pd;
pub mod replicas;
pub mod report;
pub mod svg;
pub mod text;
pub mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cortex_hash::text::TextTokenizer;
use cortex_sim::Timing;

use cluster::{ClusterSpec, Engine, SglangLauncher, Sims};
use driver::{DriverOptions, Send};
use metrics::PolicyResult;
use workload::{Kind, Shape};

/// The flags of `cargo xtask replay`.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "replay")]
pub struct Args {
    /// Workloads to replay, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "mooncake,hot-spot")]
    pub workload: Vec<Kind>,
    /// Policies, each on a fresh cluster: Cortex's scheduler policies by name (cache_aware is
    /// Cortex's default; `cache_aware_v1` the first wave's, on this gateway's bookings; `NAME@N`:
    /// N gateway replicas in separate processes, the requests spread across them round robin,
    /// each following the events itself and only the engines' load reports connecting them) and
    /// `sglang` for SGLang's router with its cache_aware policy (default:
    /// `cache_aware,cache_aware_v1,round_robin,power_of_two,least_load,sglang`). With `--pd`: the PD front ends
    /// `cortex`, `cortex-load-decode`, `sglang-pd` (SGLang workers) and `vllm-toy` (vLLM
    /// workers); default: the first two and the engine's peer.
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// A disaggregated cluster of P prefill and D decode workers (`--pd 4,4`) instead of
    /// `--workers` regular ones, behind the PD front ends of `--policies`.
    #[arg(long)]
    pub pd: Option<pd::PdShape>,
    /// With `--pd`: Cortex serves a request on the decode worker alone when it lacks at most
    /// this many prompt tokens (vLLM; the `cortex` front end only): two pages, so only a request
    /// whose prefill would do almost nothing skips it.
    #[arg(long, default_value_t = 32)]
    pub decode_only_max_uncached: u32,
    /// With `--pd` and SGLang: decode workers without the radix cache
    /// (`--disaggregation-decode-enable-radix-cache` off, SGLang's default; they then cache and
    /// announce nothing, and every decode choice is by load).
    #[arg(long)]
    pub no_decode_radix_cache: bool,
    /// With `--pd` and vLLM: the Python that runs vLLM's toy proxy (needs fastapi, uvicorn,
    /// httpx); `auto`: the venv `cargo xtask pd-check` creates under `target/`, else `python3`.
    #[arg(long, default_value = "auto")]
    pub python: String,
    /// Extra settings of Cortex's `scheduler:` section, as YAML flow-map entries applied to every
    /// Cortex policy (for example `recompute_weight: 0.5, bounded_load_epsilon: 0.5`; a setting no
    /// pool of a policy reads is refused, as in the gateway); see
    /// docs/configuration.md.
    #[arg(long, default_value = "")]
    pub scheduler: String,
    /// Requests per workload (Mooncake: the first N of the trace; default 2000; synthetic
    /// workloads have their own defaults).
    #[arg(long)]
    pub requests: Option<usize>,
    /// The whole Mooncake trace (12,031 requests, about 6 minutes per policy).
    #[arg(long)]
    pub all: bool,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Each worker caches 1/N of the workload's unique pages.
    #[arg(long, default_value_t = 16)]
    pub capacity_divisor: u64,
    /// Pages per worker, overriding --capacity-divisor.
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// Trace time runs this many times faster than real time (the simulators' clock follows).
    #[arg(long, default_value_t = 10.0)]
    pub compression: f64,
    /// Text tokens of one trace block (512 tokens): the expansion of the trace.
    #[arg(long, default_value_t = 64)]
    pub chunk_tokens: u32,
    /// Cap on every request's output tokens (Mooncake: the trace's output_length, capped).
    #[arg(long, default_value_t = 256)]
    pub max_output: u32,
    /// Tokens per KV page of the simulated engines and the gateway.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Simulated engine.
    #[arg(long, value_enum, default_value = "sglang")]
    pub engine: Engine,
    /// Simulated prefill cost per text token, µs (default: 100 µs per trace token, times
    /// 512/chunk_tokens).
    #[arg(long)]
    pub prefill_us_per_token: Option<f64>,
    /// Requests running at once per worker.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Synthetic workloads: arrivals per second of trace time (shared-prefix 4, multi-turn 2,
    /// hot-spot 8).
    #[arg(long)]
    pub rate: Option<f64>,
    /// shared-prefix: groups.
    #[arg(long, default_value_t = 16)]
    pub groups: usize,
    /// Chunks of the shared prefix (shared-prefix 4, hot-spot 16, multi-turn 2).
    #[arg(long)]
    pub prefix_chunks: Option<usize>,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 6)]
    pub turns: usize,
    /// Seed of the synthetic generators.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// SGLang's router: `auto` (smg on PATH, or a python3 with sglang_router), `off`, or the
    /// path of an `smg` executable or of a Python that has it.
    #[arg(long, default_value = "auto")]
    pub sglang_router: String,
    /// Output directory (relative to the workspace root).
    #[arg(long, default_value = "target/replay")]
    pub out: PathBuf,
    /// Give up on one request after this many wall-clock seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_secs: u64,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
}

/// Trace tokens per trace block.
const TRACE_BLOCK: f64 = 512.0;

impl Args {
    /// Trace tokens one text token stands for.
    #[must_use]
    pub fn scale(&self) -> f64 {
        TRACE_BLOCK / f64::from(self.chunk_tokens.max(1))
    }

    /// The simulators' latency model.
    #[must_use]
    pub fn timing(&self) -> Timing {
        let per_token = self.prefill_us_per_token.unwrap_or(100.0 * self.scale());
        Timing {
            speed: 1.0 / self.compression,
            prefill_per_token: Duration::from_secs_f64(per_token / 1e6),
            ..Timing::default()
        }
    }

    /// The chunked-prefill budget: 8192 trace tokens per step.
    #[must_use]
    pub fn max_batched_tokens(&self) -> usize {
        ((8192.0 / self.scale()) as usize).max(self.block_size)
    }

    fn shape(&self) -> Shape {
        Shape {
            requests: self.requests,
            all: self.all,
            max_output: self.max_output,
            chunk_tokens: self.chunk_tokens,
            rate: self.rate,
            groups: self.groups,
            prefix_chunks: self.prefix_chunks,
            turns: self.turns,
            seed: self.seed,
        }
    }

    /// The policies (or PD front ends) to run, in order.
    #[must_use]
    pub fn policies(&self) -> Vec<String> {
        if !self.policies.is_empty() {
            return self.policies.clone();
        }
        match self.pd {
            Some(_) => pd::policies(self.engine),
            None => ["cache_aware", "cache_aware_v1", "round_robin", "power_of_two", "least_load", "sglang"]
                .map(str::to_owned)
                .to_vec(),
        }
    }

    /// Workers in the cluster.
    #[must_use]
    pub fn cluster_workers(&self) -> usize {
        self.pd.map_or(self.workers, |p| p.prefill + p.decode)
    }

    fn validate(&self) -> Result<()> {
        if self.workers == 0 || self.capacity_divisor == 0 || self.block_size == 0 {
            bail!("--workers, --capacity-divisor and --block-size must be positive");
        }
        if !(self.compression.is_finite() && self.compression > 0.0) {
            bail!("--compression must be a positive number");
        }
        if self.chunk_tokens < 2 {
            bail!("--chunk-tokens must be at least 2");
        }
        if self.pd.is_some() {
            for p in self.policies() {
                pd::check(&p, self.engine)?;
            }
            return Ok(());
        }
        for p in &self.policies() {
            if p != "sglang" {
                if let Some((_, count)) = p.split_once('@')
                    && count.parse::<usize>().ok().filter(|&c| c >= 1).is_none()
                {
                    bail!("--policies: `{p}`: the replica count must be a positive number");
                }
                replicas_of(p)
                    .0
                    .parse::<cortex_sched::PolicyKind>()
                    .map_err(|e| anyhow::anyhow!("--policies: `{p}`: {e}"))?;
            }
        }
        Ok(())
    }
}

/// One workload's run.
#[derive(Clone, Debug)]
pub struct WorkloadRun {
    /// Which workload.
    pub kind: Kind,
    /// What it is.
    pub description: String,
    /// Requests.
    pub requests: usize,
    /// Σ prompt tokens (replay tokenization).
    pub prompt_tokens: u64,
    /// Infinite-cache bound, share of prompt tokens (engine rule).
    pub token_bound: f64,
    /// Infinite-cache bound in trace blocks.
    pub block_bound: f64,
    /// Reference: one LRU cache of the cluster's total size (see [`bound::Analysis::lru_share`]).
    pub lru_share: f64,
    /// Reference: the per-window load CoV of an offline greedy balance (see
    /// [`metrics::balanced_cov`]).
    pub balanced_cov: f64,
    /// Unique pages.
    pub unique_pages: u64,
    /// Pages per worker used.
    pub capacity_blocks: usize,
    /// Why the capacity differs from the rule, if it does.
    pub capacity_note: Option<String>,
    /// Trace time covered.
    pub span: Duration,
    /// Per policy.
    pub results: Vec<PolicyResult>,
    /// Policies skipped, with the reason.
    pub skipped: Vec<(String, String)>,
    /// With `--pd`: per PD front end.
    pub pd_results: Vec<pd::PdResult>,
}

/// A whole replay.
#[derive(Clone, Debug)]
pub struct Replay {
    /// The flags used.
    pub args: Args,
    /// Per workload.
    pub workloads: Vec<WorkloadRun>,
    /// SGLang's router version, when it ran.
    pub sglang_version: Option<String>,
    /// Wall-clock duration of the whole replay.
    pub wall: Duration,
}

/// A Cortex policy name and its replica count (`cache_aware@2`: two replicas).
fn replicas_of(policy: &str) -> (&str, usize) {
    match policy.split_once('@') {
        Some((p, n)) => (p, n.parse().unwrap_or(1).max(1)),
        None => (policy, 1),
    }
}

fn label(policy: &str) -> String {
    match replicas_of(policy) {
        ("sglang", _) => "sglang-router cache_aware".to_owned(),
        (p, 1) => format!("cortex {p}"),
        (p, n) => format!("cortex {p} ×{n} replicas"),
    }
}

/// Runs the replay described by `args` on the workspace at `root`.
///
/// # Errors
/// A workload cannot be built, or a cluster or front end cannot start.
pub fn run(root: &Path, args: &Args) -> Result<Replay> {
    args.validate()?;
    let began = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let tokenizer = TextTokenizer::from_file(root.join("golden/models/qwen3/tokenizer.json"))
        .context("loading the Qwen3 tokenizer")?;
    let out_dir = root.join(&args.out);
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let policies = args.policies();
    let launcher = if policies.iter().any(|p| p == "sglang" || p == pd::SGLANG_PD) {
        Some(SglangLauncher::find(&args.sglang_router))
    } else {
        None
    };
    let sglang_version = match &launcher {
        Some(Ok(l)) => Some(l.version()),
        _ => None,
    };
    let mut workloads = Vec::new();
    for &kind in &args.workload {
        let w = workload::build(kind, &args.shape(), root)?;
        let analysis = bound::analyse(&w, &tokenizer, args.block_size)?;
        let rule = analysis.unique_pages.div_ceil(args.capacity_divisor) as usize;
        // Room for eight of the workload's longest requests at once (prompt and output): a small
        // synthetic workload's 1/16 would not even let a worker run its requests.
        let longest =
            analysis.max_prompt_pages as usize + (args.max_output as usize).div_ceil(args.block_size);
        let need = 8 * longest;
        let (capacity_blocks, capacity_note) = match args.capacity_blocks {
            Some(c) => (
                c,
                Some(format!("set by --capacity-blocks (the 1/{} rule gives {rule})", args.capacity_divisor)),
            ),
            None if rule < need => (
                need,
                Some(format!(
                    "raised from {rule} (1/{} of the unique pages) to room for eight of the longest requests",
                    args.capacity_divisor
                )),
            ),
            None => (rule, None),
        };
        let max_prompt = analysis.prompt_tokens.iter().copied().max().unwrap_or(0) as usize;
        let spec = ClusterSpec {
            workers: args.cluster_workers(),
            engine: args.engine,
            block_size: args.block_size,
            capacity_blocks,
            timing: args.timing(),
            max_model_len: (max_prompt + args.max_output as usize + 16).max(32_768),
            max_running: args.max_running,
            max_batched_tokens: args.max_batched_tokens(),
            prefill_workers: args.pd.map(|p| p.prefill),
            decode_radix_cache: !args.no_decode_radix_cache,
        };
        let sends: Vec<Send> = w
            .requests
            .iter()
            .map(|r| Send {
                at: r.at.div_f64(args.compression),
                prompt: Arc::from(text::prompt(&r.pieces)),
                max_tokens: r.max_tokens,
            })
            .collect();
        let mut run = WorkloadRun {
            kind,
            description: w.description.clone(),
            requests: w.requests.len(),
            prompt_tokens: analysis.total_prompt_tokens(),
            token_bound: analysis.token_bound(),
            block_bound: analysis.block_bound,
            lru_share: analysis.lru_share(capacity_blocks as u64 * args.workers as u64, args.block_size),
            balanced_cov: metrics::balanced_cov(&w, &analysis, args.workers),
            unique_pages: analysis.unique_pages,
            capacity_blocks,
            capacity_note,
            span: w.requests.last().map_or(Duration::ZERO, |r| r.at),
            results: Vec::new(),
            skipped: Vec::new(),
            pd_results: Vec::new(),
        };
        if !args.quiet {
            eprintln!(
                "replay {}: {} requests over {:.0} s of trace time ({:.0} s wall), capacity {} pages per worker",
                kind.name(),
                run.requests,
                run.span.as_secs_f64(),
                run.span.as_secs_f64() / args.compression,
                capacity_blocks
            );
        }
        if args.pd.is_some() {
            let python = pd::python(root, &args.python);
            for policy in &policies {
                let sglang = match (policy.as_str(), &launcher) {
                    (pd::SGLANG_PD, Some(Err(why))) => {
                        eprintln!("  skipping SGLang's PD router: {why}");
                        run.skipped.push((pd::label(policy, args.decode_only_max_uncached), why.clone()));
                        continue;
                    }
                    (_, Some(Ok(l))) => Some(l),
                    _ => None,
                };
                let pd_run = pd::PdRun {
                    root,
                    spec: &spec,
                    scheduler: &args.scheduler,
                    decode_only_max_uncached: args.decode_only_max_uncached,
                    sglang,
                    python: &python,
                    log: out_dir.join(format!("{}-{policy}.log", kind.name())),
                    timeout: Duration::from_secs(args.timeout_secs),
                    progress: !args.quiet,
                    compression: args.compression,
                };
                let result = rt.block_on(pd::run_policy(&pd_run, policy, &sends, &analysis))?;
                if !args.quiet {
                    eprintln!(
                        "  {:<52} TTFT p50/p90/p99 {:.0}/{:.0}/{:.0} ms  hit {:.1}%  transferred {}  decode-only {:.0}%  failed {}",
                        result.label,
                        result.ttft[0],
                        result.ttft[1],
                        result.ttft[2],
                        result.hit * 100.0,
                        result.transferred_tokens,
                        result.decode_only_share * 100.0,
                        result.failed
                    );
                }
                run.pd_results.push(result);
            }
            workloads.push(run);
            continue;
        }
        for policy in &policies {
            let launcher = match (policy.as_str(), &launcher) {
                ("sglang", Some(Err(why))) => {
                    eprintln!("  skipping SGLang's router: {why}");
                    run.skipped.push((label(policy), why.clone()));
                    continue;
                }
                ("sglang", Some(Ok(l))) => Some(l.clone()),
                _ => None,
            };
            let log = out_dir.join(format!("{}-sglang-router.log", kind.name()));
            let tsv = out_dir.join(format!("{}-{}.requests.tsv", kind.name(), policy.replace('@', "x")));
            let result = rt.block_on(run_policy(
                root,
                args,
                &spec,
                policy,
                launcher.as_ref(),
                (&log, &tsv),
                &sends,
                &w,
                &analysis,
            ))?;
            if !args.quiet {
                eprintln!(
                    "  {:<30} hit {:>5.1}% ({:.0}% of bound)  TTFT p50/p99 {:.0}/{:.0} ms  CoV {:.2}  failed {} shed {}",
                    result.label,
                    result.hit_ratio * 100.0,
                    result.of_bound * 100.0,
                    result.ttft.p50,
                    result.ttft.p99,
                    result.load.cov,
                    result.failed,
                    result.shed
                );
            }
            run.results.push(result);
        }
        workloads.push(run);
    }
    drop(rt);
    Ok(Replay { args: args.clone(), workloads, sglang_version, wall: began.elapsed() })
}

#[allow(clippy::too_many_arguments)] // one call site; the pieces of one run
async fn run_policy(
    root: &Path,
    args: &Args,
    spec: &ClusterSpec,
    policy: &str,
    launcher: Option<&SglangLauncher>,
    (log, tsv): (&Path, &Path),
    sends: &[Send],
    w: &workload::Workload,
    analysis: &bound::Analysis,
) -> Result<PolicyResult> {
    let spec2 = spec.clone();
    let sims = tokio::task::spawn_blocking(move || Sims::start(&spec2)).await??;
    let label = label(policy);
    let progress = (!args.quiet).then(|| label.clone());
    let timeout = Duration::from_secs(args.timeout_secs);
    let mut learned = None;
    let (outcomes, wall) = match launcher {
        Some(l) => {
            let router = match cluster::start_sglang(l, &sims, log).await {
                Ok(r) => r,
                Err(e) => {
                    tokio::task::spawn_blocking(move || sims.shutdown()).await?;
                    return Err(e);
                }
            };
            let opts = DriverOptions {
                target: router.addr,
                targets: Vec::new(),
                timeout,
                progress,
                require_sim_ttft: true,
            };
            let t = Instant::now();
            let outcomes = driver::run(sends, &opts, Some(Arc::clone(&router.seen))).await;
            let wall = t.elapsed();
            router.stop().await;
            (outcomes, wall)
        }
        None if replicas_of(policy).1 > 1 => {
            let (name, n) = replicas_of(policy);
            let yaml =
                cluster::cortex_yaml(root, &sims, args.engine, args.block_size, name, &args.scheduler, "");
            let dir = log.parent().unwrap_or(root).to_path_buf();
            let replicas = match replicas::Replicas::start(&yaml, n, sims.workers.len(), &dir).await {
                Ok(r) => r,
                Err(e) => {
                    tokio::task::spawn_blocking(move || sims.shutdown()).await?;
                    return Err(e);
                }
            };
            let opts = DriverOptions {
                target: replicas.addrs[0],
                targets: replicas.addrs.clone(),
                timeout,
                progress,
                require_sim_ttft: true,
            };
            let t = Instant::now();
            let outcomes = driver::run(sends, &opts, None).await;
            let wall = t.elapsed();
            let views = replicas.workers_views().await;
            learned = Some(metrics::Learned::from_views(&views, &args.timing(), args.compression));
            replicas.stop().await;
            (outcomes, wall)
        }
        None => {
            let gw = match cluster::start_cortex(
                root,
                &sims,
                args.engine,
                args.block_size,
                replicas_of(policy).0,
                &args.scheduler,
                "",
            )
            .await
            {
                Ok(g) => g,
                Err(e) => {
                    tokio::task::spawn_blocking(move || sims.shutdown()).await?;
                    return Err(e);
                }
            };
            let opts = DriverOptions {
                target: gw.addr,
                targets: Vec::new(),
                timeout,
                progress,
                require_sim_ttft: true,
            };
            let t = Instant::now();
            let outcomes = driver::run(sends, &opts, None).await;
            let wall = t.elapsed();
            let view = gw.gateway.control().workers_view();
            learned = Some(metrics::Learned::from_views(&[view], &args.timing(), args.compression));
            gw.shutdown().await;
            (outcomes, wall)
        }
    };
    tokio::task::spawn_blocking(move || sims.shutdown()).await?;
    // Each request's wall-clock send and end and where it went, beside the run's log, for a
    // closer look (the load bound's check is made from these).
    let _ = std::fs::write(tsv, requests_tsv(&outcomes, sends, replicas_of(policy).1));
    let mut r = metrics::summarize(&label, w, analysis, &outcomes, args.workers, args.compression, wall);
    r.learned_rate = learned;
    if launcher.is_none() && replicas_of(policy).0 == "cache_aware" {
        r.cap = bound_epsilon(&args.scheduler).map(|e| {
            metrics::CapCheck::measure(
                &outcomes,
                replicas_of(policy).1,
                args.workers,
                (e, cortex_sched::TIME_BOUND_FLOOR),
            )
        });
    }
    Ok(r)
}

/// One line per request: its index, the replica it went to, when it was sent, reached its worker
/// and ended (wall clock from the run's start, ms), its worker, its simulated TTFT, its prompt
/// and cached tokens as the worker counted them, its status, the latest earlier request its
/// prompt extends (a conversation's previous turn), and the prompt's first 64 characters.
fn requests_tsv(outcomes: &[driver::Outcome], sends: &[Send], replicas: usize) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut out = String::from(
        "request\treplica\tsent_wall_ms\tarrived_wall_ms\tend_wall_ms\tworker\tsim_ttft_ms\tprompt_tokens\tcached_tokens\tstatus\textends\tprompt_head\n",
    );
    for (i, (o, s)) in outcomes.iter().zip(sends).enumerate() {
        let head: String = s.prompt.chars().take(64).map(|c| if c.is_control() { ' ' } else { c }).collect();
        let extends = (0..i)
            .rev()
            .find(|&j| sends[j].prompt.len() < s.prompt.len() && s.prompt.starts_with(&*sends[j].prompt))
            .map_or("-".to_owned(), |j| j.to_string());
        let end = if o.wall_end > Duration::ZERO {
            format!("{:.3}", ms(o.sent_at + o.wall_end))
        } else {
            "-".to_owned()
        };
        out.push_str(&format!(
            "{i}\t{}\t{:.3}\t{}\t{end}\t{}\t{}\t{}\t{}\t{}\t{extends}\t{head}\n",
            i % replicas.max(1),
            ms(o.sent_at),
            o.arrived_at.map_or("-".to_owned(), |a| format!("{:.3}", ms(a))),
            o.worker.map_or("-".to_owned(), |w| w.to_string()),
            o.sim_ttft_ms.map_or("-".to_owned(), |t| format!("{t:.1}")),
            o.prompt_tokens,
            o.cached_tokens,
            o.status,
        ));
    }
    out
}

/// The load bound's ε in force for `cache_aware` under the `--scheduler` settings: the
/// default's (1), or what `bounded_load_epsilon` sets; `None` when it is `null` (no bound).
fn bound_epsilon(scheduler: &str) -> Option<f64> {
    let Some((_, rest)) = scheduler.split_once("bounded_load_epsilon") else {
        return cortex_sched::SchedConfig::default().bounded_load.map(|b| b.epsilon);
    };
    let value = rest.trim_start().strip_prefix(':')?.split([',', '}']).next()?.trim();
    value.parse().ok()
}

/// `cargo xtask replay`: runs, prints the report on stdout, writes the files.
///
/// # Errors
/// As [`run`], or a result file cannot be written.
#[allow(clippy::print_stdout)] // the report is the command's output
pub fn cli(root: &Path, args: &Args) -> Result<std::process::ExitCode> {
    let command = format!("cargo xtask {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "));
    let replay = run(root, args)?;
    let goals = report::goals(&replay);
    println!("{}", report::table(&replay, &goals));
    for f in report::write(&replay, &goals, &command, &root.join(&args.out))? {
        println!("wrote {}", f.strip_prefix(root).unwrap_or(&f).display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn defaults_are_the_issues() {
        let a = Args::try_parse_from(["replay"]).unwrap();
        assert_eq!(a.workload, vec![Kind::Mooncake, Kind::HotSpot]);
        assert_eq!(
            a.policies(),
            ["cache_aware", "cache_aware_v1", "round_robin", "power_of_two", "least_load", "sglang"]
        );
        let pd = Args::try_parse_from(["replay", "--pd", "4,4", "--engine", "vllm"]).unwrap();
        assert_eq!(pd.policies(), ["cortex", "cortex-load-decode", "vllm-toy"]);
        assert_eq!(pd.cluster_workers(), 8);
        pd.validate().unwrap();
        let bad =
            Args::try_parse_from(["replay", "--pd", "4,4", "--policies", "sglang-pd", "--engine", "vllm"]);
        assert!(bad.unwrap().validate().is_err());
        assert_eq!((a.workers, a.capacity_divisor, a.chunk_tokens), (8, 16, 64));
        assert!((a.compression - 10.0).abs() < f64::EPSILON);
        assert!((a.timing().speed - 0.1).abs() < 1e-12);
        assert_eq!(a.timing().prefill_per_token, Duration::from_micros(800));
        assert_eq!(a.max_batched_tokens(), 1024);
        assert!(a.requests.is_none() && !a.all);
        a.validate().unwrap();
    }

    #[test]
    fn unknown_policies_are_refused() {
        let a = Args::try_parse_from(["replay", "--policies", "cache_aware,fastest"]).unwrap();
        let e = a.validate().unwrap_err().to_string();
        assert!(e.contains("fastest"), "{e}");
    }
}
