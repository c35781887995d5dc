//! The cluster mesh's decisions, without sockets: which peers to dial and when, which of two
//! connections between the same pair to keep, what each peer wants (its *interest*), and where a
//! message goes. The server feeds it events (a peer set from config or DNS, connections made and
//! lost, control messages received, local subscriptions changing, the clock) and carries out
//! what it returns ([`Output`]); `tests/mesh_sim.rs` drives several nodes through joins, leaves,
//! restarts, reorderings and partitions over an in-memory network.
//!
//! ## Interest
//! Each node tells every peer what it wants: plain filters, and consumer groups (a group is its
//! filter and id, as in the core) with how many members it has there. It sends a full snapshot
//! when a connection starts, then updates, each the absolute count of one key (idempotent). A
//! connection's messages arrive in order (one QUIC stream); each new connection starts a new
//! *session* with a higher number, so anything late from an older one is ignored.
//!
//! ## Forwarding, and why there are no loops or duplicates
//! A message published on node N is forwarded by N only, to each peer at most once, as one copy
//! that says what it is for: `plain` (the peer has a plain filter matching the topic) and the
//! groups N picked that peer for. The receiver delivers it to its local subscribers only and
//! never forwards it again (the MeshForwarded bit), so a message crosses at most one hop and no
//! subscriber sees it twice. The one exception is a group re-pick: if the member a copy was
//! sent for is gone when it arrives, the receiver picks again among the nodes the copy has not
//! been to yet (the copy carries that list) — a chain that visits each node at most once.
//!
//! ## Groups, cluster-wide
//! For each group matching the topic, N counts its members across the cluster (its own and each
//! peer's, as advertised) and takes the next one round-robin (one counter per group on N); the
//! copy goes to the node where that member is connected, which gives it to one of its members.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_proto::{GroupId, TopicFilter, TopicName};
use bytes::Bytes;

use foldhash::fast::RandomState;

use crate::index::SubscriptionIndex;

/// A node's name in the mesh: the Common Name of its peer certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(String);

impl NodeId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for NodeId {
    type Error = String;
    fn try_from(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s.len() > 255 {
            return Err(format!("node id {s:?} must be 1 to 255 bytes"));
        }
        Ok(NodeId(s.to_string()))
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A consumer group: its filter and id (as the core keys groups).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    pub filter: TopicFilter,
    pub group: GroupId,
}

/// One interest key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// Plain subscriptions to a filter.
    Plain(TopicFilter),
    /// Members of a group.
    Group(GroupKey),
}

/// The absolute count of one key (0: gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub key: Key,
    pub count: u32,
}

/// What one node wants.
///
/// The keys are held as routing asks for them, on every publish, which peers want the topic:
/// filters without a wildcard (most subscriptions) by their bytes, looked up, and those with one
/// in a trie of levels (the broker's own [`SubscriptionIndex`]), walked along the paths that can
/// match the topic. So neither a peer's many exact subscriptions nor its many wildcard ones cost
/// a publish a match test each.
#[derive(Clone, Default)]
pub struct Interest {
    // Each part is shared by the clones: every routing snapshot holds a clone of every node's
    // interest, made after each change, so a clone costs four reference counts, and a change
    // copies only the part it changes, and only if a snapshot still shares it.
    /// Plain filters without a wildcard, by their bytes (the filter's own buffer), with their
    /// counts.
    exact_plain: Arc<HashMap<Bytes, (TopicFilter, u32), RandomState>>,
    /// Groups whose filter has no wildcard, by the filter's bytes, with their counts.
    exact_groups: Arc<HashMap<Bytes, BTreeMap<GroupKey, u32>, RandomState>>,
    /// Plain filters with a wildcard, with their counts (one entry per filter).
    wild_plain: Arc<SubscriptionIndex<(TopicFilter, u32)>>,
    /// Groups whose filter has a wildcard, with their counts (one entry per group).
    wild_groups: Arc<SubscriptionIndex<(GroupKey, u32)>>,
    /// Keys in all four (asked at every update, to hold a peer to its limit).
    len: usize,
}

/// A node's groups as an [`Interest`] held them at one moment. Two are [`same`](Self::same)
/// only if they are the very same parts, so unchanged in between (a change copies a part that
/// is held, see [`Interest`]); holding them keeps that test sound.
#[derive(Debug, Clone)]
struct GroupsHeld(
    Arc<HashMap<Bytes, BTreeMap<GroupKey, u32>, RandomState>>,
    Arc<SubscriptionIndex<(GroupKey, u32)>>,
);

impl GroupsHeld {
    fn same(&self, other: &GroupsHeld) -> bool {
        Arc::ptr_eq(&self.0, &other.0) && Arc::ptr_eq(&self.1, &other.1)
    }
}

/// Equal when they hold the same keys with the same counts, however they got there (the
/// tries' entry order may differ).
impl PartialEq for Interest {
    fn eq(&self, other: &Interest) -> bool {
        self.len == other.len && self.updates() == other.updates()
    }
}

impl Eq for Interest {}

impl fmt::Debug for Interest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.updates().into_iter().map(|u| (u.key, u.count)))
            .finish()
    }
}

/// Set the count of the entry `item` under `filter` in `index` (0 removes it); `present`:
/// whether it has one now.
fn set_wild<V: PartialEq + Clone>(
    index: &mut SubscriptionIndex<(V, u32)>,
    filter: &TopicFilter,
    item: &V,
    count: u32,
    present: bool,
) {
    if count == 0 {
        index.remove_where(filter, |(v, _)| v == item);
    } else if !present {
        index.insert(filter, (item.clone(), count));
    } else if let Some(entry) = index
        .entries_mut(filter)
        .and_then(|list| list.iter_mut().find(|(v, _)| v == item))
    {
        entry.1 = count;
    }
}

/// The count of the entry `item` under `filter` in `index`.
fn count_wild<V: PartialEq>(
    index: &SubscriptionIndex<(V, u32)>,
    filter: &TopicFilter,
    item: &V,
) -> Option<u32> {
    index
        .entries(filter)
        .iter()
        .find(|(v, _)| v == item)
        .map(|(_, n)| *n)
}

impl Interest {
    /// Set one key's count.
    pub fn apply(&mut self, u: &Update) {
        let (key, count) = (&u.key, u.count);
        let before = self.count(key);
        if before == count {
            return; // no change: the parts stay shared
        }
        let present = before != 0;
        match key {
            Key::Plain(f) if f.is_wildcard() => {
                set_wild(Arc::make_mut(&mut self.wild_plain), f, f, count, present)
            }
            Key::Group(g) if g.filter.is_wildcard() => set_wild(
                Arc::make_mut(&mut self.wild_groups),
                &g.filter,
                g,
                count,
                present,
            ),
            Key::Plain(f) => {
                let exact = Arc::make_mut(&mut self.exact_plain);
                if count == 0 {
                    exact.remove(f.as_bytes());
                } else {
                    exact.insert(f.to_bytes(), (f.clone(), count));
                }
            }
            Key::Group(g) => {
                let exact = Arc::make_mut(&mut self.exact_groups);
                if count > 0 {
                    exact
                        .entry(g.filter.to_bytes())
                        .or_default()
                        .insert(g.clone(), count);
                } else if let Some(groups) = exact.get_mut(g.filter.as_bytes()) {
                    groups.remove(g);
                    if groups.is_empty() {
                        exact.remove(g.filter.as_bytes());
                    }
                }
            }
        }
        match (present, count) {
            (true, 0) => self.len -= 1,
            (false, _) => self.len += 1,
            _ => {}
        }
    }

    /// The member count of group `g` (0 if absent).
    pub fn count_group(&self, g: &GroupKey) -> u32 {
        if g.filter.is_wildcard() {
            count_wild(&self.wild_groups, &g.filter, g)
        } else {
            self.exact_groups
                .get(g.filter.as_bytes())
                .and_then(|groups| groups.get(g).copied())
        }
        .unwrap_or(0)
    }

    /// The count of `key` (0 if absent).
    pub fn count(&self, key: &Key) -> u32 {
        match key {
            Key::Plain(f) if f.is_wildcard() => count_wild(&self.wild_plain, f, f).unwrap_or(0),
            Key::Plain(f) => self.exact_plain.get(f.as_bytes()).map_or(0, |(_, n)| *n),
            Key::Group(g) => self.count_group(g),
        }
    }

    /// Add `delta` (±) to a key's count; returns the update to send.
    pub fn add(&mut self, key: Key, delta: i64) -> Update {
        let count = (i64::from(self.count(&key)) + delta).clamp(0, i64::from(u32::MAX)) as u32;
        let u = Update { key, count };
        self.apply(&u);
        u
    }

    /// Does a plain filter match `topic` (a valid topic name's bytes)? No allocation.
    ///
    /// A plain `#` wants system topics too (`$…`, `__…`, dead letters among them), which a
    /// leading wildcard matches for no subscriber: a node advertises `#` when its durable log
    /// wants every message published anywhere, and its own subscribers' matching filters out
    /// what they do not want.
    pub fn wants_plain_bytes(&self, topic: &[u8]) -> bool {
        self.exact_plain.contains_key(topic)
            || self.wild_plain.has_match_bytes(topic)
            || (crate::matching::is_system(topic) && self.wants_everything())
    }

    /// Whether plain `#` has a count.
    fn wants_everything(&self) -> bool {
        static EVERYTHING: std::sync::OnceLock<Option<TopicFilter>> = std::sync::OnceLock::new();
        EVERYTHING
            .get_or_init(|| TopicFilter::try_from("#").ok())
            .as_ref()
            .and_then(|all| count_wild(&self.wild_plain, all, all))
            .is_some_and(|n| n > 0)
    }

    /// Does a group's filter match `topic` (a valid topic name's bytes)?
    pub fn has_group_for(&self, topic: &[u8]) -> bool {
        self.exact_groups.contains_key(topic) || self.wild_groups.has_match_bytes(topic)
    }

    /// Call `f` for each group whose filter matches `topic` (a valid topic name's bytes), with
    /// its member count here. No allocation.
    pub fn for_each_group_for<'a>(&'a self, topic: &[u8], mut f: impl FnMut(&'a GroupKey, u32)) {
        if let Some(groups) = self.exact_groups.get(topic) {
            groups.iter().for_each(|(g, n)| f(g, *n));
        }
        self.wild_groups
            .for_each_match_bytes(topic, |(g, n)| f(g, *n));
    }

    /// Keys with a count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No key has a count.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its groups as held now (see [`GroupsHeld`]).
    fn groups_held(&self) -> GroupsHeld {
        GroupsHeld(
            Arc::clone(&self.exact_groups),
            Arc::clone(&self.wild_groups),
        )
    }

    /// The groups with a count, in no particular order.
    pub fn groups(&self) -> Vec<&GroupKey> {
        let mut all: Vec<&GroupKey> = self
            .exact_groups
            .values()
            .flat_map(BTreeMap::keys)
            .collect();
        self.wild_groups.for_each(|(g, _)| all.push(g));
        all
    }

    /// Every key and count, in key order.
    pub fn updates(&self) -> Vec<Update> {
        let mut all: Vec<Update> = Vec::with_capacity(self.len);
        let mut push = |key: Key, count: u32| all.push(Update { key, count });
        for (f, n) in self.exact_plain.values() {
            push(Key::Plain(f.clone()), *n);
        }
        for (g, n) in self.exact_groups.values().flatten() {
            push(Key::Group(g.clone()), *n);
        }
        self.wild_plain
            .for_each(|(f, n)| push(Key::Plain(f.clone()), *n));
        self.wild_groups
            .for_each(|(g, n)| push(Key::Group(g.clone()), *n));
        all.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        all
    }
}

/// Control messages between two nodes (one ordered stream per connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Everything the sender wants; starts a session.
    Snapshot {
        session: u64,
        seq: u64,
        interest: Interest,
    },
    /// More of the snapshot with the same session and seq (a snapshot too large for one
    /// message is sent as a `Snapshot` and parts): its entries add to it.
    SnapshotPart {
        session: u64,
        seq: u64,
        updates: Vec<Update>,
    },
    /// Changes since the previous message of the session.
    Delta {
        session: u64,
        seq: u64,
        updates: Vec<Update>,
    },
    /// The sender is shutting down: it writes no more copies on this connection (it finishes
    /// its data stream once the copies still queued are written) and wants to hear when the
    /// receiver has published them all (the receiver's control FIN). The receiver forgets the
    /// sender's interest at once. Acted on by the transport (which lets go of the connection
    /// without closing it and calls [`Mesh::handle_disconnected`]), not by [`Mesh::handle_control`].
    Leaving,
}

/// Entries in one control message at most: an entry takes at most 517 bytes (two 255-byte
/// names), so a message stays well under the codec's 16 MiB limit.
pub const ENTRIES_PER_MESSAGE: usize = 16_384;

/// The reason of an [`Output::Close`] for the connection of a pair that is not kept (both ends
/// dialed): the transport retires it gracefully (finishes its data stream and reads the peer's
/// to the end before closing), so no copy already written on it is lost.
pub const DUPLICATE: &str = "duplicate mesh connection";

/// The reason of an [`Output::Close`] for a connection whose peer's interest grew beyond
/// [`MeshConfig::max_peer_interest`]. Its interest is forgotten with the connection; a
/// reconnect starts a fresh session (and is closed again if the interest is still too large).
pub const INTEREST_LIMIT: &str = "the peer's interest is larger than cluster.max_peer_interest";

/// The close reason of a connection whose control stream broke the mesh protocol (an
/// undecodable message, one out of order). Both ends then redial with a growing wait, as after
/// a refusal for interest ([`Mesh::handle_broken`], [`Mesh::handle_refused_by_peer`]): a fault
/// that persists (two versions that do not understand each other) is not met several times a
/// second.
pub const PROTOCOL_ERROR: &str = "mesh protocol error";

/// The failed connections in a row a refusal for interest counts as at least (see
/// `Mesh::note_refusal`): the next dial then waits up to `backoff_min * 2^2`.
const REFUSED_ATTEMPTS: u32 = 2;

/// The reason of an [`Output::Close`] for a connection whose peer has started again since
/// (a restart within the idle timeout): nothing will come on it, so it is not retired.
pub const RESTARTED: &str = "the peer restarted";

/// A session number is the sender's run (its start time in ms) times 2^`RUN_SHIFT`, plus the
/// connections of that run before: `session >> RUN_SHIFT` tells a restarted peer.
pub const RUN_SHIFT: u32 = 20;

/// How long a connection that lost the duplicate rule to a connection that has worked is held
/// for its first control message, which says whether the peer restarted (then the new one is
/// kept); after that it is retired.
pub const HOLD_WAIT: Duration = Duration::from_secs(5);

/// A connection, as the transport numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// What the transport must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Open a mesh connection to this address.
    Dial(SocketAddr),
    /// Close this connection.
    Close { conn: ConnId, reason: &'static str },
    /// Send on this connection's control stream.
    Send { conn: ConnId, control: Control },
}

/// Nodes a group copy may list as it arrives and still be sent back to one of them when its
/// member there left (see [`RouteTable::route_forwarded_where`]): so many hops at most.
pub const MAX_VISITS: usize = 8;

/// What a copy of a message forwarded to a peer is for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Forward {
    /// Deliver to the peer's plain subscribers.
    pub plain: bool,
    /// Give it to one member of each of these groups there.
    pub groups: Vec<GroupKey>,
    /// Nodes this copy has been to (a group re-pick skips them).
    pub visited: Vec<NodeId>,
}

impl Forward {
    /// A copy for the plain subscribers only.
    pub fn plain() -> Forward {
        Forward {
            plain: true,
            groups: Vec::new(),
            visited: Vec::new(),
        }
    }
}

/// Where a message goes from this node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Routing {
    /// Groups whose picked member is connected here.
    pub local_groups: Vec<GroupKey>,
    /// One copy per peer, at most.
    pub forward: Vec<(NodeId, Forward)>,
    /// Groups with no member anywhere reachable (the message is dropped for them, counted).
    pub unplaced: Vec<GroupKey>,
}

/// Timing of reconnects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshConfig {
    /// Backoff bounds: the n-th retry waits a random time in `[0, min(max, min * 2^n)]`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Interest keys (distinct topic filters and group keys) a peer may hold here
    /// (`cluster.max_peer_interest`): the interest in force, and a snapshot in progress, each at
    /// most this many. A peer that goes beyond is closed with [`INTEREST_LIMIT`]: each key costs
    /// memory here and a match test on every local publish.
    pub max_peer_interest: usize,
}

/// The default of [`MeshConfig::max_peer_interest`] (`cluster.max_peer_interest`).
pub const DEFAULT_MAX_PEER_INTEREST: usize = 1 << 20;

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            backoff_min: Duration::from_millis(250),
            backoff_max: Duration::from_secs(30),
            max_peer_interest: DEFAULT_MAX_PEER_INTEREST,
        }
    }
}

#[derive(Debug)]
struct Target {
    /// Connections in a row that failed: dials that failed, and connections that ended before
    /// the peer spoke or that were closed for interest beyond the limit. Each doubles the
    /// longest wait before the next dial.
    attempts: u32,
    /// When to dial next (`None`: dialing now, or connected).
    next_dial: Option<Instant>,
    /// The node reached at this address, while connected.
    node: Option<NodeId>,
}

#[derive(Debug)]
struct Peer {
    conn: ConnId,
    /// This node dialed the connection.
    outbound: bool,
    addr: Option<SocketAddr>,
    /// The session this node sends on.
    out_session: u64,
    /// What the peer sent last: its session and sequence number.
    in_session: Option<(u64, u64)>,
    interest: Interest,
    /// Parts of a snapshot still to come (session, seq, entries so far): the interest in force
    /// is swapped for it whole when its snapshot arrives.
    pending: Option<(u64, u64, Interest)>,
    /// The connection was closed for interest beyond the limit, by this node or by the peer
    /// ([`INTEREST_LIMIT`]): what still comes on it is ignored, and its end does not count as
    /// a connection that worked.
    refused: bool,
    /// The peer sent a control message on it: when it ends (not refused), the connection
    /// worked, and the next dial waits at most `backoff_min`.
    spoke: bool,
}

/// A connection that lost the duplicate rule, held until its first control message says whether
/// the peer restarted (see [`HOLD_WAIT`]).
#[derive(Debug)]
struct Held {
    node: NodeId,
    outbound: bool,
    addr: Option<SocketAddr>,
    /// The session this node opened on it, and the sequence number its snapshot was at (held
    /// connections get no deltas).
    out_session: u64,
    seq: u64,
    until: Instant,
}

/// One node's view of the mesh.
#[derive(Debug)]
pub struct Mesh {
    me: NodeId,
    config: MeshConfig,
    local: Interest,
    out_seq: u64,
    next_session: u64,
    /// Addresses to stay connected to (config or DNS), minus this node's own.
    targets: BTreeMap<SocketAddr, Target>,
    /// Addresses found to be this node (never dialed again).
    own: BTreeSet<SocketAddr>,
    peers: BTreeMap<NodeId, Peer>,
    held: BTreeMap<ConnId, Held>,
    /// Round-robin position per group that some node has (shared with the route tables made
    /// from this mesh, as a whole while no node's groups change).
    rr: Arc<BTreeMap<GroupKey, Arc<AtomicU64>>>,
    /// Every node's groups when `rr` was last brought up to date: a snapshot whose nodes hold
    /// the very same groups reuses it instead of gathering every group again.
    groups_seen: Vec<(NodeId, GroupsHeld)>,
    rng: u64,
    out: VecDeque<Output>,
}

impl Mesh {
    /// `seed` makes the backoff jitter reproducible (tests); `session_base` must grow from one
    /// run of the node to the next (e.g. the start time in ms), so that a restarted node's
    /// sessions outrank those of its previous life.
    pub fn new(me: NodeId, config: MeshConfig, seed: u64, session_base: u64) -> Mesh {
        Mesh {
            me,
            config,
            local: Interest::default(),
            out_seq: 0,
            next_session: session_base << RUN_SHIFT,
            targets: BTreeMap::new(),
            own: BTreeSet::new(),
            peers: BTreeMap::new(),
            held: BTreeMap::new(),
            rr: Arc::default(),
            groups_seen: Vec::new(),
            rng: seed | 1,
            out: VecDeque::new(),
        }
    }

    pub fn me(&self) -> &NodeId {
        &self.me
    }

    /// The next thing to do, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let dials = self.targets.values().filter_map(|t| t.next_dial);
        dials.chain(self.held.values().map(|h| h.until)).min()
    }

    /// Dial what is due; retire held connections whose peer said nothing in time.
    pub fn handle_timeout(&mut self, now: Instant) {
        for (addr, t) in &mut self.targets {
            if t.next_dial.is_some_and(|at| at <= now) {
                t.next_dial = None;
                self.out.push_back(Output::Dial(*addr));
            }
        }
        self.close_held(|h| h.until <= now, DUPLICATE);
    }

    /// Close the held connections `pick` picks, for `reason`.
    fn close_held(&mut self, pick: impl Fn(&Held) -> bool, reason: &'static str) {
        let picked: Vec<ConnId> = self
            .held
            .iter()
            .filter(|(_, h)| pick(h))
            .map(|(c, _)| *c)
            .collect();
        for conn in picked {
            self.held.remove(&conn);
            self.out.push_back(Output::Close { conn, reason });
        }
    }

    /// The peer finished its side of `conn` (it retired it, keeping the pair's other
    /// connection, or it is leaving). A held connection is retired at once, not after
    /// [`HOLD_WAIT`]: both dialed at the same moment, and the peer, which had not heard from
    /// this node on the kept connection yet, retired the duplicate without a word on it, so no
    /// control message will come to decide. (Waiting kept the peer's retired end waiting too,
    /// and both warned after 5 s.) A connection this node keeps is left to the transport.
    pub fn handle_peer_retired(&mut self, conn: ConnId) {
        if self.held.remove(&conn).is_some() {
            self.out.push_back(Output::Close {
                conn,
                reason: DUPLICATE,
            });
        }
    }

    /// The addresses to be connected to (from `cluster.peers` or DNS), this node's own among
    /// them or not. New ones are dialed now; connections to ones that left are closed.
    pub fn handle_peer_set(&mut self, now: Instant, addrs: impl IntoIterator<Item = SocketAddr>) {
        let wanted: BTreeSet<SocketAddr> = addrs
            .into_iter()
            .filter(|a| !self.own.contains(a))
            .collect();
        let gone: Vec<SocketAddr> = self
            .targets
            .keys()
            .filter(|a| !wanted.contains(a))
            .copied()
            .collect();
        for addr in gone {
            // A connection it dialed there and holds (a second one, while the first worked):
            // closed too, or the peer's snapshot on it would make it the peer again (as a
            // restart) although the set no longer names it.
            self.close_held(|h| h.outbound && h.addr == Some(addr), "no longer a peer");
            if let Some(node) = self.targets.remove(&addr).and_then(|t| t.node) {
                // Another address still wanted reaches the same node: it stays a peer, on the
                // connection it has (nothing else would dial it: that address counts as
                // connected).
                let other = self
                    .targets
                    .iter()
                    .find(|(a, t)| wanted.contains(a) && t.node.as_ref() == Some(&node))
                    .map(|(a, _)| *a);
                match other {
                    Some(other) => {
                        if let Some(p) = self.peers.get_mut(&node) {
                            if p.addr == Some(addr) {
                                p.addr = Some(other);
                            }
                        }
                    }
                    None => {
                        if let Some(p) = self.peers.remove(&node) {
                            self.out.push_back(Output::Close {
                                conn: p.conn,
                                reason: "no longer a peer",
                            });
                        }
                    }
                }
            }
        }
        for addr in wanted {
            self.targets.entry(addr).or_insert_with(|| Target {
                attempts: 0,
                next_dial: Some(now),
                node: None,
            });
        }
        self.handle_timeout(now);
    }

    /// A dial failed: try again after a backoff with full jitter.
    pub fn handle_dial_failed(&mut self, now: Instant, addr: SocketAddr) {
        let delay = self.backoff(addr);
        if let Some(t) = self.targets.get_mut(&addr) {
            t.attempts = t.attempts.saturating_add(1);
            t.next_dial = Some(now + delay);
        }
    }

    fn backoff(&mut self, addr: SocketAddr) -> Duration {
        let attempts = self.targets.get(&addr).map_or(0, |t| t.attempts);
        let cap = self
            .config
            .backoff_min
            .saturating_mul(1u32 << attempts.min(16))
            .min(self.config.backoff_max);
        // xorshift64*: enough for jitter, reproducible from the seed.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let nanos = cap.as_nanos() as u64;
        Duration::from_nanos(if nanos == 0 { 0 } else { r % (nanos + 1) })
    }

    /// A mesh connection is up (its TLS handshake named the peer `node`). `outbound`: this
    /// node dialed it (then `addr` is the address dialed). Returns whether it is kept; if not,
    /// the transport closes it (an [`Output::Close`] is queued too).
    pub fn handle_connected(
        &mut self,
        now: Instant,
        conn: ConnId,
        node: NodeId,
        addr: Option<SocketAddr>,
        outbound: bool,
    ) -> bool {
        let _ = now;
        if node == self.me {
            // DNS returned this node's own address: never dial it again.
            if let Some(a) = addr.filter(|_| outbound) {
                self.targets.remove(&a);
                self.own.insert(a);
            }
            self.out.push_back(Output::Close {
                conn,
                reason: "a node does not connect to itself",
            });
            return false;
        }
        if addr.is_some_and(|a| outbound && !self.targets.contains_key(&a)) {
            // Dialed before its address left the set (DNS dropped it while the handshake ran):
            // closed as the set's change closes a connected one. Kept, it was a peer for as long
            // as the connection lasted, and never dialed again once it ended.
            self.out.push_back(Output::Close {
                conn,
                reason: "no longer a peer",
            });
            return false;
        }
        // What the peer is known to want carries over to the connection that replaces the one
        // in use, until the new session's snapshot arrives: routing to it never pauses.
        let carried = self
            .peers
            .get(&node)
            .map(|p| p.interest.clone())
            .unwrap_or_default();
        if let Some(existing) = self.peers.get(&node) {
            // Both dialed: keep the connection dialed by the node with the smaller id, on both
            // sides alike.
            let dialer_of = |outbound: bool| if outbound { &self.me } else { &node };
            let keep_new = dialer_of(outbound) < dialer_of(existing.outbound);
            if keep_new {
                self.out.push_back(Output::Close {
                    conn: existing.conn,
                    reason: DUPLICATE,
                });
            } else {
                let worked = existing.in_session.is_some();
                if let Some(a) = addr.filter(|_| outbound) {
                    if let Some(t) = self.targets.get_mut(&a) {
                        t.attempts = 0;
                        t.node = Some(node.clone());
                    }
                }
                if worked {
                    // The one in use may be dead: the peer restarted within the idle timeout
                    // and dialed again (it has no other connection then, and keeps this one).
                    // Its first control message says which (see `handle_held`).
                    let out_session = self.send_snapshot(conn);
                    self.held.insert(
                        conn,
                        Held {
                            node,
                            outbound,
                            addr: addr.filter(|_| outbound),
                            out_session,
                            seq: self.out_seq,
                            until: now + HOLD_WAIT,
                        },
                    );
                } else {
                    self.out.push_back(Output::Close {
                        conn,
                        reason: DUPLICATE,
                    });
                }
                return false;
            }
        }
        let session = self.send_snapshot(conn);
        self.keep(conn, node, addr, outbound, session, carried);
        true
    }

    /// Make `conn` the connection in use for `node`.
    fn keep(
        &mut self,
        conn: ConnId,
        node: NodeId,
        addr: Option<SocketAddr>,
        outbound: bool,
        out_session: u64,
        interest: Interest,
    ) {
        if let Some(a) = addr.filter(|_| outbound) {
            if let Some(t) = self.targets.get_mut(&a) {
                // `attempts` goes back to 0 only when a connection on which the peer spoke
                // ends unrefused (`handle_disconnected`): a peer that accepts the handshake and
                // then refuses the connection (a certificate it does not take as a peer's), or
                // one closed for its interest, is redialed with a growing backoff, not several
                // times a second.
                t.next_dial = None;
                t.node = Some(node.clone());
            }
        }
        self.peers.insert(
            node,
            Peer {
                conn,
                outbound,
                addr: addr.filter(|_| outbound),
                out_session,
                in_session: None,
                interest,
                pending: None,
                refused: false,
                spoke: false,
            },
        );
    }

    /// Open a session on `conn`: queue this node's snapshot (in parts if large). Returns the
    /// session.
    fn send_snapshot(&mut self, conn: ConnId) -> u64 {
        self.next_session += 1;
        let session = self.next_session;
        let seq = self.out_seq;
        if self.local.len() <= ENTRIES_PER_MESSAGE {
            self.out.push_back(Output::Send {
                conn,
                control: Control::Snapshot {
                    session,
                    seq,
                    interest: self.local.clone(),
                },
            });
        } else {
            // Too large for one message: parts first, then the snapshot with the last entries,
            // which completes it (the receiver swaps the whole in at once).
            let all = self.local.updates();
            let chunks: Vec<&[Update]> = all.chunks(ENTRIES_PER_MESSAGE).collect();
            let (last, parts): (&[Update], &[&[Update]]) = match chunks.split_last() {
                Some((last, parts)) => (last, parts),
                None => (&[], &[]),
            };
            for part in parts {
                self.out.push_back(Output::Send {
                    conn,
                    control: Control::SnapshotPart {
                        session,
                        seq,
                        updates: part.to_vec(),
                    },
                });
            }
            let mut rest = Interest::default();
            for u in last {
                rest.apply(u);
            }
            self.out.push_back(Output::Send {
                conn,
                control: Control::Snapshot {
                    session,
                    seq,
                    interest: rest,
                },
            });
        }
        session
    }

    /// A connection ended. If it was a peer's, its interest is forgotten and, if this node
    /// dials it, a reconnect is scheduled.
    pub fn handle_disconnected(&mut self, now: Instant, conn: ConnId) {
        if self.held.remove(&conn).is_some() {
            return;
        }
        let Some(node) = self
            .peers
            .iter()
            .find(|(_, p)| p.conn == conn)
            .map(|(n, _)| n.clone())
        else {
            return;
        };
        let Some(peer) = self.peers.remove(&node) else {
            return;
        };
        let worked = peer.spoke && !peer.refused;
        // Reconnect to every target whose node this was (dialed or not: the other side may be
        // the one that went away, and only one of us may have it as a target).
        let addrs: Vec<SocketAddr> = self
            .targets
            .iter()
            .filter(|(a, t)| t.node.as_ref() == Some(&node) || peer.addr == Some(**a))
            .map(|(a, _)| *a)
            .collect();
        for addr in addrs {
            if let Some(t) = self.targets.get_mut(&addr).filter(|_| worked) {
                t.attempts = 0;
            }
            let delay = self.backoff(addr);
            if let Some(t) = self.targets.get_mut(&addr) {
                t.node = None;
                t.next_dial = Some(now + delay);
                t.attempts = t.attempts.saturating_add(1);
            }
        }
    }

    /// A control message from the peer on `conn`. Returns false if it breaks the protocol (the
    /// connection is then closed; the reconnect starts a fresh session).
    pub fn handle_control(&mut self, conn: ConnId, control: Control) -> bool {
        if let Some(held) = self.held.remove(&conn) {
            return self.handle_held(conn, held, control);
        }
        let max = self.config.max_peer_interest;
        let Some(peer) = self.peers.values_mut().find(|p| p.conn == conn) else {
            return true; // a connection being replaced: ignore
        };
        if peer.refused {
            return true; // closed for its interest: what was still on its way is ignored
        }
        // The peer speaks: unless it is refused, a reconnect after this connection starts from
        // the shortest backoff again.
        peer.spoke = true;
        match control {
            Control::Snapshot {
                session,
                seq,
                interest,
            } => {
                if peer.in_session.is_some_and(|(s, _)| session < s) {
                    return true; // late, from an older session
                }
                let mut whole = interest;
                if let Some((s, q, parts)) = peer.pending.take() {
                    if (s, q) == (session, seq) {
                        for u in parts.updates() {
                            whole.apply(&u);
                        }
                    }
                }
                if whole.len() > max {
                    return self.refuse_interest(conn);
                }
                peer.in_session = Some((session, seq));
                peer.interest = whole;
                true
            }
            Control::SnapshotPart {
                session,
                seq,
                updates,
            } => {
                if peer.in_session.is_some_and(|(s, _)| session <= s) {
                    return true; // late, from an older session (or this one's, complete)
                }
                match &mut peer.pending {
                    Some((s, q, parts)) if (*s, *q) == (session, seq) => {
                        for u in &updates {
                            parts.apply(u);
                        }
                    }
                    // The first part of a new snapshot (one in progress is forgotten).
                    pending => {
                        let mut parts = Interest::default();
                        for u in &updates {
                            parts.apply(u);
                        }
                        *pending = Some((session, seq, parts));
                    }
                }
                // The parts alone are already more than the peer may hold.
                if peer.pending.as_ref().is_some_and(|(_, _, p)| p.len() > max) {
                    return self.refuse_interest(conn);
                }
                true
            }
            // The transport's to act on (see [`Control::Leaving`]).
            Control::Leaving => true,
            Control::Delta {
                session,
                seq,
                updates,
            } => match peer.in_session {
                Some((s, _)) if session < s => true,
                // `last` is the peer's own number: checked, so u64::MAX cannot overflow.
                Some((s, last)) if session == s && last.checked_add(1) == Some(seq) => {
                    for u in &updates {
                        peer.interest.apply(u);
                    }
                    if peer.interest.len() > max {
                        return self.refuse_interest(conn);
                    }
                    peer.in_session = Some((s, seq));
                    true
                }
                // A gap: the peer's interest here is no longer what it has. A protocol error,
                // redialed with a growing wait (a peer that keeps skipping is not met 4 times
                // a second); the next connection starts over from a snapshot.
                _ => {
                    self.note_refusal(conn);
                    self.out.push_back(Output::Close {
                        conn,
                        reason: PROTOCOL_ERROR,
                    });
                    false
                }
            },
        }
    }

    /// Close `conn`, whose peer's interest went beyond [`MeshConfig::max_peer_interest`], and
    /// forget that interest now (not only when the transport reports the connection gone):
    /// nothing is routed to the peer by what it wanted beyond the limit, and what still comes
    /// on the connection is ignored. Returns false (the message broke the rules).
    fn refuse_interest(&mut self, conn: ConnId) -> bool {
        self.note_refusal(conn);
        self.out.push_back(Output::Close {
            conn,
            reason: INTEREST_LIMIT,
        });
        false
    }

    /// The peer on `conn` closed it because this node's interest is beyond its limit (the
    /// transport saw [`INTEREST_LIMIT`] as the close reason), or for a protocol error
    /// ([`PROTOCOL_ERROR`]): this node waits longer, each time, before it dials that peer
    /// again. Call before [`Mesh::handle_disconnected`].
    pub fn handle_refused_by_peer(&mut self, conn: ConnId) {
        self.note_refusal(conn);
    }

    /// The control stream of `conn` broke the protocol; the transport closes the connection
    /// ([`PROTOCOL_ERROR`]). It ends as [`Mesh::handle_disconnected`] ends one, but counts as a
    /// refusal even if the peer spoke first: a fault that persists is redialed with a growing
    /// wait, not within `backoff_min` every time.
    pub fn handle_broken(&mut self, now: Instant, conn: ConnId) {
        self.note_refusal(conn);
        self.handle_disconnected(now, conn);
    }

    fn note_refusal(&mut self, conn: ConnId) {
        let Some((node, peer)) = self.peers.iter_mut().find(|(_, p)| p.conn == conn) else {
            return;
        };
        peer.refused = true;
        peer.interest = Interest::default();
        peer.pending = None;
        let (node, addr) = (node.clone(), peer.addr);
        // The targets `handle_disconnected` will schedule again (counting this connection as
        // one more failed): the first refusal in a row makes the next dial wait up to four
        // times `backoff_min` (1 s by default), an interest beyond the limit being unlikely to
        // shrink sooner; each further one twice as long, up to `backoff_max`.
        for (a, t) in self.targets.iter_mut() {
            if t.node.as_ref() == Some(&node) || addr == Some(*a) {
                t.attempts = t.attempts.max(REFUSED_ATTEMPTS);
            }
        }
    }

    /// The first control message on a held connection: if it comes from a later run of the
    /// peer than the connection in use (the peer restarted; the one in use is dead and would
    /// only end at its idle timeout, refusing the peer meanwhile), or the one in use is gone,
    /// this one is kept; otherwise it is a duplicate after all and retired.
    fn handle_held(&mut self, conn: ConnId, held: Held, control: Control) -> bool {
        let (Control::Snapshot { session, .. }
        | Control::SnapshotPart { session, .. }
        | Control::Delta { session, .. }) = &control
        else {
            // The transport's to act on (see [`Control::Leaving`]); it forgets the connection.
            return true;
        };
        let run = session >> RUN_SHIFT;
        let restarted = match self.peers.get(&held.node) {
            None => true,
            Some(p) => p.in_session.is_some_and(|(s, _)| run > s >> RUN_SHIFT),
        };
        if !restarted {
            self.out.push_back(Output::Close {
                conn,
                reason: DUPLICATE,
            });
            return true;
        }
        let carried = match self.peers.get(&held.node) {
            Some(old) => {
                self.out.push_back(Output::Close {
                    conn: old.conn,
                    reason: RESTARTED,
                });
                old.interest.clone()
            }
            None => Interest::default(),
        };
        // Deltas made while it was held did not go to it: a new snapshot then.
        let out_session = if held.seq == self.out_seq {
            held.out_session
        } else {
            self.send_snapshot(conn)
        };
        self.keep(
            conn,
            held.node,
            held.addr,
            held.outbound,
            out_session,
            carried,
        );
        self.handle_control(conn, control)
    }

    /// A local subscription came or went: `delta` is +1 or -1 for `key`. Every peer is told.
    pub fn handle_local(&mut self, key: Key, delta: i64) {
        let update = self.local.add(key, delta);
        self.out_seq += 1;
        for p in self.peers.values() {
            self.out.push_back(Output::Send {
                conn: p.conn,
                control: Control::Delta {
                    session: p.out_session,
                    seq: self.out_seq,
                    updates: vec![update.clone()],
                },
            });
        }
    }

    /// The most interest keys a peer may hold here ([`MeshConfig::max_peer_interest`]).
    pub fn max_peer_interest(&self) -> usize {
        self.config.max_peer_interest
    }

    /// This node's own interest.
    pub fn local(&self) -> &Interest {
        &self.local
    }

    /// What `node` is known to want (while connected).
    pub fn peer_interest(&self, node: &NodeId) -> Option<&Interest> {
        self.peers.get(node).map(|p| &p.interest)
    }

    /// Connected peers.
    pub fn peers(&self) -> impl Iterator<Item = (&NodeId, ConnId)> {
        self.peers.iter().map(|(n, p)| (n, p.conn))
    }

    /// An immutable snapshot of what routing needs (this node's and its peers' interest, and
    /// the round-robin counters, which snapshots share): the server publishes one behind an
    /// atomic pointer after every change, so the publish path routes with no lock.
    pub fn table(&mut self) -> RouteTable {
        let mut nodes: Vec<(NodeId, Interest)> = Vec::with_capacity(self.peers.len() + 1);
        nodes.push((self.me.clone(), self.local.clone()));
        nodes.extend(
            self.peers
                .iter()
                .map(|(n, p)| (n.clone(), p.interest.clone())),
        );
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        let seen: Vec<(NodeId, GroupsHeld)> = nodes
            .iter()
            .map(|(n, i)| (n.clone(), i.groups_held()))
            .collect();
        let unchanged = seen.len() == self.groups_seen.len()
            && seen
                .iter()
                .zip(&self.groups_seen)
                .all(|((a, x), (b, y))| a == b && x.same(y));
        if !unchanged {
            // Only the groups some node has keep a counter: group ids that come and go (one
            // per worker instance, say) must not pile up.
            let mut rr = BTreeMap::new();
            for (_, interest) in &nodes {
                for g in interest.groups() {
                    if !rr.contains_key(g) {
                        let turn = self.rr.get(g).cloned().unwrap_or_default();
                        rr.insert(g.clone(), turn);
                    }
                }
            }
            self.rr = Arc::new(rr);
            self.groups_seen = seen;
        }
        let peers_want_nothing = nodes
            .iter()
            .all(|(n, interest)| *n == self.me || interest.is_empty());
        RouteTable {
            me: self.me.clone(),
            nodes,
            counters: Arc::clone(&self.rr),
            peers_want_nothing,
        }
    }

    /// Where a message published on this node goes (see [`RouteTable::route`]).
    pub fn route(&mut self, topic: &TopicName) -> Routing {
        self.table().route(topic)
    }

    /// Where a forwarded copy goes from here (see [`RouteTable::route_forwarded`]).
    pub fn route_forwarded(&mut self, forward: &Forward) -> Routing {
        self.table().route_forwarded(forward)
    }
}

/// What routing needs, frozen: every node's interest (this one's and its connected peers', in
/// id order) and shared round-robin counters. `&self` only: safe to use from many publishing
/// tasks at once without a lock.
#[derive(Debug, Clone)]
pub struct RouteTable {
    me: NodeId,
    nodes: Vec<(NodeId, Interest)>,
    counters: Arc<BTreeMap<GroupKey, Arc<AtomicU64>>>,
    /// No peer (connected or not) wants anything: every message is this node's alone.
    peers_want_nothing: bool,
}

impl RouteTable {
    /// No peer wants any message (none connected, or none has a subscription): publishing is
    /// then exactly as without a cluster — nothing is forwarded and every group is picked here.
    pub fn peers_want_nothing(&self) -> bool {
        self.peers_want_nothing
    }

    /// Every node's interest, this one's included, in id order.
    pub fn nodes(&self) -> &[(NodeId, Interest)] {
        &self.nodes
    }

    /// The peers with a plain filter matching `topic` (each gets one copy for its plain
    /// subscribers).
    pub fn plain_peers<'a>(&'a self, topic: &'a [u8]) -> impl Iterator<Item = &'a NodeId> + 'a {
        self.nodes
            .iter()
            .filter(move |(n, i)| *n != self.me && i.wants_plain_bytes(topic))
            .map(|(n, _)| n)
    }

    /// Where a message published on this node goes: one copy per peer at most (plain interest,
    /// and the groups whose picked member is there), the groups picked here, and the groups
    /// with no member anywhere.
    pub fn route(&self, topic: &TopicName) -> Routing {
        self.route_bytes(topic.as_bytes())
    }

    /// [`route`](Self::route) on a topic's bytes.
    pub fn route_bytes(&self, topic: &[u8]) -> Routing {
        self.route_bytes_where(topic, |_| true, |_| true)
    }

    /// [`route_bytes`](Self::route_bytes), placing groups only on the peers `reachable` accepts
    /// and here only if `here` says the group still has a member here: the snapshot may still
    /// name a peer whose connection just ended, or count a member here that just left (the
    /// table follows the broker a moment later), and a group picked there would be served by
    /// no one while another node's member could take it. (A plain copy is still named: the
    /// caller drops what it cannot send and counts it.)
    pub fn route_bytes_where(
        &self,
        topic: &[u8],
        here: impl Fn(&GroupKey) -> bool,
        reachable: impl Fn(&NodeId) -> bool,
    ) -> Routing {
        let mut routing = Routing::default();
        let mut copies: BTreeMap<NodeId, Forward> = BTreeMap::new();
        for node in self.plain_peers(topic) {
            copies.entry(node.clone()).or_default().plain = true;
        }
        for (g, members) in self.groups_for(topic) {
            let placeable = |n: &NodeId| {
                if *n == self.me {
                    here(&g)
                } else {
                    reachable(n)
                }
            };
            let members = members.into_iter().map(|(i, c)| (&self.nodes[i].0, c));
            match self.pick_among(&g, members, placeable) {
                Some(node) if node == self.me => routing.local_groups.push(g),
                Some(node) => copies.entry(node).or_default().groups.push(g),
                None => routing.unplaced.push(g),
            }
        }
        for (node, mut f) in copies {
            f.visited = vec![self.me.clone()];
            routing.forward.push((node, f));
        }
        routing
    }

    /// Where a copy forwarded to this node goes: its plain part to the local plain subscribers
    /// (the caller's), its groups to a local member, or — if none is left here — re-picked
    /// among the nodes it has not been to. Never to a plain subscriber elsewhere.
    pub fn route_forwarded(&self, forward: &Forward) -> Routing {
        self.route_forwarded_where(forward, |g| self.members(&self.me, g) > 0, |_| true)
    }

    /// [`route_forwarded`](Self::route_forwarded), taking a group here if `here` says it has a
    /// member now (the broker routes it), whatever this snapshot counts: the snapshot may still
    /// count a member that just left, or not yet one that joined (this node tells its peers of
    /// a new member before it rebuilds its own table, so a peer may send it that group's copies
    /// first). A group `here` denies is picked again among the nodes the copy has not been to
    /// (this one counts as visited) that `reachable` accepts (a peer the snapshot names may have
    /// no connection any more); if none has a member, among those it has been to but this one,
    /// while it has made fewer than [`MAX_VISITS`] hops: a copy whose member here left just
    /// before it came goes back to the sender's members instead of being dropped (the sender's
    /// table did not know yet). Each hop is listed, so a copy cannot go back and forth for good.
    pub fn route_forwarded_where(
        &self,
        forward: &Forward,
        here: impl Fn(&GroupKey) -> bool,
        reachable: impl Fn(&NodeId) -> bool,
    ) -> Routing {
        let mut routing = Routing::default();
        let mut visited = forward.visited.clone();
        visited.push(self.me.clone());
        let mut copies: BTreeMap<NodeId, Forward> = BTreeMap::new();
        for g in &forward.groups {
            if here(g) {
                routing.local_groups.push(g.clone());
                continue;
            }
            let picked = self
                .pick(g, |n| !visited.contains(n) && reachable(n))
                .or_else(|| {
                    (forward.visited.len() < MAX_VISITS)
                        .then(|| self.pick(g, |n| *n != self.me && reachable(n)))
                        .flatten()
                });
            match picked {
                Some(node) if node != self.me => {
                    copies.entry(node).or_default().groups.push(g.clone())
                }
                _ => routing.unplaced.push(g.clone()),
            }
        }
        for (node, mut f) in copies {
            f.visited = visited.clone();
            routing.forward.push((node, f));
        }
        routing
    }

    /// Where a message of group `g` goes that no member on this node can take any more (its
    /// last member here left with it queued or unsettled): the next member round-robin on the
    /// other nodes that `reachable` accepts, as a copy for that group only that has been here.
    /// `None`: no member elsewhere either. This node's own count is skipped, whatever it says
    /// (the snapshot may not have seen the member leave yet); so is a peer the caller cannot
    /// reach (the snapshot may name a peer whose connection just ended), so that the message
    /// goes to a member that can take it rather than being lost with the pick.
    pub fn repick_elsewhere(
        &self,
        g: &GroupKey,
        reachable: impl Fn(&NodeId) -> bool,
    ) -> Option<(NodeId, Forward)> {
        let node = self.pick(g, |n| *n != self.me && reachable(n))?;
        Some((
            node,
            Forward {
                plain: false,
                groups: vec![g.clone()],
                visited: vec![self.me.clone()],
            },
        ))
    }

    fn members(&self, node: &NodeId, g: &GroupKey) -> u32 {
        self.nodes
            .iter()
            .find(|(n, _)| n == node)
            .map_or(0, |(_, i)| i.count_group(g))
    }

    /// Groups (anywhere) whose filter matches `topic`, each with its member count on every node
    /// that has members (the node's index in `nodes`, in order).
    fn groups_for(&self, topic: &[u8]) -> BTreeMap<GroupKey, Vec<(usize, u32)>> {
        let mut groups: BTreeMap<GroupKey, Vec<(usize, u32)>> = BTreeMap::new();
        for (i, (_, interest)) in self.nodes.iter().enumerate() {
            interest.for_each_group_for(topic, |g, n| match groups.get_mut(g) {
                Some(members) => members.push((i, n)),
                None => {
                    groups.insert(g.clone(), vec![(i, n)]);
                }
            });
        }
        groups
    }

    /// Does a consumer group of any node match `topic` (then each message is routed on its
    /// own: the groups' round-robin picks per message)?
    pub fn groups_match(&self, topic: &[u8]) -> bool {
        self.nodes.iter().any(|(_, i)| i.has_group_for(topic))
    }

    /// Are there groups anywhere (else routing is plain only, and cheaper)?
    pub fn has_groups(&self) -> bool {
        self.counters.values().next().is_some()
    }

    /// The node of the next member of `g` round-robin, over the members of every node that
    /// `usable` accepts (in id order).
    fn pick(&self, g: &GroupKey, usable: impl Fn(&NodeId) -> bool) -> Option<NodeId> {
        let members = self.nodes.iter().map(|(n, i)| (n, i.count_group(g)));
        self.pick_among(g, members, usable)
    }

    /// [`pick`](Self::pick) among `members` (each node's member count, in node order), as
    /// routing a publish already has them.
    fn pick_among<'a>(
        &self,
        g: &GroupKey,
        members: impl Iterator<Item = (&'a NodeId, u32)>,
        usable: impl Fn(&NodeId) -> bool,
    ) -> Option<NodeId> {
        let nodes: Vec<(&NodeId, u64)> = members
            .map(|(n, c)| (n, u64::from(c)))
            .filter(|(n, c)| *c > 0 && usable(n))
            .collect();
        let total: u64 = nodes.iter().map(|(_, c)| c).sum();
        if total == 0 {
            return None;
        }
        let turn = self
            .counters
            .get(g)
            .map_or(0, |c| c.fetch_add(1, Ordering::Relaxed));
        let mut k = turn % total;
        for (n, c) in nodes {
            if k < c {
                return Some(n.clone());
            }
            k -= c;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(s: &str) -> NodeId {
        NodeId::try_from(s).expect("node id")
    }

    fn plain(f: &str) -> Key {
        Key::Plain(TopicFilter::try_from(f).expect("filter"))
    }

    /// A delta of session `session` at `seq` setting these keys' counts.
    fn delta(session: u64, seq: u64, updates: &[(Key, u32)]) -> Control {
        Control::Delta {
            session,
            seq,
            updates: updates
                .iter()
                .map(|(key, count)| Update {
                    key: key.clone(),
                    count: *count,
                })
                .collect(),
        }
    }

    fn group(f: &str, g: &str) -> GroupKey {
        GroupKey {
            filter: TopicFilter::try_from(f).expect("filter"),
            group: GroupId::try_from(g).expect("group"),
        }
    }

    fn topic(t: &str) -> TopicName {
        TopicName::try_from(t).expect("topic")
    }

    /// `Interest` against a model (a map of every key's count, scanned for matches): for any
    /// sequence of updates (keys added, changed and removed) it holds the same counts, and for
    /// any topic the same plain interest and the same groups with the same counts match. Equal
    /// counts reached different ways make equal interests.
    mod index_model {
        use super::*;
        use proptest::prelude::*;

        const FILTERS: [&str; 12] = [
            "a", "a/b", "a/+", "a/#", "#", "+/b", "$sys/x", "+/+", "b", "$sys/#", "c/+/e", "+/d/#",
        ];
        const TOPICS: [&str; 11] = [
            "a", "a/b", "a/c", "b", "b/b", "$sys/x", "c/d/e", "a/b/c", "__dlq__a", "a//e", "$sys",
        ];

        fn key(i: usize, as_group: bool, g: usize) -> Key {
            if as_group {
                Key::Group(group(FILTERS[i], ["w", "x"][g]))
            } else {
                plain(FILTERS[i])
            }
        }

        proptest! {
            #[test]
            fn interest_answers_as_a_scan_of_every_key(
                ops in proptest::collection::vec(
                    (0..FILTERS.len(), any::<bool>(), 0..2usize, 0..3u32), 0..40)
            ) {
                let mut interest = Interest::default();
                let mut again = Interest::default();
                let mut model: BTreeMap<Key, u32> = BTreeMap::new();
                for (i, as_group, g, count) in ops {
                    let u = Update { key: key(i, as_group, g), count };
                    // A clone (as a routing snapshot holds) does not see the change.
                    let snapshot = interest.clone();
                    let before = snapshot.updates();
                    interest.apply(&u);
                    prop_assert_eq!(snapshot.updates(), before);
                    // The same counts reached another way: set, then set again.
                    again.apply(&Update { key: u.key.clone(), count: count + 1 });
                    again.apply(&u);
                    if count == 0 {
                        model.remove(&u.key);
                    } else {
                        model.insert(u.key, count);
                    }
                }
                prop_assert_eq!(&interest, &again);
                prop_assert_eq!(interest.len(), model.len());
                let want: Vec<Update> = model
                    .iter()
                    .map(|(key, &count)| Update { key: key.clone(), count })
                    .collect();
                prop_assert_eq!(interest.updates(), want);
                for (i, as_group, g) in (0..FILTERS.len()).flat_map(|i| {
                    [(i, false, 0), (i, true, 0), (i, true, 1)]
                }) {
                    let k = key(i, as_group, g);
                    prop_assert_eq!(interest.count(&k), model.get(&k).copied().unwrap_or(0));
                }
                let mut groups: Vec<&GroupKey> = interest.groups();
                groups.sort();
                let model_groups: Vec<&GroupKey> = model
                    .keys()
                    .filter_map(|k| match k {
                        Key::Group(g) => Some(g),
                        Key::Plain(_) => None,
                    })
                    .collect();
                prop_assert_eq!(groups, model_groups);
                for t in TOPICS {
                    let matches = |f: &TopicFilter| {
                        crate::matching::matches_bytes(f.as_bytes(), t.as_bytes())
                    };
                    // A peer's plain `#` wants system topics too (wants_plain_bytes).
                    let everything = |f: &TopicFilter| {
                        f.as_str() == "#" && crate::matching::is_system(t.as_bytes())
                    };
                    let scan_plain = model
                        .keys()
                        .any(|k| matches!(k, Key::Plain(f) if matches(f) || everything(f)));
                    prop_assert_eq!(interest.wants_plain_bytes(t.as_bytes()), scan_plain, "{}", t);
                    let scan_groups: Vec<(GroupKey, u32)> = model
                        .iter()
                        .filter_map(|(k, n)| match k {
                            Key::Group(g) if matches(&g.filter) => Some((g.clone(), *n)),
                            _ => None,
                        })
                        .collect();
                    let mut indexed: Vec<(GroupKey, u32)> = Vec::new();
                    interest.for_each_group_for(t.as_bytes(), |g, n| indexed.push((g.clone(), n)));
                    indexed.sort();
                    prop_assert_eq!(interest.has_group_for(t.as_bytes()), !scan_groups.is_empty(), "{}", t);
                    prop_assert_eq!(indexed, scan_groups, "{}", t);
                }
            }
        }
    }

    fn connected(m: &mut Mesh, conn: u64, peer: &str, interest: &[(Key, u32)]) {
        assert!(m.handle_connected(Instant::now(), ConnId(conn), node(peer), None, false));
        let mut i = Interest::default();
        for (k, n) in interest {
            i.apply(&Update {
                key: k.clone(),
                count: *n,
            });
        }
        assert!(m.handle_control(
            ConnId(conn),
            Control::Snapshot {
                session: 1,
                seq: 0,
                interest: i
            }
        ));
    }

    #[test]
    fn a_table_knows_when_no_peer_wants_anything() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        a.handle_local(plain("orders/#"), 1);
        assert!(a.table().peers_want_nothing(), "alone");
        connected(&mut a, 1, "b", &[]);
        assert!(a.table().peers_want_nothing(), "an idle peer");
        connected(&mut a, 2, "c", &[(plain("x"), 1)]);
        assert!(!a.table().peers_want_nothing());
    }

    /// The round-robin counters of groups no node has any more are freed: a churn of group
    /// ids kept one counter per id ever seen.
    #[test]
    fn turn_counters_of_groups_gone_are_freed() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        for i in 0..1000 {
            let k = Key::Group(group("jobs", &format!("g{i}")));
            a.handle_local(k.clone(), 1);
            a.table();
            a.handle_local(k, -1);
        }
        a.table();
        assert!(a.rr.is_empty(), "{} counters left", a.rr.len());
        let kept = Key::Group(group("jobs", "kept"));
        a.handle_local(kept, 1);
        assert_eq!(a.table().counters.len(), 1);
        assert_eq!(a.rr.len(), 1);
    }

    /// A snapshot reuses the round-robin counters while no node's groups changed (plain
    /// interest churn costs no walk over every group), gathers them again when any did, and the
    /// turns go on across both.
    #[test]
    fn a_snapshot_gathers_the_groups_again_only_when_a_node_s_groups_changed() {
        let g = group("jobs", "w");
        let mut a = a_and_b_sharing(&g, 1);
        let first = a.table();
        a.handle_local(plain("x"), 1);
        let second = a.table();
        assert!(
            Arc::ptr_eq(&first.counters, &second.counters),
            "only plain interest changed"
        );
        a.handle_local(Key::Group(group("other", "w")), 1);
        let third = a.table();
        assert!(
            !Arc::ptr_eq(&second.counters, &third.counters),
            "a group came"
        );
        assert_eq!(third.counters.len(), 2);
        assert!(
            Arc::ptr_eq(&third.counters[&g], &first.counters[&g]),
            "the same turn"
        );
        // A member more on b: b's groups changed.
        assert!(a.handle_control(ConnId(1), delta(1, 1, &[(Key::Group(g.clone()), 2)])));
        let fourth = a.table();
        assert!(
            !Arc::ptr_eq(&third.counters, &fourth.counters),
            "b's groups changed"
        );
        let counts = places(30, || fourth.route(&topic("jobs")));
        assert_eq!(counts.get("a"), Some(&10), "{counts:?}");
        assert_eq!(counts.get("b"), Some(&20), "{counts:?}");
        // b gone: its groups with it.
        a.handle_disconnected(Instant::now(), ConnId(1));
        let fifth = a.table();
        assert!(!Arc::ptr_eq(&fourth.counters, &fifth.counters));
        let counts = places(3, || fifth.route(&topic("jobs")));
        assert_eq!(counts.get("a"), Some(&3), "{counts:?}");
    }

    #[test]
    fn forwards_once_to_interested_peers_only() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(
            &mut a,
            1,
            "b",
            &[(plain("orders/#"), 1), (plain("orders/eu"), 2)],
        );
        connected(&mut a, 2, "c", &[(plain("stock/#"), 1)]);
        let r = a.route(&topic("orders/eu"));
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].0, node("b"));
        assert!(r.forward[0].1.plain);
        assert!(a.route(&topic("other")).forward.is_empty());
    }

    /// Node "a" with one member of `g` and peer "b" with `on_b` (on connection 1).
    fn a_and_b_sharing(g: &GroupKey, on_b: u32) -> Mesh {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        a.handle_local(Key::Group(g.clone()), 1);
        connected(&mut a, 1, "b", &[(Key::Group(g.clone()), on_b)]);
        a
    }

    /// Where `n` routings of a one-group message (from node "a") went: "a" when picked here,
    /// else the peer's id, counted.
    fn places(n: usize, mut route: impl FnMut() -> Routing) -> BTreeMap<String, u32> {
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            let r = route();
            let place = match (r.local_groups.len(), r.forward.len()) {
                (1, 0) => "a".to_string(),
                (0, 1) => r.forward[0].0.to_string(),
                other => panic!("one place per message: {other:?}"),
            };
            *counts.entry(place).or_default() += 1;
        }
        counts
    }

    #[test]
    fn groups_round_robin_over_members_wherever_they_are() {
        let g = group("jobs", "workers");
        let mut a = a_and_b_sharing(&g, 2);
        let counts = places(30, || a.route(&topic("jobs")));
        assert_eq!(counts.get("a"), Some(&10));
        assert_eq!(counts.get("b"), Some(&20));
    }

    /// Groups with wildcard filters (held in a trie, not a list) are found for every topic
    /// they match, and only those: each takes its turn over the nodes that have members, and
    /// a plain wildcard filter beside them still gets its one copy.
    #[test]
    fn wildcard_groups_round_robin_over_the_nodes_that_have_them() {
        let region = group("jobs/+/eu", "workers");
        let all = group("jobs/#", "audit");
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        a.handle_local(Key::Group(region.clone()), 1);
        connected(
            &mut a,
            1,
            "b",
            &[
                (Key::Group(region.clone()), 1),
                (Key::Group(all.clone()), 1),
                (plain("+/+/eu"), 1),
            ],
        );
        let table = a.table();
        assert!(table.groups_match(b"jobs/x/eu"));
        assert!(
            table.groups_match(b"jobs"),
            "# matches the parent level too"
        );
        assert!(!table.groups_match(b"stock/x/eu"));
        let mut here = 0;
        for _ in 0..10 {
            let r = table.route_bytes(b"jobs/x/eu");
            assert!(r.unplaced.is_empty(), "{r:?}");
            let to_b = r.forward.iter().find(|(n, _)| *n == node("b"));
            let to_b = to_b.expect("b gets a copy: its plain filter and its audit group");
            assert!(to_b.1.plain, "{r:?}");
            assert!(to_b.1.groups.contains(&all), "{r:?}");
            if r.local_groups == vec![region.clone()] {
                here += 1;
            } else {
                assert!(to_b.1.groups.contains(&region), "{r:?}");
            }
        }
        assert_eq!(here, 5, "workers alternate between a and b");
        let r = table.route_bytes(b"jobs/x/us");
        assert_eq!(r.local_groups, vec![]);
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].1.groups, vec![all.clone()]);
        assert!(!r.forward[0].1.plain);
    }

    /// A publish's group is never placed on a peer the caller cannot reach (the snapshot still
    /// names a peer whose connection just ended): it goes round-robin over this node and the
    /// reachable peers, and with no member left anywhere reachable it is unplaced.
    #[test]
    fn a_publish_places_groups_on_reachable_nodes_only() {
        let g = group("jobs", "workers");
        let mut a = a_and_b_sharing(&g, 1);
        connected(&mut a, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let table = a.table();
        let not_b = |n: &NodeId| *n != node("b");
        let counts = places(20, || table.route_bytes_where(b"jobs", |_| true, not_b));
        assert_eq!(counts.get("b"), None, "{counts:?}");
        assert_eq!(counts.get("a"), Some(&10), "{counts:?}");
        assert_eq!(counts.get("c"), Some(&10), "{counts:?}");
        // This node is always reachable; with no member here and none reachable, unplaced.
        let mut lone = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(&mut lone, 1, "b", &[(Key::Group(g.clone()), 1)]);
        let r = lone.table().route_bytes_where(b"jobs", |_| true, |_| false);
        assert!(r.forward.is_empty() && r.local_groups.is_empty(), "{r:?}");
        assert_eq!(r.unplaced, vec![g]);
    }

    /// Publishing tasks share one table without a lock: the round-robin stays exact.
    #[test]
    fn a_route_table_is_shared_by_threads_and_keeps_the_round_robin() {
        fn shareable<T: Send + Sync>(_: &T) {}
        let g = group("jobs", "workers");
        let mut a = a_and_b_sharing(&g, 1);
        connected(&mut a, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let table = std::sync::Arc::new(a.table());
        shareable(&*table);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let table = table.clone();
                std::thread::spawn(move || {
                    let mut here = [0u32; 3];
                    for _ in 0..300 {
                        let r = table.route(&topic("jobs"));
                        let i = match r.forward.first() {
                            None => 0,
                            Some((n, _)) if n.as_str() == "b" => 1,
                            Some(_) => 2,
                        };
                        here[i] += 1;
                    }
                    here
                })
            })
            .collect();
        let mut total = [0u32; 3];
        for t in threads {
            let here = t.join().expect("thread");
            for (t, h) in total.iter_mut().zip(here) {
                *t += h;
            }
        }
        assert_eq!(total, [400, 400, 400]);
        // A later table goes on from where this one stopped.
        let r = a.route(&topic("jobs"));
        assert!(r.forward.is_empty() && r.local_groups == vec![g]);
    }

    #[test]
    fn a_gone_member_is_re_picked_elsewhere_never_twice_at_a_node() {
        let g = group("jobs", "w");
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 1, 1);
        connected(&mut b, 1, "a", &[]);
        connected(&mut b, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let f = Forward {
            plain: false,
            groups: vec![g.clone()],
            visited: vec![node("a")],
        };
        let r = b.route_forwarded(&f);
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].0, node("c"));
        assert_eq!(r.forward[0].1.visited, vec![node("a"), node("b")]);
        // At c, gone too, and nowhere else to go: unplaced, not sent back.
        let mut c = Mesh::new(node("c"), MeshConfig::default(), 1, 1);
        connected(&mut c, 1, "a", &[]);
        connected(&mut c, 2, "b", &[]);
        let r = c.route_forwarded(&r.forward[0].1);
        assert!(r.forward.is_empty());
        assert_eq!(r.unplaced, vec![g]);
    }

    /// The snapshot still counts a member here that the broker no longer routes to (it just
    /// left): the copy is picked again among the nodes it has not been to, not given to a group
    /// that would reach no one.
    #[test]
    fn a_group_copy_is_re_picked_when_its_member_here_just_left() {
        let g = group("jobs", "w");
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 1, 1);
        b.handle_local(Key::Group(g.clone()), 1);
        connected(&mut b, 1, "a", &[(Key::Group(g.clone()), 1)]);
        connected(&mut b, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let f = Forward {
            plain: false,
            groups: vec![g.clone()],
            visited: vec![node("a")],
        };
        let table = b.table();
        let r = table.route_forwarded(&f);
        assert_eq!(r.local_groups, vec![g.clone()], "the snapshot says: here");
        let r = table.route_forwarded_where(&f, |_| false, |_| true);
        assert!(r.local_groups.is_empty());
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].0, node("c"), "on to c, never back to a");
        assert_eq!(r.forward[0].1.visited, vec![node("a"), node("b")]);
    }

    /// A copy whose member here left just before it came, with members left only on the node
    /// that sent it (its table did not know yet), goes back there instead of being dropped as
    /// unplaced; a copy that has made MAX_VISITS hops is not sent back again (no endless back
    /// and forth while both tables are behind).
    #[test]
    fn a_group_copy_goes_back_to_the_sender_s_members_when_none_is_left_elsewhere() {
        let g = group("jobs", "w");
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(&mut a, 1, "b", &[(Key::Group(g.clone()), 1)]);
        connected(&mut a, 2, "c", &[]);
        let table = a.table();
        let f = Forward {
            plain: false,
            groups: vec![g.clone()],
            visited: vec![node("b")],
        };
        let r = table.route_forwarded_where(&f, |_| false, |_| true);
        assert!(r.unplaced.is_empty(), "dropped: {:?}", r.unplaced);
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].0, node("b"), "back to b's members");
        assert_eq!(r.forward[0].1.visited, vec![node("b"), node("a")]);
        // An unvisited node with a member still comes first.
        connected(&mut a, 3, "d", &[(Key::Group(g.clone()), 1)]);
        let r = a.table().route_forwarded_where(&f, |_| false, |_| true);
        assert_eq!(r.forward[0].0, node("d"));
        // Arriving with MAX_VISITS nodes listed, unplaced; with one fewer, sent back.
        let listing = |n: usize| Forward {
            visited: (0..n).map(|i| node(["b", "a"][i % 2])).collect(),
            ..f.clone()
        };
        let r = table.route_forwarded_where(&listing(MAX_VISITS - 1), |_| false, |_| true);
        assert_eq!(r.forward.len(), 1);
        assert_eq!(r.forward[0].1.visited.len(), MAX_VISITS);
        let r = table.route_forwarded_where(&listing(MAX_VISITS), |_| false, |_| true);
        assert!(r.forward.is_empty());
        assert_eq!(r.unplaced, vec![g]);
    }

    /// A node advertising plain `#` (its durable log wants every message) gets system topics
    /// too, dead letters among them: a leading wildcard matches none for subscribers, and the
    /// logging node never received the dead letters made on other nodes.
    #[test]
    fn plain_everything_wants_system_topics_too() {
        let mut i = Interest::default();
        for system in [&b"__dlq__orders"[..], b"$app/x", b"__audit"] {
            assert!(!i.wants_plain_bytes(system));
        }
        i.apply(&Update {
            key: plain("#"),
            count: 1,
        });
        for system in [&b"__dlq__orders"[..], b"$app/x", b"__audit", b"orders/eu"] {
            assert!(i.wants_plain_bytes(system), "{system:?}");
        }
        let mut other = Interest::default();
        other.apply(&Update {
            key: plain("+/x"),
            count: 1,
        });
        assert!(!other.wants_plain_bytes(b"$app/x"), "only # wants them");
    }

    /// A copy for a group whose first member here joined after this node's table was built (a
    /// peer learned of the member first) is kept: the broker routes the group. It was picked
    /// again among the nodes not yet visited, none, and dropped as unplaced.
    #[test]
    fn a_group_copy_is_kept_for_a_member_the_table_does_not_count_yet() {
        let g = group("jobs", "w");
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 1, 1);
        connected(&mut b, 1, "a", &[(Key::Group(g.clone()), 1)]);
        let f = Forward {
            plain: false,
            groups: vec![g.clone()],
            visited: vec![node("a")],
        };
        let r = b.table().route_forwarded_where(&f, |_| true, |_| true);
        assert_eq!(r.local_groups, vec![g]);
        assert!(r.unplaced.is_empty() && r.forward.is_empty());
    }

    #[test]
    fn an_orphaned_group_message_is_re_picked_on_another_node_never_here() {
        let g = group("jobs", "w");
        // a's own count still says 1 (the snapshot has not seen its member leave).
        let mut a = a_and_b_sharing(&g, 1);
        connected(&mut a, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let table = a.table();
        let mut seen = BTreeSet::new();
        for _ in 0..4 {
            let (to, f) = table
                .repick_elsewhere(&g, |_| true)
                .expect("a member elsewhere");
            assert_ne!(to, node("a"));
            assert_eq!(
                (f.plain, &f.groups, &f.visited),
                (false, &vec![g.clone()], &vec![node("a")])
            );
            seen.insert(to);
        }
        assert_eq!(seen.len(), 2, "round-robin over b and c");
        // At b (its member gone too), the copy may go on to c but never back to a.
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 1, 1);
        connected(&mut b, 1, "a", &[(Key::Group(g.clone()), 1)]);
        connected(&mut b, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let f = table.repick_elsewhere(&g, |_| true).expect("picked").1;
        for _ in 0..4 {
            let r = b.route_forwarded(&f);
            assert_eq!(r.forward.len(), 1);
            assert_eq!(r.forward[0].0, node("c"));
        }
        // No member anywhere else: nothing.
        let mut lone = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        lone.handle_local(Key::Group(g.clone()), 1);
        connected(&mut lone, 1, "b", &[]);
        assert!(lone.table().repick_elsewhere(&g, |_| true).is_none());
    }

    #[test]
    fn a_re_pick_skips_a_peer_the_caller_cannot_reach() {
        // The snapshot still names c (its connection just ended): every re-pick goes to b,
        // whatever c's turn in the round-robin, instead of landing on c and being lost.
        let g = group("jobs", "w");
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(&mut a, 1, "b", &[(Key::Group(g.clone()), 1)]);
        connected(&mut a, 2, "c", &[(Key::Group(g.clone()), 1)]);
        let table = a.table();
        let not_c = |n: &NodeId| *n != node("c");
        for _ in 0..4 {
            let (to, _) = table.repick_elsewhere(&g, not_c).expect("b can take it");
            assert_eq!(to, node("b"));
        }
        assert!(table.repick_elsewhere(&g, |_| false).is_none());
        // A forwarded copy whose member here left: on to b, never to c.
        let f = Forward {
            plain: false,
            groups: vec![g.clone()],
            visited: vec![node("x")],
        };
        for _ in 0..4 {
            let r = table.route_forwarded_where(&f, |_| false, not_c);
            assert_eq!(r.forward.len(), 1);
            assert_eq!(r.forward[0].0, node("b"));
            assert!(r.unplaced.is_empty());
        }
        let r = table.route_forwarded_where(&f, |_| false, |_| false);
        assert_eq!(r.unplaced, vec![g.clone()], "no reachable member: unplaced");
    }

    #[test]
    fn a_snapshot_too_large_for_one_message_goes_in_parts_and_arrives_whole() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let n = ENTRIES_PER_MESSAGE * 2 + 10;
        for i in 0..n {
            a.handle_local(plain(&format!("t/{i}")), 1);
        }
        while a.poll_output().is_some() {}
        assert!(a.handle_connected(Instant::now(), ConnId(1), node("b"), None, false));
        let mut sent = Vec::new();
        while let Some(out) = a.poll_output() {
            if let Output::Send { control, .. } = out {
                sent.push(control);
            }
        }
        assert_eq!(sent.len(), 3, "two parts and the snapshot");
        assert!(
            matches!(sent.last(), Some(Control::Snapshot { .. })),
            "the snapshot last"
        );
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 2, 1);
        assert!(b.handle_connected(Instant::now(), ConnId(1), node("a"), None, true));
        let last = sent.len() - 1;
        for (i, control) in sent.into_iter().enumerate() {
            // Each fits the codec's limit, and decodes to itself.
            let mut bytes = Vec::new();
            crate::mesh_codec::encode_control(&control, &mut bytes);
            assert!(bytes.len() < crate::mesh_codec::MAX_CONTROL);
            let (decoded, used) = crate::mesh_codec::decode_control(&bytes).expect("decodes");
            assert_eq!((used, &decoded), (bytes.len(), &control));
            assert!(b.handle_control(ConnId(1), decoded));
            if i < last {
                // Parts do not replace what is in force: the whole is swapped in at the end.
                assert_eq!(b.peer_interest(&node("a")).map(Interest::len), Some(0));
            }
        }
        assert_eq!(b.peer_interest(&node("a")).map(Interest::len), Some(n));
        // A later delta follows on.
        a.handle_local(plain("t/new"), 1);
        let delta = std::iter::from_fn(|| a.poll_output())
            .find_map(|o| match o {
                Output::Send { control, .. } => Some(control),
                _ => None,
            })
            .expect("a delta");
        assert!(b.handle_control(ConnId(1), delta));
        assert_eq!(b.peer_interest(&node("a")).map(Interest::len), Some(n + 1));
        // A part of a newer session waits for its snapshot; one of the session in force is late.
        assert!(b.handle_control(
            ConnId(1),
            Control::SnapshotPart {
                session: u64::MAX,
                seq: 99,
                updates: vec![Update {
                    key: plain("later"),
                    count: 1
                }]
            }
        ));
        assert_eq!(b.peer_interest(&node("a")).map(Interest::len), Some(n + 1));
    }

    /// Two addresses of the set reach the same node: when the one its connection was dialed
    /// to leaves the set, the node stays a peer (the other address still names it). It was
    /// disconnected, and the other address, counted as connected, was never dialed again.
    #[test]
    fn a_node_still_named_by_another_address_stays_a_peer() {
        let now = Instant::now();
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let (one, two): (SocketAddr, SocketAddr) = (
            "10.0.0.2:4242".parse().expect("addr"),
            "10.0.0.3:4242".parse().expect("addr"),
        );
        a.handle_peer_set(now, [one, two]);
        drain(&mut a);
        assert!(a.handle_connected(now, ConnId(1), node("b"), Some(one), true));
        assert!(!a.handle_connected(now, ConnId(2), node("b"), Some(two), true));
        assert_eq!(drain(&mut a).1, vec![(ConnId(2), DUPLICATE)]);
        a.handle_peer_set(now, [two]);
        assert_eq!(drain(&mut a).1, vec![], "nothing closed");
        assert_eq!(a.peers().collect::<Vec<_>>(), vec![(&node("b"), ConnId(1))]);
        // Lost later: the remaining address is dialed again.
        a.handle_disconnected(now, ConnId(1));
        let due = a.poll_timeout().expect("a redial");
        a.handle_timeout(due);
        assert_eq!(a.poll_output(), Some(Output::Dial(two)));
        // Out of the set as well: closed.
        assert!(a.handle_connected(due, ConnId(3), node("b"), Some(two), true));
        drain(&mut a);
        a.handle_peer_set(due, []);
        assert_eq!(drain(&mut a).1, vec![(ConnId(3), "no longer a peer")]);
    }

    /// A dial under way when its address leaves the set: the connection it makes is closed,
    /// as a connected peer's is when its address leaves. It was kept (a peer for as long as it
    /// lasted, although the set no longer named it).
    #[test]
    fn a_dial_that_completes_after_its_address_left_the_set_is_closed() {
        let (mut a, addr, now) = dialing_one_peer(MeshConfig::default());
        a.handle_peer_set(now, []);
        assert!(!a.handle_connected(now, ConnId(1), node("b"), Some(addr), true));
        assert_eq!(drain(&mut a).1, vec![(ConnId(1), "no longer a peer")]);
        assert_eq!(a.peers().count(), 0);
        assert_eq!(a.poll_timeout(), None, "and not dialed again");
        // Back in the set: dialed, and kept.
        a.handle_peer_set(now, [addr]);
        assert_eq!(a.poll_output(), Some(Output::Dial(addr)));
        assert!(a.handle_connected(now, ConnId(2), node("b"), Some(addr), true));
        assert_eq!(a.peers().collect::<Vec<_>>(), vec![(&node("b"), ConnId(2))]);
    }

    /// A second connection dialed to a peer whose first one works is held; when the peer's
    /// address then leaves the set, the held one is closed with the first. It stayed held, and
    /// the peer's snapshot on it made it the peer again (as a restart), for good.
    #[test]
    fn a_held_connection_is_closed_when_its_address_leaves_the_set() {
        let (mut a, addr, now) = dialing_one_peer(MeshConfig::default());
        connected_in_sync(&mut a, now, ConnId(1), addr, 0);
        assert!(!a.handle_connected(now, ConnId(2), node("b"), Some(addr), true));
        assert_eq!(drain(&mut a).1, vec![], "held, not closed");
        a.handle_peer_set(now, []);
        let mut closed = drain(&mut a).1;
        closed.sort();
        assert_eq!(
            closed,
            vec![
                (ConnId(1), "no longer a peer"),
                (ConnId(2), "no longer a peer")
            ]
        );
        let snapshot = Control::Snapshot {
            session: 2 << RUN_SHIFT,
            seq: 0,
            interest: Interest::default(),
        };
        a.handle_control(ConnId(2), snapshot);
        assert_eq!(a.peers().count(), 0, "not a peer again");
    }

    #[test]
    fn duplicate_connections_keep_the_smaller_dialer_on_both_sides() {
        let now = Instant::now();
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 2, 1);
        // a dialed (conn 1), b dialed (conn 2); each side sees both.
        assert!(a.handle_connected(now, ConnId(1), node("b"), None, true));
        assert!(!a.handle_connected(now, ConnId(2), node("b"), None, false));
        assert!(b.handle_connected(now, ConnId(2), node("a"), None, true));
        assert!(b.handle_connected(now, ConnId(1), node("a"), None, false));
        assert_eq!(a.peers().next().map(|(_, c)| c), Some(ConnId(1)));
        assert_eq!(b.peers().next().map(|(_, c)| c), Some(ConnId(1)));
    }

    /// `conn`, a connection to peer `b` at `addr`, is up and past the peer's snapshot of
    /// interest (`seq`); what it made `a` send is taken.
    fn connected_in_sync(a: &mut Mesh, now: Instant, conn: ConnId, addr: SocketAddr, seq: u64) {
        assert!(a.handle_connected(now, conn, node("b"), Some(addr), true));
        let snapshot = Control::Snapshot {
            session: 1,
            seq,
            interest: Interest::default(),
        };
        assert!(a.handle_control(conn, snapshot));
        while a.poll_output().is_some() {}
    }

    /// Node a with one peer address, its first dial made: (mesh, address, now).
    fn dialing_one_peer(cfg: MeshConfig) -> (Mesh, SocketAddr, Instant) {
        let mut a = Mesh::new(node("a"), cfg, 7, 1);
        let addr: SocketAddr = "10.0.0.2:4242".parse().expect("addr");
        let now = Instant::now();
        a.handle_peer_set(now, [addr]);
        assert_eq!(a.poll_output(), Some(Output::Dial(addr)));
        (a, addr, now)
    }

    /// `a` (dialing `addr`) connects `n` times to b; `on_connected` acts on each connection
    /// before it ends; returns the wait before each next dial.
    fn waits_between_connections(
        a: &mut Mesh,
        addr: SocketAddr,
        now: Instant,
        n: u64,
        mut on_connected: impl FnMut(&mut Mesh, ConnId),
    ) -> Vec<Duration> {
        let mut waits = Vec::new();
        for i in 0..n {
            let conn = ConnId(i + 1);
            assert!(a.handle_connected(now, conn, node("b"), Some(addr), true));
            on_connected(a, conn);
            while a.poll_output().is_some() {}
            a.handle_disconnected(now, conn);
            let at = a.poll_timeout().expect("scheduled");
            waits.push(at - now);
            a.handle_timeout(at);
            assert_eq!(a.poll_output(), Some(Output::Dial(addr)));
        }
        waits
    }

    /// A peer that takes the handshake and then closes the connection before saying anything
    /// (it refuses this node's certificate as a peer's) is redialed with a growing backoff, not
    /// within `backoff_min` every time; once a peer speaks, a reconnect is quick again.
    #[test]
    fn a_peer_that_refuses_after_the_handshake_is_redialed_with_a_growing_backoff() {
        let cfg = MeshConfig::default();
        let (mut a, addr, now) = dialing_one_peer(cfg);
        let waits = waits_between_connections(&mut a, addr, now, 12, |_, _| {});
        assert!(
            waits.iter().any(|w| *w > Duration::from_secs(5)),
            "{waits:?}"
        );
        after_a_plain_connection_the_wait_is_short(&mut a, addr, now, cfg);
    }

    /// `a` connects to b on `addr`, takes its (empty) snapshot, and the connection ends for
    /// no refusal: the wait before the next dial is back to at most `backoff_min`.
    fn after_a_plain_connection_the_wait_is_short(
        a: &mut Mesh,
        addr: SocketAddr,
        now: Instant,
        cfg: MeshConfig,
    ) {
        let conn = ConnId(100);
        connected_in_sync(a, now, conn, addr, 1);
        a.handle_disconnected(now, conn);
        let at = a.poll_timeout().expect("scheduled");
        assert!(at - now <= cfg.backoff_min, "{:?}", at - now);
    }

    /// A node refused for its interest, by this node or by itself, is redialed with a growing
    /// wait (the peer speaking first does not reset it); a connection that ends for another
    /// reason clears the count.
    #[test]
    fn a_refusal_for_interest_lengthens_the_wait_before_the_next_dial() {
        let cfg = MeshConfig {
            max_peer_interest: 1,
            ..MeshConfig::default()
        };
        let too_much = || {
            let mut i = Interest::default();
            i.add(plain("x"), 1);
            i.add(plain("y"), 1);
            i
        };
        let snapshot = |interest| Control::Snapshot {
            session: 1,
            seq: 0,
            interest,
        };
        for by_the_peer in [false, true] {
            let refuse = |a: &mut Mesh, conn| {
                if by_the_peer {
                    // b speaks (a takes its snapshot), then closes for a's interest.
                    assert!(a.handle_control(conn, snapshot(Interest::default())));
                    a.handle_refused_by_peer(conn);
                } else {
                    assert!(!a.handle_control(conn, snapshot(too_much())));
                }
            };
            let (mut a, addr, now) = dialing_one_peer(cfg);
            let waits = waits_between_connections(&mut a, addr, now, 8, refuse);
            // Were a refused connection counted as one that worked, every wait would be at
            // most backoff_min (250 ms).
            assert!(
                waits.iter().any(|w| *w > Duration::from_secs(2)),
                "by the peer: {by_the_peer}: {waits:?}"
            );
            // A connection that ends for another reason: the next wait is short again.
            after_a_plain_connection_the_wait_is_short(&mut a, addr, now, cfg);
            // Then a first refusal counts as REFUSED_ATTEMPTS failures at least, and the
            // connection itself as one more: the next wait is up to 4 * backoff_min.
            waits_between_connections(&mut a, addr, now, 1, refuse);
            assert_eq!(a.targets[&addr].attempts, REFUSED_ATTEMPTS + 1);
        }
    }

    /// A connection whose control stream breaks the protocol after the peer spoke (a version
    /// that does not understand this one's messages) is redialed with a growing wait, as a
    /// refused one is, not within `backoff_min` every time; the next connection that ends
    /// plainly makes the wait short again.
    #[test]
    fn a_connection_that_breaks_the_protocol_is_redialed_with_a_growing_wait() {
        let cfg = MeshConfig::default();
        let (mut a, addr, now) = dialing_one_peer(cfg);
        let mut waits = Vec::new();
        for i in 0..8 {
            let conn = ConnId(i + 1);
            connected_in_sync(&mut a, now, conn, addr, 0);
            a.handle_broken(now, conn);
            let at = a.poll_timeout().expect("scheduled");
            waits.push(at - now);
            a.handle_timeout(at);
            assert_eq!(a.poll_output(), Some(Output::Dial(addr)));
        }
        assert!(
            waits.iter().any(|w| *w > Duration::from_secs(2)),
            "{waits:?}"
        );
        assert!(a.peers().next().is_none(), "the broken connection is gone");
        after_a_plain_connection_the_wait_is_short(&mut a, addr, now, cfg);
    }

    /// A delta whose number skips one closes the connection as a protocol error: the reason
    /// the peer's node recognises, and a longer wait before the next dial. It closed with a
    /// reason of its own and was redialed within `backoff_min`.
    #[test]
    fn a_delta_out_of_order_is_a_protocol_error() {
        let (mut a, addr, now) = dialing_one_peer(MeshConfig::default());
        let conn = ConnId(1);
        connected_in_sync(&mut a, now, conn, addr, 5);
        let gap = Control::Delta {
            session: 1,
            seq: 7,
            updates: vec![],
        };
        assert!(!a.handle_control(conn, gap));
        assert_eq!(
            a.poll_output(),
            Some(Output::Close {
                conn,
                reason: PROTOCOL_ERROR
            })
        );
        a.handle_disconnected(now, conn);
        assert!(
            a.targets[&addr].attempts > REFUSED_ATTEMPTS,
            "a refusal's wait"
        );
    }

    /// What still comes on a connection closed for its interest is ignored: the rest of a
    /// snapshot whose parts went beyond the limit cannot put a part of it in force.
    #[test]
    fn what_comes_after_a_refusal_is_ignored() {
        let cfg = MeshConfig {
            max_peer_interest: 2,
            ..MeshConfig::default()
        };
        let mut a = Mesh::new(node("a"), cfg, 1, 1);
        assert!(a.handle_connected(Instant::now(), ConnId(1), node("b"), None, false));
        let part = |from: usize| Control::SnapshotPart {
            session: 1,
            seq: 0,
            updates: (from..from + 2)
                .map(|i| Update {
                    key: plain(&format!("t/{i}")),
                    count: 1,
                })
                .collect(),
        };
        assert!(a.handle_control(ConnId(1), part(0)));
        assert!(!a.handle_control(ConnId(1), part(2)), "beyond the limit");
        assert!(a.handle_control(ConnId(1), part(4)), "ignored");
        let mut last = Interest::default();
        last.add(plain("t/6"), 1);
        assert!(a.handle_control(
            ConnId(1),
            Control::Snapshot {
                session: 1,
                seq: 0,
                interest: last
            }
        ));
        assert_eq!(a.peer_interest(&node("b")).map(Interest::len), Some(0));
        let (_, closed) = drain(&mut a);
        assert_eq!(closed, vec![(ConnId(1), INTEREST_LIMIT)], "closed once");
    }

    #[test]
    fn backoff_is_bounded_with_full_jitter() {
        let cfg = MeshConfig::default();
        let (mut a, addr, now) = dialing_one_peer(cfg);
        let mut waits = Vec::new();
        for _ in 0..20 {
            a.handle_dial_failed(now, addr);
            let at = a.poll_timeout().expect("scheduled");
            waits.push(at - now);
            a.handle_timeout(at);
            assert_eq!(a.poll_output(), Some(Output::Dial(addr)));
        }
        assert!(waits.iter().all(|w| *w <= cfg.backoff_max));
        assert!(waits[0] <= cfg.backoff_min);
        assert!(
            waits.iter().any(|w| *w > Duration::from_secs(5)),
            "{waits:?}"
        );
    }

    #[test]
    fn a_node_never_dials_itself_again() {
        let now = Instant::now();
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let own: SocketAddr = "10.0.0.1:4242".parse().expect("addr");
        a.handle_peer_set(now, [own]);
        assert_eq!(a.poll_output(), Some(Output::Dial(own)));
        assert!(!a.handle_connected(now, ConnId(1), node("a"), Some(own), true));
        a.handle_peer_set(now, [own]);
        while let Some(o) = a.poll_output() {
            assert!(!matches!(o, Output::Dial(_)), "{o:?}");
        }
        assert_eq!(a.poll_timeout(), None);
    }

    #[test]
    fn late_messages_of_an_old_session_are_ignored_and_gaps_close() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(&mut a, 1, "b", &[(plain("x"), 1)]);
        assert!(a.handle_control(
            ConnId(1),
            Control::Snapshot {
                session: 5,
                seq: 0,
                interest: Interest::default()
            }
        ));
        // Late delta of session 1: ignored.
        assert!(a.handle_control(ConnId(1), delta(1, 1, &[(plain("y"), 1)])));
        assert_eq!(a.peer_interest(&node("b")), Some(&Interest::default()));
        // A gap in the current session: closed.
        assert!(!a.handle_control(ConnId(1), delta(5, 3, &[])));
    }

    /// A peer may hold `max_peer_interest` keys here and no more: a snapshot, the parts of one
    /// in progress, or a delta that goes beyond closes the connection with `INTEREST_LIMIT`,
    /// and the interest is forgotten at once (nothing is routed to it by the excess).
    #[test]
    fn a_peer_may_not_hold_more_interest_than_the_limit() {
        let keys = |from: usize, n: usize| -> Vec<Update> {
            (from..from + n)
                .map(|i| Update {
                    key: plain(&format!("t/{i}")),
                    count: 1,
                })
                .collect()
        };
        let whole = |updates: Vec<Update>| {
            let mut i = Interest::default();
            for u in &updates {
                i.apply(u);
            }
            i
        };
        let config = MeshConfig {
            max_peer_interest: 3,
            ..MeshConfig::default()
        };
        // Node a, connected to b on connection 1, with nothing queued.
        let fresh = || {
            let mut m = Mesh::new(node("a"), config, 1, 1);
            assert!(m.handle_connected(Instant::now(), ConnId(1), node("b"), None, false));
            let _ = drain(&mut m);
            m
        };
        let refused = |m: &mut Mesh| {
            let (_, closed) = drain(m);
            assert_eq!(closed, vec![(ConnId(1), INTEREST_LIMIT)]);
            assert_eq!(m.peer_interest(&node("b")).map(Interest::len), Some(0));
        };

        // At the limit: kept.
        let mut a = fresh();
        let snapshot = |interest| Control::Snapshot {
            session: 1,
            seq: 0,
            interest,
        };
        assert!(a.handle_control(ConnId(1), snapshot(whole(keys(0, 3)))));
        assert_eq!(a.peer_interest(&node("b")).map(Interest::len), Some(3));
        assert_eq!(drain(&mut a).1, vec![]);
        // A delta that removes one and one that adds it back are fine; one more key is not.
        let keys_delta = |seq, updates| Control::Delta {
            session: 1,
            seq,
            updates,
        };
        assert!(a.handle_control(ConnId(1), delta(1, 1, &[(plain("t/0"), 0)])));
        assert!(a.handle_control(ConnId(1), keys_delta(2, keys(0, 1))));
        assert_eq!(drain(&mut a).1, vec![]);
        assert!(!a.handle_control(ConnId(1), keys_delta(3, keys(3, 1))));
        refused(&mut a);

        // A snapshot beyond it.
        let mut a = fresh();
        assert!(!a.handle_control(ConnId(1), snapshot(whole(keys(0, 4)))));
        refused(&mut a);

        // Parts beyond it, before their snapshot comes.
        let mut a = fresh();
        let part = |updates| Control::SnapshotPart {
            session: 1,
            seq: 0,
            updates,
        };
        assert!(a.handle_control(ConnId(1), part(keys(0, 2))));
        assert!(!a.handle_control(ConnId(1), part(keys(2, 2))));
        refused(&mut a);

        // Parts within it whose snapshot brings the whole beyond it.
        let mut a = fresh();
        assert!(a.handle_control(ConnId(1), part(keys(0, 2))));
        assert!(!a.handle_control(ConnId(1), snapshot(whole(keys(2, 2)))));
        refused(&mut a);
    }

    /// What `m` queued: the control messages per connection, and the connections it closed.
    #[allow(clippy::type_complexity)]
    fn drain(m: &mut Mesh) -> (Vec<(ConnId, Control)>, Vec<(ConnId, &'static str)>) {
        let (mut sent, mut closed) = (Vec::new(), Vec::new());
        while let Some(out) = m.poll_output() {
            match out {
                Output::Send { conn, control } => sent.push((conn, control)),
                Output::Close { conn, reason } => closed.push((conn, reason)),
                Output::Dial(_) => {}
            }
        }
        (sent, closed)
    }

    /// Hand what `from` sent on `conn` to `to`; returns what `from` closed.
    fn pass(from: &mut Mesh, to: &mut Mesh, conn: u64) -> Vec<(ConnId, &'static str)> {
        let (sent, closed) = drain(from);
        for (c, control) in sent {
            if c == ConnId(conn) {
                assert!(to.handle_control(c, control), "taken");
            }
        }
        closed
    }

    /// a dialed b (conn 1); both sent their snapshots and were heard.
    fn pair(b_run: u64) -> (Mesh, Mesh) {
        let now = Instant::now();
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 2, b_run);
        assert!(a.handle_connected(now, ConnId(1), node("b"), None, true));
        assert!(b.handle_connected(now, ConnId(1), node("a"), None, false));
        assert!(pass(&mut a, &mut b, 1).is_empty());
        assert!(pass(&mut b, &mut a, 1).is_empty());
        (a, b)
    }

    /// A peer that restarted within the idle timeout dials again while this node still holds
    /// its old, dead connection, which the duplicate rule kept (the smaller id dialed it): the
    /// peer was refused until the dead one timed out (~12 s). Its first message, from a later
    /// run, now makes the new connection the one in use at once.
    #[test]
    fn a_peer_restarted_within_the_idle_timeout_is_taken_at_its_first_message() {
        let now = Instant::now();
        let (mut a, _old_b) = pair(1);
        // b starts again (a later run) and dials a: conn 2.
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 3, 2);
        b.handle_local(plain("b/new"), 1);
        assert!(b.handle_connected(now, ConnId(2), node("a"), None, true));
        assert!(!a.handle_connected(now, ConnId(2), node("b"), None, false));
        // Meanwhile a's own interest changes: deltas go on the connection in use only.
        a.handle_local(plain("a/x"), 1);
        let closed = pass(&mut a, &mut b, 2);
        assert!(closed.is_empty(), "held, not closed: {closed:?}");
        let closed = pass(&mut b, &mut a, 2);
        assert!(closed.is_empty());
        let (sent, closed) = drain(&mut a);
        assert_eq!(
            closed,
            vec![(ConnId(1), RESTARTED)],
            "the dead one is closed"
        );
        assert_eq!(a.peers().collect::<Vec<_>>(), vec![(&node("b"), ConnId(2))]);
        assert!(a
            .peer_interest(&node("b"))
            .is_some_and(|i| i.count(&plain("b/new")) == 1));
        // b learns a's interest, the change made while held included, without a gap.
        for (c, control) in sent {
            if c == ConnId(2) {
                assert!(b.handle_control(c, control));
            }
        }
        assert!(b
            .peer_interest(&node("a"))
            .is_some_and(|i| i.count(&plain("a/x")) == 1));
        a.handle_local(plain("a/y"), 1);
        assert!(pass(&mut a, &mut b, 2).is_empty());
        assert!(b
            .peer_interest(&node("a"))
            .is_some_and(|i| i.count(&plain("a/y")) == 1));
    }

    /// Both ends dialed while the first connection already worked (same run): the second is
    /// held on both sides and then retired on both, as before.
    #[test]
    fn a_duplicate_of_a_working_connection_from_the_same_run_is_retired() {
        let now = Instant::now();
        let (mut a, mut b) = pair(1);
        assert!(!b.handle_connected(now, ConnId(2), node("a"), None, true));
        assert!(!a.handle_connected(now, ConnId(2), node("b"), None, false));
        let (a_sent, a_closed) = drain(&mut a);
        let (b_sent, b_closed) = drain(&mut b);
        assert!(a_closed.is_empty() && b_closed.is_empty(), "held first");
        for (c, control) in a_sent {
            assert!(b.handle_control(c, control));
        }
        for (c, control) in b_sent {
            assert!(a.handle_control(c, control));
        }
        for m in [&mut a, &mut b] {
            assert_eq!(drain(m).1, vec![(ConnId(2), DUPLICATE)]);
            assert_eq!(
                m.peers().map(|(_, c)| c).collect::<Vec<_>>(),
                vec![ConnId(1)]
            );
        }
    }

    /// Both dial at once: `a` (the smaller id) meets `b`'s connection (2) before `b` has spoken
    /// on `a`'s own (1), so it retires 2 without a word; `b` has heard `a` on 1 already and
    /// holds 2. When `a`'s retirement reaches `b` (the transport sees the peer finish its
    /// side), `b` retires 2 at once; it waited `HOLD_WAIT` for a control message that never
    /// came, and the two ends warned.
    #[test]
    fn a_held_connection_the_peer_retires_is_retired_at_once() {
        let now = Instant::now();
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        let mut b = Mesh::new(node("b"), MeshConfig::default(), 2, 1);
        // 1: dialed by a. a has not heard b on it yet.
        assert!(a.handle_connected(now, ConnId(1), node("b"), None, true));
        assert!(b.handle_connected(now, ConnId(1), node("a"), None, false));
        let (a_sent, _) = drain(&mut a);
        for (c, control) in a_sent {
            assert!(b.handle_control(c, control));
        }
        // 2: dialed by b. a retires it at once (1 has not worked for a yet); b holds it.
        assert!(!a.handle_connected(now, ConnId(2), node("b"), None, false));
        assert_eq!(drain(&mut a).1, vec![(ConnId(2), DUPLICATE)]);
        assert!(!b.handle_connected(now, ConnId(2), node("a"), None, true));
        assert!(drain(&mut b).1.is_empty(), "held");
        b.handle_peer_retired(ConnId(2));
        assert_eq!(drain(&mut b).1, vec![(ConnId(2), DUPLICATE)]);
        assert_eq!(b.poll_timeout(), None, "no hold left to time out");
        for m in [&a, &b] {
            assert_eq!(
                m.peers().map(|(_, c)| c).collect::<Vec<_>>(),
                vec![ConnId(1)]
            );
        }
        // A kept connection is the transport's to judge: nothing happens here.
        b.handle_peer_retired(ConnId(1));
        assert!(drain(&mut b).1.is_empty());
    }

    /// A held connection on which the peer says nothing is retired after `HOLD_WAIT`.
    #[test]
    fn a_held_connection_that_stays_silent_is_retired() {
        let now = Instant::now();
        let (mut a, _b) = pair(1);
        assert!(!a.handle_connected(now, ConnId(2), node("b"), None, false));
        drain(&mut a);
        assert!(a.poll_timeout().is_some_and(|t| t <= now + HOLD_WAIT));
        a.handle_timeout(now + HOLD_WAIT);
        assert_eq!(drain(&mut a).1, vec![(ConnId(2), DUPLICATE)]);
        assert_eq!(a.poll_timeout(), None);
        assert_eq!(
            a.peers().map(|(_, c)| c).collect::<Vec<_>>(),
            vec![ConnId(1)]
        );
    }

    /// A peer's snapshot numbered u64::MAX, then a delta: a gap like any other (the connection
    /// is closed), not an overflow (which panicked the mesh driver in a debug build).
    #[test]
    fn a_delta_after_the_last_sequence_number_is_a_gap_not_an_overflow() {
        let mut a = Mesh::new(node("a"), MeshConfig::default(), 1, 1);
        connected(&mut a, 1, "b", &[]);
        assert!(a.handle_control(
            ConnId(1),
            Control::Snapshot {
                session: 5,
                seq: u64::MAX,
                interest: Interest::default()
            }
        ));
        assert!(!a.handle_control(ConnId(1), delta(5, 0, &[])));
    }
}
