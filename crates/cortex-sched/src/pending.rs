//! Prefixes in flight: what this gateway sent to each holder and the engine has not announced
//! yet. A request dispatched to a holder will leave its prompt's blocks in that holder's cache
//! once its prefill is done; until the engine's `BlockStored` events for them are in the ledger,
//! the ledger cannot know. A second request with the same prefix arriving meanwhile (a burst of
//! requests sharing a system prompt, a conversation's next turn sent before the last answer
//! ended) would otherwise be spread to another holder and recompute the prefix there — twice
//! the work, and a second copy in another cache.
//!
//! Key decisions:
//! - **Kept with the booking**: a booking records its prompt's chain here when it is made, marks
//!   it to expire shortly after its first token (by then the blocks are cached and their events
//!   on their way, see [`GRACE`]), and removes it at once if the request ends without one (it
//!   may never have been prefilled).
//! - **Scoring only, never a claimed hit**: a pending prefix shortens the estimated time to first
//!   token on its holder (the request will find the prefix there once the queue ahead of it —
//!   which includes the pending request — is done), but the hit the gateway reports and checks
//!   (`x-cortex-cache-hit-tokens`, the alignment checks) stays the ledger's, so no prediction
//!   rests on it.
//! - **Looked up by the chain's first block**: requests share a prefix only if they share its
//!   first block, and by the chain property the longest common prefix of two chains is found by
//!   a binary search on equality. The decision path locks one mutex and allocates nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cortex_hash::SeqHash;
use cortex_hash::kv::HolderId;

use crate::time::Timestamp;

/// How long a prefix stays pending after its request's first token: the events announcing its
/// blocks reach the ledger within milliseconds of the prefill.
pub const GRACE: Duration = Duration::from_secs(2);

/// Entries kept at most; beyond, expired ones are swept, then the oldest dropped.
pub const MAX_ENTRIES: usize = 16_384;

#[derive(Debug)]
struct Entry {
    id: u64,
    holder: HolderId,
    chain: Arc<[SeqHash]>,
    /// `None` while the request has no first token.
    expires: Option<Timestamp>,
}

#[derive(Debug, Default)]
struct Inner {
    by_first: HashMap<u64, Vec<Entry>>,
    len: usize,
    next: u64,
}

/// The prefixes in flight, per holder (see the module docs).
#[derive(Debug, Default)]
pub struct PendingPrefixes {
    inner: Mutex<Inner>,
}

/// A pending entry's key, kept by its booking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PendingKey {
    first: u64,
    id: u64,
}

/// Leading blocks `a` and `b` share: by the chain property, equal blocks at `i` mean equal
/// blocks before it, so the shared prefix is found by a binary search.
fn shared_blocks(a: &[SeqHash], b: &[SeqHash]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] { lo = mid } else { hi = mid - 1 }
    }
    lo
}

impl PendingPrefixes {
    /// An empty set.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Entries held now (expired ones not yet swept included).
    #[must_use]
    pub fn len(&self) -> usize {
        self.lock().len
    }

    /// Whether none is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that `chain` was sent to `holder`.
    pub(crate) fn insert(
        &self,
        holder: HolderId,
        chain: Arc<[SeqHash]>,
        now: Timestamp,
    ) -> Option<PendingKey> {
        let first = chain.first()?.to_bits();
        let mut g = self.lock();
        if g.len >= MAX_ENTRIES {
            sweep(&mut g, now);
        }
        g.next += 1;
        let id = g.next;
        let list = g.by_first.entry(first).or_default();
        let before = list.len();
        list.retain(|e| e.expires.is_none_or(|t| t > now));
        let swept = before - list.len();
        list.push(Entry { id, holder, chain, expires: None });
        g.len = g.len + 1 - swept;
        Some(PendingKey { first, id })
    }

    /// The entry's request had its first token: it stays for [`GRACE`] more.
    pub(crate) fn expire(&self, key: PendingKey, now: Timestamp) {
        let mut g = self.lock();
        if let Some(e) = g.by_first.get_mut(&key.first).and_then(|l| l.iter_mut().find(|e| e.id == key.id)) {
            e.expires = Some(now.saturating_add(GRACE));
        }
    }

    /// The entry's request ended without a first token: it is gone at once.
    pub(crate) fn remove(&self, key: PendingKey) {
        let mut g = self.lock();
        let Some(list) = g.by_first.get_mut(&key.first) else { return };
        let before = list.len();
        list.retain(|e| e.id != key.id);
        let removed = before - list.len();
        if list.is_empty() {
            g.by_first.remove(&key.first);
        }
        g.len -= removed;
    }

    /// The longest pending prefix of `seq` on each holder that has one, in blocks, written to
    /// `out` (at most its length, longest kept first); returns how many were written. Allocates
    /// nothing.
    pub fn matches(&self, seq: &[SeqHash], now: Timestamp, out: &mut [(HolderId, u32)]) -> usize {
        let Some(first) = seq.first() else { return 0 };
        let g = self.lock();
        let Some(list) = g.by_first.get(&first.to_bits()) else { return 0 };
        let mut n = 0;
        for e in list.iter().filter(|e| e.expires.is_none_or(|t| t > now)) {
            let blocks = shared_blocks(seq, &e.chain) as u32;
            if blocks == 0 {
                continue;
            }
            let cap = out.len();
            match out[..n].iter().position(|(h, _)| *h == e.holder) {
                Some(j) => out[j].1 = out[j].1.max(blocks),
                None if n < cap => {
                    out[n] = (e.holder, blocks);
                    n += 1;
                }
                None => {
                    // Full: keep the longest.
                    if let Some(min) = out.iter_mut().min_by_key(|(_, b)| *b)
                        && min.1 < blocks
                    {
                        *min = (e.holder, blocks);
                    }
                }
            }
        }
        n
    }
}

/// Drops every expired entry; if that is not enough, the entries with the smallest ids (the
/// oldest) until half the room is free.
fn sweep(g: &mut Inner, now: Timestamp) {
    for list in g.by_first.values_mut() {
        list.retain(|e| e.expires.is_none_or(|t| t > now));
    }
    g.by_first.retain(|_, l| !l.is_empty());
    g.len = g.by_first.values().map(Vec::len).sum();
    if g.len >= MAX_ENTRIES {
        let cut = g.next.saturating_sub((MAX_ENTRIES / 2) as u64);
        for list in g.by_first.values_mut() {
            list.retain(|e| e.id > cut);
        }
        g.by_first.retain(|_, l| !l.is_empty());
        g.len = g.by_first.values().map(Vec::len).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cortex_hash::kv::{DpRank, WorkerId};

    fn chain(base: u64, n: u64) -> Arc<[SeqHash]> {
        (0..n).map(|i| SeqHash::from_bits(base * 1_000 + i)).collect()
    }

    fn h(w: u32) -> HolderId {
        HolderId::new(WorkerId(w), DpRank(0))
    }

    fn ms(n: u64) -> Timestamp {
        Timestamp::from_millis(n)
    }

    #[test]
    fn shared_prefixes_by_binary_search() {
        let a = chain(1, 10);
        let mut b: Vec<SeqHash> = a[..6].to_vec();
        b.extend((0..4).map(|i| SeqHash::from_bits(9_999_000 + i)));
        assert_eq!(shared_blocks(&a, &b), 6);
        assert_eq!(shared_blocks(&a, &a[..3]), 3);
        assert_eq!(shared_blocks(&a, &chain(2, 10)), 0);
        assert_eq!(shared_blocks(&[], &a), 0);
    }

    #[test]
    fn a_pending_prefix_lives_until_its_grace_after_the_first_token() {
        let p = PendingPrefixes::new();
        let k = p.insert(h(1), chain(1, 20), ms(0)).unwrap();
        p.insert(h(2), chain(1, 5), ms(0)).unwrap();
        let seq = chain(1, 30);
        let mut out = [(h(0), 0); 4];
        let n = p.matches(&seq, ms(10), &mut out);
        let mut got = out[..n].to_vec();
        got.sort();
        assert_eq!(got, [(h(1), 20), (h(2), 5)]);
        p.expire(k, ms(100));
        assert_eq!(p.matches(&seq, ms(100).saturating_add(GRACE), &mut out), 1, "only h2 left");
        assert_eq!(p.matches(&chain(3, 5), ms(0), &mut out), 0, "another first block");
    }

    #[test]
    fn a_request_that_ends_without_a_first_token_leaves_nothing() {
        let p = PendingPrefixes::new();
        let k = p.insert(h(1), chain(1, 20), ms(0)).unwrap();
        assert_eq!(p.len(), 1);
        p.remove(k);
        assert!(p.is_empty());
        let mut out = [(h(0), 0); 4];
        assert_eq!(p.matches(&chain(1, 20), ms(1), &mut out), 0);
        assert!(p.insert(h(1), Arc::from(Vec::new()), ms(0)).is_none(), "an empty chain is not recorded");
    }

    #[test]
    fn the_set_stays_bounded() {
        let p = PendingPrefixes::new();
        for i in 0..(MAX_ENTRIES as u64 + 100) {
            p.insert(h(1), chain(i, 2), ms(0));
        }
        assert!(p.len() <= MAX_ENTRIES, "{}", p.len());
    }
}
