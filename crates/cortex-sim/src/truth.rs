//! Ground truth: exactly which blocks a rank holds, for tests that audit a gateway's ledger.
//!
//! Key decision: the snapshot is taken from the engine model itself (vLLM's physical blocks,
//! duplicates included; SGLang's radix pages), not reconstructed from the events, so a ledger
//! built from the event stream can be checked against it.

use cortex_hash::kv::EngineHash;

/// One cached block (vLLM: one physical block; SGLang: one radix page).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    /// The hash as published (`EngineHash::from_digest` of vLLM's digest; SGLang's signed value).
    pub hash: EngineHash,
    /// vLLM with `int_block_hashes` off: the full digest published as `bin`.
    pub digest: Option<Vec<u8>>,
    /// The block before it in its chain, `None` at the root.
    pub parent: Option<EngineHash>,
    /// The block's tokens (for SGLang bigram pages, the raw window: one more token than units).
    pub tokens: Vec<u32>,
    /// Referenced by a running (or leased) request, hence not evictable.
    pub in_use: bool,
    /// The LoRA adapter's name, if the block belongs to one.
    pub lora_name: Option<String>,
    /// The cache salt of the chain the block belongs to.
    pub cache_salt: Option<String>,
}

/// What one rank holds and how its event stream stands.
#[derive(Clone, Debug, PartialEq)]
pub struct RankState {
    /// The DP rank.
    pub rank: u16,
    /// Every cached block.
    pub blocks: Vec<HeldBlock>,
    /// A subscriber whose subscription matches the topic is connected to the PUB.
    pub subscribed: bool,
    /// The last sequence number published (or dropped by a fault), if any.
    pub last_seq: Option<u64>,
    /// Replay requests left unanswered (malformed, or sent while replay was off).
    pub replay_ignored: u64,
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// The rank's virtual clock.
    pub virtual_time: std::time::Duration,
    /// Its PD legs so far.
    pub pd: PdCounters,
    /// Requests aborted because their client left before they finished.
    pub cancelled: u64,
    /// Prompt tokens the rank computed (prefilled) so far; the rest of its requests' prompts
    /// came from its cache or over a KV transfer.
    pub computed_prompt_tokens: u64,
    /// Running requests preempted for want of KV room (their KV freed, to be computed again).
    pub preemptions: u64,
}

/// A rank's PD legs, counted as the engines' own code would see them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PdCounters {
    /// Prefill legs finished (SGLang: their KV taken by the decode side; vLLM: their blocks
    /// leased).
    pub prefill_legs: u64,
    /// Decode legs admitted with the prompt's KV from a prefill worker.
    pub decode_legs: u64,
    /// Prompt tokens those decode legs received: the part of the prompt they lacked locally
    /// (vLLM pulls `remote_num_tokens − num_computed_tokens`; SGLang's decode side with a radix
    /// cache asks for the pages after its `decode_prefix_len`, without one for all of them).
    pub pulled_tokens: u64,
}
