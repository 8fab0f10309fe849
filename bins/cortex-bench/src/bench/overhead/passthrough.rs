//! The do-nothing proxy: the floor any HTTP proxy in front of a worker pays.
//!
//! It accepts HTTP/1.1 connections (keep-alive, `TCP_NODELAY`), points each request's URI at the
//! one upstream and hands request and response bodies through untouched with a pooled
//! hyper-util client (keep-alive, `TCP_NODELAY`) — no parsing, no headers added, nothing else.
//! Cortex's added latency is judged against this one's, measured in the same run.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = UnsyncBoxBody<bytes::Bytes, hyper::Error>;

/// Binds `127.0.0.1:0` and serves until the runtime is dropped; returns the bound address.
///
/// # Errors
/// The listener cannot be bound.
pub async fn start(upstream: SocketAddr) -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(connector);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let client = client.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| forward(client.clone(), upstream, req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

async fn forward(
    client: Client<HttpConnector, Incoming>,
    upstream: SocketAddr,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path_and_query().map_or("/", http::uri::PathAndQuery::as_str);
    let Ok(uri) = format!("http://{upstream}{path}").parse::<Uri>() else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    *req.uri_mut() = uri;
    match client.request(req).await {
        Ok(resp) => Ok(resp.map(BodyExt::boxed_unsync)),
        Err(_) => Ok(status(StatusCode::BAD_GATEWAY)),
    }
}

fn status(code: StatusCode) -> Response<Body> {
    let mut r = Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
    *r.status_mut() = code;
    r
}
