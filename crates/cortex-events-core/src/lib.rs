//! `cortex-events-core`: what the two engine event crates, `cortex-events-vllm` and
//! `cortex-events-sglang`, share — the borrowing MessagePack reader and msgspec-compatible writer
//! ([`msgpack`]), the tagged-event and batch shape both engines' msgspec encoders produce
//! ([`event`]), the decode and encode errors ([`DecodeError`], [`EncodeError`]), the namespace
//! reuse of normalization ([`Namespaces`]), and, behind the `testing` feature, the harness of their
//! golden, fuzz-corpus and bench code ([`testing`]).
//!
//! Key decision: the engine crates never depend on each other, and everything one engine's format
//! means stays in its crate (field lists, what a hash or a token list is, normalization rules).
//! This crate holds only what is the same for both, byte for byte, so that it is written once.
//! Pure like them: no sockets, no async.

#![forbid(unsafe_code)]

pub mod error;
pub mod event;
pub mod msgpack;
mod namespaces;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{DecodeError, EncodeError, ValueKind};
pub use namespaces::Namespaces;
