//! `cortex-proxy`: the streaming data plane (filled by the gateway issue).
//!
//! It will be the only HTTP crate of the gateway: the hyper server and pooled client, the
//! OpenAI and SGLang routes, tokenization off the I/O threads, the `x-cortex-*` headers, SSE
//! pass-through, retries before the first byte, limits, and the single place where errors
//! become HTTP responses.
