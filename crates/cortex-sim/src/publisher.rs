//! The ZeroMQ side of a worker: per DP rank an XPUB on `port_base + rank` and, optionally, a replay
//! ROUTER on `replay_base + rank`, all serviced by one thread per worker.
//!
//! Key decisions:
//! - XPUB, not PUB: it is the same wire protocol for SUB clients, and it reports subscriptions,
//!   so [`Publisher::wait_subscribed`] can tell a test exactly when a subscriber will receive
//!   the next message (no sleeping to beat the slow-joiner problem). With `XPUB_VERBOSE` every
//!   subscription is reported and the last unsubscription of a prefix too, which is enough to
//!   know whether *some* matching subscriber is connected.
//! - Frames and sequence numbers are the engines': `[topic, seq u64 BE, payload]`, seq from 0 per
//!   publisher, +1 per non-empty batch; the ring keeps the last `buffer_steps` batches; replay
//!   answers `[id, "", topic, seq, payload]…` then `[id, "", "", FF×8, ""]` (vLLM ≥ 0.26 and
//!   SGLang ≥ 0.5.20) or the same without the topic frame (vLLM ≤ 0.25, SGLang 0.5.19); a request
//!   that is not exactly `[id, "", start_seq]` gets no reply.
//! - The engine hands over encoded payloads through a channel and rings an inproc doorbell, so
//!   the thread sleeps in `zmq::poll` until there is work.
//! - Faults live here: dropping the next N batches (their sequence numbers are consumed, so
//!   subscribers see a gap, while the ring still has them for replay), restarting (sequence back
//!   to 0, ring emptied, nothing announced — what a vLLM restart looks like), and disabling replay
//!   (requests are read and never answered).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::SimError;
use crate::config::EventsConfig;

/// End-of-replay sequence: -1 as a signed 8-byte big-endian integer.
const END_SEQ: [u8; 8] = [0xff; 8];
const NO_SEQ: u64 = u64::MAX;

/// How replay replies are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplayFraming {
    /// `[id, "", topic, seq, payload]`, end `[id, "", "", FF×8, ""]` (vLLM ≥ 0.26, SGLang).
    WithTopic,
    /// `[id, "", seq, payload]`, end `[id, "", FF×8, ""]` (vLLM ≤ 0.25, SGLang 0.5.19).
    WithoutTopic,
}

/// The ports one rank publishes and replays on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankEndpoints {
    /// The DP rank.
    pub rank: u16,
    /// The PUB (XPUB) address.
    pub publish: SocketAddr,
    /// The replay ROUTER address, if replay is on.
    pub replay: Option<SocketAddr>,
}

/// Per-rank state shared with the worker's handles.
#[derive(Debug)]
pub(crate) struct RankPub {
    subscribed: Mutex<bool>,
    changed: Condvar,
    watch: tokio::sync::watch::Sender<bool>,
    last_seq: AtomicU64,
    replay_on: AtomicBool,
    replay_ignored: AtomicU64,
}

impl RankPub {
    fn new() -> Self {
        RankPub {
            subscribed: Mutex::new(false),
            changed: Condvar::new(),
            watch: tokio::sync::watch::Sender::new(false),
            last_seq: AtomicU64::new(NO_SEQ),
            replay_on: AtomicBool::new(true),
            replay_ignored: AtomicU64::new(0),
        }
    }

    fn set_subscribed(&self, v: bool) {
        let mut s = self.subscribed.lock();
        if *s != v {
            *s = v;
            self.changed.notify_all();
            self.watch.send_replace(v);
        }
    }
}

enum Cmd {
    Publish {
        rank: u16,
        payload: Vec<u8>,
    },
    DropNext {
        rank: u16,
        n: u64,
    },
    Restart {
        rank: u16,
    },
    /// Acknowledged once every command sent before it was applied.
    Flush(mpsc::SyncSender<()>),
    Shutdown,
}

/// The worker's event publisher: sockets, ring buffers and the thread that services them.
pub(crate) struct Publisher {
    cmd: mpsc::Sender<Cmd>,
    bell: Mutex<zmq::Socket>,
    ranks: Arc<Vec<RankPub>>,
    endpoints: Vec<RankEndpoints>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("endpoints", &self.endpoints).finish_non_exhaustive()
    }
}

struct RankSockets {
    xpub: zmq::Socket,
    router: Option<zmq::Socket>,
}

fn tcp(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// Binds every rank's sockets on one contiguous range (and the replay range), retrying other
/// bases when a port is taken.
fn bind_ranges(
    ctx: &zmq::Context,
    host: IpAddr,
    dp: u16,
    cfg: &EventsConfig,
) -> Result<(Vec<RankSockets>, Vec<RankEndpoints>), SimError> {
    let attempts = if cfg.port_base.is_some() { 1 } else { 64 };
    let ports = usize::from(dp) * if cfg.replay { 2 } else { 1 };
    for _ in 0..attempts {
        let base = cfg.port_base.unwrap_or_else(|| fastrand::u16(20_000..30_000));
        let replay_base = cfg.replay_port_base.unwrap_or(base.saturating_add(dp));
        match try_bind(ctx, host, dp, cfg, base, replay_base) {
            Ok(v) => return Ok(v),
            Err(zmq::Error::EADDRINUSE | zmq::Error::EACCES) => continue,
            Err(e) => return Err(SimError::Zmq(e)),
        }
    }
    Err(SimError::EventPorts { ports, attempts })
}

fn try_bind(
    ctx: &zmq::Context,
    host: IpAddr,
    dp: u16,
    cfg: &EventsConfig,
    base: u16,
    replay_base: u16,
) -> Result<(Vec<RankSockets>, Vec<RankEndpoints>), zmq::Error> {
    let mut socks = Vec::with_capacity(usize::from(dp));
    let mut eps = Vec::with_capacity(usize::from(dp));
    for r in 0..dp {
        let port = base.checked_add(r).ok_or(zmq::Error::EADDRINUSE)?;
        let xpub = ctx.socket(zmq::XPUB)?;
        xpub.set_linger(0)?;
        xpub.set_sndhwm(cfg.hwm)?;
        xpub.set_rcvhwm(cfg.hwm)?;
        xpub.set_xpub_verbose(true)?;
        let publish = SocketAddr::new(host, port);
        xpub.bind(&tcp(publish))?;
        let (router, replay) = if cfg.replay {
            let rport = replay_base.checked_add(r).ok_or(zmq::Error::EADDRINUSE)?;
            let router = ctx.socket(zmq::ROUTER)?;
            router.set_linger(0)?;
            // vLLM 0.33 sizes the replay HWM to the whole ring (plus the end marker).
            router.set_sndhwm(i32::try_from(2 * (cfg.buffer_steps + 1)).unwrap_or(i32::MAX))?;
            let addr = SocketAddr::new(host, rport);
            router.bind(&tcp(addr))?;
            (Some(router), Some(addr))
        } else {
            (None, None)
        };
        socks.push(RankSockets { xpub, router });
        eps.push(RankEndpoints { rank: r, publish, replay });
    }
    Ok((socks, eps))
}

impl Publisher {
    /// Binds the sockets of `dp` ranks and starts the thread.
    pub(crate) fn start(
        ctx: &zmq::Context,
        host: IpAddr,
        dp: u16,
        cfg: &EventsConfig,
        framing: ReplayFraming,
    ) -> Result<Publisher, SimError> {
        let (socks, endpoints) = bind_ranges(ctx, host, dp, cfg)?;
        let bell_addr = format!("inproc://cortex-sim-bell-{}", fastrand::u64(..));
        let bell_rx = ctx.socket(zmq::PAIR)?;
        bell_rx.set_linger(0)?;
        bell_rx.bind(&bell_addr)?;
        let bell = ctx.socket(zmq::PAIR)?;
        bell.set_linger(0)?;
        bell.connect(&bell_addr)?;
        let ranks: Arc<Vec<RankPub>> = Arc::new((0..dp).map(|_| RankPub::new()).collect());
        let (tx, rx) = mpsc::channel();
        let state = Arc::clone(&ranks);
        let topic = cfg.topic.as_bytes().to_vec();
        let buffer = cfg.buffer_steps;
        let thread = std::thread::Builder::new()
            .name("cortex-sim-zmq".to_owned())
            .spawn(move || {
                let mut t = Thread {
                    socks,
                    bell: bell_rx,
                    rx,
                    state,
                    topic,
                    framing,
                    buffer,
                    rings: (0..dp).map(|_| Ring::default()).collect(),
                    subs: (0..dp).map(|_| HashMap::new()).collect(),
                };
                t.run();
            })
            .map_err(SimError::Runtime)?;
        Ok(Publisher { cmd: tx, bell: Mutex::new(bell), ranks, endpoints, thread: Mutex::new(Some(thread)) })
    }

    fn send(&self, cmd: Cmd) {
        if self.cmd.send(cmd).is_ok() {
            // A full doorbell means the thread is already awake; nothing is lost.
            let _ = self.bell.lock().send(&[][..], zmq::DONTWAIT);
        }
    }

    /// Publishes one encoded batch on `rank`.
    pub(crate) fn publish(&self, rank: u16, payload: Vec<u8>) {
        self.send(Cmd::Publish { rank, payload });
    }

    /// The next `n` batches of `rank` are not sent (their sequence numbers are used up).
    pub(crate) fn drop_next(&self, rank: u16, n: u64) {
        self.send(Cmd::DropNext { rank, n });
    }

    /// Sequence back to 0 and an empty ring, with nothing announced.
    pub(crate) fn restart(&self, rank: u16) {
        self.send(Cmd::Restart { rank });
    }

    /// Turns replay answering on or off.
    pub(crate) fn set_replay(&self, rank: u16, on: bool) {
        if let Some(r) = self.ranks.get(usize::from(rank)) {
            r.replay_on.store(on, Ordering::SeqCst);
        }
    }

    pub(crate) fn endpoints(&self) -> &[RankEndpoints] {
        &self.endpoints
    }

    pub(crate) fn subscribed(&self, rank: u16) -> bool {
        self.ranks.get(usize::from(rank)).is_some_and(|r| *r.subscribed.lock())
    }

    pub(crate) fn last_seq(&self, rank: u16) -> Option<u64> {
        let v = self.ranks.get(usize::from(rank))?.last_seq.load(Ordering::SeqCst);
        (v != NO_SEQ).then_some(v)
    }

    /// Replay requests left unanswered (malformed, or replay off).
    pub(crate) fn replay_ignored(&self, rank: u16) -> u64 {
        self.ranks.get(usize::from(rank)).map_or(0, |r| r.replay_ignored.load(Ordering::SeqCst))
    }

    /// Blocks until a matching subscriber is connected to `rank`'s PUB.
    pub(crate) fn wait_subscribed(&self, rank: u16, timeout: Duration) -> Result<(), SimError> {
        let r = self.ranks.get(usize::from(rank)).ok_or(SimError::NoSuchRank {
            rank,
            dp_size: u16::try_from(self.ranks.len()).unwrap_or(u16::MAX),
        })?;
        let deadline = Instant::now() + timeout;
        let mut s = r.subscribed.lock();
        while !*s {
            if r.changed.wait_until(&mut s, deadline).timed_out() && !*s {
                return Err(SimError::Timeout(timeout));
            }
        }
        Ok(())
    }

    /// A receiver that turns true when a matching subscriber is connected to `rank`.
    pub(crate) fn subscription_watch(&self, rank: u16) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.ranks.get(usize::from(rank)).map(|r| r.watch.subscribe())
    }

    /// Blocks until every batch handed over before this call has been sent (or `timeout`).
    pub(crate) fn flush(&self, timeout: Duration) -> Result<(), SimError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Cmd::Flush(tx));
        rx.recv_timeout(timeout).map_err(|_| SimError::Timeout(timeout))
    }

    /// Stops the thread and closes the sockets.
    pub(crate) fn shutdown(&self) {
        self.send(Cmd::Shutdown);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[derive(Default)]
struct Ring {
    next_seq: u64,
    drop_next: u64,
    batches: VecDeque<(u64, Vec<u8>)>,
}

struct Thread {
    socks: Vec<RankSockets>,
    bell: zmq::Socket,
    rx: mpsc::Receiver<Cmd>,
    state: Arc<Vec<RankPub>>,
    topic: Vec<u8>,
    framing: ReplayFraming,
    buffer: usize,
    rings: Vec<Ring>,
    subs: Vec<HashMap<Vec<u8>, u32>>,
}

impl Thread {
    fn run(&mut self) {
        loop {
            let mut ready = vec![false; 1 + 2 * self.socks.len()];
            {
                let mut items = Vec::with_capacity(ready.len());
                items.push(self.bell.as_poll_item(zmq::POLLIN));
                for s in &self.socks {
                    items.push(s.xpub.as_poll_item(zmq::POLLIN));
                    match &s.router {
                        Some(r) => items.push(r.as_poll_item(zmq::POLLIN)),
                        // Keep indices aligned: poll the XPUB twice, ignore the second.
                        None => items.push(s.xpub.as_poll_item(zmq::PollEvents::empty())),
                    }
                }
                if zmq::poll(&mut items, -1).is_err() {
                    return;
                }
                for (i, it) in items.iter().enumerate() {
                    ready[i] = it.is_readable();
                }
            }
            if ready[0] {
                while self.bell.recv_bytes(zmq::DONTWAIT).is_ok() {}
            }
            for r in 0..self.socks.len() {
                if ready[1 + 2 * r] {
                    self.read_subscriptions(r);
                }
                if ready[2 + 2 * r] {
                    self.serve_replay(r);
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return,
                    Ok(cmd) => self.apply(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
        }
    }

    fn apply(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Publish { rank, payload } => {
                let r = usize::from(rank);
                let Some(ring) = self.rings.get_mut(r) else { return };
                let seq = ring.next_seq;
                ring.next_seq += 1;
                let live = if ring.drop_next > 0 {
                    ring.drop_next -= 1;
                    false
                } else {
                    true
                };
                if live {
                    let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
                    // PUB semantics: a send never blocks; beyond the HWM messages are dropped.
                    let _ = self.socks[r].xpub.send_multipart(frames, zmq::DONTWAIT);
                }
                ring.batches.push_back((seq, payload));
                while ring.batches.len() > self.buffer {
                    ring.batches.pop_front();
                }
                self.state[r].last_seq.store(seq, Ordering::SeqCst);
            }
            Cmd::Flush(done) => {
                let _ = done.send(());
            }
            Cmd::DropNext { rank, n } => {
                if let Some(ring) = self.rings.get_mut(usize::from(rank)) {
                    ring.drop_next += n;
                }
            }
            Cmd::Restart { rank } => {
                if let Some(ring) = self.rings.get_mut(usize::from(rank)) {
                    *ring = Ring::default();
                    self.state[usize::from(rank)].last_seq.store(NO_SEQ, Ordering::SeqCst);
                }
            }
            Cmd::Shutdown => {}
        }
    }

    fn read_subscriptions(&mut self, r: usize) {
        while let Ok(msg) = self.socks[r].xpub.recv_bytes(zmq::DONTWAIT) {
            let Some((&kind, prefix)) = msg.split_first() else { continue };
            match kind {
                1 => *self.subs[r].entry(prefix.to_vec()).or_insert(0) += 1,
                // Without XPUB_VERBOSER only the last unsubscription of a prefix arrives.
                0 => {
                    self.subs[r].remove(prefix);
                }
                _ => {}
            }
        }
        let topic = &self.topic;
        let on = self.subs[r].iter().any(|(p, &n)| n > 0 && topic.starts_with(p));
        self.state[r].set_subscribed(on);
    }

    fn serve_replay(&mut self, r: usize) {
        let Some(router) = &self.socks[r].router else { return };
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            if !self.state[r].replay_on.load(Ordering::SeqCst) || frames.len() != 3 {
                self.state[r].replay_ignored.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            let id = &frames[0];
            let start = frames[2]
                .iter()
                .try_fold(0u64, |acc, &b| acc.checked_mul(256).map(|v| v | u64::from(b)))
                .unwrap_or(u64::MAX);
            for (seq, payload) in self.rings[r].batches.iter().filter(|(s, _)| *s >= start) {
                let seq = seq.to_be_bytes();
                let _ = match self.framing {
                    ReplayFraming::WithTopic => {
                        router.send_multipart([&id[..], b"", &self.topic, &seq, payload], 0)
                    }
                    ReplayFraming::WithoutTopic => router.send_multipart([&id[..], b"", &seq, payload], 0),
                };
            }
            let _ = match self.framing {
                ReplayFraming::WithTopic => router.send_multipart([&id[..], b"", b"", &END_SEQ, b""], 0),
                ReplayFraming::WithoutTopic => router.send_multipart([&id[..], b"", &END_SEQ, b""], 0),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_explicit_base_is_an_error_and_ranks_are_contiguous() {
        let ctx = zmq::Context::new();
        let host = IpAddr::from([127, 0, 0, 1]);
        let auto = EventsConfig::default();
        let (socks, eps) = bind_ranges(&ctx, host, 3, &auto).expect("a free range");
        let base = eps[0].publish.port();
        for (r, e) in eps.iter().enumerate() {
            assert_eq!(usize::from(e.publish.port()), usize::from(base) + r);
            assert_eq!(e.replay.map(|a| usize::from(a.port())), Some(usize::from(base) + 3 + r));
        }
        // The same explicit base again: taken, and no other base is tried.
        let fixed = EventsConfig { port_base: Some(base), ..EventsConfig::default() };
        assert!(matches!(
            bind_ranges(&ctx, host, 1, &fixed),
            Err(SimError::EventPorts { ports: 2, attempts: 1 })
        ));
        drop(socks);
    }
}
