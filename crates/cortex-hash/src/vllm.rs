//! vLLM's block-hash recipes (v1 engine, 0.10.2 → 0.33), byte for byte: what a worker will
//! publish in `block_hashes` for a request.
//!
//! ```text
//! block_hash[i] = H( serialize( (parent digest or NONE_HASH, tuple(tokens_i), extra_keys_i) ) )
//! NONE_HASH     = H( serialize(seed string) )   seed = "vllm-none-hash" (>= 0.29) or $PYTHONHASHSEED
//! wire value    = low 64 bits of the digest (int.from_bytes(d, "big") & (2**64 - 1)), or the digest
//! ```
//!
//! `H` and `serialize` per `--prefix-caching-hash-algo`: `sha256` (pickle protocol 5 → SHA-256),
//! `sha256_cbor` (canonical CBOR → SHA-256), `xxhash` (pickle → xxh3-128), `xxhash_cbor`
//! (CBOR → xxh3-128). Extra keys: LoRA on every block, cache salt on block 0 only, tagged
//! (`("lora", name, path)`, `("cache_salt", salt)`) since 0.31 and bare before.
//!
//! Key decision: the pickle and CBOR encoders below write exactly the small shapes these preimages
//! have (a 3-tuple of bytes, a tuple of ints and a tuple of string tuples), not general
//! serializers; each is checked byte for byte against vLLM's own preimages in
//! `golden/vllm/hash_golden.json`. Multimodal, prompt-embeds and EAGLE-lookahead keys are not
//! reproducible outside vLLM and are refused. Spec: `docs/engines.md` §3.1.

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::Token;

/// `--prefix-caching-hash-algo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// `sha256`: pickle protocol 5, SHA-256 (the default).
    Sha256,
    /// `sha256_cbor`: canonical CBOR, SHA-256.
    Sha256Cbor,
    /// `xxhash`: pickle protocol 5, xxh3-128.
    Xxhash,
    /// `xxhash_cbor`: canonical CBOR, xxh3-128.
    XxhashCbor,
}

impl HashAlgo {
    /// Parses vLLM's spelling.
    #[must_use]
    pub fn parse(s: &str) -> Option<HashAlgo> {
        Some(match s {
            "sha256" => HashAlgo::Sha256,
            "sha256_cbor" => HashAlgo::Sha256Cbor,
            "xxhash" => HashAlgo::Xxhash,
            "xxhash_cbor" => HashAlgo::XxhashCbor,
            _ => return None,
        })
    }

    /// vLLM's spelling.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    const fn is_pickle(self) -> bool {
        matches!(self, HashAlgo::Sha256 | HashAlgo::Xxhash)
    }

    fn digest_of(self, preimage: &[u8]) -> VllmDigest {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                VllmDigest { bytes: Sha256::digest(preimage).into(), len: 32 }
            }
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                let mut bytes = [0u8; 32];
                bytes[..16].copy_from_slice(&xxh3_128(preimage).to_be_bytes());
                VllmDigest { bytes, len: 16 }
            }
        }
    }
}

/// The digest `algo` computes over `preimage` (SHA-256, or xxh3-128 as big-endian bytes).
#[must_use]
pub fn digest(algo: HashAlgo, preimage: &[u8]) -> VllmDigest {
    algo.digest_of(preimage)
}

/// Where `NONE_HASH`, the parent of block 0, comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NoneHashSeed {
    /// vLLM ≥ 0.29 with `PYTHONHASHSEED` unset and a SHA-256 algorithm: `"vllm-none-hash"`.
    /// (With `xxhash*` and no seed vLLM draws a random seed: not reproducible.)
    Default,
    /// `PYTHONHASHSEED` as set in the worker's environment (any version ≥ 0.10.2).
    PythonHashSeed(String),
}

impl NoneHashSeed {
    /// The seed string vLLM serializes.
    #[must_use]
    pub fn as_str(&self) -> &str {
        match self {
            NoneHashSeed::Default => "vllm-none-hash",
            NoneHashSeed::PythonHashSeed(s) => s,
        }
    }
}

/// How extra keys enter the hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKeyForm {
    /// vLLM ≥ 0.31: `("lora", name, path)`, `("cache_salt", salt)`.
    Tagged,
    /// vLLM 0.12 – 0.30: the LoRA name and the salt as bare strings.
    Untagged,
}

/// A full vLLM digest (32 bytes for SHA-256, 16 for xxh3-128).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct VllmDigest {
    bytes: [u8; 32],
    len: u8,
}

impl VllmDigest {
    /// The digest bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// What `BlockStored.block_hashes` carries by default: the low 64 bits.
    #[must_use]
    pub fn wire_u64(&self) -> u64 {
        let b = self.as_bytes();
        let mut be = [0u8; 8];
        be.copy_from_slice(&b[b.len() - 8..]);
        u64::from_be_bytes(be)
    }
}

impl std::fmt::Debug for VllmDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VllmDigest(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

/// A LoRA adapter as vLLM hashes it (≥ 0.31 hashes the path too; `/v1/models` lists it as the
/// adapter card's `root`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lora<'a> {
    /// Adapter name.
    pub name: &'a str,
    /// Adapter path.
    pub path: &'a str,
}

/// The request-level inputs of the extra keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RequestExtras<'a> {
    /// The LoRA adapter, if any.
    pub lora: Option<Lora<'a>>,
    /// `cache_salt`, if any.
    pub cache_salt: Option<&'a str>,
}

/// Why a vLLM hash could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VllmHashError {
    /// Block size 0.
    #[error("block size must be positive")]
    ZeroBlockSize,
    /// A preimage larger than one pickle frame (64 KiB): vLLM's pickler would split frames,
    /// which this encoder does not reproduce.
    #[error("pickle preimage of {0} bytes exceeds one 64 KiB frame")]
    PreimageTooLarge(usize),
}

/// A configured vLLM block hasher: algorithm, `NONE_HASH` and extra-key form.
///
/// ```
/// use cortex_hash::vllm::{BlockHasher, ExtraKeyForm, HashAlgo, NoneHashSeed, RequestExtras};
///
/// let hasher = BlockHasher::new(HashAlgo::Sha256, &NoneHashSeed::Default, ExtraKeyForm::Tagged);
/// let tokens: Vec<u32> = (1..=48).collect();
/// let hashes = hasher.block_hashes(&tokens, 16, RequestExtras::default()).unwrap();
/// assert_eq!(hashes[0].wire_u64(), 1403909460543360175);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: VllmDigest,
    form: ExtraKeyForm,
}

impl BlockHasher {
    /// A hasher for `algo` with `NONE_HASH` derived from `seed`.
    #[must_use]
    pub fn new(algo: HashAlgo, seed: &NoneHashSeed, form: ExtraKeyForm) -> Self {
        BlockHasher { algo, none_hash: algo.digest_of(&none_hash_preimage(algo, seed.as_str())), form }
    }

    /// The algorithm.
    #[must_use]
    pub const fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// `NONE_HASH`, the parent of block 0.
    #[must_use]
    pub const fn none_hash(&self) -> &VllmDigest {
        &self.none_hash
    }

    /// Full digests of every full block of `tokens` (vLLM hashes full blocks only).
    ///
    /// # Errors
    /// [`VllmHashError`] for a zero block size or an oversized pickle preimage.
    pub fn block_hashes(
        &self,
        tokens: &[Token],
        block_size: usize,
        extras: RequestExtras<'_>,
    ) -> Result<Vec<VllmDigest>, VllmHashError> {
        if block_size == 0 {
            return Err(VllmHashError::ZeroBlockSize);
        }
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        let mut parent = self.none_hash;
        for (i, page) in crate::pages(tokens, block_size).enumerate() {
            let pre = self.preimage(&parent, page, &self.extra_keys(i, extras))?;
            parent = self.algo.digest_of(&pre);
            out.push(parent);
        }
        Ok(out)
    }

    /// The serialized `(parent, tokens, extra_keys)` tuple of one block, exactly as vLLM hashes it.
    ///
    /// # Errors
    /// [`VllmHashError::PreimageTooLarge`] if a pickle preimage would need several frames.
    pub fn preimage(
        &self,
        parent: &VllmDigest,
        page: &[Token],
        extras: &[Extra<'_>],
    ) -> Result<Vec<u8>, VllmHashError> {
        if self.algo.is_pickle() {
            pickle_preimage(parent.as_bytes(), page, extras)
        } else {
            Ok(cbor_preimage(parent.as_bytes(), page, extras))
        }
    }

    /// The extra-keys tuple of block number `block` of a request: LoRA on every block, the salt
    /// on block 0 only, in this hasher's form.
    #[must_use]
    pub fn extra_keys<'a>(&self, block: usize, extras: RequestExtras<'a>) -> Vec<Extra<'a>> {
        let mut out = Vec::new();
        if let Some(lora) = extras.lora {
            out.push(match self.form {
                ExtraKeyForm::Tagged => Extra::Tagged("lora", lora.name, lora.path),
                ExtraKeyForm::Untagged => Extra::Bare(lora.name),
            });
        }
        if let (0, Some(salt)) = (block, extras.cache_salt) {
            out.push(match self.form {
                ExtraKeyForm::Tagged => Extra::TaggedPair("cache_salt", salt),
                ExtraKeyForm::Untagged => Extra::Bare(salt),
            });
        }
        out
    }
}

/// One element of a block's extra-keys tuple.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra<'a> {
    /// A bare string (≤ 0.30).
    Bare(&'a str),
    /// A triple of strings (≥ 0.31 LoRA: `("lora", name, path)`).
    Tagged(&'a str, &'a str, &'a str),
    /// A pair of strings (≥ 0.31 salt: `("cache_salt", salt)`).
    TaggedPair(&'a str, &'a str),
}

/// The serialized seed string `NONE_HASH` is the digest of.
#[must_use]
pub fn none_hash_preimage(algo: HashAlgo, seed: &str) -> Vec<u8> {
    if algo.is_pickle() {
        let mut p = Pickler::default();
        p.str(seed);
        p.finish()
    } else {
        let mut c = Vec::new();
        cbor_str(&mut c, seed);
        c
    }
}

const FRAME_SIZE_TARGET: usize = 64 * 1024;

fn pickle_preimage(parent: &[u8], page: &[Token], extras: &[Extra<'_>]) -> Result<Vec<u8>, VllmHashError> {
    let mut p = Pickler::default();
    p.bytes(parent);
    p.tuple(page.len(), |p| page.iter().for_each(|&t| p.int(i64::from(t))));
    if extras.is_empty() {
        p.none();
    } else {
        p.tuple(extras.len(), |p| {
            for e in extras {
                match e {
                    Extra::Bare(s) => p.str(s),
                    Extra::Tagged(a, b, c) => p.tuple(3, |p| [a, b, c].iter().for_each(|s| p.str(s))),
                    Extra::TaggedPair(a, b) => p.tuple(2, |p| {
                        p.str(a);
                        p.str(b);
                    }),
                }
            }
        });
    }
    p.tuple_end(3);
    if p.body.len() + 1 >= FRAME_SIZE_TARGET {
        return Err(VllmHashError::PreimageTooLarge(p.body.len() + 1));
    }
    Ok(p.finish())
}

/// The subset of CPython's C pickler (protocol 5) these preimages use. Every string, bytes and
/// tuple is memoized (`MEMOIZE`); no object repeats inside one preimage, so no `BINGET` appears.
#[derive(Default)]
struct Pickler {
    body: Vec<u8>,
}

impl Pickler {
    fn none(&mut self) {
        self.body.push(b'N');
    }

    fn int(&mut self, x: i64) {
        let o = &mut self.body;
        if (0..0x100).contains(&x) {
            o.push(b'K');
            o.push(x as u8);
        } else if (0..0x10000).contains(&x) {
            o.push(b'M');
            o.extend_from_slice(&(x as u16).to_le_bytes());
        } else if (i64::from(i32::MIN)..=i64::from(i32::MAX)).contains(&x) {
            o.push(b'J');
            o.extend_from_slice(&(x as i32).to_le_bytes());
        } else {
            // LONG1: minimal little-endian two's complement.
            let n = ((64 - if x < 0 { (!x).leading_zeros() } else { x.leading_zeros() }) + 8) / 8;
            o.push(0x8a);
            o.push(n as u8);
            o.extend_from_slice(&x.to_le_bytes()[..n as usize]);
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        let o = &mut self.body;
        if b.len() < 256 {
            o.push(b'C');
            o.push(b.len() as u8);
        } else {
            o.push(b'B');
            o.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        o.extend_from_slice(b);
        o.push(0x94);
    }

    fn str(&mut self, s: &str) {
        let o = &mut self.body;
        if s.len() < 256 {
            o.push(0x8c);
            o.push(s.len() as u8);
        } else {
            o.push(b'X');
            o.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        o.extend_from_slice(s.as_bytes());
        o.push(0x94);
    }

    /// A tuple of `n` elements written by `items`.
    fn tuple(&mut self, n: usize, items: impl FnOnce(&mut Self)) {
        if n == 0 {
            self.body.push(b')');
            return;
        }
        if n > 3 {
            self.body.push(b'(');
        }
        items(self);
        self.tuple_end(n);
    }

    /// Closes a tuple of `n` (1..) elements already written (with a MARK first when `n > 3`).
    fn tuple_end(&mut self, n: usize) {
        match n {
            1 => self.body.push(0x85),
            2 => self.body.push(0x86),
            3 => self.body.push(0x87),
            _ => self.body.push(b't'),
        }
        self.body.push(0x94);
    }

    fn finish(mut self) -> Vec<u8> {
        self.body.push(b'.');
        let mut out = Vec::with_capacity(self.body.len() + 11);
        out.extend_from_slice(&[0x80, 5]);
        if self.body.len() >= 4 {
            out.push(0x95);
            out.extend_from_slice(&(self.body.len() as u64).to_le_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }
}

fn cbor_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n < 0x100 {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n < 0x1_0000 {
        out.push(m | 25);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n < 0x1_0000_0000 {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn cbor_str(out: &mut Vec<u8>, s: &str) {
    cbor_head(out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn cbor_preimage(parent: &[u8], page: &[Token], extras: &[Extra<'_>]) -> Vec<u8> {
    let mut c = Vec::with_capacity(8 + parent.len() + page.len() * 5);
    cbor_head(&mut c, 4, 3);
    cbor_head(&mut c, 2, parent.len() as u64);
    c.extend_from_slice(parent);
    cbor_head(&mut c, 4, page.len() as u64);
    for &t in page {
        cbor_head(&mut c, 0, u64::from(t));
    }
    if extras.is_empty() {
        c.push(0xf6);
    } else {
        cbor_head(&mut c, 4, extras.len() as u64);
        for e in extras {
            match e {
                Extra::Bare(s) => cbor_str(&mut c, s),
                Extra::Tagged(a, b, x) => {
                    cbor_head(&mut c, 4, 3);
                    [a, b, x].iter().for_each(|s| cbor_str(&mut c, s));
                }
                Extra::TaggedPair(a, b) => {
                    cbor_head(&mut c, 4, 2);
                    cbor_str(&mut c, a);
                    cbor_str(&mut c, b);
                }
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn none_hash_preimages() {
        assert_eq!(
            hex(&none_hash_preimage(HashAlgo::Sha256, "vllm-none-hash")),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
        assert_eq!(
            hex(&none_hash_preimage(HashAlgo::Sha256Cbor, "vllm-none-hash")),
            "6e766c6c6d2d6e6f6e652d68617368"
        );
        let h = BlockHasher::new(HashAlgo::Sha256, &NoneHashSeed::Default, ExtraKeyForm::Tagged);
        assert_eq!(
            hex(h.none_hash().as_bytes()),
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
        );
    }

    #[test]
    fn pickle_int_widths_match_cpython() {
        // Expected bytes from CPython: pickle.dumps(x, protocol=5) minus the header and STOP.
        for (x, want) in [
            (0, "4b00"),
            (255, "4bff"),
            (256, "4d0001"),
            (65535, "4dffff"),
            (65536, "4a00000100"),
            (-1, "4affffffff"),
            (1 << 31, "8a050000008000"),
            (-(1 << 31) - 1, "8a05ffffff7fff"),
        ] {
            let mut p = Pickler::default();
            p.int(x);
            assert_eq!(hex(&p.body), want, "int {x}");
        }
    }

    #[test]
    fn salted_lora_extras_encode_as_vllm_does() {
        let mut c = Vec::new();
        cbor_head(&mut c, 4, 1);
        let e = Extra::TaggedPair("cache_salt", "tenant-a");
        if let Extra::TaggedPair(a, b) = e {
            cbor_head(&mut c, 4, 2);
            cbor_str(&mut c, a);
            cbor_str(&mut c, b);
        }
        assert_eq!(hex(&c), format!("8182{}{}{}{}", "6a", hex(b"cache_salt"), "68", hex(b"tenant-a")));
    }
}
