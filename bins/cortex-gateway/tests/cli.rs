//! The binary as users start it: flags are validated before anything starts, and the demo serves
//! with the runtime size a flag asks for (port 0, the bound address read from the banner; the
//! child is killed at the end, whatever happens).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test fails loudly

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_cortex-gateway");

/// Kills the child when dropped, so a failing assertion never leaves a gateway running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn zero_worker_threads_is_refused_with_the_flag_named() {
    let out = Command::new(BIN).args(["--demo", "--worker-threads", "0"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--worker-threads"), "{err}");
}

#[test]
fn demo_serves_on_one_runtime_thread() {
    let child = Command::new(BIN)
        .args([
            "--demo",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--sim-speed",
            "0",
            "--worker-threads",
            "1",
        ])
        .args(["--workers-per-engine", "1", "--log", "warn"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let stdout = running.0.stdout.take().unwrap();
    let mut addr = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("Cortex gateway listening on http://") {
            addr = Some(rest.trim().to_owned());
            break;
        }
    }
    let addr = addr.expect("the demo prints its address");
    let deadline = Instant::now() + Duration::from_secs(30);
    let response = loop {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET /health/live HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        if r.starts_with("HTTP/1.1 200") || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
}

/// `--check-config` prints its summary, and only its summary, on stdout (deployment checks parse
/// it), even at a log level that logs while loading (the tokenizer's choice of encoder).
#[test]
fn check_config_prints_one_json_line_on_stdout() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let qwen = root.join("golden/models/qwen3");
    let dir = std::env::temp_dir().join(format!("cortex-check-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cortex.yaml");
    std::fs::write(
        &file,
        format!(
            "listen: 127.0.0.1:0\nmodels:\n  - name: m\n    engine: vllm\n    tokenizer: {}\n    \
             tokenizer_config: {}\n    block_size: 16\nworkers:\n  - name: w\n    url: http://127.0.0.1:9\n    \
             engine: vllm\n    model: m\n",
            qwen.join("tokenizer.json").display(),
            qwen.join("tokenizer_config.json").display()
        ),
    )
    .unwrap();
    let out = Command::new(BIN).args(["--log", "debug", "--check-config"]).arg(&file).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let summary: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(summary["workers"], 1, "{summary}");
}

/// `--demo --pd` works as printed: the banner's request, sent as its curl sends it, is served by
/// a prefill and a decode worker, and the headers it greps show both.
#[test]
fn the_pd_demo_serves_its_printed_request_disaggregated() {
    let child = Command::new(BIN)
        .args([
            "--demo",
            "--pd",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--sim-speed",
            "0",
            "--workers-per-engine",
            "1",
        ])
        .args(["--log", "warn"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let stdout = running.0.stdout.take().unwrap();
    let (mut addr, mut body) = (None, None);
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("Cortex gateway listening on http://") {
            addr = Some(rest.trim().to_owned());
        }
        if let Some(rest) = line.trim().strip_prefix("-d '") {
            body = rest.split_once("' |").map(|(b, _)| b.to_owned());
            break;
        }
    }
    let (addr, body) = (addr.expect("the demo prints its address"), body.expect("the demo prints a curl"));
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let lower = r.to_ascii_lowercase();
    assert!(lower.contains("x-cortex-pd: disaggregated"), "{r}");
    assert!(lower.contains("x-cortex-prefill-worker: sim-vllm-prefill-0"), "{r}");
    assert!(lower.contains("x-cortex-assigned-worker: sim-vllm-decode-0"), "{r}");
}

/// A gateway started from a configuration file with a JSON access log and no worker (every
/// generation request answers 503 at once), its stdout and stderr piped; `args` before
/// `--config`. Returns it, its address (from the start-up log line on stderr, which is then no
/// longer read) and the directory of its file.
fn json_access_gateway(args: &[&str]) -> (Running, String, std::path::PathBuf) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let qwen = root.join("golden/models/qwen3");
    let dir = std::env::temp_dir().join(format!("cortex-access-log-{}-{}", std::process::id(), args.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cortex.yaml");
    std::fs::write(
        &file,
        format!(
            "listen: 127.0.0.1:0\nmodels:\n  - name: m\n    engine: vllm\n    tokenizer: {}\n    \
             tokenizer_config: {}\n    block_size: 16\nworkers: []\naccess_log: {{format: json}}\n",
            qwen.join("tokenizer.json").display(),
            qwen.join("tokenizer_config.json").display()
        ),
    )
    .unwrap();
    let child = Command::new(BIN)
        .args(args)
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let stderr = running.0.stderr.take().unwrap();
    let mut reader = BufReader::new(stderr);
    let mut addr = None;
    let mut line = String::new();
    while {
        line.clear();
        reader.read_line(&mut line).unwrap() > 0
    } {
        if line.contains("cortex-gateway serving") {
            let at = line.find("127.0.0.1:").expect("the address is logged");
            let port: String = line[at + 10..].chars().take_while(char::is_ascii_digit).collect();
            addr = Some(format!("127.0.0.1:{port}"));
            break;
        }
    }
    // Kept open, never read again.
    running.0.stderr = Some(reader.into_inner());
    (running, addr.expect("the gateway logs its address"), dir)
}

/// One request on its own connection; the whole response.
fn send(addr: &str, head: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{head}\r\nhost: {addr}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
        .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r
}

/// With `access_log: {format: json}` every generation request gets one JSON line on stdout, even
/// when `--log` turns the access target off (the other logs stay on stderr).
#[test]
fn the_json_access_log_goes_to_stdout_whatever_log_says() {
    let (mut running, addr, dir) = json_access_gateway(&["--log", "info,cortex::access=off"]);
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1}"#;
    let r = send(
        &addr,
        "POST /v1/completions HTTP/1.1\r\nx-request-id: cli-access-1\r\ncontent-type: application/json",
        body,
    );
    assert!(r.starts_with("HTTP/1.1 503"), "no worker: {r}");
    let stdout = running.0.stdout.take().unwrap();
    let line = BufReader::new(stdout).lines().next().expect("an access line").unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: `{line}`"));
    assert_eq!(v["request_id"], "cli-access-1", "{v}");
    assert_eq!(v["model"], "m", "{v}");
    assert_eq!(v["route"], "completions", "{v}");
    assert_eq!(v["status"], 503, "{v}");
    assert_eq!(v["outcome"], "error", "{v}");
}

/// A log reader that stops reading costs log lines, not requests: with stdout (the JSON access
/// log) and stderr never read past start-up, far more requests than a pipe's 64 KiB of access
/// lines are all answered, and the lines dropped are counted.
#[test]
fn a_log_reader_that_stops_reading_never_stalls_requests() {
    let (running, addr, dir) = json_access_gateway(&["--log", "info", "--log-buffer-bytes", "4096"]);
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1}"#;
    let head = "POST /v1/completions HTTP/1.1\r\ncontent-type: application/json";
    // Each access line is about 300 bytes: 1,000 of them are 4.5 pipes' worth.
    for i in 0..1000 {
        let r = send(&addr, head, body);
        assert!(r.starts_with("HTTP/1.1 503"), "request {i}: {r}");
    }
    let metrics = send(&addr, "GET /metrics HTTP/1.1", "");
    let _ = std::fs::remove_dir_all(&dir);
    let dropped: f64 = metrics
        .lines()
        .find(|l| l.starts_with("cortex_log_lines_dropped_total{stream=\"stdout\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no dropped-lines series for stdout: {metrics}"));
    assert!(dropped >= 500.0, "dropped {dropped}");
    drop(running);
}
