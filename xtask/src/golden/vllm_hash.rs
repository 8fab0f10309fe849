//! vLLM hash vectors: the 24 cases of `golden/vllm/hash_golden.json` (every preimage, digest and
//! wire value) and the chain a real `BlockPool` published in `golden/vllm/blockpool_golden.json`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use cortex_hash::vllm::{BlockHasher, ExtraKeyForm, HashAlgo, Lora, NoneHashSeed, RequestExtras, VllmDigest};
use serde_json::Value;

use super::{Suite, array, field, opt_str, read_json, str_field, u64_field};

fn u32_tokens(v: &Value) -> Result<Vec<u32>> {
    v.as_array()
        .context("token_ids is not an array")?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).context("token id"))
        .collect()
}

/// Every case: `NONE_HASH` preimage and digest, and per block the preimage, digest and wire u64.
pub(super) fn hash_golden(dir: &Path) -> Result<Suite> {
    let doc = read_json(&dir.join("vllm/hash_golden.json"))?;
    let mut suite = Suite::new("vllm hash_golden");
    for c in doc.as_array().context("hash_golden.json is not an array")? {
        let algo_name = str_field(c, "algo")?;
        let algo = HashAlgo::parse(algo_name).with_context(|| format!("unknown algo {algo_name}"))?;
        let seed = match opt_str(c, "PYTHONHASHSEED") {
            None => NoneHashSeed::Default,
            Some(s) => NoneHashSeed::PythonHashSeed(s.to_owned()),
        };
        let name = format!(
            "{algo_name} PYTHONHASHSEED={:?} {}",
            opt_str(c, "PYTHONHASHSEED"),
            str_field(c, "case")?
        );
        suite.check("vllm NONE_HASH seed", name.clone(), str_field(c, "none_hash_seed")?, seed.as_str());
        let hasher = BlockHasher::new(algo, &seed, ExtraKeyForm::Tagged);
        suite.check(
            "vllm NONE_HASH preimage",
            name.clone(),
            str_field(c, "none_hash_preimage_hex")?.to_owned(),
            hex::encode(cortex_hash::vllm::none_hash_preimage(algo, seed.as_str())),
        );
        suite.check(
            "vllm NONE_HASH",
            name.clone(),
            str_field(c, "none_hash_hex")?.to_owned(),
            hex::encode(hasher.none_hash().as_bytes()),
        );
        let tokens = u32_tokens(field(c, "token_ids")?)?;
        let block_size = u64_field(c, "block_size")? as usize;
        let lora = c.get("lora").filter(|l| !l.is_null());
        let extras = RequestExtras {
            lora: lora
                .map(|l| -> Result<Lora<'_>> {
                    Ok(Lora { name: str_field(l, "lora_name")?, path: str_field(l, "lora_path")? })
                })
                .transpose()?,
            cache_salt: opt_str(c, "cache_salt"),
        };
        let digests = hasher.block_hashes(&tokens, block_size, extras)?;
        let want_pre: Vec<&str> = array(c, "preimage_hex")?.iter().filter_map(Value::as_str).collect();
        let got_pre = preimages(&hasher, &tokens, block_size, extras, &digests)?;
        for (i, (w, g)) in want_pre.iter().zip(&got_pre).enumerate() {
            suite.check("vllm preimage", format!("{name} block {i}"), (*w).to_owned(), g.clone());
        }
        suite.check("vllm preimage count", name.clone(), want_pre.len(), got_pre.len());
        let want_hex: Vec<&str> = array(c, "block_hash_hex")?.iter().filter_map(Value::as_str).collect();
        let got_hex: Vec<String> = digests.iter().map(|d| hex::encode(d.as_bytes())).collect();
        suite.check(
            "vllm block digests",
            name.clone(),
            want_hex.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
            got_hex,
        );
        let want_wire: Vec<u64> = array(c, "wire_u64")?.iter().filter_map(Value::as_u64).collect();
        suite.check(
            "vllm wire u64",
            name,
            want_wire,
            digests.iter().map(VllmDigest::wire_u64).collect::<Vec<_>>(),
        );
    }
    Ok(suite)
}

/// The preimage of every block, rebuilt from the digests of the blocks before it.
fn preimages(
    hasher: &BlockHasher,
    tokens: &[u32],
    block_size: usize,
    extras: RequestExtras<'_>,
    digests: &[VllmDigest],
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut parent = *hasher.none_hash();
    for (i, page) in tokens.chunks_exact(block_size).enumerate() {
        let pre = hasher.preimage(&parent, page, &hasher.extra_keys(i, extras))?;
        out.push(hex::encode(pre));
        parent = digests[i];
    }
    Ok(out)
}

/// The chain a real `BlockPool` published: every `BlockStored` hash is recomputed from the event's
/// own tokens, continuing from its parent's digest. Request B's LoRA path is not published; the
/// README names it (`/adapters/my-lora`), and its salt is the block-0 extra key.
pub(super) fn blockpool_chain(dir: &Path) -> Result<Suite> {
    let doc = read_json(&dir.join("vllm/blockpool_golden.json"))?;
    let mut suite = Suite::new("vllm blockpool chain");
    let hasher = BlockHasher::new(HashAlgo::Sha256, &NoneHashSeed::Default, ExtraKeyForm::Tagged);
    let mut digests: HashMap<u64, VllmDigest> = HashMap::new();
    for step in doc.as_array().context("blockpool_golden.json is not an array")? {
        let step_no = u64_field(step, "step")?;
        let batch = field(step, "untyped_json")?.as_array().context("untyped_json")?;
        let events = batch.get(1).and_then(Value::as_array).context("batch events")?;
        for (ei, ev) in events.iter().enumerate() {
            if str_field(ev, "type")? != "BlockStored" {
                continue;
            }
            let case = format!("step {step_no} event {ei}");
            let tokens = u32_tokens(field(ev, "token_ids")?)?;
            let block_size = u64_field(ev, "block_size")? as usize;
            let lora_name = opt_str(ev, "lora_name");
            // Event extra keys are untagged: [lora_name, ..., salt] for block 0.
            let salt = ev
                .get("extra_keys")
                .and_then(Value::as_array)
                .and_then(|keys| keys.first())
                .and_then(Value::as_array)
                .and_then(|k0| k0.iter().filter_map(Value::as_str).find(|s| Some(*s) != lora_name));
            let lora = match lora_name {
                Some("my-lora") => Some(Lora { name: "my-lora", path: "/adapters/my-lora" }),
                Some(other) => bail!("blockpool golden has an unexpected LoRA {other}"),
                None => None,
            };
            let parent = match field(ev, "parent_block_hash")?.as_u64() {
                None => *hasher.none_hash(),
                Some(p) => {
                    *digests.get(&p).with_context(|| format!("{case}: parent {p} was never stored"))?
                }
            };
            let first_block = parent == *hasher.none_hash();
            let mut chain = parent;
            let mut got = Vec::new();
            for (i, page) in tokens.chunks_exact(block_size).enumerate() {
                let block_index = if first_block { i } else { i + 1 };
                let extras = RequestExtras { lora, cache_salt: salt };
                let pre = hasher.preimage(&chain, page, &hasher.extra_keys(block_index, extras))?;
                chain = cortex_hash::vllm::digest(HashAlgo::Sha256, &pre);
                digests.insert(chain.wire_u64(), chain);
                got.push(chain.wire_u64());
            }
            let want: Vec<u64> = array(ev, "block_hashes")?.iter().filter_map(Value::as_u64).collect();
            suite.check("vllm blockpool block_hashes", case, want, got);
        }
    }
    Ok(suite)
}
