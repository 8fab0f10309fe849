//! From SGLang's wire fields to the ledger's vocabulary ([`cortex_hash::kv`]).
//!
//! What each `BlockStored` becomes:
//! - each page gets its content [`BlockHash`](cortex_hash::BlockHash) in the namespace (SGLang,
//!   `block_size`, model, `lora_name`); `cache_salt` seeds the lineage root;
//! - **bigram pages** (EAGLE / EAGLE3 / FROZEN_KV_MTP: `token_ids` as pairs `[[a,b],[b,c],…]`): a
//!   page of `P` units covers the `P + 1` tokens `t_j ..= t_{j+P}`, and SGLang's prefix match needs
//!   all of them (the pairs are the radix key). Cortex hashes exactly that token window, so the
//!   gateway computes the same identity for a request with `Namespace::bigram_seq_hashes`: page `i` is
//!   `tokens[i*P ..= i*P + P]`, and a request of `N` tokens has `(N - 1) / P` full pages, as many
//!   as SGLang inserts. A plain page of `P` tokens and a bigram window of `P + 1` never hash alike;
//! - **unknown namespace**: SGLang publishes `lora_name` only for adapters registered in its
//!   `KvEventLoraNames`; an unregistered adapter's blocks (and, in the `dynamo` format, any
//!   extra-key request's) arrive without `lora_name` and, in the `default` format, with exactly the
//!   base model's hashes (`golden/sglang/hash_vectors.json`, case
//!   `lora_unregistered_default_p16`). When the context says such traffic may reach the worker
//!   ([`Unlabeled::Unknown`]), every store without `lora_name` gets `lineage: None`, so the ledger
//!   never counts it as a base-model block; so does a store with a `lora_id` but no name;
//! - a store whose units do not cut into exactly one page per hash, whose bigram pairs do not
//!   overlap, or with a token beyond `u32` (a "wide" page no tokenizer produces for a request), is
//!   dropped: it says nothing the ledger can key, and dropping only under-counts.

use cortex_events_core::Namespaces;
use cortex_hash::kv::{
    BlockRemoved, BlockStored, DpRank, EngineHash, EventBatch, KvEvent, Lineage, Medium, StoredBlock,
};
use cortex_hash::{Engine, Token};

use crate::wire::{TokenIds, WireBatch, WireBlockStored, WireEvent};

/// What a decoder needs that the event does not say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeContext<'a> {
    /// Served model name: part of every namespace.
    pub model: &'a str,
    /// How to read a `BlockStored` without `lora_name`.
    pub unlabeled: Unlabeled,
}

impl<'a> DecodeContext<'a> {
    /// A context for `model`.
    #[must_use]
    pub const fn new(model: &'a str, unlabeled: Unlabeled) -> Self {
        DecodeContext { model, unlabeled }
    }
}

/// How to read a store without `lora_name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unlabeled {
    /// As a base-model request: every adapter served by this worker is registered (its name is
    /// published) and, with `format: dynamo`, no request carries an extra key.
    Plain,
    /// As unknown: unregistered adapters or extra keys may be in use; `lineage: None`.
    Unknown,
}

impl WireBatch<'_> {
    /// The normalized batch: what the ledger applies.
    #[must_use]
    pub fn normalize(&self, ctx: &DecodeContext<'_>) -> EventBatch {
        let mut namespaces = Namespaces::new(Engine::Sglang, ctx.model);
        let mut events = Vec::with_capacity(self.events.len());
        let mut units = Vec::new();
        for ev in &self.events {
            match ev {
                WireEvent::BlockStored(s) => {
                    if let Some(e) = stored(s, ctx, &mut namespaces, &mut units) {
                        events.push(KvEvent::Stored(e));
                    }
                }
                WireEvent::BlockRemoved(r) => events.push(KvEvent::Removed(BlockRemoved {
                    blocks: r.block_hashes.iter().map(|&h| EngineHash::from_i64(h)).collect(),
                    medium: Medium::from_wire(r.medium),
                })),
                WireEvent::AllBlocksCleared => events.push(KvEvent::AllCleared),
            }
        }
        EventBatch { ts: self.ts, dp_rank: self.attn_dp_rank.map(DpRank), events }
    }
}

/// Fills `units` with the tokens every page hashes, laid out page after page (`P` tokens a page,
/// or `P + 1` for bigram windows); `None` if the store cannot be paged.
fn page_tokens(t: &TokenIds, n: usize, p: usize, units: &mut Vec<Token>) -> Option<usize> {
    units.clear();
    if t.len() != n.checked_mul(p)? {
        return None;
    }
    match t {
        TokenIds::Flat(ids) => {
            units.reserve(ids.len());
            for &id in ids {
                units.push(Token::try_from(id).ok()?);
            }
            Some(p)
        }
        TokenIds::Bigram(pairs) => {
            if pairs.windows(2).any(|w| w[0][1] != w[1][0]) {
                return None;
            }
            units.reserve(n * (p + 1));
            for page in pairs.chunks_exact(p) {
                for pair in page {
                    units.push(Token::try_from(pair[0]).ok()?);
                }
                units.push(Token::try_from(page.last()?[1]).ok()?);
            }
            Some(p + 1)
        }
    }
}

fn stored(
    s: &WireBlockStored<'_>,
    ctx: &DecodeContext<'_>,
    namespaces: &mut Namespaces<'_>,
    units: &mut Vec<Token>,
) -> Option<BlockStored> {
    let n = s.block_hashes.len();
    if n == 0 || s.block_size == 0 {
        return None;
    }
    let width = page_tokens(&s.token_ids, n, s.block_size as usize, units)?;
    let ns = namespaces.get(s.block_size, s.lora_name);
    let labelled = s.lora_name.is_some() || (s.lora_id.is_none() && ctx.unlabeled == Unlabeled::Plain);
    let lineage = labelled.then(|| Lineage::new(ns, s.cache_salt));
    let blocks = units
        .chunks_exact(width)
        .zip(&s.block_hashes)
        .map(|(page, &h)| StoredBlock { engine: EngineHash::from_i64(h), content: ns.block_hash(page) })
        .collect();
    Some(BlockStored {
        parent: s.parent_block_hash.map(EngineHash::from_i64),
        blocks,
        lineage,
        medium: Medium::from_wire(s.medium),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bigram_windows_overlap_by_one_token() {
        let pairs: Vec<[u64; 2]> = (0..8u64).map(|t| [t, t + 1]).collect();
        let mut units = Vec::new();
        assert_eq!(page_tokens(&TokenIds::Bigram(pairs.clone()), 2, 4, &mut units), Some(5));
        assert_eq!(units, vec![0, 1, 2, 3, 4, 4, 5, 6, 7, 8]);
        let mut broken = pairs;
        broken[5] = [99, 6];
        assert_eq!(page_tokens(&TokenIds::Bigram(broken), 2, 4, &mut units), None);
    }

    #[test]
    fn flat_pages_must_fit_u32_and_the_hash_count() {
        let mut units = Vec::new();
        assert_eq!(page_tokens(&TokenIds::Flat((0..8).collect()), 2, 4, &mut units), Some(4));
        assert_eq!(page_tokens(&TokenIds::Flat((0..7).collect()), 2, 4, &mut units), None);
        assert_eq!(page_tokens(&TokenIds::Flat(vec![1, 2, 3, 1 << 32]), 1, 4, &mut units), None);
    }
}
