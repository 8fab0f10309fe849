//! Small blocking helpers the checks that run real processes share: a child process killed
//! when dropped, a free loopback port, one HTTP/1.1 request read to its end, and a wait for a
//! process's endpoint to answer, and the `--demo` gateway with its admin listener and token.
//!
//! Key decision: a dozen lines of HTTP/1.1 over `TcpStream` (`Connection: close`, chunked bodies
//! decoded) instead of an HTTP client crate, so that xtask stays small and quick to build.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

/// How long a process may take to show it is up.
pub const STARTUP: Duration = Duration::from_secs(60);

/// How long one request through a proxy may take.
pub const REQUEST: Duration = Duration::from_secs(30);

/// A child process that is killed and reaped when dropped.
pub struct Proc {
    /// What it is, for messages.
    pub name: String,
    /// The process.
    pub child: Child,
    /// Where its output goes, if to a file.
    pub log: Option<PathBuf>,
}

impl Proc {
    /// The last lines of its log.
    #[must_use]
    pub fn tail(&self) -> String {
        let Some(log) = &self.log else { return String::new() };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(30);
        format!("--- last lines of {} ({}) ---\n{}", self.name, log.display(), lines[from..].join("\n"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free on loopback now.
///
/// # Errors
/// No port can be bound.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").context("binding a free port")?.local_addr()?.port())
}

/// An HTTP/1.1 answer.
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The headers, in order.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as text.
    #[must_use]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header's value.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").context("chunk size line")?;
        let size_line = std::str::from_utf8(&b[..nl])?;
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("chunk size `{size_line}`"))?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        ensure!(b.len() >= size + 2, "a chunk is cut short");
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// One request, `Connection: close`, read to its end.
///
/// # Errors
/// The connection fails, times out, or the answer is not HTTP/1.1.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Result<Answer> {
    request(addr, method, path, body, None)
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    token: Option<&str>,
) -> Result<Answer> {
    let mut s =
        TcpStream::connect_timeout(&addr, REQUEST).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(REQUEST))?;
    let payload = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n",
        payload.len(),
        token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(payload.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).with_context(|| format!("reading {method} {path} from {addr}"))?;
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no response head")?;
    let head = std::str::from_utf8(&raw[..end]).context("response head")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .context("status line")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())))
        .collect();
    let mut a = Answer { status, headers, body: raw[end + 4..].to_vec() };
    if a.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        a.body = dechunk(&a.body)?;
    }
    Ok(a)
}

/// Polls `GET path` on `addr` until it answers 200, while `proc` runs, for [`STARTUP`].
///
/// # Errors
/// The process exited or the deadline passed (with the end of its log).
pub fn wait_ready(addr: SocketAddr, path: &str, proc: &mut Proc) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Ok(a) = http(addr, "GET", path, None)
            && a.status == 200
        {
            return Ok(());
        }
        if let Some(status) = proc.child.try_wait()? {
            bail!("{} exited ({status}) before answering {path}\n{}", proc.name, proc.tail());
        }
        ensure!(
            start.elapsed() < STARTUP,
            "{} did not answer {path} within {STARTUP:?}\n{}",
            proc.name,
            proc.tail()
        );
        // A poll interval, not a wait for readiness: readiness is the 200 above.
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A `--demo` gateway with an admin listener: its process, both listeners and the admin token
/// its banner printed.
pub struct DemoGateway {
    /// Killed when dropped.
    pub proc: Proc,
    /// The public listener.
    pub public: SocketAddr,
    /// The admin listener (`/debug/*`, the admin API).
    pub admin: SocketAddr,
    /// The admin listener's bearer token.
    pub token: String,
}

/// The banner line whose curl carries the admin token.
const TOKEN_MARK: &str = "authorization: Bearer ";

/// Starts `cmd` (the gateway binary, or `cargo run` of it) as `--demo` with `extra` arguments on
/// two free loopback ports, its log in `log`; waits up to `deadline` for the banner's admin
/// token, then for `/health/ready`. A port taken between its choice and the gateway's bind (the
/// demo's own workers bind ephemeral ports first) is chosen again, up to three times.
///
/// # Errors
/// It does not start, prints no token in time, or does not become ready.
pub fn start_demo(
    root: &std::path::Path,
    cmd: std::process::Command,
    extra: &[&str],
    name: &str,
    log: PathBuf,
    deadline: Duration,
) -> Result<DemoGateway> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        // `Command` is not `Clone`: each attempt starts from a copy of `cmd`.
        let mut again = std::process::Command::new(cmd.get_program());
        again.args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => again.env(k, v),
                None => again.env_remove(k),
            };
        }
        match start_demo_once(root, again, extra, name, log.clone(), deadline) {
            Err(e) if attempt < 3 && format!("{e:#}").contains("Address already in use") => {
                eprintln!("{name}: a port was taken before the gateway bound it; choosing again");
            }
            other => return other,
        }
    }
}

fn start_demo_once(
    root: &std::path::Path,
    mut cmd: std::process::Command,
    extra: &[&str],
    name: &str,
    log: PathBuf,
    deadline: Duration,
) -> Result<DemoGateway> {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let public: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let mut child = cmd
        .args(["--demo", "--sim-speed", "0", "--log", "warn"])
        .args(extra)
        .arg("--listen")
        .arg(public.to_string())
        .arg("--admin-listen")
        .arg(admin.to_string())
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).context("creating the gateway's log")?)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("the gateway's stdout")?;
    let mut proc = Proc { name: name.to_owned(), child, log: Some(log) };
    // The banner comes once the workers are discovered; read it on a thread so a gateway that
    // never prints fails the deadline, then keep draining.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !sent && let Some(i) = line.find(TOKEN_MARK) {
                let token: String =
                    line[i + TOKEN_MARK.len()..].chars().take_while(char::is_ascii_alphanumeric).collect();
                sent = tx.send(token).is_ok();
            }
        }
    });
    let token = match rx.recv_timeout(deadline) {
        Ok(t) if !t.is_empty() => t,
        // A gateway that exited (a port taken) ends the wait at once: its stdout closed.
        _ => bail!("{name} printed no admin token within {deadline:?}\n{}", proc.tail()),
    };
    wait_ready(public, "/health/ready", &mut proc)?;
    Ok(DemoGateway { proc, public, admin, token })
}

/// `GET path` on `addr` with a bearer token.
///
/// # Errors
/// As [`http`].
pub fn get_with_token(addr: SocketAddr, path: &str, token: &str) -> Result<Answer> {
    request(addr, "GET", path, None, Some(token))
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n").unwrap_or_default(), b"abcde");
        assert!(dechunk(b"5\r\nab\r\n").is_err());
        assert!(dechunk(b"zz\r\n").is_err());
    }
}
