//! Writes [`WireBatch`]es exactly as a given vLLM release's `msgspec` encoder does, for the
//! simulator.
//!
//! What a release decides: whether the batch carries the DP rank (0.9.1+), whether events are
//! positional arrays (≤ 0.23, full length for that release, nil where `None`) or maps with a
//! `"type"` key (≥ 0.24: fields without a default always present, fields defaulting to `None`
//! omitted when `None`), which fields exist, and the map header form (msgspec sizes a struct's map
//! header by the number of keys the struct *could* have, so 0.33's `BlockStored`, with 16
//! possible keys, always gets a map16 header, and 0.30's, with 15, a fixmap).
//!
//! Key decision: a field the release does not have is an error, not silently dropped; a simulator
//! asking for an impossible event is a bug worth hearing about.

use crate::wire::{
    BlockExtraKeys, ExtraKey, REMOVED_FIELDS, STORED_FIELDS, WireBatch, WireBlockRemoved, WireBlockStored,
    WireEvent, WireHash,
};
use cortex_events_core::EncodeError;
use cortex_events_core::msgpack::write;

/// A vLLM release, as far as the event format is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    major: u16,
    minor: u16,
    patch: u16,
}

impl Version {
    /// The newest release whose format this crate knows. Later releases are written like it.
    pub const LATEST: Version = Version::new(0, 33, 0);
    /// The last release with positional-array events.
    pub const LAST_ARRAY: Version = Version::new(0, 23, 0);

    /// `major.minor.patch`.
    #[must_use]
    pub const fn new(major: u16, minor: u16, patch: u16) -> Self {
        Version { major, minor, patch }
    }

    const fn at_least(self, major: u16, minor: u16, patch: u16) -> bool {
        let (a, b) = ((self.major, self.minor, self.patch), (major, minor, patch));
        a.0 > b.0 || (a.0 == b.0 && (a.1 > b.1 || (a.1 == b.1 && a.2 >= b.2)))
    }

    /// Events are maps (≥ 0.24) rather than positional arrays.
    #[must_use]
    pub const fn tagged_maps(self) -> bool {
        self.at_least(0, 24, 0)
    }

    /// The batch has a third element, the DP rank (≥ 0.9.1).
    #[must_use]
    pub const fn has_rank(self) -> bool {
        self.at_least(0, 9, 1)
    }

    /// How many `BlockStored` fields this release declares (a prefix of [`STORED_FIELDS`]).
    const fn stored_fields(self) -> usize {
        if self.at_least(0, 33, 0) {
            15
        } else if self.at_least(0, 30, 0) {
            14
        } else if self.at_least(0, 29, 0) {
            13
        } else if self.at_least(0, 26, 0) {
            12
        } else if self.at_least(0, 22, 0) {
            11
        } else if self.at_least(0, 20, 0) {
            9
        } else if self.at_least(0, 17, 0) {
            8
        } else if self.at_least(0, 14, 0) {
            7
        } else if self.at_least(0, 10, 2) {
            6
        } else {
            5
        }
    }

    /// How many `BlockRemoved` fields this release declares (a prefix of [`REMOVED_FIELDS`]).
    const fn removed_fields(self) -> usize {
        if self.at_least(0, 29, 0) {
            5
        } else if self.at_least(0, 26, 0) {
            4
        } else if self.at_least(0, 20, 0) {
            3
        } else if self.at_least(0, 10, 2) {
            2
        } else {
            1
        }
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// `BlockStored` fields without a default (always present in maps): up to `lora_name`.
const STORED_REQUIRED: usize = 7;
/// `BlockRemoved` fields without a default: `block_hashes`, `medium`.
const REMOVED_REQUIRED: usize = 2;

/// Encodes `batch` as vLLM `version` publishes it: the bytes of frame 2 of a live message.
///
/// # Errors
/// [`EncodeError::FieldNotInFormat`] if the batch sets a field (or the DP rank) `version` does
/// not have; [`EncodeError::TooLong`] for a collection beyond MessagePack's limits.
pub fn encode(batch: &WireBatch<'_>, version: Version) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 128);
    let long = |field| EncodeError::TooLong { field };
    if version.has_rank() {
        write::array(&mut out, 3).ok_or_else(|| long("batch"))?;
    } else if batch.data_parallel_rank.is_some() {
        return Err(EncodeError::FieldNotInFormat { field: "data_parallel_rank" });
    } else {
        write::array(&mut out, 2).ok_or_else(|| long("batch"))?;
    }
    write::f64(&mut out, batch.ts);
    write::array(&mut out, batch.events.len()).ok_or_else(|| long("events"))?;
    for ev in &batch.events {
        match ev {
            WireEvent::BlockStored(s) => stored(&mut out, s, version)?,
            WireEvent::BlockRemoved(r) => removed(&mut out, r, version)?,
            WireEvent::AllBlocksCleared => {
                if version.tagged_maps() {
                    write::map(&mut out, 1).ok_or_else(|| long("event"))?;
                    tag(&mut out, "AllBlocksCleared")?;
                } else {
                    write::array(&mut out, 1).ok_or_else(|| long("event"))?;
                    write::str(&mut out, "AllBlocksCleared").ok_or_else(|| long("type"))?;
                }
            }
        }
    }
    if version.has_rank() {
        match batch.data_parallel_rank {
            Some(r) => write::uint(&mut out, u64::from(r)),
            None => write::nil(&mut out),
        }
    }
    Ok(out)
}

fn tag(out: &mut Vec<u8>, name: &'static str) -> Result<(), EncodeError> {
    write::str(out, "type").ok_or(EncodeError::TooLong { field: "type" })?;
    write::str(out, name).ok_or(EncodeError::TooLong { field: "type" })
}

/// One field's value; a field is `None` when it holds nothing (nil, or omitted from a map if it
/// has a default).
#[derive(Clone, Copy)]
enum Val<'f> {
    Hashes(&'f [WireHash<'f>]),
    Hash(WireHash<'f>),
    Tokens(&'f [u32]),
    Uint(u64),
    Int(i64),
    Str(&'f str),
    ExtraKeys(&'f [BlockExtraKeys<'f>]),
    Lookahead(&'f [Vec<u32>]),
}

/// Writes an event: `fields` in declaration order (named by `names`), the first `declared` of
/// them existing in this release, the first `required` without a default.
fn event(
    out: &mut Vec<u8>,
    version: Version,
    name: &'static str,
    names: &[&'static str],
    fields: &[Option<Val<'_>>],
    declared: usize,
    required: usize,
) -> Result<(), EncodeError> {
    if let Some(i) = (declared..fields.len()).find(|&i| fields[i].is_some()) {
        return Err(EncodeError::FieldNotInFormat { field: names[i] });
    }
    let fields = &fields[..declared.min(fields.len())];
    if version.tagged_maps() {
        let present = fields.iter().enumerate().filter(|(i, f)| *i < required || f.is_some()).count();
        write::struct_map(out, 1 + present, 1 + declared).ok_or(EncodeError::TooLong { field: "event" })?;
        tag(out, name)?;
        for (i, f) in fields.iter().enumerate() {
            if i >= required && f.is_none() {
                continue;
            }
            write::str(out, names[i]).ok_or(EncodeError::TooLong { field: "key" })?;
            value(out, *f, names[i])?;
        }
    } else {
        write::array(out, 1 + declared).ok_or(EncodeError::TooLong { field: "event" })?;
        write::str(out, name).ok_or(EncodeError::TooLong { field: "type" })?;
        for (i, f) in fields.iter().enumerate() {
            value(out, *f, names[i])?;
        }
    }
    Ok(())
}

fn value(out: &mut Vec<u8>, v: Option<Val<'_>>, field: &'static str) -> Result<(), EncodeError> {
    let long = || EncodeError::TooLong { field };
    match v {
        None => write::nil(out),
        Some(Val::Hashes(hs)) => {
            write::array(out, hs.len()).ok_or_else(long)?;
            for &h in hs {
                hash(out, h).ok_or_else(long)?;
            }
        }
        Some(Val::Hash(h)) => hash(out, h).ok_or_else(long)?,
        Some(Val::Tokens(ts)) => tokens(out, ts).ok_or_else(long)?,
        Some(Val::Uint(v)) => write::uint(out, v),
        Some(Val::Int(v)) => write::int(out, v),
        Some(Val::Str(s)) => write::str(out, s).ok_or_else(long)?,
        Some(Val::ExtraKeys(blocks)) => {
            write::array(out, blocks.len()).ok_or_else(long)?;
            for block in blocks {
                match block {
                    None => write::nil(out),
                    Some(keys) => {
                        write::array(out, keys.len()).ok_or_else(long)?;
                        for k in keys {
                            extra_key(out, k).ok_or_else(long)?;
                        }
                    }
                }
            }
        }
        Some(Val::Lookahead(lists)) => {
            write::array(out, lists.len()).ok_or_else(long)?;
            for ts in lists {
                tokens(out, ts).ok_or_else(long)?;
            }
        }
    }
    Ok(())
}

fn hash(out: &mut Vec<u8>, h: WireHash<'_>) -> Option<()> {
    match h {
        WireHash::Uint(v) => write::uint(out, v),
        WireHash::Int(v) => write::int(out, v),
        WireHash::Bytes(b) => write::bin(out, b)?,
    }
    Some(())
}

fn tokens(out: &mut Vec<u8>, ts: &[u32]) -> Option<()> {
    write::array(out, ts.len())?;
    for &t in ts {
        write::uint(out, u64::from(t));
    }
    Some(())
}

fn extra_key(out: &mut Vec<u8>, k: &ExtraKey<'_>) -> Option<()> {
    match *k {
        ExtraKey::Str(s) => write::str(out, s)?,
        ExtraKey::Mm { identifier, offset } => {
            write::array(out, 2)?;
            write::str(out, identifier)?;
            write::int(out, offset);
        }
        ExtraKey::Bytes(b) => write::bin(out, b)?,
        ExtraKey::Other(raw) => out.extend_from_slice(raw),
    }
    Some(())
}

fn stored(out: &mut Vec<u8>, s: &WireBlockStored<'_>, version: Version) -> Result<(), EncodeError> {
    let fields = [
        Some(Val::Hashes(&s.block_hashes)),
        s.parent_block_hash.map(Val::Hash),
        Some(Val::Tokens(&s.token_ids)),
        Some(Val::Uint(u64::from(s.block_size))),
        s.lora_id.map(Val::Int),
        s.medium.map(Val::Str),
        s.lora_name.map(Val::Str),
        s.extra_keys.as_deref().map(Val::ExtraKeys),
        s.group_idx.map(Val::Int),
        s.kv_cache_spec_kind.map(Val::Str),
        s.kv_cache_spec_sliding_window.map(Val::Int),
        s.locality.map(Val::Str),
        s.ownership.map(Val::Str),
        s.session_id.map(Val::Str),
        s.lookahead_token_ids.as_deref().map(Val::Lookahead),
    ];
    event(out, version, "BlockStored", &STORED_FIELDS, &fields, version.stored_fields(), STORED_REQUIRED)
}

fn removed(out: &mut Vec<u8>, r: &WireBlockRemoved<'_>, version: Version) -> Result<(), EncodeError> {
    let fields = [
        Some(Val::Hashes(&r.block_hashes)),
        r.medium.map(Val::Str),
        r.group_idx.map(Val::Int),
        r.locality.map(Val::Str),
        r.ownership.map(Val::Str),
    ];
    event(out, version, "BlockRemoved", &REMOVED_FIELDS, &fields, version.removed_fields(), REMOVED_REQUIRED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_and_gate_fields() {
        assert!(Version::new(0, 9, 1) > Version::new(0, 9, 0));
        assert!(!Version::new(0, 9, 0).has_rank());
        assert!(Version::new(0, 9, 1).has_rank());
        assert!(!Version::LAST_ARRAY.tagged_maps());
        assert!(Version::new(0, 24, 0).tagged_maps());
        assert_eq!(Version::new(0, 10, 1).stored_fields(), 5);
        assert_eq!(Version::new(0, 10, 2).stored_fields(), 6);
        assert_eq!(Version::LAST_ARRAY.stored_fields(), 11);
        assert_eq!(Version::new(0, 32, 4).stored_fields(), 14);
        assert_eq!(Version::new(1, 0, 0).stored_fields(), 15);
        assert_eq!(Version::LATEST.to_string(), "0.33.0");
    }

    #[test]
    fn a_field_the_release_lacks_is_refused() {
        let s = WireBlockStored { session_id: Some("s"), ..WireBlockStored::default() };
        let batch =
            WireBatch { ts: 0.0, events: vec![WireEvent::BlockStored(s)], data_parallel_rank: Some(0) };
        assert_eq!(
            encode(&batch, Version::new(0, 29, 0)),
            Err(EncodeError::FieldNotInFormat { field: "session_id" })
        );
        assert!(encode(&batch, Version::new(0, 30, 0)).is_ok());
        let ranked = WireBatch { ts: 0.0, events: vec![], data_parallel_rank: Some(1) };
        assert_eq!(
            encode(&ranked, Version::new(0, 9, 0)),
            Err(EncodeError::FieldNotInFormat { field: "data_parallel_rank" })
        );
    }

    #[test]
    fn struct_map_headers_follow_the_declared_field_count() {
        let s = WireBlockStored { block_size: 16, medium: Some("GPU"), ..WireBlockStored::default() };
        let batch =
            WireBatch { ts: 0.0, events: vec![WireEvent::BlockStored(s)], data_parallel_rank: Some(0) };
        let latest = encode(&batch, Version::LATEST).unwrap();
        // [ts(9 bytes), [ {…} ] ]: the event starts at byte 11.
        assert_eq!(latest[11..14], [0xde, 0x00, 0x08]);
        let v030 = encode(&batch, Version::new(0, 30, 0)).unwrap();
        assert_eq!(v030[11], 0x88);
    }
}
