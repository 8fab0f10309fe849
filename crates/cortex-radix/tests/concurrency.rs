//! Writers of different holders in parallel with lock-free readers (real threads, bounded
//! iterations, no sleeps): a reader never sees a block a holder never stored, never a prefix
//! longer than what was stored, and a removed worker's writer is refused. The loom models in
//! `src/table.rs`, `src/run.rs` and `src/slots.rs` check the interleavings exhaustively on a small scale; this checks the whole
//! ledger at a size where shards rebuild under the readers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cortex_hash::kv::{
    BlockRemoved, BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::{BlockHash, Engine, Namespace, SeqHash, chain};
use cortex_radix::{
    HolderConfig, HolderFilter, Ledger, LedgerConfig, LedgerError, OverlapScores, QueryOptions,
};

const HOLDERS: u32 = 4;
const CHAINS: u64 = 64;
const LEN: usize = 24;

fn lineage() -> Lineage {
    Lineage::new(Namespace::new(Engine::Sglang, 4, "m", None), None)
}

/// Chain `c` of holder `h`: its blocks' (content, seq). Chains of different holders share
/// nothing, so any cross-holder match is an over-count.
fn chain_of(h: u32, c: u64) -> Vec<(BlockHash, SeqHash)> {
    let l = lineage();
    let mut seq = l.root;
    (0..LEN as u64)
        .map(|i| {
            let content = BlockHash::from_bits((u64::from(h) << 48) ^ (c << 16) ^ i);
            seq = chain(seq, content);
            (content, seq)
        })
        .collect()
}

/// The longest prefix of chain `c` a writer ever stores: differs per chain (8 to `LEN`), so a
/// reader that sees more leading blocks than that has over-counted.
fn longest(c: u64) -> usize {
    8 + (c % (LEN as u64 - 7)) as usize
}

/// The prefix of chain `c` the writers store in `round` (stored prefixes grow and shrink).
fn stored_len(round: u64, c: u64) -> usize {
    1 + ((round * 7 + c) % longest(c) as u64) as usize
}

fn store(h: u32, c: u64, n: usize) -> KvEvent {
    let blocks = chain_of(h, c)
        .into_iter()
        .take(n)
        .map(|(content, seq)| StoredBlock { engine: EngineHash::from_u64(seq.to_bits()), content })
        .collect();
    KvEvent::Stored(BlockStored { parent: None, blocks, lineage: Some(lineage()), medium: Medium::Gpu })
}

fn remove(h: u32, c: u64) -> KvEvent {
    let blocks = chain_of(h, c).into_iter().map(|(_, seq)| EngineHash::from_u64(seq.to_bits())).collect();
    KvEvent::Removed(BlockRemoved { blocks, medium: Medium::Gpu })
}

#[test]
fn parallel_writers_and_readers_never_over_count() {
    let ledger = Ledger::new(LedgerConfig::default());
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..HOLDERS)
        .map(|h| {
            let cfg = HolderConfig { capacity_blocks: 100_000, content_deterministic: false };
            let mut w = ledger.add_holder(HolderId::new(WorkerId(h), DpRank(0)), cfg).expect("add");
            std::thread::spawn(move || {
                for round in 0..40u64 {
                    for c in 0..CHAINS {
                        // Stored prefixes grow and shrink; removes and re-stores churn the table.
                        let n = stored_len(round, c);
                        w.apply(&store(h, c, n)).expect("store");
                        if (round + c) % 3 == 0 {
                            w.apply(&remove(h, c)).expect("remove");
                        }
                    }
                }
                w
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let ledger = ledger.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut out = OverlapScores::with_capacity(HOLDERS as usize);
                let opts = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
                let mut queries = 0u64;
                let mut c = r;
                while !stop.load(Ordering::Relaxed) || queries < 1000 {
                    let h = (c % u64::from(HOLDERS)) as u32;
                    let seqs: Vec<SeqHash> = chain_of(h, c % CHAINS).into_iter().map(|(_, s)| s).collect();
                    ledger.query(&seqs, opts, &mut out);
                    for o in out.iter() {
                        assert_eq!(o.holder.worker.0, h, "holder {} matched holder {h}'s chain", o.holder);
                        assert!(
                            o.gpu_blocks as usize <= longest(c % CHAINS) && o.gpu_blocks <= o.any_tier_blocks,
                            "{o:?}: more than chain {} ever had stored ({})",
                            c % CHAINS,
                            longest(c % CHAINS)
                        );
                    }
                    queries += 1;
                    c += 1;
                }
                queries
            })
        })
        .collect();
    let mut writers: Vec<_> = writers.into_iter().map(|w| w.join().expect("writer")).collect();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().expect("reader") >= 1000);
    }
    // After the writers: each holder has exactly the prefixes of its last round.
    let mut out = OverlapScores::default();
    let opts = QueryOptions { holders: HolderFilter::All, ..QueryOptions::default() };
    for h in 0..HOLDERS {
        for c in 0..CHAINS {
            let seqs: Vec<SeqHash> = chain_of(h, c).into_iter().map(|(_, s)| s).collect();
            ledger.query(&seqs, opts, &mut out);
            let got = out.get(HolderId::new(WorkerId(h), DpRank(0))).map_or(0, |o| o.gpu_blocks);
            // Replay the writer's history for this chain: one reference per store, one per
            // remove (vLLM's rule), then count the leading blocks still referenced.
            let mut refs = [0u32; LEN];
            for round in 0..40u64 {
                let n = stored_len(round, c);
                refs[..n].iter_mut().for_each(|r| *r += 1);
                if (round + c) % 3 == 0 {
                    refs.iter_mut().for_each(|r| *r = r.saturating_sub(1));
                }
            }
            let want = refs.iter().take_while(|&&r| r > 0).count() as u32;
            assert_eq!(got, want, "holder {h} chain {c}");
        }
    }
    // Removing a worker refuses its writer, and its blocks stop counting at once.
    ledger.remove_worker(WorkerId(0));
    assert_eq!(
        writers[0].apply(&store(0, 0, 1)),
        Err(LedgerError::Revoked(HolderId::new(WorkerId(0), DpRank(0))))
    );
    let seqs: Vec<SeqHash> = chain_of(0, 1).into_iter().map(|(_, s)| s).collect();
    ledger.query(&seqs, opts, &mut out);
    assert!(out.is_empty());
    assert!(ledger.stats().table_rebuilds > 0, "the table never rebuilt under the readers");
    writers.clear();
}

#[test]
fn ledger_and_writer_are_send_and_sync_as_promised() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Ledger>();
    send::<cortex_radix::HolderWriter>();
}
