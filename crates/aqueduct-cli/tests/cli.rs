//! The binaries as a user runs them: help, config errors, and a real broker with `aqueduct pub`
//! and `aqueduct sub` trusting the generated development certificate, then SIGTERM → exit 0.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BROKER: &str = env!("CARGO_BIN_EXE_aqueduct-broker");
const CLIENT: &str = env!("CARGO_BIN_EXE_aqueduct");
const WAIT: Duration = Duration::from_secs(30);

#[test]
fn help_explains_the_flags() {
    let out = Command::new(BROKER).arg("--help").output().expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--config",
        "--addr",
        "--metrics-addr",
        "--cert",
        "--key",
        "--aal",
        "AQUEDUCT_",
        "dev-cert.pem",
    ] {
        assert!(
            text.contains(needle),
            "aqueduct-broker --help lacks {needle}:\n{text}"
        );
    }
    let out = Command::new(CLIENT).arg("--help").output().expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["pub", "sub", "--addr", "--ca", "--pin"] {
        assert!(
            text.contains(needle),
            "aqueduct --help lacks {needle}:\n{text}"
        );
    }
}

#[test]
fn configuration_errors_stop_startup_naming_the_key() {
    let dir = tempfile::tempdir().expect("dir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "broker:\n  flush_interval: 50xs\n").expect("write");
    let out = Command::new(BROKER)
        .arg("--config")
        .arg(&bad)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("broker.flush_interval") && err.contains("50xs"),
        "{err}"
    );

    let out = Command::new(BROKER)
        .args(["--config", "/nonexistent.yaml"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.yaml: not found"));

    let out = Command::new(BROKER)
        .env("AQUEDUCT_BROKER_BACKPRESSURE_POLICY", "drop_everything")
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("broker.backpressure_policy"));
}

/// Start the broker on a free port; returns it and its address, read from its log.
// The caller waits for the child (after SIGTERM).
#[allow(clippy::zombie_processes)]
fn start_broker(home: &std::path::Path) -> (Child, String, mpsc::Receiver<String>) {
    let mut child = Command::new(BROKER)
        .args([
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--log",
            "info",
        ])
        .env("AQUEDUCT_HOME", home)
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("broker starts");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    loop {
        let line = rx.recv_timeout(WAIT).expect("broker log line");
        if line.contains("broker listening") {
            let addr = line
                .split("addr=")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .expect("address in the log line")
                .to_string();
            return (child, addr, rx);
        }
    }
}

#[test]
fn pub_and_sub_against_a_real_broker_then_sigterm() {
    let home = tempfile::tempdir().expect("dir");
    let (mut broker, addr, logs) = start_broker(home.path());
    assert!(
        home.path().join("dev-cert.pem").is_file(),
        "the dev certificate was written"
    );

    let sub = Command::new(CLIENT)
        .args(["--addr", &addr, "sub", "orders/+", "--count", "2"])
        .env("AQUEDUCT_HOME", home.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sub starts");
    // Wait until the broker has the subscription (its log says so), then publish.
    loop {
        let line = logs.recv_timeout(WAIT).expect("broker log line");
        if line.contains("subscribed") {
            break;
        }
    }
    let out = Command::new(CLIENT)
        .args([
            "--addr",
            &addr,
            "pub",
            "orders/eu",
            "hello",
            "--priority",
            "0",
        ])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("pub runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(CLIENT)
        .args(["--addr", &addr, "pub", "orders/us", "world", "--confirm"])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("pub runs");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("published to orders/us at offset 0"));

    let out = sub.wait_with_output().expect("sub exits after 2 messages");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["orders/eu #0 p0: hello", "orders/us #0 p2: world"]
    );

    // A host that is not local is not trusted on the dev certificate.
    let out = Command::new(CLIENT)
        .args(["--addr", "192.0.2.1:4242", "pub", "t", "x"])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no way to verify the broker"));

    // Graceful shutdown on SIGTERM, exit status 0.
    let status = Command::new("kill")
        .args(["-TERM", &broker.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(broker.wait());
    });
    let exit = rx.recv_timeout(WAIT).expect("broker exits").expect("wait");
    assert!(exit.success(), "exit status {exit:?}");
}
