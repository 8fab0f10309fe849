//! The workers the gateway knows: how each is configured, its address, and what discovery learned
//! about it.
//!
//! Key decision: workers are identified by a typed [`WorkerId`] everywhere; the URL is only an
//! attribute. The registry is an immutable map swapped on change (reads clone one `Arc`); only
//! [`crate::control::Control`] writes it. The event plane is told about workers through
//! [`RegistryEvent`]s on a channel, so this crate never depends on the ZeroMQ runtime (the binary
//! wires the two).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cortex_hash::Engine;
use cortex_hash::kv::{DpRank, HolderId, HolderSource, WorkerId};
use cortex_hash::profile::{Alignment, WorkerFacts};
use cortex_sched::Role;
use http::Uri;

use crate::models::ModelTable;

/// How a worker is configured (file or admin API).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Unique name, shown in `x-cortex-assigned-worker`.
    pub name: String,
    /// Base URL, `http://host:port`.
    pub url: String,
    /// The engine.
    pub engine: Engine,
    /// The served model (a configured model's name).
    pub model: String,
    /// Its pool: regular workers serve whole requests; a model with prefill and decode workers
    /// is served disaggregated (`cortex_pd`).
    pub role: Role,
    /// The engine's limit on running requests per DP rank, when configured: overrides what the
    /// engine reports. vLLM reports none (`--max-num-seqs` is only in its dev-mode endpoints), so
    /// without it a vLLM worker counts [`DEFAULT_MAX_RUNNING_REQUESTS`].
    pub max_running_requests: Option<u32>,
    /// KV events for engines that do not advertise them (vLLM < 0.31 has no
    /// `/kv_event_sources`): per-rank endpoints are `publish_port_base + rank`.
    pub events: Option<EventsOverride>,
    /// Stores that do not say which adapter or extra keys they were made under (SGLang never
    /// names unregistered LoRA adapters; vLLM before 0.17 has no `extra_keys`) are never counted,
    /// instead of being read as plain base-model blocks. For workers that serve such traffic.
    pub unlabeled_stores_unknown: bool,
    /// SGLang prefill workers: the bootstrap port to send when the worker's `/server_info` does
    /// not report one (a Kubernetes pod's `sglang.ai/bootstrap-port` annotation, the file's or
    /// the admin API's `bootstrap_port`).
    pub bootstrap_port: Option<u16>,
}

impl WorkerConfig {
    /// Checks what can be checked of the worker alone — a name that headers and metric labels
    /// can carry, a base URL `http://host:port` — and returns that URL parsed and its host.
    ///
    /// # Errors
    /// [`RegistryError::BadName`] or [`RegistryError::BadUrl`], saying what is wrong.
    pub fn base_url(&self) -> Result<(Uri, String), RegistryError> {
        let why = if self.name.is_empty() {
            Some("must not be empty")
        } else if self.name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("must not contain whitespace or control characters")
        } else if !self.name.is_ascii() {
            // Headers carry it, and readers of them (the access log, spans) take visible ASCII.
            Some("must be ASCII")
        } else if self.name.contains(['"', '\\']) {
            // Quoted in metric labels and logs, where `dd\x` and `dd\\x` came out as one series.
            Some("must not contain `\"` or `\\`")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(RegistryError::BadName { name: self.name.clone(), why });
        }
        let bad = |why| RegistryError::BadUrl { name: self.name.clone(), url: self.url.clone(), why };
        // `Uri` drops a fragment silently: look for one in the text.
        if self.url.contains('#') {
            return Err(bad(BASE_URL_ONLY));
        }
        let base: Uri = self.url.trim_end_matches('/').parse().map_err(|_| bad(NOT_HTTP))?;
        let host = match (base.scheme_str(), base.authority(), base.host()) {
            (Some("http"), Some(a), Some(h)) if base.port_u16().is_some_and(|p| p != 0) => {
                if a.as_str().contains('@') {
                    return Err(bad(BASE_URL_ONLY));
                }
                h.trim_matches(['[', ']']).to_owned()
            }
            _ => return Err(bad(NOT_HTTP)),
        };
        if base.path_and_query().is_some_and(|p| !matches!(p.as_str(), "" | "/")) {
            return Err(bad(BASE_URL_ONLY));
        }
        Ok((base, host))
    }

    /// Refuses a `bootstrap_port` where nothing reads it: only an SGLang prefill worker's is
    /// sent (to both legs, for the decode worker to reach its bootstrap server).
    ///
    /// # Errors
    /// What the port would have been for, when the worker is not an SGLang prefill worker.
    pub fn check_bootstrap_port(&self) -> Result<(), String> {
        if self.bootstrap_port.is_some() && (self.engine != Engine::Sglang || self.role != Role::Prefill) {
            return Err(format!(
                "applies only to an SGLang prefill worker (the bootstrap server its decode workers reach); \
                 this one is a {} {} worker",
                self.engine.as_str(),
                self.role.as_str()
            ));
        }
        Ok(())
    }

    /// Checks the worker's model: configured in `models`, and for the worker's engine.
    ///
    /// # Errors
    /// [`RegistryError::UnknownModel`] or [`RegistryError::EngineMismatch`].
    pub fn check_model(&self, models: &ModelTable) -> Result<(), RegistryError> {
        let Some(route) = models.get(Some(&self.model)) else {
            return Err(RegistryError::UnknownModel { name: self.name.clone(), model: self.model.clone() });
        };
        let model_engine = route.spec().profile.engine();
        if model_engine != self.engine {
            return Err(RegistryError::EngineMismatch {
                name: self.name.clone(),
                engine: self.engine,
                model: self.model.clone(),
                model_engine,
            });
        }
        Ok(())
    }
}

/// A host as the one-worker-per-address check compares it: an IP address as the one it
/// reaches (an IPv4-mapped IPv6 address as its IPv4 address, one written as a single number as
/// that address, the unspecified `0.0.0.0` and `::` as the loopback `127.0.0.1` and `::1`
/// connections to them reach), any name case-insensitively without a trailing dot. Names are not
/// resolved, except `localhost`, which matches `127.0.0.1` and `::1` ([`same_host`]).
fn host_key(host: &str) -> String {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let name = host.strip_suffix('.').unwrap_or(host);
    // `http://2130706433:8000`, `127.1` or `0x7f.0.0.1` are 127.0.0.1 to the resolver.
    let ip = name.parse::<IpAddr>().ok().or_else(|| inet_aton(name).map(IpAddr::V4));
    match ip {
        Some(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some() => {
            host_key(&v6.to_ipv4_mapped().map_or_else(String::new, |v4| v4.to_string()))
        }
        Some(IpAddr::V4(v4)) if v4.is_unspecified() => Ipv4Addr::LOCALHOST.to_string(),
        Some(IpAddr::V6(v6)) if v6.is_unspecified() => Ipv6Addr::LOCALHOST.to_string(),
        Some(ip) => ip.to_string(),
        None => name.to_ascii_lowercase(),
    }
}

/// An IPv4 address in any form the system resolver takes (`inet_aton`): one to four parts
/// separated by dots, each decimal, `0x` hexadecimal or `0` octal, the last filling the bytes
/// left.
fn inet_aton(s: &str) -> Option<std::net::Ipv4Addr> {
    let mut parts = [0u32; 4];
    let mut n = 0;
    for p in s.split('.') {
        let (digits, radix) = match p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
            Some(h) => (h, 16),
            None if p.len() > 1 && p.starts_with('0') => (&p[1..], 8),
            None => (p, 10),
        };
        if n == 4 || digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        parts[n] = u32::from_str_radix(digits, radix).ok()?;
        n += 1;
    }
    let (head, last) = (&parts[..n - 1], parts[n - 1]);
    let mut addr = 0u32;
    for (i, &v) in head.iter().enumerate() {
        if v > 255 {
            return None;
        }
        addr |= v << (24 - 8 * i);
    }
    let room = 32 - 8 * head.len();
    if room < 32 && last >> room != 0 {
        return None;
    }
    Some(std::net::Ipv4Addr::from(addr | last))
}

/// Whether two hosts reach the same machine's listener as far as can be told without resolving
/// names: equal [`host_key`]s, or `localhost` and one of the loopback addresses it names.
fn same_host(a: &str, b: &str) -> bool {
    let (a, b) = (host_key(a), host_key(b));
    let local = |k: &str| k == "127.0.0.1" || k == "::1";
    a == b || (a == "localhost" && local(&b)) || (b == "localhost" && local(&a))
}

/// What a worker's `url` must be, when it is no URL of the kind.
const NOT_HTTP: &str = "it must be http://host:port";

/// What a worker's `url` must be, when it has more than a scheme, host and port.
const BASE_URL_ONLY: &str =
    "it must be the engine's base URL, http://host:port, with no path, query, fragment or user";

/// The running-request limit a worker counts when neither its configuration nor its engine says:
/// vLLM's `--max-num-seqs` default on GPUs below 70 GiB and on A100s (`vllm/engine/arg_utils.py`,
/// `get_batch_defaults`; 1024 on H100-class and larger GPUs).
pub const DEFAULT_MAX_RUNNING_REQUESTS: u32 = 256;

/// A worker's `role` as the YAML file and the admin API spell it (absent: `regular`).
///
/// # Errors
/// Any word but `regular`, `prefill` or `decode`, named in the message.
pub fn parse_role(s: Option<&str>) -> Result<Role, String> {
    match s {
        None | Some("regular") => Ok(Role::Regular),
        Some("prefill") => Ok(Role::Prefill),
        Some("decode") => Ok(Role::Decode),
        Some(o) => Err(format!("must be regular, prefill or decode, not `{o}`")),
    }
}

/// A worker's `unlabeled_stores` (absent: `plain`): whether stores that name no adapter or extra
/// keys are unknown ([`WorkerConfig::unlabeled_stores_unknown`]).
///
/// # Errors
/// Any word but `plain` or `unknown`, named in the message.
pub fn parse_unlabeled_stores(s: Option<&str>) -> Result<bool, String> {
    match s {
        None | Some("plain") => Ok(false),
        Some("unknown") => Ok(true),
        Some(o) => Err(format!("must be plain or unknown, not `{o}`")),
    }
}

/// Event endpoints given by configuration instead of discovery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventsOverride {
    /// PUB port of rank 0.
    pub publish_port_base: u16,
    /// ROUTER port of rank 0, if replay is on.
    pub replay_port_base: Option<u16>,
    /// Topic.
    pub topic: String,
    /// Number of DP ranks.
    pub dp_size: u16,
}

impl EventsOverride {
    /// Refuses endpoints no rank can have: no rank (`dp_size` 0), port 0, or a rank whose port
    /// (`base + rank`) is beyond 65535.
    ///
    /// # Errors
    /// The field (`dp_size`, `publish_port_base` or `replay_port_base`) and what is wrong with it.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.dp_size == 0 {
            return Err(("dp_size", "must be at least 1".to_owned()));
        }
        let last = self.dp_size - 1;
        for (field, base) in
            [("publish_port_base", Some(self.publish_port_base)), ("replay_port_base", self.replay_port_base)]
        {
            let Some(base) = base else { continue };
            if base == 0 {
                return Err((field, "must be a port number, not 0".to_owned()));
            }
            if u32::from(base) + u32::from(last) > u32::from(u16::MAX) {
                return Err((
                    field,
                    format!("{base} leaves rank {last} no port (rank r uses {field} + r, at most 65535)"),
                ));
            }
        }
        // Each rank's PUB and replay ROUTER are two sockets: their ranges must not share a port.
        if let Some(replay) = self.replay_port_base {
            let (p, r) = (u32::from(self.publish_port_base), u32::from(replay));
            let n = u32::from(self.dp_size);
            if p < r + n && r < p + n {
                return Err((
                    "replay_port_base",
                    format!(
                        "{replay} overlaps the publish ports ({p}..={}): rank r publishes on publish_port_base + r \
                         and replays on replay_port_base + r, two sockets that cannot share a port",
                        p + n - 1
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Where one rank of a worker publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEndpoints {
    /// The rank.
    pub rank: DpRank,
    /// `tcp://host:port` of the PUB socket.
    pub publish: String,
    /// `tcp://host:port` of the replay ROUTER, if any.
    pub replay: Option<String>,
    /// Topic.
    pub topic: String,
}

/// What the event plane must do, as the registry learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryEvent {
    /// Follow these holders (a worker was discovered or came back).
    Follow(Vec<HolderSource>),
    /// Stop following every rank of this worker and drop its ledger entries.
    Unfollow(WorkerId),
    /// The engine reports this many running (and waiting) requests on this holder; and when this
    /// gateway sent it, since the last report, the first and the last request that store new
    /// blocks (silence detection: only such work obliges the engine to publish events after it).
    Running(HolderId, u64, Option<(std::time::Instant, std::time::Instant)>),
}

/// Where a worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Being probed for the first time.
    Discovering,
    /// In the live pool.
    Live,
    /// Failed its probes: out of the pool, its ledger pruned.
    Down,
}

impl Phase {
    /// Lower-case name.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Discovering => "discovering",
            Phase::Live => "live",
            Phase::Down => "down",
        }
    }
}

/// What changes about a worker over its life.
#[derive(Clone, Debug)]
pub struct WorkerStatus {
    /// Life phase.
    pub phase: Phase,
    /// Data-parallel ranks (from discovery).
    pub dp_size: u16,
    /// Facts discovery read.
    pub facts: WorkerFacts,
    /// The registration verdict.
    pub alignment: Alignment,
    /// The event sources, if the worker publishes events.
    pub sources: Vec<RankEndpoints>,
    /// KV capacity per rank in blocks, if known.
    pub capacity_blocks: u32,
    /// The running-request limit per rank the scheduler counts, and where it came from.
    pub max_running: MaxRunning,
    /// The last probe or discovery error.
    pub last_error: Option<String>,
    /// SGLang prefill workers: the bootstrap port `/server_info` reported.
    pub bootstrap_port: Option<u16>,
    /// SGLang decode workers: whether the decode side keeps a radix cache (what its reported
    /// cached tokens and published blocks mean, `cortex_pd::alignment`).
    pub decode_radix_cache: bool,
}

/// Where a worker's running-request limit came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacitySource {
    /// `workers[].max_running_requests` (or the admin API's field).
    Config,
    /// The engine's per-rank load report (SGLang `/v1/loads`).
    LoadReport,
    /// The engine's discovery answer (SGLang `/server_info` `internal_states`).
    ServerInfo,
    /// Nothing said: [`DEFAULT_MAX_RUNNING_REQUESTS`].
    Default,
}

impl CapacitySource {
    /// Snake-case name (`/debug/workers`).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            CapacitySource::Config => "config",
            CapacitySource::LoadReport => "v1_loads",
            CapacitySource::ServerInfo => "server_info",
            CapacitySource::Default => "default",
        }
    }
}

/// A running-request limit per rank and its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxRunning {
    /// The limit.
    pub value: u32,
    /// Where it came from.
    pub source: CapacitySource,
}

impl MaxRunning {
    /// The limit for a worker configured with `config` whose engine reported `reported` (from
    /// `source`): the configuration wins, then the engine, then the default.
    #[must_use]
    pub fn resolve(config: Option<u32>, reported: Option<u32>, source: CapacitySource) -> Self {
        match (config, reported) {
            (Some(value), _) => MaxRunning { value, source: CapacitySource::Config },
            (None, Some(value)) => MaxRunning { value, source },
            (None, None) => {
                MaxRunning { value: DEFAULT_MAX_RUNNING_REQUESTS, source: CapacitySource::Default }
            }
        }
    }
}

/// A worker the gateway knows.
#[derive(Debug)]
pub struct WorkerRecord {
    /// Its id.
    pub id: WorkerId,
    /// Its configuration.
    pub config: WorkerConfig,
    /// Its base URI.
    pub base: Uri,
    /// Its host (for wildcard event endpoints).
    pub host: String,
    /// The API key its engine requires, sent on every request to it (its model's
    /// `worker_api_key_env`).
    pub api_key: Option<crate::auth::WorkerKey>,
    status: Mutex<WorkerStatus>,
}

impl WorkerRecord {
    /// A copy of the status.
    #[must_use]
    pub fn status(&self) -> WorkerStatus {
        self.status.lock().map_or_else(|p| p.into_inner().clone(), |s| s.clone())
    }

    /// Changes the status.
    pub fn update(&self, f: impl FnOnce(&mut WorkerStatus)) {
        match self.status.lock() {
            Ok(mut s) => f(&mut s),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    /// Data-parallel ranks.
    #[must_use]
    pub fn dp_size(&self) -> u16 {
        self.status().dp_size.max(1)
    }
}

/// Why a worker cannot be added.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    /// The name is empty, or holds whitespace or a control character (it is sent in headers and
    /// used as a metric label).
    #[error("worker name {name:?} {why}")]
    BadName {
        /// Worker name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The URL is not `http://host:port`.
    #[error("worker `{name}`: invalid url `{url}`: {why}")]
    BadUrl {
        /// Worker name.
        name: String,
        /// The URL.
        url: String,
        /// What it must be.
        why: &'static str,
    },
    /// The name is taken.
    #[error("a worker named `{0}` already exists")]
    Duplicate(String),
    /// Another worker has the same scheme, host and port.
    #[error("worker `{name}`: `{url}` is the address of worker `{other}` already")]
    SameUrl {
        /// Worker name.
        name: String,
        /// The URL.
        url: String,
        /// The worker that has it.
        other: String,
    },
    /// The model is not configured.
    #[error("worker `{name}` serves `{model}`, which is not a configured model")]
    UnknownModel {
        /// Worker name.
        name: String,
        /// The model named.
        model: String,
    },
    /// The worker's engine is not its model's (it could never be confirmed).
    #[error("worker `{name}` runs {engine}, but its model `{model}` is configured for {model_engine}")]
    EngineMismatch {
        /// Worker name.
        name: String,
        /// The worker's engine.
        engine: Engine,
        /// The model named.
        model: String,
        /// The model's engine.
        model_engine: Engine,
    },
}

/// The registry.
#[derive(Debug, Default)]
pub struct Registry {
    map: RwLock<Arc<HashMap<WorkerId, Arc<WorkerRecord>>>>,
    next: AtomicU32,
}

impl Registry {
    /// An empty registry.
    #[must_use]
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds a worker (phase `Discovering`).
    ///
    /// # Errors
    /// [`RegistryError`] for a bad name or URL ([`WorkerConfig::base_url`]), a name taken, or an
    /// address (scheme, host and port) that is another worker's.
    pub fn add(&self, config: WorkerConfig) -> Result<Arc<WorkerRecord>, RegistryError> {
        self.add_keyed(config, None)
    }

    /// [`Registry::add`] for a worker whose engine requires `api_key`.
    ///
    /// # Errors
    /// As [`Registry::add`].
    pub fn add_keyed(
        &self,
        config: WorkerConfig,
        api_key: Option<crate::auth::WorkerKey>,
    ) -> Result<Arc<WorkerRecord>, RegistryError> {
        let (base, host) = config.base_url()?;
        let mut guard = self.map.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.values().any(|w| w.config.name == config.name) {
            return Err(RegistryError::Duplicate(config.name));
        }
        // The scheme is always http: the same host and port is the same engine.
        if let Some(other) =
            guard.values().find(|w| same_host(&w.host, &host) && w.base.port_u16() == base.port_u16())
        {
            return Err(RegistryError::SameUrl {
                name: config.name,
                url: config.url,
                other: other.config.name.clone(),
            });
        }
        // Relaxed: ids only need to be unique, which the write lock also guarantees.
        let id = WorkerId(self.next.fetch_add(1, Ordering::Relaxed));
        let max_running = MaxRunning::resolve(config.max_running_requests, None, CapacitySource::Default);
        let record = Arc::new(WorkerRecord {
            id,
            config,
            base,
            host,
            api_key,
            status: Mutex::new(WorkerStatus {
                phase: Phase::Discovering,
                dp_size: 1,
                facts: WorkerFacts::default(),
                alignment: Alignment::Unconfirmed(vec!["discovery"]),
                sources: Vec::new(),
                capacity_blocks: 0,
                max_running,
                last_error: None,
                bootstrap_port: None,
                decode_radix_cache: false,
            }),
        });
        let mut next = HashMap::clone(&guard);
        next.insert(id, Arc::clone(&record));
        *guard = Arc::new(next);
        Ok(record)
    }

    /// Removes a worker; returns it.
    pub fn remove(&self, id: WorkerId) -> Option<Arc<WorkerRecord>> {
        let mut guard = self.map.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut next = HashMap::clone(&guard);
        let gone = next.remove(&id);
        *guard = Arc::new(next);
        gone
    }

    /// The current map.
    #[must_use]
    pub fn snapshot(&self) -> Arc<HashMap<WorkerId, Arc<WorkerRecord>>> {
        Arc::clone(&self.map.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// One worker.
    #[must_use]
    pub fn get(&self, id: WorkerId) -> Option<Arc<WorkerRecord>> {
        self.snapshot().get(&id).cloned()
    }

    /// A worker's configured name (the `worker` label of every metric).
    #[must_use]
    pub fn name(&self, id: WorkerId) -> Option<String> {
        self.get(id).map(|w| w.config.name.clone())
    }

    /// A worker by name.
    #[must_use]
    pub fn by_name(&self, name: &str) -> Option<Arc<WorkerRecord>> {
        self.snapshot().values().find(|w| w.config.name == name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM worker of model `m` named `name` at `url`.
    fn cfg(name: &str, url: &str) -> WorkerConfig {
        WorkerConfig {
            name: name.into(),
            url: url.into(),
            engine: Engine::Vllm,
            model: "m".into(),
            role: Role::Regular,
            max_running_requests: None,
            events: None,
            unlabeled_stores_unknown: false,
            bootstrap_port: None,
        }
    }

    #[test]
    fn registry_rejects_bad_urls_and_duplicates() {
        let r = Registry::new();
        assert!(r.add(cfg("a", "http://127.0.0.1:8000")).is_ok());
        assert_eq!(
            r.add(cfg("a", "http://127.0.0.1:8001")).unwrap_err(),
            RegistryError::Duplicate("a".into())
        );
        assert!(matches!(r.add(cfg("b", "not a url")), Err(RegistryError::BadUrl { .. })));
        assert!(matches!(r.add(cfg("c", "https://h:1")), Err(RegistryError::BadUrl { .. })));
        assert_eq!(r.by_name("a").unwrap().host, "127.0.0.1");
    }

    #[test]
    fn names_headers_can_carry_base_urls_and_one_worker_per_address() {
        let r = Registry::new();
        for (name, says) in [
            ("", "worker name \"\" must not be empty"),
            ("a b", "worker name \"a b\" must not contain whitespace"),
            ("a\u{1}", "worker name \"a\\u{1}\" must not contain whitespace or control"),
            ("a\t", "must not contain whitespace"),
        ] {
            let err = r.add(cfg(name, "http://h:1")).unwrap_err().to_string();
            assert!(err.contains(says), "{name:?}: {err}");
        }
        for url in ["http://h:1/v1", "http://h:1/v1/", "http://h:1/?x=1", "http://h:1#f", "http://u@h:1"] {
            let err = r.add(cfg("a", url)).unwrap_err().to_string();
            assert!(
                err.contains(&format!("`{url}`")) && err.contains("the engine's base URL"),
                "{url}: {err}"
            );
        }
        assert!(r.add(cfg("a", "http://Host:8000/")).is_ok());
        assert!(r.add(cfg("é-1", "http://[::1]:8000")).unwrap_err().to_string().contains("must be ASCII"));
        for name in ["dd\\x", "say\"hi"] {
            let err = r.add(cfg(name, "http://[::1]:8001")).unwrap_err().to_string();
            assert!(err.contains("must not contain `\"` or `\\`"), "{name}: {err}");
        }
        assert!(r.add(cfg("w-1.a_b:c", "http://[::1]:8000")).is_ok(), "any other visible ASCII is a name's");
        for same in ["http://host:8000", "http://HOST:8000/"] {
            assert_eq!(
                r.add(cfg("b", same)).unwrap_err(),
                RegistryError::SameUrl { name: "b".into(), url: same.into(), other: "a".into() }
            );
        }
        assert!(r.add(cfg("b", "http://host:8001")).is_ok(), "another port is another engine");
        // An IP address is compared as the address it reaches; `localhost` names 127.0.0.1 and
        // ::1; other loopback addresses are listeners of their own.
        for same in [
            "http://localhost:8000",
            "http://LOCALHOST.:8000",
            "http://[0:0:0:0:0:0:0:1]:8000",
            "http://[::]:8000",
        ] {
            assert_eq!(
                r.add(cfg("c", same)).unwrap_err(),
                RegistryError::SameUrl { name: "c".into(), url: same.into(), other: "w-1.a_b:c".into() }
            );
        }
        assert!(r.add(cfg("c", "http://127.0.0.1:8000")).is_ok(), "::1 and 127.0.0.1 are two listeners");
        for same in [
            "http://[::ffff:127.0.0.1]:8000",
            "http://2130706433:8000",
            "http://0.0.0.0:8000",
            "http://127.1:8000",
            "http://0x7f000001:8000",
            "http://0177.0.0.1:8000",
            "http://127.0.0.01:8000",
        ] {
            assert_eq!(
                r.add(cfg("d", same)).unwrap_err(),
                RegistryError::SameUrl { name: "d".into(), url: same.into(), other: "c".into() }
            );
        }
        assert!(r.add(cfg("d", "http://127.0.0.2:8000")).is_ok(), "another loopback address");
        assert!(r.add(cfg("e", "http://[2001:db8::1]:8000")).is_ok());
        assert!(matches!(r.add(cfg("f", "http://[2001:db8:0::1]:8000")), Err(RegistryError::SameUrl { .. })));
        assert!(
            r.add(cfg("f", "http://h:0")).unwrap_err().to_string().contains("http://host:port"),
            "port 0"
        );
        assert_eq!(r.snapshot().len(), 6);
    }

    #[test]
    fn ipv4_in_the_resolver_s_forms() {
        for (s, ip) in [
            ("127.0.0.1", Some("127.0.0.1")),
            ("127.1", Some("127.0.0.1")),
            ("127.0.1", Some("127.0.0.1")),
            ("0x7f000001", Some("127.0.0.1")),
            ("0x7f.0.0.1", Some("127.0.0.1")),
            ("0177.0.0.1", Some("127.0.0.1")),
            ("017700000001", Some("127.0.0.1")),
            ("2130706433", Some("127.0.0.1")),
            ("10.0.258", Some("10.0.1.2")),
            ("256.0.0.1", None),
            ("1.2.3.4.5", None),
            ("08.0.0.1", None),
            ("0x", None),
            ("127..1", None),
            ("+1.2.3.4", None),
            ("4294967296", None),
            ("1.16777216", None),
            ("host", None),
            ("", None),
        ] {
            assert_eq!(inet_aton(s).map(|a| a.to_string()), ip.map(str::to_owned), "{s:?}");
        }
    }

    #[test]
    fn roles_are_regular_prefill_or_decode() {
        assert_eq!(parse_role(None), Ok(Role::Regular));
        assert_eq!(parse_role(Some("regular")), Ok(Role::Regular));
        assert_eq!(parse_role(Some("prefill")), Ok(Role::Prefill));
        assert_eq!(parse_role(Some("decode")), Ok(Role::Decode));
        let e = parse_role(Some("leader")).unwrap_err();
        assert!(e.contains("leader") && e.contains("prefill"), "{e}");
    }

    #[test]
    fn the_configured_limit_wins_then_the_engine_then_the_default() {
        let s = CapacitySource::LoadReport;
        assert_eq!(
            MaxRunning::resolve(Some(8), Some(64), s),
            MaxRunning { value: 8, source: CapacitySource::Config }
        );
        assert_eq!(MaxRunning::resolve(None, Some(64), s), MaxRunning { value: 64, source: s });
        assert_eq!(
            MaxRunning::resolve(None, None, s),
            MaxRunning { value: DEFAULT_MAX_RUNNING_REQUESTS, source: CapacitySource::Default }
        );
    }
}
