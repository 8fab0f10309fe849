//! Decode throughput in block-stores per second on one core: vLLM 0.33 batches of `BlockStored`
//! events with 16 blocks of 16 tokens each, against `rmpv::decode::read_value` on the same bytes
//! (a generic MessagePack tree, no hashing) measured in the same run.
//!
//! `cargo bench -p cortex-events-vllm --bench decode`

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;

use cortex_events_vllm::{
    DecodeContext, Unlabeled, Version, WireBatch, WireBlockStored, WireEvent, WireHash, decode, decode_wire,
    encode,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const EVENTS: usize = 8;
const BLOCKS: usize = 16;
const PAGE: usize = 16;

/// A batch as a busy vLLM 0.33 step publishes it: `EVENTS` stores, each 16 full blocks chained on
/// a parent, realistic token ids (most need a `uint32`), full-size hashes.
fn payload() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let events = (0..EVENTS)
        .map(|_| {
            WireEvent::BlockStored(WireBlockStored {
                block_hashes: (0..BLOCKS).map(|_| WireHash::Uint(next())).collect(),
                parent_block_hash: Some(WireHash::Uint(next())),
                token_ids: (0..BLOCKS * PAGE).map(|_| (next() % 151_000) as u32).collect(),
                block_size: PAGE as u32,
                medium: Some("GPU"),
                extra_keys: Some(vec![None; BLOCKS]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention"),
                ..WireBlockStored::default()
            })
        })
        .collect();
    let batch = WireBatch { ts: 1_700_000_000.25, events, data_parallel_rank: Some(0) };
    encode(&batch, Version::LATEST).expect("encodable")
}

fn bench(c: &mut Criterion) {
    let bytes = payload();
    let ctx = DecodeContext::new("Qwen/Qwen3-8B", Unlabeled::Plain);
    let mut g = c.benchmark_group("vllm decode (8 events x 16 blocks x 16 tokens)");
    g.throughput(Throughput::Elements((EVENTS * BLOCKS) as u64));
    g.bench_function("baseline rmpv::decode::read_value", |b| {
        b.iter(|| rmpv::decode::read_value(&mut black_box(bytes.as_slice())).expect("valid"));
    });
    g.bench_function("cortex decode_wire (typed, no hashing)", |b| {
        b.iter(|| decode_wire(black_box(&bytes)).expect("valid"));
    });
    g.bench_function("cortex decode (typed + page hashes)", |b| {
        b.iter(|| decode(black_box(&bytes), &ctx).expect("valid"));
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
