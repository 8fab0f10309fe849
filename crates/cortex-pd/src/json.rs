//! Edits of a JSON object on the bytes the client sent: find a member, replace, remove or add
//! members, and prepend to an array, without re-serializing anything else.
//!
//! Key decision: the gateway forwards bodies as received (re-serializing changed numbers and
//! added defaults, which broke clients of SGLang's router), so a PD leg's body is the client's
//! bytes with a few top-level members spliced. The scanner here validates what it walks over
//! (strings with their escapes, numbers, literals, nesting up to [`MAX_DEPTH`]) so that a body it
//! accepts is one a JSON parser accepts, and compares keys after unescaping them (a client could
//! spell `stream` as `"str\u0065am"`). Duplicate keys are legal JSON and the engines' parsers
//! keep the last one; an edit therefore removes *every* occurrence of the key it sets or removes,
//! then writes the new member once, first in the object. Kept members are copied byte for byte;
//! only the separators between members are rewritten (one `,`).

use std::borrow::Cow;
use std::ops::Range;

/// Deepest nesting the scanner accepts (serde_json's default recursion limit).
pub const MAX_DEPTH: usize = 128;

/// Why bytes are not the JSON an edit needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JsonError {
    /// The bytes end inside a value.
    #[error("the JSON ends early")]
    Eof,
    /// A byte that cannot appear here, at this offset.
    #[error("unexpected byte at offset {0}")]
    Unexpected(usize),
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("the JSON nests deeper than {MAX_DEPTH}")]
    TooDeep,
    /// The value is not an object (an edit needs one).
    #[error("the JSON value is not an object")]
    NotAnObject,
    /// Something follows the value.
    #[error("trailing bytes after the JSON value at offset {0}")]
    Trailing(usize),
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

fn string_end(b: &[u8], start: usize) -> Result<usize, JsonError> {
    // b[start] == b'"'
    let mut i = start + 1;
    loop {
        match b.get(i).copied() {
            None => return Err(JsonError::Eof),
            Some(b'"') => return Ok(i + 1),
            Some(b'\\') => match b.get(i + 1).copied() {
                None => return Err(JsonError::Eof),
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                Some(b'u') => {
                    let hex = b.get(i + 2..i + 6).ok_or(JsonError::Eof)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return Err(JsonError::Unexpected(i + 2));
                    }
                    i += 6;
                }
                Some(_) => return Err(JsonError::Unexpected(i + 1)),
            },
            Some(c) if c < 0x20 => return Err(JsonError::Unexpected(i)),
            Some(c) if c >= 0x80 => {
                // UTF-8 is checked where it occurs (the engines' servers decode bodies as UTF-8).
                let len = match c {
                    0xc2..=0xdf => 2,
                    0xe0..=0xef => 3,
                    0xf0..=0xf4 => 4,
                    _ => return Err(JsonError::Unexpected(i)),
                };
                let ch = b.get(i..i + len).ok_or(JsonError::Eof)?;
                if std::str::from_utf8(ch).is_err() {
                    return Err(JsonError::Unexpected(i));
                }
                i += len;
            }
            Some(_) => i += 1,
        }
    }
}

fn number_end(b: &[u8], start: usize) -> Result<usize, JsonError> {
    let mut i = start;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
        }
        Some(_) => return Err(JsonError::Unexpected(i)),
        None => return Err(JsonError::Eof),
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if !b.get(i).is_some_and(u8::is_ascii_digit) {
            return Err(if i >= b.len() { JsonError::Eof } else { JsonError::Unexpected(i) });
        }
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if !b.get(i).is_some_and(u8::is_ascii_digit) {
            return Err(if i >= b.len() { JsonError::Eof } else { JsonError::Unexpected(i) });
        }
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    Ok(i)
}

/// The end of the value starting at `start` (no leading whitespace), validated.
fn value_end(b: &[u8], start: usize, depth: usize) -> Result<usize, JsonError> {
    match b.get(start).copied() {
        None => Err(JsonError::Eof),
        Some(b'"') => string_end(b, start),
        Some(b'{' | b'[') if depth >= MAX_DEPTH => Err(JsonError::TooDeep),
        Some(b'{') => {
            let mut i = ws(b, start + 1);
            if b.get(i) == Some(&b'}') {
                return Ok(i + 1);
            }
            loop {
                if b.get(i) != Some(&b'"') {
                    return Err(if i >= b.len() { JsonError::Eof } else { JsonError::Unexpected(i) });
                }
                i = ws(b, string_end(b, i)?);
                if b.get(i) != Some(&b':') {
                    return Err(if i >= b.len() { JsonError::Eof } else { JsonError::Unexpected(i) });
                }
                i = ws(b, i + 1);
                i = ws(b, value_end(b, i, depth + 1)?);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(b'}') => return Ok(i + 1),
                    Some(_) => return Err(JsonError::Unexpected(i)),
                    None => return Err(JsonError::Eof),
                }
            }
        }
        Some(b'[') => {
            let mut i = ws(b, start + 1);
            if b.get(i) == Some(&b']') {
                return Ok(i + 1);
            }
            loop {
                i = ws(b, value_end(b, i, depth + 1)?);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(b']') => return Ok(i + 1),
                    Some(_) => return Err(JsonError::Unexpected(i)),
                    None => return Err(JsonError::Eof),
                }
            }
        }
        Some(b't') => literal(b, start, b"true"),
        Some(b'f') => literal(b, start, b"false"),
        Some(b'n') => literal(b, start, b"null"),
        Some(b'-' | b'0'..=b'9') => number_end(b, start),
        Some(_) => Err(JsonError::Unexpected(start)),
    }
}

fn literal(b: &[u8], start: usize, lit: &[u8]) -> Result<usize, JsonError> {
    match b.get(start..start + lit.len()) {
        Some(s) if s == lit => Ok(start + lit.len()),
        Some(_) => Err(JsonError::Unexpected(start)),
        None => Err(JsonError::Eof),
    }
}

/// Checks that `b` is exactly one JSON value (whitespace around it allowed); returns its span.
///
/// # Errors
/// If it is not.
pub fn validate(b: &[u8]) -> Result<Range<usize>, JsonError> {
    let start = ws(b, 0);
    let end = value_end(b, start, 0)?;
    let rest = ws(b, end);
    if rest != b.len() {
        return Err(JsonError::Trailing(rest));
    }
    Ok(start..end)
}

/// One member of an object: where its key (with quotes) and its value are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The key, quotes included.
    pub key: Range<usize>,
    /// The value.
    pub value: Range<usize>,
}

impl Member {
    /// Whether the (unescaped) key is `name`.
    #[must_use]
    pub fn is(&self, b: &[u8], name: &str) -> bool {
        key_is(&b[self.key.start + 1..self.key.end - 1], name)
    }
}

fn key_is(raw: &[u8], name: &str) -> bool {
    if !raw.contains(&b'\\') {
        return raw == name.as_bytes();
    }
    unescape(raw).is_some_and(|k| k == name)
}

/// Decodes the inside of a JSON string (without its quotes). `None` if an escape is invalid or
/// the result is not UTF-8 (a lone surrogate).
#[must_use]
pub fn unescape(raw: &[u8]) -> Option<Cow<'_, str>> {
    if !raw.contains(&b'\\') {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    let hex4 = |s: &[u8]| -> Option<u32> { u32::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok() };
    while i < raw.len() {
        let c = raw[i];
        if c != b'\\' {
            let len = match c {
                0x00..=0x7f => 1,
                0xc0..=0xdf => 2,
                0xe0..=0xef => 3,
                _ => 4,
            };
            out.push_str(std::str::from_utf8(raw.get(i..i + len)?).ok()?);
            i += len;
            continue;
        }
        let e = *raw.get(i + 1)?;
        i += 2;
        let ch = match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = hex4(raw.get(i..i + 4)?)?;
                i += 4;
                if (0xd800..0xdc00).contains(&hi) {
                    if raw.get(i..i + 2)? != b"\\u" {
                        return None;
                    }
                    let lo = hex4(raw.get(i + 2..i + 6)?)?;
                    if !(0xdc00..0xe000).contains(&lo) {
                        return None;
                    }
                    i += 6;
                    char::from_u32(0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00))?
                } else {
                    char::from_u32(hi)?
                }
            }
            _ => return None,
        };
        out.push(ch);
    }
    Some(Cow::Owned(out))
}

/// The members of the object `b[obj]` (the span of a validated object value), in order.
///
/// # Errors
/// [`JsonError::NotAnObject`] if the span is not an object; scanning errors otherwise.
pub fn members(b: &[u8], obj: Range<usize>, out: &mut Vec<Member>) -> Result<(), JsonError> {
    out.clear();
    if b.get(obj.start) != Some(&b'{') {
        return Err(JsonError::NotAnObject);
    }
    let mut i = ws(b, obj.start + 1);
    if b.get(i) == Some(&b'}') {
        return Ok(());
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(JsonError::Unexpected(i));
        }
        let key_end = string_end(b, i)?;
        let key = i..key_end;
        i = ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(JsonError::Unexpected(i));
        }
        let vstart = ws(b, i + 1);
        let vend = value_end(b, vstart, 1)?;
        out.push(Member { key, value: vstart..vend });
        i = ws(b, vend);
        match b.get(i) {
            Some(b',') => i = ws(b, i + 1),
            Some(b'}') => return Ok(()),
            Some(_) => return Err(JsonError::Unexpected(i)),
            None => return Err(JsonError::Eof),
        }
    }
}

/// The spans of the elements of the array `b[array]` (the span of a validated array value), in
/// order.
///
/// # Errors
/// [`JsonError::Unexpected`] if the span is not an array; scanning errors otherwise.
pub fn elements(b: &[u8], array: Range<usize>, out: &mut Vec<Range<usize>>) -> Result<(), JsonError> {
    out.clear();
    if b.get(array.start) != Some(&b'[') {
        return Err(JsonError::Unexpected(array.start));
    }
    let mut i = ws(b, array.start + 1);
    if b.get(i) == Some(&b']') {
        return Ok(());
    }
    loop {
        let end = value_end(b, i, 1)?;
        out.push(i..end);
        i = ws(b, end);
        match b.get(i) {
            Some(b',') => i = ws(b, i + 1),
            Some(b']') => return Ok(()),
            Some(_) => return Err(JsonError::Unexpected(i)),
            None => return Err(JsonError::Eof),
        }
    }
}

/// The raw value of the top-level member `name` of the object `b` (the last one if the key is
/// repeated, as the engines' parsers read it).
///
/// # Errors
/// If `b` is not one JSON object.
pub fn get<'b>(b: &'b [u8], name: &str) -> Result<Option<&'b [u8]>, JsonError> {
    let span = validate(b)?;
    let mut ms = Vec::new();
    members(b, span, &mut ms)?;
    Ok(ms.iter().rev().find(|m| m.is(b, name)).map(|m| &b[m.value.clone()]))
}

/// A value as the engines' Python code tests it for truth: `null`, `false`, `0`, `""`, `[]` and
/// `{}` are false.
#[must_use]
pub fn truthy(raw: &[u8]) -> bool {
    let t = raw.trim_ascii();
    match t.first() {
        None | Some(b'n' | b'f') => false,
        Some(b't') => true,
        Some(b'"') => t.len() > 2,
        Some(b'[' | b'{') => t[1..t.len() - 1].iter().any(|c| !c.is_ascii_whitespace()),
        Some(_) => number_is_nonzero(t),
    }
}

fn number_is_nonzero(t: &[u8]) -> bool {
    // Mantissa digits before any exponent; a zero mantissa is zero whatever the exponent.
    t.iter().take_while(|c| !matches!(c, b'e' | b'E')).any(|c| (b'1'..=b'9').contains(c))
}

/// A member to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edit<'a> {
    /// Remove every `key` member, then add `"key": value` (`value` is raw JSON).
    Set(&'a str, &'a [u8]),
    /// Like `Set`, but only if the object has a `key` member.
    Replace(&'a str, &'a [u8]),
    /// Remove every `key` member.
    Remove(&'a str),
}

impl Edit<'_> {
    const fn key(&self) -> &str {
        match self {
            Edit::Set(k, _) | Edit::Replace(k, _) | Edit::Remove(k) => k,
        }
    }
}

/// Writes the object `b` with `edits` applied into `out` (cleared first). Members no edit names
/// are copied byte for byte, in order, after the set ones; `b`'s whitespace before and after the
/// object is kept.
///
/// # Errors
/// If `b` is not one JSON object. `out` is then empty.
pub fn edit(b: &[u8], edits: &[Edit<'_>], out: &mut Vec<u8>) -> Result<(), JsonError> {
    out.clear();
    let span = validate(b)?;
    let mut ms = Vec::new();
    members(b, span.clone(), &mut ms)?;
    out.reserve(b.len() + edits.iter().map(|e| e.key().len() + 8).sum::<usize>());
    out.extend_from_slice(&b[..=span.start]);
    let mut first = true;
    for e in edits {
        let value = match *e {
            Edit::Set(_, v) => v,
            Edit::Replace(k, v) if ms.iter().any(|m| m.is(b, k)) => v,
            Edit::Replace(..) | Edit::Remove(_) => continue,
        };
        if !first {
            out.push(b',');
        }
        first = false;
        write_string(e.key(), out);
        out.push(b':');
        out.extend_from_slice(value);
    }
    for m in &ms {
        if edits.iter().any(|e| m.is(b, e.key())) {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(&b[m.key.start..m.value.end]);
    }
    out.push(b'}');
    out.extend_from_slice(&b[span.end..]);
    Ok(())
}

/// Appends `s` as a JSON string.
pub fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                let _ = std::io::Write::write_fmt(out, format_args!("\\u{:04x}", c as u32));
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// The span of the value at `path` (object keys) inside the value `b[span]`, if every step is an
/// object with that key (the last occurrence of a repeated key).
///
/// # Errors
/// Scanning errors.
pub fn find_path(b: &[u8], span: Range<usize>, path: &[&str]) -> Result<Option<Range<usize>>, JsonError> {
    let mut cur = span;
    let mut ms = Vec::new();
    for key in path {
        if b.get(cur.start) != Some(&b'{') {
            return Ok(None);
        }
        members(b, cur.clone(), &mut ms)?;
        match ms.iter().rev().find(|m| m.is(b, key)) {
            Some(m) => cur = m.value.clone(),
            None => return Ok(None),
        }
    }
    Ok(Some(cur))
}

/// The inside of the array `b[span]` (between its brackets, trimmed), or `None` if the span is not
/// an array.
#[must_use]
pub fn array_items(b: &[u8], span: Range<usize>) -> Option<&[u8]> {
    if b.get(span.start) != Some(&b'[') {
        return None;
    }
    Some(b[span.start + 1..span.end - 1].trim_ascii())
}

/// Copies `b` into `out`, with `items` (the inside of another array, as [`array_items`] gives)
/// inserted at the start of the array at `array` (a span of `b`). Nothing else changes.
pub fn prepend_items(b: &[u8], array: Range<usize>, items: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(b.len() + items.len() + 1);
    out.extend_from_slice(&b[..=array.start]);
    if !items.is_empty() {
        out.extend_from_slice(items);
        let inner = &b[array.start + 1..array.end - 1];
        if !inner.trim_ascii().is_empty() {
            out.push(b',');
        }
    }
    out.extend_from_slice(&b[array.start + 1..]);
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn ed(b: &str, edits: &[Edit<'_>]) -> String {
        let mut out = Vec::new();
        edit(b.as_bytes(), edits, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn validate_accepts_json_and_refuses_the_rest() {
        for ok in [
            r#"{}"#,
            r#" {"a":[1,-2.5e+3,true,false,null,"\u00e9\n"],"b":{"c":{}}} "#,
            "0",
            r#""x""#,
            "[[],[{}]]",
        ] {
            assert!(validate(ok.as_bytes()).is_ok(), "{ok}");
            assert!(serde_json::from_str::<Value>(ok).is_ok());
        }
        for bad in [
            "",
            "{",
            r#"{"a"}"#,
            r#"{"a":}"#,
            r#"{"a":1,}"#,
            "[1,]",
            "01",
            "1.",
            "-",
            "1e",
            "tru",
            r#""\x""#,
            "\"a\nb\"",
            r#"{"a":1} x"#,
            r#"{a:1}"#,
            r#""\u12g4""#,
            "[1 2]",
        ] {
            assert!(validate(bad.as_bytes()).is_err(), "{bad:?}");
            assert!(serde_json::from_str::<Value>(bad).is_err(), "{bad:?} is valid JSON after all");
        }
        for bad in [&b"\"\x80\""[..], b"\"\xc3\"", b"\"\xed\xa0\x80\"", b"\"\xf5\x80\x80\x80\""] {
            assert!(validate(bad).is_err(), "{bad:?}: not UTF-8");
            assert!(serde_json::from_slice::<Value>(bad).is_err());
        }
        assert!(validate("\"é😀\"".as_bytes()).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert_eq!(validate(deep.as_bytes()), Err(JsonError::TooDeep));
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(validate(ok.as_bytes()).is_ok());
    }

    #[test]
    fn edits_keep_the_rest_byte_for_byte() {
        let b = " {\"text\": \"a\",\n \"x\": 1.50, \"stream\": true}\n";
        let out = ed(b, &[Edit::Set("stream", b"false"), Edit::Set("room", b"7")]);
        assert_eq!(out, " {\"stream\":false,\"room\":7,\"text\": \"a\",\"x\": 1.50}\n");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["x"].to_string(), "1.5");
        assert!(out.contains("1.50"), "numbers are not reformatted");
    }

    #[test]
    fn every_duplicate_is_replaced_and_escaped_keys_match() {
        let b = r#"{"stream":true,"a":1,"str\u0065am":true,"stream":true}"#;
        let out = ed(b, &[Edit::Set("stream", b"false")]);
        assert_eq!(out, r#"{"stream":false,"a":1}"#);
        let out = ed(b, &[Edit::Remove("stream")]);
        assert_eq!(out, r#"{"a":1}"#);
    }

    #[test]
    fn replace_only_writes_present_keys_and_remove_of_absent_is_identity() {
        let b = r#"{"max_tokens":9}"#;
        assert_eq!(ed(b, &[Edit::Replace("max_completion_tokens", b"1")]), b);
        assert_eq!(ed(b, &[Edit::Replace("max_tokens", b"1")]), r#"{"max_tokens":1}"#);
        assert_eq!(ed(b, &[Edit::Remove("nope")]), b);
        assert_eq!(ed("{ }", &[Edit::Set("a", b"1")]), r#"{"a":1}"#);
        assert_eq!(ed(r#"{"a":1}"#, &[Edit::Remove("a")]), "{}");
    }

    #[test]
    fn edits_refuse_what_is_not_an_object() {
        let mut out = vec![1];
        assert_eq!(edit(b"[1]", &[], &mut out), Err(JsonError::NotAnObject));
        assert!(out.is_empty());
        assert!(edit(br#"{"a":1"#, &[], &mut out).is_err());
        assert!(edit(br#"{"a":1}{}"#, &[], &mut out).is_err());
    }

    #[test]
    fn elements_of_arrays() {
        let b = b" [1, {\"a\":[2]} ,\"x\" ] ";
        let span = validate(b).unwrap();
        let mut out = Vec::new();
        elements(b, span, &mut out).unwrap();
        let got: Vec<&[u8]> = out.iter().map(|r| &b[r.clone()]).collect();
        assert_eq!(got, [&b"1"[..], br#"{"a":[2]}"#, br#""x""#]);
        elements(b"[ ]", 0..3, &mut out).unwrap();
        assert!(out.is_empty());
        assert!(elements(b"{}", 0..2, &mut out).is_err());
    }

    #[test]
    fn get_reads_the_last_occurrence() {
        let b = br#"{"a":1,"b":{"c":[2]},"a":3}"#;
        assert_eq!(get(b, "a").unwrap(), Some(&b"3"[..]));
        assert_eq!(get(b, "b").unwrap(), Some(&br#"{"c":[2]}"#[..]));
        assert_eq!(get(b, "z").unwrap(), None);
        assert!(get(b"[]", "a").is_err());
    }

    #[test]
    fn truth_as_python_tests_it() {
        for (raw, t) in [
            ("null", false),
            ("false", false),
            ("true", true),
            ("0", false),
            ("-0.0e5", false),
            ("0.001", true),
            ("\"\"", false),
            ("\"x\"", true),
            ("[ ]", false),
            ("[0]", true),
            ("{}", false),
            ("{\"a\":1}", true),
        ] {
            assert_eq!(truthy(raw.as_bytes()), t, "{raw}");
        }
    }

    #[test]
    fn unescape_handles_every_escape_and_refuses_lone_surrogates() {
        assert_eq!(unescape(br#"a\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"#).unwrap(), "a\"\\/\u{8}\u{c}\n\r\té😀");
        assert!(unescape(br"\ud83d").is_none());
        assert!(unescape(br"\ud83dx").is_none());
        assert!(unescape(br"\q").is_none());
        assert_eq!(unescape("é".as_bytes()).unwrap(), "é");
    }

    #[test]
    fn strings_are_written_escaped() {
        let mut out = Vec::new();
        write_string("a\"b\\c\nd\u{1}é", &mut out);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v, "a\"b\\c\nd\u{1}é");
    }

    #[test]
    fn paths_and_array_prepends() {
        let b = br#"{"meta_info":{"input_token_logprobs":[[1,2],[3,4]],"x":0}}"#;
        let span = validate(b).unwrap();
        let arr = find_path(b, span.clone(), &["meta_info", "input_token_logprobs"]).unwrap().unwrap();
        assert_eq!(&b[arr.clone()], b"[[1,2],[3,4]]");
        let mut out = Vec::new();
        prepend_items(b, arr.clone(), b"[9,9]", &mut out);
        assert_eq!(&out[..], br#"{"meta_info":{"input_token_logprobs":[[9,9],[1,2],[3,4]],"x":0}}"#);
        prepend_items(b, arr, b"", &mut out);
        assert_eq!(&out[..], &b[..]);
        let empty = br#"{"l":[ ]}"#;
        let arr = find_path(empty, validate(empty).unwrap(), &["l"]).unwrap().unwrap();
        prepend_items(empty, arr, b"1,2", &mut out);
        assert_eq!(&out[..], br#"{"l":[1,2 ]}"#);
        assert_eq!(find_path(b, span.clone(), &["meta_info", "nope"]).unwrap(), None);
        assert_eq!(find_path(b, span, &["meta_info", "x", "deeper"]).unwrap(), None);
        assert_eq!(array_items(b"[ 1, 2 ]", 0..8), Some(&b"1, 2"[..]));
        assert_eq!(array_items(b"{}", 0..2), None);
    }
}
