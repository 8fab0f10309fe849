//! The byte budget: converted to blocks and shared among holders by capacity, the least
//! recently stored blocks going first; and the ledger's measured bytes stay within it.

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, chain};
use cortex_radix::{
    BUDGET_BYTES_PER_BLOCK, HolderConfig, HolderFilter, Ledger, LedgerConfig, OverlapScores, QueryOptions,
};

#[test]
fn budget_shares_blocks_by_capacity_and_evicts_the_oldest() {
    let budget_blocks = 3_000;
    let ledger = Ledger::new(LedgerConfig {
        byte_budget: budget_blocks * BUDGET_BYTES_PER_BLOCK,
        capacity_slack_percent: 25,
    });
    let l = Lineage::new(Namespace::new(Engine::Vllm, 16, "m", None), None);
    // Capacities 1:2, both far above their budget shares (1000 and 2000 blocks).
    let mut writers: Vec<_> = [10_000u32, 20_000]
        .iter()
        .enumerate()
        .map(|(i, &cap)| {
            let cfg = HolderConfig { capacity_blocks: cap, content_deterministic: false };
            ledger.add_holder(HolderId::new(WorkerId(i as u32), DpRank(0)), cfg).expect("add")
        })
        .collect();
    // Each holder stores 500 single-block chains of 8 blocks (4000 blocks), oldest first.
    let chain_seqs = |h: u64, c: u64| {
        let mut seq = l.root;
        (0..8u64)
            .map(|i| {
                let content = BlockHash::from_bits((h << 40) ^ (c << 8) ^ i);
                seq = chain(seq, content);
                (content, seq)
            })
            .collect::<Vec<_>>()
    };
    for c in 0..500u64 {
        for (h, w) in writers.iter_mut().enumerate() {
            let blocks = chain_seqs(h as u64, c)
                .into_iter()
                .map(|(content, seq)| StoredBlock { engine: EngineHash::from_u64(seq.to_bits()), content })
                .collect();
            w.apply(&KvEvent::Stored(BlockStored {
                parent: None,
                blocks,
                lineage: Some(l),
                medium: Medium::Gpu,
            }))
            .expect("store");
        }
    }
    let stats = ledger.stats();
    assert!(stats.evictions_budget > 0 && stats.evictions_capacity == 0, "{stats:?}");
    let blocks = |h: u32| ledger.dump(HolderId::new(WorkerId(h), DpRank(0))).expect("dump").blocks.len();
    // Each chain is a run of its own: 8 blocks in three cache lines (192 B) and one holder record
    // (103 B at worst), charged with the blocks: the budget allows 3000 × 96 / (96 + 295 / 8) =
    // 2181 blocks.
    let allowed = budget_blocks * BUDGET_BYTES_PER_BLOCK / (BUDGET_BYTES_PER_BLOCK + 295 / 8);
    // Over its share, a holder goes down to the share less the 25 % slack (then refills).
    let (b0, b1) = (blocks(0), blocks(1));
    assert!((allowed / 3 * 100 / 125..=allowed / 3).contains(&b0), "{b0} of {allowed}");
    assert!((allowed * 2 / 3 * 100 / 125..=allowed * 2 / 3).contains(&b1), "{b1} of {allowed}");
    assert!(stats.live_bytes <= budget_blocks * BUDGET_BYTES_PER_BLOCK, "{stats:?}");
    // The newest chains survive whole, the oldest are gone.
    let mut out = OverlapScores::default();
    let opts = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
    let seqs = |h, c| chain_seqs(h, c).into_iter().map(|(_, s)| s).collect::<Vec<_>>();
    ledger.query(&seqs(0, 499), opts, &mut out);
    assert_eq!(out.get(HolderId::new(WorkerId(0), DpRank(0))).map(|o| o.gpu_blocks), Some(8));
    ledger.query(&seqs(1, 0), opts, &mut out);
    assert!(out.is_empty());
}

/// The gateway soak's shape: shared prefixes, and every request stores a short suffix of its own
/// — a run of one or two blocks per request, which costs more per block than long chains do. The
/// budget holds there too (the runs and their records are charged as they are), sampled
/// throughout, and still keeps thousands of blocks.
#[test]
fn the_budget_holds_when_every_request_stores_a_short_suffix_of_its_own() {
    let budget = 1 << 20;
    let ledger = Ledger::new(LedgerConfig { byte_budget: budget, capacity_slack_percent: 25 });
    let l = Lineage::new(Namespace::new(Engine::Vllm, 16, "m", None), None);
    let mut writers: Vec<_> = (0..4u32)
        .map(|h| {
            let cfg = HolderConfig { capacity_blocks: 1 << 20, content_deterministic: h % 2 == 0 };
            ledger.add_holder(HolderId::new(WorkerId(h), DpRank(0)), cfg).expect("add")
        })
        .collect();
    let mut held = vec![std::collections::HashSet::new(); writers.len()];
    let mut max_live = 0;
    for i in 0..24_000u64 {
        let h = (i * 7 % 4) as usize;
        // Seven blocks of one of 64 prefixes (one retired every 20 requests), two of its own.
        let prefix = i.wrapping_mul(0x9E37_79B9) % 64 + i / 20;
        let mut seq = l.root;
        let blocks: Vec<_> = (0..9u64)
            .map(|j| {
                let content =
                    BlockHash::from_bits(if j < 7 { (prefix << 8) | j } else { (1 << 62) | (i << 8) | j });
                seq = chain(seq, content);
                StoredBlock { engine: EngineHash::from_u64(seq.to_bits()), content }
            })
            .collect();
        // Like an engine with prefix caching, only what the holder lacks is stored.
        let first_new = blocks.iter().position(|b| !held[h].contains(&b.engine)).unwrap_or(9);
        let parent = first_new.checked_sub(1).map(|k| blocks[k].engine);
        held[h].extend(blocks[first_new..].iter().map(|b| b.engine));
        writers[h]
            .apply(&KvEvent::Stored(BlockStored {
                parent,
                blocks: blocks[first_new..].to_vec(),
                lineage: Some(l),
                medium: Medium::Gpu,
            }))
            .expect("store");
        if i % 50 == 0 {
            max_live = max_live.max(ledger.stats().live_bytes);
        }
    }
    let stats = ledger.stats();
    assert!(stats.evictions_budget > 0, "{stats:?}");
    assert!(max_live.max(stats.live_bytes) <= budget, "{max_live} > {budget}: {stats:?}");
    assert!(stats.blocks >= 4_000, "{stats:?}");
}
