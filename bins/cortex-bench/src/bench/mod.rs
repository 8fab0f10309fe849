//! `cargo xtask bench`: every benchmark of the workspace in one run, and `docs/perf.md`'s tables
//! rewritten from it.
//!
//! It runs every `[[bench]]` target of the workspace (found with `cargo metadata`, with its
//! required features) — the criterion benches and the custom-harness ingest bench — then the
//! gateway overhead benchmark ([`overhead`], which must run optimized: `cargo xtask bench` runs
//! this crate in release, and a debug build re-runs that part with `cargo run --release`), and rewrites only the generated blocks of `docs/perf.md`
//! (see [`perfmd`]) with machine, date, commit, the command that reproduces each table, and
//! ratios against the baselines measured in the same run. `cargo xtask bench-peers` (the
//! dynamo-kv-router comparison) stays separate.
//!
//! Key decision: a table is rewritten only from numbers this run produced (criterion files
//! newer than the run's start, output of benches that ran), so `--only` can refresh one section
//! without touching the others, and a failed bench shows as failed instead of keeping old
//! numbers.

pub mod criterion;
pub mod machine;
pub mod overhead;
pub mod perfmd;
pub mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::SystemTime;

use anyhow::{Context, Result, bail};

use report::Results;

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Short runs: criterion warm-up 0.5 s and measurement 1 s per benchmark, the ledger report
    /// on one configuration, 3 overhead rounds of 1,000 requests.
    #[arg(long)]
    pub quick: bool,
    /// Only these parts, comma-separated: hashing, ledger, decode, ingest, sched, chat8k,
    /// overhead (the generated blocks of docs/perf.md of the same names are rewritten).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Interleaved rounds of the overhead benchmark [default: 7; 3 with --quick].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Measured requests per target, round and concurrency [default: 4000; 1000 with --quick].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Concurrency levels of the overhead benchmark, each measured separately.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub concurrency: Vec<usize>,
    /// Do not measure SGLang's router even if it is installed.
    #[arg(long)]
    pub no_sglang: bool,
    /// Print the generated blocks instead of rewriting docs/perf.md.
    #[arg(long)]
    pub dry_run: bool,
    /// Internal: run only the overhead benchmark in this (optimized) process and write its raw
    /// results to this file.
    #[arg(long, hide = true)]
    pub overhead_json: Option<PathBuf>,
}

/// The generated blocks of docs/perf.md and the bench targets (`package/bench`) each is made
/// from. `overhead` comes from the overhead benchmark; `criterion-all` lists everything.
const BLOCKS: &[(&str, &[&str])] = &[
    ("hashing", &["cortex-hash/hashing"]),
    ("ledger", &["cortex-radix/ledger"]),
    ("decode", &["cortex-events-vllm/decode", "cortex-events-sglang/decode"]),
    ("ingest", &["cortex-ingest/ingest"]),
    ("sched", &["cortex-sched/decision"]),
    ("chat8k", &["cortex-proxy/chat8k"]),
    ("overhead", &[]),
];

const ALL_BLOCK: &str = "criterion-all";

impl Args {
    fn rounds(&self) -> usize {
        self.rounds.unwrap_or(if self.quick { 3 } else { 7 }).max(1)
    }

    fn requests(&self) -> usize {
        self.requests.unwrap_or(if self.quick { 1000 } else { 4000 }).max(1)
    }

    fn overhead_options(&self) -> overhead::Options {
        let requests = self.requests();
        overhead::Options {
            rounds: self.rounds(),
            requests,
            warmup: (requests / 10).clamp(50, 500),
            concurrency: if self.concurrency.is_empty() { vec![1] } else { self.concurrency.clone() },
            sglang: !self.no_sglang,
        }
    }

    /// The blocks this run rewrites.
    fn blocks(&self) -> Result<Vec<&'static str>> {
        if self.only.is_empty() {
            let mut all: Vec<&str> = BLOCKS.iter().map(|(b, _)| *b).collect();
            all.push(ALL_BLOCK);
            return Ok(all);
        }
        let mut out = Vec::new();
        for o in &self.only {
            let Some((b, _)) = BLOCKS.iter().find(|(b, _)| b == o) else {
                bail!(
                    "--only {o}: unknown part (one of {})",
                    BLOCKS.iter().map(|(b, _)| *b).collect::<Vec<_>>().join(", ")
                );
            };
            out.push(*b);
        }
        Ok(out)
    }

    /// The command line that reproduces the overhead benchmark with these options.
    fn overhead_command(&self) -> String {
        let o = self.overhead_options();
        let c: Vec<String> = o.concurrency.iter().map(ToString::to_string).collect();
        format!(
            "cargo xtask bench --only overhead --rounds {} --requests {} --concurrency {}{}",
            o.rounds,
            o.requests,
            c.join(","),
            if o.sglang { "" } else { " --no-sglang" }
        )
    }
}

/// Runs `cargo xtask bench`.
///
/// # Errors
/// docs/perf.md lacks a block's markers, a bench cannot be started, or a file cannot be written.
/// A bench that fails is reported in its table and makes the command exit non-zero.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn run(root: &Path, args: &Args) -> Result<ExitCode> {
    let out_dir = crate::target_dir(root).join("bench");
    let log_dir = out_dir.join("logs");
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    if let Some(path) = &args.overhead_json {
        let v = overhead::run(root, &args.overhead_options(), &log_dir)?;
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let perf_path = root.join("docs/perf.md");
    let blocks = args.blocks()?;
    let doc =
        std::fs::read_to_string(&perf_path).with_context(|| format!("reading {}", perf_path.display()))?;
    perfmd::check(&doc, &blocks)?;

    let started = SystemTime::now();
    let mut machine = machine::Machine::now(root);
    eprintln!("bench: {}", machine.line());
    let wanted: Vec<&str> =
        BLOCKS.iter().filter(|(b, _)| blocks.contains(b)).flat_map(|(_, ids)| ids.iter().copied()).collect();
    let targets: Vec<criterion::BenchTarget> = criterion::discover(root)?
        .into_iter()
        .filter(|t| args.only.is_empty() || wanted.contains(&t.id().as_str()))
        .collect();
    let crit_args: Vec<String> = if args.quick {
        ["--warm-up-time", "0.5", "--measurement-time", "1"].map(str::to_owned).to_vec()
    } else {
        Vec::new()
    };
    let mut runs = BTreeMap::new();
    for t in &targets {
        let mut env = Vec::new();
        if args.quick && t.package == "cortex-radix" {
            env.push(("CORTEX_BENCH_CONFIGS".to_owned(), "8x10000".to_owned()));
        }
        let log = log_dir.join(format!("{}-{}.log", t.package, t.bench));
        let r = criterion::run(root, t, &crit_args, &env, &log)?;
        if !r.ok {
            eprintln!("bench: {} FAILED (log: {})", t.id(), log.display());
        }
        runs.insert(t.id(), r);
    }
    let estimates = criterion::collect(&crate::target_dir(root).join("criterion"), started)?;

    let overhead = if blocks.contains(&"overhead") {
        Some(run_overhead(root, args, &out_dir).map_err(|e| format!("{e:#}")))
    } else {
        None
    };
    machine.load_end = machine::load_average();
    let results = Results {
        machine,
        quick: args.quick,
        estimates,
        runs,
        overhead,
        overhead_command: args.overhead_command(),
    };

    // Read the page again: its prose may have been edited while the benchmarks ran.
    let mut doc =
        std::fs::read_to_string(&perf_path).with_context(|| format!("reading {}", perf_path.display()))?;
    perfmd::check(&doc, &blocks)?;
    for b in &blocks {
        let content = match *b {
            "hashing" => report::hashing(&results),
            "ledger" => report::ledger(&results),
            "decode" => report::decode(&results),
            "ingest" => report::ingest(&results),
            "sched" => report::sched(&results),
            "chat8k" => report::chat8k(&results),
            "overhead" => report::overhead(&results),
            _ => report::all(&results),
        };
        if args.dry_run {
            println!("{}\n{content}{}\n", perfmd::begin(b), perfmd::end(b));
        }
        doc = perfmd::replace(&doc, b, &content)?;
    }
    if !args.dry_run {
        std::fs::write(&perf_path, doc).with_context(|| format!("writing {}", perf_path.display()))?;
        eprintln!("bench: rewrote {} in {}", blocks.join(", "), perf_path.display());
    }
    let failed: Vec<String> = results.runs.values().filter(|r| !r.ok).map(|r| r.target.id()).collect();
    let overhead_failed = matches!(results.overhead, Some(Err(_)));
    if let Some(Err(e)) = &results.overhead {
        eprintln!("bench: the overhead benchmark failed: {e}");
    }
    if failed.is_empty() && !overhead_failed {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("bench: failed: {}", failed.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// Runs the overhead benchmark optimized: in this process if it is a release build (as `cargo
/// xtask bench` starts it), else in `cargo run --release -p cortex-bench`.
#[allow(clippy::print_stderr)]
fn run_overhead(root: &Path, args: &Args, out_dir: &Path) -> Result<serde_json::Value> {
    let json = out_dir.join("overhead.json");
    if cfg!(debug_assertions) {
        let o = args.overhead_options();
        let c: Vec<String> = o.concurrency.iter().map(ToString::to_string).collect();
        let mut cmd = Command::new(crate::cargo());
        cmd.args(["run", "--release", "-p", "cortex-bench", "--", "bench", "--overhead-json"])
            .arg(&json)
            .args([
                "--rounds",
                &o.rounds.to_string(),
                "--requests",
                &o.requests.to_string(),
                "--concurrency",
                &c.join(","),
            ])
            .current_dir(root);
        if !o.sglang {
            cmd.arg("--no-sglang");
        }
        eprintln!(
            "bench: overhead, optimized: cargo run --release -p cortex-bench -- bench --overhead-json {}",
            json.display()
        );
        let _ = std::fs::remove_file(&json);
        let status = cmd.status().context("running cargo run --release -p cortex-bench")?;
        if !status.success() {
            bail!("the optimized overhead run exited with {status}");
        }
    } else {
        let v = overhead::run(root, &args.overhead_options(), &out_dir.join("logs"))?;
        std::fs::write(&json, serde_json::to_string_pretty(&v)?)?;
    }
    let text = std::fs::read_to_string(&json).with_context(|| format!("reading {}", json.display()))?;
    Ok(serde_json::from_str(&text)?)
}
