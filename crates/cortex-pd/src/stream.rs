//! What a decode (or fallback) leg's answer says before the client sees any of it: an output, a
//! preamble to hold, or an error that makes the failure one "before the first byte".
//!
//! Key decision: the client's first byte waits for the leg's first *output*. Both engines send a
//! `200` head before they know whether the KV arrived, so the head alone proves nothing: a vLLM
//! decode worker whose NIXL pull fails (its default `kv_load_failure_policy = "fail"`) finishes
//! the request with `finish_reason = "error"`, which its OpenAI server turns into an SSE event
//! `{"error": {…, "code": 500}}` after the role preamble of a chat stream (and into a `500` when
//! not streaming); an SGLang decode worker whose bootstrap fails aborts the request (an error
//! event, or `finish_reason.type = "abort"`). Holding the head until the first output costs no
//! time to first token: the first token is the first thing the client could use, and it leaves
//! with the head; only the head itself leaves later (after the transfer instead of before it).
//! The held events are the role preamble of a chat stream (one small event per choice).

use std::ops::Range;

use crate::json;

/// What an event (or a complete non-streaming body) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Nothing for the client yet (a chat stream's role preamble): hold it and read on.
    Preamble,
    /// An output (a token, a finish, usage, `[DONE]`, or anything not recognised as an error):
    /// commit.
    Output,
    /// The engine reports a failure where the output should be.
    Error,
}

/// The first complete SSE event in `buf`: its end (after the blank line) and the span of its
/// `data` (the lines joined as the spec says only matters for multi-line data, which the engines
/// never send: the span of the first `data:` line's value). `None` until a whole event is there.
#[must_use]
pub fn next_event(buf: &[u8]) -> Option<(usize, Option<Range<usize>>)> {
    let mut line_start = 0;
    let mut data = None;
    while let Some(nl) = buf[line_start..].iter().position(|&c| c == b'\n') {
        let end = line_start + nl;
        let line = &buf[line_start..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return Some((end + 1, data));
        }
        if data.is_none()
            && let Some(rest) = line.strip_prefix(b"data:")
        {
            let off = line_start + 5 + usize::from(rest.first() == Some(&b' '));
            data = Some(off..line_start + line.len());
        }
        line_start = end + 1;
    }
    None
}

fn has_error(b: &[u8], span: Range<usize>) -> Result<bool, json::JsonError> {
    let mut ms = Vec::new();
    json::members(b, span, &mut ms)?;
    let err = ms.iter().rev().find(|m| m.is(b, "error")).is_some_and(|m| json::truthy(&b[m.value.clone()]));
    let object_error =
        ms.iter().rev().find(|m| m.is(b, "object")).is_some_and(|m| &b[m.value.clone()] == b"\"error\"");
    Ok(err || object_error)
}

fn str_is(raw: Option<&[u8]>, s: &str) -> bool {
    raw.is_some_and(|v| {
        v.len() >= 2 && v[0] == b'"' && json::unescape(&v[1..v.len() - 1]).is_some_and(|u| u == s)
    })
}

/// Looks at one object of an answer (an event, a body, or a batch item).
fn object_verdict(b: &[u8], span: Range<usize>) -> Result<Verdict, json::JsonError> {
    if has_error(b, span.clone())? {
        return Ok(Verdict::Error);
    }
    // SGLang /generate: an aborted request.
    if let Some(t) = json::find_path(b, span.clone(), &["meta_info", "finish_reason", "type"])?
        && str_is(Some(&b[t]), "abort")
    {
        return Ok(Verdict::Error);
    }
    let Some(choices) = json::find_path(b, span, &["choices"])? else { return Ok(Verdict::Output) };
    let Some(items) = json::array_items(b, choices.clone()) else { return Ok(Verdict::Output) };
    if items.is_empty() {
        return Ok(Verdict::Output); // a usage chunk
    }
    let mut any_output = false;
    let mut choices_of = Vec::new();
    json::elements(b, choices, &mut choices_of)?;
    for c in choices_of {
        if b[c.start] != b'{' {
            any_output = true;
            continue;
        }
        let fr = json::find_path(b, c.clone(), &["finish_reason"])?.map(|r| &b[r]);
        if str_is(fr, "error") {
            return Ok(Verdict::Error);
        }
        let delta = json::find_path(b, c, &["delta"])?;
        // A role preamble: no finish, and a delta with nothing but a role and empty fields.
        let preamble = fr.is_none_or(|v| v == b"null")
            && delta.is_some_and(|d| {
                let mut ms = Vec::new();
                json::members(b, d, &mut ms).is_ok()
                    && ms.iter().all(|m| m.is(b, "role") || !json::truthy(&b[m.value.clone()]))
            });
        any_output |= !preamble;
    }
    Ok(if any_output { Verdict::Output } else { Verdict::Preamble })
}

/// The verdict on one SSE event's `data` (as [`next_event`] finds it).
#[must_use]
pub fn event_verdict(data: &[u8]) -> Verdict {
    let d = data.trim_ascii();
    if d == b"[DONE]" {
        return Verdict::Output;
    }
    body_verdict(d)
}

/// The verdict on a complete answer (a non-streaming body, or one event's JSON). A batch (an
/// array of objects) is an error if any item is. Bytes that are not JSON are passed on as they
/// are (an output): judging them is the client's business.
#[must_use]
pub fn body_verdict(body: &[u8]) -> Verdict {
    let Ok(span) = json::validate(body) else { return Verdict::Output };
    let verdict = match body.get(span.start) {
        Some(b'{') => object_verdict(body, span),
        Some(b'[') => {
            let mut items = Vec::new();
            json::elements(body, span, &mut items).map(|()| {
                let error = items
                    .iter()
                    .any(|r| body[r.start] == b'{' && object_verdict(body, r.clone()) == Ok(Verdict::Error));
                if error { Verdict::Error } else { Verdict::Output }
            })
        }
        _ => Ok(Verdict::Output),
    };
    verdict.unwrap_or(Verdict::Output)
}

/// The most a [`Hold`] keeps before giving up on finding an output (then it lets the stream
/// through as it is: a preamble that large is not one the engines send).
pub const MAX_HELD: usize = 64 * 1024;

/// The decode (or fallback) leg's stream held back until its first output: push the body's
/// chunks as they come; the bytes stay in the hold until the verdict is [`Verdict::Output`]
/// (commit, then forward [`Hold::take`] and the rest of the stream unparsed) or
/// [`Verdict::Error`] (the leg failed before the first byte).
#[derive(Clone, Debug, Default)]
pub struct Hold {
    buf: Vec<u8>,
    scanned: usize,
}

impl Hold {
    /// An empty hold.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a chunk and judges the events completed so far: [`Verdict::Preamble`] while there
    /// is nothing but preamble (or an event still incomplete), else the first event that is an
    /// output or an error decides.
    pub fn push(&mut self, chunk: &[u8]) -> Verdict {
        self.buf.extend_from_slice(chunk);
        while let Some((end, data)) = next_event(&self.buf[self.scanned..]) {
            let start = self.scanned;
            self.scanned += end;
            if let Some(d) = data {
                let verdict = event_verdict(&self.buf[start + d.start..start + d.end]);
                if verdict != Verdict::Preamble {
                    return verdict;
                }
            }
        }
        if self.buf.len() > MAX_HELD { Verdict::Output } else { Verdict::Preamble }
    }

    /// The bytes held so far.
    #[must_use]
    pub fn held(&self) -> &[u8] {
        &self.buf
    }

    /// Takes the held bytes (to forward them on commit), leaving the hold empty.
    pub fn take(&mut self) -> Vec<u8> {
        self.scanned = 0;
        std::mem::take(&mut self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_at_blank_lines() {
        assert_eq!(next_event(b"data: {\"a\":1}\n"), None);
        let buf = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
        let (end, data) = next_event(buf).unwrap();
        assert_eq!(&buf[data.unwrap()], b"{\"a\":1}");
        let (end2, data2) = next_event(&buf[end..]).unwrap();
        assert_eq!(&buf[end..][data2.unwrap()], b"[DONE]");
        assert_eq!(end + end2, buf.len());
        let crlf = b": comment\r\ndata:{\"b\":2}\r\n\r\nrest";
        let (end, data) = next_event(crlf).unwrap();
        assert_eq!(&crlf[data.unwrap()], b"{\"b\":2}");
        assert_eq!(&crlf[end..], b"rest");
        assert_eq!(next_event(b": ping\n\n"), Some((8, None)));
    }

    #[test]
    fn vllm_chat_preamble_is_held_and_its_kv_error_is_an_error() {
        // What vLLM's chat stream sends when the decode side's KV pull failed: the role
        // preamble, then the GenerationError event, then [DONE].
        let role = br#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(event_verdict(role), Verdict::Preamble);
        let err = br#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#;
        assert_eq!(event_verdict(err), Verdict::Error);
        let token = br#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
        assert_eq!(event_verdict(token), Verdict::Output);
        let finish = br#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        assert_eq!(event_verdict(finish), Verdict::Output);
        let finish_error = br#"{"choices":[{"index":0,"text":"","finish_reason":"error"}]}"#;
        assert_eq!(event_verdict(finish_error), Verdict::Error);
        let tool = br#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"t"}]},"finish_reason":null}]}"#;
        assert_eq!(event_verdict(tool), Verdict::Output);
        let completion =
            br#"{"object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}"#;
        assert_eq!(event_verdict(completion), Verdict::Output);
        assert_eq!(event_verdict(br#"{"choices":[],"usage":{"prompt_tokens":3}}"#), Verdict::Output);
        assert_eq!(event_verdict(b" [DONE] "), Verdict::Output);
        assert_eq!(event_verdict(b"not json"), Verdict::Output);
    }

    #[test]
    fn a_hold_waits_for_the_first_output_across_chunks() {
        let mut h = Hold::new();
        let role = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
        assert_eq!(h.push(&role[..20]), Verdict::Preamble, "an incomplete event");
        assert_eq!(h.push(&role[20..]), Verdict::Preamble);
        assert_eq!(h.push(b": keep-alive\n\n"), Verdict::Preamble);
        assert_eq!(
            h.push(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}"),
            Verdict::Preamble
        );
        assert_eq!(h.push(b",\"finish_reason\":null}]}\n\n"), Verdict::Output);
        let held = h.take();
        assert!(held.starts_with(role));
        assert!(held.ends_with(b"\n\n"));
        assert!(h.held().is_empty());
        // The vLLM KV-pull failure, in one chunk after the preamble.
        let mut h = Hold::new();
        h.push(role);
        let err =
            b"data: {\"error\":{\"message\":\"Internal server error\",\"code\":500}}\n\ndata: [DONE]\n\n";
        assert_eq!(h.push(err), Verdict::Error);
        // A preamble that never ends is not held forever.
        let mut h = Hold::new();
        let mut v = Verdict::Preamble;
        while v == Verdict::Preamble && h.held().len() <= MAX_HELD {
            v = h.push(role);
        }
        assert_eq!(v, Verdict::Output);
    }

    #[test]
    fn sglang_aborts_and_error_bodies() {
        let abort = br#"{"text":"","meta_info":{"id":"r","finish_reason":{"type":"abort","message":"KV transfer failed"}}}"#;
        assert_eq!(event_verdict(abort), Verdict::Error);
        let ok = br#"{"text":"Hi","meta_info":{"id":"r","finish_reason":null}}"#;
        assert_eq!(event_verdict(ok), Verdict::Output);
        let length = br#"{"text":"Hi","meta_info":{"finish_reason":{"type":"length","length":4}}}"#;
        assert_eq!(body_verdict(length), Verdict::Output);
        assert_eq!(body_verdict(br#"{"error":{"message":"x"}}"#), Verdict::Error);
        assert_eq!(body_verdict(br#"{"object":"error","message":"x","code":500}"#), Verdict::Error);
        assert_eq!(body_verdict(br#"{"error":null,"text":"a"}"#), Verdict::Output);
        let batch = [&ok[..], b",", &abort[..]].concat();
        let batch = [b"[".as_slice(), &batch, b"]"].concat();
        assert_eq!(body_verdict(&batch), Verdict::Error);
        assert_eq!(body_verdict(format!("[{}]", String::from_utf8_lossy(ok)).as_bytes()), Verdict::Output);
        let non_stream = br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"length"}]}"#;
        assert_eq!(body_verdict(non_stream), Verdict::Output);
    }
}
