//! The holder slots readers see: per slot the holder's id, per group of 32 slots an `active`
//! and a `ready` mask.
//!
//! Key decision: a holder becomes visible to queries by one Release `fetch_or` of its active bit,
//! after its id was stored, so a reader that sees the bit (Acquire) reads the right id; it stops
//! being counted by clearing the bit, before anything else of it is torn down. A slot is reused
//! only after an epoch grace period (see `Ledger::remove_worker`), so a running query never pairs
//! an old bit with a new id. Checked by the loom model below.

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Slots per group (a run's mask word has one bit per holder of a group; its cuts fill eight words).
pub(crate) const GROUP: u32 = 32;

pub(crate) struct Slots {
    active: Box<[AtomicU32]>,
    ready: Box<[AtomicU32]>,
    ids: Box<[AtomicU64]>,
    groups_used: AtomicU32,
}

#[inline]
fn at(slot: u32) -> (usize, u32) {
    ((slot / GROUP) as usize, 1u32 << (slot % GROUP))
}

impl Slots {
    pub(crate) fn new(slots: u32) -> Slots {
        let groups = slots.div_ceil(GROUP) as usize;
        Slots {
            active: (0..groups).map(|_| AtomicU32::new(0)).collect(),
            ready: (0..groups).map(|_| AtomicU32::new(0)).collect(),
            ids: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            groups_used: AtomicU32::new(0),
        }
    }

    /// Makes `slot` visible with `id` (not ready).
    pub(crate) fn publish(&self, slot: u32, id: u64) {
        let (g, bit) = at(slot);
        #[cfg(not(cortex_loom_bug = "id_after_active"))]
        // Relaxed: published by the Release fetch_or of the active bit below.
        self.ids[slot as usize].store(id, Ordering::Relaxed);
        // Release: a reused slot starts not ready; `ready` is only read together with `active`.
        self.ready[g].fetch_and(!bit, Ordering::Release);
        // Release: a reader that sees the new group count (Acquire) sees its masks' set-up.
        self.groups_used.fetch_max(g as u32 + 1, Ordering::Release);
        // Release: a reader that sees the active bit (Acquire) sees the holder's id.
        self.active[g].fetch_or(bit, Ordering::Release);
        #[cfg(cortex_loom_bug = "id_after_active")]
        // Relaxed (negative control): the deliberate bug is storing the id after the bit.
        self.ids[slot as usize].store(id, Ordering::Relaxed);
    }

    /// Stops counting `slot` at once.
    pub(crate) fn retract(&self, slot: u32) {
        let (g, bit) = at(slot);
        self.active[g].fetch_and(!bit, Ordering::SeqCst);
        self.ready[g].fetch_and(!bit, Ordering::SeqCst);
    }

    pub(crate) fn set_ready(&self, slot: u32, ready: bool) {
        let (g, bit) = at(slot);
        if ready {
            // Release: pairs with the Acquire load in `counted`.
            self.ready[g].fetch_or(bit, Ordering::Release);
        } else {
            // Release: as above.
            self.ready[g].fetch_and(!bit, Ordering::Release);
        }
    }

    /// Groups that ever had a holder.
    #[inline]
    pub(crate) fn groups(&self) -> usize {
        // Acquire: pairs with the Release in `publish`.
        self.groups_used.load(Ordering::Acquire) as usize
    }

    /// Group `g`'s active holders, and only the ready ones if `ready_only`.
    #[inline]
    pub(crate) fn counted(&self, g: usize, ready_only: bool) -> u32 {
        // Acquire: pairs with the Release of the active bit in `publish` (ids are published by it).
        let mut mask = self.active[g].load(Ordering::Acquire);
        if ready_only {
            // Acquire: pairs with the Release updates in `set_ready`.
            mask &= self.ready[g].load(Ordering::Acquire);
        }
        mask
    }

    /// The id stored for `slot`.
    #[inline]
    pub(crate) fn id(&self, slot: u32) -> u64 {
        // Acquire: pairs with the Release of the holder's active bit (`publish`).
        self.ids[slot as usize].load(Ordering::Acquire)
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.ids.len() * 8 + self.active.len() * 8
    }
}

/// loom model of publishing a holder (run by `cargo xtask loom`), with its negative control
/// (`CORTEX_LOOM_BUG=id_after_active`).
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// A reader that counts a freshly published holder reads its id, never a stale one.
    #[test]
    #[cfg_attr(cortex_loom_bug = "id_after_active", should_panic(expected = "stale id"))]
    fn holder_is_published_with_its_id() {
        let found = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let sink = found.clone();
        loom::model(move || {
            let s = Arc::new(Slots::new(GROUP));
            let w = {
                let s = s.clone();
                thread::spawn(move || s.publish(3, 0xABCD))
            };
            let seen = (s.groups() > 0 && s.counted(0, false) & (1 << 3) != 0).then(|| s.id(3));
            w.join().unwrap();
            if let Some(id) = seen
                && id != 0xABCD
            {
                sink.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get_or_insert(format!("stale id {id:#x}"));
            }
        });
        let v = found.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        assert!(v.is_none(), "{}", v.unwrap_or_default());
    }
}
