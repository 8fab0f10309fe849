//! `cargo xtask golden`: every vector in `golden/` checked against Cortex's code.
//!
//! The captures (bytes, hashes, renderings and token ids produced by the engines' and
//! HuggingFace's own code) are never rewritten. `--bless` rewrites only the derived expectation
//! files under `golden/expect/`, which pin Cortex's own outputs (its block identity) so that a
//! change to them is always deliberate. A failing vector prints which recipe, which case, what was
//! expected and what Cortex computed.

use std::fmt;
use std::path::Path;

use anyhow::{Context, Result};

mod identity;
mod sglang_hash;
mod text;
mod vllm_hash;
mod wire;

/// One vector that did not reproduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Which recipe or component (e.g. `sglang chain`).
    pub recipe: String,
    /// Which case (the vector's name, with the item inside it).
    pub case: String,
    /// What the golden file says.
    pub expected: String,
    /// What Cortex computed.
    pub got: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] {}\n    expected: {}\n    got:      {}",
            self.recipe, self.case, self.expected, self.got
        )
    }
}

/// The vectors of one golden file or group, and those that failed.
#[derive(Debug, Default)]
pub struct Suite {
    /// Name shown in the summary.
    pub name: &'static str,
    /// Number of vectors checked.
    pub checked: usize,
    /// Vectors that did not reproduce.
    pub failures: Vec<Failure>,
}

impl Suite {
    fn new(name: &'static str) -> Self {
        Suite { name, ..Suite::default() }
    }

    /// Counts one vector and records a failure if `expected != got`.
    fn check<T: fmt::Debug + PartialEq>(
        &mut self,
        recipe: &str,
        case: impl Into<String>,
        expected: T,
        got: T,
    ) {
        self.checked += 1;
        if expected != got {
            self.fail(recipe, case, format!("{expected:?}"), format!("{got:?}"));
        }
    }

    fn fail(&mut self, recipe: &str, case: impl Into<String>, expected: String, got: String) {
        self.failures.push(Failure { recipe: recipe.to_owned(), case: case.into(), expected, got });
    }
}

/// Every suite's result.
#[derive(Debug, Default)]
pub struct Report {
    /// The suites, in the order they ran.
    pub suites: Vec<Suite>,
}

impl Report {
    /// All failures of all suites.
    pub fn failures(&self) -> impl Iterator<Item = &Failure> {
        self.suites.iter().flat_map(|s| &s.failures)
    }

    /// Total vectors checked.
    #[must_use]
    pub fn checked(&self) -> usize {
        self.suites.iter().map(|s| s.checked).sum()
    }

    /// The suite called `name`.
    #[must_use]
    pub fn suite(&self, name: &str) -> Option<&Suite> {
        self.suites.iter().find(|s| s.name == name)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.suites {
            let status = if s.failures.is_empty() { "ok" } else { "FAILED" };
            writeln!(f, "golden {:<28} {:>5} vectors  {status}", s.name, s.checked)?;
        }
        for fail in self.failures() {
            writeln!(f, "{fail}")?;
        }
        let n = self.failures().count();
        write!(f, "golden: {} vectors checked, {n} failed", self.checked())
    }
}

/// Checks every vector under `dir` (the repository's `golden/`).
///
/// # Errors
/// If a golden file is missing or malformed; mismatches are reported in the [`Report`], not as
/// errors.
pub fn check(dir: &Path) -> Result<Report> {
    Ok(Report {
        suites: vec![
            sglang_hash::chains(dir)?,
            sglang_hash::namespace(dir)?,
            sglang_hash::events(dir)?,
            vllm_hash::hash_golden(dir)?,
            vllm_hash::blockpool_chain(dir)?,
            text::tokenizer(dir)?,
            text::chat_templates(dir)?,
            identity::check(dir)?,
            wire::vllm(dir)?,
            wire::sglang(dir)?,
        ],
    })
}

/// Rewrites the derived expectation files under `dir/expect/`. Captures are never touched.
///
/// # Errors
/// If a file cannot be written.
pub fn bless(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    Ok(vec![identity::bless(dir)?])
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let bytes = std::fs::read(path).with_context(|| format!("reading golden file {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing golden file {}", path.display()))
}

/// Field `key` of `v`, or an error naming the file's shape problem.
pub(crate) fn field<'a>(v: &'a serde_json::Value, key: &str) -> Result<&'a serde_json::Value> {
    v.get(key).with_context(|| format!("golden vector has no `{key}`: {}", short(v)))
}

pub(crate) fn str_field<'a>(v: &'a serde_json::Value, key: &str) -> Result<&'a str> {
    field(v, key)?.as_str().with_context(|| format!("`{key}` is not a string"))
}

pub(crate) fn opt_str<'a>(v: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(serde_json::Value::as_str)
}

pub(crate) fn u64_field(v: &serde_json::Value, key: &str) -> Result<u64> {
    field(v, key)?.as_u64().with_context(|| format!("`{key}` is not an unsigned integer"))
}

pub(crate) fn array<'a>(v: &'a serde_json::Value, key: &str) -> Result<&'a Vec<serde_json::Value>> {
    field(v, key)?.as_array().with_context(|| format!("`{key}` is not an array"))
}

pub(crate) fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.len() > 120 { format!("{}…", &s[..s.floor_char_boundary(120)]) } else { s }
}

pub(crate) fn hex32(s: &str) -> Result<[u8; 32]> {
    let v = hex::decode(s).with_context(|| format!("bad hex {s}"))?;
    v.try_into().map_err(|_| anyhow::anyhow!("expected 32 bytes of hex: {s}"))
}
