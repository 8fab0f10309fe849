//! Text vectors: the 46 token-id vectors HuggingFace's tokenizer produced for llama.cpp's test
//! texts (with the Qwen3 `tokenizer.json`), and the 15 chat templates transformers rendered.

use std::path::Path;

use super::{Suite, read_json};
use anyhow::{Context, Result, bail};
use cortex_hash::text::{ChatTemplate, SpecialTokens, TextTokenizer};

/// The separator between cases in llama.cpp's `.inp` files.
const CASE_SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// Every `.inp` case encoded without special tokens must give its `.out` line.
pub(super) fn tokenizer(dir: &Path) -> Result<Suite> {
    let mut suite = Suite::new("qwen3 tokenizer");
    let tok = TextTokenizer::from_file(dir.join("models/qwen3/tokenizer.json"))?;
    let inp =
        std::fs::read_to_string(dir.join("tokenizer/ggml-vocab-qwen2.gguf.inp")).context("reading .inp")?;
    let out =
        std::fs::read_to_string(dir.join("tokenizer/ggml-vocab-qwen2.gguf.out")).context("reading .out")?;
    // The .inp file starts with one separator-free case and ends with a trailing separator.
    let texts: Vec<&str> = inp.strip_suffix(CASE_SEPARATOR).unwrap_or(&inp).split(CASE_SEPARATOR).collect();
    let expected: Vec<&str> = out.lines().collect();
    if texts.len() != expected.len() {
        bail!("tokenizer golden has {} texts but {} id lines", texts.len(), expected.len());
    }
    for (i, (text, ids)) in texts.iter().zip(expected).enumerate() {
        let want: Vec<u32> =
            ids.split_whitespace().map(str::parse).collect::<Result<_, _>>().context("id line")?;
        let got = tok.encode(text, SpecialTokens::Omit)?;
        suite.check("qwen3 tokenizer", format!("case {i} {text:?}"), want, got);
    }
    Ok(suite)
}

/// Every case rendered as transformers rendered it. The context is the case itself: messages,
/// tools, `add_generation_prompt`, special tokens and template keyword arguments.
pub(super) fn chat_templates(dir: &Path) -> Result<Suite> {
    let mut suite = Suite::new("chat templates");
    for (model, template) in [
        ("qwen3", "Qwen-Qwen3-0.6B.jinja"),
        ("qwen25", "Qwen-Qwen2.5-7B-Instruct.jinja"),
        ("llama31", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ] {
        let base = dir.join("chat-templates");
        let source =
            std::fs::read_to_string(base.join(template)).with_context(|| format!("reading {template}"))?;
        let tpl = ChatTemplate::new(&source)?;
        let cases = read_json(&base.join(format!("cases_{model}.json")))?;
        let expected = read_json(&base.join(format!("expected_transformers_{model}.json")))?;
        let cases = cases.as_array().context("cases is not an array")?;
        let expected = expected.as_array().context("expected is not an array")?;
        if cases.len() != expected.len() {
            bail!("{model}: {} cases but {} expected renderings", cases.len(), expected.len());
        }
        for (i, (case, want)) in cases.iter().zip(expected).enumerate() {
            let want = want.as_str().context("expected rendering is not a string")?;
            let got = tpl.render(case).map_err(|e| anyhow::anyhow!("{model} case {i}: {e}"));
            match got {
                Ok(got) => suite.check("chat template", format!("{template} case {i}"), want.to_owned(), got),
                Err(e) => {
                    suite.checked += 1;
                    suite.fail(
                        "chat template",
                        format!("{template} case {i}"),
                        format!("{want:?}"),
                        e.to_string(),
                    );
                }
            }
        }
    }
    Ok(suite)
}
