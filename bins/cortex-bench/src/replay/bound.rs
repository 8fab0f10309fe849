//! What a workload allows at best: its requests tokenized with the real tokenizer, paged as the
//! engines page them, and the infinite-cache bound — the share of prompt tokens an engine with
//! unlimited KV cache, seeing every request, could have served from cache.
//!
//! Key decision: the bound follows the simulated engines' own rule, so that it is in the same
//! units as the `cached_tokens` the workers report: only whole pages count, and the last prompt
//! token is never a hit (both engines match `tokens[..len − 1]`). The same pass counts the
//! unique pages of the workload, which sizes the cluster's caches. The trace-level bound (in the
//! trace's own 512-token blocks, as `bins/cortex-bench/traces/README.md` states it) is reported next to it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use anyhow::{Context, Result};
use cortex_hash::text::{SpecialTokens, TextTokenizer};

use super::text::{Piece, push_piece};
use super::workload::Workload;

/// The token-level facts of a workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Analysis {
    /// Prompt tokens of every request, in order.
    pub prompt_tokens: Vec<u64>,
    /// Prompt tokens an infinite cache would have served, per request.
    pub bound_hits: Vec<u64>,
    /// Distinct full pages over all prompts.
    pub unique_pages: u64,
    /// The largest prompt, in pages (rounded up).
    pub max_prompt_pages: u64,
    /// Trace-level bound: leading blocks (chunks) seen before, over all blocks.
    pub block_bound: f64,
    /// Chained page keys of every prompt (full pages).
    pub chains: Vec<Vec<u64>>,
}

impl Analysis {
    /// Σ prompt tokens.
    #[must_use]
    pub fn total_prompt_tokens(&self) -> u64 {
        self.prompt_tokens.iter().sum()
    }

    /// The infinite-cache bound as a share of prompt tokens.
    #[must_use]
    pub fn token_bound(&self) -> f64 {
        ratio(self.bound_hits.iter().sum(), self.total_prompt_tokens())
    }

    /// A reference, not a bound: the share of prompt tokens one LRU cache of `capacity` pages
    /// (the whole cluster's, as if routing were perfect and load did not matter) would serve.
    /// Prompts only (the engines also cache outputs), tails evicted before heads.
    #[must_use]
    pub fn lru_share(&self, capacity: u64, page: usize) -> f64 {
        let mut stamp_of: HashMap<u64, u64> = HashMap::new();
        let mut by_stamp: BTreeMap<u64, u64> = BTreeMap::new();
        let mut now = 0u64;
        let mut hits = 0u64;
        for (chain, &len) in self.chains.iter().zip(&self.prompt_tokens) {
            let usable = (len as usize).saturating_sub(1) / page;
            hits += (chain[..usable.min(chain.len())].iter().take_while(|k| stamp_of.contains_key(k)).count()
                * page) as u64;
            // Touch the tail first, so that a prefix is always newer than its continuation.
            for k in chain.iter().rev() {
                now += 1;
                if let Some(old) = stamp_of.insert(*k, now) {
                    by_stamp.remove(&old);
                }
                by_stamp.insert(now, *k);
            }
            while stamp_of.len() as u64 > capacity {
                let Some((_, k)) = by_stamp.pop_first() else { break };
                stamp_of.remove(&k);
            }
        }
        ratio(hits, self.total_prompt_tokens())
    }
}

/// `a / b`, 0 when `b` is 0.
#[must_use]
pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Tokenizes each distinct chunk once.
#[derive(Debug)]
pub struct ChunkTokens<'a> {
    tokenizer: &'a TextTokenizer,
    cache: HashMap<Piece, Vec<u32>>,
}

impl<'a> ChunkTokens<'a> {
    /// A cache over `tokenizer`.
    #[must_use]
    pub fn new(tokenizer: &'a TextTokenizer) -> Self {
        ChunkTokens { tokenizer, cache: HashMap::new() }
    }

    /// Tokens of one chunk, alone.
    ///
    /// # Errors
    /// The tokenizer fails.
    pub fn piece(&mut self, p: Piece) -> Result<&[u32]> {
        if !self.cache.contains_key(&p) {
            let mut s = String::new();
            push_piece(&mut s, p);
            // `/v1/completions` tokenizes with special tokens added (Qwen3 adds none).
            let ids = self.tokenizer.encode(&s, SpecialTokens::Add).context("tokenizing a chunk")?;
            self.cache.insert(p, ids);
        }
        Ok(self.cache.get(&p).map_or(&[], Vec::as_slice))
    }

    /// Tokens of a prompt: its chunks' tokens, concatenated (chunks tokenize independently).
    ///
    /// # Errors
    /// The tokenizer fails.
    pub fn prompt(&mut self, pieces: &[Piece]) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(pieces.len() * 64);
        for p in pieces {
            out.extend_from_slice(self.piece(*p)?);
        }
        Ok(out)
    }
}

/// Chained page keys of `tokens` (full pages only).
fn page_chain<T: Hash>(tokens: &[T], page: usize) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(page)
        .map(|p| {
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            p.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

/// Analyses `workload` with `page`-token pages.
///
/// # Errors
/// The tokenizer fails.
pub fn analyse(workload: &Workload, tokenizer: &TextTokenizer, page: usize) -> Result<Analysis> {
    let mut chunks = ChunkTokens::new(tokenizer);
    let mut seen_pages: HashSet<u64> = HashSet::new();
    let mut seen_blocks: HashSet<u64> = HashSet::new();
    let (mut block_hits, mut blocks) = (0u64, 0u64);
    let mut out = Analysis {
        prompt_tokens: Vec::with_capacity(workload.requests.len()),
        bound_hits: Vec::with_capacity(workload.requests.len()),
        unique_pages: 0,
        max_prompt_pages: 0,
        block_bound: 0.0,
        chains: Vec::with_capacity(workload.requests.len()),
    };
    for r in &workload.requests {
        let tokens = chunks.prompt(&r.pieces)?;
        let chain = page_chain(&tokens, page);
        let usable = tokens.len().saturating_sub(1) / page;
        let hit = chain[..usable].iter().take_while(|k| seen_pages.contains(k)).count();
        out.prompt_tokens.push(tokens.len() as u64);
        out.bound_hits.push((hit * page) as u64);
        out.max_prompt_pages = out.max_prompt_pages.max(tokens.len().div_ceil(page) as u64);
        seen_pages.extend(chain.iter().copied());
        out.chains.push(chain);
        // Trace blocks: a block is a hit when the whole prefix up to it was seen before (chained
        // like pages, so a prefix is one key).
        let ids: Vec<u64> = r.pieces.iter().map(|p| p.id).collect();
        let prefixes = page_chain(&ids, 1);
        blocks += ids.len() as u64;
        block_hits += prefixes.iter().take_while(|k| seen_blocks.contains(k)).count() as u64;
        seen_blocks.extend(prefixes);
    }
    out.unique_pages = seen_pages.len() as u64;
    out.block_bound = ratio(block_hits, blocks);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::workload::{Kind, Request};
    use std::time::Duration;

    fn tokenizer() -> TextTokenizer {
        TextTokenizer::from_file(crate::workspace_root().join("golden/models/qwen3/tokenizer.json")).unwrap()
    }

    #[test]
    fn chunk_tokenization_does_not_depend_on_neighbours() {
        let tok = tokenizer();
        let mut chunks = ChunkTokens::new(&tok);
        // Full chunks, partial chunks of every length, in many orders.
        let mut pieces: Vec<Piece> = (0..40).map(|id| Piece { id, tokens: 64 }).collect();
        pieces.extend((2..=64).map(|t| Piece { id: 1000 + u64::from(t), tokens: t }));
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!(chunks.piece(*p).unwrap().len(), p.tokens as usize, "piece {i} {p:?}");
        }
        for stride in [1usize, 3, 7, 11] {
            let order: Vec<Piece> = (0..pieces.len()).map(|i| pieces[(i * stride) % pieces.len()]).collect();
            let whole = tok.encode(&super::super::text::prompt(&order), SpecialTokens::Add).unwrap();
            assert_eq!(whole, chunks.prompt(&order).unwrap(), "stride {stride}");
        }
    }

    #[test]
    fn every_vocabulary_word_is_one_token() {
        let tok = tokenizer();
        for w in super::super::text::VOCABULARY {
            let ids = tok.encode(&format!(" {w}"), SpecialTokens::Add).unwrap();
            assert_eq!(ids.len(), 1, "` {w}` is {ids:?}");
        }
    }

    #[test]
    fn the_bound_counts_whole_pages_and_never_the_last_token() {
        let tok = tokenizer();
        let req = |ids: &[u64]| Request {
            at: Duration::ZERO,
            pieces: ids.iter().map(|&id| Piece { id, tokens: 64 }).collect(),
            max_tokens: 1,
        };
        let w = Workload {
            kind: Kind::SharedPrefix,
            description: String::new(),
            requests: vec![req(&[1, 2]), req(&[1, 2]), req(&[1, 3, 4])],
        };
        let a = analyse(&w, &tok, 16).unwrap();
        assert_eq!(a.prompt_tokens, vec![128, 128, 192]);
        // The repeat hits everything but its last page (the last token is recomputed).
        assert_eq!(a.bound_hits, vec![0, 112, 64]);
        assert_eq!(a.unique_pages, 8 + 8);
        assert_eq!(a.max_prompt_pages, 12);
        // Blocks: 2 + 3 hit of 2 + 2 + 3.
        assert!((a.block_bound - 3.0 / 7.0).abs() < 1e-9);
        // An LRU that holds the whole workload reaches the bound; an empty one serves nothing.
        assert!((a.lru_share(1000, 16) - a.token_bound()).abs() < 1e-9);
        assert_eq!(a.lru_share(0, 16), 0.0);
        let tight = a.lru_share(8, 16);
        assert!(tight > 0.0 && tight <= a.token_bound(), "{tight}");
    }
}
