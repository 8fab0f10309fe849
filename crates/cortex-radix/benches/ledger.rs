//! Ledger benchmarks on the ledger workload of `benches/workload.rs` (W = 8 and 64 holders, 10k
//! and 100k blocks each), against a naive baseline in the same run: query latency p50/p99,
//! apply throughput (block-stores/s on one core) and live bytes per (holder, block), measured
//! with a counting allocator. The report table comes first; criterion then times the query and
//! the apply of the smallest configuration.
//!
//! `cargo bench -p cortex-radix --bench ledger` (set `CORTEX_BENCH_CONFIGS=8x10000,64x10000` to
//! choose configurations; `CORTEX_BENCH_REPORT_ONLY=1` to skip criterion).

#![allow(clippy::print_stdout, missing_docs)]

#[path = "workload.rs"]
mod workload;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use cortex_hash::SeqHash;
use cortex_hash::kv::{DpRank, HolderId, KvEvent, WorkerId};
use cortex_radix::{
    EarlyExit, HolderConfig, HolderFilter, HolderWriter, Ledger, LedgerConfig, OverlapScores, QueryOptions,
    Readiness,
};
use criterion::Criterion;
use workload::{CountingAlloc, Workload, latencies, live_bytes, percentile};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The naive baseline: one `HashMap<SeqHash, Vec<holder>>` plus per-holder
/// `HashMap<engine, (seq, refs)>`, single-threaded, no tiers, no orphans.
#[derive(Default)]
struct Naive {
    index: HashMap<u64, Vec<u32>>,
    holders: Vec<HashMap<u64, (u64, u32)>>,
}

impl Naive {
    fn apply(&mut self, holder: u32, ev: &KvEvent) {
        let KvEvent::Stored(s) = ev else { return };
        if self.holders.len() <= holder as usize {
            self.holders.resize_with(holder as usize + 1, HashMap::new);
        }
        let Some(l) = s.lineage else { return };
        let map = &mut self.holders[holder as usize];
        let mut parent = match s.parent {
            None => l.root,
            Some(p) => match map.get(&p.to_u64()) {
                Some(&(seq, _)) => SeqHash::from_bits(seq),
                None => return,
            },
        };
        for b in &s.blocks {
            let seq = cortex_hash::chain(parent, b.content);
            let e = map.entry(b.engine.to_u64()).or_insert((seq.to_bits(), 0));
            e.1 += 1;
            if e.1 == 1 {
                self.index.entry(seq.to_bits()).or_default().push(holder);
            }
            parent = seq;
        }
    }

    fn query(&self, seqs: &[SeqHash], out: &mut Vec<(u32, u32)>) {
        out.clear();
        let mut active: Vec<u32> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let Some(h) = self.index.get(&s.to_bits()) else { break };
            if i == 0 {
                active.extend_from_slice(h);
            } else {
                active.retain(|a| {
                    let keep = h.contains(a);
                    if !keep {
                        out.push((*a, i as u32));
                    }
                    keep
                });
            }
            if active.is_empty() {
                return;
            }
        }
        let n = seqs.iter().take_while(|s| self.index.contains_key(&s.to_bits())).count() as u32;
        out.extend(active.iter().map(|&a| (a, n)));
    }
}

fn holder(i: u32) -> HolderId {
    HolderId::new(WorkerId(i), DpRank(0))
}

/// A ledger with every store of `w` applied (and its writers, all ready).
fn build(w: &Workload, events: &[KvEvent]) -> (Arc<Ledger>, Vec<HolderWriter>) {
    let ledger = Ledger::new(LedgerConfig { byte_budget: 64 << 30, capacity_slack_percent: 25 });
    let cfg = HolderConfig { capacity_blocks: w.blocks_per_holder as u32, content_deterministic: false };
    let mut writers: Vec<HolderWriter> =
        (0..w.holders).map(|i| ledger.add_holder(holder(i), cfg).expect("add")).collect();
    for wr in &mut writers {
        wr.set_readiness(Readiness::Ready);
    }
    for (s, ev) in w.stores.iter().zip(events) {
        writers[s.holder as usize].apply(ev).expect("apply");
    }
    (ledger, writers)
}

struct Row {
    config: String,
    cortex_p50: f64,
    cortex_p99: f64,
    cortex_ee_p50: f64,
    naive_p50: f64,
    naive_p99: f64,
    cortex_mops: f64,
    naive_mops: f64,
    cortex_bytes: f64,
    cortex_stat_bytes: f64,
    naive_bytes: f64,
}

fn measure(holders: u32, blocks: usize) -> Row {
    let w = Workload::new(holders, blocks, 20_000, 7);
    let events: Vec<KvEvent> = w.stores.iter().map(|s| w.event(s)).collect();
    let block_stores = w.pairs as f64;

    // Memory: live heap delta of building the structure (events are allocated before).
    let before = live_bytes();
    let (ledger, writers) = build(&w, &events);
    let cortex_bytes = (live_bytes() - before) as f64 / w.pairs as f64;
    let cortex_stat_bytes = ledger.stats().live_bytes as f64 / w.pairs as f64;
    let before = live_bytes();
    let mut naive = Naive::default();
    for (s, ev) in w.stores.iter().zip(&events) {
        naive.apply(s.holder, ev);
    }
    let naive_bytes = (live_bytes() - before) as f64 / w.pairs as f64;

    // Queries.
    let mut out = OverlapScores::with_capacity(holders as usize);
    let nq = w.queries.len();
    let warm = |i: usize| {
        black_box(w.queries[i].seqs.iter().fold(0u64, |a, s| a ^ s.to_bits()));
    };
    for q in w.queries.iter().take(2000) {
        ledger.query(&q.seqs, QueryOptions::default(), &mut out);
    }
    let c = latencies(nq, warm, |i| {
        ledger.query(black_box(&w.queries[i].seqs), QueryOptions::default(), &mut out)
    });
    let ee = QueryOptions { early_exit: EarlyExit::OneHolderLeft, holders: HolderFilter::Ready };
    let c_ee = latencies(nq, warm, |i| ledger.query(black_box(&w.queries[i].seqs), ee, &mut out));
    let mut nout = Vec::new();
    let n = latencies(nq, warm, |i| naive.query(black_box(&w.queries[i].seqs), &mut nout));
    drop(writers);
    drop(ledger);

    // Apply throughput on one core: best of three fresh builds.
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let built = build(&w, &events);
        best = best.min(t.elapsed().as_secs_f64());
        drop(built);
    }
    let mut nbest = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let mut nv = Naive::default();
        for (s, ev) in w.stores.iter().zip(&events) {
            nv.apply(s.holder, ev);
        }
        nbest = nbest.min(t.elapsed().as_secs_f64());
        drop(black_box(nv));
    }
    Row {
        config: format!("W={holders} x {blocks}"),
        cortex_p50: percentile(&c, 50.0),
        cortex_p99: percentile(&c, 99.0),
        cortex_ee_p50: percentile(&c_ee, 50.0),
        naive_p50: percentile(&n, 50.0),
        naive_p99: percentile(&n, 99.0),
        cortex_mops: block_stores / best / 1e6,
        naive_mops: block_stores / nbest / 1e6,
        cortex_bytes,
        cortex_stat_bytes,
        naive_bytes,
    }
}

fn configs() -> Vec<(u32, usize)> {
    match std::env::var("CORTEX_BENCH_CONFIGS") {
        Ok(s) => s
            .split(',')
            .filter_map(|c| {
                let (w, b) = c.split_once('x')?;
                Some((w.trim().parse().ok()?, b.trim().parse().ok()?))
            })
            .collect(),
        Err(_) => vec![(8, 10_000), (64, 10_000), (8, 100_000), (64, 100_000)],
    }
}

fn report() {
    println!("ledger report (§4 workload; ns per 80-block query, timer overhead subtracted)");
    println!(
        "| config | Cortex query p50 / p99 | early exit p50 | naive p50 / p99 | Cortex apply M block-stores/s | naive | Cortex B/(holder,block) (allocator; stats) | naive B |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (h, b) in configs() {
        let r = measure(h, b);
        println!(
            "| {} | {:.0} / {:.0} | {:.0} | {:.0} / {:.0} | {:.2} | {:.2} | {:.1} ; {:.1} | {:.1} |",
            r.config,
            r.cortex_p50,
            r.cortex_p99,
            r.cortex_ee_p50,
            r.naive_p50,
            r.naive_p99,
            r.cortex_mops,
            r.naive_mops,
            r.cortex_bytes,
            r.cortex_stat_bytes,
            r.naive_bytes
        );
    }
}

fn criterion_benches(c: &mut Criterion) {
    let w = Workload::new(8, 10_000, 4096, 11);
    let events: Vec<KvEvent> = w.stores.iter().map(|s| w.event(s)).collect();
    let (ledger, _writers) = build(&w, &events);
    let mut naive = Naive::default();
    for (s, ev) in w.stores.iter().zip(&events) {
        naive.apply(s.holder, ev);
    }
    let mut g = c.benchmark_group("query_W8x10k");
    let mut out = OverlapScores::with_capacity(8);
    let mut i = 0;
    g.bench_function("cortex", |b| {
        b.iter(|| {
            i = (i + 1) % w.queries.len();
            ledger.query(black_box(&w.queries[i].seqs), QueryOptions::default(), &mut out);
        });
    });
    let mut nout = Vec::new();
    g.bench_function("naive", |b| {
        b.iter(|| {
            i = (i + 1) % w.queries.len();
            naive.query(black_box(&w.queries[i].seqs), &mut nout);
        });
    });
    g.finish();
    let mut g = c.benchmark_group("apply_W8x10k");
    g.throughput(criterion::Throughput::Elements(w.pairs as u64));
    g.sample_size(10);
    g.bench_function("cortex", |b| b.iter(|| build(&w, &events)));
    g.bench_function("naive", |b| {
        b.iter(|| {
            let mut nv = Naive::default();
            for (s, ev) in w.stores.iter().zip(&events) {
                nv.apply(s.holder, ev);
            }
            nv
        });
    });
    g.finish();
}

fn main() {
    report();
    if std::env::var_os("CORTEX_BENCH_REPORT_ONLY").is_some() {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_benches(&mut c);
    c.final_summary();
}
