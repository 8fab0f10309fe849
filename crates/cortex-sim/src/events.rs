//! The cache models' events in a chosen engine version's wire format, through the event crates'
//! encoders (never our own MessagePack).
//!
//! Key decision: fields are set only where the simulated release has them — vLLM: `medium` from
//! 0.10.2, `lora_name` 0.14, `extra_keys` 0.17, `group_idx` 0.20, `kv_cache_spec_kind` 0.22
//! (stores only, as `KVCacheManager.take_events` fills it), `session_id` 0.30; SGLang positional
//! arrays (0.5.19) carry neither `session_id` nor `lora_name` — so the encoders, which refuse a
//! field a release lacks, accept every batch.

use cortex_events_sglang::{Encoding, TokenIds, WireBatch as SgBatch, WireBlockRemoved as SgRemoved};
use cortex_events_sglang::{WireBlockStored as SgStored, WireEvent as SgEvent};
use cortex_events_vllm::{
    ExtraKey, Version, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireHash,
};
use cortex_hash::vllm::VllmDigest;

use crate::config::{SglangOptions, VllmOptions};
use crate::sglang::RadixEvent;
use crate::vllm::PoolEvent;

const MEDIUM_GPU: &str = "GPU";

fn wire_hash(d: &VllmDigest, int: bool) -> WireHash<'_> {
    if int { WireHash::Uint(d.wire_u64()) } else { WireHash::Bytes(d.as_bytes()) }
}

/// Encodes one vLLM batch; `None` if the encoder refuses it (a bug: logged by the caller's tests).
pub(crate) fn encode_vllm(events: &[PoolEvent], opts: &VllmOptions, rank: u16, ts: f64) -> Option<Vec<u8>> {
    let v = opts.version;
    let since = |major, minor, patch| v >= Version::new(major, minor, patch);
    let int = opts.int_block_hashes;
    let wire: Vec<WireEvent<'_>> = events
        .iter()
        .map(|e| match e {
            PoolEvent::Stored(s) => WireEvent::BlockStored(WireBlockStored {
                block_hashes: s.hashes.iter().map(|h| wire_hash(h, int)).collect(),
                parent_block_hash: s.parent.as_ref().map(|h| wire_hash(h, int)),
                token_ids: s.tokens.clone(),
                block_size: u32::try_from(s.block_size).unwrap_or(u32::MAX),
                lora_id: s.lora_id,
                medium: since(0, 10, 2).then_some(MEDIUM_GPU),
                lora_name: if since(0, 14, 0) { s.lora_name.as_deref() } else { None },
                extra_keys: since(0, 17, 0).then(|| {
                    s.extra_keys
                        .iter()
                        .map(|k| k.as_ref().map(|keys| keys.iter().map(|x| ExtraKey::Str(x)).collect()))
                        .collect()
                }),
                group_idx: since(0, 20, 0).then_some(0),
                kv_cache_spec_kind: since(0, 22, 0).then_some("full_attention"),
                session_id: if since(0, 30, 0) { s.session_id.as_deref() } else { None },
                ..WireBlockStored::default()
            }),
            PoolEvent::Removed(h) => WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: vec![wire_hash(h, int)],
                medium: since(0, 10, 2).then_some(MEDIUM_GPU),
                group_idx: since(0, 20, 0).then_some(0),
                ..WireBlockRemoved::default()
            }),
            PoolEvent::Cleared => WireEvent::AllBlocksCleared,
        })
        .collect();
    let batch = WireBatch { ts, events: wire, data_parallel_rank: v.has_rank().then_some(rank) };
    cortex_events_vllm::encode(&batch, v).ok()
}

/// Encodes one SGLang batch; `None` if the encoder refuses it.
pub(crate) fn encode_sglang(
    events: &[RadixEvent],
    opts: &SglangOptions,
    rank: u16,
    ts: f64,
) -> Option<Vec<u8>> {
    let maps = opts.encoding == Encoding::Maps;
    let wire: Vec<SgEvent<'_>> = events
        .iter()
        .map(|e| match e {
            RadixEvent::Stored(s) => SgEvent::BlockStored(SgStored {
                block_hashes: s.hashes.clone(),
                parent_block_hash: s.parent,
                token_ids: if s.bigram {
                    TokenIds::Bigram(s.units.iter().map(|u| [u >> 32, u & 0xffff_ffff]).collect())
                } else {
                    TokenIds::Flat(s.units.clone())
                },
                block_size: u32::try_from(s.block_size).unwrap_or(u32::MAX),
                lora_id: None,
                medium: Some(MEDIUM_GPU),
                cache_salt: s.cache_salt.as_deref(),
                session_id: if maps { s.session_id.as_deref() } else { None },
                lora_name: if maps { s.lora_name.as_deref() } else { None },
            }),
            RadixEvent::Removed { hashes, .. } => {
                SgEvent::BlockRemoved(SgRemoved { block_hashes: hashes.clone(), medium: Some(MEDIUM_GPU) })
            }
            RadixEvent::Cleared => SgEvent::AllBlocksCleared,
        })
        .collect();
    let batch = SgBatch { ts, events: wire, attn_dp_rank: Some(rank) };
    cortex_events_sglang::encode(&batch, opts.encoding).ok()
}
