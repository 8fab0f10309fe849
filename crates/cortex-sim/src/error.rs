//! The crate's one error type: what can go wrong starting, driving or stopping a simulated
//! worker.
//!
//! Key decision: typed variants without `String` payloads; the sources (I/O, ZeroMQ, tokenizer)
//! are kept as `#[source]` so a test failure says which socket or file was at fault.

use std::time::Duration;

/// Why a simulated worker could not start, or a handle call could not be served.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is inconsistent; `field` names the offending key.
    #[error("invalid simulator config: `{field}` {reason}")]
    Config {
        /// The config field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The tokenizer or chat template could not be loaded.
    #[error("cannot load the model's tokenizer or chat template")]
    Model(#[source] cortex_hash::text::TextError),
    /// A model file could not be read.
    #[error("cannot read model file")]
    ModelIo(#[source] std::io::Error),
    /// The HTTP (or PD rendezvous) listener could not be bound.
    #[error("cannot bind a listener")]
    Bind(#[source] std::io::Error),
    /// No contiguous range of event ports could be bound.
    #[error("no free contiguous range of {ports} event ports after {attempts} attempts")]
    EventPorts {
        /// Ports needed (publishers plus replay sockets).
        ports: usize,
        /// Bases tried.
        attempts: usize,
    },
    /// A ZeroMQ call failed.
    #[error("zeromq")]
    Zmq(#[source] zmq::Error),
    /// The worker's threads could not be started.
    #[error("cannot start the worker's runtime")]
    Runtime(#[source] std::io::Error),
    /// A DP rank outside `0..dp_size`.
    #[error("no DP rank {rank} (dp_size {dp_size})")]
    NoSuchRank {
        /// The rank asked for.
        rank: u16,
        /// The worker's DP size.
        dp_size: u16,
    },
    /// The rank runs the other engine than the call expects.
    #[error("this worker does not simulate that engine")]
    WrongEngine,
    /// Waiting for a condition took longer than the caller allowed.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// A cache flush was refused because requests are running (SGLang and vLLM both refuse).
    #[error("cache flush refused: requests are running")]
    FlushRefused,
    /// The worker has been shut down.
    #[error("the worker has shut down")]
    ShutDown,
}

impl From<zmq::Error> for SimError {
    fn from(e: zmq::Error) -> Self {
        SimError::Zmq(e)
    }
}
