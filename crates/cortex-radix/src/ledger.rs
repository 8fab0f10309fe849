//! The ledger: its public types, registering and removing holders, the overlap query, budgets,
//! dumps and stats. How a holder's events change it is the writer's (`ledger/writer.rs`); the
//! index that grafts orphans across content-deterministic holders is `deterministic.rs`.
//!
//! Key decision: the shared structure is a set of *runs* (`run.rs`), contiguous pieces of `SeqHash`
//! chains, each block in exactly one run, found by their first block in the head table
//! (`table.rs`). A query costs one lookup per run it crosses, not one per block: the chain property
//! lets it compare a whole run with the prompt in one comparison. All per-(holder, block)
//! bookkeeping — engine hashes, reference counts, tiers, orphans, LRU stamps, which offsets of
//! which run the holder has — is private to the holder's single writer (`holder.rs`), which
//! publishes per run only two cuts. Writers of different holders run in parallel and meet only on
//! short locks: the head table's shards (creating, finding and reclaiming runs) and, for
//! content-deterministic holders, the deterministic index's; readers pin an epoch and never lock.

mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64 as StdAtomicU64, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};

use cortex_hash::SeqHash;
use cortex_hash::kv::{HolderId, WorkerId};

use crate::deterministic::DeterministicIndex;
use crate::holder::{COUNTABLE, ORPHAN, Private};
use crate::overlap::{Overlap, OverlapScores};
use crate::run::{GROUPS, Run, head_key, unpack};
use crate::slots::{GROUP, Slots};
use crate::sync::epoch;
use crate::sync::{AtomicBool, AtomicU8, AtomicU64, Mutex, Ordering};
use crate::table::SlotTable;

use writer::Graft;
pub use writer::HolderWriter;

/// The most holders one ledger indexes at once (32 groups).
pub const MAX_HOLDERS: u32 = 1024;
const _: () = assert!(GROUPS == (MAX_HOLDERS / GROUP) as usize);

/// Runs a query looks up ahead (in the head table only) before it reads them.
const PATH: usize = 16;

/// The bytes per (holder, block), besides the runs' own allocations, that
/// [`LedgerConfig::byte_budget`] is converted to blocks with: about two and a half times what a
/// holder's entry and its share of the head table and the deterministic index cost at the
/// structures' usual load where prompts share long chains. A workload of short suffixes of their
/// own uses nearly all of it (the gateway soak: ~177 B per block, ~80 B of them runs, at 98.5 %
/// of its budget), so the budget holds there with little room. The runs are charged as they are: the conversion adds the live runs' bytes and the
/// holders' records of them per (holder, block) — a few bytes where prompts share long chains,
/// ~80 B where every request stores a short suffix of its own, up to a whole run where holders
/// keep only a run's head.
/// Converting to blocks rather than evicting while measured bytes exceed the budget cannot
/// thrash: arrays that have not shrunk yet never make the ledger evict again, and run bytes fall
/// with the blocks evicted (a run is freed with its last block).
pub const BUDGET_BYTES_PER_BLOCK: usize = 96;

/// What a holder's record of a run it has blocks of costs at worst, charged with the runs.
const RUN_RECORD_BYTES: u128 = crate::holder::RUN_RECORD_BYTES as u128;

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
    /// A thread panicked part-way through a write of this holder (its own writer's, or another
    /// holder's writer leaving it a graft): its state is no longer used. Quarantine it
    /// ([`Ledger::quarantine`]) and register it again to rebuild it.
    #[error("holder {0}'s state was left half-changed by a panic; quarantine it and register it again")]
    Poisoned(HolderId),
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
    /// Holders taken out without being cleared ([`Ledger::quarantine`], or removed while a panic
    /// had left their state half-changed): what each held is leaked, still counted in
    /// `live_bytes` and `blocks`.
    pub quarantined_holders: u64,
    /// (holder, namespace, parent) waits of content-deterministic orphans on other holders.
    pub deterministic_waits: usize,
    /// Distinct (namespace, engine hash) countable blocks of content-deterministic holders.
    pub deterministic_blocks: usize,
}

/// The ledger-wide counters behind [`LedgerStats`] (the deterministic index counts its own
/// bytes).
#[derive(Default)]
struct Counters {
    run_bytes: StdAtomicUsize,
    runs: StdAtomicUsize,
    run_blocks: StdAtomicU64,
    private_bytes: StdAtomicUsize,
    blocks: StdAtomicU64,
    /// (holder, run) records: the runs each holder has blocks of.
    holder_runs: StdAtomicU64,
    countable: StdAtomicU64,
    orphans: StdAtomicU64,
    capacity: StdAtomicU64,
    evictions_capacity: StdAtomicU64,
    evictions_budget: StdAtomicU64,
    unknown_removes: StdAtomicU64,
    conflicts: StdAtomicU64,
    grafts: StdAtomicU64,
    refused: StdAtomicU64,
    quarantined: StdAtomicU64,
}

/// A registered holder, shared by the registry, its writer and (to leave grafts) the other
/// holders' writers.
struct HolderShared {
    id: HolderId,
    /// Its slot in the query's holder slots (and in the runs' groups).
    slot: u32,
    cfg: HolderConfig,
    /// Blocks it may keep before the capacity eviction: capacity plus slack.
    limit: usize,
    /// The writer-owned state, locked for every write.
    private: Mutex<Private>,
    /// Set by `remove_worker`: the writer may no longer write.
    revoked: AtomicBool,
    /// Set (with `revoked`, the slot retracted) when a thread panicked while it held `private`:
    /// the state may be half-changed, so nothing reads or changes it again (see
    /// [`Ledger::quarantine`]).
    poisoned: AtomicBool,
    readiness: AtomicU8,
    /// Grafts other holders' writers left for it.
    mailbox: Mutex<Vec<Graft>>,
    /// The mailbox may be non-empty (see `writer::unlock`).
    mail: AtomicBool,
    /// Events applied.
    applied: AtomicU64,
    /// Times the writer said the ledger lost part of the engine's history (see
    /// [`HolderWriter::mark_history_lost`]).
    history_lost: StdAtomicU64,
    /// Blocks it holds (orphans included), as of its writer's last write.
    held: StdAtomicU64,
}

/// How far a holder's writer has followed its engine ([`Ledger::progress`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderProgress {
    /// Events applied: moves whenever the engine's events reach the ledger.
    pub events_applied: u64,
    /// [`Ledger::history_lost`].
    pub history_lost: u64,
}

/// The registered holders, by id and by slot.
#[derive(Default)]
struct Registry {
    by_id: std::collections::HashMap<HolderId, Arc<HolderShared>>,
    by_slot: Vec<Option<Arc<HolderShared>>>,
    next_slot: u32,
}

/// What the [`Ledger`] handle and every [`HolderWriter`] share: the head table and the holder
/// slots queries read, the registry of holders, the deterministic index and the counters.
struct LedgerShared {
    cfg: LedgerConfig,
    table: SlotTable,
    slots: Slots,
    registry: Mutex<Registry>,
    free_slots: Arc<Mutex<Vec<u32>>>,
    det: DeterministicIndex,
    counters: Counters,
}

/// The KV ledger. Shared as `Arc<Ledger>`; see the crate documentation.
pub struct Ledger {
    shared: Arc<LedgerShared>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("cfg", &self.shared.cfg).field("stats", &self.stats()).finish()
    }
}

fn encode_id(id: HolderId) -> u64 {
    (u64::from(id.worker.0) << 16) | u64::from(id.rank.0)
}

fn decode_id(v: u64) -> HolderId {
    HolderId::new(WorkerId((v >> 16) as u32), cortex_hash::kv::DpRank(v as u16))
}

impl HolderShared {
    fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }
}

impl LedgerShared {
    /// Stops `h` at once: its writer revoked, its slot no longer counted by queries.
    fn retract(&self, h: &HolderShared) {
        h.revoked.store(true, Ordering::SeqCst);
        self.slots.retract(h.slot);
    }

    /// The rest of taking a holder out: its grafts' waits dropped, its capacity no longer
    /// counted.
    fn unregister(&self, h: &HolderShared) {
        self.det.forget_waits_of(h.slot);
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.capacity.fetch_sub(u64::from(h.cfg.capacity_blocks), StdOrdering::Relaxed);
    }

    /// Takes a holder out without clearing it (quarantined or poisoned): unregistered, counted
    /// as quarantined, its slot leaked.
    fn forget(&self, h: &HolderShared) {
        self.unregister(h);
        // Relaxed: a statistics counter; nothing is published through it.
        self.counters.quarantined.fetch_add(1, StdOrdering::Relaxed);
    }
}

impl Ledger {
    /// An empty ledger.
    #[must_use]
    pub fn new(cfg: LedgerConfig) -> Arc<Ledger> {
        Arc::new(Ledger {
            shared: Arc::new(LedgerShared {
                cfg,
                table: SlotTable::new(),
                slots: Slots::new(MAX_HOLDERS),
                registry: Mutex::new(Registry::default()),
                free_slots: Arc::new(Mutex::new(Vec::new())),
                det: DeterministicIndex::new(),
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
        let shared = &self.shared;
        let mut reg = shared.registry.lock();
        if reg.by_id.contains_key(&holder) {
            return Err(LedgerError::HolderExists(holder));
        }
        let slot = match shared.free_slots.lock().pop() {
            Some(s) => s,
            None if reg.next_slot < MAX_HOLDERS => {
                reg.next_slot += 1;
                reg.next_slot - 1
            }
            None => return Err(LedgerError::TooManyHolders),
        };
        let cap = cfg.capacity_blocks as usize;
        let limit = cap + cap * shared.cfg.capacity_slack_percent as usize / 100;
        let h = Arc::new(HolderShared {
            id: holder,
            slot,
            cfg,
            limit,
            private: Mutex::new(Private {
                entries: crate::holder::EngineMap::with_capacity_target(cfg.capacity_blocks as usize),
                ..Private::default()
            }),
            revoked: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            readiness: AtomicU8::new(Readiness::Syncing.to_u8()),
            mailbox: Mutex::new(Vec::new()),
            mail: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            history_lost: StdAtomicU64::new(0),
            held: StdAtomicU64::new(0),
        });
        shared.slots.publish(slot, encode_id(holder));
        if reg.by_slot.len() <= slot as usize {
            reg.by_slot.resize(slot as usize + 1, None);
        }
        reg.by_slot[slot as usize] = Some(h.clone());
        reg.by_id.insert(holder, h.clone());
        // Relaxed: a statistics counter; nothing is published through it.
        shared.counters.capacity.fetch_add(u64::from(cfg.capacity_blocks), StdOrdering::Relaxed);
        Ok(HolderWriter::new(shared.clone(), h))
    }

    /// For every holder, how many leading blocks of `seq` it holds contiguously, on GPU and on
    /// any tier. Lock-free and allocation-free with a reused `out` (sized for the holders).
    ///
    /// `seq` is a prompt's chain of `SeqHash`es from its namespace's root (as
    /// `Namespace::seq_hashes` makes it). A block being written concurrently may be missed (an
    /// under-count); a block is counted only if its holder had it at some instant during the query.
    pub fn query(&self, seq: &[SeqHash], opts: QueryOptions, out: &mut OverlapScores) {
        let shared = &*self.shared;
        let n = seq.len();
        out.begin(n as u32);
        if seq.is_empty() {
            return;
        }
        let guard = epoch::pin();
        // Per counted group: (group, GPU-alive bits, any-alive bits).
        let mut states: [(u32, u32, u32); GROUPS] = [(0, 0, 0); GROUPS];
        let mut n_states = 0;
        for g in 0..shared.slots.groups() {
            let mask = shared.slots.counted(g, opts.holders == HolderFilter::Ready);
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
                let id = decode_id(shared.slots.id(g * GROUP + b));
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
                let v = shared.table.get(head_key(seq[p].to_bits()), &guard);
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
        let reg = self.shared.registry.lock();
        // Relaxed: a status read, ordered by the registry lock against registration.
        reg.by_id.get(&holder).map(|h| Readiness::from_u8(h.readiness.load(Ordering::Relaxed)))
    }

    /// How many blocks `holder` holds (orphans included) as of its writer's last write, `None`
    /// if it is not registered: how full its engine's cache is, against its capacity. Takes the
    /// registry lock: for the gateway's periodic sync, off the request path.
    #[must_use]
    pub fn held_blocks(&self, holder: HolderId) -> Option<u64> {
        let reg = self.shared.registry.lock();
        // Relaxed: a gauge its writer stores after each write; nothing is published through it.
        reg.by_id.get(&holder).map(|h| h.held.load(StdOrdering::Relaxed))
    }

    /// How far `holder`'s writer has followed its engine, `None` if it is not registered: the
    /// events it applied and [`Ledger::history_lost`], read under one lock of the registry.
    #[must_use]
    pub fn progress(&self, holder: HolderId) -> Option<HolderProgress> {
        let reg = self.shared.registry.lock();
        reg.by_id.get(&holder).map(|h| HolderProgress {
            // Relaxed (both): monotone counters read as a status.
            events_applied: h.applied.load(Ordering::Relaxed),
            history_lost: h.history_lost.load(StdOrdering::Relaxed),
        })
    }

    /// How many times `holder`'s writer said the ledger lost part of its engine's history
    /// ([`HolderWriter::mark_history_lost`]), `None` if it is not registered. Zero means the
    /// ledger has followed the engine's every event since its cache was empty, so a block the
    /// ledger lacks, the engine lacks too; otherwise the engine may hold blocks stored before
    /// the loss that it will never announce again. Takes the registry lock: for verification
    /// off the request path.
    #[must_use]
    pub fn history_lost(&self, holder: HolderId) -> Option<u64> {
        let reg = self.shared.registry.lock();
        // Relaxed: a monotone counter read as a status.
        reg.by_id.get(&holder).map(|h| h.history_lost.load(StdOrdering::Relaxed))
    }

    /// Whether `holder` lost the countable block `seq` lately — its engine removed it, or the
    /// ledger evicted it — among the last 3,000–6,000 blocks it lost (a filter: up to ~6 % of
    /// blocks never held also read as lost, with both generations full). `false` if the holder is not registered. Locks the
    /// holder (waits for an apply in progress): for verification off the request path.
    #[must_use]
    pub fn lost_lately(&self, holder: HolderId, seq: SeqHash) -> bool {
        let Some(h) = self.shared.registry.lock().by_id.get(&holder).cloned() else { return false };
        let p = h.private.lock();
        !h.is_poisoned() && p.gone.contains(seq.to_bits())
    }

    /// Removes every rank of `worker`: queries stop counting them at once, their blocks are
    /// dropped, and their writers' later applies are refused with [`LedgerError::Revoked`].
    /// Waits for an apply in progress on one of them to finish.
    pub fn remove_worker(&self, worker: WorkerId) {
        let shared = &self.shared;
        let victims: Vec<Arc<HolderShared>> = {
            let mut reg = shared.registry.lock();
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
            shared.retract(&h);
            let p = h.private.lock();
            if h.is_poisoned() {
                // Half-changed by a panic: quarantined, never cleared (see `quarantine`).
                drop(p);
                shared.forget(&h);
                continue;
            }
            let guard = epoch::pin();
            writer::empty_removed(shared, &h, &guard, p);
            shared.unregister(&h);
            // The slot is reused only after every query that may still read it has ended.
            let free = shared.free_slots.clone();
            let slot = h.slot;
            guard.defer(move || free.lock().push(slot));
            guard.flush();
        }
    }

    /// Takes `holder` out of the ledger without reading or changing what it holds: for a holder
    /// whose state a panic left half-changed ([`LedgerError::Poisoned`]), where clearing could
    /// free a run still in use. Queries stop counting it at once, its writer is revoked, other
    /// holders' grafts no longer reach it, and its id may be registered again with
    /// [`Ledger::add_holder`] (a rebuild from its engine). What it held is leaked on purpose: its
    /// run references are never released and its slot is never reused (the runs keep its cuts),
    /// and its blocks and bytes stay counted in [`LedgerStats`]. A holder poisoned by a panic is
    /// already out of queries and refuses writes; this only frees its id. Returns how many times
    /// it had lost history ([`Ledger::history_lost`]), for the new registration to carry on
    /// from, or `None` if the holder is not registered.
    pub fn quarantine(&self, holder: HolderId) -> Option<u64> {
        let shared = &self.shared;
        let h = {
            let mut reg = shared.registry.lock();
            let h = reg.by_id.remove(&holder)?;
            reg.by_slot[h.slot as usize] = None;
            h
        };
        shared.retract(&h);
        shared.forget(&h);
        // Relaxed: a monotone counter read as a status.
        Some(h.history_lost.load(StdOrdering::Relaxed))
    }

    /// Holders quarantined so far ([`LedgerStats::quarantined_holders`], without the rest).
    #[must_use]
    pub fn quarantined(&self) -> u64 {
        // Relaxed: a statistics counter.
        self.shared.counters.quarantined.load(StdOrdering::Relaxed)
    }

    /// One block of a holder, by the engine's hash: its state and references, `None` if the
    /// holder does not have it. Locks the holder briefly (waits for an apply in progress): for
    /// verification off the request path, such as checking that a worker published the engine
    /// hashes the gateway predicted for a request.
    #[must_use]
    pub fn block(&self, holder: HolderId, engine: cortex_hash::kv::EngineHash) -> Option<DumpBlock> {
        let h = self.shared.registry.lock().by_id.get(&holder).cloned()?;
        let p = h.private.lock();
        if h.is_poisoned() {
            return None;
        }
        let e = p.entry(engine.to_u64())?;
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
        let h = self.shared.registry.lock().by_id.get(&holder).cloned()?;
        let p = h.private.lock();
        if h.is_poisoned() {
            return None;
        }
        let mut blocks: Vec<DumpBlock> = p
            .iter_entries()
            .map(|(engine, e)| DumpBlock {
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
        let i = &self.shared;
        let c = &i.counters;
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        let table_bytes = i.table.counters.bytes.load(r) + c.run_bytes.load(r);
        LedgerStats {
            live_bytes: self.shared.live_bytes(),
            table_bytes,
            holder_bytes: c.private_bytes.load(r),
            deterministic_index_bytes: i.det.heap_bytes(),
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
            quarantined_holders: c.quarantined.load(r),
            deterministic_waits: i.det.waits(),
            deterministic_blocks: i.det.blocks(),
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

impl LedgerShared {
    fn live_bytes(&self) -> usize {
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        self.table.counters.bytes.load(r)
            + self.counters.run_bytes.load(r)
            + self.counters.private_bytes.load(r)
            + self.det.heap_bytes()
            + std::mem::size_of::<LedgerShared>()
            + self.slots.heap_bytes()
    }

    /// The most blocks a holder of capacity `cap` may keep under the byte budget: its
    /// capacity-proportional share of the budget, at [`BUDGET_BYTES_PER_BLOCK`] plus the live
    /// runs' bytes and their holders' records of them per (holder, block) each.
    fn budget_blocks(&self, cap: u32) -> usize {
        // Relaxed: statistics counters; nothing is published through them.
        let r = StdOrdering::Relaxed;
        // (holder, block) pairs, as of the last apply's end. Not the runs' blocks: under eviction
        // churn runs keep blocks no holder has, and dividing by those under-charged the runs (the
        // gateway soak left its budget). During an apply the count lags its new runs, which
        // over-charges, so a tight budget may evict more than it must: never too little.
        let blocks = self.counters.blocks.load(r).max(1) as u128;
        let runs = self.counters.run_bytes.load(r) as u128
            + RUN_RECORD_BYTES * u128::from(self.counters.holder_runs.load(r));
        let per_block = BUDGET_BYTES_PER_BLOCK as u128 + runs / blocks;
        let allowed = self.cfg.byte_budget as u128 / per_block;
        let total_cap = self.counters.capacity.load(r).max(1);
        (allowed * u128::from(cap) / u128::from(total_cap)) as usize
    }
}

/// The `SeqHash` bits of the block at `loc` (its run is held by the caller).
fn seq_at(loc: u64) -> u64 {
    let (run, off) = unpack(loc);
    run.hash(off)
}

// A run's mask word per group is `L << 32 | holders`: one bit per holder of the group.
const _: () = assert!(GROUP == 32);

impl Drop for LedgerShared {
    fn drop(&mut self) {
        // No query or writer is left: free every run still referenced (by a holder, the
        // deterministic index or a pending graft) directly, each once.
        #[cfg(loom)]
        if std::thread::panicking() {
            return;
        }
        let mut runs = std::collections::HashSet::new();
        for h in self.registry.lock().by_id.values().filter(|h| !h.is_poisoned()) {
            runs.extend(h.private.lock().runs.iter().map(|(r, _)| r));
            runs.extend(h.mailbox.lock().iter().map(|g| unpack(g.loc).0.bits()));
        }
        self.det.collect_runs(&mut runs);
        for bits in runs {
            // SAFETY: `&mut self`: no reader or writer is left, and each run is freed once.
            unsafe { Run::from_bits(bits).free() };
        }
    }
}
