//! The metrics and health endpoint on `metrics_addr`, routed by axum and served by hyper's
//! HTTP/1.1 connection (one request per connection, GET only):
//!
//! - `GET /metrics` — Prometheus text format 0.0.4;
//! - `GET /healthz` — 200 while the process runs;
//! - `GET /readyz` — 200 while the QUIC listener is serving, 503 once shutdown began.
//!
//! It must survive slow and hostile clients: at most `metrics.max_connections` connections at
//! once (more wait in the kernel's accept queue), the request head must arrive within
//! `metrics.header_timeout` (hyper closes the connection otherwise) and fit in 8 KiB (431
//! otherwise), and a whole exchange is bounded in time. Connection tasks live in a `JoinSet`
//! owned by the endpoint's task, so none outlives it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tracing::debug;

use crate::metrics::{render, TopicLabels};
use crate::server::Shared;

/// Largest request head (hyper's smallest allowed buffer).
const MAX_HEAD: usize = 8 * 1024;
/// A response must be written within this (after the head arrived).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Endpoint {
    pub shared: Arc<Shared>,
    pub labels: TopicLabels,
    pub ready: AtomicBool,
}

fn router(endpoint: Arc<Endpoint>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /healthz or /readyz\n",
            )
        })
        .with_state(endpoint)
}

async fn metrics(State(e): State<Arc<Endpoint>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&e.shared, &e.labels),
    )
}

async fn readyz(State(e): State<Arc<Endpoint>>) -> impl IntoResponse {
    if e.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// Serve until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    endpoint: Arc<Endpoint>,
    mut stop: watch::Receiver<bool>,
) {
    let limit = Arc::new(Semaphore::new(
        endpoint.shared.config.metrics.max_connections,
    ));
    let header_timeout = endpoint.shared.config.metrics.header_timeout;
    let app = router(endpoint);
    let mut conns = JoinSet::new();
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (socket, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    debug!("metrics accept failed: {e}");
                    continue;
                }
            },
            _ = stop.wait_for(|s| *s) => return,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        conns.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(MAX_HEAD)
                .keep_alive(false)
                .serve_connection(TokioIo::new(socket), service);
            match tokio::time::timeout(header_timeout + WRITE_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, "metrics request failed: {e}"),
                Err(_) => debug!(%peer, "metrics request took too long; closed"),
            }
            drop(permit);
        });
    }
}
