//! The routing decision for 8, 64 and 512 workers, with and without an overlap query, against a
//! naive baseline measured in the same run; then per-decision percentiles.
//!
//! `cargo bench -p cortex-sched --bench decision`
//!
//! The overlap query is a stated **stand-in** until the real ledger (cortex-radix) lands: a
//! `HashMap<SeqHash, holder bitset>` walked over an 80-block prompt, intersecting the set of
//! holders still matching at each block and stopping when it is empty. Holders hold a prefix of
//! the prompt of `(7·w mod 80)` blocks; a quarter hold none (the ledger issue's 75 % hits). The
//! number will be re-measured with the real ledger.
//!
//! The naive baseline is what a first implementation looks like: the workers behind an `RwLock`,
//! each worker's counters behind a `Mutex`, the model compared as a `String`, the overlap looked
//! up per worker with `OverlapScores::get` (a linear scan), the scores collected into a fresh
//! `Vec` and sorted.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::{Engine, SeqHash};
use cortex_radix::{Overlap, OverlapScores};
use cortex_sched::*;
use criterion::{BenchmarkId, Criterion};

const BLOCKS: usize = 80;
const BLOCK_TOKENS: u32 = 16;
const PROMPT_TOKENS: u32 = BLOCKS as u32 * BLOCK_TOKENS;

/// `SeqHash` is already a hash: use its bits.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The stand-in ledger: block → bitset of holders.
struct StandIn {
    index: HashMap<SeqHash, Vec<u64>, BuildHasherDefault<IdHasher>>,
    holders: Vec<HolderId>,
    prompt: Vec<SeqHash>,
    words: usize,
}

impl StandIn {
    fn new(workers: u32) -> Self {
        let prompt: Vec<SeqHash> = (0..BLOCKS as u64)
            .map(|i| SeqHash::from_bits(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xabc))
            .collect();
        let words = (workers as usize).div_ceil(64);
        let mut index: HashMap<SeqHash, Vec<u64>, BuildHasherDefault<IdHasher>> = HashMap::default();
        for w in 0..workers {
            let held = if w % 4 == 0 { 0 } else { (w as usize * 7) % BLOCKS };
            for b in &prompt[..held] {
                index.entry(*b).or_insert_with(|| vec![0; words])[w as usize / 64] |= 1 << (w % 64);
            }
        }
        let holders = (0..workers).map(|w| HolderId::new(WorkerId(w), DpRank(0))).collect();
        StandIn { index, holders, prompt, words }
    }

    fn query(&self, out: &mut OverlapScores, active: &mut [u64]) {
        out.begin(BLOCKS as u32);
        active.iter_mut().for_each(|a| *a = u64::MAX);
        let mut depth = 0u32;
        for b in &self.prompt {
            let Some(bits) = self.index.get(b) else { break };
            let mut any = 0;
            for (i, (a, &m)) in active.iter_mut().zip(bits).enumerate() {
                let dropped = *a & !m;
                self.flush(out, i, dropped, depth);
                *a &= m;
                any |= *a;
            }
            depth += 1;
            if any == 0 {
                return;
            }
        }
        for (i, &a) in active.iter().enumerate() {
            self.flush(out, i, a, depth);
        }
    }

    fn flush(&self, out: &mut OverlapScores, word: usize, mut bits: u64, depth: u32) {
        while bits != 0 && depth > 0 {
            let j = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(&holder) = self.holders.get(j) {
                out.push(Overlap { holder, gpu_blocks: depth, any_tier_blocks: depth });
            }
        }
    }
}

struct Fixture {
    cluster: Cluster,
    sched: Scheduler,
    standin: StandIn,
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
            std::mem::forget(snap.book_holder(HolderId::new(w.spec().id, DpRank(0)), 300, Timestamp::ZERO));
        }
    }
    Fixture {
        cluster,
        sched: Scheduler::new(SchedConfig::default()).expect("config"),
        standin: StandIn::new(workers),
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
        let mut active = vec![0u64; f.standin.words];
        let mut out = Ranking::with_capacity(workers as usize);
        f.standin.query(&mut overlap, &mut active);
        assert!(overlap.len() > (workers as usize) / 2, "stand-in answers for most holders");
        let now = Timestamp::from_millis(1);

        g.bench_with_input(BenchmarkId::new("overlap_standin", workers), &workers, |b, _| {
            b.iter(|| f.standin.query(black_box(&mut overlap), &mut active));
        });
        g.bench_with_input(BenchmarkId::new("cortex_decide", workers), &workers, |b, _| {
            b.iter(|| decide(&f, black_box(&overlap), &mut out, now));
        });
        g.bench_with_input(BenchmarkId::new("cortex_overlap+decide", workers), &workers, |b, _| {
            b.iter(|| {
                f.standin.query(&mut overlap, &mut active);
                decide(&f, black_box(&overlap), &mut out, now);
            });
        });
        g.bench_with_input(BenchmarkId::new("naive_overlap+decide", workers), &workers, |b, _| {
            b.iter(|| {
                f.standin.query(&mut overlap, &mut active);
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
        let mut active = vec![0u64; f.standin.words];
        let mut out = Ranking::with_capacity(workers as usize);
        let now = Timestamp::from_millis(1);
        let mut with_query = Vec::with_capacity(100_000);
        let mut alone = Vec::with_capacity(100_000);
        for i in 0..110_000 {
            let t0 = Instant::now();
            f.standin.query(&mut overlap, &mut active);
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
        let mut active = vec![0u64; f.standin.words];
        let mut out = Ranking::with_capacity(64);
        f.standin.query(&mut overlap, &mut active);
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
