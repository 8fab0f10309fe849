//! What the event crates' tests and benches share (feature `testing`): the golden captures'
//! payloads, the fuzz corpus, the never-panic properties the fuzz targets' oracle runs under on
//! stable, the ledger's chaining rule, and the decode bench against `rmpv`.
//!
//! Key decision: each engine crate keeps its oracle and its expectations (what a payload must
//! decode to); only the harness around them lives here, so the two crates' tests cannot drift
//! apart in how they read fixtures or how hard they fuzz.

#![allow(clippy::unwrap_used, reason = "test helpers; a malformed fixture should fail loudly")]

use std::collections::HashMap;
use std::path::PathBuf;

use cortex_hash::kv::{BlockStored, EngineHash, KvEvent};
use cortex_hash::{SeqHash, chain};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;

/// The workspace root (fixtures are read from `golden/` and `fuzz/corpus/` under it).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A golden document, `golden/<path>` (for example `vllm/blockpool_golden.json`).
#[must_use]
pub fn golden(path: &str) -> Value {
    let path = root().join("golden").join(path);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// Every non-empty payload frame in a golden document, in document order: the last frame of each
/// `frames_hex` message, and the payload of each replay reply written as a list
/// `["", seq, payload]` (the legacy captures).
#[must_use]
pub fn payloads(doc: &Value) -> Vec<Vec<u8>> {
    fn walk(v: &Value, out: &mut Vec<Vec<u8>>) {
        let mut push = |hex: &str| {
            if !hex.is_empty() {
                out.push(hex::decode(hex).unwrap());
            }
        };
        match v {
            Value::Object(m) => {
                if let Some(frames) = m.get("frames_hex").and_then(Value::as_array) {
                    push(frames.last().and_then(Value::as_str).unwrap());
                }
                m.iter().filter(|(k, _)| *k != "frames_hex").for_each(|(_, x)| walk(x, out));
            }
            Value::Array(a) if a.len() == 3 && a.iter().all(Value::is_string) && a[0] == "" => {
                push(a[2].as_str().unwrap());
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(doc, &mut out);
    out
}

/// The store an event must be.
///
/// # Panics
/// If it is not one.
#[must_use]
pub fn stored(ev: &KvEvent) -> &BlockStored {
    match ev {
        KvEvent::Stored(s) => s,
        other => panic!("expected a store, got {other:?}"),
    }
}

/// What the ledger does with stores: chains each block's content from its parent's `SeqHash` (or
/// the lineage root), keyed by engine hash, so a test can compare the chain a stream builds with
/// the one a gateway computes for the request.
#[derive(Debug, Default)]
pub struct Chains(HashMap<EngineHash, SeqHash>);

impl Chains {
    /// The `SeqHash`es of `s`'s blocks, remembered for later children.
    ///
    /// # Panics
    /// If the store has no lineage or names a parent not applied before.
    pub fn apply(&mut self, s: &BlockStored) -> Vec<SeqHash> {
        let lineage = s.lineage.expect("a known lineage");
        let mut seq = s.parent.map_or(lineage.root, |p| self.0[&p]);
        s.blocks
            .iter()
            .map(|b| {
                seq = chain(seq, b.content);
                self.0.insert(b.engine, seq);
                seq
            })
            .collect()
    }
}

/// Every saved input of the fuzz corpus `fuzz/corpus/<target>`, sorted by file name.
#[must_use]
pub fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = root().join("fuzz/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

/// The fuzz targets' properties on stable: `check` (a target's oracle, which panics when it finds
/// a bug) never panics on 2,000 arbitrary byte strings, nor on 2,000 mutated and truncated inputs
/// of `corpus`.
///
/// # Panics
/// With the smallest failing input, when `check` panics.
pub fn never_panics(corpus: &[Vec<u8>], check: impl Fn(&[u8]) -> bool) {
    let config = || Config { cases: 2000, failure_persistence: None, ..Config::default() };
    TestRunner::new(config())
        .run(&proptest::collection::vec(any::<u8>(), 0..512), |data| {
            check(&data);
            Ok(())
        })
        .unwrap();
    let mutation =
        (any::<Index>(), proptest::collection::vec((any::<Index>(), any::<u8>()), 1..8), any::<Index>());
    TestRunner::new(config())
        .run(&mutation, |(pick, edits, cut)| {
            let mut data = corpus[pick.index(corpus.len())].clone();
            if data.is_empty() {
                return Err(TestCaseError::reject("empty input"));
            }
            for (at, byte) in edits {
                let i = at.index(data.len());
                data[i] = byte;
            }
            let keep = cut.index(data.len() + 1).max(data.len() / 2);
            data.truncate(keep);
            check(&data);
            Ok(())
        })
        .unwrap();
}

/// A deterministic xorshift64 stream, for bench payloads that look random and are the same in
/// every run.
pub fn xorshift() -> impl FnMut() -> u64 {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// The decode bench of one engine: throughput in block-stores per second of `decode_wire` (typed,
/// no hashing) and `decode` (typed + page hashes) on `payload`, which holds `blocks` block-stores,
/// against `rmpv::decode::read_value` on the same bytes (a generic MessagePack tree) in the same
/// run, as criterion group `group`. Each closure decodes its argument and passes the result to
/// [`std::hint::black_box`] (a result borrows the payload, so it cannot be returned).
pub fn decode_bench(
    c: &mut criterion::Criterion,
    group: &str,
    payload: &[u8],
    blocks: u64,
    decode_wire: impl Fn(&[u8]),
    decode: impl Fn(&[u8]),
) {
    use std::hint::black_box;
    let mut g = c.benchmark_group(group);
    g.throughput(criterion::Throughput::Elements(blocks));
    g.bench_function("baseline rmpv::decode::read_value", |b| {
        b.iter(|| rmpv::decode::read_value(&mut black_box(payload)).expect("valid"));
    });
    g.bench_function("cortex decode_wire (typed, no hashing)", |b| {
        b.iter(|| decode_wire(black_box(payload)))
    });
    g.bench_function("cortex decode (typed + page hashes)", |b| b.iter(|| decode(black_box(payload))));
    g.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_panics_catches_an_oracle_that_panics_on_long_or_mutated_input() {
        // Arbitrary inputs reach 300 bytes…
        let long = std::panic::catch_unwind(|| {
            never_panics(&[vec![0; 4]], |d| {
                assert!(d.len() < 300, "a long input");
                true
            });
        });
        assert!(long.is_err(), "inputs of up to 512 bytes were not tried");
        // …and mutations change the corpus inputs.
        let seed = vec![7u8; 64];
        let mutated = std::panic::catch_unwind(|| {
            never_panics(std::slice::from_ref(&seed), |d| {
                assert!(d.len() < 64 || d == seed.as_slice(), "a mutated corpus input");
                true
            });
        });
        assert!(mutated.is_err(), "corpus inputs were never mutated");
    }

    #[test]
    fn every_golden_payload_is_found() {
        // blockpool_golden.json: five steps, each one message.
        assert_eq!(payloads(&golden("vllm/blockpool_golden.json")).len(), 5);
        // The 0.23 capture's replay lists (["", seq, payload]) count too, the end marker does not.
        let legacy = payloads(&golden("vllm/zmq_golden_vllm-0.23.0.json"));
        assert_eq!(legacy.len(), 5);
        assert!(legacy.iter().all(|p| p.first() == Some(&0x93)), "every payload is a batch array");
    }
}
