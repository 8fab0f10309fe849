//! Cortex's automation, as a library so that its checks also run as ordinary tests.
//!
//! Key decision: every bit of automation is Rust in this crate (no shell scripts, no Makefile);
//! `cargo xtask <command>` is the interface, and `cargo xtask ci` is the one command CI runs.

#![forbid(unsafe_code)]

pub mod ci;
pub mod deploy_check;
pub mod fuzz;
#[cfg(feature = "golden")]
pub mod golden;
pub mod net;
pub mod obs_check;
pub mod pd_check;
pub mod radix;
pub mod sdk_check;
pub mod tidy;

use std::path::PathBuf;

/// The cargo that runs this xtask (`$CARGO`), or `cargo`.
#[must_use]
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// `cargo metadata --no-deps` of the workspace at `root`, parsed.
///
/// # Errors
/// `cargo metadata` cannot run or fails.
pub fn cargo_metadata(root: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let out = std::process::Command::new(cargo())
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        anyhow::bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing cargo metadata")
}

/// The target directory cargo builds into for the workspace at `root` (`$CARGO_TARGET_DIR` or
/// `root/target`).
#[must_use]
pub fn target_dir(root: &std::path::Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// The workspace root (the parent of this crate's directory).
#[must_use]
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map_or(here.clone(), std::path::Path::to_path_buf)
}

/// Runs `cmd` (named `what` in errors) and returns its standard output.
///
/// # Errors
/// It cannot start, or it fails: the message has its status and both outputs.
pub fn command_output(cmd: &mut std::process::Command, what: &str) -> anyhow::Result<String> {
    use anyhow::{Context, ensure};
    let out = cmd.output().with_context(|| format!("{what}: cannot run"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Creates (once) a Python venv in `dir` with `requirements` (pinned), and returns its Python
/// and how long creating it took (`None` when a venv with exactly these requirements is there:
/// a marker file in it names them). Used by the checks that run engines' or schemas' Python.
///
/// # Errors
/// The venv cannot be created or pip fails (its output in the message).
pub fn python_venv(
    python: &str,
    dir: &std::path::Path,
    requirements: &[&str],
) -> anyhow::Result<(PathBuf, Option<std::time::Duration>)> {
    use anyhow::Context;
    use std::process::Command;
    let py = dir.join("bin").join("python");
    let marker = dir.join("cortex-requirements.txt");
    let wanted = requirements.join("\n");
    if py.exists() && std::fs::read_to_string(&marker).is_ok_and(|m| m == wanted) {
        return Ok((py, None));
    }
    let start = std::time::Instant::now();
    command_output(
        Command::new(python).args(["-m", "venv", "--clear"]).arg(dir),
        &format!("`{python} -m venv`"),
    )?;
    command_output(
        Command::new(&py)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(requirements),
        &format!("pip install {}", requirements.join(" ")),
    )?;
    std::fs::write(&marker, wanted).context("writing the venv marker")?;
    Ok((py, Some(start.elapsed())))
}

/// Runs `cortex-bench <command> <args>` built in release (`cargo run --release -p cortex-bench`):
/// the benchmark drivers run the gateway and the simulators, which must be measured optimized,
/// and keeping them out of this crate keeps `cargo xtask tidy` from compiling the product.
///
/// # Errors
/// cargo cannot be started; the driver's own failure is its exit code.
pub fn bench_driver(
    root: &std::path::Path,
    command: &str,
    args: &[String],
) -> anyhow::Result<std::process::ExitCode> {
    use anyhow::Context;
    let status = std::process::Command::new(cargo())
        .args(["run", "--release", "--quiet", "-p", "cortex-bench", "--", command])
        .args(args)
        .current_dir(root)
        .status()
        .context("running cargo run --release -p cortex-bench")?;
    Ok(match status.code() {
        Some(0) => std::process::ExitCode::SUCCESS,
        Some(c) => std::process::ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => std::process::ExitCode::FAILURE,
    })
}
