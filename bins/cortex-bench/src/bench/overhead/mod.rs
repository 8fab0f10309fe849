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

use loadgen::Probe;

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

/// The small request: a short `/v1/completions` prompt (about 40 tokens), 4 output tokens,
/// non-streaming.
#[must_use]
pub fn probe() -> Probe {
    let prompt = "You are a helpful assistant. Answer in one short sentence, without lists or code: \
                  what does a key-value cache store for a transformer model while it generates text?";
    let body = json!({"model": targets::MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0});
    Probe { path: "/v1/completions".to_owned(), body: Bytes::from(body.to_string()) }
}

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
    let mut levels = Vec::new();
    for &c in &opts.concurrency {
        let mut per: Vec<(String, Vec<Value>)> =
            addrs.iter().map(|(n, _, _)| ((*n).to_owned(), Vec::new())).collect();
        for round in 0..opts.rounds {
            let n = addrs.len();
            for k in 0..n {
                let i = (k + round) % n;
                let (name, addr, threads) = &addrs[i];
                let r = rt.block_on(loadgen::run(*addr, &probe, c, opts.warmup, opts.requests, threads))?;
                if r.errors > 0 {
                    bail!("{name}: {} of {} requests failed at concurrency {c}", r.errors, opts.requests);
                }
                eprintln!(
                    "bench overhead: c={c} round {}/{} {name:<13} p50 {:>7.1} µs  p99 {:>7.1} µs  {:>7.0} req/s  CPU {:>6.1} µs/req",
                    round + 1,
                    opts.rounds,
                    r.quantile(0.5) as f64 / 1e3,
                    r.quantile(0.99) as f64 / 1e3,
                    r.rps(),
                    r.cpu_per_request_ns() / 1e3,
                );
                per[i].1.push(json!({
                    "p50_ns": r.quantile(0.5),
                    "p99_ns": r.quantile(0.99),
                    "rps": r.rps(),
                    "cpu_ns_per_request": r.cpu_per_request_ns(),
                }));
            }
        }
        let targets: serde_json::Map<String, Value> =
            per.into_iter().map(|(n, rounds)| (n, Value::Array(rounds))).collect();
        levels.push(json!({"concurrency": c, "targets": targets}));
    }
    drop(sglang);
    drop(cortex);
    drop(passthrough);
    sim.shutdown();
    Ok(json!({
        "request": {"path": probe.path, "body": String::from_utf8_lossy(&probe.body)},
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

/// Summarizes one level of [`run`]'s output.
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
