//! `cargo xtask pd-check`: the simulator's PD workers checked by the engines' own proxies —
//! vLLM's `toy_proxy_server.py` (vendored in `xtask/assets/vllm/`) and SGLang's `mini_lb`
//! (`sglang-router==0.3.2` from PyPI) — for chat, completions and (SGLang) `/generate`,
//! streaming and not.
//!
//! Key decisions:
//! - **Foreign clients, real processes.** The simulator runs as its binary, the proxies as the
//!   engines ship them, each on a loopback port; nothing of Cortex sits between them. Where a
//!   proxy fails, the simulator is wrong.
//! - **Checked on both sides.** Each answer must have the engine's shape (an OpenAI body or an SSE
//!   stream ending in `[DONE]`), and the workers' own counters (`/sim/state`) must show that the
//!   request went through both legs: one more prefill leg on the prefill worker, one more decode
//!   leg with pulled tokens on the decode worker.
//! - **Python in a venv under the target directory**, created once and reused (a marker file
//!   names what was installed); an install that fails stops the check with pip's output. Waits
//!   are on observable state (the simulator's printed addresses, a proxy's health endpoint),
//!   each with a deadline; every process started is stopped, whatever happens.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::net::{Answer, Proc, STARTUP, free_port, http, wait_ready};

/// The simulator's package and the arguments before its own (the one place to change if the
/// package is renamed).
const SIM: &[&str] = &["run", "--quiet", "-p", "cortex-sim-bin", "--bin", "cortex-sim", "--"];

/// What the venv gets from PyPI.
/// What the venv gets from PyPI, pinned so that a fresh machine checks what this one did.
const REQUIREMENTS: &[&str] =
    &["fastapi==0.165.0", "uvicorn==0.54.0", "httpx==0.28.1", "sglang-router==0.3.2"];

/// `cargo xtask pd-check` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The Python that creates the venv.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Only this engine (`vllm` or `sglang`); both by default.
    #[arg(long)]
    pub engine: Option<String>,
    /// The simulator's executable, already built (CI passes the test build's); without it the
    /// simulator is built and run with `cargo run`.
    #[arg(long)]
    pub sim: Option<PathBuf>,
}

/// A simulated worker as the simulator binary printed it.
#[derive(Debug)]
struct Worker {
    http: SocketAddr,
    bootstrap: Option<SocketAddr>,
}

fn addr_of(url: &str) -> Result<SocketAddr> {
    url.trim_start_matches("http://").parse().with_context(|| format!("bad address `{url}`"))
}

/// Starts one prefill and one decode worker of `engine`; returns them once both are printed.
fn start_sim(root: &Path, sim: Option<&Path>, engine: &str, logs: &Path) -> Result<(Proc, Worker, Worker)> {
    let log = logs.join(format!("sim-{engine}.log"));
    let mut cmd = match sim {
        Some(exe) => Command::new(exe),
        None => {
            let mut c = Command::new(crate::cargo());
            c.args(SIM);
            c
        }
    };
    let mut child = cmd
        .args([
            "--engine",
            engine,
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--speed",
            "0",
            "--json",
        ])
        .args(["--host", "127.0.0.1"])
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).context("creating the simulator's log")?)
        .spawn()
        .context("starting the simulator")?;
    let stdout: ChildStdout = child.stdout.take().context("the simulator's stdout")?;
    let proc = Proc { name: format!("cortex-sim ({engine})"), child, log: Some(log) };
    // Reading blocks until the binary (built first, if needed) prints its workers; the lines are
    // read on a thread so that a simulator that never prints fails the deadline, not the check.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for _ in 0..2 {
            let line = lines.next();
            let done = !matches!(line, Some(Ok(_)));
            if tx.send(line).is_err() || done {
                return;
            }
        }
        // Keep draining so the simulator never blocks on a full pipe.
        for _ in lines {}
    });
    let deadline = STARTUP * 10; // the first run builds the simulator
    let mut workers = Vec::new();
    for _ in 0..2 {
        let line = match rx.recv_timeout(deadline) {
            Ok(Some(Ok(l))) => l,
            Ok(other) => {
                bail!("the simulator stopped before printing its workers ({other:?})\n{}", proc.tail())
            }
            Err(_) => bail!("the simulator printed no workers within {deadline:?}\n{}", proc.tail()),
        };
        let v: Value =
            serde_json::from_str(&line).with_context(|| format!("the simulator printed `{line}`"))?;
        let http = addr_of(v["http"].as_str().context("no http address")?)?;
        let bootstrap = v["bootstrap"].as_str().map(addr_of).transpose()?;
        workers.push((v["role"].as_str().unwrap_or_default().to_owned(), Worker { http, bootstrap }));
    }
    let take = |role: &str, ws: &mut Vec<(String, Worker)>| -> Result<Worker> {
        let i = ws.iter().position(|(r, _)| r == role).with_context(|| format!("no {role} worker"))?;
        Ok(ws.remove(i).1)
    };
    let p = take("prefill", &mut workers)?;
    let d = take("decode", &mut workers)?;
    Ok((proc, p, d))
}

/// The prefill and decode counters of a worker's rank 0.
fn legs(w: &Worker) -> Result<(u64, u64, u64)> {
    let a = http(w.http, "GET", "/sim/state", None)?;
    ensure!(a.status == 200, "/sim/state answered {}", a.status);
    let v: Value = serde_json::from_slice(&a.body).context("/sim/state")?;
    let pd = &v["ranks"][0]["pd"];
    let n = |k: &str| pd[k].as_u64().with_context(|| format!("/sim/state has no ranks[0].pd.{k}"));
    Ok((n("prefill_legs")?, n("decode_legs")?, n("pulled_tokens")?))
}

/// One request the proxy must complete, and what its answer must hold.
struct Case {
    path: &'static str,
    body: Value,
    stream: bool,
}

fn cases(engine: &str) -> Vec<Case> {
    let chat = json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "Tell me about prefill and decode."}], "max_tokens": 6});
    let completion = json!({"model": "Qwen/Qwen3-0.6B", "prompt": "Disaggregated serving splits prefill from decode", "max_tokens": 6});
    let generate = json!({"text": "Disaggregated serving splits prefill from decode", "sampling_params": {"max_new_tokens": 6}});
    let mut out = Vec::new();
    let mut both = |path, body: &Value| {
        out.push(Case { path, body: body.clone(), stream: false });
        let mut s = body.clone();
        s["stream"] = json!(true);
        if path != "/generate" {
            s["stream_options"] = json!({"include_usage": true});
        }
        out.push(Case { path, body: s, stream: true });
    };
    both("/v1/chat/completions", &chat);
    both("/v1/completions", &completion);
    if engine == "sglang" {
        both("/generate", &generate);
    }
    out
}

/// The answer's generated text, checked for the engine's shape.
fn answer_text(case: &Case, a: &Answer) -> Result<String> {
    ensure!(a.status == 200, "status {}: {}", a.status, a.text());
    let piece = |v: &Value| -> Option<String> {
        if case.path == "/generate" {
            return v["text"].as_str().map(str::to_owned);
        }
        let c = &v["choices"][0];
        c["message"]["content"]
            .as_str()
            .or_else(|| c["delta"]["content"].as_str())
            .or_else(|| c["text"].as_str())
            .map(str::to_owned)
    };
    if !case.stream {
        let v: Value = serde_json::from_slice(&a.body).with_context(|| format!("not JSON: {}", a.text()))?;
        ensure!(v.get("error").is_none(), "an error body: {v}");
        return piece(&v).with_context(|| format!("no generated text in {v}"));
    }
    let text = a.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim))
        .collect();
    ensure!(events.last() == Some(&"[DONE]"), "the stream does not end with [DONE]: {text}");
    let mut out = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).with_context(|| format!("an event is not JSON: {e}"))?;
        ensure!(v.get("error").is_none(), "an error event: {v}");
        if let Some(p) = piece(&v) {
            // SGLang's /generate streams the whole text so far in each event.
            if case.path == "/generate" { out = p } else { out.push_str(&p) }
        }
    }
    ensure!(!out.is_empty(), "the stream generated nothing: {text}");
    Ok(out)
}

/// Runs every case of `engine` through its foreign proxy.
fn check_engine(root: &Path, sim: Option<&Path>, py: &Path, engine: &str, logs: &Path) -> Result<usize> {
    let (_sim, p, d) = start_sim(root, sim, engine, logs)?;
    let port = free_port()?;
    let log = logs.join(format!("proxy-{engine}.log"));
    let mut cmd = Command::new(py);
    let health = if engine == "vllm" {
        cmd.arg(root.join("xtask/assets/vllm/toy_proxy_server.py"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", &p.http.port().to_string()])
            .args(["--decoder-hosts", "127.0.0.1", "--decoder-ports", &d.http.port().to_string()]);
        "/healthcheck"
    } else {
        let boot = p.bootstrap.context("the SGLang prefill worker printed no bootstrap address")?;
        cmd.args(["-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb"])
            .args(["--prefill", &format!("http://{}", p.http), &boot.port().to_string()])
            .args(["--decode", &format!("http://{}", d.http)])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        "/health"
    };
    let out = std::fs::File::create(&log).context("creating the proxy's log")?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {engine}'s proxy"))?;
    let name = if engine == "vllm" { "vLLM toy_proxy_server.py" } else { "SGLang mini_lb" };
    let mut proxy = Proc { name: name.to_owned(), child, log: Some(log) };
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    wait_ready(addr, health, &mut proxy)?;
    let cases = cases(engine);
    for case in &cases {
        let what = format!("{engine} {} ({})", case.path, if case.stream { "stream" } else { "no stream" });
        let (p0, d0) = (legs(&p)?, legs(&d)?);
        let a = http(addr, "POST", case.path, Some(&case.body)).with_context(|| what.clone())?;
        let text = answer_text(case, &a).with_context(|| format!("{what}\n{}", proxy.tail()))?;
        let (p1, d1) = (legs(&p)?, legs(&d)?);
        ensure!(p1.0 == p0.0 + 1, "{what}: the prefill worker served {} prefill legs, not 1", p1.0 - p0.0);
        ensure!(d1.1 == d0.1 + 1, "{what}: the decode worker served {} decode legs, not 1", d1.1 - d0.1);
        ensure!(d1.2 > d0.2, "{what}: the decode worker pulled no tokens");
        crate_print(&format!("  ok  {what}: {text:?} (decode pulled {} tokens)", d1.2 - d0.2));
    }
    Ok(cases.len())
}

#[allow(clippy::print_stdout, reason = "the check's progress is this command's output")]
fn crate_print(s: &str) {
    println!("{s}");
}

/// Runs the check.
///
/// # Errors
/// The first thing that fails: the venv, a process that does not come up, a request a proxy
/// does not complete, an answer of the wrong shape, or counters that show a leg missing.
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let start = Instant::now();
    let target = crate::target_dir(root);
    let logs = target.join("pd-check");
    std::fs::create_dir_all(&logs).context("creating target/pd-check")?;
    let (py, installed) = crate::python_venv(&args.python, &target.join("pd-check-venv"), REQUIREMENTS)?;
    match installed {
        Some(t) => crate_print(&format!(
            "pd-check: venv created and {} installed in {:.1}s",
            REQUIREMENTS.join(", "),
            t.as_secs_f64()
        )),
        None => crate_print("pd-check: venv already there"),
    }
    let engines: Vec<&str> = match args.engine.as_deref() {
        None => vec!["vllm", "sglang"],
        Some(e @ ("vllm" | "sglang")) => vec![e],
        Some(other) => bail!("unknown engine `{other}` (vllm or sglang)"),
    };
    let checked = Instant::now();
    let mut n = 0;
    for e in engines {
        n += check_engine(root, args.sim.as_deref(), &py, e, &logs)?;
    }
    crate_print(&format!(
        "pd-check: {n} requests passed through the engines' proxies in {:.1}s ({:.1}s in all)",
        checked.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_checked_for_the_engines_shapes() {
        let cases = cases("sglang");
        assert_eq!(cases.len(), 6);
        let ok = |case: &Case, body: &str| {
            answer_text(case, &Answer { status: 200, headers: Vec::new(), body: body.as_bytes().to_vec() })
        };
        let chat = &cases[0];
        assert_eq!(ok(chat, r#"{"choices":[{"message":{"content":"hi"}}]}"#).unwrap(), "hi");
        assert!(ok(chat, r#"{"error":{"message":"x"}}"#).is_err());
        assert!(ok(chat, r#"{"choices":[]}"#).is_err());
        let stream = &cases[1];
        let good = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(ok(stream, good).unwrap(), "ab");
        assert!(
            ok(stream, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n").is_err(),
            "no [DONE]"
        );
        assert!(ok(stream, "data: {\"error\":{\"code\":500}}\n\ndata: [DONE]\n\n").is_err());
        let generate = &cases[5];
        assert_eq!(
            ok(generate, "data: {\"text\":\"a\"}\n\ndata: {\"text\":\"ab\"}\n\ndata: [DONE]\n\n").unwrap(),
            "ab"
        );
        let a = Answer { status: 502, headers: Vec::new(), body: Vec::new() };
        assert!(answer_text(chat, &a).is_err());
    }
}
