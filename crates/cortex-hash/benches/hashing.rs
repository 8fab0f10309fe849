//! Hashing and tokenization of an 8k-token prompt: Cortex's own identity against the engines'
//! recipes (the baselines, measured in the same run), and Cortex's fast encoder against the
//! `tokenizers` crate (the baseline) on the same text.
//!
//! `cargo bench -p cortex-hash --features text --bench hashing`

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::path::PathBuf;

use cortex_hash::sglang::chain_digests;
use cortex_hash::text::{SpecialTokens, TextTokenizer};
use cortex_hash::vllm::{BlockHasher, ExtraKeyForm, HashAlgo, NoneHashSeed, RequestExtras};
use cortex_hash::{Engine, Namespace};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const PROMPT_TOKENS: usize = 8192;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

/// Real English/markdown text of 8k Qwen3 tokens: copies of a README, cut to the longest prefix
/// (on a character boundary) that tokenizes to at most `PROMPT_TOKENS`.
fn prompt_text(tok: &TextTokenizer) -> String {
    let seed = std::fs::read_to_string(golden().join("sglang/README.md")).expect("golden README");
    let count = |t: &str| tok.encode_reference(t, SpecialTokens::Omit).expect("encode").len();
    let mut text = String::new();
    while count(&text) < PROMPT_TOKENS {
        text.push_str(&seed);
    }
    let (mut lo, mut hi) = (0, text.len());
    while lo < hi {
        let mut mid = (lo + hi).div_ceil(2);
        while !text.is_char_boundary(mid) {
            mid -= 1;
        }
        if mid <= lo {
            break;
        }
        if count(&text[..mid]) <= PROMPT_TOKENS { lo = mid } else { hi = mid - 1 }
    }
    text.truncate(lo);
    let n = count(&text);
    assert!(n <= PROMPT_TOKENS && n + 16 >= PROMPT_TOKENS, "prompt of {n} tokens");
    text
}

fn benches(c: &mut Criterion) {
    let tok = TextTokenizer::from_file(golden().join("models/qwen3/tokenizer.json")).expect("tokenizer");
    let text = prompt_text(&tok);
    let mut tokens = tok.encode_reference(&text, SpecialTokens::Omit).expect("encode");
    assert_eq!(tok.encode(&text, SpecialTokens::Omit).expect("encode"), tokens, "same ids");
    tokens.truncate(PROMPT_TOKENS);

    let mut g = c.benchmark_group("chain_8k_tokens");
    g.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    for bs in [16u32, 64] {
        let ns = Namespace::new(Engine::Sglang, bs, "Qwen/Qwen3-8B", None);
        let mut out = Vec::with_capacity(PROMPT_TOKENS);
        g.bench_with_input(BenchmarkId::new("cortex_xxh3", bs), &bs, |b, _| {
            b.iter(|| {
                out.clear();
                ns.extend_seq_hashes(ns.root(None), black_box(&tokens), &mut out)
            });
        });
        g.bench_with_input(BenchmarkId::new("sglang_sha256", bs), &bs, |b, &bs| {
            b.iter(|| chain_digests(black_box(&tokens), bs as usize, None, false).expect("hash"));
        });
        let vllm = BlockHasher::new(HashAlgo::Sha256Cbor, &NoneHashSeed::Default, ExtraKeyForm::Tagged);
        g.bench_with_input(BenchmarkId::new("vllm_sha256_cbor", bs), &bs, |b, &bs| {
            b.iter(|| {
                vllm.block_hashes(black_box(&tokens), bs as usize, RequestExtras::default()).expect("hash")
            });
        });
    }
    g.finish();

    let mut g = c.benchmark_group("tokenize_8k_tokens");
    g.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    g.sample_size(20);
    g.bench_function("qwen3_tokenizers_crate", |b| {
        b.iter(|| tok.encode_reference(black_box(&text), SpecialTokens::Omit).expect("encode"));
    });
    g.bench_function("qwen3_cortex_fast", |b| {
        b.iter(|| tok.encode(black_box(&text), SpecialTokens::Omit).expect("encode"));
    });
    g.finish();
}

criterion_group!(hashing, benches);
criterion_main!(hashing);
