//! `cortex-sim`: a hermetic simulator of vLLM and SGLang workers that speaks their real
//! protocols — HTTP APIs, KV events over ZeroMQ byte for byte, replay, DP ranks, PD roles — in
//! virtual time, for Cortex's end-to-end tests, demo and benchmarks. Only binaries, tests,
//! benches and xtask may depend on it.
//!
//! ```no_run
//! use cortex_sim::{SimConfig, SimWorker};
//!
//! let mut cfg = SimConfig::vllm();
//! cfg.dp_size = 2;
//! let worker = SimWorker::start(cfg)?;
//! println!("{} publishes on {:?}", worker.base_url(), worker.event_endpoints());
//! worker.shutdown();
//! # Ok::<(), cortex_sim::SimError>(())
//! ```
//!
//! # What is modeled, and why it is faithful enough
//!
//! A gateway routes on three things a worker exposes: the KV events it publishes, the token ids
//! it computes for a request, and its load. The simulator reproduces the first two exactly and the
//! third structurally.
//!
//! - **The cache model is the engines' own logic, ported** — vLLM's `BlockPool` (LRU free queue,
//!   tail-first freeing, no deduplication of physical blocks, hits not re-announced, the last
//!   token never a hit, null block) in [`vllm`]; SGLang's radix tree (page-aligned keys,
//!   namespaces, silent splits, LRU leaf eviction, the Rust TreeCore's event coalescing) in
//!   [`sglang`]. Hashes are `cortex-hash`'s engine recipes and bytes are the event crates'
//!   encoders, and both are proven against the engines: `tests/sim/` drives the cache models
//!   through the scenarios captured from vLLM's real `BlockPool` and SGLang's real
//!   `UnifiedRadixCache` (`golden/vllm/blockpool_golden.json`, `golden/sglang/wire_topic_kv.json`)
//!   and compares every ZeroMQ frame with the engines' (timestamps masked).
//! - **When events happen follows the schedulers**: a step-based scheduler per DP rank
//!   (token budget, chunked prefill, max running requests, a waiting queue, preemption) decides
//!   when vLLM caches blocks (at allocation, prompt and decode) and when SGLang inserts (after
//!   prefill, and the whole sequence at finish). Events of one step are one batch.
//! - **Text is the model's**: tokenizer and chat template from the model's own files
//!   (`cortex-hash`'s `text`), Qwen3 by default; a worker may get another template or block size
//!   than the gateway, to prove misalignment is detected.
//! - **Time is virtual**: each step costs `prefill_overhead + uncached tokens × per-token` and/or
//!   an inter-token latency growing with the batch ([`Timing`]); responses report the simulated
//!   TTFT (`x-sim-ttft-ms` and the TTFT histograms), so tests assert on simulated time. A speed
//!   factor maps it to wall-clock (0 = instant, the default); a step's tokens are delivered once
//!   its cost has passed on that clock, as a real engine's output follows its compute.
//! - **The wire around the cache**: DP ranks publish on `port_base + rank`, replay ROUTERs frame
//!   replies as each engine does, `/kv_event_sources` and `/server_info.kv_events` describe them,
//!   `/metrics` and `/v1/loads` carry the engines' names.
//! - **PD**: SGLang's bootstrap rendezvous (both legs concurrent, prefill done when the transfer
//!   is) and vLLM's NIXL pull (`kv_transfer_params`, leases that expire), over real HTTP between
//!   workers, so prefill and decode workers may live in different processes. A decode leg
//!   receives only the prompt tokens it lacks (its transfer costs time in proportion, and
//!   [`SimWorker::pd_counters`] counts them), reports `cached_tokens` as the engines do, and
//!   answers a failed transfer as they do (streaming: an error event after the `200` head).
//!   `cargo xtask pd-check` drives both roles through vLLM's toy proxy and SGLang's `mini_lb`.
//! - **Ground truth and faults**: [`SimWorker::held_blocks`] and `GET /sim/state` say exactly
//!   which blocks each rank holds and whether a subscriber is connected; [`Fault`]s (errors,
//!   stalls, cut streams, dropped batches, publisher restarts, replay off, flushes) are explicit
//!   and counted, never random.
//!
//! **Not modeled**, because no routing decision depends on it: model outputs (a fixed sentence is
//! generated), sampling parameters and stop strings, logprobs, multimodal inputs, hybrid or
//! sliding-window KV groups, CPU/disk offload tiers, speculative decoding beyond EAGLE's bigram
//! pages, and real GPU timing (the latency model is a linear stand-in).
//!
//! The crate's binary, `cortex-sim` (`src/main.rs`), starts workers from the command line
//! (`cargo run -p cortex-sim -- --help`). Its clap and anyhow sit behind the default feature
//! `cli`, which only the binary requires; the workspace's other crates take the library without
//! it.

#![forbid(unsafe_code)]

mod config;
mod engine;
mod error;
mod events;
mod faults;
mod http;
mod model;
mod pd;
mod publisher;
pub mod sglang;
mod truth;
pub mod vllm;
mod worker;

pub use config::{
    EngineConfig, EventsConfig, LoraAdapter, ModelSource, PdOptions, Role, SglangOptions, SimConfig, Timing,
    VllmOptions,
};
pub use error::SimError;
pub use faults::Fault;
pub use model::{SimModel, qwen3_dir};
pub use publisher::RankEndpoints;
pub use truth::{HeldBlock, PdCounters, RankState};
pub use worker::SimWorker;

/// Re-exported engine-format types a configuration names.
pub mod formats {
    pub use cortex_events_sglang::Encoding as SglangEncoding;
    pub use cortex_events_vllm::Version as VllmVersion;
    pub use cortex_hash::sglang::EventFormat as SglangEventFormat;
    pub use cortex_hash::vllm::{HashAlgo as VllmHashAlgo, NoneHashSeed};
}
