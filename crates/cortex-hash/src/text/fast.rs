//! Cortex's own encoder for the byte-level BPE tokenizers of Qwen2/Qwen3 (and the Llama 3
//! pre-tokenizer pattern): the same token ids as the `tokenizers` crate, several times faster.
//!
//! The `tokenizers` crate runs a general pipeline: it tracks the alignment of every normalized
//! byte to the input, runs Oniguruma for the pre-tokenizer, keeps a string and offsets per
//! token. For one family of `tokenizer.json` the result is a short computation: split the text at
//! the added tokens (leftmost-longest, as `tokenizers`' Aho-Corasick does), NFC-normalize each
//! piece in between (only when a quick check says it may change), cut it with the pattern's state
//! machine ([`super::pretok`]), and BPE each piece on raw bytes ([`super::bpe`]).
//!
//! Key decision: support is decided strictly from the file. [`FastTokenizer::new`] reads
//! `tokenizer.json` and accepts only what this module implements exactly — NFC or no normalizer,
//! the two known `Split` patterns followed by a regex-free `ByteLevel`, a BPE model without
//! dropout, byte fallback or subword affixes that covers every byte, added tokens without
//! strip/word/normalization options, a post-processor that adds nothing, no truncation or
//! padding — and names the first thing it does not; a tokenizer it refuses is encoded by the
//! `tokenizers` crate, and the refusal is visible (`TextTokenizer::encoder`).

use std::borrow::Cow;
use std::collections::HashMap;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::Value;

use super::Splitters;
use super::bpe::Bpe;
use super::pretok::{self, Digits};
use crate::Token;

/// Why a tokenizer is encoded by the `tokenizers` crate rather than Cortex's fast path: the part
/// of `tokenizer.json` the fast path does not implement, and what it found there.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{part}: {found}")]
pub struct Unsupported {
    /// The part of `tokenizer.json` (`normalizer`, `pre_tokenizer`, `model`, ...).
    pub part: &'static str,
    /// What it holds that the fast path does not implement.
    pub found: String,
}

fn unsupported(part: &'static str, found: impl Into<String>) -> Unsupported {
    Unsupported { part, found: found.into() }
}

/// The parts of `tokenizer.json` the decision reads. The model is read with borrowed strings
/// (an 11 MB file for Qwen3); everything else is small.
#[derive(Deserialize)]
struct File<'a> {
    #[serde(default)]
    truncation: Value,
    #[serde(default)]
    padding: Value,
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
    #[serde(default)]
    post_processor: Value,
    #[serde(borrow)]
    model: Model<'a>,
}

#[derive(Deserialize)]
struct Model<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(borrow, default)]
    vocab: HashMap<Text<'a>, Token>,
    #[serde(borrow, default)]
    merges: Vec<MergeEntry<'a>>,
}

/// A string borrowed from the file when it has no escapes (serde's own `Cow` always copies
/// inside collections; 300,000 copies were a third of the load).
#[derive(PartialEq, Eq, Hash)]
struct Text<'a>(Cow<'a, str>);

impl std::borrow::Borrow<str> for Text<'_> {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// The two tokens of a merge written `"a b"` (split on its only space, as `tokenizers` does).
fn halves<E: de::Error>(s: &str) -> Result<(&str, &str), E> {
    let mut parts = s.split(' ');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(a), Some(b), None) => Ok((a, b)),
        _ => Err(E::custom(format!("merge {s:?} is not two tokens"))),
    }
}

/// A merge as `tokenizer.json` writes it: `"a b"` (older files) or `["a", "b"]`.
struct MergeEntry<'a>(Cow<'a, str>, Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for MergeEntry<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MergeEntry<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a merge: \"a b\" or [\"a\", \"b\"]")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                let (a, b) = halves(s)?;
                Ok(MergeEntry(Cow::Borrowed(a), Cow::Borrowed(b)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                let (a, b) = halves(s)?;
                Ok(MergeEntry(Cow::Owned(a.to_owned()), Cow::Owned(b.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let a: Text<'de> = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let b: Text<'de> = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(MergeEntry(a.0, b.0))
            }
        }
        d.deserialize_any(V)
    }
}

/// Cortex's encoder for a supported `tokenizer.json`.
pub(super) struct FastTokenizer {
    /// Every added token (special or not), which `tokenizers` extracts before anything else.
    added: Splitters,
    nfc: bool,
    digits: Digits,
    bpe: Bpe,
}

/// `value` is an object whose keys are all in `allowed` and whose `type` is `kind`.
fn is_object_of(value: &Value, kind: &str, allowed: &[&str]) -> bool {
    value.as_object().is_some_and(|o| {
        o.get("type").and_then(Value::as_str) == Some(kind)
            && o.keys().all(|k| k == "type" || allowed.contains(&k.as_str()))
    })
}

fn type_name(value: &Value) -> String {
    match value.get("type").and_then(Value::as_str) {
        Some(t) => format!("{t} ({value})").chars().take(200).collect(),
        None => value.to_string().chars().take(200).collect(),
    }
}

/// A `ByteLevel` step without its regex and without a prefix space (offsets trimming changes
/// offsets only, never ids).
fn is_plain_byte_level(value: &Value) -> bool {
    is_object_of(value, "ByteLevel", &["add_prefix_space", "trim_offsets", "use_regex"])
        && value.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
        && value.get("use_regex").and_then(Value::as_bool) == Some(false)
}

fn pre_tokenizer(value: &Value) -> Result<Digits, Unsupported> {
    let steps = value
        .as_object()
        .filter(|_| is_object_of(value, "Sequence", &["pretokenizers"]))
        .and_then(|o| o.get("pretokenizers"))
        .and_then(Value::as_array)
        .ok_or_else(|| unsupported("pre_tokenizer", type_name(value)))?;
    let [split, byte_level] = steps.as_slice() else {
        return Err(unsupported("pre_tokenizer", format!("a Sequence of {} steps", steps.len())));
    };
    let pattern = split
        .get("pattern")
        .and_then(|p| p.as_object())
        .filter(|p| p.len() == 1)
        .and_then(|p| p.get("Regex"))
        .and_then(Value::as_str);
    let digits = match pattern {
        Some(p) if is_object_of(split, "Split", &["pattern", "behavior", "invert"]) => Digits::for_pattern(p)
            .ok_or_else(|| unsupported("pre_tokenizer", format!("Split pattern {p:?}")))?,
        _ => return Err(unsupported("pre_tokenizer", type_name(split))),
    };
    if split.get("behavior").and_then(Value::as_str) != Some("Isolated")
        || split.get("invert").and_then(Value::as_bool) != Some(false)
    {
        return Err(unsupported("pre_tokenizer", type_name(split)));
    }
    if !is_plain_byte_level(byte_level) {
        return Err(unsupported("pre_tokenizer", type_name(byte_level)));
    }
    Ok(digits)
}

/// A post-processor that adds no token with `add_special_tokens`: none, or `ByteLevel` steps.
fn post_processor(value: &Value) -> Result<(), Unsupported> {
    let adds_nothing = value.is_null()
        || is_plain_byte_level_post(value)
        || (is_object_of(value, "Sequence", &["processors"])
            && value
                .get("processors")
                .and_then(Value::as_array)
                .is_some_and(|steps| steps.iter().all(is_plain_byte_level_post)));
    if adds_nothing { Ok(()) } else { Err(unsupported("post_processor", type_name(value))) }
}

fn is_plain_byte_level_post(value: &Value) -> bool {
    is_object_of(value, "ByteLevel", &["add_prefix_space", "trim_offsets", "use_regex"])
}

impl FastTokenizer {
    /// The fast encoder for `json` (the bytes `reference` was loaded from), or what it does not
    /// implement.
    ///
    /// # Errors
    /// [`Unsupported`], naming the first part of the file the fast path does not implement.
    pub(super) fn new(json: &[u8], reference: &tokenizers::Tokenizer) -> Result<FastTokenizer, Unsupported> {
        let file: File<'_> =
            serde_json::from_slice(json).map_err(|e| unsupported("tokenizer.json", e.to_string()))?;
        if !file.truncation.is_null() {
            return Err(unsupported("truncation", file.truncation.to_string()));
        }
        if !file.padding.is_null() {
            return Err(unsupported("padding", file.padding.to_string()));
        }
        let nfc = match &file.normalizer {
            Value::Null => false,
            v if is_object_of(v, "NFC", &[]) => true,
            v => return Err(unsupported("normalizer", type_name(v))),
        };
        let digits = pre_tokenizer(&file.pre_tokenizer)?;
        post_processor(&file.post_processor)?;
        let m = &file.model;
        if m.kind.as_deref() != Some("BPE") {
            return Err(unsupported("model", format!("type {:?}", m.kind)));
        }
        if m.dropout.is_some_and(|d| d != 0.0) {
            return Err(unsupported("model", "dropout"));
        }
        if m.byte_fallback {
            return Err(unsupported("model", "byte_fallback"));
        }
        if m.continuing_subword_prefix.as_deref().is_some_and(|p| !p.is_empty())
            || m.end_of_word_suffix.as_deref().is_some_and(|s| !s.is_empty())
        {
            return Err(unsupported("model", "a continuing_subword_prefix or end_of_word_suffix"));
        }
        if reference.get_encode_special_tokens() {
            return Err(unsupported("added_tokens", "encode_special_tokens is set"));
        }
        // The ids `tokenizers` assigned (it may differ from the file's `id` fields).
        let mut added = Vec::new();
        for (id, t) in reference.get_added_tokens_decoder() {
            if t.lstrip || t.rstrip || t.single_word || t.normalized {
                return Err(unsupported(
                    "added_tokens",
                    format!("{:?} has lstrip, rstrip, single_word or normalized set", t.content),
                ));
            }
            if !t.content.is_empty() {
                added.push((t.content, id));
            }
        }
        let merges: Vec<(&str, &str)> = m.merges.iter().map(|e| (&*e.0, &*e.1)).collect();
        let bpe = Bpe::new(m.vocab.iter().map(|(s, &id)| (&*s.0, id)), &merges, m.ignore_merges)
            .map_err(|e| unsupported("model", e.to_string()))?;
        Ok(FastTokenizer { added: Splitters::new(added), nfc, digits, bpe })
    }

    /// Appends the token ids of `text` to `out` (what `tokenizers` gives with or without
    /// `add_special_tokens`: this post-processor adds nothing).
    pub(super) fn encode(&self, text: &str, out: &mut Vec<Token>) {
        for seg in self.added.segments(text) {
            match seg {
                super::Segment::Special(id) => out.push(id),
                super::Segment::Text(piece) => self.encode_plain(piece, out),
            }
        }
    }

    /// Text with no added token in it.
    fn encode_plain(&self, text: &str, out: &mut Vec<Token>) {
        let text = if self.nfc { nfc(text) } else { Cow::Borrowed(text) };
        pretok::for_each_piece(&text, self.digits, |piece| self.bpe.encode_piece(piece, out));
    }
}

/// `text` in NFC, exactly as `tokenizers`' NFC normalizer computes it (with the same
/// `unicode-normalization-alignments` tables), borrowed when a quick check proves it unchanged.
/// Characters below U+0300 are all starters that are allowed in NFC (a test checks it), so the
/// check starts at the first byte that can begin a later character.
pub(super) fn nfc(text: &str) -> Cow<'_, str> {
    use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};
    let Some(first) = text.bytes().position(|b| b >= 0xCC) else { return Cow::Borrowed(text) };
    if is_nfc_quick(text[first..].chars()) == IsNormalized::Yes {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(text.nfc().map(|(c, _)| c).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{Encoder, SpecialTokens, TextTokenizer};
    use serde_json::json;
    use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

    /// Qwen3's `tokenizer.json` cut to its first 3,000 merges (and the tokens they make), so that
    /// variants load in milliseconds.
    fn small_qwen() -> &'static Value {
        static FILE: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
        FILE.get_or_init(|| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../golden/models/qwen3/tokenizer.json");
            let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
            let keep = 3000;
            let model = v["model"].as_object_mut().unwrap();
            let merges: Vec<Value> = model["merges"].as_array().unwrap()[..keep].to_vec();
            model["merges"] = Value::Array(merges);
            let vocab = model["vocab"].as_object().unwrap();
            let vocab: serde_json::Map<String, Value> = vocab
                .iter()
                .filter(|(_, id)| id.as_u64().unwrap() < 256 + keep as u64)
                .map(|(k, id)| (k.clone(), id.clone()))
                .collect();
            model["vocab"] = Value::Object(vocab);
            v
        })
    }

    fn load(edit: impl FnOnce(&mut Value)) -> TextTokenizer {
        let mut v = small_qwen().clone();
        edit(&mut v);
        TextTokenizer::from_bytes(&serde_json::to_vec(&v).unwrap()).unwrap()
    }

    const TEXTS: &[&str] = &[
        "Hello world, it's 12345 ",
        "e\u{301}t\u{e9} Å Ω \u{212b}",
        "  spaces\t\n\n  x<|im_start|>y<think>z",
        "DON'T we'LL 'ſſ 中文 🦙",
        "1234567 a1b22c333",
    ];

    /// The fast encoder is used and gives the reference's ids on [`TEXTS`].
    fn assert_fast_equals_reference(tok: &TextTokenizer) {
        assert_eq!(tok.encoder(), &Encoder::Fast);
        for text in TEXTS {
            for special in [SpecialTokens::Omit, SpecialTokens::Add] {
                assert_eq!(
                    tok.encode(text, special).unwrap(),
                    tok.encode_reference(text, special).unwrap(),
                    "{text:?}"
                );
            }
        }
    }

    fn refused(tok: &TextTokenizer) -> &'static str {
        match tok.encoder() {
            Encoder::Reference(why) => why.part,
            Encoder::Fast => panic!("the fast encoder accepted a configuration it does not implement"),
        }
    }

    #[test]
    fn supported_variants_give_the_reference_ids() {
        assert_fast_equals_reference(&load(|_| {}));
        // No normalizer: marks stay decomposed.
        assert_fast_equals_reference(&load(|v| v["normalizer"] = Value::Null));
        // Llama 3's digit groups.
        assert_fast_equals_reference(&load(|v| {
            v["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = json!(pretok::LLAMA3_PATTERN);
        }));
        assert_fast_equals_reference(&load(|v| v["model"]["ignore_merges"] = json!(true)));
        // Merges in the older "a b" form.
        assert_fast_equals_reference(&load(|v| {
            let merges = v["model"]["merges"].as_array_mut().unwrap();
            for m in merges.iter_mut() {
                *m = json!(format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap()));
            }
        }));
    }

    type Edit = dyn FnOnce(&mut Value);

    #[test]
    fn unsupported_configurations_use_the_reference() {
        let cases: [(&str, Box<Edit>); 9] = [
            ("normalizer", Box::new(|v| v["normalizer"] = json!({"type": "NFKC"}))),
            (
                "pre_tokenizer",
                Box::new(|v| {
                    v["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
                        json!(r"\p{L}+|\p{N}+|\s+|.");
                }),
            ),
            (
                "pre_tokenizer",
                Box::new(|v| v["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true)),
            ),
            (
                "pre_tokenizer",
                Box::new(
                    |v| v["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
                ),
            ),
            ("model", Box::new(|v| v["model"]["byte_fallback"] = json!(true))),
            ("model", Box::new(|v| v["model"]["dropout"] = json!(0.1))),
            ("added_tokens", Box::new(|v| v["added_tokens"][0]["lstrip"] = json!(true))),
            (
                "post_processor",
                Box::new(|v| {
                    v["post_processor"] = json!({"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}}});
                }),
            ),
            (
                "truncation",
                Box::new(|v| {
                    v["truncation"] = json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0});
                }),
            ),
        ];
        for (part, edit) in cases {
            let tok = load(edit);
            assert_eq!(refused(&tok), part, "{:?}", tok.encoder());
        }
    }

    #[test]
    fn a_vocabulary_without_every_byte_uses_the_reference() {
        let tok = load(|v| {
            let vocab = v["model"]["vocab"].as_object_mut().unwrap();
            vocab.retain(|_, id| id.as_u64() != Some(200));
        });
        assert_eq!(refused(&tok), "model");
    }

    #[test]
    fn below_u0300_every_character_is_an_nfc_starter() {
        for c in (0..0x300u32).filter_map(char::from_u32) {
            assert_eq!(is_nfc_quick(std::iter::once(c)), IsNormalized::Yes, "U+{:04X}", c as u32);
            assert_eq!(unicode_normalization_alignments::char::canonical_combining_class(c), 0);
        }
    }

    /// The quick check never says "unchanged" for a character NFC changes.
    #[test]
    fn quick_check_yes_means_nfc_is_the_identity() {
        for c in (0..=0x10_FFFFu32).filter_map(char::from_u32) {
            let s = c.to_string();
            if is_nfc_quick(s.chars()) == IsNormalized::Yes {
                let n: String = s.as_str().nfc().map(|(c, _)| c).collect();
                assert_eq!(n, s, "U+{:04X}", c as u32);
            }
            assert_eq!(nfc(&s), s.as_str().nfc().map(|(c, _)| c).collect::<String>());
        }
    }
}
