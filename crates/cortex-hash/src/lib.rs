//! `cortex-hash`: block identity for KV-cache-aware routing.
//!
//! This crate is the ground every other part of Cortex stands on, and a library other Rust
//! routers embed. It answers one question in several forms: *which KV blocks does this token
//! sequence consist of?*
//!
//! - [`pages`]: split tokens into full pages of `block_size` tokens, as the engines do.
//! - [`Namespace`], [`BlockHash`], [`SeqHash`], [`chain`]: Cortex's own chained block identity,
//!   the key of the ledger (`cortex-radix`). Fast (xxh3-64) and namespaced by engine, block size,
//!   model, LoRA adapter and cache salt.
//! - [`sglang`] and [`vllm`]: the engines' own hash recipes, byte for byte, to predict the hashes
//!   a worker will publish for a request (alignment checks), never to key the ledger.
//! - [`kv`]: the small shared vocabulary of the event plane (holders, engine hashes, media and the
//!   normalized KV event) that the event decoders produce and the ledger consumes.
//! - [`profile`]: the versioned model profile, everything that must be identical between gateway
//!   and worker for exact routing, with a stable fingerprint.
//! - `text` (cargo feature `text`): chat-template rendering and tokenization with the model's own
//!   files, so the gateway sees the exact token ids the worker will see.
//!
//! ```
//! use cortex_hash::{Engine, Namespace};
//!
//! // The gateway and the ledger agree on identity because both hash tokens the same way.
//! let ns = Namespace::new(Engine::Sglang, 16, "Qwen/Qwen3-8B", None);
//! let prompt: Vec<u32> = (0..100).collect();
//! let keys = ns.seq_hashes(None, &prompt);
//! assert_eq!(keys.len(), 6); // 96 tokens in full pages; the 4-token tail is not a block
//! ```

pub mod identity;
pub mod kv;
pub mod profile;
pub mod sglang;
#[cfg(feature = "text")]
pub mod text;
pub mod vllm;

pub use identity::{BlockHash, Engine, Namespace, SeqHash, chain};

/// A token id as tokenizers produce it. Engine recipes that accept wider ids (SGLang's "wide"
/// pages) take their own integer types.
pub type Token = u32;

/// Full pages of `block_size` tokens; a partial tail is dropped, because engines never publish
/// it as a block on the routing path.
///
/// ```
/// let pages: Vec<&[u32]> = cortex_hash::pages(&[1, 2, 3, 4, 5], 2).collect();
/// assert_eq!(pages, vec![&[1, 2][..], &[3, 4][..]]);
/// ```
///
/// # Panics
/// If `block_size` is 0.
pub fn pages(tokens: &[Token], block_size: usize) -> std::slice::ChunksExact<'_, Token> {
    tokens.chunks_exact(block_size)
}
