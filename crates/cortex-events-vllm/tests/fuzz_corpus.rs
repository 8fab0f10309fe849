//! The fuzzer's findings on stable, in CI: every saved corpus input (`fuzz/corpus/vllm_decode`,
//! seeded with the golden payloads) goes through the decoder, and arbitrary or mutated bytes never
//! make it panic. Whatever decodes re-encodes to bytes that decode to the same wire values.

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use cortex_events_core::testing::{corpus, never_panics};
use cortex_events_vllm::{DecodeContext, Unlabeled, Version, decode, decode_wire, encode};

/// The fuzz target's oracle, verbatim.
fn check(data: &[u8]) -> bool {
    let _ = decode(data, &DecodeContext::new("m", Unlabeled::Plain));
    let _ = decode(data, &DecodeContext::new("m", Unlabeled::Unknown));
    let Ok(wire) = decode_wire(data) else { return false };
    let bytes = encode(&wire, Version::LATEST).unwrap();
    let again = decode_wire(&bytes).unwrap();
    assert_eq!(again.ts.to_bits(), wire.ts.to_bits());
    assert_eq!(again.events, wire.events);
    assert_eq!(again.data_parallel_rank, wire.data_parallel_rank);
    true
}

#[test]
fn every_saved_corpus_input() {
    let inputs = corpus("vllm_decode");
    assert!(inputs.len() >= 100, "corpus has only {} inputs", inputs.len());
    let decoded = inputs.iter().filter(|d| check(d)).count();
    // The golden seeds, at least, are real batches.
    assert!(decoded >= 18, "{decoded}");
}

#[test]
fn arbitrary_and_mutated_bytes_never_panic() {
    never_panics(&corpus("vllm_decode"), check);
}
