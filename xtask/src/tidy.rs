//! `cargo xtask tidy`: the workspace rules no compiler checks, run as an ordinary test too.
//!
//! - every crate root and module starts with a `//!` doc;
//! - the dependency direction of ARCHITECTURE.md holds (read from `cargo metadata`), including
//!   which crates may use ZeroMQ, HTTP, tokio, clap and anyhow — a library may carry a binary of
//!   its own whose command-line crates are optional dependencies behind the feature only that
//!   binary requires, if no member turns the feature on and the library's code never names them;
//! - member manifests carry no versions (all live in `[workspace.dependencies]`) and inherit the
//!   workspace lints;
//! - a member whose sources hold no `unsafe` forbids it in every crate root (`#![forbid(unsafe_code)]`),
//!   so that unsafe code never arrives unnoticed in a crate that had none.
//!
//! Key decision: the allowed edges are written out below as a table, once; ARCHITECTURE.md shows
//! the same graph, and this check is what keeps the two honest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

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
    ("cortex-bench", &["*"]),
    ("xtask", &["*"]),
];

/// External crates only some members may use, with those members. Binaries and xtask may use
/// anything; a library's own `[[bin]]` may use those listed for no library (see [`cli_features`]).
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

const BINARIES: &[&str] = &["cortex-gateway", "cortex-bench", "xtask"];

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
    for m in &members {
        out.extend(check_cli_sources(m)?);
        out.extend(check_unsafe_forbidden(m)?);
    }
    Ok(out)
}

/// A workspace member as `cargo metadata` describes it.
#[derive(Debug, Clone)]
pub struct Member {
    /// Package name.
    pub name: String,
    /// Directory of its manifest.
    pub dir: PathBuf,
    /// Its dependencies.
    pub deps: Vec<Dep>,
    /// Its features: name → what each turns on (`dep:x`, `x/feature`, other features).
    pub features: BTreeMap<String, Vec<String>>,
    /// Its binary targets: (source file, required features).
    pub bins: Vec<(PathBuf, Vec<String>)>,
    /// The root source files of its library and binaries.
    pub roots: Vec<PathBuf>,
}

/// One dependency of a member, as `cargo metadata` describes it.
#[derive(Debug, Clone, Default)]
pub struct Dep {
    /// Package name.
    pub name: String,
    /// `normal`, `dev` or `build`.
    pub kind: String,
    /// Only built when a feature turns it on.
    pub optional: bool,
    /// The dependent takes its default features.
    pub default_features: bool,
    /// Features the dependent turns on.
    pub features: Vec<String>,
}

fn members(root: &Path) -> Result<Vec<Member>> {
    let meta = crate::cargo_metadata(root)?;
    let packages = meta["packages"].as_array().context("metadata packages")?;
    packages
        .iter()
        .map(|p| {
            let manifest = PathBuf::from(p["manifest_path"].as_str().context("manifest_path")?);
            let strings = |v: &Value| -> Vec<String> {
                v.as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
            };
            Ok(Member {
                name: p["name"].as_str().context("name")?.to_owned(),
                dir: manifest.parent().context("manifest dir")?.to_path_buf(),
                deps: p["dependencies"]
                    .as_array()
                    .context("dependencies")?
                    .iter()
                    .map(|d| Dep {
                        name: d["name"].as_str().unwrap_or_default().to_owned(),
                        kind: d["kind"].as_str().unwrap_or("normal").to_owned(),
                        optional: d["optional"].as_bool().unwrap_or(false),
                        default_features: d["uses_default_features"].as_bool().unwrap_or(true),
                        features: strings(&d["features"]),
                    })
                    .collect(),
                features: p["features"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), strings(v)))
                    .collect(),
                bins: p["targets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|t| strings(&t["kind"]).iter().any(|k| k == "bin"))
                    .map(|t| {
                        (
                            PathBuf::from(t["src_path"].as_str().unwrap_or_default()),
                            strings(&t["required-features"]),
                        )
                    })
                    .collect(),
                roots: p["targets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|t| strings(&t["kind"]).iter().any(|k| k == "lib" || k == "bin"))
                    .map(|t| PathBuf::from(t["src_path"].as_str().unwrap_or_default()))
                    .collect(),
            })
        })
        .collect()
}

/// Every `.rs` file under `src/` starts with a `//!` inner doc comment.
fn check_docs(dir: &Path) -> Result<Vec<Violation>> {
    let mut out = Vec::new();
    for path in sources(dir)? {
        let text = std::fs::read_to_string(&path)?;
        let first = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with("#!["));
        if !first.is_some_and(|l| l.starts_with("//!")) {
            out.push(Violation(format!("{}: module does not start with a `//!` doc", path.display())));
        }
    }
    Ok(out)
}

/// The `.rs` files under a member's `src/`.
fn sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.join("src")];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries {
            let path = e?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    Ok(out)
}

/// A member without unsafe code forbids it in each crate root.
fn check_unsafe_forbidden(m: &Member) -> Result<Vec<Violation>> {
    let mut has_unsafe = false;
    for path in sources(&m.dir)? {
        let text = std::fs::read_to_string(&path)?;
        has_unsafe |= text.lines().map(str::trim).any(|l| {
            !l.starts_with("//")
                && ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern"].iter().any(|u| l.contains(u))
        });
    }
    let mut out = Vec::new();
    if !has_unsafe {
        for root in &m.roots {
            if !std::fs::read_to_string(root)?.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]") {
                out.push(Violation(format!(
                    "{}: {} has no unsafe code; its crate root should say `#![forbid(unsafe_code)]`",
                    root.display(),
                    m.name
                )));
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

/// The features of `m` that only its own binaries require, with the binary-only crates (those
/// [`RESTRICTED`] lists for no library) they turn on: a library's command line, kept out of the
/// library by `required-features`.
fn cli_features(m: &Member) -> BTreeMap<&str, Vec<&str>> {
    let binary_only: Vec<&str> =
        RESTRICTED.iter().filter(|(_, users)| users.is_empty()).map(|(c, _)| *c).collect();
    m.features
        .iter()
        .filter(|(f, _)| m.bins.iter().any(|(_, req)| req.contains(f)))
        .map(|(f, on)| {
            let crates = on
                .iter()
                .filter_map(|x| x.strip_prefix("dep:"))
                .filter(|c| binary_only.contains(c))
                .collect();
            (f.as_str(), crates)
        })
        .filter(|(_, crates): &(&str, Vec<&str>)| !crates.is_empty())
        .collect()
}

/// The features a dependency turns on in `m`: those it names, and `m`'s defaults (with what they
/// turn on) unless it opts out.
fn enabled<'a>(m: &'a Member, dep: &'a Dep) -> Vec<&'a str> {
    let mut on: Vec<&str> = dep.features.iter().map(String::as_str).collect();
    if dep.default_features {
        on.push("default");
    }
    let mut i = 0;
    while i < on.len() {
        if let Some(more) = m.features.get(on[i]) {
            on.extend(more.iter().map(String::as_str).filter(|f| m.features.contains_key(*f)));
        }
        i += 1;
    }
    on
}

fn check_direction(members: &[Member]) -> Vec<Violation> {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let restricted: BTreeMap<&str, &[&str]> = RESTRICTED.iter().copied().collect();
    let by_name: BTreeMap<&str, &Member> = members.iter().map(|m| (m.name.as_str(), m)).collect();
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
        let cli = cli_features(m);
        for dep in &m.deps {
            let (name, kind) = (dep.name.as_str(), dep.kind.as_str());
            if let Some(target) = by_name.get(name) {
                let fine = ok.contains(&"*") || ok.contains(&name) || (kind == "dev" && name == "cortex-sim");
                if !fine {
                    out.push(Violation(format!(
                        "{} may not depend on {name} ({kind}): see ARCHITECTURE.md",
                        m.name
                    )));
                }
                let target_cli = cli_features(target);
                for f in enabled(target, dep).into_iter().filter(|f| target_cli.contains_key(f)) {
                    out.push(Violation(format!(
                        "{} turns on {name}'s `{f}` feature, its binary's command line: depend on it with \
                         `default-features = false`",
                        m.name
                    )));
                }
            } else if let Some(users) = restricted.get(name)
                && !binary
                && kind != "dev"
                && !users.contains(&m.name.as_str())
                && !(dep.optional && cli.values().any(|crates| crates.contains(&name)) && only_cli(m, name))
            {
                out.push(Violation(format!(
                    "{} may not use {name}: only {users:?} and the binaries may",
                    m.name
                )));
            }
        }
    }
    out
}

/// Every feature of `m` that turns on the optional dependency `dep` is one only its binaries
/// require.
fn only_cli(m: &Member, dep: &str) -> bool {
    let cli = cli_features(m);
    let turns_on = |on: &Vec<String>| on.iter().any(|x| x.strip_prefix("dep:") == Some(dep) || x == dep);
    m.features.iter().filter(|(_, on)| turns_on(on)).all(|(f, _)| cli.contains_key(f.as_str()))
}

/// A library with a command line of its own ([`cli_features`]) never names the command-line
/// crates outside its binaries' sources: with the feature on (every workspace build) it would
/// compile, and break only for the library's users.
fn check_cli_sources(m: &Member) -> Result<Vec<Violation>> {
    let crates: Vec<String> = cli_features(m).into_values().flatten().map(|c| c.replace('-', "_")).collect();
    if crates.is_empty() || BINARIES.contains(&m.name.as_str()) {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for path in sources(&m.dir)? {
        if m.bins.iter().any(|(b, _)| *b == path) {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        for c in &crates {
            if text.contains(&format!("{c}::")) {
                out.push(Violation(format!(
                    "{}: names `{c}`, which only the binary's command line may use",
                    path.display()
                )));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dep(name: &str, kind: &str) -> Dep {
        Dep { name: name.to_owned(), kind: kind.to_owned(), default_features: true, ..Dep::default() }
    }

    fn member(name: &str, deps: &[(&str, &str)]) -> Member {
        Member {
            name: name.to_owned(),
            dir: PathBuf::new(),
            deps: deps.iter().map(|(d, k)| dep(d, k)).collect(),
            features: BTreeMap::new(),
            bins: Vec::new(),
            roots: Vec::new(),
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

    /// `cortex-sim` with its binary behind `cli`, and `cortex-gateway` depending on it with
    /// `default_features` and `features`.
    fn sim_workspace(
        sim: impl FnOnce(&mut Member),
        default_features: bool,
        features: &[&str],
    ) -> Vec<String> {
        let mut lib = member("cortex-sim", &[("tokio", "normal"), ("clap", "normal"), ("anyhow", "normal")]);
        for d in &mut lib.deps[1..] {
            d.optional = true;
        }
        let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        lib.features.insert("default".into(), strings(&["cli"]));
        lib.features.insert("cli".into(), strings(&["dep:clap", "dep:anyhow"]));
        lib.bins.push((PathBuf::from("src/main.rs"), strings(&["cli"])));
        sim(&mut lib);
        let mut gateway = member("cortex-gateway", &[]);
        gateway.deps.push(Dep {
            default_features,
            features: strings(features),
            ..dep("cortex-sim", "normal")
        });
        check_direction(&[lib, gateway]).into_iter().map(|v| v.0).collect()
    }

    #[test]
    fn a_library_may_carry_its_own_command_line_only_behind_its_binarys_feature() {
        assert_eq!(sim_workspace(|_| {}, false, &[]), Vec::<String>::new());
        // Its users must opt out of the defaults and never ask for the feature.
        let v = sim_workspace(|_| {}, true, &[]);
        assert!(v.iter().any(|s| s.contains("cortex-gateway turns on cortex-sim's `cli` feature")), "{v:?}");
        let v = sim_workspace(|_| {}, false, &["cli"]);
        assert!(v.iter().any(|s| s.contains("cortex-gateway turns on cortex-sim's `cli` feature")), "{v:?}");
        // Not optional, or turned on by a feature the binary does not require: the library has it.
        let v = sim_workspace(|m| m.deps[1].optional = false, false, &[]);
        assert_eq!(v, ["cortex-sim may not use clap: only [] and the binaries may"]);
        let extra = |m: &mut Member| {
            m.features.insert("extra".into(), vec!["dep:anyhow".into()]);
        };
        let v = sim_workspace(extra, false, &[]);
        assert_eq!(v, ["cortex-sim may not use anyhow: only [] and the binaries may"]);
        let v = sim_workspace(|m| m.bins.clear(), false, &[]);
        assert_eq!(v.len(), 2, "{v:?}");
    }

    #[test]
    fn the_library_code_never_names_its_command_line_crates() {
        let dir = std::env::temp_dir().join(format!("cortex-tidy-cli-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/main.rs"), "//! bin\nuse anyhow::Result;\n").unwrap();
        std::fs::write(dir.join("src/lib.rs"), "//! lib\npub fn f() -> anyhow::Result<()> { Ok(()) }\n")
            .unwrap();
        let mut m = member("cortex-sim", &[("anyhow", "normal")]);
        m.dir = dir.clone();
        m.deps[0].optional = true;
        m.features.insert("cli".into(), vec!["dep:anyhow".into()]);
        m.bins.push((dir.join("src/main.rs"), vec!["cli".into()]));
        let v = check_cli_sources(&m).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].0.contains("lib.rs: names `anyhow`"), "{v:?}");
    }

    #[test]
    fn a_crate_without_unsafe_code_must_forbid_it() {
        let dir = std::env::temp_dir().join(format!("cortex-tidy-unsafe-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        let mut m = member("cortex-pd", &[]);
        m.dir = dir.clone();
        m.roots.push(dir.join("src/lib.rs"));
        let check = |lib: &str, module: &str| {
            std::fs::write(dir.join("src/lib.rs"), lib).unwrap();
            std::fs::write(dir.join("src/m.rs"), module).unwrap();
            check_unsafe_forbidden(&m).unwrap().len()
        };
        let plain = "//! m\n// unsafe { in a comment }\npub fn f() {}\n";
        let results = [
            check("//! lib\nmod m;\n", plain),
            check("//! lib\n\n#![forbid(unsafe_code)]\nmod m;\n", plain),
            check("//! lib\nmod m;\n", "//! m\n// SAFETY: x\npub fn f() { unsafe { g() } }\n"),
        ];
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(results, [1, 0, 0], "missing forbid flagged; forbid, or real unsafe code, accepted");
    }
}
