//! `cortex-events-sglang`: SGLang's KV-event wire format (filled by the event-ingestion issue).
//!
//! It will own the pure conversion between SGLang's msgpack payloads (`[ts, events, attn_dp_rank]`,
//! events as maps or, up to 0.5.19, arrays; signed hashes; bigram pages) and
//! `cortex_hash::kv::EventBatch`, in both directions. No sockets, no tokio.
