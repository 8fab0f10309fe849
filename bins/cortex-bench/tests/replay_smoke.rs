//! CI smoke for `cargo xtask replay`, so the tooling cannot rot: a short Mooncake replay (the
//! first 400 requests, trace time 20× faster than real time, about 7 s of sending per policy)
//! through Cortex's default policy and round-robin, each on a fresh simulated cluster behind the
//! in-process gateway. No request may fail and cache-aware routing must serve more prompt tokens
//! from cache than round-robin. Caches are a quarter of the workload's unique pages (not the
//! default sixteenth): this early in the trace a conversation's next turn comes back after its
//! worker's small cache has turned over, and the margin must not be a coin toss.

#![allow(clippy::unwrap_used, clippy::print_stderr)] // a failed step should panic with its message

use clap::Parser;
use cortex_bench::replay::{self, Args, report};

#[test]
fn a_short_mooncake_replay_fails_nothing_and_beats_round_robin() {
    let root = cortex_bench::workspace_root();
    let out = std::env::temp_dir().join(format!("cortex-replay-smoke-{}", std::process::id()));
    let args = Args::try_parse_from([
        "replay",
        "--workload",
        "mooncake",
        "--requests",
        "400",
        "--compression",
        "20",
        "--max-output",
        "64",
        "--capacity-divisor",
        "4",
        "--policies",
        "cache_aware,round_robin",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let run = replay::run(&root, &args).unwrap();
    let goals = report::goals(&run);
    eprintln!("{}", report::table(&run, &goals));
    let files = report::write(&run, &goals, "replay smoke", &out).unwrap();
    assert!(files.iter().any(|f| f.ends_with("results.json")));
    assert!(files.iter().any(|f| f.ends_with("mooncake-ttft-cdf.svg")));

    let w = &run.workloads[0];
    assert_eq!(w.requests, 400);
    for r in &w.results {
        assert_eq!((r.failed, r.shed, r.ok), (0, 0, 400), "{}: {:?}", r.label, r.errors);
        assert_eq!(r.token_mismatches, 0, "{}: the workers tokenized differently", r.label);
        assert_eq!(r.load.unattributed, 0, "{}", r.label);
    }
    let hit = |label: &str| w.results.iter().find(|r| r.label == label).unwrap().hit_ratio;
    let (cortex, rr) = (hit("cortex cache_aware"), hit("cortex round_robin"));
    assert!(cortex > rr, "cache-aware {cortex:.3} is not above round-robin {rr:.3}");
    std::fs::remove_dir_all(&out).unwrap();
}
