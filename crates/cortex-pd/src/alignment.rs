//! Which alignment checks mean anything on a PD worker: the proxy verifies its predictions
//! continuously (predicted against reported cached tokens; the served request's first block in
//! the ledger afterwards), and on PD workers the engines report and publish differently.
//!
//! Key decision, from the engines' code (`docs/engines-pd.md`):
//! - a **vLLM decode worker** counts the tokens it pulled over NIXL as computed, so its
//!   `cached_tokens` is its local hit plus the transfer — not comparable with a prediction; it
//!   does store (and announce) the pulled blocks when they land, so the ledger check holds;
//! - an **SGLang decode worker** reports the prefill worker's `cached_tokens` (raised to its own
//!   radix match when it has a radix cache), so without a radix cache its number is the
//!   prefill's hit — checked against the prefill prediction — and it publishes no blocks at all,
//!   so the ledger check cannot apply; with `--disaggregation-decode-enable-radix-cache` it
//!   publishes what it inserts but its number mixes both sides;
//! - prefill and regular workers behave as any worker.

use cortex_hash::Engine;
use cortex_sched::Role;

/// Whether a worker's decode side keeps a prefix cache (SGLang
/// `--disaggregation-decode-enable-radix-cache`; vLLM decode workers always have prefix caching
/// when the worker does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeCache {
    /// No prefix cache on the decode side.
    Off,
    /// A prefix cache on the decode side.
    On,
}

/// What a reported `cached_tokens` is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CachedTokens {
    /// The prediction for this worker.
    OwnPrediction,
    /// The prediction for the pair's prefill worker (its hit is what the worker reports).
    PrefillPrediction,
    /// Nothing: the number mixes in transferred tokens; a difference is no misprediction.
    NotComparable,
}

/// The checks that apply to an answer of a worker in `role`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Checks {
    /// The cached-tokens comparison.
    pub cached_tokens: CachedTokens,
    /// Whether the served prompt's first block must be in the ledger for this worker afterwards
    /// (false where the worker publishes nothing).
    pub ledger_presence: bool,
}

/// The checks for a worker of `engine` in `role` whose decode side has `cache`.
#[must_use]
pub fn checks(engine: Engine, role: Role, cache: DecodeCache) -> Checks {
    let (cached_tokens, ledger_presence) = match (engine, role, cache) {
        (_, Role::Regular | Role::Prefill, _) => (CachedTokens::OwnPrediction, true),
        (Engine::Sglang, Role::Decode, DecodeCache::Off) => (CachedTokens::PrefillPrediction, false),
        // vLLM (pulled tokens counted as computed), SGLang with a decode radix cache (both sides'
        // hits in one number), and any engine added later until its code says otherwise.
        (_, Role::Decode, _) => (CachedTokens::NotComparable, true),
    };
    Checks { cached_tokens, ledger_presence }
}

/// Whether `reported` cached tokens contradict the prediction these checks compare with
/// (`predicted` for [`CachedTokens::OwnPrediction`], the prefill's for
/// [`CachedTokens::PrefillPrediction`]). An engine may report more than predicted (blocks it
/// stored that the ledger has not seen yet) but never fewer than a correct prediction.
#[must_use]
pub fn mispredicted(checks: Checks, predicted: u32, reported: u32) -> bool {
    match checks.cached_tokens {
        CachedTokens::OwnPrediction | CachedTokens::PrefillPrediction => reported < predicted,
        CachedTokens::NotComparable => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_and_engine() {
        for e in [Engine::Vllm, Engine::Sglang] {
            for r in [Role::Regular, Role::Prefill] {
                for c in [DecodeCache::Off, DecodeCache::On] {
                    let k = checks(e, r, c);
                    assert_eq!(
                        k,
                        Checks { cached_tokens: CachedTokens::OwnPrediction, ledger_presence: true }
                    );
                    assert!(mispredicted(k, 64, 32));
                    assert!(!mispredicted(k, 64, 64));
                    assert!(!mispredicted(k, 64, 80));
                }
            }
        }
        let v = checks(Engine::Vllm, Role::Decode, DecodeCache::On);
        assert_eq!(v, Checks { cached_tokens: CachedTokens::NotComparable, ledger_presence: true });
        assert!(!mispredicted(v, 0, 1000), "pulled tokens are reported as cached");
        assert!(!mispredicted(v, 1000, 0));
        let s = checks(Engine::Sglang, Role::Decode, DecodeCache::Off);
        assert_eq!(s, Checks { cached_tokens: CachedTokens::PrefillPrediction, ledger_presence: false });
        assert!(mispredicted(s, 64, 0), "compared with the prefill's prediction");
        let sr = checks(Engine::Sglang, Role::Decode, DecodeCache::On);
        assert_eq!(sr, Checks { cached_tokens: CachedTokens::NotComparable, ledger_presence: true });
    }
}
