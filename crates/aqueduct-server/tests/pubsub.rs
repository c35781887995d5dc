//! End to end over QUIC with the real client: pub/sub, wildcards, groups, settlement, dead
//! letters, priorities, TTL, confirmations, shutdown, many connections.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use aqueduct_client::{ErrorCode, OverflowPolicy, Priority, PublishOptions, SubscribeOptions};
use aqueduct_proto::TopicName;
use bytes::Bytes;
use common::*;
use futures_util::StreamExt;

fn confirm() -> PublishOptions {
    PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    }
}

/// Settle each message explicitly.
fn explicit_ack() -> SubscribeOptions {
    SubscribeOptions {
        ack: true,
        ..SubscribeOptions::default()
    }
}

/// A subscription to `filter` settled explicitly, one unsettled delivery at a time.
async fn one_at_a_time(
    client: &aqueduct_client::Client,
    filter: &str,
) -> aqueduct_client::Subscription {
    let opts = SubscribeOptions {
        max_in_flight: Some(1),
        ..explicit_ack()
    };
    client
        .subscribe_with(filter, &opts)
        .await
        .expect("subscribe")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_and_wildcard_subscriptions() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut exact = client.subscribe("sport/tennis").await.expect("subscribe");
    let mut plus = client.subscribe("sport/+").await.expect("subscribe");
    let mut hash = client.subscribe("#").await.expect("subscribe");
    let publisher = b.client().await;
    let offset = publisher
        .publish_with("sport/tennis", "ace", &confirm())
        .await
        .expect("publish");
    assert_eq!(offset, Some(0));
    for sub in [&mut exact, &mut plus, &mut hash] {
        let m = next(sub).await;
        assert_eq!(
            (m.topic().as_str(), m.body().as_ref(), m.offset()),
            ("sport/tennis", &b"ace"[..], 0)
        );
        assert_eq!((m.priority(), m.attempt()), (Priority::DEFAULT, 1));
    }
    publisher
        .publish_with("news", "x", &confirm())
        .await
        .expect("publish");
    assert_eq!(next(&mut hash).await.topic().as_str(), "news");
    // `exact` and `plus` must not get "news": the next thing they see is the next sport message.
    publisher
        .publish_with("sport/golf", "birdie", &confirm())
        .await
        .expect("publish");
    assert_eq!(next(&mut plus).await.body().as_ref(), b"birdie");
    publisher
        .publish_with("sport/tennis", "let", &confirm())
        .await
        .expect("publish");
    assert_eq!(next(&mut exact).await.body().as_ref(), b"let");
    // Binary bodies pass through untouched.
    let body: Vec<u8> = (0..=255u8).collect();
    publisher
        .publish_with("bin", body.clone(), &confirm())
        .await
        .expect("publish");
    loop {
        let m = next(&mut hash).await;
        if m.topic().as_str() == "bin" {
            assert_eq!(m.body().as_ref(), body.as_slice());
            break;
        }
    }
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_publish_with_confirmation() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("b/+").await.expect("subscribe");
    let messages = (0..50).map(|i| {
        (
            if i % 2 == 0 { "b/even" } else { "b/odd" },
            Bytes::from(i.to_string()),
        )
    });
    let offsets = client
        .publish_batch(messages, &confirm())
        .await
        .expect("batch")
        .expect("confirmed");
    let want: Vec<u64> = (0..50).map(|i| i / 2).collect();
    assert_eq!(offsets, want);
    for i in 0..50 {
        assert_eq!(
            next(&mut sub).await.body().as_ref(),
            i.to_string().as_bytes()
        );
    }
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_group_round_robin_and_failover() {
    let b = TestBroker::start().await;
    let clients = [b.client().await, b.client().await, b.client().await];
    let mut members = Vec::new();
    for c in &clients {
        members.push(c.subscribe_group("jobs/+", "workers").await.expect("join"));
    }
    let publisher = b.client().await;
    for i in 0..300 {
        publisher
            .publish_with("jobs/a", i.to_string(), &confirm())
            .await
            .expect("publish");
    }
    let mut seen = BTreeSet::new();
    for m in &mut members {
        for _ in 0..100 {
            let msg = next(m).await;
            assert!(
                seen.insert(msg.offset()),
                "offset {} delivered twice",
                msg.offset()
            );
            msg.ack().await.expect("ack");
        }
    }
    assert_eq!(seen.len(), 300);

    // Failover: member 0 takes messages without settling them, then its connection goes away.
    for i in 0..6 {
        publisher
            .publish_with("jobs/a", format!("f{i}"), &confirm())
            .await
            .expect("publish");
    }
    let unsettled: Vec<_> = vec![next(&mut members[0]).await, next(&mut members[0]).await];
    let lost: BTreeSet<u64> = unsettled.iter().map(|m| m.offset()).collect();
    let gone = members.remove(0);
    drop(gone);
    clients[0]
        .close()
        .await
        .expect("close: everything published was taken");
    let mut redelivered = BTreeMap::new();
    let mut all = BTreeSet::new();
    // The other two get their own 4 plus the 2 that member 0 held (as attempt 2).
    while all.len() < 6 {
        for m in members.iter_mut() {
            if let Ok(Some(Ok(msg))) =
                tokio::time::timeout(Duration::from_millis(200), m.next()).await
            {
                all.insert(msg.offset());
                if msg.attempt() > 1 {
                    redelivered.insert(msg.offset(), msg.attempt());
                }
                msg.ack().await.expect("ack");
            }
        }
    }
    assert_eq!(redelivered.keys().copied().collect::<BTreeSet<_>>(), lost);
    assert!(redelivered.values().all(|a| *a == 2));
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_redelivers_then_dead_letters() {
    let b = TestBroker::start().await; // max_retries 3
    let client = b.client().await;
    let opts = explicit_ack();
    let mut jobs = client
        .subscribe_with("jobs", &opts)
        .await
        .expect("subscribe");
    let mut dlq = client
        .subscribe("__dlq__jobs")
        .await
        .expect("subscribe dlq");
    client
        .publish_with("jobs", "payload", &confirm())
        .await
        .expect("publish");
    for attempt in 1..=4 {
        let m = next(&mut jobs).await;
        assert_eq!((m.attempt(), m.body().as_ref()), (attempt, &b"payload"[..]));
        m.nack(Some("cannot parse")).await.expect("nack");
    }
    let dead = next(&mut dlq).await;
    assert_eq!(dead.topic().as_str(), "__dlq__jobs");
    assert_eq!(dead.body().as_ref(), b"payload");
    let ext = dead.extensions();
    assert_eq!(
        ext.original_topic,
        Some(TopicName::try_from("jobs").expect("valid"))
    );
    assert_eq!(ext.original_offset, Some(0));
    assert_eq!(ext.attempts_made, Some(4));
    assert_eq!(ext.reason.as_deref(), Some("cannot parse"));

    // Settling something that is not in flight is refused with an ERROR on the subscription.
    client
        .publish_with("jobs", "again", &confirm())
        .await
        .expect("publish");
    let m = next(&mut jobs).await;
    m.ack().await.expect("ack");
    m.ack().await.expect("second ack is sent");
    let err = within("the refusal", jobs.next())
        .await
        .expect("open")
        .expect_err("an error");
    assert_eq!(err.code(), Some(ErrorCode::NOT_IN_FLIGHT));
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_priority_order_under_load() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("prio").await.expect("subscribe");
    // One batch frame is enqueued under one subscriber lock before the writer drains it, so the
    // subscriber must see every priority-0 message before any priority-1 one, and so on.
    let mut batch = Vec::new();
    for i in 0..1500u32 {
        batch.push((i % 4, i));
    }
    let publisher = b.client().await;
    let mut frames = Vec::new();
    for (prio, i) in &batch {
        let p = aqueduct_proto::Publish::new(
            TopicName::try_from("prio").expect("valid"),
            Bytes::from(i.to_string()),
        )
        .with_priority(Priority::new(3 - *prio as u8).expect("valid"));
        frames.push(p);
    }
    let batch_frame = aqueduct_proto::PublishBatch::from_publishes(&frames);
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write_frame(&aqueduct_proto::Frame::new(
        0,
        aqueduct_proto::frame::Message::PublishBatch(batch_frame),
    ))
    .await;
    let mut got = Vec::new();
    for _ in 0..1500 {
        let m = next(&mut sub).await;
        got.push((m.priority().level(), m.offset()));
    }
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(got, sorted, "strict priority order, FIFO within a priority");
    drop(publisher);
    b.stop().await.expect("clean shutdown");
}

/// A subscription that takes one message at a time (max_in_flight 1) sees what waits behind it
/// in strict priority order: an urgent message published after five routine ones comes next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_subscription_gets_the_urgent_message_next() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = one_at_a_time(&client, "alerts").await;
    let publisher = b.client().await;
    let at = |level: u8| PublishOptions {
        priority: Priority::new(level),
        confirm: true,
        ..PublishOptions::default()
    };
    for i in 0..5 {
        publisher
            .publish_with("alerts", format!("routine {i}"), &at(3))
            .await
            .expect("publish");
    }
    publisher
        .publish_with("alerts", "disk 99%", &at(0))
        .await
        .expect("publish");
    let mut got = Vec::new();
    for _ in 0..6 {
        let m = next(&mut sub).await;
        got.push(String::from_utf8_lossy(m.body()).into_owned());
        // Until this ACK arrives the broker sends nothing more.
        m.ack().await.expect("ack");
    }
    assert_eq!(
        got,
        [
            "routine 0",
            "disk 99%",
            "routine 1",
            "routine 2",
            "routine 3",
            "routine 4"
        ]
    );
    b.stop().await.expect("clean shutdown");
}

/// A redelivery joins the back of its priority's queue (protocol.md 6.6, 8.1): A, B, C queued,
/// A NACKed, and the subscription next gets B, C, then A's second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_joins_the_back_of_its_queue() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = one_at_a_time(&client, "order").await;
    let publisher = b.client().await;
    for body in ["A", "B", "C"] {
        publisher
            .publish_with("order", body, &confirm())
            .await
            .expect("publish");
    }
    let first = next(&mut sub).await;
    assert_eq!((first.body().as_ref(), first.attempt()), (&b"A"[..], 1));
    first.nack(None).await.expect("nack");
    let mut got = Vec::new();
    for _ in 0..3 {
        let m = next(&mut sub).await;
        got.push((String::from_utf8_lossy(m.body()).into_owned(), m.attempt()));
        m.ack().await.expect("ack");
    }
    assert_eq!(
        got,
        [
            ("B".to_owned(), 1),
            ("C".to_owned(), 1),
            ("A".to_owned(), 2)
        ]
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_messages_are_dropped_and_counted() {
    let b = TestBroker::start_with(|c| c.broker.max_in_flight = 1).await;
    let client = b.client().await;
    let opts = explicit_ack();
    let mut sub = client
        .subscribe_with("ttl", &opts)
        .await
        .expect("subscribe");
    client
        .publish_with("ttl", "first", &confirm())
        .await
        .expect("publish");
    let first = next(&mut sub).await; // now in flight: nothing else is sent until it is settled
    let short = PublishOptions {
        ttl: Some(Duration::from_millis(30)),
        confirm: true,
        ..PublishOptions::default()
    };
    client
        .publish_with("ttl", "short-lived", &short)
        .await
        .expect("publish");
    client
        .publish_with("ttl", "last", &confirm())
        .await
        .expect("publish");
    // Let the short-lived message's TTL pass while it waits in the queue.
    tokio::time::sleep(Duration::from_millis(60)).await;
    first.ack().await.expect("ack");
    let m = next(&mut sub).await;
    assert_eq!(
        m.body().as_ref(),
        b"last",
        "the expired message is never delivered"
    );
    let stats = b
        .broker
        .topic(&TopicName::try_from("ttl").expect("valid"))
        .expect("known")
        .stats()
        .snapshot();
    assert_eq!(stats.expired(Priority::DEFAULT), 1);
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_flushes_queued_deliveries() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("flush").await.expect("subscribe");
    let batch = (0..500).map(|i| ("flush", Bytes::from(i.to_string())));
    client
        .publish_batch(batch, &confirm())
        .await
        .expect("batch");
    b.stop().await.expect("clean shutdown");
    let mut n = 0;
    while let Some(Ok(m)) = within("flushed messages", sub.next()).await {
        assert_eq!(m.body().as_ref(), n.to_string().as_bytes());
        n += 1;
    }
    assert_eq!(
        n, 500,
        "every queued delivery was flushed before the connection closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_connections_publish_and_subscribe() {
    let b = TestBroker::start().await;
    const N: usize = 200;
    let mut clients = Vec::new();
    for _ in 0..N {
        clients.push(b.client().await);
    }
    let mut subs = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        subs.push(c.subscribe(&format!("load/{i}")).await.expect("subscribe"));
    }
    let mut tasks = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for k in 0..5 {
                c.publish_with(
                    &format!("load/{}", (i + 1) % N),
                    format!("{i}:{k}"),
                    &confirm(),
                )
                .await
                .expect("publish");
            }
        }));
    }
    for t in tasks {
        within("publishers", t).await.expect("publisher task");
    }
    for (i, sub) in subs.iter_mut().enumerate() {
        let from = (i + N - 1) % N;
        for k in 0..5 {
            assert_eq!(
                next(sub).await.body().as_ref(),
                format!("{from}:{k}").as_bytes()
            );
        }
    }
    assert_eq!(b.broker.subscriber_count(), N);
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_right_after_publishing_loses_nothing() {
    // A publisher that closes at once must not race the broker: QUIC acknowledging the data
    // is not the broker having read it, so `close` waits for the broker's end of the stream.
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("quick").await.expect("subscribe");
    const N: u64 = 30;
    for i in 0..N {
        let publisher = b.client().await;
        publisher
            .publish("quick", i.to_string())
            .await
            .expect("publish");
        publisher
            .close()
            .await
            .expect("close: everything published was taken");
    }
    for i in 0..N {
        let m = next(&mut sub).await;
        assert_eq!(
            (m.offset(), m.body().as_ref()),
            (i, i.to_string().as_bytes())
        );
    }
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_subscription_unsubscribes() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let sub = client.subscribe("gone").await.expect("subscribe");
    assert_eq!(b.broker.subscriber_count(), 1);
    drop(sub);
    until("the broker to drop the subscription", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    let policy = SubscribeOptions {
        overflow: Some(OverflowPolicy::DropNewest),
        ..SubscribeOptions::default()
    };
    let sub = client
        .subscribe_with("gone", &policy)
        .await
        .expect("subscribe");
    sub.unsubscribe().await.expect("unsubscribe");
    until("the broker to drop the subscription", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    b.stop().await.expect("clean shutdown");
}

/// Several subscriptions on one stream: one `Subscription` yields the messages of all of them,
/// and each message settles with its own subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_subscriptions_share_one_stream() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let opts = explicit_ack();
    let mut sub = client
        .subscribe_many(&["a", "b/+", "c"], &opts)
        .await
        .expect("subscribe");
    assert_eq!(b.broker.subscriber_count(), 3);
    assert_eq!(
        b.stats
            .live_streams
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let publisher = b.client().await;
    for topic in ["c", "b/1", "a"] {
        publisher
            .publish_with(topic, topic, &confirm())
            .await
            .expect("publish");
    }
    let mut got = BTreeSet::new();
    for _ in 0..3 {
        let m = next(&mut sub).await;
        assert_eq!(m.topic().as_str().as_bytes(), m.body().as_ref());
        m.ack().await.expect("ack");
        got.insert(m.topic().to_string());
    }
    assert_eq!(got, BTreeSet::from(["a".into(), "b/1".into(), "c".into()]));
    until("every delivery settled", || {
        b.broker.subscribers().iter().all(|s| s.in_flight() == 0)
    })
    .await;
    // A refused filter refuses the whole call.
    let err = client
        .subscribe_many(&["ok", "bad/#/x"], &opts)
        .await
        .expect_err("invalid filter");
    assert!(err.to_string().contains("filter"), "{err}");
    sub.unsubscribe().await.expect("unsubscribe");
    until("all gone", || b.broker.subscriber_count() == 0).await;
    b.stop().await.expect("clean shutdown");
}

/// What the cancellation tests share: a broker with the smallest stream window it accepts (so
/// that a 50 KB batch needs several rounds of credit), a client subscribed to `prefix/+` whose
/// publish stream is open (`prefix/first` published), and a 300-message batch to
/// `prefix/batch` whose publish was dropped after its first poll, part of it written.
struct Cancelled {
    b: TestBroker,
    client: aqueduct_client::Client,
    sub: aqueduct_client::Subscription,
    prefix: &'static str,
    body: Bytes,
}

const CANCELLED_BATCH: usize = 300;

async fn cancel_a_batch_mid_frame(prefix: &'static str) -> Cancelled {
    use futures_util::FutureExt;
    // The batch is three times the broker's stream credit, but a first poll that the machine
    // suspends long enough can see the broker read and grant more, and finish it: that try
    // shows nothing, so it is made again on a new broker (a few times at most).
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let b = TestBroker::start_with(|c| c.transport.stream_receive_window = 16 << 10).await;
        let client = b.client().await;
        let sub = client
            .subscribe(&format!("{prefix}/+"))
            .await
            .expect("subscribe");
        client
            .publish_with(&format!("{prefix}/first"), "first", &confirm())
            .await
            .expect("the stream opens");
        let body = Bytes::from(vec![b'x'; 150]);
        let topic = format!("{prefix}/batch");
        let batch = (0..CANCELLED_BATCH).map(|_| (topic.as_str(), body.clone()));
        let cancelled = client
            .publish_batch(batch, &PublishOptions::default())
            .now_or_never();
        if cancelled.is_none() {
            return Cancelled {
                b,
                client,
                sub,
                prefix,
                body,
            };
        }
        close_and_stop(client, b).await;
    }
    panic!("the batch fitted the broker's stream credit in {TRIES} tries: the test shows nothing");
}

impl Cancelled {
    /// A confirmed publish to `prefix/after` on the same stream; then the subscriber gets
    /// `first`, the whole batch and `after`, in order.
    async fn publish_after_and_receive_everything(&mut self) {
        let after = format!("{}/after", self.prefix);
        let offset = within(
            "the next publish is confirmed",
            self.client.publish_with(&after, "after", &confirm()),
        )
        .await
        .expect("the next publish on the stream");
        assert_eq!(offset, Some(0), "{after}'s first message");
        assert_eq!(next(&mut self.sub).await.body().as_ref(), b"first");
        let topic = format!("{}/batch", self.prefix);
        for i in 0..CANCELLED_BATCH {
            let m = next(&mut self.sub).await;
            assert_eq!(
                (i, m.topic().as_str(), m.body()),
                (i, topic.as_str(), &self.body)
            );
        }
        assert_eq!(next(&mut self.sub).await.body().as_ref(), b"after");
    }
}

/// A publish cancelled halfway through its frame (a batch larger than the stream's
/// flow-control credit, its future dropped after the first part went out) leaves no partial
/// frame behind: the next publish on the same stream sends the rest first, and the broker
/// reads both whole. Before the fix, the next frame's bytes were read as the rest of the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_cancelled_mid_frame_is_sent_whole_by_the_next() {
    let mut c = cancel_a_batch_mid_frame("cancel").await;
    c.publish_after_and_receive_everything().await;
    c.b.stop().await.expect("clean shutdown");
}

/// A flush cancelled while the rest of a frame waits for flow control leaves the stream in
/// place with that rest queued: the next publish sends it first. Before the fix the flush took
/// the stream out first, and dropping it cut the frame off (the broker lost the whole batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_cancelled_mid_frame_leaves_the_frame_to_the_next_publish() {
    use futures_util::FutureExt;
    let mut c = cancel_a_batch_mid_frame("flush").await;
    assert!(
        c.client.flush().now_or_never().is_none(),
        "the flush must wait for credit too, or this test shows nothing"
    );
    c.publish_after_and_receive_everything().await;
    within("flush", c.client.flush()).await.expect("flush");
    c.b.stop().await.expect("clean shutdown");
}

/// After the broker stops reading a publish stream (a frame above `transport.max_buf_size`:
/// FRAME_TOO_LARGE), the next publish goes out on a new stream. Before the fix every later
/// publish on that publisher failed until someone called `flush`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_after_a_stream_fatal_error_uses_a_new_stream() {
    let b = TestBroker::start_with(|c| c.transport.max_frame_data = 1024).await;
    let client = b.client().await;
    let mut sub = client.subscribe("fatal/+").await.expect("subscribe");
    let err = client
        .publish_with("fatal/big", vec![b'z'; 2000], &confirm())
        .await
        .expect_err("too large");
    assert!(
        matches!(
            err,
            aqueduct_client::ClientError::Broker {
                code: ErrorCode::FRAME_TOO_LARGE,
                ..
            }
        ),
        "{err}"
    );
    for i in 0..3u64 {
        let offset = within(
            "a publish after the error",
            client.publish_with("fatal/small", format!("small {i}"), &confirm()),
        )
        .await
        .expect("published on a new stream");
        assert_eq!(offset, Some(i));
    }
    for i in 0..3 {
        assert_eq!(
            next(&mut sub).await.body().as_ref(),
            format!("small {i}").as_bytes()
        );
    }
    // The first stream was cut short: the next flush says so, once.
    let lost = client.flush().await.expect_err("reported");
    assert!(lost.to_string().contains("FRAME_TOO_LARGE"), "{lost}");
    client.flush().await.expect("then flushed");
    b.stop().await.expect("clean shutdown");
}

/// A publish without `confirm` that finds its stream stopped by the broker (an earlier frame
/// above `transport.max_buf_size`) reports the broker's reason, FRAME_TOO_LARGE, and so does
/// the flush after it. It said only "the broker stopped reading the stream with ErrorCode(0)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_on_a_stopped_stream_says_why_the_broker_stopped_it() {
    let b = TestBroker::start_with(|c| c.transport.max_frame_data = 1024).await;
    let client = b.client().await;
    // More than the stream's window in all: a write blocks until the broker's STOP_SENDING
    // fails it (smaller frames are all sent before it comes; the next publish then sees the
    // ERROR first and goes on on a new stream).
    let mut refused = None;
    for _ in 0..300 {
        if let Err(e) = client.publish("big", vec![b'z'; 70_000]).await {
            refused = Some(e);
            break;
        }
    }
    let e = refused.expect("a publish on the stopped stream fails");
    assert!(e.to_string().contains("FRAME_TOO_LARGE"), "{e}");
    let lost = within("flush", client.flush()).await.expect_err("reported");
    assert!(lost.to_string().contains("FRAME_TOO_LARGE"), "{lost}");
    b.stop().await.expect("clean shutdown");
}

/// A flush (and `close`, which flushes) after an earlier stream was cut short still finishes
/// the current stream and waits for the broker to have read it, then reports the earlier loss.
/// Before, it reported the loss at once, and `close` then closed the connection under
/// publishes the broker had not read yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_after_an_earlier_stream_failed_still_flushes_the_current_one() {
    const N: usize = 2_000;
    let b = TestBroker::start_with(|c| {
        c.transport.max_frame_data = 4096;
        c.broker.queue_size = 4 * N;
    })
    .await;
    let watcher = b.client().await;
    let mut sub = watcher.subscribe("after/+").await.expect("subscribe");
    let client = b.client().await;
    client
        .publish_with("after/big", vec![b'z'; 8000], &confirm())
        .await
        .expect_err("too large");
    for i in 0..N {
        client
            .publish("after/small", format!("{i:04}{}", "x".repeat(1000)))
            .await
            .expect("published on a new stream");
    }
    // close reports the earlier loss, once it has flushed the current stream.
    let lost = client.close().await.expect_err("the earlier loss reported");
    assert!(lost.to_string().contains("FRAME_TOO_LARGE"), "{lost}");
    for i in 0..N {
        let m = next(&mut sub).await;
        assert_eq!(&m.body()[..4], format!("{i:04}").as_bytes());
    }
    close_and_stop(watcher, b).await;
}

/// A broker whose queues hold 4 messages and whose `block` subscriptions may hold a publisher
/// for `timeout`.
async fn block_timeout_broker(timeout: Duration) -> TestBroker {
    TestBroker::start_with(|c| {
        c.broker.queue_size = 4;
        c.block_timeout = Some(timeout);
    })
    .await
}

/// A `block` subscription with one unsettled delivery at a time: never settled, its queue fills
/// behind the first while its stream itself has room.
fn stuck_block() -> SubscribeOptions {
    SubscribeOptions {
        max_in_flight: Some(1),
        overflow: Some(OverflowPolicy::Block),
        ..explicit_ack()
    }
}

/// A `block` subscription that holds its publisher past `broker.block_timeout` is closed with
/// ERROR SLOW_CONSUMER whose reason says so (protocol.md 7.3); it said "its queue overflowed
/// (policy disconnect)", a policy the subscription did not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_timeout_close_says_why() {
    let b = block_timeout_broker(Duration::from_millis(300)).await;
    let subscriber = b.client().await;
    // One unsettled delivery at a time and none settled: the queue fills behind the first,
    // while the stream itself has room (so the broker sends an ERROR, not a reset).
    let opts = stuck_block();
    let mut sub = subscriber
        .subscribe_with("held", &opts)
        .await
        .expect("subscribe");
    let publisher = b.client().await;
    for i in 0..16 {
        publisher
            .publish("held", format!("m{i}"))
            .await
            .expect("publish");
    }
    within("the flush", publisher.flush())
        .await
        .expect("the broker read everything once the subscription was closed");
    let end = within("the subscription's end", async {
        loop {
            match sub.next_message().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => break e,
                None => panic!("ended without an error"),
            }
        }
    })
    .await;
    assert_eq!(end.code(), Some(ErrorCode::SLOW_CONSUMER), "{end}");
    let text = end.to_string();
    assert!(
        text.contains("broker.block_timeout (300ms)") && text.contains("policy block"),
        "{text}"
    );
    assert!(!text.contains("disconnect"), "{text}");
    b.stop().await.expect("clean shutdown");
}

/// A publisher held by many stuck `block` subscriptions at once is held for one
/// `broker.block_timeout` in all, after which every one still full is closed: their timeouts
/// ran one after another, so N stuck subscriptions (one client may hold thousands) held it N
/// times as long (here 8 s instead of 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_stuck_block_subscriptions_hold_a_publisher_for_one_block_timeout() {
    const STUCK: usize = 8;
    let b = block_timeout_broker(Duration::from_secs(1)).await;
    let subscriber = b.client().await;
    let opts = stuck_block();
    let mut subs = Vec::new();
    for _ in 0..STUCK {
        subs.push(
            subscriber
                .subscribe_with("held", &opts)
                .await
                .expect("subscribe"),
        );
    }
    let publisher = b.client().await;
    for i in 0..16 {
        publisher
            .publish("held", format!("m{i}"))
            .await
            .expect("publish");
    }
    // Within one block_timeout and a wide margin for a loaded machine; eight of them in turn
    // would take 8 s.
    tokio::time::timeout(Duration::from_secs(5), publisher.flush())
        .await
        .expect("the publisher let go of within about one block_timeout")
        .expect("flushed");
    assert_eq!(b.broker.slow_consumers_disconnected(), STUCK as u64);
    drop(subs);
    close_and_stop(publisher, b).await;
}

/// A slow consumer closed while the broker's write to it was blocked gets its delivery stream
/// reset with code 300: the subscription ends with an error that carries SLOW_CONSUMER, as the
/// ERROR frame would (protocol.md 7.3). Before, it was a connection error without a code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_reset_carries_its_code() {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 16;
        c.broker.backpressure_policy = aqueduct_client::OverflowPolicy::Disconnect;
    })
    .await;
    let subscriber = b.client().await;
    let mut sub = subscriber.subscribe("slow").await.expect("subscribe");
    let publisher = b.client().await;
    // More than the client's stream window (8 MiB) while it reads nothing: the broker's write
    // blocks, the queue overflows, and the blocked stream is reset.
    let body = bytes::Bytes::from(vec![b'x'; 4096]);
    let mut n = 0;
    while b
        .stats
        .slow_consumer_resets
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(n < 10_000, "no reset after {n} messages");
        publisher
            .publish("slow", body.clone())
            .await
            .expect("publish");
        n += 1;
    }
    let end = within("the subscription's end", async {
        loop {
            match sub.next_message().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => break e,
                None => panic!("ended without an error"),
            }
        }
    })
    .await;
    assert_eq!(end.code(), Some(ErrorCode::SLOW_CONSUMER), "{end}");
    publisher
        .close()
        .await
        .expect("close: everything published was taken");
    close_and_stop(subscriber, b).await;
}

/// What `next_batch` lends: (topic, body, offset, attempt, whether it carries a trace context).
type Lent = (String, Vec<u8>, u64, u32, bool);

/// Call `next_batch` until `want` messages were lent; each call's messages, as lent.
async fn lend(sub: &mut aqueduct_client::Subscription, want: usize) -> Vec<Vec<Lent>> {
    let mut calls: Vec<Vec<Lent>> = Vec::new();
    while calls.iter().map(Vec::len).sum::<usize>() < want {
        let mut got = Vec::new();
        let n = within(
            "a batch",
            sub.next_batch(want, |m| {
                let trace = m.to_message().trace().is_some();
                let row = (
                    m.topic().to_owned(),
                    m.body().to_vec(),
                    m.offset(),
                    m.attempt(),
                    trace,
                );
                got.push(row);
            }),
        )
        .await
        .expect("subscription still open")
        .expect("messages, not an error");
        assert_eq!(n, got.len(), "next_batch counts what it lent");
        calls.push(got);
    }
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_batch_lends_deliveries_in_order_with_every_field() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client.subscribe("lend/#").await.expect("subscribe");
    let publisher = b.client().await;
    // Plain deliveries are read in place; a traced one carries an extension the in-place
    // reader leaves to the full decoder, so it is lent from an owned message, in its place.
    let traced = PublishOptions {
        trace: Some(aqueduct_client::new_trace()),
        ..confirm()
    };
    let sent = [
        ("lend/a", "one", confirm()),
        ("lend/a", "two", confirm()),
        ("lend/b", "three", traced),
        ("lend/b", "four", confirm()),
        ("lend/a", "five", confirm()),
    ];
    for (topic, body, opts) in &sent {
        publisher
            .publish_with(topic, *body, opts)
            .await
            .expect("publish");
    }
    let lent: Vec<Lent> = lend(&mut sub, sent.len()).await.concat();
    let want: Vec<Lent> = [
        ("lend/a", "one", 0, false),
        ("lend/a", "two", 1, false),
        ("lend/b", "three", 0, true),
        ("lend/b", "four", 1, false),
        ("lend/a", "five", 2, false),
    ]
    .iter()
    .map(|(t, body, offset, trace)| (t.to_string(), body.as_bytes().to_vec(), *offset, 1, *trace))
    .collect();
    assert_eq!(lent, want);

    // `max` bounds a call: ten messages already received, lent three at a time at most.
    publisher
        .publish_batch(
            (0..10u8).map(|i| ("lend/c", Bytes::from(vec![i]))),
            &confirm(),
        )
        .await
        .expect("batch");
    let mut bodies = Vec::new();
    while bodies.len() < 10 {
        let mut call = Vec::new();
        within("a batch", sub.next_batch(3, |m| call.push(m.body()[0])))
            .await
            .expect("open")
            .expect("messages");
        assert!((1..=3).contains(&call.len()), "{call:?}");
        bodies.extend(call);
    }
    assert_eq!(bodies, (0..10).collect::<Vec<u8>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_batch_returns_an_error_in_a_call_of_its_own_and_goes_on() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let opts = explicit_ack();
    let mut sub = client
        .subscribe_with("lend/err", &opts)
        .await
        .expect("subscribe");
    client
        .publish_with("lend/err", "first", &confirm())
        .await
        .expect("publish");
    let mut first = None;
    within(
        "the first message",
        sub.next_batch(8, |m| first = Some(m.to_message())),
    )
    .await
    .expect("open")
    .expect("a message");
    let first = first.expect("lent");
    assert_eq!(first.body().as_ref(), b"first");
    // Settling it twice: the broker answers the second ACK with NOT_IN_FLIGHT on this stream.
    first.ack().await.expect("ack");
    first.ack().await.expect("second ack sent");
    client
        .publish_with("lend/err", "second", &confirm())
        .await
        .expect("publish");
    // The error and the next message, in whichever order the broker wrote them: the error in
    // a call that lends nothing, and the subscription goes on after it.
    let (mut error, mut bodies) = (None, Vec::new());
    while error.is_none() || bodies.is_empty() {
        let mut call = Vec::new();
        match within(
            "an item",
            sub.next_batch(8, |m| call.push(m.body().to_vec())),
        )
        .await
        .expect("still open after an error")
        {
            Ok(n) => assert_eq!(n, call.len()),
            Err(e) => {
                assert!(call.is_empty(), "an error comes in a call of its own");
                error = e.code();
            }
        }
        bodies.extend(call);
    }
    assert_eq!(error, Some(ErrorCode::NOT_IN_FLIGHT));
    assert_eq!(bodies, vec![b"second".to_vec()]);
}

/// `Subscription::close` drains the stream until the broker finishes it; an ACK the broker
/// refused meanwhile was dropped with the rest, and close said Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_reports_an_ack_the_broker_refused() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut sub = client
        .subscribe_with("close/err", &explicit_ack())
        .await
        .expect("subscribe");
    client
        .publish_with("close/err", "only", &confirm())
        .await
        .expect("publish");
    let message = within("the message", sub.next())
        .await
        .expect("open")
        .expect("a message");
    message.ack().await.expect("ack");
    message.ack().await.expect("second ack sent");
    let err = within("close", sub.close())
        .await
        .expect_err("the second ACK was refused");
    assert_eq!(err.code(), Some(ErrorCode::NOT_IN_FLIGHT), "{err}");
    close_and_stop(client, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_message_is_settled_later_through_its_settler() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let opts = explicit_ack();
    // A wildcard subscription: an ACK or NACK must name the topic, offsets being per topic.
    let mut sub = client
        .subscribe_with("settle/#", &opts)
        .await
        .expect("subscribe");
    for topic in ["settle/a", "settle/b"] {
        client
            .publish_with(topic, topic, &confirm())
            .await
            .expect("publish");
    }
    let mut settlers = Vec::new();
    while settlers.len() < 2 {
        within(
            "lent messages",
            sub.next_batch(8, |m| {
                settlers.push((m.topic().to_owned(), m.attempt(), m.settler()))
            }),
        )
        .await
        .expect("open")
        .expect("messages");
    }
    let topics: Vec<(&str, u32)> = settlers.iter().map(|(t, a, _)| (t.as_str(), *a)).collect();
    assert_eq!(topics, vec![("settle/a", 1), ("settle/b", 1)]);
    settlers[0].2.ack().await.expect("ack");
    settlers[1].2.nack(Some("again")).await.expect("nack");
    // The NACK redelivers settle/b, as attempt 2.
    let mut again = Vec::new();
    within(
        "the redelivery",
        sub.next_batch(8, |m| {
            again.push((m.topic().to_owned(), m.attempt(), m.settler()))
        }),
    )
    .await
    .expect("open")
    .expect("a message");
    assert_eq!(
        again
            .iter()
            .map(|(t, a, _)| (t.as_str(), *a))
            .collect::<Vec<_>>(),
        vec![("settle/b", 2)]
    );
    again[0].2.ack().await.expect("ack");
    // settle/a was settled by the first ACK: a second one is refused as not in flight.
    settlers[0].2.ack().await.expect("second ack sent");
    let r = within("the refusal", sub.next_batch(8, |_| {}))
        .await
        .expect("open");
    assert_eq!(
        r.expect_err("an error").code(),
        Some(ErrorCode::NOT_IN_FLIGHT)
    );
}

/// A delivery to an idle subscriber stream is written by the publishing stream task itself
/// (the broker's stream/direct.rs), one task hand-over fewer; a batch frame's backlog is left
/// to the stream's own writer. Every message arrives, in order, either way, also in a burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_to_an_idle_stream_are_written_directly_and_in_order() {
    use std::sync::atomic::Ordering;
    let b = TestBroker::start().await;
    let sub_client = b.client().await;
    let mut sub = sub_client.subscribe("direct/t").await.expect("subscribe");
    let publisher = b.client().await;
    // One at a time: the subscriber's stream is idle whenever one arrives (its writer parks
    // its sending half before the previous delivery even leaves the broker).
    for i in 0..20u32 {
        publisher
            .publish("direct/t", i.to_string())
            .await
            .expect("publish");
        assert_eq!(
            next(&mut sub).await.body().as_ref(),
            i.to_string().as_bytes()
        );
    }
    let direct = b.stats.direct_writes.load(Ordering::Relaxed);
    assert_eq!(
        direct, 20,
        "each delivery to the idle stream written directly"
    );
    // A batch frame leaves a backlog: its stream's writer writes it (so that, under load, the
    // drains of many streams run on their own tasks), not the publishing task.
    let batch: Vec<(&str, Bytes)> = (0..100)
        .map(|i| ("direct/t", Bytes::from(format!("batch {i}"))))
        .collect();
    publisher
        .publish_batch(batch, &PublishOptions::default())
        .await
        .expect("batch");
    for i in 0..100 {
        assert_eq!(
            next(&mut sub).await.body().as_ref(),
            format!("batch {i}").as_bytes()
        );
    }
    assert_eq!(
        b.stats.direct_writes.load(Ordering::Relaxed),
        20,
        "the batch went to the writer"
    );
    // A fan-out to six idle streams: four are written directly, the other two by their own
    // writers (so that a wide fan-out is written in parallel); all get it.
    let mut fan = Vec::new();
    for _ in 0..6 {
        fan.push(sub_client.subscribe("direct/fan").await.expect("subscribe"));
    }
    publisher
        .publish("direct/fan", "all")
        .await
        .expect("publish");
    for s in &mut fan {
        assert_eq!(next(s).await.body().as_ref(), b"all");
    }
    assert_eq!(
        b.stats.direct_writes.load(Ordering::Relaxed),
        24,
        "four of six direct"
    );
    // A burst, published without waiting: in order too.
    for i in 20..2020u32 {
        publisher
            .publish("direct/t", i.to_string())
            .await
            .expect("publish");
    }
    for i in 20..2020u32 {
        assert_eq!(
            next(&mut sub).await.body().as_ref(),
            i.to_string().as_bytes()
        );
    }
    b.stop().await.expect("clean shutdown");
}

/// The seed's `-addr :PORT` form serves every interface, IPv6 and IPv4, as Go's listeners do:
/// the QUIC port and the metrics port bind `[::]` dual stack (where the host has IPv6), and an
/// IPv4 client reaches both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_go_style_port_only_address_serves_ipv6_and_ipv4() {
    let seed_style = aqueduct_server::Config::load(&aqueduct_server::Sources {
        overrides: aqueduct_server::Overrides {
            listen_addr: Some(":0".into()),
            metrics_addr: Some(":0".into()),
            ..Default::default()
        },
        ..Default::default()
    })
    .expect(":0 is an address");
    let b = TestBroker::start_with(|c| {
        c.listen_addr = seed_style.listen_addr;
        c.metrics_addr = seed_style.metrics_addr;
    })
    .await;
    let host_has_ipv6 = std::net::UdpSocket::bind("[::1]:0").is_ok();
    if host_has_ipv6 {
        assert!(
            b.addr.is_ipv6() && b.addr.ip().is_unspecified(),
            "{}",
            b.addr
        );
        assert!(b.metrics_addr.is_ipv6(), "{}", b.metrics_addr);
    } else {
        assert!(b.addr.ip().is_unspecified(), "{}", b.addr);
    }
    let v4 = |a: std::net::SocketAddr| std::net::SocketAddr::from(([127, 0, 0, 1], a.port()));
    let options =
        aqueduct_client::ConnectOptions::new(v4(b.addr).to_string()).dev_cert_file(&b.dev_cert);
    let client = within("IPv4 connect", aqueduct_client::Client::connect(options))
        .await
        .expect("an IPv4 client reaches a ':PORT' broker");
    let mut sub = client.subscribe("dual.stack").await.expect("subscribe");
    client
        .publish_with("dual.stack", Bytes::from_static(b"v4"), &confirm())
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"v4");
    let (status, _) = get(v4(b.metrics_addr), "/healthz").await;
    assert_eq!(status, 200);
    client
        .close()
        .await
        .expect("close: everything published was taken");
    b.stop().await.expect("stop");
}

/// Each end asks the other for fewer ACKs (the QUIC ACK-frequency extension: every tenth packet
/// or within 1 ms, by default), and neither asks with a threshold of 1
/// (`transport.ack_eliciting_threshold`, `ConnectOptions::ack_eliciting_threshold`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ends_ask_for_fewer_acks_unless_told_not_to() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    client
        .publish_with("acks", "one", &confirm())
        .await
        .expect("confirmed");
    until("an ACK_FREQUENCY frame each way", || {
        let s = client.quic_stats();
        s.ack_frequency_received >= 1 && s.ack_frequency_sent >= 1
    })
    .await;

    let off = TestBroker::start_with(|c| c.transport.ack_eliciting_threshold = 1).await;
    let client = within(
        "client connect",
        aqueduct_client::Client::connect(off.options().ack_eliciting_threshold(1)),
    )
    .await
    .expect("client connects");
    // A round trip: an end that asks does so in its first packets after the handshake, before
    // any reply.
    client
        .publish_with("acks", "one", &confirm())
        .await
        .expect("confirmed");
    let s = client.quic_stats();
    assert_eq!(s.ack_frequency_received, 0, "the broker asked: {s:?}");
    assert_eq!(s.ack_frequency_sent, 0, "the client asked: {s:?}");
    b.stop().await.expect("clean shutdown");
    off.stop().await.expect("clean shutdown");
}

/// On loopback, path-MTU discovery takes the broker's datagrams to a client up to 6500 bytes of
/// UDP payload (`transport.max_mtu`; the client's endpoint accepts `ConnectOptions::max_mtu`),
/// so a packet carries several messages where 1452 bytes carried one or two, and they stay that
/// large under a bulk transfer: at the largest size quinn's segmentation-offload sends (ten
/// datagrams in one) still fit a UDP datagram (beyond it they all failed, and the losses sent
/// discovery back to 1200). A broker with `max_mtu` 1452 keeps its clients' datagrams at 1452.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_grow_to_the_largest_mtu_the_path_and_both_ends_allow() {
    const MESSAGES: usize = 4_000;
    const SIZE: usize = 1_000;
    let b = TestBroker::start().await;
    let publisher = b.client().await;
    let subscriber = b.client().await;
    let mut sub = subscriber.subscribe("mtu").await.expect("subscribe");
    let body = Bytes::from(vec![7u8; SIZE]);
    // Until the broker's discovery is done: 100 KB in fewer than 40 datagrams (at 1452 bytes
    // it takes over 70).
    within("path MTU discovery", async {
        loop {
            let before = subscriber.quic_stats().datagrams_received;
            for _ in 0..100 {
                publisher
                    .publish("mtu", body.clone())
                    .await
                    .expect("queued");
            }
            publisher.flush().await.expect("flushed");
            for _ in 0..100 {
                next(&mut sub).await;
            }
            if subscriber.quic_stats().datagrams_received - before < 40 {
                break;
            }
        }
    })
    .await;
    let before = subscriber.quic_stats().datagrams_received;
    for _ in 0..MESSAGES - 1 {
        publisher
            .publish("mtu", body.clone())
            .await
            .expect("queued");
    }
    publisher
        .publish_with("mtu", body.clone(), &confirm())
        .await
        .expect("confirmed");
    for _ in 0..MESSAGES {
        assert_eq!(next(&mut sub).await.body().len(), SIZE);
    }
    let s = subscriber.quic_stats();
    assert_eq!(s.black_holes, 0, "{s:?}");
    // 4 MB in datagrams of at most 1452 bytes would be over 2,700 of them; a black hole
    // (the broker's datagrams back at 1200) as many.
    let received = s.datagrams_received - before;
    assert!(
        received < 1_500,
        "{received} datagrams for {MESSAGES} x {SIZE} bytes"
    );
    assert_eq!(
        publisher.quic_stats().path_mtu,
        1452,
        "the client does not probe"
    );

    let small = TestBroker::start_with(|c| c.transport.max_mtu = 1452).await;
    let client = small.client().await;
    let mut sub = client.subscribe("mtu").await.expect("subscribe");
    let before = client.quic_stats().datagrams_received;
    for _ in 0..100 {
        client.publish("mtu", body.clone()).await.expect("queued");
    }
    client.flush().await.expect("flushed");
    for _ in 0..100 {
        next(&mut sub).await;
    }
    let received = client.quic_stats().datagrams_received - before;
    assert!(
        received >= 70,
        "{received} datagrams for 100 KB: the broker's limit is 1452"
    );
    b.stop().await.expect("clean shutdown");
    small.stop().await.expect("clean shutdown");
}

/// A broker whose `block` queues hold 4 messages and whose `block_timeout` is 1 s, with a
/// member of group `g` on `jobs` that takes one job, never settles it, and has 4 more queued
/// behind it: full, and holding no publisher. Returns the broker, the member's client and
/// subscription, and a publisher.
async fn stalled_block_member() -> (
    TestBroker,
    aqueduct_client::Client,
    aqueduct_client::Subscription,
    aqueduct_client::Client,
) {
    let b = TestBroker::start_with(|c| {
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.broker.queue_size = 4;
        c.block_timeout = Some(Duration::from_secs(1));
    })
    .await;
    let stalled = b.client().await;
    let mut stuck = stalled
        .subscribe_with("jobs", &group_member())
        .await
        .expect("subscribed");
    let publisher = b.client().await;
    publisher
        .publish_with("jobs", "job 0", &confirm())
        .await
        .expect("published");
    within("the stalled member's one job", stuck.next_message())
        .await
        .expect("open")
        .expect("a job");
    // Its writer is at its in-flight limit: these stay queued, the last one filling the queue
    // without holding the publisher (it found room).
    for i in 1..5 {
        publisher
            .publish_with("jobs", format!("job {i}"), &confirm())
            .await
            .expect("published");
    }
    (b, stalled, stuck, publisher)
}

/// Wait until [`stalled_block_member`]'s member is closed as a slow consumer, then end.
async fn closed_as_slow(
    b: TestBroker,
    stalled: aqueduct_client::Client,
    stuck: aqueduct_client::Subscription,
    publisher: aqueduct_client::Client,
) {
    until("the stalled member to be closed", || {
        b.broker.slow_consumers_disconnected() >= 1
    })
    .await;
    drop(stuck);
    stalled.close().await.expect("closed");
    close_and_stop(publisher, b).await;
}

/// A member of group `g`, settling explicitly, one unsettled job at a time.
fn group_member() -> SubscribeOptions {
    SubscribeOptions {
        group: Some("g".into()),
        max_in_flight: Some(1),
        ..explicit_ack()
    }
}

/// A `block` group member that does not read, filled past its bound by a member that takes a
/// job and leaves without settling it: once it has stayed full for `broker.block_timeout`, it
/// is closed as a slow consumer, as a held publisher would close it. What a departing member
/// hands over holds no publisher, and nothing watched the queue: members coming and going grew
/// it without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departing_group_members_cannot_grow_a_stalled_block_member_for_good() {
    let (b, stalled, stuck, publisher) = stalled_block_member().await;
    // A member joins, takes the next job and leaves without settling it: its job goes back to
    // the group, whose only other member is full (a redelivery).
    let leaving = b.client().await;
    let mut taken = leaving
        .subscribe_with("jobs", &group_member())
        .await
        .expect("subscribed");
    publisher
        .publish_with("jobs", "job 5", &confirm())
        .await
        .expect("published");
    let job = within("the new member's job", taken.next_message())
        .await
        .expect("open")
        .expect("a job");
    assert_eq!(&job.body()[..], b"job 5");
    drop(taken);
    leaving.close().await.expect("left");
    closed_as_slow(b, stalled, stuck, publisher).await;
}

/// The same with jobs still queued for the departing member (its client stopped reading):
/// those are handed over as its connection ends, which holds nothing back, and the connection's
/// end hands the full member to the watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departing_members_queued_jobs_cannot_grow_a_stalled_block_member_for_good() {
    let (b, stalled, stuck, publisher) = stalled_block_member().await;
    // A member whose client reads nothing: 4 KiB on the stream, then its jobs queue.
    let before = b.broker.subscriber_count();
    let leaving = Raw::connect(&b, 4096).await;
    let mut stream = leaving.stream().await;
    stream
        .write(&raw_frame(0x42, 77, b"\x00\x00topic:jobs:group:g"))
        .await;
    until("the departing member", || {
        b.broker.subscriber_count() == before + 1
    })
    .await;
    let member = b
        .broker
        .subscribers()
        .into_iter()
        .find(|s| s.stream_id() == 77)
        .expect("the departing member");
    let body = Bytes::from(vec![7u8; 512]);
    let mut sent = 0;
    while member.queued() == 0 {
        assert!(sent < 64, "nothing queued after {sent} jobs");
        publisher
            .publish_with("jobs", body.clone(), &confirm())
            .await
            .expect("published");
        sent += 1;
    }
    assert_eq!(b.broker.slow_consumers_disconnected(), 0);
    leaving.conn.close(0u32.into(), b"gone");
    closed_as_slow(b, stalled, stuck, publisher).await;
}

/// Dead letters the ack-wait timer makes into a block-policy subscription that does not read:
/// once it has stayed full for `broker.block_timeout`, it is closed as a slow consumer, as a
/// held publisher would close it. The timer holds no source it could stop reading, and forgot
/// that the queue was full: it grew without bound for as long as messages kept timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_the_ack_timer_cannot_grow_a_stalled_block_queue_for_good() {
    let b = TestBroker::start_with(|c| {
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.broker.queue_size = 4;
        c.broker.max_retries = 0;
        c.broker.ack_wait = Duration::from_millis(200);
        c.block_timeout = Some(Duration::from_secs(1));
    })
    .await;
    // A dead-letter reader that stops reading (a small stream window, never read).
    let before = b.broker.subscriber_count();
    let stalled = Raw::connect(&b, 4096).await;
    let mut dlq = stalled.stream().await;
    dlq.write(&raw_frame(0x42, 1, b"\x00\x00topic:__dlq__jobs"))
        .await;
    until("the dead-letter subscription", || {
        b.broker.subscriber_count() == before + 1
    })
    .await;
    // A worker that takes jobs and never acknowledges them: each times out into a dead letter.
    let worker = b.client().await;
    let mut jobs = worker
        .subscribe_with("jobs", &explicit_ack())
        .await
        .expect("subscribed");
    let publisher = b.client().await;
    // More than the stalled writer takes into its own buffer (64 KiB) and the queue's 4.
    let batch: Vec<(&str, Bytes)> = (0..100)
        .map(|_| ("jobs", Bytes::from(vec![7u8; 512])))
        .collect();
    for _ in 0..4 {
        publisher
            .publish_batch(batch.clone(), &confirm())
            .await
            .expect("published");
    }
    for _ in 0..400 {
        within("a job", jobs.next_message())
            .await
            .expect("open")
            .expect("a job");
    }
    until("the stalled dead-letter queue to be closed", || {
        b.broker.slow_consumers_disconnected() >= 1
    })
    .await;
    stalled.forget();
    drop(jobs);
    close_and_stop(publisher, b).await;
}

/// Subscriptions the application does not read hold back only themselves. The client's
/// connection window was 32 MiB against 8 MiB per stream, so four unread subscriptions on a
/// busy topic stopped every other stream of the connection: deliveries and CONFIRMs.
#[tokio::test]
async fn unread_subscriptions_do_not_stop_the_connections_other_streams() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut unread = Vec::new();
    for _ in 0..5 {
        unread.push(
            within("subscribe", client.subscribe("big"))
                .await
                .expect("subscribe"),
        );
    }
    let mut read = within("subscribe", client.subscribe("small"))
        .await
        .expect("subscribe");
    let publisher = b.client().await;
    let body = Bytes::from(vec![0x42; 60 << 10]);
    // 12 MB for each subscription: more than its stream's 8 MiB window.
    for _ in 0..200 {
        within("publish", publisher.publish("big", body.clone()))
            .await
            .expect("publish");
    }
    within("flush", publisher.flush()).await.expect("flush");
    // Five full windows: past the 32 MiB that stopped the connection.
    until("the unread subscriptions' windows to fill", || {
        client.quic_stats().bytes_received >= 36 << 20
    })
    .await;
    within("publish", publisher.publish("small", "still here"))
        .await
        .expect("publish");
    within("flush", publisher.flush()).await.expect("flush");
    assert_eq!(next(&mut read).await.body(), &b"still here"[..]);
    // Its own publish stream's answers get through too.
    within(
        "a confirmed publish",
        client.publish_with("small", "mine", &confirm()),
    )
    .await
    .expect("confirmed");
    assert_eq!(next(&mut read).await.body(), &b"mine"[..]);
    drop(unread);
    close_and_stop(client, b).await;
}
