//! Test support: a tiny blocking HTTP/1.1 client over `std::net`, SSE parsing, ZeroMQ helpers,
//! golden-file loading and a bounded wait on observable state.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(20);

/// A parsed HTTP response.
#[derive(Debug)]
pub(crate) struct HttpResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
    /// The body ended properly (content-length reached, or the last chunk seen).
    pub(crate) complete: bool,
}

impl HttpResponse {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of an SSE body, `[DONE]` included.
    pub(crate) fn sse(&self) -> Vec<String> {
        self.text().split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
    }

    pub(crate) fn ttft_ms(&self) -> f64 {
        self.header("x-sim-ttft-ms").expect("x-sim-ttft-ms header").parse().expect("a number")
    }
}

fn write_request(
    stream: &mut TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) {
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).expect("send request");
}

/// Sends one request and reads the whole response (until the server closes).
pub(crate) fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    write_request(&mut stream, addr, method, path, headers, body);
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("response not finished after {TIMEOUT:?}: {}", String::from_utf8_lossy(&raw))
            }
            // A reset connection (a cut stream) ends the response like EOF.
            Err(_) => break,
        }
    }
    parse(&raw)
}

pub(crate) fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    request(addr, "POST", path, &[], Some(&body.to_string()))
}

pub(crate) fn post_h(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> HttpResponse {
    request(addr, "POST", path, headers, Some(&body.to_string()))
}

pub(crate) fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, &[], None)
}

/// Opens a request and returns the stream once the response head and the first body bytes have
/// arrived (for disconnect tests).
pub(crate) fn open_stream(addr: SocketAddr, path: &str, body: &Value) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    write_request(&mut stream, addr, "POST", path, &[], Some(&body.to_string()));
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: ") {
        let n = stream.read(&mut buf).expect("read");
        assert!(n > 0, "closed before the first event");
        raw.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8_lossy(&raw).into_owned())
}

fn parse(raw: &[u8]) -> HttpResponse {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        // The connection closed before a response head (a cut connection).
        return HttpResponse { status: 0, headers: Vec::new(), body: raw.to_vec(), complete: false };
    };
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 =
        lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    if !chunked {
        let len: Option<usize> =
            headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok());
        let complete = len.is_none_or(|l| rest.len() >= l);
        return HttpResponse { status, headers, body: rest.to_vec(), complete };
    }
    let mut body = Vec::new();
    let mut pos = 0;
    let mut complete = false;
    while let Some(eol) = rest[pos..].windows(2).position(|w| w == b"\r\n") {
        let size_line = String::from_utf8_lossy(&rest[pos..pos + eol]).into_owned();
        let Ok(size) = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16) else {
            break;
        };
        pos += eol + 2;
        if size == 0 {
            complete = true;
            break;
        }
        if pos + size > rest.len() {
            body.extend_from_slice(&rest[pos..]);
            break;
        }
        body.extend_from_slice(&rest[pos..pos + size]);
        pos += size + 2;
    }
    HttpResponse { status, headers, body, complete }
}

/// Waits (bounded) until `cond` holds; fails the test otherwise.
pub(crate) fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub(crate) fn golden(path: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden").join(path);
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_slice(&bytes).expect("golden JSON")
}

pub(crate) fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).expect("hex")
}

/// A SUB socket connected to `addr`, subscribed to `topic`.
pub(crate) fn sub(ctx: &zmq::Context, addr: SocketAddr, topic: &[u8]) -> zmq::Socket {
    let s = ctx.socket(zmq::SUB).expect("SUB");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(i32::try_from(TIMEOUT.as_millis()).unwrap_or(i32::MAX)).expect("rcvtimeo");
    s.connect(&format!("tcp://{addr}")).expect("connect");
    s.set_subscribe(topic).expect("subscribe");
    s
}

/// A DEALER socket connected to a replay ROUTER.
pub(crate) fn dealer(ctx: &zmq::Context, addr: SocketAddr) -> zmq::Socket {
    let s = ctx.socket(zmq::DEALER).expect("DEALER");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(i32::try_from(TIMEOUT.as_millis()).unwrap_or(i32::MAX)).expect("rcvtimeo");
    s.connect(&format!("tcp://{addr}")).expect("connect");
    s
}

/// Receives one multipart message (fails the test on timeout).
pub(crate) fn recv(s: &zmq::Socket) -> Vec<Vec<u8>> {
    s.recv_multipart(0).expect("a message before the timeout")
}

/// A payload with the 8 timestamp bytes (`93 cb <f64>`) zeroed.
pub(crate) fn mask_ts(payload: &[u8]) -> Vec<u8> {
    assert_eq!(&payload[..2], &[0x93, 0xcb], "payload starts with [ts: float64, …]");
    let mut p = payload.to_vec();
    p[2..10].fill(0);
    p
}

/// Replay requests until the end marker; returns the replies.
pub(crate) fn replay(s: &zmq::Socket, from: u64) -> Vec<Vec<Vec<u8>>> {
    s.send_multipart([&b""[..], &from.to_be_bytes()], 0).expect("send replay request");
    let mut out = Vec::new();
    loop {
        let m = recv(s);
        let end =
            m.iter().rev().nth(1).is_some_and(|f| f == &[0xff; 8]) && m.last().is_some_and(Vec::is_empty);
        out.push(m);
        if end {
            return out;
        }
    }
}
