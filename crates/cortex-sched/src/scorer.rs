//! The one seam users plug into: how a candidate's facts become a score.
//!
//! Key decision: the scheduler gathers the facts (matched tokens it may count, active requests,
//! expected queue latency, KV usage) and owns everything around the score — the candidate
//! filter, the load bound, the watermark, the degradation chain — so a custom [`Scorer`] cannot
//! weaken those guarantees; it only orders admissible candidates. Higher is better. The default,
//! [`TimeScorer`], is the shortest estimated time to first token; [`WeightedScorer`] is the
//! design's `score(w) = α·matched_tokens(w) − β·active_requests(w) − γ·expected_queue_latency(w)`
//! (`cache_aware_v1`, and the load order of the load-based policies).

use cortex_hash::kv::HolderId;

use crate::cluster::Capacity;
use crate::config::Weights;
use crate::decision::Score;

/// What the scheduler knows about one admissible candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreInput {
    /// The holder.
    pub holder: HolderId,
    /// Cached prompt tokens the score may count (0 when affinity is off for this request).
    pub matched_tokens: u32,
    /// The request's prompt length in tokens.
    pub prompt_tokens: u32,
    /// Requests in flight on the holder.
    pub active_requests: u32,
    /// Expected queue latency in milliseconds.
    pub queue_latency_ms: f64,
    /// KV usage fraction, when the engine reported it.
    pub kv_usage: Option<f32>,
    /// The holder's capacity.
    pub capacity: Capacity,
    /// Prefill tokens queued ahead of the request on the holder.
    pub queue_tokens: u32,
    /// The holder's learned prefill speed, seconds per token.
    pub secs_per_token: f64,
    /// The holder's learned fixed overhead before a first token, seconds.
    pub overhead_s: f64,
    /// How full the holder's cache is, 0–1: blocks held over its capacity (1 when either is
    /// unknown).
    pub cache_fill: f32,
}

impl ScoreInput {
    /// The estimated time to first token on this holder, milliseconds: the overhead, then the
    /// queued work and the request's uncached tokens (`prompt_tokens − matched_tokens`) at the
    /// learned speed.
    #[must_use]
    #[inline]
    pub fn est_ttft_ms(&self) -> f64 {
        let work =
            f64::from(self.queue_tokens) + f64::from(self.prompt_tokens.saturating_sub(self.matched_tokens));
        (self.overhead_s + self.secs_per_token * work) * 1e3
    }
}

/// Orders admissible candidates: higher `total` first.
pub trait Scorer: Send + Sync {
    /// The score and its breakdown: called once per admissible candidate by a decision whose
    /// ranking explains itself ([`Ranking::explaining`](crate::Ranking::explaining)), so it must
    /// be cheap and must not allocate.
    fn score(&self, input: &ScoreInput) -> Score;

    /// The score's `total` alone, what every other decision calls once per admissible
    /// candidate. It must equal `self.score(input).total` bit for bit; the default computes the
    /// whole score. A scorer whose terms cost more than their sum overrides it.
    #[inline]
    fn total(&self, input: &ScoreInput) -> f32 {
        self.score(input).total
    }
}

/// `α·matched_tokens − β·active_requests − γ·expected_queue_latency_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct WeightedScorer {
    /// α, β, γ.
    pub weights: Weights,
}

impl WeightedScorer {
    /// The affinity, load and queue terms.
    #[inline]
    fn terms(&self, i: &ScoreInput) -> (f64, f64, f64) {
        let w = self.weights;
        let affinity = w.alpha_per_token * f64::from(i.matched_tokens);
        let load = -w.beta_per_request * f64::from(i.active_requests);
        let queue = -w.gamma_per_ms * i.queue_latency_ms;
        (affinity, load, queue)
    }
}

impl Scorer for WeightedScorer {
    #[inline]
    fn score(&self, i: &ScoreInput) -> Score {
        let (affinity, load, queue) = self.terms(i);
        Score {
            affinity: affinity as f32,
            load: load as f32,
            queue: queue as f32,
            total: (affinity + load + queue) as f32,
        }
    }

    #[inline]
    fn total(&self, i: &ScoreInput) -> f32 {
        let (affinity, load, queue) = self.terms(i);
        (affinity + load + queue) as f32
    }
}

/// The shortest estimated time to first token, plus `per_active_ms` for every request already
/// active on the holder (its share of each engine step): `score = −(est_ttft_ms + per_active_ms ·
/// active_requests)`. The breakdown is in milliseconds: `affinity` is the prefill time the
/// matched tokens save, `queue` the queued work's time, `load` the active requests' term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeScorer {
    /// Milliseconds per active request.
    pub per_active_ms: f64,
    /// The weight of the prefill work the request adds, beside its own wait.
    pub recompute_weight: f64,
}

impl TimeScorer {
    /// The load term, milliseconds: the active requests' share and the prefill work the
    /// request adds.
    #[inline]
    fn load_ms(&self, i: &ScoreInput) -> f64 {
        let uncached = f64::from(i.prompt_tokens.saturating_sub(i.matched_tokens));
        // Copying into a cache with room evicts nothing: the weight scales with how full it is.
        -self.per_active_ms * f64::from(i.active_requests)
            - self.recompute_weight * f64::from(i.cache_fill) * i.secs_per_token * uncached * 1e3
    }
}

impl Scorer for TimeScorer {
    #[inline]
    fn score(&self, i: &ScoreInput) -> Score {
        let load = self.load_ms(i);
        let queue = -i.secs_per_token * f64::from(i.queue_tokens) * 1e3;
        let affinity = i.secs_per_token * f64::from(i.matched_tokens) * 1e3;
        Score {
            affinity: affinity as f32,
            load: load as f32,
            queue: queue as f32,
            total: (-i.est_ttft_ms() + load) as f32,
        }
    }

    #[inline]
    fn total(&self, i: &ScoreInput) -> f32 {
        (-i.est_ttft_ms() + self.load_ms(i)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cortex_hash::kv::{DpRank, WorkerId};

    #[test]
    fn default_formula() {
        let s = WeightedScorer {
            weights: Weights { alpha_per_token: 2.0, beta_per_request: 3.0, gamma_per_ms: 0.5 },
        };
        let got = s.score(&ScoreInput {
            holder: HolderId::new(WorkerId(1), DpRank(0)),
            matched_tokens: 100,
            prompt_tokens: 300,
            active_requests: 4,
            queue_latency_ms: 10.0,
            kv_usage: None,
            capacity: Capacity::default(),
            queue_tokens: 0,
            secs_per_token: 0.001,
            overhead_s: 0.0,
            cache_fill: 1.0,
        });
        assert_eq!(got, Score { affinity: 200.0, load: -12.0, queue: -5.0, total: 183.0 });
    }

    /// `total` is `score().total`, bit for bit, for both scorers: the decision orders by the
    /// one and the debug view shows the other.
    #[test]
    fn the_total_alone_is_the_score_s_total() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x = x.wrapping_mul(0x5851_f42d_4c95_7f2d).wrapping_add(0x1405_7b7e_f767_814f);
            x >> 11
        };
        let weighted = WeightedScorer {
            weights: Weights { alpha_per_token: 0.7, beta_per_request: 3.0, gamma_per_ms: 0.25 },
        };
        for _ in 0..20_000 {
            let mut r = || (next() % 100_000) as u32;
            let input = ScoreInput {
                holder: HolderId::new(WorkerId(1), DpRank(0)),
                matched_tokens: r(),
                prompt_tokens: r(),
                active_requests: r() % 64,
                queue_latency_ms: f64::from(r()) / 7.0,
                kv_usage: None,
                capacity: Capacity::default(),
                queue_tokens: r(),
                secs_per_token: 1.0 / f64::from(r().max(1)),
                overhead_s: f64::from(r()) * 1e-6,
                cache_fill: (r() % 1_001) as f32 / 1_000.0,
            };
            let time = TimeScorer {
                per_active_ms: f64::from(r() % 100) / 10.0,
                recompute_weight: f64::from(r() % 4),
            };
            for (s, name) in [(&time as &dyn Scorer, "time"), (&weighted as &dyn Scorer, "weighted")] {
                assert_eq!(s.total(&input).to_bits(), s.score(&input).total.to_bits(), "{name}: {input:?}");
            }
        }
    }

    #[test]
    fn time_is_overhead_queue_and_uncached_work() {
        let input = ScoreInput {
            holder: HolderId::new(WorkerId(1), DpRank(0)),
            matched_tokens: 1_000,
            prompt_tokens: 1_500,
            active_requests: 4,
            queue_latency_ms: 0.0,
            kv_usage: None,
            capacity: Capacity::default(),
            queue_tokens: 2_000,
            secs_per_token: 0.001, // 1,000 tokens/s
            overhead_s: 0.010,
            cache_fill: 1.0,
        };
        // 10 ms + (2,000 queued + 500 uncached) ms = 2,510 ms; 4 active × 0.5 ms.
        assert!((input.est_ttft_ms() - 2_510.0).abs() < 1e-9);
        let s = TimeScorer { per_active_ms: 0.5, recompute_weight: 0.0 }.score(&input);
        assert_eq!(s, Score { affinity: 1_000.0, load: -2.0, queue: -2_000.0, total: -2_512.0 });
    }
}
