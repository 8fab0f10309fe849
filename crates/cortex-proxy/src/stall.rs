//! Answers a client stopped reading: a relay handed a frame to the server and not asked for
//! another within `client_write_timeout`, on a connection whose client took no bytes of any answer
//! in that time (`ConnSlot::progress`: a client reading a full socket slowly, or many streams of
//! one connection each waiting its turn, is still reading; on HTTP/2 this holds an answer at most
//! `MULTIPLEXED_WAIT_MAX` timeouts past its own frame), is given up — dropped as if the client
//! had left, which
//! releases its admission slot and booking and closes the worker's connection (the engine aborts
//! the request) and ends the request as `client_gone`. The client's stream is reset when the server
//! next writes to it. The request stops counting toward its connection's requests in flight: a
//! connection left with nothing else, or with several answers given up, is closed (`server.rs`);
//! so is a connection whose socket takes no byte for as long.
//!
//! Key decision: the relay cannot notice this itself — a server whose client does not read
//! (HTTP/2 flow control, a full socket) stops polling the body, so no code of the body runs. Each
//! relay is therefore kept in a shared cell that a sweeper of the gateway's maintenance loop
//! can empty; the relay's own poll takes the cell's uncontended lock once per frame.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use crate::error::BodyError;
use crate::server::ConnSlot;
use crate::upstream::RelayBody;

/// `since` of a relay that is not waiting for the client (waiting for the worker, or done).
const NOT_WAITING: u64 = u64::MAX;

/// A relay in its cell.
struct Cell {
    relay: Mutex<Option<RelayBody>>,
    /// Milliseconds since [`Stalls::base`] when the relay last handed over a frame, while the
    /// server has not asked for the next one; [`NOT_WAITING`] otherwise.
    since: AtomicU64,
    /// The request's place on its client connection, given back when the relay is given up.
    conn: Option<ConnSlot>,
    /// The connection's progress counts (socket drained, frames asked) when `since` was set:
    /// counts that moved since say its client is reading (the answer waits its turn).
    seen_drained: AtomicU64,
    seen_asks: AtomicU64,
    /// Milliseconds since [`Stalls::base`] when the relay last handed over a frame (`since`,
    /// unlike this, moves when the connection's progress re-arms the wait).
    handed_at: AtomicU64,
}

/// How many `client_write_timeout`s an HTTP/2 answer's own frame may wait while its connection
/// makes progress elsewhere: a stream waiting its turn gets one well within it, and a stream
/// whose window its client keeps shut is given up by then however busy the connection is.
const MULTIPLEXED_WAIT_MAX: u64 = 4;

/// The relays in flight and the sweep that gives up those whose client stopped reading.
pub(crate) struct Stalls {
    timeout: Duration,
    base: Instant,
    /// Relays in flight; a slot is reused once its relay ends.
    cells: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    cells: Vec<Option<Arc<Cell>>>,
    free: Vec<usize>,
}

impl std::fmt::Debug for Stalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stalls").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl Stalls {
    /// Relays whose client does not read for `timeout` are given up.
    pub(crate) fn new(timeout: Duration) -> Arc<Stalls> {
        Arc::new(Stalls { timeout, base: Instant::now(), cells: Mutex::new(Slots::default()) })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(NOT_WAITING - 1)
    }

    /// `relay`, watched; `conn` is the request's place on its client connection (none for a
    /// request that did not come through [`crate::server`]).
    pub(crate) fn watch(self: &Arc<Self>, relay: RelayBody, conn: Option<ConnSlot>) -> Watched {
        // Waiting from the start: the answer's head is the server's from now, and a server whose
        // client never opens its window may not ask for a first frame at all.
        let (drained, asks) = conn.as_ref().map_or((0, 0), ConnSlot::progress);
        let now = self.now_ms();
        let cell = Arc::new(Cell {
            relay: Mutex::new(Some(relay)),
            since: AtomicU64::new(now),
            conn,
            seen_drained: AtomicU64::new(drained),
            seen_asks: AtomicU64::new(asks),
            handed_at: AtomicU64::new(now),
        });
        let mut slots = lock(&self.cells);
        let slot = match slots.free.pop() {
            Some(i) => {
                slots.cells[i] = Some(Arc::clone(&cell));
                i
            }
            None => {
                slots.cells.push(Some(Arc::clone(&cell)));
                slots.cells.len() - 1
            }
        };
        Watched { cell, slot, stalls: Arc::clone(self) }
    }

    /// Gives up every relay that has waited for its client longer than the timeout; returns how
    /// many. A relay being polled right now is not waiting.
    pub(crate) fn sweep(&self) -> usize {
        let now = self.now_ms();
        let limit = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        let stalled: Vec<Arc<Cell>> = {
            let slots = lock(&self.cells);
            slots
                .cells
                .iter()
                .flatten()
                // Relaxed: a timestamp; the relay's lock below decides.
                .filter(|c| {
                    let since = c.since.load(Ordering::Relaxed);
                    since != NOT_WAITING && now.saturating_sub(since) > limit
                })
                .cloned()
                .collect()
        };
        let mut given_up = 0;
        for cell in stalled {
            let relay = cell.relay.try_lock().ok().and_then(|mut r| {
                // Relaxed: as above; checked again under the lock, where the relay's poll writes it.
                let since = cell.since.load(Ordering::Relaxed);
                if since == NOT_WAITING || now.saturating_sub(since) <= limit {
                    return None;
                }
                // Its client took bytes of the connection's answers since: the answer waits its
                // turn (a full socket draining slowly, other streams' share of the connection),
                // not a client that stopped. Watched afresh from now — on HTTP/2 only up to
                // `MULTIPLEXED_WAIT_MAX` timeouts of its own frame's wait.
                if let Some(c) = &cell.conn {
                    // Relaxed (all): as `since` above.
                    let (drained, asks) = c.progress();
                    let moved = drained != cell.seen_drained.load(Ordering::Relaxed)
                        || asks != cell.seen_asks.load(Ordering::Relaxed);
                    let own_wait = now.saturating_sub(cell.handed_at.load(Ordering::Relaxed));
                    if moved && (!c.multiplexed() || own_wait <= limit.saturating_mul(MULTIPLEXED_WAIT_MAX)) {
                        cell.seen_drained.store(drained, Ordering::Relaxed);
                        cell.seen_asks.store(asks, Ordering::Relaxed);
                        cell.since.store(now, Ordering::Relaxed);
                        return None;
                    }
                }
                // Marked under the lock: a poll that finds the cell empty comes after it.
                r.as_mut()?.client_stalled();
                r.take()
            });
            if let Some(relay) = relay {
                given_up += 1;
                metrics::counter!(crate::telemetry::CLIENT_WRITE_TIMEOUTS, "scope" => "answer").increment(1);
                tracing::info!(timeout = ?self.timeout, "a client stopped reading its answer: given up");
                if let Some(conn) = &cell.conn {
                    conn.abandon();
                }
                // Dropped here, outside every lock: as if the client had left.
                drop(relay);
            }
        }
        given_up
    }
}

/// A relay the sweeper can give up (see the module docs).
pub(crate) struct Watched {
    cell: Arc<Cell>,
    slot: usize,
    stalls: Arc<Stalls>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        // The relay ends here, not in a sweep that cloned the cell just before (which would count
        // an answer the client did read as given up).
        let relay = lock(&self.cell.relay).take();
        // Relaxed: as in `poll_frame`.
        self.cell.since.store(NOT_WAITING, Ordering::Relaxed);
        drop(relay);
        let mut slots = lock(&self.stalls.cells);
        slots.cells[self.slot] = None;
        slots.free.push(self.slot);
    }
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &*self;
        let mut relay = lock(&this.cell.relay);
        let Some(r) = relay.as_mut() else {
            let t = this.stalls.timeout;
            return Poll::Ready(Some(Err(format!("the client read nothing for {t:?}").into())));
        };
        let polled = Pin::new(r).poll_frame(cx);
        let since = match &polled {
            Poll::Ready(Some(Ok(_))) => {
                let now = this.stalls.now_ms();
                if let Some(c) = &this.cell.conn {
                    let (drained, asks) = c.progress();
                    // Relaxed (all): read under this lock by the sweep.
                    this.cell.seen_drained.store(drained, Ordering::Relaxed);
                    this.cell.seen_asks.store(asks, Ordering::Relaxed);
                }
                this.cell.handed_at.store(now, Ordering::Relaxed);
                now
            }
            _ => NOT_WAITING,
        };
        // Relaxed: read by the sweeper, which takes this lock before it acts.
        this.cell.since.store(since, Ordering::Relaxed);
        polled
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.cell.relay).as_ref().is_some_and(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.cell.relay).as_ref().map_or_else(SizeHint::default, HttpBody::size_hint)
    }
}

/// The lock, whatever a panic left behind (the cells hold no invariant a panic could break).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
