//! The cluster mesh between in-process brokers on 127.0.0.1: connections, interest, forwarding
//! to plain subscribers and to consumer groups with members on several nodes.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use aqueduct_core::mesh::Key;
use aqueduct_proto::TopicFilter;
use aqueduct_server::config::{ClusterConfig, Compression};
use common::relay::Relay;
use common::*;

struct Cluster {
    nodes: Vec<TestBroker>,
    _dir: tempfile::TempDir,
}

/// Stop each node gracefully (each must shut down cleanly).
async fn stop_all(nodes: impl IntoIterator<Item = TestBroker>) {
    for b in nodes {
        b.stop().await.expect("clean shutdown");
    }
}

/// A resolver whose answer the test sets.
#[derive(Debug, Default)]
struct FakeDns(std::sync::Mutex<Vec<SocketAddr>>);

impl aqueduct_server::discovery::Resolver for FakeDns {
    fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> aqueduct_server::discovery::Lookup<'a> {
        let answer = self.0.lock().expect("lock").clone();
        Box::pin(async move { Ok(answer) })
    }
}

/// A cluster CA in a temporary directory, which holds the certificates it signs too.
struct ClusterCa {
    dir: tempfile::TempDir,
    ca: TestCa,
    file: std::path::PathBuf,
}

impl ClusterCa {
    fn new() -> ClusterCa {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = test_ca();
        let file = ca.write(dir.path());
        ClusterCa { dir, ca, file }
    }

    /// The cluster settings of node `node` (its peer certificate signed by this CA), with DNS
    /// discovery when given.
    fn node(&self, node: &str, discovery: Option<(String, u16, Duration)>) -> ClusterConfig {
        let (cert, key) = self.ca.peer(self.dir.path(), node);
        ClusterConfig {
            enabled: true,
            peers: Vec::new(),
            ca_file: Some(self.file.clone()),
            cert_file: Some(cert),
            key_file: Some(key),
            crl_file: None,
            compression: Compression::None,
            peer_queue_size: 1024,
            max_peer_interest: 1 << 20,
            discovery,
        }
    }

    /// A node of this cluster, on its own.
    async fn lone_node(&self, node: &str) -> TestBroker {
        let cfg = self.node(node, None);
        TestBroker::start_with(|c| c.cluster = cfg).await
    }
}

/// DNS discovery with a fake resolver: the service scales 3 → 5 → 2 and every node's peer set
/// follows within about one interval (the wait allows a few, for a loaded machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_follows_the_service_as_it_scales() {
    let ca = ClusterCa::new();
    let dns = std::sync::Arc::new(FakeDns::default());
    let interval = Duration::from_millis(200);
    let start = |i: usize| {
        let cfg = ca.node(
            &format!("node-{i}"),
            Some(("aqueduct-headless".into(), 4242, interval)),
        );
        let resolver = dns.clone();
        async move { TestBroker::start_custom(|c| c.cluster = cfg, |s| s.set_resolver(resolver)).await }
    };
    let others = |i: usize, n: usize| -> BTreeSet<String> {
        (0..n)
            .filter(|j| *j != i)
            .map(|j| format!("node-{j}"))
            .collect()
    };
    // Three pods; the headless Service lists them (each node finds itself in it too).
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start(i).await);
    }
    *dns.0.lock().expect("lock") = nodes.iter().map(|b| b.addr).collect();
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see 3 nodes"), || {
            peers_of(b) == others(i, 3)
        })
        .await;
    }
    // Scale to 5.
    for i in 3..5 {
        nodes.push(start(i).await);
    }
    *dns.0.lock().expect("lock") = nodes.iter().map(|b| b.addr).collect();
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see 5 nodes"), || {
            peers_of(b) == others(i, 5)
        })
        .await;
    }
    // Scale to 2: the Service lists two, the other pods stop.
    *dns.0.lock().expect("lock") = nodes[..2].iter().map(|b| b.addr).collect();
    stop_all(nodes.drain(2..)).await;
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see 2 nodes"), || {
            peers_of(b) == others(i, 2)
        })
        .await;
    }
    stop_all(nodes).await;
}

async fn cluster(n: usize) -> Cluster {
    cluster_with(n, Compression::None).await
}

async fn cluster_with(n: usize, compression: Compression) -> Cluster {
    let c = unjoined(n, |_, c| c.cluster.compression = compression).await;
    // Every node gets every address, its own included (as DNS would answer).
    let addrs: Vec<SocketAddr> = c.nodes.iter().map(|b| b.addr).collect();
    for b in &c.nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    c
}

/// `n` nodes `node-0`.. of one cluster CA, not told of each other yet; `adjust(i, config)`
/// configures node `i` further.
async fn unjoined(n: usize, adjust: impl Fn(usize, &mut aqueduct_server::Config)) -> Cluster {
    let ca = ClusterCa::new();
    let mut nodes = Vec::new();
    for i in 0..n {
        let cfg = ca.node(&format!("node-{i}"), None);
        nodes.push(
            TestBroker::start_with(|c| {
                c.cluster = cfg;
                adjust(i, c);
            })
            .await,
        );
    }
    Cluster {
        nodes,
        _dir: ca.dir,
    }
}

fn peers_of(b: &TestBroker) -> BTreeSet<String> {
    b.control
        .mesh()
        .expect("cluster on")
        .view()
        .into_iter()
        .map(|(n, _)| n.to_string())
        .collect()
}

fn wants(b: &TestBroker, peer: &str, filter: &str) -> bool {
    let key = Key::Plain(TopicFilter::try_from(filter).expect("filter"));
    b.control
        .mesh()
        .expect("cluster on")
        .view()
        .into_iter()
        .any(|(n, i)| n.as_str() == peer && i.count(&key) > 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_a_full_mesh_and_share_interest() {
    let c = cluster(3).await;
    for (i, b) in c.nodes.iter().enumerate() {
        let want: BTreeSet<String> = (0..3)
            .filter(|j| *j != i)
            .map(|j| format!("node-{j}"))
            .collect();
        until(&format!("node-{i} to see its two peers"), || {
            peers_of(b) == want
        })
        .await;
    }
    // When both ends of a pair dialed, the connection neither keeps is closed, not left open:
    // each node ends with exactly its two peers' connections.
    for (i, b) in c.nodes.iter().enumerate() {
        until(
            &format!("node-{i}'s duplicate connections to close"),
            || b.control.open_connections() == 2,
        )
        .await;
    }
    // A subscription on node 1 becomes interest that nodes 0 and 2 know of, and goes again.
    let client = c.nodes[1].client().await;
    let sub = client.subscribe("orders/#").await.expect("subscribe");
    until("nodes 0 and 2 to learn node-1's interest", || {
        wants(&c.nodes[0], "node-1", "orders/#") && wants(&c.nodes[2], "node-1", "orders/#")
    })
    .await;
    sub.unsubscribe().await.expect("unsubscribe");
    until("the interest to go", || {
        !wants(&c.nodes[0], "node-1", "orders/#") && !wants(&c.nodes[2], "node-1", "orders/#")
    })
    .await;
    // A node that stops leaves the others' views.
    let mut nodes = c.nodes;
    let gone = nodes.pop().expect("node 2");
    gone.stop().await.expect("clean shutdown");
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to drop node-2"), || {
            !peers_of(b).contains("node-2")
        })
        .await;
    }
    stop_all(nodes).await;
}

/// A node holds at most `cluster.max_peer_interest` keys for a peer: node 0 allows 2, and
/// node 1's third subscription closes their connection, counted; node 0 forgets node 1's
/// interest. Once node 1 is back within the limit, they connect again and the interest is
/// shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_more_interest_than_the_limit_is_disconnected() {
    let c = unjoined(2, |i, c| {
        if i == 0 {
            c.cluster.max_peer_interest = 2;
        }
    })
    .await;
    let addrs: Vec<SocketAddr> = c.nodes.iter().map(|b| b.addr).collect();
    for b in &c.nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    formed(&c).await;
    let mesh0 = c.nodes[0].control.mesh().expect("cluster on");
    let refused = || {
        mesh0
            .interest_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let client = c.nodes[1].client().await;
    let a = client.subscribe("a").await.expect("subscribe");
    let b = client.subscribe("b/#").await.expect("subscribe");
    until("node 0 to learn node 1's two filters", || {
        wants(&c.nodes[0], "node-1", "a") && wants(&c.nodes[0], "node-1", "b/#")
    })
    .await;
    assert_eq!(refused(), 0, "at the limit is allowed");
    let third = client.subscribe("c").await.expect("subscribe");
    // The whole of it is forgotten (not only the key beyond); a reconnect's snapshot of three
    // keys is refused too, so it stays forgotten while the third subscription lasts.
    until("node 0 to refuse node 1's interest and forget it", || {
        refused() >= 1
            && ["a", "b/#", "c"]
                .iter()
                .all(|f| !wants(&c.nodes[0], "node-1", f))
    })
    .await;
    // Node 1 sees why (the close reason) and counts it.
    let mesh1 = c.nodes[1].control.mesh().expect("cluster on");
    until("node 1 to see its interest refused", || {
        mesh1
            .refused_by_peer
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    // Node 1 redials (after a growing wait) and is refused again while it has three.
    until("node 0 to refuse node 1's next connection too", || {
        refused() >= 2
    })
    .await;
    assert!(
        ["a", "b/#", "c"]
            .iter()
            .all(|f| !wants(&c.nodes[0], "node-1", f)),
        "still forgotten"
    );
    // Back within the limit: the next connection's snapshot is taken.
    third.unsubscribe().await.expect("unsubscribe");
    until("node 0 to learn node 1's interest again", || {
        wants(&c.nodes[0], "node-1", "a") && wants(&c.nodes[0], "node-1", "b/#")
    })
    .await;
    drop((a, b));
    stop_all(c.nodes).await;
}

async fn formed(c: &Cluster) {
    let n = c.nodes.len();
    for (i, b) in c.nodes.iter().enumerate() {
        until(&format!("node-{i} to see its peers"), || {
            peers_of(b).len() == n - 1
        })
        .await;
    }
}

/// Nodes on IPv6 sockets (as the default `":4242"` binds, dual stack) dial their peers' IPv4
/// addresses (what DNS discovery gives in most clusters): the mesh forms and copies cross. The
/// sockets are bound to the IPv4-mapped loopback address, so nothing listens beyond loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_ipv6_sockets_dial_ipv4_peer_addresses() {
    let mapped: SocketAddr = "[::ffff:127.0.0.1]:0".parse().expect("addr");
    let c = unjoined(2, |_, cfg| cfg.listen_addr = mapped).await;
    let v4 = |b: &TestBroker| SocketAddr::from(([127, 0, 0, 1], b.addr.port()));
    for b in &c.nodes {
        assert!(b.addr.is_ipv6(), "an IPv6 socket: {}", b.addr);
        b.control
            .set_cluster_peers(c.nodes.iter().map(v4).collect());
    }
    formed(&c).await;
    let client = |b: &TestBroker| {
        aqueduct_client::Client::connect(
            aqueduct_client::ConnectOptions::new(v4(b).to_string()).dev_cert_file(&b.dev_cert),
        )
    };
    let far = within("connect", client(&c.nodes[1]))
        .await
        .expect("node 1");
    let mut sub = far.subscribe("v4/#").await.expect("subscribe on node 1");
    until("node 0 to learn node 1's interest", || {
        wants(&c.nodes[0], "node-1", "v4/#")
    })
    .await;
    let publisher = within("connect", client(&c.nodes[0]))
        .await
        .expect("node 0");
    publisher.publish("v4/x", "across").await.expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"across");
}

/// Publish on node 0; exact and wildcard subscribers on nodes 1 and 2 each get every message
/// once, in order, with its priority; a node without interest is sent nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_on_one_node_reach_subscribers_on_the_others_once() {
    // Copies travel compressed (every block: threshold 0).
    let c = cluster_with(
        3,
        Compression::Zstd {
            level: 3,
            threshold: 0,
        },
    )
    .await;
    formed(&c).await;
    let (b, cc) = (c.nodes[1].client().await, c.nodes[2].client().await);
    let mut exact = b.subscribe("orders/eu").await.expect("exact on node 1");
    let mut wild = cc.subscribe("orders/#").await.expect("wildcard on node 2");
    let mut also = cc
        .subscribe("orders/+")
        .await
        .expect("second filter on node 2");
    until("node 0 to learn both nodes' interest", || {
        wants(&c.nodes[0], "node-1", "orders/eu") && wants(&c.nodes[0], "node-2", "orders/+")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    let opts = aqueduct_client::PublishOptions {
        confirm: true,
        priority: Some(aqueduct_client::Priority::new(1).expect("priority")),
        ..Default::default()
    };
    // In batches of 50: a peer's copies then leave in blocks of many, which compress.
    const N: usize = 200;
    for chunk in 0..N / 50 {
        let batch: Vec<(&str, bytes::Bytes)> = (chunk * 50..(chunk + 1) * 50)
            .map(|i| ("orders/eu", bytes::Bytes::from(format!("m{i}"))))
            .collect();
        publisher
            .publish_batch(batch, &opts)
            .await
            .expect("publish");
    }
    publisher
        .publish_with("stock/x", "not for them", &opts)
        .await
        .expect("publish");
    for sub in [&mut exact, &mut wild, &mut also] {
        for i in 0..N {
            let m = next(sub).await;
            assert_eq!(&m.body()[..], format!("m{i}").as_bytes(), "in order, once");
            assert_eq!(m.priority().level(), 1);
        }
    }
    // Nothing more arrives (no duplicates, nothing without interest).
    let (b2, c2) = (c.nodes[1].broker.clone(), c.nodes[2].broker.clone());
    let published = |b: &aqueduct_core::Broker, t: &str| {
        b.topic(&aqueduct_proto::TopicName::try_from(t).expect("topic"))
            .map_or(0, |s| s.stats().snapshot().published)
    };
    assert_eq!(published(&b2, "orders/eu"), N as u64, "one copy to node 1");
    assert_eq!(
        published(&c2, "orders/eu"),
        N as u64,
        "one copy to node 2 for two filters"
    );
    assert_eq!(published(&b2, "stock/x") + published(&c2, "stock/x"), 0);
    let counters = c.nodes[0].control.mesh().expect("on").peer_counters();
    for p in &counters {
        assert_eq!((p.forwarded, p.dropped), (N as u64, 0), "to {}", p.node);
    }
    // The same in the metrics, per peer.
    let m = get(c.nodes[0].metrics_addr, "/metrics").await.1;
    assert_eq!(value(&m, "aqueduct_mesh_peers"), Some(2.0));
    for peer in ["node-1", "node-2"] {
        let series = format!("aqueduct_mesh_forwarded_total{{peer=\"{peer}\"}}");
        assert_eq!(value(&m, &series), Some(N as f64), "{series}");
        let sent = value(
            &m,
            &format!("aqueduct_mesh_bytes_sent_total{{peer=\"{peer}\"}}"),
        );
        let raw = value(
            &m,
            &format!("aqueduct_mesh_bytes_uncompressed_total{{peer=\"{peer}\"}}"),
        );
        let (sent, raw) = (sent.expect("sent"), raw.expect("raw"));
        assert!(
            sent > 0.0 && raw > sent,
            "compressed: {raw} bytes sent as {sent}"
        );
        println!("compression ratio to {peer}: {:.2}", raw / sent);
    }
    // Each receiver counted what it received from node 0.
    for (i, node) in [(1, &c.nodes[1]), (2, &c.nodes[2])] {
        let m = get(node.metrics_addr, "/metrics").await.1;
        assert_eq!(
            value(&m, "aqueduct_mesh_received_total{peer=\"node-0\"}"),
            Some(N as f64),
            "node-{i} received"
        );
        assert!(
            value(&m, "aqueduct_mesh_bytes_received_total{peer=\"node-0\"}").unwrap_or(0.0) > 0.0
        );
        assert!(value(&m, "aqueduct_mesh_reconnects_total{peer=\"node-0\"}").is_some());
    }
    // A node with no interest in stock/x was sent nothing of it: node 1's only copies are the
    // orders (checked above), and its own metrics show it forwarded nothing.
    let m1 = get(c.nodes[1].metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&m1, "aqueduct_mesh_forwarded_total{peer=\"node-0\"}"),
        Some(0.0)
    );
    stop_all(c.nodes).await;
}

/// Published on node 0 for a subscriber on node 1 that holds one unsettled message: what waits
/// on node 1 comes out highest priority first, and a message whose TTL runs out meanwhile is
/// dropped there and counted as expired, never delivered (the copy carried its TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_and_ttl_hold_across_a_hop() {
    let c = cluster(2).await;
    formed(&c).await;
    let client = c.nodes[1].client().await;
    let opts = aqueduct_client::SubscribeOptions {
        ack: true,
        max_in_flight: Some(1),
        ..Default::default()
    };
    let mut sub = client
        .subscribe_with("alerts", &opts)
        .await
        .expect("subscribe on node 1");
    until("node 0 to learn node-1's interest", || {
        wants(&c.nodes[0], "node-1", "alerts")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    let with = |priority: u8, ttl: Option<Duration>| aqueduct_client::PublishOptions {
        confirm: true,
        priority: Some(aqueduct_client::Priority::new(priority).expect("priority")),
        ttl,
        trace: None,
    };
    publisher
        .publish_with("alerts", "first", &with(2, None))
        .await
        .expect("publish");
    let first = next(&mut sub).await;
    assert_eq!(&first.body()[..], b"first");
    for i in 0..3 {
        publisher
            .publish_with("alerts", format!("routine {i}"), &with(3, None))
            .await
            .expect("publish");
    }
    let ttl = Duration::from_millis(300);
    publisher
        .publish_with("alerts", "short-lived", &with(2, Some(ttl)))
        .await
        .expect("publish");
    publisher
        .publish_with("alerts", "urgent", &with(0, None))
        .await
        .expect("publish");
    let stats = |b: &TestBroker| {
        b.broker
            .topic(&aqueduct_proto::TopicName::try_from("alerts").expect("topic"))
            .map(|t| t.stats().snapshot())
    };
    until("the six copies to reach node 1", || {
        stats(&c.nodes[1]).is_some_and(|s| s.published == 6)
    })
    .await;
    // Let the short-lived message's TTL pass while it waits on node 1.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    first.ack().await.expect("ack");
    let mut order = Vec::new();
    for _ in 0..4 {
        let m = next(&mut sub).await;
        order.push(String::from_utf8_lossy(m.body()).into_owned());
        m.ack().await.expect("ack");
    }
    assert_eq!(order, ["urgent", "routine 0", "routine 1", "routine 2"]);
    let s = stats(&c.nodes[1]).expect("known on node 1");
    assert_eq!(
        s.expired(aqueduct_proto::Priority::new(2).expect("priority")),
        1,
        "the short-lived copy expired on node 1"
    );
    stop_all(c.nodes).await;
}

fn group_wanted(b: &TestBroker, peer: &str) -> bool {
    let key = Key::Group(aqueduct_core::mesh::GroupKey {
        filter: TopicFilter::try_from("jobs").expect("filter"),
        group: aqueduct_proto::GroupId::try_from("workers").expect("group"),
    });
    b.control
        .mesh()
        .expect("cluster on")
        .view()
        .into_iter()
        .any(|(n, i)| n.as_str() == peer && i.count(&key) > 0)
}

/// A group with a member on each of three nodes gets each message published on one of them
/// exactly once, spread round-robin over the members; a plain subscriber still gets them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_across_nodes_gets_each_message_once_round_robin() {
    use std::sync::{Arc, Mutex};
    let c = cluster(3).await;
    formed(&c).await;
    let got: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let mut readers = Vec::new();
    let mut clients = Vec::new();
    for (i, node) in c.nodes.iter().enumerate() {
        let client = node.client().await;
        let mut member = client
            .subscribe_group("jobs", "workers")
            .await
            .expect("member");
        clients.push(client);
        let got = got.clone();
        readers.push(tokio::spawn(async move {
            while let Some(Ok(m)) = member.next_message().await {
                got.lock()
                    .expect("lock")
                    .push((i, String::from_utf8_lossy(m.body()).into_owned()));
                let _ = m.ack().await;
            }
        }));
    }
    let watcher = c.nodes[1].client().await;
    let mut plain = watcher.subscribe("jobs").await.expect("plain");
    until("node 0 to learn the other members", || {
        group_wanted(&c.nodes[0], "node-1") && group_wanted(&c.nodes[0], "node-2")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    let opts = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    const N: usize = 300;
    for i in 0..N {
        publisher
            .publish_with("jobs", format!("j{i}"), &opts)
            .await
            .expect("publish");
    }
    for i in 0..N {
        assert_eq!(
            &next(&mut plain).await.body()[..],
            format!("j{i}").as_bytes()
        );
    }
    until("every job to reach a member", || {
        got.lock().expect("lock").len() >= N
    })
    .await;
    let got = got.lock().expect("lock").clone();
    assert_eq!(got.len(), N, "no job twice");
    let unique: BTreeSet<&String> = got.iter().map(|(_, b)| b).collect();
    assert_eq!(unique.len(), N, "every job once");
    let mut per_node = [0usize; 3];
    for (i, _) in &got {
        per_node[*i] += 1;
    }
    assert_eq!(per_node, [100, 100, 100], "round-robin over the members");
    for r in readers {
        r.abort();
    }
    drop(clients);
    stop_all(c.nodes).await;
}

/// Jobs in the two-node group tests.
const N: usize = 10;

/// Jobs published to a group spanning two nodes.
struct SplitJobs {
    /// The publisher on node 0 (kept connected).
    _a: aqueduct_client::Client,
    m0: aqueduct_client::Subscription,
    b: aqueduct_client::Client,
    m1: aqueduct_client::Subscription,
    /// Settled by node 0's member.
    done: BTreeSet<String>,
    /// Received by node 1's member, unsettled.
    held: BTreeSet<String>,
}

/// [`N`] jobs published on node 0 to group `workers` of `jobs`, with a member on each of
/// the two nodes: node 0's settles its half, node 1's holds its half unsettled.
async fn jobs_split_across_two_nodes(c: &Cluster) -> SplitJobs {
    let opts = aqueduct_client::SubscribeOptions {
        group: Some("workers".into()),
        ack: true,
        ..Default::default()
    };
    let (a, b) = (c.nodes[0].client().await, c.nodes[1].client().await);
    let mut m0 = a
        .subscribe_with("jobs", &opts)
        .await
        .expect("member on node 0");
    let mut m1 = b
        .subscribe_with("jobs", &opts)
        .await
        .expect("member on node 1");
    until("each node to learn the other's member", || {
        group_wanted(&c.nodes[0], "node-1") && group_wanted(&c.nodes[1], "node-0")
    })
    .await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    for i in 0..N {
        a.publish_with("jobs", format!("j{i}"), &confirm)
            .await
            .expect("publish");
    }
    let mut done = BTreeSet::new();
    for _ in 0..N / 2 {
        let m = next(&mut m0).await;
        done.insert(String::from_utf8_lossy(m.body()).into_owned());
        m.ack().await.expect("ack");
    }
    let mut held = BTreeSet::new();
    for _ in 0..N / 2 {
        held.insert(String::from_utf8_lossy(next(&mut m1).await.body()).into_owned());
    }
    SplitJobs {
        _a: a,
        m0,
        b,
        m1,
        done,
        held,
    }
}

/// A group member on node 1 takes its share of the jobs and leaves without settling them; node 1
/// has no other member, so they go to the member on node 0 (once each), not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_member_s_unsettled_jobs_go_to_a_member_on_another_node() {
    let c = cluster(2).await;
    formed(&c).await;
    let mut jobs = jobs_split_across_two_nodes(&c).await;
    assert!(
        jobs.done.is_disjoint(&jobs.held),
        "round-robin: each job to one member"
    );
    // Node 1's only member goes away with its five jobs unsettled.
    drop(jobs.m1);
    jobs.b
        .close()
        .await
        .expect("close: everything published was taken");
    for _ in 0..N / 2 {
        let m = next(&mut jobs.m0).await;
        let body = String::from_utf8_lossy(m.body()).into_owned();
        assert!(jobs.held.contains(&body), "{body} was node 1's");
        // Delivered once on node 1: this is its second attempt, counted on across nodes.
        assert_eq!(m.attempt(), 2, "{body}");
        assert!(jobs.done.insert(body), "once");
        m.ack().await.expect("ack");
    }
    assert_eq!(jobs.done.len(), N);
    let m = get(c.nodes[1].metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&m, "aqueduct_mesh_group_handovers_total"),
        Some((N / 2) as f64)
    );
    let dropped = c.nodes[1]
        .broker
        .topic(&aqueduct_proto::TopicName::try_from("jobs").expect("topic"))
        .map(|t| t.stats().snapshot().dropped.iter().sum::<u64>());
    assert_eq!(dropped, Some(0), "nothing dropped on node 1");
    stop_all(c.nodes).await;
}

/// A node shutting down (a rolling restart) with a group member holding unsettled jobs: the
/// member's connection ends in the shutdown, and its jobs reach the member on the other node
/// before the node's mesh connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_shutting_down_hands_its_member_s_unsettled_jobs_over_first() {
    let mut c = cluster(2).await;
    formed(&c).await;
    let mut jobs = jobs_split_across_two_nodes(&c).await;
    // Node 1 stops with its member's five jobs unsettled.
    let node1 = c.nodes.pop().expect("node 1");
    node1.stop().await.expect("clean shutdown");
    drop((jobs.m1, jobs.b));
    for _ in 0..N / 2 {
        let m = next(&mut jobs.m0).await;
        let body = String::from_utf8_lossy(m.body()).into_owned();
        assert!(jobs.held.contains(&body), "{body} was node 1's");
        assert!(jobs.done.insert(body), "once");
        m.ack().await.expect("ack");
    }
    assert_eq!(jobs.done.len(), N);
    stop_all(c.nodes).await;
}

/// A job published on node 0 and rejected by its worker on node 1 until it runs out of retries
/// becomes a dead letter on node 1 (which owns the delivery) that reaches the dead-letter
/// subscriber on node 0, with its original topic, offset, attempts and reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_made_on_one_node_reaches_subscribers_on_another() {
    let c = cluster(2).await;
    formed(&c).await;
    let (a, b) = (c.nodes[0].client().await, c.nodes[1].client().await);
    let mut dlq = a.subscribe("__dlq__jobs").await.expect("dlq on node 0");
    let opts = aqueduct_client::SubscribeOptions {
        group: Some("workers".into()),
        ack: true,
        ..Default::default()
    };
    let mut worker = b
        .subscribe_with("jobs", &opts)
        .await
        .expect("worker on node 1");
    until("each node to learn the other's interest", || {
        group_wanted(&c.nodes[0], "node-1") && wants(&c.nodes[1], "node-0", "__dlq__jobs")
    })
    .await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    a.publish_with("jobs", "poison", &confirm)
        .await
        .expect("publish");
    // max_retries 3: four attempts, then the dead letter.
    for attempt in 1..=4 {
        let m = next(&mut worker).await;
        assert_eq!((m.attempt(), &m.body()[..]), (attempt, &b"poison"[..]));
        m.nack(Some("cannot parse")).await.expect("nack");
    }
    let dead = next(&mut dlq).await;
    assert_eq!(dead.topic().as_str(), "__dlq__jobs");
    assert_eq!(&dead.body()[..], b"poison");
    let ext = dead.extensions();
    assert_eq!(
        ext.original_topic.as_ref().map(|t| t.as_str()),
        Some("jobs")
    );
    assert_eq!(ext.original_offset, Some(0), "node 1's offset of the job");
    assert_eq!(ext.attempts_made, Some(4));
    assert_eq!(ext.reason.as_deref(), Some("cannot parse"));
    stop_all(c.nodes).await;
}

/// A client certificate cannot open a mesh connection: only a certificate of the cluster CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_certificate_of_another_ca_is_not_a_peer() {
    let c = cluster(1).await;
    let other = ClusterCa::new();
    let intruder = other.lone_node("intruder").await;
    intruder.control.set_cluster_peers(vec![c.nodes[0].addr]);
    c.nodes[0].control.set_cluster_peers(vec![intruder.addr]);
    // Give them time to try (and fail) a few times: neither may ever list the other.
    for _ in 0..50 {
        assert!(peers_of(&c.nodes[0]).is_empty());
        assert!(peers_of(&intruder).is_empty());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    intruder.stop().await.expect("clean shutdown");
    stop_all(c.nodes).await;
}

/// `cluster.tls.crl_file`: a node whose peer certificate the cluster CA revoked is no peer. A
/// reload (what SIGHUP does) that revokes a connected peer closes its connection, and neither
/// its dials nor this node's are taken again. Peer certificates were not checked against any
/// list: a leaked peer key needed a new CA for the whole mesh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_peer_certificate_is_no_peer() {
    let ca = ClusterCa::new();
    let crl = ca.dir.path().join("cluster-crl.pem");
    ca.ca.write_crl(&crl, &[], 1);
    let cfg0 = ClusterConfig {
        crl_file: Some(crl.clone()),
        ..ca.node("node-0", None)
    };
    let cfg1 = ca.node("node-1", None);
    let revoked_cert = cfg1.cert_file.clone().expect("node-1's certificate");
    let n0 = TestBroker::start_with(|c| c.cluster = cfg0).await;
    let n1 = TestBroker::start_with(|c| c.cluster = cfg1).await;
    n0.control.set_cluster_peers(vec![n1.addr]);
    n1.control.set_cluster_peers(vec![n0.addr]);
    let node1 = BTreeSet::from(["node-1".to_string()]);
    // How often node-1 has seen node-0 come back (its count while connected).
    let reconnects = || {
        n1.control
            .mesh()
            .expect("cluster on")
            .peer_counters()
            .into_iter()
            .find(|p| p.node.as_str() == "node-0")
            .map(|p| p.reconnects)
    };
    // node-1 counts node-0 as connected at node-0's first word on a connection (its interest
    // snapshot), not at the handshake: wait for node-0's interest to reach node-1. Waiting for
    // node-1's counters only (made at the handshake) let the revocation below close the first
    // connection before node-0 spoke on it, so the one after it was no reconnect.
    let client = n0.client().await;
    let _sub = client.subscribe("probe").await.expect("subscribe");
    until(
        "node-0 to take node-1 as a peer, and node-1 to hear from node-0",
        || peers_of(&n0) == node1 && wants(&n1, "node-0", "probe"),
    )
    .await;
    let before = reconnects().expect("connected");
    ca.ca.write_crl(&crl, &[&revoked_cert], 2);
    let (revoked, closed) = n0
        .control
        .reload_revocations()
        .await
        .expect("reloaded")
        .expect("a list to reload");
    assert_eq!(revoked, 1);
    assert!(closed >= 1, "the peer's connection was closed");
    until("node-0 to drop node-1", || peers_of(&n0).is_empty()).await;
    // Both keep dialing (node-1 has no list): node-0 must never take node-1 again.
    for _ in 0..100 {
        assert!(peers_of(&n0).is_empty(), "a revoked peer was taken again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Taken back (a list without it), node-0 comes back to node-1 once. The connections node-0
    // closed right after each handshake meanwhile were no reconnects: node-1 counted (and
    // logged, "cluster peer reconnected") every one of them, as it counted a connection up at
    // its handshake, not once the peer spoke on it.
    ca.ca.write_crl(&crl, &[], 3);
    let (revoked, _) = n0
        .control
        .reload_revocations()
        .await
        .expect("reloaded")
        .expect("a list to reload");
    assert_eq!(revoked, 0);
    // Counted once node-0 has spoken on the new connection (its snapshot): wait for that.
    until("the two to be peers again", || {
        peers_of(&n0) == node1 && reconnects().is_some_and(|n| n > before)
    })
    .await;
    assert_eq!(
        reconnects(),
        Some(before + 1),
        "refused connections counted"
    );
    stop_all([n0, n1]).await;
}

/// A `cluster.tls.crl_file` that would check nothing (a list of another CA of the same name)
/// or cannot be read
/// stops startup with an error naming the key.
#[tokio::test]
async fn a_cluster_revocation_list_of_another_ca_stops_startup() {
    let ca = ClusterCa::new();
    let crl = ca.dir.path().join("other-crl.pem");
    test_ca().write_crl(&crl, &[], 1);
    let missing = ca.dir.path().join("missing.pem");
    for (file, why) in [(&crl, "not signed by that CA"), (&missing, "")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = aqueduct_server::Config::for_tests(dir.path().join("dev-cert.pem"));
        config.cluster = ClusterConfig {
            crl_file: Some(file.clone()),
            ..ca.node("node-0", None)
        };
        let e = match aqueduct_server::Server::bind(config).await {
            Ok(_) => panic!("{}: started", file.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("cluster.tls.crl_file") && e.contains(why),
            "{}: {e}",
            file.display()
        );
    }
}

/// `transport.max_connections` counts clients: two nodes each at the limit still take each
/// other's mesh connections (from a peer's address, a few handshakes at a time), while a
/// further client is refused as before. Each refused the other's: a loaded cluster, once its
/// links dropped, stayed apart until clients left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_full_of_clients_still_take_their_peers() {
    let ca = ClusterCa::new();
    let full = |name: &str| {
        let cluster = ca.node(name, None);
        TestBroker::start_with(move |c| {
            c.cluster = cluster;
            c.transport.max_connections = 1;
        })
    };
    let (a, b) = (full("node-a").await, full("node-b").await);
    let (client_a, client_b) = (a.client().await, b.client().await);
    // Each is at its limit: another client is refused.
    let refused = aqueduct_client::Client::connect(a.options()).await;
    assert!(refused.is_err(), "a second client was let in");
    a.control.set_cluster_peers(vec![b.addr]);
    b.control.set_cluster_peers(vec![a.addr]);
    until("the full nodes to take each other as peers", || {
        peers_of(&a) == BTreeSet::from(["node-b".to_string()])
            && peers_of(&b) == BTreeSet::from(["node-a".to_string()])
    })
    .await;
    client_a.close().await.expect("closed");
    client_b.close().await.expect("closed");
    stop_all([a, b]).await;
}

/// A client certificate of the cluster's own CA (no `aqueduct-mesh` name) is no peer either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_of_the_same_ca_is_not_a_peer() {
    let ca = ClusterCa::new();
    let node = ca.lone_node("node-0").await;
    let (cert, key) = ca.ca.client(ca.dir.path(), "alice");
    let intruder = TestBroker::start_with(|c| {
        c.cluster = ClusterConfig {
            cert_file: Some(cert),
            key_file: Some(key),
            ..ca.node("unused", None)
        }
    })
    .await;
    intruder.control.set_cluster_peers(vec![node.addr]);
    node.control.set_cluster_peers(vec![intruder.addr]);
    // The real node never takes it as a peer (the intruder may see the node for a moment, as
    // its own dial verifies the node's genuine certificate, until the node closes it).
    for _ in 0..50 {
        assert!(peers_of(&node).is_empty());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    intruder.stop().await.expect("clean shutdown");
    node.stop().await.expect("clean shutdown");
}

/// A peer certificate is no client identity on a broker without the cluster either, even one
/// that trusts the same CA for its clients; a client certificate of that CA is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_certificate_is_no_client_identity_without_the_cluster() {
    let ca = ClusterCa::new();
    let ca_file = ca.ca.write(ca.dir.path());
    let b = TestBroker::start_with(|c| c.tls.client_ca_file = Some(ca_file.clone())).await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    let (cert, key) = ca.ca.peer(ca.dir.path(), "node-x");
    // Refused at once, or (TLS 1.3 lets the client finish first) closed right after.
    let refused = match aqueduct_client::Client::connect(b.options().client_cert(&cert, &key)).await
    {
        Err(_) => true,
        Ok(client) => within("the refusal", client.publish_with("t", "x", &confirm))
            .await
            .is_err(),
    };
    assert!(refused, "a peer certificate was served as a client");
    let (cert, key) = ca.ca.client(ca.dir.path(), "alice");
    let alice = aqueduct_client::Client::connect(b.options().client_cert(&cert, &key))
        .await
        .expect("a client certificate is served");
    alice
        .publish_with("t", "x", &confirm)
        .await
        .expect("published");
    close_and_stop(alice, b).await;
}

/// A peer certificate is no client identity over WebTransport either: a session presenting one
/// is refused (the handshake accepts the cluster CA for mesh connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_certificate_cannot_open_a_webtransport_session() {
    let ca = ClusterCa::new();
    let node = ca.lone_node("node-0").await;
    let wt = aqueduct_client::Transport::WebTransport {
        path: "/aqueduct/wt".into(),
    };
    // Without a certificate: a client as any other.
    let anonymous = aqueduct_client::Client::connect(node.options().transport(wt.clone()))
        .await
        .expect("an anonymous WebTransport client");
    anonymous
        .close()
        .await
        .expect("close: everything published was taken");
    let (cert, key) = ca.ca.peer(ca.dir.path(), "node-x");
    let refused =
        aqueduct_client::Client::connect(node.options().client_cert(&cert, &key).transport(wt))
            .await;
    assert!(refused.is_err(), "a peer certificate opened a session");
    node.stop().await.expect("clean shutdown");
}

/// Two nodes that reach each other only through relays. While the relays drop everything, each
/// node notices the peer is gone and keeps serving its own clients; once they pass traffic
/// again, the mesh reconnects within the backoff bound (at most 30 s between dials, plus a
/// dial's 10 s timeout) and messages published on one node reach the other's subscribers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_heals_and_forwarding_resumes() {
    let Cluster { nodes, _dir } = unjoined(2, |_, _| {}).await;
    // Each node's only way to the other is a relay.
    let to_1 = Relay::start(nodes[1].addr).await;
    let to_0 = Relay::start(nodes[0].addr).await;
    nodes[0].control.set_cluster_peers(vec![to_1.front]);
    nodes[1].control.set_cluster_peers(vec![to_0.front]);
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see its peer"), || {
            peers_of(b).len() == 1
        })
        .await;
    }
    let (a, b) = (nodes[0].client().await, nodes[1].client().await);
    let mut remote = b.subscribe("news").await.expect("subscribe on node 1");
    let mut local = a.subscribe("news").await.expect("subscribe on node 0");
    until("node 0 to learn node-1's interest", || {
        wants(&nodes[0], "node-1", "news")
    })
    .await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    a.publish_with("news", "before", &confirm)
        .await
        .expect("publish");
    assert_eq!(&next(&mut local).await.body()[..], b"before");
    assert_eq!(&next(&mut remote).await.body()[..], b"before");

    let reconnects = |m: &str| value(m, "aqueduct_mesh_reconnects_total{peer=\"node-1\"}");
    let before = reconnects(&get(nodes[0].metrics_addr, "/metrics").await.1).expect("series");
    // The partition: within the mesh's idle timeout (8 s) both nodes see the other gone.
    to_1.cut(true);
    to_0.cut(true);
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to notice the partition"), || {
            peers_of(b).is_empty()
        })
        .await;
    }
    // Each side still serves its own clients.
    let mut on_1 = b.subscribe("local/1").await.expect("subscribe on node 1");
    b.publish_with("local/1", "node 1 alone", &confirm)
        .await
        .expect("publish on node 1");
    assert_eq!(&next(&mut on_1).await.body()[..], b"node 1 alone");
    a.publish_with("news", "during", &confirm)
        .await
        .expect("publish on node 0");
    assert_eq!(&next(&mut local).await.body()[..], b"during");

    // Healed: reconnected within the backoff bound, interest exchanged again, forwarding back.
    to_1.cut(false);
    to_0.cut(false);
    let bound = Duration::from_secs(30 + 10 + 5);
    tokio::time::timeout(bound, async {
        while !(wants(&nodes[0], "node-1", "news") && peers_of(&nodes[1]).len() == 1) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the mesh to reconnect within the backoff bound");
    a.publish_with("news", "after", &confirm)
        .await
        .expect("publish");
    assert_eq!(&next(&mut local).await.body()[..], b"after");
    // Node 1's subscriber missed "during" (copies are not kept across a partition: at most
    // once across the mesh) and gets "after".
    assert_eq!(&next(&mut remote).await.body()[..], b"after");
    let after = reconnects(&get(nodes[0].metrics_addr, "/metrics").await.1).expect("series");
    assert!(
        after > before,
        "the reconnect is counted ({before} -> {after})"
    );
    stop_all(nodes).await;
}

/// A node with the durable log wants every message and logs the copies it gets with its own
/// offsets: a durable subscription there reads what was published on another node, from the
/// log, and the log holds it after the node stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_the_log_logs_what_other_nodes_publish() {
    let log_dir = tempfile::tempdir().expect("log dir");
    let Cluster { nodes, _dir } = unjoined(2, |i, c| {
        if i == 1 {
            c.aal = Some(aal(log_dir.path(), aqueduct_log::FsyncMode::Batch));
        }
    })
    .await;
    let addrs: Vec<SocketAddr> = nodes.iter().map(|b| b.addr).collect();
    for b in &nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    // Without a subscriber on node 1, node 0 learns that it wants everything.
    until("node 0 to learn that node-1 logs everything", || {
        wants(&nodes[0], "node-1", "#")
    })
    .await;
    let publisher = nodes[0].client().await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    for i in 0..20 {
        publisher
            .publish_with("orders", format!("o{i}"), &confirm)
            .await
            .expect("publish");
    }
    for i in 0..5 {
        publisher
            .publish_with("stock/x", format!("s{i}"), &confirm)
            .await
            .expect("publish");
    }
    // A durable subscription on node 1 started afterwards reads them all from node 1's log.
    let reader = nodes[1].client().await;
    let opts = aqueduct_client::SubscribeOptions {
        durable: Some(("audit".into(), aqueduct_client::DurableStart::Earliest)),
        ack: true,
        ..Default::default()
    };
    let mut durable = reader
        .subscribe_with("orders", &opts)
        .await
        .expect("durable subscription on node 1");
    for i in 0..20u64 {
        let m = next(&mut durable).await;
        assert_eq!((m.offset(), &m.body()[..]), (i, format!("o{i}").as_bytes()));
        m.ack().await.expect("ack");
    }
    until("the five stock copies to reach node 1", || {
        nodes[1]
            .broker
            .topic(&aqueduct_proto::TopicName::try_from("stock/x").expect("topic"))
            .is_some_and(|t| t.stats().snapshot().published == 5)
    })
    .await;
    drop(durable);
    reader
        .close()
        .await
        .expect("close: everything published was taken");
    let mut nodes = nodes;
    let logging = nodes.pop().expect("node 1");
    logging.stop().await.expect("clean shutdown");
    let orders = logged(log_dir.path(), "orders");
    let bodies: Vec<String> = orders
        .iter()
        .map(|(_, m)| String::from_utf8_lossy(&m.body).into_owned())
        .collect();
    assert_eq!(bodies, (0..20).map(|i| format!("o{i}")).collect::<Vec<_>>());
    assert_eq!(logged(log_dir.path(), "stock/x").len(), 5);
    stop_all(nodes).await;
}

/// A block-policy subscriber on node 1 that reads nothing holds node 0's copies for at most
/// `block_timeout`, as it would hold a client's publishes; then it is closed as a slow consumer
/// and the other subscriber on node 1 gets every copy, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_block_subscriber_holds_a_peer_s_copies_for_block_timeout_only() {
    let Cluster { nodes, _dir } =
        unjoined(2, block_on_node_1(32, Duration::from_millis(300))).await;
    let addrs: Vec<SocketAddr> = nodes.iter().map(|b| b.addr).collect();
    for b in &nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    let stalled = stalled_subscriber(&nodes[1], "bp").await;
    let (_reader, mut normal) = subscribed_on_node_1(&nodes, "bp").await;
    let publisher = nodes[0].client().await;
    const N: u64 = 600;
    let body = "x".repeat(200);
    for _ in 0..N {
        publisher
            .publish("bp", body.clone())
            .await
            .expect("publish");
    }
    publisher.flush().await.expect("flush");
    for i in 0..N {
        assert_eq!(next(&mut normal).await.offset(), i, "every copy, in order");
    }
    // The copies may all have come in a few blocks, queued (a block is queued whole) before
    // the hold began: the stalled one is closed once the hold has lasted `block_timeout`.
    until("the stalled subscriber closed as a slow consumer", || {
        nodes[1].broker.slow_consumers_disconnected() == 1
    })
    .await;
    drop(stalled);
    stop_all(nodes).await;
}

/// Eight stuck block-policy subscribers on node 1 hold node 0's copies for one `block_timeout`
/// in all, then every one of them is closed: their timeouts ran one after another, so the
/// copies waited eight times as long (8 s here) before the reading subscriber got them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_stuck_block_subscribers_hold_a_peer_s_copies_for_one_block_timeout() {
    const STUCK: usize = 8;
    let Cluster { nodes, _dir } = unjoined(2, block_on_node_1(32, Duration::from_secs(1))).await;
    let addrs: Vec<SocketAddr> = nodes.iter().map(|b| b.addr).collect();
    for b in &nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    let mut stalled = Vec::new();
    for _ in 0..STUCK {
        stalled.push(stalled_subscriber(&nodes[1], "bp").await);
    }
    let (_reader, mut normal) = subscribed_on_node_1(&nodes, "bp").await;
    let publisher = nodes[0].client().await;
    const N: u64 = 600;
    let body = "x".repeat(200);
    for _ in 0..N {
        publisher
            .publish("bp", body.clone())
            .await
            .expect("publish");
    }
    publisher.flush().await.expect("flush");
    // Within one block_timeout and a wide margin for a loaded machine.
    tokio::time::timeout(Duration::from_secs(5), async {
        for i in 0..N {
            assert_eq!(next(&mut normal).await.offset(), i, "every copy, in order");
        }
    })
    .await
    .expect("every copy within about one block_timeout");
    until("every stalled subscriber closed as a slow consumer", || {
        nodes[1].broker.slow_consumers_disconnected() == STUCK as u64
    })
    .await;
    drop(stalled);
    stop_all(nodes).await;
}

/// Node 1's subscribers hold publishers (block policy) when `queue_size` messages wait, for at
/// most `timeout`.
fn block_on_node_1(
    queue_size: usize,
    timeout: Duration,
) -> impl Fn(usize, &mut aqueduct_server::Config) {
    move |i, c| {
        if i == 1 {
            c.broker.queue_size = queue_size;
            c.broker.backpressure_policy = aqueduct_client::OverflowPolicy::Block;
            c.block_timeout = Some(timeout);
        }
    }
}

/// Node 1 dials node 0 (node 0 does not dial yet): the pair's connection in use is node 1's.
async fn node_1_dials_first(nodes: &[TestBroker]) {
    nodes[1].control.set_cluster_peers(vec![nodes[0].addr]);
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see its peer"), || {
            peers_of(b).len() == 1
        })
        .await;
    }
}

/// A client of node 1 subscribed to `filter`, once node 0 knows of it (the client must live as
/// long as the subscription).
async fn subscribed_on_node_1(
    nodes: &[TestBroker],
    filter: &str,
) -> (aqueduct_client::Client, aqueduct_client::Subscription) {
    let reader = nodes[1].client().await;
    let sub = reader.subscribe(filter).await.expect("subscribe on node 1");
    until("node 0 to learn node-1's interest", || {
        wants(&nodes[0], "node-1", filter)
    })
    .await;
    (reader, sub)
}

/// Node 1 (which dialed node 0) holding node 0's copies: a stalled block-policy subscriber to
/// `sw/#` on node 1 and a reading one (`sub`), and `n` numbered messages published on node 0
/// and written to node 1 — more than the stalled subscriber takes, so node 1's reader of the
/// connection is held with copies still to publish.
struct HeldOnNode1 {
    stalled: (Raw, RawStream),
    reader: aqueduct_client::Client,
    sub: aqueduct_client::Subscription,
    publisher: aqueduct_client::Client,
    mesh0: aqueduct_server::mesh::MeshHandle,
}

async fn copies_held_on_node_1(nodes: &[TestBroker], n: usize) -> HeldOnNode1 {
    node_1_dials_first(nodes).await;
    let stalled = stalled_subscriber(&nodes[1], "sw/#").await;
    let (reader, sub) = subscribed_on_node_1(nodes, "sw/#").await;
    let publisher = nodes[0].client().await;
    let mesh0 = nodes[0].control.mesh().expect("on").clone();
    // In two rounds: a block of copies is queued whole, so all of them in one block would
    // overfill the stalled subscriber's queue without a hold; the second round's find it full.
    for to in [n / 2, n] {
        publish_numbered(&publisher, to - n / 2, to).await;
        until("node 0 to write the copies", || {
            mesh0
                .peer_counters()
                .first()
                .is_some_and(|c| c.forwarded == to as u64 && c.queued == 0)
        })
        .await;
    }
    HeldOnNode1 {
        stalled,
        reader,
        sub,
        publisher,
        mesh0,
    }
}

/// A raw subscriber to `filter` on `b` with a tiny receive window, that reads nothing.
async fn stalled_subscriber(b: &TestBroker, filter: &str) -> (Raw, RawStream) {
    let before = b.broker.subscriber_count();
    let stalled = Raw::connect(b, 4096).await;
    let mut s = stalled.stream().await;
    s.write(&raw_frame(
        0x42,
        1,
        format!("\x00\x00topic:{filter}").as_bytes(),
    ))
    .await;
    until("the stalled subscription", || {
        b.broker.subscriber_count() == before + 1
    })
    .await;
    (stalled, s)
}

/// Publish `m{from}` .. `m{to - 1}` to `sw/0` .. `sw/3` in turn, in one confirmed batch.
async fn publish_numbered(publisher: &aqueduct_client::Client, from: usize, to: usize) {
    let batch: Vec<(String, bytes::Bytes)> = (from..to)
        .map(|i| (format!("sw/{}", i % 4), bytes::Bytes::from(format!("m{i}"))))
        .collect();
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    publisher
        .publish_batch(batch.iter().map(|(t, b)| (t.as_str(), b.clone())), &confirm)
        .await
        .expect("publish");
}

/// The next `n` messages of `sub`, each `m<number>`, are `m0` .. `m{n - 1}` in order.
async fn expect_numbered_in_order(sub: &mut aqueduct_client::Subscription, n: usize) {
    let mut order = Vec::with_capacity(n);
    for _ in 0..n {
        let m = next(sub).await;
        let body = String::from_utf8_lossy(m.body()).into_owned();
        order.push(body[1..].parse::<usize>().expect("m<number>"));
    }
    let first_out_of_order = order.windows(2).position(|w| w[0] >= w[1]);
    assert_eq!(
        first_out_of_order,
        None,
        "copies out of order or twice across the switch: {:?}",
        first_out_of_order.map(|i| &order[i.saturating_sub(3)..(i + 4).min(order.len())])
    );
    assert_eq!(order, (0..n).collect::<Vec<_>>(), "every copy once");
}

/// Both nodes dial: node 1 first (its connection carries the copies), then node 0, whose
/// connection both ends keep (the smaller id's dial). The switch happens while node 0 publishes
/// to a subscriber on node 1: the copies waiting in node 0's queue go out on the kept
/// connection, and those written on the retired one are read to its end — none is lost (before,
/// the queue went with the connection and the retired one was cut at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_copy_is_lost_when_a_duplicate_connection_replaces_the_one_in_use() {
    let Cluster { nodes, _dir } = unjoined(2, |_, _| {}).await;
    node_1_dials_first(&nodes).await;
    let (_reader, mut sub) = subscribed_on_node_1(&nodes, "sw/#").await;
    let publisher = nodes[0].client().await;
    const BATCHES: usize = 60;
    const PER: usize = 100;
    let retired = |b: &TestBroker| {
        b.control
            .mesh()
            .expect("on")
            .retired
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for n in 0..BATCHES {
        publish_numbered(&publisher, n * PER, (n + 1) * PER).await;
        if n == 5 {
            // Now node 0 dials too: its connection replaces node 1's mid-stream.
            nodes[0].control.set_cluster_peers(vec![nodes[1].addr]);
        }
    }
    // Every copy once, in the order published: the kept connection writes only once the peer
    // has published the retired one's to its end.
    expect_numbered_in_order(&mut sub, BATCHES * PER).await;
    until("the duplicate to be retired", || {
        retired(&nodes[0]) + retired(&nodes[1]) >= 1
    })
    .await;
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to keep one connection"), || {
            b.control.open_connections() == 2
        })
        .await;
    }
    stop_all(nodes).await;
}

/// The switch to a duplicate connection while the receiving node is still publishing what the
/// old one carried: a block-policy subscriber on node 1 that reads nothing holds node 1's
/// reader of the old connection (for `block_timeout`, then it is closed as a slow consumer),
/// with copies of the old connection still to publish, when node 0 retires that connection.
/// Node 0 must neither close it nor write on the kept one before node 1 has *published* them
/// (the QUIC acknowledgement only says received): before, it closed the old connection at the
/// acknowledgement, and the copies node 1 had not published yet were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_received_but_not_yet_published_survive_the_switch_in_order() {
    // The hold ends within the 5 s a retired connection is given to finish.
    let Cluster { nodes, _dir } =
        unjoined(2, block_on_node_1(16, Duration::from_millis(1_500))).await;
    // On the old connection: node 1's reader of it is held with copies still to publish.
    const OLD: usize = 400;
    const ALL: usize = 1_000;
    let HeldOnNode1 {
        stalled,
        reader: _reader,
        mut sub,
        publisher,
        mesh0,
    } = copies_held_on_node_1(&nodes, OLD).await;
    // Node 0 dials too: its connection replaces node 1's; the rest go out on it.
    nodes[0].control.set_cluster_peers(vec![nodes[1].addr]);
    until("the duplicate to be retired", || {
        mesh0.retired.load(std::sync::atomic::Ordering::Relaxed) >= 1
    })
    .await;
    publish_numbered(&publisher, OLD, ALL).await;
    expect_numbered_in_order(&mut sub, ALL).await;
    until("the stalled subscriber closed as a slow consumer", || {
        nodes[1].broker.slow_consumers_disconnected() == 1
    })
    .await;
    // One mesh connection each: node 0 has its publisher's too, node 1 its two clients'.
    for (i, clients) in [(0, 1), (1, 2)] {
        until(&format!("node-{i} to keep one connection"), || {
            nodes[i].control.open_connections() == 1 + clients
        })
        .await;
    }
    drop(stalled);
    stop_all(nodes).await;
}

/// A node shutting down while its peer is still publishing the copies it sent: a block-policy
/// subscriber on node 1 that reads nothing holds node 1's reader of node 0's copies (for
/// `block_timeout`, then it is closed as a slow consumer) when node 0 stops. Node 0 tells node
/// 1 it is leaving and closes the connection only once node 1 has *published* every copy:
/// before, it closed the connection at once, and the copies node 1 had received but not yet
/// published were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_shutting_down_waits_until_its_peer_published_its_copies() {
    // The hold ends within the 5 s a leaving node waits.
    let Cluster { mut nodes, _dir } =
        unjoined(2, block_on_node_1(16, Duration::from_millis(1_500))).await;
    const ALL: usize = 400;
    let HeldOnNode1 {
        stalled,
        reader: _reader,
        mut sub,
        publisher,
        ..
    } = copies_held_on_node_1(&nodes, ALL).await;
    drop(publisher);
    let stopping = tokio::spawn(nodes.remove(0).stop());
    expect_numbered_in_order(&mut sub, ALL).await;
    stopping.await.expect("join").expect("clean shutdown");
    assert_eq!(nodes[0].broker.slow_consumers_disconnected(), 1);
    drop(stalled);
    stop_all(nodes).await;
}

/// A whole cluster stopping at once: each node leaving takes the other's leaving message as its
/// cue to confirm (once it has published what the other sent), so neither waits for the other
/// until the leave's limit (5 s), which both did when a leaving node answered no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_stopping_together_confirm_each_other_s_leave() {
    let c = cluster(2).await;
    formed(&c).await;
    let far = c.nodes[1].client().await;
    let mut sub = far.subscribe("both").await.expect("subscribe on node 1");
    until("node 0 to learn node 1's interest", || {
        wants(&c.nodes[0], "node-1", "both")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    publisher
        .publish_with("both", "x", &confirm)
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"x");
    drop((publisher, sub, far));
    let Cluster { nodes, _dir } = c;
    let meshes: Vec<_> = nodes
        .iter()
        .map(|b| b.control.mesh().expect("on").clone())
        .collect();
    let stops = nodes.into_iter().map(|b| tokio::spawn(b.stop()));
    for stop in stops.collect::<Vec<_>>() {
        stop.await.expect("join").expect("clean shutdown");
    }
    for (i, mesh) in meshes.iter().enumerate() {
        assert_eq!(
            mesh.leaves_unconfirmed
                .load(std::sync::atomic::Ordering::Relaxed),
            0,
            "node {i} waited out the leave's limit for its peer's confirmation"
        );
    }
}

/// A traced message published on node 0 and delivered on node 1 is one trace: node 1's
/// `deliver` span is a child of node 0's `publish` span (the forwarded copy carries the
/// broker's context), and the subscriber there sees that span as its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_follows_a_message_across_nodes() {
    use common::otlp::*;
    let (received, endpoint, _receiver) = receiver().await;
    let c = unjoined(2, |i, cfg| {
        cfg.tracing = Some(aqueduct_server::otel::TracingConfig {
            service_name: format!("node-{i}"),
            ..tracing_to(&endpoint, 1.0)
        })
    })
    .await;
    let addrs: Vec<SocketAddr> = c.nodes.iter().map(|b| b.addr).collect();
    for b in &c.nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    formed(&c).await;
    let far = c.nodes[1].client().await;
    let mut sub = far.subscribe("audit/#").await.expect("subscribe on node 1");
    until("node 0 to learn node 1's interest", || {
        wants(&c.nodes[0], "node-1", "audit/#")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    let parent = aqueduct_client::new_trace();
    publisher
        .publish_with(
            "audit/login",
            "alice",
            &aqueduct_client::PublishOptions {
                trace: Some(parent),
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .expect("publish");
    let delivered = next(&mut sub).await.trace().expect("traced");
    assert_eq!(delivered.trace_id, parent.trace_id);
    until("publish, route and deliver spans of both nodes", || {
        received.of_trace(&parent.trace_id).len() >= 3
    })
    .await;
    let spans = received.spans();
    let of = |name: &str| {
        spans
            .iter()
            .filter(|(_, s)| s.trace_id == parent.trace_id && s.name == name)
            .collect::<Vec<_>>()
    };
    let [(publish_node, publish)] = &of("publish")[..] else {
        panic!("one publish span: {spans:#?}")
    };
    assert_eq!(publish_node, "node-0");
    assert_eq!(publish.parent_span_id, parent.span_id);
    assert_eq!(publish.span_id, delivered.span_id);
    let [(deliver_node, deliver)] = &of("deliver")[..] else {
        panic!("one deliver span: {spans:#?}")
    };
    assert_eq!(deliver_node, "node-1");
    assert_eq!(deliver.parent_span_id, publish.span_id, "across the hop");
    assert_eq!(
        deliver.flags & REMOTE_PARENT_FLAGS,
        REMOTE_PARENT_FLAGS,
        "node 0's publish span is a remote parent on node 1"
    );
}

/// A batch mixing a topic a cross-node group consumes with a plain topic (the plain runs are
/// routed as runs, the group's messages one by one): every subscriber sees its messages once,
/// in order, and the group's are spread round-robin over its members on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixing_group_and_plain_topics_keeps_order_and_round_robin() {
    let c = cluster(2).await;
    formed(&c).await;
    let (near, far) = (c.nodes[0].client().await, c.nodes[1].client().await);
    let mut members = Vec::new();
    for client in [&near, &far] {
        members.push(
            client
                .subscribe_group("jobs", "workers")
                .await
                .expect("member"),
        );
    }
    let mut plain = far.subscribe("logs/#").await.expect("plain on node 1");
    let mut watcher = far.subscribe("jobs").await.expect("plain on jobs");
    until("node 0 to learn node 1's interest", || {
        group_wanted(&c.nodes[0], "node-1") && wants(&c.nodes[0], "node-1", "logs/#")
    })
    .await;
    let publisher = c.nodes[0].client().await;
    // 3 logs, 2 jobs, 3 logs, 2 jobs, ... in one batch frame, 5 times over.
    let mut batch: Vec<(String, bytes::Bytes)> = Vec::new();
    for round in 0..5 {
        for i in 0..3 {
            batch.push(("logs/app".into(), format!("log{round}.{i}").into()));
        }
        for i in 0..2 {
            batch.push(("jobs".into(), format!("job{round}.{i}").into()));
        }
    }
    publisher
        .publish_batch(
            batch.iter().map(|(t, b)| (t.as_str(), b.clone())),
            &aqueduct_client::PublishOptions {
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .expect("batch")
        .expect("confirmed");
    let want = |prefix: &str| -> Vec<String> {
        batch
            .iter()
            .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
            .filter(|b| b.starts_with(prefix))
            .collect()
    };
    for w in want("log") {
        assert_eq!(String::from_utf8_lossy(next(&mut plain).await.body()), w);
    }
    for w in want("job") {
        assert_eq!(String::from_utf8_lossy(next(&mut watcher).await.body()), w);
    }
    // 10 jobs over 2 members, round-robin: 5 each, each job once, each member's in order.
    let mut seen = Vec::new();
    for m in &mut members {
        let mut mine = Vec::new();
        for _ in 0..5 {
            let msg = next(m).await;
            mine.push(String::from_utf8_lossy(msg.body()).into_owned());
            msg.ack().await.expect("ack");
        }
        let mut sorted = mine.clone();
        sorted.sort();
        assert_eq!(mine, sorted, "in order");
        seen.extend(mine);
    }
    seen.sort();
    let mut jobs = want("job");
    jobs.sort();
    assert_eq!(seen, jobs, "every job once");
    drop((near, far, publisher));
    stop_all(c.nodes).await;
}

/// A resolver that never answers with an address.
#[derive(Debug, Default)]
struct FailingDns;

impl aqueduct_server::discovery::Resolver for FailingDns {
    fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> aqueduct_server::discovery::Lookup<'a> {
        Box::pin(async move { Err("no such host".to_string()) })
    }
}

/// With DNS discovery on, the static `cluster.peers` are used whatever the lookups say: they
/// are always kept, also while the discovery name does not resolve (before, they were handed to
/// the mesh only with a changed DNS answer, so never while every lookup failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_peers_are_used_while_discovery_fails() {
    let ca = ClusterCa::new();
    let b = ca.lone_node("node-b").await;
    let mut a_cfg = ca.node(
        "node-a",
        Some(("aqueduct-headless".into(), 4242, Duration::from_millis(200))),
    );
    a_cfg.peers = vec![b.addr.to_string()];
    let resolver = std::sync::Arc::new(FailingDns);
    let a = TestBroker::start_custom(|c| c.cluster = a_cfg, |s| s.set_resolver(resolver)).await;
    until("node-a to connect to its static peer", || {
        peers_of(&a).contains("node-b")
    })
    .await;
    a.stop().await.expect("clean shutdown");
    b.stop().await.expect("clean shutdown");
}

/// A raw peer: one quinn endpoint that dials and accepts with the certificate of `node` from
/// `ca` (ALPN `aqueduct-mesh`), for tests that speak the mesh protocol by hand.
fn raw_peer(ca: &ClusterCa, node: &str) -> quinn::Endpoint {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let (cert, key) = ca.ca.peer(ca.dir.path(), node);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert)
        .expect("cert")
        .map(|c| c.expect("pem"))
        .collect();
    let key = PrivateKeyDer::from_pem_file(&key).expect("key");
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&ca.file).expect("ca") {
        roots.add(c.expect("pem")).expect("root");
    }
    let provider = aqueduct_server::tls::provider();
    let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_client_auth_cert(certs.clone(), key.clone_key())
        .expect("client cert");
    client.alpn_protocols = vec![b"aqueduct-mesh".to_vec()];
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server cert");
    server.alpn_protocols = vec![b"aqueduct-mesh".to_vec()];
    let server = quinn::ServerConfig::with_crypto(std::sync::Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(server).expect("quic server"),
    ));
    let mut endpoint =
        quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(client).expect("quic client"),
    )));
    endpoint
}

/// A raw mesh peer `node-a` (a smaller id than the node's) that plays the race of two nodes
/// dialing each other at once: it dials the node and speaks (a snapshot), so the node keeps
/// that connection and has heard it; then the node dials back, and the peer, as a node that
/// has not heard the other on the kept connection yet does, retires the node's connection at
/// once without a word on it (finishes its data stream). The node held that connection
/// (it loses the duplicate rule to one that has worked): it must retire it as soon as the
/// peer's end arrives — finish its own data stream — not after its 5 s hold, which made both
/// ends warn that copies might be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_the_peer_retires_is_retired_at_once() {
    // The connection the peer dials: its two streams, and a snapshot on the control stream.
    let Spoken {
        _ca,
        b,
        endpoint,
        conn: kept,
        control: _control,
        data: _data,
    } = node_b_spoken_to_by_a().await;
    // The node dials the peer: the duplicate, which the node holds.
    b.control
        .set_cluster_peers(vec![endpoint.local_addr().expect("addr")]);
    let incoming = within("the node's dial", endpoint.accept())
        .await
        .expect("incoming");
    let dup = within("its handshake", incoming.accept().expect("accept"))
        .await
        .expect("handshake");
    // Retired at once by the peer, without a word: its streams, the data one finished.
    let mut dup_control = dup.open_uni().await.expect("control stream");
    dup_control.write_all(&[1u8]).await.expect("write");
    let mut dup_data = dup.open_uni().await.expect("data stream");
    dup_data.write_all(&[2u8]).await.expect("write");
    dup_data.finish().expect("finish");
    // The node retires it too: it finishes its data stream on it, well before its 5 s hold.
    let mut node_data = tokio::time::timeout(Duration::from_millis(2500), node_stream(&dup, 2))
        .await
        .expect("the node's data stream on the duplicate");
    let rest = tokio::time::timeout(Duration::from_millis(2500), node_data.read_to_end(1 << 20))
        .await
        .expect("the node finished its data stream on the duplicate before its hold ran out")
        .expect("read");
    assert!(rest.is_empty(), "no copies on a duplicate: {rest:?}");
    // Counted by the node's driver, which the connection's own task does not wait for.
    let retired = || {
        b.control
            .mesh()
            .expect("cluster on")
            .retired
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    until("the node to count the retired connection", || {
        retired() >= 1
    })
    .await;
    assert_eq!(retired(), 1);
    assert_eq!(peers_of(&b), BTreeSet::from(["node-a".to_string()]));
    kept.close(0u32.into(), b"done");
    dup.close(0u32.into(), b"done");
    b.stop().await.expect("clean shutdown");
}

/// One node may have at most 8 mesh connections open to another at a time: a peer that opens
/// twelve at once has the last four closed at once, with a reason, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_may_not_open_more_than_eight_connections_at_once() {
    let ca = ClusterCa::new();
    let b = TestBroker::start_with(|c| c.cluster = ca.node("node-b", None)).await;
    let endpoint = raw_peer(&ca, "node-a");
    let conns = raw_connections(&endpoint, &b, 12).await;
    let refused = || {
        b.control
            .mesh()
            .expect("cluster on")
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    until("the node to refuse the connections beyond eight", || {
        refused() >= 4
    })
    .await;
    for conn in &conns[8..] {
        let why = within("the refused connection's close", conn.closed()).await;
        match why {
            quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(
                c.reason.as_ref(),
                b"too many mesh connections from this node"
            ),
            other => panic!("closed otherwise: {other}"),
        }
    }
    assert_eq!(refused(), 4, "the first eight were taken");
    for conn in &conns {
        conn.close(0u32.into(), b"done");
    }
    b.stop().await.expect("clean shutdown");
}

/// `n` connections of a raw peer's `endpoint` to `b`, handshakes done, nothing said on them.
async fn raw_connections(
    endpoint: &quinn::Endpoint,
    b: &TestBroker,
    n: usize,
) -> Vec<quinn::Connection> {
    let mut conns = Vec::new();
    for i in 0..n {
        let conn = within(
            &format!("handshake {i}"),
            endpoint.connect(b.addr, "aqueduct-mesh").expect("connect"),
        )
        .await
        .expect("handshake");
        conns.push(conn);
    }
    conns
}

/// A raw peer `node`'s connection to `b` (`endpoint` presents that node's certificate), with a snapshot on its control stream (so the node
/// keeps it and has heard it) and its data stream opened: (connection, control stream, data
/// stream).
async fn raw_peer_spoke(
    endpoint: &quinn::Endpoint,
    node: &str,
    b: &TestBroker,
) -> (quinn::Connection, quinn::SendStream, quinn::SendStream) {
    use aqueduct_core::mesh::{Control, Interest};
    let conn = within(
        "the peer's dial",
        endpoint.connect(b.addr, "aqueduct-mesh").expect("connect"),
    )
    .await
    .expect("handshake");
    let mut control = conn.open_uni().await.expect("control stream");
    let mut snapshot = vec![1u8]; // CONTROL_STREAM
    aqueduct_core::mesh_codec::encode_control(
        &Control::Snapshot {
            session: 1 << 20,
            seq: 0,
            interest: Interest::default(),
        },
        &mut snapshot,
    );
    control.write_all(&snapshot).await.expect("write");
    let mut data = conn.open_uni().await.expect("data stream");
    data.write_all(&[2u8]).await.expect("write"); // DATA_STREAM
    until("the node to keep the peer's connection", || {
        peers_of(b).contains(node)
    })
    .await;
    (conn, control, data)
}

/// Node "node-b", and a raw peer "node-a" that dialed it and spoke (see [`raw_peer_spoke`]).
struct Spoken {
    /// Its certificates' directory, kept for the node's life.
    _ca: ClusterCa,
    b: TestBroker,
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    control: quinn::SendStream,
    data: quinn::SendStream,
}

async fn node_b_spoken_to_by_a() -> Spoken {
    let ca = ClusterCa::new();
    let b = TestBroker::start_with(|c| c.cluster = ca.node("node-b", None)).await;
    let endpoint = raw_peer(&ca, "node-a");
    let (conn, control, data) = raw_peer_spoke(&endpoint, "node-a", &b).await;
    Spoken {
        _ca: ca,
        b,
        endpoint,
        conn,
        control,
        data,
    }
}

/// The first unidirectional stream of `kind` (1 control, 2 data) the node opens on a raw
/// peer's connection, its kind byte read.
async fn node_stream(conn: &quinn::Connection, kind: u8) -> quinn::RecvStream {
    loop {
        let mut recv = conn.accept_uni().await.expect("the node's streams");
        let mut first = [0u8];
        recv.read_exact(&mut first).await.expect("kind");
        if first[0] == kind {
            return recv;
        }
    }
}

/// The node's control stream on a raw peer's connection.
async fn node_control_stream(conn: &quinn::Connection) -> quinn::RecvStream {
    within("the node's control stream", node_stream(conn, 1)).await
}

/// Read control messages from the node's control stream until `want` says yes to one.
async fn until_control(
    recv: &mut quinn::RecvStream,
    want: impl Fn(&aqueduct_core::mesh::Control) -> bool,
) {
    let mut buf = Vec::new();
    within("a control message", async {
        loop {
            while let Ok((control, used)) = aqueduct_core::mesh_codec::decode_control(&buf) {
                buf.drain(..used);
                if want(&control) {
                    return;
                }
            }
            let chunk = recv
                .read_chunk(4096, true)
                .await
                .expect("read")
                .expect("the stream goes on");
            buf.extend_from_slice(&chunk.bytes);
        }
    })
    .await
}

/// A node shutting down while a peer that already said it is leaving still has its connection
/// open waits for that peer as for the others: the peer's copies are published and the node's
/// control stream finished (what the leaving peer waits for), not cut. The node closed such a
/// connection at once ("broker shutting down"), as if its control writer were stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_leaving_waits_for_a_peer_that_is_leaving_too() {
    use aqueduct_core::mesh::Control;
    let ca = ClusterCa::new();
    let b = TestBroker::start_with(|c| c.cluster = ca.node("node-b", None)).await;
    let (endpoint_a, endpoint_c) = (raw_peer(&ca, "node-a"), raw_peer(&ca, "node-c"));
    let (conn_c, _control_c, _data_c) = raw_peer_spoke(&endpoint_c, "node-c", &b).await;
    let (conn_a, mut control_a, mut data_a) = raw_peer_spoke(&endpoint_a, "node-a", &b).await;
    let mut node_control_a = node_control_stream(&conn_a).await;
    let mut node_control_c = node_control_stream(&conn_c).await;
    let mut leaving = Vec::new();
    aqueduct_core::mesh_codec::encode_control(&Control::Leaving, &mut leaving);
    control_a.write_all(&leaving).await.expect("write");
    until("the node to let node-a go", || {
        peers_of(&b) == BTreeSet::from(["node-c".to_string()])
    })
    .await;
    let stopping = tokio::spawn(b.stop());
    // node-c hears the node leave: the node has dealt with every connection by then.
    until_control(&mut node_control_c, |c| matches!(c, Control::Leaving)).await;
    // node-a has written everything: the node finishes its control stream once that is
    // published, on a connection still open.
    data_a.finish().expect("finish");
    within(
        "the node's control FIN to node-a",
        node_control_a.read_to_end(1 << 20),
    )
    .await
    .expect("the node's control stream finished, the connection still open");
    conn_a.close(0u32.into(), b"left");
    conn_c.close(0u32.into(), b"left");
    within("the node's stop", stopping)
        .await
        .expect("joined")
        .expect("clean shutdown");
}

fn protocol_errors(b: &TestBroker) -> u64 {
    b.control
        .mesh()
        .expect("cluster on")
        .protocol_errors
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// The reason a connection was closed with by its peer (the node), within `wait`.
async fn closed_by_node(conn: &quinn::Connection, wait: Duration) -> String {
    match tokio::time::timeout(wait, conn.closed())
        .await
        .expect("the node closed the connection in time")
    {
        quinn::ConnectionError::ApplicationClosed(c) => {
            String::from_utf8_lossy(&c.reason).into_owned()
        }
        other => panic!("closed otherwise: {other}"),
    }
}

/// A peer that says it is leaving and then keeps the connection open (finishing nothing, its
/// keep-alives answered) has it closed by the node once the leave's 5 s are well past, with a
/// reason, counted: before, the node kept it for ever, so a peer leaving over and over (each
/// time on a new connection) made it keep ever more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_says_it_leaves_and_stays_is_closed() {
    let mut p = node_b_spoken_to_by_a().await;
    let mut leaving = Vec::new();
    aqueduct_core::mesh_codec::encode_control(&aqueduct_core::mesh::Control::Leaving, &mut leaving);
    p.control.write_all(&leaving).await.expect("write");
    until("the node to forget the leaving peer", || {
        peers_of(&p.b).is_empty()
    })
    .await;
    let started = std::time::Instant::now();
    let why = closed_by_node(&p.conn, Duration::from_secs(20)).await;
    assert_eq!(
        why,
        "the peer said it was leaving but kept the connection open"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "not before the leave's own wait: {:?}",
        started.elapsed()
    );
    assert_eq!(protocol_errors(&p.b), 1);
    p.b.stop().await.expect("clean shutdown");
}

/// A control stream that breaks the mesh protocol (here a message of an unknown kind) has its
/// connection closed with the reason the peer's node recognises ("mesh protocol error"), and
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_stream_that_breaks_the_protocol_is_closed_and_counted() {
    let mut p = node_b_spoken_to_by_a().await;
    // A message of 25 bytes whose kind (0x7f) no version knows.
    let mut bad = vec![0x15, 0, 0, 0, 0x7f];
    bad.extend_from_slice(&[0u8; 20]);
    p.control.write_all(&bad).await.expect("write");
    let why = closed_by_node(&p.conn, Duration::from_secs(5)).await;
    assert_eq!(why, aqueduct_core::mesh::PROTOCOL_ERROR);
    assert_eq!(protocol_errors(&p.b), 1);
    p.b.stop().await.expect("clean shutdown");
}

/// A data stream whose block holds a malformed record (routing longer than the record) has its
/// connection closed as a protocol error and is counted in `refused_blocks`
/// (`aqueduct_mesh_blocks_refused_total`, "a malformed block"): only a block that did not open
/// was counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_with_a_malformed_record_is_refused_and_counted() {
    let mut p = node_b_spoken_to_by_a().await;
    // A plain block (kind 1) of 2 bytes: one record whose routing claims 65,535 bytes.
    p.data
        .write_all(&[1, 2, 0, 0, 0, 0xff, 0xff])
        .await
        .expect("write");
    let why = closed_by_node(&p.conn, Duration::from_secs(5)).await;
    assert_eq!(why, aqueduct_core::mesh::PROTOCOL_ERROR);
    let mesh = p.b.control.mesh().expect("cluster on");
    assert_eq!(
        mesh.refused_blocks
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(protocol_errors(&p.b), 1);
    p.b.stop().await.expect("clean shutdown");
}

/// A peer that closes this node's connection for a protocol error is not counted as refusing
/// this node's interest (`aqueduct_mesh_interest_refused_by_peer_total` says "went beyond that
/// peer's `cluster.max_peer_interest`"): every such close was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_closing_for_a_protocol_error_is_not_an_interest_refusal() {
    let p = node_b_spoken_to_by_a().await;
    p.conn
        .close(0u32.into(), aqueduct_core::mesh::PROTOCOL_ERROR.as_bytes());
    // The node hears of the refusal before it forgets the connection (one channel, in order).
    until("the node to forget the peer", || peers_of(&p.b).is_empty()).await;
    let mesh = p.b.control.mesh().expect("cluster on");
    assert_eq!(
        mesh.refused_by_peer
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    p.b.stop().await.expect("clean shutdown");
}

/// The cap of 8 connections per peer counts this node's dials too: with 8 of the peer's open,
/// a connection the node dials to it is closed at once, with the reason, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_beyond_eight_connections_to_a_peer_is_closed() {
    let ca = ClusterCa::new();
    let b = TestBroker::start_with(|c| c.cluster = ca.node("node-b", None)).await;
    let endpoint = raw_peer(&ca, "node-a");
    let conns = raw_connections(&endpoint, &b, 8).await;
    b.control
        .set_cluster_peers(vec![endpoint.local_addr().expect("addr")]);
    let incoming = within("the node's dial", endpoint.accept())
        .await
        .expect("incoming");
    let dialed = within("its handshake", incoming.accept().expect("accept"))
        .await
        .expect("handshake");
    let why = closed_by_node(&dialed, Duration::from_secs(5)).await;
    assert_eq!(why, "too many mesh connections from this node");
    let refused = b
        .control
        .mesh()
        .expect("cluster on")
        .connections_refused
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(refused, 1);
    for conn in &conns {
        conn.close(0u32.into(), b"done");
    }
    b.stop().await.expect("clean shutdown");
}
