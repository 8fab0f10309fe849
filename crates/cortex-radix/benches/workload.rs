//! The ledger benchmark workload (`docs/perf.md`, "Ledger"), shared (by `#[path]`) by the
//! criterion bench, the soak and the peer harness in `peers/radix-bench`, so all three measure
//! exactly the same events and queries.
//!
//! W holders each store `blocks / 64` chains of 64 blocks; even chains are identical across
//! holders (a 16-block prefix shared by every even chain, then a chain-specific tail), odd chains
//! are unique per holder. Stores are 16-block events with a parent hash. Queries are 80 blocks:
//! 75 % an existing chain plus 16 new blocks, 25 % random (a first-block miss). Engine hashes
//! are the blocks' `SeqHash` bits (router-computable, as Dynamo's harness uses), contents are
//! the `BlockHash` bits (Dynamo's `LocalBlockHash`).

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use cortex_hash::kv::{BlockStored, EngineHash, KvEvent, Lineage, Medium, StoredBlock};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};

/// Blocks per chain.
pub const CHAIN: usize = 64;
/// Blocks of the prefix every even chain shares.
pub const SHARED: usize = 16;
/// Blocks per store event.
pub const EVENT_BLOCKS: usize = 16;
/// Blocks per query.
pub const QUERY_BLOCKS: usize = 80;

/// One store event of one holder (holder index, parent engine hash, (engine, content) blocks).
pub struct Store {
    pub holder: u32,
    pub parent: Option<u64>,
    pub blocks: Vec<(u64, u64)>,
}

/// One query: contents (for Dynamo) and `SeqHash`es (for Cortex).
pub struct Query {
    pub content: Vec<u64>,
    pub seqs: Vec<SeqHash>,
}

/// The whole workload.
pub struct Workload {
    pub holders: u32,
    pub blocks_per_holder: usize,
    pub lineage: Lineage,
    pub stores: Vec<Store>,
    pub queries: Vec<Query>,
    /// (holder, block) pairs stored.
    pub pairs: usize,
    /// Distinct blocks.
    pub distinct: usize,
}

/// splitmix64: a deterministic stream without dependencies.
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Workload {
    /// W = `holders`, `blocks_per_holder` blocks each, `queries` queries, from `seed`.
    pub fn new(holders: u32, blocks_per_holder: usize, queries: usize, seed: u64) -> Workload {
        let ns = Namespace::new(Engine::Vllm, 16, "bench-model", None);
        let lineage = Lineage::new(ns, None);
        let chains = blocks_per_holder / CHAIN;
        let content = |h: u32, c: usize, i: usize| -> u64 {
            if c.is_multiple_of(2) {
                if i < SHARED {
                    splitmix(0x5AED ^ (i as u64) << 8)
                } else {
                    splitmix(0xE7E7_0000_0000 ^ ((c as u64) << 16) ^ i as u64)
                }
            } else {
                splitmix(0x0DD0_0000_0000_0000 ^ (u64::from(h) << 40) ^ ((c as u64) << 16) ^ i as u64)
            }
        };
        let chain_of = |h: u32, c: usize| -> (Vec<u64>, Vec<SeqHash>) {
            let contents: Vec<u64> = (0..CHAIN).map(|i| content(h, c, i)).collect();
            let mut seq = lineage.root;
            let seqs = contents
                .iter()
                .map(|&b| {
                    seq = chain(seq, BlockHash::from_bits(b));
                    seq
                })
                .collect();
            (contents, seqs)
        };
        let mut stores = Vec::new();
        let mut distinct = std::collections::HashSet::new();
        for c in 0..chains {
            for h in 0..holders {
                let (contents, seqs) = chain_of(h, c);
                for e in 0..CHAIN / EVENT_BLOCKS {
                    let r = e * EVENT_BLOCKS..(e + 1) * EVENT_BLOCKS;
                    stores.push(Store {
                        holder: h,
                        parent: (e > 0).then(|| seqs[r.start - 1].to_bits()),
                        blocks: r.clone().map(|i| (seqs[i].to_bits(), contents[i])).collect(),
                    });
                }
                distinct.extend(seqs.iter().map(|s| s.to_bits()));
            }
        }
        let mut rng = seed;
        let mut next = || {
            rng = splitmix(rng);
            rng
        };
        let queries = (0..queries)
            .map(|_| {
                let mut contents: Vec<u64> = if next() % 4 != 0 && chains > 0 {
                    let h = (next() % u64::from(holders)) as u32;
                    let c = (next() % chains as u64) as usize;
                    chain_of(h, c).0
                } else {
                    Vec::new()
                };
                while contents.len() < QUERY_BLOCKS {
                    contents.push(next());
                }
                let mut seq = lineage.root;
                let seqs = contents
                    .iter()
                    .map(|&b| {
                        seq = chain(seq, BlockHash::from_bits(b));
                        seq
                    })
                    .collect();
                Query { content: contents, seqs }
            })
            .collect();
        Workload {
            holders,
            blocks_per_holder,
            lineage,
            pairs: chains * CHAIN * holders as usize,
            distinct: distinct.len(),
            stores,
            queries,
        }
    }

    /// The Cortex event of a store.
    pub fn event(&self, s: &Store) -> KvEvent {
        KvEvent::Stored(BlockStored {
            parent: s.parent.map(EngineHash::from_u64),
            blocks: s
                .blocks
                .iter()
                .map(|&(e, c)| StoredBlock {
                    engine: EngineHash::from_u64(e),
                    content: BlockHash::from_bits(c),
                })
                .collect(),
            lineage: Some(self.lineage),
            medium: Medium::Gpu,
        })
    }
}

/// A global allocator that counts live heap bytes (the benches' ground truth for memory).
pub struct CountingAlloc;

pub static LIVE_BYTES: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

// SAFETY: every method forwards to the system allocator unchanged and only adds bookkeeping.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES
            .fetch_add(new_size as isize - layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

/// Live heap bytes now.
pub fn live_bytes() -> isize {
    LIVE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// p-th percentile (0..=100) of sorted nanoseconds.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[i]
}

/// Per-call latencies in ns of `f(i)` for `i < n`, each after `warm(i)` (a caller that just hashed
/// the prompt has it in cache), minus the timer's own median cost, sorted.
pub fn latencies(n: usize, warm: impl Fn(usize), mut f: impl FnMut(usize)) -> Vec<f64> {
    let mut empty: Vec<f64> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            black_box(());
            t.elapsed().as_nanos() as f64
        })
        .collect();
    empty.sort_by(f64::total_cmp);
    let overhead = percentile(&empty, 50.0);
    let mut v: Vec<f64> = (0..n)
        .map(|i| {
            // The caller hashed the prompt just before asking: its input is in cache.
            warm(i);
            let t = Instant::now();
            f(i);
            (t.elapsed().as_nanos() as f64 - overhead).max(0.0)
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v
}
