//! Serving connections: the accept loop, connection settings and graceful shutdown, for the
//! public listener and the admin listener alike.
//!
//! Key decisions: HTTP/1.1 with keep-alive and HTTP/2 from clients that ask for it (hyper-util's
//! auto builder); `TCP_NODELAY` on every accepted socket; a header-read timeout, which hyper only
//! enforces when it is given a timer, and which also closes a connection that sends no byte at
//! all (hyper's timer starts only after the protocol is sniffed); graceful shutdown stops accepting at once, lets in-flight
//! streams finish up to the deadline, then closes what is left.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::error::Body;
use crate::gateway::Gateway;

/// Serves `handler` on `listener` until `shutdown` resolves, then drains for up to `grace`.
pub async fn serve_with<H, Fut, S>(
    listener: TcpListener,
    handler: H,
    header_read_timeout: Duration,
    grace: Duration,
    shutdown: S,
) where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
    S: Future<Output = ()>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout).keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // Tells connections still waiting for their first byte to go: graceful shutdown waits for
    // every watcher, and a silent connection must not hold it until its timeout.
    let (closing, closing_rx) = tokio::sync::watch::channel(());
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let h = handler.clone();
                let builder = builder.clone();
                let watcher = graceful.watcher();
                let mut closing = closing_rx.clone();
                tokio::spawn(async move {
                    // hyper's header timer starts after the protocol is sniffed: a connection
                    // that never sends a byte would otherwise be held forever.
                    // (`peek`, not `readable`: readiness may be reported before any byte.)
                    let mut first = [0u8; 1];
                    tokio::select! {
                        r = tokio::time::timeout(header_read_timeout, stream.peek(&mut first)) => {
                            if r.is_err() {
                                tracing::debug!("closing a connection that sent nothing");
                                return;
                            }
                        }
                        _ = closing.changed() => return,
                    }
                    let conn = builder.serve_connection(TokioIo::new(stream), service_fn(h));
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let _ = closing.send(());
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!(?grace, "graceful shutdown deadline passed; closing remaining connections");
    }
}

/// Serves the gateway's public API on `listener` until `shutdown` resolves.
pub async fn serve(listener: TcpListener, gateway: Arc<Gateway>, shutdown: impl Future<Output = ()>) {
    let header_read_timeout = gateway.limits().header_read_timeout;
    let grace = gateway.shutdown_grace();
    let gw = Arc::clone(&gateway);
    let handler = move |req: Request<Incoming>| Arc::clone(&gw).serve(req);
    let stop = async {
        shutdown.await;
        gateway.begin_shutdown();
    };
    serve_with(listener, handler, header_read_timeout, grace, stop).await;
}
