//! `cortex-sim`: runs many simulated workers in one process (filled by the simulator issue).
//!
//! Until the simulator issue lands this binary only says so, and exits with an error.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("cortex-sim: the simulator is not built yet (see the simulator issue)")
}
