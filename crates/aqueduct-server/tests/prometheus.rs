//! The monitoring stack with the real parts that run here (no Docker): the exposition passes
//! `promtool check metrics`, and Debian's `prometheus`, started with the repository's
//! `deploy/prometheus/prometheus.yml` pointed at a broker on 127.0.0.1, scrapes it (`up` is 1)
//! and answers every query of the Grafana dashboard with data.
//!
//! Needs Debian's `prometheus` package (`promtool` and `prometheus`); `.ci/run` installs it. If
//! it is missing and this runs as root with apt, the test installs it; otherwise it fails saying
//! what to install.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use aqueduct_client::{PublishOptions, SubscribeOptions};
use common::*;

static TOOLS: Mutex<bool> = Mutex::new(false);

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `promtool` and `prometheus` on the PATH, installed with apt if need be (once per binary).
fn ensure_prometheus() {
    let mut done = TOOLS.lock().unwrap_or_else(|e| e.into_inner());
    if *done || (have("promtool") && have("prometheus")) {
        *done = true;
        return;
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if root && have("apt-get") {
        let _ = Command::new("apt-get").args(["update", "-qq"]).status();
        let _ = Command::new("apt-get")
            .args([
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "prometheus",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status();
    }
    assert!(
        have("promtool") && have("prometheus"),
        "this test needs Prometheus' promtool and prometheus: `apt-get install prometheus` \
         (Debian), as .ci/run does"
    );
    *done = true;
}

async fn metrics_text(addr: SocketAddr) -> String {
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    body
}

/// Traffic that makes every dashboard series exist: publishes and deliveries, a consumer
/// group with NACKs, redeliveries and dead letters, expired and dropped messages, a rejected
/// frame and ERROR frames. Returns what must stay connected (the group's offsets are exported
/// while it has members).
async fn traffic(b: &TestBroker) -> impl Sized {
    let c = b.client().await;
    let opts = SubscribeOptions {
        group: Some("g".into()),
        ack: true,
        ..SubscribeOptions::default()
    };
    let mut member = c.subscribe_with("orders", &opts).await.expect("group");
    let mut plain = c.subscribe("orders").await.expect("plain");
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    for i in 0..20 {
        c.publish_with("orders", format!("m{i}"), &confirm)
            .await
            .expect("publish");
        next(&mut plain).await;
    }
    // Ack the first half; NACK the rest until they are dead letters (max_retries 1).
    let mut settled = 0;
    while settled < 20 {
        let m = next(&mut member).await;
        if m.body().as_ref() < b"m10".as_ref() && m.body().len() == 2 {
            m.ack().await.expect("ack");
            settled += 1;
        } else if m.attempt() >= 2 {
            m.nack(Some("again")).await.expect("nack");
            settled += 1;
        } else {
            m.nack(Some("first")).await.expect("nack");
        }
    }
    // Expired: a message with a 1 ms TTL to a subscriber that holds it unread, then reads.
    let ttl = PublishOptions {
        ttl: Some(Duration::from_millis(1)),
        confirm: true,
        ..PublishOptions::default()
    };
    let _ = c.publish_with("orders", "short", &ttl).await;
    // A rejected frame and its ERROR: an unknown opcode on a raw stream.
    let raw = Raw::connect(b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x7e, 9, b"")).await;
    let reply = within("an ERROR", s.read_frame()).await.expect("frame");
    assert_eq!(
        error_code(&reply),
        aqueduct_proto::ErrorCode::UNKNOWN_OPCODE
    );
    (c, member, plain)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Percent-encode a query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn query(prom: SocketAddr, q: &str) -> serde_json::Value {
    let (status, body) = try_query(prom, q).await;
    assert_eq!(status, 200, "{q}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{q}: {e}: {body}"))
}

/// (status, body) of a query. Prometheus answers 503 until its storage is ready.
async fn try_query(prom: SocketAddr, q: &str) -> (u16, String) {
    // HTTP/1.0: Prometheus then closes the connection after a plain (not chunked) body.
    http(
        prom,
        &format!(
            "GET /api/v1/query?query={} HTTP/1.0\r\nHost: x\r\n\r\n",
            encode(q)
        ),
    )
    .await
}

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_exposition() {
    ensure_prometheus();
    let b = TestBroker::start().await;
    let _live = traffic(&b).await;
    let text = metrics_text(b.metrics_addr).await;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_broker_and_every_dashboard_query_has_data() {
    ensure_prometheus();
    // The durable log on, for the dashboard's log panels.
    let log_dir = tempfile::tempdir().expect("tempdir");
    let b = TestBroker::start_with(|c| {
        c.broker.max_retries = 1;
        c.aal = Some(aal(log_dir.path(), aqueduct_log::FsyncMode::Batch));
    })
    .await;
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let dir = tempfile::tempdir().expect("tempdir");
    // The repository's file, pointed at this broker and scraping every second.
    let config = std::fs::read_to_string(format!("{root}/deploy/prometheus/prometheus.yml"))
        .expect("prometheus.yml");
    assert!(config.contains("broker:9090"), "{config}");
    let config = config
        .replace("broker:9090", &b.metrics_addr.to_string())
        .replace("scrape_interval: 5s", "scrape_interval: 1s");
    let config_file = dir.path().join("prometheus.yml");
    std::fs::write(&config_file, config).expect("write");
    let prom: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let _prometheus = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus starts"),
    );
    let _live = traffic(&b).await;
    // `up` is 1 once it has scraped.
    within("Prometheus to scrape the broker", async {
        loop {
            if tokio::net::TcpStream::connect(prom).await.is_ok() {
                if let (200, body) = try_query(prom, "up").await {
                    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
                    if v["data"]["result"][0]["value"][1] == "1" {
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    // Every dashboard query returns data (rates need two scrapes, so wait for them).
    let queries = dashboard_queries();
    assert!(queries.len() >= 20);
    for q in &queries {
        within(&format!("data for {q}"), async {
            loop {
                let v = query(prom, q).await;
                if v["data"]["result"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await;
    }
    b.stop().await.expect("clean shutdown");
}
