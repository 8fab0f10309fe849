//! Event-plane throughput and time to READY, end to end over loopback ZeroMQ.
//!
//! `cargo bench -p cortex-ingest --bench ingest`
//!
//! - throughput: a fake engine publishes 16-block `BlockStored` batches (16-token pages, vLLM 0.33
//!   format) as fast as it can; measured from the first publish to the last batch visible in the
//!   ledger, with one writer lane. Baselines in the same run: decoding the same payloads alone,
//!   and decoding + applying them to a ledger writer directly (no sockets).
//! - one batch at a time: the engine publishes a batch only once the previous one is visible, as
//!   at a gateway's ordinary load (a batch per request); per batch, the time from publish to
//!   visible (p50, p99) and the CPU time of the ingest threads and of the whole process (from
//!   `/proc/self/task/*/schedstat`, Linux only).
//! - time to READY: a cold start whose first batch is seq 10,000 (replayed from 0), a gap of 1,000
//!   batches filled by replay, and an engine restart.
//!
//! Prints a table; nothing here is asserted (timings never are).

#![allow(missing_docs, clippy::print_stdout, clippy::unwrap_used)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cortex_events_vllm::{
    DecodeContext, Unlabeled as VUnlabeled, Version, WireBatch, WireBlockStored, WireEvent, WireHash,
};
use cortex_hash::kv::{DpRank, HolderId, WorkerId};
use cortex_ingest::{HolderSource, HolderState, Ingest, IngestConfig, Unlabeled, Wire};
use cortex_radix::{HolderConfig, Ledger, LedgerConfig};
use support::{FakeEngine, ReplayFraming};

const BLOCKS_PER_BATCH: u64 = 16;
const PAGE: u64 = 16;
const MODEL: &str = "bench-model";
const WAIT: Duration = Duration::from_secs(120);

/// Batch `i` stores blocks `16i..16i+16` of one long chain; engine hashes are the block numbers.
fn batch(i: u64) -> Vec<u8> {
    let first = i * BLOCKS_PER_BATCH;
    let stored = WireBlockStored {
        block_hashes: (first..first + BLOCKS_PER_BATCH).map(|b| WireHash::Uint(b + 1)).collect(),
        parent_block_hash: if first == 0 { None } else { Some(WireHash::Uint(first)) },
        token_ids: (first * PAGE..(first + BLOCKS_PER_BATCH) * PAGE).map(|t| (t % 150_000) as u32).collect(),
        block_size: PAGE as u32,
        medium: Some("GPU"),
        ..WireBlockStored::default()
    };
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let b = WireBatch { ts, events: vec![WireEvent::BlockStored(stored)], data_parallel_rank: Some(0) };
    cortex_events_vllm::encode(&b, Version::LATEST).unwrap()
}

fn source(engine: &FakeEngine, holder: HolderId, capacity: u32) -> HolderSource {
    HolderSource {
        holder,
        wire: Wire::Vllm,
        model: MODEL.into(),
        unlabeled: Unlabeled::Plain,
        publish: engine.pub_endpoint.clone(),
        replay: engine.replay_endpoint.clone(),
        topic: String::new(),
        capacity_blocks: capacity,
        content_deterministic: true,
    }
}

fn one_lane() -> IngestConfig {
    IngestConfig { lanes: 1, replay_timeout: Duration::from_secs(60), ..IngestConfig::default() }
}

/// A one-lane ingest following `worker`'s rank 0 on a fresh fake engine (no replay socket),
/// subscribed and ready to receive.
fn live_holder(worker: WorkerId, capacity: u32) -> (Ingest, FakeEngine, HolderId) {
    let ingest = Ingest::start(Ledger::new(LedgerConfig::default()), one_lane()).unwrap();
    let engine = FakeEngine::new("", None);
    let h = HolderId::new(worker, DpRank(0));
    ingest.add_holder(source(&engine, h, capacity)).unwrap();
    engine.wait_subscribed();
    (ingest, engine, h)
}

fn mblocks_per_s(blocks: u64, d: Duration) -> f64 {
    blocks as f64 / d.as_secs_f64() / 1e6
}

fn throughput(payloads: &[Vec<u8>]) -> (f64, f64, f64) {
    let blocks = payloads.len() as u64 * BLOCKS_PER_BATCH;
    let capacity = u32::try_from(blocks * 2).unwrap();
    // Baseline 1: decode only.
    let ctx = DecodeContext::new(MODEL, VUnlabeled::Plain);
    let t = Instant::now();
    let mut n = 0;
    for p in payloads {
        n += cortex_events_vllm::decode(p, &ctx).unwrap().events.len();
    }
    let decode = t.elapsed();
    assert_eq!(n, payloads.len());
    // Baseline 2: decode + apply, no sockets.
    let ledger = Ledger::new(LedgerConfig::default());
    let mut w = ledger
        .add_holder(
            HolderId::new(WorkerId(1), DpRank(0)),
            HolderConfig { capacity_blocks: capacity, content_deterministic: true },
        )
        .unwrap();
    let t = Instant::now();
    for p in payloads {
        w.apply_batch(&cortex_events_vllm::decode(p, &ctx).unwrap()).unwrap();
    }
    let direct = t.elapsed();
    // End to end over loopback.
    let (ingest, mut engine, h) = live_holder(WorkerId(2), capacity);
    let last = payloads.len() as u64 - 1;
    let t = Instant::now();
    for (i, p) in payloads.iter().enumerate() {
        engine.send_live(i as u64, p);
    }
    assert!(ingest.wait_for(h, WAIT, |s| s.last_seq == last), "{:?}", ingest.status(h));
    let e2e = t.elapsed();
    engine.history.clear();
    (mblocks_per_s(blocks, decode), mblocks_per_s(blocks, direct), mblocks_per_s(blocks, e2e))
}

/// CPU time in ns of this process's threads (all, and those whose name starts with `prefix`).
fn thread_cpu_ns(prefix: &str) -> (u64, u64) {
    let (mut all, mut named) = (0, 0);
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return (0, 0) };
    for t in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        let ns: u64 = read("schedstat").split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
        all += ns;
        if read("comm").starts_with(prefix) {
            named += ns;
        }
    }
    (all, named)
}

/// One batch at a time: (p50, p99) publish-to-visible latency, and CPU µs per batch (whole
/// process, ingest threads).
fn one_at_a_time(payloads: &[Vec<u8>]) -> (Duration, Duration, f64, f64) {
    let capacity = u32::try_from(payloads.len() as u64 * BLOCKS_PER_BATCH * 2).unwrap();
    let (ingest, mut engine, h) = live_holder(WorkerId(5), capacity);
    let mut lat = Vec::with_capacity(payloads.len());
    let (all0, ing0) = thread_cpu_ns("cortex-ingest");
    for (i, p) in payloads.iter().enumerate() {
        let t = Instant::now();
        engine.send_live(i as u64, p);
        assert!(ingest.wait_for(h, WAIT, |s| s.last_seq == i as u64), "{:?}", ingest.status(h));
        lat.push(t.elapsed());
    }
    let (all1, ing1) = thread_cpu_ns("cortex-ingest");
    engine.history.clear();
    lat.sort();
    let n = payloads.len() as f64;
    (
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        (all1 - all0) as f64 / n / 1e3,
        (ing1 - ing0) as f64 / n / 1e3,
    )
}

fn cold_start_with_replay(payloads: &[Vec<u8>]) -> Duration {
    let n = payloads.len() as u64;
    let ledger = Ledger::new(LedgerConfig::default());
    let ingest = Ingest::start(Arc::clone(&ledger), one_lane()).unwrap();
    let mut engine = FakeEngine::new("", Some(ReplayFraming::WithTopic));
    for (i, p) in payloads.iter().enumerate() {
        engine.record_only(i as u64, p);
    }
    let h = HolderId::new(WorkerId(3), DpRank(0));
    let capacity = u32::try_from((n + 1) * BLOCKS_PER_BATCH * 2).unwrap();
    let t = Instant::now();
    ingest.add_holder(source(&engine, h, capacity)).unwrap();
    engine.wait_subscribed();
    engine.publish(n, &batch(n));
    engine.serve_replay();
    assert!(ingest.wait_for(h, WAIT, |s| s.state == HolderState::Ready && s.last_seq == n));
    t.elapsed()
}

fn gap_and_restart(payloads: &[Vec<u8>], gap: usize) -> (Duration, Duration) {
    let ledger = Ledger::new(LedgerConfig::default());
    let ingest = Ingest::start(Arc::clone(&ledger), one_lane()).unwrap();
    let mut engine = FakeEngine::new("", Some(ReplayFraming::WithTopic));
    let h = HolderId::new(WorkerId(4), DpRank(0));
    let capacity = u32::try_from(payloads.len() as u64 * BLOCKS_PER_BATCH * 2).unwrap();
    ingest.add_holder(source(&engine, h, capacity)).unwrap();
    engine.wait_subscribed();
    // The holder's start replay (the engine has nothing buffered yet).
    engine.serve_replay();
    let split = payloads.len() - gap - 1;
    for (i, p) in payloads[..split].iter().enumerate() {
        engine.publish(i as u64, p);
    }
    assert!(ingest.wait_for(h, WAIT, |s| s.last_seq == split as u64 - 1));
    for (i, p) in payloads[split..split + gap].iter().enumerate() {
        engine.record_only((split + i) as u64, p);
    }
    let last = (split + gap) as u64;
    let t = Instant::now();
    engine.publish(last, &payloads[split + gap]);
    engine.serve_replay();
    assert!(ingest.wait_for(h, WAIT, |s| s.state == HolderState::Ready && s.last_seq == last));
    let gap_time = t.elapsed();
    let t = Instant::now();
    engine.publish(0, &payloads[0]);
    assert!(ingest.wait_for(h, WAIT, |s| s.last_seq == 0 && s.clears == 1), "{:?}", ingest.status(h));
    (gap_time, t.elapsed())
}

fn main() {
    let payloads: Vec<Vec<u8>> = (0..20_000).map(batch).collect();
    println!(
        "cortex-ingest: 16-block BlockStored batches, 16-token pages, vLLM 0.33 format, one writer lane"
    );
    // `CORTEX_INGEST_BENCH=paced`: only the one-batch-at-a-time rounds (for a profiler).
    let paced_only = std::env::var("CORTEX_INGEST_BENCH").is_ok_and(|v| v == "paced");
    let mut rows = Vec::new();
    // Five rounds: the goal of issue 20 is a median of at least five.
    for round in 0..if paced_only { 0 } else { 5 } {
        let (d, a, e) = throughput(&payloads);
        println!(
            "round {round}: decode only {d:.2} M blocks/s | decode+apply {a:.2} M blocks/s | end to end {e:.2} M blocks/s"
        );
        rows.push((d, a, e));
    }
    let median = |f: fn(&(f64, f64, f64)) -> f64| {
        let mut v: Vec<f64> = rows.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    if !paced_only {
        println!(
            "median: decode only {:.2} | decode+apply {:.2} | end to end {:.2} M block-stores/s ({:.0} % of decode+apply)",
            median(|r| r.0),
            median(|r| r.1),
            median(|r| r.2),
            100.0 * median(|r| r.2) / median(|r| r.1)
        );
    }
    for round in 0..3 {
        let (p50, p99, all, ing) = one_at_a_time(&payloads[..3_000]);
        println!(
            "one batch at a time, round {round}: publish to visible p50 {:.1} us, p99 {:.1} us | CPU per batch: ingest threads {ing:.1} us, process {all:.1} us",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
        );
    }
    if paced_only {
        return;
    }
    let cold = cold_start_with_replay(&payloads[..10_000]);
    println!(
        "time to READY, cold start replaying 10,000 batches (160,000 blocks): {:.1} ms",
        cold.as_secs_f64() * 1e3
    );
    let (gap, restart) = gap_and_restart(&payloads[..5_000], 1_000);
    println!("time to READY, gap of 1,000 batches filled by replay: {:.1} ms", gap.as_secs_f64() * 1e3);
    println!(
        "time to apply a restart (clear 64,000 blocks, apply seq 0): {:.1} ms",
        restart.as_secs_f64() * 1e3
    );
}
