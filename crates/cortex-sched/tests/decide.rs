//! Table tests of the decision: every branch of the degradation chain, the watermark, the load
//! bound, the candidate filter (health, cooldown classes, breaker, ledger readiness), each policy,
//! DP-rank selection and the scorer seam. Virtual time throughout.

use std::time::Duration;

use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::{Engine, SeqHash};
use cortex_radix::{Overlap, OverlapScores};
use cortex_sched::*;

const MODEL: &str = "qwen3";
const BLOCK: u32 = 16;
const PROMPT: u32 = 2048;

fn h(w: u32) -> HolderId {
    HolderId::new(WorkerId(w), DpRank(0))
}

fn ms(n: u64) -> Timestamp {
    Timestamp::from_millis(n)
}

struct Fixture {
    cluster: Cluster,
    sched: Scheduler,
    out: Ranking,
    overlap: OverlapScores,
    bookings: Vec<Booking>,
}

impl Fixture {
    fn new(workers: u32, config: SchedConfig) -> Self {
        Self::with_specs(
            (0..workers).map(|i| WorkerSpec::new(WorkerId(i), MODEL, Engine::Sglang)).collect(),
            config,
        )
    }

    fn with_specs(specs: Vec<WorkerSpec>, config: SchedConfig) -> Self {
        let cluster = Cluster::new(HealthPolicy::default());
        for s in specs {
            cluster.upsert(s, Health::Healthy);
        }
        let snap = cluster.load();
        for w in snap.workers() {
            for r in 0..w.state().dp_size() {
                w.state().set_ledger(DpRank(r), LedgerState::Ready);
            }
        }
        Fixture {
            cluster,
            sched: Scheduler::new(config).expect("valid config"),
            // Its candidates' scores carry their terms, which the tests read.
            out: Ranking::with_capacity(64).explaining(),
            overlap: OverlapScores::with_capacity(64),
            bookings: Vec::new(),
        }
    }

    fn state(&self, w: u32) -> std::sync::Arc<WorkerState> {
        std::sync::Arc::clone(self.cluster.load().worker(WorkerId(w)).expect("worker").state())
    }

    /// The ledger's answer: `(holder, blocks)`.
    fn hits(&mut self, hits: &[(HolderId, u32)]) -> &mut Self {
        self.overlap.begin(PROMPT / BLOCK);
        for &(holder, gpu_blocks) in hits {
            self.overlap.push(Overlap { holder, gpu_blocks, any_tier_blocks: gpu_blocks });
        }
        self
    }

    /// Books `n` requests of `prefill` tokens on `holder`.
    fn load(&mut self, holder: HolderId, n: u32, prefill: u32) -> &mut Self {
        let snap = self.cluster.load();
        for _ in 0..n {
            self.bookings.push(snap.book_holder(holder, prefill, 0, ms(0)).expect("book"));
        }
        self
    }

    fn decide_with(&mut self, cache: CacheView<'_>, now: Timestamp) -> Result<(), SchedError> {
        let snap = self.cluster.load();
        let req = Request::new(MODEL, Role::Regular, now, PROMPT, cache);
        self.sched.decide(&snap, &req, &mut self.out)
    }

    fn decide(&mut self) -> &Ranking {
        let overlap = std::mem::take(&mut self.overlap);
        let r = self.decide_with(CacheView::Overlap { scores: &overlap, block_tokens: BLOCK }, ms(10));
        self.overlap = overlap;
        r.expect("a candidate");
        &self.out
    }

    fn first(&mut self) -> HolderId {
        self.decide().first().expect("first").holder
    }
}

fn no_bound() -> SchedConfig {
    SchedConfig { bounded_load: None, ..SchedConfig::default() }
}

/// `cache_aware_v1`: the weighted score in prompt tokens, and the degradation chain's load-signal
/// levels.
fn v1(c: SchedConfig) -> SchedConfig {
    SchedConfig { pools: PoolPolicies { regular: PolicyConfig::CacheAwareV1, ..c.pools }, ..c }
}

// ---------------------------------------------------------------------------------------------
// The degradation chain

#[test]
fn exact_kv_events_when_ready_and_hit() {
    let mut f = Fixture::new(4, v1(SchedConfig::default()));
    f.hits(&[(h(2), 100), (h(1), 10)]);
    let r = f.decide();
    assert_eq!((r.mode(), r.reason()), (MatchMode::ExactKvEvents, None));
    assert_eq!(r.mode().as_str(), "exact_kv_events");
    let c = r.first().expect("first");
    assert_eq!((c.holder, c.matched_tokens, c.affinity_tokens, c.prefill_tokens), (h(2), 1600, 1600, 448));
    assert_eq!(c.score.affinity, 1600.0);
    assert_eq!(r.cache_hit_tokens(), 1600);
    // The whole pool is ranked; the next best cache holder is second.
    assert_eq!(r.admissible().len(), 4);
    assert_eq!(r.admissible().nth(1).expect("nth").holder, h(1));
}

#[test]
fn load_aware_when_no_hit_picks_least_loaded() {
    let mut f = Fixture::new(3, no_bound());
    f.load(h(0), 2, 100).load(h(2), 1, 100).hits(&[]);
    let r = f.decide();
    assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(FallbackReason::NoHit)));
    assert_eq!(r.mode().as_str(), "load_aware");
    let order: Vec<_> = r.admissible().map(|c| c.holder).collect();
    assert_eq!(order, vec![h(1), h(2), h(0)]);
    assert_eq!(r.cache_hit_tokens(), 0);
}

#[test]
fn load_aware_when_the_hit_is_overruled_by_load() {
    let mut f = Fixture::new(2, v1(no_bound()));
    // One block (16 tokens) of hit on w1 is worth less than 3 extra requests (β = 32 each).
    f.load(h(1), 3, 0).hits(&[(h(1), 1)]);
    let r = f.decide();
    assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(FallbackReason::HitOverruled)));
    assert_eq!(r.first().expect("first").holder, h(0));
    // The hit is still shown on the candidate that had it.
    let w1 = r.admissible().find(|c| c.holder == h(1)).expect("w1");
    assert_eq!((w1.matched_tokens, w1.affinity_tokens), (16, 16));
}

#[test]
fn untrusted_requests_never_get_a_guessed_hit() {
    for (u, reason) in [
        (Untrusted::TokenizerFailed, FallbackReason::TokenizerFailed),
        (Untrusted::UnreproduciblePrompt, FallbackReason::UnreproduciblePrompt),
        (Untrusted::TemplateMismatch, FallbackReason::TemplateMismatch),
        (Untrusted::LedgerNotReady, FallbackReason::LedgerNotReady),
        (Untrusted::ExactRoutingOff, FallbackReason::ExactRoutingOff),
    ] {
        let mut f = Fixture::new(3, SchedConfig::default());
        f.load(h(0), 1, 0);
        f.decide_with(CacheView::Untrusted(u), ms(1)).expect("ok");
        let r = &f.out;
        assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(reason)), "{u:?}");
        assert!(
            r.all().all(|c| c.matched_tokens == 0 && c.affinity_tokens == 0 && c.prefill_tokens == PROMPT)
        );
        assert_ne!(r.first().expect("first").holder, h(0), "still load-aware");
        assert_eq!(
            reason.as_str(),
            format!("{u:?}").chars().fold(String::new(), |mut s, ch| {
                if ch.is_uppercase() && !s.is_empty() {
                    s.push('_');
                }
                s.push(ch.to_ascii_lowercase());
                s
            })
        );
    }
}

#[test]
fn a_holder_whose_ledger_is_not_ready_gets_no_credit() {
    for state in [LedgerState::Syncing, LedgerState::Stale, LedgerState::Disabled] {
        let mut f = Fixture::new(2, SchedConfig::default());
        f.state(1).set_ledger(DpRank(0), state);
        f.hits(&[(h(1), 100)]);
        let r = f.decide();
        let w1 = r.all().find(|c| c.holder == h(1)).expect("w1");
        assert_eq!((w1.matched_tokens, w1.ledger, w1.excluded), (0, state, None), "{state:?}");
        // No hit counted, but a syncing or stale holder may have the prefix unseen: the reason
        // says so rather than that the ledger saw a miss. A disabled one (exact routing off for
        // good) is a miss as before.
        let reason = match state {
            LedgerState::Disabled => FallbackReason::NoHit,
            _ => FallbackReason::LedgerNotReady,
        };
        assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(reason)), "{state:?}");
    }
}

#[test]
fn unready_holders_excluded_when_configured() {
    let cfg = SchedConfig { unready_holders: UnreadyHolders::Excluded, ..SchedConfig::default() };
    let mut f = Fixture::new(3, cfg);
    f.state(1).set_ledger(DpRank(0), LedgerState::Stale);
    f.hits(&[]);
    let r = f.decide();
    assert_eq!(r.admissible().len(), 2);
    assert_eq!(r.excluded().len(), 1);
    assert_eq!(
        (r.excluded().next().expect("next").holder, r.excluded().next().expect("next").excluded),
        (h(1), Some(Exclusion::LedgerNotReady))
    );
    // No READY holder at all: load-routed over everyone, and said so.
    for w in [0, 2] {
        f.state(w).set_ledger(DpRank(0), LedgerState::Syncing);
    }
    let r = f.decide();
    assert_eq!(r.admissible().len(), 3);
    assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(FallbackReason::LedgerNotReady)));
}

#[test]
fn the_bound_counts_only_holders_left_after_the_ledger_filter() {
    // w0 READY with 5 bookings, w1 syncing and idle. Over both, the cap would be ⌈1.25·6/2⌉ = 4
    // and exclude w0 too; over w0 alone it is 8.
    let cfg = SchedConfig {
        unready_holders: UnreadyHolders::Excluded,
        bounded_load: Some(BoundedLoad { epsilon: 0.25 }),
        ..SchedConfig::default()
    };
    let mut f = Fixture::new(2, cfg);
    f.state(1).set_ledger(DpRank(0), LedgerState::Syncing);
    f.load(h(0), 5, 0).hits(&[(h(0), 10)]);
    let r = f.decide();
    assert_eq!(r.first().expect("w0 stays").holder, h(0));
    assert_eq!(r.mode(), MatchMode::ExactKvEvents);
}

fn engine_reports() -> SchedConfig {
    SchedConfig { load_signals: LoadSignals::EngineReports { max_age: Duration::from_secs(1) }, ..no_bound() }
}

fn report(f: &Fixture, w: u32, running: u32, at: Timestamp) {
    let l = EngineLoad {
        running,
        waiting: 0,
        waiting_prefill_tokens: Some(0),
        kv_usage: 0.5,
        prefill_totals: None,
    };
    assert!(f.state(w).report_load(DpRank(0), l, at));
}

#[test]
fn fallback_p2c_when_load_signals_are_partly_missing() {
    let mut f = Fixture::new(3, v1(engine_reports()));
    report(&f, 0, 1, ms(0));
    report(&f, 1, 1, ms(0));
    report(&f, 2, 1, ms(0));
    // At 10 ms all three are fresh: load-aware, hits counted.
    f.hits(&[(h(2), 50)]);
    assert_eq!(f.decide().mode(), MatchMode::ExactKvEvents);
    // Worker 2's report ages beyond max_age while the others refresh.
    report(&f, 0, 1, ms(1500));
    report(&f, 1, 1, ms(1500));
    f.decide_with(CacheView::Untrusted(Untrusted::TokenizerFailed), ms(1600)).expect("ok");
    assert_eq!(
        (f.out.mode(), f.out.reason()),
        (MatchMode::FallbackP2c, Some(FallbackReason::LoadSignalsPartial))
    );
    assert_eq!(f.out.mode().as_str(), "fallback_p2c");
    let missing = f.out.all().find(|c| c.holder == h(2)).expect("w2");
    assert!(!missing.load_reported);
    // The cache is not used in this branch, even with a hit.
    let overlap = f.overlap.clone();
    f.decide_with(CacheView::Overlap { scores: &overlap, block_tokens: BLOCK }, ms(1600)).expect("ok");
    assert_eq!(f.out.mode(), MatchMode::FallbackP2c);
    assert!(f.out.all().all(|c| c.affinity_tokens == 0));
}

#[test]
fn fallback_round_robin_when_only_liveness_is_known() {
    let mut f = Fixture::new(3, v1(engine_reports()));
    f.hits(&[(h(1), 100)]);
    let mut firsts = Vec::new();
    for _ in 0..6 {
        let r = f.decide();
        assert_eq!(
            (r.mode(), r.reason()),
            (MatchMode::FallbackRoundRobin, Some(FallbackReason::LoadSignalsMissing))
        );
        assert_eq!(r.mode().as_str(), "fallback_round_robin");
        assert!(r.all().all(|c| c.affinity_tokens == 0));
        firsts.push(r.first().expect("first").holder.worker.0);
    }
    assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
}

#[test]
fn engine_reports_feed_the_load_terms() {
    let mut f = Fixture::new(2, engine_reports());
    report(&f, 0, 9, ms(5));
    report(&f, 1, 2, ms(5));
    f.hits(&[]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(1));
    let w0 = r.all().find(|c| c.holder == h(0)).expect("w0");
    assert_eq!((w0.active_requests, w0.booked_requests, w0.kv_usage), (9, 0, Some(0.5)));
}

// ---------------------------------------------------------------------------------------------
// Watermark and bounded load

#[test]
fn watermark_gives_up_affinity_for_the_request() {
    let cap = Capacity { max_running_requests: 4, ..Capacity::default() };
    let specs =
        (0..3).map(|i| WorkerSpec { capacity: cap, ..WorkerSpec::new(WorkerId(i), MODEL, Engine::Vllm) });
    // Cases: (policy, bookings on the holder, prefill tokens each, expect watermark). The queue
    // latency threshold is `cache_aware_v1`'s: `cache_aware` weighs the queue in its estimate.
    for (cfg, n, prefill, watermark) in [
        (no_bound(), 3, 0, false),
        (no_bound(), 4, 0, true),
        (v1(no_bound()), 1, 30_000, true),
        (v1(no_bound()), 1, 1_000, false),
    ] {
        let mut f = Fixture::with_specs(specs.clone().collect(), cfg);
        f.load(h(1), n, prefill).hits(&[(h(1), 128)]);
        let r = f.decide();
        let w1 = *r.all().find(|c| c.holder == h(1)).expect("w1");
        if watermark {
            assert_eq!(
                (r.mode(), r.reason()),
                (MatchMode::LoadAware, Some(FallbackReason::Watermark)),
                "{n} {prefill}"
            );
            assert_eq!((w1.matched_tokens, w1.affinity_tokens), (2048, 0), "hit shown, not counted");
            assert_ne!(r.first().expect("first").holder, h(1));
        } else {
            assert_eq!(r.mode(), MatchMode::ExactKvEvents, "{n} {prefill}");
            assert_eq!(r.first().expect("first").holder, h(1));
        }
    }
}

#[test]
fn bounded_load_caps_the_best_holder() {
    let cfg = SchedConfig { bounded_load: Some(BoundedLoad { epsilon: 0.25 }), ..SchedConfig::default() };
    let mut f = Fixture::new(4, cfg);
    // Bookings 6,2,2,2: cap = ⌈1.25 · 13 / 4⌉ = 5.
    f.load(h(0), 6, 0).load(h(1), 2, 0).load(h(2), 2, 0).load(h(3), 2, 0).hits(&[(h(0), 128)]);
    let r = f.decide();
    assert_eq!(r.excluded().len(), 1);
    assert_eq!(
        (r.excluded().next().expect("next").holder, r.excluded().next().expect("next").excluded),
        (h(0), Some(Exclusion::BoundedLoad { cap: 5 }))
    );
    assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(FallbackReason::HitOverruled)));
    // Without the bound the hit wins (128 blocks outweigh 4 requests).
    let mut f = Fixture::new(4, no_bound());
    f.load(h(0), 6, 0).load(h(1), 2, 0).load(h(2), 2, 0).load(h(3), 2, 0).hits(&[(h(0), 128)]);
    assert_eq!(f.first(), h(0));
}

/// `cache_aware` at low load: with one request in flight on 8 holders, ⌈2 · 2/8⌉ = 1 would
/// exclude the holder of the prompt's history because it answers one other request; the floor
/// (`TIME_BOUND_FLOOR`) lets it take requests up to the floor, not one more.
#[test]
fn the_bound_never_forbids_a_holder_its_first_requests() {
    // 8 holders, ε = 1: ⌈2·(B + 1)/8⌉ is below the floor here, so the floor is the cap.
    let floor = TIME_BOUND_FLOOR as u32;
    for busy in 1..floor {
        let mut f = Fixture::new(8, SchedConfig::default());
        f.load(h(3), busy, 0).hits(&[(h(3), 128)]);
        assert_eq!(f.first(), h(3), "the history's holder, answering {busy} other request(s)");
        assert_eq!(f.out.excluded().len(), 0);
    }
    let mut f = Fixture::new(8, SchedConfig::default());
    f.load(h(3), floor, 0).hits(&[(h(3), 128)]);
    assert_ne!(f.first(), h(3));
    let excluded: Vec<_> = f.out.excluded().map(|c| (c.holder, c.excluded)).collect();
    assert_eq!(excluded, vec![(h(3), Some(Exclusion::BoundedLoad { cap: floor }))]);
    // `cache_aware_v1` keeps the first wave's bound: cap 1 excludes the holder at once.
    let mut f = Fixture::new(8, v1(SchedConfig::default()));
    f.load(h(3), 1, 0).hits(&[(h(3), 128)]);
    assert_ne!(f.first(), h(3));
}

proptest::proptest! {
    /// Whatever the bookings and hits, the chosen holder is below max(⌈(1+ε)·(Σ+1)/n⌉, TIME_BOUND_FLOOR)
    /// (`cache_aware`'s floor), so after booking no holder exceeds the bound.
    #[test]
    fn bounded_load_guarantee(
        loads in proptest::collection::vec(0u32..20, 1..12),
        hits in proptest::collection::vec(0u32..128, 1..12),
        eps in 0.05f64..1.0,
    ) {
        let n = loads.len() as u32;
        let cfg = SchedConfig { bounded_load: Some(BoundedLoad { epsilon: eps }), ..SchedConfig::default() };
        let mut f = Fixture::new(n, cfg);
        for (w, &l) in loads.iter().enumerate() {
            f.load(h(w as u32), l, 0);
        }
        let hs: Vec<_> = hits.iter().enumerate().filter(|(w, _)| (*w as u32) < n).map(|(w, &b)| (h(w as u32), b)).collect();
        f.hits(&hs);
        let total: u32 = loads.iter().sum();
        let cap = (((1.0 + eps) * f64::from(total + 1) / f64::from(n)).ceil() as u32).max(TIME_BOUND_FLOOR as u32);
        let r = f.decide();
        let first = r.first().expect("never empty");
        proptest::prop_assert!(first.booked_requests < cap, "{} >= {cap}", first.booked_requests);
        for c in r.excluded() {
            proptest::prop_assert_eq!(c.excluded, Some(Exclusion::BoundedLoad { cap }));
            proptest::prop_assert!(c.booked_requests >= cap);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The candidate filter

#[test]
fn cooldown_classes_exclude_for_their_duration() {
    let d = HealthPolicy::default().cooldowns;
    for (class, cooldown) in [
        (FailureClass::RateLimited, Some(d.rate_limited)),
        (FailureClass::ServerError, Some(d.server_error)),
        (FailureClass::Timeout, Some(d.timeout)),
        (FailureClass::ContextLengthExceeded, None),
        (FailureClass::QuotaExhausted, Some(d.quota_exhausted)),
        (FailureClass::ContentPolicy, None),
    ] {
        let mut f = Fixture::new(2, SchedConfig::default());
        f.hits(&[(h(0), 100)]);
        f.state(0).record_failure(class, ms(0));
        let overlap = f.overlap.clone();
        let at = |f: &mut Fixture, t: Timestamp| {
            f.decide_with(CacheView::Overlap { scores: &overlap, block_tokens: BLOCK }, t).expect("ok");
            f.out.all().find(|c| c.holder == h(0)).expect("w0").excluded
        };
        match cooldown {
            Some(d) => {
                assert_eq!(at(&mut f, ms(0)), Some(Exclusion::CoolingDown(class)), "{class}");
                assert_eq!(f.out.first().expect("w1").holder, h(1), "{class}: retry elsewhere");
                let almost = Timestamp::from_nanos(d.as_nanos() as u64 - 1);
                assert_eq!(at(&mut f, almost), Some(Exclusion::CoolingDown(class)), "{class}");
                assert_eq!(at(&mut f, ms(0).saturating_add(d)), None, "{class}: over");
                assert_eq!(f.out.first().expect("w0").holder, h(0));
            }
            None => {
                assert_eq!(at(&mut f, ms(0)), None, "{class}: the request was the problem");
                assert_eq!(f.out.first().expect("w0").holder, h(0));
            }
        }
    }
}

#[test]
fn health_breaker_and_none_admissible() {
    let mut f = Fixture::new(4, SchedConfig::default());
    f.cluster.set_health(WorkerId(0), Health::Unhealthy);
    f.cluster.set_health(WorkerId(1), Health::Draining);
    for i in 0..10 {
        f.state(2).record_failure(FailureClass::ServerError, ms(i));
    }
    // Cooldown of server errors is 1 s; the breaker stays open 60 s.
    f.decide_with(CacheView::Untrusted(Untrusted::TokenizerFailed), ms(5_000)).expect("w3 left");
    let why: Vec<_> = f.out.excluded().map(|c| (c.holder.worker.0, c.excluded)).collect();
    assert_eq!(
        why,
        vec![
            (0, Some(Exclusion::Unhealthy)),
            (1, Some(Exclusion::Draining)),
            (2, Some(Exclusion::BreakerOpen))
        ]
    );
    assert_eq!(f.out.admissible().len(), 1);
    f.state(3).record_failure(FailureClass::RateLimited, ms(5_000));
    let err = f.decide_with(CacheView::Untrusted(Untrusted::TokenizerFailed), ms(5_001));
    assert_eq!(err, Err(SchedError::NoneAdmissible));
    assert_eq!(f.out.admissible().len(), 0);
    assert_eq!(f.out.excluded().len(), 4, "the debug view still lists every holder");
    assert_eq!(
        f.out.excluded().nth(3).expect("nth").excluded,
        Some(Exclusion::CoolingDown(FailureClass::RateLimited))
    );
    // After the open period, the breaker lets trial requests through.
    f.decide_with(CacheView::Untrusted(Untrusted::TokenizerFailed), ms(70_000)).expect("half-open");
    assert!(f.out.admissible().any(|c| c.holder == h(2)));
}

#[test]
fn no_pool_for_unknown_model_or_role() {
    let mut f = Fixture::new(2, SchedConfig::default());
    let snap = f.cluster.load();
    let cache = CacheView::Untrusted(Untrusted::TokenizerFailed);
    let req = Request::new("other", Role::Regular, ms(0), 10, cache);
    assert_eq!(f.sched.decide(&snap, &req, &mut f.out), Err(SchedError::NoPool));
    let req = Request::new(MODEL, Role::Prefill, ms(0), 10, cache);
    assert_eq!(f.sched.decide(&snap, &req, &mut f.out), Err(SchedError::NoPool));
}

#[test]
fn retry_takes_the_next_candidate_after_a_failure() {
    let mut f = Fixture::new(3, SchedConfig::default());
    f.hits(&[(h(2), 100), (h(0), 50)]);
    let snap = f.cluster.load();
    let ranked: Vec<Candidate> = f.decide().admissible().copied().collect();
    assert_eq!(ranked.iter().map(|c| c.holder).collect::<Vec<_>>(), vec![h(2), h(0), h(1)]);
    let b = snap.book(&ranked[0], ms(10)).expect("book");
    b.fail(FailureClass::ServerError, ms(20));
    assert!(!snap.admissible(ranked[0].holder, ms(21)), "cooling down now");
    let next = ranked[1..].iter().find(|c| snap.admissible(c.holder, ms(21))).expect("next");
    assert_eq!(next.holder, h(0));
    let b = snap.book(next, ms(21)).expect("book");
    let load = f.state(0).rank_load(DpRank(0), ms(21)).expect("rank");
    assert_eq!((load.booked_requests, load.booked_prefill_tokens), (1, u64::from(PROMPT - 800)));
    drop(b);
    assert_eq!(f.state(0).rank_load(DpRank(0), ms(21)).expect("rank").booked_requests, 0);
    assert_eq!(f.state(2).rank_load(DpRank(0), ms(21)).expect("rank").booked_requests, 0);
}

// ---------------------------------------------------------------------------------------------
// Data-parallel ranks

#[test]
fn dp_ranks_are_candidates_of_their_own() {
    let spec = WorkerSpec { dp_size: 4, ..WorkerSpec::new(WorkerId(7), MODEL, Engine::Sglang) };
    let mut f =
        Fixture::with_specs(vec![spec, WorkerSpec::new(WorkerId(8), MODEL, Engine::Sglang)], no_bound());
    let r7 = |r| HolderId::new(WorkerId(7), DpRank(r));
    // A hit on rank 2 names (worker 7, rank 2).
    f.hits(&[(r7(2), 64)]);
    assert_eq!(f.first(), r7(2));
    assert_eq!(f.out.admissible().len(), 5);
    // Without a hit, the least-loaded rank; a booking lands on that rank only.
    f.load(r7(0), 2, 0).load(r7(1), 1, 0).load(r7(2), 1, 0).load(r7(3), 1, 0).load(h(8), 3, 0).hits(&[]);
    f.decide();
    let first = *f.out.first().expect("first");
    assert!([r7(1), r7(2), r7(3)].contains(&first.holder));
    let snap = f.cluster.load();
    let b = snap.book(&first, ms(10)).expect("book");
    assert_eq!(f.state(7).rank_load(first.holder.rank, ms(10)).expect("rank").booked_requests, 2);
    assert_eq!(f.state(7).rank_load(DpRank(0), ms(10)).expect("rank").booked_requests, 2);
    drop(b);
    // A rank whose ledger is syncing gets no credit while its siblings do.
    f.state(7).set_ledger(DpRank(3), LedgerState::Syncing);
    f.hits(&[(r7(3), 100), (r7(1), 10)]);
    assert_eq!(f.first(), r7(1));
}

// ---------------------------------------------------------------------------------------------
// Policies

fn with_policy(p: PolicyConfig) -> SchedConfig {
    SchedConfig { pools: PoolPolicies { regular: p, prefill: p, decode: p }, ..SchedConfig::default() }
}

#[test]
fn round_robin_cycles_over_admissible() {
    let mut f = Fixture::new(3, with_policy(PolicyConfig::RoundRobin));
    f.cluster.set_health(WorkerId(1), Health::Unhealthy);
    f.hits(&[(h(2), 100)]);
    let firsts: Vec<u32> = (0..4).map(|_| f.first().worker.0).collect();
    assert_eq!(firsts, vec![0, 2, 0, 2]);
    assert_eq!(f.out.policy(), PolicyKind::RoundRobin);
    assert_eq!((f.out.mode(), f.out.reason()), (MatchMode::FallbackRoundRobin, Some(FallbackReason::Policy)));
    assert_eq!(f.out.cache_hit_tokens(), 0, "round robin never reads the overlap");
}

#[test]
fn random_spreads_evenly() {
    let mut f = Fixture::new(4, with_policy(PolicyConfig::Random));
    let mut counts = [0u32; 4];
    for _ in 0..4000 {
        counts[f.first().worker.0 as usize] += 1;
    }
    assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
}

#[test]
fn power_of_two_never_picks_the_worse_of_its_pair() {
    let mut f = Fixture::new(4, with_policy(PolicyConfig::PowerOfTwo));
    f.load(h(1), 5, 0).load(h(2), 10, 0).load(h(3), 15, 0);
    let mut counts = [0u32; 4];
    for _ in 0..3000 {
        let r = f.decide();
        assert_eq!((r.mode(), r.reason()), (MatchMode::FallbackP2c, Some(FallbackReason::Policy)));
        let (a, b) = (r.admissible().next().expect("next"), r.admissible().nth(1).expect("nth"));
        assert!(a.active_requests <= b.active_requests);
        counts[a.holder.worker.0 as usize] += 1;
    }
    // P(w0 sampled) = 1/2, P(w1 best of its pair) = 1/3, P(w2) = 1/6, P(w3) = 0.
    assert_eq!(counts[3], 0);
    assert!((1350..1650).contains(&counts[0]) && (850..1150).contains(&counts[1]), "{counts:?}");
}

#[test]
fn least_load_is_load_only_and_bounded() {
    let mut f = Fixture::new(3, with_policy(PolicyConfig::LeastLoad));
    f.load(h(0), 3, 0).load(h(1), 1, 0).load(h(2), 2, 0).hits(&[(h(0), 128)]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(1));
    assert_eq!((r.mode(), r.reason()), (MatchMode::LoadAware, Some(FallbackReason::Policy)));
    assert!(r.all().all(|c| c.matched_tokens == 0));
}

#[test]
fn consistent_hashing_on_the_routing_key() {
    let mut f = Fixture::new(5, with_policy(PolicyConfig::ConsistentHashing));
    let snap = f.cluster.load();
    let pick = |f: &mut Fixture, snap: &Snapshot, key: &str| {
        let mut req =
            Request::new(MODEL, Role::Regular, ms(1), 10, CacheView::Untrusted(Untrusted::TokenizerFailed));
        req.routing_key = Some(key.as_bytes());
        f.sched.decide(snap, &req, &mut f.out).expect("ok");
        f.out.first().expect("first").holder
    };
    let keys: Vec<String> = (0..200).map(|i| format!("user-{i}")).collect();
    let before: Vec<HolderId> = keys.iter().map(|k| pick(&mut f, &snap, k)).collect();
    assert_eq!(before, keys.iter().map(|k| pick(&mut f, &snap, k)).collect::<Vec<_>>(), "stable");
    let mut per = [0; 5];
    for b in &before {
        per[b.worker.0 as usize] += 1;
    }
    assert!(per.iter().all(|&n| n > 20), "{per:?}");
    // Removing a worker moves only its own keys.
    f.cluster.remove(WorkerId(3));
    let snap2 = f.cluster.load();
    for (k, b) in keys.iter().zip(&before) {
        let a = pick(&mut f, &snap2, k);
        if b.worker != WorkerId(3) {
            assert_eq!(a, *b, "{k} moved");
        }
    }
    // No key: round robin, and said so.
    f.decide_with(CacheView::Untrusted(Untrusted::TokenizerFailed), ms(1)).expect("ok");
    assert_eq!(f.out.reason(), Some(FallbackReason::NoRoutingKey));
}

#[test]
fn manual_sticks_until_idle_or_gone() {
    let m = ManualConfig { max_idle: Duration::from_secs(60), assignment: Assignment::MinLoad };
    let mut f = Fixture::new(3, with_policy(PolicyConfig::Manual(m)));
    f.load(h(0), 2, 0).load(h(2), 1, 0);
    let pick = |f: &mut Fixture, t: Timestamp| {
        let snap = f.cluster.load();
        let mut req =
            Request::new(MODEL, Role::Regular, t, 10, CacheView::Untrusted(Untrusted::TokenizerFailed));
        req.routing_key = Some(b"session-42");
        f.sched.decide(&snap, &req, &mut f.out).expect("ok");
        f.out.first().expect("first").holder
    };
    assert_eq!(pick(&mut f, ms(0)), h(1), "assigned to the least loaded");
    f.load(h(1), 5, 0);
    assert_eq!(pick(&mut f, ms(30_000)), h(1), "sticky despite load");
    assert_eq!(pick(&mut f, ms(89_000)), h(1), "used 59 s ago");
    // Idle beyond max_idle: reassigned by load.
    assert_eq!(pick(&mut f, ms(150_000)), h(2));
    // Holder gone unhealthy: reassigned.
    f.cluster.set_health(WorkerId(2), Health::Unhealthy);
    assert_eq!(pick(&mut f, ms(150_001)), h(0));
    assert_eq!(f.sched.sweep_sticky(ms(150_002)), 0);
    assert_eq!(f.sched.sticky_assignments(), 1);
    assert_eq!(f.sched.sweep_sticky(ms(300_000)), 1);
    assert_eq!(f.sched.sticky_assignments(), 0);
}

#[test]
fn prefix_hash_is_sticky_per_prefix_and_bounded() {
    let cfg = PrefixHashConfig { prefix_blocks: 4, bound: BoundedLoad { epsilon: 0.25 } };
    let mut f = Fixture::new(4, with_policy(PolicyConfig::PrefixHash(cfg)));
    let chain = |group: u64, len: u64| -> Vec<SeqHash> {
        (0..len).map(|i| SeqHash::from_bits(if i < 4 { group * 1000 + i } else { 7_000_000 + i })).collect()
    };
    let pick = |f: &mut Fixture, prefix: &[SeqHash]| {
        let snap = f.cluster.load();
        let mut req =
            Request::new(MODEL, Role::Regular, ms(1), 10, CacheView::Untrusted(Untrusted::TokenizerFailed));
        req.prefix = prefix;
        f.sched.decide(&snap, &req, &mut f.out).expect("ok");
        f.out.first().expect("first").holder
    };
    let a = pick(&mut f, &chain(1, 10));
    assert_eq!(pick(&mut f, &chain(1, 6)), a, "same 4 leading blocks, same holder");
    assert_eq!((f.out.mode(), f.out.reason()), (MatchMode::LoadAware, Some(FallbackReason::Policy)));
    let spread: std::collections::HashSet<_> = (0..40).map(|g| pick(&mut f, &chain(g, 5))).collect();
    assert_eq!(spread.len(), 4);
    // Load the holder beyond the bound: the next holder in the prefix's order takes it.
    f.load(a, 5, 0);
    let b = pick(&mut f, &chain(1, 10));
    assert_ne!(b, a);
    assert_eq!(f.out.excluded().next().expect("next").excluded, Some(Exclusion::BoundedLoad { cap: 2 }));
    // No full block: least load, and said so.
    assert_ne!(pick(&mut f, &[]), a);
    assert_eq!(f.out.reason(), Some(FallbackReason::NoPrefix));
}

#[test]
fn prefill_and_decode_pools_use_their_own_policies() {
    let specs = (0..4)
        .map(|i| WorkerSpec {
            role: if i < 2 { Role::Prefill } else { Role::Decode },
            ..WorkerSpec::new(WorkerId(i), MODEL, Engine::Sglang)
        })
        .collect();
    let mut f = Fixture::with_specs(specs, SchedConfig::default());
    f.hits(&[(h(1), 100), (h(3), 100)]);
    let overlap = f.overlap.clone();
    let snap = f.cluster.load();
    let cache = CacheView::Overlap { scores: &overlap, block_tokens: BLOCK };
    f.sched.decide(&snap, &Request::new(MODEL, Role::Prefill, ms(1), PROMPT, cache), &mut f.out).expect("ok");
    assert_eq!((f.out.policy(), f.out.mode()), (PolicyKind::CacheAware, MatchMode::ExactKvEvents));
    assert_eq!(f.out.first().expect("first").holder, h(1));
    assert_eq!(f.out.all().len(), 2, "only the prefill pool");
    // The decode pool is cache-aware by default too: the decode worker holding the prefix
    // would pull less of it.
    f.sched.decide(&snap, &Request::new(MODEL, Role::Decode, ms(1), PROMPT, cache), &mut f.out).expect("ok");
    assert_eq!((f.out.policy(), f.out.mode()), (PolicyKind::CacheAware, MatchMode::ExactKvEvents));
    assert_eq!(f.out.first().expect("first").holder, h(3));
    assert!(f.out.all().all(|c| c.holder.worker.0 >= 2));
    // Each pool under its own policy: power-of-two decode ignores the cache.
    let pools = PoolPolicies { decode: PolicyConfig::PowerOfTwo, ..PoolPolicies::default() };
    let sched = Scheduler::new(SchedConfig { pools, ..SchedConfig::default() }).expect("config");
    sched.decide(&snap, &Request::new(MODEL, Role::Decode, ms(1), PROMPT, cache), &mut f.out).expect("ok");
    assert_eq!((f.out.policy(), f.out.mode()), (PolicyKind::PowerOfTwo, MatchMode::FallbackP2c));
    assert!(f.out.all().all(|c| c.holder.worker.0 >= 2 && c.matched_tokens == 0));
}

/// A decode holder computes none of the prompt: what it lacks is pulled from the prefill worker
/// at the transfer's speed. So a saved pull weighs little against the requests a decode worker
/// is running (each lengthens its every step), and a short shared prefix does not pile requests
/// onto the one decode worker that holds it.
#[test]
fn a_decode_pool_prices_what_its_holders_lack_at_the_transfer_speed() {
    let specs: Vec<WorkerSpec> = (0..2)
        .map(|i| WorkerSpec { role: Role::Decode, ..WorkerSpec::new(WorkerId(i), MODEL, Engine::Vllm) })
        .collect();
    let decide = |transfer_tokens_per_sec: u32| {
        let config = SchedConfig { transfer_tokens_per_sec, ..no_bound() };
        let mut f = Fixture::with_specs(specs.clone(), config);
        // w0 holds a 128-token system prompt and runs 6 requests; w1 holds nothing and is idle.
        f.load(h(0), 6, 0).hits(&[(h(0), 8)]);
        let overlap = f.overlap.clone();
        let snap = f.cluster.load();
        let cache = CacheView::Overlap { scores: &overlap, block_tokens: BLOCK };
        f.sched.decide(&snap, &Request::new(MODEL, Role::Decode, ms(1), 192, cache), &mut f.out).expect("ok");
        let first = *f.out.first().expect("first");
        let w1 = *f.out.all().find(|c| c.holder == h(1)).expect("w1");
        (first.holder, w1)
    };
    // At 200,000 tokens/s the 128 tokens w0 saves are 0.64 ms; its 6 requests, 3 ms: w1.
    let (first, w1) = decide(200_000);
    assert_eq!(first, h(1));
    assert!((w1.rate_tokens_per_sec - 200_000.0).abs() < 1.0, "{w1:?}");
    assert!((w1.est_ttft_ms - 192.0 / 200.0).abs() < 0.01, "the pull alone, no overhead: {w1:?}");
    // Priced like a prefill (10,000 tokens/s: 12.8 ms saved), w0 would have it.
    assert_eq!(decide(10_000).0, h(0));
}

#[test]
fn a_decode_holder_the_request_would_overfill_is_passed_over_while_another_has_room() {
    // Two decode workers of 100 KV blocks; the first holds the prompt's first 10 blocks.
    let specs = (0..2)
        .map(|i| WorkerSpec {
            role: Role::Decode,
            capacity: Capacity { kv_blocks: 100, ..Capacity::default() },
            ..WorkerSpec::new(WorkerId(i), MODEL, Engine::Sglang)
        })
        .collect();
    let mut f = Fixture::with_specs(specs, SchedConfig::default());
    f.hits(&[(h(0), 10)]);
    let overlap = f.overlap.clone();
    let snap = f.cluster.load();
    let cache = CacheView::Overlap { scores: &overlap, block_tokens: BLOCK };
    let request =
        |kv_blocks| Request { kv_blocks, ..Request::new(MODEL, Role::Decode, ms(1), PROMPT, cache) };
    // 70 of its blocks are held by a request in flight there.
    let held = snap.book_holder(h(0), 0, 70, ms(0)).expect("book");
    // A request of 20 blocks fits beside it: the prefix wins.
    f.sched.decide(&snap, &request(20), &mut f.out).expect("ok");
    assert_eq!(f.out.first().expect("first").holder, h(0));
    assert_eq!(f.out.first().expect("first").kv_committed, 70);
    // One of 40 fits too: its first 10 blocks are the cached prefix, which takes no room.
    f.sched.decide(&snap, &request(40), &mut f.out).expect("ok");
    assert_eq!((f.out.first().expect("first").holder, f.out.excluded().count()), (h(0), 0));
    assert_eq!(f.out.first().expect("first").kv_blocks, 30);
    // One of 45 would overfill it (the engine would queue it or preempt): the other takes it.
    f.sched.decide(&snap, &request(45), &mut f.out).expect("ok");
    assert_eq!(f.out.first().expect("first").holder, h(1));
    let full = f.out.excluded().next().expect("excluded");
    assert_eq!((full.holder, full.excluded), (h(0), Some(Exclusion::KvFull)));
    // Without a size (no output limit known, no tokens), nothing is excluded.
    f.sched.decide(&snap, &request(0), &mut f.out).expect("ok");
    assert_eq!(f.out.first().expect("first").holder, h(0));
    // When no holder has room, none is excluded and the policy decides.
    let other = snap.book_holder(h(1), 0, 70, ms(0)).expect("book");
    f.sched.decide(&snap, &request(45), &mut f.out).expect("ok");
    assert_eq!(f.out.excluded().count(), 0);
    assert_eq!(f.out.first().expect("first").holder, h(0));
    // A request larger than a holder's whole cache books no more than that cache (70 + 100).
    let mut c = *f.out.all().find(|c| c.holder == h(1)).expect("h(1)");
    (c.kv_blocks, c.prefill_tokens, c.queue_tokens) = (u32::MAX, 0, 0);
    let huge = snap.book(&c, ms(0)).expect("book");
    let rank = snap.worker(WorkerId(1)).expect("w").state().rank_load(DpRank(0), ms(0)).expect("rank");
    assert_eq!(rank.booked_kv_blocks, 170);
    drop(huge);
    // The booking frees its blocks when the request ends.
    drop((held, other));
    f.sched.decide(&snap, &request(45), &mut f.out).expect("ok");
    assert_eq!((f.out.first().expect("first").holder, f.out.excluded().count()), (h(0), 0));
    // Load-only decode checks the room too, with the whole request (it ignores the cache).
    let pools = PoolPolicies { decode: PolicyConfig::LeastLoad, ..PoolPolicies::default() };
    let least = Scheduler::new(SchedConfig { pools, ..SchedConfig::default() }).expect("config");
    let _held = snap.book_holder(h(1), 0, 70, ms(0)).expect("book");
    let _small = [0, 1].map(|_| snap.book_holder(h(0), 0, 1, ms(0)).expect("book"));
    least.decide(&snap, &request(0), &mut f.out).expect("ok");
    assert_eq!(f.out.first().expect("first").holder, h(1), "the least loaded");
    least.decide(&snap, &request(40), &mut f.out).expect("ok");
    assert_eq!(f.out.first().expect("first").holder, h(0), "h(1) is less loaded, but only h(0) has room");
    // `cache_aware_v1` without load reports falls back to rotating, which checks the room too.
    let pools = PoolPolicies { decode: PolicyConfig::CacheAwareV1, ..PoolPolicies::default() };
    let signals = LoadSignals::EngineReports { max_age: Duration::from_secs(1) };
    let v1 = Scheduler::new(SchedConfig { pools, load_signals: signals, ..SchedConfig::default() })
        .expect("config");
    for _ in 0..4 {
        v1.decide(&snap, &request(40), &mut f.out).expect("ok");
        assert_eq!(f.out.first().expect("first").holder, h(0), "{:?}", f.out.mode());
    }
    // The regular pool is left to the time estimate (its queue is in the engine's report).
    let regular = Fixture::new(2, SchedConfig::default()).cluster.load();
    let r = Request { kv_blocks: 1_000_000, ..Request::new(MODEL, Role::Regular, ms(1), PROMPT, cache) };
    f.sched.decide(&regular, &r, &mut f.out).expect("ok");
    assert_eq!(f.out.excluded().count(), 0);
}

/// A custom scorer: prefers the highest worker id, ignoring everything else.
struct HighestId;

impl Scorer for HighestId {
    fn score(&self, i: &ScoreInput) -> Score {
        let total = i.holder.worker.0 as f32;
        Score { total, ..Score::default() }
    }
}

#[test]
fn the_scorer_is_the_seam_and_cannot_bypass_the_filter() {
    let cluster = Cluster::new(HealthPolicy::default());
    for i in 0..3 {
        cluster.upsert(WorkerSpec::new(WorkerId(i), MODEL, Engine::Sglang), Health::Healthy);
    }
    let sched = Scheduler::with_scorer(SchedConfig::default(), HighestId).expect("config");
    let mut out = Ranking::with_capacity(3);
    let req = Request::new(MODEL, Role::Regular, ms(0), 10, CacheView::Untrusted(Untrusted::TokenizerFailed));
    sched.decide(&cluster.load(), &req, &mut out).expect("ok");
    assert_eq!(out.admissible().map(|c| c.holder.worker.0).collect::<Vec<_>>(), vec![2, 1, 0]);
    cluster.set_health(WorkerId(2), Health::Unhealthy);
    sched.decide(&cluster.load(), &req, &mut out).expect("ok");
    assert_eq!(out.first().expect("first").holder, h(1));
}

#[test]
fn the_first_ranked_are_in_order_and_sort_all_orders_the_rest() {
    let n = 40u32;
    let mut f = Fixture::new(n, no_bound());
    // Worker w has (w * 7) % 40 bookings: all distinct, so the load order is strict.
    for w in 0..n {
        f.load(h(w), (w * 7) % n, 0);
    }
    f.hits(&[]);
    f.decide();
    let loads = |r: &Ranking| r.admissible().map(|c| c.booked_requests).collect::<Vec<_>>();
    let got = loads(&f.out);
    assert_eq!(got.len(), n as usize);
    assert_eq!(&got[..RANKED], &(0..RANKED as u32).collect::<Vec<_>>()[..]);
    assert!(got[RANKED..].iter().all(|&l| l >= RANKED as u32), "the rest are all worse");
    f.out.sort_all();
    assert_eq!(loads(&f.out), (0..n).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// cache_aware: time to first token

/// A ranking that does not explain itself decides the same: every candidate, the order, the
/// mode and the reason, with the score's terms left at zero and its total the same.
#[test]
fn a_decision_explained_or_not_is_the_same_decision() {
    for config in [SchedConfig::default(), v1(SchedConfig::default())] {
        // A second scheduler of the same seed: the same tie-break rotation.
        let twin = Scheduler::new(config).expect("valid config");
        let mut f = Fixture::new(6, config);
        f.hits(&[(h(2), 100), (h(1), 10), (h(4), 60)]).load(h(2), 2, 900).load(h(0), 1, 300);
        let explained = f.decide().clone();
        let mut plain = Ranking::with_capacity(64);
        let overlap = std::mem::take(&mut f.overlap);
        let snap = f.cluster.load();
        let req = Request::new(
            MODEL,
            Role::Regular,
            ms(10),
            PROMPT,
            CacheView::Overlap { scores: &overlap, block_tokens: BLOCK },
        );
        twin.decide(&snap, &req, &mut plain).expect("a candidate");
        assert_eq!((plain.mode(), plain.reason()), (explained.mode(), explained.reason()));
        let (a, b): (Vec<_>, Vec<_>) = (explained.admissible().collect(), plain.admissible().collect());
        assert_eq!(a.len(), b.len());
        assert!(a.iter().any(|c| c.score.affinity != 0.0) && a.iter().any(|c| c.score.load != 0.0), "{a:?}");
        for (e, p) in a.iter().zip(&b) {
            assert_eq!(p.score, Score { total: e.score.total, ..Score::default() }, "{p:?}");
            let mut same = **p;
            same.score = e.score;
            assert_eq!(same, **e);
        }
    }
}

/// Equal queues: the holder with the longest exact hit has the least to prefill, so the
/// shortest estimated TTFT; the breakdown is in milliseconds at the prior (10,000 tokens/s).
#[test]
fn time_the_longest_hit_is_the_shortest_ttft() {
    let mut f = Fixture::new(4, SchedConfig::default());
    f.hits(&[(h(2), 100), (h(1), 10)]);
    let r = f.decide();
    assert_eq!((r.mode(), r.reason(), r.policy()), (MatchMode::ExactKvEvents, None, PolicyKind::CacheAware));
    let c = r.first().expect("first");
    assert_eq!((c.holder, c.matched_tokens, c.prefill_tokens, c.queue_tokens), (h(2), 1600, 448, 0));
    // 10 ms of overhead, then 448 tokens at 10,000 tokens/s.
    assert!((c.est_ttft_ms - 54.8).abs() < 0.01, "{c:?}");
    assert!((c.score.affinity - 160.0).abs() < 0.01, "1,600 tokens saved = 160 ms: {c:?}");
    assert!((c.rate_tokens_per_sec - 10_000.0).abs() < 1.0);
    assert_eq!(r.admissible().nth(1).expect("second").holder, h(1));
}

/// A hot holder's queue is worth waiting for only while it is shorter than recomputing the
/// prefix elsewhere: an idle worker that holds nothing takes the request once it is not.
#[test]
fn time_a_queue_longer_than_the_recompute_sends_the_request_to_an_idle_worker() {
    let mut f = Fixture::new(2, no_bound());
    // w0 holds 1,600 of the 2,048 prompt tokens; 1,000 tokens are queued ahead on it.
    f.load(h(0), 1, 1_000).hits(&[(h(0), 100)]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(0), "1,448 tokens of work beat 2,048");
    assert_eq!(r.mode(), MatchMode::ExactKvEvents);
    // 4,000 tokens queued: 4,448 tokens of wait on w0 plus the 448 it would add (the default
    // `recompute_weight` of 1) lose to 2,048 plus 2,048 on the idle w1.
    f.load(h(0), 1, 3_000);
    let r = f.decide();
    assert_eq!((r.first().expect("first").holder, r.mode()), (h(1), MatchMode::LoadAware));
    assert_eq!(r.reason(), Some(FallbackReason::HitOverruled));
}

/// Engine reports are the queue, and this gateway's bookings since the report are added:
/// SGLang reports waiting uncached tokens; vLLM reports waiting requests, sized at the mean
/// prefill of this gateway's requests there.
#[test]
fn time_the_queue_is_the_report_plus_what_was_sent_since() {
    let mut f = Fixture::new(2, engine_reports());
    f.load(h(0), 2, 300); // booked before the report: the report covers them
    let sglang = EngineLoad {
        running: 1,
        waiting: 3,
        waiting_prefill_tokens: Some(900),
        kv_usage: 0.2,
        prefill_totals: None,
    };
    assert!(f.state(0).report_load(DpRank(0), sglang, ms(5)));
    f.load(h(0), 1, 250); // after the report: added
    f.hits(&[]);
    let w0 = *f.decide().all().find(|c| c.holder == h(0)).expect("w0");
    assert_eq!(w0.queue_tokens, 900 + 250);
    // vLLM: 4 waiting requests × the mean booked prefill here (300, 300, 250 → 283).
    let vllm = EngineLoad {
        running: 1,
        waiting: 4,
        waiting_prefill_tokens: None,
        kv_usage: 0.2,
        prefill_totals: None,
    };
    assert!(f.state(0).report_load(DpRank(0), vllm, ms(6)));
    let w0 = *f.decide().all().find(|c| c.holder == h(0)).expect("w0");
    assert_eq!(
        w0.queue_tokens,
        4 * 283,
        "since-report bookings reset with the report; own bookings are less"
    );
    // No fresh report (w1): its own outstanding bookings, and no degradation.
    f.load(h(1), 1, 700);
    let r = f.decide();
    let w1 = *r.all().find(|c| c.holder == h(1)).expect("w1");
    assert_eq!((w1.queue_tokens, w1.load_reported), (700, false));
    assert_eq!(r.mode(), MatchMode::LoadAware);
}

/// Teaches `w`'s learner `samples` streaming first chunks at `overhead_ms` plus a token per
/// `1 / tokens_per_ms` ms, one request a second, works from 200 to 3,700 tokens.
fn train(snap: &Snapshot, w: u32, samples: u64, overhead_ms: f64, tokens_per_ms: f64) {
    for i in 0..samples {
        let prefill = 200 + (i % 8) as u32 * 500;
        let mut b = snap.book_holder(h(w), prefill, 0, ms(1_000 * i)).expect("book");
        let took = overhead_ms + f64::from(prefill) / tokens_per_ms;
        b.first_output(Timestamp::from_nanos(1_000_000_000 * i + (took * 1e6) as u64));
        b.succeed(ms(1_000 * i + 900));
    }
}

/// What the engine does teaches the estimate: streaming first chunks that come 8× slower than
/// the prior make the holder's estimated TTFT follow, and a faster holder wins.
#[test]
fn time_first_chunks_teach_each_holder_its_speed() {
    let mut f = Fixture::new(2, no_bound());
    let snap = f.cluster.load();
    // w0's first chunks: 1,250 tokens/s and 20 ms of overhead (the prior says 10,000 and 10 ms).
    train(&snap, 0, 64, 20.0, 1.25);
    let learned = f.state(0).rank_load(DpRank(0), ms(0)).expect("rank").estimate;
    assert!((learned.rate() / 1_250.0 - 1.0).abs() < 0.05, "{learned:?}");
    assert!((learned.overhead_s - 0.02).abs() < 0.005, "{learned:?}");
    assert_eq!(f.state(0).learned_samples(DpRank(0)), 64);
    // A non-streaming first byte teaches nothing.
    let mut b = snap.book_holder(h(1), 100, 0, ms(0)).expect("book");
    b.first_token(ms(5_000));
    drop(b);
    assert_eq!(f.state(1).learned_samples(DpRank(0)), 0);
    // w1's first chunks: 10,000 tokens/s and 10 ms (an untrained holder would be priced at w0's
    // line, its pool's only learned one).
    train(&snap, 1, 16, 10.0, 10.0);
    // w0 holds half the prompt but is 8× slower: w1 recomputes it all faster.
    f.hits(&[(h(0), 64)]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(1));
    let w0 = r.all().find(|c| c.holder == h(0)).expect("w0");
    assert!(w0.est_ttft_ms > 800.0 && (w0.rate_tokens_per_sec - 1_250.0).abs() < 70.0, "{w0:?}");
}

/// A holder the pool has not measured yet is estimated at the mean line of the holders it has
/// measured, not at the configured prior: a worker added to a pool whose workers all run 10×
/// faster than the prior would otherwise look 10× slower, and at low load never be tried.
#[test]
fn time_an_untrained_holder_is_estimated_at_its_pool_s_learned_line() {
    let mut f = Fixture::new(3, no_bound());
    let snap = f.cluster.load();
    // w0 and w1: 100,000 tokens/s and 1 ms of overhead (the prior says 10,000 and 10 ms).
    train(&snap, 0, 64, 1.0, 100.0);
    train(&snap, 1, 64, 1.0, 100.0);
    // One request each in flight on w0 and w1: w2, idle, is the faster choice — but only if
    // it is not priced at the prior (10 ms + 2,048 × 100 µs = 215 ms against about 32 ms).
    f.load(h(0), 1, 1_000).load(h(1), 1, 1_000).hits(&[]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(2), "{:#?}", r.all().collect::<Vec<_>>());
    let w2 = r.all().find(|c| c.holder == h(2)).expect("w2");
    assert!((w2.rate_tokens_per_sec / 100_000.0 - 1.0).abs() < 0.05, "{w2:?}");
    assert!(w2.est_ttft_ms > 15.0 && w2.est_ttft_ms < 30.0, "{w2:?}");
    // Its own samples take over once it has enough: w2 turns out 4× slower than the others.
    train(&f.cluster.load(), 2, 64, 1.0, 25.0);
    f.hits(&[]);
    let r = f.decide();
    let w2 = r.all().find(|c| c.holder == h(2)).expect("w2");
    assert!((w2.rate_tokens_per_sec / 25_000.0 - 1.0).abs() < 0.05, "{w2:?}");
    assert_ne!(r.first().expect("first").holder, h(2));
}

/// A holder whose line came out slow (here: first chunks that took 200 ms more, a stall) is not
/// chosen, so it takes no sample that could correct the line. Not booked for `STARVED_AFTER`
/// while its pool's others are, it forgets the line and is priced at its pool's line again; an
/// idle pool (nobody booked) forgets nothing; and a holder forgotten again waits twice as long.
#[test]
fn time_a_holder_starved_by_a_slow_line_is_priced_at_its_pool_s_line_again() {
    let after = cortex_sched::learn::STARVED_AFTER;
    let s = |secs: u64| ms(secs * 1_000);
    let mut f = Fixture::new(3, no_bound());
    let snap = f.cluster.load();
    // The last bookings come at 63 s.
    train(&snap, 0, 64, 1.0, 100.0);
    train(&snap, 1, 64, 1.0, 100.0);
    train(&snap, 2, 64, 200.0, 100.0);
    f.load(h(0), 1, 1_000).load(h(1), 1, 1_000).hits(&[]);
    assert_ne!(f.first(), h(2), "its slow line keeps it out");
    // The sweep notes the bookings as it goes (the first look counts as one).
    assert_eq!(snap.forget_starved(s(64), after), 0);
    // An idle pool: nobody booked since, nobody forgets.
    assert_eq!(snap.forget_starved(s(90), after), 0);
    // w0 is booked again; w2 (and w1, booked no more than it) forget their lines.
    let book = |w: u32, at: Timestamp| {
        let mut b = snap.book_holder(h(w), 200, 0, at).expect("book");
        b.first_output(at.saturating_add(Duration::from_millis(3)));
        b.succeed(at.saturating_add(Duration::from_millis(10)));
    };
    book(0, s(91));
    assert_eq!(snap.forget_starved(s(92), after), 2);
    assert_eq!(f.state(2).learned_samples(DpRank(0)), 0);
    assert_eq!(f.state(0).learned_samples(DpRank(0)), 65);
    // Priced at the pool's line (w0's), idle w2 is the faster choice now.
    f.hits(&[]);
    let r = f.decide();
    assert_eq!(r.first().expect("first").holder, h(2), "{:#?}", r.all().collect::<Vec<_>>());
    let w2 = r.all().find(|c| c.holder == h(2)).expect("w2");
    assert!((w2.rate_tokens_per_sec / 100_000.0 - 1.0).abs() < 0.05, "{w2:?}");
    // w2 turns out slow again (8 bookings at 93 s): starved again, it now waits 2 × 20 s.
    for _ in 0..8 {
        let mut b = snap.book_holder(h(2), 200, 0, s(93)).expect("book");
        b.first_output(s(93).saturating_add(Duration::from_millis(202)));
        b.succeed(s(94));
    }
    book(0, s(94));
    assert_eq!(snap.forget_starved(s(95), after), 0, "w2 was just booked");
    for t in [110, 120, 130] {
        book(0, s(t));
        snap.forget_starved(s(t), after);
        assert_eq!(f.state(2).learned_samples(DpRank(0)), 8, "at {t} s: within twice the wait");
    }
    book(0, s(140));
    snap.forget_starved(s(140), after);
    assert_eq!(f.state(2).learned_samples(DpRank(0)), 0, "past twice the wait");
}

/// A worker joining (or rejoining) an idle pool does not make it busy: its first look only starts
/// its clock, so the trained holders of the pool keep their lines.
#[test]
fn time_a_worker_joining_an_idle_pool_makes_nobody_forget() {
    let after = cortex_sched::learn::STARVED_AFTER;
    let s = |secs: u64| ms(secs * 1_000);
    let f = Fixture::new(2, no_bound());
    train(&f.cluster.load(), 0, 64, 1.0, 100.0);
    train(&f.cluster.load(), 1, 64, 1.0, 100.0);
    assert_eq!(f.cluster.load().forget_starved(s(64), after), 0);
    assert_eq!(f.cluster.load().forget_starved(s(120), after), 0, "idle");
    f.cluster.upsert(WorkerSpec::new(WorkerId(2), MODEL, Engine::Sglang), Health::Healthy);
    assert_eq!(f.cluster.load().forget_starved(s(121), after), 0, "a joining worker is no booking");
    assert_eq!(f.state(0).learned_samples(DpRank(0)), 64);
}

/// `recompute_weight` charges a copy by how full the target's cache is: an empty cache evicts
/// nothing, so a worker with room takes a request a full one would only take with its queue.
#[test]
fn time_a_copy_into_an_empty_cache_costs_no_recompute_weight() {
    let cap = Capacity { kv_blocks: 1_000, ..Capacity::default() };
    let specs =
        (0..2).map(|i| WorkerSpec { capacity: cap, ..WorkerSpec::new(WorkerId(i), MODEL, Engine::Sglang) });
    let mut f = Fixture::with_specs(specs.collect(), no_bound());
    // w0: full, holds 1,600 of the 2,048 tokens, 2,000 queued: 2,000 + 448 + 448 = 2,896.
    f.state(0).set_cached_blocks(DpRank(0), 1_000);
    f.load(h(0), 1, 2_000).hits(&[(h(0), 100)]);
    // w1 empty: 2,048 and nothing to evict.
    f.state(1).set_cached_blocks(DpRank(0), 0);
    assert_eq!(f.first(), h(1));
    // w1 full as well: 2,048 + 2,048 = 4,096 against 2,896.
    f.state(1).set_cached_blocks(DpRank(0), 1_000);
    f.hits(&[(h(0), 100)]);
    assert_eq!(f.first(), h(0));
}
