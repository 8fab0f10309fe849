//! The gateway: shared state and the request path, phase by phase (see
//! `docs/request-lifecycle.md`).
//!
//! ```text
//! admit ─► read body ─► parse facts ─► tokenize (blocking pool, segment reuse) ─► hash ─► ledger query
//!   ─► decide (ranking) ─► book ─► forward ─┬─ 2xx: relay the stream (first token, completion, usage)
//!                                           ├─ the request's own error: pass it through
//!                                           └─ the worker's failure: classify, cool down, next candidate
//! ```
//!
//! Key decisions: one `Arc<Gateway>` built once by the binary holds everything (no global state);
//! every handler returns `Result<_, ProxyError>` and [`Gateway::serve`] is the single place where
//! errors become responses; retries happen only before the response head is returned (the first
//! byte the client sees), and each retry takes the next candidate of the same ranking.

use std::cell::RefCell;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use cortex_hash::SeqHash;
use cortex_hash::kv::{HolderId, WorkerId};
use cortex_radix::{HolderFilter, Ledger, OverlapScores, QueryOptions};
use cortex_sched::{
    CacheView, Candidate, Cluster, FallbackReason, HealthPolicy, MatchMode, MonotonicClock, Ranking,
    Request as SchedRequest, Role, SchedConfig, Scheduler, Snapshot, Untrusted,
};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::alignment::{AlignmentTracker, Check, Verdict, hit_check};
use crate::config::{Mode, ProxyConfig};
use crate::error::{Body, ProxyError, full};
use crate::models::{ModelRoute, ModelTable, TokenizeError};
use crate::registry::{Registry, RegistryEvent};
use crate::request::{self, Prompt, RequestFacts, Route};
use crate::telemetry as t;
use crate::upstream::{self, Answer, Completion, RelayBody, UpstreamClient};

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

/// Bounded admission: `max_concurrent` slots and a queue of `max_queue` waiters.
struct Admission {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_queue: usize,
    timeout: std::time::Duration,
}

impl Admission {
    async fn acquire(&self) -> Result<OwnedSemaphorePermit, ProxyError> {
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(p);
        }
        // Relaxed: an approximate queue length; admission never depends on exact ordering.
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(ProxyError::Overloaded);
        }
        let r = tokio::time::timeout(self.timeout, Arc::clone(&self.slots).acquire_owned()).await;
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(ProxyError::ShuttingDown),
            Err(_) => Err(ProxyError::QueueTimeout(self.timeout)),
        }
    }
}

/// The gateway. Build with [`Gateway::new`]; serve with [`crate::server`].
pub struct Gateway {
    pub(crate) cfg: ProxyConfig,
    pub(crate) models: ModelTable,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) sched: Scheduler,
    pub(crate) registry: Registry,
    pub(crate) alignment: AlignmentTracker,
    pub(crate) client: UpstreamClient,
    pub(crate) clock: MonotonicClock,
    admission: Admission,
    pub(crate) events: mpsc::UnboundedSender<RegistryEvent>,
    prometheus: Option<PrometheusHandle>,
    shutting_down: AtomicBool,
    pub(crate) tasks: Mutex<std::collections::HashMap<WorkerId, tokio::task::AbortHandle>>,
    scrape_hooks: Mutex<Vec<ScrapeHook>>,
}

/// Called on every `/metrics` scrape, before rendering, to refresh metrics that mirror a
/// component this crate does not own (the binary registers the event plane's).
pub type ScrapeHook = Box<dyn Fn(&Gateway) + Send + Sync>;

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("mode", &self.cfg.mode).finish_non_exhaustive()
    }
}

/// What the decision produced for one request.
struct Plan {
    candidates: Vec<Candidate>,
    mode: MatchMode,
    reason: Option<FallbackReason>,
    prompt_tokens: u32,
    seq: Vec<SeqHash>,
    /// The tokens of the prompt's first block (for the alignment checks), when it has one.
    first_page: Vec<cortex_hash::Token>,
    snapshot: Arc<Snapshot>,
}

thread_local! {
    /// Per-thread buffers for the overlap query and the ranking: a decision allocates nothing.
    static BUFFERS: RefCell<(OverlapScores, Ranking)> = RefCell::new((OverlapScores::with_capacity(64), Ranking::with_capacity(64)));
}

impl Gateway {
    /// Builds the gateway; the receiver yields what the event plane must follow.
    ///
    /// # Errors
    /// [`ProxyError::Internal`] if the scheduler configuration is invalid.
    pub fn new(
        parts: GatewayParts,
    ) -> Result<(Arc<Gateway>, mpsc::UnboundedReceiver<RegistryEvent>), ProxyError> {
        let sched = Scheduler::new(parts.sched).map_err(|e| ProxyError::Internal(e.to_string()))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let limits = &parts.config.limits;
        let gw = Gateway {
            admission: Admission {
                slots: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
                waiting: AtomicUsize::new(0),
                max_queue: limits.max_queue,
                timeout: limits.queue_timeout,
            },
            client: upstream::client(parts.config.probes.timeout),
            alignment: AlignmentTracker::new(parts.config.alignment),
            cfg: parts.config,
            models: parts.models,
            ledger: parts.ledger,
            cluster: Arc::new(Cluster::new(parts.health)),
            sched,
            registry: Registry::new(),
            clock: MonotonicClock::new(),
            events: tx,
            prometheus: parts.prometheus,
            shutting_down: AtomicBool::new(false),
            tasks: Mutex::new(std::collections::HashMap::new()),
            scrape_hooks: Mutex::new(Vec::new()),
        };
        Ok((Arc::new(gw), rx))
    }

    /// The cluster view (for tests and the binary).
    #[must_use]
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The worker registry.
    #[must_use]
    pub fn registry(&self) -> &Registry {
        &self.registry
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

    /// The continuous alignment verdict of a worker.
    #[must_use]
    pub fn verdict(&self, worker: WorkerId) -> Verdict {
        self.alignment.verdict(worker)
    }

    /// Workers in the live pool (healthy: discovered, probed, not failing).
    #[must_use]
    pub fn live_workers(&self) -> usize {
        self.cluster.load().workers().iter().filter(|w| w.health() == cortex_sched::Health::Healthy).count()
    }

    /// A registered worker's configured name (the `worker` label of every metric).
    #[must_use]
    pub fn worker_name(&self, worker: WorkerId) -> Option<String> {
        self.registry.get(worker).map(|w| w.config.name.clone())
    }

    /// Registers `hook` to run on every `/metrics` scrape (see [`ScrapeHook`]).
    pub fn on_scrape(&self, hook: ScrapeHook) {
        self.scrape_hooks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(hook);
    }

    /// Stops admitting requests (graceful shutdown); in-flight ones finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        for (_, task) in self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain() {
            task.abort();
        }
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
        let resp = match self.dispatch(req, &rid).await {
            Ok(r) => r,
            Err(e) => {
                metrics::counter!(t::ERRORS, "code" => e.code()).increment(1);
                if e.status().is_server_error() {
                    tracing::warn!(request_id = %rid, error = %e, "request failed");
                }
                e.into_response(&rid)
            }
        };
        Ok(resp)
    }

    async fn dispatch(
        self: &Arc<Self>,
        req: Request<Incoming>,
        rid: &str,
    ) -> Result<Response<Body>, ProxyError> {
        let path = req.uri().path().to_owned();
        let method = req.method().clone();
        match (method.clone(), path.as_str()) {
            (Method::POST, "/v1/chat/completions") => self.route(Route::ChatCompletions, req, rid).await,
            (Method::POST, "/v1/completions") => self.route(Route::Completions, req, rid).await,
            (Method::POST, "/generate") => self.route(Route::Generate, req, rid).await,
            (Method::POST, "/tokenize") => self.tokenize(req).await,
            (Method::POST, "/debug/route") => self.debug_route(req).await,
            (Method::GET, "/debug/workers") => Ok(json_response(StatusCode::OK, &self.debug_workers())),
            (Method::GET, "/v1/models") => Ok(json_response(StatusCode::OK, &self.list_models())),
            (Method::GET, "/health/live") => Ok(json_response(StatusCode::OK, &json!({"status": "live"}))),
            (Method::GET, "/health/ready") => Ok(self.ready()),
            (Method::GET, "/metrics") => Ok(self.metrics()),
            (
                _,
                "/v1/chat/completions"
                | "/v1/completions"
                | "/generate"
                | "/tokenize"
                | "/debug/route"
                | "/debug/workers"
                | "/v1/models"
                | "/health/live"
                | "/health/ready"
                | "/metrics",
            ) => Err(ProxyError::MethodNotAllowed(method.to_string())),
            _ => Err(ProxyError::NotFound { method: method.to_string(), path }),
        }
    }

    /// Reads a body under the size and time limits.
    pub(crate) async fn read_body(&self, body: Incoming) -> Result<Bytes, ProxyError> {
        let limits = &self.cfg.limits;
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

    fn model_for(&self, facts: &RequestFacts) -> Result<&Arc<ModelRoute>, ProxyError> {
        // SGLang names its adapter in `lora_path`; OpenAI routes name it as the model.
        if let Some(l) = facts.lora.as_deref()
            && let Some(m) = self.models.get(Some(l))
        {
            return Ok(m);
        }
        self.models.get(facts.model.as_deref()).ok_or_else(|| {
            ProxyError::UnknownModel(facts.model.clone().unwrap_or_else(|| "(none given)".to_owned()))
        })
    }

    async fn route(
        self: &Arc<Self>,
        route: Route,
        req: Request<Incoming>,
        rid: &str,
    ) -> Result<Response<Body>, ProxyError> {
        if self.is_shutting_down() {
            return Err(ProxyError::ShuttingDown);
        }
        let permit = self.admission.acquire().await?;
        let (parts, body) = req.into_parts();
        let body = self.read_body(body).await?;
        let facts = Arc::new(request::parse(route, &body)?);
        let model = Arc::clone(self.model_for(&facts)?);
        let routing_key = parts.headers.get("x-cortex-routing-key").map(|v| v.as_bytes().to_vec());
        let plan = self.plan(&model, &facts, routing_key.as_deref()).await?;
        self.forward(route, &model, &facts, &parts.headers, body, plan, permit, rid).await
    }

    /// Tokenizes, hashes, queries the ledger and decides.
    async fn plan(
        &self,
        model: &Arc<ModelRoute>,
        facts: &Arc<RequestFacts>,
        routing_key: Option<&[u8]>,
    ) -> Result<Plan, ProxyError> {
        let mut untrusted = None;
        let mut tokens = Vec::new();
        if self.cfg.mode == Mode::ProxyOnly {
            untrusted = Some(Untrusted::ExactRoutingOff);
        } else {
            let started = Instant::now();
            let result = if tokenize_inline(&facts.prompt) {
                Ok(model.tokens(&facts.prompt))
            } else {
                let (m, f) = (Arc::clone(model), Arc::clone(facts));
                tokio::task::spawn_blocking(move || m.tokens(&f.prompt)).await
            };
            metrics::histogram!(t::TOKENIZE_SECONDS).record(started.elapsed().as_secs_f64());
            match result {
                Ok(Ok(t)) => tokens = t,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "no tokens for this request; routing by load");
                    untrusted = Some(untrusted_for(&e));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "tokenizer task failed; routing by load");
                    untrusted = Some(Untrusted::TokenizerFailed);
                }
            }
        }
        let started = Instant::now();
        let mut seq = Vec::new();
        if untrusted.is_none() {
            let h = Instant::now();
            if let Err(e) = model.seq_hashes(&tokens, facts.cache_salt.as_deref(), &mut seq) {
                tracing::debug!(error = %e, "no exact identity for this request");
                untrusted = Some(Untrusted::ExactRoutingOff);
            }
            metrics::histogram!(t::HASH_SECONDS).record(h.elapsed().as_secs_f64());
        }
        let prompt_tokens = if tokens.is_empty() { estimate_tokens(&facts.prompt) } else { tokens.len() };
        let prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        let snapshot = self.cluster.load();
        let now = self.clock.now();
        let block_tokens = model.block_size();
        let decided = BUFFERS.with(|b| {
            let (overlap, ranking) = &mut *b.borrow_mut();
            let cache = match untrusted {
                Some(u) => CacheView::Untrusted(u),
                None => {
                    self.ledger.query(&seq, QueryOptions::default(), overlap);
                    CacheView::Overlap { scores: overlap, block_tokens }
                }
            };
            let req = SchedRequest {
                model: model.base_model(),
                role: Role::Regular,
                now,
                prompt_tokens,
                cache,
                routing_key,
                prefix: &seq,
            };
            self.sched.decide(&snapshot, &req, ranking).map(|()| {
                (ranking.admissible().copied().collect::<Vec<_>>(), ranking.mode(), ranking.reason())
            })
        });
        metrics::histogram!(t::ROUTING_SECONDS).record(started.elapsed().as_secs_f64());
        let (candidates, mode, reason) =
            decided.map_err(|_| ProxyError::NoWorker(model.base_model().to_owned()))?;
        let first_page = if seq.is_empty() { Vec::new() } else { tokens[..block_tokens as usize].to_vec() };
        Ok(Plan { candidates, mode, reason, prompt_tokens, seq, first_page, snapshot })
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward(
        self: &Arc<Self>,
        route: Route,
        model: &Arc<ModelRoute>,
        facts: &Arc<RequestFacts>,
        client_headers: &HeaderMap,
        body: Bytes,
        plan: Plan,
        permit: OwnedSemaphorePermit,
        rid: &str,
    ) -> Result<Response<Body>, ProxyError> {
        let started = Instant::now();
        let retry = self.cfg.retry;
        let mut attempts = 0u32;
        let mut last: Option<upstream::Failure> = None;
        for cand in &plan.candidates {
            if attempts >= retry.max_attempts.max(1) || (attempts > 0 && started.elapsed() >= retry.budget) {
                break;
            }
            let now = self.clock.now();
            if !plan.snapshot.admissible(cand.holder, now) {
                continue;
            }
            let Some(worker) = self.registry.get(cand.holder.worker) else { continue };
            let Some(booking) = plan.snapshot.book(cand, now) else { continue };
            if attempts > 0 {
                metrics::counter!(t::RETRIES).increment(1);
            }
            attempts += 1;
            let mut headers = upstream::end_to_end(client_headers);
            upstream::set_header(&mut headers, "x-request-id", rid);
            let multi_rank = worker.dp_size() > 1;
            let out_body = match worker.config.engine {
                cortex_hash::Engine::Sglang if multi_rank && facts.client_rank.is_none() => {
                    request::splice_routed_dp_rank(&body, cand.holder.rank.0)
                }
                cortex_hash::Engine::Vllm if multi_rank && !headers.contains_key("x-data-parallel-rank") => {
                    upstream::set_header(
                        &mut headers,
                        "x-data-parallel-rank",
                        &cand.holder.rank.0.to_string(),
                    );
                    body.clone()
                }
                _ => body.clone(),
            };
            headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
            let uri = upstream::worker_uri(&worker.base, route.path())?;
            match upstream::send(&self.client, uri, headers, out_body, self.cfg.limits.upstream_head_timeout)
                .await
            {
                Ok(Answer::Stream(resp)) => {
                    let mode = effective_mode(plan.mode, cand);
                    metrics::counter!(t::REQUESTS, "route" => route.as_str(), "mode" => mode.as_str())
                        .increment(1);
                    if let Some(r) = plan.reason {
                        metrics::counter!(t::FALLBACKS, "reason" => r.as_str()).increment(1);
                    }
                    let (up, incoming) = resp.into_parts();
                    let mut headers = upstream::end_to_end(&up.headers);
                    self.cortex_headers(&mut headers, cand, mode, &worker.config.name, rid);
                    let sse = facts.stream
                        || up
                            .headers
                            .get(http::header::CONTENT_TYPE)
                            .and_then(|v| v.to_str().ok())
                            .is_some_and(|v| v.starts_with("text/event-stream"));
                    let on_complete = self.completion_check(model, facts, cand, mode, &plan);
                    let relay = RelayBody::new(
                        incoming,
                        booking,
                        self.clock,
                        sse,
                        self.cfg.limits.upstream_idle_timeout,
                        on_complete,
                    )
                    .holding(permit);
                    let mut resp = Response::new(relay.boxed_unsync());
                    *resp.status_mut() = up.status;
                    *resp.headers_mut() = headers;
                    return Ok(resp);
                }
                Ok(Answer::Reject { status, headers: up_headers, body, class }) => {
                    match class {
                        Some(c) => booking.fail(c, self.clock.now()),
                        None => booking.succeed(self.clock.now()),
                    }
                    let mode = effective_mode(plan.mode, cand);
                    let mut headers = up_headers;
                    self.cortex_headers(&mut headers, cand, mode, &worker.config.name, rid);
                    let mut resp = Response::new(full(body));
                    *resp.status_mut() = status;
                    *resp.headers_mut() = headers;
                    return Ok(resp);
                }
                Err(f) => {
                    tracing::info!(worker = %worker.config.name, class = f.class.as_str(), message = %f.message, "attempt failed");
                    metrics::counter!(t::UPSTREAM_ERRORS, "class" => f.class.as_str(), "stage" => "head")
                        .increment(1);
                    booking.fail(f.class, self.clock.now());
                    last = Some(f);
                }
            }
        }
        match last {
            Some(f) => Err(ProxyError::Upstream { class: f.class, attempts, message: f.message }),
            None => Err(ProxyError::NoWorker(model.base_model().to_owned())),
        }
    }

    fn cortex_headers(&self, h: &mut HeaderMap, cand: &Candidate, mode: MatchMode, worker: &str, rid: &str) {
        upstream::set_header(h, "x-cortex-cache-hit-tokens", &cand.matched_tokens.to_string());
        upstream::set_header(h, "x-cortex-assigned-worker", worker);
        upstream::set_header(h, "x-cortex-assigned-rank", &cand.holder.rank.0.to_string());
        upstream::set_header(h, "x-cortex-match-mode", mode.as_str());
        upstream::set_header(h, "x-request-id", rid);
    }

    /// What to check when the response ends: the realized hit against the prediction, and that
    /// the worker now holds the request's blocks under Cortex's identity.
    fn completion_check(
        self: &Arc<Self>,
        model: &Arc<ModelRoute>,
        facts: &Arc<RequestFacts>,
        cand: &Candidate,
        mode: MatchMode,
        plan: &Plan,
    ) -> upstream::OnComplete {
        let gw = Arc::clone(self);
        let holder = cand.holder;
        let predicted = cand.matched_tokens.min(model.max_cached_tokens(plan.prompt_tokens as usize));
        let exact = mode == MatchMode::ExactKvEvents;
        // The block check costs a timer and a ledger lookup: every request while the worker's
        // window fills, then one in 16.
        let sample =
            self.alignment.samples(holder.worker) < self.cfg.alignment.window || fastrand::u8(..16) == 0;
        let first = (sample && !plan.seq.is_empty()).then(|| {
            let salt = facts.cache_salt.clone();
            (plan.seq[0], plan.first_page.clone(), Arc::clone(model), salt)
        });
        Box::new(move |c: Completion| {
            if let Some(realized) = c.cached_tokens {
                metrics::counter!(t::PREDICTED_HIT_TOKENS).increment(u64::from(predicted));
                metrics::counter!(t::REALIZED_HIT_TOKENS).increment(u64::from(realized));
                if exact && predicted > 0 {
                    gw.record_check(holder.worker, hit_check(predicted, realized));
                }
            }
            if let Some((seq, page, model, salt)) = first {
                let gw2 = Arc::clone(&gw);
                tokio::spawn(async move {
                    tokio::time::sleep(gw2.cfg.alignment.settle).await;
                    // The worker's hash of the first page, as the engine's recipe computes it.
                    let engine =
                        model.predict_engine_hashes(&page, salt.as_deref()).and_then(|h| h.first().copied());
                    gw2.block_check(holder, seq, engine);
                });
            }
        })
    }

    /// After a worker served a request it holds the request's first block (both engines store
    /// prompt blocks): the ledger must show it under Cortex's identity (else the worker's tokens
    /// or block size differ from the gateway's), and under the engine hash the recipe predicts
    /// (else its hash algorithm, seed, salt or LoRA namespacing differ). Checked only while the
    /// holder is READY; a block evicted that fast reads as a failure the tolerance absorbs.
    fn block_check(&self, holder: HolderId, seq: SeqHash, engine: Option<cortex_hash::kv::EngineHash>) {
        if self.ledger.readiness(holder) != Some(cortex_radix::Readiness::Ready) {
            return;
        }
        let mut out = OverlapScores::with_capacity(4);
        let opts = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
        self.ledger.query(&[seq], opts, &mut out);
        let held = out.get(holder).is_some_and(|o| o.any_tier_blocks > 0);
        let check = match (held, engine.map(|e| self.ledger.block(holder, e))) {
            (false, _) => Check::Failed(
                "the worker published no block matching the gateway's tokens for a request it served".into(),
            ),
            (true, None) => Check::Ok,
            (true, Some(Some(b))) if b.state == cortex_radix::DumpState::Countable(seq) => Check::Ok,
            (true, Some(Some(_))) => {
                Check::Failed("the predicted engine hash names another block on the worker".into())
            }
            (true, Some(None)) => Check::Failed(
                "the worker published other engine hashes than its recipe predicts (hash algorithm, seed, salt or LoRA)"
                    .into(),
            ),
        };
        self.record_check(holder.worker, check);
    }

    pub(crate) fn record_check(&self, worker: WorkerId, check: Check) {
        let ok = matches!(check, Check::Ok);
        let name = self.registry.get(worker).map(|w| w.config.name.clone()).unwrap_or_default();
        metrics::counter!(t::ALIGNMENT_CHECKS, "worker" => name.clone(), "result" => if ok { "ok" } else { "failed" })
            .increment(1);
        if let Some(v) = self.alignment.record(worker, check) {
            match &v {
                Verdict::Misaligned(why) => {
                    tracing::warn!(worker = %name, reason = %why, "worker misaligned: exact routing off");
                }
                other => tracing::info!(worker = %name, verdict = other.as_str(), "alignment verdict"),
            }
            self.sync_ledger_states();
        }
    }

    async fn tokenize(&self, req: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
        let body = self.read_body(req.into_body()).await?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
        let route = if v.get("messages").is_some() { Route::ChatCompletions } else { Route::Completions };
        let facts = Arc::new(request::parse(route, &body)?);
        let model = Arc::clone(self.model_for(&facts)?);
        let f = Arc::clone(&facts);
        let tokens = tokio::task::spawn_blocking(move || model.tokens(&f.prompt))
            .await
            .map_err(|e| ProxyError::Internal(e.to_string()))?
            .map_err(|e| ProxyError::InvalidRequest(e.to_string()))?;
        Ok(json_response(StatusCode::OK, &json!({"count": tokens.len(), "tokens": tokens})))
    }

    fn list_models(&self) -> serde_json::Value {
        let data: Vec<serde_json::Value> = self
            .models
            .names()
            .map(|name| json!({"id": name, "object": "model", "created": 0, "owned_by": "cortex"}))
            .collect();
        json!({"object": "list", "data": data})
    }

    fn ready(&self) -> Response<Body> {
        let live = self.live_workers();
        let ready_holders = self
            .registry
            .snapshot()
            .values()
            .flat_map(|w| (0..w.dp_size()).map(move |r| HolderId::new(w.id, cortex_hash::kv::DpRank(r))))
            .filter(|h| self.ledger.readiness(*h) == Some(cortex_radix::Readiness::Ready))
            .count();
        let body = json!({
            "status": if live > 0 && !self.is_shutting_down() { "ready" } else { "not_ready" },
            "live_workers": live,
            "ready_holders": ready_holders,
            "routing": if self.cfg.mode == Mode::ProxyOnly { "proxy_only" }
                       else if ready_holders > 0 { "exact_kv_events" } else { "degraded" },
        });
        let status = if live > 0 && !self.is_shutting_down() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        json_response(status, &body)
    }

    fn metrics(&self) -> Response<Body> {
        self.refresh_gauges();
        let text = self.prometheus.as_ref().map(PrometheusHandle::render).unwrap_or_default();
        let mut resp = Response::new(full(text));
        resp.headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; version=0.0.4"));
        resp
    }

    fn refresh_gauges(&self) {
        let stats = self.ledger.stats();
        metrics::gauge!(t::LEDGER_BYTES).set(stats.live_bytes as f64);
        metrics::gauge!(t::LEDGER_BLOCKS).set(stats.blocks as f64);
        metrics::gauge!(t::LEDGER_ORPHANS).set(stats.orphans as f64);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "capacity").absolute(stats.evictions_capacity);
        metrics::counter!(t::LEDGER_EVICTIONS, "reason" => "budget").absolute(stats.evictions_budget);
        let free = self.admission.slots.available_permits();
        metrics::gauge!(t::INFLIGHT).set(self.cfg.limits.max_concurrent.max(1).saturating_sub(free) as f64);
        for hook in self.scrape_hooks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter() {
            hook(self);
        }
        let snap = self.cluster.load();
        let now = self.clock.now();
        for w in self.registry.snapshot().values() {
            let name = w.config.name.clone();
            let entry = snap.worker(w.id);
            metrics::gauge!(t::WORKER_LIVE, "worker" => name.clone()).set(
                if entry.is_some_and(|e| e.health() == cortex_sched::Health::Healthy) { 1.0 } else { 0.0 },
            );
            let aligned = matches!(w.status().alignment, cortex_hash::profile::Alignment::Confirmed)
                && !matches!(self.alignment.verdict(w.id), Verdict::Misaligned(_));
            metrics::gauge!(t::ALIGNED, "worker" => name.clone()).set(if aligned { 1.0 } else { 0.0 });
            for r in 0..w.dp_size() {
                let rank = cortex_hash::kv::DpRank(r);
                let labels = [("worker", name.clone()), ("rank", r.to_string())];
                if let Some(e) = entry
                    && let Some(l) = e.state().rank_load(rank, now)
                {
                    metrics::gauge!(t::WORKER_INFLIGHT, &labels).set(f64::from(l.booked_requests));
                    if let Some((engine, _age)) = l.engine {
                        metrics::gauge!(t::WORKER_RUNNING, &labels).set(f64::from(engine.running));
                        metrics::gauge!(t::WORKER_WAITING, &labels).set(f64::from(engine.waiting));
                        metrics::gauge!(t::WORKER_KV_USAGE, &labels).set(f64::from(engine.kv_usage));
                    }
                }
                let state = self.holder_state(w.id, rank);
                for s in ["ready", "syncing", "stale", "disabled"] {
                    metrics::gauge!(t::LEDGER_STATE, "worker" => name.clone(), "rank" => r.to_string(), "state" => s)
                        .set(if state.as_str() == s { 1.0 } else { 0.0 });
                }
            }
        }
    }
}

/// Why a request without tokens is routed by load: an extra key the profile does not reproduce
/// turns exact routing off, a prompt Cortex cannot reproduce is a known limit, anything else is a
/// tokenizer failure.
pub(crate) fn untrusted_for(e: &TokenizeError) -> Untrusted {
    match e {
        TokenizeError::ExtraKeyNotReproduced(_) => Untrusted::ExactRoutingOff,
        TokenizeError::Unreproducible(_) => Untrusted::UnreproduciblePrompt,
        TokenizeError::Text(_) => Untrusted::TokenizerFailed,
    }
}

/// The scheduler's mode, or `load_aware` when the chosen candidate (a retry) holds nothing.
fn effective_mode(mode: MatchMode, cand: &Candidate) -> MatchMode {
    if mode == MatchMode::ExactKvEvents && cand.matched_tokens == 0 { MatchMode::LoadAware } else { mode }
}

/// Plain-text prompts up to this many bytes (about 60 tokens) are tokenized on the I/O thread.
/// Handing a prompt to the blocking pool costs two thread wake-ups: for a 40-token completion
/// `cargo xtask bench --only overhead` measured about 50 µs more latency (p50) and 60 µs more
/// CPU per request through the pool than tokenizing inline (about 50 µs). Longer prompts and
/// chat prompts (template rendering) go to the pool, so no I/O thread blocks for long.
const INLINE_TOKENIZE_BYTES: usize = 256;

/// Whether [`ModelRoute::tokens`] for `p` is cheap enough to run on the I/O thread.
fn tokenize_inline(p: &Prompt) -> bool {
    match p {
        Prompt::Tokens(_) | Prompt::Unreproducible(_) => true,
        Prompt::Text(t) => t.len() <= INLINE_TOKENIZE_BYTES,
        Prompt::Chat(_) => false,
    }
}

/// A rough token count when tokenization failed: what a booking reserves.
fn estimate_tokens(p: &Prompt) -> usize {
    match p {
        Prompt::Chat(ctx) => ctx.get("messages").map_or(0, |m| m.to_string().len() / 4),
        Prompt::Text(t) => t.len() / 4,
        Prompt::Tokens(t) => t.len(),
        Prompt::Unreproducible(_) => 0,
    }
}

/// The request's `x-request-id`, or a fresh one.
fn request_id(h: &HeaderMap) -> String {
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
mod tests {
    use super::*;

    #[test]
    fn only_cheap_prompts_are_tokenized_inline() {
        assert!(tokenize_inline(&Prompt::Tokens(vec![1; 100_000])));
        assert!(tokenize_inline(&Prompt::Unreproducible("x")));
        assert!(tokenize_inline(&Prompt::Text("a short completion prompt".into())));
        assert!(!tokenize_inline(&Prompt::Text("x".repeat(INLINE_TOKENIZE_BYTES + 1))));
        assert!(!tokenize_inline(&Prompt::Chat(serde_json::Map::new())));
    }
}
