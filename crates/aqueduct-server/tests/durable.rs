//! The durable log end to end, in process: confirmed publishes are in the log, live delivery
//! goes on, offsets continue across a restart, a new topic starts at 0.

mod common;
use aqueduct_client::{Priority, PublishOptions};
use aqueduct_log::FsyncMode;
use bytes::Bytes;
use common::*;

fn confirm() -> PublishOptions {
    PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_publishes_are_logged_and_offsets_go_on_after_a_restart() {
    for fsync in [FsyncMode::Batch, FsyncMode::Always, FsyncMode::Never] {
        let dir = tempfile::tempdir().expect("temp dir");
        let b = TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), fsync))).await;
        let client = b.client().await;
        // INFO says the log is on (protocol.md §4.1, DURABLE).
        assert_eq!(client.info().await.expect("info").durable, Some(true));
        let mut live = client.subscribe("orders").await.expect("subscribe");
        for i in 0..10u64 {
            let opts = PublishOptions {
                priority: Priority::new((i % 4) as u8),
                ..confirm()
            };
            let offset = client
                .publish_with("orders", format!("single {i}"), &opts)
                .await
                .expect("publish");
            assert_eq!(offset, Some(i));
        }
        let batch = (0..20).map(|i| ("orders", Bytes::from(format!("batched {i}"))));
        let offsets = client
            .publish_batch(batch, &confirm())
            .await
            .expect("batch");
        assert_eq!(offsets, Some((10..30).collect::<Vec<u64>>()));
        // Live delivery is not held back by the log.
        for i in 0..30u64 {
            assert_eq!(next(&mut live).await.offset(), i);
        }
        // Not confirmed, still logged.
        client
            .publish("orders", "unconfirmed")
            .await
            .expect("publish");
        assert_eq!(next(&mut live).await.offset(), 30);
        drop(live);
        close_and_stop(client, b).await;

        let got = logged(dir.path(), "orders");
        assert_eq!(got.len(), 31, "{fsync:?}");
        for (i, (offset, m)) in got.iter().enumerate() {
            assert_eq!(*offset, i as u64);
            let want = match i {
                0..10 => format!("single {i}"),
                10..30 => format!("batched {}", i - 10),
                _ => "unconfirmed".into(),
            };
            assert_eq!(m.body, want.as_bytes());
            if i < 10 {
                assert_eq!(m.priority.level(), (i % 4) as u8);
            }
        }

        let b = TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), fsync))).await;
        let client = b.client().await;
        let offset = client
            .publish_with("orders", "after restart", &confirm())
            .await
            .expect("publish");
        assert_eq!(offset, Some(31), "offsets go on after a restart");
        let fresh = client
            .publish_with("fresh", "first", &confirm())
            .await
            .expect("publish");
        assert_eq!(fresh, Some(0), "a topic the log never saw starts at 0");
        close_and_stop(client, b).await;
        assert_eq!(logged(dir.path(), "orders").len(), 32);
    }
}

/// A broker with the durable log in `dir` (batch fsync).
async fn durable_broker(dir: &std::path::Path) -> TestBroker {
    TestBroker::start_with(|c| c.aal = Some(aal(dir, FsyncMode::Batch))).await
}

fn durable_opts(
    consumer: &str,
    start: aqueduct_client::DurableStart,
) -> aqueduct_client::SubscribeOptions {
    aqueduct_client::SubscribeOptions {
        durable: Some((consumer.to_string(), start)),
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    }
}

/// Receive `n` messages, acknowledging each; their (offset, body).
async fn take_acked(sub: &mut aqueduct_client::Subscription, n: usize) -> Vec<(u64, String)> {
    let mut got = Vec::new();
    for _ in 0..n {
        let m = next(sub).await;
        got.push((m.offset(), String::from_utf8_lossy(m.body()).into_owned()));
        m.ack().await.expect("ack");
    }
    got
}

async fn publish_n(client: &aqueduct_client::Client, topic: &str, range: std::ops::Range<u64>) {
    for i in range {
        client
            .publish_with(topic, format!("m{i}"), &confirm())
            .await
            .expect("publish");
    }
}

fn expect(range: std::ops::Range<u64>) -> Vec<(u64, String)> {
    range.map(|i| (i, format!("m{i}"))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_consumer_backfills_then_goes_live_without_gap_or_duplicate() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "orders", 0..50).await;
    let mut sub = client
        .subscribe_with("orders", &durable_opts("c1", DurableStart::Earliest))
        .await
        .expect("durable subscribe");
    assert_eq!(
        sub.durable_log(),
        Some(true),
        "the CONFIRM says the log serves it"
    );
    // Published while the backfill runs, and after it.
    let publisher = b.client().await;
    let more = tokio::spawn(async move {
        publish_n(&publisher, "orders", 50..100).await;
        publisher
    });
    assert_eq!(take_acked(&mut sub, 100).await, expect(0..100));
    let publisher = more.await.expect("publisher");
    // One subscription per consumer at a time.
    let second = client
        .subscribe_with("orders", &durable_opts("c1", DurableStart::Earliest))
        .await;
    assert!(
        matches!(&second, Err(aqueduct_client::ClientError::Broker { code, .. }) if *code == aqueduct_client::ErrorCode::BAD_SUBSCRIBE),
        "{second:?}"
    );
    let why = second.expect_err("refused").to_string();
    assert!(
        why.contains("durable consumer c1 is already subscribed"),
        "the id as given: {why}"
    );
    // Another consumer from an offset; and one from latest sees only what comes next.
    let mut from_90 = client
        .subscribe_with("orders", &durable_opts("c2", DurableStart::Offset(90)))
        .await
        .expect("subscribe");
    assert_eq!(take_acked(&mut from_90, 10).await, expect(90..100));
    let mut latest = client
        .subscribe_with("orders", &durable_opts("c3", DurableStart::Latest))
        .await
        .expect("subscribe");
    publish_n(&publisher, "orders", 100..101).await;
    assert_eq!(take_acked(&mut latest, 1).await, expect(100..101));
    assert_eq!(take_acked(&mut sub, 1).await, expect(100..101));
    client
        .close()
        .await
        .expect("close: everything published was taken");
    close_and_stop(publisher, b).await;
}

/// Without the durable log a durable SUBSCRIBE becomes an in-memory consumer group, and its
/// CONFIRM says so: the client can tell its user that nothing is replayed or kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_log_a_durable_subscription_is_told_it_is_in_memory() {
    use aqueduct_client::DurableStart;
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("orders", &durable_opts("c1", DurableStart::Earliest))
        .await
        .expect("durable subscribe");
    assert_eq!(sub.durable_log(), Some(false), "in memory, and said so");
    let plain = client.subscribe("orders").await.expect("subscribe");
    assert_eq!(plain.durable_log(), None, "not a durable subscription");
    // It is the consumer group the spec describes: live messages still arrive.
    publish_n(&client, "orders", 0..3).await;
    assert_eq!(take_acked(&mut sub, 3).await, expect(0..3));
    close_and_stop(client, b).await;
}

/// Close the subscription (the broker has read the ACKs when it returns), then the client:
/// closing the connection at once could drop ACKs still on their way, and their messages would
/// be delivered again (at least once).
async fn leave(
    b: &TestBroker,
    sub: aqueduct_client::Subscription,
    client: &aqueduct_client::Client,
) {
    let before = b.broker.subscriber_count();
    sub.close().await.expect("close the subscription");
    assert_eq!(
        b.broker.subscriber_count(),
        before - 1,
        "ended by the time close returns"
    );
    client
        .close()
        .await
        .expect("close: everything published was taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_consumer_resumes_after_reconnect_and_restart_with_unacked_redelivered() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "jobs", 0..40).await;
    let mut sub = client
        .subscribe_with("jobs", &durable_opts("worker", DurableStart::Earliest))
        .await
        .expect("subscribe");
    assert_eq!(take_acked(&mut sub, 10).await, expect(0..10));
    // Received but not acknowledged: must come again.
    let unacked = next(&mut sub).await;
    assert_eq!(unacked.offset(), 10);
    leave(&b, sub, &client).await;

    // Reconnect: the stored position wins over the start asked for.
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("jobs", &durable_opts("worker", DurableStart::Latest))
        .await
        .expect("resubscribe");
    // Delivered again as a first delivery: attempts are not stored with the position
    // (protocol.md §7.1).
    let again = next(&mut sub).await;
    assert_eq!((again.offset(), again.attempt()), (10, 1));
    again.ack().await.expect("ack");
    assert_eq!(take_acked(&mut sub, 9).await, expect(11..20));
    leave(&b, sub, &client).await;
    b.stop().await.expect("clean shutdown");

    // Restart the broker: the position was saved.
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("jobs", &durable_opts("worker", DurableStart::Offset(0)))
        .await
        .expect("subscribe after restart");
    assert_eq!(take_acked(&mut sub, 20).await, expect(20..40));
    publish_n(&client, "jobs", 40..45).await;
    assert_eq!(take_acked(&mut sub, 5).await, expect(40..45));
    close_and_stop(client, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_durable_consumer_picks_up_new_topics_from_their_first_message() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "sensors/a", 0..3).await;
    publish_n(&client, "other", 0..3).await;
    let mut sub = client
        .subscribe_with("sensors/+", &durable_opts("w", DurableStart::Latest))
        .await
        .expect("subscribe");
    // Latest: nothing of sensors/a so far; a topic that appears later: all of it.
    publish_n(&client, "sensors/b", 0..2).await;
    publish_n(&client, "sensors/a", 3..4).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let m = next(&mut sub).await;
        got.push((m.topic().as_str().to_string(), m.offset()));
        m.ack().await.expect("ack");
    }
    got.sort();
    assert_eq!(
        got,
        vec![
            ("sensors/a".to_string(), 3),
            ("sensors/b".to_string(), 0),
            ("sensors/b".to_string(), 1)
        ]
    );
    close_and_stop(client, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_logged_and_replayed_with_their_origin() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), FsyncMode::Batch));
        c.broker.max_retries = 1;
    })
    .await;
    let client = b.client().await;
    let opts = aqueduct_client::SubscribeOptions {
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    };
    let mut worker = client
        .subscribe_with("jobs", &opts)
        .await
        .expect("subscribe");
    client
        .publish_with("jobs", "poison", &confirm())
        .await
        .expect("publish");
    // First attempt and one retry, both rejected: then a dead letter.
    for _ in 0..2 {
        let m = next(&mut worker).await;
        m.nack(Some("cannot parse")).await.expect("nack");
    }
    let mut dlq = client
        .subscribe_with(
            "__dlq__jobs",
            &durable_opts("dlq-reader", DurableStart::Earliest),
        )
        .await
        .expect("durable subscribe to the dead letters");
    let m = next(&mut dlq).await;
    assert_eq!(
        (m.topic().as_str(), m.offset(), m.body().as_ref()),
        ("__dlq__jobs", 0, &b"poison"[..])
    );
    let ext = m.extensions();
    assert_eq!(
        ext.original_topic.as_ref().map(|t| t.as_str()),
        Some("jobs")
    );
    assert_eq!(ext.original_offset, Some(0));
    assert_eq!(ext.reason.as_deref(), Some("cannot parse"));
    m.ack().await.expect("ack");
    leave(&b, dlq, &client).await;
    drop(worker);
    b.stop().await.expect("clean shutdown");
    let logged = logged(dir.path(), "__dlq__jobs");
    assert_eq!(logged.len(), 1);
    let dl = logged[0]
        .1
        .dead_letter
        .clone()
        .expect("stored as a dead letter");
    assert_eq!(
        (dl.original_topic.as_str(), dl.original_offset),
        ("jobs", 0)
    );
}

/// An empty PUBLISH_BATCH asking for CONFIRM gets its (empty) CONFIRM, in order with the
/// answers to the frames around it, with the log on as without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_confirmed_batch_is_answered_in_order() {
    use aqueduct_proto::frame::Message as Wire;
    use aqueduct_proto::{Frame, Publish, PublishBatch, TopicName};
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    let mut empty = PublishBatch::from_publishes(&[]);
    empty.ext.confirm = true;
    let one = Publish::new(
        TopicName::try_from("t").expect("topic"),
        Bytes::from_static(b"x"),
    )
    .with_confirm();
    s.write_frame(&Frame::new(1, Wire::Publish(one.clone())))
        .await;
    s.write_frame(&Frame::new(2, Wire::PublishBatch(empty)))
        .await;
    s.write_frame(&Frame::new(3, Wire::Publish(one))).await;
    let mut answers = Vec::new();
    for _ in 0..3 {
        let f = s.read_frame().await.expect("an answer");
        match f.message {
            Wire::Confirm(c) => answers.push((f.stream_id, c.offsets)),
            other => panic!("expected CONFIRM, got {other:?}"),
        }
    }
    assert_eq!(answers, vec![(1, vec![0]), (2, vec![]), (3, vec![1])]);
    raw.forget();
    b.stop().await.expect("clean shutdown");
}

/// A consumer that comes back reads topics it has no position for (they appeared while it was
/// away) from their first message, whatever start it asks for; and only topics its filter
/// matches now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_consumer_reads_new_topics_from_the_start_and_only_what_it_matches() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "a/1", 0..2).await;
    let mut sub = client
        .subscribe_with("a/+", &durable_opts("r", DurableStart::Earliest))
        .await
        .expect("subscribe");
    assert_eq!(take_acked(&mut sub, 2).await, expect(0..2));
    leave(&b, sub, &client).await;
    // While it is away: a new topic it matches, one it does not.
    let client = b.client().await;
    publish_n(&client, "a/2", 0..3).await;
    publish_n(&client, "b/1", 0..3).await;
    let mut sub = client
        .subscribe_with("a/+", &durable_opts("r", DurableStart::Latest))
        .await
        .expect("resubscribe");
    let mut got = Vec::new();
    for _ in 0..3 {
        let m = next(&mut sub).await;
        got.push((m.topic().as_str().to_string(), m.offset()));
        m.ack().await.expect("ack");
    }
    assert_eq!(
        got,
        vec![("a/2".into(), 0), ("a/2".into(), 1), ("a/2".into(), 2)],
        "a topic created while it was away: all of it"
    );
    leave(&b, sub, &client).await;
    // The same consumer with another filter: the old topics' positions stay, unread.
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("b/+", &durable_opts("r", DurableStart::Latest))
        .await
        .expect("resubscribe with another filter");
    publish_n(&client, "a/1", 2..3).await;
    publish_n(&client, "b/1", 3..4).await;
    let m = next(&mut sub).await;
    assert_eq!(
        (m.topic().as_str(), m.offset()),
        ("b/1", 0),
        "b/1 from its first message"
    );
    let mut seen = vec![m.topic().as_str().to_string()];
    m.ack().await.expect("ack");
    for _ in 0..3 {
        let m = next(&mut sub).await;
        seen.push(m.topic().as_str().to_string());
        m.ack().await.expect("ack");
    }
    assert!(seen.iter().all(|t| t == "b/1"), "nothing of a/+: {seen:?}");
    leave(&b, sub, &client).await;
    b.stop().await.expect("clean shutdown");
}
fn group_opts(
    group: &str,
    start: aqueduct_client::DurableStart,
) -> aqueduct_client::SubscribeOptions {
    aqueduct_client::SubscribeOptions {
        group: Some(group.to_string()),
        durable: Some((group.to_string(), start)),
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    }
}

/// A durable group (fed by the log, not by routing) has its committed offset on the metrics
/// endpoint too, its position as last saved: `aqueduct_consumer_offset` listed only the groups
/// routing feeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_group_s_offset_is_on_the_metrics_endpoint() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("tempdir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("orders", &group_opts("billing", DurableStart::Earliest))
        .await
        .expect("subscribed");
    for i in 0..3 {
        client
            .publish_with("orders", format!("o{i}"), &confirm())
            .await
            .expect("published");
    }
    for _ in 0..3 {
        let m = within("a message", sub.next_message())
            .await
            .expect("open")
            .expect("message");
        m.ack().await.expect("ack");
    }
    let series = "aqueduct_consumer_offset{consumer=\"billing\",topic=\"orders\"}";
    within("the durable group's offset", async {
        while value(&get(b.metrics_addr, "/metrics").await.1, series) != Some(3.0) {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    leave(&b, sub, &client).await;
    b.stop().await.expect("clean shutdown");
}

/// A durable group has one position: its members share the log (each message to one of them at
/// a time), a member that leaves hands its unacknowledged messages to the others, and after
/// every member left and the broker restarted, the group resumes from that position with what
/// was unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_group_shares_the_log_and_resumes_after_failover_and_restart() {
    use aqueduct_client::DurableStart;
    use std::collections::BTreeSet;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let c1 = b.client().await;
    let c2 = b.client().await;
    let mut w1 = c1
        .subscribe_with("orders", &group_opts("billing", DurableStart::Earliest))
        .await
        .expect("worker 1");
    let mut w2 = c2
        .subscribe_with("orders", &group_opts("billing", DurableStart::Earliest))
        .await
        .expect("worker 2");
    publish_n(&client, "orders", 0..20).await;
    // Worker 1 acknowledges what it gets; worker 2 holds what it gets, unacknowledged.
    let mut seen: Vec<u64> = Vec::new();
    let mut held = Vec::new();
    while seen.len() < 20 {
        tokio::select! {
            m = next(&mut w1) => { seen.push(m.offset()); m.ack().await.expect("ack"); }
            m = next(&mut w2) => { seen.push(m.offset()); held.push(m.offset()); }
        }
    }
    let distinct: BTreeSet<u64> = seen.iter().copied().collect();
    assert_eq!(
        distinct,
        (0..20).collect(),
        "each message once, to one member"
    );
    assert!(!held.is_empty(), "both members got messages: {held:?}");
    // Worker 2 leaves without acknowledging: worker 1 gets its messages.
    leave(&b, w2, &c2).await;
    let mut again = Vec::new();
    for _ in 0..held.len() {
        let m = next(&mut w1).await;
        again.push(m.offset());
        m.ack().await.expect("ack");
    }
    again.sort();
    held.sort();
    assert_eq!(
        again, held,
        "the leaving member's messages went to the other"
    );
    // Worker 1 takes two more and does not acknowledge them; then everyone leaves.
    publish_n(&client, "orders", 20..25).await;
    let mut unacked = Vec::new();
    for i in 0..5 {
        let m = next(&mut w1).await;
        if i < 3 {
            m.ack().await.expect("ack");
        } else {
            unacked.push(m.offset());
        }
    }
    leave(&b, w1, &c1).await;
    close_and_stop(client, b).await;

    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "orders", 25..27).await;
    let mut w3 = client
        .subscribe_with("orders", &group_opts("billing", DurableStart::Latest))
        .await
        .expect("a new worker after the restart");
    let mut got = Vec::new();
    for _ in 0..unacked.len() + 2 {
        let m = next(&mut w3).await;
        got.push(m.offset());
        m.ack().await.expect("ack");
    }
    got.sort();
    let mut want = unacked.clone();
    want.extend([25, 26]);
    want.sort();
    assert_eq!(
        got, want,
        "resumed from the group's position, unacknowledged ones again"
    );
    leave(&b, w3, &client).await;
    b.stop().await.expect("clean shutdown");
}

/// Every member of a durable group goes away at once (their connections close, no UNSUBSCRIBE)
/// with messages unacknowledged: nothing is lost — after a restart the next member gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_group_whose_members_all_vanish_at_once_loses_nothing() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let publisher = b.client().await;
    let c1 = b.client().await;
    let c2 = b.client().await;
    let mut w1 = c1
        .subscribe_with("jobs", &group_opts("crew", DurableStart::Earliest))
        .await
        .expect("worker 1");
    let mut w2 = c2
        .subscribe_with("jobs", &group_opts("crew", DurableStart::Earliest))
        .await
        .expect("worker 2");
    publish_n(&publisher, "jobs", 0..10).await;
    // Each takes what it gets, acknowledging nothing, until all ten are out.
    let mut out = 0;
    while out < 10 {
        tokio::select! {
            _ = next(&mut w1) => out += 1,
            _ = next(&mut w2) => out += 1,
        }
    }
    // Both connections close at once, without UNSUBSCRIBE.
    drop((w1, w2));
    let (a, b2) = tokio::join!(c1.close(), c2.close());
    a.expect("close: everything published was taken");
    b2.expect("close: everything published was taken");
    until("both members are gone", || b.broker.subscriber_count() == 0).await;
    close_and_stop(publisher, b).await;

    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let mut w3 = client
        .subscribe_with("jobs", &group_opts("crew", DurableStart::Latest))
        .await
        .expect("a member after the restart");
    let mut got = Vec::new();
    for _ in 0..10 {
        let m = next(&mut w3).await;
        got.push(m.offset());
        m.ack().await.expect("ack");
    }
    got.sort();
    assert_eq!(
        got,
        (0..10).collect::<Vec<u64>>(),
        "every unacknowledged message"
    );
    leave(&b, w3, &client).await;
    b.stop().await.expect("clean shutdown");
}

/// A member that stops taking messages (at its prefetch limit, nothing acknowledged) does not
/// stall its durable group: the feeder goes on with the members that have room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_member_does_not_stall_its_durable_group() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let publisher = b.client().await;
    let c1 = b.client().await;
    let c2 = b.client().await;
    let stuck_opts = aqueduct_client::SubscribeOptions {
        max_in_flight: Some(3),
        ..group_opts("pool", DurableStart::Earliest)
    };
    let _stuck = c1
        .subscribe_with("work", &stuck_opts)
        .await
        .expect("a member that never reads");
    let mut busy = c2
        .subscribe_with("work", &group_opts("pool", DurableStart::Earliest))
        .await
        .expect("a member that works");
    publish_n(&publisher, "work", 0..50).await;
    let mut got = std::collections::BTreeSet::new();
    for _ in 0..47 {
        let m = next(&mut busy).await;
        assert!(got.insert(m.offset()), "offset {} twice", m.offset());
        m.ack().await.expect("ack");
    }
    assert_eq!(got.len(), 47, "all but the stuck member's three");
    close_and_stop(publisher, b).await;
}

/// A stream-fatal ERROR (FRAME_TOO_LARGE) on a publish stream does not cost the frames before
/// it their answers: with the durable log, the ERROR waits behind the CONFIRM the log owes the
/// earlier frame (answers come in request order), and both reach their publishers. (Before an
/// earlier fix the ERROR came first and the client, which stopped reading at it, failed the
/// earlier publish although the broker had stored it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirm_that_comes_after_a_stream_fatal_error_still_reaches_its_publisher() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), FsyncMode::Batch));
        c.transport.max_frame_data = 1024;
    })
    .await;
    let client = b.client().await;
    b.control.hold_log_writes(true);
    let first = tokio::spawn({
        let client = client.clone();
        async move { client.publish_with("held/a", "stored", &confirm()).await }
    });
    let topic = aqueduct_proto::TopicName::try_from("held/a").expect("valid");
    until("the first publish is read and handed to the log", || {
        b.broker
            .topic(&topic)
            .is_some_and(|t| t.stats().snapshot().published == 1)
    })
    .await;
    let second = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .publish_with("held/b", vec![b'z'; 2000], &confirm())
                .await
        }
    });
    let too_large = aqueduct_client::ErrorCode::FRAME_TOO_LARGE.0;
    until("the oversized frame refused", || {
        b.stats
            .errors_sent()
            .get(&too_large)
            .is_some_and(|n| *n >= 1)
    })
    .await;
    b.control.hold_log_writes(false);
    let offset = within("the held CONFIRM", first)
        .await
        .expect("task")
        .expect("the first publish was stored and confirmed");
    assert_eq!(offset, Some(0));
    let err = within("the ERROR", second)
        .await
        .expect("task")
        .expect_err("too large");
    assert_eq!(
        err.code(),
        Some(aqueduct_client::ErrorCode::FRAME_TOO_LARGE),
        "{err}"
    );
    // The publisher goes on, on a new stream, and flush reports that the old one stopped
    // being read (the broker read nothing after the oversized frame).
    let next = client
        .publish_with("held/a", "after", &confirm())
        .await
        .expect("a new stream");
    assert_eq!(next, Some(1));
    let lost = client
        .flush()
        .await
        .expect_err("the old stream was cut short");
    assert!(lost.to_string().contains("FRAME_TOO_LARGE"), "{lost}");
    client.flush().await.expect("reported once");
    b.stop().await.expect("clean shutdown");
}

/// A start that fails after the log was opened (here: a damaged admin state file) closes the
/// log again: the next start, in the same process, opens it (the first one's writer no longer
/// holds it) and finds a clean close, so offsets go on without a crash's gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_closes_the_log_it_opened() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    assert_eq!(
        client
            .publish_with("t", "first", &confirm())
            .await
            .expect("stored"),
        Some(0)
    );
    close_and_stop(client, b).await;

    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let state_file = dir.path().join("admin-state.json");
    std::fs::write(&state_file, "not json").expect("write");
    let mut config = aqueduct_server::Config::for_tests(dir.path().join("dev-cert.pem"));
    config.aal = Some(aal(dir.path(), FsyncMode::Batch));
    config.tls.client_ca_file = Some(ca_file.clone());
    config.admin = Some(aqueduct_server::config::AdminConfig {
        listen_addr: "127.0.0.1:0".parse().expect("addr"),
        allowed_cn: "admin-*".parse().expect("pattern"),
        client_ca_file: ca_file,
        state_file,
    });
    let err = match aqueduct_server::Server::bind(config).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a damaged state file must stop the start"),
    };
    assert!(err.contains("admin-state.json"), "{err}");

    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    assert_eq!(
        client
            .publish_with("t", "second", &confirm())
            .await
            .expect("stored"),
        Some(1),
        "closed cleanly: no crash gap"
    );
    close_and_stop(client, b).await;
}

/// The log's segment files under `dir`, oldest first.
fn segment_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .expect("log dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    found.sort();
    found
}

/// A read of the log that fails (here a segment that cannot be read for a while: a directory
/// stands where it was) does not make a durable consumer skip what that segment holds: the read
/// is counted and tried again from the same position, and once the segment is back every
/// message arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_read_of_the_log_is_tried_again_not_skipped() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        let mut a = aal(dir.path(), FsyncMode::Batch);
        a.max_segment_bytes = 2048;
        c.aal = Some(a);
    })
    .await;
    let client = b.client().await;
    publish_n(&client, "orders", 0..60).await;
    let segments = segment_files(dir.path());
    assert!(segments.len() >= 3, "{segments:?}");
    let first = segments[0].clone();
    let aside = first.with_extension("seg.aside");
    std::fs::rename(&first, &aside).expect("move the segment aside");
    std::fs::create_dir(&first).expect("a directory in its place");
    let mut sub = client
        .subscribe_with("orders", &durable_opts("c1", DurableStart::Earliest))
        .await
        .expect("durable subscribe");
    within("a failed read counted", async {
        loop {
            let (_, m) = get(b.metrics_addr, "/metrics").await;
            if value(&m, "aqueduct_log_read_errors_total").is_some_and(|n| n >= 1.0) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    std::fs::remove_dir(&first).expect("remove the directory");
    std::fs::rename(&aside, &first).expect("the segment back");
    assert_eq!(take_acked(&mut sub, 60).await, expect(0..60));
    close_and_stop(client, b).await;
}

/// A damaged batch at the end of a topic (nothing readable after it yet) is skipped, counted
/// and warned about, and then read again only a second later: before, every write of the log to
/// any topic made the consumer read it (and warn) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_at_the_end_of_a_topic_is_not_read_again_at_every_write() {
    use aqueduct_client::DurableStart;
    use std::io::{Read, Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    publish_n(&client, "orders", 0..10).await;
    // The last byte of the segment: inside the last batch (message 9's, written alone).
    let segment = segment_files(dir.path()).pop().expect("a segment");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&segment)
        .expect("open the segment");
    let end = f.seek(SeekFrom::End(-1)).expect("seek");
    let mut byte = [0u8];
    f.read_exact(&mut byte).expect("read");
    f.seek(SeekFrom::Start(end)).expect("seek");
    f.write_all(&[byte[0] ^ 0xFF]).expect("flip a byte");
    drop(f);
    let mut sub = client
        .subscribe_with("orders", &durable_opts("c1", DurableStart::Earliest))
        .await
        .expect("durable subscribe");
    assert_eq!(take_acked(&mut sub, 9).await, expect(0..9));
    let skips = || async {
        let (_, m) = get(b.metrics_addr, "/metrics").await;
        value(&m, "aqueduct_log_read_skips_total").unwrap_or(0.0)
    };
    within("the damage counted", async {
        while skips().await < 1.0 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    // 200 writes of the log to another topic, each waking the consumer.
    let started = std::time::Instant::now();
    publish_n(&client, "other", 0..200).await;
    let skipped = skips().await;
    // One more read per second passed, at most (plus the first).
    let allowed = 2.0 + started.elapsed().as_secs_f64().ceil();
    assert!(
        skipped <= allowed,
        "{skipped} reads of the damage in {:?}",
        started.elapsed()
    );
    close_and_stop(client, b).await;
}

/// A durable consumer whose client stops reading (STOP_SENDING) with a message in flight: the
/// message's ack timeout comes while it is detached (nothing can be written to it), and when its
/// stream ends the stored position must still be at that message, so the consumer gets it
/// again when it resubscribes (protocol.md 7.1: the position is the lowest unsettled offset).
/// Before, the position went back only to what was queued, and the message was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_consumer_that_stops_reading_keeps_its_unsettled_message() {
    use aqueduct_client::DurableStart;
    use aqueduct_core::DropReason;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), FsyncMode::Batch));
        c.broker.ack_wait = std::time::Duration::from_millis(200);
    })
    .await;
    let client = b.client().await;
    publish_n(&client, "jobs", 0..1).await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut delivery = raw.stream().await;
    // ACK_MODE explicit, durable consumer c from offset 0.
    delivery
        .write(&raw_frame(
            0x42,
            1,
            b"\x03\x00\x09\x01\x01topic:jobs:durable:c:0",
        ))
        .await;
    let got = delivery.read_frame().await.expect("the delivery");
    let aqueduct_proto::frame::Message::Publish(p) = got.message else {
        panic!("not a delivery: {got:?}")
    };
    assert_eq!(p.ext.offset, Some(0));
    delivery.stop_reading();
    until("the writer to see STOP_SENDING", || {
        b.stats
            .streams_stopped
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1
    })
    .await;
    let jobs = b
        .broker
        .topic(&"jobs".try_into().expect("topic"))
        .expect("known");
    until(
        "the ack timeout's redelivery to be dropped (detached)",
        || jobs.stats().snapshot().dropped(DropReason::Unsubscribed) >= 1,
    )
    .await;
    delivery.finish();
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    let mut sub = client
        .subscribe_with("jobs", &durable_opts("c", DurableStart::Latest))
        .await
        .expect("resubscribe");
    assert_eq!(take_acked(&mut sub, 1).await, expect(0..1));
    close_and_stop(client, b).await;
}

/// A new durable consumer subscribing at `latest` starts past every message published before
/// its SUBSCRIBE, also in a topic whose first messages the log has not written yet (they are
/// the broker's already); what is published after the SUBSCRIBE reaches it. Before, its
/// positions were taken at its feeder's first look at the log, after the CONFIRM, and a topic
/// not in the log yet was taken for one that appeared later and read from its first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latest_consumer_starts_at_its_subscribe() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    b.control.hold_log_writes(true);
    // Not confirmed: the log holds it, unwritten; the broker has given it offset 0.
    let held = b.client().await;
    held.publish("fresh", "before").await.expect("publish");
    until("the broker to take it", || {
        b.broker
            .topic(&"fresh".try_into().expect("topic"))
            .is_some_and(|t| t.next_offset() == 1)
    })
    .await;
    let mut sub = client
        .subscribe_with("#", &durable_opts("d", DurableStart::Latest))
        .await
        .expect("subscribe");
    b.control.hold_log_writes(false);
    publish_n(&client, "fresh", 1..2).await;
    assert_eq!(take_acked(&mut sub, 1).await, expect(1..2));
    for c in [held, client] {
        c.close()
            .await
            .expect("close: everything published was taken");
    }
    b.stop().await.expect("clean shutdown");
}

/// A `latest` consumer whose filter matched no topic yet has still started: back after a
/// topic appeared, it reads that topic from its first message (protocol.md 7.1). Its empty
/// position was not kept, so it came back as a new consumer, at latest, and skipped what was
/// published while it was away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latest_consumer_back_reads_the_topics_that_appeared_while_it_was_away() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let sub = client
        .subscribe_with("lat/#", &durable_opts("away", DurableStart::Latest))
        .await
        .expect("subscribe");
    leave(&b, sub, &client).await;
    let publisher = b.client().await;
    publish_n(&publisher, "lat/a", 0..2).await;
    let opts = durable_opts("away", DurableStart::Latest);
    receive_the_first_then_stop(b, publisher, "lat/#", &opts, 2).await;
}

/// Subscribe to `filter` with `opts` on a new client, expect messages `m0..m{n}` at offsets
/// `0..n` (acknowledged), leave; close `publisher` and stop the broker.
async fn receive_the_first_then_stop(
    b: TestBroker,
    publisher: aqueduct_client::Client,
    filter: &str,
    opts: &aqueduct_client::SubscribeOptions,
    n: u64,
) {
    let client = b.client().await;
    let mut sub = client
        .subscribe_with(filter, opts)
        .await
        .expect("subscribe");
    assert_eq!(take_acked(&mut sub, n as usize).await, expect(0..n));
    leave(&b, sub, &client).await;
    close_and_stop(publisher, b).await;
}

/// The next frame on `s` is an ERROR `BAD_SUBSCRIBE`.
async fn expect_bad_subscribe(s: &mut RawStream) {
    let refused = within("the refusal", s.read_frame())
        .await
        .expect("a frame");
    assert_eq!(
        error_code(&refused),
        aqueduct_client::ErrorCode::BAD_SUBSCRIBE
    );
}

/// A refused SUBSCRIBE changes nothing (protocol.md 7.1), also when it would have been the
/// first member of a new durable group: the group's `latest` positions, taken when the
/// SUBSCRIBE was handled, were stored as it was taken back, and the group's real first
/// SUBSCRIBE then "resumed" from them, skipping what it asked for (`earliest`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_first_member_leaves_no_position_for_its_group() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let publisher = b.client().await;
    publish_n(&publisher, "g/a", 0..1).await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:other")).await;
    s.write(&raw_frame(
        0x42,
        1,
        b"\x00\x00topic:g/#:group:wg:durable:wg:latest",
    ))
    .await;
    expect_bad_subscribe(&mut s).await;
    let opts = group_opts("wg", DurableStart::Earliest);
    receive_the_first_then_stop(b, publisher, "g/#", &opts, 1).await;
}

/// A durable SUBSCRIBE refused for its stream id (in use) or for the connection's limit is
/// refused before the broker works out where a new `latest` consumer starts, which walks every
/// topic: a client repeating such SUBSCRIBEs with fresh consumer ids made the broker walk every
/// topic for each of them. (`aal.max_consumers` is checked before the walk too:
/// `Consumers::claims_new`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_subscribe_refused_for_its_stream_id_walks_no_topic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let walks = || {
        b.stats
            .durable_latest_walks
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:taken")).await;
    for n in 0..5 {
        let spec = format!("\x00\x00topic:t/#:durable:c{n}:latest");
        s.write(&raw_frame(0x42, 1, spec.as_bytes())).await;
        expect_bad_subscribe(&mut s).await;
    }
    assert_eq!(walks(), 0, "refused before any walk");
    s.write(&raw_frame(0x42, 2, b"\x00\x00topic:t/#:durable:c9:latest"))
        .await;
    until("the new consumer", || b.broker.subscriber_count() == 2).await;
    assert_eq!(walks(), 1);
    // Refused as live already, or joining a live group: nothing to walk for either (a client
    // could make the broker walk every topic with each such SUBSCRIBE).
    s.write(&raw_frame(0x42, 3, b"\x00\x00topic:t/#:durable:c9:latest"))
        .await;
    expect_bad_subscribe(&mut s).await;
    assert_eq!(walks(), 1, "refused as in use without a walk");
    s.write(&raw_frame(
        0x42,
        4,
        b"\x00\x00topic:t/#:group:g:durable:m1:latest",
    ))
    .await;
    until("the group's first member", || {
        b.broker.subscriber_count() == 3
    })
    .await;
    assert_eq!(walks(), 2, "a new group walks");
    s.write(&raw_frame(
        0x42,
        5,
        b"\x00\x00topic:t/#:group:g:durable:m2:latest",
    ))
    .await;
    until("the group's second member", || {
        b.broker.subscriber_count() == 4
    })
    .await;
    assert_eq!(walks(), 2, "joining it does not");
    b.stop().await.expect("clean shutdown");
    // The connection's limit: refused before any walk too.
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), FsyncMode::Batch));
        c.transport.max_subscriptions_per_connection = 1;
    })
    .await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:taken")).await;
    s.write(&raw_frame(0x42, 2, b"\x00\x00topic:t/#:durable:c:latest"))
        .await;
    expect_bad_subscribe(&mut s).await;
    assert_eq!(
        b.stats
            .durable_latest_walks
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "refused at the limit before any walk"
    );
    b.stop().await.expect("clean shutdown");
}

/// Retention forgets the topics it empties that nothing holds, so that a broker with the log
/// does not keep every topic name it ever logged: one published to again goes on past every
/// offset it had (the log's offset floor), also after a restart. A topic the broker holds (it
/// has a subscription) and one a durable consumer has not read to the end are kept, and go on
/// at their own next offset; one a durable consumer has read to the end is forgotten, and the
/// consumer, back after the restart, gets its next message past the floor without taking that
/// for retention overtaking it. (Before, the log kept every topic it ever logged, for good, and
/// then every topic a durable consumer had a position in.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_forgets_the_topics_it_empties_and_their_offsets_go_on() {
    use aqueduct_client::DurableStart;
    let dir = tempfile::tempdir().expect("temp dir");
    let small = || {
        let mut a = aal(dir.path(), FsyncMode::Batch);
        a.max_segment_bytes = 16 << 10;
        a.retention_bytes = Some(64 << 10);
        a
    };
    let b = TestBroker::start_with(|c| c.aal = Some(small())).await;
    let client = b.client().await;
    let mut live = client.subscribe("churn/live").await.expect("subscribe");
    publish_n(&client, "churn/0", 0..3).await;
    publish_n(&client, "churn/live", 0..1).await;
    assert_eq!(next(&mut live).await.offset(), 0);
    publish_n(&client, "dur/unread", 0..1).await;
    publish_n(&client, "dur/read", 0..1).await;
    // A durable consumer reads both and leaves: its positions (1, 1) are stored. Then one more
    // of `dur/unread`, which it has not read.
    let reader = b.client().await;
    let mut sub = reader
        .subscribe_with("dur/+", &durable_opts("d", DurableStart::Earliest))
        .await
        .expect("subscribe");
    let got = take_acked(&mut sub, 2).await;
    assert_eq!(got, vec![(0, "m0".to_string()); 2]);
    // After its ACKs are handled (dropping it could cut them: its positions would stay at 0).
    sub.close().await.expect("close");
    reader.close().await.expect("close");
    publish_n(&client, "dur/unread", 1..2).await;
    // 5,000 more topics, one message each: the broker frees the state of idle topics once it
    // holds 4,096 (the subscribed one stays).
    for chunk in (1..=5_000).collect::<Vec<u32>>().chunks(500) {
        let batch = chunk
            .iter()
            .map(|i| (format!("churn/{i}"), Bytes::from_static(b"x")))
            .collect::<Vec<_>>();
        client
            .publish_batch(
                batch.iter().map(|(t, m)| (t.as_str(), m.clone())),
                &confirm(),
            )
            .await
            .expect("batch");
    }
    // Enough of one more topic that retention (64 KiB) deletes every segment of the others.
    let filler = Bytes::from(vec![b'f'; 200]);
    for _ in 0..4 {
        let batch = (0..250).map(|_| ("filler", filler.clone()));
        client
            .publish_batch(batch, &confirm())
            .await
            .expect("batch");
    }
    let metrics = |name: &'static str| {
        let addr = b.metrics_addr;
        async move { value(&get(addr, "/metrics").await.1, name).unwrap_or(0.0) }
    };
    // Every topic is kept, or forgotten already (by the writer's own pass, every 10 s).
    let accounted =
        metrics("aqueduct_log_topics").await + metrics("aqueduct_log_topics_forgotten_total").await;
    assert!(accounted > 5_000.0, "{accounted}");
    let (mut forgotten, mut left) = (0.0, f64::MAX);
    for _ in 0..5 {
        b.control.apply_log_retention();
        // Two publishes one after the other: the writer confirms the second in a write after
        // the pass. No scrape meanwhile: a scrape holds every topic's state for a moment, and
        // the broker frees no topic in use (the pass then keeps it, in a mark).
        for _ in 0..2 {
            client
                .publish_with("filler", "after the pass", &confirm())
                .await
                .expect("publish");
        }
        forgotten = metrics("aqueduct_log_topics_forgotten_total").await;
        left = metrics("aqueduct_log_topics").await;
        if forgotten >= 4_000.0 && left < 1_200.0 {
            break;
        }
        // Topics a pass met in use (the writer's own 10 s pass during a scrape, on a slow
        // machine) were kept in marks: more of the other topic pushes those out too.
        let batch = (0..250).map(|_| ("filler", filler.clone()));
        client
            .publish_batch(batch, &confirm())
            .await
            .expect("batch");
    }
    assert!(forgotten >= 4_000.0, "topics forgotten: {forgotten}");
    assert!(
        left < 1_200.0,
        "topics the log keeps after retention: {left}"
    );
    // A forgotten topic goes on past every offset any forgotten topic had (churn/0's 0..=2).
    let again = client
        .publish_with("churn/1", "again", &confirm())
        .await
        .expect("publish");
    assert_eq!(again, Some(3), "past the offset floor, not at 1");
    client.close().await.expect("close");
    b.stop().await.expect("clean shutdown");

    // What the log keeps, read offline: not the forgotten topics.
    {
        let (log, _) = aqueduct_log::Log::open(
            dir.path(),
            aqueduct_log::LogOptions {
                key: Some(key()),
                ..aqueduct_log::LogOptions::default()
            },
        )
        .expect("log opens");
        let topics: std::collections::HashSet<&[u8]> = log.topics().collect();
        assert!(!topics.contains(&b"churn/0"[..]));
        assert!(topics.contains(&b"churn/live"[..]));
        assert!(topics.contains(&b"dur/unread"[..]));
        assert!(!topics.contains(&b"dur/read"[..]));
        // The consumer's position in `dur/read` went with it.
        let (_, positions) = aqueduct_log::PositionStore::open(dir.path()).expect("positions");
        assert_eq!(
            positions["consumer:d"].next,
            std::collections::BTreeMap::from([(b"dur/unread".to_vec(), 1)])
        );
        assert_eq!(log.new_topic_offset(), 3);
        log.close().expect("close");
    }

    let b = TestBroker::start_with(|c| c.aal = Some(small())).await;
    let client = b.client().await;
    for (topic, want) in [
        ("churn/0", 3),
        ("churn/live", 1),
        ("dur/unread", 2),
        ("dur/read", 3),
    ] {
        let offset = client
            .publish_with(topic, "after restart", &confirm())
            .await
            .expect("publish");
        assert_eq!(offset, Some(want), "{topic}");
    }
    // The consumer comes back: retention deleted the message of `dur/unread` it had not read
    // (retention does not wait for consumers), which it is told (counted once, and warned);
    // it gets both topics' new messages (`dur/read` found again from its start, past the
    // floor, which is no sign of retention overtaking it).
    let reader = b.client().await;
    let mut sub = reader
        .subscribe_with("dur/+", &durable_opts("d", DurableStart::Earliest))
        .await
        .expect("subscribe");
    let mut got = Vec::new();
    for _ in 0..2 {
        let m = next(&mut sub).await;
        got.push((m.topic().to_string(), m.offset()));
        m.ack().await.expect("ack");
    }
    got.sort();
    assert_eq!(
        got,
        vec![("dur/read".to_string(), 3), ("dur/unread".to_string(), 2)]
    );
    let overtaken = value(
        &get(b.metrics_addr, "/metrics").await.1,
        "aqueduct_log_consumers_overtaken_total",
    );
    assert_eq!(overtaken, Some(1.0), "only in `dur/unread`");
    sub.close().await.expect("close");
    reader.close().await.expect("close");
    client.close().await.expect("close");
    b.stop().await.expect("clean shutdown");
}

/// A shutdown stops feeding durable consumers: each stream's writer sends what is queued,
/// finishes the stream and waits for the client to read it, so a consumer whose deliveries are
/// settled as written (no ACK_MODE explicit) has received everything its saved position counts.
/// Before, its feeder went on during the shutdown, the writer never ran dry, and after 5 s the
/// connection was closed under messages written but not yet read: the position saved at the
/// end skipped them, and they never came again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_stops_feeding_so_a_consumer_without_acks_misses_nothing() {
    use aqueduct_client::DurableStart;
    const BACKLOG: u64 = 5000;
    let dir = tempfile::tempdir().expect("temp dir");
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    for start in (0..BACKLOG).step_by(500) {
        let batch = (start..start + 500).map(|i| ("jobs", Bytes::from(format!("m{i}"))));
        client
            .publish_batch(batch, &confirm())
            .await
            .expect("batch");
    }
    client.close().await.expect("close");
    // A consumer with a 4 KiB stream window that reads slower than the log could feed it.
    let raw = Raw::connect(&b, 4096).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(
        0x42,
        1,
        b"\x00\x00topic:jobs:durable:w:earliest",
    ))
    .await;
    let offset = |f: aqueduct_proto::Frame| match f.message {
        aqueduct_proto::frame::Message::Publish(p) => p.ext.offset.expect("an offset"),
        other => panic!("not a delivery: {other:?}"),
    };
    let mut got = vec![offset(s.read_frame().await.expect("the first delivery"))];
    let stopping = tokio::spawn(b.stop());
    let mut pace = tokio::time::interval(std::time::Duration::from_millis(2));
    while let Some(f) = s.read_frame().await {
        got.push(offset(f));
        pace.tick().await;
    }
    within("the shutdown", stopping)
        .await
        .expect("joined")
        .expect("clean shutdown");
    let received = got.len() as u64;
    assert_eq!(got, (0..received).collect::<Vec<_>>(), "in order, no gap");
    assert!(
        received < BACKLOG,
        "the shutdown went on feeding the consumer ({received} of {BACKLOG})"
    );
    raw.forget();

    // After a restart it goes on exactly where it stopped receiving.
    let b = durable_broker(dir.path()).await;
    let client = b.client().await;
    let opts = aqueduct_client::SubscribeOptions {
        durable: Some(("w".to_string(), DurableStart::Earliest)),
        ..aqueduct_client::SubscribeOptions::default()
    };
    let mut sub = client
        .subscribe_with("jobs", &opts)
        .await
        .expect("resubscribe");
    assert_eq!(
        next(&mut sub).await.offset(),
        received,
        "nothing skipped, nothing again"
    );
    close_and_stop(client, b).await;
}

/// While the log owes all it may (here its writer is held and 131,072 messages wait), a NACK
/// that would make a dead letter waits too: it is not handled (its stream is not read on), so
/// that many subscriptions NACKing one message each cannot grow the log's queue past its
/// bounds. Once the log has room its dead letter is made. Before, it was made at once, whatever
/// the log owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_waits_for_room_in_the_log() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b = TestBroker::start_with(|c| {
        c.aal = Some(aal(dir.path(), FsyncMode::Batch));
        c.broker.max_retries = 0;
    })
    .await;
    let client = b.client().await;
    let opts = aqueduct_client::SubscribeOptions {
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    };
    let mut sub = client
        .subscribe_with("jobs", &opts)
        .await
        .expect("subscribe");
    publish_n(&client, "jobs", 0..1).await;
    let nacked = next(&mut sub).await;
    let dead_letters = || {
        b.broker
            .topic(&"__dlq__jobs".try_into().expect("topic"))
            .map_or(0, |t| t.stats().snapshot().published)
    };
    b.control.hold_log_writes(true);
    // 64 batches of 2,048: exactly what the log may owe.
    let filler = b.client().await;
    for _ in 0..64 {
        let batch = (0..2048).map(|_| ("fill", Bytes::from_static(b"x")));
        filler
            .publish_batch(batch, &PublishOptions::default())
            .await
            .expect("batch");
    }
    // Full for good only once every batch is routed: while a batch is routed its room and its
    // queued messages are both counted, so the log can look full during the 63rd batch and
    // have room again when that batch lets its room go (the NACK then got in: a flaky test).
    let filled = || {
        b.broker
            .topic(&"fill".try_into().expect("topic"))
            .map_or(0, |t| t.stats().snapshot().published)
    };
    until("the log to owe all it may", || {
        filled() == 64 * 2048 && b.control.log_is_full()
    })
    .await;
    nacked.nack(None).await.expect("nack sent");
    // Given time to be handled (it would be at once), it is not.
    let made = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        until("a dead letter", || dead_letters() > 0),
    )
    .await;
    assert!(
        made.is_err(),
        "a dead letter was made while the log was full"
    );
    b.control.hold_log_writes(false);
    until("the dead letter, once the log has room", || {
        dead_letters() == 1
    })
    .await;
    close_and_stop(client, b).await;
}
