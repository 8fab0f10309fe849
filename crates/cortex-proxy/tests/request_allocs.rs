//! Allocations on the request path between the body being received and the upstream send, on a
//! warm gateway: parse the body's facts, read the routing headers, plan (tokenize a prompt the
//! segment cache holds, hash, query the ledger, decide, keep the candidates), and build the
//! upstream request's head. hyper's own allocations (reading the body, sending) are outside
//! these steps and not counted.
//!
//! A counting global allocator (per thread, so the harness's and the runtime's other threads do
//! not count) counts each step run on the test's thread; the plan's future is polled once with a
//! no-op waker, as the request task polls it (a short plain-text prompt is tokenized inline, so
//! it completes in one poll). Each step must allocate exactly its budget below, where every
//! allocation that remains is named with why: a new allocation on the path, or a removed one
//! whose budget is not lowered, fails the test (exact counts, not upper bounds), and
//! `counting::the_counter_sees_allocations` is the negative control that the counter counts at all. It
//! failed as written before the allocations it found were removed: the plan counted 6 (the
//! route's namespace and root derived per request) and the upstream head 6 (the header map
//! grown, the route's path parsed).

mod fake;

#[path = "../../cortex-sched/tests/counting/mod.rs"]
mod counting;

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use cortex_hash::Engine;
use cortex_proxy::forwarder::upstream_head;
use cortex_proxy::request::{self, Route};
use cortex_proxy::{Ask, Plan};
use cortex_sched::{MatchMode, Role};
use fake::{FakeConfig, MODEL, Options, start};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::json;

use counting::allocations;

/// Polls `fut` once with a no-op waker; `None` if it is not ready.
fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// The allocations each step may make, with why (see the module's doc).
const BUDGET: [(&str, u64); 4] = [
    // serde_json's `Value` of the body (the object's map and its nodes, the keys and the string
    // values), then the facts' own `String`s (model, prompt).
    ("parse", PARSE),
    // `Ask` shares the facts behind an `Arc` (one allocation: they outlive the request task in
    // the relay's alignment check).
    ("ask", 1),
    // The plan's own vectors, each returned in the `Plan` and each allocated once at its size:
    // the prompt's tokens, its block identities, the admissible candidates, and the first
    // block's tokens for the alignment checks. Tokenizing a cached prompt, hashing (the route's
    // namespace and unsalted root are derived once; a cache salt costs one more, for its root),
    // the ledger query and the decision allocate nothing (thread-local buffers, a lent
    // `Ranking`).
    ("plan", 4),
    // The upstream head: the header map (its index and entry arrays, sized for the headers the
    // gateway adds, never grown) and the `x-request-id` value (copied from the request id).
    ("upstream head", 3),
];

/// serde_json's allocations for the probe's body (see [`BUDGET`]): the `Value` tree of a
/// four-member object (its map's nodes, the four keys and the two string values), then the
/// facts' `model` and `prompt` copied out of it. A borrowing, typed parse would remove most of
/// them; it is not done yet.
const PARSE: u64 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_path_allocates_only_its_budget() {
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    let prompt = "You are a helpful assistant. Answer in one short sentence, without lists or code: \
                  what does a key-value cache store for a transformer model while it generates text?";
    let value = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0});
    // Warm: the first request tokenizes the prompt into the segment cache, the fake caches its
    // blocks, and the ledger learns them.
    let first = h.post("/v1/completions", &[], &value).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    h.fakes[0].prime(Route::Completions, 0, &value);
    let body = Bytes::from(value.to_string());
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(http::header::HOST, HeaderValue::from_static("127.0.0.1"));
    let worker = h.gateway.control().registry().snapshot().values().next().cloned().expect("the worker");
    let rid = "cortex-0123456789abcdef0123456789abcdef";
    let planner = h.gateway.planner();
    // Each step twice: the first run on this thread warms its thread-local buffers.
    let mut counted = Vec::new();
    for round in 0..2 {
        let (facts, parse) = allocations(|| request::parse(Route::Completions, &body).unwrap());
        let (ask, ask_n) = allocations(|| Ask::new(facts, &headers).unwrap());
        let (plan, plan_n) = allocations(|| poll_once(planner.plan(&ask, Role::Regular)));
        let plan: Plan = plan.expect("a cached short prompt is planned in one poll").unwrap();
        assert_eq!(plan.mode, MatchMode::ExactKvEvents, "the warm prompt is a cache hit");
        assert!(plan.candidates[0].matched_tokens >= 32, "{:?}", plan.candidates[0]);
        let (head, head_n) =
            allocations(|| upstream_head(&headers, rid, None, &worker, Route::Completions).map(|_| ()));
        head.unwrap();
        if round == 1 {
            counted = vec![("parse", parse), ("ask", ask_n), ("plan", plan_n), ("upstream head", head_n)];
        }
    }
    assert_eq!(counted, BUDGET.to_vec(), "allocations per step (name, count) against the budget");
    h.shutdown().await;
}

/// The relay reads a finished response's usage (`upstream::find_usage`) for the alignment
/// checks and the hit metrics. It scans for the four numbers and allocates nothing of its own,
/// on a body and on a stream's tail: the one allocation is serde_json's scratch buffer, which
/// holds the stack of containers it skips (here `choices: [{...}]`). A `serde_json::Value` of
/// the same body, which it used to build, allocates for every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_s_usage_is_read_without_allocating() {
    use cortex_proxy::upstream::find_usage;
    let h = start(Options::new(Engine::Sglang, vec![FakeConfig::new(Engine::Sglang)])).await;
    let value = json!({"model": MODEL, "prompt": "Say something about caches.", "max_tokens": 4});
    let answer = h.post("/v1/completions", &[], &value).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let body = answer.text().into_bytes();
    let sse = format!("data: {{\"choices\":[]}}\n\ndata: {}\n\ndata: [DONE]\n\n", answer.text());
    for _ in 0..2 {
        let (usage, n) = allocations(|| find_usage(&body, false));
        assert!(usage.is_some_and(|u| u.prompt_tokens.is_some()), "{}", answer.text());
        assert_eq!(n, 1, "allocations reading a body's usage: {}", answer.text());
        let (usage, n) = allocations(|| find_usage(sse.as_bytes(), true));
        assert!(usage.is_some(), "{sse}");
        assert_eq!(n, 1, "allocations reading a stream's usage");
    }
    let (_, tree) = allocations(|| serde_json::from_slice::<serde_json::Value>(&body).map(drop));
    assert!(tree > 5, "a Value of the body allocates ({tree}): the comparison above means something");
    h.shutdown().await;
}
