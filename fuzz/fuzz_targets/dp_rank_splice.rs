//! The DP-rank body splicer on arbitrary bytes (the first two are the rank): never panics, and
//! a JSON object without a rank of its own comes out as the same object plus `routed_dp_rank`.

#![no_main]

use bytes::Bytes;
use cortex_proxy::request::splice_routed_dp_rank;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((rank, body)) = data.split_first_chunk::<2>() else { return };
    let rank = u16::from_le_bytes(*rank);
    let body = Bytes::copy_from_slice(body);
    let out = splice_routed_dp_rank(&body, rank);
    if let Ok(serde_json::Value::Object(mut before)) = serde_json::from_slice::<serde_json::Value>(&body)
        && !before.contains_key("routed_dp_rank")
    {
        let after: serde_json::Value = serde_json::from_slice(&out).expect("a spliced object is JSON");
        before.insert("routed_dp_rank".to_owned(), rank.into());
        assert_eq!(after, serde_json::Value::Object(before));
    }
});
