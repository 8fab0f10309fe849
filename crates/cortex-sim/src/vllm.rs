//! vLLM's paged KV cache with prefix caching: a port of `vllm/v1/core/block_pool.py` (0.33) and
//! of the parts of `KVCacheManager` that decide what is cached and announced, for one
//! full-attention KV-cache group.
//!
//! What is faithful, because a gateway's ledger depends on it:
//! - the free queue is vLLM's LRU doubly linked list: blocks come from its head, freed blocks go
//!   to its tail *in reverse block order* (a request's tail blocks are evicted first), and an
//!   evictable cached block that is hit again is taken out of the queue (`touch`);
//! - `BlockStored` is emitted when blocks become full at allocation time (prompt or decode), one
//!   event per request and step, parent = the request's previous block hash; prefix-cache hits
//!   are not re-announced;
//! - physical blocks are not deduplicated: the same hash may be cached in several blocks (an
//!   identical block-aligned prompt recomputes its last block), each copy announced and each
//!   eviction announced (one `BlockRemoved` per evicted block);
//! - the last prompt token is never a cache hit (`max_cache_hit_length = num_tokens - 1`);
//! - `AllBlocksCleared` only on a successful reset, which fails while any block is in use;
//! - one null block (block 0) is taken at start, so `num_gpu_blocks` includes it.
//!
//! Hashes come from `cortex-hash`'s vLLM recipe (pickle or CBOR, SHA-256 or xxh3, tagged extra
//! keys from 0.31), so they equal what the real engine publishes for the same tokens.

use std::collections::HashMap;
use std::sync::Arc;

use cortex_hash::kv::EngineHash;
use cortex_hash::vllm::{BlockHasher, ExtraKeyForm, Lora, RequestExtras, VllmDigest, digest};

use crate::config::{LoraAdapter, VllmOptions};
use crate::truth::HeldBlock;

/// A physical block's index in the pool (block 0 is the null block).
pub type BlockId = u32;

const NONE: u32 = u32::MAX;

/// What a request contributes to its blocks' identity and events.
#[derive(Clone, Debug, Default)]
pub struct RequestKeys {
    /// The LoRA adapter (hashed as `("lora", name, path)` from 0.31; `lora_id`/`lora_name` events).
    pub lora: Option<Arc<LoraAdapter>>,
    /// `cache_salt` (hashed into block 0 only).
    pub cache_salt: Option<Arc<str>>,
    /// `session_id` (published from 0.30).
    pub session_id: Option<Arc<str>>,
}

/// The request-side state the block pool reads: all token ids and the chain of full-block
/// digests (vLLM's `Request.all_token_ids` and `Request.block_hashes`).
#[derive(Clone, Debug)]
pub struct BlockRequest {
    tokens: Vec<u32>,
    hashes: Vec<VllmDigest>,
    keys: RequestKeys,
}

impl BlockRequest {
    /// All token ids (prompt and generated).
    #[must_use]
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Digests of every full block so far.
    #[must_use]
    pub fn block_hashes(&self) -> &[VllmDigest] {
        &self.hashes
    }

    /// The request's keys.
    #[must_use]
    pub fn keys(&self) -> &RequestKeys {
        &self.keys
    }
}

/// One event as the pool records it (converted to the release's wire format when published).
#[derive(Clone, Debug, PartialEq)]
pub enum PoolEvent {
    /// `BlockStored`.
    Stored(StoredBlocks),
    /// `BlockRemoved` of one block.
    Removed(VllmDigest),
    /// `AllBlocksCleared`.
    Cleared,
}

/// A `BlockStored`: the newly full blocks of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredBlocks {
    /// Digests of the stored blocks.
    pub hashes: Vec<VllmDigest>,
    /// Digest of the request's previous block, `None` for block 0.
    pub parent: Option<VllmDigest>,
    /// The blocks' tokens, concatenated.
    pub tokens: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// `lora_id`.
    pub lora_id: Option<i64>,
    /// `lora_name`.
    pub lora_name: Option<Arc<str>>,
    /// Per block, the event form of its extra keys (LoRA name, then the salt on block 0).
    pub extra_keys: Vec<Option<Vec<Arc<str>>>>,
    /// `session_id`.
    pub session_id: Option<Arc<str>>,
}

#[derive(Clone, Debug)]
struct Cached {
    hash: VllmDigest,
    parent: Option<VllmDigest>,
    tokens: Vec<u32>,
    lora_name: Option<Arc<str>>,
    cache_salt: Option<Arc<str>>,
}

#[derive(Clone, Debug)]
struct Block {
    ref_cnt: u32,
    cached: Option<Cached>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// vLLM's `BlockPool` for one KV-cache group: blocks, the LRU free queue, the hash → blocks map
/// and the event queue.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    hasher: BlockHasher,
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<VllmDigest, Vec<BlockId>>,
    events: Vec<PoolEvent>,
}

/// Why an allocation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not enough free blocks: need {needed}, have {free}")]
pub struct NoFreeBlocks {
    /// Blocks asked for.
    pub needed: usize,
    /// Blocks free (including evictable cached ones).
    pub free: usize,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (block 0 becomes the null block) hashing with vLLM
    /// `opts`' recipe.
    ///
    /// # Panics
    /// If `num_gpu_blocks` is 0 or does not fit in a `u32`, or `block_size` is 0.
    #[must_use]
    pub fn new(num_gpu_blocks: usize, block_size: usize, opts: &VllmOptions) -> Self {
        assert!(num_gpu_blocks > 0 && block_size > 0, "a pool needs blocks of a positive size");
        let n = u32::try_from(num_gpu_blocks).expect("num_gpu_blocks fits in u32");
        let form = if opts.version >= cortex_events_vllm::Version::new(0, 31, 0) {
            ExtraKeyForm::Tagged
        } else {
            ExtraKeyForm::Untagged
        };
        let hasher = BlockHasher::new(opts.hash_algo, &opts.none_hash_seed, form);
        let blocks = (0..n)
            .map(|i| Block {
                ref_cnt: 0,
                cached: None,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                in_free: true,
            })
            .collect();
        let mut pool = BlockPool {
            block_size,
            hasher,
            blocks,
            head: 0,
            tail: n - 1,
            num_free: num_gpu_blocks,
            cached: HashMap::new(),
            events: Vec::new(),
        };
        // The null block: popped at start and never returned (`self.null_block = popleft()`).
        let null = pool.popleft();
        pool.blocks[null as usize].ref_cnt = 1;
        pool
    }

    /// Tokens per block.
    #[must_use]
    pub const fn block_size(&self) -> usize {
        self.block_size
    }

    /// `num_gpu_blocks`, null block included.
    #[must_use]
    pub fn num_gpu_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks, including evictable cached blocks.
    #[must_use]
    pub const fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// `kv_cache_usage_perc`: `1 - free / (num_gpu_blocks - 1)`.
    #[must_use]
    pub fn usage(&self) -> f64 {
        let total = self.blocks.len() - 1;
        if total == 0 { 0.0 } else { 1.0 - self.num_free as f64 / total as f64 }
    }

    /// A request's hashing state for `tokens` (full blocks hashed now, later ones on
    /// [`BlockPool::append_tokens`]).
    #[must_use]
    pub fn request(&self, tokens: Vec<u32>, keys: RequestKeys) -> BlockRequest {
        let mut r = BlockRequest { tokens: Vec::new(), hashes: Vec::new(), keys };
        self.append_tokens(&mut r, &tokens);
        r
    }

    /// Appends generated tokens to a request and hashes the blocks they complete.
    pub fn append_tokens(&self, req: &mut BlockRequest, tokens: &[u32]) {
        req.tokens.extend_from_slice(tokens);
        let lora = req.keys.lora.as_ref().map(|l| Lora { name: &l.name, path: &l.path });
        let extras = RequestExtras { lora, cache_salt: req.keys.cache_salt.as_deref() };
        while (req.hashes.len() + 1) * self.block_size <= req.tokens.len() {
            let i = req.hashes.len();
            let page = &req.tokens[i * self.block_size..(i + 1) * self.block_size];
            let parent = req.hashes.last().copied().unwrap_or(*self.hasher.none_hash());
            // The pickle encoder refuses only preimages over 64 KiB, far beyond any block size
            // a simulator is configured with; such a block is left unhashed (never cached).
            let Ok(pre) = self.hasher.preimage(&parent, page, &self.hasher.extra_keys(i, extras)) else {
                break;
            };
            req.hashes.push(digest(self.hasher.algo(), &pre));
        }
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NONE {
            self.head = next
        } else {
            self.blocks[prev as usize].next = next
        }
        if next == NONE {
            self.tail = prev
        } else {
            self.blocks[next as usize].prev = prev
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NONE;
        b.next = NONE;
        b.in_free = false;
        self.num_free -= 1;
    }

    fn popleft(&mut self) -> u32 {
        let id = self.head;
        self.unlink(id);
        id
    }

    fn append(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.prev = self.tail;
        b.next = NONE;
        b.in_free = true;
        if self.tail == NONE {
            self.head = id
        } else {
            self.blocks[self.tail as usize].next = id
        }
        self.tail = id;
        self.num_free += 1;
    }

    /// The first cached block holding `hash`, if any (`get_cached_block`).
    #[must_use]
    pub fn cached_block(&self, hash: &VllmDigest) -> Option<BlockId> {
        self.cached.get(hash).and_then(|v| v.first().copied())
    }

    /// Takes `n` blocks from the head of the free queue, evicting the cached ones (one
    /// `BlockRemoved` each), with reference count 1 (`get_new_blocks`).
    ///
    /// # Errors
    /// [`NoFreeBlocks`] if fewer than `n` blocks are free.
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, NoFreeBlocks> {
        if n > self.num_free {
            return Err(NoFreeBlocks { needed: n, free: self.num_free });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.popleft();
            self.maybe_evict(id);
            self.blocks[id as usize].ref_cnt += 1;
            out.push(id);
        }
        Ok(out)
    }

    fn maybe_evict(&mut self, id: BlockId) {
        let Some(c) = self.blocks[id as usize].cached.take() else { return };
        if let Some(list) = self.cached.get_mut(&c.hash) {
            list.retain(|&b| b != id);
            if list.is_empty() {
                self.cached.remove(&c.hash);
            }
        }
        self.events.push(PoolEvent::Removed(c.hash));
    }

    /// Adds a reference to each block, taking evictable ones out of the free queue (`touch`).
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            if self.blocks[id as usize].ref_cnt == 0 && self.blocks[id as usize].in_free {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Drops a reference from each block and appends the unreferenced ones to the free queue in
    /// the given order (`free_blocks`; callers pass a request's blocks in reverse).
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let list: Vec<BlockId> = ordered.into_iter().collect();
        for &id in &list {
            let b = &mut self.blocks[id as usize];
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
        }
        for id in list {
            if id != 0 && self.blocks[id as usize].ref_cnt == 0 && !self.blocks[id as usize].in_free {
                self.append(id);
            }
        }
    }

    /// Marks `blocks[num_cached..num_full]` as cached under the request's hashes and records one
    /// `BlockStored` (`cache_full_blocks`).
    ///
    /// # Panics
    /// If the request has fewer than `num_full` full blocks or `blocks` is shorter than that.
    pub fn cache_full_blocks(
        &mut self,
        req: &BlockRequest,
        blocks: &[BlockId],
        num_cached: usize,
        num_full: usize,
    ) {
        if num_cached >= num_full {
            return;
        }
        let bs = self.block_size;
        let lora_name: Option<Arc<str>> = req.keys.lora.as_ref().map(|l| Arc::from(l.name.as_str()));
        let mut hashes = Vec::with_capacity(num_full - num_cached);
        let mut extra_keys = Vec::with_capacity(num_full - num_cached);
        for (i, &id) in blocks.iter().enumerate().take(num_full).skip(num_cached) {
            let hash = req.hashes[i];
            let parent = if i == 0 { None } else { Some(req.hashes[i - 1]) };
            if id != 0 {
                self.blocks[id as usize].cached = Some(Cached {
                    hash,
                    parent,
                    tokens: req.tokens[i * bs..(i + 1) * bs].to_vec(),
                    lora_name: lora_name.clone(),
                    cache_salt: req.keys.cache_salt.clone(),
                });
                self.cached.entry(hash).or_default().push(id);
                hashes.push(hash);
            }
            let mut keys: Vec<Arc<str>> = Vec::new();
            if let Some(n) = &lora_name {
                keys.push(Arc::clone(n));
            }
            if i == 0
                && let Some(s) = &req.keys.cache_salt
            {
                keys.push(Arc::clone(s));
            }
            extra_keys.push(if keys.is_empty() { None } else { Some(keys) });
        }
        self.events.push(PoolEvent::Stored(StoredBlocks {
            hashes,
            parent: if num_cached == 0 { None } else { Some(req.hashes[num_cached - 1]) },
            tokens: req.tokens[num_cached * bs..num_full * bs].to_vec(),
            block_size: bs,
            lora_id: req.keys.lora.as_ref().map(|l| l.id),
            lora_name,
            extra_keys,
            session_id: req.keys.session_id.clone(),
        }));
    }

    /// Drops every cached hash if no block is in use and records `AllBlocksCleared`
    /// (`reset_prefix_cache`); returns false (and changes nothing) while blocks are in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.blocks.len() - self.num_free != 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.cached = None;
        }
        self.events.push(PoolEvent::Cleared);
        true
    }

    /// Drains the recorded events (`take_events`).
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached physical block (duplicates included), in block order.
    #[must_use]
    pub fn held_blocks(&self, int_hashes: bool) -> Vec<HeldBlock> {
        let eh = |d: &VllmDigest| EngineHash::from_digest(d.as_bytes());
        self.blocks
            .iter()
            .filter_map(|b| {
                let c = b.cached.as_ref()?;
                Some(HeldBlock {
                    hash: eh(&c.hash),
                    digest: if int_hashes { None } else { Some(c.hash.as_bytes().to_vec()) },
                    parent: c.parent.as_ref().map(eh),
                    tokens: c.tokens.clone(),
                    in_use: b.ref_cnt > 0,
                    lora_name: c.lora_name.as_deref().map(str::to_owned),
                    cache_salt: c.cache_salt.as_deref().map(str::to_owned),
                })
            })
            .collect()
    }
}

/// A request's block table (`SingleTypeKVCacheManager.req_to_blocks`, `num_cached_block`).
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockTable {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) num_cached: usize,
}

/// The request-level manager the scheduler drives (`KVCacheManager` for one group).
#[derive(Debug)]
pub(crate) struct KvManager {
    pub(crate) pool: BlockPool,
    tables: HashMap<u64, BlockTable>,
}

impl KvManager {
    pub(crate) fn new(pool: BlockPool) -> Self {
        KvManager { pool, tables: HashMap::new() }
    }

    /// The longest cached prefix of a new request, never its last token
    /// (`get_computed_blocks`): the hit blocks.
    pub(crate) fn computed_blocks(&self, req: &BlockRequest) -> Vec<BlockId> {
        let max_len = req.tokens.len().saturating_sub(1);
        let max_blocks = max_len / self.pool.block_size;
        req.hashes.iter().take(max_blocks).map_while(|h| self.pool.cached_block(h)).collect()
    }

    /// Allocates slots for `num_new` more tokens after `num_computed` (plus `hits`, the newly
    /// computed prefix blocks of a request being admitted) and caches the blocks that become
    /// full (`allocate_slots` + `cache_blocks`). With `cache` false the blocks are allocated but
    /// not cached (a PD decode worker caches them when the KV lands). False if there is no room.
    pub(crate) fn allocate(
        &mut self,
        id: u64,
        req: &BlockRequest,
        num_computed: usize,
        num_new: usize,
        hits: &[BlockId],
        cache: bool,
    ) -> bool {
        let bs = self.pool.block_size;
        let computed = num_computed + hits.len() * bs;
        let need_tokens = computed + num_new;
        let have = self.tables.get(&id).map_or(0, |t| t.blocks.len());
        let needed = need_tokens.div_ceil(bs).saturating_sub(have + hits.len());
        let evictable_hits = hits.iter().filter(|&&b| self.pool.blocks[b as usize].ref_cnt == 0).count();
        if needed + evictable_hits > self.pool.num_free {
            return false;
        }
        self.pool.touch(hits);
        let table = self.tables.entry(id).or_default();
        if !hits.is_empty() {
            table.blocks.extend_from_slice(hits);
            table.num_cached = table.blocks.len();
        }
        let Ok(new) = self.pool.get_new_blocks(needed) else { return false };
        let table = self.tables.entry(id).or_default();
        table.blocks.extend(new);
        if cache {
            self.cache_blocks(id, req, computed + num_new);
        }
        true
    }

    /// Caches the request's full blocks up to `num_tokens` (`cache_blocks`).
    pub(crate) fn cache_blocks(&mut self, id: u64, req: &BlockRequest, num_tokens: usize) {
        let Some(table) = self.tables.get_mut(&id) else { return };
        let num_full = (num_tokens.min(req.tokens.len()) / self.pool.block_size)
            .min(req.hashes.len())
            .min(table.blocks.len());
        if num_full > table.num_cached {
            let blocks = table.blocks.clone();
            let from = table.num_cached;
            table.num_cached = num_full;
            self.pool.cache_full_blocks(req, &blocks, from, num_full);
        }
    }

    /// Frees a request's blocks, tail first (`free`).
    pub(crate) fn free(&mut self, id: u64) {
        if let Some(t) = self.tables.remove(&id) {
            self.pool.free_blocks(t.blocks.into_iter().rev());
        }
    }

    /// Takes a request's block table out (a PD prefill keeps its blocks leased after finishing).
    pub(crate) fn detach(&mut self, id: u64) -> Option<BlockTable> {
        self.tables.remove(&id)
    }

    /// Frees a detached table, tail first.
    pub(crate) fn free_table(&mut self, t: BlockTable) {
        self.pool.free_blocks(t.blocks.into_iter().rev());
    }

    /// Block ids of a request.
    pub(crate) fn block_ids(&self, id: u64) -> Vec<BlockId> {
        self.tables.get(&id).map(|t| t.blocks.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(n, 16, &VllmOptions::default())
    }

    #[test]
    fn hashes_match_the_golden_vectors() {
        let p = pool(8);
        let r = p.request((1..=48).collect(), RequestKeys::default());
        let wire: Vec<u64> = r.block_hashes().iter().map(VllmDigest::wire_u64).collect();
        assert_eq!(wire, [1403909460543360175, 1643945449041937783, 17267691262617277681]);
        let mut r = p.request((1..=40).collect(), RequestKeys::default());
        assert_eq!(r.block_hashes().len(), 2);
        p.append_tokens(&mut r, &(41..=48).collect::<Vec<_>>());
        assert_eq!(r.block_hashes()[2].wire_u64(), 17267691262617277681);
    }

    #[test]
    fn freed_blocks_are_evicted_tail_first_and_hits_leave_the_free_queue() {
        let mut p = pool(6);
        assert_eq!(p.num_free_blocks(), 5);
        let r = p.request((1..=48).collect(), RequestKeys::default());
        let b = p.get_new_blocks(3).unwrap();
        p.cache_full_blocks(&r, &b, 0, 3);
        p.free_blocks(b.iter().rev().copied());
        assert_eq!(p.num_free_blocks(), 5);
        // Hit the first block again: it leaves the free queue.
        let hit = p.cached_block(&r.block_hashes()[0]).unwrap();
        p.touch(&[hit]);
        assert_eq!(p.num_free_blocks(), 4);
        p.take_events();
        // Two unused blocks first, then the cached tail blocks (3rd, then 2nd).
        let _ = p.get_new_blocks(4).unwrap();
        let removed: Vec<u64> = p
            .take_events()
            .into_iter()
            .filter_map(|e| if let PoolEvent::Removed(h) = e { Some(h.wire_u64()) } else { None })
            .collect();
        assert_eq!(removed, [17267691262617277681, 1643945449041937783]);
        assert!(!p.reset_prefix_cache(), "blocks in use block a reset");
    }

    #[test]
    fn the_last_token_is_never_a_hit_and_duplicates_are_announced() {
        let mut m = KvManager::new(pool(16));
        let r1 = m.pool.request((1..=32).collect(), RequestKeys::default());
        assert!(m.allocate(1, &r1, 0, 32, &[], true));
        m.free(1);
        let r2 = m.pool.request((1..=32).collect(), RequestKeys::default());
        let hits = m.computed_blocks(&r2);
        assert_eq!(hits.len(), 1, "a block-aligned prompt recomputes its last block");
        m.pool.take_events();
        assert!(m.allocate(2, &r2, 0, 16, &hits, true));
        let ev = m.pool.take_events();
        assert!(matches!(&ev[..], [PoolEvent::Stored(s)] if s.hashes == vec![r2.block_hashes()[1]]
            && s.parent == Some(r2.block_hashes()[0])));
        let held = m.pool.held_blocks(true);
        assert_eq!(
            held.iter()
                .filter(|b| b.hash == EngineHash::from_digest(r2.block_hashes()[1].as_bytes()))
                .count(),
            2
        );
    }
}
