//! The model profile: everything that must be identical between the gateway and a worker for
//! exact routing to be right, as one versioned value with a stable fingerprint.
//!
//! Tokenizer file, chat template, engine and its hash recipe, block size and the extra-key policy
//! decide which token ids a request becomes and which blocks those are. If any of them differs
//! between gateway and worker, the gateway would look up blocks the worker never stores (a silent
//! miss) or, worse, predict hits that are not there. So a profile is built whole or not at all
//! ([`ProfileBuilder::build`] refuses an unknown field), and facts discovered from a worker are
//! compared with it field by field ([`ModelProfile::check`]): a mismatch turns exact routing off
//! for that worker, and so does a fact that could not be discovered.
//!
//! Key decision: the fingerprint covers only what changes block identity. Two gateways with equal
//! fingerprints compute equal [`SeqHash`](crate::SeqHash)es for equal requests.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::sglang::EventFormat;
use crate::vllm::{ExtraKeyForm, HashAlgo, NoneHashSeed};
use crate::{Engine, Namespace};

/// Version of the profile schema, part of every fingerprint.
pub const PROFILE_VERSION: u32 = 1;

/// SHA-256 of a file's bytes (tokenizer.json, chat template source).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileDigest([u8; 32]);

impl FileDigest {
    /// Digest of `bytes`.
    #[must_use]
    pub fn of(bytes: &[u8]) -> Self {
        FileDigest(Sha256::digest(bytes).into())
    }

    /// The digest bytes.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for FileDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for FileDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FileDigest({self})")
    }
}

/// The engine and the recipe its workers hash blocks with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HashRecipe {
    /// vLLM: algorithm, `NONE_HASH` seed and extra-key form.
    Vllm {
        /// `--prefix-caching-hash-algo`.
        algo: HashAlgo,
        /// Where `NONE_HASH` comes from.
        seed: NoneHashSeed,
        /// Tagged (≥ 0.31) or bare extra keys.
        extra_keys: ExtraKeyForm,
    },
    /// SGLang: event format and whether pages are EAGLE bigrams.
    Sglang {
        /// `kv_events_config.format`.
        format: EventFormat,
        /// EAGLE / EAGLE3 / FROZEN_KV_MTP speculative decoding hashes bigram pages.
        bigram: Bigram,
    },
}

/// Whether SGLang hashes overlapping token pairs (EAGLE speculative decoding) or plain tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bigram {
    /// Plain pages.
    Off,
    /// Bigram pages.
    On,
}

impl HashRecipe {
    /// The engine this recipe belongs to.
    #[must_use]
    pub const fn engine(&self) -> Engine {
        match self {
            HashRecipe::Vllm { .. } => Engine::Vllm,
            HashRecipe::Sglang { .. } => Engine::Sglang,
        }
    }

    /// Whether equal content gives equal engine hashes on every worker of this recipe. SGLang's
    /// chain is unseeded; vLLM's is when its `NONE_HASH` seed is the fixed default (≥ 0.29) or a
    /// shared `PYTHONHASHSEED`, which a configured seed asserts. The ledger uses this to graft
    /// orphaned blocks on another holder's parent.
    #[must_use]
    pub fn content_deterministic(&self) -> bool {
        match self {
            HashRecipe::Sglang { .. } => true,
            HashRecipe::Vllm { algo, seed, .. } => {
                !matches!((algo, seed), (HashAlgo::Xxhash | HashAlgo::XxhashCbor, NoneHashSeed::Default))
            }
        }
    }
}

/// Which request extras the gateway can reproduce, and so route exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExtraKeyPolicy {
    /// LoRA adapters: each gets its own namespace (`Namespaced`), or requests for adapters are
    /// routed by load (`LoadOnly`).
    pub lora: ExtraKeyHandling,
    /// `cache_salt`: seeds the chain root (`Namespaced`), or salted requests are routed by load.
    pub cache_salt: ExtraKeyHandling,
}

/// How one kind of extra key is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKeyHandling {
    /// Hashed into the block identity as the engine does.
    Namespaced,
    /// Not reproduced: such requests never get an exact match.
    LoadOnly,
}

impl Default for ExtraKeyPolicy {
    fn default() -> Self {
        ExtraKeyPolicy { lora: ExtraKeyHandling::Namespaced, cache_salt: ExtraKeyHandling::Namespaced }
    }
}

/// A complete model profile. Build one with [`ModelProfile::builder`].
///
/// ```
/// use cortex_hash::profile::{Bigram, FileDigest, HashRecipe, ModelProfile};
/// use cortex_hash::sglang::EventFormat;
///
/// let profile = ModelProfile::builder()
///     .model("Qwen/Qwen3-8B")
///     .recipe(HashRecipe::Sglang { format: EventFormat::Default, bigram: Bigram::Off })
///     .block_size(16)
///     .tokenizer(FileDigest::of(b"tokenizer.json bytes"))
///     .chat_template(FileDigest::of(b"template source"))
///     .build()
///     .unwrap();
/// assert!(profile.fingerprint().starts_with("cortex-profile-v1:"));
///
/// // A profile with a field unknown is an error, never a guess.
/// assert!(ModelProfile::builder().model("m").block_size(16).build().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelProfile {
    model: String,
    recipe: HashRecipe,
    block_size: u32,
    tokenizer: FileDigest,
    chat_template: FileDigest,
    extra_keys: ExtraKeyPolicy,
}

/// Why a profile could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// A field was never given.
    #[error("model profile field `{0}` is unknown; exact routing needs every field")]
    Missing(&'static str),
    /// Block size 0.
    #[error("model profile block size must be positive")]
    ZeroBlockSize,
    /// Empty model name.
    #[error("model profile model name is empty")]
    EmptyModel,
}

/// Builder of a [`ModelProfile`]; every field but the extra-key policy (default: both
/// namespaced, as the engines do) must be set.
#[derive(Clone, Debug, Default)]
pub struct ProfileBuilder {
    model: Option<String>,
    recipe: Option<HashRecipe>,
    block_size: Option<u32>,
    tokenizer: Option<FileDigest>,
    chat_template: Option<FileDigest>,
    extra_keys: ExtraKeyPolicy,
}

impl ProfileBuilder {
    /// The served model name (what requests carry in `model`).
    #[must_use]
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The engine's hash recipe.
    #[must_use]
    pub fn recipe(mut self, recipe: HashRecipe) -> Self {
        self.recipe = Some(recipe);
        self
    }

    /// Tokens per KV block (SGLang: `page_size × dcp_size`; see [`sglang_block_size`]).
    #[must_use]
    pub fn block_size(mut self, block_size: u32) -> Self {
        self.block_size = Some(block_size);
        self
    }

    /// Digest of the tokenizer file.
    #[must_use]
    pub fn tokenizer(mut self, digest: FileDigest) -> Self {
        self.tokenizer = Some(digest);
        self
    }

    /// Digest of the chat template source.
    #[must_use]
    pub fn chat_template(mut self, digest: FileDigest) -> Self {
        self.chat_template = Some(digest);
        self
    }

    /// The extra-key policy.
    #[must_use]
    pub fn extra_keys(mut self, policy: ExtraKeyPolicy) -> Self {
        self.extra_keys = policy;
        self
    }

    /// The profile, or the first missing or invalid field.
    ///
    /// # Errors
    /// [`ProfileError`] naming the field.
    pub fn build(self) -> Result<ModelProfile, ProfileError> {
        let model = self.model.ok_or(ProfileError::Missing("model"))?;
        if model.is_empty() {
            return Err(ProfileError::EmptyModel);
        }
        let recipe = self.recipe.ok_or(ProfileError::Missing("recipe"))?;
        let block_size = self.block_size.ok_or(ProfileError::Missing("block_size"))?;
        if block_size == 0 {
            return Err(ProfileError::ZeroBlockSize);
        }
        Ok(ModelProfile {
            model,
            recipe,
            block_size,
            tokenizer: self.tokenizer.ok_or(ProfileError::Missing("tokenizer"))?,
            chat_template: self.chat_template.ok_or(ProfileError::Missing("chat_template"))?,
            extra_keys: self.extra_keys,
        })
    }
}

/// SGLang's KV block size: `page_size × dcp_size` (what `/server_info` advertises as
/// `kv_events.block_size`).
#[must_use]
pub const fn sglang_block_size(page_size: u32, dcp_size: u32) -> u32 {
    page_size * dcp_size
}

impl ModelProfile {
    /// A builder with nothing set.
    #[must_use]
    pub fn builder() -> ProfileBuilder {
        ProfileBuilder::default()
    }

    /// Served model name.
    #[must_use]
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The engine.
    #[must_use]
    pub const fn engine(&self) -> Engine {
        self.recipe.engine()
    }

    /// The hash recipe.
    #[must_use]
    pub const fn recipe(&self) -> &HashRecipe {
        &self.recipe
    }

    /// Tokens per block.
    #[must_use]
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Tokenizer digest.
    #[must_use]
    pub const fn tokenizer(&self) -> FileDigest {
        self.tokenizer
    }

    /// Chat template digest.
    #[must_use]
    pub const fn chat_template(&self) -> FileDigest {
        self.chat_template
    }

    /// Extra-key policy.
    #[must_use]
    pub const fn extra_keys(&self) -> ExtraKeyPolicy {
        self.extra_keys
    }

    /// The [`Namespace`] of this profile's blocks for the base model (`lora = None`) or an
    /// adapter.
    #[must_use]
    pub fn namespace(&self, lora: Option<&str>) -> Namespace {
        Namespace::new(self.engine(), self.block_size, &self.model, lora)
    }

    /// A stable identifier of everything that decides block identity:
    /// `cortex-profile-v1:<32 hex digits>`.
    #[must_use]
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        let mut put = |s: &[u8]| {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s);
        };
        put(&PROFILE_VERSION.to_le_bytes());
        put(self.model.as_bytes());
        put(self.engine().as_str().as_bytes());
        match &self.recipe {
            HashRecipe::Vllm { algo, seed, extra_keys } => {
                put(algo.as_str().as_bytes());
                put(match seed {
                    NoneHashSeed::Default => b"default",
                    NoneHashSeed::PythonHashSeed(_) => b"pythonhashseed",
                });
                put(seed.as_str().as_bytes());
                put(match extra_keys {
                    ExtraKeyForm::Tagged => b"tagged",
                    ExtraKeyForm::Untagged => b"untagged",
                });
            }
            HashRecipe::Sglang { format, bigram } => {
                put(format.as_str().as_bytes());
                put(match bigram {
                    Bigram::Off => b"plain",
                    Bigram::On => b"bigram",
                });
            }
        }
        put(&self.block_size.to_le_bytes());
        put(self.tokenizer.as_bytes());
        put(self.chat_template.as_bytes());
        for handling in [self.extra_keys.lora, self.extra_keys.cache_salt] {
            put(match handling {
                ExtraKeyHandling::Namespaced => b"ns",
                ExtraKeyHandling::LoadOnly => b"load",
            });
        }
        let digest = h.finalize();
        let mut s = String::from("cortex-profile-v1:");
        for b in &digest[..16] {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Compares the profile with what a worker reported about itself. Every fact the worker
    /// reported is compared; a fact it did not report is listed as unconfirmed.
    #[must_use]
    pub fn check(&self, facts: &WorkerFacts) -> Alignment {
        let mut mismatches = Vec::new();
        let mut unconfirmed = Vec::new();
        let mut cmp = |field: &'static str, configured: String, discovered: Option<String>| match discovered {
            None => unconfirmed.push(field),
            Some(d) if d != configured => mismatches.push(Mismatch { field, configured, discovered: d }),
            Some(_) => {}
        };
        cmp("engine", self.engine().to_string(), facts.engine.map(|e| e.to_string()));
        cmp("model", self.model.clone(), facts.model.clone());
        cmp("block_size", self.block_size.to_string(), facts.block_size.map(|b| b.to_string()));
        match &self.recipe {
            HashRecipe::Vllm { algo, .. } => {
                cmp("hash_algo", algo.as_str().to_owned(), facts.hash_algo.map(|a| a.as_str().to_owned()));
            }
            HashRecipe::Sglang { bigram, .. } => {
                cmp("bigram", format!("{bigram:?}"), facts.bigram.map(|b| format!("{b:?}")));
            }
        }
        cmp(
            "tokens",
            "gateway tokens".to_owned(),
            facts.tokens_agree.map(|ok| if ok { "gateway tokens" } else { "different tokens" }.to_owned()),
        );
        if !mismatches.is_empty() {
            Alignment::Mismatch(mismatches)
        } else if !unconfirmed.is_empty() {
            Alignment::Unconfirmed(unconfirmed)
        } else {
            Alignment::Confirmed
        }
    }
}

/// What a worker reported about itself at registration (SGLang `/server_info`, vLLM
/// `/metrics` `vllm:cache_config_info` and `/kv_event_sources`, and a `/tokenize` probe).
/// `None` means not reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerFacts {
    /// The engine.
    pub engine: Option<Engine>,
    /// Served model name.
    pub model: Option<String>,
    /// KV block size (SGLang: `page_size × dcp_size`).
    pub block_size: Option<u32>,
    /// vLLM hash algorithm.
    pub hash_algo: Option<HashAlgo>,
    /// SGLang bigram mode (from `speculative_algorithm`).
    pub bigram: Option<Bigram>,
    /// Whether the worker's tokenization of a fixed probe equals the gateway's.
    pub tokens_agree: Option<bool>,
}

/// The result of [`ModelProfile::check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// Every fact was reported and agrees.
    Confirmed,
    /// Nothing disagrees, but these facts were not reported: exact routing stays off.
    Unconfirmed(Vec<&'static str>),
    /// These facts disagree: exact routing is off.
    Mismatch(Vec<Mismatch>),
}

impl Alignment {
    /// True only for [`Alignment::Confirmed`].
    #[must_use]
    pub const fn allows_exact_routing(&self) -> bool {
        matches!(self, Alignment::Confirmed)
    }
}

/// One disagreeing fact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The profile field.
    pub field: &'static str,
    /// The gateway's value.
    pub configured: String,
    /// The worker's value.
    pub discovered: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: configured {}, worker reports {}", self.field, self.configured, self.discovered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> ModelProfile {
        ModelProfile::builder()
            .model("m")
            .recipe(HashRecipe::Vllm {
                algo: HashAlgo::Sha256,
                seed: NoneHashSeed::Default,
                extra_keys: ExtraKeyForm::Tagged,
            })
            .block_size(16)
            .tokenizer(FileDigest::of(b"t"))
            .chat_template(FileDigest::of(b"c"))
            .build()
            .unwrap()
    }

    #[test]
    fn every_field_is_required() {
        let full = ModelProfile::builder()
            .model("m")
            .recipe(HashRecipe::Sglang { format: EventFormat::Default, bigram: Bigram::Off })
            .block_size(16)
            .tokenizer(FileDigest::of(b"t"))
            .chat_template(FileDigest::of(b"c"));
        assert!(full.clone().build().is_ok());
        let mut b = full.clone();
        b.tokenizer = None;
        assert_eq!(b.build(), Err(ProfileError::Missing("tokenizer")));
        let mut b = full.clone();
        b.chat_template = None;
        assert_eq!(b.build(), Err(ProfileError::Missing("chat_template")));
        assert_eq!(full.clone().block_size(0).build(), Err(ProfileError::ZeroBlockSize));
        assert_eq!(full.model("").build(), Err(ProfileError::EmptyModel));
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        let p = profile();
        assert_eq!(p.fingerprint(), profile().fingerprint());
        let mut q = p.clone();
        q.block_size = 32;
        assert_ne!(p.fingerprint(), q.fingerprint());
        let mut q = p.clone();
        q.chat_template = FileDigest::of(b"other");
        assert_ne!(p.fingerprint(), q.fingerprint());
        let mut q = p.clone();
        q.recipe = HashRecipe::Vllm {
            algo: HashAlgo::Sha256,
            seed: NoneHashSeed::PythonHashSeed("0".into()),
            extra_keys: ExtraKeyForm::Tagged,
        };
        assert_ne!(p.fingerprint(), q.fingerprint());
    }

    #[test]
    fn check_reports_mismatch_then_unconfirmed() {
        let p = profile();
        let mut facts = WorkerFacts {
            engine: Some(Engine::Vllm),
            model: Some("m".into()),
            block_size: Some(16),
            hash_algo: Some(HashAlgo::Sha256),
            bigram: None,
            tokens_agree: Some(true),
        };
        assert_eq!(p.check(&facts), Alignment::Confirmed);
        facts.block_size = Some(32);
        let Alignment::Mismatch(m) = p.check(&facts) else { panic!("expected a mismatch") };
        assert_eq!(m[0].field, "block_size");
        facts.block_size = None;
        assert_eq!(p.check(&facts), Alignment::Unconfirmed(vec!["block_size"]));
        assert!(!p.check(&facts).allows_exact_routing());
    }

    #[test]
    fn unseeded_xxhash_is_not_content_deterministic() {
        let r = HashRecipe::Vllm {
            algo: HashAlgo::Xxhash,
            seed: NoneHashSeed::Default,
            extra_keys: ExtraKeyForm::Tagged,
        };
        assert!(!r.content_deterministic());
        assert!(
            HashRecipe::Sglang { format: EventFormat::Dynamo, bigram: Bigram::On }.content_deterministic()
        );
    }
}
