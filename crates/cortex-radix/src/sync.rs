//! The sync shim: every atomic, lock and epoch the lock-free paths use comes from here.
//!
//! Key decision: under `--cfg loom` (with `--cfg crossbeam_loom`, as `cargo xtask loom` sets) the
//! shim swaps `std`'s atomics and locks for loom's, and crossbeam-epoch is built with its own loom
//! support, so the loom models in `table.rs`, `run.rs` and `slots.rs` check the very code the
//! ledger runs rather than a copy of it. Outside this module, `std::sync::atomic` is named only
//! for statistics counters (bytes, blocks, evictions) that no lock-free path orders anything by,
//! renamed `Std*` where they are imported so they cannot be mistaken for the shim's.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering, fence};

pub(crate) use crossbeam_epoch as epoch;

/// A mutual-exclusion lock for the writer side (readers never take one). `parking_lot` in normal
/// builds; loom's mutex under loom. The lock itself is never poisoned; a thread that panics while
/// it holds a holder's state marks that holder poisoned instead (`writer::PoisonOnPanic`), and
/// nothing reads or changes the state again.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T> {
    #[cfg(not(loom))]
    inner: parking_lot::Mutex<T>,
    #[cfg(loom)]
    inner: loom::sync::Mutex<T>,
}

#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;
#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        {
            Mutex { inner: parking_lot::Mutex::new(value) }
        }
        #[cfg(loom)]
        {
            Mutex { inner: loom::sync::Mutex::new(value) }
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(not(loom))]
        {
            self.inner.lock()
        }
        #[cfg(loom)]
        {
            self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        #[cfg(not(loom))]
        {
            self.inner.try_lock()
        }
        #[cfg(loom)]
        {
            match self.inner.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }
}

/// Hints the CPU to fetch the cache line at `p` (a no-op off x86-64 and under loom).
#[inline]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    // SAFETY: a prefetch is only a hint: it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = p;
}
