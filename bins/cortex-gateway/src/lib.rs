//! The gateway process, as a library so that end-to-end tests, the replay tool and the binary
//! start it the same way.
//!
//! Wiring happens once, here: the ledger, the event plane (ZeroMQ ingest) and the data plane
//! (proxy), with the registry's events forwarded to the ingest runtime, the public and admin
//! listeners, and a graceful shutdown that stops accepting, lets streams finish up to the
//! deadline, then stops the event plane.
//!
//! Key decision: nothing global but the metrics recorder, which the binary installs; every
//! component is built from [`config::Settings`] and owned by [`Running`].

#![forbid(unsafe_code)]

pub mod config;
pub mod demo;
pub mod discovery;
pub mod log_pipe;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use cortex_hash::kv::HolderId;
use cortex_ingest::{DECODE_ERROR_KINDS, Ingest, Reason};
use cortex_proxy::{Admin, Gateway, GatewayParts, RegistryEvent, Tls};
use cortex_radix::Ledger;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

pub use config::Settings;
pub use cortex_proxy::Token;

/// A started gateway.
pub struct Running {
    /// The public listener's address.
    pub addr: SocketAddr,
    /// The admin listener's address, if any.
    pub admin_addr: Option<SocketAddr>,
    /// The data plane.
    pub gateway: Arc<Gateway>,
    /// The event plane.
    pub ingest: Arc<Ingest>,
    stop: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
    /// The listeners' certificate reloaders (aborted at shutdown).
    reloaders: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("addr", &self.addr).finish_non_exhaustive()
    }
}

/// Builds everything from `settings` and starts serving. Binds the listeners first, so the
/// returned addresses accept connections at once.
///
/// # Errors
/// A listener cannot be bound, or a component cannot start.
pub async fn start(settings: Settings, prometheus: Option<PrometheusHandle>) -> Result<Running> {
    let ledger = Ledger::new(settings.ledger);
    let ingest = Arc::new(
        Ingest::start(Arc::clone(&ledger), settings.ingest.clone()).context("starting the event plane")?,
    );
    let (gateway, events) = Gateway::new(GatewayParts {
        config: settings.proxy.clone(),
        models: settings.models,
        ledger,
        sched: settings.sched,
        health: settings.health,
        prometheus,
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    gateway.on_scrape(event_metrics(Arc::clone(&ingest)));
    gateway.start_background();
    let mut tasks = vec![tokio::spawn(forward_events(events, Arc::clone(&ingest)))];
    let listener =
        TcpListener::bind(settings.listen).await.with_context(|| format!("binding {}", settings.listen))?;
    let addr = listener.local_addr()?;
    let mut stop = Vec::new();
    let mut reloaders = Vec::new();
    let tls = match settings.tls {
        Some(cfg) => Some(listener_tls(cfg, "tls", &mut reloaders)?),
        None => None,
    };
    let (tx, rx) = oneshot::channel::<()>();
    stop.push(tx);
    let gw = Arc::clone(&gateway);
    tasks.push(tokio::spawn(async move {
        cortex_proxy::server::serve(listener, tls, gw, async {
            let _ = rx.await;
        })
        .await;
    }));
    let mut admin_addr = None;
    if let Some(a) = settings.admin {
        let listener =
            TcpListener::bind(a.listen).await.with_context(|| format!("binding admin {}", a.listen))?;
        admin_addr = Some(listener.local_addr()?);
        let tls = match a.tls {
            Some(cfg) => Some(listener_tls(cfg, "admin.tls", &mut reloaders)?),
            None => None,
        };
        let admin = Admin::new(Arc::clone(&gateway), a.token);
        let (tx, rx) = oneshot::channel::<()>();
        stop.push(tx);
        let limits = settings.proxy.limits.clone();
        tasks.push(tokio::spawn(async move {
            let handler = move |req| admin.clone().serve(req);
            cortex_proxy::server::serve_with(
                listener,
                tls,
                handler,
                &limits,
                std::time::Duration::from_secs(1),
                async {
                    let _ = rx.await;
                },
            )
            .await;
        }));
    }
    for w in settings.workers {
        gateway.control().join(w).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    // After the file's workers, so that a pod named like one of them is the one refused.
    if let Some(k8s) = settings.kubernetes {
        for (tx, task) in discovery::kubernetes::start(k8s, &gateway).await? {
            stop.push(tx);
            tasks.push(task);
        }
    }
    Ok(Running { addr, admin_addr, gateway, ingest, stop, tasks, reloaders })
}

/// A listener's TLS, loaded, with its reloader among `tasks` (`key` names the section).
fn listener_tls(
    cfg: cortex_proxy::TlsConfig,
    key: &str,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<Arc<Tls>> {
    let tls = Tls::load(cfg).with_context(|| format!("{key}: cannot serve this certificate and key"))?;
    tasks.push(tls.spawn_reloader());
    Ok(tls)
}

impl Running {
    /// A holder's ledger readiness (for tests and diagnostics).
    #[must_use]
    pub fn ledger_state(&self, holder: cortex_hash::kv::HolderId) -> Option<cortex_radix::Readiness> {
        self.gateway.control().ledger().readiness(holder)
    }

    /// Graceful shutdown: `/health/ready` answers 503 at once; requests are still served for
    /// `shutdown_delay`; then stop accepting, let in-flight streams finish up to `shutdown_grace`,
    /// then stop the event plane.
    pub async fn shutdown(self) {
        let delay = self.gateway.shutdown_delay();
        self.gateway.begin_drain();
        if !delay.is_zero() {
            tracing::info!(?delay, "draining: not ready, still serving");
            tokio::time::sleep(delay).await;
        }
        self.gateway.begin_shutdown();
        for s in self.stop {
            let _ = s.send(());
        }
        for r in self.reloaders {
            r.abort();
        }
        let mut tasks = self.tasks;
        // The event forwarder ends when the gateway (its sender) is dropped; do not wait on it.
        let forwarder = tasks.remove(0);
        for t in tasks {
            let _ = t.await;
        }
        forwarder.abort();
        // The requests' last spans, sent before the process may exit.
        self.gateway.flush_traces().await;
        let ingest = self.ingest;
        let _ = tokio::task::spawn_blocking(move || drop(ingest)).await;
    }
}

/// The event plane's metrics, refreshed on every scrape from the ingest runtime's per-holder
/// counters. Counters advance by what changed since the last scrape, per holder incarnation: a
/// holder removed and added again (a worker that left and came back) counts from zero under a
/// new incarnation, and the final counts of the one removed (taken from
/// [`Ingest::take_retired`]) are added first, so no transition is lost and none counted twice.
/// The apply-lag gauges are set for the holders followed now, of workers still registered. A
/// holder's worker name is remembered, since a removed worker usually leaves the registry before
/// the scrape that takes its final counts.
fn event_metrics(ingest: Arc<Ingest>) -> cortex_proxy::ScrapeHook {
    use cortex_proxy::telemetry as t;
    // Per holder: its incarnation, its worker's name (a retired holder's worker has usually
    // left the registry by the scrape that takes its final counts) and the counts last seen.
    type Seen = (u64, String, HashMap<&'static str, u64>);
    let last: std::sync::Mutex<HashMap<HolderId, Seen>> = std::sync::Mutex::default();
    Box::new(move |registry, gauges| {
        let mut last = last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let retired = ingest.take_retired();
        let live = ingest.statuses();
        for (st, is_live) in retired.iter().map(|s| (s, false)).chain(live.iter().map(|s| (s, true))) {
            let registered = registry.name(st.holder.worker);
            let is_live = is_live && registered.is_some();
            let Some(name) = registered.or_else(|| last.get(&st.holder).map(|seen| seen.1.clone())) else {
                continue;
            };
            let rank = st.holder.rank.0.to_string();
            let seen =
                last.entry(st.holder).or_insert_with(|| (st.incarnation, name.clone(), HashMap::new()));
            if seen.0 != st.incarnation || seen.1 != name {
                *seen = (st.incarnation, name.clone(), HashMap::new());
            }
            let mut advance = |key: &'static str, now: u64, counter: metrics::Counter| {
                let before = seen.2.insert(key, now).unwrap_or(0);
                counter.increment(now.saturating_sub(before));
            };
            let labels = [("worker", name.clone()), ("rank", rank.clone())];
            advance("batches", st.batches, metrics::counter!(t::EVENT_BATCHES, &labels));
            advance("duplicates", st.duplicates, metrics::counter!(t::EVENT_DUPLICATES, &labels));
            advance(
                "rank_mismatches",
                st.rank_mismatches,
                metrics::counter!(t::EVENT_RANK_MISMATCHES, &labels),
            );
            advance("replays", st.replays_requested, metrics::counter!(t::EVENT_REPLAYS, &labels));
            for reason in Reason::ALL {
                let c = metrics::counter!(t::EVENT_TRANSITIONS, "worker" => name.clone(), "rank" => rank.clone(), "reason" => reason.as_str());
                advance(reason.as_str(), st.transitions(reason), c);
            }
            for (i, kind) in DECODE_ERROR_KINDS.iter().enumerate() {
                let c = metrics::counter!(t::EVENT_DECODE_ERRORS, "worker" => name.clone(), "rank" => rank.clone(), "kind" => *kind);
                advance(kind, st.decode_errors[i], c);
            }
            if is_live {
                let labels = [("worker", name.as_str()), ("rank", rank.as_str())];
                gauges.set(t::EVENT_APPLY_LAG, &labels, st.apply_lag_us as f64 / 1e6);
                gauges.set(t::EVENT_APPLY_LAG_MAX, &labels, st.apply_lag_max_us as f64 / 1e6);
            }
        }
        // Holders no longer followed: their final counts were taken above.
        last.retain(|h, _| live.iter().any(|s| s.holder == *h));
    })
}

/// Turns the registry's events into ingest calls, in order. Removal waits for the event plane
/// to stop following the worker (blocking), so it runs off the async threads.
async fn forward_events(mut events: mpsc::UnboundedReceiver<RegistryEvent>, ingest: Arc<Ingest>) {
    while let Some(ev) = events.recv().await {
        match ev {
            RegistryEvent::Follow(sources) => {
                for s in sources {
                    let holder = s.holder;
                    if let Err(e) = ingest.add_holder(s) {
                        tracing::error!(%holder, error = %e, "cannot follow holder");
                    }
                }
            }
            RegistryEvent::Unfollow(worker) => {
                let ing = Arc::clone(&ingest);
                match tokio::task::spawn_blocking(move || ing.remove_worker(worker)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::error!(%worker, error = %e, "cannot unfollow worker"),
                    Err(e) => tracing::error!(%worker, error = %e, "unfollow task failed"),
                }
            }
            RegistryEvent::Running(holder, n, stores) => ingest.report_running(holder, n, stores),
        }
    }
}
