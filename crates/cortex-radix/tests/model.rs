//! Model-based test: the real ledger against a naive reference (plain ordered maps implementing
//! the same rules, orphans and deterministic grafting included), driven by the same random
//! operations; every query and every holder dump is compared after every operation. A self-test
//! shows the harness catches a ledger that drops a remove.

use std::collections::{BTreeMap, BTreeSet};

use cortex_hash::kv::{
    BlockRemoved, BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};
use cortex_radix::{
    DumpState, EarlyExit, HolderConfig, HolderFilter, HolderWriter, Ledger, LedgerConfig, Overlap,
    OverlapScores, QueryOptions, Readiness,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

// ---------------------------------------------------------------------------------------------
// The universe: holders and chains.

const HOLDERS: [(u32, u16, bool, u32); 4] =
    [(0, 0, false, 8), (0, 1, true, 12), (1, 0, true, 16), (2, 0, false, 96)];
const SLACK_PERCENT: u32 = 25;

fn holder_id(h: usize) -> HolderId {
    HolderId::new(WorkerId(HOLDERS[h].0), DpRank(HOLDERS[h].1))
}

fn namespaces() -> [Namespace; 2] {
    [Namespace::new(Engine::Sglang, 2, "m", None), Namespace::new(Engine::Sglang, 2, "m", Some("lora"))]
}

/// A chain spec: namespace index, salt, page ids (each page is `[id, id]`).
struct Spec {
    ns: usize,
    salt: Option<&'static str>,
    pages: Vec<u32>,
}

fn specs() -> Vec<Spec> {
    vec![
        Spec { ns: 0, salt: None, pages: vec![1, 2, 3, 4, 5, 6, 7, 8] },
        Spec { ns: 0, salt: None, pages: vec![1, 2, 3, 9, 10, 11] },
        Spec { ns: 1, salt: None, pages: vec![1, 2, 3, 4, 5, 6] },
        Spec { ns: 0, salt: Some("s"), pages: vec![1, 2, 3, 4] },
        Spec { ns: 0, salt: None, pages: vec![20, 21, 22, 23, 24, 25, 26, 27, 28, 29] },
        // Long enough to fill runs (16 reserved for a short store, up to 64 for a long one) and
        // continue in the next; the second leaves the first inside a run.
        Spec { ns: 0, salt: None, pages: (40..120).collect() },
        Spec { ns: 0, salt: None, pages: (40..80).chain(200..230).collect() },
    ]
}

struct Universe {
    ns: [Namespace; 2],
    specs: Vec<Spec>,
    /// Per spec: the SeqHash of every position.
    seqs: Vec<Vec<SeqHash>>,
}

impl Universe {
    fn new() -> Self {
        let ns = namespaces();
        let specs = specs();
        let seqs = specs
            .iter()
            .map(|s| {
                let tokens: Vec<u32> = s.pages.iter().flat_map(|&p| [p, p]).collect();
                ns[s.ns].seq_hashes(s.salt, &tokens)
            })
            .collect();
        Universe { ns, specs, seqs }
    }

    fn content(&self, spec: usize, pos: usize) -> BlockHash {
        let p = self.specs[spec].pages[pos];
        self.ns[self.specs[spec].ns].block_hash(&[p, p])
    }

    fn lineage(&self, spec: usize) -> Lineage {
        Lineage::new(self.ns[self.specs[spec].ns], self.specs[spec].salt)
    }

    /// The engine hash holder `h` gives position `pos` of `spec`: a function of the chain for
    /// content-deterministic holders (equal across them), holder-specific otherwise.
    fn engine(&self, h: usize, spec: usize, pos: usize) -> EngineHash {
        let seq = self.seqs[spec][pos].to_bits();
        let seed = if HOLDERS[h].2 { 0xD00D } else { 0x1000 + h as u64 };
        EngineHash::from_u64(seq.rotate_left(17) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

// ---------------------------------------------------------------------------------------------
// Operations.

#[derive(Clone, Debug)]
enum Op {
    /// Stores positions `from..to` of a spec (its parent is position `from - 1`).
    Store {
        h: usize,
        spec: usize,
        from: usize,
        len: usize,
        lineage: bool,
        tier: u8,
    },
    /// Stores positions `0..len` of a spec in 16-block events, one after another, as an engine
    /// stores a long prompt: runs grow by appends, fill and continue in the next.
    Prompt {
        h: usize,
        spec: usize,
        len: usize,
    },
    /// Re-stores a known engine hash with another identity (a broken or reused hash).
    Conflict {
        h: usize,
        spec: usize,
        pos: usize,
        page: u32,
    },
    /// Removes positions `pos..pos + n` of a spec, or hashes nobody has.
    Remove {
        h: usize,
        spec: usize,
        pos: usize,
        n: usize,
        tier: u8,
        garbage: bool,
    },
    Clear {
        h: usize,
    },
    RemoveWorker {
        h: usize,
    },
    AddBack {
        h: usize,
    },
    Ready {
        h: usize,
        r: u8,
    },
}

fn medium(tier: u8) -> Medium {
    match tier % 4 {
        0 | 1 => Medium::Gpu,
        2 => Medium::Cpu,
        _ => Medium::Storage,
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let h = 0..HOLDERS.len();
    prop_oneof![
        10 => (h.clone(), 0..7usize, 0..80usize, prop_oneof![4 => 1..6usize, 1 => 14..24usize], prop::bool::weighted(0.9), 0..4u8).prop_map(
            |(h, spec, from, len, lineage, tier)| Op::Store { h, spec, from, len, lineage, tier }
        ),
        1 => (h.clone(), 5..7usize, 17..80usize).prop_map(|(h, spec, len)| Op::Prompt { h, spec, len }),
        1 => (h.clone(), 0..7usize, 0..80usize, 100..103u32).prop_map(|(h, spec, pos, page)| Op::Conflict { h, spec, pos, page }),
        5 => (h.clone(), 0..7usize, 0..80usize, 1..4usize, 0..4u8, prop::bool::weighted(0.15))
            .prop_map(|(h, spec, pos, n, tier, garbage)| Op::Remove { h, spec, pos, n, tier, garbage }),
        1 => h.clone().prop_map(|h| Op::Clear { h }),
        1 => h.clone().prop_map(|h| Op::RemoveWorker { h }),
        2 => h.clone().prop_map(|h| Op::AddBack { h }),
        2 => (h, 0..3u8).prop_map(|(h, r)| Op::Ready { h, r }),
    ]
}

fn readiness(r: u8) -> Readiness {
    match r {
        0 => Readiness::Ready,
        1 => Readiness::Syncing,
        _ => Readiness::Stale,
    }
}

/// The event an op means for holder `h` (None: not an event).
fn event(u: &Universe, op: &Op) -> Option<(usize, KvEvent)> {
    match *op {
        Op::Store { h, spec, from, len, lineage, tier } => {
            let n = u.specs[spec].pages.len();
            let from = from % n;
            let to = (from + len).min(n);
            let blocks = (from..to)
                .map(|p| StoredBlock { engine: u.engine(h, spec, p), content: u.content(spec, p) })
                .collect();
            Some((
                h,
                KvEvent::Stored(BlockStored {
                    parent: (from > 0).then(|| u.engine(h, spec, from - 1)),
                    blocks,
                    lineage: lineage.then(|| u.lineage(spec)),
                    medium: medium(tier),
                }),
            ))
        }
        Op::Conflict { h, spec, pos, page } => {
            // Deterministic holders' hashes are functions of the content: no conflicts there.
            let h = if HOLDERS[h].2 { 0 } else { h };
            let pos = pos % u.specs[spec].pages.len();
            let ns = u.ns[u.specs[spec].ns];
            Some((
                h,
                KvEvent::Stored(BlockStored {
                    parent: None,
                    blocks: vec![StoredBlock {
                        engine: u.engine(h, spec, pos),
                        content: ns.block_hash(&[page, page]),
                    }],
                    lineage: Some(Lineage::new(ns, None)),
                    medium: Medium::Gpu,
                }),
            ))
        }
        Op::Remove { h, spec, pos, n, tier, garbage } => {
            let len = u.specs[spec].pages.len();
            let pos = pos % len;
            let blocks = if garbage {
                (0..n).map(|i| EngineHash::from_u64(0xdead_0000 + (pos + i) as u64)).collect()
            } else {
                (pos..(pos + n).min(len)).map(|p| u.engine(h, spec, p)).collect()
            };
            Some((h, KvEvent::Removed(BlockRemoved { blocks, medium: medium(tier) })))
        }
        Op::Clear { h } => Some((h, KvEvent::AllCleared)),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The reference: ordered maps, rules written out plainly, fixpoint grafting.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Countable(u64),
    Orphan { parent: u64, content: u64, ns: u64 },
    Uncountable,
}

#[derive(Clone, Copy, Debug)]
struct MEntry {
    state: MState,
    gpu: u32,
    low: u32,
    stamp: u64,
    /// Namespace of a countable block (for deterministic grafting).
    ns: Option<u64>,
}

struct MHolder {
    det: bool,
    cap: usize,
    ready: Readiness,
    entries: BTreeMap<u64, MEntry>,
    tick: u64,
}

#[derive(Default)]
struct Model {
    holders: BTreeMap<usize, MHolder>,
}

enum MParent {
    Known(u64),
    Uncountable,
    Waiting(u64),
}

impl Model {
    fn add(&mut self, h: usize) {
        self.holders.insert(
            h,
            MHolder {
                det: HOLDERS[h].2,
                cap: HOLDERS[h].3 as usize,
                ready: Readiness::Syncing,
                entries: BTreeMap::new(),
                tick: 0,
            },
        );
    }

    fn parent_of(&self, h: usize, engine: u64) -> MParent {
        match self.holders[&h].entries.get(&engine).map(|e| e.state) {
            Some(MState::Countable(s)) => MParent::Known(s),
            Some(MState::Uncountable) => MParent::Uncountable,
            _ => MParent::Waiting(engine),
        }
    }

    /// The SeqHash some content-deterministic holder has for `(ns, engine)`, countable.
    fn det_seq(&self, ns: u64, engine: u64) -> Option<u64> {
        self.holders.values().filter(|m| m.det).find_map(|m| match m.entries.get(&engine) {
            Some(MEntry { state: MState::Countable(s), ns: Some(n), .. }) if *n == ns => Some(*s),
            _ => None,
        })
    }

    fn apply(&mut self, h: usize, ev: &KvEvent) {
        match ev {
            KvEvent::Stored(st) => {
                let gpu = st.medium.is_gpu();
                let ns = st.lineage.map(|l| l.namespace.to_bits());
                let mut parent = match (st.parent, st.lineage) {
                    (_, None) => MParent::Uncountable,
                    (None, Some(l)) => MParent::Known(l.root.to_bits()),
                    (Some(p), Some(_)) => self.parent_of(h, p.to_u64()),
                };
                for b in &st.blocks {
                    let content = b.content.to_bits();
                    let ident = match (parent, ns) {
                        (MParent::Known(s), Some(_)) => MState::Countable(seq_of(s, content)),
                        (MParent::Waiting(p), Some(ns)) => {
                            match self.holders[&h].det.then(|| self.det_seq(ns, p)).flatten() {
                                Some(s) => MState::Countable(seq_of(s, content)),
                                None => MState::Orphan { parent: p, content, ns },
                            }
                        }
                        _ => MState::Uncountable,
                    };
                    let m = self.holders.get_mut(&h).expect("holder");
                    let stamp = m.tick;
                    m.tick += 1;
                    let engine = b.engine.to_u64();
                    let (g, l) = (u32::from(gpu), u32::from(!gpu));
                    match m.entries.get_mut(&engine) {
                        None => {
                            m.entries.insert(engine, MEntry { state: ident, gpu: g, low: l, stamp, ns });
                        }
                        Some(e) => {
                            e.stamp = stamp;
                            match (e.state, ident) {
                                (MState::Countable(a), MState::Countable(b)) if a != b => {
                                    e.state = ident;
                                    e.gpu = g;
                                    e.low = l;
                                    e.ns = ns;
                                }
                                (MState::Orphan { .. } | MState::Uncountable, MState::Countable(_)) => {
                                    e.state = ident;
                                    e.ns = ns;
                                    e.gpu = (e.gpu + g).min(255);
                                    e.low = (e.low + l).min(255);
                                }
                                _ => {
                                    e.gpu = (e.gpu + g).min(255);
                                    e.low = (e.low + l).min(255);
                                }
                            }
                        }
                    }
                    self.fixpoint();
                    parent = self.parent_of(h, engine);
                }
            }
            KvEvent::Removed(r) => {
                let m = self.holders.get_mut(&h).expect("holder");
                for e in &r.blocks {
                    let Some(entry) = m.entries.get_mut(&e.to_u64()) else { continue };
                    let c = if r.medium.is_gpu() { &mut entry.gpu } else { &mut entry.low };
                    if *c > 0 {
                        *c -= 1;
                    }
                    if entry.gpu + entry.low == 0 {
                        m.entries.remove(&e.to_u64());
                    }
                }
            }
            KvEvent::AllCleared => {
                self.holders.get_mut(&h).expect("holder").entries.clear();
            }
        }
        // Capacity: past capacity plus slack, the least recently stored go, down to capacity.
        let m = self.holders.get_mut(&h).expect("holder");
        if m.entries.len() > m.cap + m.cap * SLACK_PERCENT as usize / 100 {
            let mut by_age: Vec<(u64, u64)> = m.entries.iter().map(|(k, e)| (e.stamp, *k)).collect();
            by_age.sort_unstable();
            let n = m.entries.len() - m.cap;
            for (_, k) in by_age.into_iter().take(n) {
                m.entries.remove(&k);
            }
        }
    }

    /// Grafts every orphan whose parent is known, until nothing changes: in its own holder
    /// first (countable: graft; uncountable: uncountable), else — content-deterministic holders
    /// only — from any content-deterministic holder with the parent countable in the same
    /// namespace.
    fn fixpoint(&mut self) {
        loop {
            let mut change = None;
            'find: for (&h, m) in &self.holders {
                for (&engine, e) in &m.entries {
                    let MState::Orphan { parent, content, ns } = e.state else { continue };
                    let new = match m.entries.get(&parent).map(|p| p.state) {
                        Some(MState::Countable(s)) => Some((MState::Countable(seq_of(s, content)), Some(ns))),
                        Some(MState::Uncountable) => Some((MState::Uncountable, e.ns)),
                        _ if m.det => self
                            .det_seq(ns, parent)
                            .map(|s| (MState::Countable(seq_of(s, content)), Some(ns))),
                        _ => None,
                    };
                    if let Some(new) = new {
                        change = Some((h, engine, new));
                        break 'find;
                    }
                }
            }
            let Some((h, engine, (state, ns))) = change else { return };
            let e = self.holders.get_mut(&h).and_then(|m| m.entries.get_mut(&engine)).expect("entry");
            e.state = state;
            e.ns = ns;
        }
    }

    fn query(&self, seqs: &[SeqHash], opts: QueryOptions) -> BTreeSet<(HolderId, u32, u32)> {
        let mut exact = Vec::new();
        for (&h, m) in &self.holders {
            if opts.holders == HolderFilter::Ready && m.ready != Readiness::Ready {
                continue;
            }
            let has = |s: SeqHash, gpu: bool| {
                m.entries.values().any(|e| {
                    e.state == MState::Countable(s.to_bits())
                        && if gpu { e.gpu > 0 } else { e.gpu + e.low > 0 }
                })
            };
            let g = seqs.iter().take_while(|&&s| has(s, true)).count() as u32;
            let a = seqs.iter().take_while(|&&s| has(s, false)).count() as u32;
            if a > 0 {
                exact.push((holder_id(h), g, a));
            }
        }
        if opts.early_exit == EarlyExit::OneHolderLeft {
            for i in 0..seqs.len() as u32 {
                let left: Vec<_> = exact.iter().filter(|x| x.2 > i).collect();
                if left.is_empty() {
                    break;
                }
                if left.len() == 1 {
                    let id = left[0].0;
                    for x in &mut exact {
                        if x.0 == id {
                            x.1 = x.1.min(i + 1);
                            x.2 = i + 1;
                        }
                    }
                    break;
                }
            }
        }
        exact.into_iter().collect()
    }
}

fn seq_of(parent: u64, content: u64) -> u64 {
    chain(SeqHash::from_bits(parent), BlockHash::from_bits(content)).to_bits()
}

// ---------------------------------------------------------------------------------------------
// The harness.

/// A deliberate bug in the system under test, to prove the harness catches it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    /// The first remove that would remove something is not forwarded to the ledger.
    DropOneRemove,
}

/// Where the real holders sit in the ledger's holder groups (32 holders per group).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    /// All in group 0 (the one-group fast path of the query).
    Packed,
    /// Spread over groups 0 and 1 by idle padding holders (the multi-group walk).
    Spread,
}

struct Harness {
    u: Universe,
    ledger: std::sync::Arc<Ledger>,
    writers: BTreeMap<usize, HolderWriter>,
    model: Model,
    fault: Fault,
    out: OverlapScores,
}

impl Harness {
    fn new(fault: Fault) -> Self {
        Self::with_layout(fault, Layout::Packed)
    }

    fn with_layout(fault: Fault, layout: Layout) -> Self {
        let ledger =
            Ledger::new(LedgerConfig { byte_budget: 1 << 40, capacity_slack_percent: SLACK_PERCENT });
        let mut h = Harness {
            u: Universe::new(),
            ledger,
            writers: BTreeMap::new(),
            model: Model::default(),
            fault,
            out: OverlapScores::default(),
        };
        for i in 0..HOLDERS.len() {
            if layout == Layout::Spread {
                // Idle, ready holders that never store: real holders land at slots 0, 12, 24, 36.
                for pad in 0..11 {
                    let id = HolderId::new(WorkerId(1000 + (i * 11 + pad) as u32), DpRank(0));
                    let cfg = HolderConfig { capacity_blocks: 4, content_deterministic: false };
                    let mut w = h.ledger.add_holder(id, cfg).expect("pad holder");
                    w.set_readiness(Readiness::Ready);
                    std::mem::forget(w);
                }
            }
            h.add(i);
        }
        h
    }

    fn add(&mut self, h: usize) {
        let cfg = HolderConfig { capacity_blocks: HOLDERS[h].3, content_deterministic: HOLDERS[h].2 };
        let w = self.ledger.add_holder(holder_id(h), cfg).expect("add holder");
        self.writers.insert(h, w);
        self.model.add(h);
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Prompt { h, spec, len } => {
                for from in (0..len).step_by(16) {
                    let len = (len - from).min(16);
                    self.step(&Op::Store { h, spec, from, len, lineage: true, tier: 0 })?;
                }
                return Ok(());
            }
            Op::RemoveWorker { h } => {
                let worker = holder_id(h).worker;
                self.ledger.remove_worker(worker);
                let gone: Vec<usize> =
                    self.model.holders.keys().copied().filter(|&i| holder_id(i).worker == worker).collect();
                for i in gone {
                    self.model.holders.remove(&i);
                    // The old writer is revoked: it must refuse, and write nothing.
                    let mut w = self.writers.remove(&i).expect("writer");
                    let refused = w.apply(&KvEvent::AllCleared);
                    if refused.is_ok() {
                        return Err(format!("revoked writer of {} still applies", holder_id(i)));
                    }
                }
            }
            Op::AddBack { h } => {
                if !self.model.holders.contains_key(&h) {
                    self.add(h);
                }
            }
            Op::Ready { h, r } => {
                if let Some(w) = self.writers.get_mut(&h) {
                    w.set_readiness(readiness(r));
                    self.model.holders.get_mut(&h).expect("holder").ready = readiness(r);
                }
            }
            _ => {
                let (h, ev) = event(&self.u, op).expect("an event");
                let Some(w) = self.writers.get_mut(&h) else { return Ok(()) };
                let drop_it = self.fault == Fault::DropOneRemove
                    && matches!(&ev, KvEvent::Removed(r) if r.blocks.iter().any(|e| {
                        self.model.holders[&h].entries.get(&e.to_u64()).is_some_and(|m| if r.medium.is_gpu() { m.gpu > 0 } else { m.low > 0 })
                    }));
                if drop_it {
                    self.fault = Fault::None;
                } else {
                    let before = w.applied();
                    w.apply(&ev).map_err(|e| e.to_string())?;
                    if w.applied() != before + 1 {
                        return Err("applied() did not advance by one event".into());
                    }
                }
                self.model.apply(h, &ev);
            }
        }
        self.compare()
    }

    fn compare(&mut self) -> Result<(), String> {
        // Every chain whole, and the long ones also cut inside a run (the prompt ends there).
        let prompts = self.u.seqs.iter().enumerate().flat_map(|(i, s)| {
            let cut = (s.len() > 20).then(|| (i, &s[..s.len() * 2 / 3]));
            std::iter::once((i, &s[..])).chain(cut)
        });
        let prompts: Vec<(usize, &[SeqHash])> = prompts.collect();
        for (i, seqs) in prompts {
            for holders in [HolderFilter::All, HolderFilter::Ready] {
                for early_exit in [EarlyExit::Never, EarlyExit::OneHolderLeft] {
                    let opts = QueryOptions { early_exit, holders };
                    self.ledger.query(seqs, opts, &mut self.out);
                    let got: BTreeSet<_> = self
                        .out
                        .iter()
                        .map(|o: &Overlap| (o.holder, o.gpu_blocks, o.any_tier_blocks))
                        .collect();
                    let want = self.model.query(seqs, opts);
                    if got != want {
                        return Err(format!(
                            "query of spec {i} with {opts:?}: ledger {got:?}, model {want:?}"
                        ));
                    }
                }
            }
        }
        let mut blocks = 0;
        for (&h, m) in &self.model.holders {
            let dump = self.ledger.dump(holder_id(h)).ok_or("registered holder has no dump")?;
            let got: Vec<(u64, String, u32, u32)> = dump
                .blocks
                .iter()
                .map(|b| {
                    let s = match b.state {
                        DumpState::Countable(s) => format!("C{:x}", s.to_bits()),
                        DumpState::Orphan { parent } => format!("O{:x}", parent.to_u64()),
                        DumpState::Uncountable => "U".into(),
                    };
                    (b.engine.to_u64(), s, b.gpu_refs, b.lower_refs)
                })
                .collect();
            let want: Vec<(u64, String, u32, u32)> = m
                .entries
                .iter()
                .map(|(&k, e)| {
                    let s = match e.state {
                        MState::Countable(s) => format!("C{s:x}"),
                        MState::Orphan { parent, .. } => format!("O{parent:x}"),
                        MState::Uncountable => "U".into(),
                    };
                    (k, s, e.gpu, e.low)
                })
                .collect();
            if got != want {
                return Err(format!("dump of {}: ledger {got:?}\nmodel {want:?}", holder_id(h)));
            }
            if dump.readiness != m.ready {
                return Err(format!("readiness of {}", holder_id(h)));
            }
            blocks += m.entries.len() as u64;
        }
        let stats = self.ledger.stats();
        if stats.blocks != blocks {
            return Err(format!("stats.blocks {} != model {blocks}", stats.blocks));
        }
        // Every content-deterministic orphan waits on other holders for (namespace, parent);
        // nothing else does (a stale wait would be a leak).
        let waits: BTreeSet<(usize, u64, u64)> = self
            .model
            .holders
            .iter()
            .filter(|(_, m)| m.det)
            .flat_map(|(&h, m)| {
                m.entries.values().filter_map(move |e| match e.state {
                    MState::Orphan { parent, ns, .. } => Some((h, ns, parent)),
                    _ => None,
                })
            })
            .collect();
        if stats.deterministic_waits != waits.len() {
            return Err(format!("{} deterministic waits, model {}", stats.deterministic_waits, waits.len()));
        }
        Ok(())
    }
}

fn run(ops: &[Op], fault: Fault) -> Result<(), String> {
    run_counting(ops, fault).0
}

fn run_spread(ops: &[Op]) -> Result<(), String> {
    let mut h = Harness::with_layout(Fault::None, Layout::Spread);
    for (i, op) in ops.iter().enumerate() {
        h.step(op).map_err(|e| format!("after op {i} {op:?}: {e}"))?;
    }
    Ok(())
}

/// Runs `ops`; also says whether the fault was injected.
fn run_counting(ops: &[Op], fault: Fault) -> (Result<(), String>, bool) {
    let mut h = Harness::new(fault);
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = h.step(op) {
            return (Err(format!("after op {i} {op:?}: {e}")), h.fault != fault);
        }
    }
    (Ok(()), h.fault != fault)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ledger_matches_the_reference(ops in prop::collection::vec(op_strategy(), 1..120)) {
        if let Err(e) = run(&ops, Fault::None) {
            return Err(TestCaseError::fail(e));
        }
    }

    #[test]
    fn ledger_matches_the_reference_across_holder_groups(ops in prop::collection::vec(op_strategy(), 1..120)) {
        if let Err(e) = run_spread(&ops) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// The harness catches a ledger that drops a remove: a fixed scenario, and random ones.
#[test]
fn harness_catches_a_dropped_remove() {
    let ops = [
        Op::Store { h: 0, spec: 0, from: 0, len: 3, lineage: true, tier: 0 },
        Op::Remove { h: 0, spec: 0, pos: 2, n: 1, tier: 0, garbage: false },
    ];
    assert!(run(&ops, Fault::None).is_ok());
    assert!(run(&ops, Fault::DropOneRemove).is_err(), "the harness missed a dropped remove");

    // Random runs: whenever the fault fired (a remove of a block the holder has was dropped),
    // the very next comparison must catch it.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op_strategy(), 20..80);
    let (mut fired, mut caught) = (0, 0);
    for _ in 0..64 {
        let ops = strategy.new_tree(&mut runner).expect("ops").current();
        let (result, injected) = run_counting(&ops, Fault::DropOneRemove);
        fired += u32::from(injected);
        caught += u32::from(injected && result.is_err());
    }
    assert!(fired > 10, "too few runs exercised the fault: {fired}");
    assert_eq!(caught, fired, "the harness missed {} dropped removes", fired - caught);
}

/// The random operations reach every rule: orphans and grafts, evictions, conflicts, unknown
/// removes, tiers and removed workers (otherwise the comparison above proves little).
#[test]
fn random_operations_cover_the_rules() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op_strategy(), 60..120);
    let mut total = cortex_radix::LedgerStats::default();
    let mut lower_tier = 0;
    // Holders with more than 16 leading blocks of a long chain: a run grew past a short store's
    // 16-block reservation, or filled and continued in the next (paths a 10-block chain never
    // reaches), and the query compared above walked it.
    let mut long_runs = 0;
    let long: Vec<SeqHash> = Universe::new().seqs[5].clone();
    for _ in 0..48 {
        let ops = strategy.new_tree(&mut runner).expect("ops").current();
        let mut h = Harness::new(Fault::None);
        for op in &ops {
            h.step(op).expect("ledger matches the model");
            lower_tier +=
                h.model.holders.values().flat_map(|m| m.entries.values()).filter(|e| e.low > 0).count();
            let opts = QueryOptions { early_exit: EarlyExit::Never, holders: HolderFilter::All };
            long_runs +=
                h.model.query(&long, opts).iter().filter(|(_, gpu, any)| (*gpu).max(*any) > 16).count();
        }
        let s = h.ledger.stats();
        total.grafts += s.grafts;
        total.evictions_capacity += s.evictions_capacity;
        total.conflicts += s.conflicts;
        total.unknown_removes += s.unknown_removes;
        total.refused_applies += s.refused_applies;
        total.orphans += s.orphans;
    }
    assert!(total.grafts > 0 && total.evictions_capacity > 0 && total.conflicts > 0, "{total:?}");
    assert!(total.unknown_removes > 0 && total.refused_applies > 0 && total.orphans > 0, "{total:?}");
    assert!(lower_tier > 0);
    assert!(long_runs > 0, "no holder ever had more than 16 leading blocks of a long chain");
}

/// Orphan rules, spelled out: an orphan never counts, is grafted by a late parent in its own
/// holder, and — between content-deterministic holders of one namespace — by another holder's
/// block.
#[test]
fn orphans_graft_late_and_across_deterministic_holders() {
    let u = Universe::new();
    let mut h = Harness::new(Fault::None);
    for i in 0..HOLDERS.len() {
        h.writers.get_mut(&i).unwrap().set_readiness(Readiness::Ready);
        h.model.holders.get_mut(&i).unwrap().ready = Readiness::Ready;
    }
    let q = |h: &mut Harness, holder: usize| {
        h.ledger.query(&u.seqs[0], QueryOptions::default(), &mut h.out);
        h.out.get(holder_id(holder)).map_or(0, |o| o.any_tier_blocks)
    };
    // Tail first (holder 0, not deterministic): orphans, nothing counted.
    h.step(&Op::Store { h: 0, spec: 0, from: 2, len: 3, lineage: true, tier: 0 }).unwrap();
    assert_eq!(q(&mut h, 0), 0);
    assert_eq!(h.ledger.stats().orphans, 3);
    // The late head grafts the whole chain.
    h.step(&Op::Store { h: 0, spec: 0, from: 0, len: 2, lineage: true, tier: 0 }).unwrap();
    assert_eq!(q(&mut h, 0), 5);
    assert_eq!(h.ledger.stats().orphans, 0);
    // Holder 1 (deterministic) gets a tail whose parent only holder 2 (deterministic) will have.
    h.step(&Op::Store { h: 1, spec: 0, from: 3, len: 2, lineage: true, tier: 0 }).unwrap();
    assert_eq!(q(&mut h, 1), 0);
    h.step(&Op::Store { h: 2, spec: 0, from: 0, len: 3, lineage: true, tier: 0 }).unwrap();
    // Grafted, but holder 1 still lacks blocks 0..3, so its prefix is empty...
    assert_eq!(q(&mut h, 1), 0);
    let dump = h.ledger.dump(holder_id(1)).unwrap();
    assert!(dump.blocks.iter().all(|b| matches!(b.state, DumpState::Countable(_))), "{dump:?}");
    // ...until it gets them.
    h.step(&Op::Store { h: 1, spec: 0, from: 0, len: 3, lineage: true, tier: 0 }).unwrap();
    assert_eq!(q(&mut h, 1), 5);
    // A non-deterministic holder is never grafted from another holder.
    h.step(&Op::Store { h: 3, spec: 0, from: 3, len: 2, lineage: true, tier: 0 }).unwrap();
    assert_eq!(h.ledger.dump(holder_id(3)).unwrap().orphans, 2);
}
