//! The engines' generation APIs: vLLM's OpenAI server (`/v1/completions`,
//! `/v1/chat/completions`) and SGLang's (`/generate`, `/v1/completions`,
//! `/v1/chat/completions`), with their response and SSE chunk shapes, usage accounting
//! (`prompt_tokens_details.cached_tokens` = the engine's prefix hit), DP-rank pinning
//! (`X-data-parallel-rank`, `routed_dp_rank`), request ids and PD legs.
//!
//! Key decision: the response headers wait for the first token, so every response carries its
//! simulated timings (`x-sim-ttft-ms`, `x-sim-queue-ms`, `x-sim-cached-tokens`,
//! `x-sim-prompt-tokens`, `x-sim-dp-rank`); with speed 0 that wait is not observable. It also
//! says when the request reached the worker (`x-sim-arrived-unix-us`, the system clock), so a
//! test in front of several workers can order what they received on one clock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::{Chunk, Cut, Resp, SSE_DONE, SimBody, info, json_resp, read_json, sse, text_resp};
use crate::config::{LoraAdapter, Role};
use crate::engine::{
    Failure, NewRequest, PdMode, PdOutcome, ReqEvent, ReqKeys, ReqStats, vllm_transfer_params,
};
use crate::pd::{FetchError, call};
use crate::worker::{ClientWatch, InflightGuard, Shared};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    Vllm,
    Sglang,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    Generate,
}

pub(super) async fn vllm(shared: Arc<Shared>, req: Request<Incoming>, path: &str) -> Result<Resp, Cut> {
    let m = req.method().clone();
    Ok(match (m, path) {
        (Method::GET, "/health") => health(&shared),
        (Method::GET, "/ping") => health(&shared),
        (Method::GET, "/v1/models") => info::models(&shared),
        (Method::POST, "/v1/completions") => {
            return generate(shared, req, Flavor::Vllm, Kind::Completion).await;
        }
        (Method::POST, "/v1/chat/completions") => {
            return generate(shared, req, Flavor::Vllm, Kind::Chat).await;
        }
        (Method::POST, "/tokenize") => info::tokenize(&shared, req).await,
        (Method::POST, "/detokenize") => info::detokenize(&shared, req).await,
        (Method::GET, "/kv_event_sources") if info::has_kv_event_sources(&shared) => {
            info::kv_event_sources(&shared)
        }
        (Method::GET, "/metrics") => info::metrics(&shared),
        (Method::GET, "/load") => {
            json_resp(StatusCode::OK, &json!({"server_load": shared.inflight_http.load(Ordering::SeqCst)}))
        }
        (Method::GET, "/version") => {
            json_resp(StatusCode::OK, &json!({"version": info::engine_version(&shared)}))
        }
        // Only in vLLM's dev mode (VLLM_SERVER_DEV_MODE=1); otherwise a 404 like any unknown path.
        (Method::POST, "/reset_prefix_cache") if vllm_dev_mode(&shared) => flush(&shared, Flavor::Vllm),
        _ => json_resp(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"})),
    })
}

pub(super) async fn sglang(shared: Arc<Shared>, req: Request<Incoming>, path: &str) -> Result<Resp, Cut> {
    let m = req.method().clone();
    Ok(match (m, path) {
        (Method::GET, "/health" | "/health_generate") => health(&shared),
        // SGLang's readiness probe fails with its health (the gateway probes `/ready`).
        (Method::GET, "/ready") if shared.faults.healthy() => text_resp(StatusCode::OK, "ready"),
        (Method::GET, "/ready") => text_resp(StatusCode::SERVICE_UNAVAILABLE, "not ready"),
        (Method::POST | Method::PUT, "/generate") => {
            return generate(shared, req, Flavor::Sglang, Kind::Generate).await;
        }
        (Method::POST, "/v1/completions") => {
            return generate(shared, req, Flavor::Sglang, Kind::Completion).await;
        }
        (Method::POST, "/v1/chat/completions") => {
            return generate(shared, req, Flavor::Sglang, Kind::Chat).await;
        }
        (Method::GET, "/server_info" | "/get_server_info") => info::server_info(&shared),
        (Method::GET, "/model_info" | "/get_model_info") => info::model_info(&shared),
        (Method::GET, "/v1/models") => info::models(&shared),
        (Method::GET, "/v1/loads") => info::loads(&shared, req.uri()),
        (Method::GET, "/metrics") => info::metrics(&shared),
        (Method::GET | Method::POST, "/flush_cache") => flush(&shared, Flavor::Sglang),
        (Method::POST, "/tokenize") => info::tokenize(&shared, req).await,
        _ => json_resp(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"})),
    })
}

fn vllm_dev_mode(shared: &Shared) -> bool {
    matches!(&shared.cfg.engine, crate::config::EngineConfig::Vllm(o) if o.dev_mode)
}

fn health(shared: &Shared) -> Resp {
    if shared.faults.healthy() {
        Response::new(SimBody::Full(None))
    } else {
        let mut r = Response::new(SimBody::Full(None));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        r
    }
}

fn flush(shared: &Shared, flavor: Flavor) -> Resp {
    match shared.apply(&crate::faults::Fault::FlushCache) {
        Ok(()) => match flavor {
            Flavor::Sglang => text_resp(
                StatusCode::OK,
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
            ),
            Flavor::Vllm => Response::new(SimBody::Full(None)),
        },
        Err(_) => match flavor {
            Flavor::Sglang => text_resp(
                StatusCode::BAD_REQUEST,
                "Cache not flushed. Please check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
            ),
            Flavor::Vllm => error_resp(
                flavor,
                Kind::Completion,
                StatusCode::BAD_REQUEST,
                "Failed to reset prefix cache: requests are running",
            ),
        },
    }
}

/// The engine's error body for `status`.
fn error_resp(flavor: Flavor, kind: Kind, status: StatusCode, message: &str) -> Resp {
    let ty = match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let code = status.as_u16();
    let body = match (flavor, kind) {
        (Flavor::Vllm, _) => json!({"error": {"message": message, "type": ty, "param": null, "code": code}}),
        (Flavor::Sglang, Kind::Generate) => json!({"error": {"message": message}}),
        (Flavor::Sglang, _) => {
            json!({"object": "error", "message": message, "type": ty, "param": null, "code": code})
        }
    };
    json_resp(status, &body)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn hex_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// Per-request context shared by the renderers.
struct Ctx {
    flavor: Flavor,
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    /// When the request was parsed: microseconds since the Unix epoch (system clock).
    arrived_us: u128,
    stream: bool,
    include_usage: bool,
    batch: bool,
    request_id: Option<String>,
}

struct Item {
    rank: u16,
    new: NewRequest,
}

/// A handler step that may end the request with an (error) response, boxed: responses are big.
type ApiResult<T> = Result<T, Box<Resp>>;

fn bad(ctx_flavor: Flavor, kind: Kind, msg: &str) -> Box<Resp> {
    Box::new(error_resp(ctx_flavor, kind, StatusCode::BAD_REQUEST, msg))
}

fn u64_field(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// The adapter a request names: vLLM's `model`; SGLang's `lora_path`, `model` or `base:adapter`.
fn resolve_lora(
    shared: &Shared,
    flavor: Flavor,
    kind: Kind,
    body: &Value,
) -> ApiResult<Option<Arc<LoraAdapter>>> {
    let find = |name: &str| shared.cfg.loras.iter().find(|l| l.name == name).cloned().map(Arc::new);
    let model = body.get("model").and_then(Value::as_str);
    match flavor {
        Flavor::Vllm => match model {
            None => Ok(None),
            Some(m) if m == shared.cfg.model_name => Ok(None),
            Some(m) => find(m).map(Some).ok_or_else(|| {
                Box::new(error_resp(
                    flavor,
                    kind,
                    StatusCode::NOT_FOUND,
                    &format!("The model `{m}` does not exist."),
                ))
            }),
        },
        Flavor::Sglang => {
            if let Some(p) = body.get("lora_path").and_then(Value::as_str) {
                return find(p)
                    .map(Some)
                    .ok_or_else(|| bad(flavor, kind, &format!("unknown LoRA adapter `{p}`")));
            }
            let adapter = model.and_then(|m| m.split_once(':').map_or(Some(m), |(_, a)| Some(a)));
            Ok(adapter.and_then(find))
        }
    }
}

/// The prompts of a request (one per batch item) as token ids.
fn prompts(shared: &Shared, flavor: Flavor, kind: Kind, body: &Value) -> ApiResult<(Vec<Vec<u32>>, bool)> {
    let model = &shared.model;
    let tok_err = |e: cortex_hash::text::TextError| bad(flavor, kind, &e.to_string());
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    match kind {
        Kind::Chat => Ok((vec![model.encode_chat(body).map_err(tok_err)?], false)),
        Kind::Completion => {
            let add = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
            match body.get("prompt") {
                Some(Value::String(s)) => Ok((vec![model.encode(s, add).map_err(tok_err)?], false)),
                Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => Ok((
                    vec![ids(&Value::Array(a.clone())).ok_or_else(|| bad(flavor, kind, "bad token ids"))?],
                    false,
                )),
                Some(Value::Array(a)) if !a.is_empty() => {
                    let mut out = Vec::with_capacity(a.len());
                    for p in a {
                        out.push(match p {
                            Value::String(s) => model.encode(s, add).map_err(tok_err)?,
                            other => ids(other).ok_or_else(|| bad(flavor, kind, "bad prompt"))?,
                        });
                    }
                    let batch = out.len() > 1;
                    Ok((out, batch))
                }
                _ => Err(bad(flavor, kind, "`prompt` is required")),
            }
        }
        Kind::Generate => {
            if let Some(input) = body.get("input_ids").filter(|v| !v.is_null()) {
                return match input {
                    Value::Array(a) if a.first().is_some_and(Value::is_array) => {
                        let v: Option<Vec<Vec<u32>>> = a.iter().map(ids).collect();
                        Ok((v.ok_or_else(|| bad(flavor, kind, "bad input_ids"))?, true))
                    }
                    other => Ok((vec![ids(other).ok_or_else(|| bad(flavor, kind, "bad input_ids"))?], false)),
                };
            }
            match body.get("text") {
                Some(Value::String(s)) => Ok((vec![model.encode(s, true).map_err(tok_err)?], false)),
                Some(Value::Array(a)) => {
                    let mut out = Vec::with_capacity(a.len());
                    for t in a {
                        let s = t.as_str().ok_or_else(|| bad(flavor, kind, "bad text"))?;
                        out.push(model.encode(s, true).map_err(tok_err)?);
                    }
                    Ok((out, true))
                }
                _ => Err(bad(flavor, kind, "Either text or input_ids should be provided.")),
            }
        }
    }
}

/// The pinned rank, if any: `X-data-parallel-rank` (vLLM) or `routed_dp_rank` /
/// `data_parallel_rank` (SGLang, per batch item when a list).
fn pinned_rank(
    shared: &Shared,
    flavor: Flavor,
    kind: Kind,
    parts: &http::request::Parts,
    body: &Value,
    i: usize,
) -> ApiResult<Option<u16>> {
    let raw: Option<u64> = match flavor {
        Flavor::Vllm => match parts.headers.get("x-data-parallel-rank") {
            None => None,
            Some(h) => Some(
                h.to_str()
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| bad(flavor, kind, "invalid X-data-parallel-rank header"))?,
            ),
        },
        Flavor::Sglang => {
            let v = body
                .get("routed_dp_rank")
                .filter(|v| !v.is_null())
                .or_else(|| body.get("data_parallel_rank").filter(|v| !v.is_null()));
            match v {
                None => None,
                Some(Value::Array(a)) => a.get(i).and_then(u64_field),
                Some(v) => Some(u64_field(v).ok_or_else(|| bad(flavor, kind, "invalid routed_dp_rank"))?),
            }
        }
    };
    match raw {
        None => Ok(None),
        Some(r) if r < u64::from(shared.cfg.dp_size) => Ok(Some(u16::try_from(r).unwrap_or(0))),
        Some(r) => Err(bad(
            flavor,
            kind,
            &format!("data_parallel_rank {r} is out of range [0, {})", shared.cfg.dp_size),
        )),
    }
}

/// An unpinned request's rank: vLLM's least-loaded engine (`waiting × 4 + running`), SGLang's
/// round robin.
fn balance(shared: &Shared, flavor: Flavor) -> u16 {
    let n = shared.ranks.len();
    match flavor {
        Flavor::Vllm => (0..n)
            .min_by_key(|&i| {
                let l = shared.ranks[i].load();
                l.waiting * 4 + l.running
            })
            .and_then(|i| u16::try_from(i).ok())
            .unwrap_or(0),
        Flavor::Sglang => u16::try_from(shared.rr.fetch_add(1, Ordering::SeqCst) % n).unwrap_or(0),
    }
}

fn str_field(body: &Value, key: &str) -> Option<Arc<str>> {
    body.get(key).and_then(Value::as_str).map(Arc::from)
}

fn list_or_scalar(v: Option<&Value>, i: usize) -> Option<&Value> {
    match v? {
        Value::Array(a) => a.get(i),
        Value::Null => None,
        other => Some(other),
    }
}

async fn resolve(host: &str, port: u16) -> Option<SocketAddr> {
    tokio::net::lookup_host((host, port)).await.ok()?.next()
}

/// Why [`prepare`] produced no items.
enum Refusal {
    /// An error answer before anything is sent (bad request, unknown model).
    Resp(Box<Resp>),
    /// The decode leg's KV transfer failed (SGLang bootstrap, vLLM NIXL pull).
    Transfer(String),
}

impl From<Box<Resp>> for Refusal {
    fn from(r: Box<Resp>) -> Self {
        Refusal::Resp(r)
    }
}

fn fetch_error(e: &FetchError) -> Refusal {
    Refusal::Transfer(format!("KV transfer failed: {e}"))
}

/// The answer of a decode leg whose KV never arrived, as each engine gives it. Both have sent
/// their `200` head before they know, when streaming: vLLM finishes the request with
/// `finish_reason = "error"`, which its OpenAI server turns into an SSE error event after the
/// chat role preamble (`_raise_if_error`, `_convert_generation_error_to_streaming_response`) or
/// a `500` when not streaming; SGLang's `/generate` stream ends with an error event
/// (`serve_generate_request`), a non-streaming request gets a `500`.
fn transfer_failed(shared: &Shared, flavor: Flavor, kind: Kind, body: &Value, message: &str) -> Resp {
    shared.pd_transfer_failures.fetch_add(1, Ordering::SeqCst);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let (message, error) = match flavor {
        Flavor::Vllm => (
            "Internal server error",
            json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}),
        ),
        Flavor::Sglang => (
            message,
            json!({"error": {"message": message, "type": "invalid_request_error", "code": 500, "retryable": false}}),
        ),
    };
    if !stream {
        return error_resp(flavor, kind, StatusCode::INTERNAL_SERVER_ERROR, message);
    }
    let mut sse_body = Vec::new();
    if flavor == Flavor::Vllm && kind == Kind::Chat {
        let model = body.get("model").and_then(Value::as_str).unwrap_or(&shared.cfg.model_name);
        let role = json!({
            "id": format!("chatcmpl-{}", hex_id()), "object": "chat.completion.chunk", "created": unix_now(), "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
        });
        sse_body.extend_from_slice(&sse(&role.to_string()));
    }
    sse_body.extend_from_slice(&sse(&error.to_string()));
    sse_body.extend_from_slice(SSE_DONE);
    let mut r = super::full(StatusCode::OK, "text/event-stream", sse_body);
    r.headers_mut().insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

async fn generate(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    flavor: Flavor,
    kind: Kind,
) -> Result<Resp, Cut> {
    let _inflight = InflightGuard::new(&shared.inflight_http);
    let watch = ClientWatch::new(&shared);
    let answer = generate_answer(&shared, req, flavor, kind).await;
    watch.done();
    answer
}

async fn generate_answer(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    flavor: Flavor,
    kind: Kind,
) -> Result<Resp, Cut> {
    let (parts, body) = match read_json(req).await {
        Ok(v) => v,
        Err(r) => return Ok(r),
    };
    if let Some(tp) = parts.headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        shared.saw_traceparent(tp);
    }
    if let Some(status) = shared.faults.take_failure() {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut r = error_resp(flavor, kind, status, "simulated fault");
        if matches!(status.as_u16(), 429 | 503) {
            // Two seconds: what a client gets through a gateway tells the worker's own apart
            // from a gateway's one-second default.
            r.headers_mut().insert(http::header::RETRY_AFTER, HeaderValue::from_static("2"));
        }
        return Ok(r);
    }
    match prepare(shared, &parts, &body, flavor, kind).await {
        Ok((ctx, items)) => run(Arc::clone(shared), ctx, items).await,
        Err(Refusal::Resp(r)) => Ok(*r),
        Err(Refusal::Transfer(message)) => Ok(transfer_failed(shared, flavor, kind, &body, &message)),
    }
}

async fn prepare(
    shared: &Arc<Shared>,
    parts: &http::request::Parts,
    body: &Value,
    flavor: Flavor,
    kind: Kind,
) -> Result<(Ctx, Vec<Item>), Refusal> {
    let lora = resolve_lora(shared, flavor, kind, body)?;
    let (prompts, batch) = prompts(shared, flavor, kind, body)?;
    let max_tokens = match kind {
        Kind::Generate => {
            body.get("sampling_params").and_then(|s| s.get("max_new_tokens")).and_then(Value::as_u64)
        }
        Kind::Chat => body
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| body.get("max_tokens").and_then(Value::as_u64)),
        Kind::Completion => body.get("max_tokens").and_then(Value::as_u64),
    }
    .map_or(shared.cfg.default_max_tokens, |v| usize::try_from(v).unwrap_or(usize::MAX));
    for p in &prompts {
        if p.is_empty() {
            return Err(bad(flavor, kind, "The prompt cannot be empty").into());
        }
        if p.len().saturating_add(max_tokens) > shared.cfg.max_model_len {
            // Each engine's own wording (vLLM's serving layer; SGLang's tokenizer manager).
            let message = match flavor {
                Flavor::Vllm => format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion).",
                    shared.cfg.max_model_len,
                    p.len() + max_tokens,
                    p.len(),
                    max_tokens
                ),
                Flavor::Sglang => format!(
                    "Requested token count exceeds the model's maximum context length of {} tokens. You requested a total of {} tokens: {} tokens from the input messages and {} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                    shared.cfg.max_model_len,
                    p.len() + max_tokens,
                    p.len(),
                    max_tokens
                ),
            };
            return Err(bad(flavor, kind, &message).into());
        }
    }
    let header = |k: &str| parts.headers.get(k).and_then(|h| h.to_str().ok()).map(str::to_owned);
    let request_id = header("x-request-id");
    let rid = body.get("rid").and_then(Value::as_str).map(str::to_owned);
    // vLLM seeds its id from `X-Request-Id`; SGLang takes the body's `rid` first.
    let base = match flavor {
        Flavor::Vllm => request_id.clone().or(rid),
        Flavor::Sglang => rid.or_else(|| request_id.clone()),
    }
    .unwrap_or_else(hex_id);
    let id = match (flavor, kind) {
        (Flavor::Vllm, Kind::Chat) => format!("chatcmpl-{base}"),
        (Flavor::Vllm, _) => format!("cmpl-{base}"),
        (Flavor::Sglang, _) => base.clone(),
    };
    let session_id = match flavor {
        Flavor::Vllm => {
            str_field(body, "session_id").or_else(|| header("x-session-id").map(Arc::from)).or_else(|| {
                body.get("vllm_xargs")
                    .and_then(|x| x.get("session_id"))
                    .and_then(Value::as_str)
                    .map(Arc::from)
            })
        }
        Flavor::Sglang => str_field(body, "session_id").or_else(|| {
            body.get("session_params").and_then(|s| s.get("id")).and_then(Value::as_str).map(Arc::from)
        }),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let model = body.get("model").and_then(Value::as_str).unwrap_or(&shared.cfg.model_name).to_owned();
    let ctx = Ctx {
        flavor,
        kind,
        id: id.clone(),
        model,
        created: unix_now(),
        arrived_us: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros()),
        stream,
        include_usage,
        batch,
        request_id,
    };

    let mut items = Vec::with_capacity(prompts.len());
    for (i, tokens) in prompts.into_iter().enumerate() {
        let pinned = pinned_rank(shared, flavor, kind, parts, body, i)?;
        let mut pd = PdMode::None;
        let mut first_token = None;
        let mut prefill_cached = None;
        let mut rank = pinned;
        match flavor {
            Flavor::Vllm => {
                if let Some(kv) = body.get("kv_transfer_params").filter(|v| v.is_object()) {
                    let flag = |k: &str| kv.get(k).and_then(Value::as_bool).unwrap_or(false);
                    if flag("do_remote_decode") && shared.cfg.role == Role::Prefill {
                        pd = PdMode::VllmPrefill;
                    } else if flag("do_remote_prefill") && shared.cfg.role == Role::Decode {
                        vllm_fetch(shared, flavor, kind, kv, tokens.len()).await?;
                        if shared.faults.take_transfer_failure() {
                            return Err(Refusal::Transfer("simulated NIXL read failure".to_owned()));
                        }
                        pd = PdMode::VllmDecode;
                    }
                }
            }
            Flavor::Sglang => {
                if let Some(room) = list_or_scalar(body.get("bootstrap_room"), i).and_then(u64_field) {
                    match shared.cfg.role {
                        Role::Prefill => {
                            pd = PdMode::SglangPrefill { room };
                            let dp = u64::from(shared.cfg.dp_size);
                            rank = rank.or_else(|| u16::try_from(room % dp).ok());
                        }
                        Role::Decode => {
                            let host = list_or_scalar(body.get("bootstrap_host"), i)
                                .and_then(Value::as_str)
                                .unwrap_or("127.0.0.1");
                            let port = list_or_scalar(body.get("bootstrap_port"), i)
                                .and_then(u64_field)
                                .and_then(|p| u16::try_from(p).ok())
                                .unwrap_or(8998);
                            let (tok, cached) =
                                sglang_fetch(flavor, kind, shared, host, port, room, tokens.len()).await?;
                            if shared.faults.take_transfer_failure() {
                                return Err(Refusal::Transfer("simulated KV transfer failure".to_owned()));
                            }
                            first_token = Some(tok);
                            prefill_cached = Some(cached);
                            pd = PdMode::SglangDecode;
                        }
                        Role::Unified => {}
                    }
                } else if shared.cfg.role != Role::Unified {
                    // SGLang's scheduler refuses it in a disaggregation mode (a decode worker
                    // cannot prefill alone; `Scheduler.handle_generate_request`).
                    return Err(bad(
                        flavor,
                        kind,
                        "Invalid request: Disaggregated request received without bootstrap room id.",
                    )
                    .into());
                }
            }
        }
        let rank = rank.unwrap_or_else(|| balance(shared, flavor));
        let extra_key = match flavor {
            Flavor::Sglang => body.get("extra_key").and_then(Value::as_str).map(str::to_owned),
            Flavor::Vllm => None,
        };
        let rid = match flavor {
            Flavor::Vllm if kind == Kind::Chat => format!("{id}-{:08x}", fastrand::u32(..)),
            Flavor::Vllm => format!("{id}-{i}-{:08x}", fastrand::u32(..)),
            Flavor::Sglang if ctx.batch => format!("{id}-{i}"),
            Flavor::Sglang => id.clone(),
        };
        items.push(Item {
            rank,
            new: NewRequest {
                rid,
                tokens,
                max_tokens,
                keys: ReqKeys {
                    lora: lora.clone(),
                    cache_salt: str_field(body, "cache_salt"),
                    session_id: session_id.clone(),
                    extra_key,
                },
                pd,
                first_token,
                prefill_cached,
            },
        });
    }
    Ok((ctx, items))
}

async fn vllm_fetch(
    shared: &Shared,
    flavor: Flavor,
    kind: Kind,
    kv: &Value,
    prompt_len: usize,
) -> Result<(), Refusal> {
    let host = kv.get("remote_host").and_then(Value::as_str).unwrap_or("localhost");
    let port = kv.get("remote_port").and_then(u64_field).and_then(|p| u16::try_from(p).ok());
    let rid = kv.get("remote_request_id").and_then(Value::as_str);
    let (Some(port), Some(rid)) = (port, rid) else {
        return Err(bad(flavor, kind, "kv_transfer_params needs remote_port and remote_request_id").into());
    };
    if let Some(n) = kv.get("remote_num_tokens").and_then(Value::as_u64)
        && usize::try_from(n).ok() != Some(prompt_len)
    {
        return Err(bad(flavor, kind, "kv_transfer_params were computed for another prompt").into());
    }
    let addr = resolve(host, port).await.ok_or_else(|| {
        fetch_error(&FetchError::Connect(std::io::Error::other("cannot resolve remote_host")))
    })?;
    call(addr, Method::POST, &format!("/sim/pd/vllm/lease/{rid}"), shared.cfg.pd.bootstrap_timeout)
        .await
        .map(|_| ())
        .map_err(|e| fetch_error(&e))
}

/// The decode leg's side of a bootstrap room: the prefill's first token and `cached_tokens`.
async fn sglang_fetch(
    flavor: Flavor,
    kind: Kind,
    shared: &Shared,
    host: &str,
    port: u16,
    room: u64,
    prompt_len: usize,
) -> Result<(u32, usize), Refusal> {
    let wait = shared.cfg.pd.bootstrap_timeout;
    let addr = resolve(host, port).await.ok_or_else(|| {
        fetch_error(&FetchError::Connect(std::io::Error::other("cannot resolve bootstrap_host")))
    })?;
    let path = format!("/sim/pd/sglang/room/{room}?timeout_ms={}", wait.as_millis());
    let body =
        call(addr, Method::GET, &path, wait + Duration::from_secs(1)).await.map_err(|e| fetch_error(&e))?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if v.get("prompt_tokens").and_then(Value::as_u64).and_then(|n| usize::try_from(n).ok())
        != Some(prompt_len)
    {
        return Err(bad(flavor, kind, "the prefill leg of this bootstrap_room had another prompt").into());
    }
    let tok = v.get("first_token").and_then(Value::as_u64).and_then(|t| u32::try_from(t).ok()).unwrap_or(0);
    let cached =
        v.get("cached_tokens").and_then(Value::as_u64).and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
    Ok((tok, cached))
}

/// One batch item's progress.
struct Track {
    stats: Option<ReqStats>,
    tokens: Vec<u32>,
    text: String,
    pd: Option<PdOutcome>,
    rid: String,
    done: bool,
}

fn failure_resp(ctx: &Ctx, f: &Failure) -> Resp {
    match f {
        Failure::TooLarge => *bad(ctx.flavor, ctx.kind, "the prompt does not fit in the KV cache"),
        Failure::TransferTimeout => error_resp(
            ctx.flavor,
            ctx.kind,
            StatusCode::INTERNAL_SERVER_ERROR,
            "KV transfer failed: the decode side never fetched this bootstrap room",
        ),
        Failure::Aborted => {
            error_resp(ctx.flavor, ctx.kind, StatusCode::SERVICE_UNAVAILABLE, "request aborted")
        }
    }
}

async fn run(shared: Arc<Shared>, ctx: Ctx, items: Vec<Item>) -> Result<Resp, Cut> {
    let die_after = shared.faults.take_death();
    let n = items.len();
    let mut tracks: Vec<Track> = Vec::with_capacity(n);
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, ReqEvent)>();
    for (i, it) in items.into_iter().enumerate() {
        let Some(rank) = shared.ranks.get(usize::from(it.rank)) else { continue };
        tracks.push(Track {
            stats: None,
            tokens: Vec::new(),
            text: String::new(),
            pd: None,
            rid: it.new.rid.clone(),
            done: false,
        });
        let mut erx = rank.submit(it.new);
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = erx.recv() => match ev {
                        Some(ev) => if tx.send((i, ev)).is_err() { return },
                        None => return,
                    },
                    () = tx.closed() => return,
                }
            }
        });
    }
    drop(tx);
    // Wait until every item has started (or one failed).
    let mut pending: Vec<(usize, ReqEvent)> = Vec::new();
    while tracks.iter().any(|t| t.stats.is_none()) {
        match rx.recv().await {
            Some((i, ReqEvent::Started(s))) => tracks[i].stats = Some(s),
            Some((_, ReqEvent::Failed(f))) => return Ok(failure_resp(&ctx, &f)),
            Some(ev) => pending.push(ev),
            None => return Ok(failure_resp(&ctx, &Failure::Aborted)),
        }
    }
    let headers = timing_headers(&ctx, tracks.first().and_then(|t| t.stats.as_ref()));
    if ctx.stream {
        let (btx, brx) = mpsc::channel::<Chunk>(64);
        let mut resp = Response::new(SimBody::Stream(brx));
        resp.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        resp.headers_mut().insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        for (k, v) in headers {
            resp.headers_mut().insert(k, v);
        }
        tokio::spawn(pump(ctx, tracks, pending, rx, btx, die_after, shared));
        return Ok(resp);
    }
    // Non-streaming: collect everything.
    let mut sent = 0usize;
    let mut queue: std::collections::VecDeque<(usize, ReqEvent)> = pending.into();
    loop {
        let ev = match queue.pop_front() {
            Some(ev) => ev,
            None => match rx.recv().await {
                Some(ev) => ev,
                None => break,
            },
        };
        match ev {
            (i, ReqEvent::Token { id, text }) => {
                tracks[i].tokens.push(id);
                tracks[i].text.push_str(&text);
                sent += 1;
                if die_after.is_some_and(|d| sent >= d) {
                    return Err(Cut);
                }
            }
            (i, ReqEvent::Finished { stats, pd }) => {
                tracks[i].stats = Some(stats);
                tracks[i].pd = pd;
                tracks[i].done = true;
                if tracks.iter().all(|t| t.done) {
                    break;
                }
            }
            (_, ReqEvent::Failed(f)) => return Ok(failure_resp(&ctx, &f)),
            (i, ReqEvent::Started(s)) => tracks[i].stats = Some(s),
        }
    }
    if !tracks.iter().all(|t| t.done) {
        return Ok(failure_resp(&ctx, &Failure::Aborted));
    }
    if die_after.is_some() {
        // Dies before the end of the response even if fewer tokens were generated.
        return Err(Cut);
    }
    let body = final_body(&ctx, &tracks, &shared);
    let mut resp = json_resp(StatusCode::OK, &body);
    for (k, v) in headers {
        resp.headers_mut().insert(k, v);
    }
    Ok(resp)
}

fn timing_headers(ctx: &Ctx, s: Option<&ReqStats>) -> Vec<(http::HeaderName, HeaderValue)> {
    let mut h = Vec::new();
    let mut put = |k: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.push((http::HeaderName::from_static(k), v));
        }
    };
    put("x-request-id", ctx.request_id.clone().unwrap_or_else(|| ctx.id.clone()));
    put("x-sim-arrived-unix-us", ctx.arrived_us.to_string());
    if let Some(s) = s {
        put("x-sim-ttft-ms", format!("{:.3}", s.ttft.as_secs_f64() * 1e3));
        put("x-sim-queue-ms", format!("{:.3}", s.queue.as_secs_f64() * 1e3));
        put("x-sim-cached-tokens", s.cached_tokens.to_string());
        put("x-sim-prompt-tokens", s.prompt_tokens.to_string());
        put("x-sim-dp-rank", s.rank.to_string());
    }
    h
}

fn usage(tracks: &[Track]) -> Value {
    let prompt: usize = tracks.iter().filter_map(|t| t.stats.as_ref()).map(|s| s.prompt_tokens).sum();
    let completion: usize = tracks.iter().map(|t| t.tokens.len()).sum();
    let cached: usize = tracks.iter().filter_map(|t| t.stats.as_ref()).map(|s| s.cached_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn kv_params(shared: &Shared, t: &Track) -> Value {
    match (&t.pd, shared.pd_addr, &t.stats) {
        (Some(pd), Some(addr), Some(s)) => vllm_transfer_params(
            pd,
            &t.rid,
            &format!("{}_dp{}", shared.engine_id, s.rank),
            &addr.ip().to_string(),
            addr.port(),
            s.prompt_tokens,
        ),
        _ => Value::Null,
    }
}

fn sglang_meta(ctx: &Ctx, t: &Track, finished: bool, pd_prefill: bool) -> Value {
    let s = t.stats.as_ref();
    let finish = if finished {
        json!({"type": "length", "length": if pd_prefill { 0 } else { t.tokens.len() }})
    } else {
        Value::Null
    };
    json!({
        "id": if ctx.batch { t.rid.clone() } else { ctx.id.clone() },
        "finish_reason": finish,
        "prompt_tokens": s.map_or(0, |s| s.prompt_tokens),
        "weight_version": "default",
        "completion_tokens": t.tokens.len(),
        "cached_tokens": s.map_or(0, |s| s.cached_tokens),
        "e2e_latency": s.map_or(0.0, |s| s.e2e.as_secs_f64()),
        "total_retractions": 0,
    })
}

fn final_body(ctx: &Ctx, tracks: &[Track], shared: &Shared) -> Value {
    let pd_prefill = shared.cfg.role == Role::Prefill;
    match ctx.kind {
        Kind::Generate => {
            let one = |t: &Track| json!({"text": t.text, "output_ids": t.tokens, "meta_info": sglang_meta(ctx, t, true, pd_prefill)});
            if ctx.batch {
                Value::Array(tracks.iter().map(one).collect())
            } else {
                tracks.first().map_or(Value::Null, one)
            }
        }
        Kind::Completion => {
            let choices: Vec<Value> = tracks
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    json!({"index": i, "text": t.text, "logprobs": null, "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null})
                })
                .collect();
            let mut v = json!({
                "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                "choices": choices, "usage": usage(tracks),
            });
            if ctx.flavor == Flavor::Vllm {
                v["system_fingerprint"] = Value::Null;
                v["kv_transfer_params"] = tracks.first().map_or(Value::Null, |t| kv_params(shared, t));
            }
            v
        }
        Kind::Chat => {
            let t = tracks.first();
            let mut v = json!({
                "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": t.map_or(String::new(), |t| t.text.clone()), "reasoning_content": null, "tool_calls": []},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }],
                "usage": usage(tracks),
            });
            if ctx.flavor == Flavor::Vllm {
                v["prompt_logprobs"] = Value::Null;
                v["kv_transfer_params"] = t.map_or(Value::Null, |t| kv_params(shared, t));
            }
            v
        }
    }
}

fn chunk(ctx: &Ctx, i: usize, t: &Track, delta: &str, finished: bool, shared: &Shared) -> Value {
    let fr = if finished { json!("length") } else { Value::Null };
    match ctx.kind {
        Kind::Completion => {
            let mut v = json!({
                "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                "choices": [{"index": i, "text": delta, "logprobs": null, "finish_reason": fr, "stop_reason": null}],
            });
            if finished && ctx.flavor == Flavor::Vllm && t.pd.is_some() {
                v["kv_transfer_params"] = kv_params(shared, t);
            }
            v
        }
        Kind::Chat => {
            let mut v = json!({
                "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
                "choices": [{"index": i, "delta": {"content": delta}, "logprobs": null, "finish_reason": fr}],
            });
            if finished && ctx.flavor == Flavor::Vllm && t.pd.is_some() {
                v["kv_transfer_params"] = kv_params(shared, t);
            }
            v
        }
        Kind::Generate => {
            let mut v = json!({"text": t.text, "output_ids": t.tokens, "meta_info": sglang_meta(ctx, t, finished, shared.cfg.role == Role::Prefill)});
            if ctx.batch {
                v["index"] = json!(i);
            }
            v
        }
    }
}

async fn pump(
    ctx: Ctx,
    mut tracks: Vec<Track>,
    pending: Vec<(usize, ReqEvent)>,
    mut rx: mpsc::UnboundedReceiver<(usize, ReqEvent)>,
    out: mpsc::Sender<Chunk>,
    die_after: Option<usize>,
    shared: Arc<Shared>,
) {
    let watch = ClientWatch::new(&shared);
    if pump_events(&ctx, &mut tracks, pending, &mut rx, &out, die_after, &shared).await {
        watch.done();
    }
}

/// Streams the answer; false when the client left before it was complete.
async fn pump_events(
    ctx: &Ctx,
    tracks: &mut [Track],
    pending: Vec<(usize, ReqEvent)>,
    rx: &mut mpsc::UnboundedReceiver<(usize, ReqEvent)>,
    out: &mpsc::Sender<Chunk>,
    die_after: Option<usize>,
    shared: &Shared,
) -> bool {
    if ctx.kind == Kind::Chat {
        for i in 0..tracks.len() {
            let role = json!({
                "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
            });
            if !send(out, &role).await {
                return false;
            }
        }
    }
    let mut queue: std::collections::VecDeque<(usize, ReqEvent)> = pending.into();
    // A token is held back one event so the last one can carry `finish_reason`, as vLLM does.
    let mut held: Vec<Option<String>> = vec![None; tracks.len()];
    let mut sent = 0usize;
    loop {
        let ev = match queue.pop_front() {
            Some(ev) => ev,
            None => tokio::select! {
                ev = rx.recv() => match ev { Some(ev) => ev, None => break },
                () = out.closed() => return false,
            },
        };
        match ev {
            (i, ReqEvent::Token { id, text }) => {
                if let Some(prev) = held[i].take() {
                    if !send(out, &chunk(ctx, i, &tracks[i], &prev, false, shared)).await {
                        return false;
                    }
                    sent += 1;
                    if die_after.is_some_and(|d| sent >= d) {
                        cut(out).await;
                        return true;
                    }
                }
                tracks[i].tokens.push(id);
                tracks[i].text.push_str(&text);
                held[i] = Some(text.to_string());
            }
            (i, ReqEvent::Finished { stats, pd }) => {
                tracks[i].stats = Some(stats);
                tracks[i].pd = pd;
                tracks[i].done = true;
                let last = held[i].take().unwrap_or_default();
                if die_after.is_some() {
                    cut(out).await;
                    return true;
                }
                if !send(out, &chunk(ctx, i, &tracks[i], &last, true, shared)).await {
                    return false;
                }
                if tracks.iter().all(|t| t.done) {
                    break;
                }
            }
            (i, ReqEvent::Started(s)) => tracks[i].stats = Some(s),
            (_, ReqEvent::Failed(f)) => {
                let msg = match f {
                    Failure::TooLarge => "the prompt does not fit in the KV cache",
                    Failure::TransferTimeout => "KV transfer failed",
                    Failure::Aborted => "request aborted",
                };
                let _ = send(out, &json!({"error": {"message": msg, "type": "InternalServerError", "param": null, "code": 500}})).await;
                let _ = out.send(Chunk::Data(bytes::Bytes::from_static(SSE_DONE))).await;
                return true;
            }
        }
    }
    if !tracks.iter().all(|t| t.done) {
        cut(out).await;
        return true;
    }
    if ctx.include_usage && ctx.kind != Kind::Generate {
        let object = if ctx.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut u = Map::new();
        u.insert("id".to_owned(), json!(ctx.id));
        u.insert("object".to_owned(), json!(object));
        u.insert("created".to_owned(), json!(ctx.created));
        u.insert("model".to_owned(), json!(ctx.model));
        u.insert("choices".to_owned(), json!([]));
        u.insert("usage".to_owned(), usage(tracks));
        let _ = send(out, &Value::Object(u)).await;
    }
    out.send(Chunk::Data(bytes::Bytes::from_static(SSE_DONE))).await.is_ok()
}

async fn send(out: &mpsc::Sender<Chunk>, v: &Value) -> bool {
    out.send(Chunk::Data(sse(&v.to_string()))).await.is_ok()
}

/// Cuts the connection once hyper has taken (and so written) every chunk sent before: the
/// connection task runs on the same single-threaded runtime, so once the channel is drained and
/// this task runs again, the chunks are on the socket.
async fn cut(out: &mpsc::Sender<Chunk>) {
    while out.capacity() < out.max_capacity() && !out.is_closed() {
        tokio::task::yield_now().await;
    }
    tokio::task::yield_now().await;
    let _ = out.send(Chunk::Cut).await;
}
