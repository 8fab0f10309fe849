//! The served models: for each, the profile and the pipeline that turns a request into the exact
//! token ids and block identities the worker will see, and the engine hashes it will publish.
//!
//! Key decision: everything here mirrors the engine, never approximates it. Chat prompts are
//! rendered with the model's template exactly as transformers does (as vLLM and SGLang do) and
//! tokenized without adding special tokens; plain prompts with them. Prompts Cortex cannot
//! reproduce (images, per-request templates) produce no tokens, so they are routed by load, never
//! by a guessed hit. Tokenization reuses the segments of earlier prompts ([`SegmentCache`]):
//! multi-turn conversations resend their history.

use std::collections::HashMap;
use std::sync::Arc;

use cortex_hash::kv::EngineHash;
use cortex_hash::profile::{Bigram, ExtraKeyHandling, HashRecipe};
use cortex_hash::sglang::{RequestKey, event_hashes};
use cortex_hash::text::{SegmentCache, SpecialTokens, TextError};
use cortex_hash::vllm::{BlockHasher, Lora, RequestExtras};
use cortex_hash::{Namespace, SeqHash, Token};

use crate::config::ModelSpec;
use crate::request::Prompt;

/// Why a request has no trustworthy tokens.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// Rendering or tokenizing failed.
    #[error(transparent)]
    Text(#[from] TextError),
    /// The prompt holds something Cortex cannot reproduce.
    #[error("prompt not reproducible by the gateway: {0}")]
    Unreproducible(&'static str),
    /// The request uses an extra key the profile does not reproduce (LoRA or cache salt with
    /// `load_only` handling).
    #[error("requests with {0} are routed by load for this model")]
    ExtraKeyNotReproduced(&'static str),
}

/// One served model (or LoRA adapter of one): how its requests become tokens and blocks.
pub struct ModelRoute {
    spec: ModelSpec,
    /// The adapter (name, path) when this route serves a LoRA adapter of the base model.
    lora: Option<(String, String)>,
    cache: Arc<SegmentCache>,
    vllm_hasher: Option<BlockHasher>,
    /// The tokenizer's largest token id.
    max_token_id: Token,
    /// The namespace of this route's blocks and its root without a cache salt, derived once:
    /// deriving them hashes a buffer built on the heap, which the request path does not pay.
    ns: Namespace,
    unsalted_root: SeqHash,
}

impl std::fmt::Debug for ModelRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRoute")
            .field("model", &self.spec.profile.model())
            .field("lora", &self.lora)
            .finish()
    }
}

impl ModelRoute {
    fn new(
        spec: ModelSpec,
        lora: Option<(String, String)>,
        cache: Arc<SegmentCache>,
        max_token_id: Token,
    ) -> Self {
        let vllm_hasher = match spec.profile.recipe() {
            HashRecipe::Vllm { algo, seed, extra_keys } => Some(BlockHasher::new(*algo, seed, *extra_keys)),
            HashRecipe::Sglang { .. } => None,
        };
        let ns = spec.profile.namespace(lora.as_ref().map(|(name, _)| name.as_str()));
        let unsalted_root = ns.root(None);
        ModelRoute { spec, lora, cache, vllm_hasher, max_token_id, ns, unsalted_root }
    }

    /// The largest token id a prompt may name (the tokenizer's vocabulary, added tokens
    /// included).
    #[must_use]
    pub fn max_token_id(&self) -> Token {
        self.max_token_id
    }

    /// The profile.
    #[must_use]
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The base model's name (what workers serve and the scheduler matches).
    #[must_use]
    pub fn base_model(&self) -> &str {
        self.spec.profile.model()
    }

    /// The LoRA adapter this route serves, if any.
    #[must_use]
    pub fn lora(&self) -> Option<&str> {
        self.lora.as_ref().map(|(name, _)| name.as_str())
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.spec.profile.block_size()
    }

    /// The token ids the engine will compute for `prompt`. Blocking (tokenization takes
    /// milliseconds): call it off the I/O threads.
    ///
    /// # Errors
    /// [`TokenizeError`] when the tokens cannot be trusted.
    pub fn tokens(&self, prompt: &Prompt) -> Result<Vec<Token>, TokenizeError> {
        match prompt {
            Prompt::Chat(ctx) => {
                let mut ctx = ctx.clone();
                if let Some(b) = &self.spec.bos_token {
                    ctx.entry("bos_token").or_insert_with(|| b.clone().into());
                }
                if let Some(e) = &self.spec.eos_token {
                    ctx.entry("eos_token").or_insert_with(|| e.clone().into());
                }
                let text = self.spec.template.render(&serde_json::Value::Object(ctx))?;
                Ok(self.spec.tokenizer.encode_cached(&text, &self.cache)?)
            }
            Prompt::Text(t) => {
                Ok(self.spec.tokenizer.encode_text_cached(t, SpecialTokens::Add, &self.cache)?)
            }
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Unreproducible(why) => Err(TokenizeError::Unreproducible(why)),
        }
    }

    /// The namespace of this route's blocks.
    ///
    /// # Errors
    /// [`TokenizeError::ExtraKeyNotReproduced`] for an adapter or a salt the profile routes by
    /// load.
    pub fn namespace(&self, salt: Option<&str>) -> Result<Namespace, TokenizeError> {
        let policy = self.spec.profile.extra_keys();
        if self.lora.is_some() && policy.lora == ExtraKeyHandling::LoadOnly {
            return Err(TokenizeError::ExtraKeyNotReproduced("a LoRA adapter"));
        }
        if salt.is_some() && policy.cache_salt == ExtraKeyHandling::LoadOnly {
            return Err(TokenizeError::ExtraKeyNotReproduced("a cache salt"));
        }
        Ok(self.ns)
    }

    /// Cortex's identity of every full block of `tokens` (the ledger's keys), into `out`.
    ///
    /// # Errors
    /// As [`ModelRoute::namespace`].
    pub fn seq_hashes(
        &self,
        tokens: &[Token],
        salt: Option<&str>,
        out: &mut Vec<SeqHash>,
    ) -> Result<(), TokenizeError> {
        let ns = self.namespace(salt)?;
        out.clear();
        match self.spec.profile.recipe() {
            // EAGLE workers store pages of overlapping token pairs: page i covers the tokens
            // i*P ..= i*P + P, so its content is that window.
            HashRecipe::Sglang { bigram: Bigram::On, .. } => out.extend(ns.bigram_seq_hashes(salt, tokens)),
            _ => {
                let root = if salt.is_none() { self.unsalted_root } else { ns.root(salt) };
                out.reserve_exact(tokens.len() / self.block_size() as usize);
                ns.extend_seq_hashes(root, tokens, out);
            }
        }
        Ok(())
    }

    /// The engine hashes a worker of this profile will publish for the full blocks of `tokens`
    /// (for alignment checks). `None` when the recipe cannot be predicted (an SGLang adapter's
    /// internal id, an unseeded xxhash).
    #[must_use]
    pub fn predict_engine_hashes(&self, tokens: &[Token], salt: Option<&str>) -> Option<Vec<EngineHash>> {
        match self.spec.profile.recipe() {
            HashRecipe::Vllm { .. } => {
                let hasher = self.vllm_hasher.as_ref()?;
                if !self.spec.profile.recipe().content_deterministic() {
                    return None;
                }
                let lora = self.lora.as_ref().map(|(name, path)| Lora { name, path });
                let extras = RequestExtras { lora, cache_salt: salt };
                let digests = hasher.block_hashes(tokens, self.block_size() as usize, extras).ok()?;
                Some(digests.iter().map(|d| EngineHash::from_u64(d.wire_u64())).collect())
            }
            HashRecipe::Sglang { format, bigram } => {
                if self.lora.is_some() {
                    return None;
                }
                let key = RequestKey { extra_key: None, cache_salt: salt, lora_registered: false };
                let hashes =
                    event_hashes(tokens, self.block_size() as usize, *bigram == Bigram::On, key, *format)
                        .ok()?;
                Some(hashes.into_iter().map(EngineHash::from_i64).collect())
            }
        }
    }

    /// The most tokens an engine can report as cached for a prompt of `prompt_tokens`: whole
    /// blocks, and never the last token (both engines recompute at least one).
    #[must_use]
    pub fn max_cached_tokens(&self, prompt_tokens: usize) -> u32 {
        let bs = self.block_size() as usize;
        let blocks = prompt_tokens.saturating_sub(1) / bs;
        u32::try_from(blocks * bs).unwrap_or(u32::MAX)
    }
}

/// Every served model and adapter, by request `model` name.
#[derive(Debug, Default)]
pub struct ModelTable {
    by_name: HashMap<String, Arc<ModelRoute>>,
    order: Vec<String>,
    /// The API key each model's workers require, by model name.
    worker_keys: HashMap<String, crate::auth::WorkerKey>,
}

impl ModelTable {
    /// An empty table.
    #[must_use]
    pub fn new() -> Self {
        ModelTable::default()
    }

    /// Serves `spec` under its profile's model name, with a segment cache of `cache_tokens`.
    pub fn add_model(&mut self, spec: ModelSpec, cache_tokens: usize) {
        let name = spec.profile.model().to_owned();
        let cache = Arc::new(SegmentCache::new(cache_tokens));
        let max_token_id = spec.tokenizer.max_token_id();
        self.order.push(name.clone());
        self.by_name.insert(name, Arc::new(ModelRoute::new(spec, None, cache, max_token_id)));
    }

    /// Serves the LoRA adapter `name` (loaded from `path` on the workers) of `base`: requests
    /// naming the adapter are routed among `base`'s workers within the adapter's namespace.
    /// Returns false, and serves nothing new, if `base` is not served or `name` already is (a
    /// model or another adapter keeps its route).
    pub fn add_adapter(&mut self, name: &str, path: &str, base: &str) -> bool {
        if self.by_name.contains_key(name) {
            return false;
        }
        let Some(b) = self.by_name.get(base) else { return false };
        let lora = (name.to_owned(), path.to_owned());
        let route = ModelRoute::new(b.spec.clone(), Some(lora), Arc::clone(&b.cache), b.max_token_id);
        self.order.push(name.to_owned());
        self.by_name.insert(name.to_owned(), Arc::new(route));
        true
    }

    /// Every worker of the served model `model` (static, added by the admin API or discovered)
    /// requires `key` (its engine's `--api-key`). Returns false, and sets nothing, if `model` is
    /// not a served model.
    pub fn set_worker_api_key(&mut self, model: &str, key: crate::auth::WorkerKey) -> bool {
        if self.by_name.get(model).is_none_or(|r| r.lora.is_some()) {
            return false;
        }
        self.worker_keys.insert(model.to_owned(), key);
        true
    }

    /// The API key the workers of `model` require, if one is set.
    #[must_use]
    pub fn worker_api_key(&self, model: &str) -> Option<&crate::auth::WorkerKey> {
        self.worker_keys.get(model)
    }

    /// The route for a request's `model`; a request without one goes to the only model, if there
    /// is exactly one.
    #[must_use]
    pub fn get(&self, model: Option<&str>) -> Option<&Arc<ModelRoute>> {
        match model {
            Some(m) => self.by_name.get(m),
            None if self.order.len() == 1 => self.by_name.get(&self.order[0]),
            None => None,
        }
    }

    /// Every served name, in the order added.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.order.iter().map(String::as_str)
    }
}
