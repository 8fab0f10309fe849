//! Quarantining a holder whose writer panicked: queries stop counting it, its writer is refused,
//! the same id can be registered again and rebuilt, and the other holders — including those
//! sharing its runs — are untouched.

#![allow(clippy::unwrap_used)] // test setup: a failed step should panic

use cortex_hash::kv::{
    BlockRemoved, BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};
use cortex_radix::{
    HolderConfig, HolderWriter, Ledger, LedgerConfig, LedgerError, OverlapScores, QueryOptions, Readiness,
};

const BLOCKS: u64 = 20;

fn holder(w: u32) -> HolderId {
    HolderId::new(WorkerId(w), DpRank(0))
}

fn lineage() -> Lineage {
    Lineage::new(Namespace::new(Engine::Sglang, 16, "m", None), None)
}

fn add(ledger: &Ledger, h: HolderId) -> HolderWriter {
    let mut w =
        ledger.add_holder(h, HolderConfig { capacity_blocks: 1000, content_deterministic: true }).unwrap();
    w.set_readiness(Readiness::Ready);
    w
}

/// Stores the test chain: engine hashes 1..=BLOCKS, contents 100.. .
fn store(w: &mut HolderWriter) {
    let blocks = (1..=BLOCKS)
        .map(|i| StoredBlock { engine: EngineHash::from_u64(i), content: BlockHash::from_bits(100 + i) })
        .collect();
    w.apply(&KvEvent::Stored(BlockStored {
        parent: None,
        blocks,
        lineage: Some(lineage()),
        medium: Medium::Gpu,
    }))
    .unwrap();
}

fn seq() -> Vec<SeqHash> {
    let mut at = lineage().root;
    (1..=BLOCKS)
        .map(|i| {
            at = chain(at, BlockHash::from_bits(100 + i));
            at
        })
        .collect()
}

fn overlap(ledger: &Ledger) -> Vec<(HolderId, u32)> {
    let mut out = OverlapScores::default();
    ledger.query(&seq(), QueryOptions::default(), &mut out);
    let mut v: Vec<_> = out.iter().map(|o| (o.holder, o.gpu_blocks)).collect();
    v.sort();
    v
}

#[test]
fn a_quarantined_holder_leaves_at_once_and_its_id_can_be_rebuilt() {
    let ledger = Ledger::new(LedgerConfig::default());
    let (a, b) = (holder(1), holder(2));
    let mut wa = add(&ledger, a);
    let mut wb = add(&ledger, b);
    store(&mut wa);
    store(&mut wb);
    assert_eq!(overlap(&ledger), vec![(a, 20), (b, 20)]);
    let before = ledger.stats();

    assert_eq!(ledger.quarantine(a), Some(0));
    assert_eq!(ledger.quarantine(a), None, "a holder is quarantined once");
    assert_eq!(overlap(&ledger), vec![(b, 20)], "queries stop counting it at once");
    assert!(matches!(wa.apply(&KvEvent::AllCleared), Err(LedgerError::Revoked(h)) if h == a));
    assert_eq!(ledger.readiness(a), None);
    let s = ledger.stats();
    assert_eq!(s.quarantined_holders, 1);
    assert_eq!(s.holders, 1);
    // Leaked, not freed: its blocks stay counted.
    assert_eq!(s.blocks, before.blocks);

    // The same id again: a fresh holder, rebuilt from its engine's events.
    let mut wa2 = add(&ledger, a);
    assert_eq!(overlap(&ledger), vec![(b, 20)], "the new incarnation starts empty");
    store(&mut wa2);
    assert_eq!(overlap(&ledger), vec![(a, 20), (b, 20)]);

    // The other holder, which shares the runs, removes its blocks and clears: the runs the
    // quarantined state still references stay alive, and the rebuilt holder is unaffected.
    wb.apply(&KvEvent::Removed(BlockRemoved {
        blocks: (11..=BLOCKS).map(EngineHash::from_u64).collect(),
        medium: Medium::Gpu,
    }))
    .unwrap();
    assert_eq!(overlap(&ledger), vec![(a, 20), (b, 10)]);
    wb.clear();
    wa2.clear();
    assert_eq!(overlap(&ledger), vec![]);
    // The runs the quarantined state references stay alive (leaked, never freed).
    let s = ledger.stats();
    assert!(s.nodes > 0 && s.run_blocks == BLOCKS, "{s:?}");
    store(&mut wb);
    assert_eq!(overlap(&ledger), vec![(b, 20)]);
    ledger.remove_worker(WorkerId(1));
    ledger.remove_worker(WorkerId(2));
    assert_eq!(overlap(&ledger), vec![]);
    assert_eq!(ledger.stats().holders, 0);
}
