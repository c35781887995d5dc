//! A 3-node cluster of real `aqueduct-broker` processes on 127.0.0.1 (static peers, certificates
//! from `aqueduct cert`): messages published on one node reach exact and wildcard subscribers on
//! the others once each; a node killed with SIGKILL and restarted rejoins and gets deliveries.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Node {
    child: common::Broker,
    addr: String,
    metrics: String,
}

fn start(home: &Path, i: usize, port: u16, peers: &[String]) -> Node {
    let (child, addr, metrics) = cluster_node(home, i, port, peers, &[]);
    Node {
        child,
        addr,
        metrics,
    }
}

fn sub(home: &Path, node: usize, addr: &str, filter: &str, count: u32) -> Child {
    spawn_client(
        &home.join(format!("home-{node}")),
        &["--addr", addr, "sub", filter, "--count", &count.to_string()],
    )
}

fn publish(home: &Path, addr: &str, topic: &str, body: &str) {
    let out = Command::new(CLIENT)
        .args(["--addr", addr, "pub", topic, body, "--confirm"])
        .env("AQUEDUCT_HOME", home.join("home-0"))
        .output()
        .expect("aqueduct pub");
    assert_ok(&out);
}

/// Publish `topic` on node 0 (one message every 100 ms) until every subscriber has exited.
fn publish_until_done(home: &Path, addr: &str, topic: &str, subs: &mut [Child]) -> Vec<String> {
    let mut sent = 0;
    while subs
        .iter_mut()
        .any(|s| s.try_wait().ok().flatten().is_none())
    {
        assert!(
            sent < 300,
            "subscribers still waiting after {sent} messages"
        );
        publish(home, addr, topic, &format!("m{sent}"));
        sent += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    subs.iter_mut()
        .map(|s| {
            let mut out = String::new();
            s.stdout
                .take()
                .expect("stdout")
                .read_to_string(&mut out)
                .expect("read");
            assert!(s.wait().expect("wait").success());
            out
        })
        .collect()
}

#[test]
fn three_broker_processes_forward_once_and_a_killed_node_rejoins() {
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();
    let certs = h.join("certs").display().to_string();
    assert_ok(&run_client(h, &["cert", "ca", "--out", &certs]));
    for i in 0..3 {
        let node = format!("node-{i}");
        assert_ok(&run_client(
            h,
            &[
                "cert",
                "peer",
                &node,
                "--out",
                &certs,
                "--name",
                "localhost",
                "--name",
                "127.0.0.1",
            ],
        ));
    }
    let ports: Vec<u16> = (0..3).map(|_| free_udp_port()).collect();
    let peers: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let mut nodes: Vec<Node> = (0..3).map(|i| start(h, i, ports[i], &peers)).collect();
    for n in &nodes {
        wait_until("a full mesh", || {
            metric(&n.metrics, "aqueduct_mesh_peers") == Some(2.0)
        });
    }
    // Exact on node 1, wildcard on node 2: each gets 3 distinct messages, in order.
    let mut subs = vec![
        sub(h, 1, &nodes[1].addr, "orders/eu", 3),
        sub(h, 2, &nodes[2].addr, "orders/#", 3),
    ];
    let outs = publish_until_done(h, &nodes[0].addr, "orders/eu", &mut subs);
    for out in &outs {
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        let mut seen = std::collections::BTreeSet::new();
        for l in &lines {
            assert!(seen.insert(*l), "a duplicate: {out}");
        }
    }
    // Kill node 2 (SIGKILL) and restart it on the same port: it rejoins.
    let _ = nodes[2].child.kill();
    let _ = nodes[2].child.wait();
    wait_until("node 0 to notice", || {
        metric(&nodes[0].metrics, "aqueduct_mesh_peers") == Some(1.0)
    });
    nodes[2] = start(h, 2, ports[2], &peers);
    for n in &nodes {
        wait_until("the mesh to heal", || {
            metric(&n.metrics, "aqueduct_mesh_peers") == Some(2.0)
        });
    }
    let mut again = vec![sub(h, 2, &nodes[2].addr, "orders/#", 2)];
    let outs = publish_until_done(h, &nodes[0].addr, "orders/eu", &mut again);
    assert_eq!(outs[0].lines().count(), 2, "{}", outs[0]);
    for n in nodes {
        stop(n.child);
    }
}
