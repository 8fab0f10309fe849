//! `cargo xtask`: the command-line face of Cortex's automation (see `cargo xtask --help`).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use xtask::{ci, radix, tidy, workspace_root};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Cortex's automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Everything CI runs: fmt check, clippy (warnings denied), all tests, tidy, golden --check,
    /// cargo-deny (installed if missing), pd-check, sdk-check, deploy-check and obs-check, with
    /// the time of each step.
    Ci {
        /// Run `.ci/run` as a fresh machine does instead: on a clone of the committed HEAD under
        /// `target/fresh-ci` (or `--dir`), with an empty cargo home and an empty target directory.
        #[arg(long)]
        fresh: bool,
        /// Where `--fresh` clones (removed first).
        #[arg(long, requires = "fresh")]
        dir: Option<std::path::PathBuf>,
    },
    /// Workspace rules: `//!` docs, dependency direction, manifests.
    Tidy,
    /// Check every golden vector, or rewrite the derived expectations.
    Golden {
        /// Verify every vector (the default).
        #[arg(long, conflicts_with = "bless")]
        check: bool,
        /// Rewrite derived expectation files under golden/expect/ (never the captures).
        #[arg(long)]
        bless: bool,
    },
    /// The ledger's loom models and their negative controls (own target dir, time-capped).
    Loom {
        /// Time cap per run, in seconds.
        #[arg(long, default_value_t = 900)]
        cap_secs: u64,
    },
    /// The ledger soak in release: 10^7 events with churn, memory within budget, no growth.
    Soak {
        /// Events to apply.
        #[arg(long, default_value_t = 10_000_000)]
        ops: u64,
        /// Byte budget in MiB.
        #[arg(long, default_value_t = 64)]
        budget_mib: u64,
        /// Instead, the head-only retention soak (`crates/cortex-radix/examples/retention.rs`):
        /// one request stream applied with insertion-order and with last-use eviction, bytes per
        /// (holder, block) compared (it has no budget to set).
        #[arg(long, conflicts_with = "budget_mib")]
        head_retention: bool,
    },
    /// The ledger against dynamo-kv-router 1.6.1 (separate workspace peers/radix-bench).
    BenchPeers {
        /// Interleaved rounds per configuration.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Configurations, `holders x blocks` each.
        #[arg(long, default_value = "8x10000,64x10000,8x100000,64x100000")]
        configs: String,
    },
    /// Every benchmark of the workspace (criterion, ingest, gateway overhead), then rewrite the
    /// generated tables of docs/perf.md: `cargo run --release -p cortex-bench -- bench ARGS`
    /// (`--help` for its flags).
    #[command(disable_help_flag = true)]
    Bench {
        /// Passed to `cortex-bench bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Replay a request trace open loop through each routing policy onto a simulated cluster
    /// (cache hits against the infinite-cache bound, simulated TTFT, load imbalance, failures):
    /// `cargo run --release -p cortex-bench -- replay ARGS` (`--help` for its flags).
    #[command(disable_help_flag = true)]
    Replay {
        /// Passed to `cortex-bench replay`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The gateway soak: 10^6 requests through the release binary onto simulated workers in
    /// their own processes, with prefix churn, event gaps, publisher restarts and a worker
    /// kill -9 per minute; RSS flat, ledger within budget, no unexplained failure, every ledger
    /// READY at the end: `cargo run --release -p cortex-bench -- soak-gateway ARGS` (`--help`).
    #[command(disable_help_flag = true)]
    SoakGateway {
        /// Passed to `cortex-bench soak-gateway`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The simulator's PD workers through vLLM's toy proxy and SGLang's mini_lb (needs python3).
    PdCheck(xtask::pd_check::Args),
    /// The deployment files: kustomizations rendered, objects validated offline, the Dockerfile.
    DeployCheck(xtask::deploy_check::Args),
    /// The official openai SDK and requests against the demo gateway (needs python3).
    SdkCheck(xtask::sdk_check::Args),
    /// The Grafana dashboard and the alert rules against a real Prometheus scraping the demo.
    ObsCheck(xtask::obs_check::Args),
    /// Long differential and fuzz runs, every target by default (`--target` for one, `--list`),
    /// `--minutes` per target.
    Fuzz(xtask::fuzz::Args),
}

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Cmd::Ci { fresh: false, .. } => ci::run(&root),
        Cmd::Ci { fresh: true, dir } => {
            ci::fresh(&root, &dir.unwrap_or_else(|| root.join("target").join("fresh-ci")))
        }
        Cmd::Loom { cap_secs } => radix::loom(&root, std::time::Duration::from_secs(cap_secs)),
        Cmd::Soak { ops, head_retention: true, .. } => {
            radix::retention_soak(&root, ops, std::time::Duration::from_secs(3600))
        }
        Cmd::Soak { ops, budget_mib, head_retention: false } => {
            radix::soak(&root, ops, budget_mib, std::time::Duration::from_secs(3600))
        }
        Cmd::BenchPeers { rounds, configs } => {
            radix::bench_peers(&root, rounds, &configs, std::time::Duration::from_secs(3600))
        }
        Cmd::Bench { args } => xtask::bench_driver(&root, "bench", &args),
        Cmd::Replay { args } => xtask::bench_driver(&root, "replay", &args),
        Cmd::SoakGateway { args } => xtask::bench_driver(&root, "soak-gateway", &args),
        Cmd::PdCheck(args) => xtask::pd_check::run(&root, &args).map(|()| ExitCode::SUCCESS),
        Cmd::DeployCheck(args) => xtask::deploy_check::run(&root, &args).map(|()| ExitCode::SUCCESS),
        Cmd::SdkCheck(args) => xtask::sdk_check::run(&root, &args).map(|()| ExitCode::SUCCESS),
        Cmd::ObsCheck(args) => xtask::obs_check::run(&root, &args).map(|()| ExitCode::SUCCESS),
        Cmd::Fuzz(args) => xtask::fuzz::run(&root, &args),
        Cmd::Tidy => {
            let violations = tidy::run(&root)?;
            for v in &violations {
                eprintln!("tidy: {v}");
            }
            if violations.is_empty() {
                println!("tidy: ok");
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!("tidy: {} violation(s)", violations.len());
                Ok(ExitCode::FAILURE)
            }
        }
        Cmd::Golden { bless, .. } => golden(&root, bless),
    }
}

/// `cargo xtask golden`: the checks themselves, when built with the `golden` feature.
#[cfg(feature = "golden")]
#[allow(clippy::print_stdout)]
fn golden(root: &std::path::Path, bless: bool) -> Result<ExitCode> {
    use xtask::golden;
    if bless {
        for path in golden::bless(&root.join("golden"))? {
            println!("blessed {}", path.display());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let report = golden::check(&root.join("golden"))?;
    println!("{report}");
    Ok(if report.failures().next().is_none() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `cargo xtask golden` without the `golden` feature (how `cargo xtask` builds): xtask again,
/// with the feature (see `xtask/Cargo.toml`).
#[cfg(not(feature = "golden"))]
fn golden(root: &std::path::Path, bless: bool) -> Result<ExitCode> {
    use anyhow::Context;
    let status = std::process::Command::new(xtask::cargo())
        .args(["run", "--quiet", "-p", "xtask", "--features", "golden", "--", "golden"])
        .arg(if bless { "--bless" } else { "--check" })
        .current_dir(root)
        .status()
        .context("running cargo run -p xtask --features golden")?;
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
