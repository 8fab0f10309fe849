//! SGLang's KV-event wire format as typed values, field by field, and the decoder that reads them.
//!
//! The batch is `[ts, events, attn_dp_rank]` in every release. Events are maps with a `"type"`
//! key since 0.5.20 and positional arrays `["BlockStored", block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id, medium]` up to 0.5.19, where a salted store
//! (`BlockStoredWithMetadata`, same tag) has an eighth element `{"cache_salt": S}`. Fields are
//! matched by name in maps and by position in arrays; unknown keys are ignored, optional fields
//! may be missing, arrays may be longer or (after the required fields) shorter.
//!
//! Key decision: the wire types keep exactly what was sent (signed hashes, tokens as published,
//! EAGLE bigram pairs as pairs), so they re-encode byte for byte; interpreting them is
//! [`crate::normalize`]'s job.

use cortex_events_core::event::{self, Tag};
use cortex_events_core::msgpack::Reader;
use cortex_events_core::{DecodeError, ValueKind};

/// `token_ids` as published: flat ids, or for EAGLE speculative decoding the overlapping pairs
/// `[[a, b], [b, c], …]` (one pair per page unit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenIds {
    /// Plain token ids (SGLang accepts ids up to 2^63 − 1: "wide" pages).
    Flat(Vec<u64>),
    /// Bigram units.
    Bigram(Vec<[u64; 2]>),
}

impl Default for TokenIds {
    fn default() -> Self {
        TokenIds::Flat(Vec::new())
    }
}

impl TokenIds {
    /// Number of page units (tokens, or pairs).
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            TokenIds::Flat(t) => t.len(),
            TokenIds::Bigram(p) => p.len(),
        }
    }

    /// True when there are no units.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `lora_id` (always nil in 0.5.23; an integer or an adapter-id string in forks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraId<'a> {
    /// An integer id.
    Int(i64),
    /// A string id.
    Str(&'a str),
}

/// `BlockStored`, every field by name, in declaration order.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WireBlockStored<'a> {
    /// One signed 64-bit hash per page.
    pub block_hashes: Vec<i64>,
    /// Hash of the page before `block_hashes[0]`; `None` = the path starts at the root.
    pub parent_block_hash: Option<i64>,
    /// The pages' tokens, concatenated.
    pub token_ids: TokenIds,
    /// Units per page (`page_size * dcp_size`).
    pub block_size: u32,
    /// Adapter id (no default: present, usually nil).
    pub lora_id: Option<LoraId<'a>>,
    /// `"GPU"`, `"CPU_PINNED"`, `"DISK"` or `"EXTERNAL"`.
    pub medium: Option<&'a str>,
    /// The request's cache salt (maps; the metadata element of 0.5.18–0.5.19 arrays).
    pub cache_salt: Option<&'a str>,
    /// The request's session id (maps only).
    pub session_id: Option<&'a str>,
    /// The adapter's name, published only for adapters registered in `KvEventLoraNames` (maps
    /// only).
    pub lora_name: Option<&'a str>,
}

/// `BlockRemoved`, every field by name.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WireBlockRemoved<'a> {
    /// The removed pages' hashes.
    pub block_hashes: Vec<i64>,
    /// Tier the pages left.
    pub medium: Option<&'a str>,
}

/// One event as published.
#[derive(Clone, Debug, PartialEq)]
pub enum WireEvent<'a> {
    /// `BlockStored` (or 0.5.18–0.5.19 `BlockStoredWithMetadata`).
    BlockStored(WireBlockStored<'a>),
    /// `BlockRemoved`.
    BlockRemoved(WireBlockRemoved<'a>),
    /// `AllBlocksCleared` (no fields).
    AllBlocksCleared,
}

/// One payload as published: `[ts, events, attn_dp_rank]`.
#[derive(Clone, Debug, PartialEq)]
pub struct WireBatch<'a> {
    /// Wall-clock seconds (`time.time()`).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<WireEvent<'a>>,
    /// The attention-DP rank; `None` when nil or absent.
    pub attn_dp_rank: Option<u16>,
}

/// `BlockStored` map keys in declaration order; the first six are also the positional fields.
pub(crate) const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
];
/// Fields without which a store means nothing.
const STORED_REQUIRED: usize = 4;
/// Position of the `BlockStoredWithMetadata` element (after the tag and six fields).
const METADATA_POSITION: usize = 6;
pub(crate) const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// Decodes a payload into the wire types, without interpreting it.
///
/// # Errors
/// [`DecodeError`] if the payload is not one well-formed batch.
pub fn decode_wire(payload: &[u8]) -> Result<WireBatch<'_>, DecodeError> {
    let mut r = Reader::new(payload);
    let b = event::array_batch(&mut r, "attn_dp_rank", wire_event)?;
    r.finish()?;
    Ok(WireBatch { ts: b.ts, events: b.events, attn_dp_rank: b.rank })
}

/// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
/// {"cache_salt": S}?]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`, or the
/// same as maps with a `"type"` key.
fn wire_event<'a>(r: &mut Reader<'a>) -> Result<WireEvent<'a>, DecodeError> {
    event::event(r, |r, tag, fields| {
        Ok(match tag {
            Tag::Stored => {
                let positional = fields.positional();
                let s = fields.read_into(
                    r,
                    "BlockStored",
                    &STORED_FIELDS,
                    STORED_REQUIRED,
                    |r, s: &mut WireBlockStored<'a>, i| {
                        // An array has six fields, then the metadata element, then nothing we know.
                        match i {
                            METADATA_POSITION if positional => s.cache_salt = metadata(r)?,
                            _ if positional && i > METADATA_POSITION => r.skip()?,
                            _ => stored_field(r, s, i)?,
                        }
                        Ok(())
                    },
                )?;
                WireEvent::BlockStored(s)
            }
            Tag::Removed => WireEvent::BlockRemoved(fields.read_into(
                r,
                "BlockRemoved",
                &REMOVED_FIELDS,
                1,
                removed_field,
            )?),
            Tag::Cleared => {
                fields.skip(r)?;
                WireEvent::AllBlocksCleared
            }
        })
    })
}

/// The `BlockStoredWithMetadata` element: a map holding `cache_salt` (nil and unknown keys
/// tolerated).
fn metadata<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.kind()? != ValueKind::Map {
        r.skip()?;
        return Ok(None);
    }
    let n = r.map_len()?;
    let mut salt = None;
    for _ in 0..n {
        match r.key()? {
            Some(b"cache_salt") => salt = r.opt_str()?,
            _ => r.skip()?,
        }
    }
    Ok(salt)
}

/// Reads field number `i` of [`STORED_FIELDS`] (others are skipped).
fn stored_field<'a>(r: &mut Reader<'a>, s: &mut WireBlockStored<'a>, i: usize) -> Result<(), DecodeError> {
    match i {
        0 => s.block_hashes = hashes(r)?,
        1 => s.parent_block_hash = if r.nil()? { None } else { Some(hash(r)?) },
        2 => s.token_ids = tokens(r)?,
        3 => s.block_size = r.u32("block_size")?,
        4 => {
            s.lora_id = match r.kind()? {
                ValueKind::Nil => {
                    r.skip()?;
                    None
                }
                ValueKind::Str => Some(LoraId::Str(r.str()?)),
                _ => Some(LoraId::Int(r.i64("lora_id")?)),
            };
        }
        5 => s.medium = r.opt_str()?,
        6 => s.cache_salt = r.opt_str()?,
        7 => s.session_id = r.opt_str()?,
        8 => s.lora_name = r.opt_str()?,
        _ => r.skip()?,
    }
    Ok(())
}

/// Reads field number `i` of [`REMOVED_FIELDS`] (others are skipped).
fn removed_field<'a>(r: &mut Reader<'a>, rm: &mut WireBlockRemoved<'a>, i: usize) -> Result<(), DecodeError> {
    match i {
        0 => rm.block_hashes = hashes(r)?,
        1 => rm.medium = r.opt_str()?,
        _ => r.skip()?,
    }
    Ok(())
}

/// A hash: msgspec writes a non-negative `i64` as an unsigned form, so `uint64` up to
/// `i64::MAX` is accepted; larger values cannot be SGLang's.
#[inline]
fn hash(r: &mut Reader<'_>) -> Result<i64, DecodeError> {
    r.i64("block_hashes")
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<i64>, DecodeError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(hash(r)?);
    }
    Ok(v)
}

fn tokens(r: &mut Reader<'_>) -> Result<TokenIds, DecodeError> {
    let n = r.array_len()?;
    if n > 0 && r.kind()? == ValueKind::Array {
        let mut pairs = Vec::with_capacity(n);
        for _ in 0..n {
            let offset = r.pos();
            if r.array_len()? != 2 {
                return Err(DecodeError::UnexpectedType {
                    offset,
                    expected: "a token pair",
                    found: ValueKind::Array,
                });
            }
            pairs.push([r.u64("token_ids")?, r.u64("token_ids")?]);
        }
        return Ok(TokenIds::Bigram(pairs));
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(r.u64("token_ids")?);
    }
    Ok(TokenIds::Flat(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cortex_events_core::msgpack::write;

    /// A tiny builder for hand-made payloads (shapes no release writes).
    #[derive(Default)]
    struct B(Vec<u8>);

    impl B {
        fn arr(mut self, n: usize) -> Self {
            write::array(&mut self.0, n).unwrap();
            self
        }
        fn map(mut self, n: usize) -> Self {
            write::map(&mut self.0, n).unwrap();
            self
        }
        fn s(mut self, v: &str) -> Self {
            write::str(&mut self.0, v).unwrap();
            self
        }
        fn u(mut self, v: u64) -> Self {
            write::uint(&mut self.0, v);
            self
        }
        fn i(mut self, v: i64) -> Self {
            write::int(&mut self.0, v);
            self
        }
        fn nil(mut self) -> Self {
            write::nil(&mut self.0);
            self
        }
        fn head(self) -> Self {
            let mut b = self.arr(3);
            write::f64(&mut b.0, 1.5);
            b.arr(1)
        }
        fn tail(self) -> Vec<u8> {
            self.u(0).0
        }
    }

    fn stored(b: &WireBatch<'_>) -> WireBlockStored<'static> {
        match &b.events[0] {
            WireEvent::BlockStored(s) => WireBlockStored {
                block_hashes: s.block_hashes.clone(),
                parent_block_hash: s.parent_block_hash,
                token_ids: s.token_ids.clone(),
                block_size: s.block_size,
                ..WireBlockStored::default()
            },
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn short_and_long_positional_stores() {
        // 0.5.10-style: no medium; and a future release with two more elements.
        let short = B::default().head().arr(5).s("BlockStored").arr(1).i(-1).nil().arr(1).u(5).u(1).tail();
        let b = decode_wire(&short).unwrap();
        assert_eq!(stored(&b).block_hashes, [-1]);
        let long = B::default()
            .head()
            .arr(10)
            .s("BlockStored")
            .arr(1)
            .i(-1)
            .i(-2)
            .arr(1)
            .u(5)
            .u(1)
            .nil()
            .s("GPU")
            .nil()
            .map(1)
            .s("x")
            .u(1)
            .arr(0)
            .tail();
        let b = decode_wire(&long).unwrap();
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
        assert_eq!((s.parent_block_hash, s.medium, s.cache_salt), (Some(-2), Some("GPU"), None));
    }

    #[test]
    fn map_stores_in_any_key_order_with_unknown_keys() {
        let p = B::default()
            .head()
            .map(7)
            .s("token_ids")
            .arr(2)
            .arr(2)
            .u(1)
            .u(2)
            .arr(2)
            .u(2)
            .u(3)
            .s("origin")
            .s("NEW")
            .s("block_size")
            .u(2)
            .s("type")
            .s("BlockStored")
            .s("block_hashes")
            .arr(1)
            .u(9)
            .s("parent_block_hash")
            .nil()
            .s("lora_id")
            .s("4f1c")
            .tail();
        let b = decode_wire(&p).unwrap();
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
        assert_eq!(s.token_ids, TokenIds::Bigram(vec![[1, 2], [2, 3]]));
        assert_eq!(s.lora_id, Some(LoraId::Str("4f1c")));
    }

    #[test]
    fn malformed_payloads_get_typed_errors() {
        let cases: Vec<(Vec<u8>, DecodeError)> = vec![
            (
                B::default().head().arr(2).s("BlockRemoved").arr(1).u(u64::MAX).tail(),
                DecodeError::OutOfRange { offset: 26, field: "block_hashes" },
            ),
            (
                B::default().head().arr(5).s("BlockStored").arr(0).nil().arr(1).i(-3).u(1).tail(),
                DecodeError::OutOfRange { offset: 27, field: "token_ids" },
            ),
            (
                B::default()
                    .head()
                    .arr(5)
                    .s("BlockStored")
                    .arr(0)
                    .nil()
                    .arr(1)
                    .arr(3)
                    .u(1)
                    .u(2)
                    .u(3)
                    .u(1)
                    .tail(),
                DecodeError::UnexpectedType { offset: 27, expected: "a token pair", found: ValueKind::Array },
            ),
            (
                B::default().head().arr(4).s("BlockStored").arr(0).nil().arr(0).tail(),
                DecodeError::MissingField { offset: 11, event: "BlockStored", field: "block_size" },
            ),
            (B::default().head().arr(1).s("Dropped").tail(), DecodeError::UnknownEventType { offset: 12 }),
            (
                B::default().arr(3).u(1).arr(0).i(-1).0,
                DecodeError::OutOfRange { offset: 3, field: "attn_dp_rank" },
            ),
        ];
        for (payload, want) in cases {
            assert_eq!(decode_wire(&payload).unwrap_err(), want);
        }
    }
}
