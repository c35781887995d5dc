//! End to end: how subscriptions and streams end (FIN, STOP_SENDING, connection loss, shutdown),
//! the order of a SUBSCRIBE's CONFIRM and its deliveries, and the per-connection limits.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use aqueduct_client::{ClientError, ErrorCode, OverflowPolicy, PublishOptions};
use aqueduct_proto::frame::Message;
use common::*;

/// A raw SUBSCRIBE with an (empty) extension block: Aqueduct's delivery form.
fn subscribe_frame(stream_id: u32, spec: &str) -> Vec<u8> {
    let mut data = vec![0, 0];
    data.extend_from_slice(spec.as_bytes());
    raw_frame(0x42, stream_id, &data)
}

/// A raw subscriber (SUBSCRIBE with stream id 1) whose stream window is 4 KiB and who reads
/// nothing: the broker's writes to it soon block on flow control. Returns once it is
/// registered.
async fn stalled_subscriber(b: &TestBroker, spec: &str) -> (Raw, RawStream) {
    let raw = Raw::connect(b, 4096).await;
    let mut s = raw.stream().await;
    s.write(&subscribe_frame(1, spec)).await;
    until("the subscription", || b.broker.subscriber_count() == 1).await;
    (raw, s)
}

/// Two raw group members of `jobs`; returns the connection and both streams.
async fn two_members(b: &TestBroker) -> (Raw, RawStream, RawStream) {
    let raw = Raw::connect(b, 1 << 20).await;
    let mut first = raw.stream().await;
    first.write(&subscribe_frame(1, "topic:jobs:group:w")).await;
    let mut second = raw.stream().await;
    second
        .write(&subscribe_frame(2, "topic:jobs:group:w"))
        .await;
    until("both members", || b.broker.subscriber_count() == 2).await;
    (raw, first, second)
}

/// After one member closed its stream (however), every job goes to the other one.
async fn the_other_member_gets_every_job(b: &TestBroker, member: &mut RawStream) {
    let publisher = b.client().await;
    for i in 0..10 {
        publisher
            .publish("jobs", format!("job {i}"))
            .await
            .expect("publish");
    }
    for _ in 0..10 {
        let frame = member.read_frame().await.expect("a job");
        assert!(matches!(frame.message, Message::Publish(_)), "{frame:?}");
        assert_eq!(frame.stream_id, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_member_that_finishes_its_stream_leaves_the_group() {
    let b = TestBroker::start().await;
    let (_raw, mut first, mut second) = two_members(&b).await;
    first.finish();
    until("the member to leave", || b.broker.subscriber_count() == 1).await;
    the_other_member_gets_every_job(&b, &mut second).await;
    assert!(
        first.read_frame().await.is_none(),
        "the broker finishes the stream"
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_member_that_stops_reading_leaves_the_group() {
    let b = TestBroker::start().await;
    let (_raw, mut first, mut second) = two_members(&b).await;
    first.stop_reading();
    // It may still settle what it has, so it stays registered; but it gets nothing more.
    until("the broker to see STOP_SENDING", || {
        b.stats.streams_stopped.load(Ordering::Relaxed) == 1
    })
    .await;
    the_other_member_gets_every_job(&b, &mut second).await;
    // Its stream's end (here, the client finishing its side) ends the subscription.
    first.finish();
    until("the member to be gone", || b.broker.subscriber_count() == 1).await;
    b.stop().await.expect("clean shutdown");
}

/// No stream task outlives its connection, and the connection's subscriptions end with it,
/// whether the client closes the connection or simply disappears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_tasks_and_subscriptions_end_with_the_connection() {
    let b = TestBroker::start_with(|c| {
        c.transport.idle_timeout = Duration::from_secs(1);
        c.transport.keep_alive_interval = Duration::ZERO;
    })
    .await;
    let live = || b.stats.live_streams.load(Ordering::Relaxed);
    for vanish in [false, true] {
        let raw = Raw::connect(&b, 1 << 20).await;
        let mut streams = Vec::new();
        for id in 1..=3 {
            let mut s = raw.stream().await;
            s.write(&subscribe_frame(id, &format!("topic:t/{id}")))
                .await;
            streams.push(s);
        }
        until("three subscriptions", || b.broker.subscriber_count() == 3).await;
        assert_eq!(live(), 3);
        if vanish {
            // No CONNECTION_CLOSE: the broker notices at its idle timeout.
            drop(streams);
            raw.forget();
        } else {
            raw.conn.close(0u32.into(), b"bye");
        }
        until("every stream task to end", || live() == 0).await;
        assert_eq!(b.broker.subscriber_count(), 0);
        // A connection closed is not the client stopping its streams (STOP_SENDING). (The
        // vanishing client's dropped streams do send STOP_SENDING.)
        if !vanish {
            assert_eq!(b.stats.streams_stopped.load(Ordering::Relaxed), 0);
        }
    }
    b.stop().await.expect("clean shutdown");
}

/// A subscription becomes routable before its CONFIRM is sent, and no delivery is written
/// before the CONFIRM: under a flood of publishes, every `subscribe` sees its CONFIRM first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_confirm_of_a_subscribe_precedes_its_deliveries() {
    let b = TestBroker::start().await;
    let publisher = b.client().await;
    // Until the end of the test (a fixed count could run out before the last subscribe).
    let flood = tokio::spawn(async move {
        for i in 0u64.. {
            if publisher.publish("flood", i.to_string()).await.is_err() {
                break;
            }
        }
    });
    let client = b.client().await;
    for _ in 0..50 {
        let mut sub = client.subscribe("flood").await.expect("CONFIRM came first");
        next(&mut sub).await;
    }
    flood.abort();
    b.stop().await.expect("clean shutdown");
}

/// Two SUBSCRIBEs with one stream id, sent at the same moment on two streams: exactly one is
/// confirmed, the other is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_subscribes_with_one_id_cannot_both_succeed() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut keep = Vec::new();
    for id in 1..=20u32 {
        let mut x = raw.stream().await;
        let mut y = raw.stream().await;
        // CONFIRM requested (extension 0x08 CONFIRM, empty).
        let mut data = vec![2, 0, 0x08, 0];
        data.extend_from_slice(b"topic:race");
        let frame = raw_frame(0x42, id, &data);
        tokio::join!(x.write(&frame), y.write(&frame));
        let (rx, ry) = tokio::join!(x.read_frame(), y.read_frame());
        let kinds = [rx.expect("reply"), ry.expect("reply")].map(|f| match f.message {
            Message::Confirm(_) => "confirm",
            Message::Error(e) if e.code == ErrorCode::BAD_SUBSCRIBE => "refused",
            other => panic!("unexpected {other:?}"),
        });
        let mut sorted = kinds;
        sorted.sort();
        assert_eq!(sorted, ["confirm", "refused"], "id {id}");
        keep.push((x, y));
    }
    assert_eq!(b.broker.subscriber_count(), 20);
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_per_connection_are_limited() {
    let b = TestBroker::start_with(|c| c.transport.max_subscriptions_per_connection = 3).await;
    let client = b.client().await;
    let mut subs = Vec::new();
    for i in 0..3 {
        subs.push(
            client
                .subscribe(&format!("s/{i}"))
                .await
                .expect("within the limit"),
        );
    }
    let err = client.subscribe("s/3").await.expect_err("over the limit");
    assert_eq!(err.code(), Some(ErrorCode::BAD_SUBSCRIBE), "{err}");
    assert!(
        err.to_string().contains("max_subscriptions_per_connection"),
        "{err}"
    );
    assert_eq!(b.stats.subscriptions_refused.load(Ordering::Relaxed), 1);
    // Another connection has its own budget; a freed slot can be reused.
    let other = b.client().await;
    let _other_sub = other.subscribe("s/3").await.expect("other connection");
    subs.pop()
        .expect("one")
        .unsubscribe()
        .await
        .expect("unsubscribe");
    until("the slot to be freed", || b.broker.subscriber_count() == 3).await;
    client.subscribe("s/4").await.expect("a freed slot");
    b.stop().await.expect("clean shutdown");
}

/// A broker that shuts down while a publisher's frames are still unread (here: held by a full
/// `block` queue) must not tell the publisher they were all handled: its flush fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_fails_when_the_broker_stops_before_reading_everything() {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 16;
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.block_timeout = None;
    })
    .await;
    // A subscriber that never reads: the publisher is held once its queue is full.
    let (_stalled, s) = stalled_subscriber(&b, "topic:held").await;
    let publisher = b.client().await;
    let body = "x".repeat(200);
    let opts = PublishOptions::default();
    for _ in 0..2000 {
        publisher
            .publish_with("held", body.clone(), &opts)
            .await
            .expect("publish (not confirmed)");
    }
    until("the publisher to be held", || {
        b.stats.publish_holds.load(Ordering::Relaxed) >= 1
    })
    .await;
    // A first flush given up on (its caller's timeout) while the publisher is held: what the
    // stream's end says must not be lost with it.
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(100), publisher.flush())
            .await
            .is_err(),
        "still held"
    );
    let stopping = tokio::spawn(b.stop());
    let err = within("the flush", publisher.flush())
        .await
        .expect_err("the broker did not read everything");
    shut_down_with(err, stopping).await;
    drop(s);
}

/// A connection starts with a small stream allowance that the broker raises as streams are
/// used: one client can still hold far more subscriptions (one stream each) than the initial 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_allowance_grows_with_use() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let mut subs = Vec::new();
    for i in 0..100 {
        let sub = within("a subscription", client.subscribe(&format!("many/{i}")))
            .await
            .expect("subscribe");
        subs.push(sub);
    }
    let publisher = b.client().await;
    for i in 0..100 {
        publisher
            .publish(&format!("many/{i}"), "x")
            .await
            .expect("publish");
    }
    for (i, sub) in subs.iter_mut().enumerate() {
        assert_eq!(next(sub).await.topic().as_str(), format!("many/{i}"));
    }
    assert_eq!(b.stats.live_streams.load(Ordering::Relaxed), 101);
    b.stop().await.expect("clean shutdown");
}

/// A plain subscription whose client finishes its stream gets nothing new, ends, and its
/// stream is finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_subscription_ends_when_its_client_finishes_the_stream() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&subscribe_frame(1, "topic:news")).await;
    until("the subscription", || b.broker.subscriber_count() == 1).await;
    let publisher = b.client().await;
    publisher.publish("news", "before").await.expect("publish");
    let frame = s.read_frame().await.expect("a delivery");
    assert!(matches!(frame.message, Message::Publish(_)));
    s.finish();
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    publisher.publish("news", "after").await.expect("publish");
    assert!(
        s.read_frame().await.is_none(),
        "finished, nothing after the FIN"
    );
    b.stop().await.expect("clean shutdown");
}

/// A delivery written straight into an idle stream by the publishing task (the broker's
/// stream/direct.rs) that flow control holds back in part: the stream's writer sends the rest
/// first, then what came after, once the subscriber reads. Nothing is lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_write_held_by_flow_control_is_finished_by_the_writer_in_order() {
    let b = TestBroker::start().await;
    let (_slow, mut s) = stalled_subscriber(&b, "topic:held").await;
    let publisher = b.client().await;
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    // 100 × ~300 bytes against a 4 KiB stream window the client does not read yet: the first
    // go out directly, one is cut short by flow control, and the rest wait for the writer.
    let body = |i: u32| format!("{i:04}-{}", "x".repeat(290));
    for i in 0..100 {
        publisher
            .publish_with("held", body(i), &confirm)
            .await
            .expect("routed");
    }
    assert!(
        b.stats.direct_writes.load(Ordering::Relaxed) >= 1,
        "the first deliveries were written directly"
    );
    let mut got = Vec::new();
    while got.len() < 100 {
        match s.read_frame().await.expect("a frame").message {
            Message::Publish(p) => got.push(String::from_utf8(p.body.to_vec()).expect("utf-8")),
            Message::Confirm(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, (0..100).map(body).collect::<Vec<_>>());
    b.stop().await.expect("clean shutdown");
}

/// A client that resets its sending side of a stream ends the stream's subscriptions at once
/// (`docs/protocol.md` §1.1, §7.4), also while the broker is blocked writing deliveries the
/// client does not read: the blocked write is abandoned. Before, the writer waited on the
/// write for as long as the connection lived, and the subscription stayed routable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_ends_the_subscriptions_of_a_stream_whose_write_is_blocked() {
    let b = TestBroker::start().await;
    let (stalled, mut s) = stalled_subscriber(&b, "topic:jobs").await;
    let publisher = b.client().await;
    block_a_write(&b.broker, &publisher, "jobs").await;
    s.send.reset(0u32.into()).expect("reset");
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    assert!(
        stalled.conn.close_reason().is_none(),
        "the connection goes on"
    );
    close_and_stop(publisher, b).await;
}

/// A reset ends a stream's subscriptions at once also while the broker is not reading the
/// stream (§1.1): here its client left over 1 MiB of replies unread, so the reader waits for
/// the writer, which waits for the client. Before, the reset was only seen by the next read,
/// which never came: the subscription stayed routable for as long as the connection lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_ends_the_subscriptions_of_a_stream_that_is_not_being_read() {
    let b = TestBroker::start().await;
    let (stalled, mut s) = stalled_subscriber(&b, "topic:jobs").await;
    // Frames each answered with an ERROR (reserved opcode): ~3 MB of replies the client does
    // not read, while the frames fit the stream's receive window (4 MiB).
    let noise: Vec<u8> = (0..100_000).flat_map(|_| raw_frame(0x3F, 7, b"")).collect();
    s.write(&noise).await;
    until("the reader to be held", || {
        b.stats.reads_held.load(Ordering::Relaxed) >= 1
    })
    .await;
    s.send.reset(0u32.into()).expect("reset");
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    assert!(
        stalled.conn.close_reason().is_none(),
        "the connection goes on"
    );
    b.stop().await.expect("clean shutdown");
}

/// The same while a publish frame of the stream waits for room in a full `block` queue: the
/// stream's own subscriptions end at once when the client resets it, not at
/// `broker.block_timeout` (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_ends_the_subscriptions_of_a_stream_held_by_a_full_block_queue() {
    let b = TestBroker::start_with(|c| {
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.broker.queue_size = 4;
    })
    .await;
    // A subscriber of `jobs` that reads nothing: its queue fills.
    let stalled = Raw::connect(&b, 4096).await;
    let mut jobs = stalled.stream().await;
    jobs.write(&subscribe_frame(1, "topic:jobs")).await;
    // A stream that subscribes to `mine` and publishes to `jobs`.
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&subscribe_frame(2, "topic:mine")).await;
    until("both subscriptions", || b.broker.subscriber_count() == 2).await;
    let body = bytes::Bytes::from(vec![b'x'; 1000]);
    for _ in 0..40 {
        let publish = aqueduct_proto::Frame::new(
            3,
            Message::Publish(aqueduct_proto::Publish::new(
                aqueduct_proto::TopicName::try_from("jobs").expect("topic"),
                body.clone(),
            )),
        );
        s.write_frame(&publish).await;
    }
    until("the publishing stream to be held", || {
        b.stats.publish_holds.load(Ordering::Relaxed) >= 1
    })
    .await;
    s.send.reset(0u32.into()).expect("reset");
    until("the resetting stream's subscription to end", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    stalled.conn.close(0u32.into(), b"bye");
    b.stop().await.expect("clean shutdown");
}

/// A publisher held by a full `block` queue that resets its stream and comes back on a new one
/// puts one more frame past the queue's capacity each time. Before, nothing bounded that (the
/// hold, and its `block_timeout`, went with the reset stream): the queue grew for as long as
/// the publisher kept doing it. Now, once `MAX_ORPHANED_HOLDS` publishers have left while
/// held, the subscription is closed as a slow consumer (`block_timeout` is far away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_that_reset_while_held_cannot_grow_a_block_queue_without_end() {
    let b = TestBroker::start_with(|c| {
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.broker.queue_size = 4;
        c.block_timeout = Some(Duration::from_secs(600));
    })
    .await;
    // A subscriber of `jobs` that reads nothing: its queue fills.
    let stalled = Raw::connect(&b, 4096).await;
    let mut jobs = stalled.stream().await;
    jobs.write(&subscribe_frame(1, "topic:jobs")).await;
    until("the subscription", || b.broker.subscriber_count() == 1).await;
    let publisher = Raw::connect(&b, 1 << 20).await;
    let publish = aqueduct_proto::Frame::new(
        0,
        Message::Publish(aqueduct_proto::Publish::new(
            aqueduct_proto::TopicName::try_from("jobs").expect("topic"),
            bytes::Bytes::from(vec![b'x'; 1000]),
        )),
    );
    let limit = aqueduct_core::subscriber::MAX_ORPHANED_HOLDS as usize;
    let mut rounds = 0;
    while b.broker.subscriber_count() == 1 {
        assert!(
            rounds < 4 * limit,
            "{rounds} publishers left while held and the queue still takes more"
        );
        let holds = b.stats.publish_holds.load(Ordering::Relaxed);
        let mut s = publisher.stream().await;
        // The first stream fills the queue; later ones find it full at once.
        for _ in 0..if rounds == 0 { 40 } else { 1 } {
            s.write_frame(&publish).await;
        }
        until("the stream to be held, or the subscription closed", || {
            b.stats.publish_holds.load(Ordering::Relaxed) > holds
                || b.broker.subscriber_count() == 0
        })
        .await;
        s.send.reset(0u32.into()).expect("reset");
        rounds += 1;
    }
    assert!(
        rounds > limit,
        "closed after {rounds} rounds, before the limit"
    );
    assert_eq!(b.broker.slow_consumers_disconnected(), 1);
    stalled.conn.close(0u32.into(), b"bye");
    b.stop().await.expect("clean shutdown");
}

/// After STOP_SENDING the broker goes on reading the stream (§1.1): the replies it can no
/// longer send are dropped, not queued. Before, they piled up until the reader's backpressure
/// (1 MiB of unsent replies) stopped reading the stream, and what the client sent after that
/// was never handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_replies_cannot_be_sent_is_still_read() {
    let b = TestBroker::start().await;
    let watcher = b.client().await;
    let mut sub = watcher.subscribe("after/stop").await.expect("subscribe");
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.stop_reading();
    // Frames each answered with an ERROR (reserved opcode: UNKNOWN_OPCODE, skipped): well over
    // 1 MiB of replies.
    let noise: Vec<u8> = (0..60_000).flat_map(|_| raw_frame(0x3F, 7, b"")).collect();
    s.write(&noise).await;
    let publish = aqueduct_proto::Frame::new(
        7,
        Message::Publish(aqueduct_proto::Publish::new(
            aqueduct_proto::TopicName::try_from("after/stop").expect("topic"),
            bytes::Bytes::from_static(b"still read"),
        )),
    );
    s.write_frame(&publish).await;
    let got = next(&mut sub).await;
    assert_eq!(&got.body()[..], b"still read");
    raw.forget();
    close_and_stop(watcher, b).await;
}

/// A SUBSCRIBE on a stream the client stopped reading registers nothing (§7.4): nothing could
/// be delivered or answered there. Its stream id stays free for a SUBSCRIBE on another stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_on_a_stream_the_client_stopped_reading_registers_nothing() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut stopped = raw.stream().await;
    // Something on the stream first (the broker's side of it exists), then the stop.
    stopped.write(&raw_frame(0x3F, 9, b"")).await;
    stopped.stop_reading();
    until("the broker saw the stop", || {
        b.stats.streams_stopped.load(Ordering::Relaxed) >= 1
    })
    .await;
    stopped.write(&subscribe_frame(9, "topic:ignored")).await;
    until("the SUBSCRIBE counted as rejected", || {
        b.stats
            .rejected_frames()
            .get("subscribe_on_closed_stream")
            .is_some_and(|n| *n >= 1)
    })
    .await;
    assert_eq!(b.broker.subscriber_count(), 0);
    let mut other = raw.stream().await;
    other.write(&subscribe_frame(9, "topic:taken")).await;
    until("the same id on another stream", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    raw.forget();
    b.stop().await.expect("clean shutdown");
}

/// `Client::closed` says when and why the connection ended: the broker's shutdown (its code in
/// the error), or this client's own close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_says_why_the_connection_ended() {
    let b = TestBroker::start().await;
    let client = b.client().await;
    let own = b.client().await;
    let waiting = tokio::spawn({
        let own = own.clone();
        async move { own.closed().await }
    });
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), client.closed())
            .await
            .is_err(),
        "open: still waiting"
    );
    own.close().await.expect("close");
    let err = within("the own close", waiting).await.expect("joined");
    assert!(matches!(err, ClientError::Closed), "{err}");
    let stopping = tokio::spawn(b.stop());
    let err = within("the broker's close", client.closed()).await;
    shut_down_with(err, stopping).await;
}

/// `err` says the broker shut down (SHUTTING_DOWN), and the shutdown (`stopping`) was clean.
async fn shut_down_with(
    err: ClientError,
    stopping: tokio::task::JoinHandle<Result<(), aqueduct_server::ServerError>>,
) {
    assert!(
        matches!(err, ClientError::Connection(_)) && err.to_string().contains("SHUTTING_DOWN"),
        "{err}"
    );
    within("the broker", stopping)
        .await
        .expect("joined")
        .expect("clean shutdown");
}
