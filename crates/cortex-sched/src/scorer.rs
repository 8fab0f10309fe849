//! The one seam users plug into: how a candidate's facts become a score.
//!
//! Key decision: the scheduler gathers the facts (matched tokens it may count, active requests,
//! expected queue latency, KV usage) and owns everything around the score — the candidate
//! filter, the load bound, the watermark, the degradation chain — so a custom [`Scorer`] cannot
//! weaken those guarantees; it only orders admissible candidates. Higher is better. The default,
//! [`WeightedScorer`], is the design's
//! `score(w) = α·matched_tokens(w) − β·active_requests(w) − γ·expected_queue_latency(w)`.

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
}

/// Orders admissible candidates: higher `total` first.
pub trait Scorer: Send + Sync {
    /// The score and its breakdown. Called once per admissible candidate per decision, so it
    /// must be cheap and must not allocate.
    fn score(&self, input: &ScoreInput) -> Score;
}

/// `α·matched_tokens − β·active_requests − γ·expected_queue_latency_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct WeightedScorer {
    /// α, β, γ.
    pub weights: Weights,
}

impl Scorer for WeightedScorer {
    #[inline]
    fn score(&self, i: &ScoreInput) -> Score {
        let w = self.weights;
        let affinity = w.alpha_per_token * f64::from(i.matched_tokens);
        let load = -w.beta_per_request * f64::from(i.active_requests);
        let queue = -w.gamma_per_ms * i.queue_latency_ms;
        Score {
            affinity: affinity as f32,
            load: load as f32,
            queue: queue as f32,
            total: (affinity + load + queue) as f32,
        }
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
        });
        assert_eq!(got, Score { affinity: 200.0, load: -12.0, queue: -5.0, total: 183.0 });
    }
}
