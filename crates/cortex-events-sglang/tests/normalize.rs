//! What the ledger receives for every kind of `BlockStored` SGLang can publish. Each case goes
//! through the bytes (encode, decode).

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use cortex_events_sglang::{
    DecodeContext, EncodeError, Encoding, LoraId, TokenIds, Unlabeled, WireBatch, WireBlockStored, WireEvent,
    decode, encode,
};
use cortex_hash::kv::{BlockStored, EngineHash, KvEvent, Lineage, Medium};
use cortex_hash::{Engine, Namespace, chain};

const MODEL: &str = "m";
const PLAIN: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Plain);
const UNKNOWN: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Unknown);

fn store(pages: u64) -> WireBlockStored<'static> {
    WireBlockStored {
        block_hashes: (1..=pages as i64).map(|h| -h).collect(),
        token_ids: TokenIds::Flat((0..pages * 4).collect()),
        block_size: 4,
        medium: Some("GPU"),
        ..WireBlockStored::default()
    }
}

fn stores(s: WireBlockStored<'_>, encoding: Encoding, ctx: &DecodeContext<'_>) -> Vec<BlockStored> {
    let batch = WireBatch { ts: 2.0, events: vec![WireEvent::BlockStored(s)], attn_dp_rank: Some(0) };
    decode(&encode(&batch, encoding).unwrap(), ctx)
        .unwrap()
        .events
        .into_iter()
        .map(|e| match e {
            KvEvent::Stored(s) => s,
            other => panic!("{other:?}"),
        })
        .collect()
}

fn one(s: WireBlockStored<'_>, ctx: &DecodeContext<'_>) -> Option<BlockStored> {
    let mut v = stores(s, Encoding::Maps, ctx);
    assert!(v.len() <= 1);
    v.pop()
}

fn ns() -> Namespace {
    Namespace::new(Engine::Sglang, 4, MODEL, None)
}

#[test]
fn signed_hashes_name_blocks_and_pages_are_rehashed() {
    let s = one(store(2), &PLAIN).unwrap();
    assert_eq!(s.blocks[0].engine, EngineHash::from_i64(-1));
    assert_eq!(s.blocks[1].content, ns().block_hash(&[4, 5, 6, 7]));
    assert_eq!(s.lineage, Some(Lineage::new(ns(), None)));
}

#[test]
fn bigram_pages_hash_the_window_the_gateway_hashes() {
    // 13 tokens = 12 pairs = 3 pages of 4 pairs.
    let tokens: Vec<u32> = (100..113).collect();
    let pairs: Vec<[u64; 2]> = tokens.windows(2).map(|w| [u64::from(w[0]), u64::from(w[1])]).collect();
    let s = WireBlockStored { token_ids: TokenIds::Bigram(pairs.clone()), ..store(3) };
    let got = one(s, &PLAIN).unwrap();
    let mut seq = got.lineage.unwrap().root;
    let chained: Vec<_> = got
        .blocks
        .iter()
        .map(|b| {
            seq = chain(seq, b.content);
            seq
        })
        .collect();
    assert_eq!(chained, ns().bigram_seq_hashes(None, &tokens));
    assert_eq!(got.blocks[0].content, ns().block_hash(&tokens[..5]));
    // Bigram and plain pages of the same tokens never share an identity.
    assert_ne!(got.blocks[0].content, ns().block_hash(&tokens[..4]));
    // Pairs that do not overlap are not a bigram sequence: dropped.
    let mut broken = pairs;
    broken[6] = [1, 107];
    assert_eq!(one(WireBlockStored { token_ids: TokenIds::Bigram(broken), ..store(3) }, &PLAIN), None);
}

#[test]
fn unnamed_stores_follow_the_context() {
    assert!(one(store(1), &PLAIN).unwrap().lineage.is_some());
    assert_eq!(one(store(1), &UNKNOWN).unwrap().lineage, None);
    let named = WireBlockStored { lora_name: Some("sql-adapter"), ..store(1) };
    let lora = Namespace::new(Engine::Sglang, 4, MODEL, Some("sql-adapter"));
    assert_eq!(one(named, &UNKNOWN).unwrap().lineage, Some(Lineage::new(lora, None)));
    // An adapter id without a name is never the base model.
    let id_only = WireBlockStored { lora_id: Some(LoraId::Int(3)), ..store(1) };
    assert_eq!(one(id_only, &PLAIN).unwrap().lineage, None);
}

#[test]
fn unpageable_stores_are_dropped() {
    let wide = WireBlockStored { token_ids: TokenIds::Flat(vec![1, 2, 3, 1 << 32]), ..store(1) };
    let short = WireBlockStored { token_ids: TokenIds::Flat(vec![1, 2, 3]), ..store(1) };
    let zero = WireBlockStored { block_size: 0, ..store(1) };
    let none = WireBlockStored { block_hashes: vec![], token_ids: TokenIds::Flat(vec![]), ..store(1) };
    for s in [wide, short, zero, none] {
        assert_eq!(one(s.clone(), &PLAIN), None, "{s:?}");
    }
}

#[test]
fn media() {
    for (medium, want) in [
        (None, Medium::Gpu),
        (Some("GPU"), Medium::Gpu),
        (Some("CPU_PINNED"), Medium::Cpu),
        (Some("DISK"), Medium::Storage),
        (Some("EXTERNAL"), Medium::External),
    ] {
        assert_eq!(one(WireBlockStored { medium, ..store(1) }, &PLAIN).unwrap().medium, want);
    }
}

#[test]
fn both_encodings_carry_the_salt() {
    let salted = WireBlockStored { cache_salt: Some("tenant-a"), ..store(2) };
    let maps = stores(salted.clone(), Encoding::Maps, &PLAIN);
    let arrays = stores(salted, Encoding::Arrays, &PLAIN);
    assert_eq!(maps, arrays);
    assert_eq!(maps[0].lineage, Some(Lineage::new(ns(), Some("tenant-a"))));
    // Arrays cannot carry a session or an adapter name.
    let batch = |s| WireBatch { ts: 0.0, events: vec![WireEvent::BlockStored(s)], attn_dp_rank: None };
    assert_eq!(
        encode(&batch(WireBlockStored { session_id: Some("s"), ..store(1) }), Encoding::Arrays),
        Err(EncodeError::FieldNotInFormat { field: "session_id" })
    );
    assert_eq!(
        encode(&batch(WireBlockStored { lora_name: Some("a"), ..store(1) }), Encoding::Arrays),
        Err(EncodeError::FieldNotInFormat { field: "lora_name" })
    );
}
