//! The forwarder: a planned request sent to the workers, one attempt per try, until one answers
//! or the retry budget is spent; the answer relayed with Cortex's headers and the alignment
//! checks armed.
//!
//! ```text
//! for each candidate of the plan:  admissible now? ─► book ─► attempt ─┬─ 2xx: relay (RelayBody)
//!                                                                     ├─ the request's own error: pass it on
//!                                                                     └─ the worker's failure: cool down, next
//! ```
//!
//! Key decisions:
//! - An [`Attempt`] is one try on one holder: the body as received with the booked rank pinned the
//!   engine's way (`routed_dp_rank` spliced into an SGLang body, `X-data-parallel-rank` for vLLM),
//!   sent, classified. The loop around it owns the retry budget and the bookings; a disaggregated
//!   request will be a second kind of attempt (a prefill and a decode leg) under the same loop.
//! - Retries happen only before the response head is returned (the first byte the client sees),
//!   each on the next candidate of the same ranking that is still admissible.
//! - The rank in `x-cortex-assigned-rank`, the booking and the alignment checks are the
//!   candidate's, which the planner restricted to a rank the client pinned.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cortex_hash::Engine;
use cortex_sched::{Candidate, MatchMode, MonotonicClock};
use http::{HeaderMap, Response, Uri};
use http_body_util::BodyExt;
use tokio::sync::OwnedSemaphorePermit;

use crate::alignment::{Prediction, Verifier};
use crate::config::{ProxyConfig, RetryPolicy};
use crate::error::{Body, ErrorFormat, ProxyError, refusal};
use crate::observe::{SpanGuard, Watch};
use crate::planner::{Plan, RANK_HEADER};
use crate::registry::{Registry, WorkerRecord};
use crate::request::{self, RequestFacts, Route};
use crate::server::ConnSlot;
use crate::stall::{Stalls, Watched};
use crate::telemetry as t;
use crate::upstream::{self, Answer, Failure, RelayBody, UpstreamClient};

/// What the client sent, as the forwarder passes it on.
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// The endpoint (the same path on the worker).
    pub route: Route,
    /// The body's routing facts.
    pub facts: &'a Arc<RequestFacts>,
    /// The client's headers (end-to-end ones are forwarded).
    pub headers: &'a HeaderMap,
    /// The body, exactly as received.
    pub body: Bytes,
    /// The request id (`x-request-id`).
    pub rid: &'a str,
    /// The request's observer (its attempts' spans, and how the relay ended).
    pub watch: &'a Watch,
    /// The request's place on its client connection (`None` outside [`crate::server`]).
    pub conn: Option<&'a ConnSlot>,
}

/// Sends planned requests to workers. Shared by every request task.
#[derive(Debug)]
pub struct Forwarder {
    client: UpstreamClient,
    registry: Arc<Registry>,
    retry: RetryPolicy,
    head_timeout: Duration,
    idle_timeout: Duration,
    clock: MonotonicClock,
    verifier: Arc<Verifier>,
    pd: cortex_pd::PdConfig,
    /// Every relay in flight, given up when its client stops reading.
    stalls: Arc<Stalls>,
}

/// One try of a request on one holder.
struct Attempt<'a> {
    worker: &'a WorkerRecord,
    cand: &'a Candidate,
    /// The plan's [`Plan::max_hit`].
    max_hit: u32,
}

impl Forwarder {
    /// A forwarder over `client`, reading workers from `registry`, with `cfg`'s retries,
    /// upstream timeouts and PD rules.
    #[must_use]
    pub fn new(
        client: UpstreamClient,
        registry: Arc<Registry>,
        cfg: &ProxyConfig,
        clock: MonotonicClock,
        verifier: Arc<Verifier>,
    ) -> Self {
        Forwarder {
            client,
            registry,
            retry: cfg.retry,
            head_timeout: cfg.limits.upstream_head_timeout,
            idle_timeout: cfg.limits.upstream_idle_timeout,
            clock,
            verifier,
            pd: cfg.pd,
            stalls: Stalls::new(cfg.limits.client_write_timeout),
        }
    }

    pub(crate) fn client(&self) -> &UpstreamClient {
        &self.client
    }

    pub(crate) fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub(crate) fn clock(&self) -> MonotonicClock {
        self.clock
    }

    pub(crate) fn verifier(&self) -> &Arc<Verifier> {
        &self.verifier
    }

    pub(crate) fn head_timeout(&self) -> Duration {
        self.head_timeout
    }

    pub(crate) fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Watches `relay` for a client that stops reading (see `stall.rs`); `conn` is the request's
    /// place on its client connection.
    pub(crate) fn watch(&self, relay: RelayBody, conn: Option<&ConnSlot>) -> Watched {
        self.stalls.watch(relay, conn.cloned())
    }

    /// Gives up the relays whose client stopped reading; returns how many.
    pub(crate) fn sweep_stalled(&self) -> usize {
        self.stalls.sweep()
    }

    pub(crate) fn pd(&self) -> &cortex_pd::PdConfig {
        &self.pd
    }

    /// Forwards `out` along `plan`, holding `permit` (the admission slot) until the response
    /// body has been relayed.
    ///
    /// # Errors
    /// [`ProxyError::Upstream`] when every attempt failed, [`ProxyError::NoWorker`] when no
    /// candidate could be tried.
    pub async fn forward(
        &self,
        out: Outgoing<'_>,
        plan: Plan,
        permit: OwnedSemaphorePermit,
    ) -> Result<Response<Body>, ProxyError> {
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut last: Option<Failure> = None;
        for cand in &plan.candidates {
            if attempts >= self.retry.max_attempts.max(1)
                || (attempts > 0 && started.elapsed() >= self.retry.budget)
            {
                break;
            }
            let now = self.clock.now();
            if !plan.snapshot.admissible(cand.holder, now) {
                continue;
            }
            let Some(worker) = self.registry.get(cand.holder.worker) else { continue };
            let Some(mut booking) = plan.snapshot.book(cand, now) else { continue };
            booking.track_prefix(&plan.pending, &plan.seq, now);
            // Whether it stores new blocks, so that its engine owes KV events: the ledger says so
            // at once when it has followed the engine's whole history (nothing lost, nothing
            // evicted for its limits) and hashed the prompt; else it knows less than the engine,
            // and the engine's own `cached_tokens` settles it when the answer ends (see
            // `owed_events`). A prompt the ledger did not hash (a cache salt or adapter routed by
            // load only, an untokenizable prompt) matches nothing there, cached or not.
            // One read of the ledger's progress: this and the block check's `events_before`.
            let progress = self.verifier.progress(cand.holder);
            let trusted = progress.is_some_and(|p| p.history_lost == 0) && !plan.seq.is_empty();
            // Owed only once the engine has computed the prompt (its answer's first token): an
            // engine that refuses or fails the request, or drops it unstarted when its client
            // leaves after a streaming head, stores nothing and publishes nothing.
            let owes = trusted
                && computes_new_blocks(plan.prompt_tokens, cand.matched_tokens, plan.model.block_size());
            let owed = (!trusted).then(|| (Arc::clone(booking.worker_state()), cand.holder.rank, now));
            if attempts > 0 {
                metrics::counter!(t::RETRIES).increment(1);
            }
            attempts += 1;
            let attempt = Attempt { worker: &worker, cand, max_hit: plan.max_hit() };
            let mode = effective_mode(plan.mode, cand);
            let mut span = out.watch.span("attempt", &worker.config.name, u32::from(cand.holder.rank.0));
            // Named in the access log when this attempt is left unanswered (after the send:
            // nothing is allocated before it), whether it failed or the client went away during
            // it; an answer's own headers name it otherwise.
            let dispatched =
                Dispatched { watch: out.watch, worker: &worker.config.name, rank: cand.holder.rank.0 };
            // For the block check: the worker's events the ledger had applied before this request.
            let events_before = progress.map(|p| p.events_applied);
            let answer = key_refused(attempt.send(self, &out, span.as_ref()).await, worker.as_ref());
            if let (Some(s), Ok(a)) = (span.as_mut(), &answer) {
                s.answered(a.status().as_u16());
            }
            if answer.is_ok() {
                dispatched.answered();
            }
            match answer {
                Ok(Answer::Stream(resp)) => {
                    if owes {
                        booking.expect_events_after_first_token(now);
                    }
                    let (up, incoming) = resp.into_parts();
                    let mut headers = upstream::end_to_end(&up.headers);
                    attempt.cortex_headers(&mut headers, mode, out.rid);
                    let sse = out.facts.stream
                        || up
                            .headers
                            .get(http::header::CONTENT_TYPE)
                            .and_then(|v| v.to_str().ok())
                            .is_some_and(|v| v.starts_with("text/event-stream"));
                    let check = self.verifier.on_complete(prediction(
                        &worker.config.name,
                        &plan,
                        out.facts,
                        cand,
                        mode,
                        &self.verifier,
                        events_before,
                    ));
                    let (bs, prompt) = (plan.model.block_size(), plan.prompt_tokens);
                    let on_complete: upstream::OnComplete = Box::new(move |c: upstream::Completion| {
                        if let Some(owed) = &owed {
                            owed_events(owed, &c, (prompt, bs));
                        }
                        check(c);
                    });
                    let mut relay =
                        RelayBody::new(incoming, booking, self.clock, sse, self.idle_timeout, on_complete)
                            .holding(permit)
                            .after_attempts(attempts)
                            .in_format(ErrorFormat::of(out.route))
                            .tapped(out.watch.tap());
                    if let Some(s) = span {
                        // The attempt's span lasts as long as its answer is relayed.
                        relay = relay.guarding(Box::new(s));
                    }
                    let mut resp = Response::new(self.watch(relay, out.conn).boxed_unsync());
                    *resp.status_mut() = up.status;
                    *resp.headers_mut() = headers;
                    return Ok(resp);
                }
                Ok(Answer::Reject { status, headers: up_headers, body, class }) => {
                    match class {
                        Some(c) => booking.fail(c, self.clock.now()),
                        None => booking.succeed(self.clock.now()),
                    }
                    // The request's own error: in the route's format, with the worker's status and
                    // message and Cortex's class as its `code`.
                    let mut resp = refusal(status, up_headers, &body, class, ErrorFormat::of(out.route));
                    attempt.cortex_headers(resp.headers_mut(), mode, out.rid);
                    return Ok(resp);
                }
                Err(f) => {
                    tracing::info!(worker = %worker.config.name, class = f.class.as_str(), message = %f.message, "attempt failed");
                    metrics::counter!(t::UPSTREAM_ERRORS, "class" => f.class.as_str(), "stage" => "head")
                        .increment(1);
                    let asked = f.retry_after.map(|s| Duration::from_secs(u64::from(s)));
                    booking.fail_for(f.class, self.clock.now(), asked);
                    last = Some(f);
                }
            }
        }
        match last {
            Some(f) => Err(ProxyError::Upstream {
                class: f.class,
                attempts,
                message: f.message,
                retry_after: f.retry_after,
            }),
            None => Err(ProxyError::NoWorker(plan.model.base_model().to_owned())),
        }
    }
}

impl Attempt<'_> {
    /// Sends the request to the holder and waits for the response head.
    async fn send(
        &self,
        fw: &Forwarder,
        out: &Outgoing<'_>,
        span: Option<&SpanGuard>,
    ) -> Result<Answer, Failure> {
        let traceparent = span.map(SpanGuard::traceparent);
        let (uri, mut headers) =
            upstream_head(out.headers, out.rid, traceparent.as_deref(), self.worker, out.route)?;
        let rank = self.cand.holder.rank.0;
        let body = match self.worker.config.engine {
            // Only a multi-rank worker is told a rank; a body that already pins it (the planner
            // made the candidate that rank) is left byte for byte.
            Engine::Sglang if self.worker.dp_size() > 1 && out.facts.client_rank.is_none() => {
                request::splice_routed_dp_rank(&out.body, rank)
            }
            Engine::Vllm if self.worker.dp_size() > 1 => {
                upstream::set_header(&mut headers, RANK_HEADER, &rank.to_string());
                out.body.clone()
            }
            _ => out.body.clone(),
        };
        upstream::send(&fw.client, uri, headers, body, fw.head_timeout).await
    }

    /// The `x-cortex-*` headers of the answer.
    fn cortex_headers(&self, h: &mut HeaderMap, mode: MatchMode, rid: &str) {
        let hit = self.cand.matched_tokens.min(self.max_hit);
        upstream::set_header(h, "x-cortex-cache-hit-tokens", &hit.to_string());
        upstream::set_header(h, "x-cortex-assigned-worker", &self.worker.config.name);
        upstream::set_header(h, "x-cortex-assigned-rank", &self.cand.holder.rank.0.to_string());
        upstream::set_header(h, "x-cortex-match-mode", mode.as_str());
        upstream::set_header(h, "x-request-id", rid);
    }
}

/// The head of an attempt's upstream request, but for the rank pin: the worker's URI for
/// `route`, and the client's end-to-end headers with the request id, the trace context (when the
/// request is traced), the JSON content type and, for a worker whose engine requires one, its
/// API key in place of the client's `Authorization`.
///
/// # Errors
/// A [`Failure`] (not sent) when the worker's base URI and the route do not make a URI.
pub fn upstream_head(
    client: &HeaderMap,
    rid: &str,
    traceparent: Option<&str>,
    worker: &WorkerRecord,
    route: Route,
) -> Result<(Uri, HeaderMap), Failure> {
    let base = &worker.base;
    let mut headers = upstream::end_to_end(client);
    // The worker's own key replaces whatever the client sent.
    if let Some(key) = &worker.api_key {
        key.apply(&mut headers);
    }
    upstream::set_header(&mut headers, "x-request-id", rid);
    if let Some(t) = traceparent {
        upstream::set_header(&mut headers, "traceparent", t);
    }
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    let uri = upstream::worker_uri_static(base, route.path()).map_err(|e| Failure {
        class: cortex_sched::FailureClass::ServerError,
        message: e.to_string(),
        sent: false,
        retry_after: None,
    })?;
    Ok((uri, headers))
}

/// A worker sent its model's worker API key that answers 401 or 403 refuses the key, not the
/// client: a failure of that worker (cooled down; the request goes to the next), never passed
/// to the client as its own credentials' fault.
pub(crate) fn key_refused(answer: Result<Answer, Failure>, worker: &WorkerRecord) -> Result<Answer, Failure> {
    match answer {
        Ok(Answer::Reject { status, .. })
            if worker.api_key.is_some() && matches!(status.as_u16(), 401 | 403) =>
        {
            let message = format!(
                "worker {} refused the model's worker API key ({status}): check models[].worker_api_key_env",
                worker.config.name
            );
            // Where an operator looks (`/debug/workers`): a key rotated on an engine whose probes
            // need none (vLLM's `/health`, `/metrics`) shows nowhere else.
            worker.update(|s| s.last_error = Some(message.clone()));
            Err(Failure {
                class: cortex_sched::FailureClass::ServerError,
                message,
                sent: true,
                retry_after: None,
            })
        }
        other => other,
    }
}

/// Notes on the worker, when a request's answer ends, that its engine owes KV events for it if
/// it computed a new full block, judged by the engine's own `cached_tokens`. Only for a request
/// the ledger could not judge (it has not followed the engine's whole history, or did not hash
/// the prompt): the ledger then knows less than the engine, and a request it takes for new work
/// may be all cache hits, which store nothing. An answer that reports no `cached_tokens` (a
/// stream without `include_usage`, an engine without its cache report) obliges nothing: its
/// silence could not be told from a healthy engine's. `owed`: the worker, the rank and when the
/// request was sent.
fn owed_events(
    owed: &(Arc<cortex_sched::WorkerState>, cortex_hash::kv::DpRank, cortex_sched::Timestamp),
    c: &upstream::Completion,
    (prompt, bs): (u32, u32),
) {
    let (state, rank, sent) = owed;
    let Some(cached) = c.cached_tokens else { return };
    if computes_new_blocks(c.prompt_tokens.unwrap_or(prompt), cached, bs) {
        state.expect_events(*rank, *sent);
    }
}

/// Names an attempt's worker in the access log when the attempt is left without an answer: a
/// request whose every attempt failed, or whose client left during one, has no answer head to
/// name it.
struct Dispatched<'a> {
    watch: &'a crate::observe::Watch,
    worker: &'a str,
    rank: u16,
}

impl Dispatched<'_> {
    /// The attempt was answered: the answer's headers name its worker, nothing to do here.
    fn answered(self) {
        std::mem::forget(self);
    }
}

impl Drop for Dispatched<'_> {
    fn drop(&mut self) {
        self.watch.dispatched("attempt", self.worker, u32::from(self.rank));
    }
}

/// Whether a prompt of `prompt_tokens` with `cached` of them in the worker's cache (whole
/// blocks) makes the worker store at least one new full block, and so publish a KV event.
pub(crate) fn computes_new_blocks(prompt_tokens: u32, cached: u32, block_size: u32) -> bool {
    let bs = block_size.max(1);
    prompt_tokens / bs > cached / bs
}

/// What the alignment checks compare the response with.
fn prediction(
    worker: &str,
    plan: &Plan,
    facts: &RequestFacts,
    cand: &Candidate,
    mode: MatchMode,
    verifier: &Verifier,
    events_before: Option<u64>,
) -> Prediction {
    let holder = cand.holder;
    let first_block = (!plan.seq.is_empty() && verifier.samples_block(holder.worker))
        .then(|| (plan.seq[0], plan.first_page.clone()));
    Prediction {
        holder,
        worker: worker.to_owned(),
        predicted_hit: cand.matched_tokens.min(plan.max_hit()),
        exact: mode == MatchMode::ExactKvEvents,
        model: Arc::clone(&plan.model),
        cache_salt: facts.cache_salt.clone(),
        first_block,
        events_before,
    }
}

/// The scheduler's mode, or `load_aware` when the chosen candidate (a retry, or a pinned rank)
/// holds nothing.
fn effective_mode(mode: MatchMode, cand: &Candidate) -> MatchMode {
    if mode == MatchMode::ExactKvEvents && cand.matched_tokens == 0 { MatchMode::LoadAware } else { mode }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::auth::WorkerKey;
    use crate::registry::{Registry, WorkerConfig};

    fn worker(key: Option<WorkerKey>) -> Arc<WorkerRecord> {
        let cfg = WorkerConfig {
            name: "w0".into(),
            url: "http://127.0.0.1:9".into(),
            engine: Engine::Vllm,
            model: "m".into(),
            role: cortex_sched::Role::Regular,
            max_running_requests: None,
            events: None,
            unlabeled_stores_unknown: false,
            bootstrap_port: None,
        };
        Registry::new().add_keyed(cfg, key).unwrap()
    }

    fn refusal(status: u16) -> Result<Answer, Failure> {
        Ok(Answer::Reject {
            status: StatusCode::from_u16(status).unwrap(),
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"{\"error\":\"Unauthorized\"}"),
            class: None,
        })
    }

    /// A worker sent its model's key that answers 401 or 403 refuses the key: a failure of that
    /// worker, never the client's refusal; without a key, or for another status, the answer
    /// stands.
    #[test]
    fn a_worker_refusing_its_key_is_a_failure_of_that_worker() {
        let keyed = worker(Some(WorkerKey::new("s3cr3t-key").unwrap()));
        for status in [401, 403] {
            let f = key_refused(refusal(status), &keyed).expect_err("a failure");
            assert_eq!(f.class, cortex_sched::FailureClass::ServerError);
            assert!(f.message.contains("worker_api_key_env") && f.message.contains("w0"), "{}", f.message);
            assert!(!f.message.contains("s3cr3t"), "the key is never shown: {}", f.message);
            // And it is where an operator looks.
            assert_eq!(keyed.status().last_error.as_deref(), Some(f.message.as_str()));
        }
        assert!(matches!(key_refused(refusal(400), &keyed), Ok(Answer::Reject { .. })));
        let plain = worker(None);
        assert!(matches!(key_refused(refusal(401), &plain), Ok(Answer::Reject { .. })));
    }
}
