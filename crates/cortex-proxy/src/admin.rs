//! The admin API, on its own listener: list, add and remove workers, behind a bearer token.
//!
//! ```text
//! GET    /admin/workers          the registry (same shape as /debug/workers)
//! POST   /admin/workers          {"name", "url", "engine": "vllm"|"sglang", "model", "role"?}
//! DELETE /admin/workers/{name}
//! ```
//!
//! Key decision: a separate listener (never the public one) and a constant-time token check, so
//! that exposing the data plane never exposes control of the cluster.

use std::convert::Infallible;
use std::sync::Arc;

use cortex_hash::Engine;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::error::{Body, ProxyError};
use crate::gateway::{Gateway, json_response};
use crate::registry::{WorkerConfig, parse_role, parse_unlabeled_stores};

/// The admin service.
#[derive(Clone)]
pub struct Admin {
    gateway: Arc<Gateway>,
    token: Arc<str>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    /// An admin API for `gateway` accepting `Authorization: Bearer <token>`.
    #[must_use]
    pub fn new(gateway: Arc<Gateway>, token: &str) -> Self {
        Admin { gateway, token: token.into() }
    }

    /// The hyper service.
    ///
    /// # Errors
    /// Never: errors become responses.
    pub async fn serve(self, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
        Ok(match self.handle(req).await {
            Ok(r) => r,
            Err(e) => e.into_response("admin"),
        })
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let given = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        constant_time_eq(given.as_bytes(), self.token.as_bytes())
    }

    async fn handle(&self, req: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
        if !self.authorized(&req) {
            return Err(ProxyError::Unauthorized);
        }
        let path = req.uri().path().to_owned();
        match (req.method().clone(), path.as_str()) {
            (Method::GET, "/admin/workers") => {
                Ok(json_response(StatusCode::OK, &self.gateway.debug_workers()))
            }
            (Method::POST, "/admin/workers") => {
                let body = self.gateway.read_body(req.into_body()).await?;
                let v: Value =
                    serde_json::from_slice(&body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
                let cfg = worker_config(&v)?;
                let id = self.gateway.add_worker(cfg)?;
                Ok(json_response(StatusCode::CREATED, &json!({"id": id.0})))
            }
            (Method::DELETE, p) if p.starts_with("/admin/workers/") => {
                let name = &p["/admin/workers/".len()..];
                let w = self
                    .gateway
                    .registry()
                    .by_name(name)
                    .ok_or_else(|| ProxyError::NotFound { method: "DELETE".into(), path: p.to_owned() })?;
                self.gateway.remove_worker(w.id);
                Ok(json_response(StatusCode::OK, &json!({"removed": name})))
            }
            (m, _) => Err(ProxyError::NotFound { method: m.to_string(), path }),
        }
    }
}

/// Parses a worker from the admin API's JSON.
///
/// # Errors
/// [`ProxyError::InvalidRequest`] naming the field.
pub fn worker_config(v: &Value) -> Result<WorkerConfig, ProxyError> {
    let s = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| ProxyError::InvalidRequest(format!("`{k}` is required")))
    };
    let engine = match s("engine")?.as_str() {
        "vllm" => Engine::Vllm,
        "sglang" => Engine::Sglang,
        other => {
            return Err(ProxyError::InvalidRequest(format!("`engine` must be vllm or sglang, not {other}")));
        }
    };
    let role = parse_role(v.get("role").and_then(Value::as_str))
        .map_err(|e| ProxyError::InvalidRequest(format!("`role` {e}")))?;
    let unlabeled_stores_unknown = parse_unlabeled_stores(v.get("unlabeled_stores").and_then(Value::as_str))
        .map_err(|e| ProxyError::InvalidRequest(format!("`unlabeled_stores` {e}")))?;
    Ok(WorkerConfig {
        name: s("name")?,
        url: s("url")?,
        engine,
        model: s("model")?,
        role,
        events: None,
        unlabeled_stores_unknown,
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_json() {
        let w = worker_config(&json!({"name": "a", "url": "http://h:1", "engine": "sglang", "model": "m"}))
            .unwrap();
        assert_eq!((w.engine, w.role), (Engine::Sglang, cortex_sched::Role::Regular));
        assert!(worker_config(&json!({"name": "a", "url": "u", "engine": "trt", "model": "m"})).is_err());
        assert!(worker_config(&json!({"url": "u", "engine": "vllm", "model": "m"})).is_err());
        assert!(!w.unlabeled_stores_unknown);
        let u =
            json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "unlabeled_stores": "unknown"});
        assert!(worker_config(&u).unwrap().unlabeled_stores_unknown);
        let bad = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "unlabeled_stores": "x"});
        assert!(worker_config(&bad).unwrap_err().to_string().contains("unlabeled_stores"));
    }

    #[test]
    fn token_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
