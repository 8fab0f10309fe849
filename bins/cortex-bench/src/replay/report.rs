//! The replay's report: the parameters used, one table per workload, the goals marked
//! met or not met, and the files — `results.json` and the SVG plots — under the output
//! directory.
//!
//! Key decision: goals are evaluated from the same numbers the table prints, and a goal that
//! could not be measured (SGLang's router absent, a policy left out) says so instead of passing.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::metrics::PolicyResult;
use super::workload::Kind;
use super::{Replay, WorkloadRun, svg};

/// One goal of the issue, evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Goal {
    /// What is asked.
    pub name: String,
    /// What was measured.
    pub value: String,
    /// Met, not met, or not measured (`None`).
    pub met: Option<bool>,
}

fn find<'a>(w: &'a WorkloadRun, label: &str) -> Option<&'a PolicyResult> {
    w.results.iter().find(|r| r.label == label)
}

const DEFAULT: &str = "cortex cache_aware";
const SGLANG: &str = "sglang-router cache_aware";

/// The PD replay's goals: Cortex's end-to-end TTFT p50 and p99 at most 0.8× the engine's peer
/// (SGLang's PD router, vLLM's toy proxy); on multi-turn, where decode workers cache (vLLM, SGLang
/// with the decode radix cache), transferred tokens with cache-aware decode at most 0.7× with
/// load-only decode.
fn pd_goals(replay: &Replay, out: &mut Vec<Goal>) {
    use super::pd;
    let a = &replay.args;
    let peer = match a.engine {
        super::cluster::Engine::Sglang => pd::SGLANG_PD,
        super::cluster::Engine::Vllm => pd::VLLM_TOY,
    };
    let (cortex, load, peer_label) = (
        pd::label(pd::CORTEX, a.decode_only_max_uncached),
        pd::label(pd::CORTEX_LOAD_DECODE, a.decode_only_max_uncached),
        pd::label(peer, a.decode_only_max_uncached),
    );
    for w in &replay.workloads {
        let find = |l: &str| w.pd_results.iter().find(|r| r.label == l);
        let Some(c) = find(&cortex) else { continue };
        let n = w.kind.name();
        for (i, p) in [(0, "p50"), (2, "p99")] {
            let name = format!("{n} (PD): Cortex's TTFT {p} ≤ 0.8× {peer_label}'s");
            out.push(match find(&peer_label) {
                Some(o) if o.ttft[i] > 0.0 => Goal {
                    name,
                    value: format!(
                        "{:.0} ms vs {:.0} ms ({:.2}×)",
                        c.ttft[i],
                        o.ttft[i],
                        c.ttft[i] / o.ttft[i]
                    ),
                    met: Some(c.ttft[i] <= 0.8 * o.ttft[i]),
                },
                _ => Goal { name, value: "not measured: the peer did not run".to_owned(), met: None },
            });
        }
        let caches = a.engine == super::cluster::Engine::Vllm || !a.no_decode_radix_cache;
        if w.kind == Kind::MultiTurn && caches {
            let name =
                format!("{n} (PD): tokens transferred with cache-aware decode ≤ 0.7× with load-only decode");
            out.push(match find(&load) {
                Some(o) if o.transferred_tokens > 0 => Goal {
                    name,
                    value: format!(
                        "{} vs {} ({:.2}×)",
                        c.transferred_tokens,
                        o.transferred_tokens,
                        c.transferred_tokens as f64 / o.transferred_tokens as f64
                    ),
                    met: Some(c.transferred_tokens as f64 <= 0.7 * o.transferred_tokens as f64),
                },
                _ => Goal { name, value: "not measured: load-only decode did not run".to_owned(), met: None },
            });
        }
    }
}

/// "No worse" everywhere: at most this factor of the best other policy of the same run.
const TOLERANCE: f64 = 1.05;

/// The goals, for the workloads and policies that ran: on every workload Cortex's
/// default TTFT p50 and p99 no worse than the best other policy (Cortex's own replicas aside);
/// on Mooncake TTFT p50 and p90 ≤ 0.8× SGLang's router and a hit ratio at least its; on shared
/// prefix and multi-turn a hit ratio ≥ 90 % of the bound; on the hot spot no worker routed less
/// than half the mean; with N replicas, hit ratio and TTFT p50 within 10 % of one replica; and a
/// run that did not keep pace (clock ratio < 0.9) is not a result.
#[must_use]
pub fn goals(replay: &Replay) -> Vec<Goal> {
    let mut out = Vec::new();
    if replay.args.pd.is_some() {
        pd_goals(replay, &mut out);
        return out;
    }
    for w in &replay.workloads {
        let Some(c) = find(w, DEFAULT) else { continue };
        let n = w.kind.name();
        let slow: Vec<String> = w
            .results
            .iter()
            .filter(|r| r.clock_ratio.is_some_and(|k| k < 0.9))
            .map(|r| format!("{} {:.2}", r.label, r.clock_ratio.unwrap_or(0.0)))
            .collect();
        out.push(Goal {
            name: format!("{n}: every policy kept pace (simulators' clock ratio ≥ 0.9)"),
            value: if slow.is_empty() { "yes".to_owned() } else { slow.join(", ") },
            met: Some(slow.is_empty()),
        });
        let others: Vec<&PolicyResult> = w
            .results
            .iter()
            .filter(|r| r.label != DEFAULT && !r.label.starts_with("cortex cache_aware ×"))
            .collect();
        for (p, get) in [("p50", (|t: &super::metrics::Ttft| t.p50) as fn(&_) -> f64), ("p99", |t| t.p99)] {
            let name = format!("{n}: Cortex's TTFT {p} ≤ {TOLERANCE}× the best other policy's");
            let best =
                others.iter().filter(|o| o.ok > 0).min_by(|a, b| get(&a.ttft).total_cmp(&get(&b.ttft)));
            out.push(match best {
                Some(o) => Goal {
                    name,
                    value: format!("{:.0} ms vs {:.0} ms ({})", get(&c.ttft), get(&o.ttft), o.label),
                    met: Some(get(&c.ttft) <= TOLERANCE * get(&o.ttft)),
                },
                None => Goal { name, value: "not measured: no other policy ran".to_owned(), met: None },
            });
        }
        match w.kind {
            Kind::Mooncake => match find(w, SGLANG) {
                Some(o) if o.ok > 0 => {
                    for (p, mine, theirs) in
                        [("p50", c.ttft.p50, o.ttft.p50), ("p90", c.ttft.p90, o.ttft.p90)]
                    {
                        out.push(Goal {
                            name: format!("mooncake: Cortex's TTFT {p} ≤ 0.8× SGLang's router's"),
                            value: format!(
                                "{mine:.0} ms vs {theirs:.0} ms ({:.2}×)",
                                mine / theirs.max(1e-9)
                            ),
                            met: Some(mine <= 0.8 * theirs),
                        });
                    }
                    out.push(Goal {
                        name: "mooncake: Cortex's hit ratio ≥ SGLang's router's".to_owned(),
                        value: format!(
                            "{:.1} % vs {:.1} % (bound {:.1} %)",
                            c.hit_ratio * 100.0,
                            o.hit_ratio * 100.0,
                            w.token_bound * 100.0
                        ),
                        met: Some(c.hit_ratio >= o.hit_ratio),
                    });
                }
                _ => {
                    let why = w
                        .skipped
                        .iter()
                        .find(|(l, _)| l == SGLANG)
                        .map_or("not in --policies", |(_, why)| why.as_str());
                    out.push(Goal {
                        name: "mooncake: Cortex against SGLang's router".to_owned(),
                        value: format!("not measured: {why}"),
                        met: None,
                    });
                }
            },
            Kind::SharedPrefix | Kind::MultiTurn => out.push(Goal {
                name: format!("{n}: Cortex's hit ratio ≥ 90 % of the infinite-cache bound"),
                value: format!(
                    "{:.1} % of the bound ({:.1} % vs {:.1} %)",
                    c.of_bound * 100.0,
                    c.hit_ratio * 100.0,
                    w.token_bound * 100.0
                ),
                met: Some(c.of_bound >= 0.9),
            }),
            Kind::HotSpot => {
                let totals = per_worker(c);
                let mean = totals.iter().sum::<u64>() as f64 / totals.len().max(1) as f64;
                let min = totals.iter().copied().min().unwrap_or(0);
                out.push(Goal {
                    name: "hot-spot: no worker routed less than half the mean (prompt tokens)".to_owned(),
                    value: format!("least {min} vs mean {mean:.0} ({:.2}×)", min as f64 / mean.max(1e-9)),
                    met: Some(min as f64 >= 0.5 * mean),
                });
            }
        }
        for r in w.results.iter().filter(|r| r.label.starts_with("cortex cache_aware ×")) {
            let within = |a: f64, b: f64| (a - b).abs() <= 0.1 * b;
            out.push(Goal {
                name: format!("{n}: {} hit ratio and TTFT p50 within 10 % of one replica's", r.label),
                value: format!(
                    "{:.1} % vs {:.1} %, {:.0} ms vs {:.0} ms",
                    r.hit_ratio * 100.0,
                    c.hit_ratio * 100.0,
                    r.ttft.p50,
                    c.ttft.p50
                ),
                met: Some(within(r.hit_ratio, c.hit_ratio) && within(r.ttft.p50, c.ttft.p50)),
            });
        }
    }
    out
}

/// Prompt tokens routed to each worker over the whole run.
#[must_use]
pub fn per_worker(r: &PolicyResult) -> Vec<u64> {
    let mut totals = Vec::new();
    for window in &r.load.windows {
        totals.resize(totals.len().max(window.len()), 0);
        for (t, v) in totals.iter_mut().zip(window) {
            *t += v;
        }
    }
    totals
}

/// The parameters, one line.
#[must_use]
pub fn parameters(replay: &Replay) -> String {
    let a = &replay.args;
    let t = a.timing();
    let cluster = match a.pd {
        Some(p) => format!(
            "{} prefill + {} decode simulated {} workers{}",
            p.prefill,
            p.decode,
            a.engine.name(),
            match a.engine {
                super::cluster::Engine::Sglang if a.no_decode_radix_cache =>
                    " (decode workers without the radix cache)",
                super::cluster::Engine::Sglang => " (decode workers with the radix cache)",
                super::cluster::Engine::Vllm => "",
            }
        ),
        None => format!("{} simulated {} workers", a.workers, a.engine.name()),
    };
    format!(
        "{cluster} · {}-token pages · each worker caches 1/{} of the workload's unique pages · trace time {}× faster than real time (simulator speed {}) · one {}-token text chunk per 512-token trace block · prefill {:.0} µs per text token + {} ms per step, chunked at {} tokens · decode {} ms per step + {} µs per running request · max {} running per worker · output ≤ {} tokens",
        a.block_size,
        a.capacity_divisor,
        a.compression,
        t.speed,
        a.chunk_tokens,
        t.prefill_per_token.as_secs_f64() * 1e6,
        t.prefill_overhead.as_millis(),
        a.max_batched_tokens(),
        t.itl_base.as_millis(),
        t.itl_per_running.as_micros(),
        a.max_running,
        a.max_output,
    ) + &format!(
        " · request timeout {} s · scheduler overrides: {}",
        a.timeout_secs,
        if a.scheduler.trim().is_empty() { "none (the defaults)" } else { a.scheduler.trim() }
    )
}

/// A PD workload's table: end-to-end TTFT, what the cache saved, what moved, and how Cortex
/// served the requests.
fn pd_table(s: &mut String, w: &WorkloadRun) {
    let _ = writeln!(
        s,
        "| front end | answered | failed | TTFT p50 | p90 | p99 (ms, end to end) | prompt not computed | tokens transferred | decode-only |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &w.pd_results {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.1} % | {} | {:.0} % |",
            r.label,
            r.ok,
            r.failed,
            r.ttft[0],
            r.ttft[1],
            r.ttft[2],
            r.hit * 100.0,
            r.transferred_tokens,
            r.decode_only_share * 100.0
        );
    }
    for (l, why) in &w.skipped {
        let _ = writeln!(s, "\n{l}: skipped — {why}");
    }
    let _ = writeln!(s, "\nDiagnostics:");
    for r in &w.pd_results {
        let modes: Vec<String> = r.pd_modes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            s,
            "- {}: wall {:.0} s; dispatch late p99 {:.1} ms; decode preemptions {}{}{}{}{}",
            r.label,
            r.wall_secs,
            r.late_p99_ms,
            r.decode_preemptions,
            if r.prefill_shares.is_empty() {
                String::new()
            } else {
                let shares: Vec<String> =
                    r.prefill_shares.iter().map(|x| format!("{:.0} %", x * 100.0)).collect();
                format!("; prefill workers' shares of computed tokens {}", shares.join(" / "))
            },
            super::metrics::Learned::diagnostic(r.learned_rate.as_ref()),
            if modes.is_empty() { String::new() } else { format!("; served: {}", modes.join(", ")) },
            if r.errors.is_empty() { String::new() } else { format!("; errors: {}", r.errors.join(" | ")) },
        );
    }
}

/// The text report.
#[must_use]
pub fn table(replay: &Replay, goals: &[Goal]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Parameters: {}.", parameters(replay));
    for w in &replay.workloads {
        let _ = writeln!(s, "\n## {} — {}", w.kind.name(), w.description);
        let _ = writeln!(
            s,
            "{} requests over {:.0} s of trace time · {} prompt tokens · {} unique pages · {} pages per worker{}",
            w.requests,
            w.span.as_secs_f64(),
            w.prompt_tokens,
            w.unique_pages,
            w.capacity_blocks,
            w.capacity_note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "Infinite-cache bound: {:.1} % of prompt tokens (whole pages, last token excluded) · {:.1} % of trace blocks.",
            w.token_bound * 100.0,
            w.block_bound * 100.0,
        );
        let _ = writeln!(
            s,
            "References (not goals): one LRU cache the size of the whole cluster's, with perfect routing and load ignored, would serve {:.1} %; balancing each window's tokens offline (largest first to the lightest worker), cache ignored, gives a load CoV of {:.3}.\n",
            w.lru_share * 100.0,
            w.balanced_cov
        );
        if !w.pd_results.is_empty() {
            pd_table(&mut s, w);
            continue;
        }
        let _ = writeln!(
            s,
            "| policy | answered | failed | shed | cache hit | of bound | TTFT p50 | p90 | p99 (ms) | load CoV | max/mean |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &w.results {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.1} % | {:.0} % | {:.0} | {:.0} | {:.0} | {:.3} | {:.2} |",
                r.label,
                r.ok,
                r.failed,
                r.shed,
                r.hit_ratio * 100.0,
                r.of_bound * 100.0,
                r.ttft.p50,
                r.ttft.p90,
                r.ttft.p99,
                r.load.cov,
                r.load.max_over_mean
            );
        }
        for (l, why) in &w.skipped {
            let _ = writeln!(s, "\n{l}: skipped — {why}");
        }
        let _ = writeln!(s, "\nDiagnostics:");
        for r in &w.results {
            let modes: Vec<String> = r.match_modes.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(
                s,
                "- {}: wall {:.0} s; dispatch late p99 {:.1} ms; simulated/wall clock ratio {}; whole-run CoV {:.3}{}{}{}{}{}{}{}",
                r.label,
                r.wall_secs,
                r.late_p99_ms,
                r.clock_ratio.map_or("n/a".to_owned(), |c| format!("{c:.2}")),
                r.load.cov_total,
                super::metrics::Learned::diagnostic(r.learned_rate.as_ref()),
                r.cap.as_ref().map(|c| format!("; {c}")).unwrap_or_default(),
                if r.load.idle_workers > 0 {
                    format!("; {} worker(s) routed nothing", r.load.idle_workers)
                } else {
                    String::new()
                },
                r.predicted_hit_tokens
                    .map(|p| format!(
                        "; predicted hits {:.1} % of prompt tokens",
                        p as f64 / r.prompt_tokens.max(1) as f64 * 100.0
                    ))
                    .unwrap_or_default(),
                if modes.is_empty() { String::new() } else { format!("; match modes: {}", modes.join(", ")) },
                if r.token_mismatches > 0 {
                    format!("; {} prompt-length mismatches", r.token_mismatches)
                } else {
                    String::new()
                },
                if r.errors.is_empty() {
                    String::new()
                } else {
                    format!("; errors: {}", r.errors.join(" | "))
                },
            );
        }
    }
    if !goals.is_empty() {
        let _ = writeln!(s, "\nGoals:");
        let overrides = replay.args.scheduler.trim();
        if !overrides.is_empty() {
            let _ = writeln!(
                s,
                "(judged with the scheduler overrides {overrides}, not the defaults the goals are set for)"
            );
        }
        for g in goals {
            let mark = match g.met {
                Some(true) => "met",
                Some(false) => "NOT MET",
                None => "not measured",
            };
            let _ = writeln!(s, "- [{mark}] {} — {}", g.name, g.value);
        }
    }
    let _ = writeln!(s, "\nWall clock: {:.0} s for the whole replay.", replay.wall.as_secs_f64());
    s
}

/// The JSON result.
#[must_use]
pub fn to_json(replay: &Replay, goals: &[Goal], command: &str) -> Value {
    let a = &replay.args;
    let t = a.timing();
    json!({
        "command": command,
        "parameters": {
            "workers": a.cluster_workers(),
            "pd": a.pd.map(|p| json!({"prefill": p.prefill, "decode": p.decode, "decode_only_max_uncached": a.decode_only_max_uncached, "decode_radix_cache": !a.no_decode_radix_cache})),
            "engine": a.engine.name(),
            "block_size": a.block_size,
            "capacity_divisor": a.capacity_divisor,
            "compression": a.compression,
            "simulator_speed": t.speed,
            "chunk_tokens": a.chunk_tokens,
            "prefill_us_per_token": t.prefill_per_token.as_secs_f64() * 1e6,
            "prefill_overhead_ms": t.prefill_overhead.as_secs_f64() * 1e3,
            "max_batched_tokens": a.max_batched_tokens(),
            "itl_base_ms": t.itl_base.as_secs_f64() * 1e3,
            "itl_per_running_us": t.itl_per_running.as_secs_f64() * 1e6,
            "max_running": a.max_running,
            "max_output": a.max_output,
            "seed": a.seed,
            "timeout_secs": a.timeout_secs,
            "scheduler_overrides": a.scheduler.trim(),
            "sglang_router": replay.sglang_version,
        },
        "workloads": replay.workloads.iter().map(|w| json!({
            "workload": w.kind.name(),
            "description": w.description,
            "requests": w.requests,
            "trace_span_s": w.span.as_secs_f64(),
            "prompt_tokens": w.prompt_tokens,
            "bound_token_share": w.token_bound,
            "bound_block_share": w.block_bound,
            "cluster_lru_share": w.lru_share,
            "balanced_cov": w.balanced_cov,
            "unique_pages": w.unique_pages,
            "capacity_blocks": w.capacity_blocks,
            "capacity_note": w.capacity_note,
            "results": w.results.iter().map(PolicyResult::to_json).collect::<Vec<_>>(),
            "pd_results": w.pd_results.iter().map(super::pd::PdResult::to_json).collect::<Vec<_>>(),
            "skipped": w.skipped.iter().map(|(l, why)| json!({"policy": l, "reason": why})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "goals": goals.iter().map(|g| json!({"goal": g.name, "value": g.value, "met": g.met})).collect::<Vec<_>>(),
        "wall_s": replay.wall.as_secs_f64(),
    })
}

/// Writes `results.json` and the plots under `dir`; returns the paths written.
///
/// # Errors
/// A file cannot be written.
pub fn write(replay: &Replay, goals: &[Goal], command: &str, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut files = Vec::new();
    let mut put = |name: String, text: String| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
        files.push(p);
        Ok(())
    };
    let json = serde_json::to_string_pretty(&to_json(replay, goals, command))?;
    put("results.json".to_owned(), json + "\n")?;
    put("report.md".to_owned(), table(replay, goals))?;
    for w in replay.workloads.iter().filter(|w| !w.results.is_empty()) {
        let n = w.kind.name();
        put(
            format!("{n}-hit-ratio.svg"),
            svg::hit_ratio(&format!("{n}: prompt tokens served from cache"), &w.results, w.token_bound),
        )?;
        put(format!("{n}-ttft-cdf.svg"), svg::ttft_cdf(&format!("{n}: simulated TTFT"), &w.results))?;
        put(
            format!("{n}-load.svg"),
            svg::load(&format!("{n}: routed prompt tokens per worker"), &w.results),
        )?;
    }
    Ok(files)
}
