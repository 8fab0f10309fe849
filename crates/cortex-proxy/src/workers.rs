//! Worker lifecycle: registration with discovery and an alignment probe, health probing, load
//! polling, leaving and rejoining the live pool, and keeping the scheduler's view of each
//! holder's ledger state current.
//!
//! Key decisions:
//! - At registration every fact that decides block identity is read from the worker itself
//!   (SGLang `/server_info`; vLLM `/kv_event_sources` and `vllm:cache_config_info`) and a fixed
//!   probe conversation is tokenized by both sides. Any disagreement with the configured profile
//!   — or a fact that could not be read — turns exact routing off for that worker, with the
//!   reason in logs, metrics and `/debug/workers`; the worker still takes load-routed traffic.
//! - A worker whose probes fail leaves the live pool first, then the event plane drops its
//!   subscription and its ledger entries (no late event can be applied); when it comes back it
//!   is discovered again and its ledger starts SYNCING.
//! - SGLang's `/health` runs a generation; the cheap `/ready` is probed instead.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cortex_hash::Engine;
use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::profile::{Alignment, WorkerFacts};
use cortex_radix::Readiness;
use cortex_sched::{Capacity, Health, LedgerState, WorkerSpec};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use crate::alignment::Verdict;
use crate::config::Mode;
use crate::error::ProxyError;
use crate::gateway::Gateway;
use crate::registry::{
    self, EventSource, Phase, RankEndpoints, RegistryError, RegistryEvent, WorkerConfig, WorkerRecord,
};
use crate::request::Prompt;

/// The fixed conversation both sides tokenize at registration.
fn probe_conversation() -> Value {
    json!([
        {"role": "system", "content": "You are the alignment probe of the Cortex gateway."},
        {"role": "user", "content": "Reply with one word: is 2 + 2 = 4? Zürich, 東京, emoji 🦙."}
    ])
}

/// What discovery learned.
struct Discovery {
    facts: WorkerFacts,
    dp_size: u16,
    sources: Vec<RankEndpoints>,
    capacity_blocks: u32,
}

impl Gateway {
    /// Registers a worker and starts discovering and probing it in the background.
    ///
    /// # Errors
    /// [`ProxyError::InvalidRequest`] for a bad URL, a duplicate name or a model not served.
    pub fn add_worker(self: &Arc<Self>, config: WorkerConfig) -> Result<WorkerId, ProxyError> {
        if self.models.get(Some(&config.model)).is_none() {
            return Err(ProxyError::InvalidRequest(format!(
                "worker `{}` serves `{}`, which is not a configured model",
                config.name, config.model
            )));
        }
        let record = self
            .registry
            .add(config)
            .map_err(|e: RegistryError| ProxyError::InvalidRequest(e.to_string()))?;
        let id = record.id;
        let gw = Arc::clone(self);
        let task = tokio::spawn(async move { gw.worker_task(record).await });
        self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id, task.abort_handle());
        Ok(id)
    }

    /// Removes a worker: out of the pool, its events unfollowed, its ledger entries dropped.
    /// Returns false if no such worker.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        if let Some(task) = self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id) {
            task.abort();
        }
        let existed = self.registry.remove(id).is_some();
        self.cluster.remove(id);
        let _ = self.events.send(RegistryEvent::Unfollow(id));
        self.alignment.forget(id);
        existed
    }

    /// Starts the background loop that mirrors each holder's ledger readiness (and alignment)
    /// into the scheduler's worker state.
    pub fn start_background(self: &Arc<Self>) {
        let gw = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                let Some(gw) = gw.upgrade() else { return };
                if gw.is_shutting_down() {
                    return;
                }
                gw.sync_ledger_states();
            }
        });
    }

    /// The ledger state the scheduler should see for a holder.
    pub(crate) fn holder_state(&self, id: WorkerId, rank: DpRank) -> LedgerState {
        let Some(w) = self.registry.get(id) else { return LedgerState::Disabled };
        let status = w.status();
        let aligned = matches!(status.alignment, Alignment::Confirmed)
            && !matches!(self.alignment.verdict(id), Verdict::Misaligned(_));
        if !aligned || status.sources.is_empty() || self.cfg.mode == Mode::ProxyOnly {
            return LedgerState::Disabled;
        }
        match self.ledger.readiness(HolderId::new(id, rank)) {
            Some(Readiness::Ready) => LedgerState::Ready,
            Some(Readiness::Syncing) => LedgerState::Syncing,
            Some(Readiness::Stale) => LedgerState::Stale,
            None => LedgerState::Syncing,
        }
    }

    /// Pushes every live holder's ledger state into the scheduler.
    pub fn sync_ledger_states(&self) {
        let snap = self.cluster.load();
        for w in self.registry.snapshot().values() {
            let Some(entry) = snap.worker(w.id) else { continue };
            for r in 0..w.dp_size() {
                let rank = DpRank(r);
                entry.state().set_ledger(rank, self.holder_state(w.id, rank));
            }
        }
    }

    async fn worker_task(self: Arc<Self>, w: Arc<WorkerRecord>) {
        let probes = self.cfg.probes;
        loop {
            // Discover until it works.
            let discovery = loop {
                match self.discover(&w).await {
                    Ok(d) => break d,
                    Err(e) => {
                        tracing::warn!(worker = %w.config.name, error = %e, "discovery failed; retrying");
                        w.update(|s| s.last_error = Some(e));
                        tokio::time::sleep(probes.health_interval).await;
                    }
                }
            };
            self.go_live(&w, discovery);
            self.live_loop(&w).await;
            // Down: out of the pool, events unfollowed, ledger pruned.
            self.cluster.set_health(w.id, Health::Unhealthy);
            let _ = self.events.send(RegistryEvent::Unfollow(w.id));
            self.alignment.forget(w.id);
            w.update(|s| s.phase = Phase::Down);
            tracing::warn!(worker = %w.config.name, "worker left the live pool");
            // Wait until it answers again, then rediscover (its ledger starts SYNCING).
            let mut ok = 0;
            while ok < probes.successes_to_restore {
                tokio::time::sleep(probes.health_interval).await;
                ok = if self.health_probe(&w).await { ok + 1 } else { 0 };
            }
            tracing::info!(worker = %w.config.name, "worker answers again; rediscovering");
        }
    }

    fn go_live(&self, w: &Arc<WorkerRecord>, d: Discovery) {
        let model = self.models.get(Some(&w.config.model));
        let alignment = match model {
            Some(m) => m.spec().profile.check(&d.facts),
            None => Alignment::Unconfirmed(vec!["model"]),
        };
        match &alignment {
            Alignment::Confirmed => {
                tracing::info!(worker = %w.config.name, "profile confirmed: exact routing on")
            }
            Alignment::Unconfirmed(fields) => {
                tracing::warn!(worker = %w.config.name, ?fields, "profile unconfirmed: exact routing off")
            }
            Alignment::Mismatch(m) => {
                let reasons: Vec<String> = m.iter().map(ToString::to_string).collect();
                tracing::warn!(worker = %w.config.name, reasons = %reasons.join("; "), "profile mismatch: exact routing off")
            }
        }
        let content_deterministic = model.is_some_and(|m| m.spec().profile.recipe().content_deterministic());
        w.update(|s| {
            s.phase = Phase::Live;
            s.dp_size = d.dp_size;
            s.facts = d.facts.clone();
            s.alignment = alignment.clone();
            s.sources = d.sources.clone();
            s.capacity_blocks = d.capacity_blocks;
            s.last_error = None;
        });
        let mut spec = WorkerSpec::new(w.id, w.config.model.clone(), w.config.engine);
        spec.role = w.config.role;
        spec.dp_size = d.dp_size;
        spec.capacity = Capacity {
            kv_blocks: d.capacity_blocks,
            prefill_tokens_per_sec: self.cfg.prefill_tokens_per_sec,
            ..Capacity::default()
        };
        spec.labels = vec![("name".into(), w.config.name.clone()), ("url".into(), w.config.url.clone())];
        self.cluster.upsert(spec, Health::Healthy);
        if self.cfg.mode == Mode::Route && !d.sources.is_empty() {
            let sources = d
                .sources
                .iter()
                .map(|e| EventSource {
                    holder: HolderId::new(w.id, e.rank),
                    engine: w.config.engine,
                    model: w.config.model.clone(),
                    endpoints: e.clone(),
                    capacity_blocks: d.capacity_blocks.max(1),
                    content_deterministic,
                    unlabeled_stores_unknown: w.config.unlabeled_stores_unknown,
                })
                .collect();
            let _ = self.events.send(RegistryEvent::Follow(sources));
        }
        self.sync_ledger_states();
    }

    /// Probes health and polls load until the worker fails `failures_to_remove` health probes in
    /// a row (or the task is aborted).
    async fn live_loop(&self, w: &Arc<WorkerRecord>) {
        let probes = self.cfg.probes;
        let mut health = tokio::time::interval(probes.health_interval);
        let mut load = tokio::time::interval(probes.load_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        load.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0;
        loop {
            tokio::select! {
                _ = health.tick() => {
                    if self.health_probe(w).await {
                        failures = 0;
                    } else {
                        failures += 1;
                        if failures >= probes.failures_to_remove {
                            return;
                        }
                    }
                }
                _ = load.tick() => self.poll_load(w).await,
            }
        }
    }

    async fn get(&self, w: &WorkerRecord, path: &str) -> Result<(StatusCode, Bytes), String> {
        self.call(w, Method::GET, path, None).await
    }

    async fn call(
        &self,
        w: &WorkerRecord,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Bytes), String> {
        let uri = crate::upstream::worker_uri(&w.base, path).map_err(|e| e.to_string())?;
        let mut req = Request::new(Full::new(body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()))));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        req.headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        let timeout = self.cfg.probes.timeout;
        let fut = async {
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), 8 << 20)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("{path}: no answer within {timeout:?}"))?
    }

    async fn get_json(&self, w: &WorkerRecord, path: &str) -> Result<Value, String> {
        let (status, body) = self.get(w, path).await?;
        if !status.is_success() {
            return Err(format!("{path} answered {status}"));
        }
        serde_json::from_slice(&body).map_err(|e| format!("{path}: not JSON: {e}"))
    }

    async fn health_probe(&self, w: &WorkerRecord) -> bool {
        let path = match w.config.engine {
            Engine::Sglang => "/ready",
            _ => "/health",
        };
        matches!(self.get(w, path).await, Ok((s, _)) if s.is_success())
    }

    async fn poll_load(&self, w: &WorkerRecord) {
        let loads = match w.config.engine {
            Engine::Sglang => match self.get_json(w, "/v1/loads").await {
                Ok(v) => registry::parse_sglang_loads(&v),
                Err(_) => return,
            },
            _ => match self.get(w, "/metrics").await {
                Ok((s, body)) if s.is_success() => {
                    registry::parse_vllm_metrics(&String::from_utf8_lossy(&body)).loads
                }
                _ => return,
            },
        };
        let snap = self.cluster.load();
        let Some(entry) = snap.worker(w.id) else { return };
        let now = self.clock.now();
        for (rank, load) in loads {
            entry.state().report_load(rank, load, now);
            // Queued requests count too: an engine with work and no events is suspicious.
            let busy = u64::from(load.running) + u64::from(load.waiting);
            let _ = self.events.send(RegistryEvent::Running(HolderId::new(w.id, rank), busy));
        }
    }

    async fn discover(&self, w: &WorkerRecord) -> Result<Discovery, String> {
        let mut d = match w.config.engine {
            Engine::Sglang => {
                let v = self.get_json(w, "/server_info").await?;
                let info = registry::parse_server_info(&v, &w.host);
                Discovery {
                    facts: info.facts,
                    dp_size: info.dp_size,
                    sources: info.sources,
                    capacity_blocks: info.capacity_blocks,
                }
            }
            _ => {
                let (status, metrics) = self.get(w, "/metrics").await?;
                if !status.is_success() {
                    return Err(format!("/metrics answered {status}"));
                }
                let m = registry::parse_vllm_metrics(&String::from_utf8_lossy(&metrics));
                let sources = match self.get_json(w, "/kv_event_sources").await {
                    Ok(v) => registry::parse_kv_event_sources(&v, &w.host),
                    Err(e) => {
                        tracing::info!(worker = %w.config.name, error = %e, "no /kv_event_sources (vLLM < 0.31?)");
                        Vec::new()
                    }
                };
                let served = self
                    .get_json(w, "/v1/models")
                    .await
                    .ok()
                    .and_then(|v| v["data"][0]["id"].as_str().map(str::to_owned));
                Discovery {
                    facts: WorkerFacts {
                        engine: Some(Engine::Vllm),
                        model: served,
                        block_size: m.block_size,
                        hash_algo: m.hash_algo,
                        bigram: None,
                        tokens_agree: None,
                    },
                    dp_size: u16::try_from(sources.len().max(1)).unwrap_or(1),
                    sources,
                    capacity_blocks: m.num_gpu_blocks.unwrap_or(0),
                }
            }
        };
        if let Some(o) = &w.config.events {
            d.dp_size = o.dp_size.max(1);
            d.sources = (0..d.dp_size)
                .map(|r| RankEndpoints {
                    rank: DpRank(r),
                    publish: format!("tcp://{}:{}", w.host, u32::from(o.publish_port_base) + u32::from(r)),
                    replay: o
                        .replay_port_base
                        .map(|p| format!("tcp://{}:{}", w.host, u32::from(p) + u32::from(r))),
                    topic: o.topic.clone(),
                })
                .collect();
        }
        d.facts.tokens_agree = self.tokens_probe(w).await;
        Ok(d)
    }

    /// Tokenizes the probe conversation on both sides: exact ids through `/tokenize`, else the
    /// prompt length of a one-token chat completion. `None` when neither answers.
    async fn tokens_probe(&self, w: &WorkerRecord) -> Option<bool> {
        let model = Arc::clone(self.models.get(Some(&w.config.model))?);
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), probe_conversation());
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        let ours = tokio::task::spawn_blocking(move || model.tokens(&Prompt::Chat(ctx))).await.ok()?.ok()?;
        let body =
            json!({"model": w.config.model, "messages": probe_conversation(), "add_generation_prompt": true});
        if let Ok((s, b)) = self.call(w, Method::POST, "/tokenize", Some(body)).await
            && s.is_success()
            && let Ok(v) = serde_json::from_slice::<Value>(&b)
            && let Some(tokens) = v.get("tokens").and_then(Value::as_array)
        {
            let theirs: Vec<u64> = tokens.iter().filter_map(Value::as_u64).collect();
            let agree =
                theirs.len() == ours.len() && theirs.iter().zip(&ours).all(|(a, b)| *a == u64::from(*b));
            return Some(agree);
        }
        let body = json!({"model": w.config.model, "messages": probe_conversation(), "max_tokens": 1, "stream": false});
        let (s, b) = self.call(w, Method::POST, "/v1/chat/completions", Some(body)).await.ok()?;
        if !s.is_success() {
            return None;
        }
        let v: Value = serde_json::from_slice(&b).ok()?;
        let n = v.get("usage")?.get("prompt_tokens")?.as_u64()?;
        Some(n == ours.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_is_a_conversation() {
        let p = probe_conversation();
        assert_eq!(p.as_array().map(Vec::len), Some(2));
    }
}
