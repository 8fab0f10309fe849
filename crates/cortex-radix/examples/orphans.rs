//! Apply speed while a holder keeps orphans waiting (blocks whose parent it never saw, as after a
//! clear): 10,000 batches of 16 chained blocks, first with no orphan held, then with 20,000.
//!
//! `cargo run --release -p cortex-radix --example orphans`

#![allow(clippy::unwrap_used, clippy::print_stdout)]
use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, EventBatch, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace};
use cortex_radix::{HolderConfig, Ledger, LedgerConfig};
use std::time::Instant;

fn batch(lineage: Lineage, parent: Option<u64>, first: u64, n: u64) -> EventBatch {
    EventBatch {
        ts: 0.0,
        dp_rank: None,
        events: vec![KvEvent::Stored(BlockStored {
            parent: parent.map(EngineHash::from_u64),
            blocks: (first..first + n)
                .map(|e| StoredBlock {
                    engine: EngineHash::from_u64(e),
                    content: BlockHash::from_bits(e.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                })
                .collect(),
            lineage: Some(lineage),
            medium: Medium::Gpu,
        })],
    }
}

fn main() {
    for orphans in [0u64, 20_000] {
        let ledger = Ledger::new(LedgerConfig::default());
        let lineage = Lineage::new(Namespace::new(Engine::Vllm, 16, "m", None), None);
        let mut w = ledger
            .add_holder(
                HolderId::new(WorkerId(1), DpRank(0)),
                HolderConfig { capacity_blocks: 400_000, content_deterministic: false },
            )
            .unwrap();
        // Orphans: single blocks whose parents are unknown (as after a clear).
        for i in 0..orphans {
            w.apply_batch(&batch(lineage, Some(10_000_000 + i), 20_000_000 + i, 1)).unwrap();
        }
        let t = Instant::now();
        let mut next = 1u64;
        for _ in 0..10_000u64 {
            w.apply_batch(&batch(lineage, if next == 1 { None } else { Some(next - 1) }, next, 16)).unwrap();
            next += 16;
        }
        println!("orphans {orphans}: {:.2} M block-stores/s", 160_000.0 / t.elapsed().as_secs_f64() / 1e6);
    }
}
