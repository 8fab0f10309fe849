//! Derived expectations of Cortex's own block identity (`golden/expect/cortex_identity.json`).
//!
//! Unlike the captures, this file is produced by Cortex (`cargo xtask golden --bless`). It pins
//! the `SeqHash` of fixed inputs, so that a change to the identity function — which would silently
//! split every embedding router's view from the gateway's — fails CI until it is blessed on
//! purpose.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use cortex_hash::{Engine, Namespace};
use serde_json::{Value, json};

use super::{Suite, array, read_json, str_field, u64_field};

const FILE: &str = "expect/cortex_identity.json";

struct Input {
    name: &'static str,
    engine: Engine,
    block_size: u32,
    model: &'static str,
    lora: Option<&'static str>,
    salt: Option<&'static str>,
    tokens: Vec<u32>,
}

fn inputs() -> Vec<Input> {
    let seq = |n: u32| (1..=n).collect::<Vec<u32>>();
    let qwen = "Qwen/Qwen3-0.6B";
    vec![
        Input {
            name: "vllm_bs16_1_to_48",
            engine: Engine::Vllm,
            block_size: 16,
            model: qwen,
            lora: None,
            salt: None,
            tokens: seq(48),
        },
        Input {
            name: "sglang_bs16_1_to_48",
            engine: Engine::Sglang,
            block_size: 16,
            model: qwen,
            lora: None,
            salt: None,
            tokens: seq(48),
        },
        Input {
            name: "sglang_bs4_1_to_10",
            engine: Engine::Sglang,
            block_size: 4,
            model: qwen,
            lora: None,
            salt: None,
            tokens: seq(10),
        },
        Input {
            name: "vllm_bs16_salted",
            engine: Engine::Vllm,
            block_size: 16,
            model: qwen,
            lora: None,
            salt: Some("tenant-a"),
            tokens: seq(32),
        },
        Input {
            name: "vllm_bs16_lora",
            engine: Engine::Vllm,
            block_size: 16,
            model: qwen,
            lora: Some("my-lora"),
            salt: None,
            tokens: seq(32),
        },
        Input {
            name: "sglang_bs64_large_ids",
            engine: Engine::Sglang,
            block_size: 64,
            model: qwen,
            lora: None,
            salt: None,
            tokens: (0..128).map(|i| 151_000 + i).collect(),
        },
    ]
}

fn engine_name(e: Engine) -> &'static str {
    e.as_str()
}

fn compute(i: &Input) -> Vec<String> {
    Namespace::new(i.engine, i.block_size, i.model, i.lora)
        .seq_hashes(i.salt, &i.tokens)
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// Compares every pinned identity with what Cortex computes now.
pub(super) fn check(dir: &Path) -> Result<Suite> {
    let mut suite = Suite::new("cortex identity (derived)");
    let doc = read_json(&dir.join(FILE))?;
    let cases = array(&doc, "cases")?;
    let current = inputs();
    suite.check("cortex identity", "number of cases", current.len(), cases.len());
    for (input, case) in current.iter().zip(cases) {
        suite.check("cortex identity", "case name", input.name, str_field(case, "name")?);
        suite.check(
            "cortex identity",
            format!("{} block_size", input.name),
            u64::from(input.block_size),
            u64_field(case, "block_size")?,
        );
        let want: Vec<String> = array(case, "seq_hashes")?
            .iter()
            .map(|v| v.as_str().map(str::to_owned).context("seq hash"))
            .collect::<Result<_>>()?;
        suite.check("cortex identity", input.name, want, compute(input));
    }
    Ok(suite)
}

/// Rewrites the expectation file from the current identity function.
pub(super) fn bless(dir: &Path) -> Result<PathBuf> {
    let cases: Vec<Value> = inputs()
        .iter()
        .map(|i| {
            json!({
                "name": i.name,
                "engine": engine_name(i.engine),
                "block_size": i.block_size,
                "model": i.model,
                "lora": i.lora,
                "cache_salt": i.salt,
                "tokens": i.tokens,
                "seq_hashes": compute(i),
            })
        })
        .collect();
    let doc = json!({
        "_about": "Derived, not captured: Cortex's own SeqHash for fixed inputs. Rewrite with `cargo xtask golden --bless` only when the identity function changes on purpose.",
        "cases": cases,
    });
    let path = dir.join(FILE);
    std::fs::create_dir_all(path.parent().context("expect dir")?)?;
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
