//! The HTTP edge's fuzz targets on stable, in CI: every saved corpus input of `fuzz/corpus/`
//! (`request_facts`, `dp_rank_splice`, `usage_tail`: seeded with real bodies and stream tails)
//! goes through its target's oracle, and so do arbitrary byte strings and mutated, truncated
//! corpus inputs. The oracles are the fuzz targets' own, verbatim.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test-only helpers; a malformed fixture should fail loudly"
)]

use std::path::PathBuf;

use bytes::Bytes;
use cortex_proxy::request::{Prompt, Route, parse, splice_routed_dp_rank};
use cortex_proxy::upstream::find_usage;

/// `fuzz/corpus/<target>`, sorted: the hand-made seeds (`seed-*`), then everything (the seeds
/// and the fuzzer's finds).
fn corpus(target: &str) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let read = |f: &PathBuf| std::fs::read(f).unwrap();
    let seed = |f: &&PathBuf| f.file_name().is_some_and(|n| n.to_string_lossy().starts_with("seed-"));
    (files.iter().filter(seed).map(read).collect(), files.iter().map(read).collect())
}

/// `check` on 2,000 arbitrary byte strings (up to 512 bytes) and 2,000 corpus inputs with a few
/// bytes overwritten and the tail cut, from a fixed seed (the same inputs every run).
fn never_panics(corpus: &[Vec<u8>], check: impl Fn(&[u8])) {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..2000 {
        let len = (next() % 512) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        check(&data);
    }
    for _ in 0..2000 {
        let mut data = corpus[(next() % corpus.len() as u64) as usize].clone();
        if data.is_empty() {
            continue;
        }
        for _ in 0..1 + next() % 8 {
            let i = (next() % data.len() as u64) as usize;
            data[i] = next() as u8;
        }
        let keep = ((next() % (data.len() as u64 + 1)) as usize).max(data.len() / 2);
        data.truncate(keep);
        check(&data);
    }
}

/// `request_facts`: never panics; a token-id prompt's largest id is within `max_token_id`.
fn request_facts(data: &[u8]) -> bool {
    let mut parsed = false;
    for route in [Route::ChatCompletions, Route::Completions, Route::Generate] {
        if let Ok(facts) = parse(route, data) {
            parsed = true;
            if let Prompt::Tokens(ids) = &facts.prompt
                && let Some(&largest) = ids.iter().max()
            {
                assert!(facts.max_token_id.is_some_and(|m| m >= largest), "{facts:?}");
            }
        }
    }
    parsed
}

/// `dp_rank_splice`: never panics; an object without a rank comes out as itself plus the rank.
fn dp_rank_splice(data: &[u8]) -> bool {
    let Some((rank, body)) = data.split_first_chunk::<2>() else { return false };
    let rank = u16::from_le_bytes(*rank);
    let body = Bytes::copy_from_slice(body);
    let out = splice_routed_dp_rank(&body, rank);
    if let Ok(serde_json::Value::Object(mut before)) = serde_json::from_slice::<serde_json::Value>(&body)
        && !before.contains_key("routed_dp_rank")
    {
        let after: serde_json::Value = serde_json::from_slice(&out).expect("a spliced object is JSON");
        before.insert("routed_dp_rank".to_owned(), rank.into());
        assert_eq!(after, serde_json::Value::Object(before));
        return true;
    }
    false
}

/// `usage_tail`: never panics.
fn usage_tail(data: &[u8]) -> bool {
    find_usage(data, true).is_some() | find_usage(data, false).is_some()
}

#[test]
fn request_facts_corpus_and_mutations() {
    let (seeds, inputs) = corpus("request_facts");
    assert!(seeds.len() >= 10 && inputs.len() >= 100, "{} seeds, {} inputs", seeds.len(), inputs.len());
    assert!(seeds.iter().all(|d| request_facts(d)), "every seed parses");
    let parsed = inputs.iter().filter(|d| request_facts(d)).count();
    assert!(parsed >= seeds.len(), "{parsed}");
    never_panics(&inputs, |d| {
        request_facts(d);
    });
}

#[test]
fn dp_rank_splice_corpus_and_mutations() {
    let (seeds, inputs) = corpus("dp_rank_splice");
    assert!(seeds.len() >= 10 && inputs.len() >= 100, "{} seeds, {} inputs", seeds.len(), inputs.len());
    assert!(seeds.iter().all(|d| dp_rank_splice(d)), "every seed is spliced");
    let spliced = inputs.iter().filter(|d| dp_rank_splice(d)).count();
    assert!(spliced >= seeds.len(), "{spliced}");
    never_panics(&inputs, |d| {
        dp_rank_splice(d);
    });
}

#[test]
fn usage_tail_corpus_and_mutations() {
    let (seeds, inputs) = corpus("usage_tail");
    assert!(seeds.len() >= 5 && inputs.len() >= 50, "{} seeds, {} inputs", seeds.len(), inputs.len());
    assert!(seeds.iter().all(|d| usage_tail(d)), "every seed has a usage");
    let found = inputs.iter().filter(|d| usage_tail(d)).count();
    assert!(found >= seeds.len(), "{found}");
    never_panics(&inputs, |d| {
        usage_tail(d);
    });
}
