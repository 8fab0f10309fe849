//! Decode throughput in block-stores per second on one core: vLLM 0.33 batches of `BlockStored`
//! events with 16 blocks of 16 tokens each, against `rmpv::decode::read_value` on the same bytes
//! (a generic MessagePack tree, no hashing) measured in the same run
//! ([`cortex_events_core::testing::decode_bench`]).
//!
//! `cargo bench -p cortex-events-vllm --bench decode`

#![allow(missing_docs)] // criterion_group! generates undocumented items

use cortex_events_vllm::{
    DecodeContext, Unlabeled, Version, WireBatch, WireBlockStored, WireEvent, WireHash, decode, decode_wire,
    encode,
};
use std::hint::black_box;

use cortex_events_core::testing::{decode_bench, xorshift};
use criterion::{Criterion, criterion_group, criterion_main};

const EVENTS: usize = 8;
const BLOCKS: usize = 16;
const PAGE: usize = 16;

/// A batch as a busy vLLM 0.33 step publishes it: `EVENTS` stores, each 16 full blocks chained on
/// a parent, realistic token ids (most need a `uint32`), full-size hashes.
fn payload() -> Vec<u8> {
    let mut next = xorshift();
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
    let ctx = DecodeContext::new("Qwen/Qwen3-8B", Unlabeled::Plain);
    decode_bench(
        c,
        "vllm decode (8 events x 16 blocks x 16 tokens)",
        &payload(),
        (EVENTS * BLOCKS) as u64,
        |p| drop(black_box(decode_wire(p).expect("valid"))),
        |p| drop(black_box(decode(p, &ctx).expect("valid"))),
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
