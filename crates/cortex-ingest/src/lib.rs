//! `cortex-ingest`: the event plane's runtime, and the one place on the event path that knows
//! ZeroMQ.
//!
//! For every holder — a (worker, data-parallel rank) — it subscribes to the engine's KV-event
//! PUB socket (`tcp://host:port_base + rank`), checks the sequence number of every batch
//! ([`seq`]: duplicates dropped, gaps replayed through the engine's ROUTER socket or rebuilt,
//! restarts cleared), decodes the payload with the engine's decoder (`cortex-events-vllm`,
//! `cortex-events-sglang`) and applies it through the holder's ledger writer (`cortex-radix`). A
//! holder takes part in exact routing only while it is READY.
//!
//! ```no_run
//! use std::time::Duration;
//! use cortex_hash::kv::{DpRank, HolderId, WorkerId};
//! use cortex_ingest::{HolderSource, Ingest, IngestConfig, Unlabeled, Wire};
//! use cortex_radix::{Ledger, LedgerConfig};
//!
//! let ledger = Ledger::new(LedgerConfig::default());
//! let ingest = Ingest::start(ledger.clone(), IngestConfig::default())?;
//! let holder = HolderId::new(WorkerId(1), DpRank(0));
//! ingest.add_holder(HolderSource {
//!     holder,
//!     wire: Wire::Sglang,
//!     model: "Qwen/Qwen3-8B".into(),
//!     unlabeled: Unlabeled::Plain,
//!     publish: "tcp://10.0.0.7:5557".into(),
//!     replay: Some("tcp://10.0.0.7:5600".into()),
//!     topic: String::new(),
//!     capacity_blocks: 100_000,
//!     content_deterministic: true,
//! })?;
//! ingest.wait_for(holder, Duration::from_secs(5), |s| s.state == cortex_ingest::HolderState::Ready);
//! # Ok::<(), cortex_ingest::IngestError>(())
//! ```
//!
//! Key decision: correctness over hits. Anything that could make the ledger report a block the
//! engine no longer has (a lost batch, a restart, an undecodable payload) clears the holder;
//! anything merely suspicious (a disconnect, silence) takes it out of exact routing until events
//! prove it in sync again. The table of transitions is in [`seq`] and in ARCHITECTURE.md.

#![forbid(unsafe_code)]

pub mod config;
pub mod runtime;
pub mod seq;
pub mod stats;

#[cfg(test)]
#[path = "../tests/support/mod.rs"]
mod test_support;

pub use config::{HolderSource, IngestConfig, StaleRouting, Unlabeled, Wire};
pub use runtime::{Ingest, IngestError};
pub use seq::{HolderState, Reason};
pub use stats::{DECODE_ERROR_KINDS, HolderStatus};
