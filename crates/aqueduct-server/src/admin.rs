//! The gRPC admin API (`proto/aqueduct/admin/v1/admin.proto`): quotas, ACL rules, clients,
//! topics, broker info and the cluster view, for clients whose certificate CN matches
//! `admin.allowed_cn`.
//!
//! Transport: TCP + TLS 1.3 (rustls, ring) with a *required* client certificate signed by
//! `admin.client_ca_file`, so a client without one fails the handshake; the CN is then checked on
//! every call (PERMISSION_DENIED otherwise) and logged with it. TLS handshakes run in the admin
//! server's own task (at most [`MAX_HANDSHAKES`] at once, each bounded by [`HANDSHAKE_TIMEOUT`]).
//!
//! Changes go through `Access` (atomic swaps; the publish path never locks) and are persisted
//! to the state file before the call returns; live subscriptions the new rules refuse are closed
//! with ERROR NOT_AUTHORIZED ([`recheck_subscriptions`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aqueduct_core::acl::{AclRule, ClientPattern};
use aqueduct_core::quota::QuotaSpec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use crate::server::Shared;
use crate::warn_every::{held_back, WarnEvery};

/// Generated code and the descriptor set (for reflection).
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod proto {
    tonic::include_proto!("aqueduct.admin.v1");
    /// The encoded `FileDescriptorSet` of admin.proto.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("admin_descriptor");
}

use crate::eviction::eviction_order;
use proto::admin_service_server::{AdminService, AdminServiceServer};

/// TLS handshakes in progress at once; a new connection beyond closes the oldest handshake of
/// the address group with the most in progress.
pub const MAX_HANDSHAKES: usize = 64;
/// TLS handshakes in progress at once from one IP address; more from it are closed at once.
/// A connection that never starts its handshake costs nothing but a TCP connect, and anyone
/// who reaches the port may open one: this way such connections from one address cannot take
/// every handshake slot (for [`HANDSHAKE_TIMEOUT`] each) from administrators elsewhere.
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 8;
/// Admin connections open at once, past their handshake; more are closed after it. A slot is
/// taken only once the handshake is done: connections still handshaking hold none.
pub const MAX_CONNECTIONS: usize = 64;
/// An admin call that takes longer is cancelled.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer the admin client takes (tonic's default is 4 MiB: `admin topics` of a
/// broker with ~60,000 topics).
pub const MAX_ANSWER: usize = 256 << 20;
/// A TLS handshake that takes longer is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections whose certificate's CN does not match `admin.allowed_cn` open at once (each is
/// told why on its calls); more are closed after their handshake. So ordinary clients, whose
/// certificates the admin CA may also sign, cannot take the slots administrators need.
pub const MAX_DENIED_CONNECTIONS: usize = 8;
/// A connection whose CN does not match `admin.allowed_cn` is closed this long after its
/// handshake: time enough for its calls to be refused with the reason.
pub const DENIED_LIFETIME: Duration = Duration::from_secs(5);

/// Who is calling: the client certificate's CN and the address.
#[derive(Debug, Clone)]
pub struct AdminPeer {
    pub cn: Option<String>,
    pub remote: SocketAddr,
    /// The certificates it presented (end entity first): each call checks them against the
    /// revocation lists in force, which a reload may have changed since the handshake.
    pub chain: Arc<[rustls_pki_types::CertificateDer<'static>]>,
    /// Told when the connection must end (its CN does not match, its certificate is found
    /// revoked or expired): it then ends [`DENIED_LIFETIME`] later.
    ended: Arc<tokio::sync::Notify>,
    /// Whether it was told (counted once).
    ending: Arc<std::sync::atomic::AtomicBool>,
}

impl AdminPeer {
    /// End the connection [`DENIED_LIFETIME`] from now; false if it was told before.
    fn end(&self) -> bool {
        let first = !self.ending.swap(true, Ordering::AcqRel);
        if first {
            self.ended.notify_one();
        }
        first
    }
}

/// The admin connections open, with their certificates: a reload that revokes one ends its
/// connections. A revoked administrator (a leaked key) held its connections, and so up to
/// [`MAX_CONNECTIONS`] slots, for as long as it kept them open: the other administrators could
/// not connect until a restart.
#[derive(Debug, Default)]
pub struct AdminConns {
    open: std::sync::Mutex<HashMap<u64, AdminPeer>>,
    next: std::sync::atomic::AtomicU64,
}

impl AdminConns {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, AdminPeer>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tell every open connection whose certificate `revoked` says is revoked to end; how many
    /// were not told before.
    pub(crate) fn end_revoked(
        &self,
        revoked: impl Fn(&[rustls_pki_types::CertificateDer<'static>]) -> bool,
    ) -> usize {
        let open = self.lock();
        open.values()
            .filter(|p| revoked(&p.chain) && p.end())
            .count()
    }

    /// How many admin connections are open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection's place in [`AdminConns`], given up when it ends.
struct Registered {
    conns: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.conns.admin_conns.lock().remove(&self.id);
    }
}

/// A TLS connection with its peer's identity, for tonic.
struct TlsConn {
    io: tokio_rustls::server::TlsStream<TcpStream>,
    peer: AdminPeer,
    /// Held for the connection's life (`MAX_CONNECTIONS`).
    _slot: tokio::sync::OwnedSemaphorePermit,
    /// A caller `admin.allowed_cn` refuses: one of `MAX_DENIED_CONNECTIONS`, and the end of its
    /// `DENIED_LIFETIME`.
    _denied: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Told when it must end ([`AdminPeer::end`]: its CN does not match, its certificate is
    /// revoked or expired); taken once it told.
    ended: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    /// When it ends: [`DENIED_LIFETIME`] after it was told, or after its certificate expires
    /// (an idle connection of a short-lived certificate, what howto-security advises against a
    /// leaked key, ends too), whichever comes first.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    _registered: Registered,
}

impl Connected for TlsConn {
    type ConnectInfo = AdminPeer;
    fn connect_info(&self) -> AdminPeer {
        self.peer.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        use std::future::Future;
        let this = self.get_mut();
        if this
            .ended
            .as_mut()
            .is_some_and(|e| e.as_mut().poll(cx).is_ready())
        {
            this.ended = None;
            let at = tokio::time::Instant::now() + DENIED_LIFETIME;
            match &mut this.deadline {
                Some(d) if d.deadline() <= at => {}
                Some(d) => d.as_mut().reset(at),
                None => this.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
            }
        }
        if this
            .deadline
            .as_mut()
            .is_some_and(|d| d.as_mut().poll(cx).is_ready())
        {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "closed: the caller may not use the admin API (its CN does not match \
                 admin.allowed_cn, or its certificate is revoked or has expired)",
            )));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The TLS handshakes in progress, in the order they began, with their address groups.
#[derive(Default)]
struct InProgress(Vec<(tokio::task::AbortHandle, IpAddr)>);

impl InProgress {
    fn len(&self) -> usize {
        self.0.len()
    }

    /// How many come from `group`.
    fn of(&self, group: IpAddr) -> usize {
        self.0.iter().filter(|(_, g)| *g == group).count()
    }

    fn started(&mut self, task: tokio::task::AbortHandle, group: IpAddr) {
        self.0.push((task, group));
    }

    fn ended(&mut self, id: tokio::task::Id) {
        self.0.retain(|(t, _)| t.id() != id);
    }

    /// Close the oldest handshake of the group with the most in progress, for a new
    /// connection when all [`MAX_HANDSHAKES`] are taken: connections that never handshake, from
    /// however many addresses, cannot keep an administrator's from being served. Returns its
    /// group.
    fn evict(&mut self) -> Option<IpAddr> {
        let groups: Vec<IpAddr> = self.0.iter().map(|(_, g)| *g).collect();
        let i = *eviction_order(&groups, |_| true).first()?;
        let (task, group) = self.0.remove(i);
        task.abort();
        Some(group)
    }
}

/// Serve the admin API on `listener` until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let (tx, mut rx) = mpsc::channel::<TlsConn>(MAX_HANDSHAKES);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let stats = shared.stats.clone();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let denied_slots = Arc::new(tokio::sync::Semaphore::new(MAX_DENIED_CONNECTIONS));
    let allowed = shared.config.admin.as_ref().map(|a| a.allowed_cn.clone());
    let registry = shared.clone();
    let accept = async move {
        let mut handshakes = JoinSet::new();
        let mut in_progress = InProgress::default();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (tcp, remote) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            warn!("admin API: accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let group = crate::eviction::address_group(remote.ip());
                    if in_progress.of(group) >= MAX_HANDSHAKES_PER_ADDRESS {
                        stats.admin_handshakes_failed.fetch_add(1, Ordering::Relaxed);
                        debug!(%remote, "admin API: connection closed: {MAX_HANDSHAKES_PER_ADDRESS} TLS handshakes from its address are in progress");
                        continue;
                    }
                    if in_progress.len() >= MAX_HANDSHAKES {
                        if let Some(from) = in_progress.evict() {
                            stats.admin_handshakes_failed.fetch_add(1, Ordering::Relaxed);
                            debug!(%from, "admin API: a TLS handshake in progress closed for a new connection: {MAX_HANDSHAKES} are in progress");
                        }
                    }
                    let (acceptor, tx, stats) = (acceptor.clone(), tx.clone(), stats.clone());
                    let (denied_slots, allowed) = (denied_slots.clone(), allowed.clone());
                    let (slots, shared) = (slots.clone(), registry.clone());
                    let task = handshakes.spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(io)) => {
                                let Ok(slot) = slots.try_acquire_owned() else {
                                    stats.admin_handshakes_failed.fetch_add(1, Ordering::Relaxed);
                                    info!(%remote, "admin API: connection closed after its handshake: {MAX_CONNECTIONS} admin connections are open");
                                    return;
                                };
                                let chain: Arc<[rustls_pki_types::CertificateDer<'static>]> = io
                                    .get_ref()
                                    .1
                                    .peer_certificates()
                                    .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
                                    .unwrap_or_default();
                                let cn = chain.first().and_then(crate::tls::common_name);
                                let admin = match (&cn, &allowed) {
                                    (Some(cn), Some(pattern)) => pattern.matches(cn),
                                    _ => false,
                                };
                                let denied = if admin {
                                    None
                                } else {
                                    let Ok(permit) = denied_slots.try_acquire_owned() else {
                                        stats.admin_denied.fetch_add(1, Ordering::Relaxed);
                                        info!(
                                            %remote,
                                            cn = cn.as_deref().unwrap_or("(none)"),
                                            "admin API: connection closed: its CN does not match admin.allowed_cn, and {MAX_DENIED_CONNECTIONS} such connections are open"
                                        );
                                        return;
                                    };
                                    Some(permit)
                                };
                                let ended = Arc::new(tokio::sync::Notify::new());
                                let deadline = chain
                                    .first()
                                    .and_then(crate::tls::validity)
                                    .map(|(_, until)| {
                                        let left = until.saturating_sub(crate::server::unix_now());
                                        let left = Duration::from_secs(left.max(0) as u64)
                                            .min(crate::config::MAX_DURATION);
                                        Box::pin(tokio::time::sleep(left + DENIED_LIFETIME))
                                    });
                                let peer = AdminPeer {
                                    cn,
                                    remote,
                                    chain,
                                    ended: ended.clone(),
                                    ending: Arc::default(),
                                };
                                let id = shared.admin_conns.next.fetch_add(1, Ordering::Relaxed);
                                shared.admin_conns.lock().insert(id, peer.clone());
                                // Its CN does not match; or revoked by a reload after its
                                // handshake's check and before it was listed (that reload did
                                // not see it).
                                if denied.is_some()
                                    || shared
                                        .admin_certs
                                        .as_ref()
                                        .is_some_and(|v| v.is_revoked(&peer.chain))
                                {
                                    peer.end();
                                }
                                let registered = Registered { conns: shared, id };
                                let _ = tx
                                    .send(TlsConn {
                                        io,
                                        peer,
                                        _slot: slot,
                                        _denied: denied,
                                        ended: Some(Box::pin(async move { ended.notified().await })),
                                        deadline,
                                        _registered: registered,
                                    })
                                    .await;
                            }
                            Ok(Err(e)) => {
                                stats.admin_handshakes_failed.fetch_add(1, Ordering::Relaxed);
                                info!(%remote, "admin API: TLS handshake refused: {e}");
                            }
                            Err(_) => {
                                stats.admin_handshakes_failed.fetch_add(1, Ordering::Relaxed);
                                debug!(%remote, "admin API: TLS handshake timed out");
                            }
                        }
                    });
                    in_progress.started(task, group);
                }
                Some(done) = handshakes.join_next_with_id(), if !handshakes.is_empty() => {
                    in_progress.ended(match done {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    });
                }
            }
        }
    };
    let incoming = async_stream(&mut rx);
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1();
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1alpha();
    let mut builder = tonic::transport::Server::builder()
        .timeout(CALL_TIMEOUT)
        // Find dead peers; live idle ones are bounded by MAX_CONNECTIONS.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)));
    let router = match (reflection_v1, reflection_v1alpha) {
        (Ok(v1), Ok(v1alpha)) => builder
            .add_service(AdminServiceServer::new(AdminApi::new(shared.clone())))
            .add_service(v1)
            .add_service(v1alpha),
        (Err(e), _) | (_, Err(e)) => {
            warn!("admin API: server reflection is off: {e}");
            builder.add_service(AdminServiceServer::new(AdminApi::new(shared.clone())))
        }
    };
    let server = router.serve_with_incoming_shutdown(incoming, async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    tokio::select! {
        r = server => if let Err(e) = r {
            warn!("admin API stopped: {e}");
        },
        _ = accept => {}
    }
}

/// The answer to a change that is live but could not be saved.
fn not_saved(e: impl std::fmt::Display) -> Status {
    warn!("admin change applied but not saved: {e}");
    Status::internal(format!(
        "the change is live but could not be saved, so a restart would undo it: {e}"
    ))
}

/// The accepted connections as a stream, for tonic.
fn async_stream(
    rx: &mut mpsc::Receiver<TlsConn>,
) -> impl futures_util::Stream<Item = Result<TlsConn, std::io::Error>> + '_ {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|c| c.map(Ok)))
}

/// Close, with ERROR NOT_AUTHORIZED, every live subscription the current ACL refuses: routing to
/// them stops now, and each one's stream task finishes closing it right after (see
/// `stream::request_revoke`). Returns how many. No policy change lands during the walk
/// ([`aqueduct_core::acl::Acl::hold_changes`]), so two walks after two quick changes cannot close
/// a subscription the newer policy allows.
pub(crate) fn recheck_subscriptions(shared: &Shared) -> usize {
    let acl = &shared.access.acl;
    let _steady = acl.hold_changes();
    let policy = acl.policy();
    shared
        .live_clients()
        .iter()
        .map(|conn| recheck_under(shared, &policy, conn))
        .sum()
}

/// Run `work` — a policy change, a walk over the live subscriptions — on a blocking thread, and
/// wait for it there: a change waits for a walk in progress ([`aqueduct_core::acl::Acl::hold_changes`]),
/// and a walk takes as long as there are subscriptions, so neither may hold an async worker (the
/// connections it serves would stall meanwhile).
pub(crate) async fn off_workers<T: Send + 'static>(
    shared: &Arc<Shared>,
    work: impl FnOnce(&Shared) -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || work(&shared)).await
}

/// [`recheck_subscriptions`] for one connection, just listed: what it subscribed to in 0-RTT
/// data was handled before its identity was known. At once when no change or walk is in
/// progress (the usual case: a connection has few subscriptions yet); otherwise it waits for
/// that one [`off_workers`]. Returns how many subscriptions it closed.
///
/// Every handshake comes here, and only one whose 0-RTT data subscribed has anything to check:
/// any other (a 1-RTT connection is listed before any of its streams is served) returns at
/// once, without waiting for a walk in progress. The connection is listed already, so a later
/// change walks it, and a SUBSCRIBE handled from now on is checked with its identity known.
pub(crate) async fn recheck_connection(
    shared: &Arc<Shared>,
    conn: &Arc<crate::connection::ConnState>,
) -> usize {
    let acl = &shared.access.acl;
    if !acl.enabled() || !conn.has_subs() {
        return 0;
    }
    if let Some(_steady) = acl.try_hold_changes() {
        return recheck_under(shared, &acl.policy(), conn);
    }
    let walking = conn.clone();
    let walked = off_workers(shared, move |shared| {
        let acl = &shared.access.acl;
        let _steady = acl.hold_changes();
        recheck_under(shared, &acl.policy(), &walking)
    })
    .await;
    walked.unwrap_or_else(|e| {
        // Fail closed: its subscriptions were not checked, so it is not served.
        warn!("checking a new connection's subscriptions against the ACL failed: {e}");
        if let Some(c) = conn.conn.get() {
            c.close(
                aqueduct_proto::ErrorCode::INTERNAL.0.into(),
                b"checking the connection against the ACL failed",
            );
        }
        0
    })
}

/// [`recheck_connection`] under `policy`, the live one (changes held).
fn recheck_under(
    shared: &Shared,
    policy: &aqueduct_core::acl::AclPolicy,
    conn: &crate::connection::ConnState,
) -> usize {
    if !policy.enabled {
        return 0;
    }
    let rules = policy.for_client(conn.identity());
    let mut closed = 0;
    for entry in conn.subs() {
        // Counted in `aqueduct_acl_denied_total` where the stream ends it.
        if !rules.may_subscribe(entry.sub.filter()) && crate::stream::request_revoke(shared, &entry)
        {
            closed += 1;
        }
    }
    closed
}

struct AdminApi {
    shared: Arc<Shared>,
    /// Refused calls are warned about once a minute per caller and reason (the rest at debug
    /// level): a caller with a certificate of the CA could send refused calls without end.
    denied_warned: std::sync::Mutex<WarnEvery<(String, &'static str)>>,
}

impl AdminApi {
    fn new(shared: Arc<Shared>) -> AdminApi {
        AdminApi {
            shared,
            denied_warned: std::sync::Mutex::new(WarnEvery::new(Duration::from_secs(60))),
        }
    }

    /// A call refused: counted, and warned about (see [`AdminApi::denied_warned`]).
    fn denied(&self, cn: &str, remote: &str, rpc: &str, why: &'static str) {
        self.shared
            .stats
            .admin_denied
            .fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        let due = {
            let mut w = self.denied_warned.lock().unwrap_or_else(|e| e.into_inner());
            let due = w.due((cn.to_string(), why), (), now);
            // After `due`: forgotten first, a key due again lost what it held back.
            w.forget_expired(now);
            due
        };
        match due {
            Some(more) => warn!(
                caller = %cn, %remote, rpc,
                "admin call refused: {why}{}", held_back(more, "such refusals of this caller")
            ),
            None => debug!(caller = %cn, %remote, rpc, "admin call refused: {why}"),
        }
    }
}

impl std::fmt::Debug for AdminApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminApi")
    }
}

fn now_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl AdminApi {
    /// The caller's CN if it may call the API; PERMISSION_DENIED otherwise. Logs the call.
    fn authorize<T: std::fmt::Debug>(&self, req: &Request<T>, rpc: &str) -> Result<String, Status> {
        let peer = req.extensions().get::<AdminPeer>().cloned();
        let allowed: Option<&ClientPattern> =
            self.shared.config.admin.as_ref().map(|a| &a.allowed_cn);
        let cn = peer.as_ref().and_then(|p| p.cn.clone());
        let remote = peer
            .as_ref()
            .map(|p| p.remote.to_string())
            .unwrap_or_default();
        // Revoked since the handshake (a reload of tls.crl_file), on a connection still open.
        let revoked = match (&peer, &self.shared.admin_certs) {
            (Some(p), Some(v)) => v.is_revoked(&p.chain),
            _ => false,
        };
        // Expired since the handshake, on a connection gRPC keeps open (short-lived admin
        // certificates are what howto-security advises).
        let expired = peer
            .as_ref()
            .and_then(|p| p.chain.first().and_then(crate::tls::validity))
            .is_some_and(|(_, until)| until < crate::server::unix_now());
        if revoked || expired {
            // Its connection ends: it would keep a slot other administrators need.
            if let Some(p) = &peer {
                p.end();
            }
        }
        if revoked {
            let cn = cn.unwrap_or_else(|| "(none)".into());
            self.denied(
                &cn,
                &remote,
                rpc,
                "the certificate is revoked (tls.crl_file)",
            );
            return Err(Status::permission_denied(format!(
                "certificate of {cn} is revoked (tls.crl_file)"
            )));
        }
        if expired {
            let cn = cn.unwrap_or_else(|| "(none)".into());
            self.denied(&cn, &remote, rpc, "the certificate has expired");
            return Err(Status::permission_denied(format!(
                "certificate of {cn} has expired: connect again with a valid one"
            )));
        }
        match (cn, allowed) {
            (Some(cn), Some(pattern)) if pattern.matches(&cn) => {
                info!(caller = %cn, %remote, rpc, request = ?req.get_ref(), "admin call");
                Ok(cn)
            }
            (cn, pattern) => {
                let cn = cn.unwrap_or_else(|| "(none)".into());
                let pattern = pattern.map(|p| p.to_string()).unwrap_or_default();
                self.denied(&cn, &remote, rpc, "the CN does not match admin.allowed_cn");
                Err(Status::permission_denied(format!(
                    "certificate CN {cn} does not match admin.allowed_cn ({pattern})"
                )))
            }
        }
    }

    /// After a change: persist it (file I/O off the async workers, awaited: the call returns
    /// once it is saved); say so if it could not be saved.
    async fn persist(&self) -> Result<(), Status> {
        let access = self.shared.access.clone();
        let saved = tokio::task::spawn_blocking(move || access.changed())
            .await
            .map_err(|e| Status::internal(format!("saving the change failed: {e}")))?;
        saved.map_err(not_saved)
    }

    fn acl(&self) -> proto::Acl {
        let p = self.shared.access.acl.policy();
        proto::Acl {
            enabled: p.enabled,
            default_permission: p.default.to_string(),
            rules: p.rules.iter().map(rule_to_proto).collect(),
        }
    }

    /// Apply `change` to the ACL; if it says it changed something, close the live
    /// subscriptions the new policy refuses, log the change and save it. All of it in one task
    /// [`off_workers`]: a call dropped while it waits (its deadline, the client gone) cannot
    /// leave a change live but unsaved. Returns what `change` said.
    async fn change_acl(
        &self,
        caller: &str,
        change: impl FnOnce(&mut aqueduct_core::acl::AclPolicy) -> bool + Send + 'static,
    ) -> Result<bool, Status> {
        let caller = caller.to_string();
        let done = off_workers(&self.shared, move |shared| {
            if !shared.access.acl.update(change) {
                return Ok(false);
            }
            let closing = recheck_subscriptions(shared);
            let p = shared.access.acl.policy();
            info!(caller, rules = p.rules.len(), default = %p.default, closing_subscriptions = closing, "ACL changed");
            shared.access.changed().map(|()| true)
        })
        .await
        .map_err(|e| {
            Status::internal(format!(
                "the ACL change did not complete (ListACL shows whether it is live): {e}"
            ))
        })?;
        done.map_err(not_saved)
    }

    fn quota(&self, client_id: &str) -> proto::ClientQuota {
        let policy = self.shared.access.quotas.policy();
        let counters = self
            .shared
            .access
            .quotas
            .buckets()
            .into_iter()
            .find(|(id, _)| id == client_id)
            .map(|(_, b)| b.counters());
        quota_entry(&policy, client_id, counters)
    }
}

/// One client's quota as the API shows it, with its bucket's counters (`None`: it has none).
fn quota_entry(
    policy: &aqueduct_core::quota::QuotaPolicy,
    client_id: &str,
    counters: Option<(Duration, u64)>,
) -> proto::ClientQuota {
    let spec = policy.spec_for(client_id);
    let (throttled, rejected) = counters.unwrap_or_default();
    proto::ClientQuota {
        client_id: client_id.to_string(),
        rate: spec.rate,
        burst: spec.burst,
        is_override: policy.clients.contains_key(client_id),
        throttled_seconds: throttled.as_secs_f64(),
        rejected_messages: rejected,
    }
}

fn rule_to_proto(r: &AclRule) -> proto::AclRule {
    proto::AclRule {
        client_id: r.client.to_string(),
        topic: r.topic.to_string(),
        permission: r.permission.to_string(),
    }
}

/// One rule of a request; `i`: its place in a list of rules (named in the error), `None` for
/// the one rule of an add or remove.
fn rule_from_proto(i: Option<usize>, r: &proto::AclRule) -> Result<AclRule, Status> {
    AclRule::parse(&r.client_id, &r.topic, &r.permission).map_err(|e| {
        // Named as the request's fields are (the config file's `client` is `client_id` here).
        let field = match e.field {
            "client" => "client_id",
            other => other,
        };
        let e = format!("{field}: {}", e.problem);
        Status::invalid_argument(match i {
            Some(i) => format!("rule {i}: {e}"),
            None => e,
        })
    })
}

fn client_id(id: &str) -> Result<&str, Status> {
    let id = id.trim();
    if id.is_empty() {
        return Err(Status::invalid_argument("client_id is empty"));
    }
    Ok(id)
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn set_client_quota(
        &self,
        req: Request<proto::SetClientQuotaRequest>,
    ) -> Result<Response<proto::ClientQuota>, Status> {
        let caller = self.authorize(&req, "SetClientQuota")?;
        let r = req.into_inner();
        let id = client_id(&r.client_id)?.to_string();
        if id.contains('*') {
            // It would apply to a client of exactly that id, that is to nobody.
            return Err(Status::invalid_argument(format!(
                "{id:?}: a quota names one client id exactly; `*` patterns are for ACL rules \
                 (set the default quota, or each client's)"
            )));
        }
        if r.burst == Some(0) {
            return Err(Status::invalid_argument("burst must be at least 1"));
        }
        let spec = self.shared.access.quotas.update(|p| {
            let burst = r.burst.unwrap_or_else(|| p.spec_for(&id).burst);
            let spec = QuotaSpec {
                rate: r.rate,
                burst,
            };
            p.clients.insert(id.clone(), spec);
            spec
        });
        info!(caller, client = %id, rate = spec.rate, burst = spec.burst, "quota set");
        self.persist().await?;
        Ok(Response::new(self.quota(&id)))
    }

    async fn get_client_quota(
        &self,
        req: Request<proto::GetClientQuotaRequest>,
    ) -> Result<Response<proto::ClientQuota>, Status> {
        self.authorize(&req, "GetClientQuota")?;
        let id = client_id(&req.get_ref().client_id)?;
        Ok(Response::new(self.quota(id)))
    }

    async fn remove_client_quota(
        &self,
        req: Request<proto::RemoveClientQuotaRequest>,
    ) -> Result<Response<proto::ClientQuota>, Status> {
        let caller = self.authorize(&req, "RemoveClientQuota")?;
        let id = client_id(&req.get_ref().client_id)?.to_string();
        let removed = self
            .shared
            .access
            .quotas
            .update(|p| p.clients.remove(&id).is_some());
        if !removed {
            return Err(Status::not_found(format!(
                "client {id} has no quota of its own (it follows the default)"
            )));
        }
        info!(caller, client = %id, "quota override removed");
        self.persist().await?;
        Ok(Response::new(self.quota(&id)))
    }

    async fn list_client_quotas(
        &self,
        req: Request<proto::ListClientQuotasRequest>,
    ) -> Result<Response<proto::ListClientQuotasResponse>, Status> {
        self.authorize(&req, "ListClientQuotas")?;
        let policy = self.shared.access.quotas.policy();
        let mut ids: Vec<&String> = policy.clients.keys().collect();
        ids.sort();
        // One look at the buckets for all: per client, it was one copy of them each (quadratic
        // in the overrides).
        let counters: HashMap<String, (Duration, u64)> = self
            .shared
            .access
            .quotas
            .buckets()
            .into_iter()
            .map(|(id, b)| (id, b.counters()))
            .collect();
        Ok(Response::new(proto::ListClientQuotasResponse {
            default_quota: Some(proto::ClientQuota {
                client_id: String::new(),
                rate: policy.default.rate,
                burst: policy.default.burst,
                is_override: false,
                throttled_seconds: 0.0,
                rejected_messages: 0,
            }),
            clients: ids
                .into_iter()
                .map(|id| quota_entry(&policy, id, counters.get(id).copied()))
                .collect(),
            action: match self.shared.access.action() {
                crate::access::QuotaAction::Throttle => "throttle".into(),
                crate::access::QuotaAction::Reject => "reject".into(),
            },
        }))
    }

    async fn update_acl(
        &self,
        req: Request<proto::UpdateAclRequest>,
    ) -> Result<Response<proto::Acl>, Status> {
        let caller = self.authorize(&req, "UpdateACL")?;
        let r = req.into_inner();
        let rules = r
            .rules
            .iter()
            .enumerate()
            .map(|(i, rule)| rule_from_proto(Some(i), rule))
            .collect::<Result<Vec<_>, _>>()?;
        let default = match &r.default_permission {
            Some(d) => Some(d.parse().map_err(|e: String| {
                Status::invalid_argument(format!("default_permission: {e}"))
            })?),
            None => None,
        };
        self.change_acl(&caller, move |p| {
            p.rules = rules;
            if let Some(d) = default {
                p.default = d;
            }
            true
        })
        .await?;
        Ok(Response::new(self.acl()))
    }

    async fn list_acl(
        &self,
        req: Request<proto::ListAclRequest>,
    ) -> Result<Response<proto::Acl>, Status> {
        self.authorize(&req, "ListACL")?;
        Ok(Response::new(self.acl()))
    }

    async fn add_acl_rule(
        &self,
        req: Request<proto::AclRule>,
    ) -> Result<Response<proto::Acl>, Status> {
        let caller = self.authorize(&req, "AddACLRule")?;
        let rule = rule_from_proto(None, req.get_ref())?;
        let new = rule.clone();
        let added = self
            .change_acl(&caller, move |p| {
                if p.rules.contains(&new) {
                    false
                } else {
                    p.rules.push(new);
                    true
                }
            })
            .await?;
        if !added {
            return Err(Status::already_exists(format!(
                "the rule {rule} is already there"
            )));
        }
        Ok(Response::new(self.acl()))
    }

    async fn remove_acl_rule(
        &self,
        req: Request<proto::AclRule>,
    ) -> Result<Response<proto::Acl>, Status> {
        let caller = self.authorize(&req, "RemoveACLRule")?;
        let rule = rule_from_proto(None, req.get_ref())?;
        let gone = rule.clone();
        let removed = self
            .change_acl(&caller, move |p| {
                let before = p.rules.len();
                p.rules.retain(|r| r != &gone);
                before != p.rules.len()
            })
            .await?;
        if !removed {
            return Err(Status::not_found(format!("no rule {rule}")));
        }
        Ok(Response::new(self.acl()))
    }

    async fn list_clients(
        &self,
        req: Request<proto::ListClientsRequest>,
    ) -> Result<Response<proto::ListClientsResponse>, Status> {
        self.authorize(&req, "ListClients")?;
        let clients = self
            .shared
            .live_clients()
            .iter()
            .map(|c| proto::Client {
                connection_id: c.id,
                client_id: c.identity().to_string(),
                address: c.remote.to_string(),
                connected_since_unix_ms: now_ms(c.connected_at),
                subscriptions: c
                    .subs()
                    .iter()
                    .map(|e| proto::Subscription {
                        stream_id: e.sub.stream_id(),
                        filter: e.sub.filter().to_string(),
                        group: e
                            .sub
                            .group()
                            .map(|g| g.id().as_str().to_string())
                            .unwrap_or_default(),
                        queued: e.sub.queued_approx() as u64,
                        in_flight: e.sub.in_flight() as u64,
                    })
                    .collect(),
                published: c.published.load(Ordering::Relaxed),
                delivered: c.delivered.load(Ordering::Relaxed),
            })
            .collect();
        Ok(Response::new(proto::ListClientsResponse { clients }))
    }

    async fn disconnect_client(
        &self,
        req: Request<proto::DisconnectClientRequest>,
    ) -> Result<Response<proto::DisconnectClientResponse>, Status> {
        use proto::disconnect_client_request::Target;
        let caller = self.authorize(&req, "DisconnectClient")?;
        let r = req.into_inner();
        let Some(target) = r.target else {
            return Err(Status::invalid_argument("give connection_id or client_id"));
        };
        let reason = if r.reason.trim().is_empty() {
            format!("disconnected by an administrator ({caller})")
        } else {
            format!(
                "disconnected by an administrator ({caller}): {}",
                r.reason.trim()
            )
        };
        let mut disconnected = 0u32;
        for c in self.shared.live_clients() {
            let hit = match &target {
                Target::ConnectionId(id) => c.id == *id,
                Target::ClientId(id) => c.identity() == id,
            };
            if hit && c.conn.get().is_some() {
                c.disconnect(reason.clone());
                info!(caller, client = %c.describe(), "disconnected by the admin API");
                disconnected += 1;
            }
        }
        if disconnected == 0 {
            return Err(Status::not_found("no connection matched"));
        }
        Ok(Response::new(proto::DisconnectClientResponse {
            disconnected,
        }))
    }

    async fn list_topics(
        &self,
        req: Request<proto::ListTopicsRequest>,
    ) -> Result<Response<proto::ListTopicsResponse>, Status> {
        self.authorize(&req, "ListTopics")?;
        let broker = self.shared.broker.clone();
        // Every topic against every distinct filter: off the async workers, which carry the
        // data path (many topics and subscriptions make this long).
        let topics = tokio::task::spawn_blocking(move || {
            let mut filters: std::collections::HashMap<aqueduct_proto::TopicFilter, u64> =
                std::collections::HashMap::new();
            for sub in broker.subscribers() {
                *filters.entry(sub.filter().clone()).or_default() += 1;
            }
            let mut topics: Vec<proto::Topic> = broker
                .topic_snapshots_and_evicted_stats()
                .0
                .into_iter()
                .map(|(name, _, s)| proto::Topic {
                    name: name.to_string(),
                    published: s.published,
                    delivered: s.delivered,
                    dropped: s.dropped.iter().sum(),
                    expired: s.expired.iter().sum(),
                    dead_lettered: s.dead_lettered,
                    subscribers: filters
                        .iter()
                        .filter(|(f, _)| aqueduct_core::matching::matches(f, &name))
                        .map(|(_, n)| n)
                        .sum(),
                })
                .collect();
            topics.sort_by(|a, b| a.name.cmp(&b.name));
            topics
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(proto::ListTopicsResponse { topics }))
    }

    async fn get_broker_info(
        &self,
        req: Request<proto::GetBrokerInfoRequest>,
    ) -> Result<Response<proto::BrokerInfo>, Status> {
        self.authorize(&req, "GetBrokerInfo")?;
        let sh = &self.shared;
        let c = &sh.config;
        let acl = sh.access.acl.policy();
        let quotas = sh.access.quotas.policy();
        let mut config = std::collections::HashMap::new();
        let mut put = |k: &str, v: String| {
            config.insert(k.to_string(), v);
        };
        put("broker.queue_size", c.broker.queue_size.to_string());
        // Each value as the configuration writes it.
        put(
            "broker.backpressure_policy",
            c.broker.backpressure_policy.as_str().to_string(),
        );
        put("broker.max_retries", c.broker.max_retries.to_string());
        let duration = |d: std::time::Duration| humantime::format_duration(d).to_string();
        put("broker.ack_wait", duration(c.broker.ack_wait));
        put("broker.flush_interval", duration(c.flush_interval));
        put(
            "broker.quotas.default_publish_rate",
            quotas.default.rate.to_string(),
        );
        put(
            "broker.quotas.default_burst_size",
            quotas.default.burst.to_string(),
        );
        put(
            "tls.require_client_cert",
            c.tls.require_client_cert.to_string(),
        );
        put("aal.enabled", c.aal.is_some().to_string());
        put("acl.default", acl.default.to_string());
        put(
            "transport.max_buf_size",
            c.transport.max_frame_data.to_string(),
        );
        put(
            "transport.max_connections",
            c.transport.max_connections.to_string(),
        );
        Ok(Response::new(proto::BrokerInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_seconds: sh.epoch.elapsed().as_secs_f64(),
            listen_addr: sh.local_addr.to_string(),
            metrics_addr: c.metrics_addr.to_string(),
            connections: sh.connections.load(Ordering::Relaxed) as u32,
            subscriptions: sh.broker.subscriber_count() as u32,
            topics: sh.broker.topic_count() as u32,
            acl_enabled: acl.enabled,
            acl_rules: acl.rules.len() as u32,
            config,
        }))
    }

    async fn get_cluster(
        &self,
        req: Request<proto::GetClusterRequest>,
    ) -> Result<Response<proto::ClusterInfo>, Status> {
        self.authorize(&req, "GetCluster")?;
        Ok(Response::new(cluster_info(self.shared.mesh.as_ref())))
    }
}

/// The cluster as this node sees it: its id, and per peer (the routing snapshot's and the
/// queues', by node id) the queue's counters and a summary of the interest it advertised.
fn cluster_info(mesh: Option<&crate::mesh::MeshHandle>) -> proto::ClusterInfo {
    use aqueduct_core::mesh::Key;
    use std::collections::BTreeMap;
    let Some(mesh) = mesh else {
        return proto::ClusterInfo {
            cluster_enabled: false,
            node_id: String::new(),
            peers: Vec::new(),
            refused_blocks: 0,
        };
    };
    let mut peers: BTreeMap<String, proto::ClusterPeer> = BTreeMap::new();
    fn entry(
        peers: &mut BTreeMap<String, proto::ClusterPeer>,
        node: String,
    ) -> &mut proto::ClusterPeer {
        peers
            .entry(node.clone())
            .or_insert_with(|| proto::ClusterPeer {
                node_id: node,
                counters: None,
                interest: Some(proto::PeerInterest::default()),
            })
    }
    for (node, interest) in mesh.view() {
        let mut sum = proto::PeerInterest::default();
        for u in interest.updates() {
            match u.key {
                Key::Plain(_) => {
                    sum.filters += 1;
                    sum.subscriptions += u64::from(u.count);
                }
                Key::Group(_) => {
                    sum.groups += 1;
                    sum.group_members += u64::from(u.count);
                }
            }
        }
        entry(&mut peers, node.to_string()).interest = Some(sum);
    }
    for c in mesh.peer_counters() {
        entry(&mut peers, c.node.to_string()).counters = Some(proto::PeerCounters {
            forwarded: c.forwarded,
            dropped: c.dropped,
            bytes: c.bytes,
            raw_bytes: c.raw_bytes,
            expired: c.expired,
            queued: c.queued,
            received: c.received,
            received_bytes: c.received_bytes,
            reconnects: c.reconnects,
            not_stored: c.not_stored,
        });
    }
    proto::ClusterInfo {
        cluster_enabled: true,
        node_id: mesh.node().to_string(),
        peers: peers.into_values().collect(),
        refused_blocks: mesh.refused_blocks.load(Ordering::Relaxed),
    }
}

/// Why the admin API could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum AdminConnectError {
    #[error("invalid server name {0:?} for TLS")]
    ServerName(String),
    #[error("cannot connect to the admin API at {addr}: {reason}")]
    Connect { addr: String, reason: String },
}

/// A client of the admin API at `addr` over TLS (`tls` must offer ALPN `h2` and present an admin
/// client certificate), verifying the broker's certificate for `server_name`.
pub async fn connect(
    addr: String,
    tls: rustls::ClientConfig,
    server_name: &str,
    timeout: Duration,
) -> Result<
    proto::admin_service_client::AdminServiceClient<tonic::transport::Channel>,
    AdminConnectError,
> {
    let name = rustls_pki_types::ServerName::try_from(server_name.to_string())
        .map_err(|_| AdminConnectError::ServerName(server_name.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let target = addr.clone();
    let connect = tower::service_fn(move |_: tonic::transport::Uri| {
        let (connector, name, target) = (connector.clone(), name.clone(), target.clone());
        async move {
            let tcp = TcpStream::connect(&target).await?;
            let tls = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    let err = |reason: String| AdminConnectError::Connect {
        addr: addr.clone(),
        reason,
    };
    // The URI only names the service; the connector above makes the connection.
    let channel = tonic::transport::Endpoint::from_static("http://aqueduct-admin")
        .connect_timeout(timeout)
        .connect_with_connector(connect)
        .await
        .map_err(|e| {
            let mut reason = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                // Errors that wrap another often repeat its text: say each part once.
                let part = s.to_string();
                if !reason.contains(&part) {
                    reason = format!("{reason}: {part}");
                }
                source = s.source();
            }
            err(reason)
        })?;
    // Listings of a large broker (topics, clients) pass tonic's default 4 MiB.
    Ok(
        proto::admin_service_client::AdminServiceClient::new(channel)
            .max_decoding_message_size(MAX_ANSWER),
    )
}

#[cfg(test)]
mod tests {
    use super::{proto, rule_from_proto, InProgress};

    /// A bad rule in a request names the request's field (`client_id`), not the config
    /// file's (`client`).
    #[test]
    fn a_bad_rule_names_the_request_s_field() {
        let rule = proto::AclRule {
            client_id: "a*b".into(),
            topic: "t".into(),
            permission: "all".into(),
        };
        let e = rule_from_proto(Some(2), &rule).expect_err("bad client pattern");
        assert!(
            e.message().starts_with("rule 2: client_id: "),
            "{}",
            e.message()
        );
    }

    /// With every handshake slot taken, the oldest handshake of the group with the most goes:
    /// many addresses' idle connections cannot keep a new one out.
    #[tokio::test]
    async fn the_group_with_the_most_handshakes_gives_one_up() {
        let mut tasks = tokio::task::JoinSet::new();
        let mut in_progress = InProgress::default();
        let a = "10.0.0.1".parse().expect("ip");
        let b = "10.0.0.2".parse().expect("ip");
        let mut ids = Vec::new();
        for group in [a, b, b, a, b] {
            let task = tasks.spawn(std::future::pending::<()>());
            ids.push(task.id());
            in_progress.started(task, group);
        }
        assert_eq!(in_progress.evict(), Some(b));
        assert_eq!((in_progress.of(a), in_progress.of(b)), (2, 2));
        // The oldest of b's (the second started) was aborted.
        let ended = tasks.join_next_with_id().await.expect("one ended");
        let e = ended.expect_err("aborted");
        assert!(e.is_cancelled());
        assert_eq!(e.id(), ids[1]);
        in_progress.ended(e.id());
        assert_eq!(in_progress.len(), 4);
        tasks.abort_all();
    }
}
