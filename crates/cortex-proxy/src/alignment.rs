//! Continuous alignment verification: after routing, compare what the gateway predicted with what
//! the worker did, and turn exact routing off for a worker whose predictions keep failing.
//!
//! Two signals, both per worker:
//! - the predicted cache hit (capped as the engine counts it: whole blocks, never the last token)
//!   against the `cached_tokens` the worker reports in its usage — a worker that reports fewer
//!   cached tokens than the ledger promised has blocks the gateway believes in but the worker does
//!   not (different tokens, different block size);
//! - the engine hashes the gateway predicted for the request's pages (cortex-hash recipes) against
//!   the hashes the worker then published for those pages (found in the ledger by Cortex's own
//!   identity) — a different template, block size, salt or hash algorithm shows up here even when
//!   the worker reports no usage.
//!
//! Key decision: no signal means no verdict. A check is recorded only when the worker said
//! something (usage present, or blocks found); a window of recent checks with too many failures
//! marks the worker misaligned, and enough successes restore it.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use cortex_hash::kv::WorkerId;

use crate::config::AlignmentConfig;

/// The continuous verdict on one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not enough checks yet.
    Unknown,
    /// Predictions hold.
    Aligned,
    /// Too many predictions failed; the last failure's description.
    Misaligned(String),
}

impl Verdict {
    /// Lower-case name.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Unknown => "unknown",
            Verdict::Aligned => "aligned",
            Verdict::Misaligned(_) => "misaligned",
        }
    }
}

/// One check's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// The prediction held.
    Ok,
    /// It did not; why.
    Failed(String),
}

#[derive(Debug, Default)]
struct Window {
    results: VecDeque<bool>,
    verdict: Option<Verdict>,
    last_failure: Option<String>,
}

/// Windows of checks per worker.
#[derive(Debug)]
pub struct AlignmentTracker {
    cfg: AlignmentConfig,
    windows: Mutex<HashMap<WorkerId, Window>>,
}

impl AlignmentTracker {
    /// A tracker with `cfg`.
    #[must_use]
    pub fn new(cfg: AlignmentConfig) -> Self {
        AlignmentTracker { cfg, windows: Mutex::new(HashMap::new()) }
    }

    /// Records a check; returns the new verdict when it changed.
    pub fn record(&self, worker: WorkerId, check: Check) -> Option<Verdict> {
        let mut all = self.windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let w = all.entry(worker).or_default();
        match check {
            Check::Ok => w.results.push_back(true),
            Check::Failed(why) => {
                w.results.push_back(false);
                w.last_failure = Some(why);
            }
        }
        while w.results.len() > self.cfg.window.max(1) {
            w.results.pop_front();
        }
        if w.results.len() < self.cfg.min_samples {
            return None;
        }
        let failed = w.results.iter().filter(|ok| !**ok).count();
        let rate = failed as f64 / w.results.len() as f64;
        let verdict = if rate > self.cfg.tolerance {
            Verdict::Misaligned(format!(
                "{failed} of the last {} predictions failed (last: {})",
                w.results.len(),
                w.last_failure.as_deref().unwrap_or("?")
            ))
        } else {
            Verdict::Aligned
        };
        let changed = w.verdict.as_ref().map(Verdict::as_str) != Some(verdict.as_str());
        w.verdict = Some(verdict.clone());
        changed.then_some(verdict)
    }

    /// The current verdict.
    #[must_use]
    pub fn verdict(&self, worker: WorkerId) -> Verdict {
        let all = self.windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        all.get(&worker).and_then(|w| w.verdict.clone()).unwrap_or(Verdict::Unknown)
    }

    /// Checks recorded in the worker's window.
    #[must_use]
    pub fn samples(&self, worker: WorkerId) -> usize {
        let all = self.windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        all.get(&worker).map_or(0, |w| w.results.len())
    }

    /// Forgets a worker (removed, or re-registered with a new verdict to earn).
    pub fn forget(&self, worker: WorkerId) {
        self.windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&worker);
    }
}

/// The hit check: `realized` cached tokens against the capped prediction.
#[must_use]
pub fn hit_check(predicted: u32, realized: u32) -> Check {
    if realized >= predicted {
        Check::Ok
    } else {
        Check::Failed(format!("predicted {predicted} cached tokens, worker reported {realized}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> AlignmentTracker {
        AlignmentTracker::new(AlignmentConfig {
            window: 10,
            tolerance: 0.2,
            min_samples: 5,
            ..AlignmentConfig::default()
        })
    }

    #[test]
    fn verdict_needs_samples_then_follows_the_window() {
        let t = tracker();
        let w = WorkerId(1);
        for _ in 0..4 {
            assert_eq!(t.record(w, Check::Ok), None);
        }
        assert_eq!(t.verdict(w), Verdict::Unknown);
        assert_eq!(t.record(w, Check::Ok), Some(Verdict::Aligned));
        assert_eq!(t.record(w, Check::Failed("x".into())), None, "1 of 6 is within tolerance");
        let mut changed = None;
        for _ in 0..3 {
            changed = changed.or(t.record(w, Check::Failed("blocks differ".into())));
        }
        assert!(matches!(changed, Some(Verdict::Misaligned(ref why)) if why.contains("blocks differ")));
        for _ in 0..10 {
            t.record(w, Check::Ok);
        }
        assert_eq!(t.verdict(w), Verdict::Aligned);
    }

    #[test]
    fn hit_check_allows_under_prediction() {
        assert_eq!(hit_check(32, 48), Check::Ok);
        assert_eq!(hit_check(32, 32), Check::Ok);
        assert!(matches!(hit_check(32, 16), Check::Failed(_)));
    }
}
