//! The ledger: holders, writers, the overlap query, removal, budgets, dumps and stats.
//!
//! Key decision: the shared structure is a set of *runs* (`run.rs`), contiguous pieces of `SeqHash`
//! chains, each block in exactly one run, found by their first block in the head table
//! (`table.rs`). A query costs one lookup per run it crosses, not one per block: the chain property
//! lets it compare a whole run with the prompt in one comparison. All per-(holder, block)
//! bookkeeping — engine hashes, reference counts, tiers, orphans, LRU stamps, which offsets of
//! which run the holder has — is private to the holder's single writer (`holder.rs`), which
//! publishes per run only two cuts. Writers of different holders run in parallel and meet only on
//! short shard locks of the head table (creating, finding and reclaiming runs); readers pin an
//! epoch and never lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64 as StdAtomicU64, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};

use cortex_hash::kv::{BlockRemoved, BlockStored, EventBatch, HolderId, KvEvent, WorkerId};
use cortex_hash::{BlockHash, SeqHash, chain};

use crate::holder::{COUNTABLE, Entry, HolderRun, NS_NONE, ORPHAN, OrphanInfo, Private, UNCOUNTABLE, mix64};
use crate::overlap::{Overlap, OverlapScores};
use crate::run::{self, GROUPS, MAX_RUN, Run, head_key, pack, unpack};
use crate::slots::{GROUP, Slots};
use crate::sync::epoch::{self, Guard};
use crate::sync::{AtomicBool, AtomicU8, AtomicU64, Mutex, MutexGuard, Ordering, fence};
use crate::table::SlotTable;

/// The most holders one ledger indexes at once (32 groups).
pub const MAX_HOLDERS: u32 = 1024;
const _: () = assert!(GROUPS == (MAX_HOLDERS / GROUP) as usize);

/// Runs a query looks up ahead (in the head table only) before it reads them.
const PATH: usize = 16;

/// The bytes per (holder, block) that [`LedgerConfig::byte_budget`] is converted to blocks with:
/// about two and a half times what a block costs at the structures' usual load (35–40 B in the §4 benchmark, up
/// to ~80 B in the soak, whose deterministic holders also fill the cross-holder index), so that
/// the budget holds with load factors at their worst. Converting to blocks once, rather than
/// evicting while measured bytes exceed the budget, cannot thrash: arrays that have not shrunk
/// yet never make the ledger evict again.
pub const BUDGET_BYTES_PER_BLOCK: usize = 96;

/// Ledger-wide settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Memory the ledger may use. Converted to blocks ([`BUDGET_BYTES_PER_BLOCK`] each) and
    /// shared among holders in proportion to their capacity: a holder over its share evicts its
    /// least recently stored blocks down to the share less the slack.
    pub byte_budget: usize,
    /// Extra blocks a holder may keep beyond its engine capacity before the ledger evicts, in
    /// percent of that capacity. Only lost removes make a holder exceed its capacity; when it
    /// exceeds capacity plus slack, its least recently stored blocks are evicted down to the
    /// capacity.
    pub capacity_slack_percent: u32,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig { byte_budget: 1 << 30, capacity_slack_percent: 25 }
    }
}

/// One holder's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderConfig {
    /// The engine's KV capacity in blocks (the ledger adds its own slack).
    pub capacity_blocks: u32,
    /// The engine's hashes are equal across workers for equal content (SGLang; vLLM ≥ 0.29 with
    /// the default seed): an orphan may then be grafted from another such holder of the same
    /// namespace.
    pub content_deterministic: bool,
}

/// Whether a holder's state can be trusted, as decided by the ingest runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Readiness {
    /// In sync with its engine: counted by default queries.
    Ready,
    /// Replaying or catching up (the state a new holder starts in).
    Syncing,
    /// Events stopped or a gap could not be repaired.
    Stale,
}

impl Readiness {
    const fn to_u8(self) -> u8 {
        match self {
            Readiness::Ready => 0,
            Readiness::Syncing => 1,
            Readiness::Stale => 2,
        }
    }
    const fn from_u8(v: u8) -> Readiness {
        match v {
            0 => Readiness::Ready,
            1 => Readiness::Syncing,
            _ => Readiness::Stale,
        }
    }
}

/// When a query may stop before the end of the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EarlyExit {
    /// Walk until no holder matches (exact lengths for every holder).
    #[default]
    Never,
    /// Stop once at most one holder still matches; that holder's lengths are then a lower bound
    /// (enough to know who the best holder is).
    OneHolderLeft,
}

/// Which holders a query counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HolderFilter {
    /// Only holders in [`Readiness::Ready`].
    #[default]
    Ready,
    /// Every registered holder, whatever its readiness.
    All,
}

/// Options of [`Ledger::query`]. The default counts only ready holders and never exits early.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryOptions {
    /// Early exit.
    pub early_exit: EarlyExit,
    /// Holders counted.
    pub holders: HolderFilter,
}

/// Errors of the ledger.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LedgerError {
    /// The holder already has a writer.
    #[error("holder {0} already has a writer")]
    HolderExists(HolderId),
    /// [`MAX_HOLDERS`] holders are registered.
    #[error("the ledger already indexes {MAX_HOLDERS} holders")]
    TooManyHolders,
    /// A holder's capacity must be at least one block.
    #[error("holder {0} has a capacity of 0 blocks")]
    ZeroCapacity(HolderId),
    /// The holder's worker was removed: its writer may no longer write.
    #[error("holder {0} was removed; its writer is revoked")]
    Revoked(HolderId),
}

/// What an apply did (summed over a batch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Events applied.
    pub events: u64,
    /// Block references stored (new blocks and duplicates).
    pub stored: u64,
    /// Block references removed.
    pub removed: u64,
    /// Removes of a hash (or tier copy) the holder did not have: ignored.
    pub unknown_removes: u64,
    /// Blocks that arrived as orphans (their parent unknown).
    pub orphaned: u64,
    /// Orphans grafted (made countable).
    pub grafted: u64,
    /// Blocks evicted by the capacity or the budget.
    pub evicted: u64,
    /// `AllBlocksCleared` events and clears.
    pub cleared: u64,
}

/// A block's state in a dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DumpState {
    /// Countable, with its identity.
    Countable(SeqHash),
    /// Waiting on the parent with this engine hash.
    Orphan {
        /// The parent's engine hash.
        parent: cortex_hash::kv::EngineHash,
    },
    /// Namespace unknown: kept for removes and children, never counted.
    Uncountable,
}

/// One block of a holder, as dumped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DumpBlock {
    /// The engine's hash.
    pub engine: cortex_hash::kv::EngineHash,
    /// State and identity.
    pub state: DumpState,
    /// References on GPU.
    pub gpu_refs: u32,
    /// References on lower tiers (CPU, storage, external).
    pub lower_refs: u32,
}

/// A holder's blocks (debugging, tests), sorted by engine hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderDump {
    /// The holder.
    pub holder: HolderId,
    /// Its readiness.
    pub readiness: Readiness,
    /// Every block, orphans included.
    pub blocks: Vec<DumpBlock>,
    /// How many of them are orphans.
    pub orphans: usize,
}

/// Counters for metrics. Gauges are current values; the rest count since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// Bytes the ledger's structures use now (runs, head table arrays and holders' maps,
    /// estimated from their capacities).
    pub live_bytes: usize,
    /// Of which the shared structure: runs and the head table.
    pub table_bytes: usize,
    /// Of which the holders' private maps (engine hashes, orphans, waiting lists).
    pub holder_bytes: usize,
    /// Of which the index of content-deterministic holders' blocks.
    pub deterministic_index_bytes: usize,
    /// Registered holders.
    pub holders: usize,
    /// (holder, block) entries, orphans and uncountable blocks included.
    pub blocks: u64,
    /// Of which countable.
    pub countable_blocks: u64,
    /// Of which orphans.
    pub orphans: u64,
    /// Live runs (contiguous pieces of chains, the shared structure's nodes): referenced by a holder,
    /// the deterministic index or a pending graft.
    pub nodes: usize,
    /// Head-table keys whose run is gone, reclaimed at their shard's next rebuild.
    pub dead_nodes: usize,
    /// Head-table shard rebuilds.
    pub table_rebuilds: usize,
    /// Blocks in live runs (each distinct countable block once).
    pub run_blocks: u64,
    /// Blocks evicted because a holder exceeded its capacity plus slack.
    pub evictions_capacity: u64,
    /// Blocks evicted because of the byte budget.
    pub evictions_budget: u64,
    /// Removes of unknown hashes (or tier copies), ignored.
    pub unknown_removes: u64,
    /// Re-stores of a known engine hash with a different identity (the new one replaces it).
    pub conflicts: u64,
    /// Orphans grafted.
    pub grafts: u64,
    /// Applies refused because the holder's worker was removed.
    pub refused_applies: u64,
    /// (holder, namespace, parent) waits of content-deterministic orphans on other holders.
    pub deterministic_waits: usize,
    /// Distinct (namespace, engine hash) countable blocks of content-deterministic holders.
    pub deterministic_blocks: usize,
}

#[derive(Default)]
struct Counters {
    run_bytes: StdAtomicUsize,
    runs: StdAtomicUsize,
    run_blocks: StdAtomicU64,
    private_bytes: StdAtomicUsize,
    det_bytes: StdAtomicUsize,
    blocks: StdAtomicU64,
    countable: StdAtomicU64,
    orphans: StdAtomicU64,
    capacity: StdAtomicU64,
    evictions_capacity: StdAtomicU64,
    evictions_budget: StdAtomicU64,
    unknown_removes: StdAtomicU64,
    conflicts: StdAtomicU64,
    grafts: StdAtomicU64,
    refused: StdAtomicU64,
}

/// A graft offered to a deterministic holder by another one: `(ns, parent engine)` is the block
/// at `loc`. The graft holds a reference to that run until it is applied or dropped.
#[derive(Clone, Copy, Debug)]
struct Graft {
    ns: u64,
    parent: u64,
    loc: u64,
}

struct HolderShared {
    id: HolderId,
    slot: u32,
    cfg: HolderConfig,
    limit: usize,
    private: Mutex<Private>,
    revoked: AtomicBool,
    readiness: AtomicU8,
    mailbox: Mutex<Vec<Graft>>,
    mail: AtomicBool,
    applied: AtomicU64,
    /// Times the writer said the ledger lost part of the engine's history (see
    /// [`HolderWriter::mark_history_lost`]).
    history_lost: StdAtomicU64,
}

#[derive(Default)]
struct Registry {
    by_id: std::collections::HashMap<HolderId, Arc<HolderShared>>,
    by_slot: Vec<Option<Arc<HolderShared>>>,
    next_slot: u32,
}

/// `det_key(ns, engine) → (location in the entry's loc, holders in its stamp)`: an [`EngineMap`]
/// (no tombstones, so churn does not grow it). Each entry holds a reference to its run.
type DetMap = crate::holder::EngineMap;

/// The deterministic index's key: the engine hash XOR a mix of the namespace (a bijection for
/// each namespace; two namespaces collide with probability 2^-64, like two `SeqHash`es).
fn det_key(ns: u64, engine: u64) -> u64 {
    engine ^ mix64(ns ^ 0x6465_7465_726d_696e)
}

/// Countable blocks of deterministic holders by (namespace, engine hash), and the deterministic
/// orphans waiting on a parent nobody had yet.
struct DetIndex {
    /// Sharded (64 ways) so that writers of different holders rarely meet and a growing map
    /// grows by 1/64 of the index at a time.
    blocks: Box<[Mutex<DetMap>]>,
    waits: Mutex<std::collections::HashMap<(u64, u64), Vec<u32>>>,
    waiting: StdAtomicUsize,
}

impl DetIndex {
    fn shard(&self, ns: u64, engine: u64) -> &Mutex<DetMap> {
        &self.blocks[(mix64(ns ^ engine.rotate_left(32)) >> 58) as usize]
    }
}

struct Inner {
    cfg: LedgerConfig,
    table: SlotTable,
    slots: Slots,
    registry: Mutex<Registry>,
    free_slots: Arc<Mutex<Vec<u32>>>,
    det: DetIndex,
    counters: Counters,
}

/// The KV ledger. Shared as `Arc<Ledger>`; see the crate documentation.
pub struct Ledger {
    inner: Arc<Inner>,
}

/// The only handle that writes one holder's blocks. Exactly one exists per registered holder;
/// it is `Send` (the ingest runtime moves it to the thread that owns the holder's events) and
/// not `Clone`.
pub struct HolderWriter {
    inner: Arc<Inner>,
    me: Arc<HolderShared>,
}

impl std::fmt::Debug for HolderWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HolderWriter").field("holder", &self.me.id).field("slot", &self.me.slot).finish()
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("cfg", &self.inner.cfg).field("stats", &self.stats()).finish()
    }
}

fn encode_id(id: HolderId) -> u64 {
    (u64::from(id.worker.0) << 16) | u64::from(id.rank.0)
}

fn decode_id(v: u64) -> HolderId {
    HolderId::new(WorkerId((v >> 16) as u32), cortex_hash::kv::DpRank(v as u16))
}

impl Ledger {
    /// An empty ledger.
    #[must_use]
    pub fn new(cfg: LedgerConfig) -> Arc<Ledger> {
        Arc::new(Ledger {
            inner: Arc::new(Inner {
                cfg,
                table: SlotTable::new(),
                slots: Slots::new(MAX_HOLDERS),
                registry: Mutex::new(Registry::default()),
                free_slots: Arc::new(Mutex::new(Vec::new())),
                det: DetIndex {
                    blocks: (0..64)
                        .map(|_| Mutex::new(DetMap::with_capacity_target(usize::MAX / 8)))
                        .collect(),
                    waits: Mutex::default(),
                    waiting: StdAtomicUsize::new(0),
                },
                counters: Counters::default(),
            }),
        })
    }

    /// Registers `holder` and returns its only writer. It starts [`Readiness::Syncing`].
    ///
    /// # Errors
    /// [`LedgerError::HolderExists`] if the holder already has a writer (remove its worker
    /// first), [`LedgerError::TooManyHolders`], [`LedgerError::ZeroCapacity`].
    pub fn add_holder(&self, holder: HolderId, cfg: HolderConfig) -> Result<HolderWriter, LedgerError> {
        if cfg.capacity_blocks == 0 {
            return Err(LedgerError::ZeroCapacity(holder));
        }
        let inner = &self.inner;
        let mut reg = inner.registry.lock();
        if reg.by_id.contains_key(&holder) {
            return Err(LedgerError::HolderExists(holder));
        }
        let slot = match inner.free_slots.lock().pop() {
            Some(s) => s,
            None if reg.next_slot < MAX_HOLDERS => {
                reg.next_slot += 1;
                reg.next_slot - 1
            }
            None => return Err(LedgerError::TooManyHolders),
        };
        let cap = cfg.capacity_blocks as usize;
        let limit = cap + cap * inner.cfg.capacity_slack_percent as usize / 100;
        let shared = Arc::new(HolderShared {
            id: holder,
            slot,
            cfg,
            limit,
            private: Mutex::new(Private {
                entries: crate::holder::EngineMap::with_capacity_target(cfg.capacity_blocks as usize),
                ..Private::default()
            }),
            revoked: AtomicBool::new(false),
            readiness: AtomicU8::new(Readiness::Syncing.to_u8()),
            mailbox: Mutex::new(Vec::new()),
            mail: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            history_lost: StdAtomicU64::new(0),
        });
        inner.slots.publish(slot, encode_id(holder));
        if reg.by_slot.len() <= slot as usize {
            reg.by_slot.resize(slot as usize + 1, None);
        }
        reg.by_slot[slot as usize] = Some(shared.clone());
        reg.by_id.insert(holder, shared.clone());
        // Relaxed: a statistics counter; nothing is published through it.
        inner.counters.capacity.fetch_add(u64::from(cfg.capacity_blocks), StdOrdering::Relaxed);
        Ok(HolderWriter { inner: inner.clone(), me: shared })
    }

    /// For every holder, how many leading blocks of `seq` it holds contiguously, on GPU and on
    /// any tier. Lock-free and allocation-free with a reused `out` (sized for the holders).
    ///
    /// `seq` is a prompt's chain of `SeqHash`es from its namespace's root (as
    /// `Namespace::seq_hashes` makes it). A block being written concurrently may be missed (an
    /// under-count); a block is counted only if its holder had it at some instant during the query.
    pub fn query(&self, seq: &[SeqHash], opts: QueryOptions, out: &mut OverlapScores) {
        let inner = &*self.inner;
        let n = seq.len();
        out.begin(n as u32);
        if seq.is_empty() {
            return;
        }
        let guard = epoch::pin();
        // Per counted group: (group, GPU-alive bits, any-alive bits).
        let mut states: [(u32, u32, u32); GROUPS] = [(0, 0, 0); GROUPS];
        let mut n_states = 0;
        for g in 0..inner.slots.groups() {
            let mask = inner.slots.counted(g, opts.holders == HolderFilter::Ready);
            if mask != 0 {
                states[n_states] = (g as u32, mask, mask);
                n_states += 1;
            }
        }
        let states = &mut states[..n_states];
        if states.is_empty() {
            return;
        }
        // GPU run lengths of holders whose GPU run ended before their any-tier run, per counted
        // group: on the stack, so that the query allocates nothing whatever the number of groups,
        // and only the rows of counted groups are initialized (zeroing 4 KiB was a fifth of a
        // query).
        let mut rows = [const { std::mem::MaybeUninit::<[u32; GROUP as usize]>::uninit() }; GROUPS];
        for row in &mut rows[..states.len()] {
            row.write([0; GROUP as usize]);
        }
        // SAFETY: the first `states.len()` rows were just initialized, and `MaybeUninit<T>` has
        // the layout of `T`.
        let gpu_len: &mut [[u32; GROUP as usize]] =
            unsafe { &mut *(std::ptr::from_mut(&mut rows[..states.len()]) as *mut [[u32; GROUP as usize]]) };
        // Look-ahead: with an early exit, most queries stop at their first run.
        let ahead = if opts.early_exit == EarlyExit::Never { PATH } else { 2 };
        let emit = |out: &mut OverlapScores, g: u32, b: u32, gpu: u32, any: u32| {
            if any > 0 {
                let id = decode_id(inner.slots.id(g * GROUP + b));
                out.push(Overlap { holder: id, gpu_blocks: gpu, any_tier_blocks: any });
            }
        };
        // The walk, in rounds: first the head table alone, assuming every run matches whole (the
        // table's value says where a run ends), prefetching each run's first line, so that the
        // runs' misses overlap; then the runs in order, each checked against the prompt. A run
        // the prompt leaves early ends the round; the next starts where it diverged.
        let mut i = 0;
        let mut path = [(0u64, 0usize); PATH];
        'rounds: while i < n {
            let mut len_path = 0;
            let mut p = i;
            while p < n && len_path < ahead {
                let v = inner.table.get(head_key(seq[p].to_bits()), &guard);
                if v == 0 {
                    break;
                }
                let (run, len) = Run::from_head_value(v);
                run.prefetch_for(len.min(n - p));
                path[len_path] = (v, len);
                len_path += 1;
                p += len;
            }
            if len_path == 0 {
                break;
            }
            for &(v, len) in &path[..len_path] {
                // A run found in the head table is reclaimed only after it was unlinked from it
                // and every guard pinned before has been dropped; `guard` is pinned.
                let (run, _) = Run::from_head_value(v);
                let k = len.min(n - i);
                // The key is the first block's `SeqHash` itself except for 0 and 1 (see
                // `head_key`).
                if seq[i].to_bits() <= 1 && run.hash(0) != seq[i].to_bits() {
                    break 'rounds;
                }
                // The matched span: the whole run if its last compared block matches (the chain
                // property), else the divergence found by binary search (equality is monotone).
                let m = if run.hash(k - 1) == seq[i + k - 1].to_bits() {
                    k
                } else {
                    run.prefetch(k / 2);
                    let (mut lo, mut hi) = (0, k - 1);
                    while hi - lo > 1 {
                        let mid = (lo + hi) / 2;
                        if run.hash(mid) == seq[i + mid].to_bits() {
                            lo = mid;
                        } else {
                            hi = mid;
                        }
                    }
                    lo + 1
                };
                if opts.early_exit == EarlyExit::OneHolderLeft
                    && let Some(end) = early_exit(run, states, i, m)
                {
                    // At most one holder is left within this span: everyone else ends where they
                    // end, the survivor at `end`.
                    for (si, st) in states.iter().enumerate() {
                        let mut d = st.2;
                        while d != 0 {
                            let b = d.trailing_zeros();
                            d &= d - 1;
                            let (gc, ac) = run.cut(st.0 as usize, b);
                            let (gc, ac) = (gc.min(m), ac.min(m));
                            let gpu =
                                if st.1 & (1 << b) != 0 { (i + gc) as u32 } else { gpu_len[si][b as usize] };
                            let any = (i + ac) as u32;
                            if any >= end {
                                emit(out, st.0, b, gpu.min(end), end);
                            } else {
                                emit(out, st.0, b, gpu, any);
                            }
                        }
                    }
                    return;
                }
                let mut left = 0;
                for (si, st) in states.iter_mut().enumerate() {
                    if st.2 == 0 {
                        continue;
                    }
                    // Holders in the mask cover the span on both tiers if it ends by the mask's
                    // length; every other holder still matching reads its cuts (four to a word).
                    let g = st.0 as usize;
                    let (l, full) = run.mask(g);
                    let mut d = if m <= l { st.2 & !full } else { st.2 };
                    let mut word = (usize::MAX, 0u64);
                    while d != 0 {
                        let b = d.trailing_zeros();
                        let bit = 1u32 << b;
                        d &= d - 1;
                        if word.0 != b as usize / 4 {
                            word = (b as usize / 4, run.cut_word(g, b as usize / 4));
                        }
                        let v = (word.1 >> ((b % 4) * 16)) as usize;
                        let (gc, ac) = (v & 0xff, (v >> 8) & 0xff);
                        if st.1 & bit != 0 && gc < m {
                            gpu_len[si][b as usize] = (i + gc) as u32;
                            st.1 &= !bit;
                        }
                        if st.2 & bit != 0 && ac < m {
                            let gpu = gpu_len[si][b as usize];
                            emit(
                                out,
                                st.0,
                                b,
                                if st.1 & bit != 0 { (i + ac) as u32 } else { gpu },
                                (i + ac) as u32,
                            );
                            st.1 &= !bit;
                            st.2 &= !bit;
                        }
                    }
                    left += st.2.count_ones();
                }
                if left == 0 {
                    return;
                }
                i += m;
                if m < len {
                    // Diverged inside the run (or the prompt ended): the rest of the path assumed
                    // it matched whole.
                    continue 'rounds;
                }
            }
            if len_path < ahead && i < n {
                // The head table had no run at `p`: nobody holds the block there.
                break;
            }
        }
        for (si, st) in states.iter().enumerate() {
            let mut d = st.2;
            while d != 0 {
                let b = d.trailing_zeros();
                d &= d - 1;
                let gpu = if st.1 & (1 << b) != 0 { i as u32 } else { gpu_len[si][b as usize] };
                emit(out, st.0, b, gpu, i as u32);
            }
        }
    }

    /// The readiness of `holder`, `None` if it is not registered. Takes the registry lock: for
    /// the control plane, not the request path.
    #[must_use]
    pub fn readiness(&self, holder: HolderId) -> Option<Readiness> {
        let reg = self.inner.registry.lock();
        // Relaxed: a status read, ordered by the registry lock against registration.
        reg.by_id.get(&holder).map(|h| Readiness::from_u8(h.readiness.load(Ordering::Relaxed)))
    }

    /// How many times `holder`'s writer said the ledger lost part of its engine's history
    /// ([`HolderWriter::mark_history_lost`]), `None` if it is not registered. Zero means the
    /// ledger has followed the engine's every event since its cache was empty, so a block the
    /// ledger lacks, the engine lacks too; otherwise the engine may hold blocks stored before
    /// the loss that it will never announce again. Takes the registry lock: for verification
    /// off the request path.
    #[must_use]
    pub fn history_lost(&self, holder: HolderId) -> Option<u64> {
        let reg = self.inner.registry.lock();
        // Relaxed: a monotone counter read as a status.
        reg.by_id.get(&holder).map(|h| h.history_lost.load(StdOrdering::Relaxed))
    }

    /// Removes every rank of `worker`: queries stop counting them at once, their blocks are
    /// dropped, and their writers' later applies are refused with [`LedgerError::Revoked`].
    /// Waits for an apply in progress on one of them to finish.
    pub fn remove_worker(&self, worker: WorkerId) {
        let inner = &self.inner;
        let victims: Vec<Arc<HolderShared>> = {
            let mut reg = inner.registry.lock();
            let ids: Vec<HolderId> = reg.by_id.keys().filter(|h| h.worker == worker).copied().collect();
            let mut v = Vec::new();
            for id in ids {
                if let Some(h) = reg.by_id.remove(&id) {
                    reg.by_slot[h.slot as usize] = None;
                    v.push(h);
                }
            }
            v
        };
        for h in victims {
            h.revoked.store(true, Ordering::SeqCst);
            inner.slots.retract(h.slot);
            let mut p = h.private.lock();
            let guard = epoch::pin();
            let mut out = ApplyOutcome::default();
            let mut cx = Cx { inner, me: &h, guard: &guard, out: &mut out };
            let before = (p.entries.len(), p.countable, p.orphans.len());
            cx.clear(&mut p);
            p.namespaces = Vec::new();
            cx.report(&mut p, before);
            drop(p);
            for gr in std::mem::take(&mut *h.mailbox.lock()) {
                release(inner, unpack(gr.loc).0, &guard);
            }
            // Relaxed: a statistics counter; nothing is published through it.
            inner.counters.capacity.fetch_sub(u64::from(h.cfg.capacity_blocks), StdOrdering::Relaxed);
            {
                let mut waits = inner.det.waits.lock();
                waits.retain(|_, v| {
                    v.retain(|&s| s != h.slot);
                    !v.is_empty()
                });
                // Relaxed: a hint read under the waits lock or rechecked by it.
                inner.det.waiting.store(waits.len(), StdOrdering::Relaxed);
            }
            // The slot is reused only after every query that may still read it has ended.
            let free = inner.free_slots.clone();
            let slot = h.slot;
            guard.defer(move || free.lock().push(slot));
            guard.flush();
        }
    }

    /// One block of a holder, by the engine's hash: its state and references, `None` if the
    /// holder does not have it. Locks the holder briefly (waits for an apply in progress): for
    /// verification off the request path, such as checking that a worker published the engine
    /// hashes the gateway predicted for a request.
    #[must_use]
    pub fn block(&self, holder: HolderId, engine: cortex_hash::kv::EngineHash) -> Option<DumpBlock> {
        let h = self.inner.registry.lock().by_id.get(&holder).cloned()?;
        let p = h.private.lock();
        let e = p.entries.get(&engine.to_u64())?;
        Some(DumpBlock {
            engine,
            state: match e.state {
                COUNTABLE => DumpState::Countable(SeqHash::from_bits(seq_at(e.loc))),
                ORPHAN => DumpState::Orphan {
                    parent: cortex_hash::kv::EngineHash::from_u64(
                        p.orphans.get(&engine.to_u64()).map_or(0, |o| o.parent),
                    ),
                },
                _ => DumpState::Uncountable,
            },
            gpu_refs: u32::from(e.gpu),
            lower_refs: u32::from(e.low),
        })
    }

    /// A holder's blocks, orphans included, `None` if it is not registered. Locks the holder
    /// (waits for an apply in progress): for debugging and tests.
    #[must_use]
    pub fn dump(&self, holder: HolderId) -> Option<HolderDump> {
        let h = self.inner.registry.lock().by_id.get(&holder).cloned()?;
        let p = h.private.lock();
        let mut blocks: Vec<DumpBlock> = p
            .entries
            .iter()
            .map(|(&engine, e)| DumpBlock {
                engine: cortex_hash::kv::EngineHash::from_u64(engine),
                state: match e.state {
                    COUNTABLE => DumpState::Countable(SeqHash::from_bits(seq_at(e.loc))),
                    ORPHAN => DumpState::Orphan {
                        parent: cortex_hash::kv::EngineHash::from_u64(
                            p.orphans.get(&engine).map_or(0, |o| o.parent),
                        ),
                    },
                    _ => DumpState::Uncountable,
                },
                gpu_refs: u32::from(e.gpu),
                lower_refs: u32::from(e.low),
            })
            .collect();
        blocks.sort_unstable();
        Some(HolderDump {
            holder,
            // Relaxed: a status read.
            readiness: Readiness::from_u8(h.readiness.load(Ordering::Relaxed)),
            orphans: p.orphans.len(),
            blocks,
        })
    }

    /// Current counters.
    #[must_use]
    pub fn stats(&self) -> LedgerStats {
        let i = &self.inner;
        let c = &i.counters;
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        let table_bytes = i.table.counters.bytes.load(r) + c.run_bytes.load(r);
        LedgerStats {
            live_bytes: self.inner.live_bytes(),
            table_bytes,
            holder_bytes: c.private_bytes.load(r),
            deterministic_index_bytes: c.det_bytes.load(r),
            holders: i.registry.lock().by_id.len(),
            blocks: c.blocks.load(r),
            countable_blocks: c.countable.load(r),
            orphans: c.orphans.load(r),
            nodes: c.runs.load(r),
            run_blocks: c.run_blocks.load(r),
            dead_nodes: i.table.counters.dead.load(r),
            table_rebuilds: i.table.counters.rebuilds.load(r),
            evictions_capacity: c.evictions_capacity.load(r),
            evictions_budget: c.evictions_budget.load(r),
            unknown_removes: c.unknown_removes.load(r),
            conflicts: c.conflicts.load(r),
            grafts: c.grafts.load(r),
            refused_applies: c.refused.load(r),
            deterministic_waits: i.det.waits.lock().values().map(Vec::len).sum(),
            deterministic_blocks: i.det.blocks.iter().map(|m| m.lock().len()).sum(),
        }
    }
}

/// With `EarlyExit::OneHolderLeft`: the query's end if at most one of the holders still alive
/// entering the span `i..i + m` of `run` is left at some position of the span (the first position
/// where exactly one is left, plus one), else `None`.
fn early_exit(run: Run, states: &[(u32, u32, u32)], i: usize, m: usize) -> Option<u32> {
    // Two holders in masks outlast the span: no need to read a cut.
    let mut covered = 0;
    for st in states {
        let (l, full) = run.mask(st.0 as usize);
        if m <= l {
            covered += (st.2 & full).count_ones();
            if covered >= 2 {
                return None;
            }
        }
    }
    // The two largest any-tier cuts (within the span) over the holders alive entering it.
    let (mut first, mut second) = (0usize, 0usize);
    let mut alive = 0;
    for st in states {
        let mut d = st.2;
        while d != 0 {
            let b = d.trailing_zeros();
            d &= d - 1;
            let ac = run.cut(st.0 as usize, b).1.min(m);
            alive += 1;
            if ac > first {
                second = first;
                first = ac;
            } else if ac > second {
                second = ac;
            }
            if second == m {
                // Two holders outlast the span.
                return None;
            }
        }
    }
    // One holder left at position i + second (the second-largest ends there) if the largest goes
    // further; with a tie, both end together and no single holder is ever left.
    (alive > 0 && first > second && second < m).then_some((i + second + 1) as u32)
}

impl Inner {
    fn live_bytes(&self) -> usize {
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        self.table.counters.bytes.load(r)
            + self.counters.run_bytes.load(r)
            + self.counters.private_bytes.load(r)
            + self.counters.det_bytes.load(r)
            + std::mem::size_of::<Inner>()
            + self.slots.heap_bytes()
    }

    /// The most blocks a holder of capacity `cap` may keep under the byte budget: its
    /// capacity-proportional share of `byte_budget / BUDGET_BYTES_PER_BLOCK` blocks.
    fn budget_blocks(&self, cap: u32) -> usize {
        let allowed = (self.cfg.byte_budget / BUDGET_BYTES_PER_BLOCK) as u128;
        // Relaxed: a statistics counter; nothing is published through it.
        let total_cap = self.counters.capacity.load(StdOrdering::Relaxed).max(1);
        (allowed * u128::from(cap) / u128::from(total_cap)) as usize
    }
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

/// A writer's context: the ledger, the holder and a pinned guard.
struct Cx<'a> {
    inner: &'a Inner,
    me: &'a HolderShared,
    guard: &'a Guard,
    out: &'a mut ApplyOutcome,
}

/// Drops one reference to `run`, reclaiming it if that was the last.
fn release(inner: &Inner, run: Run, guard: &Guard) {
    if run.release() {
        reclaim(inner, run, guard);
    }
}

/// Reclaims `run`, whose last reference was just released (see [`run::reclaim`]), and counts it.
fn reclaim(inner: &Inner, run: Run, guard: &Guard) {
    if run::reclaim(&inner.table, run, guard) {
        // Relaxed: statistics counters; nothing is published through them.
        inner.counters.run_bytes.fetch_sub(run.bytes(), StdOrdering::Relaxed);
        // Relaxed: as above.
        inner.counters.runs.fetch_sub(1, StdOrdering::Relaxed);
        // Relaxed: as above.
        inner.counters.run_blocks.fetch_sub(run.len() as u64, StdOrdering::Relaxed);
    }
}

impl Cx<'_> {
    fn group_bit(&self) -> (u32, u32) {
        (self.me.slot / GROUP, self.me.slot % GROUP)
    }

    /// The run with first block `seq`, with a new reference, if there is one.
    fn find_head(&self, seq: u64) -> Option<Run> {
        run::find(&self.inner.table, seq, self.guard)
    }

    /// A run of `seqs` (see [`run::create`]), with a new reference, counted if new.
    fn create(&self, seqs: &[u64]) -> Run {
        let groups = self.inner.slots.groups().max(self.group_bit().0 as usize + 1);
        let (run, new) = run::create(&self.inner.table, seqs, groups, self.guard);
        if new {
            // Relaxed: statistics counters; nothing is published through them.
            self.inner.counters.run_bytes.fetch_add(run.bytes(), StdOrdering::Relaxed);
            // Relaxed: as above.
            self.inner.counters.runs.fetch_add(1, StdOrdering::Relaxed);
            // Relaxed: as above.
            self.inner.counters.run_blocks.fetch_add(seqs.len() as u64, StdOrdering::Relaxed);
        }
        run
    }

    /// Where block `seq`, the child of `parent` (a location, 0 for a namespace root), goes: the
    /// next block of the parent's run if it is `seq`, else the run that starts with `seq`, else —
    /// with as many of the blocks chained after it (`rest`, their contents) as start no run — the
    /// end of the parent's run if that is the parent and has room, else a new run. By the chain
    /// property those are the only places `seq` can be. Returns the location and whether a
    /// reference was taken for it.
    fn place(&self, parent: u64, seq: u64, rest: &[cortex_hash::kv::StoredBlock]) -> (u64, bool) {
        let mut tail = None;
        if parent != 0 {
            let (run, off) = unpack(parent);
            let len = run.len();
            if off + 1 < len {
                if run.hash(off + 1) == seq {
                    return (pack(run, off + 1), false);
                }
            } else if len < run.cap() {
                tail = Some((run, len));
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
            self.inner.table.prefetch(head_key(s), self.guard);
            len += 1;
        }
        // A block that already starts a run (its parent's run was reclaimed while it lived on)
        // ends the new blocks: it stays in its own run.
        let mut take = 1;
        while take < len && self.inner.table.get(head_key(seqs[take]), self.guard) == 0 {
            take += 1;
        }
        if let Some((run, at)) = tail {
            let appended = run::append(&self.inner.table, run, at, &seqs[..take], self.guard);
            if appended > 0 {
                // Relaxed: a statistics counter; nothing is published through it.
                self.inner.counters.run_blocks.fetch_add(appended as u64, StdOrdering::Relaxed);
                return (pack(run, at), false);
            }
            // Another writer appended first: `seq` may be the run's next block now.
            if run.len() > at && run.hash(at) == seq {
                return (pack(run, at), false);
            }
        }
        (pack(self.create(&seqs[..take]), 0), true)
    }

    /// Adds an entry located at `loc` to the holder's blocks of its run; `fresh`: a reference
    /// was taken for it (handed to the holder, or released if it already has the run).
    fn attach(&self, p: &mut Private, loc: u64, fresh: bool) {
        let (run, _) = unpack(loc);
        match p.runs.get_mut(&run.bits()) {
            Some(hr) => {
                hr.entries += 1;
                if fresh {
                    release(self.inner, run, self.guard);
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
        let Some(hr) = p.runs.get_mut(&run.bits()) else { return };
        hr.entries -= 1;
        if hr.entries > 0 {
            return;
        }
        self.publish(run, hr.published, 0);
        p.runs.remove(&run.bits());
        release(self.inner, run, self.guard);
    }

    /// Moves the entry at `loc` from the flags `before` to `now` in the holder's offsets of the
    /// run; the cuts are published by [`Cx::flush`].
    fn cover(&self, p: &mut Private, loc: u64, before: (bool, bool), now: (bool, bool)) {
        if before == now {
            return;
        }
        let (run, off) = unpack(loc);
        let Some(hr) = p.runs.get_mut(&run.bits()) else { return };
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
            self.inner.counters.run_bytes.fetch_add(allocated, StdOrdering::Relaxed);
        }
    }

    /// Publishes the cuts of the runs whose offsets changed.
    fn flush(&self, p: &mut Private) {
        for key in std::mem::take(&mut p.dirty) {
            let Some(hr) = p.runs.get_mut(&key) else { continue };
            let (old, cuts) = (hr.published, hr.cuts());
            hr.published = cuts;
            // SAFETY: the holder has the run (`hr`), so it holds a reference to it.
            self.publish(unsafe { Run::from_bits(key) }, old, cuts);
        }
    }

    /// Moves `e` from the flags `before` to its current flags.
    fn sync(&self, p: &mut Private, before: (bool, bool), e: &Entry) {
        if e.state == COUNTABLE {
            self.cover(p, e.loc, before, e.flags());
        }
    }

    fn det_register(&self, p: &Private, engine: u64, e: &Entry) {
        if !self.me.cfg.content_deterministic || e.ns == NS_NONE || e.state != COUNTABLE {
            return;
        }
        let ns = p.namespaces[e.ns as usize];
        let fresh = {
            let mut m = self.inner.det.shard(ns, engine).lock();
            let key = det_key(ns, engine);
            if let Some(slot) = m.get_mut(&key) {
                slot.stamp += 1;
                false
            } else {
                let before = m.heap_bytes();
                // The index's own reference (the holder has the run, so it holds one).
                unpack(e.loc).0.acquire();
                m.insert_new(
                    key,
                    Entry { loc: e.loc, stamp: 1, gpu: 0, low: 0, state: COUNTABLE, ns: NS_NONE },
                );
                let after = m.heap_bytes();
                if after != before {
                    // Relaxed: a statistics counter; nothing is published through it.
                    self.inner.counters.det_bytes.fetch_add(after, StdOrdering::Relaxed);
                    // Relaxed: a statistics counter; nothing is published through it.
                    self.inner.counters.det_bytes.fetch_sub(before, StdOrdering::Relaxed);
                }
                true
            }
        };
        if fresh && self.inner.det.waiting.load(StdOrdering::SeqCst) > 0 {
            let waiters = {
                let mut w = self.inner.det.waits.lock();
                let v = w.remove(&(ns, engine));
                self.inner.det.waiting.store(w.len(), StdOrdering::SeqCst);
                v
            };
            for slot in waiters.into_iter().flatten() {
                if slot != self.me.slot {
                    // The graft's reference, taken while this holder holds one.
                    unpack(e.loc).0.acquire();
                    self.deliver(slot, Graft { ns, parent: engine, loc: e.loc });
                }
            }
        }
    }

    fn det_unregister(&self, p: &Private, engine: u64, e: &Entry) {
        if !self.me.cfg.content_deterministic || e.ns == NS_NONE || e.state != COUNTABLE {
            return;
        }
        let ns = p.namespaces[e.ns as usize];
        let gone = {
            let mut m = self.inner.det.shard(ns, engine).lock();
            let key = det_key(ns, engine);
            match m.get_mut(&key) {
                Some(slot) => {
                    slot.stamp -= 1;
                    if slot.stamp == 0 { m.remove(&key).map(|d| d.loc) } else { None }
                }
                None => None,
            }
        };
        if let Some(loc) = gone {
            release(self.inner, unpack(loc).0, self.guard);
        }
    }

    /// The location some deterministic holder has for `(ns, parent)`, with a new reference.
    fn det_lookup(&self, ns: u64, parent: u64) -> Option<u64> {
        let m = self.inner.det.shard(ns, parent).lock();
        let loc = m.get(&det_key(ns, parent)).map(|v| v.loc)?;
        // Under the index's lock its entry holds a reference, so taking another is safe.
        unpack(loc).0.acquire();
        Some(loc)
    }

    fn det_wait(&self, ns: u64, parent: u64) {
        let mut w = self.inner.det.waits.lock();
        let v = w.entry((ns, parent)).or_default();
        if !v.contains(&self.me.slot) {
            v.push(self.me.slot);
        }
        self.inner.det.waiting.store(w.len(), StdOrdering::SeqCst);
    }

    fn det_unwait(&self, ns: u64, parent: u64) {
        let mut w = self.inner.det.waits.lock();
        if let Some(v) = w.get_mut(&(ns, parent)) {
            v.retain(|&s| s != self.me.slot);
            if v.is_empty() {
                w.remove(&(ns, parent));
            }
        }
        self.inner.det.waiting.store(w.len(), StdOrdering::SeqCst);
    }

    /// Offers a graft to holder `slot`: into its mailbox, then applied at once if its state is
    /// free, or by whoever holds it when they unlock (see [`unlock`]).
    fn deliver(&self, slot: u32, graft: Graft) {
        let target = self.inner.registry.lock().by_slot.get(slot as usize).cloned().flatten();
        let Some(target) = target else {
            release(self.inner, unpack(graft.loc).0, self.guard);
            return;
        };
        target.mailbox.lock().push(graft);
        target.mail.store(true, Ordering::SeqCst);
        // SeqCst fence: either this try_lock sees the lock released, or the unlocker's check
        // after its own fence sees the mail flag (see `unlock`).
        fence(Ordering::SeqCst);
        if let Some(p) = target.private.try_lock() {
            unlock(self.inner, &target, self.guard, p);
        }
    }

    /// Applies the grafts in this holder's mailbox (and releases their references).
    fn drain_mail(&mut self, p: &mut Private) {
        self.me.mail.store(false, Ordering::SeqCst);
        let grafts = std::mem::take(&mut *self.me.mailbox.lock());
        for gr in grafts {
            self.apply_graft(p, gr);
            release(self.inner, unpack(gr.loc).0, self.guard);
        }
        self.flush(p);
    }

    fn apply_graft(&mut self, p: &mut Private, gr: Graft) {
        let known = p.entries.get(&gr.parent).is_some_and(|e| e.state != ORPHAN);
        if known {
            return;
        }
        let Some(children) = p.waiting.get(&gr.parent).cloned() else { return };
        let parent = Parent::Known { seq: unpack(gr.loc).0.hash(unpack(gr.loc).1), loc: gr.loc };
        let mut left = Vec::new();
        for c in children {
            match p.orphans.get(&c).copied() {
                Some(info) if info.ns == gr.ns => {
                    p.orphans.remove(&c);
                    self.make_countable(p, c, parent, info);
                }
                Some(_) => left.push(c),
                None => {}
            }
        }
        if left.is_empty() {
            p.waiting.remove(&gr.parent);
        } else {
            p.waiting.insert(gr.parent, left);
        }
    }

    /// Turns orphan `engine` (its info already removed) into a countable block, the child of
    /// `parent`, and grafts its waiting descendants.
    fn make_countable(&mut self, p: &mut Private, engine: u64, parent: Parent, info: OrphanInfo) {
        let Parent::Known { seq, loc } = parent else { return };
        let ns_idx = if self.me.cfg.content_deterministic { p.ns_index(info.ns) } else { NS_NONE };
        if p.entries.get(&engine).is_none() {
            return;
        }
        let child = chain(SeqHash::from_bits(seq), BlockHash::from_bits(info.content)).to_bits();
        let (cloc, fresh) = self.place(loc, child, &[]);
        self.attach(p, cloc, fresh);
        let Some(e) = p.entries.get_mut(&engine) else { return };
        let before = e.flags();
        e.state = COUNTABLE;
        e.loc = cloc;
        e.ns = ns_idx;
        let e = *e;
        self.sync(p, before, &e);
        p.countable += 1;
        self.out.grafted += 1;
        self.det_register(p, engine, &e);
        self.cascade(p, engine, Parent::Known { seq: child, loc: cloc });
    }

    /// Resolves the orphans waiting on `parent`, which just became countable or uncountable.
    fn cascade(&mut self, p: &mut Private, parent: u64, how: Parent) {
        if !p.waiting.contains_key(&parent) {
            return;
        }
        let mut stack = vec![(parent, how)];
        while let Some((par, how)) = stack.pop() {
            let Some(children) = p.waiting.remove(&par) else { continue };
            for c in children {
                let Some(info) = p.orphans.remove(&c) else { continue };
                if self.me.cfg.content_deterministic {
                    // Nobody waits on `par` here any more: drop the cross-holder wait too.
                    self.det_unwait(info.ns, par);
                }
                match how {
                    Parent::Known { seq, loc } => {
                        if p.entries.get(&c).is_none() {
                            continue;
                        }
                        let child =
                            chain(SeqHash::from_bits(seq), BlockHash::from_bits(info.content)).to_bits();
                        let ns_idx =
                            if self.me.cfg.content_deterministic { p.ns_index(info.ns) } else { NS_NONE };
                        let (cloc, fresh) = self.place(loc, child, &[]);
                        self.attach(p, cloc, fresh);
                        let Some(e) = p.entries.get_mut(&c) else { continue };
                        let before = e.flags();
                        e.state = COUNTABLE;
                        e.loc = cloc;
                        e.ns = ns_idx;
                        let e = *e;
                        self.sync(p, before, &e);
                        p.countable += 1;
                        self.out.grafted += 1;
                        self.det_register(p, c, &e);
                        stack.push((c, Parent::Known { seq: child, loc: cloc }));
                    }
                    _ => {
                        if let Some(e) = p.entries.get_mut(&c) {
                            e.state = UNCOUNTABLE;
                        }
                        stack.push((c, Parent::Uncountable));
                    }
                }
            }
        }
    }

    fn parent_of(&self, p: &Private, engine: u64) -> Parent {
        match p.entries.get(&engine) {
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
        for b in &ev.blocks {
            p.entries.prefetch(b.engine.to_u64());
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
                    let det = if self.me.cfg.content_deterministic { self.det_lookup(ns, par) } else { None };
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
                release(self.inner, run, self.guard);
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
        let Some(e) = p.entries.get_mut(&engine) else {
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
                    p.entries.insert_new(engine, e);
                    self.attach(p, loc, fresh);
                    self.sync(p, (false, false), &e);
                    p.countable += 1;
                    self.det_register(p, engine, &e);
                    self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
                }
                Ident::Uncountable => {
                    p.entries.insert_new(engine, e);
                    self.cascade(p, engine, Parent::Uncountable);
                }
                Ident::Orphan(info, ns) => {
                    e.state = ORPHAN;
                    e.ns = ns;
                    p.entries.insert_new(engine, e);
                    p.orphans.insert(engine, info);
                    p.waiting.entry(info.parent).or_default().push(engine);
                    self.out.orphaned += 1;
                    if self.me.cfg.content_deterministic {
                        self.det_wait(info.ns, info.parent);
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
                let old = *e;
                e.loc = loc;
                e.ns = ns;
                e.gpu = u8::from(gpu);
                e.low = u8::from(!gpu);
                let new = *e;
                self.attach(p, loc, fresh);
                self.cover(p, old.loc, before, (false, false));
                self.detach(p, old.loc);
                self.sync(p, (false, false), &new);
                self.det_unregister(p, engine, &old);
                self.det_register(p, engine, &new);
                // Relaxed: a statistics counter; nothing is published through it.
                self.inner.counters.conflicts.fetch_add(1, StdOrdering::Relaxed);
            }
            (ORPHAN, Ident::Countable { loc, fresh, ns }) => {
                bump(e, gpu);
                let info = p.orphans.remove(&engine);
                if let Some(info) = info {
                    self.unlink_waiting(p, engine, info);
                }
                self.attach(p, loc, fresh);
                let Some(e) = p.entries.get_mut(&engine) else { return };
                e.state = COUNTABLE;
                e.loc = loc;
                e.ns = ns;
                let e = *e;
                self.sync(p, before, &e);
                p.countable += 1;
                self.out.grafted += 1;
                self.det_register(p, engine, &e);
                self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
            }
            (UNCOUNTABLE, Ident::Countable { loc, fresh, ns }) => {
                bump(e, gpu);
                e.state = COUNTABLE;
                e.loc = loc;
                e.ns = ns;
                let e = *e;
                self.attach(p, loc, fresh);
                self.sync(p, before, &e);
                p.countable += 1;
                self.det_register(p, engine, &e);
                self.cascade(p, engine, Parent::Known { seq: unpack(loc).0.hash(unpack(loc).1), loc });
            }
            (_, ident) => {
                bump(e, gpu);
                let e = *e;
                self.sync(p, before, &e);
                if let Ident::Countable { loc, fresh: true, .. } = ident {
                    // The same block again: the holder already holds its run.
                    release(self.inner, unpack(loc).0, self.guard);
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
            p.waiting.remove(&info.parent);
        }
        if self.me.cfg.content_deterministic && !same_ns_left {
            self.det_unwait(info.ns, info.parent);
        }
    }

    /// Drops entry `engine` entirely.
    fn drop_entry(&mut self, p: &mut Private, engine: u64) {
        let Some(e) = p.entries.remove(&engine) else { return };
        match e.state {
            COUNTABLE => {
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
            let Some(e) = p.entries.get_mut(&engine) else {
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
                let e = *e;
                self.sync(p, before, &e);
            }
        }
    }

    fn clear(&mut self, p: &mut Private) {
        // Unpublish and release every run first, then forget the entries.
        for (key, hr) in std::mem::take(&mut p.runs) {
            // SAFETY: the holder has the run, so it holds a reference to it.
            let run = unsafe { Run::from_bits(key) };
            self.publish(run, hr.published, 0);
            release(self.inner, run, self.guard);
        }
        p.dirty.clear();
        let countable: Vec<(u64, Entry)> =
            p.entries.iter().filter(|(_, e)| e.state == COUNTABLE).map(|(k, e)| (*k, *e)).collect();
        for (engine, e) in countable {
            self.det_unregister(p, engine, &e);
        }
        if self.me.cfg.content_deterministic {
            let waits: Vec<(u64, u64)> = p.orphans.values().map(|o| (o.ns, o.parent)).collect();
            for (ns, parent) in waits {
                self.det_unwait(ns, parent);
            }
        }
        p.entries.clear_all();
        p.orphans = Default::default();
        p.waiting = Default::default();
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
        if p.runs.capacity() > 4 * p.runs.len().max(16) {
            p.runs.shrink_to(2 * p.runs.len());
        }
        self.out.evicted += n as u64;
        n as u64
    }

    /// Capacity and budget limits, after an event.
    fn enforce_limits(&mut self, p: &mut Private) {
        if p.entries.len() > self.me.limit {
            let n = self.evict(p, self.me.cfg.capacity_blocks as usize);
            // Relaxed: a statistics counter; nothing is published through it.
            self.inner.counters.evictions_capacity.fetch_add(n, StdOrdering::Relaxed);
        }
        let budget = self.inner.budget_blocks(self.me.cfg.capacity_blocks);
        if p.entries.len() > budget {
            // Down to the share less the slack, as for the capacity: one selection pass per
            // slack's worth of stores, not one per store.
            let slack = self.inner.cfg.capacity_slack_percent as usize;
            let n = self.evict(p, budget * 100 / (100 + slack));
            // Relaxed: a statistics counter; nothing is published through it.
            self.inner.counters.evictions_budget.fetch_add(n, StdOrdering::Relaxed);
            // Give the memory back: the map was sized for the capacity, not the budget.
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
    fn report(&self, p: &mut Private, before: (usize, usize, usize)) {
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        let c = &self.inner.counters;
        let bytes = p.heap_bytes();
        // Relaxed: a statistics counter; nothing is published through it.
        c.private_bytes.fetch_add(bytes, r);
        // Relaxed: a statistics counter; nothing is published through it.
        c.private_bytes.fetch_sub(p.reported_bytes, r);
        p.reported_bytes = bytes;
        let now = (p.entries.len(), p.countable, p.orphans.len());
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

fn bump(e: &mut Entry, gpu: bool) {
    if gpu {
        e.gpu = e.gpu.saturating_add(1);
    } else {
        e.low = e.low.saturating_add(1);
    }
}

/// Releases a holder's state, then applies grafts other holders left in its mailbox meanwhile.
/// Returns the orphans grafted from the mailbox.
fn unlock<'a>(inner: &Inner, me: &'a HolderShared, guard: &Guard, mut p: MutexGuard<'a, Private>) -> u64 {
    let mut grafted = 0;
    loop {
        if me.mail.load(Ordering::SeqCst) && !me.revoked.load(Ordering::SeqCst) {
            let mut out = ApplyOutcome::default();
            let mut cx = Cx { inner, me, guard, out: &mut out };
            let before = (p.entries.len(), p.countable, p.orphans.len());
            cx.drain_mail(&mut p);
            cx.report(&mut p, before);
            // Relaxed: a statistics counter; nothing is published through it.
            inner.counters.grafts.fetch_add(out.grafted, StdOrdering::Relaxed);
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

impl HolderWriter {
    /// The holder this writer writes.
    #[must_use]
    pub fn holder(&self) -> HolderId {
        self.me.id
    }

    fn run(&mut self, f: impl FnOnce(&mut Cx<'_>, &mut Private)) -> Result<ApplyOutcome, LedgerError> {
        let p = self.me.private.lock();
        if self.me.revoked.load(Ordering::SeqCst) {
            // Relaxed: a statistics counter; nothing is published through it.
            self.inner.counters.refused.fetch_add(1, StdOrdering::Relaxed);
            return Err(LedgerError::Revoked(self.me.id));
        }
        let guard = epoch::pin();
        let mut out = ApplyOutcome::default();
        let mut p = p;
        {
            let mut cx = Cx { inner: &self.inner, me: &self.me, guard: &guard, out: &mut out };
            let before = (p.entries.len(), p.countable, p.orphans.len());
            if cx.me.mail.load(Ordering::SeqCst) {
                cx.drain_mail(&mut p);
            }
            f(&mut cx, &mut p);
            cx.report(&mut p, before);
        }
        let c = &self.inner.counters;
        // Relaxed: a statistics counter; nothing is published through it.
        c.unknown_removes.fetch_add(out.unknown_removes, StdOrdering::Relaxed);
        // Relaxed: a statistics counter; nothing is published through it.
        c.grafts.fetch_add(out.grafted, StdOrdering::Relaxed);
        // Relaxed: a counter only this writer increments; readers poll it.
        self.me.applied.fetch_add(out.events, Ordering::Relaxed);
        out.grafted += unlock(&self.inner, &self.me, &guard, p);
        Ok(out)
    }

    /// Applies one event.
    ///
    /// # Errors
    /// [`LedgerError::Revoked`] once the holder's worker was removed (nothing is written).
    pub fn apply(&mut self, event: &KvEvent) -> Result<ApplyOutcome, LedgerError> {
        self.run(|cx, p| cx.event(p, event))
    }

    /// Applies a batch's events in order.
    ///
    /// # Errors
    /// [`LedgerError::Revoked`] once the holder's worker was removed (nothing is written).
    pub fn apply_batch(&mut self, batch: &EventBatch) -> Result<ApplyOutcome, LedgerError> {
        self.run(|cx, p| {
            for ev in &batch.events {
                cx.event(p, ev);
            }
        })
    }

    /// Drops every block of the holder (`AllBlocksCleared`, engine restart, resync). A revoked
    /// writer has nothing left to clear.
    pub fn clear(&mut self) {
        let _ = self.run(|cx, p| {
            cx.clear(p);
            cx.out.events += 1;
        });
    }

    /// Records that the ledger lost part of the engine's history for this holder: it was
    /// cleared or started without the engine's earlier events (a gap without replay, a replay
    /// that failed or timed out, a restart, an undecodable batch, a cold start). An engine's own
    /// `AllBlocksCleared` is not such a loss: the engine forgot too. Read by
    /// [`Ledger::history_lost`].
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
        self.inner.slots.set_ready(self.me.slot, r == Readiness::Ready);
    }

    /// Events applied so far (clears included): a monotone counter tests and the ingest runtime
    /// can wait on.
    #[must_use]
    pub fn applied(&self) -> u64 {
        // Relaxed: a monotone counter.
        self.me.applied.load(Ordering::Relaxed)
    }
}

/// The `SeqHash` bits of the block at `loc` (its run is held by the caller).
fn seq_at(loc: u64) -> u64 {
    let (run, off) = unpack(loc);
    run.hash(off)
}

// A run's mask word per group is `L << 32 | holders`: one bit per holder of the group.
const _: () = assert!(GROUP == 32);

impl Drop for Inner {
    fn drop(&mut self) {
        // No query or writer is left: free every run still referenced (by a holder, the
        // deterministic index or a pending graft) directly, each once.
        #[cfg(loom)]
        if std::thread::panicking() {
            return;
        }
        let mut runs = std::collections::HashSet::new();
        for h in self.registry.lock().by_id.values() {
            runs.extend(h.private.lock().runs.keys().copied());
            runs.extend(h.mailbox.lock().iter().map(|g| unpack(g.loc).0.bits()));
        }
        for shard in self.det.blocks.iter() {
            runs.extend(shard.lock().values().map(|e| unpack(e.loc).0.bits()));
        }
        for bits in runs {
            // SAFETY: `&mut self`: no reader or writer is left, and each run is freed once.
            unsafe { Run::from_bits(bits).free() };
        }
    }
}
