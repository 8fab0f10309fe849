//! The writer: how a holder's events change the ledger — a store's blocks placed in runs or kept
//! as orphans, grafts, removes, clears, the capacity and budget evictions — and how a
//! content-deterministic holder's new block reaches the orphans other such holders keep waiting
//! on it.
//!
//! Key decision: every write is one [`Apply`], made by whoever holds the holder's mutex (its
//! [`HolderWriter`]; rarely `remove_worker`, or another holder's writer applying the grafts it
//! left). It changes the holder's private state ([`Private`]) freely, and what queries read only
//! through the holder's cuts, published once per event for the runs whose offsets changed, and
//! through run references, taken and released here (the last release reclaims the run). A graft
//! for another holder never waits for that holder's mutex: it goes to the holder's mailbox and is
//! applied at once if the mutex is free, else by the write holding it when it unlocks (`deliver`
//! and [`unlock`] pair through `SeqCst` fences); one that meets the mutex held by a read
//! (`Ledger::dump`, `HolderWriter::set_readiness`) waits for the holder's next apply.

use std::sync::Arc;
use std::sync::atomic::Ordering as StdOrdering;

use cortex_hash::kv::{BlockRemoved, BlockStored, EventBatch, HolderId, KvEvent, StoredBlock};
use cortex_hash::{BlockHash, SeqHash, chain};

use super::{ApplyOutcome, HolderShared, LedgerError, LedgerShared, Readiness};
use crate::holder::{COUNTABLE, Entry, HolderRun, NS_NONE, ORPHAN, OrphanInfo, Private, UNCOUNTABLE};
use crate::run::{self, MAX_RUN, Run, head_key, pack, unpack};
use crate::slots::GROUP;
use crate::sync::epoch::{self, Guard};
use crate::sync::{MutexGuard, Ordering, fence};

/// The only handle that writes one holder's blocks. Exactly one exists per registered holder;
/// it is `Send` (the ingest runtime moves it to the thread that owns the holder's events) and
/// not `Clone`.
pub struct HolderWriter {
    shared: Arc<LedgerShared>,
    me: Arc<HolderShared>,
}

impl std::fmt::Debug for HolderWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HolderWriter").field("holder", &self.me.id).field("slot", &self.me.slot).finish()
    }
}

impl HolderWriter {
    /// The writer of holder `me`, just registered in `shared`.
    pub(super) fn new(shared: Arc<LedgerShared>, me: Arc<HolderShared>) -> HolderWriter {
        HolderWriter { shared, me }
    }

    /// The holder this writer writes.
    #[must_use]
    pub fn holder(&self) -> HolderId {
        self.me.id
    }

    fn run(&mut self, f: impl FnOnce(&mut Apply<'_>, &mut Private)) -> Result<ApplyOutcome, LedgerError> {
        let p = self.me.private.lock();
        let _poison = PoisonOnPanic { shared: &self.shared, me: &self.me };
        if self.me.is_poisoned() {
            return Err(LedgerError::Poisoned(self.me.id));
        }
        if self.me.revoked.load(Ordering::SeqCst) {
            // Relaxed: a statistics counter; nothing is published through it.
            self.shared.counters.refused.fetch_add(1, StdOrdering::Relaxed);
            return Err(LedgerError::Revoked(self.me.id));
        }
        let guard = epoch::pin();
        let mut out = ApplyOutcome::default();
        let mut p = p;
        {
            let mut apply = Apply { shared: &self.shared, me: &self.me, guard: &guard, out: &mut out };
            let before = gauges(&p);
            if apply.me.mail.load(Ordering::SeqCst) {
                apply.drain_mail(&mut p);
            }
            f(&mut apply, &mut p);
            apply.report(&mut p, before);
            // Relaxed: a gauge readers poll; nothing is published through it.
            self.me.held.store(p.entries.len() as u64, StdOrdering::Relaxed);
        }
        let c = &self.shared.counters;
        // Relaxed: a statistics counter; nothing is published through it.
        c.unknown_removes.fetch_add(out.unknown_removes, StdOrdering::Relaxed);
        // Relaxed: a statistics counter; nothing is published through it.
        c.grafts.fetch_add(out.grafted, StdOrdering::Relaxed);
        // Relaxed: a counter only this writer increments; readers poll it.
        self.me.applied.fetch_add(out.events, Ordering::Relaxed);
        out.grafted += unlock(&self.shared, &self.me, &guard, p);
        Ok(out)
    }

    /// Applies one event.
    ///
    /// # Errors
    /// [`LedgerError::Revoked`] once the holder's worker was removed (nothing is written).
    pub fn apply(&mut self, event: &KvEvent) -> Result<ApplyOutcome, LedgerError> {
        self.run(|apply, p| apply.event(p, event))
    }

    /// Applies a batch's events in order.
    ///
    /// # Errors
    /// [`LedgerError::Revoked`] once the holder's worker was removed (nothing is written).
    pub fn apply_batch(&mut self, batch: &EventBatch) -> Result<ApplyOutcome, LedgerError> {
        self.run(|apply, p| {
            for ev in &batch.events {
                apply.event(p, ev);
            }
        })
    }

    /// Drops every block of the holder (`AllBlocksCleared`, engine restart, resync). A revoked
    /// writer has nothing left to clear.
    pub fn clear(&mut self) {
        let _ = self.run(|apply, p| {
            apply.clear(p);
            apply.out.events += 1;
        });
    }

    /// Starts this holder's count of lost history at `n` more: for a holder registered again
    /// after [`Ledger::quarantine`], which returns the count of the registration it replaces, so
    /// that whoever compares counts sees the count move on, never repeat.
    pub fn carry_history_lost(&self, n: u64) {
        // Relaxed: a monotone counter read as a status.
        self.me.history_lost.fetch_add(n, StdOrdering::Relaxed);
    }

    /// Records that the ledger lost part of the engine's history for this holder: it was
    /// cleared or started without the engine's earlier events (a gap without replay, a replay
    /// that failed or timed out, a restart, an undecodable batch, a cold start), or evicted for
    /// its capacity or the byte budget blocks the engine may still hold. An engine's own
    /// `AllBlocksCleared` is not such a loss: the engine forgot too. Read by
    /// [`Ledger::history_lost`](crate::Ledger::history_lost).
    pub fn mark_history_lost(&self) {
        // Relaxed: a monotone counter read as a status.
        self.me.history_lost.fetch_add(1, StdOrdering::Relaxed);
    }

    /// Sets the holder's readiness (the ingest runtime's decision). Ignored once revoked.
    pub fn set_readiness(&mut self, r: Readiness) {
        let _p = self.me.private.lock();
        if self.me.revoked.load(Ordering::SeqCst) {
            return;
        }
        // Relaxed: the status value itself; queries read the ready mask below.
        self.me.readiness.store(r.to_u8(), Ordering::Relaxed);
        self.shared.slots.set_ready(self.me.slot, r == Readiness::Ready);
    }

    /// Events applied so far (clears included): a monotone counter tests and the ingest runtime
    /// can wait on.
    #[must_use]
    pub fn applied(&self) -> u64 {
        // Relaxed: a monotone counter.
        self.me.applied.load(Ordering::Relaxed)
    }
}

/// Empties holder `me`, whose worker was just removed (its writer revoked, its slot retracted),
/// with its state `p` locked: drops every block — cuts unpublished, runs released, entries of the
/// deterministic index and waits dropped — unlocks, and releases the grafts left in its mailbox.
pub(super) fn empty_removed(
    shared: &LedgerShared,
    me: &HolderShared,
    guard: &Guard,
    mut p: MutexGuard<'_, Private>,
) {
    let _poison = PoisonOnPanic { shared, me };
    let mut out = ApplyOutcome::default();
    let mut apply = Apply { shared, me, guard, out: &mut out };
    let before = gauges(&p);
    apply.clear(&mut p);
    p.namespaces = Vec::new();
    apply.report(&mut p, before);
    drop(p);
    for gr in std::mem::take(&mut *me.mailbox.lock()) {
        release(shared, unpack(gr.loc).0, guard);
    }
}

/// Poisons holder `me` if the thread panics while this guard lives — declared right after its
/// state's lock is taken, it is dropped first, so the marks are made before the lock is
/// released: a panic part-way through a write may leave the state half-changed (a run released
/// but still listed, an entry half-moved), and reading or clearing it again could free a run
/// still in use. The holder is revoked and retracted from queries at once; the ingest runtime
/// then quarantines and rebuilds it ([`LedgerError::Poisoned`]).
struct PoisonOnPanic<'a> {
    shared: &'a LedgerShared,
    me: &'a HolderShared,
}

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.me.poisoned.store(true, Ordering::SeqCst);
            self.shared.retract(self.me);
        }
    }
}

/// Releases a holder's state, then applies grafts other holders left in its mailbox meanwhile.
/// Returns the orphans grafted from the mailbox.
fn unlock<'a>(
    shared: &LedgerShared,
    me: &'a HolderShared,
    guard: &Guard,
    mut p: MutexGuard<'a, Private>,
) -> u64 {
    let _poison = PoisonOnPanic { shared, me };
    let mut grafted = 0;
    loop {
        if me.mail.load(Ordering::SeqCst) && !me.revoked.load(Ordering::SeqCst) {
            let mut out = ApplyOutcome::default();
            let mut apply = Apply { shared, me, guard, out: &mut out };
            let before = gauges(&p);
            apply.drain_mail(&mut p);
            apply.report(&mut p, before);
            // Relaxed: a statistics counter; nothing is published through it.
            shared.counters.grafts.fetch_add(out.grafted, StdOrdering::Relaxed);
            grafted += out.grafted;
        }
        drop(p);
        // SeqCst fence: pairs with the one in `deliver` (a graft left while this thread held
        // the lock is seen here, or its deliverer's try_lock succeeds).
        fence(Ordering::SeqCst);
        if !me.mail.load(Ordering::SeqCst) {
            return grafted;
        }
        match me.private.try_lock() {
            Some(again) => p = again,
            None => return grafted,
        }
    }
}

/// A graft offered to a deterministic holder by another one: `(ns, parent engine)` is the block
/// at `loc`. The graft holds a reference to that run until it is applied or dropped.
#[derive(Clone, Copy, Debug)]
pub(super) struct Graft {
    /// The namespace of the block and of the orphans it grafts.
    ns: u64,
    /// The block's engine hash: the parent the orphans wait on.
    parent: u64,
    /// The block's location.
    pub(super) loc: u64,
}

/// One apply in progress on holder `me` — its events, a clear, the grafts of its mailbox — by
/// whoever holds the holder's private state (passed to each step as `p`): the ledger's shared
/// state, an epoch guard pinned for the apply, and the outcome summed so far.
struct Apply<'a> {
    shared: &'a LedgerShared,
    me: &'a HolderShared,
    guard: &'a Guard,
    out: &'a mut ApplyOutcome,
}

/// What a block's parent is, while walking a store.
#[derive(Clone, Copy)]
enum Parent {
    /// Countable: its `SeqHash` and location (0 for a namespace root, which is in no run).
    Known {
        seq: u64,
        loc: u64,
    },
    Uncountable,
    Waiting(u64),
}

/// What a stored block is.
#[derive(Clone, Copy)]
enum Ident {
    /// Countable at `loc`; `fresh`: the placement took a reference to the run for this block,
    /// which the store hands to the holder or releases.
    Countable {
        loc: u64,
        fresh: bool,
        ns: u8,
    },
    Orphan(OrphanInfo, u8),
    Uncountable,
}

/// Drops one reference to `run`, reclaiming it if that was the last.
fn release(shared: &LedgerShared, run: Run, guard: &Guard) {
    if run.release() {
        reclaim(shared, run, guard);
    }
}

/// Reclaims `run`, whose last reference was just released (see [`run::reclaim`]), and counts it.
fn reclaim(shared: &LedgerShared, run: Run, guard: &Guard) {
    if run::reclaim(&shared.table, run, guard) {
        // Relaxed: statistics counters; nothing is published through them.
        shared.counters.run_bytes.fetch_sub(run.bytes(), StdOrdering::Relaxed);
        // Relaxed: as above.
        shared.counters.runs.fetch_sub(1, StdOrdering::Relaxed);
        // Relaxed: as above.
        shared.counters.run_blocks.fetch_sub(run.len() as u64, StdOrdering::Relaxed);
    }
}

impl Apply<'_> {
    fn group_bit(&self) -> (u32, u32) {
        (self.me.slot / GROUP, self.me.slot % GROUP)
    }

    /// The run with first block `seq`, with a new reference, if there is one.
    fn find_head(&self, seq: u64) -> Option<Run> {
        run::find(&self.shared.table, seq, self.guard)
    }

    /// A run of `seqs` (see [`run::create`]), with a new reference, counted if new.
    /// `after`: the capacity of the full run whose last block is the parent of `seqs[0]`.
    fn create(&self, seqs: &[u64], after: Option<usize>) -> Run {
        let groups = self.shared.slots.groups().max(self.group_bit().0 as usize + 1);
        let (run, new) = run::create(&self.shared.table, seqs, groups, after, self.guard);
        if new {
            // Relaxed: statistics counters; nothing is published through them.
            self.shared.counters.run_bytes.fetch_add(run.bytes(), StdOrdering::Relaxed);
            // Relaxed: as above.
            self.shared.counters.runs.fetch_add(1, StdOrdering::Relaxed);
            // Relaxed: as above.
            self.shared.counters.run_blocks.fetch_add(seqs.len() as u64, StdOrdering::Relaxed);
        }
        run
    }

    /// Where block `seq`, the child of `parent` (a location, 0 for a namespace root), goes: the
    /// next block of the parent's run if it is `seq`, else the run that starts with `seq`, else —
    /// with as many of the blocks chained after it (`rest`, their contents) as start no run — the
    /// end of the parent's run if that is the parent and has room, else a new run. By the chain
    /// property those are the only places `seq` can be. Returns the location and whether a
    /// reference was taken for it.
    fn place(&self, parent: u64, seq: u64, rest: &[StoredBlock]) -> (u64, bool) {
        let (mut tail, mut after) = (None, None);
        if parent != 0 {
            let (run, off) = unpack(parent);
            let len = run.len();
            if off + 1 < len {
                if run.hash(off + 1) == seq {
                    return (pack(run, off + 1), false);
                }
            } else if len < run.cap() {
                tail = Some((run, len));
            } else if run.cap() < MAX_RUN {
                // A chain growing past a short run (decode): the next run reserves more. After a
                // full-size run, a continuation reserves by its own length.
                after = Some(run.cap());
            }
        }
        if let Some(run) = self.find_head(seq) {
            return (pack(run, 0), true);
        }
        let mut seqs = [0u64; MAX_RUN];
        seqs[0] = seq;
        let mut len = 1;
        let mut s = seq;
        for b in rest.iter().take(MAX_RUN - 1) {
            s = chain(SeqHash::from_bits(s), b.content).to_bits();
            seqs[len] = s;
            self.shared.table.prefetch(head_key(s), self.guard);
            len += 1;
        }
        // A block that already starts a run (its parent's run was reclaimed while it lived on)
        // ends the new blocks: it stays in its own run.
        let mut take = 1;
        while take < len && self.shared.table.get(head_key(seqs[take]), self.guard) == 0 {
            take += 1;
        }
        if let Some((run, at)) = tail {
            let appended = run::append(&self.shared.table, run, at, &seqs[..take], self.guard);
            if appended > 0 {
                // Relaxed: a statistics counter; nothing is published through it.
                self.shared.counters.run_blocks.fetch_add(appended as u64, StdOrdering::Relaxed);
                return (pack(run, at), false);
            }
            // Another writer appended first: `seq` may be the run's next block now.
            if run.len() > at && run.hash(at) == seq {
                return (pack(run, at), false);
            }
        }
        (pack(self.create(&seqs[..take], after), 0), true)
    }

    /// Adds an entry located at `loc` to the holder's blocks of its run; `fresh`: a reference
    /// was taken for it (handed to the holder, or released if it already has the run).
    fn attach(&self, p: &mut Private, loc: u64, fresh: bool) {
        let (run, _) = unpack(loc);
        match p.runs.get_mut(run.bits()) {
            Some(hr) => {
                hr.entries += 1;
                if fresh {
                    release(self.shared, run, self.guard);
                }
            }
            None => {
                if !fresh {
                    // The caller holds a reference (its parent's block, or a graft's).
                    run.acquire();
                }
                p.runs.insert(run.bits(), HolderRun { entries: 1, ..HolderRun::default() });
            }
        }
    }

    /// Removes an entry located at `loc` (its flags already cleared); the holder's last entry in
    /// the run unpublishes its cuts and releases the run.
    fn detach(&self, p: &mut Private, loc: u64) {
        let (run, _) = unpack(loc);
        let Some(hr) = p.runs.get_mut(run.bits()) else { return };
        hr.entries -= 1;
        if hr.entries > 0 {
            return;
        }
        self.publish(run, hr.published, 0);
        p.runs.remove(run.bits());
        release(self.shared, run, self.guard);
    }

    /// Moves the entry at `loc` from the flags `before` to `now` in the holder's offsets of the
    /// run; the cuts are published by [`Apply::flush`].
    fn cover(&self, p: &mut Private, loc: u64, before: (bool, bool), now: (bool, bool)) {
        if before == now {
            return;
        }
        let (run, off) = unpack(loc);
        let Some(hr) = p.runs.get_mut(run.bits()) else { return };
        let bit = 1u64 << off;
        hr.gpu = if now.0 { hr.gpu | bit } else { hr.gpu & !bit };
        hr.any = if now.1 { hr.any | bit } else { hr.any & !bit };
        if hr.cuts() != hr.published && p.dirty.last() != Some(&run.bits()) {
            p.dirty.push(run.bits());
        }
    }

    /// Publishes the holder's cuts of `run` (counting a group extension it allocates).
    fn publish(&self, run: Run, old: u16, new: u16) {
        let (g, bit) = self.group_bit();
        let allocated = run.publish(g as usize, bit, old, new);
        if allocated > 0 {
            // Relaxed: a statistics counter; nothing is published through it.
            self.shared.counters.run_bytes.fetch_add(allocated, StdOrdering::Relaxed);
        }
    }

    /// Publishes the cuts of the runs whose offsets changed.
    fn flush(&self, p: &mut Private) {
        // The list goes back empty with its capacity: taking it left a new one to allocate on
        // the next write.
        let mut dirty = std::mem::take(&mut p.dirty);
        for &key in &dirty {
            let Some(hr) = p.runs.get_mut(key) else { continue };
            let (old, cuts) = (hr.published, hr.cuts());
            hr.published = cuts;
            // SAFETY: the holder has the run (`hr`), so it holds a reference to it.
            self.publish(unsafe { Run::from_bits(key) }, old, cuts);
        }
        dirty.clear();
        if p.dirty.is_empty() {
            p.dirty = dirty;
        }
    }

    /// Moves `e` from the flags `before` to its current flags.
    fn sync(&self, p: &mut Private, before: (bool, bool), e: &Entry) {
        if e.state == COUNTABLE {
            self.cover(p, e.loc, before, e.flags());
        }
    }

    /// Registers countable block `engine` of a deterministic holder in the deterministic index;
    /// the first holder to have it offers a graft to every holder waiting on it.
    fn det_register(&self, p: &Private, engine: u64, e: &Entry) {
        if !self.me.cfg.content_deterministic || e.ns == NS_NONE || e.state != COUNTABLE {
            return;
        }
        let ns = p.namespaces[e.ns as usize];
        if !self.shared.det.insert(ns, engine, e.loc) {
            return;
        }
        for slot in self.shared.det.take_waiters(ns, engine) {
            if slot != self.me.slot {
                // The graft's reference, taken while this holder holds one.
                unpack(e.loc).0.acquire();
                self.deliver(slot, Graft { ns, parent: engine, loc: e.loc });
            }
        }
    }

    /// Unregisters countable block `engine` of a deterministic holder from the deterministic
    /// index, releasing the index's reference to its run with the last holder.
    fn det_unregister(&self, p: &Private, engine: u64, e: &Entry) {
        if !self.me.cfg.content_deterministic || e.ns == NS_NONE || e.state != COUNTABLE {
            return;
        }
        let ns = p.namespaces[e.ns as usize];
        if let Some(loc) = self.shared.det.remove(ns, engine) {
            release(self.shared, unpack(loc).0, self.guard);
        }
    }

    /// Offers a graft to holder `slot`: into its mailbox, then applied at once if its state is
    /// free, or by whoever holds it when they unlock (see [`unlock`]).
    fn deliver(&self, slot: u32, graft: Graft) {
        let target = self.shared.registry.lock().by_slot.get(slot as usize).cloned().flatten();
        let Some(target) = target.filter(|t| !t.revoked.load(Ordering::SeqCst)) else {
            release(self.shared, unpack(graft.loc).0, self.guard);
            return;
        };
        target.mailbox.lock().push(graft);
        target.mail.store(true, Ordering::SeqCst);
        // SeqCst fence: either this try_lock sees the lock released, or the unlocker's check
        // after its own fence sees the mail flag (see `unlock`).
        fence(Ordering::SeqCst);
        if let Some(p) = target.private.try_lock() {
            unlock(self.shared, &target, self.guard, p);
        }
    }

    /// Applies the grafts in this holder's mailbox (and releases their references).
    fn drain_mail(&mut self, p: &mut Private) {
        self.me.mail.store(false, Ordering::SeqCst);
        let grafts = std::mem::take(&mut *self.me.mailbox.lock());
        for gr in grafts {
            self.apply_graft(p, gr);
            release(self.shared, unpack(gr.loc).0, self.guard);
        }
        self.flush(p);
    }

    fn apply_graft(&mut self, p: &mut Private, gr: Graft) {
        let known = p.entry(gr.parent).is_some_and(|e| e.state != ORPHAN);
        if known {
            return;
        }
        let Some(children) = p.waiting.get(&gr.parent).cloned() else { return };
        let (run, off) = unpack(gr.loc);
        let seq = run.hash(off);
        let mut left = Vec::new();
        for c in children {
            match p.orphans.get(&c).copied() {
                Some(info) if info.ns == gr.ns => {
                    p.orphans.remove(&c);
                    if let Some(next) = self.graft(p, c, info, seq, gr.loc) {
                        self.cascade(p, c, next);
                    }
                }
                Some(_) => left.push(c),
                None => {}
            }
        }
        if left.is_empty() {
            p.waiting_take(gr.parent);
        } else {
            p.waiting_put(gr.parent, left);
        }
    }

    /// The graft step: orphan `engine` (its info already removed) becomes a countable block, the
    /// child of the countable block `seq` at `loc`, placed, attached, counted and published like
    /// a stored one. Returns what it now is as a parent (for its own waiting children), `None` if
    /// the holder does not have it.
    fn graft(
        &mut self,
        p: &mut Private,
        engine: u64,
        info: OrphanInfo,
        seq: u64,
        loc: u64,
    ) -> Option<Parent> {
        // Nothing is placed for a block the holder does not have.
        if !p.has(engine) {
            return None;
        }
        let child = chain(SeqHash::from_bits(seq), BlockHash::from_bits(info.content)).to_bits();
        let ns_idx = self.ns_idx(p, info.ns);
        let (cloc, fresh) = self.place(loc, child, &[]);
        self.attach(p, cloc, fresh);
        let mut e = p.entry(engine)?;
        let before = e.flags();
        e.state = COUNTABLE;
        e.loc = cloc;
        e.ns = ns_idx;
        p.set_entry(engine, &e);
        self.sync(p, before, &e);
        p.countable += 1;
        self.out.grafted += 1;
        self.det_register(p, engine, &e);
        Some(Parent::Known { seq: child, loc: cloc })
    }

    /// Resolves the orphans waiting on `parent`, which just became countable or uncountable,
    /// and theirs, transitively.
    fn cascade(&mut self, p: &mut Private, parent: u64, how: Parent) {
        if !p.waiting.contains_key(&parent) {
            return;
        }
        let mut stack = vec![(parent, how)];
        while let Some((par, how)) = stack.pop() {
            let Some(children) = p.waiting_take(par) else { continue };
            for c in children {
                let Some(info) = p.orphans.remove(&c) else { continue };
                if self.me.cfg.content_deterministic {
                    // Nobody waits on `par` here any more: drop the cross-holder wait too.
                    self.shared.det.unwait(info.ns, par, self.me.slot);
                }
                match how {
                    Parent::Known { seq, loc } => {
                        if let Some(next) = self.graft(p, c, info, seq, loc) {
                            stack.push((c, next));
                        }
                    }
                    _ => {
                        if let Some(mut e) = p.entry(c) {
                            e.state = UNCOUNTABLE;
                            p.set_entry(c, &e);
                        }
                        stack.push((c, Parent::Uncountable));
                    }
                }
            }
        }
    }

    fn parent_of(&self, p: &Private, engine: u64) -> Parent {
        match p.entry(engine) {
            Some(e) if e.state == COUNTABLE => {
                let (run, off) = unpack(e.loc);
                Parent::Known { seq: run.hash(off), loc: e.loc }
            }
            Some(e) if e.state == UNCOUNTABLE => Parent::Uncountable,
            _ => Parent::Waiting(engine),
        }
    }

    fn store(&mut self, p: &mut Private, ev: &BlockStored) {
        let gpu = ev.medium.is_gpu();
        let mut parent = match (ev.parent, ev.lineage) {
            (_, None) => Parent::Uncountable,
            (None, Some(l)) => Parent::Known { seq: l.root.to_bits(), loc: 0 },
            (Some(e), Some(_)) => self.parent_of(p, e.to_u64()),
        };
        let ns = ev.lineage.map(|l| l.namespace.to_bits());
        // Every block's home slots, before the first is applied: the holder's map and, for a
        // content-deterministic holder, the shared index (see `det_register`).
        let det_ns = ns.filter(|_| self.me.cfg.content_deterministic);
        for b in &ev.blocks {
            p.entries.prefetch(b.engine.to_u64());
            if let Some(ns) = det_ns {
                self.shared.det.prefetch(ns, b.engine.to_u64());
            }
        }
        for (j, b) in ev.blocks.iter().enumerate() {
            let content = b.content.to_bits();
            let rest = &ev.blocks[j + 1..];
            // A reference to a deterministic parent's run, held until this block is placed.
            let mut borrowed = None;
            // A countable block ends up at its placement whatever the holder had: it is the next
            // block's parent.
            let mut next = None;
            let ident = match (parent, ns) {
                (Parent::Known { seq, loc }, Some(ns)) => {
                    let seq = chain(SeqHash::from_bits(seq), b.content).to_bits();
                    let (loc, fresh) = self.place(loc, seq, rest);
                    next = Some(Parent::Known { seq, loc });
                    Ident::Countable { loc, fresh, ns: self.ns_idx(p, ns) }
                }
                (Parent::Waiting(par), Some(ns)) => {
                    let det = if self.me.cfg.content_deterministic {
                        self.shared.det.lookup(ns, par)
                    } else {
                        None
                    };
                    match det {
                        Some(ploc) => {
                            borrowed = Some(unpack(ploc).0);
                            self.out.grafted += 1;
                            let (prun, poff) = unpack(ploc);
                            let seq = chain(SeqHash::from_bits(prun.hash(poff)), b.content).to_bits();
                            let (loc, fresh) = self.place(ploc, seq, rest);
                            next = Some(Parent::Known { seq, loc });
                            Ident::Countable { loc, fresh, ns: self.ns_idx(p, ns) }
                        }
                        None => Ident::Orphan(OrphanInfo { parent: par, content, ns }, self.ns_idx(p, ns)),
                    }
                }
                _ => Ident::Uncountable,
            };
            let engine = b.engine.to_u64();
            self.store_one(p, engine, ident, gpu);
            if let Some(run) = borrowed {
                release(self.shared, run, self.guard);
            }
            parent = next.unwrap_or_else(|| self.parent_of(p, engine));
            self.out.stored += 1;
        }
    }

    fn ns_idx(&self, p: &mut Private, ns: u64) -> u8 {
        if self.me.cfg.content_deterministic { p.ns_index(ns) } else { NS_NONE }
    }

    fn store_one(&mut self, p: &mut Private, engine: u64, ident: Ident, gpu: bool) {
        let stamp = p.next_stamp();
        let Some(mut e) = p.entry(engine) else {
            let mut e = Entry {
                loc: 0,
                stamp,
                gpu: u8::from(gpu),
                low: u8::from(!gpu),
                state: UNCOUNTABLE,
                ns: NS_NONE,
            };
            match ident {
                Ident::Countable { loc, fresh, ns } => {
                    e.state = COUNTABLE;
                    e.loc = loc;
                    e.ns = ns;
                    // The run's record first: the entry names it.
                    self.attach(p, loc, fresh);
                    #[cfg(test)]
                    fault::point();
                    p.insert_entry(engine, &e);
                    self.sync(p, (false, false), &e);
                    p.countable += 1;
                    self.det_register(p, engine, &e);
                    self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
                }
                Ident::Uncountable => {
                    p.insert_entry(engine, &e);
                    self.cascade(p, engine, Parent::Uncountable);
                }
                Ident::Orphan(info, ns) => {
                    e.state = ORPHAN;
                    e.ns = ns;
                    p.insert_entry(engine, &e);
                    p.orphans.insert(engine, info);
                    p.waiting_push(info.parent, engine);
                    self.out.orphaned += 1;
                    if self.me.cfg.content_deterministic {
                        self.shared.det.wait(info.ns, info.parent, self.me.slot);
                    }
                }
            }
            return;
        };
        let before = e.flags();
        e.stamp = stamp;
        match (e.state, ident) {
            (COUNTABLE, Ident::Countable { loc, fresh, ns }) if loc != e.loc => {
                // A known engine hash with another identity: the new store replaces the old
                // block, references included.
                let old = e;
                e.loc = loc;
                e.ns = ns;
                e.gpu = u8::from(gpu);
                e.low = u8::from(!gpu);
                self.attach(p, loc, fresh);
                // Before `detach`, which may drop the old run's record.
                p.set_entry(engine, &e);
                self.cover(p, old.loc, before, (false, false));
                self.detach(p, old.loc);
                self.sync(p, (false, false), &e);
                self.det_unregister(p, engine, &old);
                self.det_register(p, engine, &e);
                // Relaxed: a statistics counter; nothing is published through it.
                self.shared.counters.conflicts.fetch_add(1, StdOrdering::Relaxed);
            }
            (ORPHAN, Ident::Countable { loc, fresh, ns }) => {
                bump(&mut e, gpu);
                let info = p.orphans.remove(&engine);
                if let Some(info) = info {
                    self.unlink_waiting(p, engine, info);
                }
                self.attach(p, loc, fresh);
                e.state = COUNTABLE;
                e.loc = loc;
                e.ns = ns;
                p.set_entry(engine, &e);
                self.sync(p, before, &e);
                p.countable += 1;
                self.out.grafted += 1;
                self.det_register(p, engine, &e);
                self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
            }
            (UNCOUNTABLE, Ident::Countable { loc, fresh, ns }) => {
                bump(&mut e, gpu);
                e.state = COUNTABLE;
                e.loc = loc;
                e.ns = ns;
                self.attach(p, loc, fresh);
                p.set_entry(engine, &e);
                self.sync(p, before, &e);
                p.countable += 1;
                self.det_register(p, engine, &e);
                self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
            }
            (_, ident) => {
                bump(&mut e, gpu);
                p.set_entry(engine, &e);
                self.sync(p, before, &e);
                if let Ident::Countable { loc, fresh: true, .. } = ident {
                    // The same block again: the holder already holds its run.
                    release(self.shared, unpack(loc).0, self.guard);
                }
            }
        }
    }

    /// Removes orphan `engine` from its parent's waiting list (and the deterministic waits when
    /// the list empties).
    fn unlink_waiting(&self, p: &mut Private, engine: u64, info: OrphanInfo) {
        let Some(list) = p.waiting.get_mut(&info.parent) else { return };
        list.retain(|&c| c != engine);
        let empty = list.is_empty();
        // The cross-holder wait is per (namespace, parent): drop it when no orphan of that
        // namespace waits on the parent any more. (`engine`'s own info is already removed.)
        let same_ns_left = self.me.cfg.content_deterministic
            && list.iter().any(|c| p.orphans.get(c).is_some_and(|o| o.ns == info.ns));
        if empty {
            // `retain` above kept the list's capacity: the byte count changes only here.
            p.waiting_take(info.parent);
        }
        if self.me.cfg.content_deterministic && !same_ns_left {
            self.shared.det.unwait(info.ns, info.parent, self.me.slot);
        }
    }

    /// Drops entry `engine` entirely.
    fn drop_entry(&mut self, p: &mut Private, engine: u64) {
        let Some(e) = p.remove_entry(engine) else { return };
        match e.state {
            COUNTABLE => {
                // Before `detach`, which may release the run.
                p.gone.insert(super::seq_at(e.loc));
                self.cover(p, e.loc, e.flags(), (false, false));
                self.detach(p, e.loc);
                p.countable -= 1;
                self.det_unregister(p, engine, &e);
            }
            ORPHAN => {
                if let Some(info) = p.orphans.remove(&engine) {
                    self.unlink_waiting(p, engine, info);
                }
            }
            _ => {}
        }
    }

    fn remove(&mut self, p: &mut Private, ev: &BlockRemoved) {
        let gpu = ev.medium.is_gpu();
        for h in &ev.blocks {
            let engine = h.to_u64();
            let Some(mut e) = p.entry(engine) else {
                self.out.unknown_removes += 1;
                continue;
            };
            if (if gpu { e.gpu } else { e.low }) == 0 {
                self.out.unknown_removes += 1;
                continue;
            }
            self.out.removed += 1;
            if e.refs() == 1 {
                // The last reference: drop the entry whole (its flags still say what to clear).
                self.drop_entry(p, engine);
            } else {
                let before = e.flags();
                if gpu {
                    e.gpu -= 1;
                } else {
                    e.low -= 1;
                }
                p.set_entry(engine, &e);
                self.sync(p, before, &e);
            }
        }
    }

    fn clear(&mut self, p: &mut Private) {
        // What the alignment check may ask about (`Gone`), read while the runs are held.
        // The countable entries, unpacked while their runs' records are there.
        let countable: Vec<(u64, Entry)> = p.iter_entries().filter(|(_, e)| e.state == COUNTABLE).collect();
        for (_, e) in &countable {
            p.gone.insert(super::seq_at(e.loc));
        }
        // Unpublish and release every run first, then forget the entries.
        for (key, hr) in p.runs.take_all() {
            // SAFETY: the holder has the run, so it holds a reference to it.
            let run = unsafe { Run::from_bits(key) };
            self.publish(run, hr.published, 0);
            release(self.shared, run, self.guard);
        }
        p.dirty.clear();
        for (engine, e) in countable {
            self.det_unregister(p, engine, &e);
        }
        if self.me.cfg.content_deterministic {
            let waits: Vec<(u64, u64)> = p.orphans.values().map(|o| (o.ns, o.parent)).collect();
            for (ns, parent) in waits {
                self.shared.det.unwait(ns, parent, self.me.slot);
            }
        }
        p.entries.clear_all();
        p.orphans = Default::default();
        p.waiting_clear();
        p.countable = 0;
        self.out.cleared += 1;
    }

    fn evict(&mut self, p: &mut Private, down_to: usize) -> u64 {
        let n = p.entries.len().saturating_sub(down_to);
        if n == 0 {
            return 0;
        }
        for engine in p.oldest(n) {
            self.drop_entry(p, engine);
        }
        if p.entries.capacity() > 4 * p.entries.len().max(16) {
            p.entries.shrink_to(p.entries.len());
        }
        p.shrink_runs();
        self.out.evicted += n as u64;
        n as u64
    }

    /// Capacity and budget limits, after an event.
    fn enforce_limits(&mut self, p: &mut Private) {
        if p.entries.len() > self.me.limit {
            let n = self.evict(p, self.me.cfg.capacity_blocks as usize);
            // Relaxed: a statistics counter; nothing is published through it.
            self.shared.counters.evictions_capacity.fetch_add(n, StdOrdering::Relaxed);
            // Blocks the engine may still hold are no longer known: the ledger is a lower bound
            // of its cache from now on, as after a lost history.
            self.me.history_lost.fetch_add(1, StdOrdering::Relaxed);
        }
        let budget = self.shared.budget_blocks(self.me.cfg.capacity_blocks);
        if p.entries.len() > budget {
            // Down to the share less the slack, as for the capacity: one selection pass per
            // slack's worth of stores, not one per store.
            let slack = self.shared.cfg.capacity_slack_percent as usize;
            let n = self.evict(p, budget * 100 / (100 + slack));
            // Relaxed: a statistics counter; nothing is published through it.
            self.shared.counters.evictions_budget.fetch_add(n, StdOrdering::Relaxed);
            // As for the capacity: the engine keeps what the budget evicted.
            self.me.history_lost.fetch_add(1, StdOrdering::Relaxed);
            // Give the memory back: the map was sized for the capacity, not the budget; from now
            // on it is sized for the share and an eighth, so that the store that goes past the
            // share is evicted for before the map would grow for it.
            p.entries.set_target(budget + budget / 8);
            if p.entries.capacity() > 2 * budget {
                p.entries.shrink_to(budget * 100 / (100 + slack));
            }
        }
    }

    fn event(&mut self, p: &mut Private, ev: &KvEvent) {
        match ev {
            KvEvent::Stored(s) => self.store(p, s),
            // Relaxed: a statistics counter; nothing is published through it.
            KvEvent::Removed(r) => self.remove(p, r),
            KvEvent::AllCleared => self.clear(p),
        }
        if self.me.mail.load(Ordering::SeqCst) {
            // Grafts this event caused through another deterministic holder (or that arrived
            // meanwhile) are applied before the limits evict: an orphan is grafted, then it may
            // be evicted, never the other way round.
            self.drain_mail(p);
        }
        self.enforce_limits(p);
        self.flush(p);
        self.out.events += 1;
    }

    /// Publishes this holder's gauges to the ledger's counters.
    fn report(&self, p: &mut Private, before: Gauges) {
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        let c = &self.shared.counters;
        let bytes = p.heap_bytes();
        // Relaxed: a statistics counter; nothing is published through it.
        c.private_bytes.fetch_add(bytes, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.private_bytes.fetch_sub(p.reported_bytes, r);
        p.reported_bytes = bytes;
        let now = gauges(p);
        // Relaxed: a statistics counter; nothing is published through it.
        c.holder_runs.fetch_add(now.3 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.holder_runs.fetch_sub(before.3 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.blocks.fetch_add(now.0 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.blocks.fetch_sub(before.0 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.countable.fetch_add(now.1 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.countable.fetch_sub(before.1 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.orphans.fetch_add(now.2 as u64, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.orphans.fetch_sub(before.2 as u64, r);
    }
}

/// A holder's blocks, countable blocks, orphans and runs, as [`Apply::report`] publishes them.
type Gauges = (usize, usize, usize, usize);

fn gauges(p: &Private) -> Gauges {
    (p.entries.len(), p.countable, p.orphans.len(), p.runs.len())
}

fn bump(e: &mut Entry, gpu: bool) {
    if gpu {
        e.gpu = e.gpu.saturating_add(1);
    } else {
        e.low = e.low.saturating_add(1);
    }
}

/// A panic injected part-way through a store (after the run's record was attached, before the
/// entry naming it exists), for the tests of what a panic leaves behind.
#[cfg(test)]
pub(super) mod fault {
    use std::cell::Cell;

    thread_local! {
        /// Stores this thread may still make before the next one panics (none armed: `None`).
        static LEFT: Cell<Option<u32>> = const { Cell::new(None) };
    }

    /// Arms a panic in this thread's `n + 1`-th store from now.
    pub(crate) fn panic_after(n: u32) {
        LEFT.with(|l| l.set(Some(n)));
    }

    pub(super) fn point() {
        let fire = LEFT.with(|l| match l.get() {
            Some(0) => {
                l.set(None);
                true
            }
            Some(n) => {
                l.set(Some(n - 1));
                false
            }
            None => false,
        });
        assert!(!fire, "injected panic part-way through a store");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // test setup: a failed step should panic
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use cortex_hash::kv::{
        BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
    };
    use cortex_hash::{BlockHash, Engine, Namespace, chain};

    use super::fault;
    use crate::{
        HolderConfig, HolderWriter, Ledger, LedgerConfig, LedgerError, OverlapScores, QueryOptions, Readiness,
    };

    fn holder(w: u32) -> HolderId {
        HolderId::new(WorkerId(w), DpRank(0))
    }

    fn lineage() -> Lineage {
        Lineage::new(Namespace::new(Engine::Sglang, 16, "m", None), None)
    }

    fn add(ledger: &Ledger, h: HolderId) -> HolderWriter {
        let cfg = HolderConfig { capacity_blocks: 1000, content_deterministic: true };
        let mut w = ledger.add_holder(h, cfg).unwrap();
        w.set_readiness(Readiness::Ready);
        w
    }

    /// Blocks `from..to` of the test chain (engine hash = 1 + position), parent the one before.
    fn stored(from: u64, to: u64) -> KvEvent {
        let blocks = (from..to)
            .map(|i| StoredBlock {
                engine: EngineHash::from_u64(1 + i),
                content: BlockHash::from_bits(100 + i),
            })
            .collect();
        let parent = from.checked_sub(1).map(|p| EngineHash::from_u64(1 + p));
        KvEvent::Stored(BlockStored { parent, blocks, lineage: Some(lineage()), medium: Medium::Gpu })
    }

    fn counted(ledger: &Ledger, blocks: u64) -> Vec<(HolderId, u32)> {
        let mut at = lineage().root;
        let seq: Vec<_> = (0..blocks)
            .map(|i| {
                at = chain(at, BlockHash::from_bits(100 + i));
                at
            })
            .collect();
        let mut out = OverlapScores::default();
        ledger.query(&seq, QueryOptions::default(), &mut out);
        let mut v: Vec<_> = out.iter().map(|o| (o.holder, o.gpu_blocks)).collect();
        v.sort();
        v
    }

    /// A writer prefetches the deterministic index's slots from each shard's hint without its
    /// lock: every growth of a shard must publish where its slots moved, or the prefetches
    /// fetch freed memory (harmless, and useless).
    #[test]
    fn the_deterministic_index_s_prefetch_hints_follow_every_growth() {
        let ledger = Ledger::new(LedgerConfig::default());
        let mut w = ledger
            .add_holder(holder(1), HolderConfig { capacity_blocks: 100_000, content_deterministic: true })
            .unwrap();
        w.set_readiness(Readiness::Ready);
        for i in 0..400 {
            w.apply(&stored(i * 16, (i + 1) * 16)).unwrap();
            let (current, grown) = ledger.shared.det.hints_current();
            assert!(current, "a shard grew without publishing its slots (event {i})");
            if i == 399 {
                assert_eq!(grown, 64, "6,400 blocks grow every shard, several times");
            }
        }
    }

    #[test]
    fn a_panic_part_way_through_a_write_poisons_the_holder_and_nothing_touches_its_state_again() {
        let ledger = Ledger::new(LedgerConfig::default());
        let (a, b) = (holder(1), holder(2));
        let mut wa = add(&ledger, a);
        let mut wb = add(&ledger, b);
        wa.apply(&stored(0, 8)).unwrap();
        wb.apply(&stored(0, 4)).unwrap();
        assert_eq!(counted(&ledger, 8), vec![(a, 8), (b, 4)]);

        // A's next store panics after attaching a run record, before the entry naming it exists.
        fault::panic_after(2);
        let caught = catch_unwind(AssertUnwindSafe(|| wa.apply(&stored(8, 16))));
        assert!(caught.is_err());
        // Out of queries at once, and every later write refused as poisoned.
        assert_eq!(counted(&ledger, 8), vec![(b, 4)]);
        assert!(matches!(wa.apply(&stored(16, 17)), Err(LedgerError::Poisoned(h)) if h == a));
        // Readers of its state get nothing rather than the half-changed state.
        assert!(ledger.dump(a).is_none());
        assert!(ledger.block(a, EngineHash::from_u64(1)).is_none());
        assert!(!ledger.lost_lately(a, chain(lineage().root, BlockHash::from_bits(100))));
        // B goes on writing the blocks A was storing.
        wb.apply(&stored(4, 16)).unwrap();
        assert_eq!(counted(&ledger, 16), vec![(b, 16)]);

        // Quarantined and registered again, A is rebuilt; its count of lost history moves on.
        let lost = ledger.history_lost(a).unwrap();
        assert_eq!(ledger.quarantine(a), Some(lost));
        assert_eq!(ledger.quarantine(a), None);
        let mut wa2 = add(&ledger, a);
        wa2.carry_history_lost(lost + 1);
        assert_eq!(ledger.history_lost(a), Some(lost + 1));
        wa2.apply(&stored(0, 16)).unwrap();
        assert_eq!(counted(&ledger, 16), vec![(a, 16), (b, 16)]);
        assert_eq!(ledger.stats().quarantined_holders, 1);
        // Removing the workers clears the live registrations; the leaked state is never read.
        ledger.remove_worker(WorkerId(1));
        ledger.remove_worker(WorkerId(2));
        assert_eq!(counted(&ledger, 16), vec![]);
    }

    #[test]
    fn a_poisoned_holder_removed_with_its_worker_is_forgotten_not_cleared() {
        let ledger = Ledger::new(LedgerConfig::default());
        let a = holder(3);
        let mut wa = add(&ledger, a);
        wa.apply(&stored(0, 8)).unwrap();
        fault::panic_after(0);
        assert!(catch_unwind(AssertUnwindSafe(|| wa.apply(&stored(8, 16)))).is_err());
        let blocks = ledger.stats().blocks;
        ledger.remove_worker(WorkerId(3));
        let s = ledger.stats();
        assert_eq!((s.holders, s.quarantined_holders, s.blocks), (0, 1, blocks), "leaked, not cleared");
        // The ledger's drop (end of the test) skips the poisoned state too.
    }
}
