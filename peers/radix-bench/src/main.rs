//! Peer comparison: Cortex's ledger against `dynamo-kv-router` 1.6.1 on the ledger workload of
//! `docs/perf.md` (the very generator the criterion bench uses), interleaving the two
//! several times because the machine is noisy, and printing each ratio with its spread:
//! - query latency p50/p99 (80-block queries, no early exit) vs `ConcurrentRadixTreeCompressed`
//!   (Dynamo's fastest for reads, behind its `ThreadPoolIndexer` with 2 event threads, queried
//!   inline on the caller's thread as in production);
//! - apply throughput (block-stores/s on one core) vs `RadixTree` (its fastest for writes);
//! - live heap bytes per (holder, block) vs `RadixTree` (its leanest), by a counting allocator.
//!
//! Run by `cargo xtask bench-peers [--rounds N] [--configs 8x10000,...]`.

#![allow(clippy::print_stdout)]

#[path = "../../../crates/cortex-radix/benches/workload.rs"]
mod workload;

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use cortex_hash::kv::{DpRank, HolderId, KvEvent, WorkerId};
use cortex_radix::{
    HolderConfig, HolderWriter, Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness,
};
use dynamo_kv_router::indexer::{RadixTree, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, indexer::SyncIndexer};
use workload::{CountingAlloc, Workload, latencies, live_bytes, percentile};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn dynamo_events(w: &Workload) -> Vec<RouterEvent> {
    w.stores
        .iter()
        .enumerate()
        .map(|(i, s)| {
            RouterEvent::new(
                u64::from(s.holder),
                KvCacheEvent {
                    event_id: i as u64,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: s.parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: s
                            .blocks
                            .iter()
                            .map(|&(e, c)| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(e),
                                tokens_hash: LocalBlockHash(c),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                    dp_rank: 0,
                },
            )
        })
        .collect()
}

fn cortex_build(w: &Workload, events: &[KvEvent]) -> (Arc<Ledger>, Vec<HolderWriter>) {
    let ledger = Ledger::new(LedgerConfig { byte_budget: 64 << 30, capacity_slack_percent: 25 });
    let cfg = HolderConfig { capacity_blocks: w.blocks_per_holder as u32, content_deterministic: false };
    let mut writers: Vec<HolderWriter> = (0..w.holders)
        .map(|i| ledger.add_holder(HolderId::new(WorkerId(i), DpRank(0)), cfg).expect("add holder"))
        .collect();
    for wr in &mut writers {
        wr.set_readiness(Readiness::Ready);
    }
    for (s, ev) in w.stores.iter().zip(events) {
        writers[s.holder as usize].apply(ev).expect("apply");
    }
    (ledger, writers)
}


#[derive(Default)]
struct Round {
    cortex_p50: f64,
    cortex_p99: f64,
    crtc_p50: f64,
    crtc_p99: f64,
    cortex_mops: f64,
    radix_mops: f64,
    cortex_bytes: f64,
    radix_bytes: f64,
}

fn round(w: &Workload, events: &[KvEvent], rt: &tokio::runtime::Runtime, cortex_first: bool) -> Round {
    let mut r = Round::default();
    let queries_local: Vec<Vec<LocalBlockHash>> =
        w.queries.iter().map(|q| q.content.iter().map(|&c| LocalBlockHash(c)).collect()).collect();

    // Apply throughput on one core and live bytes, then query latency; which peer goes first
    // alternates between rounds, and the CRTC's event threads are gone before anything else runs.
    let cortex_apply = |r: &mut Round| {
        let before = live_bytes();
        let t = Instant::now();
        let built = cortex_build(w, events);
        let secs = t.elapsed().as_secs_f64();
        r.cortex_bytes = (live_bytes() - before) as f64 / w.pairs as f64;
        r.cortex_mops = w.pairs as f64 / secs / 1e6;
        drop(built);
    };
    let dynamo_apply = |r: &mut Round| {
        {
            let before = live_bytes();
            let evs = dynamo_events(w);
            let mut tree = RadixTree::new();
            let t = Instant::now();
            for ev in evs {
                tree.apply_event(ev).expect("apply");
            }
            let secs = t.elapsed().as_secs_f64();
            // The events were moved into the tree and freed: what is left is the tree.
            r.radix_bytes = (live_bytes() - before) as f64 / w.pairs as f64;
            r.radix_mops = w.pairs as f64 / secs / 1e6;
            drop(tree);
        }
    };
    let cortex_query = |r: &mut Round| {
        let (ledger, _writers) = cortex_build(w, events);
        let mut out = OverlapScores::with_capacity(w.holders as usize);
        for q in w.queries.iter().take(2000) {
            ledger.query(&q.seqs, QueryOptions::default(), &mut out);
        }
        let l = latencies(
            w.queries.len(),
            |i| {
                black_box(w.queries[i].seqs.iter().fold(0u64, |a, s| a ^ s.to_bits()));
            },
            |i| ledger.query(black_box(&w.queries[i].seqs), QueryOptions::default(), &mut out),
        );
        r.cortex_p50 = percentile(&l, 50.0);
        r.cortex_p99 = percentile(&l, 99.0);
    };
    let dynamo_query = |r: &mut Round| {
        let crtc = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 2, 16);
        for ev in dynamo_events(w) {
            crtc.enqueue_event(ev).expect("enqueue");
        }
        rt.block_on(crtc.flush_and_wait()).expect("flush");
        let backend = crtc.backend();
        for q in queries_local.iter().take(2000) {
            black_box(backend.find_matches(q, false));
        }
        let l = latencies(
            queries_local.len(),
            |i| {
                black_box(queries_local[i].iter().fold(0u64, |a, s| a ^ s.0));
            },
            |i| {
                black_box(backend.find_matches(black_box(&queries_local[i]), false));
            },
        );
        r.crtc_p50 = percentile(&l, 50.0);
        r.crtc_p99 = percentile(&l, 99.0);
    };
    if cortex_first {
        cortex_apply(&mut r);
        dynamo_apply(&mut r);
        cortex_query(&mut r);
        dynamo_query(&mut r);
    } else {
        dynamo_apply(&mut r);
        cortex_apply(&mut r);
        dynamo_query(&mut r);
        cortex_query(&mut r);
    }
    r
}

/// Median and (min, max) of `v`.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(&v, 50.0), v[0], v[v.len() - 1])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let rounds: usize = arg("--rounds").and_then(|s| s.parse().ok()).unwrap_or(5);
    let configs: Vec<(u32, usize)> = arg("--configs")
        .unwrap_or_else(|| "8x10000,64x10000,8x100000,64x100000".to_owned())
        .split(',')
        .filter_map(|c| {
            let (a, b) = c.split_once('x')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    println!("peer comparison: Cortex vs dynamo-kv-router 1.6.1, {rounds} interleaved rounds per config");
    println!(
        "ratios are Dynamo / Cortex for time and bytes (>1: Cortex better), Cortex / Dynamo for throughput"
    );
    println!(
        "| config | query p50 ns Cortex / CRTC | ratio (min–max) | query p99 ns Cortex / CRTC | ratio (min–max) | apply M/s Cortex / RadixTree | ratio (min–max) | B/(holder,block) Cortex / RadixTree | ratio (min–max) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (h, b) in configs {
        let w = Workload::new(h, b, 20_000, 7);
        let events: Vec<KvEvent> = w.stores.iter().map(|s| w.event(s)).collect();
        let rs: Vec<Round> = (0..rounds).map(|i| round(&w, &events, &rt, i % 2 == 0)).collect();
        let col = |f: &dyn Fn(&Round) -> f64| spread(rs.iter().map(f).collect());
        let (c50, _, _) = col(&|r| r.cortex_p50);
        let (d50, _, _) = col(&|r| r.crtc_p50);
        let q50 = col(&|r| r.crtc_p50 / r.cortex_p50);
        let (c99, _, _) = col(&|r| r.cortex_p99);
        let (d99, _, _) = col(&|r| r.crtc_p99);
        let q99 = col(&|r| r.crtc_p99 / r.cortex_p99);
        let (cm, _, _) = col(&|r| r.cortex_mops);
        let (dm, _, _) = col(&|r| r.radix_mops);
        let qm = col(&|r| r.cortex_mops / r.radix_mops);
        let (cb, _, _) = col(&|r| r.cortex_bytes);
        let (db, _, _) = col(&|r| r.radix_bytes);
        let qb = col(&|r| r.radix_bytes / r.cortex_bytes);
        println!(
            "| W={h} x {b} | {c50:.0} / {d50:.0} | {:.2}× ({:.2}–{:.2}) | {c99:.0} / {d99:.0} | {:.2}× ({:.2}–{:.2}) | {cm:.2} / {dm:.2} | {:.2}× ({:.2}–{:.2}) | {cb:.1} / {db:.1} | {:.2}× ({:.2}–{:.2}) |",
            q50.0, q50.1, q50.2, q99.0, q99.1, q99.2, qm.0, qm.1, qm.2, qb.0, qb.1, qb.2
        );
    }
}
