//! The decoder and encoder against bytes vLLM's own publisher produced (`golden/vllm/`): every
//! payload re-encodes byte for byte, and what the ledger receives is what a gateway computes for
//! the same request.

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use cortex_events_core::testing::{Chains, golden, payloads, stored};
use cortex_events_vllm::{
    DecodeContext, Unlabeled, Version, WireEvent, WireHash, decode, decode_wire, encode,
};
use cortex_hash::kv::{DpRank, EngineHash, KvEvent, Lineage, Medium};
use cortex_hash::{Engine, Namespace};

const MODEL: &str = "Qwen/Qwen3-8B";
const CTX: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Plain);

/// Every payload of `golden/vllm/<file>`.
fn all(file: &str) -> Vec<Vec<u8>> {
    payloads(&golden(&format!("vllm/{file}")))
}

#[test]
fn every_capture_reencodes_byte_for_byte() {
    let cases = [
        ("blockpool_golden.json", Version::LATEST, 5),
        ("zmq_golden_dp0.json", Version::LATEST, 7),
        ("zmq_golden_dp1.json", Version::LATEST, 7),
        ("zmq_golden_vllm-0.23.0.json", Version::LAST_ARRAY, 5),
    ];
    for (file, version, count) in cases {
        let payloads = all(file);
        assert_eq!(payloads.len(), count, "{file}");
        for p in payloads {
            let wire = decode_wire(&p).unwrap();
            assert_eq!(encode(&wire, version).unwrap(), p, "{file}: {wire:?}");
            decode(&p, &CTX).unwrap();
        }
    }
}

fn blockpool() -> Vec<Vec<u8>> {
    all("blockpool_golden.json")
}

#[test]
fn block_pool_stream_becomes_what_a_gateway_computes() {
    let p = blockpool();
    let ns = Namespace::new(Engine::Vllm, 16, MODEL, None);
    let tokens: Vec<u32> = (1..=48).collect();
    let mut chains = Chains::default();

    // Step 0: request A's first 32 tokens, two blocks from the root.
    let b0 = decode(&p[0], &CTX).unwrap();
    assert_eq!(b0.dp_rank, Some(DpRank(0)));
    assert_eq!(b0.ts, 1_700_000_100.0);
    let s0 = stored(&b0.events[0]);
    assert_eq!(s0.parent, None);
    assert_eq!(s0.medium, Medium::Gpu);
    assert_eq!(s0.lineage, Some(Lineage::new(ns, None)));
    let engines: Vec<u64> = s0.blocks.iter().map(|b| b.engine.to_u64()).collect();
    assert_eq!(engines, [1_403_909_460_543_360_175, 1_643_945_449_041_937_783]);
    assert_eq!(s0.blocks[1].content, ns.block_hash(&tokens[16..32]));
    let mut got = chains.apply(s0);

    // Step 1: decode fills block 3, chained on block 2 by parent hash.
    let s1 = decode(&p[1], &CTX).unwrap();
    let s1 = stored(&s1.events[0]);
    assert_eq!(s1.parent, Some(EngineHash::from_u64(1_643_945_449_041_937_783)));
    got.extend(chains.apply(s1));
    assert_eq!(got, ns.seq_hashes(None, &tokens));

    // Step 2: request B with LoRA "my-lora" and salt "tenant-a" (block 0's extra key).
    let b2 = decode(&p[2], &CTX).unwrap();
    let s2 = stored(&b2.events[0]);
    let lora = Namespace::new(Engine::Vllm, 16, MODEL, Some("my-lora"));
    assert_eq!(s2.lineage, Some(Lineage::new(lora, Some("tenant-a"))));
    assert_eq!(chains.apply(s2), lora.seq_hashes(Some("tenant-a"), &tokens[..32]));

    // Step 3: one BlockRemoved per evicted block; step 4: reset.
    let b3 = decode(&p[3], &CTX).unwrap();
    let removed: Vec<u64> = b3
        .events
        .iter()
        .flat_map(|e| match e {
            KvEvent::Removed(r) => r.blocks.iter().map(|h| h.to_u64()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        removed,
        [
            17_267_691_262_617_277_681,
            1_643_945_449_041_937_783,
            1_403_909_460_543_360_175,
            2_191_850_839_142_165_756
        ]
    );
    assert_eq!(decode(&p[4], &CTX).unwrap().events, vec![KvEvent::AllCleared]);
}

#[test]
fn a_bin_digest_names_the_same_block_as_its_integer_form() {
    let live = all("zmq_golden_dp0.json");
    // seq 4: block 0 of tokens 1..16 published as bin(32).
    let wire = decode_wire(&live[4]).unwrap();
    let WireEvent::BlockStored(s) = &wire.events[0] else { panic!("{wire:?}") };
    assert!(matches!(s.block_hashes[0], WireHash::Bytes(b) if b.len() == 32));
    let batch = decode(&live[4], &CTX).unwrap();
    assert_eq!(stored(&batch.events[0]).blocks[0].engine, EngineHash::from_u64(1_403_909_460_543_360_175));
}

#[test]
fn ranks_and_releases_agree() {
    let dp0 = all("zmq_golden_dp0.json");
    let dp1 = all("zmq_golden_dp1.json");
    for (a, b) in dp0.iter().zip(&dp1) {
        let (a, b) = (decode(a, &CTX).unwrap(), decode(b, &CTX).unwrap());
        assert_eq!((a.dp_rank, b.dp_rank), (Some(DpRank(0)), Some(DpRank(1))));
        assert_eq!(a.events, b.events);
    }
    // 0.23's positional BlockStored of tokens 1..32 normalizes exactly like 0.33's map.
    let legacy = all("zmq_golden_vllm-0.23.0.json");
    let old = decode(&legacy[0], &CTX).unwrap();
    let new = decode(&blockpool()[0], &CTX).unwrap();
    assert_eq!(old.events, new.events);
    let old_removed = decode(&legacy[1], &CTX).unwrap();
    assert_eq!(
        old_removed.events,
        vec![KvEvent::Removed(cortex_hash::kv::BlockRemoved {
            blocks: vec![EngineHash::from_u64(1_643_945_449_041_937_783)],
            medium: Medium::Gpu
        })]
    );
}
