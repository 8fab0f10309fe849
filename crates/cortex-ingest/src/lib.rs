//! `cortex-ingest`: the event runtime (filled by the event-ingestion issue).
//!
//! It will be the one place that knows ZeroMQ: one SUB socket per holder, sequence checks
//! (duplicate, gap, restart), replay through the engine's ROUTER socket, the READY / SYNCING /
//! STALE state machine per holder, and the writer lanes that apply decoded batches to the ledger.
