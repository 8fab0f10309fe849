//! Finding, running and reading the workspace's benchmarks.
//!
//! Every `[[bench]]` target of every workspace member is found with `cargo metadata` (with its
//! `required-features`), run with `cargo bench -p <package> --bench <name>`, and its output kept
//! in a log. Criterion's numbers are read from `target/criterion/**/new/{benchmark,estimates}.json`
//! — only files written after the bench started, so a number in the report is always from this
//! run.
//!
//! Key decision: nothing here knows a benchmark by heart except how to run it; the report
//! ([`super::report`]) picks the numbers it tabulates by criterion id, and every criterion result
//! of the run is listed anyway.

use crate::cargo;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde_json::Value;

/// A `[[bench]]` target of a workspace member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchTarget {
    /// Package name.
    pub package: String,
    /// Bench target name.
    pub bench: String,
    /// Its `required-features`.
    pub features: Vec<String>,
}

impl BenchTarget {
    /// `package/bench`.
    #[must_use]
    pub fn id(&self) -> String {
        format!("{}/{}", self.package, self.bench)
    }

    /// The command that runs it.
    #[must_use]
    pub fn command(&self) -> String {
        let mut s = format!("cargo bench -p {} --bench {}", self.package, self.bench);
        if !self.features.is_empty() {
            s.push_str(&format!(" --features {}", self.features.join(",")));
        }
        s
    }
}

/// Every bench target of the workspace, sorted by package and name.
///
/// # Errors
/// `cargo metadata` fails.
pub fn discover(root: &Path) -> Result<Vec<BenchTarget>> {
    Ok(bench_targets(&crate::cargo_metadata(root)?))
}

fn bench_targets(meta: &Value) -> Vec<BenchTarget> {
    let mut out = Vec::new();
    for p in meta["packages"].as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            if t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bench")) {
                out.push(BenchTarget {
                    package: p["name"].as_str().unwrap_or_default().to_owned(),
                    bench: t["name"].as_str().unwrap_or_default().to_owned(),
                    features: t["required-features"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|f| f.as_str().map(str::to_owned))
                        .collect(),
                });
            }
        }
    }
    out.sort_by(|a, b| (&a.package, &a.bench).cmp(&(&b.package, &b.bench)));
    out
}

/// What running one bench produced.
#[derive(Debug, Clone)]
pub struct BenchRun {
    /// The target.
    pub target: BenchTarget,
    /// Whether it exited successfully.
    pub ok: bool,
    /// Everything it printed (stdout and stderr, interleaved by line).
    pub output: String,
    /// When it started.
    pub started: SystemTime,
}

/// Runs `target` with `args` after `--` and `env`, echoing its output (except criterion's
/// progress lines) and keeping it in `log`.
///
/// # Errors
/// The command cannot be spawned or the log cannot be written; a failing bench is reported in
/// [`BenchRun::ok`], not as an error.
#[allow(clippy::print_stderr)]
pub fn run(
    root: &Path,
    target: &BenchTarget,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
) -> Result<BenchRun> {
    let started = SystemTime::now();
    let mut cmd = Command::new(cargo());
    cmd.args(["bench", "-p", &target.package, "--bench", &target.bench]);
    if !target.features.is_empty() {
        cmd.args(["--features", &target.features.join(",")]);
    }
    cmd.arg("--").args(args).current_dir(root).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    eprintln!("bench: {} -- {}", target.command(), args.join(" "));
    let mut child = cmd.spawn().with_context(|| format!("running {}", target.command()))?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    for stream in [
        child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(std::result::Result::ok) {
                let _ = tx.send(line);
            }
        }));
    }
    drop(tx);
    let mut file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut output = String::new();
    for line in rx {
        writeln!(file, "{line}")?;
        if !line.starts_with("Benchmarking ") && !line.trim().is_empty() {
            eprintln!("  {line}");
        }
        output.push_str(&line);
        output.push('\n');
    }
    for r in readers {
        let _ = r.join();
    }
    let ok = child.wait()?.success();
    Ok(BenchRun { target: target.clone(), ok, output, started })
}

/// One criterion result.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// `group/function[/value]`.
    pub id: String,
    /// Mean time per iteration, ns.
    pub mean_ns: f64,
    /// 95 % confidence interval of the mean, ns.
    pub mean_ci_ns: (f64, f64),
    /// Median of the sample means, ns.
    pub median_ns: f64,
    /// Elements (or bytes) per iteration, if the bench declared a throughput.
    pub elements: Option<f64>,
}

impl Estimate {
    /// Elements per second at the mean, if a throughput was declared.
    #[must_use]
    pub fn per_second(&self) -> Option<f64> {
        self.elements.map(|e| e / (self.mean_ns * 1e-9))
    }
}

/// Every criterion result under `criterion_dir` written at or after `since`, by id.
///
/// # Errors
/// A result file exists but cannot be read.
pub fn collect(criterion_dir: &Path, since: SystemTime) -> Result<BTreeMap<String, Estimate>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![criterion_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries {
            let path = e?.path();
            if !path.is_dir() {
                continue;
            }
            if path.file_name().is_some_and(|n| n == "new") {
                if let Some(est) = read_one(&path, since)? {
                    out.insert(est.id.clone(), est);
                }
            } else if path.file_name().is_none_or(|n| n != "base" && n != "change" && n != "report") {
                stack.push(path);
            }
        }
    }
    Ok(out)
}

fn read_one(new_dir: &Path, since: SystemTime) -> Result<Option<Estimate>> {
    let est_path: PathBuf = new_dir.join("estimates.json");
    let bench_path = new_dir.join("benchmark.json");
    let Ok(meta) = std::fs::metadata(&est_path) else { return Ok(None) };
    if meta.modified()? < since || !bench_path.exists() {
        return Ok(None);
    }
    let bench: Value = serde_json::from_str(&std::fs::read_to_string(&bench_path)?)
        .with_context(|| format!("parsing {}", bench_path.display()))?;
    let est: Value = serde_json::from_str(&std::fs::read_to_string(&est_path)?)
        .with_context(|| format!("parsing {}", est_path.display()))?;
    Ok(parse(&bench, &est))
}

/// An [`Estimate`] from criterion's `benchmark.json` and `estimates.json`.
#[must_use]
pub fn parse(bench: &Value, est: &Value) -> Option<Estimate> {
    let mut id =
        format!("{}/{}", bench["group_id"].as_str()?, bench["function_id"].as_str().unwrap_or_default());
    if let Some(v) = bench["value_str"].as_str() {
        id.push('/');
        id.push_str(v);
    }
    let id = id.trim_end_matches('/').to_owned();
    let mean = &est["mean"];
    let elements = bench["throughput"].as_object().and_then(|t| t.values().next()).and_then(Value::as_f64);
    Some(Estimate {
        id,
        mean_ns: mean["point_estimate"].as_f64()?,
        mean_ci_ns: (
            mean["confidence_interval"]["lower_bound"].as_f64()?,
            mean["confidence_interval"]["upper_bound"].as_f64()?,
        ),
        median_ns: est["median"]["point_estimate"].as_f64()?,
        elements,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn estimates_from_criterion_files() {
        let bench = json!({"group_id": "chain_8k_tokens", "function_id": "cortex_xxh3", "value_str": "16",
                           "throughput": {"Elements": 8192}, "full_id": "chain_8k_tokens/cortex_xxh3/16"});
        let est = json!({"mean": {"point_estimate": 2000.0, "confidence_interval": {"lower_bound": 1900.0, "upper_bound": 2100.0}},
                         "median": {"point_estimate": 1950.0}});
        let e = parse(&bench, &est).unwrap();
        assert_eq!(e.id, "chain_8k_tokens/cortex_xxh3/16");
        assert_eq!((e.mean_ns, e.mean_ci_ns, e.median_ns), (2000.0, (1900.0, 2100.0), 1950.0));
        assert!((e.per_second().unwrap() - 4.096e9).abs() < 1.0, "{:?}", e.per_second());
        let bench =
            json!({"group_id": "decision", "function_id": "total", "value_str": null, "throughput": null});
        let e = parse(&bench, &est).unwrap();
        assert_eq!((e.id.as_str(), e.elements), ("decision/total", None));
    }

    #[test]
    fn bench_targets_with_required_features() {
        let meta = json!({"packages": [
            {"name": "b", "targets": [{"name": "lib", "kind": ["lib"]}, {"name": "z", "kind": ["bench"], "required-features": ["text"]}]},
            {"name": "a", "targets": [{"name": "y", "kind": ["bench"]}]},
        ]});
        let t = bench_targets(&meta);
        assert_eq!(t.iter().map(BenchTarget::id).collect::<Vec<_>>(), ["a/y", "b/z"]);
        assert_eq!(t[1].command(), "cargo bench -p b --bench z --features text");
    }

    #[test]
    fn the_workspace_has_benches() {
        let all = discover(&crate::workspace_root()).unwrap();
        assert!(all.iter().any(|t| t.package == "cortex-hash" && t.features == ["text"]), "{all:?}");
        assert!(all.iter().any(|t| t.package == "cortex-proxy" && t.bench == "chat8k"), "{all:?}");
    }
}
