//! The routing decision for 8, 64 and 512 workers, with and without an overlap query, against a
//! naive baseline measured in the same run; then per-decision percentiles.
//!
//! `cargo bench -p cortex-sched --bench decision`
//!
//! The overlap query is the real one: `cortex_radix::Ledger::query` over an 80-block prompt on
//! a ledger where every worker is a READY holder; worker `w` holds a prefix of `(7·w mod 80)`
//! blocks of the prompt, and a quarter hold none (the ledger issue's 75 % hits).
//!
//! The naive baseline is what a first implementation looks like: the workers behind an `RwLock`,
//! each worker's counters behind a `Mutex`, the model compared as a `String`, the overlap looked
//! up per worker with `OverlapScores::get` (a linear scan), the scores collected into a fresh
//! `Vec` and sorted.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{Engine, Namespace, SeqHash};
use cortex_radix::{HolderConfig, Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness};
use cortex_sched::*;
use criterion::{BenchmarkId, Criterion};

const BLOCKS: usize = 80;
const BLOCK_TOKENS: u32 = 16;
const PROMPT_TOKENS: u32 = BLOCKS as u32 * BLOCK_TOKENS;

/// The ledger the decision reads: every worker a READY holder of a prefix of the prompt.
struct Overlaps {
    ledger: Arc<Ledger>,
    prompt: Vec<SeqHash>,
}

impl Overlaps {
    fn new(workers: u32) -> Self {
        let ns = Namespace::new(Engine::Sglang, BLOCK_TOKENS, "m", None);
        let tokens: Vec<u32> = (0..PROMPT_TOKENS).map(|t| t.wrapping_mul(2_654_435_761) % 150_000).collect();
        let prompt = ns.seq_hashes(None, &tokens);
        let ledger = Ledger::new(LedgerConfig::default());
        for w in 0..workers {
            let cfg = HolderConfig { capacity_blocks: 1_000, content_deterministic: false };
            let mut writer = ledger.add_holder(HolderId::new(WorkerId(w), DpRank(0)), cfg).expect("holder");
            writer.set_readiness(Readiness::Ready);
            let held = if w % 4 == 0 { 0 } else { (w as usize * 7) % BLOCKS };
            if held == 0 {
                continue;
            }
            let blocks = tokens
                .chunks(BLOCK_TOKENS as usize)
                .take(held)
                .enumerate()
                .map(|(i, page)| StoredBlock {
                    engine: EngineHash::from_u64(u64::from(w) << 32 | i as u64),
                    content: ns.block_hash(page),
                })
                .collect();
            let store = BlockStored {
                parent: None,
                blocks,
                lineage: Some(Lineage::new(ns, None)),
                medium: Medium::Gpu,
            };
            writer.apply(&KvEvent::Stored(store)).expect("store");
        }
        Overlaps { ledger, prompt }
    }

    fn query(&self, out: &mut OverlapScores) {
        self.ledger.query(&self.prompt, QueryOptions::default(), out);
    }
}

struct Fixture {
    cluster: Cluster,
    sched: Scheduler,
    overlaps: Overlaps,
}

fn fixture(workers: u32) -> Fixture {
    let cluster = Cluster::new(HealthPolicy::default());
    for i in 0..workers {
        cluster.upsert(WorkerSpec::new(WorkerId(i), "m", Engine::Sglang), Health::Healthy);
    }
    let snap = cluster.load();
    for (i, w) in snap.workers().iter().enumerate() {
        w.state().set_ledger(DpRank(0), LedgerState::Ready);
        // Some load, so the bound and the load terms have work to do.
        for _ in 0..(i % 5) {
            std::mem::forget(snap.book_holder(
                HolderId::new(w.spec().id, DpRank(0)),
                300,
                0,
                Timestamp::ZERO,
            ));
        }
    }
    Fixture {
        cluster,
        sched: Scheduler::new(SchedConfig::default()).expect("config"),
        overlaps: Overlaps::new(workers),
    }
}

// ------------------------------------------------------------------------------------------------
// The naive baseline.

struct NaiveState {
    inflight: u32,
    prefill: u64,
    ready: bool,
}

struct NaiveWorker {
    holder: HolderId,
    model: String,
    healthy: bool,
    state: Mutex<NaiveState>,
}

struct Naive {
    workers: RwLock<Vec<NaiveWorker>>,
}

impl Naive {
    fn new(workers: u32) -> Self {
        let ws = (0..workers)
            .map(|i| NaiveWorker {
                holder: HolderId::new(WorkerId(i), DpRank(0)),
                model: "m".to_owned(),
                healthy: true,
                state: Mutex::new(NaiveState {
                    inflight: i % 5,
                    prefill: u64::from(i % 5) * 300,
                    ready: true,
                }),
            })
            .collect();
        Naive { workers: RwLock::new(ws) }
    }

    fn decide(&self, model: &str, overlap: &OverlapScores) -> Vec<(f64, HolderId)> {
        let w = Weights::default();
        let workers = self.workers.read().expect("lock");
        let mut out: Vec<(f64, HolderId)> = workers
            .iter()
            .filter(|x| x.model == model && x.healthy)
            .map(|x| {
                let st = x.state.lock().expect("lock");
                let matched = if st.ready {
                    overlap.get(x.holder).map_or(0, |o| o.gpu_blocks * BLOCK_TOKENS)
                } else {
                    0
                };
                let queue_ms = st.prefill as f64 / 10.0;
                let s = w.alpha_per_token * f64::from(matched)
                    - w.beta_per_request * f64::from(st.inflight)
                    - w.gamma_per_ms * queue_ms;
                (s, x.holder)
            })
            .collect();
        out.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
        out
    }
}

// ------------------------------------------------------------------------------------------------

fn decide(f: &Fixture, overlap: &OverlapScores, out: &mut Ranking, now: Timestamp) {
    let snap = f.cluster.load();
    let req = Request::new(
        "m",
        Role::Regular,
        now,
        PROMPT_TOKENS,
        CacheView::Overlap { scores: overlap, block_tokens: BLOCK_TOKENS },
    );
    f.sched.decide(&snap, &req, out).expect("decide");
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for workers in [8u32, 64, 512] {
        let f = fixture(workers);
        let naive = Naive::new(workers);
        let mut overlap = OverlapScores::with_capacity(workers as usize);
        let mut out = Ranking::with_capacity(workers as usize);
        f.overlaps.query(&mut overlap);
        assert!(overlap.len() > (workers as usize) / 2, "the ledger answers for most holders");
        let now = Timestamp::from_millis(1);

        g.bench_with_input(BenchmarkId::new("overlap_ledger", workers), &workers, |b, _| {
            b.iter(|| f.overlaps.query(black_box(&mut overlap)));
        });
        g.bench_with_input(BenchmarkId::new("cortex_decide", workers), &workers, |b, _| {
            b.iter(|| decide(&f, black_box(&overlap), &mut out, now));
        });
        g.bench_with_input(BenchmarkId::new("cortex_overlap+decide", workers), &workers, |b, _| {
            b.iter(|| {
                f.overlaps.query(&mut overlap);
                decide(&f, black_box(&overlap), &mut out, now);
            });
        });
        g.bench_with_input(BenchmarkId::new("naive_overlap+decide", workers), &workers, |b, _| {
            b.iter(|| {
                f.overlaps.query(&mut overlap);
                black_box(naive.decide("m", black_box(&overlap)))
            });
        });
    }
    g.finish();
}

/// Per-decision percentiles (each call timed on its own; `Instant::now` costs ~20–30 ns, which is
/// included).
fn percentiles() {
    for workers in [8u32, 64, 512] {
        let f = fixture(workers);
        let mut overlap = OverlapScores::with_capacity(workers as usize);
        let mut out = Ranking::with_capacity(workers as usize);
        let now = Timestamp::from_millis(1);
        let mut with_query = Vec::with_capacity(100_000);
        let mut alone = Vec::with_capacity(100_000);
        for i in 0..110_000 {
            let t0 = Instant::now();
            f.overlaps.query(&mut overlap);
            let t1 = Instant::now();
            decide(&f, &overlap, &mut out, now);
            let t2 = Instant::now();
            if i >= 10_000 {
                with_query.push((t2 - t0).as_nanos() as u64);
                alone.push((t2 - t1).as_nanos() as u64);
            }
        }
        for (name, v) in [("decide", &mut alone), ("overlap+decide", &mut with_query)] {
            v.sort_unstable();
            let p = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
            eprintln!(
                "percentiles {name:<15} workers={workers:<4} p50={} ns p90={} ns p99={} ns p99.9={} ns",
                p(0.50),
                p(0.90),
                p(0.99),
                p(0.999)
            );
        }
    }
}

fn main() {
    // `CORTEX_BENCH_LOOP=N`: N decisions at 64 workers and exit (for callgrind/cachegrind, whose
    // instruction counts are stable on a shared machine).
    if let Some(n) = std::env::var("CORTEX_BENCH_LOOP").ok().and_then(|v| v.parse::<u32>().ok()) {
        let f = fixture(64);
        let mut overlap = OverlapScores::with_capacity(64);
        let mut out = Ranking::with_capacity(64);
        f.overlaps.query(&mut overlap);
        for _ in 0..n {
            decide(&f, black_box(&overlap), &mut out, Timestamp::from_millis(1));
        }
        return;
    }
    let mut c = Criterion::default()
        .sample_size(50)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3))
        .configure_from_args();
    benches(&mut c);
    c.final_summary();
    // `--profile-time` (perf sessions) and criterion's test mode skip the percentile pass.
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--profile-time" || a == "--test" || a == "--list") {
        percentiles();
    }
}
