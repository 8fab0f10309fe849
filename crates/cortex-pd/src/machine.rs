//! The state machine of one disaggregated request: which legs to send where, when to cancel,
//! retry or fall back, and when the client's first byte may go out. Pure: the driver feeds it
//! what the legs did, with the time, and executes the [`Effect`]s it returns, in order.
//!
//! Key decisions:
//! - **One machine, two flows** ([`Protocol`]): SGLang sends both legs at once (they meet in a
//!   bootstrap room), vLLM sends the prefill leg and then the decode leg with the prefill's
//!   `kv_transfer_params`. The failure rules are the same for both, so they are written once.
//! - **The client's first byte is the decode leg's first output** ([`LegEvent::FirstOutput`]),
//!   not its response head: both engines answer `200` before they know whether the KV arrived
//!   (vLLM streams an error event after its role preamble; SGLang an error event or an abort), so
//!   until an output is seen every failure is still "before the first byte", retried or fallen
//!   back from. [`crate::stream`] tells the driver which events are outputs.
//! - **Choices come from the scheduler's rankings** ([`Pools`]): the first admissible candidate of
//!   each pool that has not failed in this request, re-checked against the snapshot (a failure
//!   recorded through its booking may have just cooled a worker down). A new pair keeps the leg
//!   that did not fail when it is still admissible.
//! - **Late events of an abandoned dispatch are ignored**: every leg event names its dispatch.

use cortex_hash::kv::HolderId;
use cortex_sched::{FailureClass, Ranking, Snapshot, Timestamp};

use crate::config::{PdConfig, Replay, TransferFailure};
use crate::error::{PdError, is_request_problem};

/// The engine's PD protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Both legs at once, meeting in a bootstrap room.
    Sglang,
    /// The prefill leg, then the decode leg with its `kv_transfer_params`.
    Vllm,
}

/// One request sent to one worker on behalf of the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Leg {
    /// The prefill worker's leg.
    Prefill,
    /// The decode worker's leg of a pair.
    Decode,
    /// A decode worker serving the whole request, prefilling locally (vLLM's fallback).
    DecodeLocal,
    /// A regular worker serving the whole request (the fallback).
    Regular,
}

impl Leg {
    /// Every leg, in declaration order (so that metrics can register each label value at zero).
    pub const ALL: [Leg; 4] = [Leg::Prefill, Leg::Decode, Leg::DecodeLocal, Leg::Regular];

    /// Snake-case name for metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
            Leg::DecodeLocal => "decode_local",
            Leg::Regular => "regular",
        }
    }
}

/// A bootstrap room: SGLang's rendezvous key, in `[0, 2^63 − 1]` (the engines store it as a
/// signed 64-bit integer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Room(u64);

impl Room {
    /// The largest room.
    pub const MAX: u64 = i64::MAX as u64;

    /// The room `raw` masked into range.
    #[must_use]
    pub const fn new(raw: u64) -> Room {
        Room(raw & Room::MAX)
    }

    /// The room number.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The room of batch item `i` (distinct per item, in range).
    #[must_use]
    pub const fn item(self, i: u64) -> Room {
        Room::new(self.0.wrapping_add(i))
    }
}

/// A prefill and a decode holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pair {
    /// The prefill (worker, rank).
    pub prefill: HolderId,
    /// The decode (worker, rank).
    pub decode: HolderId,
}

/// What the machine chooses from: the scheduler's rankings of the model's pools (decided once per
/// request, in buffers the driver owns) and the snapshot they were decided on.
#[derive(Clone, Copy, Debug)]
pub struct Pools<'a> {
    /// The prefill pool's ranking.
    pub prefill: &'a Ranking,
    /// The decode pool's ranking.
    pub decode: &'a Ranking,
    /// The regular pool's ranking, if the model has regular workers.
    pub regular: Option<&'a Ranking>,
    /// The snapshot the rankings came from.
    pub snapshot: &'a Snapshot,
}

/// Whether a failed leg may have reached an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reached {
    /// The connection was refused or never established: nothing was sent.
    No,
    /// The request was (or may have been) sent.
    Maybe,
}

/// A leg's failure, classified by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LegFailure {
    /// The scheduler's failure class (what it means for the worker).
    pub class: FailureClass,
    /// Whether the leg may have reached its engine.
    pub reached: Reached,
}

impl LegFailure {
    /// A failure of a request that was sent.
    #[must_use]
    pub const fn sent(class: FailureClass) -> Self {
        LegFailure { class, reached: Reached::Maybe }
    }

    /// A connection that never carried the request.
    #[must_use]
    pub const fn refused() -> Self {
        LegFailure { class: FailureClass::ServerError, reached: Reached::No }
    }
}

/// What the prefill leg's complete answer says about the KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transfer {
    /// The KV is ready for (SGLang: already with) the decode worker; vLLM: the answer carried
    /// `kv_transfer_params`.
    Ready,
    /// vLLM: the answer carried no `kv_transfer_params`; the decode worker prefills locally.
    Missing,
}

/// What happened on a leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LegEvent {
    /// A `2xx` response head (held: the client sees nothing yet).
    Answered,
    /// The leg failed before its first output: transport error, timeout, non-`2xx` status, or an
    /// error event or body where the output should be.
    Failed(LegFailure),
    /// The prefill leg's answer is complete (only [`Leg::Prefill`]).
    PrefillDone(Transfer),
    /// The first output event (a token or a finish), or a complete non-streaming body that is
    /// not an error: the point after which the request is never replayed.
    FirstOutput,
    /// The answer ended normally.
    Done,
    /// The answer broke after its first output.
    Broken(FailureClass),
}

/// An input of the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Input {
    /// Dispatch the first attempt.
    Start,
    /// Something happened on a leg of dispatch `attempt` (1-based, as the effect named it).
    Leg {
        /// The dispatch the leg belongs to.
        attempt: u32,
        /// The leg.
        leg: Leg,
        /// What happened.
        event: LegEvent,
    },
    /// The client went away.
    ClientGone,
}

/// Why a request was not served disaggregated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackCause {
    /// The prefill succeeded, the decode leg failed before its first output.
    TransferFailed,
    /// vLLM's prefill answered without `kv_transfer_params`: the decode worker prefilled locally.
    NoTransferParams,
    /// No prefill worker could take the request.
    PrefillUnavailable,
    /// No decode worker could take the request.
    DecodeUnavailable,
}

impl FallbackCause {
    /// Every cause, in declaration order (so that metrics can register each label value at
    /// zero).
    pub const ALL: [FallbackCause; 4] = [
        FallbackCause::TransferFailed,
        FallbackCause::NoTransferParams,
        FallbackCause::PrefillUnavailable,
        FallbackCause::DecodeUnavailable,
    ];

    /// Snake-case name for metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            FallbackCause::TransferFailed => "transfer_failed",
            FallbackCause::NoTransferParams => "no_transfer_params",
            FallbackCause::PrefillUnavailable => "prefill_unavailable",
            FallbackCause::DecodeUnavailable => "decode_unavailable",
        }
    }
}

/// How the request is being served (the `x-cortex-pd` header).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// A prefill and a decode worker.
    Disaggregated,
    /// The decode worker alone, by choice: it lacks so little of the prompt (at most
    /// [`PdConfig::decode_only_max_uncached`] tokens) that prefilling it there beats a prefill
    /// leg and a transfer.
    DecodeOnly,
    /// One worker, with a cold prefill.
    FallbackSingle(FallbackCause),
}

impl Mode {
    /// The `x-cortex-pd` header value.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Mode::Disaggregated => "disaggregated",
            Mode::DecodeOnly => "decode_only",
            Mode::FallbackSingle(_) => "fallback_single",
        }
    }
}

/// How the request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The client got a whole answer.
    Served {
        /// How.
        mode: Mode,
        /// Dispatches made.
        attempts: u32,
    },
    /// The client left; every leg was cancelled.
    ClientGone {
        /// Dispatches made.
        attempts: u32,
    },
    /// The request failed; `error` says who is to blame.
    Failed {
        /// Why.
        error: PdError,
        /// Dispatches made.
        attempts: u32,
    },
}

/// What the driver must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Send a pair. SGLang (`room` is `Some`): both legs now, with the bootstrap fields of
    /// `pair.prefill` and `room` ([`crate::sglang`]). vLLM (`room` is `None`): the prefill leg
    /// ([`crate::vllm::prefill_body`]); the decode leg follows with [`Effect::SendDecode`].
    Dispatch {
        /// The dispatch number (1-based), for the leg events.
        attempt: u32,
        /// Where.
        pair: Pair,
        /// SGLang's bootstrap room.
        room: Option<Room>,
    },
    /// vLLM: send the decode leg of `attempt` — with the prefill's `kv_transfer_params`
    /// ([`Transfer::Ready`]) or the client's body as it came ([`Transfer::Missing`]).
    SendDecode {
        /// The dispatch.
        attempt: u32,
        /// Where.
        decode: HolderId,
        /// With or without the prefill's parameters.
        transfer: Transfer,
    },
    /// Send the client's body as it came to one worker (`leg` is [`Leg::Regular`] or
    /// [`Leg::DecodeLocal`]).
    SendSingle {
        /// The dispatch.
        attempt: u32,
        /// Which kind of worker.
        leg: Leg,
        /// Where.
        holder: HolderId,
    },
    /// Abort this leg of the current dispatch now (drop its connection).
    Cancel(Leg),
    /// Record a failure on the holder's booking (cooldown, breaker).
    Blame {
        /// The holder.
        holder: HolderId,
        /// The class.
        class: FailureClass,
    },
    /// Forward `leg`'s response head and the events held so far: the client's first byte. The
    /// booking's first token.
    Commit(Leg),
    /// The request is over; nothing more will be emitted.
    Finish(Outcome),
}

/// A leg's progress in the current dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LegState {
    Unsent,
    Sent,
    Answered,
    Done,
    Failed,
}

impl LegState {
    const fn pending(self) -> bool {
        matches!(self, LegState::Sent | LegState::Answered)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    /// A pair is in flight.
    Pair,
    /// A single-worker fallback is in flight.
    Single(Leg, HolderId),
    /// The client has its first byte from this leg.
    Streaming(Leg, HolderId),
    Finished,
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One disaggregated request. See the crate docs for the table of its transitions.
#[derive(Clone, Debug)]
pub struct PdRequest {
    protocol: Protocol,
    config: PdConfig,
    replay: Replay,
    logprob: bool,
    rng: u64,
    start: Option<Timestamp>,
    attempts: u32,
    phase: Phase,
    pair: Option<Pair>,
    room: Option<Room>,
    mode: Mode,
    /// The prefill leg of the current pair.
    p: LegState,
    /// The leg whose answer the client gets: the pair's decode leg, or the single worker's.
    d: LegState,
    /// The decode leg's first output came while the prefill's answer (needed to merge logprobs)
    /// was still pending.
    output_held: bool,
    /// Some leg of some dispatch may have reached an engine.
    reached: bool,
    /// Holders that failed in this request: never chosen again for it.
    failed: Vec<HolderId>,
    /// The last failure before the first byte, for the error if no dispatch is left.
    last: Option<(Leg, FailureClass)>,
}

impl PdRequest {
    /// A request of `protocol` under `config`. `replay` is the rule for this request
    /// ([`Replay::for_request`]); `logprob` says the client asked SGLang for `return_logprob`, so
    /// the prefill's `input_token_logprobs` must be merged into the decode's answer (the first
    /// byte then waits for the prefill's answer too; ignored for vLLM); `seed` draws the
    /// bootstrap rooms.
    #[must_use]
    pub fn new(protocol: Protocol, config: PdConfig, replay: Replay, logprob: bool, seed: u64) -> Self {
        PdRequest {
            protocol,
            config,
            replay,
            logprob: logprob && protocol == Protocol::Sglang,
            rng: seed,
            start: None,
            attempts: 0,
            phase: Phase::Idle,
            pair: None,
            room: None,
            mode: Mode::Disaggregated,
            p: LegState::Unsent,
            d: LegState::Unsent,
            output_held: false,
            reached: false,
            failed: Vec::new(),
            last: None,
        }
    }

    /// How the request is being served (meaningful from the first dispatch on).
    #[must_use]
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The pair of the current (or last) pair dispatch.
    #[must_use]
    pub fn pair(&self) -> Option<Pair> {
        self.pair
    }

    /// The current dispatch's bootstrap room (SGLang).
    #[must_use]
    pub fn room(&self) -> Option<Room> {
        self.room
    }

    /// Dispatches made so far.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The leg and holder whose answer the client gets (or will get): the decode leg of the
    /// current pair, or the single worker.
    #[must_use]
    pub fn serving(&self) -> Option<(Leg, HolderId)> {
        match self.phase {
            Phase::Single(leg, h) | Phase::Streaming(leg, h) => Some((leg, h)),
            Phase::Pair => self.pair.map(|p| (Leg::Decode, p.decode)),
            Phase::Idle | Phase::Finished => None,
        }
    }

    /// Whether the request is over.
    #[must_use]
    pub fn finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// Whether the client has its first byte (no replay from here on).
    #[must_use]
    pub fn committed(&self) -> bool {
        matches!(self.phase, Phase::Streaming(..))
    }

    fn next_room(&mut self) -> Room {
        self.rng = self.rng.wrapping_add(GOLDEN);
        Room::new(mix(self.rng))
    }

    fn pick(
        &self,
        r: &Ranking,
        pools: &Pools<'_>,
        now: Timestamp,
        prefer: Option<HolderId>,
    ) -> Option<HolderId> {
        let ok = |h: HolderId| !self.failed.contains(&h) && pools.snapshot.admissible(h, now);
        if let Some(h) = prefer
            && ok(h)
            && r.admissible().any(|c| c.holder == h)
        {
            return Some(h);
        }
        r.admissible().map(|c| c.holder).find(|&h| ok(h))
    }

    /// The decode worker that serves the request alone: the decode ranking's first admissible
    /// holder, when it lacks at most [`PdConfig::decode_only_max_uncached`] prompt tokens
    /// (vLLM only: an SGLang decode worker refuses a request without a bootstrap room).
    fn decode_only(&self, now: Timestamp, pools: &Pools<'_>) -> Option<HolderId> {
        let max = self.config.decode_only_max_uncached?;
        if self.protocol != Protocol::Vllm {
            return None;
        }
        let best = self.pick(pools.decode, pools, now, None)?;
        let c = pools.decode.admissible().find(|c| c.holder == best)?;
        (c.prefill_tokens <= max).then_some(best)
    }

    /// The single worker to fall back to: a regular one, else (vLLM only: an SGLang decode
    /// worker needs a bootstrap room) a decode worker prefilling locally.
    fn single_target(&self, now: Timestamp, pools: &Pools<'_>) -> Option<(Leg, HolderId)> {
        if let Some(h) = pools.regular.and_then(|r| self.pick(r, pools, now, None)) {
            return Some((Leg::Regular, h));
        }
        match self.protocol {
            Protocol::Vllm => self.pick(pools.decode, pools, now, None).map(|h| (Leg::DecodeLocal, h)),
            Protocol::Sglang => None,
        }
    }

    /// Feeds one input at `now`; the effects to execute are appended to `out` in order.
    pub fn step(&mut self, now: Timestamp, input: Input, pools: &Pools<'_>, out: &mut Vec<Effect>) {
        match (self.phase, input) {
            (Phase::Finished, _) => {}
            (Phase::Idle, Input::Start) => {
                self.start = Some(now);
                match self.decode_only(now, pools) {
                    Some(holder) => {
                        self.attempts += 1;
                        self.mode = Mode::DecodeOnly;
                        self.phase = Phase::Single(Leg::DecodeLocal, holder);
                        self.d = LegState::Sent;
                        out.push(Effect::SendSingle {
                            attempt: self.attempts,
                            leg: Leg::DecodeLocal,
                            holder,
                        });
                    }
                    None => self.dispatch_pair(now, pools, None, out),
                }
            }
            (_, Input::Start) => {}
            (_, Input::ClientGone) => {
                self.cancel_pending(out);
                self.finish(Outcome::ClientGone { attempts: self.attempts }, out);
            }
            (phase, Input::Leg { attempt, leg, event }) if attempt == self.attempts => {
                if !matches!(event, LegEvent::Failed(LegFailure { reached: Reached::No, .. })) {
                    self.reached = true;
                }
                match phase {
                    Phase::Pair => self.pair_event(now, leg, event, pools, out),
                    Phase::Single(l, h) if l == leg => self.single_event(now, leg, h, event, pools, out),
                    Phase::Streaming(l, h) => self.streaming_event(l, h, leg, event, out),
                    _ => {}
                }
            }
            (_, Input::Leg { .. }) => {} // a late event of an abandoned dispatch
        }
    }

    fn finish(&mut self, outcome: Outcome, out: &mut Vec<Effect>) {
        self.phase = Phase::Finished;
        out.push(Effect::Finish(outcome));
    }

    fn fail(&mut self, error: PdError, out: &mut Vec<Effect>) {
        self.cancel_pending(out);
        self.finish(Outcome::Failed { error, attempts: self.attempts }, out);
    }

    fn cancel_pending(&mut self, out: &mut Vec<Effect>) {
        if self.p.pending() {
            self.p = LegState::Failed;
            out.push(Effect::Cancel(Leg::Prefill));
        }
        if self.d.pending()
            && let Some((leg, _)) = self.serving()
        {
            self.d = LegState::Failed;
            out.push(Effect::Cancel(leg));
        }
    }

    /// Dispatches a new pair, preferring `keep`'s holders (the leg that did not fail); without
    /// an admissible prefill (or decode) worker, falls back to a single worker.
    fn dispatch_pair(
        &mut self,
        now: Timestamp,
        pools: &Pools<'_>,
        keep: Option<Pair>,
        out: &mut Vec<Effect>,
    ) {
        let p = self.pick(pools.prefill, pools, now, keep.map(|k| k.prefill));
        let d = self.pick(pools.decode, pools, now, keep.map(|k| k.decode));
        let (Some(prefill), Some(decode)) = (p, d) else {
            let (cause, none) = if p.is_none() {
                (FallbackCause::PrefillUnavailable, PdError::NoPrefill)
            } else {
                (FallbackCause::DecodeUnavailable, PdError::NoDecode)
            };
            return match self.single_target(now, pools) {
                Some((leg, holder)) => self.dispatch_single(leg, holder, cause, out),
                None => {
                    let error = self.exhausted().unwrap_or(none);
                    self.fail(error, out)
                }
            };
        };
        self.attempts += 1;
        let pair = Pair { prefill, decode };
        self.pair = Some(pair);
        self.mode = Mode::Disaggregated;
        self.output_held = false;
        self.phase = Phase::Pair;
        self.p = LegState::Sent;
        self.room = match self.protocol {
            Protocol::Sglang => {
                self.d = LegState::Sent;
                Some(self.next_room())
            }
            Protocol::Vllm => {
                self.d = LegState::Unsent;
                None
            }
        };
        out.push(Effect::Dispatch { attempt: self.attempts, pair, room: self.room });
    }

    fn dispatch_single(&mut self, leg: Leg, holder: HolderId, cause: FallbackCause, out: &mut Vec<Effect>) {
        self.attempts += 1;
        self.mode = Mode::FallbackSingle(cause);
        self.phase = Phase::Single(leg, holder);
        self.room = None;
        self.p = LegState::Unsent;
        self.d = LegState::Sent;
        out.push(Effect::SendSingle { attempt: self.attempts, leg, holder });
    }

    fn exhausted(&self) -> Option<PdError> {
        self.last.map(|(leg, class)| PdError::Exhausted { leg, class, attempts: self.attempts })
    }

    /// After `leg` failed before the first byte (its legs already cancelled): whether another
    /// dispatch may follow. If not, the request is finished with the right error.
    fn may_retry(&mut self, now: Timestamp, leg: Leg, f: LegFailure, out: &mut Vec<Effect>) -> bool {
        self.last = Some((leg, f.class));
        let within = self.start.is_none_or(|s| now.saturating_since(s) < self.config.budget);
        let error = if is_request_problem(f.class) {
            // Any worker would refuse it the same way.
            PdError::Exhausted { leg, class: f.class, attempts: self.attempts }
        } else if self.replay == Replay::Never && self.reached {
            PdError::NotReplayed { leg, class: f.class }
        } else if self.attempts >= self.config.max_attempts || !within {
            PdError::Exhausted { leg, class: f.class, attempts: self.attempts }
        } else {
            return true;
        };
        self.fail(error, out);
        false
    }

    fn pair_event(
        &mut self,
        now: Timestamp,
        leg: Leg,
        event: LegEvent,
        pools: &Pools<'_>,
        out: &mut Vec<Effect>,
    ) {
        let Some(pair) = self.pair else { return };
        match (leg, event) {
            (Leg::Prefill, LegEvent::Answered) if self.p == LegState::Sent => self.p = LegState::Answered,
            (Leg::Decode, LegEvent::Answered) if self.d == LegState::Sent => self.d = LegState::Answered,
            (Leg::Prefill, LegEvent::PrefillDone(t)) if self.p.pending() => {
                self.p = LegState::Done;
                match self.protocol {
                    Protocol::Vllm => {
                        if t == Transfer::Missing {
                            self.mode = Mode::FallbackSingle(FallbackCause::NoTransferParams);
                        }
                        self.d = LegState::Sent;
                        out.push(Effect::SendDecode {
                            attempt: self.attempts,
                            decode: pair.decode,
                            transfer: t,
                        });
                    }
                    Protocol::Sglang if self.output_held => {
                        self.commit(Leg::Decode, pair.decode, out);
                        if self.d == LegState::Done {
                            self.served(out);
                        }
                    }
                    Protocol::Sglang => {}
                }
            }
            (Leg::Decode, LegEvent::FirstOutput) if self.d.pending() => {
                if self.logprob && self.p != LegState::Done {
                    self.output_held = true;
                } else {
                    self.commit(Leg::Decode, pair.decode, out);
                }
            }
            // A held answer (waiting for the prefill's logprobs) is complete.
            (Leg::Decode, LegEvent::Done) if self.output_held => self.d = LegState::Done,
            // An answer that ended without any output event (an empty stream): it is the answer.
            (Leg::Decode, LegEvent::Done) if self.d.pending() => {
                self.commit(Leg::Decode, pair.decode, out);
                self.served(out);
            }
            (Leg::Prefill, LegEvent::Failed(f)) if self.p.pending() => {
                self.p = LegState::Failed;
                out.push(Effect::Blame { holder: pair.prefill, class: f.class });
                if self.d.pending() {
                    // Sent at the same time (SGLang): it may be running on its engine.
                    self.reached = true;
                    self.d = LegState::Failed;
                    out.push(Effect::Cancel(Leg::Decode));
                }
                if self.may_retry(now, Leg::Prefill, f, out) {
                    self.failed.push(pair.prefill);
                    self.dispatch_pair(now, pools, Some(pair), out);
                }
            }
            (Leg::Decode, LegEvent::Failed(_) | LegEvent::Broken(_)) if self.d.pending() => {
                let f = match event {
                    LegEvent::Failed(f) => f,
                    LegEvent::Broken(class) => LegFailure::sent(class),
                    _ => return,
                };
                self.d = LegState::Failed;
                self.output_held = false;
                out.push(Effect::Blame { holder: pair.decode, class: f.class });
                let prefill_done = self.p == LegState::Done;
                // A decode leg failing after its prefill finished failed in the transfer as
                // likely as on its own worker (a KV the prefill worker no longer holds, a
                // bootstrap it no longer answers; vLLM's decode says only "Internal server
                // error"): both ends take the blame, so a prefill worker whose transfers fail is
                // cooled down too instead of taking every decode worker down with it. Not for a
                // decode worker's own refusal to admit (a rate limit, a quota): that is its word
                // on itself, and its `Retry-After` is its own.
                let transfer_may_have_failed =
                    matches!(f.class, FailureClass::ServerError | FailureClass::Timeout);
                if prefill_done && transfer_may_have_failed {
                    out.push(Effect::Blame { holder: pair.prefill, class: f.class });
                }
                if self.p.pending() {
                    // Still running on its engine, for all the decode leg's failure says.
                    self.reached = true;
                    self.p = LegState::Failed;
                    out.push(Effect::Cancel(Leg::Prefill));
                }
                if !self.may_retry(now, Leg::Decode, f, out) {
                    return;
                }
                self.failed.push(pair.decode);
                let single = match self.config.transfer_failure {
                    TransferFailure::SingleWorker if prefill_done => self.single_target(now, pools),
                    _ => None,
                };
                match single {
                    Some((leg, holder)) => {
                        self.dispatch_single(leg, holder, FallbackCause::TransferFailed, out)
                    }
                    None => self.dispatch_pair(now, pools, Some(pair), out),
                }
            }
            _ => {}
        }
    }

    fn single_event(
        &mut self,
        now: Timestamp,
        leg: Leg,
        holder: HolderId,
        event: LegEvent,
        pools: &Pools<'_>,
        out: &mut Vec<Effect>,
    ) {
        match event {
            LegEvent::FirstOutput => self.commit(leg, holder, out),
            LegEvent::Done => {
                self.commit(leg, holder, out);
                self.served(out);
            }
            LegEvent::Failed(_) | LegEvent::Broken(_) => {
                let f = match event {
                    LegEvent::Failed(f) => f,
                    LegEvent::Broken(class) => LegFailure::sent(class),
                    _ => return,
                };
                self.d = LegState::Failed;
                out.push(Effect::Blame { holder, class: f.class });
                if !self.may_retry(now, leg, f, out) {
                    return;
                }
                self.failed.push(holder);
                let cause = match self.mode {
                    Mode::FallbackSingle(cause) => cause,
                    // The decode worker alone failed: disaggregate after all.
                    Mode::DecodeOnly => return self.dispatch_pair(now, pools, None, out),
                    Mode::Disaggregated => return,
                };
                match self.single_target(now, pools) {
                    Some((leg, holder)) => self.dispatch_single(leg, holder, cause, out),
                    None => {
                        let error = self.exhausted().unwrap_or(PdError::NoDecode);
                        self.fail(error, out);
                    }
                }
            }
            LegEvent::Answered | LegEvent::PrefillDone(_) => {}
        }
    }

    fn streaming_event(
        &mut self,
        served: Leg,
        holder: HolderId,
        leg: Leg,
        event: LegEvent,
        out: &mut Vec<Effect>,
    ) {
        if leg == Leg::Prefill {
            // The KV has moved: the prefill's answer no longer matters to the client.
            match event {
                LegEvent::PrefillDone(_) if self.p.pending() => self.p = LegState::Done,
                LegEvent::Failed(_) | LegEvent::Broken(_) if self.p.pending() => self.p = LegState::Failed,
                _ => {}
            }
            return;
        }
        if leg != served {
            return;
        }
        match event {
            LegEvent::Done => self.served(out),
            LegEvent::Broken(class) | LegEvent::Failed(LegFailure { class, .. }) => {
                self.d = LegState::Failed;
                out.push(Effect::Blame { holder, class });
                self.fail(PdError::MidStream { leg, class }, out);
            }
            LegEvent::Answered | LegEvent::FirstOutput | LegEvent::PrefillDone(_) => {}
        }
    }

    fn commit(&mut self, leg: Leg, holder: HolderId, out: &mut Vec<Effect>) {
        self.phase = Phase::Streaming(leg, holder);
        self.output_held = false;
        out.push(Effect::Commit(leg));
    }

    /// The answer is complete: a prefill leg still running is cancelled (its KV has moved).
    fn served(&mut self, out: &mut Vec<Effect>) {
        if self.p.pending() {
            self.p = LegState::Failed;
            out.push(Effect::Cancel(Leg::Prefill));
        }
        self.d = LegState::Done;
        self.finish(Outcome::Served { mode: self.mode, attempts: self.attempts }, out);
    }
}
