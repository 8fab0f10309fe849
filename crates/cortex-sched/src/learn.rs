//! Learning each holder's prefill speed online: the time to first token a request will see there
//! is `overhead + work / rate`, where `work` is the prompt tokens the engine must prefill before
//! the request's first token (the queue ahead of it, then its own uncached tokens).
//!
//! Key decisions:
//! - **A decayed least-squares line, not a ratio.** `ttft = a + b·work` is fitted over the recent
//!   samples (each older sample's weight shrinks by a constant factor per new sample, half-life
//!   [`HALF_LIFE_SAMPLES`]): small requests are mostly overhead, large ones mostly rate, and a
//!   ratio of sums would mix the two. When the recent works are too alike to separate `a` from
//!   `b`, `a` keeps its prior and `b` is the ratio of what is left.
//! - **The configured rate is only the prior**: it enters as pseudo-samples of weight
//!   [`PRIOR_WEIGHT`] at two work sizes, so a cold holder has an estimate; their weight halves
//!   every [`PRIOR_HALF_LIFE_SAMPLES`] real samples (faster than the samples' own decay: far from
//!   the real works, the prior's points would otherwise tilt the line for long).
//! - **Samples are what the engine did, never what was predicted**: the time from dispatch to a
//!   streaming response's first chunk (a non-streaming response's first byte comes after
//!   generation, and a request that never reached a first chunk says nothing), or the prefill
//!   tokens and busy time an engine reports between two load reports (SGLang `/v1/loads`).
//! - Pure and allocation-free; [`crate::state`] keeps one per holder behind a mutex and
//!   publishes its estimate through atomics for the decision path.

/// Samples after which an old sample weighs half as much.
pub const HALF_LIFE_SAMPLES: f64 = 32.0;

/// Total weight of the prior's pseudo-samples.
pub const PRIOR_WEIGHT: f64 = 4.0;

/// Real samples after which the prior weighs half as much.
pub const PRIOR_HALF_LIFE_SAMPLES: f64 = 4.0;

/// Real samples after which a holder's own line is its estimate in decisions (the prior then
/// weighs a quarter of its start). Before, `cache_aware` prices the holder at the mean line of
/// its pool's holders that have as many: the same model on, most likely, the same hardware,
/// where the configured prior may be several times off — and a holder that looks slower than it
/// is may never be chosen, so never learn.
pub const TRAINED_SAMPLES: u64 = 8;

/// How long a trained holder may go without a sample while its pool's others take some before it
/// forgets its line (see [`crate::Snapshot::forget_starved`]).
pub const STARVED_AFTER: std::time::Duration = std::time::Duration::from_secs(20);

/// Work sizes (tokens) of the prior's two pseudo-samples.
const PRIOR_WORKS: [f64; 2] = [512.0, 8192.0];

/// The estimate: seconds of fixed overhead, and seconds per token of prefill work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Seconds before any token is prefilled (scheduling, one step's fixed cost).
    pub overhead_s: f64,
    /// Seconds per prompt token of prefill work.
    pub secs_per_token: f64,
}

impl Estimate {
    /// Prefill tokens per second.
    #[must_use]
    pub fn rate(&self) -> f64 {
        1.0 / self.secs_per_token
    }

    /// Seconds until the first token for `work` tokens of prefill work.
    #[must_use]
    pub fn ttft_s(&self, work: f64) -> f64 {
        self.overhead_s + self.secs_per_token * work
    }
}

/// A decayed least-squares fit of `ttft = overhead + secs_per_token · work`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateFit {
    /// The real samples' decayed sums.
    sums: Sums,
    /// The prior's pseudo-samples at weight 1 (scaled by their own decay when fitting).
    prior_sums: Sums,
    prior: Estimate,
    samples: u64,
}

/// Weighted sums of a least-squares line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Sums {
    n: f64,
    sw: f64,
    st: f64,
    sww: f64,
    swt: f64,
}

impl Sums {
    fn add(&mut self, w: f64, t: f64, weight: f64) {
        self.n += weight;
        self.sw += weight * w;
        self.st += weight * t;
        self.sww += weight * w * w;
        self.swt += weight * w * t;
    }

    fn scaled(self, k: f64) -> Sums {
        Sums { n: self.n * k, sw: self.sw * k, st: self.st * k, sww: self.sww * k, swt: self.swt * k }
    }

    fn plus(self, o: Sums) -> Sums {
        Sums {
            n: self.n + o.n,
            sw: self.sw + o.sw,
            st: self.st + o.st,
            sww: self.sww + o.sww,
            swt: self.swt + o.swt,
        }
    }
}

/// The most times faster than its prior an estimate may claim a holder is.
const MAX_OVER_PRIOR: f64 = 100.0;

/// The slowest and fastest rates an estimate may claim (tokens per second).
const MIN_RATE: f64 = 1.0;
const MAX_RATE: f64 = 1e9;

impl RateFit {
    /// A fit whose prior is `rate` tokens per second and `overhead_s` seconds.
    #[must_use]
    pub fn new(rate: f64, overhead_s: f64) -> Self {
        let prior = Estimate {
            overhead_s: overhead_s.max(0.0),
            secs_per_token: 1.0 / rate.clamp(MIN_RATE, MAX_RATE),
        };
        let mut prior_sums = Sums::default();
        for w in PRIOR_WORKS {
            prior_sums.add(w, prior.ttft_s(w), PRIOR_WEIGHT / PRIOR_WORKS.len() as f64);
        }
        RateFit { sums: Sums::default(), prior_sums, prior, samples: 0 }
    }

    /// Adds a sample: `work` tokens of prefill work took `ttft_s` seconds. Returns false (and
    /// ignores it) when the sample cannot be one: no work, or a time that is not a positive
    /// finite number.
    pub fn observe(&mut self, work: f64, ttft_s: f64) -> bool {
        if !(work.is_finite() && work > 0.0 && ttft_s.is_finite() && ttft_s > 0.0) {
            return false;
        }
        self.sums = self.sums.scaled(0.5f64.powf(1.0 / HALF_LIFE_SAMPLES));
        self.sums.add(work, ttft_s, 1.0);
        self.samples += 1;
        true
    }

    /// Forgets every real sample: the estimate is the prior's again.
    pub fn forget(&mut self) {
        self.sums = Sums::default();
        self.samples = 0;
    }

    /// Real samples observed so far.
    #[must_use]
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The current estimate.
    #[must_use]
    pub fn estimate(&self) -> Estimate {
        let prior = 0.5f64.powf(self.samples as f64 / PRIOR_HALF_LIFE_SAMPLES);
        let s = self.sums.plus(self.prior_sums.scaled(prior));
        let mean_w = s.sw / s.n;
        let var_w = s.sww / s.n - mean_w * mean_w;
        // The works must spread enough (relative to their size) to separate the two terms.
        let fitted = (var_w > (0.05 * mean_w) * (0.05 * mean_w)).then(|| {
            let b = (s.swt / s.n - mean_w * s.st / s.n) / var_w;
            (s.st / s.n - b * mean_w, b)
        });
        // A line that does not rise with the work (noise: a few samples, a stall on small
        // requests) says nothing about the rate; clamped, it would claim the fastest rate there
        // is. The ratio of what is left after the prior's overhead says something, and the plain
        // ratio (no overhead) always does: every sample took positive time.
        let (a, b) = match fitted {
            Some((a, b)) if b > 0.0 && b.is_finite() => (a, b),
            _ => {
                let a = self.prior.overhead_s;
                let b = (s.st - a * s.n) / s.sw;
                if b > 0.0 { (a, b) } else { (0.0, s.st / s.sw) }
            }
        };
        // A nearly flat line that still rises would claim an absurd rate too: no estimate is more
        // than `MAX_OVER_PRIOR` times faster than the configured prior.
        let fastest = (self.prior.secs_per_token / MAX_OVER_PRIOR).max(1.0 / MAX_RATE);
        let b = if b.is_finite() { b.clamp(fastest, 1.0 / MIN_RATE) } else { self.prior.secs_per_token };
        let a = if a.is_finite() { a.max(0.0) } else { self.prior.overhead_s };
        Estimate { overhead_s: a, secs_per_token: b }
    }
}

/// Buckets of a [`LogHistogram`]: four per doubling, 20 doublings above the first bucket.
pub const LOG_BUCKETS: usize = 82;

/// Buckets per doubling of a [`LogHistogram`] (each bucket spans a factor of 2^¼, about 19 %).
pub const PER_DOUBLING: f64 = 4.0;

/// A histogram of positive values on a log scale: bucket 0 holds `[0, lo]`, bucket `i ≥ 1`
/// holds `(lo·2^((i−1)/4), lo·2^(i/4)]`, the last bucket everything above. Fixed size, no
/// allocation; quantiles are read by interpolating inside a bucket (off by at most one bucket's
/// width, 19 %).
#[derive(Clone, Debug, PartialEq)]
pub struct LogHistogram {
    lo: f64,
    counts: [u32; LOG_BUCKETS],
}

impl LogHistogram {
    /// An empty histogram whose first bucket ends at `lo` (> 0).
    #[must_use]
    pub const fn new(lo: f64) -> Self {
        LogHistogram { lo, counts: [0; LOG_BUCKETS] }
    }

    /// The upper edge of bucket `i` (infinite for the last).
    #[must_use]
    pub fn upper(&self, i: usize) -> f64 {
        if i + 1 >= LOG_BUCKETS { f64::INFINITY } else { self.lo * (i as f64 / PER_DOUBLING).exp2() }
    }

    /// The lower edge of bucket `i` (0 for the first).
    #[must_use]
    pub fn lower(&self, i: usize) -> f64 {
        if i == 0 { 0.0 } else { self.lo * ((i - 1) as f64 / PER_DOUBLING).exp2() }
    }

    /// Counts `v` (a negative or non-finite value is not counted).
    pub fn record(&mut self, v: f64) {
        if !(v.is_finite() && v >= 0.0) {
            return;
        }
        let i = if v <= self.lo {
            0
        } else {
            // The first i with v ≤ lo·2^(i/4); the `min` keeps a rounding at an edge in range.
            (((v / self.lo).log2() * PER_DOUBLING).ceil() as usize).min(LOG_BUCKETS - 1)
        };
        self.counts[i] = self.counts[i].saturating_add(1);
    }

    /// Adds bucket `i`'s `count` (a histogram read back from its sparse form).
    pub fn add(&mut self, i: usize, count: u32) {
        if let Some(c) = self.counts.get_mut(i) {
            *c = c.saturating_add(count);
        }
    }

    /// Values counted.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|&c| u64::from(c)).sum()
    }

    /// The non-empty buckets: `(index, count)`.
    pub fn sparse(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, c)| (i, *c))
    }

    /// The `q`-quantile (`q` in [0, 1]), interpolated linearly inside its bucket; `None` when
    /// empty. A quantile in the last, open bucket is its lower edge.
    #[must_use]
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * n as f64;
        let mut below = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            let c = f64::from(c);
            if c > 0.0 && below + c >= rank {
                let (lo, hi) = (self.lower(i), self.upper(i));
                if !hi.is_finite() {
                    return Some(lo);
                }
                return Some(lo + (hi - lo) * ((rank - below) / c).clamp(0.0, 1.0));
            }
            below += c;
        }
        Some(self.lower(LOG_BUCKETS - 1))
    }
}

/// How far a holder's estimated times to first token were from what it did: the estimate the
/// decision ranked the holder by, against the time from dispatch to a streaming answer's first
/// chunk (the samples the learner takes).
#[derive(Clone, Debug, PartialEq)]
pub struct EstimateErrors {
    /// |actual − estimated|, seconds (first bucket up to 0.1 ms).
    pub abs_s: LogHistogram,
    /// |actual − estimated| ÷ actual (first bucket up to 0.001).
    pub relative: LogHistogram,
    /// Σ (actual − estimated), seconds: positive when the estimates are too short on the whole.
    pub sum_signed_s: f64,
}

impl Default for EstimateErrors {
    fn default() -> Self {
        EstimateErrors {
            abs_s: LogHistogram::new(1e-4),
            relative: LogHistogram::new(1e-3),
            sum_signed_s: 0.0,
        }
    }
}

impl EstimateErrors {
    /// Counts one request estimated at `estimated_s` that took `actual_s`.
    pub fn record(&mut self, estimated_s: f64, actual_s: f64) {
        if !(estimated_s.is_finite() && actual_s.is_finite() && actual_s > 0.0) {
            return;
        }
        let e = actual_s - estimated_s;
        self.abs_s.record(e.abs());
        self.relative.record(e.abs() / actual_s);
        self.sum_signed_s += e;
    }

    /// Requests counted.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.abs_s.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic noise source in [-1, 1).
    fn noise(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    #[test]
    fn the_prior_is_the_estimate_until_samples_come() {
        let f = RateFit::new(10_000.0, 0.005);
        let e = f.estimate();
        assert!((e.rate() - 10_000.0).abs() < 1.0, "{e:?}");
        assert!((e.overhead_s - 0.005).abs() < 1e-9, "{e:?}");
        assert_eq!(f.samples(), 0);
    }

    /// A prior eight times too fast (10,000 against a true 1,250 tokens/s), ±30 % noise on
    /// every sample, requests arriving in batches (each batch's later requests have the earlier
    /// ones' work ahead of them): within 10 % of the true rate after 100 requests.
    #[test]
    fn it_converges_from_a_prior_far_from_the_truth() {
        let (true_rate, true_overhead) = (1_250.0, 0.02);
        let mut f = RateFit::new(10_000.0, 0.0);
        let mut seed = 7;
        let mut requests = 0;
        while requests < 100 {
            let batch = 1 + (noise(&mut seed).abs() * 4.0) as usize;
            let mut ahead = 0.0;
            for _ in 0..batch {
                let own = 200.0 + (noise(&mut seed) + 1.0) * 2_000.0;
                let work = ahead + own;
                let ttft = (true_overhead + work / true_rate) * (1.0 + 0.3 * noise(&mut seed));
                assert!(f.observe(work, ttft));
                ahead = work;
                requests += 1;
            }
        }
        let e = f.estimate();
        assert!((e.rate() / true_rate - 1.0).abs() < 0.10, "learned {:.0} tokens/s", e.rate());
    }

    #[test]
    fn impossible_samples_are_ignored() {
        let mut f = RateFit::new(1_000.0, 0.0);
        let before = f.estimate();
        for (w, t) in [(0.0, 1.0), (100.0, 0.0), (100.0, -1.0), (f64::NAN, 1.0), (100.0, f64::INFINITY)] {
            assert!(!f.observe(w, t), "{w} {t}");
        }
        assert_eq!(f.estimate(), before);
        assert_eq!(f.samples(), 0);
    }

    /// Samples of one size cannot separate overhead from rate: the overhead keeps its prior and
    /// the rate explains the rest.
    #[test]
    fn alike_samples_keep_the_prior_overhead() {
        let mut f = RateFit::new(1_000.0, 0.01);
        for _ in 0..500 {
            f.observe(4_000.0, 0.01 + 4_000.0 / 2_000.0);
        }
        let e = f.estimate();
        assert!((e.rate() / 2_000.0 - 1.0).abs() < 0.02, "{e:?}");
        assert!((e.overhead_s - 0.01).abs() < 1e-3, "{e:?}");
    }

    /// TTFTs that fall as the work grows (a stall on the small requests, then quick large ones)
    /// fit a falling line: the estimate is then the ratio of time to work, never the fastest
    /// rate the clamp allows (a hot-spot replay learned a worker at 80,000 times its true rate,
    /// 10^9 tokens/s).
    #[test]
    fn a_falling_line_is_no_rate() {
        let mut f = RateFit::new(12_500.0, 0.0005);
        for k in 0..20 {
            let (work, ttft) = if k % 2 == 0 { (100.0, 0.120) } else { (2_000.0, 0.020) };
            assert!(f.observe(work, ttft));
        }
        let e = f.estimate();
        // Σttft / Σwork over the samples is ~0.07 s per 1,050 tokens: ~15,000 tokens/s.
        assert!(e.rate() > 1_000.0 && e.rate() < 100_000.0, "{e:?}");
        // A line that rises, but hardly: at most 100 times the prior.
        let mut f = RateFit::new(12_500.0, 0.0005);
        for k in 0..20 {
            let work = if k % 2 == 0 { 100.0 } else { 2_000.0 };
            assert!(f.observe(work, 0.050 + work * 1e-12));
        }
        assert!(f.estimate().rate() <= 12_500.0 * 100.0 * 1.001, "{:?}", f.estimate());
    }

    /// The rate follows a change (a worker slowed by other traffic) within a few half-lives.
    #[test]
    fn it_follows_a_change() {
        let mut f = RateFit::new(1_000.0, 0.0);
        let mut seed = 3;
        for k in 0..600 {
            let rate = if k < 300 { 1_000.0 } else { 400.0 };
            let work = 500.0 + (noise(&mut seed) + 1.0) * 1_500.0;
            f.observe(work, work / rate);
        }
        assert!((f.estimate().rate() / 400.0 - 1.0).abs() < 0.05, "{:?}", f.estimate());
    }

    #[test]
    fn a_log_histogram_puts_values_in_their_bucket_and_reads_quantiles() {
        let mut h = LogHistogram::new(1.0);
        assert_eq!(h.quantile(0.5), None);
        for v in [0.0, 0.5, 1.0] {
            h.record(v);
        }
        assert_eq!(h.sparse().collect::<Vec<_>>(), vec![(0, 3)]);
        // 2 = 1·2^(4/4): the upper edge of bucket 4; a hair above it is in bucket 5.
        h.record(2.0);
        h.record(2.0001);
        assert_eq!(h.sparse().collect::<Vec<_>>(), vec![(0, 3), (4, 1), (5, 1)]);
        for v in [f64::NAN, -1.0, f64::INFINITY] {
            h.record(v);
        }
        assert_eq!(h.count(), 5);
        h.record(1e12);
        assert_eq!(h.sparse().last(), Some((LOG_BUCKETS - 1, 1)));
        // Uniform values: every quantile within one bucket's width of the exact one.
        let mut h = LogHistogram::new(1e-3);
        for k in 1..=10_000 {
            h.record(f64::from(k) * 1e-3);
        }
        for (q, exact) in [(0.5, 5.0), (0.9, 9.0), (0.1, 1.0)] {
            let got = h.quantile(q).expect("values");
            assert!((got / exact - 1.0).abs() < 0.19, "q{q}: {got} against {exact}");
        }
    }

    #[test]
    fn estimate_errors_count_absolute_relative_and_signed() {
        let mut e = EstimateErrors::default();
        e.record(0.100, 0.150);
        e.record(0.300, 0.250);
        e.record(0.1, 0.0);
        e.record(f64::NAN, 1.0);
        assert_eq!(e.count(), 2);
        assert!((e.sum_signed_s - 0.0).abs() < 1e-12, "{}", e.sum_signed_s);
        let p = e.abs_s.quantile(1.0).expect("two");
        assert!((0.05 / 1.19..=0.05 * 1.19).contains(&p), "{p}");
        let r = e.relative.quantile(1.0).expect("two");
        assert!((0.33 / 1.19..=0.34 * 1.19).contains(&r), "{r}");
    }
}
