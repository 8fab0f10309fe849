//! `cortex-sim`: runs simulated vLLM or SGLang workers in one process, for demos and benchmarks,
//! prints their HTTP addresses and event ports, and serves until interrupted.
//!
//! Key decision: a thin shell over `cortex_sim::SimWorker`; every flag maps onto one field of
//! `cortex_sim::SimConfig`, validated by it, and durations are written with units ("250ms").

#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use cortex_sim::formats::{NoneHashSeed, SglangEncoding, SglangEventFormat, VllmHashAlgo, VllmVersion};
use cortex_sim::{
    EngineConfig, LoraAdapter, ModelSource, Role, SglangOptions, SimConfig, SimModel, SimWorker, VllmOptions,
};

const AFTER_HELP: &str = "\
ROLES
  --workers N starts N ordinary workers. --prefill-workers and --decode-workers start a
  disaggregated cluster instead (or as well):
  * SGLang: send the same body to a prefill and a decode worker concurrently with
    bootstrap_host, bootstrap_port (the prefill worker's printed bootstrap port) and
    bootstrap_room; the prefill leg finishes when the decode leg has taken its KV.
  * vLLM: send the prefill worker kv_transfer_params {\"do_remote_decode\": true} (max_tokens 1),
    then the decode worker the returned kv_transfer_params verbatim; the prefill blocks stay
    leased until the decode leg reads them or --kv-lease runs out.
  A leg whose counterpart never comes fails with HTTP 500 after --bootstrap-timeout.

FAULTS AND GROUND TRUTH (every worker)
  POST /sim/fault with one of:
    {\"fail_next\": {\"status\": 503, \"count\": 2}}     next requests answer 429/500/503/...
    \"stall\" / \"resume\"                              stop / restart every rank's scheduler
    {\"die_mid_stream\": {\"after_tokens\": 3, \"count\": 1}}  cut the connection mid-response
    {\"drop_batches\": {\"rank\": 0, \"count\": 2}}      skip event batches (a sequence gap)
    {\"restart_publisher\": {\"rank\": 0}}              seq back to 0, no AllBlocksCleared
    {\"replay\": {\"rank\": 0, \"enabled\": false}}      ignore replay requests
    \"flush_cache\"                                   AllBlocksCleared (refused while busy)
    {\"health\": {\"healthy\": false}}                  /health answers 503
  GET /sim/state: every rank's cached blocks (hashes, parents, tokens), subscription state,
  last sequence number, queue lengths and virtual time, and the W3C traceparent headers the
  API requests carried (the last 1024).

EXAMPLE
  cortex-sim --engine vllm --workers 4 --dp-size 2 --speed 1";

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EngineArg {
    Vllm,
    Sglang,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatArg {
    Default,
    Dynamo,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EncodingArg {
    /// Tagged maps (SGLang ≥ 0.5.20).
    Maps,
    /// Positional arrays (SGLang 0.5.19).
    Arrays,
}

/// Simulated vLLM / SGLang workers speaking the engines' real HTTP and ZeroMQ protocols.
#[derive(Debug, Parser)]
#[command(name = "cortex-sim", version, after_long_help = AFTER_HELP, after_help = "See --help for roles, faults and ground truth.")]
struct Args {
    /// The engine to simulate.
    #[arg(long, value_enum, default_value = "vllm")]
    engine: EngineArg,
    /// Ordinary (non-disaggregated) workers [default: 1 without PD workers, else 0].
    #[arg(long)]
    workers: Option<u16>,
    /// PD prefill workers (each binds a bootstrap / side-channel listener).
    #[arg(long, default_value_t = 0)]
    prefill_workers: u16,
    /// PD decode workers.
    #[arg(long, default_value_t = 0)]
    decode_workers: u16,
    /// Data-parallel ranks per worker; rank r publishes on the worker's event base + r.
    #[arg(long, default_value_t = 1)]
    dp_size: u16,
    /// Address every listener binds.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port of the first worker (worker i binds port + i); 0 picks free ports.
    #[arg(long, default_value_t = 0)]
    http_port: u16,
    /// Event PUB port of the first worker's rank 0; each worker takes dp-size PUB ports followed by
    /// dp-size replay ports. Omitted: a free contiguous range per worker.
    #[arg(long)]
    event_port_base: Option<u16>,
    /// Event topic (frame 0 of every message).
    #[arg(long, default_value = "")]
    topic: String,
    /// Do not bind replay ROUTERs.
    #[arg(long)]
    no_replay: bool,
    /// Replay ring size in batches.
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// Tokens per KV block (vLLM block_size, SGLang page_size).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV capacity per rank in blocks (vLLM num_gpu_blocks, null block included).
    #[arg(long, default_value_t = 4096)]
    capacity_blocks: usize,
    /// Served model name.
    #[arg(long, default_value = "Qwen/Qwen3-0.6B")]
    model: String,
    /// Directory with tokenizer.json and tokenizer_config.json (default: the repository's Qwen3).
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// A chat template file replacing the model's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// A LoRA adapter, NAME=ID:PATH (repeatable).
    #[arg(long = "lora", value_parser = parse_lora)]
    loras: Vec<LoraAdapter>,
    /// vLLM release whose wire format is simulated (maps ≥ 0.24, arrays before; replay topic
    /// frame ≥ 0.26; /kv_event_sources ≥ 0.31).
    #[arg(long, default_value = "0.33.0", value_parser = parse_version)]
    vllm_version: VllmVersion,
    /// vLLM: VLLM_SERVER_DEV_MODE=1, which serves the development routes (`/reset_prefix_cache`).
    #[arg(long)]
    vllm_dev_mode: bool,
    /// vLLM --prefix-caching-hash-algo: sha256, sha256_cbor, xxhash, xxhash_cbor.
    #[arg(long, default_value = "sha256", value_parser = parse_algo)]
    hash_algo: VllmHashAlgo,
    /// vLLM: PYTHONHASHSEED (NONE_HASH seed); default: vLLM ≥ 0.29's "vllm-none-hash".
    #[arg(long)]
    python_hash_seed: Option<String>,
    /// vLLM: publish block hashes as 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    #[arg(long)]
    bytes_block_hashes: bool,
    /// SGLang kv_events format.
    #[arg(long, value_enum, default_value = "default")]
    sglang_format: FormatArg,
    /// SGLang event encoding.
    #[arg(long, value_enum, default_value = "maps")]
    sglang_encoding: EncodingArg,
    /// SGLang: EAGLE speculative decoding (bigram pages).
    #[arg(long)]
    eagle: bool,
    /// SGLang: decode workers keep a radix cache (and publish events).
    #[arg(long)]
    decode_radix_cache: bool,
    /// Wall-clock seconds per simulated second (0 = as fast as possible).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Fixed cost of a prefill step.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    prefill_overhead: Duration,
    /// Cost per uncached prompt token.
    #[arg(long, default_value = "100us", value_parser = parse_duration)]
    prefill_per_token: Duration,
    /// Decode step cost with one running request.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    itl: Duration,
    /// Extra decode step cost per additional running request.
    #[arg(long, default_value = "500us", value_parser = parse_duration)]
    itl_per_running: Duration,
    /// PD decode side: KV transfer cost per token.
    #[arg(long, default_value = "5us", value_parser = parse_duration)]
    kv_transfer_per_token: Duration,
    /// Maximum running requests per rank.
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 8192)]
    max_batched_tokens: usize,
    /// Context length.
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// max_tokens when a request does not say.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: usize,
    /// Bootstrap (SGLang) / side-channel (vLLM) port of the first prefill worker (+ i); 0 = free.
    #[arg(long, default_value_t = 0)]
    bootstrap_port: u16,
    /// How long a PD leg waits for its counterpart.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    bootstrap_timeout: Duration,
    /// How long a vLLM prefill worker keeps a finished request's blocks for the decode side.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    kv_lease: Duration,
    /// The engine's API key: requests without `Authorization: Bearer <KEY>` get 401 where the
    /// engine guards them (SGLang: all but /health* and /metrics*; vLLM: /v1/*).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Print one JSON object per worker instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split =
        s.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or("a unit is required (ns, us, ms, s, m)")?;
    let (num, unit) = s.split_at(split);
    let v: f64 = num.parse().map_err(|_| format!("`{num}` is not a number"))?;
    let secs = match unit {
        "ns" => v / 1e9,
        "us" | "µs" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        _ => return Err(format!("unknown unit `{unit}` (ns, us, ms, s, m)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

fn parse_version(s: &str) -> Result<VllmVersion, String> {
    let parts: Vec<u16> =
        s.split('.').map(str::parse).collect::<Result<_, _>>().map_err(|_| format!("bad version `{s}`"))?;
    match parts[..] {
        [a, b, c] => Ok(VllmVersion::new(a, b, c)),
        [a, b] => Ok(VllmVersion::new(a, b, 0)),
        _ => Err(format!("bad version `{s}` (expected 0.33.0)")),
    }
}

fn parse_algo(s: &str) -> Result<VllmHashAlgo, String> {
    VllmHashAlgo::parse(s).ok_or_else(|| format!("unknown hash algorithm `{s}`"))
}

fn parse_lora(s: &str) -> Result<LoraAdapter, String> {
    let (name, rest) = s.split_once('=').ok_or("expected NAME=ID:PATH")?;
    let (id, path) = rest.split_once(':').ok_or("expected NAME=ID:PATH")?;
    let id: i64 = id.parse().map_err(|_| format!("`{id}` is not an integer id"))?;
    Ok(LoraAdapter::new(name, id, path))
}

fn base_config(a: &Args) -> Result<SimConfig> {
    let engine = match a.engine {
        EngineArg::Vllm => EngineConfig::Vllm(VllmOptions {
            version: a.vllm_version,
            hash_algo: a.hash_algo,
            none_hash_seed: a
                .python_hash_seed
                .clone()
                .map_or(NoneHashSeed::Default, NoneHashSeed::PythonHashSeed),
            int_block_hashes: !a.bytes_block_hashes,
            dev_mode: a.vllm_dev_mode,
        }),
        EngineArg::Sglang => EngineConfig::Sglang(SglangOptions {
            encoding: match a.sglang_encoding {
                EncodingArg::Maps => SglangEncoding::Maps,
                EncodingArg::Arrays => SglangEncoding::Arrays,
            },
            format: match a.sglang_format {
                FormatArg::Default => SglangEventFormat::Default,
                FormatArg::Dynamo => SglangEventFormat::Dynamo,
            },
            bigram: a.eagle,
            decode_radix_cache: a.decode_radix_cache,
        }),
    };
    let mut cfg = SimConfig::new(engine);
    cfg.dp_size = a.dp_size;
    cfg.block_size = a.block_size;
    cfg.capacity_blocks = a.capacity_blocks;
    cfg.model_name.clone_from(&a.model);
    // Load the model once; every worker shares it.
    let model: Arc<SimModel> =
        match &a.tokenizer_dir {
            Some(d) => SimModel::load_dir(d)
                .with_context(|| format!("loading the model files in {}", d.display()))?,
            None => SimModel::qwen3()
                .context("loading the repository's Qwen3 tokenizer (pass --tokenizer-dir)")?,
        };
    cfg.model = ModelSource::Loaded(model);
    if let Some(t) = &a.chat_template {
        cfg.chat_template =
            Some(std::fs::read_to_string(t).with_context(|| format!("reading {}", t.display()))?);
    }
    cfg.loras.clone_from(&a.loras);
    cfg.timing.speed = a.speed;
    cfg.timing.prefill_overhead = a.prefill_overhead;
    cfg.timing.prefill_per_token = a.prefill_per_token;
    cfg.timing.itl_base = a.itl;
    cfg.timing.itl_per_running = a.itl_per_running;
    cfg.timing.kv_transfer_per_token = a.kv_transfer_per_token;
    cfg.max_running = a.max_running;
    cfg.max_batched_tokens = a.max_batched_tokens;
    cfg.max_model_len = a.max_model_len;
    cfg.default_max_tokens = a.default_max_tokens;
    cfg.events.topic.clone_from(&a.topic);
    cfg.events.replay = !a.no_replay;
    cfg.events.buffer_steps = a.buffer_steps;
    cfg.host = a.host;
    cfg.pd.bootstrap_timeout = a.bootstrap_timeout;
    cfg.pd.kv_lease = a.kv_lease;
    cfg.api_key.clone_from(&a.api_key);
    cfg.validate().context("invalid configuration")?;
    Ok(cfg)
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Unified => "unified",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

#[allow(clippy::print_stdout, reason = "printing the workers' addresses is this binary's output")]
fn report(i: usize, w: &SimWorker, json: bool) {
    let role = role_name(w.config().role);
    let eps = w.event_endpoints();
    if json {
        let ranks: Vec<serde_json::Value> = eps
            .iter()
            .map(|e| {
                serde_json::json!({
                    "rank": e.rank,
                    "publish": format!("tcp://{}", e.publish),
                    "replay": e.replay.map(|a| format!("tcp://{a}")),
                })
            })
            .collect();
        let line = serde_json::json!({
            "worker": i, "role": role, "engine": w.config().engine.name(), "http": w.base_url(),
            "bootstrap": w.bootstrap_addr().map(|a| a.to_string()), "ranks": ranks,
        });
        println!("{line}");
        return;
    }
    let boot = w.bootstrap_addr().map(|a| format!("  bootstrap={a}")).unwrap_or_default();
    println!("worker {i}  role={role}  http={}{boot}", w.base_url());
    for e in eps {
        let replay = e.replay.map(|a| format!("  replay=tcp://{a}")).unwrap_or_default();
        println!("  rank {}  pub=tcp://{}{replay}", e.rank, e.publish);
    }
}

#[allow(clippy::print_stdout, reason = "the start-up banner is this binary's output")]
fn main() -> Result<()> {
    let args = Args::parse();
    let unified = args.workers.unwrap_or(if args.prefill_workers + args.decode_workers == 0 { 1 } else { 0 });
    let total = usize::from(unified) + usize::from(args.prefill_workers) + usize::from(args.decode_workers);
    if total == 0 {
        bail!("no workers: pass --workers, --prefill-workers or --decode-workers");
    }
    // Signal handlers go in before anything is printed, so a supervisor that signals as soon as
    // it reads the addresses is heard.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("runtime")?;
    let (mut int, mut term) = {
        let _guard = rt.enter();
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::interrupt()).context("SIGINT")?,
            signal(SignalKind::terminate()).context("SIGTERM")?,
        )
    };
    let base = base_config(&args)?;
    let roles = std::iter::repeat_n(Role::Unified, usize::from(unified))
        .chain(std::iter::repeat_n(Role::Prefill, usize::from(args.prefill_workers)))
        .chain(std::iter::repeat_n(Role::Decode, usize::from(args.decode_workers)));
    let ports_per_worker = usize::from(args.dp_size) * if args.no_replay { 1 } else { 2 };
    let mut workers = Vec::with_capacity(total);
    let mut prefill_index: u16 = 0;
    for (i, role) in roles.enumerate() {
        let mut cfg = base.clone();
        cfg.role = role;
        let offset = |base: u16, step: usize| -> Result<u16> {
            u16::try_from(usize::from(base) + i * step).context("port out of range")
        };
        if args.http_port != 0 {
            cfg.http_port = offset(args.http_port, 1)?;
        }
        if let Some(b) = args.event_port_base {
            cfg.events.port_base = Some(offset(b, ports_per_worker)?);
        }
        if role == Role::Prefill && args.bootstrap_port != 0 {
            cfg.pd.port = args.bootstrap_port.checked_add(prefill_index).context("port out of range")?;
            prefill_index += 1;
        }
        let w = SimWorker::start(cfg).with_context(|| format!("starting worker {i}"))?;
        report(i, &w, args.json);
        workers.push(w);
    }
    if !args.json {
        println!("serving {total} {} worker(s); Ctrl-C to stop", base.engine.name());
    }
    rt.block_on(async {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    });
    for w in workers {
        w.shutdown();
    }
    Ok(())
}
