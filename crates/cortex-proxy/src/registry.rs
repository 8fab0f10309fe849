//! The workers the gateway knows: their addresses and what discovery learned about them, and the
//! pure parsers of the engines' discovery and load endpoints.
//!
//! Key decision: workers are identified by a typed [`WorkerId`] everywhere; the URL is only an
//! attribute. The registry is an immutable map swapped on change (reads clone one `Arc`), and the
//! event plane is told about workers through [`RegistryEvent`]s on a channel, so this crate never
//! depends on the ZeroMQ runtime (the binary wires the two).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cortex_hash::Engine;
use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::profile::{Alignment, Bigram, WorkerFacts};
use cortex_hash::vllm::HashAlgo;
use cortex_sched::{EngineLoad, Role};
use http::Uri;
use serde_json::Value;

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
    /// Regular, prefill or decode.
    pub role: Role,
    /// KV events for engines that do not advertise them (vLLM < 0.31 has no
    /// `/kv_event_sources`): per-rank endpoints are `publish_port_base + rank`.
    pub events: Option<EventsOverride>,
    /// Stores that do not say which adapter or extra keys they were made under (SGLang never
    /// names unregistered LoRA adapters; vLLM before 0.17 has no `extra_keys`) are never counted,
    /// instead of being read as plain base-model blocks. For workers that serve such traffic.
    pub unlabeled_stores_unknown: bool,
}

/// A worker's `role` as the YAML file and the admin API spell it (absent: `regular`).
///
/// # Errors
/// Any other word, named in the message.
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

/// One holder the event plane must follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    /// The holder.
    pub holder: HolderId,
    /// The engine (its wire format).
    pub engine: Engine,
    /// Served model name.
    pub model: String,
    /// Endpoints.
    pub endpoints: RankEndpoints,
    /// The engine's KV capacity in blocks.
    pub capacity_blocks: u32,
    /// Whether equal content gives equal engine hashes across workers.
    pub content_deterministic: bool,
    /// Stores without an adapter or extra-key label are unknown, never base-model blocks (see
    /// [`WorkerConfig::unlabeled_stores_unknown`]).
    pub unlabeled_stores_unknown: bool,
}

/// What the event plane must do, as the registry learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryEvent {
    /// Follow these holders (a worker was discovered or came back).
    Follow(Vec<EventSource>),
    /// Stop following every rank of this worker and drop its ledger entries.
    Unfollow(WorkerId),
    /// The engine reports this many running requests on this holder (silence detection).
    Running(HolderId, u64),
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
    /// The last probe or discovery error.
    pub last_error: Option<String>,
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
    /// The URL is not `http://host:port`.
    #[error("worker `{name}`: invalid url `{url}`")]
    BadUrl {
        /// Worker name.
        name: String,
        /// The URL.
        url: String,
    },
    /// The name is taken.
    #[error("a worker named `{0}` already exists")]
    Duplicate(String),
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
    /// [`RegistryError`] for a bad URL or a duplicate name.
    pub fn add(&self, config: WorkerConfig) -> Result<Arc<WorkerRecord>, RegistryError> {
        let base: Uri = config
            .url
            .trim_end_matches('/')
            .parse()
            .map_err(|_| RegistryError::BadUrl { name: config.name.clone(), url: config.url.clone() })?;
        let host = match (base.scheme_str(), base.host()) {
            (Some("http"), Some(h)) if base.port_u16().is_some() => h.trim_matches(['[', ']']).to_owned(),
            _ => return Err(RegistryError::BadUrl { name: config.name.clone(), url: config.url.clone() }),
        };
        let mut guard = self.map.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.values().any(|w| w.config.name == config.name) {
            return Err(RegistryError::Duplicate(config.name));
        }
        // Relaxed: ids only need to be unique, which the write lock also guarantees.
        let id = WorkerId(self.next.fetch_add(1, Ordering::Relaxed));
        let record = Arc::new(WorkerRecord {
            id,
            config,
            base,
            host,
            status: Mutex::new(WorkerStatus {
                phase: Phase::Discovering,
                dp_size: 1,
                facts: WorkerFacts::default(),
                alignment: Alignment::Unconfirmed(vec!["discovery"]),
                sources: Vec::new(),
                capacity_blocks: 0,
                last_error: None,
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

    /// A worker by name.
    #[must_use]
    pub fn by_name(&self, name: &str) -> Option<Arc<WorkerRecord>> {
        self.snapshot().values().find(|w| w.config.name == name).cloned()
    }
}

/// Replaces a wildcard host (`*`, `0.0.0.0`, `::`, empty) by the worker's.
fn endpoint_host<'a>(host: &'a str, worker_host: &'a str) -> &'a str {
    match host {
        "" | "*" | "0.0.0.0" | "::" | "[::]" => worker_host,
        h => h,
    }
}

fn tcp(host: &str, port: u64) -> String {
    if host.contains(':') { format!("tcp://[{host}]:{port}") } else { format!("tcp://{host}:{port}") }
}

/// Rewrites `tcp://*:5557` (vLLM reports endpoints as configured) with the worker's host.
fn rewrite_endpoint(endpoint: &str, worker_host: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u64 = port.parse().ok()?;
    Some(tcp(endpoint_host(host.trim_matches(['[', ']']), worker_host), port))
}

/// What SGLang's `/server_info` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SglangInfo {
    /// Facts for the profile check.
    pub facts: WorkerFacts,
    /// DP ranks.
    pub dp_size: u16,
    /// Event endpoints, if events are on.
    pub sources: Vec<RankEndpoints>,
    /// KV capacity per rank in blocks.
    pub capacity_blocks: u32,
}

/// Parses SGLang's `/server_info` (research/sglang.md §1.7; golden `server_info_kv_events.json`).
#[must_use]
pub fn parse_server_info(v: &Value, worker_host: &str) -> SglangInfo {
    let u = |k: &str| v.get(k).and_then(Value::as_u64);
    let page = u("page_size").unwrap_or(1);
    let dcp = u("dcp_size").unwrap_or(1).max(1);
    let ev = v.get("kv_events").filter(|e| e.is_object());
    let block_size = ev.and_then(|e| e.get("block_size")).and_then(Value::as_u64).unwrap_or(page * dcp);
    let dp_size = ev
        .and_then(|e| e.get("dp_size"))
        .and_then(Value::as_u64)
        .or_else(|| u("dp_size"))
        .unwrap_or(1)
        .clamp(1, u64::from(u16::MAX)) as u16;
    let bigram = match v.get("speculative_algorithm").and_then(Value::as_str) {
        Some("EAGLE" | "EAGLE3" | "FROZEN_KV_MTP") => Bigram::On,
        _ => Bigram::Off,
    };
    let model = v
        .get("served_model_name")
        .and_then(Value::as_str)
        .or_else(|| v.get("model_path").and_then(Value::as_str))
        .map(str::to_owned);
    let mut sources = Vec::new();
    if let Some(e) = ev {
        let host = endpoint_host(e.get("endpoint_host").and_then(Value::as_str).unwrap_or("*"), worker_host);
        let topic = e.get("topic").and_then(Value::as_str).unwrap_or_default();
        if let Some(base) = e.get("endpoint_port_base").and_then(Value::as_u64) {
            let replay = e.get("replay_endpoint_port_base").and_then(Value::as_u64);
            for r in 0..dp_size {
                sources.push(RankEndpoints {
                    rank: DpRank(r),
                    publish: tcp(host, base + u64::from(r)),
                    replay: replay.map(|p| tcp(host, p + u64::from(r))),
                    topic: topic.to_owned(),
                });
            }
        }
    }
    let capacity_blocks =
        u("max_total_num_tokens").map_or(0, |t| u32::try_from(t / block_size.max(1)).unwrap_or(u32::MAX));
    SglangInfo {
        facts: WorkerFacts {
            engine: Some(Engine::Sglang),
            model,
            block_size: u32::try_from(block_size).ok(),
            hash_algo: None,
            bigram: Some(bigram),
            tokens_agree: None,
        },
        dp_size,
        sources,
        capacity_blocks,
    }
}

/// Parses vLLM's `/kv_event_sources` (≥ 0.31): one entry per rank, endpoints already offset.
#[must_use]
pub fn parse_kv_event_sources(v: &Value, worker_host: &str) -> Vec<RankEndpoints> {
    let Some(obj) = v.as_object() else { return Vec::new() };
    let mut out: Vec<RankEndpoints> = obj
        .iter()
        .filter_map(|(rank, s)| {
            let rank = DpRank(rank.parse().ok()?);
            if s.get("publisher").and_then(Value::as_str) != Some("zmq") {
                return None;
            }
            let publish = rewrite_endpoint(s.get("endpoint")?.as_str()?, worker_host)?;
            let replay = s
                .get("replay_endpoint")
                .and_then(Value::as_str)
                .and_then(|e| rewrite_endpoint(e, worker_host));
            let topic = s.get("topic").and_then(Value::as_str).unwrap_or_default().to_owned();
            Some(RankEndpoints { rank, publish, replay, topic })
        })
        .collect();
    out.sort_by_key(|e| e.rank);
    out
}

/// Every sample of `metric` in a Prometheus text exposition: its labels and value.
#[must_use]
pub fn prom_samples(text: &str, metric: &str) -> Vec<(HashMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else { continue };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once('}') {
                Some((l, v)) => (parse_labels(l), v),
                None => continue,
            },
            None if rest.starts_with(' ') => (HashMap::new(), rest),
            None => continue,
        };
        if let Some(v) = value.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            out.push((labels, v));
        }
    }
    out
}

fn parse_labels(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = s;
    while let Some((k, r)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = r.char_indices();
        let mut end = r.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(k.trim().trim_start_matches(',').trim().to_owned(), value);
        rest = &r[end..];
    }
    out
}

/// What vLLM's `/metrics` says: block size, hash algorithm and capacity from
/// `vllm:cache_config_info`, and the load per DP engine.
#[derive(Clone, Debug, PartialEq)]
pub struct VllmMetrics {
    /// `block_size` label.
    pub block_size: Option<u32>,
    /// `prefix_caching_hash_algo` label.
    pub hash_algo: Option<HashAlgo>,
    /// `num_gpu_blocks` label.
    pub num_gpu_blocks: Option<u32>,
    /// Load per `engine` label (the DP rank).
    pub loads: Vec<(DpRank, EngineLoad)>,
}

/// Parses vLLM's `/metrics`.
#[must_use]
pub fn parse_vllm_metrics(text: &str) -> VllmMetrics {
    let info = prom_samples(text, "vllm:cache_config_info");
    let label = |k: &str| info.first().and_then(|(l, _)| l.get(k).cloned());
    let mut loads: HashMap<u16, EngineLoad> = HashMap::new();
    let mut read = |metric: &str, set: &mut dyn FnMut(&mut EngineLoad, f64)| {
        for (labels, v) in prom_samples(text, metric) {
            let rank = labels.get("engine").and_then(|e| e.parse().ok()).unwrap_or(0);
            set(loads.entry(rank).or_default(), v);
        }
    };
    read("vllm:num_requests_running", &mut |l, v| l.running = v as u32);
    read("vllm:num_requests_waiting", &mut |l, v| l.waiting = v as u32);
    read("vllm:kv_cache_usage_perc", &mut |l, v| l.kv_usage = v as f32);
    let mut loads: Vec<(DpRank, EngineLoad)> = loads.into_iter().map(|(r, l)| (DpRank(r), l)).collect();
    loads.sort_by_key(|(r, _)| *r);
    VllmMetrics {
        block_size: label("block_size").and_then(|b| b.parse().ok()),
        hash_algo: label("prefix_caching_hash_algo").and_then(|a| HashAlgo::parse(&a)),
        num_gpu_blocks: label("num_gpu_blocks").and_then(|b| b.parse().ok()),
        loads,
    }
}

/// Parses SGLang's `/v1/loads`.
#[must_use]
pub fn parse_sglang_loads(v: &Value) -> Vec<(DpRank, EngineLoad)> {
    let Some(loads) = v.get("loads").and_then(Value::as_array) else { return Vec::new() };
    loads
        .iter()
        .filter_map(|l| {
            let u = |k: &str| l.get(k).and_then(Value::as_u64).unwrap_or(0);
            let rank = u16::try_from(l.get("dp_rank")?.as_u64()?).ok()?;
            Some((
                DpRank(rank),
                EngineLoad {
                    running: u32::try_from(u("num_running_reqs")).unwrap_or(u32::MAX),
                    waiting: u32::try_from(u("num_waiting_reqs")).unwrap_or(u32::MAX),
                    waiting_prefill_tokens: u("num_waiting_uncached_tokens"),
                    kv_usage: l.get("token_usage").and_then(Value::as_f64).unwrap_or(0.0) as f32,
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_golden_shape() {
        let v = serde_json::json!({
            "served_model_name": "qwen3", "page_size": 16, "dcp_size": 1, "dp_size": 2,
            "speculative_algorithm": null, "max_total_num_tokens": 32768,
            "kv_events": {"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,"topic":"kv",
                          "block_size":16,"dp_size":2,"replay_endpoint_port_base":5600}
        });
        let info = parse_server_info(&v, "10.0.0.7");
        assert_eq!(info.dp_size, 2);
        assert_eq!(info.capacity_blocks, 2048);
        assert_eq!(info.facts.block_size, Some(16));
        assert_eq!(info.facts.bigram, Some(Bigram::Off));
        assert_eq!(info.sources[1].publish, "tcp://10.0.0.7:5558");
        assert_eq!(info.sources[1].replay.as_deref(), Some("tcp://10.0.0.7:5601"));
        assert_eq!(info.sources[0].topic, "kv");
        let none = parse_server_info(&serde_json::json!({"page_size": 64, "kv_events": null}), "h");
        assert!(none.sources.is_empty());
        assert_eq!(none.facts.block_size, Some(64));
    }

    #[test]
    fn kv_event_sources_rewrite_wildcards() {
        let v = serde_json::json!({
            "1": {"publisher":"zmq","endpoint":"tcp://*:5558","replay_endpoint":null,"topic":"kv-events"},
            "0": {"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5657","topic":"kv-events"}
        });
        let s = parse_kv_event_sources(&v, "127.0.0.1");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].publish, "tcp://127.0.0.1:5557");
        assert_eq!(s[0].replay.as_deref(), Some("tcp://127.0.0.1:5657"));
        assert_eq!(s[1].replay, None);
    }

    #[test]
    fn vllm_metrics() {
        let text = "# HELP x\nvllm:cache_config_info{block_size=\"16\",prefix_caching_hash_algo=\"sha256_cbor\",num_gpu_blocks=\"1000\"} 1.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n";
        let m = parse_vllm_metrics(text);
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.hash_algo, Some(HashAlgo::Sha256Cbor));
        assert_eq!(m.num_gpu_blocks, Some(1000));
        assert_eq!(m.loads[0].1.running, 3);
        assert_eq!(m.loads[0].1.waiting, 1);
        assert!((m.loads[0].1.kv_usage - 0.25).abs() < 1e-6);
        assert_eq!(m.loads[1].0, DpRank(1));
    }

    #[test]
    fn sglang_loads() {
        let v = serde_json::json!({"loads": [{"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 5, "token_usage": 0.5, "num_waiting_uncached_tokens": 100}]});
        let l = parse_sglang_loads(&v);
        assert_eq!(l[0].0, DpRank(1));
        assert_eq!((l[0].1.running, l[0].1.waiting, l[0].1.waiting_prefill_tokens), (2, 5, 100));
    }

    #[test]
    fn registry_rejects_bad_urls_and_duplicates() {
        let r = Registry::new();
        let cfg = |name: &str, url: &str| WorkerConfig {
            name: name.into(),
            url: url.into(),
            engine: Engine::Vllm,
            model: "m".into(),
            role: Role::Regular,
            events: None,
            unlabeled_stores_unknown: false,
        };
        assert!(r.add(cfg("a", "http://127.0.0.1:8000")).is_ok());
        assert_eq!(
            r.add(cfg("a", "http://127.0.0.1:8001")).unwrap_err(),
            RegistryError::Duplicate("a".into())
        );
        assert!(matches!(r.add(cfg("b", "not a url")), Err(RegistryError::BadUrl { .. })));
        assert!(matches!(r.add(cfg("c", "https://h:1")), Err(RegistryError::BadUrl { .. })));
        assert_eq!(r.by_name("a").unwrap().host, "127.0.0.1");
    }
}
