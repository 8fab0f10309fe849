//! Declares the cfgs the loom build uses, so that ordinary builds do not warn about them.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
    println!("cargo::rustc-check-cfg=cfg(crossbeam_loom)");
    println!(
        "cargo::rustc-check-cfg=cfg(cortex_loom_bug, values(\"publish_key_first\", \"free_now\", \"reuse_dead\"))"
    );
}
