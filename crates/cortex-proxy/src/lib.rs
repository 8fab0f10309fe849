//! `cortex-proxy`: the streaming data plane, and the only HTTP crate of the gateway.
//!
//! OpenAI and SGLang clients point at it; it tokenizes like the workers ([`models`]), asks the
//! ledger (`cortex-radix`) and the scheduler (`cortex-sched`) where the request's prompt is
//! cached without overloading anyone ([`planner`]), forwards the body untouched and streams the
//! answer back as it arrives ([`forwarder`], [`upstream`]), and says what it did in `x-cortex-*`
//! headers. It verifies continuously that its predictions match what workers do
//! ([`alignment`]), and owns the workers' membership and life — discovery, health, load
//! ([`control`], with [`probes`] asking and [`discovery`] parsing, [`registry`] holding them).
//!
//! The request path is a short phase chart in `docs/request-lifecycle.md`; [`gateway`] routes it
//! and [`server`] serves the connections.
//!
//! Key decisions: one planner for the request path, the dry run and `/tokenize`; one owner of
//! membership; the body is forwarded as received (only an SGLang `routed_dp_rank` is spliced
//! in); retries happen only before the first byte reaches the client; errors become HTTP
//! responses or SSE error events in exactly one place ([`error`]); a request whose tokens cannot
//! be trusted is routed by load and says so, never given a guessed hit.

// One audited `unsafe` block: the `SIOCOUTQ` ioctl in `server.rs` (no safe wrapper exists).
#![deny(unsafe_code)]

pub mod admin;
pub mod alignment;
pub mod auth;
pub mod config;
pub mod control;
mod debug;
pub mod discovery;
pub mod error;
mod fanout;
pub mod forwarder;
pub mod gateway;
pub mod models;
pub mod observe;
pub mod pd;
pub mod planner;
pub mod probes;
pub mod registry;
pub mod request;
mod scrape;
pub mod server;
mod stall;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod upstream;

pub use admin::Admin;
pub use auth::{Token, WorkerKey};
pub use config::{AlignmentConfig, Limits, Mode, ModelSpec, ProbeConfig, ProxyConfig, RetryPolicy};
pub use control::Control;
pub use error::ProxyError;
pub use gateway::{Gateway, GatewayParts};
pub use models::{ModelRoute, ModelTable};
pub use planner::{Ask, PdPlan, Plan, Planner};
pub use registry::{EventsOverride, RankEndpoints, RegistryEvent, WorkerConfig};
pub use scrape::{ScrapeHook, WorkerGauges};
pub use tls::{Tls, TlsConfig};
