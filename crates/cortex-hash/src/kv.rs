//! The shared vocabulary of the event plane: who holds a block ([`HolderId`]), how an engine names
//! it ([`EngineHash`]), where it lives ([`Medium`]), the normalized KV event both engines'
//! decoders produce ([`EventBatch`], [`KvEvent`]), and where a holder's events come from
//! ([`HolderSource`]).
//!
//! Key decision: these types live in the lowest crate because the event decoders
//! (`cortex-events-*`), the ledger (`cortex-radix`), the ingest runtime and the simulator all
//! speak them, and the event crates and the ledger must not depend on each other. Chaining is
//! *not* done here nor in the decoders: a stored block carries its engine hash and its page's
//! content [`BlockHash`]; the ledger, which knows each holder's parents, computes the
//! [`SeqHash`](crate::SeqHash).

use std::fmt;

use crate::{BlockHash, Engine, Namespace, SeqHash};

/// A worker (one engine server) as the gateway's registry knows it. Typed, never a URL string.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct WorkerId(pub u32);

/// A data-parallel rank inside a worker. Each rank has its own KV cache and its own event stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct DpRank(pub u16);

/// One KV cache: a (worker, data-parallel rank) pair. The ledger indexes blocks per holder.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct HolderId {
    /// The worker.
    pub worker: WorkerId,
    /// The rank within the worker.
    pub rank: DpRank,
}

impl HolderId {
    /// Holder `rank` of `worker`.
    #[must_use]
    pub const fn new(worker: WorkerId, rank: DpRank) -> Self {
        HolderId { worker, rank }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}/dp{}", self.worker.0, self.rank.0)
    }
}

/// An engine's name for a block, as published in `block_hashes` / `parent_block_hash`: an opaque
/// handle, meaningful only within one holder (and, for content-deterministic engines, one
/// namespace).
///
/// vLLM publishes the low 64 bits of its digest as an unsigned integer by default, or the whole
/// 32-byte digest as `bin`; [`EngineHash::from_digest`] maps a digest to the same value the
/// integer form would carry, so both forms name the same block. SGLang publishes signed 64-bit
/// values; [`EngineHash::from_i64`] keeps their bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(u64);

impl EngineHash {
    /// From an unsigned wire integer (vLLM's default).
    #[must_use]
    pub const fn from_u64(v: u64) -> Self {
        EngineHash(v)
    }

    /// From a signed wire integer (SGLang, old vLLM): the two's-complement bits.
    #[must_use]
    pub const fn from_i64(v: i64) -> Self {
        EngineHash(v as u64)
    }

    /// From a digest published as bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`): the
    /// low 64 bits of the big-endian integer, which is exactly what the integer form carries.
    /// Digests shorter than 8 bytes are zero-extended.
    #[must_use]
    pub fn from_digest(digest: &[u8]) -> Self {
        let tail = &digest[digest.len().saturating_sub(8)..];
        let mut be = [0u8; 8];
        be[8 - tail.len()..].copy_from_slice(tail);
        EngineHash(u64::from_be_bytes(be))
    }

    /// The raw bits as an unsigned integer.
    #[must_use]
    pub const fn to_u64(self) -> u64 {
        self.0
    }

    /// The raw bits as a signed integer (SGLang's view).
    #[must_use]
    pub const fn to_i64(self) -> i64 {
        self.0 as i64
    }
}

impl fmt::Debug for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EngineHash({:016x})", self.0)
    }
}

/// Where a stored block lives. The ledger counts GPU blocks and lower-tier blocks separately:
/// only the GPU tier saves prefill compute outright.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Medium {
    /// GPU memory (vLLM `"GPU"`, SGLang `"GPU"`, or no medium given).
    Gpu,
    /// Host memory (vLLM `"CPU"`, SGLang `"CPU_PINNED"`).
    Cpu,
    /// Disk or a storage backend (vLLM `"STORAGE"`, SGLang `"DISK"`).
    Storage,
    /// A tier outside the worker (SGLang `"EXTERNAL"`) or one Cortex does not know.
    External,
}

impl Medium {
    /// Parses an engine's medium string; `None` (absent) means GPU in both engines.
    #[must_use]
    pub fn from_wire(s: Option<&str>) -> Medium {
        match s {
            None | Some("GPU") => Medium::Gpu,
            Some("CPU" | "CPU_PINNED") => Medium::Cpu,
            Some("STORAGE" | "DISK") => Medium::Storage,
            Some(_) => Medium::External,
        }
    }

    /// True for the GPU tier.
    #[must_use]
    pub const fn is_gpu(self) -> bool {
        matches!(self, Medium::Gpu)
    }
}

/// One block of a `BlockStored` event: the engine's name for it and the content hash of its page.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct StoredBlock {
    /// The engine's hash (a handle for later removes and children).
    pub engine: EngineHash,
    /// Cortex's content hash of the block's page, in the event's namespace.
    pub content: BlockHash,
}

/// The identity context of a store: the namespace its blocks belong to and the root a chain
/// without a parent starts from (the namespace root with the request's salt).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Lineage {
    /// Namespace of the blocks (engine, block size, model, LoRA).
    pub namespace: Namespace,
    /// Where a parentless chain starts: `namespace.root(salt)`.
    pub root: SeqHash,
}

impl Lineage {
    /// Lineage of blocks in `namespace` stored by a request with cache salt `salt`.
    #[must_use]
    pub fn new(namespace: Namespace, salt: Option<&str>) -> Self {
        Lineage { namespace, root: namespace.root(salt) }
    }
}

/// A normalized `BlockStored`: consecutive blocks of one chain.
#[derive(Clone, PartialEq, Debug)]
pub struct BlockStored {
    /// The engine hash of the block before `blocks[0]`; `None` means the chain starts at the root.
    pub parent: Option<EngineHash>,
    /// The stored blocks, in chain order.
    pub blocks: Vec<StoredBlock>,
    /// Namespace and root, or `None` when the decoder cannot know the namespace (for example an
    /// SGLang LoRA block whose adapter name was not published). Such blocks must never be counted
    /// as base-model blocks; the ledger keeps only their engine hashes so removes still match.
    pub lineage: Option<Lineage>,
    /// Storage tier.
    pub medium: Medium,
}

/// A normalized `BlockRemoved`.
#[derive(Clone, PartialEq, Debug)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks (one reference each: vLLM removes once per copy).
    pub blocks: Vec<EngineHash>,
    /// Storage tier the blocks left.
    pub medium: Medium,
}

/// One KV-cache event, normalized across engines and versions.
#[derive(Clone, PartialEq, Debug)]
pub enum KvEvent {
    /// Blocks entered a tier.
    Stored(BlockStored),
    /// Blocks left a tier.
    Removed(BlockRemoved),
    /// The holder's cache was reset (`AllBlocksCleared`).
    AllCleared,
}

/// One published batch: what one sequence number carries.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct EventBatch {
    /// Engine wall-clock timestamp in seconds.
    pub ts: f64,
    /// Data-parallel rank stamped in the batch, when present.
    pub dp_rank: Option<DpRank>,
    /// The events, in order.
    pub events: Vec<KvEvent>,
}

/// Which engine's wire format a holder publishes (the decoder to use). Exhaustive, unlike
/// [`Engine`]: the event plane must know every format it is handed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// vLLM, any release from 0.9 to 0.33.
    Vllm,
    /// SGLang 0.5.x.
    Sglang,
}

impl From<Engine> for Wire {
    fn from(e: Engine) -> Wire {
        match e {
            Engine::Vllm => Wire::Vllm,
            Engine::Sglang => Wire::Sglang,
        }
    }
}

/// How to read a store that does not say whether the request was plain (vLLM: no `extra_keys`
/// before 0.17; SGLang: no `lora_name`, which unregistered LoRA adapters and extra keys do not
/// publish).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unlabeled {
    /// As a plain base-model store: this worker gets no such traffic.
    Plain,
    /// As unknown: never counted.
    Unknown,
}

/// Where one holder's KV events come from and how to read them: what the gateway learns about a
/// holder at discovery and the event plane needs to follow it. One type for both sides (the
/// proxy builds it, the ingest runtime consumes it as it is), so the two cannot drift.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderSource {
    /// The (worker, DP rank) whose cache these events describe.
    pub holder: HolderId,
    /// The engine's wire format.
    pub wire: Wire,
    /// Served model name (part of every block's namespace).
    pub model: String,
    /// How to read unlabeled stores.
    pub unlabeled: Unlabeled,
    /// The PUB endpoint, `tcp://host:port` (already offset by the rank).
    pub publish: String,
    /// The replay ROUTER endpoint, if the engine has one (already offset by the rank).
    pub replay: Option<String>,
    /// The topic to subscribe to (`""` for everything).
    pub topic: String,
    /// The engine's KV capacity in blocks (bounds the ledger's memory for this holder).
    pub capacity_blocks: u32,
    /// Whether equal content gives equal engine hashes across workers (SGLang; vLLM >= 0.29 with
    /// the default seed): lets the ledger graft orphans from other holders.
    pub content_deterministic: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_maps_to_the_integer_form() {
        // vLLM's wire u64 is int.from_bytes(digest, "big") & (2**64 - 1).
        let digest = hex_bytes("7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf");
        assert_eq!(EngineHash::from_digest(&digest).to_u64(), 1_403_909_460_543_360_175);
    }

    #[test]
    fn signed_and_unsigned_views_agree() {
        let h = EngineHash::from_i64(-3_488_128_144_981_237_669);
        assert_eq!(h.to_i64(), -3_488_128_144_981_237_669);
        assert_eq!(EngineHash::from_u64(h.to_u64()), h);
    }

    #[test]
    fn medium_strings() {
        assert_eq!(Medium::from_wire(None), Medium::Gpu);
        assert_eq!(Medium::from_wire(Some("CPU_PINNED")), Medium::Cpu);
        assert_eq!(Medium::from_wire(Some("CPU")), Medium::Cpu);
        assert_eq!(Medium::from_wire(Some("DISK")), Medium::Storage);
        assert_eq!(Medium::from_wire(Some("NVME-OF")), Medium::External);
    }

    fn hex_bytes(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }
}
