//! `aqueduct admin` against the real broker binary with certificates made by `aqueduct cert`:
//! every subcommand, table and JSON output, a non-admin certificate refused, SIGHUP reloading
//! the config file's sections, and API changes surviving a restart until the file is edited;
//! `aqueduct admin cluster` on a 2-node cluster of real processes (peers, interest, counters).

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use common::*;
use serde_json::Value;

/// Read broker log lines until one contains `needle`; that line.
fn log_line(logs: &mpsc::Receiver<String>, needle: &str) -> String {
    let mut seen = Vec::new();
    loop {
        let line = logs.recv_timeout(WAIT).unwrap_or_else(|_| {
            panic!(
                "no broker log line with {needle:?} in:\n{}",
                seen.join("\n")
            )
        });
        if line.contains(needle) {
            return line;
        }
        seen.push(line);
    }
}

fn config(dir: &Path, rules: &str) -> String {
    let certs = dir.join("certs");
    format!(
        "tls:\n  client_ca_file: {ca}\nacl:\n  enabled: true\n  default: none\n  rules:\n{rules}admin:\n  enabled: true\n  listen_addr: 127.0.0.1:0\n  state_file: {state}\n",
        ca = certs.join("ca.pem").display(),
        state = dir.join("admin-state.json").display(),
    )
}

struct Broker {
    child: common::Broker,
    addr: String,
    admin: String,
    logs: mpsc::Receiver<String>,
}

fn start(home: &Path, config_file: &Path) -> Broker {
    let (child, addr, _metrics, logs) = start_broker_config(home, config_file, "127.0.0.1:0", &[]);
    let admin = admin_addr(&logs);
    Broker {
        child,
        addr,
        admin,
        logs,
    }
}

/// `aqueduct admin` with the certificate of `cn`; its output.
fn admin(home: &Path, b: &Broker, cn: &str, args: &[&str]) -> std::process::Output {
    let certs = home.join("certs");
    let cert = certs.join(format!("{cn}.pem")).display().to_string();
    let key = certs.join(format!("{cn}-key.pem")).display().to_string();
    admin_as(home, b, &cert, &key, args)
}

/// `aqueduct admin` with the certificate `cert` and its key `key`; its output.
fn admin_as(home: &Path, b: &Broker, cert: &str, key: &str, args: &[&str]) -> std::process::Output {
    let mut all = vec![
        "admin",
        "--admin-addr",
        &b.admin,
        "--cert",
        cert,
        "--key",
        key,
    ];
    all.extend_from_slice(args);
    run_client(home, &all)
}

fn admin_json(home: &Path, b: &Broker, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = admin(home, b, "admin-alice", &all);
    assert_ok(&out);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: not JSON: {}", String::from_utf8_lossy(&out.stdout)))
}

fn rule_count(home: &Path, b: &Broker) -> usize {
    admin_json(home, b, &["acl", "list"])["rules"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

#[test]
fn admin_commands_manage_a_running_broker() {
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();
    let certs = h.join("certs").display().to_string();
    for args in [
        vec!["cert", "ca", "--out", &certs, "--cn", "Aqueduct test CA"],
        vec!["cert", "client", "admin-alice", "--out", &certs],
        vec!["cert", "client", "service-a", "--out", &certs],
    ] {
        assert_ok(&run_client(h, &args));
    }
    let config_file = h.join("config.yaml");
    std::fs::write(
        &config_file,
        config(
            h,
            "    - {client: service-a, topic: \"orders/#\", permission: all}\n",
        ),
    )
    .expect("write config");
    let b = start(h, &config_file);

    // A certificate that is not admin-*: refused, saying why.
    let out = admin(h, &b, "service-a", &["info"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not match admin.allowed_cn") && err.contains("admin-*"),
        "{err}"
    );
    assert_eq!(
        err.matches("admin.allowed_cn").count(),
        1,
        "said once: {err}"
    );
    // No certificate at all: said in plain words, before dialing (the broker would refuse the
    // handshake; tonic saw only a dropped connection, once per address of `localhost`). Also
    // where nothing listens.
    for admin_addr in [b.admin.as_str(), "127.0.0.1:1"] {
        let out = run_client(h, &["admin", "--admin-addr", admin_addr, "info"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("requires an admin client certificate: pass --cert"),
            "{admin_addr}: {err}"
        );
    }

    // Certificates from a CA the broker does not trust: said in plain words, for a client and
    // for the admin API (a session ended after its handshake). A CA of another name (what
    // `cert ca` makes by default) is an unknown issuer (the broker's TLS alert 48); one named as
    // the trusted CA but with another key fails its signature check (alert 51).
    for (dir, cn, said) in [
        (
            "other",
            None,
            "the broker does not trust the CA that signed the client certificate",
        ),
        (
            "twin",
            Some("Aqueduct test CA"),
            "not signed by a CA the broker trusts",
        ),
    ] {
        let other = h.join(dir).display().to_string();
        let mut ca = vec!["cert", "ca", "--out", &other];
        ca.extend(cn.iter().flat_map(|cn| ["--cn", *cn]));
        assert_ok(&run_client(h, &ca));
        assert_ok(&run_client(
            h,
            &["cert", "client", "admin-bob", "--out", &other],
        ));
        let (cert, key) = (
            format!("{other}/admin-bob.pem"),
            format!("{other}/admin-bob-key.pem"),
        );
        let out = run_client(
            h,
            &[
                "--addr",
                &b.addr,
                "--cert",
                &cert,
                "--key",
                &key,
                "pub",
                "orders/1",
                "x",
                "--confirm",
            ],
        );
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{dir}: {err}");
        let out = admin_as(h, &b, &cert, &key, &["info"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("did not accept the client certificate") || err.contains(said),
            "{dir}: {err}"
        );
    }

    // info, as a table and as JSON.
    let out = admin(h, &b, "admin-alice", &["info"]);
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("access control on (1 rules)"), "{text}");
    assert_eq!(admin_json(h, &b, &["info"])["acl_enabled"], true);

    // cluster, with the cluster off: an answer, not an error.
    let out = admin(h, &b, "admin-alice", &["cluster"]);
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("cluster off (cluster.enabled: false)"),
        "{text}"
    );
    let c = admin_json(h, &b, &["cluster"]);
    assert_eq!(c["cluster_enabled"], false, "{c}");
    assert_eq!(c["peers"].as_array().map(Vec::len), Some(0), "{c}");
    // Every field of the response, zeros included, as the other commands' JSON.
    assert_eq!(c["refused_blocks"], 0, "{c}");

    // ACL: add, remove, replace from a file.
    let acl = admin_json(
        h,
        &b,
        &["acl", "add", "ops-*", "__dlq__orders", "subscribe"],
    );
    assert_eq!(acl["rules"].as_array().map(Vec::len), Some(2));
    let out = admin(h, &b, "admin-alice", &["acl", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CLIENT     TOPIC          PERMISSION") && text.contains("ops-*"),
        "{text}"
    );
    admin_json(h, &b, &["acl", "rm", "ops-*", "__dlq__orders", "subscribe"]);
    assert_eq!(rule_count(h, &b), 1);
    let out = admin(h, &b, "admin-alice", &["acl", "rm", "nobody", "x", "all"]);
    assert!(!out.status.success(), "removing a missing rule fails");
    let rules_file = h.join("rules.yaml");
    std::fs::write(
        &rules_file,
        "default: none\nrules:\n  - {client: service-a, topic: \"orders/#\", permission: all}\n  - {client: \"*\", topic: \"public/#\", permission: subscribe}\n",
    )
    .expect("write rules");
    let acl = admin_json(
        h,
        &b,
        &["acl", "replace", &rules_file.display().to_string()],
    );
    assert_eq!(acl["rules"].as_array().map(Vec::len), Some(2));
    assert_eq!(acl["default_permission"], "none");
    // What `--json acl list` prints is read back by `acl replace` as it is.
    let listed = admin_json(h, &b, &["acl", "list"]);
    assert_eq!(listed["rules"][0]["client_id"], "service-a", "{listed}");
    let listed_file = h.join("rules-listed.json");
    std::fs::write(&listed_file, listed.to_string()).expect("write the listed rules");
    // `remove`, as the RPC and the help say, is `rm`.
    admin_json(h, &b, &["acl", "remove", "*", "public/#", "subscribe"]);
    assert_eq!(rule_count(h, &b), 1);
    let acl = admin_json(
        h,
        &b,
        &["acl", "replace", &listed_file.display().to_string()],
    );
    assert_eq!(acl, listed, "the rules and the default, as listed");

    // Quotas: set, get, list, remove.
    let q = admin_json(
        h,
        &b,
        &["quota", "set", "service-a", "500", "--burst", "50"],
    );
    assert_eq!(
        (q["rate"].as_u64(), q["burst"].as_u64()),
        (Some(500), Some(50))
    );
    let q = admin_json(h, &b, &["quota", "get", "service-a"]);
    assert_eq!(q["is_override"], true);
    let list = admin_json(h, &b, &["quota", "list"]);
    assert_eq!(list["clients"].as_array().map(Vec::len), Some(1));
    assert_eq!(list["action"], "throttle");
    let q = admin_json(h, &b, &["quota", "rm", "service-a"]);
    assert_eq!(q["is_override"], false);

    // A connected client shows up, with its subscription; it can be kicked.
    let (sub_cert, sub_key) = (
        h.join("certs/service-a.pem").display().to_string(),
        h.join("certs/service-a-key.pem").display().to_string(),
    );
    let sub = Command::new(CLIENT)
        .args([
            "--cert", &sub_cert, "--key", &sub_key, "--addr", &b.addr, "sub", "orders/#",
        ])
        .env("AQUEDUCT_HOME", h)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aqueduct sub");
    let clients = wait_for(|| {
        let c = admin_json(h, &b, &["clients"]);
        let found = c.as_array().is_some_and(|a| {
            a.iter().any(|c| {
                c["client_id"] == "service-a" && c["subscriptions"][0]["filter"] == "orders/#"
            })
        });
        found.then_some(c)
    });
    assert!(clients.is_array());
    let kicked = admin_json(h, &b, &["kick", "service-a", "--reason", "maintenance"]);
    assert_eq!(kicked["disconnected"], 1);
    let out = output_within(sub, "the kicked subscriber");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("maintenance"), "the client is told why: {err}");
    assert!(
        err.contains("the broker closed the connection: disconnected by an administrator"),
        "in plain words, without a code: {err}"
    );
    let topics = admin_json(h, &b, &["topics"]);
    assert!(topics.is_array());

    // SIGHUP: the file's sections become the policy again (the API's changes go).
    std::fs::write(
        &config_file,
        config(
            h,
            "    - {client: a, topic: t1, permission: all}\n    - {client: b, topic: t2, permission: all}\n    - {client: c, topic: t3, permission: all}\n",
        ),
    )
    .expect("rewrite config");
    let _ = Command::new("kill")
        .args(["-HUP", &b.child.id().to_string()])
        .status();
    log_line(&b.logs, "SIGHUP: acl and broker.quotas reloaded");
    assert_eq!(rule_count(h, &b), 3);

    // An API change survives a restart...
    admin_json(h, &b, &["acl", "add", "d", "t4", "all"]);
    stop(b.child);
    let b = start(h, &config_file);
    assert_eq!(rule_count(h, &b), 4, "the state file's rules");
    // ... until the config file's sections are edited: then the file wins.
    std::fs::write(
        &config_file,
        config(h, "    - {client: e, topic: t5, permission: all}\n"),
    )
    .expect("rewrite config");
    stop(b.child);
    let b = start(h, &config_file);
    assert_eq!(rule_count(h, &b), 1, "the edited config file's rules");
    stop(b.child);
}

/// Poll `f` (every 50 ms) until it returns something, for at most `WAIT`.
fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < WAIT, "condition not met within {WAIT:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A cluster node with the admin API: its addresses and log.
struct Node {
    child: common::Broker,
    addr: String,
    admin: String,
    _logs: mpsc::Receiver<String>,
}

fn start_node(home: &Path, name: &str, port: u16, peers: &[String]) -> Node {
    let certs = home.join("certs");
    let file = |f: &str| certs.join(f).display().to_string();
    let config = home.join(format!("{name}.yaml"));
    std::fs::write(
        &config,
        format!(
            "tls:\n  generate: false\n  cert_file: {cert}\n  key_file: {key}\ncluster:\n  enabled: true\n  peers: [{peers}]\n  tls:\n    ca_file: {ca}\n    cert_file: {cert}\n    key_file: {key}\nadmin:\n  enabled: true\n  listen_addr: 127.0.0.1:0\n  client_ca_file: {ca}\n  state_file: {state}\n",
            cert = file(&format!("{name}.pem")),
            key = file(&format!("{name}-key.pem")),
            ca = file("ca.pem"),
            peers = peers.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", "),
            state = home.join(format!("{name}-admin-state.json")).display(),
        ),
    )
    .expect("config");
    let (child, addr, _metrics, logs) =
        start_broker_config(home, &config, &format!("127.0.0.1:{port}"), &[]);
    let admin = admin_addr(&logs);
    Node {
        child,
        addr,
        admin,
        _logs: logs,
    }
}

/// `aqueduct admin [--json] cluster` on `node`, with the admin certificate.
fn cluster_of(home: &Path, node: &Node, json: bool) -> std::process::Output {
    let certs = home.join("certs");
    let file = |f: &str| certs.join(f).display().to_string();
    let mut args = vec![
        "--ca".to_string(),
        file("ca.pem"),
        "--cert".into(),
        file("admin-alice.pem"),
        "--key".into(),
        file("admin-alice-key.pem"),
        "admin".into(),
        "--admin-addr".into(),
        node.admin.clone(),
    ];
    if json {
        args.push("--json".into());
    }
    args.push("cluster".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_client(home, &args)
}

fn cluster_json(home: &Path, node: &Node) -> Value {
    let out = cluster_of(home, node, true);
    assert_ok(&out);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: not JSON: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The entry of `peer` in a `--json cluster` answer.
fn peer_of<'a>(c: &'a Value, peer: &str) -> Option<&'a Value> {
    c["peers"].as_array()?.iter().find(|p| p["node_id"] == peer)
}

fn sub_on(home: &Path, node: &Node, args: &[&str]) -> Child {
    let ca = home.join("certs/ca.pem").display().to_string();
    let mut all = vec!["--ca", &ca, "--addr", &node.addr, "sub"];
    all.extend_from_slice(args);
    spawn_client(home, &all)
}

fn pub_on(home: &Path, node: &Node, topic: &str, body: &str) {
    let ca = home.join("certs/ca.pem").display().to_string();
    assert_ok(&run_client(
        home,
        &[
            "--ca",
            &ca,
            "--addr",
            &node.addr,
            "pub",
            topic,
            body,
            "--confirm",
        ],
    ));
}

/// Two real nodes: `aqueduct admin cluster` shows each one's peer, the interest it advertised
/// (a plain filter, a group member) and the counters of what went between them.
#[test]
fn admin_cluster_shows_the_peers_interest_and_counters() {
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();
    let certs = h.join("certs").display().to_string();
    assert_ok(&run_client(h, &["cert", "ca", "--out", &certs]));
    assert_ok(&run_client(
        h,
        &["cert", "client", "admin-alice", "--out", &certs],
    ));
    for name in ["node-a", "node-b"] {
        assert_ok(&run_client(
            h,
            &[
                "cert",
                "peer",
                name,
                "--out",
                &certs,
                "--name",
                "localhost",
                "--name",
                "127.0.0.1",
            ],
        ));
    }
    let ports = [free_udp_port(), free_udp_port()];
    let peers: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let a = start_node(h, "node-a", ports[0], &peers);
    let b = start_node(h, "node-b", ports[1], &peers);
    for (node, me, other) in [(&a, "node-a", "node-b"), (&b, "node-b", "node-a")] {
        let c = wait_for(|| {
            let c = cluster_json(h, node);
            peer_of(&c, other).is_some().then_some(c)
        });
        assert_eq!(c["cluster_enabled"], true, "{c}");
        assert_eq!(c["node_id"], me, "{c}");
        assert_eq!(
            c["peers"].as_array().map(Vec::len),
            Some(1),
            "only the other node: {c}"
        );
    }

    // Interest on node b (a plain filter, a group member) shows on node a.
    let plain = sub_on(h, &b, &["orders/#", "--count", "3"]);
    let member = sub_on(h, &b, &["jobs", "--group", "workers", "--count", "1"]);
    wait_for(|| {
        let c = cluster_json(h, &a);
        let i = &peer_of(&c, "node-b")?["interest"];
        (i["filters"] == 1
            && i["subscriptions"] == 1
            && i["groups"] == 1
            && i["group_members"] == 1)
            .then_some(())
    });
    let text = String::from_utf8_lossy(&cluster_of(h, &a, false).stdout).to_string();
    assert!(
        text.starts_with("node node-a: cluster on, 1 peer(s) connected, 0 block(s) refused"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("node-b") && l.contains("1 (1 subs)  1 (1 members)")),
        "{text}"
    );

    // Three orders and a job published on node a: four copies for node b, all received there.
    for i in 0..3 {
        pub_on(h, &a, "orders/eu", &format!("order {i}"));
    }
    pub_on(h, &a, "jobs", "job 0");
    let out = output_within(plain, "the subscriber on node b");
    assert_ok(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 3);
    assert_ok(&output_within(member, "the group member on node b"));
    let to_b = cluster_json(h, &a);
    let sent = &peer_of(&to_b, "node-b").expect("node-b")["counters"];
    assert_eq!(sent["forwarded"], 4, "{to_b}");
    assert_eq!(sent["dropped"], 0, "{to_b}");
    assert_eq!(sent["expired"], 0, "{to_b}");
    assert_eq!(sent["received"], 0, "node b published nothing: {to_b}");
    let bytes = sent["bytes"].as_u64().expect("bytes");
    assert!(bytes > 0 && sent["raw_bytes"].as_u64() > Some(0), "{to_b}");
    let from_a = cluster_json(h, &b);
    let got = &peer_of(&from_a, "node-a").expect("node-a")["counters"];
    assert_eq!(got["received"], 4, "{from_a}");
    assert_eq!(
        got["received_bytes"].as_u64(),
        Some(bytes),
        "as sent: {from_a}"
    );
    assert_eq!(got["forwarded"], 0, "node a wants nothing: {from_a}");
    assert_eq!(got["not_stored"], 0, "no durable log to fail: {from_a}");
    stop(a.child);
    stop(b.child);
}

/// `aqueduct cert revoke` and `tls.crl_file`: the broker binary refuses a revoked certificate,
/// and on SIGHUP re-reads the list and closes the connection of a certificate revoked since
/// (its `aqueduct sub` ends saying why); other clients go on.
#[test]
fn a_certificate_revoked_with_the_cli_is_shut_out_on_sighup() {
    let dir = tempfile::tempdir().expect("dir");
    let h = dir.path();
    let certs = h.join("certs").display().to_string();
    for args in [
        vec!["cert", "ca", "--out", &certs],
        vec!["cert", "client", "alice", "--out", &certs],
        vec!["cert", "client", "bob", "--out", &certs],
        vec!["cert", "client", "mallory", "--out", &certs],
    ] {
        assert_ok(&run_client(h, &args));
    }
    let file = |f: &str| h.join("certs").join(f).display().to_string();
    let revoke = |who: &[&str]| {
        let mut args = vec!["cert", "revoke", "--out", &certs];
        let paths: Vec<String> = who.iter().map(|w| file(&format!("{w}.pem"))).collect();
        args.extend(paths.iter().map(String::as_str));
        let out = run_client(h, &args);
        assert_ok(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let printed = revoke(&["mallory"]);
    assert!(printed.contains("revoked CN=mallory"), "{printed}");
    assert!(printed.contains("crl.pem"), "{printed}");
    let config_file = h.join("config.yaml");
    std::fs::write(
        &config_file,
        format!(
            "tls:\n  require_client_cert: true\n  client_ca_file: {}\n  crl_file: {}\n",
            file("ca.pem"),
            file("crl.pem")
        ),
    )
    .expect("config");
    let (broker, addr, _metrics, logs) = start_broker_config(h, &config_file, "127.0.0.1:0", &[]);
    let as_client = |who: &str, args: &[&str]| {
        let (cert, key) = (file(&format!("{who}.pem")), file(&format!("{who}-key.pem")));
        let mut all = vec!["--addr", &addr, "--cert", &cert, "--key", &key];
        all.extend_from_slice(args);
        all.iter().map(|s| s.to_string()).collect::<Vec<String>>()
    };
    let run_as = |who: &str, args: &[&str]| {
        let all = as_client(who, args);
        run_client(h, &all.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = run_as("mallory", &["pub", "t", "x", "--confirm"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("revoked"), "{err}");

    let sub_args = as_client("alice", &["sub", "t"]);
    let sub = spawn_client(h, &sub_args.iter().map(String::as_str).collect::<Vec<_>>());
    log_line(&logs, "subscribed client=alice");
    revoke(&["alice"]);
    let _ = Command::new("kill")
        .args(["-HUP", &broker.id().to_string()])
        .status();
    let line = log_line(&logs, "SIGHUP: tls.crl_file reloaded");
    assert!(
        line.contains("revoked_certificates=2") && line.contains("closed_connections=1"),
        "{line}"
    );
    let out = output_within(sub, "alice's subscriber");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("client certificate revoked"), "{err}");
    assert_ok(&run_as("bob", &["pub", "t", "x", "--confirm"]));
    let out = run_as("alice", &["pub", "t", "x", "--confirm"]);
    assert!(!out.status.success(), "alice is refused from now on");
    // A new path for the lists takes a restart: the reload says so (it re-read the old path
    // without a word, and a file added to a broker started without one was ignored).
    let moved = h.join("moved-crl.pem");
    std::fs::copy(file("crl.pem"), &moved).expect("copy");
    std::fs::write(
        &config_file,
        format!(
            "tls:\n  require_client_cert: true\n  client_ca_file: {}\n  crl_file: {}\n",
            file("ca.pem"),
            moved.display()
        ),
    )
    .expect("config");
    let _ = Command::new("kill")
        .args(["-HUP", &broker.id().to_string()])
        .status();
    let line = log_line(&logs, "tls.crl_file changed");
    assert!(line.contains("takes a restart"), "{line}");
    stop(broker);
}
