//! `/debug/route` (a dry run that explains a decision) and `/debug/workers` (the registry, each
//! worker's profile verdict, ledger state and counts).
//!
//! Key decision: the dry run goes through exactly the request path's planning (tokenize, hash,
//! query, decide) and stops before booking, so what it shows is what a real request would get.

use std::sync::Arc;

use cortex_hash::kv::DpRank;
use cortex_hash::profile::Alignment;
use cortex_sched::{CacheView, Ranking, Request as SchedRequest, Role, Untrusted};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::config::Mode;
use crate::error::{Body, ProxyError};
use crate::gateway::{Gateway, json_response};
use crate::request::{self, Route};

impl Gateway {
    /// `POST /debug/route`: the body of a chat, completion or `/generate` request; answers the
    /// ranked candidates with their score breakdown and the excluded holders with why.
    pub(crate) async fn debug_route(
        self: &Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, ProxyError> {
        let query = req.uri().query().unwrap_or_default().to_owned();
        let body = self.read_body(req.into_body()).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
        let route =
            if query.contains("route=generate") || v.get("text").is_some() || v.get("input_ids").is_some() {
                Route::Generate
            } else if v.get("messages").is_some() {
                Route::ChatCompletions
            } else {
                Route::Completions
            };
        let facts = Arc::new(request::parse(route, &body)?);
        let model = Arc::clone(self.models.get(facts.model.as_deref()).ok_or_else(|| {
            ProxyError::UnknownModel(facts.model.clone().unwrap_or_else(|| "(none given)".into()))
        })?);
        let (m, f) = (Arc::clone(&model), Arc::clone(&facts));
        let tokens = if self.cfg.mode == Mode::ProxyOnly {
            Err(("proxy-only mode".to_owned(), Untrusted::ExactRoutingOff))
        } else {
            tokio::task::spawn_blocking(move || m.tokens(&f.prompt))
                .await
                .map_err(|e| (e.to_string(), Untrusted::TokenizerFailed))
                .and_then(|r| r.map_err(|e| (e.to_string(), crate::gateway::untrusted_for(&e))))
        };
        let mut seq = Vec::new();
        let untrusted = match &tokens {
            Ok(t) => model
                .seq_hashes(t, facts.cache_salt.as_deref(), &mut seq)
                .err()
                .map(|_| Untrusted::ExactRoutingOff),
            Err((_, u)) => Some(*u),
        };
        let mut overlap = cortex_radix::OverlapScores::with_capacity(16);
        let cache = match untrusted {
            Some(u) => CacheView::Untrusted(u),
            None => {
                self.ledger.query(&seq, cortex_radix::QueryOptions::default(), &mut overlap);
                CacheView::Overlap { scores: &overlap, block_tokens: model.block_size() }
            }
        };
        let prompt_tokens = tokens.as_ref().map_or(0, Vec::len);
        let snap = self.cluster.load();
        let mut ranking = Ranking::with_capacity(16);
        let req = SchedRequest {
            model: model.base_model(),
            role: Role::Regular,
            now: self.clock.now(),
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            cache,
            routing_key: None,
            prefix: &seq,
        };
        let decided = self.sched.decide(&snap, &req, &mut ranking);
        ranking.sort_all();
        let name = |id| self.registry.get(id).map_or_else(|| format!("w{}", id.0), |w| w.config.name.clone());
        let cand = |c: &cortex_sched::Candidate| {
            json!({
                "worker": name(c.holder.worker),
                "rank": c.holder.rank.0,
                "matched_tokens": c.matched_tokens,
                "affinity_tokens": c.affinity_tokens,
                "prefill_tokens": c.prefill_tokens,
                "active_requests": c.active_requests,
                "booked_requests": c.booked_requests,
                "queue_latency_ms": c.queue_latency_ms,
                "ledger": c.ledger.as_str(),
                "score": format!("{:?}", c.score),
                "excluded": c.excluded.map(|e| format!("{e:?}")),
            })
        };
        let body = json!({
            "model": model.base_model(),
            "lora": model.lora(),
            "prompt_tokens": prompt_tokens,
            "blocks": seq.len(),
            "tokenization": tokens.as_ref().err().map(|(why, _)| why),
            "decided": decided.as_ref().err().map(ToString::to_string),
            "mode": ranking.mode().as_str(),
            "reason": ranking.reason().map(|r| r.as_str()),
            "policy": format!("{:?}", ranking.policy()),
            "cache_hit_tokens": ranking.cache_hit_tokens(),
            "candidates": ranking.admissible().map(cand).collect::<Vec<_>>(),
            "excluded": ranking.excluded().map(cand).collect::<Vec<_>>(),
        });
        Ok(json_response(StatusCode::OK, &body))
    }

    /// `GET /debug/workers`.
    pub(crate) fn debug_workers(&self) -> Value {
        let snap = self.cluster.load();
        let now = self.clock.now();
        let mut workers: Vec<Value> = self
            .registry
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
                let verdict = self.alignment.verdict(w.id);
                let ranks: Vec<Value> = (0..w.dp_size())
                    .map(|r| {
                        let rank = DpRank(r);
                        let holder = cortex_hash::kv::HolderId::new(w.id, rank);
                        let load = entry.and_then(|e| e.state().rank_load(rank, now));
                        json!({
                            "rank": r,
                            "ledger": self.holder_state(w.id, rank).as_str(),
                            "events": s.sources.iter().find(|e| e.rank == rank).map(|e| json!({"publish": e.publish, "replay": e.replay, "topic": e.topic})),
                            "ledger_blocks": self.ledger.dump(holder).map(|d| d.blocks.len()),
                            "booked_requests": load.map(|l| l.booked_requests),
                            "engine": load.and_then(|l| l.engine).map(|(e, age)| json!({"running": e.running, "waiting": e.waiting, "kv_usage": e.kv_usage, "age_ms": age.as_millis()})),
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
                    "health": entry.map(|e| format!("{:?}", e.health())),
                    "profile": alignment,
                    "continuous_verdict": match &verdict {
                        crate::alignment::Verdict::Misaligned(why) => json!({"verdict": "misaligned", "reason": why}),
                        v => json!({"verdict": v.as_str()}),
                    },
                    "facts": format!("{:?}", s.facts),
                    "capacity_blocks": s.capacity_blocks,
                    "last_error": s.last_error,
                    "cooldown": entry.and_then(|e| e.state().cooldown(now)).map(|(c, _)| c.as_str()),
                    "ranks": ranks,
                })
            })
            .collect();
        workers.sort_by_key(|w| w["id"].as_u64());
        let ledger = self.ledger.stats();
        let profiles: Vec<Value> = self
            .models
            .names()
            .filter_map(|n| self.models.get(Some(n)).map(|m| (n, m)))
            .map(|(n, m)| json!({"name": n, "fingerprint": m.spec().profile.fingerprint(), "block_size": m.block_size()}))
            .collect();
        json!({
            "mode": format!("{:?}", self.cfg.mode),
            "models": profiles,
            "workers": workers,
            "ledger": {"live_bytes": ledger.live_bytes, "blocks": ledger.blocks, "countable_blocks": ledger.countable_blocks, "orphans": ledger.orphans, "holders": ledger.holders},
        })
    }
}
