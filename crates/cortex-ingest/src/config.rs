//! What the ingest runtime is told: per holder where its engine publishes and how to read it, and
//! the runtime's own knobs.
//!
//! Key decision: plain typed values (durations as `Duration`, enums instead of flags); the
//! gateway's configuration file and worker discovery produce them, this crate never parses text.

use std::time::Duration;

use cortex_hash::kv::HolderId;

/// Which engine's wire format a holder publishes (the decoder to use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// vLLM, any release from 0.9 to 0.33.
    Vllm,
    /// SGLang 0.5.x.
    Sglang,
}

/// How to read a store that does not say whether the request was plain (vLLM: no `extra_keys`
/// before 0.17; SGLang: no `lora_name`, which unregistered LoRA adapters and extra keys do not
/// publish).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unlabeled {
    /// As a plain base-model store: this worker gets no such traffic.
    Plain,
    /// As unknown: never counted.
    Unknown,
}

/// One holder's event source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderSource {
    /// The (worker, DP rank) whose cache these events describe.
    pub holder: HolderId,
    /// The engine's wire format.
    pub wire: Wire,
    /// Served model name (part of every block's namespace).
    pub model: String,
    /// How to read unlabeled stores.
    pub unlabeled: Unlabeled,
    /// The PUB endpoint, `tcp://host:port` (already offset by the rank).
    pub publish: String,
    /// The replay ROUTER endpoint, if the engine has one (already offset by the rank).
    pub replay: Option<String>,
    /// The topic to subscribe to (`""` for everything).
    pub topic: String,
    /// The engine's KV capacity in blocks (bounds the ledger's memory for this holder).
    pub capacity_blocks: u32,
    /// Whether equal content gives equal engine hashes across workers (SGLang; vLLM ≥ 0.29 with
    /// the default seed): lets the ledger graft orphans from other holders.
    pub content_deterministic: bool,
}

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
    /// Writer lanes (threads that decode and apply); holders are sharded across them and a
    /// holder's batches stay in order.
    pub lanes: usize,
    /// How long a replay may take before the holder is rebuilt cold.
    pub replay_timeout: Duration,
    /// How long a holder may publish nothing while its engine reports running requests before
    /// it is suspected STALE.
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
