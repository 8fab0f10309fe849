//! The scheduler's configuration: plain typed structs, validated once.
//!
//! Key decision: no file format here. The gateway binary owns the YAML schema and converts it
//! with a validating `TryFrom` into these structs; this crate only states what each knob means,
//! in its own units (durations are [`Duration`], optional features are `Option`, modes are
//! enums — no `-1` sentinels, no `bool` mode flags), and refuses values that make no sense
//! ([`SchedConfig::validate`], [`HealthPolicy::validate`]) naming the offending key.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::failure::{BreakerConfig, Cooldowns};

/// The weights of the default score
/// `score(w) = α·matched_tokens(w) − β·active_requests(w) − γ·expected_queue_latency_ms(w)`.
///
/// With α = 1 every term is in "prompt tokens worth of prefill": γ converts a millisecond of
/// expected queueing into tokens (a worker that prefills 10,000 tokens/s recomputes 10 tokens per
/// millisecond), and β is the price of one more concurrent request in tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// α: value of one prompt token already in the holder's GPU KV cache.
    pub alpha_per_token: f64,
    /// β: cost of one active (in-flight) request on the holder.
    pub beta_per_request: f64,
    /// γ: cost of one millisecond of expected queue latency on the holder.
    pub gamma_per_ms: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights { alpha_per_token: 1.0, beta_per_request: 32.0, gamma_per_ms: 10.0 }
    }
}

/// The high watermark: when the best cache holder is at or above either limit, affinity is given
/// up for the request (the cache gain no longer pays for the queue).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Watermark {
    /// In-flight limit as a fraction of the holder's `max_running_requests` (rounded up).
    pub inflight_fraction: f64,
    /// Expected queue latency limit.
    pub queue_latency: Duration,
}

impl Default for Watermark {
    fn default() -> Self {
        Watermark { inflight_fraction: 1.0, queue_latency: Duration::from_secs(2) }
    }
}

/// Consistent hashing with bounded loads (Mirrokni et al.): no holder takes more than
/// ⌈(1 + ε)·mean⌉ requests in flight, where the mean counts the request being placed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BoundedLoad {
    /// ε > 0; 0.25 gives SGLang's `prefix_hash` factor of 1.25.
    pub epsilon: f64,
}

/// Where the load terms come from, and so when load signals count as missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadSignals {
    /// This gateway's own bookings are the load (it is the only sender, as Dynamo assumes): the
    /// signals are always complete.
    Booked,
    /// Engine-reported running/waiting/KV usage, combined with bookings. A holder whose last
    /// report is older than `max_age` (or absent) has a missing signal: some missing degrades to
    /// `fallback_p2c`, all missing to `fallback_round_robin`.
    EngineReports {
        /// Age beyond which a report no longer counts.
        max_age: Duration,
    },
}

/// What happens to a holder whose ledger is not READY (as the ingest side last told the state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnreadyHolders {
    /// It takes load-routed traffic: a candidate with no cache credit.
    LoadRouted,
    /// Under exact routing it is excluded (reason `ledger_not_ready`), unless no holder is READY,
    /// in which case the request is load-routed over all of them.
    Excluded,
}

/// The policies, by the names SGLang's router uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// `cache_aware`: each candidate's estimated time to first token — the prefill work queued
    /// ahead of the request and its own uncached tokens (exact, from the ledger), at the
    /// holder's learned prefill speed — the shortest first (see [`crate::learn`]).
    CacheAware,
    /// `cache_aware_v1`: the ledger's exact overlap weighed against load in prompt tokens,
    /// `α·matched − β·active − γ·queue latency` (the first wave's default, kept selectable so that
    /// comparisons stay reproducible).
    CacheAwareV1,
    /// `round_robin`.
    RoundRobin,
    /// `random`.
    Random,
    /// `power_of_two`: two random candidates, the less loaded wins.
    PowerOfTwo,
    /// `least_load`: the load terms of the scorer alone.
    LeastLoad,
    /// `consistent_hashing`: rendezvous hashing on the caller's routing key (a header value).
    ConsistentHashing,
    /// `manual`: sticky routing key → holder assignment with idle expiry.
    Manual,
    /// `prefix_hash`: rendezvous hashing on the prompt's leading blocks, with bounded loads.
    PrefixHash,
}

impl PolicyKind {
    /// Every policy.
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::CacheAware,
        PolicyKind::CacheAwareV1,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::PowerOfTwo,
        PolicyKind::LeastLoad,
        PolicyKind::ConsistentHashing,
        PolicyKind::Manual,
        PolicyKind::PrefixHash,
    ];

    /// The name in configuration, metrics and debug output (SGLang's spelling).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::CacheAwareV1 => "cache_aware_v1",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::ConsistentHashing => "consistent_hashing",
            PolicyKind::Manual => "manual",
            PolicyKind::PrefixHash => "prefix_hash",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown routing policy (expected one of cache_aware, cache_aware_v1, round_robin, random, power_of_two, least_load, consistent_hashing, manual, prefix_hash)"
)]
pub struct UnknownPolicy;

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or(UnknownPolicy)
    }
}

/// How the `manual` policy assigns a key it has not seen (or whose holder went away).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// The least-loaded admissible holder.
    MinLoad,
    /// A random admissible holder.
    Random,
}

/// Settings of the `manual` policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManualConfig {
    /// An assignment unused for this long is forgotten (SGLang: 4 h).
    pub max_idle: Duration,
    /// How new keys are placed.
    pub assignment: Assignment,
}

impl Default for ManualConfig {
    fn default() -> Self {
        ManualConfig { max_idle: Duration::from_secs(4 * 3600), assignment: Assignment::MinLoad }
    }
}

/// Settings of the `prefix_hash` policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixHashConfig {
    /// How many leading blocks form the key (SGLang: 256 tokens = 16 blocks of 16).
    pub prefix_blocks: u32,
    /// The load bound.
    pub bound: BoundedLoad,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        PrefixHashConfig { prefix_blocks: 16, bound: BoundedLoad { epsilon: 0.25 } }
    }
}

/// A policy with its settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PolicyConfig {
    /// See [`PolicyKind::CacheAware`]; watermark, bound and [`SchedConfig::per_active_ms`] come
    /// from [`SchedConfig`].
    CacheAware,
    /// See [`PolicyKind::CacheAwareV1`]; weights, watermark and bound come from [`SchedConfig`].
    CacheAwareV1,
    /// See [`PolicyKind::RoundRobin`].
    RoundRobin,
    /// See [`PolicyKind::Random`].
    Random,
    /// See [`PolicyKind::PowerOfTwo`].
    PowerOfTwo,
    /// See [`PolicyKind::LeastLoad`]; the bound of [`SchedConfig::bounded_load`] applies.
    LeastLoad,
    /// See [`PolicyKind::ConsistentHashing`].
    ConsistentHashing,
    /// See [`PolicyKind::Manual`].
    Manual(ManualConfig),
    /// See [`PolicyKind::PrefixHash`].
    PrefixHash(PrefixHashConfig),
}

impl PolicyConfig {
    /// The policy's name.
    #[must_use]
    pub const fn kind(&self) -> PolicyKind {
        match self {
            PolicyConfig::CacheAware => PolicyKind::CacheAware,
            PolicyConfig::CacheAwareV1 => PolicyKind::CacheAwareV1,
            PolicyConfig::RoundRobin => PolicyKind::RoundRobin,
            PolicyConfig::Random => PolicyKind::Random,
            PolicyConfig::PowerOfTwo => PolicyKind::PowerOfTwo,
            PolicyConfig::LeastLoad => PolicyKind::LeastLoad,
            PolicyConfig::ConsistentHashing => PolicyKind::ConsistentHashing,
            PolicyConfig::Manual(_) => PolicyKind::Manual,
            PolicyConfig::PrefixHash(_) => PolicyKind::PrefixHash,
        }
    }

    /// The policy `kind` with default settings (selection by name).
    #[must_use]
    pub fn with_defaults(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::CacheAware => PolicyConfig::CacheAware,
            PolicyKind::CacheAwareV1 => PolicyConfig::CacheAwareV1,
            PolicyKind::RoundRobin => PolicyConfig::RoundRobin,
            PolicyKind::Random => PolicyConfig::Random,
            PolicyKind::PowerOfTwo => PolicyConfig::PowerOfTwo,
            PolicyKind::LeastLoad => PolicyConfig::LeastLoad,
            PolicyKind::ConsistentHashing => PolicyConfig::ConsistentHashing,
            PolicyKind::Manual => PolicyConfig::Manual(ManualConfig::default()),
            PolicyKind::PrefixHash => PolicyConfig::PrefixHash(PrefixHashConfig::default()),
        }
    }
}

/// One policy per pool: regular workers, and the prefill and decode pools of a disaggregated
/// cluster (SGLang's `--policy`, `--prefill-policy`, `--decode-policy`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolPolicies {
    /// Workers that serve whole requests.
    pub regular: PolicyConfig,
    /// The prefill pool.
    pub prefill: PolicyConfig,
    /// The decode pool.
    pub decode: PolicyConfig,
}

impl Default for PoolPolicies {
    fn default() -> Self {
        // Cache-aware in every pool. A decode worker that holds a prompt's prefix pulls only the
        // rest (vLLM's NIXL connector; SGLang's decode side with its radix cache), so its matched
        // blocks are transfer saved; a decode worker that publishes nothing (SGLang without the
        // decode radix cache) matches nothing, and the same scorer chooses it by load alone.
        // (SGLang's router uses power-of-two on the decode pool: it cannot see decode caches.)
        PoolPolicies {
            regular: PolicyConfig::CacheAware,
            prefill: PolicyConfig::CacheAware,
            decode: PolicyConfig::CacheAware,
        }
    }
}

/// Everything the decision needs besides the snapshot and the request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedConfig {
    /// α, β, γ of `cache_aware_v1` and of the load-based policies' scores.
    pub weights: Weights,
    /// `cache_aware`: milliseconds one more active request on a holder adds to the estimated
    /// time to first token (its decode share of every engine step), beside the learned prefill
    /// time.
    pub per_active_ms: f64,
    /// `cache_aware`: how much the prefill work a request would add to a holder counts beside
    /// the request's own wait, as a fraction of that work's time (0: the request's own time to
    /// first token alone). Recomputing a prefix that another holder has costs every later
    /// request on this one that time, and duplicates the prefix in a second cache.
    pub recompute_weight: f64,
    /// `cache_aware` in a decode pool: how fast a decode holder pulls the prompt tokens it
    /// lacks from the prefill worker (the KV transfer), tokens per second. A decode holder's
    /// uncached tokens and the pulls booked ahead of the request are priced at this speed
    /// instead of a learned prefill line: a decode worker computes none of them.
    pub transfer_tokens_per_sec: u32,
    /// The high watermark of the cache-aware policy.
    pub watermark: Watermark,
    /// Bounded loads for `cache_aware` and `least_load` (`None`: no bound).
    pub bounded_load: Option<BoundedLoad>,
    /// Where load comes from.
    pub load_signals: LoadSignals,
    /// Holders whose ledger is not READY.
    pub unready_holders: UnreadyHolders,
    /// The policy of each pool.
    pub pools: PoolPolicies,
    /// Seed of the `random`, `power_of_two` and `manual` (random assignment) choices; fixed so
    /// that simulations replay exactly.
    pub seed: u64,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            weights: Weights::default(),
            per_active_ms: 0.5,
            recompute_weight: 1.0,
            transfer_tokens_per_sec: 200_000,
            watermark: Watermark::default(),
            bounded_load: Some(BoundedLoad { epsilon: 1.0 }),
            load_signals: LoadSignals::Booked,
            unready_holders: UnreadyHolders::LoadRouted,
            pools: PoolPolicies::default(),
            seed: 0x5eed_c0de_cafe_f00d,
        }
    }
}

/// What happens to a worker when requests fail or finish: cooldowns, circuit breaker, smoothing.
/// Held by the cluster and copied into each worker's state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HealthPolicy {
    /// Cooldown per failure class.
    pub cooldowns: Cooldowns,
    /// The circuit breaker (`None`: disabled).
    pub breaker: Option<BreakerConfig>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy { cooldowns: Cooldowns::default(), breaker: Some(BreakerConfig::default()) }
    }
}

/// A configuration value that makes no sense; names the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A weight is negative or not finite.
    #[error("scheduler weight `{0}` must be finite and >= 0")]
    Weight(&'static str),
    /// ε of a bounded load is not > 0 and finite.
    #[error("`{0}` (epsilon) must be finite and > 0")]
    Epsilon(&'static str),
    /// The watermark fraction is not > 0 and finite.
    #[error("`watermark.inflight_fraction` must be finite and > 0")]
    WatermarkFraction,
    /// `prefix_hash.prefix_blocks` is 0.
    #[error("`prefix_hash.prefix_blocks` must be >= 1")]
    PrefixBlocks,
    /// The transfer speed is 0.
    #[error("`transfer_tokens_per_sec` must be >= 1")]
    TransferRate,
    /// A breaker threshold is 0.
    #[error("`breaker.{0}` must be >= 1")]
    Breaker(&'static str),
}

fn weight_ok(w: f64) -> bool {
    w.is_finite() && w >= 0.0
}

fn epsilon_ok(e: f64) -> bool {
    e.is_finite() && e > 0.0
}

impl SchedConfig {
    /// Refuses values that make no sense.
    ///
    /// # Errors
    /// The first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = self.weights;
        for (name, v) in
            [("alpha", w.alpha_per_token), ("beta", w.beta_per_request), ("gamma", w.gamma_per_ms)]
        {
            if !weight_ok(v) {
                return Err(ConfigError::Weight(name));
            }
        }
        if !weight_ok(self.per_active_ms) {
            return Err(ConfigError::Weight("per_active_ms"));
        }
        if !weight_ok(self.recompute_weight) {
            return Err(ConfigError::Weight("recompute_weight"));
        }
        if self.transfer_tokens_per_sec == 0 {
            return Err(ConfigError::TransferRate);
        }
        if !(self.watermark.inflight_fraction.is_finite() && self.watermark.inflight_fraction > 0.0) {
            return Err(ConfigError::WatermarkFraction);
        }
        if let Some(b) = self.bounded_load
            && !epsilon_ok(b.epsilon)
        {
            return Err(ConfigError::Epsilon("bounded_load"));
        }
        for p in [self.pools.regular, self.pools.prefill, self.pools.decode] {
            if let PolicyConfig::PrefixHash(ph) = p {
                if ph.prefix_blocks == 0 {
                    return Err(ConfigError::PrefixBlocks);
                }
                if !epsilon_ok(ph.bound.epsilon) {
                    return Err(ConfigError::Epsilon("prefix_hash.bound"));
                }
            }
        }
        Ok(())
    }
}

impl HealthPolicy {
    /// Refuses values that make no sense.
    ///
    /// # Errors
    /// The first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(b) = self.breaker {
            if b.failure_threshold == 0 {
                return Err(ConfigError::Breaker("failure_threshold"));
            }
            if b.close_after_successes == 0 {
                return Err(ConfigError::Breaker("close_after_successes"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip_with_sglang_spellings() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>(), Ok(k));
            assert_eq!(PolicyConfig::with_defaults(k).kind(), k);
        }
        assert_eq!("cache-aware".parse::<PolicyKind>(), Err(UnknownPolicy));
    }

    #[test]
    fn validation_names_the_key() {
        assert_eq!(SchedConfig::default().validate(), Ok(()));
        assert_eq!(HealthPolicy::default().validate(), Ok(()));
        let mut c = SchedConfig::default();
        c.weights.beta_per_request = -1.0;
        assert_eq!(c.validate(), Err(ConfigError::Weight("beta")));
        let mut c =
            SchedConfig { bounded_load: Some(BoundedLoad { epsilon: 0.0 }), ..SchedConfig::default() };
        assert_eq!(c.validate(), Err(ConfigError::Epsilon("bounded_load")));
        c.bounded_load = None;
        c.pools.decode =
            PolicyConfig::PrefixHash(PrefixHashConfig { prefix_blocks: 0, ..Default::default() });
        assert_eq!(c.validate(), Err(ConfigError::PrefixBlocks));
        c.pools.decode = PolicyConfig::RoundRobin;
        c.watermark.inflight_fraction = f64::NAN;
        assert_eq!(c.validate(), Err(ConfigError::WatermarkFraction));
        let h = HealthPolicy {
            breaker: Some(BreakerConfig { failure_threshold: 0, ..BreakerConfig::default() }),
            ..HealthPolicy::default()
        };
        assert_eq!(h.validate(), Err(ConfigError::Breaker("failure_threshold")));
    }
}
