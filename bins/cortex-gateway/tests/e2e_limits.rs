//! End to end, the gateway's resource limits: admission (a full queue, a wait that lasts too
//! long) and a client that leaves mid-stream, against simulated workers on loopback. Slots are
//! held by requests a stalled or real-time simulated worker keeps open; waits poll observable
//! state under deadlines.

#![allow(clippy::unwrap_used, clippy::print_stdout)] // test helpers: a failed setup step should panic

mod common;

use std::time::{Duration, Instant};

use common::{MODEL, harness, sim, slow_sim, worker_entry};
use http::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const QUEUE_TIMEOUT: Duration = Duration::from_millis(500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_a_wait_past_the_queue_timeout_503() {
    let limits = format!(
        "{{max_body: 65536, max_concurrent: 1, max_queue: 1, queue_timeout: {}ms}}",
        QUEUE_TIMEOUT.as_millis()
    );
    let h = harness("sglang", vec![sim("sglang")], &[("limits", &limits)]).await;
    let body = |p: &str| json!({"model": MODEL, "prompt": p, "max_tokens": 2});
    // The only slot is held by a request the stalled worker keeps waiting.
    h.sims[0].stall();
    let holder = tokio::spawn({
        let (gw, b) = (h.caller(), body("hold the slot"));
        async move { gw.post("/v1/completions", &b).await }
    });
    h.wait("the slot's request reached the worker", || h.sims[0].in_flight(0).unwrap_or(0) > 0).await;
    // Two more: one takes the only place in the queue and waits there until the timeout, the
    // other finds the queue full and is refused. Which is which depends on arrival; the error
    // codes say which path each took (no timing is asserted).
    let (b1, b2) = (body("queued or refused, 1"), body("queued or refused, 2"));
    let (a, b) = tokio::join!(h.post("/v1/completions", &b1), h.post("/v1/completions", &b2));
    let (refused, queued) = if a.status == StatusCode::TOO_MANY_REQUESTS { (a, b) } else { (b, a) };
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", refused.body);
    assert_eq!(refused.error_code(), "gateway_overloaded", "{}", refused.body);
    assert_eq!(queued.status, StatusCode::SERVICE_UNAVAILABLE, "{}", queued.body);
    assert_eq!(queued.error_code(), "queue_timeout", "{}", queued.body);
    for r in [&refused, &queued] {
        assert!(!r.header("x-request-id").is_empty(), "gateway errors carry x-request-id");
    }
    // Nothing refused reached the worker.
    assert_eq!(h.sims[0].in_flight(0).unwrap(), 1);
    // The slot's request finishes once the worker resumes, and frees the slot.
    h.sims[0].resume();
    let held = holder.await.unwrap();
    assert_eq!(held.status, StatusCode::OK, "{}", held.body);
    let after = h.post("/v1/completions", &body("after")).await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.body);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_cancels_the_upstream_request() {
    let h = harness("vllm", vec![slow_sim("vllm")], &[]).await;
    // 2000 tokens at 20 ms: the stream would run for 40 s if nobody cancelled it.
    let body = json!({"model": MODEL, "prompt": "a very long answer", "max_tokens": 2000, "stream": true})
        .to_string();
    let mut conn = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        h.addr(),
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    // Read until the first tokens arrive.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = tokio::time::timeout(common::WAIT, conn.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "the gateway closed the stream: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&seen));
    assert_eq!(h.sims[0].in_flight(0).unwrap(), 1);
    let booked = |dbg: &serde_json::Value| worker_entry(dbg, "w0")["ranks"][0]["booked_requests"].clone();
    assert_eq!(booked(&h.debug_workers().await), 1);
    // The client leaves: the gateway drops its upstream request, and the worker stops it.
    drop(conn);
    // Deadlines well inside the 40 s the whole stream would take.
    h.wait_within("the worker dropped the request", Duration::from_secs(20), || {
        h.sims[0].in_flight(0).unwrap_or(1) == 0
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while booked(&h.debug_workers().await) != 0 {
        assert!(Instant::now() < deadline, "the gateway's booking was never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_does_not_wait_for_a_connection_that_sent_nothing() {
    // A silent connection could hold shutdown for the whole grace period (60 s here); finishing
    // well inside the deadline below shows it does not. No timing is measured.
    let limits = "{max_body: 65536, header_read_timeout: 120s}";
    let h = harness("vllm", vec![sim("vllm")], &[("limits", limits), ("shutdown_grace", "60s")]).await;
    // A client connects and sends nothing (a spare pooled connection, a TCP health check).
    let silent = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    // A request on a later connection: once it is answered, the silent one was accepted too.
    assert_eq!(h.send("GET", "/health/live", bytes::Bytes::new()).await.status, StatusCode::OK);
    // Nothing is in flight: shutdown has nothing to wait for.
    let common::Harness { sims, gw, client, .. } = h;
    drop(client);
    tokio::time::timeout(Duration::from_secs(20), gw.shutdown())
        .await
        .expect("shutdown waited for a connection that sent nothing");
    drop((silent, sims));
}
