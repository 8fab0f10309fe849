//! `cortex-sched`: the scheduler (filled by the scheduler issue).
//!
//! It will own the cluster snapshot (published with one atomic swap), the per-worker fast state
//! (atomics inherited by worker id), failure classes and cooldowns, and the decision
//! `score = α·matched_tokens − β·active_requests − γ·queue_latency` with a high watermark, bounded
//! load and the fixed degradation chain exact_kv_events → load_aware → fallback_p2c →
//! fallback_round_robin. It never sees HTTP types.
