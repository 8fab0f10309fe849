//! The admin API, on its own listener, behind a bearer token: list, add and remove workers,
//! flush the workers' caches, and the debug views.
//!
//! ```text
//! GET    /admin/workers          the registry (same shape as /debug/workers)
//! POST   /admin/workers          {"name", "url", "engine": "vllm"|"sglang", "model", "role"?,
//!                                 "unlabeled_stores"?, "max_running_requests"?, "bootstrap_port"?,
//!                                 "events"?: {"publish_port_base", "replay_port_base"?, "topic"?,
//!                                 "dp_size"?}}; any other key is refused
//! DELETE /admin/workers/{name}
//! POST   /admin/cache/flush[?worker=NAME]   each worker's answer, the ledger before and after
//! GET    /debug/workers          each worker's configuration, discovery, verdicts, ledger, load
//! POST   /debug/route[?route=generate]      the dry run of a request body
//! ```
//!
//! Key decisions: a separate listener (never the public one; `/debug/*` answers 404 there) and a
//! constant-time token check ([`crate::auth`]), so that exposing the data plane never exposes
//! control of the cluster nor what it knows of each worker. Membership changes go only through
//! [`Control`], the owner of membership.

use std::convert::Infallible;
use std::sync::Arc;

use cortex_hash::Engine;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Map, Value, json};

use crate::auth::Token;
use crate::error::{Body, ProxyError};
use crate::gateway::{Gateway, json_response, read_body, request_id};
use crate::registry::{EventsOverride, WorkerConfig, parse_role, parse_unlabeled_stores};

/// The admin service.
#[derive(Clone)]
pub struct Admin {
    gateway: Arc<Gateway>,
    token: Token,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    /// An admin API over `gateway` (its control plane, its dry run, its body limits) accepting
    /// `Authorization: Bearer <token>`.
    #[must_use]
    pub fn new(gateway: Arc<Gateway>, token: Token) -> Self {
        Admin { gateway, token }
    }

    /// The hyper service.
    ///
    /// # Errors
    /// Never: errors become responses.
    pub async fn serve(self, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
        // The public listener's contract: the client's `x-request-id` (else a fresh one) on
        // every answer, errors included.
        let rid = request_id(req.headers());
        Ok(match self.handle(req).await {
            Ok(mut r) => {
                if !r.headers().contains_key("x-request-id") {
                    crate::upstream::set_header(r.headers_mut(), "x-request-id", &rid);
                }
                r
            }
            Err(e) => e.into_response(&rid),
        })
    }

    async fn handle(&self, req: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
        if !self.token.admits(req.headers()) {
            return Err(ProxyError::Unauthorized);
        }
        let control = self.gateway.control();
        let path = req.uri().path().to_owned();
        match (req.method().clone(), path.as_str()) {
            (Method::GET, "/admin/workers" | "/debug/workers") => {
                Ok(json_response(StatusCode::OK, &crate::debug::workers(control)))
            }
            (Method::POST, "/debug/route") => self.gateway.debug_route(req).await,
            (Method::POST, "/admin/cache/flush") => {
                let query = req.uri().query().unwrap_or_default();
                let worker = query.split('&').find_map(|kv| kv.strip_prefix("worker=")).map(percent_decoded);
                let worker = worker.transpose()?;
                Ok(json_response(StatusCode::OK, &crate::fanout::flush(control, worker.as_deref()).await?))
            }
            (Method::POST, "/admin/workers") => {
                let body = read_body(req.into_body(), self.gateway.limits()).await?;
                let v: Value =
                    serde_json::from_slice(&body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
                let cfg = worker_config(&v)?;
                let id = control.join(cfg)?;
                Ok(json_response(StatusCode::CREATED, &json!({"id": id.0})))
            }
            (Method::DELETE, p) if p.starts_with("/admin/workers/") => {
                let name = percent_decoded(&p["/admin/workers/".len()..])?;
                let name = name.as_str();
                let w = control
                    .registry()
                    .by_name(name)
                    .ok_or_else(|| ProxyError::NotFound { method: "DELETE".into(), path: p.to_owned() })?;
                control.leave(w.id);
                Ok(json_response(StatusCode::OK, &json!({"removed": name})))
            }
            (m, p) => Err(match allowed(p) {
                Some((allow, note)) => ProxyError::MethodNotAllowed { method: m.to_string(), allow, note },
                None => ProxyError::NotFound { method: m.to_string(), path },
            }),
        }
    }
}

/// A worker's name as a path segment or a query value carries it: `%XX` escapes decoded (a name
/// may hold any character), `+` kept as itself.
fn percent_decoded(s: &str) -> Result<String, ProxyError> {
    let bad = || ProxyError::InvalidRequest(format!("`{s}` is not a valid percent-encoded worker name"));
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next().ok_or_else(bad)?, bytes.next().ok_or_else(bad)?];
            let hex = std::str::from_utf8(&hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// The methods an admin path takes (its `Allow` header) and a note for the 405's message;
/// `None` for a path the admin listener does not serve.
fn allowed(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "/admin/workers" => Some(("GET, POST", "")),
        "/debug/workers" => Some(("GET", "")),
        "/admin/cache/flush" => Some(("POST", "")),
        "/debug/route" => Some(("POST", ", whose body is a chat, completion or /generate request")),
        p if p.strip_prefix("/admin/workers/").is_some_and(|name| !name.is_empty()) => Some(("DELETE", "")),
        _ => None,
    }
}

/// The fields of `POST /admin/workers`.
const WORKER_FIELDS: [&str; 9] = [
    "name",
    "url",
    "engine",
    "model",
    "role",
    "max_running_requests",
    "bootstrap_port",
    "unlabeled_stores",
    "events",
];

/// The fields of its `events`.
const EVENTS_FIELDS: [&str; 4] = ["publish_port_base", "replay_port_base", "topic", "dp_size"];

/// Refuses the keys of `obj` that are not `known`, naming them (a misspelt key is never
/// silently dropped).
fn only_known(obj: &Map<String, Value>, known: &[&str], what: &str) -> Result<(), ProxyError> {
    let unknown: Vec<String> =
        obj.keys().filter(|k| !known.contains(&k.as_str())).map(|k| format!("`{k}`")).collect();
    if unknown.is_empty() {
        return Ok(());
    }
    Err(ProxyError::InvalidRequest(format!(
        "unknown field{} {} in {what}, which takes {}",
        if unknown.len() == 1 { "" } else { "s" },
        unknown.join(", "),
        known.join(", ")
    )))
}

/// A worker's `events` (the configuration file's `workers[].events`).
fn events_override(v: &Value) -> Result<EventsOverride, ProxyError> {
    let obj = v.as_object().ok_or_else(|| {
        ProxyError::InvalidRequest(format!("`events` must be an object with {}", EVENTS_FIELDS.join(", ")))
    })?;
    only_known(obj, &EVENTS_FIELDS, "`events`")?;
    let port = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(n) => n
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ProxyError::InvalidRequest(format!("`events.{k}` must be a port number"))),
    };
    let o = EventsOverride {
        publish_port_base: port("publish_port_base")?
            .ok_or_else(|| ProxyError::InvalidRequest("`events.publish_port_base` is required".into()))?,
        replay_port_base: port("replay_port_base")?,
        topic: match obj.get("topic") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(t)) => t.clone(),
            Some(_) => return Err(ProxyError::InvalidRequest("`events.topic` must be a string".into())),
        },
        dp_size: match obj.get("dp_size") {
            None | Some(Value::Null) => 1,
            Some(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()).ok_or_else(|| {
                ProxyError::InvalidRequest("`events.dp_size` must be a positive integer".into())
            })?,
        },
    };
    o.validate().map_err(|(field, why)| ProxyError::InvalidRequest(format!("`events.{field}` {why}")))?;
    Ok(o)
}

/// Parses a worker from the admin API's JSON: the configuration file's `workers[]` keys.
///
/// # Errors
/// [`ProxyError::InvalidRequest`] naming the field (an unknown one included).
pub fn worker_config(v: &Value) -> Result<WorkerConfig, ProxyError> {
    let obj = v.as_object().ok_or_else(|| {
        ProxyError::InvalidRequest(format!(
            "the body must be a JSON object with {}",
            WORKER_FIELDS.join(", ")
        ))
    })?;
    only_known(obj, &WORKER_FIELDS, "a worker")?;
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
    let max_running_requests = match v.get("max_running_requests") {
        None | Some(Value::Null) => None,
        Some(n) => {
            Some(n.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0).ok_or_else(|| {
                ProxyError::InvalidRequest("`max_running_requests` must be a positive integer".into())
            })?)
        }
    };
    let bootstrap_port = match v.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| ProxyError::InvalidRequest("`bootstrap_port` must be a port number".into()))?,
        ),
    };
    Ok(WorkerConfig {
        name: s("name")?,
        url: s("url")?,
        engine,
        model: s("model")?,
        role,
        max_running_requests,
        events: match v.get("events") {
            None | Some(Value::Null) => None,
            Some(e) => Some(events_override(e)?),
        },
        unlabeled_stores_unknown,
        bootstrap_port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_names_are_percent_decoded() {
        assert_eq!(percent_decoded("gpu%20node%2F1").unwrap(), "gpu node/1");
        assert_eq!(percent_decoded("a+b").unwrap(), "a+b");
        assert_eq!(percent_decoded("w%C3%A9").unwrap(), "wé");
        for bad in ["a%2", "a%zz", "%FF"] {
            assert!(matches!(percent_decoded(bad), Err(ProxyError::InvalidRequest(_))), "{bad}");
        }
    }

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
        let base = json!({"name": "a", "url": "u", "engine": "vllm", "model": "m"});
        assert_eq!(worker_config(&base).unwrap().max_running_requests, None);
        let mut capped = base.clone();
        capped["max_running_requests"] = json!(64);
        assert_eq!(worker_config(&capped).unwrap().max_running_requests, Some(64));
        for bad in [json!(0), json!(-1), json!("64"), json!(1.5)] {
            capped["max_running_requests"] = bad;
            assert!(worker_config(&capped).unwrap_err().to_string().contains("max_running_requests"));
        }
    }

    #[test]
    fn unknown_fields_are_refused_by_name_and_events_are_read() {
        let base = json!({"name": "a", "url": "u", "engine": "vllm", "model": "m"});
        let mut typo = base.clone();
        typo["max_running_request"] = json!(64);
        let err = worker_config(&typo).unwrap_err().to_string();
        assert!(
            err.contains("unknown field `max_running_request`") && err.contains("max_running_requests"),
            "{err}"
        );
        let mut two = typo.clone();
        two["evnets"] = json!({});
        let err = worker_config(&two).unwrap_err().to_string();
        assert!(
            err.contains("unknown fields")
                && err.contains("`evnets`")
                && err.contains("`max_running_request`")
        );
        assert!(worker_config(&json!(["a"])).unwrap_err().to_string().contains("JSON object"));
        assert_eq!(worker_config(&base).unwrap().events, None);
        let mut with = base.clone();
        with["events"] =
            json!({"publish_port_base": 5557, "replay_port_base": 5657, "topic": "kv", "dp_size": 2});
        assert_eq!(
            worker_config(&with).unwrap().events,
            Some(EventsOverride {
                publish_port_base: 5557,
                replay_port_base: Some(5657),
                topic: "kv".into(),
                dp_size: 2
            })
        );
        with["events"] = json!({"publish_port_base": 5557});
        let e = worker_config(&with).unwrap().events.unwrap();
        assert_eq!((e.replay_port_base, e.topic.as_str(), e.dp_size), (None, "", 1));
        for (events, says) in [
            (json!({"publish_port_base": 5557, "dp_size": 0}), "`events.dp_size` must be at least 1"),
            (json!({"publish_port_base": 0}), "`events.publish_port_base` must be a port number"),
            (json!({"publish_port_base": 70000}), "`events.publish_port_base` must be a port number"),
            (
                json!({"publish_port_base": 65535, "dp_size": 2}),
                "`events.publish_port_base` 65535 leaves rank 1",
            ),
            (json!({"replay_port_base": 5657}), "`events.publish_port_base` is required"),
            (json!({"publish_port_base": 5557, "topic": 3}), "`events.topic`"),
            (json!({"publish_port_base": 5557, "port": 1}), "unknown field `port` in `events`"),
            (json!(5557), "`events` must be an object"),
        ] {
            with["events"] = events;
            let err = worker_config(&with).unwrap_err().to_string();
            assert!(err.contains(says), "{}: {err}", with["events"]);
        }
    }

    #[test]
    fn pd_roles_and_the_bootstrap_port() {
        let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "role": "prefill", "bootstrap_port": 8998});
        let w = worker_config(&v).unwrap();
        assert_eq!((w.role, w.bootstrap_port), (cortex_sched::Role::Prefill, Some(8998)));
        let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "role": "decode"});
        assert_eq!(worker_config(&v).unwrap().role, cortex_sched::Role::Decode);
        for bad in [json!(0), json!(70000), json!("8998")] {
            let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "bootstrap_port": bad});
            assert!(worker_config(&v).unwrap_err().to_string().contains("bootstrap_port"));
        }
        let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "role": "leader"});
        assert!(worker_config(&v).unwrap_err().to_string().contains("leader"));
    }
}
