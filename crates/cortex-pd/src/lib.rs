//! `cortex-pd`: prefill/decode orchestration (filled by the PD issue).
//!
//! It will own the explicit, pure state machines of disaggregated serving — SGLang (both legs at
//! once with `bootstrap_host/port/room`) and vLLM (prefill, then decode with
//! `kv_transfer_params`) — with retries only before the first byte reaches the client and a
//! fallback to a single worker. A thin async driver lives in the proxy.

#![forbid(unsafe_code)]
