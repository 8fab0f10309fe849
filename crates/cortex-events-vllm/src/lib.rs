//! `cortex-events-vllm`: vLLM's KV-event wire format, as pure functions from bytes to Cortex's
//! normalized events ([`cortex_hash::kv::EventBatch`]) and from typed wire values back to bytes.
//! No sockets, no async: the ZeroMQ runtime is `cortex-ingest`, the publisher is `cortex-sim`.
//!
//! # The format and its history (vLLM 0.9 → 0.33)
//!
//! A payload (frame 2 of `[topic, seq, payload]`) is a msgspec MessagePack array
//! `[ts: float64, events, data_parallel_rank]`; 0.9.0 had no rank (a 2-element batch). Events are
//! `BlockStored`, `BlockRemoved` and `AllBlocksCleared`:
//!
//! | releases | event encoding |
//! |---|---|
//! | ≤ 0.23 | positional arrays `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`, as long as the release's field list, nil where `None` |
//! | ≥ 0.24 | maps with a `"type"` key; fields without a default always present, the rest omitted when `None` |
//!
//! Fields arrived over time (`medium` 0.10.2, `lora_name` 0.14, `extra_keys` 0.17, `group_idx`
//! 0.20, `kv_cache_spec_kind` 0.22, `locality` 0.26, `ownership` 0.29, `session_id` 0.30,
//! `lookahead_token_ids` 0.33). Block hashes are integers of any msgpack width (the low 64 bits
//! of the digest, unsigned, since 0.10.2; Python `hash()` values, possibly negative, before) or,
//! with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, the 32- or 16-byte digest as `bin`. [`decode`]
//! reads all of it in one pass; [`encode`] writes any [`Version`] byte for byte as msgspec does.
//!
//! # The key decision
//!
//! Cortex does not trust vLLM's hashes for identity (they depend on the release, the hash
//! algorithm, `PYTHONHASHSEED`, LoRA paths): every page of `token_ids` is re-hashed into Cortex's
//! own [`BlockHash`](cortex_hash::BlockHash), namespaced by engine, block size, model and
//! `lora_name`, and the cache salt (from `extra_keys`) seeds the lineage root. vLLM's hashes stay
//! per-holder handles for parents and removals. Only what Cortex can reproduce for a request gets a
//! lineage: stores of non-full-attention groups and offload placeholders are dropped; blocks with
//! multimodal items or prompt embeddings, and LoRA stores without a name, get `lineage: None`, so
//! the ledger never counts them as plain blocks. See [`normalize`] for every rule.
//!
//! ```
//! use cortex_events_vllm::{DecodeContext, Unlabeled, Version, decode, decode_wire, encode};
//! use cortex_hash::kv::KvEvent;
//!
//! // vLLM 0.33: [ts, [{"type": "AllBlocksCleared"}], 0]
//! let payload = [
//!     0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x5a, 0, 0, 0, 0x91, 0x81, 0xa4, b't', b'y', b'p', b'e', 0xb0,
//!     b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's', b'C', b'l', b'e', b'a', b'r', b'e', b'd', 0x00,
//! ];
//! let ctx = DecodeContext::new("Qwen/Qwen3-8B", Unlabeled::Plain);
//! let batch = decode(&payload, &ctx)?;
//! assert_eq!(batch.events, vec![KvEvent::AllCleared]);
//! // The wire view re-encodes to the same bytes.
//! assert_eq!(encode(&decode_wire(&payload)?, Version::LATEST).unwrap(), payload);
//! # Ok::<(), cortex_events_vllm::DecodeError>(())
//! ```

#![forbid(unsafe_code)]

mod encode;
pub mod normalize;
mod wire;

pub use cortex_events_core::{DecodeError, EncodeError, ValueKind};
pub use encode::{Version, encode};
pub use normalize::{DecodeContext, Unlabeled, engine_hash};
pub use wire::{
    BlockExtraKeys, ExtraKey, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireHash, decode_wire,
};

use cortex_hash::kv::EventBatch;

/// Decodes one payload into the normalized batch the ledger applies: [`decode_wire`] followed by
/// [`WireBatch::normalize`].
///
/// # Errors
/// [`DecodeError`] if the payload is not one well-formed vLLM batch. Never panics.
pub fn decode(payload: &[u8], ctx: &DecodeContext<'_>) -> Result<EventBatch, DecodeError> {
    Ok(decode_wire(payload)?.normalize(ctx))
}
