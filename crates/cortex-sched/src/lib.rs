//! `cortex-sched`: the scheduler — cluster snapshot, per-worker state, and the locality-versus-load
//! decision. It never sees HTTP types: the proxy extracts the facts of a request, asks for a
//! ranking, books the first candidate and takes the next on retry.
//!
//! Choosing "the worker with the most cached tokens" alone piles traffic onto hot workers (SGLang
//! issue #21199: a cache-aware router 2.6× worse than round-robin on one shared prefix); ignoring
//! the cache wastes GPUs. This crate weighs the two, per request, in about a microsecond, and
//! explains its choice.
//!
//! # Key decisions
//!
//! - **Snapshot plus fast state** ([`cluster`], [`state`]; the Pixiu cluster-runtime RFC). The
//!   membership and health of the workers form an immutable [`Snapshot`] published with one atomic
//!   pointer swap ([`Cluster::load`] is lock-free and allocation-free) and rebuilt only when
//!   membership or health changes. Everything that changes per request — bookings, engine load
//!   reports, ledger readiness, cooldowns, the circuit breaker — is atomics in a
//!   [`WorkerState`] the snapshot points to and that rebuilds inherit by worker id.
//! - **Bookings are RAII** ([`Booking`]): the request and its prefill tokens are booked at
//!   dispatch, prefill released at the first token, the request at completion or drop, so a
//!   cancelled or panicking request task cannot leak in-flight counts.
//! - **Failures are classified by the caller, acted on here** ([`FailureClass`]): request
//!   problems (context length, content policy) never cool a worker down; rate limits and quota
//!   cool it down; server errors and timeouts also count toward its circuit breaker.
//! - **Filter, then choose** ([`Scheduler::decide`]): health, cooldown, breaker and (optionally)
//!   ledger readiness exclude holders first; the pool's policy only orders what is left, so a
//!   custom [`Scorer`] or policy cannot route around them.
//! - **One degradation chain** ([`MatchMode`]): `exact_kv_events` → `load_aware` →
//!   `fallback_p2c` → `fallback_round_robin`, each decision with its [`FallbackReason`]. The caller
//!   says when it cannot trust the cache ([`Untrusted`]); the scheduler then never reads an
//!   overlap, and a holder whose ledger is not READY never gets credit: no guessed hit.
//! - **Locality against load, in time**: the default policy's [`TimeScorer`] ranks by each
//!   candidate's estimated time to first token — its learned fixed overhead, then the prefill
//!   work queued ahead (the engine's report plus this gateway's bookings since) and the request's
//!   own uncached tokens, at the holder's prefill speed learned online ([`learn`]) — so cache and
//!   load are weighed in one unit, with the prefill a request adds to a holder counted again
//!   (`recompute_weight`) and prefixes in flight credited where they are being prefilled
//!   ([`pending`]). A high watermark gives up affinity when the best holder is saturated; a load
//!   bound (consistent hashing with bounded loads) caps every holder at ⌈(1+ε)·mean⌉ of this
//!   gateway's requests in flight. `cache_aware_v1` keeps the first wave's
//!   [`WeightedScorer`], `α·matched_tokens − β·active_requests − γ·expected_queue_latency` in
//!   prompt tokens, whose queue latency is a per-rank *virtual prefill clock* at the configured
//!   rate.
//! - **A ranked, explained result in a lent buffer** ([`Ranking`]): every holder of the pool with
//!   its score breakdown and exclusion reason; data-parallel ranks are candidates of their own, so
//!   a decision names a (worker, rank). Only the first [`RANKED`] admissible candidates are put in
//!   order (what a proxy can use); [`Ranking::sort_all`] orders the rest for the debug view.
//!   Nothing on the default path allocates (a counting-allocator test checks it).
//! - **SGLang parity by name** ([`PolicyKind`]): `cache_aware`, `round_robin`, `random`,
//!   `power_of_two`, `least_load`, `consistent_hashing`, `manual`, `prefix_hash`; prefill, decode
//!   and regular pools each pick their own ([`PoolPolicies`]).
//! - **No clock inside**: every time-dependent call takes a [`Timestamp`], so tests and the
//!   simulation run on virtual time.
//!
//! # Per request
//!
//! ```
//! use cortex_hash::Engine;
//! use cortex_hash::kv::{DpRank, HolderId, WorkerId};
//! use cortex_radix::{Overlap, OverlapScores};
//! use cortex_sched::*;
//!
//! let cluster = Cluster::new(HealthPolicy::default());
//! for id in 0..2 {
//!     cluster.upsert(WorkerSpec::new(WorkerId(id), "qwen3", Engine::Sglang), Health::Healthy);
//!     let snap = cluster.load();
//!     snap.worker(WorkerId(id)).unwrap().state().set_ledger(DpRank(0), LedgerState::Ready);
//! }
//! let sched = Scheduler::new(SchedConfig::default()).unwrap();
//! let mut ranking = Ranking::with_capacity(8);
//!
//! // The proxy ran the ledger query; worker 1 holds the first 64 blocks of a 100-block prompt.
//! let mut overlap = OverlapScores::with_capacity(8);
//! overlap.begin(100);
//! let holder = HolderId::new(WorkerId(1), DpRank(0));
//! overlap.push(Overlap { holder, gpu_blocks: 64, any_tier_blocks: 64 });
//!
//! let now = Timestamp::from_millis(1);
//! let cache = CacheView::Overlap { scores: &overlap, block_tokens: 16 };
//! let req = Request::new("qwen3", Role::Regular, now, 1600, cache);
//! let snap = cluster.load();
//! sched.decide(&snap, &req, &mut ranking).unwrap();
//! assert_eq!(ranking.mode().as_str(), "exact_kv_events");
//! let first = ranking.first().unwrap();
//! assert_eq!((first.holder, first.matched_tokens), (holder, 1024));
//!
//! let mut booking = snap.book(first, now).unwrap(); // in flight: 1 request, 576 prefill tokens
//! booking.first_token(Timestamp::from_millis(30)); // prefill tokens released
//! booking.succeed(Timestamp::from_millis(900)); // request released, breaker told
//! ```
//!
//! On a failure before the first byte reached the client, the proxy classifies it, records it
//! through the booking (`booking.fail(FailureClass::RateLimited, now)`: cooldown, breaker) and
//! takes the next candidate of the same ranking that [`Snapshot::admissible`] still accepts (the
//! failure may have just cooled down a sibling rank's worker). Dropping a booking without an
//! outcome (client gone) releases it without blaming the worker. A disaggregated request decides
//! twice, with [`Role::Prefill`] and [`Role::Decode`], each pool under its own policy.

pub mod cluster;
pub mod config;
pub mod decision;
pub mod failure;
pub mod learn;
pub mod pending;
pub mod scheduler;
pub mod scorer;
pub mod state;
pub mod time;

pub use cluster::{Capacity, Cluster, Health, Role, Snapshot, WorkerEntry, WorkerSpec};
pub use config::{
    Assignment, BoundedLoad, ConfigError, HealthPolicy, LoadSignals, ManualConfig, PolicyConfig, PolicyKind,
    PoolPolicies, PrefixHashConfig, SchedConfig, UnknownPolicy, UnreadyHolders, Watermark, Weights,
};
pub use decision::{
    CacheView, Candidate, Exclusion, FallbackReason, MatchMode, Ranking, Request, Score, Untrusted,
};
pub use failure::{BreakerConfig, BreakerState, Cooldowns, FailureClass};
pub use learn::{Estimate, EstimateErrors, LogHistogram, RateFit};
pub use pending::PendingPrefixes;
pub use scheduler::{MAX_POOL_HOLDERS, RANKED, SchedError, Scheduler, TIME_BOUND_FLOOR};
pub use scorer::{ScoreInput, Scorer, TimeScorer, WeightedScorer};
pub use state::{Booking, EngineLoad, LedgerState, PrefillTotals, RankLoad, WorkerState};
pub use time::{MonotonicClock, Timestamp};
