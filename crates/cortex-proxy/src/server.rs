//! Serving connections: the accept loop, connection limits and graceful shutdown, for the public
//! listener and the admin listener alike.
//!
//! ```text
//! accept ─► over max_connections? close ─► serve (HTTP/1.1 or HTTP/2, sniffed by hyper-util)
//!             no request in flight for header_read_timeout (from accept, or since the last
//!             response): ask the connection to close (HTTP/2: GOAWAY), drop it one more
//!             header_read_timeout later
//! shutdown ─► stop accepting, ask every connection to close, wait up to the grace, abort the rest
//! ```
//!
//! Key decisions:
//! - One connection-level deadline, owned here, for both HTTP versions: a connection may wait
//!   for a request's headers at most `header_read_timeout` while none of its requests is in
//!   flight. It covers what hyper's own timer does not: hyper-util's protocol detection (a
//!   client dribbling the HTTP/2 preface), an HTTP/2 connection that sent its preface and
//!   settings and then nothing, an idle HTTP/2 connection, and a connection that sends no byte.
//!   hyper's HTTP/1 header timer stays on as well (same limit, from the head's first poll). A
//!   request is in flight from its headers until its response body is finished or dropped.
//! - A header that never completes is not answered (no 408): the client has made no request
//!   yet, and on HTTP/2 there is no stream to answer on.
//! - Request heads are bounded by `max_header_bytes` on both versions (431): HTTP/1.1 by hyper's
//!   read buffer, HTTP/2 by `SETTINGS_MAX_HEADER_LIST_SIZE`. HTTP/2 connections are pinged
//!   (`http2_keep_alive_*`), so a vanished peer is noticed while its streams wait.
//! - At most `max_connections` connections: one beyond is closed at once (and counted), which
//!   tells a client to go elsewhere sooner than a full accept backlog would.
//! - Graceful shutdown stops accepting at once, asks every connection to close (in-flight
//!   responses finish; idle ones close now), and at the deadline aborts the connections still
//!   open, which drops their response bodies and, with them, their upstream requests.
//! - `TCP_NODELAY` on every accepted socket.
//! - A write to the socket that waits `client_write_timeout` without the client taking a byte
//!   fails ([`WriteDeadline`]), which ends the connection: a client that stops reading (a full
//!   socket buffer, on either HTTP version) gives back its connection slot, not only its
//!   request's admission slot ([`crate::stall`]).
//! - With TLS ([`crate::tls`]), the handshake runs in the connection's own task under the same
//!   `header_read_timeout` (a client that never finishes it holds a connection slot, never the
//!   accept loop), with the certificate in service at that moment.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::{Limits, MIN_HEADER_BYTES};
use crate::error::{Body, BodyError};
use crate::gateway::Gateway;
use crate::tls::Tls;

/// Requests of one connection in flight, and a signal when that number changes.
#[derive(Debug, Default)]
struct Activity {
    in_flight: AtomicUsize,
    /// Answers given up on the connection's client ([`ConnSlot::abandon`]) whose streams hyper
    /// still holds open.
    abandoned_open: AtomicUsize,
    changed: Notify,
    /// Counts the client taking bytes of its answers: a write the socket took, or, while a write
    /// waits, the socket's unsent bytes shrinking by [`MIN_DRAIN_BYTES`] ([`WriteDeadline`]) ...
    drained: AtomicU64,
    /// ... and a response body asked for its next frame (hyper sent or buffered the one before:
    /// on HTTP/2, its stream had window).
    asks: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity::default())
    }

    fn drained(&self) {
        // Relaxed: a count the sweep compares; no other memory hangs on it.
        self.drained.fetch_add(1, Ordering::Relaxed);
    }

    fn idle(&self) -> bool {
        // SeqCst: read against the guards' updates by the connection task; rare, not hot.
        self.in_flight.load(Ordering::SeqCst) == 0
    }

    /// Whether the connection should close: its client left every answer it holds unread, or
    /// [`ABANDONED_MAX`] of them at once.
    fn abandoned_by_client(&self) -> bool {
        // SeqCst: as in `idle`; `abandon` counts the open stream before it stops counting the
        // request in flight, so no state in between reads as idle without it.
        let open = self.abandoned_open.load(Ordering::SeqCst);
        open >= ABANDONED_MAX || (open > 0 && self.idle())
    }
}

/// Answers given up on one connection's client and still open at once before the connection is
/// closed even while it has other requests in flight: its client reads none of them, and an
/// HTTP/2 stream given up stays open (hyper resets a stream only when it polls its body, which it
/// does not while the client's window is shut).
const ABANDONED_MAX: usize = 8;

/// How long a connection closed for its given-up answers has, once nothing else is in flight, to
/// send what its finished answers queued (and its `GOAWAY`) before it is dropped.
const ABANDONED_GRACE: Duration = Duration::from_secs(1);

/// A slot's state.
const COUNTED: u8 = 0;
const RELEASED: u8 = 1;
const ABANDONED: u8 = 2;

/// A request's place among its connection's requests in flight, from its headers until its
/// response body ends or is dropped — or until its answer is given up on its client
/// ([`ConnSlot::abandon`], by the stall sweep). A connection whose requests are all given up is
/// closed, and so is one with [`ABANDONED_MAX`] given up and open: gracefully (`GOAWAY`, the
/// other requests finish), then dropped [`ABANDONED_GRACE`] after nothing else is in flight.
#[derive(Clone, Debug)]
pub struct ConnSlot(Arc<Slot>);

#[derive(Debug)]
struct Slot {
    activity: Arc<Activity>,
    state: std::sync::atomic::AtomicU8,
    multiplexed: bool,
}

impl ConnSlot {
    fn new(a: &Arc<Activity>, version: http::Version) -> Self {
        a.in_flight.fetch_add(1, Ordering::SeqCst);
        a.changed.notify_one();
        ConnSlot(Arc::new(Slot {
            activity: Arc::clone(a),
            state: std::sync::atomic::AtomicU8::new(COUNTED),
            multiplexed: version >= http::Version::HTTP_2,
        }))
    }

    /// How often the request's connection has seen its client take bytes of an answer: its
    /// socket draining, and its answers asking for their next frame (see [`Activity`]). A client
    /// reading steadily, whose answers wait their turn on its socket or connection, is not
    /// stalled.
    pub(crate) fn progress(&self) -> (u64, u64) {
        let a = &self.0.activity;
        // Relaxed: as in `Activity::drained`.
        (a.drained.load(Ordering::Relaxed), a.asks.load(Ordering::Relaxed))
    }

    /// Whether the request came over HTTP/2, where answers share their connection.
    pub(crate) fn multiplexed(&self) -> bool {
        self.0.multiplexed
    }

    /// The request's answer was given up on its client: it no longer keeps its connection open.
    pub(crate) fn abandon(&self) {
        let a = &self.0.activity;
        // SeqCst: rare; read against `Activity::abandoned_by_client` by the connection task.
        // Counted open before the state says so: a `release` racing this then never takes it
        // below zero.
        a.abandoned_open.fetch_add(1, Ordering::SeqCst);
        if self.0.state.compare_exchange(COUNTED, ABANDONED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            a.in_flight.fetch_sub(1, Ordering::SeqCst);
            a.changed.notify_one();
        } else {
            a.abandoned_open.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The request's response body ended or was dropped.
    fn release(&self) {
        let a = &self.0.activity;
        // SeqCst: as in `abandon`.
        match self.0.state.swap(RELEASED, Ordering::SeqCst) {
            COUNTED => a.in_flight.fetch_sub(1, Ordering::SeqCst),
            ABANDONED => a.abandoned_open.fetch_sub(1, Ordering::SeqCst),
            _ => return,
        };
        a.changed.notify_one();
    }
}

/// Counts a request in flight until dropped (with its response body) or abandoned.
#[derive(Debug)]
struct InFlight(ConnSlot);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// A response body that keeps its request counted in flight until it ends or is dropped.
pub struct Tracked {
    inner: Body,
    in_flight: InFlight,
    /// The last poll returned a frame: the next one is the client's progress.
    handed: bool,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.handed {
            // The server asks for the next frame: the last one went out (or into the buffer
            // before the socket), so the client took bytes.
            // Relaxed: as in `Activity::drained`.
            self.in_flight.0.0.activity.asks.fetch_add(1, Ordering::Relaxed);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        self.handed = matches!(polled, Poll::Ready(Some(Ok(_))));
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How often a waiting write looks at the socket's unsent bytes.
const UNSENT_CHECK_EVERY: Duration = Duration::from_millis(500);

/// Bytes the socket's unsent queue must shrink by (or empty) to count as the client reading: a
/// client trickling a few bytes now and then does not hold its answer (the least rate that keeps
/// a connection is 16 KiB per `client_write_timeout`, 273 B/s at the default).
const MIN_DRAIN_BYTES: usize = 16 << 10;

/// A connection's socket whose writes fail once one has waited `limit` without the client taking
/// bytes, like nginx's `send_timeout`: the client takes bytes when a write goes through, or, while
/// one waits, when the socket's unsent bytes shrink by [`MIN_DRAIN_BYTES`] or empty (a full socket
/// becomes writable again only once much of it has drained). Both are counted as the
/// connection's progress, which the stall sweep reads ([`ConnSlot::progress`]). A client whose
/// kernel keeps its receive window shut for the whole of `limit` shows neither: the window
/// reopens only in large steps, so one reading less than about a receive window per `limit` is
/// cut.
struct WriteDeadline {
    io: tokio::net::TcpStream,
    limit: Duration,
    activity: Arc<Activity>,
    /// While a write or flush waits.
    waiting: Option<Waiting>,
    /// The deadline passed: every later write fails at once.
    expired: bool,
}

/// A write that waits: since when the client took nothing, the socket's unsent bytes then, and
/// the next look at them.
struct Waiting {
    since: Instant,
    unsent: usize,
    check: Pin<Box<tokio::time::Sleep>>,
}

impl WriteDeadline {
    fn new(io: tokio::net::TcpStream, limit: Duration, activity: Arc<Activity>) -> Self {
        WriteDeadline { io, limit, activity, waiting: None, expired: false }
    }

    fn expired_error(&self) -> std::io::Error {
        let limit = self.limit;
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the client read nothing for {limit:?} (client_write_timeout)"),
        )
    }

    /// `polled` (a write of `wrote` bytes when ready), unless it has waited past the deadline
    /// with the client taking nothing.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<T>>,
        wrote: usize,
    ) -> Poll<std::io::Result<T>> {
        if polled.is_ready() {
            self.waiting = None;
            if wrote > 0 {
                self.activity.drained();
            }
            return polled;
        }
        let every = UNSENT_CHECK_EVERY.min(self.limit);
        if self.waiting.is_none() {
            let unsent = unsent(&self.io);
            let check = Box::pin(tokio::time::sleep(every));
            self.waiting = Some(Waiting { since: Instant::now(), unsent, check });
        }
        loop {
            let Some(w) = self.waiting.as_mut() else { return Poll::Pending };
            if w.check.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = Instant::now();
            let left = unsent(&self.io);
            if left < w.unsent && (w.unsent - left >= MIN_DRAIN_BYTES || left == 0) {
                w.since = now;
                w.unsent = left;
                self.activity.drained();
            } else if now.duration_since(w.since) >= self.limit {
                self.waiting = None;
                self.expired = true;
                metrics::counter!(crate::telemetry::CLIENT_WRITE_TIMEOUTS, "scope" => "connection")
                    .increment(1);
                return Poll::Ready(Err(self.expired_error()));
            }
            w.check.as_mut().reset(now + every);
        }
    }
}

/// Bytes the socket holds that the peer has not acknowledged (Linux `SIOCOUTQ`); `usize::MAX`
/// where that cannot be read, so that no progress is seen while a write waits.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn unsent(s: &tokio::net::TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: `TIOCOUTQ` (`SIOCOUTQ`) on a socket descriptor writes one `int` to the pointer
    // given, which points at `n`; the descriptor is open for as long as `s` is borrowed.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &raw mut n) };
    if r == 0 { usize::try_from(n).unwrap_or(usize::MAX) } else { usize::MAX }
}

#[cfg(not(target_os = "linux"))]
fn unsent(_: &tokio::net::TcpStream) -> usize {
    usize::MAX
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.expired {
            return Poll::Ready(Err(self.expired_error()));
        }
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        let wrote = if let Poll::Ready(Ok(n)) = &polled { *n } else { 0 };
        self.watch(cx, polled, wrote)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.expired {
            return Poll::Ready(Err(self.expired_error()));
        }
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        let wrote = if let Poll::Ready(Ok(n)) = &polled { *n } else { 0 };
        self.watch(cx, polled, wrote)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.expired {
            return Poll::Ready(Err(self.expired_error()));
        }
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled, 0)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.expired {
            return Poll::Ready(Err(self.expired_error()));
        }
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, polled, 0)
    }
}

/// The hyper builder for `limits`.
fn builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let head = limits.max_header_bytes.max(MIN_HEADER_BYTES);
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(head)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(head).unwrap_or(u32::MAX))
        .keep_alive_interval(limits.http2_keep_alive_interval)
        .keep_alive_timeout(limits.http2_keep_alive_timeout);
    b
}

/// Serves `handler` on `listener` (over TLS when `tls` is given) under `limits` (connections,
/// heads, timeouts) until `shutdown` resolves, then drains for up to `grace` and closes what is
/// left.
pub async fn serve_with<H, Fut, S>(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
    handler: H,
    limits: &Limits,
    grace: Duration,
    shutdown: S,
) where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
    S: Future<Output = ()>,
{
    let builder = builder(limits);
    let header_read_timeout = limits.header_read_timeout;
    let write_timeout = limits.client_write_timeout;
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    // Asks every connection to close (graceful shutdown).
    let (closing, closing_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    metrics::counter!(crate::telemetry::CONNECTIONS_REFUSED).increment(1);
                    tracing::debug!("max_connections reached: closing a new connection");
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let activity = Activity::new();
                let stream = WriteDeadline::new(stream, write_timeout, Arc::clone(&activity));
                let (handler, builder, closing_rx) = (handler.clone(), builder.clone(), closing_rx.clone());
                let acceptor = tls.as_ref().map(|t| t.acceptor());
                connections.spawn(async move {
                    match acceptor {
                        None => {
                            serve_connection(stream, activity, handler, builder, header_read_timeout, closing_rx)
                                .await;
                        }
                        Some(acceptor) => {
                            match tokio::time::timeout(header_read_timeout, acceptor.accept(stream)).await {
                                Ok(Ok(tls)) => {
                                    serve_connection(
                                        tls,
                                        activity,
                                        handler,
                                        builder,
                                        header_read_timeout,
                                        closing_rx,
                                    )
                                    .await;
                                }
                                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                Err(_) => tracing::debug!("TLS handshake not finished within header_read_timeout"),
                            }
                        }
                    }
                    drop(slot);
                });
            }
            // Reaps finished connections, so the set holds only open ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let _ = closing.send(true);
    let drained =
        tokio::time::timeout(grace, async { while connections.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            open = connections.len(),
            "graceful shutdown deadline passed; closing the connections left"
        );
        connections.shutdown().await;
    }
}

/// One connection, until it ends, idles past its deadline, or the server closes it.
async fn serve_connection<IO, H, Fut>(
    stream: IO,
    activity: Arc<Activity>,
    handler: H,
    builder: auto::Builder<TokioExecutor>,
    header_read_timeout: Duration,
    mut closing: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let a = Arc::clone(&activity);
    let service = service_fn(move |mut req: Request<Incoming>| {
        let slot = ConnSlot::new(&a, req.version());
        req.extensions_mut().insert(slot.clone());
        let in_flight = InFlight(slot);
        let answer = handler(req);
        async move {
            let resp = answer.await?;
            Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, in_flight, handed: false }))
        }
    });
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut deadline = Instant::now() + header_read_timeout;
    let mut asked_to_close = false;
    let mut closing_abandoned = false;
    loop {
        let idle = activity.idle();
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = activity.changed.notified() => {
                if closing_abandoned {
                    // The last other request just finished: its last frames get the grace too.
                    if activity.idle() {
                        deadline = Instant::now() + ABANDONED_GRACE;
                    }
                } else if activity.abandoned_by_client() {
                    // Gracefully: answers that finished still reach the client (their last
                    // frames may be queued, not yet written), and requests read but not
                    // started are refused with GOAWAY rather than cut.
                    tracing::debug!("closing a connection whose client left its answers unread");
                    conn.as_mut().graceful_shutdown();
                    asked_to_close = true;
                    closing_abandoned = true;
                    deadline = Instant::now() + ABANDONED_GRACE;
                } else if activity.idle() {
                    deadline = Instant::now() + header_read_timeout;
                }
            }
            () = tokio::time::sleep_until(deadline), if idle => {
                if asked_to_close {
                    tracing::debug!("closing a connection that did not close when asked");
                    return;
                }
                tracing::debug!("closing a connection without a request for header_read_timeout");
                conn.as_mut().graceful_shutdown();
                asked_to_close = true;
                deadline = Instant::now() + header_read_timeout;
            }
            changed = closing.changed(), if !asked_to_close => {
                // (An earlier graceful close, for idleness or given-up answers, stands.)
                if changed.is_err() || *closing.borrow() {
                    conn.as_mut().graceful_shutdown();
                    asked_to_close = true;
                    deadline = Instant::now() + header_read_timeout;
                }
            }
        }
    }
}

/// Serves the gateway's public API on `listener` (over TLS when `tls` is given) until `shutdown`
/// resolves.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
) {
    let limits = gateway.limits().clone();
    let grace = gateway.shutdown_grace();
    let gw = Arc::clone(&gateway);
    let handler = move |req: Request<Incoming>| Arc::clone(&gw).serve(req);
    let stop = async {
        shutdown.await;
        gateway.begin_shutdown();
    };
    serve_with(listener, tls, handler, &limits, grace, stop).await;
}
