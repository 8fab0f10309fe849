//! Cortex's automation, as a library so that its checks also run as ordinary tests.
//!
//! Key decision: every bit of automation is Rust in this crate (no shell scripts, no Makefile);
//! `cargo xtask <command>` is the interface, and `cargo xtask ci` is the one command CI runs.

pub mod bench;
pub mod ci;
pub mod fuzz;
pub mod golden;
pub mod radix;
pub mod replay;
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

/// The workspace root (the parent of this crate's directory).
#[must_use]
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map_or(here.clone(), std::path::Path::to_path_buf)
}
