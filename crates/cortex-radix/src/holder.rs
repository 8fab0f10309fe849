//! One holder's private state, owned by its writer: `EngineHash → block`, its blocks of each run,
//! orphans, LRU stamps.
//!
//! Key decision: everything that is per (holder, block) and only ever touched by that holder's
//! writer lives here, in plain (non-atomic) maps behind the holder's own mutex, which its
//! writer takes — and, rarely, `remove_worker`, another holder's writer grafting a deterministic
//! orphan, and the diagnostic reads `Ledger::block` and `Ledger::dump`. The shared runs ([`crate::run`]) hold only what readers need: per holder and
//! run, two cuts. A block is one 24-byte slot of an [`EngineMap`] (its engine hash, then 16 bytes:
//! the block's location — run and offset, packed; unused for orphans and uncountable blocks — its
//! store stamp — the LRU order is the stamp order, evicted in batches by a selection, not a linked
//! list — its reference counts on GPU and on lower tiers, its state and its namespace, by index,
//! for deterministic grafting). Per run the holder has blocks of, a [`HolderRun`] keeps which
//! offsets it has (on GPU, on any tier) so that the cuts it publishes are exact. Orphans' extra data
//! and waiting lists are small side maps.

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
    /// Location (`run::pack`) when countable; unused otherwise. Deterministic-index entries
    /// keep a location too.
    pub(crate) loc: u64,
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
    /// Whether this entry counts on GPU and on any tier (what its run's cuts publish).
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

/// Marks a vacant [`EngineMap`] slot (in the entry's state byte).
const VACANT: u8 = u8::MAX;

#[derive(Clone, Copy)]
struct Slot {
    key: u64,
    e: Entry,
}

const EMPTY_SLOT: Slot =
    Slot { key: 0, e: Entry { loc: 0, stamp: 0, gpu: 0, low: 0, state: VACANT, ns: NS_NONE } };

/// A holder's blocks by engine hash: linear probing over 24-byte slots (key and entry side by
/// side, so a probe touches one line), sized for the holder's capacity at 4/5 load, with
/// backward-shift deletion (no tombstones) and a prefetch for a store's blocks.
///
/// Key decision: a general hash map would double past capacity and carry control bytes; a
/// holder's block count is bounded by its capacity plus slack, so the map grows straight to the
/// size that holds the capacity at 4/5 load, then by quarters.
#[derive(Clone, Default)]
pub(crate) struct EngineMap {
    slots: Vec<Slot>,
    len: usize,
    /// Slots that hold the holder's capacity at 4/5 load.
    target: usize,
}

impl EngineMap {
    /// An empty map for a holder of `capacity` blocks (allocates nothing yet).
    pub(crate) fn with_capacity_target(capacity: usize) -> EngineMap {
        EngineMap { slots: Vec::new(), len: 0, target: (capacity + capacity / 4).max(16) }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        ((u128::from(mix64(key)) * self.slots.len() as u128) >> 64) as usize
    }

    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let n = self.slots.len();
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.e.state == VACANT {
                return None;
            }
            if s.key == key {
                return Some(i);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Hints the CPU to fetch `key`'s home slot.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        crate::sync::prefetch(&raw const self.slots[self.home(key)]);
    }

    pub(crate) fn get(&self, key: &u64) -> Option<&Entry> {
        self.find(*key).map(|i| &self.slots[i].e)
    }

    pub(crate) fn get_mut(&mut self, key: &u64) -> Option<&mut Entry> {
        self.find(*key).map(|i| &mut self.slots[i].e)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Inserts or replaces `key`'s entry (tests; the ledger always knows which it does).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn insert(&mut self, key: u64, e: Entry) {
        if let Some(i) = self.find(key) {
            self.slots[i].e = e;
            return;
        }
        self.insert_new(key, e);
    }

    /// Inserts `key`, which the caller knows is absent.
    pub(crate) fn insert_new(&mut self, key: u64, e: Entry) {
        debug_assert!(e.state != VACANT && self.find(key).is_none());
        if (self.len + 1) * 5 > self.slots.len() * 4 {
            let n = self.slots.len();
            let grown = if n < self.target { (n * 2).clamp(16, self.target) } else { n + n / 4 };
            self.resize(grown);
        }
        let n = self.slots.len();
        let mut i = self.home(key);
        while self.slots[i].e.state != VACANT {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        self.slots[i] = Slot { key, e };
        self.len += 1;
    }

    /// Removes `key`, shifting later members of its cluster back (no tombstones).
    pub(crate) fn remove(&mut self, key: &u64) -> Option<Entry> {
        let mut hole = self.find(*key)?;
        let out = self.slots[hole].e;
        let n = self.slots.len();
        let mut j = hole;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            if self.slots[j].e.state == VACANT {
                break;
            }
            let h = self.home(self.slots[j].key);
            // Move j back into the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < h && h <= j } else { hole < h || h <= j };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = EMPTY_SLOT;
        self.len -= 1;
        Some(out)
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY_SLOT; slots]);
        self.slots.shrink_to_fit();
        self.len = 0;
        for s in old {
            if s.e.state != VACANT {
                self.insert_new(s.key, s.e);
            }
        }
    }

    /// Sets the entries the map is sized for (it grows by doubling up to the size that holds
    /// them at 4/5 load, then by quarters): a holder limited by the byte budget below its
    /// capacity sizes for its budget share, so its map never holds twice the slots it may use.
    pub(crate) fn set_target(&mut self, entries: usize) {
        self.target = (entries + entries / 4).max(16);
    }

    /// Shrinks to the smallest size that holds `n` entries at 4/5 load (never below the
    /// entries present).
    pub(crate) fn shrink_to(&mut self, n: usize) {
        let want = (n.max(self.len) * 5 / 4 + 1).max(16);
        if want < self.slots.len() {
            self.resize(want);
        }
    }

    /// Drops every entry and the memory.
    pub(crate) fn clear_all(&mut self) {
        self.slots = Vec::new();
        self.len = 0;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&u64, &Entry)> {
        self.slots.iter().filter(|s| s.e.state != VACANT).map(|s| (&s.key, &s.e))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &u64> {
        self.iter().map(|(k, _)| k)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.iter().map(|(_, e)| e)
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

/// A holder's blocks of one run: which offsets it has on GPU and on any tier, how many of its
/// entries are located in the run (it holds one reference to the run while that is nonzero), and
/// the cuts it last published.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HolderRun {
    /// Offsets held on GPU.
    pub(crate) gpu: u64,
    /// Offsets held on any tier.
    pub(crate) any: u64,
    /// Entries located in the run.
    pub(crate) entries: u32,
    /// Cuts last published (`gpu | any << 8`).
    pub(crate) published: u16,
}

impl HolderRun {
    /// The cuts the holder's offsets call for (`gpu | any << 8`).
    pub(crate) fn cuts(&self) -> u16 {
        crate::run::cut_of(self.gpu) | (crate::run::cut_of(self.any) << 8)
    }
}

/// The writer-owned state of one holder.
#[derive(Default)]
pub(crate) struct Private {
    /// Every block of the holder (countable, orphan or uncountable), by engine hash.
    pub(crate) entries: EngineMap,
    /// The holder's blocks of each run, by the run's address.
    pub(crate) runs: Map<HolderRun>,
    /// Runs whose cuts changed since they were last published.
    pub(crate) dirty: Vec<u64>,
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
    /// Cortex identities of countable blocks the holder lost lately.
    pub(crate) gone: Gone,
}

/// Bits in one generation of [`Gone`].
const GONE_BITS: usize = 1 << 15;
/// Blocks one generation of [`Gone`] takes before the older is dropped.
const GONE_PER_GENERATION: u32 = 3_000;

/// The Cortex identities (`SeqHash` bits) of countable blocks a holder lost lately — removed by
/// its engine or evicted by the ledger — so that a check can tell a block that was stored and
/// is gone from one that was never stored: two generations of a 32-Kibit filter, two bits a
/// block, the older dropped when the newer has taken 3,000. It answers for the last
/// 3,000–6,000 blocks lost, with about 3 % false positives per full generation (up to ~6 % with
/// both full); 8 KiB, allocated at the first loss.
///
/// Key decision: a filter, not a list: a lookup is two bit tests, and a false "lost lately" only
/// turns one alignment check into no check (never a failure into a pass of a block never stored
/// under the gateway's identity more often than the false-positive rate).
#[derive(Default)]
pub(crate) struct Gone {
    bits: Vec<u64>,
    count: u32,
}

impl Gone {
    fn positions(seq: u64) -> [usize; 2] {
        let h = mix64(seq);
        [(h as usize) % GONE_BITS, ((h >> 32) as usize) % GONE_BITS]
    }

    pub(crate) fn insert(&mut self, seq: u64) {
        const WORDS: usize = GONE_BITS / 64;
        if self.bits.is_empty() {
            self.bits = vec![0; 2 * WORDS];
        }
        if self.count == GONE_PER_GENERATION {
            // The newer generation becomes the older.
            self.bits.copy_within(..WORDS, WORDS);
            self.bits[..WORDS].fill(0);
            self.count = 0;
        }
        for b in Self::positions(seq) {
            self.bits[b / 64] |= 1 << (b % 64);
        }
        self.count += 1;
    }

    pub(crate) fn contains(&self, seq: u64) -> bool {
        const WORDS: usize = GONE_BITS / 64;
        let p = Self::positions(seq);
        (0..2).any(|g| {
            let half = self.bits.get(g * WORDS..(g + 1) * WORDS).unwrap_or(&[]);
            !half.is_empty() && p.iter().all(|&b| half[b / 64] & (1 << (b % 64)) != 0)
        })
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.bits.capacity() * 8
    }
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
        self.entries.heap_bytes()
            + map_bytes(&self.runs)
            + self.dirty.capacity() * 8
            + map_bytes(&self.orphans)
            + map_bytes(&self.waiting)
            + self.waiting.values().map(|v| v.capacity() * 8).sum::<usize>()
            + self.namespaces.capacity() * 8
            + self.gone.heap_bytes()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(seq: u64) -> Entry {
        Entry { loc: seq, stamp: 0, gpu: 1, low: 0, state: COUNTABLE, ns: NS_NONE }
    }

    /// The filter finds the blocks lost in its last generation and the one before, forgets the
    /// generation before that, and says "lost" of blocks never inserted only at about the rate
    /// its size gives.
    #[test]
    fn gone_remembers_two_generations() {
        let mut g = Gone::default();
        assert!(!g.contains(1));
        let n = u64::from(GONE_PER_GENERATION);
        (0..n).for_each(|i| g.insert(i));
        (n..2 * n).for_each(|i| g.insert(i));
        assert!((0..2 * n).all(|i| g.contains(i)));
        (2 * n..3 * n).for_each(|i| g.insert(i));
        assert!((n..3 * n).all(|i| g.contains(i)));
        let stale = (0..n).filter(|&i| g.contains(i)).count();
        let never = (1u64 << 40..(1 << 40) + 10_000).filter(|&i| g.contains(i)).count();
        // Two full generations of 3,000 in 32 Kibit each, two bits a block: ~2.8 % each.
        assert!(stale < 300 && never < 800, "stale {stale}, never stored {never}");
    }

    proptest! {
        /// The engine map behaves like a `HashMap` under inserts, replacements and removals
        /// (clusters that wrap around the end included: keys from a small range collide).
        #[test]
        fn engine_map_matches_a_hash_map(ops in prop::collection::vec((0u64..400, any::<bool>()), 1..3000), target in 1usize..200) {
            let mut m = EngineMap::with_capacity_target(target);
            let mut want = std::collections::HashMap::new();
            for (k, insert) in ops {
                if insert {
                    m.insert(k, entry(k + 1));
                    want.insert(k, k + 1);
                } else {
                    prop_assert_eq!(m.remove(&k).map(|e| e.loc), want.remove(&k));
                }
                prop_assert_eq!(m.len(), want.len());
            }
            for (k, v) in &want {
                prop_assert_eq!(m.get(k).map(|e| e.loc), Some(*v));
            }
            prop_assert_eq!(m.iter().count(), want.len());
            m.shrink_to(0);
            for (k, v) in &want {
                prop_assert_eq!(m.get(k).map(|e| e.loc), Some(*v));
            }
        }
    }
}
