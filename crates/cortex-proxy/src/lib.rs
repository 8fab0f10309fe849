//! `cortex-proxy`: the streaming data plane, and the only HTTP crate of the gateway.
//!
//! OpenAI and SGLang clients point at it; it tokenizes like the workers ([`models`]), asks the
//! ledger (`cortex-radix`) and the scheduler (`cortex-sched`) where the request's prompt is
//! cached without overloading anyone, forwards the body untouched ([`request`]), streams the
//! answer back as it arrives ([`upstream`]) and says what it did in `x-cortex-*` headers. It
//! verifies continuously that its predictions match what workers do ([`alignment`]) and keeps the
//! registry of workers, their discovery, health and load ([`registry`], [`workers`]).
//!
//! The request path is a short phase chart in `docs/request-lifecycle.md`; [`gateway`] follows it.
//!
//! Key decisions: the body is forwarded as received (only an SGLang `routed_dp_rank` is spliced
//! in); retries happen only before the first byte reaches the client; errors become HTTP
//! responses or SSE error events in exactly one place ([`error`]); a request whose tokens cannot
//! be trusted is routed by load and says so, never given a guessed hit.

#![forbid(unsafe_code)]

pub mod admin;
pub mod alignment;
pub mod config;
mod debug;
pub mod error;
pub mod gateway;
pub mod models;
pub mod registry;
pub mod request;
pub mod server;
pub mod telemetry;
pub mod upstream;
pub mod workers;

pub use admin::Admin;
pub use config::{AlignmentConfig, Limits, Mode, ModelSpec, ProbeConfig, ProxyConfig, RetryPolicy};
pub use error::ProxyError;
pub use gateway::{Gateway, GatewayParts, ScrapeHook};
pub use models::{ModelRoute, ModelTable};
pub use registry::{EventSource, EventsOverride, RankEndpoints, RegistryEvent, WorkerConfig};
