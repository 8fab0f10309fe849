//! What the engines' discovery and load endpoints say, as pure functions of their bodies: SGLang
//! `/server_info` and `/v1/loads`, vLLM `/kv_event_sources`, `/metrics` and `/v1/models`.
//!
//! Key decision: parsing is separate from asking. [`crate::probes`] sends the requests and
//! [`crate::control`] acts on the answers; everything here takes a body and returns typed facts,
//! so each field is tested on captures of the engines' own output (the `kv_events` block of
//! `golden/sglang/server_info_kv_events.json`) and on fixtures written from the engines' source,
//! file and line cited next to each. A fact an answer does not carry stays `None` (the profile
//! check then says it is unconfirmed), never a guessed default.

use std::collections::HashMap;

use cortex_hash::Engine;
use cortex_hash::kv::DpRank;
use cortex_hash::profile::{Bigram, WorkerFacts};
use cortex_hash::vllm::HashAlgo;
use cortex_sched::{EngineLoad, PrefillTotals, Role};
use serde_json::Value;

use crate::registry::{EventsOverride, RankEndpoints};

/// What discovery learned about a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    /// Facts for the profile check (`tokens_agree` is filled by the tokens probe).
    pub facts: WorkerFacts,
    /// Data-parallel ranks.
    pub dp_size: u16,
    /// Where each rank publishes KV events (empty: no events).
    pub sources: Vec<RankEndpoints>,
    /// KV capacity per rank in blocks (0: unknown).
    pub capacity_blocks: u32,
    /// The engine's limit on running requests per rank, when it reports one.
    pub max_running_requests: Option<u32>,
    /// What the engine says of prefill/decode disaggregation (SGLang; vLLM says nothing).
    pub pd: PdFacts,
}

/// What SGLang's `/server_info` says of disaggregation (its server arguments
/// `disaggregation_mode`, `disaggregation_bootstrap_port` and
/// `disaggregation_decode_enable_radix_cache`, `srt/server_args.py`); `None` where the answer
/// does not carry the field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PdFacts {
    /// The role the engine runs in.
    pub role: Option<Role>,
    /// The prefill side's bootstrap server port.
    pub bootstrap_port: Option<u16>,
    /// Whether a decode worker keeps a radix (prefix) cache.
    pub decode_radix_cache: Option<bool>,
}

impl PdFacts {
    /// Why a worker configured with `configured` cannot serve in that role, when the engine
    /// reports another one (a prefill or decode SGLang worker refuses requests without a
    /// bootstrap room; a regular one ignores the bootstrap fields).
    #[must_use]
    pub fn role_conflict(&self, configured: Role) -> Option<String> {
        let reported = self.role?;
        (reported != configured).then(|| {
            format!(
                "configured with role `{}`, but the engine runs with disaggregation_mode `{}`",
                configured.as_str(),
                match reported {
                    Role::Regular => "null",
                    r => r.as_str(),
                }
            )
        })
    }
}

/// One rank's load report (SGLang `/v1/loads`, vLLM `/metrics`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankReport {
    /// The rank.
    pub rank: DpRank,
    /// Running, waiting, uncached waiting tokens, KV usage.
    pub load: EngineLoad,
    /// The rank's limit on running requests, when the engine reports it (SGLang).
    pub max_running_requests: Option<u32>,
    /// The rank's KV capacity in tokens, when the engine reports it (SGLang).
    pub max_total_num_tokens: Option<u64>,
}

/// The smallest running-request limit the ranks report (the ranks of one worker share one
/// configuration; the smallest is the safe reading if they ever differ).
#[must_use]
pub fn reported_max_running(reports: &[RankReport]) -> Option<u32> {
    reports.iter().filter_map(|r| r.max_running_requests).min()
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

fn positive_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64).filter(|&n| n > 0).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// SGLang's `/server_info`: the resolved server arguments, the scheduler's init info
/// (`max_total_num_tokens`), `internal_states` per DP rank and the `kv_events` descriptor.
///
/// The running-request limit is the scheduler's own per-rank value
/// (`internal_states[].effective_max_running_requests_per_dp`), not the top-level
/// `max_running_requests` server argument, which is `null` unless set and is divided among
/// attention-DP ranks by the engine.
#[must_use]
pub fn sglang_server_info(v: &Value, worker_host: &str) -> Discovery {
    let u = |k: &str| v.get(k).and_then(Value::as_u64);
    let dcp = u("dcp_size").unwrap_or(1).max(1);
    let ev = v.get("kv_events").filter(|e| e.is_object());
    let block_size = ev
        .and_then(|e| e.get("block_size"))
        .and_then(Value::as_u64)
        .or_else(|| u("page_size").map(|p| p * dcp))
        .filter(|&b| b > 0);
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
        let host = host.trim_matches(['[', ']']);
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
    let capacity_blocks = match (u("max_total_num_tokens"), block_size) {
        (Some(t), Some(b)) => u32::try_from(t / b).unwrap_or(u32::MAX),
        _ => 0,
    };
    let max_running_requests = v
        .get("internal_states")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| positive_u32(s.get("effective_max_running_requests_per_dp")))
        .min();
    let pd = PdFacts {
        role: match v.get("disaggregation_mode") {
            Some(Value::String(m)) if m == "prefill" => Some(Role::Prefill),
            Some(Value::String(m)) if m == "decode" => Some(Role::Decode),
            Some(Value::String(m)) if m == "null" => Some(Role::Regular),
            Some(Value::Null) => Some(Role::Regular),
            _ => None,
        },
        bootstrap_port: v
            .get("disaggregation_bootstrap_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok()),
        decode_radix_cache: v.get("disaggregation_decode_enable_radix_cache").and_then(Value::as_bool),
    };
    Discovery {
        facts: WorkerFacts {
            engine: Some(Engine::Sglang),
            model,
            block_size: block_size.and_then(|b| u32::try_from(b).ok()),
            hash_algo: None,
            bigram: Some(bigram),
            tokens_agree: None,
        },
        dp_size,
        sources,
        capacity_blocks,
        max_running_requests,
        pd,
    }
}

/// vLLM's answers: `/metrics` (parsed by [`vllm_metrics`]), `/kv_event_sources` (≥ 0.31; `None`
/// when the worker has no such route) and the served model of `/v1/models`.
#[must_use]
pub fn vllm_discovery(
    metrics: &VllmMetrics,
    kv_event_sources: Option<&Value>,
    served_model: Option<String>,
    worker_host: &str,
) -> Discovery {
    let sources = kv_event_sources.map(|v| vllm_kv_event_sources(v, worker_host)).unwrap_or_default();
    Discovery {
        facts: WorkerFacts {
            engine: Some(Engine::Vllm),
            model: served_model,
            block_size: metrics.block_size,
            hash_algo: metrics.hash_algo,
            bigram: None,
            tokens_agree: None,
        },
        dp_size: u16::try_from(sources.len().max(1)).unwrap_or(1),
        sources,
        capacity_blocks: metrics.num_gpu_blocks.unwrap_or(0),
        max_running_requests: None,
        pd: PdFacts::default(),
    }
}

/// Replaces what discovery found about events by configured endpoints (engines that do not
/// advertise them): rank `r` publishes on `publish_port_base + r` of the worker's host.
pub fn apply_events_override(d: &mut Discovery, o: &EventsOverride, worker_host: &str) {
    d.dp_size = o.dp_size.max(1);
    d.sources = (0..d.dp_size)
        .map(|r| RankEndpoints {
            rank: DpRank(r),
            publish: tcp(worker_host, u64::from(o.publish_port_base) + u64::from(r)),
            replay: o.replay_port_base.map(|p| tcp(worker_host, u64::from(p) + u64::from(r))),
            topic: o.topic.clone(),
        })
        .collect();
}

/// vLLM's `/kv_event_sources` (≥ 0.31): one `KVEventsConfig` per DP rank, endpoints already
/// offset by the rank; only `zmq` publishers are followed.
#[must_use]
pub fn vllm_kv_event_sources(v: &Value, worker_host: &str) -> Vec<RankEndpoints> {
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

/// Every model an OpenAI `/v1/models` answer lists (vLLM: each `--served-model-name`, then the
/// LoRA adapters), in its order.
#[must_use]
pub fn served_models(v: &Value) -> Vec<String> {
    v["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect()
}

/// Why a worker configured as a vLLM engine is not one: its `/v1/models` says its models are
/// owned by another engine (SGLang's say `sglang`, vLLM's `vllm`; SGLang's router tells the
/// backends apart the same way). `None` when they say `vllm` or nothing.
#[must_use]
pub fn vllm_engine_conflict(v: &Value) -> Option<String> {
    let owner = v["data"].as_array()?.iter().find_map(|m| m["owned_by"].as_str())?;
    owner.eq_ignore_ascii_case("sglang").then(|| {
        format!(
            "configured as a vLLM engine, but the worker's /v1/models says its models are owned by `{owner}`: \
             an SGLang engine (its events, hashes and load reports are SGLang's)"
        )
    })
}

/// Why a worker configured to serve `configured` cannot answer its requests: it names the models
/// it serves (`served`: vLLM's `/v1/models`, SGLang's `served_model_name`) and `configured` is
/// not one of them. `None` when it serves it or names none (the profile check then says the
/// model is unconfirmed).
#[must_use]
pub fn model_conflict(configured: &str, served: &[String]) -> Option<String> {
    (!served.is_empty() && !served.iter().any(|m| m == configured)).then(|| {
        let names: Vec<String> = served.iter().map(|m| format!("`{m}`")).collect();
        format!("configured with model `{configured}`, but the worker serves {}", names.join(", "))
    })
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
    /// Load per `engine` label (the DP rank). vLLM reports no running-request limit.
    pub loads: Vec<RankReport>,
}

/// Parses vLLM's `/metrics`.
#[must_use]
pub fn vllm_metrics(text: &str) -> VllmMetrics {
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
    let mut loads: Vec<RankReport> = loads
        .into_iter()
        .map(|(r, load)| RankReport {
            rank: DpRank(r),
            load,
            max_running_requests: None,
            max_total_num_tokens: None,
        })
        .collect();
    loads.sort_by_key(|r| r.rank);
    VllmMetrics {
        block_size: label("block_size").and_then(|b| b.parse().ok()),
        hash_algo: label("prefix_caching_hash_algo").and_then(|a| HashAlgo::parse(&a)),
        num_gpu_blocks: label("num_gpu_blocks").and_then(|b| b.parse().ok()),
        loads,
    }
}

/// Parses SGLang's `/v1/loads`: one `LoadSnapshot` per DP rank.
#[must_use]
pub fn sglang_loads(v: &Value) -> Vec<RankReport> {
    let Some(loads) = v.get("loads").and_then(Value::as_array) else { return Vec::new() };
    loads
        .iter()
        .filter_map(|l| {
            let u = |k: &str| l.get(k).and_then(Value::as_u64).unwrap_or(0);
            let rank = u16::try_from(l.get("dp_rank")?.as_u64()?).ok()?;
            Some(RankReport {
                rank: DpRank(rank),
                load: EngineLoad {
                    running: u32::try_from(u("num_running_reqs")).unwrap_or(u32::MAX),
                    waiting: u32::try_from(u("num_waiting_reqs")).unwrap_or(u32::MAX),
                    waiting_prefill_tokens: l.get("num_waiting_uncached_tokens").and_then(Value::as_u64),
                    kv_usage: l.get("token_usage").and_then(Value::as_f64).unwrap_or(0.0) as f32,
                    // Cumulative prefill work (`LoadSnapshot.total_prefill_uncached_tokens`,
                    // `total_prefill_busy_us`): two reports give a prefill-rate sample.
                    prefill_totals: match (
                        l.get("total_prefill_uncached_tokens").and_then(Value::as_u64),
                        l.get("total_prefill_busy_us").and_then(Value::as_u64),
                    ) {
                        (Some(tokens), Some(us)) => Some(PrefillTotals {
                            uncached_tokens: tokens,
                            busy: std::time::Duration::from_micros(us),
                        }),
                        _ => None,
                    },
                },
                max_running_requests: positive_u32(l.get("max_running_requests")),
                max_total_num_tokens: l
                    .get("max_total_num_tokens")
                    .and_then(Value::as_u64)
                    .filter(|&t| t > 0),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn golden(path: &str) -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden").join(path);
        serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Every case of the capture: the `kv_events` block exactly as SGLang 0.5.23's
    /// `describe_kv_events_publisher` wrote it, inside a `/server_info` with the case's server
    /// arguments.
    #[test]
    fn server_info_kv_events_golden() {
        let g = golden("sglang/server_info_kv_events.json");
        let cases = g["cases"].as_array().unwrap();
        assert!(cases.len() >= 10, "the capture has its cases");
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let args = &case["server_args"];
            let ev = &case["kv_events"];
            let info = json!({"page_size": args["page_size"], "dcp_size": args["dcp_size"],
                              "dp_size": args["dp_size"], "kv_events": ev});
            let d = sglang_server_info(&info, "10.0.0.7");
            if ev.is_null() {
                assert!(d.sources.is_empty(), "{name}: no publisher, no sources");
                continue;
            }
            let ranks = ev["dp_size"].as_u64().unwrap();
            assert_eq!(u64::from(d.dp_size), ranks, "{name}: one holder per DP rank");
            assert_eq!(d.sources.len() as u64, ranks, "{name}");
            assert_eq!(u64::from(d.facts.block_size.unwrap()), ev["block_size"].as_u64().unwrap(), "{name}");
            let host = match ev["endpoint_host"].as_str().unwrap() {
                "*" => "10.0.0.7".to_owned(),
                h => h.trim_matches(['[', ']']).to_owned(),
            };
            let base = ev["endpoint_port_base"].as_u64().unwrap();
            for (r, s) in d.sources.iter().enumerate() {
                assert_eq!(s.rank, DpRank(r as u16), "{name}");
                assert_eq!(s.publish, tcp(&host, base + r as u64), "{name}");
                assert_eq!(
                    s.replay,
                    ev["replay_endpoint_port_base"].as_u64().map(|p| tcp(&host, p + r as u64)),
                    "{name}"
                );
                assert_eq!(s.topic, ev["topic"].as_str().unwrap(), "{name}");
            }
        }
        // Spot checks a mistake in the loop above could hide.
        let by_name = |n: &str| cases.iter().find(|c| c["name"] == n).unwrap();
        let c = by_name("wildcard_topic_kv_replay_dp2");
        let d = sglang_server_info(&json!({"page_size": 16, "kv_events": c["kv_events"]}), "10.0.0.7");
        assert_eq!(d.sources[1].publish, "tcp://10.0.0.7:5558");
        assert_eq!(d.sources[1].replay.as_deref(), Some("tcp://10.0.0.7:5559"));
        let c = by_name("ipv6_loopback");
        let d = sglang_server_info(&json!({"page_size": 16, "kv_events": c["kv_events"]}), "10.0.0.7");
        assert_eq!(d.sources[0].publish, "tcp://[::1]:5557");
        let c = by_name("dcp_size_2_doubles_block_size");
        let d =
            sglang_server_info(&json!({"page_size": 16, "dcp_size": 2, "kv_events": c["kv_events"]}), "h");
        assert_eq!(d.facts.block_size, Some(32));
    }

    /// Hand-derived from SGLang 0.5.23's source (not a capture): `/server_info` is
    /// `build_server_info` (`python/sglang/srt/utils/common.py:3584-3593`: the resolved server
    /// arguments, then `result.update(scheduler_info)`, then `kv_events`) plus `internal_states`
    /// and `version` (`python/sglang/srt/entrypoints/http_server.py:882-892`). The scheduler info
    /// carries `max_total_num_tokens` (`python/sglang/srt/managers/scheduler.py:1945`, per rank:
    /// `data_parallel_controller.py:821` takes rank 0's); each internal state carries
    /// `effective_max_running_requests_per_dp` = the scheduler's `max_running_requests`
    /// (`python/sglang/srt/managers/scheduler_components/internal_state.py:73`).
    #[test]
    fn server_info_capacity_hand_derived() {
        let v = json!({
            "served_model_name": "qwen3", "page_size": 16, "dcp_size": 1, "dp_size": 2,
            "speculative_algorithm": null, "max_running_requests": null, "max_total_num_tokens": 32768,
            "internal_states": [
                {"effective_max_running_requests_per_dp": 48, "last_gen_throughput": 0.0},
                {"effective_max_running_requests_per_dp": 48, "last_gen_throughput": 0.0}
            ],
            "kv_events": null, "version": "0.5.23"
        });
        let d = sglang_server_info(&v, "h");
        assert_eq!(d.max_running_requests, Some(48), "the scheduler's per-rank value");
        assert_eq!(d.capacity_blocks, 2048, "32768 tokens in pages of 16");
        assert_eq!(d.facts.block_size, Some(16));
        assert_eq!(d.facts.model.as_deref(), Some("qwen3"));
        assert_eq!(d.facts.bigram, Some(Bigram::Off));
        // The server argument alone is not per rank (divided among attention-DP ranks): unused.
        let arg_only = json!({"page_size": 16, "max_running_requests": 512});
        assert_eq!(sglang_server_info(&arg_only, "h").max_running_requests, None);
        // Older releases without `internal_states`, and zeros, say nothing.
        let zero =
            json!({"page_size": 16, "internal_states": [{"effective_max_running_requests_per_dp": 0}]});
        assert_eq!(sglang_server_info(&zero, "h").max_running_requests, None);
        // A missing page size is an unknown block size, not a block of one token.
        let d = sglang_server_info(&json!({"served_model_name": "m"}), "h");
        assert_eq!((d.facts.block_size, d.capacity_blocks), (None, 0));
        let eagle = json!({"page_size": 16, "speculative_algorithm": "EAGLE3"});
        assert_eq!(sglang_server_info(&eagle, "h").facts.bigram, Some(Bigram::On));
    }

    /// Hand-derived from SGLang 0.5.23's source: `/v1/loads` answers `{"timestamp", "version",
    /// "accelerator", "num_accelerators", "loads": [...]}`
    /// (`python/sglang/srt/entrypoints/v1_loads.py:139-150`), each load a `LoadSnapshot` whose
    /// core keys are every scalar field (`python/sglang/srt/managers/load_snapshot.py:196-215`,
    /// `_CORE_KEYS` at 262), among them `max_total_num_tokens` and `max_running_requests`
    /// (210-211), filled per rank by `load_inquirer.py:241-242`.
    #[test]
    fn sglang_loads_hand_derived() {
        let v = json!({"timestamp": "2026-01-01T00:00:00+00:00", "version": "0.5.23", "accelerator": "H100",
            "num_accelerators": 1, "loads": [
            {"timestamp": 1.0, "dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 5,
             "num_waiting_uncached_tokens": 100, "num_used_tokens": 900, "num_total_tokens": 1000,
             "num_active_tokens": 900, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 65536,
             "max_running_requests": 64, "token_usage": 0.5, "gen_throughput": 10.0,
             "cache_hit_rate": 0.25, "utilization": 0.5,
             "total_prefill_uncached_tokens": 4096, "total_prefill_busy_us": 2048000},
            {"timestamp": 1.0, "dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0,
             "num_waiting_uncached_tokens": 0, "max_total_num_tokens": 65536,
             "max_running_requests": 64, "token_usage": 0.0}]});
        let l = sglang_loads(&v);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].rank, DpRank(0));
        assert_eq!(
            (l[0].load.running, l[0].load.waiting, l[0].load.waiting_prefill_tokens),
            (2, 5, Some(100))
        );
        assert!((l[0].load.kv_usage - 0.5).abs() < 1e-6);
        // The cumulative prefill counters (`LoadSnapshot.total_prefill_uncached_tokens`,
        // `total_prefill_busy_us`): absent on rank 1, as on a release without them.
        let totals = PrefillTotals { uncached_tokens: 4096, busy: std::time::Duration::from_secs_f64(2.048) };
        assert_eq!((l[0].load.prefill_totals, l[1].load.prefill_totals), (Some(totals), None));
        assert_eq!((l[1].max_running_requests, l[1].max_total_num_tokens), (Some(64), Some(65536)));
        assert_eq!(reported_max_running(&l), Some(64));
        // A rank without the fields (an older release) reports no limit; the others still count.
        let v = json!({"loads": [{"dp_rank": 0, "max_running_requests": 0}, {"dp_rank": 1, "max_running_requests": 32}]});
        let l = sglang_loads(&v);
        assert_eq!((l[0].max_running_requests, reported_max_running(&l)), (None, Some(32)));
        assert!(sglang_loads(&json!({"error": "x"})).is_empty());
    }

    /// Hand-derived from vLLM 0.33.0's source: `GET /kv_event_sources`
    /// (`vllm/entrypoints/serve/instrumentator/basic.py:59-63`) answers the engine client's
    /// `dict[int, KVEventsConfig]` (`vllm/v1/engine/core_client.py:929-930`), a `KVEventsConfig`
    /// per DP rank with `enable_kv_cache_events`, `publisher`, `endpoint`, `replay_endpoint`,
    /// `buffer_steps`, `hwm`, `max_queue_size`, `topic` (`vllm/config/kv_events.py:14-47`);
    /// endpoints are reported as configured (`tcp://*:port`).
    #[test]
    fn an_sglang_engine_configured_as_vllm_is_told_apart() {
        let models = |owner: &str| json!({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]});
        assert_eq!(vllm_engine_conflict(&models("vllm")), None);
        assert_eq!(vllm_engine_conflict(&json!({"object": "list", "data": [{"id": "m"}]})), None);
        assert_eq!(vllm_engine_conflict(&json!({"object": "list", "data": []})), None);
        let why = vllm_engine_conflict(&models("sglang")).expect("an SGLang engine");
        assert!(why.contains("an SGLang engine"), "{why}");
    }

    #[test]
    fn vllm_kv_event_sources_hand_derived() {
        let v = json!({
            "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",
                  "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv-events"},
            "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5657", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv-events"},
            "2": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5559",
                  "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}
        });
        let s = vllm_kv_event_sources(&v, "127.0.0.1");
        assert_eq!(s.len(), 2, "the null publisher is not followed");
        assert_eq!(s[0].publish, "tcp://127.0.0.1:5557");
        assert_eq!(s[0].replay.as_deref(), Some("tcp://127.0.0.1:5657"));
        assert_eq!((s[1].rank, s[1].replay.as_deref(), s[1].topic.as_str()), (DpRank(1), None, "kv-events"));
        let m = vllm_metrics("");
        let d = vllm_discovery(&m, Some(&v), Some("m".into()), "127.0.0.1");
        assert_eq!((d.dp_size, d.sources.len(), d.max_running_requests), (2, 2, None));
        // A worker without the route (vLLM < 0.31): no events, one rank.
        let d = vllm_discovery(&m, None, None, "h");
        assert_eq!((d.dp_size, d.sources.len(), d.facts.block_size), (1, 0, None));
    }

    /// Hand-derived from vLLM 0.33.0's source: `vllm:cache_config_info` is a gauge of 1 whose
    /// labels are every `CacheConfig` field as a string (`vllm/config/cache.py:440-443`) plus
    /// `engine` (`vllm/v1/metrics/loggers.py:1114-1136`); the load gauges carry `engine` (the DP
    /// rank) and `model_name`.
    #[test]
    fn vllm_metrics_hand_derived() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"1000\",prefix_caching_hash_algo=\"sha256_cbor\"} 1.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n";
        let m = vllm_metrics(text);
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.hash_algo, Some(HashAlgo::Sha256Cbor));
        assert_eq!(m.num_gpu_blocks, Some(1000));
        assert_eq!((m.loads[0].load.running, m.loads[0].load.waiting), (3, 1));
        assert!((m.loads[0].load.kv_usage - 0.25).abs() < 1e-6);
        assert_eq!(m.loads[1].rank, DpRank(1));
        assert_eq!(reported_max_running(&m.loads), None, "vLLM reports no running-request limit");
        assert_eq!(
            served_models(&json!({"object": "list", "data": [{"id": "m", "object": "model"}]})),
            ["m"]
        );
    }

    /// A worker that names the models it serves must name the configured one; one that names
    /// none is not refused (its profile is unconfirmed instead).
    #[test]
    fn a_worker_must_serve_its_configured_model() {
        let models = json!({"object": "list", "data": [
            {"id": "alias", "object": "model", "parent": null},
            {"id": "m", "object": "model", "parent": null},
            {"id": "sql-lora", "object": "model", "parent": "alias"},
        ]});
        let served = served_models(&models);
        assert_eq!(served, ["alias", "m", "sql-lora"]);
        assert_eq!(model_conflict("m", &served), None);
        assert_eq!(model_conflict("m", &[]), None);
        assert_eq!(
            model_conflict("m", &["zzz".into()]).as_deref(),
            Some("configured with model `m`, but the worker serves `zzz`")
        );
        assert!(served_models(&json!({"data": "nope"})).is_empty());
    }

    #[test]
    fn events_override_builds_one_endpoint_per_rank() {
        let mut d = vllm_discovery(&vllm_metrics(""), None, None, "10.0.0.2");
        let o = EventsOverride {
            publish_port_base: 5557,
            replay_port_base: Some(5657),
            topic: "t".into(),
            dp_size: 2,
        };
        apply_events_override(&mut d, &o, "10.0.0.2");
        assert_eq!(d.dp_size, 2);
        assert_eq!(d.sources[1].publish, "tcp://10.0.0.2:5558");
        assert_eq!(d.sources[1].replay.as_deref(), Some("tcp://10.0.0.2:5658"));
        apply_events_override(&mut d, &EventsOverride { replay_port_base: None, ..o }, "::1");
        assert_eq!(
            (d.sources[0].publish.as_str(), d.sources[0].replay.as_deref()),
            ("tcp://[::1]:5557", None)
        );
    }
}
