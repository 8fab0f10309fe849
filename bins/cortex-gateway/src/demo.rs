//! The embedded default: a simulated cluster of both engines (cortex-sim workers, in this
//! process) behind the gateway, with the Qwen3 tokenizer and template shipped in the repository.
//! No GPU, no network.
//!
//! Key decision: the demo goes through the same configuration path as a real deployment (a YAML
//! document, parsed and validated), so what it shows is what a configured gateway does.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use cortex_sim::{SimConfig, SimWorker, Timing};

use crate::config::{AdminSettings, Config, Settings};

/// The served model names of the demo.
pub const VLLM_MODEL: &str = "qwen3-vllm";
/// See [`VLLM_MODEL`].
pub const SGLANG_MODEL: &str = "qwen3-sglang";

/// The repository root (the demo reads the shipped Qwen3 files from it).
#[must_use]
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The demo: its simulated workers and the gateway settings that point at them.
pub struct Demo {
    /// Simulated workers (stopped when dropped).
    pub workers: Vec<SimWorker>,
    /// Gateway settings.
    pub settings: Settings,
    /// The admin listener's bearer token (fresh for each run).
    pub admin_token: String,
}

impl std::fmt::Debug for Demo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Demo").field("workers", &self.workers.len()).finish_non_exhaustive()
    }
}

/// The demo's cluster shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Regular workers, each serving whole requests.
    Regular,
    /// A disaggregated cluster per engine: prefill workers and decode workers.
    Disaggregated,
}

/// Starts `per_engine` simulated vLLM and SGLang workers — with [`Shape::Disaggregated`],
/// `per_engine` prefill and `per_engine` decode workers of each engine — and builds the
/// gateway's settings for them, with an admin listener on `admin_listen` behind a fresh token;
/// `speed` maps simulated time to wall-clock (1.0 = real time, 0 = instant).
///
/// # Errors
/// A worker cannot start or the settings do not validate.
pub fn start(
    listen: SocketAddr,
    admin_listen: SocketAddr,
    per_engine: usize,
    speed: f64,
    shape: Shape,
) -> Result<Demo> {
    let mut workers = Vec::new();
    let mut yaml_workers = String::new();
    let roles: &[(cortex_sim::Role, &str)] = match shape {
        Shape::Regular => &[(cortex_sim::Role::Unified, "regular")],
        Shape::Disaggregated => {
            &[(cortex_sim::Role::Prefill, "prefill"), (cortex_sim::Role::Decode, "decode")]
        }
    };
    for (engine, model) in [("vllm", VLLM_MODEL), ("sglang", SGLANG_MODEL)] {
        for &(role, role_name) in roles {
            for i in 0..per_engine {
                let mut cfg = if engine == "vllm" { SimConfig::vllm() } else { SimConfig::sglang() };
                cfg.model_name = model.to_owned();
                cfg.role = role;
                cfg.capacity_blocks = 4096;
                cfg.timing = Timing { speed, ..Timing::default() };
                cfg.default_max_tokens = 32;
                let name = match shape {
                    Shape::Regular => format!("sim-{engine}-{i}"),
                    Shape::Disaggregated => format!("sim-{engine}-{role_name}-{i}"),
                };
                let w = SimWorker::start(cfg).with_context(|| format!("starting simulated worker {name}"))?;
                yaml_workers.push_str(&format!(
                    "  - {{name: {name}, url: '{}', engine: {engine}, model: {model}, role: {role_name}}}\n",
                    w.base_url()
                ));
                workers.push(w);
            }
        }
    }
    let qwen = repo_root().join("golden/models/qwen3");
    let yaml = format!(
        "listen: '{listen}'
models:
  - name: {VLLM_MODEL}
    engine: vllm
    tokenizer: '{tok}'
    tokenizer_config: '{cfg}'
    block_size: 16
  - name: {SGLANG_MODEL}
    engine: sglang
    tokenizer: '{tok}'
    tokenizer_config: '{cfg}'
    block_size: 16
workers:
{yaml_workers}probes: {{health_interval: 1s, load_interval: 250ms}}
",
        tok = qwen.join("tokenizer.json").display(),
        cfg = qwen.join("tokenizer_config.json").display(),
    );
    let mut settings = Config::parse(&yaml)?.into_settings(&repo_root())?;
    if admin_listen == listen && listen.port() != 0 {
        anyhow::bail!("--admin-listen must differ from --listen");
    }
    // A fresh token per run: the standard library's randomly seeded hasher, twice.
    let random = || {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new().build_hasher().finish()
    };
    let admin_token = format!("{:016x}{:016x}", random(), random());
    settings.admin = Some(AdminSettings {
        listen: admin_listen,
        token: cortex_proxy::Token::new(&admin_token),
        tls: None,
    });
    Ok(Demo { workers, settings, admin_token })
}

/// What the demo prints once it is up: the public URL, the workers, a request to try, and how
/// to reach the admin listener (`admin`, behind `token`).
#[must_use]
pub fn banner(addr: SocketAddr, admin: SocketAddr, token: &str, workers: &[SimWorker]) -> String {
    let mut s = format!("Cortex gateway listening on http://{addr}\n\nSimulated workers:\n");
    for w in workers {
        let ports: Vec<String> = w.event_endpoints().iter().map(|e| e.publish.port().to_string()).collect();
        let role = match w.config().role {
            cortex_sim::Role::Unified => String::new(),
            r => format!(" {}", r.sglang_mode()),
        };
        s.push_str(&format!(
            "  {}{role} {} (KV events on port {})\n",
            w.config().engine.name(),
            w.base_url(),
            ports.join(", ")
        ));
    }
    let body = format!(
        "{{\"model\":\"{VLLM_MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Explain KV caches in one long paragraph, please. Explain KV caches in one long paragraph, please.\"}}]}}"
    );
    let disaggregated = workers.iter().any(|w| w.config().role != cortex_sim::Role::Unified);
    if disaggregated {
        s.push_str(
            "\nTry (x-cortex-prefill-worker computed the prompt, x-cortex-assigned-worker decoded it; run it\n\
             twice: the second call goes to the prefill worker that holds the prompt):\n",
        );
    } else {
        s.push_str(
            "\nTry (run it twice: the second call hits the cache of the worker that served the first):\n",
        );
    }
    s.push_str(&format!(
        "  curl -si http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n"
    ));
    s.push_str(&format!("    -d '{body}' | grep -i -e '^x-cortex' -e '^x-sim'\n"));
    s.push_str(&format!(
        "\nAlso: http://{addr}/v1/models  http://{addr}/metrics  http://{addr}/health/ready\n"
    ));
    s.push_str(&format!(
        "\nAdmin API and debug views on the admin listener http://{admin} (bearer token below):\n"
    ));
    s.push_str(&format!("  curl -s http://{admin}/debug/workers -H 'authorization: Bearer {token}'\n"));
    s.push_str(&format!(
        "  curl -s http://{admin}/debug/route -H 'authorization: Bearer {token}' -H 'content-type: application/json' \\\n    -d '{body}'\n"
    ));
    s
}

/// How long the demo waits for its workers to be discovered before printing the banner.
pub const DISCOVERY_WAIT: Duration = Duration::from_secs(10);
