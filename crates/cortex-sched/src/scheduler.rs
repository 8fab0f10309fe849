//! The decision: candidate filter, then the pool's policy, written into a lent [`Ranking`].
//!
//! Key decisions:
//! - Filter before choosing (Pixiu RFC, option C1): health, cooldown and breaker are checked once
//!   per holder here, so no policy re-implements them; every policy then only orders admissible
//!   candidates.
//! - The chain is decided from what is known, in one place: with load signals missing everywhere
//!   the decision is round-robin, partly missing power-of-two; otherwise the cache is used when the
//!   caller trusts it, the holder's ledger is READY, the best holder is under the high watermark
//!   and the holder is under the load bound.
//! - The load bound (consistent hashing with bounded loads) counts this gateway's own bookings, so
//!   its guarantee — no holder above ⌈(1+ε)·mean⌉, mean including the request being placed — holds
//!   for the traffic the gateway controls; at least one holder is always under it.
//! - Nothing on the path allocates: the candidates go into the caller's buffer, sorting is in
//!   place, randomness is a splitmix64 counter. Only `manual` touches a map (and a mutex).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use cortex_hash::kv::HolderId;
use xxhash_rust::xxh3::xxh3_64;

use crate::cluster::{Health, HolderSlot, PoolRef, Snapshot};
use crate::config::{
    Assignment, BoundedLoad, ConfigError, LoadSignals, ManualConfig, PolicyConfig, PrefixHashConfig,
    SchedConfig, UnreadyHolders,
};
use crate::decision::{
    CacheView, Candidate, Exclusion, Facts, FallbackReason, MatchMode, Ranking, Request, Score,
};
use crate::failure::BreakerState;
use crate::scorer::{ScoreInput, Scorer, TimeScorer, WeightedScorer};
use crate::state::LedgerState;
use crate::time::Timestamp;

/// Why no candidate could be ranked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// No worker of the snapshot serves the request's model in the request's role.
    #[error("no worker serves this model in this role")]
    NoPool,
    /// The pool exists but every holder is excluded; the ranking lists why.
    #[error("every worker of the pool is excluded (unhealthy, cooling down or breaker open)")]
    NoneAdmissible,
}

struct Sticky {
    holder: HolderId,
    last_used: Timestamp,
}

struct PoolRuntime {
    policy: PolicyConfig,
    next: AtomicU64,
    sticky: Mutex<HashMap<u64, Sticky>>,
}

/// How complete the load signals of the admissible candidates are.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Signals {
    Complete,
    Partial,
    Missing,
}

/// The scheduler: configuration, the scorer and the policies' small state (round-robin counters,
/// random state, sticky assignments). Shared by all request tasks (`&self` everywhere).
///
/// `S` scores `cache_aware` (default: [`TimeScorer`], the shortest estimated time to first
/// token); `cache_aware_v1` and the load orders of `least_load`, `power_of_two` and `manual` use
/// the config's [`WeightedScorer`].
pub struct Scheduler<S = TimeScorer> {
    config: SchedConfig,
    scorer: S,
    weighted: WeightedScorer,
    pending: std::sync::Arc<crate::pending::PendingPrefixes>,
    pools: [PoolRuntime; 3],
    rng: AtomicU64,
}

impl<S> std::fmt::Debug for Scheduler<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Scheduler<TimeScorer> {
    /// A scheduler with the default scorer and `config`'s settings.
    ///
    /// # Errors
    /// If `config` does not validate.
    pub fn new(config: SchedConfig) -> Result<Self, ConfigError> {
        Self::with_scorer(
            config,
            TimeScorer { per_active_ms: config.per_active_ms, recompute_weight: config.recompute_weight },
        )
    }
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn holder_bits(h: HolderId) -> u64 {
    (u64::from(h.worker.0) << 16) | u64::from(h.rank.0)
}

/// Sort keys are one `u64`: a 32-bit primary, a 12-bit secondary (tie-break), and the 20-bit
/// pool index (added by `order`). Policies build the first two with `key`.
const fn sort_key(primary: u32, secondary: u64) -> u64 {
    ((primary as u64) << 32) | ((secondary & 0xfff) << 20)
}

pub(crate) const INDEX_MASK: u64 = (1 << 20) - 1;

/// How many admissible candidates a decision puts in rank order (the rest follow unordered until
/// [`Ranking::sort_all`]): the first and its retries (three attempts by default). Eight instead
/// of sixteen took a third of the selection's cost.
pub const RANKED: usize = 8;

/// The least `cache_aware`'s load bound allows any holder: `⌈(1+ε)·(B + 1)/n⌉` is 1 whenever
/// fewer than `n/(1+ε)` requests are in flight, which would forbid a holder its second request
/// while the cluster is nearly idle — turning cache affinity off exactly when no worker is
/// loaded (a conversation's next turn sent away from its history because the holder is
/// answering one other request). `cache_aware`'s estimate already charges the queue a request
/// waits behind, so the floor only has to stop a pile-up, which takes more than three: at 2 the
/// slowest turns of the multi-turn replay still went to a cold worker because their holder had
/// two requests in flight (perf.md, "After the bound's floor").
pub const TIME_BOUND_FLOOR: u64 = 3;

/// The largest pool a decision considers (the sort key's index field); holders beyond it, in
/// holder-id order, are ignored. A million holders in one (model, role) pool is far beyond any
/// cluster this gateway fronts.
pub const MAX_POOL_HOLDERS: usize = 1 << 20;

/// Maps `x` to a u32 that sorts ascending as `x` sorts *descending* (NaN last). Scores are f32
/// (a relative precision of 6e-8): closer scores are ties, broken by the secondary key. Finite scores map above 2, so 0 and 1 stay free for `power_of_two`'s pair.
///
/// Without branches: a negative score's bits already sort ascending as it sorts descending, and
/// a positive one's do once its 31 low bits are flipped.
#[inline]
fn desc_key(x: f32) -> u32 {
    let b = if x.is_nan() { f32::NEG_INFINITY.to_bits() } else { x.to_bits() };
    let negative = ((b as i32) >> 31) as u32;
    b ^ (!negative & 0x7fff_ffff)
}

impl<S: Scorer> Scheduler<S> {
    /// A scheduler whose `cache_aware` policy orders candidates with a custom scorer.
    ///
    /// # Errors
    /// If `config` does not validate.
    pub fn with_scorer(config: SchedConfig, scorer: S) -> Result<Self, ConfigError> {
        config.validate()?;
        let pool =
            |policy| PoolRuntime { policy, next: AtomicU64::new(0), sticky: Mutex::new(HashMap::new()) };
        Ok(Scheduler {
            config,
            scorer,
            weighted: WeightedScorer { weights: config.weights },
            pending: std::sync::Arc::default(),
            pools: [pool(config.pools.regular), pool(config.pools.prefill), pool(config.pools.decode)],
            rng: AtomicU64::new(config.seed),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &SchedConfig {
        &self.config
    }

    /// The prefixes in flight `cache_aware` credits (bookings record theirs with
    /// [`crate::Booking::track_prefix`]).
    #[must_use]
    pub fn pending(&self) -> &std::sync::Arc<crate::pending::PendingPrefixes> {
        &self.pending
    }

    /// Forgets `manual` assignments idle for longer than their `max_idle` at `now`; returns how
    /// many. The proxy calls it now and then (SGLang: every 60 s).
    pub fn sweep_sticky(&self, now: Timestamp) -> usize {
        let mut n = 0;
        for p in &self.pools {
            if let PolicyConfig::Manual(m) = p.policy {
                let mut map = p.sticky.lock().unwrap_or_else(PoisonError::into_inner);
                let before = map.len();
                map.retain(|_, s| now.saturating_since(s.last_used) <= m.max_idle);
                n += before - map.len();
            }
        }
        n
    }

    /// `manual` assignments held now, over every pool (what [`Scheduler::sweep_sticky`] keeps
    /// bounded).
    #[must_use]
    pub fn sticky_assignments(&self) -> usize {
        self.pools.iter().map(|p| p.sticky.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }

    fn random(&self) -> u64 {
        // Relaxed: a counter whose only job is to differ between calls.
        mix(self.rng.fetch_add(GOLDEN, Ordering::Relaxed).wrapping_add(GOLDEN))
    }

    /// Ranks the holders of `req`'s pool in `snap` into `out` (cleared first).
    ///
    /// On success `out.admissible()` is non-empty. On [`SchedError::NoneAdmissible`], `out` still
    /// lists every holder with why it was excluded.
    ///
    /// # Errors
    /// [`SchedError::NoPool`] if no worker serves the model in the role;
    /// [`SchedError::NoneAdmissible`] if all are excluded.
    pub fn decide(&self, snap: &Snapshot, req: &Request<'_>, out: &mut Ranking) -> Result<(), SchedError> {
        let rt = &self.pools[req.role.index()];
        out.reset(rt.policy.kind());
        let mut pool = snap.pool(req.model, req.role).ok_or(SchedError::NoPool)?;
        pool.holders = &pool.holders[..pool.holders.len().min(MAX_POOL_HOLDERS)];
        let time = rt.policy == PolicyConfig::CacheAware;
        let (mut admissible, mut reported, mut booked) = self.gather(pool.holders, req, time, out);
        if admissible == 0 {
            Self::order(out);
            return Err(SchedError::NoneAdmissible);
        }
        let signals_of = |admissible: usize, reported: usize| match self.config.load_signals {
            LoadSignals::Booked => Signals::Complete,
            LoadSignals::EngineReports { .. } if reported == admissible => Signals::Complete,
            LoadSignals::EngineReports { .. } if reported == 0 => Signals::Missing,
            LoadSignals::EngineReports { .. } => Signals::Partial,
        };
        // The KV room: `cache_aware` checks it once it knows each holder's cached prefix (which
        // takes no new blocks); every other decision (the load fallbacks of `cache_aware_v1`
        // included) here, with the whole request.
        let looks_at_cache = match rt.policy {
            PolicyConfig::CacheAware => true,
            PolicyConfig::CacheAwareV1 => signals_of(admissible, reported) == Signals::Complete,
            _ => false,
        };
        if Self::checks_kv_room(req) && !looks_at_cache {
            let full = Self::exclude_kv_full(pool.holders, out);
            admissible -= full.0;
            reported -= full.1;
            booked -= full.2;
        }
        let signals = signals_of(admissible, reported);
        match rt.policy {
            // Time-based: a holder without a fresh report is estimated from this gateway's own
            // bookings, so partial or missing engine reports do not degrade the decision.
            PolicyConfig::CacheAware => {
                self.cache_aware(snap, pool, req, Signals::Complete, (admissible, booked), true, out);
            }
            PolicyConfig::CacheAwareV1 => {
                self.cache_aware(snap, pool, req, signals, (admissible, booked), false, out);
            }
            PolicyConfig::LeastLoad => {
                let cap = self.config.bounded_load.map(|b| Self::cap(b, admissible, booked));
                self.least_load(pool.holders, req, signals, cap, FallbackReason::Policy, out);
            }
            PolicyConfig::PowerOfTwo => match signals {
                Signals::Missing => self.rotate(rt, FallbackReason::LoadSignalsMissing, out),
                _ => self.p2c(pool.holders, req, FallbackReason::Policy, out),
            },
            PolicyConfig::RoundRobin => self.rotate(rt, FallbackReason::Policy, out),
            PolicyConfig::Random => {
                let start = self.random();
                self.rotate_from(start, out);
                out.mode = MatchMode::FallbackRoundRobin;
                out.reason = Some(FallbackReason::Policy);
            }
            PolicyConfig::ConsistentHashing => match req.routing_key {
                Some(key) => {
                    self.rendezvous(xxh3_64(key), out);
                    out.mode = MatchMode::FallbackRoundRobin;
                    out.reason = Some(FallbackReason::Policy);
                }
                None => self.rotate(rt, FallbackReason::NoRoutingKey, out),
            },
            PolicyConfig::Manual(m) => match req.routing_key {
                Some(key) => self.manual(pool.holders, rt, m, xxh3_64(key), req, out),
                None => self.rotate(rt, FallbackReason::NoRoutingKey, out),
            },
            PolicyConfig::PrefixHash(ph) => {
                self.prefix_hash(
                    pool.holders,
                    ph,
                    req,
                    signals,
                    Self::cap(ph.bound, admissible, booked),
                    out,
                );
            }
        }
        if !out.ordered {
            Self::order(out);
        }
        Ok(())
    }

    /// The candidate filter and the load facts: one candidate per holder of the pool, in pool
    /// order. With `time`, queue latency is the queued work at the learned speed. Returns
    /// (admissible, admissible with a load signal, bookings on the admissible).
    fn gather(
        &self,
        pool: &[HolderSlot],
        req: &Request<'_>,
        time: bool,
        out: &mut Ranking,
    ) -> (usize, usize, u64) {
        let max_age = match self.config.load_signals {
            LoadSignals::Booked => None,
            LoadSignals::EngineReports { max_age } => Some(max_age),
        };
        let kv_room = Self::checks_kv_room(req);
        // A decode holder computes no prompt token: what it lacks is pulled from the prefill
        // worker, priced at the transfer's speed.
        let pull = (time && req.role == crate::cluster::Role::Decode).then(|| {
            let rate = self.config.transfer_tokens_per_sec.max(1);
            (1.0 / f64::from(rate), rate as f32)
        });
        out.candidates.reserve(pool.len());
        // The same loop, compiled apart for the default decision (`cache_aware` on this
        // gateway's bookings, not a decode pool, no KV room check): what it does not use is not
        // in its loop.
        if time && max_age.is_none() && !kv_room && pull.is_none() {
            Self::gather_with::<true>(pool, req, (true, None, false, None), out)
        } else {
            Self::gather_with::<false>(pool, req, (time, max_age, kv_room, pull), out)
        }
    }

    /// [`Scheduler::gather`] with `(time, max_age, kv_room, pull)` fixed to
    /// `(true, None, false, None)` under `DEFAULT`. `pull`: a decode pool's seconds per
    /// transferred token and its rate, which replace each holder's learned line.
    #[inline]
    fn gather_with<const DEFAULT: bool>(
        pool: &[HolderSlot],
        req: &Request<'_>,
        (time, max_age, kv_room, pull): (bool, Option<std::time::Duration>, bool, Option<(f64, f32)>),
        out: &mut Ranking,
    ) -> (usize, usize, u64) {
        let (time, max_age, kv_room, pull) =
            if DEFAULT { (true, None, false, None) } else { (time, max_age, kv_room, pull) };
        let now = req.now;
        let (mut admissible, mut reported, mut booked_total) = (0, 0, 0u64);
        // `cache_aware`: holders without a learned line of their own yet.
        let mut untrained = 0usize;
        for slot in pool {
            let st = &*slot.state;
            let Some(rs) = st.rank_state(slot.holder.rank) else { continue };
            let excluded = match slot.health {
                Health::Unhealthy => Some(Exclusion::Unhealthy),
                Health::Draining => Some(Exclusion::Draining),
                Health::Healthy => match st.cooldown(now) {
                    Some((class, _)) => Some(Exclusion::CoolingDown(class)),
                    None if st.breaker(now) == BreakerState::Open => Some(Exclusion::BreakerOpen),
                    None => None,
                },
            };
            let mut hot = rs.hot();
            if let Some((secs_per_token, rate)) = pull {
                (hot.secs_per_token, hot.overhead_s, hot.rate_tokens_per_sec) = (secs_per_token, 0.0, rate);
                hot.trained = true;
            }
            let booked = hot.booked_requests;
            let mut active = booked;
            let own = hot.booked_prefill_tokens;
            let mut queue_tokens = own;
            let capacity = slot.capacity;
            // `cache_aware` computes it from the queue below; the others read the prefill clock.
            let mut queue_ms =
                if time { 0.0 } else { crate::state::u64_to_f64(rs.prefill_backlog_ns(now)) * 1e-6 };
            let mut kv_usage = None;
            let load_reported = match max_age {
                None => true,
                Some(age) => match rs.engine(now, Some(age)) {
                    Some((e, _)) => {
                        active = active.max(e.running.saturating_add(e.waiting));
                        let rate = f64::from(capacity.prefill_tokens_per_sec.max(1)) / 1000.0;
                        let waiting = e
                            .waiting_prefill_tokens
                            .unwrap_or_else(|| u64::from(e.waiting).saturating_mul(rs.mean_booked_tokens()));
                        queue_ms = queue_ms.max(waiting as f64 / rate);
                        queue_tokens = own.max(waiting.saturating_add(rs.since_report_tokens()));
                        kv_usage = Some(e.kv_usage);
                        true
                    }
                    None => false,
                },
            };
            if time {
                // A holder whose requests are on average past the first token estimated at
                // their dispatch is behind its estimate (stalled, or slower than learned so
                // far): the next request waits at least that much longer too.
                queue_tokens = queue_tokens.saturating_add(Self::late_tokens(rs, now, hot.secs_per_token));
                queue_ms = hot.secs_per_token * crate::state::u64_to_f64(queue_tokens) * 1e3;
                untrained += usize::from(!hot.trained);
            }
            if excluded.is_none() {
                admissible += 1;
                reported += usize::from(load_reported);
                booked_total += u64::from(booked);
            }
            // Only where the room is checked: a decision of every pool reads this holder state.
            let kv_committed = if kv_room {
                Self::kv_committed(rs.booked_kv_blocks(), booked, active, req.kv_blocks)
            } else {
                0
            };
            let cap = capacity.kv_blocks;
            // Written in place: a push's capacity check and its copy through the stack were
            // about a tenth of the decision (the room for every holder is reserved above).
            let len = out.candidates.len();
            let Some(slot_out) = out.candidates.spare_capacity_mut().first_mut() else {
                unreachable!("the gather reserves a candidate for every holder")
            };
            slot_out.write(Candidate {
                holder: slot.holder,
                matched_tokens: 0,
                affinity_tokens: 0,
                prefill_tokens: req.prompt_tokens,
                kv_blocks: req.kv_blocks,
                kv_committed: u32::try_from(kv_committed).unwrap_or(u32::MAX),
                active_requests: active,
                booked_requests: booked,
                queue_latency_ms: queue_ms as f32,
                queue_tokens: u32::try_from(queue_tokens).unwrap_or(u32::MAX),
                rate_tokens_per_sec: hot.rate_tokens_per_sec,
                pending_tokens: 0,
                est_ttft_ms: 0.0,
                load_reported,
                kv_usage,
                ledger: hot.ledger,
                score: Score::default(),
                excluded,
                key: 0,
                facts: Facts {
                    secs_per_token: hot.secs_per_token,
                    overhead_s: hot.overhead_s,
                    cache_fill: if cap == 0 { 1.0 } else { (hot.cached_blocks / cap as f32).min(1.0) },
                },
            });
            // SAFETY: the element at `len` was initialized by the `write` just above, and it is
            // within the capacity (`spare_capacity_mut` returned it).
            unsafe { out.candidates.set_len(len + 1) };
        }
        if untrained > 0 && untrained < out.candidates.len() {
            Self::price_untrained(pool, now, out);
        }
        (admissible, reported, booked_total)
    }

    /// Queued tokens a holder's lateness stands for at `secs_per_token`: its unanswered
    /// bookings are on average past the first token estimated at their dispatch (stalled, or
    /// slower than learned so far), so the next request waits at least that much longer too.
    #[inline]
    fn late_tokens(rs: &crate::state::RankState, now: Timestamp, secs_per_token: f64) -> u64 {
        // In nanoseconds: no `Duration` built and taken apart per holder.
        let late_ns = rs.unanswered_lateness_ns(now);
        if late_ns > 0 && secs_per_token > 0.0 {
            (crate::state::u64_to_f64(late_ns) * 1e-9 / secs_per_token) as u64
        } else {
            0
        }
    }

    /// `cache_aware`: prices each holder without [`TRAINED_SAMPLES`](crate::learn::TRAINED_SAMPLES)
    /// at the mean learned line (seconds per token, overhead) of its pool's trained holders
    /// instead of the configured prior (see [`crate::learn::TRAINED_SAMPLES`]): its rate, its
    /// queue's time, and the lateness converted at that rate. Some holders of `out` are trained.
    #[cold]
    fn price_untrained(pool: &[HolderSlot], now: Timestamp, out: &mut Ranking) {
        // The gather's candidates and facts are the pool's holders in order (all have a rank).
        // A holder trained since the gather counted keeps its own line; none goes back (samples
        // only grow), so the mean has at least one line.
        let trained =
            |slot: &HolderSlot| slot.state.rank_state(slot.holder.rank).is_some_and(|rs| rs.trained());
        let (n, spt, overhead) = out
            .candidates
            .iter()
            .zip(pool)
            .filter(|(_, slot)| trained(slot))
            .fold((0.0, 0.0, 0.0), |(n, s, o), (c, _)| {
                (n + 1.0, s + c.facts.secs_per_token, o + c.facts.overhead_s)
            });
        let (spt, overhead) = (spt / n, overhead / n);
        let rate = (1.0 / spt) as f32;
        for (c, slot) in out.candidates.iter_mut().zip(pool) {
            let Some(rs) = slot.state.rank_state(slot.holder.rank) else { continue };
            if rs.trained() {
                continue;
            }
            let own =
                u64::from(c.queue_tokens).saturating_sub(Self::late_tokens(rs, now, c.facts.secs_per_token));
            let queue = own.saturating_add(Self::late_tokens(rs, now, spt));
            c.queue_tokens = u32::try_from(queue).unwrap_or(u32::MAX);
            c.queue_latency_ms = (spt * crate::state::u64_to_f64(queue) * 1e3) as f32;
            c.rate_tokens_per_sec = rate;
            (c.facts.secs_per_token, c.facts.overhead_s) = (spt, overhead);
        }
    }

    /// The KV blocks the requests in flight on a holder hold at their longest: this gateway's
    /// bookings (`own` blocks over `booked` requests), and the engine's requests beyond them
    /// (`active` counts them; another replica's) at the same mean size, or at `this` request's
    /// size when this gateway has none there.
    fn kv_committed(own: u64, booked: u32, active: u32, this: u32) -> u64 {
        let more = u64::from(active.saturating_sub(booked));
        let mean = own.checked_div(u64::from(booked)).filter(|&m| m > 0).unwrap_or(u64::from(this));
        own.saturating_add(mean.saturating_mul(more))
    }

    /// Whether the decision keeps the request off a holder it would overfill: decode holders,
    /// whose requests hold their KV for their whole generation (a prefill or regular holder's
    /// wait is in its queue estimate), when the request's size is known.
    fn checks_kv_room(req: &Request<'_>) -> bool {
        req.role == crate::cluster::Role::Decode && req.kv_blocks > 0
    }

    /// Excludes the decode holders that the request would overfill (the requests in flight
    /// there and this one need more KV blocks than the holder has), as long as one admissible
    /// holder has room: there the engine takes the request at once, where a full one queues it
    /// or preempts a running request, which then computes its whole prompt again. When none
    /// has room, all stay and the policy decides. Returns what it excluded as (holders, of
    /// them with a load signal, their bookings).
    fn exclude_kv_full(pool: &[HolderSlot], out: &mut Ranking) -> (usize, usize, u64) {
        let full = |c: &Candidate, slot: &HolderSlot| {
            let cap = slot.capacity.kv_blocks;
            cap > 0 && u64::from(c.kv_committed) + u64::from(c.kv_blocks) > u64::from(cap)
        };
        let admissible = || out.candidates.iter().zip(pool).filter(|(c, _)| c.excluded.is_none());
        if !admissible().any(|(c, slot)| !full(c, slot)) {
            return (0, 0, 0);
        }
        let mut gone = (0, 0, 0);
        for (c, slot) in out.candidates.iter_mut().zip(pool) {
            if c.excluded.is_none() && full(c, slot) {
                c.excluded = Some(Exclusion::KvFull);
                gone.0 += 1;
                gone.1 += usize::from(c.load_reported);
                gone.2 += u64::from(c.booked_requests);
            }
        }
        gone
    }

    /// Admissible first in key order, excluded after in pool order; sets `out.admissible`.
    /// Sorts the keys (each carrying its candidate's index); the candidates do not move.
    ///
    /// Only the first [`RANKED`] admissible candidates are put in order (what a proxy can use:
    /// the first and its retries); the rest follow in no particular order until
    /// [`Ranking::sort_all`] (the debug view) orders them (see [`top_sorted`]; a full sort was a
    /// sixth of a 64-holder decision).
    fn order(out: &mut Ranking) {
        // One pass: admissible keys from the front, excluded indices from the back (then put
        // back in pool order).
        let n = out.candidates.len();
        out.order.clear();
        out.order.resize(n, 0);
        let (mut front, mut back) = (0, n);
        let order = &mut out.order[..n];
        for (i, c) in out.candidates.iter().enumerate() {
            if c.excluded.is_none() {
                order[front] = c.key | i as u64;
                front += 1;
            } else {
                back -= 1;
                order[back] = i as u64;
            }
        }
        Self::rank(out, front);
    }

    /// The second half of [`Scheduler::order`], for a pass that wrote `out.order` itself: the
    /// first `admissible` keys admissible, the excluded indices after them in reverse pool order.
    fn rank(out: &mut Ranking, admissible: usize) {
        out.order[admissible..].reverse();
        let ranked = &mut out.order[..admissible];
        if ranked.len() > RANKED {
            top_sorted(ranked);
        } else {
            ranked.sort_unstable();
        }
        out.admissible = admissible;
        out.sorted = admissible <= RANKED;
        out.ordered = true;
    }

    /// Scores every admissible candidate with `scorer` and keys it by score; ties are broken by a
    /// random rotation so that equal holders share a burst. With `counted`, the score counts each
    /// candidate's matched tokens (its `affinity_tokens`); otherwise none. With `time`, each
    /// candidate's estimated TTFT is kept.
    fn score_all<T: Scorer + ?Sized>(
        &self,
        scorer: &T,
        pool: &[HolderSlot],
        req: &Request<'_>,
        counted: bool,
        time: bool,
        out: &mut Ranking,
    ) {
        let n = out.candidates.len() as u64;
        let offset = self.random() % n.max(1);
        Self::rescore(scorer, pool, req, (counted, time), offset, out);
    }

    /// [`Scheduler::score_all`] with the tie-break rotation's `offset` given; returns the index of
    /// the best candidate.
    fn rescore<T: Scorer + ?Sized>(
        scorer: &T,
        pool: &[HolderSlot],
        req: &Request<'_>,
        (counted, time): (bool, bool),
        offset: u64,
        out: &mut Ranking,
    ) -> Option<usize> {
        let n = out.candidates.len() as u64;
        let explain = out.explain;
        // As in `bound_and_score`: every key is below `u64::MAX`.
        let mut best = (u64::MAX, usize::MAX);
        for (i, c) in out.candidates.iter_mut().enumerate() {
            if c.excluded.is_some() {
                continue;
            }
            let key =
                Self::score_one(scorer, &pool[i], req, (counted, time, explain), (i as u64, n, offset), c);
            if key < best.0 {
                best = (key, i);
            }
        }
        (best.1 != usize::MAX).then_some(best.1)
    }

    /// Scores the admissible candidate `c`, the `i`-th of `n`, and keys it by its score; returns
    /// the key. See [`Scheduler::score_all`].
    #[inline(always)]
    fn score_one<T: Scorer + ?Sized>(
        scorer: &T,
        slot: &HolderSlot,
        req: &Request<'_>,
        (counted, time, explain): (bool, bool, bool),
        (i, n, offset): (u64, u64, u64),
        c: &mut Candidate,
    ) -> u64 {
        let f = c.facts;
        c.affinity_tokens = if counted { c.matched_tokens } else { 0 };
        let cached = if counted { c.affinity_tokens.max(c.pending_tokens) } else { 0 };
        let input = ScoreInput {
            holder: c.holder,
            matched_tokens: cached,
            prompt_tokens: req.prompt_tokens,
            active_requests: c.active_requests,
            queue_latency_ms: f64::from(c.queue_latency_ms),
            kv_usage: c.kv_usage,
            capacity: slot.capacity,
            queue_tokens: c.queue_tokens,
            secs_per_token: f.secs_per_token,
            overhead_s: f.overhead_s,
            cache_fill: f.cache_fill,
        };
        // Otherwise the terms stay as the gather wrote them: zero.
        if explain {
            c.score = scorer.score(&input);
        } else {
            c.score.total = scorer.total(&input);
        }
        if time {
            c.est_ttft_ms = input.est_ttft_ms() as f32;
        }
        // (i + n − offset) mod n without a division: i, offset < n.
        let t = i + n - offset;
        c.key = sort_key(desc_key(c.score.total), if t >= n { t - n } else { t });
        c.key
    }

    /// Whether the best cache holder is past the high watermark: its in-flight requests against
    /// its capacity and, for `cache_aware_v1`, its expected queue latency. `cache_aware` (`time`)
    /// already weighs each candidate's queue against the prefill its cache saves, in the same
    /// unit, so a latency threshold on top would only throw away hits that win on time.
    fn over_watermark(&self, c: &Candidate, capacity: crate::cluster::Capacity, time: bool) -> bool {
        let w = self.config.watermark;
        let limit = (w.inflight_fraction * f64::from(capacity.max_running_requests)).ceil().max(1.0);
        f64::from(c.active_requests) >= limit
            || (!time && f64::from(c.queue_latency_ms) >= w.queue_latency.as_secs_f64() * 1000.0)
    }

    /// The load bound `⌈(1+ε)·(Σbooked + 1)/n⌉` over `n` admissible holders with `Σbooked`
    /// bookings. Holders at or above it are excluded; at least one stays, since the least booked
    /// has at most the mean, which is below the cap.
    fn cap(b: BoundedLoad, admissible: usize, booked: u64) -> u64 {
        ((1.0 + b.epsilon) * (booked + 1) as f64 / admissible.max(1) as f64).ceil() as u64
    }

    fn bound(cap: u64, out: &mut Ranking) {
        let cap32 = u32::try_from(cap).unwrap_or(u32::MAX);
        for c in out.candidates.iter_mut().filter(|c| c.excluded.is_none()) {
            if u64::from(c.booked_requests) >= cap {
                c.excluded = Some(Exclusion::BoundedLoad { cap: cap32 });
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // one caller per policy; the pieces of one decision
    fn cache_aware(
        &self,
        snap: &Snapshot,
        pool: PoolRef<'_>,
        req: &Request<'_>,
        signals: Signals,
        (mut admissible, mut booked): (usize, u64),
        time: bool,
        out: &mut Ranking,
    ) {
        match signals {
            Signals::Missing => {
                let rt = &self.pools[req.role.index()];
                return self.rotate(rt, FallbackReason::LoadSignalsMissing, out);
            }
            Signals::Partial => return self.p2c(pool.holders, req, FallbackReason::LoadSignalsPartial, out),
            Signals::Complete => {}
        }
        let mut distrust = match req.cache {
            CacheView::Overlap { scores, block_tokens } => {
                for o in scores.iter() {
                    let Some(i) = snap.index_in_pool(pool.id, o.holder) else { continue };
                    let c = &mut out.candidates[i];
                    // Never a guessed hit: a holder whose ledger is not READY gets no credit even
                    // if the ledger answered for it.
                    if c.ledger == LedgerState::Ready {
                        let tokens = u64::from(o.gpu_blocks) * u64::from(block_tokens);
                        c.matched_tokens = tokens.min(u64::from(req.prompt_tokens)) as u32;
                        c.prefill_tokens = req.prompt_tokens - c.matched_tokens;
                    }
                }
                None
            }
            CacheView::Untrusted(u) => Some(FallbackReason::from(u)),
        };
        if time
            && distrust.is_none()
            && let CacheView::Overlap { block_tokens, .. } = req.cache
        {
            let mut found =
                [(HolderId::new(cortex_hash::kv::WorkerId(0), cortex_hash::kv::DpRank(0)), 0u32); 16];
            let n = self.pending.matches(req.prefix, req.now, &mut found);
            for &(holder, blocks) in &found[..n] {
                // Like its ledger's hits, a holder's prefixes in flight count only while READY.
                if let Some(i) = snap.index_in_pool(pool.id, holder)
                    && out.candidates[i].ledger == LedgerState::Ready
                {
                    let tokens = u64::from(blocks) * u64::from(block_tokens);
                    out.candidates[i].pending_tokens = tokens.min(u64::from(req.prompt_tokens)) as u32;
                }
            }
        }
        if distrust.is_none() && self.config.unready_holders == UnreadyHolders::Excluded {
            let any_ready =
                out.candidates.iter().any(|c| c.excluded.is_none() && c.ledger == LedgerState::Ready);
            if any_ready {
                for c in out
                    .candidates
                    .iter_mut()
                    .filter(|c| c.excluded.is_none() && c.ledger != LedgerState::Ready)
                {
                    c.excluded = Some(Exclusion::LedgerNotReady);
                    admissible -= 1;
                    booked -= u64::from(c.booked_requests);
                }
            } else {
                distrust = Some(FallbackReason::LedgerNotReady);
            }
        }
        if Self::checks_kv_room(req) {
            if let CacheView::Overlap { block_tokens, .. } = req.cache {
                // Its cached prefix is already in the holder's KV: only the rest is new.
                for c in &mut out.candidates {
                    c.kv_blocks = c.kv_blocks.saturating_sub(c.matched_tokens / block_tokens.max(1));
                }
            }
            let full = Self::exclude_kv_full(pool.holders, out);
            admissible -= full.0;
            booked -= full.2;
        }
        // One pass: the load bound, any hit at all (bound-excluded included), the best cache
        // holder among the admissible (most matched tokens, then fewest active), and the score
        // as if affinity counts; scored again without it in the rare decision where the best
        // cache holder turns out to be past the watermark.
        let cap = self
            .config
            .bounded_load
            .map(|b| Self::cap(b, admissible, booked))
            .map(|c| if time { c.max(TIME_BOUND_FLOOR) } else { c });
        let trusted = distrust.is_none();
        let n = out.candidates.len() as u64;
        let offset = self.random() % n.max(1);
        let Pass { any_hit, best, top, admissible } = if time {
            Self::bound_and_score(&self.scorer, pool.holders, req, cap, (trusted, true), offset, out)
        } else {
            Self::bound_and_score(&self.weighted, pool.holders, req, cap, (trusted, false), offset, out)
        };
        let over_watermark = best
            .is_some_and(|(i, _, _)| self.over_watermark(&out.candidates[i], pool.holders[i].capacity, time));
        let mut top = top;
        if trusted && over_watermark {
            top = if time {
                Self::rescore(&self.scorer, pool.holders, req, (false, true), offset, out)
            } else {
                Self::rescore(&self.weighted, pool.holders, req, (false, false), offset, out)
            };
            // The keys changed: `decide` orders them again.
        } else {
            Self::rank(out, admissible);
        }
        let top_hit = top.is_some_and(|i| out.candidates[i].affinity_tokens > 0);
        (out.mode, out.reason) = match distrust {
            Some(r) => (MatchMode::LoadAware, Some(r)),
            None if over_watermark => (MatchMode::LoadAware, Some(FallbackReason::Watermark)),
            None if top_hit => (MatchMode::ExactKvEvents, None),
            None if any_hit => (MatchMode::LoadAware, Some(FallbackReason::HitOverruled)),
            // No hit, but a holder the ledger cannot vouch for now (syncing, stale) may hold the
            // prefix: not a miss the ledger saw.
            None if out.candidates.iter().any(|c| {
                c.excluded.is_none() && matches!(c.ledger, LedgerState::Stale | LedgerState::Syncing)
            }) =>
            {
                (MatchMode::LoadAware, Some(FallbackReason::LedgerNotReady))
            }
            None => (MatchMode::LoadAware, Some(FallbackReason::NoHit)),
        };
    }

    /// `cache_aware`'s pass over the candidates: the load bound `cap`, any hit at all
    /// (bound-excluded included), the best cache holder among the admissible (most matched
    /// tokens, then fewest active) and the score with `scorer` (see [`Scheduler::score_all`]).
    /// Writes the ranking's keys as [`Scheduler::order`] would (ordered by
    /// [`Scheduler::rank`] unless the scores change again). One copy per scorer: the loop holds
    /// only its arithmetic, and one per `EXPLAIN` (whether the scores carry their terms).
    fn bound_and_score<T: Scorer + ?Sized>(
        scorer: &T,
        pool: &[HolderSlot],
        req: &Request<'_>,
        cap: Option<u64>,
        (counted, time): (bool, bool),
        offset: u64,
        out: &mut Ranking,
    ) -> Pass {
        if out.explain {
            Self::bound_and_score_with::<T, true>(scorer, pool, req, cap, (counted, time), offset, out)
        } else {
            Self::bound_and_score_with::<T, false>(scorer, pool, req, cap, (counted, time), offset, out)
        }
    }

    /// [`Scheduler::bound_and_score`] with `out.explain` fixed to `EXPLAIN`.
    fn bound_and_score_with<T: Scorer + ?Sized, const EXPLAIN: bool>(
        scorer: &T,
        pool: &[HolderSlot],
        req: &Request<'_>,
        cap: Option<u64>,
        (counted, time): (bool, bool),
        offset: u64,
        out: &mut Ranking,
    ) -> Pass {
        let cap32 = cap.map_or(u32::MAX, |c| u32::try_from(c).unwrap_or(u32::MAX));
        let mut any_hit = false;
        let mut best: Option<(usize, u32, u32)> = None;
        let n = out.candidates.len() as u64;
        // The best key so far and its index. A candidate's key leaves its low bits to the index
        // (`order` fills them), so it is below `u64::MAX` and the first admissible one takes it.
        let mut top = (u64::MAX, usize::MAX);
        // Without a cap, no holder's bookings reach it.
        let cap = cap.unwrap_or(u64::MAX);
        // The ranking's keys, written as `order` would: admissible from the front, excluded
        // from the back.
        out.order.clear();
        out.order.resize(n as usize, 0);
        let (mut front, mut back) = (0, n as usize);
        for (i, c) in out.candidates.iter_mut().enumerate() {
            if c.excluded.is_none() && u64::from(c.booked_requests) >= cap {
                c.excluded = Some(Exclusion::BoundedLoad { cap: cap32 });
            }
            any_hit |= c.matched_tokens > 0;
            if c.excluded.is_some() {
                back -= 1;
                out.order[back] = i as u64;
                continue;
            }
            if c.matched_tokens > 0
                && best.is_none_or(|(_, m, a)| (c.matched_tokens, a) > (m, c.active_requests))
            {
                best = Some((i, c.matched_tokens, c.active_requests));
            }
            let key =
                Self::score_one(scorer, &pool[i], req, (counted, time, EXPLAIN), (i as u64, n, offset), c);
            out.order[front] = key | i as u64;
            front += 1;
            if key < top.0 {
                top = (key, i);
            }
        }
        Pass { any_hit, best, top: (top.1 != usize::MAX).then_some(top.1), admissible: front }
    }

    fn least_load(
        &self,
        pool: &[HolderSlot],
        req: &Request<'_>,
        signals: Signals,
        cap: Option<u64>,
        reason: FallbackReason,
        out: &mut Ranking,
    ) {
        match signals {
            Signals::Missing => {
                let rt = &self.pools[req.role.index()];
                self.rotate(rt, FallbackReason::LoadSignalsMissing, out);
            }
            Signals::Partial => self.p2c(pool, req, FallbackReason::LoadSignalsPartial, out),
            Signals::Complete => {
                if let Some(cap) = cap {
                    Self::bound(cap, out);
                }
                self.score_all(&self.weighted, pool, req, false, false, out);
                out.mode = MatchMode::LoadAware;
                out.reason = Some(reason);
            }
        }
    }

    /// Power of two choices over the load score; the rest follow by score for retries.
    fn p2c(&self, pool: &[HolderSlot], req: &Request<'_>, reason: FallbackReason, out: &mut Ranking) {
        self.score_all(&self.weighted, pool, req, false, false, out);
        let n = out.candidates.iter().filter(|c| c.excluded.is_none()).count() as u64;
        let r = self.random();
        let a = r % n;
        let b = if n > 1 { (a + 1 + (r >> 32) % (n - 1)) % n } else { a };
        let (ia, ib) = (self.nth_admissible(out, a), self.nth_admissible(out, b));
        let (win, lose) = if out.candidates[ib].key < out.candidates[ia].key { (ib, ia) } else { (ia, ib) };
        for (i, c) in out.candidates.iter_mut().enumerate() {
            if c.excluded.is_none() {
                c.key = if i == win {
                    sort_key(0, 0)
                } else if i == lose {
                    sort_key(1, 0)
                } else {
                    c.key // a score key, above 2
                };
            }
        }
        out.mode = MatchMode::FallbackP2c;
        out.reason = Some(reason);
    }

    fn nth_admissible(&self, out: &Ranking, n: u64) -> usize {
        out.candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.excluded.is_none())
            .nth(n as usize)
            .map_or(0, |(i, _)| i)
    }

    /// Admissible candidates in pool order rotated to start at `start % n`.
    fn rotate_from(&self, start: u64, out: &mut Ranking) {
        let n = out.candidates.iter().filter(|c| c.excluded.is_none()).count() as u64;
        let start = start % n.max(1);
        for (j, c) in out.candidates.iter_mut().filter(|c| c.excluded.is_none()).enumerate() {
            c.key = sort_key(((j as u64 + n - start) % n) as u32, 0);
        }
    }

    /// Round robin over the admissible candidates (the pool's counter).
    fn rotate(&self, rt: &PoolRuntime, reason: FallbackReason, out: &mut Ranking) {
        // Relaxed: a ticket counter; only its distinctness matters.
        let start = rt.next.fetch_add(1, Ordering::Relaxed);
        self.rotate_from(start, out);
        out.mode = MatchMode::FallbackRoundRobin;
        out.reason = Some(reason);
    }

    /// Rendezvous (highest-random-weight) hashing of `key` over the admissible candidates: a
    /// consistent hash without a ring (a holder leaving moves only its own keys), and a full
    /// ranking for retries.
    fn rendezvous(&self, key: u64, out: &mut Ranking) {
        for c in out.candidates.iter_mut().filter(|c| c.excluded.is_none()) {
            let w = mix(key ^ mix(holder_bits(c.holder)));
            c.key = sort_key(!(w >> 32) as u32, w);
        }
    }

    fn manual(
        &self,
        pool: &[HolderSlot],
        rt: &PoolRuntime,
        m: ManualConfig,
        key: u64,
        req: &Request<'_>,
        out: &mut Ranking,
    ) {
        // Load scores order the rest (and pick new assignments under `MinLoad`).
        self.score_all(&self.weighted, pool, req, false, false, out);
        let mut map = rt.sticky.lock().unwrap_or_else(PoisonError::into_inner);
        let current = map
            .get(&key)
            .filter(|s| req.now.saturating_since(s.last_used) <= m.max_idle)
            .and_then(|s| out.candidates.iter().position(|c| c.excluded.is_none() && c.holder == s.holder));
        let chosen = match current {
            Some(i) => i,
            None => match m.assignment {
                Assignment::MinLoad => out
                    .candidates
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.excluded.is_none())
                    .min_by_key(|(_, c)| c.key)
                    .map_or(0, |(i, _)| i),
                Assignment::Random => {
                    let n = out.candidates.iter().filter(|c| c.excluded.is_none()).count() as u64;
                    self.nth_admissible(out, self.random() % n.max(1))
                }
            },
        };
        map.insert(key, Sticky { holder: out.candidates[chosen].holder, last_used: req.now });
        drop(map);
        for (i, c) in out.candidates.iter_mut().enumerate().filter(|(_, c)| c.excluded.is_none()) {
            c.key = if i == chosen { sort_key(0, 0) } else { c.key };
        }
        out.mode = MatchMode::FallbackRoundRobin;
        out.reason = Some(FallbackReason::Policy);
    }

    fn prefix_hash(
        &self,
        pool: &[HolderSlot],
        ph: PrefixHashConfig,
        req: &Request<'_>,
        signals: Signals,
        cap: u64,
        out: &mut Ranking,
    ) {
        let Some(last) = req.prefix.len().checked_sub(1) else {
            return self.least_load(pool, req, signals, Some(cap), FallbackReason::NoPrefix, out);
        };
        let idx = last.min(ph.prefix_blocks as usize - 1);
        Self::bound(cap, out);
        self.rendezvous(req.prefix[idx].to_bits(), out);
        out.mode = MatchMode::LoadAware;
        out.reason = Some(FallbackReason::Policy);
    }
}

/// What `cache_aware`'s pass over the candidates found (see `Scheduler::bound_and_score`).
struct Pass {
    /// Some holder, admissible or not, has a hit.
    any_hit: bool,
    /// The best cache holder among the admissible: index, matched tokens, active requests.
    best: Option<(usize, u32, u32)>,
    /// The best scored.
    top: Option<usize>,
    /// Admissible candidates, whose keys lead `Ranking::order`.
    admissible: usize,
}

/// Puts the [`RANKED`] smallest keys of `keys` (more than `RANKED`), sorted, in its first
/// `RANKED` slots; the others follow in no particular order. The first `RANKED` are sorted, then
/// each later key that beats the worst of them is inserted in place and the worst takes its
/// slot: one comparison for most keys, O(n·RANKED) at worst.
fn top_sorted(keys: &mut [u64]) {
    let (top, rest) = keys.split_at_mut(RANKED);
    top.sort_unstable();
    for k in rest.iter_mut() {
        if *k >= top[RANKED - 1] {
            continue;
        }
        let key = std::mem::replace(k, top[RANKED - 1]);
        let mut p = RANKED - 1;
        while p > 0 && top[p - 1] > key {
            top[p] = top[p - 1];
            p -= 1;
        }
        top[p] = key;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn desc_key_orders_scores_descending_nan_last() {
        // The branching form it replaced.
        let reference = |x: f32| {
            let b = if x.is_nan() { f32::NEG_INFINITY } else { x }.to_bits();
            !(if b >> 31 == 1 { !b } else { b | (1 << 31) })
        };
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let specials = [0.0, -0.0, 1.0, -1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN];
        let randoms = (0..100_000).map(|_| {
            x = mix(x);
            f32::from_bits(x as u32)
        });
        for v in specials.into_iter().chain(randoms) {
            assert_eq!(desc_key(v), reference(v), "{v} ({:#x})", v.to_bits());
        }
        let ordered = [f32::INFINITY, 3.0, 0.5, 0.0, -0.0, -0.5, -3.0, f32::NEG_INFINITY];
        assert!(ordered.windows(2).all(|w| desc_key(w[0]) <= desc_key(w[1])));
        assert_eq!(desc_key(f32::NAN), desc_key(f32::NEG_INFINITY));
    }

    #[test]
    fn top_sorted_keeps_the_smallest_in_order_and_every_key() {
        let mut orders: Vec<Vec<u64>> = vec![
            (0..64).collect(),
            (0..64).rev().collect(),
            (0..40).map(|i| i % 5).collect(),
            (0..RANKED as u64 + 1).rev().collect(),
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in [17usize, 64, 512] {
            orders.push(
                (0..n)
                    .map(|_| {
                        x = mix(x);
                        x % 1000
                    })
                    .collect(),
            );
        }
        for keys in orders {
            let mut want = keys.clone();
            want.sort_unstable();
            let mut got = keys.clone();
            top_sorted(&mut got);
            assert_eq!(&got[..RANKED], &want[..RANKED], "{keys:?}");
            got.sort_unstable();
            assert_eq!(got, want, "a permutation of {keys:?}");
        }
    }
}
