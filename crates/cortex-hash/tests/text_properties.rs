//! Segment reuse never changes token ids: for any text made of words, whitespace, unicode and
//! the tokenizer's own special tokens, cached encoding equals plain encoding, with a cold and a
//! warm cache.

#![cfg(feature = "text")]

use std::sync::OnceLock;

use cortex_hash::text::{SegmentCache, SpecialTokens, TextTokenizer};
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
