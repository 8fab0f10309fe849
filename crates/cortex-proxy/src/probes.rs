//! Asking a worker over HTTP: discovery, the alignment probe, health probes and load polls. The
//! answers are parsed by [`crate::discovery`]; [`crate::control`] decides what they mean.
//!
//! Key decisions:
//! - Every fact that decides block identity is read from the worker itself (SGLang
//!   `/server_info`; vLLM `/kv_event_sources`, `vllm:cache_config_info` and `/v1/models`), and a
//!   fixed conversation is tokenized by both sides: exact ids through `/tokenize`, else the prompt
//!   length of a one-token chat completion.
//! - SGLang's `/health` runs a generation; the cheap `/ready` is probed instead.
//! - Every call has the probe timeout and reads at most 8 MiB.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cortex_hash::Engine;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use crate::discovery::{self, Discovery, RankReport};
use crate::models::ModelRoute;
use crate::registry::WorkerRecord;
use crate::request::Prompt;
use crate::upstream::{self, UpstreamClient};

/// The fixed conversation both sides tokenize at registration.
fn probe_conversation() -> Value {
    json!([
        {"role": "system", "content": "You are the alignment probe of the Cortex gateway."},
        {"role": "user", "content": "Reply with one word: is 2 + 2 = 4? Zürich, 東京, emoji 🦙."}
    ])
}

/// What a probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    /// The worker answered as a healthy worker does.
    Up,
    /// It answered otherwise, or not within the timeout.
    Down,
    /// Its address refused the connection: no process listens there.
    Refused,
}

/// A failed probe call.
#[derive(Debug)]
struct CallError {
    message: String,
    /// The connection was refused.
    refused: bool,
}

impl CallError {
    const fn other(message: String) -> Self {
        CallError { message, refused: false }
    }
}

/// Whether `e` is a refused connection (an `ECONNREFUSED` anywhere in its sources).
fn connection_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The HTTP side of probing workers.
#[derive(Debug)]
pub struct Probes {
    client: UpstreamClient,
    timeout: Duration,
}

impl Probes {
    /// Probes through `client`, each call within `timeout`.
    #[must_use]
    pub fn new(client: UpstreamClient, timeout: Duration) -> Self {
        Probes { client, timeout }
    }

    /// One call to `w` within the probe timeout: its status and (at most 8 MiB of) body.
    pub(crate) async fn call(
        &self,
        w: &WorkerRecord,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Bytes), String> {
        self.call_told(w, method, path, body).await.map_err(|e| e.message)
    }

    /// [`Self::call`], telling a refused connection apart.
    async fn call_told(
        &self,
        w: &WorkerRecord,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let uri = upstream::worker_uri(&w.base, path).map_err(|e| CallError::other(e.to_string()))?;
        let mut req = Request::new(Full::new(body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()))));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        req.headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        if let Some(key) = &w.api_key {
            key.apply(req.headers_mut());
        }
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| CallError { refused: connection_refused(&e), message: e.to_string() })?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), 8 << 20)
                .collect()
                .await
                .map_err(|e| CallError::other(e.to_string()))?
                .to_bytes();
            Ok::<_, CallError>((status, body))
        };
        let timeout = self.timeout;
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| CallError::other(format!("{path}: no answer within {timeout:?}")))?
    }

    async fn get(&self, w: &WorkerRecord, path: &str) -> Result<(StatusCode, Bytes), String> {
        self.call(w, Method::GET, path, None).await
    }

    /// The worker's health route: answered healthy, answered otherwise (or not in time), or
    /// refused (nothing listens on its address).
    pub async fn health(&self, w: &WorkerRecord) -> Probed {
        let path = match w.config.engine {
            Engine::Sglang => "/ready",
            _ => "/health",
        };
        match self.call_told(w, Method::GET, path, None).await {
            Ok((s, _)) if s.is_success() => Probed::Up,
            Ok((s, _)) => {
                // Why it is down, for `/debug/workers` (a worker key refused, above all).
                w.update(|st| st.last_error = Some(format!("{path} answered {s}{}", key_hint(w, s))));
                Probed::Down
            }
            Err(e) if e.refused => Probed::Refused,
            Err(e) => {
                w.update(|st| st.last_error = Some(e.message));
                Probed::Down
            }
        }
    }

    async fn get_ok(&self, w: &WorkerRecord, path: &str) -> Result<Bytes, String> {
        let (status, body) = self.get(w, path).await?;
        if !status.is_success() {
            return Err(format!("{path} answered {status}{}", key_hint(w, status)));
        }
        Ok(body)
    }

    async fn get_json(&self, w: &WorkerRecord, path: &str) -> Result<Value, String> {
        let body = self.get_ok(w, path).await?;
        serde_json::from_slice(&body).map_err(|e| format!("{path}: not JSON: {e}"))
    }

    /// Whether the worker answers its health route.
    pub async fn healthy(&self, w: &WorkerRecord) -> bool {
        self.health(w).await == Probed::Up
    }

    /// The worker's load per rank (SGLang `/v1/loads`, vLLM `/metrics`); `Err` when it did not
    /// answer (`Probed::Refused` when nothing listens on its address), `Ok(None)` when its answer
    /// is not a load report.
    pub async fn loads(&self, w: &WorkerRecord) -> Result<Option<Vec<RankReport>>, Probed> {
        let path = match w.config.engine {
            Engine::Sglang => "/v1/loads",
            _ => "/metrics",
        };
        let body = match self.call_told(w, Method::GET, path, None).await {
            Ok((s, body)) if s.is_success() => body,
            Ok(_) => return Ok(None),
            Err(e) => return Err(if e.refused { Probed::Refused } else { Probed::Down }),
        };
        Ok(match w.config.engine {
            Engine::Sglang => serde_json::from_slice(&body).ok().map(|v| discovery::sglang_loads(&v)),
            _ => Some(discovery::vllm_metrics(&String::from_utf8_lossy(&body)).loads),
        })
    }

    /// Everything discovery reads from the worker, the tokens probe included (with `model`, the
    /// route of the worker's model).
    ///
    /// # Errors
    /// What failed, for the worker's `last_error`: also a worker that cannot serve as configured
    /// (an SGLang `disaggregation_mode` contradicting its role, or a worker naming the models it
    /// serves without its configured one), which then stays out of the pool until a later
    /// discovery finds it right.
    pub async fn discover(
        &self,
        w: &WorkerRecord,
        model: Option<&Arc<ModelRoute>>,
    ) -> Result<Discovery, String> {
        let served: Vec<String>;
        let mut d = match w.config.engine {
            Engine::Sglang => {
                let d = discovery::sglang_server_info(&self.get_json(w, "/server_info").await?, &w.host);
                // SGLang answers whatever the request's `model` says: a worker named otherwise
                // still serves (a profile mismatch, routed by load), unlike vLLM's 404.
                served = Vec::new();
                d
            }
            _ => {
                let metrics = self.get_ok(w, "/metrics").await?;
                let metrics = discovery::vllm_metrics(&String::from_utf8_lossy(&metrics));
                let sources = match self.get_json(w, "/kv_event_sources").await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::info!(worker = %w.config.name, error = %e, "no /kv_event_sources (vLLM < 0.31?)");
                        None
                    }
                };
                served = match self.get_json(w, "/v1/models").await {
                    // Another engine on the configured one's port (restarted as SGLang): it would
                    // be followed and routed as vLLM.
                    Ok(v) => match discovery::vllm_engine_conflict(&v) {
                        Some(conflict) => return Err(conflict),
                        None => discovery::served_models(&v),
                    },
                    // A worker that refuses Cortex's requests cannot serve them: not a worker
                    // whose model is merely unconfirmed.
                    Err(e) if e.contains(" 401 ") || e.contains(" 403 ") => return Err(e),
                    Err(_) => Vec::new(),
                };
                // Under several names (`--served-model-name a b`), the configured one is the fact.
                let model = served.iter().find(|m| **m == w.config.model).or(served.first()).cloned();
                discovery::vllm_discovery(&metrics, sources.as_ref(), model, &w.host)
            }
        };
        if let Some(conflict) = d.pd.role_conflict(w.config.role) {
            return Err(conflict);
        }
        // It would refuse every request for the model (vLLM's 404), or answer them with another.
        if let Some(conflict) = discovery::model_conflict(&w.config.model, &served) {
            return Err(conflict);
        }
        if let Some(o) = &w.config.events {
            // An override of fewer (or more) ranks than the engine reports follows the wrong
            // sockets: the ranks left out are never followed, and a port may be another rank's.
            let reported = d.dp_size;
            if (reported > 1 || !d.sources.is_empty()) && reported != o.dp_size.max(1) {
                tracing::warn!(
                    worker = %w.config.name,
                    configured = o.dp_size,
                    reported,
                    "events override: its dp_size is not the number of data-parallel ranks the engine reports; \
                     the ranks it leaves out are not followed (check events.dp_size and publish_port_base)"
                );
            }
            discovery::apply_events_override(&mut d, o, &w.host);
        }
        d.facts.tokens_agree = match model {
            Some(m) => self.tokens_agree(w, m).await,
            None => None,
        };
        Ok(d)
    }

    /// Tokenizes the probe conversation on both sides: exact ids through `/tokenize`, else the
    /// prompt length of a one-token chat completion. `None` when neither answers.
    async fn tokens_agree(&self, w: &WorkerRecord, model: &Arc<ModelRoute>) -> Option<bool> {
        let model = Arc::clone(model);
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

/// What a 401 or 403 from `w` means for an operator: its engine wants an API key Cortex does not
/// send, or refuses the one it sends (empty for other statuses).
fn key_hint(w: &WorkerRecord, status: StatusCode) -> &'static str {
    match (status.as_u16(), &w.api_key) {
        (401 | 403, None) => " (the worker requires an API key: set its model's worker_api_key_env)",
        (401 | 403, Some(_)) => " (the worker refuses its model's worker API key: check worker_api_key_env)",
        _ => "",
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
