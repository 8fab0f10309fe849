//! The accept loop's connection limits, on loopback: a connection that never sends a byte is
//! closed after the header-read timeout, while one that sends a request is served.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails loudly

use std::convert::Infallible;
use std::time::Duration;

use cortex_proxy::error::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

async fn ok(_req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    Ok(Response::new(
        http_body_util::Full::new(bytes::Bytes::from_static(b"ok")).map_err(|e| match e {}).boxed_unsync(),
    ))
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_and_one_that_asks_is_served() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let header_read_timeout = Duration::from_millis(300);
    let server = tokio::spawn(cortex_proxy::server::serve_with(
        listener,
        ok,
        header_read_timeout,
        Duration::from_secs(1),
        async {
            let _ = stopped.await;
        },
    ));

    // Silent: the gateway closes it (EOF) after the timeout, not never.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf))
        .await
        .expect("the silent connection was not closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "the gateway answered a connection that sent nothing");

    // A request on another connection is served.
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut resp)).await.unwrap().unwrap();
    let resp = String::from_utf8_lossy(&resp);
    assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with("ok"), "{resp}");

    let _ = stop.send(());
    server.await.unwrap();
}
