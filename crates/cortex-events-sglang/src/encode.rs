//! Writes [`WireBatch`]es exactly as SGLang's `msgspec` encoder does, for the simulator.
//!
//! Two encodings exist (`golden/sglang/format_history.json`): positional-array events up to
//! 0.5.19 (full length, nil where `None`; a salted store is `BlockStoredWithMetadata`, the same
//! tag with an eighth element `{"cache_salt": S}`), and tagged maps since 0.5.20 (fields without a
//! default — `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id` — always
//! present, `medium`, `cache_salt`, `session_id`, `lora_name` omitted when `None`). The batch is
//! `[ts float64, events, attn_dp_rank]` in both.
//!
//! Key decision: a field the encoding cannot carry (`session_id` or `lora_name` in arrays) is an
//! error, not silently dropped.

use crate::wire::{LoraId, REMOVED_FIELDS, STORED_FIELDS, TokenIds, WireBatch, WireBlockStored, WireEvent};
use cortex_events_core::EncodeError;
use cortex_events_core::msgpack::write;

/// Which event encoding an SGLang release publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// 0.5.18 – 0.5.19: positional arrays, `BlockStoredWithMetadata` for salted stores.
    Arrays,
    /// 0.5.20 and later: maps with a `"type"` key.
    Maps,
}

/// `BlockStored` fields without a default (always present in maps).
const STORED_REQUIRED: usize = 5;

/// Encodes `batch` as SGLang publishes it with `encoding`: the bytes of frame 2 of a live message.
///
/// # Errors
/// [`EncodeError::FieldNotInFormat`] for a field the encoding cannot carry;
/// [`EncodeError::TooLong`] for a collection beyond MessagePack's limits.
pub fn encode(batch: &WireBatch<'_>, encoding: Encoding) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 128);
    write::array(&mut out, 3).ok_or(EncodeError::TooLong { field: "batch" })?;
    write::f64(&mut out, batch.ts);
    write::array(&mut out, batch.events.len()).ok_or(EncodeError::TooLong { field: "events" })?;
    for ev in &batch.events {
        match (ev, encoding) {
            (WireEvent::BlockStored(s), Encoding::Maps) => stored_map(&mut out, s)?,
            (WireEvent::BlockStored(s), Encoding::Arrays) => stored_array(&mut out, s)?,
            (WireEvent::BlockRemoved(r), Encoding::Maps) => {
                let present = 2 + usize::from(r.medium.is_some());
                write::map(&mut out, present).ok_or(EncodeError::TooLong { field: "event" })?;
                str(&mut out, "type", "type")?;
                str(&mut out, "BlockRemoved", "type")?;
                str(&mut out, REMOVED_FIELDS[0], "key")?;
                hashes(&mut out, &r.block_hashes)?;
                if let Some(m) = r.medium {
                    str(&mut out, REMOVED_FIELDS[1], "key")?;
                    str(&mut out, m, "medium")?;
                }
            }
            (WireEvent::BlockRemoved(r), Encoding::Arrays) => {
                write::array(&mut out, 3).ok_or(EncodeError::TooLong { field: "event" })?;
                str(&mut out, "BlockRemoved", "type")?;
                hashes(&mut out, &r.block_hashes)?;
                opt_str(&mut out, r.medium, "medium")?;
            }
            (WireEvent::AllBlocksCleared, Encoding::Maps) => {
                write::map(&mut out, 1).ok_or(EncodeError::TooLong { field: "event" })?;
                str(&mut out, "type", "type")?;
                str(&mut out, "AllBlocksCleared", "type")?;
            }
            (WireEvent::AllBlocksCleared, Encoding::Arrays) => {
                write::array(&mut out, 1).ok_or(EncodeError::TooLong { field: "event" })?;
                str(&mut out, "AllBlocksCleared", "type")?;
            }
        }
    }
    match batch.attn_dp_rank {
        Some(r) => write::uint(&mut out, u64::from(r)),
        None => write::nil(&mut out),
    }
    Ok(out)
}

fn str(out: &mut Vec<u8>, s: &str, field: &'static str) -> Result<(), EncodeError> {
    write::str(out, s).ok_or(EncodeError::TooLong { field })
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>, field: &'static str) -> Result<(), EncodeError> {
    match s {
        Some(s) => str(out, s, field),
        None => {
            write::nil(out);
            Ok(())
        }
    }
}

fn hashes(out: &mut Vec<u8>, hs: &[i64]) -> Result<(), EncodeError> {
    write::array(out, hs.len()).ok_or(EncodeError::TooLong { field: "block_hashes" })?;
    for &h in hs {
        write::int(out, h);
    }
    Ok(())
}

fn tokens(out: &mut Vec<u8>, t: &TokenIds) -> Result<(), EncodeError> {
    let long = EncodeError::TooLong { field: "token_ids" };
    match t {
        TokenIds::Flat(ids) => {
            write::array(out, ids.len()).ok_or(long)?;
            for &id in ids {
                write::uint(out, id);
            }
        }
        TokenIds::Bigram(pairs) => {
            write::array(out, pairs.len()).ok_or(long)?;
            for &[a, b] in pairs {
                write::array(out, 2).ok_or(EncodeError::TooLong { field: "token_ids" })?;
                write::uint(out, a);
                write::uint(out, b);
            }
        }
    }
    Ok(())
}

/// The fields both encodings share, in declaration order: `block_hashes` … `lora_id`.
fn common(out: &mut Vec<u8>, s: &WireBlockStored<'_>, keys: bool) -> Result<(), EncodeError> {
    let key = |out: &mut Vec<u8>, i: usize| if keys { str(out, STORED_FIELDS[i], "key") } else { Ok(()) };
    key(out, 0)?;
    hashes(out, &s.block_hashes)?;
    key(out, 1)?;
    match s.parent_block_hash {
        Some(h) => write::int(out, h),
        None => write::nil(out),
    }
    key(out, 2)?;
    tokens(out, &s.token_ids)?;
    key(out, 3)?;
    write::uint(out, u64::from(s.block_size));
    key(out, 4)?;
    match s.lora_id {
        None => write::nil(out),
        Some(LoraId::Int(v)) => write::int(out, v),
        Some(LoraId::Str(v)) => str(out, v, "lora_id")?,
    }
    Ok(())
}

fn stored_map(out: &mut Vec<u8>, s: &WireBlockStored<'_>) -> Result<(), EncodeError> {
    let optional = [s.medium, s.cache_salt, s.session_id, s.lora_name];
    let present = 1 + STORED_REQUIRED + optional.iter().filter(|v| v.is_some()).count();
    write::map(out, present).ok_or(EncodeError::TooLong { field: "event" })?;
    str(out, "type", "type")?;
    str(out, "BlockStored", "type")?;
    common(out, s, true)?;
    for (i, v) in optional.iter().enumerate() {
        if let Some(v) = v {
            let name = STORED_FIELDS[STORED_REQUIRED + i];
            str(out, name, "key")?;
            str(out, v, name)?;
        }
    }
    Ok(())
}

fn stored_array(out: &mut Vec<u8>, s: &WireBlockStored<'_>) -> Result<(), EncodeError> {
    if s.session_id.is_some() {
        return Err(EncodeError::FieldNotInFormat { field: "session_id" });
    }
    if s.lora_name.is_some() {
        return Err(EncodeError::FieldNotInFormat { field: "lora_name" });
    }
    write::array(out, if s.cache_salt.is_some() { 8 } else { 7 })
        .ok_or(EncodeError::TooLong { field: "event" })?;
    str(out, "BlockStored", "type")?;
    common(out, s, false)?;
    opt_str(out, s.medium, "medium")?;
    if let Some(salt) = s.cache_salt {
        write::map(out, 1).ok_or(EncodeError::TooLong { field: "metadata" })?;
        str(out, "cache_salt", "key")?;
        str(out, salt, "cache_salt")?;
    }
    Ok(())
}
