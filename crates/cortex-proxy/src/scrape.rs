//! What a `/metrics` scrape does: refresh the gauges that mirror other components' state (the
//! ledger, each worker and holder, the gateway's own in-flight count, and whatever the binary
//! registered for the event plane), then render the Prometheus text.
//!
//! Key decision: mirrored state is read when scraped, not pushed on every change, so the
//! request path and the event plane never touch these gauges. The metric names live in
//! [`crate::telemetry`].

use std::sync::{Mutex, PoisonError};

use cortex_hash::kv::{DpRank, HolderId};
use cortex_hash::profile::Alignment;
use cortex_sched::Health;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::alignment::Verdict;
use crate::control::Control;
use crate::registry::Registry;
use crate::telemetry as t;

/// Called on every `/metrics` scrape, before rendering, to refresh metrics that mirror a
/// component this crate does not own (the binary registers the event plane's). It gets the
/// registry, which names the workers.
pub type ScrapeHook = Box<dyn Fn(&Registry) + Send + Sync>;

/// The recorder's handle and the registered hooks.
pub(crate) struct Scrape {
    prometheus: Option<PrometheusHandle>,
    hooks: Mutex<Vec<ScrapeHook>>,
}

impl Scrape {
    pub(crate) fn new(prometheus: Option<PrometheusHandle>) -> Self {
        Scrape { prometheus, hooks: Mutex::new(Vec::new()) }
    }

    pub(crate) fn add(&self, hook: ScrapeHook) {
        self.hooks.lock().unwrap_or_else(PoisonError::into_inner).push(hook);
    }

    /// Refreshes every mirrored gauge, with `in_flight` requests holding an admission slot, and
    /// renders the text (empty without a recorder).
    pub(crate) fn render(&self, c: &Control, in_flight: usize) -> String {
        let stats = c.ledger().stats();
        metrics::gauge!(t::LEDGER_BYTES).set(stats.live_bytes as f64);
        metrics::gauge!(t::LEDGER_BLOCKS).set(stats.blocks as f64);
        metrics::gauge!(t::LEDGER_ORPHANS).set(stats.orphans as f64);
        metrics::gauge!(t::LEDGER_QUARANTINED).set(stats.quarantined_holders as f64);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "capacity").absolute(stats.evictions_capacity);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "budget").absolute(stats.evictions_budget);
        metrics::gauge!(t::INFLIGHT).set(in_flight as f64);
        for hook in self.hooks.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            hook(c.registry());
        }
        let snap = c.cluster().load();
        let now = c.clock().now();
        for w in c.registry().snapshot().values() {
            let name = w.config.name.clone();
            let entry = snap.worker(w.id);
            let live = entry.is_some_and(|e| e.health() == Health::Healthy);
            metrics::gauge!(t::WORKER_LIVE, "worker" => name.clone()).set(if live { 1.0 } else { 0.0 });
            let admissible = (0..w.dp_size()).any(|r| snap.admissible(HolderId::new(w.id, DpRank(r)), now));
            metrics::gauge!(t::WORKER_ADMISSIBLE, "worker" => name.clone()).set(if admissible {
                1.0
            } else {
                0.0
            });
            t::register_worker(&name);
            let aligned = matches!(w.status().alignment, Alignment::Confirmed)
                && !matches!(c.verdict(w.id), Verdict::Misaligned(_));
            metrics::gauge!(t::ALIGNED, "worker" => name.clone()).set(if aligned { 1.0 } else { 0.0 });
            for r in 0..w.dp_size() {
                let rank = DpRank(r);
                let labels = [("worker", name.clone()), ("rank", r.to_string())];
                if let Some(e) = entry
                    && let Some(l) = e.state().rank_load(rank, now)
                {
                    metrics::gauge!(t::WORKER_INFLIGHT, &labels).set(f64::from(l.booked_requests));
                    metrics::gauge!(t::WORKER_PREFILL_RATE, &labels).set(l.estimate.rate());
                    metrics::gauge!(t::WORKER_PREFILL_OVERHEAD, &labels).set(l.estimate.overhead_s);
                    if let Some((engine, _age)) = l.engine {
                        metrics::gauge!(t::WORKER_RUNNING, &labels).set(f64::from(engine.running));
                        metrics::gauge!(t::WORKER_WAITING, &labels).set(f64::from(engine.waiting));
                        metrics::gauge!(t::WORKER_KV_USAGE, &labels).set(f64::from(engine.kv_usage));
                    }
                }
                let state = c.holder_state(w.id, rank);
                for s in ["ready", "syncing", "stale", "disabled"] {
                    metrics::gauge!(t::LEDGER_STATE, "worker" => name.clone(), "rank" => r.to_string(), "state" => s)
                        .set(if state.as_str() == s { 1.0 } else { 0.0 });
                }
            }
        }
        self.prometheus.as_ref().map(PrometheusHandle::render).unwrap_or_default()
    }
}
