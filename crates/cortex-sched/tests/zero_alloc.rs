//! The decision path allocates nothing when the caller lends the result buffer: a counting global
//! allocator (per thread, so the test harness's own threads do not count) around snapshot load,
//! decision, booking, first token and completion, for every policy but `manual` (whose sticky
//! map inserts a key per new routing key, by design).

mod counting;

use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::{Engine, SeqHash};
use cortex_radix::{Overlap, OverlapScores};
use cortex_sched::learn::TRAINED_SAMPLES;
use cortex_sched::*;
use counting::allocations;

#[test]
fn decision_path_allocates_nothing() {
    const WORKERS: u32 = 64;
    let policies = [
        PolicyConfig::CacheAware,
        PolicyConfig::CacheAwareV1,
        PolicyConfig::RoundRobin,
        PolicyConfig::Random,
        PolicyConfig::PowerOfTwo,
        PolicyConfig::LeastLoad,
        PolicyConfig::ConsistentHashing,
        PolicyConfig::PrefixHash(PrefixHashConfig::default()),
    ];
    let cluster = Cluster::new(HealthPolicy::default());
    for i in 0..WORKERS {
        let spec = WorkerSpec {
            dp_size: if i % 8 == 0 { 2 } else { 1 },
            ..WorkerSpec::new(WorkerId(i), "m", Engine::Vllm)
        };
        cluster.upsert(spec, Health::Healthy);
    }
    let snap = cluster.load();
    for w in snap.workers() {
        for r in 0..w.state().dp_size() {
            w.state().set_ledger(DpRank(r), LedgerState::Ready);
        }
    }
    drop(snap);
    let mut ranking = Ranking::with_capacity(2 * WORKERS as usize);
    let mut overlap = OverlapScores::with_capacity(2 * WORKERS as usize);
    let prefix: Vec<SeqHash> = (0..80).map(SeqHash::from_bits).collect();
    let mut bookings = Vec::with_capacity(64);
    // Streaming first chunks train a quarter of the holders: pools hold trained and untrained
    // holders, which `cache_aware` prices at the trained ones' line.
    let snap = cluster.load();
    for w in (0..WORKERS).filter(|w| w % 4 == 0) {
        for i in 0..TRAINED_SAMPLES {
            let holder = HolderId::new(WorkerId(w), DpRank(0));
            let mut b = snap
                .book_holder(holder, 100 + 300 * (i as u32 % 4), 0, Timestamp::from_millis(i))
                .expect("book");
            b.first_output(Timestamp::from_millis(i + 20));
        }
    }
    drop(snap);
    // Booked signals: the exact and load-aware branches; engine reports that some ranks never
    // send: the p2c branch.
    let signals =
        [LoadSignals::Booked, LoadSignals::EngineReports { max_age: std::time::Duration::from_secs(5) }];
    for (p, load_signals) in policies.into_iter().flat_map(|p| signals.map(|s| (p, s))) {
        let config = SchedConfig {
            pools: PoolPolicies { regular: p, prefill: p, decode: p },
            load_signals,
            ..SchedConfig::default()
        };
        let mut modes = [0u32; 4];
        let sched = Scheduler::new(config).expect("config");
        let mut round =
            |i: u64, ranking: &mut Ranking, overlap: &mut OverlapScores, bookings: &mut Vec<Booking>| {
                let now = Timestamp::from_millis(i);
                // Engine reports for most holders (some missing: the p2c branch), a ledger answer.
                let snap = cluster.load();
                for w in snap.workers().iter().filter(|w| u64::from(w.spec().id.0) % 7 != i % 3) {
                    let load = EngineLoad {
                        running: (i % 5) as u32,
                        waiting: 1,
                        waiting_prefill_tokens: Some(100),
                        kv_usage: 0.3,
                        prefill_totals: None,
                    };
                    w.state().report_load(DpRank(0), load, now);
                }
                overlap.begin(80);
                for w in 0..WORKERS {
                    if !(u64::from(w) + i).is_multiple_of(4) {
                        let holder = HolderId::new(WorkerId(w), DpRank(0));
                        let blocks = ((u64::from(w) * 7 + i) % 80) as u32;
                        overlap.push(Overlap { holder, gpu_blocks: blocks, any_tier_blocks: blocks });
                    }
                }
                let mut req = Request::new(
                    "m",
                    Role::Regular,
                    now,
                    1280,
                    CacheView::Overlap { scores: overlap, block_tokens: 16 },
                );
                req.routing_key = Some(b"tenant-7");
                req.prefix = &prefix[..(i % 80) as usize];
                sched.decide(&snap, &req, ranking).expect("decide");
                modes[ranking.mode() as usize] += 1;
                let mut b = snap.book(ranking.first().expect("first"), now).expect("book");
                b.first_token(now);
                if i.is_multiple_of(2) {
                    b.succeed(now);
                } else {
                    bookings.push(b); // keep some in flight
                }
                if bookings.len() > 40 {
                    bookings.clear();
                }
            };
        // Warm-up: the first epoch pin of this thread registers it (one allocation, once).
        round(0, &mut ranking, &mut overlap, &mut bookings);
        let ((), n) = allocations(|| {
            for i in 1..500 {
                round(i, &mut ranking, &mut overlap, &mut bookings);
            }
        });
        assert_eq!(n, 0, "{} allocated {n} times in 499 decisions", p.kind());

        bookings.clear();
        let exact = MatchMode::ExactKvEvents as usize;
        if p == PolicyConfig::CacheAwareV1 {
            match load_signals {
                LoadSignals::Booked => assert!(modes[exact] > 100, "{modes:?}"),
                LoadSignals::EngineReports { .. } => {
                    assert!(modes[MatchMode::FallbackP2c as usize] > 100, "{modes:?}")
                }
            }
        }
        // The time-based policy estimates a holder without a fresh report from the bookings:
        // it never degrades for load signals.
        if p == PolicyConfig::CacheAware {
            assert!(modes[exact] > 100, "{modes:?}");
        }
    }
}
