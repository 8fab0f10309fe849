//! SGLang hash vectors (`golden/sglang/hash_vectors.json`): the 28 page-hash chains, the
//! namespace seeds and namespaced hashes, and the 14 event cases recorded from real tree caches.

use std::path::Path;

use anyhow::{Context, Result, bail};
use cortex_hash::sglang::{
    EventFormat, RequestKey, chain_digests, event_hashes, namespace_seed, namespaced_block_hash,
    published_hash,
};
use serde_json::Value;

use super::{Suite, array, field, hex32, opt_str, read_json, str_field, u64_field};

fn load(dir: &Path) -> Result<Value> {
    read_json(&dir.join("sglang/hash_vectors.json"))
}

/// A token list as SGLang's array typecode held it.
enum Tokens {
    Signed(Vec<i64>),
    Unsigned(Vec<u64>),
}

fn tokens(v: &Value, typecode: &str) -> Result<Tokens> {
    let list = v.as_array().context("tokens is not an array")?;
    Ok(match typecode {
        "Q" | "I" => {
            Tokens::Unsigned(list.iter().map(|t| t.as_u64().context("token")).collect::<Result<_>>()?)
        }
        _ => Tokens::Signed(list.iter().map(|t| t.as_i64().context("token")).collect::<Result<_>>()?),
    })
}

/// Every chain: digests, published hashes and parents, or the rejection SGLang raises.
pub(super) fn chains(dir: &Path) -> Result<Suite> {
    let doc = load(dir)?;
    let mut suite = Suite::new("sglang chains");
    for c in array(&doc, "chains")? {
        let name = str_field(c, "name")?;
        let page = u64_field(c, "page_size")? as usize;
        let bigram = field(c, "is_bigram")?.as_bool().context("is_bigram")?;
        let prior = opt_str(c, "prior_hash_hex").map(hex32).transpose()?;
        let toks = tokens(field(c, "tokens")?, str_field(c, "token_array_typecode")?)?;
        let got = match &toks {
            Tokens::Signed(t) => chain_digests(t, page, prior.as_ref(), bigram),
            Tokens::Unsigned(t) => chain_digests(t, page, prior.as_ref(), bigram),
        };
        if let Some(err) = opt_str(c, "error") {
            suite.checked += 1;
            if let Ok(d) = got {
                suite.fail("sglang chain", name, format!("rejected ({err})"), format!("{} digests", d.len()));
            }
            continue;
        }
        let digests = match got {
            Ok(d) => d,
            Err(e) => {
                suite.checked += 1;
                suite.fail("sglang chain", name, "digests".into(), format!("error: {e}"));
                continue;
            }
        };
        let want_hex: Vec<String> =
            array(c, "digests_hex")?.iter().filter_map(|h| h.as_str().map(str::to_owned)).collect();
        let got_hex: Vec<String> = digests.iter().map(hex::encode).collect();
        suite.check("sglang chain digests", name, want_hex, got_hex);
        let want: Vec<i64> = array(c, "block_hashes")?.iter().filter_map(Value::as_i64).collect();
        let published: Vec<i64> = digests.iter().map(published_hash).collect();
        suite.check("sglang chain block_hashes", name, want, published.clone());
        let want_parents: Vec<Option<i64>> =
            array(c, "parent_block_hashes")?.iter().map(Value::as_i64).collect();
        // The parent of page 0 is the prior's published hash; an empty chain lists one parent.
        let first = prior.as_ref().map(published_hash);
        let mut got_parents = vec![first];
        got_parents.extend(published.iter().map(|&h| Some(h)));
        got_parents.truncate(published.len().max(1));
        suite.check("sglang chain parent_block_hashes", name, want_parents, got_parents);
    }
    Ok(suite)
}

/// Namespace seeds and namespaced block hashes.
pub(super) fn namespace(dir: &Path) -> Result<Suite> {
    let doc = load(dir)?;
    let ns = field(&doc, "namespace")?;
    let mut suite = Suite::new("sglang namespace");
    for s in array(ns, "seeds")? {
        let extra = opt_str(s, "extra_key");
        let salt = opt_str(s, "cache_salt");
        let case = format!("seed(extra_key={extra:?}, cache_salt={salt:?})");
        let want = opt_str(s, "kv_event_namespace_seed_hex").map(str::to_owned);
        let got = namespace_seed(extra, salt).map(hex::encode);
        suite.check("sglang kv_event_namespace_seed", case, want, got);
    }
    for e in array(ns, "namespaced_block_hash_examples")? {
        let h = field(e, "block_hash")?.as_i64().context("block_hash")?;
        let extra = opt_str(e, "extra_key");
        let salt = opt_str(e, "cache_salt");
        let case = format!("namespaced_block_hash({h}, extra_key={extra:?}, cache_salt={salt:?})");
        let want = field(e, "namespaced_block_hash")?.as_i64().context("namespaced_block_hash")?;
        let Some(seed) = namespace_seed(extra, salt) else {
            suite.check("sglang namespaced_block_hash", case, want, h);
            continue;
        };
        suite.check("sglang namespaced_block_hash", case, want, namespaced_block_hash(h, &seed));
    }
    Ok(suite)
}

/// The events real tree caches recorded: every published block and parent hash must be what the
/// recipe predicts for the step's tokens, salt, extra key, format and LoRA registration.
pub(super) fn events(dir: &Path) -> Result<Suite> {
    let doc = load(dir)?;
    let mut suite = Suite::new("sglang events");
    for case in array(&doc, "events")? {
        let name = str_field(case, "name")?;
        let page = u64_field(case, "page_size")? as usize;
        let format = match str_field(case, "format")? {
            "default" => EventFormat::Default,
            "dynamo" => EventFormat::Dynamo,
            other => bail!("unknown SGLang event format {other}"),
        };
        let key = RequestKey {
            extra_key: opt_str(case, "extra_key"),
            cache_salt: opt_str(case, "cache_salt"),
            lora_registered: case.get("lora_registered").is_some_and(|v| !v.is_null()),
        };
        let bigram = field(case, "is_eagle_bigram")?.as_bool().context("is_eagle_bigram")?;
        for (si, step) in array(case, "steps")?.iter().enumerate() {
            let toks: Vec<i64> =
                array(step, "tokens")?.iter().map(|t| t.as_i64().context("token")).collect::<Result<_>>()?;
            let predicted = match event_hashes(&toks, page, bigram, key, format) {
                Ok(p) => p,
                Err(e) => {
                    suite.checked += 1;
                    suite.fail(
                        "sglang event hashes",
                        format!("{name} step {si}"),
                        "hashes".into(),
                        format!("error: {e}"),
                    );
                    continue;
                }
            };
            for (ei, ev) in array(step, "events")?.iter().enumerate() {
                if str_field(ev, "type")? != "BlockStored" {
                    continue;
                }
                let case_name = format!("{name} step {si} event {ei}");
                let hashes: Vec<i64> = array(ev, "block_hashes")?.iter().filter_map(Value::as_i64).collect();
                let parent = field(ev, "parent_block_hash")?.as_i64();
                // Where this event's blocks sit in the step's chain.
                let at = hashes.first().and_then(|h| predicted.iter().position(|p| p == h));
                let Some(at) = at else {
                    suite.checked += 1;
                    suite.fail(
                        "sglang event block_hashes",
                        case_name,
                        format!("{hashes:?}"),
                        format!("{predicted:?}"),
                    );
                    continue;
                };
                let got = predicted[at..(at + hashes.len()).min(predicted.len())].to_vec();
                suite.check("sglang event block_hashes", case_name.clone(), hashes, got);
                let got_parent = at.checked_sub(1).map(|i| predicted[i]);
                suite.check("sglang event parent_block_hash", case_name, parent, got_parent);
            }
        }
    }
    Ok(suite)
}
