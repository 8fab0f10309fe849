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
    /// Cortex: each worker's learned prefill rate ÷ the simulators' true rate, for the workers
    /// with samples, and how far the estimated times to first token were from the real ones.
    pub learned_rate: Option<Learned>,
    /// Cortex `cache_aware`: the load bound checked at every dispatch, from the client's side.
    pub cap: Option<CapCheck>,
}

/// The learned prefill rates at the end of a run against the simulators' true one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Learned {
    /// The simulators' prefill rate, tokens per wall-clock second (`1 / (per token × speed)`).
    pub true_rate: f64,
    /// Learned ÷ true, per worker with samples, sorted (each replica's workers, for replicas).
    pub ratios: Vec<f64>,
    /// Samples behind the estimates, summed over workers.
    pub samples: u64,
    /// How far the gateway's estimated times to first token were from the times the requests
    /// took (dispatch to the streaming answer's first chunk), over every worker and replica.
    pub errors: Option<EstimateError>,
}

/// The estimate errors of `/debug/workers` (`ranks[].learned.estimate_error`), merged.
#[derive(Clone, Debug, PartialEq)]
pub struct EstimateError {
    /// The errors, wall-clock seconds, as the gateways count them.
    pub errors: cortex_sched::EstimateErrors,
    /// Trace time per wall-clock time (the replay's compression).
    pub compression: f64,
}

impl EstimateError {
    fn new(compression: f64) -> Self {
        EstimateError { errors: cortex_sched::EstimateErrors::default(), compression }
    }

    /// Adds one holder's `estimate_error` object.
    fn add(&mut self, v: &Value) {
        let e = &mut self.errors;
        for (key, h) in [("abs_buckets", &mut e.abs_s), ("relative_buckets", &mut e.relative)] {
            for pair in v[key]["counts"].as_array().into_iter().flatten() {
                if let (Some(i), Some(c)) = (pair[0].as_u64(), pair[1].as_u64()) {
                    h.add(i as usize, u32::try_from(c).unwrap_or(u32::MAX));
                }
            }
        }
        let n = v["samples"].as_f64().unwrap_or(0.0);
        e.sum_signed_s += v["mean_signed_ms"].as_f64().unwrap_or(0.0) * n / 1e3;
    }

    /// Requests counted.
    #[must_use]
    pub fn samples(&self) -> u64 {
        self.errors.count()
    }

    /// The `q`-quantile of the absolute error, milliseconds of trace time.
    #[must_use]
    pub fn abs_ms(&self, q: f64) -> f64 {
        self.errors.abs_s.quantile(q).unwrap_or(0.0) * 1e3 * self.compression
    }

    /// The mean signed error (taken − estimated), milliseconds of trace time.
    #[must_use]
    pub fn mean_signed_ms(&self) -> f64 {
        self.errors.sum_signed_s * 1e3 * self.compression / self.samples().max(1) as f64
    }

    /// The JSON form.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "samples": self.samples(),
            "abs_trace_ms": {"p50": self.abs_ms(0.5), "p90": self.abs_ms(0.9)},
            "relative": {"p50": self.errors.relative.quantile(0.5), "p90": self.errors.relative.quantile(0.9)},
            "mean_signed_trace_ms": self.mean_signed_ms(),
        })
    }
}

impl std::fmt::Display for EstimateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "|taken − estimated| p50 {:.0} ms, p90 {:.0} ms (relative {:.2}, {:.2}; mean signed {:+.0} ms) over {} requests",
            self.abs_ms(0.5),
            self.abs_ms(0.9),
            self.errors.relative.quantile(0.5).unwrap_or(0.0),
            self.errors.relative.quantile(0.9).unwrap_or(0.0),
            self.mean_signed_ms(),
            self.samples()
        )
    }
}

impl Learned {
    /// From `/debug/workers`' bodies ([`cortex_proxy::Control::workers_view`]) of one gateway
    /// or of each replica, in front of simulators with `timing` and the replay's `compression`:
    /// the first rank of every worker that is not a decode worker and learned from at least one
    /// sample.
    #[must_use]
    pub fn from_views(views: &[Value], timing: &cortex_sim::Timing, compression: f64) -> Learned {
        let true_rate = 1.0 / (timing.prefill_per_token.as_secs_f64() * timing.speed);
        let mut out = Learned { true_rate, ..Learned::default() };
        let mut errors = EstimateError::new(compression);
        for view in views {
            for w in view["workers"].as_array().into_iter().flatten().filter(|w| w["role"] != "decode") {
                let l = &w["ranks"][0]["learned"];
                let samples = l["samples"].as_u64().unwrap_or(0);
                if let (true, Some(rate)) = (samples > 0, l["prefill_tokens_per_sec"].as_f64()) {
                    out.ratios.push(rate / true_rate);
                    out.samples += samples;
                }
                errors.add(&l["estimate_error"]);
            }
        }
        out.ratios.sort_by(f64::total_cmp);
        out.errors = (errors.samples() > 0).then_some(errors);
        out
    }

    /// The JSON form.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "true_tokens_per_s": self.true_rate,
            "learned_over_true": self.ratios,
            "samples": self.samples,
            "estimate_error": self.errors.as_ref().map(EstimateError::to_json),
        })
    }

    /// The report's diagnostic: `; learned prefill rate ÷ true …` and the estimate's error,
    /// empty without `learned` or a worker that learned.
    #[must_use]
    pub fn diagnostic(learned: Option<&Learned>) -> String {
        let Some(l) = learned else { return String::new() };
        let mut s = l.summary().map(|r| format!("; learned prefill rate ÷ true {r}")).unwrap_or_default();
        if let Some(e) = &l.errors {
            s.push_str(&format!("; estimated TTFT {e}"));
        }
        s
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

/// The load bound (`scheduler.bounded_load_epsilon`, [deployment.md]) checked at every
/// request's arrival at its worker. A worker's requests are counted from when it received them
/// (`x-sim-arrived-unix-us`; the client's send when absent) to when the client saw the answer
/// end: the worker's real load. The in-flight total B the bound scales with is counted from each
/// request's send, as the clients see it: the gateway has booked a request somewhere between
/// its send and its arrival, and under a burst it plans requests a while after they were sent
/// and in another order, so counting B from the arrivals would leave out requests the gateway
/// had already counted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CapCheck {
    /// Gateway replicas (request `i` went to replica `i mod N`).
    pub replicas: usize,
    /// The bound's ε.
    pub epsilon: f64,
    /// The least the bound allows a holder (`cortex_sched::TIME_BOUND_FLOOR` for `cache_aware`).
    pub floor: u64,
    /// Arrivals checked (answered requests with a known worker).
    pub dispatches: usize,
    /// Arrivals after which the replica's own requests on the worker exceeded
    /// max(⌈(1 + ε)(Bᵣ + 1)/n⌉, floor), Bᵣ the replica's other requests in flight (what each
    /// replica guarantees on its own).
    pub own_over: usize,
    /// The most a replica's own requests on a worker exceeded that bound by, requests.
    pub own_worst_excess: u32,
    /// Arrivals after which all requests on the worker exceeded (1 + ε)(B + N)/n + N·floor, B
    /// all other requests in flight (the cross-replica bound deployment.md states).
    pub all_over: usize,
    /// The most any worker held at an arrival, over the cross-replica bound at that moment.
    pub worst_over_bound: f64,
    /// The most requests in flight on one worker.
    pub max_in_flight: u32,
}

impl CapCheck {
    /// Checks `outcomes` (sent round robin to `replicas` replicas in front of `workers`
    /// workers) against the bound at `epsilon` with `floor`.
    #[must_use]
    pub fn measure(
        outcomes: &[Outcome],
        replicas: usize,
        workers: usize,
        (epsilon, floor): (f64, u64),
    ) -> CapCheck {
        const END: u8 = 0;
        const SENT: u8 = 1;
        const ARRIVED: u8 = 2;
        let replicas = replicas.max(1);
        // (time, kind, request): at one instant, ends first, then sends, then arrivals.
        let mut events: Vec<(Duration, u8, usize)> = Vec::new();
        for (i, o) in outcomes.iter().enumerate() {
            if o.worker.is_some_and(|w| w < workers) && o.wall_end > Duration::ZERO {
                let end = o.sent_at + o.wall_end;
                events.push((o.sent_at, SENT, i));
                events.push((o.arrived_at.unwrap_or(o.sent_at).clamp(o.sent_at, end), ARRIVED, i));
                events.push((end, END, i));
            }
        }
        events.sort_unstable();
        let mut on = vec![vec![0u32; workers]; replicas];
        let mut on_worker = vec![0u32; workers];
        let mut of_replica = vec![0u32; replicas];
        let mut total = 0u32;
        let n = workers as f64;
        let mut c = CapCheck { replicas, epsilon, floor, ..CapCheck::default() };
        let floor = floor as f64;
        for (_, kind, i) in events {
            let (w, r) = (outcomes[i].worker.unwrap_or(0), i % replicas);
            match kind {
                END => {
                    on[r][w] -= 1;
                    on_worker[w] -= 1;
                    of_replica[r] -= 1;
                    total -= 1;
                }
                SENT => {
                    of_replica[r] += 1;
                    total += 1;
                }
                _ => {
                    // B and Bᵣ: the others in flight (this one was counted at its send).
                    let own = ((1.0 + epsilon) * f64::from(of_replica[r]) / n).ceil().max(floor);
                    let all = (1.0 + epsilon) * (f64::from(total) - 1.0 + replicas as f64) / n
                        + replicas as f64 * floor;
                    on[r][w] += 1;
                    on_worker[w] += 1;
                    c.dispatches += 1;
                    c.own_over += usize::from(f64::from(on[r][w]) > own);
                    c.own_worst_excess = c.own_worst_excess.max((f64::from(on[r][w]) - own).max(0.0) as u32);
                    c.all_over += usize::from(f64::from(on_worker[w]) > all);
                    c.worst_over_bound = c.worst_over_bound.max(f64::from(on_worker[w]) / all);
                    c.max_in_flight = c.max_in_flight.max(on_worker[w]);
                }
            }
        }
        c
    }

    /// The JSON form.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "replicas": self.replicas,
            "epsilon": self.epsilon,
            "floor": self.floor,
            "dispatches": self.dispatches,
            "own_bound_exceeded": self.own_over,
            "own_bound_worst_excess": self.own_worst_excess,
            "cross_replica_bound_exceeded": self.all_over,
            "worst_in_flight_over_cross_replica_bound": self.worst_over_bound,
            "max_in_flight_on_one_worker": self.max_in_flight,
        })
    }
}

impl std::fmt::Display for CapCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "load bound (ε {}, at each arrival; B counted from the sends) over {} requests: a replica's own bound exceeded {} times, by at most {}; \
             (1 + ε)(B + N)/n + N·{} exceeded {} times, worst {:.2}× it; at most {} in flight on one worker",
            self.epsilon,
            self.dispatches,
            self.own_over,
            self.own_worst_excess,
            self.floor,
            self.all_over,
            self.worst_over_bound,
            self.max_in_flight
        )
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
            "load_bound": self.cap.as_ref().map(CapCheck::to_json),
            "errors": self.errors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(worker: usize, sent_ms: u64, took_ms: u64) -> Outcome {
        Outcome {
            worker: Some(worker),
            sent_at: Duration::from_millis(sent_ms),
            wall_end: Duration::from_millis(took_ms),
            ..Outcome::default()
        }
    }

    /// Two workers, ε 0: one replica may put at most ⌈(B + 1)/2⌉ on a worker. Three requests
    /// overlapping on worker 0 exceed it at the second (⌈2/2⌉ = 1) and the third (⌈3/2⌉ = 2);
    /// a request that ended before the next was sent no longer counts.
    #[test]
    fn the_cap_check_counts_dispatches_over_the_bound() {
        let spread = [outcome(0, 0, 100), outcome(1, 10, 100), outcome(0, 200, 50), outcome(1, 300, 10)];
        let c = CapCheck::measure(&spread, 1, 2, (0.0, 1));
        assert_eq!((c.dispatches, c.own_over, c.all_over, c.max_in_flight), (4, 0, 0, 1), "{c:?}");
        let piled = [outcome(0, 0, 100), outcome(0, 10, 100), outcome(0, 20, 100), outcome(1, 500, 1)];
        let c = CapCheck::measure(&piled, 1, 2, (0.0, 1));
        assert_eq!((c.own_over, c.own_worst_excess, c.max_in_flight), (2, 1, 3), "{c:?}");
        // Cross-replica bound with one replica: (B + 1)/2 + 1 = 2 at the third (B = 2): 3 > 2.5.
        assert_eq!(c.all_over, 1, "{c:?}");
        // Two replicas: requests alternate; each replica's own count on worker 0 is at most 2.
        let c = CapCheck::measure(&piled, 2, 2, (0.0, 1));
        assert_eq!(c.own_over, 1, "{c:?}");
        // On its worker from its arrival: the second request, sent at 10 ms, reached its worker
        // only after the first ended (a gateway busy planning a burst).
        let mut late = piled[..2].to_vec();
        late[1].arrived_at = Some(Duration::from_millis(105));
        let c = CapCheck::measure(&late, 1, 2, (0.0, 1));
        assert_eq!((c.own_over, c.max_in_flight), (0, 1), "{c:?}");
        // In B from its send: a request sent (and not yet arrived) when another arrives raises
        // the bound: ⌈(1 + 1)/2⌉ = 1 without it, ⌈(2 + 1)/2⌉ = 2 with it.
        let mut burst = vec![outcome(0, 0, 100), outcome(0, 1, 100), outcome(1, 2, 100)];
        burst[1].arrived_at = Some(Duration::from_millis(5));
        burst[2].arrived_at = Some(Duration::from_millis(50));
        let c = CapCheck::measure(&burst, 1, 2, (0.0, 1));
        assert_eq!(c.own_over, 0, "{c:?}");
        burst[2].sent_at = Duration::from_millis(6);
        assert_eq!(CapCheck::measure(&burst, 1, 2, (0.0, 1)).own_over, 1);
        // A floor of 2 allows the second request on a worker whatever B.
        assert_eq!(CapCheck::measure(&burst, 1, 2, (0.0, 2)).own_over, 0);
        assert_eq!(CapCheck::measure(&piled, 1, 2, (0.0, 2)).own_over, 1);
        // A request with no answer (no end) or no worker is not counted.
        let mut partial = piled.to_vec();
        partial[1].wall_end = Duration::ZERO;
        partial[2].worker = None;
        assert_eq!(CapCheck::measure(&partial, 1, 2, (0.0, 1)).dispatches, 2);
    }

    /// Two replicas' views, each with one worker's errors: merged, and read in trace time.
    #[test]
    fn estimate_errors_merge_across_views() {
        let view = |bucket: u64, signed_ms: f64| {
            json!({"workers": [{"role": "regular", "ranks": [{"learned": {
                "samples": 2, "prefill_tokens_per_sec": 100.0,
                "estimate_error": {"samples": 2, "mean_signed_ms": signed_ms,
                    "abs_buckets": {"counts": [[bucket, 2]]}, "relative_buckets": {"counts": [[1, 2]]}}}}]}]})
        };
        let timing = cortex_sim::Timing::default();
        let l = Learned::from_views(&[view(40, 10.0), view(40, -30.0)], &timing, 4.0);
        let e = l.errors.expect("errors");
        assert_eq!(e.samples(), 4);
        // Bucket 40 ends at 0.1 ms · 2^10 = 102.4 ms of wall time, 409.6 ms of trace time.
        let p50 = e.abs_ms(0.5);
        assert!(p50 > 409.6 / 1.19 && p50 <= 409.6, "{p50}");
        assert!((e.mean_signed_ms() - (-10.0 * 4.0)).abs() < 1e-9, "{}", e.mean_signed_ms());
        assert_eq!(l.ratios.len(), 2);
    }

    #[test]
    fn the_bound_s_epsilon_follows_the_scheduler_settings() {
        assert_eq!(super::super::bound_epsilon(""), Some(1.0));
        assert_eq!(super::super::bound_epsilon("gamma: 2, bounded_load_epsilon: 0.5"), Some(0.5));
        assert_eq!(super::super::bound_epsilon("bounded_load_epsilon: null, gamma: 1"), None);
    }

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
