//! The HTTP side of a worker: a hyper 1.x HTTP/1.1 server (`TCP_NODELAY` on every connection),
//! a hand-written router per engine, and the simulator's own routes (`/sim/*`: ground truth,
//! faults, PD rendezvous).
//!
//! Key decisions:
//! - Handlers return `Err` only to cut a connection on purpose (the "die mid-stream" fault);
//!   every other outcome is a response in the engine's own error format.
//! - Streaming bodies are fed through a channel by a pump task; when the client goes away hyper
//!   drops the body, the pump stops, the engine sees its request channel closed and aborts the
//!   request at its next step. A non-streaming handler dropped by hyper has the same effect.

mod api;
mod info;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::faults::Fault;
use crate::worker::Shared;

/// Which routes a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Surface {
    /// The engine's API plus `/sim/*`.
    Api,
    /// A prefill worker's PD rendezvous listener.
    Rendezvous,
}

/// The connection is cut on purpose.
#[derive(Debug)]
pub(crate) struct Cut;

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection cut by a simulated fault")
    }
}

impl std::error::Error for Cut {}

/// A chunk of a streaming body.
pub(crate) enum Chunk {
    Data(Bytes),
    /// End the body with an error: hyper closes the connection mid-response.
    Cut,
}

/// A response body: complete, or streamed from a channel.
pub(crate) enum SimBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Chunk>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Stream(rx) => match rx.poll_recv(cx) {
                Poll::Ready(Some(Chunk::Data(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(Some(Chunk::Cut)) => Poll::Ready(Some(Err(Cut))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Stream(_) => SizeHint::default(),
        }
    }
}

pub(crate) type Resp = Response<SimBody>;

pub(crate) fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(SimBody::Full(Some(body.into())));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(crate) fn json_resp(status: StatusCode, v: &Value) -> Resp {
    full(status, "application/json", v.to_string())
}

pub(crate) fn text_resp(status: StatusCode, s: impl Into<String>) -> Resp {
    full(status, "text/plain; charset=utf-8", s.into())
}

pub(crate) fn sse(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

pub(crate) const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Accepts connections until the runtime is dropped.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, surface: Surface) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(_) => {
                tokio::task::yield_now().await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let s = Arc::clone(&shared);
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let s = Arc::clone(&s);
                async move { route(s, surface, req).await }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// Reads a JSON body; an empty body is `{}`.
pub(crate) async fn read_json(req: Request<Incoming>) -> Result<(http::request::Parts, Value), Resp> {
    let (parts, body) = req.into_parts();
    let bytes = body.collect().await.map(http_body_util::Collected::to_bytes).unwrap_or_default();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok((parts, json!({})));
    }
    match serde_json::from_slice(&bytes) {
        Ok(v) => Ok((parts, v)),
        Err(e) => Err(json_resp(
            StatusCode::BAD_REQUEST,
            &json!({"error": {"message": format!("invalid JSON body: {e}"), "type": "BadRequestError", "param": null, "code": 400}}),
        )),
    }
}

async fn route(shared: Arc<Shared>, surface: Surface, req: Request<Incoming>) -> Result<Resp, Cut> {
    let path = req.uri().path().to_owned();
    if surface == Surface::Rendezvous {
        return Ok(rendezvous(&shared, &req, &path).await);
    }
    if path.starts_with("/sim/") {
        return Ok(sim_route(&shared, req, &path).await);
    }
    if let Some(key) = &shared.cfg.api_key
        && guarded(shared.is_vllm(), req.method(), &path)
        && req.headers().get(http::header::AUTHORIZATION).map(http::HeaderValue::as_bytes)
            != Some(format!("Bearer {key}").as_bytes())
    {
        // Both engines answer exactly this (SGLang's `add_api_key_middleware`, vLLM's
        // `AuthenticationMiddleware`).
        return Ok(json_resp(StatusCode::UNAUTHORIZED, &json!({"error": "Unauthorized"})));
    }
    if shared.is_vllm() { api::vllm(shared, req, &path).await } else { api::sglang(shared, req, &path).await }
}

/// Whether the engine's `--api-key` guards `path`: SGLang every path but `/health*` and
/// `/metrics*`, vLLM the `/v1` paths; neither an `OPTIONS` request.
fn guarded(vllm: bool, method: &http::Method, path: &str) -> bool {
    if method == http::Method::OPTIONS {
        return false;
    }
    if vllm {
        path.starts_with("/v1")
    } else {
        !(path.starts_with("/health") || path.starts_with("/metrics"))
    }
}

fn query_param<'a>(uri: &'a http::Uri, key: &str) -> Option<&'a str> {
    uri.query()?.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

async fn rendezvous(shared: &Arc<Shared>, req: &Request<Incoming>, path: &str) -> Resp {
    if let Some(room) = path.strip_prefix("/sim/pd/sglang/room/") {
        let Ok(room) = room.parse::<u64>() else { return text_resp(StatusCode::BAD_REQUEST, "bad room") };
        let wait = query_param(req.uri(), "timeout_ms")
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(shared.cfg.pd.bootstrap_timeout, std::time::Duration::from_millis);
        return match shared.pd.take_room(room, wait).await {
            Some(info) => json_resp(
                StatusCode::OK,
                &json!({
                    "prompt_tokens": info.prompt_tokens,
                    "first_token": info.first_token,
                    "cached_tokens": info.cached_tokens,
                    "rank": info.rank,
                }),
            ),
            None => text_resp(StatusCode::GATEWAY_TIMEOUT, "no prefill for this room"),
        };
    }
    if let Some(rid) = path.strip_prefix("/sim/pd/vllm/lease/") {
        return match shared.pd.take_lease(rid) {
            Some(n) => json_resp(StatusCode::OK, &json!({"num_blocks": n})),
            None => text_resp(StatusCode::NOT_FOUND, "unknown or expired lease"),
        };
    }
    text_resp(StatusCode::NOT_FOUND, "not found")
}

async fn sim_route(shared: &Arc<Shared>, req: Request<Incoming>, path: &str) -> Resp {
    match path {
        "/sim/state" => {
            let ranks: Vec<Value> = (0..shared.cfg.dp_size)
                .filter_map(|r| shared.rank_state(r).ok())
                .map(|st| {
                    let eps = shared
                        .publisher
                        .as_ref()
                        .and_then(|p| p.endpoints().get(usize::from(st.rank)).copied());
                    json!({
                        "rank": st.rank,
                        "subscribed": st.subscribed,
                        "last_seq": st.last_seq,
                        "running": st.running,
                        "waiting": st.waiting,
                        "virtual_time_ms": st.virtual_time.as_secs_f64() * 1e3,
                        "cancelled": st.cancelled,
                        "pd": {
                            "prefill_legs": st.pd.prefill_legs,
                            "decode_legs": st.pd.decode_legs,
                            "pulled_tokens": st.pd.pulled_tokens,
                        },
                        "publish": eps.map(|e| format!("tcp://{}", e.publish)),
                        "replay": eps.and_then(|e| e.replay).map(|a| format!("tcp://{a}")),
                        "blocks": st.blocks.iter().map(|b| {
                            let (hash, parent) = if shared.is_vllm() {
                                (json!(b.hash.to_u64()), json!(b.parent.map(|p| p.to_u64())))
                            } else {
                                (json!(b.hash.to_i64()), json!(b.parent.map(|p| p.to_i64())))
                            };
                            json!({
                                "hash": hash,
                                "parent": parent,
                                "tokens": b.tokens,
                                "in_use": b.in_use,
                                "lora_name": b.lora_name,
                                "cache_salt": b.cache_salt,
                            })
                        }).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json_resp(
                StatusCode::OK,
                &json!({
                    "engine": shared.cfg.engine.name(),
                    "role": shared.cfg.role.sglang_mode(),
                    "pd_transfer_failures": shared.pd_transfer_failures.load(std::sync::atomic::Ordering::SeqCst),
                    "traceparents": shared.traceparents(),
                    "ranks": ranks,
                }),
            )
        }
        "/sim/fault" => {
            let (_, body) = match read_json(req).await {
                Ok(v) => v,
                Err(r) => return r,
            };
            let fault: Fault = match serde_json::from_value(body) {
                Ok(f) => f,
                Err(e) => return text_resp(StatusCode::BAD_REQUEST, format!("unknown fault: {e}")),
            };
            match shared.apply(&fault) {
                Ok(()) => json_resp(StatusCode::OK, &json!({"ok": true})),
                Err(crate::SimError::FlushRefused) => {
                    text_resp(StatusCode::BAD_REQUEST, "requests are running")
                }
                Err(e) => text_resp(StatusCode::BAD_REQUEST, e.to_string()),
            }
        }
        _ => text_resp(StatusCode::NOT_FOUND, "not found"),
    }
}
