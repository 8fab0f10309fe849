//! [`SimWorker`]: one simulated engine server, started in-process and driven through a handle.
//!
//! Key decisions:
//! - Every listener (HTTP, PUB/ROUTER, PD rendezvous) is bound before [`SimWorker::start`]
//!   returns, so an address handed out is already accepting connections.
//! - A worker owns its threads: one thread running a current-thread tokio runtime (HTTP, the
//!   ranks' stepping tasks, PD timers) and one ZeroMQ thread. [`SimWorker::shutdown`] (or drop)
//!   stops both and closes every socket, so tests leave nothing running; a worker works the same
//!   whether the caller is synchronous or inside its own tokio runtime.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;

use crate::config::{EngineConfig, ModelSource, Role, SimConfig};
use crate::engine::{Rank, RankParams};
use crate::faults::{Fault, HttpFaults};
use crate::model::SimModel;
use crate::pd::PdRegistry;
use crate::publisher::{Publisher, RankEndpoints, ReplayFraming};
use crate::sglang::RadixCache;
use crate::truth::{HeldBlock, RankState};
use crate::vllm::BlockPool;
use crate::{SimError, http};

/// State shared by the handle, the HTTP handlers and the ranks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: SimConfig,
    pub(crate) model: Arc<SimModel>,
    pub(crate) ranks: Vec<Arc<Rank>>,
    pub(crate) publisher: Option<Arc<Publisher>>,
    pub(crate) pd: Arc<PdRegistry>,
    pub(crate) pd_addr: Option<SocketAddr>,
    pub(crate) http_addr: SocketAddr,
    pub(crate) faults: HttpFaults,
    pub(crate) engine_id: String,
    pub(crate) rr: AtomicUsize,
    pub(crate) created: u64,
    pub(crate) inflight_http: AtomicUsize,
    /// Decode legs whose KV transfer failed.
    pub(crate) pd_transfer_failures: AtomicU64,
    /// Generation requests whose client left before their answer was complete.
    pub(crate) client_gone: AtomicU64,
    /// The W3C `traceparent` header of every API request that carried one, in arrival order
    /// (at most [`TRACEPARENTS_KEPT`], the oldest dropped).
    pub(crate) traceparents: std::sync::Mutex<std::collections::VecDeque<String>>,
}

/// `traceparent` headers remembered by a worker.
pub(crate) const TRACEPARENTS_KEPT: usize = 1024;

impl Shared {
    /// Remembers an API request's `traceparent`.
    pub(crate) fn saw_traceparent(&self, value: &str) {
        let mut q = self.traceparents.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.len() == TRACEPARENTS_KEPT {
            q.pop_front();
        }
        q.push_back(value.to_owned());
    }

    pub(crate) fn traceparents(&self) -> Vec<String> {
        self.traceparents.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned().collect()
    }
}

impl Shared {
    pub(crate) fn rank(&self, rank: u16) -> Result<&Arc<Rank>, SimError> {
        self.ranks.get(usize::from(rank)).ok_or(SimError::NoSuchRank { rank, dp_size: self.cfg.dp_size })
    }

    pub(crate) fn is_vllm(&self) -> bool {
        matches!(self.cfg.engine, EngineConfig::Vllm(_))
    }

    pub(crate) fn rank_state(&self, rank: u16) -> Result<RankState, SimError> {
        let r = self.rank(rank)?;
        let load = r.load();
        Ok(RankState {
            rank,
            blocks: r.held_blocks(),
            subscribed: self.publisher.as_ref().is_some_and(|p| p.subscribed(rank)),
            last_seq: self.publisher.as_ref().and_then(|p| p.last_seq(rank)),
            replay_ignored: self.publisher.as_ref().map_or(0, |p| p.replay_ignored(rank)),
            running: load.running,
            waiting: load.waiting,
            virtual_time: load.now,
            pd: crate::PdCounters {
                prefill_legs: load.stats.pd_prefill_legs,
                decode_legs: load.stats.pd_decode_legs,
                pulled_tokens: load.stats.pulled_tokens,
            },
            cancelled: load.stats.cancelled,
            computed_prompt_tokens: load.stats.computed_prompt_tokens,
            preemptions: load.stats.preemptions,
        })
    }

    pub(crate) fn apply(&self, fault: &Fault) -> Result<(), SimError> {
        let publisher =
            || self.publisher.as_ref().ok_or(SimError::Config { field: "events.enabled", reason: "is off" });
        match *fault {
            Fault::FailNext { status, count } => self.faults.fail_next(status, count),
            Fault::Stall => self.ranks.iter().for_each(|r| r.set_stalled(true)),
            Fault::Resume => self.ranks.iter().for_each(|r| r.set_stalled(false)),
            Fault::DieMidStream { after_tokens, count } => self.faults.die_mid_stream(after_tokens, count),
            Fault::DropBatches { rank, count } => {
                self.rank(rank)?;
                publisher()?.drop_next(rank, count);
            }
            Fault::RestartPublisher { rank } => {
                self.rank(rank)?;
                publisher()?.restart(rank);
            }
            Fault::Replay { rank, enabled } => {
                self.rank(rank)?;
                publisher()?.set_replay(rank, enabled);
            }
            Fault::FlushCache => {
                if self.ranks.iter().any(|r| r.in_flight() > 0 || r.leases() > 0) {
                    return Err(SimError::FlushRefused);
                }
                for r in &self.ranks {
                    if !r.flush() {
                        return Err(SimError::FlushRefused);
                    }
                }
            }
            Fault::Health { healthy } => self.faults.set_healthy(healthy),
            Fault::FailTransfers { count } => self.faults.fail_transfers(count),
        }
        Ok(())
    }
}

/// A running simulated worker (one engine server with `dp_size` ranks).
#[derive(Debug)]
pub struct SimWorker {
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

fn load_model(cfg: &SimConfig) -> Result<Arc<SimModel>, SimError> {
    let base = match &cfg.model {
        ModelSource::Qwen3 => SimModel::qwen3()?,
        ModelSource::Dir(d) => SimModel::load_dir(d)?,
        ModelSource::Loaded(m) => Arc::clone(m),
    };
    match &cfg.chat_template {
        Some(t) => base.with_template(t),
        None => Ok(base),
    }
}

fn bind_std(addr: SocketAddr) -> Result<std::net::TcpListener, SimError> {
    let l = std::net::TcpListener::bind(addr).map_err(SimError::Bind)?;
    l.set_nonblocking(true).map_err(SimError::Bind)?;
    Ok(l)
}

impl SimWorker {
    /// Starts a worker: loads (or reuses) the model, binds the HTTP listener, the event sockets
    /// of every rank and, for a prefill worker, the PD rendezvous listener, then returns.
    ///
    /// # Errors
    /// [`SimError`] if the config is invalid, the model cannot be loaded or a socket cannot be
    /// bound.
    pub fn start(cfg: SimConfig) -> Result<SimWorker, SimError> {
        cfg.validate()?;
        let model = load_model(&cfg)?;
        let publisher = if cfg.events.enabled {
            let ctx = zmq::Context::new();
            // Replies gained a topic frame in vLLM 0.26; SGLang 0.5.19 replied without it too.
            let framing = match &cfg.engine {
                EngineConfig::Vllm(o) if o.version < cortex_events_vllm::Version::new(0, 26, 0) => {
                    ReplayFraming::WithoutTopic
                }
                EngineConfig::Sglang(o) if o.encoding == cortex_events_sglang::Encoding::Arrays => {
                    ReplayFraming::WithoutTopic
                }
                _ => ReplayFraming::WithTopic,
            };
            Some(Arc::new(Publisher::start(&ctx, cfg.host, cfg.dp_size, &cfg.events, framing)?))
        } else {
            None
        };
        let http_listener = bind_std(SocketAddr::new(cfg.host, cfg.http_port))?;
        let http_addr = http_listener.local_addr().map_err(SimError::Bind)?;
        let pd_listener = if cfg.role == Role::Prefill {
            Some(bind_std(SocketAddr::new(cfg.host, cfg.pd.port))?)
        } else {
            None
        };
        let pd_addr = pd_listener
            .as_ref()
            .map(std::net::TcpListener::local_addr)
            .transpose()
            .map_err(SimError::Bind)?;
        let pd = Arc::new(PdRegistry::default());
        let ranks: Vec<Arc<Rank>> = (0..cfg.dp_size)
            .map(|r| {
                Arc::new(Rank::new(
                    RankParams {
                        rank: r,
                        timing: cfg.timing,
                        max_running: cfg.max_running,
                        max_batched_tokens: cfg.max_batched_tokens,
                        block_size: cfg.block_size,
                        model: Arc::clone(&model),
                        publisher: publisher.clone(),
                        pd: Arc::clone(&pd),
                        bootstrap_timeout: cfg.pd.bootstrap_timeout,
                        kv_lease: cfg.pd.kv_lease,
                    },
                    &cfg.engine,
                    cfg.capacity_blocks,
                    cfg.role == Role::Decode,
                ))
            })
            .collect();
        pd.set_ranks(&ranks);
        // The start-up batches (SGLang's `AllBlocksCleared`, seq 0) are sent before `start`
        // returns, as a real engine sends them before anyone can connect: a subscriber that
        // connects afterwards sees them only through replay, never live at a moment it cannot know.
        if let Some(p) = &publisher {
            p.flush(Duration::from_secs(10))?;
        }
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let shared = Arc::new(Shared {
            engine_id: format!("sim-{:016x}", fastrand::u64(..)),
            cfg,
            model,
            ranks,
            publisher,
            pd,
            pd_addr,
            http_addr,
            faults: HttpFaults::default(),
            rr: AtomicUsize::new(0),
            created,
            inflight_http: AtomicUsize::new(0),
            pd_transfer_failures: AtomicU64::new(0),
            client_gone: AtomicU64::new(0),
            traceparents: std::sync::Mutex::default(),
        });
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(SimError::Runtime)?;
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("cortex-sim-worker".to_owned())
            .spawn(move || {
                rt.block_on(async move {
                    for r in &s.ranks {
                        tokio::spawn(crate::engine::run(Arc::clone(r)));
                    }
                    if let Ok(l) = tokio::net::TcpListener::from_std(http_listener) {
                        tokio::spawn(http::serve(l, Arc::clone(&s), http::Surface::Api));
                    }
                    if let Some(l) = pd_listener.and_then(|l| tokio::net::TcpListener::from_std(l).ok()) {
                        tokio::spawn(http::serve(l, Arc::clone(&s), http::Surface::Rendezvous));
                    }
                    let _ = stop_rx.await;
                    for r in &s.ranks {
                        r.abort_all();
                    }
                });
                // Dropping the runtime cancels every task and closes every connection.
                drop(rt);
            })
            .map_err(SimError::Runtime)?;
        Ok(SimWorker { shared, stop: Some(stop_tx), thread: Some(thread) })
    }

    /// The configuration the worker runs with.
    #[must_use]
    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// The model (tokenizer and template) the worker serves.
    #[must_use]
    pub fn model(&self) -> &Arc<SimModel> {
        &self.shared.model
    }

    /// The HTTP address.
    #[must_use]
    pub fn http_addr(&self) -> SocketAddr {
        self.shared.http_addr
    }

    /// `http://host:port`.
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("http://{}", self.shared.http_addr)
    }

    /// Every rank's PUB and replay addresses (empty if events are off).
    #[must_use]
    pub fn event_endpoints(&self) -> Vec<RankEndpoints> {
        self.shared.publisher.as_ref().map(|p| p.endpoints().to_vec()).unwrap_or_default()
    }

    /// The PD rendezvous listener of a prefill worker (SGLang's `bootstrap_port`, vLLM's side
    /// channel `remote_port`).
    #[must_use]
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.shared.pd_addr
    }

    /// Exactly which blocks `rank` holds.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`].
    pub fn held_blocks(&self, rank: u16) -> Result<Vec<HeldBlock>, SimError> {
        Ok(self.shared.rank(rank)?.held_blocks())
    }

    /// Blocks, subscription, sequence and load of `rank`.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`].
    pub fn rank_state(&self, rank: u16) -> Result<RankState, SimError> {
        self.shared.rank_state(rank)
    }

    /// Whether a subscriber whose subscription matches the topic is connected to `rank`'s PUB.
    #[must_use]
    pub fn subscribed(&self, rank: u16) -> bool {
        self.shared.publisher.as_ref().is_some_and(|p| p.subscribed(rank))
    }

    /// Blocks until a matching subscriber is connected to `rank`'s PUB (messages published from
    /// then on reach it).
    ///
    /// # Errors
    /// [`SimError::Timeout`], [`SimError::NoSuchRank`], or [`SimError::Config`] if events are off.
    pub fn wait_subscribed(&self, rank: u16, timeout: Duration) -> Result<(), SimError> {
        self.publisher()?.wait_subscribed(rank, timeout)
    }

    /// [`SimWorker::wait_subscribed`] for async callers (it never blocks the caller's runtime).
    ///
    /// # Errors
    /// As [`SimWorker::wait_subscribed`].
    pub async fn wait_subscribed_async(&self, rank: u16, timeout: Duration) -> Result<(), SimError> {
        let mut rx = self
            .publisher()?
            .subscription_watch(rank)
            .ok_or(SimError::NoSuchRank { rank, dp_size: self.shared.cfg.dp_size })?;
        tokio::time::timeout(timeout, rx.wait_for(|on| *on))
            .await
            .map_err(|_| SimError::Timeout(timeout))?
            .map(|_| ())
            .map_err(|_| SimError::ShutDown)
    }

    fn publisher(&self) -> Result<&Arc<Publisher>, SimError> {
        self.shared.publisher.as_ref().ok_or(SimError::Config { field: "events.enabled", reason: "is off" })
    }

    /// The last sequence number `rank` published (or dropped by a fault).
    #[must_use]
    pub fn last_seq(&self, rank: u16) -> Option<u64> {
        self.shared.publisher.as_ref().and_then(|p| p.last_seq(rank))
    }

    /// Requests running, waiting or awaiting a PD transfer on `rank`.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`].
    pub fn in_flight(&self, rank: u16) -> Result<usize, SimError> {
        Ok(self.shared.rank(rank)?.in_flight())
    }

    /// vLLM prefill worker: leases (finished `do_remote_decode` requests whose blocks wait for
    /// the decode side) held by `rank`.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`].
    pub fn leases(&self, rank: u16) -> Result<usize, SimError> {
        Ok(self.shared.rank(rank)?.leases())
    }

    /// Rank `rank`'s PD legs so far.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`].
    pub fn pd_counters(&self, rank: u16) -> Result<crate::PdCounters, SimError> {
        Ok(self.shared.rank_state(rank)?.pd)
    }

    /// Decode legs whose KV transfer failed (answered as the engine does: an error event after a
    /// `200` head when streaming, a `500` otherwise).
    #[must_use]
    pub fn pd_transfer_failures(&self) -> u64 {
        self.shared.pd_transfer_failures.load(Ordering::SeqCst)
    }

    /// Generation requests being answered over HTTP now (including legs waiting for their KV
    /// transfer, which are not yet in a rank's queue).
    #[must_use]
    pub fn in_flight_http(&self) -> usize {
        self.shared.inflight_http.load(Ordering::SeqCst)
    }

    /// Generation requests whose client left before the answer was complete (what a real
    /// engine sees as an abort: the connection closed while the request waited for its KV,
    /// queued, ran, or streamed).
    #[must_use]
    pub fn client_gone(&self) -> u64 {
        self.shared.client_gone.load(Ordering::SeqCst)
    }

    /// The W3C `traceparent` headers the API requests carried, oldest first (the last 1024):
    /// what a tracing engine would take as the parent of its own spans.
    #[must_use]
    pub fn traceparents(&self) -> Vec<String> {
        self.shared.traceparents()
    }

    /// Injects a fault (see [`Fault`]).
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`] for a bad rank, [`SimError::FlushRefused`] for a flush while
    /// requests run, [`SimError::Config`] for an event fault with events off.
    pub fn inject(&self, fault: &Fault) -> Result<(), SimError> {
        self.shared.apply(fault)
    }

    /// Answers the next `count` generation requests with `status` (429, 500, 503, …).
    pub fn fail_next(&self, status: u16, count: u32) {
        self.shared.faults.fail_next(status, count);
    }

    /// Stops every rank from stepping: requests are accepted and wait, until [`SimWorker::resume`].
    pub fn stall(&self) {
        self.shared.ranks.iter().for_each(|r| r.set_stalled(true));
    }

    /// Resumes stepping.
    pub fn resume(&self) {
        self.shared.ranks.iter().for_each(|r| r.set_stalled(false));
    }

    /// The next `count` requests are cut off after `after_tokens` tokens.
    pub fn die_mid_stream(&self, after_tokens: usize, count: u32) {
        self.shared.faults.die_mid_stream(after_tokens, count);
    }

    /// Skips the next `count` event batches of `rank` (a sequence gap; the ring keeps them).
    ///
    /// # Errors
    /// As [`SimWorker::inject`].
    pub fn drop_next_batches(&self, rank: u16, count: u64) -> Result<(), SimError> {
        self.inject(&Fault::DropBatches { rank, count })
    }

    /// Restarts `rank`'s publisher: sequence back to 0, empty ring, no `AllBlocksCleared`.
    ///
    /// # Errors
    /// As [`SimWorker::inject`].
    pub fn restart_publisher(&self, rank: u16) -> Result<(), SimError> {
        self.inject(&Fault::RestartPublisher { rank })
    }

    /// Turns replay answering on or off for `rank`.
    ///
    /// # Errors
    /// As [`SimWorker::inject`].
    pub fn set_replay(&self, rank: u16, enabled: bool) -> Result<(), SimError> {
        self.inject(&Fault::Replay { rank, enabled })
    }

    /// Flushes every rank's prefix cache (`AllBlocksCleared`).
    ///
    /// # Errors
    /// [`SimError::FlushRefused`] while requests run.
    pub fn flush_cache(&self) -> Result<(), SimError> {
        self.inject(&Fault::FlushCache)
    }

    /// Makes `/health` answer 503 (false) or 200 (true).
    pub fn set_healthy(&self, healthy: bool) {
        self.shared.faults.set_healthy(healthy);
    }

    /// Runs `f` on `rank`'s vLLM block pool, then publishes what it recorded as one batch (how the
    /// faithfulness tests replay vLLM's own `BlockPool` scenario).
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`], or [`SimError::WrongEngine`] on an SGLang worker.
    pub fn with_vllm_pool<R>(&self, rank: u16, f: impl FnOnce(&mut BlockPool) -> R) -> Result<R, SimError> {
        self.shared.rank(rank)?.with_vllm_pool(f).ok_or(SimError::WrongEngine)
    }

    /// Runs `f` on `rank`'s SGLang radix cache, then publishes what it recorded as one batch.
    ///
    /// # Errors
    /// [`SimError::NoSuchRank`], or [`SimError::WrongEngine`] on a vLLM worker.
    pub fn with_radix_cache<R>(
        &self,
        rank: u16,
        f: impl FnOnce(&mut RadixCache) -> R,
    ) -> Result<R, SimError> {
        self.shared.rank(rank)?.with_radix_cache(f).ok_or(SimError::WrongEngine)
    }

    /// Stops the worker: in-flight requests fail, every thread is joined, every socket closed.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    /// Stops the worker as if its process were killed (what [`SimWorker::shutdown`] does), but
    /// keeps the handle: its configuration and addresses stay readable, so a test can start it
    /// again on the same ports ([`SimWorker::config_on_same_ports`]) with an empty cache and its
    /// sequence numbers back to 0, as a restarted engine. Calls that need the running worker
    /// fail or read its last state.
    pub fn kill(&mut self) {
        self.stop_now();
    }

    /// The worker's configuration with its HTTP, event and replay ports fixed to the ones it
    /// bound (it started on ephemeral ports): what starts it again where its clients look.
    #[must_use]
    pub fn config_on_same_ports(&self) -> SimConfig {
        let mut cfg = self.shared.cfg.clone();
        cfg.http_port = self.shared.http_addr.port();
        let eps = self.event_endpoints();
        if let Some(first) = eps.first() {
            cfg.events.port_base = Some(first.publish.port());
            cfg.events.replay_port_base = first.replay.map(|r| r.port());
        }
        if let Some(pd) = self.shared.pd_addr {
            cfg.pd.port = pd.port();
        }
        cfg
    }

    fn stop_now(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.shared.publisher {
            p.shutdown();
        }
    }
}

impl Drop for SimWorker {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// The number of HTTP requests in flight (vLLM's `/load`).
/// Counts a generation request whose client leaves before its answer is complete: armed while
/// the answer is produced, [`ClientWatch::done`] once it is complete (or the simulator itself
/// ended it, as a fault); dropped while armed, it counts the client as gone.
pub(crate) struct ClientWatch {
    shared: Arc<Shared>,
    armed: bool,
}

impl ClientWatch {
    pub(crate) fn new(shared: &Arc<Shared>) -> Self {
        ClientWatch { shared: Arc::clone(shared), armed: true }
    }

    pub(crate) fn done(mut self) {
        self.armed = false;
    }
}

impl Drop for ClientWatch {
    fn drop(&mut self) {
        if self.armed {
            self.shared.client_gone.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub(crate) struct InflightGuard<'a>(&'a AtomicUsize);

impl<'a> InflightGuard<'a> {
    pub(crate) fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        InflightGuard(c)
    }
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
