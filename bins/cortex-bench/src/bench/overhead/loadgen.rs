//! A closed-loop HTTP/1.1 load generator: `concurrency` keep-alive connections, each sending
//! the next request as soon as the previous answer's body has been read, until `requests`
//! answers are in. Latency is measured per request from just before the request is handed to
//! the connection to the last byte of the body (the body is made before that: a never-seen
//! prompt costs the generator, not the measured request).
//!
//! Key decision: one generator for every target, on its own single-threaded runtime, so that
//! what differs between targets is the target alone. Raw `hyper::client::conn::http1`
//! connections (no pool, no retries) keep the generator's own cost small and constant.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::cpu::Threads;

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Run {
    /// Per-request latencies in nanoseconds, sorted.
    pub latencies_ns: Vec<u64>,
    /// Wall-clock time of the whole run.
    pub elapsed: Duration,
    /// Requests that did not answer 200 with a body.
    pub errors: usize,
    /// CPU time the target's threads spent during the measured requests, in ns.
    pub cpu_ns: u64,
}

impl Run {
    /// The `q` quantile (0..=1) in nanoseconds.
    #[must_use]
    pub fn quantile(&self, q: f64) -> u64 {
        quantile(&self.latencies_ns, q)
    }

    /// The target's CPU time per request, in ns.
    #[must_use]
    pub fn cpu_per_request_ns(&self) -> f64 {
        self.cpu_ns as f64 / self.latencies_ns.len().max(1) as f64
    }

    /// Answers per second.
    #[must_use]
    pub fn rps(&self) -> f64 {
        self.latencies_ns.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The `q` quantile of sorted values (nearest rank).
#[must_use]
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1).min(sorted.len() - 1);
    sorted[i]
}

/// One request, sent the same way to every target.
#[derive(Debug, Clone)]
pub struct Probe {
    /// Path, e.g. `/v1/completions`.
    pub path: String,
    /// JSON body (the first one, for [`Bodies::NeverSeen`]).
    pub body: Bytes,
    /// Whether every request sends that body or a new one.
    pub bodies: Bodies,
}

/// What each request of a [`Probe`] sends.
#[derive(Debug, Clone)]
pub enum Bodies {
    /// The same body every time (a gateway's caches answer it after the first).
    Repeated,
    /// A body never sent before: `make(n)` for a number `n` taken from one process-wide counter,
    /// so no two requests of the process (of any target, round or warm-up) carry the same body.
    NeverSeen(fn(u64) -> Bytes),
}

/// The process-wide counter behind [`Bodies::NeverSeen`].
static NEXT_BODY: AtomicU64 = AtomicU64::new(0);

impl Probe {
    /// The body of the next request.
    #[must_use]
    pub fn next_body(&self) -> Bytes {
        match self.bodies {
            Bodies::Repeated => self.body.clone(),
            // Relaxed: a unique number is all that is needed; no other memory depends on it.
            Bodies::NeverSeen(make) => make(NEXT_BODY.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

fn request(addr: SocketAddr, probe: &Probe) -> Result<http::Request<Full<Bytes>>> {
    Ok(http::Request::post(probe.path.as_str())
        .header(http::header::HOST, addr.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(probe.next_body()))?)
}

/// One request on `sender`; `Ok(true)` for a 200 with a body.
async fn once(sender: &mut SendRequest<Full<Bytes>>, req: http::Request<Full<Bytes>>) -> Result<bool> {
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    let ok = resp.status() == http::StatusCode::OK;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(ok && !body.is_empty())
}

/// Sends one request and returns the response's status, headers and body (for checks).
///
/// # Errors
/// The target cannot be reached.
pub async fn fetch(addr: SocketAddr, probe: &Probe) -> Result<(http::StatusCode, http::HeaderMap, Bytes)> {
    let mut sender = connect(addr).await?;
    sender.ready().await?;
    let resp = sender.send_request(request(addr, probe)?).await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok((parts.status, parts.headers, body))
}

/// Opens `concurrency` connections, sends `warmup` requests (not measured), then `requests`
/// measured ones, closed loop; `cpu` tells the target's CPU time so far (ns), read before and
/// after the measured requests.
///
/// # Errors
/// A connection cannot be opened or breaks.
pub async fn run(
    addr: SocketAddr,
    probe: &Probe,
    concurrency: usize,
    warmup: usize,
    requests: usize,
    cpu: &Threads,
) -> Result<Run> {
    let concurrency = concurrency.max(1);
    let mut senders = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        senders.push(connect(addr).await?);
    }
    let mut errors = 0;
    for i in 0..warmup {
        let s = &mut senders[i % concurrency];
        if !once(s, request(addr, probe)?).await? {
            errors += 1;
        }
    }
    if errors > 0 {
        bail!("{errors} of {warmup} warm-up requests to {addr} failed");
    }
    let left = Arc::new(AtomicUsize::new(requests));
    let cpu_before = cpu.cpu_ns();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for mut sender in senders {
        let left = Arc::clone(&left);
        let probe = probe.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(requests / concurrency + 1);
            let mut errors = 0usize;
            // Relaxed: a shared countdown; no other memory depends on it.
            while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                let req = request(addr, &probe)?;
                let t = Instant::now();
                let ok = once(&mut sender, req).await?;
                lat.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
                if !ok {
                    errors += 1;
                }
            }
            anyhow::Ok((lat, errors))
        }));
    }
    let mut latencies_ns = Vec::with_capacity(requests);
    for t in tasks {
        let (lat, e) = t.await.context("load task")??;
        latencies_ns.extend(lat);
        errors += e;
    }
    let elapsed = started.elapsed();
    let cpu_ns = cpu.cpu_ns().saturating_sub(cpu_before);
    latencies_ns.sort_unstable();
    Ok(Run { latencies_ns, elapsed, errors, cpu_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), 50);
        assert_eq!(quantile(&v, 0.99), 99);
        assert_eq!(quantile(&v, 1.0), 100);
        assert_eq!(quantile(&v, 0.0), 1);
        assert_eq!(quantile(&[], 0.5), 0);
        assert_eq!(quantile(&[7], 0.99), 7);
    }
}
