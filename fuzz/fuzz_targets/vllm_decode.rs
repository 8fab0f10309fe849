//! vLLM decoder on arbitrary bytes: never panics, and whatever decodes re-encodes to bytes that
//! decode to the same wire values.

#![no_main]

use cortex_events_vllm::{DecodeContext, Unlabeled, Version, decode, decode_wire, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode(data, &DecodeContext::new("m", Unlabeled::Plain));
    let _ = decode(data, &DecodeContext::new("m", Unlabeled::Unknown));
    if let Ok(wire) = decode_wire(data) {
        let bytes = encode(&wire, Version::LATEST).expect("the newest release carries every field");
        let again = decode_wire(&bytes).expect("our own encoding decodes");
        assert_eq!(again.ts.to_bits(), wire.ts.to_bits());
        assert_eq!(again.events, wire.events);
        assert_eq!(again.data_parallel_rank, wire.data_parallel_rank);
    }
});
