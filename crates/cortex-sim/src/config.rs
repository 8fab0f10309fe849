//! What a simulated worker is: engine and version, role, DP size, cache geometry, model files,
//! timing, event publishing and PD options. Plain typed values; the binary's flags convert into
//! them.
//!
//! Key decision: one [`SimConfig`] describes one worker (one engine server with `dp_size` ranks);
//! everything defaults to what the engines default to where that is meaningful (block size 16,
//! empty topic, replay ring of 10 000 batches, vLLM 0.33 / SGLang 0.5.23 wire formats) and to
//! what tests want where it is not (speed 0, loopback, ephemeral ports).

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cortex_hash::sglang::EventFormat;
use cortex_hash::vllm::{HashAlgo, NoneHashSeed};

use crate::SimError;
use crate::model::SimModel;

/// The engine a worker simulates, with its version-dependent options.
#[derive(Clone, Debug)]
pub enum EngineConfig {
    /// vLLM (v1 engine).
    Vllm(VllmOptions),
    /// SGLang.
    Sglang(SglangOptions),
}

impl EngineConfig {
    /// vLLM 0.33 with the default hash (`sha256`, deterministic `NONE_HASH`).
    #[must_use]
    pub fn vllm() -> Self {
        EngineConfig::Vllm(VllmOptions::default())
    }

    /// SGLang 0.5.23 with the `default` event format.
    #[must_use]
    pub fn sglang() -> Self {
        EngineConfig::Sglang(SglangOptions::default())
    }

    /// `"vllm"` or `"sglang"`.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        match self {
            EngineConfig::Vllm(_) => "vllm",
            EngineConfig::Sglang(_) => "sglang",
        }
    }
}

/// vLLM-specific options.
#[derive(Clone, Debug)]
pub struct VllmOptions {
    /// The release whose event format (and `/kv_event_sources`, replay framing, hash extra-key
    /// form) is simulated.
    pub version: cortex_events_vllm::Version,
    /// `--prefix-caching-hash-algo`.
    pub hash_algo: HashAlgo,
    /// Where `NONE_HASH` comes from (`PYTHONHASHSEED` or the ≥ 0.29 default).
    pub none_hash_seed: NoneHashSeed,
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (default on): hashes as u64, else the digest bytes.
    pub int_block_hashes: bool,
    /// `VLLM_SERVER_DEV_MODE=1`: the development routes, `/reset_prefix_cache` among them, are
    /// served (vLLM serves them only in that mode; default off, as vLLM).
    pub dev_mode: bool,
}

impl Default for VllmOptions {
    fn default() -> Self {
        VllmOptions {
            version: cortex_events_vllm::Version::LATEST,
            hash_algo: HashAlgo::Sha256,
            none_hash_seed: NoneHashSeed::Default,
            int_block_hashes: true,
            dev_mode: false,
        }
    }
}

/// SGLang-specific options.
#[derive(Clone, Debug)]
pub struct SglangOptions {
    /// Event encoding: tagged maps (≥ 0.5.20, reported as 0.5.23) or positional arrays (0.5.19).
    pub encoding: cortex_events_sglang::Encoding,
    /// `kv_events_config.format`: `default` or `dynamo` hash namespacing.
    pub format: EventFormat,
    /// EAGLE-style speculative decoding: the radix tree holds bigram pages and events carry
    /// `[[a,b],[b,c],…]` token pairs; `/server_info.speculative_algorithm` says `"EAGLE"`.
    pub bigram: bool,
    /// `--disaggregation-decode-enable-radix-cache`: off by default, so a decode worker has no
    /// prefix cache and publishes no block events.
    pub decode_radix_cache: bool,
}

impl Default for SglangOptions {
    fn default() -> Self {
        SglangOptions {
            encoding: cortex_events_sglang::Encoding::Maps,
            format: EventFormat::Default,
            bigram: false,
            decode_radix_cache: false,
        }
    }
}

/// Prefill/decode disaggregation role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// An ordinary worker (no disaggregation).
    Unified,
    /// A prefill worker: SGLang `--disaggregation-mode prefill` (binds the bootstrap listener);
    /// vLLM with a KV connector serving `do_remote_decode` requests (binds the side channel).
    Prefill,
    /// A decode worker: SGLang `--disaggregation-mode decode`; vLLM serving `do_remote_prefill`.
    Decode,
}

impl Role {
    /// SGLang's spelling of `disaggregation_mode`.
    #[must_use]
    pub const fn sglang_mode(self) -> &'static str {
        match self {
            Role::Unified => "null",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Virtual-time latency model. A step costs `prefill_overhead + prefill_per_token × prefill
/// tokens` if it prefills anything, plus `itl_base + itl_per_running × (running − 1)` if it
/// decodes; a request's TTFT is its queue wait plus the steps until its first token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Wall-clock seconds slept per simulated second: 0 runs as fast as possible (tests), 1 runs
    /// in real time.
    pub speed: f64,
    /// Fixed cost of a step that prefills.
    pub prefill_overhead: Duration,
    /// Cost per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Decode step cost with one running request.
    pub itl_base: Duration,
    /// Extra decode step cost per additional running request.
    pub itl_per_running: Duration,
    /// KV transfer cost per token on a PD decode worker.
    pub kv_transfer_per_token: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            speed: 0.0,
            prefill_overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(100),
            itl_base: Duration::from_millis(10),
            itl_per_running: Duration::from_micros(500),
            kv_transfer_per_token: Duration::from_micros(5),
        }
    }
}

/// Event publishing (ZeroMQ) options.
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// Publish KV events at all.
    pub enabled: bool,
    /// Frame 0 of every message (`""` by default).
    pub topic: String,
    /// Bind a replay ROUTER per rank.
    pub replay: bool,
    /// Replay ring size, in batches (`buffer_steps`, 10 000).
    pub buffer_steps: usize,
    /// PUB port of rank 0 (rank `r` binds `base + r`); `None` picks a free contiguous range.
    pub port_base: Option<u16>,
    /// ROUTER port of rank 0; `None` places it right after the PUB range (`base + dp_size`).
    pub replay_port_base: Option<u16>,
    /// PUB send high-water mark (100 000).
    pub hwm: i32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            enabled: true,
            topic: String::new(),
            replay: true,
            buffer_steps: 10_000,
            port_base: None,
            replay_port_base: None,
            hwm: 100_000,
        }
    }
}

/// PD rendezvous options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdOptions {
    /// Port of the prefill side's rendezvous listener (SGLang's bootstrap port, vLLM's NIXL side
    /// channel); 0 binds an ephemeral port.
    pub port: u16,
    /// How long a leg waits for its counterpart (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s
    /// in SGLang) before failing.
    pub bootstrap_timeout: Duration,
    /// How long a vLLM prefill worker keeps a finished request's blocks for the decode side
    /// (`kv_lease_duration`, 30 s).
    pub kv_lease: Duration,
}

impl Default for PdOptions {
    fn default() -> Self {
        PdOptions { port: 0, bootstrap_timeout: Duration::from_secs(300), kv_lease: Duration::from_secs(30) }
    }
}

/// A LoRA adapter the worker serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraAdapter {
    /// The adapter name (the `model` a client asks for; SGLang's `lora_path`).
    pub name: String,
    /// vLLM's `lora_int_id` (published as `lora_id`).
    pub id: i64,
    /// The adapter path (vLLM ≥ 0.31 hashes it; `/v1/models` reports it as `root`).
    pub path: String,
    /// SGLang's 32-hex adapter id (`uuid4().hex`), the end of the request's `extra_key`.
    pub sglang_id: String,
    /// SGLang: registered in the scheduler's `KvEventLoraNames`, so its name is published and
    /// (in the `default` format) its hashes are namespaced.
    pub registered: bool,
}

impl LoraAdapter {
    /// An adapter with a deterministic SGLang id derived from its name, registered.
    #[must_use]
    pub fn new(name: &str, id: i64, path: &str) -> Self {
        let d = cortex_hash::profile::FileDigest::of(name.as_bytes());
        let sglang_id: String = d.as_bytes()[..16].iter().map(|b| format!("{b:02x}")).collect();
        LoraAdapter { name: name.to_owned(), id, path: path.to_owned(), sglang_id, registered: true }
    }
}

/// Where the tokenizer and chat template come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// The repository's Qwen3 files (`golden/models/qwen3/`), loaded once per process.
    Qwen3,
    /// A directory holding `tokenizer.json` and `tokenizer_config.json`, loaded once per process.
    Dir(PathBuf),
    /// Already loaded (share one model across workers explicitly).
    Loaded(Arc<SimModel>),
}

/// One simulated worker.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Engine and version.
    pub engine: EngineConfig,
    /// PD role.
    pub role: Role,
    /// Data-parallel ranks; each has its own cache, scheduler and event stream.
    pub dp_size: u16,
    /// Tokens per KV block (vLLM `block_size`, SGLang `page_size`).
    pub block_size: usize,
    /// KV capacity per rank in blocks: vLLM's `num_gpu_blocks` (one of which is the null block,
    /// as in vLLM), SGLang's `max_total_num_tokens / page_size`.
    pub capacity_blocks: usize,
    /// The served model name (`/v1/models`, metrics labels).
    pub model_name: String,
    /// Tokenizer and chat template.
    pub model: ModelSource,
    /// A chat template overriding the model's (to simulate a worker whose template differs from
    /// the gateway's).
    pub chat_template: Option<String>,
    /// LoRA adapters served.
    pub loras: Vec<LoraAdapter>,
    /// Latency model.
    pub timing: Timing,
    /// Maximum running requests per rank (`max_num_seqs` / `max_running_requests`); the rest wait.
    pub max_running: usize,
    /// Token budget of one step (`max_num_batched_tokens` / `chunked_prefill_size`).
    pub max_batched_tokens: usize,
    /// Context length; longer requests are refused with 400.
    pub max_model_len: usize,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: usize,
    /// KV events.
    pub events: EventsConfig,
    /// Address every listener binds (HTTP, events, PD).
    pub host: IpAddr,
    /// HTTP port; 0 binds an ephemeral port.
    pub http_port: u16,
    /// PD options.
    pub pd: PdOptions,
    /// The engine's `--api-key`: requests without `Authorization: Bearer <key>` are refused with
    /// 401 where the engine refuses them (SGLang: every path but `/health*` and `/metrics*`;
    /// vLLM: the `/v1` paths). The simulator's own `/sim/*` paths are never guarded.
    pub api_key: Option<String>,
}

impl SimConfig {
    /// A worker simulating `engine`, with test-friendly defaults: one rank, block size 16,
    /// 1024 blocks, the Qwen3 tokenizer, speed 0, loopback, ephemeral ports.
    #[must_use]
    pub fn new(engine: EngineConfig) -> Self {
        SimConfig {
            engine,
            role: Role::Unified,
            dp_size: 1,
            block_size: 16,
            capacity_blocks: 1024,
            model_name: "Qwen/Qwen3-0.6B".to_owned(),
            model: ModelSource::Qwen3,
            chat_template: None,
            loras: Vec::new(),
            timing: Timing::default(),
            max_running: 64,
            max_batched_tokens: 8192,
            max_model_len: 32_768,
            default_max_tokens: 16,
            events: EventsConfig::default(),
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            http_port: 0,
            pd: PdOptions::default(),
            api_key: None,
        }
    }

    /// [`SimConfig::new`] for vLLM 0.33.
    #[must_use]
    pub fn vllm() -> Self {
        SimConfig::new(EngineConfig::vllm())
    }

    /// [`SimConfig::new`] for SGLang 0.5.23.
    #[must_use]
    pub fn sglang() -> Self {
        SimConfig::new(EngineConfig::sglang())
    }

    /// Checks the values no engine would accept.
    ///
    /// # Errors
    /// [`SimError::Config`] naming the field.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field, reason| Err(SimError::Config { field, reason });
        if self.dp_size == 0 {
            return bad("dp_size", "must be at least 1");
        }
        if self.block_size == 0 {
            return bad("block_size", "must be at least 1");
        }
        let min_blocks = if matches!(self.engine, EngineConfig::Vllm(_)) { 2 } else { 1 };
        if self.capacity_blocks < min_blocks {
            return bad("capacity_blocks", "must hold at least one usable block");
        }
        if self.max_running == 0 {
            return bad("max_running", "must be at least 1");
        }
        if self.max_batched_tokens == 0 {
            return bad("max_batched_tokens", "must be at least 1");
        }
        if !(self.timing.speed >= 0.0 && self.timing.speed.is_finite()) {
            return bad("timing.speed", "must be a finite number ≥ 0");
        }
        if self.events.buffer_steps == 0 {
            return bad("events.buffer_steps", "must be at least 1");
        }
        if self.model_name.is_empty() {
            return bad("model_name", "must not be empty");
        }
        for l in &self.loras {
            if l.name.is_empty() || l.name == self.model_name {
                return bad("loras", "adapter names must be non-empty and differ from the model name");
            }
        }
        Ok(())
    }
}
