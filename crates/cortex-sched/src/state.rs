//! Per-worker fast state: atomics the proxy and the ingest side update on every request, event or
//! report, and the scheduler reads on every decision — plus the [`Booking`] guard.
//!
//! Key decision (Pixiu cluster-runtime RFC): fast-changing state never lives in the immutable
//! snapshot. Each worker's [`WorkerState`] sits behind an `Arc` that the snapshot points to and
//! that a rebuild hands to the next snapshot when the worker id survives, so updating it is a few
//! atomic stores and never rebuilds anything; a removed worker's state dies when the last
//! snapshot or booking that references it does. Reads are `Relaxed` and may be torn across fields
//! (running from one report, waiting from the next): the scheduler uses them as estimates, as
//! Dynamo's load tracking does on purpose.
//!
//! Bookings are what this gateway itself put on a holder: a request and its prefill tokens are
//! booked at dispatch, the prefill tokens are released at the first token, the request at
//! completion. [`Booking`] is an RAII guard so the proxy cannot leak either: dropping it releases
//! whatever is still booked.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cortex_hash::kv::{DpRank, HolderId};

use crate::config::HealthPolicy;
use crate::failure::{BreakerState, FailureClass};
use crate::learn::{Estimate, EstimateErrors, RateFit, TRAINED_SAMPLES};
use crate::pending::{PendingKey, PendingPrefixes};
use crate::time::{Timestamp, duration_nanos};

/// The prior of a holder's fixed prefill overhead (one engine step's fixed cost and scheduling),
/// until its own first chunks teach it.
pub const PRIOR_OVERHEAD: Duration = Duration::from_millis(10);

/// What an engine reports it prefilled since it started (SGLang `/v1/loads`:
/// `total_prefill_uncached_tokens`, `total_prefill_busy_us`): the difference between two reports
/// is a sample of its prefill rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PrefillTotals {
    /// Uncached prompt tokens prefilled.
    pub uncached_tokens: u64,
    /// Time spent prefilling.
    pub busy: Duration,
}

/// What an engine last reported for one data-parallel rank (SGLang `/v1/loads` or its load PUB
/// socket, vLLM `/metrics`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct EngineLoad {
    /// Requests running in the engine's batch.
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Uncached prompt tokens waiting for prefill (SGLang `num_waiting_uncached_tokens`; `None`
    /// when the engine does not report it: vLLM reports waiting requests only).
    pub waiting_prefill_tokens: Option<u64>,
    /// Fraction of the KV cache in use, in [0, 1].
    pub kv_usage: f32,
    /// Cumulative prefill counters, when the engine reports them.
    pub prefill_totals: Option<PrefillTotals>,
}

/// The ledger state of one holder, as the ingest side last set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LedgerState {
    /// The event stream is complete and applied: the ledger's overlap for this holder is exact.
    Ready = 0,
    /// The holder is (re)building its ledger: it must not get cache credit.
    Syncing = 1,
    /// A gap or a silent publisher: the holder's ledger cannot be trusted.
    Stale = 2,
    /// Exact routing is off for this holder (misaligned profile, or no event stream).
    Disabled = 3,
}

impl LedgerState {
    /// Snake-case name for metrics labels and debug output.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            LedgerState::Ready => "ready",
            LedgerState::Syncing => "syncing",
            LedgerState::Stale => "stale",
            LedgerState::Disabled => "disabled",
        }
    }

    const fn code(self) -> u8 {
        self as u8
    }

    /// The state whose [`LedgerState::code`] is `c`. Only `code` writes the word, so its two low
    /// bits are the whole code: with the discriminants equal to the codes, the match compiles to
    /// the mask alone (a decision reads it for every holder).
    const fn from_code(c: u8) -> Self {
        match c & 3 {
            0 => LedgerState::Ready,
            1 => LedgerState::Syncing,
            2 => LedgerState::Stale,
            _ => LedgerState::Disabled,
        }
    }
}

/// A point-in-time read of one holder's load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankLoad {
    /// Requests this gateway booked and has not completed.
    pub booked_requests: u32,
    /// Prompt tokens this gateway booked whose first token has not arrived.
    pub booked_prefill_tokens: u64,
    /// When this gateway's booked prefill work should be done (a virtual clock: each booking
    /// adds its tokens at the holder's prefill rate, each first token pulls it back to what is
    /// still booked). At or before `now` when idle.
    pub prefill_busy_until: Timestamp,
    /// The engine's last report and its age, if it ever reported.
    pub engine: Option<(EngineLoad, Duration)>,
    /// The learned prefill speed: fixed overhead and seconds per token.
    pub estimate: Estimate,
    /// Prefill tokens this gateway booked since that report.
    pub since_report_tokens: u64,
    /// KV blocks this gateway's bookings hold at their longest (prompt and output limit).
    pub booked_kv_blocks: u64,
}

/// One data-parallel rank's atomics.
///
/// Layout (`repr(C)`, cache-line aligned): the first 64 bytes hold everything a decision reads
/// of the holder under the default policy and signals, each field in the form the decision uses
/// it (the estimate as `f64` seconds and `f32` tokens per second, the cache's blocks as `f32`):
/// written once per change, so a decision reads one line per holder and converts nothing (see
/// [`RankState::hot`]). What only updates, engine reports and other policies read follows.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct RankState {
    booked_requests: AtomicU32,
    /// Bookings of this gateway still waiting for their first token, and the sum of the times
    /// (ns) each was due by the estimate at its dispatch: how late they are on average says
    /// whether the holder is behind its estimate.
    unanswered: AtomicU32,
    booked_prefill_tokens: AtomicU64,
    /// The learned TTFT line, published for decisions: `f64` bits of the seconds per token of
    /// prefill work and of the fixed overhead (seconds), `f32` bits of the rate (tokens per
    /// second). Stored as nanoseconds and picoseconds before: the values are still rounded to
    /// those units (see `publish`).
    est_secs_per_token: AtomicU64,
    est_overhead_s: AtomicU64,
    est_rate: AtomicU32,
    /// `f32` bits of the blocks its cache holds, as the ledger last counted them (see
    /// [`WorkerState::set_cached_blocks`]).
    cached_blocks: AtomicU32,
    unanswered_due_sum_ns: AtomicU64,
    /// Nanoseconds: the virtual clock of booked prefill work (see `RankLoad`).
    prefill_busy_until: AtomicU64,
    ledger: AtomicU8,
    /// Whether the learner has [`TRAINED_SAMPLES`] real samples: until then a decision prices
    /// the holder at its pool's learned line (see `scheduler::gather`).
    trained: AtomicBool,
    // (end of the first line)
    /// KV blocks of the bookings at their longest (see `RankLoad`).
    booked_kv_blocks: AtomicU64,
    running: AtomicU32,
    waiting: AtomicU32,
    waiting_prefill_tokens: AtomicU64,
    kv_usage_ppm: AtomicU32,
    /// Nanoseconds of the last report plus one; 0 = never reported.
    reported_at: AtomicU64,
    /// Counts the engine's reports: a booking made since the last one is not in it yet.
    report_epoch: AtomicU32,
    /// Prefill tokens this gateway booked since the engine's last report and not yet prefilled.
    since_report_tokens: AtomicU64,
    /// Every booking's prefill tokens and count: the mean uncached size of a request here (what
    /// a waiting request an engine counts but does not size is taken to be).
    booked_total_requests: AtomicU64,
    booked_total_tokens: AtomicU64,
    /// Nanoseconds (plus one; 0 = none) of the first and the last booking since the last look
    /// whose request computes at least one new full block, so that the engine must publish KV
    /// events after it (see [`WorkerState::take_expected_events`]).
    expects_first: AtomicU64,
    expects_last: AtomicU64,
    /// The learner, and the engine's last cumulative prefill totals (updates only).
    learn: Mutex<Learner>,
}

// The layout the decision relies on: a rank's decision fields in its first line, rank 0 in the
// line after its worker's failure state.
const _: () = assert!(std::mem::offset_of!(RankState, booked_kv_blocks) <= 64);
const _: () = assert!(std::mem::offset_of!(WorkerState, rank0) == 64);

/// What a decision reads of a holder's first line (see [`RankState::hot`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hot {
    pub(crate) booked_requests: u32,
    pub(crate) booked_prefill_tokens: u64,
    pub(crate) secs_per_token: f64,
    pub(crate) overhead_s: f64,
    pub(crate) rate_tokens_per_sec: f32,
    pub(crate) cached_blocks: f32,
    pub(crate) ledger: LedgerState,
    pub(crate) trained: bool,
}

#[derive(Debug)]
struct Learner {
    fit: RateFit,
    /// The holder's booking count when last noted, and when it last changed (see
    /// [`RankState::note_bookings`]).
    booked_seen: u64,
    booked_at: Option<Timestamp>,
    /// Whether `booked_at` is a booking seen (not the first call's start of the clock).
    booked_moved: bool,
    /// Times the line was forgotten for starvation lately, and the last time: each forgetting
    /// doubles the wait before the next (a holder that is truly slow is not re-tried every
    /// [`crate::learn::STARVED_AFTER`]); the count restarts once the holder, 32 waits after its
    /// last forgetting, is being chosen.
    forgets: u32,
    forgot_at: Option<Timestamp>,
    last_totals: Option<PrefillTotals>,
    /// How far the decisions' estimates were from the first chunks that came.
    errors: EstimateErrors,
}

impl RankState {
    fn new(prior_rate: u32) -> Self {
        let fit = RateFit::new(f64::from(prior_rate.max(1)), PRIOR_OVERHEAD.as_secs_f64());
        let r = RankState {
            est_secs_per_token: AtomicU64::new(0),
            est_overhead_s: AtomicU64::new(0),
            est_rate: AtomicU32::new(0),
            report_epoch: AtomicU32::new(0),
            since_report_tokens: AtomicU64::new(0),
            booked_total_requests: AtomicU64::new(0),
            booked_total_tokens: AtomicU64::new(0),
            expects_first: AtomicU64::new(0),
            expects_last: AtomicU64::new(0),
            unanswered: AtomicU32::new(0),
            unanswered_due_sum_ns: AtomicU64::new(0),
            cached_blocks: AtomicU32::new(0),
            learn: Mutex::new(Learner {
                fit,
                booked_seen: 0,
                booked_at: None,
                booked_moved: false,
                forgets: 0,
                forgot_at: None,
                last_totals: None,
                errors: EstimateErrors::default(),
            }),
            booked_requests: AtomicU32::new(0),
            booked_prefill_tokens: AtomicU64::new(0),
            booked_kv_blocks: AtomicU64::new(0),
            prefill_busy_until: AtomicU64::new(0),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            waiting_prefill_tokens: AtomicU64::new(0),
            kv_usage_ppm: AtomicU32::new(0),
            reported_at: AtomicU64::new(0),
            ledger: AtomicU8::new(LedgerState::Syncing.code()),
            trained: AtomicBool::new(false),
        };
        r.publish(fit.estimate());
        r
    }

    fn publish(&self, e: Estimate) {
        // Rounded to whole nanoseconds and picoseconds as before, so that every estimate read
        // is the one the unit-based store gave.
        let overhead_s = u64_to_f64((e.overhead_s * 1e9) as u64) * 1e-9;
        let secs_per_token = u64_to_f64((e.secs_per_token * 1e12).max(1.0) as u64) * 1e-12;
        let est = Estimate { overhead_s, secs_per_token };
        // Relaxed (all three): an estimate read by decisions; a torn read (one field of the
        // previous estimate) is as good as either.
        self.est_overhead_s.store(overhead_s.to_bits(), Ordering::Relaxed);
        self.est_secs_per_token.store(secs_per_token.to_bits(), Ordering::Relaxed);
        self.est_rate.store((est.rate() as f32).to_bits(), Ordering::Relaxed);
    }

    /// The learned TTFT line.
    #[inline]
    pub(crate) fn estimate(&self) -> Estimate {
        // Relaxed: see `publish`.
        Estimate {
            overhead_s: f64::from_bits(self.est_overhead_s.load(Ordering::Relaxed)),
            secs_per_token: f64::from_bits(self.est_secs_per_token.load(Ordering::Relaxed)),
        }
    }

    /// What a decision reads of the holder, all from its first cache line.
    #[inline]
    pub(crate) fn hot(&self) -> Hot {
        // Relaxed (all): independent estimates, as in the accessors below; torn across fields
        // is fine (see the module docs).
        Hot {
            booked_requests: self.booked_requests.load(Ordering::Relaxed),
            booked_prefill_tokens: self.booked_prefill_tokens.load(Ordering::Relaxed),
            secs_per_token: f64::from_bits(self.est_secs_per_token.load(Ordering::Relaxed)),
            overhead_s: f64::from_bits(self.est_overhead_s.load(Ordering::Relaxed)),
            rate_tokens_per_sec: f32::from_bits(self.est_rate.load(Ordering::Relaxed)),
            cached_blocks: f32::from_bits(self.cached_blocks.load(Ordering::Relaxed)),
            ledger: LedgerState::from_code(self.ledger.load(Ordering::Relaxed)),
            trained: self.trained.load(Ordering::Relaxed),
        }
    }

    /// Whether the learner has [`TRAINED_SAMPLES`] samples (see [`RankState::hot`]).
    #[inline]
    pub(crate) fn trained(&self) -> bool {
        // Relaxed: as the estimate (see `publish`).
        self.trained.load(Ordering::Relaxed)
    }

    fn learn(&self, f: impl FnOnce(&mut Learner)) {
        let mut l = self.learn.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut l);
        let e = l.fit.estimate();
        let trained = l.fit.samples() >= TRAINED_SAMPLES;
        drop(l);
        self.publish(e);
        // Relaxed: as the estimate (see `publish`).
        self.trained.store(trained, Ordering::Relaxed);
    }

    /// Notes whether the holder was booked since the last call (its booking count moved) and
    /// returns when it last was, as far as these calls tell; `None` until a call saw the count
    /// move (the first call only starts the holder's clock: a holder joining an idle pool does
    /// not make it busy).
    pub(crate) fn note_bookings(&self, now: Timestamp) -> Option<Timestamp> {
        // Relaxed: a count compared between two calls.
        let count = self.booked_total_requests.load(Ordering::Relaxed);
        let mut l = self.learn.lock().unwrap_or_else(PoisonError::into_inner);
        match l.booked_at {
            None => {
                l.booked_seen = count;
                l.booked_at = Some(now);
                l.booked_moved = false;
            }
            Some(_) if count != l.booked_seen => {
                l.booked_seen = count;
                l.booked_at = Some(now);
                l.booked_moved = true;
            }
            Some(_) => {}
        }
        l.booked_at.filter(|_| l.booked_moved)
    }

    /// Forgets a trained line whose holder was not booked within `after` before `now` (twice as
    /// long per recent forgetting; see [`crate::Snapshot::forget_starved`]); whether it did.
    pub(crate) fn forget_if_starved(&self, now: Timestamp, after: Duration) -> bool {
        let mut forgot = false;
        self.learn(|l| {
            // Chosen on its own line for long since its last forgetting: a fresh start.
            if l.forgot_at.is_some_and(|t| now.saturating_since(t) > after.saturating_mul(32))
                && l.booked_at.is_some_and(|t| now.saturating_since(t) <= after)
            {
                l.forgets = 0;
            }
            let wait = after.saturating_mul(1 << l.forgets.min(4));
            let starved = l.booked_at.is_some_and(|t| now.saturating_since(t) > wait);
            if l.fit.samples() >= TRAINED_SAMPLES && starved {
                l.fit.forget();
                l.forgets = l.forgets.saturating_add(1);
                l.forgot_at = Some(now);
                forgot = true;
            }
        });
        forgot
    }

    /// Prefill tokens this gateway booked since the engine's last report and not yet prefilled.
    #[inline]
    pub(crate) fn since_report_tokens(&self) -> u64 {
        // Relaxed: an estimate.
        self.since_report_tokens.load(Ordering::Relaxed)
    }

    /// The mean prefill tokens of a request booked here (0 before any).
    #[inline]
    pub(crate) fn mean_booked_tokens(&self) -> u64 {
        // Relaxed (both): an estimate.
        let n = self.booked_total_requests.load(Ordering::Relaxed);
        self.booked_total_tokens.load(Ordering::Relaxed).checked_div(n).unwrap_or(0)
    }

    // Relaxed: an independent counter read as an estimate; nothing else is published through it.
    #[inline]
    pub(crate) fn booked_requests(&self) -> u32 {
        self.booked_requests.load(Ordering::Relaxed)
    }

    // Relaxed: as above.
    #[inline]
    pub(crate) fn booked_prefill_tokens(&self) -> u64 {
        self.booked_prefill_tokens.load(Ordering::Relaxed)
    }

    // Relaxed: as above.
    #[inline]
    pub(crate) fn booked_kv_blocks(&self) -> u64 {
        self.booked_kv_blocks.load(Ordering::Relaxed)
    }

    /// How late, in nanoseconds, on average at `now`, this gateway's bookings without a first
    /// token are: past twice the time to first token estimated at their dispatch, plus a second
    /// (zero when on time or none are outstanding).
    #[inline]
    pub(crate) fn unanswered_lateness_ns(&self, now: Timestamp) -> u64 {
        // Relaxed (both): an estimate; the two loads may straddle a booking, which moves the
        // mean by one request's share at most.
        let n = u64::from(self.unanswered.load(Ordering::Relaxed));
        let sum = self.unanswered_due_sum_ns.load(Ordering::Relaxed);
        // `now > ⌊sum / n⌋` exactly when `now · n > sum` (integers): the division (tens of
        // cycles, per holder and decision) is left to the rare holder that is late. Also false
        // when none is outstanding.
        if u128::from(now.as_nanos()) * u128::from(n) <= u128::from(sum) {
            return 0;
        }
        now.as_nanos() - sum / n
    }

    /// Expected wait for this gateway's booked prefill work at `now`, in nanoseconds.
    #[inline]
    pub(crate) fn prefill_backlog_ns(&self, now: Timestamp) -> u64 {
        // Relaxed: an estimate; see `booked_requests`.
        self.prefill_busy_until.load(Ordering::Relaxed).saturating_sub(now.as_nanos())
    }

    // Relaxed: a state flag read as a hint; the ledger's own query is the authority on data.
    #[inline]
    pub(crate) fn ledger(&self) -> LedgerState {
        LedgerState::from_code(self.ledger.load(Ordering::Relaxed))
    }

    /// The engine's last report if it is at most `max_age` old at `now` (any age for `None`).
    #[inline]
    pub(crate) fn engine(&self, now: Timestamp, max_age: Option<Duration>) -> Option<(EngineLoad, Duration)> {
        // Acquire: pairs with the Release store in `report`, so the fields read below are at
        // least as new as the timestamp.
        let at = self.reported_at.load(Ordering::Acquire);
        if at == 0 {
            return None;
        }
        let age = now.saturating_since(Timestamp::from_nanos(at - 1));
        if max_age.is_some_and(|m| age > m) {
            return None;
        }
        // Relaxed (all four): ordered after the Acquire load above; torn across fields is fine.
        let tokens = self.waiting_prefill_tokens.load(Ordering::Relaxed);
        let load = EngineLoad {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            waiting_prefill_tokens: (tokens != u64::MAX).then_some(tokens),
            kv_usage: self.kv_usage_ppm.load(Ordering::Relaxed) as f32 / 1e6,
            prefill_totals: None,
        };
        Some((load, age))
    }

    fn report(&self, load: EngineLoad, now: Timestamp) {
        // Relaxed (four fields): published by the Release store of `reported_at` below.
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.waiting_prefill_tokens.store(load.waiting_prefill_tokens.unwrap_or(u64::MAX), Ordering::Relaxed);
        let ppm = (f64::from(load.kv_usage.clamp(0.0, 1.0)) * 1e6) as u32;
        self.kv_usage_ppm.store(ppm, Ordering::Relaxed);
        // Relaxed (both): bookings compare the epoch as an estimate; a booking racing a report
        // is counted in one or the other, never both for long.
        self.report_epoch.fetch_add(1, Ordering::Relaxed);
        self.since_report_tokens.store(0, Ordering::Relaxed);
        // Release: makes the fields above visible to a reader that Acquires the timestamp.
        self.reported_at.store(now.as_nanos().saturating_add(1), Ordering::Release);
        if let Some(t) = load.prefill_totals {
            self.learn(|l| {
                if let Some(prev) = l.last_totals
                    && t.uncached_tokens > prev.uncached_tokens
                    && t.busy > prev.busy
                {
                    let tokens = (t.uncached_tokens - prev.uncached_tokens) as f64;
                    l.fit.observe(tokens, (t.busy - prev.busy).as_secs_f64());
                }
                l.last_totals = Some(t);
            });
        }
    }
}

/// Breaker word layout: bits 0–1 state, bits 2–31 consecutive worker faults, bits 32–63
/// consecutive half-open successes. One word so that a transition is one compare-and-swap.
const BREAKER_CLOSED: u64 = 0;
const BREAKER_OPEN: u64 = 1;
const BREAKER_HALF_OPEN: u64 = 2;
const FAULTS_MAX: u64 = (1 << 30) - 1;

fn breaker_word(state: u64, faults: u64, successes: u64) -> u64 {
    state | (faults.min(FAULTS_MAX) << 2) | (successes.min(u64::from(u32::MAX)) << 32)
}

fn breaker_parts(w: u64) -> (u64, u64, u64) {
    (w & 3, (w >> 2) & FAULTS_MAX, w >> 32)
}

/// One worker's fast state, shared by every snapshot that contains the worker id.
///
/// Layout (`repr(C)`, cache-line aligned): the first 64 bytes hold the worker's failure state a
/// decision checks (cooldown, breaker); rank 0 follows in the same allocation, its decision line
/// right after (most workers have one rank: a decision reads two adjacent lines per holder);
/// ranks 1.. are boxed; the policy comes last.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct WorkerState {
    /// Nanoseconds; the worker is skipped while `now < cooldown_until`.
    cooldown_until: AtomicU64,
    breaker: AtomicU64,
    breaker_opened_at: AtomicU64,
    /// Ranks 1.. (rank 0 lives in the same allocation as the worker's own fields).
    more_ranks: Box<[RankState]>,
    /// The class of the failure that set the current cooldown (0: none).
    cooldown_class: AtomicU8,
    /// The class of the last failure of any kind (0: none).
    last_failure: AtomicU8,
    rank0: RankState,
    policy: HealthPolicy,
}

impl WorkerState {
    pub(crate) fn new(dp_size: u16, policy: HealthPolicy, prior_rate: u32) -> Self {
        WorkerState {
            rank0: RankState::new(prior_rate),
            more_ranks: (1..dp_size.max(1)).map(|_| RankState::new(prior_rate)).collect(),
            cooldown_until: AtomicU64::new(0),
            cooldown_class: AtomicU8::new(0),
            last_failure: AtomicU8::new(0),
            breaker: AtomicU64::new(BREAKER_CLOSED),
            breaker_opened_at: AtomicU64::new(0),
            policy,
        }
    }

    /// Number of data-parallel ranks.
    #[must_use]
    pub fn dp_size(&self) -> u16 {
        self.more_ranks.len() as u16 + 1
    }

    #[inline]
    pub(crate) fn rank_state(&self, rank: DpRank) -> Option<&RankState> {
        match rank.0 {
            0 => Some(&self.rank0),
            r => self.more_ranks.get(usize::from(r) - 1),
        }
    }

    /// Records an engine load report for `rank` (false: no such rank).
    pub fn report_load(&self, rank: DpRank, load: EngineLoad, now: Timestamp) -> bool {
        self.rank_state(rank).map(|r| r.report(load, now)).is_some()
    }

    /// Sets how many blocks holder `rank`'s cache holds, as the ledger counts them (false: no
    /// such rank). `cache_aware` weighs a copy into a cache by how full it is.
    pub fn set_cached_blocks(&self, rank: DpRank, blocks: u64) -> bool {
        // Relaxed: a gauge read per decision as a hint. Stored as the `f32` the decision uses.
        let blocks = (blocks as f32).to_bits();
        self.rank_state(rank).map(|r| r.cached_blocks.store(blocks, Ordering::Relaxed)).is_some()
    }

    /// Sets the ledger state of holder `rank` (false: no such rank). Called by the ingest side.
    pub fn set_ledger(&self, rank: DpRank, state: LedgerState) -> bool {
        // Relaxed: a hint read per decision; see `RankState::ledger`.
        self.rank_state(rank).map(|r| r.ledger.store(state.code(), Ordering::Relaxed)).is_some()
    }

    /// The ledger state of holder `rank`.
    #[must_use]
    pub fn ledger(&self, rank: DpRank) -> Option<LedgerState> {
        self.rank_state(rank).map(RankState::ledger)
    }

    /// The load of holder `rank` at `now` (engine report of any age).
    #[must_use]
    pub fn rank_load(&self, rank: DpRank, now: Timestamp) -> Option<RankLoad> {
        self.rank_state(rank).map(|r| RankLoad {
            booked_requests: r.booked_requests(),
            booked_prefill_tokens: r.booked_prefill_tokens(),
            // Relaxed: an estimate.
            prefill_busy_until: Timestamp::from_nanos(r.prefill_busy_until.load(Ordering::Relaxed)),
            engine: r.engine(now, None),
            estimate: r.estimate(),
            since_report_tokens: r.since_report_tokens(),
            booked_kv_blocks: r.booked_kv_blocks(),
        })
    }

    /// Learned-rate samples holder `rank` has taken (first chunks and engine totals).
    #[must_use]
    pub fn learned_samples(&self, rank: DpRank) -> u64 {
        self.rank_state(rank)
            .map_or(0, |r| r.learn.lock().unwrap_or_else(PoisonError::into_inner).fit.samples())
    }

    /// How far the estimated times to first token of holder `rank`'s requests were from their
    /// streaming answers' first chunks (see [`Booking::first_output`]).
    #[must_use]
    pub fn estimate_errors(&self, rank: DpRank) -> Option<EstimateErrors> {
        self.rank_state(rank).map(|r| r.learn.lock().unwrap_or_else(PoisonError::into_inner).errors.clone())
    }

    /// A request sent to `rank` at `sent` computed at least one new full block, so the engine
    /// must publish KV events after `sent` (see [`Booking::expect_events`]; the forwarder calls
    /// this when the answer ends, with what the engine said it had cached).
    pub fn expect_events(&self, rank: DpRank, sent: Timestamp) {
        if let Some(r) = self.rank_state(rank) {
            let t = sent.as_nanos().saturating_add(1);
            // Relaxed (both): times read and cleared by the load poller; a late look is harmless.
            let _ = r.expects_first.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == 0 { t } else { old.min(t) })
            });
            r.expects_last.fetch_max(t, Ordering::Relaxed);
        }
    }

    /// When the first and the last request booked on `rank` since the last call that compute
    /// new blocks were booked: the engine must publish KV events after each
    /// ([`Booking::expect_events`]). Clears them.
    #[must_use]
    pub fn take_expected_events(&self, rank: DpRank) -> Option<(Timestamp, Timestamp)> {
        let r = self.rank_state(rank)?;
        // Relaxed (both): see `Booking::expect_events`; a booking between the two swaps moves
        // the last one only, which the next call reports.
        let first = r.expects_first.swap(0, Ordering::Relaxed);
        let last = r.expects_last.swap(0, Ordering::Relaxed);
        (first > 0).then(|| (Timestamp::from_nanos(first - 1), Timestamp::from_nanos(last.max(first) - 1)))
    }

    /// The cooldown in force at `now`: the class that started it and when it ends.
    #[must_use]
    #[inline]
    pub fn cooldown(&self, now: Timestamp) -> Option<(FailureClass, Timestamp)> {
        // Relaxed: a deadline read as a hint; a just-started cooldown seen one request late is fine.
        let until = self.cooldown_until.load(Ordering::Relaxed);
        if now.as_nanos() >= until {
            return None;
        }
        // Relaxed: as above; the class is only for display.
        let class = FailureClass::from_code(self.cooldown_class.load(Ordering::Relaxed))
            .unwrap_or(FailureClass::ServerError);
        Some((class, Timestamp::from_nanos(until)))
    }

    /// The class of the last failure recorded, of any class.
    #[must_use]
    pub fn last_failure(&self) -> Option<FailureClass> {
        // Relaxed: display only.
        FailureClass::from_code(self.last_failure.load(Ordering::Relaxed))
    }

    /// The circuit breaker's state at `now`: an open breaker whose open period has ended reads as
    /// half-open (trial requests flow) until an outcome moves it.
    #[must_use]
    #[inline]
    pub fn breaker(&self, now: Timestamp) -> BreakerState {
        // Acquire: pairs with the Release CAS that opened it, so `breaker_opened_at` is current.
        let (state, _, _) = breaker_parts(self.breaker.load(Ordering::Acquire));
        match state {
            BREAKER_CLOSED => BreakerState::Closed,
            BREAKER_HALF_OPEN => BreakerState::HalfOpen,
            _ if self.open_expired(now) => BreakerState::HalfOpen,
            _ => BreakerState::Open,
        }
    }

    #[inline]
    fn open_expired(&self, now: Timestamp) -> bool {
        let Some(cfg) = self.policy.breaker else { return true };
        // Relaxed: ordered by the Acquire load of the breaker word in the callers.
        let opened = Timestamp::from_nanos(self.breaker_opened_at.load(Ordering::Relaxed));
        now >= opened.saturating_add(cfg.open_for)
    }

    /// Records a failure: sets the cooldown of its class (never shortening one in force), and
    /// counts a worker fault toward the circuit breaker.
    pub fn record_failure(&self, class: FailureClass, now: Timestamp) {
        self.record_failure_for(class, now, None);
    }

    /// [`WorkerState::record_failure`], the cooldown `for` this long instead of the class's when
    /// the worker said when to come back (its `Retry-After` on a rate limit or a quota).
    pub fn record_failure_for(&self, class: FailureClass, now: Timestamp, cooldown: Option<Duration>) {
        // Relaxed: display only.
        self.last_failure.store(class.code(), Ordering::Relaxed);
        let told =
            cooldown.filter(|_| matches!(class, FailureClass::RateLimited | FailureClass::QuotaExhausted));
        if let Some(d) = told.or_else(|| self.policy.cooldowns.for_class(class)) {
            let until = now.as_nanos().saturating_add(duration_nanos(d));
            // Relaxed: a deadline hint (see `cooldown`); fetch_max never shortens a longer one.
            let prev = self.cooldown_until.fetch_max(until, Ordering::Relaxed);
            if until > prev {
                // Relaxed: display only; may name the class of a racing failure.
                self.cooldown_class.store(class.code(), Ordering::Relaxed);
            }
        }
        let Some(cfg) = self.policy.breaker else { return };
        if !class.is_worker_fault() {
            return;
        }
        let threshold = u64::from(cfg.failure_threshold);
        // Relaxed: this read only seeds the CAS loop, which re-reads with AcqRel.
        let mut cur = self.breaker.load(Ordering::Relaxed);
        loop {
            let (state, faults, _) = breaker_parts(cur);
            let faults = faults + 1;
            let opens = match state {
                BREAKER_CLOSED => faults >= threshold,
                BREAKER_HALF_OPEN => true,
                _ => self.open_expired(now), // a failed trial after the open period: reopen
            };
            let next = if opens {
                breaker_word(BREAKER_OPEN, faults, 0)
            } else if state == BREAKER_OPEN {
                return; // already open; a late failure changes nothing
            } else {
                breaker_word(state, faults, 0)
            };
            if opens {
                // Relaxed: published by the Release CAS below; only read while the state is open.
                self.breaker_opened_at.store(now.as_nanos(), Ordering::Relaxed);
            }
            // AcqRel: publishes `breaker_opened_at`; Acquire on failure to recompute from fresh state.
            match self.breaker.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Forgets the worker's failures: ends its cooldown and closes its breaker (with no fault
    /// counted). For a worker that left the live pool and was rediscovered healthy: the failures
    /// that cooled it down or opened its breaker were those of the instance that left.
    pub fn reset_failures(&self) {
        // Relaxed: a deadline hint (see `cooldown`).
        self.cooldown_until.store(0, Ordering::Relaxed);
        // Release: pairs with the Acquire loads of the breaker word (`breaker`, the CAS loops).
        self.breaker.store(BREAKER_CLOSED, Ordering::Release);
    }

    /// Records a success: resets the consecutive-fault count, and closes a half-open breaker after
    /// enough consecutive successes.
    pub fn record_success(&self, now: Timestamp) {
        let Some(cfg) = self.policy.breaker else { return };
        // Relaxed: seeds the CAS loop below.
        let mut cur = self.breaker.load(Ordering::Relaxed);
        loop {
            let (state, faults, successes) = breaker_parts(cur);
            let next = match state {
                BREAKER_CLOSED if faults == 0 => return,
                BREAKER_CLOSED => breaker_word(BREAKER_CLOSED, 0, 0),
                BREAKER_OPEN if !self.open_expired(now) => return, // a request from before it opened
                _ => {
                    let s = successes + 1;
                    if s >= u64::from(cfg.close_after_successes) {
                        breaker_word(BREAKER_CLOSED, 0, 0)
                    } else {
                        breaker_word(BREAKER_HALF_OPEN, faults, s)
                    }
                }
            };
            // AcqRel/Acquire: as in `record_failure`.
            match self.breaker.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }
}

/// A request this gateway put on a holder. Dropping it releases whatever is still booked; the
/// outcome methods record success or failure on the way.
#[derive(Debug)]
#[must_use = "dropping a Booking releases it at once"]
pub struct Booking {
    state: Arc<WorkerState>,
    holder: HolderId,
    prefill_tokens: u64,
    /// Nanoseconds of prefill per token on this holder (from its capacity).
    ns_per_token: u64,
    first_token_seen: bool,
    /// When it was booked (the dispatch).
    dispatched_at: Timestamp,
    /// The prefill work ahead of its first token at dispatch: the queue the decision saw, then
    /// its own prefill tokens.
    work_tokens: u64,
    /// The engine report epoch it was booked in.
    epoch: u32,
    /// Its prompt's chain in the prefixes in flight, when tracked.
    pending: Option<(Arc<PendingPrefixes>, PendingKey)>,
    /// KV blocks it holds at its longest, until it ends.
    kv_blocks: u64,
    /// When its first token was due by the estimate at dispatch (ns), while it is counted among
    /// the holder's bookings without one.
    due_ns: Option<u64>,
    /// The time to first token the decision estimated for it there, seconds (0: none, as for
    /// policies that do not estimate time).
    est_ttft_s: f32,
    /// When it was sent, if its engine owes KV events once it has computed the prompt (see
    /// [`Booking::expect_events_after_first_token`]).
    owes_events: Option<Timestamp>,
    /// Another holder's events owed once this request's first token comes, as its worker's
    /// state, its rank and its request's send (see [`Booking::owe_for`]).
    owes_for: Option<(Arc<WorkerState>, DpRank, Timestamp)>,
}

impl Booking {
    /// Books one request, `prefill_tokens` and `kv_blocks` on `holder`, with `queue_tokens` of
    /// prefill work ahead of it. `None` if the rank does not exist.
    pub(crate) fn new(
        state: Arc<WorkerState>,
        holder: HolderId,
        (prefill_tokens, kv_blocks): (u64, u64),
        queue_tokens: u64,
        prefill_tokens_per_sec: u32,
        now: Timestamp,
    ) -> Option<Self> {
        let r = state.rank_state(holder.rank)?;
        let ns_per_token = 1_000_000_000 / u64::from(prefill_tokens_per_sec.max(1));
        // Relaxed (all): independent counters read as estimates.
        r.booked_requests.fetch_add(1, Ordering::Relaxed);
        r.booked_prefill_tokens.fetch_add(prefill_tokens, Ordering::Relaxed);
        r.booked_kv_blocks.fetch_add(kv_blocks, Ordering::Relaxed);
        r.booked_total_requests.fetch_add(1, Ordering::Relaxed);
        r.booked_total_tokens.fetch_add(prefill_tokens, Ordering::Relaxed);
        let est = r.estimate();
        let work_tokens = queue_tokens.saturating_add(prefill_tokens);
        // Late means past twice the estimate and a second: estimates err by tens of percent
        // under load; a stall is what this is for.
        let due_s = 2.0 * (est.overhead_s + est.secs_per_token * work_tokens as f64) + 1.0;
        let due_ns = now.as_nanos().saturating_add((due_s.clamp(0.0, 1e6) * 1e9) as u64);
        r.unanswered_due_sum_ns.fetch_add(due_ns, Ordering::Relaxed);
        r.unanswered.fetch_add(1, Ordering::Relaxed);
        let epoch = r.report_epoch.load(Ordering::Relaxed);
        r.since_report_tokens.fetch_add(prefill_tokens, Ordering::Relaxed);
        let work = prefill_tokens.saturating_mul(ns_per_token);
        // Relaxed: an estimate (the virtual prefill clock); nothing is published through it.
        let _ = r.prefill_busy_until.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |busy| {
            Some(busy.max(now.as_nanos()).saturating_add(work))
        });
        Some(Booking {
            state,
            holder,
            prefill_tokens,
            ns_per_token,
            first_token_seen: false,
            dispatched_at: now,
            work_tokens,
            epoch,
            pending: None,
            due_ns: Some(due_ns),
            kv_blocks,
            est_ttft_s: 0.0,
            owes_events: None,
            owes_for: None,
        })
    }

    /// Records the request's prompt chain `seq` as in flight on this holder until shortly after
    /// its first token (see [`crate::pending`]), so that requests sharing the prefix meanwhile
    /// can be sent where it will be.
    pub fn track_prefix(
        &mut self,
        pending: &Arc<PendingPrefixes>,
        seq: &[cortex_hash::SeqHash],
        now: Timestamp,
    ) {
        if self.first_token_seen || self.pending.is_some() {
            return;
        }
        if let Some(key) = pending.insert(self.holder, Arc::from(seq), now) {
            self.pending = Some((Arc::clone(pending), key));
        }
    }

    /// This request computes at least one new full block on its holder (its prompt's full blocks
    /// past the ones cached there), so the holder's engine will publish KV events for it: an
    /// engine that goes on computing such requests without publishing anything is suspect,
    /// where one serving cache hits only is rightly quiet (see
    /// [`WorkerState::take_expected_events`]).
    pub fn expect_events(&self, now: Timestamp) {
        self.state.expect_events(self.holder.rank, now);
    }

    /// [`Booking::expect_events`] for a request sent at `sent`, once its first token comes
    /// ([`Booking::first_token`], [`Booking::first_output`]): only an engine that computed the
    /// prompt stored its blocks. One that refused or failed the request, or dropped it unstarted
    /// when its client left (a streaming head comes before any work), owes nothing.
    pub fn expect_events_after_first_token(&mut self, sent: Timestamp) {
        if self.first_token_seen {
            self.expect_events(sent);
        } else {
            self.owes_events = Some(sent);
        }
    }

    /// Takes over what `other` would owe at its own first token, to be owed at this request's
    /// instead: an SGLang pair's prefill leg may still be running when the decode worker answers,
    /// and the decode worker's first token shows that the prefill computed the prompt.
    pub fn owe_for(&mut self, other: &mut Booking) {
        let Some(sent) = other.owes_events.take() else { return };
        if self.first_token_seen {
            other.expect_events(sent);
        } else {
            self.owes_for = Some((Arc::clone(&other.state), other.holder.rank, sent));
        }
    }

    /// Records the time to first token the decision estimated for this request on its holder
    /// (see [`Booking::first_output`]).
    pub fn set_estimated_ttft(&mut self, seconds: f32) {
        self.est_ttft_s = seconds;
    }

    /// The holder it is booked on.
    #[must_use]
    pub fn holder(&self) -> HolderId {
        self.holder
    }

    /// Prefill tokens still booked (0 after the first token).
    #[must_use]
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    /// The worker's state (to record latencies or look at it).
    #[must_use]
    pub fn worker_state(&self) -> &Arc<WorkerState> {
        &self.state
    }

    /// Leaves the holder's bookings without a first token.
    fn answered(&mut self) {
        let Some(due) = self.due_ns.take() else { return };
        if let Some(r) = self.state.rank_state(self.holder.rank) {
            // Relaxed (both): see `new`.
            r.unanswered.fetch_sub(1, Ordering::Relaxed);
            r.unanswered_due_sum_ns.fetch_sub(due, Ordering::Relaxed);
        }
    }

    /// Releases the prefill tokens; with `now`, also pulls the holder's virtual prefill clock
    /// back to at most what is still booked (the engine may be faster than its nominal rate, and
    /// a request that ends before its first token no longer occupies the prefill queue).
    fn release_prefill(&mut self, now: Option<Timestamp>) {
        if self.prefill_tokens == 0 {
            return;
        }
        let Some(r) = self.state.rank_state(self.holder.rank) else { return };
        // Relaxed: see `new`.
        let left =
            r.booked_prefill_tokens.fetch_sub(self.prefill_tokens, Ordering::Relaxed) - self.prefill_tokens;
        // Relaxed (both): an estimate. A booking from before the last report is in the report.
        if r.report_epoch.load(Ordering::Relaxed) == self.epoch {
            let n = self.prefill_tokens;
            let _ = r
                .since_report_tokens
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| Some(s.saturating_sub(n)));
        }
        self.prefill_tokens = 0;
        if let Some(now) = now {
            let bound = now.as_nanos().saturating_add(left.saturating_mul(self.ns_per_token));
            // Relaxed: an estimate; fetch_min only ever tightens it.
            r.prefill_busy_until.fetch_min(bound, Ordering::Relaxed);
        }
    }

    /// The first token arrived: releases the prefill tokens. Later calls do nothing.
    pub fn first_token(&mut self, now: Timestamp) {
        if !self.first_token_seen {
            self.first_token_seen = true;
            if let Some(sent) = self.owes_events.take() {
                self.expect_events(sent);
            }
            if let Some((state, rank, sent)) = self.owes_for.take() {
                state.expect_events(rank, sent);
            }
            self.answered();
            self.release_prefill(Some(now));
            if let Some((p, key)) = &self.pending {
                p.expire(*key, now);
            }
        }
    }

    /// The first chunk of a *streaming* answer arrived: as [`Booking::first_token`], and the time
    /// since dispatch is a sample of the holder's prefill speed for the work that was ahead of
    /// it (see [`crate::learn`]). A non-streaming answer's first byte comes after generation:
    /// call [`Booking::first_token`] for it.
    ///
    /// With an estimate ([`Booking::set_estimated_ttft`]), the holder also counts how far it
    /// was from the time taken (see [`WorkerState::estimate_errors`]), and this returns that
    /// error: seconds taken less seconds estimated. `None` without an estimate or on a later call.
    pub fn first_output(&mut self, now: Timestamp) -> Option<f64> {
        if self.first_token_seen {
            return None;
        }
        let ttft = now.saturating_since(self.dispatched_at).as_secs_f64();
        let estimated = (self.est_ttft_s > 0.0).then_some(f64::from(self.est_ttft_s));
        if let Some(r) = self.state.rank_state(self.holder.rank) {
            let work = self.work_tokens as f64;
            r.learn(|l| {
                l.fit.observe(work, ttft);
                if let Some(e) = estimated {
                    l.errors.record(e, ttft);
                }
            });
        }
        self.first_token(now);
        estimated.map(|e| ttft - e)
    }

    /// The request finished well: records a success and releases the booking.
    pub fn succeed(mut self, now: Timestamp) {
        self.release_prefill(Some(now));
        self.state.record_success(now);
    }

    /// The request failed: records the failure (cooldown, breaker) and releases the booking.
    pub fn fail(self, class: FailureClass, now: Timestamp) {
        self.fail_for(class, now, None);
    }

    /// [`Booking::fail`], with the cooldown the worker asked for (its `Retry-After` on a rate
    /// limit or a quota; see [`WorkerState::record_failure_for`]).
    pub fn fail_for(mut self, class: FailureClass, now: Timestamp, cooldown: Option<Duration>) {
        self.release_prefill(Some(now));
        self.state.record_failure_for(class, now, cooldown);
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        // Never prefilled (or not known to be): its prefix will not be there.
        if !self.first_token_seen
            && let Some((p, key)) = self.pending.take()
        {
            p.remove(key);
        }
        self.answered();
        // No clock here: the virtual prefill clock keeps a cancelled request's share until it
        // runs out (at most that request's own prefill time).
        self.release_prefill(None);
        // Relaxed: see `new`. The rank was checked in `new`; a state's rank count never changes.
        if let Some(r) = self.state.rank_state(self.holder.rank) {
            r.booked_requests.fetch_sub(1, Ordering::Relaxed);
            r.booked_kv_blocks.fetch_sub(self.kv_blocks, Ordering::Relaxed);
        }
    }
}

/// `x` as `f64` through `i64`: one conversion instruction where `u64 as f64` takes a branchy
/// sequence (the decision converts a few per holder). Saturates at `i64::MAX`, far beyond any
/// count or duration it converts.
#[inline]
#[must_use]
pub(crate) fn u64_to_f64(x: u64) -> f64 {
    x.min(i64::MAX as u64) as i64 as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::BreakerConfig;

    fn ms(n: u64) -> Timestamp {
        Timestamp::from_millis(n)
    }

    fn state(policy: HealthPolicy) -> Arc<WorkerState> {
        Arc::new(WorkerState::new(2, policy, 10_000))
    }

    #[test]
    fn every_ledger_state_reads_back_as_written() {
        for s in [LedgerState::Ready, LedgerState::Syncing, LedgerState::Stale, LedgerState::Disabled] {
            assert_eq!(LedgerState::from_code(s.code()), s);
            let r = state(HealthPolicy::default());
            assert!(r.set_ledger(DpRank(1), s));
            assert_eq!(r.rank_state(DpRank(1)).map(|rs| rs.ledger()), Some(s));
            assert_eq!(r.rank_state(DpRank(1)).map(|rs| rs.hot().ledger), Some(s));
        }
    }

    fn holder(rank: u16) -> HolderId {
        HolderId::new(cortex_hash::kv::WorkerId(1), DpRank(rank))
    }

    /// A streaming first chunk counts how far the decision's estimate was from it; a booking
    /// without an estimate, a non-streaming first token and a second call count nothing.
    #[test]
    fn first_output_counts_the_estimate_s_error() {
        let s = state(HealthPolicy::default());
        let errors = |s: &WorkerState| s.estimate_errors(DpRank(0)).expect("rank 0");
        let mut a = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(0)).expect("rank");
        a.set_estimated_ttft(0.040);
        let e = a.first_output(ms(100)).expect("an estimate");
        assert!((e - 0.060).abs() < 1e-6, "{e}");
        assert_eq!(a.first_output(ms(200)), None, "counted once");
        let mut b = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(0)).expect("rank");
        assert_eq!(b.first_output(ms(50)), None, "no estimate");
        let mut c = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(0)).expect("rank");
        c.set_estimated_ttft(0.040);
        c.first_token(ms(500));
        let e = errors(&s);
        assert_eq!(e.count(), 1);
        assert!((e.sum_signed_s - 0.060).abs() < 1e-6, "{e:?}");
        let p = e.abs_s.quantile(0.5).expect("one");
        assert!((0.060 / 1.19..=0.060 * 1.19).contains(&p), "{p}");
        assert_eq!(s.estimate_errors(DpRank(1)).expect("rank 1").count(), 0);
    }

    /// Events are owed from a request's send, but only once its first token says the engine
    /// computed the prompt: a request refused, failed or dropped before any token owes none.
    #[test]
    fn events_are_owed_from_the_send_once_the_first_token_comes() {
        let s = state(HealthPolicy::default());
        let mut dropped = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(10)).expect("rank");
        dropped.expect_events_after_first_token(ms(10));
        drop(dropped);
        assert_eq!(s.take_expected_events(DpRank(0)), None, "never computed");
        let mut failed = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(20)).expect("rank");
        failed.expect_events_after_first_token(ms(20));
        failed.fail(FailureClass::ServerError, ms(30));
        assert_eq!(s.take_expected_events(DpRank(0)), None, "failed");
        let mut served = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(40)).expect("rank");
        served.expect_events_after_first_token(ms(40));
        assert_eq!(s.take_expected_events(DpRank(0)), None, "not before its first token");
        served.first_output(ms(90));
        assert_eq!(s.take_expected_events(DpRank(0)), Some((ms(40), ms(40))), "from its send");
        // Another leg's debt, owed at this one's first token (an SGLang pair's prefill, still
        // running when the decode worker answers).
        let other = state(HealthPolicy::default());
        let mut prefill = Booking::new(other.clone(), holder(0), (500, 0), 0, 10_000, ms(41)).expect("rank");
        prefill.expect_events_after_first_token(ms(41));
        let mut decode = Booking::new(s.clone(), holder(1), (500, 0), 0, 10_000, ms(42)).expect("rank");
        decode.owe_for(&mut prefill);
        prefill.succeed(ms(45));
        assert_eq!(other.take_expected_events(DpRank(0)), None, "not before the decode's first token");
        decode.first_token(ms(48));
        assert_eq!(other.take_expected_events(DpRank(0)), Some((ms(41), ms(41))));
        assert_eq!(s.take_expected_events(DpRank(1)), None, "the decode leg owed nothing itself");
        // Already answering (a PD leg's finished prefill): owed at once.
        let mut later = Booking::new(s.clone(), holder(1), (500, 0), 0, 10_000, ms(50)).expect("rank");
        later.first_token(ms(60));
        later.expect_events_after_first_token(ms(50));
        assert_eq!(s.take_expected_events(DpRank(1)), Some((ms(50), ms(50))));
    }

    #[test]
    fn booking_releases_prefill_at_first_token_and_request_on_drop() {
        let s = state(HealthPolicy::default());
        let mut b = Booking::new(s.clone(), holder(1), (500, 40), 0, 10_000, ms(0)).expect("rank 1");
        let load = s.rank_load(DpRank(1), ms(0)).expect("rank");
        assert_eq!((load.booked_requests, load.booked_prefill_tokens, load.booked_kv_blocks), (1, 500, 40));
        assert_eq!(s.rank_load(DpRank(0), ms(0)).expect("rank").booked_requests, 0);
        b.first_token(ms(40));
        b.first_token(ms(90)); // second call is a no-op
        let load = s.rank_load(DpRank(1), ms(0)).expect("rank");
        // The KV stays held until the request ends: it decodes after its first token.
        assert_eq!((load.booked_requests, load.booked_prefill_tokens, load.booked_kv_blocks), (1, 0, 40));
        drop(b);
        let load = s.rank_load(DpRank(1), ms(0)).expect("rank");
        assert_eq!((load.booked_requests, load.booked_prefill_tokens, load.booked_kv_blocks), (0, 0, 0));
        assert!(Booking::new(s, holder(2), (1, 0), 0, 10_000, ms(0)).is_none(), "no rank 2");
    }

    #[test]
    fn the_prefill_clock_advances_per_booking_and_snaps_back_at_first_tokens() {
        let s = state(HealthPolicy::default());
        let busy = |s: &WorkerState| s.rank_load(DpRank(0), ms(0)).expect("rank").prefill_busy_until;
        // 10,000 tokens/s: 1,000 tokens are 100 ms of prefill.
        let mut a = Booking::new(s.clone(), holder(0), (1000, 0), 0, 10_000, ms(0)).expect("rank");
        let mut b = Booking::new(s.clone(), holder(0), (1000, 0), 0, 10_000, ms(50)).expect("rank");
        assert_eq!(busy(&s), ms(200), "queued behind the first");
        assert_eq!(s.rank_state(DpRank(0)).expect("rank").prefill_backlog_ns(ms(150)), 50_000_000);
        // The engine is faster than nominal: the first token at 60 ms leaves 1,000 tokens booked.
        a.first_token(ms(60));
        assert_eq!(busy(&s), ms(160));
        b.first_token(ms(200)); // slower this time: the clock is never pushed later
        assert_eq!(busy(&s), ms(160));
        assert_eq!(s.rank_state(DpRank(0)).expect("rank").prefill_backlog_ns(ms(200)), 0);
        // Idle: a new booking starts from now.
        let c = Booking::new(s.clone(), holder(0), (500, 0), 0, 10_000, ms(1000)).expect("rank");
        assert_eq!(busy(&s), ms(1050));
        c.fail(FailureClass::Timeout, ms(1010));
        assert_eq!(busy(&s), ms(1010), "a failed request leaves the queue");
    }

    #[test]
    fn unanswered_bookings_are_late_past_their_estimated_first_token() {
        let s = state(HealthPolicy::default());
        let r = s.rank_state(DpRank(0)).expect("rank");
        assert_eq!(r.unanswered_lateness_ns(ms(5)), 0);
        // At the prior (10 ms + 0.1 ms per token), due after twice the estimate and a second:
        // at 2·(10 + 30) + 1,000 = 1,080 ms and at 100 + 2·10 + 1,000 = 1,120 ms.
        let mut a = Booking::new(s.clone(), holder(0), (300, 0), 0, 10_000, ms(0)).expect("rank");
        let b = Booking::new(s.clone(), holder(0), (0, 0), 0, 10_000, ms(100)).expect("rank");
        // (Milliseconds: the estimate's seconds are floating point.)
        let late = |at| r.unanswered_lateness_ns(ms(at)) / 1_000_000;
        assert_eq!(late(1_090), 0, "on time on average");
        // At 2 s: 920 and 880 ms late, 900 on average.
        assert_eq!(late(2_000), 900);
        a.first_token(ms(2_000));
        a.first_token(ms(2_001));
        assert_eq!(late(2_000), 880);
        drop(b);
        drop(a);
        assert_eq!(r.unanswered_lateness_ns(ms(3_000)), 0);
    }

    #[test]
    fn dropping_before_first_token_releases_everything() {
        let s = state(HealthPolicy::default());
        let a = Booking::new(s.clone(), holder(0), (300, 0), 0, 10_000, ms(0)).expect("rank");
        let b = Booking::new(s.clone(), holder(0), (200, 0), 0, 10_000, ms(0)).expect("rank");
        assert_eq!(s.rank_load(DpRank(0), ms(0)).expect("rank").booked_prefill_tokens, 500);
        a.fail(FailureClass::Timeout, ms(1));
        assert_eq!(s.rank_load(DpRank(0), ms(0)).expect("rank").booked_prefill_tokens, 200);
        drop(b);
        let l = s.rank_load(DpRank(0), ms(0)).expect("rank");
        assert_eq!((l.booked_requests, l.booked_prefill_tokens), (0, 0));
    }

    #[test]
    fn cooldown_per_class_never_shortens() {
        let s = state(HealthPolicy::default());
        let c = HealthPolicy::default().cooldowns;
        for (class, until) in [
            (FailureClass::ContextLengthExceeded, None),
            (FailureClass::ContentPolicy, None),
            (FailureClass::ServerError, Some(ms(1000).saturating_add(c.server_error))),
            (FailureClass::RateLimited, Some(ms(1000).saturating_add(c.rate_limited))),
            (FailureClass::QuotaExhausted, Some(ms(1000).saturating_add(c.quota_exhausted))),
        ] {
            let s = state(HealthPolicy::default());
            s.record_failure(class, ms(1000));
            assert_eq!(s.cooldown(ms(1000)), until.map(|t| (class, t)), "{class}");
            assert_eq!(s.last_failure(), Some(class));
        }
        s.record_failure(FailureClass::QuotaExhausted, ms(0));
        s.record_failure(FailureClass::ServerError, ms(10));
        let (class, until) = s.cooldown(ms(10)).expect("cooling");
        assert_eq!((class, until), (FailureClass::QuotaExhausted, ms(0).saturating_add(c.quota_exhausted)));
        assert_eq!(s.last_failure(), Some(FailureClass::ServerError));
        assert!(s.cooldown(ms(0).saturating_add(c.quota_exhausted)).is_none(), "over at the deadline");
    }

    #[test]
    fn breaker_opens_half_opens_and_closes() {
        let cfg = BreakerConfig {
            failure_threshold: 3,
            open_for: Duration::from_secs(10),
            close_after_successes: 2,
        };
        let s = state(HealthPolicy { breaker: Some(cfg), ..HealthPolicy::default() });
        s.record_failure(FailureClass::ServerError, ms(0));
        s.record_failure(FailureClass::Timeout, ms(1));
        s.record_success(ms(2)); // resets the consecutive count
        s.record_failure(FailureClass::ServerError, ms(3));
        s.record_failure(FailureClass::ServerError, ms(4));
        s.record_failure(FailureClass::RateLimited, ms(5)); // not a worker fault
        s.record_failure(FailureClass::ContextLengthExceeded, ms(5));
        assert_eq!(s.breaker(ms(5)), BreakerState::Closed);
        s.record_failure(FailureClass::ServerError, ms(6));
        assert_eq!(s.breaker(ms(6)), BreakerState::Open);
        s.record_success(ms(7)); // a request from before it opened
        assert_eq!(s.breaker(ms(7)), BreakerState::Open);
        assert_eq!(s.breaker(ms(10_006)), BreakerState::HalfOpen);
        s.record_failure(FailureClass::Timeout, ms(10_010)); // failed trial reopens
        assert_eq!(s.breaker(ms(10_011)), BreakerState::Open);
        assert_eq!(s.breaker(ms(20_010)), BreakerState::HalfOpen);
        s.record_success(ms(20_011));
        assert_eq!(s.breaker(ms(20_012)), BreakerState::HalfOpen);
        s.record_success(ms(20_013));
        assert_eq!(s.breaker(ms(20_014)), BreakerState::Closed);
        // closed again: needs the full threshold to reopen
        s.record_failure(FailureClass::ServerError, ms(20_015));
        assert_eq!(s.breaker(ms(20_016)), BreakerState::Closed);
    }

    #[test]
    fn reset_failures_ends_the_cooldown_and_closes_the_breaker() {
        let cfg = BreakerConfig {
            failure_threshold: 2,
            open_for: Duration::from_secs(60),
            close_after_successes: 2,
        };
        let s = state(HealthPolicy { breaker: Some(cfg), ..HealthPolicy::default() });
        s.record_failure(FailureClass::ServerError, ms(0));
        s.record_failure(FailureClass::ServerError, ms(1));
        assert_eq!(s.breaker(ms(2)), BreakerState::Open);
        assert!(s.cooldown(ms(2)).is_some());
        s.reset_failures();
        assert_eq!(s.breaker(ms(3)), BreakerState::Closed);
        assert!(s.cooldown(ms(3)).is_none());
        // The fault count starts over: one failure does not reopen it.
        s.record_failure(FailureClass::ServerError, ms(4));
        assert_eq!(s.breaker(ms(5)), BreakerState::Closed);
    }

    #[test]
    fn breaker_disabled_never_opens() {
        let s = state(HealthPolicy { breaker: None, ..HealthPolicy::default() });
        for i in 0..100 {
            s.record_failure(FailureClass::ServerError, ms(i));
        }
        assert_eq!(s.breaker(ms(100)), BreakerState::Closed);
    }

    #[test]
    fn engine_reports_have_an_age_and_ledger_state_defaults_to_syncing() {
        let s = state(HealthPolicy::default());
        assert_eq!(s.rank_load(DpRank(0), ms(0)).expect("rank").engine, None);
        let l = EngineLoad {
            running: 3,
            waiting: 2,
            waiting_prefill_tokens: Some(900),
            kv_usage: 0.5,
            prefill_totals: None,
        };
        assert!(s.report_load(DpRank(0), l, ms(100)));
        assert!(!s.report_load(DpRank(7), l, ms(100)));
        let (got, age) = s.rank_load(DpRank(0), ms(350)).expect("rank").engine.expect("reported");
        assert_eq!((got, age), (l, Duration::from_millis(250)));
        let r = s.rank_state(DpRank(0)).expect("rank");
        assert!(r.engine(ms(350), Some(Duration::from_millis(200))).is_none(), "too old");
        assert!(r.engine(ms(350), Some(Duration::from_millis(250))).is_some());
        assert_eq!(s.ledger(DpRank(1)), Some(LedgerState::Syncing));
        assert!(s.set_ledger(DpRank(1), LedgerState::Ready));
        assert_eq!(s.ledger(DpRank(1)), Some(LedgerState::Ready));
        assert_eq!(s.ledger(DpRank(2)), None);
    }

    #[test]
    fn concurrent_bookings_never_leak() {
        let s = state(HealthPolicy::default());
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let s = Arc::clone(&s);
                scope.spawn(move || {
                    for i in 0..5_000u64 {
                        let mut b = Booking::new(
                            Arc::clone(&s),
                            holder((i % 2) as u16),
                            (100 + t, 3),
                            0,
                            10_000,
                            ms(i),
                        )
                        .expect("rank");
                        match i % 4 {
                            0 => drop(b),
                            1 => b.first_token(ms(i + 1)),
                            2 => {
                                b.first_token(ms(i + 1));
                                b.succeed(ms(i + 2));
                            }
                            _ => b.fail(FailureClass::ContextLengthExceeded, ms(i + 1)),
                        }
                    }
                });
            }
        });
        for r in 0..2 {
            let l = s.rank_load(DpRank(r), ms(0)).expect("rank");
            assert_eq!(
                (l.booked_requests, l.booked_prefill_tokens, l.booked_kv_blocks),
                (0, 0, 0),
                "rank {r}"
            );
        }
    }
}
