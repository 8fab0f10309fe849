//! What the gateway reads from a request body, and the one change it ever makes to it.
//!
//! Key decision: the body is forwarded exactly as received. Re-serializing a parsed request with
//! defaults broke clients of SGLang's router (fields added, numbers reformatted); Cortex parses a
//! copy only to learn the model, the prompt and a few routing facts, and splices
//! `"routed_dp_rank"` into the original bytes when an SGLang rank must be pinned (vLLM gets a
//! header instead).

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use crate::error::ProxyError;

/// The routed endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// SGLang's native `POST /generate`.
    Generate,
}

impl Route {
    /// The path on the worker.
    #[must_use]
    pub const fn path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Generate => "/generate",
        }
    }

    /// Label for metrics.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Completions => "completions",
            Route::Generate => "generate",
        }
    }
}

/// The prompt, in the form the engine will tokenize.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A conversation: the template context (`messages`, `tools`, `add_generation_prompt`, and the
    /// request's `chat_template_kwargs`), without the special tokens, which the model adds.
    Chat(Map<String, Value>),
    /// Plain text, tokenized with the tokenizer's special tokens (as engines do by default).
    Text(String),
    /// Token ids given by the client.
    Tokens(Vec<u32>),
    /// Something Cortex cannot reproduce exactly (images, audio, embeddings): routed by load.
    Unreproducible(&'static str),
}

/// The facts of a request the gateway routes by.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestFacts {
    /// The endpoint.
    pub route: Route,
    /// `model`, if given.
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// The prompt.
    pub prompt: Prompt,
    /// `cache_salt`, if given.
    pub cache_salt: Option<String>,
    /// SGLang's `lora_path` (the adapter name), if given.
    pub lora: Option<String>,
    /// The client pinned a rank itself (`routed_dp_rank`); the gateway then leaves the body alone.
    pub client_rank: Option<u16>,
    /// The largest token id the body gives as a prompt (`prompt` or `input_ids`, every prompt of
    /// a batch), checked against the model's vocabulary before anything is forwarded.
    pub max_token_id: Option<u32>,
    /// The output limit, if the body gives one as a non-negative integer: `max_completion_tokens`
    /// or `max_tokens` (OpenAI routes), `sampling_params.max_new_tokens` (`/generate`). The
    /// engine validates it; Cortex only sizes the request's KV with it.
    pub max_output_tokens: Option<u32>,
}

/// Parses a request body for `route`.
///
/// # Errors
/// [`ProxyError::MalformedJson`] if the body is not a JSON object, [`ProxyError::InvalidRequest`]
/// if a field the route needs is missing or has the wrong type.
pub fn parse(route: Route, body: &[u8]) -> Result<RequestFacts, ProxyError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ProxyError::MalformedJson(e.to_string()))?;
    let Value::Object(obj) = v else {
        return Err(ProxyError::MalformedJson("the body must be a JSON object".into()));
    };
    let str_field = |k: &str| -> Result<Option<String>, ProxyError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ProxyError::InvalidRequest(format!("`{k}` must be a string"))),
        }
    };
    let model = str_field("model")?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ProxyError::InvalidRequest("`stream` must be a boolean".into())),
    };
    let prompt = match route {
        Route::ChatCompletions => chat_prompt(&obj)?,
        Route::Completions => completion_prompt(obj.get("prompt"))?,
        Route::Generate => generate_prompt(&obj)?,
    };
    let client_rank = match obj.get("routed_dp_rank").or_else(|| obj.get("data_parallel_rank")) {
        Some(Value::Number(n)) => n.as_u64().and_then(|r| u16::try_from(r).ok()),
        _ => None,
    };
    let ids = match route {
        Route::ChatCompletions => None,
        Route::Completions => obj.get("prompt"),
        Route::Generate => obj.get("input_ids"),
    };
    Ok(RequestFacts {
        route,
        model,
        stream,
        prompt,
        cache_salt: str_field("cache_salt")?,
        lora: str_field("lora_path")?,
        client_rank,
        max_token_id: ids.and_then(max_token_id),
        max_output_tokens: max_output_tokens(route, &obj),
    })
}

/// See [`RequestFacts::max_output_tokens`]: the first limit given, read leniently.
fn max_output_tokens(route: Route, obj: &Map<String, Value>) -> Option<u32> {
    let limit = |v: Option<&Value>| v.and_then(Value::as_u64).map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    match route {
        Route::ChatCompletions => {
            limit(obj.get("max_completion_tokens")).or_else(|| limit(obj.get("max_tokens")))
        }
        Route::Completions => limit(obj.get("max_tokens")),
        Route::Generate => limit(obj.get("sampling_params").and_then(|s| s.get("max_new_tokens"))),
    }
}

/// The largest number in a token-id list or a batch of them (ids that are not numbers are the
/// prompt parser's to refuse; a number beyond `u32` reads as `u32::MAX`, out of every
/// vocabulary).
fn max_token_id(v: &Value) -> Option<u32> {
    let Value::Array(items) = v else { return None };
    items
        .iter()
        .filter_map(|item| match item {
            Value::Number(n) => Some(n.as_u64().map_or(u32::MAX, |t| u32::try_from(t).unwrap_or(u32::MAX))),
            Value::Array(_) => max_token_id(item),
            _ => None,
        })
        .max()
}

fn chat_prompt(obj: &Map<String, Value>) -> Result<Prompt, ProxyError> {
    let messages = match obj.get("messages") {
        None | Some(Value::Null) => {
            return Err(ProxyError::InvalidRequest(
                "`messages` is required: a list of at least one message".into(),
            ));
        }
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ProxyError::InvalidRequest("`messages` is empty: give at least one message".into()));
        }
        Some(Value::Array(m)) => m,
        Some(_) => return Err(ProxyError::InvalidRequest("`messages` must be a list of messages".into())),
    };
    let mut normalized = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ProxyError::InvalidRequest(format!("`messages[{i}]` must be an object")));
        };
        match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => {}
            None | Some(Value::Null) => {
                return Err(ProxyError::InvalidRequest(format!(
                    "`messages[{i}].role` is required (system, user, assistant or tool)"
                )));
            }
            Some(_) => {
                return Err(ProxyError::InvalidRequest(format!(
                    "`messages[{i}].role` must be a non-empty string"
                )));
            }
        }
        let mut m = m.clone();
        // OpenAI content parts: engines join the text parts with newlines for string templates.
        if let Some(Value::Array(parts)) = m.get("content") {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t.to_owned()),
                    (Some(kind), _) if kind != "text" => {
                        return Ok(Prompt::Unreproducible("multimodal content"));
                    }
                    _ => return Err(ProxyError::InvalidRequest("a content part has no text".into())),
                }
            }
            m.insert("content".into(), Value::String(texts.join("\n")));
        }
        if let Err(e) = cortex_hash::text::normalize_chat_message(&mut m) {
            return Ok(Prompt::Unreproducible(e.0));
        }
        normalized.push(Value::Object(m));
    }
    let mut ctx = Map::new();
    ctx.insert("messages".into(), Value::Array(normalized));
    let add_generation_prompt = match obj.get("add_generation_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ProxyError::InvalidRequest("`add_generation_prompt` must be a boolean".into()));
        }
    };
    ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
    for key in ["tools", "documents", "continue_final_message"] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
            ctx.insert(key.into(), v.clone());
        }
    }
    match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(kw)) => {
            for (k, v) in kw {
                ctx.insert(k.clone(), v.clone());
            }
        }
        Some(_) => return Err(ProxyError::InvalidRequest("`chat_template_kwargs` must be an object".into())),
    }
    if obj.get("chat_template").is_some_and(|v| !v.is_null()) {
        // A per-request template: the gateway cannot know what the worker will render.
        return Ok(Prompt::Unreproducible("per-request chat_template"));
    }
    Ok(Prompt::Chat(ctx))
}

fn token_ids(list: &[Value]) -> Option<Vec<u32>> {
    list.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

fn completion_prompt(p: Option<&Value>) -> Result<Prompt, ProxyError> {
    match p {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        // A batch: route by its first prompt (the engine serves all of them on one worker).
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_string) => {
            Ok(Prompt::Text(items[0].as_str().unwrap_or_default().to_owned()))
        }
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_array) => {
            let first = items[0].as_array().map(Vec::as_slice).unwrap_or_default();
            token_ids(first)
                .map(Prompt::Tokens)
                .ok_or_else(|| ProxyError::InvalidRequest("invalid token ids".into()))
        }
        Some(Value::Array(items)) => token_ids(items)
            .map(Prompt::Tokens)
            .ok_or_else(|| ProxyError::InvalidRequest("invalid token ids".into())),
        None | Some(Value::Null) => Err(ProxyError::InvalidRequest("`prompt` is required".into())),
        Some(_) => Err(ProxyError::InvalidRequest("`prompt` must be a string or token ids".into())),
    }
}

fn generate_prompt(obj: &Map<String, Value>) -> Result<Prompt, ProxyError> {
    match (obj.get("text"), obj.get("input_ids")) {
        (Some(t), _) if !t.is_null() => match t {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(items) => match items.first() {
                Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
                _ => Err(ProxyError::InvalidRequest("`text` must be a string or a list of strings".into())),
            },
            _ => Err(ProxyError::InvalidRequest("`text` must be a string or a list of strings".into())),
        },
        (_, Some(Value::Array(ids))) => completion_prompt(Some(&Value::Array(ids.clone()))),
        (_, Some(v)) if !v.is_null() => Err(ProxyError::InvalidRequest("`input_ids` must be a list".into())),
        _ => match obj.get("input_embeds") {
            Some(v) if !v.is_null() => Ok(Prompt::Unreproducible("input_embeds")),
            _ => Err(ProxyError::InvalidRequest("`text` or `input_ids` is required".into())),
        },
    }
}

/// The body with `"routed_dp_rank": rank` inserted as its first member. Any value the client
/// wrote comes later in the object and wins with every JSON parser the engines use, but the
/// gateway does not call this when the client pinned a rank.
#[must_use]
pub fn splice_routed_dp_rank(body: &Bytes, rank: u16) -> Bytes {
    let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace()) else { return body.clone() };
    if body[open] != b'{' {
        return body.clone();
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let member = format!("\"routed_dp_rank\":{rank}{}", if empty { "" } else { "," });
    let mut out = BytesMut::with_capacity(body.len() + member.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(rest);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_facts() {
        let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"chat_template_kwargs":{"enable_thinking":false},"cache_salt":"s","unknown":1}"#;
        let f = parse(Route::ChatCompletions, body).unwrap();
        assert_eq!(f.model.as_deref(), Some("m"));
        assert!(f.stream);
        assert_eq!(f.cache_salt.as_deref(), Some("s"));
        let Prompt::Chat(ctx) = f.prompt else { panic!("chat") };
        assert_eq!(ctx["messages"][0]["content"], "a\nb");
        assert_eq!(ctx["enable_thinking"], false);
        assert_eq!(ctx["add_generation_prompt"], true);
    }

    /// The OpenAI SDK's tool-calling follow-up (`content: null` next to `tool_calls`, arguments
    /// as a JSON string) is prepared as the engines prepare it, so the template renders it; where
    /// the engines part ways the prompt is routed by load, never refused.
    #[test]
    fn tool_calling_turns_are_prepared_as_the_engines_prepare_them() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"b\":1,\"a\":2}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"},{"role":"assistant","tool_calls":[]}]}"#;
        let f = parse(Route::ChatCompletions, body).unwrap();
        let Prompt::Chat(ctx) = f.prompt else { panic!("chat: {:?}", f.prompt) };
        assert_eq!(ctx["messages"][1]["content"], "");
        assert_eq!(
            ctx["messages"][1]["tool_calls"][0]["function"]["arguments"],
            serde_json::json!({"b": 1, "a": 2})
        );
        assert_eq!(ctx["messages"][3]["content"], "", "a missing content is empty too");
        let odd = br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":"{oops"}}]}]}"#;
        let f = parse(Route::ChatCompletions, odd).unwrap();
        assert!(matches!(f.prompt, Prompt::Unreproducible(_)), "{:?}", f.prompt);
    }

    #[test]
    fn prompts_of_every_route() {
        let f = parse(Route::Completions, br#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!(f.prompt, Prompt::Text("hi".into()));
        let f = parse(Route::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(f.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let f = parse(Route::Generate, br#"{"input_ids":[5,6],"routed_dp_rank":1}"#).unwrap();
        assert_eq!((f.prompt, f.client_rank), (Prompt::Tokens(vec![5, 6]), Some(1)));
        let f = parse(Route::Generate, br#"{"text":["x","y"],"lora_path":"sql"}"#).unwrap();
        assert_eq!((f.prompt, f.lora.as_deref()), (Prompt::Text("x".into()), Some("sql")));
        let f = parse(
            Route::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        )
        .unwrap();
        assert!(matches!(f.prompt, Prompt::Unreproducible(_)));
    }

    #[test]
    fn the_largest_token_id_of_every_prompt_is_found() {
        let max = |route, body: &str| parse(route, body.as_bytes()).unwrap().max_token_id;
        assert_eq!(max(Route::Completions, r#"{"prompt":[1,9,3]}"#), Some(9));
        assert_eq!(max(Route::Completions, r#"{"prompt":[[1,2],[3,70000]]}"#), Some(70000));
        assert_eq!(max(Route::Completions, r#"{"prompt":[[1],[99999999999]]}"#), Some(u32::MAX));
        assert_eq!(max(Route::Generate, r#"{"input_ids":[[4],[5,6]]}"#), Some(6));
        assert_eq!(max(Route::Completions, r#"{"prompt":"text"}"#), None);
        assert_eq!(max(Route::ChatCompletions, r#"{"messages":[{"role":"user","content":"x"}]}"#), None);
    }

    #[test]
    fn the_output_limit_is_read_where_each_route_puts_it() {
        let limit = |route, body: &str| parse(route, body.as_bytes()).unwrap().max_output_tokens;
        let chat = r#""messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(limit(Route::ChatCompletions, &format!("{{{chat},\"max_tokens\":64}}")), Some(64));
        let both = format!("{{{chat},\"max_tokens\":64,\"max_completion_tokens\":32}}");
        assert_eq!(limit(Route::ChatCompletions, &both), Some(32), "the newer name wins");
        assert_eq!(limit(Route::ChatCompletions, &format!("{{{chat}}}")), None);
        assert_eq!(limit(Route::Completions, r#"{"prompt":"x","max_tokens":7}"#), Some(7));
        assert_eq!(limit(Route::Generate, r#"{"text":"x","sampling_params":{"max_new_tokens":9}}"#), Some(9));
        // Not a non-negative integer: unknown (the engine refuses it, not Cortex).
        assert_eq!(limit(Route::Completions, r#"{"prompt":"x","max_tokens":-1}"#), None);
        assert_eq!(limit(Route::Completions, r#"{"prompt":"x","max_tokens":"7"}"#), None);
        assert_eq!(limit(Route::Completions, r#"{"prompt":"x","max_tokens":99999999999}"#), Some(u32::MAX));
    }

    #[test]
    fn bad_bodies_are_client_errors() {
        assert!(matches!(parse(Route::Completions, b"{not json"), Err(ProxyError::MalformedJson(_))));
        assert!(matches!(parse(Route::Completions, b"[1]"), Err(ProxyError::MalformedJson(_))));
        assert!(matches!(parse(Route::Completions, br#"{"model":"m"}"#), Err(ProxyError::InvalidRequest(_))));
        // Each chat fault names the field.
        for (body, field) in [
            (r#"{"messages":3}"#, "`messages`"),
            (r#"{"model":"m"}"#, "`messages` is required"),
            (r#"{"messages":[]}"#, "`messages` is empty"),
            (
                r#"{"messages":[{"role":"user","content":"a"},{"content":"b"}]}"#,
                "`messages[1].role` is required",
            ),
            (r#"{"messages":[{"role":7,"content":"b"}]}"#, "`messages[0].role`"),
            (r#"{"messages":["hi"]}"#, "`messages[0]`"),
        ] {
            match parse(Route::ChatCompletions, body.as_bytes()) {
                Err(ProxyError::InvalidRequest(m)) => assert!(m.contains(field), "{body}: {m}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(
            parse(Route::Completions, br#"{"prompt":"x","stream":"yes"}"#),
            Err(ProxyError::InvalidRequest(_))
        ));
    }

    #[test]
    fn splice_keeps_the_rest_byte_for_byte() {
        let body = Bytes::from_static(b"  {\"text\": \"a\",\n \"x\": 1.50}");
        let out = splice_routed_dp_rank(&body, 3);
        assert_eq!(&out[..], b"  {\"routed_dp_rank\":3,\"text\": \"a\",\n \"x\": 1.50}");
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["routed_dp_rank"], 3);
        assert_eq!(&splice_routed_dp_rank(&Bytes::from_static(b"{ }"), 0)[..], b"{\"routed_dp_rank\":0 }");
    }
}
