//! Bytes per (holder, block) of a branchy workload: shared prefixes, each request a short suffix
//! of its own and a few decode blocks stored one at a time (the gateway soak's shape).
//!
//! `cargo run --release -p cortex-radix --example branches -- [--requests N] [--prefix B] [--suffix B] [--decode B] [--budget-kib K]`
//! (`pairs` counts the stores; with a binding budget, `blocks held` is what is left)

#![allow(clippy::print_stdout, missing_docs)]

#[path = "../benches/workload.rs"]
mod workload;

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};
use cortex_radix::{HolderConfig, Ledger, LedgerConfig, Readiness};
use workload::{CountingAlloc, live_bytes, splitmix};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, d: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(d)
    };
    let (requests, prefix, suffix, decode) =
        (arg("--requests", 20_000), arg("--prefix", 7), arg("--suffix", 2), arg("--decode", 1));
    let budget = arg("--budget-kib", 1 << 24) as usize * 1024;
    let holders = 4u32;
    let before = live_bytes();
    let ledger = Ledger::new(LedgerConfig { byte_budget: budget, capacity_slack_percent: 25 });
    let ns = Namespace::new(Engine::Vllm, 16, "branches", None);
    let lineage = Lineage::new(ns, None);
    let mut writers: Vec<_> = (0..holders)
        .map(|h| {
            let cfg = HolderConfig { capacity_blocks: 1 << 24, content_deterministic: h % 2 == 0 };
            let mut w = ledger.add_holder(HolderId::new(WorkerId(h), DpRank(0)), cfg).expect("holder");
            w.set_readiness(Readiness::Ready);
            w
        })
        .collect();
    let mut held = vec![std::collections::HashSet::new(); holders as usize];
    let mut pairs = 0u64;
    let mut max_live = 0usize;
    for i in 0..requests {
        let h = (splitmix(i ^ 77) % u64::from(holders)) as usize;
        let p = splitmix(i ^ 5) % 64 + (i / 20);
        let mut contents: Vec<u64> = (0..prefix).map(|j| splitmix(p * 1000 + j)).collect();
        contents.extend((0..suffix + decode).map(|j| splitmix((i << 20) ^ (j + 1) ^ 0xABCDEF)));
        let mut seq = lineage.root;
        let seqs: Vec<SeqHash> = contents
            .iter()
            .map(|&b| {
                seq = chain(seq, BlockHash::from_bits(b));
                seq
            })
            .collect();
        let first_new = seqs.iter().position(|s| !held[h].contains(&s.to_bits())).unwrap_or(seqs.len());
        let prompt_end = (prefix + suffix) as usize;
        let mut start = first_new;
        while start < seqs.len() {
            let end = if start < prompt_end { prompt_end } else { start + 1 };
            let parent = (start > 0).then(|| EngineHash::from_u64(seqs[start - 1].to_bits()));
            let blocks = (start..end)
                .map(|k| {
                    held[h].insert(seqs[k].to_bits());
                    pairs += 1;
                    StoredBlock {
                        engine: EngineHash::from_u64(seqs[k].to_bits()),
                        content: BlockHash::from_bits(contents[k]),
                    }
                })
                .collect();
            writers[h]
                .apply(&KvEvent::Stored(BlockStored {
                    parent,
                    blocks,
                    lineage: Some(lineage),
                    medium: Medium::Gpu,
                }))
                .expect("apply");
            start = end;
        }
        if i % 64 == 0 {
            max_live = max_live.max(ledger.stats().live_bytes);
        }
    }
    let stats = ledger.stats();
    let heap = live_bytes() - before;
    println!(
        "requests {requests} prefix {prefix} suffix {suffix} decode {decode}: (holder, block) pairs {pairs}, live_bytes {} = {:.1} B/pair, allocator {:.1} B/pair",
        stats.live_bytes,
        stats.live_bytes as f64 / pairs as f64,
        heap as f64 / pairs as f64
    );
    println!("budget {budget} B, max live bytes sampled {max_live} B, blocks held {}", stats.blocks);
    println!("{stats:?}");
}
