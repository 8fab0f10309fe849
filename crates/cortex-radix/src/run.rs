//! Runs: the shared, reader-visible unit of the ledger. A run is a contiguous piece of one
//! `SeqHash` chain (at most [`MAX_RUN`] blocks, fixed at creation) plus, per holder, how long a
//! prefix of it the holder has on GPU and on any tier.
//!
//! Key decisions:
//! - **One cache-line-aligned allocation of atomic words**: `[len | groups] [last hash] [refs]
//!   [ext] [masks × groups] [cuts × 8 × groups] [hash × len]`. A run's hashes never change after
//!   it is published, so a query that found a run by its first block compares the rest of the run
//!   with the prompt in one comparison (the chain property: two chains that agree at position j
//!   agree at every position before it) and, on a mismatch, finds the divergence by binary search.
//!   The first line holds the length, the last hash and the masks of up to four groups, so a run
//!   the prompt covers whole, whose holders have it whole, costs the query one line.
//! - **Per holder, two cuts** (the first offset it lacks, on GPU and on any tier) in one 16-bit
//!   word, four to an atomic word, plus per group of 32 holders a mask word of the holders whose
//!   cuts are the whole run (low half GPU, high half any tier): the query's fast path is one mask
//!   word; only holders that end inside the run cost a second load. Each holder's writer owns its
//!   bits and changes them with one `fetch_xor`; there is no lock on coverage. Cut words are always
//!   written, full or not, so a reader that reads a cut word reads a state the holder had.
//! - **Groups registered later than the run** live in an extension allocated once, on demand,
//!   with a compare-and-swap.
//! - **Reference counted, reclaimed through the epoch:** every holder that has a block of the run,
//!   every deterministic-index entry and every pending graft holds one reference. The last release
//!   unlinks the run from the head table under its shard lock and hands it to the epoch, which frees
//!   it once no query can still read it (see `Ledger` and `table.rs`).

use std::ptr::NonNull;

use crate::slots::GROUP;
use crate::sync::epoch::Guard;
use crate::sync::{AtomicU64, Ordering};
use crate::table::{EMPTY, SlotTable};

/// The most blocks in one run (a cut fits in a byte; a holder's blocks of a run in a `u64`).
pub(crate) const MAX_RUN: usize = 64;

/// Holder groups a ledger can have (`MAX_HOLDERS / GROUP`).
pub(crate) const GROUPS: usize = 32;

/// Cut words per group: 32 16-bit cuts, four per atomic word.
const CUT_WORDS: usize = GROUP as usize / 4;

/// Words per group in the extension: the mask word and the cut words.
const GROUP_WORDS: usize = 1 + CUT_WORDS;

/// Header words: `len | groups << 8`, last hash, references, extension pointer.
const HEADER: usize = 4;

/// The allocation unit: a cache line of words (loom: one word, as loom's atomics are larger).
#[cfg(not(loom))]
#[repr(C, align(64))]
struct Unit([AtomicU64; 8]);
#[cfg(not(loom))]
const UNIT_WORDS: usize = 8;
#[cfg(loom)]
#[allow(dead_code, reason = "only the memory of a unit is used, through the run's word pointer")]
struct Unit(AtomicU64);
#[cfg(loom)]
const UNIT_WORDS: usize = 1;

impl Unit {
    fn zero() -> Unit {
        #[cfg(not(loom))]
        {
            Unit(std::array::from_fn(|_| AtomicU64::new(0)))
        }
        #[cfg(loom)]
        {
            Unit(AtomicU64::new(0))
        }
    }
}

/// Set in the reference word once the run is unlinked (debugging aid and loom check).
const DEAD: u64 = 1 << 63;

/// A handle to a run: a thin pointer to its first word. Copyable; the run itself lives until its
/// last reference is released and the epoch has passed (see the module documentation). A handle
/// is only used while its user holds a reference or is pinned and found it in the head table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Run(NonNull<AtomicU64>);

// SAFETY: a run is only atomics; handles are shared between threads under the reference and epoch
// rules above.
unsafe impl Send for Run {}
// SAFETY: as above.
unsafe impl Sync for Run {}

/// Bit position above which a location packs the offset (user-space pointers are below 2^57).
const OFF_SHIFT: u32 = 57;

/// A block's location: its run and offset, packed in one `u64` (a holder's entry keeps it).
#[inline]
pub(crate) fn pack(run: Run, off: usize) -> u64 {
    run.bits() | ((off as u64) << OFF_SHIFT)
}

/// The run and offset of a packed location.
#[inline]
pub(crate) fn unpack(loc: u64) -> (Run, usize) {
    // SAFETY: packed locations are only made by `pack` from a live run.
    (unsafe { Run::from_bits(loc & ((1 << OFF_SHIFT) - 1)) }, (loc >> OFF_SHIFT) as usize)
}

impl Run {
    /// A new run of `hashes` (1..=MAX_RUN) with inline room for `groups` holder groups and `refs`
    /// references, unpublished.
    pub(crate) fn new(hashes: &[u64], groups: usize, refs: u64) -> Run {
        debug_assert!(!hashes.is_empty() && hashes.len() <= MAX_RUN && groups <= GROUPS);
        let units = Self::units(hashes.len(), groups);
        let boxed: Box<[Unit]> = (0..units).map(|_| Unit::zero()).collect();
        let ptr = Box::into_raw(boxed).cast::<AtomicU64>();
        assert!((ptr as u64) >> OFF_SHIFT == 0, "a run allocated above 2^57 cannot be packed");
        // SAFETY: `Box::into_raw` never returns null.
        let run = Run(unsafe { NonNull::new_unchecked(ptr) });
        #[cfg(not(cortex_loom_bug = "run_hashes_late"))]
        let base = HEADER + groups * GROUP_WORDS;
        // Relaxed (all stores here): the run is unpublished; its publication (a Release store of
        // its address) orders them.
        run.w(0).store(hashes.len() as u64 | ((groups as u64) << 8), Ordering::Relaxed);
        #[cfg(not(cortex_loom_bug = "run_hashes_late"))]
        {
            // Relaxed: as above.
            run.w(1).store(hashes[hashes.len() - 1], Ordering::Relaxed);
            for (i, &h) in hashes.iter().enumerate() {
                // Relaxed: as above.
                run.w(base + i).store(h, Ordering::Relaxed);
            }
        }
        // Relaxed: as above.
        run.w(2).store(refs, Ordering::Relaxed);
        run
    }

    /// Allocation units of a run of `len` blocks with `groups` inline groups.
    fn units(len: usize, groups: usize) -> usize {
        (HEADER + groups * GROUP_WORDS + len).div_ceil(UNIT_WORDS)
    }

    /// Negative control `run_hashes_late`: writes the hashes after the run was published.
    #[cfg(cortex_loom_bug = "run_hashes_late")]
    pub(crate) fn publish_late(self, hashes: &[u64]) {
        let base = HEADER + self.groups() * GROUP_WORDS;
        // Relaxed (negative control): the bug is that this comes after publication.
        self.w(1).store(hashes[hashes.len() - 1], Ordering::Relaxed);
        for (i, &h) in hashes.iter().enumerate() {
            // Relaxed (negative control): as above.
            self.w(base + i).store(h, Ordering::Relaxed);
        }
    }

    #[inline]
    pub(crate) fn bits(self) -> u64 {
        self.0.as_ptr() as u64
    }

    /// # Safety
    /// `bits` must come from [`Run::bits`] of a run that is still allocated.
    #[inline]
    pub(crate) unsafe fn from_bits(bits: u64) -> Run {
        // SAFETY: the caller passes a non-null run pointer.
        Run(unsafe { NonNull::new_unchecked(bits as *mut AtomicU64) })
    }

    #[inline]
    fn w(self, i: usize) -> &'static AtomicU64 {
        // SAFETY: `i` is within the run's words (callers index from its header), and the run is
        // alive while the handle is used (the reference and epoch rules of the module doc); the
        // `'static` never escapes a caller that holds one of them.
        unsafe { &*self.0.as_ptr().add(i) }
    }

    #[inline]
    fn header(self) -> u64 {
        // Relaxed: immutable after creation; the run's publication (Release) orders it.
        self.w(0).load(Ordering::Relaxed)
    }

    /// Blocks in the run.
    #[inline]
    pub(crate) fn len(self) -> usize {
        (self.header() & 0xff) as usize
    }

    #[inline]
    fn groups(self) -> usize {
        ((self.header() >> 8) & 0xff) as usize
    }

    /// Heap bytes of the run (its extension included).
    pub(crate) fn bytes(self) -> usize {
        let ext = if self.ext().is_some() { (GROUPS - self.groups()) * GROUP_WORDS * 8 } else { 0 };
        Self::units(self.len(), self.groups()) * std::mem::size_of::<Unit>() + ext
    }

    /// The head table's value for this run: its address and its length less one, packed like a
    /// location, so that a query knows where the run ends before it reads the run.
    #[inline]
    pub(crate) fn head_value(self) -> u64 {
        pack(self, self.len() - 1)
    }

    /// The run and its length of a head-table value.
    #[inline]
    pub(crate) fn from_head_value(v: u64) -> (Run, usize) {
        let (run, last) = unpack(v);
        (run, last + 1)
    }

    /// Hints the CPU to fetch the run's first line.
    #[inline]
    pub(crate) fn prefetch_head(self) {
        prefetch(self.w(0));
    }

    /// The hash of the last block (in the first line).
    #[inline]
    pub(crate) fn last(self) -> u64 {
        // Relaxed: immutable after creation; published with the run.
        self.w(1).load(Ordering::Relaxed)
    }

    /// The hash of block `i`.
    #[inline]
    pub(crate) fn hash(self, i: usize) -> u64 {
        debug_assert!(i < self.len());
        // Relaxed: immutable after creation; published with the run.
        self.w(HEADER + self.groups() * GROUP_WORDS + i).load(Ordering::Relaxed)
    }

    /// Hints the CPU to fetch the line of hash `i`.
    #[inline]
    pub(crate) fn prefetch(self, i: usize) {
        prefetch(self.w(HEADER + self.groups() * GROUP_WORDS + i));
    }

    fn ext(self) -> Option<NonNull<AtomicU64>> {
        // Acquire: pairs with the Release compare-and-swap that installed the extension.
        NonNull::new(self.w(3).load(Ordering::Acquire) as *mut AtomicU64)
    }

    /// Group `g`'s mask word and first cut word, if the run has them (reader side).
    #[inline]
    fn group(self, g: usize) -> Option<(&'static AtomicU64, *const AtomicU64)> {
        let inline = self.groups();
        if g < inline {
            let cuts: *const AtomicU64 = self.w(HEADER + inline + g * CUT_WORDS);
            return Some((self.w(HEADER + g), cuts));
        }
        let ext = self.ext()?;
        // SAFETY: the extension holds `(GROUPS - inline) * GROUP_WORDS` words, lives as long as the
        // run, and `g - inline < GROUPS - inline`.
        let mask = unsafe { &*ext.as_ptr().add((g - inline) * GROUP_WORDS) };
        let cuts: *const AtomicU64 = mask;
        // SAFETY: the cut words follow the mask word within the group's words.
        Some((mask, unsafe { cuts.add(1) }))
    }

    /// Group `g`'s mask word and first cut word, creating the extension if needed (writer side),
    /// and the bytes this call allocated.
    fn group_mut(self, g: usize) -> ((&'static AtomicU64, *const AtomicU64), usize) {
        if let Some(w) = self.group(g) {
            return (w, 0);
        }
        let n = (GROUPS - self.groups()) * GROUP_WORDS;
        let fresh: Box<[AtomicU64]> = (0..n).map(|_| AtomicU64::new(0)).collect();
        let fresh = Box::into_raw(fresh).cast::<AtomicU64>();
        // Release: a reader that loads the pointer (Acquire) sees the zeroed words.
        let won = self.w(3).compare_exchange(0, fresh as u64, Ordering::Release, Ordering::Acquire);
        let allocated = if won.is_err() {
            // SAFETY: `fresh` was never published; it is the box made just above.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(fresh, n)) });
            0
        } else {
            n * 8
        };
        (self.group(g).unwrap_or_else(|| unreachable!("the extension was just installed")), allocated)
    }

    /// The masks of group `g`: holders that have the whole run on GPU (low half) and on any tier
    /// (high half); 0 if the run has no block for the group.
    #[inline]
    pub(crate) fn masks(self, g: usize) -> u64 {
        // Acquire: pairs with the holders' Release updates (`publish`).
        self.group(g).map_or(0, |(w, _)| w.load(Ordering::Acquire))
    }

    /// Holder `bit` of group `g`: (GPU cut, any-tier cut).
    #[inline]
    pub(crate) fn cut(self, g: usize, bit: u32) -> (usize, usize) {
        let Some((_, cuts)) = self.group(g) else { return (0, 0) };
        // SAFETY: a group has GROUP / 4 cut words; `bit < GROUP`.
        let word = unsafe { &*cuts.add(bit as usize / 4) };
        // Acquire: pairs with the holder's Release update (`publish`).
        let v = (word.load(Ordering::Acquire) >> ((bit % 4) * 16)) as usize;
        (v & 0xff, (v >> 8) & 0xff)
    }

    /// Holder `bit` of group `g` moves its cuts from `old` to `new` (each `gpu | any << 8`).
    /// Only that holder's writer calls this for its bits. Returns the bytes it allocated (the
    /// run's extension, for a group registered after the run was created).
    pub(crate) fn publish(self, g: usize, bit: u32, old: u16, new: u16) -> usize {
        if old == new {
            return 0;
        }
        let len = self.len() as u16;
        let ((mask, cuts), allocated) = self.group_mut(g);
        // SAFETY: as in `cut`.
        let word = unsafe { &*cuts.add(bit as usize / 4) };
        let shift = (bit % 4) * 16;
        // Release: a reader that loads the word (Acquire) sees what this writer published before.
        word.fetch_xor(u64::from(old ^ new) << shift, Ordering::Release);
        let full = |c: u16| (u64::from(c & 0xff == len) << bit) | (u64::from(c >> 8 == len) << (bit + 32));
        let flip = full(old) ^ full(new);
        if flip != 0 {
            // Release: as above.
            mask.fetch_xor(flip, Ordering::Release);
        }
        allocated
    }

    /// Takes one more reference. The caller must already hold one, or hold the head table's shard
    /// lock of the run's first block and have found the run there.
    #[inline]
    pub(crate) fn acquire(self) {
        // Relaxed: a new reference is always derived from a held one (or made under the shard lock
        // that reclamation takes), so no ordering is needed to keep the run alive.
        let before = self.w(2).fetch_add(1, Ordering::Relaxed);
        debug_assert!(before & DEAD == 0, "acquired a reclaimed run");
    }

    /// Drops one reference; true if it was the last (the caller then reclaims the run).
    #[inline]
    pub(crate) fn release(self) -> bool {
        // AcqRel: the last releaser must see every other holder's writes to the run before it is
        // reclaimed (Acquire), and its own before handing it over (Release).
        self.w(2).fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// References now (0 after the last release).
    #[inline]
    pub(crate) fn refs(self) -> u64 {
        // Acquire: read under the shard lock by reclamation; pairs with `release`.
        self.w(2).load(Ordering::Acquire)
    }

    /// Marks the run unlinked (shard lock held, no reference left).
    pub(crate) fn mark_dead(self) {
        // Relaxed: read only by debug assertions and loom checks.
        self.w(2).fetch_or(DEAD, Ordering::Relaxed);
    }

    /// Frees the run.
    ///
    /// # Safety
    /// No thread may use the run any more: it is unlinked and every reader pinned before the
    /// unlinking has unpinned (or the ledger is being dropped).
    pub(crate) unsafe fn free(self) {
        #[cfg(loom)]
        {
            // loom models leak runs (they are tiny) and poison the header instead, for the models
            // to detect a read of a freed run.
            // Relaxed: loom only.
            self.w(0).store(u64::MAX, Ordering::Relaxed);
        }
        #[cfg(not(loom))]
        {
            let (inline, units) = (self.groups(), Self::units(self.len(), self.groups()));
            if let Some(ext) = self.ext() {
                let n = (GROUPS - inline) * GROUP_WORDS;
                // SAFETY: the extension was made by `group_mut` with exactly `n` words.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ext.as_ptr(), n)) });
            }
            let units_ptr = self.0.as_ptr().cast::<Unit>();
            // SAFETY: the run was made by `new` as a boxed slice of exactly `units` units, and the
            // caller guarantees nobody uses it any more.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(units_ptr, units)) });
        }
    }

    /// True once freed (loom builds: a freed run's header is poisoned).
    #[cfg(loom)]
    pub(crate) fn is_freed(self) -> bool {
        self.header() == u64::MAX
    }
}

/// The head-table key of a run whose first block is `seq`: the `SeqHash` itself, the reserved
/// empty key mapped to 1 (a run found under a key is always checked against its first block).
#[inline]
pub(crate) fn head_key(seq: u64) -> u64 {
    if seq == EMPTY { 1 } else { seq }
}

/// The run whose first block is `seq`, with a new reference (writers), if there is one: looked
/// up lock-free, then again under the shard lock, which reclamation takes to unlink a run, so a
/// run found there is alive and may be acquired.
pub(crate) fn find(table: &SlotTable, seq: u64, guard: &Guard) -> Option<Run> {
    let key = head_key(seq);
    if table.get(key, guard) == 0 {
        return None;
    }
    let locked = table.lock(key, guard);
    let bits = locked.find(key);
    if bits == 0 {
        return None;
    }
    // Found under the shard lock (see above).
    let (run, _) = Run::from_head_value(bits);
    if run.hash(0) != seq {
        return None;
    }
    run.acquire();
    Some(run)
}

/// A run of `seqs`, with a new reference: a new one with `groups` inline groups, published in the
/// head table (`true`), or the one another writer published first under the same first block
/// (`false`). The caller saw no run start with `seqs[0]`, and none of the others start one.
pub(crate) fn create(table: &SlotTable, seqs: &[u64], groups: usize, guard: &Guard) -> (Run, bool) {
    let key = head_key(seqs[0]);
    let mut locked = table.lock(key, guard);
    let bits = locked.find(key);
    if bits != 0 {
        // Found under the shard lock (see `find`).
        let (run, _) = Run::from_head_value(bits);
        if run.hash(0) == seqs[0] {
            run.acquire();
            return (run, false);
        }
    }
    let run = Run::new(seqs, groups, 1);
    if bits == 0 {
        // (A key taken by a run of another first block — a 2^-64 collision — leaves this run
        // unpublished: never counted, still correct for its holders' bookkeeping.)
        locked.put(key, run.head_value());
    }
    #[cfg(cortex_loom_bug = "run_hashes_late")]
    run.publish_late(seqs);
    (run, true)
}

/// Reclaims `run`, whose last reference was just released: under the shard lock of its first
/// block, unless a writer found it there and took a reference meanwhile (or another releaser
/// reclaimed it already), unlinks it and hands it to the epoch, which frees it once every reader
/// that may have found it has unpinned. True if this call reclaimed it.
pub(crate) fn reclaim(table: &SlotTable, run: Run, guard: &Guard) -> bool {
    let key = head_key(run.hash(0));
    let mut locked = table.lock(key, guard);
    #[cfg(not(cortex_loom_bug = "reclaim_unlocked"))]
    if run.refs() != 0 {
        return false;
    }
    if locked.find(key) == run.head_value() {
        locked.put(key, 0);
    }
    run.mark_dead();
    drop(locked);
    #[cfg(not(cortex_loom_bug = "free_run_now"))]
    {
        let bits = run.bits();
        guard.defer(move || {
            // SAFETY: the run is unlinked from the head table and no reference to it is left;
            // the epoch runs this only after every guard pinned before the unlinking (the only
            // ones that can still hold it) has been dropped.
            unsafe { Run::from_bits(bits).free() }
        });
        // Reclamations are rare next to lookups: push them to the global queue now so that
        // memory comes back promptly.
        guard.flush();
    }
    #[cfg(cortex_loom_bug = "free_run_now")]
    // SAFETY: none; the negative control frees without waiting for readers.
    unsafe {
        run.free();
    }
    true
}

#[inline]
fn prefetch(w: &AtomicU64) {
    let p: *const AtomicU64 = w;
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    // SAFETY: a prefetch is only a hint; it never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = p;
}

/// The cuts of a holder's blocks of a run: the first offset missing from `bits`.
#[inline]
pub(crate) fn cut_of(bits: u64) -> u16 {
    bits.trailing_ones() as u16
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn coverage_is_published_and_read_back() {
        let hashes: Vec<u64> = (1..=16).collect();
        let r = Run::new(&hashes, 1, 1);
        assert_eq!(r.len(), 16);
        assert_eq!(r.hash(15), 16);
        r.publish(0, 5, 0, 3 | (7 << 8));
        assert_eq!(r.cut(0, 5), (3, 7));
        assert_eq!(r.masks(0), 0);
        r.publish(0, 5, 3 | (7 << 8), 16 | (16 << 8));
        assert_eq!(r.masks(0), (1 << 5) | (1 << 37));
        // A group beyond the inline ones goes to the extension.
        assert_eq!(r.cut(7, 31), (0, 0));
        r.publish(7, 31, 0, 2 | (16 << 8));
        assert_eq!(r.cut(7, 31), (2, 16));
        assert_eq!(r.masks(7), 1 << 63);
        assert_eq!(r.cut(0, 5), (16, 16));
        let loc = pack(r, 9);
        assert_eq!(unpack(loc), (r, 9));
        assert!(r.release(), "the only reference");
        // SAFETY: never published; this test is its only user.
        unsafe { r.free() };
    }
}

/// loom models of publishing, finding and reclaiming runs (run by `cargo xtask loom`), against the
/// real head table and run code. Each has a negative control: built with its deliberate bug
/// (`CORTEX_LOOM_BUG=<name>`), the model must fail — it is then `#[should_panic]`.
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use crate::sync::epoch;
    use loom::sync::Arc;
    use loom::thread;

    const H0: u64 = 0x1000_0000_0000_0011;
    const H1: u64 = 0x2000_0000_0000_0022;

    /// Runs `model` under loom; the first violation any interleaving reports is asserted once
    /// loom is done (as in `table.rs`).
    fn check(model: impl Fn() -> Option<String> + Sync + Send + 'static) {
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

    /// A published run (one reference, its writer's).
    fn published(t: &SlotTable) -> Run {
        let g = epoch::pin();
        create(t, &[H0, H1], 1, &g).0
    }

    /// Publish: a reader that finds a run in the head table reads its hashes.
    /// Negative control: `cortex_loom_bug="run_hashes_late"`.
    #[test]
    #[cfg_attr(cortex_loom_bug = "run_hashes_late", should_panic(expected = "without its hashes"))]
    fn run_is_published_with_its_hashes() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            drop(epoch::pin());
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    create(&t, &[H0, H1], 1, &g);
                })
            };
            let g = epoch::pin();
            let bits = t.get(head_key(H0), &g);
            let seen = (bits != 0).then(|| {
                // Found in the table under a pinned guard.
                let (run, _) = Run::from_head_value(bits);
                (run.hash(0), run.last())
            });
            drop(g);
            w.join().unwrap();
            match seen {
                Some(h) if h != (H0, H1) => Some(format!("reader found the run without its hashes: {h:x?}")),
                _ => None,
            }
        });
    }

    /// Reclaim: a reader that found a run while pinned never reads it freed, even as its last
    /// reference is released and it is reclaimed. Negative control: `cortex_loom_bug="free_run_now"`.
    #[test]
    #[cfg_attr(cortex_loom_bug = "free_run_now", should_panic(expected = "freed run"))]
    fn run_is_freed_only_after_readers_leave() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            let run = published(&t);
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    if run.release() {
                        reclaim(&t, run, &g);
                    }
                })
            };
            let g = epoch::pin();
            let bits = t.get(head_key(H0), &g);
            let freed = (bits != 0).then(|| {
                // Found in the table under a pinned guard.
                let (run, _) = Run::from_head_value(bits);
                run.is_freed()
            });
            drop(g);
            w.join().unwrap();
            (freed == Some(true)).then(|| "reader read a freed run".to_owned())
        });
    }

    /// References: a writer that finds a run (taking a reference) while its last other reference
    /// is released never ends up with a reclaimed run. Negative control:
    /// `cortex_loom_bug="reclaim_unlocked"` (reclamation does not recheck under the lock).
    #[test]
    #[cfg_attr(cortex_loom_bug = "reclaim_unlocked", should_panic(expected = "reclaimed under"))]
    fn a_found_run_is_never_reclaimed() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            let run = published(&t);
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    if run.release() {
                        reclaim(&t, run, &g);
                    }
                })
            };
            let g = epoch::pin();
            let found = find(&t, H0, &g);
            drop(g);
            w.join().unwrap();
            match found {
                Some(r) if r.refs() & DEAD != 0 => Some("a found run was reclaimed under its finder".to_owned()),
                _ => None,
            }
        });
    }
}
