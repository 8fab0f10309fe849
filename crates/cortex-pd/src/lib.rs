//! `cortex-pd`: prefill/decode disaggregation for SGLang and vLLM, as pure state machines and
//! body edits. No sockets, no async, no HTTP types: the proxy's driver sends what the machine
//! says, reports what the legs did, and splices bodies with the functions here.
//!
//! # Key decisions
//!
//! - **Effects returned, not performed** ([`PdRequest::step`], like `cortex-ingest`'s sequencer):
//!   every transition is a unit test on virtual time, and the driver stays thin.
//! - **The scheduler chooses, the machine picks** ([`Pools`]): the driver decides the prefill and
//!   decode pools once per request (`cortex_sched::Scheduler::decide` with `Role::Prefill` and
//!   `Role::Decode`, each under its own policy, plus `Role::Regular` for the fallback) into
//!   buffers it owns; the machine takes the first admissible candidate of each that has not
//!   failed in this request.
//! - **Bodies are the client's bytes** ([`json`]): each leg's body is the client's with a few
//!   top-level members spliced in or removed; nothing else is re-serialized.
//! - **The first byte is the decode leg's first output** ([`stream`]): both engines answer `200`
//!   before they know whether the KV arrived, so the head is held until an output event is seen;
//!   until then every failure is retried or fallen back from.
//! - **No allocation on the happy path** that the request path cares about: the machine is a few
//!   words, its effects go into the caller's buffer, bodies into the caller's `Vec`; only failure
//!   paths remember the holders that failed.
//!
//! # The driver's loop
//!
//! ```text
//! let replay = config.replay.for_request(headers.get(NO_REPLAY_HEADER));
//! let logprob = protocol == Sglang && route == Generate && sglang::wants_logprobs(&body)?;
//! let mut m = PdRequest::new(protocol, config, replay, logprob, random_seed);
//! m.step(now, Input::Start, &pools, &mut effects);
//! loop: for each effect, in order:
//!   Dispatch { attempt, pair, room: Some(room) }  (SGLang)
//!       → sglang::leg_body(&body, SglangLeg::Prefill / Decode, &Bootstrap { host, port, room,
//!         prefill_rank, decode_rank }, &mut buf); send both legs at once; book both holders
//!   Dispatch { attempt, pair, room: None }        (vLLM)
//!       → vllm::prefill_body(&body, &mut buf); send it to pair.prefill; book both holders
//!   SendDecode { attempt, decode, transfer }      (vLLM, after PrefillDone)
//!       → vllm::decode_body(&body, vllm::transfer_params(&prefill_answer)?, prefill_host, &mut buf)
//!   SendSingle { attempt, leg, holder }           → the client's body as it came
//!   Cancel(leg)        → drop that leg's upstream now
//!   Blame { holder, class } → that holder's booking.fail(class, now)
//!   Commit(leg)        → forward leg's head + the held events (merged with the prefill's
//!                        logprobs via sglang::merge_logprobs when asked): the first byte
//!   Finish(outcome)    → headers/metrics from outcome, m.mode(), m.pair(); stop
//! and report, with the dispatch number each leg belongs to:
//!   2xx head → LegEvent::Answered; failure before output → LegEvent::Failed(LegFailure)
//!   (non-2xx, transport error, timeout, or stream::event_verdict / body_verdict = Error);
//!   prefill answer complete → LegEvent::PrefillDone(Transfer::Ready / Missing);
//!   the stream pushed into a stream::Hold until its verdict is Output (→ LegEvent::FirstOutput,
//!   then forward hold.take() and the rest unparsed) or Error (→ LegEvent::Failed); a
//!   non-streaming body judged whole with stream::body_verdict;
//!   end → LegEvent::Done; break after commit → LegEvent::Broken(class); client gone →
//!   Input::ClientGone.
//! ```
//!
//! # Failure rules (the request-lifecycle section)
//!
//! Phases of a disaggregated request: **choose** (the pair from the rankings) → **dispatch**
//! (SGLang: both legs at once with one bootstrap room; vLLM: the prefill leg, then on its answer
//! the decode leg) → **hold** (the decode leg's head and preamble, until its first output; with
//! SGLang `return_logprob`, also until the prefill's answer) → **commit** (the client's first
//! byte; from here on nothing is replayed) → **stream** → **finish** (a prefill leg still running
//! is cancelled: its KV has moved).
//!
//! | when | event | action |
//! |---|---|---|
//! | start | vLLM, `decode_only_max_uncached` set, and the best decode worker lacks at most that many prompt tokens | that decode worker alone, prefilling locally (`decode_only`) |
//! | before commit | the `decode_only` worker fails | blame it; disaggregate after all (a new pair, another decode worker) |
//! | start | no admissible prefill (or decode) worker | single-worker fallback (`fallback_single`, `prefill_unavailable` / `decode_unavailable`); none at all → `NoPrefill` / `NoDecode` (blame gateway) |
//! | before commit | prefill leg fails | cancel the decode leg at once (an SGLang survivor would wait out its bootstrap timeout), blame the prefill, new pair (another prefill, the same decode if still admissible) with a new room |
//! | before commit | decode leg fails while the prefill is still running | cancel the prefill, blame the decode, new pair (the same prefill if admissible, another decode) with a new room |
//! | before commit | decode leg fails after the prefill succeeded (bootstrap, KV transfer, the decode worker itself; vLLM: an error event or `500` where the output should be) | blame both (the cause cannot be told apart); default `transfer_failure: single_worker`: one worker with a cold prefill — a regular worker, else (vLLM) a decode worker prefilling locally; SGLang without a regular worker: a new pair. `rechoose_decode`: a new pair with the same prefill |
//! | before commit | vLLM prefill answers without `kv_transfer_params` | the decode leg gets the client's body and prefills locally (`fallback_single`, `no_transfer_params`) |
//! | before commit | the single-worker fallback fails | blame it, the next single worker |
//! | before commit | any failure, and the request must not run twice (`replay: never`, or the client's `x-cortex-no-replay: 1`) and some leg may have reached an engine | the upstream failure, unreplayed (`NotReplayed`, blame the leg); a refused connection reached nothing and is retried |
//! | before commit | any failure that is the request's (context length, content policy) | that error at once (blame client): no worker would answer differently |
//! | before commit | `max_attempts` dispatches made, or the `budget` spent | the last failure (`Exhausted`, blame its leg) |
//! | after commit | the served leg breaks | blame it, cancel the prefill if running, `MidStream` (the proxy ends the SSE stream with an error event); never replayed |
//! | after commit | the prefill leg fails or finishes | nothing: its KV has moved |
//! | any time | the client leaves | cancel every running leg; `ClientGone` (nobody blamed) |
//! | any time | an event of an abandoned dispatch | ignored |
//!
//! Holding the decode leg's head until its first output costs no time to first token: the first
//! token leaves with the head. What it costs is that the head leaves after the KV transfer rather
//! than before it, and one held event per choice (a chat stream's role preamble).

#![forbid(unsafe_code)]

pub mod alignment;
pub mod config;
pub mod error;
pub mod json;
pub mod machine;
pub mod sglang;
pub mod stream;
pub mod vllm;

pub use config::{NO_REPLAY_HEADER, PdConfig, PdConfigError, Replay, TransferFailure};
pub use error::{Blame, PdError};
pub use json::JsonError;
pub use machine::{
    Effect, FallbackCause, Input, Leg, LegEvent, LegFailure, Mode, Outcome, Pair, PdRequest, Pools, Protocol,
    Reached, Room, Transfer,
};
pub use stream::{Hold, Verdict};
