//! The running event plane: one socket thread that owns every ZeroMQ socket, and writer lanes
//! that apply batches to the ledger.
//!
//! ```text
//!  engine PUB ──► SUB (one per holder) ─┐
//!  engine ROUTER ◄─► DEALER (per replay)├─ socket thread ── seq + batch ──► lane k (holder % lanes)
//!  socket monitor (disconnects) ────────┘  (decodes a  ▲                     │ Sequencer (seq.rs)
//!                                           queued group) └─ replay requests ┤
//!                                                                             ▼ HolderWriter (ledger)
//! ```
//!
//! Key decisions:
//! - ZeroMQ sockets are not thread-safe, so exactly one thread owns them all and multiplexes them
//!   by polling their signalling descriptors (`ZMQ_FD`); it splits frames and reads the sequence
//!   number. Commands reach it through a channel plus an `inproc` wake-up socket. `zmq_poll` over
//!   the sockets themselves asks each socket for its events before and after the wait, a `poll`
//!   system call each: about twelve system calls per batch at one batch at a time, where the
//!   descriptors need one wait and the drain's last receive. The descriptors are edge-triggered
//!   (they announce new commands, not messages already queued), so a socket is drained until it
//!   has nothing, or kept *hot* — looked at again without waiting — when it may still have
//!   something: just created, just sent on, or a drain stopped at `BURST`.
//! - Applying — the real work — happens on the lanes, in parallel across holders and strictly in
//!   order within one (a holder always maps to the same lane). The socket thread decodes the
//!   groups it queues (decoding is a fifth of decode + apply), so that a busy lane only applies
//!   while the socket thread reads and decodes the next group: the two overlap.
//! - Hand-offs travel in groups, because a wake-up per batch costs as much as decoding it: the
//!   socket thread sends everything one socket has ready (up to `BURST`) as one channel message,
//!   and a lane drains its whole queue per wake-up and signals progress once per drain.
//! - No hand-off at all when the lane is idle: a small group for a lane with nothing queued is
//!   decoded and applied by the socket thread itself, under the lane's lock (the lane's state
//!   lives behind a mutex that its thread takes per drain). An engine publishing a batch per
//!   request, as at a gateway's ordinary load, then costs one thread wake-up per batch instead of
//!   two. Order within a holder holds: the socket thread applies inline only when every group it
//!   sent that lane before has been handled (`queued` counts sent and not yet handled), and busy
//!   lanes keep their parallelism.
//! - A panic stays with the holder whose state it concerns: a decoder's makes the batch
//!   undecodable; one while the ledger held the holder's state poisons that holder there
//!   (`LedgerError::Poisoned`). Each input runs under `catch_unwind`, and the holder's ledger state
//!   is quarantined — leaked rather than cleared, since clearing relies on invariants a panic
//!   part-way through a write may have broken — and the holder registered again and started cold
//!   (`LaneState::guarded`, `LaneHolder::rebuild`), up to [`MAX_REBUILDS`] times. Without it, a
//!   panic on the socket thread, which applies small groups inline, would stop every holder's
//!   events.
//! - Every replay uses a fresh DEALER socket (a REQ socket receives only one reply), so a late
//!   reply of an abandoned replay can never be mistaken for the current one.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::os::fd::RawFd;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SendError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cortex_hash::kv::{EventBatch, HolderId, WorkerId};
use cortex_radix::{HolderConfig, HolderWriter, Ledger, LedgerError, Readiness};

use crate::config::{HolderSource, IngestConfig, StaleRouting, Unlabeled, Wire};
use crate::seq::{Effect, Fingerprint, HolderState, Input, Reason, Replay, Sequencer};
use crate::stats::{DECODE_ERROR_KINDS, HolderStats, HolderStatus, Progress};

/// Why the runtime could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// A ZeroMQ call failed.
    #[error("zeromq: {0}")]
    Zmq(#[from] zmq::Error),
    /// The ledger refused the holder.
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// A thread could not be started.
    #[error("cannot start thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The runtime is shut down.
    #[error("the ingest runtime is shut down")]
    ShutDown,
}

static INSTANCE: AtomicU64 = AtomicU64::new(0);

/// End-of-replay sequence number (-1 as a signed 8-byte big-endian integer).
const END_SEQ: u64 = u64::MAX;

/// Lanes wake at least this often to check replay deadlines and silence.
const TICK: Duration = Duration::from_millis(50);

/// Messages drained from one socket per poll round, so one busy holder cannot starve the rest;
/// they reach the lane as one group.
const BURST: usize = 512;

/// Inputs a lane handles per wake-up before it signals progress and checks its timers.
const DRAIN: usize = 1024;

/// Largest group the socket thread applies itself when its lane is idle; a larger one (a burst,
/// a replay) goes to the lane, so that the socket thread keeps reading the other holders.
const INLINE_MAX: usize = 8;

/// Groups queued to a lane past which the socket thread stops reading the live sockets of that
/// lane's holders until it catches up: what they publish meanwhile waits in their SUB sockets,
/// bounded by `receive_hwm`, past which ZeroMQ drops it and the holder sees a gap (replayed or
/// cleared). Without it a lane slower than its engines would queue without bound.
const LANE_BACKLOG: usize = 16;

/// How long the socket thread waits before looking again at a socket it left unread for its
/// lane's backlog.
const BACKLOG_RECHECK_MS: i64 = 1;

enum SockCmd {
    Add(Subscription),
    RemoveWorker {
        worker: WorkerId,
        done: Sender<()>,
    },
    Replay {
        holder: HolderId,
        from: u64,
        /// The request's id, which its replies carry to the lane.
        id: u64,
    },
    /// Stop following one holder (given up after panics): its sockets are closed.
    Unsubscribe {
        holder: HolderId,
    },
    Shutdown,
}

/// A holder for the socket thread to follow.
struct Subscription {
    holder: HolderId,
    lane: usize,
    publish: String,
    topic: String,
    replay: Option<String>,
    decoder: Decoder,
}

enum LaneMsg {
    Add(Box<LaneHolder>),
    RemoveWorker {
        worker: WorkerId,
        done: Sender<()>,
    },
    /// One holder's inputs in arrival order: everything its socket had ready; for a replay's
    /// replies, the id of the request they answer (the lane drops the replies of any other).
    Inputs(HolderId, Vec<Input<Payload>>, Option<u64>),
    Shutdown,
}

/// Final counters of removed holders kept for [`Ingest::take_retired`] (the oldest are dropped
/// beyond this, if nobody takes them).
const RETIRED_MAX: usize = 4096;

struct Shared {
    ledger: Arc<Ledger>,
    cfg: IngestConfig,
    holders: Mutex<HashMap<HolderId, Arc<HolderStats>>>,
    /// Counters of removed holders, as they were at removal, until taken.
    retired: Mutex<VecDeque<HolderStatus>>,
    /// The next holder incarnation.
    incarnations: AtomicU64,
    /// The next replay request's id (unique across holders and their rebuilds).
    replay_ids: AtomicU64,
    progress: Progress,
    commands: Mutex<Commander>,
    lanes: Vec<LaneShared>,
}

/// One writer lane as the other threads reach it.
struct LaneShared {
    tx: Sender<LaneMsg>,
    /// Messages sent to the lane and not yet handled (incremented before the send, decremented
    /// under `state`'s lock once handled).
    queued: AtomicUsize,
    /// The lane's holders: its thread takes the lock per drain, the socket thread when it
    /// applies a group inline.
    state: Mutex<LaneState>,
}

/// The sending side of the socket thread's command channel, with its wake-up socket.
struct Commander {
    tx: Sender<SockCmd>,
    wake: zmq::Socket,
}

impl Shared {
    fn command(&self, cmd: SockCmd) -> Result<(), IngestError> {
        let c = self.commands.lock().map_err(|_| IngestError::ShutDown)?;
        c.tx.send(cmd).map_err(|_| IngestError::ShutDown)?;
        c.wake
            .send(&[][..], zmq::DONTWAIT)
            .or_else(|e| if e == zmq::Error::EAGAIN { Ok(()) } else { Err(e) })?;
        Ok(())
    }

    /// Queues `msg` for lane `lane`'s thread.
    fn send_lane(&self, lane: usize, msg: LaneMsg) -> Result<(), SendError<LaneMsg>> {
        let l = &self.lanes[lane];
        // AcqRel: pairs with the socket thread's Acquire load in `deliver`.
        l.queued.fetch_add(1, Ordering::AcqRel);
        l.tx.send(msg).inspect_err(|_| {
            l.queued.fetch_sub(1, Ordering::AcqRel);
        })
    }

    /// Hands a holder's inputs to its lane (the socket thread only): applied here and now when
    /// the group is small and the lane has nothing queued and is not draining, else queued.
    fn deliver(
        &self,
        lane: usize,
        holder: HolderId,
        mut inputs: Vec<Input<Payload>>,
        replay: Option<u64>,
        decoder: &Decoder,
    ) {
        let l = &self.lanes[lane];
        let small = inputs.len() <= INLINE_MAX;
        #[cfg(test)]
        let small = tests::forced_path(holder).unwrap_or(small);
        // Acquire: a count of zero means every message sent before was handled, and its
        // effects (the holder's state, under the lock) are visible.
        if small && l.queued.load(Ordering::Acquire) == 0 {
            // Busy (the lane is draining) or poisoned (its thread is gone): queue instead.
            if let Ok(mut state) = l.state.try_lock()
                && l.queued.load(Ordering::Acquire) == 0
            {
                #[cfg(test)]
                tests::count_path(holder, true);
                state.handle(self, LaneMsg::Inputs(holder, inputs, replay));
                drop(state);
                self.progress.notify();
                return;
            }
        }
        #[cfg(test)]
        tests::count_path(holder, false);
        // Queued: decode here, so that the lane only applies while this thread reads on.
        for input in &mut inputs {
            if let Input::Live { payload, .. } | Input::Replayed { payload, .. } = input {
                payload.decode(decoder);
            }
        }
        // An error means the lane is gone (shutdown).
        let _ = self.send_lane(lane, LaneMsg::Inputs(holder, inputs, replay));
    }

    fn lane_of(&self, holder: HolderId) -> usize {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        holder.hash(&mut h);
        (h.finish() % self.lanes.len() as u64) as usize
    }
}

/// The event plane of one gateway: add holders, and the ledger follows their engines.
///
/// Dropping it (or [`Ingest::shutdown`]) stops every thread and closes every socket.
pub struct Ingest {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest").field("lanes", &self.shared.lanes.len()).finish_non_exhaustive()
    }
}

impl Ingest {
    /// Starts the socket thread and the writer lanes, applying to `ledger`.
    ///
    /// # Errors
    /// [`IngestError`] if a socket or a thread cannot be created.
    pub fn start(ledger: Arc<Ledger>, cfg: IngestConfig) -> Result<Ingest, IngestError> {
        let ctx = zmq::Context::new();
        let id = INSTANCE.fetch_add(1, Ordering::Relaxed);
        let wake_endpoint = format!("inproc://cortex-ingest-wake-{id}");
        let wake_rx = ctx.socket(zmq::PULL)?;
        wake_rx.bind(&wake_endpoint)?;
        let wake_tx = ctx.socket(zmq::PUSH)?;
        wake_tx.set_sndhwm(1)?;
        wake_tx.set_linger(0)?;
        wake_tx.connect(&wake_endpoint)?;
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let lanes_n = cfg.lanes.max(1);
        let mut lanes = Vec::with_capacity(lanes_n);
        let mut lane_rxs = Vec::with_capacity(lanes_n);
        for _ in 0..lanes_n {
            let (tx, rx) = mpsc::channel();
            lanes.push(LaneShared {
                tx,
                queued: AtomicUsize::new(0),
                state: Mutex::new(LaneState::default()),
            });
            lane_rxs.push(rx);
        }
        let shared = Arc::new(Shared {
            ledger,
            cfg,
            holders: Mutex::new(HashMap::new()),
            retired: Mutex::new(VecDeque::new()),
            incarnations: AtomicU64::new(0),
            replay_ids: AtomicU64::new(1),
            progress: Progress::default(),
            commands: Mutex::new(Commander { tx: cmd_tx, wake: wake_tx }),
            lanes,
        });
        let mut threads = Vec::new();
        for (i, rx) in lane_rxs.into_iter().enumerate() {
            let s = Arc::clone(&shared);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("cortex-ingest-lane-{i}"))
                    .spawn(move || lane_loop(&s, i, &rx))
                    .map_err(IngestError::Thread)?,
            );
        }
        let s = Arc::clone(&shared);
        let sockets = SocketThread {
            ctx,
            id,
            wake_watch: Watch::of(&wake_rx)?,
            wake: wake_rx,
            commands: cmd_rx,
            holders: Vec::new(),
            next_monitor: 0,
            frames: Vec::new(),
        };
        threads.push(
            std::thread::Builder::new()
                .name("cortex-ingest-sockets".into())
                .spawn(move || sockets.run(&s))
                .map_err(IngestError::Thread)?,
        );
        Ok(Ingest { shared, threads })
    }

    /// Registers `source.holder` with the ledger (SYNCING) and subscribes to its engine.
    ///
    /// # Errors
    /// [`IngestError::Ledger`] if the holder already has a writer; [`IngestError::ShutDown`].
    pub fn add_holder(&self, source: HolderSource) -> Result<(), IngestError> {
        let cfg = HolderConfig {
            capacity_blocks: source.capacity_blocks,
            content_deterministic: source.content_deterministic,
        };
        let writer = self.shared.ledger.add_holder(source.holder, cfg)?;
        // Relaxed: the counter only needs to be unique and increasing.
        let incarnation = self.shared.incarnations.fetch_add(1, Ordering::Relaxed);
        let stats = Arc::new(HolderStats::new(source.holder, incarnation));
        self.shared
            .holders
            .lock()
            .map_err(|_| IngestError::ShutDown)?
            .insert(source.holder, Arc::clone(&stats));
        let lane = self.shared.lane_of(source.holder);
        let replay = if source.replay.is_some() { Replay::Available } else { Replay::Unavailable };
        let mut holder = LaneHolder {
            writer,
            seq: Sequencer::new(replay, self.shared.cfg.max_buffered),
            decoder: Decoder { wire: source.wire, model: source.model, unlabeled: source.unlabeled },
            stats,
            replay_deadline: None,
            last_event: Instant::now(),
            expect: None,
            cfg,
            replay,
            rebuilds: 0,
            replay_id: None,
            given_up: false,
        };
        holder.writer.set_readiness(Readiness::Syncing);
        // Sockets first: the lane's first act may be a replay request, which the socket thread
        // must find the holder for.
        self.shared.command(SockCmd::Add(Subscription {
            holder: source.holder,
            lane,
            publish: source.publish,
            topic: source.topic,
            replay: source.replay,
            decoder: holder.decoder.clone(),
        }))?;
        self.shared.send_lane(lane, LaneMsg::Add(Box::new(holder))).map_err(|_| IngestError::ShutDown)
    }

    /// Stops following every rank of `worker`: unsubscribes first (no late event can be
    /// applied), then drops its ledger entries. Returns once both are done.
    ///
    /// # Errors
    /// [`IngestError::ShutDown`].
    pub fn remove_worker(&self, worker: WorkerId) -> Result<(), IngestError> {
        let (done, wait) = mpsc::channel();
        self.shared.command(SockCmd::RemoveWorker { worker, done })?;
        wait.recv().map_err(|_| IngestError::ShutDown)?;
        for lane in 0..self.shared.lanes.len() {
            let (done, wait) = mpsc::channel();
            self.shared
                .send_lane(lane, LaneMsg::RemoveWorker { worker, done })
                .map_err(|_| IngestError::ShutDown)?;
            wait.recv().map_err(|_| IngestError::ShutDown)?;
        }
        self.shared.ledger.remove_worker(worker);
        let mut gone = Vec::new();
        if let Ok(mut h) = self.shared.holders.lock() {
            h.retain(|id, s| {
                let keep = id.worker != worker;
                if !keep {
                    gone.push(s.status());
                }
                keep
            });
        }
        gone.sort_by_key(|s| s.holder);
        if let Ok(mut r) = self.shared.retired.lock() {
            r.extend(gone);
            while r.len() > RETIRED_MAX {
                r.pop_front();
            }
        }
        self.shared.progress.notify();
        Ok(())
    }

    /// Reports how many requests a worker's engine says are running (from load polling), and
    /// since when (`stores`) the gateway has sent it requests that store new blocks: a holder
    /// that publishes nothing for `silence_timeout` after such a request is suspected STALE. An
    /// engine serving cache hits only stores nothing, so it is rightly quiet however busy.
    pub fn report_running(&self, holder: HolderId, running: u64, stores: Option<(Instant, Instant)>) {
        if let Some(s) = self.stats_of(holder) {
            // Relaxed: a gauge read by the holder's lane on its next tick.
            s.running.store(running, Ordering::Relaxed);
            if let Some((first, last)) = stores {
                let mut e = s.expected.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                *e = Some(e.map_or((first, last), |(f, l)| (f.min(first), l.max(last))));
            }
        }
    }

    fn stats_of(&self, holder: HolderId) -> Option<Arc<HolderStats>> {
        self.shared.holders.lock().ok()?.get(&holder).cloned()
    }

    /// The counters of `holder`, if it is followed.
    #[must_use]
    pub fn status(&self, holder: HolderId) -> Option<HolderStatus> {
        self.stats_of(holder).map(|s| s.status())
    }

    /// The counters of every followed holder.
    #[must_use]
    pub fn statuses(&self) -> Vec<HolderStatus> {
        let Ok(h) = self.shared.holders.lock() else { return Vec::new() };
        let mut v: Vec<HolderStatus> = h.values().map(|s| s.status()).collect();
        v.sort_by_key(|s| s.holder);
        v
    }

    /// The final counters of the holders removed since the last call, in removal order: what a
    /// holder counted between the last look at [`Ingest::statuses`] and its removal (a worker
    /// that failed and left) is not lost to whoever turns counters into metrics.
    #[must_use]
    pub fn take_retired(&self) -> Vec<HolderStatus> {
        self.shared.retired.lock().map(|mut r| r.drain(..).collect()).unwrap_or_default()
    }

    /// Waits until `done(status)` holds for `holder` or `timeout` passes; returns whether it
    /// holds. Progress is signalled after every group of batches a lane applies and every state
    /// change, so this never polls.
    pub fn wait_for(
        &self,
        holder: HolderId,
        timeout: Duration,
        mut done: impl FnMut(&HolderStatus) -> bool,
    ) -> bool {
        self.shared.progress.wait_until(timeout, || self.status(holder).is_some_and(|s| done(&s)))
    }

    /// Stops every thread and closes every socket.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // Errors mean the threads are already gone.
        let _ = self.shared.command(SockCmd::Shutdown);
        for lane in 0..self.shared.lanes.len() {
            let _ = self.shared.send_lane(lane, LaneMsg::Shutdown);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Ingest {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A holder's sockets, owned by the socket thread.
struct SockHolder {
    holder: HolderId,
    lane: usize,
    sub: zmq::Socket,
    monitor: zmq::Socket,
    sub_watch: Watch,
    monitor_watch: Watch,
    /// The `inproc` endpoint `monitor` reads the SUB's events from.
    monitor_endpoint: String,
    replay_endpoint: Option<String>,
    /// The replay in progress: its socket, how to wait on it, and its request's id.
    dealer: Option<(zmq::Socket, Watch, u64)>,
    decoder: Decoder,
}

impl Drop for SockHolder {
    /// Turns the SUB's monitor off before its sockets close. Closing a SUB is asynchronous: its
    /// connection can still report a disconnect from libzmq's I/O thread, which sends the event
    /// to the monitor with a blocking send; once `monitor` (the only reader) is closed, that send
    /// never returns, and the I/O thread of every holder's connections stops with it (seen as
    /// a new holder's subscription never reaching its engine after a worker was removed while
    /// its engine went away). Monitoring again with no events stops the old monitor without an
    /// event and sends nothing more. (`zmq::Socket::monitor` cannot pass the NULL endpoint that
    /// only stops.)
    fn drop(&mut self) {
        let off = format!("{}-off", self.monitor_endpoint);
        if let Err(e) = self.sub.monitor(&off, 0) {
            tracing::warn!(holder = %self.holder, error = %e, "ingest: cannot stop a closing socket's monitor");
        }
    }
}

struct SocketThread {
    ctx: zmq::Context,
    id: u64,
    wake: zmq::Socket,
    wake_watch: Watch,
    commands: Receiver<SockCmd>,
    holders: Vec<SockHolder>,
    next_monitor: u64,
    /// The frames of the message being received (reused: no allocation per message).
    frames: Vec<zmq::Message>,
}

/// How the socket thread waits on one socket: its signalling descriptor (`ZMQ_FD`), and whether
/// the socket may hold messages the descriptor will not announce (`hot`: look without waiting;
/// see the module docs).
#[derive(Clone, Copy)]
struct Watch {
    fd: RawFd,
    hot: bool,
}

impl Watch {
    /// A new socket's: hot, since what it already has was never announced.
    fn of(socket: &zmq::Socket) -> Result<Watch, zmq::Error> {
        Ok(Watch { fd: socket.get_fd()?, hot: true })
    }
}

/// Which socket a poll item belongs to.
#[derive(Clone, Copy)]
enum Slot {
    Wake,
    Sub(usize),
    Dealer(usize),
    Monitor(usize),
}

impl SocketThread {
    fn run(mut self, shared: &Shared) {
        loop {
            let mut slots = vec![Slot::Wake];
            for (i, h) in self.holders.iter().enumerate() {
                slots.push(Slot::Sub(i));
                slots.push(Slot::Monitor(i));
                if h.dealer.is_some() {
                    slots.push(Slot::Dealer(i));
                }
            }
            let watch = |s: &Slot| match *s {
                Slot::Wake => self.wake_watch,
                Slot::Sub(i) => self.holders[i].sub_watch,
                Slot::Monitor(i) => self.holders[i].monitor_watch,
                // A dealer slot exists only while the replay does.
                Slot::Dealer(i) => {
                    self.holders[i].dealer.as_ref().map_or(Watch { fd: -1, hot: false }, |d| d.1)
                }
            };
            let hot = |s: &Slot| watch(s).hot;
            // A live socket whose lane is backlogged is left unread (see `LANE_BACKLOG`).
            let deferred = |s: &Slot| match *s {
                Slot::Sub(i) => {
                    // Acquire: as in `deliver`.
                    shared.lanes[self.holders[i].lane].queued.load(Ordering::Acquire) >= LANE_BACKLOG
                }
                _ => false,
            };
            let deferred: Vec<bool> = slots.iter().map(deferred).collect();
            // A hot socket is looked at whatever its descriptor says, so the wait must not block;
            // one left unread is looked at again shortly.
            let timeout = if slots.iter().zip(&deferred).any(|(s, d)| hot(s) && !d) {
                0
            } else if deferred.contains(&true) {
                BACKLOG_RECHECK_MS
            } else {
                -1
            };
            let ready: Vec<bool> = {
                let mut items: Vec<zmq::PollItem<'_>> =
                    slots.iter().map(|s| zmq::PollItem::from_fd(watch(s).fd, zmq::POLLIN)).collect();
                if let Err(e) = zmq::poll(&mut items, timeout) {
                    if e == zmq::Error::EINTR {
                        continue;
                    }
                    tracing::error!(error = %e, "ingest: zmq poll failed; the event plane stops");
                    // No more events will arrive: no holder's ledger may stay READY.
                    for h in &self.holders {
                        let _ = shared
                            .send_lane(h.lane, LaneMsg::Inputs(h.holder, vec![Input::Disconnected], None));
                    }
                    return;
                }
                items.iter().zip(&slots).map(|(item, s)| item.is_readable() || hot(s)).collect()
            };
            // The sockets first, while the indices in `slots` still name them; the commands
            // last, since removing a worker shifts the holders after it.
            let mut wake = false;
            for ((slot, readable), deferred) in slots.iter().zip(ready).zip(deferred) {
                if !readable {
                    continue;
                }
                if deferred && let Slot::Sub(i) = *slot {
                    // Its descriptor's announcement is spent: look again without it.
                    self.holders[i].sub_watch.hot = true;
                    #[cfg(test)]
                    tests::count_deferral();
                    continue;
                }
                match *slot {
                    Slot::Wake => wake = true,
                    Slot::Sub(i) => self.drain_sub(shared, i),
                    Slot::Dealer(i) => self.drain_dealer(shared, i),
                    Slot::Monitor(i) => self.drain_monitor(shared, i),
                }
            }
            if wake {
                while recv_msg(&self.wake, zmq::DONTWAIT).is_ok() {}
                self.wake_watch.hot = false;
                if !self.run_commands(shared) {
                    return;
                }
            }
        }
    }

    /// Executes queued commands; false on shutdown.
    fn run_commands(&mut self, shared: &Shared) -> bool {
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                SockCmd::Shutdown => return false,
                SockCmd::Add(add) => {
                    let (holder, publish) = (add.holder, add.publish.clone());
                    match self.subscribe(shared, add) {
                        Ok(h) => self.holders.push(h),
                        Err(e) => {
                            tracing::error!(%holder, endpoint = %publish, error = %e, "ingest: cannot subscribe")
                        }
                    }
                }
                SockCmd::RemoveWorker { worker, done } => {
                    // Dropping the sockets closes them (linger 0): nothing more arrives.
                    self.holders.retain(|h| h.holder.worker != worker);
                    let _ = done.send(());
                }
                SockCmd::Replay { holder, from, id } => self.start_replay(holder, from, id),
                SockCmd::Unsubscribe { holder } => {
                    self.holders.retain(|h| h.holder != holder);
                    tracing::info!(%holder, "ingest: unsubscribed");
                }
            }
        }
        true
    }

    fn subscribe(&mut self, shared: &Shared, add: Subscription) -> Result<SockHolder, zmq::Error> {
        let Subscription { holder, lane, publish, topic, replay, decoder } = add;
        let (publish, topic) = (publish.as_str(), topic.as_str());
        let sub = self.ctx.socket(zmq::SUB)?;
        sub.set_rcvhwm(shared.cfg.receive_hwm)?;
        sub.set_linger(0)?;
        let endpoint = format!("inproc://cortex-ingest-monitor-{}-{}", self.id, self.next_monitor);
        self.next_monitor += 1;
        sub.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED.to_raw().into())?;
        let monitor = self.ctx.socket(zmq::PAIR)?;
        monitor.connect(&endpoint)?;
        sub.set_subscribe(topic.as_bytes())?;
        sub.connect(publish)?;
        let (sub_watch, monitor_watch) = (Watch::of(&sub)?, Watch::of(&monitor)?);
        tracing::info!(%holder, endpoint = publish, topic, "ingest: subscribed");
        Ok(SockHolder {
            holder,
            lane,
            sub,
            monitor,
            sub_watch,
            monitor_watch,
            monitor_endpoint: endpoint,
            replay_endpoint: replay,
            dealer: None,
            decoder,
        })
    }

    fn start_replay(&mut self, holder: HolderId, from: u64, id: u64) {
        let Some(h) = self.holders.iter_mut().find(|h| h.holder == holder) else { return };
        let Some(endpoint) = h.replay_endpoint.clone() else { return };
        // A fresh socket per request: replies to an abandoned request die with the old one.
        h.dealer = None;
        let dealer = (|| -> Result<zmq::Socket, zmq::Error> {
            let d = self.ctx.socket(zmq::DEALER)?;
            d.set_linger(0)?;
            d.set_rcvhwm(0)?;
            d.connect(&endpoint)?;
            d.send_multipart([&[][..], &from.to_be_bytes()[..]], 0)?;
            Ok(d)
        })();
        // Just sent on (hot): its replies may come without the descriptor firing.
        match dealer.and_then(|d| Watch::of(&d).map(|w| (d, w, id))) {
            Ok(d) => {
                tracing::info!(%holder, from, endpoint, "ingest: replay requested");
                h.dealer = Some(d);
            }
            // The lane's replay deadline turns this into a cold rebuild.
            Err(e) => tracing::warn!(%holder, error = %e, "ingest: cannot request replay"),
        }
    }

    fn drain_sub(&mut self, shared: &Shared, i: usize) {
        let h = &mut self.holders[i];
        let parts = &mut self.frames;
        let mut group = Vec::new();
        // Every message counts toward `BURST`, the ones skipped too: a flood of malformed ones
        // must not keep the thread on one socket.
        let mut received = 0;
        while received < BURST && recv_parts(&h.sub, parts).is_ok() {
            received += 1;
            if parts.len() != 3 {
                tracing::warn!(holder = %h.holder, frames = parts.len(), "ingest: ignoring a message that is not [topic, seq, payload]");
                continue;
            }
            let Some(seq) = seq_of(&parts[1]) else { continue };
            let payload = Payload::new(parts.pop().unwrap_or_else(zmq::Message::new));
            group.push(Input::Live { seq, payload });
        }
        // Stopped at `BURST`: the rest is already queued, and nothing will announce it.
        h.sub_watch.hot = received >= BURST;
        if !group.is_empty() {
            shared.deliver(h.lane, h.holder, group, None, &h.decoder);
        }
    }

    fn drain_dealer(&mut self, shared: &Shared, i: usize) {
        let h = &mut self.holders[i];
        let Some(&(ref dealer, _, id)) = h.dealer.as_ref() else { return };
        let parts = &mut self.frames;
        let mut group = Vec::new();
        let mut finished = false;
        let mut received = 0;
        while !finished && received < BURST && recv_parts(dealer, parts).is_ok() {
            received += 1;
            // vLLM ≥ 0.26 and SGLang: ["", topic, seq, payload]; vLLM ≤ 0.25: ["", seq, payload].
            let seq = match parts.len() {
                4 if parts[0].is_empty() => seq_of(&parts[2]),
                3 if parts[0].is_empty() => seq_of(&parts[1]),
                _ => None,
            };
            let input = match seq {
                Some(END_SEQ) => {
                    finished = true;
                    Input::ReplayEnd
                }
                Some(seq) => Input::Replayed {
                    seq,
                    payload: Payload::new(parts.pop().unwrap_or_else(zmq::Message::new)),
                },
                None => {
                    tracing::warn!(holder = %h.holder, "ingest: ignoring a malformed replay reply");
                    continue;
                }
            };
            group.push(input);
        }
        if !group.is_empty() {
            shared.deliver(h.lane, h.holder, group, Some(id), &h.decoder);
        }
        if finished {
            h.dealer = None;
        } else if let Some((_, w, _)) = h.dealer.as_mut() {
            w.hot = received >= BURST;
        }
    }

    fn drain_monitor(&mut self, shared: &Shared, i: usize) {
        let h = &mut self.holders[i];
        h.monitor_watch.hot = false;
        let parts = &mut self.frames;
        while recv_parts(&h.monitor, parts).is_ok() {
            let event = parts.first().filter(|p| p.len() >= 2).map(|p| u16::from_le_bytes([p[0], p[1]]));
            if event == Some(zmq::SocketEvent::DISCONNECTED.to_raw()) {
                tracing::warn!(holder = %h.holder, "ingest: publisher disconnected");
                shared.deliver(h.lane, h.holder, vec![Input::Disconnected], None, &h.decoder);
            }
        }
    }
}

/// Receives the next message, if one is ready, into `parts` (its frames; the vector is reused).
fn recv_parts(socket: &zmq::Socket, parts: &mut Vec<zmq::Message>) -> Result<(), zmq::Error> {
    parts.clear();
    parts.push(recv_msg(socket, zmq::DONTWAIT)?);
    while socket.get_rcvmore()? {
        parts.push(recv_msg(socket, 0)?);
    }
    Ok(())
}

/// One frame, the receive retried when a signal interrupts it. An interrupted receive may
/// already have processed the socket's commands, and with them the wake-up of its descriptor:
/// stopping there would leave what is queued unannounced (and a message's later frames to be
/// read as a message of their own).
fn recv_msg(socket: &zmq::Socket, flags: i32) -> Result<zmq::Message, zmq::Error> {
    loop {
        match socket.recv_msg(flags) {
            Err(zmq::Error::EINTR) => {}
            r => return r,
        }
    }
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// How a holder's payloads decode: its engine's wire format, the served model, and how to read
/// stores without extra keys. The socket thread and the holder's lane each have a copy.
#[derive(Clone, Debug)]
struct Decoder {
    wire: Wire,
    model: String,
    unlabeled: Unlabeled,
}

/// The index of `other` in [`DECODE_ERROR_KINDS`].
const DECODE_OTHER: usize = 3;
const _: () = assert!(DECODE_ERROR_KINDS.len() == DECODE_OTHER + 1);

/// A decoded batch, or the decode error's kind (an index of [`DECODE_ERROR_KINDS`]) and message.
type Decoded = Result<EventBatch, (usize, String)>;

impl Decoder {
    /// Decodes `payload`. A decoder's panic (a bug the fuzzing has not found) makes the batch
    /// undecodable, kind `other`: the decoders only read the payload, so nothing is left
    /// half-changed, and the holder goes through the undecodable path (cleared, READY cold).
    fn decode(&self, payload: &[u8]) -> Decoded {
        std::panic::catch_unwind(AssertUnwindSafe(|| self.decode_unguarded(payload))).unwrap_or_else(
            |panic| Err((DECODE_OTHER, format!("the decoder panicked: {}", panic_message(&*panic)))),
        )
    }

    fn decode_unguarded(&self, payload: &[u8]) -> Decoded {
        #[cfg(test)]
        assert!(self.model != tests::PANICKING_MODEL, "injected decoder panic");
        match self.wire {
            Wire::Vllm => {
                let unlabeled = match self.unlabeled {
                    Unlabeled::Plain => cortex_events_vllm::Unlabeled::Plain,
                    Unlabeled::Unknown => cortex_events_vllm::Unlabeled::Unknown,
                };
                cortex_events_vllm::decode(
                    payload,
                    &cortex_events_vllm::DecodeContext::new(&self.model, unlabeled),
                )
                .map_err(|e| (vllm_error_kind(&e), e.to_string()))
            }
            Wire::Sglang => {
                let unlabeled = match self.unlabeled {
                    Unlabeled::Plain => cortex_events_sglang::Unlabeled::Plain,
                    Unlabeled::Unknown => cortex_events_sglang::Unlabeled::Unknown,
                };
                cortex_events_sglang::decode(
                    payload,
                    &cortex_events_sglang::DecodeContext::new(&self.model, unlabeled),
                )
                .map_err(|e| (sglang_error_kind(&e), e.to_string()))
            }
        }
    }
}

/// A batch as the sequencer carries it: the message until it is decoded (by the socket thread
/// for a group it queues to a lane; else by whoever applies it), then the decoding alone. The
/// message is released where it was decoded: releasing a ZeroMQ message (its share of the
/// receive buffer, a reference count the I/O thread also writes) was a third of a busy lane's
/// time when the lane did it.
struct Payload {
    /// A hash of the message's bytes, taken when it is read (see [`Fingerprint`]).
    fp: u64,
    body: Body,
}

enum Body {
    Raw(zmq::Message),
    Decoded(Decoded),
}

impl Payload {
    fn new(msg: zmq::Message) -> Payload {
        Payload { fp: xxhash_rust::xxh3::xxh3_64(&msg), body: Body::Raw(msg) }
    }

    /// Decodes the message in place (the message is dropped here).
    fn decode(&mut self, decoder: &Decoder) {
        if let Body::Raw(msg) = &self.body {
            let decoded = decoder.decode(msg);
            self.body = Body::Decoded(decoded);
        }
    }
}

impl Fingerprint for Payload {
    fn fingerprint(&self) -> u64 {
        self.fp
    }
}

/// A holder as its lane sees it.
struct LaneHolder {
    writer: HolderWriter,
    seq: Sequencer<Payload>,
    decoder: Decoder,
    stats: Arc<HolderStats>,
    replay_deadline: Option<Instant>,
    last_event: Instant,
    /// The first and the last request that stores new blocks sent to the engine and not yet
    /// followed by an event: the engine must publish one after each, so silence counts from the
    /// first (an engine idle, or serving cache hits only, is rightly quiet however long). Two
    /// points stand for the requests between: an event between them leaves the last owed, which
    /// can only delay a suspicion, never make a false one.
    expect: Option<(Instant, Instant)>,
    /// What the holder was registered with, and whether its engine replays: a rebuild
    /// registers it again the same way.
    cfg: HolderConfig,
    replay: Replay,
    /// Rebuilds after a panic so far (at most [`MAX_REBUILDS`]).
    rebuilds: u32,
    /// The id of the last replay requested, whose replies are the only ones taken.
    replay_id: Option<u64>,
    /// Given up after too many panics: registered, empty and STALE, unsubscribed, any input
    /// still on its way dropped.
    given_up: bool,
}

/// A lane's holders and its reusable buffers.
#[derive(Default)]
struct LaneState {
    holders: HashMap<HolderId, LaneHolder>,
    effects: Vec<Effect<Payload>>,
    pending: VecDeque<Effect<Payload>>,
}

fn lane_loop(shared: &Shared, lane: usize, rx: &Receiver<LaneMsg>) {
    let l = &shared.lanes[lane];
    loop {
        let mut next = match rx.recv_timeout(TICK) {
            Ok(msg) => Some(msg),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut state = l.state.lock().unwrap_or_else(PoisonError::into_inner);
        if next.is_some() {
            // Drain what queued up meanwhile: one wake-up and one progress signal for all of it.
            let mut handled = 0;
            while let Some(msg) = next.take() {
                let n = state.handle(shared, msg);
                // AcqRel: the socket thread's Acquire load of zero sees this message handled.
                l.queued.fetch_sub(1, Ordering::AcqRel);
                match n {
                    Some(n) => handled += n,
                    None => return,
                }
                if handled < DRAIN {
                    next = match rx.try_recv() {
                        Ok(msg) => Some(msg),
                        Err(TryRecvError::Empty) => None,
                        Err(TryRecvError::Disconnected) => return,
                    };
                }
            }
            shared.progress.notify();
        }
        state.check_timers(shared);
    }
}

impl LaneState {
    /// Handles one message; the number of inputs it carried, or `None` on shutdown.
    fn handle(&mut self, shared: &Shared, msg: LaneMsg) -> Option<usize> {
        match msg {
            LaneMsg::Shutdown => return None,
            LaneMsg::Add(h) => {
                let id = h.writer.holder();
                self.holders.entry(id).or_insert(*h);
                self.guarded(shared, id, |h, effects, pending| {
                    h.seq.step(Input::Start, effects);
                    h.execute(shared, effects, pending)
                });
            }
            LaneMsg::RemoveWorker { worker, done } => {
                self.holders.retain(|id, _| id.worker != worker);
                let _ = done.send(());
            }
            LaneMsg::Inputs(id, inputs, replay) => {
                let n = inputs.len();
                let Some(h) = self.holders.get_mut(&id) else { return Some(n) };
                if replay.is_some_and(|r| Some(r) != h.replay_id) {
                    // Replies to a replay given up since (a new one was asked for, or the holder
                    // was rebuilt): they must not be taken for the current one's.
                    HolderStats::add(&h.stats.stale_replies, n as u64);
                    return Some(n);
                }
                // One input at a time, so that after a rebuild the rest of the group reaches
                // the rebuilt holder.
                for input in inputs {
                    let ran = self.guarded(shared, id, |h, effects, pending| {
                        if h.given_up {
                            return Fate::Alive;
                        }
                        h.seq.step(input, effects);
                        h.execute(shared, effects, pending)
                    });
                    if !ran {
                        break;
                    }
                }
                return Some(n);
            }
        }
        Some(1)
    }

    /// Runs `f` on holder `id`, if the lane has it, and drops the holder if the ledger revoked it
    /// (its worker was removed). A panic in `f` — in the ledger's apply, on the lane's thread or
    /// inline on the socket thread — or a holder whose ledger state a panic on another thread
    /// left half-changed ([`Fate::Poisoned`]) is contained to this holder: its ledger state is
    /// quarantined and the holder registered again (`LaneHolder::rebuild`), while the lane's
    /// other holders go on. Returns whether `f` ran.
    fn guarded(
        &mut self,
        shared: &Shared,
        id: HolderId,
        f: impl FnOnce(&mut LaneHolder, &mut Vec<Effect<Payload>>, &mut VecDeque<Effect<Payload>>) -> Fate,
    ) -> bool {
        let Some(h) = self.holders.get_mut(&id) else { return false };
        let (effects, pending) = (&mut self.effects, &mut self.pending);
        // AssertUnwindSafe: after a panic the buffers are emptied, the holder's sequencer and
        // writer are replaced and its ledger state is quarantined, never read again; what the new
        // holder keeps of the old one (its counters, decoder and settings) is atomics and plain
        // data that a panic cannot leave half-changed.
        let why = match std::panic::catch_unwind(AssertUnwindSafe(|| f(h, effects, pending))) {
            Ok(Fate::Alive) => return true,
            Ok(Fate::Removed) => {
                self.holders.remove(&id);
                return true;
            }
            Ok(Fate::Poisoned) => "a panic on another thread left its ledger state half-changed".to_owned(),
            Err(panic) => panic_message(&*panic).to_owned(),
        };
        self.effects.clear();
        self.pending.clear();
        if let Some(h) = self.holders.remove(&id)
            && let Some(mut h) = h.rebuild(shared, &why)
        {
            if !h.given_up {
                h.seq.start_cold(&mut self.effects);
            }
            if h.execute(shared, &mut self.effects, &mut self.pending) == Fate::Alive {
                self.holders.insert(id, h);
            }
        }
        shared.progress.notify();
        true
    }

    fn check_timers(&mut self, shared: &Shared) {
        let now = Instant::now();
        let mut due = Vec::new();
        for (id, h) in self.holders.iter_mut().filter(|(_, h)| !h.given_up) {
            let reported = h.stats.expected.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            if let Some((first, last)) = reported {
                h.expect = Some(h.expect.map_or((first, last), |(f, l)| (f.min(first), l.max(last))));
            }
            // An event after the requests that obliged one pays them (the report may come after
            // the event: the load poll lags the requests).
            h.expect = match h.expect {
                Some((_, last)) if h.last_event >= last => None,
                Some((first, last)) if h.last_event >= first => Some((last, last)),
                e => e,
            };
            let input = if h.replay_deadline.is_some_and(|d| now >= d) && h.seq.replaying() {
                h.replay_deadline = None;
                Some(Input::ReplayTimeout)
            } else if h.seq.state() == HolderState::Ready
                && h.expect.is_some_and(|(first, _)| {
                    now.saturating_duration_since(first) >= shared.cfg.silence_timeout
                })
            {
                h.expect = None;
                Some(Input::Silent)
            } else {
                None
            };
            if let Some(input) = input {
                due.push((*id, input));
            }
        }
        let changed = !due.is_empty();
        for (id, input) in due {
            self.guarded(shared, id, |h, effects, pending| {
                h.seq.step(input, effects);
                h.execute(shared, effects, pending)
            });
        }
        if changed {
            shared.progress.notify();
        }
    }
}

/// Rebuilds of one holder after panics before the runtime gives up on it.
const MAX_REBUILDS: u32 = 3;

/// Holders the ledger may have quarantined (each leaks what it held) before the runtime stops
/// rebuilding any: a bound on the memory and slots leaked.
const MAX_QUARANTINED: u64 = 64;

/// What became of a holder after an input was handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Alive,
    /// The ledger revoked it: its worker was removed.
    Removed,
    /// A panic on another thread (another holder's writer leaving it a graft) left its ledger
    /// state half-changed.
    Poisoned,
}

/// The message of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

impl LaneHolder {
    /// After a panic while applying this holder's events: counts it, takes the holder's ledger
    /// state out of the ledger without touching it (`Ledger::quarantine`: a panic part-way
    /// through an apply may have broken the invariants that clearing relies on), and registers
    /// the holder again, empty, its count of lost history carried on. The caller starts the new
    /// sequencer cold (no replay: the replies of a replay in progress at the panic may still be
    /// queued). After [`MAX_REBUILDS`] rebuilds, or once the ledger has quarantined
    /// [`MAX_QUARANTINED`] holders, the new registration is given up instead: STALE, empty and
    /// unsubscribed, until its worker is removed and added again. `None` if the holder was
    /// removed meanwhile.
    fn rebuild(self, shared: &Shared, why: &str) -> Option<LaneHolder> {
        let id = self.writer.holder();
        self.stats.set_state(HolderState::Stale);
        self.stats.count_transition(Reason::InternalError);
        let lost = shared.ledger.quarantine(id)?;
        let give_up = self.rebuilds >= MAX_REBUILDS || shared.ledger.quarantined() >= MAX_QUARANTINED;
        let mut writer = match shared.ledger.add_holder(id, self.cfg) {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(holder = %id, why, error = %e, "ingest: applying the holder's events panicked, and it cannot be registered again; its events are dropped");
                return None;
            }
        };
        writer.carry_history_lost(lost + 1);
        if give_up {
            writer.set_readiness(Readiness::Stale);
            // Nothing it publishes is applied any more: stop receiving (and decoding) it. An
            // error means the runtime is shutting down.
            let _ = shared.command(SockCmd::Unsubscribe { holder: id });
            tracing::error!(holder = %id, why, rebuilds = self.rebuilds, quarantined = shared.ledger.quarantined(), "ingest: applying the holder's events panicked again; it stays STALE and unsubscribed until its worker is removed and added again");
        } else {
            tracing::error!(holder = %id, why, "ingest: applying the holder's events panicked; its ledger state is quarantined and the holder rebuilt cold from its engine's next events");
        }
        Some(LaneHolder {
            writer,
            seq: Sequencer::new(self.replay, shared.cfg.max_buffered),
            replay_deadline: None,
            last_event: Instant::now(),
            expect: None,
            rebuilds: self.rebuilds + 1,
            replay_id: None,
            given_up: give_up,
            ..self
        })
    }

    /// Executes `effects` in order (through `pending`, empty between calls); stops early if
    /// the ledger revoked this holder or a panic poisoned its state.
    fn execute(
        &mut self,
        shared: &Shared,
        effects: &mut Vec<Effect<Payload>>,
        pending: &mut VecDeque<Effect<Payload>>,
    ) -> Fate {
        pending.extend(effects.drain(..));
        let fate = self.run_effects(shared, effects, pending);
        pending.clear();
        effects.clear();
        fate
    }

    fn run_effects(
        &mut self,
        shared: &Shared,
        more: &mut Vec<Effect<Payload>>,
        pending: &mut VecDeque<Effect<Payload>>,
    ) -> Fate {
        while let Some(effect) = pending.pop_front() {
            match effect {
                Effect::Apply { seq, payload } => match self.apply(seq, payload) {
                    // The engine's events reach the ledger (silence detection); a batch dropped
                    // as a duplicate does not count.
                    Ok(true) => self.last_event = Instant::now(),
                    Ok(false) => {
                        self.last_event = Instant::now();
                        // Undecodable: its events are lost; the machine says what to do, first.
                        self.seq.step(Input::Undecodable, more);
                        for e in more.drain(..).rev() {
                            pending.push_front(e);
                        }
                    }
                    Err(LedgerError::Revoked(_)) => return Fate::Removed,
                    Err(LedgerError::Poisoned(_)) => return Fate::Poisoned,
                    Err(e) => {
                        tracing::error!(holder = %self.writer.holder(), error = %e, "ingest: apply failed")
                    }
                },
                Effect::Clear(reason) => {
                    self.writer.clear();
                    self.writer.mark_history_lost();
                    HolderStats::add(&self.stats.clears, 1);
                    tracing::info!(holder = %self.writer.holder(), reason = reason.as_str(), "ingest: holder cleared");
                }
                Effect::RequestReplay { from } => {
                    HolderStats::add(&self.stats.replays_requested, 1);
                    self.replay_deadline = Some(Instant::now() + shared.cfg.replay_timeout);
                    // Relaxed: ids need only be unique.
                    let id = shared.replay_ids.fetch_add(1, Ordering::Relaxed);
                    self.replay_id = Some(id);
                    if shared.command(SockCmd::Replay { holder: self.writer.holder(), from, id }).is_err() {
                        return Fate::Removed;
                    }
                }
                Effect::Duplicate { .. } => HolderStats::add(&self.stats.duplicates, 1),
                Effect::State(state, reason) => {
                    if !self.seq.replaying() {
                        self.replay_deadline = None;
                    }
                    self.stats.set_state(state);
                    self.stats.count_transition(reason);
                    if state == HolderState::Ready && reason.history_lost() {
                        self.writer.mark_history_lost();
                    }
                    let readiness = match (state, shared.cfg.stale_routing) {
                        (HolderState::Ready, _) | (HolderState::Stale, StaleRouting::Included) => {
                            Readiness::Ready
                        }
                        (HolderState::Syncing, _) => Readiness::Syncing,
                        (HolderState::Stale, StaleRouting::Excluded) => Readiness::Stale,
                    };
                    self.writer.set_readiness(readiness);
                    tracing::info!(
                        holder = %self.writer.holder(),
                        state = state.as_str(),
                        reason = reason.as_str(),
                        "ingest: holder state"
                    );
                }
            }
        }
        Fate::Alive
    }

    /// Applies one batch (decoding it if the socket thread did not): Ok(false) if it does not
    /// decode.
    fn apply(&mut self, seq: u64, payload: Payload) -> Result<bool, LedgerError> {
        let decoded = match payload.body {
            Body::Decoded(d) => d,
            Body::Raw(msg) => self.decoder.decode(&msg),
        };
        let holder = self.writer.holder();
        let batch = match decoded {
            Ok(b) => b,
            Err((kind, msg)) => {
                HolderStats::add(&self.stats.decode_errors[kind], 1);
                tracing::warn!(%holder, seq, kind = DECODE_ERROR_KINDS[kind], error = %msg, "ingest: undecodable batch");
                return Ok(false);
            }
        };
        if let Some(rank) = batch.dp_rank.filter(|&r| r != holder.rank) {
            // Relaxed: a counter; the first mismatch is logged once per holder.
            if self.stats.rank_mismatches.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    %holder,
                    batch_rank = rank.0,
                    "ingest: a batch names another DP rank than its socket's; applied to the socket's rank \
                     (check the worker's events.publish_port_base and dp_size)"
                );
            }
        }
        let outcome = self.writer.apply_batch(&batch)?;
        #[cfg(test)]
        tests::injected_panic(holder);
        HolderStats::add(&self.stats.batches, 1);
        HolderStats::add(&self.stats.events, outcome.events);
        HolderStats::add(&self.stats.blocks_stored, outcome.stored);
        HolderStats::add(&self.stats.blocks_removed, outcome.removed);
        // Relaxed: a gauge for status readers; progress is signalled separately.
        self.stats.last_seq.store(seq, Ordering::Relaxed);
        if let Ok(now) = SystemTime::now().duration_since(UNIX_EPOCH) {
            let lag = now.as_secs_f64() - batch.ts;
            if lag.is_finite() && lag >= 0.0 {
                self.stats.record_lag(Duration::from_secs_f64(lag));
            }
        }
        Ok(true)
    }
}

fn vllm_error_kind(e: &cortex_events_vllm::DecodeError) -> usize {
    use cortex_events_vllm::DecodeError as D;
    match e {
        D::Truncated { .. } => 0,
        D::UnexpectedType { .. } | D::OutOfRange { .. } | D::HashLength { .. } => 1,
        D::UnknownEventType { .. }
        | D::MissingField { .. }
        | D::BatchShape { .. }
        | D::TrailingBytes { .. } => 2,
        _ => 3,
    }
}

fn sglang_error_kind(e: &cortex_events_sglang::DecodeError) -> usize {
    use cortex_events_sglang::DecodeError as D;
    match e {
        D::Truncated { .. } => 0,
        D::UnexpectedType { .. } | D::OutOfRange { .. } => 1,
        D::UnknownEventType { .. }
        | D::MissingField { .. }
        | D::BatchShape { .. }
        | D::TrailingBytes { .. } => 2,
        _ => 3,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // test setup: a failed step should panic
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use cortex_hash::kv::{DpRank, EngineHash, HolderId, WorkerId};
    use cortex_radix::{Ledger, LedgerConfig, Readiness};

    use crate::test_support::{FakeEngine, vllm_block_batch};
    use crate::{HolderSource, HolderState, Ingest, IngestConfig, Reason, Unlabeled, Wire};

    /// Holders whose applies panic (after the ledger applied the batch), with how many more
    /// times: a fault no real input is known to cause, injected to exercise the containment.
    static PANICS: Mutex<Vec<(HolderId, u32)>> = Mutex::new(Vec::new());

    /// Holders whose groups take one path whatever their size: inline (`true`) or queued.
    static FORCED: Mutex<Vec<(HolderId, bool)>> = Mutex::new(Vec::new());
    /// Groups delivered per holder: (inline, queued).
    static PATHS: Mutex<Vec<(HolderId, u64, u64)>> = Mutex::new(Vec::new());
    /// A model whose decoder panics on every batch.
    pub(super) const PANICKING_MODEL: &str = "panicking-decoder";

    pub(super) fn forced_path(holder: HolderId) -> Option<bool> {
        FORCED.lock().unwrap().iter().find(|(h, _)| *h == holder).map(|(_, inline)| *inline)
    }

    pub(super) fn count_path(holder: HolderId, inline: bool) {
        let mut p = PATHS.lock().unwrap();
        let i = p.iter().position(|(h, ..)| *h == holder).unwrap_or_else(|| {
            p.push((holder, 0, 0));
            p.len() - 1
        });
        if inline {
            p[i].1 += 1;
        } else {
            p[i].2 += 1;
        }
    }

    fn paths(holder: HolderId) -> (u64, u64) {
        PATHS.lock().unwrap().iter().find(|(h, ..)| *h == holder).map_or((0, 0), |&(_, i, q)| (i, q))
    }

    /// Replies that answer a replay given up since (another was asked for, or the holder was
    /// rebuilt) reach the lane after the new request: they carry their request's id, and the
    /// lane drops them instead of taking them for the new replay's (whose end marker would
    /// otherwise end it early).
    #[test]
    fn replies_to_a_replay_given_up_are_dropped() {
        use crate::test_support::ReplayFraming;
        let ledger = Ledger::new(LedgerConfig::default());
        let ingest =
            Ingest::start(ledger.clone(), IngestConfig { lanes: 1, ..IngestConfig::default() }).unwrap();
        let h = holder(951);
        let mut engine = FakeEngine::new("stale-replies", Some(ReplayFraming::WithTopic));
        engine.record_only(0, &vllm_block_batch(0));
        follow(&ingest, &engine, h);
        // The start asks for a replay from 0; before it is answered, replies to a request the
        // holder no longer waits for arrive (id 0 is never a request's).
        wait(&ingest, h, "the replay request", |s| {
            s.replays_requested == 1 && s.state == HolderState::Syncing
        });
        let stale = vec![
            super::Input::Replayed {
                seq: 7,
                payload: super::Payload::new(zmq::Message::from(vllm_block_batch(7))),
            },
            super::Input::ReplayEnd,
        ];
        ingest.shared.send_lane(0, super::LaneMsg::Inputs(h, stale, Some(0))).unwrap();
        wait(&ingest, h, "the stale replies dropped", |s| s.stale_replies == 2);
        let st = ingest.status(h).unwrap();
        assert_eq!(st.state, HolderState::Syncing, "the replay goes on: {st:?}");
        assert!(!holds(&ledger, h, 7));
        // The real replay's replies are taken.
        assert_eq!(engine.serve_replay(), 0);
        wait(&ingest, h, "the replay", |s| s.state == HolderState::Ready && s.last_seq == 0);
        assert!(holds(&ledger, h, 0) && !holds(&ledger, h, 7));
        assert_eq!(ingest.status(h).unwrap().transitions(Reason::ReplayOk), 1);
        ingest.shutdown();
    }

    /// Live sockets the socket thread left unread for their lane's backlog.
    static DEFERRALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub(super) fn count_deferral() {
        DEFERRALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A lane that cannot keep up (held here by the test) stops the socket thread from reading
    /// its holders' live sockets past `LANE_BACKLOG` queued groups, instead of queuing every
    /// batch its engine publishes: what comes meanwhile waits in the SUB socket (bounded by
    /// `receive_hwm`), and the holder catches up in order once the lane is free.
    #[test]
    fn a_lane_that_falls_behind_is_queued_no_more_than_its_backlog() {
        let ledger = Ledger::new(LedgerConfig::default());
        let ingest =
            Ingest::start(ledger.clone(), IngestConfig { lanes: 1, ..IngestConfig::default() }).unwrap();
        let h = holder(941);
        FORCED.lock().unwrap().push((h, false));
        let mut engine = FakeEngine::new("slow-lane", None);
        follow(&ingest, &engine, h);
        wait(&ingest, h, "the start", |s| s.state == HolderState::Ready);
        engine.publish(0, &vllm_block_batch(0));
        wait(&ingest, h, "seq 0", |s| s.last_seq == 0);
        let lane = &ingest.shared.lanes[0];
        let deferrals = DEFERRALS.load(std::sync::atomic::Ordering::Relaxed);
        let held = lane.state.lock().unwrap();
        let mut most = 0;
        for seq in 1..=400 {
            engine.publish(seq, &vllm_block_batch(seq));
            if seq % 20 == 0 {
                // Time for the socket thread to read what it may.
                std::thread::sleep(Duration::from_millis(5));
            }
            most = most.max(lane.queued.load(std::sync::atomic::Ordering::Acquire));
        }
        std::thread::sleep(Duration::from_millis(50));
        most = most.max(lane.queued.load(std::sync::atomic::Ordering::Acquire));
        assert!(most <= super::LANE_BACKLOG + 1, "{most} groups queued");
        assert!(
            DEFERRALS.load(std::sync::atomic::Ordering::Relaxed) > deferrals,
            "the socket was never left unread"
        );
        drop(held);
        // Nothing was lost (the SUB held it): every batch applied, in order, with no repair.
        wait(&ingest, h, "seq 400", |s| s.last_seq == 400 && s.state == HolderState::Ready);
        assert!((0..=400).all(|b| holds(&ledger, h, b)));
        let st = ingest.status(h).unwrap();
        assert_eq!((st.clears, st.transitions(Reason::Gap)), (0, 0), "{st:?}");
        ingest.shutdown();
    }

    pub(super) fn injected_panic(holder: HolderId) {
        let mut p = PANICS.lock().unwrap();
        if let Some(e) = p.iter_mut().find(|(h, n)| *h == holder && *n > 0) {
            e.1 -= 1;
            drop(p);
            panic!("injected panic for {holder}");
        }
    }

    const WAIT: Duration = Duration::from_secs(10);

    fn follow(ingest: &Ingest, engine: &FakeEngine, holder: HolderId) {
        follow_model(ingest, engine, holder, "test-model");
    }

    fn follow_model(ingest: &Ingest, engine: &FakeEngine, holder: HolderId, model: &str) {
        ingest
            .add_holder(HolderSource {
                holder,
                wire: Wire::Vllm,
                model: model.into(),
                unlabeled: Unlabeled::Plain,
                publish: engine.pub_endpoint.clone(),
                replay: engine.replay_endpoint.clone(),
                topic: String::from_utf8(engine.topic.clone()).unwrap(),
                capacity_blocks: 10_000,
                content_deterministic: true,
            })
            .unwrap();
        engine.wait_subscribed();
    }

    fn wait(ingest: &Ingest, h: HolderId, what: &str, done: impl FnMut(&crate::HolderStatus) -> bool) {
        assert!(ingest.wait_for(h, WAIT, done), "{h}: {what} never happened: {:?}", ingest.status(h));
    }

    fn holder(w: u32) -> HolderId {
        HolderId::new(WorkerId(w), DpRank(0))
    }

    fn holds(ledger: &Ledger, h: HolderId, batch: u64) -> bool {
        ledger.block(h, EngineHash::from_u64(1000 + batch)).is_some()
    }

    #[test]
    fn a_panic_while_applying_inline_is_contained_to_its_holder_and_rebuilt() {
        contained_and_rebuilt(true, 901);
    }

    #[test]
    fn a_panic_while_applying_on_the_lane_is_contained_to_its_holder_and_rebuilt() {
        contained_and_rebuilt(false, 911);
    }

    /// Waits until lane 0 has nothing queued and is not draining: the inline path needs it so.
    fn wait_lane_idle(ingest: &Ingest) {
        let lane = &ingest.shared.lanes[0];
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while lane.queued.load(std::sync::atomic::Ordering::Acquire) != 0 || lane.state.try_lock().is_err() {
            assert!(std::time::Instant::now() < deadline, "the lane never went idle");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The holders' groups all applied inline by the socket thread, or all queued to the lane.
    fn contained_and_rebuilt(inline: bool, first: u32) {
        let ledger = Ledger::new(LedgerConfig::default());
        // One lane: both holders share it.
        let ingest =
            Ingest::start(ledger.clone(), IngestConfig { lanes: 1, ..IngestConfig::default() }).unwrap();
        let (a, b) = (holder(first), holder(first + 1));
        FORCED.lock().unwrap().extend([(a, inline), (b, inline)]);
        let (mut ea, mut eb) = (FakeEngine::new("a", None), FakeEngine::new("b", None));
        follow(&ingest, &ea, a);
        follow(&ingest, &eb, b);
        // Started on the lane (a group that found the lane's `Add` queued would be queued too).
        for h in [a, b] {
            wait(&ingest, h, "the start", |s| s.state == HolderState::Ready);
        }
        for i in 0..3 {
            if inline {
                // On a loaded machine the lane may still be busy with the start: it must be idle
                // for a group to take the inline path at all.
                wait_lane_idle(&ingest);
            }
            ea.publish(i, &vllm_block_batch(i));
            eb.publish(i, &vllm_block_batch(i));
        }
        for h in [a, b] {
            wait(&ingest, h, "seq 2", |s| s.last_seq == 2 && s.state == HolderState::Ready);
        }
        assert!(holds(&ledger, a, 2));

        PANICS.lock().unwrap().push((a, 1));
        ea.publish(3, &vllm_block_batch(3));
        eb.publish(3, &vllm_block_batch(3));
        wait(&ingest, a, "the rebuild", |s| {
            s.transitions(Reason::InternalError) == 1 && s.state == HolderState::Ready
        });
        assert_eq!(ledger.stats().quarantined_holders, 1);
        // The rebuilt holder starts empty (what it held is quarantined) and follows its engine.
        assert!(!holds(&ledger, a, 2) && !holds(&ledger, a, 3));
        ea.publish(4, &vllm_block_batch(4));
        wait(&ingest, a, "seq 4 after the rebuild", |s| s.last_seq == 4);
        assert!(holds(&ledger, a, 4));
        assert_eq!(ledger.readiness(a), Some(Readiness::Ready));
        let st = ingest.status(a).unwrap();
        assert_eq!(st.transitions(Reason::ColdStart), 2, "registered, then rebuilt: {st:?}");

        // The other holder on the same lane never noticed.
        wait(&ingest, b, "seq 3", |s| s.last_seq == 3 && s.state == HolderState::Ready);
        assert!((0..4).all(|i| holds(&ledger, b, i)));
        assert_eq!(ingest.status(b).unwrap().transitions(Reason::InternalError), 0);
        // The groups took the path asked for (queued always; inline whenever the lane was idle).
        for h in [a, b] {
            let (inlined, queued) = paths(h);
            assert!(if inline { inlined > 0 } else { inlined == 0 && queued > 0 }, "{inlined} {queued}");
        }
        ingest.shutdown();
    }

    #[test]
    fn a_decoder_s_panic_is_an_undecodable_batch_on_both_paths() {
        let ledger = Ledger::new(LedgerConfig::default());
        let ingest =
            Ingest::start(ledger.clone(), IngestConfig { lanes: 1, ..IngestConfig::default() }).unwrap();
        let (d, e) = (holder(921), holder(922));
        // d's groups are queued (the socket thread decodes them), e's applied inline.
        FORCED.lock().unwrap().extend([(d, false), (e, true)]);
        let (mut ed, mut ee) = (FakeEngine::new("d", None), FakeEngine::new("e", None));
        follow_model(&ingest, &ed, d, PANICKING_MODEL);
        follow_model(&ingest, &ee, e, PANICKING_MODEL);
        // One holder after the other: a lane busy with d's groups would make e's queue too.
        for (h, engine) in [(d, &mut ed), (e, &mut ee)] {
            for i in 0..3 {
                if h == e {
                    // The inline path needs an idle lane: on a loaded machine the lane thread may
                    // still be finishing d's repairs when e's batches come.
                    wait_lane_idle(&ingest);
                }
                engine.publish(i, &vllm_block_batch(i));
            }
            wait(&ingest, h, "three undecodable batches", |s| {
                s.decode_errors[3] == 3
                    && s.transitions(Reason::Undecodable) == 3
                    && s.state == HolderState::Ready
            });
            let st = ingest.status(h).unwrap();
            assert_eq!((st.clears, st.transitions(Reason::InternalError)), (3, 0), "{st:?}");
            assert_eq!(ledger.readiness(h), Some(Readiness::Ready));
        }
        assert_eq!(ledger.stats().quarantined_holders, 0, "nothing was left half-changed");
        assert!(paths(d).1 > 0 && paths(e).0 > 0);
        ingest.shutdown();
    }

    #[test]
    fn a_holder_that_keeps_panicking_is_given_up_and_the_others_go_on() {
        let ledger = Ledger::new(LedgerConfig::default());
        let ingest =
            Ingest::start(ledger.clone(), IngestConfig { lanes: 1, ..IngestConfig::default() }).unwrap();
        let (c, d) = (holder(903), holder(904));
        let (mut ec, mut ed) = (FakeEngine::new("c", None), FakeEngine::new("d", None));
        follow(&ingest, &ec, c);
        follow(&ingest, &ed, d);
        PANICS.lock().unwrap().push((c, u32::MAX));
        // A burst (more than the socket thread applies inline): the lane's thread panics.
        for i in 0..20 {
            ec.publish(i, &vllm_block_batch(i));
        }
        let rebuilds = u64::from(super::MAX_REBUILDS);
        wait(&ingest, c, "giving up", |s| {
            s.transitions(Reason::InternalError) == rebuilds + 1 && s.state == HolderState::Stale
        });
        // Given up: registered again, empty and STALE, and unsubscribed.
        ec.wait_unsubscribed();
        assert_eq!(ledger.readiness(c), Some(Readiness::Stale));
        assert_eq!(ledger.held_blocks(c), Some(0));
        assert_eq!(ledger.stats().quarantined_holders, rebuilds + 1);
        for i in 0..3 {
            ed.publish(i, &vllm_block_batch(i));
        }
        wait(&ingest, d, "seq 2", |s| s.last_seq == 2 && s.state == HolderState::Ready);
        assert!((0..3).all(|i| holds(&ledger, d, i)));
        // Nothing it publishes later is applied.
        ec.publish(20, &vllm_block_batch(20));
        ed.publish(3, &vllm_block_batch(3));
        wait(&ingest, d, "seq 3", |s| s.last_seq == 3);
        assert_eq!(ingest.status(c).unwrap().state, HolderState::Stale);
        assert_eq!(ingest.status(c).unwrap().transitions(Reason::InternalError), rebuilds + 1);
        assert_eq!(ledger.held_blocks(c), Some(0));
        // Removing its worker removes it.
        ingest.remove_worker(c.worker).unwrap();
        assert_eq!(ledger.readiness(c), None);
        ingest.shutdown();
    }
}
