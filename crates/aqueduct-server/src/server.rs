//! The broker process: binds the QUIC endpoint, accepts connections, runs the ack-wait ticker,
//! and shuts down gracefully (stop accepting, flush deliveries, close connections with a reason).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aqueduct_core::{Broker, PublishContext};
use aqueduct_proto::ErrorCode;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::access::Access;
use crate::config::{AalConfig, Config, TransportConfig};
use crate::connection::ConnState;
use crate::consumers::Consumers;
use crate::durable::Durable;
use crate::revocation::ClientVerifier;
use crate::stats::ServerStats;
use crate::tls::{self, TlsError};
use aqueduct_log::Log;

/// How often unsettled deliveries are checked against `broker.ack_wait`.
const ACK_TICK: Duration = Duration::from_millis(100);
/// How long shutdown waits for connections to flush and close.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long the shutdown waits, after aborting the connections left at [`SHUTDOWN_GRACE`], for
/// their stream tasks to end.
const STREAMS_END_WAIT: Duration = Duration::from_secs(2);

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("listen_addr {addr}: {reason}")]
    Bind { addr: SocketAddr, reason: String },
    #[error("metrics_addr {addr}: {reason}")]
    MetricsBind { addr: SocketAddr, reason: String },
    #[error("webtransport.listen_addr {addr}: {reason}")]
    WebTransportBind { addr: SocketAddr, reason: String },
    #[error("admin.listen_addr {addr}: {reason}")]
    AdminBind { addr: SocketAddr, reason: String },
    #[error("transport settings rejected: {0}")]
    Transport(String),
    /// The log's error is part of the message, not also its `source()` (a printer of error
    /// chains would say it twice).
    #[error("aal (durable log): {0}")]
    Log(aqueduct_log::LogError),
    #[error("{0}")]
    Startup(String),
}

impl From<aqueduct_log::LogError> for ServerError {
    fn from(e: aqueduct_log::LogError) -> Self {
        ServerError::Log(e)
    }
}

/// `tls.crl_file`'s lists (at `path`) as read now, checked against the verifiers that use the
/// file (the clients' and the admin API's, and the cluster's when it is `cluster.tls.crl_file`
/// too): a list of a CA none of them holds would revoke nothing, and is refused; lists past
/// their next update are warned about.
fn read_tls_lists(
    path: &std::path::Path,
    config: &Config,
    verifiers: [Option<&ClientVerifier>; 2],
    mesh: Option<&crate::mesh_tls::MeshTls>,
) -> Result<crate::revocation::Lists, crate::tls::TlsError> {
    let lists = crate::revocation::Lists::read(crate::revocation::CRL_KEY, path)?;
    lists.warn_expired();
    let peers = mesh
        .filter(|_| config.cluster.crl_file.as_deref() == Some(path))
        .map(|m| m.peer_certs().as_ref());
    let [client, admin] = verifiers;
    crate::revocation::all_claimed(&lists, &[client, admin, peers])?;
    Ok(lists)
}

/// How many handshakes of connections from peers' addresses may run at once beyond
/// `transport.max_connections` (a peer keeps at most 8 connections to a node; a few peers
/// reconnecting at once after a blip).
pub(crate) const PEER_HANDSHAKES: usize = 32;

/// What every connection task shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: Config,
    pub broker: Arc<Broker>,
    pub stats: Arc<ServerStats>,
    pub connections: AtomicUsize,
    /// The durable log, when `aal.enabled`.
    pub durable: Option<Arc<Durable>>,
    /// Durable consumers' positions (with the durable log).
    pub consumers: Option<Arc<Consumers>>,
    /// ACL and quotas (changed by the admin API and SIGHUP).
    pub access: Arc<Access>,
    /// Live connections, for the admin API (list, disconnect) and for re-checking subscriptions
    /// when the ACL changes. Locked on connect, disconnect and admin calls only.
    pub clients: Mutex<HashMap<u64, Arc<ConnState>>>,
    pub next_conn_id: AtomicU64,
    /// Handshakes of peers' connections let through while the broker is at
    /// `transport.max_connections` (at most [`PEER_HANDSHAKES`] at once).
    pub peer_handshakes: Arc<tokio::sync::Semaphore>,
    /// When the broker started (its uptime).
    pub epoch: Instant,
    /// The QUIC address actually bound.
    pub local_addr: SocketAddr,
    /// The cluster mesh, when `cluster.enabled`.
    pub mesh: Option<crate::mesh::MeshHandle>,
    /// The QUIC endpoint (a handle), for its connection count.
    pub endpoint: quinn::Endpoint,
    pub mesh_tls: Option<Arc<crate::mesh_tls::MeshTls>>,
    /// Verifies client certificates (`tls.client_ca_file`, `tls.crl_file`), if configured.
    pub client_certs: Option<Arc<ClientVerifier>>,
    /// Verifies the admin API's client certificates, when it is enabled.
    pub admin_certs: Option<Arc<ClientVerifier>>,
    /// The admin API's open connections.
    pub admin_conns: crate::admin::AdminConns,
    /// The certificate browsers get (WebTransport with a generated certificate).
    pub browser_certs: Option<Arc<crate::webtransport::BrowserCerts>>,
    /// Trace export, when `tracing.otlp_endpoint` is set.
    pub tracer: Option<Arc<crate::otel::Tracer>>,
    /// The UDP address browsers are told to connect to (`webtransport.listen_addr` as bound,
    /// else the broker's own).
    pub webtransport_addr: SocketAddr,
    /// Told each time a stream task has ended (`ServerStats::live_streams` went down).
    pub stream_ended: tokio::sync::Notify,
}

impl Shared {
    /// The quota buckets' clock: the one their policy changes read too.
    pub fn now_ns(&self) -> u64 {
        self.access.quotas.now_ns()
    }

    pub fn live_clients(&self) -> Vec<Arc<ConnState>> {
        let mut v: Vec<_> = self
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|c| c.id);
        v
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // A server dropped without serving (or after) still closes its log cleanly.
        if let Some(d) = &self.durable {
            d.close();
        }
    }
}

/// A bound, not yet serving, broker.
#[derive(Debug)]
pub struct Server {
    endpoint: quinn::Endpoint,
    /// WebTransport's own endpoint, when `webtransport.listen_addr` is set.
    wt_endpoint: Option<quinn::Endpoint>,
    metrics: tokio::net::TcpListener,
    /// The admin API's listener and TLS, when `admin.enabled`.
    admin: Option<(tokio::net::TcpListener, Arc<rustls::ServerConfig>)>,
    /// The cluster mesh's driver, when `cluster.enabled` (runs in `serve`).
    mesh_driver: Option<crate::mesh::Driver>,
    /// How `cluster.discovery` looks peers up.
    resolver: Arc<dyn crate::discovery::Resolver>,
    shared: Arc<Shared>,
    dev_cert: Option<PathBuf>,
    /// Sends the spans to the collector (runs in `serve`).
    trace_export: Option<crate::otel::Export>,
}

fn transport_config(
    t: &TransportConfig,
    webtransport: bool,
) -> Result<quinn::TransportConfig, ServerError> {
    let mut c = quinn::TransportConfig::default();
    // Start small and let each connection raise its own allowance as its client opens streams
    // (connection.rs): quinn keeps state for every stream a peer may open, ~90 bytes each, so an
    // idle connection costs ~20 KB less than with all 256 allowed up front.
    c.max_concurrent_bidi_streams(initial_streams(t).into());
    // HTTP/3 needs 3 unidirectional streams (control, QPACK encoder and decoder), and Chromium
    // wants them in the handshake's transport parameters: raised after the handshake, it closes
    // the connection (QUIC_ZERO_RTT_RESUMPTION_LIMIT_REDUCED, "new unidirectional limit 0
    // decreases the current limit: 3"). A native client's are refused unread (connection.rs).
    let uni = if webtransport {
        crate::webtransport::H3_UNI_STREAMS
    } else {
        0
    };
    c.max_concurrent_uni_streams(uni.into());
    // QUIC datagrams: the native protocol has none, so none are taken (a client's would be a
    // protocol violation). quinn's default buffers up to 1.25 MB of a connection's unread
    // datagrams, which a client could fill on every connection. HTTP/3 must offer them
    // (RFC 9297: a browser closes a connection that announces H3_DATAGRAM without them), and
    // the broker never reads them: a small buffer, its oldest dropped first.
    c.datagram_receive_buffer_size(webtransport.then_some(crate::webtransport::DATAGRAM_BUFFER));
    c.max_idle_timeout(if t.idle_timeout.is_zero() {
        None
    } else {
        Some(
            quinn::IdleTimeout::try_from(t.idle_timeout)
                .map_err(|e| ServerError::Transport(format!("transport.idle_timeout: {e}")))?,
        )
    });
    c.keep_alive_interval((!t.keep_alive_interval.is_zero()).then_some(t.keep_alive_interval));
    c.stream_receive_window(t.stream_receive_window.into());
    c.receive_window(t.receive_window.into());
    c.send_window(t.send_window);
    aqueduct_udp::path_mtu(&mut c, t.initial_mtu, t.max_mtu);
    // Fewer ACKs from clients: each is a datagram the broker must receive and handle.
    c.ack_frequency_config(ack_frequency(t));
    Ok(c)
}

/// What the broker asks of its peers' ACKs: clients' and cluster peers' alike.
fn ack_frequency(t: &TransportConfig) -> Option<quinn::AckFrequencyConfig> {
    aqueduct_udp::ack_frequency(t.ack_eliciting_threshold, t.ack_delay)
}

/// Streams a new connection may open before the broker raises the allowance.
pub(crate) const INITIAL_STREAMS: u32 = 16;

pub(crate) fn initial_streams(t: &TransportConfig) -> u32 {
    t.max_streams_per_connection.min(INITIAL_STREAMS)
}

/// A UDP socket with the configured buffer sizes (the kernel may clamp them to its maximum).
fn udp_socket(addr: SocketAddr, buffer: usize) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Protocol, Type};
    let socket = bind_with_ipv4_fallback(addr, |addr| {
        let socket = new_socket(addr, Type::DGRAM, Protocol::UDP)?;
        socket.bind(&addr.into())?;
        Ok(socket)
    })?;
    if buffer > 0 {
        if let Err(e) = socket.set_recv_buffer_size(buffer) {
            warn!("cannot set UDP receive buffer to {buffer} bytes: {e}");
        }
        if let Err(e) = socket.set_send_buffer_size(buffer) {
            warn!("cannot set UDP send buffer to {buffer} bytes: {e}");
        }
    }
    Ok(socket.into())
}

/// Why a bind failed, in words: a port in use says what usually holds it and how to choose
/// another (`how`: the command-line flag, or the key).
fn bind_failure(e: &std::io::Error, how: &str) -> String {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        format!(
            "{e}: another program holds the port (a broker started before and still running?); \
             stop it, or choose another address with {how}"
        )
    } else {
        e.to_string()
    }
}

/// Bind `addr`; where it is `[::]` (every interface, as `":4242"` is read) and the host has no
/// IPv6, bind `0.0.0.0` on the same port instead, as Go's listeners do. A port taken or not
/// permitted is reported as such for the address as configured; where the IPv4 bind fails too,
/// its error is the one reported (the IPv6 one only says there is no IPv6).
fn bind_with_ipv4_fallback<T>(
    addr: SocketAddr,
    bind: impl Fn(SocketAddr) -> std::io::Result<T>,
) -> std::io::Result<T> {
    match bind(addr) {
        Err(e)
            if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED)
                && !matches!(
                    e.kind(),
                    std::io::ErrorKind::AddrInUse | std::io::ErrorKind::PermissionDenied
                ) =>
        {
            let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port());
            let bound = bind(v4)?;
            info!(%addr, "IPv6 is not available here ({e}): listening on {v4} (IPv4 only)");
            Ok(bound)
        }
        r => r,
    }
}

/// A socket of `addr`'s family; an IPv6 one serves IPv4 too, whatever the host's
/// `bindv6only` (where the system refuses, some never serve IPv4 on an IPv6 socket: IPv6 only).
fn new_socket(
    addr: SocketAddr,
    ty: socket2::Type,
    protocol: socket2::Protocol,
) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), ty, Some(protocol))?;
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    Ok(socket)
}

/// A TCP listener for `addr` (`[::]` serves IPv6 and IPv4).
fn tcp_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    bind_with_ipv4_fallback(addr, |addr| {
        let socket = new_socket(addr, socket2::Type::STREAM, socket2::Protocol::TCP)?;
        // As std and tokio do on Unix: a restarted broker rebinds at once (TIME_WAIT).
        #[cfg(unix)]
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        tokio::net::TcpListener::from_std(socket.into())
    })
}

impl Server {
    /// Set up TLS and bind the UDP socket. Must run inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Server, ServerError> {
        for warning in config.warnings() {
            warn!("{warning}");
        }
        let identity = tls::identity(&config.tls)?;
        // Client certificates: the CA's, minus the revoked ones (`tls.crl_file`, re-read on
        // SIGHUP); one verifier for the client listener and the cluster's client check.
        let client_certs = match &config.tls.client_ca_file {
            Some(ca) => Some(Arc::new(ClientVerifier::new(
                "tls.client_ca_file",
                ca,
                !config.tls.require_client_cert,
                (crate::revocation::CRL_KEY, config.tls.crl_file.as_deref()),
                false,
            )?)),
            None => None,
        };
        // The admin API's: the same lists. With a clients' CA of another name, a certificate
        // of an admin CA they do not cover passes (the lists may be the clients' CA's alone;
        // a warning says so); with none, the lists are the admin CA's, and must cover it.
        let admin_certs = match &config.admin {
            Some(a) => Some(Arc::new(ClientVerifier::new(
                "admin.client_ca_file",
                &a.client_ca_file,
                false,
                (crate::revocation::CRL_KEY, config.tls.crl_file.as_deref()),
                config
                    .tls
                    .client_ca_file
                    .as_ref()
                    .is_some_and(|c| c != &a.client_ca_file),
            )?)),
            None => None,
        };

        let mesh_tls = match config.cluster.enabled {
            true => Some(Arc::new(crate::mesh_tls::MeshTls::load(
                &config.cluster,
                &config.tls,
                client_certs.clone(),
            )?)),
            false => None,
        };
        // Every list in tls.crl_file must be of one of those CAs (or the cluster's, when the
        // same file is cluster.tls.crl_file too): one of another would revoke nothing (an old
        // admin CA's, say), unsaid.
        if let (Some(path), true) = (&config.cluster.crl_file, mesh_tls.is_some()) {
            crate::revocation::Lists::read(crate::revocation::MESH_CRL_KEY, path)?.warn_expired();
        }
        if let Some(path) = &config.tls.crl_file {
            read_tls_lists(
                path,
                &config,
                [client_certs.as_deref(), admin_certs.as_deref()],
                mesh_tls.as_deref(),
            )?;
        }
        // Browsers get a short-lived certificate of their own while the broker's is generated.
        let browser_certs = match config.webtransport.enabled && identity.is_generated() {
            true => {
                let certs = Arc::new(crate::webtransport::BrowserCerts::default());
                certs.renew().map_err(|e| {
                    ServerError::Startup(format!(
                        "webtransport: cannot generate the browsers' certificate: {e}"
                    ))
                })?;
                Some(certs)
            }
            false => None,
        };
        let (crypto, dev_cert) = tls::server_crypto(
            &config.tls,
            &identity,
            client_certs.clone(),
            mesh_tls.as_deref(),
            config.webtransport.enabled,
            browser_certs.as_ref(),
        )?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server_config.transport_config(Arc::new(transport_config(
            &config.transport,
            config.webtransport.enabled,
        )?));
        // `failed`: the error naming the address's key; `how`: where to choose another.
        let bind_endpoint =
            |addr: SocketAddr, failed: fn(SocketAddr, String) -> ServerError, how: &str| {
                let socket = udp_socket(addr, config.transport.socket_buffer)
                    .map_err(|e| failed(addr, bind_failure(&e, how)))?;
                // Registered for reading only: a send does not wake the other worker thread.
                quinn::Endpoint::new(
                    aqueduct_udp::endpoint_config(config.transport.max_mtu),
                    Some(server_config.clone()),
                    socket,
                    aqueduct_udp::runtime(),
                )
                .map_err(|e| failed(addr, e.to_string()))
            };
        let endpoint = bind_endpoint(
            config.listen_addr,
            |addr, reason| ServerError::Bind { addr, reason },
            "--addr",
        )?;
        // Browsers' own port, when set (the broker's port serves them too).
        let wt_endpoint = match config.webtransport.listen_addr {
            Some(addr) if config.webtransport.enabled => Some(bind_endpoint(
                addr,
                |addr, reason| ServerError::WebTransportBind { addr, reason },
                "webtransport.listen_addr",
            )?),
            // Warned about (Config::warnings).
            _ => None,
        };
        let metrics = tcp_listener(config.metrics_addr).map_err(|e| ServerError::MetricsBind {
            addr: config.metrics_addr,
            reason: bind_failure(&e, "--metrics-addr"),
        })?;
        let admin = match (&config.admin, &admin_certs) {
            (Some(a), Some(verifier)) => {
                let crypto = tls::admin_crypto(&identity, verifier.clone())?;
                let listener = tcp_listener(a.listen_addr).map_err(|e| ServerError::AdminBind {
                    addr: a.listen_addr,
                    reason: bind_failure(&e, "admin.listen_addr"),
                })?;
                Some((listener, Arc::new(crypto)))
            }
            _ => None,
        };
        // Every socket is ours: only now may the development certificate be replaced.
        if let Some(cert) = &dev_cert {
            // Its section of the file (shared with the other local brokers) is keyed by the
            // UDP port it bound.
            let port = endpoint.local_addr().map(|a| a.port()).unwrap_or(0);
            let cert = &cert.clone().bound_to(port);
            match &browser_certs {
                Some(browser) => browser.publish_with(cert.clone())?,
                None => cert.write()?,
            }
        }
        let dev_cert = dev_cert.map(|c| c.path);
        let broker = Arc::new(Broker::new(config.broker.clone()));
        let stats = Arc::new(ServerStats::default());
        // A start that fails once the log is open closes it (and stops its writer thread), so
        // that the next try does not find it left open, as after a crash.
        let mut close_log = CloseLogOnError(None);
        let (durable, consumers) = match &config.aal {
            Some(aal) => {
                let durable = open_log(aal, stats.clone()).await?;
                close_log.0 = Some(durable.clone());
                let consumers = Arc::new(Consumers::open(&aal.dir, aal.consumers)?);
                let source = durable.clone();
                broker
                    .set_offset_source(Box::new(move |topic| source.next_offset(topic.as_bytes())));
                durable.set_forget_gate(&broker, &consumers);
                (Some(durable), Some(consumers))
            }
            None => (None, None),
        };
        if let Some(path) = &config.admin_state_when_off {
            Access::set_aside_state_file(path).map_err(|e| ServerError::Startup(e.to_string()))?;
        }
        let access = Access::start(
            &config.access,
            config.admin.as_ref().map(|a| a.state_file.clone()),
        )
        .map_err(|e| ServerError::Startup(e.to_string()))?;
        if config.access.acl.enabled {
            let p = access.acl.policy();
            info!(default = %p.default, rules = p.rules.len(), "access control on");
        }
        let local_addr = endpoint.local_addr().unwrap_or(config.listen_addr);
        let (mesh_driver, mesh) = match mesh_tls.clone() {
            Some(t) => {
                let (driver, handle) = crate::mesh::new(
                    t,
                    broker.clone(),
                    durable.clone(),
                    &config.cluster,
                    config.block_timeout,
                    crate::mesh::DialTransport {
                        ack_frequency: ack_frequency(&config.transport),
                        initial_mtu: config.transport.initial_mtu,
                    },
                );
                let h = handle.clone();
                broker.set_interest_listener(Box::new(move |key, delta| {
                    h.send(crate::mesh::Event::Local { key, delta })
                }));
                // A group's message whose last member here left goes to a member elsewhere.
                let h = handle.clone();
                broker.set_orphan_listener(Box::new(move |orphan| h.hand_over(&orphan)));
                // Dead letters made here reach the dead-letter topic's subscribers on every node.
                let h = handle.clone();
                broker.set_dead_letter_router(Box::new(move |ctx, p, local| {
                    h.publish(ctx, p, |ctx| local(ctx))
                }));
                (Some(driver), Some(handle))
            }
            None => (None, None),
        };
        let (tracer, trace_export) = match &config.tracing {
            Some(t) => {
                let (tracer, export) =
                    crate::otel::Tracer::start(t).map_err(ServerError::Startup)?;
                (Some(tracer), Some(export))
            }
            None => (None, None),
        };
        let endpoint_handle = endpoint.clone();
        let webtransport_addr = wt_endpoint
            .as_ref()
            .and_then(|e| e.local_addr().ok())
            .unwrap_or(local_addr);
        close_log.0 = None;
        Ok(Server {
            wt_endpoint,
            trace_export,
            endpoint,
            metrics,
            admin,
            mesh_driver,
            resolver: Arc::new(crate::discovery::SystemResolver),
            shared: Arc::new(Shared {
                config,
                broker,
                stats,
                connections: AtomicUsize::new(0),
                durable,
                consumers,
                access: Arc::new(access),
                clients: Mutex::new(HashMap::new()),
                next_conn_id: AtomicU64::new(1),
                peer_handshakes: Arc::new(tokio::sync::Semaphore::new(PEER_HANDSHAKES)),
                epoch: Instant::now(),
                local_addr,
                mesh,
                mesh_tls,
                client_certs,
                admin_certs,
                admin_conns: Default::default(),
                browser_certs,
                endpoint: endpoint_handle,
                tracer,
                webtransport_addr,
                stream_ended: tokio::sync::Notify::new(),
            }),
            dev_cert,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .unwrap_or(self.shared.config.listen_addr)
    }

    /// The UDP address browsers connect to (`webtransport.listen_addr` as bound, else
    /// [`local_addr`](Self::local_addr)).
    pub fn webtransport_addr(&self) -> SocketAddr {
        self.shared.webtransport_addr
    }

    /// The address of the metrics and health endpoint.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
            .local_addr()
            .unwrap_or(self.shared.config.metrics_addr)
    }

    /// Where the generated development certificate was written, if one was generated.
    pub fn dev_cert_file(&self) -> Option<&PathBuf> {
        self.dev_cert.as_ref()
    }

    /// The routing core (for inspection and tests).
    pub fn broker(&self) -> Arc<Broker> {
        self.shared.broker.clone()
    }

    /// Server counters.
    pub fn stats(&self) -> Arc<ServerStats> {
        self.shared.stats.clone()
    }

    /// The admin API's address, when it is enabled.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// Look cluster peers up with `resolver` instead of the system's (tests).
    pub fn set_resolver(&mut self, resolver: Arc<dyn crate::discovery::Resolver>) {
        self.resolver = resolver;
    }

    /// A handle to change the running broker's access policy (SIGHUP).
    pub fn control(&self) -> Control {
        Control {
            shared: self.shared.clone(),
        }
    }

    /// Serve until `shutdown` completes, then shut down gracefully.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let Server {
            endpoint,
            wt_endpoint,
            metrics,
            admin,
            mesh_driver,
            resolver,
            shared,
            trace_export,
            ..
        } = self;
        info!(
            addr = %endpoint.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            alpn = "aqueduct-v1",
            "broker listening (QUIC/UDP, TLS 1.3)"
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let ticker = Owned::spawn(ack_ticker(
            shared.broker.clone(),
            shared.durable.clone(),
            shared.config.block_timeout,
            stop_rx.clone(),
        ));
        // Renews the browsers' certificate (aborted with the server).
        let _renewer = shared
            .browser_certs
            .clone()
            .map(|c| Owned::spawn(c.keep_renewed()));
        if shared.config.webtransport.enabled {
            info!(
                path = %shared.config.webtransport.path_prefix,
                "WebTransport for browsers on the same UDP port (ALPN h3)"
            );
        }
        if let Some(wt) = &wt_endpoint {
            info!(
                addr = %wt.local_addr().map(|a| a.to_string()).unwrap_or_default(),
                path = %shared.config.webtransport.path_prefix,
                "WebTransport for browsers on a UDP port of its own too (webtransport.listen_addr; ALPN h3 only)"
            );
        }
        // Saves durable consumers' positions; stopped (and a last save made) once the
        // connections are closed, below.
        let (checkpoint_stop, checkpoint_stop_rx) = watch::channel(false);
        let checkpointer = shared
            .consumers
            .clone()
            .zip(shared.durable.clone())
            .map(|(c, d)| Owned::spawn(crate::consumers::checkpointer(c, d, checkpoint_stop_rx)));
        let http = Arc::new(crate::http::Endpoint {
            shared: shared.clone(),
            labels: crate::metrics::TopicLabels::default(),
            ready: std::sync::atomic::AtomicBool::new(true),
            renders: Arc::new(tokio::sync::Semaphore::new(crate::http::RENDERS)),
        });
        info!(addr = %metrics.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics endpoint listening (GET /metrics, /healthz, /readyz)");
        // The endpoint outlives the QUIC side's shutdown, so /readyz reports it.
        let (http_stop, http_stop_rx) = watch::channel(false);
        let metrics_task = Owned::spawn(crate::http::serve(metrics, http.clone(), http_stop_rx));
        let (admin_stop, admin_stop_rx) = watch::channel(false);
        let admin_task = admin.map(|(listener, tls)| {
            info!(
                addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
                "admin API listening (gRPC over TLS 1.3, client certificate required)"
            );
            Owned::spawn(crate::admin::serve(
                listener,
                tls,
                shared.clone(),
                admin_stop_rx,
            ))
        });
        // Stopped last, once nothing can make spans any more, so the last ones are exported.
        let (trace_stop, trace_stop_rx) = watch::channel(false);
        let trace_task = trace_export.map(|e| Owned::spawn(e.run(trace_stop_rx)));
        let (mesh_stop, mesh_stop_rx) = watch::channel(false);
        let mesh_task = mesh_driver.map(|driver| {
            Owned::spawn(driver.run_with_peers(
                shared.config.cluster.clone(),
                resolver,
                endpoint.clone(),
                mesh_stop_rx,
            ))
        });
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        let mut wt_open = wt_endpoint.is_some();
        loop {
            let (incoming, webtransport_only) = tokio::select! {
                _ = &mut shutdown => break,
                incoming = endpoint.accept() => match incoming {
                    Some(i) => (i, false),
                    None => break,
                },
                incoming = accept_on(wt_endpoint.as_ref().filter(|_| wt_open)) => match incoming {
                    Some(i) => (i, true),
                    None => {
                        // Its socket failed: browsers keep the broker's own port.
                        warn!("the WebTransport port (webtransport.listen_addr) stopped accepting; browsers can still use the broker's port");
                        wt_open = false;
                        continue;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            };
            let live = shared.connections.fetch_add(1, Ordering::AcqRel);
            // Beyond the limit, only a peer's connection (known by its address until its
            // handshake says) is let through, a few at a time: the limit is the clients'.
            // Refused, a node full of clients stayed apart from its peers.
            let over_limit = if live < shared.config.transport.max_connections {
                None
            } else {
                let peer = shared
                    .mesh
                    .as_ref()
                    .is_some_and(|m| m.is_peer_addr(incoming.remote_address()));
                if peer && !incoming.remote_address_validated() {
                    // A source address anyone can write: proved first (a Retry round trip),
                    // so that spoofed packets cannot hold the peers' handshake permits.
                    let _ = incoming.retry();
                    shared.connections.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let permit = peer
                    .then(|| shared.peer_handshakes.clone().try_acquire_owned().ok())
                    .flatten();
                if permit.is_none() {
                    shared.connections.fetch_sub(1, Ordering::AcqRel);
                    shared
                        .stats
                        .connections_refused
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(remote = %crate::connection::canonical(incoming.remote_address()), live, "connection refused: transport.max_connections reached");
                    incoming.refuse();
                    continue;
                }
                permit
            };
            connections.spawn(crate::connection::handle(
                incoming,
                shared.clone(),
                stop_rx.clone(),
                webtransport_only,
                over_limit,
            ));
        }
        info!(
            connections = shared.connections.load(Ordering::Acquire),
            "shutting down: no new connections; flushing queued deliveries"
        );
        http.ready.store(false, Ordering::Release);
        endpoint.set_server_config(None);
        if let Some(wt) = &wt_endpoint {
            wt.set_server_config(None);
        }
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("connections did not close within {SHUTDOWN_GRACE:?}; closing them now");
            // Ended here, before the log closes: a connection's cleanup (a group member leaving)
            // can make dead letters, whose offsets only a log still open records.
            connections.shutdown().await;
            // An aborted connection drops its stream tasks without waiting for them: they end
            // (and end their subscriptions) on their own workers, and must have before the
            // log closes. Bounded: a stream task's end takes no I/O.
            let shared = &shared;
            let ended = tokio::time::timeout(STREAMS_END_WAIT, async {
                loop {
                    let ended = shared.stream_ended.notified();
                    tokio::pin!(ended);
                    ended.as_mut().enable();
                    if shared.stats.live_streams.load(Ordering::Acquire) == 0 {
                        return;
                    }
                    ended.await;
                }
            })
            .await;
            if ended.is_err() {
                warn!(
                    streams = shared.stats.live_streams.load(Ordering::Acquire),
                    "stream tasks of aborted connections did not end within {STREAMS_END_WAIT:?}"
                );
            }
        }
        // Stopped, not just told to: it makes dead letters (expired ack waits) under the log's
        // order, which must come before the log closes, and hands them to the mesh.
        ticker.stop_within(Some(Duration::ZERO)).await;
        let _ = checkpoint_stop.send(true);
        if let Some(task) = checkpointer {
            // Its last save must finish.
            task.stop_within(None).await;
        }
        // The mesh before the endpoint closes (its connections are on it) and before the log:
        // it leaves gracefully, waiting up to LEAVE_WAIT for its peers to publish the copies it
        // sent them (the handed-over jobs of the members that just left among them), and it
        // logs the copies peers forward and the dead letters of its slow consumers, all of which
        // must reach the log before it closes.
        let _ = mesh_stop.send(true);
        if let Some(task) = mesh_task {
            task.stop_within(Some(crate::mesh::LEAVE_WAIT + Duration::from_secs(1)))
                .await;
        }
        endpoint.close(ErrorCode::SHUTTING_DOWN.0.into(), b"broker shutting down");
        if let Some(wt) = &wt_endpoint {
            wt.close(ErrorCode::SHUTTING_DOWN.0.into(), b"broker shutting down");
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            endpoint.wait_idle().await;
            if let Some(wt) = &wt_endpoint {
                wt.wait_idle().await;
            }
        })
        .await;
        if let Some(d) = shared.durable.clone() {
            // Write what is queued and close the log cleanly (blocking file I/O). Nothing that
            // hands out offsets runs any more.
            let _ = tokio::task::spawn_blocking(move || d.close()).await;
        }
        let _ = admin_stop.send(true);
        if let Some(task) = admin_task {
            task.stop_within(Some(Duration::from_secs(1))).await;
        }
        let _ = http_stop.send(true);
        metrics_task.stop_within(Some(Duration::from_secs(1))).await;
        let _ = trace_stop.send(true);
        if let Some(task) = trace_task {
            task.stop_within(Some(Duration::from_secs(12))).await;
        }
        info!("broker stopped");
        Ok(())
    }
}

/// The next connection on `endpoint`; never, without one.
async fn accept_on(endpoint: Option<&quinn::Endpoint>) -> Option<quinn::Incoming> {
    match endpoint {
        Some(e) => e.accept().await,
        None => std::future::pending().await,
    }
}

/// A task the server owns: aborted when dropped (also when `serve` itself is dropped midway),
/// so it never outlives the server whose state it holds.
struct Owned(Option<tokio::task::JoinHandle<()>>);

impl Owned {
    fn spawn(task: impl Future<Output = ()> + Send + 'static) -> Owned {
        Owned(Some(tokio::spawn(task)))
    }

    /// Wait for it to end on its own, at most `limit` (`None`: as long as it takes); then
    /// abort it.
    async fn stop_within(mut self, limit: Option<Duration>) {
        let Some(mut task) = self.0.take() else {
            return;
        };
        let ended = match limit {
            Some(limit) => tokio::time::timeout(limit, &mut task).await.is_ok(),
            None => {
                let _ = (&mut task).await;
                true
            }
        };
        if !ended {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Changes a running broker's access policy: what `SIGHUP` does.
#[derive(Debug, Clone)]
pub struct Control {
    shared: Arc<Shared>,
}

impl Control {
    /// Make `access` (the config file's `acl` and `broker.quotas` sections, just re-read) the
    /// live policy, close the live subscriptions it refuses, and persist it. Returns how many
    /// were closed. The closing does not wait for the state file (a slow disk). All of it runs
    /// on a blocking thread: the change may wait for a walk in progress, the walk takes as long
    /// as there are subscriptions, and the state file is file I/O.
    pub async fn reload_access(
        &self,
        access: &crate::access::AccessConfig,
    ) -> Result<usize, String> {
        let access = access.clone();
        let (closed, saved) = crate::admin::off_workers(&self.shared, move |shared| {
            shared.access.apply(&access);
            let closed = crate::admin::recheck_subscriptions(shared);
            (closed, shared.access.changed())
        })
        .await
        .map_err(|e| e.to_string())?;
        saved.map_err(|e| e.to_string())?;
        Ok(closed)
    }

    /// A testing aid: hold the ACL as it is until the guard is dropped, as a walk over the live
    /// subscriptions does (changes and the checks of new connections wait for it).
    #[doc(hidden)]
    pub fn hold_acl_changes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.shared.access.acl.hold_changes()
    }

    /// A testing aid: how many ACL changes and walks wait for the one holding it.
    #[doc(hidden)]
    pub fn acl_waiters(&self) -> usize {
        self.shared.access.acl.waiting_for_changes()
    }

    /// A testing aid: while `hold` is true the durable log's writer stores nothing, so the
    /// publishes it was given wait in its queue, unanswered. No effect without the log.
    #[doc(hidden)]
    pub fn hold_log_writes(&self, hold: bool) {
        if let Some(d) = &self.shared.durable {
            d.hold_writes(hold);
        }
    }

    /// A testing aid: the durable log owes all it may (no room for one more message). False
    /// without the log.
    #[doc(hidden)]
    pub fn log_is_full(&self) -> bool {
        self.shared.durable.as_ref().is_some_and(|d| d.is_full())
    }

    /// A testing aid: the durable log's writer applies retention now (it does every 10 s):
    /// deletes what the limits say and forgets the topics that emptied and nothing holds. No
    /// effect without the log.
    #[doc(hidden)]
    pub fn apply_log_retention(&self) {
        if let Some(d) = &self.shared.durable {
            d.ask_retention();
        }
    }

    /// Re-read `tls.crl_file` and `cluster.tls.crl_file` (what SIGHUP does; the files named at
    /// startup): new handshakes are checked against the new lists at once, and the live
    /// connections whose client (or peer) certificate they revoke are closed with
    /// NOT_AUTHORIZED (the admin API's [`crate::admin::DENIED_LIFETIME`] later, their calls
    /// meanwhile refused with the reason). Returns how many certificates the lists revoke and
    /// how many connections were (or are being) closed; `None` without either file. If either file is unreadable or invalid, the
    /// lists in force stay, both files' (all or none).
    pub async fn reload_revocations(&self) -> Result<Option<(usize, usize)>, String> {
        use crate::revocation::{Lists, MESH_CRL_KEY};
        let reloaded = crate::admin::off_workers(&self.shared, |shared| -> Result<_, String> {
            let mesh = shared
                .mesh_tls
                .as_ref()
                .zip(shared.config.cluster.crl_file.as_ref());
            if shared.config.tls.crl_file.is_none() && mesh.is_none() {
                return Ok(None);
            }
            // Every verifier's new lists are checked before any is put in force: all or none.
            let mut verifiers: Vec<(&Arc<ClientVerifier>, Lists)> = Vec::new();
            if let Some(path) = &shared.config.tls.crl_file {
                let lists = read_tls_lists(
                    path,
                    &shared.config,
                    [
                        shared.client_certs.as_deref(),
                        shared.admin_certs.as_deref(),
                    ],
                    shared.mesh_tls.as_deref(),
                )
                .map_err(|e| e.to_string())?;
                for v in [&shared.client_certs, &shared.admin_certs]
                    .into_iter()
                    .flatten()
                {
                    verifiers.push((v, lists.clone()));
                }
            }
            if let Some((tls, path)) = mesh {
                let lists = Lists::read(MESH_CRL_KEY, path).map_err(|e| e.to_string())?;
                lists.warn_expired();
                verifiers.push((tls.peer_certs(), lists));
            }
            let prepared = verifiers
                .iter()
                .map(|(v, lists)| v.prepare(lists))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            for ((v, _), new) in verifiers.iter().zip(prepared) {
                v.install(new);
            }
            // Each file's count once (the clients' lists serve two verifiers).
            let mut revoked = 0;
            let mut seen = Vec::new();
            for (_, lists) in &verifiers {
                if !seen.contains(&lists.key()) {
                    seen.push(lists.key());
                    revoked += lists.revoked;
                }
            }
            let live = shared.live_clients();
            let mut closed = live.iter().filter(|c| close_if_revoked(shared, c)).count();
            // The admin API's too, DENIED_LIFETIME later (calls meanwhile are told why).
            if let Some(v) = &shared.admin_certs {
                closed += shared.admin_conns.end_revoked(|chain| v.is_revoked(chain));
            }
            Ok(Some((revoked, closed)))
        })
        .await
        .map_err(|e| e.to_string())??;
        let Some((revoked, mut closed)) = reloaded else {
            return Ok(None);
        };
        if let (Some(mesh), Some(_)) = (&self.shared.mesh, &self.shared.config.cluster.crl_file) {
            closed += mesh.close_revoked().await;
        }
        Ok(Some((revoked, closed)))
    }

    /// The keys of the revocation lists a reload re-reads (`tls.crl_file`,
    /// `cluster.tls.crl_file`), those the broker started with.
    pub fn crl_keys(&self) -> Vec<&'static str> {
        let mut keys = Vec::new();
        if self.shared.config.tls.crl_file.is_some() {
            keys.push(crate::revocation::CRL_KEY);
        }
        if self.shared.mesh_tls.is_some() && self.shared.config.cluster.crl_file.is_some() {
            keys.push(crate::revocation::MESH_CRL_KEY);
        }
        keys
    }

    /// The settings of `new` (the configuration re-read for a SIGHUP) that a reload does not
    /// apply and that differ from those the broker runs with ([`Config::needs_restart`]).
    pub fn needs_restart(&self, new: &Config) -> Vec<&'static str> {
        self.shared.config.needs_restart(new)
    }

    /// The `tls.crl_file` and `cluster.tls.crl_file` the broker started with, by key: the files
    /// [`reload_revocations`] re-reads.
    ///
    /// [`reload_revocations`]: Self::reload_revocations
    pub fn crl_files(&self) -> [(&'static str, Option<&std::path::Path>); 2] {
        self.shared.config.crl_files()
    }

    /// The live ACL policy.
    pub fn acl(&self) -> Arc<aqueduct_core::acl::AclPolicy> {
        self.shared.access.acl.policy()
    }

    /// The client id of each connected client (`anonymous` without a certificate or token).
    pub fn client_ids(&self) -> Vec<String> {
        self.shared
            .live_clients()
            .iter()
            .map(|c| c.identity().to_string())
            .collect()
    }

    /// Close every connection of `client_id` with `reason`, as the admin API's
    /// `DisconnectClient` does; how many. Testing aid.
    #[doc(hidden)]
    pub fn disconnect_client(&self, client_id: &str, reason: &str) -> usize {
        let mut n = 0;
        for c in self.shared.live_clients() {
            if c.identity() == client_id {
                c.disconnect(reason.to_string());
                n += 1;
            }
        }
        n
    }

    /// The admin API's connections open now.
    pub fn admin_connections(&self) -> usize {
        self.shared.admin_conns.len()
    }

    /// QUIC connections open on the broker's endpoint now (clients and cluster peers).
    pub fn open_connections(&self) -> usize {
        self.shared.endpoint.open_connections()
    }

    /// The cluster mesh, when `cluster.enabled`.
    pub fn mesh(&self) -> Option<&crate::mesh::MeshHandle> {
        self.shared.mesh.as_ref()
    }

    /// Replace the set of peer addresses (what DNS discovery does; tests use it directly).
    pub fn set_cluster_peers(&self, addrs: Vec<SocketAddr>) {
        if let Some(m) = &self.shared.mesh {
            m.send(crate::mesh::Event::Peers(addrs));
        }
    }
}

/// Close `conn` if the lists in force revoke its client certificate (a reload of
/// `tls.crl_file`, or a handshake checked against the lists before it). Returns whether it did.
pub(crate) fn close_if_revoked(shared: &Shared, conn: &ConnState) -> bool {
    let (Some(verifier), Some(chain)) = (&shared.client_certs, peer_chain(conn)) else {
        return false;
    };
    if !verifier.is_revoked(&chain) {
        return false;
    }
    warn!(client = %conn.describe(), "closing the connection: its client certificate is revoked (tls.crl_file)");
    shared
        .stats
        .connections_revoked
        .fetch_add(1, Ordering::Relaxed);
    conn.disconnect_with(
        ErrorCode::NOT_AUTHORIZED,
        "client certificate revoked".into(),
    );
    true
}

/// The client certificate chain of a connection, end entity first, if it presented one.
fn peer_chain(conn: &ConnState) -> Option<Vec<rustls_pki_types::CertificateDer<'static>>> {
    crate::tls::peer_certificates(conn.conn.get()?)
}

/// Close a new connection whose client certificate has expired: a resumed TLS session (its
/// ticket lives a day) is not verified again, so without this an expired certificate would
/// go on being served by resuming. (A full handshake refuses it already.) True if closed.
pub(crate) fn close_if_expired(shared: &Shared, conn: &ConnState) -> bool {
    if shared.client_certs.is_none() {
        return false;
    }
    let expired = peer_chain(conn)
        .and_then(|chain| chain.first().and_then(crate::tls::validity))
        .is_some_and(|(_, until)| until < unix_now());
    if expired {
        warn!(client = %conn.describe(), "closing the connection: its client certificate has expired (a resumed TLS session)");
        conn.disconnect_with(
            ErrorCode::NOT_AUTHORIZED,
            "client certificate expired".into(),
        );
    }
    expired
}

/// Seconds since the Unix epoch, now.
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Closes the durable log when dropped while it holds it: a start that failed after the log was
/// opened.
struct CloseLogOnError(Option<Arc<Durable>>);

impl Drop for CloseLogOnError {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            d.close();
        }
    }
}

/// Open (and recover) the durable log off the async workers, say what recovery found, and start
/// its writer.
async fn open_log(aal: &AalConfig, stats: Arc<ServerStats>) -> Result<Arc<Durable>, ServerError> {
    let dir = aal.dir.clone();
    let opts = aal.log_options(crate::durable::CRASH_OFFSET_GAP);
    let fsync = aal.fsync;
    let (log, rec) = tokio::task::spawn_blocking(move || Log::open(dir, opts))
        .await
        .map_err(|e| ServerError::Startup(format!("the log recovery task failed: {e}")))??;
    info!(
        dir = %aal.dir.display(),
        encrypted = aal.key.is_some(),
        fsync = %format!("{:?}", aal.fsync).to_lowercase(),
        clean = rec.clean,
        segments = rec.segments,
        topics = rec.topics,
        bytes = rec.bytes,
        rebuilt_indexes = rec.rebuilt_indexes,
        truncated_bytes = rec.truncated_bytes,
        removed_empty_segments = rec.removed_empty_segments,
        took = ?rec.elapsed,
        "durable log opened"
    );
    // Where each topic's offsets go on (the first few at info, all at debug).
    const SHOWN: usize = 10;
    let mut topics: Vec<&[u8]> = log.topics().collect();
    topics.sort_unstable();
    for (i, t) in topics.iter().enumerate() {
        let topic = String::from_utf8_lossy(t);
        let next_offset = log.next_offset(t);
        let last_offset = log.last_offset(t);
        if i < SHOWN {
            info!(%topic, ?last_offset, next_offset, "durable log: topic recovered");
        } else {
            debug!(%topic, ?last_offset, next_offset, "durable log: topic recovered");
        }
    }
    if topics.len() > SHOWN {
        info!(
            "durable log: {} more topics recovered (AQUEDUCT_LOG=debug lists them)",
            topics.len() - SHOWN
        );
    }
    if !rec.clean {
        warn!(
            "durable log: the previous run did not close it (crash or kill); offsets go on past \
             what it may have handed out unwritten"
        );
    }
    if rec.damaged_batches > 0 {
        warn!(
            damaged_batches = rec.damaged_batches,
            degraded_topics = ?rec.degraded_topics,
            "durable log: damaged batches are skipped by readers and kept on disk; run `aqueduct log verify`"
        );
    }
    for (path, why) in &rec.unreadable_segments {
        warn!(path = %path.display(), "durable log: the newest segment held only an unreadable header (a crash while it was created); moved aside: {why}");
    }
    log_previous_keys(&rec.previous_key_segments);
    Durable::start(log, &rec, fsync, stats).map_err(|e| {
        ServerError::Startup(format!("cannot start the durable log's writer thread: {e}"))
    })
}

/// Say, per key of `aal.previous_keys`, how many segments are still sealed with it: one with
/// none is no longer needed.
fn log_previous_keys(segments_per_key: &[usize]) {
    for (i, &segments) in segments_per_key.iter().enumerate() {
        let which = format!("key {} of {}", i + 1, segments_per_key.len());
        if segments == 0 {
            info!("durable log: aal.previous_keys {which} seals no segment any more: it can be removed");
        } else {
            info!("durable log: aal.previous_keys {which} still seals {segments} segment(s); keep it until retention deletes them, or re-seal them with `aqueduct log rekey` (broker stopped)");
        }
    }
}

/// Redeliver deliveries whose ack-wait deadline passed.
async fn ack_ticker(
    broker: Arc<Broker>,
    durable: Option<Arc<Durable>>,
    block_timeout: Option<Duration>,
    mut stop: watch::Receiver<bool>,
) {
    let mut ctx = PublishContext::default();
    let mut tick = tokio::time::interval(ACK_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // Dead letters of messages that ran out of retries go to the log in order. They
                // are not held back by the log's bound (there is no source to stop reading):
                // at most the subscriptions' unsettled messages (max_in_flight each).
                let _ = match &durable {
                    Some(d) => d.with_order(&mut ctx, |ctx| broker.tick(ctx, Instant::now())),
                    None => broker.tick(&mut ctx, Instant::now()),
                };
                // The timer holds no source it could stop reading: block-policy subscriptions
                // its dead letters filled are watched, as are those that redeliveries and
                // departing group members' messages filled (`Broker::watch_full`). One that
                // stays full past block_timeout is closed as a slow consumer here, as a held
                // publisher would close it: its queue would otherwise grow without bound for
                // as long as such messages kept coming.
                let now = Instant::now();
                broker.watch_full(&mut ctx, now);
                for sub in broker.overdue_full(now, block_timeout) {
                    let closed = match &durable {
                        Some(d) => d.with_order(&mut ctx, |ctx| broker.disconnect_slow(ctx, &sub, now)),
                        None => broker.disconnect_slow(&mut ctx, &sub, now),
                    };
                    if closed {
                        warn!(
                            filter = %sub.filter(),
                            "a block-policy subscription stayed full for {:?} of messages no publisher could be held back for (redeliveries, dead letters of the ack-wait timer, a departing group member's messages): closed it as a slow consumer",
                            block_timeout.unwrap_or_default()
                        );
                    }
                }
                // What closing them handed on (a group member's queue) is watched too.
                broker.watch_full(&mut ctx, now);
            }
            _ = stop.changed() => return,
        }
    }
}

/// Bind and serve until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
    Server::bind(config).await?.serve(shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Datagrams: none taken from native clients (quinn's default held up to 1.25 MB of a
    /// connection's unread ones); with WebTransport, offered (HTTP/3 must) into a small buffer.
    /// quinn keeps the settings private: its Debug output is the only view of them.
    #[test]
    fn datagrams_are_refused_natively_and_buffered_little_for_browsers() {
        let t = Config::default().transport;
        let native = format!("{:?}", transport_config(&t, false).expect("config"));
        assert!(
            native.contains("datagram_receive_buffer_size: None"),
            "{native}"
        );
        let browsers = format!("{:?}", transport_config(&t, true).expect("config"));
        assert!(
            browsers.contains("datagram_receive_buffer_size: Some(16384)"),
            "{browsers}"
        );
    }

    /// `":4242"` on a host without IPv6: IPv4 instead; a port in use is not a missing IPv6;
    /// and where IPv4 fails too, its error is the one told.
    #[test]
    fn an_unspecified_ipv6_bind_falls_back_to_ipv4_only_for_a_missing_ipv6() {
        use std::cell::RefCell;
        use std::io::{Error, ErrorKind};
        const EAFNOSUPPORT: i32 = 97;
        let any: SocketAddr = "[::]:4242".parse().expect("addr");
        let tried = RefCell::new(Vec::new());
        let no_ipv6 = |a: SocketAddr| {
            tried.borrow_mut().push(a);
            match a.is_ipv6() {
                true => Err(Error::from_raw_os_error(EAFNOSUPPORT)),
                false => Ok(a),
            }
        };
        assert_eq!(
            bind_with_ipv4_fallback(any, no_ipv6)
                .expect("IPv4")
                .to_string(),
            "0.0.0.0:4242"
        );
        assert_eq!(tried.borrow().len(), 2);
        tried.borrow_mut().clear();
        let in_use = |a: SocketAddr| -> std::io::Result<SocketAddr> {
            tried.borrow_mut().push(a);
            Err(Error::from(ErrorKind::AddrInUse))
        };
        let e = bind_with_ipv4_fallback(any, in_use).expect_err("taken");
        assert_eq!(e.kind(), ErrorKind::AddrInUse);
        assert_eq!(*tried.borrow(), vec![any], "no IPv4 try for a port in use");
        let v4_taken = |a: SocketAddr| -> std::io::Result<SocketAddr> {
            match a.is_ipv6() {
                true => Err(Error::from_raw_os_error(EAFNOSUPPORT)),
                false => Err(Error::from(ErrorKind::AddrInUse)),
            }
        };
        let e = bind_with_ipv4_fallback(any, v4_taken).expect_err("taken");
        assert_eq!(
            e.kind(),
            ErrorKind::AddrInUse,
            "the IPv4 error, not 'no IPv6'"
        );
        // An explicit address is bound as given, never replaced.
        let lo: SocketAddr = "[::1]:4242".parse().expect("addr");
        let refused = |_: SocketAddr| -> std::io::Result<SocketAddr> {
            Err(Error::from_raw_os_error(EAFNOSUPPORT))
        };
        assert!(bind_with_ipv4_fallback(lo, refused).is_err());
    }
}
