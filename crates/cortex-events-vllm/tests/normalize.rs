//! What the ledger receives for every kind of `BlockStored` vLLM can publish: which stores feed
//! it, which are dropped, and which get an unknown lineage. Each case goes through the bytes
//! (encode as vLLM 0.33, decode).

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use cortex_events_vllm::{
    DecodeContext, ExtraKey, Unlabeled, Version, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent,
    WireHash, decode, encode, engine_hash,
};
use cortex_hash::kv::{BlockStored, EngineHash, KvEvent, Lineage, Medium};
use cortex_hash::{Engine, Namespace};

const MODEL: &str = "m";
const PLAIN: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Plain);

fn store(n: u64) -> WireBlockStored<'static> {
    WireBlockStored {
        block_hashes: (1..=n).map(WireHash::Uint).collect(),
        token_ids: (0..n as u32 * 4).collect(),
        block_size: 4,
        medium: Some("GPU"),
        extra_keys: Some(vec![None; n as usize]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention"),
        ..WireBlockStored::default()
    }
}

fn run(events: Vec<WireEvent<'_>>, ctx: &DecodeContext<'_>) -> Vec<KvEvent> {
    let batch = WireBatch { ts: 2.0, events, data_parallel_rank: Some(0) };
    decode(&encode(&batch, Version::LATEST).unwrap(), ctx).unwrap().events
}

fn stores(events: Vec<WireEvent<'_>>, ctx: &DecodeContext<'_>) -> Vec<BlockStored> {
    run(events, ctx)
        .into_iter()
        .map(|e| match e {
            KvEvent::Stored(s) => s,
            other => panic!("{other:?}"),
        })
        .collect()
}

fn ns() -> Namespace {
    Namespace::new(Engine::Vllm, 4, MODEL, None)
}

#[test]
fn only_full_attention_groups_feed_the_ledger() {
    for (kind, kept) in [
        (None, true),
        (Some("full_attention"), true),
        (Some("mla_attention"), true),
        (Some("sink_full_attention"), true),
        (Some("sliding_window"), false),
        (Some("mamba"), false),
        (Some("chunked_local_attention"), false),
        (Some("unknown"), false),
    ] {
        let s = WireBlockStored { kv_cache_spec_kind: kind, ..store(2) };
        assert_eq!(stores(vec![WireEvent::BlockStored(s)], &PLAIN).len(), usize::from(kept), "{kind:?}");
    }
}

#[test]
fn placeholders_and_unpageable_stores_are_dropped() {
    let placeholder = WireBlockStored { token_ids: vec![], block_size: 0, medium: Some("CPU"), ..store(2) };
    let empty_tokens = WireBlockStored { token_ids: vec![], ..store(2) };
    let zero_size = WireBlockStored { block_size: 0, ..store(2) };
    let short = WireBlockStored { token_ids: (0..7).collect(), ..store(2) };
    let lookahead_mismatch = WireBlockStored { lookahead_token_ids: Some(vec![vec![1]]), ..store(2) };
    for s in [placeholder, empty_tokens, zero_size, short, lookahead_mismatch] {
        assert_eq!(stores(vec![WireEvent::BlockStored(s.clone())], &PLAIN), vec![], "{s:?}");
    }
}

#[test]
fn a_plain_store_pages_its_tokens() {
    let s = stores(vec![WireEvent::BlockStored(store(3))], &PLAIN).remove(0);
    assert_eq!(s.lineage, Some(Lineage::new(ns(), None)));
    let tokens: Vec<u32> = (0..12).collect();
    let contents: Vec<_> = s.blocks.iter().map(|b| b.content).collect();
    assert_eq!(contents, tokens.chunks(4).map(|p| ns().block_hash(p)).collect::<Vec<_>>());
    assert_eq!(s.medium, Medium::Gpu);
}

#[test]
fn multimodal_blocks_split_the_store() {
    let mut s = store(3);
    s.extra_keys = Some(vec![None, Some(vec![ExtraKey::Mm { identifier: "img", offset: 2 }]), None]);
    let out = stores(vec![WireEvent::BlockStored(s)], &PLAIN);
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].blocks.len(), out[0].lineage), (1, Some(Lineage::new(ns(), None))));
    assert_eq!(
        (out[1].parent, out[1].blocks.len(), out[1].lineage),
        (Some(EngineHash::from_u64(1)), 2, None)
    );
    // From the first block on: one store, unknown.
    let mut s = store(2);
    s.extra_keys = Some(vec![Some(vec![ExtraKey::Bytes(&[3; 32])]), None]);
    let out = stores(vec![WireEvent::BlockStored(s)], &PLAIN);
    assert_eq!((out.len(), out[0].lineage), (1, None));
}

#[test]
fn salt_and_adapter_shape_the_lineage() {
    let mut s = store(2);
    s.lora_name = Some("sql");
    s.lora_id = Some(3);
    s.extra_keys = Some(vec![
        Some(vec![ExtraKey::Str("sql"), ExtraKey::Str("tenant")]),
        Some(vec![ExtraKey::Str("sql")]),
    ]);
    let lora = Namespace::new(Engine::Vllm, 4, MODEL, Some("sql"));
    let out = stores(vec![WireEvent::BlockStored(s)], &PLAIN).remove(0);
    assert_eq!(out.lineage, Some(Lineage::new(lora, Some("tenant"))));
    assert_eq!(out.blocks[0].content, lora.block_hash(&[0, 1, 2, 3]));
    // Before 0.14 a LoRA store had only `lora_id`: its namespace is unknown.
    let old = WireBlockStored {
        lora_id: Some(3),
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        ..store(2)
    };
    assert_eq!(stores(vec![WireEvent::BlockStored(old)], &PLAIN)[0].lineage, None);
}

#[test]
fn stores_without_extra_keys_follow_the_context() {
    let s = WireBlockStored { extra_keys: None, ..store(2) };
    let unknown = DecodeContext::new(MODEL, Unlabeled::Unknown);
    assert!(stores(vec![WireEvent::BlockStored(s.clone())], &PLAIN)[0].lineage.is_some());
    assert_eq!(stores(vec![WireEvent::BlockStored(s)], &unknown)[0].lineage, None);
    // With extra_keys present the context does not matter.
    assert!(stores(vec![WireEvent::BlockStored(store(2))], &unknown)[0].lineage.is_some());
}

#[test]
fn lookahead_blocks_hash_their_window() {
    let s = WireBlockStored { lookahead_token_ids: Some(vec![vec![4], vec![8]]), ..store(2) };
    let out = stores(vec![WireEvent::BlockStored(s)], &PLAIN).remove(0);
    assert_eq!(out.blocks[0].content, ns().block_hash(&[0, 1, 2, 3, 4]));
    assert_eq!(out.blocks[1].content, ns().block_hash(&[4, 5, 6, 7, 8]));
    assert_ne!(out.blocks[0].content, ns().block_hash(&[0, 1, 2, 3]));
}

#[test]
fn groups_keep_their_blocks_apart() {
    let group = |g| {
        let mut s = store(1);
        s.group_idx = Some(g);
        s.kv_cache_spec_kind = None;
        stores(vec![WireEvent::BlockStored(s)], &PLAIN).remove(0).blocks[0].engine
    };
    assert_eq!(group(0), EngineHash::from_u64(1));
    assert_ne!(group(1), group(0));
    // A removal in group 1 names group 1's block, not group 0's.
    let rm = WireBlockRemoved {
        block_hashes: vec![WireHash::Uint(1)],
        medium: Some("GPU"),
        group_idx: Some(1),
        ..Default::default()
    };
    let out = run(vec![WireEvent::BlockRemoved(rm)], &PLAIN);
    assert_eq!(
        out,
        vec![KvEvent::Removed(cortex_hash::kv::BlockRemoved { blocks: vec![group(1)], medium: Medium::Gpu })]
    );
    assert_eq!(engine_hash(WireHash::Uint(1), Some(1)), group(1));
}

#[test]
fn media_and_remote_tiers() {
    for (medium, locality, want) in [
        (None, None, Medium::Gpu),
        (Some("CPU"), None, Medium::Cpu),
        (Some("STORAGE"), Some("LOCAL"), Medium::Storage),
        (Some("CPU"), Some("REMOTE"), Medium::External),
        (Some("LMCACHE"), None, Medium::External),
    ] {
        let s = WireBlockStored { medium, locality, ..store(1) };
        assert_eq!(
            stores(vec![WireEvent::BlockStored(s)], &PLAIN)[0].medium,
            want,
            "{medium:?} {locality:?}"
        );
    }
}

#[test]
fn every_release_layout_decodes_to_the_same_events() {
    // The same store written by each release's encoder (fields that release lacks left unset).
    let base = WireBlockStored {
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        medium: None,
        ..store(2)
    };
    let want = stores(vec![WireEvent::BlockStored(base.clone())], &PLAIN);
    for (major, minor, patch) in [
        (0, 9, 0),
        (0, 9, 1),
        (0, 10, 2),
        (0, 14, 0),
        (0, 17, 0),
        (0, 20, 0),
        (0, 23, 0),
        (0, 24, 0),
        (0, 30, 0),
        (0, 33, 0),
    ] {
        let version = Version::new(major, minor, patch);
        let batch = WireBatch {
            ts: 2.0,
            events: vec![WireEvent::BlockStored(base.clone()), WireEvent::AllBlocksCleared],
            data_parallel_rank: None,
        };
        let bytes = encode(&batch, version).unwrap();
        let got = decode(&bytes, &PLAIN).unwrap();
        assert_eq!(
            got.events[..1],
            want[..].iter().cloned().map(KvEvent::Stored).collect::<Vec<_>>()[..],
            "{version}"
        );
        assert_eq!(got.events[1], KvEvent::AllCleared);
    }
}
