//! `cortex-gateway`: the binary platform teams deploy (filled by the gateway issue).
//!
//! Wiring happens once, here: the YAML configuration and clap CLI, the worker registry, the
//! ingest runtime, the scheduler and the proxy. Until the gateway issue lands this binary only
//! says so, and exits with an error.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("cortex-gateway: the data plane is not built yet (see the gateway issue)")
}
