//! The gateway: the public API's routes over the planner, the forwarder and the control plane,
//! and the request path phase by phase (see `docs/request-lifecycle.md`).
//!
//! ```text
//! read body ─► admit ─► parse facts ─► plan (Planner: tokenize, hash, ledger, decide)
//!   ─► forward (Forwarder: book, attempt, retry before the first byte, relay)
//! ```
//!
//! Key decisions: one `Arc<Gateway>` built once by the binary; it owns only what the routes use
//! (admission, body limits, and the three parts), and the parts own the rest. Every handler
//! returns `Result<_, ProxyError>` and [`Gateway::serve`] is the single place where errors become
//! responses.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use cortex_hash::kv::{DpRank, HolderId};
use cortex_radix::Ledger;
use cortex_sched::{Cluster, HealthPolicy, Role, SchedConfig, Scheduler};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::alignment::Verifier;
use crate::auth::Token;
use crate::config::{Limits, Mode, ProxyConfig};
use crate::control::{Control, ControlParts};
use crate::error::{Body, ErrorFormat, ProxyError, full};
use crate::forwarder::{Forwarder, Outgoing};
use crate::models::ModelTable;
use crate::observe::{Observer, Watch};
use crate::planner::{Ask, Planner};
use crate::probes::Probes;
use crate::registry::{Registry, RegistryEvent};
use crate::request::{self, Route};
use crate::scrape::{Scrape, ScrapeHook};
use crate::{debug, upstream};

/// Everything the binary hands over to build a gateway.
pub struct GatewayParts {
    /// Data-plane settings.
    pub config: ProxyConfig,
    /// Served models.
    pub models: ModelTable,
    /// The ledger the event plane fills.
    pub ledger: Arc<Ledger>,
    /// Scheduler settings.
    pub sched: SchedConfig,
    /// Cooldowns and circuit breaker.
    pub health: HealthPolicy,
    /// The Prometheus recorder's handle, when one is installed.
    pub prometheus: Option<PrometheusHandle>,
}

/// Bounded admission: `max_concurrent` slots and a queue of `max_queue` waiters. A request asks
/// for its slot once its body has been read (slow clients hold connections, bounded by
/// `max_connections`, never slots); `/tokenize` and `/debug/route` take one too, as they
/// tokenize like a routed request.
#[derive(Debug)]
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    max_concurrent: usize,
    waiting: AtomicUsize,
    max_queue: usize,
    timeout: Duration,
}

impl Admission {
    fn new(limits: &Limits) -> Self {
        let max_concurrent = limits.max_concurrent.max(1);
        Admission {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            waiting: AtomicUsize::new(0),
            max_queue: limits.max_queue,
            timeout: limits.queue_timeout,
        }
    }

    async fn acquire(&self) -> Result<OwnedSemaphorePermit, ProxyError> {
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(p);
        }
        // Relaxed: an approximate queue length; admission never depends on exact ordering.
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(ProxyError::Overloaded);
        }
        // Its place in the queue is given back however the wait ends, a client that leaves
        // (the request's future dropped while it waits) included.
        let place = Place(&self.waiting);
        let r = tokio::time::timeout(self.timeout, Arc::clone(&self.slots).acquire_owned()).await;
        drop(place);
        match r {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(ProxyError::ShuttingDown),
            Err(_) => Err(ProxyError::QueueTimeout(self.timeout)),
        }
    }

    /// Requests holding a slot now.
    pub(crate) fn in_flight(&self) -> usize {
        self.max_concurrent.saturating_sub(self.slots.available_permits())
    }
}

/// A request's place in the admission queue, given back when dropped.
struct Place<'a>(&'a AtomicUsize);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        // Relaxed: as in `Admission::acquire`.
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How often the `manual` policy's idle assignments are swept (SGLang: every 60 s).
pub const STICKY_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// How often the answers whose client stopped reading are looked for: a stalled answer is given
/// up between `client_write_timeout` and that plus this.
pub const STALL_SWEEP_EVERY: Duration = Duration::from_millis(250);

/// Between two looks for holders whose pool stopped choosing them (see
/// `cortex_sched::Snapshot::forget_starved`).
pub const STARVED_SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How often every holder's ledger state is mirrored into the scheduler (and at once after an
/// alignment verdict changed).
const LEDGER_SYNC_EVERY: Duration = Duration::from_millis(50);

/// The gateway. Build with [`Gateway::new`]; serve with [`crate::server`].
pub struct Gateway {
    limits: Limits,
    shutdown_grace: Duration,
    shutdown_delay: Duration,
    admission: Admission,
    planner: Planner,
    forwarder: Forwarder,
    control: Arc<Control>,
    observer: Arc<Observer>,
    scrape: Scrape,
    shutting_down: AtomicBool,
    draining: AtomicBool,
    /// The public API's bearer token, when one is required.
    auth: Option<Token>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("mode", &self.control.mode()).finish_non_exhaustive()
    }
}

impl Gateway {
    /// Builds the gateway; the receiver yields what the event plane must follow.
    ///
    /// # Errors
    /// [`ProxyError::Internal`] if the scheduler configuration is invalid.
    pub fn new(
        parts: GatewayParts,
    ) -> Result<(Arc<Gateway>, mpsc::UnboundedReceiver<RegistryEvent>), ProxyError> {
        let cfg = parts.config;
        let sched = Scheduler::new(parts.sched).map_err(|e| ProxyError::Internal(e.to_string()))?;
        let models = Arc::new(parts.models);
        let registry = Arc::new(Registry::new());
        let cluster = Arc::new(Cluster::new(parts.health));
        let clock = cortex_sched::MonotonicClock::new();
        let client = upstream::client(cfg.probes.timeout);
        let observer = Arc::new(Observer::new(cfg.access_log, cfg.tracing.as_ref(), client.clone()));
        let verifier =
            Arc::new(Verifier::new(cfg.alignment, Arc::clone(&parts.ledger), Arc::clone(&registry)));
        let planner = Planner::new(
            cfg.mode,
            Arc::clone(&models),
            Arc::clone(&parts.ledger),
            Arc::clone(&cluster),
            sched,
            clock,
        );
        let forwarder =
            Forwarder::new(client.clone(), Arc::clone(&registry), &cfg, clock, Arc::clone(&verifier));
        let (control, events) = Control::new(ControlParts {
            mode: cfg.mode,
            probes: cfg.probes,
            prefill_tokens_per_sec: cfg.prefill_tokens_per_sec,
            models,
            registry,
            cluster,
            ledger: parts.ledger,
            verifier,
            http: Probes::new(client, cfg.probes.timeout),
            clock,
        });
        let gw = Gateway {
            admission: Admission::new(&cfg.limits),
            limits: cfg.limits,
            shutdown_grace: cfg.shutdown_grace,
            shutdown_delay: cfg.shutdown_delay,
            planner,
            forwarder,
            control: Arc::new(control),
            observer,
            scrape: Scrape::new(parts.prometheus),
            shutting_down: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            auth: cfg.auth,
        };
        Ok((Arc::new(gw), events))
    }

    /// The control plane: worker membership, their state, the ledger and the cluster view.
    #[must_use]
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// The planner (for dry runs and tests).
    #[must_use]
    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// Request limits and timeouts.
    #[must_use]
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Time allowed for graceful shutdown before streams are cut.
    #[must_use]
    pub fn shutdown_grace(&self) -> Duration {
        self.shutdown_grace
    }

    /// Registers `hook` to run on every `/metrics` scrape (see [`ScrapeHook`]).
    pub fn on_scrape(&self, hook: ScrapeHook) {
        self.scrape.add(hook);
    }

    /// Starts the maintenance loop: every holder's ledger state mirrored into the scheduler
    /// (every 50 ms, and at once when an alignment verdict changed), the answers whose client
    /// stopped reading given up (checked every [`STALL_SWEEP_EVERY`]), the learned speeds of
    /// holders their pool stopped choosing forgotten (every [`STARVED_SWEEP_EVERY`]), and the `manual` policy's
    /// idle assignments swept every [`STICKY_SWEEP_EVERY`].
    pub fn start_background(self: &Arc<Self>) {
        let gw = Arc::downgrade(self);
        let control = Arc::clone(&self.control);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(LEDGER_SYNC_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut swept = tokio::time::Instant::now();
            let mut stalls_swept = swept;
            let mut starved_swept = swept;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = control.verdict_changed() => {}
                }
                let Some(gw) = gw.upgrade() else { return };
                if gw.is_shutting_down() {
                    return;
                }
                gw.control.sync_ledger_states();
                if stalls_swept.elapsed() >= STALL_SWEEP_EVERY {
                    stalls_swept = tokio::time::Instant::now();
                    gw.forwarder.sweep_stalled();
                }
                if swept.elapsed() >= STICKY_SWEEP_EVERY {
                    swept = tokio::time::Instant::now();
                    let n = gw.planner.sweep_sticky(gw.control.clock().now());
                    if n > 0 {
                        tracing::debug!(forgotten = n, "idle manual assignments swept");
                    }
                }
                if starved_swept.elapsed() >= STARVED_SWEEP_EVERY {
                    starved_swept = tokio::time::Instant::now();
                    let now = gw.control.clock().now();
                    let n =
                        gw.control.cluster().load().forget_starved(now, cortex_sched::learn::STARVED_AFTER);
                    if n > 0 {
                        tracing::debug!(
                            holders = n,
                            "learned speeds of holders their pool stopped choosing forgotten"
                        );
                    }
                }
            }
        });
    }

    /// Time between the start of a graceful shutdown and closing the listeners (see
    /// [`Gateway::begin_drain`]).
    #[must_use]
    pub fn shutdown_delay(&self) -> Duration {
        self.shutdown_delay
    }

    /// Starts draining, the first step of a graceful shutdown: `/health/ready` answers 503 at
    /// once (so a load balancer or Kubernetes takes the endpoint out), while requests are still
    /// served until [`Gateway::begin_shutdown`].
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Stops admitting requests (graceful shutdown); in-flight ones finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.control.shutdown();
    }

    /// Sends the trace spans still queued (the last step of a graceful shutdown), waiting at
    /// most 5 s for the collector.
    pub async fn flush_traces(&self) {
        self.observer.flush(Duration::from_secs(5)).await;
    }

    /// True once [`Gateway::begin_shutdown`] ran.
    #[must_use]
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// The hyper service: every request of the public listener.
    ///
    /// # Errors
    /// Never: every error becomes a response here.
    pub async fn serve(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
        let rid = request_id(req.headers());
        // SGLang's clients read SGLang's errors; every other route answers OpenAI's.
        let format = if req.uri().path() == "/generate" { ErrorFormat::Sglang } else { ErrorFormat::OpenAi };
        let open = req.uri().path().starts_with("/health/");
        let unread = (req.version(), !hyper::body::Body::is_end_stream(req.body()));
        let answer = match &self.auth {
            Some(token) if !open && !token.admits(req.headers()) => Err(ProxyError::Unauthorized),
            _ => self.dispatch(req, &rid).await,
        };
        let resp = match answer {
            Ok(mut r) => {
                // Routed answers carry it already; `/v1/models`, `/tokenize` and the probes too.
                if !r.headers().contains_key("x-request-id") {
                    crate::upstream::set_header(r.headers_mut(), "x-request-id", &rid);
                }
                r
            }
            Err(e) => {
                metrics::counter!(crate::telemetry::ERRORS, "code" => e.code()).increment(1);
                if e.status().is_server_error() {
                    tracing::warn!(request_id = %rid, error = %e, "request failed");
                }
                let body_unread = unread.1 && e.precedes_body();
                let mut resp = e.into_response_in(&rid, format);
                if body_unread {
                    crate::error::close_connection(&mut resp, unread.0);
                }
                resp
            }
        };
        Ok(resp)
    }

    async fn dispatch(&self, req: Request<Incoming>, rid: &str) -> Result<Response<Body>, ProxyError> {
        let method = req.method().clone();
        let path = req.uri().path();
        match (&method, path) {
            (&Method::POST, "/v1/chat/completions") => self.route(Route::ChatCompletions, req, rid).await,
            (&Method::POST, "/v1/completions") => self.route(Route::Completions, req, rid).await,
            (&Method::POST, "/generate") => self.route(Route::Generate, req, rid).await,
            (&Method::POST, "/tokenize") => self.tokenize(req).await,
            (&Method::GET, "/v1/models") => {
                Ok(json_response(StatusCode::OK, &crate::fanout::models(&self.control).await))
            }
            // HEAD too, for load balancers that probe with it (hyper sends the head alone).
            (&Method::GET | &Method::HEAD, "/health/live") => {
                Ok(json_response(StatusCode::OK, &json!({"status": "live"})))
            }
            (&Method::GET | &Method::HEAD, "/health/ready") => Ok(self.ready()),
            (&Method::GET, "/metrics") => Ok(self.metrics()),
            (_, "/v1/chat/completions" | "/v1/completions" | "/generate" | "/tokenize") => {
                Err(ProxyError::MethodNotAllowed { method: method.to_string(), allow: "POST", note: "" })
            }
            (_, "/health/live" | "/health/ready") => {
                Err(ProxyError::MethodNotAllowed { method: method.to_string(), allow: "GET, HEAD", note: "" })
            }
            (_, "/v1/models" | "/metrics") => {
                Err(ProxyError::MethodNotAllowed { method: method.to_string(), allow: "GET", note: "" })
            }
            _ => Err(ProxyError::NotFound { method: method.to_string(), path: path.to_owned() }),
        }
    }

    /// The request path, followed to its end by a [`Watch`] (counted, logged and traced once).
    async fn route(
        &self,
        route: Route,
        req: Request<Incoming>,
        rid: &str,
    ) -> Result<Response<Body>, ProxyError> {
        let watch = self.observer.watch(route, rid, req.headers());
        let result = self.route_watched(route, req, rid, &watch).await;
        watch.respond(result)
    }

    /// The request path: read, admit, parse, plan, forward.
    async fn route_watched(
        &self,
        route: Route,
        req: Request<Incoming>,
        rid: &str,
        watch: &Watch,
    ) -> Result<Response<Body>, ProxyError> {
        if self.is_shutting_down() {
            return Err(ProxyError::ShuttingDown);
        }
        let (mut parts, body) = req.into_parts();
        // The body first: a client sending it slowly holds its connection, never a slot.
        let body = read_body(body, &self.limits).await?;
        let permit = self.admission.acquire().await?;
        let ask = Ask::new(request::parse(route, &body)?, &parts.headers)?;
        if self.auth.is_some() {
            // Cortex's own token is for Cortex: the workers never see it.
            parts.headers.remove(http::header::AUTHORIZATION);
        }
        watch.asked(ask.facts.model.as_deref());
        let conn = parts.extensions.get::<crate::server::ConnSlot>();
        let out = Outgoing { route, facts: &ask.facts, headers: &parts.headers, body, rid, watch, conn };
        if self.planner.disaggregated(&ask)? {
            let plan = self.planner.plan_pd(&ask).await?;
            // The prefill ranking decides the cache hit (and the fallback reason) of a pair.
            let model = plan.model.base_model();
            watch.planned(model, plan.prefill.mode(), plan.prefill.reason(), plan.prompt_tokens);
            return self.forwarder.forward_pd(out, plan, permit).await;
        }
        let plan = self.planner.plan(&ask, Role::Regular).await?;
        watch.planned(plan.model.base_model(), plan.mode, plan.reason, plan.prompt_tokens);
        self.forwarder.forward(out, plan, permit).await
    }

    /// `POST /tokenize`: the token ids the worker will compute for a chat or completion body.
    async fn tokenize(&self, req: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
        let body = read_body(req.into_body(), &self.limits).await?;
        // Tokenizing costs what a routed request's planning does: it takes a slot too.
        let _permit = self.admission.acquire().await?;
        let route = debug::route_of(None, &body)?;
        let facts = Arc::new(request::parse(route, &body)?);
        let tokens = self.planner.tokenize(&facts).await?;
        Ok(json_response(StatusCode::OK, &json!({"count": tokens.len(), "tokens": tokens})))
    }

    /// `POST /debug/route` (on the admin listener): the dry run of the body (and headers) of a
    /// chat, completion or `/generate` request (`route`, else the body's shape, says which);
    /// answers the ranked candidates with their score breakdown and the excluded holders with why.
    pub(crate) async fn debug_route(
        &self,
        req: Request<Incoming>,
        route: Option<Route>,
    ) -> Result<Response<Body>, ProxyError> {
        let (parts, body) = req.into_parts();
        let body = read_body(body, &self.limits).await?;
        let _permit = self.admission.acquire().await?;
        let route = debug::route_of(route, &body)?;
        let ask = Ask::new(request::parse(route, &body)?, &parts.headers)?;
        let registry = self.control.registry();
        if !self.planner.disaggregated(&ask)? {
            let explained = self.planner.explain(&ask, Role::Regular).await?;
            return Ok(json_response(StatusCode::OK, &debug::route(&explained, registry)));
        }
        // Disaggregated: the prefill choice at the top (it decides the cache hit), the decode and
        // regular (fallback) pools under `pd`. A pinned rank is refused as the request would be.
        if let Some(r) = ask.pinned {
            return Err(ProxyError::InvalidRequest(format!(
                "the request pins data-parallel rank {}, but its model is served disaggregated",
                r.0
            )));
        }
        let mut v = debug::route(&self.planner.explain(&ask, Role::Prefill).await?, registry);
        let decode = debug::route(&self.planner.explain(&ask, Role::Decode).await?, registry);
        let regular = match self.planner.explain(&ask, Role::Regular).await? {
            e if e.ranking.all().next().is_some() => debug::route(&e, registry),
            _ => serde_json::Value::Null,
        };
        // The decode-only rule (vLLM): the decode ranking's best holder, if it lacks few enough
        // prompt tokens, serves alone.
        let pd = self.forwarder.pd();
        let best_uncached = decode["candidates"][0]["prefill_tokens"].as_u64();
        let vllm = self.planner.model_for(&ask.facts)?.spec().profile.engine() == cortex_hash::Engine::Vllm;
        let decode_only = match (pd.decode_only_max_uncached, best_uncached) {
            (Some(max), Some(u)) if vllm => u <= u64::from(max),
            _ => false,
        };
        v["pd"] = json!({
            "prefill_policy": v["policy"],
            "decode": decode,
            "regular": regular,
            "decode_only": {
                "max_uncached": pd.decode_only_max_uncached,
                "best_decode_uncached": best_uncached,
                "chosen": decode_only,
            },
        });
        Ok(json_response(StatusCode::OK, &v))
    }

    fn ready(&self) -> Response<Body> {
        let c = &self.control;
        let live = c.live_workers();
        let ready_holders = c
            .registry()
            .snapshot()
            .values()
            .flat_map(|w| (0..w.dp_size()).map(move |r| HolderId::new(w.id, DpRank(r))))
            .filter(|h| c.ledger().readiness(*h) == Some(cortex_radix::Readiness::Ready))
            .count();
        let draining = self.is_shutting_down() || self.draining.load(Ordering::SeqCst);
        let ok = live > 0 && !draining;
        let body = json!({
            "status": if draining { "draining" } else if ok { "ready" } else { "not_ready" },
            "live_workers": live,
            "ready_holders": ready_holders,
            "routing": if c.mode() == Mode::ProxyOnly { "proxy_only" }
                       else if ready_holders > 0 { "exact_kv_events" } else { "degraded" },
        });
        json_response(if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &body)
    }

    fn metrics(&self) -> Response<Body> {
        let text = self.scrape.render(&self.control, self.admission.in_flight());
        let mut resp = Response::new(full(text));
        resp.headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; version=0.0.4"));
        resp
    }
}

/// Reads a body under the size and time limits.
pub(crate) async fn read_body(body: Incoming, limits: &Limits) -> Result<Bytes, ProxyError> {
    // A declared length beyond the limit is refused before a byte is read (and before hyper
    // answers an `Expect: 100-continue`).
    if usize::try_from(hyper::body::Body::size_hint(&body).lower())
        .map_or(true, |n| n > limits.max_body_bytes)
    {
        return Err(ProxyError::BodyTooLarge { limit: limits.max_body_bytes });
    }
    let limited = http_body_util::Limited::new(body, limits.max_body_bytes);
    match tokio::time::timeout(limits.body_read_timeout, limited.collect()).await {
        Err(_) => Err(ProxyError::BodyTimeout(limits.body_read_timeout)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(ProxyError::BodyTooLarge { limit: limits.max_body_bytes })
        }
        Ok(Err(e)) => Err(ProxyError::BodyRead(e.to_string())),
    }
}

/// The request's `x-request-id` (at most 128 bytes), or a fresh one; both listeners answer with it.
pub(crate) fn request_id(h: &HeaderMap) -> String {
    match h.get("x-request-id").and_then(|v| v.to_str().ok()) {
        Some(v) if !v.is_empty() && v.len() <= 128 => v.to_owned(),
        _ => format!("cortex-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
    }
}

/// A JSON response.
pub(crate) fn json_response(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    resp
}

#[cfg(test)]
mod admission_tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};

    use super::*;

    /// A client that leaves while its request waits for a slot gives its place in the queue
    /// back: before, the count kept it, and every later request found the queue full (429)
    /// whenever the slots were taken.
    #[tokio::test]
    async fn a_request_that_leaves_the_queue_gives_its_place_back() {
        let limits = Limits {
            max_concurrent: 1,
            max_queue: 1,
            queue_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let a = Admission::new(&limits);
        let held = a.acquire().await.expect("the slot");
        for _ in 0..3 {
            let mut cx = Context::from_waker(Waker::noop());
            {
                let mut waiting = pin!(a.acquire());
                assert!(waiting.as_mut().poll(&mut cx).is_pending(), "queued");
                assert_eq!(a.waiting.load(Ordering::Relaxed), 1);
                // A second request finds the queue full.
                assert!(matches!(a.acquire().await, Err(ProxyError::Overloaded)));
            } // the client leaves: its request's future is dropped while it waits
            assert_eq!(a.waiting.load(Ordering::Relaxed), 0, "its place is given back");
        }
        drop(held);
        assert!(a.acquire().await.is_ok());
    }
}
