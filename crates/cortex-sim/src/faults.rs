//! Injectable faults, set through [`crate::SimWorker`] or `POST /sim/fault`.
//!
//! Key decision: every fault is explicit and counted ("the next N requests"), never random, so a
//! test that injects one knows exactly which request it hits. Faults of the event stream
//! (dropped batches, publisher restart, replay off) live in the publisher; stalling lives in the
//! ranks; the HTTP-level ones are here.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};

/// A fault, as `POST /sim/fault` accepts it (externally tagged JSON: `"stall"`,
/// `{"fail_next": {"status": 503, "count": 2}}`, …); serializing one gives that body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Answer the next `count` generation requests with `status` (429, 500, 503, …).
    FailNext {
        /// The HTTP status.
        status: u16,
        /// How many requests.
        count: u32,
    },
    /// Stop stepping every rank: requests are accepted and wait.
    Stall,
    /// Undo [`Fault::Stall`].
    Resume,
    /// The next `count` requests die after `after_tokens` tokens: the connection is cut
    /// without the end of the response (no `[DONE]`, no last chunk).
    DieMidStream {
        /// Tokens sent before dying.
        after_tokens: usize,
        /// How many requests.
        count: u32,
    },
    /// Do not send the next `count` event batches of `rank` (their sequence numbers are used:
    /// subscribers see a gap; the replay ring still has them).
    DropBatches {
        /// The DP rank.
        rank: u16,
        /// How many batches.
        count: u64,
    },
    /// Restart `rank`'s publisher: sequence back to 0, replay ring emptied, nothing announced
    /// (no `AllBlocksCleared`, as vLLM behaves on restart).
    RestartPublisher {
        /// The DP rank.
        rank: u16,
    },
    /// Turn replay answering on or off for `rank`.
    Replay {
        /// The DP rank.
        rank: u16,
        /// Answer replay requests.
        enabled: bool,
    },
    /// Flush the prefix cache of every rank (`AllBlocksCleared`), refused while requests run.
    FlushCache,
    /// Make `/health` (and SGLang's `/ready`) answer 503 (false) or 200 (true).
    Health {
        /// Healthy.
        healthy: bool,
    },
    /// A decode worker's next `count` KV transfers fail after the prefill side handed the KV
    /// over (SGLang: the room was found and the prefill finished; vLLM: the lease was read), as
    /// a failed NIXL read or bootstrap transfer does: the decode leg answers the engine's
    /// transfer failure.
    FailTransfers {
        /// How many decode legs.
        count: u32,
    },
}

/// The HTTP-level fault state of a worker.
#[derive(Debug, Default)]
pub(crate) struct HttpFaults {
    fail_next: Mutex<Option<(u16, u32)>>,
    fail_transfers: Mutex<u32>,
    die: Mutex<Option<(usize, u32)>>,
    unhealthy: AtomicBool,
}

impl HttpFaults {
    pub(crate) fn fail_next(&self, status: u16, count: u32) {
        *self.fail_next.lock() = (count > 0).then_some((status, count));
    }

    /// The status to fail this request with, consuming one.
    pub(crate) fn take_failure(&self) -> Option<u16> {
        let mut f = self.fail_next.lock();
        let (status, left) = (*f)?;
        *f = (left > 1).then_some((status, left - 1));
        Some(status)
    }

    pub(crate) fn die_mid_stream(&self, after_tokens: usize, count: u32) {
        *self.die.lock() = (count > 0).then_some((after_tokens, count));
    }

    /// After how many tokens this request dies, consuming one.
    pub(crate) fn take_death(&self) -> Option<usize> {
        let mut d = self.die.lock();
        let (after, left) = (*d)?;
        *d = (left > 1).then_some((after, left - 1));
        Some(after)
    }

    pub(crate) fn fail_transfers(&self, count: u32) {
        *self.fail_transfers.lock() = count;
    }

    /// Whether this decode leg's transfer fails, consuming one.
    pub(crate) fn take_transfer_failure(&self) -> bool {
        let mut left = self.fail_transfers.lock();
        let fail = *left > 0;
        *left = left.saturating_sub(1);
        fail
    }

    pub(crate) fn set_healthy(&self, healthy: bool) {
        self.unhealthy.store(!healthy, Ordering::SeqCst);
    }

    pub(crate) fn healthy(&self) -> bool {
        !self.unhealthy.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::Fault;

    /// A serialized fault is the body `POST /sim/fault` reads back as the same fault.
    #[test]
    fn a_serialized_fault_is_what_sim_fault_accepts() {
        for (fault, body) in [
            (Fault::Stall, r#""stall""#),
            (Fault::FailNext { status: 503, count: 2 }, r#"{"fail_next":{"status":503,"count":2}}"#),
            (Fault::DropBatches { rank: 0, count: 1 }, r#"{"drop_batches":{"rank":0,"count":1}}"#),
            (Fault::Health { healthy: false }, r#"{"health":{"healthy":false}}"#),
        ] {
            assert_eq!(serde_json::to_string(&fault).ok().as_deref(), Some(body));
            assert_eq!(serde_json::from_str::<Fault>(body).ok(), Some(fault));
        }
    }
}
