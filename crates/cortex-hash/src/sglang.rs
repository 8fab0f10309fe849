//! SGLang's page-hash recipe (0.5.23), byte for byte: what a worker will publish in
//! `block_hashes` for a request.
//!
//! ```text
//! d_i = SHA-256( d_{i-1} (32 raw bytes; omitted for page 0 without a prior)
//!                || page_i tokens as u32 little-endian )          (a "narrow" page)
//! d_i = SHA-256( d_{i-1} || 0xFF || page_i tokens as u64 LE )      (a "wide" page: a token > u32)
//! published block hash h_i = first 8 bytes of d_i, big-endian, as i64
//! ```
//!
//! A cache salt seeds the chain (`d_{-1} = SHA-256("sglang-cache-salt-v1\0" || salt)`). Hashes of
//! a namespaced key are then mapped through [`namespaced_block_hash`]: in the `default` event
//! format only for a registered LoRA adapter, in the `dynamo` format for any extra key or salt.
//! EAGLE speculative decoding hashes "bigram" pages (overlapping token pairs).
//!
//! Key decision: these functions only *predict* hashes (alignment checks). The ledger never keys
//! on them: the recipe is an implementation detail SGLang has changed before.
//! Spec: `docs/engines.md` §3.2 and `golden/sglang/README.md`; checked against every vector of
//! `golden/sglang/hash_vectors.json` by `cargo xtask golden`.

use sha2::{Digest, Sha256};

/// A 32-byte SHA-256 chain digest.
pub type PageDigest = [u8; 32];

/// Why SGLang would reject a token sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SglangHashError {
    /// A token id outside `0..2^63` (SGLang: "token id must be a non-negative int64").
    #[error("token id at position {position} must be a non-negative int64")]
    TokenOutOfRange {
        /// Index of the offending token in the input.
        position: usize,
    },
    /// Page size 0.
    #[error("page size must be positive")]
    ZeroPageSize,
}

/// An integer type SGLang token ids can arrive in. Values outside `0..2^63` are rejected as
/// SGLang rejects them.
pub trait SglangToken: Copy {
    /// The id as a non-negative 63-bit value, or `None` if SGLang would reject it.
    fn to_wide(self) -> Option<u64>;
}

impl SglangToken for u32 {
    #[inline]
    fn to_wide(self) -> Option<u64> {
        Some(u64::from(self))
    }
}

impl SglangToken for u64 {
    #[inline]
    fn to_wide(self) -> Option<u64> {
        (self <= i64::MAX as u64).then_some(self)
    }
}

impl SglangToken for i64 {
    #[inline]
    fn to_wide(self) -> Option<u64> {
        u64::try_from(self).ok()
    }
}

/// The chain digests of `tokens` paged by `page_size`, as SGLang's `get_hash_str` computes them:
/// every page including a short last one, starting from `prior` (a salt seed or the parent's
/// digest). With `bigram`, `tokens` are the raw ids and the hashed units are the overlapping pairs
/// `(t_j, t_{j+1})`, so `n` raw tokens give `n - 1` units.
///
/// ```
/// use cortex_hash::sglang::{chain_digests, published_hash};
///
/// let d = chain_digests(&[1u32, 2, 3, 4], 4, None, false).unwrap();
/// assert_eq!(published_hash(&d[0]), -3488128144981237669);
/// ```
///
/// # Errors
/// [`SglangHashError`] for a zero page size or a token SGLang rejects.
pub fn chain_digests<T: SglangToken>(
    tokens: &[T],
    page_size: usize,
    prior: Option<&PageDigest>,
    bigram: bool,
) -> Result<Vec<PageDigest>, SglangHashError> {
    if page_size == 0 {
        return Err(SglangHashError::ZeroPageSize);
    }
    let wide: Vec<u64> = tokens
        .iter()
        .enumerate()
        .map(|(position, t)| t.to_wide().ok_or(SglangHashError::TokenOutOfRange { position }))
        .collect::<Result<_, _>>()?;
    let units = if bigram { wide.len().saturating_sub(1) } else { wide.len() };
    let mut out = Vec::with_capacity(units.div_ceil(page_size));
    let mut prev = prior.copied();
    // One buffer for every page's bytes: SHA-256 is much faster fed once per page than per token.
    let mut bytes: Vec<u8> = Vec::with_capacity(page_size * if bigram { 16 } else { 8 } + 1);
    let mut start = 0;
    while start < units {
        let end = (start + page_size).min(units);
        // The words this page feeds: the tokens, or for bigram pages each pair's two tokens.
        let words = |j: usize| -> [u64; 2] { if bigram { [wide[j], wide[j + 1]] } else { [wide[j], 0] } };
        let per_unit = if bigram { 2 } else { 1 };
        let is_wide = (start..end).any(|j| words(j)[..per_unit].iter().any(|&w| w > u64::from(u32::MAX)));
        bytes.clear();
        if is_wide {
            bytes.push(0xFF);
        }
        for j in start..end {
            for &w in &words(j)[..per_unit] {
                if is_wide {
                    bytes.extend_from_slice(&w.to_le_bytes());
                } else {
                    // Checked above: every word of a narrow page fits in a u32.
                    bytes.extend_from_slice(&(w as u32).to_le_bytes());
                }
            }
        }
        let mut h = Sha256::new();
        if let Some(p) = &prev {
            h.update(p);
        }
        h.update(&bytes);
        let d: PageDigest = h.finalize().into();
        out.push(d);
        prev = Some(d);
        start = end;
    }
    Ok(out)
}

/// The value SGLang publishes for a digest: its first 8 bytes, big-endian, as `i64`.
#[must_use]
pub fn published_hash(digest: &PageDigest) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(b)
}

/// The chain seed for a cache salt: `SHA-256("sglang-cache-salt-v1\0" || salt)`.
#[must_use]
pub fn salt_seed(salt: &str) -> PageDigest {
    let mut h = Sha256::new();
    h.update(b"sglang-cache-salt-v1\0");
    h.update(salt.as_bytes());
    h.finalize().into()
}

/// `kv_event_namespace_seed(extra_key, cache_salt)`: `None` when both are `None` (no
/// re-namespacing), else `SHA-256("sglang-kv-event-namespace-v1" || part(extra_key) ||
/// part(cache_salt))` with `part(None) = 0x00` and `part(s) = 0x01 || len u64 LE || utf-8`.
#[must_use]
pub fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> Option<PageDigest> {
    if extra_key.is_none() && cache_salt.is_none() {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"sglang-kv-event-namespace-v1");
    for part in [extra_key, cache_salt] {
        match part {
            None => h.update([0u8]),
            Some(s) => {
                h.update([1u8]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    Some(h.finalize().into())
}

/// `namespaced_block_hash(h, seed)`: the first 8 bytes (big-endian `i64`) of
/// `SHA-256(seed || h as 8-byte big-endian two's complement)`.
#[must_use]
pub fn namespaced_block_hash(hash: i64, seed: &PageDigest) -> i64 {
    let mut h = Sha256::new();
    h.update(seed);
    h.update(hash.to_be_bytes());
    published_hash(&h.finalize().into())
}

/// SGLang's KV-event `format` setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventFormat {
    /// `"default"`: hashes re-namespaced only for a registered LoRA adapter.
    Default,
    /// `"dynamo"`: hashes re-namespaced for any extra key or cache salt.
    Dynamo,
}

impl EventFormat {
    /// The configuration spelling.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            EventFormat::Default => "default",
            EventFormat::Dynamo => "dynamo",
        }
    }
}

/// What decides the hashes a request's blocks are published under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestKey<'a> {
    /// The request's `extra_key` (for LoRA: user extra key or "" followed by the adapter id).
    pub extra_key: Option<&'a str>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<&'a str>,
    /// Whether the adapter is registered in the scheduler's `KvEventLoraNames` (its name is then
    /// published as `lora_name`).
    pub lora_registered: bool,
}

/// The hashes SGLang publishes in `BlockStored` for the page-aligned prefix of `tokens`: one per
/// full page (SGLang never inserts a partial page when `page_size > 1`), salted and namespaced as
/// `format` says. Parent hashes are the previous entry (or the value of the prefix before).
///
/// # Errors
/// As [`chain_digests`].
pub fn event_hashes<T: SglangToken>(
    tokens: &[T],
    page_size: usize,
    bigram: bool,
    key: RequestKey<'_>,
    format: EventFormat,
) -> Result<Vec<i64>, SglangHashError> {
    if page_size == 0 {
        return Err(SglangHashError::ZeroPageSize);
    }
    let units = if bigram { tokens.len().saturating_sub(1) } else { tokens.len() };
    let aligned_units = if page_size == 1 { units } else { units - units % page_size };
    let raw =
        if bigram { &tokens[..(aligned_units + 1).min(tokens.len())] } else { &tokens[..aligned_units] };
    let prior = key.cache_salt.map(salt_seed);
    let digests = chain_digests(raw, page_size, prior.as_ref(), bigram)?;
    let seed = match format {
        EventFormat::Default if key.lora_registered => namespace_seed(key.extra_key, None),
        EventFormat::Default => None,
        EventFormat::Dynamo => namespace_seed(key.extra_key, key.cache_salt),
    };
    Ok(digests
        .iter()
        .map(|d| {
            let h = published_hash(d);
            seed.as_ref().map_or(h, |s| namespaced_block_hash(h, s))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brief_goldens() {
        let d = chain_digests(&[1u32, 2, 3, 4], 4, None, false).unwrap();
        assert_eq!(published_hash(&d[0]), -3_488_128_144_981_237_669);
        let d = chain_digests(&[10u32, 20], 4, None, false).unwrap();
        assert_eq!(published_hash(&d[0]), 978_178_666_101_069_530);
    }

    #[test]
    fn rejects_what_sglang_rejects() {
        assert_eq!(
            chain_digests(&[1i64, -1, 3, 4], 4, None, false),
            Err(SglangHashError::TokenOutOfRange { position: 1 })
        );
        assert_eq!(
            chain_digests(&[1u64, 2, 3, u64::MAX], 4, None, false),
            Err(SglangHashError::TokenOutOfRange { position: 3 })
        );
        assert_eq!(chain_digests(&[1u32], 0, None, false), Err(SglangHashError::ZeroPageSize));
    }

    #[test]
    fn event_hashes_drop_the_partial_page() {
        let tokens: Vec<u32> = (1..=10).collect();
        let all = chain_digests(&tokens, 4, None, false).unwrap();
        let ev = event_hashes(
            &tokens,
            4,
            false,
            RequestKey { extra_key: None, cache_salt: None, lora_registered: false },
            EventFormat::Default,
        )
        .unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev, all[..2].iter().map(published_hash).collect::<Vec<_>>());
    }
}
