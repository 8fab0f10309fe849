//! `cortex-events-sglang`: SGLang's KV-event wire format, as pure functions from bytes to Cortex's
//! normalized events ([`cortex_hash::kv::EventBatch`]) and from typed wire values back to bytes.
//! No sockets, no async: the ZeroMQ runtime is `cortex-ingest`, the publisher is `cortex-sim`.
//!
//! # The format and its history
//!
//! A payload (frame 2 of `[topic, seq, payload]`) is a msgspec MessagePack array
//! `[ts: float64, events, attn_dp_rank]` in every release. Events are `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared`:
//!
//! | releases | event encoding |
//! |---|---|
//! | ≤ 0.5.19 | positional arrays `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`; from 0.5.18 a salted store (`BlockStoredWithMetadata`) adds `{"cache_salt": S}` |
//! | ≥ 0.5.20 | maps with a `"type"` key; `medium`, `cache_salt`, `session_id`, `lora_name` omitted when `None` |
//!
//! Hashes are signed 64-bit (the first 8 bytes of a SHA-256 page chain); msgspec writes the
//! non-negative ones as unsigned forms (`uint64` `0xcf`). `medium` is `GPU`, `CPU_PINNED`, `DISK`
//! or `EXTERNAL`. With EAGLE speculative decoding `token_ids` holds overlapping pairs
//! `[[a,b],[b,c],…]`. [`decode`] reads both encodings in one pass; [`encode`] writes either
//! ([`Encoding`]) byte for byte as msgspec does.
//!
//! # The key decisions
//!
//! Cortex does not key on SGLang's hashes (a recipe SGLang has changed before, and namespaced
//! differently by the `default` and `dynamo` formats): every page is re-hashed into Cortex's own
//! [`BlockHash`](cortex_hash::BlockHash) in the namespace (engine, block size, model,
//! `lora_name`), the cache salt seeding the lineage root; SGLang's hashes stay per-holder handles
//! for parents and removals. Two cases need care, both detailed in [`normalize`]:
//! - a bigram page is hashed as the token window its pairs cover (`P + 1` tokens), which the
//!   gateway computes for a request with
//!   [`Namespace::bigram_seq_hashes`](cortex_hash::Namespace::bigram_seq_hashes);
//! - SGLang publishes `lora_name` only for registered adapters, and an unregistered adapter's
//!   blocks carry the base model's hashes; [`Unlabeled::Unknown`] makes every store without a name
//!   `lineage: None`, so such blocks are never counted as base-model blocks.
//!
//! ```
//! use cortex_events_sglang::{DecodeContext, Encoding, Unlabeled, decode, decode_wire, encode};
//! use cortex_hash::kv::{DpRank, KvEvent};
//!
//! // SGLang 0.5.23: [ts, [{"type": "AllBlocksCleared"}], 1]
//! let payload = [
//!     0x93, 0xcb, 0x41, 0xda, 0xc3, 0x44, 0xa7, 0x5d, 0x0c, 0xf3, 0x91, 0x81, 0xa4, b't', b'y', b'p',
//!     b'e', 0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's', b'C', b'l', b'e', b'a', b'r',
//!     b'e', b'd', 0x01,
//! ];
//! let ctx = DecodeContext::new("Qwen/Qwen3-8B", Unlabeled::Plain);
//! let batch = decode(&payload, &ctx)?;
//! assert_eq!((batch.dp_rank, batch.events), (Some(DpRank(1)), vec![KvEvent::AllCleared]));
//! assert_eq!(encode(&decode_wire(&payload)?, Encoding::Maps).unwrap(), payload);
//! # Ok::<(), cortex_events_sglang::DecodeError>(())
//! ```

#![forbid(unsafe_code)]

mod encode;
pub mod normalize;
mod wire;

pub use cortex_events_core::{DecodeError, EncodeError, ValueKind};
pub use encode::{Encoding, encode};
pub use normalize::{DecodeContext, Unlabeled};
pub use wire::{LoraId, TokenIds, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, decode_wire};

use cortex_hash::kv::EventBatch;

/// Decodes one payload into the normalized batch the ledger applies: [`decode_wire`] followed by
/// [`WireBatch::normalize`].
///
/// # Errors
/// [`DecodeError`] if the payload is not one well-formed SGLang batch. Never panics.
pub fn decode(payload: &[u8], ctx: &DecodeContext<'_>) -> Result<EventBatch, DecodeError> {
    Ok(decode_wire(payload)?.normalize(ctx))
}
