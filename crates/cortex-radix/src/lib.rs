//! `cortex-radix`: the KV ledger (filled by the ledger issue).
//!
//! It will own the in-memory index of which holder — a (worker, data-parallel rank) — holds which
//! chained KV block (keyed by `cortex_hash::SeqHash`, never an engine hash), answer "how many
//! leading blocks of this prompt does each holder have?" without ever taking a lock (memory
//! reclaimed with crossbeam-epoch), reference-count vLLM's duplicate physical blocks, keep
//! orphaned chains until their parent appears, and bound and measure its memory. It knows nothing
//! about sockets or async.

pub mod overlap;

pub use overlap::{Overlap, OverlapScores};
