//! Every transition of the PD request machine, for both protocols, on virtual time, against real
//! scheduler rankings of a cluster with prefill, decode and (optionally) regular workers.

use std::sync::Arc;
use std::time::Duration;

use cortex_hash::Engine;
use cortex_hash::kv::{HolderId, WorkerId};
use cortex_pd::*;
use cortex_sched::{
    CacheView, Cluster, FailureClass, Health, HealthPolicy, Ranking, Request, Role, SchedConfig, Scheduler,
    Snapshot, Timestamp, Untrusted, WorkerSpec,
};

const MODEL: &str = "m";

fn ms(n: u64) -> Timestamp {
    Timestamp::from_millis(n)
}

/// Prefill workers 0.., decode workers 10.., regular workers 20.., each pool ranked once.
struct World {
    snap: Arc<Snapshot>,
    prefill: Ranking,
    decode: Ranking,
    regular: Option<Ranking>,
}

impl World {
    fn new(engine: Engine, prefill: u32, decode: u32, regular: u32) -> Self {
        Self::with(engine, prefill, decode, regular, &[])
    }

    fn with(engine: Engine, prefill: u32, decode: u32, regular: u32, unhealthy: &[u32]) -> Self {
        let cluster = Cluster::new(HealthPolicy::default());
        for (base, n, role) in
            [(0, prefill, Role::Prefill), (10, decode, Role::Decode), (20, regular, Role::Regular)]
        {
            for i in 0..n {
                let id = base + i;
                let spec = WorkerSpec { role, ..WorkerSpec::new(WorkerId(id), MODEL, engine) };
                let health = if unhealthy.contains(&id) { Health::Unhealthy } else { Health::Healthy };
                cluster.upsert(spec, health);
            }
        }
        let snap = cluster.load();
        let sched = Scheduler::new(SchedConfig::default()).expect("config");
        let rank = |role| {
            let mut r = Ranking::with_capacity(8);
            let req = Request::new(MODEL, role, ms(0), 100, CacheView::Untrusted(Untrusted::ExactRoutingOff));
            let _ = sched.decide(&snap, &req, &mut r);
            r
        };
        let (prefill, decode) = (rank(Role::Prefill), rank(Role::Decode));
        let regular = (regular > 0).then(|| rank(Role::Regular));
        World { snap, prefill, decode, regular }
    }

    fn pools(&self) -> Pools<'_> {
        Pools {
            prefill: &self.prefill,
            decode: &self.decode,
            regular: self.regular.as_ref(),
            snapshot: &self.snap,
        }
    }

    fn order(r: &Ranking) -> Vec<HolderId> {
        r.admissible().map(|c| c.holder).collect()
    }

    fn p(&self, i: usize) -> HolderId {
        Self::order(&self.prefill)[i]
    }

    fn d(&self, i: usize) -> HolderId {
        Self::order(&self.decode)[i]
    }

    fn r(&self, i: usize) -> HolderId {
        Self::order(self.regular.as_ref().expect("regular pool"))[i]
    }
}

struct T {
    w: World,
    m: PdRequest,
}

impl T {
    fn new(w: World, protocol: Protocol, config: PdConfig, replay: Replay, logprob: bool) -> Self {
        T { w, m: PdRequest::new(protocol, config, replay, logprob, 7) }
    }

    fn sglang(w: World) -> Self {
        Self::new(w, Protocol::Sglang, PdConfig::default(), Replay::Allowed, false)
    }

    fn vllm(w: World) -> Self {
        Self::new(w, Protocol::Vllm, PdConfig::default(), Replay::Allowed, false)
    }

    fn at(&mut self, now: u64, input: Input) -> Vec<Effect> {
        let mut out = Vec::new();
        self.m.step(ms(now), input, &self.w.pools(), &mut out);
        out
    }

    fn go(&mut self, input: Input) -> Vec<Effect> {
        self.at(1, input)
    }

    fn ev(&mut self, attempt: u32, leg: Leg, event: LegEvent) -> Vec<Effect> {
        self.go(Input::Leg { attempt, leg, event })
    }
}

fn fail(class: FailureClass) -> LegEvent {
    LegEvent::Failed(LegFailure::sent(class))
}

fn dispatched(effects: &[Effect]) -> (u32, Pair, Option<Room>) {
    effects
        .iter()
        .find_map(|e| match *e {
            Effect::Dispatch { attempt, pair, room } => Some((attempt, pair, room)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no dispatch in {effects:?}"))
}

fn served(mode: Mode, attempts: u32) -> Effect {
    Effect::Finish(Outcome::Served { mode, attempts })
}

const TRANSFER_FAILED: Mode = Mode::FallbackSingle(FallbackCause::TransferFailed);

#[test]
fn sglang_happy_path_streams_the_decode_leg_and_drains_the_prefill() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 2, 0));
    let e = t.go(Input::Start);
    let (attempt, pair, room) = dispatched(&e);
    assert_eq!(e.len(), 1);
    assert_eq!((attempt, pair), (1, Pair { prefill: t.w.p(0), decode: t.w.d(0) }));
    assert!(room.is_some_and(|r| r.get() <= Room::MAX));
    assert_eq!(t.m.room(), room);
    assert_eq!(t.m.serving(), Some((Leg::Decode, t.w.d(0))));
    assert!(t.ev(1, Leg::Prefill, LegEvent::Answered).is_empty());
    assert!(t.ev(1, Leg::Decode, LegEvent::Answered).is_empty(), "the decode head is held");
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::FirstOutput), vec![Effect::Commit(Leg::Decode)]);
    assert!(t.m.committed());
    assert!(t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready)).is_empty());
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::Done), vec![served(Mode::Disaggregated, 1)]);
    assert!(t.m.finished());
    assert!(t.ev(1, Leg::Decode, LegEvent::Done).is_empty(), "nothing after the finish");
    assert!(t.go(Input::ClientGone).is_empty());
}

#[test]
fn the_answer_ending_first_cancels_a_prefill_still_running() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 0));
    t.go(Input::Start);
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    assert_eq!(
        t.ev(1, Leg::Decode, LegEvent::Done),
        vec![Effect::Cancel(Leg::Prefill), served(Mode::Disaggregated, 1)]
    );
}

#[test]
fn a_second_start_is_ignored() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 0));
    t.go(Input::Start);
    assert!(t.go(Input::Start).is_empty());
    assert_eq!(t.m.attempts(), 1);
}

#[test]
fn a_failed_prefill_cancels_the_decode_at_once_and_a_new_pair_gets_a_new_room() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 2, 0));
    let (_, first, room1) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Decode, LegEvent::Answered);
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    assert_eq!(e[0], Effect::Blame { holder: first.prefill, class: FailureClass::ServerError });
    assert_eq!(e[1], Effect::Cancel(Leg::Decode));
    let (attempt, pair, room2) = dispatched(&e);
    assert_eq!(attempt, 2);
    assert_eq!(pair, Pair { prefill: t.w.p(1), decode: first.decode }, "the decode worker is kept");
    assert_ne!(room1, room2);
    // The abandoned dispatch's late events change nothing.
    assert!(t.ev(1, Leg::Decode, LegEvent::FirstOutput).is_empty());
    assert!(!t.m.committed());
    assert_eq!(t.ev(2, Leg::Decode, LegEvent::FirstOutput), vec![Effect::Commit(Leg::Decode)]);
}

#[test]
fn a_decode_failing_while_the_prefill_runs_cancels_it_and_keeps_the_prefill_worker() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 2, 1));
    let (_, first, _) = dispatched(&t.go(Input::Start));
    let e = t.ev(1, Leg::Decode, fail(FailureClass::Timeout));
    assert_eq!(e[0], Effect::Blame { holder: first.decode, class: FailureClass::Timeout });
    assert_eq!(e[1], Effect::Cancel(Leg::Prefill));
    let (_, pair, _) = dispatched(&e);
    assert_eq!(pair, Pair { prefill: first.prefill, decode: t.w.d(1) });
    assert_eq!(t.m.mode(), Mode::Disaggregated, "not a transfer failure: the prefill never finished");
}

#[test]
fn a_decode_failing_after_the_prefill_succeeded_falls_back_to_a_regular_worker() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 2, 2));
    let (_, pair, _) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let e = t.ev(1, Leg::Decode, fail(FailureClass::ServerError));
    let regular = t.w.r(0);
    assert_eq!(
        e,
        vec![
            Effect::Blame { holder: pair.decode, class: FailureClass::ServerError },
            Effect::Blame { holder: pair.prefill, class: FailureClass::ServerError },
            Effect::SendSingle { attempt: 2, leg: Leg::Regular, holder: regular },
        ]
    );
    assert_eq!(t.m.mode(), TRANSFER_FAILED);
    assert_eq!(t.m.mode().as_str(), "fallback_single");
    assert_eq!(t.m.serving(), Some((Leg::Regular, regular)));
    assert!(t.ev(2, Leg::Regular, LegEvent::Answered).is_empty());
    assert_eq!(t.ev(2, Leg::Regular, LegEvent::FirstOutput), vec![Effect::Commit(Leg::Regular)]);
    assert_eq!(t.ev(2, Leg::Regular, LegEvent::Done), vec![served(TRANSFER_FAILED, 2)]);
}

/// A decode worker that refuses to admit the request (a rate limit, a quota) after the prefill
/// finished said so about itself: the prefill worker is not blamed (it would be cooled down
/// for the decode worker's `Retry-After`).
#[test]
fn a_decode_worker_s_rate_limit_blames_only_the_decode_worker() {
    for class in [FailureClass::RateLimited, FailureClass::QuotaExhausted] {
        let mut t = T::sglang(World::new(Engine::Sglang, 1, 2, 2));
        let (_, pair, _) = dispatched(&t.go(Input::Start));
        t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
        let e = t.ev(1, Leg::Decode, fail(class));
        assert_eq!(e[0], Effect::Blame { holder: pair.decode, class }, "{e:?}");
        assert!(!e.contains(&Effect::Blame { holder: pair.prefill, class }), "{class:?}: {e:?}");
    }
}

#[test]
fn sglang_without_a_regular_worker_rechooses_the_decode_after_a_transfer_failure() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 2, 0));
    let (_, first, _) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let (_, pair, _) = dispatched(&t.ev(1, Leg::Decode, fail(FailureClass::ServerError)));
    assert_eq!(pair, Pair { prefill: first.prefill, decode: t.w.d(1) });
}

#[test]
fn rechoose_decode_is_a_setting() {
    let config = PdConfig { transfer_failure: TransferFailure::RechooseDecode, ..PdConfig::default() };
    let mut t = T::new(World::new(Engine::Sglang, 1, 2, 1), Protocol::Sglang, config, Replay::Allowed, false);
    let (_, first, _) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let (_, pair, _) = dispatched(&t.ev(1, Leg::Decode, fail(FailureClass::ServerError)));
    assert_eq!(
        pair,
        Pair { prefill: first.prefill, decode: t.w.d(1) },
        "a regular worker exists but is not used"
    );
}

#[test]
fn logprobs_hold_the_first_byte_for_the_prefill_answer() {
    let w = World::new(Engine::Sglang, 1, 1, 0);
    let mut t = T::new(w, Protocol::Sglang, PdConfig::default(), Replay::Allowed, true);
    t.go(Input::Start);
    assert!(t.ev(1, Leg::Decode, LegEvent::FirstOutput).is_empty(), "held for the prefill's logprobs");
    assert_eq!(
        t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready)),
        vec![Effect::Commit(Leg::Decode)]
    );
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::Done), vec![served(Mode::Disaggregated, 1)]);
    // Non-streaming: the whole answer is held; the prefill's answer commits and finishes.
    let w = World::new(Engine::Sglang, 1, 1, 0);
    let mut t = T::new(w, Protocol::Sglang, PdConfig::default(), Replay::Allowed, true);
    t.go(Input::Start);
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    assert!(t.ev(1, Leg::Decode, LegEvent::Done).is_empty());
    assert_eq!(
        t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready)),
        vec![Effect::Commit(Leg::Decode), served(Mode::Disaggregated, 1)]
    );
    // The prefill failing while the answer is held is a failure before the first byte.
    let w = World::new(Engine::Sglang, 2, 1, 0);
    let mut t = T::new(w, Protocol::Sglang, PdConfig::default(), Replay::Allowed, true);
    t.go(Input::Start);
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    assert!(e.contains(&Effect::Cancel(Leg::Decode)));
    assert_eq!(dispatched(&e).0, 2);
}

#[test]
fn logprobs_never_hold_vllm() {
    let mut t =
        T::new(World::new(Engine::Vllm, 1, 1, 0), Protocol::Vllm, PdConfig::default(), Replay::Allowed, true);
    t.go(Input::Start);
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::FirstOutput), vec![Effect::Commit(Leg::Decode)]);
}

#[test]
fn a_request_that_must_not_run_twice_gets_the_upstream_failure() {
    let w = World::new(Engine::Sglang, 2, 2, 1);
    let mut t = T::new(w, Protocol::Sglang, PdConfig::default(), Replay::Never, false);
    let (_, pair, _) = dispatched(&t.go(Input::Start));
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    let error = PdError::NotReplayed { leg: Leg::Prefill, class: FailureClass::ServerError };
    assert_eq!(
        e,
        vec![
            Effect::Blame { holder: pair.prefill, class: FailureClass::ServerError },
            Effect::Cancel(Leg::Decode),
            Effect::Finish(Outcome::Failed { error, attempts: 1 }),
        ]
    );
    assert_eq!((error.blame(), error.retry_safe()), (Blame::Prefill, false));
    // A refused connection reached nothing: still retried.
    let w = World::new(Engine::Vllm, 2, 1, 0);
    let mut t = T::new(w, Protocol::Vllm, PdConfig::default(), Replay::Never, false);
    t.go(Input::Start);
    let e = t.ev(1, Leg::Prefill, LegEvent::Failed(LegFailure::refused()));
    assert_eq!(dispatched(&e).0, 2);
    // Once something reached an engine, even a refused connection is not retried.
    t.ev(2, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let e = t.ev(2, Leg::Decode, LegEvent::Failed(LegFailure::refused()));
    assert!(matches!(
        e.last(),
        Some(Effect::Finish(Outcome::Failed { error: PdError::NotReplayed { .. }, .. }))
    ));
    // SGLang sends both legs at once: one leg's refused connection cancels the other, which may
    // already be running on its engine, so the request is not sent again.
    for refused in [Leg::Decode, Leg::Prefill] {
        let w = World::new(Engine::Sglang, 2, 2, 0);
        let mut t = T::new(w, Protocol::Sglang, PdConfig::default(), Replay::Never, false);
        t.go(Input::Start);
        let e = t.ev(1, refused, LegEvent::Failed(LegFailure::refused()));
        assert!(
            matches!(
                e.last(),
                Some(Effect::Finish(Outcome::Failed { error: PdError::NotReplayed { .. }, .. }))
            ),
            "{refused:?}: {e:?}"
        );
        assert_eq!(dispatched_count(&e), 0, "{refused:?}: {e:?}");
    }
}

/// How many pairs `effects` dispatch.
fn dispatched_count(effects: &[Effect]) -> usize {
    effects.iter().filter(|e| matches!(e, Effect::Dispatch { .. })).count()
}

#[test]
fn the_requests_own_problems_are_not_retried() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 2, 0));
    t.go(Input::Start);
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ContextLengthExceeded));
    let Some(Effect::Finish(Outcome::Failed { error, attempts: 1 })) = e.last() else { panic!("{e:?}") };
    assert_eq!(error.blame(), Blame::Client);
    assert!(!error.retry_safe());
}

#[test]
fn the_attempt_and_time_budgets_end_retries() {
    let config = PdConfig { max_attempts: 2, ..PdConfig::default() };
    let mut t = T::new(World::new(Engine::Sglang, 3, 1, 0), Protocol::Sglang, config, Replay::Allowed, false);
    t.go(Input::Start);
    assert_eq!(dispatched(&t.ev(1, Leg::Prefill, fail(FailureClass::ServerError))).0, 2);
    let e = t.ev(2, Leg::Prefill, fail(FailureClass::Timeout));
    let error = PdError::Exhausted { leg: Leg::Prefill, class: FailureClass::Timeout, attempts: 2 };
    assert_eq!(e.last(), Some(&Effect::Finish(Outcome::Failed { error, attempts: 2 })));
    assert_eq!(error.blame(), Blame::Prefill);

    let config = PdConfig { budget: Duration::from_millis(100), ..PdConfig::default() };
    let mut t = T::new(World::new(Engine::Sglang, 3, 1, 0), Protocol::Sglang, config, Replay::Allowed, false);
    t.at(0, Input::Start);
    let e = t.at(100, Input::Leg { attempt: 1, leg: Leg::Prefill, event: fail(FailureClass::ServerError) });
    assert!(matches!(
        e.last(),
        Some(Effect::Finish(Outcome::Failed { error: PdError::Exhausted { .. }, .. }))
    ));
}

#[test]
fn after_the_first_byte_nothing_is_replayed() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 2, 1));
    let (_, pair, _) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    let e = t.ev(1, Leg::Decode, LegEvent::Broken(FailureClass::ServerError));
    let error = PdError::MidStream { leg: Leg::Decode, class: FailureClass::ServerError };
    assert_eq!(
        e,
        vec![
            Effect::Blame { holder: pair.decode, class: FailureClass::ServerError },
            Effect::Cancel(Leg::Prefill),
            Effect::Finish(Outcome::Failed { error, attempts: 1 }),
        ]
    );
    assert_eq!(error.blame(), Blame::Decode);
}

#[test]
fn a_prefill_failing_after_the_first_byte_changes_nothing() {
    let mut t = T::sglang(World::new(Engine::Sglang, 2, 1, 0));
    t.go(Input::Start);
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    assert!(t.ev(1, Leg::Prefill, fail(FailureClass::ServerError)).is_empty());
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::Done), vec![served(Mode::Disaggregated, 1)]);
}

#[test]
fn a_client_that_leaves_cancels_every_running_leg() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 0));
    t.go(Input::Start);
    assert_eq!(
        t.go(Input::ClientGone),
        vec![
            Effect::Cancel(Leg::Prefill),
            Effect::Cancel(Leg::Decode),
            Effect::Finish(Outcome::ClientGone { attempts: 1 })
        ]
    );
    // After the first byte, with the prefill done.
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 0));
    t.go(Input::Start);
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    assert_eq!(
        t.go(Input::ClientGone),
        vec![Effect::Cancel(Leg::Decode), Effect::Finish(Outcome::ClientGone { attempts: 1 })]
    );
    // During a fallback.
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 1));
    t.go(Input::Start);
    assert_eq!(
        t.go(Input::ClientGone),
        vec![Effect::Cancel(Leg::Regular), Effect::Finish(Outcome::ClientGone { attempts: 1 })]
    );
}

#[test]
fn without_prefill_workers_the_request_goes_to_a_single_worker() {
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 1));
    let regular = t.w.r(0);
    assert_eq!(
        t.go(Input::Start),
        vec![Effect::SendSingle { attempt: 1, leg: Leg::Regular, holder: regular }]
    );
    assert_eq!(t.m.mode(), Mode::FallbackSingle(FallbackCause::PrefillUnavailable));
    // Every prefill worker unhealthy is the same.
    let mut t = T::vllm(World::with(Engine::Vllm, 2, 1, 0, &[0, 1]));
    let d = t.w.d(0);
    assert_eq!(t.go(Input::Start), vec![Effect::SendSingle { attempt: 1, leg: Leg::DecodeLocal, holder: d }]);
    // SGLang decode workers cannot prefill: no regular worker, no answer.
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 0));
    assert_eq!(
        t.go(Input::Start),
        vec![Effect::Finish(Outcome::Failed { error: PdError::NoPrefill, attempts: 0 })]
    );
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 0, 0));
    assert_eq!(
        t.go(Input::Start),
        vec![Effect::Finish(Outcome::Failed { error: PdError::NoDecode, attempts: 0 })]
    );
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 0, 1));
    assert!(matches!(t.go(Input::Start)[..], [Effect::SendSingle { leg: Leg::Regular, .. }]));
    assert_eq!(t.m.mode(), Mode::FallbackSingle(FallbackCause::DecodeUnavailable));
}

#[test]
fn when_the_last_prefill_worker_fails_the_fallback_takes_over() {
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 1));
    t.go(Input::Start);
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    assert!(matches!(e.last(), Some(Effect::SendSingle { attempt: 2, leg: Leg::Regular, .. })), "{e:?}");
    assert_eq!(t.m.mode(), Mode::FallbackSingle(FallbackCause::PrefillUnavailable));
    // And with nothing to fall back to, the prefill's failure is the answer.
    let mut t = T::sglang(World::new(Engine::Sglang, 1, 1, 0));
    t.go(Input::Start);
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    let error = PdError::Exhausted { leg: Leg::Prefill, class: FailureClass::ServerError, attempts: 1 };
    assert_eq!(e.last(), Some(&Effect::Finish(Outcome::Failed { error, attempts: 1 })));
}

#[test]
fn single_worker_failures_move_to_the_next_single_worker() {
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 2));
    t.go(Input::Start);
    let (r0, r1) = (t.w.r(0), t.w.r(1));
    let e = t.ev(1, Leg::Regular, fail(FailureClass::RateLimited));
    assert_eq!(
        e,
        vec![
            Effect::Blame { holder: r0, class: FailureClass::RateLimited },
            Effect::SendSingle { attempt: 2, leg: Leg::Regular, holder: r1 },
        ]
    );
    let e = t.ev(2, Leg::Regular, LegEvent::Broken(FailureClass::ServerError));
    let error = PdError::Exhausted { leg: Leg::Regular, class: FailureClass::ServerError, attempts: 2 };
    assert_eq!(e.last(), Some(&Effect::Finish(Outcome::Failed { error, attempts: 2 })));
    assert_eq!(error.blame(), Blame::Regular);
    // A fallback that breaks after its first byte.
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 2));
    t.go(Input::Start);
    t.ev(1, Leg::Regular, LegEvent::FirstOutput);
    let e = t.ev(1, Leg::Regular, LegEvent::Broken(FailureClass::Timeout));
    let error = PdError::MidStream { leg: Leg::Regular, class: FailureClass::Timeout };
    assert_eq!(e.last(), Some(&Effect::Finish(Outcome::Failed { error, attempts: 1 })));
    // A fallback whose answer ends without an output event is served.
    let mut t = T::sglang(World::new(Engine::Sglang, 0, 1, 1));
    t.go(Input::Start);
    let e = t.ev(1, Leg::Regular, LegEvent::Done);
    assert_eq!(
        e,
        vec![
            Effect::Commit(Leg::Regular),
            served(Mode::FallbackSingle(FallbackCause::PrefillUnavailable), 1)
        ]
    );
}

#[test]
fn vllm_happy_path_is_prefill_then_decode() {
    let mut t = T::vllm(World::new(Engine::Vllm, 2, 2, 0));
    let (attempt, pair, room) = dispatched(&t.go(Input::Start));
    assert_eq!((attempt, room), (1, None));
    assert!(t.ev(1, Leg::Prefill, LegEvent::Answered).is_empty());
    assert!(t.ev(1, Leg::Decode, LegEvent::FirstOutput).is_empty(), "no decode leg yet");
    assert_eq!(
        t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready)),
        vec![Effect::SendDecode { attempt: 1, decode: pair.decode, transfer: Transfer::Ready }]
    );
    assert!(t.ev(1, Leg::Decode, LegEvent::Answered).is_empty());
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::FirstOutput), vec![Effect::Commit(Leg::Decode)]);
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::Done), vec![served(Mode::Disaggregated, 1)]);
}

#[test]
fn vllm_without_transfer_params_the_decode_prefills_and_says_so() {
    let mut t = T::vllm(World::new(Engine::Vllm, 1, 1, 0));
    let (_, pair, _) = dispatched(&t.go(Input::Start));
    assert_eq!(
        t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Missing)),
        vec![Effect::SendDecode { attempt: 1, decode: pair.decode, transfer: Transfer::Missing }]
    );
    let mode = Mode::FallbackSingle(FallbackCause::NoTransferParams);
    assert_eq!(t.m.mode(), mode);
    t.ev(1, Leg::Decode, LegEvent::FirstOutput);
    assert_eq!(t.ev(1, Leg::Decode, LegEvent::Done), vec![served(mode, 1)]);
}

#[test]
fn vllm_kv_pull_failure_falls_back_to_a_decode_worker_prefilling_locally() {
    // The decode worker's error event after its role preamble is reported as a failure.
    let mut t = T::vllm(World::new(Engine::Vllm, 1, 2, 0));
    let (_, pair, _) = dispatched(&t.go(Input::Start));
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    t.ev(1, Leg::Decode, LegEvent::Answered);
    let e = t.ev(1, Leg::Decode, fail(FailureClass::ServerError));
    let other = t.w.d(1);
    assert_ne!(other, pair.decode);
    assert_eq!(
        e,
        vec![
            Effect::Blame { holder: pair.decode, class: FailureClass::ServerError },
            Effect::Blame { holder: pair.prefill, class: FailureClass::ServerError },
            Effect::SendSingle { attempt: 2, leg: Leg::DecodeLocal, holder: other },
        ]
    );
    assert_eq!(t.m.serving(), Some((Leg::DecodeLocal, other)));
    assert_eq!(t.ev(2, Leg::DecodeLocal, LegEvent::FirstOutput), vec![Effect::Commit(Leg::DecodeLocal)]);
    assert_eq!(t.ev(2, Leg::DecodeLocal, LegEvent::Done), vec![served(TRANSFER_FAILED, 2)]);
    // With a regular worker, that one serves.
    let mut t = T::vllm(World::new(Engine::Vllm, 1, 2, 1));
    t.go(Input::Start);
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let e = t.ev(1, Leg::Decode, fail(FailureClass::ServerError));
    assert!(matches!(e.last(), Some(Effect::SendSingle { leg: Leg::Regular, .. })));
    // The only decode worker failed and there is no regular one: the failure is the answer.
    let mut t = T::vllm(World::new(Engine::Vllm, 1, 1, 0));
    t.go(Input::Start);
    t.ev(1, Leg::Prefill, LegEvent::PrefillDone(Transfer::Ready));
    let e = t.ev(1, Leg::Decode, fail(FailureClass::ServerError));
    assert!(matches!(
        e.last(),
        Some(Effect::Finish(Outcome::Failed { error: PdError::Exhausted { .. }, .. }))
    ));
}

#[test]
fn vllm_prefill_failures_rechoose_the_prefill() {
    let mut t = T::vllm(World::new(Engine::Vllm, 2, 1, 0));
    let (_, first, _) = dispatched(&t.go(Input::Start));
    let e = t.ev(1, Leg::Prefill, fail(FailureClass::ServerError));
    assert!(!e.contains(&Effect::Cancel(Leg::Decode)), "no decode leg was sent");
    let (_, pair, room) = dispatched(&e);
    assert_eq!((pair.decode, room), (first.decode, None));
    assert_ne!(pair.prefill, first.prefill);
}

#[test]
fn rooms_are_in_range_distinct_and_seeded() {
    let room = |seed| {
        let w = World::new(Engine::Sglang, 1, 1, 0);
        let mut m = PdRequest::new(Protocol::Sglang, PdConfig::default(), Replay::Allowed, false, seed);
        let mut out = Vec::new();
        m.step(ms(0), Input::Start, &w.pools(), &mut out);
        m.room().expect("room")
    };
    assert_eq!(room(1), room(1));
    assert_ne!(room(1), room(2));
    assert_eq!(Room::new(u64::MAX).get(), Room::MAX);
    assert_eq!(Room::new(Room::MAX).item(1).get(), 0);
}

fn decode_only(max: u32) -> PdConfig {
    PdConfig { decode_only_max_uncached: Some(max), ..PdConfig::default() }
}

/// vLLM: the best decode worker lacks 100 prompt tokens (nothing cached, a 100-token prompt);
/// at or under the threshold it serves the request alone, prefilling locally.
#[test]
fn vllm_a_decode_worker_lacking_little_serves_alone() {
    let w = World::new(Engine::Vllm, 1, 2, 0);
    let best = w.d(0);
    let mut t = T::new(w, Protocol::Vllm, decode_only(100), Replay::Allowed, false);
    let e = t.go(Input::Start);
    assert_eq!(e, vec![Effect::SendSingle { attempt: 1, leg: Leg::DecodeLocal, holder: best }]);
    assert_eq!(t.m.mode(), Mode::DecodeOnly);
    assert_eq!(t.m.mode().as_str(), "decode_only");
    assert_eq!(t.m.serving(), Some((Leg::DecodeLocal, best)));
    assert_eq!(t.ev(1, Leg::DecodeLocal, LegEvent::FirstOutput), vec![Effect::Commit(Leg::DecodeLocal)]);
    assert_eq!(t.ev(1, Leg::DecodeLocal, LegEvent::Done), vec![served(Mode::DecodeOnly, 1)]);
}

#[test]
fn above_the_threshold_or_on_sglang_the_request_is_disaggregated() {
    let mut t =
        T::new(World::new(Engine::Vllm, 1, 1, 0), Protocol::Vllm, decode_only(99), Replay::Allowed, false);
    dispatched(&t.go(Input::Start));
    assert_eq!(t.m.mode(), Mode::Disaggregated);
    // An SGLang decode worker refuses a request without a bootstrap room: never alone.
    let mut t = T::new(
        World::new(Engine::Sglang, 1, 1, 0),
        Protocol::Sglang,
        decode_only(10_000),
        Replay::Allowed,
        false,
    );
    dispatched(&t.go(Input::Start));
    assert_eq!(t.m.mode(), Mode::Disaggregated);
}

/// The decode worker that was to serve alone fails before its first output: the request is
/// disaggregated after all, on another decode worker.
#[test]
fn a_failed_decode_only_leg_is_disaggregated_after_all() {
    let w = World::new(Engine::Vllm, 1, 2, 0);
    let (first, other, prefill) = (w.d(0), w.d(1), w.p(0));
    let mut t = T::new(w, Protocol::Vllm, decode_only(100), Replay::Allowed, false);
    t.go(Input::Start);
    let e = t.ev(1, Leg::DecodeLocal, fail(FailureClass::ServerError));
    assert_eq!(e[0], Effect::Blame { holder: first, class: FailureClass::ServerError });
    let (attempt, pair, room) = dispatched(&e);
    assert_eq!((attempt, pair, room), (2, Pair { prefill, decode: other }, None));
    assert_eq!(t.m.mode(), Mode::Disaggregated);
}
