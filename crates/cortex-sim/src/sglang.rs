//! SGLang's radix cache with KV events: the behaviour of 0.5.23's default tree
//! (`UnifiedRadixCache` with the Rust TreeCore) as far as a gateway can observe it.
//!
//! What is faithful:
//! - keys are page-aligned (a partial last page is never inserted unless `page_size == 1`),
//!   children are keyed by their first page within a namespace (`extra_key`, `cache_salt`), and a
//!   partial match splits a node at a page boundary (a split emits nothing);
//! - only the new suffix node of an insert is announced: one `BlockStored` per node, parent = the
//!   last page hash of the parent node (none at the root); consecutive stores that chain with the
//!   same attributes are coalesced into one event, as `KVCacheEventRecorder` does;
//! - eviction pops unlocked leaves in LRU order (a parent becomes a candidate once it is an
//!   unlocked leaf) until enough tokens are freed; removals are coalesced like the Rust TreeCore
//!   does: a new `BlockRemoved` starts whenever the `extra_key` changes;
//! - hashes are the SHA-256 page chain of `cortex-hash` (salt-seeded chain, `default` / `dynamo`
//!   namespacing, wide pages, EAGLE bigram pages);
//! - `reset()` records `AllBlocksCleared` (at start-up and on `/flush_cache`).
//!
//! Access times are a logical counter rather than `time.monotonic()`, so eviction order is
//! deterministic.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use cortex_hash::kv::EngineHash;
use cortex_hash::sglang::{
    EventFormat, PageDigest, chain_digests, namespace_seed, namespaced_block_hash, published_hash, salt_seed,
};

use crate::truth::HeldBlock;

/// A node of the tree.
pub type NodeId = u32;

const ROOT: NodeId = 0;

/// What identifies an insert or a lookup: the tokens and their namespace, plus the attributes an
/// insert publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RadixKey {
    /// Raw token ids (for bigram caches, `n` tokens make `n - 1` units).
    pub tokens: Vec<u32>,
    /// The request's `extra_key` (for LoRA: user extra key or "" followed by the adapter id).
    pub extra_key: Option<String>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// The request's session id (published on stores).
    pub session_id: Option<String>,
    /// The adapter's name if it is registered in `KvEventLoraNames` (published, and in the
    /// `default` format it namespaces the hashes).
    pub lora_name: Option<String>,
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq)]
pub enum RadixEvent {
    /// `BlockStored` (possibly coalesced over several nodes).
    Stored(RadixStored),
    /// `BlockRemoved` (possibly coalesced).
    Removed {
        /// The removed pages' hashes.
        hashes: Vec<i64>,
        /// The `extra_key` of the removed nodes (the Rust TreeCore coalesces per key).
        extra_key: Option<Arc<str>>,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// A `BlockStored`.
#[derive(Clone, Debug, PartialEq)]
pub struct RadixStored {
    /// Published page hashes.
    pub hashes: Vec<i64>,
    /// Hash of the page before the first one.
    pub parent: Option<i64>,
    /// The pages' units: token ids, or for bigram caches `(a << 32) | b` pairs.
    pub units: Vec<u64>,
    /// Whether `units` are bigram pairs.
    pub bigram: bool,
    /// Units per page.
    pub block_size: usize,
    /// `cache_salt`.
    pub cache_salt: Option<Arc<str>>,
    /// `session_id`.
    pub session_id: Option<Arc<str>>,
    /// `lora_name`.
    pub lora_name: Option<Arc<str>>,
}

#[derive(Debug, PartialEq, Eq, Hash, Clone)]
struct ChildKey {
    extra_key: Option<Arc<str>>,
    cache_salt: Option<Arc<str>>,
    first: Vec<u64>,
}

#[derive(Debug)]
struct Ns {
    extra_key: Option<Arc<str>>,
    cache_salt: Option<Arc<str>>,
    lora_name: Option<Arc<str>>,
    /// Chain seed of page 0 (salt).
    prior: Option<PageDigest>,
    /// Namespacing seed of published hashes.
    seed: Option<PageDigest>,
}

#[derive(Debug)]
struct Node {
    parent: NodeId,
    children: HashMap<ChildKey, NodeId>,
    units: Vec<u64>,
    digests: Vec<PageDigest>,
    hashes: Vec<i64>,
    lock_ref: u32,
    last_access: u64,
    ns: Arc<Ns>,
}

/// SGLang's radix cache for one rank.
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    bigram: bool,
    format: EventFormat,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    tick: u64,
    total_units: usize,
    evictable_units: usize,
    events: Vec<RadixEvent>,
}

/// Where a lookup or insert ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Match {
    /// Units of the key found in the tree (page-aligned).
    pub len: usize,
    /// The deepest node of the matched path (the root if nothing matched).
    pub node: NodeId,
}

impl RadixCache {
    /// An empty tree with pages of `page_size` units. Like SGLang's cache `__init__`, it calls
    /// [`RadixCache::reset`], which records `AllBlocksCleared`.
    ///
    /// # Panics
    /// If `page_size` is 0.
    #[must_use]
    pub fn new(page_size: usize, bigram: bool, format: EventFormat) -> Self {
        assert!(page_size > 0, "page size must be positive");
        let mut c = RadixCache {
            page_size,
            bigram,
            format,
            nodes: Vec::new(),
            free_ids: Vec::new(),
            tick: 0,
            total_units: 0,
            evictable_units: 0,
            events: Vec::new(),
        };
        c.reset();
        c
    }

    /// Units per page.
    #[must_use]
    pub const fn page_size(&self) -> usize {
        self.page_size
    }

    /// Units held in the tree.
    #[must_use]
    pub const fn total_units(&self) -> usize {
        self.total_units
    }

    /// Units held by unlocked nodes.
    #[must_use]
    pub const fn evictable_units(&self) -> usize {
        self.evictable_units
    }

    /// Drops everything and records `AllBlocksCleared`.
    pub fn reset(&mut self) {
        let ns = Arc::new(Ns { extra_key: None, cache_salt: None, lora_name: None, prior: None, seed: None });
        self.nodes = vec![Some(Node {
            parent: ROOT,
            children: HashMap::new(),
            units: Vec::new(),
            digests: Vec::new(),
            hashes: Vec::new(),
            lock_ref: 1,
            last_access: 0,
            ns,
        })];
        self.free_ids.clear();
        self.total_units = 0;
        self.evictable_units = 0;
        self.events.push(RadixEvent::Cleared);
    }

    /// Drains the recorded events (`take_events`).
    pub fn take_events(&mut self) -> Vec<RadixEvent> {
        std::mem::take(&mut self.events)
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }

    fn units_of(&self, tokens: &[u32]) -> Vec<u64> {
        if self.bigram {
            tokens.windows(2).map(|w| (u64::from(w[0]) << 32) | u64::from(w[1])).collect()
        } else {
            tokens.iter().map(|&t| u64::from(t)).collect()
        }
    }

    fn aligned(&self, n: usize) -> usize {
        if self.page_size == 1 { n } else { n - n % self.page_size }
    }

    fn ns_for(&self, key: &RadixKey) -> Arc<Ns> {
        let extra_key: Option<Arc<str>> = key.extra_key.as_deref().map(Arc::from);
        let cache_salt: Option<Arc<str>> = key.cache_salt.as_deref().map(Arc::from);
        let seed = match self.format {
            EventFormat::Default if key.lora_name.is_some() => namespace_seed(key.extra_key.as_deref(), None),
            EventFormat::Default => None,
            EventFormat::Dynamo => namespace_seed(key.extra_key.as_deref(), key.cache_salt.as_deref()),
        };
        Arc::new(Ns {
            extra_key,
            cache_salt,
            lora_name: key.lora_name.as_deref().map(Arc::from),
            prior: key.cache_salt.as_deref().map(salt_seed),
            seed,
        })
    }

    fn child_key(ns: &Ns, units: &[u64], page: usize) -> ChildKey {
        ChildKey {
            extra_key: ns.extra_key.clone(),
            cache_salt: ns.cache_salt.clone(),
            first: units[..page.min(units.len())].to_vec(),
        }
    }

    fn common_prefix(&self, a: &[u64], b: &[u64]) -> usize {
        let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        self.aligned(n)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Splits `child` after `len` units: a new node takes the prefix (and a fresh access time),
    /// `child` keeps the rest. Emits nothing.
    fn split(&mut self, child: NodeId, len: usize) -> NodeId {
        let page = self.page_size;
        let tick = self.next_tick();
        let (parent, lock_ref, ns, units, digests, hashes) = {
            let c = self.node_mut(child);
            let units: Vec<u64> = c.units.drain(..len).collect();
            let digests: Vec<PageDigest> = c.digests.drain(..len / page).collect();
            let hashes: Vec<i64> = c.hashes.drain(..len / page).collect();
            (c.parent, c.lock_ref, Arc::clone(&c.ns), units, digests, hashes)
        };
        let old_key = Self::child_key(&ns, &units, page);
        let rest_key = Self::child_key(&ns, &self.node(child).units, page);
        let new = self.alloc(Node {
            parent,
            children: HashMap::from([(rest_key, child)]),
            units,
            digests,
            hashes,
            lock_ref,
            last_access: tick,
            ns,
        });
        self.node_mut(child).parent = new;
        self.node_mut(parent).children.insert(old_key, new);
        new
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        if let Some(id) = self.free_ids.pop() {
            self.nodes[id as usize] = Some(node);
            id
        } else {
            self.nodes.push(Some(node));
            NodeId::try_from(self.nodes.len() - 1).expect("fewer than 2^32 nodes")
        }
    }

    /// The longest cached page-aligned prefix of `key`, splitting a node where the match ends
    /// inside it and refreshing the access time of every node on the path (`match_prefix`).
    pub fn match_prefix(&mut self, key: &RadixKey) -> Match {
        let ns = self.ns_for(key);
        let units = self.units_of(&key.tokens);
        let units = &units[..self.aligned(units.len())];
        let mut node = ROOT;
        let mut pos = 0;
        while pos < units.len() {
            let ck = Self::child_key(&ns, &units[pos..], self.page_size);
            let Some(&child) = self.node(node).children.get(&ck) else { break };
            let tick = self.next_tick();
            self.node_mut(child).last_access = tick;
            let plen = self.common_prefix(&self.node(child).units, &units[pos..]);
            pos += plen;
            if plen < self.node(child).units.len() {
                node = self.split(child, plen);
                break;
            }
            node = child;
        }
        Match { len: pos, node }
    }

    /// Inserts the page-aligned part of `key`; only the new suffix node is announced
    /// (`insert`). Returns how much was already present and the node the key ends at.
    pub fn insert(&mut self, key: &RadixKey) -> Match {
        let ns = self.ns_for(key);
        let all = self.units_of(&key.tokens);
        let units = &all[..self.aligned(all.len())];
        let page = self.page_size;
        let mut node = ROOT;
        let mut pos = 0;
        while pos < units.len() {
            let ck = Self::child_key(&ns, &units[pos..], page);
            let Some(&child) = self.node(node).children.get(&ck) else { break };
            let tick = self.next_tick();
            self.node_mut(child).last_access = tick;
            let plen = self.common_prefix(&self.node(child).units, &units[pos..]);
            pos += plen;
            node = if plen < self.node(child).units.len() { self.split(child, plen) } else { child };
        }
        let present = pos;
        if pos < units.len() {
            let new_units = units[pos..].to_vec();
            let (prior, parent_hash) = if node == ROOT {
                (ns.prior, None)
            } else {
                let p = self.node(node);
                (p.digests.last().copied(), p.hashes.last().copied())
            };
            // Raw tokens of the new pages: for bigram units, the window one token wider.
            let raw: Vec<u32> = if self.bigram {
                let mut r: Vec<u32> = Vec::with_capacity(new_units.len() + 1);
                r.push((new_units[0] >> 32) as u32);
                r.extend(new_units.iter().map(|u| (*u & 0xffff_ffff) as u32));
                r
            } else {
                new_units.iter().map(|&u| u as u32).collect()
            };
            let digests = chain_digests(&raw, page, prior.as_ref(), self.bigram).unwrap_or_default();
            let hashes: Vec<i64> = digests
                .iter()
                .map(|d| {
                    let h = published_hash(d);
                    ns.seed.as_ref().map_or(h, |s| namespaced_block_hash(h, s))
                })
                .collect();
            let tick = self.next_tick();
            let ck = Self::child_key(&ns, &new_units, page);
            let n = new_units.len();
            let leaf = self.alloc(Node {
                parent: node,
                children: HashMap::new(),
                units: new_units.clone(),
                digests,
                hashes: hashes.clone(),
                lock_ref: 0,
                last_access: tick,
                ns: Arc::clone(&ns),
            });
            self.node_mut(node).children.insert(ck, leaf);
            self.total_units += n;
            self.evictable_units += n;
            self.record_store(RadixStored {
                hashes,
                parent: parent_hash,
                units: new_units,
                bigram: self.bigram,
                block_size: page,
                cache_salt: ns.cache_salt.clone(),
                session_id: key.session_id.as_deref().map(Arc::from),
                lora_name: ns.lora_name.clone(),
            });
            node = leaf;
        }
        Match { len: present, node }
    }

    fn record_store(&mut self, s: RadixStored) {
        if let Some(RadixEvent::Stored(tail)) = self.events.last_mut() {
            let chains = s.parent.is_some() && tail.hashes.last().copied() == s.parent;
            if chains
                && tail.bigram == s.bigram
                && tail.block_size == s.block_size
                && tail.cache_salt == s.cache_salt
                && tail.session_id == s.session_id
                && tail.lora_name == s.lora_name
            {
                tail.hashes.extend(s.hashes);
                tail.units.extend(s.units);
                return;
            }
        }
        self.events.push(RadixEvent::Stored(s));
    }

    fn record_remove(&mut self, hashes: Vec<i64>, extra_key: Option<Arc<str>>) {
        if let Some(RadixEvent::Removed { hashes: tail, extra_key: k }) = self.events.last_mut()
            && *k == extra_key
        {
            tail.extend(hashes);
            return;
        }
        self.events.push(RadixEvent::Removed { hashes, extra_key });
    }

    /// Locks the path from `node` to the root against eviction (`inc_lock_ref`).
    pub fn inc_lock_ref(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = self.node_mut(node);
            if n.lock_ref == 0 {
                let len = n.units.len();
                self.evictable_units -= len;
            }
            let n = self.node_mut(node);
            n.lock_ref += 1;
            node = n.parent;
        }
    }

    /// Undoes [`RadixCache::inc_lock_ref`] (`dec_lock_ref`).
    pub fn dec_lock_ref(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = self.node_mut(node);
            n.lock_ref = n.lock_ref.saturating_sub(1);
            let (now_free, len, parent) = (n.lock_ref == 0, n.units.len(), n.parent);
            if now_free {
                self.evictable_units += len;
            }
            node = parent;
        }
    }

    /// Evicts unlocked leaves in LRU order until at least `num_units` are freed (or nothing is
    /// left to evict); returns the units freed (`evict`).
    pub fn evict(&mut self, num_units: usize) -> usize {
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let n = n.as_ref()?;
                (i != ROOT as usize && n.children.is_empty()).then_some(Reverse((n.last_access, i as NodeId)))
            })
            .collect();
        let mut freed = 0;
        while freed < num_units {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            if self.node(id).lock_ref > 0 {
                continue;
            }
            let Some(node) = self.nodes[id as usize].take() else { continue };
            self.free_ids.push(id);
            freed += node.units.len();
            self.total_units -= node.units.len();
            self.evictable_units -= node.units.len();
            let ck = Self::child_key(&node.ns, &node.units, self.page_size);
            self.record_remove(node.hashes, node.ns.extra_key.clone());
            let parent = node.parent;
            self.node_mut(parent).children.remove(&ck);
            if parent != ROOT && self.node(parent).children.is_empty() && self.node(parent).lock_ref == 0 {
                heap.push(Reverse((self.node(parent).last_access, parent)));
            }
        }
        freed
    }

    /// Every cached page, depth first.
    #[must_use]
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let n = self.node(id);
            let mut children: Vec<NodeId> = n.children.values().copied().collect();
            children.sort_unstable();
            stack.extend(children.into_iter().rev());
            if id == ROOT {
                continue;
            }
            let mut parent = if n.parent == ROOT { None } else { self.node(n.parent).hashes.last().copied() };
            for (i, &h) in n.hashes.iter().enumerate() {
                let units = &n.units[i * self.page_size..((i + 1) * self.page_size).min(n.units.len())];
                let tokens: Vec<u32> = if self.bigram {
                    let mut t = vec![(units[0] >> 32) as u32];
                    t.extend(units.iter().map(|u| (*u & 0xffff_ffff) as u32));
                    t
                } else {
                    units.iter().map(|&u| u as u32).collect()
                };
                out.push(HeldBlock {
                    hash: EngineHash::from_i64(h),
                    digest: None,
                    parent: parent.map(EngineHash::from_i64),
                    tokens,
                    in_use: n.lock_ref > 0,
                    lora_name: n.ns.lora_name.as_deref().map(str::to_owned),
                    cache_salt: n.ns.cache_salt.as_deref().map(str::to_owned),
                });
                parent = Some(h);
            }
        }
        out
    }
}

/// A running request's KV in an SGLang rank: its KV length and the tree path it has locked.
#[derive(Clone, Copy, Debug)]
struct ReqKv {
    kv_len: usize,
    tree_len: usize,
    node: NodeId,
}

/// The rank's KV pool on top of the radix cache: capacity in pages, the tree's pages and each
/// running request's private pages; allocation evicts LRU leaves when the pool is short.
#[derive(Debug)]
pub(crate) struct SglangKv {
    pub(crate) cache: RadixCache,
    capacity_pages: usize,
    reqs: HashMap<u64, ReqKv>,
    /// False on a decode worker without `--disaggregation-decode-enable-radix-cache`: nothing
    /// is matched, inserted or announced.
    pub(crate) enabled: bool,
}

impl SglangKv {
    pub(crate) fn new(cache: RadixCache, capacity_pages: usize, enabled: bool) -> Self {
        SglangKv { cache, capacity_pages, reqs: HashMap::new(), enabled }
    }

    fn pages(&self, units: usize) -> usize {
        units.div_ceil(self.cache.page_size)
    }

    fn private_pages(&self, r: &ReqKv) -> usize {
        self.pages(r.kv_len).saturating_sub(r.tree_len / self.cache.page_size)
    }

    pub(crate) fn used_pages(&self) -> usize {
        self.pages(self.cache.total_units) + self.reqs.values().map(|r| self.private_pages(r)).sum::<usize>()
    }

    pub(crate) const fn capacity_pages(&self) -> usize {
        self.capacity_pages
    }

    fn ensure_free(&mut self, pages: usize) -> bool {
        let free = self.capacity_pages.saturating_sub(self.used_pages());
        if free >= pages {
            return true;
        }
        self.cache.evict((pages - free) * self.cache.page_size);
        self.capacity_pages.saturating_sub(self.used_pages()) >= pages
    }

    /// Admits a request: matches `key` minus its last token, locks the match. Returns the cached
    /// length.
    pub(crate) fn admit(&mut self, id: u64, key: &RadixKey) -> usize {
        let (len, node) = if self.enabled && key.tokens.len() > 1 {
            let probe = RadixKey { tokens: key.tokens[..key.tokens.len() - 1].to_vec(), ..key.clone() };
            let m = self.cache.match_prefix(&probe);
            self.cache.inc_lock_ref(m.node);
            (m.len, m.node)
        } else {
            (0, ROOT)
        };
        self.reqs.insert(id, ReqKv { kv_len: len, tree_len: len, node });
        len
    }

    /// Grows a request's KV by `n` tokens, evicting if needed; false if the pool cannot hold them.
    pub(crate) fn grow(&mut self, id: u64, n: usize) -> bool {
        let Some(r) = self.reqs.get(&id).copied() else { return false };
        let extra = self.pages(r.kv_len + n) - self.pages(r.kv_len);
        if extra > 0 && !self.ensure_free(extra) {
            return false;
        }
        if let Some(r) = self.reqs.get_mut(&id) {
            r.kv_len += n;
        }
        true
    }

    /// Inserts the request's computed tokens (`cache_unfinished_req`) and moves its lock to the
    /// new end of its path.
    pub(crate) fn insert(&mut self, id: u64, key: &RadixKey) {
        if !self.enabled {
            return;
        }
        let Some(r) = self.reqs.get(&id).copied() else { return };
        let m = self.cache.insert(key);
        self.cache.inc_lock_ref(m.node);
        self.cache.dec_lock_ref(r.node);
        let tree_len = self.cache.aligned(self.cache.units_of(&key.tokens).len());
        if let Some(r) = self.reqs.get_mut(&id) {
            r.node = m.node;
            r.tree_len = tree_len;
        }
    }

    /// Releases a request; with `key`, its computed tokens are inserted first
    /// (`cache_finished_req`).
    pub(crate) fn release(&mut self, id: u64, key: Option<&RadixKey>) {
        if let Some(k) = key {
            self.insert(id, k);
        }
        if let Some(r) = self.reqs.remove(&id) {
            self.cache.dec_lock_ref(r.node);
        }
    }

    /// Pages held by unlocked tree nodes.
    pub(crate) fn evictable_pages(&self) -> usize {
        self.cache.evictable_units / self.cache.page_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tokens: impl IntoIterator<Item = u32>) -> RadixKey {
        RadixKey { tokens: tokens.into_iter().collect(), ..RadixKey::default() }
    }

    #[test]
    fn inserts_announce_only_new_pages_and_splits_are_silent() {
        let mut c = RadixCache::new(4, false, EventFormat::Default);
        assert_eq!(c.take_events(), vec![RadixEvent::Cleared]);
        c.insert(&key(1..=10)); // 8 units page-aligned
        let ev = c.take_events();
        let RadixEvent::Stored(s) = &ev[0] else { panic!("{ev:?}") };
        assert_eq!((s.hashes.len(), s.parent, s.units.len()), (2, None, 8));
        assert_eq!(s.hashes[0], -3_488_128_144_981_237_669); // golden: [1,2,3,4], page 4
        c.insert(&key([1, 2, 3, 4, 9, 9, 9, 9]));
        let ev = c.take_events();
        let RadixEvent::Stored(s2) = &ev[0] else { panic!("{ev:?}") };
        assert_eq!(s2.parent, Some(s.hashes[0]));
        assert_eq!(c.total_units(), 12);
        assert_eq!(c.held_blocks().len(), 3);
    }

    #[test]
    fn eviction_is_lru_by_leaf_and_respects_locks() {
        let mut c = RadixCache::new(4, false, EventFormat::Default);
        c.insert(&key(1..=8));
        c.insert(&key(100..=107));
        let m = c.match_prefix(&key(1..=8));
        c.inc_lock_ref(m.node);
        c.take_events();
        assert_eq!(c.evict(100), 8);
        assert!(matches!(&c.take_events()[..], [RadixEvent::Removed { hashes, .. }] if hashes.len() == 2));
        c.dec_lock_ref(m.node);
        assert_eq!(c.evictable_units(), 8);
    }
}
