//! The fuzzer's findings on stable, in CI: every saved corpus input (`fuzz/corpus/vllm_decode`,
//! seeded with the golden payloads) goes through the decoder, and arbitrary or mutated bytes never
//! make it panic. Whatever decodes re-encodes to bytes that decode to the same wire values.

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use std::path::PathBuf;
use std::sync::LazyLock;

use cortex_events_vllm::{DecodeContext, Unlabeled, Version, decode, decode_wire, encode};
use proptest::prelude::*;

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

static CORPUS: LazyLock<Vec<Vec<u8>>> = LazyLock::new(read_corpus);

fn read_corpus() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/vllm_decode");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

#[test]
fn every_saved_corpus_input() {
    let inputs = &*CORPUS;
    assert!(inputs.len() >= 100, "corpus has only {} inputs", inputs.len());
    let decoded = inputs.iter().filter(|d| check(d)).count();
    // The golden seeds, at least, are real batches.
    assert!(decoded >= 18, "{decoded}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        check(&data);
    }

    #[test]
    fn mutated_real_payloads_never_panic(
        pick in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let inputs = &*CORPUS;
        let mut data = inputs[pick.index(inputs.len())].clone();
        prop_assume!(!data.is_empty());
        for (at, byte) in edits {
            let i = at.index(data.len());
            data[i] = byte;
        }
        let keep = cut.index(data.len() + 1).max(data.len() / 2);
        data.truncate(keep);
        check(&data);
    }
}
