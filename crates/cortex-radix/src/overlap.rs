//! The answer of an overlap query: per holder, how many leading blocks of the prompt it holds.
//!
//! Key decision: the result is plain data in a buffer the caller lends and reuses
//! ([`OverlapScores::clear`] keeps the allocation), so that a routing decision allocates nothing.
//! Holders that match no block do not appear; the scheduler treats a missing holder as 0.

use cortex_hash::kv::HolderId;

/// One holder's match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// The holder.
    pub holder: HolderId,
    /// Contiguous leading blocks of the query the holder has on GPU.
    pub gpu_blocks: u32,
    /// Contiguous leading blocks the holder has on any tier (GPU or lower); `>= gpu_blocks`.
    pub any_tier_blocks: u32,
}

/// The result of an overlap query, reusable across queries.
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    entries: Vec<Overlap>,
    query_blocks: u32,
}

impl OverlapScores {
    /// An empty result with room for `holders` entries.
    #[must_use]
    pub fn with_capacity(holders: usize) -> Self {
        OverlapScores { entries: Vec::with_capacity(holders), query_blocks: 0 }
    }

    /// Forgets the previous answer, keeping the allocation.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.query_blocks = 0;
    }

    /// Number of blocks in the query that produced this result.
    #[must_use]
    pub const fn query_blocks(&self) -> u32 {
        self.query_blocks
    }

    /// Holders with at least one matched block, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Overlap> {
        self.entries.iter()
    }

    /// The match of `holder` (`None`: no leading block matched).
    #[must_use]
    pub fn get(&self, holder: HolderId) -> Option<&Overlap> {
        self.entries.iter().find(|o| o.holder == holder)
    }

    /// Number of holders with a match.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no holder matched.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The largest GPU match.
    #[must_use]
    pub fn best_gpu_blocks(&self) -> u32 {
        self.entries.iter().map(|o| o.gpu_blocks).max().unwrap_or(0)
    }

    /// Starts filling a result for a query of `query_blocks` blocks (used by the ledger, and by
    /// tests and simulations that build results by hand).
    pub fn begin(&mut self, query_blocks: u32) {
        self.clear();
        self.query_blocks = query_blocks;
    }

    /// Records one holder's match (used by the ledger, tests and simulations).
    pub fn push(&mut self, overlap: Overlap) {
        self.entries.push(overlap);
    }
}
