//! The cluster mesh between in-process brokers on 127.0.0.1: connections, interest, forwarding
//! to plain subscribers and to consumer groups with members on several nodes.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use aqueduct_core::mesh::Key;
use aqueduct_proto::TopicFilter;
use aqueduct_server::config::{ClusterConfig, Compression};
use common::*;

struct Cluster {
    nodes: Vec<TestBroker>,
    _dir: tempfile::TempDir,
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

fn node_config(
    ca: &TestCa,
    ca_file: &std::path::Path,
    dir: &std::path::Path,
    node: &str,
    discovery: Option<(String, u16, Duration)>,
) -> ClusterConfig {
    let (cert, key) = ca.peer(dir, node);
    ClusterConfig {
        enabled: true,
        peers: Vec::new(),
        ca_file: Some(ca_file.to_path_buf()),
        cert_file: Some(cert),
        key_file: Some(key),
        compression: Compression::None,
        peer_queue_size: 1024,
        discovery,
    }
}

/// DNS discovery with a fake resolver: the service scales 3 → 5 → 2 and every node's peer set
/// follows within about one interval (the wait allows a few, for a loaded machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_follows_the_service_as_it_scales() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let dns = std::sync::Arc::new(FakeDns::default());
    let interval = Duration::from_millis(200);
    let start = |i: usize| {
        let cfg = node_config(
            &ca,
            &ca_file,
            dir.path(),
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
    for b in nodes.drain(2..) {
        b.stop().await.expect("clean shutdown");
    }
    for (i, b) in nodes.iter().enumerate() {
        until(&format!("node-{i} to see 2 nodes"), || {
            peers_of(b) == others(i, 2)
        })
        .await;
    }
    for b in nodes {
        b.stop().await.expect("clean shutdown");
    }
}

async fn cluster(n: usize) -> Cluster {
    cluster_with(n, Compression::None).await
}

async fn cluster_with(n: usize, compression: Compression) -> Cluster {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let mut nodes = Vec::new();
    for i in 0..n {
        let (cert, key) = ca.peer(dir.path(), &format!("node-{i}"));
        let cfg = ClusterConfig {
            enabled: true,
            peers: Vec::new(),
            ca_file: Some(ca_file.clone()),
            cert_file: Some(cert),
            key_file: Some(key),
            compression,
            peer_queue_size: 1024,
            discovery: None,
        };
        nodes.push(TestBroker::start_with(|c| c.cluster = cfg).await);
    }
    // Every node gets every address, its own included (as DNS would answer).
    let addrs: Vec<SocketAddr> = nodes.iter().map(|b| b.addr).collect();
    for b in &nodes {
        b.control.set_cluster_peers(addrs.clone());
    }
    Cluster { nodes, _dir: dir }
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
    for b in nodes {
        b.stop().await.expect("clean shutdown");
    }
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
    // A node with no interest in stock/x was sent nothing of it: node 1's only copies are the
    // orders (checked above), and its own metrics show it forwarded nothing.
    let m1 = get(c.nodes[1].metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&m1, "aqueduct_mesh_forwarded_total{peer=\"node-0\"}"),
        Some(0.0)
    );
    for b in c.nodes {
        b.stop().await.expect("clean shutdown");
    }
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
    for b in c.nodes {
        b.stop().await.expect("clean shutdown");
    }
}

/// A client certificate cannot open a mesh connection: only a certificate of the cluster CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_certificate_of_another_ca_is_not_a_peer() {
    let c = cluster(1).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let other = test_ca();
    let ca_file = other.write(dir.path());
    let (cert, key) = other.peer(dir.path(), "intruder");
    let intruder = TestBroker::start_with(|cfg| {
        cfg.cluster = ClusterConfig {
            enabled: true,
            peers: Vec::new(),
            ca_file: Some(ca_file),
            cert_file: Some(cert),
            key_file: Some(key),
            compression: Compression::None,
            peer_queue_size: 1024,
            discovery: None,
        }
    })
    .await;
    intruder.control.set_cluster_peers(vec![c.nodes[0].addr]);
    c.nodes[0].control.set_cluster_peers(vec![intruder.addr]);
    // Give them time to try (and fail) a few times: neither may ever list the other.
    for _ in 0..50 {
        assert!(peers_of(&c.nodes[0]).is_empty());
        assert!(peers_of(&intruder).is_empty());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    intruder.stop().await.expect("clean shutdown");
    for b in c.nodes {
        b.stop().await.expect("clean shutdown");
    }
}

/// A client certificate of the cluster's own CA (no `aqueduct-mesh` name) is no peer either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_of_the_same_ca_is_not_a_peer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let node = TestBroker::start_with(|c| {
        c.cluster = node_config(&ca, &ca_file, dir.path(), "node-0", None)
    })
    .await;
    let (cert, key) = ca.client(dir.path(), "alice");
    let intruder = TestBroker::start_with(|c| {
        c.cluster = ClusterConfig {
            cert_file: Some(cert),
            key_file: Some(key),
            ..node_config(&ca, &ca_file, dir.path(), "unused", None)
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
