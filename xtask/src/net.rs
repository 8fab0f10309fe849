//! Small blocking helpers the checks that run real processes share: a child process killed
//! when dropped, a free loopback port, one HTTP/1.1 request read to its end, and a wait for a
//! process's endpoint to answer.
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
    let mut s =
        TcpStream::connect_timeout(&addr, REQUEST).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(REQUEST))?;
    let payload = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
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
