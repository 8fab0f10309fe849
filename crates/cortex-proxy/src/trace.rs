//! Tracing: W3C trace context in and out, and an OTLP/HTTP (JSON) span exporter.
//!
//! Key decisions:
//! - No OpenTelemetry SDK: a request makes one server span and a client span per attempt or PD
//!   leg, with flat attributes, so the spans are plain records queued to one task that POSTs
//!   them in OTLP's JSON encoding to `<endpoint>/v1/traces` with the gateway's own HTTP client.
//!   A full queue drops spans (counted nowhere but the log): tracing never slows a request.
//! - Sampling is decided once per request: a client's `traceparent` decides with its sampled
//!   flag (and becomes the request span's parent); otherwise `sample_ratio` decides by the
//!   trace id, so that every replica decides the same for the same trace.
//! - Only a sampled request sends its own `traceparent` to the workers (the client span of the
//!   attempt or leg is the parent the worker sees).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Request, Uri};
use http_body_util::Full;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::upstream::UpstreamClient;

/// Tracing settings (off when absent from [`crate::ProxyConfig`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP base (`http://host:4318`); spans go to `<endpoint>/v1/traces`.
    pub endpoint: Uri,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Fraction of requests without a client decision that are traced, in `[0, 1]`.
    pub sample_ratio: f64,
}

/// Spans kept waiting for export; beyond, new spans are dropped.
const QUEUE: usize = 4096;
/// Spans per export request.
const BATCH: usize = 512;
/// Longest wait before a partial batch is sent.
const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// A request's place in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace.
    pub trace_id: [u8; 16],
    /// The request span's id.
    pub span_id: [u8; 8],
    /// The client's span, when it sent a `traceparent`.
    pub parent: Option<[u8; 8]>,
}

impl TraceContext {
    /// A `traceparent` header value naming `span` of this trace, sampled.
    #[must_use]
    pub fn traceparent(&self, span: [u8; 8]) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&span))
    }
}

/// Parses a W3C `traceparent` (version 00): trace id, parent span id, sampled flag.
#[must_use]
pub fn parse_traceparent(v: &str) -> Option<([u8; 16], [u8; 8], bool)> {
    let mut parts = v.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    unhex(trace, &mut trace_id)?;
    unhex(span, &mut span_id)?;
    let mut f = [0u8; 1];
    unhex(flags, &mut f)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((trace_id, span_id, f[0] & 1 == 1))
}

fn unhex(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// A random non-zero span id.
#[must_use]
pub fn new_span_id() -> [u8; 8] {
    fastrand::u64(1..).to_be_bytes()
}

/// Nanoseconds since the Unix epoch.
#[must_use]
pub fn now_unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A span attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
}

/// A finished span.
#[derive(Clone, Debug)]
pub struct SpanRecord {
    /// Its trace.
    pub trace_id: [u8; 16],
    /// Its id.
    pub span_id: [u8; 8],
    /// Its parent, if any.
    pub parent: Option<[u8; 8]>,
    /// Its name.
    pub name: String,
    /// True for a server span (the request), false for a client span (an attempt or a leg).
    pub server: bool,
    /// Start, Unix nanoseconds.
    pub start: u64,
    /// End, Unix nanoseconds.
    pub end: u64,
    /// Attributes.
    pub attrs: Vec<(&'static str, AttrValue)>,
    /// Whether the span ended in error.
    pub error: bool,
}

/// What the exporter task is sent.
#[derive(Debug)]
enum Msg {
    /// A finished span.
    Span(SpanRecord),
    /// Send what is queued now, then answer.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// The exporter's front: decides sampling and queues finished spans.
#[derive(Debug)]
pub struct Tracer {
    ratio: f64,
    tx: mpsc::Sender<Msg>,
}

impl Tracer {
    /// Starts the exporter task on the current tokio runtime (`None` outside a runtime: tracing
    /// is then off, with a warning).
    #[must_use]
    pub fn start(cfg: &TracingConfig, client: UpstreamClient) -> Option<Tracer> {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("tracing configured but no runtime to export from: tracing is off");
            return None;
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let url = format!("{}/v1/traces", cfg.endpoint.to_string().trim_end_matches('/'));
        let uri: Uri = url.parse().ok()?;
        rt.spawn(export(rx, client, uri, cfg.service_name.clone()));
        Some(Tracer { ratio: cfg.sample_ratio, tx })
    }

    /// The trace context of a request with `headers`; `None` when it is not sampled.
    #[must_use]
    pub fn context(&self, headers: &HeaderMap) -> Option<TraceContext> {
        let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok()).and_then(parse_traceparent);
        let (trace_id, parent, sampled) = match incoming {
            Some((t, p, sampled)) => (t, Some(p), sampled),
            None => {
                let t = u128::from(fastrand::u64(1..)) << 64 | u128::from(fastrand::u64(..));
                (t.to_be_bytes(), None, sampled_by_ratio(t.to_be_bytes(), self.ratio))
            }
        };
        sampled.then(|| TraceContext { trace_id, span_id: new_span_id(), parent })
    }

    /// Queues a finished span (dropped when the queue is full).
    pub fn export(&self, span: SpanRecord) {
        if self.tx.try_send(Msg::Span(span)).is_err() {
            tracing::debug!("span queue full: span dropped");
        }
    }

    /// Sends every span queued so far, waiting at most `within` (at shutdown).
    pub async fn flush(&self, within: Duration) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let asked = tokio::time::timeout(within, self.tx.send(Msg::Flush(tx))).await;
        if matches!(asked, Ok(Ok(()))) {
            let _ = tokio::time::timeout(within, rx).await;
        }
    }
}

/// The sampling decision of a trace without a client decision: the trace id's low 8 bytes as a
/// fraction of `u64::MAX`, below `ratio`.
#[must_use]
pub fn sampled_by_ratio(trace_id: [u8; 16], ratio: f64) -> bool {
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    ratio >= 1.0 || (u64::from_be_bytes(low) as f64) < ratio * u64::MAX as f64
}

async fn export(mut rx: mpsc::Receiver<Msg>, client: UpstreamClient, uri: Uri, service: String) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut flushed = Vec::new();
    loop {
        let Some(first) = rx.recv().await else { return };
        match first {
            Msg::Span(s) => batch.push(s),
            Msg::Flush(done) => flushed.push(done),
        }
        let deadline = tokio::time::Instant::now() + FLUSH_EVERY;
        while batch.len() < BATCH && flushed.is_empty() {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Msg::Span(s))) => batch.push(s),
                Ok(Some(Msg::Flush(done))) => flushed.push(done),
                Ok(None) | Err(_) => break,
            }
        }
        if !batch.is_empty() {
            post(&client, &uri, &service, &batch).await;
            batch.clear();
        }
        for done in flushed.drain(..) {
            let _ = done.send(());
        }
    }
}

/// POSTs one batch; a failure is logged, never retried.
async fn post(client: &UpstreamClient, uri: &Uri, service: &str, batch: &[SpanRecord]) {
    let body = otlp_json(service, batch).to_string();
    let mut req = Request::new(Full::new(Bytes::from(body)));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri.clone();
    req.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => {}
        Ok(Ok(r)) => tracing::warn!(status = %r.status(), "the trace collector refused spans"),
        Ok(Err(e)) => tracing::warn!(error = %e, "spans not exported"),
        Err(_) => tracing::warn!("spans not exported: the collector did not answer within 10s"),
    }
}

/// The OTLP/HTTP JSON body of `spans` (`ExportTraceServiceRequest`).
#[must_use]
pub fn otlp_json(service: &str, spans: &[SpanRecord]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let attrs: Vec<Value> = s
                .attrs
                .iter()
                .map(|(k, v)| match v {
                    AttrValue::Str(x) => json!({"key": k, "value": {"stringValue": x}}),
                    AttrValue::Int(x) => json!({"key": k, "value": {"intValue": x.to_string()}}),
                })
                .collect();
            let mut v = json!({
                "traceId": hex(&s.trace_id),
                "spanId": hex(&s.span_id),
                "name": s.name,
                // SPAN_KIND_SERVER = 2, SPAN_KIND_CLIENT = 3.
                "kind": if s.server { 2 } else { 3 },
                "startTimeUnixNano": s.start.to_string(),
                "endTimeUnixNano": s.end.to_string(),
                "attributes": attrs,
                // STATUS_CODE_OK = 1, STATUS_CODE_ERROR = 2.
                "status": {"code": if s.error { 2 } else { 1 }},
            });
            if let Some(p) = s.parent {
                v["parentSpanId"] = json!(hex(&p));
            }
            v
        })
        .collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "cortex-gateway"}, "spans": spans}],
    }]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_parsing() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (t, p, s) = parse_traceparent(v).unwrap_or_default();
        assert_eq!(hex(&t), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&p), "00f067aa0ba902b7");
        assert!(s);
        let ctx = TraceContext { trace_id: t, span_id: p, parent: None };
        assert_eq!(ctx.traceparent(p), v);
        assert!(
            !parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .unwrap_or_default()
                .2
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad}");
        }
    }

    #[test]
    fn ratio_sampling_is_decided_by_the_trace_id() {
        let mut low = [0u8; 16];
        low[8..].copy_from_slice(&(u64::MAX / 4).to_be_bytes());
        assert!(sampled_by_ratio(low, 0.5));
        assert!(!sampled_by_ratio(low, 0.2));
        assert!(!sampled_by_ratio(low, 0.0));
        assert!(sampled_by_ratio([0xff; 16], 1.0));
        assert!(!sampled_by_ratio([0xff; 16], 0.99));
    }

    /// A collector on loopback that answers 200 to every request and counts the spans POSTed.
    async fn collector() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let spans = std::sync::Arc::new(AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&spans);
        tokio::spawn(async move {
            let Ok((mut s, _)) = listener.accept().await else { return };
            let mut buf = Vec::new();
            loop {
                let mut chunk = [0u8; 4096];
                let Ok(n) = s.read(&mut chunk).await else { return };
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() < end + 4 + len {
                    continue;
                }
                let body: Value = serde_json::from_slice(&buf[end + 4..end + 4 + len]).unwrap_or_default();
                let n = body["resourceSpans"][0]["scopeSpans"][0]["spans"].as_array().map_or(0, Vec::len);
                counted.fetch_add(n, Ordering::SeqCst);
                buf.drain(..end + 4 + len);
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        (addr, spans)
    }

    /// `flush` sends what is queued at once, without waiting for the batch's timer.
    #[tokio::test]
    async fn flush_sends_the_queued_spans_now() {
        let (addr, got) = collector().await;
        let cfg = TracingConfig {
            endpoint: format!("http://{addr}").parse().unwrap_or_else(|e| panic!("{e}")),
            service_name: "t".into(),
            sample_ratio: 1.0,
        };
        let tracer = Tracer::start(&cfg, crate::upstream::client(Duration::from_secs(1)))
            .unwrap_or_else(|| panic!("no tracer"));
        let span = SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: None,
            name: "s".into(),
            server: true,
            start: 1,
            end: 2,
            attrs: Vec::new(),
            error: false,
        };
        tracer.export(span.clone());
        tracer.export(span);
        let started = std::time::Instant::now();
        tracer.flush(Duration::from_secs(5)).await;
        assert_eq!(got.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(started.elapsed() < FLUSH_EVERY, "the flush waited for the batch timer");
    }

    #[test]
    fn otlp_json_encoding() {
        let s = SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: Some([3; 8]),
            name: "attempt".into(),
            server: false,
            start: 5,
            end: 7,
            attrs: vec![("cortex.worker", AttrValue::Str("w0".into())), ("cortex.rank", AttrValue::Int(1))],
            error: false,
        };
        let v = otlp_json("cortex", &[s]);
        let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "01010101010101010101010101010101");
        assert_eq!(span["parentSpanId"], "0303030303030303");
        assert_eq!(span["kind"], 3);
        assert_eq!(span["startTimeUnixNano"], "5");
        assert_eq!(span["attributes"][1]["value"]["intValue"], "1");
        assert_eq!(v["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"], "cortex");
    }
}
