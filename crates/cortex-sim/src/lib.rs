//! `cortex-sim`: the engine simulator (filled by the simulator issue).
//!
//! It will simulate vLLM and SGLang workers faithfully enough that a gateway that works against
//! it works against real engines: their HTTP APIs, a paged prefix cache with LRU eviction, KV
//! events in each engine version's exact bytes, replay, data-parallel ranks, prefill/decode
//! roles, virtual-time latency and injectable faults. Only binaries, tests, benches and xtask
//! may depend on it.
