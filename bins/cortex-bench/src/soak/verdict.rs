//! The soak's judgement, as pure functions of what was recorded: whether the gateway's memory is
//! flat, which failures the injected faults explain, and the Prometheus text the figures are
//! read from.
//!
//! Key decisions:
//! - Flatness is judged on the second half of the run, where start-up allocation is over, on a
//!   trailing moving average of the one-second RSS samples (so one sample taken in the middle of
//!   a burst of allocations does not decide), as `(max - min) / min` of that smoothed series.
//! - Only a worker kill explains a failed request: one that was in flight at the kill, or started
//!   before the worker was back (plus a grace), on that worker when the gateway said which.
//!   Event gaps and publisher restarts change routing, never a request's fate, so they explain
//!   nothing; every other failure fails the soak.

use std::time::Duration;

/// How flat a series is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Flatness {
    /// Smallest value of the smoothed series.
    pub min: f64,
    /// Largest value of the smoothed series.
    pub max: f64,
    /// `(max - min) / min`.
    pub spread: f64,
}

/// The trailing moving average of `xs` over `window` samples (fewer at the start).
#[must_use]
pub fn smooth(xs: &[f64], window: usize) -> Vec<f64> {
    let w = window.max(1);
    let mut out = Vec::with_capacity(xs.len());
    let mut sum = 0.0;
    for (i, x) in xs.iter().enumerate() {
        sum += x;
        if i >= w {
            sum -= xs[i - w];
        }
        out.push(sum / (i + 1).min(w) as f64);
    }
    out
}

/// The flatness of the second half of `samples`, smoothed over `window` samples (the window
/// reaches back into the first half, so the second half's first point is a whole average).
/// `None` with fewer than two samples.
#[must_use]
pub fn second_half_flatness(samples: &[f64], window: usize) -> Option<Flatness> {
    if samples.len() < 2 {
        return None;
    }
    let smoothed = smooth(samples, window);
    let half = &smoothed[samples.len() / 2..];
    let min = half.iter().copied().fold(f64::INFINITY, f64::min);
    let max = half.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some(Flatness { min, max, spread: if min > 0.0 { (max - min) / min } else { f64::INFINITY } })
}

/// A worker killed (`kill -9`) and started again on its ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outage {
    /// The worker's name in the gateway's configuration.
    pub worker: String,
    /// When it was killed (since the start of the load).
    pub killed: Duration,
    /// When the restarted process answered its health route.
    pub back: Duration,
}

/// A request that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The request's index.
    pub index: u64,
    /// When it was sent (since the start of the load).
    pub start: Duration,
    /// When its failure was seen.
    pub end: Duration,
    /// The worker the gateway assigned, if the response said.
    pub worker: Option<String>,
    /// What went wrong (`http 502 upstream_unavailable`, `stream error event`, `connection`…).
    pub class: String,
}

/// The kill that explains `f`, if one does: `f` was in flight at the kill or started before
/// the worker was back plus `grace`, and it went to that worker when the gateway said which.
#[must_use]
pub fn explained_by<'a>(f: &Failure, outages: &'a [Outage], grace: Duration) -> Option<&'a Outage> {
    outages.iter().find(|o| {
        f.end >= o.killed && f.start <= o.back + grace && f.worker.as_ref().is_none_or(|w| *w == o.worker)
    })
}

/// One sample of a Prometheus text exposition: its labels and value.
pub type Sample = (Vec<(String, String)>, f64);

/// Every sample of metric `name` in the text exposition `text` (label values unescaped for
/// `\"` and `\\` only; the gateway's labels are names and codes).
#[must_use]
pub fn samples(text: &str, name: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        let (labels, value) = if let Some(body) = rest.strip_prefix('{') {
            let Some(close) = body.rfind('}') else { continue };
            (parse_labels(&body[..close]), &body[close + 1..])
        } else if rest.starts_with(' ') {
            (Vec::new(), rest)
        } else {
            continue; // another metric whose name starts with `name`
        };
        if let Some(v) = value.split_whitespace().next().and_then(|v| v.parse().ok()) {
            out.push((labels, v));
        }
    }
    out
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches(',').trim().to_owned();
        let mut value = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let mut end = rest.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(n);
                    }
                }
                '"' => {
                    end = eq + 2 + i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key, value));
        rest = &rest[end.min(rest.len())..];
    }
    out
}

/// The label `key` of a sample.
#[must_use]
pub fn label<'a>(s: &'a Sample, key: &str) -> Option<&'a str> {
    s.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// The sum of metric `name` grouped by label `key`, in the order first seen.
#[must_use]
pub fn sum_by(text: &str, name: &str, key: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for s in samples(text, name) {
        let k = label(&s, key).unwrap_or("").to_owned();
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => *v += s.1,
            None => out.push((k, s.1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatness_is_judged_on_the_smoothed_second_half() {
        // Growth in the first half (start-up) does not count; the second half is flat.
        let mut xs: Vec<f64> = (0..50).map(|i| 50.0 + f64::from(i)).collect();
        xs.extend(std::iter::repeat_n(100.0, 50));
        let f = second_half_flatness(&xs, 1).unwrap_or(Flatness { min: 0.0, max: 0.0, spread: 1.0 });
        assert_eq!((f.min, f.max, f.spread), (100.0, 100.0, 0.0));
        // A steady 20 % climb over the second half fails a 10 % tolerance.
        let xs: Vec<f64> =
            (0..100).map(|i| 100.0 + if i >= 50 { f64::from(i - 50) * 0.4 } else { 0.0 }).collect();
        let f = second_half_flatness(&xs, 5).map_or(0.0, |f| f.spread);
        assert!(f > 0.15 && f < 0.21, "{f}");
        // One spike among flat samples is averaged away by the window…
        let mut xs = vec![100.0; 100];
        xs[80] = 150.0;
        assert!(second_half_flatness(&xs, 10).is_some_and(|f| f.spread <= 0.051));
        // …and decides alone without one.
        assert!(second_half_flatness(&xs, 1).is_some_and(|f| (f.spread - 0.5).abs() < 1e-9));
        assert_eq!(second_half_flatness(&[1.0], 3), None);
    }

    #[test]
    fn smoothing_is_a_trailing_mean() {
        assert_eq!(smooth(&[2.0, 4.0, 6.0, 8.0], 2), [2.0, 3.0, 5.0, 7.0]);
        assert_eq!(smooth(&[2.0, 4.0], 0), [2.0, 4.0]);
    }

    #[test]
    fn only_a_kill_of_the_request_s_worker_while_it_ran_explains_a_failure() {
        let s = Duration::from_secs;
        let kill = [Outage { worker: "w1".into(), killed: s(60), back: s(62) }];
        let f = |start, end, worker: Option<&str>| Failure {
            index: 0,
            start: s(start),
            end: s(end),
            worker: worker.map(str::to_owned),
            class: "stream error event".into(),
        };
        let grace = s(3);
        // In flight at the kill, on the killed worker or on an unknown one.
        assert!(explained_by(&f(59, 60, Some("w1")), &kill, grace).is_some());
        assert!(explained_by(&f(59, 61, None), &kill, grace).is_some());
        // Started while it was down or just back (grace).
        assert!(explained_by(&f(64, 65, Some("w1")), &kill, grace).is_some());
        // Another worker's failure, one that ended before the kill, one long after: unexplained.
        assert!(explained_by(&f(59, 61, Some("w0")), &kill, grace).is_none());
        assert!(explained_by(&f(50, 59, Some("w1")), &kill, grace).is_none());
        assert!(explained_by(&f(70, 71, None), &kill, grace).is_none());
        assert!(explained_by(&f(59, 61, None), &[], grace).is_none());
    }

    #[test]
    fn prometheus_samples_are_read_with_their_labels() {
        let text = "# HELP cortex_ledger_live_bytes Ledger live bytes\n\
            # TYPE cortex_ledger_live_bytes gauge\n\
            cortex_ledger_live_bytes 123456\n\
            cortex_ledger_live_bytes_total 9\n\
            cortex_ledger_state{worker=\"w0\",rank=\"0\",state=\"ready\"} 1\n\
            cortex_ledger_state{worker=\"w0\",rank=\"0\",state=\"syncing\"} 0\n\
            cortex_errors_total{code=\"a \\\"quoted\\\" code\"} 2\n\
            cortex_requests_total{route=\"chat\",outcome=\"ok\"} 5\n\
            cortex_requests_total{route=\"completions\",outcome=\"ok\"} 7\n\
            cortex_requests_total{route=\"chat\",outcome=\"error\"} 1\n";
        assert_eq!(samples(text, "cortex_ledger_live_bytes"), vec![(vec![], 123456.0)]);
        let ready = samples(text, "cortex_ledger_state");
        assert_eq!(ready.len(), 2);
        assert_eq!(label(&ready[0], "state"), Some("ready"));
        assert_eq!(label(&ready[0], "worker"), Some("w0"));
        assert_eq!(sum_by(text, "cortex_errors_total", "code"), vec![("a \"quoted\" code".to_owned(), 2.0)]);
        assert_eq!(
            sum_by(text, "cortex_requests_total", "outcome"),
            vec![("ok".to_owned(), 12.0), ("error".to_owned(), 1.0)]
        );
        assert!(samples(text, "cortex_absent").is_empty());
    }
}
