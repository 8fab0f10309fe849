//! `cargo xtask sdk-check`: the official `openai` Python SDK and `requests` drive the demo
//! gateway (`cortex-gateway --demo`, both engines simulated) as real clients would: chat and
//! completions, streaming and not, `stream_options.include_usage`, the SDK's typed exceptions
//! with Cortex's error codes, a stream broken mid-way, the async client at concurrency 32, and
//! SGLang's `/generate` with `requests` (the script: `xtask/assets/sdk_check.py`).
//!
//! Key decisions:
//! - **The clients as users install them**: exact versions of the SDK and of everything it
//!   pulls, pinned, in a venv under the target directory created once and reused (the same
//!   helper as `pd-check`'s), so a fresh machine checks what this one did.
//! - **The gateway as users start it**: the binary's `--demo` on loopback ports chosen here,
//!   the admin token read from its banner (the script injects the mid-stream fault through the
//!   simulated workers the admin API lists). CI passes the test build's binary.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::net::start_demo;

/// What the venv gets from PyPI: the two clients and every package they pull, pinned.
pub const REQUIREMENTS: &[&str] = &[
    "openai==3.57.0",
    "requests==2.34.2",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "idna==3.20",
    "jiter==0.19.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "sniffio==1.3.1",
    "truststore==0.10.5",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
];

/// `cargo xtask sdk-check` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The Python that creates the venv.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The gateway's executable, already built (CI passes the test build's); without it the
    /// gateway is built and run with `cargo run`.
    #[arg(long)]
    pub gateway: Option<PathBuf>,
}

/// Runs the check.
///
/// # Errors
/// The venv cannot be made, the demo does not come up, or a check of the script fails.
#[allow(clippy::print_stdout)]
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let start = Instant::now();
    let target = crate::target_dir(root);
    let logs = target.join("sdk-check");
    std::fs::create_dir_all(&logs).context("creating target/sdk-check")?;
    let (py, installed) = crate::python_venv(&args.python, &target.join("sdk-check-venv"), REQUIREMENTS)?;
    match installed {
        Some(t) => println!(
            "sdk-check: venv created and {} packages installed in {:.1}s",
            REQUIREMENTS.len(),
            t.as_secs_f64()
        ),
        None => println!("sdk-check: venv already there"),
    }
    let cmd = match &args.gateway {
        Some(exe) => Command::new(exe),
        None => {
            let mut c = Command::new(crate::cargo());
            c.args(["run", "--quiet", "-p", "cortex-gateway", "--"]);
            c
        }
    };
    // The first run without `--gateway` builds the gateway.
    let demo = start_demo(
        root,
        cmd,
        &[],
        "cortex-gateway --demo",
        logs.join("gateway.log"),
        std::time::Duration::from_secs(600),
    )?;
    let (public, admin, token) = (demo.public, demo.admin, demo.token.clone());
    let script = root.join("xtask").join("assets").join("sdk_check.py");
    let checked = Instant::now();
    let status = Command::new(&py)
        .arg(&script)
        .args([
            "--base",
            &format!("http://{public}"),
            "--admin",
            &format!("http://{admin}"),
            "--token",
            &token,
        ])
        .current_dir(root)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("sdk-check: {} failed ({status})\n{}", script.display(), demo.proc.tail());
    }
    println!(
        "sdk-check: the openai SDK and requests passed in {:.1}s ({:.1}s in all)",
        checked.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
