//! One holder's private state, owned by its writer: `EngineHash → block`, its blocks of each run,
//! orphans, LRU stamps.
//!
//! Key decision: everything that is per (holder, block) and only ever touched by that holder's
//! writer lives here, in plain (non-atomic) maps behind the holder's own mutex, which its
//! writer takes — and, rarely, `remove_worker`, another holder's writer grafting a deterministic
//! orphan, and the diagnostic reads `Ledger::block` and `Ledger::dump`. The shared runs ([`crate::run`]) hold only what readers need: per holder and
//! run, two cuts. A block is one 20-byte slot of an [`EngineMap`] (its engine hash, then a
//! 12-byte [`Packed`]: the block's location — the index of the holder's record of the run and the
//! offset; unused for orphans and uncountable blocks — its store stamp — the LRU order is the
//! stamp order, evicted in batches by a selection, not a linked list — its reference counts on GPU
//! and on lower tiers, its state and its namespace, by index, for deterministic grafting). Per run
//! the holder has blocks of, a [`HolderRun`] in a slab ([`HolderRuns`]) keeps which offsets it has
//! (on GPU, on any tier) so that the cuts it publishes are exact. Orphans' extra data and waiting
//! lists are small side maps.
//!
//! The slot is 20 bytes, not the 24 of a `u64` location, because the holder already keeps a record
//! per run it has blocks of: naming that record by a 4-byte slab index instead of the run's address
//! cut the bytes per (holder, block) from 36.6 to 31.9 at 8 holders × 100k blocks (`docs/perf.md`).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::run::Run;

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

/// A map's value: `Copy`, with one value that marks a vacant slot.
pub(crate) trait SlotValue: Copy {
    /// The value of a vacant slot.
    const VACANT: Self;
    /// Whether this is the vacant value.
    fn is_vacant(&self) -> bool;
}

/// Marks a vacant [`Packed`] slot (in its state byte; real state bytes are at most
/// `2 | 63 << 2`).
const VACANT: u8 = u8::MAX;

/// A holder's block as its map keeps it: 12 bytes, so that a slot with its key is 20. The
/// location is the holder's record of the run ([`HolderRuns`], by index) and the offset, kept in
/// the state byte's upper six bits; [`Private::entry`] unpacks it into an [`Entry`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Packed {
    /// Index of the run's record in [`HolderRuns`] when countable; 0 otherwise.
    run: u32,
    /// As [`Entry::stamp`].
    pub(crate) stamp: u32,
    gpu: u8,
    low: u8,
    /// The state (low two bits) and, when countable, the offset in the run (`<< 2`).
    state_off: u8,
    ns: u8,
}

impl SlotValue for Packed {
    const VACANT: Packed = Packed { run: 0, stamp: 0, gpu: 0, low: 0, state_off: VACANT, ns: NS_NONE };
    #[inline]
    fn is_vacant(&self) -> bool {
        self.state_off == VACANT
    }
}

/// A slot: the key in two halves (4-byte alignment, so that a [`Packed`] slot is 20 bytes, not
/// 24), then the value.
#[derive(Clone, Copy)]
#[repr(C)]
struct Slot<V> {
    key: [u32; 2],
    v: V,
}

impl<V: SlotValue> Slot<V> {
    const EMPTY: Slot<V> = Slot { key: [0, 0], v: V::VACANT };

    #[inline]
    fn key(&self) -> u64 {
        u64::from(self.key[0]) | (u64::from(self.key[1]) << 32)
    }
}

#[inline]
fn halves(key: u64) -> [u32; 2] {
    [key as u32, (key >> 32) as u32]
}

/// `key`'s home slot among `n`.
#[inline]
fn home_index(key: u64, n: usize) -> usize {
    ((u128::from(mix64(key)) * n as u128) >> 64) as usize
}

/// Hints the CPU to fetch `key`'s home slot in an [`EngineMap`] of `V` whose slots were at `base`,
/// `n` of them, when last seen ([`EngineMap::home_hint`]): an address is computed, nothing is
/// read, so a stale or torn hint costs a useless prefetch and nothing else.
#[inline]
pub(crate) fn prefetch_home<V: SlotValue>(base: *const u8, n: usize, key: u64) {
    if n > 0 {
        crate::sync::prefetch(base.wrapping_add(home_index(key, n) * std::mem::size_of::<Slot<V>>()));
    }
}

/// Blocks by engine hash (a holder's, and the deterministic index's): linear probing over slots
/// of the key and a small value side by side (20 bytes for a holder's [`Packed`] block, so a
/// probe touches one line), sized for the holder's capacity at 4/5 load, with backward-shift
/// deletion (no tombstones) and a prefetch for a store's blocks.
///
/// Key decision: a general hash map would double past capacity and carry control bytes; a
/// holder's block count is bounded by its capacity plus slack, so the map grows straight to the
/// size that holds the capacity at 4/5 load, then by quarters.
#[derive(Clone)]
pub(crate) struct EngineMap<V> {
    slots: Vec<Slot<V>>,
    len: usize,
    /// Slots that hold the holder's capacity at 4/5 load.
    target: usize,
}

impl<V: SlotValue> Default for EngineMap<V> {
    fn default() -> Self {
        EngineMap { slots: Vec::new(), len: 0, target: 0 }
    }
}

impl<V: SlotValue> EngineMap<V> {
    /// An empty map for a holder of `capacity` blocks (allocates nothing yet).
    pub(crate) fn with_capacity_target(capacity: usize) -> EngineMap<V> {
        EngineMap { slots: Vec::new(), len: 0, target: (capacity + capacity / 4).max(16) }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        home_index(key, self.slots.len())
    }

    /// The slots' address and count, for a prefetch by a thread that does not hold the map (see
    /// [`prefetch_home`]).
    #[inline]
    pub(crate) fn home_hint(&self) -> (*const u8, usize) {
        (self.slots.as_ptr().cast(), self.slots.len())
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let n = self.slots.len();
        let want = halves(key);
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.v.is_vacant() {
                return None;
            }
            if s.key == want {
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
        let (base, n) = self.home_hint();
        prefetch_home::<V>(base, n, key);
    }

    #[inline]
    pub(crate) fn get(&self, key: &u64) -> Option<&V> {
        self.find(*key).map(|i| &self.slots[i].v)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        self.find(*key).map(|i| &mut self.slots[i].v)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Inserts or replaces `key`'s value (tests; the ledger always knows which it does).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn insert(&mut self, key: u64, v: V) {
        if let Some(i) = self.find(key) {
            self.slots[i].v = v;
            return;
        }
        self.insert_new(key, v);
    }

    /// Inserts `key`, which the caller knows is absent.
    pub(crate) fn insert_new(&mut self, key: u64, v: V) {
        debug_assert!(!v.is_vacant() && self.find(key).is_none());
        if (self.len + 1) * 5 > self.slots.len() * 4 {
            let n = self.slots.len();
            let grown = if n < self.target { (n * 2).clamp(16, self.target) } else { n + n / 4 };
            self.resize(grown);
        }
        let n = self.slots.len();
        let mut i = self.home(key);
        while !self.slots[i].v.is_vacant() {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        self.slots[i] = Slot { key: halves(key), v };
        self.len += 1;
    }

    /// Removes `key`, shifting later members of its cluster back (no tombstones).
    pub(crate) fn remove(&mut self, key: &u64) -> Option<V> {
        let mut hole = self.find(*key)?;
        let out = self.slots[hole].v;
        let n = self.slots.len();
        let mut j = hole;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            if self.slots[j].v.is_vacant() {
                break;
            }
            let h = self.home(self.slots[j].key());
            // Move j back into the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < h && h <= j } else { hole < h || h <= j };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = Slot::EMPTY;
        self.len -= 1;
        Some(out)
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::EMPTY; slots]);
        self.slots.shrink_to_fit();
        self.len = 0;
        for s in old {
            if !s.v.is_vacant() {
                self.insert_new(s.key(), s.v);
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

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.slots.iter().filter(|s| !s.v.is_vacant()).map(|s| (s.key(), &s.v))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> {
        self.iter().map(|(k, _)| k)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, e)| e)
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<V>>()
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

/// No record (the end of the free list).
const NO_RECORD: u32 = u32::MAX;

/// The holder's records of the runs it has blocks of: a slab, so that an entry names its run by
/// a 4-byte index, and a map from the run's address to its index, with the last index looked up
/// remembered (a store's blocks are usually of one run). A free record keeps the next free index
/// in its `entries`.
#[derive(Default)]
pub(crate) struct HolderRuns {
    /// `(run address, record)`; address 0: free.
    recs: Vec<(u64, HolderRun)>,
    /// Run address → index in `recs`.
    by_run: Map<u32>,
    /// First free record, or [`NO_RECORD`] (a `Default` slab has none: `recs` is empty).
    free: Option<u32>,
    /// The last `(run address, index)` looked up.
    last: (u64, u32),
}

impl HolderRuns {
    /// Records.
    pub(crate) fn len(&self) -> usize {
        self.by_run.len()
    }

    /// The index of `run`'s record, if the holder has one.
    #[inline]
    pub(crate) fn index(&mut self, run: u64) -> Option<u32> {
        if self.last.0 == run && run != 0 {
            return Some(self.last.1);
        }
        let i = *self.by_run.get(&run)?;
        self.last = (run, i);
        Some(i)
    }

    /// `run`'s record, if the holder has one.
    #[inline]
    pub(crate) fn get_mut(&mut self, run: u64) -> Option<&mut HolderRun> {
        let i = self.index(run)?;
        Some(&mut self.recs[i as usize].1)
    }

    /// The run address of record `i`.
    #[inline]
    pub(crate) fn run_at(&self, i: u32) -> u64 {
        self.recs[i as usize].0
    }

    /// Adds a record for `run` (which has none); returns its index.
    pub(crate) fn insert(&mut self, run: u64, hr: HolderRun) -> u32 {
        debug_assert!(run != 0 && !self.by_run.contains_key(&run));
        let i = match self.free.filter(|&f| f != NO_RECORD) {
            Some(f) => {
                let next = self.recs[f as usize].1.entries;
                self.free = Some(next);
                self.recs[f as usize] = (run, hr);
                f
            }
            None => {
                let i = u32::try_from(self.recs.len()).unwrap_or_else(|_| unreachable!("more runs than u32"));
                self.recs.push((run, hr));
                i
            }
        };
        self.by_run.insert(run, i);
        self.last = (run, i);
        i
    }

    /// Drops `run`'s record.
    pub(crate) fn remove(&mut self, run: u64) -> Option<HolderRun> {
        let i = self.by_run.remove(&run)?;
        if self.last.0 == run {
            self.last = (0, 0);
        }
        let next = self.free.unwrap_or(NO_RECORD);
        let (_, hr) = std::mem::replace(
            &mut self.recs[i as usize],
            (0, HolderRun { entries: next, ..HolderRun::default() }),
        );
        self.free = Some(i);
        Some(hr)
    }

    /// Every `(run address, record)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &HolderRun)> {
        self.recs.iter().filter(|(r, _)| *r != 0).map(|(r, hr)| (*r, hr))
    }

    /// Takes every record, leaving none (and no memory).
    pub(crate) fn take_all(&mut self) -> Vec<(u64, HolderRun)> {
        let out = self.iter().map(|(r, hr)| (r, *hr)).collect();
        *self = HolderRuns::default();
        out
    }

    /// Whether the slab and the map hold over four times the room their records need.
    pub(crate) fn sparse(&self) -> bool {
        let n = self.len().max(16);
        self.by_run.capacity() > 4 * n || self.recs.len() > 4 * n
    }

    /// Rebuilds the slab densely (indices change: `entries` is renumbered by `renumber`, which
    /// gets the old and the new index of each record) and shrinks the map.
    pub(crate) fn compact(&mut self, mut renumber: impl FnMut(&[u32])) {
        let mut moved = vec![NO_RECORD; self.recs.len()];
        let mut recs = Vec::with_capacity(self.len());
        for (old, &(r, hr)) in self.recs.iter().enumerate() {
            if r != 0 {
                moved[old] = recs.len() as u32;
                recs.push((r, hr));
            }
        }
        self.recs = recs;
        self.free = None;
        self.by_run.clear();
        self.by_run.shrink_to(2 * self.recs.len());
        for (i, &(r, _)) in self.recs.iter().enumerate() {
            self.by_run.insert(r, i as u32);
        }
        self.last = (0, 0);
        renumber(&moved);
    }

    /// Heap bytes (the map's as hashbrown lays it out; see [`Private::heap_bytes`]).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.recs.capacity() * std::mem::size_of::<(u64, HolderRun)>() + map_bytes(&self.by_run)
    }
}

/// Heap bytes of a [`Map`] (hashbrown's layout: buckets of (key, value) plus one control byte
/// each, buckets a power of two at most 7/8 full).
fn map_bytes<V>(m: &Map<V>) -> usize {
    let cap = m.capacity();
    if cap == 0 {
        return 0;
    }
    let buckets = if cap < 8 { cap + 1 } else { (cap * 8 / 7).next_power_of_two() };
    buckets * (std::mem::size_of::<(u64, V)>() + 1) + 16
}

/// What a holder's record of a run costs at worst: its slab element with the slab at half use
/// (it doubles) and its map bucket (a 13-byte bucket at 7/16 load, the least before the map
/// doubles). Charged with the runs by the byte budget.
pub(crate) const RUN_RECORD_BYTES: usize =
    2 * std::mem::size_of::<(u64, HolderRun)>() + (std::mem::size_of::<(u64, u32)>() + 1) * 16 / 7 + 1;

/// The writer-owned state of one holder.
#[derive(Default)]
pub(crate) struct Private {
    /// Every block of the holder (countable, orphan or uncountable), by engine hash; read and
    /// written as [`Entry`]s through [`Private::entry`] and [`Private::set_entry`].
    pub(crate) entries: EngineMap<Packed>,
    /// The holder's blocks of each run.
    pub(crate) runs: HolderRuns,
    /// Runs whose cuts changed since they were last published.
    pub(crate) dirty: Vec<u64>,
    /// Orphans' extra data, by engine hash.
    pub(crate) orphans: Map<OrphanInfo>,
    /// Orphans waiting on a parent engine hash: parent → children. Lists are added, grown,
    /// replaced and removed only through the `waiting_*` methods, which keep
    /// `waiting_list_bytes` (a `retain` in place keeps a list's capacity).
    pub(crate) waiting: Map<Vec<u64>>,
    /// Heap bytes of `waiting`'s lists (8 per element of capacity), kept as they change: summing
    /// them cost every write time in proportion to the orphans held (after a clear, up to every
    /// block the engine stores).
    pub(crate) waiting_list_bytes: usize,
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
    /// `engine` waits on `parent`.
    pub(crate) fn waiting_push(&mut self, parent: u64, engine: u64) {
        let list = self.waiting.entry(parent).or_default();
        let before = list.capacity();
        list.push(engine);
        self.waiting_list_bytes += (list.capacity() - before) * 8;
        self.check_waiting_bytes();
    }

    /// The orphans waiting on `parent`, no longer waiting.
    pub(crate) fn waiting_take(&mut self, parent: u64) -> Option<Vec<u64>> {
        let list = self.waiting.remove(&parent)?;
        self.waiting_list_bytes -= list.capacity() * 8;
        self.check_waiting_bytes();
        Some(list)
    }

    /// `list` waits on `parent` instead of what did.
    pub(crate) fn waiting_put(&mut self, parent: u64, list: Vec<u64>) {
        self.waiting_list_bytes += list.capacity() * 8;
        if let Some(old) = self.waiting.insert(parent, list) {
            self.waiting_list_bytes -= old.capacity() * 8;
        }
        self.check_waiting_bytes();
    }

    /// Nothing waits any more.
    pub(crate) fn waiting_clear(&mut self) {
        self.waiting = Map::default();
        self.waiting_list_bytes = 0;
    }

    /// Tests (debug builds): the kept byte count is the lists' sum.
    fn check_waiting_bytes(&self) {
        debug_assert_eq!(
            self.waiting_list_bytes,
            self.waiting.values().map(|v| v.capacity() * 8).sum::<usize>(),
            "waiting_list_bytes drifted from the lists"
        );
    }

    /// The next stamp, renumbering every entry's stamp by rank when the counter would wrap.
    pub(crate) fn next_stamp(&mut self) -> u32 {
        if self.tick == u32::MAX {
            let mut order: Vec<(u32, u64)> = self.entries.iter().map(|(k, e)| (e.stamp, k)).collect();
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
            return self.entries.keys().collect();
        }
        let mut stamps: Vec<u32> = self.entries.values().map(|e| e.stamp).collect();
        let (_, nth, _) = stamps.select_nth_unstable(k - 1);
        let threshold = *nth;
        // Stamps are unique within a holder, so exactly `k` entries qualify.
        self.entries.iter().filter(|(_, e)| e.stamp <= threshold).map(|(k, _)| k).collect()
    }

    /// Heap bytes of this state (hash maps as hashbrown lays them out, see [`map_bytes`]).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
            + self.runs.heap_bytes()
            + self.dirty.capacity() * 8
            + map_bytes(&self.orphans)
            + map_bytes(&self.waiting)
            + self.waiting_list_bytes
            + self.namespaces.capacity() * 8
            + self.gone.heap_bytes()
    }

    /// Unpacks a map value.
    #[inline]
    fn unpack(&self, v: &Packed) -> Entry {
        let state = v.state_off & 3;
        let loc = if state == COUNTABLE {
            // SAFETY: a countable entry's run has a record, and the holder holds a reference to
            // it while it does.
            crate::run::pack(
                unsafe { Run::from_bits(self.runs.run_at(v.run)) },
                usize::from(v.state_off >> 2),
            )
        } else {
            0
        };
        Entry { loc, stamp: v.stamp, gpu: v.gpu, low: v.low, state, ns: v.ns }
    }

    /// Packs `e` (a countable entry's run must have a record).
    #[inline]
    fn pack(&mut self, e: &Entry) -> Packed {
        let (run, off) = if e.state == COUNTABLE {
            let (run, off) = crate::run::unpack(e.loc);
            let i = self
                .runs
                .index(run.bits())
                .unwrap_or_else(|| unreachable!("a countable entry's run has a record"));
            (i, off as u8)
        } else {
            (0, 0)
        };
        Packed { run, stamp: e.stamp, gpu: e.gpu, low: e.low, state_off: e.state | (off << 2), ns: e.ns }
    }

    /// Block `engine`, if the holder has it.
    #[inline]
    pub(crate) fn entry(&self, engine: u64) -> Option<Entry> {
        self.entries.get(&engine).map(|v| self.unpack(v))
    }

    /// Whether the holder has block `engine`.
    #[inline]
    pub(crate) fn has(&self, engine: u64) -> bool {
        self.entries.get(&engine).is_some()
    }

    /// Replaces block `engine`'s entry (the holder has it).
    #[inline]
    pub(crate) fn set_entry(&mut self, engine: u64, e: &Entry) {
        let v = self.pack(e);
        if let Some(slot) = self.entries.get_mut(&engine) {
            *slot = v;
        }
    }

    /// Adds block `engine` (the holder does not have it).
    #[inline]
    pub(crate) fn insert_entry(&mut self, engine: u64, e: &Entry) {
        let v = self.pack(e);
        self.entries.insert_new(engine, v);
    }

    /// Drops block `engine`, returning its entry.
    #[inline]
    pub(crate) fn remove_entry(&mut self, engine: u64) -> Option<Entry> {
        let v = self.entries.remove(&engine)?;
        Some(self.unpack(&v))
    }

    /// Every block, unpacked.
    pub(crate) fn iter_entries(&self) -> impl Iterator<Item = (u64, Entry)> {
        self.entries.iter().map(|(k, v)| (k, self.unpack(v)))
    }

    /// Shrinks the run records if they are sparse (after evictions), renumbering the entries'
    /// record indices.
    pub(crate) fn shrink_runs(&mut self) {
        if !self.runs.sparse() {
            return;
        }
        let entries = &mut self.entries;
        self.runs.compact(|moved| {
            for s in entries.slots.iter_mut() {
                if !s.v.is_vacant() && s.v.state_off & 3 == COUNTABLE {
                    s.v.run = moved[s.v.run as usize];
                }
            }
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(v: u64) -> Packed {
        Packed { run: v as u32, stamp: 0, gpu: 1, low: 0, state_off: COUNTABLE, ns: NS_NONE }
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

    /// Entries name their run by its record's index: freed records are reused, and compacting
    /// the records after evictions renumbers every entry, which still unpacks to its location.
    #[test]
    fn run_records_are_reused_and_compacted_under_their_entries() {
        let mut p = Private { entries: EngineMap::with_capacity_target(1000), ..Private::default() };
        // Run addresses are only packed, never read, here.
        let run = |i: u64| i << 12;
        let countable = |r: u64, off: usize| Entry {
            // SAFETY: never dereferenced (see above).
            loc: crate::run::pack(unsafe { Run::from_bits(r) }, off),
            stamp: 0,
            gpu: 1,
            low: 0,
            state: COUNTABLE,
            ns: NS_NONE,
        };
        let add = |p: &mut Private, engine: u64, r: u64, off: usize| {
            if p.runs.get_mut(r).is_none() {
                p.runs.insert(r, HolderRun::default());
            }
            let v = p.pack(&countable(r, off));
            p.entries.insert_new(engine, v);
        };
        for i in 1..=200u64 {
            add(&mut p, i, run(i), (i % 64) as usize);
        }
        add(&mut p, 1000, run(7), 63);
        let orphan = Entry { loc: 0, stamp: 3, gpu: 0, low: 2, state: ORPHAN, ns: 4 };
        let v = p.pack(&orphan);
        p.entries.insert_new(2000, v);
        for i in 11..=200u64 {
            p.remove_entry(i);
            p.runs.remove(run(i));
        }
        // Freed records are reused before the slab grows.
        add(&mut p, 300, run(300), 5);
        assert_eq!(p.runs.recs.len(), 200);
        assert!(p.runs.sparse());
        p.shrink_runs();
        assert_eq!((p.runs.recs.len(), p.runs.len()), (11, 11));
        for i in 1..=10u64 {
            assert_eq!(p.entry(i).map(|e| e.loc), Some(countable(run(i), (i % 64) as usize).loc));
        }
        assert_eq!(p.entry(1000).map(|e| e.loc), Some(countable(run(7), 63).loc));
        assert_eq!(p.entry(300).map(|e| e.loc), Some(countable(run(300), 5).loc));
        let o = p.entry(2000).expect("orphan");
        assert_eq!((o.loc, o.stamp, o.gpu, o.low, o.state, o.ns), (0, 3, 0, 2, ORPHAN, 4));
        assert_eq!(p.entry(11).map(|e| e.loc), None);
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
                    prop_assert_eq!(m.remove(&k).map(|e| u64::from(e.run)), want.remove(&k));
                }
                prop_assert_eq!(m.len(), want.len());
            }
            for (k, v) in &want {
                prop_assert_eq!(m.get(k).map(|e| u64::from(e.run)), Some(*v));
            }
            prop_assert_eq!(m.iter().count(), want.len());
            m.shrink_to(0);
            for (k, v) in &want {
                prop_assert_eq!(m.get(k).map(|e| u64::from(e.run)), Some(*v));
            }
        }
    }
}
