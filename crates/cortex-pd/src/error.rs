//! The one error type of the crate, with who is to blame and whether sending the request again
//! is safe; the proxy turns it into a response in its one place for that.

use cortex_sched::FailureClass;

use crate::json::JsonError;
use crate::machine::Leg;

/// Who caused a PD failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Blame {
    /// The client's request (not JSON, too long for the context, refused by policy).
    Client,
    /// The prefill worker.
    Prefill,
    /// The decode worker.
    Decode,
    /// A regular worker serving the single-worker fallback.
    Regular,
    /// The gateway (no worker of a role can take the request).
    Gateway,
}

impl Blame {
    /// Snake-case name for metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Blame::Client => "client",
            Blame::Prefill => "prefill",
            Blame::Decode => "decode",
            Blame::Regular => "regular",
            Blame::Gateway => "gateway",
        }
    }

    pub(crate) const fn of(leg: Leg, class: FailureClass) -> Blame {
        if is_request_problem(class) {
            return Blame::Client;
        }
        match leg {
            Leg::Prefill => Blame::Prefill,
            Leg::Decode | Leg::DecodeLocal => Blame::Decode,
            Leg::Regular => Blame::Regular,
        }
    }
}

/// A failure the request causes wherever it goes: no other worker would answer differently.
pub(crate) const fn is_request_problem(class: FailureClass) -> bool {
    matches!(class, FailureClass::ContextLengthExceeded | FailureClass::ContentPolicy)
}

/// Why a disaggregated request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PdError {
    /// The client's body is not the JSON object the legs need.
    #[error("the request body cannot be prepared for disaggregation: {0}")]
    Body(#[from] JsonError),
    /// No prefill worker of the model can take the request.
    #[error("no prefill worker is available")]
    NoPrefill,
    /// No decode worker of the model can take the request.
    #[error("no decode worker is available")]
    NoDecode,
    /// Every allowed dispatch failed before the first byte; the last failure.
    #[error("the {} leg failed ({}) after {attempts} dispatch(es)", leg.as_str(), class.as_str())]
    Exhausted {
        /// The leg that failed last.
        leg: Leg,
        /// Its failure class.
        class: FailureClass,
        /// Dispatches made.
        attempts: u32,
    },
    /// A leg failed and the request must not run twice ([`crate::Replay::Never`]): the upstream
    /// error as it came.
    #[error("the {} leg failed ({}) and the request must not run twice", leg.as_str(), class.as_str())]
    NotReplayed {
        /// The leg.
        leg: Leg,
        /// Its failure class.
        class: FailureClass,
    },
    /// The answer broke after its first byte reached the client (never replayed).
    #[error("the {} leg broke after the first byte ({})", leg.as_str(), class.as_str())]
    MidStream {
        /// The leg that was streaming.
        leg: Leg,
        /// Its failure class.
        class: FailureClass,
    },
}

impl PdError {
    /// Who is to blame.
    #[must_use]
    pub fn blame(&self) -> Blame {
        match *self {
            PdError::Body(_) => Blame::Client,
            PdError::NoPrefill | PdError::NoDecode => Blame::Gateway,
            PdError::Exhausted { leg, class, .. }
            | PdError::NotReplayed { leg, class }
            | PdError::MidStream { leg, class } => Blame::of(leg, class),
        }
    }

    /// Whether the client may send the same request again: not for its own mistakes, not when it
    /// declared it must not run twice and it may have run.
    #[must_use]
    pub fn retry_safe(&self) -> bool {
        match *self {
            PdError::Body(_) | PdError::NotReplayed { .. } => false,
            PdError::NoPrefill | PdError::NoDecode => true,
            PdError::Exhausted { class, .. } | PdError::MidStream { class, .. } => !is_request_problem(class),
        }
    }

    /// The failure class of the upstream failure, if the error is one.
    #[must_use]
    pub fn class(&self) -> Option<FailureClass> {
        match *self {
            PdError::Exhausted { class, .. }
            | PdError::NotReplayed { class, .. }
            | PdError::MidStream { class, .. } => Some(class),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blame_and_retry_safety() {
        let e = PdError::Exhausted { leg: Leg::Prefill, class: FailureClass::ServerError, attempts: 3 };
        assert_eq!((e.blame(), e.retry_safe()), (Blame::Prefill, true));
        let e =
            PdError::Exhausted { leg: Leg::Decode, class: FailureClass::ContextLengthExceeded, attempts: 1 };
        assert_eq!((e.blame(), e.retry_safe()), (Blame::Client, false));
        let e = PdError::NotReplayed { leg: Leg::Decode, class: FailureClass::Timeout };
        assert_eq!((e.blame(), e.retry_safe()), (Blame::Decode, false));
        let e = PdError::MidStream { leg: Leg::Regular, class: FailureClass::ServerError };
        assert_eq!((e.blame(), e.retry_safe()), (Blame::Regular, true));
        assert_eq!(PdError::NoDecode.blame(), Blame::Gateway);
        assert!(PdError::NoPrefill.retry_safe());
        let e = PdError::from(JsonError::NotAnObject);
        assert_eq!((e.blame(), e.retry_safe(), e.class()), (Blame::Client, false, None));
        assert_eq!(
            PdError::MidStream { leg: Leg::DecodeLocal, class: FailureClass::Timeout }.class(),
            Some(FailureClass::Timeout)
        );
        assert!(e.to_string().contains("not an object"));
        assert_eq!(Blame::Gateway.as_str(), "gateway");
    }
}
