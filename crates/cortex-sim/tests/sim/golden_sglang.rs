//! Faithfulness, SGLang: the steps SGLang 0.5.23's `UnifiedRadixCache` (Rust TreeCore) and
//! `ZmqEventPublisher` were driven through (`golden/sglang/wire_topic_kv.json`, DP ranks 0 and 1,
//! topic `kv`, page 16) replayed on the simulator's radix cache: every live frame and every replay
//! exchange equals the engine's, timestamps masked. The same for the `dynamo` format capture and
//! for SGLang 0.5.19's positional-array capture.

use cortex_sim::formats::{SglangEncoding, SglangEventFormat};
use cortex_sim::sglang::{RadixCache, RadixKey};
use cortex_sim::{EngineConfig, SglangOptions, SimConfig, SimWorker};
use serde_json::Value;

use crate::support::{TIMEOUT, dealer, golden, mask_ts, recv, replay, sub, unhex};

const LORA_ID: &str = "4f1c2a7e9b3d4c5e8a6f0b1d2c3e4f50";

fn key(tokens: Vec<u32>) -> RadixKey {
    RadixKey { tokens, ..RadixKey::default() }
}

fn range(off: u32, from: u32, to_incl: u32) -> Vec<u32> {
    (from + off..=to_incl + off).collect()
}

/// The harness's steps (see each step's description in the golden files). `legacy` is the 0.5.19
/// capture, which has no LoRA step, no no-op step, no insert after the eviction and no
/// evict-everything step.
fn drive(w: &SimWorker, rank: u16, legacy: bool) {
    let off = 10_000 * u32::from(rank);
    let a = range(off, 100, 139);
    let a_ext: Vec<u32> = a.iter().copied().chain(range(off, 300, 323)).collect();
    let b: Vec<u32> = range(off, 100, 115).into_iter().chain(range(off, 500, 531)).collect();
    let step = |f: &dyn Fn(&mut RadixCache)| w.with_radix_cache(rank, |c| f(c)).expect("sglang");
    step(&|c| {
        c.insert(&key(a.clone()));
    });
    step(&|c| {
        c.insert(&key(a_ext.clone()));
    });
    step(&|c| {
        c.insert(&key(b.clone()));
    });
    step(&|c| {
        c.insert(&RadixKey {
            tokens: range(off, 100, 131),
            cache_salt: Some("tenant-a".to_owned()),
            session_id: Some("sess-42".to_owned()),
            ..RadixKey::default()
        });
    });
    if !legacy {
        step(&|c| {
            c.insert(&RadixKey {
                tokens: range(off, 700, 719),
                extra_key: Some(LORA_ID.to_owned()),
                lora_name: Some("sql-adapter".to_owned()),
                ..RadixKey::default()
            });
        });
        // A step that records nothing publishes nothing.
        step(&|_| {});
    }
    step(&|c| {
        let m = c.match_prefix(&key(b.clone()));
        c.inc_lock_ref(m.node);
        c.evict(48);
        if !legacy {
            c.insert(&key(range(off, 900, 932)));
        }
    });
    if !legacy {
        step(&|c| {
            c.evict(usize::MAX);
        });
    }
    step(&|c| c.reset());
}

fn frames(v: &Value) -> Vec<Vec<u8>> {
    v.as_array().expect("frames").iter().map(|f| unhex(f.as_str().expect("hex"))).collect()
}

/// Frames compared with the payload's timestamp masked.
fn same(got: &[Vec<u8>], want: &[Vec<u8>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: frame count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if w.len() > 10 && w[..2] == [0x93, 0xcb] {
            assert_eq!(hex::encode(mask_ts(g)), hex::encode(mask_ts(w)), "{what}: frame {i} (ts masked)");
        } else {
            assert_eq!(hex::encode(g), hex::encode(w), "{what}: frame {i}");
        }
    }
}

#[test]
fn radix_steps_publish_the_frames_sglang_published_on_both_ranks() {
    let golden = golden("sglang/wire_topic_kv.json");
    let mut cfg = SimConfig::sglang();
    cfg.dp_size = 2;
    cfg.block_size = 16;
    cfg.events.topic = "kv".to_owned();
    let w = SimWorker::start(cfg).expect("worker");
    let ctx = zmq::Context::new();
    let eps = w.event_endpoints();
    assert_eq!(eps[1].publish.port(), eps[0].publish.port() + 1, "rank r publishes on base + r");
    let subs: Vec<zmq::Socket> = eps.iter().map(|e| sub(&ctx, e.publish, b"kv")).collect();
    for r in 0..2 {
        w.wait_subscribed(r, TIMEOUT).expect("subscribed");
    }
    for r in 0..2u16 {
        drive(&w, r, false);
    }
    for (r, g) in golden["ranks"].as_array().expect("ranks").iter().enumerate() {
        let messages = g["messages"].as_array().expect("messages");
        // seq 0 (the start-up AllBlocksCleared) was published before anyone subscribed; the live
        // stream starts at seq 1, and seq 0 is checked through replay below.
        for m in messages.iter().filter(|m| m["seq"] != 0) {
            same(&recv(&subs[r]), &frames(&m["frames_hex"]), &format!("rank {r} live seq {}", m["seq"]));
        }
        let d = dealer(&ctx, eps[r].replay.expect("replay endpoint"));
        let rep = &g["replay"];
        for (name, from) in
            [("dealer_from_0", 0u64), ("dealer_from_middle_seq_3", 3), ("dealer_past_end_seq_1000", 1000)]
        {
            let want = rep[name]["replies"].as_array().expect("replies");
            let got = replay(&d, from);
            assert_eq!(got.len(), want.len(), "rank {r} {name}: reply count");
            for (i, (g, wnt)) in got.iter().zip(want).enumerate() {
                same(g, &frames(&wnt["frames_hex"]), &format!("rank {r} {name} reply {i}"));
            }
        }
        // A DEALER that omits the empty delimiter gets no reply: the next valid request's reply
        // is the first thing that arrives.
        d.send(&3u64.to_be_bytes()[..], 0).expect("send malformed");
        let got = replay(&d, 1000);
        assert_eq!(got.len(), 1, "rank {r}: only the end marker of the valid request");
        same(&got[0], &frames(&rep["dealer_past_end_seq_1000"]["replies"][0]["frames_hex"]), "end marker");
    }
    let st = w.rank_state(1).expect("rank 1");
    assert!(st.subscribed);
    assert_eq!(st.last_seq, Some(8));
    assert!(st.blocks.is_empty(), "reset() left nothing");
    w.shutdown();
}

#[test]
fn dynamo_format_publishes_what_sglang_published() {
    let golden = golden("sglang/wire_topic_kv_dynamo.json");
    let mut cfg = SimConfig::new(EngineConfig::Sglang(SglangOptions {
        format: SglangEventFormat::Dynamo,
        ..SglangOptions::default()
    }));
    cfg.events.topic = "kv".to_owned();
    let w = SimWorker::start(cfg).expect("worker");
    let ctx = zmq::Context::new();
    let ep = w.event_endpoints()[0];
    let s = sub(&ctx, ep.publish, b"kv");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    drive(&w, 0, false);
    let g = &golden["ranks"][0];
    for m in g["messages"].as_array().expect("messages").iter().filter(|m| m["seq"] != 0) {
        same(&recv(&s), &frames(&m["frames_hex"]), &format!("dynamo live seq {}", m["seq"]));
    }
    let d = dealer(&ctx, ep.replay.expect("replay"));
    let want = g["replay"]["dealer_from_0"]["replies"].as_array().expect("replies");
    let got = replay(&d, 0);
    assert_eq!(got.len(), want.len());
    for (i, (g, wnt)) in got.iter().zip(want).enumerate() {
        same(g, &frames(&wnt["frames_hex"]), &format!("dynamo replay {i}"));
    }
    w.shutdown();
}

#[test]
fn legacy_positional_format_publishes_what_sglang_0_5_19_published() {
    let golden = golden("sglang/wire_legacy_0.5.19.json");
    let mut cfg = SimConfig::new(EngineConfig::Sglang(SglangOptions {
        encoding: SglangEncoding::Arrays,
        ..SglangOptions::default()
    }));
    cfg.events.topic = "kv".to_owned();
    let w = SimWorker::start(cfg).expect("worker");
    let ctx = zmq::Context::new();
    let ep = w.event_endpoints()[0];
    let s = sub(&ctx, ep.publish, b"kv");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    drive(&w, 0, true);
    for m in golden["messages"].as_array().expect("messages").iter().filter(|m| m["seq"] != 0) {
        same(&recv(&s), &frames(&m["frames_hex"]), &format!("0.5.19 live seq {}", m["seq"]));
    }
    // 0.5.19 replied without the topic frame.
    let d = dealer(&ctx, ep.replay.expect("replay"));
    let want = golden["replay_dealer_from_seq_4_frames_hex"].as_array().expect("replies");
    let got = replay(&d, 4);
    assert_eq!(got.len(), want.len());
    for (i, (g, wnt)) in got.iter().zip(want).enumerate() {
        same(g, &frames(wnt), &format!("0.5.19 replay {i}"));
    }
    w.shutdown();
}

/// One recorded event as JSON, as `msgspec.to_builtins` prints it in `hash_vectors.json`.
fn event_json(e: &cortex_sim::sglang::RadixEvent) -> Value {
    use cortex_sim::sglang::RadixEvent;
    match e {
        RadixEvent::Stored(s) => {
            let tokens: Vec<Value> = if s.bigram {
                s.units.iter().map(|u| serde_json::json!([u >> 32, u & 0xffff_ffff])).collect()
            } else {
                s.units.iter().map(|u| serde_json::json!(u)).collect()
            };
            let mut v = serde_json::json!({
                "type": "BlockStored", "block_hashes": s.hashes, "parent_block_hash": s.parent,
                "token_ids": tokens, "block_size": s.block_size, "lora_id": null, "medium": "GPU",
            });
            for (k, x) in
                [("cache_salt", &s.cache_salt), ("session_id", &s.session_id), ("lora_name", &s.lora_name)]
            {
                if let Some(x) = x {
                    v[k] = serde_json::json!(x.as_ref());
                }
            }
            v
        }
        RadixEvent::Removed { hashes, .. } => {
            serde_json::json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
        }
        RadixEvent::Cleared => serde_json::json!({"type": "AllBlocksCleared"}),
    }
}

/// The events SGLang's tree recorded for every recipe variant of `hash_vectors.json` (page sizes,
/// salt, registered and unregistered LoRA, `default` and `dynamo` formats, user extra keys, EAGLE
/// bigram pages), recorded by the simulator's tree for the same inserts.
#[test]
fn tree_events_match_sglang_for_every_recipe_variant() {
    let golden = golden("sglang/hash_vectors.json");
    let mut checked = 0;
    for case in golden["events"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let steps = case["steps"].as_array().expect("steps");
        let tokens_of = |s: &Value| -> Option<Vec<u32>> {
            s["tokens"].as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
        };
        // Token ids beyond u32 ("wide" pages) never come out of a tokenizer.
        if steps.iter().any(|s| tokens_of(s).is_none()) {
            continue;
        }
        let format =
            if case["format"] == "dynamo" { SglangEventFormat::Dynamo } else { SglangEventFormat::Default };
        let page = usize::try_from(case["page_size"].as_u64().expect("page")).expect("usize");
        let mut tree = RadixCache::new(page, case["is_eagle_bigram"] == true, format);
        tree.take_events();
        for s in steps {
            tree.insert(&RadixKey {
                tokens: tokens_of(s).expect("u32 tokens"),
                extra_key: case["extra_key"].as_str().map(str::to_owned),
                cache_salt: case["cache_salt"].as_str().map(str::to_owned),
                session_id: None,
                lora_name: case["lora_registered"]["lora_name"].as_str().map(str::to_owned),
            });
            let got: Vec<Value> = tree.take_events().iter().map(event_json).collect();
            assert_eq!(Value::Array(got), s["events"], "{name}: {}", s["op"]);
        }
        checked += 1;
    }
    assert_eq!(checked, 13, "every case but the wide-token one");
}
