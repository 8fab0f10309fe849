//! Declares the cfgs the loom build uses, so that ordinary builds do not warn about them, and
//! turns `CORTEX_LOOM_BUG=<name>` into `--cfg cortex_loom_bug="<name>"` for this crate only: the
//! loom negative controls (`cargo xtask loom`) rebuild one crate, not the dependency graph.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
    println!("cargo::rustc-check-cfg=cfg(crossbeam_loom)");
    println!(
        "cargo::rustc-check-cfg=cfg(cortex_loom_bug, values(\"publish_key_first\", \"free_now\", \"reuse_dead\", \"id_after_active\", \"run_hashes_late\", \"free_run_now\", \"reclaim_unlocked\", \"len_before_hashes\"))"
    );
    println!("cargo::rerun-if-env-changed=CORTEX_LOOM_BUG");
    println!("cargo::rerun-if-changed=build.rs");
    if let Ok(bug) = std::env::var("CORTEX_LOOM_BUG")
        && !bug.is_empty()
    {
        println!("cargo::rustc-cfg=cortex_loom_bug=\"{bug}\"");
    }
}
