//! Gateway overhead: the latency a proxy adds to a small request, measured interleaved in one
//! run with one load generator against (a) the simulated worker directly, (b) a do-nothing
//! hyper proxy, (c) Cortex, and (d) SGLang's router when it is installed.
//!
//! Key decisions: the targets take turns within each round (the order rotates every round) and
//! the rounds repeat, because this machine is shared and noisy: a number is the median over
//! rounds, with its spread (min–max over rounds); the added latency is computed per round
//! against the direct call of the same round. It must run optimized: `cargo xtask bench` runs
//! it from a release build of this crate.

pub mod cpu;
pub mod loadgen;
pub mod passthrough;
pub mod targets;

use std::path::Path;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use serde_json::{Value, json};

use loadgen::{Bodies, Probe};

/// Settings of one overhead run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Interleaved rounds.
    pub rounds: usize,
    /// Measured requests per target per round (and concurrency).
    pub requests: usize,
    /// Unmeasured requests per target per round, first.
    pub warmup: usize,
    /// Concurrency levels, each measured separately.
    pub concurrency: Vec<usize>,
    /// Measure SGLang's router if it is installed.
    pub sglang: bool,
}

/// The target names, in the order of the report.
pub const TARGETS: [&str; 4] = ["direct", "passthrough", "cortex", "sglang_router"];

/// The small request's question, after its first sentence.
const QUESTION: &str = "Answer in one short sentence, without lists or code: what does a key-value cache store for a \
     transformer model while it generates text?";

/// The small request: a short `/v1/completions` prompt (about 40 tokens), 4 output tokens,
/// non-streaming, the same every time.
#[must_use]
pub fn probe() -> Probe {
    let prompt = format!("You are a helpful assistant. {QUESTION}");
    Probe { path: "/v1/completions".to_owned(), body: completion(&prompt), bodies: Bodies::Repeated }
}

/// The same request with a prompt never seen: its first sentence is four words that spell the
/// request's number, so no two requests share a prompt, or even a first 16-token block, while
/// every prompt stays in [`probe`]'s length class (the same question, 41 tokens against 40).
#[must_use]
pub fn never_seen_probe() -> Probe {
    Probe {
        path: "/v1/completions".to_owned(),
        body: never_seen_body(0),
        bodies: Bodies::NeverSeen(never_seen_body),
    }
}

/// Words the number of a never-seen prompt is spelled in (64, one token each in Qwen3's
/// vocabulary with their leading space).
const WORDS: [&str; 64] = [
    "apple", "river", "stone", "cloud", "green", "house", "music", "paper", "light", "table", "water",
    "bread", "chair", "plant", "glass", "train", "horse", "money", "night", "phone", "sugar", "storm",
    "dream", "field", "heart", "metal", "ocean", "pilot", "queen", "radio", "sheep", "tiger", "uncle",
    "voice", "whale", "youth", "zebra", "angle", "beach", "candy", "dance", "earth", "fruit", "ghost",
    "honey", "index", "juice", "knife", "lemon", "mouse", "nurse", "olive", "piano", "quilt", "robot",
    "salad", "tooth", "union", "video", "wheel", "yacht", "amber", "bench", "coral",
];

/// The body of never-seen request number `n` (unique for `n` below 64⁴, about 16.8 million).
#[must_use]
pub fn never_seen_body(n: u64) -> Bytes {
    let word = |k: u32| WORDS[usize::try_from((n >> (6 * k)) & 63).unwrap_or(0)];
    let prompt = format!("Request {} {} {} {}. {QUESTION}", word(3), word(2), word(1), word(0));
    completion(&prompt)
}

fn completion(prompt: &str) -> Bytes {
    let body = json!({"model": targets::MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0});
    Bytes::from(body.to_string())
}

/// The prompt variants, in the order of the report: the repeated prompt and a never-seen one.
pub const PROMPTS: [&str; 2] = ["repeated", "never_seen"];

/// Runs the benchmark and returns its raw results (per target, per concurrency, per round).
///
/// # Errors
/// A target cannot start or a request fails.
#[allow(clippy::print_stderr)]
pub fn run(root: &Path, opts: &Options, log_dir: &Path) -> Result<Value> {
    let probe = probe();
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().ok();
    let sim = targets::sim()?;
    let direct = sim.http_addr();
    let passthrough = targets::Passthrough::start(direct)?;
    let cortex =
        targets::Cortex::start(root, &sim.base_url(), &probe, prometheus).context("starting Cortex")?;
    let mut sglang = None;
    let mut sglang_status = json!({"status": "disabled", "reason": "--no-sglang"});
    if opts.sglang {
        match targets::SglangRouter::start(&sim.base_url(), &probe, &log_dir.join("sglang-router.log")) {
            Ok(r) => {
                sglang_status = json!({"status": "measured", "command": r.command, "version": r.version});
                sglang = Some(r);
            }
            Err(e) => {
                eprintln!("bench overhead: SGLang's router skipped: {e:#}");
                sglang_status = json!({"status": "skipped", "reason": format!("{e:#}")});
            }
        }
    }
    let named = |names: &[&str]| cpu::Threads::Named(names.iter().map(|n| (*n).to_owned()).collect());
    let mut addrs = vec![
        ("direct", direct, named(&[targets::SIM_THREADS])),
        ("passthrough", passthrough.addr, named(&[targets::PASSTHROUGH_THREADS])),
        ("cortex", cortex.addr, named(&[targets::CORTEX_THREADS, "cortex-ingest"])),
    ];
    if let Some(r) = &sglang {
        addrs.push(("sglang_router", r.addr, cpu::Threads::Process(r.pid())));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Every target answers, and Cortex says what it did.
    for (name, addr, _) in &addrs {
        let (status, headers, body) = rt.block_on(loadgen::fetch(*addr, &probe))?;
        if status != http::StatusCode::OK {
            bail!("{name} answered {status}: {}", String::from_utf8_lossy(&body));
        }
        if *name == "cortex" && !headers.contains_key("x-cortex-assigned-worker") {
            bail!("Cortex's answer has no x-cortex-assigned-worker header");
        }
    }
    let probes = [probe.clone(), never_seen_probe()];
    let mut levels = Vec::new();
    for &c in &opts.concurrency {
        // Every (prompt, target) pair takes its turn in every round, the order rotated per round.
        let pairs: Vec<(usize, usize)> =
            (0..probes.len()).flat_map(|p| (0..addrs.len()).map(move |t| (p, t))).collect();
        let mut per: Vec<Vec<Value>> = vec![Vec::new(); pairs.len()];
        for round in 0..opts.rounds {
            let n = pairs.len();
            for k in 0..n {
                let i = (k + round) % n;
                let (p, t) = pairs[i];
                let (name, addr, threads) = &addrs[t];
                let r =
                    rt.block_on(loadgen::run(*addr, &probes[p], c, opts.warmup, opts.requests, threads))?;
                if r.errors > 0 {
                    bail!("{name}: {} of {} requests failed at concurrency {c}", r.errors, opts.requests);
                }
                eprintln!(
                    "bench overhead: c={c} round {}/{} {:<10} {name:<13} p50 {:>7.1} µs  p99 {:>7.1} µs  {:>7.0} req/s  CPU {:>6.1} µs/req",
                    round + 1,
                    opts.rounds,
                    PROMPTS[p],
                    r.quantile(0.5) as f64 / 1e3,
                    r.quantile(0.99) as f64 / 1e3,
                    r.rps(),
                    r.cpu_per_request_ns() / 1e3,
                );
                per[i].push(json!({
                    "p50_ns": r.quantile(0.5),
                    "p99_ns": r.quantile(0.99),
                    "rps": r.rps(),
                    "cpu_ns_per_request": r.cpu_per_request_ns(),
                }));
            }
        }
        let mut prompts = serde_json::Map::new();
        for (p, prompt) in PROMPTS.iter().enumerate() {
            let targets: serde_json::Map<String, Value> = pairs
                .iter()
                .zip(&per)
                .filter(|((q, _), _)| *q == p)
                .map(|((_, t), rounds)| (addrs[*t].0.to_owned(), Value::Array(rounds.clone())))
                .collect();
            prompts.insert((*prompt).to_owned(), json!({"targets": targets}));
        }
        levels.push(json!({"concurrency": c, "prompts": prompts}));
    }
    drop(sglang);
    drop(cortex);
    drop(passthrough);
    sim.shutdown();
    Ok(json!({
        "request": {"path": probe.path, "body": String::from_utf8_lossy(&probe.body)},
        "never_seen_example": String::from_utf8_lossy(&probes[1].body),
        "rounds": opts.rounds,
        "requests": opts.requests,
        "warmup": opts.warmup,
        "sglang_router": sglang_status,
        "levels": levels,
    }))
}

/// Summary of a series over rounds: median, min, max.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median over rounds.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (none if empty).
    #[must_use]
    pub fn of(values: &[f64]) -> Option<Spread> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 { v[mid] } else { f64::midpoint(v[mid - 1], v[mid]) };
        Some(Spread { median, min: v[0], max: v[v.len() - 1] })
    }

    /// The spread of `f` over `rows` (none if empty).
    #[must_use]
    pub fn over<T>(rows: &[T], f: impl Fn(&T) -> f64) -> Option<Spread> {
        Spread::of(&rows.iter().map(f).collect::<Vec<_>>())
    }
}

/// One target's numbers at one concurrency, over rounds (latencies in µs).
#[derive(Debug, Clone)]
pub struct TargetSummary {
    /// Target name.
    pub name: String,
    /// p50 latency.
    pub p50: Spread,
    /// p99 latency.
    pub p99: Spread,
    /// Requests per second.
    pub rps: Spread,
    /// CPU time of the target's own threads per request (the simulated worker's for `direct`).
    pub cpu: Option<Spread>,
    /// p50 minus the same round's direct p50 (none for `direct`).
    pub added_p50: Option<Spread>,
    /// p99 minus the same round's direct p99.
    pub added_p99: Option<Spread>,
    /// Median added p50 divided by the do-nothing proxy's median added p50 (a ratio of
    /// medians: a per-round ratio explodes when the proxy's added latency of one round is
    /// close to zero).
    pub vs_passthrough: Option<f64>,
}

/// Summarizes one prompt variant of one level of [`run`]'s output (`level["prompts"][variant]`).
#[must_use]
pub fn summarize(level: &Value) -> Vec<TargetSummary> {
    let series = |name: &str, key: &str| -> Vec<f64> {
        level["targets"][name].as_array().map_or_else(Vec::new, |rounds| {
            rounds
                .iter()
                .filter_map(|r| r[key].as_f64())
                .map(|v| if key == "rps" { v } else { v / 1e3 })
                .collect()
        })
    };
    let minus = |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x - y).collect() };
    let direct50 = series("direct", "p50_ns");
    let direct99 = series("direct", "p99_ns");
    let pass_added = Spread::of(&minus(&series("passthrough", "p50_ns"), &direct50)).map(|s| s.median);
    let mut out = Vec::new();
    for name in TARGETS {
        let p50 = series(name, "p50_ns");
        let (Some(p50s), Some(p99), Some(rps)) =
            (Spread::of(&p50), Spread::of(&series(name, "p99_ns")), Spread::of(&series(name, "rps")))
        else {
            continue;
        };
        let is_direct = name == "direct";
        let added = Spread::of(&minus(&p50, &direct50));
        let vs = match (added, pass_added) {
            (Some(a), Some(p)) if p > 0.0 && !is_direct && name != "passthrough" => Some(a.median / p),
            _ => None,
        };
        out.push(TargetSummary {
            name: name.to_owned(),
            p50: p50s,
            p99,
            rps,
            cpu: Spread::of(&series(name, "cpu_ns_per_request")),
            added_p50: if is_direct { None } else { added },
            added_p99: if is_direct { None } else { Spread::of(&minus(&series(name, "p99_ns"), &direct99)) },
            vs_passthrough: vs,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_seen_bodies_differ_from_the_first_word_and_keep_the_length_class() {
        let prompt =
            |b: &Bytes| serde_json::from_slice::<Value>(b).unwrap()["prompt"].as_str().unwrap().to_owned();
        let repeated = prompt(&probe().body);
        let bodies: Vec<String> = [0, 1, 64, 4096, 262_144, 64u64.pow(4) - 1]
            .iter()
            .map(|&n| prompt(&never_seen_body(n)))
            .collect();
        for (i, a) in bodies.iter().enumerate() {
            assert!(a.ends_with(QUESTION) && a.len().abs_diff(repeated.len()) <= 16, "{a}");
            for b in &bodies[i + 1..] {
                assert_ne!(
                    a.split(' ').take(5).collect::<Vec<_>>(),
                    b.split(' ').take(5).collect::<Vec<_>>()
                );
            }
        }
        let p = never_seen_probe();
        assert_ne!(p.next_body(), p.next_body());
        assert_eq!(probe().next_body(), probe().body);
    }

    #[test]
    fn spreads_and_per_round_differences() {
        assert_eq!(Spread::of(&[3.0, 1.0, 2.0]), Some(Spread { median: 2.0, min: 1.0, max: 3.0 }));
        assert_eq!(Spread::of(&[1.0, 2.0]).map(|s| s.median), Some(1.5));
        assert_eq!(Spread::of(&[]), None);
        let r = |p50: u64, p99: u64| json!({"p50_ns": p50, "p99_ns": p99, "rps": 1000.0});
        let level = json!({"concurrency": 1, "targets": {
            "direct": [r(100_000, 200_000), r(110_000, 210_000)],
            "passthrough": [r(150_000, 300_000), r(150_000, 300_000)],
            "cortex": [r(200_000, 400_000), r(170_000, 350_000)],
        }});
        let s = summarize(&level);
        assert_eq!(
            s.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["direct", "passthrough", "cortex"]
        );
        let cortex = &s[2];
        // Added per round: 100 and 60 µs (median 80); the proxy's: 50 and 40 µs (median 45).
        assert_eq!(cortex.added_p50, Some(Spread { median: 80.0, min: 60.0, max: 100.0 }));
        assert_eq!(cortex.vs_passthrough, Some(80.0 / 45.0));
        assert!(s[0].added_p50.is_none() && s[1].vs_passthrough.is_none());
    }
}
