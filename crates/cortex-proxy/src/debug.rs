//! The JSON of `/debug/route` (a dry run, explained) and `/debug/workers` (each worker's
//! configuration, discovery, profile verdict, capacity, ledger state and load; also
//! `GET /admin/workers`).
//!
//! Key decision: these are views only. The dry run is [`Planner::explain`](crate::planner::Planner::explain),
//! the same pipeline as the request path; this module renders it. Every value is JSON (numbers,
//! booleans, snake-case names), never a Rust `Debug` string, so scripts can read it.

use cortex_hash::kv::{DpRank, HolderId};
use cortex_hash::profile::{Alignment, Bigram, WorkerFacts};
use cortex_sched::{Candidate, Exclusion, Health};
use serde_json::{Value, json};

use crate::alignment::Verdict;
use crate::config::Mode;
use crate::control::Control;
use crate::error::ProxyError;
use crate::planner::Explanation;
use crate::registry::Registry;
use crate::request::Route;

/// The route a debug or `/tokenize` body is parsed as: `given` (`/debug/route?route=`), else
/// SGLang's `text` / `input_ids`, then `messages` (chat), else a completion.
///
/// # Errors
/// [`ProxyError::MalformedJson`] when the body is not JSON.
pub(crate) fn route_of(given: Option<Route>, body: &[u8]) -> Result<Route, ProxyError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
    Ok(if let Some(route) = given {
        route
    } else if v.get("text").is_some() || v.get("input_ids").is_some() {
        Route::Generate
    } else if v.get("messages").is_some() {
        Route::ChatCompletions
    } else {
        Route::Completions
    })
}

fn exclusion(e: Exclusion) -> Value {
    match e {
        Exclusion::CoolingDown(class) => json!({"reason": e.as_str(), "class": class.as_str()}),
        Exclusion::BoundedLoad { cap } => json!({"reason": e.as_str(), "cap": cap}),
        _ => json!({"reason": e.as_str()}),
    }
}

fn candidate(c: &Candidate, registry: &Registry) -> Value {
    json!({
        "worker": registry.name(c.holder.worker).unwrap_or_else(|| c.holder.worker.to_string()),
        "rank": c.holder.rank.0,
        "matched_tokens": c.matched_tokens,
        "affinity_tokens": c.affinity_tokens,
        "prefill_tokens": c.prefill_tokens,
        "active_requests": c.active_requests,
        "booked_requests": c.booked_requests,
        "queue_latency_ms": c.queue_latency_ms,
        "queue_tokens": c.queue_tokens,
        "pending_tokens": c.pending_tokens,
        "prefill_tokens_per_sec": c.rate_tokens_per_sec,
        "est_ttft_ms": c.est_ttft_ms,
        "load_reported": c.load_reported,
        "kv_usage": c.kv_usage,
        "kv_blocks": c.kv_blocks,
        "kv_committed_blocks": c.kv_committed,
        "ledger": c.ledger.as_str(),
        "score": {"affinity": c.score.affinity, "load": c.score.load, "queue": c.score.queue, "total": c.score.total},
        "excluded": c.excluded.map(exclusion),
    })
}

/// `POST /debug/route`: what the request would get. `candidates` are the admissible holders in
/// rank order (the first is the one a real request books; with a pinned rank, only that rank's);
/// `excluded` the holders that may not take it, with why.
pub(crate) fn route(e: &Explanation, registry: &Registry) -> Value {
    let r = &e.ranking;
    let (prompt_tokens, blocks, decided) = match &e.plan {
        Ok(p) => (Some(p.prompt_tokens), p.seq.len(), Value::Null),
        Err(err) => (None, 0, Value::String(err.to_string())),
    };
    // The plan's candidates, in the fully sorted ranking's order (the plan orders only the first
    // `cortex_sched::RANKED`, which are the same).
    let pinned = |c: &&Candidate| e.pinned.is_none_or(|p| c.holder.rank == p);
    let candidates: Vec<Value> = match &e.plan {
        Ok(_) => r.admissible().filter(pinned).map(|c| candidate(c, registry)).collect(),
        Err(_) => Vec::new(),
    };
    let not_pinned = r.admissible().filter(|c| e.pinned.is_some_and(|p| c.holder.rank != p));
    let excluded: Vec<Value> = r
        .excluded()
        .map(|c| candidate(c, registry))
        .chain(not_pinned.map(|c| {
            let mut v = candidate(c, registry);
            v["excluded"] = json!({"reason": "not_the_pinned_rank"});
            v
        }))
        .collect();
    json!({
        "model": e.model.base_model(),
        "lora": e.model.lora(),
        "prompt_tokens": prompt_tokens,
        "tokenized": e.untrusted.is_none(),
        "tokenization": e.untrusted.as_ref().map(|(_, why)| why),
        "blocks": blocks,
        "pinned_rank": e.pinned.map(|p| p.0),
        "decided": decided,
        "mode": r.mode().as_str(),
        "reason": r.reason().map(|x| x.as_str()),
        "policy": r.policy().as_str(),
        "cache_hit_tokens": e.plan.as_ref().ok().and_then(|p| p.candidates.first().map(|c| c.matched_tokens.min(p.max_hit()))).unwrap_or(0),
        "candidates": candidates,
        "excluded": excluded,
    })
}

fn facts(f: &WorkerFacts) -> Value {
    json!({
        "engine": f.engine.map(|e| e.as_str()),
        "model": f.model,
        "block_size": f.block_size,
        "hash_algo": f.hash_algo.map(|a| a.as_str()),
        "bigram": f.bigram.map(|b| b == Bigram::On),
        "tokens_agree": f.tokens_agree,
    })
}

const fn health(h: Health) -> &'static str {
    match h {
        Health::Healthy => "healthy",
        Health::Unhealthy => "unhealthy",
        Health::Draining => "draining",
    }
}

/// A holder's errors of estimated time to first token (see
/// [`cortex_sched::WorkerState::estimate_errors`]): quantiles, the mean signed error, and each
/// histogram's non-empty buckets as `[index, count]` (bucket `i ≥ 1` ends at
/// `first·2^(i/4)`), so that holders and replicas can be merged.
fn estimate_error(e: &cortex_sched::EstimateErrors) -> Value {
    let ms = |q: f64| e.abs_s.quantile(q).map(|s| s * 1e3);
    let buckets = |h: &cortex_sched::LogHistogram| h.sparse().map(|(i, c)| json!([i, c])).collect::<Vec<_>>();
    json!({
        "samples": e.count(),
        "abs_p50_ms": ms(0.5),
        "abs_p90_ms": ms(0.9),
        "relative_p50": e.relative.quantile(0.5),
        "relative_p90": e.relative.quantile(0.9),
        "mean_signed_ms": e.sum_signed_s * 1e3 / e.count().max(1) as f64,
        "abs_buckets": {"first_ms": e.abs_s.upper(0) * 1e3, "counts": buckets(&e.abs_s)},
        "relative_buckets": {"first": e.relative.upper(0), "counts": buckets(&e.relative)},
    })
}

/// `GET /debug/workers` (and `GET /admin/workers`).
pub(crate) fn workers(c: &Control) -> Value {
    let snap = c.cluster().load();
    let now = c.clock().now();
    let ledger = c.ledger();
    let mut workers: Vec<Value> = c
        .registry()
        .snapshot()
        .values()
        .map(|w| {
            let s = w.status();
            let entry = snap.worker(w.id);
            let alignment = match &s.alignment {
                Alignment::Confirmed => json!({"verdict": "confirmed"}),
                Alignment::Unconfirmed(f) => json!({"verdict": "unconfirmed", "fields": f}),
                Alignment::Mismatch(m) => json!({"verdict": "mismatch",
                    "mismatches": m.iter().map(ToString::to_string).collect::<Vec<_>>()}),
            };
            let ranks: Vec<Value> = (0..w.dp_size())
                .map(|r| {
                    let rank = DpRank(r);
                    let holder = HolderId::new(w.id, rank);
                    let load = entry.and_then(|e| e.state().rank_load(rank, now));
                    json!({
                        "rank": r,
                        "ledger": c.holder_state(w.id, rank).as_str(),
                        "events": s.sources.iter().find(|e| e.rank == rank).map(|e| json!({"publish": e.publish, "replay": e.replay, "topic": e.topic})),
                        "ledger_blocks": ledger.dump(holder).map(|d| d.blocks.len()),
                        "booked_requests": load.map(|l| l.booked_requests),
                        "learned": load.map(|l| json!({
                            "prefill_tokens_per_sec": l.estimate.rate(),
                            "overhead_ms": l.estimate.overhead_s * 1e3,
                            "samples": entry.map_or(0, |e| e.state().learned_samples(rank)),
                            "estimate_error": entry.and_then(|e| e.state().estimate_errors(rank)).filter(|e| e.count() > 0).map(|e| estimate_error(&e)),
                        })),
                        "engine": load.and_then(|l| l.engine).map(|(e, age)| json!({"running": e.running, "waiting": e.waiting, "waiting_prefill_tokens": e.waiting_prefill_tokens, "kv_usage": e.kv_usage, "age_ms": age.as_millis()})),
                    })
                })
                .collect();
            json!({
                "id": w.id.0,
                "name": w.config.name,
                "url": w.config.url,
                "engine": w.config.engine.as_str(),
                "model": w.config.model,
                "role": w.config.role.as_str(),
                "phase": s.phase.as_str(),
                "health": entry.map(|e| health(e.health())),
                "profile": alignment,
                "continuous_verdict": match c.verdict(w.id) {
                    Verdict::Misaligned(why) => json!({"verdict": "misaligned", "reason": why}),
                    v => json!({"verdict": v.as_str()}),
                },
                "facts": facts(&s.facts),
                "capacity_blocks": s.capacity_blocks,
                "max_running_requests": {"value": s.max_running.value, "source": s.max_running.source.as_str()},
                "last_error": s.last_error,
                "cooldown": entry.and_then(|e| e.state().cooldown(now)).map(|(class, _)| class.as_str()),
                "ranks": ranks,
            })
        })
        .collect();
    workers.sort_by_key(|w| w["id"].as_u64());
    let stats = ledger.stats();
    let models = c.models();
    let profiles: Vec<Value> = models
        .names()
        .filter_map(|n| models.get(Some(n)).map(|m| (n, m)))
        .map(|(n, m)| json!({"name": n, "fingerprint": m.spec().profile.fingerprint(), "block_size": m.block_size()}))
        .collect();
    json!({
        "mode": match c.mode() { Mode::Route => "route", Mode::ProxyOnly => "proxy_only" },
        "models": profiles,
        "workers": workers,
        "ledger": {"live_bytes": stats.live_bytes, "blocks": stats.blocks, "countable_blocks": stats.countable_blocks, "orphans": stats.orphans, "holders": stats.holders},
    })
}
