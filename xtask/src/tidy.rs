//! `cargo xtask tidy`: the workspace rules no compiler checks, run as an ordinary test too.
//!
//! - every crate root and module starts with a `//!` doc;
//! - the dependency direction of ARCHITECTURE.md holds (read from `cargo metadata`), including
//!   which crates may use ZeroMQ, HTTP, tokio, clap and anyhow;
//! - member manifests carry no versions (all live in `[workspace.dependencies]`) and inherit the
//!   workspace lints.
//!
//! Key decision: the allowed edges are written out below as a table, once; ARCHITECTURE.md shows
//! the same graph, and this check is what keeps the two honest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Which workspace crates each member may depend on (normal and build dependencies). Dev
/// dependencies may add `cortex-sim` (tests and benches drive simulated engines).
const ALLOWED: &[(&str, &[&str])] = &[
    ("cortex-hash", &[]),
    ("cortex-events-core", &["cortex-hash"]),
    ("cortex-events-vllm", &["cortex-hash", "cortex-events-core"]),
    ("cortex-events-sglang", &["cortex-hash", "cortex-events-core"]),
    ("cortex-radix", &["cortex-hash"]),
    ("cortex-ingest", &["cortex-hash", "cortex-radix", "cortex-events-vllm", "cortex-events-sglang"]),
    ("cortex-sched", &["cortex-hash", "cortex-radix"]),
    ("cortex-pd", &["cortex-hash", "cortex-radix", "cortex-sched"]),
    ("cortex-proxy", &["cortex-hash", "cortex-radix", "cortex-sched", "cortex-pd"]),
    ("cortex-sim", &["cortex-hash", "cortex-events-vllm", "cortex-events-sglang"]),
    ("cortex-gateway", &["*"]),
    ("cortex-sim-bin", &["*"]),
    ("xtask", &["*"]),
];

/// External crates only some members may use, with those members. Binaries and xtask may use
/// anything.
const RESTRICTED: &[(&str, &[&str])] = &[
    ("zmq", &["cortex-ingest", "cortex-sim"]),
    ("hyper", &["cortex-proxy", "cortex-sim"]),
    ("hyper-util", &["cortex-proxy", "cortex-sim"]),
    ("http-body-util", &["cortex-proxy", "cortex-sim"]),
    ("tokio", &["cortex-ingest", "cortex-proxy", "cortex-sim"]),
    ("clap", &[]),
    ("anyhow", &[]),
    ("serde_yaml_ng", &[]),
];

const BINARIES: &[&str] = &["cortex-gateway", "cortex-sim-bin", "xtask"];

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation(pub String);

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Runs every rule on the workspace at `root`.
///
/// # Errors
/// If `cargo metadata` or a manifest cannot be read; broken rules are returned as violations.
pub fn run(root: &Path) -> Result<Vec<Violation>> {
    let members = members(root)?;
    let mut out = Vec::new();
    for m in &members {
        out.extend(check_docs(&m.dir)?);
        out.extend(check_manifest(m)?);
    }
    out.extend(check_direction(&members));
    Ok(out)
}

/// A workspace member as `cargo metadata` describes it.
#[derive(Debug, Clone)]
pub struct Member {
    /// Package name.
    pub name: String,
    /// Directory of its manifest.
    pub dir: PathBuf,
    /// (dependency name, kind) pairs; kind is `normal`, `dev` or `build`.
    pub deps: Vec<(String, String)>,
}

fn members(root: &Path) -> Result<Vec<Member>> {
    let meta = crate::cargo_metadata(root)?;
    let packages = meta["packages"].as_array().context("metadata packages")?;
    packages
        .iter()
        .map(|p| {
            let manifest = PathBuf::from(p["manifest_path"].as_str().context("manifest_path")?);
            Ok(Member {
                name: p["name"].as_str().context("name")?.to_owned(),
                dir: manifest.parent().context("manifest dir")?.to_path_buf(),
                deps: p["dependencies"]
                    .as_array()
                    .context("dependencies")?
                    .iter()
                    .map(|d| {
                        (
                            d["name"].as_str().unwrap_or_default().to_owned(),
                            d["kind"].as_str().unwrap_or("normal").to_owned(),
                        )
                    })
                    .collect(),
            })
        })
        .collect()
}

/// Every `.rs` file under `src/` starts with a `//!` inner doc comment.
fn check_docs(dir: &Path) -> Result<Vec<Violation>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.join("src")];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries {
            let path = e?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&path)?;
                let first = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with("#!["));
                if !first.is_some_and(|l| l.starts_with("//!")) {
                    out.push(Violation(format!(
                        "{}: module does not start with a `//!` doc",
                        path.display()
                    )));
                }
            }
        }
    }
    Ok(out)
}

fn check_manifest(m: &Member) -> Result<Vec<Violation>> {
    let path = m.dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&path)?;
    let doc: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut out = Vec::new();
    let mut tables: Vec<(String, &toml::Table)> = Vec::new();
    for key in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if let Some(t) = doc.get(key).and_then(toml::Value::as_table) {
            tables.push((key.to_owned(), t));
        }
    }
    if let Some(targets) = doc.get("target").and_then(toml::Value::as_table) {
        for (cfg, t) in targets {
            for key in ["dependencies", "dev-dependencies", "build-dependencies"] {
                if let Some(deps) = t.get(key).and_then(toml::Value::as_table) {
                    tables.push((format!("target.{cfg}.{key}"), deps));
                }
            }
        }
    }
    for (section, deps) in tables {
        for (name, spec) in deps {
            let inherits =
                spec.as_table().and_then(|t| t.get("workspace")).and_then(toml::Value::as_bool) == Some(true);
            if !inherits {
                out.push(Violation(format!(
                    "{}: [{section}] {name} does not use `workspace = true`; versions live in [workspace.dependencies]",
                    path.display()
                )));
            }
        }
    }
    let lints = doc
        .get("lints")
        .and_then(toml::Value::as_table)
        .and_then(|t| t.get("workspace"))
        .and_then(toml::Value::as_bool);
    if lints != Some(true) {
        out.push(Violation(format!("{}: missing `[lints] workspace = true`", path.display())));
    }
    Ok(out)
}

fn check_direction(members: &[Member]) -> Vec<Violation> {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let restricted: BTreeMap<&str, &[&str]> = RESTRICTED.iter().copied().collect();
    let names: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
    let mut out = Vec::new();
    for m in members {
        let Some(ok) = allowed.get(m.name.as_str()) else {
            out.push(Violation(format!(
                "{}: not in the dependency table of xtask/src/tidy.rs and ARCHITECTURE.md",
                m.name
            )));
            continue;
        };
        let binary = BINARIES.contains(&m.name.as_str());
        for (dep, kind) in &m.deps {
            if names.contains(&dep.as_str()) {
                let fine =
                    ok.contains(&"*") || ok.contains(&dep.as_str()) || (kind == "dev" && dep == "cortex-sim");
                if !fine {
                    out.push(Violation(format!(
                        "{} may not depend on {dep} ({kind}): see ARCHITECTURE.md",
                        m.name
                    )));
                }
            } else if let Some(users) = restricted.get(dep.as_str())
                && !binary
                && kind != "dev"
                && !users.contains(&m.name.as_str())
            {
                out.push(Violation(format!(
                    "{} may not use {dep}: only {users:?} and the binaries may",
                    m.name
                )));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, deps: &[(&str, &str)]) -> Member {
        Member {
            name: name.to_owned(),
            dir: PathBuf::new(),
            deps: deps.iter().map(|(d, k)| ((*d).to_owned(), (*k).to_owned())).collect(),
        }
    }

    #[test]
    fn direction_rules_catch_wrong_edges() {
        let ws = vec![
            member("cortex-hash", &[]),
            member("cortex-radix", &[("cortex-hash", "normal"), ("cortex-events-vllm", "normal")]),
            member("cortex-events-vllm", &[("cortex-events-core", "normal"), ("tokio", "normal")]),
            member(
                "cortex-events-sglang",
                &[("cortex-events-core", "normal"), ("cortex-events-vllm", "normal")],
            ),
            member("cortex-events-core", &[("cortex-hash", "normal")]),
            member("cortex-sched", &[("cortex-radix", "normal"), ("cortex-sim", "dev")]),
            member("cortex-proxy", &[("cortex-ingest", "normal"), ("hyper", "normal")]),
            member("cortex-ingest", &[]),
            member("cortex-sim", &[]),
        ];
        let v: Vec<String> = check_direction(&ws).into_iter().map(|v| v.0).collect();
        assert!(v.iter().any(|s| s.contains("cortex-radix may not depend on cortex-events-vllm")), "{v:?}");
        assert!(v.iter().any(|s| s.contains("cortex-events-vllm may not use tokio")), "{v:?}");
        assert!(v.iter().any(|s| s.contains("cortex-proxy may not depend on cortex-ingest")), "{v:?}");
        // The two event crates share cortex-events-core, never each other.
        assert!(
            v.iter().any(|s| s.contains("cortex-events-sglang may not depend on cortex-events-vllm")),
            "{v:?}"
        );
        assert_eq!(v.len(), 4, "{v:?}");
    }
}
