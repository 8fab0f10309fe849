//! The event plane against a fake engine on loopback: a test XPUB (so the test sees the
//! subscription arrive before publishing) and ROUTER play the engine, with the golden frames and
//! with synthetic streams in the engines' real framing. Every row of the sequence table is
//! exercised; tests wait on observable state (the subscription, the applied sequence number),
//! never on sleeps.

#![allow(clippy::unwrap_used)] // test helpers: a failed setup step should panic

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_hash::{Engine, Namespace};
use cortex_ingest::{HolderSource, HolderState, Ingest, IngestConfig, Reason, StaleRouting, Unlabeled, Wire};
use cortex_radix::{Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness};

mod support;
use support::{FakeEngine, ReplayFraming, vllm_block_batch};

const WAIT: Duration = Duration::from_secs(10);
const MODEL: &str = "test-model";

fn golden(path: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden").join(path);
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

fn unhex(s: &serde_json::Value) -> Vec<u8> {
    hex::decode(s.as_str().unwrap()).unwrap()
}

fn source(engine: &FakeEngine, holder: HolderId, wire: Wire) -> HolderSource {
    HolderSource {
        holder,
        wire,
        model: MODEL.into(),
        unlabeled: Unlabeled::Plain,
        publish: engine.pub_endpoint.clone(),
        replay: engine.replay_endpoint.clone(),
        topic: String::from_utf8(engine.topic.clone()).unwrap(),
        capacity_blocks: 10_000,
        content_deterministic: true,
    }
}

struct Setup {
    ledger: Arc<Ledger>,
    ingest: Ingest,
}

/// Follows `h` on `engine` (vLLM's wire format) and waits until the engine has the subscription.
fn follow(s: &Setup, engine: &FakeEngine, h: HolderId) {
    s.ingest.add_holder(source(engine, h, Wire::Vllm)).unwrap();
    engine.wait_subscribed();
}

/// Publishes the vLLM batches `seqs` live, in order.
fn publish_vllm(engine: &mut FakeEngine, seqs: std::ops::Range<u64>) {
    for i in seqs {
        engine.publish(i, &vllm_block_batch(i));
    }
}

fn setup(cfg: IngestConfig) -> Setup {
    let ledger = Ledger::new(LedgerConfig::default());
    let ingest = Ingest::start(Arc::clone(&ledger), cfg).unwrap();
    Setup { ledger, ingest }
}

fn holder(w: u32, r: u16) -> HolderId {
    HolderId::new(WorkerId(w), DpRank(r))
}

fn wait_seq(s: &Setup, h: HolderId, seq: u64) {
    // The ledger's readiness too: a transition shows in the status a moment before the ledger.
    assert!(
        s.ingest.wait_for(h, WAIT, |st| st.last_seq == seq
            && st.state == HolderState::Ready
            && s.ledger.readiness(h) == Some(Readiness::Ready)),
        "holder never applied seq {seq}: {:?}, ledger {:?}",
        s.ingest.status(h),
        s.ledger.readiness(h)
    );
}

/// Waits until `h` is STALE with `transitions(reason) == count` and the ledger shows `readiness`.
fn wait_stale(s: &Setup, h: HolderId, reason: Reason, count: u64, readiness: Readiness) {
    assert!(
        s.ingest.wait_for(h, WAIT, |st| st.state == HolderState::Stale
            && st.transitions(reason) == count
            && s.ledger.readiness(h) == Some(readiness)),
        "holder never went STALE ({reason:?} x{count}, ledger {readiness:?}): {:?}, ledger {:?}",
        s.ingest.status(h),
        s.ledger.readiness(h)
    );
}

/// How many leading blocks of the synthetic stream `h` holds, as a query sees it.
fn synthetic_overlap(ledger: &Ledger, h: HolderId, blocks: u32) -> u32 {
    let ns = Namespace::new(Engine::Vllm, 16, MODEL, None);
    let tokens: Vec<u32> = (0..blocks * 16).collect();
    let seq = ns.seq_hashes(None, &tokens);
    let mut out = OverlapScores::default();
    ledger.query(&seq, QueryOptions::default(), &mut out);
    out.get(h).map_or(0, |o| o.gpu_blocks)
}

#[test]
fn sglang_golden_stream_both_ranks() {
    let doc = golden("sglang/wire_topic_kv.json");
    let s = setup(IngestConfig::default());
    for rank in doc["ranks"].as_array().unwrap() {
        let r = rank["attn_dp_rank"].as_u64().unwrap() as u16;
        let mut engine = FakeEngine::new("kv", None);
        let h = holder(1, r);
        s.ingest.add_holder(source(&engine, h, Wire::Sglang)).unwrap();
        engine.wait_subscribed();
        // Publish up to (not including) the eviction steps: seq 0..=5.
        let msgs: Vec<&serde_json::Value> = rank["messages"].as_array().unwrap().iter().collect();
        for m in msgs.iter().take(6) {
            let frames = m["frames_hex"].as_array().unwrap();
            let seq = m["seq"].as_u64().unwrap();
            engine.publish(seq, &unhex(&frames[2]));
        }
        wait_seq(&s, h, 5);
        // A's 64 tokens (100..140 then 300..324; rank 1's capture adds 10000) are 4 pages of 16
        // in the base namespace.
        let ns = Namespace::new(Engine::Sglang, 16, MODEL, None);
        let off = 10_000 * u32::from(r);
        let a: Vec<u32> = (100 + off..140 + off).chain(300 + off..324 + off).collect();
        let mut out = OverlapScores::default();
        s.ledger.query(&ns.seq_hashes(None, &a), QueryOptions::default(), &mut out);
        assert_eq!(out.get(h).map(|o| o.gpu_blocks), Some(4), "rank {r}");
        // C is A's first 32 tokens under salt "tenant-a": 2 blocks in the salted lineage only.
        s.ledger.query(&ns.seq_hashes(Some("tenant-a"), &a[..32]), QueryOptions::default(), &mut out);
        assert_eq!(out.get(h).map(|o| o.gpu_blocks), Some(2));
        // The rest: eviction steps, then the reset.
        for m in msgs.iter().skip(6) {
            let frames = m["frames_hex"].as_array().unwrap();
            engine.publish(m["seq"].as_u64().unwrap(), &unhex(&frames[2]));
        }
        wait_seq(&s, h, 8);
        s.ledger.query(&ns.seq_hashes(None, &a), QueryOptions::default(), &mut out);
        assert_eq!(out.get(h), None, "after AllBlocksCleared nothing is held");
        let st = s.ingest.status(h).unwrap();
        assert_eq!(st.decode_errors_total(), 0);
        assert_eq!(st.rank_mismatches, 0);
        assert_eq!(st.batches, 9);
    }
}

#[test]
fn vllm_golden_blockpool_stream() {
    let doc = golden("vllm/blockpool_golden.json");
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(2, 0);
    follow(&s, &engine, h);
    let steps = doc.as_array().unwrap();
    for step in &steps[..2] {
        engine.publish(step["step"].as_u64().unwrap(), &unhex(&step["frames_hex"][2]));
    }
    wait_seq(&s, h, 1);
    // Request A: tokens 1..=48 are three blocks.
    let ns = Namespace::new(Engine::Vllm, 16, MODEL, None);
    let a: Vec<u32> = (1..=48).collect();
    let mut out = OverlapScores::default();
    s.ledger.query(&ns.seq_hashes(None, &a), QueryOptions::default(), &mut out);
    assert_eq!(out.get(h).map(|o| o.gpu_blocks), Some(3));
    for step in &steps[2..4] {
        engine.publish(step["step"].as_u64().unwrap(), &unhex(&step["frames_hex"][2]));
    }
    wait_seq(&s, h, 3);
    // The eviction removed all of A.
    s.ledger.query(&ns.seq_hashes(None, &a), QueryOptions::default(), &mut out);
    assert_eq!(out.get(h), None);
    assert_eq!(s.ingest.status(h).unwrap().blocks_removed, 4);
}

/// Worker `w`'s rank 0 on an engine with a replay socket: batches 0–2 arrive, the next `lost`
/// are lost on the wire, and the one after them reveals the gap, which the replay fills: every
/// block is back, in order. Returns the setup and the holder.
fn gap_filled_by_replay(w: u32, lost: u64) -> (Setup, HolderId) {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("kv-events", Some(ReplayFraming::WithTopic));
    let h = holder(w, 0);
    follow(&s, &engine, h);
    // Added: the holder asks for everything buffered (nothing yet) and is READY.
    assert_eq!(engine.serve_replay(), 0);
    publish_vllm(&mut engine, 0..3);
    wait_seq(&s, h, 2);
    let last = 3 + lost;
    for seq in 3..last {
        engine.record_only(seq, &vllm_block_batch(seq));
    }
    engine.publish(last, &vllm_block_batch(last));
    assert_eq!(engine.serve_replay(), 3, "asked from the first lost batch");
    wait_seq(&s, h, last);
    let blocks = u32::try_from(last + 1).unwrap();
    assert_eq!(synthetic_overlap(&s.ledger, h, blocks), blocks, "every block is back, in order");
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.transitions(Reason::Gap), 1);
    assert_eq!(st.transitions(Reason::ReplayOk), 2, "the start replay and the gap's");
    assert_eq!(st.clears, 0);
    (s, h)
}

#[test]
fn gap_is_filled_by_replay() {
    // Batches 3 and 4 are lost on the wire; 5 arrives and reveals the gap.
    let (s, h) = gap_filled_by_replay(3, 2);
    // Batch 5 came live and again in the replay: applied once, and not counted as a duplicate
    // (the engine sent it once; an alert on duplicates fired on every repaired gap).
    assert_eq!(s.ingest.status(h).unwrap().duplicates, 0);
}

/// A replay longer than one drain of the socket (`BURST`, 512 messages): the replies the socket
/// thread has not read yet are already queued, and nothing announces them again. Fails when a
/// drain stopped at `BURST` waits for the socket's descriptor instead of reading on.
#[test]
fn a_replay_longer_than_one_drain_is_read_to_its_end() {
    gap_filled_by_replay(9, 1_500);
}

#[test]
fn gap_without_replay_clears_and_continues() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(4, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..3);
    wait_seq(&s, h, 2);
    engine.publish(5, &vllm_block_batch(5));
    wait_seq(&s, h, 5);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.clears, 1);
    assert_eq!(st.transitions(Reason::ReplayFailed), 1);
    // Cleared: the prefix is gone (block 5's parent is unknown, so it waits as an orphan).
    assert_eq!(synthetic_overlap(&s.ledger, h, 6), 0);
}

#[test]
fn replay_timeout_rebuilds_cold() {
    let cfg = IngestConfig { replay_timeout: Duration::from_millis(200), ..IngestConfig::default() };
    let s = setup(cfg);
    let mut engine = FakeEngine::new("", Some(ReplayFraming::WithTopic));
    let h = holder(5, 0);
    follow(&s, &engine, h);
    engine.serve_replay();
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    engine.publish(4, &vllm_block_batch(4));
    engine.ignore_replay();
    assert!(s.ingest.wait_for(h, WAIT, |st| st.transitions(Reason::ReplayTimeout) == 1));
    wait_seq(&s, h, 4);
    assert_eq!(s.ingest.status(h).unwrap().clears, 1);
}

#[test]
fn incomplete_replay_rebuilds_cold() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", Some(ReplayFraming::WithTopic));
    let h = holder(6, 0);
    follow(&s, &engine, h);
    engine.serve_replay();
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    // The engine's ring buffer no longer holds 1..3: it replays from 4.
    engine.history.clear();
    engine.record_only(4, &vllm_block_batch(4));
    engine.publish(5, &vllm_block_batch(5));
    engine.serve_replay();
    wait_seq(&s, h, 5);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.transitions(Reason::ReplayFailed), 1);
    assert_eq!(st.clears, 1);
}

#[test]
fn restart_clears_and_reapplies() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(7, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..4);
    wait_seq(&s, h, 3);
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 4);
    // The engine restarts: sequence back to 0, no AllBlocksCleared (vLLM), new content.
    engine.publish(0, &vllm_block_batch(0));
    assert!(s.ingest.wait_for(h, WAIT, |st| st.transitions(Reason::Restart) == 1 && st.last_seq == 0));
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 1, "only what the restarted engine stored");
}

/// A publisher restarted behind the same socket (a relay, or a PUB that dropped its first
/// batches before the SUB was back): no disconnection is seen and its seq 0 never arrives. Its
/// next batches are numbered below the last applied but carry other bytes: a restart, cleared,
/// not a run of duplicates dropped until the new numbers pass the old ones.
#[test]
fn a_restart_seen_through_a_relay_without_its_first_batch_is_cleared() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(16, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..20);
    wait_seq(&s, h, 19);
    assert_eq!(synthetic_overlap(&s.ledger, h, 20), 20);
    // The "restarted" engine: its batch 0 is lost; 1, 2 and 3 store other blocks (the chain's
    // blocks 100 to 102, on no parent the ledger holds: a new chain).
    for (seq, batch) in [(1, 100), (2, 101), (3, 102)] {
        engine.send_live(seq, &vllm_block_batch(batch));
    }
    wait_seq(&s, h, 3);
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.clears, st.duplicates), (1, 0), "{st:?}");
    assert_eq!(st.transitions(Reason::Restart), 1, "{st:?}");
    assert_eq!(synthetic_overlap(&s.ledger, h, 20), 0, "the old engine's blocks are gone");
}

#[test]
fn duplicates_are_dropped() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(8, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..3);
    engine.send_live(1, &vllm_block_batch(1));
    engine.publish(3, &vllm_block_batch(3));
    wait_seq(&s, h, 3);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.duplicates, 1);
    assert_eq!(st.batches, 4);
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 4);
}

#[test]
fn a_long_burst_keeps_order_and_counts_across_hand_off_groups() {
    // More batches than one socket drain (512) or one lane drain (1024) takes, sent without
    // waiting: they reach the lane in many groups, whose boundaries fall anywhere.
    const N: u64 = 3_000;
    let s = setup(IngestConfig { lanes: 1, ..IngestConfig::default() });
    let engine = FakeEngine::new("", None);
    let h = holder(15, 0);
    follow(&s, &engine, h);
    let mut duplicates = 0;
    for i in 0..N {
        engine.send_live(i, &vllm_block_batch(i));
        if i % 7 == 6 {
            engine.send_live(i - 3, &vllm_block_batch(i - 3));
            duplicates += 1;
        }
    }
    wait_seq(&s, h, N - 1);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.batches, N);
    assert_eq!(st.duplicates, duplicates);
    assert_eq!(st.clears, 0);
    assert_eq!(st.transitions(Reason::Gap), 0);
    assert_eq!(synthetic_overlap(&s.ledger, h, N as u32), N as u32, "every block, in order");
}

/// Several holders, bursts of every size around one socket drain (1, 511, 512, 513, 1,024,
/// 1,536) sent to one holder while the others are idle, then to all at once: each holder's last
/// batch must arrive with nothing after it to wake its socket. A socket whose queued or new
/// messages could sit unannounced while the socket thread waits makes a wait time out.
#[test]
fn bursts_of_every_size_on_several_holders_all_arrive() {
    let s = setup(IngestConfig { lanes: 2, ..IngestConfig::default() });
    let engines: Vec<FakeEngine> = (0..4).map(|_| FakeEngine::new("", None)).collect();
    let hs: Vec<HolderId> = (0..4).map(|w| holder(40 + w, 0)).collect();
    for (e, &h) in engines.iter().zip(&hs) {
        follow(&s, e, h);
    }
    let mut next = [0u64; 4];
    let send = |e: &FakeEngine, next: &mut u64, n: u64| {
        for _ in 0..n {
            e.send_live(*next, &vllm_block_batch(*next));
            *next += 1;
        }
    };
    for (round, size) in [1u64, 511, 512, 513, 1_024, 2, 1_536, 7].into_iter().enumerate() {
        let k = round % 4;
        send(&engines[k], &mut next[k], size);
        wait_seq(&s, hs[k], next[k] - 1);
        for (j, e) in engines.iter().enumerate() {
            send(e, &mut next[j], (size + j as u64 * 97) % 600 + 1);
        }
        for (j, &h) in hs.iter().enumerate() {
            wait_seq(&s, h, next[j] - 1);
        }
    }
    for (j, &h) in hs.iter().enumerate() {
        let st = s.ingest.status(h).unwrap();
        assert_eq!((st.batches, st.clears, st.transitions(Reason::Gap)), (next[j], 0, 0), "holder {j}");
    }
}

#[test]
fn malformed_payload_is_counted_and_the_stream_continues() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(9, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    engine.publish(1, b"\x93\xcb not msgpack");
    engine.publish(2, &vllm_block_batch(2));
    wait_seq(&s, h, 2);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.decode_errors_total(), 1);
    assert_eq!(st.transitions(Reason::Undecodable), 1);
    assert_eq!(st.clears, 1, "the lost batch may have held removes");
    // The same in a burst, which the socket thread decodes before queueing it to the lane.
    for i in 3..40 {
        if i == 20 {
            engine.publish(i, b"\x93\xcb not msgpack");
        } else {
            engine.publish(i, &vllm_block_batch(i));
        }
    }
    wait_seq(&s, h, 39);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.decode_errors_total(), 2);
    assert_eq!(st.transitions(Reason::Undecodable), 2);
    assert_eq!(st.batches, 2 + 36);
}

#[test]
fn first_batch_after_start_replays_from_zero_without_topic_frame() {
    // vLLM ≤ 0.25 replies without the topic frame.
    let doc = golden("vllm/zmq_golden_vllm-0.23.0.json");
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("kv-events", Some(ReplayFraming::NoTopic));
    let payloads: Vec<Vec<u8>> =
        doc["live"].as_array().unwrap().iter().map(|m| unhex(&m["frames_hex"][2])).collect();
    assert!(payloads.len() >= 3);
    // The gateway starts after the engine published batches 0 and 1.
    engine.record_only(0, &payloads[0]);
    engine.record_only(1, &payloads[1]);
    let h = holder(10, 0);
    follow(&s, &engine, h);
    engine.publish(2, &payloads[2]);
    assert_eq!(engine.serve_replay(), 0);
    wait_seq(&s, h, 2);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.batches, 3);
    assert_eq!(st.transitions(Reason::ColdStart), 1);
    assert_eq!(st.transitions(Reason::ReplayOk), 1);
}

#[test]
fn removed_worker_gets_no_late_events() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(11, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    s.ingest.remove_worker(WorkerId(11)).unwrap();
    assert!(s.ingest.status(h).is_none());
    engine.publish(1, &vllm_block_batch(1));
    assert_eq!(synthetic_overlap(&s.ledger, h, 2), 0);
    assert!(s.ledger.dump(h).is_none());
    // The worker comes back: it starts SYNCING again and follows a fresh stream.
    let mut engine = FakeEngine::new("", None);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    assert_eq!(synthetic_overlap(&s.ledger, h, 2), 1);
}

/// Removing a worker while the holders after it have events waiting keeps the event plane up:
/// the socket thread drains each socket it polled before the removal shifts the holders (it used
/// to index past the end and die, found by `cargo xtask soak-gateway`), and a holder followed
/// afterwards still gets its events.
#[test]
fn removing_a_worker_while_later_holders_are_busy_keeps_the_event_plane() {
    let s = setup(IngestConfig::default());
    let payload = vllm_block_batch(0);
    // Without the fix the first round already fails; a second removes a worker after a removal.
    for round in 0..2 {
        let quiet = FakeEngine::new("", None);
        follow(&s, &quiet, holder(100 + round, 0));
        let busy = FakeEngine::new("", None);
        let b = holder(200 + round, 0);
        follow(&s, &busy, b);
        // Far more than one drain takes: the busy socket stays readable while the removal
        // wakes the socket thread.
        for seq in 0..20_000 {
            busy.send_live(seq, &payload);
        }
        s.ingest.remove_worker(WorkerId(100 + round)).unwrap();
        assert!(s.ingest.wait_for(b, WAIT, |st| st.last_seq == 19_999), "{:?}", s.ingest.status(b));
        s.ingest.remove_worker(WorkerId(200 + round)).unwrap();
    }
    let mut engine = FakeEngine::new("", None);
    let h = holder(1, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
}

#[test]
fn silence_while_busy_is_stale_until_events_resume() {
    let cfg = IngestConfig { silence_timeout: Duration::from_millis(100), ..IngestConfig::default() };
    let s = setup(cfg);
    let mut engine = FakeEngine::new("", None);
    let h = holder(12, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    s.ingest.report_running(h, 3, Some((Instant::now(), Instant::now())));
    wait_stale(&s, h, Reason::Silent, 1, Readiness::Stale);
    assert_eq!(synthetic_overlap(&s.ledger, h, 1), 0, "a STALE holder is not counted by default");
    engine.publish(1, &vllm_block_batch(1));
    wait_seq(&s, h, 1);
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Silent), 1);
    assert_eq!(synthetic_overlap(&s.ledger, h, 2), 2);
}

/// The last batches lost on the wire, which no later batch reveals as a gap: the silence after
/// the request that owed them asks the replay for what follows the last batch, and the holder is
/// READY again with every block, no request needed; a probe that finds nothing leaves it STALE
/// with what it holds. Fails without the probe (the holder stays STALE until the engine's next
/// batch).
#[test]
fn a_silence_repairs_lost_last_batches_through_the_replay() {
    let cfg = IngestConfig { silence_timeout: Duration::from_millis(100), ..IngestConfig::default() };
    let s = setup(cfg);
    let mut engine = FakeEngine::new("kv", Some(ReplayFraming::WithTopic));
    let h = holder(21, 0);
    follow(&s, &engine, h);
    assert_eq!(engine.serve_replay(), 0);
    publish_vllm(&mut engine, 0..2);
    wait_seq(&s, h, 1);
    engine.record_only(2, &vllm_block_batch(2));
    engine.record_only(3, &vllm_block_batch(3));
    s.ingest.report_running(h, 1, Some((Instant::now(), Instant::now())));
    assert_eq!(engine.serve_replay(), 2, "asked from the batch after the last applied");
    wait_seq(&s, h, 3);
    assert!(s.ingest.wait_for(h, WAIT, |st| st.state == HolderState::Ready), "{:?}", s.ingest.status(h));
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 4, "the lost batches' blocks are there");
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.transitions(Reason::Silent), st.clears), (1, 0), "{st:?}");
    // Silent again, and this time the engine published nothing: STALE, nothing cleared.
    s.ingest.report_running(h, 1, Some((Instant::now(), Instant::now())));
    assert_eq!(engine.serve_replay(), 4);
    wait_stale(&s, h, Reason::Silent, 2, Readiness::Stale);
    std::thread::sleep(Duration::from_millis(50));
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.state, st.clears), (HolderState::Stale, 0), "{st:?}");
    // Its next batch in order resumes it, every block kept.
    engine.publish(4, &vllm_block_batch(4));
    wait_seq(&s, h, 4);
    assert!(s.ingest.wait_for(h, WAIT, |st| st.state == HolderState::Ready), "{:?}", s.ingest.status(h));
    assert_eq!(synthetic_overlap(&s.ledger, h, 5), 5);
    s.ingest.shutdown();
}

/// A batch naming another DP rank than its socket's is applied to the socket's holder (the
/// socket is where the engine's rank publishes) and counted, so that a misconfigured port base
/// shows.
#[test]
fn a_batch_of_another_rank_is_applied_and_counted() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(22, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    engine.publish(1, &support::vllm_block_batch_of_rank(1, 3));
    wait_seq(&s, h, 1);
    assert_eq!(synthetic_overlap(&s.ledger, h, 2), 2);
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.batches, st.rank_mismatches), (2, 1), "{st:?}");
    s.ingest.shutdown();
}

/// Silence counts only after a request that stores new blocks: an engine idle for longer than
/// `silence_timeout` (found against the demo, where a worker's first request after 30 idle
/// seconds made it STALE) or busy serving cache hits only (found by a probe: a hot worker lost
/// exact routing after 30 s of hits) stores nothing and is rightly quiet; one that publishes
/// nothing for a timeout after such a request is STALE; an event after the request, even one
/// that came before the load poll said so, satisfies it.
#[test]
fn only_work_that_stores_blocks_obliges_an_engine_to_publish() {
    let timeout = Duration::from_secs(1);
    let s = setup(IngestConfig { silence_timeout: timeout, ..IngestConfig::default() });
    let mut engine = FakeEngine::new("", None);
    let h = holder(14, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    // Idle past the timeout, then busy with cache hits for longer than it.
    std::thread::sleep(timeout + Duration::from_millis(300));
    for _ in 0..8 {
        s.ingest.report_running(h, 8, None);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Silent), 0);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    // A request that stores blocks, whose event came before the poll reported it: satisfied.
    let sent = Instant::now();
    engine.publish(1, &vllm_block_batch(1));
    wait_seq(&s, h, 1);
    s.ingest.report_running(h, 1, Some((sent, sent)));
    std::thread::sleep(timeout + Duration::from_millis(300));
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Silent), 0);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    // One with no event after it: STALE a timeout later, not before.
    s.ingest.report_running(h, 1, Some((Instant::now(), Instant::now())));
    std::thread::sleep(timeout / 2);
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Silent), 0);
    wait_stale(&s, h, Reason::Silent, 1, Readiness::Stale);
    // Events resume: READY, and nothing more is owed.
    engine.publish(2, &vllm_block_batch(2));
    wait_seq(&s, h, 2);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    std::thread::sleep(timeout + Duration::from_millis(300));
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Silent), 1);
    s.ingest.shutdown();
}

/// A batch sent again (dropped as a duplicate) is not the event a request that stored blocks
/// owes: a relay re-sending an old batch every half second kept a holder whose new batches were
/// all lost READY (a probe's finding).
#[test]
fn a_duplicate_does_not_settle_what_a_request_owes() {
    let timeout = Duration::from_secs(1);
    let s = setup(IngestConfig { silence_timeout: timeout, ..IngestConfig::default() });
    let mut engine = FakeEngine::new("", None);
    let h = holder(17, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..3);
    wait_seq(&s, h, 2);
    s.ingest.report_running(h, 1, Some((Instant::now(), Instant::now())));
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(200));
        engine.send_live(1, &vllm_block_batch(1));
    }
    let st = s.ingest.status(h).unwrap();
    assert!(st.duplicates >= 4, "{st:?}");
    assert_eq!(st.transitions(Reason::Silent), 1, "{st:?}");
    s.ingest.shutdown();
}

#[test]
fn an_idle_engine_is_ready_without_any_event() {
    let s = setup(IngestConfig::default());
    // Without a replay socket: READY at once, from an empty ledger.
    let engine = FakeEngine::new("", None);
    let h = holder(13, 0);
    s.ingest.add_holder(source(&engine, h, Wire::Sglang)).unwrap();
    assert!(s.ingest.wait_for(h, WAIT, |st| st.state == HolderState::Ready));
    // With one: READY once the engine said it buffers nothing.
    let with_replay = FakeEngine::new("", Some(ReplayFraming::WithTopic));
    let h2 = holder(14, 0);
    s.ingest.add_holder(source(&with_replay, h2, Wire::Sglang)).unwrap();
    assert_eq!(with_replay.serve_replay(), 0);
    assert!(s.ingest.wait_for(h2, WAIT, |st| st.state == HolderState::Ready
        && s.ledger.readiness(h2) == Some(Readiness::Ready)));
}

/// How many leading pages of the synthetic SGLang stream `h` holds, as a query sees it.
fn sglang_overlap(ledger: &Ledger, h: HolderId, pages: u32) -> u32 {
    let ns = Namespace::new(Engine::Sglang, 16, MODEL, None);
    let tokens: Vec<u32> = (0..pages * 16).collect();
    let mut out = OverlapScores::default();
    ledger.query(&ns.seq_hashes(None, &tokens), QueryOptions::default(), &mut out);
    out.get(h).map_or(0, |o| o.gpu_blocks)
}

/// A synthetic SGLang stream in `encoding`: batch `i` stores page `i` of the token sequence
/// `0..`, chained on page `i - 1`; SGLang's hash of page `i` is `2000 + i`.
fn sglang_page_batch(i: u64, encoding: cortex_events_sglang::Encoding) -> Vec<u8> {
    use cortex_events_sglang::{TokenIds, WireBatch, WireBlockStored, WireEvent};
    let stored = WireBlockStored {
        block_hashes: vec![2000 + i as i64],
        parent_block_hash: i.checked_sub(1).map(|p| 2000 + p as i64),
        token_ids: TokenIds::Flat((i * 16..i * 16 + 16).collect()),
        block_size: 16,
        medium: Some("GPU"),
        ..WireBlockStored::default()
    };
    let batch = WireBatch { ts: 1.0, events: vec![WireEvent::BlockStored(stored)], attn_dp_rank: Some(0) };
    cortex_events_sglang::encode(&batch, encoding).unwrap()
}

/// Drops `engine` (its PUB socket goes away: the SUB's monitor reports the disconnection), waits
/// for `h`'s `disconnects`-th STALE, and binds a new publisher on the same address, subscribed.
fn back_on_the_same_address(s: &Setup, h: HolderId, engine: FakeEngine, disconnects: u64) -> FakeEngine {
    let endpoint = engine.pub_endpoint.clone();
    drop(engine);
    wait_stale(s, h, Reason::Disconnected, disconnects, Readiness::Stale);
    let engine = FakeEngine::bound_to(&endpoint, "", None);
    engine.wait_subscribed();
    engine
}

#[test]
fn a_disconnected_publisher_makes_the_holder_stale_until_it_publishes_in_order_again() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(16, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..3);
    wait_seq(&s, h, 2);
    assert_eq!(s.ingest.status(h).unwrap().transitions(Reason::Resumed), 0);
    // The same publisher comes back on the same address (libzmq reconnects the SUB); until it
    // publishes, the holder is STALE.
    let mut engine = back_on_the_same_address(&s, h, engine, 1);
    assert_eq!(s.ingest.status(h).unwrap().clears, 0, "a disconnection is a suspicion, not a loss");
    assert_eq!(synthetic_overlap(&s.ledger, h, 3), 0, "a STALE holder is not counted by default");
    // It goes on where it stopped: seq = last + 1 proves nothing was lost, so READY with every
    // block kept.
    engine.publish(3, &vllm_block_batch(3));
    wait_seq(&s, h, 3);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.transitions(Reason::Resumed), 1);
    assert_eq!(st.clears, 0);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 4, "what was applied before the disconnection is kept");
    // It goes away again and comes back restarted (seq 0): a restart, so cleared and READY.
    let mut engine = back_on_the_same_address(&s, h, engine, 2);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.transitions(Reason::Restart), st.clears), (1, 1));
    assert_eq!(synthetic_overlap(&s.ledger, h, 4), 1, "only what the restarted engine stored");
}

/// A publisher restarted on the same address whose first batches went out before the SUB was
/// connected again (a PUB drops what no subscriber is connected for): the first batch seen is
/// numbered below the last applied one. That is a restart, cleared — not a run of duplicates
/// that would end, at the old last + 1, with the old engine's blocks taken for the new one's.
#[test]
fn a_restarted_publisher_whose_first_batches_were_missed_is_cleared() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(19, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..5);
    wait_seq(&s, h, 4);
    let mut engine = back_on_the_same_address(&s, h, engine, 1);
    // Its batches 0 and 1 were missed; 2, storing a first block, is the first seen.
    engine.publish(2, &vllm_block_batch(0));
    wait_seq(&s, h, 2);
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.transitions(Reason::Restart), st.clears), (1, 1));
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    assert_eq!(synthetic_overlap(&s.ledger, h, 5), 1, "only what the restarted engine was seen storing");
}

/// Makes a READY holder holding one block STALE (silent while its engine reports work) under
/// `stale_routing`; returns its ledger readiness and the blocks a query counts while STALE, then
/// checks that events resuming make it READY and counted.
fn silent_holder_under(stale_routing: StaleRouting, worker: u32) -> (Option<Readiness>, u32) {
    let cfg = IngestConfig {
        silence_timeout: Duration::from_millis(100),
        stale_routing,
        ..IngestConfig::default()
    };
    let s = setup(cfg);
    let mut engine = FakeEngine::new("", None);
    let h = holder(worker, 0);
    follow(&s, &engine, h);
    engine.publish(0, &vllm_block_batch(0));
    wait_seq(&s, h, 0);
    s.ingest.report_running(h, 2, Some((Instant::now(), Instant::now())));
    let expected = match stale_routing {
        StaleRouting::Included => Readiness::Ready,
        StaleRouting::Excluded => Readiness::Stale,
    };
    wait_stale(&s, h, Reason::Silent, 1, expected);
    let while_stale = (s.ledger.readiness(h), synthetic_overlap(&s.ledger, h, 1));
    engine.publish(1, &vllm_block_batch(1));
    wait_seq(&s, h, 1);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    assert_eq!(synthetic_overlap(&s.ledger, h, 2), 2);
    assert_eq!(s.ingest.status(h).unwrap().clears, 0);
    s.ingest.shutdown();
    while_stale
}

#[test]
fn stale_routing_included_keeps_a_stale_holder_ready_in_the_ledger() {
    assert_eq!(
        silent_holder_under(StaleRouting::Included, 17),
        (Some(Readiness::Ready), 1),
        "Included: STALE in the event plane, still counted by exact routing"
    );
    assert_eq!(IngestConfig::default().stale_routing, StaleRouting::Excluded);
    assert_eq!(
        silent_holder_under(StaleRouting::Excluded, 18),
        (Some(Readiness::Stale), 0),
        "the default: a STALE holder leaves exact routing"
    );
}

#[test]
fn sglang_gap_is_filled_by_replay() {
    use cortex_events_sglang::Encoding;
    let s = setup(IngestConfig::default());
    // Both encodings SGLang has published (arrays up to 0.5.19, maps since 0.5.20).
    for (worker, encoding) in [(19, Encoding::Maps), (20, Encoding::Arrays)] {
        let mut engine = FakeEngine::new("kv", Some(ReplayFraming::WithTopic));
        let h = holder(worker, 0);
        s.ingest.add_holder(source(&engine, h, Wire::Sglang)).unwrap();
        engine.wait_subscribed();
        assert_eq!(engine.serve_replay(), 0);
        for i in 0..3 {
            engine.publish(i, &sglang_page_batch(i, encoding));
        }
        wait_seq(&s, h, 2);
        assert_eq!(sglang_overlap(&s.ledger, h, 6), 3);
        // Pages 3 and 4 are lost on the wire; 5 arrives and reveals the gap.
        engine.record_only(3, &sglang_page_batch(3, encoding));
        engine.record_only(4, &sglang_page_batch(4, encoding));
        engine.publish(5, &sglang_page_batch(5, encoding));
        assert_eq!(engine.serve_replay(), 3);
        wait_seq(&s, h, 5);
        assert_eq!(sglang_overlap(&s.ledger, h, 6), 6, "{encoding:?}: every page is back, in order");
        let st = s.ingest.status(h).unwrap();
        assert_eq!(st.transitions(Reason::Gap), 1);
        assert_eq!(st.transitions(Reason::ReplayOk), 2, "the start replay and the gap's");
        assert_eq!(st.clears, 0);
        assert_eq!(st.decode_errors_total(), 0);
        assert_eq!(st.rank_mismatches, 0);
        assert_eq!(st.duplicates, 0, "page 5 came live and replayed: applied once, not an engine duplicate");
        assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
    }
}

#[test]
fn a_gap_without_replay_passes_through_stale_and_back_to_ready() {
    let s = setup(IngestConfig::default());
    let mut engine = FakeEngine::new("", None);
    let h = holder(21, 0);
    follow(&s, &engine, h);
    publish_vllm(&mut engine, 0..3);
    wait_seq(&s, h, 2);
    // Two gaps (3..=4 and 7 lost): each is one STALE (`gap`) and one READY (`replay_failed`).
    engine.publish(5, &vllm_block_batch(5));
    engine.publish(6, &vllm_block_batch(6));
    wait_seq(&s, h, 6);
    let st = s.ingest.status(h).unwrap();
    assert_eq!((st.transitions(Reason::Gap), st.transitions(Reason::ReplayFailed)), (1, 1));
    engine.publish(8, &vllm_block_batch(8));
    wait_seq(&s, h, 8);
    let st = s.ingest.status(h).unwrap();
    assert_eq!(st.transitions(Reason::Gap), 2, "the gap is counted as a gap");
    assert_eq!(st.transitions(Reason::ReplayFailed), 2, "the repair as the replay that could not be had");
    assert_eq!(st.clears, 2);
    assert_eq!(st.replays_requested, 0, "no replay socket: nothing asked");
    assert_eq!(st.transitions(Reason::Resumed), 0);
    assert_eq!(s.ledger.readiness(h), Some(Readiness::Ready));
}
