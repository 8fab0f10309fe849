//! `cargo xtask`: the command-line face of Cortex's automation (see `cargo xtask --help`).

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use xtask::{ci, golden, tidy, workspace_root};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Cortex's automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Everything CI runs: fmt check, clippy (warnings denied), all tests, tidy, golden --check
    /// and cargo-deny (installed if missing).
    Ci,
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
}

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Cmd::Ci => ci::run(&root),
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
        Cmd::Golden { bless: true, .. } => {
            for path in golden::bless(&root.join("golden"))? {
                println!("blessed {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Golden { .. } => {
            let report = golden::check(&root.join("golden"))?;
            println!("{report}");
            Ok(if report.failures().next().is_none() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
    }
}
