//! `cortex-radix`: the KV ledger — which holder (a worker and data-parallel rank) holds which
//! chained KV block right now, and how many leading blocks of a prompt each holder has.
//!
//! ```
//! use cortex_hash::kv::*;
//! use cortex_hash::{Engine, Namespace};
//! use cortex_radix::{HolderConfig, Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness};
//!
//! let ledger = Ledger::new(LedgerConfig::default());
//! let holder = HolderId::new(WorkerId(7), DpRank(0));
//! let mut writer = ledger
//!     .add_holder(holder, HolderConfig { capacity_blocks: 1000, content_deterministic: false })
//!     .unwrap();
//! writer.set_readiness(Readiness::Ready);
//!
//! let ns = Namespace::new(Engine::Vllm, 4, "m", None);
//! let tokens: Vec<u32> = (0..12).collect();
//! let blocks = tokens
//!     .chunks(4)
//!     .enumerate()
//!     .map(|(i, page)| StoredBlock { engine: EngineHash::from_u64(100 + i as u64), content: ns.block_hash(page) })
//!     .collect();
//! let store = BlockStored { parent: None, blocks, lineage: Some(Lineage::new(ns, None)), medium: Medium::Gpu };
//! writer.apply(&KvEvent::Stored(store)).unwrap();
//!
//! let mut out = OverlapScores::with_capacity(8);
//! ledger.query(&ns.seq_hashes(None, &tokens), QueryOptions::default(), &mut out);
//! assert_eq!(out.get(holder).map(|o| o.gpu_blocks), Some(3));
//! ```
//!
//! Key decision: the ledger is keyed by Cortex's chained `SeqHash`, and the shared structure is
//! made of *runs* — contiguous pieces of chains, each block in exactly one, with per holder the
//! length of the prefix it has — found by their first block in a head table (read lock-free under
//! a crossbeam-epoch guard). By the chain property a query compares a whole run with the prompt
//! at once, so "longest cached prefix" costs one lookup per run, not per block. Everything per
//! (holder, block) — engine hashes, reference counts, tiers, orphans and LRU order — belongs to
//! that holder's single writer. See ARCHITECTURE.md (`crates/cortex-radix`) for the structure,
//! the benchmark that chose it and the exact orphan rules.

mod deterministic;
mod holder;
pub mod ledger;
pub mod overlap;
mod run;
mod slots;
mod sync;
mod table;

pub use ledger::{
    ApplyOutcome, BUDGET_BYTES_PER_BLOCK, DumpBlock, DumpState, EarlyExit, HolderConfig, HolderDump,
    HolderFilter, HolderProgress, HolderWriter, Ledger, LedgerConfig, LedgerError, LedgerStats, MAX_HOLDERS,
    QueryOptions, Readiness,
};
pub use overlap::{Overlap, OverlapScores};
