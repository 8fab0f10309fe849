//! The configuration file: its YAML schema, and the validating conversion into every crate's
//! plain typed settings.
//!
//! Key decision: the schema lives here and nowhere else. Unknown keys are refused with their
//! name (`deny_unknown_fields`), durations are written `250ms`/`30s`/`5m`, sizes `32MiB`, modes are
//! tagged strings; [`Config::into_settings`] checks every value and names the key of the first bad
//! one, so a bad config is refused at start, never half-applied.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cortex_hash::Engine;
use cortex_hash::profile::{Bigram, ExtraKeyHandling, ExtraKeyPolicy, FileDigest, HashRecipe, ModelProfile};
use cortex_hash::sglang::EventFormat;
use cortex_hash::text::{ChatTemplate, TextTokenizer, TokenizerConfig};
use cortex_hash::vllm::{ExtraKeyForm, HashAlgo, NoneHashSeed};
use cortex_ingest::{IngestConfig, StaleRouting};
use cortex_pd::{PdConfig, Replay, TransferFailure};
use cortex_proxy::config::{
    AlignmentConfig, Limits, MIN_HEADER_BYTES, Mode, ModelSpec, ProbeConfig, ProxyConfig, RetryPolicy,
};
use cortex_proxy::observe::AccessLog;
use cortex_proxy::registry::{Registry, parse_role, parse_unlabeled_stores};
use cortex_proxy::{EventsOverride, ModelTable, Tls, TlsConfig, Token, WorkerConfig, WorkerKey};
use cortex_radix::LedgerConfig;
use cortex_sched::{
    BoundedLoad, BreakerConfig, ConfigError, Cooldowns, HealthPolicy, LoadSignals, PolicyConfig, PolicyKind,
    PoolPolicies, Role, SchedConfig, UnreadyHolders, Watermark, Weights,
};
use serde::Deserialize;

use crate::discovery::WorkerTemplate;
use crate::discovery::kubernetes::{ApiAccess, KubernetesSettings, PodGroup};
use crate::discovery::pods::{PodReading, PortSpec};

/// A duration written as `250ms`, `30s`, `5m` or `1h`, at most [`MAX_DURATION`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Parsed inside the visitor, so the YAML reader's error names the key (`limits.x: …`).
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Dur;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration like 250ms, 30s, 5m")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Dur, E> {
                parse_duration(s).map(Dur).map_err(E::custom)
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// The longest duration the file takes: one year (8760h). Every duration is added to an
/// `Instant` somewhere (a deadline, a timer), which panics on overflow; a year is far beyond any
/// useful timeout and far below any platform's `Instant` range.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Parses `250ms`, `30s`, `5m`, `1h`, `1.5s`; refuses a duration above [`MAX_DURATION`].
///
/// # Errors
/// A message saying what is wrong.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a duration like 250ms, 30s, 5m"))?;
    let secs = match unit.trim() {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "us" | "µs" => n / 1e6,
        _ => return Err(format!("`{s}` is not a duration: the unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a valid duration"));
    }
    // Checked before the conversion, which panics beyond `Duration::MAX`.
    if secs > MAX_DURATION.as_secs_f64() {
        return Err(format!("`{s}` is too long: a duration is at most 8760h (one year)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A size written as `32MiB`, `512KiB`, `1GiB` or a plain number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub usize);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Parsed inside the visitor, so the YAML reader's error names the key (`limits.x: …`).
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size like 32MiB, 512KiB or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Size, E> {
                usize::try_from(n).map(Size).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Size, E> {
                u64::try_from(n)
                    .map_err(|_| E::custom(format!("`{n}` is not a size: it must not be negative")))
                    .and_then(|n| self.visit_u64(n))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Size, E> {
                parse_size(s).map(Size).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a size like 32MiB"))?;
    let mul = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("`{s}`: the unit must be B, KiB, MiB or GiB")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("`{s}` is too large"))
}

/// The most `ingest.lanes` the file takes (each lane is a thread).
pub const MAX_LANES: usize = 256;

/// The smallest `ledger.byte_budget` the file takes: a few hundred blocks.
pub const MIN_LEDGER_BUDGET: usize = 64 << 10;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Public listener (`host:port`).
    pub listen: SocketAddr,
    /// TLS on the public listener.
    #[serde(default)]
    pub tls: Option<TlsFile>,
    /// Bearer-token authentication of the public API.
    #[serde(default)]
    pub auth: Option<AuthFile>,
    /// Admin API.
    #[serde(default)]
    pub admin: Option<AdminFile>,
    /// `route` (default) or `proxy_only`.
    #[serde(default)]
    pub mode: ModeFile,
    /// Served models.
    pub models: Vec<ModelFile>,
    /// Workers known at start.
    #[serde(default)]
    pub workers: Vec<WorkerFile>,
    /// Request limits.
    #[serde(default)]
    pub limits: LimitsFile,
    /// Retries before the first byte.
    #[serde(default)]
    pub retry: RetryFile,
    /// Prefill/decode disaggregation.
    #[serde(default)]
    pub pd: PdFile,
    /// Scheduler.
    #[serde(default)]
    pub scheduler: SchedulerFile,
    /// Worker probing.
    #[serde(default)]
    pub probes: ProbesFile,
    /// Continuous alignment verification.
    #[serde(default)]
    pub alignment: AlignmentFile,
    /// Event plane.
    #[serde(default)]
    pub ingest: IngestFile,
    /// Ledger memory.
    #[serde(default)]
    pub ledger: LedgerFile,
    /// Graceful-shutdown deadline.
    #[serde(default)]
    pub shutdown_grace: Option<Dur>,
    /// Time after SIGTERM during which `/health/ready` answers 503 and requests are still
    /// served, before the listeners close.
    #[serde(default)]
    pub shutdown_delay: Option<Dur>,
    /// Workers found by watching an orchestrator.
    #[serde(default)]
    pub discovery: DiscoveryFile,
    /// The access log (one line per generation request).
    #[serde(default)]
    pub access_log: AccessLogFile,
    /// Span export, OTLP over HTTP (off when absent).
    #[serde(default)]
    pub tracing: Option<TracingFile>,
}

/// `access_log:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AccessLogFile {
    /// `text` (default), `json` or `off`.
    pub format: Option<String>,
}

/// `tracing:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingFile {
    /// The collector's OTLP/HTTP base URL (`http://host:4318`); spans are POSTed to
    /// `<endpoint>/v1/traces`.
    pub endpoint: String,
    /// `service.name` of the spans (default `cortex-gateway`).
    pub service_name: Option<String>,
    /// Fraction of requests traced when the client's `traceparent` does not decide (default 1).
    pub sample_ratio: Option<f64>,
}

/// Validates `tracing:`.
fn tracing_settings(t: Option<&TracingFile>) -> Result<Option<cortex_proxy::trace::TracingConfig>> {
    let Some(t) = t else { return Ok(None) };
    let endpoint: http::Uri = t
        .endpoint
        .parse()
        .map_err(|e| anyhow::anyhow!("tracing.endpoint `{}` is not a URL: {e}", t.endpoint))?;
    match endpoint.scheme_str() {
        Some("http") => {}
        Some("https") => bail!(
            "tracing.endpoint `{}`: https is not supported (the gateway's HTTP client has no TLS); \
             send to an http:// collector or agent next to the gateway",
            t.endpoint
        ),
        _ => bail!("tracing.endpoint `{}` must be an http:// URL", t.endpoint),
    }
    if endpoint.authority().is_none() || endpoint.query().is_some() {
        bail!(
            "tracing.endpoint `{}` must be http://host:port with an optional path and no query",
            t.endpoint
        );
    }
    let sample_ratio = t.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_ratio) {
        bail!("tracing.sample_ratio must be within [0, 1]");
    }
    let service_name = t.service_name.clone().unwrap_or_else(|| "cortex-gateway".to_owned());
    if service_name.is_empty() {
        bail!("tracing.service_name must not be empty");
    }
    Ok(Some(cortex_proxy::trace::TracingConfig { endpoint, service_name, sample_ratio }))
}

/// `admin:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminFile {
    /// Admin listener (`host:port`), never the public one.
    pub listen: SocketAddr,
    /// Name of the environment variable holding the bearer token.
    pub token_env: String,
    /// TLS on the admin listener.
    #[serde(default)]
    pub tls: Option<TlsFile>,
}

/// `auth:` (the public API)
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthFile {
    /// Name of the environment variable holding the bearer token clients must send.
    pub token_env: String,
}

/// `tls:` and `admin.tls:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFile {
    /// PEM certificate chain, leaf first (relative paths: against the file's directory).
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
    /// How often both files are re-read (default 60s).
    #[serde(default)]
    pub reload_interval: Option<Dur>,
}

/// The default `reload_interval` of a listener's certificate and key.
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(60);

/// The bearer token in the environment variable `var`, for the key `key`.
fn token_from_env(key: &str, var: &str) -> Result<Token> {
    let token = std::env::var(var)
        .ok()
        .filter(|t| !t.is_empty())
        .with_context(|| format!("{key}: the environment variable `{var}` is not set or empty"))?;
    bearer_token(key, var, &token, "clients send")
}

/// The API key of a model's workers, in the environment variable `var`, for the key `key`:
/// checked as a bearer token clients send (Cortex is the client here).
fn worker_key_from_env(key: &str, var: &str) -> Result<WorkerKey> {
    let secret = std::env::var(var)
        .ok()
        .filter(|t| !t.is_empty())
        .with_context(|| format!("{key}: the environment variable `{var}` is not set or empty"))?;
    bearer_token(key, var, &secret, "Cortex sends its workers")?;
    WorkerKey::new(&secret).with_context(|| format!("{key}: the key in `{var}` is not a header value"))
}

/// `token`, read from `var` for `key`, if it can be sent unchanged (by `who`, for the message).
/// The message says what is wrong and where, never which character: the value is a secret.
fn bearer_token(key: &str, var: &str, token: &str, who: &str) -> Result<Token> {
    // A bearer token is compared byte for byte with what is sent: only visible ASCII
    // (0x21–0x7E) goes through every client and proxy unchanged.
    if let Some((at, c)) = token.char_indices().find(|(_, c)| !matches!(c, '\x21'..='\x7e')) {
        let what = if c.is_whitespace() {
            "whitespace"
        } else if c.is_ascii_control() {
            "a control character"
        } else {
            "a non-ASCII character"
        };
        bail!(
            "{key}: the value of `{var}` has {what} at byte {at}; a bearer token must be visible \
             ASCII (0x21 to 0x7E), which {who} unchanged"
        );
    }
    Ok(Token::new(token))
}

/// A listener's TLS settings, checked by loading the pair once (`key` names the section).
fn tls(key: &str, t: TlsFile, base: &Path) -> Result<TlsConfig> {
    let resolve = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
    let reload_interval = t.reload_interval.map_or(TLS_RELOAD_INTERVAL, |d| d.0);
    if reload_interval.is_zero() {
        bail!("{key}.reload_interval must be positive");
    }
    let cfg = TlsConfig { cert: resolve(&t.cert), key: resolve(&t.key), reload_interval };
    Tls::load(cfg.clone()).with_context(|| format!("{key}: cannot serve this certificate and key"))?;
    Ok(cfg)
}

/// `mode:`
#[derive(Debug, Deserialize, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ModeFile {
    /// Cortex routes.
    #[default]
    Route,
    /// Cortex only proxies (Dynamo schedules).
    ProxyOnly,
}

/// `models[]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// Served model name.
    pub name: String,
    /// `vllm` or `sglang`.
    pub engine: EngineFile,
    /// Path of `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// Path of `tokenizer_config.json` (chat template, special tokens).
    pub tokenizer_config: PathBuf,
    /// A `.jinja` file overriding the template in `tokenizer_config`.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Tokens per KV block (SGLang: `page_size × dcp_size`).
    pub block_size: u32,
    /// vLLM hashing.
    #[serde(default)]
    pub vllm: Option<VllmFile>,
    /// SGLang hashing.
    #[serde(default)]
    pub sglang: Option<SglangFile>,
    /// `namespaced` (default) or `load_only`.
    #[serde(default)]
    pub lora: Option<ExtraKeyFile>,
    /// `namespaced` (default) or `load_only`.
    #[serde(default)]
    pub cache_salt: Option<ExtraKeyFile>,
    /// LoRA adapters served by this model's workers.
    #[serde(default)]
    pub adapters: Vec<AdapterFile>,
    /// Environment variable holding the API key this model's workers require (their engines'
    /// `--api-key`).
    #[serde(default)]
    pub worker_api_key_env: Option<String>,
}

/// `engine:`
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineFile {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
}

impl From<EngineFile> for Engine {
    fn from(e: EngineFile) -> Engine {
        match e {
            EngineFile::Vllm => Engine::Vllm,
            EngineFile::Sglang => Engine::Sglang,
        }
    }
}

/// `models[].vllm:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmFile {
    /// `sha256` (default), `sha256_cbor`, `xxhash`, `xxhash_cbor`.
    #[serde(default)]
    pub hash_algo: Option<String>,
    /// The workers' `PYTHONHASHSEED`, if set.
    #[serde(default)]
    pub python_hash_seed: Option<String>,
    /// `tagged` (vLLM ≥ 0.31, default) or `untagged`.
    #[serde(default)]
    pub extra_keys: Option<String>,
}

/// `models[].sglang:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SglangFile {
    /// `default` or `dynamo`.
    #[serde(default)]
    pub event_format: Option<String>,
    /// EAGLE-style bigram pages.
    #[serde(default)]
    pub bigram: bool,
}

/// `lora:` / `cache_salt:`
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ExtraKeyFile {
    /// Hashed into the identity, as the engine does.
    Namespaced,
    /// Such requests are routed by load.
    LoadOnly,
}

impl From<ExtraKeyFile> for ExtraKeyHandling {
    fn from(e: ExtraKeyFile) -> Self {
        match e {
            ExtraKeyFile::Namespaced => ExtraKeyHandling::Namespaced,
            ExtraKeyFile::LoadOnly => ExtraKeyHandling::LoadOnly,
        }
    }
}

/// `adapters[]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterFile {
    /// Adapter name.
    pub name: String,
    /// Adapter path on the workers.
    pub path: String,
}

/// `workers[]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerFile {
    /// Unique name.
    pub name: String,
    /// `http://host:port`.
    pub url: String,
    /// `vllm` or `sglang`.
    pub engine: EngineFile,
    /// A configured model's name.
    pub model: String,
    /// `regular` (the default), `prefill` or `decode`.
    #[serde(default)]
    pub role: Option<String>,
    /// The engine's limit on running requests per DP rank (vLLM `--max-num-seqs`); overrides what
    /// the engine reports.
    #[serde(default)]
    pub max_running_requests: Option<u32>,
    /// Event endpoints for engines that do not advertise them.
    #[serde(default)]
    pub events: Option<EventsFile>,
    /// SGLang prefill workers: the bootstrap port, when `/server_info` reports none.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// `plain` (default) or `unknown`: how to read stores that do not say which adapter or extra
    /// keys they were made under.
    #[serde(default)]
    pub unlabeled_stores: Option<String>,
}

/// `workers[].events:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsFile {
    /// PUB port of rank 0.
    pub publish_port_base: u16,
    /// ROUTER port of rank 0.
    #[serde(default)]
    pub replay_port_base: Option<u16>,
    /// Topic.
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks.
    #[serde(default = "one")]
    pub dp_size: u16,
}

fn one() -> u16 {
    1
}

/// `limits:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    /// Largest request body.
    pub max_body: Option<Size>,
    /// Time a connection may wait for a request's headers with no request in flight.
    pub header_read_timeout: Option<Dur>,
    /// Largest request line and headers.
    pub max_header_bytes: Option<Size>,
    /// Connections open at once.
    pub max_connections: Option<usize>,
    /// HTTP/2 ping interval.
    pub http2_keep_alive_interval: Option<Dur>,
    /// HTTP/2 ping acknowledgement timeout.
    pub http2_keep_alive_timeout: Option<Dur>,
    /// Time to receive a request body.
    pub body_read_timeout: Option<Dur>,
    /// Time for a worker's response head.
    pub upstream_head_timeout: Option<Dur>,
    /// Longest silence inside a worker's response.
    pub upstream_idle_timeout: Option<Dur>,
    /// Longest a client may leave a response unread.
    pub client_write_timeout: Option<Dur>,
    /// Requests processed at once.
    pub max_concurrent: Option<usize>,
    /// Requests waiting for a slot.
    pub max_queue: Option<usize>,
    /// Longest wait for a slot.
    pub queue_timeout: Option<Dur>,
}

/// `retry:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RetryFile {
    /// Attempts in all.
    pub max_attempts: Option<u32>,
    /// Time budget of all attempts.
    pub budget: Option<Dur>,
}

/// `pd:` (retries and their budget are `retry:`'s, shared with regular requests)
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PdFile {
    /// After a prefill succeeded and its decode leg failed before the first byte:
    /// `single_worker` (default) or `rechoose_decode`.
    pub transfer_failure: Option<String>,
    /// `allowed` (default) or `never`: whether a failed request may be sent to workers again.
    pub replay: Option<String>,
    /// SGLang: the bootstrap port of prefill workers whose `/server_info` reports none.
    pub bootstrap_port: Option<u16>,
    /// vLLM: serve a request on the best decode worker alone when it lacks at most this many
    /// prompt tokens (absent: always disaggregate).
    pub decode_only_max_uncached: Option<u32>,
}

/// `scheduler:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SchedulerFile {
    /// Policy of regular workers (SGLang names; default `cache_aware`).
    pub policy: Option<String>,
    /// Policy of the prefill pool (default `cache_aware`).
    pub prefill_policy: Option<String>,
    /// Policy of the decode pool (default `cache_aware`).
    pub decode_policy: Option<String>,
    /// α (per matched token).
    pub alpha: Option<f64>,
    /// β (per active request).
    pub beta: Option<f64>,
    /// γ (per millisecond of expected queue latency).
    pub gamma: Option<f64>,
    /// `cache_aware`: milliseconds an active request adds to a holder's estimated TTFT.
    pub per_active_ms: Option<f64>,
    /// `cache_aware`: the weight of the prefill work a request adds, beside its own wait.
    pub recompute_weight: Option<f64>,
    /// `cache_aware` in a decode pool: the KV transfer's speed, tokens per second.
    pub transfer_tokens_per_sec: Option<u32>,
    /// Watermark: in-flight as a fraction of the worker's max running requests.
    pub watermark_inflight_fraction: Option<f64>,
    /// Watermark: expected queue latency.
    pub watermark_queue_latency: Option<Dur>,
    /// Bounded load ε; `null` disables the bound. Absent: `None`; `null`: `Some(None)`.
    #[serde(default, deserialize_with = "present")]
    pub bounded_load_epsilon: Option<Option<f64>>,
    /// `engine_reports` (default: the engines' reports with this gateway's bookings since) or
    /// `booked` (this gateway's bookings alone).
    pub load_signals: Option<String>,
    /// The workers' prefill throughput, prompt tokens per second per DP rank (turns booked
    /// prefill work into expected queue latency).
    pub prefill_tokens_per_sec: Option<u32>,
    /// Maximum age of an engine load report under `engine_reports`.
    pub load_report_max_age: Option<Dur>,
    /// `load_routed` (default) or `excluded`: may SYNCING/STALE holders take load-routed traffic.
    pub unready_holders: Option<String>,
    /// Cooldown after a 429.
    pub cooldown_rate_limited: Option<Dur>,
    /// Cooldown after a server error.
    pub cooldown_server_error: Option<Dur>,
    /// Cooldown after a timeout.
    pub cooldown_timeout: Option<Dur>,
    /// Cooldown after a quota ran out.
    pub cooldown_quota_exhausted: Option<Dur>,
    /// Consecutive worker faults that open the breaker; `0` disables it.
    pub breaker_failures: Option<u32>,
    /// How long an open breaker stays open.
    pub breaker_open_for: Option<Dur>,
}

/// The default `scheduler.load_report_max_age`.
pub const LOAD_REPORT_MAX_AGE: Duration = Duration::from_secs(5);

/// A key that may be `null`: present (`Some`, with `None` for `null`) or absent (`None`, from
/// `serde(default)`), so that setting it can be told from leaving it out.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// `probes:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ProbesFile {
    /// Between health probes.
    pub health_interval: Option<Dur>,
    /// Between load polls.
    pub load_interval: Option<Dur>,
    /// Timeout of one probe.
    pub timeout: Option<Dur>,
    /// Failed probes before a worker leaves the pool.
    pub failures_to_remove: Option<u32>,
    /// Successful probes before it comes back.
    pub successes_to_restore: Option<u32>,
}

/// `alignment:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AlignmentFile {
    /// Checks remembered per worker.
    pub window: Option<usize>,
    /// Failed fraction tolerated.
    pub tolerance: Option<f64>,
    /// Checks before a verdict.
    pub min_samples: Option<usize>,
    /// Delay before looking for a served request's blocks.
    pub settle: Option<Dur>,
}

/// `ingest:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct IngestFile {
    /// Writer lanes.
    pub lanes: Option<usize>,
    /// Replay deadline.
    pub replay_timeout: Option<Dur>,
    /// Silence before a busy holder is suspected STALE.
    pub silence_timeout: Option<Dur>,
    /// `excluded` (default) or `included`: do STALE holders keep exact routing.
    pub stale_routing: Option<String>,
}

/// `ledger:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LedgerFile {
    /// Memory budget.
    pub byte_budget: Option<Size>,
    /// Extra blocks per holder beyond its capacity, percent.
    pub capacity_slack_percent: Option<u32>,
}

/// The admin listener, typed and validated.
#[derive(Debug)]
pub struct AdminSettings {
    /// Its address (never the public listener's).
    pub listen: SocketAddr,
    /// The bearer token it requires.
    pub token: Token,
    /// Its TLS, if any.
    pub tls: Option<TlsConfig>,
}

/// Everything, typed and validated.
pub struct Settings {
    /// Public listener.
    pub listen: SocketAddr,
    /// The public listener's TLS, if any.
    pub tls: Option<TlsConfig>,
    /// Admin listener, token and TLS.
    pub admin: Option<AdminSettings>,
    /// Data plane.
    pub proxy: ProxyConfig,
    /// Served models.
    pub models: ModelTable,
    /// Workers known at start.
    pub workers: Vec<WorkerConfig>,
    /// Scheduler.
    pub sched: SchedConfig,
    /// Cooldowns and breaker.
    pub health: HealthPolicy,
    /// Event plane.
    pub ingest: IngestConfig,
    /// Ledger.
    pub ledger: LedgerConfig,
    /// Kubernetes discovery, if configured.
    pub kubernetes: Option<KubernetesSettings>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings").field("listen", &self.listen).finish_non_exhaustive()
    }
}

impl Config {
    /// Reads and parses a file; relative model paths are resolved against its directory.
    ///
    /// # Errors
    /// The file cannot be read, is not YAML, or has an unknown key (named in the message).
    pub fn load(path: &Path) -> Result<(Config, PathBuf)> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        let cfg = Config::parse(&text).with_context(|| format!("in config {}", path.display()))?;
        Ok((cfg, path.parent().map_or_else(PathBuf::new, Path::to_path_buf)))
    }

    /// Parses YAML text.
    ///
    /// # Errors
    /// Not YAML, or an unknown or mistyped key (named in the message).
    pub fn parse(text: &str) -> Result<Config> {
        serde_yaml_ng::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// `mode: proxy_only` follows no KV events, reads no ledger and never disaggregates: the
    /// settings only those do are refused, naming why, rather than accepted with no effect.
    fn check_proxy_only(&self) -> Result<()> {
        let why = "mode proxy_only follows no KV events, reads no ledger and never disaggregates: it would have no effect";
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(role) = w.role.as_deref().filter(|r| *r != "regular") {
                bail!("workers[{i}].role: {role}: {why} (the worker would receive no request)");
            }
            if w.events.is_some() {
                bail!("workers[{i}].events: {why}");
            }
        }
        if let Some(k) = &self.discovery.kubernetes
            && (!k.prefill.is_empty() || !k.decode.is_empty())
        {
            bail!("discovery.kubernetes.prefill and decode: {why} (their pods would receive no request)");
        }
        let s = &self.scheduler;
        for (key, set) in [
            ("scheduler.prefill_policy", s.prefill_policy.is_some()),
            ("scheduler.decode_policy", s.decode_policy.is_some()),
            ("scheduler.alpha", s.alpha.is_some()),
            ("scheduler.transfer_tokens_per_sec", s.transfer_tokens_per_sec.is_some()),
            ("pd.transfer_failure", self.pd.transfer_failure.is_some()),
            ("pd.replay", self.pd.replay.is_some()),
            ("pd.bootstrap_port", self.pd.bootstrap_port.is_some()),
            ("pd.decode_only_max_uncached", self.pd.decode_only_max_uncached.is_some()),
            ("ingest.lanes", self.ingest.lanes.is_some()),
            ("ingest.replay_timeout", self.ingest.replay_timeout.is_some()),
            ("ingest.silence_timeout", self.ingest.silence_timeout.is_some()),
            ("ingest.stale_routing", self.ingest.stale_routing.is_some()),
            ("ledger.byte_budget", self.ledger.byte_budget.is_some()),
            ("ledger.capacity_slack_percent", self.ledger.capacity_slack_percent.is_some()),
            ("alignment.window", self.alignment.window.is_some()),
            ("alignment.tolerance", self.alignment.tolerance.is_some()),
            ("alignment.min_samples", self.alignment.min_samples.is_some()),
            ("alignment.settle", self.alignment.settle.is_some()),
        ] {
            if set {
                bail!("{key}: {why}");
            }
        }
        Ok(())
    }

    /// Validates and converts; loads tokenizers and templates.
    ///
    /// # Errors
    /// The first bad value, naming its key.
    pub fn into_settings(self, base: &Path) -> Result<Settings> {
        let d = ProxyConfig::default();
        let l = &self.limits;
        let limits = Limits {
            max_body_bytes: l.max_body.map_or(d.limits.max_body_bytes, |s| s.0),
            header_read_timeout: l.header_read_timeout.map_or(d.limits.header_read_timeout, |v| v.0),
            max_header_bytes: l.max_header_bytes.map_or(d.limits.max_header_bytes, |s| s.0),
            max_connections: l.max_connections.unwrap_or(d.limits.max_connections),
            http2_keep_alive_interval: l
                .http2_keep_alive_interval
                .map_or(d.limits.http2_keep_alive_interval, |v| v.0),
            http2_keep_alive_timeout: l
                .http2_keep_alive_timeout
                .map_or(d.limits.http2_keep_alive_timeout, |v| v.0),
            body_read_timeout: l.body_read_timeout.map_or(d.limits.body_read_timeout, |v| v.0),
            upstream_head_timeout: l.upstream_head_timeout.map_or(d.limits.upstream_head_timeout, |v| v.0),
            upstream_idle_timeout: l.upstream_idle_timeout.map_or(d.limits.upstream_idle_timeout, |v| v.0),
            client_write_timeout: l.client_write_timeout.map_or(d.limits.client_write_timeout, |v| v.0),
            max_concurrent: l.max_concurrent.unwrap_or(d.limits.max_concurrent),
            max_queue: l.max_queue.unwrap_or(d.limits.max_queue),
            queue_timeout: l.queue_timeout.map_or(d.limits.queue_timeout, |v| v.0),
        };
        if limits.max_concurrent == 0 {
            bail!("limits.max_concurrent must be at least 1");
        }
        if limits.max_body_bytes == 0 {
            bail!("limits.max_body must be positive");
        }
        if limits.header_read_timeout.is_zero() {
            bail!("limits.header_read_timeout must be positive");
        }
        if !(MIN_HEADER_BYTES..=u32::MAX as usize).contains(&limits.max_header_bytes) {
            bail!(
                "limits.max_header_bytes must be at least {}KiB (the smallest HTTP/1.1 read buffer) and under 4GiB",
                MIN_HEADER_BYTES / 1024
            );
        }
        if limits.max_connections == 0 {
            bail!("limits.max_connections must be at least 1");
        }
        if limits.http2_keep_alive_interval.is_zero() || limits.http2_keep_alive_timeout.is_zero() {
            bail!("limits.http2_keep_alive_interval and limits.http2_keep_alive_timeout must be positive");
        }
        // `queue_timeout: 0s` is kept: a request that finds no free slot is refused at once.
        if limits.max_queue == 0 && l.queue_timeout.is_some() {
            bail!(
                "limits.queue_timeout applies to requests waiting in the queue, and limits.max_queue: 0 lets none wait \
                 (every request that finds the slots taken gets 429): it would have no effect"
            );
        }
        for (key, d, why) in [
            ("body_read_timeout", limits.body_read_timeout, "no request body could arrive in time"),
            (
                "upstream_head_timeout",
                limits.upstream_head_timeout,
                "every attempt would time out before the worker's response head",
            ),
            (
                "upstream_idle_timeout",
                limits.upstream_idle_timeout,
                "every response would be cut at its first pause",
            ),
            (
                "client_write_timeout",
                limits.client_write_timeout,
                "every answer would be given up as soon as it is handed to the client",
            ),
        ] {
            if d.is_zero() {
                bail!("limits.{key} must be positive: {why}");
            }
        }
        let retry = RetryPolicy {
            max_attempts: self.retry.max_attempts.unwrap_or(d.retry.max_attempts),
            budget: self.retry.budget.map_or(d.retry.budget, |v| v.0),
        };
        if retry.max_attempts == 0 {
            bail!("retry.max_attempts must be at least 1");
        }
        let pd = PdConfig {
            transfer_failure: match self.pd.transfer_failure.as_deref() {
                None | Some("single_worker") => TransferFailure::SingleWorker,
                Some("rechoose_decode") => TransferFailure::RechooseDecode,
                Some(o) => bail!("pd.transfer_failure must be single_worker or rechoose_decode, not `{o}`"),
            },
            replay: match self.pd.replay.as_deref() {
                None | Some("allowed") => Replay::Allowed,
                Some("never") => Replay::Never,
                Some(o) => bail!("pd.replay must be allowed or never, not `{o}`"),
            },
            max_attempts: retry.max_attempts,
            budget: retry.budget,
            default_bootstrap_port: self.pd.bootstrap_port,
            decode_only_max_uncached: self.pd.decode_only_max_uncached,
        };
        pd.validate().context("retry")?;
        let a = &self.alignment;
        let alignment = AlignmentConfig {
            window: a.window.unwrap_or(d.alignment.window),
            tolerance: a.tolerance.unwrap_or(d.alignment.tolerance),
            min_samples: a.min_samples.unwrap_or(d.alignment.min_samples),
            settle: a.settle.map_or(d.alignment.settle, |v| v.0),
        };
        if !(0.0..=1.0).contains(&alignment.tolerance) {
            bail!("alignment.tolerance must be within [0, 1]");
        }
        if alignment.window == 0 || alignment.min_samples > alignment.window {
            bail!("alignment.window must be positive and at least alignment.min_samples");
        }
        let p = &self.probes;
        let probes = ProbeConfig {
            health_interval: p.health_interval.map_or(d.probes.health_interval, |v| v.0),
            load_interval: p.load_interval.map_or(d.probes.load_interval, |v| v.0),
            timeout: p.timeout.map_or(d.probes.timeout, |v| v.0),
            failures_to_remove: p.failures_to_remove.unwrap_or(d.probes.failures_to_remove),
            successes_to_restore: p.successes_to_restore.unwrap_or(d.probes.successes_to_restore),
        };
        if probes.timeout.is_zero() {
            bail!(
                "probes.timeout must be positive: every probe and every connection to a worker would time out"
            );
        }
        if probes.health_interval.is_zero() || probes.load_interval.is_zero() {
            bail!("probes.health_interval and probes.load_interval must be positive");
        }
        if probes.failures_to_remove == 0 || probes.successes_to_restore == 0 {
            bail!("probes.failures_to_remove and probes.successes_to_restore must be at least 1");
        }
        let proxy = ProxyConfig {
            mode: match self.mode {
                ModeFile::Route => Mode::Route,
                ModeFile::ProxyOnly => Mode::ProxyOnly,
            },
            limits,
            retry,
            alignment,
            probes,
            segment_cache_tokens: d.segment_cache_tokens,
            prefill_tokens_per_sec: self.scheduler.prefill_tokens_per_sec.unwrap_or(d.prefill_tokens_per_sec),
            shutdown_grace: self.shutdown_grace.map_or(d.shutdown_grace, |v| v.0),
            shutdown_delay: self.shutdown_delay.map_or(d.shutdown_delay, |v| v.0),
            pd,
            auth: match &self.auth {
                Some(a) => Some(token_from_env("auth.token_env", &a.token_env)?),
                None => None,
            },
            access_log: match self.access_log.format.as_deref() {
                None | Some("text") => AccessLog::Text,
                Some("json") => AccessLog::Json,
                Some("off") => AccessLog::Off,
                Some(o) => bail!("access_log.format must be text, json or off, not `{o}`"),
            },
            tracing: tracing_settings(self.tracing.as_ref())?,
        };
        if self.mode == ModeFile::ProxyOnly {
            self.check_proxy_only()?;
        }
        let (sched, health) = scheduler(&self.scheduler, self.mode == ModeFile::ProxyOnly)?;
        if proxy.prefill_tokens_per_sec == 0 {
            bail!("scheduler.prefill_tokens_per_sec must be positive");
        }
        let mut models = ModelTable::new();
        if self.models.is_empty() {
            bail!("models: at least one model is required");
        }
        // A request's `model` names one route: an adapter may share its name with no model and
        // no other adapter (else one would silently take the other's requests).
        let mut routes: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
        for (i, m) in self.models.iter().enumerate() {
            routes.entry(&m.name).or_insert_with(|| format!("models[{i}].name"));
        }
        for (i, m) in self.models.iter().enumerate() {
            for (j, a) in m.adapters.iter().enumerate() {
                let key = format!("models[{i}].adapters[{j}].name");
                if let Some(other) = routes.get(a.name.as_str()) {
                    bail!(
                        "{key} `{}` is also {other}: a request's `model` must name one model or adapter",
                        a.name
                    );
                }
                routes.insert(&a.name, key);
            }
        }
        for (i, m) in self.models.into_iter().enumerate() {
            let adapters: Vec<(String, String)> =
                m.adapters.iter().map(|a| (a.name.clone(), a.path.clone())).collect();
            let name = m.name.clone();
            let worker_key = match &m.worker_api_key_env {
                Some(var) => Some(worker_key_from_env(&format!("models[{i}].worker_api_key_env"), var)?),
                None => None,
            };
            let spec = model_spec(m, base).with_context(|| format!("models[{i}] ({name})"))?;
            if models.get(Some(&name)).is_some() {
                bail!("models[{i}].name `{name}` is configured twice");
            }
            models.add_model(spec, proxy.segment_cache_tokens);
            if let Some(key) = worker_key {
                models.set_worker_api_key(&name, key);
            }
            for (j, (a, path)) in adapters.into_iter().enumerate() {
                if !models.add_adapter(&a, &path, &name) {
                    bail!("models[{i}].adapters[{j}].name `{a}` is already served");
                }
            }
        }
        let mut workers = Vec::new();
        // The workers are added to a registry of their own: the checks of the admin API's
        // (name, URL, a name or address taken) on the file's, at start and by --check-config.
        let registry = Registry::new();
        for (i, w) in self.workers.into_iter().enumerate() {
            if models.get(Some(&w.model)).is_none() {
                bail!("workers[{i}].model `{}` is not a configured model", w.model);
            }
            let w = WorkerConfig {
                name: w.name,
                url: w.url,
                engine: w.engine.into(),
                model: w.model,
                role: parse_role(w.role.as_deref())
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("workers[{i}].role"))?,
                max_running_requests: match w.max_running_requests {
                    Some(0) => bail!("workers[{i}].max_running_requests must be at least 1"),
                    n => n,
                },
                events: match w.events {
                    None => None,
                    Some(e) => {
                        let o = EventsOverride {
                            publish_port_base: e.publish_port_base,
                            replay_port_base: e.replay_port_base,
                            topic: e.topic,
                            dp_size: e.dp_size,
                        };
                        if let Err((field, why)) = o.validate() {
                            bail!("workers[{i}].events.{field} {why}");
                        }
                        Some(o)
                    }
                },
                unlabeled_stores_unknown: parse_unlabeled_stores(w.unlabeled_stores.as_deref())
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("workers[{i}].unlabeled_stores"))?,
                bootstrap_port: match w.bootstrap_port {
                    Some(0) => bail!("workers[{i}].bootstrap_port must not be 0"),
                    p => p,
                },
            };
            w.check_bootstrap_port()
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("workers[{i}].bootstrap_port"))?;
            w.check_model(&models).with_context(|| format!("workers[{i}].engine"))?;
            registry.add(w.clone()).with_context(|| format!("workers[{i}]"))?;
            workers.push(w);
        }
        let di = IngestConfig::default();
        let ingest = IngestConfig {
            lanes: match self.ingest.lanes {
                Some(0) => bail!("ingest.lanes must be at least 1: events are applied by the lanes' threads"),
                Some(n) if n > MAX_LANES => bail!(
                    "ingest.lanes is {n}, more than {MAX_LANES}: each lane is a thread, and more lanes than cores only add threads"
                ),
                n => n.unwrap_or(di.lanes),
            },
            replay_timeout: self.ingest.replay_timeout.map_or(di.replay_timeout, |v| v.0),
            silence_timeout: self.ingest.silence_timeout.map_or(di.silence_timeout, |v| v.0),
            stale_routing: match self.ingest.stale_routing.as_deref() {
                None | Some("excluded") => StaleRouting::Excluded,
                Some("included") => StaleRouting::Included,
                Some(o) => bail!("ingest.stale_routing must be excluded or included, not `{o}`"),
            },
            ..di
        };
        if ingest.replay_timeout.is_zero() {
            bail!(
                "ingest.replay_timeout must be positive: every replay would be abandoned and its holder rebuilt cold"
            );
        }
        if ingest.silence_timeout.is_zero() {
            bail!("ingest.silence_timeout must be positive: every busy holder would be STALE at once");
        }
        let dl = LedgerConfig::default();
        let ledger = LedgerConfig {
            byte_budget: self.ledger.byte_budget.map_or(dl.byte_budget, |s| s.0),
            capacity_slack_percent: self.ledger.capacity_slack_percent.unwrap_or(dl.capacity_slack_percent),
        };
        if ledger.byte_budget < MIN_LEDGER_BUDGET {
            bail!(
                "ledger.byte_budget must be at least 64KiB, not {} bytes: the ledger would keep (almost) no block",
                ledger.byte_budget
            );
        }
        let admin = match self.admin {
            None => None,
            Some(a) => {
                // Port 0 asks the system for a free port: two such listeners never collide.
                if a.listen == self.listen && a.listen.port() != 0 {
                    bail!(
                        "admin.listen must differ from listen: the admin API never shares the public listener"
                    );
                }
                let token = token_from_env("admin.token_env", &a.token_env)?;
                let tls = match a.tls {
                    Some(t) => Some(tls("admin.tls", t, base)?),
                    None => None,
                };
                Some(AdminSettings { listen: a.listen, token, tls })
            }
        };
        let kubernetes = match self.discovery.kubernetes {
            Some(k) => Some(kubernetes(k, &models)?),
            None => None,
        };
        let public_tls = match self.tls {
            Some(t) => Some(tls("tls", t, base)?),
            None => None,
        };
        Ok(Settings {
            listen: self.listen,
            tls: public_tls,
            admin,
            proxy,
            models,
            workers,
            sched,
            health,
            ingest,
            ledger,
            kubernetes,
        })
    }
}

fn policy(s: Option<&str>, default: PolicyConfig, key: &str) -> Result<PolicyConfig> {
    match s {
        None => Ok(default),
        Some(name) => {
            let kind: PolicyKind = name.parse().with_context(|| format!("scheduler.{key}: `{name}`"))?;
            Ok(PolicyConfig::with_defaults(kind))
        }
    }
}

/// `proxy_only`: no prefill or decode pool can exist, so only the regular pool's policy reads.
fn scheduler(s: &SchedulerFile, proxy_only: bool) -> Result<(SchedConfig, HealthPolicy)> {
    let d = SchedConfig::default();
    let pools = PoolPolicies {
        regular: policy(s.policy.as_deref(), d.pools.regular, "policy")?,
        prefill: policy(s.prefill_policy.as_deref(), d.pools.prefill, "prefill_policy")?,
        decode: policy(s.decode_policy.as_deref(), d.pools.decode, "decode_policy")?,
    };
    // A setting only some policies read is refused when no pool's policy does: it would have
    // no effect.
    let kinds: &[PolicyKind] = if proxy_only {
        &[pools.regular.kind()]
    } else {
        &[pools.regular.kind(), pools.prefill.kind(), pools.decode.kind()]
    };
    let inert = |key: &str, set: bool, readers: &[PolicyKind]| -> Result<()> {
        if set && !kinds.iter().any(|k| readers.contains(k)) {
            let names: Vec<&str> = readers.iter().map(|k| k.as_str()).collect();
            bail!(
                "scheduler.{key} applies only to {}, which no pool uses ({}: {}): it would have no effect",
                names.join(", "),
                if proxy_only {
                    "policy, the only pool under mode proxy_only"
                } else {
                    "policy, prefill_policy, decode_policy"
                },
                kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
        Ok(())
    };
    let weighted =
        [PolicyKind::CacheAwareV1, PolicyKind::LeastLoad, PolicyKind::PowerOfTwo, PolicyKind::Manual];
    inert("alpha", s.alpha.is_some(), &[PolicyKind::CacheAwareV1])?;
    inert("beta", s.beta.is_some(), &weighted)?;
    inert("gamma", s.gamma.is_some(), &weighted)?;
    inert("watermark_queue_latency", s.watermark_queue_latency.is_some(), &[PolicyKind::CacheAwareV1])?;
    inert(
        "watermark_inflight_fraction",
        s.watermark_inflight_fraction.is_some(),
        &[PolicyKind::CacheAware, PolicyKind::CacheAwareV1],
    )?;
    inert("per_active_ms", s.per_active_ms.is_some(), &[PolicyKind::CacheAware])?;
    inert(
        "bounded_load_epsilon",
        matches!(s.bounded_load_epsilon, Some(Some(_))),
        &[PolicyKind::CacheAware, PolicyKind::CacheAwareV1, PolicyKind::LeastLoad],
    )?;
    inert("recompute_weight", s.recompute_weight.is_some(), &[PolicyKind::CacheAware])?;
    // The prior of the learned speed (`cache_aware`), the prefill clock's speed (the others'
    // queue latency).
    inert(
        "prefill_tokens_per_sec",
        s.prefill_tokens_per_sec.is_some(),
        &[
            PolicyKind::CacheAware,
            PolicyKind::CacheAwareV1,
            PolicyKind::LeastLoad,
            PolicyKind::PowerOfTwo,
            PolicyKind::Manual,
        ],
    )?;
    if s.transfer_tokens_per_sec.is_some() && pools.decode.kind() != PolicyKind::CacheAware {
        bail!(
            "scheduler.transfer_tokens_per_sec applies only to decode_policy: cache_aware (it prices a decode \
             worker's pulls), not {}: it would have no effect",
            pools.decode.kind().as_str()
        );
    }
    let cfg = SchedConfig {
        weights: Weights {
            alpha_per_token: s.alpha.unwrap_or(d.weights.alpha_per_token),
            beta_per_request: s.beta.unwrap_or(d.weights.beta_per_request),
            gamma_per_ms: s.gamma.unwrap_or(d.weights.gamma_per_ms),
        },
        per_active_ms: s.per_active_ms.unwrap_or(d.per_active_ms),
        recompute_weight: s.recompute_weight.unwrap_or(d.recompute_weight),
        transfer_tokens_per_sec: s.transfer_tokens_per_sec.unwrap_or(d.transfer_tokens_per_sec),
        watermark: Watermark {
            inflight_fraction: s.watermark_inflight_fraction.unwrap_or(d.watermark.inflight_fraction),
            queue_latency: s.watermark_queue_latency.map_or(d.watermark.queue_latency, |v| v.0),
        },
        bounded_load: match s.bounded_load_epsilon {
            None => d.bounded_load,
            Some(e) => e.map(|epsilon| BoundedLoad { epsilon }),
        },
        load_signals: match s.load_signals.as_deref() {
            Some("booked") if s.load_report_max_age.is_some() => bail!(
                "scheduler.load_report_max_age applies only to load_signals: engine_reports; \
                 load_signals: booked reads no engine report"
            ),
            Some("booked") => LoadSignals::Booked,
            None | Some("engine_reports") => LoadSignals::EngineReports {
                max_age: match s.load_report_max_age {
                    Some(Dur(d)) if d.is_zero() => bail!(
                        "scheduler.load_report_max_age must be positive: no engine report would ever be fresh \
                         (`load_signals: booked` routes by this gateway's bookings alone)"
                    ),
                    a => a.map_or(LOAD_REPORT_MAX_AGE, |v| v.0),
                },
            },
            Some(o) => bail!("scheduler.load_signals must be booked or engine_reports, not `{o}`"),
        },
        unready_holders: match s.unready_holders.as_deref() {
            None | Some("load_routed") => UnreadyHolders::LoadRouted,
            Some("excluded") => UnreadyHolders::Excluded,
            Some(o) => bail!("scheduler.unready_holders must be load_routed or excluded, not `{o}`"),
        },
        pools,
        seed: d.seed,
    };
    cfg.validate().map_err(sched_error)?;
    let dc = Cooldowns::default();
    let health = HealthPolicy {
        cooldowns: Cooldowns {
            rate_limited: s.cooldown_rate_limited.map_or(dc.rate_limited, |v| v.0),
            server_error: s.cooldown_server_error.map_or(dc.server_error, |v| v.0),
            timeout: s.cooldown_timeout.map_or(dc.timeout, |v| v.0),
            quota_exhausted: s.cooldown_quota_exhausted.map_or(dc.quota_exhausted, |v| v.0),
        },
        breaker: match s.breaker_failures {
            Some(0) if s.breaker_open_for.is_some() => bail!(
                "scheduler.breaker_open_for has no effect with breaker_failures: 0, which disables the breaker"
            ),
            Some(0) => None,
            _ if s.breaker_open_for.is_some_and(|v| v.0.is_zero()) => bail!(
                "scheduler.breaker_open_for must be positive: an open breaker would let the next request through at once (breaker_failures: 0 turns the breaker off)"
            ),
            n => Some(BreakerConfig {
                failure_threshold: n.unwrap_or(BreakerConfig::default().failure_threshold),
                open_for: s.breaker_open_for.map_or(BreakerConfig::default().open_for, |v| v.0),
                ..BreakerConfig::default()
            }),
        },
    };
    health.validate().map_err(sched_error)?;
    Ok((cfg, health))
}

/// The scheduler's refusal of a value, naming the key of `scheduler:` that holds it.
fn sched_error(e: ConfigError) -> anyhow::Error {
    match e {
        // `alpha`, `beta`, `gamma`, `per_active_ms`, `recompute_weight`: the file's own names.
        ConfigError::Weight(name) => anyhow::anyhow!("scheduler.{name} must be finite and >= 0"),
        ConfigError::Epsilon("bounded_load") => {
            anyhow::anyhow!("scheduler.bounded_load_epsilon must be finite and > 0 (null disables the bound)")
        }
        ConfigError::WatermarkFraction => {
            anyhow::anyhow!("scheduler.watermark_inflight_fraction must be finite and > 0")
        }
        ConfigError::TransferRate => anyhow::anyhow!("scheduler.transfer_tokens_per_sec must be at least 1"),
        ConfigError::Breaker("failure_threshold") => {
            anyhow::anyhow!("scheduler.breaker_failures must be at least 1, or 0 to disable the breaker")
        }
        // Values the file does not set (a policy's own defaults): the scheduler's words.
        e @ (ConfigError::Epsilon(_) | ConfigError::PrefixBlocks | ConfigError::Breaker(_)) => {
            anyhow::anyhow!("scheduler: {e}")
        }
    }
}

fn model_spec(m: ModelFile, base: &Path) -> Result<ModelSpec> {
    let resolve = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
    let tok_path = resolve(&m.tokenizer);
    let tokenizer =
        TextTokenizer::from_file(&tok_path).with_context(|| format!("tokenizer {}", tok_path.display()))?;
    let cfg_path = resolve(&m.tokenizer_config);
    let cfg_bytes =
        std::fs::read(&cfg_path).with_context(|| format!("tokenizer_config {}", cfg_path.display()))?;
    let tcfg = TokenizerConfig::from_json(&cfg_bytes)
        .with_context(|| format!("tokenizer_config {}", cfg_path.display()))?;
    let source = match &m.chat_template {
        Some(p) => {
            let p = resolve(p);
            std::fs::read_to_string(&p).with_context(|| format!("chat_template {}", p.display()))?
        }
        None => tcfg.chat_template.clone(),
    };
    let template = ChatTemplate::new(&source).context("chat_template")?;
    let engine: Engine = m.engine.into();
    let recipe = match engine {
        Engine::Sglang => {
            if m.vllm.is_some() {
                bail!("vllm: set for an sglang model");
            }
            let s = m.sglang.unwrap_or(SglangFile { event_format: None, bigram: false });
            let format = match s.event_format.as_deref() {
                None | Some("default") => EventFormat::Default,
                Some("dynamo") => EventFormat::Dynamo,
                Some(o) => bail!("sglang.event_format must be default or dynamo, not `{o}`"),
            };
            HashRecipe::Sglang { format, bigram: if s.bigram { Bigram::On } else { Bigram::Off } }
        }
        _ => {
            if m.sglang.is_some() {
                bail!("sglang: set for a vllm model");
            }
            let v = m.vllm.unwrap_or(VllmFile { hash_algo: None, python_hash_seed: None, extra_keys: None });
            let algo = match v.hash_algo.as_deref() {
                None => HashAlgo::Sha256,
                Some(a) => HashAlgo::parse(a).with_context(|| {
                    format!("vllm.hash_algo must be sha256, sha256_cbor, xxhash or xxhash_cbor, not `{a}`")
                })?,
            };
            let extra_keys = match v.extra_keys.as_deref() {
                None | Some("tagged") => ExtraKeyForm::Tagged,
                Some("untagged") => ExtraKeyForm::Untagged,
                Some(o) => bail!("vllm.extra_keys must be tagged or untagged, not `{o}`"),
            };
            let seed = v.python_hash_seed.map_or(NoneHashSeed::Default, NoneHashSeed::PythonHashSeed);
            HashRecipe::Vllm { algo, seed, extra_keys }
        }
    };
    let policy = ExtraKeyPolicy {
        lora: m.lora.map_or(ExtraKeyHandling::Namespaced, Into::into),
        cache_salt: m.cache_salt.map_or(ExtraKeyHandling::Namespaced, Into::into),
    };
    let profile = ModelProfile::builder()
        .model(m.name)
        .recipe(recipe)
        .block_size(m.block_size)
        .tokenizer(tokenizer.digest())
        .chat_template(FileDigest::of(source.as_bytes()))
        .extra_keys(policy)
        .build()
        .context("profile")?;
    Ok(ModelSpec {
        profile,
        tokenizer: Arc::new(tokenizer),
        template: Arc::new(template),
        bos_token: tcfg.bos_token,
        eos_token: tcfg.eos_token,
    })
}

/// `discovery:`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryFile {
    /// Pods of a Kubernetes namespace.
    #[serde(default)]
    pub kubernetes: Option<KubernetesFile>,
}

/// `discovery.kubernetes:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesFile {
    /// The namespace (default: the gateway's own, from its service account).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Full relist period.
    #[serde(default)]
    pub resync: Option<Dur>,
    /// Regular workers: one entry per label selector.
    #[serde(default)]
    pub workers: Vec<PodSelectorFile>,
    /// Prefill workers (SGLang's bootstrap port from the pod annotation
    /// `sglang.ai/bootstrap-port` when the engine does not report it).
    #[serde(default)]
    pub prefill: Vec<PodSelectorFile>,
    /// Decode workers.
    #[serde(default)]
    pub decode: Vec<PodSelectorFile>,
}

/// `discovery.kubernetes.workers[]` (and `prefill[]`, `decode[]`)
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodSelectorFile {
    /// A Kubernetes label selector.
    pub selector: String,
    /// The engine's port: a number or a container port's name.
    pub port: PortFile,
    /// `vllm` or `sglang`.
    pub engine: EngineFile,
    /// A configured model's name.
    pub model: String,
    /// `plain` (default) or `unknown` (see `workers[].unlabeled_stores`).
    #[serde(default)]
    pub unlabeled_stores: Option<String>,
    /// As `workers[].max_running_requests`, for every pod of the selector.
    #[serde(default)]
    pub max_running_requests: Option<u32>,
}

/// A port number or a container port's name.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PortFile {
    /// `30000`
    Number(u16),
    /// `http`
    Name(String),
}

/// How often a selector is relisted by default.
const DEFAULT_RESYNC: Duration = Duration::from_secs(300);

fn kubernetes(k: KubernetesFile, models: &ModelTable) -> Result<KubernetesSettings> {
    if k.namespace.as_deref().is_some_and(str::is_empty) {
        bail!("discovery.kubernetes.namespace must not be empty (leave it out for the gateway's own)");
    }
    let resync = k.resync.map_or(DEFAULT_RESYNC, |d| d.0);
    if resync < Duration::from_secs(1) {
        bail!("discovery.kubernetes.resync must be at least 1s");
    }
    let mut groups = Vec::new();
    for (list, role, entries) in [
        ("workers", Role::Regular, k.workers),
        ("prefill", Role::Prefill, k.prefill),
        ("decode", Role::Decode, k.decode),
    ] {
        for (i, e) in entries.into_iter().enumerate() {
            let key = format!("discovery.kubernetes.{list}[{i}]");
            if e.selector.trim().is_empty() {
                bail!(
                    "{key}.selector must select something: an empty selector matches every pod of the namespace"
                );
            }
            let Some(model) = models.get(Some(&e.model)) else {
                bail!("{key}.model `{}` is not a configured model", e.model);
            };
            // As for `workers[]`: a worker of another engine than its model's is never confirmed.
            let model_engine = model.spec().profile.engine();
            if model_engine != Engine::from(e.engine) {
                bail!(
                    "{key}.engine is {}, but its model `{}` is configured for {model_engine}",
                    Engine::from(e.engine),
                    e.model
                );
            }
            let port = match e.port {
                PortFile::Number(0) => bail!("{key}.port must not be 0"),
                PortFile::Number(n) => PortSpec::Number(n),
                PortFile::Name(n) => {
                    // An IANA service name, as Kubernetes requires of a container port's name.
                    let valid = !n.is_empty()
                        && n.len() <= 15
                        && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                        && n.chars().any(|c| c.is_ascii_lowercase());
                    if !valid {
                        bail!("{key}.port `{n}` is neither a port number nor a container port name");
                    }
                    PortSpec::Named(n)
                }
            };
            let unlabeled_stores_unknown = parse_unlabeled_stores(e.unlabeled_stores.as_deref())
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{key}.unlabeled_stores"))?;
            if e.max_running_requests == Some(0) {
                bail!("{key}.max_running_requests must be at least 1");
            }
            groups.push(PodGroup {
                key,
                selector: e.selector,
                reading: PodReading { port, bootstrap_port: role == Role::Prefill },
                template: WorkerTemplate {
                    engine: e.engine.into(),
                    model: e.model,
                    role,
                    unlabeled_stores_unknown,
                    max_running_requests: e.max_running_requests,
                },
            });
        }
    }
    if groups.is_empty() {
        bail!("discovery.kubernetes: at least one selector (workers, prefill or decode) is required");
    }
    Ok(KubernetesSettings { api: ApiAccess::Infer, namespace: k.namespace, resync, groups })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(parse_size("32MiB"), Ok(32 << 20));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert!(parse_size("3MB").is_err());
    }

    #[test]
    fn durations_beyond_a_year_are_refused_by_key() {
        assert_eq!(parse_duration("8760h"), Ok(MAX_DURATION));
        for long in ["8761h", "10000000000000000000s", "99999999999999999999999999h"] {
            let err = parse_duration(long).unwrap_err();
            assert!(err.contains("at most 8760h"), "{long}: {err}");
        }
        // Every duration key of the file goes through the same type: each is refused by name.
        let too_long = "10000000000000000000s";
        for (section, key) in [
            ("", "shutdown_grace"),
            ("", "shutdown_delay"),
            ("limits", "header_read_timeout"),
            ("limits", "http2_keep_alive_interval"),
            ("limits", "http2_keep_alive_timeout"),
            ("limits", "body_read_timeout"),
            ("limits", "upstream_head_timeout"),
            ("limits", "upstream_idle_timeout"),
            ("limits", "client_write_timeout"),
            ("limits", "queue_timeout"),
            ("retry", "budget"),
            ("scheduler", "watermark_queue_latency"),
            ("scheduler", "load_report_max_age"),
            ("scheduler", "cooldown_rate_limited"),
            ("scheduler", "cooldown_server_error"),
            ("scheduler", "cooldown_timeout"),
            ("scheduler", "cooldown_quota_exhausted"),
            ("scheduler", "breaker_open_for"),
            ("probes", "health_interval"),
            ("probes", "load_interval"),
            ("probes", "timeout"),
            ("alignment", "settle"),
            ("ingest", "replay_timeout"),
            ("ingest", "silence_timeout"),
            ("tls", "reload_interval"),
            ("discovery.kubernetes", "resync"),
        ] {
            let yaml = match section {
                "" => minimal(&format!("{key}: {too_long}\n")),
                "tls" => minimal(&format!("tls: {{cert: c, key: k, {key}: {too_long}}}\n")),
                "discovery.kubernetes" => {
                    minimal(&format!("discovery: {{kubernetes: {{{key}: {too_long}}}}}\n"))
                }
                s => minimal(&format!("{s}: {{{key}: {too_long}}}\n")),
            };
            let err = format!("{:#}", Config::parse(&yaml).unwrap_err());
            let path = if section.is_empty() { key.to_owned() } else { format!("{section}.{key}") };
            assert!(err.contains(&path) && err.contains("at most 8760h"), "{path}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = Config::parse("listen: 127.0.0.1:8080\nmodels: []\nlimit: {}\n").unwrap_err().to_string();
        assert!(err.contains("unknown field `limit`"), "{err}");
        let err = Config::parse("listen: 127.0.0.1:8080\nmodels: []\nlimits: {max_concurent: 3}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_concurent"), "{err}");
        let err = Config::parse("listen: 127.0.0.1:8080\nmodels: []\nretry: {budget: 30}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("budget") || err.contains("duration"), "{err}");
    }

    #[test]
    fn the_documented_example_is_valid() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
        let text = std::fs::read_to_string(docs.join("cortex.example.yaml")).unwrap();
        // As it is: what `--check-config` on it says.
        Config::parse(&text).unwrap().into_settings(&docs).unwrap();
        // With its commented-out sections (`# key:` at the start of a line, and the lines under
        // it) uncommented, but the admin listener's, whose token comes from the environment.
        let mut open = String::new();
        let mut section = false;
        for line in text.lines() {
            let body = line.strip_prefix("# ");
            section = match body {
                Some(b)
                    if !b.starts_with(' ')
                        && b.split_whitespace().next().is_some_and(|k| k.ends_with(':')) =>
                {
                    matches!(b.split(':').next(), Some("discovery"))
                }
                Some(b) => section && b.starts_with(' '),
                None => false,
            };
            open.push_str(if section { body.unwrap_or(line) } else { line });
            open.push('\n');
        }
        let s = Config::parse(&open).unwrap().into_settings(&docs).unwrap();
        assert_eq!(s.workers.len(), 2);
        assert_eq!(s.workers[1].events.as_ref().map(|e| e.publish_port_base), Some(5557));
        assert!(!s.workers[0].unlabeled_stores_unknown);
        assert_eq!(s.workers[1].max_running_requests, Some(256));
        assert_eq!(
            (s.proxy.shutdown_delay, s.proxy.shutdown_grace),
            (Duration::ZERO, Duration::from_secs(30))
        );
        assert_eq!(s.sched.load_signals, LoadSignals::EngineReports { max_age: LOAD_REPORT_MAX_AGE });
        let k = s.kubernetes.unwrap();
        assert_eq!(
            (k.namespace.as_deref(), k.resync, k.groups.len()),
            (Some("inference"), Duration::from_secs(300), 1)
        );
    }

    #[test]
    fn kubernetes_discovery_is_typed_per_role() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let yaml = |discovery: &str| {
            format!(
                "listen: 127.0.0.1:8080\nmodels:\n  - name: m\n    engine: sglang\n    tokenizer: golden/models/qwen3/tokenizer.json\n    tokenizer_config: golden/models/qwen3/tokenizer_config.json\n    block_size: 16\ndiscovery:\n  kubernetes:\n{discovery}"
            )
        };
        let ok = "    namespace: llm\n    resync: 30s\n    workers:\n      - {selector: 'app=sglang', port: http, engine: sglang, model: m}\n      - {selector: 'app=other', port: 30000, engine: sglang, model: m, unlabeled_stores: unknown, max_running_requests: 1024}\n";
        let k = Config::parse(&yaml(ok)).unwrap().into_settings(&base).unwrap().kubernetes.unwrap();
        assert_eq!(k.api, ApiAccess::Infer);
        assert_eq!(k.namespace.as_deref(), Some("llm"));
        assert_eq!(k.resync, Duration::from_secs(30));
        assert_eq!(k.groups.len(), 2);
        assert_eq!(k.groups[0].key, "discovery.kubernetes.workers[0]");
        assert_eq!(k.groups[0].selector, "app=sglang");
        assert_eq!(
            k.groups[0].reading,
            PodReading { port: PortSpec::Named("http".into()), bootstrap_port: false }
        );
        assert_eq!(k.groups[1].reading.port, PortSpec::Number(30000));
        assert_eq!(k.groups[0].template.role, Role::Regular);
        assert!(
            !k.groups[0].template.unlabeled_stores_unknown && k.groups[1].template.unlabeled_stores_unknown
        );
        assert_eq!(
            (k.groups[0].template.max_running_requests, k.groups[1].template.max_running_requests),
            (None, Some(1024))
        );
        let zero = ok.replace("max_running_requests: 1024", "max_running_requests: 0");
        let err = format!("{:#}", Config::parse(&yaml(&zero)).unwrap().into_settings(&base).unwrap_err());
        assert!(
            err.contains("discovery.kubernetes.workers[1].max_running_requests must be at least 1"),
            "{err}"
        );
        // Without the section there is no discovery; a misspelt key is refused by name.
        let none = Config::parse(&yaml("").replace("discovery:\n  kubernetes:\n", "")).unwrap();
        assert!(none.into_settings(&base).unwrap().kubernetes.is_none());
        let err = Config::parse(&yaml("    selectors: []\n")).unwrap_err().to_string();
        assert!(err.contains("unknown field `selectors`"), "{err}");
        // Prefill and decode selectors are typed with their role; a prefill pod's bootstrap
        // port annotation is read.
        let pd = "    prefill:\n      - {selector: 'app=p', port: http, engine: sglang, model: m}\n    decode:\n      - {selector: 'app=d', port: 30000, engine: sglang, model: m}\n";
        let k = Config::parse(&yaml(pd)).unwrap().into_settings(&base).unwrap().kubernetes.unwrap();
        let roles: Vec<_> =
            k.groups.iter().map(|g| (g.key.as_str(), g.template.role, g.reading.bootstrap_port)).collect();
        assert_eq!(
            roles,
            [
                ("discovery.kubernetes.prefill[0]", Role::Prefill, true),
                ("discovery.kubernetes.decode[0]", Role::Decode, false)
            ]
        );
        let err = format!(
            "{:#}",
            Config::parse(&yaml("    workers: []\n")).unwrap().into_settings(&base).unwrap_err()
        );
        assert!(err.contains("at least one selector"), "{err}");
    }

    #[test]
    fn auth_and_tls_are_read_and_checked() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let err_of = |extra: &str| match Config::parse(&minimal(extra)) {
            Err(e) => format!("{e:#}"),
            Ok(c) => format!("{:#}", c.into_settings(&base).unwrap_err()),
        };
        // Cargo sets CARGO_PKG_NAME for the test process: a variable that is surely set.
        let s = Config::parse(&minimal(
            "auth: {token_env: CARGO_PKG_NAME}
",
        ))
        .unwrap()
        .into_settings(&base)
        .unwrap();
        assert_eq!(s.proxy.auth, Some(Token::new("cortex-gateway")));
        let err = err_of(
            "auth: {token_env: CORTEX_TEST_VARIABLE_NEVER_SET}
",
        );
        assert!(err.contains("auth.token_env") && err.contains("CORTEX_TEST_VARIABLE_NEVER_SET"), "{err}");
        let err = err_of(
            "auth: {token: x}
",
        );
        assert!(err.contains("unknown field `token`"), "{err}");
        // A generated pair is loaded at start; each failure names its key and its file.
        let dir = std::env::temp_dir().join(format!("cortex-config-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        std::fs::write(dir.join("cert.pem"), cert.cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), cert.signing_key.serialize_pem()).unwrap();
        std::fs::write(dir.join("other-key.pem"), other.signing_key.serialize_pem()).unwrap();
        let d = dir.display();
        let tls = format!(
            "tls: {{cert: '{d}/cert.pem', key: '{d}/key.pem', reload_interval: 5s}}
"
        );
        let s = Config::parse(&minimal(&tls)).unwrap().into_settings(&base).unwrap();
        let t = s.tls.unwrap();
        assert_eq!((t.cert, t.reload_interval), (dir.join("cert.pem"), Duration::from_secs(5)));
        let admin = format!(
            "admin: {{listen: 127.0.0.1:9090, token_env: CARGO_PKG_NAME, tls: {{cert: '{d}/cert.pem', key: '{d}/key.pem'}}}}
"
        );
        let a = Config::parse(&minimal(&admin)).unwrap().into_settings(&base).unwrap().admin.unwrap();
        assert_eq!(a.tls.unwrap().reload_interval, TLS_RELOAD_INTERVAL);
        for (extra, key, says) in [
            (format!("tls: {{cert: '{d}/missing.pem', key: '{d}/key.pem'}}
"), "tls:", "missing.pem"),
            (format!("tls: {{cert: '{d}/key.pem', key: '{d}/key.pem'}}
"), "tls:", "no CERTIFICATE"),
            (format!("tls: {{cert: '{d}/cert.pem', key: '{d}/cert.pem'}}
"), "tls:", "cert.pem"),
            (format!("tls: {{cert: '{d}/cert.pem', key: '{d}/other-key.pem'}}
"), "tls:", "other-key.pem"),
            (format!("tls: {{cert: '{d}/cert.pem', key: '{d}/key.pem', reload_interval: 0s}}
"), "tls.reload_interval", ""),
            (
                format!("admin: {{listen: 127.0.0.1:9090, token_env: CARGO_PKG_NAME, tls: {{cert: '{d}/nope.pem', key: '{d}/key.pem'}}}}
"),
                "admin.tls:",
                "nope.pem",
            ),
        ] {
            let err = err_of(&extra);
            assert!(err.contains(key) && err.contains(says), "{extra}: {err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bearer_token_must_be_visible_ascii() {
        assert_eq!(
            bearer_token("auth.token_env", "T", "a-Z_0~!", "clients send").unwrap(),
            Token::new("a-Z_0~!")
        );
        for (token, says) in [
            ("qqx en", "whitespace at byte 3"),
            ("qqx\ten", "whitespace at byte 3"),
            ("qqx\x01en", "a control character at byte 3"),
            ("qqx\x7fen", "a control character at byte 3"),
            ("qqxén", "a non-ASCII character at byte 3"),
            ("qqx\u{a0}en", "whitespace at byte 3"),
        ] {
            let err = format!(
                "{:#}",
                bearer_token("admin.token_env", "ADMIN_TOKEN", token, "clients send").unwrap_err()
            );
            assert!(
                err.contains("admin.token_env") && err.contains("`ADMIN_TOKEN`") && err.contains(says),
                "{token:?}: {err}"
            );
            // The secret's characters are never shown.
            assert!(!err.contains("qqx") && !err.contains("\\u{"), "{err}");
        }
    }

    #[test]
    fn a_model_s_worker_api_key_is_read_from_its_variable() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let with = |var: &str| {
            let yaml = minimal("").replace(
                "    block_size: 16\n",
                &format!("    block_size: 16\n    worker_api_key_env: {var}\n"),
            );
            Config::parse(&yaml).unwrap().into_settings(&base)
        };
        // Cargo sets CARGO_PKG_NAME for the test process: a variable that is surely set.
        let s = with("CARGO_PKG_NAME").unwrap();
        assert_eq!(s.models.worker_api_key("m"), Some(&WorkerKey::new("cortex-gateway").unwrap()));
        assert!(format!("{:?}", s.models.worker_api_key("m")).contains("redacted"));
        assert_eq!(with("CARGO_PKG_NAME").unwrap().models.worker_api_key("other"), None);
        let err = format!("{:#}", with("CORTEX_TEST_VARIABLE_NEVER_SET").unwrap_err());
        assert!(
            err.contains("models[0].worker_api_key_env") && err.contains("CORTEX_TEST_VARIABLE_NEVER_SET"),
            "{err}"
        );
        // Without it, no key.
        assert_eq!(
            Config::parse(&minimal("")).unwrap().into_settings(&base).unwrap().models.worker_api_key("m"),
            None
        );
    }

    /// A valid file of one vLLM model `m`, then `extra`; paths relative to the repository root.
    fn minimal(extra: &str) -> String {
        format!(
            "listen: 127.0.0.1:8080\nmodels:\n  - name: m\n    engine: vllm\n    tokenizer: golden/models/qwen3/tokenizer.json\n    tokenizer_config: golden/models/qwen3/tokenizer_config.json\n    block_size: 16\n{extra}"
        )
    }

    #[test]
    fn settings_that_cannot_act_are_refused() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let w = "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m";
        for (extra, says) in [
            (
                "limits: {max_queue: 0, queue_timeout: 5s}\n".to_owned(),
                "limits.queue_timeout applies to requests waiting",
            ),
            (
                format!("{w}, events: {{publish_port_base: 5557, replay_port_base: 5558, dp_size: 2}}}}\n"),
                "replay_port_base 5558 overlaps the publish ports (5557..=5558)",
            ),
            (
                format!("{w}, events: {{publish_port_base: 5557, replay_port_base: 5557}}}}\n"),
                "replay_port_base 5557 overlaps",
            ),
            ("mode: proxy_only\nalignment: {settle: 1s}\n".to_owned(), "alignment.settle: mode proxy_only"),
            (
                "mode: proxy_only\nscheduler: {policy: round_robin, bounded_load_epsilon: 0.5}\n".to_owned(),
                "scheduler.bounded_load_epsilon applies only to cache_aware, cache_aware_v1, least_load, which no pool uses (policy, the only pool under mode proxy_only: round_robin)",
            ),
        ] {
            let err = format!(
                "{:#}",
                Config::parse(&minimal(&extra))
                    .and_then(|c| c.into_settings(&base))
                    .err()
                    .unwrap_or_else(|| panic!("accepted: {extra}"))
            );
            assert!(err.contains(says), "{extra}: {err}");
        }
        // Beside them, the same settings are taken.
        for extra in [
            "limits: {max_queue: 0}\n".to_owned(),
            format!("{w}, events: {{publish_port_base: 5557, replay_port_base: 5559, dp_size: 2}}}}\n"),
        ] {
            assert!(Config::parse(&minimal(&extra)).unwrap().into_settings(&base).is_ok(), "{extra}");
        }
    }

    #[test]
    fn proxy_only_refuses_what_only_routing_reads() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let w = "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m}\n";
        let settle = |extra: &str| {
            Config::parse(&minimal(&format!("mode: proxy_only\n{extra}")))?.into_settings(&base)
        };
        // Load, liveness, limits and the regular pool's policy act in proxy_only.
        let ok = format!("{w}scheduler: {{policy: least_load, beta: 2}}\nprobes: {{load_interval: 1s}}\n");
        assert!(settle(&ok).is_ok());
        for (extra, key) in [
            (
                "workers:\n  - {name: p, url: 'http://h:1', engine: vllm, model: m, role: prefill}\n".to_owned(),
                "workers[0].role: prefill",
            ),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, events: {publish_port_base: 5557}}\n"
                    .to_owned(),
                "workers[0].events",
            ),
            (format!("{w}scheduler: {{decode_policy: least_load}}\n"), "scheduler.decode_policy"),
            (format!("{w}scheduler: {{alpha: 2}}\n"), "scheduler.alpha"),
            (format!("{w}pd: {{replay: never}}\n"), "pd.replay"),
            (format!("{w}ingest: {{silence_timeout: 1s}}\n"), "ingest.silence_timeout"),
            (format!("{w}ledger: {{byte_budget: 1GiB}}\n"), "ledger.byte_budget"),
            (
                "discovery:\n  kubernetes:\n    decode:\n      - {selector: 'app=d', port: 30000, engine: vllm, model: m}\n"
                    .to_owned(),
                "discovery.kubernetes.prefill and decode",
            ),
        ] {
            let err = format!("{:#}", settle(&extra).err().unwrap_or_else(|| panic!("accepted: {extra}")));
            assert!(err.contains(key) && err.contains("mode proxy_only"), "{extra}: {err}");
        }
    }

    #[test]
    fn the_admin_listener_never_shares_the_public_one() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let with = |public: &str, admin: &str| {
            let yaml = minimal(&format!("admin: {{listen: '{admin}', token_env: CARGO_PKG_NAME}}\n"))
                .replace("listen: 127.0.0.1:8080", &format!("listen: '{public}'"));
            Config::parse(&yaml).unwrap().into_settings(&base).map(|s| s.admin.map(|a| a.listen))
        };
        let err = format!("{:#}", with("127.0.0.1:8080", "127.0.0.1:8080").unwrap_err());
        assert!(err.contains("admin.listen must differ from listen"), "{err}");
        // Port 0 lets the system pick: two such listeners get different ports.
        assert_eq!(with("127.0.0.1:0", "127.0.0.1:0").unwrap(), Some("127.0.0.1:0".parse().unwrap()));
        assert!(with("127.0.0.1:8080", "127.0.0.1:8081").is_ok());
    }

    #[test]
    fn bad_values_name_their_key() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let yaml = minimal;
        let ok = Config::parse(&yaml("")).unwrap().into_settings(&base);
        assert!(ok.is_ok(), "{:?}", ok.err());
        // No wait for a slot is a choice, not a mistake.
        let ok = Config::parse(&yaml("limits: {queue_timeout: 0s}\n")).unwrap().into_settings(&base);
        assert_eq!(ok.unwrap().proxy.limits.queue_timeout, Duration::ZERO);
        let s =
            Config::parse(&yaml("    adapters: [{name: sql, path: /a/sql}, {name: chat, path: /a/chat}]\n"))
                .unwrap()
                .into_settings(&base)
                .unwrap();
        assert_eq!(s.models.names().collect::<Vec<_>>(), ["m", "sql", "chat"]);
        for (extra, key) in [
            ("limits: {max_concurrent: 0}\n", "limits.max_concurrent"),
            ("limits: {max_header_bytes: 4KiB}\n", "limits.max_header_bytes"),
            ("limits: {max_connections: 0}\n", "limits.max_connections"),
            ("limits: {header_read_timeout: 0s}\n", "limits.header_read_timeout"),
            ("limits: {http2_keep_alive_interval: 0s}\n", "limits.http2_keep_alive_interval"),
            ("retry: {max_attempts: 0}\n", "retry.max_attempts"),
            ("ingest: {lanes: 0}\n", "ingest.lanes"),
            ("ingest: {lanes: 100000}\n", "ingest.lanes"),
            (
                "    adapters: [{name: m, path: /a/sql}]\n",
                "models[0].adapters[0].name `m` is also models[0].name",
            ),
            (
                "    adapters: [{name: m2, path: /a/sql}]\n  - {name: m2, engine: vllm, tokenizer: golden/models/qwen3/tokenizer.json, tokenizer_config: golden/models/qwen3/tokenizer_config.json, block_size: 16}\n",
                "models[0].adapters[0].name `m2` is also models[1].name",
            ),
            (
                "    adapters: [{name: sql, path: /a/sql}, {name: sql, path: /a/sql2}]\n",
                "models[0].adapters[1].name `sql` is also models[0].adapters[0].name",
            ),
            ("limits: {body_read_timeout: 0s}\n", "limits.body_read_timeout"),
            ("limits: {upstream_head_timeout: 0s}\n", "limits.upstream_head_timeout"),
            ("limits: {upstream_idle_timeout: 0ms}\n", "limits.upstream_idle_timeout"),
            ("limits: {client_write_timeout: 0s}\n", "limits.client_write_timeout"),
            ("probes: {timeout: 0s}\n", "probes.timeout"),
            ("ingest: {replay_timeout: 0s}\n", "ingest.replay_timeout"),
            ("ingest: {silence_timeout: 0s}\n", "ingest.silence_timeout"),
            ("scheduler: {load_report_max_age: 0s}\n", "scheduler.load_report_max_age"),
            ("scheduler: {load_signals: booked, load_report_max_age: 5s}\n", "scheduler.load_report_max_age"),
            ("scheduler: {breaker_failures: 0, breaker_open_for: 60s}\n", "scheduler.breaker_open_for"),
            ("scheduler: {breaker_open_for: 0s}\n", "scheduler.breaker_open_for"),
            ("ledger: {byte_budget: 0}\n", "ledger.byte_budget"),
            ("ledger: {byte_budget: 0MiB}\n", "ledger.byte_budget"),
            ("ledger: {byte_budget: 1}\n", "ledger.byte_budget"),
            ("ledger: {byte_budget: -3}\n", "ledger.byte_budget"),
            ("limits: {max_body: -5}\n", "limits.max_body"),
            ("limits: {max_body: true}\n", "limits.max_body"),
            ("limits: {max_header_bytes: 64KB}\n", "limits.max_header_bytes"),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, events: {publish_port_base: 5557, dp_size: 0}}\n",
                "workers[0].events.dp_size",
            ),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, events: {publish_port_base: 0}}\n",
                "workers[0].events.publish_port_base",
            ),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, events: {publish_port_base: 5557, replay_port_base: 65535, dp_size: 2}}\n",
                "workers[0].events.replay_port_base",
            ),
            ("scheduler: {policy: fastest}\n", "scheduler.policy"),
            ("scheduler: {transfer_tokens_per_sec: 0}\n", "scheduler.transfer_tokens_per_sec"),
            ("scheduler: {watermark_inflight_fraction: 0}\n", "scheduler.watermark_inflight_fraction"),
            ("scheduler: {watermark_inflight_fraction: .inf}\n", "scheduler.watermark_inflight_fraction"),
            ("scheduler: {bounded_load_epsilon: 0}\n", "scheduler.bounded_load_epsilon"),
            ("scheduler: {bounded_load_epsilon: -1.0}\n", "scheduler.bounded_load_epsilon"),
            ("scheduler: {beta: -1}\n", "scheduler.beta"),
            ("scheduler: {recompute_weight: .nan}\n", "scheduler.recompute_weight"),
            ("workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: other}\n", "workers[0].model"),
            ("alignment: {tolerance: 2.0}\n", "alignment.tolerance"),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: sglang, model: m, unlabeled_stores: maybe}\n",
                "workers[0].unlabeled_stores",
            ),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, max_running_requests: 0}\n",
                "workers[0].max_running_requests",
            ),
            ("discovery: {kubernetes: {}}\n", "discovery.kubernetes: at least one selector"),
            (
                "discovery: {kubernetes: {workers: [{selector: a=b, port: 80, engine: vllm, model: x}]}}\n",
                "discovery.kubernetes.workers[0].model",
            ),
            (
                "discovery: {kubernetes: {workers: [{selector: ' ', port: 80, engine: vllm, model: m}]}}\n",
                "discovery.kubernetes.workers[0].selector",
            ),
            (
                "discovery: {kubernetes: {workers: [{selector: a=b, port: 80, engine: sglang, model: m}]}}\n",
                "discovery.kubernetes.workers[0].engine is sglang, but its model `m` is configured for vllm",
            ),
            (
                "discovery: {kubernetes: {workers: [{selector: a=b, port: 0, engine: vllm, model: m}]}}\n",
                "discovery.kubernetes.workers[0].port",
            ),
            (
                "discovery: {kubernetes: {workers: [{selector: a=b, port: HTTP_PORT, engine: vllm, model: m}]}}\n",
                "discovery.kubernetes.workers[0].port",
            ),
            (
                "discovery: {kubernetes: {workers: [{selector: a=b, port: 80, engine: vllm, model: m, unlabeled_stores: x}]}}\n",
                "discovery.kubernetes.workers[0].unlabeled_stores",
            ),
            (
                "discovery: {kubernetes: {resync: 0s, workers: [{selector: a=b, port: 80, engine: vllm, model: m}]}}\n",
                "discovery.kubernetes.resync",
            ),
            (
                "discovery: {kubernetes: {namespace: '', workers: [{selector: a=b, port: 80, engine: vllm, model: m}]}}\n",
                "discovery.kubernetes.namespace",
            ),
        ] {
            // Refused when read (a value of the wrong shape) or when checked.
            let err = match Config::parse(&yaml(extra)) {
                Err(e) => format!("{e:#}"),
                Ok(c) => format!("{:#}", c.into_settings(&base).err().unwrap()),
            };
            assert!(err.contains(key), "{extra}: {err}");
        }
    }

    #[test]
    fn workers_are_checked_as_the_admin_api_checks_them() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let workers = |list: &[&str]| {
            let entries: Vec<String> = list.iter().map(|w| format!("  - {{{w}, model: m}}\n")).collect();
            Config::parse(&minimal(&format!("workers:\n{}", entries.concat())))
                .unwrap()
                .into_settings(&base)
                .map(|s| s.workers.len())
                .map_err(|e| format!("{e:#}"))
        };
        assert_eq!(
            workers(&[
                "name: a, url: 'http://h:1/', engine: vllm",
                "name: b, url: 'http://h:2', engine: vllm"
            ]),
            Ok(2)
        );
        for (list, says) in [
            (
                &["name: '', url: 'http://h:1', engine: vllm"][..],
                "workers[0]: worker name \"\" must not be empty",
            ),
            (
                &["name: 'a b', url: 'http://h:1', engine: vllm"],
                "workers[0]: worker name \"a b\" must not contain",
            ),
            (
                &["name: a, url: 'http://h:1', engine: sglang"],
                "workers[0].engine: worker `a` runs sglang, but its model `m` is configured for vllm",
            ),
            (
                &["name: a, url: 'http://h:1/v1', engine: vllm"],
                "workers[0]: worker `a`: invalid url `http://h:1/v1`",
            ),
            (&["name: a, url: 'http://h:1?x=1', engine: vllm"], "the engine's base URL"),
            (
                &["name: a, url: 'http://h:1', engine: vllm", "name: b, url: 'http://H:1/', engine: vllm"],
                "workers[1]: worker `b`: `http://H:1/` is the address of worker `a` already",
            ),
            (
                &["name: a, url: 'http://h:1', engine: vllm", "name: a, url: 'http://h:2', engine: vllm"],
                "workers[1]: a worker named `a` already exists",
            ),
        ] {
            let err = workers(list).unwrap_err();
            assert!(err.contains(says), "{list:?}: {err}");
        }
    }

    #[test]
    fn access_log_and_tracing_are_validated_by_key() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let settings = |extra: &str| Config::parse(&minimal(extra)).and_then(|c| c.into_settings(&base));
        let s = settings("").unwrap();
        assert_eq!((s.proxy.access_log, s.proxy.tracing.is_none()), (AccessLog::Text, true));
        assert_eq!(settings("access_log: {format: json}\n").unwrap().proxy.access_log, AccessLog::Json);
        assert_eq!(settings("access_log: {format: off}\n").unwrap().proxy.access_log, AccessLog::Off);
        let t = settings("tracing: {endpoint: 'http://127.0.0.1:4318', sample_ratio: 0.25}\n")
            .unwrap()
            .proxy
            .tracing;
        let t = t.unwrap();
        assert_eq!(
            (t.endpoint.to_string().as_str(), t.service_name.as_str(), t.sample_ratio),
            ("http://127.0.0.1:4318/", "cortex-gateway", 0.25)
        );
        for (extra, says) in [
            ("access_log: {format: xml}\n", "access_log.format"),
            ("access_log: {fromat: json}\n", "fromat"),
            ("tracing: {endpoint: 'https://collector:4318'}\n", "tracing.endpoint"),
            ("tracing: {endpoint: 'https://collector:4318'}\n", "no TLS"),
            ("tracing: {endpoint: 'collector:4318'}\n", "tracing.endpoint"),
            ("tracing: {endpoint: 'http://collector:4318?x=1'}\n", "tracing.endpoint"),
            ("tracing: {endpoint: 'http://c:4318', sample_ratio: 1.5}\n", "tracing.sample_ratio"),
            ("tracing: {endpoint: 'http://c:4318', service_name: ''}\n", "tracing.service_name"),
            ("tracing: {endpoint: 'http://c:4318', headers: {}}\n", "headers"),
            ("tracing: {sample_ratio: 1.0}\n", "endpoint"),
        ] {
            let err = format!("{:#}", settings(extra).err().unwrap());
            assert!(err.contains(says), "{extra}: {err}");
        }
    }

    #[test]
    fn pd_roles_pool_policies_and_the_pd_section() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let yaml = minimal;
        let sglang = |extra: &str| yaml(extra).replace("    engine: vllm\n", "    engine: sglang\n");
        let s = Config::parse(&sglang(
            "workers:\n  - {name: p, url: 'http://h:1', engine: sglang, model: m, role: prefill, bootstrap_port: 8998}\n  - {name: d, url: 'http://h:2', engine: sglang, model: m, role: decode}\nscheduler: {prefill_policy: least_load, decode_policy: round_robin}\npd: {transfer_failure: rechoose_decode, replay: never, bootstrap_port: 9000}\nretry: {max_attempts: 5, budget: 10s}\n",
        ))
        .unwrap()
        .into_settings(&base)
        .unwrap();
        assert_eq!(
            s.workers.iter().map(|w| (w.role, w.bootstrap_port)).collect::<Vec<_>>(),
            [(Role::Prefill, Some(8998)), (Role::Decode, None)]
        );
        assert_eq!(s.sched.pools.prefill.kind(), PolicyKind::LeastLoad);
        assert_eq!(s.sched.pools.decode.kind(), PolicyKind::RoundRobin);
        let pd = s.proxy.pd;
        assert_eq!((pd.transfer_failure, pd.replay), (TransferFailure::RechooseDecode, Replay::Never));
        assert_eq!((pd.max_attempts, pd.budget), (5, Duration::from_secs(10)), "retry's, shared");
        assert_eq!(pd.default_bootstrap_port, Some(9000));
        for (extra, key) in [
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, role: leader}\n",
                "workers[0].role",
            ),
            ("scheduler: {decode_policy: fastest}\n", "scheduler.decode_policy"),
            ("pd: {transfer_failure: retry}\n", "pd.transfer_failure"),
            ("pd: {replay: sometimes}\n", "pd.replay"),
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: sglang, model: m, bootstrap_port: 0}\n",
                "workers[0].bootstrap_port",
            ),
            // A bootstrap port nothing reads: a vLLM prefill worker's.
            (
                "workers:\n  - {name: w, url: 'http://h:1', engine: vllm, model: m, role: prefill, bootstrap_port: 8998}\n",
                "workers[0].bootstrap_port: applies only to an SGLang prefill worker",
            ),
            // Settings no pool's policy reads.
            ("scheduler: {alpha: 2}\n", "scheduler.alpha applies only to cache_aware_v1"),
            ("scheduler: {gamma: 2}\n", "scheduler.gamma applies only to cache_aware_v1, least_load"),
            (
                "scheduler: {policy: round_robin, prefill_policy: power_of_two, decode_policy: random, bounded_load_epsilon: 2}\n",
                "scheduler.bounded_load_epsilon applies only to cache_aware, cache_aware_v1, least_load",
            ),
            ("scheduler: {watermark_queue_latency: 1s}\n", "scheduler.watermark_queue_latency applies only"),
            (
                "scheduler: {policy: round_robin, prefill_policy: least_load, decode_policy: random, per_active_ms: 1}\n",
                "scheduler.per_active_ms applies only to cache_aware",
            ),
            (
                "scheduler: {policy: round_robin, prefill_policy: round_robin, decode_policy: random, beta: 1}\n",
                "scheduler.beta applies only",
            ),
            (
                "scheduler: {policy: round_robin, prefill_policy: random, decode_policy: prefix_hash, prefill_tokens_per_sec: 5000}\n",
                "scheduler.prefill_tokens_per_sec applies only",
            ),
            (
                "scheduler: {decode_policy: least_load, transfer_tokens_per_sec: 1000}\n",
                "decode_policy: cache_aware",
            ),
        ] {
            let err =
                format!("{:#}", Config::parse(&yaml(extra)).unwrap().into_settings(&base).err().unwrap());
            assert!(err.contains(key), "{extra}: {err}");
        }
        let err = Config::parse(&yaml("pd: {max_attempts: 2}\n")).unwrap_err().to_string();
        assert!(err.contains("unknown field `max_attempts`"), "retries are retry's: {err}");
        // Where a pool's policy reads them, the same settings are taken.
        for extra in [
            "scheduler: {policy: cache_aware_v1, alpha: 2, watermark_queue_latency: 1s}\n",
            "scheduler: {decode_policy: power_of_two, beta: 1, gamma: 1}\n",
            "scheduler: {per_active_ms: 1, recompute_weight: 0, transfer_tokens_per_sec: 1000}\n",
        ] {
            assert!(Config::parse(&yaml(extra)).unwrap().into_settings(&base).is_ok(), "{extra}");
        }
    }

    /// The `config_yaml` fuzz target on stable: every saved corpus input (`fuzz/corpus/config_yaml`,
    /// seeded with the example, the deploy configurations and a minimal file), then 1,000 of
    /// them with bytes overwritten and the tail cut, from a fixed seed: parsing and validation
    /// never panic (a file is accepted or refused with a message).
    #[test]
    fn the_config_fuzz_corpus_and_its_mutations_never_panic() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/config_yaml");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let inputs: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
        let seeds: Vec<&Vec<u8>> = files
            .iter()
            .zip(&inputs)
            .filter(|(f, _)| f.file_name().is_some_and(|n| n.to_string_lossy().starts_with("seed-")))
            .map(|(_, d)| d)
            .collect();
        assert!(seeds.len() >= 4 && inputs.len() >= 50, "{} seeds, {} inputs", seeds.len(), inputs.len());
        // The fuzz target's oracle, verbatim.
        let check = |data: &[u8]| {
            let Ok(text) = std::str::from_utf8(data) else { return false };
            let Ok(cfg) = Config::parse(text) else { return false };
            let _ = cfg.into_settings(Path::new("/nonexistent/cortex-fuzz"));
            true
        };
        assert!(seeds.iter().all(|d| check(d)), "every seed is YAML the schema reads");
        for d in &inputs {
            check(d);
        }
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..1000 {
            let mut data = inputs[(next() % inputs.len() as u64) as usize].clone();
            for _ in 0..1 + next() % 8 {
                let i = (next() % data.len() as u64) as usize;
                data[i] = next() as u8;
            }
            let keep = ((next() % (data.len() as u64 + 1)) as usize).max(data.len() / 2);
            data.truncate(keep);
            check(&data);
        }
    }

    /// The configurations `deploy/` ships, with the repository's Qwen3 files for the model
    /// volume: the base and the disaggregated overlay are accepted.
    #[test]
    fn the_deploy_configurations_are_what_deploy_check_expects() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let load = |file: &str| {
            let mut cfg = Config::parse(&std::fs::read_to_string(root.join(file)).unwrap()).unwrap();
            for m in &mut cfg.models {
                m.tokenizer = root.join("golden/models/qwen3/tokenizer.json");
                m.tokenizer_config = root.join("golden/models/qwen3/tokenizer_config.json");
                m.chat_template = None;
            }
            cfg.into_settings(&root)
        };
        assert!(load("deploy/base/cortex.yaml").is_ok());
        let pd = load("deploy/overlays/disaggregated/cortex.yaml").unwrap();
        let roles: Vec<Role> = pd.kubernetes.unwrap().groups.iter().map(|g| g.template.role).collect();
        assert!(roles.contains(&Role::Prefill) && roles.contains(&Role::Decode), "{roles:?}");
    }
}
