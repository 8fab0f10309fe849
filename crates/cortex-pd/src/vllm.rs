//! vLLM's PD wire (NIXL pull): what the prefill leg is sent, what its answer gives the decode
//! leg, and the `remote_host` a decode worker can reach.
//!
//! The prefill leg is the client's body with `kv_transfer_params = {"do_remote_decode": true,
//! …}` (the dict vLLM's `toy_proxy_server.py` sends), `stream: false`, `max_tokens: 1`,
//! `max_completion_tokens: 1` when present, and `stream_options`, `min_tokens`,
//! `min_completion_tokens` removed (the prefill worker generates one token and must not stream).
//! The decode leg is the client's body as it came with the prefill answer's top-level
//! `kv_transfer_params` spliced in verbatim — except `remote_host`, which the prefill worker
//! fills from `VLLM_NIXL_SIDE_CHANNEL_HOST`, `localhost` unless set: when it is a loopback or
//! wildcard name, it is replaced by the prefill worker's host as the gateway reaches it. A
//! prefill answer without (or with empty) `kv_transfer_params` sends the decode worker the
//! client's body unchanged: it prefills locally.

use crate::json::{self, Edit, JsonError};

/// The `kv_transfer_params` the prefill leg gets.
pub const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Writes the prefill leg's body into `out` (cleared first).
///
/// # Errors
/// If the body is not a JSON object (`out` is then empty).
pub fn prefill_body(body: &[u8], out: &mut Vec<u8>) -> Result<(), JsonError> {
    json::edit(
        body,
        &[
            Edit::Set("kv_transfer_params", PREFILL_PARAMS),
            Edit::Set("stream", b"false"),
            Edit::Set("max_tokens", b"1"),
            Edit::Replace("max_completion_tokens", b"1"),
            Edit::Remove("stream_options"),
            Edit::Remove("min_tokens"),
            Edit::Remove("min_completion_tokens"),
        ],
        out,
    )
}

/// The prefill answer's top-level `kv_transfer_params`, if it is a non-empty object (the toy
/// proxy's `if kv_transfer_params:`).
///
/// # Errors
/// If the answer is not a JSON object.
pub fn transfer_params(answer: &[u8]) -> Result<Option<&[u8]>, JsonError> {
    Ok(json::get(answer, "kv_transfer_params")?.filter(|v| v.first() == Some(&b'{') && json::truthy(v)))
}

/// Whether `host` names this machine or any machine (`localhost`, a loopback address, a wildcard):
/// as `remote_host`, only the prefill worker's own machine can use it.
#[must_use]
pub fn is_local_name(host: &str) -> bool {
    let h = host.trim().trim_start_matches('[').trim_end_matches(']');
    if h.eq_ignore_ascii_case("localhost") || h.to_ascii_lowercase().ends_with(".localhost") {
        return true;
    }
    match h.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback() || ip.is_unspecified(),
        Err(_) => h.eq_ignore_ascii_case("localhost.localdomain"),
    }
}

/// Writes the decode leg's body into `out` (cleared first): `body` with `params` (the prefill's
/// [`transfer_params`]) spliced in, their `remote_host` replaced by `prefill_host` (IPv6 without
/// brackets, as vLLM's side channel takes it) when it is a local name and `prefill_host` is not;
/// `body` as it came when `params` is `None`.
///
/// # Errors
/// If the body or the parameters are not JSON objects (`out` is then empty).
pub fn decode_body(
    body: &[u8],
    params: Option<&[u8]>,
    prefill_host: &str,
    out: &mut Vec<u8>,
) -> Result<(), JsonError> {
    let Some(params) = params else {
        out.clear();
        json::validate(body)?;
        out.extend_from_slice(body);
        return Ok(());
    };
    let advertised = json::get(params, "remote_host")?;
    let local = advertised
        .filter(|v| v.first() == Some(&b'"'))
        .and_then(|v| json::unescape(&v[1..v.len() - 1]))
        .is_some_and(|h| is_local_name(&h));
    let host = prefill_host.trim_start_matches('[').trim_end_matches(']');
    let mut rewritten = Vec::new();
    let params = if local && !is_local_name(host) {
        let mut v = Vec::with_capacity(host.len() + 2);
        json::write_string(host, &mut v);
        json::edit(params, &[Edit::Set("remote_host", &v)], &mut rewritten)?;
        &rewritten[..]
    } else {
        params
    };
    json::edit(body, &[Edit::Set("kv_transfer_params", params)], out)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn the_prefill_leg_is_capped_and_unstreamed() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":64,"max_completion_tokens":64,"min_tokens":8,"min_completion_tokens":8,"kv_transfer_params":{"x":1},"temperature":0.70}"#;
        let mut out = Vec::new();
        prefill_body(body, &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert!(v["kv_transfer_params"].get("x").is_none());
        assert_eq!((v["stream"].clone(), v["max_tokens"].clone()), (json!(false), json!(1)));
        assert_eq!(v["max_completion_tokens"], 1);
        for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(v.get(gone).is_none(), "{gone}");
        }
        assert!(String::from_utf8(out.clone()).unwrap().contains("\"temperature\":0.70"));
        prefill_body(br#"{"prompt":"x"}"#, &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v.get("max_completion_tokens").is_none(), "added only when the client sent it");
        assert_eq!(v["max_tokens"], 1);
    }

    #[test]
    fn transfer_params_only_when_non_empty() {
        let a = br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_port":5600}}"#;
        assert_eq!(
            transfer_params(a).unwrap(),
            Some(&br#"{"do_remote_prefill":true,"remote_port":5600}"#[..])
        );
        assert_eq!(transfer_params(br#"{"kv_transfer_params":null}"#).unwrap(), None);
        assert_eq!(transfer_params(br#"{"kv_transfer_params":{}}"#).unwrap(), None);
        assert_eq!(transfer_params(br#"{"choices":[]}"#).unwrap(), None);
        assert!(transfer_params(b"oops").is_err());
    }

    #[test]
    fn the_decode_leg_gets_the_params_verbatim_with_a_reachable_host() {
        let body = br#"{"prompt":"x","stream":true,"max_tokens":64}"#;
        let params = br#"{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_host":"localhost","remote_port":5601,"tp_size":1}"#;
        let mut out = Vec::new();
        decode_body(body, Some(params), "10.1.2.3", &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_host"], "10.1.2.3");
        assert_eq!(v["kv_transfer_params"]["remote_block_ids"], json!([[1, 2]]));
        assert_eq!((v["stream"].clone(), v["max_tokens"].clone()), (json!(true), json!(64)));
        // A routable advertised host is kept; so is a loopback one when the gateway uses loopback.
        let routable = br#"{"remote_host":"p0.cluster","remote_port":1}"#;
        decode_body(body, Some(routable), "10.1.2.3", &mut out).unwrap();
        assert!(
            String::from_utf8(out.clone())
                .unwrap()
                .contains(r#""kv_transfer_params":{"remote_host":"p0.cluster","remote_port":1}"#)
        );
        decode_body(body, Some(params), "127.0.0.1", &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_host"], "localhost");
        decode_body(body, Some(params), "[fd00::9]", &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_host"], "fd00::9");
        // No params: the client's body, byte for byte.
        decode_body(body, None, "10.1.2.3", &mut out).unwrap();
        assert_eq!(&out[..], &body[..]);
        assert!(decode_body(b"[", None, "h", &mut out).is_err());
    }

    #[test]
    fn local_names() {
        for h in [
            "localhost",
            "LOCALHOST",
            "127.0.0.1",
            "127.9.9.9",
            "::1",
            "[::1]",
            "0.0.0.0",
            "::",
            "a.localhost",
        ] {
            assert!(is_local_name(h), "{h}");
        }
        for h in ["10.0.0.1", "fd00::1", "prefill-0", "localhost.example.com"] {
            assert!(!is_local_name(h), "{h}");
        }
    }
}
