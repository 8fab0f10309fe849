//! The processes under soak: `cortex-sim` workers, one process each so that one can be killed
//! with SIGKILL and started again on the same ports, and the `cortex-gateway` binary.
//!
//! Key decision: every listener is bound by its own process on port 0 and reported back (the
//! simulator's `--json` line), never guessed; a restart passes the reported ports explicitly.
//! Every process is an `xtask::net::Proc`, killed and reaped when dropped, so an error or an
//! interrupted soak leaves nothing behind.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use xtask::net::{Proc, http, wait_ready};

/// How long a simulator may take to print its addresses.
const BANNER: Duration = Duration::from_secs(30);

/// One simulated worker in its own process.
pub struct Sim {
    /// Its name in the gateway's configuration (`w0`, …).
    pub name: String,
    /// `vllm` or `sglang`.
    pub engine: &'static str,
    /// Its HTTP listener.
    pub http: SocketAddr,
    /// Its first event port (rank 0's PUB; the replay ROUTER follows).
    event_base: u16,
    /// The command line without ports.
    args: Vec<String>,
    bin: PathBuf,
    log: PathBuf,
    proc: Proc,
}

impl Sim {
    /// Starts worker `name` of `engine` serving `model` with `args` appended, on free ports.
    ///
    /// # Errors
    /// It does not start or prints no address.
    pub fn start(
        bin: &Path,
        name: &str,
        engine: &'static str,
        model: &str,
        args: &[String],
        dir: &Path,
    ) -> Result<Sim> {
        let mut all = vec![
            "--engine".into(),
            engine.into(),
            "--workers".into(),
            "1".into(),
            "--model".into(),
            model.into(),
        ];
        all.extend_from_slice(args);
        let log = dir.join(format!("sim-{name}.log"));
        let (proc, http, event_base) = spawn(bin, name, &all, None, &log)?;
        Ok(Sim {
            name: name.to_owned(),
            engine,
            http,
            event_base,
            args: all,
            bin: bin.to_path_buf(),
            log,
            proc,
        })
    }

    /// `kill -9`, reaped.
    pub fn kill(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }

    /// Starts it again on the same ports and waits for its health route; a port still held by
    /// the dead process's sockets is retried for a few seconds.
    ///
    /// # Errors
    /// It does not come back.
    pub fn restart(&mut self) -> Result<()> {
        let ports = Some((self.http.port(), self.event_base));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match spawn(&self.bin, &self.name, &self.args, ports, &self.log) {
                Ok((proc, http, base)) => {
                    self.proc = proc;
                    (self.http, self.event_base) = (http, base);
                    return wait_ready(self.http, "/health", &mut self.proc);
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                // A poll interval: the kernel frees the dead process's ports on its own time.
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// `POST /sim/fault` with `fault`.
    ///
    /// # Errors
    /// The worker does not take it.
    pub fn fault(&self, fault: &Value) -> Result<()> {
        let a = http(self.http, "POST", "/sim/fault", Some(fault))?;
        if a.status != 200 {
            bail!("{}: fault {fault} refused: {} {}", self.name, a.status, a.text());
        }
        Ok(())
    }

    /// Drop the next `count` event batches (a sequence gap).
    ///
    /// # Errors
    /// As [`Sim::fault`].
    pub fn drop_batches(&self, count: u64) -> Result<()> {
        self.fault(&json!({"drop_batches": {"rank": 0, "count": count}}))
    }

    /// Answer replay requests or not.
    ///
    /// # Errors
    /// As [`Sim::fault`].
    pub fn replay(&self, enabled: bool) -> Result<()> {
        self.fault(&json!({"replay": {"rank": 0, "enabled": enabled}}))
    }

    /// Restart the event publisher (sequence back to 0, nothing announced).
    ///
    /// # Errors
    /// As [`Sim::fault`].
    pub fn restart_publisher(&self) -> Result<()> {
        self.fault(&json!({"restart_publisher": {"rank": 0}}))
    }
}

/// Spawns the simulator with `args` (and `ports`: HTTP and event base) and reads its `--json`
/// line: its process, HTTP address and first event port.
fn spawn(
    bin: &Path,
    name: &str,
    args: &[String],
    ports: Option<(u16, u16)>,
    log: &Path,
) -> Result<(Proc, SocketAddr, u16)> {
    let mut cmd = Command::new(bin);
    cmd.args(args).arg("--json");
    if let Some((http, events)) = ports {
        cmd.args(["--http-port", &http.to_string(), "--event-port-base", &events.to_string()]);
    }
    let err = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("the simulator's stdout")?;
    let mut proc = Proc { name: format!("simulated worker {name}"), child, log: Some(log.to_path_buf()) };
    let (tx, rx) = std::sync::mpsc::channel();
    // Reads the address line, then keeps draining so the worker never blocks on its stdout.
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
        if let Some(first) = lines.next() {
            let _ = tx.send(first);
        }
        lines.for_each(drop);
    });
    let Ok(line) = rx.recv_timeout(BANNER) else {
        let status = proc.child.try_wait().ok().flatten();
        bail!("{} printed no address ({status:?})\n{}", proc.name, proc.tail());
    };
    let v: Value = serde_json::from_str(&line).with_context(|| format!("{}: `{line}`", proc.name))?;
    let http: SocketAddr = v["http"]
        .as_str()
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("{}: no http address in `{line}`", proc.name))?;
    let base = v["ranks"][0]["publish"]
        .as_str()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{}: no event port in `{line}`", proc.name))?;
    if ports.is_none() {
        wait_ready(http, "/health", &mut proc)?;
    }
    Ok((proc, http, base))
}

/// The gateway binary with `config`, its log in `log`, once `/health/ready` answers.
///
/// # Errors
/// It does not start or become ready.
pub fn start_gateway(bin: &Path, config: &Path, public: SocketAddr, log: &Path) -> Result<Proc> {
    let child = Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(["--log", "warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).context("creating the gateway's log")?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut proc = Proc { name: "cortex-gateway".to_owned(), child, log: Some(log.to_path_buf()) };
    wait_ready(public, "/health/ready", &mut proc)?;
    Ok(proc)
}

/// The resident set of process `pid` (`VmRSS` of `/proc/PID/status`), bytes.
#[must_use]
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
