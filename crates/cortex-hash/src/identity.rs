//! Cortex's own block identity: the key of the ledger.
//!
//! A prompt is cut into full pages of `block_size` tokens ([`crate::pages`]). Each page gets a
//! [`BlockHash`] (a content hash of its tokens) and each position in the prompt a [`SeqHash`], the
//! chain `seq[i] = chain(seq[i-1], block[i])` rooted at the [`Namespace`]'s root. Two prompts share
//! `SeqHash` number `i` exactly when they share pages `0..=i` in the same namespace, which turns
//! "longest cached prefix" into a sequence of independent hash lookups.
//!
//! Key decision: the hash is Cortex's own (xxh3-64), never an engine's. Engine hashes change with
//! engine versions, seeds and settings (see [`crate::vllm`] and [`crate::sglang`]); Cortex re-hashes
//! the `token_ids` every `BlockStored` event carries, as Dynamo and llm-d ended up doing. A
//! [`Namespace`] (engine, block size, model, LoRA adapter) seeds every hash and the cache salt seeds
//! the chain root, so blocks of different engines, block sizes or tenants never meet.
//!
//! The salt enters at the root only, because that is where engines put it: vLLM adds the salt to
//! the extra keys of block 0 alone, and every later block inherits it through its parent. A chain
//! started from `root(Some(salt))` therefore never shares a `SeqHash` with one started elsewhere.

use std::fmt;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::Token;

/// Content hash of one page of tokens within a [`Namespace`].
///
/// Equal pages in equal namespaces have equal `BlockHash`es wherever they sit in a prompt; the
/// position-dependent identity is the [`SeqHash`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(u64);

/// Chained identity of a page *and everything before it*: the ledger's key.
///
/// `SeqHash` values are only produced by [`Namespace::root`], [`chain`] and the helpers built on
/// them; two prompts share the `i`-th `SeqHash` exactly when their first `i + 1` pages (and their
/// namespace and salt) are equal, barring 64-bit collisions.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHash(u64);

macro_rules! bits_api {
    ($t:ident) => {
        impl $t {
            /// The raw 64 bits, for persistence, metrics labels and debugging dumps.
            #[must_use]
            pub const fn to_bits(self) -> u64 {
                self.0
            }

            /// Rebuilds a value from [`Self::to_bits`]. Only values that came out of `to_bits` are
            /// meaningful; the hash functions are the only other source.
            #[must_use]
            pub const fn from_bits(bits: u64) -> Self {
                Self(bits)
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($t), "({:016x})"), self.0)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:016x}", self.0)
            }
        }
    };
}
bits_api!(BlockHash);
bits_api!(SeqHash);

/// The inference engine a block belongs to. The design forbids one tree across engines: the
/// engine is part of every [`Namespace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Engine {
    /// vLLM (v1 engine).
    Vllm,
    /// SGLang.
    Sglang,
}

impl Engine {
    /// Lower-case name as used in configuration and metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything that separates one family of KV blocks from another: engine, block size, model and
/// LoRA adapter. The cache salt is the fifth part; it seeds [`Namespace::root`].
///
/// A `Namespace` is a small `Copy` value (a 64-bit seed derived from its parts); compare two with
/// `==`.
///
/// ```
/// use cortex_hash::{Engine, Namespace};
///
/// let base = Namespace::new(Engine::Vllm, 16, "Qwen/Qwen3-8B", None);
/// let lora = Namespace::new(Engine::Vllm, 16, "Qwen/Qwen3-8B", Some("sql-adapter"));
/// let tokens: Vec<u32> = (0..64).collect();
/// assert_ne!(base.seq_hashes(None, &tokens), lora.seq_hashes(None, &tokens));
/// assert_eq!(base.seq_hashes(None, &tokens).len(), 4); // 64 tokens = 4 full pages of 16
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace {
    seed: u64,
    block_size: u32,
}

const NAMESPACE_DOMAIN: &[u8] = b"cortex-namespace-v1\0";
const ROOT_DOMAIN: &[u8] = b"cortex-root-v1\0";

impl Namespace {
    /// Builds the namespace of blocks of `engine` with `block_size` tokens per page, serving
    /// `model` with the LoRA adapter `lora` (its name as the engine publishes it) or the base
    /// model (`None`).
    ///
    /// # Panics
    /// If `block_size` is 0: no engine pages with an empty page, and a zero would make every
    /// prompt empty. Callers validate block sizes coming from the network first.
    #[must_use]
    pub fn new(engine: Engine, block_size: u32, model: &str, lora: Option<&str>) -> Namespace {
        assert!(block_size > 0, "block size must be positive");
        let mut buf = Vec::with_capacity(64 + model.len() + lora.map_or(0, str::len));
        buf.extend_from_slice(NAMESPACE_DOMAIN);
        buf.extend_from_slice(engine.as_str().as_bytes());
        buf.push(0);
        buf.extend_from_slice(&block_size.to_le_bytes());
        put_str(&mut buf, Some(model));
        put_str(&mut buf, lora);
        Namespace { seed: xxh3_64(&buf), block_size }
    }

    /// Tokens per page in this namespace.
    #[must_use]
    pub const fn block_size(self) -> u32 {
        self.block_size
    }

    /// The namespace's 64-bit seed, for metrics labels and debugging.
    #[must_use]
    pub const fn to_bits(self) -> u64 {
        self.seed
    }

    /// The `SeqHash` every chain of this namespace starts from, with the request's cache salt
    /// (`None` for no salt; `Some("")` is a salt, distinct from `None`, as in both engines).
    #[must_use]
    pub fn root(self, salt: Option<&str>) -> SeqHash {
        let mut buf = Vec::with_capacity(32 + salt.map_or(0, str::len));
        buf.extend_from_slice(ROOT_DOMAIN);
        put_str(&mut buf, salt);
        SeqHash(xxh3_64_with_seed(&buf, self.seed))
    }

    /// Content hash of one page. The page is hashed whatever its length; callers pass full pages
    /// (see [`crate::pages`]).
    #[must_use]
    #[inline]
    pub fn block_hash(self, page: &[Token]) -> BlockHash {
        BlockHash(xxh3_64_with_seed(token_bytes(page), self.seed))
    }

    /// `SeqHash`es of every full page of `tokens` (the partial tail is not a block on the routing
    /// path), starting from `root(salt)`.
    #[must_use]
    pub fn seq_hashes(self, salt: Option<&str>, tokens: &[Token]) -> Vec<SeqHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size as usize);
        self.extend_seq_hashes(self.root(salt), tokens, &mut out);
        out
    }

    /// Appends the `SeqHash`es of every full page of `tokens`, chained from `parent`, to `out`.
    /// Returns the last `SeqHash` appended, or `parent` if `tokens` holds no full page. With a
    /// lent buffer this allocates nothing, and it lets a caller continue a chain it computed
    /// earlier (a conversation's previous turn).
    pub fn extend_seq_hashes(self, parent: SeqHash, tokens: &[Token], out: &mut Vec<SeqHash>) -> SeqHash {
        let mut seq = parent;
        for page in crate::pages(tokens, self.block_size as usize) {
            seq = chain(seq, self.block_hash(page));
            out.push(seq);
        }
        seq
    }
}

impl Namespace {
    /// `SeqHash`es of a prompt for an engine that caches *bigram* pages (SGLang with EAGLE
    /// speculative decoding): page `i` holds the overlapping pairs `(t_j, t_{j+1})` for
    /// `j in i*P .. (i+1)*P`, which cover the `P + 1` tokens `tokens[i*P ..= i*P + P]`; that
    /// window is the page's content. `n` tokens give `(n - 1) / P` pages.
    ///
    /// ```
    /// use cortex_hash::{Engine, Namespace};
    ///
    /// let ns = Namespace::new(Engine::Sglang, 4, "m", None);
    /// let tokens: Vec<u32> = (500..=516).collect(); // 17 tokens = 16 pairs = 4 pages
    /// assert_eq!(ns.bigram_seq_hashes(None, &tokens).len(), 4);
    /// assert_eq!(ns.bigram_seq_hashes(None, &tokens[..16]).len(), 3);
    /// ```
    #[must_use]
    pub fn bigram_seq_hashes(self, salt: Option<&str>, tokens: &[Token]) -> Vec<SeqHash> {
        let p = self.block_size as usize;
        let pages = tokens.len().saturating_sub(1) / p;
        let mut seq = self.root(salt);
        (0..pages)
            .map(|i| {
                seq = chain(seq, self.block_hash(&tokens[i * p..=i * p + p]));
                seq
            })
            .collect()
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({:016x}, block_size={})", self.seed, self.block_size)
    }
}

/// The chain step: the identity of `block` placed right after the prefix whose identity is
/// `parent`.
///
/// ```
/// use cortex_hash::{chain, Engine, Namespace};
///
/// let ns = Namespace::new(Engine::Sglang, 4, "m", None);
/// let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
/// let root = ns.root(None);
/// let first = chain(root, ns.block_hash(&tokens[..4]));
/// let second = chain(first, ns.block_hash(&tokens[4..]));
/// assert_eq!(ns.seq_hashes(None, &tokens), vec![first, second]);
/// ```
#[must_use]
#[inline]
pub fn chain(parent: SeqHash, block: BlockHash) -> SeqHash {
    SeqHash(xxh3_64_with_seed(&block.0.to_le_bytes(), parent.0))
}

fn put_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => buf.push(0),
        Some(s) => {
            buf.push(1);
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
    }
}

/// The little-endian bytes of `tokens`, without copying on little-endian targets.
#[cfg(target_endian = "little")]
#[inline]
fn token_bytes(tokens: &[Token]) -> &[u8] {
    // SAFETY: `Token` is `u32`, which has no padding and no invalid bit patterns; any `u32` slice
    // is a valid byte slice of 4x its length with the same lifetime, and `u8` has alignment 1.
    // On a little-endian target those bytes are the tokens' little-endian encoding.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) }
}

#[cfg(not(target_endian = "little"))]
compile_error!("cortex-hash hashes tokens as little-endian bytes and supports little-endian targets only");

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(engine: Engine, bs: u32, model: &str, lora: Option<&str>) -> Namespace {
        Namespace::new(engine, bs, model, lora)
    }

    #[test]
    fn every_namespace_part_separates() {
        let tokens: Vec<Token> = (0..128).collect();
        let base = ns(Engine::Vllm, 16, "m", None);
        let others = [
            ns(Engine::Sglang, 16, "m", None),
            ns(Engine::Vllm, 32, "m", None),
            ns(Engine::Vllm, 16, "m2", None),
            ns(Engine::Vllm, 16, "m", Some("a")),
            ns(Engine::Vllm, 16, "m", Some("")),
        ];
        let want = base.seq_hashes(None, &tokens[..64]);
        for other in others {
            let got = other.seq_hashes(None, &tokens[..other.block_size() as usize * 4]);
            assert!(got.iter().all(|h| !want.contains(h)), "{other:?} collides with {base:?}");
        }
        for salt in [Some(""), Some("tenant-a")] {
            let got = base.seq_hashes(salt, &tokens[..64]);
            assert!(got.iter().all(|h| !want.contains(h)), "salt {salt:?} does not separate");
        }
    }

    #[test]
    fn string_parts_are_length_prefixed() {
        // "ab" + "c" must differ from "a" + "bc".
        assert_ne!(ns(Engine::Vllm, 16, "ab", Some("c")), ns(Engine::Vllm, 16, "a", Some("bc")));
        assert_ne!(ns(Engine::Vllm, 16, "m", None), ns(Engine::Vllm, 16, "m", Some("")));
    }

    #[test]
    fn partial_tail_is_not_a_block() {
        let n = ns(Engine::Sglang, 4, "m", None);
        assert_eq!(n.seq_hashes(None, &[1, 2, 3]), vec![]);
        assert_eq!(n.seq_hashes(None, &[1, 2, 3, 4, 5]), n.seq_hashes(None, &[1, 2, 3, 4]));
    }

    #[test]
    fn extend_continues_a_chain() {
        let n = ns(Engine::Sglang, 4, "m", None);
        let tokens: Vec<Token> = (0..40).collect();
        let whole = n.seq_hashes(Some("s"), &tokens);
        let mut out = Vec::new();
        let mid = n.extend_seq_hashes(n.root(Some("s")), &tokens[..16], &mut out);
        let last = n.extend_seq_hashes(mid, &tokens[16..], &mut out);
        assert_eq!(out, whole);
        assert_eq!(Some(&last), whole.last());
    }
}
