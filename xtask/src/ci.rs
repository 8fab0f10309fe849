//! `cargo xtask ci`: the README's test command, exactly what `.ci/run` runs on a fresh machine,
//! and `cargo xtask ci --fresh`, which reproduces that fresh machine locally.
//!
//! Key decisions: one command, in Rust, that installs what it needs (cargo-deny) and fails on the
//! first red step, so that a developer's machine and CI cannot drift apart. On two cores the
//! compiles are the cost, so the workspace is compiled once: clippy's lints run inside the test
//! build (clippy-driver as the workspace's rustc wrapper, exactly what `cargo clippy` does in a
//! check build), and cargo-deny — built without optimization, since it runs for a second — builds
//! on the other core while the workspace's long serial stretches leave it idle. Every crate of
//! the lockfile, for every platform, is fetched first, because cargo-deny reads them offline.
//! The golden vectors are checked by a test of the test build, not by this binary, which is built
//! without the tokenizer stack (xtask's `golden` feature).

use crate::cargo;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::tidy;

/// cargo-deny version CI installs when it is missing.
const CARGO_DENY_VERSION: &str = "0.20.2";

/// The lints every workspace target is held to (what `cargo clippy -- -D warnings` passes).
const CLIPPY_ARGS: &[&str] = &["-D", "warnings"];

/// Wall time per step, printed at the end (the breakdown a slow CI run is read from).
#[derive(Default)]
struct Steps(Vec<(String, Duration)>);

impl Steps {
    #[allow(clippy::print_stdout)]
    fn time<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let out = f();
        let took = started.elapsed();
        println!("<== {name}: {}", secs(took));
        self.0.push((name.to_owned(), took));
        out
    }

    fn summary(&self) -> String {
        let total: Duration = self.0.iter().map(|(_, d)| *d).sum();
        let parts: Vec<String> = self.0.iter().map(|(n, d)| format!("{n} {}", secs(*d))).collect();
        format!("{} ({})", secs(total), parts.join(", "))
    }
}

fn secs(d: Duration) -> String {
    format!("{:.0}s", d.as_secs_f64())
}

#[allow(clippy::print_stdout)]
fn step(root: &Path, cmd: &mut Command) -> Result<()> {
    println!("==> {}", describe(cmd));
    let status = cmd.current_dir(root).status().with_context(|| format!("starting {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    format!("{} {}", cmd.get_program().to_string_lossy(), args.join(" "))
}

fn cargo_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(cargo());
    c.args(args);
    c
}

/// The toolchain's `bin` directory (where `clippy-driver` is), from the `rustc` cargo uses.
fn toolchain_bin() -> Result<PathBuf> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let out =
        Command::new(rustc).args(["--print", "sysroot"]).output().context("running rustc --print sysroot")?;
    if !out.status.success() {
        bail!("rustc --print sysroot failed");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("bin"))
}

/// A cargo command whose workspace crates are compiled by clippy-driver with [`CLIPPY_ARGS`]:
/// the lints of `cargo clippy`, in a build that also produces the test binaries.
fn linted(args: &[&str], clippy_driver: &Path) -> Command {
    let mut c = cargo_cmd(args);
    let clippy_args: String = CLIPPY_ARGS.iter().map(|a| format!("{a}__CLIPPY_HACKERY__")).collect();
    c.env("RUSTC_WORKSPACE_WRAPPER", clippy_driver).env("CLIPPY_ARGS", clippy_args);
    c
}

fn have_cargo_deny() -> bool {
    Command::new(cargo()).args(["deny", "--version"]).output().is_ok_and(|o| o.status.success())
}

/// Starts `cargo install cargo-deny` in the background (its output in `log`): unoptimized and
/// without debug info it builds in well under half the time of its release profile (fat LTO,
/// one codegen unit), and its check still takes about two seconds.
#[allow(clippy::print_stdout)]
fn start_cargo_deny_install(log: &Path) -> Result<Child> {
    println!("==> cargo install cargo-deny {CARGO_DENY_VERSION} (in the background, log {})", log.display());
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    cargo_cmd(&["install", "cargo-deny", "--locked", "--debug", "--version", CARGO_DENY_VERSION])
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting cargo install cargo-deny")
}

/// Runs every CI step in order.
///
/// # Errors
/// The first failing step.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn run(root: &Path) -> Result<ExitCode> {
    let mut steps = Steps::default();
    let result = run_steps(root, &mut steps);
    match &result {
        Ok(()) => println!("ci: all green in {}", steps.summary()),
        Err(e) => eprintln!("ci: failed after {}: {e:#}", steps.summary()),
    }
    result.map(|()| ExitCode::SUCCESS)
}

fn run_steps(root: &Path, steps: &mut Steps) -> Result<()> {
    steps.time("format", || step(root, &mut cargo_cmd(&["fmt", "--all", "--", "--check"])))?;
    // cargo-deny reads every crate of the lockfile, for every target platform, offline.
    steps.time("fetch", || step(root, &mut cargo_cmd(&["fetch", "--locked"])))?;
    let log = crate::target_dir(root).join("ci").join("cargo-deny-install.log");
    let mut deny_install = if have_cargo_deny() { None } else { Some(start_cargo_deny_install(&log)?) };

    let driver = toolchain_bin()?.join("clippy-driver");
    if !driver.exists() {
        bail!("{} is missing: the toolchain file lists the clippy component", driver.display());
    }
    // Every target `cargo clippy --workspace --all-targets` lints, compiled once for the tests.
    steps.time("clippy + test build", || {
        step(root, &mut linted(&["test", "--workspace", "--all-targets", "--locked", "--no-run"], &driver))
    })?;
    // Among the tests: xtask's `tidy_passes` and `every_golden_vector_reproduces`, the checks of
    // `cargo xtask tidy` and `cargo xtask golden --check` (the golden ones need the tokenizer,
    // which only the test build compiles; see xtask's `golden` feature).
    steps.time("tests", || step(root, &mut linted(&["test", "--workspace", "--locked"], &driver)))?;
    // The workspace build turns cortex-hash's `text` feature on; routers that embed only the
    // hash recipes build it without, so that must keep compiling (and linting) on its own.
    steps.time("cortex-hash without features", || {
        step(
            root,
            &mut cargo_cmd(&[
                "clippy",
                "-p",
                "cortex-hash",
                "--lib",
                "--no-default-features",
                "--locked",
                "--",
                "-D",
                "warnings",
            ]),
        )
    })?;
    // The simulator's PD workers against the engines' own proxies, with the test build's binary.
    steps.time("pd-check", || {
        let sim = crate::target_dir(root).join("debug").join("cortex-sim");
        let args = crate::pd_check::Args { python: "python3".to_owned(), engine: None, sim: Some(sim) };
        crate::pd_check::run(root, &args)
    })?;
    // Real clients: the official openai SDK and requests against the test build's demo gateway.
    steps.time("sdk-check", || {
        let gateway = crate::target_dir(root).join("debug").join("cortex-gateway");
        let args = crate::sdk_check::Args { python: "python3".to_owned(), gateway: Some(gateway) };
        crate::sdk_check::run(root, &args)
    })?;
    // The deployment files: rendered, validated offline, checked against the gateway's own
    // verdict on their configuration (the test build's gateway) and against the Dockerfile.
    steps.time("deploy-check", || {
        let gateway = crate::target_dir(root).join("debug").join("cortex-gateway");
        let args = crate::deploy_check::Args { python: "python3".to_owned(), gateway: Some(gateway) };
        crate::deploy_check::run(root, &args)
    })?;
    // The dashboard and the alert rules, against a real Prometheus scraping the test build's
    // demo gateway.
    steps.time("obs-check", || {
        let gateway = crate::target_dir(root).join("debug").join("cortex-gateway");
        crate::obs_check::run(root, &crate::obs_check::Args { gateway: Some(gateway) })
    })?;
    steps.time("tidy", || check_tidy(root))?;

    steps.time("cargo-deny", || {
        if let Some(child) = deny_install.as_mut() {
            let status = child.wait().context("waiting for cargo install cargo-deny")?;
            if !status.success() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                bail!("cargo install cargo-deny failed ({status}):\n{text}");
            }
        }
        // Advisories need the RustSec database from GitHub, which this machine kind cannot reach.
        step(root, &mut cargo_cmd(&["deny", "--offline", "check", "licenses", "bans", "sources"]))
    })
}

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn check_tidy(root: &Path) -> Result<()> {
    println!("==> tidy");
    let violations = tidy::run(root)?;
    for v in &violations {
        eprintln!("tidy: {v}");
    }
    if !violations.is_empty() {
        bail!("tidy: {} violation(s)", violations.len());
    }
    Ok(())
}

/// Environment that would make a child cargo share this machine's state instead of the fresh
/// one's: target directories, compiler wrappers and flags, and what `cargo run` sets for xtask.
const INHERITED: &[&str] = &[
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_HOME",
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "RUSTDOCFLAGS",
    "CARGO",
    "CARGO_MANIFEST_DIR",
    "CARGO_PKG_NAME",
];

/// `cargo xtask ci --fresh`: `.ci/run` as a fresh machine runs it — on a clone of the committed
/// `HEAD` in `dir`, with an empty cargo home (no registry, no installed tools, hence no
/// cargo-deny) and an empty target directory, the toolchain's own `bin` first on the `PATH`
/// instead of `~/.cargo/bin`. Uncommitted changes are not in the clone: only commits land.
///
/// # Errors
/// Cloning fails, or `.ci/run` fails in the clone.
#[allow(clippy::print_stdout)]
pub fn fresh(root: &Path, dir: &Path) -> Result<ExitCode> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let repo = dir.join("repo");
    let home = dir.join("cargo-home");
    std::fs::create_dir_all(&home)?;
    let status = Command::new("git")
        .args(["clone", "--quiet", "--no-hardlinks"])
        .arg(root)
        .arg(&repo)
        .status()
        .context("running git clone")?;
    if !status.success() {
        bail!("git clone of {} failed", root.display());
    }
    let bin = toolchain_bin()?;
    let cargo_bin = home_cargo_bin();
    let path: Vec<PathBuf> = std::iter::once(home.join("bin"))
        .chain(std::iter::once(bin))
        .chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .filter(|p| Some(p) != cargo_bin.as_ref()),
        )
        .collect();
    let mut cmd = Command::new("bash");
    cmd.arg(".ci/run").current_dir(&repo);
    for var in INHERITED {
        cmd.env_remove(var);
    }
    cmd.env("CARGO_HOME", &home).env("PATH", std::env::join_paths(path)?);
    println!("==> fresh clone in {}: bash .ci/run (CARGO_HOME={})", repo.display(), home.display());
    let started = Instant::now();
    let status = cmd.status().context("running .ci/run in the clone")?;
    println!(
        "fresh: .ci/run {} in {}",
        if status.success() { "passed" } else { "FAILED" },
        secs(started.elapsed())
    );
    Ok(if status.success() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `~/.cargo/bin`, where rustup's proxies and `cargo install`ed tools live.
fn home_cargo_bin() -> Option<PathBuf> {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|h| h.join("bin"))
}
