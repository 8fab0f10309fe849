//! `cortex-bench`: the command line of Cortex's benchmark drivers. Users type `cargo xtask bench`
//! `cargo xtask replay` and `cargo xtask soak-gateway`, which build and run this binary in release.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cortex_bench::{bench, replay, soak, workspace_root};

#[derive(Parser)]
#[command(
    name = "cortex-bench",
    about = "Cortex's benchmark drivers (run by `cargo xtask bench|replay|soak-gateway`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every benchmark of the workspace (criterion, ingest, gateway overhead), then rewrite the
    /// generated tables of docs/perf.md.
    Bench(bench::Args),
    /// Replay a request trace open loop through each routing policy onto a simulated cluster:
    /// cache hits against the infinite-cache bound, simulated TTFT, load imbalance, failures.
    Replay(Box<replay::Args>),
    /// 10^6 requests through the release gateway binary onto simulated workers in their own
    /// processes, with prefix churn, event gaps, publisher restarts and a worker kill per
    /// minute: RSS flat, ledger within budget, no unexplained failure, every ledger READY.
    SoakGateway(soak::Args),
    /// One Cortex gateway replica of `--replicas` runs (started by `replay`).
    #[command(hide = true)]
    Gateway {
        /// The gateway's configuration.
        #[arg(long)]
        config: std::path::PathBuf,
    },
}

fn main() -> Result<ExitCode> {
    let root = workspace_root();
    match Cli::parse().command {
        Cmd::Bench(args) => bench::run(&root, &args),
        Cmd::Replay(args) => replay::cli(&root, &args),
        Cmd::SoakGateway(args) => soak::cli(&root, &args),
        Cmd::Gateway { config } => replay::replicas::serve(&root, &config),
    }
}
