//! The soak's load: a closed loop at a fixed concurrency, each sender taking the next request
//! index until all are sent, reading every response to its end and judging it.
//!
//! Key decision: a request succeeds only when its answer is whole — a 200 with `choices`, or a
//! stream with no error event that ends with `[DONE]` — and everything else is kept as a
//! [`Failure`] with its times and worker, for [`super::verdict::explained_by`] to judge against
//! the kills. Successes are only counted, so memory on this side stays flat over 10^6 requests.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::prompts::{Req, Shape, Workload};
use super::verdict::Failure;

/// Longest wait for one whole answer.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Tokens generated per request.
const MAX_TOKENS: u32 = 8;

/// Counters shared with the sampler and the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests answered (either way).
    pub done: AtomicU64,
    /// Requests that failed.
    pub failed: AtomicU64,
    /// Set to stop sending (interrupted).
    pub stop: AtomicBool,
}

/// The failures kept with their details (the first [`Failures::CAP`]; beyond it only counted),
/// behind a lock taken only on a failure.
#[derive(Debug, Default)]
struct Failures {
    kept: Mutex<Vec<Failure>>,
}

impl Failures {
    const CAP: usize = 100_000;

    fn push(&self, f: Failure) {
        if let Ok(mut v) = self.kept.lock()
            && v.len() < Self::CAP
        {
            v.push(f);
        }
    }

    fn take(&self) -> Vec<Failure> {
        self.kept.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
}

/// Sends requests `0..n` of `workload` to `target` from `concurrency` senders; `start` is the
/// zero of every time recorded. Returns the failures.
pub async fn run(
    target: SocketAddr,
    models: &[String],
    workload: Workload,
    n: u64,
    concurrency: usize,
    start: Instant,
    progress: Arc<Progress>,
) -> Vec<Failure> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(http);
    let next = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Failures::default());
    let models: Arc<[String]> = models.into();
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, next, failures, progress, models) = (
            client.clone(),
            Arc::clone(&next),
            Arc::clone(&failures),
            Arc::clone(&progress),
            Arc::clone(&models),
        );
        senders.spawn(async move {
            loop {
                // A work counter: each index is taken once, no other memory is ordered by it.
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n || progress.stop.load(Ordering::Relaxed) {
                    break;
                }
                let req = workload.request(i);
                let sent = start.elapsed();
                let verdict = tokio::time::timeout(TIMEOUT, send(&client, target, &models, &req)).await;
                let (worker, class) = match verdict {
                    Ok((_, None)) => {
                        progress.done.fetch_add(1, Ordering::Relaxed); // a counter
                        continue;
                    }
                    Ok((worker, Some(class))) => (worker, class),
                    Err(_) => (None, format!("no whole answer within {TIMEOUT:?}")),
                };
                failures.push(Failure { index: i, start: sent, end: start.elapsed(), worker, class });
                progress.failed.fetch_add(1, Ordering::Relaxed); // a counter
                progress.done.fetch_add(1, Ordering::Relaxed); // a counter
            }
        });
    }
    while senders.join_next().await.is_some() {}
    failures.take()
}

fn body(models: &[String], req: &Req) -> Value {
    let model = &models[req.model % models.len()];
    let stream = req.shape.streams();
    let mut v = match req.shape {
        Shape::Chat | Shape::ChatStream => json!({
            "model": model,
            "messages": [{"role": "user", "content": req.text}],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }),
        Shape::Completion | Shape::CompletionStream => json!({
            "model": model,
            "prompt": req.text,
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }),
    };
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

/// Sends `req`; returns the worker the gateway assigned (if it said) and, if it failed, why.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    target: SocketAddr,
    models: &[String],
    req: &Req,
) -> (Option<String>, Option<String>) {
    let http_req = http::Request::post(format!("http://{target}{}", req.shape.path()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body(models, req).to_string())));
    let http_req = match http_req {
        Ok(r) => r,
        Err(e) => return (None, Some(format!("request: {e}"))),
    };
    let resp = match client.request(http_req).await {
        Ok(r) => r,
        Err(e) => return (None, Some(format!("connection: {}", source_chain(&e)))),
    };
    let (parts, body) = resp.into_parts();
    let worker =
        parts.headers.get("x-cortex-assigned-worker").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (worker, Some(format!("body cut: {}", source_chain(&e)))),
    };
    (worker, judge(parts.status.as_u16(), req.shape.streams(), &bytes))
}

fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Why an answer of `status` with `body` is not a whole answer, if it is not.
#[must_use]
pub fn judge(status: u16, streams: bool, body: &[u8]) -> Option<String> {
    if status != 200 {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let code = v["error"]["code"].as_str().or_else(|| v["error"]["type"].as_str()).unwrap_or("-");
        return Some(format!("http {status} {code}"));
    }
    if !streams {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        return (!v["choices"].is_array()).then(|| "a 200 without choices".to_owned());
    }
    let text = String::from_utf8_lossy(body);
    let mut done = false;
    for data in text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim) {
        if data == "[DONE]" {
            done = true;
        } else if data.starts_with("{\"error\"") {
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            let code = v["error"]["code"].as_str().unwrap_or("-");
            return Some(format!("stream error event {code}"));
        }
    }
    (!done).then(|| "a stream without [DONE]".to_owned())
}

#[cfg(test)]
mod tests {
    use super::judge;

    #[test]
    fn only_whole_answers_succeed() {
        let ok_stream = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(judge(200, true, ok_stream), None);
        assert_eq!(judge(200, false, b"{\"choices\":[]}"), None);
        assert_eq!(
            judge(502, false, b"{\"error\":{\"code\":\"upstream_unavailable\"}}").as_deref(),
            Some("http 502 upstream_unavailable")
        );
        assert_eq!(judge(500, true, b"oops").as_deref(), Some("http 500 -"));
        assert_eq!(judge(200, false, b"{\"object\":\"error\"}").as_deref(), Some("a 200 without choices"));
        let broken = b"data: {\"choices\":[]}\n\ndata: {\"error\":{\"code\":\"upstream_stream_broken\"}}\n\ndata: [DONE]\n\n";
        assert_eq!(judge(200, true, broken).as_deref(), Some("stream error event upstream_stream_broken"));
        assert_eq!(
            judge(200, true, b"data: {\"choices\":[]}\n\n").as_deref(),
            Some("a stream without [DONE]")
        );
    }
}
