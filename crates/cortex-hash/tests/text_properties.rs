//! Token ids never depend on how Cortex computes them. Segment reuse: for any text made of
//! words, whitespace, unicode and the tokenizer's own special tokens, cached encoding equals
//! plain encoding, with a cold and a warm cache. The fast encoder: on random and adversarial
//! Unicode, the golden chat renders and sampled code points in context, its ids are the
//! `tokenizers` crate's (`cargo xtask fuzz` runs the long version).

#![cfg(feature = "text")]

use std::sync::OnceLock;

use cortex_hash::text::{Encoder, SegmentCache, SpecialTokens, TextTokenizer};
use proptest::prelude::*;

fn tokenizer() -> &'static TextTokenizer {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden/models/qwen3");
        TextTokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer")
    })
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<|endoftext|>".to_owned()),
        Just("<think>".to_owned()),
        Just("\n".to_owned()),
        Just("  ".to_owned()),
        Just("<|im_".to_owned()),
        "[a-zA-Z0-9 ,.!?'\"-]{0,12}",
        "\\PC{0,4}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn cached_equals_plain(pieces in proptest::collection::vec(piece(), 0..24)) {
        let text: String = pieces.concat();
        let tok = tokenizer();
        let plain = tok.encode(&text, SpecialTokens::Omit).unwrap();
        let cache = SegmentCache::new(1 << 14);
        prop_assert_eq!(&tok.encode_cached(&text, &cache).unwrap(), &plain);
        prop_assert_eq!(&tok.encode_cached(&text, &cache).unwrap(), &plain);
    }
}

fn reference() -> &'static tokenizers::Tokenizer {
    static TOK: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden/models/qwen3");
        tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer")
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// ASCII text skips the NFC normalizer (the identity on ASCII): the ids must equal those of
    /// the unmodified tokenizer, with and without special tokens.
    #[test]
    fn ascii_fast_path_equals_the_full_pipeline(text in "([ -~\\t\\n]|<\\|im_start\\|>|<\\|im_end\\|>){0,60}") {
        let tok = tokenizer();
        for (special, add) in [(SpecialTokens::Omit, false), (SpecialTokens::Add, true)] {
            let want = reference().encode_fast(text.as_str(), add).unwrap().get_ids().to_vec();
            prop_assert_eq!(tok.encode(&text, special).unwrap(), want);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cortex's fast encoder against the `tokenizers` crate: the same ids on any text.

/// The reference's ids for `text`.
fn reference_ids(text: &str, add_special_tokens: bool) -> Vec<u32> {
    reference().encode_fast(text, add_special_tokens).expect("reference encode").get_ids().to_vec()
}

/// `Err` with a report when the fast encoder and the reference disagree on `text`.
fn differs(text: &str) -> Result<(), String> {
    let tok = tokenizer();
    for (special, add) in [(SpecialTokens::Omit, false), (SpecialTokens::Add, true)] {
        let fast = tok.encode(text, special).map_err(|e| e.to_string())?;
        let want = reference_ids(text, add);
        if fast != want {
            return Err(format!(
                "text {text:?} (add_special_tokens={add}):\n  fast      {fast:?}\n  tokenizers {want:?}"
            ));
        }
    }
    Ok(())
}

fn assert_fast_encoder() {
    assert_eq!(tokenizer().encoder(), &Encoder::Fast, "Qwen3's tokenizer must use the fast encoder");
}

/// Pieces that stress each part of the pipeline: added tokens (whole and cut), contractions in
/// odd cases (and `ſ`, which `(?i)` folds onto `s`), whitespace runs of every kind, digits of
/// several scripts, combining marks and sequences NFC changes, emoji, CJK, letters of several
/// scripts, punctuation, and arbitrary characters.
fn adversarial_piece() -> impl Strategy<Value = String> {
    const FIXED: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|im_",
        "<think",
        "|>",
        "'s",
        "'S",
        "'ſ",
        "'ll",
        "'LL",
        "'lL",
        "'re",
        "'rE",
        "'Ve",
        "'d",
        "'M",
        "'t",
        "''",
        "'",
        "n't",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\n\n\n",
        " \n ",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        "\u{b}",
        "\u{c}",
        "\u{1680}",
        "\u{202f}",
        "0",
        "7",
        "12",
        "123",
        "12345",
        "١٢٣",
        "१२",
        "½",
        "Ⅻ",
        "²",
        "e\u{301}",
        "\u{301}",
        "\u{327}\u{301}",
        "a\u{308}\u{301}",
        "\u{1100}\u{1161}\u{11a8}",
        "\u{212b}",
        "\u{1e9b}\u{323}",
        "\u{212a}",
        "\u{344}",
        "\u{958}",
        "ﬁ",
        "\u{fb2c}",
        "\u{2126}",
        "o\u{31b}\u{323}",
        "🦙",
        "👨\u{200d}👩\u{200d}👧",
        "🇯🇵",
        "❤\u{fe0f}",
        "中文",
        "日本語",
        "한국어",
        "Ünïcödé",
        "ΑΒΓ",
        "кириллица",
        "עברית",
        "العربية",
        "...",
        "()",
        "{}",
        "\"",
        "`",
        "#",
        "$",
        "€",
        "—",
        "…",
        "<",
        ">",
        "/",
        "\u{0}",
        "\u{7f}",
        "\u{ffff}",
        "\u{10ffff}",
        "\u{e000}",
    ];
    prop_oneof![
        4 => proptest::sample::select(FIXED).prop_map(str::to_owned),
        2 => "[a-zA-Z]{1,9}",
        1 => "[ \t\n\r]{1,5}",
        1 => "[0-9]{1,7}",
        2 => "\\PC{1,6}",
        1 => any::<char>().prop_map(|c| c.to_string()),
    ]
}

fn adversarial_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(adversarial_piece(), 0..40).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    /// The fast encoder gives the `tokenizers` crate's ids, with and without special tokens.
    #[test]
    fn fast_encoder_equals_tokenizers(text in adversarial_text()) {
        assert_fast_encoder();
        differs(&text).map_err(TestCaseError::fail)?;
    }
}

/// The chat renders of the golden conversations (every template's, with Qwen3's tokenizer), the
/// 46 golden tokenizer texts, and very long pieces.
#[test]
fn fast_encoder_equals_tokenizers_on_golden_text() {
    assert_fast_encoder();
    let golden = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden");
    let mut texts: Vec<String> = Vec::new();
    for model in ["qwen3", "qwen25", "llama31"] {
        let path = golden.join(format!("chat-templates/expected_transformers_{model}.json"));
        let renders: Vec<String> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        texts.extend(renders);
    }
    assert!(texts.len() >= 15, "{} renders", texts.len());
    let inp = std::fs::read_to_string(golden.join("tokenizer/ggml-vocab-qwen2.gguf.inp")).unwrap();
    texts.extend(inp.split("\n__ggml_vocab_test__\n").map(str::to_owned));
    let all = texts.concat();
    texts.push(all);
    // Pieces longer than the array-scan BPE takes (the heap path): long words, runs of digits,
    // spaces, newlines and punctuation.
    for long in ["Supercalifragilistic".repeat(20), "Ünïcödéß".repeat(30), "中文".repeat(80), "1".repeat(200)]
    {
        texts.push(format!("{long} {long}"));
    }
    texts.push(format!("{}x{}y{}", " ".repeat(100), "\n".repeat(60), "!?".repeat(70)));
    for text in &texts {
        differs(text).unwrap();
    }
}

/// Code point `c` in the contexts where its class decides a piece boundary.
fn code_point_probe(c: char) -> String {
    format!("a{c}b {c}{c}  {c}\n'{c}1'{c}{c}'{c}ll{c}x{c}\u{301}{c}'s{c}\n\n{c} {c}")
}

/// Every 97th code point (all of them in the long run) in [`code_point_probe`]'s contexts.
#[test]
fn fast_encoder_equals_tokenizers_on_sampled_code_points() {
    assert_fast_encoder();
    for c in (0..=0x10_FFFFu32).step_by(97).filter_map(char::from_u32) {
        differs(&code_point_probe(c)).unwrap();
    }
}

/// The long differential run `cargo xtask fuzz` drives: every code point in context, then random
/// adversarial texts until `CORTEX_FUZZ_SECONDS` (default 60) have passed. Proptest shrinks a
/// failure to a minimal text.
#[test]
#[ignore = "long run (minutes): `cargo xtask fuzz --target tokenizer`"]
fn fast_encoder_long_differential() {
    assert_fast_encoder();
    let secs: u64 = std::env::var("CORTEX_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    for c in (0..=0x10_FFFFu32).filter_map(char::from_u32) {
        differs(&code_point_probe(c)).unwrap();
        if std::time::Instant::now() > deadline {
            println!("stopped the code point sweep at U+{:04X}", c as u32);
            return;
        }
    }
    println!("every code point in context: same ids");
    let mut cases = 0u64;
    while std::time::Instant::now() < deadline {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 2000,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let result = runner.run(&adversarial_text(), |text| differs(&text).map_err(TestCaseError::fail));
        if let Err(e) = result {
            panic!("{e}");
        }
        cases += 2000;
    }
    println!("{cases} random texts: same ids");
}
