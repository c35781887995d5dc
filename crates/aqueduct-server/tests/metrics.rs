//! The metrics and health endpoint end to end: every seed metric is exported and live, topic
//! cardinality is bounded, health and readiness answer, hostile HTTP clients are cut off, and the
//! deployment files (Grafana dashboard, Prometheus, docker-compose) parse and only query metrics
//! the broker exports.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use aqueduct_client::{OverflowPolicy, PublishOptions, SubscribeOptions};
use common::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Every metric family name the endpoint exports (from `# TYPE` lines).
fn families(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

/// The metric names docs/metrics.md lists in its tables (the first column of each row).
fn documented_metrics() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/metrics.md"
    ))
    .expect("docs/metrics.md");
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `aqueduct_"))
        .flat_map(|first| {
            let cell = first.split(" |").next().unwrap_or_default();
            format!("`aqueduct_{cell}")
                .split(", ")
                .map(|n| n.trim_matches('`').to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every metric docs/metrics.md documents is exported, by a broker with the durable log on
/// (the cluster's `aqueduct_mesh_*` and the trace exporter's `aqueduct_trace_*` only exist with
/// those on, as the doc says; tests/cluster.rs and tests/otel.rs read them). The log's
/// frames-committed counter was documented, and the mean CONFIRM wait computed with it, while
/// nothing exported it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_metric_is_exported() {
    let documented = documented_metrics();
    assert!(documented.len() >= 70, "the doc's tables: {documented:?}");
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), aqueduct_log::FsyncMode::Batch));
        c.broker.max_retries = 0;
    })
    .await;
    let client = b.client().await;
    let confirm = PublishOptions {
        confirm: true,
        ..Default::default()
    };
    for i in 0..3 {
        client
            .publish_with("docs/metrics", format!("m{i}"), &confirm)
            .await
            .expect("publish");
    }
    // A dead letter is written to the log too, but no publisher waits for it: it is not one of
    // the frames whose mean CONFIRM wait the counters give.
    let opts = SubscribeOptions {
        ack: true,
        ..Default::default()
    };
    let mut job = client.subscribe_with("docs/dlq", &opts).await.expect("sub");
    let mut dlq = client.subscribe("__dlq__docs/dlq").await.expect("sub dlq");
    client
        .publish_with("docs/dlq", "refused", &confirm)
        .await
        .expect("publish");
    next(&mut job).await.nack(Some("no")).await.expect("nack");
    next(&mut dlq).await;
    let m = within("the dead letter is in the log", async {
        loop {
            let (_, m) = get(b.metrics_addr, "/metrics").await;
            // The topic gauge is taken after each write: docs/metrics, docs/dlq and the dead
            // letter's __dlq__docs/dlq.
            if m.lines()
                .any(|l| l == "aqueduct_log_records_appended_total 5")
                && m.lines().any(|l| l == "aqueduct_log_topics 3")
            {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let exported = families(&m);
    let missing: Vec<&String> = documented
        .iter()
        .filter(|n| !n.starts_with("aqueduct_mesh_") && !n.starts_with("aqueduct_trace_"))
        .filter(|n| !exported.contains(*n))
        .collect();
    assert!(missing.is_empty(), "documented, not exported: {missing:?}");
    let value = |name: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} has no value"))
    };
    assert_eq!(value("aqueduct_log_frames_committed_total"), 4.0);
    assert!(value("aqueduct_log_commit_wait_seconds_total") > 0.0);
    close_and_stop(client, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_seed_metric_is_exported_and_live() {
    let b = TestBroker::start_with(|c| {
        c.broker.max_retries = 0;
        c.broker.queue_size = 2;
        c.broker.max_in_flight = 1;
        c.metrics.max_topic_labels = 6;
    })
    .await;
    let client = b.client().await;
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    // delivered + nacked + dead-lettered + (max_retries 0) no redelivery; a group for offsets.
    let mut group = client
        .subscribe_group("jobs", "workers")
        .await
        .expect("join");
    let mut dlq = client.subscribe("__dlq__jobs").await.expect("dlq");
    client
        .publish_with("jobs", "a", &confirm)
        .await
        .expect("publish");
    next(&mut group)
        .await
        .nack(Some("bad"))
        .await
        .expect("nack");
    next(&mut dlq).await;
    client
        .publish_with("jobs", "b", &confirm)
        .await
        .expect("publish");
    next(&mut group).await.ack().await.expect("ack");
    // Redelivery: a second group member and an ack timeout are not needed; NACK with retries.
    // Drops and expiry: an explicit-ack subscriber holding one message in flight (max_in_flight
    // 1) with a queue of 2 per priority.
    let opts = SubscribeOptions {
        ack: true,
        overflow: Some(OverflowPolicy::DropNewest),
        ..SubscribeOptions::default()
    };
    let mut slow = client
        .subscribe_with("slow", &opts)
        .await
        .expect("subscribe");
    client
        .publish_with("slow", "1", &confirm)
        .await
        .expect("publish");
    let held = next(&mut slow).await;
    let short = PublishOptions {
        ttl: Some(Duration::from_millis(1)),
        confirm: true,
        ..PublishOptions::default()
    };
    client
        .publish_with("slow", "expires", &short)
        .await
        .expect("publish");
    for i in 0..3 {
        client
            .publish_with("slow", format!("q{i}"), &confirm)
            .await
            .expect("publish");
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    held.ack().await.expect("ack");
    next(&mut slow).await;
    // A scrape now gives the three topics so far their labels for good; then ten more topics:
    // only 6 labels in total, the rest under __other__.
    assert_eq!(get(b.metrics_addr, "/metrics").await.0, 200);
    for i in 0..10 {
        client
            .publish_with(&format!("many/{i}"), "x", &confirm)
            .await
            .expect("publish");
    }
    // A rejected frame and an ERROR frame.
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&[0x1F, 0x3F, 1, 0, 0, 0, 0, 0, 0, 0]).await;
    s.read_frame().await.expect("ERROR");

    let addr = b.metrics_addr;
    let (status, m) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    for family in [
        "aqueduct_messages_published_total",
        "aqueduct_messages_delivered_total",
        "aqueduct_messages_expired_total",
        "aqueduct_messages_dropped_total",
        "aqueduct_messages_nacked_total",
        "aqueduct_messages_dead_lettered_total",
        "aqueduct_messages_redelivered_total",
        "aqueduct_active_subscribers",
        "aqueduct_consumer_offset",
        "aqueduct_slow_consumers_disconnected_total",
        "aqueduct_connections",
        "aqueduct_connections_total",
        "aqueduct_bytes_received_total",
        "aqueduct_bytes_sent_total",
        "aqueduct_frames_rejected_total",
        "aqueduct_error_frames_sent_total",
        "aqueduct_subscribers_by_queue_depth",
        "aqueduct_delivery_latency_seconds",
    ] {
        assert!(
            families(&m).contains(family),
            "{family} missing from /metrics"
        );
    }
    let v =
        |series: &str| value(&m, series).unwrap_or_else(|| panic!("no sample {series} in\n{m}"));
    assert_eq!(v("aqueduct_messages_published_total{topic=\"jobs\"}"), 2.0);
    assert!(v("aqueduct_messages_delivered_total{topic=\"jobs\"}") >= 2.0);
    assert_eq!(v("aqueduct_messages_nacked_total{topic=\"jobs\"}"), 1.0);
    assert_eq!(
        v("aqueduct_messages_dead_lettered_total{topic=\"jobs\"}"),
        1.0
    );
    assert_eq!(
        v("aqueduct_messages_published_total{topic=\"__dlq__jobs\"}"),
        1.0
    );
    assert_eq!(
        v("aqueduct_messages_expired_total{topic=\"slow\",priority=\"2\"}"),
        1.0
    );
    assert!(v("aqueduct_messages_dropped_total{topic=\"slow\",policy=\"drop_newest\"}") >= 1.0);
    assert_eq!(
        v("aqueduct_consumer_offset{consumer=\"workers\",topic=\"jobs\"}"),
        2.0
    );
    assert_eq!(v("aqueduct_active_subscribers"), 3.0);
    assert!(v("aqueduct_connections") >= 2.0);
    assert_eq!(
        v("aqueduct_frames_rejected_total{reason=\"unknown_opcode\"}"),
        1.0
    );
    assert_eq!(
        v("aqueduct_error_frames_sent_total{code=\"102\",name=\"UNKNOWN_OPCODE\"}"),
        1.0
    );
    assert!(v("aqueduct_delivery_latency_seconds_count") >= 4.0);
    assert!(v("aqueduct_bytes_received_total") > 0.0 && v("aqueduct_bytes_sent_total") > 0.0);
    // Cardinality: at most 6 topic labels plus __other__, which holds the rest.
    let topics: BTreeSet<&str> = m
        .lines()
        .filter(|l| l.starts_with("aqueduct_messages_published_total{"))
        .filter_map(|l| l.split('"').nth(1))
        .collect();
    assert_eq!(topics.len(), 7, "{topics:?}");
    assert!(topics.contains("__other__"));
    let published: f64 = m
        .lines()
        .filter(|l| l.starts_with("aqueduct_messages_published_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        published,
        2.0 + 1.0 + 5.0 + 10.0,
        "nothing is lost by folding into __other__"
    );
    drop(s);
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_hostile_http_clients() {
    let b = TestBroker::start_with(|c| {
        c.metrics.header_timeout = Duration::from_millis(300);
        c.metrics.max_connections = 2;
    })
    .await;
    let addr = b.metrics_addr;
    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(get(addr, "/readyz").await.0, 200);
    assert_eq!(get(addr, "/nope").await.0, 404);
    assert_eq!(http(addr, "POST /metrics HTTP/1.1\r\n\r\n").await.0, 405);
    // Two clients that never send a request hold both slots: a real request takes the place
    // of one of them (closed at once), the other is cut off by the header timeout.
    let idle1 = TcpStream::connect(addr).await.expect("connect");
    let idle2 = TcpStream::connect(addr).await.expect("connect");
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("aqueduct_active_subscribers"));
    for mut idle in [idle1, idle2] {
        let mut out = String::new();
        within(
            "the slow client to be answered",
            idle.read_to_string(&mut out),
        )
        .await
        .expect("read");
        assert!(
            out.is_empty() || out.starts_with("HTTP/1.1 408"),
            "closed without a response: {out}"
        );
    }
    // An oversized request head is refused.
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    assert_eq!(http(addr, &huge).await.0, 431);
    b.stop().await.expect("clean shutdown");
}

/// Clients that open connections to the metrics port and send nothing (anyone who reaches it
/// may) cannot keep a health probe waiting: a new connection takes the place of one that has
/// sent no request, from the address holding the most. Before, 16 such connections held every
/// slot until their 5 s header timeout, and a probe with the shipped charts' 2 s timeout failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_starve_the_health_probes() {
    let b = TestBroker::start().await;
    let addr = b.metrics_addr;
    let idle = idle_connections_from_elsewhere(addr, 100).await;
    for path in ["/healthz", "/readyz", "/healthz"] {
        // Well within the 5 s header timeout the idle ones were each waited for.
        let answer = tokio::time::timeout(Duration::from_secs(2), get(addr, path))
            .await
            .unwrap_or_else(|_| panic!("{path} waited behind idle connections"));
        assert_eq!(answer.0, 200, "{path}");
    }
    drop(idle);
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_only_queries_exported_metrics_and_deploy_files_parse() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let mut queried = BTreeSet::new();
    for expr in dashboard_queries() {
        let mut rest = expr.as_str();
        while let Some(i) = rest.find("aqueduct_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name)
                .to_string();
            queried.insert(family);
        }
    }
    assert!(
        queried.len() >= 15,
        "the dashboard covers the broker: {queried:?}"
    );
    // With the durable log on: the dashboard has its panels too.
    let log_dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(log_dir.path(), aqueduct_log::FsyncMode::Batch))
    })
    .await;
    let (_, m) = get(b.metrics_addr, "/metrics").await;
    let exported = families(&m);
    for family in &queried {
        assert!(
            exported.contains(family),
            "the dashboard queries {family}, which the broker does not export"
        );
    }
    b.stop().await.expect("clean shutdown");

    for file in [
        "docker-compose.yml",
        "deploy/prometheus/prometheus.yml",
        "deploy/grafana/provisioning/datasources/prometheus.yml",
        "deploy/grafana/provisioning/dashboards/aqueduct.yml",
    ] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).expect("deploy file");
        let _: serde_json::Value = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("{file} is not valid YAML: {e}"));
    }
    let compose: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(format!("{root}/docker-compose.yml")).expect("compose"),
    )
    .expect("yaml");
    for service in ["broker", "prometheus", "grafana"] {
        assert!(
            compose["services"][service].is_object(),
            "docker-compose.yml lacks {service}"
        );
    }
    assert!(compose["services"]["broker"]["ports"]
        .to_string()
        .contains("4242:4242/udp"));
    let prom: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(format!("{root}/deploy/prometheus/prometheus.yml")).expect("prom"),
    )
    .expect("yaml");
    assert_eq!(
        prom["scrape_configs"][0]["static_configs"][0]["targets"][0],
        "broker:9090"
    );
}

/// `aqueduct_consumer_offset` is bounded like the topic labels (group ids are the clients' to
/// choose: a client with many groups made one series per group and labelled topic, without
/// bound), and one group id on two filters is one series, not two with the same labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_offsets_are_bounded_and_never_duplicated() {
    let b = TestBroker::start_with(|c| c.metrics.max_topic_labels = 3).await;
    let c = b.client().await;
    let mut subs = Vec::new();
    for (filter, group) in [
        ("jobs", "dup"),
        ("#", "dup"),
        ("jobs", "g1"),
        ("jobs", "g2"),
        ("jobs", "g3"),
        ("jobs", "g4"),
    ] {
        let opts = SubscribeOptions {
            group: Some(group.into()),
            ..SubscribeOptions::default()
        };
        subs.push(c.subscribe_with(filter, &opts).await.expect("subscribed"));
    }
    c.publish_with(
        "jobs",
        "x",
        &PublishOptions {
            confirm: true,
            ..PublishOptions::default()
        },
    )
    .await
    .expect("published");
    for s in &mut subs {
        within("a delivery", s.next_message())
            .await
            .expect("open")
            .expect("message");
    }
    let lines = |m: &str| -> Vec<String> {
        m.lines()
            .filter(|l| l.starts_with("aqueduct_consumer_offset{"))
            .map(str::to_owned)
            .collect()
    };
    let mut series = Vec::new();
    within("the offsets to show", async {
        loop {
            series = lines(&get(b.metrics_addr, "/metrics").await.1);
            if series.len() >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        series.len(),
        3,
        "bounded by metrics.max_topic_labels: {series:?}"
    );
    let keys: BTreeSet<&str> = series
        .iter()
        .map(|l| l.rsplit_once(' ').map_or(l.as_str(), |(k, _)| k))
        .collect();
    assert_eq!(keys.len(), series.len(), "no duplicate series: {series:?}");
    close_and_stop(c, b).await;
}
