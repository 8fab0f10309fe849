//! The binary: `--help` documents roles and faults, and `--workers 4` starts four workers whose
//! printed addresses answer, then stops on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_cortex-sim");

#[test]
fn help_documents_flags_roles_and_faults() {
    let out = Command::new(BIN).arg("--help").output().expect("run --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--engine",
        "--workers",
        "--prefill-workers",
        "--decode-workers",
        "--dp-size",
        "--event-port-base",
        "--topic",
        "--no-replay",
        "--block-size",
        "--capacity-blocks",
        "--tokenizer-dir",
        "--chat-template",
        "--lora",
        "--vllm-version",
        "--sglang-format",
        "--eagle",
        "--speed",
        "--itl",
        "--bootstrap-timeout",
        "--kv-lease",
        "bootstrap_room",
        "do_remote_decode",
        "POST /sim/fault",
        "fail_next",
        "stall",
        "die_mid_stream",
        "drop_batches",
        "restart_publisher",
        "flush_cache",
        "GET /sim/state",
    ] {
        assert!(help.contains(needle), "--help does not mention {needle}");
    }
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn four_workers_start_print_their_ports_and_stop_on_sigterm() {
    let mut child = Command::new(BIN)
        .args(["--engine", "vllm", "--workers", "4", "--dp-size", "2", "--speed", "0", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut workers = Vec::new();
    for _ in 0..4 {
        let line = lines.next().expect("a line per worker").expect("utf-8");
        workers.push(serde_json::from_str::<serde_json::Value>(&line).expect("JSON"));
    }
    for (i, w) in workers.iter().enumerate() {
        assert_eq!(w["worker"], i);
        assert_eq!(w["engine"], "vllm");
        let ranks = w["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 2);
        let port = |r: &serde_json::Value| -> u16 {
            r["publish"]
                .as_str()
                .and_then(|p| p.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("port")
        };
        assert_eq!(port(&ranks[1]), port(&ranks[0]) + 1, "rank r on base + r");
        let http = w["http"].as_str().expect("http").trim_start_matches("http://").to_owned();
        let sources = http_get(&http, "/kv_event_sources");
        assert!(sources.starts_with("HTTP/1.1 200"), "{sources}");
        assert!(sources.contains(&format!("tcp://*:{}", port(&ranks[0]))), "{sources}");
    }
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let exit = child.wait().expect("wait");
    assert!(exit.success(), "{exit:?}");
}
