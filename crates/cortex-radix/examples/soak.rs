//! The ledger soak (run by `cargo xtask soak`, release, not on every CI run): 10^7 events (16
//! blocks per store) with prefix churn against simulated engines that evict LRU blocks and whose
//! removes are sometimes lost (one in 50), orphan chains (one store in 100), half the holders
//! content-deterministic, two writer threads and a concurrent reader. It checks that the ledger's
//! memory (`stats().live_bytes`, which the bench checks against a counting allocator) stays
//! within the byte budget and that the process heap (ledger plus simulated engines, by a counting
//! allocator) does not grow once the working set is stable, and exits non-zero otherwise. With
//! `--budget-mib 8` the budget binds (budget evictions); with the default 64 only capacity does.
//!
//! `cargo run --release -p cortex-radix --example soak -- [--ops N] [--budget-mib M]`

#![allow(clippy::print_stdout, missing_docs)]

#[path = "../benches/workload.rs"]
mod workload;

use std::collections::{HashMap, VecDeque};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cortex_hash::kv::{
    BlockRemoved, BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};
use cortex_radix::{
    HolderConfig, HolderWriter, Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness,
};
use workload::{CountingAlloc, live_bytes, splitmix};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const HOLDERS: u32 = 8;
const CAPACITY: u32 = 20_000;
const CHAIN: usize = 64;
const EVENT: usize = 16;
/// Live prefixes at any time; the window slides, so old prefixes die (churn).
const WINDOW: u64 = 2_000;
/// One remove in this many is lost (the ledger must evict by capacity or budget).
const LOST_REMOVE_ONE_IN: u64 = 50;
/// One store in this many arrives without its parent (an orphan chain).
const ORPHAN_ONE_IN: u64 = 100;

struct Engine1 {
    writer: HolderWriter,
    /// Resident blocks and their copies (vLLM keeps a physical copy per store).
    resident: HashMap<u64, u32>,
    lru: VecDeque<u64>,
    rng: u64,
}

fn contents(prefix: u64) -> Vec<u64> {
    (0..CHAIN as u64).map(|i| splitmix(prefix.wrapping_mul(1_000_003) ^ i)).collect()
}

impl Engine1 {
    fn next(&mut self) -> u64 {
        self.rng = splitmix(self.rng);
        self.rng
    }

    /// Stores one chain (as 16-block events) and evicts to capacity; returns events applied.
    fn step(&mut self, lineage: Lineage, window_start: u64) -> u64 {
        let prefix = window_start + self.next() % WINDOW;
        let c = contents(prefix);
        let mut seq = lineage.root;
        let seqs: Vec<SeqHash> = c
            .iter()
            .map(|&b| {
                seq = chain(seq, BlockHash::from_bits(b));
                seq
            })
            .collect();
        let mut n = 0;
        let orphan = self.next().is_multiple_of(ORPHAN_ONE_IN);
        // Like an engine with prefix caching: the cached prefix is not stored again; the rest is,
        // in 16-block events, each block's copy counted (a later eviction removes every copy).
        let first_new = seqs.iter().position(|s| !self.resident.contains_key(&s.to_bits())).unwrap_or(CHAIN);
        // An orphan store: the chain's tail arrives with a parent nobody has (a lost event); a
        // later store of the whole chain grafts it, or capacity eviction expires it.
        let mut start = if orphan { first_new.max(EVENT) } else { first_new };
        let orphan_at = start;
        while start < CHAIN {
            let r = start..(start + EVENT).min(CHAIN);
            start = r.end;
            let parent = if r.start == 0 {
                None
            } else if orphan && r.start == orphan_at {
                Some(EngineHash::from_u64(self.next()))
            } else {
                Some(EngineHash::from_u64(seqs[r.start - 1].to_bits()))
            };
            let mut blocks = Vec::with_capacity(EVENT);
            for i in r {
                let engine = seqs[i].to_bits();
                let copies = self.resident.entry(engine).or_insert(0);
                *copies += 1;
                if *copies == 1 {
                    self.lru.push_back(engine);
                }
                blocks.push(StoredBlock {
                    engine: EngineHash::from_u64(engine),
                    content: BlockHash::from_bits(c[i]),
                });
            }
            let ev =
                KvEvent::Stored(BlockStored { parent, blocks, lineage: Some(lineage), medium: Medium::Gpu });
            self.writer.apply(&ev).expect("apply");
            n += 1;
        }
        let mut removed = Vec::new();
        while self.lru.len() > CAPACITY as usize {
            let Some(old) = self.lru.pop_front() else { break };
            let copies = self.resident.remove(&old).unwrap_or(0);
            for _ in 0..copies {
                if !self.next().is_multiple_of(LOST_REMOVE_ONE_IN) {
                    removed.push(EngineHash::from_u64(old));
                }
            }
        }
        if !removed.is_empty() {
            self.writer
                .apply(&KvEvent::Removed(BlockRemoved { blocks: removed, medium: Medium::Gpu }))
                .expect("apply");
            n += 1;
        }
        n
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|s| s.parse::<u64>().ok())
    };
    let total_ops = arg("--ops").unwrap_or(10_000_000);
    let budget = arg("--budget-mib").unwrap_or(64) as usize * 1024 * 1024;

    let before = live_bytes();
    let ledger = Ledger::new(LedgerConfig { byte_budget: budget, capacity_slack_percent: 25 });
    let ns = Namespace::new(Engine::Vllm, 16, "soak", None);
    let lineage = Lineage::new(ns, None);
    let ops = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));

    let mut engines: Vec<Engine1> = (0..HOLDERS)
        .map(|h| {
            let cfg = HolderConfig { capacity_blocks: CAPACITY, content_deterministic: h % 2 == 0 };
            let mut writer =
                ledger.add_holder(HolderId::new(WorkerId(h), DpRank(0)), cfg).expect("add holder");
            writer.set_readiness(Readiness::Ready);
            let room = CAPACITY as usize + 2 * CHAIN;
            let (resident, lru) = (HashMap::with_capacity(room), VecDeque::with_capacity(room));
            Engine1 { writer, resident, lru, rng: splitmix(u64::from(h) + 1) }
        })
        .collect();
    let second: Vec<Engine1> = engines.split_off(HOLDERS as usize / 2);

    let spawn_writer = |mut engines: Vec<Engine1>| {
        let ops = ops.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !done.load(Ordering::Relaxed) {
                let window_start = ops.load(Ordering::Relaxed) / 20_000;
                let len = engines.len() as u64;
                let e = &mut engines[(k % len) as usize];
                let n = e.step(lineage, window_start);
                ops.fetch_add(n, Ordering::Relaxed);
                k += 1;
            }
            engines.len()
        })
    };
    let w1 = spawn_writer(engines);
    let w2 = spawn_writer(second);
    let reader = {
        let ledger = ledger.clone();
        let ops = ops.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let mut out = OverlapScores::with_capacity(HOLDERS as usize);
            let mut rng = 99u64;
            let mut queries = 0u64;
            let mut seqs = Vec::with_capacity(CHAIN);
            while !done.load(Ordering::Relaxed) {
                rng = splitmix(rng);
                let window_start = ops.load(Ordering::Relaxed) / 20_000;
                let c = contents(window_start + rng % WINDOW);
                seqs.clear();
                let mut seq = lineage.root;
                for &b in &c {
                    seq = chain(seq, BlockHash::from_bits(b));
                    seqs.push(seq);
                }
                ledger.query(&seqs, QueryOptions::default(), &mut out);
                queries += 1;
            }
            queries
        })
    };

    println!("soak: {total_ops} ops, budget {} MiB, {HOLDERS} holders x {CAPACITY} blocks", budget >> 20);
    println!(
        "| events (M) | process heap (ledger + simulated engines) | stats.live_bytes | of which runs+table / holders / det. index | blocks | orphans | det. waits / blocks | evictions cap / budget | unknown removes | runs / their blocks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut samples = Vec::new();
    let mut next = total_ops / 20;
    loop {
        let n = ops.load(Ordering::Relaxed);
        if n >= next {
            let s = ledger.stats();
            let live = live_bytes() - before;
            println!(
                "| {:.1} | {} | {} | {} / {} / {} | {} | {} | {} / {} | {} / {} | {} | {} / {} |",
                n as f64 / 1e6,
                live,
                s.live_bytes,
                s.table_bytes,
                s.holder_bytes,
                s.deterministic_index_bytes,
                s.blocks,
                s.orphans,
                s.deterministic_waits,
                s.deterministic_blocks,
                s.evictions_capacity,
                s.evictions_budget,
                s.unknown_removes,
                s.nodes,
                s.run_blocks
            );
            samples.push((n, live, s.live_bytes));
            next += total_ops / 20;
        }
        if n >= total_ops {
            break;
        }
        std::thread::yield_now();
    }
    done.store(true, Ordering::Relaxed);
    let queries = reader.join().expect("reader");
    let _ = (w1.join().expect("writer"), w2.join().expect("writer"));

    // Stable phase: the second half. No growth: its last sample is within 5 % of its first, and
    // its spread is within 10 % of its mean; everything within the budget.
    let stable: Vec<_> = samples[samples.len() / 2..].to_vec();
    let max_live = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let max_stat = samples.iter().map(|s| s.2).max().unwrap_or(0);
    let (lo, hi) =
        (stable.iter().map(|s| s.1).min().unwrap_or(0), stable.iter().map(|s| s.1).max().unwrap_or(0));
    let mean = stable.iter().map(|s| s.1 as f64).sum::<f64>() / stable.len().max(1) as f64;
    let first = stable.first().map_or(0, |s| s.1) as f64;
    let last = stable.last().map_or(0, |s| s.1) as f64;
    println!("queries run concurrently: {queries}");
    println!("max bytes: process heap {max_live}, ledger stats.live_bytes {max_stat}; budget {budget}");
    println!("stable phase: min {lo}, max {hi}, mean {mean:.0}, first {first:.0}, last {last:.0}");
    let mut ok = true;
    // The budget is the ledger's: its own accounting (which the bench checks against a counting
    // allocator) must stay within it. The process heap also holds the simulated engines.
    if max_stat > budget {
        println!("FAIL: ledger memory above the budget");
        ok = false;
    }
    if last > first * 1.05 {
        println!("FAIL: memory still grows in the stable phase");
        ok = false;
    }
    if (hi - lo) as f64 > mean * 0.10 {
        println!("FAIL: memory spread above 10 % in the stable phase");
        ok = false;
    }
    if ok {
        println!("soak: ok");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
