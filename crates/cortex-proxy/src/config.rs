//! The data plane's settings as plain typed values.
//!
//! Key decision: the configuration file (YAML, with its key names and `250ms` durations) belongs
//! to the gateway binary, which validates it and converts it into these structs; this crate never
//! parses text and has no sentinel values.

use std::sync::Arc;
use std::time::Duration;

use cortex_hash::profile::ModelProfile;
use cortex_hash::text::{ChatTemplate, TextTokenizer};

/// What the gateway decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Tokenize, consult the ledger and the scheduler: Cortex routes.
    Route,
    /// Forward only, by load and liveness; no KV or PD decisions (for clusters where NVIDIA
    /// Dynamo schedules: one scheduling authority per traffic path).
    ProxyOnly,
}

/// Request limits and timeouts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Time allowed for a connection to deliver a request's headers while no request of it is
    /// in flight: from its accept to its first request (protocol detection, the HTTP/2 preface
    /// and settings included), and from its last response to its next request (HTTP/1.1
    /// keep-alive and HTTP/2 alike). Beyond, the connection is closed without a response: a
    /// client that has not finished its headers has made no request to answer.
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers), in bytes; 431 beyond. HTTP/1.1 reads a
    /// head into a buffer of at most this size, HTTP/2 advertises it as
    /// `SETTINGS_MAX_HEADER_LIST_SIZE` (each header counted as name + value + 32 bytes). At least
    /// [`MIN_HEADER_BYTES`].
    pub max_header_bytes: usize,
    /// Connections open at once on a listener; a connection accepted beyond is closed at once.
    pub max_connections: usize,
    /// HTTP/2: how often a connection is pinged, so that a peer that vanished is noticed while
    /// its streams wait on workers.
    pub http2_keep_alive_interval: Duration,
    /// HTTP/2: a ping not acknowledged within this closes the connection.
    pub http2_keep_alive_timeout: Duration,
    /// Time allowed to receive a request's body (408 beyond).
    pub body_read_timeout: Duration,
    /// Time allowed for a worker to answer with a response head.
    pub upstream_head_timeout: Duration,
    /// Longest silence allowed between two chunks of a worker's response body.
    pub upstream_idle_timeout: Duration,
    /// Longest a client may leave a response unread: a relay that handed the server a chunk
    /// and is not asked for the next within this is given up (its slot, booking and worker
    /// request released; see `stall.rs`), and a connection whose socket takes no byte of a write
    /// for this long is closed (see `server.rs`).
    pub client_write_timeout: Duration,
    /// Requests processed at once, counted from the moment their body has been read.
    pub max_concurrent: usize,
    /// Requests allowed to wait for a slot (429 beyond).
    pub max_queue: usize,
    /// Longest wait for a slot (503 beyond).
    pub queue_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_connections: 16 * 1024,
            http2_keep_alive_interval: Duration::from_secs(20),
            http2_keep_alive_timeout: Duration::from_secs(20),
            body_read_timeout: Duration::from_secs(30),
            upstream_head_timeout: Duration::from_secs(600),
            upstream_idle_timeout: Duration::from_secs(300),
            client_write_timeout: Duration::from_secs(60),
            max_concurrent: 1024,
            max_queue: 4096,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

/// The smallest `max_header_bytes`: hyper's HTTP/1.1 read buffer cannot be smaller.
pub const MIN_HEADER_BYTES: usize = 8 * 1024;

/// Retries before the first byte reaches the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all (1 = no retry).
    pub max_attempts: u32,
    /// Time budget for all attempts together, from the first dispatch.
    pub budget: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { max_attempts: 3, budget: Duration::from_secs(30) }
    }
}

/// Continuous alignment verification (see [`crate::alignment`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlignmentConfig {
    /// Checks remembered per worker.
    pub window: usize,
    /// Fraction of failed checks in the window beyond which the worker is marked misaligned.
    pub tolerance: f64,
    /// Checks needed before any verdict.
    pub min_samples: usize,
    /// How long after a response ends its predicted blocks must be visible in the ledger.
    pub settle: Duration,
}

impl Default for AlignmentConfig {
    fn default() -> Self {
        AlignmentConfig { window: 50, tolerance: 0.2, min_samples: 5, settle: Duration::from_millis(500) }
    }
}

/// Worker probing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Between two health probes.
    pub health_interval: Duration,
    /// Between two load polls.
    pub load_interval: Duration,
    /// Timeout of one probe request.
    pub timeout: Duration,
    /// Consecutive failed health probes before a worker leaves the live pool.
    pub failures_to_remove: u32,
    /// Consecutive successful probes before a removed worker comes back.
    pub successes_to_restore: u32,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            health_interval: Duration::from_secs(5),
            load_interval: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
            failures_to_remove: 3,
            successes_to_restore: 2,
        }
    }
}

/// The data plane's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyConfig {
    /// Route or only proxy.
    pub mode: Mode,
    /// Limits and timeouts.
    pub limits: Limits,
    /// Retries.
    pub retry: RetryPolicy,
    /// Alignment verification.
    pub alignment: AlignmentConfig,
    /// Worker probing.
    pub probes: ProbeConfig,
    /// Token ids kept per model for reusing the tokenization of repeated prompt segments.
    pub segment_cache_tokens: usize,
    /// The workers' prefill throughput, in prompt tokens per second per DP rank: turns the
    /// prefill work booked on a worker into the expected queue latency the scheduler weighs
    /// against cache hits.
    pub prefill_tokens_per_sec: u32,
    /// Time allowed for graceful shutdown before streams are cut.
    pub shutdown_grace: Duration,
    /// Time between the start of a graceful shutdown and closing the listeners, during which
    /// `/health/ready` answers 503 and requests are still served (zero: close at once).
    pub shutdown_delay: Duration,
    /// Prefill/decode disaggregation: retries, fallbacks, replay, bootstrap port.
    pub pd: cortex_pd::PdConfig,
    /// The bearer token the public API requires (`/health/*` excepted); none: open.
    pub auth: Option<crate::auth::Token>,
    /// The access log's format.
    pub access_log: crate::observe::AccessLog,
    /// Span export (off when `None`).
    pub tracing: Option<crate::trace::TracingConfig>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            mode: Mode::Route,
            limits: Limits::default(),
            retry: RetryPolicy::default(),
            alignment: AlignmentConfig::default(),
            probes: ProbeConfig::default(),
            segment_cache_tokens: 4 << 20,
            prefill_tokens_per_sec: cortex_sched::Capacity::default().prefill_tokens_per_sec,
            shutdown_grace: Duration::from_secs(30),
            shutdown_delay: Duration::ZERO,
            pd: cortex_pd::PdConfig::default(),
            auth: None,
            access_log: crate::observe::AccessLog::Text,
            tracing: None,
        }
    }
}

/// One served model: its profile and the files that turn its requests into tokens.
#[derive(Clone)]
pub struct ModelSpec {
    /// The profile (name, engine recipe, block size, tokenizer and template digests).
    pub profile: ModelProfile,
    /// The model's tokenizer.
    pub tokenizer: Arc<TextTokenizer>,
    /// The model's chat template.
    pub template: Arc<ChatTemplate>,
    /// `bos_token` passed to the template.
    pub bos_token: Option<String>,
    /// `eos_token` passed to the template.
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSpec").field("profile", &self.profile).finish_non_exhaustive()
    }
}
