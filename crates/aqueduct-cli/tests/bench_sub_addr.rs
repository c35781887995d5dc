//! `aqueduct bench --sub-addr`: the subscribers connect to another broker than the publishers.
//! Across a 2-node cluster every message published on one node reaches the subscriber on the
//! other (nothing lost, the probes not counted); two brokers that are not a cluster never pass
//! the probes (so the subscribers are really on the other broker); the same broker twice works
//! as without the option.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn bench(home: &Path, addr: &str, args: &[&str]) -> std::process::Output {
    let child = Command::new(CLIENT)
        .args(["--addr", addr, "bench", "--json", "--idle", "3s"])
        .args(args)
        .env("AQUEDUCT_HOME", home)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bench runs");
    output_within(child, "aqueduct bench")
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert_ok(out);
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn sub_addr_of_the_same_broker_counts_every_message_once() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, _metrics, _logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_BROKER_QUEUE_SIZE", "100000")]);
    let out = bench(
        home.path(),
        &addr,
        &[
            "--messages",
            "4000",
            "--subscribers",
            "2",
            "--batch",
            "50",
            "--sub-addr",
            &addr,
        ],
    );
    let r = json(&out);
    assert_eq!(r["sub_addr"], addr.as_str());
    assert_eq!(r["msgs"], 4000);
    assert_eq!(
        (r["lost_total"].as_u64(), r["duplicates_total"].as_u64()),
        (Some(0), Some(0))
    );
    // The probes are not counted: exactly the published messages, each with a latency sample.
    for sub in r["subscribers"].as_array().expect("subscribers") {
        assert_eq!(sub["received"], 4000);
    }
    assert_eq!(r["latency"]["samples"], 8000);
    stop(broker);
}

#[test]
fn sub_addr_of_a_broker_outside_the_cluster_never_sees_the_probes() {
    let (home_a, home_b) = (
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    );
    let (a, addr_a, _la) = start_broker(home_a.path());
    let (b, addr_b, _lb) = start_broker(home_b.path());
    let dev_b = home_b.path().join("dev-cert.pem").display().to_string();
    let out = bench(
        home_a.path(),
        &addr_a,
        &[
            "--messages",
            "1000",
            "--sub-addr",
            &addr_b,
            "--sub-dev-cert",
            &dev_b,
            "--probe-timeout",
            "2s",
        ],
    );
    assert!(!out.status.success(), "a run without forwarding succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("saw a probe"), "{err}");
    // Without --sub-dev-cert the subscriber does not trust B's development certificate (it is
    // not A's): the option is what the connection to B used.
    let out = bench(
        home_a.path(),
        &addr_a,
        &["--messages", "1000", "--sub-addr", &addr_b],
    );
    assert!(!out.status.success(), "B was trusted with A's certificate");
    stop(a);
    stop(b);
}

/// Node `i` of a cluster of `peers` (a large queue: the bench's publisher is not held).
fn node(home: &Path, i: usize, port: u16, peers: &[String]) -> (common::Broker, String, String) {
    cluster_node(
        home,
        i,
        port,
        peers,
        &[("AQUEDUCT_BROKER_QUEUE_SIZE", "100000")],
    )
}

#[test]
fn sub_addr_on_another_cluster_node_gets_every_message() {
    let home = tempfile::tempdir().expect("dir");
    let h = home.path();
    let certs = h.join("certs").display().to_string();
    assert_ok(&run_client(h, &["cert", "ca", "--out", &certs]));
    for i in 0..2 {
        let name = format!("node-{i}");
        assert_ok(&run_client(
            h,
            &[
                "cert",
                "peer",
                &name,
                "--out",
                &certs,
                "--name",
                "127.0.0.1",
            ],
        ));
    }
    let ports = [free_udp_port(), free_udp_port()];
    let peers: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let nodes: Vec<_> = (0..2).map(|i| node(h, i, ports[i], &peers)).collect();
    for (_, _, metrics) in &nodes {
        let start = Instant::now();
        while metric(metrics, "aqueduct_mesh_peers") != Some(1.0) {
            assert!(start.elapsed() < WAIT, "the mesh did not form");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let dev_b = h.join("home-1").join("dev-cert.pem").display().to_string();
    let out = bench(
        &h.join("home-0"),
        &nodes[0].1,
        &[
            "--messages",
            "5000",
            "--batch",
            "50",
            "--sub-addr",
            &nodes[1].1,
            "--sub-dev-cert",
            &dev_b,
        ],
    );
    let r = json(&out);
    assert_eq!(
        (r["lost_total"].as_u64(), r["duplicates_total"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(r["subscribers"][0]["received"], 5000);
    // They went through the mesh: node 0 forwarded them to node 1 (and the probes).
    let forwarded = metric(&nodes[0].2, "aqueduct_mesh_forwarded_total").unwrap_or(0.0);
    assert!(forwarded >= 5000.0, "forwarded {forwarded}");
    for (child, _, _) in nodes {
        stop(child);
    }
}
