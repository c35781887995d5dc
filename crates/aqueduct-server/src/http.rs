//! The metrics and health endpoint: a deliberately small HTTP/1.1 server (GET only, one request
//! per connection) on `metrics_addr`:
//!
//! - `GET /metrics` — Prometheus text format 0.0.4;
//! - `GET /healthz` — 200 while the process runs;
//! - `GET /readyz` — 200 while the QUIC listener is serving, 503 once shutdown began.
//!
//! It must survive slow and hostile clients: at most `metrics.max_connections` connections at
//! once (more wait in the kernel's accept queue), the request head must arrive within
//! `metrics.header_timeout` and fit in 8 KiB, and the response write is bounded too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tracing::debug;

use crate::metrics::{render, TopicLabels};
use crate::server::Shared;

const MAX_HEAD: usize = 8 * 1024;
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Endpoint {
    pub shared: Arc<Shared>,
    pub labels: TopicLabels,
    pub ready: AtomicBool,
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
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
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
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let timeout = endpoint.shared.config.metrics.header_timeout;
            if let Err(e) = handle(socket, &endpoint, timeout).await {
                debug!(%peer, "metrics request failed: {e}");
            }
            drop(permit);
        });
    }
}

async fn handle(
    mut socket: TcpStream,
    endpoint: &Endpoint,
    header_timeout: Duration,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let complete = tokio::time::timeout(header_timeout, async {
        let mut buf = [0u8; 1024];
        loop {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                return Ok(true);
            }
            if head.len() > MAX_HEAD {
                return Ok(false);
            }
        }
    })
    .await;
    let response = match complete {
        Err(_) => response(408, "text/plain", "request head not received in time\n"),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(false)) if head.len() > MAX_HEAD => {
            response(431, "text/plain", "request head too large\n")
        }
        Ok(Ok(false)) => return Ok(()),
        Ok(Ok(true)) => route(&head, endpoint),
    };
    tokio::time::timeout(WRITE_TIMEOUT, async {
        socket.write_all(&response).await?;
        socket.shutdown().await
    })
    .await
    .unwrap_or(Ok(()))
}

fn route(head: &[u8], endpoint: &Endpoint) -> Vec<u8> {
    let line = head.split(|&b| b == b'\r').next().unwrap_or(&[]);
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next().unwrap_or(&[]), parts.next().unwrap_or(&[]));
    let path = path.split(|&b| b == b'?').next().unwrap_or(&[]);
    if method != b"GET" {
        return response(405, "text/plain", "only GET is supported\n");
    }
    match path {
        b"/metrics" => response(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            &render(&endpoint.shared, &endpoint.labels),
        ),
        b"/healthz" => response(200, "text/plain", "ok\n"),
        b"/readyz" if endpoint.ready.load(Ordering::Acquire) => {
            response(200, "text/plain", "ready\n")
        }
        b"/readyz" => response(503, "text/plain", "not ready\n"),
        _ => response(
            404,
            "text/plain",
            "not found: try /metrics, /healthz or /readyz\n",
        ),
    }
}

fn response(status: u16, content_type: &str, body: &str) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}
