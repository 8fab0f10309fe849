//! A worker stops everything it started: after `shutdown` (or drop) the process has the threads
//! it had before, and the ports are free again. A separate test binary, because it counts the
//! process's threads.

use std::time::{Duration, Instant};

use cortex_sim::{Role, SimConfig, SimWorker};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

#[test]
fn shutdown_and_drop_leave_no_threads_or_sockets_behind() {
    // Load the shared model first: its one-time cost is not the worker's.
    cortex_sim::SimModel::qwen3().expect("model");
    let before = threads();
    let mut cfg = SimConfig::sglang();
    cfg.dp_size = 2;
    cfg.role = Role::Prefill;
    let w = SimWorker::start(cfg).expect("worker");
    assert!(threads() > before);
    let http = w.http_addr();
    let eps = w.event_endpoints();
    let boot = w.bootstrap_addr().expect("bootstrap");
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).expect("SUB");
    s.connect(&format!("tcp://{}", eps[0].publish)).expect("connect");
    s.set_subscribe(b"").expect("subscribe");
    w.wait_subscribed(0, Duration::from_secs(20)).expect("subscribed");
    drop(s);
    drop(ctx);
    w.shutdown();
    // libzmq's context threads end when the last socket closes; give them a bounded moment.
    let deadline = Instant::now() + Duration::from_secs(20);
    while threads() != before {
        assert!(Instant::now() < deadline, "threads left: {} before, {} after", before, threads());
        std::thread::sleep(Duration::from_millis(5));
    }
    for addr in [http, boot] {
        std::net::TcpListener::bind(addr).expect("the listener's port is free again");
    }
    for e in eps {
        std::net::TcpListener::bind(e.publish).expect("the PUB port is free again");
    }
    // Drop without shutdown does the same.
    let w = SimWorker::start(SimConfig::vllm()).expect("worker");
    drop(w);
    let deadline = Instant::now() + Duration::from_secs(20);
    while threads() != before {
        assert!(Instant::now() < deadline, "threads left after drop");
        std::thread::sleep(Duration::from_millis(5));
    }
}
