//! From vLLM's wire fields to the ledger's vocabulary ([`cortex_hash::kv`]).
//!
//! What each `BlockStored` becomes (the engine facts are `docs/engines.md` §2.1):
//! - only full-attention groups feed the ledger: a store whose `kv_cache_spec_kind` is set and is
//!   not `full_attention`, `mla_attention` or `sink_full_attention` is dropped;
//! - offload placeholders (empty `token_ids` or `block_size` 0) are dropped, and so is a store
//!   whose tokens do not cut into exactly one page per hash (it says nothing the ledger can key);
//! - each page gets its content [`BlockHash`](cortex_hash::BlockHash) in the namespace (vLLM,
//!   block size, model, `lora_name`); an EAGLE-lookahead block (0.33, `lookahead_token_ids`) hashes
//!   its page followed by its lookahead tokens, since vLLM's prefix hit needs both;
//! - `extra_keys` are read by type and position (LoRA name, multimodal `[id, offset]` pairs, cache
//!   salt on block 0, prompt-embeds `bin`): the salt goes into the lineage root; from the first
//!   block with a multimodal item, embeds digest or anything unrecognised, Cortex cannot reproduce
//!   the identity, so the event is split and that block and its successors get `lineage: None`;
//! - a store with `lora_id` but no `lora_name` (before 0.14), or without `extra_keys` (before
//!   0.17) when the context says such stores may be salted or multimodal, gets `lineage: None`.
//!
//! Engine hashes are per (hash, group): vLLM keys its cache by `BlockHashWithGroupId` and publishes
//! the same hash for every group of a hybrid model, so a sliding-window group evicting hash `h`
//! must not remove the full-attention group's `h`. [`engine_hash`] folds a non-zero `group_idx`
//! into the handle; group 0 and absent groups keep the published value.

use cortex_events_core::Namespaces;
use cortex_hash::Engine;
use cortex_hash::kv::{BlockRemoved, BlockStored, EventBatch, KvEvent, Lineage, Medium, StoredBlock};

use crate::wire::{ExtraKey, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireHash};

/// What a decoder needs that the event does not say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeContext<'a> {
    /// Served model name: part of every namespace.
    pub model: &'a str,
    /// How to read a `BlockStored` without `extra_keys` (releases before 0.17 did not publish
    /// cache salts or multimodal items).
    pub unlabeled: Unlabeled,
}

impl<'a> DecodeContext<'a> {
    /// A context for `model`.
    #[must_use]
    pub const fn new(model: &'a str, unlabeled: Unlabeled) -> Self {
        DecodeContext { model, unlabeled }
    }
}

/// How to read a store that does not say whether the request had a cache salt or multimodal
/// items (no `extra_keys` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unlabeled {
    /// As a plain request: no salted or multimodal traffic reaches this worker.
    Plain,
    /// As unknown: `lineage: None`, never counted as plain blocks.
    Unknown,
}

/// Kinds of KV-cache groups whose blocks a prefix hit needs exactly as published.
const FULL_ATTENTION: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// Mixes a group index into an engine hash (odd, so distinct groups give distinct handles).
const GROUP_MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// The handle of a published block hash in KV-cache group `group`.
///
/// Integer and `bin` forms of one digest give the same handle ([`EngineHash::from_digest`]).
/// Group 0 and absent groups (before 0.20) keep the published value.
///
/// [`EngineHash::from_digest`]: cortex_hash::kv::EngineHash::from_digest
#[must_use]
pub fn engine_hash(hash: WireHash<'_>, group: Option<i64>) -> cortex_hash::kv::EngineHash {
    use cortex_hash::kv::EngineHash;
    let h = match hash {
        WireHash::Uint(v) => EngineHash::from_u64(v),
        WireHash::Int(v) => EngineHash::from_i64(v),
        WireHash::Bytes(b) => EngineHash::from_digest(b),
    };
    match group {
        None | Some(0) => h,
        Some(g) => EngineHash::from_u64(h.to_u64() ^ (g as u64).wrapping_mul(GROUP_MIX)),
    }
}

impl WireBatch<'_> {
    /// The normalized batch: what the ledger applies.
    #[must_use]
    pub fn normalize(&self, ctx: &DecodeContext<'_>) -> EventBatch {
        let mut namespaces = Namespaces::new(Engine::Vllm, ctx.model);
        let mut events = Vec::with_capacity(self.events.len());
        let mut window = Vec::new();
        for ev in &self.events {
            match ev {
                WireEvent::BlockStored(s) => stored(s, ctx, &mut namespaces, &mut window, &mut events),
                WireEvent::BlockRemoved(r) => events.push(KvEvent::Removed(removed(r))),
                WireEvent::AllBlocksCleared => events.push(KvEvent::AllCleared),
            }
        }
        EventBatch { ts: self.ts, dp_rank: self.data_parallel_rank.map(cortex_hash::kv::DpRank), events }
    }
}

fn medium(medium: Option<&str>, locality: Option<&str>) -> Medium {
    // A remote offload tier is outside the worker, whatever its medium.
    if locality == Some("REMOTE") { Medium::External } else { Medium::from_wire(medium) }
}

fn removed(r: &WireBlockRemoved<'_>) -> BlockRemoved {
    BlockRemoved {
        blocks: r.block_hashes.iter().map(|&h| engine_hash(h, r.group_idx)).collect(),
        medium: medium(r.medium, r.locality),
    }
}

fn stored(
    s: &WireBlockStored<'_>,
    ctx: &DecodeContext<'_>,
    namespaces: &mut Namespaces<'_>,
    window: &mut Vec<u32>,
    out: &mut Vec<KvEvent>,
) {
    if s.kv_cache_spec_kind.is_some_and(|k| !FULL_ATTENTION.contains(&k)) {
        return;
    }
    let n = s.block_hashes.len();
    let bs = s.block_size as usize;
    if n == 0 || bs == 0 || s.token_ids.is_empty() || n.checked_mul(bs) != Some(s.token_ids.len()) {
        return;
    }
    let lookahead = match &s.lookahead_token_ids {
        Some(l) if l.len() != n => return,
        l => l.as_deref(),
    };
    let ns = namespaces.get(s.block_size, s.lora_name);
    let (salt, reproducible) =
        if s.lora_name.is_none() && s.lora_id.is_some() { (None, 0) } else { classify(s, n, ctx.unlabeled) };
    let blocks: Vec<StoredBlock> = s
        .token_ids
        .chunks_exact(bs)
        .zip(&s.block_hashes)
        .enumerate()
        .map(|(i, (page, &h))| {
            let content = match lookahead {
                None => ns.block_hash(page),
                Some(l) => {
                    window.clear();
                    window.extend_from_slice(page);
                    window.extend_from_slice(&l[i]);
                    ns.block_hash(window)
                }
            };
            StoredBlock { engine: engine_hash(h, s.group_idx), content }
        })
        .collect();
    let parent = s.parent_block_hash.map(|h| engine_hash(h, s.group_idx));
    let medium = medium(s.medium, s.locality);
    if reproducible == n {
        out.push(KvEvent::Stored(BlockStored {
            parent,
            blocks,
            lineage: Some(Lineage::new(ns, salt)),
            medium,
        }));
    } else if reproducible == 0 {
        out.push(KvEvent::Stored(BlockStored { parent, blocks, lineage: None, medium }));
    } else {
        let mut known = blocks;
        let unknown = known.split_off(reproducible);
        let split_parent = known.last().map(|b| b.engine);
        out.push(KvEvent::Stored(BlockStored {
            parent,
            blocks: known,
            lineage: Some(Lineage::new(ns, salt)),
            medium,
        }));
        out.push(KvEvent::Stored(BlockStored {
            parent: split_parent,
            blocks: unknown,
            lineage: None,
            medium,
        }));
    }
}

/// Reads `extra_keys` by type and position: the cache salt of a chain's first block, and how many
/// leading blocks Cortex can reproduce (`n` for all).
fn classify<'a>(s: &WireBlockStored<'a>, n: usize, unlabeled: Unlabeled) -> (Option<&'a str>, usize) {
    let Some(keys) = &s.extra_keys else {
        return match unlabeled {
            Unlabeled::Plain => (None, n),
            Unlabeled::Unknown => (None, 0),
        };
    };
    if keys.len() != n {
        return (None, 0);
    }
    let mut salt = None;
    for (i, entry) in keys.iter().enumerate() {
        let Some(elems) = entry else {
            // A LoRA request names its adapter on every block.
            if s.lora_name.is_some() {
                return (salt, i);
            }
            continue;
        };
        let mut rest = elems.as_slice();
        if let Some(name) = s.lora_name {
            match rest.split_first() {
                Some((ExtraKey::Str(x), tail)) if *x == name => rest = tail,
                _ => return (salt, i),
            }
        }
        match rest {
            [] => {}
            // The salt comes after LoRA and multimodal items, on the request's block 0 only.
            [ExtraKey::Str(x)] if i == 0 && s.parent_block_hash.is_none() => salt = Some(*x),
            // Multimodal items, a prompt-embeds digest, a salt anywhere else, or unknown keys.
            _ => return (salt, i),
        }
    }
    (salt, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::BlockExtraKeys;

    type Extras = Option<Vec<BlockExtraKeys<'static>>>;

    fn stored_event(extra: Extras) -> WireBlockStored<'static> {
        WireBlockStored {
            block_hashes: vec![WireHash::Uint(1), WireHash::Uint(2), WireHash::Uint(3)],
            token_ids: (0..12).collect(),
            block_size: 4,
            lora_name: Some("ad"),
            extra_keys: extra,
            ..WireBlockStored::default()
        }
    }

    #[test]
    fn extra_keys_are_read_by_position() {
        use ExtraKey::{Bytes, Mm, Str};
        let mm = Mm { identifier: "img", offset: 0 };
        let cases: Vec<(Extras, (Option<&str>, usize))> = vec![
            (Some(vec![Some(vec![Str("ad")]); 3]), (None, 3)),
            (
                Some(vec![Some(vec![Str("ad"), Str("salt")]), Some(vec![Str("ad")]), Some(vec![Str("ad")])]),
                (Some("salt"), 3),
            ),
            // A salt equal to the adapter name is still the second element.
            (
                Some(vec![Some(vec![Str("ad"), Str("ad")]), Some(vec![Str("ad")]), Some(vec![Str("ad")])]),
                (Some("ad"), 3),
            ),
            (Some(vec![Some(vec![Str("ad")]), Some(vec![Str("ad"), mm]), Some(vec![Str("ad")])]), (None, 1)),
            (
                Some(vec![
                    Some(vec![Str("ad")]),
                    Some(vec![Str("ad"), Bytes(&[1; 32])]),
                    Some(vec![Str("ad")]),
                ]),
                (None, 1),
            ),
            // A salt on a later block is not a salt.
            (
                Some(vec![Some(vec![Str("ad")]), Some(vec![Str("ad"), Str("s")]), Some(vec![Str("ad")])]),
                (None, 1),
            ),
            // The adapter must come first, on every block.
            (Some(vec![Some(vec![Str("other")]), Some(vec![Str("ad")]), Some(vec![Str("ad")])]), (None, 0)),
            (Some(vec![Some(vec![Str("ad")]), None, Some(vec![Str("ad")])]), (None, 1)),
            (Some(vec![Some(vec![Str("ad")]); 2]), (None, 0)),
        ];
        for (extra, want) in cases {
            let s = stored_event(extra.clone());
            assert_eq!(classify(&s, 3, Unlabeled::Plain), want, "{extra:?}");
        }
        let s = stored_event(None);
        assert_eq!(classify(&s, 3, Unlabeled::Plain), (None, 3));
        assert_eq!(classify(&s, 3, Unlabeled::Unknown), (None, 0));
    }

    #[test]
    fn a_salt_on_a_continuation_is_not_a_salt() {
        let mut s = stored_event(Some(vec![Some(vec![ExtraKey::Str("ad"), ExtraKey::Str("s")]), None, None]));
        s.lora_name = None;
        s.extra_keys = Some(vec![Some(vec![ExtraKey::Str("s")]), None, None]);
        assert_eq!(classify(&s, 3, Unlabeled::Plain), (Some("s"), 3));
        s.parent_block_hash = Some(WireHash::Uint(9));
        assert_eq!(classify(&s, 3, Unlabeled::Plain), (None, 0));
    }

    #[test]
    fn groups_separate_handles_and_group_zero_keeps_the_wire_value() {
        let h = WireHash::Uint(17_267_691_262_617_277_681);
        assert_eq!(engine_hash(h, None).to_u64(), 17_267_691_262_617_277_681);
        assert_eq!(engine_hash(h, Some(0)), engine_hash(h, None));
        assert_ne!(engine_hash(h, Some(1)), engine_hash(h, Some(0)));
        assert_ne!(engine_hash(h, Some(1)), engine_hash(h, Some(2)));
        let digest = [7u8; 32];
        let low = u64::from_be_bytes([7; 8]);
        assert_eq!(engine_hash(WireHash::Bytes(&digest), Some(3)), engine_hash(WireHash::Uint(low), Some(3)));
    }
}
