//! docs/howto-cluster.md's local section, run as written: every ```sh block after a
//! `<!-- howto-cluster: ... -->` marker, in order (see `common/howto.rs`), with three real
//! `aqueduct-broker` processes on the ports the page names (127.0.0.1, UDP 7441–7443, TCP
//! 9441–9443 and 9451–9453: below the ephemeral range, so no other test's port-0 sockets take
//! them), and the outputs the page shows.

mod common;

const DOC: &str = include_str!("../../../docs/howto-cluster.md");

/// The row of `peer` in the `aqueduct admin cluster` table printed for `node`, as columns.
fn row<'a>(outputs: &'a [String], node: &str, peer: &str) -> Vec<&'a str> {
    let header = format!("node {node}: cluster on");
    let out = outputs
        .iter()
        .rev()
        .find(|o| o.starts_with(&header))
        .unwrap_or_else(|| panic!("no cluster table of {node} in {outputs:#?}"));
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(peer))
        .unwrap_or_else(|| panic!("no row for {peer} in:\n{out}"))
        .split_whitespace()
        .collect()
}

/// A column of a row, by header (FILTERS and GROUPS take three words each: "0 (0 subs)").
fn column(row: &[&str], name: &str) -> u64 {
    let headers = [
        "FORWARDED",
        "DROPPED",
        "EXPIRED",
        "QUEUED",
        "RECEIVED",
        "BYTES-OUT",
        "RAW-BYTES-OUT",
        "BYTES-IN",
        "RECONNECTS",
        "NOT-STORED",
    ];
    let i = headers.iter().position(|h| *h == name).expect("a column");
    row[7 + i].parse().expect("a number")
}

#[test]
fn the_cluster_howto_runs_as_written() {
    let outputs = common::howto::run_howto(DOC, "howto-cluster", 14, false);
    let all = outputs.join("");
    for shown in [
        "node node-1: cluster on, 2 peer(s) connected, 0 block(s) refused",
        "node node-2: cluster on, 2 peer(s) connected, 0 block(s) refused",
        "published to orders/eu at offset 0",
        "published to orders/us at offset 0",
        "orders/eu #0 p2: first order",
        "orders/us #0 p2: second order",
    ] {
        assert!(
            all.contains(shown),
            "the page shows {shown:?}; the run printed:\n{all}"
        );
    }
    // The subscriber on node 2 got each order once.
    let orders: Vec<&str> = all.lines().filter(|l| l.starts_with("orders/")).collect();
    assert_eq!(orders.len(), 2, "{all}");
    // After the two publishes on node 1: one copy each for node 2, none for node 3 (no
    // interest), nothing dropped; node 2 received both from node 1.
    let to_2 = row(&outputs, "node-1", "node-2");
    let to_3 = row(&outputs, "node-1", "node-3");
    assert_eq!(column(&to_2, "FORWARDED"), 2, "{to_2:?}");
    assert_eq!(column(&to_2, "DROPPED"), 0, "{to_2:?}");
    assert!(column(&to_2, "BYTES-OUT") > 0, "{to_2:?}");
    assert_eq!(column(&to_3, "FORWARDED"), 0, "{to_3:?}");
    assert_eq!(column(&to_3, "BYTES-OUT"), 0, "{to_3:?}");
    let from_1 = row(&outputs, "node-2", "node-1");
    assert_eq!(column(&from_1, "RECEIVED"), 2, "{from_1:?}");
    assert!(column(&from_1, "BYTES-IN") > 0, "{from_1:?}");
    // The group: six jobs, each printed once, by the three workers (one per node, two each).
    let workers: Vec<&String> = outputs.iter().filter(|o| o.contains("jobs #")).collect();
    assert_eq!(workers.len(), 3, "three workers: {outputs:#?}");
    let mut jobs = std::collections::BTreeSet::new();
    for worker in &workers {
        let lines: Vec<&str> = worker.lines().filter(|l| l.starts_with("jobs #")).collect();
        assert_eq!(lines.len(), 2, "{worker}");
        for l in lines {
            let body = l.split_once(": ").map(|(_, b)| b).expect("a body");
            assert!(jobs.insert(body.to_string()), "{body} twice: {workers:#?}");
        }
    }
    let want: std::collections::BTreeSet<String> = (1..=6).map(|i| format!("job {i}")).collect();
    assert_eq!(jobs, want);
    // As the page shows them: node 1's worker with the topic's offsets there, the others with
    // their own numbering of the copies they received, round-robin in node-id order.
    for shown in [
        "jobs #0 p2: job 1\njobs #3 p2: job 4",
        "jobs #0 p2: job 2\njobs #1 p2: job 5",
        "jobs #0 p2: job 3\njobs #1 p2: job 6",
    ] {
        assert!(
            workers.iter().any(|w| w.contains(shown)),
            "the page shows {shown:?}; the workers printed {workers:#?}"
        );
    }
}
