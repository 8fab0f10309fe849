//! The control plane: the single owner of worker membership. Workers join and leave here, and
//! each one's life — discovery, the live pool, health probes, load polls, leaving and rejoining —
//! runs here; so does the scheduler's view of each holder's ledger state.
//!
//! ```text
//! join ─► registry (discovering) ─► discover ─► arrive ─► live: probe health, poll load
//!                                     ▲                          │ failures_to_remove probes fail
//!                                     └── successes_to_restore ◄─ depart (failed)
//! leave ─► depart (removed)
//! ```
//!
//! Key decisions:
//! - Membership lives in the registry, the scheduler's snapshot, the event plane (its holders,
//!   lanes and ledger slots, behind [`RegistryEvent`]s) and the alignment verdicts. Only
//!   [`Control`] changes any of them, always in one order — registry → snapshot → event plane →
//!   alignment — under one lock, so a worker removed while its probe was answering cannot come
//!   back as a ghost in one place and not another.
//! - At registration every fact that decides block identity is read from the worker (see
//!   [`crate::probes`]); any disagreement with the configured profile, or a fact that could not
//!   be read, turns exact routing off for that worker with the reason in logs, metrics and
//!   `/debug/workers`; the worker still takes load-routed traffic.
//! - A worker whose probes fail leaves the live pool first, then the event plane drops its
//!   subscription and its ledger entries (no late event can be applied); when it comes back it is
//!   discovered again, its ledger starts SYNCING, its alignment verdict starts from none and its
//!   cooldown and circuit breaker are reset (they judged the instance that left). A worker
//!   whose address refuses a probe's or load poll's connection leaves at once (nothing listens
//!   there) and is awaited at the load polls' pace, so that a process restarted on the same
//!   address faster than `failures_to_remove` probes is rediscovered within seconds, the same way.
//! - The running-request limit the scheduler's watermark counts is the configured one, else what
//!   the engine reports (SGLang: `/server_info` at discovery, then every `/v1/loads`), else
//!   [`crate::registry::DEFAULT_MAX_RUNNING_REQUESTS`]; `/debug/workers` shows which.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cortex_hash::kv::{DpRank, HolderId, HolderSource, Unlabeled, WorkerId};
use cortex_hash::profile::Alignment;
use cortex_radix::{Ledger, Readiness};
use cortex_sched::{Capacity, Cluster, Health, LedgerState, MonotonicClock, Role, WorkerSpec};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::alignment::{Verdict, Verifier};
use crate::config::{Mode, ProbeConfig};
use crate::discovery::{self, Discovery};
use crate::error::ProxyError;
use crate::models::ModelTable;
use crate::probes::{Probed, Probes};
use crate::registry::{
    CapacitySource, MaxRunning, Phase, Registry, RegistryError, RegistryEvent, WorkerConfig, WorkerRecord,
};

/// Why a worker's live phase ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Left {
    /// `failures_to_remove` health probes in a row failed.
    Failed,
    /// Its address refused a probe's or load poll's connection: nothing listens there.
    Refused,
}

/// Why a worker leaves the live pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Departure {
    /// Removed (admin API): forgotten everywhere.
    Removed,
    /// Its health probes failed: it stays registered, and rejoins when it answers again.
    Failed,
}

/// Everything [`Control`] is built from.
#[derive(Debug)]
pub struct ControlParts {
    /// Route or only proxy (proxy-only follows no events).
    pub mode: Mode,
    /// Probe intervals and thresholds.
    pub probes: ProbeConfig,
    /// The workers' prefill throughput per rank (each worker's capacity).
    pub prefill_tokens_per_sec: u32,
    /// Served models.
    pub models: Arc<ModelTable>,
    /// The workers.
    pub registry: Arc<Registry>,
    /// The scheduler's cluster view.
    pub cluster: Arc<Cluster>,
    /// The ledger (each holder's readiness).
    pub ledger: Arc<Ledger>,
    /// The continuous alignment verdicts.
    pub verifier: Arc<Verifier>,
    /// The HTTP side of probing.
    pub http: Probes,
    /// The clock load reports are stamped with.
    pub clock: MonotonicClock,
}

/// The owner of worker membership.
#[derive(Debug)]
pub struct Control {
    mode: Mode,
    probes: ProbeConfig,
    prefill_tokens_per_sec: u32,
    models: Arc<ModelTable>,
    registry: Arc<Registry>,
    cluster: Arc<Cluster>,
    ledger: Arc<Ledger>,
    verifier: Arc<Verifier>,
    events: mpsc::UnboundedSender<RegistryEvent>,
    http: Probes,
    clock: MonotonicClock,
    /// Each worker's life task.
    tasks: Mutex<HashMap<WorkerId, AbortHandle>>,
    /// Held while membership changes anywhere (never across an await).
    membership: Mutex<()>,
}

impl Control {
    /// `/debug/workers`' body: every worker with its ranks' ledger state, bookings, engine load
    /// and learned prefill rate — for tools that run the gateway in process (the replay compares
    /// the learned rates with the simulators' true ones).
    #[must_use]
    pub fn workers_view(&self) -> serde_json::Value {
        crate::debug::workers(self)
    }

    /// A control plane built from `parts`; the receiver yields what the event plane must follow,
    /// in order.
    #[must_use]
    pub fn new(parts: ControlParts) -> (Control, mpsc::UnboundedReceiver<RegistryEvent>) {
        let (events, rx) = mpsc::unbounded_channel();
        let c = Control {
            mode: parts.mode,
            probes: parts.probes,
            prefill_tokens_per_sec: parts.prefill_tokens_per_sec,
            models: parts.models,
            registry: parts.registry,
            cluster: parts.cluster,
            ledger: parts.ledger,
            verifier: parts.verifier,
            events,
            http: parts.http,
            clock: parts.clock,
            tasks: Mutex::new(HashMap::new()),
            membership: Mutex::new(()),
        };
        (c, rx)
    }

    /// The HTTP side of asking workers (probes, and the fan-outs of [`crate::fanout`]).
    pub(crate) fn http(&self) -> &Probes {
        &self.http
    }

    /// The workers.
    #[must_use]
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The scheduler's cluster view.
    #[must_use]
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The ledger.
    #[must_use]
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The served models.
    #[must_use]
    pub fn models(&self) -> &ModelTable {
        &self.models
    }

    /// Route or only proxy.
    #[must_use]
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The clock of load reports and cooldowns.
    #[must_use]
    pub fn clock(&self) -> MonotonicClock {
        self.clock
    }

    /// The continuous alignment verdict of a worker.
    #[must_use]
    pub fn verdict(&self, worker: WorkerId) -> Verdict {
        self.verifier.verdict(worker)
    }

    /// Workers in the live pool (healthy: discovered, probed, not failing).
    #[must_use]
    pub fn live_workers(&self) -> usize {
        self.cluster.load().workers().iter().filter(|w| w.health() == Health::Healthy).count()
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.membership.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a worker and starts its life in the background (discovery first).
    ///
    /// # Errors
    /// [`ProxyError::InvalidRequest`] for a model not served or of another engine, a bad name or
    /// URL, a name taken or another worker's address ([`RegistryError`]).
    pub fn join(self: &Arc<Self>, config: WorkerConfig) -> Result<WorkerId, ProxyError> {
        config.check_model(&self.models).map_err(|e| ProxyError::InvalidRequest(e.to_string()))?;
        if self.mode == Mode::ProxyOnly && config.events.is_some() {
            return Err(ProxyError::InvalidRequest(format!(
                "worker {} has `events`, but the gateway runs in mode proxy_only, which follows no KV events: \
                 it would have no effect",
                config.name
            )));
        }
        if self.mode == Mode::ProxyOnly && config.role != Role::Regular {
            return Err(ProxyError::InvalidRequest(format!(
                "worker {} has role {}, but the gateway runs in mode proxy_only, which never disaggregates: \
                 it would receive no request",
                config.name,
                config.role.as_str()
            )));
        }
        let record = {
            let _m = self.lock();
            let key = self.models.worker_api_key(&config.model).cloned();
            self.registry
                .add_keyed(config, key)
                .map_err(|e: RegistryError| ProxyError::InvalidRequest(e.to_string()))?
        };
        let id = record.id;
        let c = Arc::clone(self);
        let task = tokio::spawn(async move { c.life(record).await });
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner).insert(id, task.abort_handle());
        Ok(id)
    }

    /// Removes a worker everywhere. Returns false if there was no such worker.
    pub fn leave(&self, id: WorkerId) -> bool {
        if let Some(task) = self.tasks.lock().unwrap_or_else(PoisonError::into_inner).remove(&id) {
            task.abort();
        }
        self.depart(id, Departure::Removed)
    }

    /// Stops every worker's life task (graceful shutdown); membership stays as it is.
    pub fn shutdown(&self) {
        for (_, task) in self.tasks.lock().unwrap_or_else(PoisonError::into_inner).drain() {
            task.abort();
        }
    }

    /// The worker enters the live pool with what discovery learned: registry, then snapshot,
    /// then event plane (alignment starts from no verdict). Nothing happens if it was removed
    /// meanwhile.
    fn arrive(&self, w: &Arc<WorkerRecord>, d: Discovery) {
        let model = self.models.get(Some(&w.config.model));
        let alignment = match model {
            Some(m) => m.spec().profile.check(&d.facts),
            None => Alignment::Unconfirmed(vec!["model"]),
        };
        match &alignment {
            Alignment::Confirmed => {
                tracing::info!(worker = %w.config.name, "profile confirmed: exact routing on")
            }
            Alignment::Unconfirmed(fields) => {
                tracing::warn!(worker = %w.config.name, ?fields, "profile unconfirmed: exact routing off");
            }
            Alignment::Mismatch(m) => {
                let reasons: Vec<String> = m.iter().map(ToString::to_string).collect();
                tracing::warn!(worker = %w.config.name, reasons = %reasons.join("; "), "profile mismatch: exact routing off");
            }
        }
        let content_deterministic = model.is_some_and(|m| m.spec().profile.recipe().content_deterministic());
        let max_running = MaxRunning::resolve(
            w.config.max_running_requests,
            d.max_running_requests,
            CapacitySource::ServerInfo,
        );
        let _m = self.lock();
        if self.registry.get(w.id).is_none() {
            return;
        }
        w.update(|s| {
            s.phase = Phase::Live;
            s.dp_size = d.dp_size;
            s.facts = d.facts.clone();
            s.alignment = alignment.clone();
            s.sources = d.sources.clone();
            s.capacity_blocks = d.capacity_blocks;
            s.max_running = max_running;
            s.last_error = None;
            s.bootstrap_port = d.pd.bootstrap_port;
            s.decode_radix_cache = d.pd.decode_radix_cache.unwrap_or(false);
        });
        self.cluster.upsert(self.spec(w), Health::Healthy);
        // Back healthy: the cooldown and breaker of the instance that left no longer apply.
        if let Some(entry) = self.cluster.load().worker(w.id) {
            entry.state().reset_failures();
        }
        if self.mode == Mode::Route && !d.sources.is_empty() {
            let unlabeled =
                if w.config.unlabeled_stores_unknown { Unlabeled::Unknown } else { Unlabeled::Plain };
            let sources = d
                .sources
                .iter()
                .map(|e| HolderSource {
                    holder: HolderId::new(w.id, e.rank),
                    wire: w.config.engine.into(),
                    model: w.config.model.clone(),
                    unlabeled,
                    publish: e.publish.clone(),
                    replay: e.replay.clone(),
                    topic: e.topic.clone(),
                    capacity_blocks: d.capacity_blocks.max(1),
                    content_deterministic,
                })
                .collect::<Vec<_>>();
            // The event plane's logs name holders by id (`w3/dp0`); this line maps them to the
            // worker's name.
            tracing::info!(
                worker = %w.config.name,
                id = %w.id,
                ranks = sources.len(),
                "following the worker's KV events (the event plane logs it as {}/dp<rank>)",
                w.id
            );
            let _ = self.events.send(RegistryEvent::Follow(sources));
        }
        self.sync_worker(w);
    }

    /// The worker leaves: registry, then snapshot, then event plane, then alignment. Returns
    /// whether it was registered.
    fn depart(&self, id: WorkerId, how: Departure) -> bool {
        let _m = self.lock();
        let known = match how {
            Departure::Removed => self.registry.remove(id).is_some(),
            Departure::Failed => match self.registry.get(id) {
                Some(w) => {
                    w.update(|s| s.phase = Phase::Down);
                    true
                }
                None => false,
            },
        };
        if !known {
            return false;
        }
        match how {
            Departure::Removed => self.cluster.remove(id),
            Departure::Failed => self.cluster.set_health(id, Health::Unhealthy),
        };
        let _ = self.events.send(RegistryEvent::Unfollow(id));
        self.verifier.forget(id);
        true
    }

    /// What the scheduler knows of a worker, from its record.
    fn spec(&self, w: &WorkerRecord) -> WorkerSpec {
        let s = w.status();
        let mut spec = WorkerSpec::new(w.id, w.config.model.clone(), w.config.engine);
        spec.role = w.config.role;
        spec.dp_size = s.dp_size.max(1);
        spec.capacity = Capacity {
            max_running_requests: s.max_running.value,
            kv_blocks: s.capacity_blocks,
            prefill_tokens_per_sec: self.prefill_tokens_per_sec,
        };
        spec.labels = vec![("name".into(), w.config.name.clone()), ("url".into(), w.config.url.clone())];
        spec
    }

    /// The ledger state the scheduler should see for a holder.
    #[must_use]
    pub fn holder_state(&self, id: WorkerId, rank: DpRank) -> LedgerState {
        let Some(w) = self.registry.get(id) else { return LedgerState::Disabled };
        let status = w.status();
        let aligned = matches!(status.alignment, Alignment::Confirmed)
            && !matches!(self.verifier.verdict(id), Verdict::Misaligned(_));
        if !aligned || status.sources.is_empty() || self.mode == Mode::ProxyOnly {
            return LedgerState::Disabled;
        }
        match self.ledger.readiness(HolderId::new(id, rank)) {
            Some(Readiness::Ready) => LedgerState::Ready,
            Some(Readiness::Syncing) | None => LedgerState::Syncing,
            Some(Readiness::Stale) => LedgerState::Stale,
        }
    }

    fn sync_worker(&self, w: &WorkerRecord) {
        let snap = self.cluster.load();
        let Some(entry) = snap.worker(w.id) else { return };
        for r in 0..w.dp_size() {
            let rank = DpRank(r);
            entry.state().set_ledger(rank, self.holder_state(w.id, rank));
            if let Some(n) = self.ledger.held_blocks(HolderId::new(w.id, rank)) {
                entry.state().set_cached_blocks(rank, n);
            }
        }
    }

    /// Pushes every holder's ledger state (readiness and alignment) into the scheduler.
    pub fn sync_ledger_states(&self) {
        for w in self.registry.snapshot().values() {
            self.sync_worker(w);
        }
    }

    /// Resolves when some alignment verdict changed (the ledger states then need a sync).
    pub async fn verdict_changed(&self) {
        self.verifier.changed().await;
    }

    /// A worker's life, until it is removed (the task is aborted) or the gateway shuts down.
    async fn life(self: Arc<Self>, w: Arc<WorkerRecord>) {
        let probes = self.probes;
        loop {
            let discovery = loop {
                match self.http.discover(&w, self.models.get(Some(&w.config.model))).await {
                    Ok(d) => break d,
                    Err(e) => {
                        tracing::warn!(worker = %w.config.name, error = %e, "discovery failed; retrying");
                        w.update(|s| s.last_error = Some(e));
                        tokio::time::sleep(probes.health_interval).await;
                    }
                }
            };
            self.arrive(&w, discovery);
            let left = self.live(&w).await;
            self.depart(w.id, Departure::Failed);
            // Wait until it answers again, then rediscover (its ledger starts SYNCING). One that
            // refused connections is awaited at the load polls' pace: a process restarting on
            // the same address is back in seconds, and the breaker and cooldown its predecessor
            // earned are reset when it is rediscovered.
            let every = match left {
                Left::Failed => {
                    tracing::warn!(worker = %w.config.name, "worker left the live pool");
                    probes.health_interval
                }
                Left::Refused => {
                    tracing::warn!(worker = %w.config.name, "worker refused connections: it left the live pool");
                    probes.health_interval.min(probes.load_interval)
                }
            };
            // A worker that stays away is probed less and less often, up to `health_interval`.
            let (mut ok, mut every) = (0, every);
            while ok < probes.successes_to_restore {
                tokio::time::sleep(every).await;
                ok = if self.http.healthy(&w).await {
                    ok + 1
                } else {
                    every = every.saturating_mul(2).min(probes.health_interval);
                    0
                };
            }
            tracing::info!(worker = %w.config.name, "worker answers again; rediscovering");
        }
    }

    /// Probes health and polls load until `failures_to_remove` health probes in a row fail, or
    /// a probe or poll finds its address refusing connections (nothing listens there: it may be
    /// restarting, faster than `failures_to_remove` probes would notice).
    async fn live(&self, w: &Arc<WorkerRecord>) -> Left {
        let probes = self.probes;
        let mut health = tokio::time::interval(probes.health_interval);
        let mut load = tokio::time::interval(probes.load_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        load.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0;
        loop {
            tokio::select! {
                _ = health.tick() => match self.http.health(w).await {
                    Probed::Up => failures = 0,
                    Probed::Refused => return Left::Refused,
                    Probed::Down => {
                        failures += 1;
                        if failures >= probes.failures_to_remove {
                            return Left::Failed;
                        }
                    }
                },
                _ = load.tick() => match self.http.loads(w).await {
                    Ok(Some(reports)) => self.reported(w, &reports),
                    Ok(None) | Err(Probed::Down | Probed::Up) => {}
                    Err(Probed::Refused) => return Left::Refused,
                },
            }
        }
    }

    /// A load poll's answer: each rank's load into the scheduler, the engine's activity to the
    /// event plane (silence detection), and a changed running-request limit into the snapshot.
    fn reported(&self, w: &Arc<WorkerRecord>, reports: &[discovery::RankReport]) {
        let snap = self.cluster.load();
        let Some(entry) = snap.worker(w.id) else { return };
        let now = self.clock.now();
        for r in reports {
            entry.state().report_load(r.rank, r.load, now);
            // Queued requests count too: an engine with work and no events is suspicious, if the
            // work stores blocks (a cache hit stores none).
            let busy = u64::from(r.load.running) + u64::from(r.load.waiting);
            let at = |t: cortex_sched::Timestamp| {
                let ago = now.saturating_since(t);
                std::time::Instant::now().checked_sub(ago).unwrap_or_else(std::time::Instant::now)
            };
            let stores =
                entry.state().take_expected_events(r.rank).map(|(first, last)| (at(first), at(last)));
            let _ = self.events.send(RegistryEvent::Running(HolderId::new(w.id, r.rank), busy, stores));
        }
        let Some(reported) = discovery::reported_max_running(reports) else { return };
        let max_running =
            MaxRunning::resolve(w.config.max_running_requests, Some(reported), CapacitySource::LoadReport);
        if w.status().max_running == max_running {
            return;
        }
        let _m = self.lock();
        if self.registry.get(w.id).is_none() || w.status().phase != Phase::Live {
            return;
        }
        w.update(|s| s.max_running = max_running);
        self.cluster.upsert(self.spec(w), Health::Healthy);
    }
}
