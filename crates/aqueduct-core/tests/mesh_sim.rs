//! Several mesh nodes over an in-memory network, driven through random subscriptions, partitions,
//! kills and restarts (with messages of dead connections still arriving late), then healed. After
//! it settles, the mesh must be whole and exact: one connection per pair, every node's view of
//! every peer's interest equal to that peer's own, and every message published anywhere reaching
//! each matching plain subscriber exactly once and each matching group exactly once, forwarded
//! only to nodes that want it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aqueduct_core::mesh::{
    ConnId, Control, Forward, GroupKey, Key, Mesh, MeshConfig, NodeId, Output,
};
use aqueduct_proto::{GroupId, TopicFilter, TopicName};
use proptest::prelude::*;

const NODES: usize = 4;

fn keys() -> Vec<Key> {
    let f = |s: &str| TopicFilter::try_from(s).expect("filter");
    let g = |s: &str| GroupId::try_from(s).expect("group");
    vec![
        Key::Plain(f("a/#")),
        Key::Plain(f("a/b")),
        Key::Plain(f("+/b")),
        Key::Plain(f("c")),
        Key::Group(GroupKey {
            filter: f("a/#"),
            group: g("g1"),
        }),
        Key::Group(GroupKey {
            filter: f("+/b"),
            group: g("g2"),
        }),
        Key::Group(GroupKey {
            filter: f("c"),
            group: g("g1"),
        }),
    ]
}

const TOPICS: &[&str] = &["a/b", "c", "a", "x/b", "zz"];

#[derive(Debug, Clone)]
enum Op {
    Sub(usize, usize),
    Unsub(usize, usize),
    Partition(usize, usize),
    Heal(usize, usize),
    Kill(usize),
    Restart(usize),
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let n = 0..NODES;
    prop_oneof![
        4 => (n.clone(), 0..7usize).prop_map(|(a, k)| Op::Sub(a, k)),
        2 => (n.clone(), 0..7usize).prop_map(|(a, k)| Op::Unsub(a, k)),
        1 => (n.clone(), n.clone()).prop_map(|(a, b)| Op::Partition(a, b)),
        1 => (n.clone(), n.clone()).prop_map(|(a, b)| Op::Heal(a, b)),
        1 => n.clone().prop_map(Op::Kill),
        1 => n.clone().prop_map(Op::Restart),
        2 => (0..40_000u64).prop_map(Op::Tick),
    ]
}

struct Node {
    id: NodeId,
    addr: SocketAddr,
    mesh: Mesh,
    up: bool,
    lives: u64,
    /// Local subscriptions: key → count.
    subs: BTreeMap<Key, u32>,
}

struct Conn {
    /// (node index, connection seen from there as outbound)
    ends: [usize; 2],
    /// Control messages in flight towards ends[0] and ends[1].
    inbox: [VecDeque<Control>; 2],
}

struct Net {
    now: Instant,
    nodes: Vec<Node>,
    conns: BTreeMap<ConnId, Conn>,
    /// Messages of closed connections still on their way (delivered late, to be ignored).
    stale: Vec<(usize, ConnId, Control)>,
    cut: BTreeSet<(usize, usize)>,
    next_conn: u64,
}

fn pair(a: usize, b: usize) -> (usize, usize) {
    (a.min(b), a.max(b))
}

impl Net {
    fn new() -> Net {
        let now = Instant::now();
        let nodes = (0..NODES)
            .map(|i| {
                let id = NodeId::try_from(format!("node-{i}").as_str()).expect("id");
                Node {
                    mesh: Mesh::new(id.clone(), MeshConfig::default(), 1 + i as u64, 1),
                    id,
                    addr: format!("10.0.0.{}:4242", i + 1).parse().expect("addr"),
                    up: true,
                    lives: 1,
                    subs: BTreeMap::new(),
                }
            })
            .collect();
        let mut net = Net {
            now,
            nodes,
            conns: BTreeMap::new(),
            stale: Vec::new(),
            cut: BTreeSet::new(),
            next_conn: 1,
        };
        for i in 0..NODES {
            net.announce(i);
        }
        net
    }

    /// Give node `i` the whole peer set, its own address included (as DNS would).
    fn announce(&mut self, i: usize) {
        let addrs: Vec<SocketAddr> = self.nodes.iter().map(|n| n.addr).collect();
        let now = self.now;
        self.nodes[i].mesh.handle_peer_set(now, addrs);
    }

    fn close(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            for (side, q) in c.inbox.into_iter().enumerate() {
                for m in q {
                    self.stale.push((c.ends[side], conn, m));
                }
            }
            let now = self.now;
            for e in c.ends {
                self.nodes[e].mesh.handle_disconnected(now, conn);
            }
        }
    }

    fn kill(&mut self, i: usize) {
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.ends.contains(&i))
            .map(|(id, _)| *id)
            .collect();
        for c in conns {
            self.close(c);
        }
        self.nodes[i].up = false;
    }

    fn restart(&mut self, i: usize) {
        if self.nodes[i].up {
            return;
        }
        let node = &mut self.nodes[i];
        node.lives += 1;
        node.mesh = Mesh::new(
            node.id.clone(),
            MeshConfig::default(),
            100 + i as u64,
            node.lives,
        );
        node.up = true;
        // Its clients subscribe again.
        for (k, n) in node.subs.clone() {
            node.mesh.handle_local(k.clone(), i64::from(n));
        }
        self.announce(i);
    }

    fn partition(&mut self, a: usize, b: usize) {
        if a == b {
            return;
        }
        self.cut.insert(pair(a, b));
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| pair(c.ends[0], c.ends[1]) == pair(a, b))
            .map(|(id, _)| *id)
            .collect();
        for c in conns {
            self.close(c);
        }
    }

    /// Run until nothing moves (bounded).
    fn settle(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            for i in 0..NODES {
                while let Some(o) = self.nodes[i].mesh.poll_output() {
                    moved = true;
                    if self.nodes[i].up {
                        self.carry(i, o);
                    }
                }
            }
            // One message per connection direction per round: interleaves connections.
            let ids: Vec<ConnId> = self.conns.keys().copied().collect();
            for id in ids {
                for side in 0..2 {
                    let Some(c) = self.conns.get_mut(&id) else {
                        break;
                    };
                    let Some(m) = c.inbox[side].pop_front() else {
                        continue;
                    };
                    let to = c.ends[side];
                    moved = true;
                    if !self.nodes[to].mesh.handle_control(id, m) {
                        self.close(id);
                    }
                }
            }
            // Late messages of dead connections arrive too, and must change nothing.
            for (to, id, m) in std::mem::take(&mut self.stale) {
                if self.nodes[to].up {
                    let _ = self.nodes[to].mesh.handle_control(id, m);
                }
            }
            if !moved {
                return;
            }
        }
        panic!("the mesh did not settle");
    }

    fn carry(&mut self, from: usize, o: Output) {
        match o {
            Output::Dial(addr) => {
                let now = self.now;
                let to = self.nodes.iter().position(|n| n.addr == addr);
                let reachable = to.filter(|&t| {
                    self.nodes[t].up && (t == from || !self.cut.contains(&pair(from, t)))
                });
                let Some(to) = reachable else {
                    self.nodes[from].mesh.handle_dial_failed(now, addr);
                    return;
                };
                let id = ConnId(self.next_conn);
                self.next_conn += 1;
                self.conns.insert(
                    id,
                    Conn {
                        ends: [from, to],
                        inbox: [VecDeque::new(), VecDeque::new()],
                    },
                );
                let (from_id, to_id) = (self.nodes[from].id.clone(), self.nodes[to].id.clone());
                let kept_out =
                    self.nodes[from]
                        .mesh
                        .handle_connected(now, id, to_id, Some(addr), true);
                let kept_in = from == to
                    || self.nodes[to]
                        .mesh
                        .handle_connected(now, id, from_id, None, false);
                if !kept_out || !kept_in {
                    self.close(id);
                }
            }
            Output::Close { conn, .. } => self.close(conn),
            Output::Send { conn, control } => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    let side = if c.ends[0] == from { 1 } else { 0 };
                    c.inbox[side].push_back(control);
                }
            }
        }
    }

    fn tick(&mut self, ms: u64) {
        self.now += Duration::from_millis(ms);
        let now = self.now;
        for n in &mut self.nodes {
            if n.up {
                n.mesh.handle_timeout(now);
            }
        }
    }

    /// Heal everything, restart the dead, and let reconnects (bounded by the backoff) happen.
    fn heal_all(&mut self) {
        self.cut.clear();
        for i in 0..NODES {
            self.restart(i);
        }
        for _ in 0..20 {
            self.settle();
            self.tick(31_000);
        }
        self.settle();
    }
}

fn apply(net: &mut Net, op: &Op) {
    let all = keys();
    match *op {
        Op::Sub(i, k) if net.nodes[i].up => {
            *net.nodes[i].subs.entry(all[k].clone()).or_default() += 1;
            net.nodes[i].mesh.handle_local(all[k].clone(), 1);
        }
        Op::Unsub(i, k) if net.nodes[i].up => {
            let n = net.nodes[i].subs.entry(all[k].clone()).or_default();
            if *n > 0 {
                *n -= 1;
                net.nodes[i].mesh.handle_local(all[k].clone(), -1);
            }
        }
        Op::Partition(a, b) => net.partition(a, b),
        Op::Heal(a, b) => {
            net.cut.remove(&pair(a, b));
        }
        Op::Kill(i) => net.kill(i),
        Op::Restart(i) => net.restart(i),
        Op::Tick(ms) => net.tick(ms),
        _ => {}
    }
    net.settle();
}

/// Publish `topic` on `origin`; count deliveries per (node, key): plain subscribers get one each
/// per delivery to their node, a group one per message.
fn publish(
    net: &mut Net,
    origin: usize,
    topic: &TopicName,
) -> (BTreeMap<(usize, Key), u32>, BTreeSet<usize>) {
    let mut got: BTreeMap<(usize, Key), u32> = BTreeMap::new();
    let mut forwarded_to = BTreeSet::new();
    let deliver_plain = |got: &mut BTreeMap<(usize, Key), u32>, net: &Net, at: usize| {
        for (k, n) in &net.nodes[at].subs {
            if let Key::Plain(f) = k {
                if *n > 0 && aqueduct_core::matching::matches(f, topic) {
                    *got.entry((at, k.clone())).or_default() += 1;
                }
            }
        }
    };
    deliver_plain(&mut got, net, origin);
    let r = net.nodes[origin].mesh.route(topic);
    let mut work: Vec<(usize, Forward)> = Vec::new();
    for g in r.local_groups {
        *got.entry((origin, Key::Group(g))).or_default() += 1;
    }
    for (node, f) in r.forward {
        let at = net
            .nodes
            .iter()
            .position(|n| n.id == node)
            .expect("a known node");
        work.push((at, f));
    }
    while let Some((at, f)) = work.pop() {
        forwarded_to.insert(at);
        if f.plain {
            deliver_plain(&mut got, net, at);
        }
        let r = net.nodes[at].mesh.route_forwarded(&f);
        for g in r.local_groups {
            *got.entry((at, Key::Group(g))).or_default() += 1;
        }
        for (node, f) in r.forward {
            let next = net
                .nodes
                .iter()
                .position(|n| n.id == node)
                .expect("a known node");
            work.push((next, f));
        }
    }
    (got, forwarded_to)
}

fn check(net: &mut Net) {
    // One connection per pair, the same one seen from both sides.
    for i in 0..NODES {
        let peers: Vec<(NodeId, ConnId)> = net.nodes[i]
            .mesh
            .peers()
            .map(|(n, c)| (n.clone(), c))
            .collect();
        assert_eq!(peers.len(), NODES - 1, "node {i} peers {peers:?}");
        for (n, c) in &peers {
            let j = net.nodes.iter().position(|x| &x.id == n).expect("known");
            let back: Vec<ConnId> = net.nodes[j]
                .mesh
                .peers()
                .filter(|(m, _)| **m == net.nodes[i].id)
                .map(|(_, c)| c)
                .collect();
            assert_eq!(
                back,
                vec![*c],
                "nodes {i} and {j} disagree on their connection"
            );
            // Each node knows exactly what its peers want.
            assert_eq!(
                net.nodes[i].mesh.peer_interest(n),
                Some(net.nodes[j].mesh.local()),
                "node {i}'s view of node {j}"
            );
        }
    }
    // Delivery: exactly once per subscriber and per group, forwarded only where wanted.
    for origin in 0..NODES {
        for t in TOPICS {
            let topic = TopicName::try_from(*t).expect("topic");
            let (got, forwarded_to) = publish(net, origin, &topic);
            for (i, node) in net.nodes.iter().enumerate() {
                let mut wanted = false;
                for (k, n) in &node.subs {
                    if *n == 0 {
                        continue;
                    }
                    if let Key::Plain(f) = k {
                        if aqueduct_core::matching::matches(f, &topic) {
                            wanted |= i != origin;
                            assert_eq!(
                                got.get(&(i, k.clone())),
                                Some(&1),
                                "{t} from {origin} to plain {k:?} at {i}"
                            );
                        }
                    }
                }
                let picked_here = got
                    .keys()
                    .any(|(at, k)| *at == i && matches!(k, Key::Group(_)));
                if forwarded_to.contains(&i) {
                    assert!(
                        wanted || picked_here,
                        "{t} from {origin} forwarded to {i}, which wants nothing of it"
                    );
                }
            }
            // Each group with a member anywhere: exactly once.
            let mut groups: BTreeSet<GroupKey> = BTreeSet::new();
            for node in &net.nodes {
                for (k, n) in &node.subs {
                    if let Key::Group(g) = k {
                        if *n > 0 && aqueduct_core::matching::matches(&g.filter, &topic) {
                            groups.insert(g.clone());
                        }
                    }
                }
            }
            for g in &groups {
                let total: u32 = got
                    .iter()
                    .filter(|((_, k), _)| *k == Key::Group(g.clone()))
                    .map(|(_, n)| *n)
                    .sum();
                assert_eq!(
                    total, 1,
                    "{t} from {origin}: group {g:?} got it {total} times"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_mesh_heals_and_delivers_exactly_once(ops in prop::collection::vec(op(), 0..60)) {
        let mut net = Net::new();
        net.settle();
        for op in &ops {
            apply(&mut net, op);
        }
        net.heal_all();
        check(&mut net);
    }
}

/// Group members spread over three nodes get a message each in turn, wherever it is published.
#[test]
fn a_group_across_nodes_is_served_round_robin() {
    let mut net = Net::new();
    net.heal_all();
    let g = keys()[4].clone();
    for i in 0..3 {
        apply(&mut net, &Op::Sub(i, 4));
    }
    let topic = TopicName::try_from("a/b").expect("topic");
    let mut per_node = [0u32; NODES];
    for _ in 0..30 {
        let (got, _) = publish(&mut net, 3, &topic);
        for ((at, k), n) in got {
            if k == g {
                per_node[at] += n;
            }
        }
    }
    assert_eq!(per_node, [10, 10, 10, 0]);
}
