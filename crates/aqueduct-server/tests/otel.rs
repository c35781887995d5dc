//! OpenTelemetry export against an in-process OTLP/gRPC receiver: a traced publish produces
//! `publish`, `route` and `deliver` spans in the publisher's trace, linked parent to child, and
//! the delivered trace context names the broker's `publish` span.

mod common;

use aqueduct_client::{PublishOptions, SubscribeOptions, TraceContext};
use common::otlp::*;
use common::*;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

/// Publish `body` to `topic` in a new trace; its context.
async fn publish_traced(client: &aqueduct_client::Client, topic: &str, body: &str) -> TraceContext {
    let t = aqueduct_client::new_trace();
    client
        .publish_with(
            topic,
            body.to_string(),
            &PublishOptions {
                trace: Some(t),
                ..Default::default()
            },
        )
        .await
        .expect("publish");
    t
}

#[tokio::test]
async fn a_traced_publish_is_followed_through_routing_and_each_delivery() {
    let (received, endpoint, _receiver) = receiver().await;
    let b = TestBroker::start_with(|c| c.tracing = Some(tracing_to(&endpoint, 1.0))).await;
    let subscriber = b.client().await;
    let mut plain = subscriber.subscribe("orders/+").await.expect("subscribe");
    let worker = b.client().await;
    let mut member = worker
        .subscribe_with(
            "orders/#",
            &SubscribeOptions {
                group: Some("billing".into()),
                ..Default::default()
            },
        )
        .await
        .expect("join group");
    let publisher = b.client().await;
    let parent =
        TraceContext::from_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
            .expect("valid");
    let traced = PublishOptions {
        trace: Some(parent),
        confirm: true,
        ..Default::default()
    };
    let offset = publisher
        .publish_with("orders/eu", "traced", &traced)
        .await
        .expect("publish")
        .expect("confirmed");
    // Not recorded: no trace context, and a trace its publisher did not sample.
    publisher
        .publish("orders/eu", "untraced")
        .await
        .expect("publish");
    let unsampled = TraceContext {
        flags: 0,
        trace_id: [0x33; 16],
        ..parent
    };
    publisher
        .publish_with(
            "orders/eu",
            "unsampled",
            &PublishOptions {
                trace: Some(unsampled),
                ..Default::default()
            },
        )
        .await
        .expect("publish");

    // The subscribers get the trace id unchanged and the broker's publish span as parent.
    let got = next(&mut plain).await;
    assert_eq!(&got.body()[..], b"traced");
    let delivered = got.trace().expect("trace context delivered");
    assert_eq!(delivered.trace_id, parent.trace_id);
    assert_eq!(delivered.flags, parent.flags);
    assert_ne!(delivered.span_id, parent.span_id, "names the broker's span");
    let job = next(&mut member).await;
    assert_eq!(job.trace(), Some(delivered));
    job.ack().await.expect("ack");
    // The others arrive untouched.
    assert_eq!(next(&mut plain).await.trace(), None);
    assert_eq!(next(&mut plain).await.trace(), Some(unsampled));
    for want in [None, Some(unsampled)] {
        let m = next(&mut member).await;
        assert_eq!(m.trace(), want);
        m.ack().await.expect("ack");
    }

    until("publish, route and two deliver spans exported", || {
        received.of_trace(&parent.trace_id).len() >= 4
    })
    .await;
    let spans = received.of_trace(&parent.trace_id);
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let publish = named(&spans, "publish");
    let [publish] = publish[..] else {
        panic!("one publish span: {spans:#?}")
    };
    assert_eq!(
        publish.parent_span_id, parent.span_id,
        "child of the publisher's span"
    );
    assert_eq!(publish.span_id, delivered.span_id, "the delivered context");
    assert_eq!(publish.kind, SpanKind::Server as i32);
    assert_eq!(
        publish.flags & REMOTE_PARENT_FLAGS,
        REMOTE_PARENT_FLAGS,
        "the publisher's span is in another process"
    );
    assert_eq!(
        str_attr(publish, "messaging.destination.name").as_deref(),
        Some("orders/eu")
    );
    assert_eq!(int_attr(publish, "aqueduct.offset"), Some(offset as i64));
    assert_eq!(int_attr(publish, "aqueduct.priority"), Some(2));
    assert_eq!(int_attr(publish, "messaging.message.body.size"), Some(6));
    let route = named(&spans, "route");
    let [route] = route[..] else {
        panic!("one route span: {spans:#?}")
    };
    assert_eq!(route.parent_span_id, publish.span_id);
    assert_eq!(int_attr(route, "aqueduct.routed"), Some(2), "plain + group");
    let deliveries = named(&spans, "deliver");
    assert_eq!(deliveries.len(), 2, "one per subscription: {spans:#?}");
    for d in &deliveries {
        assert_eq!(d.parent_span_id, publish.span_id);
        assert_eq!(d.kind, SpanKind::Producer as i32);
        assert_eq!(
            d.flags & REMOTE_PARENT_FLAGS,
            HAS_IS_REMOTE,
            "the publish span is this broker's own"
        );
        assert_eq!(int_attr(d, "aqueduct.offset"), Some(offset as i64));
        assert!(d.end_time_unix_nano >= d.start_time_unix_nano);
    }
    let mut filters: Vec<_> = deliveries
        .iter()
        .map(|d| str_attr(d, "messaging.destination.subscription.name"))
        .collect();
    filters.sort();
    assert_eq!(
        filters,
        [Some("orders/#".to_string()), Some("orders/+".to_string())]
    );
    assert!(deliveries
        .iter()
        .any(|d| str_attr(d, "messaging.consumer.group.name").as_deref() == Some("billing")));
    // Distinct span ids, all under the publisher's span.
    let mut ids: Vec<_> = spans.iter().map(|s| s.span_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4);

    // A batch traced as one operation: one publish and one route span for its messages, which
    // all name that publish span; deliver spans cover what one writer sent at once.
    let batch_parent = aqueduct_client::new_trace();
    let offsets = publisher
        .publish_batch(
            [
                ("orders/us", bytes::Bytes::from_static(b"b1")),
                ("orders/us", bytes::Bytes::from_static(b"b2")),
            ],
            &PublishOptions {
                trace: Some(batch_parent),
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .expect("batch")
        .expect("confirmed");
    let first = next(&mut plain).await.trace().expect("traced");
    let second = next(&mut plain).await.trace().expect("traced");
    assert_eq!(first, second, "one publish span for the run");
    for _ in 0..2 {
        let m = next(&mut member).await;
        assert_eq!(m.trace(), Some(first));
        m.ack().await.expect("ack");
    }
    let covered = |spans: &[Span], filter: &str| -> i64 {
        named(spans, "deliver")
            .iter()
            .filter(|d| {
                str_attr(d, "messaging.destination.subscription.name").as_deref() == Some(filter)
            })
            .map(|d| int_attr(d, "messaging.batch.message_count").unwrap_or(1))
            .sum()
    };
    until("the batch's spans exported", || {
        let spans = received.of_trace(&batch_parent.trace_id);
        covered(&spans, "orders/+") == 2 && covered(&spans, "orders/#") == 2
    })
    .await;
    let spans = received.of_trace(&batch_parent.trace_id);
    let publish = named(&spans, "publish");
    let [publish] = publish[..] else {
        panic!("one publish span for the batch: {spans:#?}")
    };
    assert_eq!(publish.parent_span_id, batch_parent.span_id);
    assert_eq!(publish.span_id, first.span_id);
    assert_eq!(int_attr(publish, "messaging.batch.message_count"), Some(2));
    assert_eq!(
        int_attr(publish, "aqueduct.offset"),
        Some(offsets[0] as i64)
    );
    assert_eq!(
        int_attr(publish, "aqueduct.offset.last"),
        Some(offsets[1] as i64)
    );
    assert_eq!(named(&spans, "route").len(), 1);
    for s in spans.iter().filter(|s| s.name != "publish") {
        assert_eq!(s.parent_span_id, publish.span_id, "{s:#?}");
    }
    let batch_spans = spans.len();

    b.stop().await.expect("stops");
    // Nothing else was recorded: the untraced and unsampled messages made no spans.
    let all = received.spans();
    assert_eq!(all.len(), 4 + batch_spans, "{all:#?}");
    assert!(all.iter().all(|(service, _)| service == "aqueduct-test"));
}

#[tokio::test]
async fn an_unreachable_collector_is_counted_and_delivery_goes_on() {
    // A port nothing listens on: bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let b = TestBroker::start_with(|c| c.tracing = Some(tracing_to(&endpoint, 1.0))).await;
    let client = b.client().await;
    let mut sub = client.subscribe("t").await.expect("subscribe");
    publish_traced(&client, "t", "x").await;
    assert_eq!(&next(&mut sub).await.body()[..], b"x");
    let mut metrics = String::new();
    within("the lost spans counted", async {
        loop {
            metrics = get(b.metrics_addr, "/metrics").await.1;
            if value(&metrics, "aqueduct_trace_spans_dropped_total") == Some(3.0) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        value(&metrics, "aqueduct_trace_spans_recorded_total"),
        Some(3.0)
    );
    assert!(value(&metrics, "aqueduct_trace_export_failures_total") >= Some(1.0));
    assert_eq!(
        value(&metrics, "aqueduct_trace_spans_exported_total"),
        Some(0.0)
    );
    b.stop().await.expect("stops");
}

/// The broker's tracing settings for an `https://` collector, as a configuration file gives them.
fn tracing_tls(
    endpoint: &str,
    ca: &std::path::Path,
    client: Option<(&std::path::Path, &std::path::Path)>,
) -> aqueduct_server::otel::TracingConfig {
    let path = |p: &std::path::Path| p.display().to_string();
    aqueduct_server::otel::TracingSection {
        otlp_endpoint: endpoint.into(),
        otlp_ca_file: path(ca),
        otlp_cert_file: client.map(|(c, _)| path(c)).unwrap_or_default(),
        otlp_key_file: client.map(|(_, k)| path(k)).unwrap_or_default(),
        service_name: "aqueduct-test".into(),
        ..Default::default()
    }
    .validate()
    .expect("valid tracing settings")
    .expect("export on")
}

/// Publish a traced message through `b` and wait until it is delivered; its trace.
async fn one_traced_delivery(b: &TestBroker) -> TraceContext {
    let client = b.client().await;
    let mut sub = client.subscribe("t").await.expect("subscribe");
    let t = publish_traced(&client, "t", "x").await;
    next(&mut sub).await;
    t
}

/// The broker's span names of trace `t` at `received`, once all three have come.
async fn three_spans(received: &Received, t: &TraceContext) -> Vec<String> {
    within("the spans at the TLS collector", async {
        loop {
            let mut names: Vec<_> = received
                .of_trace(&t.trace_id)
                .into_iter()
                .map(|s| s.name)
                .collect();
            if names.len() == 3 {
                names.sort();
                break names;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
}

/// Wait until `b` has counted a failed export; nothing was exported and `received` got nothing.
async fn export_fails(b: &TestBroker, received: &Received) {
    let metrics = within("the failed export counted", async {
        loop {
            let metrics = get(b.metrics_addr, "/metrics").await.1;
            if value(&metrics, "aqueduct_trace_export_failures_total") >= Some(1.0) {
                break metrics;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        value(&metrics, "aqueduct_trace_spans_exported_total"),
        Some(0.0)
    );
    assert!(received.spans().is_empty(), "the collector got spans");
}

/// Spans reach a collector over TLS that checks the broker's client certificate (mTLS), by IP
/// address and by host name; the collector refuses a broker without a client certificate.
#[tokio::test]
async fn spans_reach_a_tls_collector_that_asks_for_a_client_certificate() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let client = ca.client(dir.path(), "broker");
    let identity = Some((client.0.as_path(), client.1.as_path()));
    for host in ["127.0.0.1", "localhost"] {
        // A certificate for that name only: a wrong name would not verify.
        let (cert, key) = ca.server(dir.path(), host, &[host]);
        let (received, endpoint, _receiver) = receiver_tls(&cert, &key, Some(&ca.pem)).await;
        let endpoint = endpoint.replace("127.0.0.1", host);
        let tracing = tracing_tls(&endpoint, &ca_file, identity);
        let b = TestBroker::start_with(|c| c.tracing = Some(tracing)).await;
        let t = one_traced_delivery(&b).await;
        assert_eq!(
            three_spans(&received, &t).await,
            ["deliver", "publish", "route"],
            "{host}"
        );
        b.stop().await.expect("stops");
    }
    let (cert, key) = ca.server(dir.path(), "strict", &["127.0.0.1"]);
    let (received, endpoint, _receiver) = receiver_tls(&cert, &key, Some(&ca.pem)).await;
    let b =
        TestBroker::start_with(|c| c.tracing = Some(tracing_tls(&endpoint, &ca_file, None))).await;
    one_traced_delivery(&b).await;
    export_fails(&b, &received).await;
    b.stop().await.expect("stops");
}

/// A collector that takes the TCP connection and never answers (a stuck proxy, a load balancer
/// with no healthy backend) fails each export within a bounded time, counted, and export works
/// again once the collector does. The exporter's own timeout does not cover its connecting:
/// the export hung for ever, uncounted, and never recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_fails_exports_and_they_recover() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let (cert, key) = ca.server(dir.path(), "collector", &["127.0.0.1"]);
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = silent.local_addr().expect("addr");
    // Takes connections and holds them, saying nothing.
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let endpoint = format!("https://{addr}");
    let b =
        TestBroker::start_with(|c| c.tracing = Some(tracing_tls(&endpoint, &ca_file, None))).await;
    one_traced_delivery(&b).await;
    let metrics = within("the hung export counted as failed", async {
        loop {
            let metrics = get(b.metrics_addr, "/metrics").await.1;
            if value(&metrics, "aqueduct_trace_export_failures_total") >= Some(1.0) {
                break metrics;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(
        value(&metrics, "aqueduct_trace_spans_dropped_total"),
        Some(3.0)
    );
    // The collector works now, on the same address.
    holding.abort();
    let _ = holding.await;
    let listener = tokio::net::TcpListener::bind(addr).await.expect("rebind");
    let (received, _, _receiver) = receiver_tls_on(listener, &cert, &key, None);
    let t = one_traced_delivery(&b).await;
    let names = within("spans after the collector recovered", async {
        loop {
            let names: Vec<_> = received
                .of_trace(&t.trace_id)
                .into_iter()
                .map(|s| s.name)
                .collect();
            if names.len() == 3 {
                break names;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(names.len(), 3);
    b.stop().await.expect("stops");
}

/// A collector whose certificate does not verify — from another CA, or from the trusted CA but
/// for another host — is not trusted: its batches are counted as failed exports, and it
/// receives nothing.
#[tokio::test]
async fn a_collector_whose_certificate_does_not_verify_gets_no_spans() {
    let dir = tempfile::tempdir().expect("dir");
    let (trusted, other) = (test_ca(), test_ca());
    let ca_file = trusted.write(dir.path());
    for (ca, name, hosts) in [
        (&other, "impostor", ["127.0.0.1"]),
        (&trusted, "elsewhere", ["collector.elsewhere.example"]),
    ] {
        let (cert, key) = ca.server(dir.path(), name, &hosts);
        let (received, endpoint, _receiver) = receiver_tls(&cert, &key, None).await;
        let b =
            TestBroker::start_with(|c| c.tracing = Some(tracing_tls(&endpoint, &ca_file, None)))
                .await;
        one_traced_delivery(&b).await;
        export_fails(&b, &received).await;
        b.stop().await.expect("stops");
    }
}

#[tokio::test]
async fn export_off_makes_no_trace_metrics_and_passes_contexts_unchanged() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("t").await.expect("subscribe");
    let t = publish_traced(&client, "t", "x").await;
    assert_eq!(next(&mut sub).await.trace(), Some(t), "passed unchanged");
    let metrics = get(b.metrics_addr, "/metrics").await.1;
    assert_eq!(value(&metrics, "aqueduct_trace_spans_recorded_total"), None);
    b.stop().await.expect("stops");
}

#[tokio::test]
async fn spans_still_queued_at_shutdown_are_exported() {
    let (received, endpoint, _receiver) = receiver().await;
    let b = TestBroker::start_with(|c| c.tracing = Some(tracing_to(&endpoint, 1.0))).await;
    let client = b.client().await;
    let mut sub = client.subscribe("t").await.expect("subscribe");
    let t = publish_traced(&client, "t", "last words").await;
    next(&mut sub).await;
    drop((sub, client));
    // At once: the exporter's next round (every 250 ms) has most likely not come yet.
    b.stop().await.expect("stops");
    let mut names: Vec<_> = received
        .of_trace(&t.trace_id)
        .into_iter()
        .map(|s| s.name)
        .collect();
    names.sort();
    assert_eq!(names, ["deliver", "publish", "route"]);
}
