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
//! Key decisions: no signal means no verdict. A check is recorded only when the worker said
//! something (usage present, or blocks found); a window of recent checks with too many failures
//! marks the worker misaligned, and enough successes restore it (a misaligned worker's every
//! request is checked, so that it can). A ledger rebuilt without the engine's history is not a
//! misalignment: blocks the engine cached before it are not held against the worker. [`AlignmentTracker`] is the
//! windows alone (pure bookkeeping); [`Verifier`] runs the checks for the forwarder and says
//! when a verdict changed, so that the owner of the scheduler's view ([`crate::control`]) turns
//! exact routing off or on at once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use cortex_hash::kv::{EngineHash, HolderId, WorkerId};
use cortex_hash::{SeqHash, Token};
use cortex_radix::{DumpState, HolderFilter, HolderProgress, Ledger, OverlapScores, QueryOptions, Readiness};
use tokio::sync::Notify;

use crate::config::AlignmentConfig;
use crate::models::ModelRoute;
use crate::registry::Registry;
use crate::telemetry as t;
use crate::upstream::{Completion, OnComplete};

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

/// What a served request predicted, for the checks when its response ends.
#[derive(Debug)]
pub struct Prediction {
    /// The holder that served it.
    pub holder: HolderId,
    /// Its worker's name when the request was sent: the hit counters' label, even if the worker
    /// is removed before the answer ends.
    pub worker: String,
    /// Cached tokens predicted, capped as the engine counts them.
    pub predicted_hit: u32,
    /// Whether the decision rested on the ledger (`exact_kv_events`): only then is a hit checked.
    pub exact: bool,
    /// The model route (its recipe predicts the engine hash).
    pub model: Arc<ModelRoute>,
    /// The request's cache salt.
    pub cache_salt: Option<String>,
    /// The first block: its identity and tokens, when the prompt has one.
    pub first_block: Option<(SeqHash, Vec<Token>)>,
    /// The holder's events applied ([`Ledger::progress`]) before the request was sent, when known: a
    /// block check finding the first block missing with no event applied since cannot tell a
    /// misaligned worker from events late or lost on the way (a gap not yet seen).
    pub events_before: Option<u64>,
}

/// What was known when a served request's response ended, for its block check.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Whether the worker computed the first block for this request (its reported cached tokens
    /// do not cover it); `None` without usage.
    computed: Option<bool>,
    /// [`Ledger::history_lost`] of the holder then.
    history_lost: Option<u64>,
    /// [`Prediction::events_before`].
    events_before: Option<u64>,
}

/// Runs the continuous checks and keeps their verdicts. Shared by the forwarder (which records)
/// and the control plane (which reads verdicts, forgets workers and waits for changes).
#[derive(Debug)]
pub struct Verifier {
    tracker: AlignmentTracker,
    cfg: AlignmentConfig,
    ledger: Arc<Ledger>,
    registry: Arc<Registry>,
    changed: Notify,
}

impl Verifier {
    /// A verifier with `cfg`, reading `ledger` and naming workers from `registry`.
    #[must_use]
    pub fn new(cfg: AlignmentConfig, ledger: Arc<Ledger>, registry: Arc<Registry>) -> Self {
        Verifier { tracker: AlignmentTracker::new(cfg), cfg, ledger, registry, changed: Notify::new() }
    }

    /// The continuous verdict of a worker.
    #[must_use]
    pub fn verdict(&self, worker: WorkerId) -> Verdict {
        self.tracker.verdict(worker)
    }

    /// Forgets a worker's checks (it left, or rejoins with a verdict to earn).
    pub fn forget(&self, worker: WorkerId) {
        self.tracker.forget(worker);
    }

    /// Resolves once after some verdict changed (a notification is kept if nobody waits).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Whether a request served by `worker` should get the block check: every request while the
    /// worker's window fills or while it is misaligned (a verdict recovers only through checks),
    /// then one in 16 (the check costs a timer and a ledger lookup).
    #[must_use]
    pub fn samples_block(&self, worker: WorkerId) -> bool {
        self.tracker.samples(worker) < self.cfg.window
            || matches!(self.tracker.verdict(worker), Verdict::Misaligned(_))
            || fastrand::u8(..16) == 0
    }

    /// What to check when the response to `p` ends: the realized hit against the prediction,
    /// and (after `settle`) that the worker now holds the request's first block under Cortex's
    /// identity and the predicted engine hash.
    pub fn on_complete(self: &Arc<Self>, p: Prediction) -> OnComplete {
        let v = Arc::clone(self);
        Box::new(move |c: Completion| {
            if let Some(realized) = c.cached_tokens {
                let worker = p.worker.clone();
                metrics::counter!(t::PREDICTED_HIT_TOKENS, "worker" => worker.clone())
                    .increment(u64::from(p.predicted_hit));
                metrics::counter!(t::REALIZED_HIT_TOKENS, "worker" => worker.clone())
                    .increment(u64::from(realized));
                // The hit rate's denominator, as the worker counted it (the usage's prompt
                // tokens), so that realized / prompt is a ratio of sums over any window.
                if let Some(prompt) = c.prompt_tokens {
                    metrics::counter!(t::PROMPT_TOKENS, "worker" => worker).increment(u64::from(prompt));
                }
                if p.exact && p.predicted_hit > 0 {
                    v.record(p.holder.worker, hit_check(p.predicted_hit, realized));
                }
            }
            if let Some((seq, page)) = p.first_block {
                let seen = Seen {
                    computed: c.cached_tokens.map(|cached| (cached as usize) < page.len()),
                    history_lost: v.ledger.history_lost(p.holder),
                    events_before: p.events_before,
                };
                tokio::spawn(async move {
                    tokio::time::sleep(v.cfg.settle).await;
                    // The worker's hash of the first page, as the engine's recipe computes it.
                    let engine = p
                        .model
                        .predict_engine_hashes(&page, p.cache_salt.as_deref())
                        .and_then(|h| h.first().copied());
                    v.block_check(p.holder, seq, engine, seen);
                });
            }
        })
    }

    /// How far the ledger has followed the holder's engine ([`Ledger::progress`]): the events
    /// applied (for [`Prediction::events_before`]) and whether it has followed every one since
    /// the engine's cache was empty (`history_lost` 0: what it holds, the engine holds).
    #[must_use]
    pub fn progress(&self, holder: HolderId) -> Option<HolderProgress> {
        self.ledger.progress(holder)
    }

    /// After a worker served a request it holds the request's first block (both engines store
    /// prompt blocks): the ledger must show it under Cortex's identity (else the worker's tokens
    /// or block size differ from the gateway's), and under the engine hash the recipe predicts
    /// (else its hash algorithm, seed, salt or LoRA namespacing differ). Checked only while the
    /// holder is READY. A block the worker stored and lost again before the check (its engine
    /// evicted it, or the ledger did for its budget: [`Ledger::lost_lately`]) says nothing
    /// either way: under a cache that turns over within `settle`, such blocks would otherwise
    /// read as failures and mark an aligned worker misaligned. A block never stored under the
    /// gateway's identity is not among them, so a misaligned worker still fails, but for the
    /// filter's false positives (a few percent of its checks then say nothing).
    ///
    /// A rebuilt ledger is not a misalignment. Once the ledger lost part of the engine's history
    /// (a replay that timed out, a publisher restart: [`Ledger::history_lost`]), the engine may
    /// hold blocks stored before that it never announces again (a hit is not re-announced), so a
    /// missing block fails the check only when the worker's usage says it computed the block for
    /// this request (and so announced it); and a loss between the response and the check makes
    /// the check say nothing.
    fn block_check(&self, holder: HolderId, seq: SeqHash, engine: Option<EngineHash>, seen: Seen) {
        if self.ledger.readiness(holder) != Some(Readiness::Ready) {
            return;
        }
        let lost = self.ledger.history_lost(holder);
        if lost != seen.history_lost {
            return;
        }
        let mut out = OverlapScores::with_capacity(4);
        let opts = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
        self.ledger.query(&[seq], opts, &mut out);
        let held = out.get(holder).is_some_and(|o| o.any_tier_blocks > 0);
        let complete = lost == Some(0);
        let check = match (held, engine.map(|e| self.ledger.block(holder, e))) {
            (false, _) if !complete && seen.computed != Some(true) => return,
            (false, _) if self.ledger.lost_lately(holder, seq) => return,
            // Not one event of the worker's since the request was sent: its store is late or was
            // lost on the way (the sequencer sees a gap only at the next batch), which says
            // nothing of how the worker hashes.
            (false, _)
                if seen.events_before.is_some()
                    && self.ledger.progress(holder).map(|p| p.events_applied) == seen.events_before =>
            {
                return;
            }
            (false, _) => Check::Failed(
                "the worker published no block matching the gateway's tokens for a request it served".into(),
            ),
            (true, None) => Check::Ok,
            (true, Some(Some(b))) if b.state == DumpState::Countable(seq) => Check::Ok,
            (true, Some(Some(_))) => {
                Check::Failed("the predicted engine hash names another block on the worker".into())
            }
            (true, Some(None)) => Check::Failed(
                "the worker published other engine hashes than its recipe predicts (hash algorithm, seed, salt or LoRA)"
                    .into(),
            ),
        };
        self.record(holder.worker, check);
    }

    /// Records a check of `worker`; a changed verdict is logged and announced.
    pub fn record(&self, worker: WorkerId, check: Check) {
        let ok = matches!(check, Check::Ok);
        // A worker removed since is not counted under no name.
        let name = self.registry.name(worker);
        if let Some(name) = &name {
            metrics::counter!(t::ALIGNMENT_CHECKS, "worker" => name.clone(), "result" => if ok { "ok" } else { "failed" })
                .increment(1);
        }
        let name = name.unwrap_or_else(|| worker.to_string());
        if let Some(v) = self.tracker.record(worker, check) {
            match &v {
                Verdict::Misaligned(why) => {
                    tracing::warn!(worker = %name, reason = %why, "worker misaligned: exact routing off");
                }
                other => tracing::info!(worker = %name, verdict = other.as_str(), "alignment verdict"),
            }
            self.changed.notify_one();
        }
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

    /// Issue 19, row 7: once its window was full a misaligned worker had one request in 16
    /// checked, so a verdict that should recover hardly could. Every request is checked while it
    /// is misaligned, and enough good checks restore it.
    #[test]
    fn a_misaligned_worker_has_every_request_checked_and_recovers() {
        let cfg = AlignmentConfig { window: 4, tolerance: 0.2, min_samples: 2, ..AlignmentConfig::default() };
        let ledger = cortex_radix::Ledger::new(cortex_radix::LedgerConfig::default());
        let v = Verifier::new(cfg, ledger, Arc::new(Registry::new()));
        let w = WorkerId(1);
        for _ in 0..4 {
            v.record(w, Check::Failed("blocks differ".into()));
        }
        assert!(matches!(v.verdict(w), Verdict::Misaligned(_)));
        assert!((0..200).all(|_| v.samples_block(w)), "a misaligned worker's requests went unchecked");
        for _ in 0..4 {
            v.record(w, Check::Ok);
        }
        assert_eq!(v.verdict(w), Verdict::Aligned);
    }

    /// A first block the worker stored and lost again before the check (evicted by a cache
    /// that turns over fast) is no failure; one it never stored under the gateway's identity
    /// still is.
    #[test]
    fn a_block_stored_and_evicted_before_the_check_is_no_failure() {
        use cortex_hash::kv::{BlockRemoved, BlockStored, DpRank, KvEvent, Lineage, Medium, StoredBlock};
        use cortex_hash::{BlockHash, Engine, Namespace, chain};
        let cfg = AlignmentConfig { window: 4, tolerance: 0.2, min_samples: 1, ..AlignmentConfig::default() };
        let ledger = cortex_radix::Ledger::new(cortex_radix::LedgerConfig::default());
        let v = Verifier::new(cfg, Arc::clone(&ledger), Arc::new(Registry::new()));
        let holder = HolderId::new(WorkerId(1), DpRank(0));
        let hc = cortex_radix::HolderConfig { capacity_blocks: 64, content_deterministic: false };
        let mut w = ledger.add_holder(holder, hc).expect("holder");
        w.set_readiness(Readiness::Ready);
        let l = Lineage::new(Namespace::new(Engine::Vllm, 16, "m", None), None);
        let (stored, never) =
            (chain(l.root, BlockHash::from_bits(7)), chain(l.root, BlockHash::from_bits(8)));
        let engine = EngineHash::from_u64(99);
        let block = StoredBlock { engine, content: BlockHash::from_bits(7) };
        let ev = BlockStored { parent: None, blocks: vec![block], lineage: Some(l), medium: Medium::Gpu };
        w.apply(&KvEvent::Stored(ev)).expect("store");
        w.apply(&KvEvent::Removed(BlockRemoved { blocks: vec![engine], medium: Medium::Gpu }))
            .expect("remove");
        let seen =
            || Seen { computed: Some(true), history_lost: ledger.history_lost(holder), events_before: None };
        v.block_check(holder, stored, None, seen());
        assert_eq!(
            v.tracker.samples(holder.worker),
            0,
            "a block stored then evicted was held against the worker"
        );
        v.block_check(holder, never, None, seen());
        assert!(
            matches!(v.verdict(holder.worker), Verdict::Misaligned(_)),
            "a block never stored went unnoticed"
        );
    }

    /// A first block missing when no event of the worker's was applied since the request was
    /// sent says nothing (its store is late, or lost in a gap the sequencer has not seen yet): a
    /// probe saw a worker marked misaligned while its events were being dropped, and left so
    /// after the gap was replayed. Once events came and the block is still missing, it counts.
    #[test]
    fn a_missing_block_with_no_event_since_the_request_says_nothing() {
        use cortex_hash::kv::{BlockStored, DpRank, KvEvent, Lineage, Medium, StoredBlock};
        use cortex_hash::{BlockHash, Engine, Namespace, chain};
        let cfg = AlignmentConfig { window: 4, tolerance: 0.2, min_samples: 1, ..AlignmentConfig::default() };
        let ledger = cortex_radix::Ledger::new(cortex_radix::LedgerConfig::default());
        let v = Verifier::new(cfg, Arc::clone(&ledger), Arc::new(Registry::new()));
        let holder = HolderId::new(WorkerId(2), DpRank(0));
        let hc = cortex_radix::HolderConfig { capacity_blocks: 64, content_deterministic: false };
        let mut w = ledger.add_holder(holder, hc).expect("holder");
        w.set_readiness(Readiness::Ready);
        let l = Lineage::new(Namespace::new(Engine::Vllm, 16, "m", None), None);
        let missing = chain(l.root, BlockHash::from_bits(9));
        let before = ledger.progress(holder).map(|p| p.events_applied);
        let seen = || Seen {
            computed: Some(true),
            history_lost: ledger.history_lost(holder),
            events_before: before,
        };
        v.block_check(holder, missing, None, seen());
        assert_eq!(v.tracker.samples(holder.worker), 0, "no event since the request: no verdict");
        // An event of the worker's arrives, and it is another block: the request's is missing.
        let block = StoredBlock { engine: EngineHash::from_u64(5), content: BlockHash::from_bits(5) };
        let ev = BlockStored { parent: None, blocks: vec![block], lineage: Some(l), medium: Medium::Gpu };
        w.apply(&KvEvent::Stored(ev)).expect("store");
        v.block_check(holder, missing, None, seen());
        assert!(matches!(v.verdict(holder.worker), Verdict::Misaligned(_)), "events came, the block did not");
    }

    #[test]
    fn hit_check_allows_under_prediction() {
        assert_eq!(hit_check(32, 48), Check::Ok);
        assert_eq!(hit_check(32, 32), Check::Ok);
        assert!(matches!(hit_check(32, 16), Check::Failed(_)));
    }
}
