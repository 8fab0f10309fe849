//! Time as the scheduler sees it: a timestamp the caller supplies.
//!
//! Key decision: nothing in this crate reads a clock. Every operation that depends on time
//! (cooldowns, the circuit breaker, the age of an engine's load report, sticky-assignment expiry,
//! TTFT samples) takes `now: Timestamp`. The proxy passes its monotonic clock
//! ([`MonotonicClock`]); tests and simulations pass virtual time, so no test sleeps.

use std::time::Duration;

/// A point on the caller's monotonic clock, in nanoseconds since that clock's origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The clock's origin.
    pub const ZERO: Timestamp = Timestamp(0);

    /// `nanos` nanoseconds after the origin.
    #[must_use]
    pub const fn from_nanos(nanos: u64) -> Self {
        Timestamp(nanos)
    }

    /// `millis` milliseconds after the origin (convenient in tests and simulations).
    #[must_use]
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis.saturating_mul(1_000_000))
    }

    /// Nanoseconds since the origin.
    #[must_use]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at the end of time.
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self − earlier`, or zero when `earlier` is later.
    #[must_use]
    pub const fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX` (584 years).
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The production clock: [`std::time::Instant`] measured from the clock's creation.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: std::time::Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    #[must_use]
    pub fn new() -> Self {
        MonotonicClock { origin: std::time::Instant::now() }
    }

    /// The current time.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        Timestamp(duration_nanos(self.origin.elapsed()))
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Timestamp::from_millis(5);
        assert_eq!(t.saturating_add(Duration::from_millis(2)), Timestamp::from_millis(7));
        assert_eq!(Timestamp::from_millis(7).saturating_since(t), Duration::from_millis(2));
        assert_eq!(t.saturating_since(Timestamp::from_millis(7)), Duration::ZERO);
        assert_eq!(
            Timestamp::from_nanos(u64::MAX).saturating_add(Duration::from_secs(1)).as_nanos(),
            u64::MAX
        );
    }
}
