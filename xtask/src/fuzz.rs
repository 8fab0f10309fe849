//! `cargo xtask fuzz`: the long-running differential and fuzz targets, each for a time budget.
//!
//! CI runs bounded versions of each (ordinary tests and corpus replays); this command runs them
//! for minutes. A target is either a long `#[ignore]`d test of the main workspace, told its
//! budget in `CORTEX_FUZZ_SECONDS` (stable toolchain), or a libFuzzer target of the `fuzz/`
//! workspace (`cargo +nightly fuzz run`, with `cargo-fuzz` installed), run on its saved corpus.
//!
//! Key decision: the targets are one table, [`TARGETS`], so adding one is adding a row.

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

use crate::cargo;

/// Options of `cargo xtask fuzz`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Minutes per target.
    #[arg(long, default_value_t = 10)]
    pub minutes: u64,
    /// Targets to run, comma-separated, or `all` (see `--list`).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub target: Vec<String>,
    /// List the targets and exit.
    #[arg(long)]
    pub list: bool,
}

/// How a target runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runner {
    /// An ignored test of a workspace package: `cargo test -p <package> --features <features>
    /// --test <test> -- --ignored --exact <name>`.
    LongTest { package: &'static str, features: &'static str, test: &'static str, name: &'static str },
    /// A cargo-fuzz target of `fuzz/`, on its corpus `fuzz/corpus/<name>`, with inputs of at most
    /// `max_len` bytes.
    LibFuzzer { name: &'static str, max_len: usize },
}

/// One fuzz target.
#[derive(Debug, Clone, Copy)]
struct Target {
    name: &'static str,
    about: &'static str,
    runner: Runner,
}

const TARGETS: &[Target] = &[
    Target {
        name: "tokenizer",
        about: "Cortex's fast encoder against the tokenizers crate: every code point in context, then random adversarial text",
        runner: Runner::LongTest {
            package: "cortex-hash",
            features: "text",
            test: "text_properties",
            name: "fast_encoder_long_differential",
        },
    },
    Target {
        name: "vllm_decode",
        about: "vLLM KV-event decoder on arbitrary bytes (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "vllm_decode", max_len: 4096 },
    },
    Target {
        name: "sglang_decode",
        about: "SGLang KV-event decoder on arbitrary bytes (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "sglang_decode", max_len: 4096 },
    },
    Target {
        name: "request_facts",
        about: "the request-facts parser on arbitrary bytes and mutated real bodies (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "request_facts", max_len: 4096 },
    },
    Target {
        name: "dp_rank_splice",
        about: "the DP-rank body splicer: a JSON object comes out as itself plus the rank (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "dp_rank_splice", max_len: 4096 },
    },
    Target {
        name: "usage_tail",
        about: "the usage reader on arbitrary upstream bytes, SSE tails and JSON bodies (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "usage_tail", max_len: 4096 },
    },
    Target {
        name: "config_yaml",
        about: "the YAML config loader, parsing and validation (nightly, cargo-fuzz)",
        runner: Runner::LibFuzzer { name: "config_yaml", max_len: 16384 },
    },
];

impl Runner {
    /// The command (program, arguments, working directory below the root, environment).
    fn command(&self, seconds: u64) -> (String, Vec<String>, &'static str, Vec<(String, String)>) {
        match *self {
            Runner::LongTest { package, features, test, name } => (
                cargo(),
                [
                    "test",
                    "-p",
                    package,
                    "--features",
                    features,
                    "--test",
                    test,
                    "--",
                    "--ignored",
                    "--exact",
                    name,
                    "--nocapture",
                ]
                .map(str::to_owned)
                .to_vec(),
                ".",
                vec![("CORTEX_FUZZ_SECONDS".to_owned(), seconds.to_string())],
            ),
            Runner::LibFuzzer { name, max_len } => (
                "cargo".to_owned(),
                vec![
                    "+nightly".to_owned(),
                    "fuzz".to_owned(),
                    "run".to_owned(),
                    name.to_owned(),
                    format!("corpus/{name}"),
                    "--".to_owned(),
                    format!("-max_total_time={seconds}"),
                    format!("-max_len={max_len}"),
                ],
                "fuzz",
                Vec::new(),
            ),
        }
    }
}

fn selected(names: &[String]) -> Result<Vec<Target>> {
    if names.iter().any(|n| n == "all") {
        return Ok(TARGETS.to_vec());
    }
    names
        .iter()
        .map(|n| {
            TARGETS.iter().find(|t| t.name == n).copied().with_context(|| {
                let known: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
                format!("unknown fuzz target {n:?}; known: {}", known.join(", "))
            })
        })
        .collect()
}

/// Runs the selected targets one after another, each for `--minutes`.
///
/// # Errors
/// An unknown target, a command that cannot start; a failing target is reported in the exit
/// code after the others ran.
#[allow(clippy::print_stdout, clippy::print_stderr)]
pub fn run(root: &Path, args: &Args) -> Result<ExitCode> {
    if args.list {
        for t in TARGETS {
            println!("{:<14} {}", t.name, t.about);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.minutes == 0 {
        bail!("--minutes must be at least 1");
    }
    let mut failed = Vec::new();
    for t in selected(&args.target)? {
        let (program, argv, dir, env) = t.runner.command(args.minutes * 60);
        println!("==> fuzz {}: {program} {} ({} min)", t.name, argv.join(" "), args.minutes);
        let status = Command::new(&program)
            .args(&argv)
            .envs(env)
            .current_dir(root.join(dir))
            .status()
            .with_context(|| format!("starting {program}"))?;
        if !status.success() {
            if let Runner::LibFuzzer { .. } = t.runner {
                eprintln!("fuzz {}: needs the nightly toolchain and `cargo install cargo-fuzz`", t.name);
            }
            eprintln!("fuzz {}: failed ({status})", t.name);
            failed.push(t.name);
        }
    }
    if failed.is_empty() {
        println!("fuzz: every target passed");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("fuzz: failed: {}", failed.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_is_selectable_and_names_a_real_test_or_fuzz_target() {
        let root = crate::workspace_root();
        let all = selected(&["all".to_owned()]).unwrap();
        assert_eq!(all.len(), TARGETS.len());
        for t in TARGETS {
            assert_eq!(selected(&[t.name.to_owned()]).unwrap()[0].name, t.name);
            match t.runner {
                Runner::LongTest { package, test, name, .. } => {
                    let file = root.join("crates").join(package).join("tests").join(format!("{test}.rs"));
                    let src = std::fs::read_to_string(&file).unwrap();
                    assert!(src.contains(&format!("fn {name}()")), "{} has no test {name}", file.display());
                }
                Runner::LibFuzzer { name, .. } => {
                    let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
                    assert!(
                        manifest.contains(&format!("name = \"{name}\"")),
                        "fuzz/Cargo.toml has no {name}"
                    );
                    assert!(root.join("fuzz/corpus").join(name).is_dir(), "no corpus for {name}");
                }
            }
        }
        assert!(selected(&["nope".to_owned()]).is_err());
    }

    #[test]
    fn the_budget_reaches_the_target() {
        let (_, argv, _, env) = TARGETS[0].runner.command(120);
        assert!(argv.contains(&"--ignored".to_owned()));
        assert_eq!(env, vec![("CORTEX_FUZZ_SECONDS".to_owned(), "120".to_owned())]);
        let lib = Runner::LibFuzzer { name: "vllm_decode", max_len: 4096 }.command(120);
        assert!(lib.1.contains(&"-max_total_time=120".to_owned()));
        assert!(lib.1.contains(&"-max_len=4096".to_owned()));
    }
}
