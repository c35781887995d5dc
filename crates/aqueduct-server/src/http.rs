//! The metrics and health endpoint on `metrics_addr`, routed by axum and served by hyper's
//! HTTP/1.1 connection (one request per connection, GET only):
//!
//! - `GET /metrics` — Prometheus text format 0.0.4;
//! - `GET /healthz` — 200 while the process runs;
//! - `GET /readyz` — 200 while the QUIC listener is serving, 503 once shutdown began;
//! - `GET /webtransport/cert-hash` — the SHA-256 of the certificate browsers get (WebTransport
//!   with a generated certificate), as JSON for `serverCertificateHashes`, with the QUIC port
//!   browsers connect to; 404 without one;
//! - `GET /` and `GET /web/` — the live web view (`web/index.html`, `web/app.js`), a page that
//!   connects over WebTransport, subscribes, shows messages as they arrive and publishes;
//! - `GET /web/aqueduct/{index,codec,client}.js` — the JavaScript client (`clients/js`), embedded
//!   at compile time, which the page imports.
//!
//! It must survive slow and hostile clients: at most `metrics.max_connections` connections at
//! once (with all taken, a new one replaces one that has sent no request yet, or else one
//! open for more than 2 s whose answer is still being written, see [`evict_one`]; only when
//! none qualifies do more wait in the kernel's accept queue), the request head must arrive
//! within
//! `metrics.header_timeout` (hyper closes the connection otherwise) and fit in 8 KiB (431
//! otherwise), and a whole exchange is bounded in time. Connection tasks live in a `JoinSet`
//! owned by the endpoint's task, so none outlives it.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::debug;

use crate::metrics::{render, TopicLabels};
use crate::server::Shared;

/// Largest request head (hyper's smallest allowed buffer).
const MAX_HEAD: usize = 8 * 1024;
/// How long the endpoint waits after a failed accept (out of file descriptors, say).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// A response must be written within this (after the head arrived).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Endpoint {
    pub shared: Arc<Shared>,
    pub labels: TopicLabels,
    pub ready: AtomicBool,
    /// Renders of `/metrics` running or waiting for a blocking thread: a render cannot be
    /// cancelled once begun, so connections closed meanwhile (evicted, timed out) must not
    /// leave ever more of them behind.
    pub renders: Arc<tokio::sync::Semaphore>,
}

/// `/metrics` renders at a time (each walks every topic; they take turns on one lock anyway).
pub(crate) const RENDERS: usize = 2;

fn router(endpoint: Arc<Endpoint>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/webtransport/cert-hash", get(cert_hash))
        .route("/", get(web_page))
        .route(
            "/web",
            get(|| async { axum::response::Redirect::permanent("/web/") }),
        )
        .route("/web/", get(web_page))
        .route("/web/app.js", get(|| async { javascript(WEB_APP_JS) }))
        .route(
            "/web/aqueduct/index.js",
            get(|| async { javascript(JS_INDEX) }),
        )
        .route(
            "/web/aqueduct/codec.js",
            get(|| async { javascript(JS_CODEC) }),
        )
        .route(
            "/web/aqueduct/client.js",
            get(|| async { javascript(JS_CLIENT) }),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: try / (the live web view), /metrics, /healthz, /readyz or \
                 /webtransport/cert-hash\n",
            )
        })
        .with_state(endpoint)
}

async fn metrics(State(e): State<Arc<Endpoint>>) -> axum::response::Response {
    // On a blocking thread: a render walks every topic and group, under a lock one scrape at a
    // time takes; on the runtime's threads two scrapers could leave none for QUIC.
    // Waited for in the connection's task (cancelled with it); held by the render itself.
    let Ok(permit) = e.renders.clone().acquire_owned().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let rendered = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        render(&e.shared, &e.labels)
    });
    match rendered.await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(e): State<Arc<Endpoint>>) -> impl IntoResponse {
    if e.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// The live web view and the JavaScript client it imports, built into the binary.
const WEB_INDEX_HTML: &str = include_str!("../web/index.html");
const WEB_APP_JS: &str = include_str!("../web/app.js");
const JS_INDEX: &str = include_str!("../../../clients/js/index.js");
const JS_CODEC: &str = include_str!("../../../clients/js/codec.js");
const JS_CLIENT: &str = include_str!("../../../clients/js/client.js");

/// Headers of every file of the web view: no caching (a new broker build serves new files),
/// no sniffing, and a policy that loads nothing from elsewhere (WebTransport is `connect-src`).
fn web_headers(content_type: &'static str) -> [(header::HeaderName, &'static str); 4] {
    [
        (header::CONTENT_TYPE, content_type),
        (header::CACHE_CONTROL, "no-cache"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; \
             img-src 'self' data:; connect-src 'self' https:; base-uri 'none'; \
             form-action 'none'; frame-ancestors 'none'",
        ),
    ]
}

/// A module of the page or of the client; other sites' pages may import the client from here
/// (module scripts are fetched with CORS), as they may read the certificate hash.
fn javascript(body: &'static str) -> impl IntoResponse {
    (
        web_headers("text/javascript; charset=utf-8"),
        [(header::ACCESS_CONTROL_ALLOW_ORIGIN, "*")],
        body,
    )
}

/// The page, told the broker's QUIC port and WebTransport path (it still fetches the
/// certificate hash before each connect: the certificate is renewed).
async fn web_page(State(e): State<Arc<Endpoint>>) -> impl IntoResponse {
    let page = WEB_INDEX_HTML
        .replace(
            "{{WT_PORT}}",
            &e.shared.webtransport_addr.port().to_string(),
        )
        .replace(
            "{{WT_PATH}}",
            &html_attr(&e.shared.config.webtransport.path_prefix),
        );
    (web_headers("text/html; charset=utf-8"), page)
}

/// Escape for an HTML attribute value in double quotes.
fn html_attr(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `{"algorithm":"sha-256","value":"<hex>","not_after":<unix seconds>,"path":"/aqueduct/wt",
/// "port":4242,"host":"127.0.0.1"}`: a page passes the value (as bytes) in `serverCertificateHashes`
/// and connects to `https://<its host>:<port><path>` (`port`: the broker's QUIC port, which
/// WebTransport shares); a page on the broker's own machine uses `host` instead of `localhost`
/// (see [`local_host`]). Any origin may read it (a certificate is public; which pages may
/// *connect* is `webtransport.allowed_origins`).
async fn cert_hash(State(e): State<Arc<Endpoint>>) -> axum::response::Response {
    let cert = e.shared.browser_certs.as_ref().and_then(|c| c.current());
    let Some(cert) = cert else {
        let why = if e.shared.config.webtransport.enabled {
            "no generated certificate: browsers verify the broker's own (tls.cert_file)\n"
        } else {
            "WebTransport is off (webtransport.enabled)\n"
        };
        return (StatusCode::NOT_FOUND, why).into_response();
    };
    let not_after = cert
        .not_after
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let body = serde_json::json!({
        "algorithm": "sha-256",
        "value": cert.sha256_hex(),
        "not_after": not_after,
        "path": e.shared.config.webtransport.path_prefix,
        "port": e.shared.webtransport_addr.port(),
        "host": local_host(e.shared.webtransport_addr),
    })
    .to_string();
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::ACCESS_CONTROL_ALLOW_ORIGIN, "*"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// The broker's QUIC address as a URL host for a page on the broker's own machine: `127.0.0.1`
/// when it listens on every IPv4 interface, `[::1]` on every IPv6 one, otherwise its own address.
/// A page opened as `http://localhost:…` must not dial `localhost`: browsers resolve it to `::1`
/// first and, unlike TCP, do not fall back to `127.0.0.1` for QUIC, so a broker listening on
/// `127.0.0.1` (or `0.0.0.0`) would be unreachable from it.
fn local_host(addr: std::net::SocketAddr) -> String {
    match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".into(),
        std::net::IpAddr::V4(ip) => ip.to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
    }
}

/// A connection being served.
struct Open {
    id: tokio::task::Id,
    task: tokio::task::AbortHandle,
    from: IpAddr,
    /// When it was accepted.
    since: tokio::time::Instant,
    /// [`WAITING`], [`ASKED`] (its request head has arrived: it is being answered) or
    /// [`EVICTED`]; the service and the evictor each move it from `WAITING` once, so a request
    /// being answered is cut only when its answer has taken longer than [`SLOW_ANSWER`].
    state: Arc<AtomicU8>,
}

const WAITING: u8 = 0;
const ASKED: u8 = 1;
const EVICTED: u8 = 2;

/// How often a full endpoint looks again for a connection it may close for a new one.
const FULL_RECHECK: Duration = Duration::from_millis(250);

/// How long a connection may take, from its accept, before it may be closed for a new one
/// although its request is being answered: a scraper reading its answer slowly on purpose
/// must not keep probes waiting either (a real scrape takes milliseconds).
const SLOW_ANSWER: Duration = Duration::from_secs(2);

/// Whether `o` may be closed for a new connection: it sent no request yet, or its answer has
/// taken longer than [`SLOW_ANSWER`].
fn evictable(o: &Open, now: tokio::time::Instant) -> bool {
    match o.state.load(Ordering::Acquire) {
        WAITING => true,
        ASKED => now.saturating_duration_since(o.since) >= SLOW_ANSWER,
        _ => false,
    }
}

/// Close a connection for a new one when every slot is taken: one that has not sent its
/// request yet ([`crate::eviction`]: from the address group holding the most, the oldest), so
/// that clients that open connections and send nothing cannot keep a probe waiting (it waited
/// up to `metrics.header_timeout` behind them); else the oldest whose answer has taken longer
/// than [`SLOW_ANSWER`] (a client reading slowly on purpose). One may have sent its request
/// since it was ordered: the next is tried. Returns whether one was closed.
fn evict_one(open: &mut Vec<Open>) -> bool {
    if evict_waiting(open) {
        return true;
    }
    let now = tokio::time::Instant::now();
    let slow = open
        .iter()
        .enumerate()
        .filter(|(_, o)| o.state.load(Ordering::Acquire) == ASKED && evictable(o, now))
        .min_by_key(|(_, o)| o.since)
        .map(|(i, _)| i);
    let Some(i) = slow else {
        return false;
    };
    let evicted = open.remove(i);
    debug!(from = %evicted.from, "metrics: closing a connection whose answer took longer than {SLOW_ANSWER:?}, for a new one");
    evicted.task.abort();
    true
}

/// [`evict_one`]'s first choice: a connection that sent no request.
fn evict_waiting(open: &mut Vec<Open>) -> bool {
    let groups: Vec<IpAddr> = open.iter().map(|o| o.from).collect();
    let waiting = |i: usize| open[i].state.load(Ordering::Acquire) == WAITING;
    for i in crate::eviction::eviction_order(&groups, waiting) {
        if open[i]
            .state
            .compare_exchange(WAITING, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let evicted = open.remove(i);
            debug!(from = %evicted.from, "metrics: closing a connection that sent no request, for a new one");
            evicted.task.abort();
            return true;
        }
    }
    false
}

/// Serve until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    endpoint: Arc<Endpoint>,
    mut stop: watch::Receiver<bool>,
) {
    let max = endpoint.shared.config.metrics.max_connections.max(1);
    let header_timeout = endpoint.shared.config.metrics.header_timeout;
    let app = router(endpoint);
    let mut conns = JoinSet::new();
    // In the order they were accepted.
    let mut open: Vec<Open> = Vec::new();
    loop {
        let accepted = tokio::select! {
            Some(done) = conns.join_next_with_id(), if !conns.is_empty() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                open.retain(|o| o.id != id);
                continue;
            }
            accepted = listener.accept(), if open.len() < max || open.iter().any(|o| evictable(o, tokio::time::Instant::now())) => accepted,
            // Full: look again soon (an answer may pass SLOW_ANSWER meanwhile).
            () = tokio::time::sleep(FULL_RECHECK), if open.len() >= max => continue,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (socket, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, say: not again at once, or this loop spins.
                debug!("metrics accept failed: {e}");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        if open.len() >= max && !evict_one(&mut open) {
            // Every slot's connection became unevictable between the check and the accept:
            // this one is refused, never served beyond the limit (a client could otherwise
            // repeat that race without end).
            debug!(%peer, "metrics: connection closed: every slot is answering a request");
            drop(socket);
            continue;
        }
        let state = Arc::new(AtomicU8::new(WAITING));
        let service = {
            let inner = hyper_util::service::TowerToHyperService::new(app.clone());
            let state = state.clone();
            hyper::service::service_fn(move |req| {
                // Evicted just now: its task is being aborted, and this answer goes nowhere.
                let _ = state.compare_exchange(WAITING, ASKED, Ordering::AcqRel, Ordering::Acquire);
                hyper::service::Service::call(&inner, req)
            })
        };
        let task = conns.spawn(async move {
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
        });
        open.push(Open {
            id: task.id(),
            task,
            from: crate::eviction::address_group(peer.ip()),
            since: tokio::time::Instant::now(),
            state,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With every slot taken, a new connection closes one that sent no request, else the
    /// oldest whose answer has taken longer than SLOW_ANSWER (a client reading slowly on
    /// purpose held its slot, and probes waited, for the whole write timeout); with none of
    /// either, none, and the new connection is refused rather than served beyond the limit.
    #[tokio::test]
    async fn a_full_endpoint_closes_an_idle_connection_then_a_slow_answer() {
        let mut tasks = JoinSet::new();
        let mut conn = |state: u8, age: Duration| {
            let task = tasks.spawn(std::future::pending::<()>());
            Open {
                id: task.id(),
                task,
                from: "10.0.0.1".parse().expect("ip"),
                since: tokio::time::Instant::now() - age,
                state: Arc::new(AtomicU8::new(state)),
            }
        };
        let young = Duration::ZERO;
        let mut open = vec![conn(ASKED, young), conn(ASKED, young)];
        assert!(!evict_one(&mut open), "two answers just begun: none");
        assert_eq!(open.len(), 2);
        open.push(conn(WAITING, young));
        assert!(evict_one(&mut open), "the one that sent nothing");
        assert_eq!(open.len(), 2);
        assert!(open
            .iter()
            .all(|o| o.state.load(Ordering::Acquire) == ASKED));
        let slow = conn(ASKED, SLOW_ANSWER * 2);
        let slower = conn(ASKED, SLOW_ANSWER * 3);
        let oldest = slower.id;
        open.extend([slow, slower]);
        assert!(evict_one(&mut open), "an answer past SLOW_ANSWER");
        assert_eq!(open.len(), 3);
        assert!(open.iter().all(|o| o.id != oldest), "the oldest of them");
    }

    #[test]
    fn a_page_on_the_brokers_machine_gets_a_literal_address_it_can_reach() {
        let host = |a: &str| local_host(a.parse().expect("address"));
        assert_eq!(host("0.0.0.0:4242"), "127.0.0.1");
        assert_eq!(host("[::]:4242"), "[::1]");
        assert_eq!(host("127.0.0.1:7461"), "127.0.0.1");
        assert_eq!(host("10.1.2.3:4242"), "10.1.2.3");
        assert_eq!(host("[::1]:4242"), "[::1]");
        assert_eq!(host("[fd00::5]:4242"), "[fd00::5]");
    }
}
