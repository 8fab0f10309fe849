//! Virtual time: TTFT is queue wait + prefill overhead + uncached tokens × per-token time, decode
//! steps cost more with a bigger batch, and responses and metrics report it. Assertions are on
//! simulated time only.

use std::time::Duration;

use cortex_sim::{SimConfig, SimWorker, Timing};
use serde_json::json;

use crate::support::{get, post, wait_until};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-3
}

fn timing() -> Timing {
    Timing {
        speed: 0.0,
        prefill_overhead: Duration::from_millis(4),
        prefill_per_token: Duration::from_micros(50),
        itl_base: Duration::from_millis(8),
        itl_per_running: Duration::from_millis(2),
        kv_transfer_per_token: Duration::from_micros(1),
    }
}

/// The engine's own generate request for `prompt` (token ids) and `max_tokens`.
fn generate(w: &SimWorker, prompt: &[u32], max_tokens: u32) -> (&'static str, serde_json::Value) {
    if w.config().engine.name() == "vllm" {
        ("/v1/completions", json!({"prompt": prompt, "max_tokens": max_tokens}))
    } else {
        ("/generate", json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens}}))
    }
}

#[test]
fn ttft_falls_with_cached_tokens() {
    for mut cfg in [SimConfig::vllm(), SimConfig::sglang()] {
        cfg.timing = timing();
        let t = cfg.timing;
        let w = SimWorker::start(cfg).expect("worker");
        let prompt: Vec<u32> = (5000..6000).collect();
        let (path, body) = generate(&w, &prompt, 2);
        let cold = post(w.http_addr(), path, &body);
        let warm = post(w.http_addr(), path, &body);
        let expect = |uncached: u32| ms(t.prefill_overhead + t.prefill_per_token * uncached);
        assert!(close(cold.ttft_ms(), expect(1000)), "cold {} vs {}", cold.ttft_ms(), expect(1000));
        // 992 tokens (62 full blocks of 16, the last token excluded) hit.
        assert_eq!(warm.header("x-sim-cached-tokens"), Some("992"));
        assert!(close(warm.ttft_ms(), expect(8)), "warm {} vs {}", warm.ttft_ms(), expect(8));
        assert!(warm.ttft_ms() < cold.ttft_ms());
        w.shutdown();
    }
}

#[test]
fn queue_wait_and_batch_size_cost_simulated_time() {
    let mut cfg = SimConfig::sglang();
    cfg.timing = timing();
    cfg.max_running = 1;
    let t = cfg.timing;
    let w = SimWorker::start(cfg).expect("worker");
    let addr = w.http_addr();
    // Stall, queue two requests, resume: the second waits for the whole first request.
    w.stall();
    let send = |base: u32| {
        std::thread::spawn(move || {
            post(
                addr,
                "/generate",
                &json!({"input_ids": (base..base + 100).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 5}}),
            )
        })
    };
    let a = send(10_000);
    wait_until("the first request to queue", || w.rank_state(0).expect("rank").waiting == 1);
    let b = send(20_000);
    wait_until("both requests to queue", || w.rank_state(0).expect("rank").waiting == 2);
    w.resume();
    let (a, b) = (a.join().expect("a"), b.join().expect("b"));
    let prefill = ms(t.prefill_overhead + t.prefill_per_token * 100);
    let whole = prefill + 4.0 * ms(t.itl_base);
    assert!(close(a.ttft_ms(), prefill), "{}", a.ttft_ms());
    assert!(close(a.json()["meta_info"]["e2e_latency"].as_f64().expect("e2e") * 1e3, whole));
    let queue: f64 = b.header("x-sim-queue-ms").expect("queue").parse().expect("number");
    let arrived = |r: &crate::support::HttpResponse| -> u128 {
        r.header("x-sim-arrived-unix-us").expect("arrival").parse().expect("number")
    };
    assert!(arrived(&a) < arrived(&b), "a was sent, and queued, first");
    assert!(close(queue, whole), "second request waited {queue} ms, expected {whole}");
    assert!(close(b.ttft_ms(), whole + prefill), "{}", b.ttft_ms());

    // Two requests decoding together: every decode step costs itl_base + itl_per_running.
    let mut cfg = SimConfig::vllm();
    cfg.timing = timing();
    let w2 = SimWorker::start(cfg).expect("worker");
    let addr = w2.http_addr();
    w2.stall();
    let send = |base: u32| {
        std::thread::spawn(move || {
            post(
                addr,
                "/v1/completions",
                &json!({"prompt": (base..base + 10).collect::<Vec<u32>>(), "max_tokens": 3, "stream": true}),
            )
        })
    };
    let (a, b) = (send(100), send(200));
    wait_until("both requests to queue", || w2.rank_state(0).expect("rank").waiting == 2);
    w2.resume();
    let (a, b) = (a.join().expect("a"), b.join().expect("b"));
    let both_prefill = ms(t.prefill_overhead + t.prefill_per_token * 20);
    assert!(
        close(a.ttft_ms(), both_prefill) && close(b.ttft_ms(), both_prefill),
        "{} {}",
        a.ttft_ms(),
        b.ttft_ms()
    );
    let st = w2.rank_state(0).expect("rank");
    let decode_step = ms(t.itl_base + t.itl_per_running);
    assert!(close(ms(st.virtual_time), both_prefill + 2.0 * decode_step), "{:?}", st.virtual_time);
    // The metrics carry the simulated TTFTs.
    let m = get(addr, "/metrics").text();
    let sum_line = m.lines().find(|l| l.starts_with("vllm:time_to_first_token_seconds_sum")).expect("sum");
    let sum: f64 = sum_line.rsplit(' ').next().expect("value").parse().expect("number");
    assert!((sum - 2.0 * both_prefill / 1e3).abs() < 1e-9, "{sum_line}");
    w.shutdown();
    w2.shutdown();
}

/// A one-step prefill's answer is not seen before that step's time has passed on the wall clock
/// (`speed` × its cost), as with a real engine, whose output follows its compute. Until the
/// stepping loop delivered a step's outputs after sleeping its cost, a vLLM prefill leg
/// (`max_tokens` 1) answered at once, and a gateway learning prefill speeds from the wall clock
/// took such a worker for ten times faster than it was. (A lower bound: a slow machine can only
/// add time.)
#[test]
fn a_one_step_prefill_answers_after_its_cost_on_the_wall_clock() {
    for mut cfg in [SimConfig::vllm(), SimConfig::sglang()] {
        cfg.timing = Timing { speed: 1.0, prefill_overhead: Duration::from_millis(150), ..timing() };
        let w = SimWorker::start(cfg).expect("worker");
        let prompt: Vec<u32> = (7000..7032).collect();
        let (path, body) = generate(&w, &prompt, 1);
        let began = std::time::Instant::now();
        let r = post(w.http_addr(), path, &body);
        let wall = began.elapsed();
        let step = Duration::from_millis(150) + Duration::from_micros(50) * 32;
        assert!(close(r.ttft_ms(), ms(step)), "simulated TTFT {} ms", r.ttft_ms());
        assert!(wall >= step, "answered after {wall:?} of wall time, before its {step:?} step");
        w.shutdown();
    }
}
