//! The HTTP surfaces of both engines: routes, shapes, SSE framing, usage and cache hits, DP-rank
//! pinning, discovery documents, events published by real requests, client disconnects.

use std::time::Duration;

use cortex_sim::{LoraAdapter, SimConfig, SimWorker};
use serde_json::{Value, json};

use crate::support::{TIMEOUT, get, golden, open_stream, post, post_h, recv, sub, wait_until};

fn ids(n: u32) -> Vec<u32> {
    (1000..1000 + n).collect()
}

#[test]
fn vllm_completions_count_cached_tokens_as_vllm_does() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let addr = w.http_addr();
    // 32 tokens = 2 full blocks: the second time, only the first block is a hit (the last token
    // is always recomputed, so the last block of a block-aligned prompt never hits).
    let body = json!({"model": "Qwen/Qwen3-0.6B", "prompt": ids(32), "max_tokens": 4, "some_unknown_field": {"x": 1}});
    let first = post_h(addr, "/v1/completions", &[("X-Request-Id", "req-1")], &body);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-request-id"), Some("req-1"));
    let v = first.json();
    assert_eq!(v["id"], "cmpl-req-1");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 32);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 36);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(!v["choices"][0]["text"].as_str().expect("text").is_empty());
    let second = post(addr, "/v1/completions", &body);
    assert_eq!(second.json()["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
    assert_eq!(second.header("x-sim-cached-tokens"), Some("16"));
    // 40 tokens sharing those 2 blocks: both hit.
    let longer = post(addr, "/v1/completions", &json!({"prompt": ids(40), "max_tokens": 1}));
    assert_eq!(longer.json()["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    // An unknown model is a 404 in vLLM's error shape.
    let nope = post(addr, "/v1/completions", &json!({"model": "other", "prompt": "hi"}));
    assert_eq!(nope.status, 404);
    assert_eq!(nope.json()["error"]["code"], 404);
    // Too long for the context.
    let long = post(addr, "/v1/completions", &json!({"prompt": ids(10), "max_tokens": 1_000_000}));
    assert_eq!(long.status, 400);
    w.shutdown();
}

#[test]
fn vllm_chat_streams_sse_with_usage_and_done() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let body = json!({
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": [{"type": "text", "text": "Hello!"}]}],
        "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true},
    });
    let r = post(w.http_addr(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.complete, "the chunked body ends properly");
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
    assert!(r.text().split("\n\n").filter(|e| !e.is_empty()).all(|e| e.starts_with("data: ")));
    let events = r.sse();
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("JSON")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let content: Vec<&Value> =
        chunks.iter().filter(|c| c["choices"][0]["delta"].get("content").is_some()).skip(1).collect();
    assert_eq!(content.len(), 5, "one chunk per token");
    assert_eq!(content[4]["choices"][0]["finish_reason"], "length");
    assert!(content[..4].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], json!([]));
    let tokenized = post(w.http_addr(), "/tokenize", &json!({"messages": body["messages"]}));
    assert_eq!(usage["usage"]["prompt_tokens"], tokenized.json()["count"]);
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    // The prompt is the template's rendering, tokenized as the model's tokenizer does.
    let rendered = w.model().render_chat(&json!({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]})).expect("render");
    assert!(rendered.starts_with("<|im_start|>system\nYou are terse.<|im_end|>"), "{rendered}");
    assert_eq!(
        tokenized.json()["tokens"].as_array().expect("tokens").len(),
        w.model().encode(&rendered, false).expect("tokens").len()
    );
    w.shutdown();
}

#[test]
fn vllm_discovery_metrics_and_pinned_ranks() {
    let mut cfg = SimConfig::vllm();
    cfg.dp_size = 2;
    cfg.loras = vec![LoraAdapter::new("my-lora", 7, "/adapters/my-lora")];
    cfg.capacity_blocks = 100;
    let w = SimWorker::start(cfg).expect("worker");
    let addr = w.http_addr();
    assert_eq!(get(addr, "/health").status, 200);
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "Qwen/Qwen3-0.6B");
    assert_eq!(models["data"][1]["root"], "/adapters/my-lora");
    let sources = get(addr, "/kv_event_sources").json();
    for e in w.event_endpoints() {
        let s = &sources[e.rank.to_string()];
        assert_eq!(s["endpoint"], format!("tcp://*:{}", e.publish.port()));
        assert_eq!(s["replay_endpoint"], format!("tcp://*:{}", e.replay.expect("replay").port()));
        assert_eq!(s["topic"], "");
    }
    // Pinning: X-data-parallel-rank decides where the blocks go.
    let r = post_h(
        addr,
        "/v1/completions",
        &[("X-data-parallel-rank", "1")],
        &json!({"prompt": ids(48), "max_tokens": 2}),
    );
    assert_eq!(r.header("x-sim-dp-rank"), Some("1"));
    assert!(w.held_blocks(0).expect("rank 0").is_empty());
    assert_eq!(w.held_blocks(1).expect("rank 1").len(), 3);
    let bad = post_h(addr, "/v1/completions", &[("X-data-parallel-rank", "2")], &json!({"prompt": "x"}));
    assert_eq!(bad.status, 400);
    // A LoRA request: blocks carry the adapter.
    let l = post_h(
        addr,
        "/v1/completions",
        &[("X-data-parallel-rank", "0")],
        &json!({"model": "my-lora", "prompt": ids(16), "max_tokens": 1}),
    );
    assert_eq!(l.status, 200);
    assert!(w.held_blocks(0).expect("rank 0").iter().all(|b| b.lora_name.as_deref() == Some("my-lora")));
    let m = get(addr, "/metrics").text();
    for name in [
        "vllm:num_requests_running{engine=\"1\",model_name=\"Qwen/Qwen3-0.6B\"} 0.0",
        "vllm:num_requests_waiting{engine=\"0\"",
        "vllm:kv_cache_usage_perc{engine=\"0\"",
        "vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"Qwen/Qwen3-0.6B\"} 48.0",
        "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"Qwen/Qwen3-0.6B\"} 0.0",
        "vllm:cache_config_info{block_size=\"16\",",
        "num_gpu_blocks=\"100\",prefix_caching_hash_algo=\"sha256\"} 1.0",
        "vllm:time_to_first_token_seconds_count{engine=\"1\",model_name=\"Qwen/Qwen3-0.6B\"} 1.0",
    ] {
        assert!(m.contains(name), "missing `{name}` in\n{m}");
    }
    w.shutdown();
}

#[test]
fn vllm_requests_publish_prompt_and_decode_blocks_matching_ground_truth() {
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    let ctx = zmq::Context::new();
    let s = sub(&ctx, w.event_endpoints()[0].publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    // 40 prompt tokens + 9 generated: blocks 1-2 at prefill, block 3 once token 48 is computed.
    let r = post(w.http_addr(), "/v1/completions", &json!({"prompt": ids(40), "max_tokens": 9}));
    assert_eq!(r.status, 200);
    let mut stored = Vec::new();
    while stored.len() < 3 {
        let m = recv(&s);
        let v: Value = rmp_like_decode(&m[2]);
        for e in v.as_array().expect("events") {
            assert_eq!(e["type"], "BlockStored");
            stored.extend(
                e["block_hashes"].as_array().expect("hashes").iter().map(|h| h.as_u64().expect("u64")),
            );
        }
    }
    let held: Vec<u64> = w.held_blocks(0).expect("rank 0").iter().map(|b| b.hash.to_u64()).collect();
    assert_eq!(held, stored, "ground truth = what was announced");
    w.shutdown();
}

/// The events of a vLLM payload, through the event crate's own decoder.
fn rmp_like_decode(payload: &[u8]) -> Value {
    let b = cortex_events_vllm::decode_wire(payload).expect("a vLLM batch");
    Value::Array(
        b.events
            .iter()
            .map(|e| match e {
                cortex_events_vllm::WireEvent::BlockStored(s) => json!({
                    "type": "BlockStored",
                    "block_hashes": s.block_hashes.iter().map(|h| match h { cortex_events_vllm::WireHash::Uint(v) => json!(v), _ => Value::Null }).collect::<Vec<_>>(),
                }),
                cortex_events_vllm::WireEvent::BlockRemoved(_) => json!({"type": "BlockRemoved"}),
                cortex_events_vllm::WireEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
            })
            .collect(),
    )
}

#[test]
fn sglang_generate_text_ids_batches_and_stream() {
    let mut cfg = SimConfig::sglang();
    cfg.dp_size = 2;
    let w = SimWorker::start(cfg).expect("worker");
    let addr = w.http_addr();
    let r = post(
        addr,
        "/generate",
        &json!({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3}, "rid": "abc"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["meta_info"]["id"], "abc");
    assert_eq!(v["meta_info"]["finish_reason"], json!({"type": "length", "length": 3}));
    assert_eq!(v["output_ids"].as_array().expect("ids").len(), 3);
    assert_eq!(
        v["meta_info"]["prompt_tokens"],
        w.model().encode("The capital of France is", true).expect("tokens").len()
    );
    // Pinned by routed_dp_rank; output tokens are cached too (inserted at finish).
    let pinned = post(
        addr,
        "/generate",
        &json!({"input_ids": ids(40), "sampling_params": {"max_new_tokens": 30}, "routed_dp_rank": 1}),
    );
    assert_eq!(pinned.header("x-sim-dp-rank"), Some("1"));
    let pages = w.held_blocks(1).expect("rank 1");
    assert_eq!(pages.len(), 4, "40 prompt + 29 computed output tokens = 69 → 4 full pages");
    let out = pinned.json()["output_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("id")).expect("u32"))
        .collect::<Vec<_>>();
    let seq: Vec<u32> = ids(40).into_iter().chain(out).collect();
    let mut cached: Vec<u32> = Vec::new();
    for p in &pages {
        cached.extend(&p.tokens);
    }
    assert_eq!(cached, seq[..64], "the tree holds prompt and output pages");
    let again = post(
        addr,
        "/generate",
        &json!({"input_ids": seq[..64].to_vec(), "sampling_params": {"max_new_tokens": 1}, "routed_dp_rank": 1}),
    );
    assert_eq!(again.json()["meta_info"]["cached_tokens"], 48, "page-aligned, last token excluded");
    // Batches: a list of texts gives a list of results.
    let batch = post(
        addr,
        "/generate",
        &json!({"text": ["a b c", "d e f"], "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(batch.json().as_array().expect("list").len(), 2);
    // Streaming: cumulative text, then [DONE].
    let st = post(
        addr,
        "/generate",
        &json!({"input_ids": ids(5), "sampling_params": {"max_new_tokens": 4}, "stream": true}),
    );
    let ev = st.sse();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).expect("JSON")).collect();
    assert_eq!(chunks.len(), 4);
    assert!(chunks[3]["text"].as_str().expect("text").starts_with(chunks[0]["text"].as_str().expect("text")));
    assert_eq!(chunks[3]["meta_info"]["finish_reason"]["type"], "length");
    // OpenAI surfaces.
    let chat = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(chat.json()["choices"][0]["message"]["role"], "assistant");
    let bad = post(addr, "/generate", &json!({"input_ids": ids(5), "routed_dp_rank": 7}));
    assert_eq!(bad.status, 400);
    w.shutdown();
}

#[test]
fn sglang_discovery_documents() {
    let mut cfg = SimConfig::sglang();
    cfg.dp_size = 2;
    cfg.events.topic = "kv".to_owned();
    let w = SimWorker::start(cfg).expect("worker");
    let addr = w.http_addr();
    let info = get(addr, "/server_info").json();
    let eps = w.event_endpoints();
    let kv = &info["kv_events"];
    let keys: Vec<&String> = kv.as_object().expect("object").keys().collect();
    let g = golden("sglang/server_info_kv_events.json");
    let gkeys: Vec<&String> = g["cases"][0]["kv_events"].as_object().expect("golden").keys().collect();
    assert_eq!(keys, gkeys, "the descriptor has SGLang's keys in SGLang's order");
    assert_eq!(kv["endpoint_port_base"], eps[0].publish.port());
    assert_eq!(kv["replay_endpoint_port_base"], eps[0].replay.expect("replay").port());
    assert_eq!(kv["topic"], "kv");
    assert_eq!(kv["dp_size"], 2);
    assert_eq!(info["page_size"], 16);
    assert_eq!(info["disaggregation_mode"], "null");
    assert_eq!(get(addr, "/model_info").json()["is_generation"], true);
    let loads = get(addr, "/v1/loads").json();
    assert_eq!(loads["loads"].as_array().expect("loads").len(), 2);
    assert_eq!(get(addr, "/v1/loads?dp_rank=1").json()["loads"][0]["dp_rank"], 1);
    for path in ["/health", "/health_generate", "/ready"] {
        assert_eq!(get(addr, path).status, 200, "{path}");
    }
    let m = get(addr, "/metrics").text();
    for name in [
        "sglang:num_running_reqs{dp_rank=\"1\"",
        "sglang:num_queue_reqs{",
        "sglang:token_usage{",
        "sglang:cache_hit_rate{",
    ] {
        assert!(m.contains(name), "missing {name}");
    }
    w.shutdown();
}

#[test]
fn client_disconnect_aborts_the_request() {
    let mut cfg = SimConfig::vllm();
    // Real time: 2000 tokens would take 20 s; the test only waits for the abort.
    cfg.timing.speed = 1.0;
    let w = SimWorker::start(cfg).expect("worker");
    let (stream, first) = open_stream(
        w.http_addr(),
        "/v1/completions",
        &json!({"prompt": ids(8), "max_tokens": 2000, "stream": true}),
    );
    assert!(first.contains("x-sim-ttft-ms"), "{first}");
    assert_eq!(w.in_flight(0).expect("rank"), 1);
    drop(stream);
    wait_until("the streaming request to be aborted", || w.in_flight(0).expect("rank") == 0);
    // A non-streaming request whose client leaves is aborted too.
    let mut s = std::net::TcpStream::connect(w.http_addr()).expect("connect");
    let body = json!({"prompt": ids(8), "max_tokens": 2000}).to_string();
    std::io::Write::write_all(
        &mut s,
        format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes(),
    )
    .expect("send");
    wait_until("the request to start", || w.in_flight(0).expect("rank") == 1);
    drop(s);
    wait_until("the non-streaming request to be aborted", || w.in_flight(0).expect("rank") == 0);
    let _ = Duration::ZERO;
    w.shutdown();
}

#[test]
fn older_vllm_releases_publish_arrays_and_replay_without_topic() {
    use cortex_sim::formats::VllmVersion;
    let mut cfg = SimConfig::new(cortex_sim::EngineConfig::Vllm(cortex_sim::VllmOptions {
        version: VllmVersion::new(0, 23, 0),
        ..cortex_sim::VllmOptions::default()
    }));
    cfg.events.topic = "kv-events".to_owned();
    let w = SimWorker::start(cfg).expect("worker");
    assert_eq!(get(w.http_addr(), "/kv_event_sources").status, 404, "added in 0.31");
    let ctx = zmq::Context::new();
    let ep = w.event_endpoints()[0];
    let s = sub(&ctx, ep.publish, b"kv-events");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    post(w.http_addr(), "/v1/completions", &json!({"prompt": ids(16), "max_tokens": 1}));
    let live = recv(&s);
    assert_eq!(live[0], b"kv-events");
    // [ts, [["BlockStored", …]], 0]: a positional event (fixarray 0x9c = 12 elements in 0.23).
    assert_eq!(&live[2][10..12], &[0x91, 0x9c], "{}", hex::encode(&live[2]));
    let batch = cortex_events_vllm::decode_wire(&live[2]).expect("batch");
    let cortex_events_vllm::WireEvent::BlockStored(st) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!((st.group_idx, st.kv_cache_spec_kind, st.session_id), (Some(0), Some("full_attention"), None));
    let d = crate::support::dealer(&ctx, ep.replay.expect("replay"));
    let got = crate::support::replay(&d, 0);
    assert_eq!(
        got[0],
        vec![Vec::new(), 0u64.to_be_bytes().to_vec(), live[2].clone()],
        "≤ 0.25: no topic frame"
    );
    assert_eq!(got[1], vec![Vec::new(), vec![0xff; 8], Vec::new()]);
    w.shutdown();
}

#[test]
fn a_worker_can_run_another_template_and_block_size() {
    let default = SimWorker::start(SimConfig::vllm()).expect("worker");
    let mut cfg = SimConfig::vllm();
    cfg.chat_template = Some("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".to_owned());
    cfg.block_size = 32;
    let other = SimWorker::start(cfg).expect("worker");
    let msgs = json!({"messages": [{"role": "user", "content": "Hello there, how are you?"}]});
    let a = post(default.http_addr(), "/tokenize", &msgs).json();
    let b = post(other.http_addr(), "/tokenize", &msgs).json();
    assert_ne!(a["tokens"], b["tokens"], "different templates render different prompts");
    assert_eq!(
        b["tokens"],
        json!(other.model().encode("user: Hello there, how are you?\n", false).expect("tokens"))
    );
    let m = get(other.http_addr(), "/metrics").text();
    assert!(m.contains("vllm:cache_config_info{block_size=\"32\""));
    post(other.http_addr(), "/v1/completions", &json!({"prompt": ids(64), "max_tokens": 1}));
    assert!(other.held_blocks(0).expect("rank").iter().all(|b| b.tokens.len() == 32));
    default.shutdown();
    other.shutdown();
}

#[test]
fn sglang_eagle_workers_publish_bigram_pages() {
    let mut cfg = SimConfig::new(cortex_sim::EngineConfig::Sglang(cortex_sim::SglangOptions {
        bigram: true,
        ..cortex_sim::SglangOptions::default()
    }));
    cfg.block_size = 4;
    let w = SimWorker::start(cfg).expect("worker");
    assert_eq!(get(w.http_addr(), "/server_info").json()["speculative_algorithm"], "EAGLE");
    let ctx = zmq::Context::new();
    let s = sub(&ctx, w.event_endpoints()[0].publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    let prompt: Vec<u32> = (500..517).collect();
    let r = post(
        w.http_addr(),
        "/generate",
        &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let m = recv(&s);
    let b = cortex_events_sglang::decode_wire(&m[2]).expect("batch");
    let cortex_events_sglang::WireEvent::BlockStored(st) = &b.events[0] else { panic!("{b:?}") };
    let cortex_events_sglang::TokenIds::Bigram(pairs) = &st.token_ids else { panic!("{st:?}") };
    // 17 tokens make 16 pair units: 4 pages of 4 pairs, hashed as SGLang hashes bigram pages.
    assert_eq!(pairs.len(), 16);
    assert_eq!(pairs[0], [500, 501]);
    let want = cortex_hash::sglang::event_hashes(
        &prompt,
        4,
        true,
        cortex_hash::sglang::RequestKey { extra_key: None, cache_salt: None, lora_registered: false },
        cortex_hash::sglang::EventFormat::Default,
    )
    .expect("hashes");
    assert_eq!(st.block_hashes, want);
    assert_eq!(w.held_blocks(0).expect("rank")[0].tokens, vec![500, 501, 502, 503, 504]);
    w.shutdown();
}

#[test]
fn digest_hashes_and_handles_shareable_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<SimWorker>();
    let mut cfg = SimConfig::new(cortex_sim::EngineConfig::Vllm(cortex_sim::VllmOptions {
        int_block_hashes: false,
        ..cortex_sim::VllmOptions::default()
    }));
    cfg.events.replay = false;
    let w = SimWorker::start(cfg).expect("worker");
    assert_eq!(w.event_endpoints()[0].replay, None);
    let ctx = zmq::Context::new();
    let s = sub(&ctx, w.event_endpoints()[0].publish, b"");
    w.wait_subscribed(0, TIMEOUT).expect("subscribed");
    post(
        w.http_addr(),
        "/v1/completions",
        &json!({"prompt": (1..=17).collect::<Vec<u32>>(), "max_tokens": 1}),
    );
    let m = recv(&s);
    let b = cortex_events_vllm::decode_wire(&m[2]).expect("batch");
    let cortex_events_vllm::WireEvent::BlockStored(st) = &b.events[0] else { panic!("{b:?}") };
    // VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the 32-byte digest of tokens 1..16 (research §2.7).
    let cortex_events_vllm::WireHash::Bytes(d) = st.block_hashes[0] else { panic!("{st:?}") };
    assert_eq!(hex::encode(d), "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf");
    assert_eq!(w.held_blocks(0).expect("rank")[0].digest.as_deref(), Some(d));
    w.shutdown();
}
