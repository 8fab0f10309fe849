//! The deterministic index: the countable blocks of content-deterministic holders by (namespace,
//! engine hash), and the (namespace, parent) waits of their orphans — what lets one such holder's
//! orphan be grafted from another holder's block (orphan rule 4 in ARCHITECTURE.md).
//!
//! Key decision: only writers touch it (queries never do), so it is plain maps behind mutexes,
//! sharded 64 ways so that writers of different holders rarely meet and a growing map grows by
//! 1/64 of the index at a time. Each block entry counts the holders that have the block and
//! holds one reference to the block's run, so a location it hands out stays valid whoever drops
//! the block meanwhile. The index knows locations and holder slots, not holders: what to do with
//! a block found or a waiter woken is the writer's.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicPtr as StdAtomicPtr, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};

use crate::holder::{EngineMap, SlotValue, mix64, prefetch_home};
use crate::run::unpack;
use crate::sync::Mutex;

/// The index's key: the engine hash XOR a mix of the namespace (a bijection for each namespace;
/// two namespaces collide with probability 2^-64, like two `SeqHash`es).
fn key(ns: u64, engine: u64) -> u64 {
    engine ^ mix64(ns ^ 0x6465_7465_726d_696e)
}

/// A block of the index: its location (in halves, so that a slot is 20 bytes) and how many
/// holders have it (0 only in a vacant slot).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DetBlock {
    loc: [u32; 2],
    holders: u32,
}

impl DetBlock {
    fn loc(&self) -> u64 {
        u64::from(self.loc[0]) | (u64::from(self.loc[1]) << 32)
    }
}

impl SlotValue for DetBlock {
    const VACANT: DetBlock = DetBlock { loc: [0, 0], holders: 0 };
    fn is_vacant(&self) -> bool {
        self.holders == 0
    }
}

/// A shard's slots as last published by its lock holder (`EngineMap::home_hint`).
#[derive(Default)]
struct Hint {
    base: StdAtomicPtr<u8>,
    slots: StdAtomicUsize,
}

/// Countable blocks of deterministic holders by (namespace, engine hash), and the deterministic
/// orphans waiting on a parent nobody had yet.
pub(crate) struct DeterministicIndex {
    /// `key(ns, engine) → (location, holders)`: [`EngineMap`]s (no tombstones, so churn does
    /// not grow them), 64 shards by a mix of the key's parts.
    blocks: Box<[Mutex<EngineMap<DetBlock>>]>,
    /// Per shard, where its map's slots were when it last grew: a writer prefetches an event's
    /// home slots from it without taking the shard's lock (see [`DeterministicIndex::prefetch`]).
    hints: Box<[Hint]>,
    /// `(ns, parent engine hash) → slots of the holders with an orphan waiting on it`.
    waits: Mutex<HashMap<(u64, u64), Vec<u32>>>,
    /// How many (ns, parent) pairs are waited on: read without the lock, so that registering a
    /// block takes the waits' lock only when someone waits.
    waiting: StdAtomicUsize,
    /// Heap bytes of the block maps.
    bytes: StdAtomicUsize,
}

impl DeterministicIndex {
    /// An empty index (allocates its 64 shards' locks, not their maps).
    pub(crate) fn new() -> DeterministicIndex {
        DeterministicIndex {
            blocks: (0..64).map(|_| Mutex::new(EngineMap::with_capacity_target(usize::MAX / 8))).collect(),
            hints: (0..64).map(|_| Hint::default()).collect(),
            waits: Mutex::default(),
            waiting: StdAtomicUsize::new(0),
            bytes: StdAtomicUsize::new(0),
        }
    }

    fn shard_index(ns: u64, engine: u64) -> usize {
        (mix64(ns ^ engine.rotate_left(32)) >> 58) as usize
    }

    fn shard(&self, ns: u64, engine: u64) -> &Mutex<EngineMap<DetBlock>> {
        &self.blocks[Self::shard_index(ns, engine)]
    }

    /// Hints the CPU to fetch block `(ns, engine)`'s home slot, without the shard's lock: a
    /// writer issues it for every block of an event before applying the event, so that the
    /// misses of a large index overlap instead of stalling one after the other. (Taking each
    /// shard's lock to read its slots cost what the overlap saved.)
    #[inline]
    pub(crate) fn prefetch(&self, ns: u64, engine: u64) {
        let hint = &self.hints[Self::shard_index(ns, engine)];
        // Relaxed (both): a hint; a stale or torn pair only makes the prefetch useless.
        let (base, slots) = (hint.base.load(StdOrdering::Relaxed), hint.slots.load(StdOrdering::Relaxed));
        prefetch_home::<DetBlock>(base, slots, key(ns, engine));
    }

    /// Counts one more holder with block `(ns, engine)`, which is at `loc`. The first one takes
    /// the index's own reference to the run (the caller, whose holder has the block, holds one).
    /// Returns whether the block is new to the index.
    pub(crate) fn insert(&self, ns: u64, engine: u64, loc: u64) -> bool {
        let shard = Self::shard_index(ns, engine);
        let mut m = self.blocks[shard].lock();
        let key = key(ns, engine);
        if let Some(slot) = m.get_mut(&key) {
            slot.holders += 1;
            return false;
        }
        let before = m.heap_bytes();
        // The index's own reference (the caller's holder has the run, so it holds one).
        unpack(loc).0.acquire();
        m.insert_new(key, DetBlock { loc: [loc as u32, (loc >> 32) as u32], holders: 1 });
        let after = m.heap_bytes();
        if after != before {
            // Relaxed: a statistics counter; nothing is published through it.
            self.bytes.fetch_add(after, StdOrdering::Relaxed);
            // Relaxed: a statistics counter; nothing is published through it.
            self.bytes.fetch_sub(before, StdOrdering::Relaxed);
            // The map grew (only an insert moves its slots): publish where they are now.
            let (base, slots) = m.home_hint();
            let hint = &self.hints[shard];
            // Relaxed (both): a prefetch hint; see `prefetch`.
            hint.base.store(base.cast_mut(), StdOrdering::Relaxed);
            hint.slots.store(slots, StdOrdering::Relaxed);
        }
        true
    }

    /// Counts one holder fewer with block `(ns, engine)`. When it was the last, the entry is
    /// gone and its location is returned: the caller releases the reference the entry held.
    pub(crate) fn remove(&self, ns: u64, engine: u64) -> Option<u64> {
        let mut m = self.shard(ns, engine).lock();
        let key = key(ns, engine);
        let slot = m.get_mut(&key)?;
        if slot.holders > 1 {
            slot.holders -= 1;
            return None;
        }
        m.remove(&key).map(|d| d.loc())
    }

    /// The location some deterministic holder has for block `(ns, engine)`, with a new
    /// reference to its run for the caller.
    pub(crate) fn lookup(&self, ns: u64, engine: u64) -> Option<u64> {
        let m = self.shard(ns, engine).lock();
        let loc = m.get(&key(ns, engine)).map(DetBlock::loc)?;
        // Under the shard's lock the entry holds a reference, so taking another is safe.
        unpack(loc).0.acquire();
        Some(loc)
    }

    /// The slots of the holders waiting on `(ns, engine)`, which are no longer waiting: the
    /// block was just registered. Empty (and no lock taken) when nobody waits on anything.
    pub(crate) fn take_waiters(&self, ns: u64, engine: u64) -> Vec<u32> {
        if self.waiting.load(StdOrdering::SeqCst) == 0 {
            return Vec::new();
        }
        let mut w = self.waits.lock();
        let v = w.remove(&(ns, engine));
        self.waiting.store(w.len(), StdOrdering::SeqCst);
        v.unwrap_or_default()
    }

    /// Holder `slot` has an orphan waiting on `(ns, parent)`.
    pub(crate) fn wait(&self, ns: u64, parent: u64, slot: u32) {
        let mut w = self.waits.lock();
        let v = w.entry((ns, parent)).or_default();
        if !v.contains(&slot) {
            v.push(slot);
        }
        self.waiting.store(w.len(), StdOrdering::SeqCst);
    }

    /// Holder `slot` no longer waits on `(ns, parent)`.
    pub(crate) fn unwait(&self, ns: u64, parent: u64, slot: u32) {
        let mut w = self.waits.lock();
        if let Some(v) = w.get_mut(&(ns, parent)) {
            v.retain(|&s| s != slot);
            if v.is_empty() {
                w.remove(&(ns, parent));
            }
        }
        self.waiting.store(w.len(), StdOrdering::SeqCst);
    }

    /// Drops every wait of holder `slot` (its worker was removed).
    pub(crate) fn forget_waits_of(&self, slot: u32) {
        let mut waits = self.waits.lock();
        waits.retain(|_, v| {
            v.retain(|&s| s != slot);
            !v.is_empty()
        });
        // Relaxed: a hint read under the waits lock or rechecked by it.
        self.waiting.store(waits.len(), StdOrdering::Relaxed);
    }

    /// Heap bytes of the block maps.
    pub(crate) fn heap_bytes(&self) -> usize {
        // Relaxed: a statistics counter; nothing is published through it.
        self.bytes.load(StdOrdering::Relaxed)
    }

    /// (holder, namespace, parent) waits.
    pub(crate) fn waits(&self) -> usize {
        self.waits.lock().values().map(Vec::len).sum()
    }

    /// Distinct blocks.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks.iter().map(|m| m.lock().len()).sum()
    }

    /// Whether every shard's prefetch hint names its map's slots as they are now, and how many
    /// shards have grown (tests).
    #[cfg(test)]
    pub(crate) fn hints_current(&self) -> (bool, usize) {
        let (mut current, mut grown) = (true, 0);
        for (shard, hint) in self.blocks.iter().zip(self.hints.iter()) {
            let (base, slots) = shard.lock().home_hint();
            // Relaxed (both): read back by the thread that stored them. An empty map's
            // address is never used (no slot to prefetch).
            let published =
                (hint.base.load(StdOrdering::Relaxed).cast_const(), hint.slots.load(StdOrdering::Relaxed));
            current &= published.1 == slots && (slots == 0 || published.0 == base);
            grown += usize::from(slots > 0);
        }
        (current, grown)
    }

    /// Adds the runs the entries hold references to (as `Run::bits`) to `runs`.
    pub(crate) fn collect_runs(&self, runs: &mut HashSet<u64>) {
        for shard in self.blocks.iter() {
            runs.extend(shard.lock().values().map(|e| unpack(e.loc()).0.bits()));
        }
    }
}
