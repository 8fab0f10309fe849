//! The model a worker serves, as far as text is concerned: the model's own `tokenizer.json` and
//! chat template (through `cortex-hash`'s `text` feature, which renders exactly like transformers),
//! and the deterministic text it "generates".
//!
//! Key decisions:
//! - Loading a tokenizer takes about a second, so models are cached per directory for the whole
//!   process and shared by every worker (an `Arc`); a worker with a different chat template
//!   shares the tokenizer and compiles only its template.
//! - Generation is a fixed English sentence cycled token by token: deterministic (two identical
//!   requests produce identical outputs, so output pages hash identically, as a greedy engine's
//!   would), cheap, and made of real vocabulary tokens that detokenize one at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cortex_hash::text::{
    ChatTemplate, SpecialTokens, TextError, TextTokenizer, TokenizerConfig, normalize_chat_message_as_vllm,
};
use parking_lot::Mutex;
use serde_json::{Map, Value};

use crate::SimError;

/// The sentence a simulated engine generates, cycled.
const OUTPUT_TEXT: &str = " The quick brown fox jumps over the lazy dog while the simulated engine keeps \
     decoding one token at a time, exactly as the scheduler says.";

/// A loaded tokenizer and chat template.
pub struct SimModel {
    dir: Option<PathBuf>,
    tokenizer: Arc<TextTokenizer>,
    template: ChatTemplate,
    template_source: String,
    config: TokenizerConfig,
    output: Vec<(u32, String)>,
}

impl std::fmt::Debug for SimModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimModel")
            .field("dir", &self.dir)
            .field("template", &self.template)
            .finish_non_exhaustive()
    }
}

static MODELS: OnceLock<Mutex<HashMap<PathBuf, Arc<SimModel>>>> = OnceLock::new();

/// The repository's copy of the Qwen3 tokenizer and template.
#[must_use]
pub fn qwen3_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/models/qwen3")
}

impl SimModel {
    /// The repository's Qwen3 model files, loaded once per process.
    ///
    /// # Errors
    /// [`SimError::ModelIo`] or [`SimError::Model`] if the files cannot be read.
    pub fn qwen3() -> Result<Arc<SimModel>, SimError> {
        SimModel::load_dir(&qwen3_dir())
    }

    /// Loads `tokenizer.json` and `tokenizer_config.json` from `dir`, once per process: later
    /// calls with the same directory return the same model.
    ///
    /// # Errors
    /// [`SimError::ModelIo`] or [`SimError::Model`] if the files cannot be read.
    pub fn load_dir(dir: &Path) -> Result<Arc<SimModel>, SimError> {
        let key = dir.canonicalize().map_err(SimError::ModelIo)?;
        let cache = MODELS.get_or_init(|| Mutex::new(HashMap::new()));
        // Held while loading, so concurrent workers load a directory once.
        let mut cache = cache.lock();
        if let Some(m) = cache.get(&key) {
            return Ok(Arc::clone(m));
        }
        let tokenizer = TextTokenizer::from_file(key.join("tokenizer.json")).map_err(SimError::Model)?;
        let cfg_bytes = std::fs::read(key.join("tokenizer_config.json")).map_err(SimError::ModelIo)?;
        let config = TokenizerConfig::from_json(&cfg_bytes).map_err(SimError::Model)?;
        let model = Arc::new(SimModel::build(Some(key.clone()), Arc::new(tokenizer), config)?);
        cache.insert(key, Arc::clone(&model));
        Ok(model)
    }

    /// The same tokenizer with another chat template (the worker then renders chat prompts
    /// differently from a gateway that uses the model's own template).
    ///
    /// # Errors
    /// [`SimError::Model`] if the template does not compile.
    pub fn with_template(&self, source: &str) -> Result<Arc<SimModel>, SimError> {
        let config = TokenizerConfig { chat_template: source.to_owned(), ..self.config.clone() };
        Ok(Arc::new(SimModel::build(self.dir.clone(), Arc::clone(&self.tokenizer), config)?))
    }

    fn build(
        dir: Option<PathBuf>,
        tokenizer: Arc<TextTokenizer>,
        config: TokenizerConfig,
    ) -> Result<Self, SimError> {
        let template = ChatTemplate::new(&config.chat_template).map_err(SimError::Model)?;
        let ids = tokenizer.encode(OUTPUT_TEXT, SpecialTokens::Omit).map_err(SimError::Model)?;
        let output = ids
            .iter()
            .map(|&id| tokenizer.decode(&[id]).map(|t| (id, t)))
            .collect::<Result<Vec<_>, TextError>>()
            .map_err(SimError::Model)?;
        if output.is_empty() {
            return Err(SimError::Config { field: "model", reason: "the tokenizer produced no tokens" });
        }
        Ok(SimModel {
            dir,
            tokenizer,
            template,
            template_source: config.chat_template.clone(),
            config,
            output,
        })
    }

    /// The tokenizer.
    #[must_use]
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The chat template source this model renders with.
    #[must_use]
    pub fn chat_template_source(&self) -> &str {
        &self.template_source
    }

    /// The directory the files came from, if any.
    #[must_use]
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Token ids of a completion prompt (`add_special_tokens` as the request says, default true).
    ///
    /// # Errors
    /// [`TextError`] from the tokenizer.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        self.tokenizer.encode(text, if add_special_tokens { SpecialTokens::Add } else { SpecialTokens::Omit })
    }

    /// Renders a chat request as transformers' `apply_chat_template` would: `messages`
    /// (OpenAI content parts joined with newlines, as vLLM does for string-content templates),
    /// `add_generation_prompt`, `tools`, the special tokens and `chat_template_kwargs`.
    ///
    /// # Errors
    /// [`TextError::Render`] if the template raises.
    pub fn render_chat(&self, body: &Value) -> Result<String, TextError> {
        let mut ctx = Map::new();
        let messages = body.get("messages").cloned().unwrap_or(Value::Array(Vec::new()));
        ctx.insert("messages".to_owned(), normalize_messages(messages));
        let agp = body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
        ctx.insert("add_generation_prompt".to_owned(), Value::Bool(agp));
        if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
            ctx.insert("tools".to_owned(), tools.clone());
        }
        if let Some(b) = &self.config.bos_token {
            ctx.insert("bos_token".to_owned(), Value::String(b.clone()));
        }
        if let Some(e) = &self.config.eos_token {
            ctx.insert("eos_token".to_owned(), Value::String(e.clone()));
        }
        if let Some(Value::Object(kw)) = body.get("chat_template_kwargs") {
            for (k, v) in kw {
                ctx.insert(k.clone(), v.clone());
            }
        }
        self.template.render(&Value::Object(ctx))
    }

    /// Token ids of a chat request (template rendered, no special tokens added).
    ///
    /// # Errors
    /// [`TextError`] from the template or the tokenizer.
    pub fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TextError> {
        let text = self.render_chat(body)?;
        let add = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(false);
        self.encode(&text, add)
    }

    /// The `i`-th generated token and its text.
    #[must_use]
    pub fn output_token(&self, i: usize) -> (u32, &str) {
        let (id, text) = &self.output[i % self.output.len()];
        (*id, text)
    }

    /// The text of `ids` (special tokens kept), empty on unknown ids.
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids).unwrap_or_default()
    }
}

/// OpenAI content parts (`[{"type": "text", "text": …}, …]`) become one string joined with
/// newlines, as vLLM does for templates that expect string content; then each message is
/// prepared as the engines prepare it ([`normalize_chat_message_as_vllm`]: `null` content, tool call
/// arguments).
fn normalize_messages(messages: Value) -> Value {
    let Value::Array(list) = messages else { return messages };
    Value::Array(
        list.into_iter()
            .map(|mut m| {
                if let Some(Value::Array(parts)) = m.get("content") {
                    let text: Vec<&str> =
                        parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
                    let joined = text.join("\n");
                    if let Some(obj) = m.as_object_mut() {
                        obj.insert("content".to_owned(), Value::String(joined));
                    }
                }
                if let Some(obj) = m.as_object_mut() {
                    // Where the engines part ways this simulator renders as vLLM does.
                    normalize_chat_message_as_vllm(obj);
                }
                m
            })
            .collect(),
    )
}
