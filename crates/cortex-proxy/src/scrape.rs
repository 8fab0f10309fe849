//! What a `/metrics` scrape does: refresh the gauges that mirror other components' state (the
//! ledger, each worker and holder, the gateway's own in-flight count, and whatever the binary
//! registered for the event plane), then render the Prometheus text.
//!
//! Key decisions: mirrored state is read when scraped, not pushed on every change, so the
//! request path and the event plane never touch these gauges. The gauges of a worker (those
//! with a `worker` label, [`crate::telemetry::Metric::per_worker_gauge`]) never go through the
//! recorder, which keeps every series it was given and cannot delete one: they are written from
//! the registered workers at each scrape, after the recorder's text, so a removed worker's
//! vanish with it instead of staying at their last values. The metric names live in
//! [`crate::telemetry`].

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use cortex_hash::kv::{DpRank, HolderId};
use cortex_hash::profile::Alignment;
use cortex_sched::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::formatting::{
    sanitize_label_value, write_help_line, write_metric_line, write_type_line,
};

use crate::alignment::Verdict;
use crate::control::Control;
use crate::registry::Registry;
use crate::telemetry as t;

/// Called on every `/metrics` scrape, before rendering, to refresh metrics that mirror a
/// component this crate does not own (the binary registers the event plane's). It gets the
/// registry, which names the workers, and the scrape's [`WorkerGauges`], where it sets the
/// per-worker gauges of the workers still registered.
pub type ScrapeHook = Box<dyn Fn(&Registry, &mut WorkerGauges) + Send + Sync>;

/// The per-worker gauges of one scrape, by name then labels, rendered as Prometheus text after
/// the recorder's: a series exists only while some scrape sets it, so a worker's disappear at
/// the first scrape after it left.
#[derive(Debug, Default)]
pub struct WorkerGauges {
    series: BTreeMap<&'static str, BTreeMap<Vec<String>, f64>>,
}

impl WorkerGauges {
    /// Sets the series of `name` with `labels` (pairs of name and value) to `value` for this
    /// scrape. `name` is a gauge of [`t::METRICS`] with a `worker` label.
    pub fn set(&mut self, name: &'static str, labels: &[(&str, &str)], value: f64) {
        debug_assert!(
            t::METRICS.iter().any(|m| m.name == name && m.per_worker_gauge()),
            "{name} is not a per-worker gauge"
        );
        let labels = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", sanitize_label_value(v))).collect();
        self.series.entry(name).or_default().insert(labels, value);
    }

    /// Appends every series to `out`, each metric with its `# HELP` and `# TYPE` lines, as the
    /// recorder writes its own.
    fn render(&self, out: &mut String) {
        for (name, series) in &self.series {
            if let Some(m) = t::METRICS.iter().find(|m| m.name == *name) {
                write_help_line(out, name, m.help);
            }
            write_type_line(out, name, "gauge");
            for (labels, value) in series {
                write_metric_line::<&str, f64>(out, name, None, labels, None, *value, None);
            }
            out.push('\n');
        }
    }
}

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
    /// renders the text (empty without a recorder): the recorder's, then the per-worker gauges
    /// of the workers registered now.
    pub(crate) fn render(&self, c: &Control, in_flight: usize) -> String {
        let stats = c.ledger().stats();
        metrics::gauge!(t::LEDGER_BYTES).set(stats.live_bytes as f64);
        metrics::gauge!(t::LEDGER_BLOCKS).set(stats.blocks as f64);
        metrics::gauge!(t::LEDGER_ORPHANS).set(stats.orphans as f64);
        metrics::gauge!(t::LEDGER_QUARANTINED).set(stats.quarantined_holders as f64);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "capacity").absolute(stats.evictions_capacity);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "budget").absolute(stats.evictions_budget);
        metrics::gauge!(t::INFLIGHT).set(in_flight as f64);
        let mut gauges = WorkerGauges::default();
        for hook in self.hooks.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            hook(c.registry(), &mut gauges);
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let snap = c.cluster().load();
        let now = c.clock().now();
        for w in c.registry().snapshot().values() {
            let name = w.config.name.as_str();
            let entry = snap.worker(w.id);
            let worker = [("worker", name)];
            let live = entry.is_some_and(|e| e.health() == Health::Healthy);
            gauges.set(t::WORKER_LIVE, &worker, flag(live));
            let admissible = (0..w.dp_size()).any(|r| snap.admissible(HolderId::new(w.id, DpRank(r)), now));
            gauges.set(t::WORKER_ADMISSIBLE, &worker, flag(admissible));
            t::register_worker(name);
            let aligned = matches!(w.status().alignment, Alignment::Confirmed)
                && !matches!(c.verdict(w.id), Verdict::Misaligned(_));
            gauges.set(t::ALIGNED, &worker, flag(aligned));
            for r in 0..w.dp_size() {
                let rank = DpRank(r);
                let r = r.to_string();
                let labels = [("worker", name), ("rank", r.as_str())];
                if let Some(e) = entry
                    && let Some(l) = e.state().rank_load(rank, now)
                {
                    gauges.set(t::WORKER_INFLIGHT, &labels, f64::from(l.booked_requests));
                    gauges.set(t::WORKER_PREFILL_RATE, &labels, l.estimate.rate());
                    gauges.set(t::WORKER_PREFILL_OVERHEAD, &labels, l.estimate.overhead_s);
                    if let Some((engine, _age)) = l.engine {
                        gauges.set(t::WORKER_RUNNING, &labels, f64::from(engine.running));
                        gauges.set(t::WORKER_WAITING, &labels, f64::from(engine.waiting));
                        gauges.set(t::WORKER_KV_USAGE, &labels, f64::from(engine.kv_usage));
                    }
                }
                let state = c.holder_state(w.id, rank);
                for s in ["ready", "syncing", "stale", "disabled"] {
                    let labels = [("worker", name), ("rank", r.as_str()), ("state", s)];
                    gauges.set(t::LEDGER_STATE, &labels, flag(state.as_str() == s));
                }
            }
        }
        let Some(prometheus) = &self.prometheus else { return String::new() };
        let mut text = prometheus.render();
        gauges.render(&mut text);
        text
    }
}
