//! Prefill/decode rendezvous between simulated workers, over real HTTP so that prefill and decode
//! workers may live in different processes.
//!
//! - **SGLang** (`bootstrap_host/port/room`): the prefill worker registers the room when its leg
//!   arrives and marks it ready when the prefill is done; the decode leg asks the prefill side's
//!   bootstrap listener (`GET /sim/pd/sglang/room/{room}`, long-polling) and, on success, the
//!   prefill request finishes — "prefill finishes when the transfer is done". Either leg may come
//!   first; each gives up after `bootstrap_timeout` and fails cleanly.
//! - **vLLM** (`kv_transfer_params`, NIXL pull): a `do_remote_decode` request keeps its blocks
//!   after finishing, leased for `kv_lease`, and returns `remote_request_id`, `remote_host`,
//!   `remote_port` (this listener), `remote_block_ids`, …; the decode worker's
//!   `do_remote_prefill` leg reads the lease (`POST /sim/pd/vllm/lease/{id}`), which frees the
//!   blocks on the prefill side. An expired or unknown lease fails the decode leg.
//!
//! Key decision: the registry never calls into a rank while holding its own lock (ranks call it
//! while holding theirs), so lock order is always rank → registry.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::engine::Rank;

/// What the decode side learns from the prefill side of a room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RoomInfo {
    pub(crate) rank: u16,
    pub(crate) prompt_tokens: usize,
    pub(crate) first_token: u32,
    /// The prefill side's prefix hit, which the decode side reports.
    pub(crate) cached_tokens: usize,
    pub(crate) request: u64,
}

enum Room {
    /// Decode legs waiting for a prefill that is not ready yet.
    Waiting(Vec<oneshot::Sender<RoomInfo>>),
    /// A prefill done and waiting for its decode leg.
    Ready(RoomInfo),
}

/// The prefill side's rooms and leases.
#[derive(Default)]
pub(crate) struct PdRegistry {
    rooms: Mutex<HashMap<u64, Room>>,
    leases: Mutex<HashMap<String, u16>>,
    /// Weak: ranks hold the registry, and a cycle would keep every worker's state alive.
    ranks: OnceLock<Vec<Weak<Rank>>>,
}

impl std::fmt::Debug for PdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdRegistry").finish_non_exhaustive()
    }
}

impl PdRegistry {
    pub(crate) fn set_ranks(&self, ranks: &[Arc<Rank>]) {
        let _ = self.ranks.set(ranks.iter().map(Arc::downgrade).collect());
    }

    fn rank(&self, r: u16) -> Option<Arc<Rank>> {
        self.ranks.get()?.get(usize::from(r))?.upgrade()
    }

    /// Called by a rank (holding its lock) when a room's prefill is done. True if a decode leg
    /// was waiting and has been handed the KV (the caller then finishes the prefill).
    pub(crate) fn room_ready(&self, room: u64, info: RoomInfo) -> bool {
        let mut rooms = self.rooms.lock();
        if let Some(Room::Waiting(waiters)) = rooms.remove(&room) {
            for w in waiters {
                if w.send(info).is_ok() {
                    return true;
                }
            }
        }
        rooms.insert(room, Room::Ready(info));
        false
    }

    /// The decode leg: waits up to `timeout` for the room's prefill, then takes its KV.
    pub(crate) async fn take_room(&self, room: u64, timeout: Duration) -> Option<RoomInfo> {
        let rx = {
            let mut rooms = self.rooms.lock();
            match rooms.remove(&room) {
                Some(Room::Ready(info)) => {
                    drop(rooms);
                    if let Some(r) = self.rank(info.rank) {
                        r.complete_transfer(info.request);
                    }
                    return Some(info);
                }
                Some(Room::Waiting(mut w)) => {
                    let (tx, rx) = oneshot::channel();
                    w.push(tx);
                    rooms.insert(room, Room::Waiting(w));
                    rx
                }
                None => {
                    let (tx, rx) = oneshot::channel();
                    rooms.insert(room, Room::Waiting(vec![tx]));
                    rx
                }
            }
        };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(info)) => Some(info),
            _ => {
                let mut rooms = self.rooms.lock();
                if let Some(Room::Waiting(w)) = rooms.get_mut(&room) {
                    w.retain(|s| !s.is_closed());
                    if w.is_empty() {
                        rooms.remove(&room);
                    }
                }
                None
            }
        }
    }

    /// The prefill leg's bootstrap timeout: fail it if its decode leg never came.
    pub(crate) fn room_timed_out(&self, room: u64) {
        let info = {
            let mut rooms = self.rooms.lock();
            match rooms.remove(&room) {
                Some(Room::Ready(info)) => info,
                Some(other) => {
                    rooms.insert(room, other);
                    return;
                }
                None => return,
            }
        };
        if let Some(r) = self.rank(info.rank) {
            r.fail_transfer(info.request);
        }
    }

    /// Called by a rank (holding its lock) when a vLLM prefill leaves its blocks leased.
    pub(crate) fn register_lease(&self, rid: &str, rank: u16) {
        self.leases.lock().insert(rid.to_owned(), rank);
    }

    /// The decode side reads a lease: the prefill side frees its blocks. `None` if unknown or
    /// expired.
    pub(crate) fn take_lease(&self, rid: &str) -> Option<usize> {
        let rank = self.leases.lock().remove(rid)?;
        self.rank(rank)?.take_lease(rid)
    }

    /// The lease ran out: free the blocks.
    pub(crate) fn expire_lease(&self, rid: &str) {
        let _ = self.take_lease(rid);
    }
}

/// Why a rendezvous call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("cannot reach the prefill side")]
    Connect(#[source] std::io::Error),
    #[error("http")]
    Http(#[source] hyper::Error),
    #[error("bad request")]
    Request(#[source] http::Error),
    #[error("prefill side answered {0}")]
    Status(u16),
    #[error("timed out")]
    Timeout,
}

/// A one-shot HTTP/1.1 call to another worker's rendezvous listener; returns the body of a 200.
pub(crate) async fn call(
    addr: SocketAddr,
    method: http::Method,
    path: &str,
    timeout: Duration,
) -> Result<Bytes, FetchError> {
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr).await.map_err(FetchError::Connect)?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(FetchError::Http)?;
        let driver = tokio::spawn(conn);
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(FetchError::Request)?;
        let resp = sender.send_request(req).await.map_err(FetchError::Http)?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map_err(FetchError::Http)?.to_bytes();
        driver.abort();
        if status == 200 { Ok(body) } else { Err(FetchError::Status(status)) }
    };
    tokio::time::timeout(timeout, fut).await.unwrap_or(Err(FetchError::Timeout))
}
