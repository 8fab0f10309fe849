//! `cortex-events-vllm`: vLLM's KV-event wire format (filled by the event-ingestion issue).
//!
//! It will own the pure conversion between vLLM's msgpack payloads (positional arrays up to 0.23,
//! tagged maps since 0.24, integer or `bin` hashes) and `cortex_hash::kv::EventBatch`, in both
//! directions (the simulator publishes with the encoder). No sockets, no tokio.
