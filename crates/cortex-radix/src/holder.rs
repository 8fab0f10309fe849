//! One holder's private state, owned by its writer: `EngineHash → block`, orphans, LRU stamps.
//!
//! Key decision: everything that is per (holder, block) and only ever touched by that holder's
//! writer lives here, in plain (non-atomic) maps behind the holder's own mutex, which only its
//! writer (and, rarely, `remove_worker` or another holder's writer grafting a deterministic
//! orphan) takes. The shared [`crate::table`] holds only what readers need: one bit per holder
//! per block. An entry is 16 bytes of value: the block's `SeqHash` (or nothing, for orphans and
//! uncountable blocks), its store stamp (the LRU order is the stamp order, evicted in batches with
//! a selection, not a linked list), its reference counts on GPU and on lower tiers, its state and
//! its namespace (by index, for deterministic grafting).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The state of a block in its holder.
pub(crate) const COUNTABLE: u8 = 0;
/// Waiting for its parent; never counted.
pub(crate) const ORPHAN: u8 = 1;
/// Namespace unknown (directly or through its parent); never counted.
pub(crate) const UNCOUNTABLE: u8 = 2;

/// No namespace index (non-deterministic holders, or more than 254 namespaces in one holder).
pub(crate) const NS_NONE: u8 = u8::MAX;

/// A holder's block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// `SeqHash` bits when countable; unused otherwise.
    pub(crate) seq: u64,
    /// Store stamp: the holder's tick at the block's latest store (larger is more recent).
    pub(crate) stamp: u32,
    /// References on GPU (saturating).
    pub(crate) gpu: u8,
    /// References on lower tiers (saturating).
    pub(crate) low: u8,
    /// [`COUNTABLE`], [`ORPHAN`] or [`UNCOUNTABLE`].
    pub(crate) state: u8,
    /// Index into [`Private::namespaces`], or [`NS_NONE`].
    pub(crate) ns: u8,
}

impl Entry {
    /// The (gpu, any-tier) flags this entry contributes to the shared table.
    pub(crate) fn flags(&self) -> (bool, bool) {
        if self.state == COUNTABLE { (self.gpu > 0, self.gpu > 0 || self.low > 0) } else { (false, false) }
    }

    pub(crate) fn refs(&self) -> u32 {
        u32::from(self.gpu) + u32::from(self.low)
    }
}

/// What an orphan waits for and how to compute its `SeqHash` once grafted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OrphanInfo {
    /// Engine hash of the parent it waits on.
    pub(crate) parent: u64,
    /// Content hash of its page.
    pub(crate) content: u64,
    /// Namespace bits of its store.
    pub(crate) ns: u64,
}

/// A cheap mixer for keys that are usually hashes already (engine hashes), robust to small
/// integers in tests.
#[derive(Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = mix64(self.0 ^ v);
    }
}

/// The murmur3 64-bit finalizer: a bijection with good avalanche.
#[inline]
pub(crate) fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

pub(crate) type Map<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;

/// The writer-owned state of one holder.
#[derive(Default)]
pub(crate) struct Private {
    /// Every block of the holder (countable, orphan or uncountable), by engine hash.
    pub(crate) entries: Map<Entry>,
    /// Orphans' extra data, by engine hash.
    pub(crate) orphans: Map<OrphanInfo>,
    /// Orphans waiting on a parent engine hash: parent → children.
    pub(crate) waiting: Map<Vec<u64>>,
    /// Namespaces seen by this (deterministic) holder; entries refer to them by index.
    pub(crate) namespaces: Vec<u64>,
    /// The next store stamp.
    pub(crate) tick: u32,
    /// Countable entries.
    pub(crate) countable: usize,
    /// Bytes last reported to the ledger's counter.
    pub(crate) reported_bytes: usize,
}

impl Private {
    /// The next stamp, renumbering every entry's stamp by rank when the counter would wrap.
    pub(crate) fn next_stamp(&mut self) -> u32 {
        if self.tick == u32::MAX {
            let mut order: Vec<(u32, u64)> = self.entries.iter().map(|(k, e)| (e.stamp, *k)).collect();
            order.sort_unstable();
            for (rank, (_, k)) in order.iter().enumerate() {
                if let Some(e) = self.entries.get_mut(k) {
                    e.stamp = rank as u32;
                }
            }
            self.tick = order.len() as u32;
        }
        let t = self.tick;
        self.tick += 1;
        t
    }

    /// Index of namespace `ns` in this holder, interning it ([`NS_NONE`] when full).
    pub(crate) fn ns_index(&mut self, ns: u64) -> u8 {
        if let Some(i) = self.namespaces.iter().position(|&n| n == ns) {
            return i as u8;
        }
        if self.namespaces.len() < usize::from(NS_NONE) {
            self.namespaces.push(ns);
            (self.namespaces.len() - 1) as u8
        } else {
            NS_NONE
        }
    }

    /// The engine hashes of the `k` least recently stored entries.
    pub(crate) fn oldest(&self, k: usize) -> Vec<u64> {
        if k == 0 {
            return Vec::new();
        }
        if k >= self.entries.len() {
            return self.entries.keys().copied().collect();
        }
        let mut stamps: Vec<u32> = self.entries.values().map(|e| e.stamp).collect();
        let (_, nth, _) = stamps.select_nth_unstable(k - 1);
        let threshold = *nth;
        // Stamps are unique within a holder, so exactly `k` entries qualify.
        self.entries.iter().filter(|(_, e)| e.stamp <= threshold).map(|(k, _)| *k).collect()
    }

    /// Heap bytes of this state (hashbrown's layout: buckets of (key, value) plus one control
    /// byte each, buckets a power of two at most 7/8 full).
    pub(crate) fn heap_bytes(&self) -> usize {
        fn map_bytes<V>(m: &Map<V>) -> usize {
            let cap = m.capacity();
            if cap == 0 {
                return 0;
            }
            let buckets = if cap < 8 { cap + 1 } else { (cap * 8 / 7).next_power_of_two() };
            buckets * (std::mem::size_of::<(u64, V)>() + 1) + 16
        }
        map_bytes(&self.entries)
            + map_bytes(&self.orphans)
            + map_bytes(&self.waiting)
            + self.waiting.values().map(|v| v.capacity() * 8).sum::<usize>()
            + self.namespaces.capacity() * 8
    }
}
