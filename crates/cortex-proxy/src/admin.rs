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
//! POST   /debug/route[?route=ROUTE]         the dry run of a request body, parsed as ROUTE
//!                                            (generate, chat_completions or completions)
//! ```
//!
//! A query parameter a path does not take is refused (400), never ignored: a misspelt
//! `?workers=` must not flush every worker.
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
use crate::request::Route;

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
        // On HTTP/1.1 a refused request that came with a body ends its connection, said in the
        // answer (most refusals here come before the body is read; the rest are not worth
        // telling apart on the admin listener).
        let unread = (req.version(), !hyper::body::Body::is_end_stream(req.body()));
        Ok(match self.handle(req).await {
            Ok(mut r) => {
                if !r.headers().contains_key("x-request-id") {
                    crate::upstream::set_header(r.headers_mut(), "x-request-id", &rid);
                }
                r
            }
            Err(e) => {
                let mut resp = e.into_response(&rid);
                if unread.1 {
                    crate::error::close_connection(&mut resp, unread.0);
                }
                resp
            }
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
                query(req.uri(), None)?;
                Ok(json_response(StatusCode::OK, &crate::debug::workers(control)))
            }
            (Method::POST, "/debug/route") => {
                let route = query(req.uri(), Some("route"))?.map(|r| route_named(&r)).transpose()?;
                self.gateway.debug_route(req, route).await
            }
            (Method::POST, "/admin/cache/flush") => {
                let worker = query(req.uri(), Some("worker"))?;
                Ok(json_response(StatusCode::OK, &crate::fanout::flush(control, worker.as_deref()).await?))
            }
            (Method::POST, "/admin/workers") => {
                query(req.uri(), None)?;
                let body = read_body(req.into_body(), self.gateway.limits()).await?;
                let v: Value =
                    serde_json::from_slice(&body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
                let cfg = worker_config(&v)?;
                let id = control.join(cfg)?;
                Ok(json_response(StatusCode::CREATED, &json!({"id": id.0})))
            }
            (Method::DELETE, p) if p.len() > "/admin/workers/".len() && p.starts_with("/admin/workers/") => {
                query(req.uri(), None)?;
                let name = percent_decoded(&p["/admin/workers/".len()..], "worker name")?;
                let name = name.as_str();
                let w = control
                    .registry()
                    .by_name(name)
                    .ok_or_else(|| ProxyError::UnknownWorker(name.to_owned()))?;
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

/// The routes `/debug/route?route=` names, as their metric labels spell them.
const ROUTES: [Route; 3] = [Route::Generate, Route::ChatCompletions, Route::Completions];

/// The route named by `/debug/route?route=`.
fn route_named(name: &str) -> Result<Route, ProxyError> {
    ROUTES.into_iter().find(|r| r.as_str() == name).ok_or_else(|| {
        let names: Vec<&str> = ROUTES.iter().map(|r| r.as_str()).collect();
        ProxyError::InvalidRequest(format!(
            "query parameter `route` must be {}, not `{name}`",
            names.join(", ")
        ))
    })
}

/// The value of the one query parameter an admin path `takes` (if any), percent-decoded; any
/// other parameter, the parameter given twice or with an empty value is refused (400 naming it):
/// an admin call never silently drops what it was given.
fn query(uri: &http::Uri, takes: Option<&str>) -> Result<Option<String>, ProxyError> {
    let mut found = None;
    // An empty parameter (`?&`, `?worker=a&`), or a bare `?` on a route that takes one, is
    // refused: a query mangled on its way (a name left out, a script's `?${PARAMS}` with nothing
    // in it) must not become a call on every worker. A bare `?` elsewhere is no parameter.
    let q = uri.query().unwrap_or_default();
    if let (Some(""), Some(t)) = (uri.query(), takes) {
        return Err(ProxyError::InvalidRequest(format!(
            "an empty query (`?`): {} takes `{t}`; without the `?` it means every one",
            uri.path()
        )));
    }
    for pair in q.split('&').filter(|_| !q.is_empty()) {
        if pair.is_empty() {
            return Err(ProxyError::InvalidRequest(format!(
                "an empty query parameter (`{q}`): {} takes {}",
                uri.path(),
                takes.map_or("no query parameter".to_owned(), |t| format!("only `{t}`"))
            )));
        }
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decoded(name, "query parameter")?;
        let refuse = |why: String| ProxyError::InvalidRequest(format!("query parameter `{name}` {why}"));
        if takes != Some(name.as_str()) {
            return Err(refuse(match takes {
                None => format!("is unknown: {} takes no query parameter", uri.path()),
                Some(t) => format!("is unknown: {} takes only `{t}`", uri.path()),
            }));
        }
        if found.is_some() {
            return Err(refuse("is given twice".to_owned()));
        }
        let value = percent_decoded(value, "query value")?;
        if value.is_empty() {
            return Err(refuse("must not be empty".to_owned()));
        }
        found = Some(value);
    }
    Ok(found)
}

/// A path segment or a query value (`what` it is, for the message): `%XX` escapes decoded (a
/// worker's name may hold any character), `+` kept as itself.
fn percent_decoded(s: &str, what: &str) -> Result<String, ProxyError> {
    let bad = || ProxyError::InvalidRequest(format!("`{s}` is not a valid percent-encoded {what}"));
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
    // A key that is there must be a string: a wrongly typed one is refused, never read as absent
    // (a `role` of `["prefill"]` would make a prefill worker a regular one).
    let opt = |k: &str| match v.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(x)) => Ok(Some(x.as_str())),
        Some(other) => Err(ProxyError::InvalidRequest(format!("`{k}` must be a string, not {other}"))),
    };
    let s = |k: &str| {
        opt(k)?.map(str::to_owned).ok_or_else(|| ProxyError::InvalidRequest(format!("`{k}` is required")))
    };
    let engine = match s("engine")?.as_str() {
        "vllm" => Engine::Vllm,
        "sglang" => Engine::Sglang,
        other => {
            return Err(ProxyError::InvalidRequest(format!("`engine` must be vllm or sglang, not {other}")));
        }
    };
    let role = parse_role(opt("role")?).map_err(|e| ProxyError::InvalidRequest(format!("`role` {e}")))?;
    let unlabeled_stores_unknown = parse_unlabeled_stores(opt("unlabeled_stores")?)
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
    let w = WorkerConfig {
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
    };
    w.check_bootstrap_port().map_err(|e| ProxyError::InvalidRequest(format!("`bootstrap_port` {e}")))?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_names_are_percent_decoded() {
        assert_eq!(percent_decoded("gpu%20node%2F1", "name").unwrap(), "gpu node/1");
        assert_eq!(percent_decoded("a+b", "name").unwrap(), "a+b");
        assert_eq!(percent_decoded("w%C3%A9", "name").unwrap(), "wé");
        for bad in ["a%2", "a%zz", "%FF"] {
            assert!(matches!(percent_decoded(bad, "name"), Err(ProxyError::InvalidRequest(_))), "{bad}");
        }
    }

    #[test]
    fn a_query_parameter_a_path_does_not_take_is_refused_by_name() {
        let q = |uri: &str, takes| query(&uri.parse().unwrap(), takes).map_err(|e| e.to_string());
        assert_eq!(q("/admin/cache/flush", Some("worker")), Ok(None));
        // A bare `?` is no parameter where none is taken, and refused where one is (the flush
        // of every worker must not be what an emptied query turns into).
        assert_eq!(q("/debug/workers?", None), Ok(None));
        assert_eq!(q("/admin/cache/flush?worker=gpu%201", Some("worker")), Ok(Some("gpu 1".into())));
        for (uri, takes, says) in [
            (
                "/admin/cache/flush?workers=w0",
                Some("worker"),
                "`workers` is unknown: /admin/cache/flush takes only `worker`",
            ),
            ("/admin/cache/flush?worker=w0&all", Some("worker"), "`all` is unknown"),
            ("/admin/cache/flush?worker=", Some("worker"), "`worker` must not be empty"),
            ("/admin/cache/flush?worker", Some("worker"), "`worker` must not be empty"),
            ("/admin/cache/flush?worker=a&worker=b", Some("worker"), "`worker` is given twice"),
            (
                "/admin/workers?verbose=1",
                None,
                "`verbose` is unknown: /admin/workers takes no query parameter",
            ),
            ("/admin/cache/flush?worker=a%2", Some("worker"), "not a valid percent-encoded query value"),
            ("/admin/cache/flush?&", Some("worker"), "an empty query parameter (`&`)"),
            ("/admin/cache/flush?worker=w0&", Some("worker"), "an empty query parameter"),
            ("/admin/workers?&", None, "an empty query parameter"),
            (
                "/admin/cache/flush?",
                Some("worker"),
                "an empty query (`?`): /admin/cache/flush takes `worker`",
            ),
        ] {
            let err = q(uri, takes).unwrap_err();
            assert!(err.contains(says), "{uri}: {err}");
        }
        assert_eq!(route_named("generate").unwrap(), Route::Generate);
        assert_eq!(route_named("chat_completions").unwrap(), Route::ChatCompletions);
        let err = route_named("chat").unwrap_err().to_string();
        assert!(err.contains("must be generate, chat_completions, completions, not `chat`"), "{err}");
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
            let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "role": "prefill", "bootstrap_port": bad});
            assert!(worker_config(&v).unwrap_err().to_string().contains("bootstrap_port"));
        }
        let v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m", "role": "leader"});
        assert!(worker_config(&v).unwrap_err().to_string().contains("leader"));
        // Where nothing reads it, a bootstrap port is refused.
        for (engine, role) in [("sglang", "decode"), ("sglang", "regular"), ("vllm", "prefill")] {
            let v = json!({"name": "a", "url": "u", "engine": engine, "model": "m", "role": role, "bootstrap_port": 8998});
            let err = worker_config(&v).unwrap_err().to_string();
            assert!(err.contains("applies only to an SGLang prefill worker"), "{engine} {role}: {err}");
        }
        // A wrongly typed value is refused by name, not taken as the default.
        for (key, bad) in
            [("role", json!(["prefill"])), ("unlabeled_stores", json!(true)), ("name", json!(7))]
        {
            let mut v = json!({"name": "a", "url": "u", "engine": "sglang", "model": "m"});
            v[key] = bad;
            let err = worker_config(&v).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}` must be a string")), "{key}: {err}");
        }
    }
}
