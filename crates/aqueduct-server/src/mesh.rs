//! The cluster mesh on the network: one task carries out what `aqueduct_core::mesh::Mesh`
//! decides — dialing peers over the broker's own QUIC endpoint (ALPN `aqueduct-mesh`), taking
//! the mesh connections the endpoint accepted, exchanging interest on one unidirectional control
//! stream each way — and publishes the routing snapshot ([`RouteTable`]) behind an atomic
//! pointer after every change, for the publish path to read without a lock.
//!
//! A message published here goes, as one copy per peer with matching plain interest (a PUBLISH
//! with the MeshForwarded bit), into that peer's bounded queue; the peer's connection task
//! writes the queue on a data stream, and the receiving node publishes the copy to its own plain
//! subscribers (and the groups whose member it picked there) only, never forwarding it again
//! (but for a group re-pick). A peer's copies travel in blocks, ZSTD-compressed above
//! `cluster.compression_threshold`. A node's queue of copies belongs to the peer node, written by
//! the connection the mesh keeps; a duplicate connection is retired, not cut. The decisions and
//! guarantees: docs/architecture.md, "The cluster"; the wire format: docs/mesh-protocol.md.
//!
//! Every connection's task lives in the driver's `JoinSet`, so none outlives the driver, and the
//! driver stops with the server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::warn_every::{held_back, WarnEvery};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use aqueduct_core::mesh::{
    ConnId, Control, Interest, Key, Mesh, MeshConfig, NodeId, Output, RouteTable,
};
use aqueduct_core::mesh::{Forward, GroupKey, PROTOCOL_ERROR};
use aqueduct_core::mesh_codec::{
    decode_control, decode_forward, encode_control, encode_forward, MeshCodecError,
};
use aqueduct_core::{Broker, Publication, PublishContext};
use aqueduct_proto::frame::{split_frame, Message};
use aqueduct_proto::{Frame, Publish, HEADER_LEN};
use arc_swap::ArcSwap;
use bytes::Bytes;
use bytes::{Buf, BufMut, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::cluster::Compression;
use crate::durable::Durable;
use crate::mesh_tls::{MeshTls, MESH_NAME};

/// Groups named in one record: what the receiver takes (255-byte names: its routing stays well
/// under 64 KiB).
const GROUPS_PER_RECORD: usize = aqueduct_core::mesh_codec::MAX_GROUPS_PER_RECORD;
/// A dial that takes longer fails (and is retried after the backoff).
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer address that keeps failing is warned about again after this long (or at once when
/// the reason changes); the failures in between are logged at debug.
const DIAL_WARN_EVERY: Duration = Duration::from_secs(60);
/// Mesh connections one node may have open to this one at a time, its dials and this node's
/// together, counted until their tasks end: the one in use, one held or replacing it, and
/// duplicates still being retired (for up to `RETIRE_WAIT` each) leave room to spare. A
/// connection beyond is closed at once with [`TOO_MANY_CONNECTIONS`]: each costs a task,
/// buffers and a snapshot of this node's interest. A connection whose peer said it is leaving
/// counts until it ends, which is at most [`LEFT_OPEN_WAIT`] later.
pub(crate) const MAX_CONNECTIONS_PER_PEER: usize = 8;
/// The close reason of a connection beyond [`MAX_CONNECTIONS_PER_PEER`].
const TOO_MANY_CONNECTIONS: &str = "too many mesh connections from this node";
/// Mesh connections: keep-alive, and how long silence means the peer is gone.
const MESH_KEEP_ALIVE: Duration = Duration::from_secs(2);
const MESH_IDLE: Duration = Duration::from_secs(8);
/// Bytes of one connection's control messages the driver may have waiting (twice the largest
/// message).
const CONTROL_BYTES_WAITING: usize = 2 * aqueduct_core::mesh_codec::MAX_CONTROL;
/// Unidirectional streams each mesh connection may open (two are used: control and data).
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
        /// The message's bytes of its connection's [`CONTROL_BYTES_WAITING`], given back when
        /// the driver has handled it.
        held: tokio::sync::OwnedSemaphorePermit,
    },
    /// The connection's control stream broke the protocol.
    Broken {
        conn: ConnId,
        why: String,
    },
    Closed {
        conn: ConnId,
    },
    /// The peer closed the connection because this node's interest is beyond its
    /// `cluster.max_peer_interest`, or for a protocol error (sent just before the connection's
    /// `Closed`).
    RefusedByPeer {
        conn: ConnId,
        why: PeerRefusal,
    },
    /// The peer finished its data stream on a connection this node has not retired (and
    /// everything it wrote there is published here): it retired the connection, or it is
    /// leaving. The driver retires the connection if it holds it; a kept one is left as it is.
    PeerRetired {
        conn: ConnId,
    },
    /// A local subscription came (+1) or went (-1).
    Local {
        key: Key,
        delta: i64,
    },
    /// The addresses to be connected to.
    Peers(Vec<SocketAddr>),
    /// The peer certificates' revocation lists were replaced: close the connections of peers
    /// they revoke, and say how many.
    CheckRevoked {
        closed: tokio::sync::oneshot::Sender<usize>,
    },
}

/// A copy waiting in a peer's queue. A copy with a TTL remembers when it was queued and where
/// its TTL value sits in the record, so that the time it waited here is taken off when it is
/// written (and a copy whose TTL ran out while it waited is dropped, counted, not sent).
#[derive(Debug)]
struct Queued {
    record: Bytes,
    ttl: Option<QueuedTtl>,
}

#[derive(Debug, Clone, Copy)]
struct QueuedTtl {
    /// Offset of the TTL extension's u32 value in the record.
    at: usize,
    ms: u32,
    queued: Instant,
}

/// The copies waiting for one peer node, bounded in count and bytes (when full, the oldest are
/// dropped, counted, so a slow peer never holds up local delivery, and it is not disconnected
/// for being slow), and what went each way. One per node, kept while the node has a connection:
/// when the connection in use is replaced by another (both ends dialed), the copies waiting stay
/// and go out on the new one. Only the connection the mesh keeps (`owner`) takes from it, and
/// only once the connection that wrote before it has let go (`writer`): a retired connection
/// lets go when the peer has published its data stream to the end (the peer's control-stream
/// FIN says so), a lost one when it is gone.
/// The receiving side keeps the order too: a connection's copies are published only once the
/// connection that carried copies before it has published all of its own (`reader`), so copies
/// written on two connections around a switch are delivered in the order they were queued. The
/// lock is held only to push or to take what is queued.
#[derive(Debug)]
pub struct PeerQueue {
    /// The copies, their bytes, and whether the driver discarded the queue (its peer is gone).
    queue: Mutex<(VecDeque<Queued>, usize, bool)>,
    notify: Notify,
    capacity: usize,
    /// Copies queued, dropped (queue full), and bytes written to the peer.
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
    pub bytes: AtomicU64,
    /// Bytes of records before compression (`bytes` after): their ratio is the compression's.
    pub raw_bytes: AtomicU64,
    /// Copies whose TTL ran out while they waited in the queue (not sent).
    pub expired: AtomicU64,
    /// Copies received from the peer, and the bytes of the blocks they came in.
    pub received: AtomicU64,
    pub received_bytes: AtomicU64,
    /// Times the peer came back after being disconnected (set by the driver).
    pub reconnects: AtomicU64,
    /// The connection that writes the copies (set by the driver; 0: none yet).
    owner: AtomicU64,
    /// The connection that has written copies and whose writes the peer may not have read yet
    /// (0: none). The owner takes over only from 0.
    writer: AtomicU64,
    /// The connection whose copies from the peer are being published here (0: none): another
    /// connection's wait until it has published its last (see [`wait_turn_to_read`]).
    ///
    /// [`wait_turn_to_read`]: Self::wait_turn_to_read
    reader: AtomicU64,
    /// Wakes the connections waiting for their turn to read.
    reader_done: Notify,
    /// Copies received but neither published nor logged because this node's durable log was
    /// failing or closed (a client's publish would be refused then too).
    pub not_stored: AtomicU64,
}

/// Empty `slot` if `conn` holds it, and wake those waiting for it (a late release by a
/// connection whose turn was taken over changes nothing).
fn release(slot: &AtomicU64, conn: ConnId, waiting: &Notify) {
    if slot
        .compare_exchange(conn.0, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        waiting.notify_waiters();
    }
}

/// Bytes a peer's queue may hold.
const PEER_QUEUE_BYTES: usize = 64 << 20;

impl PeerQueue {
    fn new(capacity: usize) -> PeerQueue {
        PeerQueue {
            queue: Mutex::new((VecDeque::new(), 0, false)),
            notify: Notify::new(),
            capacity: capacity.max(1),
            forwarded: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            raw_bytes: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            received: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            owner: AtomicU64::new(0),
            writer: AtomicU64::new(0),
            reader: AtomicU64::new(0),
            reader_done: Notify::new(),
            not_stored: AtomicU64::new(0),
        }
    }

    /// Queue `record`; `ttl`: where its TTL value is and what it says (`None`: no TTL).
    /// False (nothing queued) if the queue was discarded: its peer is gone.
    #[must_use]
    fn push(&self, record: Bytes, ttl: Option<(usize, u32)>) -> bool {
        let ttl = ttl.map(|(at, ms)| QueuedTtl {
            at,
            ms,
            queued: Instant::now(),
        });
        {
            let mut guard = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            let (q, bytes, discarded) = &mut *guard;
            if *discarded {
                return false;
            }
            while !q.is_empty()
                && (q.len() >= self.capacity || *bytes + record.len() > PEER_QUEUE_BYTES)
            {
                if let Some(old) = q.pop_front() {
                    *bytes -= old.record.len();
                }
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            *bytes += record.len();
            q.push_back(Queued { record, ttl });
        }
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        // Every connection's writer waits on it; the owner takes.
        self.notify.notify_waiters();
        true
    }

    /// Queue `records` (each with its TTL's place and value), in order: one lock and one wake
    /// for all of them. False (nothing queued) if the queue was discarded.
    #[must_use]
    fn push_many(&self, records: &[(Bytes, Option<(usize, u32)>)]) -> bool {
        if records.is_empty() {
            return true;
        }
        let queued = Instant::now();
        {
            let mut guard = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            let (q, bytes, discarded) = &mut *guard;
            if *discarded {
                return false;
            }
            for (record, ttl) in records {
                while !q.is_empty()
                    && (q.len() >= self.capacity || *bytes + record.len() > PEER_QUEUE_BYTES)
                {
                    if let Some(old) = q.pop_front() {
                        *bytes -= old.record.len();
                    }
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
                *bytes += record.len();
                q.push_back(Queued {
                    record: record.clone(),
                    ttl: ttl.map(|(at, ms)| QueuedTtl { at, ms, queued }),
                });
            }
        }
        self.forwarded
            .fetch_add(records.len() as u64, Ordering::Relaxed);
        self.notify.notify_waiters();
        true
    }

    /// The driver lets go of this queue (its peer is gone): what it holds is dropped, and so is
    /// anything a publisher still holding the old queue map pushes after this (`push` says so,
    /// and the caller counts it). Returns how many were dropped here.
    fn discard(&self) -> usize {
        let mut guard = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let (q, bytes, discarded) = &mut *guard;
        *discarded = true;
        *bytes = 0;
        let n = q.len();
        q.clear();
        n
    }

    /// Make `conn` the connection that writes the copies (and wake the writers to see it).
    fn set_owner(&self, conn: ConnId) {
        if self.owner.swap(conn.0, Ordering::SeqCst) != conn.0 {
            self.notify.notify_waiters();
        }
    }

    fn owned_by(&self, conn: ConnId) -> bool {
        self.owner.load(Ordering::Acquire) == conn.0
    }

    /// May `conn` take copies now: it is the owner, and no other connection's writes are still
    /// unread by the peer (it becomes the writer until it lets go, see [`let_go`]).
    ///
    /// [`let_go`]: Self::let_go
    fn may_write(&self, conn: ConnId) -> bool {
        self.owned_by(conn)
            && match self
                .writer
                .compare_exchange(0, conn.0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => true,
                Err(w) => w == conn.0,
            }
    }

    /// `conn` writes no more, and what it wrote has been read or is lost with its connection:
    /// the owner may write (woken to see it).
    fn let_go(&self, conn: ConnId) {
        release(&self.writer, conn, &self.notify);
    }

    /// The owner waited longer than a retired connection may take: take over (what the other
    /// wrote is read by now or lost with it).
    fn take_over(&self, conn: ConnId) {
        if self.owned_by(conn) {
            self.writer.store(conn.0, Ordering::SeqCst);
            // Made owner another connection meanwhile: that one may write, not this one.
            if self.owner.load(Ordering::SeqCst) != conn.0 {
                self.let_go(conn);
            }
        }
    }

    /// Wait until `conn` may publish the copies it received: no other connection of this peer
    /// is still publishing those it carried before. (A retired connection's peer writes on the
    /// kept one only once everything is published here, but one the peer gave up as lost may
    /// still be publishing what it had received.) Bounded by `patience`: then `conn` reads
    /// anyway (the other is stuck; the order may break), and says so. A connection retired
    /// meanwhile (`retired`) does not wait: it has only a few seconds left to publish what it
    /// carries, and the connection it would wait for is the one kept, or a dead one.
    async fn wait_turn_to_read(
        &self,
        conn: ConnId,
        patience: Duration,
        retired: &mut watch::Receiver<bool>,
    ) {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let done = self.reader_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            match self
                .reader
                .compare_exchange(0, conn.0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(r) if r == conn.0 => return,
                Err(_) => {}
            }
            if *retired.borrow() {
                return;
            }
            tokio::select! {
                _ = done => {}
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(conn = conn.0, "the mesh connection replaced is still publishing its peer's copies after {patience:?}: publishing this one's too, copies may be delivered out of order");
                    self.reader.store(conn.0, Ordering::Release);
                    return;
                }
                // Retired: read on (see above). Its driver gone: the connection ends anyway.
                r = retired.changed() => if r.is_err() { return; },
            }
        }
    }

    /// `conn` publishes no more of the peer's copies: the next connection may.
    fn done_reading(&self, conn: ConnId) {
        release(&self.reader, conn, &self.reader_done);
    }

    /// Copies waiting now.
    fn depth(&self) -> usize {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }

    /// Move what is queued into `out`, up to about `budget` bytes, each TTL reduced by the time
    /// its copy waited (at least 1 ms left; a copy with none left is dropped and counted).
    fn take(&self, out: &mut BytesMut, budget: usize, now: Instant) {
        let mut guard = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let (q, bytes, _) = &mut *guard;
        while let Some(f) = q.front() {
            if !out.is_empty() && out.len() + f.record.len() > budget {
                break;
            }
            let Some(f) = q.pop_front() else { break };
            *bytes -= f.record.len();
            let start = out.len();
            match f.ttl {
                None => out.extend_from_slice(&f.record),
                Some(t) => {
                    let waited = now.saturating_duration_since(t.queued).as_millis();
                    let left = u128::from(t.ms).saturating_sub(waited);
                    if left == 0 {
                        self.expired.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    out.extend_from_slice(&f.record);
                    let value = start + t.at;
                    if let Some(slot) = out.get_mut(value..value + 4) {
                        slot.copy_from_slice(&(left as u32).to_le_bytes());
                    }
                }
            }
        }
    }
}

/// Where the TTL extension's u32 value is in an encoded frame with extensions, if it has one.
fn ttl_value_at(frame: &[u8]) -> Option<usize> {
    if frame.get(1)? & aqueduct_proto::header::FLAG_HAS_EXTENSIONS == 0 {
        return None;
    }
    let ext_len = usize::from(u16::from_le_bytes([
        *frame.get(HEADER_LEN)?,
        *frame.get(HEADER_LEN + 1)?,
    ]));
    let end = HEADER_LEN + 2 + ext_len;
    let mut at = HEADER_LEN + 2;
    while at + 2 <= end {
        let (kind, len) = (*frame.get(at)?, usize::from(*frame.get(at + 1)?));
        if kind == aqueduct_proto::ext::types::TTL && len == 4 {
            return (at + 6 <= frame.len()).then_some(at + 2);
        }
        at += 2 + len;
    }
    None
}

/// The PUBLISH a peer receives for a message published here (encoded with the MeshForwarded
/// bit, so that the peer never forwards it again): the message's priority, TTL, trace and
/// compression extensions and its body; a dead letter also with ORIGINAL_TOPIC,
/// ORIGINAL_OFFSET, ATTEMPTS_MADE and REASON; a handed-over group message with ATTEMPT.
fn forwarded_message(p: &Publication<'_>) -> Message {
    let topic = p.topic.to_name();
    let mut publish = Publish::new(topic, Bytes::copy_from_slice(p.body)).with_priority(p.priority);
    if let Some(ttl) = p.ttl {
        publish = publish.with_ttl_ms(u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX));
    }
    publish.ext.trace = p.trace.copied();
    publish.ext.compression = p.compression.copied();
    if p.attempts() > 0 {
        // A group message handed over with the attempts made so far.
        publish.ext.attempt = Some(p.attempts());
    }
    if let Some(dl) = p.dead_letter() {
        publish.ext.original_topic = Some(dl.original_topic.clone());
        publish.ext.original_offset = Some(dl.original_offset);
        publish.ext.attempts_made = Some(dl.attempts_made);
        publish.ext.reason = Some(dl.reason.to_string());
    }
    Message::Publish(publish)
}

/// [`forwarded_message`] encoded as a frame (with the MeshForwarded bit), written straight from
/// the borrowed publication into `out`: the same bytes, without the owned `Publish` (a copy of
/// the topic and the body). Dead letters and handed-over messages, rare, go the long way.
fn encode_forwarded(p: &Publication<'_>, out: &mut BytesMut) {
    use aqueduct_proto::ext::types;
    use aqueduct_proto::header::{FLAG_HAS_EXTENSIONS, FLAG_MESH_FORWARDED};
    if p.attempts() > 0 || p.dead_letter().is_some() {
        forwarded_message(p).encode_frame(out, 0, true);
        return;
    }
    let topic = p.topic.as_bytes();
    let ttl = p
        .ttl
        .map(|t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX));
    let ext_len = p.trace.map_or(0, |_| 27)
        + p.compression.map_or(0, |_| 7)
        + 3
        + 2
        + topic.len()
        + ttl.map_or(0, |_| 6);
    let data_len = 2 + ext_len + p.body.len();
    out.reserve(HEADER_LEN + data_len);
    out.put_u8(aqueduct_proto::MAGIC);
    out.put_u8(aqueduct_proto::Opcode::Publish as u8 | FLAG_HAS_EXTENSIONS | FLAG_MESH_FORWARDED);
    out.put_u32_le(0);
    out.put_u32_le(data_len as u32);
    out.put_u16_le(ext_len as u16);
    if let Some(t) = p.trace {
        out.put_slice(&[types::TRACE, 25]);
        out.put_slice(&t.trace_id);
        out.put_slice(&t.span_id);
        out.put_u8(t.flags);
    }
    if let Some(c) = p.compression {
        out.put_slice(&[types::COMPRESSION, 5, c.algorithm]);
        out.put_u32_le(c.uncompressed_len);
    }
    // TopicName guarantees 1..=255 bytes.
    out.put_slice(&[
        types::PRIORITY,
        1,
        p.priority.level(),
        types::TOPIC,
        topic.len() as u8,
    ]);
    out.put_slice(topic);
    if let Some(ms) = ttl {
        out.put_slice(&[types::TTL, 4]);
        out.put_u32_le(ms);
    }
    out.put_slice(p.body);
}

/// A copy's TTL: where its u32 value is in `record` (from `skip` on) and what it says.
fn ttl_in(record: &[u8], skip: usize) -> Option<(usize, u32)> {
    let frame = record.get(skip..)?;
    let at = ttl_value_at(frame)?;
    let v = frame.get(at..at + 4)?;
    Some((skip + at, u32::from_le_bytes([v[0], v[1], v[2], v[3]])))
}

/// Are `copies` for the peers' plain subscribers only (then they are all alike)? Which nodes a
/// copy has been to does not count: only a group's re-pick reads it.
fn plain_only(copies: &[(NodeId, Forward)]) -> bool {
    copies.iter().all(|(_, f)| f.plain && f.groups.is_empty())
}

/// The records of copies of `run` for the peers' plain subscribers (the same for every peer):
/// encoded one after the other into one buffer, each with its TTL's place and value (the queue
/// takes off the time a copy waits).
fn plain_records(run: &[Publication<'_>]) -> Vec<(Bytes, Option<(usize, u32)>)> {
    let mut routing = Vec::with_capacity(3);
    encode_forward(&Forward::plain(), &mut routing);
    let skip = 2 + routing.len();
    let size: usize = run
        .iter()
        .map(|p| skip + HEADER_LEN + 48 + p.topic.as_bytes().len() + p.body.len())
        .sum();
    let mut buf = BytesMut::with_capacity(size);
    run.iter()
        .map(|p| {
            buf.put_u16_le(routing.len() as u16);
            buf.put_slice(&routing);
            encode_forwarded(p, &mut buf);
            let record = buf.split().freeze();
            let ttl = ttl_in(&record, skip);
            (record, ttl)
        })
        .collect()
}

/// What was sent to one peer (on its current connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCounters {
    pub node: NodeId,
    /// Copies queued for it.
    pub forwarded: u64,
    /// Copies dropped because its queue was full.
    pub dropped: u64,
    /// Bytes written to it, and the same before compression.
    pub bytes: u64,
    pub raw_bytes: u64,
    /// Copies whose TTL ran out while they waited for it (not sent).
    pub expired: u64,
    /// Copies waiting for it now.
    pub queued: u64,
    /// Copies received from it, and the bytes of the blocks they came in (as sent).
    pub received: u64,
    pub received_bytes: u64,
    /// Times it was connected again after being disconnected.
    pub reconnects: u64,
    /// Copies from it dropped because the durable log here could not take them.
    pub not_stored: u64,
}

/// Each connected peer's queue, by node id: one snapshot of the peer set.
pub type PeerQueues = Arc<HashMap<NodeId, Arc<PeerQueue>>>;

/// How the rest of the server reaches the mesh.
#[derive(Debug, Clone)]
pub struct MeshHandle {
    tx: mpsc::UnboundedSender<Event>,
    table: Arc<ArcSwap<RouteTable>>,
    /// Each connected peer's queue, swapped with the peer set.
    queues: Arc<ArcSwap<HashMap<NodeId, Arc<PeerQueue>>>>,
    node: NodeId,
    /// Data blocks refused from peers (a compression bomb, a malformed block).
    pub refused_blocks: Arc<AtomicU64>,
    /// Group messages handed to a member on another node because none was left here.
    pub handed_over: Arc<AtomicU64>,
    /// Peers that did not confirm, within [`LEAVE_WAIT`] of this node's leaving, that they had
    /// published every copy it sent them (the copies not yet published there may be lost).
    pub leaves_unconfirmed: Arc<AtomicU64>,
    /// Duplicate connections retired (finished and read to the end, then closed).
    pub retired: Arc<AtomicU64>,
    /// Copies still queued for a peer when it went away (its queue is let go of).
    pub discarded: Arc<AtomicU64>,
    /// Group copies received for a group with no member left on any node they had not been to:
    /// dropped.
    pub unplaced: Arc<AtomicU64>,
    /// Connections closed because their peer did not read its control stream
    /// ([`CONTROL_QUEUE`] updates waiting).
    pub control_overflows: Arc<AtomicU64>,
    /// Connections closed because their peer's interest went beyond
    /// `cluster.max_peer_interest` ([`aqueduct_core::mesh::INTEREST_LIMIT`]).
    pub interest_refused: Arc<AtomicU64>,
    /// Connections a peer opened beyond [`MAX_CONNECTIONS_PER_PEER`] at once: closed at once.
    pub connections_refused: Arc<AtomicU64>,
    /// Connections a peer closed because this node's interest is beyond its
    /// `cluster.max_peer_interest`.
    pub refused_by_peer: Arc<AtomicU64>,
    /// Connections this node closed because the peer broke the mesh protocol: its control
    /// stream (an undecodable message), or a leave it did not finish ([`LEFT_OPEN_WAIT`]).
    pub protocol_errors: Arc<AtomicU64>,
    /// The broker, to ask whether a group picked here still has a member here (weak: the
    /// broker's listeners hold this handle).
    broker: std::sync::Weak<Broker>,
    /// The addresses peers' connections come from ([`MeshHandle::is_peer_addr`]).
    peer_addrs: Arc<std::sync::Mutex<PeerAddrs>>,
}

/// Where peers' connections come from (a node dials from its own listening socket): the
/// addresses this node dials (`cluster.peers`, discovery), and those of the peers whose
/// connections it accepted lately (a peer may have this node as a target without this node
/// having it as one).
#[derive(Debug, Default)]
struct PeerAddrs {
    targets: std::collections::HashSet<SocketAddr>,
    /// The latest [`ACCEPTED_ADDRS`], oldest first.
    accepted: std::collections::VecDeque<SocketAddr>,
}

/// How many addresses of peers whose connections were accepted are remembered.
const ACCEPTED_ADDRS: usize = 256;

impl PeerAddrs {
    fn contains(&self, addr: SocketAddr) -> bool {
        self.targets.contains(&addr) || self.accepted.contains(&addr)
    }

    fn accepted(&mut self, addr: SocketAddr) {
        if !self.accepted.contains(&addr) {
            if self.accepted.len() >= ACCEPTED_ADDRS {
                self.accepted.pop_front();
            }
            self.accepted.push_back(addr);
        }
    }
}

impl MeshHandle {
    /// Whether a connection from `addr` is likely a peer's: the address of a peer this node
    /// dials, or of one whose connection it accepted lately. The broker lets such connections
    /// through its handshake when it is at `transport.max_connections`, which counts clients
    /// (a node full of clients refused its peers, and two such nodes stayed apart); whether it
    /// is a peer's is checked once its handshake is done, as for any other.
    pub fn is_peer_addr(&self, addr: SocketAddr) -> bool {
        let addr = crate::connection::canonical(addr);
        self.peer_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(addr)
    }

    fn note_peer_addrs(&self, note: impl FnOnce(&mut PeerAddrs)) {
        note(&mut self.peer_addrs.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn send(&self, event: Event) {
        // The driver is gone only at shutdown.
        let _ = self.tx.send(event);
    }

    /// Close the mesh connections of peers whose certificate the revocation lists now in force
    /// revoke (after a reload of `cluster.tls.crl_file`); how many (0 once the mesh is gone).
    pub async fn close_revoked(&self) -> usize {
        let (closed, count) = tokio::sync::oneshot::channel();
        self.send(Event::CheckRevoked { closed });
        count.await.unwrap_or(0)
    }

    /// This node's id.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<RouteTable> {
        self.table.load_full()
    }

    /// Publish a message on this node: `local` publishes it here (on `ctx`, scoped so that the
    /// consumer groups the mesh picked members of on other nodes for are left out), then a copy
    /// goes to each peer that wants it (its plain subscribers, the groups picked there): one per
    /// peer. Atomic loads and the chosen peers' queue pushes; no other lock.
    pub fn publish<T>(
        &self,
        ctx: &mut PublishContext,
        p: &Publication<'_>,
        local: impl FnOnce(&mut PublishContext) -> T,
    ) -> T {
        let table = self.table.load();
        if table.peers_want_nothing() {
            // No peer connected, or none wants anything: nothing to decide.
            return local(ctx);
        }
        // Groups are picked only here or on a peer with a queue: the table may still name one
        // whose connection just ended, and a group picked there would reach no one while
        // another node's member could take the message.
        let queues = self.queues.load();
        // A group the table still counts a member here for, though the broker no longer
        // routes it (its last member just left), goes elsewhere, not nowhere. Asked only for
        // a group the table counts a member here for (a topic without groups asks nothing).
        let here = |g: &GroupKey| {
            self.broker
                .upgrade()
                .is_none_or(|b| b.has_group(&g.filter, &g.group))
        };
        let routing = table.route_bytes_where(p.topic.as_bytes(), here, |n| queues.contains_key(n));
        let elsewhere: Vec<GroupKey> = routing
            .forward
            .iter()
            .flat_map(|(_, f)| f.groups.iter().cloned())
            .collect();
        let out = if elsewhere.is_empty() {
            local(ctx)
        } else {
            ctx.scope_except(&elsewhere);
            let out = local(ctx);
            ctx.clear_scope();
            out
        };
        // The same map that decided which groups go elsewhere: each of those gets its copy.
        let lost = self.send_copies_to(&queues, p, &routing.forward);
        self.discarded.fetch_add(lost as u64, Ordering::Relaxed);
        out
    }

    /// Publish a publish frame's messages, in order: like [`publish`](Self::publish) for each,
    /// but a run of messages to one topic that no consumer group matches anywhere is routed
    /// once, published here with one `local` call (so the core routes it as a run), and its
    /// copies are encoded into one buffer and queued for each peer with one lock and one wake.
    /// Messages of a topic a group matches go one by one (the round-robin picks per message).
    pub fn publish_batch<'p>(
        &self,
        ctx: &mut PublishContext,
        pubs: &[Publication<'p>],
        mut local: impl FnMut(&mut PublishContext, &[Publication<'p>]),
    ) {
        let table = self.table.load();
        if table.peers_want_nothing() {
            return local(ctx, pubs);
        }
        let queues = self.queues.load();
        let mut i = 0;
        while i < pubs.len() {
            let topic = pubs[i].topic;
            let len = pubs[i..].iter().take_while(|p| p.topic == topic).count();
            let run = &pubs[i..i + len];
            i += len;
            if table.groups_match(topic.as_bytes()) {
                for p in run {
                    self.publish(ctx, p, |ctx| local(ctx, std::slice::from_ref(p)));
                }
                continue;
            }
            local(ctx, run);
            // Encoded once, for the first peer that wants them. A peer whose queue is gone
            // (its connection just ended) has them counted as discarded, as one copy does.
            let mut records = None;
            for node in table.plain_peers(topic.as_bytes()) {
                let queued = queues.get(node).is_some_and(|q| {
                    q.push_many(records.get_or_insert_with(|| plain_records(run)))
                });
                if !queued {
                    self.discarded
                        .fetch_add(run.len() as u64, Ordering::Relaxed);
                }
            }
        }
    }

    /// Queue a copy of `p` for each of `copies`, in the peers' queues as loaded by the caller
    /// (the map that decided where they go). Returns how many copies were not queued: their
    /// peer's queue is gone (its connection just ended) or was discarded since the map was
    /// loaded. The caller counts them (as discarded, or as its own drop).
    fn send_copies_to(
        &self,
        queues: &HashMap<NodeId, Arc<PeerQueue>>,
        p: &Publication<'_>,
        copies: &[(NodeId, Forward)],
    ) -> usize {
        if copies.is_empty() {
            return 0;
        }
        let mut lost = copies
            .iter()
            .filter(|(node, _)| !queues.contains_key(node))
            .count();
        // The common case: copies for the peers' plain subscribers only, all alike. One
        // record, shared by every peer's queue.
        if plain_only(copies) {
            let records = plain_records(std::slice::from_ref(p));
            for (node, _) in copies {
                if let Some(q) = queues.get(node) {
                    lost += usize::from(!q.push_many(&records));
                }
            }
            return lost;
        }
        let mut frame = BytesMut::new();
        encode_forwarded(p, &mut frame);
        let frame = frame.freeze();
        // The TTL's place in the frame and its value: the queue takes off the time it waits.
        let ttl = ttl_in(&frame, 0);
        for (node, f) in copies {
            let Some(q) = queues.get(node) else {
                continue; // counted above
            };
            // Not queued at all (a copy split into several records whose queue was discarded
            // in between had its first records counted by the discard).
            let mut queued = false;
            // At most GROUPS_PER_RECORD groups a record (its routing fits its length field);
            // the first carries the plain part.
            let chunks: Vec<&[GroupKey]> = if f.groups.is_empty() {
                vec![&[]]
            } else {
                f.groups.chunks(GROUPS_PER_RECORD).collect()
            };
            for (i, groups) in chunks.into_iter().enumerate() {
                let part = Forward {
                    plain: f.plain && i == 0,
                    groups: groups.to_vec(),
                    visited: f.visited.clone(),
                };
                let mut routing = Vec::new();
                encode_forward(&part, &mut routing);
                let Ok(len) = u16::try_from(routing.len()) else {
                    continue;
                };
                let mut record = BytesMut::with_capacity(2 + routing.len() + frame.len());
                record.put_u16_le(len);
                record.extend_from_slice(&routing);
                record.extend_from_slice(&frame);
                let ttl = ttl.map(|(at, ms)| (2 + routing.len() + at, ms));
                queued |= q.push(record.freeze(), ttl);
            }
            lost += usize::from(!queued);
        }
        lost
    }

    /// Give a consumer group's message that no member here can take any more (see
    /// [`Broker::set_orphan_listener`]) to the next member round-robin on another node, as a
    /// copy for that group only (what is left of its TTL with it). False if no other connected
    /// node has a member: the broker then drops and counts it.
    ///
    /// The delivery attempts made here go with it (ATTEMPT extension): the receiving node counts
    /// on, so `broker.max_retries` holds across nodes and a poison message ends as a dead letter.
    pub fn hand_over(&self, o: &aqueduct_core::Orphan) -> bool {
        let table = self.table.load();
        let queues = self.queues.load();
        // Only among the peers with a queue: the table may still name one whose connection
        // just ended, and a pick landing there would lose the message while another node's
        // member could take it.
        let Some((node, forward)) = table.repick_elsewhere(&o.group, |n| queues.contains_key(n))
        else {
            return false;
        };
        let mut p = Publication::new(&o.topic, &o.body).with_attempts(o.attempts.saturating_sub(1));
        p.priority = o.priority;
        p.ttl = o.ttl;
        p.trace = o.trace.as_ref();
        p.compression = o.compression.as_ref();
        // Its queue discarded meanwhile (the peer just went): the broker drops and counts it.
        if self.send_copies_to(&queues, &p, &[(node, forward)]) > 0 {
            return false;
        }
        self.handed_over.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Where a copy forwarded to this node goes (see [`RouteTable::route_forwarded_where`]):
    /// groups re-picked only among the peers with a queue, so that a pick never lands on a
    /// peer whose connection just ended while another node's member could take the copy.
    /// Returns the queues it picked among too: the copies go into those (`send_copies_to`).
    pub fn route_forwarded(
        &self,
        forward: &Forward,
        here: impl Fn(&GroupKey) -> bool,
    ) -> (aqueduct_core::mesh::Routing, PeerQueues) {
        let queues = self.queues.load_full();
        let routing = self
            .table
            .load()
            .route_forwarded_where(forward, here, |n| queues.contains_key(n));
        (routing, queues)
    }

    /// No peer wants anything now: a batch can be published as without a cluster.
    pub fn peers_want_nothing(&self) -> bool {
        self.table.load().peers_want_nothing()
    }

    /// Each connected peer's queue counters, by node id.
    pub fn peer_counters(&self) -> Vec<PeerCounters> {
        let queues = self.queues.load();
        let mut v: Vec<_> = queues
            .iter()
            .map(|(n, q)| PeerCounters {
                node: n.clone(),
                forwarded: q.forwarded.load(Ordering::Relaxed),
                dropped: q.dropped.load(Ordering::Relaxed),
                bytes: q.bytes.load(Ordering::Relaxed),
                raw_bytes: q.raw_bytes.load(Ordering::Relaxed),
                expired: q.expired.load(Ordering::Relaxed),
                queued: q.depth() as u64,
                received: q.received.load(Ordering::Relaxed),
                received_bytes: q.received_bytes.load(Ordering::Relaxed),
                reconnects: q.reconnects.load(Ordering::Relaxed),
                not_stored: q.not_stored.load(Ordering::Relaxed),
            })
            .collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
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
    queues: Arc<ArcSwap<HashMap<NodeId, Arc<PeerQueue>>>>,
    tls: Arc<MeshTls>,
    broker: Arc<Broker>,
    queue_size: usize,
    compression: Compression,
    handle: MeshHandle,
    /// The durable log, when on: copies received are logged too.
    durable: Option<Arc<Durable>>,
    /// `block_timeout`: how long a block-policy subscriber may hold a peer's copies.
    block_timeout: Option<Duration>,
    /// The transport of a link this node dials (a link the peer dialled has the broker's
    /// transport config already).
    dial_transport: DialTransport,
}

/// Make the driver and its handle. With a durable log, this node wants every message (it logs
/// what is published anywhere in the cluster, so a durable subscription here reads it all).
pub(crate) fn new(
    tls: Arc<MeshTls>,
    broker: Arc<Broker>,
    durable: Option<Arc<Durable>>,
    cluster: &crate::cluster::ClusterConfig,
    block_timeout: Option<Duration>,
    dial_transport: DialTransport,
) -> (Driver, MeshHandle) {
    let (queue_size, compression) = (cluster.peer_queue_size, cluster.compression);
    let (tx, rx) = mpsc::unbounded_channel();
    let session_base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(1);
    let mut mesh = Mesh::new(
        tls.node.clone(),
        MeshConfig {
            max_peer_interest: cluster.max_peer_interest,
            ..MeshConfig::default()
        },
        session_base ^ 0x9e37_79b9_7f4a_7c15,
        session_base,
    );
    let table = Arc::new(ArcSwap::from_pointee(mesh.table()));
    let queues = Arc::new(ArcSwap::from_pointee(HashMap::new()));
    let handle = MeshHandle {
        tx: tx.clone(),
        table: table.clone(),
        queues: queues.clone(),
        node: tls.node.clone(),
        refused_blocks: Arc::new(AtomicU64::new(0)),
        handed_over: Arc::new(AtomicU64::new(0)),
        leaves_unconfirmed: Arc::new(AtomicU64::new(0)),
        retired: Arc::new(AtomicU64::new(0)),
        discarded: Arc::new(AtomicU64::new(0)),
        unplaced: Arc::new(AtomicU64::new(0)),
        control_overflows: Arc::new(AtomicU64::new(0)),
        interest_refused: Arc::new(AtomicU64::new(0)),
        connections_refused: Arc::new(AtomicU64::new(0)),
        refused_by_peer: Arc::new(AtomicU64::new(0)),
        protocol_errors: Arc::new(AtomicU64::new(0)),
        broker: Arc::downgrade(&broker),
        peer_addrs: Arc::default(),
    };
    let out = (
        Driver {
            mesh,
            rx,
            tx,
            table,
            queues,
            tls,
            broker,
            queue_size,
            compression,
            handle: handle.clone(),
            durable: durable.clone(),
            block_timeout,
            dial_transport,
        },
        handle.clone(),
    );
    if durable.is_some() {
        if let Ok(everything) = aqueduct_proto::TopicFilter::try_from("#") {
            handle.send(Event::Local {
                key: Key::Plain(everything),
                delta: 1,
            });
        }
    }
    out
}

impl Driver {
    /// Run the driver until `stop`, with the static `cluster.peers` (looked up again now and
    /// then) and DNS discovery if configured, which adds what it finds.
    pub async fn run_with_peers(
        self,
        cluster: crate::cluster::ClusterConfig,
        resolver: Arc<dyn crate::discovery::Resolver>,
        endpoint: quinn::Endpoint,
        stop: watch::Receiver<bool>,
    ) {
        let statics = crate::discovery::StaticPeers::new(cluster.peers.clone());
        let handle = self.handle.clone();
        match cluster.discovery {
            Some((host, port, interval)) => {
                let discovery = crate::discovery::run(
                    resolver,
                    host,
                    port,
                    interval,
                    statics,
                    move |addrs| handle.send(Event::Peers(addrs)),
                    stop.clone(),
                );
                tokio::join!(self.run(endpoint, stop), discovery);
            }
            None if statics.is_empty() => self.run(endpoint, stop).await,
            None => {
                let refresh = crate::discovery::run_static(
                    statics,
                    move |addrs| handle.send(Event::Peers(addrs)),
                    stop.clone(),
                );
                tokio::join!(self.run(endpoint, stop), refresh);
            }
        }
    }

    /// Run until `stop`; then close every mesh connection.
    pub async fn run(mut self, endpoint: quinn::Endpoint, mut stop: watch::Receiver<bool>) {
        let mut conns: HashMap<ConnId, Link> = HashMap::new();
        let mut tasks = JoinSet::new();
        let mut next_conn = 1u64;
        // Turns true when this node shuts down: every connection leaves (see `leave`).
        let (leaving_tx, leaving) = watch::channel(false);
        // Per peer ever connected: how often it came back after being disconnected (a
        // duplicate connection replaced while connected is no reconnect), and the run of
        // connections (`Link::run`) it last spoke on.
        let mut reconnects: HashMap<NodeId, Spoken> = HashMap::new();
        // Peer addresses that failed to dial, by the reason warned about.
        let mut dial_warned: WarnEvery<SocketAddr, String> = WarnEvery::new(DIAL_WARN_EVERY);
        let mut refusals_warned = WarnEvery::new(DIAL_WARN_EVERY);
        // Every connection whose task still runs (kept, held, being retired), and its node.
        let mut live: HashMap<ConnId, NodeId> = HashMap::new();
        // This node's port: a dialed address with it and a local IP is this node itself.
        let own_port = endpoint.local_addr().map_or(0, |a| a.port());
        // Each node's copies, shared by its connections (only the kept one writes them).
        let mut node_queues: HashMap<NodeId, Arc<PeerQueue>> = HashMap::new();
        // Events handled since the route table was last rebuilt.
        let mut unpublished = 0usize;
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
            let mut adopt = |conn: quinn::Connection,
                             node: &NodeId,
                             conns: &mut HashMap<ConnId, Link>,
                             tasks: &mut JoinSet<()>| {
                let id = ConnId(next_conn);
                next_conn += 1;
                let (ctl_tx, ctl_rx) = mpsc::channel(CONTROL_QUEUE);
                let (retire_tx, retire_rx) = watch::channel(false);
                let queue = node_queues
                    .entry(node.clone())
                    .or_insert_with(|| Arc::new(PeerQueue::new(self.queue_size)))
                    .clone();
                // A connection whose peer said it is leaving lends no run: the peer's next
                // connection, after its restart, is a reconnect.
                let run = Run::new(
                    id,
                    conns
                        .values()
                        .filter(|l| &l.node == node && !l.left)
                        .map(|l| l.run),
                );
                conns.insert(
                    id,
                    Link {
                        conn: conn.clone(),
                        node: node.clone(),
                        ctl: ctl_tx,
                        queue: queue.clone(),
                        retire: retire_tx,
                        left: false,
                        run,
                    },
                );
                tasks.spawn(serve_peer(PeerTask {
                    conn,
                    id,
                    ctl: ctl_rx,
                    retire: retire_rx,
                    leaving: leaving.clone(),
                    queue,
                    broker: self.broker.clone(),
                    mesh: self.handle.clone(),
                    compression: self.compression,
                    events: self.tx.clone(),
                    durable: self.durable.clone(),
                    block_timeout: self.block_timeout,
                }));
                id
            };
            match event {
                None => {}
                // A connection the mesh does not keep (a duplicate, itself) is closed by the
                // `Output::Close` it queues, below: both ends then end it.
                // Checked against the revocation lists in force when the driver takes it: one
                // verified under the lists a reload replaced before its event came here would
                // otherwise slip past that reload's check of the live connections.
                Some(Event::Accepted { conn, node }) if self.tls.peer_revoked(&conn) => {
                    warn!(peer = %node, "refused a mesh connection: the peer's certificate is revoked (cluster.tls.crl_file)");
                    close_revoked(&conn);
                }
                Some(Event::Accepted { conn, node }) => {
                    if too_many(&live, &conn, &node) {
                        self.handle
                            .connections_refused
                            .fetch_add(1, Ordering::Relaxed);
                        let what = format!("cluster peer {node} opened more than {MAX_CONNECTIONS_PER_PEER} mesh connections at once: closing the new one");
                        log_refusal(&mut refusals_warned, &node, Refusal::Connections, now, what);
                    } else {
                        let from = crate::connection::canonical(conn.remote_address());
                        self.handle.note_peer_addrs(|a| a.accepted(from));
                        let id = adopt(conn, &node, &mut conns, &mut tasks);
                        live.insert(id, node.clone());
                        self.mesh.handle_connected(now, id, node, None, false);
                    }
                }
                Some(Event::Dialed { addr, result }) => {
                    let result = result.and_then(|(conn, node)| {
                        // This node's own id from an address that is not this node's: two
                        // nodes share an id (a copied configuration and certificate).
                        if &node == self.mesh.me() && !is_own_address(addr, own_port) {
                            conn.close(0u32.into(), b"duplicate node id");
                            return Err(format!(
                                "the node there presents this node's id {node}: another node \
                                 has the same node id (a node's id is its peer certificate's \
                                 Common Name: every node needs its own, `aqueduct cert peer \
                                 NODE`), or this node's own address is reached through NAT"
                            ));
                        }
                        if self.tls.peer_revoked(&conn) {
                            close_revoked(&conn);
                            return Err(
                                "the peer certificate is revoked (cluster.tls.crl_file)".into()
                            );
                        }
                        Ok((conn, node))
                    });
                    match result {
                        Ok((conn, node)) if too_many(&live, &conn, &node) => {
                            // This node's dials count as the peer's do: a peer that lets this
                            // node's connections linger (each said to be leaving, say) cannot
                            // make it keep more than the cap by having it redial.
                            self.handle
                                .connections_refused
                                .fetch_add(1, Ordering::Relaxed);
                            let what = format!("this node has {MAX_CONNECTIONS_PER_PEER} mesh connections to cluster peer {node} still open: closing the new one it dialed, and dialing again with a growing wait");
                            log_refusal(
                                &mut refusals_warned,
                                &node,
                                Refusal::Connections,
                                now,
                                what,
                            );
                            self.mesh.handle_dial_failed(now, addr);
                        }
                        Ok((conn, node)) => {
                            if dial_warned.forget(&addr) {
                                info!(%addr, peer = %node, "cluster peer reached");
                            }
                            let id = adopt(conn, &node, &mut conns, &mut tasks);
                            live.insert(id, node.clone());
                            self.mesh.handle_connected(now, id, node, Some(addr), true);
                        }
                        Err(why) => {
                            // This node's own endpoint going away (shutdown) is no peer's fault.
                            let stopping = matches!(why.as_str(), "endpoint stopping" | "closed");
                            let why = explain_dial_failure(addr, &why);
                            let due = if stopping {
                                None
                            } else {
                                dial_warned.due(addr, why.clone(), now)
                            };
                            if let Some(more) = due {
                                let more = held_back(more, "failures");
                                warn!(%addr, "cannot connect to a cluster peer (retrying with backoff): {why}{more}");
                            } else {
                                debug!(%addr, "mesh dial failed: {why}");
                            }
                            self.mesh.handle_dial_failed(now, addr);
                        }
                    }
                }
                Some(Event::Control {
                    conn,
                    control: Control::Leaving,
                    ..
                }) => {
                    // The peer is shutting down. Its interest is forgotten now; the connection
                    // is let go of, not closed: its control writer finishes the control stream
                    // once every copy the peer wrote on it is published here (which the peer
                    // waits for before it closes it).
                    if let Some(link) = conns.get_mut(&conn).filter(|l| !l.left) {
                        link.left = true;
                        info!(peer = %link.node, "cluster peer leaving (shutting down)");
                        link.let_go();
                        // The peer closes it once this node has published what it wrote there,
                        // waiting at most LEAVE_WAIT for that. One that does not is closed
                        // here: a peer saying it leaves, then never going, would otherwise
                        // hold the connection (kept alive by its keep-alives) for ever.
                        let (conn, node) = (link.conn.clone(), link.node.clone());
                        let errors = self.handle.protocol_errors.clone();
                        tasks.spawn(async move {
                            tokio::select! {
                                _ = conn.closed() => {}
                                _ = tokio::time::sleep(LEFT_OPEN_WAIT) => {
                                    warn!(peer = %node, "cluster peer said it was leaving {LEFT_OPEN_WAIT:?} ago but kept its connection open: closing it");
                                    errors.fetch_add(1, Ordering::Relaxed);
                                    conn.close(0u32.into(), LEFT_OPEN.as_bytes());
                                }
                            }
                        });
                    }
                    self.mesh.handle_disconnected(now, conn);
                }
                Some(Event::Control { conn, control, .. }) => {
                    first_word(&mut conns, conn, &mut reconnects);
                    self.mesh.handle_control(conn, control);
                }
                Some(Event::Broken { conn, why }) => {
                    live.remove(&conn);
                    warn!(conn = conn.0, "mesh control stream broken (closing the connection; the next one waits longer each time): {why}");
                    self.handle.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(link) = conns.remove(&conn) {
                        link.conn.close(0u32.into(), PROTOCOL_ERROR.as_bytes());
                    }
                    self.mesh.handle_broken(now, conn);
                }
                Some(Event::Closed { conn }) => {
                    live.remove(&conn);
                    conns.remove(&conn);
                    self.mesh.handle_disconnected(now, conn);
                }
                Some(Event::RefusedByPeer { conn, why }) => {
                    // Only a refusal of this node's interest: the metric says so, and an
                    // operator reading it would raise `cluster.max_peer_interest` for nothing
                    // on a peer's protocol-error close.
                    if why == PeerRefusal::OurInterest {
                        self.handle.refused_by_peer.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(link) = conns.get(&conn) {
                        let (kind, what) = match why {
                            PeerRefusal::OurInterest => {
                                let ours = self.mesh.local().len();
                                (Refusal::OurInterest, format!("cluster peer {} closed its connection because this node's interest ({ours} topic filters and consumer groups) is more than its cluster.max_peer_interest allows: raise the limit there, or subscribe to fewer distinct filters here; dialing it again with a growing wait", link.node))
                            }
                            PeerRefusal::ProtocolError => (Refusal::Protocol, format!("cluster peer {} closed its connection for a mesh protocol error (do both nodes run the same Aqueduct version?): dialing it again with a growing wait", link.node)),
                        };
                        log_refusal(&mut refusals_warned, &link.node, kind, now, what);
                    }
                    self.mesh.handle_refused_by_peer(conn);
                }
                Some(Event::PeerRetired { conn }) => self.mesh.handle_peer_retired(conn),
                Some(Event::Local { key, delta }) => self.mesh.handle_local(key, delta),
                Some(Event::Peers(addrs)) => {
                    self.handle.note_peer_addrs(|a| {
                        a.targets = addrs
                            .iter()
                            .map(|&a| crate::connection::canonical(a))
                            .collect();
                    });
                    dial_warned.retain(|a| addrs.contains(a));
                    self.mesh.handle_peer_set(now, addrs);
                }
                Some(Event::CheckRevoked { closed }) => {
                    let mut n = 0;
                    for link in conns.values().filter(|l| self.tls.peer_revoked(&l.conn)) {
                        warn!(peer = %link.node, "closing a mesh connection: the peer's certificate is revoked (cluster.tls.crl_file)");
                        close_revoked(&link.conn);
                        n += 1;
                    }
                    let _ = closed.send(n);
                }
            }
            while let Some(out) = self.mesh.poll_output() {
                match out {
                    Output::Dial(addr) => {
                        let (endpoint, tls, tx, ack) = (
                            endpoint.clone(),
                            self.tls.clone(),
                            self.tx.clone(),
                            self.dial_transport.clone(),
                        );
                        tasks.spawn(async move {
                            let result = dial(&endpoint, &tls, addr, ack).await;
                            let _ = tx.send(Event::Dialed { addr, result });
                        });
                    }
                    Output::Close { conn, reason } => {
                        if let Some(link) = conns.remove(&conn) {
                            if reason == aqueduct_core::mesh::DUPLICATE {
                                // Retired, not cut: what was written on it is still read.
                                debug!(conn = conn.0, "retiring a duplicate mesh connection");
                                self.handle.retired.fetch_add(1, Ordering::Relaxed);
                                let _ = link.retire.send(true);
                            } else {
                                if reason == aqueduct_core::mesh::RESTARTED {
                                    info!(peer = %link.node, "cluster peer restarted: its new connection replaces the old one");
                                    // Its new connection spoke while this one was still open
                                    // (so in its run): the restart is the reconnect.
                                    if let Some(count) =
                                        reconnects.get_mut(&link.node).map(Spoken::restarted)
                                    {
                                        link.queue.reconnects.store(count, Ordering::Relaxed);
                                        info!(peer = %link.node, reconnects = count, "cluster peer reconnected");
                                    }
                                } else if reason == aqueduct_core::mesh::INTEREST_LIMIT {
                                    let max = self.mesh.max_peer_interest();
                                    let what = format!("cluster peer {} sent more interest (topic filters and consumer groups) than cluster.max_peer_interest ({max}) allows: closing its connection, and dialing it again with a growing wait; raise the limit if its subscriptions are legitimate", link.node);
                                    log_refusal(
                                        &mut refusals_warned,
                                        &link.node,
                                        Refusal::ItsInterest,
                                        now,
                                        what,
                                    );
                                    self.handle.interest_refused.fetch_add(1, Ordering::Relaxed);
                                } else if reason == PROTOCOL_ERROR {
                                    warn!(peer = %link.node, "cluster peer broke the mesh protocol (an interest update out of order): closing its connection; the next one waits longer each time");
                                    self.handle.protocol_errors.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    debug!(conn = conn.0, reason, "closing a mesh connection");
                                }
                                link.conn.close(0u32.into(), reason.as_bytes());
                            }
                        }
                    }
                    Output::Send { conn, control } => {
                        let Some(link) = conns.get(&conn) else {
                            continue;
                        };
                        let mut bytes = Vec::new();
                        encode_control(&control, &mut bytes);
                        match link.ctl.try_send(bytes) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(_)) => {
                                warn!(
                                    peer = %link.node,
                                    "a cluster peer is not reading its control stream ({CONTROL_QUEUE} updates waiting): closing the connection; the next one starts from a full snapshot"
                                );
                                self.handle
                                    .control_overflows
                                    .fetch_add(1, Ordering::Relaxed);
                                link.conn.close(0u32.into(), b"control queue full");
                                // Once: nothing more is queued for it (its close comes as an
                                // event, as for any connection lost).
                                conns.remove(&conn);
                            }
                            // Its writer ended: the connection is going away anyway.
                            Err(mpsc::error::TrySendError::Closed(_)) => {}
                        }
                    }
                }
            }
            // The table and the queue map cost in proportion to all interest: while more
            // events are waiting (a burst of subscriptions after a restart, a peer's snapshot)
            // they are rebuilt once for the burst, at least every EVENTS_PER_TURN events.
            unpublished += 1;
            if !self.rx.is_empty() && unpublished < EVENTS_PER_TURN {
                continue;
            }
            unpublished = 0;
            self.publish_routes(&conns, &mut node_queues);
        }
        // What was handled since the last rebuild counts for the leave (a duplicate retired
        // just before: the kept connection must own its peer's queue, or no connection
        // writes what is queued).
        if unpublished > 0 {
            self.publish_routes(&conns, &mut node_queues);
        }
        self.leave(&mut conns, &leaving_tx).await;
        for link in conns.values() {
            link.conn.close(0u32.into(), SHUTTING_DOWN);
        }
        tasks.shutdown().await;
        // What is still queued was never written: copies queued after their connection's
        // writer finished for the leave (a peer's group copy that arrived while this node was
        // leaving, its group's last member here gone, and was handed to a third node), or that
        // a peer that did not confirm the leave never took. Counted, not dropped unsaid.
        let unsent = discard_all(&node_queues, &self.handle.discarded);
        if unsent > 0 {
            warn!(
                copies = unsent,
                "cluster mesh stopped with copies for peers not sent (aqueduct_mesh_discarded_total)"
            );
        }
        info!("cluster mesh stopped");
    }

    /// Publish the route table and the peers' queues for what the mesh knows now: each peer's
    /// queue owned by its kept connection; the queues of nodes no longer peers (and with no
    /// connection being set up) discarded, their copies counted.
    fn publish_routes(
        &mut self,
        conns: &HashMap<ConnId, Link>,
        node_queues: &mut HashMap<NodeId, Arc<PeerQueue>>,
    ) {
        self.table.store(Arc::new(self.mesh.table()));
        let queues: HashMap<NodeId, Arc<PeerQueue>> = self
            .mesh
            .peers()
            .filter_map(|(n, c)| {
                let link = conns.get(&c)?;
                link.queue.set_owner(c);
                Some((n.clone(), link.queue.clone()))
            })
            .collect();
        // A node's queue lives while it is a peer or a connection to it is being set up.
        let discarded = &self.handle.discarded;
        node_queues.retain(|n, q| {
            let keep = queues.contains_key(n) || conns.values().any(|l| &l.node == n);
            if !keep {
                discarded.fetch_add(q.discard() as u64, Ordering::Relaxed);
            }
            keep
        });
        self.queues.store(Arc::new(queues));
    }

    /// Leave the cluster gracefully (shutdown): tell each peer (`Control::Leaving`), write the
    /// copies still queued for it, finish the data stream, and close each connection once its
    /// peer has published every copy written on it (its control FIN), for at most
    /// [`LEAVE_WAIT`]. `conns` keeps the connections that did not end in time.
    async fn leave(&mut self, conns: &mut HashMap<ConnId, Link>, leaving: &watch::Sender<bool>) {
        if conns.is_empty() {
            return;
        }
        leaving.send_replace(true);
        let mut message = Vec::new();
        encode_control(&Control::Leaving, &mut message);
        conns.retain(|_, link| {
            // Its peer is leaving too and was let go of: its control writer finishes the
            // stream once the peer's copies are published here, and the peer then closes the
            // connection. Waited for like the others, not closed (which cut those copies).
            if link.left {
                return true;
            }
            match link.ctl.try_send(message.clone()) {
                Ok(()) => true,
                // Its control writer is gone or stuck: nothing to wait for.
                Err(_) => {
                    link.conn.close(0u32.into(), SHUTTING_DOWN);
                    false
                }
            }
        });
        let left = tokio::time::timeout(LEAVE_WAIT, async {
            while !conns.is_empty() {
                match self.rx.recv().await {
                    Some(Event::Closed { conn } | Event::Broken { conn, .. }) => {
                        conns.remove(&conn);
                    }
                    // Leaving too (a whole cluster stopping): the same as above, or each would
                    // wait for the other's confirmation until LEAVE_WAIT.
                    Some(Event::Control {
                        conn,
                        control: Control::Leaving,
                        ..
                    }) => {
                        if let Some(link) = conns.get_mut(&conn) {
                            link.let_go();
                        }
                    }
                    // Dropped: a control message's hold on its reader is released, a connection
                    // dialed or accepted meanwhile is closed.
                    Some(_) => {}
                    None => break,
                }
            }
        })
        .await;
        if left.is_err() {
            self.handle
                .leaves_unconfirmed
                .fetch_add(conns.len() as u64, Ordering::Relaxed);
            warn!(
                peers = conns.len(),
                "cluster peers did not confirm within {LEAVE_WAIT:?} that they published the copies this node sent them: closing; those not yet published there may be lost"
            );
        }
    }
}

/// Close a mesh connection whose peer's certificate is revoked.
fn close_revoked(conn: &quinn::Connection) {
    conn.close(
        aqueduct_proto::ErrorCode::NOT_AUTHORIZED.0.into(),
        b"peer certificate revoked",
    );
}

/// The close reason of a mesh connection when its node shuts down.
const SHUTTING_DOWN: &[u8] = b"broker shutting down";

/// How long a node shutting down waits for its peers to publish the copies it sent them.
pub(crate) const LEAVE_WAIT: Duration = Duration::from_secs(5);

/// How long a connection whose peer said it is leaving may stay open: the peer closes it once
/// every copy it wrote there is published here, waiting at most [`LEAVE_WAIT`] for that; past
/// this, this node closes it ([`LEFT_OPEN`]).
pub(crate) const LEFT_OPEN_WAIT: Duration = Duration::from_secs(7);

/// The close reason of a connection whose peer said it is leaving and kept it open beyond
/// [`LEFT_OPEN_WAIT`].
pub(crate) const LEFT_OPEN: &str = "the peer said it was leaving but kept the connection open";

/// Would one more connection with `node` pass [`MAX_CONNECTIONS_PER_PEER`]? If so, `conn` is
/// closed with [`TOO_MANY_CONNECTIONS`].
fn too_many(live: &HashMap<ConnId, NodeId>, conn: &quinn::Connection, node: &NodeId) -> bool {
    let open = live.values().filter(|n| *n == node).count();
    let over = open >= MAX_CONNECTIONS_PER_PEER;
    if over {
        conn.close(0u32.into(), TOO_MANY_CONNECTIONS.as_bytes());
    }
    over
}

/// A mesh connection as the driver holds it.
struct Link {
    conn: quinn::Connection,
    node: NodeId,
    /// Encoded control messages for its writer (at most [`CONTROL_QUEUE`] waiting).
    ctl: mpsc::Sender<Vec<u8>>,
    /// Copies for the peer (its node's queue).
    queue: Arc<PeerQueue>,
    /// Set when the mesh keeps the pair's other connection: finish and close gracefully.
    retire: watch::Sender<bool>,
    /// The peer said it is leaving (a watch closes the connection if it stays open).
    left: bool,
    /// Whether the peer spoke on it, and the run of connections it belongs to.
    run: Run,
}

/// Connections to one node belong to one run while the peer stays connected through them: a
/// duplicate, or the connection that replaced the one in use. A connection set up while one to
/// its node that the peer spoke on is open joins that one's run; one set up before the peer's
/// first word on another is joined to that one's run then (both nodes dial: both connections
/// speak, and the one not kept may close before the kept one's first word). Otherwise it starts
/// a run of its own (its id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    id: u64,
    /// The peer sent a control message on it: it took the connection (a peer that refuses
    /// this node's certificate closes it right after the handshake, without a word).
    spoke: bool,
}

impl Run {
    /// The run of a new connection `conn`, given those of the connections to its node still
    /// open.
    fn new(conn: ConnId, open: impl IntoIterator<Item = Run>) -> Run {
        let id = open.into_iter().find(|r| r.spoke).map_or(conn.0, |r| r.id);
        Run { id, spoke: false }
    }

    /// The peer spoke first on another connection to the node, of run `id`: this one, open and
    /// not spoken on yet, is its duplicate.
    fn join(&mut self, id: u64) {
        if !self.spoke {
            self.id = id;
        }
    }
}

impl Link {
    /// Say nothing more on its control stream: its writer then finishes the stream once every
    /// copy the peer wrote on the connection is published here (the peer is leaving and waits
    /// for that), without the connection being closed or retired.
    fn let_go(&mut self) {
        self.ctl = mpsc::channel(1).0;
    }
}

/// Control messages (interest updates) that may wait for a peer's control stream. A peer that
/// reads it so slowly that this many pile up (local clients churning through subscriptions
/// faster than it takes the updates) has its connection closed instead of the queue growing
/// without bound: the next connection starts with a full snapshot of the interest in force.
const CONTROL_QUEUE: usize = 65_536;

/// Events the driver may handle before it rebuilds the route table and the queue map while
/// more are waiting: a burst is coalesced, and routing sees the changes within it soon.
const EVENTS_PER_TURN: usize = 1024;

/// Where a mesh connection's control FIN is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fin {
    NotYet,
    Sent,
    Received,
}

/// How long a mesh connection that is done waits for its control FIN to be received before it
/// closes.
const CLOSE_AFTER_FIN_WAIT: Duration = Duration::from_secs(1);

/// How long a retired duplicate connection waits for the peer to finish its side.
const RETIRE_WAIT: Duration = Duration::from_secs(5);

/// Lets go of a peer queue's writer role when a connection's data writer ends.
struct LetGo<'a>(&'a PeerQueue, ConnId);

impl Drop for LetGo<'_> {
    fn drop(&mut self) {
        self.0.let_go(self.1);
    }
}

/// The reading side's [`LetGo`]: however a connection's reader ends (its data stream read to
/// the end, broken, gone, or cut short), the next connection's may publish.
struct DoneReading<'a>(&'a PeerQueue, ConnId);

impl Drop for DoneReading<'_> {
    fn drop(&mut self) {
        self.0.done_reading(self.1);
    }
}

/// Discard every queue's copies, counting them in `discarded`; how many there were.
fn discard_all(queues: &HashMap<NodeId, Arc<PeerQueue>>, discarded: &AtomicU64) -> u64 {
    let n: u64 = queues.values().map(|q| q.discard() as u64).sum();
    discarded.fetch_add(n, Ordering::Relaxed);
    n
}

/// A peer's reconnects, and the run of connections (`Link::run`) it last spoke on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Spoken {
    count: u64,
    run: u64,
}

impl Spoken {
    /// The peer spoke first on a connection of `run`: its reconnects so far if that is a new
    /// run, `None` if it spoke on this run before (a duplicate connection).
    fn heard(&mut self, run: u64) -> Option<u64> {
        (self.run != run).then(|| {
            self.run = run;
            self.restarted()
        })
    }

    /// The peer restarted, and its new connection, set up while the old one was still open,
    /// shares the old one's run: a reconnect all the same. Its reconnects so far.
    fn restarted(&mut self) -> u64 {
        self.count += 1;
        self.count
    }
}

/// The peer's first control message on `conn` (its snapshot, which opens every connection):
/// the peer took the connection. Said as "cluster peer connected", or "reconnected" (and
/// counted) if it was connected before, unless it already spoke on a connection of the same run
/// ([`Run`]: a duplicate, possibly closed by now). Not said at the handshake: a peer that
/// refuses this node's certificate (revoked, not a peer certificate) closes the connection
/// right after it, and this node logged it as reconnected at every redial.
fn first_word(
    conns: &mut HashMap<ConnId, Link>,
    conn: ConnId,
    reconnects: &mut HashMap<NodeId, Spoken>,
) {
    let Some(link) = conns.get_mut(&conn).filter(|l| !l.run.spoke) else {
        return;
    };
    link.run.spoke = true;
    let (node, queue, run) = (link.node.clone(), link.queue.clone(), link.run.id);
    for other in conns.values_mut().filter(|l| l.node == node && !l.left) {
        other.run.join(run);
    }
    match reconnects.get_mut(&node) {
        Some(seen) => {
            if let Some(count) = seen.heard(run) {
                queue.reconnects.store(count, Ordering::Relaxed);
                info!(peer = %node, reconnects = count, "cluster peer reconnected");
            }
        }
        None => {
            // Bounded: past REMEMBERED_PEERS node ids (ids churning with autoscaled pods), only
            // those of connected peers are kept.
            if reconnects.len() >= REMEMBERED_PEERS {
                reconnects.retain(|n, _| conns.values().any(|l| &l.node == n));
            }
            reconnects.insert(node.clone(), Spoken { count: 0, run });
            info!(peer = %node, "cluster peer connected");
        }
    }
}

/// How many peers' reconnect counts are kept beyond the connected ones'.
const REMEMBERED_PEERS: usize = 4096;

/// Dial `addr` as a mesh peer: the peer certificate must name `aqueduct-mesh` and chain to the
/// cluster CA; its CN is the peer's node id.
/// Whether `addr` is this node's own: its port, and an IP of this host (one a socket can be
/// bound to).
fn is_own_address(addr: SocketAddr, own_port: u16) -> bool {
    let mut probe = addr;
    // Port 0, the IPv6 scope (a link-local address's interface) kept.
    probe.set_port(0);
    addr.port() == own_port && std::net::UdpSocket::bind(probe).is_ok()
}

/// A dial failure in words an operator can act on: the error, and what usually causes it.
fn explain_dial_failure(addr: SocketAddr, why: &str) -> String {
    let hint = if why.contains("timed out") {
        format!(
            "is a cluster node listening on UDP {addr}? (check cluster.peers or \
             cluster.discovery here, and the peer's listen_addr)"
        )
    } else if why.contains("UnknownIssuer") || why.contains("BadSignature") {
        "the peer's certificate is not signed by this node's cluster.tls.ca_file: every node's \
         certificate must come from the same CA (`aqueduct cert ca` once, then `aqueduct cert \
         peer NODE` for each node)"
            .to_string()
    } else if why.contains("extended key usage") {
        "the certificate there is not a peer certificate (a client or server certificate in \
         cluster.tls.cert_file, there or, if this address is this node's own, here): make each \
         node's with `aqueduct cert peer NODE`"
            .to_string()
    } else if why.contains("NotValidForName") {
        format!(
            "the peer's certificate does not name {MESH_NAME}: it is not a peer certificate \
             (make one with `aqueduct cert peer NODE`)"
        )
    } else {
        return why.to_string();
    };
    format!("{why}; {hint}")
}

/// Why a peer closed a connection in a way that makes this node wait longer before the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRefusal {
    /// This node's interest is beyond the peer's limit ([`aqueduct_core::mesh::INTEREST_LIMIT`]).
    OurInterest,
    /// This node's control stream broke the peer's protocol ([`PROTOCOL_ERROR`]).
    ProtocolError,
}

/// Look at why a connection ended. Warns if the peer refused it (NOT_AUTHORIZED: this node's
/// certificate is not a peer certificate it takes); returns the refusal if the peer closed it
/// for this node's interest or a protocol error, which the driver warns about and redials
/// with a growing wait. The other closes (shutdown, a duplicate retired) are routine.
fn note_peer_close(e: &quinn::ConnectionError) -> Option<PeerRefusal> {
    let quinn::ConnectionError::ApplicationClosed(c) = e else {
        return None;
    };
    if c.error_code == quinn::VarInt::from(aqueduct_proto::ErrorCode::NOT_AUTHORIZED.0) {
        warn!(
            "a cluster peer refused this node's connection: {}",
            String::from_utf8_lossy(&c.reason)
        );
    }
    if c.reason.as_ref() == aqueduct_core::mesh::INTEREST_LIMIT.as_bytes() {
        Some(PeerRefusal::OurInterest)
    } else if c.reason.as_ref() == PROTOCOL_ERROR.as_bytes() {
        Some(PeerRefusal::ProtocolError)
    } else {
        None
    }
}

/// What a link this node dials asks of its transport, as the broker asks of the connections it
/// accepts: the peer's ACKs (`transport.ack_eliciting_threshold`, `transport.ack_delay`), and
/// its datagrams' size (`transport.initial_mtu`). Its own datagrams do not grow (no MTU
/// discovery, as the Rust client's: with it, a dialling end's closes were sometimes never
/// sent; docs/architecture.md, "Larger datagrams"); the peer's to it do (the endpoint accepts
/// `transport.max_mtu`, and the accepting node probes).
#[derive(Debug, Clone)]
pub(crate) struct DialTransport {
    pub ack_frequency: Option<quinn::AckFrequencyConfig>,
    pub initial_mtu: u16,
}

/// The round-trip time a dial assumes until it has measured one (QUIC's default is 333 ms, for
/// the open internet): a cluster's nodes sit in one data centre or Kubernetes cluster. A
/// connection closed before the peer answered (a dial to a node that is down, when this node
/// stops) lingers for three probe timeouts, about 3 s at 333 ms, and the broker's shutdown
/// waited up to its 2 s bound for it; at 50 ms it lingers ~0.45 s. The cost where the round
/// trip is longer than the first probe timeout (150 ms): a resend of the first handshake
/// packets before the answer comes (several, beyond ~450 ms), nothing else.
const MESH_INITIAL_RTT: Duration = Duration::from_millis(50);

/// The transport of a link this node dials.
fn dial_transport(asked: DialTransport) -> quinn::TransportConfig {
    let DialTransport {
        ack_frequency,
        initial_mtu,
    } = asked;
    let mut transport = quinn::TransportConfig::default();
    aqueduct_udp::path_mtu(&mut transport, initial_mtu, initial_mtu);
    transport.max_concurrent_uni_streams(MESH_UNI_STREAMS.into());
    transport.initial_rtt(MESH_INITIAL_RTT);
    // A peer that vanishes (SIGKILL, a partition) is noticed within MESH_IDLE (the smaller of
    // the two ends' idle timeouts applies), and reconnecting starts then.
    transport.keep_alive_interval(Some(MESH_KEEP_ALIVE));
    if let Ok(idle) = quinn::IdleTimeout::try_from(MESH_IDLE) {
        transport.max_idle_timeout(Some(idle));
    }
    // Fewer ACKs from the peer, as the broker asks of every connection it accepts.
    transport.ack_frequency_config(ack_frequency);
    // The mesh sends no QUIC datagrams: none are taken (quinn would hold up to 1.25 MB unread).
    transport.datagram_receive_buffer_size(None);
    transport
}

async fn dial(
    endpoint: &quinn::Endpoint,
    tls: &MeshTls,
    addr: SocketAddr,
    asked: DialTransport,
) -> Result<(quinn::Connection, NodeId), String> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from((*tls.client_config()).clone())
        .map_err(|e| e.to_string())?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(dial_transport(asked)));
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

/// Block kinds on a data stream: `kind u8 | len u32 LE | payload`; the payload of a plain block
/// is records (`routing_len u16 LE | routing | PUBLISH frame`, see `mesh_codec`), that of a zstd
/// block `uncompressed_len u32 LE | zstd(records)` (the seed's COMPRESSION extension: algorithm
/// 1 and the uncompressed length), opened within `aqueduct_proto::compress`'s limits.
const PLAIN_BLOCK: u8 = 1;
const ZSTD_BLOCK: u8 = 2;
/// Largest block on the wire.
const MAX_BLOCK: usize = 16 << 20;

/// A block of `records`, compressed when it is large enough and shrinks.
fn seal_block(records: &[u8], compression: Compression) -> Bytes {
    let mut out = BytesMut::with_capacity(records.len() + 9);
    if let Compression::Zstd { level, threshold } = compression {
        if records.len() >= threshold {
            if let Some((ext, packed)) = aqueduct_proto::compress::compress(records, level) {
                out.put_u8(ZSTD_BLOCK);
                out.put_u32_le(packed.len() as u32 + 4);
                out.put_u32_le(ext.uncompressed_len);
                out.extend_from_slice(&packed);
                return out.freeze();
            }
        }
    }
    out.put_u8(PLAIN_BLOCK);
    out.put_u32_le(records.len() as u32);
    out.extend_from_slice(records);
    out.freeze()
}

/// The next complete block's records from the front of `buf` (`None`: need more bytes).
fn next_block(buf: &mut BytesMut) -> Result<Option<Bytes>, String> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let kind = buf[0];
    let len = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_BLOCK {
        return Err(format!(
            "a block of {len} bytes, above the {MAX_BLOCK}-byte limit"
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let mut block = buf.split_to(5 + len).freeze();
    block.advance(5);
    match kind {
        PLAIN_BLOCK => Ok(Some(block)),
        ZSTD_BLOCK => {
            if block.len() < 4 {
                return Err("a zstd block without its length".into());
            }
            let claimed = block.get_u32_le();
            let ext = aqueduct_proto::Compression {
                algorithm: aqueduct_proto::Compression::ZSTD,
                uncompressed_len: claimed,
            };
            aqueduct_proto::compress::decompress(
                &block,
                &ext,
                &aqueduct_proto::compress::Limits::default(),
            )
            .map(Some)
            .map_err(|e| format!("compressed block refused: {e}"))
        }
        k => Err(format!("unknown block kind {k}")),
    }
}

/// The copies in a block's records (all complete).
fn records(mut block: Bytes) -> Result<Vec<(Forward, Publish)>, String> {
    let limits = aqueduct_proto::Limits {
        max_data_len: MAX_BLOCK as u32,
    };
    let mut out = Vec::new();
    while !block.is_empty() {
        if block.len() < 2 {
            return Err("a record cut short".into());
        }
        let routing_len = u16::from_le_bytes([block[0], block[1]]) as usize;
        if block.len() < 2 + routing_len {
            return Err("a record's routing cut short".into());
        }
        let forward = decode_forward(&block[2..2 + routing_len]).map_err(|e| e.to_string())?;
        let raw = split_frame(&block[2 + routing_len..], &limits).map_err(|e| e.to_string())?;
        let mut frame = block.split_to(2 + routing_len + raw.frame_len());
        frame.advance(2 + routing_len + HEADER_LEN);
        let header = match raw.validate() {
            Ok(h) if h.mesh_forwarded => h,
            Ok(_) => return Err("a copy without the MeshForwarded bit".into()),
            Err(e) => return Err(e.to_string()),
        };
        match Frame::decode(&header, frame) {
            Ok(Frame {
                message: Message::Publish(p),
                ..
            }) => out.push((forward, p)),
            Ok(_) => return Err("only PUBLISH copies are forwarded".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(out)
}

/// A forwarded copy's dead-letter fields (a dead letter made on the sending node): original
/// topic, original offset, attempts made, reason.
fn dead_letter_of(p: &Publish) -> Option<aqueduct_proto::delivery::DeadLetter<'_>> {
    Some(aqueduct_proto::delivery::DeadLetter {
        original_topic: p.ext.original_topic.as_ref()?,
        original_offset: p.ext.original_offset.unwrap_or(0),
        attempts_made: p.ext.attempts_made.unwrap_or(0),
        reason: p.ext.reason.as_deref().unwrap_or(""),
    })
}

/// Wait while a block-policy subscriber that a copy was published to has no room, as a client's
/// publish waits: for at most `block_timeout`, then that subscriber is closed as a slow consumer,
/// so that one stuck subscriber here cannot stop every copy from a peer.
async fn wait_held(
    ctx: &mut PublishContext,
    broker: &Broker,
    durable: Option<&Durable>,
    block_timeout: Option<Duration>,
) {
    // One `block_timeout` for the whole hold, from its start (see the stream's
    // `wait_for_room`).
    let mut deadline = None;
    while let Some(sub) = ctx.take_held() {
        let room = std::future::poll_fn(|cx| sub.poll_room(cx));
        let timed_out = match block_timeout {
            Some(limit) => {
                let at = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + limit);
                tokio::time::timeout_at(at, room).await.is_err()
            }
            None => {
                room.await;
                false
            }
        };
        if timed_out {
            let now = Instant::now();
            let closed = match durable {
                Some(d) => d.with_order(ctx, |ctx| broker.disconnect_slow(ctx, &sub, now)),
                None => broker.disconnect_slow(ctx, &sub, now),
            };
            if closed {
                warn!(
                    filter = %sub.filter(),
                    "a block-policy subscription held a cluster peer's copies for {:?}: closed it as a slow consumer",
                    block_timeout.unwrap_or_default()
                );
            }
        }
    }
}

/// The first byte of each unidirectional stream says what it carries.
const CONTROL_STREAM: u8 = 1;
const DATA_STREAM: u8 = 2;
/// A data write gathers up to this many bytes of queued copies.
const DATA_WRITE: usize = 64 * 1024;

/// What a mesh connection's task needs.
struct PeerTask {
    conn: quinn::Connection,
    id: ConnId,
    /// Encoded control messages to write.
    ctl: mpsc::Receiver<Vec<u8>>,
    /// Turns true when this connection is a duplicate to retire.
    retire: watch::Receiver<bool>,
    /// Turns true when this node shuts down: write what is queued, finish, wait until the peer
    /// has published it all, close.
    leaving: watch::Receiver<bool>,
    /// Copies to write (when this connection owns its node's queue).
    queue: Arc<PeerQueue>,
    broker: Arc<Broker>,
    mesh: MeshHandle,
    compression: Compression,
    /// To the driver.
    events: mpsc::UnboundedSender<Event>,
    durable: Option<Arc<Durable>>,
    block_timeout: Option<Duration>,
}

/// How a mesh connection's streams ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Closed, reset or gone: the connection is over.
    Gone,
    /// The peer finished its data stream (it retired this connection as a duplicate), or
    /// its control stream (it has published every copy this end wrote).
    PeerRetired,
    /// This end, retired, wrote its last copy and the peer has published them all.
    SentAll,
    /// The peer broke the mesh protocol.
    Broken(String),
}

/// Read a mesh connection's control stream, handing each message to the driver; at most
/// `limit` bytes of messages wait for the driver at a time.
async fn read_control(
    mut recv: impl tokio::io::AsyncRead + Unpin,
    id: ConnId,
    events: &mpsc::UnboundedSender<Event>,
    limit: usize,
) -> End {
    let mut buf = BytesMut::with_capacity(4096);
    // Messages sent to the driver and not yet handled, in bytes: a peer faster than the
    // driver waits (its stream's flow control holds it), rather than queueing without end.
    let waiting = Arc::new(tokio::sync::Semaphore::new(limit));
    loop {
        let Ok(n) = recv.read_buf(&mut buf).await else {
            return End::Gone;
        };
        loop {
            match decode_control(&buf) {
                Ok((control, used)) => {
                    buf.advance(used);
                    // A message larger than `limit` (none is, by default) takes it all.
                    let bytes = used.min(limit) as u32;
                    let Ok(held) = waiting.clone().acquire_many_owned(bytes).await else {
                        return End::Gone;
                    };
                    let _ = events.send(Event::Control {
                        conn: id,
                        control,
                        held,
                    });
                }
                Err(MeshCodecError::Incomplete { .. }) => break,
                Err(e) => return End::Broken(e.to_string()),
            }
        }
        if n == 0 {
            return if buf.has_remaining() {
                End::Broken("the control stream ended inside a message".into())
            } else {
                // Finished: the peer retired this connection and has published every copy
                // this end wrote on it.
                End::PeerRetired
            };
        }
    }
}

/// Where a connection's writer puts its blocks of copies: its data stream (a recorder in the
/// unit tests).
trait BlockSink {
    /// Write one sealed block; false if the stream is gone.
    async fn write(&mut self, block: Bytes) -> bool;
    /// Finish the stream and wait until the peer has published all of it.
    async fn finish(self) -> End;
}

/// A mesh connection's data stream, with the signal that the peer has published all of it.
struct DataStream {
    send: quinn::SendStream,
    /// The peer finished its control stream: it has published this stream to its FIN.
    peer_published: watch::Receiver<bool>,
}

impl BlockSink for DataStream {
    async fn write(&mut self, block: Bytes) -> bool {
        self.send.write_chunk(block).await.is_ok()
    }

    async fn finish(mut self) -> End {
        // `stopped` resolves once the finished stream is acknowledged, i.e. received; the
        // peer's control FIN says published.
        let _ = self.send.finish();
        let _ = self.send.stopped().await;
        let _ = self.peer_published.wait_for(|done| *done).await;
        End::SentAll
    }
}

/// Write the copies queued for the peer on connection `id` while it owns the queue, until it is
/// retired or this node leaves: then finish the stream and wait until the peer has published
/// all of it ([`End::SentAll`]).
async fn write_copies(
    queue: &PeerQueue,
    id: ConnId,
    mut retire: watch::Receiver<bool>,
    mut leaving: watch::Receiver<bool>,
    compression: Compression,
    mut sink: impl BlockSink,
) -> End {
    let mut buf = BytesMut::new();
    // However this ends (retired and read, or the connection gone), the next owner may write
    // after it.
    let _let_go = LetGo(queue, id);
    // Since when this connection has owned the queue while another still was its writer.
    let mut waiting_since: Option<Instant> = None;
    loop {
        let notified = queue.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if *retire.borrow() {
            // Retired: what it wrote is all it writes. Finish, and wait until the peer has
            // published it all. Only then may the next owner write: its copies cannot overtake
            // these.
            return sink.finish().await;
        }
        // Leaving: what is queued is still written (below), then the same.
        let leaving_now = *leaving.borrow_and_update();
        if queue.may_write(id) {
            waiting_since = None;
            queue.take(&mut buf, DATA_WRITE, Instant::now());
        } else if queue.owned_by(id) {
            // The connection this one replaces has not let go: its last copies may still be on
            // their way. Bounded: it is closed after RETIRE_WAIT at the latest.
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= 2 * RETIRE_WAIT {
                warn!(conn = id.0, "the mesh connection replaced did not let go of its peer's copies: writing them on this one");
                queue.take_over(id);
                continue;
            }
        } else {
            // Not the owner (any more): nothing to wait for until it is made owner again.
            waiting_since = None;
        }
        if buf.is_empty() {
            // Leaving, an owner still waiting for the connection it replaces to let go (a
            // retired duplicate whose peer has not yet published all it wrote) does not finish
            // before it does: the copies queued meanwhile (the jobs that the members leaving at
            // shutdown hand over, say) are this connection's to write once it may.
            if leaving_now && waiting_since.is_none() {
                return sink.finish().await;
            }
            // A timer only while waiting for the other connection to let go.
            let patience = async {
                match waiting_since {
                    Some(since) => tokio::time::sleep_until((since + 2 * RETIRE_WAIT).into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = notified => {}
                // Either sender gone: the driver let go of the connection, which is closing.
                r = retire.changed() => if r.is_err() { return End::Gone; },
                r = leaving.changed() => if r.is_err() { return End::Gone; },
                _ = patience => {}
            }
            continue;
        }
        let records = buf.split().freeze();
        let raw = records.len() as u64;
        let block = seal_block(&records, compression);
        let len = block.len() as u64;
        if !sink.write(block).await {
            return End::Gone;
        }
        queue.bytes.fetch_add(len, Ordering::Relaxed);
        queue.raw_bytes.fetch_add(raw, Ordering::Relaxed);
    }
}

/// Sends [`Event::Closed`] for a connection when dropped unless disarmed: its task ended
/// without saying so (a panic).
struct ClosedOnDrop {
    events: mpsc::UnboundedSender<Event>,
    conn: Option<ConnId>,
}

impl ClosedOnDrop {
    /// The task reports its end itself.
    fn disarm(&mut self) {
        self.conn = None;
    }
}

impl Drop for ClosedOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            let _ = self.events.send(Event::Closed { conn });
        }
    }
}

/// One mesh connection, both ways: this node's control messages and copies on two
/// unidirectional streams of its own, the peer's read from the two it opens (control messages
/// to the driver, copies published here to the local plain subscribers), until either ends.
async fn serve_peer(link: PeerTask) {
    let PeerTask {
        conn,
        id,
        mut ctl,
        retire,
        leaving,
        queue,
        broker,
        mesh,
        compression,
        events,
        durable,
        block_timeout,
    } = link;
    // The driver hears that this connection is gone even if this task panics: it counts the
    // connections each peer has (MAX_CONNECTIONS_PER_PEER).
    let mut closed_on_drop = ClosedOnDrop {
        events: events.clone(),
        conn: Some(id),
    };
    // A retired connection is closed only once each end has *published* what the other wrote
    // on it: the QUIC acknowledgement of a stream's data and FIN only says it was received, and
    // closing then would cut off the copies the peer has not published yet. Each end says it is
    // done by finishing its control stream once it has published the peer's data stream to
    // its FIN (`published_all`); the other's FIN on that stream is `peer_published`.
    let (published_all, published_all_rx) = watch::channel(false);
    // This end's control FIN, which tells the peer that its copies are published here.
    let (fin, fin_rx) = watch::channel(Fin::NotYet);
    let (peer_published, peer_published_rx) = watch::channel(false);
    let control_out = async {
        let Ok(mut send) = conn.open_uni().await else {
            return End::Gone;
        };
        if send.write_all(&[CONTROL_STREAM]).await.is_err() {
            return End::Gone;
        }
        while let Some(bytes) = ctl.recv().await {
            if send.write_all(&bytes).await.is_err() {
                return End::Gone;
            }
        }
        // The driver let go of this connection (retired or closed): the data side decides.
        // Retired, it says when every copy the peer wrote on it has been published here. (The
        // watch's sender lives as long as this task: `wait_for` ends only with the signal.)
        let _ = published_all_rx.clone().wait_for(|done| *done).await;
        let _ = send.finish();
        fin.send_replace(Fin::Sent);
        // Received by the peer: only now may this end close (below).
        let _ = send.stopped().await;
        fin.send_replace(Fin::Received);
        std::future::pending::<End>().await
    };
    let data_out = async {
        let Ok(mut send) = conn.open_uni().await else {
            return End::Gone;
        };
        if send.write_all(&[DATA_STREAM]).await.is_err() {
            return End::Gone;
        }
        let stream = DataStream {
            send,
            peer_published: peer_published_rx.clone(),
        };
        write_copies(
            &queue,
            id,
            retire.clone(),
            leaving.clone(),
            compression,
            stream,
        )
        .await
    };
    let inbound = async {
        let mut streams = Vec::new();
        for _ in 0..2 {
            let Ok(mut recv) = conn.accept_uni().await else {
                return End::Gone;
            };
            let mut kind = [0u8];
            if recv.read_exact(&mut kind).await.is_err() {
                return End::Gone;
            }
            streams.push((kind[0], recv));
        }
        let mut control = None;
        let mut data = None;
        for (kind, recv) in streams {
            match kind {
                CONTROL_STREAM if control.is_none() => control = Some(recv),
                DATA_STREAM if data.is_none() => data = Some(recv),
                k => return End::Broken(format!("unexpected stream kind {k}")),
            }
        }
        let (Some(control), Some(data)) = (control, data) else {
            return End::Broken("a control and a data stream are needed".into());
        };
        // A stream's clean end is a signal, not the end of the connection: the reading goes
        // on until both have ended or something breaks.
        let control = async {
            match read_control(control, id, &events, CONTROL_BYTES_WAITING).await {
                End::PeerRetired => {
                    peer_published.send_replace(true);
                    std::future::pending().await
                }
                e => e,
            }
        };
        let data = async {
            match read_data(
                data,
                id,
                retire.clone(),
                &broker,
                &mesh,
                &queue,
                durable.as_deref(),
                block_timeout,
            )
            .await
            {
                End::PeerRetired => {
                    published_all.send_replace(true);
                    std::future::pending().await
                }
                e => e,
            }
        };
        tokio::select! {
            e = control => e,
            e = data => e,
        }
    };
    #[allow(clippy::too_many_arguments)]
    async fn read_data(
        mut recv: quinn::RecvStream,
        id: ConnId,
        mut retired: watch::Receiver<bool>,
        broker: &Broker,
        mesh: &MeshHandle,
        counters: &PeerQueue,
        durable: Option<&Durable>,
        block_timeout: Option<Duration>,
    ) -> End {
        let mut ctx = PublishContext::default();
        let mut routed = Vec::new();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        let _done = DoneReading(counters, id);
        let mut my_turn = false;
        loop {
            let Ok(n) = recv.read_buf(&mut buf).await else {
                return End::Gone;
            };
            counters
                .received_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
            if !my_turn && n > 0 {
                // The first copies on this connection: after the last of the one before.
                counters
                    .wait_turn_to_read(id, 2 * RETIRE_WAIT, &mut retired)
                    .await;
                my_turn = true;
            }
            loop {
                let payload = match next_block(&mut buf) {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(why) => {
                        mesh.refused_blocks.fetch_add(1, Ordering::Relaxed);
                        return End::Broken(why);
                    }
                };
                let copies = match records(payload) {
                    Ok(c) => c,
                    Err(why) => {
                        mesh.refused_blocks.fetch_add(1, Ordering::Relaxed);
                        return End::Broken(why);
                    }
                };
                counters
                    .received
                    .fetch_add(copies.len() as u64, Ordering::Relaxed);
                let now = Instant::now();
                // Without the log, a block's copies for plain subscribers only (no group, not
                // a dead letter) are published as one batch, as a client's PUBLISH_BATCH is:
                // one lookup and one subscriber lock per run of a topic.
                let plain_only = |(f, p): &(Forward, Publish)| {
                    f.plain && f.groups.is_empty() && p.ext.original_topic.is_none()
                };
                if durable.is_none() && copies.iter().all(plain_only) {
                    ctx.scope_only(true, &[]);
                    broker.publish_batch(
                        &mut ctx,
                        copies
                            .iter()
                            .map(|(_, p)| Publication::from_publish(p).with_remote_trace()),
                        now,
                        |_, _| {},
                    );
                    ctx.clear_scope();
                    wait_held(&mut ctx, broker, durable, block_timeout).await;
                    continue;
                }
                for (forward, p) in copies {
                    let info = dead_letter_of(&p);
                    // Its trace context names the sending node's `publish` span.
                    let mut publication = Publication::from_publish(&p).with_remote_trace();
                    if let Some(dl) = &info {
                        publication = publication.with_dead_letter(dl);
                    }
                    if let Some(made) = p.ext.attempt.filter(|_| !forward.groups.is_empty()) {
                        // Handed over: its attempts count on here.
                        publication = publication.with_attempts(made);
                    }
                    // Room in the log first: from the re-pick below to the sending of its
                    // copies nothing waits, so both see the same peers.
                    let room = match durable {
                        Some(d) => Some(d.wait_room(1).await),
                        None => None,
                    };
                    // Its plain part and the groups with a member here; groups whose member
                    // left are picked again among the nodes the copy has not been to (a copy
                    // without groups only goes to the plain subscribers here).
                    let (routing, queues) = if forward.groups.is_empty() {
                        (aqueduct_core::mesh::Routing::default(), None)
                    } else {
                        // A group here only if the broker still routes it (its member may have
                        // left since the table was made).
                        let (routing, queues) = mesh
                            .route_forwarded(&forward, |g| broker.has_group(&g.filter, &g.group));
                        (routing, Some(queues))
                    };
                    if !routing.unplaced.is_empty() {
                        // No member left on any node it has not been to: dropped, counted.
                        mesh.unplaced
                            .fetch_add(routing.unplaced.len() as u64, Ordering::Relaxed);
                    }
                    if forward.plain || !routing.local_groups.is_empty() {
                        ctx.scope_only(forward.plain, &routing.local_groups);
                        match durable {
                            None => {
                                broker.publish(&mut ctx, &publication, now);
                            }
                            Some(d) => {
                                // Logged with the offsets it gets here, in order with what
                                // this node's clients publish (under the log's order lock).
                                let _order = crate::durable::lock(&d.order);
                                if d.is_closed() || d.is_failing() {
                                    counters.not_stored.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    ctx.record_dead_letters();
                                    let one = std::iter::once(publication);
                                    broker.publish_batch(&mut ctx, one, now, |t, o| {
                                        routed.push((t.clone(), o))
                                    });
                                    d.queue_copies(
                                        routed.drain(..).zip(std::iter::once(publication)),
                                    );
                                    d.queue_dead_letters(ctx.take_dead_letters());
                                }
                            }
                        }
                        ctx.clear_scope();
                    }
                    drop(room);
                    if let Some(queues) = &queues {
                        // Into the queues the re-pick chose among.
                        let lost = mesh.send_copies_to(queues, &publication, &routing.forward);
                        mesh.discarded.fetch_add(lost as u64, Ordering::Relaxed);
                    }
                    // A held subscriber (block policy) holds the peer's copies too, as it
                    // holds a client's publishes: for at most `block_timeout`, then it is
                    // closed as a slow consumer, so that one stuck subscriber here cannot stop
                    // every copy from this peer.
                    wait_held(&mut ctx, broker, durable, block_timeout).await;
                }
            }
            if n == 0 {
                if !buf.is_empty() {
                    // Finished inside a block: its copies are lost, not silently dropped.
                    mesh.refused_blocks.fetch_add(1, Ordering::Relaxed);
                    return End::Broken(format!(
                        "the data stream ended inside a block ({} bytes of it)",
                        buf.len()
                    ));
                }
                // Only a retired connection's data stream is ever finished.
                return End::PeerRetired;
            }
        }
    }
    // A retired duplicate ends when both sides are done: this end's data stream read to its
    // end by the peer, and the peer's read here to its end (what it carries is delivered).
    // Neither writer nor reader is cut short for the other; bounded by RETIRE_WAIT.
    tokio::pin!(control_out, data_out, inbound);
    let (mut sent_all, mut peer_done, mut control_ended) = (false, false, false);
    let mut published_here = published_all_rx.clone();
    let mut retired = retire.clone();
    let retired_for_long = async move {
        if retired.wait_for(|r| *r).await.is_err() {
            return std::future::pending().await;
        }
        tokio::time::sleep(RETIRE_WAIT).await;
    };
    tokio::pin!(retired_for_long);
    let peer_retired_for_long = tokio::time::sleep(Duration::from_secs(u64::MAX >> 8));
    tokio::pin!(peer_retired_for_long);
    let end = loop {
        tokio::select! {
            e = &mut control_out => {
                control_ended = true;
                break e;
            }
            e = &mut data_out, if !sent_all => match e {
                // Leaving, the peer's part (its copies to this node) does not matter.
                End::SentAll if peer_done || *leaving.borrow() => break End::Gone,
                End::SentAll => sent_all = true,
                e => break e,
            },
            e = &mut inbound => break e,
            _ = published_here.wait_for(|done| *done), if !peer_done => {
                // The peer retired it (and everything it wrote is published here); this end
                // will too once its mesh sees the other connection of the pair (both keep the
                // same one).
                if sent_all {
                    break End::Gone;
                }
                peer_done = true;
                if !*retire.borrow() {
                    // If the driver holds it (both dialed at once, and the peer retired this
                    // one without a word on it), it retires it now rather than after its hold.
                    let _ = events.send(Event::PeerRetired { conn: id });
                }
                peer_retired_for_long
                    .as_mut()
                    .reset(tokio::time::Instant::now() + RETIRE_WAIT);
            }
            // Why it closed is looked at once the task ends (a read of a stream may see the
            // close first).
            _ = conn.closed() => break End::Gone,
            _ = &mut retired_for_long => {
                warn!(conn = id.0, "a retired mesh connection did not finish within {RETIRE_WAIT:?}: closed; copies on it may be lost");
                break End::Gone;
            }
            _ = &mut peer_retired_for_long => {
                if *retire.borrow() {
                    // Retired here meanwhile: `retired_for_long` judges it, with its own words.
                    peer_retired_for_long
                        .as_mut()
                        .reset(tokio::time::Instant::now() + Duration::from_secs(u64::MAX >> 8));
                    continue;
                }
                warn!(conn = id.0, "the peer retired a mesh connection this node kept: closed");
                break End::Gone;
            }
        }
    };
    if !control_ended && !matches!(end, End::Broken(_)) {
        // The control FIN that tells the peer its copies are published must reach it before
        // the close: a close discards what is not sent yet, and the close itself can be held
        // back (by lost path-MTU probes filling the congestion window), which left the peer
        // waiting for the FIN until its keep-alive drew a stateless reset. The control writer
        // may not have seen yet that everything is published here: one more turn for it to
        // finish the stream; then, if it did, a bounded wait for the FIN to be received. The
        // copies this end wrote need no more waiting: the next connection may write at once.
        let _ = futures_util::FutureExt::now_or_never(&mut control_out);
        if *fin_rx.borrow() == Fin::Sent {
            queue.let_go(id);
            let mut fin = fin_rx.clone();
            let _ = tokio::time::timeout(CLOSE_AFTER_FIN_WAIT, async {
                tokio::select! {
                    _ = fin.wait_for(|f| *f == Fin::Received) => {}
                    _ = &mut control_out => {}
                    _ = conn.closed() => {}
                }
            })
            .await;
        }
    }
    if *retire.borrow() {
        conn.close(0u32.into(), aqueduct_core::mesh::DUPLICATE.as_bytes());
    } else if *leaving.borrow() {
        conn.close(0u32.into(), SHUTTING_DOWN);
    }
    if let Some(why) = conn.close_reason().as_ref().and_then(note_peer_close) {
        let _ = events.send(Event::RefusedByPeer { conn: id, why });
    }
    closed_on_drop.disarm();
    let _ = events.send(match end {
        End::Gone | End::PeerRetired | End::SentAll => Event::Closed { conn: id },
        End::Broken(why) => Event::Broken { conn: id, why },
    });
}

/// What a refusal warning is about (see [`log_refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Refusal {
    /// The peer sent more interest than this node takes.
    ItsInterest,
    /// The peer did not take this node's interest.
    OurInterest,
    /// The peer opened too many connections.
    Connections,
    /// The peer closed a connection for a protocol error.
    Protocol,
}

/// Log a refusal (interest beyond the limit, either way; too many connections) of `kind`
/// involving `node` at `now`: as a warning if none of that kind was warned about for that node
/// in the last [`DIAL_WARN_EVERY`] (a node whose interest stays too large is refused at every
/// reconnect), otherwise at debug level. Only the last [`DIAL_WARN_EVERY`]'s warnings are kept:
/// nodes refused once long ago leave nothing behind. Returns whether it warned.
fn log_refusal(
    warned: &mut WarnEvery<(NodeId, Refusal)>,
    node: &NodeId,
    kind: Refusal,
    now: Instant,
    what: String,
) -> bool {
    match warned.due((node.clone(), kind), (), now) {
        Some(more) => {
            warned.forget_expired(now);
            warn!("{what}{}", held_back(more, "refusals"));
            true
        }
        None => {
            debug!("{what}");
            false
        }
    }
}

#[cfg(test)]
mod tests {

    /// Both nodes dial, both connections speak, and the one not kept may close before the kept
    /// one's first word: that word is no reconnect (it was counted as one, so a peer that was
    /// connected throughout showed a reconnect, and the revoked-peer test failed now and then).
    /// A connection made while none to the node is open is one.
    #[test]
    fn a_duplicate_that_speaks_after_its_twin_closed_is_no_reconnect() {
        // a and b are set up at once, neither spoken on: separate runs for now.
        let mut a = Run::new(ConnId(5), []);
        let mut b = Run::new(ConnId(6), [a]);
        assert_ne!(a.id, b.id);
        // The peer speaks on a (connected): b, still open, joins a's run.
        a.spoke = true;
        let mut seen = Spoken {
            count: 0,
            run: a.id,
        };
        b.join(a.id);
        // a closes; the peer speaks on b: a duplicate, no reconnect.
        b.spoke = true;
        assert_eq!(seen.heard(b.id), None, "b is a's duplicate");
        // c is set up while b (spoken on) is open: the same run, no reconnect either.
        let mut c = Run::new(ConnId(7), [b]);
        c.spoke = true;
        assert_eq!(seen.heard(c.id), None, "c replaced b");
        // c closes; d is set up with only an unspoken connection open (one the peer then
        // refuses): a run of its own, and its first word a reconnect.
        let refused = Run::new(ConnId(8), []);
        let d = Run::new(ConnId(9), [refused]);
        assert_eq!(seen.heard(d.id), Some(1));
        assert_eq!(seen.heard(d.id), None);
        // A restarted peer's new connection, set up while the old one lingered (so in its
        // run): counted when the old one is closed as the peer's previous incarnation.
        assert_eq!(seen.restarted(), 2);
        assert_eq!(
            seen.heard(d.id),
            None,
            "the new connection's run stays the same"
        );
        // A spoken connection keeps its run when another speaks on another run.
        let mut spoken = d;
        spoken.spoke = true;
        spoken.join(42);
        assert_eq!(spoken.id, d.id);
    }

    /// What is still queued for peers when the mesh stops is counted as discarded, and what
    /// comes after is refused (counted by whoever pushed it): copies re-routed while the node
    /// was leaving sat in queues whose writers had finished, and went unsaid.
    #[test]
    fn copies_left_in_queues_when_the_mesh_stops_are_counted() {
        let q = Arc::new(PeerQueue::new(16));
        assert!(q.push(Bytes::from_static(b"one"), None));
        assert!(q.push(Bytes::from_static(b"two"), None));
        let queues = HashMap::from([(NodeId::try_from("c").expect("id"), q.clone())]);
        let discarded = AtomicU64::new(3);
        assert_eq!(discard_all(&queues, &discarded), 2);
        assert_eq!(discarded.load(Ordering::Relaxed), 5);
        assert!(!q.push(Bytes::from_static(b"late"), None));
    }

    /// A link this node dials asks the peer for fewer ACKs as the broker's own connections do
    /// (`transport.ack_eliciting_threshold`, `transport.ack_delay`), and nothing at threshold 1;
    /// its datagrams start at `transport.initial_mtu` and do not grow.
    /// quinn keeps the settings private: its Debug output is the only view of them.
    #[test]
    fn dialled_links_ask_for_fewer_acks_as_configured() {
        let ms = Duration::from_millis(1);
        let asked = |threshold| DialTransport {
            ack_frequency: aqueduct_udp::ack_frequency(threshold, ms),
            initial_mtu: 1400,
        };
        let on = format!("{:?}", dial_transport(asked(9)));
        assert!(on.contains("ack_eliciting_threshold: 9"), "{on}");
        assert!(on.contains("initial_mtu: 1400"), "{on}");
        assert!(on.contains("initial_rtt: 50ms"), "{on}");
        assert!(on.contains("upper_bound: 1400"), "{on}");
        assert!(on.contains("datagram_receive_buffer_size: None"), "{on}");
        let off = format!("{:?}", dial_transport(asked(1)));
        assert!(off.contains("ack_frequency_config: None"), "{off}");
    }

    /// A peer's close for a protocol error is a refusal, as one for this node's interest: the
    /// next dial waits longer. Any other close is not.
    #[test]
    fn a_peer_s_close_for_a_protocol_error_is_a_refusal() {
        let closed = |reason: &str| {
            quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: 0u32.into(),
                reason: bytes::Bytes::copy_from_slice(reason.as_bytes()),
            })
        };
        assert_eq!(
            note_peer_close(&closed(PROTOCOL_ERROR)),
            Some(PeerRefusal::ProtocolError)
        );
        assert_eq!(
            note_peer_close(&closed(aqueduct_core::mesh::INTEREST_LIMIT)),
            Some(PeerRefusal::OurInterest)
        );
        assert_eq!(note_peer_close(&closed("broker shutting down")), None);
    }

    /// A refusal is warned about once a minute per node and kind, and what is kept is only the
    /// last minute's warnings: nodes refused once long ago leave nothing behind.
    #[test]
    fn refusals_are_warned_once_a_minute_and_forgotten_after() {
        let (a, b) = (
            NodeId::try_from("a").expect("node"),
            NodeId::try_from("b").expect("node"),
        );
        let t0 = Instant::now();
        let mut w = WarnEvery::new(DIAL_WARN_EVERY);
        let what = String::new;
        assert!(log_refusal(&mut w, &a, Refusal::ItsInterest, t0, what()));
        let soon = t0 + Duration::from_secs(5);
        assert!(!log_refusal(&mut w, &a, Refusal::ItsInterest, soon, what()));
        assert!(
            log_refusal(&mut w, &a, Refusal::Connections, t0, what()),
            "another kind"
        );
        let later = t0 + DIAL_WARN_EVERY + Duration::from_secs(1);
        assert!(log_refusal(&mut w, &b, Refusal::OurInterest, later, what()));
        assert_eq!(w.len(), 1, "a's warnings expired and are dropped");
        assert!(
            log_refusal(&mut w, &a, Refusal::ItsInterest, later, what()),
            "a again"
        );
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn own_addresses_are_this_hosts_ips_on_this_port() {
        let here: SocketAddr = "127.0.0.1:7441".parse().expect("addr");
        assert!(is_own_address(here, 7441));
        assert!(!is_own_address(here, 7442), "another port: another node");
        let elsewhere: SocketAddr = "192.0.2.1:7441".parse().expect("addr");
        assert!(!is_own_address(elsewhere, 7441), "not an IP of this host");
    }

    #[test]
    fn dial_failures_say_what_usually_causes_them() {
        let addr: SocketAddr = "127.0.0.1:7445".parse().expect("addr");
        let why = explain_dial_failure(addr, "timed out");
        assert!(
            why.contains("UDP 127.0.0.1:7445") && why.contains("cluster.peers"),
            "{why}"
        );
        let why = explain_dial_failure(
            addr,
            "the cryptographic handshake failed: error 42: invalid peer certificate: UnknownIssuer",
        );
        assert!(
            why.contains("cluster.tls.ca_file") && why.contains("same CA"),
            "{why}"
        );
        let why = explain_dial_failure(addr, "invalid peer certificate: BadSignature");
        assert!(why.contains("same CA"), "{why}");
        // A client certificate where a peer certificate belongs (rustls's words for it).
        let why = explain_dial_failure(
            addr,
            "error 43: invalid peer certificate: certificate does not allow extended key usage \
             for server authentication, allows client authentication",
        );
        assert!(why.contains("aqueduct cert peer NODE"), "{why}");
        assert_eq!(
            explain_dial_failure(addr, "something else"),
            "something else"
        );
    }
    use super::*;

    /// A copy's frame, as `send_copies` encodes it.
    fn forwarded_frame(p: &Publication<'_>) -> Bytes {
        let message = forwarded_message(p);
        let mut out = BytesMut::with_capacity(message.frame_len());
        message.encode_frame(&mut out, 0, true);
        out.freeze()
    }

    fn record() -> Vec<u8> {
        let topic = aqueduct_proto::TopicName::try_from("orders").expect("topic");
        let p = Publication::new(&topic, b"a body that repeats, a body that repeats");
        let frame = forwarded_frame(&p);
        let mut routing = Vec::new();
        encode_forward(
            &Forward {
                plain: true,
                groups: Vec::new(),
                visited: Vec::new(),
            },
            &mut routing,
        );
        let mut r = Vec::new();
        r.extend_from_slice(&(routing.len() as u16).to_le_bytes());
        r.extend_from_slice(&routing);
        r.extend_from_slice(&frame);
        r
    }

    #[test]
    fn copies_are_encoded_in_place_as_the_generic_encoder_would() {
        let topic = aqueduct_proto::TopicName::try_from("orders/eu").expect("topic");
        let original = aqueduct_proto::TopicName::try_from("orders").expect("topic");
        let trace = aqueduct_proto::TraceContext {
            trace_id: [3; 16],
            span_id: [4; 8],
            flags: 1,
        };
        let zstd = aqueduct_proto::Compression {
            algorithm: 1,
            uncompressed_len: 99,
        };
        let dl = aqueduct_proto::delivery::DeadLetter {
            original_topic: &original,
            original_offset: 7,
            attempts_made: 3,
            reason: "nacked",
        };
        let base = Publication::new(&topic, b"body");
        let mut cases = vec![base, base.with_attempts(2), base.with_dead_letter(&dl)];
        for priority in [0u8, 3] {
            for ttl in [
                None,
                Some(Duration::from_millis(1500)),
                Some(Duration::ZERO),
            ] {
                for (t, c) in [(None, None), (Some(&trace), Some(&zstd))] {
                    let mut p = base;
                    p.priority = aqueduct_proto::Priority::new(priority).expect("priority");
                    p.ttl = ttl;
                    p.trace = t;
                    p.compression = c;
                    cases.push(p);
                }
            }
        }
        for p in &cases {
            let mut direct = BytesMut::new();
            encode_forwarded(p, &mut direct);
            assert_eq!(direct.freeze(), forwarded_frame(p), "{p:?}");
        }
        // A run's records: one buffer, each record the plain routing and the frame.
        let records = plain_records(&cases[3..6]);
        assert_eq!(records.len(), 3);
        for ((record, ttl), p) in records.iter().zip(&cases[3..6]) {
            let skip = record.len() - forwarded_frame(p).len();
            assert_eq!(record[skip..], forwarded_frame(p)[..]);
            assert_eq!(ttl.map(|(_, ms)| ms), p.ttl.map(|t| t.as_millis() as u32));
        }
    }

    #[test]
    fn copies_from_routing_for_plain_subscribers_take_the_shared_path() {
        // What RouteTable::route_bytes returns for a peer with a plain filter: the copy names
        // this node as visited. (The shared path used to require no visited node, so routing's
        // own copies never took it.)
        let me = NodeId::try_from("node-0").expect("node id");
        let copy = Forward {
            plain: true,
            groups: Vec::new(),
            visited: vec![me],
        };
        let peer = NodeId::try_from("node-1").expect("node id");
        assert!(plain_only(&[(peer.clone(), copy.clone())]));
        let group = Forward {
            groups: vec![GroupKey {
                group: aqueduct_proto::GroupId::try_from("g").expect("group"),
                filter: aqueduct_proto::TopicFilter::try_from("t").expect("filter"),
            }],
            ..copy
        };
        assert!(!plain_only(&[(peer, group)]));
    }

    #[test]
    fn blocks_round_trip_compressed_or_not() {
        let records: Vec<u8> = (0..200).flat_map(|_| record()).collect();
        for compression in [
            Compression::None,
            Compression::Zstd {
                level: 3,
                threshold: 0,
            },
        ] {
            let block = seal_block(&records, compression);
            if matches!(compression, Compression::Zstd { .. }) {
                assert_eq!(block[0], ZSTD_BLOCK);
                assert!(block.len() * 5 < records.len(), "compresses");
            }
            let mut buf = BytesMut::from(&block[..]);
            let opened = next_block(&mut buf).expect("valid").expect("complete");
            assert!(buf.is_empty());
            let copies = records_of(opened);
            assert_eq!(copies, 200);
        }
    }

    /// A write of the largest size (`DATA_WRITE`) of one repeated record compresses past the
    /// ratio a receiver accepts: sent as it is, not refused as a bomb (which cut the link).
    #[test]
    fn a_highly_compressible_block_is_still_opened() {
        let one = record();
        let records: Vec<u8> = (0..DATA_WRITE / one.len())
            .flat_map(|_| one.clone())
            .collect();
        let block = seal_block(
            &records,
            Compression::Zstd {
                level: 3,
                threshold: 4096,
            },
        );
        let mut buf = BytesMut::from(&block[..]);
        let opened = next_block(&mut buf).expect("accepted").expect("complete");
        assert_eq!(records_of(opened), DATA_WRITE / one.len());
    }

    fn records_of(block: Bytes) -> usize {
        records(block).expect("records").len()
    }

    /// A record for `p` as `send_copies` queues it, with its TTL's place.
    fn queued(p: &Publication<'_>) -> (Bytes, Option<(usize, u32)>) {
        let frame = forwarded_frame(p);
        let ttl = ttl_value_at(&frame).map(|at| {
            let v = &frame[at..at + 4];
            (at, u32::from_le_bytes([v[0], v[1], v[2], v[3]]))
        });
        (frame, ttl)
    }

    fn ttl_of(frame: &[u8]) -> Option<u32> {
        let header = aqueduct_proto::frame::split_frame(frame, &aqueduct_proto::Limits::default())
            .expect("frame")
            .validate()
            .expect("header");
        match Frame::decode(&header, Bytes::copy_from_slice(&frame[HEADER_LEN..])) {
            Ok(Frame {
                message: Message::Publish(p),
                ..
            }) => p.ext.ttl_ms,
            other => panic!("not a PUBLISH: {other:?}"),
        }
    }

    /// A handle over a table in which `a` (this node) sees peers `b` and `c` with a member of
    /// group `w` on `jobs` each, and queues for the peers named in `with_queue` only.
    fn handle_with_peers(with_queue: &[&str]) -> (MeshHandle, HashMap<NodeId, Arc<PeerQueue>>) {
        handle_with(with_queue, false)
    }

    /// Node `a`, its peers `b` and `c` with a member of group `w` (of `jobs`) each, queues for
    /// the peers in `with_queue`, and with `local_member` one member of `w` on `a` too (as its
    /// table counts them).
    fn handle_with(
        with_queue: &[&str],
        local_member: bool,
    ) -> (MeshHandle, HashMap<NodeId, Arc<PeerQueue>>) {
        let g = GroupKey {
            filter: aqueduct_proto::TopicFilter::try_from("jobs").expect("filter"),
            group: aqueduct_proto::GroupId::try_from("w").expect("group"),
        };
        handle_wanting(Key::Group(g), with_queue, local_member)
    }

    /// Node `a` and its peers `b` and `c`, each wanting `key`; queues for the peers in
    /// `with_queue`; with `local` an interest in `key` on `a` too.
    fn handle_wanting(
        key: Key,
        with_queue: &[&str],
        local: bool,
    ) -> (MeshHandle, HashMap<NodeId, Arc<PeerQueue>>) {
        let node = |s: &str| NodeId::try_from(s).expect("node id");
        let mut mesh = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        if local {
            mesh.handle_local(key.clone(), 1);
        }
        for (conn, peer) in [(1, "b"), (2, "c")] {
            assert!(mesh.handle_connected(Instant::now(), ConnId(conn), node(peer), None, false));
            let mut interest = Interest::default();
            interest.apply(&aqueduct_core::mesh::Update {
                key: key.clone(),
                count: 1,
            });
            assert!(mesh.handle_control(
                ConnId(conn),
                Control::Snapshot {
                    session: 1,
                    seq: 0,
                    interest
                }
            ));
        }
        let queues: HashMap<NodeId, Arc<PeerQueue>> = with_queue
            .iter()
            .map(|n| (node(n), Arc::new(PeerQueue::new(64))))
            .collect();
        let (tx, _) = mpsc::unbounded_channel();
        let handle = MeshHandle {
            tx,
            table: Arc::new(ArcSwap::from_pointee(mesh.table())),
            queues: Arc::new(ArcSwap::from_pointee(queues.clone())),
            node: node("a"),
            refused_blocks: Arc::default(),
            handed_over: Arc::default(),
            leaves_unconfirmed: Arc::default(),
            retired: Arc::default(),
            discarded: Arc::default(),
            unplaced: Arc::default(),
            control_overflows: Arc::default(),
            interest_refused: Arc::default(),
            connections_refused: Arc::default(),
            refused_by_peer: Arc::default(),
            protocol_errors: Arc::default(),
            broker: std::sync::Weak::new(),
            peer_addrs: Arc::default(),
        };
        (handle, queues)
    }

    /// A PUBLISH_BATCH's copies for a peer the table still names but whose queue is gone (its
    /// connection just ended) are counted as discarded, as single publishes' are; they were
    /// dropped uncounted.
    #[test]
    fn batch_copies_for_a_peer_without_a_queue_are_counted() {
        let filter = aqueduct_proto::TopicFilter::try_from("t").expect("filter");
        let (handle, queues) = handle_wanting(Key::Plain(filter), &["b"], false);
        let t = aqueduct_proto::TopicName::try_from("t").expect("topic");
        let pubs: Vec<Publication<'_>> = (0..2).map(|_| Publication::new(&t, b"x")).collect();
        let mut locally = 0;
        handle.publish_batch(&mut PublishContext::default(), &pubs, |_, run| {
            locally += run.len()
        });
        assert_eq!(locally, 2);
        assert_eq!(queues[&NodeId::try_from("b").expect("id")].depth(), 2);
        assert_eq!(
            handle.discarded.load(Ordering::Relaxed),
            2,
            "c's two copies"
        );
    }

    #[test]
    fn a_hand_over_goes_to_a_peer_with_a_queue_when_the_table_names_one_without() {
        // The table still names c, whose connection ended (no queue): every orphan goes to b,
        // whatever c's turn in the round-robin. Before the fix, every other one picked c and
        // was dropped although b's member could take it.
        let (handle, queues) = handle_with_peers(&["b"]);
        let orphan = aqueduct_core::Orphan {
            group: GroupKey {
                filter: aqueduct_proto::TopicFilter::try_from("jobs").expect("filter"),
                group: aqueduct_proto::GroupId::try_from("w").expect("group"),
            },
            topic: aqueduct_proto::TopicName::try_from("jobs").expect("topic"),
            body: Bytes::from_static(b"job"),
            priority: aqueduct_proto::Priority::default(),
            ttl: None,
            trace: None,
            compression: None,
            attempts: 1,
        };
        for _ in 0..6 {
            assert!(handle.hand_over(&orphan), "b has a member and a queue");
        }
        let b = &queues[&NodeId::try_from("b").expect("node id")];
        assert_eq!(b.depth(), 6, "all six went to b");
        assert_eq!(handle.handed_over.load(Ordering::Relaxed), 6);
        assert_eq!(handle.discarded.load(Ordering::Relaxed), 0);
        // No peer with a queue: not handed over (the broker drops and counts it).
        let (none, _) = handle_with_peers(&[]);
        assert!(!none.hand_over(&orphan));
        // A forwarded copy whose member here left is re-picked the same way.
        let f = Forward {
            plain: false,
            groups: vec![orphan.group.clone()],
            visited: vec![NodeId::try_from("x").expect("node id")],
        };
        for _ in 0..4 {
            let (r, _) = handle.route_forwarded(&f, |_| false);
            assert_eq!(r.forward.len(), 1);
            assert_eq!(r.forward[0].0, NodeId::try_from("b").expect("node id"));
        }
    }

    /// The table still counts a member of `w` here, but it just left (the broker no longer
    /// routes the group; the table follows a moment later): a message published here goes to a
    /// peer's member. Before, the round-robin picked this node in its turn, the core found no
    /// route, and the message went nowhere.
    #[test]
    fn a_group_whose_last_member_here_just_left_is_picked_elsewhere() {
        let broker = Arc::new(Broker::new(aqueduct_core::BrokerConfig::default()));
        let (mut handle, queues) = handle_with(&["b", "c"], true);
        handle.broker = Arc::downgrade(&broker);
        let topic = aqueduct_proto::TopicName::try_from("jobs").expect("topic");
        let p = Publication::new(&topic, b"job");
        let mut ctx = PublishContext::default();
        for _ in 0..6 {
            handle.publish(&mut ctx, &p, |ctx| broker.publish(ctx, &p, Instant::now()));
        }
        let depth = |n: &str| queues[&NodeId::try_from(n).expect("node id")].depth();
        assert_eq!(
            depth("b") + depth("c"),
            6,
            "every message went to a peer's member"
        );
    }

    /// Whether the writers waiting on `notified` have been woken since it was enabled.
    /// A peer's control messages wait for the driver up to a bound in bytes: the reader stops
    /// there (the stream's flow control then holds the peer) until the driver has handled
    /// some. They queued without bound in the driver's channel.
    #[test]
    fn control_messages_waiting_for_the_driver_are_bounded() {
        use std::future::Future;
        let mut wire = Vec::new();
        for seq in 1..=5 {
            let delta = Control::Delta {
                session: 1,
                seq,
                updates: Vec::new(),
            };
            encode_control(&delta, &mut wire);
        }
        let one = wire.len() / 5;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reading = read_control(&wire[..], ConnId(1), &tx, 2 * one + 1);
        let mut reading = std::pin::pin!(reading);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut poll = |reading: std::pin::Pin<&mut _>| match Future::poll(reading, &mut cx) {
            std::task::Poll::Ready(end) => Some(end),
            std::task::Poll::Pending => None,
        };
        assert_eq!(poll(reading.as_mut()), None, "held after two");
        assert_eq!(rx.len(), 2);
        // The driver handles one: one more is read.
        let first = rx.try_recv().expect("an event");
        assert!(matches!(first, Event::Control { .. }));
        drop(first);
        assert_eq!(poll(reading.as_mut()), None);
        assert_eq!(rx.len(), 2);
        // The driver keeps up: all are read, to the stream's end.
        let mut seqs = Vec::new();
        let end = loop {
            while let Ok(Event::Control { control, .. }) = rx.try_recv() {
                let Control::Delta { seq, .. } = control else {
                    panic!("a delta")
                };
                seqs.push(seq);
            }
            if let Some(end) = poll(reading.as_mut()) {
                break end;
            }
        };
        assert_eq!(end, End::PeerRetired);
        while let Ok(Event::Control { control, .. }) = rx.try_recv() {
            let Control::Delta { seq, .. } = control else {
                panic!("a delta")
            };
            seqs.push(seq);
        }
        assert_eq!(seqs, vec![2, 3, 4, 5], "in order, none lost");
    }

    fn woken(notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) -> bool {
        use std::future::Future;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        notified.poll(&mut cx).is_ready()
    }

    /// A queue the driver discarded (its peer is gone) takes nothing more: a publisher that
    /// still held the old queue map pushed into it, and those copies were neither written nor
    /// counted (a handed-over job was reported handed over).
    #[test]
    fn a_discarded_queue_takes_nothing_more() {
        let q = PeerQueue::new(16);
        assert!(q.push(Bytes::from(record()), None));
        assert!(q.push_many(&[(Bytes::from(record()), None)]));
        assert_eq!(q.discard(), 2, "what it held");
        assert!(
            !q.push(Bytes::from(record()), None),
            "refused: counted by the caller"
        );
        assert!(!q.push_many(&[(Bytes::from(record()), None)]));
        assert_eq!(q.depth(), 0);
        assert_eq!(q.forwarded.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_new_owner_writes_only_once_the_connection_it_replaces_lets_go() {
        let (a, b, c) = (ConnId(1), ConnId(2), ConnId(3));
        let q = PeerQueue::new(16);
        assert!(!q.may_write(a), "not the owner yet");
        q.set_owner(a);
        assert!(q.may_write(a), "the first owner writes at once");
        // b replaces a (a duplicate, or a reconnection) while a's copies may be on their way.
        q.set_owner(b);
        assert!(!q.may_write(a), "a takes nothing more");
        assert!(!q.may_write(b), "b waits for a to let go");
        let mut notified = std::pin::pin!(q.notify.notified());
        notified.as_mut().enable();
        // a's writer ends (retired and read to the end, or gone): it lets go.
        drop(LetGo(&q, a));
        assert!(woken(notified.as_mut()), "b's writer is woken");
        assert!(q.may_write(b), "and writes");
        q.let_go(a);
        assert!(q.may_write(b), "a late let-go of a does not take b's turn");
        // c replaces b, which never lets go: after waiting, c takes over; b's late let-go then
        // changes nothing.
        q.set_owner(c);
        assert!(!q.may_write(c));
        q.take_over(c);
        assert!(q.may_write(c));
        q.let_go(b);
        assert!(q.may_write(c));
        assert!(!q.may_write(b));
        // A connection that is not the owner cannot take over.
        q.take_over(a);
        assert!(q.may_write(c));
    }

    /// What a connection's writer wrote (its blocks' bytes) and whether it finished.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<(BytesMut, bool)>>);

    impl BlockSink for Recorder {
        async fn write(&mut self, block: Bytes) -> bool {
            self.0.lock().expect("recorder").0.extend_from_slice(&block);
            true
        }

        async fn finish(self) -> End {
            self.0.lock().expect("recorder").1 = true;
            End::SentAll
        }
    }

    impl Recorder {
        /// Copies written so far, and whether the stream was finished.
        fn written(&self) -> (usize, bool) {
            let guard = self.0.lock().expect("recorder");
            let mut copies = 0;
            let mut buf = guard.0.clone();
            while let Some(block) = next_block(&mut buf).expect("valid blocks") {
                copies += records_of(block);
            }
            assert!(buf.is_empty(), "whole blocks only");
            (copies, guard.1)
        }
    }

    /// A node leaving while the connection that owns a peer's queue still waits for a retired
    /// duplicate to let go: the copies queued meanwhile (the jobs its members handed over as
    /// they left) are written once the duplicate lets go, and only then is the stream finished.
    /// (The writer finished at once, leaving them queued, and they were lost with the node.)
    #[tokio::test]
    async fn a_leaving_owner_writes_what_is_queued_once_the_duplicate_lets_go() {
        let (retired, kept) = (ConnId(1), ConnId(2));
        let q = PeerQueue::new(16);
        q.set_owner(retired);
        assert!(q.may_write(retired), "the duplicate wrote copies");
        q.set_owner(kept);
        let (_retire, not_retired) = watch::channel(false);
        let (leave, leaving) = watch::channel(false);
        let sink = Recorder::default();
        let writer = write_copies(
            &q,
            kept,
            not_retired,
            leaving,
            Compression::None,
            sink.clone(),
        );
        tokio::pin!(writer);
        let copies = 3;
        for _ in 0..copies {
            assert!(q.push(Bytes::from(record()), None));
        }
        leave.send_replace(true);
        assert!(
            futures_util::FutureExt::now_or_never(&mut writer).is_none(),
            "the writer waits for the duplicate, not finishing without the copies"
        );
        assert_eq!(sink.written(), (0, false));
        q.let_go(retired);
        let end = tokio::time::timeout(Duration::from_secs(10), &mut writer)
            .await
            .expect("the writer ends once it has written the queue");
        assert_eq!(end, End::SentAll);
        assert_eq!(
            sink.written(),
            (copies, true),
            "every copy written, then finished"
        );
        assert_eq!(q.depth(), 0);
    }

    /// Leaving, a connection that does not own the queue finishes at once; the owner once it
    /// has written what is queued.
    #[tokio::test]
    async fn a_leaving_writer_finishes_once_it_has_written_its_share() {
        let (owner, other) = (ConnId(1), ConnId(2));
        let q = PeerQueue::new(16);
        q.set_owner(owner);
        assert!(q.push(Bytes::from(record()), None));
        for (conn, copies) in [(other, 0), (owner, 1)] {
            let (_retire, not_retired) = watch::channel(false);
            let (_leave, leaving) = watch::channel(true);
            let sink = Recorder::default();
            let end = tokio::time::timeout(
                Duration::from_secs(10),
                write_copies(
                    &q,
                    conn,
                    not_retired,
                    leaving,
                    Compression::None,
                    sink.clone(),
                ),
            )
            .await
            .expect("finishes");
            assert_eq!(end, End::SentAll);
            assert_eq!(sink.written(), (copies, true), "conn {}", conn.0);
        }
    }

    /// The receiving side: a new connection's copies wait until the one that carried copies
    /// before it has published its last (received is not yet published); a stuck one is
    /// waited for only as long as the patience given, and not at all by a retired connection.
    #[tokio::test]
    async fn a_new_connection_s_copies_wait_for_the_old_one_s_to_be_published() {
        let (a, b, c) = (ConnId(1), ConnId(2), ConnId(3));
        let q = PeerQueue::new(16);
        let patience = Duration::from_secs(60);
        // Whether `turn` is still waiting after a moment (it is polled meanwhile).
        async fn waits(turn: std::pin::Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
            tokio::time::timeout(Duration::from_millis(50), turn)
                .await
                .is_err()
        }
        let (retire_c, mut kept) = watch::channel(false);
        q.wait_turn_to_read(a, patience, &mut kept).await;
        q.wait_turn_to_read(a, patience, &mut kept).await; // its own turn again: at once
        let mut kept_b = kept.clone();
        let b_reads = q.wait_turn_to_read(b, patience, &mut kept_b);
        tokio::pin!(b_reads);
        assert!(
            waits(b_reads.as_mut()).await,
            "b waits while a still publishes"
        );
        // a's reader ends (read to its FIN, or its connection gone).
        drop(DoneReading(&q, a));
        tokio::time::timeout(Duration::from_secs(10), b_reads)
            .await
            .expect("b's turn once a is done");
        q.done_reading(a); // a late end of a does not end b's turn
        assert_eq!(q.reader.load(Ordering::Acquire), b.0);
        // b never finishes: d waits its patience, then publishes anyway.
        let d = ConnId(4);
        let short = Duration::from_millis(100);
        let started = std::time::Instant::now();
        q.wait_turn_to_read(d, short, &mut kept.clone()).await;
        assert!(started.elapsed() >= short);
        assert_eq!(q.reader.load(Ordering::Acquire), d.0);
        q.done_reading(b);
        assert_eq!(
            q.reader.load(Ordering::Acquire),
            d.0,
            "b's late end changes nothing"
        );
        // A connection retired while it waits reads on at once (its time is short; the one it
        // waits for is the one kept, or dead), without taking the turn.
        let mut retired_c = retire_c.subscribe();
        let c_reads = q.wait_turn_to_read(c, patience, &mut retired_c);
        tokio::pin!(c_reads);
        assert!(waits(c_reads.as_mut()).await, "c waits while d publishes");
        retire_c.send_replace(true);
        tokio::time::timeout(Duration::from_secs(10), c_reads)
            .await
            .expect("c reads once retired");
        assert_eq!(q.reader.load(Ordering::Acquire), d.0);
    }

    #[test]
    fn a_copy_s_ttl_loses_the_time_it_waited_in_the_queue() {
        let topic = aqueduct_proto::TopicName::try_from("orders").expect("topic");
        let mut p = Publication::new(&topic, b"body");
        p.ttl = Some(Duration::from_millis(5_000));
        p.priority = aqueduct_proto::Priority::new(0).expect("priority");
        let (record, ttl) = queued(&p);
        assert_eq!(
            ttl.map(|t| t.1),
            Some(5_000),
            "the TTL is found in the frame"
        );
        let q = PeerQueue::new(16);
        assert!(q.push(record.clone(), ttl));
        assert!(q.push(record.clone(), ttl));
        let queued_at = |i: usize| q.queue.lock().expect("lock").0[i].ttl.expect("ttl").queued;
        let (t0, t1) = (queued_at(0), queued_at(1));
        // Taken 1.2 s after it was queued: 3.8 s left, the rest of the frame unchanged.
        let mut out = BytesMut::new();
        q.take(&mut out, record.len(), t0 + Duration::from_millis(1_200));
        assert_eq!(out.len(), record.len(), "one record within the budget");
        assert_eq!(ttl_of(&out), Some(3_800));
        // Taken after its TTL ran out: dropped and counted.
        let mut out = BytesMut::new();
        q.take(&mut out, usize::MAX, t1 + Duration::from_millis(5_000));
        assert!(out.is_empty());
        assert_eq!(q.expired.load(Ordering::Relaxed), 1);
        assert_eq!(q.depth(), 0);
        // Without a TTL nothing is looked for or changed.
        let (plain, none) = queued(&Publication::new(&topic, b"body"));
        assert_eq!(none, None);
        assert!(q.push(plain.clone(), none));
        let mut out = BytesMut::new();
        q.take(&mut out, usize::MAX, t0 + Duration::from_secs(3_600));
        assert_eq!(&out[..], &plain[..]);
    }

    #[test]
    fn a_compressed_bomb_or_a_lie_is_refused() {
        // A block claiming 1 GiB uncompressed.
        let data: Vec<u8> = (0..50_000)
            .flat_map(|i| format!("message {i}\n").into_bytes())
            .collect();
        let packed = aqueduct_proto::compress::compress(&data, 3)
            .expect("compresses")
            .1;
        let mut buf = BytesMut::new();
        buf.put_u8(ZSTD_BLOCK);
        buf.put_u32_le(packed.len() as u32 + 4);
        buf.put_u32_le(1 << 30);
        buf.extend_from_slice(&packed);
        let e = next_block(&mut buf).expect_err("a bomb");
        assert!(e.contains("refused"), "{e}");
        // A block longer than the limit is refused before it is read.
        let mut buf = BytesMut::new();
        buf.put_u8(PLAIN_BLOCK);
        buf.put_u32_le(MAX_BLOCK as u32 + 1);
        assert!(next_block(&mut buf).is_err());
        // Garbage records.
        assert!(records(Bytes::from_static(&[5, 0, 1, 2])).is_err());
    }
}
