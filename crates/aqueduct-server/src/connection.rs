//! One client connection: handshake (with a timeout), 0-RTT gating, the client id from mTLS, the
//! table of its subscriptions by `stream_id`, and one task per stream.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use aqueduct_core::quota::Bucket;
use aqueduct_core::{PublishContext, Subscriber};
use aqueduct_proto::ErrorCode;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::server::Shared;
use crate::stream::{self, StreamOut};
use crate::tls;

/// How long the broker waits, on shutdown, for a connection's streams to flush.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// A subscription as the connection knows it: the subscriber and the writer that serves it.
#[derive(Debug, Clone)]
pub(crate) struct SubEntry {
    pub sub: Arc<Subscriber>,
    pub out: Arc<StreamOut>,
}

/// Why a subscription was not registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AddSubError {
    /// A live subscription already uses the stream id.
    InUse,
    /// `transport.max_subscriptions_per_connection` reached.
    Limit,
}

/// A connection's subscriptions by stream id, and when they were last swept at the limit.
#[derive(Debug, Default)]
struct Subs {
    by_id: HashMap<u32, SubEntry>,
    /// The connection's count of closed subscriptions ([`ConnState::sub_closes`]) when a sweep
    /// last left `by_id` at the limit (every entry live): until it moves, no entry can have
    /// closed, and a sweep would find nothing to drop.
    full_at: Option<u64>,
}

impl std::ops::Deref for Subs {
    type Target = HashMap<u32, SubEntry>;
    fn deref(&self) -> &Self::Target {
        &self.by_id
    }
}

impl std::ops::DerefMut for Subs {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.by_id
    }
}

/// Is there room in `subs` for a subscription with `stream_id`?
/// `closes`: the connection's count of closed subscriptions now.
fn room_for_sub(
    subs: &mut Subs,
    closes: u64,
    stream_id: u32,
    max: usize,
) -> Result<(), AddSubError> {
    if subs.get(&stream_id).is_some_and(|e| !e.sub.is_closed()) {
        return Err(AddSubError::InUse);
    }
    if subs.len() >= max {
        // Only at the limit, so that a connection's SUBSCRIBEs cost O(1) each in the common
        // case; and only if one of its subscriptions closed since the last sweep found none
        // closed, so that SUBSCRIBEs streamed at a full table are refused in O(1) too, not a
        // walk each (other connections' subscriptions coming and going do not count).
        if subs.full_at != Some(closes) {
            subs.retain(|_, e| !e.sub.is_closed());
            subs.full_at = (subs.len() >= max).then_some(closes);
        }
        if subs.len() >= max {
            return Err(AddSubError::Limit);
        }
    }
    Ok(())
}

/// State shared by the streams of one connection.
#[derive(Debug)]
pub(crate) struct ConnState {
    /// Unique for the broker's life (admin API: list, disconnect).
    pub id: u64,
    pub remote: SocketAddr,
    pub client_id: OnceLock<String>,
    pub connected_at: SystemTime,
    /// Messages published and deliveries written, for the admin API.
    pub published: AtomicU64,
    pub delivered: AtomicU64,
    /// The client's publish quota bucket (shared by its connections), once identified.
    pub bucket: OnceLock<Arc<Bucket>>,
    /// The connection itself, once established (the admin API closes it).
    pub conn: OnceLock<quinn::Connection>,
    /// Subscriptions by the `stream_id` of their SUBSCRIBE frame: ACK, NACK and UNSUBSCRIBE name
    /// them that way, on any stream. Locked briefly by the streams of this connection only; a
    /// SUBSCRIBE holds it while the broker registers the subscription (lock order: this, then
    /// the broker's routing lock; nothing takes them the other way round).
    subs: Mutex<Subs>,
    /// Counted up by each of the connection's subscriptions as it closes (see [`Subs`]).
    sub_closes: Arc<AtomicU64>,
    confirmed: AtomicBool,
    confirmed_notify: Notify,
    /// [`ConnState::disconnect_with`]'s code and reason; the connection's task closes the
    /// session with them.
    close_reason: Mutex<Option<(ErrorCode, String)>>,
    close_requested: Notify,
}

impl ConnState {
    /// The state of a connection just accepted: no identity, no subscriptions yet.
    pub(crate) fn new(id: u64, remote: SocketAddr) -> ConnState {
        ConnState {
            id,
            remote,
            client_id: OnceLock::new(),
            connected_at: SystemTime::now(),
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            bucket: OnceLock::new(),
            conn: OnceLock::new(),
            subs: Mutex::default(),
            sub_closes: Arc::default(),
            confirmed: AtomicBool::new(false),
            confirmed_notify: Notify::new(),
            close_reason: Mutex::new(None),
            close_requested: Notify::new(),
        }
    }

    /// Close the connection with application code 0 and `reason` (an administrator's
    /// disconnect): through the session, so that a WebTransport client gets the session's
    /// close message (its code and reason), not a bare connection close.
    pub(crate) fn disconnect(&self, reason: String) {
        self.disconnect_with(ErrorCode(0), reason);
    }

    /// Close the connection with application code `code` and `reason` (see
    /// [`disconnect`](Self::disconnect)).
    pub(crate) fn disconnect_with(&self, code: ErrorCode, reason: String) {
        *self.close_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some((code, reason));
        // A stored permit if the task is not waiting right now.
        self.close_requested.notify_one();
    }

    fn lock(&self) -> MutexGuard<'_, Subs> {
        self.subs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live subscription registered under `stream_id`. One the broker has closed (a slow
    /// consumer) is forgotten here, so ACK, NACK and UNSUBSCRIBE naming it get NOT_SUBSCRIBED.
    pub(crate) fn sub(&self, stream_id: u32) -> Option<SubEntry> {
        let mut subs = self.lock();
        match subs.get(&stream_id) {
            Some(e) if e.sub.is_closed() => {
                subs.remove(&stream_id);
                None
            }
            other => other.cloned(),
        }
    }

    /// Register the subscription `make` creates, unless `stream_id` is already in use by a live
    /// one or the connection has `max` subscriptions. Check and insert happen under one lock
    /// (held while `make` runs), so two SUBSCRIBEs with the same id cannot both succeed.
    /// Subscriptions the broker closed meanwhile (slow consumers) do not count: a closed entry
    /// under the same id is replaced, and closed ones are dropped when the limit is reached, so
    /// the table cannot grow with dead entries.
    pub(crate) fn add_sub_with(
        &self,
        stream_id: u32,
        max: usize,
        make: impl FnOnce() -> SubEntry,
    ) -> Result<Arc<Subscriber>, AddSubError> {
        let mut subs = self.lock();
        let closes = self.sub_closes.load(Ordering::Acquire);
        room_for_sub(&mut subs, closes, stream_id, max)?;
        let entry = make();
        let sub = entry.sub.clone();
        subs.insert(stream_id, entry);
        Ok(sub)
    }

    /// What the connection's subscriptions count up as they close (their `closes` option).
    pub(crate) fn sub_closes(&self) -> Arc<AtomicU64> {
        self.sub_closes.clone()
    }

    /// Would [`add_sub_with`](Self::add_sub_with) take a subscription with `stream_id` now? A
    /// cheap early answer for a SUBSCRIBE that costs much to prepare (a new durable consumer
    /// from `latest`); `add_sub_with` checks again.
    pub(crate) fn room_for_sub(&self, stream_id: u32, max: usize) -> Result<(), AddSubError> {
        let closes = self.sub_closes.load(Ordering::Acquire);
        room_for_sub(&mut self.lock(), closes, stream_id, max)
    }

    /// Forget `sub` (only if it is still the one registered under `stream_id`). Returns whether
    /// this call removed it: with several paths that may end a subscription at once (an
    /// UNSUBSCRIBE on any stream, a revocation on its own), the one that removed it ends it.
    pub(crate) fn remove_sub(&self, stream_id: u32, sub: &Arc<Subscriber>) -> bool {
        let mut subs = self.lock();
        if subs
            .get(&stream_id)
            .is_some_and(|e| Arc::ptr_eq(&e.sub, sub))
        {
            subs.remove(&stream_id);
            return true;
        }
        false
    }

    /// Does the end of `sub`'s delivery stream (its reset, FIN or the connection's end) end
    /// it? Yes if this call takes it out of the table, or if the broker closed it already (a
    /// slow consumer, whose entry an ACK may have forgotten: its durable bookkeeping is left to
    /// the stream). No while it is live but no longer in the table: an UNSUBSCRIBE or a
    /// revocation took it out and is ending it, and must do so alone — ending it at the same
    /// time emptied its in-flight deliveries before a durable consumer's position was stored,
    /// so the stored position skipped its unsettled messages.
    pub(crate) fn end_with_stream(&self, sub: &Arc<Subscriber>) -> bool {
        self.remove_sub(sub.stream_id(), sub) || sub.is_closed()
    }

    /// Is the client's identity final (its certificate's CN read, or none)? From the listing
    /// in `identify` on: before every stream of a 1-RTT connection, after the handshake of a
    /// 0-RTT one (whose early SUBSCRIBEs run before it).
    pub(crate) fn is_identified(&self) -> bool {
        self.conn.get().is_some()
    }

    /// Is the TLS handshake confirmed (the client's identity final)?
    pub(crate) fn is_confirmed(&self) -> bool {
        self.confirmed.load(Ordering::Acquire)
    }

    /// Has it a live subscription?
    pub(crate) fn has_subs(&self) -> bool {
        self.lock().values().any(|e| !e.sub.is_closed())
    }

    /// The live subscriptions (admin API, ACL re-checks).
    pub(crate) fn subs(&self) -> Vec<SubEntry> {
        self.lock()
            .values()
            .filter(|e| !e.sub.is_closed())
            .cloned()
            .collect()
    }

    /// The ACL identity: the certificate's CN, or `anonymous`.
    pub(crate) fn identity(&self) -> &str {
        crate::access::identity(self.client_id.get().map(String::as_str))
    }

    fn take_subs(&self) -> Vec<SubEntry> {
        self.lock().drain().map(|(_, e)| e).collect()
    }

    fn confirm(&self) {
        self.confirmed.store(true, Ordering::Release);
        self.confirmed_notify.notify_waiters();
    }

    /// Wait until the TLS handshake is confirmed (immediately, unless the client used 0-RTT).
    pub(crate) async fn wait_confirmed(&self) {
        loop {
            let notified = self.confirmed_notify.notified();
            if self.confirmed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// `client-id@address` for logs.
    pub(crate) fn describe(&self) -> String {
        match self.client_id.get() {
            Some(id) => format!("{id}@{}", self.remote),
            None => self.remote.to_string(),
        }
    }
}

/// Decrements the live-connection count, and leaves the registry, however the task ends.
struct LiveGuard(Arc<Shared>, u64);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
        self.0
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// A stream task's end: a panic (a bug) is logged and counted, not lost with the task. Its
/// subscriptions ended with it (their guard runs as the task unwinds).
fn stream_task_ended(
    shared: &Shared,
    conn: &ConnState,
    joined: Result<(), tokio::task::JoinError>,
) {
    if let Err(e) = joined {
        if e.is_panic() {
            shared
                .stats
                .stream_task_panics
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!(client = %conn.describe(), "a stream task panicked (a bug, please report it): {e}; the connection goes on");
        }
    }
}

/// Serve one incoming connection to the end.
///
/// `webtransport_only`: it came in on `webtransport.listen_addr`, which serves browsers only.
pub(crate) async fn handle(
    incoming: quinn::Incoming,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
    webtransport_only: bool,
    over_limit: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    let conn_id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
    let _live = LiveGuard(shared.clone(), conn_id);
    let remote = canonical(incoming.remote_address());
    let failed = |why: String| {
        debug!(%remote, "handshake failed: {why}");
        shared
            .stats
            .handshakes_failed
            .fetch_add(1, Ordering::Relaxed);
    };
    let mut connecting = match incoming.accept() {
        Ok(c) => c,
        Err(e) => return failed(e.to_string()),
    };
    // One deadline for the whole handshake, however many steps wait on it.
    let deadline = tokio::time::Instant::now() + shared.config.transport.handshake_timeout;
    // The negotiated ALPN says what the connection is (a client's, a browser's HTTP/3, a
    // peer's), and it is known only once the whole ClientHello is in: a large one spans two
    // packets (Chromium's does, with its post-quantum key share), and before the second arrives
    // a browser's connection would be taken for a native one.
    // (The negotiated protocol only: the handshake data is not `Send`.)
    let alpn = match tokio::time::timeout_at(deadline, connecting.handshake_data()).await {
        Ok(Ok(h)) => h
            .downcast_ref::<quinn::crypto::rustls::HandshakeData>()
            .and_then(|h| h.protocol.clone()),
        Ok(Err(e)) => return failed(e.to_string()),
        Err(_) => return failed("timed out".into()),
    };
    // Let through beyond transport.max_connections for coming from a peer's address: only a
    // peer's connection may go on (it stops counting as a connection once the mesh has it).
    if over_limit.is_some() && alpn.as_deref() != Some(crate::mesh_tls::MESH_ALPN) {
        shared
            .stats
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        warn!(%remote, "connection refused: transport.max_connections reached");
        return;
    }
    // A browser's (with WebTransport on).
    let h3 =
        shared.config.webtransport.enabled && alpn.as_deref() == Some(crate::webtransport::H3_ALPN);
    if webtransport_only && !h3 {
        shared
            .stats
            .webtransport_refused
            .fetch_add(1, Ordering::Relaxed);
        debug!(%remote, "refused on webtransport.listen_addr: not HTTP/3");
        if let Ok(Ok(conn)) = tokio::time::timeout_at(deadline, connecting).await {
            conn.close(
                ErrorCode::UNSUPPORTED.0.into(),
                b"this port serves WebTransport (HTTP/3) only: native clients connect to the broker's listen_addr",
            );
        }
        return;
    }
    let state = Arc::new(ConnState::new(conn_id, remote));
    // With mTLS the client is unknown until the handshake completes: no early data then; nor
    // with the cluster on (a mesh connection is only known once it completes); nor for
    // WebTransport (a session starts with HTTP/3 requests, and is checked like any client
    // connection below: a peer certificate is no client identity).
    let early_data = !shared.config.tls.require_client_cert && shared.mesh.is_none() && !h3;
    // The rest of a 0-RTT handshake, run by the connection's own task (not a detached one).
    let mut confirming: Option<Confirming> = None;
    let conn = match connecting.into_0rtt() {
        Ok((conn, accepted)) if early_data => {
            // Early data is read now; the stream readers hold back what is unsafe to replay
            // until `confirm` runs.
            let (state, conn2, shared2) = (state.clone(), conn.clone(), shared.clone());
            confirming = Some(Box::pin(async move {
                // `accepted` also resolves when the handshake failed: then the connection
                // has a close reason (its bool only says whether 0-RTT data was taken).
                match tokio::time::timeout_at(deadline, accepted).await {
                    Ok(_) if handshake_outcome(conn2.close_reason()) == Handshake::Completed => {
                        // What early data it sent is held back until now: a peer certificate
                        // (no client identity) gets nothing of it handled.
                        if !refuse_peer_certificate(&conn2) && !refuse_unnamed_certificate(&conn2) {
                            admit(&conn2, &state, &shared2).await;
                        }
                    }
                    Ok(_) => {
                        if handshake_outcome(conn2.close_reason()) == Handshake::Failed {
                            shared2
                                .stats
                                .handshakes_failed
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        shared2
                            .stats
                            .handshakes_failed
                            .fetch_add(1, Ordering::Relaxed);
                        conn2.close(ErrorCode::MALFORMED_FRAME.0.into(), b"handshake timed out");
                    }
                }
            }));
            conn
        }
        Ok((conn, accepted)) => match tokio::time::timeout_at(deadline, accepted).await {
            // `accepted` also resolves when the handshake failed (e.g. no client certificate
            // where one is required): then the connection has a close reason, and it is not a
            // client that ever connected. (One that closed right after its handshake did
            // connect: it is served, and ends at once.)
            Ok(_) => match handshake_outcome(conn.close_reason()) {
                Handshake::Completed => conn,
                Handshake::ClosedHere => return,
                Handshake::Failed => {
                    let why = conn
                        .close_reason()
                        .map(|e| e.to_string())
                        .unwrap_or_default();
                    return failed(why);
                }
            },
            Err(_) => {
                conn.close(ErrorCode::MALFORMED_FRAME.0.into(), b"handshake timed out");
                return failed("timed out".into());
            }
        },
        Err(connecting) => match tokio::time::timeout_at(deadline, connecting).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return failed(e.to_string()),
            Err(_) => return failed("timed out".into()),
        },
    };
    if confirming.is_none() {
        // The handshake is complete: a peer's connection goes to the mesh, a browser's to
        // WebTransport; a client's is known by now.
        if divert(&conn, &shared) || refuse_unnamed_certificate(&conn) {
            return;
        }
        if h3 {
            // Boxed: its state would otherwise size every native connection's task too.
            return Box::pin(crate::webtransport::serve(
                conn, shared, state, shutdown, deadline,
            ))
            .await;
        }
        admit(&conn, &state, &shared).await;
    }
    // With 0-RTT the connection is served while its handshake completes (`confirming`, which
    // counts it as a connection or as a failed handshake).
    serve_streams(Session::Quic(conn), state, shared, shutdown, confirming).await;
}

/// A WebTransport session that was admitted (webtransport.rs): `client` is the id its token
/// names (`None`: anonymous, or its certificate's CN if it presented one). Served like a native
/// connection, stream by stream.
pub(crate) async fn serve_webtransport(
    session: web_transport_quinn::Session,
    conn: quinn::Connection,
    client: Option<String>,
    state: Arc<ConnState>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    if let Some(id) = client {
        let _ = state.client_id.set(id);
    }
    admit(&conn, &state, &shared).await;
    serve_streams(
        Session::WebTransport(Box::new(session), conn),
        state,
        shared,
        shutdown,
        None,
    )
    .await;
}

/// A stream a client opened.
enum Accepted {
    Quic(quinn::SendStream, quinn::RecvStream),
    WebTransport(
        web_transport_quinn::SendStream,
        web_transport_quinn::RecvStream,
    ),
}

/// The next stream the client opens; `Err`: the connection or session ended (why).
async fn accept_bi(session: &Session) -> Result<Accepted, String> {
    match session {
        Session::Quic(c) => c
            .accept_bi()
            .await
            .map(|(s, r)| Accepted::Quic(s, r))
            .map_err(|e| e.to_string()),
        Session::WebTransport(s, _) => s
            .accept_bi()
            .await
            .map(|(s, r)| Accepted::WebTransport(s, r))
            .map_err(|e| session_ended(&e)),
    }
}

/// How a 0-RTT connection's handshake ended, judged once it resolved.
#[derive(Debug, PartialEq, Eq)]
enum Handshake {
    Completed,
    /// The client refused the broker (its certificate, say), or was not heard from.
    Failed,
    /// The broker closed the connection itself (shutting down): neither.
    ClosedHere,
}

/// `reason`: the connection's close reason when its handshake resolved. A client's own
/// application close comes only in 0-RTT or 1-RTT packets (RFC 9000 §10.2.3): the client had
/// its keys, so a client that closes right after connecting still counts as a connection.
fn handshake_outcome(reason: Option<quinn::ConnectionError>) -> Handshake {
    match reason {
        None | Some(quinn::ConnectionError::ApplicationClosed(_)) => Handshake::Completed,
        Some(quinn::ConnectionError::LocallyClosed) => Handshake::ClosedHere,
        Some(_) => Handshake::Failed,
    }
}

/// Why a WebTransport session ended, for the log: a page's close (`WebTransport.close()`, the
/// tab closed) in plain words, not as an error.
fn session_ended(e: &web_transport_quinn::SessionError) -> String {
    use web_transport_quinn::{SessionError, WebTransportError};
    match e {
        SessionError::WebTransportError(WebTransportError::Closed(0, reason))
            if reason.is_empty() =>
        {
            "closed by the client".into()
        }
        SessionError::WebTransportError(WebTransportError::Closed(0, reason)) => {
            format!("closed by the client: {reason}")
        }
        SessionError::WebTransportError(WebTransportError::Closed(code, reason)) => {
            format!("closed by the client with code {code}: {reason}")
        }
        other => other.to_string(),
    }
}

/// What a connection's streams come from.
enum Session {
    /// An `aqueduct-v1` connection.
    Quic(quinn::Connection),
    /// A WebTransport session, and its QUIC connection (stream allowance, statistics).
    WebTransport(Box<web_transport_quinn::Session>, quinn::Connection),
}

impl Session {
    fn quic(&self) -> &quinn::Connection {
        match self {
            Session::Quic(c) | Session::WebTransport(_, c) => c,
        }
    }

    fn close(&self, code: ErrorCode, reason: &[u8]) {
        match self {
            Session::Quic(c) => c.close(code.0.into(), reason),
            Session::WebTransport(s, _) => s.close(u32::from(code.0), reason),
        }
    }
}

/// With the cluster on: hand a mesh connection (ALPN `aqueduct-mesh`, a certificate of the
/// cluster CA) to the mesh, or close a connection that may not be served; true if it is not a
/// client connection to serve. With the cluster off too, a peer certificate (one that names
/// `aqueduct-mesh`) is no client identity: such a connection is closed.
fn divert(conn: &quinn::Connection, shared: &Shared) -> bool {
    let (Some(mesh), Some(tls)) = (&shared.mesh, &shared.mesh_tls) else {
        return refuse_peer_certificate(conn);
    };
    if crate::mesh_tls::alpn(conn).as_deref() == Some(crate::mesh_tls::MESH_ALPN) {
        match tls.peer_of(conn) {
            Ok(node) => {
                conn.set_max_concurrent_uni_streams(crate::mesh::MESH_UNI_STREAMS.into());
                mesh.send(crate::mesh::Event::Accepted {
                    conn: conn.clone(),
                    node,
                });
            }
            Err(why) => refuse(conn, &why),
        }
        return true;
    }
    match tls.check_client(conn) {
        Ok(()) => false,
        Err(why) => {
            refuse(conn, &why);
            true
        }
    }
}

/// Close a connection whose client presents a peer certificate (one that names
/// `aqueduct-mesh`): no client identity, with the cluster on or off. True if it was closed.
fn refuse_peer_certificate(conn: &quinn::Connection) -> bool {
    if !crate::mesh_tls::presents_peer_certificate(conn) {
        return false;
    }
    refuse(conn, crate::mesh_tls::PEER_IS_NO_CLIENT);
    true
}

/// Close a connection whose client certificate verified but names no client: no Common Name the
/// broker can read (a certificate with subject alternative names only, or a CN in a string type
/// other than UTF8String, PrintableString or IA5String). It was served as `anonymous`, silently
/// sharing that identity's rules and quota. True if it was closed.
fn refuse_unnamed_certificate(conn: &quinn::Connection) -> bool {
    if conn.peer_identity().is_none() || tls::client_common_name(conn).is_some() {
        return false;
    }
    refuse(conn, UNNAMED_CERTIFICATE);
    true
}

/// Why a client certificate without a readable Common Name is refused.
pub(crate) const UNNAMED_CERTIFICATE: &str = "the client certificate has no Common Name (CN) \
     the broker can read (exactly one, a UTF8String, PrintableString or IA5String): the CN \
     names the client for ACL rules and quotas (`aqueduct cert client NAME` makes one)";

/// Close a connection that may not be served (NOT_AUTHORIZED), saying why.
fn refuse(conn: &quinn::Connection, why: &str) {
    warn!(remote = %canonical(conn.remote_address()), "connection refused: {why}");
    conn.close(ErrorCode::NOT_AUTHORIZED.0.into(), why.as_bytes());
}

/// The longest close reason sent: a QUIC CONNECTION_CLOSE must fit one packet, and a
/// WebTransport session's close message allows 1024 bytes.
const MAX_CLOSE_REASON: usize = 512;

/// `reason`, cut to [`MAX_CLOSE_REASON`] bytes at a character boundary.
pub(crate) fn close_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// How long a closing WebTransport session waits for the peer to take the close message.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The end of a 0-RTT handshake: identifies the client and releases held-back early data.
type Confirming = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// [`identify`] the connection and, unless it must not be served, confirm it (what its 0-RTT
/// frames wait for) and count it as a connection.
async fn admit(conn: &quinn::Connection, state: &Arc<ConnState>, shared: &Arc<Shared>) {
    if identify(conn, state, shared).await {
        state.confirm();
        shared
            .stats
            .connections_total
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Learn who the client is (its certificate's CN), give it its quota bucket and list it.
/// False if it must not be served (its certificate is revoked: closing, see `serve_streams`);
/// it is then never confirmed, so nothing it sent in 0-RTT data that waits for confirmation is
/// handled.
async fn identify(conn: &quinn::Connection, state: &Arc<ConnState>, shared: &Arc<Shared>) -> bool {
    if let Some(cn) = tls::client_common_name(conn) {
        let _ = state.client_id.set(cn);
    }
    let _ = state
        .bucket
        .set(shared.access.quotas.bucket(state.identity()));
    let _ = state.conn.set(conn.clone());
    shared
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(state.id, state.clone());
    info!(client = %state.describe(), "connected");
    // A certificate revoked by a list reloaded during this handshake (checked against the old
    // lists), or a resumed session's (resumption does not verify the certificate again): the
    // reload's walk of the connections may have missed this one, not listed yet.
    if crate::server::close_if_revoked(shared, state)
        || crate::server::close_if_expired(shared, state)
    {
        return false;
    }
    // SUBSCRIBEs in 0-RTT data run before this, unchecked while the ACL is off. If a reload
    // turned it on meanwhile, its re-check did not see this connection (not listed yet): check
    // them now. A change after the listing above re-checks this connection itself.
    crate::admin::recheck_connection(shared, state).await;
    true
}

async fn serve_streams(
    session: Session,
    state: Arc<ConnState>,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
    mut confirming: Option<Confirming>,
) {
    let mut streams = JoinSet::new();
    // Streams the client may open at once: raised (doubled, up to the configured maximum) when
    // half are in use, so an idle connection keeps little per-stream state (server.rs).
    // A WebTransport session's own CONNECT stream is one of the connection's bidirectional
    // streams: allowed on top, so a page may open as many streams as a native client.
    let connect_stream = u32::from(matches!(session, Session::WebTransport(..)));
    let max_streams = shared.config.transport.max_streams_per_connection + connect_stream;
    let mut allowed = crate::server::initial_streams(&shared.config.transport) + connect_stream;
    if connect_stream > 0 {
        session.quic().set_max_concurrent_bi_streams(allowed.into());
    }
    // Closed before any of its streams is served: a certificate found revoked as the
    // connection was listed (`identify`) gets none of its frames handled.
    let closing = state
        .close_reason
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let reason = if let Some((code, reason)) = closing {
        session.close(code, close_reason(&reason));
        let _ = tokio::time::timeout(CLOSE_WAIT, session.quic().closed()).await;
        reason
    } else {
        loop {
            tokio::select! {
                _ = async {
                    match confirming.as_mut() {
                        Some(handshake) => handshake.await,
                        None => std::future::pending().await,
                    }
                }, if confirming.is_some() => {
                    confirming = None;
                }
                // The protocol uses bidirectional streams only; with WebTransport on, a native
                // client may open the few unidirectional ones HTTP/3 needs: refused unread.
                uni = session.quic().accept_uni(), if matches!(session, Session::Quic(_)) => {
                    match uni {
                        Ok(mut recv) => {
                            shared.stats.rejected("unidirectional_stream");
                            debug!(remote = %state.remote, "refused a unidirectional stream (the protocol uses bidirectional streams only)");
                            let _ = recv.stop(0u32.into());
                        }
                        Err(e) => break e.to_string(),
                    }
                }
                accepted = accept_bi(&session) => {
                    match accepted {
                        Ok(Accepted::Quic(send, recv)) => {
                            streams.spawn(stream::serve(send, recv, shared.clone(), state.clone(), shutdown.clone()));
                        }
                        Ok(Accepted::WebTransport(send, recv)) => {
                            let recv = crate::webtransport::WtRecv(recv);
                            streams.spawn(stream::serve(send, recv, shared.clone(), state.clone(), shutdown.clone()));
                        }
                        Err(e) => break e,
                    }
                    if allowed < max_streams && (streams.len() as u32 + connect_stream) * 2 >= allowed {
                        allowed = allowed.saturating_mul(2).min(max_streams);
                        session.quic().set_max_concurrent_bi_streams(allowed.into());
                    }
                }
                Some(joined) = streams.join_next(), if !streams.is_empty() => {
                    stream_task_ended(&shared, &state, joined);
                }
                _ = state.close_requested.notified() => {
                    let (code, reason) = state
                        .close_reason
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                        .unwrap_or((ErrorCode(0), String::new()));
                    // Application code 0 (an administrator's disconnect: not an error of the
                    // client's), or NOT_AUTHORIZED for a revoked certificate.
                    session.close(code, close_reason(&reason));
                    let _ = tokio::time::timeout(CLOSE_WAIT, session.quic().closed()).await;
                    break reason;
                }
                _ = shutdown.changed() => {
                    // Writers see the same signal: they flush what is queued and finish.
                    let flush = async {
                        while let Some(joined) = streams.join_next().await {
                            stream_task_ended(&shared, &state, joined);
                        }
                    };
                    let _ = tokio::time::timeout(SHUTDOWN_FLUSH, flush).await;
                    session.close(ErrorCode::SHUTTING_DOWN, b"broker shutting down");
                    // A WebTransport session's close is a message on its CONNECT stream: give the
                    // peer a moment to take it (it closes the connection then) before the endpoint
                    // closes every connection at once. A QUIC close has ended it already.
                    let _ = tokio::time::timeout(CLOSE_WAIT, session.quic().closed()).await;
                    break "broker shutting down".to_string();
                }
            }
        }
    };
    streams.shutdown().await;
    // The connection ended before its handshake did (the client refused the broker's
    // certificate, say): finish the handshake's task, which counts the failure now that the
    // connection has a close reason (bounded by the handshake deadline).
    if let Some(handshake) = confirming.take() {
        handshake.await;
    }
    // Whatever is left subscribed ends with the connection.
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for entry in state.take_subs() {
        crate::stream::logged(&shared, &mut ctx, |ctx| {
            shared.broker.unsubscribe(ctx, &entry.sub, now)
        });
    }
    // Nothing to hold back for what its group members handed on: watched instead.
    shared.broker.watch_full(&mut ctx, now);
    let st = session.quic().stats();
    if state.is_confirmed() {
        info!(client = %state.describe(), "disconnected: {reason}");
    } else {
        // Never a client's connection: counted in aqueduct_handshakes_failed_total (or refused
        // with its own log line).
        debug!(remote = %state.remote, "handshake failed: {reason}");
    }
    debug!(
        client = %state.describe(),
        path_mtu = st.path.current_mtu,
        rtt_us = st.path.rtt.as_micros() as u64,
        lost_packets = st.path.lost_packets,
        sent_packets = st.path.sent_packets,
        black_holes = st.path.black_holes_detected,
        udp_tx_datagrams = st.udp_tx.datagrams,
        udp_rx_datagrams = st.udp_rx.datagrams,
        "connection statistics"
    );
}

/// A client's address as it would be written without the dual-stack socket: an IPv4 client of
/// a broker listening on `[::]` (the `":4242"` default) shows as `127.0.0.1:5000`, not
/// `[::ffff:127.0.0.1]:5000`, in logs and in the admin API.
pub(crate) fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_reasons_are_cut_at_a_character_boundary() {
        assert_eq!(close_reason("short"), b"short");
        let long = "é".repeat(400); // 800 bytes
        let cut = close_reason(&long);
        assert!(cut.len() <= MAX_CLOSE_REASON && cut.len() >= MAX_CLOSE_REASON - 1);
        assert!(std::str::from_utf8(cut).is_ok());
    }

    /// Whoever takes a subscription out of the table ends it; its stream's end leaves a live
    /// one to the UNSUBSCRIBE or revocation that took it, and still ends one the broker closed.
    #[test]
    fn a_stream_end_leaves_a_subscription_to_whoever_took_it_out_of_the_table() {
        use aqueduct_core::{Broker, BrokerConfig, PublishContext};
        use aqueduct_proto::SubscribeSpec;
        let broker = Broker::new(BrokerConfig::default());
        let conn = ConnState::new(1, "127.0.0.1:5000".parse().expect("addr"));
        let subscribe = |stream_id: u32| {
            let spec = SubscribeSpec::parse(&bytes::Bytes::from_static(b"topic:t")).expect("spec");
            let opts = aqueduct_core::SubscribeOptions {
                stream_id,
                ..Default::default()
            };
            conn.add_sub_with(stream_id, 10, || SubEntry {
                sub: broker.subscribe(&spec, opts),
                out: Arc::default(),
            })
            .expect("registered")
        };
        // Nobody else ends it: the stream does.
        let plain = subscribe(1);
        assert!(conn.end_with_stream(&plain));
        assert!(conn.sub(1).is_none(), "taken out");
        // An UNSUBSCRIBE took it out and has not ended it yet: the stream leaves it alone.
        let unsubscribing = subscribe(2);
        assert!(conn.remove_sub(2, &unsubscribing), "the UNSUBSCRIBE's half");
        assert!(!conn.end_with_stream(&unsubscribing));
        let mut ctx = PublishContext::default();
        broker.unsubscribe(&mut ctx, &unsubscribing, std::time::Instant::now());
        // Closed by the broker (a slow consumer) and forgotten by an ACK's lookup: the stream
        // ends it (its durable bookkeeping).
        let slow = subscribe(3);
        assert!(broker.disconnect_slow(&mut ctx, &slow, std::time::Instant::now()));
        assert!(conn.sub(3).is_none(), "an ACK's lookup forgets it");
        assert!(conn.end_with_stream(&slow));
    }

    /// At the limit, a SUBSCRIBE finds room once a subscription of the connection has closed
    /// (the broker closed it: its entry stays until a sweep), also after a sweep that found
    /// none closed and marked the table full.
    #[test]
    fn a_full_table_has_room_again_once_one_of_its_subscriptions_closed() {
        use aqueduct_core::{Broker, BrokerConfig, PublishContext};
        use aqueduct_proto::SubscribeSpec;
        let broker = Broker::new(BrokerConfig::default());
        let conn = ConnState::new(1, "127.0.0.1:5000".parse().expect("addr"));
        let spec = SubscribeSpec::parse(&bytes::Bytes::from_static(b"topic:t")).expect("spec");
        let closes = conn.sub_closes();
        let subscribe = |stream_id: u32| {
            conn.add_sub_with(stream_id, 3, || SubEntry {
                sub: broker.subscribe(
                    &spec,
                    aqueduct_core::SubscribeOptions {
                        stream_id,
                        closes: Some(closes.clone()),
                        ..Default::default()
                    },
                ),
                out: Arc::default(),
            })
        };
        let subs: Vec<_> = (1..=3).map(|id| subscribe(id).expect("room")).collect();
        for _ in 0..2 {
            assert_eq!(subscribe(4).err(), Some(AddSubError::Limit));
            assert!(conn.lock().full_at.is_some(), "marked full");
        }
        let mut ctx = PublishContext::default();
        // Another connection's subscription closing says nothing about this table.
        let other = ConnState::new(2, "127.0.0.1:5001".parse().expect("addr"));
        let elsewhere = broker.subscribe(
            &spec,
            aqueduct_core::SubscribeOptions {
                closes: Some(other.sub_closes()),
                ..Default::default()
            },
        );
        broker.unsubscribe(&mut ctx, &elsewhere, std::time::Instant::now());
        assert_eq!(other.sub_closes().load(Ordering::Relaxed), 1);
        assert_eq!(closes.load(Ordering::Relaxed), 0, "not this connection's");
        assert!(broker.disconnect_slow(&mut ctx, &subs[1], std::time::Instant::now()));
        assert!(subscribe(4).is_ok(), "the closed one's place is taken");
        assert_eq!(conn.lock().len(), 3);
        assert_eq!(subscribe(5).err(), Some(AddSubError::Limit));
    }

    #[test]
    fn a_client_closing_right_after_its_handshake_is_a_connection_not_a_failure() {
        use quinn::{ApplicationClose, ConnectionError, VarInt};
        assert_eq!(handshake_outcome(None), Handshake::Completed);
        let closed = ConnectionError::ApplicationClosed(ApplicationClose {
            error_code: VarInt::from_u32(0),
            reason: Default::default(),
        });
        assert_eq!(handshake_outcome(Some(closed)), Handshake::Completed);
        assert_eq!(
            handshake_outcome(Some(ConnectionError::LocallyClosed)),
            Handshake::ClosedHere
        );
        assert_eq!(
            handshake_outcome(Some(ConnectionError::TimedOut)),
            Handshake::Failed
        );
    }

    #[test]
    fn a_page_closing_its_session_is_logged_in_plain_words() {
        use web_transport_quinn::{SessionError, WebTransportError};
        let closed = |code, reason: &str| {
            session_ended(&SessionError::WebTransportError(WebTransportError::Closed(
                code,
                reason.into(),
            )))
        };
        assert_eq!(closed(0, ""), "closed by the client");
        assert_eq!(closed(0, "bye"), "closed by the client: bye");
        assert_eq!(closed(7, "oops"), "closed by the client with code 7: oops");
    }

    #[test]
    fn an_ipv4_client_of_a_dual_stack_socket_shows_as_ipv4() {
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5000".parse().expect("addr");
        assert_eq!(canonical(mapped).to_string(), "127.0.0.1:5000");
        let v6: SocketAddr = "[::1]:5000".parse().expect("addr");
        assert_eq!(canonical(v6), v6);
    }
}
