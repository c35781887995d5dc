//! WebTransport on the broker's own QUIC port, for browsers: a connection that negotiates ALPN
//! `h3` is an HTTP/3 connection carrying a WebTransport session (`web-transport-quinn` does the
//! HTTP/3 part); every bidirectional stream of the session carries exactly the frames of
//! `docs/protocol.md` and is served by the same stream task as a native stream, with the same
//! limits, metrics and ERROR frames.
//!
//! The session's URL path must start with `webtransport.path_prefix`; its `Origin` must be allowed
//! (`webtransport.allowed_origins`; by default only pages on this machine: `localhost`,
//! `127.0.0.1`, `[::1]`); its `token` query parameter, if any, must be one of
//! `webtransport.tokens` and names the client (its ACL and quota identity), else the client is
//! `anonymous`. A refused session gets an HTTP status (404, 403, 401) and a log line; a
//! browser's (it sends `Origin`) a session closed at once with NOT_AUTHORIZED and a reason naming
//! the status instead, since browsers do not show pages the status.
//!
//! Certificates: with a generated development certificate, browsers get their own — ECDSA P-256,
//! valid 13 days (what `serverCertificateHashes` accepts), renewed every 6 days — whose SHA-256
//! the metrics endpoint serves at `GET /webtransport/cert-hash`. With `tls.cert_file` browsers get
//! that certificate and verify it as for any site.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::config::{invalid, ConfigError};

/// The ALPN of HTTP/3, which WebTransport runs on.
pub const H3_ALPN: &[u8] = b"h3";
/// The WebTransport subprotocol a session may ask for.
pub const SUBPROTOCOL: &str = "aqueduct-v1";
/// Unidirectional streams an HTTP/3 connection needs (control, QPACK encoder and decoder).
pub const H3_UNI_STREAMS: u32 = 3;
/// Bytes of a connection's QUIC datagrams quinn holds unread (it drops the oldest beyond). The
/// broker offers datagrams because HTTP/3 must, and reads none: a page's would only take memory.
pub const DATAGRAM_BUFFER: usize = 16 * 1024;
/// How long a browser certificate is valid (`serverCertificateHashes` allows at most 14 days).
const BROWSER_CERT_VALID: Duration = Duration::from_secs(13 * 24 * 3600);
/// How often it is renewed. Only the current certificate is shown: a page fetches the hash
/// before each connect (a hash fetched before a renewal no longer matches after it).
pub const BROWSER_CERT_RENEW: Duration = Duration::from_secs(6 * 24 * 3600);

/// How often [`BrowserCerts::keep_renewed`] looks at the wall clock.
const RENEW_CHECK: Duration = Duration::from_secs(600);

/// Is `cert` due for renewal at wall-clock time `now` ([`BROWSER_CERT_RENEW`] after it was made,
/// so that it is never presented in its last days)?
fn renewal_due(cert: &BrowserCert, now: std::time::SystemTime) -> bool {
    let renew_at = cert.not_after - (BROWSER_CERT_VALID - BROWSER_CERT_RENEW);
    now >= renew_at
}

/// `webtransport.*` as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebTransportSection {
    pub enabled: bool,
    /// "" = the broker's own UDP port.
    pub listen_addr: String,
    pub path_prefix: String,
    /// Exact origins (`https://app.example.com`), or `*` for any; empty: this machine's only.
    pub allowed_origins: Vec<String>,
    /// Token → client id.
    pub tokens: HashMap<String, String>,
    /// Refuse a session without a token (401); else it is admitted as `anonymous`.
    pub require_token: bool,
}

impl Default for WebTransportSection {
    fn default() -> Self {
        WebTransportSection {
            enabled: true,
            listen_addr: String::new(),
            path_prefix: "/aqueduct/wt".into(),
            allowed_origins: Vec::new(),
            tokens: HashMap::new(),
            require_token: false,
        }
    }
}

/// `webtransport.*`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebTransportConfig {
    pub enabled: bool,
    /// A UDP port of its own for browsers (besides the broker's, which serves them too);
    /// `None`: the broker's port only.
    pub listen_addr: Option<std::net::SocketAddr>,
    pub path_prefix: String,
    pub allowed_origins: Vec<String>,
    pub tokens: HashMap<String, String>,
    /// A session without a token is refused (401) instead of admitted as `anonymous`.
    pub require_token: bool,
}

impl Default for WebTransportConfig {
    fn default() -> Self {
        WebTransportConfig {
            enabled: true,
            listen_addr: None,
            path_prefix: "/aqueduct/wt".into(),
            allowed_origins: Vec::new(),
            tokens: HashMap::new(),
            require_token: false,
        }
    }
}

impl WebTransportSection {
    pub fn validate(&self) -> Result<WebTransportConfig, ConfigError> {
        let listen_addr = match self.listen_addr.trim() {
            "" => None,
            a => Some(crate::config::parse_addr("webtransport.listen_addr", a)?),
        };
        if !self.path_prefix.starts_with('/') {
            return Err(invalid(
                "webtransport.path_prefix",
                format!("{:?} must start with '/'", self.path_prefix),
            ));
        }
        // A request's path arrives percent-encoded: a prefix holding what encoding changes (a
        // space, non-ASCII text, `%`) or ends a path (`?`, `#`) matched no request, and every
        // session got 404 with nothing said at startup.
        if let Some(c) = self
            .path_prefix
            .chars()
            .find(|c| !c.is_ascii_graphic() || matches!(c, '%' | '?' | '#'))
        {
            return Err(invalid(
                "webtransport.path_prefix",
                format!(
                    "{:?} has {c:?}, which no request's path can match: use letters, digits \
                     and / - . _ ~",
                    self.path_prefix
                ),
            ));
        }
        let mut allowed_origins = Vec::with_capacity(self.allowed_origins.len());
        for o in &self.allowed_origins {
            let normal = if o == "*" {
                Some(o.clone())
            } else {
                normalized_origin(o)
            };
            let Some(normal) = normal else {
                return Err(invalid(
                    "webtransport.allowed_origins",
                    format!(
                        "{o:?} is not an origin: http(s)://host[:port] without a path, query or user, or \"*\""
                    ),
                ));
            };
            allowed_origins.push(normal);
        }
        for (token, client) in &self.tokens {
            if token.len() < 16 {
                return Err(invalid(
                    "webtransport.tokens",
                    format!(
                        "the token for {client:?} is shorter than 16 characters: too easy to guess"
                    ),
                ));
            }
            if client.trim().is_empty() {
                return Err(invalid(
                    "webtransport.tokens",
                    "a token with an empty client id",
                ));
            }
            if token.chars().any(char::is_control) {
                return Err(invalid(
                    "webtransport.tokens",
                    format!("the token for {client:?} has a control character"),
                ));
            }
        }
        Ok(WebTransportConfig {
            enabled: self.enabled,
            listen_addr,
            path_prefix: self.path_prefix.trim_end_matches('/').to_string(),
            allowed_origins,
            tokens: self.tokens.clone(),
            require_token: self.require_token,
        })
    }
}

impl WebTransportConfig {
    /// Is a page of `origin` (the `Origin` header; `None`: not a browser) allowed?
    pub fn origin_allowed(&self, origin: Option<&str>) -> bool {
        let Some(origin) = origin else {
            // Native WebTransport clients send no Origin: they are not pages another site
            // could make a visitor's browser open.
            return true;
        };
        let Some(origin) = normalized_origin(origin) else {
            // `null` (an opaque origin: a sandboxed frame, a file) or garbage.
            return self.allowed_origins.iter().any(|o| o == "*");
        };
        if self.allowed_origins.is_empty() {
            return is_local_origin(&origin);
        }
        self.allowed_origins
            .iter()
            .any(|o| o == "*" || *o == origin)
    }
}

/// `s` as a browser serializes an origin (lower-case ASCII host, punycode for a Unicode name, no
/// default port, no trailing `/`), so that a configured entry matches the `Origin` header
/// whatever way it was written. None if it is not an `http` or `https` origin: a path, query,
/// fragment or user name in it, or no host.
fn normalized_origin(s: &str) -> Option<String> {
    let u = url::Url::parse(s).ok()?;
    // A `*` in a host passes the URL syntax but is no host a browser sends (a pattern such as
    // `https://*.example.com` would never match).
    let plain = matches!(u.scheme(), "http" | "https")
        && u.host_str().is_some_and(|h| !h.contains('*'))
        && u.path() == "/"
        && u.query().is_none()
        && u.fragment().is_none()
        && u.username().is_empty()
        && u.password().is_none();
    plain.then(|| u.origin().ascii_serialization())
}

/// A page on this machine (a normalized origin): host `localhost` or a name under it (browsers
/// resolve `*.localhost` to loopback themselves), or a loopback address.
fn is_local_origin(origin: &str) -> bool {
    let Ok(u) = url::Url::parse(origin) else {
        return false;
    };
    match u.host() {
        Some(url::Host::Domain(d)) => d == "localhost" || d.ends_with(".localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// The certificate browsers get while the broker runs on a generated development certificate.
#[derive(Debug)]
pub struct BrowserCert {
    pub key: Arc<CertifiedKey>,
    /// SHA-256 of the certificate (DER): what a page passes as `serverCertificateHashes`.
    pub sha256: [u8; 32],
    pub not_after: std::time::SystemTime,
    /// The certificate, PEM.
    pub pem: String,
}

impl BrowserCert {
    /// A new ECDSA P-256 certificate for this machine's names, valid 13 days from now.
    pub fn generate() -> Result<BrowserCert, String> {
        let now = std::time::SystemTime::now();
        let not_after = now + BROWSER_CERT_VALID;
        let (cert, key) =
            crate::tls::dev_certificate_with("aqueduct development broker (browsers)", |params| {
                // A minute back: a browser whose clock is a little behind accepts it at once.
                params.not_before = (now - Duration::from_secs(60)).into();
                params.not_after = not_after.into();
            })?;
        let der = cert.der().clone();
        let pem = cert.pem();
        let digest = ring::digest::digest(&ring::digest::SHA256, &der);
        let mut sha256 = [0u8; 32];
        sha256.copy_from_slice(digest.as_ref());
        let private = rustls_pki_types::PrivateKeyDer::try_from(key.serialize_der())
            .map_err(|e| e.to_string())?;
        let key = CertifiedKey::from_der(vec![der], private, &crate::tls::provider())
            .map_err(|e| e.to_string())?;
        Ok(BrowserCert {
            key: Arc::new(key),
            sha256,
            not_after,
            pem,
        })
    }

    /// The hash as lowercase hex.
    pub fn sha256_hex(&self) -> String {
        self.sha256.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The current browser certificate (none with a certificate from files), swapped on renewal.
#[derive(Debug, Default)]
pub struct BrowserCerts {
    current: ArcSwapOption<BrowserCert>,
    /// The development certificate file, once written: it also holds the current browser
    /// certificate (so the Rust client's default trust works over WebTransport too), and is
    /// rewritten at each renewal.
    dev_cert: std::sync::Mutex<Option<crate::tls::DevCert>>,
    /// The file does not hold the current certificate (its write at a renewal failed): written
    /// again at each look until it does.
    file_stale: std::sync::atomic::AtomicBool,
}

impl BrowserCerts {
    pub fn current(&self) -> Option<Arc<BrowserCert>> {
        self.current.load_full()
    }

    /// Make and install a new one.
    pub fn renew(&self) -> Result<(), String> {
        let cert = BrowserCert::generate()
            .map_err(|e| format!("renewing the browsers' certificate failed: {e}"))?;
        info!(
            sha256 = %cert.sha256_hex(),
            "WebTransport: a new certificate for browsers (GET /webtransport/cert-hash)"
        );
        self.current.store(Some(Arc::new(cert)));
        self.write_file()
    }

    /// Write the development certificate file with the current browser certificate (nothing
    /// without the file). On failure the file is marked stale and written again at the next
    /// look ([`keep_renewed`](Self::keep_renewed)): clients trusting it would otherwise fail
    /// with an unknown issuer until the next renewal, days later.
    fn write_file(&self) -> Result<(), String> {
        let pem = self.current().map(|c| c.pem.clone()).unwrap_or_default();
        let dev = self
            .dev_cert
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(dev) = dev else {
            return Ok(());
        };
        let written = dev.write_with(&pem).map_err(|e| {
            format!(
                "the browsers' certificate is in use, but writing it to the development \
                 certificate file failed (tried again every 10 minutes): {e}"
            )
        });
        self.file_stale
            .store(written.is_err(), std::sync::atomic::Ordering::Release);
        written
    }

    /// One look of [`keep_renewed`](Self::keep_renewed), on a thread that may block (file I/O
    /// under a lock other brokers share): renew if due, else write a stale file again.
    fn look(&self, now: std::time::SystemTime) {
        let due = self.current().is_none_or(|c| renewal_due(&c, now));
        if due {
            if let Err(e) = self.renew() {
                warn!("WebTransport: {e}");
            }
        } else if self.file_stale.load(std::sync::atomic::Ordering::Acquire) {
            match self.write_file() {
                Ok(()) => info!("WebTransport: the development certificate file holds the browsers' certificate again"),
                Err(e) => warn!("WebTransport: writing the browsers' certificate to the development certificate file failed again: {e}"),
            }
        }
    }

    /// Write the development certificate file with the browser certificate after it; again at
    /// every renewal.
    pub fn publish_with(&self, dev: crate::tls::DevCert) -> Result<(), crate::tls::TlsError> {
        let pem = self.current().map(|c| c.pem.clone()).unwrap_or_default();
        dev.write_with(&pem)?;
        *self.dev_cert.lock().unwrap_or_else(|e| e.into_inner()) = Some(dev);
        Ok(())
    }

    /// Renew [`BROWSER_CERT_RENEW`] after each certificate was made (runs until dropped). The
    /// wall clock decides, looked at every [`RENEW_CHECK`]: a runtime timer does not count the
    /// time a machine sleeps (a laptop), while the certificate's validity does. A failed renewal,
    /// or a failed write of the file after one, is tried again at the next look. Each look runs
    /// on a blocking thread: it writes the file under a lock other brokers share.
    pub async fn keep_renewed(self: Arc<Self>) {
        loop {
            tokio::time::sleep(RENEW_CHECK).await;
            let me = self.clone();
            let _ =
                tokio::task::spawn_blocking(move || me.look(std::time::SystemTime::now())).await;
        }
    }
}

/// Presents the browser certificate to connections that offer `h3` (when there is one), and
/// otherwise what `inner` would.
#[derive(Debug)]
pub struct ForBrowsers {
    pub inner: Arc<dyn ResolvesServerCert>,
    pub certs: Arc<BrowserCerts>,
    /// The server's ALPN protocols, in its order of preference.
    pub alpn: Vec<Vec<u8>>,
}

impl ResolvesServerCert for ForBrowsers {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // Only a connection that will speak h3: a client offering `aqueduct-v1` too gets
        // `aqueduct-v1` (the broker prefers it) and the certificate its clients trust.
        if crate::tls::chosen_alpn(&self.alpn, &hello) == Some(H3_ALPN) {
            if let Some(c) = self.certs.current() {
                return Some(c.key.clone());
            }
        }
        self.inner.resolve(hello)
    }
}

/// Why a session request is refused: the HTTP status and what the log says.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub why: String,
}

/// Decide a session request: its origin (first: a page of another site learns nothing of the
/// configuration, such as the path prefix), path and token. `Ok(client id)` (`None`: anonymous).
pub fn admit(
    config: &WebTransportConfig,
    url: &url::Url,
    origin: Option<&str>,
) -> Result<Option<String>, Refusal> {
    if !config.origin_allowed(origin) {
        return Err(Refusal {
            status: 403,
            why: format!(
                "origin {:?} is not in webtransport.allowed_origins",
                origin.unwrap_or("")
            ),
        });
    }
    let path = url.path();
    let prefix = &config.path_prefix;
    let under = path == prefix
        || path
            .strip_prefix(prefix.as_str())
            .is_some_and(|rest| rest.starts_with('/'))
        || prefix.is_empty();
    if !under {
        return Err(Refusal {
            status: 404,
            why: format!("path {path:?} is not under webtransport.path_prefix {prefix:?}"),
        });
    }
    let token = url
        .query_pairs()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned());
    match token {
        None if config.require_token => Err(Refusal {
            status: 401,
            why: "a token is required (webtransport.require_token)".into(),
        }),
        None => Ok(None),
        Some(t) => match known_token(&config.tokens, &t) {
            Some(client) => Ok(Some(client.clone())),
            None => Err(Refusal {
                status: 401,
                why: "unknown token (webtransport.tokens)".into(),
            }),
        },
    }
}

/// The client `token` names. Every known token is compared, each in time that does not depend
/// on where it differs (a hash map's lookup compares the bytes of a stored key until the first
/// that differs: a guesser timing many requests learns a token's bytes one by one).
fn known_token<'a>(tokens: &'a HashMap<String, String>, token: &str) -> Option<&'a String> {
    let mut found = None;
    for (known, client) in tokens {
        if same_bytes(known.as_bytes(), token.as_bytes()) {
            found = Some(client);
        }
    }
    found
}

/// `a == b`, in time that depends on their lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let differ = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(differ) == 0
}

/// How long a refused session's connection stays open for the client to read the HTTP status.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);

/// Answer a session request the broker does not admit. A browser's (it sent an `Origin`) gets a
/// session that is closed at once with code NOT_AUTHORIZED (400, as a native connection the
/// broker refuses) and a reason naming the status: browsers show a page no HTTP status
/// (Chromium: net::ERR_METHOD_NOT_SUPPORTED, whatever it was), but `WebTransport.closed`
/// resolves with a session's close code and reason. The session selects no
/// subprotocol, so a client that offered `aqueduct-v1` knows at `ready` that it was refused.
/// Other clients get the status as the CONNECT response (protocol.md §12).
///
/// A status response keeps the HTTP/3 control streams open until the client closes (it does at
/// once) or REFUSAL_LINGER ends (a closed session's connection is closed by web-transport-quinn
/// itself, max(3 RTT, 100 ms) after its close message): closing them with the response (`Request::reject`) made a browser report
/// a broken connection (QUIC_HTTP_CLOSED_CRITICAL_STREAM). Bounded: a client that gives the
/// response no stream credit must not hold this task (and a connection slot) forever. A
/// shutdown ends both waits: the connection is then closed with SHUTTING_DOWN.
async fn refuse(
    conn: quinn::Connection,
    request: web_transport_quinn::Request,
    browser: bool,
    refusal: Refusal,
    timeout: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    use web_transport_quinn::http::StatusCode;
    let response = if browser {
        web_transport_quinn::proto::ConnectResponse::OK
    } else {
        StatusCode::from_u16(refusal.status)
            .unwrap_or(StatusCode::FORBIDDEN)
            .into()
    };
    let mut stopping = shutdown.clone();
    let responded = tokio::select! {
        r = tokio::time::timeout(timeout, request.respond(response)) => match r {
            Ok(r) => r.ok(),
            // Not taken in time (the client gives the response no room): closed as any setup
            // that does not finish in time is (§1.1: 100, "handshake timed out").
            Err(_) => {
                let remote = crate::connection::canonical(conn.remote_address());
                close_unestablished(&conn, &shutdown, remote);
                return;
            }
        },
        _ = stopping.wait_for(|s| *s) => None,
    };
    if let Some(session) = responded {
        if browser {
            let reason = format!(
                "WebTransport session refused ({}): {}",
                refusal.status, refusal.why
            );
            session.close(
                u32::from(aqueduct_proto::ErrorCode::NOT_AUTHORIZED.0),
                crate::connection::close_reason(&reason),
            );
        }
        tokio::select! {
            _ = tokio::time::timeout(REFUSAL_LINGER, conn.closed()) => {}
            _ = shutdown.wait_for(|s| *s) => {}
        }
        drop(session);
    }
    if *shutdown.borrow() {
        conn.close(
            aqueduct_proto::ErrorCode::SHUTTING_DOWN.0.into(),
            b"broker shutting down",
        );
    } else {
        conn.close(0u32.into(), b"WebTransport session refused");
    }
}

/// One step of a session's setup (`what`), bounded by the connection's handshake deadline and
/// the broker's shutdown. `None` if it failed or did not finish: counted as a failed handshake,
/// the connection closed if it is still open.
async fn setup_step<T, E: std::fmt::Display>(
    step: impl std::future::Future<Output = Result<T, E>>,
    what: &str,
    (conn, shared, shutdown, deadline): (
        &quinn::Connection,
        &crate::server::Shared,
        &tokio::sync::watch::Receiver<bool>,
        tokio::time::Instant,
    ),
) -> Option<T> {
    let remote = crate::connection::canonical(conn.remote_address());
    let done = tokio::select! {
        r = step => Some(r),
        () = deadline_or_shutdown(deadline, shutdown.clone()) => None,
    };
    let failed = || {
        shared
            .stats
            .handshakes_failed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    };
    match done {
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            debug!(%remote, "WebTransport {what} failed: {e}");
            failed();
            // With the reason: left to the connection's last handle, the close carried code 0
            // and none.
            let reason = format!("WebTransport {what} failed: {e}");
            conn.close(
                aqueduct_proto::ErrorCode::MALFORMED_FRAME.0.into(),
                crate::connection::close_reason(&reason),
            );
            None
        }
        None => {
            failed();
            close_unestablished(conn, shutdown, remote);
            None
        }
    }
}

/// Close a connection whose session was not set up by its handshake deadline, or by the
/// broker's shutdown: code 501 then, else 100 `handshake timed out` (protocol.md 1.1).
fn close_unestablished(
    conn: &quinn::Connection,
    shutdown: &tokio::sync::watch::Receiver<bool>,
    remote: std::net::SocketAddr,
) {
    if *shutdown.borrow() {
        conn.close(
            aqueduct_proto::ErrorCode::SHUTTING_DOWN.0.into(),
            b"broker shutting down",
        );
    } else {
        debug!(%remote, "WebTransport handshake timed out");
        conn.close(
            aqueduct_proto::ErrorCode::MALFORMED_FRAME.0.into(),
            b"handshake timed out",
        );
    }
}

/// Until `deadline`, or the broker's shutdown.
async fn deadline_or_shutdown(
    deadline: tokio::time::Instant,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => {}
        _ = shutdown.wait_for(|s| *s) => {}
    }
}

/// One browser's (or native WebTransport client's) session: the HTTP/3 handshake, the checks,
/// then each bidirectional stream to the stream task, until the session ends.
pub(crate) async fn serve(
    conn: quinn::Connection,
    shared: Arc<crate::server::Shared>,
    state: Arc<crate::connection::ConnState>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    deadline: tokio::time::Instant,
) {
    let remote = crate::connection::canonical(conn.remote_address());
    conn.set_max_concurrent_uni_streams(H3_UNI_STREAMS.into());
    // The HTTP/3 setup and the session's CONNECT count against the connection's handshake
    // deadline (`transport.handshake_timeout`, from its first packet), as a native client's
    // handshake does; a shutdown ends the wait too.
    let Some(request) = setup_step(
        web_transport_quinn::Request::accept(conn.clone()),
        "handshake",
        (&conn, &shared, &shutdown, deadline),
    )
    .await
    else {
        return;
    };
    let origin = request
        .headers
        .get("origin")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let client = match admit(&shared.config.webtransport, &request.url, origin.as_deref()) {
        Ok(c) => c,
        Err(refusal) => {
            warn!(%remote, status = refusal.status, "WebTransport session refused: {}", refusal.why);
            shared
                .stats
                .webtransport_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            refuse(conn, request, origin.is_some(), refusal, left, shutdown).await;
            return;
        }
    };
    let wants_ours = request.protocols.iter().any(|p| p == SUBPROTOCOL);
    let mut response = web_transport_quinn::proto::ConnectResponse::OK;
    if wants_ours {
        response = response.with_protocol(SUBPROTOCOL);
    }
    let Some(session) = setup_step(
        request.respond(response),
        "session setup",
        (&conn, &shared, &shutdown, deadline),
    )
    .await
    else {
        return;
    };
    shared
        .stats
        .webtransport_sessions
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::connection::serve_webtransport(session, conn, client, state, shared, shutdown).await;
}

impl crate::stream::SendHalf for web_transport_quinn::SendStream {
    async fn write_some(
        &mut self,
        chunk: &mut bytes::Bytes,
    ) -> Result<(), crate::stream::WriteFailure> {
        // `write_chunks` advances a partly written chunk in place, and is cancel safe.
        web_transport_quinn::SendStream::write_chunks(self, std::slice::from_mut(chunk))
            .await
            .map(drop)
            .map_err(|e| match e {
                web_transport_quinn::WriteError::Stopped(_) => crate::stream::WriteFailure::Stopped,
                e => crate::stream::WriteFailure::Gone(e.to_string()),
            })
    }

    async fn stopped(&mut self) -> Option<String> {
        match web_transport_quinn::SendStream::stopped(self).await {
            Ok(Some(code)) => Some(format!("STOP_SENDING with code {code}")),
            // The session or the stream ended otherwise: not the client stopping a stream.
            _ => None,
        }
    }

    fn reset(&mut self, code: u32) {
        // Browsers see one byte of a stream's code (protocol.md §12).
        let code = aqueduct_proto::ErrorCode(u16::try_from(code).unwrap_or(0));
        let _ =
            web_transport_quinn::SendStream::reset(self, u32::from(code.to_webtransport_stream()));
    }

    fn finish(&mut self) {
        let _ = web_transport_quinn::SendStream::finish(self);
    }
}

/// A WebTransport stream's receiving half as the stream task uses it: when it is let go of
/// before the client finished it (a stream-fatal framing error, the shutdown), the broker's
/// STOP_SENDING carries WebTransport's code 0 (protocol.md 1.1, 12). Dropped as it is, the
/// library's half left quinn to send a raw QUIC 0, which is no WebTransport code: a client
/// decoding it saw none.
pub(crate) struct WtRecv(pub web_transport_quinn::RecvStream);

impl Drop for WtRecv {
    fn drop(&mut self) {
        // Nothing is sent for a stream already finished and read, or reset.
        let _ = self.0.stop(0);
    }
}

impl tokio::io::AsyncRead for WtRecv {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl crate::stream::RecvHalf for WtRecv {
    async fn reset(&mut self) {
        // `Ok(None)`: finished and read, stopped, or reset with a code outside WebTransport's.
        if let Ok(None) = self.0.received_reset().await {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renewal whose write of the development certificate file failed writes it again at the
    /// next look, although no renewal is due then. It was left stale until the next renewal
    /// (6 days), and clients trusting the file failed with an unknown issuer meanwhile.
    #[test]
    fn a_failed_write_of_the_certificate_file_is_tried_again_at_the_next_look() {
        let dir = tempfile::tempdir().expect("dir");
        // Its parent is a file, so it cannot be written until that is gone.
        let blocker = dir.path().join("home");
        std::fs::write(&blocker, "not a directory").expect("write");
        let certs = BrowserCerts::default();
        *certs.dev_cert.lock().expect("lock") =
            Some(crate::tls::DevCert::at(blocker.join("dev-cert.pem")));
        assert!(certs.renew().is_err(), "the write failed");
        std::fs::remove_file(&blocker).expect("remove");
        certs.look(std::time::SystemTime::now());
        let file = std::fs::read_to_string(blocker.join("dev-cert.pem")).expect("written now");
        let current = certs.current().expect("a certificate");
        assert!(
            file.contains(current.pem.trim()),
            "it holds the current certificate"
        );
    }

    /// Renewal follows the wall clock: a certificate made 6 days ago is due whatever the
    /// runtime's timers counted (they stop while a machine sleeps), a fresh one is not.
    #[test]
    fn renewal_is_due_by_the_wall_clock() {
        let cert = BrowserCert::generate().expect("a certificate");
        let now = std::time::SystemTime::now();
        assert!(!renewal_due(&cert, now), "fresh");
        assert!(!renewal_due(
            &cert,
            now + BROWSER_CERT_RENEW - Duration::from_secs(60)
        ));
        assert!(renewal_due(
            &cert,
            now + BROWSER_CERT_RENEW + Duration::from_secs(60)
        ));
        assert!(
            renewal_due(&cert, cert.not_after),
            "never presented expired"
        );
    }

    fn url(s: &str) -> url::Url {
        url::Url::parse(s).expect("url")
    }

    /// A token is found only when every byte matches (the comparison does not stop early).
    #[test]
    fn tokens_are_matched_whole() {
        let tokens: HashMap<String, String> = [
            ("0123456789abcdef".to_string(), "a".to_string()),
            ("0123456789abcdeg".to_string(), "b".to_string()),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            known_token(&tokens, "0123456789abcdef"),
            Some(&"a".to_string())
        );
        assert_eq!(
            known_token(&tokens, "0123456789abcdeg"),
            Some(&"b".to_string())
        );
        for unknown in [
            "0123456789abcdeh",
            "0123456789abcde",
            "0123456789abcdef0",
            "",
            "x",
        ] {
            assert_eq!(known_token(&tokens, unknown), None, "{unknown:?}");
        }
        assert!(same_bytes(b"", b""));
        assert!(!same_bytes(b"a", b"b"));
    }

    #[test]
    fn sessions_are_admitted_by_path_origin_and_token() {
        let mut cfg = WebTransportConfig::default();
        let base = "https://127.0.0.1:4242/aqueduct/wt";
        assert_eq!(admit(&cfg, &url(base), None), Ok(None));
        assert_eq!(admit(&cfg, &url(&format!("{base}/x")), None), Ok(None));
        // With `require_token`, a session without one is refused (401); a known one passes.
        let mut strict = cfg.clone();
        strict.require_token = true;
        strict
            .tokens
            .insert("0123456789abcdef".into(), "web".into());
        let refused = admit(&strict, &url(base), None).expect_err("no token");
        assert_eq!(refused.status, 401);
        assert!(
            refused.why.contains("webtransport.require_token"),
            "{}",
            refused.why
        );
        assert_eq!(
            admit(
                &strict,
                &url(&format!("{base}?token=0123456789abcdef")),
                None
            ),
            Ok(Some("web".to_string()))
        );
        assert_eq!(
            admit(&cfg, &url("https://127.0.0.1:4242/aqueduct/wtx"), None).map_err(|r| r.status),
            Err(404)
        );
        assert_eq!(
            admit(&cfg, &url(base), Some("http://localhost:8080")),
            Ok(None)
        );
        assert_eq!(admit(&cfg, &url(base), Some("https://[::1]")), Ok(None));
        // Browsers resolve names under localhost to loopback: the live view treats them as
        // local, and so does the broker.
        assert_eq!(
            admit(&cfg, &url(base), Some("http://dev.localhost:3000")),
            Ok(None)
        );
        assert_eq!(admit(&cfg, &url(base), Some("http://127.0.0.2")), Ok(None));
        // Another site's page is refused for its origin before anything else, and the reason
        // names none of the configuration (the path prefix).
        let other_site = admit(
            &cfg,
            &url("https://127.0.0.1:4242/elsewhere"),
            Some("https://evil.example"),
        )
        .expect_err("refused");
        assert_eq!(other_site.status, 403);
        assert!(!other_site.why.contains("/aqueduct"), "{}", other_site.why);
        for bad in [
            "https://evil.example",
            "http://localhost.evil.example",
            "http://evil-localhost",
            "null",
            "not an origin",
        ] {
            assert_eq!(
                admit(&cfg, &url(base), Some(bad)).map_err(|r| r.status),
                Err(403),
                "{bad}"
            );
        }
        // Entries as written in a config file (upper case, a default port, a trailing slash, a
        // Unicode name) match the Origin header a browser sends for them.
        let section = WebTransportSection {
            allowed_origins: vec![
                "https://App.Example.com:443/".into(),
                "https://bücher.example:8443".into(),
            ],
            ..Default::default()
        };
        cfg.allowed_origins = section.validate().expect("origins").allowed_origins;
        for ok in [
            "https://app.example.com",
            "https://xn--bcher-kva.example:8443",
        ] {
            assert_eq!(admit(&cfg, &url(base), Some(ok)), Ok(None), "{ok}");
        }
        for bad in [
            "http://app.example.com",
            "https://app.example.com:8443",
            "https://xn--bcher-kva.example",
            "http://localhost:8080",
        ] {
            assert!(admit(&cfg, &url(base), Some(bad)).is_err(), "{bad}");
        }
        cfg.tokens
            .insert("0123456789abcdef-browser".into(), "dashboard".into());
        assert_eq!(
            admit(
                &cfg,
                &url(&format!("{base}?token=0123456789abcdef-browser")),
                None
            ),
            Ok(Some("dashboard".into()))
        );
        assert_eq!(
            admit(&cfg, &url(&format!("{base}?token=guess")), None).map_err(|r| r.status),
            Err(401)
        );
    }

    #[test]
    fn bad_settings_name_their_key() {
        let refused = |s: &WebTransportSection| s.validate().expect_err("refused").to_string();
        let mut s = WebTransportSection {
            listen_addr: "not an address".into(),
            ..Default::default()
        };
        assert!(refused(&s).contains("webtransport.listen_addr"));
        s.listen_addr = ":4443".into();
        assert_eq!(
            s.validate().expect("a port of its own").listen_addr,
            Some("[::]:4443".parse().expect("addr"))
        );
        s.listen_addr.clear();
        // Entries that could never equal an Origin header are refused, naming the key.
        for bad in [
            "app.example.com",
            "https://*.example.com",
            "https://app.example.com/app",
            "https://app.example.com?x=1",
            "https://user@app.example.com",
            "ftp://app.example.com",
            "null",
        ] {
            s.allowed_origins = vec![bad.into()];
            assert!(
                refused(&s).contains("webtransport.allowed_origins"),
                "{bad}"
            );
        }
        s.allowed_origins = vec!["*".into()];
        s.tokens.insert("short".into(), "x".into());
        assert!(refused(&s).contains("webtransport.tokens"));
        s.tokens.clear();
        // A control character can be in no URL: refused. Others a page must URL-encode (the
        // JS client does): warned about (`Config::warnings`).
        s.tokens.insert("0123456789abcdef\nx".into(), "x".into());
        assert!(refused(&s).contains("control character"));
        s.tokens.clear();
        s.tokens.insert("0123456789abcdef+/=".into(), "x".into());
        s.validate().expect("a base64 token is accepted");
        s.tokens.clear();
        s.path_prefix = "wt".into();
        assert!(refused(&s).contains("path_prefix"));
        // What a request's percent-encoded path cannot hold as written.
        for bad in ["/my wt", "/caf\u{e9}", "/a%20b", "/wt?x", "/wt#x"] {
            s.path_prefix = bad.into();
            assert!(refused(&s).contains("no request's path can match"), "{bad}");
        }
        s.path_prefix = "/api/v1.2/wt-x_y~z".into();
        s.validate().expect("letters, digits and / - . _ ~");
    }

    #[test]
    fn a_browser_certificate_is_short_lived_ecdsa() {
        let c = BrowserCert::generate().expect("generates");
        let der = &c.key.cert[0];
        let (_, x509) = x509_parser::parse_x509_certificate(der).expect("parses");
        let v = x509.validity();
        let days = (v.not_after.timestamp() - v.not_before.timestamp()) / 86_400;
        assert!(days < 14, "valid {days} days");
        assert_eq!(
            x509.public_key().algorithm.algorithm.to_id_string(),
            "1.2.840.10045.2.1",
            "an EC key"
        );
        assert_eq!(c.sha256_hex().len(), 64);
    }
}
