//! Properties of the block identity and the engine recipes that must hold for every input:
//! chaining is prefix-stable (a prompt's identity never depends on what follows it), and
//! different namespaces never share an identity for the same tokens.

use cortex_hash::sglang::{chain_digests, published_hash};
use cortex_hash::vllm::{BlockHasher, ExtraKeyForm, HashAlgo, NoneHashSeed, RequestExtras};
use cortex_hash::{Engine, Namespace};
use proptest::prelude::*;

fn engine() -> impl Strategy<Value = Engine> {
    prop_oneof![Just(Engine::Vllm), Just(Engine::Sglang)]
}

#[derive(Debug, Clone, PartialEq)]
struct Spec {
    engine: Engine,
    block_size: u32,
    model: String,
    lora: Option<String>,
    salt: Option<String>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        engine(),
        prop_oneof![Just(1u32), Just(4), Just(16), Just(64)],
        "[a-c]{0,3}",
        proptest::option::of("[a-c]{0,2}"),
        proptest::option::of("[a-c]{0,2}"),
    )
        .prop_map(|(engine, block_size, model, lora, salt)| Spec {
            engine,
            block_size,
            model,
            lora,
            salt,
        })
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(any::<u32>(), 0..300)
}

proptest! {
    #[test]
    fn cortex_identity_is_prefix_stable(s in spec(), toks in tokens(), cut in 0usize..300) {
        let ns = Namespace::new(s.engine, s.block_size, &s.model, s.lora.as_deref());
        let whole = ns.seq_hashes(s.salt.as_deref(), &toks);
        let cut = cut.min(toks.len());
        let prefix = ns.seq_hashes(s.salt.as_deref(), &toks[..cut]);
        prop_assert_eq!(&whole[..prefix.len()], &prefix[..]);
        // Continuing a chain from the prefix's last identity gives the rest of the whole.
        let aligned = prefix.len() * s.block_size as usize;
        let mut rest = Vec::new();
        let parent = prefix.last().copied().unwrap_or_else(|| ns.root(s.salt.as_deref()));
        ns.extend_seq_hashes(parent, &toks[aligned..], &mut rest);
        prop_assert_eq!(&whole[prefix.len()..], &rest[..]);
    }

    #[test]
    fn different_namespaces_never_share_an_identity(a in spec(), b in spec(), toks in proptest::collection::vec(any::<u32>(), 64..256)) {
        prop_assume!(a != b);
        let na = Namespace::new(a.engine, a.block_size, &a.model, a.lora.as_deref());
        let nb = Namespace::new(b.engine, b.block_size, &b.model, b.lora.as_deref());
        let ha = na.seq_hashes(a.salt.as_deref(), &toks);
        let hb = nb.seq_hashes(b.salt.as_deref(), &toks);
        for h in &ha {
            prop_assert!(!hb.contains(h), "{:?} and {:?} share {:?}", a, b, h);
        }
    }

    #[test]
    fn equal_pages_differ_by_position(toks in proptest::collection::vec(0u32..4, 32..33)) {
        // The same page at two positions has the same BlockHash but different SeqHashes.
        let ns = Namespace::new(Engine::Sglang, 16, "m", None);
        let doubled: Vec<u32> = toks[..16].iter().chain(&toks[..16]).copied().collect();
        let seq = ns.seq_hashes(None, &doubled);
        prop_assert_eq!(ns.block_hash(&doubled[..16]), ns.block_hash(&doubled[16..]));
        prop_assert_ne!(seq[0], seq[1]);
    }

    #[test]
    fn sglang_chain_is_prefix_stable(toks in proptest::collection::vec(any::<u32>(), 0..200), page in 1usize..20, cut in 0usize..10) {
        let whole = chain_digests(&toks, page, None, false).unwrap();
        let cut = (cut * page).min(toks.len() - toks.len() % page);
        let head = chain_digests(&toks[..cut], page, None, false).unwrap();
        prop_assert_eq!(&whole[..head.len()], &head[..]);
        let tail = chain_digests(&toks[cut..], page, head.last(), false).unwrap();
        prop_assert_eq!(&whole[head.len()..], &tail[..]);
        prop_assert!(whole.iter().map(published_hash).count() == whole.len());
    }

    #[test]
    fn vllm_chain_is_prefix_stable(toks in proptest::collection::vec(any::<u32>(), 0..100), cut in 0usize..100) {
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, &NoneHashSeed::Default, ExtraKeyForm::Tagged);
        let whole = h.block_hashes(&toks, 16, RequestExtras::default()).unwrap();
        let cut = cut.min(toks.len());
        let prefix = h.block_hashes(&toks[..cut], 16, RequestExtras::default()).unwrap();
        prop_assert_eq!(&whole[..prefix.len()], &prefix[..]);
    }
}
