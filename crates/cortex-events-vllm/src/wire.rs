//! vLLM's KV-event wire format as typed values, field by field, and the decoder that reads them.
//!
//! One decoder reads every release from 0.9 to 0.33: the batch as `[ts, events]` (0.9.0) or
//! `[ts, events, data_parallel_rank]`; each event as a positional array `["BlockStored", f1, …]`
//! (≤ 0.23) or a map with a `"type"` key (≥ 0.24). Fields are matched by name in maps and by
//! position in arrays (positions follow declaration order, which is the order of the fields of
//! [`WireBlockStored`]); unknown keys are ignored, optional fields may be missing, arrays may be
//! longer or (after the required fields) shorter than any release wrote them.
//!
//! Key decision: the wire types borrow strings and `bin`s from the payload and keep exactly what
//! was sent (`None` for nil or absent), so they can be re-encoded byte for byte; interpreting them
//! is [`crate::normalize`]'s job.

use cortex_events_core::event::{self, Fields, Tag};
use cortex_events_core::msgpack::{Int, Reader};
use cortex_events_core::{DecodeError, ValueKind};

/// A block hash as published: an integer of any width (unsigned by default since 0.10.2; Python
/// `hash()` values before that may be negative) or, with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`,
/// the digest itself (32 bytes for SHA-256, 16 for xxh3-128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireHash<'a> {
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer (old releases).
    Int(i64),
    /// A digest as `bin`.
    Bytes(&'a [u8]),
}

/// One element of a block's `extra_keys` entry. The elements are untagged on the wire; their
/// order is LoRA name, multimodal items, cache salt (block 0 only), prompt-embeds digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// A string: the LoRA name, the cache salt, or (0.17–0.18) a bare multimodal identifier.
    Str(&'a str),
    /// A multimodal item `[mm_identifier, offset]`.
    Mm {
        /// The item's identifier (a processor hash or a user `uuid`).
        identifier: &'a str,
        /// Offset of the item within the block.
        offset: i64,
    },
    /// A `bin`: the prompt-embeds digest.
    Bytes(&'a [u8]),
    /// Anything else, kept as its raw MessagePack bytes.
    Other(&'a [u8]),
}

/// One block's `extra_keys` entry: `None` (nil) for a block without extras.
pub type BlockExtraKeys<'a> = Option<Vec<ExtraKey<'a>>>;

/// `BlockStored`, every field by name, in declaration (and positional) order.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WireBlockStored<'a> {
    /// One hash per stored block.
    pub block_hashes: Vec<WireHash<'a>>,
    /// Hash of the block before `block_hashes[0]`; `None` = the chain starts at the root.
    pub parent_block_hash: Option<WireHash<'a>>,
    /// Tokens of all blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block; 0 in offload placeholders.
    pub block_size: u32,
    /// Deprecated LoRA integer id.
    pub lora_id: Option<i64>,
    /// `"GPU"`, `"CPU"`, `"STORAGE"` or a connector's own (since 0.10.2).
    pub medium: Option<&'a str>,
    /// LoRA adapter name (since 0.14).
    pub lora_name: Option<&'a str>,
    /// Per-block extra keys (since 0.17).
    pub extra_keys: Option<Vec<BlockExtraKeys<'a>>>,
    /// KV-cache group index (since 0.20).
    pub group_idx: Option<i64>,
    /// `full_attention`, `sliding_window`, `mamba`, … (since 0.22).
    pub kv_cache_spec_kind: Option<&'a str>,
    /// Sliding window of the group (since 0.22).
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// `"LOCAL"` / `"REMOTE"` for offload tiers (since 0.26).
    pub locality: Option<&'a str>,
    /// Secondary-tier owner id (since 0.29).
    pub ownership: Option<&'a str>,
    /// The request's session id (since 0.30).
    pub session_id: Option<&'a str>,
    /// EAGLE lookahead tokens hashed into each block (since 0.33).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`, every field by name.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WireBlockRemoved<'a> {
    /// One hash per removed block copy.
    pub block_hashes: Vec<WireHash<'a>>,
    /// Tier (since 0.10.2).
    pub medium: Option<&'a str>,
    /// KV-cache group index (since 0.20).
    pub group_idx: Option<i64>,
    /// `"LOCAL"` / `"REMOTE"` (since 0.26).
    pub locality: Option<&'a str>,
    /// Secondary-tier owner id (since 0.29).
    pub ownership: Option<&'a str>,
}

/// One event as published.
#[derive(Clone, Debug, PartialEq)]
pub enum WireEvent<'a> {
    /// `BlockStored`.
    BlockStored(WireBlockStored<'a>),
    /// `BlockRemoved`.
    BlockRemoved(WireBlockRemoved<'a>),
    /// `AllBlocksCleared` (no fields).
    AllBlocksCleared,
}

/// One payload as published: `[ts, events, data_parallel_rank]`.
#[derive(Clone, Debug, PartialEq)]
pub struct WireBatch<'a> {
    /// Wall-clock seconds (`time.time()`).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<WireEvent<'a>>,
    /// The DP rank; `None` when nil or (0.9.0) absent.
    pub data_parallel_rank: Option<u16>,
}

/// Fields in declaration order: a positional event's element `i + 1` is field `i`. The first four
/// have no default in any release.
pub(crate) const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const STORED_REQUIRED: usize = 4;
pub(crate) const REMOVED_FIELDS: [&str; 5] = ["block_hashes", "medium", "group_idx", "locality", "ownership"];

/// Decodes a payload into the wire types, without interpreting it.
///
/// # Errors
/// [`DecodeError`] if the payload is not one well-formed batch.
pub fn decode_wire(payload: &[u8]) -> Result<WireBatch<'_>, DecodeError> {
    let mut r = Reader::new(payload);
    let batch = if r.kind()? == ValueKind::Map {
        batch_map(&mut r)?
    } else {
        let b = event::array_batch(&mut r, "data_parallel_rank", wire_event)?;
        WireBatch { ts: b.ts, events: b.events, data_parallel_rank: b.rank }
    };
    r.finish()?;
    Ok(batch)
}

/// A batch written as a map (`{"ts": …, "events": […], "data_parallel_rank": …}`), as some vLLM
/// development trees declare it; no release in the golden captures does.
fn batch_map<'a>(r: &mut Reader<'a>) -> Result<WireBatch<'a>, DecodeError> {
    let start = r.pos();
    let n = r.map_len()?;
    let (mut ts, mut evs, mut dp_rank) = (None, None, None);
    for _ in 0..n {
        match r.key()? {
            Some(b"ts") => ts = Some(r.f64()?),
            Some(b"events") => evs = Some(event::events(r, wire_event)?),
            Some(b"data_parallel_rank") => dp_rank = r.opt_u16("data_parallel_rank")?,
            _ => r.skip()?,
        }
    }
    let missing = |field| DecodeError::MissingField { offset: start, event: "batch", field };
    Ok(WireBatch {
        ts: ts.ok_or_else(|| missing("ts"))?,
        events: evs.ok_or_else(|| missing("events"))?,
        data_parallel_rank: dp_rank,
    })
}

/// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, …]` or
/// `{"type": "BlockStored", "block_hashes": …, …}`; likewise the other two.
fn wire_event<'a>(r: &mut Reader<'a>) -> Result<WireEvent<'a>, DecodeError> {
    event::event(r, |r, tag, fields: Fields| {
        Ok(match tag {
            Tag::Stored => WireEvent::BlockStored(fields.read_into(
                r,
                "BlockStored",
                &STORED_FIELDS,
                STORED_REQUIRED,
                stored_field,
            )?),
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

/// Reads field number `i` (an index into [`STORED_FIELDS`]; others are skipped).
fn stored_field<'a>(r: &mut Reader<'a>, s: &mut WireBlockStored<'a>, i: usize) -> Result<(), DecodeError> {
    match i {
        0 => s.block_hashes = hashes(r)?,
        1 => s.parent_block_hash = if r.nil()? { None } else { Some(hash(r)?) },
        2 => s.token_ids = tokens(r, "token_ids")?,
        3 => s.block_size = r.u32("block_size")?,
        4 => s.lora_id = r.opt_i64("lora_id")?,
        5 => s.medium = r.opt_str()?,
        6 => s.lora_name = r.opt_str()?,
        7 => s.extra_keys = extra_keys(r)?,
        8 => s.group_idx = r.opt_i64("group_idx")?,
        9 => s.kv_cache_spec_kind = r.opt_str()?,
        10 => s.kv_cache_spec_sliding_window = r.opt_i64("kv_cache_spec_sliding_window")?,
        11 => s.locality = r.opt_str()?,
        12 => s.ownership = r.opt_str()?,
        13 => s.session_id = r.opt_str()?,
        14 => {
            s.lookahead_token_ids = if r.nil()? {
                None
            } else {
                let n = r.array_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(tokens(r, "lookahead_token_ids")?);
                }
                Some(v)
            };
        }
        _ => r.skip()?,
    }
    Ok(())
}

/// Reads field number `i` (an index into [`REMOVED_FIELDS`]; others are skipped).
fn removed_field<'a>(r: &mut Reader<'a>, rm: &mut WireBlockRemoved<'a>, i: usize) -> Result<(), DecodeError> {
    match i {
        0 => rm.block_hashes = hashes(r)?,
        1 => rm.medium = r.opt_str()?,
        2 => rm.group_idx = r.opt_i64("group_idx")?,
        3 => rm.locality = r.opt_str()?,
        4 => rm.ownership = r.opt_str()?,
        _ => r.skip()?,
    }
    Ok(())
}

fn tokens(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<u32>, DecodeError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(r.u32(field)?);
    }
    Ok(v)
}

fn hashes<'a>(r: &mut Reader<'a>) -> Result<Vec<WireHash<'a>>, DecodeError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(hash(r)?);
    }
    Ok(v)
}

#[inline]
fn hash<'a>(r: &mut Reader<'a>) -> Result<WireHash<'a>, DecodeError> {
    if r.kind()? == ValueKind::Bin {
        let offset = r.pos();
        let b = r.bin()?;
        if b.len() == 32 || b.len() == 16 {
            Ok(WireHash::Bytes(b))
        } else {
            Err(DecodeError::HashLength { offset, len: b.len() })
        }
    } else {
        match r.int() {
            Ok(Int::Pos(v)) => Ok(WireHash::Uint(v)),
            Ok(Int::Neg(v)) => Ok(WireHash::Int(v)),
            Err(_) => Err(r.unexpected("a block hash (integer or bin)")),
        }
    }
}

fn extra_keys<'a>(r: &mut Reader<'a>) -> Result<Option<Vec<BlockExtraKeys<'a>>>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    let n = r.array_len()?;
    let mut blocks = Vec::with_capacity(n);
    for _ in 0..n {
        if r.nil()? {
            blocks.push(None);
            continue;
        }
        let m = r.array_len()?;
        let mut keys = Vec::with_capacity(m);
        for _ in 0..m {
            keys.push(extra_key(r)?);
        }
        blocks.push(Some(keys));
    }
    Ok(Some(blocks))
}

fn extra_key<'a>(r: &mut Reader<'a>) -> Result<ExtraKey<'a>, DecodeError> {
    let start = r.pos();
    match r.kind()? {
        ValueKind::Str => return r.str().map(ExtraKey::Str),
        ValueKind::Bin => return r.bin().map(ExtraKey::Bytes),
        ValueKind::Array => {
            // `[mm_identifier, offset]`, or something unknown kept verbatim.
            if r.array_len()? == 2
                && r.kind()? == ValueKind::Str
                && let Ok(identifier) = r.str()
                && r.kind()? == ValueKind::Int
                && let Ok(offset) = r.i64("extra_keys")
            {
                return Ok(ExtraKey::Mm { identifier, offset });
            }
        }
        _ => {}
    }
    r.seek(start);
    r.skip()?;
    Ok(ExtraKey::Other(r.since(start)))
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
        fn bin(mut self, v: &[u8]) -> Self {
            write::bin(&mut self.0, v).unwrap();
            self
        }
        fn ts(mut self) -> Self {
            write::f64(&mut self.0, 1.5);
            self
        }
        fn tokens(self, ts: &[u64]) -> Self {
            ts.iter().fold(self.arr(ts.len()), |b, &t| b.u(t))
        }
    }

    #[test]
    fn the_two_element_batch_of_0_9_and_short_positional_events() {
        // [ts, [["BlockStored", [h], nil, [1,2], 2, nil], ["BlockRemoved", [h]]]]
        let p = B::default()
            .arr(2)
            .ts()
            .arr(2)
            .arr(6)
            .s("BlockStored")
            .arr(1)
            .i(-5)
            .nil()
            .tokens(&[1, 2])
            .u(2)
            .nil()
            .arr(2)
            .s("BlockRemoved")
            .arr(1)
            .i(-5);
        let b = decode_wire(&p.0).unwrap();
        assert_eq!(b.data_parallel_rank, None);
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
        assert_eq!(
            (s.block_hashes.as_slice(), s.token_ids.as_slice(), s.medium),
            (&[WireHash::Int(-5)][..], &[1, 2][..], None)
        );
        assert_eq!(
            b.events[1],
            WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: vec![WireHash::Int(-5)],
                ..Default::default()
            })
        );
    }

    #[test]
    fn extra_trailing_elements_are_ignored_and_missing_required_ones_are_not() {
        let stored = |fields: usize| {
            let mut b = B::default().arr(3).ts().arr(1).arr(1 + fields).s("BlockStored");
            for i in 0..fields {
                b = match i {
                    0 => b.arr(1).u(7),
                    1 => b.nil(),
                    2 => b.tokens(&[1]),
                    3 => b.u(1),
                    4..15 => b.nil(),
                    _ => b.map(1).s("future").arr(1).arr(1).nil(),
                };
            }
            b.u(0).0
        };
        assert!(decode_wire(&stored(4)).is_ok());
        assert!(decode_wire(&stored(20)).is_ok());
        assert_eq!(
            decode_wire(&stored(3)).unwrap_err(),
            DecodeError::MissingField { offset: 11, event: "BlockStored", field: "block_size" }
        );
    }

    #[test]
    fn map_events_match_keys_by_name_in_any_order() {
        // {"future": {..}, 1: 2, "token_ids": [3], "block_size": 1, "type": "BlockStored",
        //  "parent_block_hash": bin(16), "block_hashes": [bin(32)], "session_id": "s"}
        let p = B::default()
            .arr(3)
            .ts()
            .arr(1)
            .map(8)
            .s("future")
            .map(1)
            .s("x")
            .arr(2)
            .u(1)
            .nil()
            .u(1)
            .u(2)
            .s("token_ids")
            .tokens(&[3])
            .s("block_size")
            .u(1)
            .s("type")
            .s("BlockStored")
            .s("parent_block_hash")
            .bin(&[1; 16])
            .s("block_hashes")
            .arr(1)
            .bin(&[2; 32])
            .s("session_id")
            .s("s")
            .u(3);
        let b = decode_wire(&p.0).unwrap();
        assert_eq!(b.data_parallel_rank, Some(3));
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
        assert_eq!(s.parent_block_hash, Some(WireHash::Bytes(&[1; 16])));
        assert_eq!(s.block_hashes, [WireHash::Bytes(&[2; 32])]);
        assert_eq!((s.token_ids.as_slice(), s.block_size, s.session_id), (&[3][..], 1, Some("s")));
    }

    #[test]
    fn malformed_payloads_get_typed_errors() {
        let event =
            |e: B| B::default().arr(3).ts().arr(1).0.into_iter().chain(e.0).chain([0]).collect::<Vec<u8>>();
        let cases: Vec<(Vec<u8>, DecodeError)> = vec![
            (vec![], DecodeError::Truncated { offset: 0 }),
            (B::default().arr(1).ts().0, DecodeError::BatchShape { len: 1 }),
            (event(B::default().arr(1).s("BlockUpdated")), DecodeError::UnknownEventType { offset: 12 }),
            (
                event(B::default().map(1).s("block_hashes").arr(0)),
                DecodeError::MissingField { offset: 11, event: "event", field: "type" },
            ),
            (
                event(B::default().map(1).s("type").s("BlockRemoved")),
                DecodeError::MissingField { offset: 11, event: "BlockRemoved", field: "block_hashes" },
            ),
            (
                event(B::default().arr(2).s("BlockRemoved").arr(1).bin(&[0; 20])),
                DecodeError::HashLength { offset: 26, len: 20 },
            ),
            (
                event(B::default().arr(2).s("BlockRemoved").arr(1).s("h")),
                DecodeError::UnexpectedType {
                    offset: 26,
                    expected: "a block hash (integer or bin)",
                    found: ValueKind::Str,
                },
            ),
            (
                event(B::default().u(1)),
                DecodeError::UnexpectedType {
                    offset: 11,
                    expected: "an event (array or map)",
                    found: ValueKind::Int,
                },
            ),
            (
                B::default().arr(3).ts().arr(0).u(70_000).0,
                DecodeError::OutOfRange { offset: 11, field: "data_parallel_rank" },
            ),
            (B::default().arr(3).ts().arr(0).u(0).u(0).0, DecodeError::TrailingBytes { offset: 12 }),
        ];
        for (payload, want) in cases {
            assert_eq!(decode_wire(&payload).unwrap_err(), want, "{}", payload.len());
        }
    }

    #[test]
    fn a_map_batch_is_read_by_key() {
        let p = B::default()
            .map(3)
            .s("events")
            .arr(1)
            .arr(1)
            .s("AllBlocksCleared")
            .s("ts")
            .ts()
            .s("data_parallel_rank")
            .u(2);
        let b = decode_wire(&p.0).unwrap();
        assert_eq!(
            (b.ts, b.events.as_slice(), b.data_parallel_rank),
            (1.5, &[WireEvent::AllBlocksCleared][..], Some(2))
        );
    }

    #[test]
    fn extra_keys_elements_keep_their_type() {
        // [["lora", ["mm-1", 4], bin(32), [1, 2, 3]], nil]
        let p = B::default()
            .arr(3)
            .ts()
            .arr(1)
            .map(6)
            .s("type")
            .s("BlockStored")
            .s("block_hashes")
            .arr(0)
            .s("parent_block_hash")
            .nil()
            .s("token_ids")
            .arr(0)
            .s("block_size")
            .u(0)
            .s("extra_keys")
            .arr(2)
            .arr(4)
            .s("lora")
            .arr(2)
            .s("mm-1")
            .u(4)
            .bin(&[9; 32])
            .arr(3)
            .u(1)
            .u(2)
            .u(3)
            .nil()
            .nil();
        let b = decode_wire(&p.0).unwrap();
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("{b:?}") };
        let keys = s.extra_keys.as_ref().unwrap();
        assert_eq!(
            keys[0].as_deref().unwrap(),
            [
                ExtraKey::Str("lora"),
                ExtraKey::Mm { identifier: "mm-1", offset: 4 },
                ExtraKey::Bytes(&[9; 32]),
                ExtraKey::Other(&[0x93, 1, 2, 3]),
            ]
        );
        assert_eq!(keys[1], None);
    }
}
