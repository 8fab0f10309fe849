//! Counters of the event plane, per holder and in total, for metrics, `/debug` and tests.
//!
//! Key decision: plain atomics written by the lane that owns the holder and read by anyone; the
//! gateway renders them as Prometheus metrics, tests wait on them (through a condition variable
//! signalled after every group of inputs a lane handles, never by sleeping).

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use cortex_hash::kv::HolderId;

use crate::seq::{HolderState, Reason};

/// Kinds of decode errors, counted separately.
pub const DECODE_ERROR_KINDS: [&str; 4] = ["truncated", "type", "shape", "other"];

/// One holder's counters. All counts are since the holder was added.
#[derive(Debug)]
pub struct HolderStats {
    holder: HolderId,
    incarnation: u64,
    state: AtomicU8,
    pub(crate) last_seq: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) blocks_stored: AtomicU64,
    pub(crate) blocks_removed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) decode_errors: [AtomicU64; DECODE_ERROR_KINDS.len()],
    pub(crate) transitions: [AtomicU64; Reason::ALL.len()],
    pub(crate) clears: AtomicU64,
    pub(crate) replays_requested: AtomicU64,
    pub(crate) stale_replies: AtomicU64,
    pub(crate) rank_mismatches: AtomicU64,
    /// Microseconds from the engine's batch timestamp to the batch being visible, last and max.
    pub(crate) apply_lag_us: AtomicU64,
    pub(crate) apply_lag_max_us: AtomicU64,
    /// Requests the engine last reported running (shown; silence is judged on `expected`).
    pub(crate) running: AtomicU64,
    /// When the gateway sent the engine, since the holder's lane last looked, the first and the
    /// last request that store new blocks: the engine must publish events after each (silence
    /// detection).
    pub(crate) expected: std::sync::Mutex<Option<(std::time::Instant, std::time::Instant)>>,
}

/// A copy of one holder's counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderStatus {
    /// The holder.
    pub holder: HolderId,
    /// Which addition of the holder these counters belong to: unique per [`crate::Ingest`] and
    /// increasing, so that a holder removed and added again (a worker that left and came back)
    /// is told apart from the one before, whose counters started from zero.
    pub incarnation: u64,
    /// Its state.
    pub state: HolderState,
    /// Last applied sequence number (`u64::MAX` before the first).
    pub last_seq: u64,
    /// Batches applied.
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Block references stored.
    pub blocks_stored: u64,
    /// Block references removed.
    pub blocks_removed: u64,
    /// Duplicate batches dropped.
    pub duplicates: u64,
    /// Decode errors, by kind (see [`DECODE_ERROR_KINDS`]).
    pub decode_errors: [u64; DECODE_ERROR_KINDS.len()],
    /// State transitions and repairs, by reason (see [`Reason::ALL`]).
    pub transitions: [u64; Reason::ALL.len()],
    /// Times the holder's ledger entries were dropped.
    pub clears: u64,
    /// Replays requested.
    pub replays_requested: u64,
    /// Replay replies dropped because they answered a replay given up since.
    pub stale_replies: u64,
    /// Batches whose DP rank differed from the holder's.
    pub rank_mismatches: u64,
    /// Last engine-timestamp-to-visible lag, microseconds.
    pub apply_lag_us: u64,
    /// Largest such lag seen.
    pub apply_lag_max_us: u64,
}

impl HolderStatus {
    /// Transitions counted for `reason`.
    #[must_use]
    pub fn transitions(&self, reason: Reason) -> u64 {
        Reason::ALL.iter().position(|r| *r == reason).map_or(0, |i| self.transitions[i])
    }

    /// Decode errors of every kind.
    #[must_use]
    pub fn decode_errors_total(&self) -> u64 {
        self.decode_errors.iter().sum()
    }
}

fn state_to_u8(s: HolderState) -> u8 {
    match s {
        HolderState::Ready => 0,
        HolderState::Syncing => 1,
        HolderState::Stale => 2,
    }
}

fn state_from_u8(v: u8) -> HolderState {
    match v {
        0 => HolderState::Ready,
        1 => HolderState::Syncing,
        _ => HolderState::Stale,
    }
}

// Relaxed everywhere below: these are monotone counters and a status gauge; no other memory is
// published through them (waiters re-read them under the progress mutex).
impl HolderStats {
    pub(crate) fn new(holder: HolderId, incarnation: u64) -> Self {
        HolderStats {
            holder,
            incarnation,
            state: AtomicU8::new(state_to_u8(HolderState::Syncing)),
            last_seq: AtomicU64::new(u64::MAX),
            batches: AtomicU64::new(0),
            events: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            blocks_removed: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            decode_errors: std::array::from_fn(|_| AtomicU64::new(0)),
            transitions: std::array::from_fn(|_| AtomicU64::new(0)),
            clears: AtomicU64::new(0),
            replays_requested: AtomicU64::new(0),
            stale_replies: AtomicU64::new(0),
            rank_mismatches: AtomicU64::new(0),
            apply_lag_us: AtomicU64::new(0),
            apply_lag_max_us: AtomicU64::new(0),
            running: AtomicU64::new(0),
            expected: std::sync::Mutex::new(None),
        }
    }

    pub(crate) fn set_state(&self, s: HolderState) {
        self.state.store(state_to_u8(s), Ordering::Relaxed);
    }

    pub(crate) fn state(&self) -> HolderState {
        state_from_u8(self.state.load(Ordering::Relaxed))
    }

    pub(crate) fn count_transition(&self, r: Reason) {
        if let Some(i) = Reason::ALL.iter().position(|x| *x == r) {
            self.transitions[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn record_lag(&self, lag: Duration) {
        let us = u64::try_from(lag.as_micros()).unwrap_or(u64::MAX);
        self.apply_lag_us.store(us, Ordering::Relaxed);
        self.apply_lag_max_us.fetch_max(us, Ordering::Relaxed);
    }

    /// A copy of the counters.
    #[must_use]
    pub fn status(&self) -> HolderStatus {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HolderStatus {
            holder: self.holder,
            incarnation: self.incarnation,
            state: self.state(),
            last_seq: load(&self.last_seq),
            batches: load(&self.batches),
            events: load(&self.events),
            blocks_stored: load(&self.blocks_stored),
            blocks_removed: load(&self.blocks_removed),
            duplicates: load(&self.duplicates),
            decode_errors: std::array::from_fn(|i| load(&self.decode_errors[i])),
            transitions: std::array::from_fn(|i| load(&self.transitions[i])),
            clears: load(&self.clears),
            replays_requested: load(&self.replays_requested),
            stale_replies: load(&self.stale_replies),
            rank_mismatches: load(&self.rank_mismatches),
            apply_lag_us: load(&self.apply_lag_us),
            apply_lag_max_us: load(&self.apply_lag_max_us),
        }
    }
}

/// A condition variable signalled whenever any holder makes progress, so that callers can wait
/// for observable state instead of sleeping.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Progress {
    pub(crate) fn notify(&self) {
        if let Ok(mut g) = self.generation.lock() {
            *g = g.wrapping_add(1);
        }
        self.changed.notify_all();
    }

    /// Waits until `done()` holds or `timeout` passes; returns whether it holds.
    pub(crate) fn wait_until(&self, timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let Ok(mut g) = self.generation.lock() else { return done() };
        loop {
            if done() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            match self.changed.wait_timeout(g, deadline - now) {
                Ok((next, _)) => g = next,
                Err(_) => return done(),
            }
        }
    }
}
