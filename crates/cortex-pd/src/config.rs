//! The PD settings, plain and typed (the binary's YAML converts into them and names the key of a
//! bad value).
//!
//! Key decision: the choices the failure rules leave open are settings with the safe default —
//! after a prefill succeeded and its decode leg failed, run the request once more on a single
//! worker (the seed's rule) rather than on a new pair; a request that must not run twice is
//! declared by a rule here or by the client's `x-cortex-no-replay` header, never guessed.

use std::time::Duration;

/// What to do when the prefill leg succeeded and the decode leg failed before the first byte
/// reached the client (its bootstrap handshake, its KV transfer, or the worker itself).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransferFailure {
    /// Run the request on one worker with a cold prefill: a regular worker if the model has one,
    /// else (vLLM) a decode worker prefilling locally.
    #[default]
    SingleWorker,
    /// Dispatch a new pair with another decode worker (the same prefill worker when it is still
    /// admissible) and a new bootstrap room.
    RechooseDecode,
}

impl TransferFailure {
    /// The configuration spelling.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            TransferFailure::SingleWorker => "single_worker",
            TransferFailure::RechooseDecode => "rechoose_decode",
        }
    }
}

/// Whether a request may be sent to workers again after a leg failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Replay {
    /// Retries and fallbacks before the first byte reached the client.
    #[default]
    Allowed,
    /// Never again once any leg may have reached an engine: the upstream error goes to the client
    /// (a connection that was refused reached nothing, so it is still retried).
    Never,
}

/// The request header with which a client says its request must not run twice (`1`, `true` or
/// `yes`, any case; anything else, or no header, leaves the configured rule).
pub const NO_REPLAY_HEADER: &str = "x-cortex-no-replay";

impl Replay {
    /// The rule for one request: the configured one, made `Never` by the client's
    /// [`NO_REPLAY_HEADER`].
    #[must_use]
    pub fn for_request(self, header: Option<&[u8]>) -> Replay {
        let on = header.is_some_and(|h| {
            let h = h.trim_ascii();
            h.eq_ignore_ascii_case(b"1") || h.eq_ignore_ascii_case(b"true") || h.eq_ignore_ascii_case(b"yes")
        });
        if on { Replay::Never } else { self }
    }
}

/// The PD settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdConfig {
    /// After a successful prefill, a failed decode leg is followed by…
    pub transfer_failure: TransferFailure,
    /// Whether failed requests may be sent again (see [`Replay`]).
    pub replay: Replay,
    /// Dispatches in all — pairs and single-worker fallbacks together (1 = no retry).
    pub max_attempts: u32,
    /// Time for all dispatches together, from the first one: no new dispatch after it.
    pub budget: Duration,
    /// The bootstrap port assumed for an SGLang prefill worker whose `/server_info` does not
    /// report `disaggregation_bootstrap_port` (`None`: send `null`, as SGLang's routers do).
    pub default_bootstrap_port: Option<u16>,
    /// vLLM: send a request to the best decode worker alone — skipping the prefill leg — when
    /// the prompt tokens that worker lacks (known from the ledger) are at most this many
    /// (`None`: always disaggregate). SGLang decode workers refuse requests without a bootstrap
    /// room, so this never applies to them.
    pub decode_only_max_uncached: Option<u32>,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            transfer_failure: TransferFailure::SingleWorker,
            replay: Replay::Allowed,
            max_attempts: 3,
            budget: Duration::from_secs(30),
            default_bootstrap_port: None,
            decode_only_max_uncached: None,
        }
    }
}

/// Why a [`PdConfig`] is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PdConfigError {
    /// `max_attempts` is 0: not even the first dispatch would be allowed.
    #[error("max_attempts must be at least 1")]
    NoAttempts,
    /// `budget` is zero.
    #[error("the retry budget must be longer than zero")]
    NoBudget,
}

impl PdConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// The first setting that cannot act.
    pub fn validate(&self) -> Result<(), PdConfigError> {
        if self.max_attempts == 0 {
            return Err(PdConfigError::NoAttempts);
        }
        if self.budget.is_zero() {
            return Err(PdConfigError::NoBudget);
        }
        Ok(())
    }

    /// The bootstrap port to send for a prefill worker: what its `/server_info` reported, else
    /// the configured default, else none (`null` on the wire).
    #[must_use]
    pub fn bootstrap_port(&self, reported: Option<u16>) -> Option<u16> {
        reported.or(self.default_bootstrap_port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_only_ever_forbids() {
        for (h, want) in [
            (None, Replay::Allowed),
            (Some(&b"1"[..]), Replay::Never),
            (Some(b" TRUE "), Replay::Never),
            (Some(b"yes"), Replay::Never),
            (Some(b"0"), Replay::Allowed),
            (Some(b"no"), Replay::Allowed),
            (Some(b""), Replay::Allowed),
        ] {
            assert_eq!(Replay::Allowed.for_request(h), want, "{h:?}");
            assert_eq!(Replay::Never.for_request(h), Replay::Never, "a header cannot allow");
        }
    }

    #[test]
    fn validation_and_bootstrap_port_precedence() {
        assert_eq!(PdConfig::default().validate(), Ok(()));
        let c = PdConfig { max_attempts: 0, ..PdConfig::default() };
        assert_eq!(c.validate(), Err(PdConfigError::NoAttempts));
        let c = PdConfig { budget: Duration::ZERO, ..PdConfig::default() };
        assert_eq!(c.validate(), Err(PdConfigError::NoBudget));
        let c = PdConfig { default_bootstrap_port: Some(8998), ..PdConfig::default() };
        assert_eq!(c.bootstrap_port(Some(9000)), Some(9000));
        assert_eq!(c.bootstrap_port(None), Some(8998));
        assert_eq!(PdConfig::default().bootstrap_port(None), None);
        assert_eq!(TransferFailure::default().as_str(), "single_worker");
    }
}
