//! The per-holder sequence state machine: pure transitions, no sockets, no clocks.
//!
//! Every engine stamps each published batch with a sequence number that starts at 0 per
//! publisher process and grows by one per batch. Comparing it with the last applied one tells
//! duplicates (drop), gaps (replay or rebuild) and restarts (clear) apart:
//!
//! | observation | action | state after |
//! |---|---|---|
//! | seq = last + 1 | apply | unchanged (a STALE holder becomes READY: nothing was lost) |
//! | 0 < seq ≤ last, the same bytes as the batch applied under that number (sent again, or a replay's overlap) | drop, count | unchanged |
//! | 0 < seq ≤ last, other bytes or a number too old to compare (a restarted engine whose first batches, seq 0 included, were lost on the way: a relay, a PUB that dropped them before the SUB was back) | clear; replay from 0 if the engine has a replay socket, else apply | SYNCING → READY, or READY |
//! | seq ≠ last + 1 after a disconnection, not READY since (possibly a restarted engine whose first batches were published before the SUB was back) | clear; replay from 0 if the engine has a replay socket, else apply | SYNCING → READY, or READY |
//! | seq = 0 while a batch was applied (engine restarted; vLLM sends no AllBlocksCleared) | clear, apply | READY |
//! | seq > last + 1 (gap) | ask the replay socket for last+1…; buffer live batches | SYNCING |
//! | replay returns a contiguous range to its end marker | apply it, then the buffered batches, skipping duplicates | READY |
//! | no replay socket, replay incomplete (first replayed seq later than asked, or a hole), or timeout | clear, apply the buffered batches from a contiguous point | READY (cold) |
//! | holder added | ask the replay socket for everything buffered, else start cold from an empty ledger | SYNCING → READY, or READY |
//! | first batch after start has seq > 0 | replay from 0 if possible, else start cold | SYNCING → READY |
//! | socket disconnected | count | STALE |
//! | silent for too long after a request that stores new blocks (the engine's last batches lost, or its publisher gone quiet) | count; with a replay socket, ask it for what follows the last batch applied | STALE; READY once the replay returns a batch (lost batches repaired), still STALE if it returns none or does not answer (nothing was published since) |
//! | socket disconnected while replaying | clear, forget the batches held, replay from 0 | SYNCING |
//! | a payload that does not decode | clear, continue with the next batch (while replaying: as an incomplete replay) | READY (cold) |
//!
//! Key decision: a gap is never papered over. A lost batch may have held removes, so applying the
//! next batch as if nothing happened could make the ledger report blocks the engine no longer
//! has (an over-count, which misroutes). Clearing only under-counts, so READY after a clear is
//! safe; the replay socket, when the engine has one, avoids even that loss.
//!
//! The machine is generic over the payload type so that its table is tested without ZeroMQ; the
//! runtime feeds it [`zmq::Message`]s and executes the [`Effect`]s it returns in order.

use std::collections::VecDeque;

/// What tells one batch from another with the same sequence number: an engine that sends a batch
/// again sends the same bytes, a restarted engine's batch of that number is another (its time
/// stamp alone differs). A hash of the payload's bytes.
pub trait Fingerprint {
    /// The payload's fingerprint.
    fn fingerprint(&self) -> u64;
}

impl Fingerprint for u64 {
    fn fingerprint(&self) -> u64 {
        *self
    }
}

/// Applied batches whose fingerprints are kept, to tell a batch sent again (a duplicate) from a
/// restarted engine's batch of the same number.
const RECENT: usize = 4096;

/// A holder's state as the event plane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HolderState {
    /// Following its engine in order: exact routing may use it.
    Ready,
    /// Catching up (replaying, or waiting for the first batch).
    Syncing,
    /// Something is suspect (disconnected, silent): exact routing only if configured.
    Stale,
}

impl HolderState {
    /// Lower-case name for logs and metrics.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            HolderState::Ready => "ready",
            HolderState::Syncing => "syncing",
            HolderState::Stale => "stale",
        }
    }
}

/// Why a holder changed state or lost its ledger entries; every transition is logged and counted
/// with one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A sequence gap was seen.
    Gap,
    /// The publisher restarted (sequence back to 0).
    Restart,
    /// Replay could not fill the gap (no socket, or the range had left the engine's buffer).
    ReplayFailed,
    /// Replay did not finish in time.
    ReplayTimeout,
    /// Replay filled the gap.
    ReplayOk,
    /// The first batch seen was not seq 0 and there was no way to replay from 0.
    ColdStart,
    /// The socket reported a disconnection.
    Disconnected,
    /// No event for too long after a request that stores new blocks.
    Silent,
    /// Events resumed in order after a suspicion.
    Resumed,
    /// A payload did not decode: its events are lost.
    Undecodable,
    /// Applying the holder's events panicked: its ledger state was quarantined and the holder is
    /// rebuilt from its engine (counted by the runtime, not by the machine).
    InternalError,
}

impl Reason {
    /// Every reason, for metrics initialisation.
    pub const ALL: [Reason; 11] = [
        Reason::Gap,
        Reason::Restart,
        Reason::ReplayFailed,
        Reason::ReplayTimeout,
        Reason::ReplayOk,
        Reason::ColdStart,
        Reason::Disconnected,
        Reason::Silent,
        Reason::Resumed,
        Reason::Undecodable,
        Reason::InternalError,
    ];

    /// Snake-case name for logs and metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Gap => "gap",
            Reason::Restart => "restart",
            Reason::ReplayFailed => "replay_failed",
            Reason::ReplayTimeout => "replay_timeout",
            Reason::ReplayOk => "replay_ok",
            Reason::ColdStart => "cold_start",
            Reason::Disconnected => "disconnected",
            Reason::Silent => "silent",
            Reason::Resumed => "resumed",
            Reason::Undecodable => "undecodable",
            Reason::InternalError => "internal_error",
        }
    }

    /// Whether a holder made READY for this reason starts without some of its engine's earlier
    /// events, so that the engine may hold blocks the ledger never learns of (the runtime tells
    /// the ledger: `HolderWriter::mark_history_lost`).
    #[must_use]
    pub const fn history_lost(self) -> bool {
        matches!(
            self,
            Reason::Gap
                | Reason::Restart
                | Reason::ReplayFailed
                | Reason::ReplayTimeout
                | Reason::ColdStart
                | Reason::Undecodable
                | Reason::InternalError
        )
    }
}

/// What the runtime must do, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect<P> {
    /// Decode and apply this batch to the ledger.
    Apply {
        /// The batch's sequence number.
        seq: u64,
        /// The payload.
        payload: P,
    },
    /// Drop every ledger entry of the holder.
    Clear(Reason),
    /// Ask the engine's replay socket for every buffered batch from `from` on. Replies of an
    /// earlier request must be discarded (the runtime opens a fresh socket per request).
    RequestReplay {
        /// First sequence number wanted.
        from: u64,
    },
    /// A duplicate batch was dropped.
    Duplicate {
        /// Its sequence number.
        seq: u64,
    },
    /// The holder's state changed.
    State(HolderState, Reason),
}

/// An input of the machine.
#[derive(Debug)]
pub enum Input<P> {
    /// The holder was just added (subscribed). With a replay socket, ask for everything the
    /// engine still buffers; without one, start READY from an empty ledger: nothing is known yet,
    /// which can only under-count.
    Start,
    /// A live batch from the SUB socket.
    Live {
        /// Sequence number.
        seq: u64,
        /// Payload.
        payload: P,
    },
    /// A batch replayed by the engine.
    Replayed {
        /// Sequence number.
        seq: u64,
        /// Payload.
        payload: P,
    },
    /// The replay's end marker.
    ReplayEnd,
    /// The replay did not end in time.
    ReplayTimeout,
    /// The batch just applied did not decode (its events are lost).
    Undecodable,
    /// The socket reported a disconnection.
    Disconnected,
    /// No event for too long after a request that stores new blocks.
    Silent,
}

/// Whether the engine offers a replay socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replay {
    /// It does.
    Available,
    /// It does not (vLLM's default): gaps are repaired by clearing.
    Unavailable,
}

/// Where the machine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Applying live batches.
    Live,
    /// Waiting for a replay from `asked` whose next expected batch is `next`. `probe`: asked
    /// after a silence, to find batches lost at the tail (no later batch reveals such a gap); a
    /// probe that finds nothing leaves the holder STALE.
    Replaying { asked: u64, next: u64, first: bool, probe: bool },
}

/// One holder's sequence tracking. See the module docs for the table it implements.
#[derive(Debug)]
pub struct Sequencer<P> {
    replay: Replay,
    /// Last applied sequence number; `None` before the first batch and after a cold reset.
    last: Option<u64>,
    /// After a cold reset with nothing to apply: take the next live batch as the new baseline
    /// (asking for a replay from 0 again would only repeat the failure).
    cold: bool,
    phase: Phase,
    state: HolderState,
    /// The socket reported a disconnection and the holder has not been READY since: the same
    /// engine goes on at `last + 1`, so a live batch numbered `last` or below is a restarted
    /// engine whose first batches were published before this SUB was connected again.
    disconnected: bool,
    buffered: VecDeque<(u64, P)>,
    max_buffered: usize,
    /// The last [`RECENT`] applied batches' numbers and fingerprints, oldest first.
    recent: VecDeque<(u64, u64)>,
}

impl<P: Fingerprint> Sequencer<P> {
    /// A machine for a holder just added: SYNCING until its first batch.
    #[must_use]
    pub fn new(replay: Replay, max_buffered: usize) -> Self {
        Sequencer {
            replay,
            last: None,
            cold: false,
            phase: Phase::Live,
            state: HolderState::Syncing,
            disconnected: false,
            buffered: VecDeque::new(),
            max_buffered: max_buffered.max(1),
            recent: VecDeque::new(),
        }
    }

    /// The current state.
    #[must_use]
    pub const fn state(&self) -> HolderState {
        self.state
    }

    /// The last applied sequence number.
    #[must_use]
    pub const fn last(&self) -> Option<u64> {
        self.last
    }

    /// Whether a replay is outstanding (the runtime arms its timeout while this is true).
    #[must_use]
    pub const fn replaying(&self) -> bool {
        matches!(self.phase, Phase::Replaying { .. })
    }

    /// Live batches held while replaying.
    #[must_use]
    pub fn buffered(&self) -> usize {
        self.buffered.len()
    }

    /// Starts cold whatever the engine offers: READY from an empty ledger, the next live batch
    /// the baseline, no replay asked for. For a holder rebuilt after a panic, whose earlier
    /// replay's replies may still be on their way and must not be taken for a new replay's.
    pub fn start_cold(&mut self, out: &mut Vec<Effect<P>>) {
        self.cold = true;
        self.set_state(HolderState::Ready, Reason::ColdStart, out);
    }

    /// Feeds one input; the effects to execute are appended to `out` in order.
    pub fn step(&mut self, input: Input<P>, out: &mut Vec<Effect<P>>) {
        match input {
            Input::Start => {
                if self.last.is_none() && !self.replaying() {
                    if self.replay == Replay::Available {
                        self.start_replay(0, Reason::ColdStart, out);
                    } else {
                        self.cold = true;
                        self.set_state(HolderState::Ready, Reason::ColdStart, out);
                    }
                }
            }
            Input::Live { seq, payload } => self.live(seq, payload, out),
            Input::Replayed { seq, payload } => self.replayed(seq, payload, out),
            Input::ReplayEnd => self.replay_end(out),
            Input::ReplayTimeout => match self.phase {
                // No answer to a silence's probe says nothing was lost: it stays STALE.
                Phase::Replaying { probe: true, asked, next, .. } if next == asked => {
                    self.probe_found_nothing(out)
                }
                Phase::Replaying { .. } => self.fall_back(Reason::ReplayTimeout, out),
                Phase::Live => {}
            },
            Input::Undecodable if self.replaying() => {
                // A replayed batch's events are lost: the replay cannot fill the gap, and the
                // holder is not READY before the live batches held meanwhile are applied.
                self.fall_back(Reason::Undecodable, out);
            }
            Input::Undecodable => {
                // The batch's events are lost: rebuild from the next one.
                out.push(Effect::Clear(Reason::Undecodable));
                self.set_state(HolderState::Ready, Reason::Undecodable, out);
            }
            Input::Disconnected if self.replaying() => {
                // The engine may have restarted: the batches held and the replay's answers may
                // come from two engine processes, and a pick of them could keep the dead one's
                // blocks. Start over from the (new) engine's whole history.
                self.disconnected = true;
                self.buffered.clear();
                self.last = None;
                out.push(Effect::Clear(Reason::Disconnected));
                self.start_replay(0, Reason::Disconnected, out);
            }
            Input::Disconnected => {
                self.disconnected = true;
                self.suspect(Reason::Disconnected, out);
            }
            Input::Silent => {
                self.suspect(Reason::Silent, out);
                // The engine owes batches and none came: its last ones may have been lost on the
                // way (a gap only a later batch would reveal), or its first ones (nothing applied
                // yet: an engine just started or restarted whose seq 0 was lost). Its ring has
                // them if so.
                if self.replay == Replay::Available && !self.replaying() {
                    self.ask_replay(self.last.map_or(0, |last| last.wrapping_add(1)), true, out);
                }
            }
        }
    }

    fn live(&mut self, seq: u64, payload: P, out: &mut Vec<Effect<P>>) {
        if let Phase::Replaying { .. } = self.phase {
            if seq == 0 && (self.last.is_some() || !self.buffered.is_empty()) {
                // The engine restarted during the replay: its old history is gone.
                self.phase = Phase::Live;
                self.buffered.clear();
                self.restart(seq, payload, out);
                return;
            }
            if self.buffered.len() >= self.max_buffered {
                // Too much to hold: give up the replay, keep what is contiguous.
                self.buffered.push_back((seq, payload));
                self.fall_back(Reason::ReplayFailed, out);
                return;
            }
            self.buffered.push_back((seq, payload));
            return;
        }
        match self.last {
            None => {
                if seq == 0 || self.cold {
                    self.apply(seq, payload, out);
                    self.set_state(HolderState::Ready, Reason::Resumed, out);
                } else if self.replay == Replay::Available {
                    self.start_replay(0, Reason::ColdStart, out);
                    self.buffered.push_back((seq, payload));
                } else {
                    // Nothing before this batch can be had: start from here. Blocks stored
                    // earlier are simply not known (an under-count).
                    self.apply(seq, payload, out);
                    self.set_state(HolderState::Ready, Reason::ColdStart, out);
                }
            }
            Some(last) => {
                if seq == 0 {
                    self.restart(seq, payload, out);
                } else if seq == last.wrapping_add(1) {
                    self.apply(seq, payload, out);
                    if self.state != HolderState::Ready {
                        self.set_state(HolderState::Ready, Reason::Resumed, out);
                    }
                } else if self.disconnected {
                    // After a disconnection, a batch that does not follow the last is as likely
                    // a restarted engine's (its first batches published while this SUB was
                    // away) as a gap of the same engine's: replaying the gap could mix the two
                    // engines' histories, so the holder starts over.
                    self.restarted_unseen(seq, payload, out);
                } else if seq <= last {
                    if self.applied_as(seq) == Some(payload.fingerprint()) {
                        out.push(Effect::Duplicate { seq });
                    } else {
                        // Not the batch applied under that number: a restarted engine whose
                        // first batches (its seq 0 among them) never arrived.
                        self.restarted_unseen(seq, payload, out);
                    }
                } else if self.replay == Replay::Available {
                    self.start_replay(last + 1, Reason::Gap, out);
                    self.buffered.push_back((seq, payload));
                } else {
                    // Stale for the instant it takes to drop what the gap may have removed: the
                    // gap is counted as a gap, the repair as the replay that could not be had.
                    self.set_state(HolderState::Stale, Reason::Gap, out);
                    out.push(Effect::Clear(Reason::Gap));
                    self.apply(seq, payload, out);
                    self.set_state(HolderState::Ready, Reason::ReplayFailed, out);
                }
            }
        }
    }

    fn restart(&mut self, seq: u64, payload: P, out: &mut Vec<Effect<P>>) {
        out.push(Effect::Clear(Reason::Restart));
        self.apply(seq, payload, out);
        self.set_state(HolderState::Ready, Reason::Restart, out);
    }

    /// A restarted engine whose first batches this SUB missed (published before it was connected
    /// again): clear, then replay the new engine's history from 0 if it has a replay socket, else
    /// start from this batch (what the missed batches stored is not known: an under-count).
    fn restarted_unseen(&mut self, seq: u64, payload: P, out: &mut Vec<Effect<P>>) {
        if self.replay == Replay::Unavailable {
            self.restart(seq, payload, out);
            return;
        }
        out.push(Effect::Clear(Reason::Restart));
        self.last = None;
        self.buffered.push_back((seq, payload));
        self.start_replay(0, Reason::Restart, out);
    }

    fn start_replay(&mut self, from: u64, why: Reason, out: &mut Vec<Effect<P>>) {
        self.ask_replay(from, false, out);
        self.set_state(HolderState::Syncing, why, out);
    }

    /// Asks the engine's replay socket for its batches from `from` (`probe`: after a silence).
    fn ask_replay(&mut self, from: u64, probe: bool, out: &mut Vec<Effect<P>>) {
        self.phase = Phase::Replaying { asked: from, next: from, first: true, probe };
        out.push(Effect::RequestReplay { from });
    }

    fn replayed(&mut self, seq: u64, payload: P, out: &mut Vec<Effect<P>>) {
        let Phase::Replaying { asked, next, first, probe } = self.phase else {
            // A late reply of a finished replay: the runtime should have discarded it.
            return;
        };
        if first && seq > asked {
            // The range left the engine's ring buffer: the gap cannot be filled.
            self.buffered.push_front((seq, payload));
            self.fall_back(Reason::ReplayFailed, out);
            return;
        }
        if seq < next {
            out.push(Effect::Duplicate { seq });
        } else if seq == next {
            self.apply(seq, payload, out);
            self.phase = Phase::Replaying { asked, next: seq + 1, first: false, probe };
        } else {
            self.buffered.push_front((seq, payload));
            self.fall_back(Reason::ReplayFailed, out);
        }
        if let Phase::Replaying { asked, next, probe, .. } = self.phase {
            self.phase = Phase::Replaying { asked, next, first: false, probe };
        }
    }

    fn replay_end(&mut self, out: &mut Vec<Effect<P>>) {
        match self.phase {
            Phase::Live => return,
            Phase::Replaying { probe: true, asked, next, .. } if next == asked => {
                self.probe_found_nothing(out);
                return;
            }
            Phase::Replaying { .. } => {}
        }
        self.phase = Phase::Live;
        // The engine had nothing buffered (an idle engine just started): its next batch is its
        // seq 0. A later number means its first batches were published and lost before this
        // SUB saw them (a slow joiner); they are asked for from the replay again, and only an
        // engine that no longer has them makes the holder start cold from what it sees.
        // Catch up with what arrived live meanwhile.
        while let Some((seq, payload)) = self.buffered.pop_front() {
            match self.last {
                // The replay returned it too (the live batch that revealed a gap is the end of
                // the range asked for): received twice by this gateway's own doing, not sent
                // twice by the engine, so it is not counted as a duplicate.
                Some(last) if seq <= last => {}
                Some(last) if seq != last + 1 => {
                    // Still a hole (lost while replaying): rebuild from here.
                    self.buffered.push_front((seq, payload));
                    self.fall_back(Reason::ReplayFailed, out);
                    return;
                }
                None if seq != 0 => {
                    self.buffered.push_front((seq, payload));
                    self.fall_back(Reason::ReplayFailed, out);
                    return;
                }
                _ => self.apply(seq, payload, out),
            }
        }
        self.set_state(HolderState::Ready, Reason::ReplayOk, out);
    }

    /// Clears the holder and applies the longest contiguous run that ends with the newest
    /// buffered batch; READY (cold) afterwards.
    fn fall_back(&mut self, why: Reason, out: &mut Vec<Effect<P>>) {
        self.phase = Phase::Live;
        out.push(Effect::Clear(why));
        let mut keep_from = 0;
        let mut items: Vec<(u64, P)> = self.buffered.drain(..).collect();
        items.sort_by_key(|(seq, _)| *seq);
        items.dedup_by_key(|(seq, _)| *seq);
        for i in 1..items.len() {
            if items[i].0 != items[i - 1].0 + 1 {
                keep_from = i;
            }
        }
        self.last = None;
        self.cold = true;
        for (seq, payload) in items.into_iter().skip(keep_from) {
            self.apply(seq, payload, out);
        }
        self.set_state(HolderState::Ready, why, out);
    }

    /// A silence's probe found no batch after the last applied: nothing was lost on the way, the
    /// engine published nothing since (its publisher is quiet). The holder stays STALE; the live
    /// batches held meanwhile are taken as they would have been (the next one in order makes it
    /// READY).
    fn probe_found_nothing(&mut self, out: &mut Vec<Effect<P>>) {
        self.phase = Phase::Live;
        for (seq, payload) in std::mem::take(&mut self.buffered) {
            self.live(seq, payload, out);
        }
    }

    fn suspect(&mut self, why: Reason, out: &mut Vec<Effect<P>>) {
        if self.state == HolderState::Ready {
            self.set_state(HolderState::Stale, why, out);
        }
    }

    fn apply(&mut self, seq: u64, payload: P, out: &mut Vec<Effect<P>>) {
        self.last = Some(seq);
        self.cold = false;
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, payload.fingerprint()));
        out.push(Effect::Apply { seq, payload });
    }

    /// The fingerprint of the batch applied under `seq`, if it is among the recent ones.
    fn applied_as(&self, seq: u64) -> Option<u64> {
        // Newest first: numbers only repeat across a restart, where the newest is the one that
        // counts.
        self.recent.iter().rev().find(|(s, _)| *s == seq).map(|(_, fp)| *fp)
    }

    fn set_state(&mut self, state: HolderState, why: Reason, out: &mut Vec<Effect<P>>) {
        if state == HolderState::Ready {
            self.disconnected = false;
        }
        if self.state != state || why != Reason::Resumed {
            self.state = state;
            out.push(Effect::State(state, why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type E = Effect<u64>;

    fn run(m: &mut Sequencer<u64>, input: Input<u64>) -> Vec<E> {
        let mut out = Vec::new();
        m.step(input, &mut out);
        out
    }

    fn live(m: &mut Sequencer<u64>, seq: u64) -> Vec<E> {
        run(m, Input::Live { seq, payload: seq })
    }

    fn applied(effects: &[E]) -> Vec<u64> {
        effects
            .iter()
            .filter_map(|e| if let Effect::Apply { seq, .. } = e { Some(*seq) } else { None })
            .collect()
    }

    fn ready_at(replay: Replay, last: u64) -> Sequencer<u64> {
        let mut m = Sequencer::new(replay, 100);
        for s in 0..=last {
            live(&mut m, s);
        }
        assert_eq!(m.state(), HolderState::Ready);
        m
    }

    #[test]
    fn in_order_applies() {
        let mut m = Sequencer::new(Replay::Unavailable, 100);
        let e = live(&mut m, 0);
        assert_eq!(
            e,
            vec![Effect::Apply { seq: 0, payload: 0 }, Effect::State(HolderState::Ready, Reason::Resumed)]
        );
        assert_eq!(live(&mut m, 1), vec![Effect::Apply { seq: 1, payload: 1 }]);
    }

    #[test]
    fn duplicates_are_dropped() {
        let mut m = ready_at(Replay::Unavailable, 5);
        assert_eq!(live(&mut m, 3), vec![Effect::Duplicate { seq: 3 }]);
        assert_eq!(live(&mut m, 5), vec![Effect::Duplicate { seq: 5 }]);
        assert_eq!(m.last(), Some(5));
    }

    #[test]
    fn restart_clears_then_applies() {
        let mut m = ready_at(Replay::Available, 5);
        let e = live(&mut m, 0);
        assert_eq!(
            e,
            vec![
                Effect::Clear(Reason::Restart),
                Effect::Apply { seq: 0, payload: 0 },
                Effect::State(HolderState::Ready, Reason::Restart)
            ]
        );
        assert_eq!(live(&mut m, 1), vec![Effect::Apply { seq: 1, payload: 1 }]);
    }

    /// A restarted engine whose first batches were published before the SUB was connected again:
    /// the first batch seen is numbered at or below the last applied one. Without the
    /// disconnection that is a duplicate; after it (the same engine would go on at last + 1) it is
    /// a restart, and the old engine's blocks must go.
    #[test]
    fn a_restart_whose_first_batches_were_missed_clears() {
        let mut m = ready_at(Replay::Unavailable, 5);
        assert_eq!(
            run(&mut m, Input::Disconnected),
            vec![Effect::State(HolderState::Stale, Reason::Disconnected)]
        );
        assert_eq!(
            live(&mut m, 2),
            vec![
                Effect::Clear(Reason::Restart),
                Effect::Apply { seq: 2, payload: 2 },
                Effect::State(HolderState::Ready, Reason::Restart)
            ]
        );
        // READY since: a number at or below the last is a duplicate again.
        assert_eq!(live(&mut m, 3), vec![Effect::Apply { seq: 3, payload: 3 }]);
        assert_eq!(live(&mut m, 3), vec![Effect::Duplicate { seq: 3 }]);
        // With a replay socket: clear, replay the new engine's history from 0, then the batch.
        let mut m = ready_at(Replay::Available, 5);
        run(&mut m, Input::Disconnected);
        assert_eq!(
            live(&mut m, 2),
            vec![
                Effect::Clear(Reason::Restart),
                Effect::RequestReplay { from: 0 },
                Effect::State(HolderState::Syncing, Reason::Restart)
            ]
        );
        let mut effects = Vec::new();
        for s in 0..2 {
            effects.extend(run(&mut m, Input::Replayed { seq: s, payload: s }));
        }
        effects.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&effects), vec![0, 1, 2]);
        assert_eq!(effects.last(), Some(&Effect::State(HolderState::Ready, Reason::ReplayOk)));
    }

    /// After a disconnection, a gap is not replayed from where the old engine left off: a
    /// restarted engine whose first batches were missed would have its later batches replayed on
    /// top of the dead engine's blocks (READY, over-counting). The holder starts over from 0.
    #[test]
    fn a_gap_after_a_disconnection_starts_over_from_the_engine_s_first_batch() {
        let mut m = ready_at(Replay::Available, 2);
        run(&mut m, Input::Disconnected);
        // The new engine's 0–4 were published before the SUB was back; 5 is the first seen.
        assert_eq!(
            live(&mut m, 5),
            vec![
                Effect::Clear(Reason::Restart),
                Effect::RequestReplay { from: 0 },
                Effect::State(HolderState::Syncing, Reason::Restart)
            ]
        );
        let mut effects = Vec::new();
        for s in 0..5 {
            effects.extend(run(&mut m, Input::Replayed { seq: s, payload: 100 + s }));
        }
        effects.extend(run(&mut m, Input::ReplayEnd));
        // Only the new engine's batches, in order.
        assert_eq!(applied(&effects), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(effects.last(), Some(&Effect::State(HolderState::Ready, Reason::ReplayOk)));
        // Without a replay socket: cleared, and started from the batch seen.
        let mut m = ready_at(Replay::Unavailable, 2);
        run(&mut m, Input::Disconnected);
        let e = live(&mut m, 5);
        assert_eq!(e[0], Effect::Clear(Reason::Restart));
        assert_eq!(applied(&e), vec![5]);
        // Without the disconnection, the same gap is replayed from the last batch on.
        let mut m = ready_at(Replay::Available, 2);
        assert_eq!(live(&mut m, 5)[0], Effect::RequestReplay { from: 3 });
    }

    /// A disconnection during a replay: the batches held and the replay's answers may come from
    /// two engine processes (the dead one's 7 and 8, the restarted one's 2 and 3), and no pick of
    /// them is safe. Everything held is dropped and the replay starts over from 0.
    #[test]
    fn a_disconnection_during_a_replay_starts_over() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 7);
        live(&mut m, 8);
        assert!(m.replaying());
        let e = run(&mut m, Input::Disconnected);
        assert_eq!(
            e,
            vec![
                Effect::Clear(Reason::Disconnected),
                Effect::RequestReplay { from: 0 },
                Effect::State(HolderState::Syncing, Reason::Disconnected)
            ]
        );
        assert_eq!(m.buffered(), 0);
        live(&mut m, 2);
        live(&mut m, 3);
        let e = run(&mut m, Input::ReplayTimeout);
        // The dead engine's 7 and 8 are never applied.
        assert_eq!(applied(&e), vec![2, 3]);
        assert_eq!(m.last(), Some(3));
        assert_eq!(live(&mut m, 4), vec![Effect::Apply { seq: 4, payload: 4 }]);
    }

    /// A replayed batch that does not decode ends the replay as an incomplete one: the holder is
    /// not READY before the live batches held meanwhile are applied.
    #[test]
    fn an_undecodable_replayed_batch_ends_the_replay() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 7);
        run(&mut m, Input::Replayed { seq: 4, payload: 4 });
        assert!(m.replaying());
        let e = run(&mut m, Input::Undecodable);
        assert_eq!(e[0], Effect::Clear(Reason::Undecodable));
        assert_eq!(applied(&e), vec![7], "the batch held is applied before READY");
        assert_eq!(e.last(), Some(&Effect::State(HolderState::Ready, Reason::Undecodable)));
        assert!(!m.replaying());
        assert!(
            run(&mut m, Input::Replayed { seq: 5, payload: 5 }).is_empty(),
            "its late replies are ignored"
        );
    }

    /// A restarted engine whose first batches, seq 0 among them, never arrived, with no
    /// disconnection seen (a relay in between, or a PUB that dropped them before the SUB was
    /// back): its batch numbered at or below the last is not the one applied under that number,
    /// so it is a restart, not a duplicate. Taken for duplicates, every batch up to the old
    /// engine's last would have been dropped, and then the new engine's applied on the dead one's
    /// blocks (a probe saw exactly that: ~30 batches lost, then over-claims).
    #[test]
    fn a_lower_number_with_other_bytes_is_a_restart_whose_first_batches_were_lost() {
        let mut m = ready_at(Replay::Available, 30);
        // The same batch sent again is a duplicate.
        assert_eq!(live(&mut m, 12), vec![Effect::Duplicate { seq: 12 }]);
        // The restarted engine's seq 1 (its 0 lost): other bytes.
        assert_eq!(
            run(&mut m, Input::Live { seq: 1, payload: 1_001 }),
            vec![
                Effect::Clear(Reason::Restart),
                Effect::RequestReplay { from: 0 },
                Effect::State(HolderState::Syncing, Reason::Restart)
            ]
        );
        let mut effects = run(&mut m, Input::Replayed { seq: 0, payload: 1_000 });
        effects.extend(run(&mut m, Input::Replayed { seq: 1, payload: 1_001 }));
        effects.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&effects), vec![0, 1]);
        assert_eq!(m.last(), Some(1));
        // Without a replay socket: cleared, and started from the batch seen.
        let mut m = ready_at(Replay::Unavailable, 30);
        let e = run(&mut m, Input::Live { seq: 2, payload: 2_002 });
        assert_eq!(e[0], Effect::Clear(Reason::Restart));
        assert_eq!(applied(&e), vec![2]);
        // A number older than the fingerprints kept cannot be a batch sent again: a restart.
        let mut m = ready_at(Replay::Unavailable, RECENT as u64 + 10);
        let e = live(&mut m, 3);
        assert_eq!(e[0], Effect::Clear(Reason::Restart));
    }

    #[test]
    fn after_a_disconnection_the_same_engine_resumes_without_a_clear() {
        let mut m = ready_at(Replay::Unavailable, 5);
        run(&mut m, Input::Disconnected);
        assert_eq!(
            live(&mut m, 6),
            vec![Effect::Apply { seq: 6, payload: 6 }, Effect::State(HolderState::Ready, Reason::Resumed)]
        );
        assert_eq!(live(&mut m, 4), vec![Effect::Duplicate { seq: 4 }]);
    }

    #[test]
    fn gap_with_replay_fills_in_order() {
        let mut m = ready_at(Replay::Available, 3);
        let e = live(&mut m, 7);
        assert_eq!(
            e,
            vec![Effect::RequestReplay { from: 4 }, Effect::State(HolderState::Syncing, Reason::Gap)]
        );
        // Live batches keep arriving while the replay runs.
        assert!(live(&mut m, 8).is_empty());
        let mut effects = Vec::new();
        for s in 4..=7 {
            effects.extend(run(&mut m, Input::Replayed { seq: s, payload: s }));
        }
        effects.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&effects), vec![4, 5, 6, 7, 8]);
        // Batch 7, seen live and replayed, is applied once and is no duplicate of the engine's.
        assert!(!effects.iter().any(|e| matches!(e, Effect::Duplicate { .. })));
        assert_eq!(effects.last(), Some(&Effect::State(HolderState::Ready, Reason::ReplayOk)));
        assert!(!effects.iter().any(|e| matches!(e, Effect::Clear(_))));
    }

    #[test]
    fn gap_without_replay_clears() {
        let mut m = ready_at(Replay::Unavailable, 3);
        let e = live(&mut m, 7);
        assert_eq!(
            e,
            vec![
                Effect::State(HolderState::Stale, Reason::Gap),
                Effect::Clear(Reason::Gap),
                Effect::Apply { seq: 7, payload: 7 },
                Effect::State(HolderState::Ready, Reason::ReplayFailed)
            ]
        );
    }

    #[test]
    fn incomplete_replay_falls_back_cold() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 9);
        live(&mut m, 10);
        // The engine no longer has 4..: its first replayed batch is 6.
        let e = run(&mut m, Input::Replayed { seq: 6, payload: 6 });
        assert_eq!(e[0], Effect::Clear(Reason::ReplayFailed));
        // Kept: the contiguous run ending with the newest buffered batch (9, 10).
        assert_eq!(applied(&e), vec![9, 10]);
        assert_eq!(m.state(), HolderState::Ready);
        assert!(!m.replaying());
        // A late reply of the abandoned replay is ignored.
        assert!(run(&mut m, Input::Replayed { seq: 7, payload: 7 }).is_empty());
        assert_eq!(live(&mut m, 11), vec![Effect::Apply { seq: 11, payload: 11 }]);
    }

    #[test]
    fn replay_timeout_falls_back_cold() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 5);
        let e = run(&mut m, Input::ReplayTimeout);
        assert_eq!(
            e,
            vec![
                Effect::Clear(Reason::ReplayTimeout),
                Effect::Apply { seq: 5, payload: 5 },
                Effect::State(HolderState::Ready, Reason::ReplayTimeout)
            ]
        );
        // A timeout after the replay ended does nothing.
        assert!(run(&mut m, Input::ReplayTimeout).is_empty());
    }

    #[test]
    fn first_batch_not_zero_replays_from_zero() {
        let mut m = Sequencer::new(Replay::Available, 100);
        let e = live(&mut m, 4);
        assert_eq!(
            e,
            vec![Effect::RequestReplay { from: 0 }, Effect::State(HolderState::Syncing, Reason::ColdStart)]
        );
        let mut effects = Vec::new();
        for s in 0..=4 {
            effects.extend(run(&mut m, Input::Replayed { seq: s, payload: s }));
        }
        effects.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&effects), vec![0, 1, 2, 3, 4]);
        assert_eq!(m.state(), HolderState::Ready);
    }

    #[test]
    fn first_batch_not_zero_without_replay_starts_cold() {
        let mut m = Sequencer::new(Replay::Unavailable, 100);
        let e = live(&mut m, 4);
        assert_eq!(
            e,
            vec![Effect::Apply { seq: 4, payload: 4 }, Effect::State(HolderState::Ready, Reason::ColdStart)]
        );
    }

    #[test]
    fn failed_replay_with_nothing_buffered_takes_the_next_batch_as_baseline() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 9);
        let e = run(&mut m, Input::Replayed { seq: 20, payload: 20 });
        // 9 and 20 are not contiguous: the newest run is [20].
        assert_eq!(applied(&e), vec![20]);
        assert_eq!(live(&mut m, 21), vec![Effect::Apply { seq: 21, payload: 21 }]);
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 9);
        let e = run(&mut m, Input::ReplayTimeout);
        assert_eq!(applied(&e), vec![9]);
        let mut m = Sequencer::new(Replay::Available, 100);
        live(&mut m, 4);
        let e = run(&mut m, Input::ReplayEnd); // nothing replayed from 0
        assert_eq!(applied(&e), vec![4]);
    }

    #[test]
    fn start_replays_everything_buffered_or_starts_cold() {
        let mut m = Sequencer::new(Replay::Available, 100);
        assert_eq!(
            run(&mut m, Input::Start),
            vec![Effect::RequestReplay { from: 0 }, Effect::State(HolderState::Syncing, Reason::ColdStart)]
        );
        // An idle engine buffered nothing: READY; its next batch is its seq 0.
        let e = run(&mut m, Input::ReplayEnd);
        assert_eq!(e, vec![Effect::State(HolderState::Ready, Reason::ReplayOk)]);
        assert_eq!(live(&mut m, 0), vec![Effect::Apply { seq: 0, payload: 0 }]);
        // A later number: its first batches were lost on the way (a probe saw 0-5 lost while
        // the engine's ring still held them); they are asked for again.
        let mut m = Sequencer::new(Replay::Available, 100);
        run(&mut m, Input::Start);
        run(&mut m, Input::ReplayEnd);
        assert_eq!(
            live(&mut m, 6),
            vec![Effect::RequestReplay { from: 0 }, Effect::State(HolderState::Syncing, Reason::ColdStart)]
        );
        let mut e = Vec::new();
        for s in 0..6 {
            e.extend(run(&mut m, Input::Replayed { seq: s, payload: s }));
        }
        e.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&e), (0..=6).collect::<Vec<_>>());
        // An engine that no longer has them: started cold from the batch seen.
        let mut m = Sequencer::new(Replay::Available, 100);
        run(&mut m, Input::Start);
        run(&mut m, Input::ReplayEnd);
        live(&mut m, 7);
        let e = run(&mut m, Input::ReplayEnd);
        assert_eq!(applied(&e), vec![7]);
        assert_eq!(live(&mut m, 8), vec![Effect::Apply { seq: 8, payload: 8 }]);
        let mut m = Sequencer::new(Replay::Unavailable, 100);
        assert_eq!(run(&mut m, Input::Start), vec![Effect::State(HolderState::Ready, Reason::ColdStart)]);
        assert_eq!(live(&mut m, 3), vec![Effect::Apply { seq: 3, payload: 3 }]);
        // A start after batches were seen does nothing.
        let mut m = ready_at(Replay::Available, 2);
        assert!(run(&mut m, Input::Start).is_empty());
    }

    #[test]
    fn restart_during_replay_wins() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 6);
        let e = live(&mut m, 0);
        assert_eq!(e[0], Effect::Clear(Reason::Restart));
        assert_eq!(applied(&e), vec![0]);
        assert!(!m.replaying());
    }

    #[test]
    fn hole_after_replay_falls_back() {
        let mut m = ready_at(Replay::Available, 3);
        live(&mut m, 5);
        live(&mut m, 8); // 6 and 7 lost while replaying
        let mut e = run(&mut m, Input::Replayed { seq: 4, payload: 4 });
        e.extend(run(&mut m, Input::Replayed { seq: 5, payload: 5 }));
        e.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&e), vec![4, 5, 8]);
        assert!(e.contains(&Effect::Clear(Reason::ReplayFailed)));
    }

    #[test]
    fn suspicion_and_resumption() {
        let mut m = ready_at(Replay::Unavailable, 3);
        assert_eq!(run(&mut m, Input::Silent), vec![Effect::State(HolderState::Stale, Reason::Silent)]);
        assert!(run(&mut m, Input::Disconnected).is_empty(), "already stale");
        let e = live(&mut m, 4);
        assert_eq!(
            e,
            vec![Effect::Apply { seq: 4, payload: 4 }, Effect::State(HolderState::Ready, Reason::Resumed)]
        );
    }

    /// Silence asks the replay for what follows the last batch: batches lost at the tail (which
    /// no later batch reveals as a gap) are repaired; a replay with nothing, or none at all,
    /// leaves the holder STALE without losing what it holds.
    #[test]
    fn a_silence_probes_the_replay_for_lost_batches() {
        let silent =
            vec![Effect::State(HolderState::Stale, Reason::Silent), Effect::RequestReplay { from: 4 }];
        // Batches 4 and 5 were lost: the replay has them, READY again with nothing cleared.
        let mut m = ready_at(Replay::Available, 3);
        assert_eq!(run(&mut m, Input::Silent), silent);
        assert_eq!(m.state(), HolderState::Stale);
        let mut e = run(&mut m, Input::Replayed { seq: 4, payload: 4 });
        e.extend(run(&mut m, Input::Replayed { seq: 5, payload: 5 }));
        e.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&e), vec![4, 5]);
        assert!(!e.iter().any(|e| matches!(e, Effect::Clear(_))), "{e:?}");
        assert_eq!(e.last(), Some(&Effect::State(HolderState::Ready, Reason::ReplayOk)));
        // Nothing published since: still STALE, nothing cleared; the next batch in order resumes.
        let mut m = ready_at(Replay::Available, 3);
        run(&mut m, Input::Silent);
        assert!(run(&mut m, Input::ReplayEnd).is_empty());
        assert_eq!((m.state(), m.replaying(), m.last()), (HolderState::Stale, false, Some(3)));
        assert_eq!(
            live(&mut m, 4),
            vec![Effect::Apply { seq: 4, payload: 4 }, Effect::State(HolderState::Ready, Reason::Resumed)]
        );
        // No answer: the same, and a batch that came live meanwhile is taken in order.
        let mut m = ready_at(Replay::Available, 3);
        run(&mut m, Input::Silent);
        assert!(live(&mut m, 4).is_empty(), "held while the probe runs");
        let e = run(&mut m, Input::ReplayTimeout);
        assert_eq!(
            e,
            vec![Effect::Apply { seq: 4, payload: 4 }, Effect::State(HolderState::Ready, Reason::Resumed)]
        );
        // Nothing applied yet (an engine whose seq 0 was lost): asked from 0, and repaired.
        let mut m = Sequencer::<u64>::new(Replay::Available, 64);
        m.start_cold(&mut Vec::new());
        assert_eq!(
            run(&mut m, Input::Silent),
            vec![Effect::State(HolderState::Stale, Reason::Silent), Effect::RequestReplay { from: 0 }]
        );
        let mut e = run(&mut m, Input::Replayed { seq: 0, payload: 0 });
        e.extend(run(&mut m, Input::ReplayEnd));
        assert_eq!(applied(&e), vec![0]);
        assert_eq!(m.state(), HolderState::Ready);
        // The ring no longer has the batch after the last: lost for good, rebuilt.
        let mut m = ready_at(Replay::Available, 3);
        run(&mut m, Input::Silent);
        let e = run(&mut m, Input::Replayed { seq: 9, payload: 9 });
        assert_eq!(e[0], Effect::Clear(Reason::ReplayFailed));
        assert_eq!(applied(&e), vec![9]);
        assert_eq!(m.state(), HolderState::Ready);
    }

    #[test]
    fn undecodable_batch_clears() {
        let mut m = ready_at(Replay::Available, 3);
        let e = run(&mut m, Input::Undecodable);
        assert_eq!(e[0], Effect::Clear(Reason::Undecodable));
        assert_eq!(live(&mut m, 4), vec![Effect::Apply { seq: 4, payload: 4 }]);
    }

    #[test]
    fn buffer_overflow_gives_up_replay() {
        let mut m = Sequencer::new(Replay::Available, 2);
        live(&mut m, 0);
        live(&mut m, 5);
        live(&mut m, 6);
        let e = live(&mut m, 7);
        assert_eq!(e[0], Effect::Clear(Reason::ReplayFailed));
        assert_eq!(applied(&e), vec![5, 6, 7]);
    }
}
