//! Errors of the data plane, and the one place where an error becomes an HTTP response or an SSE
//! error event.
//!
//! Key decisions:
//! - Deep code returns a typed [`ProxyError`] that says who is to blame and whether a retry on
//!   another worker is safe; only [`ProxyError::into_response`], [`ProxyError::sse_event`] and
//!   [`refusal`] (a worker's own refusal, rewritten) turn errors into bytes.
//! - Each route answers in its clients' format ([`ErrorFormat`]): the OpenAI routes (and every
//!   route of Cortex's own) in OpenAI's error object `{"error": {"message", "type", "param",
//!   "code"}}`, SGLang's native `/generate` in SGLang's `{"error": {"message", "code"}}`. The
//!   mid-stream SSE error event uses the same format.
//! - A worker's refusal keeps the worker's status and message; what Cortex knows of it (its
//!   failure class, such as `context_length_exceeded`) becomes `code`, so an OpenAI SDK raises
//!   the right typed exception whichever engine refused.

use bytes::Bytes;
use cortex_sched::FailureClass;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

/// The error a response body may end with (hyper then aborts the connection).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the gateway writes.
pub type Body = UnsyncBoxBody<Bytes, BodyError>;

/// How a route writes its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorFormat {
    /// OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// SGLang's native API (`/generate`): `{"error": {"message", "code"}}`.
    Sglang,
}

impl ErrorFormat {
    /// The format of `route`'s clients.
    #[must_use]
    pub const fn of(route: crate::request::Route) -> Self {
        match route {
            crate::request::Route::Generate => ErrorFormat::Sglang,
            crate::request::Route::ChatCompletions | crate::request::Route::Completions => {
                ErrorFormat::OpenAi
            }
        }
    }

    /// The error body of `message`, OpenAI `kind` and `code`.
    #[must_use]
    pub fn body(self, message: &str, kind: &str, code: &str) -> serde_json::Value {
        match self {
            ErrorFormat::OpenAi => serde_json::json!({
                "error": {"message": message, "type": kind, "param": serde_json::Value::Null, "code": code}
            }),
            ErrorFormat::Sglang => serde_json::json!({"error": {"message": message, "code": code}}),
        }
    }
}

/// Who caused an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blame {
    /// The client's request is wrong.
    Client,
    /// The gateway itself (overload, no worker, a bug).
    Gateway,
    /// The worker that served (or refused) the request.
    Worker,
}

/// Everything that can go wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The body exceeds the configured limit.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The client did not send its body in time.
    #[error("request body not received within {0:?}")]
    BodyTimeout(std::time::Duration),
    /// Reading the request body failed.
    #[error("cannot read request body: {0}")]
    BodyRead(String),
    /// The body is not the JSON the route expects.
    #[error("invalid JSON body: {0}")]
    MalformedJson(String),
    /// A field has the wrong type or value.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No model of that name is served.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The request names no model and the gateway serves several.
    #[error("`model` is required: this gateway serves {}", .0.join(", "))]
    ModelRequired(Vec<String>),
    /// The model's engine does not serve the route (SGLang's `/generate` for a vLLM model).
    #[error("{route} is not served for `{model}`: its workers run {engine}, which has no such route{hint}")]
    UnsupportedRoute {
        /// The route's path.
        route: &'static str,
        /// The model named.
        model: String,
        /// The model's engine.
        engine: &'static str,
        /// What to use instead.
        hint: &'static str,
    },
    /// No route matches.
    #[error("no route for {method} {path}")]
    NotFound {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
    },
    /// The admin API names a worker that does not exist (404 `not_found`).
    #[error("no worker named `{0}` exists")]
    UnknownWorker(String),
    /// The route exists but not with this method (405, with the route's methods in `Allow`).
    #[error("method {method} not allowed here: use {allow}{note}")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The methods the route takes, as the `Allow` header lists them (`GET, POST`).
        allow: &'static str,
        /// More on what the route takes, appended to the message (empty, or `, whose body …`).
        note: &'static str,
    },
    /// Missing or wrong bearer token (answered with `WWW-Authenticate: Bearer`).
    #[error("unauthorized")]
    Unauthorized,
    /// Too many requests in flight and the queue is full.
    #[error("the gateway is at capacity; retry later")]
    Overloaded,
    /// Waited in the queue longer than allowed.
    #[error("the request waited {0:?} in the gateway's queue")]
    QueueTimeout(std::time::Duration),
    /// No worker can take the request (none healthy, all cooling down, or none serves the model).
    #[error("no worker is available for model `{0}`")]
    NoWorker(String),
    /// Every attempt failed; the last failure's class and message.
    #[error("upstream failed after {attempts} attempt(s): {message}")]
    Upstream {
        /// How the last failure was classified.
        class: FailureClass,
        /// Attempts made.
        attempts: u32,
        /// What went wrong, for the client.
        message: String,
        /// The last failing worker's `Retry-After` in seconds, passed on to the client.
        retry_after: Option<u32>,
    },
    /// The gateway is shutting down.
    #[error("the gateway is shutting down")]
    ShuttingDown,
    /// A bug or an unexpected failure in the gateway.
    #[error("internal gateway error: {0}")]
    Internal(String),
}

impl ProxyError {
    /// Who is to blame.
    #[must_use]
    pub fn blame(&self) -> Blame {
        match self {
            ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout(_)
            | ProxyError::BodyRead(_)
            | ProxyError::MalformedJson(_)
            | ProxyError::InvalidRequest(_)
            | ProxyError::UnknownModel(_)
            | ProxyError::ModelRequired(_)
            | ProxyError::UnsupportedRoute { .. }
            | ProxyError::NotFound { .. }
            | ProxyError::UnknownWorker(_)
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::Unauthorized => Blame::Client,
            ProxyError::Overloaded
            | ProxyError::QueueTimeout(_)
            | ProxyError::NoWorker(_)
            | ProxyError::ShuttingDown
            | ProxyError::Internal(_) => Blame::Gateway,
            ProxyError::Upstream { .. } => Blame::Worker,
        }
    }

    /// Whether the client may safely send the same request again.
    #[must_use]
    pub fn retry_safe(&self) -> bool {
        match self {
            ProxyError::Overloaded
            | ProxyError::QueueTimeout(_)
            | ProxyError::NoWorker(_)
            | ProxyError::ShuttingDown
            | ProxyError::BodyTimeout(_) => true,
            ProxyError::Upstream { class, .. } => retry_elsewhere(*class),
            _ => false,
        }
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::BodyRead(_)
            | ProxyError::MalformedJson(_)
            | ProxyError::InvalidRequest(_)
            | ProxyError::ModelRequired(_)
            | ProxyError::UnsupportedRoute { .. } => StatusCode::BAD_REQUEST,
            ProxyError::UnknownModel(_) | ProxyError::NotFound { .. } | ProxyError::UnknownWorker(_) => {
                StatusCode::NOT_FOUND
            }
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::QueueTimeout(_) | ProxyError::NoWorker(_) | ProxyError::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::Upstream { class, .. } => match class {
                FailureClass::RateLimited => StatusCode::TOO_MANY_REQUESTS,
                FailureClass::Timeout => StatusCode::GATEWAY_TIMEOUT,
                FailureClass::ContextLengthExceeded | FailureClass::ContentPolicy => StatusCode::BAD_REQUEST,
                FailureClass::QuotaExhausted => StatusCode::TOO_MANY_REQUESTS,
                FailureClass::ServerError => StatusCode::BAD_GATEWAY,
            },
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's error `type`.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self.blame() {
            Blame::Client => "invalid_request_error",
            Blame::Gateway | Blame::Worker => match self {
                ProxyError::Overloaded => "rate_limit_error",
                ProxyError::Upstream { class: FailureClass::RateLimited, .. } => "rate_limit_error",
                _ => "server_error",
            },
        }
    }

    /// OpenAI's error `code`: a stable machine-readable name.
    #[must_use]
    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::BodyTimeout(_) => "request_timeout",
            ProxyError::BodyRead(_) => "body_read_failed",
            ProxyError::MalformedJson(_) => "invalid_json",
            ProxyError::InvalidRequest(_) => "invalid_request",
            ProxyError::UnknownModel(_) => "model_not_found",
            ProxyError::ModelRequired(_) => "model_required",
            ProxyError::UnsupportedRoute { .. } => "unsupported_route",
            ProxyError::NotFound { .. } | ProxyError::UnknownWorker(_) => "not_found",
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::Unauthorized => "unauthorized",
            ProxyError::Overloaded => "gateway_overloaded",
            ProxyError::QueueTimeout(_) => "queue_timeout",
            ProxyError::NoWorker(_) => "no_worker_available",
            ProxyError::Upstream { class, .. } => class.as_str(),
            ProxyError::ShuttingDown => "shutting_down",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    /// The JSON error object, in OpenAI's format.
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        self.json_in(ErrorFormat::OpenAi)
    }

    /// The JSON error object in `format`.
    #[must_use]
    pub fn json_in(&self, format: ErrorFormat) -> serde_json::Value {
        format.body(&self.to_string(), self.kind(), self.code())
    }

    /// Whether this error is answered before the request's body is read (a refused length, a
    /// slow or broken body, a refused token, a route that does not exist, shutdown). On HTTP/1.1
    /// hyper then closes the connection, so the answer says `Connection: close`
    /// ([`close_connection`]): a client that pooled the connection would send its next request
    /// into a closing socket.
    #[must_use]
    pub fn precedes_body(&self) -> bool {
        matches!(
            self,
            ProxyError::BodyTooLarge { .. }
                | ProxyError::BodyTimeout(_)
                | ProxyError::BodyRead(_)
                | ProxyError::Unauthorized
                | ProxyError::NotFound { .. }
                | ProxyError::MethodNotAllowed { .. }
                | ProxyError::ShuttingDown
        )
    }

    /// The HTTP response for this error in OpenAI's format, carrying `x-request-id`.
    #[must_use]
    pub fn into_response(self, request_id: &str) -> Response<Body> {
        self.into_response_in(request_id, ErrorFormat::OpenAi)
    }

    /// The HTTP response for this error in `format`, carrying `x-request-id`, `retry-after: 1`
    /// when sending it again is safe, `www-authenticate: Bearer` on a 401 and `allow` on a 405.
    #[must_use]
    pub fn into_response_in(self, request_id: &str, format: ErrorFormat) -> Response<Body> {
        let body = Bytes::from(self.json_in(format).to_string());
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert("x-request-id", v);
        }
        if let ProxyError::Upstream { retry_after: Some(s), .. } = &self {
            h.insert(http::header::RETRY_AFTER, HeaderValue::from(*s));
        } else if self.retry_safe() {
            h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        match self {
            ProxyError::Unauthorized => {
                h.insert(http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ProxyError::MethodNotAllowed { allow, .. } => {
                h.insert(http::header::ALLOW, HeaderValue::from_static(allow));
            }
            _ => {}
        }
        resp
    }

    /// A well-formed SSE error event in `format` followed by `data: [DONE]`, for a stream that
    /// already started: vLLM and SGLang end their own streams this way.
    #[must_use]
    pub fn sse_event(&self, format: ErrorFormat) -> Bytes {
        Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", self.json_in(format)))
    }
}

/// Marks an HTTP/1.1 answer given while the request's body is still unread as the connection's
/// last (`Connection: close`): hyper closes such a connection after the answer, and a client
/// that does not know it reuses a dying socket. HTTP/2 streams are independent: nothing to do.
pub fn close_connection(resp: &mut Response<Body>, version: http::Version) {
    if version < http::Version::HTTP_2 {
        resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// A worker's refusal (an error that is the request's own: another worker would answer the
/// same), rewritten in the route's `format`: the worker's status and message are kept, `code` is
/// the failure class Cortex gave it (`context_length_exceeded`, …) or, for an ordinary refusal,
/// a name of the status; the worker's end-to-end headers are kept but its body's type.
#[must_use]
pub fn refusal(
    status: StatusCode,
    mut headers: HeaderMap,
    body: &[u8],
    class: Option<FailureClass>,
    format: ErrorFormat,
) -> Response<Body> {
    let message = worker_message(body).unwrap_or_else(|| format!("the worker answered {status}"));
    let code = class.map_or_else(|| refusal_code(status), FailureClass::as_str);
    let kind = match status.as_u16() {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let json = format.body(&message, kind, code);
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if status == StatusCode::UNAUTHORIZED && !headers.contains_key(http::header::WWW_AUTHENTICATE) {
        // A 401 says how to authenticate (RFC 9110 §15.5.2); the engines use bearer keys.
        headers.insert(http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    let mut resp = Response::new(full(json.to_string()));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// The `code` of a refusal Cortex did not classify, by its status.
fn refusal_code(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        413 => "request_too_large",
        422 | 400 => "invalid_request",
        _ => "upstream_refused",
    }
}

/// The message of a worker's error body: OpenAI's and SGLang's `error.message`, SGLang's
/// OpenAI-route `message`, FastAPI's `detail`, else the text itself; `None` when empty.
#[must_use]
pub fn worker_message(body: &[u8]) -> Option<String> {
    let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let text = json
        .as_ref()
        .and_then(|v| v.pointer("/error/message").or_else(|| v.get("message")).or_else(|| v.get("detail")))
        .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// Whether another worker may succeed where one failed with `class`: yes for the worker's own
/// trouble and refusals, no when the request itself is the problem.
#[must_use]
pub const fn retry_elsewhere(class: FailureClass) -> bool {
    !matches!(class, FailureClass::ContextLengthExceeded | FailureClass::ContentPolicy)
}

/// A body of fixed bytes.
#[must_use]
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_blame() {
        let cases = [
            (ProxyError::BodyTooLarge { limit: 1 }, 413, Blame::Client),
            (ProxyError::BodyTimeout(std::time::Duration::from_secs(1)), 408, Blame::Client),
            (ProxyError::MalformedJson("x".into()), 400, Blame::Client),
            (ProxyError::UnknownModel("m".into()), 404, Blame::Client),
            (ProxyError::UnknownWorker("w".into()), 404, Blame::Client),
            (ProxyError::Overloaded, 429, Blame::Gateway),
            (ProxyError::QueueTimeout(std::time::Duration::from_secs(1)), 503, Blame::Gateway),
            (ProxyError::NoWorker("m".into()), 503, Blame::Gateway),
            (
                ProxyError::Upstream {
                    class: FailureClass::ServerError,
                    attempts: 3,
                    message: "x".into(),
                    retry_after: None,
                },
                502,
                Blame::Worker,
            ),
            (
                ProxyError::Upstream {
                    class: FailureClass::Timeout,
                    attempts: 1,
                    message: "x".into(),
                    retry_after: None,
                },
                504,
                Blame::Worker,
            ),
        ];
        for (e, status, blame) in cases {
            assert_eq!(e.status().as_u16(), status, "{e}");
            assert_eq!(e.blame(), blame, "{e}");
        }
    }

    #[test]
    fn json_is_openai_shaped() {
        let e = ProxyError::UnknownModel("gpt-x".into());
        let v = e.json();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("gpt-x"));
        let sse =
            String::from_utf8(ProxyError::Internal("boom".into()).sse_event(ErrorFormat::OpenAi).to_vec())
                .unwrap();
        assert!(sse.starts_with("data: {\"error\""));
        assert!(sse.ends_with("data: [DONE]\n\n"));
    }

    #[test]
    fn each_format_has_its_own_shape() {
        let e = ProxyError::ModelRequired(vec!["a".into(), "b".into()]);
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let openai = e.json_in(ErrorFormat::OpenAi);
        assert_eq!(openai["error"]["code"], "model_required");
        assert_eq!(openai["error"]["type"], "invalid_request_error");
        assert!(openai["error"].get("param").is_some());
        assert!(openai["error"]["message"].as_str().unwrap().contains("a, b"));
        let sglang = e.json_in(ErrorFormat::Sglang);
        assert_eq!(
            sglang,
            serde_json::json!({"error": {"message": e.to_string(), "code": "model_required"}})
        );
        let sse = String::from_utf8(e.sse_event(ErrorFormat::Sglang).to_vec()).unwrap();
        assert_eq!(sse, format!("data: {sglang}\n\ndata: [DONE]\n\n"));
    }

    #[test]
    fn a_refusal_keeps_the_worker_s_status_and_message_and_gets_cortex_s_code() {
        let body_of = |r: Response<Body>| {
            let status = r.status();
            let b = body_bytes(r);
            (status, serde_json::from_slice::<serde_json::Value>(&b).unwrap())
        };
        // SGLang's OpenAI routes answer `{"object": "error", "code": 400}`.
        let sglang = br#"{"object":"error","message":"Requested token count exceeds the model's maximum context length of 4096 tokens.","type":"BadRequestError","param":null,"code":400}"#;
        let class = Some(FailureClass::ContextLengthExceeded);
        let (status, v) =
            body_of(refusal(StatusCode::BAD_REQUEST, HeaderMap::new(), sglang, class, ErrorFormat::OpenAi));
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().starts_with("Requested token count"));
        assert!(v.get("object").is_none());
        let (_, v) = body_of(refusal(
            StatusCode::BAD_REQUEST,
            HeaderMap::new(),
            br#"{"error":{"message":"bad sampling"}}"#,
            None,
            ErrorFormat::Sglang,
        ));
        assert_eq!(v, serde_json::json!({"error": {"message": "bad sampling", "code": "invalid_request"}}));
        let (status, v) = body_of(refusal(
            StatusCode::NOT_FOUND,
            HeaderMap::new(),
            br#"{"detail":"Not Found"}"#,
            None,
            ErrorFormat::OpenAi,
        ));
        assert_eq!((status.as_u16(), v["error"]["code"].as_str()), (404, Some("not_found")));
        assert_eq!(v["error"]["message"], "Not Found");
        let (_, v) =
            body_of(refusal(StatusCode::BAD_REQUEST, HeaderMap::new(), b"", None, ErrorFormat::OpenAi));
        assert_eq!(v["error"]["message"], "the worker answered 400 Bad Request");
        // The codes of ordinary refusals, as xrouter.md lists them: a status without a code of its
        // own is kept, with `upstream_refused`.
        for (status, code) in [
            (400, "invalid_request"),
            (422, "invalid_request"),
            (401, "unauthorized"),
            (403, "forbidden"),
            (404, "not_found"),
            (413, "request_too_large"),
            (405, "upstream_refused"),
            (409, "upstream_refused"),
            (415, "upstream_refused"),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            let (kept, v) = body_of(refusal(status, HeaderMap::new(), b"no", None, ErrorFormat::OpenAi));
            assert_eq!((kept, v["error"]["code"].as_str()), (status, Some(code)));
        }
    }

    #[test]
    fn a_401_and_a_405_carry_their_headers() {
        let r = ProxyError::Unauthorized.into_response("rid-1");
        assert_eq!(r.headers()[http::header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(r.headers()["x-request-id"], "rid-1");
        let e = ProxyError::MethodNotAllowed { method: "PUT".into(), allow: "GET, POST", note: "" };
        assert_eq!(e.to_string(), "method PUT not allowed here: use GET, POST");
        let r = e.into_response("rid-2");
        assert_eq!(r.status().as_u16(), 405);
        assert_eq!(r.headers()[http::header::ALLOW], "GET, POST");
        assert!(ProxyError::Overloaded.into_response("x").headers().get(http::header::ALLOW).is_none());
        // A worker's own 401, passed on, says how to authenticate too (its own scheme kept).
        let r = refusal(StatusCode::UNAUTHORIZED, HeaderMap::new(), b"{}", None, ErrorFormat::OpenAi);
        assert_eq!(r.headers()[http::header::WWW_AUTHENTICATE], "Bearer");
        let mut h = HeaderMap::new();
        h.insert(http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"x\""));
        let r = refusal(StatusCode::UNAUTHORIZED, h, b"{}", None, ErrorFormat::OpenAi);
        assert_eq!(r.headers()[http::header::WWW_AUTHENTICATE], "Basic realm=\"x\"");
        let r = refusal(StatusCode::BAD_REQUEST, HeaderMap::new(), b"{}", None, ErrorFormat::OpenAi);
        assert!(r.headers().get(http::header::WWW_AUTHENTICATE).is_none());
    }

    /// The bytes of a response built from [`full`].
    fn body_bytes(r: Response<Body>) -> Bytes {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async { r.into_body().collect().await.unwrap().to_bytes() })
    }
}
