//! SGLang's PD wire: the bootstrap fields both legs carry, and the merge of the prefill's
//! `input_token_logprobs` into the decode's answer.
//!
//! Both legs get the client's body with the same `bootstrap_host` (the prefill worker's host,
//! IPv6 bracketed), `bootstrap_port` (its bootstrap server, or `null`) and `bootstrap_room`
//! spliced in; the prefill leg also gets `routed_dp_rank` (its rank), the decode leg
//! `disagg_prefill_dp_rank` (the prefill's rank, so the decode side does not derive it from
//! `room % dp_size`) and its own `routed_dp_rank`. Any of these the client sent is replaced: they
//! name workers the client cannot know.
//!
//! Key decision on batches: a `/generate` batch (`text` a list, or `input_ids` a list of lists)
//! gets one distinct room per item in an array, as SGLang's routers send (`mini_lb`,
//! `inject_bootstrap_into_value`); with `sampling_params.n > 1` the array has one room per item
//! and sample, because SGLang repeats a room list `n` times (`list * parallel_sample_num` in
//! `GenerateReqInput._normalize_bootstrap_params`), which would put two samples in one room.
//! Everything else gets a scalar room, which SGLang expands to `room + i` per sample itself.

use std::ops::Range;

use crate::json::{self, Edit, JsonError};
use crate::machine::Room;

/// The bootstrap fields of one pair dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bootstrap<'a> {
    /// The prefill worker's host as the gateway reaches it (a name or an address, IPv6 without
    /// brackets); both legs get it, bracketed when it is an IPv6 address.
    pub host: &'a str,
    /// The prefill worker's bootstrap port (`None` → `null`).
    pub port: Option<u16>,
    /// The dispatch's room (batch items take [`Room::item`]).
    pub room: Room,
    /// The prefill holder's DP rank.
    pub prefill_rank: u16,
    /// The decode holder's DP rank.
    pub decode_rank: u16,
}

/// `host` as SGLang expects `bootstrap_host`: an IPv6 address in brackets (as `mini_lb`'s
/// `maybe_wrap_ipv6_address` writes it), anything else as is.
#[must_use]
pub fn bootstrap_host(host: &str) -> String {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    if bare.parse::<std::net::Ipv6Addr>().is_ok() { format!("[{bare}]") } else { host.to_owned() }
}

/// How many rooms a body needs: `None` for one scalar room, `Some(n)` for an array of `n`.
///
/// # Errors
/// If the body is not a JSON object.
pub fn rooms(body: &[u8]) -> Result<Option<usize>, JsonError> {
    let batch = match (json::get(body, "text")?, json::get(body, "input_ids")?) {
        (Some(t), _) if t.first() == Some(&b'[') => Some(count_items(t)?),
        (Some(t), _) if t != b"null" => None,
        (_, Some(ids)) if ids.first() == Some(&b'[') => {
            let span = json::validate(ids)?;
            let items = json::array_items(ids, span).unwrap_or_default();
            if items.first() == Some(&b'[') { Some(count_items(ids)?) } else { None }
        }
        _ => None,
    };
    let Some(batch) = batch else { return Ok(None) };
    let n = match json::get(body, "sampling_params")? {
        Some(sp) if sp.first() == Some(&b'{') => {
            json::get(sp, "n")?.and_then(|v| std::str::from_utf8(v).ok()?.parse::<usize>().ok()).unwrap_or(1)
        }
        _ => 1,
    };
    Ok(Some(batch.saturating_mul(n.max(1))))
}

fn count_items(array: &[u8]) -> Result<usize, JsonError> {
    let mut items = Vec::new();
    json::elements(array, json::validate(array)?, &mut items)?;
    Ok(items.len())
}

/// Which leg a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SglangLeg {
    /// The prefill worker's.
    Prefill,
    /// The decode worker's.
    Decode,
}

/// Writes the body of `leg` for `b` into `out` (cleared first): the client's bytes with the
/// bootstrap fields and ranks spliced in.
///
/// # Errors
/// If the body is not a JSON object (`out` is then empty).
pub fn leg_body(body: &[u8], leg: SglangLeg, b: &Bootstrap<'_>, out: &mut Vec<u8>) -> Result<(), JsonError> {
    out.clear();
    let rooms = rooms(body)?;
    let host = bootstrap_host(b.host);
    let mut host_v = Vec::with_capacity(host.len() + 2);
    json::write_string(&host, &mut host_v);
    let port_v = b.port.map_or_else(|| b"null".to_vec(), |p| p.to_string().into_bytes());
    let room_v = match rooms {
        None => b.room.get().to_string().into_bytes(),
        Some(n) => {
            let mut v = Vec::with_capacity(n * 20 + 2);
            v.push(b'[');
            for i in 0..n {
                if i > 0 {
                    v.push(b',');
                }
                v.extend_from_slice(b.room.item(i as u64).get().to_string().as_bytes());
            }
            v.push(b']');
            v
        }
    };
    let prank = b.prefill_rank.to_string();
    let drank = b.decode_rank.to_string();
    let mut edits = vec![
        Edit::Set("bootstrap_host", &host_v),
        Edit::Set("bootstrap_port", &port_v),
        Edit::Set("bootstrap_room", &room_v),
        // The deprecated alias would be read if it were left next to the new name.
        Edit::Remove("data_parallel_rank"),
    ];
    match leg {
        SglangLeg::Prefill => {
            edits.push(Edit::Set("routed_dp_rank", prank.as_bytes()));
            edits.push(Edit::Remove("disagg_prefill_dp_rank"));
        }
        SglangLeg::Decode => {
            edits.push(Edit::Set("routed_dp_rank", drank.as_bytes()));
            edits.push(Edit::Set("disagg_prefill_dp_rank", prank.as_bytes()));
        }
    }
    json::edit(body, &edits, out)
}

/// Whether the client asked for `return_logprob` (then the prefill's `input_token_logprobs`
/// must be merged into the decode's answer, as SGLang's routers do).
///
/// # Errors
/// If the body is not a JSON object.
pub fn wants_logprobs(body: &[u8]) -> Result<bool, JsonError> {
    Ok(json::get(body, "return_logprob")?.is_some_and(json::truthy))
}

/// The spans of the objects of a value: itself if an object, its items if an array of objects.
fn objects(b: &[u8], span: Range<usize>) -> Result<Vec<Range<usize>>, JsonError> {
    match b.get(span.start) {
        Some(b'{') => Ok(vec![span]),
        Some(b'[') => {
            let mut items = Vec::new();
            json::elements(b, span, &mut items)?;
            items.retain(|r| b[r.start] == b'{');
            Ok(items)
        }
        _ => Ok(Vec::new()),
    }
}

fn index_of(b: &[u8], obj: Range<usize>) -> Result<Option<usize>, JsonError> {
    Ok(json::find_path(b, obj, &["index"])?.and_then(|r| std::str::from_utf8(&b[r]).ok()?.parse().ok()))
}

/// Writes `decode` (one JSON value: a `/generate` answer or one SSE event's data, an object or a
/// batch's array of objects) into `out` with the prefill answer's
/// `meta_info.input_token_logprobs` prepended to each item's own, as SGLang's routers merge them
/// (`mini_lb`; `merge_logprobs_in_json` / `merge_streaming_logprobs`). Batch items are matched by
/// position, or by their `index` (streamed items carry one). An item without the array on either
/// side is left as it is. Returns how many items were merged.
///
/// # Errors
/// If either value is not JSON.
pub fn merge_logprobs(decode: &[u8], prefill: &[u8], out: &mut Vec<u8>) -> Result<usize, JsonError> {
    out.clear();
    let dspan = json::validate(decode)?;
    let pspan = json::validate(prefill)?;
    let pobjs = objects(prefill, pspan.clone())?;
    let batch = prefill.get(pspan.start) == Some(&b'[');
    let path = ["meta_info", "input_token_logprobs"];
    let mut inserts: Vec<(Range<usize>, &[u8])> = Vec::new();
    for (pos, d) in objects(decode, dspan)?.into_iter().enumerate() {
        let k = if batch { index_of(decode, d.clone())?.unwrap_or(pos) } else { 0 };
        let Some(p) = pobjs.get(k) else { continue };
        let (Some(darr), Some(parr)) =
            (json::find_path(decode, d, &path)?, json::find_path(prefill, p.clone(), &path)?)
        else {
            continue;
        };
        let (Some(_), Some(items)) =
            (json::array_items(decode, darr.clone()), json::array_items(prefill, parr))
        else {
            continue;
        };
        inserts.push((darr, items));
    }
    out.reserve(decode.len() + inserts.iter().map(|(_, i)| i.len() + 1).sum::<usize>());
    let mut at = 0;
    for (arr, items) in &inserts {
        out.extend_from_slice(&decode[at..=arr.start]);
        if !items.is_empty() {
            out.extend_from_slice(items);
            if !decode[arr.start + 1..arr.end - 1].trim_ascii().is_empty() {
                out.push(b',');
            }
        }
        at = arr.start + 1;
    }
    out.extend_from_slice(&decode[at..]);
    Ok(inserts.len())
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn boot(host: &str) -> Bootstrap<'_> {
        Bootstrap { host, port: Some(8998), room: Room::new(41), prefill_rank: 1, decode_rank: 3 }
    }

    fn leg(body: &str, leg: SglangLeg, b: &Bootstrap<'_>) -> Value {
        let mut out = Vec::new();
        leg_body(body.as_bytes(), leg, b, &mut out).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn both_legs_carry_the_same_bootstrap_and_their_own_ranks() {
        let body = r#"{"text":"hi","sampling_params":{"max_new_tokens":4},"routed_dp_rank":0,"data_parallel_rank":0,"bootstrap_room":5}"#;
        let b = boot("10.0.0.7");
        let p = leg(body, SglangLeg::Prefill, &b);
        let d = leg(body, SglangLeg::Decode, &b);
        for v in [&p, &d] {
            assert_eq!(v["bootstrap_host"], "10.0.0.7");
            assert_eq!(v["bootstrap_port"], 8998);
            assert_eq!(v["bootstrap_room"], 41);
            assert_eq!(v["text"], "hi");
            assert_eq!(v["sampling_params"], json!({"max_new_tokens": 4}));
            assert!(v.get("data_parallel_rank").is_none());
        }
        assert_eq!(p["routed_dp_rank"], 1);
        assert!(p.get("disagg_prefill_dp_rank").is_none());
        assert_eq!(d["routed_dp_rank"], 3);
        assert_eq!(d["disagg_prefill_dp_rank"], 1);
    }

    #[test]
    fn hosts_ports_and_the_body_bytes() {
        assert_eq!(bootstrap_host("::1"), "[::1]");
        assert_eq!(bootstrap_host("[fe80::2]"), "[fe80::2]");
        assert_eq!(bootstrap_host("prefill-0.svc"), "prefill-0.svc");
        assert_eq!(bootstrap_host("127.0.0.1"), "127.0.0.1");
        let b = Bootstrap { port: None, ..boot("fd00::5") };
        let body = r#"{"messages":[{"role":"user","content":"x"}], "temperature": 0.50}"#;
        let mut out = Vec::new();
        leg_body(body.as_bytes(), SglangLeg::Prefill, &b, &mut out).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains(r#""bootstrap_host":"[fd00::5]""#), "{s}");
        assert!(s.contains(r#""bootstrap_port":null"#), "{s}");
        assert!(s.contains(r#""temperature": 0.50"#), "kept byte for byte: {s}");
        assert!(leg_body(b"[1]", SglangLeg::Decode, &b, &mut Vec::new()).is_err());
    }

    #[test]
    fn rooms_per_batch_item_and_sample() {
        assert_eq!(rooms(br#"{"text":"a"}"#).unwrap(), None);
        assert_eq!(rooms(br#"{"text":["a","b","c"]}"#).unwrap(), Some(3));
        assert_eq!(rooms(br#"{"text":[]}"#).unwrap(), Some(0));
        assert_eq!(rooms(br#"{"input_ids":[1,2,3]}"#).unwrap(), None);
        assert_eq!(rooms(br#"{"input_ids":[[1,2],[3]]}"#).unwrap(), Some(2));
        assert_eq!(rooms(br#"{"text":null,"input_ids":[[1],[2]]}"#).unwrap(), Some(2));
        assert_eq!(rooms(br#"{"text":["a","b"],"sampling_params":{"n":3}}"#).unwrap(), Some(6));
        assert_eq!(
            rooms(br#"{"prompt":["a","b"]}"#).unwrap(),
            None,
            "OpenAI routes: SGLang expands a scalar"
        );
        let v = leg(r#"{"text":["a","b"]}"#, SglangLeg::Decode, &boot("h"));
        assert_eq!(v["bootstrap_room"], json!([41, 42]));
        assert_eq!(v["bootstrap_host"], "h", "host and port stay scalars: SGLang repeats them");
        let top = Bootstrap { room: Room::new(Room::MAX), ..boot("h") };
        let v = leg(r#"{"text":["a","b"]}"#, SglangLeg::Prefill, &top);
        assert_eq!(v["bootstrap_room"], json!([Room::MAX, 0]), "rooms stay in [0, 2^63-1]");
    }

    #[test]
    fn logprob_requests_are_recognised() {
        assert!(wants_logprobs(br#"{"return_logprob":true}"#).unwrap());
        assert!(!wants_logprobs(br#"{"return_logprob":false}"#).unwrap());
        assert!(!wants_logprobs(br#"{"text":"x"}"#).unwrap());
    }

    #[test]
    fn prefill_logprobs_are_prepended_like_sglangs_router() {
        let p = br#"{"text":"","meta_info":{"input_token_logprobs":[[-0.1,1,null],[-0.2,2,null]]}}"#;
        let d = br#"{"text":"ok","meta_info":{"input_token_logprobs":[[-0.3,3,null]],"id":"r"}}"#;
        let mut out = Vec::new();
        assert_eq!(merge_logprobs(d, p, &mut out).unwrap(), 1);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["meta_info"]["input_token_logprobs"],
            json!([[-0.1, 1, null], [-0.2, 2, null], [-0.3, 3, null]])
        );
        assert_eq!(v["meta_info"]["id"], "r");
        // Decode side empty, prefill empty, either side missing.
        let d2 = br#"{"meta_info":{"input_token_logprobs":[]}}"#;
        merge_logprobs(d2, p, &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"].as_array().unwrap().len(), 2);
        let p0 = br#"{"meta_info":{"input_token_logprobs":[]}}"#;
        merge_logprobs(d, p0, &mut out).unwrap();
        assert_eq!(&out[..], &d[..]);
        assert_eq!(merge_logprobs(br#"{"meta_info":{}}"#, p, &mut out).unwrap(), 0);
        assert_eq!(&out[..], br#"{"meta_info":{}}"#);
        assert!(merge_logprobs(b"{", p, &mut out).is_err());
    }

    #[test]
    fn batch_logprobs_merge_by_position_and_index() {
        let p =
            br#"[{"meta_info":{"input_token_logprobs":[[1]]}},{"meta_info":{"input_token_logprobs":[[2]]}}]"#;
        let d = br#"[{"meta_info":{"input_token_logprobs":[[10]]}},{"meta_info":{"input_token_logprobs":[[20]]}}]"#;
        let mut out = Vec::new();
        assert_eq!(merge_logprobs(d, p, &mut out).unwrap(), 2);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v[0]["meta_info"]["input_token_logprobs"], json!([[1], [10]]));
        assert_eq!(v[1]["meta_info"]["input_token_logprobs"], json!([[2], [20]]));
        let ev = br#"{"index":1,"meta_info":{"input_token_logprobs":[[20]]}}"#;
        merge_logprobs(ev, p, &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"], json!([[2], [20]]));
    }
}
