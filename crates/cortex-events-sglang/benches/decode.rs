//! Decode throughput in block-stores per second on one core: SGLang 0.5.23 batches of
//! `BlockStored` events with 16 pages of 16 tokens each, against `rmpv::decode::read_value` on the
//! same bytes (a generic MessagePack tree, no hashing) measured in the same run
//! ([`cortex_events_core::testing::decode_bench`]).
//!
//! `cargo bench -p cortex-events-sglang --bench decode`

#![allow(missing_docs)] // criterion_group! generates undocumented items

use cortex_events_sglang::{
    DecodeContext, Encoding, TokenIds, Unlabeled, WireBatch, WireBlockStored, WireEvent, decode, decode_wire,
    encode,
};
use std::hint::black_box;

use cortex_events_core::testing::{decode_bench, xorshift};
use criterion::{Criterion, criterion_group, criterion_main};

const EVENTS: usize = 8;
const BLOCKS: usize = 16;
const PAGE: usize = 16;

/// A batch as a busy SGLang step publishes it: `EVENTS` coalesced stores of 16 pages chained on a
/// parent, realistic token ids, signed 64-bit hashes (half of them negative).
fn payload() -> Vec<u8> {
    let mut next = xorshift();
    let events = (0..EVENTS)
        .map(|_| {
            WireEvent::BlockStored(WireBlockStored {
                block_hashes: (0..BLOCKS).map(|_| next() as i64).collect(),
                parent_block_hash: Some(next() as i64),
                token_ids: TokenIds::Flat((0..BLOCKS * PAGE).map(|_| next() % 151_000).collect()),
                block_size: PAGE as u32,
                medium: Some("GPU"),
                ..WireBlockStored::default()
            })
        })
        .collect();
    let batch = WireBatch { ts: 1_796_018_845.25, events, attn_dp_rank: Some(0) };
    encode(&batch, Encoding::Maps).expect("encodable")
}

fn bench(c: &mut Criterion) {
    let ctx = DecodeContext::new("Qwen/Qwen3-8B", Unlabeled::Plain);
    decode_bench(
        c,
        "sglang decode (8 events x 16 pages x 16 tokens)",
        &payload(),
        (EVENTS * BLOCKS) as u64,
        |p| drop(black_box(decode_wire(p).expect("valid"))),
        |p| drop(black_box(decode(p, &ctx).expect("valid"))),
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
