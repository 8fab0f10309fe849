//! The cluster view: an immutable [`Snapshot`] of the workers, published by [`Cluster`] with one
//! atomic pointer swap, and rebuilt only when membership or health changes.
//!
//! Key decisions:
//! - Readers never lock. [`Cluster::load`] pins a crossbeam epoch, clones the current
//!   `Arc<Snapshot>` and unpins: a few nanoseconds, no allocation, and the returned `Arc` is
//!   `Send`, so the proxy may keep it across awaits (for retries). Writers (registration, health
//!   probes) are rare; they serialize on a mutex, build a new snapshot and swap it in; the old
//!   one is freed once no reader holds it.
//! - A snapshot holds, per worker, an `Arc<WorkerState>` inherited by worker id from the previous
//!   snapshot (the Pixiu RFC's `stateByID`), so in-flight counts, cooldowns and the breaker
//!   survive rebuilds, and updating them never rebuilds anything. A worker whose DP size changed
//!   gets a fresh state (its old bookings still release on the old one).
//! - Holders (worker, DP rank) are laid out grouped by pool — (model, role) — and sorted by
//!   [`HolderId`] inside a pool, so a decision scans one contiguous slice and maps the ledger's
//!   per-holder answer with a binary search.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cortex_hash::Engine;
use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use crossbeam_epoch::{self as epoch, Atomic, Owned};

use crate::config::HealthPolicy;
use crate::decision::Candidate;
use crate::state::{Booking, WorkerState};
use crate::time::Timestamp;

/// What a worker does in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Serves whole requests.
    Regular,
    /// The prefill side of a disaggregated pair.
    Prefill,
    /// The decode side of a disaggregated pair.
    Decode,
}

impl Role {
    /// Snake-case name.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Regular => "regular",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub(crate) const fn index(self) -> usize {
        match self {
            Role::Regular => 0,
            Role::Prefill => 1,
            Role::Decode => 2,
        }
    }
}

/// Liveness as the health prober sees it. Changing it rebuilds the snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Health {
    /// Probes pass: the worker takes traffic.
    Healthy,
    /// Probes fail: no new traffic.
    Unhealthy,
    /// Being removed or shut down: no new traffic, in-flight requests finish.
    Draining,
}

/// Per-rank capacity, used by the watermark and the queue-latency estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// The engine's `max_running_requests` per DP rank.
    pub max_running_requests: u32,
    /// KV cache capacity per DP rank, in blocks.
    pub kv_blocks: u32,
    /// Prefill throughput per DP rank, tokens per second (turns booked prefill tokens into an
    /// expected queue latency).
    pub prefill_tokens_per_sec: u32,
}

impl Capacity {
    /// The KV blocks a request of `blocks` holds here: no more than the whole cache (when its
    /// size is known).
    #[must_use]
    pub fn kv_held(&self, blocks: u32) -> u64 {
        u64::from(if self.kv_blocks > 0 { blocks.min(self.kv_blocks) } else { blocks })
    }
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity { max_running_requests: 256, kv_blocks: 0, prefill_tokens_per_sec: 10_000 }
    }
}

/// A worker as registration describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Typed id (never a URL).
    pub id: WorkerId,
    /// The served model name requests are matched against.
    pub model: String,
    /// The engine.
    pub engine: Engine,
    /// Regular, prefill or decode.
    pub role: Role,
    /// Number of data-parallel ranks (each a holder with its own KV cache); 0 is read as 1.
    pub dp_size: u16,
    /// Per-rank capacity.
    pub capacity: Capacity,
    /// Free-form labels (shown in debug output).
    pub labels: Vec<(String, String)>,
}

impl WorkerSpec {
    /// A regular worker with one rank and default capacity.
    #[must_use]
    pub fn new(id: WorkerId, model: impl Into<String>, engine: Engine) -> Self {
        WorkerSpec {
            id,
            model: model.into(),
            engine,
            role: Role::Regular,
            dp_size: 1,
            capacity: Capacity::default(),
            labels: Vec::new(),
        }
    }

    fn ranks(&self) -> u16 {
        self.dp_size.max(1)
    }
}

/// One worker in a snapshot.
#[derive(Debug)]
pub struct WorkerEntry {
    spec: WorkerSpec,
    health: Health,
    state: Arc<WorkerState>,
}

impl WorkerEntry {
    /// The registration.
    #[must_use]
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// Liveness at the time of the snapshot.
    #[must_use]
    pub fn health(&self) -> Health {
        self.health
    }

    /// The live fast state (shared with later snapshots).
    #[must_use]
    pub fn state(&self) -> &Arc<WorkerState> {
        &self.state
    }
}

/// A holder's slot in a snapshot: everything a decision reads per holder that does not change
/// between rebuilds, copied next to the holder id so the scan touches one sequential array plus
/// the live state.
#[derive(Clone, Debug)]
pub(crate) struct HolderSlot {
    pub(crate) holder: HolderId,
    pub(crate) health: Health,
    pub(crate) capacity: Capacity,
    pub(crate) state: Arc<WorkerState>,
}

#[derive(Debug)]
struct Pool {
    model: Box<str>,
    role: Role,
    start: u32,
    end: u32,
}

/// A pool of holders as a decision sees it: the slice, and where each worker's rank 0 sits in it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolRef<'a> {
    pub(crate) id: u32,
    pub(crate) holders: &'a [HolderSlot],
}

/// Where a worker's holders are: its pool and the index of its rank 0 within that pool.
#[derive(Clone, Copy, Debug)]
struct Placement {
    pool: u32,
    offset: u32,
    ranks: u16,
}

/// An immutable view of the cluster.
#[derive(Debug)]
pub struct Snapshot {
    version: u64,
    workers: Vec<WorkerEntry>,
    holders: Vec<HolderSlot>,
    pools: Vec<Pool>,
    /// Per worker entry (same order as `workers`).
    placement: Vec<Placement>,
    /// Worker id → entry index, when ids are dense enough for a table (`u32::MAX`: absent);
    /// empty otherwise (binary search on `workers`).
    by_id: Vec<u32>,
    /// Worker id → its placement, when `by_id` is a table (`pool` is `u32::MAX` where absent):
    /// a ledger answer's holder is placed in one read, not two.
    placement_by_id: Vec<Placement>,
}

impl Snapshot {
    /// Forgets the learned line of every trained holder not booked within `after` while
    /// another holder of its pool was; returns how many. Called periodically (every second in
    /// the gateway): bookings are noticed by their count moving between two calls. A holder
    /// whose line came out slow (a stall, a burst, a restart) is no longer chosen, so it takes no
    /// sample that could correct the line: forgotten, it is priced at its pool's learned line
    /// again (as an untrained holder is, see [`crate::learn::TRAINED_SAMPLES`]) and learns anew
    /// from the requests that brings. Each recent forgetting doubles a holder's wait (up to 16
    /// times `after`). A pool where no holder was booked (an idle cluster) forgets nothing.
    pub fn forget_starved(&self, now: Timestamp, after: Duration) -> usize {
        fn rank(h: &HolderSlot) -> Option<&crate::state::RankState> {
            h.state.rank_state(h.holder.rank)
        }
        let mut forgotten = 0;
        for p in &self.pools {
            let holders = &self.holders[p.start as usize..p.end as usize];
            let mut active = false;
            for h in holders {
                if let Some(r) = rank(h) {
                    active |= r.note_bookings(now).is_some_and(|t| now.saturating_since(t) <= after);
                }
            }
            if !active {
                continue;
            }
            for h in holders {
                forgotten += usize::from(rank(h).is_some_and(|r| r.forget_if_starved(now, after)));
            }
        }
        forgotten
    }

    fn build(
        version: u64,
        members: &BTreeMap<WorkerId, (WorkerSpec, Health)>,
        prev: Option<&Snapshot>,
        policy: HealthPolicy,
    ) -> Self {
        let workers: Vec<WorkerEntry> = members
            .values()
            .map(|(spec, health)| {
                let state = prev
                    .and_then(|p| p.worker(spec.id))
                    .filter(|w| w.state.dp_size() == spec.ranks())
                    .map(|w| Arc::clone(&w.state))
                    .unwrap_or_else(|| {
                        Arc::new(WorkerState::new(spec.ranks(), policy, spec.capacity.prefill_tokens_per_sec))
                    });
                WorkerEntry { spec: spec.clone(), health: *health, state }
            })
            .collect();
        let mut keyed: Vec<(&str, Role, usize, HolderSlot)> = workers
            .iter()
            .enumerate()
            .flat_map(|(i, w)| {
                (0..w.spec.ranks()).map(move |r| {
                    let slot = HolderSlot {
                        holder: HolderId::new(w.spec.id, DpRank(r)),
                        health: w.health,
                        capacity: w.spec.capacity,
                        state: Arc::clone(&w.state),
                    };
                    (w.spec.model.as_str(), w.spec.role, i, slot)
                })
            })
            .collect();
        keyed.sort_by(|a, b| (a.0, a.1, a.3.holder).cmp(&(b.0, b.1, b.3.holder)));
        let mut pools: Vec<Pool> = Vec::new();
        for (i, (model, role, _, _)) in keyed.iter().enumerate() {
            match pools.last_mut() {
                Some(p) if &*p.model == *model && p.role == *role => p.end = i as u32 + 1,
                _ => pools.push(Pool {
                    model: (*model).into(),
                    role: *role,
                    start: i as u32,
                    end: i as u32 + 1,
                }),
            }
        }
        let mut placement = vec![Placement { pool: 0, offset: 0, ranks: 0 }; workers.len()];
        for (pid, p) in pools.iter().enumerate() {
            for (i, (_, _, w, h)) in keyed[p.start as usize..p.end as usize].iter().enumerate() {
                if h.holder.rank.0 == 0 {
                    let ranks = workers[*w].spec.ranks();
                    placement[*w] = Placement { pool: pid as u32, offset: i as u32, ranks };
                }
            }
        }
        let holders: Vec<HolderSlot> = keyed.into_iter().map(|(_, _, _, s)| s).collect();
        let max_id = workers.last().map_or(0, |w| w.spec.id.0 as usize);
        let by_id = if max_id < 4 * workers.len() + 64 {
            let mut t = vec![u32::MAX; max_id + 1];
            for (i, w) in workers.iter().enumerate() {
                t[w.spec.id.0 as usize] = i as u32;
            }
            t
        } else {
            Vec::new()
        };
        let absent = Placement { pool: u32::MAX, offset: 0, ranks: 0 };
        let placement_by_id =
            by_id.iter().map(|&i| placement.get(i as usize).copied().unwrap_or(absent)).collect();
        Snapshot { version, workers, holders, pools, placement, by_id, placement_by_id }
    }

    /// Increases by one at every rebuild.
    #[must_use]
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every worker, sorted by id.
    #[must_use]
    pub fn workers(&self) -> &[WorkerEntry] {
        &self.workers
    }

    /// The worker `id`.
    #[must_use]
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.worker_index(id).map(|i| &self.workers[i])
    }

    #[inline]
    fn worker_index(&self, id: WorkerId) -> Option<usize> {
        if self.by_id.is_empty() {
            self.workers.binary_search_by_key(&id, |w| w.spec.id).ok()
        } else {
            self.by_id.get(id.0 as usize).filter(|&&i| i != u32::MAX).map(|&i| i as usize)
        }
    }

    /// The index of `holder` within pool `pool` (what the ledger's per-holder answer maps to).
    #[inline]
    pub(crate) fn index_in_pool(&self, pool: u32, holder: HolderId) -> Option<usize> {
        let p = if self.placement_by_id.is_empty() {
            self.placement[self.worker_index(holder.worker)?]
        } else {
            *self.placement_by_id.get(holder.worker.0 as usize)?
        };
        (p.pool == pool && holder.rank.0 < p.ranks).then(|| (p.offset + u32::from(holder.rank.0)) as usize)
    }

    /// Number of holders (worker × rank) over all pools.
    #[must_use]
    pub fn holder_count(&self) -> usize {
        self.holders.len()
    }

    /// Whether some worker of the snapshot (healthy or not) serves `model` in `role`: a model
    /// with prefill or decode workers is served disaggregated.
    #[must_use]
    pub fn serves(&self, model: &str, role: Role) -> bool {
        self.pool(model, role).is_some()
    }

    /// The holders serving `model` in `role`, sorted by holder id.
    pub(crate) fn pool(&self, model: &str, role: Role) -> Option<PoolRef<'_>> {
        self.pools
            .iter()
            .enumerate()
            .find(|(_, p)| p.role == role && &*p.model == model)
            .map(|(i, p)| PoolRef { id: i as u32, holders: &self.holders[p.start as usize..p.end as usize] })
    }

    /// Books `candidate` (one request and its `prefill_tokens`) at `now`. `None` if its worker or
    /// rank is not in this snapshot. Admissibility is not re-checked: the proxy books what the
    /// decision ranked, and re-checks with [`Snapshot::admissible`] before a retry.
    pub fn book(&self, candidate: &Candidate, now: Timestamp) -> Option<Booking> {
        let w = self.worker(candidate.holder.worker)?;
        let rate = w.spec.capacity.prefill_tokens_per_sec;
        let (prefill, queue) = (u64::from(candidate.prefill_tokens), u64::from(candidate.queue_tokens));
        let kv = w.spec.capacity.kv_held(candidate.kv_blocks);
        let mut b = Booking::new(Arc::clone(&w.state), candidate.holder, (prefill, kv), queue, rate, now)?;
        b.set_estimated_ttft(candidate.est_ttft_ms / 1e3);
        Some(b)
    }

    /// Books one request, `prefill_tokens` and `kv_blocks` (see [`crate::Request::kv_blocks`])
    /// on `holder` directly (a holder chosen outside a ranking: a pinned decode rank, an
    /// operator override, tests).
    pub fn book_holder(
        &self,
        holder: HolderId,
        prefill_tokens: u32,
        kv_blocks: u32,
        now: Timestamp,
    ) -> Option<Booking> {
        let w = self.worker(holder.worker)?;
        let rate = w.spec.capacity.prefill_tokens_per_sec;
        let work = (u64::from(prefill_tokens), w.spec.capacity.kv_held(kv_blocks));
        Booking::new(Arc::clone(&w.state), holder, work, 0, rate, now)
    }

    /// Whether `holder` may take a request at `now`: present, healthy, not cooling down, breaker
    /// not open. For the proxy to re-check the next candidate before a retry (the failure that
    /// caused the retry may have just cooled its worker down).
    #[must_use]
    pub fn admissible(&self, holder: HolderId, now: Timestamp) -> bool {
        self.worker(holder.worker).is_some_and(|w| {
            holder.rank.0 < w.spec.ranks()
                && w.health == Health::Healthy
                && w.state.cooldown(now).is_none()
                && w.state.breaker(now) != crate::failure::BreakerState::Open
        })
    }
}

/// An `ArcSwap`-like cell over crossbeam-epoch: lock-free loads of an `Arc<Snapshot>`.
struct SnapshotCell {
    ptr: Atomic<Arc<Snapshot>>,
}

impl SnapshotCell {
    fn new(s: Arc<Snapshot>) -> Self {
        SnapshotCell { ptr: Atomic::new(s) }
    }

    fn load(&self) -> Arc<Snapshot> {
        let guard = epoch::pin();
        // Acquire: pairs with the AcqRel swap in `store`, so the snapshot's contents are visible.
        let shared = self.ptr.load(Ordering::Acquire, &guard);
        // SAFETY: the pointer is never null (set in `new`, replaced only by non-null values), and
        // the box it points to is destroyed only through `defer_destroy`, i.e. after every guard
        // pinned before the swap — including ours — is dropped.
        let arc = unsafe { shared.deref() };
        Arc::clone(arc)
    }

    fn store(&self, s: Arc<Snapshot>) {
        let guard = epoch::pin();
        // AcqRel: Release publishes the new snapshot; Acquire orders our later destruction of the
        // old box after its construction by the previous writer.
        let old = self.ptr.swap(Owned::new(s), Ordering::AcqRel, &guard);
        // SAFETY: `old` is no longer reachable from the cell; readers that loaded it are pinned,
        // and deferred destruction waits for them.
        unsafe { guard.defer_destroy(old) };
    }
}

impl Drop for SnapshotCell {
    fn drop(&mut self) {
        // SAFETY: `&mut self` means no other thread can reach the cell; readers hold their own
        // `Arc` clones, not the box.
        unsafe {
            let guard = epoch::unprotected();
            // Relaxed: exclusive access, nothing to synchronize with.
            let p = self.ptr.load(Ordering::Relaxed, guard);
            drop(p.into_owned());
        }
    }
}

struct Members {
    workers: BTreeMap<WorkerId, (WorkerSpec, Health)>,
    version: u64,
}

/// The cluster: membership and health behind one atomically swapped [`Snapshot`].
pub struct Cluster {
    cell: SnapshotCell,
    members: Mutex<Members>,
    policy: HealthPolicy,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("snapshot", &self.load()).finish_non_exhaustive()
    }
}

impl Cluster {
    /// An empty cluster whose workers follow `policy` (cooldowns, breaker).
    #[must_use]
    pub fn new(policy: HealthPolicy) -> Self {
        let members = Members { workers: BTreeMap::new(), version: 0 };
        let snap = Snapshot::build(0, &members.workers, None, policy);
        Cluster { cell: SnapshotCell::new(Arc::new(snap)), members: Mutex::new(members), policy }
    }

    /// The current snapshot. Lock-free; no allocation.
    #[must_use]
    pub fn load(&self) -> Arc<Snapshot> {
        self.cell.load()
    }

    /// The health policy every worker state follows.
    #[must_use]
    pub fn health_policy(&self) -> HealthPolicy {
        self.policy
    }

    fn update(&self, f: impl FnOnce(&mut BTreeMap<WorkerId, (WorkerSpec, Health)>) -> bool) -> bool {
        // A poisoned lock only means a writer panicked mid-update; the map is still consistent
        // (each update is one insert/remove), so carry on with it.
        let mut m = self.members.lock().unwrap_or_else(PoisonError::into_inner);
        if !f(&mut m.workers) {
            return false;
        }
        m.version += 1;
        let prev = self.cell.load();
        let next = Snapshot::build(m.version, &m.workers, Some(&prev), self.policy);
        self.cell.store(Arc::new(next));
        true
    }

    /// Adds or replaces a worker. Rebuilds (and returns true) only if something changed.
    pub fn upsert(&self, spec: WorkerSpec, health: Health) -> bool {
        self.update(|w| {
            if w.get(&spec.id).is_some_and(|(s, h)| *s == spec && *h == health) {
                return false;
            }
            w.insert(spec.id, (spec, health));
            true
        })
    }

    /// Removes a worker. Returns false if it was not there.
    pub fn remove(&self, id: WorkerId) -> bool {
        self.update(|w| w.remove(&id).is_some())
    }

    /// Sets a worker's health. Rebuilds (and returns true) only if it changed.
    pub fn set_health(&self, id: WorkerId, health: Health) -> bool {
        self.update(|w| match w.get_mut(&id) {
            Some((_, h)) if *h != health => {
                *h = health;
                true
            }
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::FailureClass;
    use crate::state::LedgerState;

    fn spec(id: u32, model: &str, role: Role, dp: u16) -> WorkerSpec {
        WorkerSpec { role, dp_size: dp, ..WorkerSpec::new(WorkerId(id), model, Engine::Sglang) }
    }

    #[test]
    fn rebuild_only_on_change_and_state_is_inherited_by_id() {
        let c = Cluster::new(HealthPolicy::default());
        assert!(c.upsert(spec(2, "m", Role::Regular, 1), Health::Healthy));
        assert!(c.upsert(spec(1, "m", Role::Regular, 2), Health::Healthy));
        let s1 = c.load();
        assert_eq!(s1.version(), 2);
        assert!(!c.upsert(spec(1, "m", Role::Regular, 2), Health::Healthy), "unchanged");
        assert!(!c.set_health(WorkerId(1), Health::Healthy));
        assert_eq!(c.load().version(), 2);

        // Fast-state updates never rebuild.
        let st = Arc::clone(s1.worker(WorkerId(1)).expect("w1").state());
        st.record_failure(FailureClass::RateLimited, Timestamp::from_millis(1));
        st.set_ledger(DpRank(1), LedgerState::Ready);
        assert_eq!(c.load().version(), 2);

        assert!(c.set_health(WorkerId(2), Health::Unhealthy));
        assert!(c.upsert(spec(3, "m", Role::Regular, 1), Health::Healthy));
        let s2 = c.load();
        assert_eq!(s2.version(), 4);
        let st2 = s2.worker(WorkerId(1)).expect("w1").state();
        assert!(Arc::ptr_eq(&st, st2), "inherited by id");
        assert!(st2.cooldown(Timestamp::from_millis(2)).is_some());
        assert_eq!(st2.ledger(DpRank(1)), Some(LedgerState::Ready));
        assert_eq!(s2.worker(WorkerId(2)).expect("w2").health(), Health::Unhealthy);
        // The old snapshot is untouched.
        assert_eq!(s1.worker(WorkerId(2)).expect("w2").health(), Health::Healthy);

        // A DP-size change gets a fresh state.
        assert!(c.upsert(spec(1, "m", Role::Regular, 4), Health::Healthy));
        let s3 = c.load();
        assert!(!Arc::ptr_eq(&st, s3.worker(WorkerId(1)).expect("w1").state()));
        assert!(c.remove(WorkerId(1)));
        assert!(!c.remove(WorkerId(1)));
        assert!(c.load().worker(WorkerId(1)).is_none());
    }

    #[test]
    fn holders_are_grouped_by_pool_and_sorted() {
        let c = Cluster::new(HealthPolicy::default());
        c.upsert(spec(5, "b", Role::Regular, 1), Health::Healthy);
        c.upsert(spec(3, "a", Role::Decode, 1), Health::Healthy);
        c.upsert(spec(2, "a", Role::Regular, 2), Health::Healthy);
        c.upsert(spec(1, "a", Role::Regular, 1), Health::Healthy);
        let s = c.load();
        assert_eq!(s.holder_count(), 5);
        let ids = |p: PoolRef<'_>| {
            p.holders.iter().map(|h| (h.holder.worker.0, h.holder.rank.0)).collect::<Vec<_>>()
        };
        assert_eq!(ids(s.pool("a", Role::Regular).expect("pool")), vec![(1, 0), (2, 0), (2, 1)]);
        assert_eq!(ids(s.pool("a", Role::Decode).expect("pool")), vec![(3, 0)]);
        assert_eq!(ids(s.pool("b", Role::Regular).expect("pool")), vec![(5, 0)]);
        assert!(s.pool("b", Role::Prefill).is_none());
        let a = s.pool("a", Role::Regular).expect("pool").id;
        let d = s.pool("a", Role::Decode).expect("pool").id;
        assert_eq!(s.index_in_pool(a, HolderId::new(WorkerId(2), DpRank(1))), Some(2));
        assert_eq!(s.index_in_pool(a, HolderId::new(WorkerId(2), DpRank(2))), None, "no rank 2");
        assert_eq!(s.index_in_pool(d, HolderId::new(WorkerId(2), DpRank(0))), None, "other pool");
        assert_eq!(s.index_in_pool(d, HolderId::new(WorkerId(3), DpRank(0))), Some(0));
        assert_eq!(s.index_in_pool(a, HolderId::new(WorkerId(99), DpRank(0))), None);
        assert!(s.pool("c", Role::Regular).is_none());
    }

    #[test]
    fn concurrent_readers_and_writers() {
        let c = Arc::new(Cluster::new(HealthPolicy::default()));
        std::thread::scope(|scope| {
            let w = Arc::clone(&c);
            scope.spawn(move || {
                for i in 0..200u32 {
                    w.upsert(spec(i % 7, "m", Role::Regular, 1), Health::Healthy);
                    w.set_health(
                        WorkerId(i % 7),
                        if i % 2 == 0 { Health::Unhealthy } else { Health::Healthy },
                    );
                }
            });
            for _ in 0..2 {
                let r = Arc::clone(&c);
                scope.spawn(move || {
                    let mut last = 0;
                    for _ in 0..2000 {
                        let s = r.load();
                        assert!(s.version() >= last, "versions never go back");
                        last = s.version();
                        assert!(s.holder_count() <= 7);
                    }
                });
            }
        });
        assert_eq!(c.load().holder_count(), 7);
    }
}
