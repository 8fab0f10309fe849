//! Calls Cortex makes to every worker on a client's behalf: `GET /v1/models` (what the live
//! workers serve) and the admin API's cache flush (`POST /admin/cache/flush`).
//!
//! Key decisions: the answers are the workers' own, never the configuration's — `/v1/models`
//! lists the models and adapters live workers report that Cortex routes, and the flush reports
//! each worker's status and answer as given (SGLang refuses with 400 while requests run; vLLM
//! serves `/reset_prefix_cache` only in its dev mode), with the ledger's block count before and
//! after, so an operator sees what happened rather than a summary. Every worker is asked at
//! once, each within the probe timeout.

use std::collections::HashSet;
use std::sync::Arc;

use cortex_hash::Engine;
use cortex_hash::kv::{DpRank, HolderId};
use http::{Method, StatusCode};
use serde_json::{Value, json};

use crate::control::Control;
use crate::error::ProxyError;
use crate::registry::{Phase, WorkerRecord};

/// `GET /v1/models`: the entries of the live workers' own `/v1/models` whose `id` is a model or
/// adapter Cortex routes, once each, in the configuration's order.
pub(crate) async fn models(c: &Control) -> Value {
    let live: Vec<Arc<WorkerRecord>> =
        c.registry().snapshot().values().filter(|w| w.status().phase == Phase::Live).cloned().collect();
    let answers = futures_util::future::join_all(
        live.iter().map(|w| c.http().call(w, Method::GET, "/v1/models", None)),
    )
    .await;
    let mut served: Vec<Value> = Vec::new();
    let mut seen = HashSet::new();
    for (status, body) in answers.into_iter().flatten() {
        if !status.is_success() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(&body) else { continue };
        for entry in v["data"].as_array().into_iter().flatten() {
            let Some(id) = entry["id"].as_str() else { continue };
            if c.models().get(Some(id)).is_some() && seen.insert(id.to_owned()) {
                served.push(entry.clone());
            }
        }
    }
    let order: Vec<&str> = c.models().names().collect();
    served.sort_by_key(|e| order.iter().position(|n| Some(*n) == e["id"].as_str()));
    json!({"object": "list", "data": served})
}

/// The route that flushes an engine's prefix cache.
const fn flush_path(engine: Engine) -> &'static str {
    match engine {
        Engine::Sglang => "/flush_cache",
        _ => "/reset_prefix_cache",
    }
}

/// What an answer means, when the engine's documentation says more than its status.
fn flush_note(engine: Engine, status: StatusCode) -> Option<&'static str> {
    match (engine, status.as_u16()) {
        (Engine::Sglang, 400) => Some(
            "SGLang flushes only when no request is running or waiting; nothing was flushed: retry when the worker is idle",
        ),
        (Engine::Vllm, 404 | 405) => Some(
            "vLLM serves /reset_prefix_cache only in its dev mode (VLLM_SERVER_DEV_MODE=1); this worker does not",
        ),
        (Engine::Vllm, 400 | 500) => Some("vLLM refused the reset, usually because requests are running"),
        _ => None,
    }
}

/// How long a flush's answer waits for the flushed workers' clear events to reach the ledger.
const FLUSH_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// `POST /admin/cache/flush[?worker=NAME]`: every worker (or the one named) asked to flush its
/// prefix cache; what each answered, and the ledger's blocks before and after: once the workers
/// that flushed hold no block in the ledger (their clear events applied), or [`FLUSH_SETTLE`]
/// after their answers (`cleared` says which).
///
/// # Errors
/// [`ProxyError::UnknownWorker`] when `worker` names no worker.
pub(crate) async fn flush(c: &Control, worker: Option<&str>) -> Result<Value, ProxyError> {
    let mut targets: Vec<Arc<WorkerRecord>> = c
        .registry()
        .snapshot()
        .values()
        .filter(|w| worker.is_none_or(|n| w.config.name == n))
        .cloned()
        .collect();
    if let (Some(name), true) = (worker, targets.is_empty()) {
        return Err(ProxyError::UnknownWorker(name.to_owned()));
    }
    targets.sort_by_key(|w| w.id.0);
    let before = c.ledger().stats().blocks;
    let answers = futures_util::future::join_all(
        targets.iter().map(|w| c.http().call(w, Method::POST, flush_path(w.config.engine), None)),
    )
    .await;
    let mut flushed = 0;
    let workers: Vec<Value> = targets
        .iter()
        .zip(answers)
        .map(|(w, answer)| {
            let engine = w.config.engine;
            let mut v = json!({
                "worker": w.config.name,
                "engine": engine.as_str(),
                "route": flush_path(engine),
            });
            match answer {
                Ok((status, body)) => {
                    flushed += usize::from(status.is_success());
                    v["status"] = json!(status.as_u16());
                    v["flushed"] = json!(status.is_success());
                    v["answer"] = json!(String::from_utf8_lossy(&body[..body.len().min(2048)]).trim());
                    if let Some(note) = flush_note(engine, status) {
                        v["note"] = json!(note);
                    }
                }
                Err(e) => {
                    v["status"] = Value::Null;
                    v["flushed"] = json!(false);
                    v["answer"] = json!(e);
                }
            }
            v
        })
        .collect();
    // The ledger empties as the flushed workers' clear events arrive, a moment after their
    // answers.
    let holders: Vec<HolderId> = targets
        .iter()
        .zip(&workers)
        .filter(|(_, v)| v["flushed"] == true)
        .flat_map(|(w, _)| (0..w.dp_size()).map(|r| HolderId::new(w.id, DpRank(r))))
        .collect();
    let emptied = || holders.iter().all(|h| c.ledger().held_blocks(*h).unwrap_or(0) == 0);
    let deadline = tokio::time::Instant::now() + FLUSH_SETTLE;
    while !emptied() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(json!({
        "flushed": flushed,
        "workers": workers,
        "ledger": {"blocks_before": before, "blocks_after": c.ledger().stats().blocks, "cleared": emptied()},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engine_s_refusal_is_explained() {
        assert!(flush_note(Engine::Sglang, StatusCode::BAD_REQUEST).unwrap().contains("running"));
        assert!(flush_note(Engine::Vllm, StatusCode::NOT_FOUND).unwrap().contains("VLLM_SERVER_DEV_MODE"));
        assert_eq!(flush_note(Engine::Sglang, StatusCode::OK), None);
        assert_eq!(
            (flush_path(Engine::Sglang), flush_path(Engine::Vllm)),
            ("/flush_cache", "/reset_prefix_cache")
        );
    }
}
