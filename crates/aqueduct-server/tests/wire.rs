//! End to end with hand-made frames: the seed's legacy frames, every malformed-input case (ERROR
//! and the connection keeps serving), and backpressure with a subscriber that stops reading.

mod common;

use aqueduct_client::{Client, ErrorCode, PublishOptions, Subscription};
use aqueduct_core::DropReason;
use aqueduct_proto::frame::Message;
use aqueduct_proto::header::write_header;
use aqueduct_proto::{OverflowPolicy, TopicName};
use bytes::Bytes;
use common::*;

async fn expect_confirm(s: &mut RawStream, stream_id: u32) -> Vec<u64> {
    let frame = s.read_frame().await.expect("a reply");
    assert_eq!(frame.stream_id, stream_id);
    match frame.message {
        Message::Confirm(c) => c.offsets,
        other => panic!("expected CONFIRM, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_frames_as_the_seed_reference_client_sends_them() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    // Stream A: SUBSCRIBE "topic:orders", no extensions (exactly the seed's bytes).
    let mut a = raw.stream().await;
    a.write(&raw_frame(0x02, 7, b"topic:orders")).await;
    until("the subscription to be active", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    // Stream B: PUBLISH whose payload is the topic, no extensions.
    let mut pubs = raw.stream().await;
    pubs.write(&raw_frame(0x01, 9, b"orders")).await;
    let frame = a
        .read_frame()
        .await
        .expect("a delivery on the subscribing stream");
    assert_eq!(
        frame.stream_id, 7,
        "deliveries carry the SUBSCRIBE's stream id"
    );
    let Message::Publish(ref p) = frame.message else {
        panic!("expected PUBLISH")
    };
    assert_eq!(p.topic().as_str(), "orders");
    assert_eq!(
        p.body.as_ref(),
        b"orders",
        "delivered with the legacy payload"
    );
    // A SUBSCRIBE without an extension block gets the seed's form: a bare PUBLISH (0x01) whose
    // payload is the body, exactly what the seed's broker forwarded. (Aqueduct's form, 0x41
    // with TOPIC/OFFSET/ATTEMPT entries, made the seed's own client print the extension block
    // as part of the message.)
    assert_eq!(frame.to_bytes(), raw_frame(0x01, 7, b"orders"));
    // The legacy ttl and topic prefixes.
    pubs.write(&raw_frame(0x01, 9, b"ttl:60000:topic:orders"))
        .await;
    let delivery = a.read_frame().await.expect("delivery");
    assert_eq!(
        delivery.to_bytes(),
        raw_frame(0x01, 7, b"ttl:60000:topic:orders"),
        "the seed's form: the publisher's payload as it was"
    );
    // A subscription with an extension block (here an empty one) gets Aqueduct's form.
    let mut modern = raw.stream().await;
    modern
        .write(&raw_frame(0x42, 8, b"\x00\x00topic:orders"))
        .await;
    until("the second subscription", || {
        b.broker.subscriber_count() == 2
    })
    .await;
    pubs.write(&raw_frame(0x01, 9, b"orders")).await;
    let Message::Publish(p) = modern.read_frame().await.expect("delivery").message else {
        panic!("PUBLISH")
    };
    assert_eq!((p.topic().as_str(), p.ext.offset), ("orders", Some(2)));
    // The seed's NACK: the bare offset, on the subscription's stream id.
    pubs.write(&raw_frame(0x05, 7, &5u64.to_le_bytes())).await;
    let err = pubs.read_frame().await.expect("refusal");
    assert_eq!(err.stream_id, 7);
    assert_eq!(error_code(&err), ErrorCode::NOT_IN_FLIGHT);
    b.stop().await.expect("clean shutdown");
}

/// protocol.md 7.2 and 7.5: a seed-style SUBSCRIBE (never confirmed) and an UNSUBSCRIBE (never
/// confirmed either) are known to be handled once an INFO sent after them on the same stream is
/// answered: the broker handles a stream's frames in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_info_answer_after_a_seed_subscribe_or_an_unsubscribe_says_it_was_handled() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut a = raw.stream().await;
    // `command` with `topic:orders` on stream 7, then an INFO request; its answer read.
    async fn then_info(a: &mut RawStream, command: u8) {
        let mut request = raw_frame(command, 7, b"topic:orders");
        request.extend(raw_frame(0x09, 7, b""));
        a.write(&request).await;
        let info = a.read_frame().await.expect("the INFO answer");
        assert!(matches!(info.message, Message::Info(_)), "{info:?}");
    }
    then_info(&mut a, 0x02).await;
    assert_eq!(
        b.broker.subscriber_count(),
        1,
        "active when the answer is read"
    );
    let mut pubs = raw.stream().await;
    pubs.write(&raw_frame(0x01, 9, b"orders")).await;
    let delivery = a.read_frame().await.expect("a delivery");
    assert_eq!(delivery.to_bytes(), raw_frame(0x01, 7, b"orders"));
    then_info(&mut a, 0x03).await;
    assert_eq!(
        b.broker.subscriber_count(),
        0,
        "ended when the answer is read"
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_gets_an_error_and_the_connection_keeps_serving() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;

    // Frame-level problems on one stream: each is answered, the stream goes on.
    let mut s = raw.stream().await;
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (raw_frame(0x3F, 11, b"abc"), ErrorCode::UNKNOWN_OPCODE),
        // HasExtensions with ext_len 5 but only 2 bytes of block.
        (
            raw_frame(0x41, 12, &[5, 0, 0x03, 1]),
            ErrorCode::BAD_EXTENSION,
        ),
        // Priority extension out of range.
        (
            raw_frame(0x41, 13, &[3, 0, 0x03, 1, 9, b'x']),
            ErrorCode::BAD_EXTENSION,
        ),
        // Topic with a wildcard, and a topic with ':'.
        (
            raw_frame(0x41, 14, &[4, 0, 0x04, 2, b'a', b'#']),
            ErrorCode::INVALID_TOPIC,
        ),
        (raw_frame(0x01, 15, b"a:b"), ErrorCode::INVALID_TOPIC),
        (raw_frame(0x02, 16, b"orders"), ErrorCode::BAD_SUBSCRIBE),
        (
            raw_frame(0x02, 17, b"topic:a:group"),
            ErrorCode::BAD_SUBSCRIBE,
        ),
        (
            raw_frame(0x03, 18, b"topic:never"),
            ErrorCode::NOT_SUBSCRIBED,
        ),
        (raw_frame(0x06, 19, &[1, 2, 3]), ErrorCode::BAD_PAYLOAD),
        (
            raw_frame(0x06, 20, &7u64.to_le_bytes()),
            ErrorCode::NOT_SUBSCRIBED,
        ),
        (
            raw_frame(0x04, 21, &raw_frame(0x02, 0, b"topic:x")),
            ErrorCode::BAD_BATCH,
        ),
        (raw_frame(0x08, 22, &[1, 0]), ErrorCode::UNSUPPORTED),
        // The MeshForwarded bit: only cluster peers may set it.
        (raw_frame(0x81, 23, b"orders"), ErrorCode::UNSUPPORTED),
        // ... nor on a batch's sub-frame, which must be valid on its own.
        (
            raw_frame(
                0x04,
                24,
                &[raw_frame(0x01, 0, b"orders"), raw_frame(0x81, 0, b"orders")].concat(),
            ),
            ErrorCode::BAD_BATCH,
        ),
    ];
    for (bytes, want) in &cases {
        s.write(bytes).await;
        let reply = s.read_frame().await.expect("an ERROR");
        assert_eq!(error_code(&reply), *want, "for frame {bytes:02x?}");
        assert_eq!(
            reply.stream_id,
            u32::from_le_bytes([bytes[2], bytes[3], bytes[4], bytes[5]])
        );
    }
    // The same stream still works.
    s.write_frame(&confirmed_publish(30, "ok", "1")).await;
    assert_eq!(expect_confirm(&mut s, 30).await, vec![0]);
    // Nothing of the refused frames was published: `orders` starts at offset 0.
    s.write_frame(&confirmed_publish(31, "orders", "1")).await;
    assert_eq!(expect_confirm(&mut s, 31).await, vec![0]);

    // A frame above transport.max_buf_size (65536): ERROR, then the stream is closed.
    let mut big = raw.stream().await;
    let mut header = Vec::new();
    write_header(&mut header, 0x01, 40, 70_000);
    big.write(&header).await;
    let reply = big.read_frame().await.expect("an ERROR");
    assert_eq!(error_code(&reply), ErrorCode::FRAME_TOO_LARGE);
    assert!(
        big.read_frame().await.is_none(),
        "stream closed after a lost frame boundary"
    );

    // Wrong magic: same.
    let mut bad = raw.stream().await;
    bad.write(&[0x20, 0x01, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(
        error_code(&bad.read_frame().await.expect("ERROR")),
        ErrorCode::BAD_MAGIC
    );
    assert!(bad.read_frame().await.is_none());

    // The connection still serves new streams.
    let mut fresh = raw.stream().await;
    fresh.write_frame(&confirmed_publish(50, "ok", "2")).await;
    assert_eq!(expect_confirm(&mut fresh, 50).await, vec![1]);
    let rejected = b.stats.rejected_frames();
    assert_eq!(rejected.get("bad_magic"), Some(&1));
    assert_eq!(rejected.get("frame_too_large"), Some(&1));
    assert_eq!(rejected.get("mesh_forwarded"), Some(&1));
    assert!(b
        .stats
        .errors_sent()
        .get(&ErrorCode::BAD_EXTENSION.0)
        .is_some_and(|n| *n >= 2));
    b.stop().await.expect("clean shutdown");
}

fn bp_stats(b: &TestBroker) -> aqueduct_core::TopicStatsSnapshot {
    b.broker
        .topic(&TopicName::try_from("bp").expect("valid"))
        .expect("known")
        .stats()
        .snapshot()
}

/// A raw subscriber to `bp` that reads nothing unless told to (a tiny receive window). Its
/// SUBSCRIBE carries an (empty) extension block, so deliveries come in Aqueduct's form.
async fn stalled_subscriber(b: &TestBroker) -> (Raw, RawStream) {
    let stalled = Raw::connect(b, 4096).await;
    let mut s = stalled.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:bp")).await;
    until("the stalled subscription", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    (stalled, s)
}

/// Publish `n` messages of `size` bytes to `bp` from a client of its own, until the broker has
/// read them all.
async fn publish_to_bp(b: &TestBroker, n: usize, size: usize) {
    let publisher = b.client().await;
    let body = "x".repeat(size);
    for _ in 0..n {
        within("a publish", publisher.publish("bp", body.clone()))
            .await
            .expect("publish");
    }
    within("the flush", publisher.flush())
        .await
        .expect("the broker read everything");
}

/// A subscriber that never reads (tiny receive window) and a normal one on the same topic. The
/// normal one is returned too: dropping it would unsubscribe it (asynchronously).
async fn backpressure(
    policy: OverflowPolicy,
) -> (TestBroker, u64, Raw, RawStream, (Client, Subscription)) {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 32;
        c.broker.backpressure_policy = policy;
    })
    .await;
    let (stalled, s) = stalled_subscriber(&b).await;
    let normal_client = b.client().await;
    let mut normal = normal_client.subscribe("bp").await.expect("subscribe");
    let publisher = b.client().await;
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    const N: u64 = 400;
    let body = "x".repeat(200);
    for i in 0..N {
        publisher
            .publish_with("bp", body.clone(), &confirm)
            .await
            .expect("publish");
        // The normal subscriber keeps up and receives everything, in order.
        assert_eq!(next(&mut normal).await.offset(), i);
    }
    let stats = bp_stats(&b);
    let dropped = stats.dropped(DropReason::Policy(policy));
    (b, dropped, stalled, s, (normal_client, normal))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_oldest_with_a_stalled_subscriber() {
    let (b, dropped, _raw, _stream, _normal) = backpressure(OverflowPolicy::DropOldest).await;
    assert!(
        dropped > 300,
        "the stalled subscriber's overflow is dropped and counted: {dropped}"
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_newest_with_a_stalled_subscriber() {
    let (b, dropped, _raw, _stream, _normal) = backpressure(OverflowPolicy::DropNewest).await;
    assert!(
        dropped > 300,
        "the stalled subscriber's overflow is dropped and counted: {dropped}"
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_closes_the_stalled_subscriber() {
    let (b, dropped, _raw, mut stream, _normal) = backpressure(OverflowPolicy::Disconnect).await;
    assert!(
        dropped >= 33,
        "the queue and the overflowing message are counted: {dropped}"
    );
    until("only the normal subscriber to be left", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    // Its stream was blocked on flow control, so it is reset with the SLOW_CONSUMER code (or,
    // if its writer had not run yet on a loaded machine, gets an ERROR with that code).
    assert_eq!(
        stream.slow_consumer_notice().await,
        u64::from(ErrorCode::SLOW_CONSUMER.0)
    );
    // The closed subscription is no longer registered: UNSUBSCRIBE and ACK naming it are
    // refused with NOT_SUBSCRIBED, as for any unknown subscription.
    let mut other = _raw.stream().await;
    other.write(&raw_frame(0x03, 1, b"topic:bp")).await;
    let reply = other.read_frame().await.expect("an ERROR");
    assert_eq!(
        (reply.stream_id, error_code(&reply)),
        (1, ErrorCode::NOT_SUBSCRIBED)
    );
    other.write(&raw_frame(0x06, 1, &0u64.to_le_bytes())).await;
    let reply = other.read_frame().await.expect("an ERROR");
    assert_eq!(
        (reply.stream_id, error_code(&reply)),
        (1, ErrorCode::NOT_SUBSCRIBED)
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_holds_the_publisher_and_loses_nothing() {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 32;
        c.broker.backpressure_policy = OverflowPolicy::Block;
    })
    .await;
    let (_stalled, mut s) = stalled_subscriber(&b).await;
    let publisher = b.client().await;
    // More than the stalled stream's credit, one writer buffer (64 KiB) and the queue hold.
    const N: u64 = 1000;
    let body = "x".repeat(200);
    let sending = tokio::spawn(async move {
        for _ in 0..N {
            publisher
                .publish("bp", body.clone())
                .await
                .expect("publish");
        }
        publisher
    });
    let held = || {
        b.stats
            .publish_holds
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    until("the broker to hold the publisher", || held() >= 1).await;
    // Now read: every message arrives, in order, and nothing was dropped.
    for i in 0..N {
        let frame = within("a delivery", s.read_frame()).await.expect("frame");
        let Message::Publish(p) = frame.message else {
            panic!("not a delivery: {frame:?}")
        };
        assert_eq!(p.ext.offset, Some(i));
    }
    let _publisher = within("the publisher", sending).await.expect("joined");
    let stats = bp_stats(&b);
    for reason in DropReason::ALL {
        assert_eq!(stats.dropped(reason), 0, "{reason:?}");
    }
    assert!(
        b.stats
            .publish_held_us
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_block_subscriber_is_closed_after_block_timeout() {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 32;
        c.broker.backpressure_policy = OverflowPolicy::Block;
        c.block_timeout = Some(std::time::Duration::from_millis(300));
    })
    .await;
    let (_stalled, mut s) = stalled_subscriber(&b).await;
    // Every publish is taken: the stuck subscriber is closed, and the publisher goes on.
    publish_to_bp(&b, 1000, 200).await;
    assert_eq!(b.broker.slow_consumers_disconnected(), 1);
    assert_eq!(b.broker.subscriber_count(), 0);
    assert!(bp_stats(&b).dropped(DropReason::Policy(OverflowPolicy::Disconnect)) > 0);
    assert!(
        b.stats
            .publish_holds
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    // Closed as a slow consumer: a reset with SLOW_CONSUMER if its writer was blocked on flow
    // control (the usual case), an ERROR frame if the writer had not run yet (a loaded machine).
    assert_eq!(
        s.slow_consumer_notice().await,
        u64::from(ErrorCode::SLOW_CONSUMER.0)
    );
    b.stop().await.expect("clean shutdown");
}

/// A client that finishes its delivery stream with a backlog queued and then reads nothing:
/// the broker's write stays blocked on flow control, and the plain subscription must still end
/// within 5 s (protocol.md 7.4) — stream reset, backlog dropped and counted, its stream id free
/// again. Before, the blocked write was given up only for a reset, a STOP_SENDING or a slow
/// consumer, so the subscription lived as long as the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_stream_its_client_does_not_read_ends_its_subscriptions() {
    let b = TestBroker::start().await;
    let (stalled, mut s) = stalled_subscriber(&b).await;
    publish_to_bp(&b, 200, 1024).await;
    // Queued (the broker read every publish): 200 KiB against the stream's 4 KiB window, so
    // the write blocks whether it started before the FIN or after.
    s.finish();
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    assert_eq!(
        b.stats
            .finish_timeouts
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // Counted just after the subscription leaves the routing table: wait for it. What the
    // interrupted write held (up to about `batch_size`, 64 KiB, and the 4 KiB window) is lost with
    // the reset uncounted (protocol.md 7.4); the rest of the 200 KiB was still queued.
    until("the dropped backlog to be counted", || {
        bp_stats(&b).dropped(DropReason::Unsubscribed) >= 100
    })
    .await;
    // Its stream id may be used again.
    let mut again = stalled.stream().await;
    again.write(&raw_frame(0x42, 1, b"\x00\x00topic:bp")).await;
    until("the new subscription", || b.broker.subscriber_count() == 1).await;
    b.stop().await.expect("clean shutdown");
}

/// A client that resets its sending side of a stream and keeps reading gets a reset (code 0),
/// not a FIN (protocol.md 1.1): the replies queued there were dropped with the stream's
/// subscriptions, and a FIN would say the stream ended cleanly. The broker's sending half was
/// dropped, which quinn ends with a FIN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_client_resets_is_reset_not_finished() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:t")).await;
    until("the subscription", || b.broker.subscriber_count() == 1).await;
    s.reset(7);
    assert_eq!(s.stream_end().await, Err(0));
    until("the subscription to end", || {
        b.broker.subscriber_count() == 0
    })
    .await;
    b.stop().await.expect("clean shutdown");
}

/// A client that finishes its delivery stream and then reads slowly, but steadily, gets
/// everything and the broker's FIN (protocol.md 1.1: "a client that keeps reading, however
/// slowly, gets everything"). The wait for the client restarts with each part of a write it
/// takes; it was measured from the start of the whole write (up to `batch_size`), so a client
/// reading below ~13 KB/s had its stream reset and its backlog dropped 5 s after the FIN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_slowly_after_its_fin_gets_everything() {
    let b = TestBroker::start_with(|c| c.batch_size = 16 << 10).await;
    let (_stalled, mut s) = stalled_subscriber(&b).await;
    const N: u64 = 20;
    publish_to_bp(&b, N as usize, 1024).await;
    s.finish();
    // ~1.7 KB/s: the write after the FIN (16 KiB, 4 KiB of it taken at once by the stream's
    // window) takes ~7 s, longer than the 5 s the broker waits for each part.
    for i in 0..N {
        let frame = within("a delivery", s.read_frame()).await.expect("a frame");
        let Message::Publish(p) = frame.message else {
            panic!("not a delivery: {frame:?}")
        };
        assert_eq!(p.ext.offset, Some(i));
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    }
    assert!(
        within("the broker's FIN", s.read_frame()).await.is_none(),
        "the stream ends cleanly"
    );
    assert_eq!(
        b.stats
            .finish_timeouts
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(bp_stats(&b).dropped(DropReason::Unsubscribed), 0);
    b.stop().await.expect("clean shutdown");
}

/// An UNSUBSCRIBE lets go of the subscription at once, also while its stream's writer is
/// blocked on flow control. It stayed in the stream's list until the writer's next fill, which a
/// blocked writer never reaches: SUBSCRIBE and UNSUBSCRIBE pairs on a stream the client does
/// not read grew the broker's memory without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsubscribe_lets_go_of_the_subscription_while_its_writer_is_blocked() {
    let b = TestBroker::start().await;
    let (_stalled, mut s) = stalled_subscriber(&b).await;
    publish_to_bp(&b, 200, 1024).await;
    for round in 0..3 {
        s.write(&raw_frame(0x42, 2, b"\x00\x00topic:other")).await;
        until("the second subscription", || {
            b.broker.subscriber_count() == 2
        })
        .await;
        let second = b
            .broker
            .subscribers()
            .iter()
            .find(|sub| sub.stream_id() == 2)
            .map(std::sync::Arc::downgrade)
            .expect("registered");
        s.write(&raw_frame(0x03, 2, b"topic:other")).await;
        until("the subscription to be let go of", || {
            second.upgrade().is_none()
        })
        .await;
        assert_eq!(b.broker.subscriber_count(), 1, "round {round}");
    }
    b.stop().await.expect("clean shutdown");
}

/// With WebTransport on, the broker lets clients open the three unidirectional streams HTTP/3
/// needs; a native client that opens one gets it refused unread (STOP_SENDING 0), and its
/// connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_client_s_unidirectional_stream_is_refused_unread() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut uni = within("a unidirectional stream", raw.conn.open_uni())
        .await
        .expect("allowed (WebTransport is on)");
    uni.write_all(b"not a protocol stream")
        .await
        .expect("write");
    let stopped = within("STOP_SENDING", uni.stopped()).await;
    assert_eq!(stopped.ok().flatten(), Some(0u32.into()));
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:still")).await;
    until("the connection to still work", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    b.stop().await.expect("clean shutdown");
}

/// A client's unidirectional stream (the protocol uses bidirectional ones only) is stopped
/// unread with code 0 and counted; nothing on it is published, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unidirectional_stream_is_stopped_unread_and_counted() {
    let b = TestBroker::start().await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut uni = within("open a unidirectional stream", raw.conn.open_uni())
        .await
        .expect("the broker allows a few (HTTP/3 needs them)");
    uni.write_all(&confirmed_publish(1, "uni", "x").to_bytes())
        .await
        .expect("write");
    let stopped = within("STOP_SENDING", uni.stopped()).await;
    assert_eq!(stopped.expect("stream state"), Some(0u32.into()));
    assert_eq!(
        b.stats.rejected_frames().get("unidirectional_stream"),
        Some(&1)
    );
    let mut s = raw.stream().await;
    s.write_frame(&confirmed_publish(2, "uni", "y")).await;
    assert_eq!(
        expect_confirm(&mut s, 2).await,
        vec![0],
        "nothing on the unidirectional stream was published"
    );
    b.stop().await.expect("clean shutdown");
}

/// With the durable log, a stream the client finished is not finished by the broker before the
/// log has answered every frame on it: a FIN says every frame before it was handled (§1.1).
/// Before the fix the broker sent its FIN as soon as it had read the client's, and the CONFIRM
/// that came later was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_finishes_a_stream_only_after_the_log_answered_its_frames() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b =
        TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), aqueduct_log::FsyncMode::Batch)))
            .await;
    let raw = Raw::connect(&b, 1 << 20).await;
    b.control.hold_log_writes(true);
    let mut s = raw.stream().await;
    s.write_frame(&confirmed_publish(7, "held", "x")).await;
    s.finish();
    // While the log holds the frame, nothing comes: neither its CONFIRM nor the FIN. (Without
    // the fix the FIN arrived here at once; a slower broker would only make this check miss.)
    let early = tokio::time::timeout(std::time::Duration::from_millis(300), s.read_frame()).await;
    assert!(
        early.is_err(),
        "the broker answered or finished early: {early:?}"
    );
    b.control.hold_log_writes(false);
    assert_eq!(expect_confirm(&mut s, 7).await, vec![0]);
    assert!(
        within("the broker's FIN", s.read_frame()).await.is_none(),
        "then the stream ends"
    );
    b.stop().await.expect("clean shutdown");
}

/// Subscriptions sharing a stream take turns at the stream's writes: a message for one of
/// them is not held back until another's backlog has drained. Before the fix every write
/// started with the first subscription, and one whose messages are larger than the write
/// budget (`broker.batch_size`) took all of it at every write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_sharing_a_stream_take_turns() {
    let b = TestBroker::start_with(|c| {
        c.broker.queue_size = 4096;
        c.batch_size = 2048;
    })
    .await;
    // A small stream window: the broker's writer stops until we read, and the backlog queues.
    let raw = Raw::connect(&b, 16 << 10).await;
    let mut s = raw.stream().await;
    s.write(&raw_frame(0x42, 1, b"\x00\x00topic:fair/a")).await;
    s.write(&raw_frame(0x42, 2, b"\x00\x00topic:fair/b")).await;
    until("both subscriptions", || b.broker.subscriber_count() == 2).await;
    let publisher = b.client().await;
    const BACKLOG: usize = 200;
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    // Each larger than a write's budget (2048 bytes).
    let body = Bytes::from(vec![b'a'; 3000]);
    for _ in 0..BACKLOG / 20 {
        let batch = (0..20).map(|_| ("fair/a", body.clone()));
        publisher
            .publish_batch(batch, &confirm)
            .await
            .expect("backlog");
    }
    publisher
        .publish_with("fair/b", "b", &confirm)
        .await
        .expect("the other subscription's message");
    let mut position = None;
    for i in 0..=BACKLOG {
        let frame = s.read_frame().await.expect("a delivery");
        let Message::Publish(delivery) = frame.message else {
            panic!("expected a delivery, got {:?}", frame.message);
        };
        if delivery.body.as_ref() == b"b" {
            position = Some(i);
            break;
        }
    }
    let position = position.expect("fair/b's message arrives");
    assert!(
        position < BACKLOG / 2,
        "fair/b's message came after {position} of fair/a's backlog of {BACKLOG}"
    );
    // The rest of the backlog is not read: close instead of letting shutdown wait for it.
    raw.conn.close(0u32.into(), b"done");
    b.stop().await.expect("clean shutdown");
}

/// Answers on a stream come in request order with the durable log too (§6.4): an ERROR for a
/// later frame waits behind the CONFIRM the log owes an earlier one. Before the fix the ERROR
/// came first, and a client matching answers by order (a seed client uses one stream id for
/// every frame of a stream) took it for the earlier frame's. So does an INFO answer (§4.1),
/// which at first was sent at once, ahead of the CONFIRM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_wait_behind_the_confirm_the_log_owes_an_earlier_frame() {
    let dir = tempfile::tempdir().expect("temp dir");
    let b =
        TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), aqueduct_log::FsyncMode::Always)))
            .await;
    let raw = Raw::connect(&b, 1 << 20).await;
    b.control.hold_log_writes(true);
    let mut s = raw.stream().await;
    s.write_frame(&confirmed_publish(7, "ordered", "x")).await;
    s.write(&raw_frame(0x09, 7, b"")).await;
    // A reserved opcode: answered UNKNOWN_OPCODE and skipped, the stream goes on.
    s.write(&raw_frame(0x3F, 7, b"")).await;
    let unknown = ErrorCode::UNKNOWN_OPCODE.0;
    until("the frames after the publish handled", || {
        b.stats.errors_sent().get(&unknown).is_some_and(|n| *n >= 1)
    })
    .await;
    b.control.hold_log_writes(false);
    assert_eq!(
        expect_confirm(&mut s, 7).await,
        vec![0],
        "the CONFIRM first"
    );
    let info = s.read_frame().await.expect("the INFO");
    assert!(matches!(info.message, Message::Info(_)), "{info:?}");
    let error = s.read_frame().await.expect("the ERROR");
    match error.message {
        Message::Error(e) => assert_eq!(e.code, ErrorCode::UNKNOWN_OPCODE),
        other => panic!("expected ERROR, got {other:?}"),
    }
    raw.forget();
    b.stop().await.expect("clean shutdown");
}

/// INFO (protocol.md §4.1) is answered on the stream it came on, in order with the stream's
/// other replies, with the broker's configured limits; the stream goes on. An extension block
/// and entries of a later version in the request are ignored; a request that is not
/// well-formed entries gets BAD_PAYLOAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_answers_with_the_configured_limits_and_the_stream_goes_on() {
    let b = TestBroker::start_with(|c| {
        c.transport.max_frame_data = 4096;
        c.transport.max_subscriptions_per_connection = 7;
    })
    .await;
    let raw = Raw::connect(&b, 1 << 20).await;
    let mut s = raw.stream().await;
    s.write_frame(&confirmed_publish(1, "orders", "a")).await;
    s.write(&raw_frame(0x09, 2, b"")).await;
    // HasExtensions with an empty block, then an entry with a key no version defines yet.
    s.write(&raw_frame(0x49, 3, &[0x00, 0x00, 0x7F, 0x01, 0x00]))
        .await;
    s.write(&raw_frame(0x09, 4, &[0x01])).await;
    s.write_frame(&confirmed_publish(5, "orders", "b")).await;
    assert_eq!(expect_confirm(&mut s, 1).await, vec![0]);
    for stream_id in [2, 3] {
        let frame = s.read_frame().await.expect("the INFO answer");
        assert_eq!(frame.stream_id, stream_id);
        let Message::Info(info) = frame.message else {
            panic!("expected INFO, got {:?}", frame.message)
        };
        assert_eq!(info.protocol, Some(1));
        assert_eq!(info.max_data_len, Some(4096));
        assert_eq!(info.max_delivery_data_len, Some(4096 + 1024));
        assert_eq!(info.max_subscriptions, Some(7));
        let broker = info.broker.expect("the broker's name");
        assert!(broker.starts_with("aqueduct-broker "), "{broker}");
        assert_eq!(info.durable, Some(false), "no log");
    }
    let frame = s.read_frame().await.expect("the ERROR");
    assert_eq!(frame.stream_id, 4);
    match frame.message {
        Message::Error(e) => assert_eq!(e.code, ErrorCode::BAD_PAYLOAD, "{}", e.reason),
        other => panic!("expected ERROR, got {other:?}"),
    }
    assert_eq!(
        expect_confirm(&mut s, 5).await,
        vec![1],
        "the stream went on"
    );
    // Known keys of the right length in a request are accepted (and ignored).
    s.write(&raw_frame(0x09, 6, &[0x01, 0x01, 0x01])).await;
    let frame = s.read_frame().await.expect("the INFO answer");
    assert!(
        frame.stream_id == 6 && matches!(frame.message, Message::Info(_)),
        "{frame:?}"
    );
    // On a subscription's stream: answered there, and the subscription goes on.
    let mut sub = raw.stream().await;
    sub.write(&raw_frame(0x02, 11, b"topic:orders")).await;
    until("the subscription to be active", || {
        b.broker.subscriber_count() == 1
    })
    .await;
    sub.write(&raw_frame(0x09, 12, b"")).await;
    let frame = sub.read_frame().await.expect("the INFO answer");
    assert!(
        frame.stream_id == 12 && matches!(frame.message, Message::Info(_)),
        "{frame:?}"
    );
    s.write_frame(&confirmed_publish(13, "orders", "c")).await;
    assert_eq!(expect_confirm(&mut s, 13).await, vec![2]);
    let delivery = sub.read_frame().await.expect("the delivery");
    assert_eq!(delivery.to_bytes(), raw_frame(0x01, 11, b"c"));
    raw.forget();
    b.stop().await.expect("clean shutdown");
}
