//! Cortex's automation, as a library so that its checks also run as ordinary tests.
//!
//! Key decision: every bit of automation is Rust in this crate (no shell scripts, no Makefile);
//! `cargo xtask <command>` is the interface, and `cargo xtask ci` is the one command CI runs.

pub mod bench;
pub mod ci;
pub mod golden;
pub mod radix;
pub mod replay;
pub mod tidy;

use std::path::PathBuf;

/// The workspace root (the parent of this crate's directory).
#[must_use]
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map_or(here.clone(), std::path::Path::to_path_buf)
}
