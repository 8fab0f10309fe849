//! Following each generation request to its end, and reporting it once: the request counters
//! and histograms, the access log line and the request's trace span.
//!
//! ```text
//! route() ─► Watch (a guard) ─► planned(decision) ─► respond(result)
//!              │ dropped before respond: client_gone      ├─ Err: error     ├─ non-2xx: rejected
//!              │                                           └─ 2xx: ObservedBody ─► end: ok / stream_failed
//!              │                                                               └─ dropped early: client_gone
//! ```
//!
//! Key decisions:
//! - One place counts a request, when it ends, whatever ended it: `cortex_requests_total` and
//!   `cortex_fallback_total` cannot miss a worker's refusal or count a request twice (the
//!   `finished` flag is swapped once).
//! - What the client was told is what is reported: the worker, rank, match mode and predicted
//!   hit come from the `x-cortex-*` headers of the answer, so the forwarder and the PD driver
//!   only hand over what headers do not carry (the plan's fallback reason, the relay's realized
//!   hit and whether its stream broke, through a [`Tap`]).
//! - The access line is built only when something will read it (`tracing::enabled!` on the
//!   `cortex::access` target).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cortex_sched::{FallbackReason, MatchMode};
use http::{HeaderMap, Response};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use crate::error::{Body, BodyError, ProxyError};
use crate::request::Route;
use crate::telemetry::{self as t, Outcome};
use crate::trace::{self, AttrValue, SpanRecord, TraceContext, Tracer};
use crate::upstream::{Completion, UpstreamClient};

/// The tracing target of the access log.
pub const ACCESS_TARGET: &str = "cortex::access";

/// How the access log is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AccessLog {
    /// A `key=value` log line on the `cortex::access` target, at INFO (shown when `--log` lets
    /// it through).
    #[default]
    Text,
    /// One JSON object per line on the `cortex::access` target (the binary writes these to
    /// stdout whatever `--log` says).
    Json,
    /// No access log.
    Off,
}

/// What every request's watch reports to. One per gateway.
#[derive(Debug)]
pub struct Observer {
    access: AccessLog,
    tracer: Option<Tracer>,
}

impl Observer {
    /// An observer writing `access` lines and, with `tracing`, exporting spans through `client`.
    #[must_use]
    pub fn new(access: AccessLog, tracing: Option<&trace::TracingConfig>, client: UpstreamClient) -> Self {
        Observer { access, tracer: tracing.and_then(|c| Tracer::start(c, client)) }
    }

    /// Sends the spans queued so far, waiting at most `within` (at shutdown).
    pub async fn flush(&self, within: Duration) {
        if let Some(tr) = &self.tracer {
            tr.flush(within).await;
        }
    }

    /// Starts following a generation request of `route` with id `rid` and the client's
    /// `headers`.
    pub(crate) fn watch(self: &Arc<Self>, route: Route, rid: &str, headers: &HeaderMap) -> Watch {
        let trace = self.tracer.as_ref().and_then(|tr| tr.context(headers));
        Watch {
            shared: Some(Arc::new(Shared {
                observer: Arc::clone(self),
                started: Instant::now(),
                started_unix: trace.map_or(0, |_| trace::now_unix_nanos()),
                route,
                rid: rid.to_owned(),
                trace,
                state: Mutex::new(State::default()),
                finished: AtomicBool::new(false),
            })),
        }
    }
}

/// What is known of a request so far.
#[derive(Debug, Default)]
struct State {
    model: Option<String>,
    plan_mode: Option<MatchMode>,
    reason: Option<FallbackReason>,
    prompt_tokens: Option<u32>,
    mode: Option<MatchMode>,
    worker: Option<String>,
    rank: Option<u32>,
    prefill_worker: Option<String>,
    pd: Option<String>,
    predicted: Option<u32>,
    status: Option<u16>,
    first_byte: Option<Duration>,
    completion: Option<Completion>,
    stream_failed: bool,
    attempts: u32,
}

#[derive(Debug)]
struct Shared {
    observer: Arc<Observer>,
    started: Instant,
    started_unix: u64,
    route: Route,
    rid: String,
    trace: Option<TraceContext>,
    state: Mutex<State>,
    finished: AtomicBool,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reports the request, once.
    fn finish(&self, outcome: Outcome) {
        if self.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        let elapsed = self.started.elapsed();
        let st = self.state();
        let route = self.route.as_str();
        let mode = st.mode.or(st.plan_mode).map_or(t::NO_MODE, MatchMode::as_str);
        metrics::counter!(t::REQUESTS, "route" => route, "mode" => mode, "outcome" => outcome.as_str())
            .increment(1);
        if let Some(r) = st.reason {
            metrics::counter!(t::FALLBACKS, "reason" => r.as_str()).increment(1);
        }
        metrics::histogram!(t::REQUEST_SECONDS, "route" => route, "outcome" => outcome.as_str())
            .record(elapsed.as_secs_f64());
        self.access_line(&st, outcome, mode, elapsed);
        if let (Some(tr), Some(ctx)) = (&self.observer.tracer, self.trace) {
            tr.export(self.request_span(&st, ctx, outcome, mode));
        }
    }

    fn access_line(&self, st: &State, outcome: Outcome, mode: &str, elapsed: Duration) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let realized = st.completion.and_then(|c| c.cached_tokens);
        match self.observer.access {
            AccessLog::Off => {}
            AccessLog::Text => tracing::info!(
                target: ACCESS_TARGET,
                request_id = %self.rid,
                model = st.model.as_deref().unwrap_or("-"),
                route = self.route.as_str(),
                worker = st.worker.as_deref().unwrap_or("-"),
                rank = st.rank,
                prefill_worker = st.prefill_worker.as_deref(),
                pd = st.pd.as_deref(),
                mode,
                predicted_hit_tokens = st.predicted,
                realized_hit_tokens = realized,
                prompt_tokens = st.completion.and_then(|c| c.prompt_tokens).or(st.prompt_tokens),
                status = st.status,
                outcome = outcome.as_str(),
                attempts = st.attempts,
                first_byte_ms = st.first_byte.map(ms),
                duration_ms = ms(elapsed),
                "request"
            ),
            AccessLog::Json => {
                if tracing::enabled!(target: ACCESS_TARGET, tracing::Level::INFO) {
                    let line = serde_json::json!({
                        "request_id": self.rid,
                        "model": st.model,
                        "route": self.route.as_str(),
                        "worker": st.worker,
                        "rank": st.rank,
                        "prefill_worker": st.prefill_worker,
                        "pd": st.pd,
                        "mode": mode,
                        "predicted_hit_tokens": st.predicted,
                        "realized_hit_tokens": realized,
                        "prompt_tokens": st.completion.and_then(|c| c.prompt_tokens).or(st.prompt_tokens),
                        "status": st.status,
                        "outcome": outcome.as_str(),
                        "attempts": st.attempts,
                        "first_byte_ms": st.first_byte.map(ms),
                        "duration_ms": ms(elapsed),
                    });
                    tracing::info!(target: ACCESS_TARGET, "{line}");
                }
            }
        }
    }

    fn request_span(&self, st: &State, ctx: TraceContext, outcome: Outcome, mode: &str) -> SpanRecord {
        let mut attrs = vec![
            ("http.route", AttrValue::Str(self.route.path().to_owned())),
            ("cortex.request_id", AttrValue::Str(self.rid.clone())),
            ("cortex.outcome", AttrValue::Str(outcome.as_str().to_owned())),
            ("cortex.match_mode", AttrValue::Str(mode.to_owned())),
        ];
        let mut s = |k, v: &Option<String>| {
            if let Some(v) = v {
                attrs.push((k, AttrValue::Str(v.clone())));
            }
        };
        s("cortex.model", &st.model);
        s("cortex.worker", &st.worker);
        s("cortex.prefill_worker", &st.prefill_worker);
        s("cortex.pd", &st.pd);
        let mut i = |k, v: Option<u32>| {
            if let Some(v) = v {
                attrs.push((k, AttrValue::Int(i64::from(v))));
            }
        };
        i("cortex.rank", st.rank);
        i("cortex.predicted_hit_tokens", st.predicted);
        i("cortex.realized_hit_tokens", st.completion.and_then(|c| c.cached_tokens));
        i("cortex.prompt_tokens", st.completion.and_then(|c| c.prompt_tokens).or(st.prompt_tokens));
        i("http.response.status_code", st.status.map(u32::from));
        if let Some(r) = st.reason {
            attrs.push(("cortex.fallback_reason", AttrValue::Str(r.as_str().to_owned())));
        }
        SpanRecord {
            trace_id: ctx.trace_id,
            span_id: ctx.span_id,
            parent: ctx.parent,
            name: format!("POST {}", self.route.path()),
            server: true,
            start: self.started_unix,
            end: trace::now_unix_nanos(),
            attrs,
            error: outcome != Outcome::Ok,
        }
    }
}

/// One request being followed. Dropped before [`Watch::respond`]: the client left before any
/// answer (`client_gone`).
#[derive(Debug)]
pub struct Watch {
    shared: Option<Arc<Shared>>,
}

impl Watch {
    fn shared(&self) -> Option<&Arc<Shared>> {
        self.shared.as_ref()
    }

    /// The model the request names (before any decision, which may fail).
    pub(crate) fn asked(&self, model: Option<&str>) {
        if let (Some(s), Some(m)) = (self.shared(), model) {
            s.state().model = Some(m.to_owned());
        }
    }

    /// The planner's decision: the model, the ranking's mode and fallback reason, and the
    /// prompt's length.
    pub(crate) fn planned(
        &self,
        model: &str,
        mode: MatchMode,
        reason: Option<FallbackReason>,
        prompt_tokens: u32,
    ) {
        if let Some(s) = self.shared() {
            let mut st = s.state();
            st.model = Some(model.to_owned());
            st.plan_mode = Some(mode);
            st.reason = reason;
            st.prompt_tokens = Some(prompt_tokens);
        }
    }

    /// What the relay of the answer reports to.
    pub(crate) fn tap(&self) -> Option<Tap> {
        self.shared().map(|s| Tap(Arc::clone(s)))
    }

    /// Names `worker` and its `rank` (the prefill worker for the PD leg `prefill`) in the access
    /// log, for a request that ends before an answer's head names them (every attempt failed, or
    /// the client left during one); a head read later names what was served.
    pub(crate) fn dispatched(&self, leg: &'static str, worker: &str, rank: u32) {
        let Some(s) = self.shared() else { return };
        let mut st = s.state();
        if st.status.is_some() {
            return;
        }
        if leg == "prefill" {
            st.prefill_worker = Some(worker.to_owned());
        } else {
            st.worker = Some(worker.to_owned());
            st.rank = Some(rank);
        }
    }

    /// A client span for one attempt (or PD `leg`) on `worker`'s `rank`; `None` when the request
    /// is not traced.
    pub(crate) fn span(&self, leg: &'static str, worker: &str, rank: u32) -> Option<SpanGuard> {
        let s = self.shared()?;
        s.state().attempts += 1;
        let ctx = s.trace?;
        Some(SpanGuard {
            shared: Arc::clone(s),
            ctx,
            span_id: trace::new_span_id(),
            leg,
            worker: worker.to_owned(),
            rank,
            start: trace::now_unix_nanos(),
            status: None,
        })
    }

    /// Reports the request's answer: a gateway error or a worker's refusal ends it now; a
    /// success is followed to the end of its body.
    pub(crate) fn respond(
        mut self,
        result: Result<Response<Body>, ProxyError>,
    ) -> Result<Response<Body>, ProxyError> {
        let Some(shared) = self.shared.take() else { return result };
        match result {
            Err(e) => {
                shared.state().status = Some(e.status().as_u16());
                shared.finish(Outcome::Error);
                Err(e)
            }
            Ok(resp) => {
                read_headers(&mut shared.state(), resp.status().as_u16(), resp.headers());
                if !resp.status().is_success() {
                    shared.finish(Outcome::Rejected);
                    return Ok(resp);
                }
                let (parts, body) = resp.into_parts();
                let observed = ObservedBody { inner: body, shared: Some(shared), first: true };
                Ok(Response::from_parts(parts, observed.boxed_unsync()))
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(s) = self.shared.take() {
            s.finish(Outcome::ClientGone);
        }
    }
}

/// The `x-cortex-*` headers the client received.
fn read_headers(st: &mut State, status: u16, h: &HeaderMap) {
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok());
    st.status = Some(status);
    if let Some(m) = get("x-cortex-match-mode") {
        st.mode = MatchMode::ALL.into_iter().find(|x| x.as_str() == m);
    }
    st.worker = get("x-cortex-assigned-worker").filter(|w| !w.is_empty()).map(str::to_owned);
    st.rank = get("x-cortex-assigned-rank").and_then(|r| r.parse().ok());
    st.predicted = get("x-cortex-cache-hit-tokens").and_then(|r| r.parse().ok());
    st.prefill_worker = get("x-cortex-prefill-worker").map(str::to_owned);
    st.pd = get("x-cortex-pd").map(str::to_owned);
}

/// Where a relay reports how it ended.
#[derive(Debug, Clone)]
pub struct Tap(Arc<Shared>);

impl Tap {
    /// The relay ended normally with `usage`.
    pub(crate) fn completed(&self, usage: Completion) {
        self.0.state().completion = Some(usage);
    }

    /// The worker's stream broke after the first byte.
    pub(crate) fn failed(&self) {
        self.0.state().stream_failed = true;
    }

    /// The client read nothing of the answer for `client_write_timeout`: the request ends now,
    /// as `client_gone` (its body may never be polled or dropped again).
    pub(crate) fn client_gone(&self) {
        self.0.finish(Outcome::ClientGone);
    }
}

/// A client span, exported when dropped (its end).
#[derive(Debug)]
pub struct SpanGuard {
    shared: Arc<Shared>,
    ctx: TraceContext,
    span_id: [u8; 8],
    leg: &'static str,
    worker: String,
    rank: u32,
    start: u64,
    status: Option<u16>,
}

impl SpanGuard {
    /// The `traceparent` the worker receives: this span is its parent.
    #[must_use]
    pub fn traceparent(&self) -> String {
        self.ctx.traceparent(self.span_id)
    }

    /// The worker answered with `status`.
    pub(crate) fn answered(&mut self, status: u16) {
        self.status = Some(status);
    }
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        let Some(tr) = &self.shared.observer.tracer else { return };
        let mut attrs = vec![
            ("cortex.leg", AttrValue::Str(self.leg.to_owned())),
            ("cortex.worker", AttrValue::Str(std::mem::take(&mut self.worker))),
            ("cortex.rank", AttrValue::Int(i64::from(self.rank))),
        ];
        if let Some(s) = self.status {
            attrs.push(("http.response.status_code", AttrValue::Int(i64::from(s))));
        }
        tr.export(SpanRecord {
            trace_id: self.ctx.trace_id,
            span_id: self.span_id,
            parent: Some(self.ctx.span_id),
            name: format!("{} {}", self.leg, self.shared.route.path()),
            server: false,
            start: self.start,
            end: trace::now_unix_nanos(),
            attrs,
            error: self.status.is_none_or(|s| !(200..300).contains(&s)),
        });
    }
}

/// The answer's body, reporting the request when it ends (or the client leaves).
struct ObservedBody {
    inner: Body,
    shared: Option<Arc<Shared>>,
    first: bool,
}

impl ObservedBody {
    fn end(&mut self, outcome: Outcome) {
        if let Some(s) = self.shared.take() {
            let failed = s.state().stream_failed;
            s.finish(if failed && outcome == Outcome::Ok { Outcome::StreamFailed } else { outcome });
        }
    }
}

impl HttpBody for ObservedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if this.first && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    this.first = false;
                    if let Some(s) = &this.shared {
                        let at = s.started.elapsed();
                        s.state().first_byte = Some(at);
                        metrics::histogram!(t::FIRST_BYTE_SECONDS, "route" => s.route.as_str())
                            .record(at.as_secs_f64());
                    }
                }
                if this.inner.is_end_stream() {
                    this.end(Outcome::Ok);
                }
            }
            Poll::Ready(Some(Err(_))) => this.end(Outcome::StreamFailed),
            Poll::Ready(None) => this.end(Outcome::Ok),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        self.end(Outcome::ClientGone);
    }
}
