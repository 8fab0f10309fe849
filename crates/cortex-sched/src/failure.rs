//! Failure classes, their cooldowns, and the per-worker circuit breaker's settings.
//!
//! Key decision (from the Pixiu cluster-runtime RFC): not every failure is the worker's fault. The
//! proxy, which sees HTTP, classifies a failure once into a [`FailureClass`]; the scheduler, which
//! owns the worker state, decides what that means. A context-length or content-policy error is a
//! property of the request, so it never cools the worker down and never counts toward its circuit
//! breaker; a rate limit cools it down without tripping the breaker; server errors and timeouts do
//! both. How long each cooldown lasts is configuration ([`Cooldowns`]).

use std::fmt;
use std::time::Duration;

/// Why a request failed on a worker, as classified by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// HTTP 429 or an engine's "too many requests": cool down, go elsewhere.
    RateLimited,
    /// A 5xx or a broken connection: short cooldown, counts toward the breaker.
    ServerError,
    /// Connect or response timeout: cooldown, counts toward the breaker.
    Timeout,
    /// The prompt does not fit this worker's context: the request is the problem; no cooldown.
    ContextLengthExceeded,
    /// A quota or budget ran out: long cooldown until it resets.
    QuotaExhausted,
    /// A content-policy refusal: the request is the problem; no cooldown.
    ContentPolicy,
}

impl FailureClass {
    /// Every class, in declaration order.
    pub const ALL: [FailureClass; 6] = [
        FailureClass::RateLimited,
        FailureClass::ServerError,
        FailureClass::Timeout,
        FailureClass::ContextLengthExceeded,
        FailureClass::QuotaExhausted,
        FailureClass::ContentPolicy,
    ];

    /// Snake-case name for metrics labels and debug output.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureClass::RateLimited => "rate_limited",
            FailureClass::ServerError => "server_error",
            FailureClass::Timeout => "timeout",
            FailureClass::ContextLengthExceeded => "context_length_exceeded",
            FailureClass::QuotaExhausted => "quota_exhausted",
            FailureClass::ContentPolicy => "content_policy",
        }
    }

    /// True when the failure says something is wrong with the worker (the circuit breaker counts
    /// it); false when it is about the request or a deliberate refusal.
    #[must_use]
    pub const fn is_worker_fault(self) -> bool {
        matches!(self, FailureClass::ServerError | FailureClass::Timeout)
    }

    pub(crate) const fn code(self) -> u8 {
        match self {
            FailureClass::RateLimited => 1,
            FailureClass::ServerError => 2,
            FailureClass::Timeout => 3,
            FailureClass::ContextLengthExceeded => 4,
            FailureClass::QuotaExhausted => 5,
            FailureClass::ContentPolicy => 6,
        }
    }

    pub(crate) const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(FailureClass::RateLimited),
            2 => Some(FailureClass::ServerError),
            3 => Some(FailureClass::Timeout),
            4 => Some(FailureClass::ContextLengthExceeded),
            5 => Some(FailureClass::QuotaExhausted),
            6 => Some(FailureClass::ContentPolicy),
            _ => None,
        }
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How long a worker is skipped after a failure of each class that cools it down.
///
/// Context-length and content-policy failures have no field: they never cool a worker down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cooldowns {
    /// After a 429.
    pub rate_limited: Duration,
    /// After a server error (short).
    pub server_error: Duration,
    /// After a timeout.
    pub timeout: Duration,
    /// After a quota ran out (long: until the window resets).
    pub quota_exhausted: Duration,
}

impl Cooldowns {
    /// The cooldown a failure of `class` starts, if any.
    #[must_use]
    pub const fn for_class(&self, class: FailureClass) -> Option<Duration> {
        match class {
            FailureClass::RateLimited => Some(self.rate_limited),
            FailureClass::ServerError => Some(self.server_error),
            FailureClass::Timeout => Some(self.timeout),
            FailureClass::QuotaExhausted => Some(self.quota_exhausted),
            FailureClass::ContextLengthExceeded | FailureClass::ContentPolicy => None,
        }
    }
}

impl Default for Cooldowns {
    fn default() -> Self {
        Cooldowns {
            rate_limited: Duration::from_secs(5),
            server_error: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
            quota_exhausted: Duration::from_secs(300),
        }
    }
}

/// The per-worker circuit breaker (SGLang router parity: open after consecutive worker faults,
/// half-open after a delay, closed after consecutive successes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive worker faults ([`FailureClass::is_worker_fault`]) that open the breaker.
    pub failure_threshold: u32,
    /// How long an open breaker keeps the worker out before letting trial requests through.
    pub open_for: Duration,
    /// Consecutive successes in half-open state that close the breaker.
    pub close_after_successes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        // SGLang router: --cb-failure-threshold 10, --cb-timeout-duration-secs 60,
        // --cb-success-threshold 3.
        BreakerConfig { failure_threshold: 10, open_for: Duration::from_secs(60), close_after_successes: 3 }
    }
}

/// The circuit breaker's position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Requests flow.
    Closed,
    /// The worker is skipped until the open period ends.
    Open,
    /// The open period ended: requests flow as trials; a worker fault reopens it.
    HalfOpen,
}

impl BreakerState {
    /// Snake-case name for metrics labels and debug output.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_no_class_is_code_zero() {
        for c in FailureClass::ALL {
            assert_eq!(FailureClass::from_code(c.code()), Some(c));
            assert_ne!(c.code(), 0);
        }
        assert_eq!(FailureClass::from_code(0), None);
    }

    #[test]
    fn request_problems_never_cool_down_and_never_trip_the_breaker() {
        let c = Cooldowns::default();
        let table = [
            (FailureClass::RateLimited, Some(c.rate_limited), false),
            (FailureClass::ServerError, Some(c.server_error), true),
            (FailureClass::Timeout, Some(c.timeout), true),
            (FailureClass::ContextLengthExceeded, None, false),
            (FailureClass::QuotaExhausted, Some(c.quota_exhausted), false),
            (FailureClass::ContentPolicy, None, false),
        ];
        for (class, cooldown, fault) in table {
            assert_eq!(c.for_class(class), cooldown, "{class}");
            assert_eq!(class.is_worker_fault(), fault, "{class}");
        }
        assert!(c.quota_exhausted > c.rate_limited && c.rate_limited > c.server_error);
    }
}
