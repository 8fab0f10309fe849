//! From outcomes to numbers: cache hit ratio against the bound, simulated TTFT percentiles, load
//! imbalance per window of trace time, failures.
//!
//! Key decisions:
//! - The hit ratio is Σ `cached_tokens` / Σ prompt tokens over answered requests, both as the
//!   workers reported them, so it is what the engines saw, not what a router believed.
//! - Load imbalance is measured on routed prompt tokens (the request's tokens, counted for the
//!   worker it was routed to, in the 10-second window of trace time it arrived in): per window,
//!   the coefficient of variation across workers and max/mean; the run's figure is their mean
//!   weighted by the window's tokens, so a window with three requests does not weigh like a busy
//!   one.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};

use super::bound::{Analysis, ratio};
use super::driver::Outcome;
use super::workload::Workload;

/// Simulated TTFT percentiles, milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ttft {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

/// Load imbalance.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Load {
    /// Window length, trace time.
    pub window: Duration,
    /// Token-weighted mean over windows of the coefficient of variation across workers.
    pub cov: f64,
    /// Token-weighted mean over windows of max/mean across workers.
    pub max_over_mean: f64,
    /// Coefficient of variation of the whole run's per-worker totals.
    pub cov_total: f64,
    /// Routed prompt tokens per window (outer) per worker (inner).
    pub windows: Vec<Vec<u64>>,
    /// Requests whose worker is unknown (not counted).
    pub unattributed: usize,
    /// Workers that were routed nothing in the whole run.
    pub idle_workers: usize,
}

/// One policy's results on one workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyResult {
    /// The label (`cortex cache_aware`, `sglang-router cache_aware`, …).
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Answered with usage.
    pub ok: usize,
    /// Refused for load (429/503).
    pub shed: usize,
    /// Failed otherwise (errors, timeouts, missing usage).
    pub failed: usize,
    /// Σ prompt tokens of answered requests (worker-reported).
    pub prompt_tokens: u64,
    /// Σ cached tokens of answered requests (worker-reported).
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_ratio: f64,
    /// `hit_ratio / bound` (the bound over the same answered requests).
    pub of_bound: f64,
    /// Simulated TTFT.
    pub ttft: Ttft,
    /// Sorted simulated TTFTs, ms (for the CDF).
    pub ttft_sorted: Vec<f64>,
    /// Load imbalance.
    pub load: Load,
    /// Cortex: requests per match mode.
    pub match_modes: BTreeMap<String, usize>,
    /// Cortex: Σ predicted hit tokens.
    pub predicted_hit_tokens: Option<u64>,
    /// Answered requests whose worker-counted prompt differs from the replay's tokenization.
    pub token_mismatches: usize,
    /// Wall-clock seconds of the sending phase (first send to last answer).
    pub wall_secs: f64,
    /// 99th percentile of how late the dispatcher sent, ms.
    pub late_p99_ms: f64,
    /// Median of simulated TTFT / (wall time to the response head × compression), over requests
    /// with a simulated TTFT of at least 2 s: about 1 when the simulators keep up with the
    /// compressed clock, well below 1 when their virtual time runs slow (an overloaded replay
    /// machine). A simulator delivers a step's tokens after sleeping the step's cost, so the
    /// wall time includes every step of a TTFT.
    pub clock_ratio: Option<f64>,
    /// A few distinct errors.
    pub errors: Vec<String>,
    /// Cortex in process: each worker's learned prefill rate ÷ the simulators' true rate, for
    /// the workers with samples.
    pub learned_rate: Option<Learned>,
}

/// The learned prefill rates at the end of a run against the simulators' true one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The simulators' prefill rate, tokens per wall-clock second (`1 / (per token × speed)`).
    pub true_rate: f64,
    /// Learned ÷ true, per worker with samples, sorted.
    pub ratios: Vec<f64>,
    /// Samples behind the estimates, summed over workers.
    pub samples: u64,
}

impl Learned {
    /// From `/debug/workers`' body ([`cortex_proxy::Control::workers_view`]) of a gateway in
    /// front of simulators with `timing`: the first rank of every worker that is not a decode
    /// worker and learned from at least one sample.
    #[must_use]
    pub fn from_view(view: &Value, timing: &cortex_sim::Timing) -> Learned {
        let true_rate = 1.0 / (timing.prefill_per_token.as_secs_f64() * timing.speed);
        let mut out = Learned { true_rate, ..Learned::default() };
        for w in view["workers"].as_array().into_iter().flatten().filter(|w| w["role"] != "decode") {
            let l = &w["ranks"][0]["learned"];
            let samples = l["samples"].as_u64().unwrap_or(0);
            if let (true, Some(rate)) = (samples > 0, l["prefill_tokens_per_sec"].as_f64()) {
                out.ratios.push(rate / true_rate);
                out.samples += samples;
            }
        }
        out.ratios.sort_by(f64::total_cmp);
        out
    }

    /// The JSON form.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({"true_tokens_per_s": self.true_rate, "learned_over_true": self.ratios, "samples": self.samples})
    }

    /// The report's diagnostic: `; learned prefill rate ÷ true …`, empty without `learned` or
    /// a worker that learned.
    #[must_use]
    pub fn diagnostic(learned: Option<&Learned>) -> String {
        learned
            .and_then(Learned::summary)
            .map(|l| format!("; learned prefill rate ÷ true {l}"))
            .unwrap_or_default()
    }

    /// `median (min – max) over N workers`, or `None` without a worker that learned.
    #[must_use]
    pub fn summary(&self) -> Option<String> {
        let (first, last) = (self.ratios.first()?, self.ratios.last()?);
        Some(format!(
            "{:.2} ({:.2} – {:.2}) over {} workers, {} samples",
            percentile(&self.ratios, 50.0),
            first,
            last,
            self.ratios.len(),
            self.samples
        ))
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn cov(xs: &[u64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<u64>() as f64 / n;
    if mean == 0.0 {
        return (0.0, 0.0);
    }
    let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let max = xs.iter().copied().max().unwrap_or(0) as f64;
    (var.sqrt() / mean, max / mean)
}

/// A reference for the load goal: the token-weighted mean per-window CoV of an offline
/// assignment that knows each window's requests in advance and balances their tokens greedily
/// (largest first, to the lightest worker) — about the best any router could do on these
/// windows, cache ignored.
#[must_use]
pub fn balanced_cov(workload: &Workload, analysis: &Analysis, workers: usize) -> f64 {
    let n_windows = workload.requests.last().map_or(0, |q| (q.at.as_secs() / 10) as usize + 1);
    let mut per_window: Vec<Vec<u64>> = vec![Vec::new(); n_windows];
    for (r, &t) in workload.requests.iter().zip(&analysis.prompt_tokens) {
        per_window[(r.at.as_secs() / 10) as usize].push(t);
    }
    let (mut wsum, mut acc) = (0.0, 0.0);
    for mut reqs in per_window {
        reqs.sort_unstable_by(|a, b| b.cmp(a));
        let mut bins = vec![0u64; workers.max(1)];
        for t in reqs {
            if let Some(min) = bins.iter_mut().min() {
                *min += t;
            }
        }
        let tokens = bins.iter().sum::<u64>() as f64;
        if tokens > 0.0 {
            wsum += tokens;
            acc += cov(&bins).0 * tokens;
        }
    }
    if wsum > 0.0 { acc / wsum } else { 0.0 }
}

/// Computes one policy's results.
#[must_use]
pub fn summarize(
    label: &str,
    workload: &Workload,
    analysis: &Analysis,
    outcomes: &[Outcome],
    workers: usize,
    compression: f64,
    wall: Duration,
) -> PolicyResult {
    let mut r = PolicyResult {
        label: label.to_owned(),
        requests: outcomes.len(),
        wall_secs: wall.as_secs_f64(),
        ..PolicyResult::default()
    };
    let mut bound_hits = 0u64;
    let mut ttfts = Vec::new();
    let mut ratios = Vec::new();
    let mut predicted = 0u64;
    let mut any_predicted = false;
    let mut lates: Vec<f64> = Vec::new();
    let window = Duration::from_secs(10);
    let n_windows = workload.requests.last().map_or(0, |q| (q.at.as_secs() / 10) as usize + 1);
    let mut windows = vec![vec![0u64; workers]; n_windows];
    for (i, o) in outcomes.iter().enumerate() {
        lates.push(o.late.as_secs_f64() * 1e3);
        match o.worker {
            Some(w) if w < workers => {
                let k = (workload.requests[i].at.as_secs() / 10) as usize;
                windows[k][w] += analysis.prompt_tokens[i];
            }
            _ => r.load.unattributed += 1,
        }
        if let Some(m) = &o.match_mode {
            *r.match_modes.entry(m.clone()).or_default() += 1;
        }
        if o.ok() {
            r.ok += 1;
            r.prompt_tokens += o.prompt_tokens;
            r.cached_tokens += o.cached_tokens;
            bound_hits += analysis.bound_hits[i];
            if o.prompt_tokens != analysis.prompt_tokens[i] {
                r.token_mismatches += 1;
            }
            if let Some(p) = o.predicted_hit {
                predicted += p;
                any_predicted = true;
            }
            if let Some(t) = o.sim_ttft_ms {
                ttfts.push(t);
                let wall_ms = o.wall_head.as_secs_f64() * 1e3 * compression;
                if t >= 2000.0 && wall_ms > 0.0 {
                    ratios.push(t / wall_ms);
                }
            }
        } else if o.shed() {
            r.shed += 1;
        } else {
            r.failed += 1;
        }
        if let Some(e) = &o.error
            && r.errors.len() < 5
            && !r.errors.contains(e)
        {
            r.errors.push(e.clone());
        }
    }
    r.hit_ratio = ratio(r.cached_tokens, r.prompt_tokens);
    let bound = ratio(bound_hits, r.prompt_tokens);
    r.of_bound = if bound > 0.0 { r.hit_ratio / bound } else { 0.0 };
    ttfts.sort_by(f64::total_cmp);
    r.ttft = Ttft {
        p50: percentile(&ttfts, 50.0),
        p90: percentile(&ttfts, 90.0),
        p99: percentile(&ttfts, 99.0),
        mean: if ttfts.is_empty() { 0.0 } else { ttfts.iter().sum::<f64>() / ttfts.len() as f64 },
    };
    r.ttft_sorted = ttfts;
    ratios.sort_by(f64::total_cmp);
    r.clock_ratio = (!ratios.is_empty()).then(|| percentile(&ratios, 50.0));
    lates.sort_by(f64::total_cmp);
    r.late_p99_ms = percentile(&lates, 99.0);
    r.predicted_hit_tokens = any_predicted.then_some(predicted);
    let (mut wsum, mut cov_acc, mut mm_acc) = (0.0, 0.0, 0.0);
    for w in &windows {
        let tokens = w.iter().sum::<u64>() as f64;
        if tokens > 0.0 {
            let (c, mm) = cov(w);
            wsum += tokens;
            cov_acc += c * tokens;
            mm_acc += mm * tokens;
        }
    }
    let totals: Vec<u64> = (0..workers).map(|k| windows.iter().map(|w| w[k]).sum()).collect();
    r.load.window = window;
    r.load.cov = if wsum > 0.0 { cov_acc / wsum } else { 0.0 };
    r.load.max_over_mean = if wsum > 0.0 { mm_acc / wsum } else { 0.0 };
    r.load.cov_total = cov(&totals).0;
    r.load.idle_workers = totals.iter().filter(|&&t| t == 0).count();
    r.load.windows = windows;
    r
}

impl PolicyResult {
    /// The JSON form (CDF downsampled to 200 points).
    #[must_use]
    pub fn to_json(&self) -> Value {
        let n = self.ttft_sorted.len();
        let cdf: Vec<Value> = (1..=200usize.min(n))
            .map(|k| {
                let idx = (k * n).div_ceil(200.min(n)) - 1;
                json!([self.ttft_sorted[idx.min(n - 1)], (idx + 1) as f64 / n as f64])
            })
            .collect();
        json!({
            "policy": self.label,
            "requests": self.requests,
            "ok": self.ok,
            "shed": self.shed,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": self.hit_ratio,
            "of_bound": self.of_bound,
            "ttft_ms": {"p50": self.ttft.p50, "p90": self.ttft.p90, "p99": self.ttft.p99, "mean": self.ttft.mean},
            "ttft_cdf_ms": cdf,
            "load": {
                "window_s": self.load.window.as_secs(),
                "cov": self.load.cov,
                "max_over_mean": self.load.max_over_mean,
                "cov_total": self.load.cov_total,
                "unattributed": self.load.unattributed,
                "idle_workers": self.load.idle_workers,
                "tokens_per_window_per_worker": self.load.windows,
            },
            "match_modes": self.match_modes,
            "predicted_hit_tokens": self.predicted_hit_tokens,
            "token_mismatches": self.token_mismatches,
            "wall_s": self.wall_secs,
            "dispatch_late_p99_ms": self.late_p99_ms,
            "clock_ratio": self.clock_ratio,
            "learned_prefill_rate": self.learned_rate.as_ref().map(Learned::to_json),
            "errors": self.errors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_cov() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), 50.0);
        assert_eq!(percentile(&xs, 99.0), 99.0);
        assert_eq!(percentile(&xs, 100.0), 100.0);
        assert_eq!(cov(&[5, 5, 5, 5]), (0.0, 1.0));
        let (c, mm) = cov(&[0, 0, 0, 8]);
        assert!((c - 3f64.sqrt()).abs() < 1e-9);
        assert!((mm - 4.0).abs() < 1e-9);
    }
}
