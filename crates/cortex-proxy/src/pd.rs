//! The driver of a disaggregated request: the forwarder's second kind of attempt. It feeds
//! [`cortex_pd::PdRequest`] what the legs did and executes what the machine says — send a pair,
//! a decode leg or a single worker, cancel, blame, commit — until the client has its first byte.
//!
//! ```text
//! plan_pd (three rankings) ─► machine.step(Start) ─► effects ─► legs (futures polled here)
//!      ▲                                                             │ LegEnd
//!      └──────────── machine.step(Leg { attempt, leg, event }) ◄─────┘
//! Commit(leg) ─► the response: the serving leg's head and held bytes, then its stream (RelayBody)
//! ```
//!
//! Key decisions:
//! - **Legs are futures owned by the driver**, not spawned tasks: a cancelled leg is a dropped
//!   future (its connection closes and the engine aborts), and a client that leaves before the
//!   first byte drops the driver and every leg with it. Only a prefill leg still running when the
//!   client's answer starts (SGLang: its answer ends when the KV has moved) is spawned, and the
//!   relay holds its abort handle: when the answer ends or the client leaves, it is cancelled.
//! - **The client's first byte is the serving leg's first output** ([`cortex_pd::stream`]): a
//!   leg's future reads its answer into a [`Hold`] until an output, an error or the end; only an
//!   output (or a complete answer) is ever shown to the client, so every failure before it is
//!   retried or fallen back from by the machine's rules.
//! - **A worker's own refusal of the request** (a 4xx that is the request's fault) ends the
//!   request at once with the worker's answer, as on the regular path: no other worker would
//!   answer differently.
//! - Bookings follow the legs: each leg books its holder when it is sent, a failure is recorded
//!   through it when the machine blames the holder, a cancelled leg releases it unblamed, and the
//!   serving leg's booking moves into the relay (first token at commit, success at the end).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use cortex_hash::Engine;
use cortex_hash::kv::HolderId;
use cortex_pd::sglang::{self, Bootstrap, SglangLeg};
use cortex_pd::stream::{self, Hold, Verdict};
use cortex_pd::{
    Effect, Input, Leg, LegEvent, LegFailure, Mode as PdMode, NO_REPLAY_HEADER, Outcome, PdError, PdRequest,
    Pools, Protocol, Reached, Transfer, vllm,
};
use cortex_sched::{Booking, Candidate, FailureClass, MatchMode, Role};
use http::{HeaderMap, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Incoming};
use tokio::sync::OwnedSemaphorePermit;

use crate::alignment::Prediction;
use crate::error::{Body, ErrorFormat, ProxyError, refusal};
use crate::forwarder::{Forwarder, Outgoing, computes_new_blocks, key_refused, upstream_head};
use crate::observe::SpanGuard;
use crate::planner::{PdPlan, RANK_HEADER};
use crate::registry::WorkerRecord;
use crate::request::{self, Route};
use crate::telemetry as t;
use crate::upstream::{self, Answer, Completion, OnComplete, RelayBody, UpstreamClient};

/// The most of a prefill answer kept (vLLM's is a one-token completion; SGLang's carries the
/// prompt's logprobs when asked): beyond it the answer is drained, not kept.
const PREFILL_ANSWER_MAX: usize = 8 << 20;

/// The most of a non-streaming answer held before the client sees it: a body that large is let
/// through unjudged (the verdict needs the whole JSON).
const HELD_BODY_MAX: usize = 4 << 20;

/// How long a decode leg's failure waits for its prefill leg (still running) to report first: a
/// decode leg may fail because of its prefill side, and the machine should blame the worker that
/// failed. Only failure paths wait.
const PREFILL_SETTLE: Duration = Duration::from_millis(500);

/// What a leg's future ends with.
enum LegEnd {
    /// A serving leg's answer reached its first output (or ended): what the client gets.
    Output(Held),
    /// The prefill leg's answer is complete.
    PrefillDone {
        /// What it says about the KV (vLLM: whether it carried `kv_transfer_params`).
        transfer: Transfer,
        /// The answer (as much as was kept).
        answer: Bytes,
        /// Whether it was an event stream.
        sse: bool,
    },
    /// The leg failed before its first output.
    Failed {
        /// Its class and whether it reached the engine.
        failure: LegFailure,
        /// What happened, for the client if no dispatch is left.
        message: String,
        /// The worker's `Retry-After`, seconds (kept for a rate limit or a quota only).
        retry_after: Option<u32>,
    },
    /// The worker refused the request itself: passed on to the client as the worker wrote it.
    Rejected {
        /// Status.
        status: StatusCode,
        /// End-to-end headers.
        headers: HeaderMap,
        /// Body.
        body: Bytes,
        /// The class, when the scheduler tracks it.
        class: Option<FailureClass>,
    },
}

/// A serving leg's answer, held until the commit.
struct Held {
    /// The response head.
    head: http::response::Parts,
    /// What was read: the preamble and the first output (a whole body when `rest` is `None`).
    bytes: Bytes,
    /// The rest of the body.
    rest: Option<Incoming>,
    /// Whether it is an event stream.
    sse: bool,
}

type LegFuture = Pin<Box<dyn Future<Output = LegEnd> + Send>>;

/// A leg of the current dispatch: in flight while it has a future; after it ended, kept until
/// the machine has blamed it or moved on (its booking is what a blame is recorded through, and
/// a served leg's booking moves into the relay).
struct Slot {
    attempt: u32,
    leg: Leg,
    holder: HolderId,
    sent: Instant,
    booking: Option<Booking>,
    fut: Option<LegFuture>,
    /// The leg's client span (a traced request), ended with the slot, or with the relay of the
    /// serving leg's answer.
    span: Option<SpanGuard>,
}

impl Slot {
    fn running(slot: &Option<Slot>) -> bool {
        slot.as_ref().is_some_and(|s| s.fut.is_some())
    }
}

/// Waits for `slot`'s leg to end; never, when none is in flight.
async fn next(slot: &mut Option<Slot>) -> LegEnd {
    match slot.as_mut().and_then(|s| s.fut.as_mut()) {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// What one leg sends.
struct LegRequest {
    client: UpstreamClient,
    /// The worker (whether its key was refused: see `forwarder::key_refused`).
    worker: Arc<WorkerRecord>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    head_timeout: Duration,
    idle_timeout: Duration,
}

impl LegRequest {
    /// Sends the request and waits for a `2xx` head; anything else ends the leg.
    async fn head(self) -> Result<(Response<Incoming>, Duration), LegEnd> {
        let idle = self.idle_timeout;
        let answer = upstream::send(&self.client, self.uri, self.headers, self.body, self.head_timeout).await;
        match key_refused(answer, &self.worker) {
            Ok(Answer::Stream(resp)) => Ok((resp, idle)),
            Ok(Answer::Reject { status, headers, body, class }) => {
                Err(LegEnd::Rejected { status, headers, body, class })
            }
            Err(f) => Err(LegEnd::Failed {
                failure: LegFailure {
                    class: f.class,
                    reached: if f.sent { Reached::Maybe } else { Reached::No },
                },
                message: f.message,
                retry_after: f.retry_after,
            }),
        }
    }
}

fn failed(class: FailureClass, message: String) -> LegEnd {
    LegEnd::Failed { failure: LegFailure::sent(class), message, retry_after: None }
}

/// The next frame's data within `idle` (`Ok(None)`: the body ended).
async fn next_data(body: &mut Incoming, idle: Duration) -> Result<Option<Bytes>, LegEnd> {
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err(failed(FailureClass::Timeout, format!("worker sent nothing for {idle:?}"))),
            Ok(None) => return Ok(None),
            Ok(Some(Err(e))) => {
                return Err(failed(FailureClass::ServerError, format!("worker stream broke: {e}")));
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    return Ok(Some(data));
                }
            }
        }
    }
}

fn is_sse(head: &http::response::Parts, asked: bool) -> bool {
    asked
        || head
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// A serving leg (decode, or a single worker): its answer held until the first output.
async fn serving_leg(req: LegRequest, stream_asked: bool) -> LegEnd {
    let (resp, idle) = match req.head().await {
        Ok(r) => r,
        Err(end) => return end,
    };
    let (head, mut body) = resp.into_parts();
    let sse = is_sse(&head, stream_asked);
    if sse {
        let mut hold = Hold::new();
        loop {
            let data = match next_data(&mut body, idle).await {
                Ok(Some(d)) => d,
                // The stream ended with nothing but preamble: that is the answer.
                Ok(None) => return LegEnd::Output(Held { head, bytes: hold.take().into(), rest: None, sse }),
                Err(end) => return end,
            };
            match hold.push(&data) {
                Verdict::Preamble => {}
                Verdict::Output => {
                    let rest = (!body.is_end_stream()).then_some(body);
                    return LegEnd::Output(Held { head, bytes: hold.take().into(), rest, sse });
                }
                Verdict::Error => {
                    let text = String::from_utf8_lossy(hold.held()).into_owned();
                    return failed(
                        FailureClass::ServerError,
                        format!("worker reported an error before its first output: {}", text.trim()),
                    );
                }
            }
        }
    }
    let mut whole = BytesMut::new();
    loop {
        match next_data(&mut body, idle).await {
            Ok(Some(d)) => {
                whole.extend_from_slice(&d);
                if whole.len() > HELD_BODY_MAX {
                    let rest = (!body.is_end_stream()).then_some(body);
                    return LegEnd::Output(Held { head, bytes: whole.freeze(), rest, sse });
                }
            }
            Ok(None) => break,
            Err(end) => return end,
        }
    }
    if stream::body_verdict(&whole) == Verdict::Error {
        let text = String::from_utf8_lossy(&whole[..whole.len().min(300)]).into_owned();
        return failed(FailureClass::ServerError, format!("worker answered an error: {}", text.trim()));
    }
    LegEnd::Output(Held { head, bytes: whole.freeze(), rest: None, sse })
}

/// A prefill leg: its whole answer, judged.
async fn prefill_leg(req: LegRequest, protocol: Protocol, stream_asked: bool) -> LegEnd {
    let (resp, idle) = match req.head().await {
        Ok(r) => r,
        Err(end) => return end,
    };
    let (head, mut body) = resp.into_parts();
    let sse = is_sse(&head, stream_asked);
    let mut answer = BytesMut::new();
    loop {
        match next_data(&mut body, idle).await {
            Ok(Some(d)) => {
                if answer.len() + d.len() <= PREFILL_ANSWER_MAX {
                    answer.extend_from_slice(&d);
                }
            }
            Ok(None) => break,
            Err(end) => return end,
        }
    }
    let error = if sse { sse_has_error(&answer) } else { stream::body_verdict(&answer) == Verdict::Error };
    if error {
        let text = String::from_utf8_lossy(&answer[..answer.len().min(300)]).into_owned();
        return failed(
            FailureClass::ServerError,
            format!("prefill worker answered an error: {}", text.trim()),
        );
    }
    let transfer = match protocol {
        Protocol::Sglang => Transfer::Ready,
        Protocol::Vllm => match vllm::transfer_params(&answer) {
            Ok(Some(_)) => Transfer::Ready,
            _ => Transfer::Missing,
        },
    };
    LegEnd::PrefillDone { transfer, answer: answer.freeze(), sse }
}

/// Whether any event of a complete stream is an error.
fn sse_has_error(mut buf: &[u8]) -> bool {
    while let Some((end, data)) = stream::next_event(buf) {
        if let Some(d) = data
            && stream::event_verdict(&buf[d]) == Verdict::Error
        {
            return true;
        }
        buf = &buf[end..];
    }
    false
}

/// The data of the first event of a stream (SGLang's prefill answer, for its logprobs).
fn first_event_data(buf: &[u8]) -> Option<&[u8]> {
    let (_, data) = stream::next_event(buf)?;
    data.map(|d| &buf[d])
}

/// A leg that fails at once (its worker left the registry between the decision and the send).
fn gone(name: HolderId) -> LegFuture {
    Box::pin(std::future::ready(LegEnd::Failed {
        failure: LegFailure::refused(),
        message: format!("worker {:?} is no longer registered", name.worker),
        retry_after: None,
    }))
}

/// The machine's protocol for a model's engine.
fn protocol_of(engine: Engine) -> Protocol {
    match engine {
        Engine::Sglang => Protocol::Sglang,
        _ => Protocol::Vllm,
    }
}

/// The role whose ranking holds `leg`'s candidates.
fn role_of(leg: Leg) -> Role {
    match leg {
        Leg::Prefill => Role::Prefill,
        Leg::Decode | Leg::DecodeLocal => Role::Decode,
        Leg::Regular => Role::Regular,
    }
}

/// One disaggregated request being driven.
struct Driver<'a> {
    fw: &'a Forwarder,
    out: &'a Outgoing<'a>,
    plan: &'a PdPlan,
    protocol: Protocol,
    prefill: Option<Slot>,
    serving: Option<Slot>,
    /// The prefill's complete answer (vLLM: its `kv_transfer_params`; SGLang: its logprobs).
    prefill_answer: Option<(Bytes, bool)>,
    /// The serving leg's answer, waiting for the commit.
    output: Option<Held>,
    /// The last failure's message, for the error if no dispatch is left.
    last_message: Option<String>,
    /// The `Retry-After` of the leg failure that set `last_message`.
    last_retry_after: Option<u32>,
    /// Each failed leg's `Retry-After`, by the holder that sent it (the latest per holder): a
    /// worker is cooled down for its own, never for another's (a pair's other worker, blamed
    /// with it, gets its class's cooldown). Empty unless a leg failed.
    retry_after_of: Vec<(HolderId, u32)>,
    /// Each dispatched leg's worker name, taken at its dispatch: the answer's headers and
    /// counters name the worker even if it is removed while the request runs.
    names: Vec<(HolderId, String)>,
    buf: Vec<u8>,
}

/// How the request ended before (or at) its first byte.
enum Ended {
    /// The client gets the serving leg's answer.
    Commit,
    /// The worker's own refusal, to pass on.
    Rejected(Response<Body>),
    /// A gateway error.
    Failed(ProxyError),
}

impl Driver<'_> {
    fn worker(&self, holder: HolderId) -> Option<Arc<WorkerRecord>> {
        self.fw.registry().get(holder.worker)
    }

    /// `holder`'s worker name as it was when a leg was dispatched to it (else as it is now).
    fn name_of(&self, holder: HolderId) -> String {
        self.names
            .iter()
            .rev()
            .find(|(h, _)| h.worker == holder.worker)
            .map(|(_, n)| n.clone())
            .or_else(|| self.worker(holder).map(|w| w.config.name.clone()))
            .unwrap_or_default()
    }

    fn candidate(&self, leg: Leg, holder: HolderId) -> Option<&Candidate> {
        self.plan.candidate(role_of(leg), holder)
    }

    fn book(&self, leg: Leg, holder: HolderId) -> Option<Booking> {
        let now = self.fw.clock().now();
        let cand = self.candidate(leg, holder);
        let mut booking = match cand {
            Some(c) => self.plan.snapshot.book(c, now),
            None => self.plan.snapshot.book_holder(holder, self.plan.prompt_tokens, self.plan.kv_blocks, now),
        }?;
        // Every leg stores the prompt's blocks it lacks (a decode leg pulls them): owed events, by
        // the ledger's word when it has followed the engine's whole history (a ledger rebuilt
        // cold knows less than the engine: no obligation is inferred from it).
        let cached = cand.map_or(0, |c| c.matched_tokens);
        // An SGLang decode worker without its radix cache keeps no prefix and announces nothing.
        let announces = leg != Leg::Decode
            || self
                .worker(holder)
                .is_some_and(|w| w.config.engine == Engine::Vllm || w.status().decode_radix_cache);
        // Owed once the leg's first token (its finished prefill, or its answer's first chunk)
        // says the engine computed the prompt: a leg refused, failed or cancelled owes nothing.
        let owes = announces
            && !self.plan.seq.is_empty()
            && self.fw.verifier().progress(holder).is_some_and(|p| p.history_lost == 0)
            && computes_new_blocks(self.plan.prompt_tokens, cached, self.plan.model.block_size());
        if owes {
            booking.expect_events_after_first_token(now);
        }
        Some(booking)
    }

    /// The leg request of `body` to `holder`'s worker, its rank pinned the engine's way.
    fn request(
        &self,
        w: &Arc<WorkerRecord>,
        holder: HolderId,
        body: Bytes,
        pin_sglang: bool,
        span: Option<&SpanGuard>,
    ) -> Option<LegRequest> {
        let traceparent = span.map(SpanGuard::traceparent);
        let (uri, mut headers) =
            upstream_head(self.out.headers, self.out.rid, traceparent.as_deref(), w, self.out.route).ok()?;
        let body = match w.config.engine {
            Engine::Sglang if pin_sglang && w.dp_size() > 1 && self.out.facts.client_rank.is_none() => {
                request::splice_routed_dp_rank(&body, holder.rank.0)
            }
            Engine::Vllm if w.dp_size() > 1 => {
                upstream::set_header(&mut headers, RANK_HEADER, &holder.rank.0.to_string());
                body
            }
            _ => body,
        };
        Some(LegRequest {
            client: self.fw.client().clone(),
            worker: Arc::clone(w),
            uri,
            headers,
            body,
            head_timeout: self.fw.head_timeout(),
            idle_timeout: self.fw.idle_timeout(),
        })
    }

    fn slot(
        &mut self,
        attempt: u32,
        leg: Leg,
        holder: HolderId,
        fut: LegFuture,
        span: Option<SpanGuard>,
    ) -> Slot {
        if let Some(w) = self.worker(holder)
            && !self.names.iter().any(|(h, _)| h.worker == holder.worker)
        {
            self.names.push((holder, w.config.name.clone()));
        }
        let mut booking = self.book(leg, holder);
        // The worker that computes the prompt holds it next: the prefill leg, or a single one.
        if leg != Leg::Decode
            && let Some(b) = booking.as_mut()
        {
            b.track_prefix(&self.plan.pending, &self.plan.seq, self.fw.clock().now());
        }
        Slot { attempt, leg, holder, sent: Instant::now(), booking, fut: Some(fut), span }
    }

    /// The client span of a leg to `holder` (when the request is traced).
    fn span(&self, leg: Leg, holder: HolderId) -> Option<SpanGuard> {
        let name = self.worker(holder).map(|w| w.config.name.clone()).unwrap_or_default();
        self.out.watch.dispatched(leg.as_str(), &name, u32::from(holder.rank.0));
        self.out.watch.span(leg.as_str(), &name, u32::from(holder.rank.0))
    }

    /// A serving leg (decode or single) of `body` to `holder`.
    fn start_serving(&mut self, attempt: u32, leg: Leg, holder: HolderId, body: Bytes, pin_sglang: bool) {
        let stream = self.out.facts.stream;
        let span = self.span(leg, holder);
        let fut: LegFuture =
            match self.worker(holder).and_then(|w| self.request(&w, holder, body, pin_sglang, span.as_ref()))
            {
                Some(req) => Box::pin(serving_leg(req, stream)),
                None => gone(holder),
            };
        self.output = None;
        self.serving = Some(self.slot(attempt, leg, holder, fut, span));
    }

    fn start_prefill(&mut self, attempt: u32, holder: HolderId, body: Bytes) {
        let (protocol, stream) = (self.protocol, self.out.facts.stream && self.protocol == Protocol::Sglang);
        let span = self.span(Leg::Prefill, holder);
        let fut: LegFuture =
            match self.worker(holder).and_then(|w| self.request(&w, holder, body, false, span.as_ref())) {
                Some(req) => Box::pin(prefill_leg(req, protocol, stream)),
                None => gone(holder),
            };
        self.prefill_answer = None;
        self.prefill = Some(self.slot(attempt, Leg::Prefill, holder, fut, span));
    }

    /// Executes one effect; `Some` when the request ended.
    fn execute(&mut self, effect: Effect, m: &PdRequest) -> Option<Ended> {
        match effect {
            Effect::Dispatch { attempt, pair, room } => {
                let Some(p) = self.worker(pair.prefill) else {
                    self.prefill =
                        Some(self.slot(attempt, Leg::Prefill, pair.prefill, gone(pair.prefill), None));
                    if room.is_some() {
                        self.serving =
                            Some(self.slot(attempt, Leg::Decode, pair.decode, gone(pair.decode), None));
                    }
                    return None;
                };
                match room {
                    Some(room) => {
                        let b = Bootstrap {
                            host: &p.host,
                            port: self
                                .fw
                                .pd()
                                .bootstrap_port(p.status().bootstrap_port.or(p.config.bootstrap_port)),
                            room,
                            prefill_rank: pair.prefill.rank.0,
                            decode_rank: pair.decode.rank.0,
                        };
                        let mut prefill_body = Vec::new();
                        if let Err(e) =
                            sglang::leg_body(&self.out.body, SglangLeg::Prefill, &b, &mut prefill_body)
                        {
                            return Some(Ended::Failed(body_error(&e)));
                        }
                        if let Err(e) = sglang::leg_body(&self.out.body, SglangLeg::Decode, &b, &mut self.buf)
                        {
                            return Some(Ended::Failed(body_error(&e)));
                        }
                        let decode_body = Bytes::copy_from_slice(&self.buf);
                        self.start_prefill(attempt, pair.prefill, prefill_body.into());
                        self.start_serving(attempt, Leg::Decode, pair.decode, decode_body, false);
                    }
                    None => {
                        if let Err(e) = vllm::prefill_body(&self.out.body, &mut self.buf) {
                            return Some(Ended::Failed(body_error(&e)));
                        }
                        let body = Bytes::copy_from_slice(&self.buf);
                        self.serving = None;
                        self.start_prefill(attempt, pair.prefill, body);
                    }
                }
                None
            }
            Effect::SendDecode { attempt, decode, transfer } => {
                let prefill_host = m.pair().and_then(|p| self.worker(p.prefill)).map(|w| w.host.clone());
                let answer = self.prefill_answer.as_ref().map(|(a, _)| a.clone()).unwrap_or_default();
                let params = match transfer {
                    Transfer::Ready => vllm::transfer_params(&answer).ok().flatten(),
                    Transfer::Missing => None,
                };
                let host = prefill_host.unwrap_or_default();
                if let Err(e) = vllm::decode_body(&self.out.body, params, &host, &mut self.buf) {
                    return Some(Ended::Failed(body_error(&e)));
                }
                let body = Bytes::copy_from_slice(&self.buf);
                self.start_serving(attempt, Leg::Decode, decode, body, false);
                None
            }
            Effect::SendSingle { attempt, leg, holder } => {
                self.start_serving(attempt, leg, holder, self.out.body.clone(), true);
                None
            }
            Effect::Cancel(Leg::Prefill) => {
                self.prefill = None;
                None
            }
            Effect::Cancel(_) => {
                self.serving = None;
                self.output = None;
                None
            }
            Effect::Blame { holder, class } => {
                let now = self.fw.clock().now();
                // The worker's own word on when to come back (a rate limit's `Retry-After`).
                let asked = self
                    .retry_after_of
                    .iter()
                    .rev()
                    .find(|&&(from, _)| from == holder)
                    .map(|&(_, s)| Duration::from_secs(u64::from(s)));
                let mut booked = false;
                for slot in [&mut self.prefill, &mut self.serving].into_iter().flatten() {
                    if slot.holder == holder
                        && let Some(b) = slot.booking.take()
                    {
                        b.fail_for(class, now, asked);
                        booked = true;
                    }
                }
                if !booked && let Some(w) = self.plan.snapshot.worker(holder.worker) {
                    // A leg that already ended well (a prefill whose transfer then failed): its
                    // booking is gone, the failure is recorded on its worker.
                    w.state().record_failure_for(class, now, asked);
                }
                None
            }
            Effect::Commit(_) => Some(Ended::Commit),
            Effect::Finish(Outcome::Failed { error, attempts }) => {
                Some(Ended::Failed(self.error(error, attempts)))
            }
            // Served: the commit came first and ended the driving. ClientGone: the driver is
            // dropped when the client leaves, so the machine is never told.
            Effect::Finish(_) => None,
        }
    }

    fn error(&self, error: PdError, attempts: u32) -> ProxyError {
        let model = self.plan.model.base_model().to_owned();
        metrics::counter!(t::PD_REQUESTS, "outcome" => "failed", "pd" => "none").increment(1);
        match error {
            PdError::Body(e) => body_error(&e),
            PdError::NoPrefill | PdError::NoDecode => ProxyError::NoWorker(model),
            PdError::Exhausted { leg, class, .. } | PdError::MidStream { leg, class } => {
                ProxyError::Upstream {
                    class,
                    attempts,
                    message: format!(
                        "the {} leg failed: {}",
                        leg.as_str(),
                        self.last_message.as_deref().unwrap_or(class.as_str())
                    ),
                    retry_after: self.last_retry_after,
                }
            }
            PdError::NotReplayed { leg, class } => ProxyError::Upstream {
                class,
                attempts,
                message: format!(
                    "the {} leg failed and the request must not run twice ({NO_REPLAY_HEADER} or \
                     pd.replay: never): {}",
                    leg.as_str(),
                    self.last_message.as_deref().unwrap_or(class.as_str())
                ),
                retry_after: self.last_retry_after,
            },
        }
    }

    /// The machine's input for what the leg in `which` (the prefill slot, or the serving one)
    /// ended with; the output is kept for the commit.
    fn observe(&mut self, which: Leg, end: LegEnd, m: &PdRequest, inputs: &mut Vec<Input>) -> Option<Ended> {
        let slot = if which == Leg::Prefill { &mut self.prefill } else { &mut self.serving };
        let s = slot.as_mut()?;
        s.fut = None;
        let status = match &end {
            LegEnd::Output(held) => Some(held.head.status.as_u16()),
            LegEnd::PrefillDone { .. } => Some(200),
            LegEnd::Rejected { status, .. } => Some(status.as_u16()),
            LegEnd::Failed { .. } => None,
        };
        if let (Some(span), Some(status)) = (s.span.as_mut(), status) {
            span.answered(status);
        }
        let (attempt, leg, holder, sent) = (s.attempt, s.leg, s.holder, s.sent);
        let mut input = |event| inputs.push(Input::Leg { attempt, leg, event });
        match end {
            LegEnd::Output(held) => {
                let whole = held.rest.is_none();
                self.output = Some(held);
                input(LegEvent::Answered);
                input(LegEvent::FirstOutput);
                if whole {
                    input(LegEvent::Done);
                }
            }
            LegEnd::PrefillDone { transfer, answer, sse } => {
                metrics::histogram!(t::PD_PREFILL_SECONDS).record(sent.elapsed().as_secs_f64());
                if let Some(mut b) = self.prefill.as_mut().and_then(|s| s.booking.take()) {
                    let now = self.fw.clock().now();
                    // vLLM's prefill leg is a one-token answer: its end is its first token, a
                    // sample of the worker's prefill speed. SGLang's ends when the decode
                    // worker took the KV: it includes the other worker's time.
                    if self.protocol == Protocol::Vllm {
                        t::estimate_error(b.first_output(now));
                    } else {
                        b.first_token(now);
                    }
                    b.succeed(now);
                }
                self.check_prefill(holder, &answer, sse);
                self.prefill_answer = Some((answer, sse));
                input(LegEvent::PrefillDone(transfer));
            }
            LegEnd::Failed { failure, message, retry_after } => {
                tracing::info!(leg = leg.as_str(), class = failure.class.as_str(), %message, "PD leg failed");
                metrics::counter!(t::PD_LEG_FAILURES, "leg" => leg.as_str(), "class" => failure.class.as_str())
                    .increment(1);
                self.last_message = Some(message);
                self.last_retry_after = retry_after;
                if let Some(s) = retry_after {
                    self.retry_after_of.push((holder, s));
                }
                input(LegEvent::Failed(failure));
            }
            LegEnd::Rejected { status, headers, body, class } => {
                let slot = if which == Leg::Prefill { &mut self.prefill } else { &mut self.serving };
                if let Some(b) = slot.as_mut().and_then(|s| s.booking.take()) {
                    let now = self.fw.clock().now();
                    match class {
                        Some(c) => b.fail(c, now),
                        None => b.succeed(now),
                    }
                }
                metrics::counter!(t::PD_REQUESTS, "outcome" => "rejected", "pd" => "none").increment(1);
                let mut resp = refusal(status, headers, &body, class, ErrorFormat::of(self.out.route));
                // Attributed as an answer is: the mode so far, the pair's prefill worker.
                self.cortex_headers(resp.headers_mut(), leg, holder, Some((m.mode(), served_pair(m, leg))));
                return Some(Ended::Rejected(resp));
            }
        }
        None
    }

    /// The prefill worker's own checks (it computed the prompt like any worker).
    fn check_prefill(&self, holder: HolderId, answer: &[u8], sse: bool) {
        let Some(c) = self.candidate(Leg::Prefill, holder) else { return };
        let mode = effective_mode(self.plan.prefill.mode(), c);
        let p = self.prediction(c, c.matched_tokens, mode == MatchMode::ExactKvEvents, true);
        let usage = upstream::find_usage(answer, sse);
        (self.fw.verifier().on_complete(p))(
            usage.unwrap_or(Completion { cached_tokens: None, prompt_tokens: None }),
        );
    }

    fn prediction(&self, c: &Candidate, predicted: u32, exact: bool, ledger_presence: bool) -> Prediction {
        let v = self.fw.verifier();
        let holder = c.holder;
        let first_block = (ledger_presence && !self.plan.seq.is_empty() && v.samples_block(holder.worker))
            .then(|| (self.plan.seq[0], self.plan.first_page.clone()));
        Prediction {
            holder,
            worker: self.name_of(holder),
            predicted_hit: predicted.min(self.plan.model.max_cached_tokens(self.plan.prompt_tokens as usize)),
            exact,
            model: Arc::clone(&self.plan.model),
            cache_salt: self.out.facts.cache_salt.clone(),
            first_block,
            events_before: None,
        }
    }

    /// What the serving leg's answer is checked against when it ends: a regular worker or a
    /// decode worker prefilling locally like any worker; a decode worker of a pair by the rules
    /// of [`cortex_pd::alignment`] (what its reported cached tokens and published blocks mean).
    fn serving_check(&self, leg: Leg, holder: HolderId, pair_prefill: Option<HolderId>) -> OnComplete {
        let verifier = self.fw.verifier();
        let none: OnComplete = Box::new(|_| {});
        let Some(c) = self.candidate(leg, holder) else { return none };
        if leg != Leg::Decode {
            let ranking = self.plan.ranking(role_of(leg)).map_or(MatchMode::LoadAware, |r| r.mode());
            let exact = effective_mode(ranking, c) == MatchMode::ExactKvEvents;
            return verifier.on_complete(self.prediction(c, c.matched_tokens, exact, true));
        }
        let Some(w) = self.worker(holder) else { return none };
        let cache = if w.status().decode_radix_cache || w.config.engine == Engine::Vllm {
            cortex_pd::alignment::DecodeCache::On
        } else {
            cortex_pd::alignment::DecodeCache::Off
        };
        let checks = cortex_pd::alignment::checks(w.config.engine, Role::Decode, cache);
        let prefill = pair_prefill.and_then(|p| self.candidate(Leg::Prefill, p));
        let prefill_exact =
            prefill.is_some_and(|p| effective_mode(self.plan.prefill.mode(), p) == MatchMode::ExactKvEvents);
        match checks.cached_tokens {
            cortex_pd::alignment::CachedTokens::OwnPrediction => {
                let exact = effective_mode(self.plan.decode.mode(), c) == MatchMode::ExactKvEvents;
                verifier.on_complete(self.prediction(c, c.matched_tokens, exact, checks.ledger_presence))
            }
            cortex_pd::alignment::CachedTokens::PrefillPrediction => {
                let predicted = prefill.map_or(0, |p| p.matched_tokens);
                verifier.on_complete(self.prediction(c, predicted, prefill_exact, checks.ledger_presence))
            }
            cortex_pd::alignment::CachedTokens::NotComparable => {
                // The number mixes in the transferred tokens: only the ledger check applies.
                let check = verifier.on_complete(self.prediction(c, 0, false, checks.ledger_presence));
                Box::new(move |done: Completion| check(Completion { cached_tokens: None, ..done }))
            }
        }
    }

    fn cortex_headers(
        &self,
        h: &mut HeaderMap,
        leg: Leg,
        holder: HolderId,
        pd: Option<(PdMode, Option<HolderId>)>,
    ) {
        let name = self.name_of(holder);
        upstream::set_header(h, "x-cortex-assigned-worker", &name);
        upstream::set_header(h, "x-cortex-assigned-rank", &holder.rank.0.to_string());
        upstream::set_header(h, "x-request-id", self.out.rid);
        let Some((mode, prefill)) = pd else { return };
        upstream::set_header(h, "x-cortex-pd", mode.as_str());
        // The cache hit that matters is the one of the worker that computed the prompt.
        let (hit_leg, hit_holder) = match prefill {
            Some(p) => (Leg::Prefill, p),
            None => (leg, holder),
        };
        let hit = self.candidate(hit_leg, hit_holder);
        let ranking_mode = self.plan.ranking(role_of(hit_leg)).map_or(MatchMode::LoadAware, |r| r.mode());
        let mode = hit.map_or(MatchMode::LoadAware, |c| effective_mode(ranking_mode, c));
        upstream::set_header(
            h,
            "x-cortex-cache-hit-tokens",
            &hit.map_or(0, |c| {
                c.matched_tokens.min(self.plan.model.max_cached_tokens(self.plan.prompt_tokens as usize))
            })
            .to_string(),
        );
        upstream::set_header(h, "x-cortex-match-mode", mode.as_str());
        if let Some(p) = prefill {
            let pname = self.name_of(p);
            upstream::set_header(h, "x-cortex-prefill-worker", &pname);
            upstream::set_header(h, "x-cortex-prefill-rank", &p.rank.0.to_string());
        }
    }
}

/// The prefill worker of the pair whose `leg` answers, if a pair serves it. A vLLM prefill that
/// returned no `kv_transfer_params` left the decode worker to compute the prompt itself: no pair
/// served it.
fn served_pair(m: &PdRequest, leg: Leg) -> Option<HolderId> {
    m.pair()
        .filter(|_| matches!(leg, Leg::Decode))
        .filter(|_| m.mode() != PdMode::FallbackSingle(cortex_pd::FallbackCause::NoTransferParams))
        .map(|p| p.prefill)
}

fn body_error(e: &cortex_pd::JsonError) -> ProxyError {
    ProxyError::InvalidRequest(format!("the body cannot be prepared for disaggregation: {e}"))
}

/// The ranking's mode, or `load_aware` when the chosen candidate holds nothing.
fn effective_mode(mode: MatchMode, c: &Candidate) -> MatchMode {
    if mode == MatchMode::ExactKvEvents && c.matched_tokens == 0 { MatchMode::LoadAware } else { mode }
}

/// Keeps a spawned task alive exactly as long as the value: dropping it aborts the task.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Forwarder {
    /// Forwards a disaggregated request along `plan` (see the module docs), holding `permit`
    /// until the answer has been relayed.
    ///
    /// # Errors
    /// [`ProxyError::Upstream`] when every allowed dispatch failed before the first byte (the
    /// last failure), [`ProxyError::NoWorker`] when no pair and no single worker could take it,
    /// [`ProxyError::InvalidRequest`] when the body cannot be prepared for the legs.
    pub async fn forward_pd(
        &self,
        out: Outgoing<'_>,
        plan: PdPlan,
        permit: OwnedSemaphorePermit,
    ) -> Result<Response<Body>, ProxyError> {
        let protocol = protocol_of(plan.model.spec().profile.engine());
        let replay = self.pd().replay.for_request(out.headers.get(NO_REPLAY_HEADER).map(|v| v.as_bytes()));
        let logprob = protocol == Protocol::Sglang
            && out.route == Route::Generate
            && sglang::wants_logprobs(&out.body).map_err(|e| body_error(&e))?;
        let mut m = PdRequest::new(protocol, *self.pd(), replay, logprob, fastrand::u64(..));
        let pools = Pools {
            prefill: &plan.prefill,
            decode: &plan.decode,
            regular: plan.regular.as_ref(),
            snapshot: &plan.snapshot,
        };
        let mut d = Driver {
            fw: self,
            out: &out,
            plan: &plan,
            protocol,
            prefill: None,
            serving: None,
            prefill_answer: None,
            output: None,
            last_message: None,
            last_retry_after: None,
            retry_after_of: Vec::new(),
            names: Vec::new(),
            buf: Vec::with_capacity(out.body.len() + 256),
        };
        let started = Instant::now();
        let mut effects = Vec::with_capacity(8);
        let mut inputs = vec![Input::Start];
        loop {
            for input in inputs.drain(..) {
                m.step(self.clock().now(), input, &pools, &mut effects);
            }
            let mut ended = None;
            for e in effects.drain(..) {
                if let Some(end) = d.execute(e, &m) {
                    ended.get_or_insert(end);
                }
            }
            match ended {
                Some(Ended::Commit) => break,
                Some(Ended::Rejected(resp)) => return Ok(resp),
                Some(Ended::Failed(e)) => return Err(e),
                None => {}
            }
            if !Slot::running(&d.prefill) && !Slot::running(&d.serving) {
                return Err(ProxyError::Internal("the PD machine waits for no running leg".into()));
            }
            let (which, end) = tokio::select! {
                end = next(&mut d.prefill) => (Leg::Prefill, end),
                end = next(&mut d.serving) => (Leg::Decode, end),
            };
            if which != Leg::Prefill
                && matches!(end, LegEnd::Failed { .. })
                && d.serving.as_ref().is_some_and(|s| s.leg == Leg::Decode)
                && Slot::running(&d.prefill)
            {
                // A decode leg may fail because of its prefill side (SGLang: the bootstrap
                // server of a prefill worker that just died): let the prefill leg report first,
                // briefly, so the machine blames the right worker.
                if let Ok(first) = tokio::time::timeout(PREFILL_SETTLE, next(&mut d.prefill)).await
                    && let Some(end) = d.observe(Leg::Prefill, first, &m, &mut inputs)
                {
                    match end {
                        Ended::Rejected(resp) => return Ok(resp),
                        Ended::Failed(e) => return Err(e),
                        Ended::Commit => break,
                    }
                }
            }
            if let Some(end) = d.observe(which, end, &m, &mut inputs) {
                match end {
                    Ended::Rejected(resp) => return Ok(resp),
                    Ended::Failed(e) => return Err(e),
                    Ended::Commit => break,
                }
            }
        }
        self.commit(d, &m, logprob, started, permit)
    }

    /// The client's answer: the serving leg's head and held bytes, then the rest of its stream;
    /// a prefill leg still running goes on in the background until the answer ends.
    fn commit(
        &self,
        mut d: Driver<'_>,
        m: &PdRequest,
        logprob: bool,
        started: Instant,
        permit: OwnedSemaphorePermit,
    ) -> Result<Response<Body>, ProxyError> {
        // The serving slot, not `m.serving()`: a whole answer also finished the machine.
        let (Some(held), Some(slot)) = (d.output.take(), d.serving.take()) else {
            return Err(ProxyError::Internal("committed without an answer".into()));
        };
        let (leg, holder) = (slot.leg, slot.holder);
        let mode = m.mode();
        let pair_prefill = served_pair(m, leg);
        metrics::counter!(t::PD_REQUESTS, "outcome" => "served", "pd" => mode.as_str()).increment(1);
        metrics::histogram!(t::PD_FIRST_BYTE_SECONDS).record(started.elapsed().as_secs_f64());
        if let PdMode::FallbackSingle(cause) = mode {
            metrics::counter!(t::PD_FALLBACKS, "reason" => cause.as_str()).increment(1);
        }
        let Held { head, mut bytes, rest, sse } = held;
        let mut merge_from = None;
        if logprob && let Some((answer, prefill_sse)) = &d.prefill_answer {
            let prefill_json = if *prefill_sse { first_event_data(answer) } else { Some(&answer[..]) };
            match (prefill_json, sse) {
                (Some(p), false) if rest.is_none() => {
                    let mut merged = Vec::with_capacity(bytes.len() + p.len());
                    if sglang::merge_logprobs(&bytes, p, &mut merged).is_ok() {
                        bytes = merged.into();
                    }
                }
                (Some(p), true) => merge_from = Some(Bytes::copy_from_slice(p)),
                _ => tracing::debug!("no prefill logprobs to merge"),
            }
        }
        let mut headers = upstream::end_to_end(&head.headers);
        d.cortex_headers(&mut headers, leg, holder, Some((mode, pair_prefill)));
        let on_complete = d.serving_check(leg, holder, pair_prefill);
        let Some(mut booking) = slot.booking else {
            return Err(ProxyError::Internal("the serving leg was never booked".into()));
        };
        // An SGLang pair's prefill leg may still run: the decode worker's first token shows that
        // it computed the prompt, and its events are owed from then.
        if let Some(prefill) = d.prefill.as_mut().and_then(|p| p.booking.as_mut()) {
            booking.owe_for(prefill);
        }
        let mut relay =
            RelayBody::resumed(bytes, rest, booking, self.clock(), sse, self.idle_timeout(), on_complete)
                .holding(permit)
                .in_format(ErrorFormat::of(d.out.route))
                .tapped(d.out.watch.tap());
        // The serving leg's span lasts as long as its answer is relayed (the prefill leg's ends
        // with it, below, or was ended when the leg finished).
        let mut guards: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
        if let Some(s) = slot.span {
            guards.push(Box::new(s));
        }
        if pair_prefill.is_some() {
            relay = relay.not_learning();
        }
        if let Some(p) = d.prefill.take() {
            // Its KV has moved (or is moving) to the decode worker: let it finish, unblamed, for
            // as long as the client's answer runs.
            let clock = self.clock();
            if let Some(fut) = p.fut {
                let (booking, sent) = (p.booking, p.sent);
                let task = tokio::spawn(async move {
                    if let LegEnd::PrefillDone { .. } = fut.await {
                        // Its duration, as for a prefill that ended before the commit.
                        metrics::histogram!(t::PD_PREFILL_SECONDS).record(sent.elapsed().as_secs_f64());
                        if let Some(b) = booking {
                            b.succeed(clock.now());
                        }
                    }
                });
                guards.push(Box::new(AbortOnDrop(task.abort_handle())));
            }
            if let Some(s) = p.span {
                guards.push(Box::new(s));
            }
        }
        if !guards.is_empty() {
            relay = relay.guarding(Box::new(guards));
        }
        let relay = self.watch(relay, d.out.conn);
        let body: Body = match merge_from {
            Some(prefill) => MergeLogprobs::new(relay, prefill).boxed_unsync(),
            None => relay.boxed_unsync(),
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = head.status;
        *resp.headers_mut() = headers;
        Ok(resp)
    }
}

/// An SGLang `/generate` stream with the prefill's `meta_info.input_token_logprobs` prepended
/// to every event's own, as SGLang's routers merge them (the prefill's first event carries
/// them). Events that are not JSON objects (`[DONE]`) pass as they are.
struct MergeLogprobs<B> {
    inner: B,
    prefill: Bytes,
    pending: BytesMut,
    out: Vec<u8>,
    done: bool,
}

impl<B> MergeLogprobs<B> {
    fn new(inner: B, prefill: Bytes) -> Self {
        MergeLogprobs { inner, prefill, pending: BytesMut::new(), out: Vec::new(), done: false }
    }

    /// The complete events buffered so far, merged.
    fn drain_events(&mut self) -> Bytes {
        let mut merged = BytesMut::new();
        while let Some((end, data)) = stream::next_event(&self.pending) {
            let event = self.pending.split_to(end);
            match data {
                Some(d) if event[d.clone()].trim_ascii_start().first() == Some(&b'{') => {
                    if sglang::merge_logprobs(&event[d.clone()], &self.prefill, &mut self.out).is_ok() {
                        merged.extend_from_slice(b"data: ");
                        merged.extend_from_slice(&self.out);
                        merged.extend_from_slice(b"\n\n");
                    } else {
                        merged.extend_from_slice(&event);
                    }
                }
                _ => merged.extend_from_slice(&event),
            }
        }
        merged.freeze()
    }
}

impl<B> HttpBody for MergeLogprobs<B>
where
    B: HttpBody<Data = Bytes, Error = crate::error::BodyError> + Unpin,
{
    type Data = Bytes;
    type Error = crate::error::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = this.pending.split().freeze();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(rest))));
                    }
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else { continue };
                    let data: Bytes = data;
                    this.pending.extend_from_slice(&data);
                    let merged = this.drain_events();
                    if !merged.is_empty() {
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(merged))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_errors_and_first_events() {
        let ok = b"data: {\"text\":\"a\",\"meta_info\":{}}\n\ndata: [DONE]\n\n";
        assert!(!sse_has_error(ok));
        let bad = b"data: {\"text\":\"a\"}\n\ndata: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n";
        assert!(sse_has_error(bad));
        assert_eq!(first_event_data(ok), Some(&b"{\"text\":\"a\",\"meta_info\":{}}"[..]));
        assert_eq!(first_event_data(b"data: {\"x\":1}"), None, "an incomplete event is not one");
    }

    /// The prefill's prompt logprobs go in front of every event's own, across chunk boundaries
    /// that split events; `[DONE]` and an unfinished tail pass as they are.
    #[tokio::test]
    async fn logprobs_are_merged_into_every_event() {
        let events = [
            "data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-0.5,3,null]]}}\n\n",
            "data: {\"text\":\"ab\",\"meta_info\":{\"input_token_logprobs\":[]}}\n\n",
            "data: [DONE]\n\n",
        ]
        .concat();
        let (a, b) = events.split_at(30);
        let inner = Chunks(vec![Bytes::from(b.to_owned()), Bytes::from(a.to_owned())]);
        let prefill =
            Bytes::from_static(b"{\"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null],[-2.0,2,null]]}}");
        let out = MergeLogprobs::new(inner, prefill).collect().await.unwrap().to_bytes();
        let text = String::from_utf8(out.to_vec()).unwrap();
        let datas: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(datas.len(), 3, "{text}");
        let first: serde_json::Value = serde_json::from_str(datas[0].trim_start_matches("data: ")).unwrap();
        assert_eq!(
            first["meta_info"]["input_token_logprobs"],
            serde_json::json!([[-1.0, 1, null], [-2.0, 2, null], [-0.5, 3, null]])
        );
        let second: serde_json::Value = serde_json::from_str(datas[1].trim_start_matches("data: ")).unwrap();
        assert_eq!(
            second["meta_info"]["input_token_logprobs"],
            serde_json::json!([[-1.0, 1, null], [-2.0, 2, null]])
        );
        assert_eq!(datas[2], "data: [DONE]");
    }

    /// A body of `chunks`, last first.
    struct Chunks(Vec<Bytes>);

    impl HttpBody for Chunks {
        type Data = Bytes;
        type Error = crate::error::BodyError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(self.0.pop().map(|b| Ok(hyper::body::Frame::data(b))))
        }
    }

    #[test]
    fn legs_map_to_their_pools() {
        assert_eq!(role_of(Leg::Prefill), Role::Prefill);
        assert_eq!(role_of(Leg::Decode), Role::Decode);
        assert_eq!(role_of(Leg::DecodeLocal), Role::Decode);
        assert_eq!(role_of(Leg::Regular), Role::Regular);
        assert_eq!(protocol_of(Engine::Sglang), Protocol::Sglang);
        assert_eq!(protocol_of(Engine::Vllm), Protocol::Vllm);
    }
}
