//! Looking up one block of a holder by the engine's hash (what the gateway's alignment check
//! uses to compare predicted and published engine hashes).

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, chain};
use cortex_radix::{DumpState, HolderConfig, Ledger, LedgerConfig};

#[test]
fn block_by_engine_hash() {
    let ledger = Ledger::new(LedgerConfig::default());
    let holder = HolderId::new(WorkerId(1), DpRank(0));
    let mut w = ledger
        .add_holder(holder, HolderConfig { capacity_blocks: 100, content_deterministic: true })
        .unwrap();
    let l = Lineage::new(Namespace::new(Engine::Sglang, 16, "m", None), None);
    let (c0, c1) = (BlockHash::from_bits(7), BlockHash::from_bits(8));
    let blocks = vec![
        StoredBlock { engine: EngineHash::from_i64(-5), content: c0 },
        StoredBlock { engine: EngineHash::from_i64(6), content: c1 },
    ];
    w.apply(&KvEvent::Stored(BlockStored { parent: None, blocks, lineage: Some(l), medium: Medium::Gpu }))
        .unwrap();
    // A child whose parent is unknown waits as an orphan.
    let orphan = vec![StoredBlock { engine: EngineHash::from_u64(99), content: c0 }];
    w.apply(&KvEvent::Stored(BlockStored {
        parent: Some(EngineHash::from_u64(42)),
        blocks: orphan,
        lineage: Some(l),
        medium: Medium::Gpu,
    }))
    .unwrap();
    let first = ledger.block(holder, EngineHash::from_i64(-5)).unwrap();
    assert_eq!(first.state, DumpState::Countable(chain(l.root, c0)));
    assert_eq!(first.gpu_refs, 1);
    let second = ledger.block(holder, EngineHash::from_i64(6)).unwrap();
    assert_eq!(second.state, DumpState::Countable(chain(chain(l.root, c0), c1)));
    assert_eq!(
        ledger.block(holder, EngineHash::from_u64(99)).unwrap().state,
        DumpState::Orphan { parent: EngineHash::from_u64(42) }
    );
    assert!(ledger.block(holder, EngineHash::from_u64(12345)).is_none());
    assert!(ledger.block(HolderId::new(WorkerId(2), DpRank(0)), EngineHash::from_i64(-5)).is_none());
}
