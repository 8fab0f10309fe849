//! Metric names and descriptions, in one place.
//!
//! Key decision: the data plane records through the `metrics` facade (a no-op until the binary
//! installs the Prometheus recorder), and every name is a constant here so that dashboards and
//! docs/configuration.md have one list to follow. Gauges that mirror other components' state
//! (ledger, holders, workers) are refreshed when `/metrics` is scraped.

/// Histogram: seconds from request parsed to ranking ready (tokenization excluded).
pub const ROUTING_SECONDS: &str = "cortex_routing_decision_seconds";
/// Histogram: seconds rendering the template and tokenizing.
pub const TOKENIZE_SECONDS: &str = "cortex_tokenize_seconds";
/// Histogram: seconds hashing the tokens into block identities.
pub const HASH_SECONDS: &str = "cortex_hash_seconds";
/// Counter: routed requests by `route` and `mode`.
pub const REQUESTS: &str = "cortex_requests_total";
/// Counter: decisions below `exact_kv_events`, by `reason`.
pub const FALLBACKS: &str = "cortex_fallback_total";
/// Counter: upstream failures by `class` and `stage` (`head` or `stream`).
pub const UPSTREAM_ERRORS: &str = "cortex_upstream_errors_total";
/// Counter: retries onto another candidate.
pub const RETRIES: &str = "cortex_retries_total";
/// Counter: requests answered with a gateway error, by `code`.
pub const ERRORS: &str = "cortex_errors_total";
/// Counter: tokens the gateway predicted as cache hits.
pub const PREDICTED_HIT_TOKENS: &str = "cortex_predicted_hit_tokens_total";
/// Counter: tokens workers reported as cache hits for the same requests.
pub const REALIZED_HIT_TOKENS: &str = "cortex_realized_hit_tokens_total";
/// Counter: alignment checks by `worker` and `result` (`ok`, `failed`).
pub const ALIGNMENT_CHECKS: &str = "cortex_alignment_checks_total";
/// Gauge: 1 when a worker's profile is aligned, 0 when misaligned or unconfirmed, by `worker`.
pub const ALIGNED: &str = "cortex_worker_aligned";
/// Gauge: ledger state per holder (`worker`, `rank`, `state`), 1 for the current state.
pub const LEDGER_STATE: &str = "cortex_ledger_state";
/// Gauge: ledger live bytes.
pub const LEDGER_BYTES: &str = "cortex_ledger_live_bytes";
/// Gauge: ledger (holder, block) entries.
pub const LEDGER_BLOCKS: &str = "cortex_ledger_blocks";
/// Gauge: ledger orphan blocks.
pub const LEDGER_ORPHANS: &str = "cortex_ledger_orphans";
/// Counter: ledger evictions (capacity or budget).
pub const LEDGER_EVICTIONS: &str = "cortex_ledger_evictions_total";
/// Gauge: requests in flight booked by this gateway, by `worker` and `rank`.
pub const WORKER_INFLIGHT: &str = "cortex_worker_inflight_requests";
/// Gauge: engine-reported running requests, by `worker` and `rank`.
pub const WORKER_RUNNING: &str = "cortex_worker_running_requests";
/// Gauge: engine-reported waiting requests, by `worker` and `rank`.
pub const WORKER_WAITING: &str = "cortex_worker_waiting_requests";
/// Gauge: engine-reported KV usage in [0, 1], by `worker` and `rank`.
pub const WORKER_KV_USAGE: &str = "cortex_worker_kv_usage";
/// Gauge: the learned prefill speed, prompt tokens per second, by `worker` and `rank`.
pub const WORKER_PREFILL_RATE: &str = "cortex_worker_prefill_tokens_per_second";
/// Gauge: the learned fixed overhead before a first token, seconds, by `worker` and `rank`.
pub const WORKER_PREFILL_OVERHEAD: &str = "cortex_worker_prefill_overhead_seconds";
/// Gauge: 1 when a worker is in the live pool, by `worker`.
pub const WORKER_LIVE: &str = "cortex_worker_live";
/// Gauge: requests being processed by the gateway (holding an admission slot).
pub const INFLIGHT: &str = "cortex_inflight_requests";
/// Counter: KV-event batches applied, by `worker` and `rank`.
pub const EVENT_BATCHES: &str = "cortex_event_batches_total";
/// Counter: duplicate KV-event batches dropped, by `worker` and `rank`.
pub const EVENT_DUPLICATES: &str = "cortex_event_duplicates_total";
/// Counter: event-plane transitions and repairs (gaps, restarts, replays, silence...), by
/// `worker`, `rank` and `reason`.
pub const EVENT_TRANSITIONS: &str = "cortex_event_transitions_total";
/// Counter: replays requested from an engine's replay socket, by `worker` and `rank`.
pub const EVENT_REPLAYS: &str = "cortex_event_replays_requested_total";
/// Counter: KV-event payloads that did not decode, by `worker`, `rank` and `kind`.
pub const EVENT_DECODE_ERRORS: &str = "cortex_event_decode_errors_total";
/// Gauge: seconds from the engine's batch timestamp to the batch being visible in the ledger,
/// last batch, by `worker` and `rank`.
pub const EVENT_APPLY_LAG: &str = "cortex_event_apply_lag_seconds";
/// Gauge: the largest such lag seen, by `worker` and `rank`.
pub const EVENT_APPLY_LAG_MAX: &str = "cortex_event_apply_lag_max_seconds";
/// Counter: connections closed at accept because `limits.max_connections` were open.
pub const CONNECTIONS_REFUSED: &str = "cortex_connections_refused_total";

/// Counter: disaggregated requests by `outcome` (`served`, `failed`, `client_gone`) and `pd`
/// (`disaggregated`, `fallback_single`; `none` when nothing was served).
pub const PD_REQUESTS: &str = "cortex_pd_requests_total";
/// Histogram: seconds from a disaggregated request's first dispatch to the first byte the
/// client gets (the decode leg's first output).
pub const PD_FIRST_BYTE_SECONDS: &str = "cortex_pd_first_byte_seconds";
/// Histogram: seconds a prefill leg took, from dispatch to its complete answer.
pub const PD_PREFILL_SECONDS: &str = "cortex_pd_prefill_seconds";
/// Counter: PD legs that failed before the first byte, by `leg` (`prefill`, `decode`,
/// `decode_local`, `regular`) and `class`.
pub const PD_LEG_FAILURES: &str = "cortex_pd_leg_failures_total";
/// Counter: disaggregated requests served by one worker instead, by `reason`
/// (`transfer_failed`, `no_transfer_params`, `prefill_unavailable`, `decode_unavailable`).
pub const PD_FALLBACKS: &str = "cortex_pd_fallbacks_total";

/// Registers descriptions for every metric (call once after installing a recorder).
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        ROUTING_SECONDS,
        metrics::Unit::Seconds,
        "Routing decision time, tokenization excluded"
    );
    describe_histogram!(
        TOKENIZE_SECONDS,
        metrics::Unit::Seconds,
        "Chat template rendering and tokenization time"
    );
    describe_histogram!(HASH_SECONDS, metrics::Unit::Seconds, "Block identity hashing time");
    describe_counter!(REQUESTS, "Routed requests by route and match mode");
    describe_counter!(FALLBACKS, "Decisions below exact_kv_events, by reason");
    describe_counter!(UPSTREAM_ERRORS, "Upstream failures by class and stage");
    describe_counter!(RETRIES, "Retries onto another candidate before the first byte");
    describe_counter!(ERRORS, "Requests answered with a gateway error, by code");
    describe_counter!(PREDICTED_HIT_TOKENS, "Tokens the gateway predicted as cache hits");
    describe_counter!(REALIZED_HIT_TOKENS, "Tokens workers reported as cache hits for the same requests");
    describe_counter!(ALIGNMENT_CHECKS, "Alignment checks by worker and result");
    describe_gauge!(ALIGNED, "1 when the worker's profile is verified aligned");
    describe_gauge!(LEDGER_STATE, "Ledger state per holder (1 for the current state)");
    describe_gauge!(LEDGER_BYTES, metrics::Unit::Bytes, "Ledger live bytes");
    describe_gauge!(LEDGER_BLOCKS, "Ledger (holder, block) entries");
    describe_gauge!(LEDGER_ORPHANS, "Ledger orphan blocks waiting for their parent");
    describe_counter!(LEDGER_EVICTIONS, "Ledger evictions by capacity or byte budget");
    describe_gauge!(WORKER_INFLIGHT, "Requests in flight booked by this gateway");
    describe_gauge!(WORKER_RUNNING, "Engine-reported running requests");
    describe_gauge!(WORKER_WAITING, "Engine-reported waiting requests");
    describe_gauge!(WORKER_KV_USAGE, "Engine-reported KV cache usage");
    describe_gauge!(WORKER_LIVE, "1 when the worker is in the live pool");
    describe_gauge!(WORKER_PREFILL_RATE, "Learned prefill speed, prompt tokens per second");
    describe_gauge!(
        WORKER_PREFILL_OVERHEAD,
        metrics::Unit::Seconds,
        "Learned fixed overhead before a first token"
    );
    describe_gauge!(INFLIGHT, "Requests being processed by the gateway");
    describe_counter!(EVENT_BATCHES, "KV-event batches applied");
    describe_counter!(EVENT_DUPLICATES, "Duplicate KV-event batches dropped");
    describe_counter!(EVENT_TRANSITIONS, "Event-plane transitions and repairs, by reason");
    describe_counter!(EVENT_REPLAYS, "Replays requested from an engine's replay socket");
    describe_counter!(EVENT_DECODE_ERRORS, "KV-event payloads that did not decode, by kind");
    describe_gauge!(
        EVENT_APPLY_LAG,
        metrics::Unit::Seconds,
        "Engine batch timestamp to visible in the ledger, last batch"
    );
    describe_gauge!(EVENT_APPLY_LAG_MAX, metrics::Unit::Seconds, "Largest apply lag seen");
    describe_counter!(PD_REQUESTS, "Disaggregated requests by outcome and how they were served");
    describe_histogram!(
        PD_FIRST_BYTE_SECONDS,
        metrics::Unit::Seconds,
        "First dispatch to the client's first byte (the decode leg's first output)"
    );
    describe_histogram!(PD_PREFILL_SECONDS, metrics::Unit::Seconds, "Prefill leg duration");
    describe_counter!(PD_LEG_FAILURES, "PD legs failed before the first byte, by leg and class");
    describe_counter!(PD_FALLBACKS, "Disaggregated requests served by one worker, by reason");
    describe_counter!(CONNECTIONS_REFUSED, "Connections closed at accept: max_connections were open");
}
