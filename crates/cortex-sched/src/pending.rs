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
//! - **Bounded work per decision**: the same chain sent to the same holder again (a repeated
//!   prompt) shares one entry, counted by its bookings, and a first block keeps at most
//!   [`MAX_PER_FIRST`] entries (the oldest whose first token came go first), so a decision scans a
//!   bounded list whatever the request rate. An entry dropped that way only makes the estimate
//!   forget a prefix in flight; its bookings' later calls find nothing and do nothing.

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

/// Entries kept at most per first block (distinct chains or holders): what a decision scans.
pub const MAX_PER_FIRST: usize = 32;

#[derive(Debug)]
struct Entry {
    id: u64,
    holder: HolderId,
    chain: Arc<[SeqHash]>,
    /// Bookings of this chain on this holder still waiting for their first token.
    waiting: u32,
    /// When the last first token's grace ends; `None` before any first token.
    expires: Option<Timestamp>,
}

impl Entry {
    fn live(&self, now: Timestamp) -> bool {
        self.waiting > 0 || self.expires.is_none_or(|t| t > now)
    }
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
        let list = g.by_first.entry(first).or_default();
        let before = list.len();
        list.retain(|e| e.live(now));
        let mut removed = before - list.len();
        // By the chain property, equal lengths and equal last blocks are equal chains.
        let same = list
            .iter_mut()
            .find(|e| e.holder == holder && e.chain.len() == chain.len() && e.chain.last() == chain.last());
        if let Some(e) = same {
            e.waiting += 1;
            let id = e.id;
            g.len -= removed;
            return Some(PendingKey { first, id });
        }
        if list.len() >= MAX_PER_FIRST {
            // The oldest whose first token came (its blocks are being announced), else the oldest.
            let victim = list.iter().position(|e| e.waiting == 0).unwrap_or(0);
            list.remove(victim);
            removed += 1;
        }
        let id = g.next + 1;
        let list = g.by_first.entry(first).or_default();
        list.push(Entry { id, holder, chain, waiting: 1, expires: None });
        g.next = id;
        g.len = g.len + 1 - removed;
        Some(PendingKey { first, id })
    }

    /// A booking of the entry had its first token: the entry stays for [`GRACE`] more once no
    /// other booking of it waits.
    pub(crate) fn expire(&self, key: PendingKey, now: Timestamp) {
        let mut g = self.lock();
        if let Some(e) = g.by_first.get_mut(&key.first).and_then(|l| l.iter_mut().find(|e| e.id == key.id)) {
            e.waiting = e.waiting.saturating_sub(1);
            e.expires = Some(now.saturating_add(GRACE));
        }
    }

    /// A booking of the entry ended without a first token: the entry is gone at once unless
    /// another booking waits or had its first token.
    pub(crate) fn remove(&self, key: PendingKey) {
        let mut g = self.lock();
        let Some(list) = g.by_first.get_mut(&key.first) else { return };
        let before = list.len();
        if let Some(e) = list.iter_mut().find(|e| e.id == key.id) {
            e.waiting = e.waiting.saturating_sub(1);
        }
        list.retain(|e| e.id != key.id || e.waiting > 0 || e.expires.is_some());
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
        for e in list.iter().filter(|e| e.live(now)) {
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
        list.retain(|e| e.live(now));
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
    fn a_repeated_prompt_shares_one_entry_until_its_last_booking_is_done() {
        let p = PendingPrefixes::new();
        let keys: Vec<_> = (0..1_000).map(|_| p.insert(h(1), chain(1, 20), ms(0)).unwrap()).collect();
        assert_eq!(p.len(), 1, "one chain on one holder is one entry");
        let mut out = [(h(0), 0); 4];
        // All but one end without a first token: the last one still waits.
        for k in &keys[1..] {
            p.remove(*k);
        }
        assert_eq!(p.matches(&chain(1, 20), ms(5), &mut out), 1);
        p.expire(keys[0], ms(10));
        assert_eq!(p.matches(&chain(1, 20), ms(10), &mut out), 1, "within its grace");
        assert_eq!(p.matches(&chain(1, 20), ms(10).saturating_add(GRACE), &mut out), 0);
        // A booking that ends without a first token after another had one keeps the grace.
        let a = p.insert(h(2), chain(2, 8), ms(0)).unwrap();
        let b = p.insert(h(2), chain(2, 8), ms(0)).unwrap();
        p.expire(a, ms(1));
        p.remove(b);
        assert_eq!(p.matches(&chain(2, 8), ms(2), &mut out), 1);
    }

    #[test]
    fn a_decision_scans_a_bounded_list() {
        let p = PendingPrefixes::new();
        // Distinct chains sharing their first block (a system prompt, unique questions).
        let shared = |i: u64| -> Arc<[SeqHash]> {
            let mut c = chain(7, 1).to_vec();
            c.extend((0..3).map(|j| SeqHash::from_bits(5_000_000 + i * 10 + j)));
            c.into()
        };
        for i in 0..1_000 {
            p.insert(h((i % 4) as u32), shared(i), ms(0)).unwrap();
        }
        assert_eq!(p.len(), MAX_PER_FIRST);
        let mut out = [(h(0), 0); 8];
        assert_eq!(p.matches(&shared(999), ms(1), &mut out), 4, "every holder still has the shared block");
        assert!(out[..4].iter().any(|&(w, b)| w == h(3) && b == 4), "the newest chain is kept whole");
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
