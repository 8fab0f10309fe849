//! A query allocates nothing once its lent `OverlapScores` has room for the holders, in the
//! one-group path and across holder groups, with GPU and lower-tier runs of different lengths.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{Engine, Namespace, SeqHash};
use cortex_radix::{
    EarlyExit, HolderConfig, HolderFilter, Ledger, LedgerConfig, OverlapScores, QueryOptions,
};

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// Counts this thread's allocations (other test threads do not disturb the count).
struct CountingAlloc;

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn queries_allocate_nothing() {
    let ns = Namespace::new(Engine::Vllm, 4, "m", None);
    let tokens: Vec<u32> = (0..4 * 40).collect();
    let seqs: Vec<SeqHash> = ns.seq_hashes(None, &tokens);
    for holders in [8u32, 70] {
        let ledger = Ledger::new(LedgerConfig::default());
        for h in 0..holders {
            let cfg = HolderConfig { capacity_blocks: 1000, content_deterministic: false };
            let mut w = ledger.add_holder(HolderId::new(WorkerId(h), DpRank(0)), cfg).expect("add");
            // Holder h has the first h % 40 blocks on GPU and 5 more on CPU.
            let n = (h % 40) as usize;
            let blocks = |from: usize, to: usize| -> Vec<StoredBlock> {
                (from..to.min(40))
                    .map(|i| StoredBlock {
                        engine: EngineHash::from_u64(seqs[i].to_bits()),
                        content: ns.block_hash(&tokens[i * 4..i * 4 + 4]),
                    })
                    .collect()
            };
            let lineage = Some(Lineage::new(ns, None));
            w.apply(&KvEvent::Stored(BlockStored {
                parent: None,
                blocks: blocks(0, n),
                lineage,
                medium: Medium::Gpu,
            }))
            .expect("store");
            if n > 0 && n < 40 {
                let parent = Some(EngineHash::from_u64(seqs[n - 1].to_bits()));
                let ev = BlockStored { parent, blocks: blocks(n, n + 5), lineage, medium: Medium::Cpu };
                w.apply(&KvEvent::Stored(ev)).expect("store");
            }
        }
        let mut out = OverlapScores::with_capacity(holders as usize);
        let all = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
        let early = QueryOptions { early_exit: EarlyExit::OneHolderLeft, holders: HolderFilter::All };
        ledger.query(&seqs, all, &mut out); // warm up the thread's epoch registration
        let before = ALLOCS.with(Cell::get);
        for opts in [all, early, QueryOptions::default()] {
            for len in [1, 7, 40] {
                ledger.query(&seqs[..len], opts, &mut out);
            }
        }
        assert_eq!(ALLOCS.with(Cell::get), before, "a query allocated ({holders} holders)");
        ledger.query(&seqs, all, &mut out);
        assert_eq!(
            out.len(),
            holders as usize - holders.div_ceil(40) as usize,
            "every holder with a block matched"
        );
        let h = out.get(HolderId::new(WorkerId(holders - 3), DpRank(0))).expect("a holder");
        let n = (holders - 3) % 40;
        assert_eq!((h.gpu_blocks, h.any_tier_blocks), (n, n + 5));
    }
}
