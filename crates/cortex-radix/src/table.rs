//! The head table: `first SeqHash of a run → run`, read lock-free, written under short shard locks.
//!
//! One slot is 16 bytes: an `AtomicU64` key (the `SeqHash` of a run's first block; see
//! `run.rs`) and an `AtomicU64` value (the run's address packed with its length less one, 0 once
//! the run is gone). Only run
//! heads are keys: a query looks a block up only where a run ends or the prompt leaves it, and
//! by the chain property the block there is either absent or the first block of another run. The
//! table is split into 16 shards by the key's top bits; each shard is one linear-probing array behind
//! a crossbeam-epoch pointer.
//!
//! Key decisions:
//! - **A slot never changes key.** A key goes `EMPTY → key` once; when its run is reclaimed, the
//!   slot stays as a *dead* entry (value 0) that the same key may revive. A reader that matched a
//!   key therefore only ever reads a value that belonged to that key (never another key's: the ABA
//!   that slot reuse would cause), and may read 0 — an under-count, never an over-count.
//! - **Reclamation is structural and whole-shard:** when a shard's live + dead entries reach 4/5
//!   of its slots, or its live entries fall under 1/8, the writer copies the live entries into a
//!   fresh array sized for twice the live count, publishes it with one pointer swap and retires
//!   the old array through the epoch, so no dead entry outlives the next rebuild of its shard.
//! - Writers take the shard's lock ([`SlotTable::lock`]) to look a key up and change it in one
//!   step (creating a run, taking a reference to a found one, reclaiming one); readers never do.

use std::sync::atomic::AtomicUsize as StdAtomicUsize;

use crate::sync::epoch::{self, Atomic, Guard, Owned, Shared};
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};

/// The reserved key of a never-used slot. [`crate::ledger`] never produces it as a key.
pub(crate) const EMPTY: u64 = 0;

/// 16 shards: the table has one key per run, not per block (the old per-block table had 64).
#[cfg(not(loom))]
const SHARD_BITS: u32 = 4;
#[cfg(loom)]
const SHARD_BITS: u32 = 0;
const SHARDS: usize = 1 << SHARD_BITS;

#[cfg(not(loom))]
const MIN_CAP: usize = 16;
#[cfg(loom)]
const MIN_CAP: usize = 4;

/// Bytes of one slot.
pub(crate) const SLOT_BYTES: usize = 16;

/// Slots per bucket: one 64-byte cache line holds four keys and their values, so a lookup
/// usually touches one line.
const LANES: usize = 4;

#[cfg_attr(not(loom), repr(C, align(64)))]
struct Bucket {
    keys: [AtomicU64; LANES],
    bits: [AtomicU64; LANES],
}

/// A slot: one key and its value.
struct Slot<'a> {
    key: &'a AtomicU64,
    bits: &'a AtomicU64,
}

/// One shard's probing array: slots in cache-line buckets, probed slot by slot.
pub(crate) struct Table {
    buckets: Box<[Bucket]>,
    /// Set when the table is retired and reclaimed (loom builds only: the loom models check that
    /// no reader ever reads a reclaimed table).
    #[cfg(loom)]
    reclaimed: crate::sync::AtomicBool,
}

impl Table {
    fn new(cap: usize) -> Table {
        Table {
            buckets: (0..cap.div_ceil(LANES))
                .map(|_| Bucket {
                    keys: std::array::from_fn(|_| AtomicU64::new(EMPTY)),
                    bits: std::array::from_fn(|_| AtomicU64::new(0)),
                })
                .collect(),
            #[cfg(loom)]
            reclaimed: crate::sync::AtomicBool::new(false),
        }
    }

    fn cap(&self) -> usize {
        self.buckets.len() * LANES
    }

    #[inline]
    fn slot(&self, i: usize) -> Slot<'_> {
        let b = &self.buckets[i / LANES];
        Slot { key: &b.keys[i % LANES], bits: &b.bits[i % LANES] }
    }

    /// Where `key`'s probe starts: the first slot of its home bucket, the bucket chosen from the
    /// key's bits below the shard bits, scaled to the bucket count (multiply-shift, so counts
    /// need not be powers of two).
    #[inline]
    fn home(&self, key: u64) -> usize {
        ((((key << SHARD_BITS) as u128 * self.buckets.len() as u128) >> 64) as usize) * LANES
    }

    /// Hints the CPU to fetch `key`'s home bucket.
    #[inline]
    fn prefetch(&self, key: u64) {
        crate::sync::prefetch(&raw const self.buckets[self.home(key) / LANES]);
    }

    /// The reader's lookup: the value of `key`, `None` if absent.
    #[inline]
    fn find(&self, key: u64) -> Option<u64> {
        let cap = self.cap();
        let mut i = self.home(key);
        loop {
            let slot = self.slot(i);
            // Acquire: pairs with the Release store that published the key, so the value written
            // before it are visible to this thread.
            let k = slot.key.load(Ordering::Acquire);
            if k == key {
                // loom builds report a read of a reclaimed table as all bits set, for the models
                // to assert on once their loom objects are gone (a panic here would abort).
                #[cfg(loom)]
                if self.reclaimed.load(Ordering::SeqCst) {
                    return Some(u64::MAX);
                }
                // Acquire: a value is only ever stored with Release by the shard's writer.
                return Some(slot.bits.load(Ordering::Acquire));
            }
            if k == EMPTY {
                return None;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Writer-side probe (shard lock held): `Ok(index)` of `key`, or `Err(index)` of the first
    /// empty slot of its probe sequence.
    fn probe(&self, key: u64) -> Result<usize, usize> {
        let cap = self.cap();
        let mut i = self.home(key);
        #[cfg(cortex_loom_bug = "reuse_dead")]
        let mut first_dead = None;
        loop {
            let slot = self.slot(i);
            // Relaxed: keys are only written under the shard lock, which this thread holds.
            let k = slot.key.load(Ordering::Relaxed);
            if k == key {
                return Ok(i);
            }
            #[cfg(cortex_loom_bug = "reuse_dead")]
            // Relaxed: bits are only written under the shard lock, which this thread holds.
            if k != EMPTY && first_dead.is_none() && slot.bits.load(Ordering::Relaxed) == 0 {
                first_dead = Some(i);
            }
            if k == EMPTY {
                #[cfg(cortex_loom_bug = "reuse_dead")]
                if let Some(d) = first_dead {
                    return Err(d);
                }
                return Err(i);
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Fills an unpublished table (no reader can see it yet).
    fn fill(&self, key: u64, bits: u64) {
        let Err(i) = self.probe(key) else { return };
        let slot = self.slot(i);
        // Relaxed: the table is not published yet; its pointer is stored with Release.
        slot.bits.store(bits, Ordering::Relaxed);
        // Relaxed: as above.
        slot.key.store(key, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct ShardState {
    /// Keys with a run.
    live: usize,
    /// Keys whose run is gone (kept until the next rebuild; see the module doc).
    dead: usize,
}

struct Shard {
    table: Atomic<Table>,
    state: Mutex<ShardState>,
}

/// Counters of the whole table, for [`crate::LedgerStats`].
#[derive(Default)]
pub(crate) struct TableCounters {
    /// Bytes of the published arrays (retired arrays awaiting reclamation are not counted).
    pub(crate) bytes: StdAtomicUsize,
    /// Live keys.
    pub(crate) live: StdAtomicUsize,
    /// Dead keys awaiting the next rebuild of their shard.
    pub(crate) dead: StdAtomicUsize,
    /// Shard rebuilds (growth, cleaning and shrinking).
    pub(crate) rebuilds: StdAtomicUsize,
}

/// The sharded table.
pub(crate) struct SlotTable {
    shards: Box<[Shard]>,
    pub(crate) counters: TableCounters,
}

#[inline]
fn shard_of(key: u64) -> usize {
    key.checked_shr(64 - SHARD_BITS).unwrap_or(0) as usize
}

/// A shard's lock, held by a writer that looks a key up and changes it atomically (run creation
/// and reclamation; see `ledger.rs`).
pub(crate) struct Locked<'a> {
    table: &'a SlotTable,
    shard: &'a Shard,
    st: MutexGuard<'a, ShardState>,
    guard: &'a Guard,
}

impl Locked<'_> {
    /// The value of `key` (0: absent or dead). Must be a key of this shard.
    pub(crate) fn find(&self, key: u64) -> u64 {
        debug_assert!(std::ptr::eq(self.shard, &self.table.shards[shard_of(key)]));
        // Relaxed: the shard lock orders this load after the previous holder's store.
        let current = self.shard.table.load(Ordering::Relaxed, self.guard);
        // SAFETY: non-null (see `get`); the shard lock is held, so no other writer can unlink it,
        // and `guard` keeps it alive.
        let table = unsafe { current.deref() };
        match table.probe(key) {
            // Relaxed: values are only written under the lock this thread holds.
            Ok(i) => table.slot(i).bits.load(Ordering::Relaxed),
            Err(_) => 0,
        }
    }

    /// Sets `key`'s value (0 marks it dead). Inserts the key if needed (nothing happens for an
    /// absent key set to 0).
    pub(crate) fn put(&mut self, key: u64, value: u64) {
        debug_assert!(key != EMPTY && std::ptr::eq(self.shard, &self.table.shards[shard_of(key)]));
        let (this, shard, guard) = (self.table, self.shard, self.guard);
        let st = &mut *self.st;
        // Relaxed: the shard lock orders this load after the previous holder's store.
        let mut current = shard.table.load(Ordering::Relaxed, guard);
        // SAFETY: as in `find`.
        let mut table = unsafe { current.deref() };
        match table.probe(key) {
            Ok(i) => {
                let slot = table.slot(i);
                // Relaxed: only the lock holder writes values.
                let old = slot.bits.load(Ordering::Relaxed);
                if value == old {
                    return;
                }
                // Release: readers load values with Acquire (see `find`), and a run's words are
                // written before its value is stored here.
                slot.bits.store(value, Ordering::Release);
                if old == 0 {
                    st.dead -= 1;
                    st.live += 1;
                    // Relaxed: a statistics counter; nothing is published through it.
                    this.counters.dead.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    // Relaxed: a statistics counter; nothing is published through it.
                    this.counters.live.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else if value == 0 {
                    st.live -= 1;
                    st.dead += 1;
                    // Relaxed: a statistics counter; nothing is published through it.
                    this.counters.live.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    // Relaxed: a statistics counter; nothing is published through it.
                    this.counters.dead.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if st.live * 8 < table.cap() && table.cap() > MIN_CAP {
                        this.rebuild(shard, st, current, guard);
                    }
                }
            }
            Err(mut i) => {
                if value == 0 {
                    return;
                }
                if (st.live + st.dead + 1) * 5 > table.cap() * 4 {
                    current = this.rebuild(shard, st, current, guard);
                    // SAFETY: just published by this thread under the lock; `guard` is pinned.
                    table = unsafe { current.deref() };
                    match table.probe(key) {
                        Err(j) => i = j,
                        Ok(_) => {
                            unreachable!("a rebuilt table holds only live keys, and this key was absent")
                        }
                    }
                }
                let slot = table.slot(i);
                #[cfg(cortex_loom_bug = "reuse_dead")]
                // Relaxed: keys are only written under the shard lock, which this thread holds.
                let was_dead = slot.key.load(Ordering::Relaxed) != EMPTY;
                #[cfg(cortex_loom_bug = "reuse_dead")]
                if was_dead {
                    st.dead -= 1;
                    // Relaxed: a statistics counter; nothing is published through it.
                    this.counters.dead.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                }
                #[cfg(not(cortex_loom_bug = "publish_key_first"))]
                {
                    // Relaxed: published by the Release store of the key just below.
                    slot.bits.store(value, Ordering::Relaxed);
                    // Release: a reader that sees the key (Acquire) sees the value stored above.
                    slot.key.store(key, Ordering::Release);
                }
                #[cfg(cortex_loom_bug = "publish_key_first")]
                {
                    // Release (negative control): the deliberate bug is the order, key before value.
                    slot.key.store(key, Ordering::Release);
                    // Release: as above.
                    slot.bits.store(value, Ordering::Release);
                }
                st.live += 1;
                // Relaxed: a statistics counter; nothing is published through it.
                this.counters.live.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

impl SlotTable {
    pub(crate) fn new() -> SlotTable {
        let counters = TableCounters::default();
        // Relaxed: a statistics counter; nothing is published through it.
        counters.bytes.store(SHARDS * MIN_CAP * SLOT_BYTES, std::sync::atomic::Ordering::Relaxed);
        SlotTable {
            shards: (0..SHARDS)
                .map(|_| Shard {
                    table: Atomic::new(Table::new(MIN_CAP)),
                    state: Mutex::new(ShardState::default()),
                })
                .collect(),
            counters,
        }
    }

    /// The value of `key` (0: absent or dead). Lock-free; `guard` must stay pinned while the
    /// caller uses the answer.
    #[inline]
    pub(crate) fn get(&self, key: u64, guard: &Guard) -> u64 {
        self.lookup(key, guard).unwrap_or(0)
    }

    /// Hints the CPU to fetch the cache line where `key`'s lookup starts.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64, guard: &Guard) {
        let shard = &self.shards[shard_of(key)];
        // Acquire: as in `lookup`.
        let table = shard.table.load(Ordering::Acquire, guard);
        // SAFETY: as in `lookup`.
        unsafe { table.deref() }.prefetch(key);
    }

    /// The value of `key`, `None` if the key is absent (a dead key reads `Some(0)`).
    #[inline]
    pub(crate) fn lookup(&self, key: u64, guard: &Guard) -> Option<u64> {
        let shard = &self.shards[shard_of(key)];
        // Acquire: pairs with the Release store that published this table after filling it.
        let table = shard.table.load(Ordering::Acquire, guard);
        // SAFETY: a shard's pointer is never null (set in `new`, replaced only by non-null
        // tables), and a table unlinked by `rebuild` is reclaimed only after every guard pinned
        // before its unlinking is dropped; `guard` is pinned now, so the table is alive.
        unsafe { table.deref() }.find(key)
    }

    /// Locks `key`'s shard.
    pub(crate) fn lock<'a>(&'a self, key: u64, guard: &'a Guard) -> Locked<'a> {
        let shard = &self.shards[shard_of(key)];
        Locked { table: self, shard, st: shard.state.lock(), guard }
    }

    /// Sets `key`'s value under its shard's lock (tests and models).
    #[cfg(test)]
    pub(crate) fn set(&self, key: u64, value: u64, guard: &Guard) {
        self.lock(key, guard).put(key, value);
    }

    /// Copies the live entries of `old` into a fresh table sized for twice their number,
    /// publishes it and retires `old`. Shard lock held by the caller.
    fn rebuild<'g>(
        &self,
        shard: &Shard,
        st: &mut ShardState,
        old: Shared<'g, Table>,
        guard: &'g Guard,
    ) -> Shared<'g, Table> {
        // SAFETY: the caller holds the shard lock and `guard`; `old` is the published table.
        let old_table = unsafe { old.deref() };
        let new_cap = (st.live * 2 + 2).max(MIN_CAP);
        let fresh = Table::new(new_cap);
        let new_cap = fresh.cap();
        for i in 0..old_table.cap() {
            let slot = old_table.slot(i);
            // Relaxed: written only under the lock this thread holds.
            let (k, b) = (slot.key.load(Ordering::Relaxed), slot.bits.load(Ordering::Relaxed));
            if k != EMPTY && b != 0 {
                fresh.fill(k, b);
            }
        }
        // Relaxed: statistics counters; nothing is published through them.
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.dead.fetch_sub(st.dead, relaxed);
        st.dead = 0;
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.bytes.fetch_add(new_cap * SLOT_BYTES, relaxed);
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.bytes.fetch_sub(old_table.cap() * SLOT_BYTES, relaxed);
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.rebuilds.fetch_add(1, relaxed);
        let fresh = Owned::new(fresh).into_shared(guard);
        // Release: publishes the filled table to readers, which load the pointer with Acquire.
        shard.table.store(fresh, Ordering::Release);
        retire(old, guard);
        fresh
    }
}

/// Hands an unlinked table to the epoch for reclamation once no reader can hold it.
fn retire(old: Shared<'_, Table>, guard: &Guard) {
    #[cfg(not(loom))]
    {
        // SAFETY: `old` was unlinked by the caller's pointer swap, so no reader that pins from
        // now on can reach it; `defer_destroy` frees it only after every guard pinned before now
        // (the only ones that may hold it) has been dropped.
        unsafe { guard.defer_destroy(old) };
    }
    #[cfg(loom)]
    {
        let raw = old.as_raw() as usize;
        let reclaim = move || {
            // SAFETY: loom models leak retired tables (they are tiny) and only flag them, so the
            // pointer stays valid; the flag is what the models check.
            let table = unsafe { &*(raw as *const Table) };
            table.reclaimed.store(true, Ordering::SeqCst);
        };
        #[cfg(not(cortex_loom_bug = "free_now"))]
        guard.defer(reclaim);
        #[cfg(cortex_loom_bug = "free_now")]
        reclaim();
    }
    // Retirements are rare (one per shard rebuild): push them to the global queue now so that
    // memory comes back promptly instead of waiting for this thread's bag to fill.
    guard.flush();
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // A loom model that failed unwinds outside loom's execution, where loom atomics cannot
        // be touched; leak instead (loom builds only leak anyway).
        #[cfg(loom)]
        if std::thread::panicking() {
            return;
        }
        // SAFETY: `&mut self` means no reader or writer is left; each shard owns its table.
        let guard = unsafe { epoch::unprotected() };
        for shard in self.shards.iter() {
            // Relaxed: `&mut self`, no other thread can see the table any more.
            let t = shard.table.swap(Shared::null(), Ordering::Relaxed, guard);
            if !t.is_null() {
                #[cfg(not(loom))]
                // SAFETY: unique owner (see above); the pointer came from `Owned::new`.
                drop(unsafe { t.into_owned() });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn grows_cleans_and_shrinks() {
        let t = SlotTable::new();
        let g = epoch::pin();
        let keys: Vec<u64> = (1..=5000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1).collect();
        for (n, &k) in keys.iter().enumerate() {
            t.set(k, n as u64 + 1, &g);
        }
        for (n, &k) in keys.iter().enumerate() {
            assert_eq!(t.get(k, &g), n as u64 + 1);
        }
        // Relaxed: a statistics counter; nothing is published through it.
        assert_eq!(t.counters.live.load(std::sync::atomic::Ordering::Relaxed), 5000);
        // Relaxed: a statistics counter; nothing is published through it.
        let grown = t.counters.bytes.load(std::sync::atomic::Ordering::Relaxed);
        for &k in &keys {
            t.set(k, 0, &g);
            assert_eq!(t.get(k, &g), 0);
        }
        // Relaxed: a statistics counter; nothing is published through it.
        assert_eq!(t.counters.live.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Relaxed: a statistics counter; nothing is published through it.
        let shrunk = t.counters.bytes.load(std::sync::atomic::Ordering::Relaxed);
        assert!(grown > 4 * shrunk, "never grew: {grown}");
        assert_eq!(shrunk, SHARDS * MIN_CAP * SLOT_BYTES, "no structural reclamation: {grown} -> {shrunk}");
    }

    #[test]
    fn dead_entries_revive_with_their_own_key_only() {
        let t = SlotTable::new();
        let g = epoch::pin();
        t.set(42 << 1, 7, &g);
        t.set(42 << 1, 0, &g);
        // Relaxed: a statistics counter; nothing is published through it.
        assert_eq!(t.counters.dead.load(std::sync::atomic::Ordering::Relaxed), 1);
        t.set(43 << 1, 9, &g);
        assert_eq!(t.get(42 << 1, &g), 0);
        assert_eq!(t.get(43 << 1, &g), 9);
        t.set(42 << 1, 11, &g);
        assert_eq!(t.get(42 << 1, &g), 11);
        assert_eq!(t.lock(42 << 1, &g).find(42 << 1), 11);
        // Relaxed: a statistics counter; nothing is published through it.
        assert_eq!(t.counters.dead.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}

/// loom models of the publish / read / reclaim paths (run by `cargo xtask loom`). Each has a
/// negative control: built with its deliberate bug (`CORTEX_LOOM_BUG=<name>`, which `build.rs`
/// turns into `--cfg cortex_loom_bug="<name>"`), the model must fail — it is then
/// `#[should_panic]`, so `cargo xtask loom` runs the suite once per bug and expects green.
#[cfg(all(test, loom))]
pub(crate) mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Keys with the same home slot (0) in a one-shard table of 4 slots.
    const A: u64 = 0x1000_0000_0000_0001;
    const B: u64 = 0x1000_0000_0000_0002;
    const C: u64 = 0x1000_0000_0000_0003;
    const D: u64 = 0x1000_0000_0000_0004;

    /// Runs `model` under loom; the first violation any interleaving reports is asserted once
    /// loom is done (a panic inside a model would unwind through epoch thread-locals that loom
    /// has already torn down, and abort). Shared with the run models (`run.rs`).
    pub(crate) fn check(model: impl Fn() -> Option<String> + Sync + Send + 'static) {
        let found = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let sink = found.clone();
        loom::model(move || {
            if let Some(v) = model() {
                sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(v);
            }
        });
        let violation = found.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        assert!(violation.is_none(), "{}", violation.unwrap_or_default());
    }

    /// Publish: a reader that finds a freshly inserted key sees the bits inserted with it.
    /// Negative control: `cortex_loom_bug="publish_key_first"`.
    #[test]
    #[cfg_attr(cortex_loom_bug = "publish_key_first", should_panic(expected = "without its bits"))]
    fn publish_key_with_bits() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            // Register this thread with the epoch collector before the race (as the other
            // models do by writing first); the collector's own set-up is not under test here.
            drop(epoch::pin());
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    t.set(A, 0xA1, &g);
                })
            };
            let g = epoch::pin();
            let seen = t.lookup(A, &g);
            drop(g);
            w.join().unwrap();
            match seen {
                Some(bits) if bits != 0xA1 => Some(format!("reader saw the key without its bits: {bits:#x}")),
                _ => None,
            }
        });
    }

    /// No ABA: a reader that matched key A never reads bits that belong to key B, even while A
    /// dies and B is inserted on the same probe path. Negative control:
    /// `cortex_loom_bug="reuse_dead"` (a new key takes over a dead slot).
    #[test]
    #[cfg_attr(cortex_loom_bug = "reuse_dead", should_panic(expected = "saw B's holder"))]
    fn dead_slot_is_never_reused_by_another_key() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            {
                let g = epoch::pin();
                t.set(A, 0xA1, &g);
            }
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    t.set(A, 0, &g);
                    t.set(B, 0xB1, &g);
                })
            };
            let g = epoch::pin();
            let bits = t.get(A, &g);
            drop(g);
            w.join().unwrap();
            (bits == 0xB1).then(|| format!("reader of A saw B's holder: {bits:#x}"))
        });
    }

    /// Reclaim: a reader pinned before a rebuild never reads the old table after it has been
    /// reclaimed, and finds the key in the old or the new table. Negative control:
    /// `cortex_loom_bug="free_now"` (reclaim without waiting for the epoch).
    #[test]
    #[cfg_attr(cortex_loom_bug = "free_now", should_panic(expected = "reclaimed table"))]
    fn rebuild_reclaims_only_after_readers_leave() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            {
                let g = epoch::pin();
                t.set(A, 0xA1, &g);
                t.set(B, 0xB1, &g);
                t.set(C, 0xC1, &g);
            }
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    // MIN_CAP is 4 under loom and the maximum load 4/5: the fourth key forces a
                    // rebuild, which retires the table the reader may be reading.
                    t.set(D, 0xD1, &g);
                })
            };
            let g = epoch::pin();
            let bits = t.get(A, &g);
            drop(g);
            w.join().unwrap();
            match bits {
                u64::MAX => Some("reader used a reclaimed table".to_owned()),
                b if b != 0xA1 => Some(format!("A lost in the rebuild: {b:#x}")),
                _ => None,
            }
        });
    }
}
