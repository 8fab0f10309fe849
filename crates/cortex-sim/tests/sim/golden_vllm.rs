//! Faithfulness, vLLM: the scenario vLLM 0.33's own `BlockPool` and `ZmqEventPublisher` were
//! driven through (`golden/vllm/blockpool_golden.json`, described in `golden/vllm/README.md`) replayed on the
//! simulator's block pool, published by a real worker, read by a SUB socket: every frame equals
//! the engine's, timestamps masked.

use std::sync::Arc;

use cortex_sim::vllm::{BlockId, BlockRequest, RequestKeys};
use cortex_sim::{LoraAdapter, SimConfig, SimWorker};

use crate::support::{TIMEOUT, golden, mask_ts, recv, sub, unhex};

#[test]
fn blockpool_scenario_publishes_the_frames_vllm_published() {
    let golden = golden("vllm/blockpool_golden.json");
    let steps = golden.as_array().expect("steps");
    let mut cfg = SimConfig::vllm();
    // `BlockPool(num_gpu_blocks=6, hash_block_size=16)`, sha256, default NONE_HASH seed, topic "".
    cfg.capacity_blocks = 6;
    cfg.block_size = 16;
    cfg.loras = vec![LoraAdapter::new("my-lora", 7, "/adapters/my-lora")];
    let lora = Arc::new(cfg.loras[0].clone());
    let w = SimWorker::start(cfg).expect("worker");
    let ctx = zmq::Context::new();
    let s = sub(&ctx, w.event_endpoints()[0].publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");

    // Step 0: request A, 40 prompt tokens, session "sess-A": 3 blocks allocated, 2 full.
    let (mut a, blocks_a): (BlockRequest, Vec<BlockId>) = w
        .with_vllm_pool(0, |pool| {
            let keys = RequestKeys { session_id: Some(Arc::from("sess-A")), ..RequestKeys::default() };
            let a = pool.request((1..=40).collect(), keys);
            let blocks = pool.get_new_blocks(3).expect("free blocks");
            pool.cache_full_blocks(&a, &blocks, 0, 2);
            (a, blocks)
        })
        .expect("vllm");
    // Step 1: A decodes to 48 tokens: block 3 becomes full, parent = block 2.
    w.with_vllm_pool(0, |pool| {
        pool.append_tokens(&mut a, &(41..=48).collect::<Vec<_>>());
        pool.cache_full_blocks(&a, &blocks_a, 2, 3);
    })
    .expect("vllm");
    // Step 2: request B, tokens 1..32, salt "tenant-a", LoRA "my-lora" (id 7).
    let blocks_b = w
        .with_vllm_pool(0, |pool| {
            let keys =
                RequestKeys { lora: Some(lora), cache_salt: Some(Arc::from("tenant-a")), session_id: None };
            let b = pool.request((1..=32).collect(), keys);
            let blocks = pool.get_new_blocks(2).expect("free blocks");
            pool.cache_full_blocks(&b, &blocks, 0, 2);
            blocks
        })
        .expect("vllm");
    // Step 3: A and B finish (blocks freed tail first); C allocates 4 blocks, evicting 4.
    let blocks_c = w
        .with_vllm_pool(0, |pool| {
            pool.free_blocks(blocks_a.iter().rev().copied());
            pool.free_blocks(blocks_b.iter().rev().copied());
            pool.get_new_blocks(4).expect("free blocks")
        })
        .expect("vllm");
    // Step 4: C finishes; reset_prefix_cache.
    let reset = w
        .with_vllm_pool(0, |pool| {
            pool.free_blocks(blocks_c.iter().rev().copied());
            pool.reset_prefix_cache()
        })
        .expect("vllm");
    assert!(reset, "nothing in use: the reset succeeds");

    for step in steps {
        let want: Vec<Vec<u8>> = step["frames_hex"]
            .as_array()
            .expect("frames")
            .iter()
            .map(|f| unhex(f.as_str().expect("hex")))
            .collect();
        let got = recv(&s);
        assert_eq!(got.len(), 3, "step {}: three frames", step["step"]);
        assert_eq!(got[0], want[0], "step {}: topic", step["step"]);
        assert_eq!(got[1], want[1], "step {}: seq", step["step"]);
        assert_eq!(
            hex::encode(mask_ts(&got[2])),
            hex::encode(mask_ts(&want[2])),
            "step {}: payload (ts masked)",
            step["step"]
        );
    }
    w.shutdown();
}
