//! The open-loop sender: every request leaves at its own arrival time (trace time divided by the
//! compression), whatever happened to the requests before it, and what came back is recorded.
//!
//! Key decisions:
//! - Open loop, as the issue asks: a slow system under test gets more concurrent requests, never
//!   fewer, so queueing shows in the simulated TTFT instead of being hidden by a closed loop.
//!   One dispatcher sleeps until each arrival and spawns the request; how late it was is
//!   recorded, so an overloaded replay machine is visible in the report.
//! - Everything measured comes from the workers through the front end: `cached_tokens` and
//!   prompt tokens from the stream's final `usage` chunk, simulated TTFT from `x-sim-ttft-ms`,
//!   the worker from `x-cortex-assigned-worker` (Cortex) or from the relays (SGLang's router).
//!   Requests stream, so the wall-clock time to the response head is a wall-clock TTFT, which
//!   checks that the simulators' virtual clock keeps pace with the compressed trace clock.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::cluster::{MODEL, Seen};

/// What one request got.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// HTTP status; 0 when no response came (connection error or timeout).
    pub status: u16,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Simulated TTFT, milliseconds (virtual time, equal to trace time).
    pub sim_ttft_ms: Option<f64>,
    /// Prompt tokens, as the worker counted them.
    pub prompt_tokens: u64,
    /// Prompt tokens the worker served from its cache.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// The worker that served it (index into the cluster).
    pub worker: Option<usize>,
    /// Cortex, disaggregated: the worker that computed the prompt (index into the cluster).
    pub prefill_worker: Option<usize>,
    /// Cortex: the match mode it was routed with.
    pub match_mode: Option<String>,
    /// Cortex: the cache hit it predicted, tokens.
    pub predicted_hit: Option<u64>,
    /// Wall clock from sending to the response head (a worker sends the head of a stream with
    /// the first token).
    pub wall_head: Duration,
    /// Wall clock from sending to the first generated text in the stream (what a user waits for,
    /// whatever a front end does with the response head).
    pub wall_first_token: Option<Duration>,
    /// Cortex: how a disaggregated request was served (`x-cortex-pd`).
    pub pd_mode: Option<String>,
    /// How late the dispatcher sent it.
    pub late: Duration,
    /// When it was sent, wall clock from the run's start.
    pub sent_at: Duration,
    /// Wall clock from sending to the end of the answer's body (zero when none came).
    pub wall_end: Duration,
    /// When the worker received it, wall clock from the run's start (`x-sim-arrived-unix-us`,
    /// passed on by the front end), if it said.
    pub arrived_at: Option<Duration>,
    /// `x-sim-arrived-unix-us` as received (what `arrived_at` is computed from).
    pub arrived_unix_us: Option<u128>,
}

impl Outcome {
    /// A 2xx response with usage.
    #[must_use]
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status) && self.error.is_none()
    }

    /// Refused by the front end for load (429 or 503): shed rather than failed.
    #[must_use]
    pub fn shed(&self) -> bool {
        matches!(self.status, 429 | 503)
    }
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct Send {
    /// Wall-clock offset from the start.
    pub at: Duration,
    /// The prompt text.
    pub prompt: Arc<str>,
    /// `max_tokens`.
    pub max_tokens: u32,
}

/// How the driver behaves.
#[derive(Clone, Debug)]
pub struct DriverOptions {
    /// Where to send (`/v1/completions`).
    pub target: SocketAddr,
    /// Several front ends (gateway replicas), request `i` to `targets[i % n]`, as a round-robin
    /// load balancer spreads them; empty: every request to `target`.
    pub targets: Vec<SocketAddr>,
    /// Give up on one request after this long (wall clock).
    pub timeout: Duration,
    /// A progress line on stderr.
    pub progress: Option<String>,
    /// Whether an answer without `x-sim-ttft-ms` fails (a front end that does not pass the
    /// worker's headers on, or a disaggregated request, has no simulated TTFT of its own).
    pub require_sim_ttft: bool,
}

/// Sends every request open loop and returns their outcomes in the same order.
pub async fn run(sends: &[Send], opts: &DriverOptions, seen: Option<Seen>) -> Vec<Outcome> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(http);
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let start = Instant::now() + Duration::from_millis(100);
    // The same instant on the system clock, which the workers' arrival headers use.
    let start_unix_us = (std::time::SystemTime::now() + Duration::from_millis(100))
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    let progress = opts.progress.clone().map(|label| {
        let (done, failed, total) = (Arc::clone(&done), Arc::clone(&failed), sends.len());
        let end = sends.last().map_or(Duration::ZERO, |s| s.at);
        let tty = std::io::stderr().is_terminal();
        tokio::spawn(async move {
            let mut tick = 0u64;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                tick += 1;
                // Not a terminal (CI logs): one plain line every 10 s instead of a redrawn bar.
                if !tty && !tick.is_multiple_of(20) {
                    continue;
                }
                let elapsed = Instant::now().saturating_duration_since(start);
                let d = done.load(Ordering::Relaxed); // a display counter: no ordering needed
                let f = failed.load(Ordering::Relaxed);
                let pct = if end.is_zero() {
                    100.0
                } else {
                    (elapsed.as_secs_f64() / end.as_secs_f64() * 100.0).min(100.0)
                };
                let width = 30usize;
                let fill = (pct / 100.0 * width as f64) as usize;
                let line = format!(
                    "  {label:<30} [{}{}] {:>5.1}s/{:.0}s  answered {d}/{total}  failed {f}",
                    "#".repeat(fill),
                    ".".repeat(width - fill),
                    elapsed.as_secs_f64(),
                    end.as_secs_f64()
                );
                if tty {
                    eprint!("\r{line}   ");
                    let _ = std::io::stderr().flush();
                } else {
                    eprintln!("{line}");
                }
            }
        })
    });
    let mut handles = Vec::with_capacity(sends.len());
    for (i, s) in sends.iter().enumerate() {
        let due = start + s.at;
        tokio::time::sleep_until(due).await;
        let now = Instant::now();
        let late = now.saturating_duration_since(due);
        let sent_at = now.saturating_duration_since(start);
        let (client, s, seen) = (client.clone(), s.clone(), seen.clone());
        let (done, failed) = (Arc::clone(&done), Arc::clone(&failed));
        let target = if opts.targets.is_empty() { opts.target } else { opts.targets[i % opts.targets.len()] };
        let (timeout, require) = (opts.timeout, opts.require_sim_ttft);
        handles.push(tokio::spawn(async move {
            let mut o = match tokio::time::timeout(timeout, send(&client, target, i, &s, require)).await {
                Ok(o) => o,
                Err(_) => {
                    Outcome { error: Some(format!("no answer within {timeout:?}")), ..Outcome::default() }
                }
            };
            o.late = late;
            o.sent_at = sent_at;
            o.arrived_at = o.arrived_unix_us.map(|us| {
                Duration::from_micros(u64::try_from(us.saturating_sub(start_unix_us)).unwrap_or(u64::MAX))
            });
            if o.worker.is_none()
                && let Some(seen) = &seen
                && let Ok(m) = seen.lock()
            {
                o.worker = m.get(&request_id(i)).copied();
            }
            done.fetch_add(1, Ordering::Relaxed); // display counter
            if !o.ok() {
                failed.fetch_add(1, Ordering::Relaxed); // display counter
            }
            o
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(
            h.await.unwrap_or_else(|e| Outcome { error: Some(format!("task: {e}")), ..Outcome::default() }),
        );
    }
    if let Some(p) = progress {
        p.abort();
        let _ = p.await;
        if std::io::stderr().is_terminal() {
            eprintln!();
        }
    }
    out
}

/// Scans the complete events of `buf` after `from` for the first with generated text (a
/// completion chunk's non-empty `choices[0].text`), noting when it came; returns how far it
/// scanned.
fn first_text(buf: &[u8], from: usize, o: &mut Outcome, sent: Instant) -> usize {
    let mut at = from;
    while let Some(end) = buf[at..].windows(2).position(|w| w == b"\n\n") {
        let event = &buf[at..at + end];
        at += end + 2;
        let Some(data) = std::str::from_utf8(event).ok().and_then(|e| e.trim().strip_prefix("data:")) else {
            continue;
        };
        let v: Value = serde_json::from_str(data.trim()).unwrap_or(Value::Null);
        if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
            o.wall_first_token = Some(sent.elapsed());
            break;
        }
    }
    at
}

fn request_id(i: usize) -> String {
    format!("replay-{i}")
}

fn header<'a>(h: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    target: SocketAddr,
    i: usize,
    s: &Send,
    require_sim_ttft: bool,
) -> Outcome {
    let body = json!({
        "model": MODEL,
        "prompt": &*s.prompt,
        "max_tokens": s.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let req = http::Request::post(format!("http://{target}/v1/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", request_id(i))
        .body(Full::new(Bytes::from(body.to_string())));
    let req = match req {
        Ok(r) => r,
        Err(e) => return Outcome { error: Some(e.to_string()), ..Outcome::default() },
    };
    let sent = Instant::now();
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => return Outcome { error: Some(format!("connection: {e}")), ..Outcome::default() },
    };
    let wall_head = sent.elapsed();
    let (parts, body) = resp.into_parts();
    let h = &parts.headers;
    let mut o = Outcome {
        status: parts.status.as_u16(),
        sim_ttft_ms: header(h, "x-sim-ttft-ms").and_then(|v| v.parse().ok()),
        worker: header(h, "x-cortex-assigned-worker").and_then(|w| w.strip_prefix('w')?.parse().ok()),
        prefill_worker: header(h, "x-cortex-prefill-worker").and_then(|w| w.strip_prefix('w')?.parse().ok()),
        match_mode: header(h, "x-cortex-match-mode").map(str::to_owned),
        predicted_hit: header(h, "x-cortex-cache-hit-tokens").and_then(|v| v.parse().ok()),
        pd_mode: header(h, "x-cortex-pd").map(str::to_owned),
        arrived_unix_us: header(h, "x-sim-arrived-unix-us").and_then(|v| v.parse().ok()),
        wall_head,
        ..Outcome::default()
    };
    let mut body = body;
    let mut bytes = bytes::BytesMut::new();
    let mut scanned = 0;
    loop {
        match body.frame().await {
            None => {
                o.wall_end = sent.elapsed();
                break;
            }
            Some(Err(e)) => {
                o.error = Some(format!("body: {e}"));
                return o;
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    bytes.extend_from_slice(&data);
                }
                if o.wall_first_token.is_none() {
                    scanned = first_text(&bytes, scanned, &mut o, sent);
                }
            }
        }
    }
    let bytes = bytes.freeze();
    if !parts.status.is_success() {
        let text = String::from_utf8_lossy(&bytes);
        o.error = Some(format!("HTTP {}: {}", o.status, text.chars().take(200).collect::<String>()));
        return o;
    }
    // Server-sent events: the usage rides on the last chunk (`include_usage`).
    let text = String::from_utf8_lossy(&bytes);
    let mut usage = None;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        if !v["error"].is_null() {
            o.error = Some(format!(
                "error event: {}",
                v["error"].to_string().chars().take(200).collect::<String>()
            ));
            return o;
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
    }
    match usage.as_ref().and_then(|u| Some((u, u["prompt_tokens"].as_u64()?))) {
        Some((u, p)) => {
            o.prompt_tokens = p;
            // Without details the engine reported no cache hit.
            o.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            o.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
        }
        None => o.error = Some("no usage in the stream".to_owned()),
    }
    if require_sim_ttft && o.sim_ttft_ms.is_none() && o.error.is_none() {
        o.error = Some("no x-sim-ttft-ms header in the response".to_owned());
    }
    o
}
