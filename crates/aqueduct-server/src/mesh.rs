//! The cluster mesh on the network: one task carries out what `aqueduct_core::mesh::Mesh`
//! decides — dialing peers over the broker's own QUIC endpoint (ALPN `aqueduct-mesh`), taking
//! the mesh connections the endpoint accepted, exchanging interest on one unidirectional control
//! stream each way — and publishes the routing snapshot ([`RouteTable`]) behind an atomic
//! pointer after every change, for the publish path to read without a lock.
//!
//! Every connection's task lives in the driver's `JoinSet`, so none outlives the driver, and the
//! driver stops with the server. Not built yet: forwarding messages over the mesh (see
//! docs/architecture.md, "The cluster").

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_core::mesh::{
    ConnId, Control, Interest, Key, Mesh, MeshConfig, NodeId, Output, RouteTable,
};
use aqueduct_core::mesh_codec::{decode_control, encode_control, MeshCodecError};
use arc_swap::ArcSwap;
use bytes::{Buf, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::mesh_tls::{MeshTls, MESH_NAME};

/// A dial that takes longer fails (and is retried after the backoff).
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Control streams each mesh connection may open (one is used).
pub(crate) const MESH_UNI_STREAMS: u32 = 4;

/// What the driver is told.
#[derive(Debug)]
pub enum Event {
    /// A mesh connection the endpoint accepted (handshake done, peer verified).
    Accepted {
        conn: quinn::Connection,
        node: NodeId,
    },
    /// A dial ended.
    Dialed {
        addr: SocketAddr,
        result: Result<(quinn::Connection, NodeId), String>,
    },
    Control {
        conn: ConnId,
        control: Control,
    },
    /// The connection's control stream broke the protocol.
    Broken {
        conn: ConnId,
        why: String,
    },
    Closed {
        conn: ConnId,
    },
    /// A local subscription came (+1) or went (-1).
    Local {
        key: Key,
        delta: i64,
    },
    /// The addresses to be connected to.
    Peers(Vec<SocketAddr>),
}

/// How the rest of the server reaches the mesh.
#[derive(Debug, Clone)]
pub struct MeshHandle {
    tx: mpsc::UnboundedSender<Event>,
    table: Arc<ArcSwap<RouteTable>>,
    node: NodeId,
}

impl MeshHandle {
    pub fn send(&self, event: Event) {
        // The driver is gone only at shutdown.
        let _ = self.tx.send(event);
    }

    /// This node's id.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<RouteTable> {
        self.table.load_full()
    }

    /// Each connected peer and what it wants, as the latest snapshot has it.
    pub fn view(&self) -> Vec<(NodeId, Interest)> {
        let table = self.table();
        table
            .nodes()
            .iter()
            .filter(|(n, _)| *n != self.node)
            .cloned()
            .collect()
    }
}

/// The driver, before it runs.
#[derive(Debug)]
pub struct Driver {
    mesh: Mesh,
    rx: mpsc::UnboundedReceiver<Event>,
    tx: mpsc::UnboundedSender<Event>,
    table: Arc<ArcSwap<RouteTable>>,
    tls: Arc<MeshTls>,
}

/// Make the driver and its handle.
pub fn new(tls: Arc<MeshTls>) -> (Driver, MeshHandle) {
    let (tx, rx) = mpsc::unbounded_channel();
    let session_base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(1);
    let mut mesh = Mesh::new(
        tls.node.clone(),
        MeshConfig::default(),
        session_base ^ 0x9e37_79b9_7f4a_7c15,
        session_base,
    );
    let table = Arc::new(ArcSwap::from_pointee(mesh.table()));
    let handle = MeshHandle {
        tx: tx.clone(),
        table: table.clone(),
        node: tls.node.clone(),
    };
    (
        Driver {
            mesh,
            rx,
            tx,
            table,
            tls,
        },
        handle,
    )
}

impl Driver {
    /// Run until `stop`; then close every mesh connection.
    pub async fn run(mut self, endpoint: quinn::Endpoint, mut stop: watch::Receiver<bool>) {
        let mut conns: HashMap<ConnId, (quinn::Connection, mpsc::UnboundedSender<Vec<u8>>)> =
            HashMap::new();
        let mut tasks = JoinSet::new();
        let mut next_conn = 1u64;
        info!(node = %self.mesh.me(), "cluster mesh started");
        loop {
            let timeout = self.mesh.poll_timeout();
            let event = tokio::select! {
                e = self.rx.recv() => match e { Some(e) => Some(e), None => break },
                _ = async {
                    match timeout {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.mesh.handle_timeout(Instant::now());
                    None
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => None,
                _ = stop.wait_for(|s| *s) => break,
            };
            let now = Instant::now();
            let mut adopt =
                |conn: quinn::Connection, conns: &mut HashMap<_, _>, tasks: &mut JoinSet<()>| {
                    let id = ConnId(next_conn);
                    next_conn += 1;
                    let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
                    conns.insert(id, (conn.clone(), ctl_tx));
                    tasks.spawn(serve_peer(conn, id, ctl_rx, self.tx.clone()));
                    id
                };
            match event {
                None => {}
                Some(Event::Accepted { conn, node }) => {
                    let id = adopt(conn.clone(), &mut conns, &mut tasks);
                    if !self.mesh.handle_connected(now, id, node, None, false) {
                        conns.remove(&id);
                    }
                }
                Some(Event::Dialed { addr, result }) => match result {
                    Ok((conn, node)) => {
                        let id = adopt(conn.clone(), &mut conns, &mut tasks);
                        if !self.mesh.handle_connected(now, id, node, Some(addr), true) {
                            conns.remove(&id);
                        }
                    }
                    Err(why) => {
                        debug!(%addr, "mesh dial failed: {why}");
                        self.mesh.handle_dial_failed(now, addr);
                    }
                },
                Some(Event::Control { conn, control }) => {
                    self.mesh.handle_control(conn, control);
                }
                Some(Event::Broken { conn, why }) => {
                    warn!(conn = conn.0, "mesh control stream broken: {why}");
                    if let Some((c, _)) = conns.remove(&conn) {
                        c.close(0u32.into(), b"mesh protocol error");
                    }
                    self.mesh.handle_disconnected(now, conn);
                }
                Some(Event::Closed { conn }) => {
                    conns.remove(&conn);
                    self.mesh.handle_disconnected(now, conn);
                }
                Some(Event::Local { key, delta }) => self.mesh.handle_local(key, delta),
                Some(Event::Peers(addrs)) => self.mesh.handle_peer_set(now, addrs),
            }
            while let Some(out) = self.mesh.poll_output() {
                match out {
                    Output::Dial(addr) => {
                        let (endpoint, tls, tx) =
                            (endpoint.clone(), self.tls.clone(), self.tx.clone());
                        tasks.spawn(async move {
                            let result = dial(&endpoint, &tls, addr).await;
                            let _ = tx.send(Event::Dialed { addr, result });
                        });
                    }
                    Output::Close { conn, reason } => {
                        if let Some((c, _)) = conns.remove(&conn) {
                            debug!(conn = conn.0, reason, "closing a mesh connection");
                            c.close(0u32.into(), reason.as_bytes());
                        }
                    }
                    Output::Send { conn, control } => {
                        if let Some((_, ctl)) = conns.get(&conn) {
                            let mut bytes = Vec::new();
                            encode_control(&control, &mut bytes);
                            let _ = ctl.send(bytes);
                        }
                    }
                }
            }
            self.table.store(Arc::new(self.mesh.table()));
        }
        for (c, _) in conns.values() {
            c.close(0u32.into(), b"broker shutting down");
        }
        tasks.shutdown().await;
        info!("cluster mesh stopped");
    }
}

/// Dial `addr` as a mesh peer: the peer certificate must name `aqueduct-mesh` and chain to the
/// cluster CA; its CN is the peer's node id.
async fn dial(
    endpoint: &quinn::Endpoint,
    tls: &MeshTls,
    addr: SocketAddr,
) -> Result<(quinn::Connection, NodeId), String> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from((*tls.client_config()).clone())
        .map_err(|e| e.to_string())?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport.max_concurrent_uni_streams(MESH_UNI_STREAMS.into());
    transport.keep_alive_interval(Some(Duration::from_secs(5)));
    config.transport_config(Arc::new(transport));
    let connecting = endpoint
        .connect_with(config, addr, MESH_NAME)
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(DIAL_TIMEOUT, connecting)
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let node = tls.peer_of(&conn)?;
    Ok((conn, node))
}

/// One mesh connection: write this node's control messages on a unidirectional stream of its
/// own, read the peer's from the first one it opens, until either side ends.
async fn serve_peer(
    conn: quinn::Connection,
    id: ConnId,
    mut ctl: mpsc::UnboundedReceiver<Vec<u8>>,
    events: mpsc::UnboundedSender<Event>,
) {
    /// How the connection's streams ended.
    enum End {
        /// Closed, reset or gone: the connection is over.
        Gone,
        /// The peer broke the control protocol.
        Broken(String),
    }
    let writer = async {
        let Ok(mut send) = conn.open_uni().await else {
            return End::Gone;
        };
        while let Some(bytes) = ctl.recv().await {
            if send.write_all(&bytes).await.is_err() {
                return End::Gone;
            }
        }
        End::Gone
    };
    let reader = async {
        let Ok(mut recv) = conn.accept_uni().await else {
            return End::Gone;
        };
        let mut buf = BytesMut::with_capacity(4096);
        loop {
            let Ok(n) = recv.read_buf(&mut buf).await else {
                return End::Gone;
            };
            loop {
                match decode_control(&buf) {
                    Ok((control, used)) => {
                        buf.advance(used);
                        let _ = events.send(Event::Control { conn: id, control });
                    }
                    Err(MeshCodecError::Incomplete { .. }) => break,
                    Err(e) => return End::Broken(e.to_string()),
                }
            }
            if n == 0 {
                return if buf.has_remaining() {
                    End::Broken("the control stream ended inside a message".into())
                } else {
                    End::Gone
                };
            }
        }
    };
    let end = tokio::select! {
        e = writer => e,
        e = reader => e,
        _ = conn.closed() => End::Gone,
    };
    let _ = events.send(match end {
        End::Gone => Event::Closed { conn: id },
        End::Broken(why) => Event::Broken { conn: id, why },
    });
}
