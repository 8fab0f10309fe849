//! `cargo xtask ci`: the README's test command, exactly what `.ci/run` runs on a fresh machine.
//!
//! Key decision: one command, in Rust, that installs what it needs (cargo-deny) and fails on the
//! first red step, so that a developer's machine and CI cannot drift apart.

use crate::cargo;
use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

use crate::{golden, tidy};

/// cargo-deny version CI installs when it is missing.
const CARGO_DENY_VERSION: &str = "0.20.2";

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn step(name: &str, root: &Path, program: &str, args: &[&str]) -> Result<()> {
    println!("==> {name}: {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("starting {program}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

fn have_cargo_deny() -> bool {
    Command::new(cargo()).args(["deny", "--version"]).output().is_ok_and(|o| o.status.success())
}

/// Runs every CI step in order.
///
/// # Errors
/// The first failing step.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn run(root: &Path) -> Result<ExitCode> {
    let cargo = cargo();
    step("format", root, &cargo, &["fmt", "--all", "--", "--check"])?;
    step(
        "clippy",
        root,
        &cargo,
        &["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"],
    )?;
    step("tests", root, &cargo, &["test", "--workspace", "--locked"])?;
    // The workspace build turns cortex-hash's `text` feature on; routers that embed only the
    // hash recipes build it without, so that must keep compiling (and linting) on its own.
    step(
        "cortex-hash without features",
        root,
        &cargo,
        &[
            "clippy",
            "-p",
            "cortex-hash",
            "--lib",
            "--no-default-features",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
    )?;

    println!("==> tidy");
    let violations = tidy::run(root)?;
    for v in &violations {
        eprintln!("tidy: {v}");
    }
    if !violations.is_empty() {
        bail!("tidy: {} violation(s)", violations.len());
    }

    println!("==> golden --check");
    let report = golden::check(&root.join("golden"))?;
    println!("{report}");
    if report.failures().next().is_some() {
        bail!("golden vectors failed");
    }

    if !have_cargo_deny() {
        step(
            "install cargo-deny",
            root,
            &cargo,
            &["install", "cargo-deny", "--locked", "--version", CARGO_DENY_VERSION],
        )?;
    }
    // Advisories need the RustSec database from GitHub, which this machine kind cannot reach.
    step("cargo-deny", root, &cargo, &["deny", "--offline", "check", "licenses", "bans", "sources"])?;
    println!("ci: all green");
    Ok(ExitCode::SUCCESS)
}
