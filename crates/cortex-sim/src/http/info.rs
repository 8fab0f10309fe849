//! The engines' discovery and load routes: `/v1/models`, vLLM's `/kv_event_sources`,
//! `/tokenize`, `/detokenize`, SGLang's `/server_info` (with the real `kv_events` descriptor),
//! `/model_info`, `/v1/loads`, and `/metrics` for both.
//!
//! Key decision: shapes follow the engines' own (golden `server_info_kv_events.json`, vLLM's
//! `/kv_event_sources` with already-offset endpoints); endpoints are reported with a wildcard host
//! (`tcp://*:port`), exactly as a worker configured with `tcp://*:port` reports them, so a gateway
//! must substitute the worker's host, as it must in production.

use http::{Request, StatusCode, Uri};
use hyper::body::Incoming;
use serde_json::{Map, Value, json};

use super::{Resp, full, json_resp, read_json};
use crate::config::EngineConfig;
use crate::engine::{RankLoad, TTFT_BUCKETS};
use crate::worker::Shared;

pub(super) fn engine_version(shared: &Shared) -> String {
    match &shared.cfg.engine {
        EngineConfig::Vllm(o) => o.version.to_string(),
        EngineConfig::Sglang(o) => match o.encoding {
            cortex_events_sglang::Encoding::Maps => "0.5.23".to_owned(),
            cortex_events_sglang::Encoding::Arrays => "0.5.19".to_owned(),
        },
    }
}

pub(super) fn has_kv_event_sources(shared: &Shared) -> bool {
    matches!(&shared.cfg.engine, EngineConfig::Vllm(o) if o.version >= cortex_events_vllm::Version::new(0, 31, 0))
}

pub(super) fn models(shared: &Shared) -> Resp {
    let owner = shared.cfg.engine.name();
    let mut data = vec![json!({
        "id": shared.cfg.model_name, "object": "model", "created": shared.created, "owned_by": owner,
        "root": shared.cfg.model_name, "parent": null, "max_model_len": shared.cfg.max_model_len,
    })];
    for l in &shared.cfg.loras {
        data.push(json!({
            "id": l.name, "object": "model", "created": shared.created, "owned_by": owner,
            "root": l.path, "parent": shared.cfg.model_name, "max_model_len": shared.cfg.max_model_len,
        }));
    }
    json_resp(StatusCode::OK, &json!({"object": "list", "data": data}))
}

pub(super) fn kv_event_sources(shared: &Shared) -> Resp {
    let mut out = Map::new();
    if let Some(p) = &shared.publisher {
        for e in p.endpoints() {
            out.insert(
                e.rank.to_string(),
                json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": format!("tcp://*:{}", e.publish.port()),
                    "replay_endpoint": e.replay.map(|a| format!("tcp://*:{}", a.port())),
                    "buffer_steps": shared.cfg.events.buffer_steps,
                    "hwm": shared.cfg.events.hwm,
                    "max_queue_size": 100_000,
                    "topic": shared.cfg.events.topic,
                }),
            );
        }
    }
    json_resp(StatusCode::OK, &Value::Object(out))
}

fn kv_events_descriptor(shared: &Shared) -> Value {
    let Some(p) = &shared.publisher else { return Value::Null };
    let Some(first) = p.endpoints().first() else { return Value::Null };
    let mut m = Map::new();
    m.insert("publisher".to_owned(), json!("zmq"));
    m.insert("endpoint_host".to_owned(), json!("*"));
    m.insert("endpoint_port_base".to_owned(), json!(first.publish.port()));
    m.insert("topic".to_owned(), json!(shared.cfg.events.topic));
    m.insert("block_size".to_owned(), json!(shared.cfg.block_size));
    m.insert("dp_size".to_owned(), json!(shared.cfg.dp_size));
    if let Some(r) = first.replay {
        m.insert("replay_endpoint_port_base".to_owned(), json!(r.port()));
    }
    Value::Object(m)
}

pub(super) fn server_info(shared: &Shared) -> Resp {
    let cfg = &shared.cfg;
    let spec = match &cfg.engine {
        EngineConfig::Sglang(o) if o.bigram => json!("EAGLE"),
        _ => Value::Null,
    };
    let decode_radix_cache = matches!(&cfg.engine, EngineConfig::Sglang(o) if o.decode_radix_cache);
    let internal: Vec<Value> = shared
        .ranks
        .iter()
        .map(|r| {
            let l = r.load();
            json!({"dp_rank": r.params.rank, "last_gen_throughput": 0.0, "num_running_reqs": l.running, "num_waiting_reqs": l.waiting})
        })
        .collect();
    let body = json!({
        "model_path": cfg.model_name,
        "tokenizer_path": shared.model.dir().map(|d| d.display().to_string()),
        "served_model_name": cfg.model_name,
        "page_size": cfg.block_size,
        "dp_size": cfg.dp_size,
        "dcp_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "enable_dp_attention": false,
        "speculative_algorithm": spec,
        "disaggregation_mode": cfg.role.sglang_mode(),
        "disaggregation_bootstrap_port": shared.pd_addr.map(|a| a.port()),
        "disaggregation_decode_enable_radix_cache": decode_radix_cache,
        "max_total_num_tokens": cfg.capacity_blocks * cfg.block_size,
        "max_running_requests": cfg.max_running,
        "chunked_prefill_size": cfg.max_batched_tokens,
        "context_length": cfg.max_model_len,
        "load_balance_method": "round_robin",
        "kv_events": kv_events_descriptor(shared),
        "internal_states": internal,
        "version": engine_version(shared),
    });
    json_resp(StatusCode::OK, &body)
}

pub(super) fn model_info(shared: &Shared) -> Resp {
    json_resp(
        StatusCode::OK,
        &json!({
            "model_path": shared.cfg.model_name,
            "tokenizer_path": shared.model.dir().map(|d| d.display().to_string()),
            "is_generation": true,
            "preferred_sampling_params": null,
            "weight_version": "default",
            "has_image_understanding": false,
            "has_audio_understanding": false,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
        }),
    )
}

pub(super) fn loads(shared: &Shared, uri: &Uri) -> Resp {
    let only: Option<u16> =
        uri.query().and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("dp_rank=")?.parse().ok()));
    let page = shared.cfg.block_size;
    let loads: Vec<Value> = shared
        .ranks
        .iter()
        .filter(|r| only.is_none_or(|o| o == r.params.rank))
        .map(|r| {
            let l = r.load();
            let used_tokens = l.used_blocks.saturating_sub(l.evictable_blocks) * page;
            let total = l.capacity_blocks * page;
            let hit_rate = if l.stats.prefix_queries == 0 {
                0.0
            } else {
                l.stats.prefix_hits as f64 / l.stats.prefix_queries as f64
            };
            json!({
                "dp_rank": r.params.rank,
                "timestamp": l.now.as_secs_f64(),
                "num_running_reqs": l.running,
                "num_waiting_reqs": l.waiting,
                "num_waiting_uncached_tokens": l.waiting_uncached_tokens,
                "num_used_tokens": used_tokens,
                "num_total_tokens": l.used_blocks * page,
                "num_active_tokens": used_tokens,
                "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": total,
                "max_running_requests": shared.cfg.max_running,
                "token_usage": l.kv_usage,
                "gen_throughput": 0.0,
                "cache_hit_rate": hit_rate,
                "utilization": l.kv_usage,
                // What the rank prefilled, and for how long on the wall clock a real engine's
                // counters see (virtual time runs 1/speed times faster than the wall clock).
                "total_prefill_uncached_tokens": l.stats.computed_prompt_tokens,
                "total_prefill_busy_us": (l.stats.prefill_busy.as_secs_f64() * shared.cfg.timing.speed * 1e6) as u64,
                "decode_moments": null,
            })
        })
        .collect();
    json_resp(
        StatusCode::OK,
        &json!({
            "timestamp": shared.created,
            "version": engine_version(shared),
            "accelerator": "sim",
            "num_accelerators": shared.cfg.dp_size,
            "loads": loads,
        }),
    )
}

pub(super) async fn tokenize(shared: &Shared, req: Request<Incoming>) -> Resp {
    let (_, body) = match read_json(req).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let tokens = if body.get("messages").is_some() {
        shared.model.encode_chat(&body)
    } else {
        let add = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
        let prompt = body.get("prompt").and_then(Value::as_str).unwrap_or_default();
        shared.model.encode(prompt, add)
    };
    match tokens {
        Ok(t) => json_resp(
            StatusCode::OK,
            &json!({"count": t.len(), "max_model_len": shared.cfg.max_model_len, "tokens": t, "token_strs": null}),
        ),
        Err(e) => json_resp(
            StatusCode::BAD_REQUEST,
            &json!({"error": {"message": e.to_string(), "type": "BadRequestError", "param": null, "code": 400}}),
        ),
    }
}

pub(super) async fn detokenize(shared: &Shared, req: Request<Incoming>) -> Resp {
    let (_, body) = match read_json(req).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let ids: Vec<u32> = body
        .get("tokens")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect())
        .unwrap_or_default();
    json_resp(StatusCode::OK, &json!({"prompt": shared.model.decode(&ids)}))
}

/// A gauge family: name, help, value from a rank's load and the page size.
type Gauge = (&'static str, &'static str, fn(&RankLoad, f64) -> f64);
/// A counter family: name, help, value from a rank's load.
type Counter = (&'static str, &'static str, fn(&RankLoad) -> f64);

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

struct Prom {
    out: String,
}

impl Prom {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        self.out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    }

    fn sample(&mut self, name: &str, labels: &str, v: f64) {
        self.out.push_str(&format!("{name}{{{labels}}} {v:?}\n"));
    }
}

pub(super) fn metrics(shared: &Shared) -> Resp {
    let mut p = Prom { out: String::new() };
    let model = esc(&shared.cfg.model_name);
    let loads: Vec<_> = shared.ranks.iter().map(|r| (r.params.rank, r.load())).collect();
    match &shared.cfg.engine {
        EngineConfig::Vllm(o) => {
            let labels = |r: u16| format!("engine=\"{r}\",model_name=\"{model}\"");
            p.family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.");
            for (r, l) in &loads {
                p.sample("vllm:num_requests_running", &labels(*r), l.running as f64);
            }
            p.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
            for (r, l) in &loads {
                p.sample("vllm:num_requests_waiting", &labels(*r), l.waiting as f64);
            }
            p.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
            for (r, l) in &loads {
                p.sample("vllm:kv_cache_usage_perc", &labels(*r), l.kv_usage);
            }
            p.family(
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
            );
            for (r, l) in &loads {
                p.sample("vllm:prefix_cache_queries_total", &labels(*r), l.stats.prefix_queries as f64);
            }
            p.family(
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
            );
            for (r, l) in &loads {
                p.sample("vllm:prefix_cache_hits_total", &labels(*r), l.stats.prefix_hits as f64);
            }
            p.family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
            for (r, l) in &loads {
                p.sample("vllm:prompt_tokens_total", &labels(*r), l.stats.prompt_tokens as f64);
            }
            p.family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
            for (r, l) in &loads {
                p.sample("vllm:generation_tokens_total", &labels(*r), l.stats.generation_tokens as f64);
            }
            p.family(
                "vllm:num_preemptions_total",
                "counter",
                "Cumulative number of preemption from the engine.",
            );
            for (r, l) in &loads {
                p.sample("vllm:num_preemptions_total", &labels(*r), l.stats.preemptions as f64);
            }
            histogram(
                &mut p,
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &loads,
                &labels,
            );
            p.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
            for (r, _) in &loads {
                let l = format!(
                    "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"{r}\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"",
                    shared.cfg.block_size,
                    shared.cfg.capacity_blocks,
                    o.hash_algo.as_str()
                );
                p.sample("vllm:cache_config_info", &l, 1.0);
            }
        }
        EngineConfig::Sglang(_) => {
            let labels = |r: u16| {
                format!(
                    "dp_rank=\"{r}\",engine_type=\"unified\",model_name=\"{model}\",pp_rank=\"0\",tp_rank=\"0\""
                )
            };
            let page = shared.cfg.block_size as f64;
            let gauges: [Gauge; 9] = [
                ("sglang:num_running_reqs", "The number of running requests.", |l, _| l.running as f64),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", |l, _| {
                    l.waiting as f64
                }),
                ("sglang:num_used_tokens", "The number of used tokens.", |l, pg| {
                    l.used_blocks.saturating_sub(l.evictable_blocks) as f64 * pg
                }),
                ("sglang:token_usage", "The token usage.", |l, _| l.kv_usage),
                ("sglang:utilization", "The utilization.", |l, _| l.kv_usage),
                (
                    "sglang:max_total_num_tokens",
                    "Maximum total number of tokens in the KV cache pool.",
                    |l, pg| l.capacity_blocks as f64 * pg,
                ),
                ("sglang:kv_evictable_tokens", "Evictable tokens in the KV cache.", |l, pg| {
                    l.evictable_blocks as f64 * pg
                }),
                ("sglang:gen_throughput", "The generation throughput (token/s).", |_, _| 0.0),
                ("sglang:cache_hit_rate", "The prefix cache hit rate.", |l, _| {
                    if l.stats.prefix_queries == 0 {
                        0.0
                    } else {
                        l.stats.prefix_hits as f64 / l.stats.prefix_queries as f64
                    }
                }),
            ];
            for (name, help, f) in gauges {
                p.family(name, "gauge", help);
                for (r, l) in &loads {
                    p.sample(name, &labels(*r), f(l, page));
                }
            }
            let counters: [Counter; 4] = [
                ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", |l| {
                    l.stats.prompt_tokens as f64
                }),
                ("sglang:generation_tokens_total", "Number of generation tokens processed.", |l| {
                    l.stats.generation_tokens as f64
                }),
                ("sglang:cached_tokens_total", "Number of cached prompt tokens.", |l| {
                    l.stats.prefix_hits as f64
                }),
                ("sglang:num_requests_total", "Number of requests processed.", |l| l.stats.finished as f64),
            ];
            for (name, help, f) in counters {
                p.family(name, "counter", help);
                for (r, l) in &loads {
                    p.sample(name, &labels(*r), f(l));
                }
            }
            histogram(
                &mut p,
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &loads,
                &labels,
            );
        }
    }
    full(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", p.out)
}

fn histogram(
    p: &mut Prom,
    name: &str,
    help: &str,
    loads: &[(u16, RankLoad)],
    labels: &dyn Fn(u16) -> String,
) {
    p.family(name, "histogram", help);
    for (r, l) in loads {
        let base = labels(*r);
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            p.sample(
                &format!("{name}_bucket"),
                &format!("{base},le=\"{b:?}\""),
                l.stats.ttft_buckets[i] as f64,
            );
        }
        p.sample(&format!("{name}_bucket"), &format!("{base},le=\"+Inf\""), l.stats.ttft_count as f64);
        p.sample(&format!("{name}_count"), &base, l.stats.ttft_count as f64);
        p.sample(&format!("{name}_sum"), &base, l.stats.ttft_sum);
    }
}
