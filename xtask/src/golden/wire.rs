//! Wire captures (`golden/vllm/*.json`, `golden/sglang/wire_*.json`): every payload the engines'
//! publishers sent decodes, field by field, to the untyped value msgspec recorded for it
//! (`untyped_json` / `payload_untyped_json` for vLLM, `decoded_untyped` for SGLang), and
//! re-encodes to the same bytes in the release's format.
//!
//! Key decision: the comparison goes through the event crates' typed wire values
//! (`WireBatch`), rebuilt here as JSON by field name, so a field the decoder drops, misreads or
//! invents shows up as a difference; the byte comparison then pins what JSON cannot show (integer
//! widths, key order, header forms, omitted fields).

use std::path::Path;

use anyhow::{Context, Result};
use cortex_events_sglang as sglang;
use cortex_events_vllm as vllm;
use serde_json::{Map, Value, json};

use super::{Suite, read_json, short};

/// One captured payload: where it is, its bytes, and msgspec's untyped decode when recorded.
struct Capture {
    case: String,
    payload: Vec<u8>,
    untyped: Option<Value>,
}

/// Every non-empty payload under `v`: the last frame of each `frames_hex` (with the sibling
/// untyped decode named by one of `json_keys`), and bare `["", seq, payload]` replay lists.
fn captures(v: &Value, path: &str, json_keys: &[&str], out: &mut Vec<Capture>) -> Result<()> {
    match v {
        Value::Object(m) => {
            if let Some(frames) = m.get("frames_hex").and_then(Value::as_array) {
                push(out, path, frames, json_keys.iter().find_map(|k| m.get(*k)).cloned())?;
            }
            for (k, x) in m.iter().filter(|(k, _)| *k != "frames_hex") {
                captures(x, &format!("{path}.{k}"), json_keys, out)?;
            }
        }
        Value::Array(a) if a.len() == 3 && a.iter().all(Value::is_string) && a[0] == "" => {
            push(out, path, a, None)?;
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                captures(x, &format!("{path}[{i}]"), json_keys, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn push(out: &mut Vec<Capture>, path: &str, frames: &[Value], untyped: Option<Value>) -> Result<()> {
    let last = frames.last().and_then(Value::as_str).with_context(|| format!("{path}: frames_hex"))?;
    if !last.is_empty() {
        let payload = hex::decode(last).with_context(|| format!("{path}: bad hex"))?;
        out.push(Capture { case: path.trim_start_matches('.').to_owned(), payload, untyped });
    }
    Ok(())
}

/// The first place two JSON values differ, for the failure message.
fn difference(want: &Value, got: &Value, path: &str) -> Option<(String, String)> {
    match (want, got) {
        (Value::Object(a), Value::Object(b)) => {
            for k in a.keys().chain(b.keys()) {
                let (x, y) = (a.get(k).unwrap_or(&Value::Null), b.get(k).unwrap_or(&Value::Null));
                if a.contains_key(k) != b.contains_key(k) {
                    return Some((format!("{path}.{k}: {}", short(x)), format!("{path}.{k}: {}", short(y))));
                }
                if let Some(d) = difference(x, y, &format!("{path}.{k}")) {
                    return Some(d);
                }
            }
            None
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter().zip(b).enumerate().find_map(|(i, (x, y))| difference(x, y, &format!("{path}[{i}]")))
        }
        _ if want == got || same_float(want, got) => None,
        _ => Some((format!("{path}: {}", short(want)), format!("{path}: {}", short(got)))),
    }
}

/// What one engine makes of a payload: its typed decode rebuilt as JSON in the shape of the
/// recorded value (when there is one), and its re-encoding.
type Run = Result<(Option<Value>, Result<Vec<u8>, String>), String>;

/// Floats (timestamps) within one unit in the last place: serde_json's default float parser may
/// round the recorded decimal to a neighbour of the value msgspec wrote. The exact bits are pinned
/// by the byte comparison, which re-encodes the decoded `float64`.
fn same_float(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Number(a), Value::Number(b)) if a.is_f64() && b.is_f64() => {
            let (a, b) = (a.as_f64().unwrap_or(f64::NAN), b.as_f64().unwrap_or(f64::NAN));
            a.is_finite()
                && b.is_finite()
                && a.signum() == b.signum()
                && a.to_bits().abs_diff(b.to_bits()) <= 1
        }
        _ => false,
    }
}

/// Checks one capture: decode → JSON equals the recorded untyped decode; re-encode equals the
/// bytes.
fn check_one(suite: &mut Suite, engine: &str, c: &Capture, run: impl Fn(&[u8], Option<&Value>) -> Run) {
    let (got, encoded) = match run(&c.payload, c.untyped.as_ref()) {
        Ok(r) => r,
        Err(e) => {
            suite.checked += 1;
            suite.fail(
                &format!("{engine} wire decode"),
                c.case.clone(),
                "a batch".into(),
                format!("error: {e}"),
            );
            return;
        }
    };
    if let (Some(want), Some(got)) = (&c.untyped, &got) {
        suite.checked += 1;
        if let Some((w, g)) = difference(want, got, "") {
            suite.fail(&format!("{engine} wire decode"), c.case.clone(), w, g);
        }
    }
    suite.checked += 1;
    match encoded {
        Ok(bytes) if bytes == c.payload => {}
        Ok(bytes) => {
            let at = bytes
                .iter()
                .zip(&c.payload)
                .position(|(a, b)| a != b)
                .unwrap_or(bytes.len().min(c.payload.len()));
            let window = |b: &[u8]| {
                format!("{} bytes, from byte {at}: {}", b.len(), hex::encode(&b[at..b.len().min(at + 24)]))
            };
            suite.fail(
                &format!("{engine} wire re-encode"),
                c.case.clone(),
                window(&c.payload),
                window(&bytes),
            );
        }
        Err(e) => suite.fail(
            &format!("{engine} wire re-encode"),
            c.case.clone(),
            "the captured bytes".into(),
            format!("error: {e}"),
        ),
    }
}

/// Builds an event as JSON in the recorded event's shape: a map (type plus every field that is
/// set, or recorded as nil) or a positional array (tag, then the fields in declaration order,
/// trailing nils beyond the recorded length dropped).
fn event_json(tag: &str, fields: Vec<(&str, Value)>, like: &Value) -> Value {
    if let Some(obj) = like.as_object() {
        let mut m = Map::new();
        m.insert("type".into(), tag.into());
        for (k, v) in fields {
            if !v.is_null() || obj.contains_key(k) {
                m.insert(k.into(), v);
            }
        }
        Value::Object(m)
    } else {
        let mut a: Vec<Value> =
            std::iter::once(Value::from(tag)).chain(fields.into_iter().map(|(_, v)| v)).collect();
        let keep = like.as_array().map_or(a.len(), Vec::len);
        while a.len() > keep && a.last().is_some_and(Value::is_null) {
            a.pop();
        }
        Value::Array(a)
    }
}

fn opt<T: Into<Value>>(v: Option<T>) -> Value {
    v.map_or(Value::Null, Into::into)
}

fn bytes_json(b: &[u8]) -> Value {
    json!({ "bytes_hex": hex::encode(b) })
}

fn batch_json(ts: f64, events: Vec<Value>, rank: Option<Option<u16>>) -> Value {
    let mut a = vec![Value::from(ts), Value::Array(events)];
    if let Some(r) = rank {
        a.push(opt(r));
    }
    Value::Array(a)
}

fn vllm_hash(h: vllm::WireHash<'_>) -> Value {
    match h {
        vllm::WireHash::Uint(v) => v.into(),
        vllm::WireHash::Int(v) => v.into(),
        vllm::WireHash::Bytes(b) => bytes_json(b),
    }
}

fn vllm_json(b: &vllm::WireBatch<'_>, like: &Value) -> Value {
    let likes = like.get(1).and_then(Value::as_array);
    let events = b
        .events
        .iter()
        .enumerate()
        .map(|(i, ev)| {
            let like = likes.and_then(|l| l.get(i)).unwrap_or(&Value::Null);
            let hashes = |hs: &[vllm::WireHash<'_>]| Value::Array(hs.iter().map(|&h| vllm_hash(h)).collect());
            match ev {
                vllm::WireEvent::BlockStored(s) => event_json(
                    "BlockStored",
                    vec![
                        ("block_hashes", hashes(&s.block_hashes)),
                        ("parent_block_hash", s.parent_block_hash.map_or(Value::Null, vllm_hash)),
                        ("token_ids", s.token_ids.clone().into()),
                        ("block_size", s.block_size.into()),
                        ("lora_id", opt(s.lora_id)),
                        ("medium", opt(s.medium)),
                        ("lora_name", opt(s.lora_name)),
                        ("extra_keys", s.extra_keys.as_ref().map_or(Value::Null, |k| vllm_extra_keys(k))),
                        ("group_idx", opt(s.group_idx)),
                        ("kv_cache_spec_kind", opt(s.kv_cache_spec_kind)),
                        ("kv_cache_spec_sliding_window", opt(s.kv_cache_spec_sliding_window)),
                        ("locality", opt(s.locality)),
                        ("ownership", opt(s.ownership)),
                        ("session_id", opt(s.session_id)),
                        ("lookahead_token_ids", opt(s.lookahead_token_ids.clone())),
                    ],
                    like,
                ),
                vllm::WireEvent::BlockRemoved(r) => event_json(
                    "BlockRemoved",
                    vec![
                        ("block_hashes", hashes(&r.block_hashes)),
                        ("medium", opt(r.medium)),
                        ("group_idx", opt(r.group_idx)),
                        ("locality", opt(r.locality)),
                        ("ownership", opt(r.ownership)),
                    ],
                    like,
                ),
                vllm::WireEvent::AllBlocksCleared => event_json("AllBlocksCleared", vec![], like),
            }
        })
        .collect();
    // 0.9.0's batch has no rank element.
    let rank = (like.as_array().map_or(3, Vec::len) >= 3).then_some(b.data_parallel_rank);
    batch_json(b.ts, events, rank)
}

fn vllm_extra_keys(blocks: &[vllm::BlockExtraKeys<'_>]) -> Value {
    Value::Array(
        blocks
            .iter()
            .map(|block| {
                block.as_ref().map_or(Value::Null, |keys| {
                    Value::Array(
                        keys.iter()
                            .map(|k| match *k {
                                vllm::ExtraKey::Str(s) => s.into(),
                                vllm::ExtraKey::Mm { identifier, offset } => json!([identifier, offset]),
                                vllm::ExtraKey::Bytes(b) => bytes_json(b),
                                vllm::ExtraKey::Other(raw) => json!({ "raw_msgpack_hex": hex::encode(raw) }),
                            })
                            .collect(),
                    )
                })
            })
            .collect(),
    )
}

/// vLLM: `blockpool_golden.json` and the DP-rank captures (0.33), the positional capture (0.23).
pub(super) fn vllm(dir: &Path) -> Result<Suite> {
    let mut suite = Suite::new("vllm wire");
    let files = [
        ("blockpool_golden.json", vllm::Version::LATEST),
        ("zmq_golden_dp0.json", vllm::Version::LATEST),
        ("zmq_golden_dp1.json", vllm::Version::LATEST),
        ("zmq_golden_vllm-0.23.0.json", vllm::Version::LAST_ARRAY),
    ];
    for (file, version) in files {
        let doc = read_json(&dir.join("vllm").join(file))?;
        let mut caps = Vec::new();
        captures(&doc, file, &["untyped_json", "payload_untyped_json"], &mut caps)?;
        for c in &caps {
            check_one(&mut suite, "vllm", c, |p, like| {
                let w = vllm::decode_wire(p).map_err(|e| e.to_string())?;
                Ok((like.map(|l| vllm_json(&w, l)), vllm::encode(&w, version).map_err(|e| e.to_string())))
            });
        }
    }
    Ok(suite)
}

fn sglang_json(b: &sglang::WireBatch<'_>, like: &Value) -> Value {
    let likes = like.get(1).and_then(Value::as_array);
    let events = b
        .events
        .iter()
        .enumerate()
        .map(|(i, ev)| {
            let like = likes.and_then(|l| l.get(i)).unwrap_or(&Value::Null);
            match ev {
                sglang::WireEvent::BlockStored(s) => {
                    let tokens = match &s.token_ids {
                        sglang::TokenIds::Flat(t) => t.clone().into(),
                        sglang::TokenIds::Bigram(p) => {
                            Value::Array(p.iter().map(|&[a, b]| json!([a, b])).collect())
                        }
                    };
                    let lora_id = match s.lora_id {
                        None => Value::Null,
                        Some(sglang::LoraId::Int(v)) => v.into(),
                        Some(sglang::LoraId::Str(v)) => v.into(),
                    };
                    let mut fields = vec![
                        ("block_hashes", s.block_hashes.clone().into()),
                        ("parent_block_hash", opt(s.parent_block_hash)),
                        ("token_ids", tokens),
                        ("block_size", s.block_size.into()),
                        ("lora_id", lora_id),
                        ("medium", opt(s.medium)),
                    ];
                    if like.is_array() {
                        // 0.5.19: the salt travels in BlockStoredWithMetadata's eighth element.
                        fields.push((
                            "metadata",
                            s.cache_salt.map_or(Value::Null, |c| json!({ "cache_salt": c })),
                        ));
                        fields.push(("session_id", opt(s.session_id)));
                        fields.push(("lora_name", opt(s.lora_name)));
                    } else {
                        fields.push(("cache_salt", opt(s.cache_salt)));
                        fields.push(("session_id", opt(s.session_id)));
                        fields.push(("lora_name", opt(s.lora_name)));
                    }
                    event_json("BlockStored", fields, like)
                }
                sglang::WireEvent::BlockRemoved(r) => event_json(
                    "BlockRemoved",
                    vec![("block_hashes", r.block_hashes.clone().into()), ("medium", opt(r.medium))],
                    like,
                ),
                sglang::WireEvent::AllBlocksCleared => event_json("AllBlocksCleared", vec![], like),
            }
        })
        .collect();
    batch_json(b.ts, events, Some(b.attn_dp_rank))
}

/// SGLang: the three 0.5.23 captures (maps) and the 0.5.19 capture (positional arrays).
pub(super) fn sglang(dir: &Path) -> Result<Suite> {
    let mut suite = Suite::new("sglang wire");
    let files = [
        ("wire_topic_kv.json", sglang::Encoding::Maps),
        ("wire_topic_empty.json", sglang::Encoding::Maps),
        ("wire_topic_kv_dynamo.json", sglang::Encoding::Maps),
        ("wire_legacy_0.5.19.json", sglang::Encoding::Arrays),
    ];
    for (file, encoding) in files {
        let doc = read_json(&dir.join("sglang").join(file))?;
        let mut caps = Vec::new();
        captures(&doc, file, &["decoded_untyped"], &mut caps)?;
        for c in &caps {
            check_one(&mut suite, "sglang", c, |p, like| {
                let w = sglang::decode_wire(p).map_err(|e| e.to_string())?;
                Ok((
                    like.map(|l| sglang_json(&w, l)),
                    sglang::encode(&w, encoding).map_err(|e| e.to_string()),
                ))
            });
        }
    }
    Ok(suite)
}
