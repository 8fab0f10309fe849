//! What the ingest runtime is told: per holder where its engine publishes and how to read it
//! ([`HolderSource`], the type the gateway builds at discovery), and the runtime's own knobs.
//!
//! Key decision: plain typed values (durations as `Duration`, enums instead of flags); the
//! gateway's configuration file and worker discovery produce them, this crate never parses text.

use std::time::Duration;

/// A holder's event source, its wire format and its unlabeled-store policy: the vocabulary the
/// gateway hands over as it is (defined with the other event-plane types in `cortex_hash::kv`).
pub use cortex_hash::kv::{HolderSource, Unlabeled, Wire};

/// Whether a STALE holder keeps exact routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StaleRouting {
    /// A STALE holder is not counted by exact routing (the default: suspicion costs hits, never
    /// misroutes).
    Excluded,
    /// A STALE holder stays counted until its state is proven wrong (a gap or a restart).
    Included,
}

/// The runtime's knobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// Writer lanes (threads that apply batches, which the socket thread decoded); holders are
    /// sharded across them and a holder's batches stay in order.
    pub lanes: usize,
    /// How long a replay may take before the holder is rebuilt cold.
    pub replay_timeout: Duration,
    /// How long a holder may publish nothing after a request that stores new blocks (see
    /// [`crate::Ingest::report_running`]) before it is suspected STALE.
    pub silence_timeout: Duration,
    /// Whether STALE holders keep exact routing.
    pub stale_routing: StaleRouting,
    /// Receive high-water mark of each SUB socket, in messages (engines publish with 100,000).
    pub receive_hwm: i32,
    /// Live batches held per holder while a replay runs; beyond it the replay is abandoned.
    pub max_buffered: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            lanes: 2,
            replay_timeout: Duration::from_secs(2),
            silence_timeout: Duration::from_secs(30),
            stale_routing: StaleRouting::Excluded,
            receive_hwm: 1_000_000,
            max_buffered: 100_000,
        }
    }
}
