//! Runs: the shared, reader-visible unit of the ledger. A run is a contiguous piece of one
//! `SeqHash` chain (at most [`MAX_RUN`] blocks, room reserved at creation, grown only at its tail)
//! plus, per holder, how long a prefix of it the holder has on GPU and on any tier.
//!
//! Key decisions:
//! - **One cache-line-aligned allocation of atomic words**: `[len | capacity | groups] [refs]
//!   [ext] [group 0: mask, cuts × 8] [hash × capacity] [further groups: mask, cuts × 8]`. Every address a
//!   query needs — the first line, group 0's cuts, any hash — follows from the run's address and
//!   the length the head table gives with it, so a query prefetches a run's lines before it reads
//!   any of them. A run's published hashes never change, so a query that found a run by its first
//!   block compares the rest with the prompt in one comparison (the chain property: two chains that
//!   agree at position j agree at every position before it) and, on a mismatch, finds the
//!   divergence by binary search.
//! - **Runs grow at their tail.** A store that continues a run's last block appends to it while
//!   it has room (capacity reserved at creation: 12 blocks for a short store, four times a store
//!   of 16 or more, twice the run it continues; at most 64 — see
//!   [`capacity_for`]), so a chain stored in 16-block events is one run, and one lookup, not four. Appends are made under
//!   the head table's shard lock of the run's first block: hashes first, then the length (Release),
//!   then the head table's value; a reader uses the length it read with the run, so it never reads
//!   a hash that was not published with it.
//! - **Per holder, two cuts** (the first offset it lacks, on GPU and on any tier) in one 16-bit
//!   word, four to an atomic word, a group's 32 holders in eight words. Cuts are absolute offsets, so they stay
//!   true when the run grows. Each holder's writer owns its bits and changes them with one
//!   `fetch_xor`; there is no lock on coverage, and a reader reads a state the holder had.
//! - **Per group, a mask word** `L << 32 | holders`: holders whose both cuts were at least `L`
//!   when they set their bit. It is only a fast path — a query whose matched span ends by `L` takes
//!   those holders as covering it without reading their cuts; every other holder costs a cut read.
//!   A holder clears its bit when its cuts drop (after writing them), and one that has the whole
//!   run at a greater length than `L` raises `L`, clearing the others' bits (they fall back to
//!   their cuts, which stay exact, until they publish again). Clearing is always safe; setting
//!   needs the holder's cuts to reach `L`.
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

/// Words per group: the mask word, then the cut words.
const GROUP_WORDS: usize = 1 + CUT_WORDS;

/// Header words: `len | capacity << 8 | groups << 16`, references, extension pointer.
const HEADER: usize = 3;

/// Where the hashes start (after the header and group 0's words).
const HASHES: usize = HEADER + GROUP_WORDS;

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

/// The capacity a new run of `len` blocks with `groups` inline groups reserves. A short store
/// (under 16 blocks) reserves 12, what three cache lines hold with one holder group: a branch
/// that never grows — a request's own suffix — costs three lines, not four. A store of 16 or more reserves four times
/// its length, so that a chain stored in events of 16 blocks is one run. A run that continues a
/// full run of capacity `after` (under 64) reserves at least twice that, so a chain growing a block at a
/// time (decode) takes fewer runs than with a fixed 16-block reservation (12 + 28 + 60 for 100
/// blocks: three runs, not seven). Always at most [`MAX_RUN`], and rounded up to fill the
/// allocation's last unit.
/// (Measured, `examples/branches.rs`: twice for long stores made such a chain two runs, one more
/// lookup per query; four times for short stores made 8-block chains that never grow cost 48 B
/// per block; a fixed 16 made every short branch cost 256 B of run; a minimum of 4 (two lines)
/// saved a line on one-block branches but split a branch that decodes a few blocks in two runs.)
pub(crate) fn capacity_for(len: usize, groups: usize, after: Option<usize>) -> usize {
    let want = if len < 16 { len.max(12) } else { 4 * len };
    let want = want.max(after.map_or(0, |c| 2 * c)).clamp(len, MAX_RUN);
    let units = Run::units(want, groups);
    (units * UNIT_WORDS - HASHES - (groups - 1) * GROUP_WORDS).min(MAX_RUN)
}

impl Run {
    /// A new run of `hashes` (1..=cap) with room for `cap` blocks (at most [`MAX_RUN`]), inline
    /// room for `groups` (at least 1) holder groups and `refs` references, unpublished.
    pub(crate) fn new(hashes: &[u64], cap: usize, groups: usize, refs: u64) -> Run {
        debug_assert!(!hashes.is_empty() && hashes.len() <= cap && cap <= MAX_RUN);
        debug_assert!((1..=GROUPS).contains(&groups));
        let units = Self::units(cap, groups);
        let boxed: Box<[Unit]> = (0..units).map(|_| Unit::zero()).collect();
        let ptr = Box::into_raw(boxed).cast::<AtomicU64>();
        assert!((ptr as u64) >> OFF_SHIFT == 0, "a run allocated above 2^57 cannot be packed");
        // SAFETY: `Box::into_raw` never returns null.
        let run = Run(unsafe { NonNull::new_unchecked(ptr) });
        #[cfg(not(cortex_loom_bug = "run_hashes_late"))]
        for (i, &h) in hashes.iter().enumerate() {
            // Relaxed (all stores here): the run is unpublished; its publication (a Release store
            // of its address) orders them.
            run.w(HASHES + i).store(h, Ordering::Relaxed);
        }
        // Relaxed: as above.
        run.w(0)
            .store(hashes.len() as u64 | ((cap as u64) << 8) | ((groups as u64) << 16), Ordering::Relaxed);
        // Relaxed: as above.
        run.w(1).store(refs, Ordering::Relaxed);
        run
    }

    /// Allocation units of a run of capacity `cap` with `groups` inline groups.
    fn units(cap: usize, groups: usize) -> usize {
        (HASHES + cap + (groups - 1) * GROUP_WORDS).div_ceil(UNIT_WORDS)
    }

    /// Negative control `run_hashes_late`: writes the hashes after the run was published.
    #[cfg(cortex_loom_bug = "run_hashes_late")]
    pub(crate) fn publish_late(self, hashes: &[u64]) {
        for (i, &h) in hashes.iter().enumerate() {
            // Relaxed (negative control): the bug is that this comes after publication.
            self.w(HASHES + i).store(h, Ordering::Relaxed);
        }
    }

    /// Appends `hashes` after the last block (head table shard lock of the run's first block held,
    /// room checked by the caller): the hashes first, then the length.
    fn append(self, hashes: &[u64]) {
        let len = self.len();
        debug_assert!(len + hashes.len() <= self.cap());
        for (i, &h) in hashes.iter().enumerate() {
            // Relaxed: published by the Release store of the length below (and the head table's
            // value after it); no reader reads past the length it was given.
            self.w(HASHES + len + i).store(h, Ordering::Relaxed);
        }
        // Release: a writer that reads the length with Acquire sees the hashes; readers get the
        // length from the head table's value, stored with Release after this.
        self.w(0).fetch_add(hashes.len() as u64, Ordering::Release);
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
        // Acquire: pairs with the Release of `append` (capacity and groups never change).
        self.w(0).load(Ordering::Acquire)
    }

    /// Blocks in the run now (writers; a query uses the length the head table gave it).
    #[inline]
    pub(crate) fn len(self) -> usize {
        (self.header() & 0xff) as usize
    }

    /// Blocks the run has room for.
    #[inline]
    pub(crate) fn cap(self) -> usize {
        ((self.header() >> 8) & 0xff) as usize
    }

    #[inline]
    fn groups(self) -> usize {
        ((self.header() >> 16) & 0xff) as usize
    }

    /// Heap bytes of the run (its extension included).
    pub(crate) fn bytes(self) -> usize {
        let ext = if self.ext().is_some() { (GROUPS - self.groups()) * GROUP_WORDS * 8 } else { 0 };
        Self::units(self.cap(), self.groups()) * std::mem::size_of::<Unit>() + ext
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

    /// Hints the CPU to fetch the lines a query reads of the run when it compares its first `k`
    /// blocks: the first line (header and the first cuts) and the line of hash `k - 1`.
    #[inline]
    pub(crate) fn prefetch_for(self, k: usize) {
        prefetch(self.w(0));
        prefetch(self.w(HASHES + k - 1));
    }

    /// The hash of block `i`.
    #[inline]
    pub(crate) fn hash(self, i: usize) -> u64 {
        // Relaxed: published with the run or by an append before the length that covers `i`.
        self.w(HASHES + i).load(Ordering::Relaxed)
    }

    /// Hints the CPU to fetch the line of hash `i`.
    #[inline]
    pub(crate) fn prefetch(self, i: usize) {
        prefetch(self.w(HASHES + i));
    }

    fn ext(self) -> Option<NonNull<AtomicU64>> {
        // Acquire: pairs with the Release compare-and-swap that installed the extension.
        NonNull::new(self.w(2).load(Ordering::Acquire) as *mut AtomicU64)
    }

    /// Group `g`'s mask word (its cut words follow it), if the run has the group (reader side).
    #[inline]
    fn group(self, g: usize) -> Option<*const AtomicU64> {
        if g == 0 {
            return Some(self.w(HEADER));
        }
        let inline = self.groups();
        if g < inline {
            return Some(self.w(HASHES + self.cap() + (g - 1) * GROUP_WORDS));
        }
        let ext = self.ext()?;
        // SAFETY: the extension holds `(GROUPS - inline) * GROUP_WORDS` words, lives as long as the
        // run, and `g - inline < GROUPS - inline`.
        Some(unsafe { ext.as_ptr().add((g - inline) * GROUP_WORDS) })
    }

    /// Group `g`'s mask word, creating the extension if needed (writer side), and the bytes this
    /// call allocated.
    fn group_mut(self, g: usize) -> (*const AtomicU64, usize) {
        if let Some(w) = self.group(g) {
            return (w, 0);
        }
        let n = (GROUPS - self.groups()) * GROUP_WORDS;
        let fresh: Box<[AtomicU64]> = (0..n).map(|_| AtomicU64::new(0)).collect();
        let fresh = Box::into_raw(fresh).cast::<AtomicU64>();
        // Release: a reader that loads the pointer (Acquire) sees the zeroed words.
        let won = self.w(2).compare_exchange(0, fresh as u64, Ordering::Release, Ordering::Acquire);
        let allocated = if won.is_err() {
            // SAFETY: `fresh` was never published; it is the box made just above.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(fresh, n)) });
            0
        } else {
            n * 8
        };
        (self.group(g).unwrap_or_else(|| unreachable!("the extension was just installed")), allocated)
    }

    /// Four holders' cuts of group `g` (holders `4w..4w + 4`, 16 bits each: GPU cut, then any-tier
    /// cut, a byte each); 0 if the run has no cuts for the group.
    #[inline]
    pub(crate) fn cut_word(self, g: usize, w: usize) -> u64 {
        let Some(group) = self.group(g) else { return 0 };
        // SAFETY: a group's CUT_WORDS cut words follow its mask word; `w < CUT_WORDS`.
        let word = unsafe { &*group.add(1 + w) };
        // Acquire: pairs with the holders' Release updates (`publish`).
        word.load(Ordering::Acquire)
    }

    /// Group `g`'s mask: (`L`, holders whose both cuts were at least `L`); (0, 0) without one.
    #[inline]
    pub(crate) fn mask(self, g: usize) -> (usize, u32) {
        let Some(group) = self.group(g) else { return (0, 0) };
        // SAFETY: the group's mask word.
        // Acquire: pairs with the holders' Release updates (`publish`).
        let v = unsafe { &*group }.load(Ordering::Acquire);
        ((v >> 32) as usize, v as u32)
    }

    /// Holder `bit` of group `g`: (GPU cut, any-tier cut).
    #[inline]
    pub(crate) fn cut(self, g: usize, bit: u32) -> (usize, usize) {
        let v = (self.cut_word(g, bit as usize / 4) >> ((bit % 4) * 16)) as usize;
        (v & 0xff, (v >> 8) & 0xff)
    }

    /// Holder `bit` of group `g` moves its cuts from `old` to `new` (each `gpu | any << 8`).
    /// Only that holder's writer calls this for its bits. Returns the bytes it allocated (the
    /// run's extension, for a group registered after the run was created).
    pub(crate) fn publish(self, g: usize, bit: u32, old: u16, new: u16) -> usize {
        if old == new {
            return 0;
        }
        let (group, allocated) = self.group_mut(g);
        // SAFETY: as in `cut_word`.
        let word = unsafe { &*group.add(1 + bit as usize / 4) };
        // Release: a reader that loads the word (Acquire) sees what this writer published before.
        word.fetch_xor(u64::from(old ^ new) << ((bit % 4) * 16), Ordering::Release);
        // SAFETY: the group's mask word.
        let mask = unsafe { &*group };
        let len = self.len() as u64;
        let whole = u64::from(new & 0xff) == len && u64::from(new >> 8) == len;
        // Acquire: pairs with other holders' Release updates of the mask.
        let mut cur = mask.load(Ordering::Acquire);
        loop {
            let (l, bits) = (cur >> 32, cur as u32 as u64);
            let next = if whole && l == len {
                (l << 32) | bits | (1 << bit)
            } else if whole && l < len {
                // Raise the mask's length: the others' bits held for a shorter run.
                (len << 32) | (1 << bit)
            } else {
                (l << 32) | (bits & !(1 << bit))
            };
            if next == cur {
                break;
            }
            // Release (success): after the cut word above, so a reader that sees the bit sees a
            // state the holder had. Acquire (failure): the next attempt starts from the latest.
            match mask.compare_exchange_weak(cur, next, Ordering::Release, Ordering::Acquire) {
                Ok(_) => break,
                Err(v) => cur = v,
            }
        }
        allocated
    }

    /// Takes one more reference. The caller must already hold one, or hold the head table's shard
    /// lock of the run's first block and have found the run there.
    #[inline]
    pub(crate) fn acquire(self) {
        // Relaxed: a new reference is always derived from a held one (or made under the shard lock
        // that reclamation takes), so no ordering is needed to keep the run alive.
        let before = self.w(1).fetch_add(1, Ordering::Relaxed);
        debug_assert!(before & DEAD == 0, "acquired a reclaimed run");
    }

    /// Drops one reference; true if it was the last (the caller then reclaims the run).
    #[inline]
    pub(crate) fn release(self) -> bool {
        // AcqRel: the last releaser must see every other holder's writes to the run before it is
        // reclaimed (Acquire), and its own before handing it over (Release).
        self.w(1).fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// References now (0 after the last release).
    #[inline]
    pub(crate) fn refs(self) -> u64 {
        // Acquire: read under the shard lock by reclamation; pairs with `release`.
        self.w(1).load(Ordering::Acquire)
    }

    /// Marks the run unlinked (shard lock held, no reference left).
    pub(crate) fn mark_dead(self) {
        // Relaxed: read only by debug assertions and loom checks.
        self.w(1).fetch_or(DEAD, Ordering::Relaxed);
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
            let (inline, units) = (self.groups(), Self::units(self.cap(), self.groups()));
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
        // Relaxed: loom only.
        self.w(0).load(Ordering::Relaxed) == u64::MAX
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
pub(crate) fn create(
    table: &SlotTable,
    seqs: &[u64],
    groups: usize,
    after: Option<usize>,
    guard: &Guard,
) -> (Run, bool) {
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
    let run = Run::new(seqs, capacity_for(seqs.len(), groups, after), groups, 1);
    if bits == 0 {
        // (A key taken by a run of another first block — a 2^-64 collision — leaves this run
        // unpublished: never counted, still correct for its holders' bookkeeping.)
        locked.put(key, run.head_value());
    }
    #[cfg(cortex_loom_bug = "run_hashes_late")]
    run.publish_late(seqs);
    (run, true)
}

/// Appends `seqs` to `run`, whose last block is at `at - 1` as the caller saw it and is the
/// parent of `seqs[0]` (none of `seqs` starts a run): under the shard lock of the run's first
/// block, if the run still ends there, as many as it has room for. Returns how many.
pub(crate) fn append(table: &SlotTable, run: Run, at: usize, seqs: &[u64], guard: &Guard) -> usize {
    let key = head_key(run.hash(0));
    let mut locked = table.lock(key, guard);
    if run.len() != at {
        return 0;
    }
    let n = seqs.len().min(run.cap() - at);
    if n == 0 {
        return 0;
    }
    let before = run.head_value();
    let published = locked.find(key) == before;
    #[cfg(cortex_loom_bug = "len_before_hashes")]
    if published {
        // Negative control: the deliberate bug publishes the new length before the hashes.
        locked.put(key, pack(run, at + n - 1));
    }
    run.append(&seqs[..n]);
    #[cfg(not(cortex_loom_bug = "len_before_hashes"))]
    if published {
        // Release (in `put`): a reader that reads the new length reads the appended hashes.
        locked.put(key, run.head_value());
    }
    n
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
    crate::sync::prefetch(std::ptr::from_ref(w));
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
        let r = Run::new(&hashes, capacity_for(16, 2, None), 2, 1);
        assert_eq!((r.len(), r.cap()), (16, 64));
        assert_eq!(r.hash(15), 16);
        r.publish(0, 5, 0, 3 | (7 << 8));
        assert_eq!(r.cut(0, 5), (3, 7));
        assert_eq!(r.mask(0), (0, 0));
        r.publish(0, 5, 3 | (7 << 8), 16 | (16 << 8));
        assert_eq!(r.cut(0, 5), (16, 16));
        assert_eq!(r.mask(0), (16, 1 << 5));
        r.publish(0, 6, 0, 16 | (16 << 8));
        assert_eq!(r.mask(0), (16, (1 << 5) | (1 << 6)));
        r.publish(1, 2, 0, 1 | (2 << 8));
        assert_eq!(r.cut(1, 2), (1, 2));
        // A group beyond the inline ones goes to the extension.
        assert_eq!(r.cut(7, 31), (0, 0));
        assert!(r.publish(7, 31, 0, 2 | (16 << 8)) > 0);
        assert_eq!(r.cut(7, 31), (2, 16));
        assert_eq!(r.cut(0, 5), (16, 16));
        // Appends keep every cut and hash.
        r.append(&[17, 18]);
        assert_eq!(
            (r.len(), r.hash(16), r.hash(17), r.cut(0, 5), r.cut(1, 2)),
            (18, 17, 18, (16, 16), (1, 2))
        );
        // The whole grown run raises the mask's length and drops the bits of a shorter run.
        r.publish(0, 6, 16 | (16 << 8), 18 | (18 << 8));
        assert_eq!(r.mask(0), (18, 1 << 6));
        r.publish(0, 6, 18 | (18 << 8), 17 | (18 << 8));
        assert_eq!(r.mask(0), (18, 0));
        let loc = pack(r, 9);
        assert_eq!(unpack(loc), (r, 9));
        assert_eq!(Run::from_head_value(r.head_value()), (r, 18));
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

    use crate::table::loom_models::check;

    /// Releases the writer's reference to `run` on another thread, reclaiming it if it was the
    /// last.
    fn release_in_thread(t: &Arc<SlotTable>, run: Run) -> thread::JoinHandle<()> {
        let t = t.clone();
        thread::spawn(move || {
            let g = epoch::pin();
            if run.release() {
                reclaim(&t, run, &g);
            }
        })
    }

    /// A published run (one reference, its writer's).
    fn published(t: &SlotTable) -> Run {
        let g = epoch::pin();
        create(t, &[H0, H1], 1, None, &g).0
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
                    create(&t, &[H0, H1], 1, None, &g);
                })
            };
            let g = epoch::pin();
            let bits = t.get(head_key(H0), &g);
            let seen = (bits != 0).then(|| {
                // Found in the table under a pinned guard.
                let (run, _) = Run::from_head_value(bits);
                (run.hash(0), run.hash(1))
            });
            drop(g);
            w.join().unwrap();
            match seen {
                Some(h) if h != (H0, H1) => Some(format!("reader found the run without its hashes: {h:x?}")),
                _ => None,
            }
        });
    }

    /// Append: a reader that gets a grown run's new length from the head table reads the appended
    /// hashes. Negative control: `cortex_loom_bug="len_before_hashes"`.
    #[test]
    #[cfg_attr(cortex_loom_bug = "len_before_hashes", should_panic(expected = "without its hash"))]
    fn append_is_published_with_its_hashes() {
        check(|| {
            let t = Arc::new(SlotTable::new());
            let run = {
                let g = epoch::pin();
                create(&t, &[H0], 1, None, &g).0
            };
            let w = {
                let t = t.clone();
                thread::spawn(move || {
                    let g = epoch::pin();
                    append(&t, run, 1, &[H1], &g);
                })
            };
            let g = epoch::pin();
            let (found, len) = Run::from_head_value(t.get(head_key(H0), &g));
            let seen = (len == 2).then(|| found.hash(1));
            drop(g);
            w.join().unwrap();
            match seen {
                Some(h) if h != H1 => Some(format!("reader got the grown length without its hash: {h:#x}")),
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
            let w = release_in_thread(&t, run);
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
            let w = release_in_thread(&t, run);
            let g = epoch::pin();
            let found = find(&t, H0, &g);
            drop(g);
            w.join().unwrap();
            match found {
                Some(r) if r.refs() & DEAD != 0 => {
                    Some("a found run was reclaimed under its finder".to_owned())
                }
                _ => None,
            }
        });
    }
}
