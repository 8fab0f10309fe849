//! The decoder and encoder against bytes and events SGLang's own code produced
//! (`golden/sglang/`): every payload re-encodes byte for byte, and what the ledger receives is what
//! a gateway computes for the same request, bigram pages and unregistered adapters included.

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use cortex_events_core::testing::{Chains, golden, payloads, stored};
use cortex_events_sglang::{
    DecodeContext, Encoding, TokenIds, Unlabeled, WireBatch, WireBlockStored, WireEvent, decode, decode_wire,
    encode,
};
use cortex_hash::kv::{BlockStored, DpRank, KvEvent, Lineage, Medium};
use cortex_hash::{Engine, Namespace};
use serde_json::Value;

const MODEL: &str = "Qwen/Qwen3-8B";
const PLAIN: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Plain);
const UNKNOWN: DecodeContext<'static> = DecodeContext::new(MODEL, Unlabeled::Unknown);

/// Every payload of `golden/sglang/<file>`.
fn all(file: &str) -> Vec<Vec<u8>> {
    payloads(&golden(&format!("sglang/{file}")))
}

#[test]
fn every_capture_reencodes_byte_for_byte() {
    for (file, encoding) in [
        ("wire_topic_kv.json", Encoding::Maps),
        ("wire_topic_empty.json", Encoding::Maps),
        ("wire_topic_kv_dynamo.json", Encoding::Maps),
        ("wire_legacy_0.5.19.json", Encoding::Arrays),
    ] {
        let payloads = all(file);
        assert!(payloads.len() >= 9, "{file}: {}", payloads.len());
        for p in payloads {
            let wire = decode_wire(&p).unwrap();
            assert_eq!(encode(&wire, encoding).unwrap(), p, "{file}: {wire:?}");
            decode(&p, &PLAIN).unwrap();
        }
    }
}

fn live(file: &str, rank: usize) -> Vec<Vec<u8>> {
    let doc = golden(&format!("sglang/{file}"));
    doc["ranks"][rank]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| hex::decode(m["frames_hex"][2].as_str().unwrap()).unwrap())
        .collect()
}

#[test]
fn live_stream_carries_salt_lora_and_ranks() {
    let ns = Namespace::new(Engine::Sglang, 16, MODEL, None);
    for rank in [0, 1] {
        let msgs = live("wire_topic_kv.json", rank);
        let batches: Vec<_> = msgs.iter().map(|p| decode(p, &PLAIN).unwrap()).collect();
        assert!(batches.iter().all(|b| b.dp_rank == Some(DpRank(rank as u16))));
        assert_eq!(batches[0].events, vec![KvEvent::AllCleared]);
        assert_eq!(batches[8].events, vec![KvEvent::AllCleared]);
        // seq 4: cache_salt seeds the root.
        assert_eq!(stored(&batches[4].events[0]).lineage, Some(Lineage::new(ns, Some("tenant-a"))));
        // seq 5: a registered adapter has its own namespace.
        let lora = Namespace::new(Engine::Sglang, 16, MODEL, Some("sql-adapter"));
        assert_eq!(stored(&batches[5].events[0]).lineage, Some(Lineage::new(lora, None)));
        // seq 6: a removal and a store in one batch; seq 7: three removals.
        assert!(matches!(batches[6].events[..], [KvEvent::Removed(_), KvEvent::Stored(_)]));
        assert!(
            batches[7].events.iter().all(|e| matches!(e, KvEvent::Removed(r) if r.medium == Medium::Gpu))
        );
    }
    // The salted store of 0.5.19 (BlockStoredWithMetadata) carries the same salt.
    let legacy = all("wire_legacy_0.5.19.json");
    let wire = decode_wire(&legacy[4]).unwrap();
    let WireEvent::BlockStored(s) = &wire.events[0] else { panic!("{wire:?}") };
    assert_eq!(s.cache_salt, Some("tenant-a"));
    assert_eq!(
        stored(&decode(&legacy[4], &PLAIN).unwrap().events[0]).lineage,
        Some(Lineage::new(ns, Some("tenant-a")))
    );
}

/// A recorded `hash_vectors.json` event as a wire store (these were captured as Python values,
/// not bytes: they go through the encoder, then the decoder).
fn wire_store(ev: &Value) -> WireBlockStored<'_> {
    let ints = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect::<Vec<_>>();
    let tokens = ev["token_ids"].as_array().unwrap();
    let token_ids = if tokens.first().is_some_and(Value::is_array) {
        TokenIds::Bigram(tokens.iter().map(|p| [p[0].as_u64().unwrap(), p[1].as_u64().unwrap()]).collect())
    } else {
        TokenIds::Flat(tokens.iter().map(|t| t.as_u64().unwrap()).collect())
    };
    WireBlockStored {
        block_hashes: ints(&ev["block_hashes"]),
        parent_block_hash: ev["parent_block_hash"].as_i64(),
        token_ids,
        block_size: ev["block_size"].as_u64().unwrap() as u32,
        lora_id: None,
        medium: ev["medium"].as_str(),
        cache_salt: ev.get("cache_salt").and_then(Value::as_str),
        session_id: ev.get("session_id").and_then(Value::as_str),
        lora_name: ev.get("lora_name").and_then(Value::as_str),
    }
}

fn roundtrip(store: WireBlockStored<'_>, ctx: &DecodeContext<'_>) -> BlockStored {
    let batch = WireBatch { ts: 1.5, events: vec![WireEvent::BlockStored(store)], attn_dp_rank: Some(0) };
    let bytes = encode(&batch, Encoding::Maps).unwrap();
    let mut out = decode(&bytes, ctx).unwrap();
    assert_eq!(out.events.len(), 1);
    match out.events.remove(0) {
        KvEvent::Stored(s) => s,
        other => panic!("{other:?}"),
    }
}

#[test]
fn recorded_tree_cache_events_match_the_request_side() {
    let doc = golden("sglang/hash_vectors.json");
    let (mut checked, mut bigram_checked) = (0, 0);
    for case in doc["events"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let page = case["page_size"].as_u64().unwrap() as u32;
        let salt = case["cache_salt"].as_str();
        let lora = case["lora_registered"].get("lora_name").and_then(Value::as_str);
        let bigram = case["is_eagle_bigram"].as_bool().unwrap();
        let ns = Namespace::new(Engine::Sglang, page, MODEL, lora);
        let mut chains = Chains::default();
        for step in case["steps"].as_array().unwrap() {
            let tokens: Vec<u32> = step["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|t| t.as_u64()?.try_into().ok())
                .collect();
            if tokens.len() != step["tokens"].as_array().unwrap().len() {
                continue; // wide tokens: no tokenizer produces them for a request
            }
            let want =
                if bigram { ns.bigram_seq_hashes(salt, &tokens) } else { ns.seq_hashes(salt, &tokens) };
            let mut got = Vec::new();
            for ev in step["events"].as_array().unwrap() {
                let wire = wire_store(ev);
                let unlabeled = wire.lora_name.is_none() && case["extra_key"].is_string();
                let s = roundtrip(wire.clone(), &PLAIN);
                if unlabeled {
                    // An unregistered adapter or extra key: unknown namespace when the operator
                    // says such traffic exists, never the base model's lineage then.
                    assert_eq!(roundtrip(wire, &UNKNOWN).lineage, None, "{name}");
                    continue;
                }
                got.extend(chains.apply(&s));
                checked += 1;
                bigram_checked += usize::from(bigram);
            }
            // A step's stores are the request's last pages (an extension stores only new ones).
            assert!(got.len() <= want.len(), "{name}");
            assert_eq!(got, want[want.len() - got.len()..], "{name}");
        }
    }
    assert!(checked >= 20, "{checked}");
    assert_eq!(bigram_checked, 2);
}

#[test]
fn an_unregistered_adapter_publishes_the_base_models_hashes() {
    // Why `Unlabeled` exists: same tokens, same hashes, no lora_name.
    let doc = golden("sglang/hash_vectors.json");
    let case = |n: &str| doc["events"].as_array().unwrap().iter().find(|c| c["name"] == n).unwrap().clone();
    let plain = case("plain_p16");
    let unreg = case("lora_unregistered_default_p16");
    let first = |c: &Value| c["steps"][0]["events"][0].clone();
    assert_eq!(first(&plain)["block_hashes"], first(&unreg)["block_hashes"]);
    let (p, u) = (first(&plain), first(&unreg));
    assert_eq!(roundtrip(wire_store(&p), &PLAIN).blocks, roundtrip(wire_store(&u), &PLAIN).blocks);
    assert!(roundtrip(wire_store(&u), &UNKNOWN).lineage.is_none());
    // A named adapter is known either way.
    let named = first(&case("lora_registered_default_p16"));
    assert!(roundtrip(wire_store(&named), &UNKNOWN).lineage.is_some());
}
