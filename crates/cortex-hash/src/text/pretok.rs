//! The byte-level BPE pre-tokenizer of Qwen2/Qwen3 and Llama 3, written out as a state machine.
//!
//! Their `tokenizer.json` declares a `Split` pre-tokenizer with one regular expression (run by
//! Oniguruma in the `tokenizers` crate, `Isolated` behaviour):
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! (Llama 3 has `\p{N}{1,3}` for the third alternative.) Every position starts a match (a letter,
//! a number, a whitespace or anything else matches one of the alternatives), so the pieces are
//! exactly the successive leftmost matches, and each is decided by the character classes of the
//! next few characters. [`piece_end`] writes out, alternative by alternative, what Oniguruma's
//! backtracking does at one position.
//!
//! Key decision: the character classes (`\p{L}`, `\p{N}`, `\s`, and what `(?i)` folds onto the
//! contraction letters) are tables generated from Oniguruma itself (`unicode_classes.rs`, checked
//! for every code point by a test), not from another Unicode library whose version could differ.

use super::unicode_classes::RANGES;

/// The class of a character for this pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Class {
    /// None of the others (punctuation, symbols, controls, marks, unassigned).
    Other = 0,
    /// `\p{L}`.
    Letter = 1,
    /// `\p{N}`.
    Number = 2,
    /// `\s` except `\r` and `\n`.
    Space = 3,
    /// `\r` or `\n`.
    Newline = 4,
}

impl Class {
    const fn from_u8(v: u8) -> Class {
        match v {
            1 => Class::Letter,
            2 => Class::Number,
            3 => Class::Space,
            4 => Class::Newline,
            _ => Class::Other,
        }
    }
}

/// How many digits the number alternative takes: `\p{N}` (Qwen2) or `\p{N}{1,3}` (Llama 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Digits {
    /// `\p{N}`.
    One,
    /// `\p{N}{1,3}`.
    UpToThree,
}

/// The Qwen2 pattern, exactly as `tokenizer.json` spells it.
pub(super) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Llama 3 pattern.
pub(super) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Digits {
    /// The pre-tokenizer whose pattern is `pattern`, if it is one of the two.
    pub(super) fn for_pattern(pattern: &str) -> Option<Digits> {
        match pattern {
            QWEN2_PATTERN => Some(Digits::One),
            LLAMA3_PATTERN => Some(Digits::UpToThree),
            _ => None,
        }
    }

    const fn max(self) -> usize {
        match self {
            Digits::One => 1,
            Digits::UpToThree => 3,
        }
    }
}

const ASCII: [Class; 128] = {
    let mut t = [Class::Other; 128];
    let mut i = 0;
    while i < 128 {
        let c = i as u8;
        t[i] = if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if c == b'\r' || c == b'\n' {
            Class::Newline
        } else if matches!(c, b'\t' | 0x0B | 0x0C | b' ') {
            Class::Space
        } else {
            Class::Other
        };
        i += 1;
    }
    t
};

/// Code points per block of the two-level class table.
const BLOCK: usize = 128;

/// A two-level table of the class of every code point, built once from [`RANGES`].
struct Table {
    /// Block index per `cp / BLOCK`.
    index: Box<[u16]>,
    /// Unique blocks, `BLOCK` classes each.
    blocks: Box<[u8]>,
}

fn table() -> &'static Table {
    static TABLE: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut flat = vec![Class::Other as u8; 0x11_0000];
        for (i, c) in ASCII.iter().enumerate() {
            flat[i] = *c as u8;
        }
        for &(first, last, class) in RANGES {
            flat[first as usize..=last as usize].fill(class);
        }
        let mut unique: std::collections::HashMap<&[u8], u16> = std::collections::HashMap::new();
        let mut blocks = Vec::new();
        let index = flat
            .chunks_exact(BLOCK)
            .map(|b| {
                *unique.entry(b).or_insert_with(|| {
                    blocks.extend_from_slice(b);
                    u16::try_from(blocks.len() / BLOCK - 1).unwrap_or(u16::MAX)
                })
            })
            .collect();
        Table { index, blocks: blocks.into_boxed_slice() }
    })
}

/// The class of code point `cp`.
pub(super) fn class_of(cp: u32) -> Class {
    if cp < 128 {
        return ASCII[cp as usize];
    }
    let t = table();
    let cp = cp as usize;
    match t.index.get(cp / BLOCK) {
        Some(&b) => Class::from_u8(t.blocks[usize::from(b) * BLOCK + cp % BLOCK]),
        None => Class::Other,
    }
}

/// The character at byte `i` of valid UTF-8 `b`: its class and its length in bytes.
#[inline]
fn char_at(b: &[u8], i: usize) -> (Class, usize, u32) {
    let x = b[i];
    if x < 0x80 {
        return (ASCII[usize::from(x)], 1, u32::from(x));
    }
    let cont = |k: usize| u32::from(b[i + k] & 0x3F);
    let (cp, len) = if x < 0xE0 {
        ((u32::from(x & 0x1F) << 6) | cont(1), 2)
    } else if x < 0xF0 {
        ((u32::from(x & 0x0F) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        ((u32::from(x & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4)
    };
    (class_of(cp), len, cp)
}

/// The contraction letter `(?i)` folds `cp` onto, if any: ASCII case, and `ſ` (U+017F) onto `s`.
pub(super) fn fold_contraction_letter(cp: u32) -> Option<u8> {
    let c = match cp {
        0x17F => b's',
        0..=0x7F => (cp as u8).to_ascii_lowercase(),
        _ => return None,
    };
    matches!(c, b's' | b't' | b'r' | b'e' | b'v' | b'm' | b'l' | b'd').then_some(c)
}

/// The end of a contraction starting with the apostrophe before byte `q`, if there is one.
fn contraction_end(b: &[u8], q: usize) -> Option<usize> {
    if q >= b.len() {
        return None;
    }
    let (_, l1, c1) = char_at(b, q);
    let second = |want: u8| -> Option<usize> {
        let r = q + l1;
        if r >= b.len() {
            return None;
        }
        let (_, l2, c2) = char_at(b, r);
        (fold_contraction_letter(c2) == Some(want)).then_some(r + l2)
    };
    match fold_contraction_letter(c1)? {
        b's' | b't' | b'm' | b'd' => Some(q + l1),
        b'r' | b'v' => second(b'e'),
        b'l' => second(b'l'),
        _ => None,
    }
}

/// The end of the run of characters of class `class` starting at byte `i`.
#[inline]
fn run_end(b: &[u8], mut i: usize, class: Class) -> usize {
    loop {
        // ASCII bytes one table lookup each, without decoding.
        while let Some(&x) = b.get(i)
            && x < 0x80
        {
            if ASCII[usize::from(x)] != class {
                return i;
            }
            i += 1;
        }
        if i >= b.len() {
            return i;
        }
        let (c, l, _) = char_at(b, i);
        if c != class {
            return i;
        }
        i += l;
    }
}

/// The end of the piece starting at byte `p` of `b` (valid UTF-8, `p < b.len()`).
#[inline]
pub(super) fn piece_end(b: &[u8], p: usize, digits: Digits) -> usize {
    let n = b.len();
    let (c0, l0, cp0) = char_at(b, p);
    let q = p + l0;
    match c0 {
        // `[^\r\n\p{L}\p{N}]?\p{L}+` with an empty prefix (a letter is never the prefix).
        Class::Letter => return run_end(b, q, Class::Letter),
        // `\p{N}` or `\p{N}{1,3}` (nothing before it can start with a number).
        Class::Number => {
            let mut e = q;
            for _ in 1..digits.max() {
                if e >= n {
                    break;
                }
                let (c, l, _) = char_at(b, e);
                if c != Class::Number {
                    break;
                }
                e += l;
            }
            return e;
        }
        _ => {}
    }
    // `(?i:'s|'t|'re|'ve|'m|'ll|'d)`.
    if cp0 == u32::from(b'\'')
        && let Some(e) = contraction_end(b, q)
    {
        return e;
    }
    let next = (q < n).then(|| char_at(b, q));
    // `[^\r\n\p{L}\p{N}]?\p{L}+` with this character as the prefix.
    if c0 != Class::Newline
        && let Some((Class::Letter, l1, _)) = next
    {
        return run_end(b, q + l1, Class::Letter);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`.
    let others_from = match (c0, next) {
        (Class::Other, _) => Some(q),
        (Class::Space, Some((Class::Other, _, _))) if cp0 == u32::from(b' ') => Some(q),
        _ => None,
    };
    if let Some(from) = others_from {
        let e = run_end(b, from, Class::Other);
        return run_end(b, e, Class::Newline);
    }
    // A whitespace run [p, e): `\s*[\r\n]+` ends after its last newline; `\s+(?!\S)` takes it
    // whole at the end of the text, or all but its last character before a non-space;
    // `\s+` takes a single whitespace character before a non-space.
    let mut e = p;
    let mut last_start = p;
    let mut last_newline = None;
    while e < n {
        let (c, l, _) = char_at(b, e);
        match c {
            Class::Newline => last_newline = Some(e),
            Class::Space => {}
            _ => break,
        }
        last_start = e;
        e += l;
    }
    if let Some(k) = last_newline {
        k + 1
    } else if e == n || last_start == p {
        e
    } else {
        last_start
    }
}

/// Calls `f` with each piece of `text`, in order.
#[inline]
pub(super) fn for_each_piece(text: &str, digits: Digits, mut f: impl FnMut(&[u8])) {
    let b = text.as_bytes();
    let mut p = 0;
    while p < b.len() {
        let e = piece_end(b, p, digits);
        f(&b[p..e]);
        p = e;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, digits: Digits) -> Vec<&str> {
        let mut out = Vec::new();
        let mut p = 0;
        while p < text.len() {
            let e = piece_end(text.as_bytes(), p, digits);
            out.push(&text[p..e]);
            p = e;
        }
        out
    }

    /// The `tokenizers` crate's own `Split` pre-tokenizer with the same pattern.
    fn reference(text: &str, pattern: &str) -> Vec<String> {
        use tokenizers::PreTokenizer;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        let split = Split::new(
            SplitPattern::Regex(pattern.to_owned()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let mut pre = tokenizers::PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).unwrap();
        pre.get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_owned())
            .collect()
    }

    #[test]
    fn pieces_match_the_regex_on_edge_cases() {
        let cases = [
            "Hello world",
            "  two  spaces  ",
            "a \n b",
            "x\r\n\r\ny",
            "\t\tword",
            "tab\t.",
            "I'm you'RE we'Ll it'ſ",
            "'s's''s",
            "don't",
            "12345 abc1234",
            "(word) ...word",
            " .\n\n",
            "\u{3000}中文\u{3000}",
            "a\u{a0}b",
            "end   ",
            "\n",
            " ",
            "",
            "ö̈",
            "e\u{301}x",
            "🦙 emoji 🦙🦙",
            "a\u{2028}b\u{85}c",
            "\u{b}\u{c}x",
        ];
        for digits in [Digits::One, Digits::UpToThree] {
            let pattern = if digits == Digits::One { QWEN2_PATTERN } else { LLAMA3_PATTERN };
            for text in cases {
                assert_eq!(pieces(text, digits), reference(text, pattern), "{text:?} ({digits:?})");
            }
        }
    }

    /// Every code point's class, as Oniguruma decides `\p{L}`, `\p{N}` and `\s`.
    fn oniguruma_classes() -> Vec<u8> {
        let all: String = (0..=0x10_FFFFu32).filter_map(char::from_u32).collect();
        let mut classes = vec![Class::Other as u8; 0x11_0000];
        for (re, class) in [(r"\p{L}", Class::Letter), (r"\p{N}", Class::Number), (r"\s", Class::Space)] {
            let re = tokenizers::utils::SysRegex::new(re).unwrap();
            for (start, end) in re.find_iter(&all) {
                let mut chars = all[start..end].chars();
                let c = chars.next().unwrap();
                assert!(chars.next().is_none(), "{re:?} matched more than one character");
                let slot = &mut classes[c as usize];
                assert_eq!(*slot, Class::Other as u8, "U+{:04X} is in two classes", c as u32);
                *slot = class as u8;
            }
        }
        classes[usize::from(b'\r')] = Class::Newline as u8;
        classes[usize::from(b'\n')] = Class::Newline as u8;
        classes
    }

    fn generated_table(classes: &[u8]) -> String {
        let mut ranges: Vec<(usize, usize, u8)> = Vec::new();
        for (cp, &c) in classes.iter().enumerate().skip(128) {
            if c == Class::Other as u8 {
                continue;
            }
            match ranges.last_mut() {
                Some((_, last, class)) if *last + 1 == cp && *class == c => *last = cp,
                _ => ranges.push((cp, cp, c)),
            }
        }
        let mut s = String::from(
            "//! Generated from Oniguruma (through the `tokenizers` crate) by `pretok::tests`: the class\n\
             //! of every non-ASCII code point for the pre-tokenizer's pattern. Do not edit; to regenerate,\n\
             //! `CORTEX_BLESS=1 cargo test -p cortex-hash --features text --lib classes_are_oniguruma`.\n\n\
             /// Non-ASCII code point ranges `(first, last, class)` of class 1 (`\\p{L}`), 2 (`\\p{N}`) or\n\
             /// 3 (`\\s`); every other code point is class 0.\n\
             #[rustfmt::skip]\n\
             pub(super) static RANGES: &[(u32, u32, u8)] = &[\n",
        );
        for chunk in ranges.chunks(6) {
            s.push_str("   ");
            for (first, last, c) in chunk {
                s.push_str(&format!(" (0x{first:X}, 0x{last:X}, {c}),"));
            }
            s.push('\n');
        }
        s.push_str("];\n");
        s
    }

    /// The committed table is exactly what Oniguruma says for every code point, and the lookup
    /// reads it back for every code point.
    #[test]
    fn classes_are_oniguruma() {
        let classes = oniguruma_classes();
        let text = generated_table(&classes);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/unicode_classes.rs");
        if std::env::var_os("CORTEX_BLESS").is_some() {
            std::fs::write(&path, &text).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap();
        assert!(committed == text, "{} is stale: rerun with CORTEX_BLESS=1", path.display());
        for (cp, &want) in classes.iter().enumerate() {
            assert_eq!(class_of(cp as u32) as u8, want, "U+{cp:04X}");
        }
    }

    /// `(?i)` folds onto the contraction letters exactly the characters
    /// [`fold_contraction_letter`] says.
    #[test]
    fn contraction_folds_are_oniguruma() {
        let all: String = (0..=0x10_FFFFu32).filter_map(char::from_u32).collect();
        for letter in "strevmld".chars() {
            let re = tokenizers::utils::SysRegex::new(&format!("(?i:{letter})")).unwrap();
            let mut got: Vec<u32> =
                re.find_iter(&all).map(|(s, _)| all[s..].chars().next().unwrap() as u32).collect();
            got.sort_unstable();
            let mut want: Vec<u32> =
                (0..=0x10_FFFFu32).filter(|&cp| fold_contraction_letter(cp) == Some(letter as u8)).collect();
            want.sort_unstable();
            assert_eq!(got, want, "(?i:{letter})");
        }
    }
}
