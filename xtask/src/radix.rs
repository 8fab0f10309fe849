//! The ledger's (`cortex-radix`) heavy checks: `cargo xtask loom`, `cargo xtask soak` and
//! `cargo xtask bench-peers`. None runs in `cargo xtask ci`: loom rebuilds the dependency graph
//! with `--cfg loom`, the soak takes minutes, and the peer build takes about seven.
//!
//! Key decision: loom runs in its own target directory (`target/loom`) so that its cfg flags
//! never invalidate the normal build, and every run has a time cap. The negative controls are
//! the same models built with one deliberate bug each (`CORTEX_LOOM_BUG`, which the crate's
//! build script turns into a cfg for that crate alone); the models are then `#[should_panic]`,
//! so each run must come out green.

use crate::cargo;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The deliberate bugs of the loom negative controls, each caught by one model (in
/// `crates/cortex-radix/src/table.rs`, `run.rs` and `slots.rs`).
pub const LOOM_BUGS: &[(&str, &str)] = &[
    ("publish_key_first", "publish_key_with_bits"),
    ("reuse_dead", "dead_slot_is_never_reused_by_another_key"),
    ("free_now", "rebuild_reclaims_only_after_readers_leave"),
    ("id_after_active", "holder_is_published_with_its_id"),
    ("run_hashes_late", "run_is_published_with_its_hashes"),
    ("free_run_now", "run_is_freed_only_after_readers_leave"),
    ("reclaim_unlocked", "a_found_run_is_never_reclaimed"),
    ("len_before_hashes", "append_is_published_with_its_hashes"),
];

/// Runs `cmd` to completion or kills it after `cap`.
#[allow(clippy::print_stdout)]
fn run_capped(mut cmd: Command, cap: Duration, what: &str) -> Result<bool> {
    println!("==> {what}");
    let mut child = cmd.stdin(Stdio::null()).spawn().with_context(|| format!("starting {what}"))?;
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status.success());
        }
        if start.elapsed() > cap {
            child.kill().ok();
            child.wait().ok();
            bail!("{what}: still running after {cap:?}, killed");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn loom_command(root: &Path, bug: Option<&str>) -> Command {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root)
        .args(["test", "-p", "cortex-radix", "--lib", "--release", "loom_models"])
        .env("RUSTFLAGS", "--cfg loom --cfg crossbeam_loom")
        .env("CARGO_TARGET_DIR", root.join("target").join("loom"))
        .env("CORTEX_LOOM_BUG", bug.unwrap_or(""));
    cmd
}

/// `cargo xtask loom`: the loom models as written, then once per deliberate bug (the model the
/// bug targets must fail, which it then declares with `should_panic`).
///
/// # Errors
/// A run that fails or exceeds `cap`.
#[allow(clippy::print_stdout)]
pub fn loom(root: &Path, cap: Duration) -> Result<ExitCode> {
    let mut failed = Vec::new();
    if !run_capped(loom_command(root, None), cap, "loom models")? {
        failed.push("loom models".to_owned());
    }
    for (bug, model) in LOOM_BUGS {
        let what = format!("loom negative control: {bug} must break {model}");
        if !run_capped(loom_command(root, Some(bug)), cap, &what)? {
            failed.push(what);
        }
    }
    if failed.is_empty() {
        println!("loom: all models hold, and every negative control is caught");
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &failed {
            println!("loom: FAILED {f}");
        }
        Ok(ExitCode::FAILURE)
    }
}

/// `cargo xtask soak`: the ledger soak in release (`crates/cortex-radix/examples/soak.rs`).
///
/// # Errors
/// If cargo cannot be started or the run exceeds `cap`.
pub fn soak(root: &Path, ops: u64, budget_mib: u64, cap: Duration) -> Result<ExitCode> {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root).args(["run", "--release", "-p", "cortex-radix", "--example", "soak", "--"]).args([
        "--ops".to_owned(),
        ops.to_string(),
        "--budget-mib".to_owned(),
        budget_mib.to_string(),
    ]);
    Ok(if run_capped(cmd, cap, "ledger soak")? { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `cargo xtask soak --head-retention`: the head-only retention soak in release
/// (`crates/cortex-radix/examples/retention.rs`), `ops` events per phase.
///
/// # Errors
/// If cargo cannot be started or the run exceeds `cap`.
pub fn retention_soak(root: &Path, ops: u64, cap: Duration) -> Result<ExitCode> {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root)
        .args(["run", "--release", "-p", "cortex-radix", "--example", "retention", "--"])
        .args(["--ops".to_owned(), ops.to_string()]);
    Ok(if run_capped(cmd, cap, "head-only retention soak")? { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `cargo xtask bench-peers`: builds the separate `peers/radix-bench` workspace in release (its
/// own lockfile and target directory) and runs the interleaved comparison with Dynamo.
///
/// # Errors
/// If the build or the run fails to start, or exceeds `cap`.
pub fn bench_peers(root: &Path, rounds: u32, configs: &str, cap: Duration) -> Result<ExitCode> {
    let manifest = root.join("peers").join("radix-bench").join("Cargo.toml");
    let mut build = Command::new(cargo());
    build.current_dir(root).arg("build").arg("--release").arg("--manifest-path").arg(&manifest);
    if !run_capped(build, cap, "build peers/radix-bench (release; dynamo-kv-router takes ~7 min)")? {
        bail!("peers/radix-bench did not build");
    }
    let bin = root.join("peers").join("radix-bench").join("target").join("release").join("radix-bench");
    let mut run = Command::new(bin);
    run.args(["--rounds", &rounds.to_string(), "--configs", configs]);
    Ok(if run_capped(run, cap, "peer comparison")? { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bug the ledger's build script declares has a negative-control run, and every run
    /// names a model that exists and declares that bug.
    #[test]
    fn every_loom_bug_has_a_negative_control() {
        let crate_dir = crate::workspace_root().join("crates").join("cortex-radix");
        let build = std::fs::read_to_string(crate_dir.join("build.rs")).expect("build.rs");
        let table = ["table.rs", "run.rs", "slots.rs"]
            .iter()
            .map(|f| std::fs::read_to_string(crate_dir.join("src").join(f)).expect("model source"))
            .collect::<Vec<_>>()
            .join("\n");
        let declared =
            build.split("cortex_loom_bug, values(").nth(1).and_then(|s| s.split(')').next()).expect("values");
        let declared: Vec<&str> =
            declared.split(',').map(|v| v.trim().trim_matches(|c| c == '\\' || c == '"')).collect();
        assert_eq!(declared.len(), LOOM_BUGS.len(), "{declared:?}");
        for (bug, model) in LOOM_BUGS {
            assert!(declared.contains(bug), "{bug} not declared in build.rs");
            let marker = format!("cortex_loom_bug = \"{bug}\", should_panic(expected");
            let at =
                table.find(&marker).unwrap_or_else(|| panic!("no should_panic negative control for {bug}"));
            let after = &table[at..];
            assert!(
                after.find(&format!("fn {model}()")).is_some_and(|i| !after[..i].contains("fn ")),
                "the {bug} control is not on {model}"
            );
        }
    }
}
