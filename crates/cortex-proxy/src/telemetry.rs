//! Every metric of the gateway, in one table: name, kind, unit, labels, histogram buckets and
//! meaning.
//!
//! Key decisions: the data plane records through the `metrics` facade (a no-op until the binary
//! installs the Prometheus recorder built by [`prometheus_builder`]), and every name is a
//! constant here, listed once in [`METRICS`], so that the dashboard, the alert rules and
//! `docs/observability.md` have one list to follow (an xtask test checks the doc against it).
//! Latencies are Prometheus histograms with buckets chosen for what each measures (never
//! summaries: per-process quantiles cannot be aggregated across replicas). Counters whose label
//! values are all known are registered at zero by [`register_zeros`], so a rate over them exists
//! before the first event; gauges that mirror other components' state (ledger, holders, workers)
//! are refreshed when `/metrics` is scraped, and each worker's counters are registered at its
//! first scrape. A worker's gauges exist only while it is registered (rendered at each scrape,
//! outside the recorder); its counters stay after it left, as Prometheus counters do.

/// Histogram: seconds from request parsed to ranking ready (tokenization excluded).
pub const ROUTING_SECONDS: &str = "cortex_routing_decision_seconds";
/// Histogram: seconds rendering the template and tokenizing.
pub const TOKENIZE_SECONDS: &str = "cortex_tokenize_seconds";
/// Histogram: seconds hashing the tokens into block identities.
pub const HASH_SECONDS: &str = "cortex_hash_seconds";
/// Counter: generation requests by `route`, `mode` and `outcome`, counted once when the request
/// ends.
pub const REQUESTS: &str = "cortex_requests_total";
/// Histogram: seconds from a generation request's arrival to the first byte of the answer's
/// body the gateway relays, by `route`.
pub const FIRST_BYTE_SECONDS: &str = "cortex_first_byte_seconds";
/// Histogram: seconds from a generation request's arrival to its end, by `route` and `outcome`.
pub const REQUEST_SECONDS: &str = "cortex_request_duration_seconds";
/// Histogram: seconds from sending one request to a worker (an attempt or a PD leg) to its
/// response head (or the failure to get one).
pub const UPSTREAM_HEAD_SECONDS: &str = "cortex_upstream_head_seconds";
/// Histogram: seconds between the time to first token the decision estimated for a request on
/// its worker (`cache_aware`) and the time from dispatch to its streaming answer's first chunk
/// (the absolute difference).
pub const TTFT_ESTIMATE_ERROR_SECONDS: &str = "cortex_ttft_estimate_error_seconds";
/// Counter: prompt tokens workers reported for served requests, by `worker`.
pub const PROMPT_TOKENS: &str = "cortex_prompt_tokens_total";
/// Gauge: 1 when a worker could take a request now (live, not cooling down, circuit closed), by
/// `worker`.
pub const WORKER_ADMISSIBLE: &str = "cortex_worker_admissible";
/// Counter: decisions below `exact_kv_events`, by `reason`.
pub const FALLBACKS: &str = "cortex_fallback_total";
/// Counter: upstream failures by `class` and `stage` (`head` or `stream`).
pub const UPSTREAM_ERRORS: &str = "cortex_upstream_errors_total";
/// Counter: retries onto another candidate.
pub const RETRIES: &str = "cortex_retries_total";
/// Counter: requests answered with a gateway error, by `code`.
pub const ERRORS: &str = "cortex_errors_total";
/// Counter: tokens the gateway predicted as cache hits, by `worker`.
pub const PREDICTED_HIT_TOKENS: &str = "cortex_predicted_hit_tokens_total";
/// Counter: tokens workers reported as cache hits for the same requests, by `worker`.
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
/// Holder states quarantined after a panic (each leaked, still counted in the ledger's bytes).
pub const LEDGER_QUARANTINED: &str = "cortex_ledger_quarantined_holders";
/// Counter: ledger evictions (capacity or budget).
pub const LEDGER_EVICTIONS: &str = "cortex_ledger_evictions_total";
/// Gauge: requests in flight booked by this gateway, by `worker` and `rank`.
pub const WORKER_INFLIGHT: &str = "cortex_worker_inflight_requests";
/// Gauge: engine-reported running requests, by `worker` and `rank`.
pub const WORKER_RUNNING: &str = "cortex_worker_running_requests";
/// Gauge: engine-reported waiting requests, by `worker` and `rank`.
pub const WORKER_WAITING: &str = "cortex_worker_waiting_requests";
/// Gauge: engine-reported KV usage in [0, 1], by `worker` and `rank`.
pub const WORKER_KV_USAGE: &str = "cortex_worker_kv_usage_ratio";
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
/// Counter: KV-event batches whose DP rank is not the rank of the socket they came on (applied
/// to the socket's holder), by `worker` and `rank`.
pub const EVENT_RANK_MISMATCHES: &str = "cortex_event_rank_mismatches_total";
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
/// Counter by `scope`: answers given up (`answer`) and connections closed (`connection`) because
/// the client read nothing for `client_write_timeout`.
pub const CLIENT_WRITE_TIMEOUTS: &str = "cortex_client_write_timeouts_total";
/// Counter: connections closed at accept because `limits.max_connections` were open.
pub const CONNECTIONS_REFUSED: &str = "cortex_connections_refused_total";

/// Counter: disaggregated requests by `outcome` (`served`, `failed`, `rejected`) and `pd`
/// (`disaggregated`, `decode_only`, `fallback_single`; `none` when nothing was served).
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

/// What kind of series a metric is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// A monotonic counter (`_total`).
    Counter,
    /// A value that goes up and down.
    Gauge,
    /// A histogram with these bucket upper bounds (seconds).
    Histogram(&'static [f64]),
}

/// One metric: what the table says of it.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// The Prometheus name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// The unit (`seconds`, `bytes`, `tokens`, `requests`, `ratio`, ...), for the docs.
    pub unit: &'static str,
    /// The label names it carries.
    pub labels: &'static [&'static str],
    /// What it means.
    pub help: &'static str,
}

impl Metric {
    /// A gauge with a `worker` label: rendered from the registered workers at each scrape,
    /// never stored in the recorder (which cannot delete a departed worker's series).
    #[must_use]
    pub fn per_worker_gauge(&self) -> bool {
        self.kind == Kind::Gauge && self.labels.contains(&"worker")
    }
}

/// Routing decisions take microseconds.
const DECISION_BUCKETS: &[f64] =
    &[5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1];
/// Tokenizing a prompt: tens of microseconds to a second for a long chat.
const TOKENIZE_BUCKETS: &[f64] =
    &[2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0];
/// Hashing tokens into block identities: microseconds.
const HASH_BUCKETS: &[f64] = &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3];
/// A first byte or a response head: milliseconds (a cache hit) to a minute (a long prefill in a
/// queue).
const FIRST_BYTE_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// A whole request: up to the 10 minutes a long generation may stream.
const REQUEST_BUCKETS: &[f64] =
    &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// Every metric the gateway exports (the binary's discovery metrics are in its own table).
pub const METRICS: &[Metric] = &[
    Metric {
        name: REQUESTS,
        kind: Kind::Counter,
        unit: "requests",
        labels: &["route", "mode", "outcome"],
        help: "Generation requests, counted once when they end, by route, match mode and outcome",
    },
    Metric {
        name: FALLBACKS,
        kind: Kind::Counter,
        unit: "requests",
        labels: &["reason"],
        help: "Decisions below exact_kv_events, counted when the request ends, by reason",
    },
    Metric {
        name: ERRORS,
        kind: Kind::Counter,
        unit: "requests",
        labels: &["code"],
        help: "Requests answered with a gateway error, by code",
    },
    Metric {
        name: RETRIES,
        kind: Kind::Counter,
        unit: "attempts",
        labels: &[],
        help: "Retries onto another candidate before the first byte",
    },
    Metric {
        name: UPSTREAM_ERRORS,
        kind: Kind::Counter,
        unit: "failures",
        labels: &["class", "stage"],
        help: "Upstream failures by class and stage (head or stream)",
    },
    Metric {
        name: ROUTING_SECONDS,
        kind: Kind::Histogram(DECISION_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "Routing decision time, tokenization excluded",
    },
    Metric {
        name: TOKENIZE_SECONDS,
        kind: Kind::Histogram(TOKENIZE_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "Chat template rendering and tokenization time",
    },
    Metric {
        name: HASH_SECONDS,
        kind: Kind::Histogram(HASH_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "Block identity hashing time",
    },
    Metric {
        name: FIRST_BYTE_SECONDS,
        kind: Kind::Histogram(FIRST_BYTE_BUCKETS),
        unit: "seconds",
        labels: &["route"],
        help: "Arrival of a generation request to the first byte of its answer's body",
    },
    Metric {
        name: REQUEST_SECONDS,
        kind: Kind::Histogram(REQUEST_BUCKETS),
        unit: "seconds",
        labels: &["route", "outcome"],
        help: "Arrival of a generation request to its end",
    },
    Metric {
        name: UPSTREAM_HEAD_SECONDS,
        kind: Kind::Histogram(FIRST_BYTE_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "One request to a worker (an attempt or a PD leg) sent to its response head",
    },
    Metric {
        name: TTFT_ESTIMATE_ERROR_SECONDS,
        kind: Kind::Histogram(FIRST_BYTE_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "Absolute difference between a request's estimated time to first token and the time from dispatch to its streaming answer's first chunk (cache_aware)",
    },
    Metric {
        name: PREDICTED_HIT_TOKENS,
        kind: Kind::Counter,
        unit: "tokens",
        labels: &["worker"],
        help: "Prompt tokens the gateway predicted as cache hits, for requests whose worker reported its hit",
    },
    Metric {
        name: REALIZED_HIT_TOKENS,
        kind: Kind::Counter,
        unit: "tokens",
        labels: &["worker"],
        help: "Prompt tokens workers reported as cache hits",
    },
    Metric {
        name: PROMPT_TOKENS,
        kind: Kind::Counter,
        unit: "tokens",
        labels: &["worker"],
        help: "Prompt tokens of the same requests (the denominator of the hit rate)",
    },
    Metric {
        name: ALIGNMENT_CHECKS,
        kind: Kind::Counter,
        unit: "checks",
        labels: &["worker", "result"],
        help: "Alignment checks by worker and result",
    },
    Metric {
        name: ALIGNED,
        kind: Kind::Gauge,
        unit: "boolean",
        labels: &["worker"],
        help: "1 when the worker's profile is verified aligned",
    },
    Metric {
        name: LEDGER_STATE,
        kind: Kind::Gauge,
        unit: "boolean",
        labels: &["worker", "rank", "state"],
        help: "Ledger state per holder (1 for the current state)",
    },
    Metric { name: LEDGER_BYTES, kind: Kind::Gauge, unit: "bytes", labels: &[], help: "Ledger live bytes" },
    Metric {
        name: LEDGER_BLOCKS,
        kind: Kind::Gauge,
        unit: "entries",
        labels: &[],
        help: "Ledger (holder, block) entries",
    },
    Metric {
        name: LEDGER_ORPHANS,
        kind: Kind::Gauge,
        unit: "blocks",
        labels: &[],
        help: "Ledger orphan blocks waiting for their parent",
    },
    Metric {
        name: LEDGER_QUARANTINED,
        kind: Kind::Gauge,
        unit: "holders",
        labels: &[],
        help: "Holder states quarantined after a panic, leaked and still counted in the ledger's bytes",
    },
    Metric {
        name: LEDGER_EVICTIONS,
        kind: Kind::Counter,
        unit: "blocks",
        labels: &["reason"],
        help: "Ledger evictions by capacity or byte budget",
    },
    Metric {
        name: WORKER_INFLIGHT,
        kind: Kind::Gauge,
        unit: "requests",
        labels: &["worker", "rank"],
        help: "Requests in flight booked by this gateway",
    },
    Metric {
        name: WORKER_RUNNING,
        kind: Kind::Gauge,
        unit: "requests",
        labels: &["worker", "rank"],
        help: "Engine-reported running requests",
    },
    Metric {
        name: WORKER_WAITING,
        kind: Kind::Gauge,
        unit: "requests",
        labels: &["worker", "rank"],
        help: "Engine-reported waiting requests",
    },
    Metric {
        name: WORKER_KV_USAGE,
        kind: Kind::Gauge,
        unit: "ratio",
        labels: &["worker", "rank"],
        help: "Engine-reported KV cache usage, 0 to 1",
    },
    Metric {
        name: WORKER_PREFILL_RATE,
        kind: Kind::Gauge,
        unit: "tokens per second",
        labels: &["worker", "rank"],
        help: "Learned prefill speed, prompt tokens per second",
    },
    Metric {
        name: WORKER_PREFILL_OVERHEAD,
        kind: Kind::Gauge,
        unit: "seconds",
        labels: &["worker", "rank"],
        help: "Learned fixed overhead before a first token",
    },
    Metric {
        name: WORKER_LIVE,
        kind: Kind::Gauge,
        unit: "boolean",
        labels: &["worker"],
        help: "1 when the worker is in the live pool",
    },
    Metric {
        name: WORKER_ADMISSIBLE,
        kind: Kind::Gauge,
        unit: "boolean",
        labels: &["worker"],
        help: "1 when some rank of the worker could take a request now (live, not cooling, circuit closed)",
    },
    Metric {
        name: INFLIGHT,
        kind: Kind::Gauge,
        unit: "requests",
        labels: &[],
        help: "Requests being processed by the gateway (holding an admission slot)",
    },
    Metric {
        name: EVENT_BATCHES,
        kind: Kind::Counter,
        unit: "batches",
        labels: &["worker", "rank"],
        help: "KV-event batches applied",
    },
    Metric {
        name: EVENT_DUPLICATES,
        kind: Kind::Counter,
        unit: "batches",
        labels: &["worker", "rank"],
        help: "Duplicate KV-event batches dropped",
    },
    Metric {
        name: EVENT_RANK_MISMATCHES,
        kind: Kind::Counter,
        unit: "batches",
        labels: &["worker", "rank"],
        help: "KV-event batches whose DP rank is not their socket's (applied to the socket's rank)",
    },
    Metric {
        name: EVENT_TRANSITIONS,
        kind: Kind::Counter,
        unit: "transitions",
        labels: &["worker", "rank", "reason"],
        help: "Event-plane transitions and repairs (gaps, restarts, replays, silence...), by reason",
    },
    Metric {
        name: EVENT_REPLAYS,
        kind: Kind::Counter,
        unit: "replays",
        labels: &["worker", "rank"],
        help: "Replays requested from an engine's replay socket",
    },
    Metric {
        name: EVENT_DECODE_ERRORS,
        kind: Kind::Counter,
        unit: "payloads",
        labels: &["worker", "rank", "kind"],
        help: "KV-event payloads that did not decode, by kind",
    },
    Metric {
        name: EVENT_APPLY_LAG,
        kind: Kind::Gauge,
        unit: "seconds",
        labels: &["worker", "rank"],
        help: "Engine batch timestamp to visible in the ledger, last batch",
    },
    Metric {
        name: EVENT_APPLY_LAG_MAX,
        kind: Kind::Gauge,
        unit: "seconds",
        labels: &["worker", "rank"],
        help: "Largest apply lag seen",
    },
    Metric {
        name: CLIENT_WRITE_TIMEOUTS,
        kind: Kind::Counter,
        unit: "events",
        labels: &["scope"],
        help: "Answers given up (scope answer) and connections closed (scope connection) because the client read nothing for client_write_timeout",
    },
    Metric {
        name: CONNECTIONS_REFUSED,
        kind: Kind::Counter,
        unit: "connections",
        labels: &[],
        help: "Connections closed at accept: max_connections were open",
    },
    Metric {
        name: PD_REQUESTS,
        kind: Kind::Counter,
        unit: "requests",
        labels: &["outcome", "pd"],
        help: "Disaggregated requests by outcome and how they were served",
    },
    Metric {
        name: PD_FIRST_BYTE_SECONDS,
        kind: Kind::Histogram(FIRST_BYTE_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "First dispatch of a disaggregated request to the client's first byte",
    },
    Metric {
        name: PD_PREFILL_SECONDS,
        kind: Kind::Histogram(FIRST_BYTE_BUCKETS),
        unit: "seconds",
        labels: &[],
        help: "Prefill leg duration",
    },
    Metric {
        name: PD_LEG_FAILURES,
        kind: Kind::Counter,
        unit: "legs",
        labels: &["leg", "class"],
        help: "PD legs failed before the first byte, by leg and class",
    },
    Metric {
        name: PD_FALLBACKS,
        kind: Kind::Counter,
        unit: "requests",
        labels: &["reason"],
        help: "Disaggregated requests served by one worker, by reason",
    },
];

/// The routes of generation requests (the `route` label).
pub const ROUTES: [&str; 3] = ["chat_completions", "completions", "generate"];

/// How a generation request ended (the `outcome` label of [`REQUESTS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The worker's answer was relayed to its end.
    Ok,
    /// The worker refused the request (its own 4xx, passed on).
    Rejected,
    /// The gateway answered with an error (no worker could serve, a bad request, overload...).
    Error,
    /// The worker's stream broke after the first byte.
    StreamFailed,
    /// The client left before the answer ended.
    ClientGone,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: [Outcome; 5] =
        [Outcome::Ok, Outcome::Rejected, Outcome::Error, Outcome::StreamFailed, Outcome::ClientGone];

    /// The label value.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Rejected => "rejected",
            Outcome::Error => "error",
            Outcome::StreamFailed => "stream_failed",
            Outcome::ClientGone => "client_gone",
        }
    }
}

/// The `mode` label of a request that ended before any decision.
pub const NO_MODE: &str = "none";

/// Records a request's error of estimated time to first token, seconds taken less seconds
/// estimated (what [`cortex_sched::Booking::first_output`] returns), when there was an estimate.
pub fn estimate_error(error: Option<f64>) {
    if let Some(e) = error {
        metrics::histogram!(TTFT_ESTIMATE_ERROR_SECONDS).record(e.abs());
    }
}

/// The Prometheus recorder's builder with every histogram's buckets.
#[must_use]
pub fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    let mut b = metrics_exporter_prometheus::PrometheusBuilder::new();
    for m in METRICS {
        if let Kind::Histogram(buckets) = m.kind {
            // Only an empty bucket list is refused, and none is empty (a unit test checks).
            b = match b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(m.name.to_owned()),
                buckets,
            ) {
                Ok(b) => b,
                Err(_) => metrics_exporter_prometheus::PrometheusBuilder::new(),
            };
        }
    }
    b
}

/// Registers descriptions for every metric the recorder renders (call once after installing a
/// recorder), and every counter whose label values are all known at zero. The per-worker gauges
/// are described where they are rendered, at each scrape.
pub fn describe() {
    for m in METRICS.iter().filter(|m| !m.per_worker_gauge()) {
        let unit = match m.unit {
            "seconds" => Some(metrics::Unit::Seconds),
            "bytes" => Some(metrics::Unit::Bytes),
            _ => None,
        };
        match (m.kind, unit) {
            (Kind::Counter, _) => metrics::describe_counter!(m.name, m.help),
            (Kind::Gauge, Some(u)) => metrics::describe_gauge!(m.name, u, m.help),
            (Kind::Gauge, None) => metrics::describe_gauge!(m.name, m.help),
            (Kind::Histogram(_), _) => metrics::describe_histogram!(m.name, metrics::Unit::Seconds, m.help),
        }
    }
    register_zeros();
}

/// Registers at zero every series whose label values are all known, so that rates and ratios
/// over them exist before the first event.
pub fn register_zeros() {
    use cortex_sched::{FailureClass, FallbackReason, MatchMode};
    let modes = MatchMode::ALL.iter().map(|m| m.as_str()).chain([NO_MODE]);
    for route in ROUTES {
        for mode in modes.clone() {
            for o in Outcome::ALL {
                metrics::counter!(REQUESTS, "route" => route, "mode" => mode, "outcome" => o.as_str())
                    .absolute(0);
            }
        }
    }
    for r in FallbackReason::ALL {
        metrics::counter!(FALLBACKS, "reason" => r.as_str()).absolute(0);
    }
    metrics::counter!(RETRIES).absolute(0);
    // The codes the queue-rejection alert watches (`ProxyError::Overloaded`, `QueueTimeout`).
    for code in ["gateway_overloaded", "queue_timeout"] {
        metrics::counter!(ERRORS, "code" => code).absolute(0);
    }
    metrics::counter!(CONNECTIONS_REFUSED).absolute(0);
    for scope in ["answer", "connection"] {
        metrics::counter!(CLIENT_WRITE_TIMEOUTS, "scope" => scope).absolute(0);
    }
    for c in FailureClass::ALL {
        for stage in ["head", "stream"] {
            metrics::counter!(UPSTREAM_ERRORS, "class" => c.as_str(), "stage" => stage).absolute(0);
        }
        for leg in cortex_pd::Leg::ALL {
            metrics::counter!(PD_LEG_FAILURES, "leg" => leg.as_str(), "class" => c.as_str()).absolute(0);
        }
    }
    for cause in cortex_pd::FallbackCause::ALL {
        metrics::counter!(PD_FALLBACKS, "reason" => cause.as_str()).absolute(0);
    }
}

/// Registers `worker`'s own counters at zero (called at each scrape: a new worker's series exist
/// from its first scrape).
pub(crate) fn register_worker(worker: &str) {
    for name in [PREDICTED_HIT_TOKENS, REALIZED_HIT_TOKENS, PROMPT_TOKENS] {
        metrics::counter!(name, "worker" => worker.to_owned()).increment(0);
    }
    for result in ["ok", "failed"] {
        metrics::counter!(ALIGNMENT_CHECKS, "worker" => worker.to_owned(), "result" => result).increment(0);
    }
}

#[cfg(test)]
mod tests {
    use super::{Kind, METRICS};

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut seen = std::collections::BTreeSet::new();
        for m in METRICS {
            assert!(seen.insert(m.name), "{} listed twice", m.name);
            assert!(m.name.starts_with("cortex_"), "{}", m.name);
            match m.kind {
                Kind::Counter => assert!(m.name.ends_with("_total"), "counter {} must end in _total", m.name),
                Kind::Gauge => assert!(!m.name.ends_with("_total"), "gauge {} ends in _total", m.name),
                Kind::Histogram(b) => {
                    assert!(m.name.ends_with("_seconds"), "histogram {} must say its unit", m.name);
                    assert!(!b.is_empty() && b.windows(2).all(|w| w[0] < w[1]), "{} buckets", m.name);
                }
            }
            if m.unit == "seconds" {
                assert!(m.name.ends_with("_seconds"), "{} is in seconds", m.name);
            }
            if m.unit == "ratio" {
                assert!(m.name.ends_with("_ratio"), "{} is a ratio", m.name);
            }
        }
    }
}
