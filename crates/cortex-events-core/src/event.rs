//! The shape both engines' msgspec encoders give a KV-event batch, read once for both.
//!
//! vLLM and SGLang declare the same three event classes (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`) as msgspec tagged structs, and the batch as an `array_like` struct
//! `[ts, events, rank]`. A tagged struct is written either as a positional array whose first
//! element is the tag (`array_like=True`: vLLM ≤ 0.23, SGLang ≤ 0.5.19) or as a map whose
//! `"type"` key holds it (vLLM ≥ 0.24, SGLang ≥ 0.5.20). [`event`] finds the tag in either form
//! and hands the engine crate a [`Fields`] cursor, which reads each field by position or by name
//! into the engine's own wire types.
//!
//! Key decision: the engine crates keep their field lists and value readers (what a field *is*
//! differs between the engines); this module owns only what the two encodings have in common —
//! tags, field order versus field names, unknown keys, missing required fields, trailing
//! elements — so a fix to how a map event is walked is made once.

use crate::error::{DecodeError, ValueKind};
use crate::msgpack::Reader;

/// An event type, by its msgspec tag (the Python class name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// `BlockStored` (SGLang 0.5.18–0.5.19's `BlockStoredWithMetadata` uses the same tag).
    Stored,
    /// `BlockRemoved`.
    Removed,
    /// `AllBlocksCleared`.
    Cleared,
}

impl Tag {
    /// The tag string as msgspec writes it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Tag::Stored => "BlockStored",
            Tag::Removed => "BlockRemoved",
            Tag::Cleared => "AllBlocksCleared",
        }
    }

    fn read(r: &mut Reader<'_>) -> Result<Tag, DecodeError> {
        let offset = r.pos();
        match r.str_bytes()? {
            b"BlockStored" => Ok(Tag::Stored),
            b"BlockRemoved" => Ok(Tag::Removed),
            b"AllBlocksCleared" => Ok(Tag::Cleared),
            _ => Err(DecodeError::UnknownEventType { offset }),
        }
    }
}

/// The fields of one event after its tag: where they are and how they are named.
#[derive(Clone, Copy, Debug)]
pub struct Fields {
    /// Start of the event (where a missing field is reported).
    start: usize,
    layout: Layout,
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `len` elements after the tag, in declaration order.
    Positional { len: usize },
    /// `count` map entries from byte `from`, in any order (the `"type"` entry may be among them).
    Named { from: usize, count: usize },
}

impl Fields {
    /// True for a positional array (`array_like`), false for a map.
    #[must_use]
    pub fn positional(&self) -> bool {
        matches!(self.layout, Layout::Positional { .. })
    }

    /// Reads every field: calls `read(r, i)` with the reader on the value of field `names[i]`
    /// (the `i`-th element after the tag of an array, or the entry keyed `names[i]` of a map) and
    /// skips everything else (later elements, unknown keys). `read` must consume the value.
    ///
    /// # Errors
    /// [`DecodeError::MissingField`] if one of the first `required` names is absent (an array
    /// shorter than that, or a map without the key), and whatever `read` returns.
    #[inline]
    pub fn read<'a>(
        &self,
        r: &mut Reader<'a>,
        event: &'static str,
        names: &[&'static str],
        required: usize,
        mut read: impl FnMut(&mut Reader<'a>, usize) -> Result<(), DecodeError>,
    ) -> Result<(), DecodeError> {
        let missing = |i: usize| DecodeError::MissingField {
            offset: self.start,
            event,
            field: names.get(i).copied().unwrap_or("?"),
        };
        match self.layout {
            Layout::Positional { len } => {
                if len < required {
                    return Err(missing(len));
                }
                for i in 0..len {
                    if i < names.len() { read(r, i)? } else { r.skip()? }
                }
            }
            Layout::Named { from, count } => {
                r.seek(from);
                let mut have = 0u64;
                for _ in 0..count {
                    match r.key()?.and_then(|k| names.iter().position(|n| n.as_bytes() == k)) {
                        Some(i) => {
                            have |= 1u64.checked_shl(i as u32).unwrap_or(0);
                            read(r, i)?;
                        }
                        None => r.skip()?,
                    }
                }
                if let Some(i) = (0..required.min(64)).find(|&i| have & (1 << i) == 0) {
                    return Err(missing(i));
                }
            }
        }
        Ok(())
    }

    /// [`Fields::read`] into a fresh `T`: `read(r, &mut value, i)` for each field, the value
    /// returned once every field is read.
    ///
    /// # Errors
    /// As [`Fields::read`].
    #[inline]
    pub fn read_into<'a, T: Default>(
        &self,
        r: &mut Reader<'a>,
        event: &'static str,
        names: &[&'static str],
        required: usize,
        mut read: impl FnMut(&mut Reader<'a>, &mut T, usize) -> Result<(), DecodeError>,
    ) -> Result<T, DecodeError> {
        let mut value = T::default();
        self.read(r, event, names, required, |r, i| read(r, &mut value, i))?;
        Ok(value)
    }

    /// Skips every field (an event type without fields, such as `AllBlocksCleared`).
    ///
    /// # Errors
    /// A malformed value.
    pub fn skip(&self, r: &mut Reader<'_>) -> Result<(), DecodeError> {
        self.read(r, "event", &[], 0, |_, _| Ok(()))
    }
}

/// Reads one event, an array `[tag, f1, f2, …]` or a map `{"type": tag, name: value, …}`: finds
/// the tag, then calls `read` with it and the event's [`Fields`], which `read` must consume
/// ([`Fields::read`] or [`Fields::skip`]).
///
/// # Errors
/// [`DecodeError::MissingField`] (`type`) for an event without a tag,
/// [`DecodeError::UnknownEventType`] for a tag that is none of the three, an
/// [`DecodeError::UnexpectedType`] for an event that is neither an array nor a map, and whatever
/// `read` returns.
#[inline]
pub fn event<'a, E>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>, Tag, Fields) -> Result<E, DecodeError>,
) -> Result<E, DecodeError> {
    let start = r.pos();
    let no_tag = || DecodeError::MissingField { offset: start, event: "event", field: "type" };
    let (tag, layout) = match r.kind()? {
        ValueKind::Array => {
            let len = r.array_len()?;
            if len == 0 {
                return Err(no_tag());
            }
            (Tag::read(r)?, Layout::Positional { len: len - 1 })
        }
        ValueKind::Map => {
            let n = r.map_len()?;
            let body = r.pos();
            // msgspec writes the tag first; look for it elsewhere only if it is not.
            if n > 0 && r.kind()? == ValueKind::Str && r.str_bytes()? == b"type" {
                (Tag::read(r)?, Layout::Named { from: r.pos(), count: n - 1 })
            } else {
                r.seek(body);
                let mut found = None;
                for _ in 0..n {
                    if r.key()? == Some(b"type") {
                        found = Some(Tag::read(r)?);
                        break;
                    }
                    r.skip()?;
                }
                (found.ok_or_else(no_tag)?, Layout::Named { from: body, count: n })
            }
        }
        _ => return Err(r.unexpected("an event (array or map)")),
    };
    read(r, tag, Fields { start, layout })
}

/// A batch as an `array_like` struct reads it: `[ts, events, rank]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch<E> {
    /// Wall-clock seconds (`time.time()`).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<E>,
    /// The DP rank; `None` when nil or absent.
    pub rank: Option<u16>,
}

/// Reads `[ts, events, rank]`, the rank (named `rank_field` in errors) optional, later elements
/// skipped; each event with `event`. The caller checks that nothing follows
/// ([`Reader::finish`]).
///
/// # Errors
/// [`DecodeError::BatchShape`] for an array of fewer than two elements, a malformed `ts`,
/// events or rank, and whatever `event` returns.
#[inline]
pub fn array_batch<'a, E>(
    r: &mut Reader<'a>,
    rank_field: &'static str,
    event: impl FnMut(&mut Reader<'a>) -> Result<E, DecodeError>,
) -> Result<Batch<E>, DecodeError> {
    let len = r.array_len()?;
    if len < 2 {
        return Err(DecodeError::BatchShape { len });
    }
    let ts = r.f64()?;
    let events = events(r, event)?;
    let rank = if len >= 3 { r.opt_u16(rank_field)? } else { None };
    for _ in 3..len {
        r.skip()?;
    }
    Ok(Batch { ts, events, rank })
}

/// Reads an array of events, each with `event`.
///
/// # Errors
/// A malformed array header, and whatever `event` returns.
#[inline]
pub fn events<'a, E>(
    r: &mut Reader<'a>,
    mut event: impl FnMut(&mut Reader<'a>) -> Result<E, DecodeError>,
) -> Result<Vec<E>, DecodeError> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(event(r)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msgpack::write;

    /// Reads `[ts, [event], 0]` with a reader that records what it saw: the tag and, per field
    /// index of `["a", "b", "c"]` (two required), the integer it holds.
    fn fields(event_bytes: &[u8]) -> Result<(Tag, Vec<(usize, i64)>), DecodeError> {
        let mut p = Vec::new();
        write::array(&mut p, 3).unwrap();
        write::f64(&mut p, 1.5);
        write::array(&mut p, 1).unwrap();
        p.extend_from_slice(event_bytes);
        write::uint(&mut p, 0);
        let mut r = Reader::new(&p);
        let batch = array_batch(&mut r, "rank", |r| {
            event(r, |r, tag, f| {
                let mut seen = Vec::new();
                f.read(r, tag.name(), &["a", "b", "c"], 2, |r, i| {
                    seen.push((i, r.i64("x")?));
                    Ok(())
                })?;
                Ok((tag, seen))
            })
        })?;
        r.finish()?;
        Ok(batch.events.into_iter().next().unwrap())
    }

    fn bytes(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut v = Vec::new();
        f(&mut v);
        v
    }

    #[test]
    fn arrays_read_by_position_and_skip_what_follows_the_known_fields() {
        let ev = bytes(|o| {
            write::array(o, 5).unwrap();
            write::str(o, "BlockRemoved").unwrap();
            for v in [1, 2, 3] {
                write::int(o, v);
            }
            write::map(o, 1).unwrap(); // a fourth element nobody declared
            write::str(o, "x").unwrap();
            write::nil(o);
        });
        assert_eq!(fields(&ev).unwrap(), (Tag::Removed, vec![(0, 1), (1, 2), (2, 3)]));
        let short = bytes(|o| {
            write::array(o, 2).unwrap();
            write::str(o, "BlockStored").unwrap();
            write::int(o, 1);
        });
        assert_eq!(
            fields(&short).unwrap_err(),
            DecodeError::MissingField { offset: 11, event: "BlockStored", field: "b" }
        );
    }

    #[test]
    fn maps_read_by_name_wherever_the_tag_is() {
        // {"c": 3, 7: nil, "type": "BlockStored", "zz": [1], "a": 1, "b": 2}: the tag not first,
        // a non-string key and an unknown key.
        let ev = bytes(|o| {
            write::map(o, 6).unwrap();
            write::str(o, "c").unwrap();
            write::int(o, 3);
            write::uint(o, 7);
            write::nil(o);
            write::str(o, "type").unwrap();
            write::str(o, "BlockStored").unwrap();
            write::str(o, "zz").unwrap();
            write::array(o, 1).unwrap();
            write::int(o, 1);
            write::str(o, "a").unwrap();
            write::int(o, 1);
            write::str(o, "b").unwrap();
            write::int(o, 2);
        });
        assert_eq!(fields(&ev).unwrap(), (Tag::Stored, vec![(2, 3), (0, 1), (1, 2)]));
        let no_b = bytes(|o| {
            write::map(o, 2).unwrap();
            write::str(o, "type").unwrap();
            write::str(o, "BlockRemoved").unwrap();
            write::str(o, "a").unwrap();
            write::int(o, 1);
        });
        assert_eq!(
            fields(&no_b).unwrap_err(),
            DecodeError::MissingField { offset: 11, event: "BlockRemoved", field: "b" }
        );
    }

    #[test]
    fn events_without_a_known_tag_are_refused() {
        let untagged = bytes(|o| {
            write::map(o, 1).unwrap();
            write::str(o, "a").unwrap();
            write::int(o, 1);
        });
        assert_eq!(
            fields(&untagged).unwrap_err(),
            DecodeError::MissingField { offset: 11, event: "event", field: "type" }
        );
        let empty = bytes(|o| write::array(o, 0).unwrap());
        assert_eq!(
            fields(&empty).unwrap_err(),
            DecodeError::MissingField { offset: 11, event: "event", field: "type" }
        );
        let unknown = bytes(|o| {
            write::array(o, 1).unwrap();
            write::str(o, "BlockUpdated").unwrap();
        });
        assert_eq!(fields(&unknown).unwrap_err(), DecodeError::UnknownEventType { offset: 12 });
        assert_eq!(
            fields(&[0x07]).unwrap_err(),
            DecodeError::UnexpectedType {
                offset: 11,
                expected: "an event (array or map)",
                found: ValueKind::Int
            }
        );
    }

    #[test]
    fn batches_need_ts_and_events_and_may_lack_the_rank() {
        let mut two = Vec::new();
        write::array(&mut two, 2).unwrap();
        write::f64(&mut two, 2.5);
        write::array(&mut two, 0).unwrap();
        let b = array_batch(&mut Reader::new(&two), "rank", |r| r.skip()).unwrap();
        assert_eq!((b.ts, b.events.len(), b.rank), (2.5, 0, None));
        let one = [0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            array_batch(&mut Reader::new(&one), "rank", |r| r.skip()).unwrap_err(),
            DecodeError::BatchShape { len: 1 }
        );
        let wide_rank = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xce, 0, 1, 0, 0];
        assert_eq!(
            array_batch(&mut Reader::new(&wide_rank), "rank", |r| r.skip()).unwrap_err(),
            DecodeError::OutOfRange { offset: 11, field: "rank" }
        );
    }
}
