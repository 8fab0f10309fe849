//! Errors of the data plane, and the one place where an error becomes an HTTP response or an SSE
//! error event.
//!
//! Key decision: deep code returns a typed [`ProxyError`] that says who is to blame and whether a
//! retry on another worker is safe; only [`ProxyError::into_response`] and
//! [`ProxyError::sse_event`] turn it into bytes, in OpenAI's error format
//! (`{"error": {"message", "type", "param", "code"}}`), so every route answers errors the same
//! way and clients of both engines can parse them.

use bytes::Bytes;
use cortex_sched::FailureClass;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

/// The error a response body may end with (hyper then aborts the connection).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the gateway writes.
pub type Body = UnsyncBoxBody<Bytes, BodyError>;

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
    /// No route matches.
    #[error("no route for {method} {path}")]
    NotFound {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
    },
    /// The route exists but not with this method.
    #[error("method {method} not allowed here: {allowed}")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// What the route takes instead.
        allowed: &'static str,
    },
    /// Missing or wrong bearer token (admin API).
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
            | ProxyError::NotFound { .. }
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
            ProxyError::BodyRead(_) | ProxyError::MalformedJson(_) | ProxyError::InvalidRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            ProxyError::UnknownModel(_) | ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
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
            ProxyError::NotFound { .. } => "not_found",
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

    /// The JSON error object.
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": serde_json::Value::Null,
                "code": self.code(),
            }
        })
    }

    /// The HTTP response for this error, carrying `x-request-id`.
    #[must_use]
    pub fn into_response(self, request_id: &str) -> Response<Body> {
        let body = Bytes::from(self.json().to_string());
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert("x-request-id", v);
        }
        if self.retry_safe() {
            h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }

    /// A well-formed SSE error event followed by `data: [DONE]`, for a stream that already
    /// started: vLLM and SGLang end their own streams this way.
    #[must_use]
    pub fn sse_event(&self) -> Bytes {
        Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", self.json()))
    }
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
            (ProxyError::Overloaded, 429, Blame::Gateway),
            (ProxyError::QueueTimeout(std::time::Duration::from_secs(1)), 503, Blame::Gateway),
            (ProxyError::NoWorker("m".into()), 503, Blame::Gateway),
            (
                ProxyError::Upstream { class: FailureClass::ServerError, attempts: 3, message: "x".into() },
                502,
                Blame::Worker,
            ),
            (
                ProxyError::Upstream { class: FailureClass::Timeout, attempts: 1, message: "x".into() },
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
        let sse = String::from_utf8(ProxyError::Internal("boom".into()).sse_event().to_vec()).unwrap();
        assert!(sse.starts_with("data: {\"error\""));
        assert!(sse.ends_with("data: [DONE]\n\n"));
    }
}
