//! Talking to workers: the pooled client, classification of what a worker answered, and the body
//! that relays a worker's response to the client as it arrives.
//!
//! Key decisions:
//! - A failure is classified once, here, into the scheduler's [`FailureClass`]; whether to try
//!   another worker follows from the class (the request's own problems are passed through).
//! - [`RelayBody`] forwards frames untouched and unbuffered. It reads nothing per chunk: it keeps
//!   the last bytes of the stream to find the final `usage` (the realized cache hit) once the
//!   stream ends. A worker that fails after the first byte gets its stream ended with a
//!   well-formed SSE error event — never a replay. When the client goes away hyper drops the
//!   body, which drops the upstream response and closes that connection: the engine aborts the
//!   request at once.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use cortex_sched::{Booking, FailureClass, MonotonicClock};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::{BodyError, ErrorFormat, ProxyError};

/// The pooled HTTP client to workers (keep-alive, `TCP_NODELAY`).
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// Builds the client.
#[must_use]
pub fn client(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(connector)
}

/// Headers the gateway adds to a message it copies with [`end_to_end`]: the request id, the trace
/// context, the content type and the rank toward a worker; Cortex's five `x-cortex-*` toward the
/// client.
const ADDED_HEADERS: usize = 6;

/// Headers that describe one hop (RFC 9110 §7.6.1, and the non-standard `proxy-connection`),
/// never forwarded; `host` is the next hop's own.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

/// Copies end-to-end headers, in either direction: drops the hop-by-hop ones, every header the
/// message's `Connection` names (RFC 9110 §7.6.1), and `content-length`, which the new body
/// sets.
#[must_use]
pub fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    // Usually empty (no allocation): most messages name nothing in `Connection`.
    let named: Vec<&str> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|list| list.split(','))
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    // Room for the headers the gateway adds (request id, trace context, content type, rank): the
    // map is allocated once, never grown.
    let mut out = HeaderMap::with_capacity(headers.len() + ADDED_HEADERS);
    for (k, v) in headers {
        if HOP_BY_HOP.contains(&k.as_str())
            || k == http::header::CONTENT_LENGTH
            || named.iter().any(|n| n.eq_ignore_ascii_case(k.as_str()))
        {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    out
}

/// Why a worker did not serve a request.
#[derive(Debug)]
pub struct Failure {
    /// The class, for cooldowns and retry decisions.
    pub class: FailureClass,
    /// What happened, for logs and the client; when the worker answered, its status and the
    /// start of its own error message, so the client loses nothing the worker said.
    pub message: String,
    /// Whether the request may have reached the worker (false: the connection was never
    /// established, so nothing was sent and nothing can have run).
    pub sent: bool,
    /// The worker's `Retry-After` in seconds, when it answered with one.
    pub retry_after: Option<u32>,
}

/// What a worker answered.
#[derive(Debug)]
pub enum Answer {
    /// A success: stream it.
    Stream(Response<Incoming>),
    /// An error that is the request's own (4xx, context length, content policy): passed to the
    /// client as the worker wrote it; another worker would answer the same.
    Reject {
        /// Status.
        status: StatusCode,
        /// Headers.
        headers: HeaderMap,
        /// Body.
        body: Bytes,
        /// The class, when the error is one the scheduler tracks.
        class: Option<FailureClass>,
    },
}

impl Answer {
    /// The worker's status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Answer::Stream(r) => r.status(),
            Answer::Reject { status, .. } => *status,
        }
    }
}

/// Sends one attempt and waits for the response head (and, for an error, its small body).
///
/// # Errors
/// [`Failure`] for anything another worker might do better: connection failures, timeouts,
/// 5xx, 429.
pub async fn send(
    client: &UpstreamClient,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    head_timeout: Duration,
) -> Result<Answer, Failure> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let sent = std::time::Instant::now();
    let resp = tokio::time::timeout(head_timeout, client.request(req)).await;
    metrics::histogram!(crate::telemetry::UPSTREAM_HEAD_SECONDS).record(sent.elapsed().as_secs_f64());
    let resp = match resp {
        Err(_) => {
            return Err(Failure {
                class: FailureClass::Timeout,
                message: format!("no response head within {head_timeout:?}"),
                sent: true,
                retry_after: None,
            });
        }
        Ok(Err(e)) => {
            return Err(Failure {
                class: FailureClass::ServerError,
                message: format!("worker unreachable: {e}"),
                sent: !e.is_connect(),
                retry_after: None,
            });
        }
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    if status.is_success() {
        return Ok(Answer::Stream(resp));
    }
    let (parts, incoming) = resp.into_parts();
    // Error bodies are small; read at most 64 KiB of one, briefly.
    let body = match tokio::time::timeout(
        Duration::from_secs(5),
        http_body_util::Limited::new(incoming, 64 * 1024).collect(),
    )
    .await
    {
        Ok(Ok(c)) => c.to_bytes(),
        _ => Bytes::new(),
    };
    let headers = end_to_end(&parts.headers);
    match classify(status, &body) {
        Some(class) if crate::error::retry_elsewhere(class) => Err(Failure {
            class,
            message: worker_said(status, &body),
            sent: true,
            retry_after: retry_after_seconds(class, &parts.headers),
        }),
        class => Ok(Answer::Reject { status, headers, body, class }),
    }
}

/// The longest `Retry-After` passed on from a worker: a day (a quota that resets daily).
pub const MAX_RETRY_AFTER_SECS: u32 = 86_400;

/// A worker's `Retry-After` of whole seconds, at most [`MAX_RETRY_AFTER_SECS`], for a refusal
/// that says "not now" (a rate limit or an exhausted quota, 429); `None` for any other failure,
/// whose client gets Cortex's own `1` (an HTTP date is not kept either).
fn retry_after_seconds(class: FailureClass, headers: &HeaderMap) -> Option<u32> {
    if !matches!(class, FailureClass::RateLimited | FailureClass::QuotaExhausted) {
        return None;
    }
    let v = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Any number of digits: a wait beyond the cap is the cap.
    Some(v.parse::<u64>().map_or(MAX_RETRY_AFTER_SECS, |s| s.min(u64::from(MAX_RETRY_AFTER_SECS)) as u32))
}

/// `worker answered <status>`, then the start of the worker's own error text (its JSON
/// `message` when it has one), on one line.
fn worker_said(status: StatusCode, body: &[u8]) -> String {
    const MAX: usize = 300;
    let text = crate::error::worker_message(body).unwrap_or_default();
    let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        return format!("worker answered {status}");
    }
    let cut = text.char_indices().nth(MAX).map_or(text.len(), |(i, _)| i);
    let ellipsis = if cut < text.len() { "…" } else { "" };
    format!("worker answered {status}: {}{ellipsis}", &text[..cut])
}

/// Classifies a worker's error response. `None`: an ordinary client error (bad request) that is
/// the request's own and does not concern the scheduler.
#[must_use]
pub fn classify(status: StatusCode, body: &[u8]) -> Option<FailureClass> {
    let text = String::from_utf8_lossy(&body[..body.len().min(4096)]).to_ascii_lowercase();
    let mentions = |words: &[&str]| words.iter().any(|w| text.contains(w));
    match status.as_u16() {
        429 if mentions(&["quota", "billing", "insufficient_quota"]) => Some(FailureClass::QuotaExhausted),
        429 => Some(FailureClass::RateLimited),
        402 => Some(FailureClass::QuotaExhausted),
        408 | 504 => Some(FailureClass::Timeout),
        500..=599 => Some(FailureClass::ServerError),
        400 | 413 | 422
            if mentions(&[
                // vLLM ≤ 0.10 and both engines' OpenAI routes: "maximum context length";
                // SGLang: "longer than the model's context length"; newer vLLM: "longer than
                // the maximum model length".
                "context length",
                "context_length",
                "maximum context",
                "maximum model length",
                "too long",
                "max_model_len",
            ]) =>
        {
            Some(FailureClass::ContextLengthExceeded)
        }
        400 | 403 | 451 if mentions(&["content policy", "content_policy", "safety", "moderation"]) => {
            Some(FailureClass::ContentPolicy)
        }
        _ => None,
    }
}

/// What a finished relay learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// `usage.prompt_tokens_details.cached_tokens` (or SGLang's `meta_info.cached_tokens`) from
    /// the final chunk or body, if the worker reported it.
    pub cached_tokens: Option<u32>,
    /// `usage.prompt_tokens`, if reported.
    pub prompt_tokens: Option<u32>,
}

/// Called once when a relay ends normally.
pub type OnComplete = Box<dyn FnOnce(Completion) + Send>;

/// Bytes kept from the end of a stream to find its final usage.
const SSE_TAIL: usize = 16 * 1024;
/// Most bytes of one event a stream's relay holds back waiting for its end (see
/// [`RelayBody::releasable`]); engines send events of a few KiB.
const SSE_HOLD_MAX: usize = 1 << 20;

/// Where the last complete event of `data` ends: just past its last blank line (`\n\n`,
/// `\n\r\n` or `\r\r`), `None` without one.
fn last_event_end(data: &[u8]) -> Option<usize> {
    let mut i = data.len();
    while i >= 2 {
        match (data[i - 2], data[i - 1]) {
            (b'\n', b'\n') | (b'\r', b'\r') => return Some(i),
            (b'\r', b'\n') if i >= 3 && data[i - 3] == b'\n' => return Some(i),
            _ => i -= 1,
        }
    }
    None
}

/// Largest non-streamed body parsed for usage.
const JSON_MAX: usize = 1 << 20;

enum RelayState {
    Streaming,
    Done,
}

/// The response body relayed to the client. See the module docs.
pub struct RelayBody {
    /// Bytes read from the worker before the relay started (a disaggregated answer's held
    /// preamble and first output), sent first.
    prefix: Option<Bytes>,
    /// The rest of the worker's body (`None`: the prefix was all of it).
    inner: Option<Incoming>,
    booking: Option<Booking>,
    clock: MonotonicClock,
    sse: bool,
    first_frame: bool,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
    tail: BytesMut,
    tail_overflowed: bool,
    state: RelayState,
    on_complete: Option<OnComplete>,
    /// The admission slot: a request counts against the gateway's concurrency until its body
    /// has been relayed to the end (or the client left).
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Whatever must live exactly as long as the relay (a disaggregated request's prefill leg,
    /// aborted when the client's answer ends or the client leaves).
    _guard: Option<Box<dyn std::any::Any + Send>>,
    /// Whether a streaming answer's first chunk teaches the holder's prefill speed (not for a
    /// disaggregated pair's decode leg, whose first chunk is the prefill worker's work).
    learn: bool,
    /// The format of a mid-stream error event (the route's).
    format: ErrorFormat,
    /// Where the request's observer learns how the relay ended.
    tap: Option<crate::observe::Tap>,
    /// A stream's bytes after its last complete event, held until the event completes: a stream
    /// that breaks mid-event then ends with whole events and Cortex's error event, never with
    /// the error glued onto half a line.
    partial: BytesMut,
    /// Whether what reached the client ends at an event boundary (a held event that outgrew
    /// [`SSE_HOLD_MAX`] was sent incomplete).
    at_boundary: bool,
    /// Attempts this request made, the one relayed included (for the error event's message).
    attempts: u32,
    /// A trailers frame that came while bytes were held: sent after them.
    trailers: Option<Frame<Bytes>>,
}

impl RelayBody {
    /// Relays `inner`, moving `booking` through first token and completion.
    #[must_use]
    pub fn new(
        inner: Incoming,
        booking: Booking,
        clock: MonotonicClock,
        sse: bool,
        idle_timeout: Duration,
        on_complete: OnComplete,
    ) -> Self {
        RelayBody {
            prefix: None,
            inner: Some(inner),
            booking: Some(booking),
            clock,
            sse,
            first_frame: true,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_timeout,
            tail: BytesMut::new(),
            tail_overflowed: false,
            state: RelayState::Streaming,
            on_complete: Some(on_complete),
            _permit: None,
            _guard: None,
            learn: true,
            format: ErrorFormat::OpenAi,
            tap: None,
            partial: BytesMut::new(),
            at_boundary: true,
            attempts: 1,
            trailers: None,
        }
    }

    /// The first chunk reached the client: a streaming answer's first chunk is the first token
    /// (a sample of the holder's prefill speed, when `learn`); a non-streaming answer's first
    /// byte comes after generation.
    fn first(learn: bool, sse: bool, b: &mut Booking, clock: MonotonicClock) {
        if learn && sse {
            crate::telemetry::estimate_error(b.first_output(clock.now()));
        } else {
            b.first_token(clock.now());
        }
    }

    /// Relays `prefix` (bytes already read from the worker), then `rest` if the body goes on.
    #[must_use]
    pub fn resumed(
        prefix: Bytes,
        rest: Option<Incoming>,
        booking: Booking,
        clock: MonotonicClock,
        sse: bool,
        idle_timeout: Duration,
        on_complete: OnComplete,
    ) -> Self {
        RelayBody {
            prefix: Some(prefix),
            inner: rest,
            booking: Some(booking),
            clock,
            sse,
            first_frame: true,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_timeout,
            tail: BytesMut::new(),
            tail_overflowed: false,
            state: RelayState::Streaming,
            on_complete: Some(on_complete),
            _permit: None,
            _guard: None,
            learn: true,
            format: ErrorFormat::OpenAi,
            tap: None,
            partial: BytesMut::new(),
            at_boundary: true,
            attempts: 1,
            trailers: None,
        }
    }

    /// Ends a broken stream with an error event in `format` (the route's; OpenAI's by default).
    #[must_use]
    pub fn in_format(mut self, format: ErrorFormat) -> Self {
        self.format = format;
        self
    }

    /// The request's attempts, this one included (1 by default).
    #[must_use]
    pub fn after_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The client read nothing of the answer for too long (the relay is about to be dropped):
    /// the request ends as `client_gone`, never blamed on the worker.
    pub(crate) fn client_stalled(&mut self) {
        if let Some(tap) = self.tap.take() {
            tap.client_gone();
        }
    }

    /// Does not learn the holder's prefill speed from the first chunk.
    #[must_use]
    pub fn not_learning(mut self) -> Self {
        self.learn = false;
        self
    }

    /// Keeps `guard` alive until the relay is dropped.
    #[must_use]
    pub fn guarding(mut self, guard: Box<dyn std::any::Any + Send>) -> Self {
        self._guard = Some(guard);
        self
    }

    /// Reports how the relay ended to `tap` (the request's observer).
    #[must_use]
    pub fn tapped(mut self, tap: Option<crate::observe::Tap>) -> Self {
        self.tap = tap;
        self
    }

    /// Keeps `permit` until the relay ends.
    #[must_use]
    pub fn holding(mut self, permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        self._permit = Some(permit);
        self
    }

    fn keep_tail(&mut self, data: &Bytes) {
        let limit = if self.sse { SSE_TAIL } else { JSON_MAX };
        if !self.sse && self.tail.len() + data.len() > limit {
            self.tail_overflowed = true;
            self.tail.clear();
            return;
        }
        if self.tail_overflowed {
            return;
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > limit {
            let cut = self.tail.len() - limit;
            let _ = self.tail.split_to(cut);
        }
    }

    fn fail(
        &mut self,
        class: FailureClass,
        message: String,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        tracing::warn!(class = class.as_str(), %message, "upstream failed mid-stream");
        metrics::counter!(crate::telemetry::UPSTREAM_ERRORS, "class" => class.as_str(), "stage" => "stream")
            .increment(1);
        if let Some(b) = self.booking.take() {
            b.fail(class, self.clock.now());
        }
        self.on_complete = None;
        if let Some(tap) = self.tap.take() {
            tap.failed();
        }
        if self.sse {
            let err = ProxyError::Upstream { class, attempts: self.attempts, message, retry_after: None };
            self.state = RelayState::Done;
            // The held partial event is dropped; an event sent incomplete is ended first.
            self.partial.clear();
            let event = err.sse_event(self.format);
            if self.at_boundary {
                return Poll::Ready(Some(Ok(Frame::data(event))));
            }
            let mut out = BytesMut::with_capacity(event.len() + 2);
            out.extend_from_slice(b"\n\n");
            out.extend_from_slice(&event);
            Poll::Ready(Some(Ok(Frame::data(out.freeze()))))
        } else {
            // A JSON body cannot be ended well-formed: fail the body, so hyper aborts the
            // connection and the client sees a broken response, never a silently short one.
            self.state = RelayState::Done;
            Poll::Ready(Some(Err(message.into())))
        }
    }

    /// What of `data` (after the held bytes) can go to the client now: a stream's complete
    /// events, the rest held; a JSON body's bytes as they are. `end`: nothing follows, so the
    /// held bytes go too.
    fn releasable(&mut self, data: Bytes, end: bool) -> Bytes {
        if !self.sse {
            return data;
        }
        if end {
            // Nothing follows: the held bytes and these go as they are.
            if self.partial.is_empty() {
                return data;
            }
            self.partial.extend_from_slice(&data);
            return self.partial.split().freeze();
        }
        let out = if self.partial.is_empty() {
            match last_event_end(&data) {
                Some(cut) if cut == data.len() => data,
                Some(cut) => {
                    self.partial.extend_from_slice(&data[cut..]);
                    data.slice(..cut)
                }
                None => {
                    self.partial.extend_from_slice(&data);
                    Bytes::new()
                }
            }
        } else {
            // The held bytes end no event: only the new ones (and the two before them, for a
            // blank line split across frames) are scanned.
            let from = self.partial.len().saturating_sub(2);
            self.partial.extend_from_slice(&data);
            match last_event_end(&self.partial[from..]) {
                Some(cut) => self.partial.split_to(from + cut).freeze(),
                None => Bytes::new(),
            }
        };
        if self.partial.len() > SSE_HOLD_MAX {
            // Not a stream of events after all (or one larger than any engine sends): relay it.
            let mut all = BytesMut::from(&out[..]);
            all.extend_from_slice(&self.partial.split());
            self.at_boundary = false;
            return all.freeze();
        }
        if !out.is_empty() {
            // Cut at an event's end, by construction.
            self.at_boundary = true;
        }
        out
    }

    fn finish(&mut self) {
        if let Some(b) = self.booking.take() {
            b.succeed(self.clock.now());
        }
        if self.on_complete.is_some() || self.tap.is_some() {
            let usage = if self.tail_overflowed { None } else { find_usage(&self.tail, self.sse) };
            let usage = usage.unwrap_or(Completion { cached_tokens: None, prompt_tokens: None });
            if let Some(tap) = self.tap.take() {
                tap.completed(usage);
            }
            if let Some(f) = self.on_complete.take() {
                f(usage);
            }
        }
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if matches!(this.state, RelayState::Done) {
            return Poll::Ready(None);
        }
        if let Some(prefix) = this.prefix.take()
            && !prefix.is_empty()
        {
            this.first_frame = false;
            if let Some(b) = this.booking.as_mut() {
                Self::first(this.learn, this.sse, b, this.clock);
            }
            this.keep_tail(&prefix);
            let end = this.inner.as_ref().is_none_or(HttpBody::is_end_stream);
            if end {
                this.state = RelayState::Done;
                this.finish();
            }
            let out = this.releasable(prefix, end);
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
        if let Some(trailers) = this.trailers.take() {
            return Poll::Ready(Some(Ok(trailers)));
        }
        loop {
            let Some(polled) = this.inner.as_mut().map(|inner| Pin::new(inner).poll_frame(cx)) else {
                this.state = RelayState::Done;
                this.finish();
                return Poll::Ready(None);
            };
            return match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    let deadline = tokio::time::Instant::now() + this.idle_timeout;
                    this.idle.as_mut().reset(deadline);
                    // A body of known length is complete with its last byte: hyper will not poll
                    // again, so the relay ends here.
                    let end = this.inner.as_ref().is_some_and(HttpBody::is_end_stream);
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            if this.first_frame && !data.is_empty() {
                                this.first_frame = false;
                                if let Some(b) = this.booking.as_mut() {
                                    Self::first(this.learn, this.sse, b, this.clock);
                                }
                            }
                            this.keep_tail(&data);
                            let out = this.releasable(data, end);
                            if out.is_empty() && !end {
                                // Only part of an event so far: wait for the rest.
                                continue;
                            }
                            Frame::data(out)
                        }
                        Err(frame) if this.partial.is_empty() => frame,
                        Err(frame) => {
                            // Trailers after held bytes: the bytes first.
                            this.trailers = Some(frame);
                            Frame::data(this.partial.split().freeze())
                        }
                    };
                    if end {
                        this.state = RelayState::Done;
                        this.finish();
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(Some(Err(e))) => {
                    this.fail(FailureClass::ServerError, format!("worker stream broke: {e}"))
                }
                Poll::Ready(None) => {
                    this.state = RelayState::Done;
                    this.finish();
                    if this.partial.is_empty() {
                        Poll::Ready(None)
                    } else {
                        // The worker ended without a last blank line: its bytes, as sent.
                        Poll::Ready(Some(Ok(Frame::data(this.partial.split().freeze()))))
                    }
                }
                Poll::Pending => match this.idle.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        let t = this.idle_timeout;
                        this.fail(FailureClass::Timeout, format!("worker sent nothing for {t:?}"))
                    }
                    Poll::Pending => Poll::Pending,
                },
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, RelayState::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            RelayState::Streaming if !self.sse && self.prefix.is_none() => {
                self.inner.as_ref().map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
            }
            _ => SizeHint::default(),
        }
    }
}

/// Finds the usage in a stream's last bytes (the last `data:` event that is JSON and mentions
/// a usage) or in a JSON body.
///
/// The document is scanned for the four numbers alone ([`usage_scan`]): nothing else of a
/// response is built or allocated, where a `serde_json::Value` of the whole body cost a
/// visible share of the gateway's CPU per request.
#[must_use]
pub fn find_usage(tail: &[u8], sse: bool) -> Option<Completion> {
    let doc: usage_scan::Doc = if sse {
        let text = std::str::from_utf8(tail).ok().or_else(|| {
            // The tail may start inside a UTF-8 sequence; skip to the next event.
            let start = tail.windows(2).position(|w| w == b"\n\n")? + 2;
            std::str::from_utf8(&tail[start..]).ok()
        })?;
        text.rsplit("\n\n")
            .filter_map(|ev| ev.trim().strip_prefix("data:").map(str::trim))
            .filter(|d| d.contains("\"usage\"") || d.contains("\"cached_tokens\""))
            .find_map(|d| serde_json::from_str(d).ok())?
    } else {
        serde_json::from_slice(tail).ok()?
    };
    let (usage, meta) = (&doc.usage, &doc.meta_info);
    let cached = usage.cached_tokens.or(meta.cached_tokens);
    let prompt = usage.prompt_tokens.or(meta.prompt_tokens);
    if cached.is_none() && prompt.is_none() {
        return None;
    }
    Some(Completion { cached_tokens: cached, prompt_tokens: prompt })
}

/// A lenient reader of a response's usage numbers.
///
/// Key decision: it reads what `serde_json::Value` lookups read, and nothing stricter. A
/// number is kept only when it is an unsigned integer within `u32`; a field of another type, an
/// object where a number was expected or the reverse reads as absent, never as an error; the
/// last of duplicate keys wins; a top-level array (a `/generate` batch) is read through its
/// first item. The JSON must still be valid as a whole (serde_json checks what it skips).
mod usage_scan {
    use std::borrow::Cow;
    use std::fmt;

    use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    /// The fields of a response the usage comes from.
    #[derive(Default)]
    pub(super) struct Doc {
        /// `usage`: `prompt_tokens` and `prompt_tokens_details.cached_tokens`.
        pub usage: Counts,
        /// SGLang's `meta_info`: `prompt_tokens` and `cached_tokens`.
        pub meta_info: Counts,
    }

    /// The two numbers of one object.
    #[derive(Default)]
    pub(super) struct Counts {
        pub prompt_tokens: Option<u32>,
        pub cached_tokens: Option<u32>,
    }

    /// Which object a [`Counts`] reads (they name the cached tokens differently).
    #[derive(Clone, Copy)]
    enum Kind {
        Usage,
        Meta,
        Details,
    }

    /// A key, borrowed from the input unless it has escapes.
    struct Key<'a>(Cow<'a, str>);

    impl<'de> Deserialize<'de> for Key<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Key<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a key")
                }
                fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                    Ok(Key(Cow::Borrowed(s)))
                }
                fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                    Ok(Key(Cow::Owned(s.to_owned())))
                }
            }
            d.deserialize_str(V)
        }
    }

    /// A lenient visitor's scalar visits (with `integers`, integers too): each reads as `$default`.
    macro_rules! lenient_visitor {
        ($visitor:ident, $value:ty, $default:expr, integers) => {
            lenient_visitor!($visitor, $value, $default);
            fn visit_u64<E>(self, _: u64) -> Result<$value, E> {
                Ok($default)
            }
            fn visit_i64<E>(self, _: i64) -> Result<$value, E> {
                Ok($default)
            }
        };
        ($visitor:ident, $value:ty, $default:expr) => {
            fn visit_bool<E>(self, _: bool) -> Result<$value, E> {
                Ok($default)
            }
            fn visit_f64<E>(self, _: f64) -> Result<$value, E> {
                Ok($default)
            }
            fn visit_str<E>(self, _: &str) -> Result<$value, E> {
                Ok($default)
            }
            fn visit_unit<E>(self) -> Result<$value, E> {
                Ok($default)
            }
            fn visit_none<E>(self) -> Result<$value, E> {
                Ok($default)
            }
        };
    }

    /// A number read as `Value::as_u64` then `u32::try_from` read it.
    struct Num(Option<u32>);

    impl<'de> Deserialize<'de> for Num {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Num;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any value")
                }
                lenient_visitor!(V, Num, Num(None));
                fn visit_u64<E>(self, n: u64) -> Result<Num, E> {
                    Ok(Num(u32::try_from(n).ok()))
                }
                fn visit_i64<E>(self, n: i64) -> Result<Num, E> {
                    Ok(Num(u32::try_from(n).ok()))
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Num, A::Error> {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(Num(None))
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Num, A::Error> {
                    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    Ok(Num(None))
                }
            }
            d.deserialize_any(V)
        }
    }

    /// An object of `kind`, read leniently.
    struct CountsOf(Kind);

    impl<'de> serde::de::DeserializeSeed<'de> for CountsOf {
        type Value = Counts;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Counts, D::Error> {
            struct V(Kind);
            impl<'de> Visitor<'de> for V {
                type Value = Counts;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any value")
                }
                lenient_visitor!(V, Counts, Counts::default(), integers);
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counts, A::Error> {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(Counts::default())
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counts, A::Error> {
                    let mut c = Counts::default();
                    while let Some(Key(k)) = map.next_key::<Key<'de>>()? {
                        match (self.0, &*k) {
                            (Kind::Usage | Kind::Meta, "prompt_tokens") => {
                                c.prompt_tokens = map.next_value::<Num>()?.0;
                            }
                            (Kind::Meta | Kind::Details, "cached_tokens") => {
                                c.cached_tokens = map.next_value::<Num>()?.0;
                            }
                            (Kind::Usage, "prompt_tokens_details") => {
                                c.cached_tokens = map.next_value_seed(CountsOf(Kind::Details))?.cached_tokens;
                            }
                            _ => {
                                map.next_value::<IgnoredAny>()?;
                            }
                        }
                    }
                    Ok(c)
                }
            }
            d.deserialize_any(V(self.0))
        }
    }

    /// The top-level object, or a batch's first item.
    struct Top {
        nested: bool,
    }

    impl<'de> serde::de::DeserializeSeed<'de> for Top {
        type Value = Doc;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Doc, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Top {
        type Value = Doc;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any value")
        }
        lenient_visitor!(Top, Doc, Doc::default(), integers);
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Doc, A::Error> {
            // Only the outermost array is a batch: an item that is itself an array
            // has no usage (as `Value::get` on an array finds none).
            let first = if self.nested { None } else { seq.next_element_seed(Top { nested: true })? };
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(first.unwrap_or_default())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Doc, A::Error> {
            let mut doc = Doc::default();
            while let Some(Key(k)) = map.next_key::<Key<'de>>()? {
                match &*k {
                    "usage" => doc.usage = map.next_value_seed(CountsOf(Kind::Usage))?,
                    "meta_info" => doc.meta_info = map.next_value_seed(CountsOf(Kind::Meta))?,
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(doc)
        }
    }

    impl<'de> Deserialize<'de> for Doc {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            serde::de::DeserializeSeed::deserialize(Top { nested: false }, d)
        }
    }
}

/// Builds the URI of `path` on a worker whose base is `base` (`http://host:port`).
///
/// # Errors
/// [`ProxyError::Internal`] if the result is not a valid URI.
pub fn worker_uri(base: &Uri, path_and_query: &str) -> Result<Uri, ProxyError> {
    let path = path_and_query.parse().map_err(|e| ProxyError::Internal(format!("bad upstream path: {e}")))?;
    with_path(base, path)
}

/// `base` with the path `path` (a route's, known at compile time: nothing is parsed or copied).
///
/// # Errors
/// [`ProxyError::Internal`] when `base` and the path do not make a URI.
pub fn worker_uri_static(base: &Uri, path: &'static str) -> Result<Uri, ProxyError> {
    with_path(base, http::uri::PathAndQuery::from_static(path))
}

fn with_path(base: &Uri, path: http::uri::PathAndQuery) -> Result<Uri, ProxyError> {
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(path);
    Uri::from_parts(parts).map_err(|e| ProxyError::Internal(format!("bad upstream uri: {e}")))
}

/// Adds a header, ignoring values that are not valid header bytes.
pub fn set_header(h: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        h.insert(HeaderName::from_static(name), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_s_retry_after_is_kept_only_for_not_now_and_capped() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(http::header::RETRY_AFTER, v.parse().unwrap());
            m
        };
        assert_eq!(retry_after_seconds(FailureClass::RateLimited, &h("30")), Some(30));
        assert_eq!(retry_after_seconds(FailureClass::QuotaExhausted, &h(" 7 ")), Some(7));
        assert_eq!(
            retry_after_seconds(FailureClass::RateLimited, &h("999999999")),
            Some(MAX_RETRY_AFTER_SECS)
        );
        assert_eq!(
            retry_after_seconds(FailureClass::ServerError, &h("600")),
            None,
            "a 503's wait is not passed on"
        );
        assert_eq!(retry_after_seconds(FailureClass::Timeout, &h("600")), None);
        assert_eq!(
            retry_after_seconds(FailureClass::RateLimited, &h("99999999999999999999999")),
            Some(MAX_RETRY_AFTER_SECS)
        );
        for bad in ["Wed, 21 Oct 2015 07:28:00 GMT", "-1", "1.5", ""] {
            assert_eq!(retry_after_seconds(FailureClass::RateLimited, &h(bad)), None, "{bad:?}");
        }
        assert_eq!(retry_after_seconds(FailureClass::RateLimited, &HeaderMap::new()), None);
    }

    #[test]
    fn a_failed_attempt_keeps_what_the_worker_said() {
        let s = |code: u16, b: &str| worker_said(StatusCode::from_u16(code).unwrap(), b.as_bytes());
        assert_eq!(
            s(503, r#"{"error":{"message":"KV cache\n full","type":"server_error"}}"#),
            "worker answered 503 Service Unavailable: KV cache full"
        );
        assert_eq!(s(500, r#"{"detail":"boom"}"#), "worker answered 500 Internal Server Error: boom");
        assert_eq!(s(502, "upstream died"), "worker answered 502 Bad Gateway: upstream died");
        assert_eq!(s(500, ""), "worker answered 500 Internal Server Error");
        let long = s(500, &"é".repeat(400));
        assert!(long.ends_with('…') && long.chars().filter(|&c| c == 'é').count() == 300, "{long}");
    }

    #[test]
    fn an_event_ends_at_its_blank_line_whatever_the_line_ends() {
        assert_eq!(last_event_end(b"data: a\n\n"), Some(9));
        assert_eq!(last_event_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(last_event_end(b"data: a\r\n\r\ndata: b\r\n"), Some(11));
        assert_eq!(last_event_end(b"data: a\r\rdata"), Some(9));
        assert_eq!(last_event_end(b"data: a\ndata: b\n"), None);
        assert_eq!(last_event_end(b""), None);
        assert_eq!(last_event_end(b"\n\n"), Some(2));
    }

    #[test]
    fn classification() {
        let c = |s: u16, b: &str| classify(StatusCode::from_u16(s).unwrap(), b.as_bytes());
        assert_eq!(c(429, "slow down"), Some(FailureClass::RateLimited));
        assert_eq!(c(429, "insufficient_quota"), Some(FailureClass::QuotaExhausted));
        assert_eq!(c(503, ""), Some(FailureClass::ServerError));
        assert_eq!(c(504, ""), Some(FailureClass::Timeout));
        assert_eq!(
            c(400, r#"{"error":{"message":"This model's maximum context length is 4096 tokens"}}"#),
            Some(FailureClass::ContextLengthExceeded)
        );
        // SGLang's OpenAI routes and its native one, and vLLM ≥ 0.11.
        let sglang = r#"{"object":"error","message":"The input (5000 tokens) is longer than the model's context length (4096 tokens).","type":"BadRequestError","param":null,"code":400}"#;
        assert_eq!(c(400, sglang), Some(FailureClass::ContextLengthExceeded));
        let sglang_total = r#"{"error":{"message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5000 tokens"}}"#;
        assert_eq!(c(400, sglang_total), Some(FailureClass::ContextLengthExceeded));
        let vllm = r#"{"error":{"message":"The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens.","type":"BadRequestError","param":null,"code":400}}"#;
        assert_eq!(c(400, vllm), Some(FailureClass::ContextLengthExceeded));
        assert_eq!(c(400, "missing field"), None);
        assert_eq!(c(404, "no such model"), None);
    }

    #[test]
    fn usage_from_stream_tail_and_body() {
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            find_usage(sse, true),
            Some(Completion { cached_tokens: Some(32), prompt_tokens: Some(40) })
        );
        let body = br#"{"text":"x","meta_info":{"prompt_tokens":20,"cached_tokens":16}}"#;
        assert_eq!(
            find_usage(body, false),
            Some(Completion { cached_tokens: Some(16), prompt_tokens: Some(20) })
        );
        assert_eq!(find_usage(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n", true), None);
    }

    /// The reading `find_usage` had before its scan: a `serde_json::Value` of the document.
    fn usage_by_value(tail: &[u8], sse: bool) -> Option<Completion> {
        let value: serde_json::Value = if sse {
            let text = std::str::from_utf8(tail).ok().or_else(|| {
                let start = tail.windows(2).position(|w| w == b"\n\n")? + 2;
                std::str::from_utf8(&tail[start..]).ok()
            })?;
            text.rsplit("\n\n")
                .filter_map(|ev| ev.trim().strip_prefix("data:").map(str::trim))
                .filter(|d| d.contains("\"usage\"") || d.contains("\"cached_tokens\""))
                .find_map(|d| serde_json::from_str(d).ok())?
        } else {
            serde_json::from_slice(tail).ok()?
        };
        let value = match value {
            serde_json::Value::Array(mut items) if !items.is_empty() => items.swap_remove(0),
            v => v,
        };
        let as_u32 = |v: Option<&serde_json::Value>| {
            v.and_then(serde_json::Value::as_u64).and_then(|n| u32::try_from(n).ok())
        };
        let usage = value.get("usage");
        let meta = value.get("meta_info");
        let cached =
            as_u32(usage.and_then(|u| u.get("prompt_tokens_details")).and_then(|d| d.get("cached_tokens")))
                .or_else(|| as_u32(meta.and_then(|m| m.get("cached_tokens"))));
        let prompt = as_u32(usage.and_then(|u| u.get("prompt_tokens")))
            .or_else(|| as_u32(meta.and_then(|m| m.get("prompt_tokens"))));
        if cached.is_none() && prompt.is_none() {
            return None;
        }
        Some(Completion { cached_tokens: cached, prompt_tokens: prompt })
    }

    /// Random JSON text that leans on the usage fields: each of their names, every type where a
    /// number or an object is expected, numbers around the `u32` limit, duplicates, batches.
    fn random_json(rng: &mut fastrand::Rng, depth: u32, out: &mut String) {
        const KEYS: [&str; 8] = [
            "usage",
            "meta_info",
            "prompt_tokens",
            "cached_tokens",
            "prompt_tokens_details",
            "choices",
            "text",
            "us\\u0061ge",
        ];
        const NUMBERS: [&str; 10] =
            ["0", "-0", "7", "-3", "4294967295", "4294967296", "18446744073709551615", "1e3", "2.0", "-1.5"];
        // Objects near the top (where the fields live), numbers below.
        let pick = match depth {
            0 => [5, 6, 6, 6, 6, 6, 6][rng.usize(..7)],
            1 => [0, 1, 2, 3, 4, 5, 6, 6, 6][rng.usize(..9)],
            2 | 3 => [0, 0, 1, 1, 2, 3, 4, 5, 6][rng.usize(..9)],
            _ => rng.u8(0..5),
        };
        match pick {
            0 | 1 => out.push_str(NUMBERS[rng.usize(..NUMBERS.len())]),
            2 => out.push_str(["null", "true", "false"][rng.usize(..3)]),
            3 => out.push_str(["\"x\"", "\"usage\"", "\"\\u00e9\"", "\"\""][rng.usize(..4)]),
            4 => out.push_str(["{}", "[]"][rng.usize(..2)]),
            5 => {
                out.push('[');
                for i in 0..rng.usize(0..4) {
                    if i > 0 {
                        out.push(',');
                    }
                    random_json(rng, depth + 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..rng.usize(0..6) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push('"');
                    out.push_str(KEYS[rng.usize(..KEYS.len())]);
                    out.push_str("\":");
                    random_json(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }

    #[test]
    fn the_usage_scan_reads_what_a_json_value_reads() {
        let mut rng = fastrand::Rng::with_seed(20_261_203);
        let mut found = 0;
        for _ in 0..50_000 {
            let mut doc = String::new();
            random_json(&mut rng, 0, &mut doc);
            if rng.u8(..8) == 0 {
                // Invalid JSON too: a cut document.
                doc.truncate(rng.usize(..=doc.len()));
            }
            let body = doc.as_bytes();
            let want = usage_by_value(body, false);
            assert_eq!(find_usage(body, false), want, "{doc}");
            found += usize::from(want.is_some());
            let sse = format!("data: {{\"choices\":[]}}\n\ndata: {doc}\n\ndata: [DONE]\n\n");
            assert_eq!(find_usage(sse.as_bytes(), true), usage_by_value(sse.as_bytes(), true), "{sse}");
        }
        // The generator reaches the fields, so the comparison is not only of absences.
        assert!(found > 200, "only {found} documents had a usage");
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close"));
        h.insert("content-length", HeaderValue::from_static("3"));
        h.insert("authorization", HeaderValue::from_static("Bearer x"));
        let out = end_to_end(&h);
        assert_eq!(out.len(), 1);
        assert!(out.contains_key("authorization"));
    }

    #[test]
    fn headers_the_connection_header_names_are_dropped_too() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("keep-alive, X-Hop"));
        h.append("connection", HeaderValue::from_static("x-other-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("x-other-hop", HeaderValue::from_static("2"));
        h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.insert("x-end-to-end", HeaderValue::from_static("3"));
        let out = end_to_end(&h);
        assert_eq!(out.keys().map(HeaderName::as_str).collect::<Vec<_>>(), ["x-end-to-end"], "{out:?}");
    }
}
