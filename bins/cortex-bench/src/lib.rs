//! Cortex's benchmark drivers, the code that runs the product to measure it: [`bench`] (every
//! benchmark of the workspace, then the generated tables of `docs/perf.md`), [`replay`]
//! (routing quality on request traces, through Cortex's policies and SGLang's router, onto
//! simulated clusters) and [`soak`] (the gateway binary under 10^6 requests and faults).
//!
//! Key decision: a crate of its own, not part of `xtask`, so that automation which only reads the
//! workspace (`cargo xtask tidy`, `golden`, `ci`) never compiles the gateway, and the drivers
//! run optimized: `cargo xtask bench`, `replay` and `soak-gateway` are `cargo run --release -p
//! cortex-bench -- bench|replay|soak-gateway …`, and a replay measures the gateway and simulators as they
//! ship, not at opt-level 0.

#![forbid(unsafe_code)]

pub mod bench;
pub mod replay;
pub mod soak;

use std::path::PathBuf;

pub use xtask::{cargo, cargo_metadata, target_dir};

/// The workspace root (two levels above this crate's directory, `bins/cortex-bench`).
#[must_use]
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().nth(2).map_or(here.clone(), std::path::Path::to_path_buf)
}
