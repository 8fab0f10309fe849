//! A fake engine for tests and benchmarks: an XPUB (so the caller sees the subscription arrive
//! before publishing) and an optional ROUTER answering replay requests in either engine framing.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)] // shared by tests and benches, each uses a part

use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

/// How the fake engine frames replay replies.
#[derive(Clone, Copy, PartialEq)]
pub enum ReplayFraming {
    /// vLLM ≥ 0.26 and SGLang: ["", topic, seq, payload].
    WithTopic,
    /// vLLM ≤ 0.25: ["", seq, payload].
    NoTopic,
}

/// A fake engine: an XPUB for live batches and, optionally, a ROUTER for replay.
pub struct FakeEngine {
    _ctx: zmq::Context,
    pub publish: zmq::Socket,
    pub router: Option<zmq::Socket>,
    pub framing: ReplayFraming,
    pub topic: Vec<u8>,
    pub history: Vec<(u64, Vec<u8>)>,
    pub pub_endpoint: String,
    pub replay_endpoint: Option<String>,
}

impl FakeEngine {
    pub fn new(topic: &str, replay: Option<ReplayFraming>) -> Self {
        Self::bound(topic, replay, "tcp://127.0.0.1:*")
    }

    /// An engine whose PUB binds `pub_endpoint`: the address an earlier engine published on
    /// (drop that one first), so a subscriber's automatic reconnect finds this one — the
    /// engine coming back. Its replay socket, if any, gets a new port.
    pub fn bound_to(pub_endpoint: &str, topic: &str, replay: Option<ReplayFraming>) -> Self {
        Self::bound(topic, replay, pub_endpoint)
    }

    fn bound(topic: &str, replay: Option<ReplayFraming>, pub_endpoint: &str) -> Self {
        let ctx = zmq::Context::new();
        let publish = ctx.socket(zmq::XPUB).unwrap();
        publish.set_sndhwm(0).unwrap();
        publish.set_linger(0).unwrap();
        publish.bind(pub_endpoint).unwrap();
        let pub_endpoint = publish.get_last_endpoint().unwrap().unwrap();
        let (router, replay_endpoint) = match replay {
            Some(_) => {
                let r = ctx.socket(zmq::ROUTER).unwrap();
                // As vLLM >= 0.33 does (SNDHWM 2 * (buffer_steps + 1)): a long replay is not cut.
                r.set_sndhwm(0).unwrap();
                r.set_linger(0).unwrap();
                r.bind("tcp://127.0.0.1:*").unwrap();
                let e = r.get_last_endpoint().unwrap().unwrap();
                (Some(r), Some(e))
            }
            None => (None, None),
        };
        FakeEngine {
            _ctx: ctx,
            publish,
            router,
            framing: replay.unwrap_or(ReplayFraming::WithTopic),
            topic: topic.as_bytes().to_vec(),
            history: Vec::new(),
            pub_endpoint,
            replay_endpoint,
        }
    }

    /// Blocks until a subscriber's subscription message reaches the XPUB.
    pub fn wait_subscribed(&self) {
        self.publish.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        let msg = self.publish.recv_bytes(0).expect("no subscription arrived");
        assert_eq!(msg[0], 1, "expected a subscribe message");
    }

    /// Blocks until the subscriber's unsubscription (its socket closed) reaches the XPUB,
    /// skipping any other message.
    pub fn wait_unsubscribed(&self) {
        self.publish.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        loop {
            let msg = self.publish.recv_bytes(0).expect("no unsubscription arrived");
            if msg.first() == Some(&0) {
                return;
            }
        }
    }

    /// Publishes a batch with sequence number `seq` (recorded for replay).
    pub fn publish(&mut self, seq: u64, payload: &[u8]) {
        self.history.push((seq, payload.to_vec()));
        self.send_live(seq, payload);
    }

    /// Sends without recording (a batch the engine "lost" on the wire is recorded but not sent:
    /// see [`FakeEngine::record_only`]).
    pub fn send_live(&self, seq: u64, payload: &[u8]) {
        self.publish.send_multipart([&self.topic[..], &seq.to_be_bytes()[..], payload], 0).unwrap();
    }

    /// Records a batch in the replay buffer without publishing it: a batch lost on the wire.
    pub fn record_only(&mut self, seq: u64, payload: &[u8]) {
        self.history.push((seq, payload.to_vec()));
    }

    /// Answers one replay request (blocking until it arrives), like the engines' ROUTER does.
    pub fn serve_replay(&self) -> u64 {
        let router = self.router.as_ref().expect("no replay socket");
        router.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        let req = router.recv_multipart(0).expect("no replay request arrived");
        assert_eq!(req.len(), 3, "identity, empty delimiter, start seq");
        assert!(req[1].is_empty());
        let from = u64::from_be_bytes(req[2].as_slice().try_into().unwrap());
        let id = &req[0];
        for (seq, payload) in self.history.iter().filter(|(s, _)| *s >= from) {
            let seq = seq.to_be_bytes();
            match self.framing {
                ReplayFraming::WithTopic => {
                    router.send_multipart([&id[..], b"", &self.topic[..], &seq[..], payload], 0).unwrap()
                }
                ReplayFraming::NoTopic => {
                    router.send_multipart([&id[..], b"", &seq[..], payload], 0).unwrap()
                }
            }
        }
        let end = u64::MAX.to_be_bytes();
        match self.framing {
            ReplayFraming::WithTopic => router.send_multipart([&id[..], b"", b"", &end[..], b""], 0).unwrap(),
            ReplayFraming::NoTopic => router.send_multipart([&id[..], b"", &end[..], b""], 0).unwrap(),
        }
        from
    }

    /// Receives one replay request and does not answer it.
    pub fn ignore_replay(&self) {
        let router = self.router.as_ref().expect("no replay socket");
        router.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        router.recv_multipart(0).expect("no replay request arrived");
    }
}

/// A synthetic vLLM stream: batch `i` stores block `i` of the token sequence `0..`, chained on
/// block `i - 1`; engine hash of block `i` is `1000 + i`.
pub fn vllm_block_batch(i: u64) -> Vec<u8> {
    vllm_block_batch_of_rank(i, 0)
}

/// [`vllm_block_batch`] naming DP rank `rank`.
pub fn vllm_block_batch_of_rank(i: u64, rank: u16) -> Vec<u8> {
    use cortex_events_vllm::{Version, WireBatch, WireBlockStored, WireEvent, WireHash};
    let tokens: Vec<u32> = (i as u32 * 16..i as u32 * 16 + 16).collect();
    let stored = WireBlockStored {
        block_hashes: vec![WireHash::Uint(1000 + i)],
        parent_block_hash: i.checked_sub(1).map(|p| WireHash::Uint(1000 + p)),
        token_ids: tokens,
        block_size: 16,
        medium: Some("GPU"),
        ..WireBlockStored::default()
    };
    let batch =
        WireBatch { ts: 1.0, events: vec![WireEvent::BlockStored(stored)], data_parallel_rank: Some(rank) };
    cortex_events_vllm::encode(&batch, Version::LATEST).unwrap()
}
