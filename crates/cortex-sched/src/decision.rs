//! The vocabulary of a decision: the request as the scheduler sees it, the degradation chain
//! ([`MatchMode`]) with the reason for each fallback, and the ranked result ([`Ranking`]).
//!
//! Key decisions:
//! - One [`MatchMode`] enum is the degradation chain everywhere (headers, metrics, debug), with
//!   the seed's spellings: `exact_kv_events` → `load_aware` → `fallback_p2c` →
//!   `fallback_round_robin`. It names the information the choice rested on; the
//!   [`FallbackReason`] says why it is not the level above.
//! - The caller states what it could not trust ([`Untrusted`]: tokenizer failure, template
//!   mismatch, ledger not READY, exact routing off). The scheduler then never looks at an overlap
//!   for that request, so no guessed hit can arise.
//! - The result is a ranked list written into a buffer the caller lends ([`Ranking`], Pingora's
//!   `BackendSelection::iter`): admissible candidates in order (the proxy books the first and the
//!   next on retry), then the excluded ones with why, for the debug endpoint. Each candidate is a
//!   holder — (worker, DP rank) — with its score breakdown.

use std::fmt;

use cortex_hash::SeqHash;
use cortex_hash::kv::HolderId;
use cortex_radix::OverlapScores;

use crate::cluster::Role;
use crate::config::PolicyKind;
use crate::failure::FailureClass;
use crate::state::LedgerState;
use crate::time::Timestamp;

/// The degradation chain, best first. The `as_str` spellings are the `x-cortex-match-mode`
/// header values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MatchMode {
    /// The ledger is READY and the chosen holder has a hit that the score counted.
    ExactKvEvents,
    /// Chosen by the load terms: the ledger was usable but had no hit, the hit was overruled
    /// (load, watermark, bound), the caller could not trust the cache for this request, or the
    /// pool's policy is load-based.
    LoadAware,
    /// Power of two choices: load signals were partly missing (or the policy is `power_of_two`).
    FallbackP2c,
    /// Only liveness was used: no load signal at all, or a liveness-only policy (`round_robin`,
    /// `random`, `consistent_hashing`, `manual`).
    FallbackRoundRobin,
}

impl MatchMode {
    /// Every mode, best first (so that metrics can register each label value at zero).
    pub const ALL: [MatchMode; 4] = [
        MatchMode::ExactKvEvents,
        MatchMode::LoadAware,
        MatchMode::FallbackP2c,
        MatchMode::FallbackRoundRobin,
    ];

    /// The header spelling.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            MatchMode::ExactKvEvents => "exact_kv_events",
            MatchMode::LoadAware => "load_aware",
            MatchMode::FallbackP2c => "fallback_p2c",
            MatchMode::FallbackRoundRobin => "fallback_round_robin",
        }
    }
}

impl fmt::Display for MatchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the caller cannot give an exact overlap for this request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Untrusted {
    /// Rendering or tokenizing the prompt failed.
    TokenizerFailed,
    /// The prompt holds what the gateway cannot reproduce token for token (images, audio, a
    /// per-request chat template): not a failure, a known limit.
    UnreproduciblePrompt,
    /// The gateway's chat template does not match the worker's.
    TemplateMismatch,
    /// The model's ledger is not READY (syncing, stale, no events).
    LedgerNotReady,
    /// Exact routing is off for this model (misaligned profile, proxy-only mode).
    ExactRoutingOff,
}

/// What the caller knows of the cache for this request.
#[derive(Clone, Copy, Debug)]
pub enum CacheView<'a> {
    /// The ledger's answer (which counts only READY holders) and the block size in tokens.
    Overlap {
        /// Per-holder leading-block matches.
        scores: &'a OverlapScores,
        /// Tokens per block.
        block_tokens: u32,
    },
    /// No trustworthy answer.
    Untrusted(Untrusted),
}

/// Why the decision is not at the level above in the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// See [`Untrusted::TokenizerFailed`].
    TokenizerFailed,
    /// See [`Untrusted::UnreproduciblePrompt`].
    UnreproduciblePrompt,
    /// See [`Untrusted::TemplateMismatch`].
    TemplateMismatch,
    /// See [`Untrusted::LedgerNotReady`]; also when no holder of the pool is READY, and when no
    /// holder has a hit while some admissible holder's ledger is syncing or stale (it may hold
    /// the prefix unseen).
    LedgerNotReady,
    /// See [`Untrusted::ExactRoutingOff`].
    ExactRoutingOff,
    /// The ledger was usable but no admissible holder has a block of the prompt.
    NoHit,
    /// Some holder had a hit, but load (score or bound) put another holder first.
    HitOverruled,
    /// The best cache holder is above the high watermark: affinity given up for this request.
    Watermark,
    /// Some admissible holders have no fresh load report.
    LoadSignalsPartial,
    /// No admissible holder has a fresh load report.
    LoadSignalsMissing,
    /// The pool's policy does not use the ledger (or, for `power_of_two`, the load terms).
    Policy,
    /// `consistent_hashing` or `manual` without a routing key.
    NoRoutingKey,
    /// `prefix_hash` without a full block of prompt.
    NoPrefix,
}

impl FallbackReason {
    /// Every reason, in declaration order (so that metrics can register each label value at
    /// zero).
    pub const ALL: [FallbackReason; 13] = [
        FallbackReason::TokenizerFailed,
        FallbackReason::UnreproduciblePrompt,
        FallbackReason::TemplateMismatch,
        FallbackReason::LedgerNotReady,
        FallbackReason::ExactRoutingOff,
        FallbackReason::NoHit,
        FallbackReason::HitOverruled,
        FallbackReason::Watermark,
        FallbackReason::LoadSignalsPartial,
        FallbackReason::LoadSignalsMissing,
        FallbackReason::Policy,
        FallbackReason::NoRoutingKey,
        FallbackReason::NoPrefix,
    ];

    /// Snake-case name for metrics labels and debug output.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            FallbackReason::TokenizerFailed => "tokenizer_failed",
            FallbackReason::UnreproduciblePrompt => "unreproducible_prompt",
            FallbackReason::TemplateMismatch => "template_mismatch",
            FallbackReason::LedgerNotReady => "ledger_not_ready",
            FallbackReason::ExactRoutingOff => "exact_routing_off",
            FallbackReason::NoHit => "no_hit",
            FallbackReason::HitOverruled => "hit_overruled",
            FallbackReason::Watermark => "watermark",
            FallbackReason::LoadSignalsPartial => "load_signals_partial",
            FallbackReason::LoadSignalsMissing => "load_signals_missing",
            FallbackReason::Policy => "policy",
            FallbackReason::NoRoutingKey => "no_routing_key",
            FallbackReason::NoPrefix => "no_prefix",
        }
    }
}

impl From<Untrusted> for FallbackReason {
    fn from(u: Untrusted) -> Self {
        match u {
            Untrusted::TokenizerFailed => FallbackReason::TokenizerFailed,
            Untrusted::UnreproduciblePrompt => FallbackReason::UnreproduciblePrompt,
            Untrusted::TemplateMismatch => FallbackReason::TemplateMismatch,
            Untrusted::LedgerNotReady => FallbackReason::LedgerNotReady,
            Untrusted::ExactRoutingOff => FallbackReason::ExactRoutingOff,
        }
    }
}

/// A request as the scheduler sees it. No HTTP types: the proxy extracts these facts.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The model name (matched against [`crate::WorkerSpec::model`]).
    pub model: &'a str,
    /// Which pool: regular, or the prefill / decode leg of a disaggregated request.
    pub role: Role,
    /// The caller's clock.
    pub now: Timestamp,
    /// Prompt length in tokens (an estimate when tokenization failed): what a booking reserves
    /// as prefill work, less the chosen holder's cached tokens.
    pub prompt_tokens: u32,
    /// The cache as far as it can be trusted.
    pub cache: CacheView<'a>,
    /// The routing key (a header value) for `consistent_hashing` and `manual`.
    pub routing_key: Option<&'a [u8]>,
    /// The prompt's chained block hashes, for `prefix_hash` (empty when unknown).
    pub prefix: &'a [SeqHash],
    /// KV blocks the request holds at its longest (prompt and output limit), 0 when unknown: a
    /// decode holder whose bookings with it would exceed its KV capacity is excluded while
    /// another has room.
    pub kv_blocks: u32,
}

impl<'a> Request<'a> {
    /// A request with no routing key and no prefix hashes.
    #[must_use]
    pub fn new(model: &'a str, role: Role, now: Timestamp, prompt_tokens: u32, cache: CacheView<'a>) -> Self {
        Request { model, role, now, prompt_tokens, cache, routing_key: None, prefix: &[], kv_blocks: 0 }
    }
}

/// The terms of a candidate's score. `total` orders the candidates; the others explain it.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Score {
    /// The affinity term (α·matched tokens for the default scorer).
    pub affinity: f32,
    /// The active-request term (−β·active requests).
    pub load: f32,
    /// The queue term (−γ·expected queue latency in ms).
    pub queue: f32,
    /// The sum the ranking used.
    pub total: f32,
}

/// Why a holder of the pool may not take this request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exclusion {
    /// Health probes fail.
    Unhealthy,
    /// Being drained.
    Draining,
    /// Cooling down after a failure of this class.
    CoolingDown(FailureClass),
    /// Its circuit breaker is open.
    BreakerOpen,
    /// Its ledger is not READY and unready holders are excluded from exact routing.
    LedgerNotReady,
    /// It already has `cap` = ⌈(1+ε)·mean⌉ requests in flight.
    BoundedLoad {
        /// The bound in force for this decision.
        cap: u32,
    },
    /// A decode holder whose KV capacity the requests in flight there and this one would
    /// exceed, while another decode holder has room (the engine would queue it or preempt a
    /// running request).
    KvFull,
}

impl Exclusion {
    /// Snake-case name for metrics labels and debug output.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Exclusion::Unhealthy => "unhealthy",
            Exclusion::Draining => "draining",
            Exclusion::CoolingDown(_) => "cooling_down",
            Exclusion::BreakerOpen => "breaker_open",
            Exclusion::LedgerNotReady => "ledger_not_ready",
            Exclusion::BoundedLoad { .. } => "bounded_load",
            Exclusion::KvFull => "kv_full",
        }
    }
}

/// One holder with everything the decision knew about it.
///
/// Laid out in declaration order (`repr(C)`): the fields a gather writes as zero (the match,
/// the score and the key, filled in later) are contiguous after the holder, so writing a
/// candidate takes a few wide stores for them (2.6 % of a 64-worker decision's instructions).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Candidate {
    /// The (worker, DP rank) to send the request to.
    pub holder: HolderId,
    /// Prompt tokens this holder has in GPU KV cache per the ledger (0 when the request's cache
    /// view is untrusted or this holder's ledger is not READY).
    pub matched_tokens: u32,
    /// The part of `matched_tokens` the score counted (0 when affinity was given up or the
    /// policy ignores the cache).
    pub affinity_tokens: u32,
    /// `cache_aware`: prompt tokens the holder will have once requests this gateway sent it are
    /// prefilled (a prefix in flight, not yet in the ledger; see [`crate::pending`]). Shortens
    /// the estimated time to first token, never counted as a hit.
    pub pending_tokens: u32,
    /// `cache_aware`: the estimated time to first token on this holder, milliseconds (0 for
    /// other policies and excluded candidates).
    pub est_ttft_ms: f32,
    /// The score (zero for excluded candidates and liveness-only policies). Its terms besides
    /// `total` are filled only when the ranking explains itself ([`Ranking::explaining`]); they
    /// are zero otherwise.
    pub score: Score,
    /// Sort key (ascending) built by the policy (see `scheduler::key`).
    pub(crate) key: u64,
    /// What the score reads besides the fields above.
    pub(crate) facts: Facts,
    /// Prefill tokens a booking on this holder reserves: prompt tokens less `matched_tokens`.
    pub prefill_tokens: u32,
    /// KV blocks a booking on this holder reserves ([`Request::kv_blocks`]).
    pub kv_blocks: u32,
    /// KV blocks the requests in flight on the holder hold at their longest: this gateway's
    /// bookings, scaled up when the engine reports more requests than this gateway booked
    /// (decode pools, for a request whose size is known; 0 otherwise).
    pub kv_committed: u32,
    /// Requests in flight: this gateway's bookings, or the engine's running + waiting when it
    /// reports more.
    pub active_requests: u32,
    /// This gateway's bookings alone (what the load bound counts).
    pub booked_requests: u32,
    /// Expected queue latency in milliseconds. `cache_aware`: the queued prefill work
    /// (`queue_tokens`) at the holder's learned speed. Other policies: the larger of this
    /// gateway's booked prefill work still ahead (its virtual prefill clock at the configured
    /// rate) and the engine-reported waiting prefill tokens at the configured rate.
    pub queue_latency_ms: f32,
    /// Prefill tokens queued ahead of the request: what the engine last reported waiting (vLLM,
    /// which reports requests: times the mean uncached size of this gateway's requests there)
    /// plus what this gateway booked there since that report, or this gateway's own outstanding
    /// bookings when those are more or no fresh report exists.
    pub queue_tokens: u32,
    /// The holder's learned prefill speed, tokens per second: under `cache_aware`, its pool's
    /// mean learned speed while the holder has fewer than
    /// [`TRAINED_SAMPLES`](crate::learn::TRAINED_SAMPLES) samples and another holder of the pool
    /// has that many; in a decode pool, the transfer's speed
    /// ([`SchedConfig::transfer_tokens_per_sec`](crate::SchedConfig::transfer_tokens_per_sec)).
    pub rate_tokens_per_sec: f32,
    /// KV usage fraction from a fresh engine report.
    pub kv_usage: Option<f32>,
    /// Why it may not take the request; `None` for admissible candidates.
    pub excluded: Option<Exclusion>,
    /// Whether the holder's load signal counted as present (always under booked-only signals).
    pub load_reported: bool,
    /// The holder's ledger state.
    pub ledger: LedgerState,
}

/// What the score reads of a candidate besides its public fields: the estimate the gather read
/// and how full the holder's cache is, kept in the candidate so that scoring reads no holder
/// state again (a second vector beside the candidates cost a push and an index per holder).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Facts {
    pub(crate) secs_per_token: f64,
    pub(crate) overhead_s: f64,
    pub(crate) cache_fill: f32,
}

/// The result of a decision, in a buffer the caller lends and reuses.
///
/// The candidates stay where the decision wrote them (pool order); the ranking is a sorted array
/// of keys that index them, so ranking 512 holders moves 4 KiB of keys, not 64 KiB of candidates.
#[derive(Clone, Debug)]
pub struct Ranking {
    pub(crate) candidates: Vec<Candidate>,
    /// Sort keys, admissible first; the low 20 bits of each index `candidates`. The first
    /// `RANKED` admissible ones are sorted; all of them when `sorted`.
    pub(crate) order: Vec<u64>,
    pub(crate) sorted: bool,
    /// Whether `order` holds this decision's ranking yet (a policy may write it as it scores).
    pub(crate) ordered: bool,
    pub(crate) admissible: usize,
    pub(crate) mode: MatchMode,
    pub(crate) reason: Option<FallbackReason>,
    pub(crate) policy: PolicyKind,
    /// Whether each candidate's score carries its terms (see [`Ranking::explaining`]).
    pub(crate) explain: bool,
}

impl Default for Ranking {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl Ranking {
    /// An empty ranking with room for `holders` candidates (the pool size, to allocate nothing
    /// per decision).
    #[must_use]
    pub fn with_capacity(holders: usize) -> Self {
        Ranking {
            candidates: Vec::with_capacity(holders),
            order: Vec::with_capacity(holders),
            sorted: true,
            ordered: false,
            admissible: 0,
            mode: MatchMode::FallbackRoundRobin,
            reason: None,
            policy: PolicyKind::CacheAware,
            explain: false,
        }
    }

    /// This ranking, whose decisions fill each candidate's score with its terms
    /// ([`Scorer::score`](crate::Scorer::score)), not only the `total` that orders them
    /// ([`Scorer::total`](crate::Scorer::total)): for a view that explains a decision. The
    /// terms cost a twentieth of a 64-holder decision, which the request path does not pay.
    #[must_use]
    pub fn explaining(mut self) -> Self {
        self.explain = true;
        self
    }

    pub(crate) fn reset(&mut self, policy: PolicyKind) {
        self.candidates.clear();
        self.order.clear();
        self.sorted = true;
        self.ordered = false;
        self.admissible = 0;
        self.mode = MatchMode::FallbackRoundRobin;
        self.reason = None;
        self.policy = policy;
    }

    fn iter_keys<'a>(&'a self, keys: &'a [u64]) -> Iter<'a> {
        Iter { candidates: &self.candidates, keys: keys.iter() }
    }

    /// Admissible candidates, best first: book the first, the next on retry. The first
    /// [`RANKED`](crate::RANKED) are in rank order; beyond them the order is unspecified until
    /// [`Ranking::sort_all`].
    #[must_use]
    pub fn admissible(&self) -> Iter<'_> {
        self.iter_keys(&self.order[..self.admissible])
    }

    /// The best candidate.
    #[must_use]
    pub fn first(&self) -> Option<&Candidate> {
        self.admissible().next()
    }

    /// Excluded holders of the pool, with why, in pool order.
    #[must_use]
    pub fn excluded(&self) -> Iter<'_> {
        self.iter_keys(&self.order[self.admissible..])
    }

    /// Puts every admissible candidate in rank order (the debug view; a decision orders only the
    /// first [`RANKED`](crate::RANKED)). Sorts in place; no allocation.
    pub fn sort_all(&mut self) {
        if !self.sorted {
            self.order[..self.admissible].sort_unstable();
            self.sorted = true;
        }
    }

    /// Every holder of the pool: admissible ones in rank order, then excluded ones.
    #[must_use]
    pub fn all(&self) -> Iter<'_> {
        self.iter_keys(&self.order)
    }

    /// The chain level of the decision.
    #[must_use]
    pub fn mode(&self) -> MatchMode {
        self.mode
    }

    /// Why it is not `exact_kv_events` (`None` exactly when it is).
    #[must_use]
    pub fn reason(&self) -> Option<FallbackReason> {
        self.reason
    }

    /// The policy that decided.
    #[must_use]
    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// The predicted cache hit on the first candidate, in tokens (the `x-cortex-cache-hit-tokens`
    /// header).
    #[must_use]
    pub fn cache_hit_tokens(&self) -> u32 {
        self.first().map_or(0, |c| c.matched_tokens)
    }
}

/// Candidates of a [`Ranking`] in order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    candidates: &'a [Candidate],
    keys: std::slice::Iter<'a, u64>,
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a Candidate;

    #[inline]
    fn next(&mut self) -> Option<&'a Candidate> {
        self.keys.next().map(|&k| &self.candidates[(k & crate::scheduler::INDEX_MASK) as usize])
    }

    #[inline]
    fn nth(&mut self, n: usize) -> Option<&'a Candidate> {
        self.keys.nth(n).map(|&k| &self.candidates[(k & crate::scheduler::INDEX_MASK) as usize])
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.keys.size_hint()
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.keys.next_back().map(|&k| &self.candidates[(k & crate::scheduler::INDEX_MASK) as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::{FallbackReason, MatchMode};

    #[test]
    fn all_lists_every_variant_once() {
        // The matches are exhaustive: a new variant fails to compile here until it is listed.
        let mode = |m: MatchMode| match m {
            MatchMode::ExactKvEvents
            | MatchMode::LoadAware
            | MatchMode::FallbackP2c
            | MatchMode::FallbackRoundRobin => m.as_str(),
        };
        let names: std::collections::BTreeSet<_> = MatchMode::ALL.iter().map(|&m| mode(m)).collect();
        assert_eq!(names.len(), MatchMode::ALL.len());
        let reason = |r: FallbackReason| match r {
            FallbackReason::TokenizerFailed
            | FallbackReason::UnreproduciblePrompt
            | FallbackReason::TemplateMismatch
            | FallbackReason::LedgerNotReady
            | FallbackReason::ExactRoutingOff
            | FallbackReason::NoHit
            | FallbackReason::HitOverruled
            | FallbackReason::Watermark
            | FallbackReason::LoadSignalsPartial
            | FallbackReason::LoadSignalsMissing
            | FallbackReason::Policy
            | FallbackReason::NoRoutingKey
            | FallbackReason::NoPrefix => r.as_str(),
        };
        let names: std::collections::BTreeSet<_> = FallbackReason::ALL.iter().map(|&r| reason(r)).collect();
        assert_eq!(names.len(), 13, "FallbackReason::ALL repeats or misses a reason");
    }
}
