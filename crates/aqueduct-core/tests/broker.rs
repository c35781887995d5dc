//! The broker's rules, end to end through `aqueduct-core` alone, with a fake clock
//! (`t0 + offsets`): routing, fan-out, groups, priorities, backpressure, TTL, ACK/NACK,
//! redelivery, ack-wait timeouts and dead letters.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_core::*;
use aqueduct_proto::frame::Message;
use aqueduct_proto::*;
use bytes::{Bytes, BytesMut};

fn t(s: &str) -> TopicName {
    TopicName::try_from(s).expect("valid topic")
}

fn spec(s: &str) -> SubscribeSpec {
    SubscribeSpec::parse(&Bytes::copy_from_slice(s.as_bytes())).expect("valid spec")
}

fn sub(b: &Broker, s: &str) -> Arc<Subscriber> {
    b.subscribe(&spec(s), SubscribeOptions::default())
}

/// A waker that counts its calls.
fn counting_waker() -> (Arc<AtomicUsize>, Waker) {
    let woken = Arc::new(AtomicUsize::new(0));
    let w = woken.clone();
    let waker: Waker = Box::new(move || {
        w.fetch_add(1, Ordering::SeqCst);
    });
    (woken, waker)
}

fn sub_with(b: &Broker, s: &str, opts: SubscribeOptions) -> Arc<Subscriber> {
    b.subscribe(&spec(s), opts)
}

/// A subscription settled explicitly (ACK/NACK).
fn explicit_sub(b: &Broker, s: &str) -> Arc<Subscriber> {
    sub_with(
        b,
        s,
        SubscribeOptions {
            ack_mode: AckMode::Explicit,
            ..Default::default()
        },
    )
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    topic: String,
    offset: u64,
    priority: u8,
    attempt: u32,
    body: Vec<u8>,
    stream_id: u32,
    ext: Extensions,
}

/// Drain everything ready and decode it.
fn drain_all(b: &Broker, s: &Subscriber, now: Instant) -> Vec<Got> {
    let mut out = BytesMut::new();
    loop {
        let d = b.drain(s, &mut out, 64 * 1024, now);
        if d.frames == 0 && d.expired == 0 {
            break;
        }
    }
    decode_all(out.freeze())
}

fn decode_all(mut buf: Bytes) -> Vec<Got> {
    let mut got = vec![];
    while !buf.is_empty() {
        let (frame, used) = decode_frame(&buf, &Limits::default()).expect("broker output decodes");
        let Message::Publish(p) = frame.message else {
            panic!("not a delivery: {frame:?}")
        };
        got.push(Got {
            topic: p.topic().to_string(),
            offset: p.ext.offset.expect("offset"),
            priority: p.priority().level(),
            attempt: p.ext.attempt.expect("attempt"),
            body: p.body.to_vec(),
            stream_id: frame.stream_id,
            ext: p.ext.clone(),
        });
        let _ = buf.split_to(used);
    }
    got
}

fn publish(
    b: &Broker,
    ctx: &mut PublishContext,
    topic: &str,
    body: &str,
    now: Instant,
) -> PublishOutcome {
    b.publish(ctx, &Publication::new(&t(topic), body.as_bytes()), now)
}

fn publish_p(
    b: &Broker,
    ctx: &mut PublishContext,
    topic: &str,
    body: &str,
    prio: u8,
    now: Instant,
) {
    let topic = t(topic);
    let mut p = Publication::new(&topic, body.as_bytes());
    p.priority = Priority::new(prio).expect("valid priority");
    b.publish(ctx, &p, now);
}

fn bodies(got: &[Got]) -> Vec<String> {
    got.iter()
        .map(|g| String::from_utf8_lossy(&g.body).into_owned())
        .collect()
}

#[test]
fn a_drain_records_each_delivery_s_latency_by_runs_of_one_publish_instant() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let s = sub(&b, "topic:lat");
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_millis(1);
    // A run of three, a run of two, then one more at the first instant (not adjacent).
    for at in [t0, t0, t0, t1, t1, t0] {
        publish(&b, &mut ctx, "lat", "x", at);
    }
    assert_eq!(drain_all(&b, &s, t0 + Duration::from_millis(5)).len(), 6);
    let l = b.latency();
    assert_eq!(l.count, 6);
    assert_eq!(l.sum, Duration::from_millis(3 * 5 + 2 * 4 + 5));
}

#[test]
fn fan_out_to_exact_and_wildcard_subscribers() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let exact = sub_with(
        &b,
        "topic:sport/tennis",
        SubscribeOptions {
            stream_id: 11,
            ..Default::default()
        },
    );
    let plus = sub(&b, "topic:sport/+");
    let hash = sub(&b, "topic:#");
    let other = sub(&b, "topic:news");
    let out = publish(&b, &mut ctx, "sport/tennis", "ace", now);
    assert_eq!(
        out,
        PublishOutcome {
            offset: 0,
            routed: 3
        }
    );
    for s in [&exact, &plus, &hash] {
        let got = drain_all(&b, s, now);
        assert_eq!(bodies(&got), ["ace"]);
        assert_eq!(got[0].topic, "sport/tennis");
        assert_eq!((got[0].offset, got[0].attempt, got[0].priority), (0, 1, 2));
    }
    assert_eq!(drain_all(&b, &exact, now), vec![]);
    assert!(drain_all(&b, &other, now).is_empty());
    // Deliveries carry the SUBSCRIBE's stream id.
    publish(&b, &mut ctx, "sport/tennis", "again", now);
    assert_eq!(drain_all(&b, &exact, now)[0].stream_id, 11);
}

#[test]
fn offsets_are_per_topic_and_monotonic() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = sub(&b, "topic:+");
    for (topic, want) in [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1)] {
        assert_eq!(publish(&b, &mut ctx, topic, "x", now).offset, want);
    }
    let got = drain_all(&b, &s, now);
    let offsets: Vec<_> = got.iter().map(|g| (g.topic.as_str(), g.offset)).collect();
    assert_eq!(offsets, [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1)]);
    assert_eq!(b.topic(&t("a")).expect("known").next_offset(), 3);
    // Unrouted messages still take an offset.
    assert_eq!(publish(&b, &mut ctx, "no/body", "x", now).routed, 0);
    assert_eq!(publish(&b, &mut ctx, "no/body", "x", now).offset, 1);
}

#[test]
fn system_topics_are_not_matched_by_leading_wildcards() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let all = sub(&b, "topic:#");
    let dlq = sub(&b, "topic:__dlq__orders");
    publish(&b, &mut ctx, "__dlq__orders", "x", now);
    assert!(drain_all(&b, &all, now).is_empty());
    assert_eq!(drain_all(&b, &dlq, now).len(), 1);
}

#[test]
fn group_round_robin_exactly_once() {
    let b = Broker::new(BrokerConfig {
        queue_size: 4096,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let members: Vec<_> = (0..3)
        .map(|_| sub(&b, "topic:jobs/+:group:workers"))
        .collect();
    let plain = sub(&b, "topic:jobs/#");
    for i in 0..3000 {
        let out = publish(&b, &mut ctx, "jobs/a", &i.to_string(), now);
        assert_eq!(
            out.routed, 2,
            "one copy for the group, one for the plain subscriber"
        );
    }
    let mut seen = BTreeSet::new();
    for m in &members {
        let got = drain_all(&b, m, now);
        assert_eq!(got.len(), 1000);
        for g in got {
            assert!(seen.insert(g.offset), "offset {} delivered twice", g.offset);
        }
    }
    assert_eq!(seen.len(), 3000);
    assert_eq!(drain_all(&b, &plain, now).len(), 3000);
    // Same group id on a different filter is a different group.
    let other = sub(&b, "topic:jobs/a:group:workers");
    publish(&b, &mut ctx, "jobs/a", "x", now);
    assert_eq!(drain_all(&b, &other, now).len(), 1);
}

#[test]
fn a_leaving_member_hands_its_messages_to_the_others() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let m1 = sub(&b, "topic:jobs:group:g");
    let m2 = sub(&b, "topic:jobs:group:g");
    for i in 0..4 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    // m1 got 0 and 2; it receives 0 (in flight) and never reads 2 (queued).
    let mut out = BytesMut::new();
    b.drain(&m1, &mut out, 1, now);
    let first = decode_all(out.freeze());
    assert_eq!(bodies(&first), ["0"]);
    assert_eq!(m1.in_flight(), 1);
    assert_eq!(m1.queued(), 1);
    b.unsubscribe(&mut ctx, &m1, now);
    assert_eq!(m1.close_reason(), Some(CloseReason::Unsubscribed));
    let got = drain_all(&b, &m2, now);
    let mut by_body: BTreeMap<String, u32> = BTreeMap::new();
    for g in &got {
        by_body.insert(String::from_utf8_lossy(&g.body).into(), g.attempt);
    }
    // 1 and 3 were m2's; 2 was queued at m1 (first attempt); 0 was in flight at m1 (second attempt).
    assert_eq!(
        by_body,
        BTreeMap::from([
            ("0".into(), 2),
            ("1".into(), 1),
            ("2".into(), 1),
            ("3".into(), 1)
        ])
    );
    // The last member leaving drops (and counts) what it still holds.
    b.unsubscribe(&mut ctx, &m2, now);
    publish(&b, &mut ctx, "jobs", "nobody", now);
    let stats = b.topic(&t("jobs")).expect("known").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Unsubscribed),
        4,
        "m2's four in-flight messages"
    );
    assert_eq!(b.subscriber_count(), 0);
}

#[test]
fn durable_group_tracks_the_committed_offset() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let m = sub(&b, "topic:orders:group:billing:durable:c1:0");
    let g = m.group().expect("group").clone();
    assert_eq!(
        g.durable().map(|d| (d.consumer.as_str(), d.start)),
        Some(("c1", DurableStart::Offset(0)))
    );
    for i in 0..5 {
        publish(&b, &mut ctx, "orders", &i.to_string(), now);
    }
    let got = drain_all(&b, &m, now);
    assert_eq!(got.len(), 5);
    assert_eq!(g.committed_offset(&t("orders")), Some(0));
    b.ack(&m, None, 1, None).expect("in flight");
    assert_eq!(g.committed_offset(&t("orders")), Some(0));
    b.ack(&m, None, 0, None).expect("in flight");
    assert_eq!(g.committed_offset(&t("orders")), Some(2));
    for o in 2..5 {
        b.ack(&m, None, o, Some(1)).expect("in flight");
    }
    assert_eq!(g.committed_offset(&t("orders")), Some(5));
    // `:durable:` without `:group:` forms a group named after the consumer.
    let solo = sub(&b, "topic:orders:durable:c9:0");
    assert_eq!(
        solo.group().map(|g| g.id().as_str().to_owned()),
        Some("c9".into())
    );
}

#[test]
fn strict_priority_order() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = sub(&b, "topic:p");
    for (prio, body) in [
        (3, "low1"),
        (2, "mid1"),
        (0, "top1"),
        (1, "hi1"),
        (3, "low2"),
        (0, "top2"),
    ] {
        publish_p(&b, &mut ctx, "p", body, prio, now);
    }
    let got = drain_all(&b, &s, now);
    assert_eq!(
        bodies(&got),
        ["top1", "top2", "hi1", "mid1", "low1", "low2"]
    );
    assert_eq!(
        got.iter().map(|g| g.priority).collect::<Vec<_>>(),
        [0, 0, 1, 2, 3, 3]
    );
}

#[test]
fn drain_respects_the_byte_budget() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = sub(&b, "topic:x");
    for _ in 0..10 {
        publish(&b, &mut ctx, "x", &"y".repeat(100), now);
    }
    let mut out = BytesMut::new();
    let d = b.drain(&s, &mut out, 300, now);
    // Each frame is 10 + 2 + 6 + (3 + 3 + 10) + 100 = 134 bytes: three fit the budget, reaching it.
    assert_eq!((d.frames, d.bytes, out.len()), (3, 402, 402));
    // A budget smaller than one frame still sends one.
    let d = b.drain(&s, &mut BytesMut::new(), 1, now);
    assert_eq!(d.frames, 1);
    assert_eq!(s.queued(), 6);
}

fn policy_broker(policy: OverflowPolicy) -> (Broker, Arc<Subscriber>, Arc<Subscriber>) {
    let b = Broker::new(BrokerConfig {
        queue_size: 4,
        backpressure_policy: policy,
        ..Default::default()
    });
    let slow = sub(&b, "topic:t");
    // A normal subscriber on the same topic with room for everything.
    let fast = sub_with(
        &b,
        "topic:t",
        SubscribeOptions {
            overflow: Some(OverflowPolicy::DropNewest),
            ..Default::default()
        },
    );
    (b, slow, fast)
}

#[test]
fn drop_oldest_keeps_the_newest() {
    let (b, slow, fast) = policy_broker(OverflowPolicy::DropOldest);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let mut fast_got = vec![];
    for i in 0..10 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
        fast_got.extend(bodies(&drain_all(&b, &fast, now)));
    }
    assert_eq!(bodies(&drain_all(&b, &slow, now)), ["6", "7", "8", "9"]);
    assert_eq!(fast_got.len(), 10, "the normal subscriber gets everything");
    let stats = b.topic(&t("t")).expect("known").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::DropOldest)),
        6
    );
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::DropNewest)),
        0
    );
}

#[test]
fn drop_newest_keeps_the_oldest() {
    let (b, slow, fast) = policy_broker(OverflowPolicy::DropNewest);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let mut fast_got = 0;
    for i in 0..10 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
        fast_got += drain_all(&b, &fast, now).len();
    }
    assert_eq!(bodies(&drain_all(&b, &slow, now)), ["0", "1", "2", "3"]);
    assert_eq!(fast_got, 10);
    let stats = b.topic(&t("t")).expect("known").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::DropNewest)),
        6
    );
}

#[test]
fn disconnect_closes_the_slow_subscriber_only() {
    let (b, slow, fast) = policy_broker(OverflowPolicy::Disconnect);
    let (woken, waker) = counting_waker();
    let watched = sub_with(
        &b,
        "topic:t",
        SubscribeOptions {
            waker: Some(waker),
            ..Default::default()
        },
    );
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let mut fast_got = 0;
    for i in 0..10 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
        fast_got += drain_all(&b, &fast, now).len();
    }
    assert_eq!(fast_got, 10);
    assert_eq!(slow.close_reason(), Some(CloseReason::SlowConsumer));
    assert_eq!(watched.close_reason(), Some(CloseReason::SlowConsumer));
    assert!(
        woken.load(Ordering::SeqCst) >= 2,
        "woken for the first message and for the close"
    );
    assert!(drain_all(&b, &slow, now).is_empty());
    // Closed subscribers are out of the routing table.
    assert_eq!(b.subscriber_count(), 1);
    let stats = b.topic(&t("t")).expect("known").stats().snapshot();
    // Each slow subscriber: 4 queued + the overflowing 5th.
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::Disconnect)),
        10
    );
}

/// A group whose members are all full under `disconnect`: one more message closes a member,
/// whose messages go to the next full member, which closes it, and so on through the group.
/// That cascade must not recurse once per member: on a thread with a small stack (256 KiB),
/// 2,000 members overflowed it (and a broker's thread aborts the process on a stack overflow).
/// Every message is still accounted for once the last member is gone.
#[test]
fn a_cascade_through_a_group_of_full_members_does_not_recurse() {
    const MEMBERS: usize = 2_000;
    let run = || {
        let b = Broker::new(BrokerConfig {
            queue_size: 1,
            backpressure_policy: OverflowPolicy::Disconnect,
            ..BrokerConfig::default()
        });
        let members: Vec<_> = (0..MEMBERS)
            .map(|_| sub(&b, "topic:jobs:group:g"))
            .collect();
        let mut ctx = PublishContext::default();
        let now = Instant::now();
        // One message each (round-robin over members with room): every queue is full.
        for i in 0..MEMBERS {
            publish(&b, &mut ctx, "jobs", &i.to_string(), now);
        }
        assert!(members.iter().all(|m| m.queued() == 1));
        publish(&b, &mut ctx, "jobs", "one too many", now);
        assert!(members
            .iter()
            .all(|m| m.close_reason() == Some(CloseReason::SlowConsumer)));
        assert_eq!(b.subscriber_count(), 0);
        let stats = b.topic(&t("jobs")).expect("known").stats().snapshot();
        let dropped: u64 = DropReason::ALL.iter().map(|r| stats.dropped(*r)).sum();
        assert_eq!(dropped, MEMBERS as u64 + 1, "every message is counted");
    };
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(run)
        .expect("thread")
        .join()
        .expect("no panic");
}

/// A task waker that counts its wakes (for `Subscriber::poll_room`).
struct CountWake(AtomicUsize);

impl std::task::Wake for CountWake {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn room_waker() -> (Arc<CountWake>, std::task::Waker) {
    let count = Arc::new(CountWake(AtomicUsize::new(0)));
    (count.clone(), std::task::Waker::from(count))
}

fn block_broker() -> (Broker, Arc<Subscriber>) {
    let b = Broker::new(BrokerConfig {
        queue_size: 4,
        backpressure_policy: OverflowPolicy::Block,
        ..Default::default()
    });
    let s = sub(&b, "topic:t");
    (b, s)
}

/// A durable group's feeder waits on `poll_can_take` when no member `has_room`: the two must
/// agree. With a queue smaller than the feeder's look-ahead, a member with a full queue was
/// "ready" to `poll_can_take` but had no room, so the feeder read the log again at once, in a
/// loop, for as long as the member stayed full.
#[test]
fn can_take_agrees_with_has_room_when_the_queue_is_smaller_than_the_look_ahead() {
    let (b, s) = block_broker();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let max_in_flight = b.config().max_in_flight;
    let (count, waker) = room_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    for i in 0..4 {
        assert!(s.has_room(max_in_flight));
        assert!(s.poll_can_take(&mut cx, max_in_flight, 16).is_ready());
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert!(!s.has_room(max_in_flight), "the queue (4) is full");
    assert!(s.poll_can_take(&mut cx, max_in_flight, 16).is_pending());
    // Woken once it has drained (to half the capacity, as held publishers are).
    let mut out = BytesMut::new();
    while s.queued() > 2 {
        b.drain(&s, &mut out, 1, now);
    }
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "woken once there is room"
    );
    assert!(s.poll_can_take(&mut cx, max_in_flight, 16).is_ready());
    assert!(s.has_room(max_in_flight));
}

/// A settlement (or an ack timeout) makes room under `max_in_flight`, not in the queue: it wakes
/// whoever waits to give the subscriber more (`poll_can_take`), not the publishers its full
/// queue holds (`poll_room`). It woke every held publisher, each of which looked, found the
/// queue as full as before and waited again: with many held publishers, that many useless
/// wake-ups per ACK.
#[test]
fn a_settlement_wakes_takers_not_the_publishers_a_full_queue_holds() {
    let b = Broker::new(BrokerConfig {
        queue_size: 4,
        backpressure_policy: OverflowPolicy::Block,
        ..Default::default()
    });
    let s = explicit_sub(&b, "topic:t");
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for i in 0..5 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    let (held, held_waker) = room_waker();
    assert!(s
        .poll_room(&mut std::task::Context::from_waker(&held_waker))
        .is_pending());
    let mut out = BytesMut::new();
    b.drain(&s, &mut out, 1, now);
    b.drain(&s, &mut out, 1, now);
    assert_eq!(s.queued(), 3, "above half: still held");
    // A feeder waiting for room under an in-flight limit of 5 (2 in flight, 3 queued).
    let (taker, taker_waker) = room_waker();
    let mut taker_cx = std::task::Context::from_waker(&taker_waker);
    assert!(s.poll_can_take(&mut taker_cx, 5, 16).is_pending());
    b.ack(&s, None, 0, None).expect("in flight");
    assert_eq!(
        taker.0.load(Ordering::SeqCst),
        1,
        "room under max_in_flight"
    );
    assert_eq!(
        held.0.load(Ordering::SeqCst),
        0,
        "the queue is as full as it was"
    );
    // Waiting again (under a limit of 4 now: 1 in flight, 3 queued).
    assert!(s.poll_can_take(&mut taker_cx, 4, 16).is_pending());
    let overdue = b.tick(&mut ctx, now + Duration::from_secs(3600));
    assert_eq!(overdue, 1, "the other delivery timed out");
    assert_eq!(s.queued(), 4, "and is queued again");
    assert_eq!(
        taker.0.load(Ordering::SeqCst),
        2,
        "an ack timeout wakes takers"
    );
    assert_eq!(held.0.load(Ordering::SeqCst), 0, "but not held publishers");
    // Drained to half: both go on.
    assert!(s.poll_can_take(&mut taker_cx, 4, 16).is_pending());
    while s.queued() > 2 {
        b.drain(&s, &mut out, 1, now);
    }
    assert_eq!(held.0.load(Ordering::SeqCst), 1, "woken at half");
    assert_eq!(taker.0.load(Ordering::SeqCst), 3);
}

/// The ack ticker looks through a subscription's deliveries in flight only once the earliest
/// ack-wait deadline may have passed: it scanned them all at every tick (10 a second), so a
/// client holding many unsettled deliveries cost the broker that much work per tick.
#[test]
fn the_ack_ticker_looks_through_deliveries_in_flight_only_when_one_may_be_due() {
    let b = Broker::new(BrokerConfig::default());
    let s = explicit_sub(&b, "topic:t");
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for i in 0..100 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    let mut out = BytesMut::new();
    while b.drain(&s, &mut out, 64 * 1024, now).frames > 0 {}
    assert_eq!(s.in_flight(), 100);
    let ack_wait = b.config().ack_wait;
    for tick in 1..=10 {
        assert_eq!(b.tick(&mut ctx, now + ack_wait / 20 * tick), 0);
    }
    assert_eq!(s.overdue_scans(), 0, "nothing could be due");
    // Settled ones leave the bound as it was: one look, when it passes.
    for offset in 0..50 {
        b.ack(&s, None, offset, None).expect("in flight");
    }
    let due = now + ack_wait;
    assert_eq!(b.tick(&mut ctx, due), 50, "the unsettled half timed out");
    assert_eq!(s.overdue_scans(), 1);
    // Redelivered with new deadlines: not looked at again before them.
    let later = due + Duration::from_millis(1);
    while b.drain(&s, &mut out, 64 * 1024, later).frames > 0 {}
    assert_eq!(s.in_flight(), 50);
    assert_eq!(b.tick(&mut ctx, later + ack_wait / 2), 0);
    assert_eq!(s.overdue_scans(), 1);
    assert_eq!(b.tick(&mut ctx, later + ack_wait), 50);
    assert_eq!(s.overdue_scans(), 2);
}

#[test]
fn block_loses_nothing_and_holds_the_publisher_until_half_drained() {
    let (b, s) = block_broker();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for i in 0..4 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert!(ctx.take_held().is_none(), "room for queue_size messages");
    publish(&b, &mut ctx, "t", "4", now);
    let held = ctx.take_held().expect("held once the queue is full");
    assert!(Arc::ptr_eq(&held, &s));
    assert!(ctx.take_held().is_none(), "reported once");
    // A publisher that goes on anyway loses nothing either; each full publish reports again.
    for i in 5..8 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert!(ctx.take_held().is_some());
    assert!(ctx.take_held().is_none(), "one entry per subscriber");
    assert_eq!(s.queued(), 8);

    let (count, waker) = room_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(s.poll_room(&mut cx).is_pending());
    let mut out = BytesMut::new();
    // One frame per drain (budget 1): 8 -> 3 queued is not yet half of the capacity.
    for _ in 0..5 {
        b.drain(&s, &mut out, 1, now);
        assert!(s.poll_room(&mut cx).is_pending());
    }
    assert_eq!(count.0.load(Ordering::SeqCst), 0, "not woken above half");
    b.drain(&s, &mut out, 1, now);
    assert_eq!(s.queued(), 2);
    assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken at half");
    assert!(s.poll_room(&mut cx).is_ready());

    while b.drain(&s, &mut out, 64 * 1024, now).frames > 0 {}
    let all = bodies(&decode_all(out.freeze()));
    assert_eq!(all, ["0", "1", "2", "3", "4", "5", "6", "7"]);
    let stats = b.topic(&t("t")).expect("known").stats().snapshot();
    for reason in DropReason::ALL {
        assert_eq!(stats.dropped(reason), 0, "{reason:?}");
    }
}

#[test]
fn a_dead_letter_into_a_full_block_queue_holds_the_nacking_source() {
    // Without a hold, NACKs could grow a `block` dead-letter queue without bound.
    let b = Broker::new(BrokerConfig {
        queue_size: 2,
        max_retries: 0,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = ack_sub(&b, "topic:jobs");
    let dlq = sub_with(
        &b,
        "topic:__dlq__jobs",
        SubscribeOptions {
            overflow: Some(OverflowPolicy::Block),
            ..Default::default()
        },
    );
    for i in 0..3 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
        assert_eq!(drain_all(&b, &s, now).len(), 1);
    }
    assert!(ctx.take_held().is_none());
    for offset in 0..2 {
        b.nack(&mut ctx, &s, None, offset, None, None, now)
            .expect("in flight");
        assert!(ctx.take_held().is_none(), "room in the dead-letter queue");
    }
    b.nack(&mut ctx, &s, None, 2, None, None, now)
        .expect("in flight");
    let held = ctx.take_held().expect("the third dead letter fills it");
    assert!(Arc::ptr_eq(&held, &dlq));
    assert_eq!(dlq.queued(), 3, "queued, not dropped");
}

/// A NACK redelivering into its own full `block` queue holds nothing: the message only moves
/// from in flight back to the queue. The NACKing stream was held, and with it the ACKs that
/// come on it, so the queue (at its in-flight limit) could never drain until block_timeout
/// closed the subscription.
#[test]
fn a_nack_into_its_own_full_block_queue_holds_nothing() {
    let b = Broker::new(BrokerConfig {
        queue_size: 2,
        backpressure_policy: OverflowPolicy::Block,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = ack_sub(&b, "topic:jobs");
    publish(&b, &mut ctx, "jobs", "0", now);
    assert_eq!(drain_all(&b, &s, now).len(), 1, "0 in flight");
    for i in 1..3 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    while ctx.take_held().is_some() {}
    assert_eq!(s.queued(), 2, "the queue is full");
    b.nack(&mut ctx, &s, None, 0, None, None, now)
        .expect("in flight");
    assert!(ctx.take_held().is_none(), "a redelivery holds no source");
    assert_eq!(b.watched_full(), 1, "but it is watched");
    assert_eq!(s.queued(), 3, "queued again, not dropped");
    let later = now + Duration::from_secs(5);
    let overdue = b.overdue_full(later, Some(Duration::from_secs(5)));
    assert!(overdue.len() == 1 && Arc::ptr_eq(&overdue[0], &s));
}

/// A broker whose queues hold `queue_size` messages under the block policy.
fn block_broker_of(queue_size: usize) -> Broker {
    Broker::new(BrokerConfig {
        queue_size,
        backpressure_policy: OverflowPolicy::Block,
        ..Default::default()
    })
}

/// A member of group `g` on `jobs`, settling explicitly.
fn group_member(b: &Broker) -> Arc<Subscriber> {
    sub_with(
        b,
        "topic:jobs:group:g",
        SubscribeOptions {
            ack_mode: AckMode::Explicit,
            ..Default::default()
        },
    )
}

/// A `block` group member that members leaving without settling fill past its bound is
/// watched: for what they had queued (their stream, ending, has nothing to hold back: the
/// caller hands the holds over), and for what they had in flight (a redelivery). Nothing
/// watched it, so members that join, take messages and leave grew a full member's queue
/// without end; the server now closes one that stays full past `broker.block_timeout`, as a
/// held publisher would. One that drains to half is forgotten.
#[test]
fn a_member_leaving_into_a_full_block_member_is_watched() {
    let b = block_broker_of(2);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let limit = Some(Duration::from_secs(30));
    let member = || group_member(&b);
    // `full` takes nothing: its queue fills.
    let full = member();
    publish(&b, &mut ctx, "jobs", "0", now);
    publish(&b, &mut ctx, "jobs", "1", now);
    ctx.clear_held();
    assert_eq!(full.queued(), 2, "full");
    // A member joins and takes the next message (in flight), then leaves; in the second round
    // it also has one queued, which is handed over first and held for.
    let mut expected = 2;
    for round in 0..2 {
        let churn = member();
        publish(&b, &mut ctx, "jobs", "a", now);
        assert_eq!(drain_all(&b, &churn, now).len(), 1, "round {round}: taken");
        expected += 1;
        if round > 0 {
            publish(&b, &mut ctx, "jobs", "b", now);
            assert_eq!(
                churn.queued(),
                1,
                "round {round}: queued for the member with room"
            );
            expected += 1;
        }
        ctx.clear_held();
        b.unsubscribe(&mut ctx, &churn, now);
        if round == 0 {
            assert!(ctx.take_held().is_none(), "a redelivery holds nothing");
        } else {
            // Held for the caller, which has no source to hold and hands it to the watch
            // (`watch_full`, tested on its own below: here the member is watched already).
            let held = ctx.take_held().expect("the hand-over of what was queued");
            assert!(Arc::ptr_eq(&held, &full));
        }
        assert_eq!(b.watched_full(), 1, "round {round}: watched");
        assert_eq!(full.queued(), expected, "round {round}: nothing lost");
    }
    assert!(
        b.overdue_full(now + Duration::from_secs(29), limit)
            .is_empty(),
        "not yet"
    );
    assert!(
        b.overdue_full(now + Duration::from_secs(99), None)
            .is_empty(),
        "no limit"
    );
    let overdue = b.overdue_full(now + Duration::from_secs(30), limit);
    assert!(overdue.len() == 1 && Arc::ptr_eq(&overdue[0], &full));
    assert_eq!(b.watched_full(), 0, "taken out");
    // Watched again, then drained to half and filled again before anyone looks (a busy
    // member that a publisher keeps full): forgotten, as a held publisher would have been let
    // go when it drained.
    // Only `watch_full` watches it here: the departing member had nothing in flight.
    // `before`: how many are watched before (an entry of an earlier fill may still be there).
    let watch_again = |ctx: &mut PublishContext, before: usize| {
        let churn = member();
        publish(&b, ctx, "jobs", "c", now);
        b.unsubscribe(ctx, &churn, now);
        assert_eq!(
            b.watched_full(),
            before,
            "held, not watched by the hand-over"
        );
        b.watch_full(ctx, now);
        assert_eq!(b.watched_full(), 1);
        assert!(ctx.take_held().is_none(), "handed to the watch");
    };
    // Drained to half, then refilled by a publisher (held, let go as it drained).
    let drained_to_half = |ctx: &mut PublishContext| {
        let queued = full.queued();
        let mut out = BytesMut::new();
        while full.queued() > 1 {
            assert!(b.drain(&full, &mut out, 1, now).frames > 0);
        }
        for i in 0..queued {
            publish(&b, ctx, "jobs", &format!("again {i}"), now);
        }
        ctx.clear_held();
        assert!(full.queued() > 1, "above half again");
    };
    watch_again(&mut ctx, 0);
    drained_to_half(&mut ctx);
    assert!(b
        .overdue_full(now + Duration::from_secs(99), limit)
        .is_empty());
    assert_eq!(b.watched_full(), 0, "drained in between: forgotten");
    // The same, but a hand-over fills it again before the look: that fill is watched (it was
    // taken for the first one, and forgotten with it).
    watch_again(&mut ctx, 0);
    drained_to_half(&mut ctx);
    watch_again(&mut ctx, 1);
    let overdue = b.overdue_full(now + Duration::from_secs(30), limit);
    assert!(overdue.len() == 1 && Arc::ptr_eq(&overdue[0], &full));
    // Drained to half for good.
    watch_again(&mut ctx, 0);
    drain_all(&b, &full, now);
    assert!(b
        .overdue_full(now + Duration::from_secs(99), limit)
        .is_empty());
    assert_eq!(b.watched_full(), 0, "drained: forgotten");
}

/// A member that hand-overs took far above its capacity but that keeps draining half its
/// capacity per `block_timeout` (what a held publisher asks of it) is never overdue, though it
/// stays above half for long: its time starts again each time. One that stops draining is.
/// (Judged by crossing half alone, a survivor given departing members' messages had to drain
/// all of them within the timeout, and was closed while draining steadily.)
#[test]
fn a_member_draining_steadily_far_above_its_bound_is_not_overdue() {
    let b = block_broker_of(4);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let limit = Some(Duration::from_secs(30));
    let member = || group_member(&b);
    let slow = member();
    let leaving: Vec<_> = (0..3).map(|_| member()).collect();
    for i in 0..16 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    ctx.clear_held();
    for m in &leaving {
        b.unsubscribe(&mut ctx, m, now);
    }
    b.watch_full(&mut ctx, now);
    assert_eq!(slow.queued(), 16, "four times its capacity");
    assert_eq!(b.watched_full(), 1);
    // Two messages (half its capacity) every 20 s: never overdue, though above half throughout.
    let mut out = BytesMut::new();
    let mut at = now;
    for _ in 0..5 {
        at += Duration::from_secs(20);
        for _ in 0..2 {
            assert_eq!(b.drain(&slow, &mut out, 1, at).frames, 1);
        }
        assert!(
            b.overdue_full(at, limit).is_empty(),
            "{} queued",
            slow.queued()
        );
        assert_eq!(b.watched_full(), 1, "still watched");
    }
    assert_eq!(slow.queued(), 6, "above half");
    // One message in the next 30 s: not enough.
    assert_eq!(b.drain(&slow, &mut out, 1, at).frames, 1);
    assert!(b
        .overdue_full(at + Duration::from_secs(29), limit)
        .is_empty());
    let overdue = b.overdue_full(at + Duration::from_secs(30), limit);
    assert!(overdue.len() == 1 && Arc::ptr_eq(&overdue[0], &slow));
}

/// Publishers that left while held (`note_orphaned_hold`) use up what a full `block` queue may
/// take past its capacity: after `MAX_ORPHANED_HOLDS` of them the next frame that finds it full
/// closes it as a slow consumer. Draining to half forgets them: a queue that keeps up now and
/// then is never closed for publishers that left long ago.
#[test]
fn publishers_that_left_while_held_bound_a_block_queue() {
    let limit = aqueduct_core::subscriber::MAX_ORPHANED_HOLDS;
    let now = Instant::now();
    // Drained to half between the departures and the next full publish: still held, not closed.
    let (b, s) = block_broker();
    let mut ctx = PublishContext::default();
    for i in 0..5 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    for _ in 0..limit {
        s.note_orphaned_hold();
    }
    let mut out = BytesMut::new();
    while s.queued() > 2 {
        b.drain(&s, &mut out, 1, now);
    }
    while ctx.take_held().is_some() {}
    for i in 0..3 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert!(ctx.take_held().is_some(), "held again");
    assert!(!s.is_closed());
    assert_eq!(b.slow_consumers_disconnected(), 0);
    // Not drained: one departure short of the limit, held on up to twice the capacity (8).
    for _ in 0..limit - 1 {
        s.note_orphaned_hold();
    }
    for i in 0..2 {
        publish(&b, &mut ctx, "t", &format!("x{i}"), now);
    }
    assert_eq!(s.queued(), 7);
    assert!(!s.is_closed(), "{} left, below the limit", limit - 1);
    // At the limit: still held below twice the capacity (a few one-shot publishers that got
    // their CONFIRM and left close nothing)...
    s.note_orphaned_hold();
    publish(&b, &mut ctx, "t", "y", now);
    assert_eq!(s.queued(), 8);
    assert!(!s.is_closed(), "at the limit, below twice the capacity");
    // ...and closed at it.
    publish(&b, &mut ctx, "t", "z", now);
    assert!(s.is_closed(), "closed as a slow consumer");
    assert_eq!(
        s.close_reason(),
        Some(aqueduct_core::CloseReason::SlowConsumer)
    );
    assert_eq!(b.slow_consumers_disconnected(), 1);
}

#[test]
fn a_closing_blocking_subscriber_releases_its_publishers() {
    let (b, s) = block_broker();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for i in 0..6 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert!(ctx.take_held().is_some());
    let (count, waker) = room_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(s.poll_room(&mut cx).is_pending());
    b.unsubscribe(&mut ctx, &s, now);
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert!(s.poll_room(&mut cx).is_ready());
}

/// A queued message whose lifetime is over when its subscription ends (a plain one, or a
/// group's last member) is counted as expired, not as dropped for the unsubscribe (§6.6): it
/// would never have been delivered. It was counted under `unsubscribed`.
#[test]
fn messages_past_their_lifetime_when_a_subscription_ends_are_counted_as_expired() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let later = t0 + Duration::from_millis(200);
    for filter in ["topic:plain", "topic:jobs:group:g"] {
        let s = sub(&b, filter);
        let topic = t(filter.split(':').nth(1).expect("a topic"));
        let mut short = Publication::new(&topic, b"short");
        short.ttl = Some(Duration::from_millis(10));
        b.publish(&mut ctx, &short, t0);
        b.publish(&mut ctx, &Publication::new(&topic, b"forever"), t0);
        b.unsubscribe(&mut ctx, &s, later);
        let stats = b.topic(&topic).expect("known").stats().snapshot();
        assert_eq!(stats.expired(Priority::DEFAULT), 1, "{filter}");
        assert_eq!(
            stats.dropped(DropReason::Unsubscribed),
            1,
            "{filter}: only the live one"
        );
    }
}

/// A message past its TTL that a full queue evicts (drop_oldest) is counted as expired, as
/// everywhere else (§6.6): it was counted as dropped by the policy. A live one is still a drop
/// (drop_newest refuses the newcomer, never past its TTL when it arrives).
#[test]
fn a_message_past_its_ttl_that_the_policy_evicts_is_counted_as_expired() {
    for (policy, want) in [
        (OverflowPolicy::DropOldest, (1, 0)),
        (OverflowPolicy::DropNewest, (0, 1)),
    ] {
        let b = Broker::new(BrokerConfig {
            queue_size: 1,
            backpressure_policy: policy,
            ..Default::default()
        });
        let _s = sub(&b, "topic:t");
        let mut ctx = PublishContext::default();
        let t0 = Instant::now();
        let topic = t("t");
        let mut short = Publication::new(&topic, b"short");
        short.ttl = Some(Duration::from_millis(10));
        b.publish(&mut ctx, &short, t0);
        let later = t0 + Duration::from_millis(50);
        b.publish(&mut ctx, &Publication::new(&topic, b"live"), later);
        let stats = b.topic(&topic).expect("known").stats().snapshot();
        let got = (
            stats.expired(Priority::DEFAULT),
            stats.dropped(DropReason::Policy(policy)),
        );
        assert_eq!(got, want, "{policy:?}: (expired, dropped)");
    }
}

#[test]
fn ttl_priority_override_and_message_ttl() {
    let mut cfg = BrokerConfig::default();
    cfg.priority_ttls[0] = Duration::from_millis(100);
    let b = Broker::new(cfg);
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let s = sub(&b, "topic:t");
    let topic = t("t");
    let mut p = Publication::new(&topic, b"short-own-ttl");
    p.ttl = Some(Duration::from_millis(10));
    b.publish(&mut ctx, &p, t0);
    let mut p0 = Publication::new(&topic, b"prio0-own-ttl-ignored");
    p0.priority = Priority::HIGHEST;
    p0.ttl = Some(Duration::from_secs(3600));
    b.publish(&mut ctx, &p0, t0);
    b.publish(&mut ctx, &Publication::new(&topic, b"forever"), t0);
    // At +50ms the 10ms message is gone; priority 0 lives 100ms whatever its own TTL says.
    let got = drain_all(&b, &s, t0 + Duration::from_millis(50));
    assert_eq!(bodies(&got), ["prio0-own-ttl-ignored", "forever"]);
    let stats = b.topic(&topic).expect("known").stats().snapshot();
    assert_eq!(stats.expired(Priority::DEFAULT), 1);

    b.publish(&mut ctx, &p0, t0);
    let got = drain_all(&b, &s, t0 + Duration::from_millis(100));
    assert!(got.is_empty(), "expiry is inclusive of the deadline");
    let stats = b.topic(&topic).expect("known").stats().snapshot();
    assert_eq!(stats.expired(Priority::HIGHEST), 1);
    assert_eq!(stats.delivered, 2);
}

fn ack_sub(b: &Broker, s: &str) -> Arc<Subscriber> {
    sub_with(
        b,
        s,
        SubscribeOptions {
            ack_mode: AckMode::Explicit,
            ..Default::default()
        },
    )
}

#[test]
fn nack_redelivers_then_dead_letters() {
    let b = Broker::default(); // max_retries 3
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = ack_sub(&b, "topic:orders");
    let dlq = sub(&b, "topic:__dlq__orders");
    let orders = t("orders");
    let mut trace_pub = Publication::new(&orders, b"payload");
    let trace = TraceContext {
        trace_id: [1; 16],
        span_id: [2; 8],
        flags: 1,
    };
    trace_pub.trace = Some(&trace);
    b.publish(&mut ctx, &trace_pub, now);
    for attempt in 1..=4 {
        let got = drain_all(&b, &s, now);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].attempt, attempt);
        b.nack(
            &mut ctx,
            &s,
            None,
            0,
            Some(attempt),
            Some("cannot parse"),
            now,
        )
        .expect("in flight");
    }
    assert!(drain_all(&b, &s, now).is_empty());
    let dead = drain_all(&b, &dlq, now);
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(
        (d.topic.as_str(), d.offset, d.body.as_slice()),
        ("__dlq__orders", 0, &b"payload"[..])
    );
    assert_eq!(d.ext.original_topic, Some(t("orders")));
    assert_eq!(d.ext.original_offset, Some(0));
    assert_eq!(d.ext.attempts_made, Some(4));
    assert_eq!(d.ext.reason.as_deref(), Some("cannot parse"));
    assert_eq!(d.ext.trace, Some(trace));
    let stats = b.topic(&t("orders")).expect("known").stats().snapshot();
    assert_eq!(
        (stats.nacked, stats.redelivered, stats.dead_lettered),
        (4, 3, 1)
    );
}

#[test]
fn settlement_errors_change_nothing() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = ack_sub(&b, "topic:orders");
    let w = ack_sub(&b, "topic:orders/#");
    assert!(matches!(
        b.ack(&s, None, 0, None),
        Err(SettleError::NotInFlight { offset: 0, .. })
    ));
    publish(&b, &mut ctx, "orders", "x", now);
    drain_all(&b, &s, now);
    drain_all(&b, &w, now);
    b.nack(&mut ctx, &s, None, 0, None, None, now)
        .expect("in flight");
    drain_all(&b, &s, now); // attempt 2 now in flight
    let err = b.ack(&s, None, 0, Some(1)).expect_err("stale");
    assert_eq!(err.code(), ErrorCode::STALE_ATTEMPT);
    assert_eq!(s.in_flight(), 1);
    assert_eq!(b.ack(&w, None, 0, None), Err(SettleError::TopicRequired));
    assert_eq!(SettleError::TopicRequired.code(), ErrorCode::TOPIC_REQUIRED);
    assert!(b.ack(&w, Some(&t("orders/x")), 0, None).is_err());
    b.ack(&w, Some(&t("orders")), 0, Some(1))
        .expect("wildcard ack with topic");
    b.ack(&s, None, 0, Some(2)).expect("current attempt");
    assert!(b.ack(&s, None, 0, Some(2)).is_err(), "settled only once");
    // Plain subscriptions without explicit acks have nothing in flight.
    let auto = sub(&b, "topic:orders");
    publish(&b, &mut ctx, "orders", "y", now);
    assert_eq!(drain_all(&b, &auto, now).len(), 1);
    assert_eq!(auto.in_flight(), 0);
}

#[test]
fn ack_wait_timeout_redelivers() {
    let b = Broker::new(BrokerConfig {
        ack_wait: Duration::from_secs(30),
        max_retries: 1,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let s = ack_sub(&b, "topic:t");
    publish(&b, &mut ctx, "t", "x", t0);
    assert_eq!(drain_all(&b, &s, t0)[0].attempt, 1);
    assert_eq!(b.tick(&mut ctx, t0 + Duration::from_secs(29)), 0);
    assert_eq!(b.tick(&mut ctx, t0 + Duration::from_secs(30)), 1);
    let t1 = t0 + Duration::from_secs(31);
    assert_eq!(drain_all(&b, &s, t1)[0].attempt, 2);
    // max_retries 1: the second timeout dead-letters it with reason "ack timeout".
    let dlq = sub(&b, "topic:__dlq__t");
    assert_eq!(
        b.expire_in_flight(&mut ctx, &s, t1 + Duration::from_secs(30)),
        1
    );
    let dead = drain_all(&b, &dlq, t1);
    assert_eq!(dead[0].ext.reason.as_deref(), Some("ack timeout"));
    assert_eq!(dead[0].ext.attempts_made, Some(2));
}

#[test]
fn group_nack_goes_to_another_member() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let m1 = sub(&b, "topic:jobs:group:g");
    let m2 = sub(&b, "topic:jobs:group:g");
    publish(&b, &mut ctx, "jobs", "x", now);
    let (first, second) = if drain_all(&b, &m1, now).len() == 1 {
        (&m1, &m2)
    } else {
        (&m2, &m1)
    };
    assert_eq!(first.in_flight(), 1);
    b.nack(&mut ctx, first, None, 0, Some(1), None, now)
        .expect("in flight");
    let got = drain_all(&b, second, now);
    assert_eq!((got.len(), got[0].attempt), (1, 2));
    assert!(drain_all(&b, first, now).is_empty());
}

/// A member that NACKs while every other member is full takes its message back: handing it
/// to a full member dropped it under drop_newest (never tried again, never dead-lettered).
#[test]
fn a_nack_while_the_other_members_are_full_comes_back_to_the_nacking_member() {
    let b = Broker::new(BrokerConfig {
        queue_size: 1,
        backpressure_policy: OverflowPolicy::DropNewest,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let stalled = sub(&b, "topic:jobs:group:g");
    let live = sub(&b, "topic:jobs:group:g");
    publish(&b, &mut ctx, "jobs", "a", now);
    publish(&b, &mut ctx, "jobs", "b", now);
    let got = drain_all(&b, &live, now);
    assert_eq!(got.len(), 1);
    assert_eq!(stalled.queued(), 1, "the stalled member's queue is full");
    b.nack(&mut ctx, &live, None, got[0].offset, Some(1), None, now)
        .expect("in flight");
    let again = drain_all(&b, &live, now);
    assert_eq!(
        again
            .iter()
            .map(|g| (g.offset, g.attempt))
            .collect::<Vec<_>>(),
        [(got[0].offset, 2)]
    );
    let stats = b.topic(&t("jobs")).expect("known").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::DropNewest)),
        0
    );
}

/// A message whose lifetime ends while it is in flight is not tried again or dead-lettered
/// when it is NACKed or times out: it is dropped as expired (a dead letter carries no TTL, so
/// its body reached the dead-letter topic after its lifetime).
#[test]
fn an_expired_message_is_neither_redelivered_nor_dead_lettered() {
    let b = Broker::new(BrokerConfig {
        max_retries: 0,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let s = ack_sub(&b, "topic:exp");
    let dlq = sub(&b, "topic:__dlq__exp");
    let topic = t("exp");
    let mut p = Publication::new(&topic, b"short");
    p.ttl = Some(Duration::from_millis(100));
    b.publish(&mut ctx, &p, t0);
    assert_eq!(drain_all(&b, &s, t0).len(), 1);
    // The ack wait (30 s) ends long after the lifetime: the last attempt's timeout.
    assert_eq!(
        b.expire_in_flight(&mut ctx, &s, t0 + Duration::from_secs(30)),
        1
    );
    assert!(drain_all(&b, &dlq, t0 + Duration::from_secs(30)).is_empty());
    let expired_dead_redelivered = |b: &Broker| {
        let stats = b.topic(&topic).expect("known").stats().snapshot();
        (
            stats.expired(Priority::DEFAULT),
            stats.dead_lettered,
            stats.redelivered,
        )
    };
    assert_eq!(expired_dead_redelivered(&b), (1, 0, 0));
    // A NACK after the lifetime, with retries left.
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let s = ack_sub(&b, "topic:exp");
    b.publish(&mut ctx, &p, t0);
    assert_eq!(drain_all(&b, &s, t0).len(), 1);
    let late = t0 + Duration::from_millis(150);
    b.nack(&mut ctx, &s, None, 0, Some(1), None, late)
        .expect("in flight");
    assert_eq!(s.queued() + s.in_flight(), 0, "not queued again");
    assert_eq!(expired_dead_redelivered(&b), (1, 0, 0));
}

#[test]
fn dead_letters_are_not_dead_lettered_again() {
    let b = Broker::new(BrokerConfig {
        max_retries: 0,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let s = ack_sub(&b, "topic:t");
    let dlq = ack_sub(&b, "topic:__dlq__t");
    publish(&b, &mut ctx, "t", "x", now);
    drain_all(&b, &s, now);
    b.nack(&mut ctx, &s, None, 0, None, None, now)
        .expect("in flight");
    assert_eq!(drain_all(&b, &dlq, now).len(), 1);
    b.nack(&mut ctx, &dlq, None, 0, None, None, now)
        .expect("in flight");
    assert!(b.topic(&t("__dlq____dlq__t")).is_none());
    let stats = b.topic(&t("__dlq__t")).expect("known").stats().snapshot();
    assert_eq!(stats.dropped(DropReason::RetriesExhausted), 1);
}

#[test]
fn dlq_topic_names_stay_within_255_bytes() {
    let long = "é".repeat(127); // 254 bytes
    let d = dlq_topic(&t(&long));
    assert!(d.len() <= 255);
    assert!(d.as_str().starts_with("__dlq__é"));
    assert_eq!(dlq_topic(&t("orders")).as_str(), "__dlq__orders");
}

/// A broker with `max_in_flight`, and an explicitly acknowledged subscription to `t` whose
/// writer wake-ups are counted.
fn explicit_sub_on_t(max_in_flight: usize) -> (Broker, Arc<Subscriber>, Arc<AtomicUsize>) {
    let b = Broker::new(BrokerConfig {
        max_in_flight,
        ..Default::default()
    });
    let (woken, waker) = counting_waker();
    let s = sub_with(
        &b,
        "topic:t",
        SubscribeOptions {
            ack_mode: AckMode::Explicit,
            waker: Some(waker),
            ..Default::default()
        },
    );
    (b, s, woken)
}

#[test]
fn max_in_flight_bounds_unsettled_deliveries() {
    let (b, s, woken) = explicit_sub_on_t(2);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for i in 0..5 {
        publish(&b, &mut ctx, "t", &i.to_string(), now);
    }
    assert_eq!(
        woken.load(Ordering::SeqCst),
        1,
        "woken once: empty to non-empty"
    );
    let mut out = BytesMut::new();
    let d = b.drain(&s, &mut out, 1 << 20, now);
    assert_eq!((d.frames, d.blocked), (2, true));
    b.ack(&s, None, 0, None).expect("in flight");
    assert_eq!(woken.load(Ordering::SeqCst), 2, "woken when room opened");
    let d = b.drain(&s, &mut out, 1 << 20, now);
    assert_eq!((d.frames, d.blocked), (1, true));
}

/// An ack-wait timeout makes room under `max_in_flight` as an ACK does: the writer is woken,
/// and what was queued behind the limit (and the redelivery) gets written. Without the wake a
/// stream whose queue was not empty stalled until something unrelated woke its writer.
#[test]
fn an_ack_timeout_wakes_the_writer_of_a_subscription_at_max_in_flight() {
    let (b, s, woken) = explicit_sub_on_t(1);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    publish(&b, &mut ctx, "t", "m0", now);
    publish(&b, &mut ctx, "t", "m1", now);
    assert_eq!(woken.load(Ordering::SeqCst), 1);
    let mut out = BytesMut::new();
    let d = b.drain(&s, &mut out, 1 << 20, now);
    assert_eq!((d.frames, d.blocked), (1, true), "m0 written, m1 held back");
    // m0 is never acknowledged: after ack_wait it is taken back for redelivery.
    let later = now + b.config().ack_wait + Duration::from_millis(1);
    assert_eq!(b.tick(&mut ctx, later), 1);
    assert_eq!(
        woken.load(Ordering::SeqCst),
        2,
        "woken: room under max_in_flight"
    );
    let d = b.drain(&s, &mut out, 1 << 20, later);
    assert_eq!(d.frames, 1, "the next one is written");
}

#[test]
fn parallel_publishers_lose_nothing() {
    let b = Arc::new(Broker::new(BrokerConfig {
        queue_size: 100_000,
        ..Default::default()
    }));
    let s = sub(&b, "topic:load/+");
    let now = Instant::now();
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut ctx = PublishContext::default();
                let topic = t(&format!("load/{i}"));
                for n in 0..5000u32 {
                    b.publish(&mut ctx, &Publication::new(&topic, &n.to_le_bytes()), now);
                }
            })
        })
        .collect();
    for th in threads {
        th.join().expect("publisher thread");
    }
    let got = drain_all(&b, &s, now);
    assert_eq!(got.len(), 20_000);
    let per_topic: BTreeMap<String, BTreeSet<u64>> =
        got.iter().fold(BTreeMap::new(), |mut m, g| {
            m.entry(g.topic.clone()).or_default().insert(g.offset);
            m
        });
    for offsets in per_topic.values() {
        assert_eq!(offsets.len(), 5000);
        assert_eq!(offsets.iter().next_back(), Some(&4999));
    }
}

#[test]
fn publish_batch_keeps_order_offsets_and_group_round_robin() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let all = sub(&b, "topic:#");
    let a_only = sub(&b, "topic:a");
    let g1 = sub(&b, "topic:g:group:w");
    let g2 = sub(&b, "topic:g:group:w");
    let (ta, tb, tg, tn) = (t("a"), t("b"), t("g"), t("nobody/x/y"));
    let seq = [&ta, &ta, &tb, &ta, &tg, &tg, &tg, &tg, &tn, &ta];
    let bodies_in: Vec<String> = (0..seq.len()).map(|i| i.to_string()).collect();
    let publications: Vec<Publication<'_>> = seq
        .iter()
        .zip(&bodies_in)
        .map(|(topic, body)| Publication::new(topic, body.as_bytes()))
        .collect();
    let mut offsets = vec![];
    let routed = b.publish_batch(&mut ctx, publications.iter().copied(), now, |_, o| {
        offsets.push(o)
    });
    assert_eq!(offsets, [0, 1, 0, 2, 0, 1, 2, 3, 0, 3]);
    // a: 4 messages x 2 subscribers; b: 1 x 1; g: 4 x (plain # + one group member); nobody/x/y: 1 x 1.
    assert_eq!(routed, 8 + 1 + 8 + 1);
    assert_eq!(bodies(&drain_all(&b, &all, now)), bodies_in);
    assert_eq!(bodies(&drain_all(&b, &a_only, now)), ["0", "1", "3", "9"]);
    let (n1, n2) = (drain_all(&b, &g1, now).len(), drain_all(&b, &g2, now).len());
    assert_eq!(
        (n1, n2),
        (2, 2),
        "a batch still round-robins over the group"
    );
    let stats = b.topic(&ta).expect("known").stats().snapshot();
    assert_eq!((stats.published, stats.delivered), (4, 8));
}

/// A batch to a topic a group subscribes to is routed message by message in one pass: the
/// look-ahead for a run of one topic walked the rest of the batch for every message (quadratic:
/// a client could make one frame cost minutes of CPU).
#[test]
fn a_batch_through_a_group_is_walked_once() {
    #[derive(Clone)]
    struct Counted<'a> {
        inner: std::slice::Iter<'a, Publication<'a>>,
        steps: std::rc::Rc<std::cell::Cell<usize>>,
    }
    impl<'a> Iterator for Counted<'a> {
        type Item = Publication<'a>;
        fn next(&mut self) -> Option<Publication<'a>> {
            self.steps.set(self.steps.get() + 1);
            self.inner.next().copied()
        }
    }
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let _member = sub(&b, "topic:jobs:group:g");
    let topic = t("jobs");
    let n = 2_000;
    let publications = vec![Publication::new(&topic, b"x"); n];
    let steps = std::rc::Rc::new(std::cell::Cell::new(0));
    let batch = Counted {
        inner: publications.iter(),
        steps: steps.clone(),
    };
    assert_eq!(b.publish_batch(&mut ctx, batch, now, |_, _| {}), n);
    assert!(
        steps.get() <= 4 * n,
        "{} steps for {n} messages",
        steps.get()
    );
}

/// A stalled member (its writer drains nothing) fills its queue; the round-robin then skips it
/// instead of dropping its share under drop_oldest while the other member is idle.
#[test]
fn a_group_skips_a_stalled_member_until_every_member_is_full() {
    let b = Broker::new(BrokerConfig {
        queue_size: 8,
        backpressure_policy: OverflowPolicy::DropOldest,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let stalled = sub(&b, "topic:jobs:group:w");
    let live = sub(&b, "topic:jobs:group:w");
    let mut delivered = 0;
    for i in 0..200 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
        // The live member keeps up (and settles what it gets).
        for g in drain_all(&b, &live, now) {
            b.ack(&live, Some(&t("jobs")), g.offset, None).expect("ack");
            delivered += 1;
        }
    }
    assert_eq!(stalled.queued(), 8, "the stalled member holds a full queue");
    assert_eq!(delivered, 192, "everything else went to the live member");
    let stats = b.topic(&t("jobs")).expect("topic").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Policy(OverflowPolicy::DropOldest)),
        0
    );
    // Once both are full, the turn falls back to any member and the policy applies.
    for i in 0..40 {
        publish(&b, &mut ctx, "jobs", &format!("late {i}"), now);
    }
    let stats = b.topic(&t("jobs")).expect("topic").stats().snapshot();
    assert!(stats.dropped(DropReason::Policy(OverflowPolicy::DropOldest)) > 0);
}

/// A member at max_in_flight (it received but never settles) gets nothing more while another
/// member can take messages.
#[test]
fn a_group_skips_a_member_at_max_in_flight() {
    let b = Broker::new(BrokerConfig {
        max_in_flight: 4,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let hoarder = sub(&b, "topic:jobs:group:w");
    let worker = sub(&b, "topic:jobs:group:w");
    let mut hoarded = 0;
    let mut worked = 0;
    for i in 0..100 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
        hoarded += drain_all(&b, &hoarder, now).len();
        for g in drain_all(&b, &worker, now) {
            b.ack(&worker, Some(&t("jobs")), g.offset, None)
                .expect("ack");
            worked += 1;
        }
    }
    assert_eq!(hoarder.in_flight(), 4);
    assert_eq!((hoarded, worked), (4, 96));
    assert_eq!(
        hoarder.queued(),
        0,
        "nothing waits behind the hoarder's settlements"
    );
}

/// Publishing to ever new topic names does not grow the broker's topic state without bound:
/// idle topics without subscribers are evicted; a subscribed topic keeps its state and offsets;
/// counters of evicted topics are kept in a total.
#[test]
fn idle_topics_are_evicted_and_subscribed_ones_kept() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let kept = sub(&b, "topic:kept");
    let wild = sub(&b, "topic:watched/+");
    publish(&b, &mut ctx, "kept", "a", now);
    publish(&b, &mut ctx, "watched/x", "a", now);
    let _ = drain_all(&b, &kept, now);
    let _ = drain_all(&b, &wild, now);
    const N: usize = 100_000;
    for i in 0..N {
        publish(&b, &mut ctx, &format!("random/{i}"), "x", now);
    }
    assert!(
        b.topic_count() <= IDLE_TOPIC_SWEEP_MIN,
        "topic state is bounded: {}",
        b.topic_count()
    );
    assert!(b.topics_evicted() >= (N - IDLE_TOPIC_SWEEP_MIN) as u64);
    // Subscribed topics keep their offsets.
    assert_eq!(publish(&b, &mut ctx, "kept", "b", now).offset, 1);
    assert_eq!(publish(&b, &mut ctx, "watched/x", "b", now).offset, 1);
    // Every publish is still counted somewhere.
    let live: u64 = b
        .topics()
        .iter()
        .map(|t| t.stats().snapshot().published)
        .sum();
    assert_eq!(live + b.evicted_topic_stats().published, N as u64 + 4);
}

/// A wildcard subscriber matches every topic, so matched topics cannot all be kept: beyond
/// `MATCHED_TOPICS_KEPT` idle ones are freed too. A freed topic published to again resumes above
/// every offset it used, so an offset never names two messages of one topic.
#[test]
fn a_wildcard_subscriber_does_not_pin_every_topic() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let all = sub(&b, "topic:#");
    let mut last = BTreeMap::new();
    for name in ["kept", "random/0"] {
        for body in ["a", "b", "c"] {
            last.insert(name, publish(&b, &mut ctx, name, body, now).offset);
        }
    }
    let _ = drain_all(&b, &all, now);
    let n = 4 * MATCHED_TOPICS_KEPT;
    let mut most = 0;
    for i in 1..n {
        publish(&b, &mut ctx, &format!("random/{i}"), "x", now);
        most = most.max(b.topic_count());
        if i % 1024 == 0 {
            // A subscriber that keeps up (its queued messages hold their topics).
            let _ = drain_all(&b, &all, now);
        }
    }
    assert!(
        most <= 2 * MATCHED_TOPICS_KEPT + 1024,
        "topic state is bounded with a `#` subscriber: at most {most}"
    );
    assert!(b.topics_evicted() >= (n - 2 * MATCHED_TOPICS_KEPT) as u64);
    let _ = drain_all(&b, &all, now);
    for (name, before) in last {
        let again = publish(&b, &mut ctx, name, "d", now).offset;
        assert!(
            again > before,
            "{name}: offset {again} after {before}: offsets of a freed topic go on upwards"
        );
    }
}

/// Without an offset source, a topic freed while idle and published to again does not restart
/// at 0: it starts at the highest next offset of any freed topic.
#[test]
fn a_freed_topic_resumes_above_its_offsets() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for body in ["a", "b", "c"] {
        publish(&b, &mut ctx, "a", body, now);
    }
    assert_eq!(publish(&b, &mut ctx, "b", "x", now).offset, 0);
    drop(ctx);
    assert_eq!(b.sweep_idle_topics(), 2);
    let mut ctx = PublishContext::default();
    assert_eq!(publish(&b, &mut ctx, "a", "d", now).offset, 3);
    assert_eq!(publish(&b, &mut ctx, "b", "y", now).offset, 3);
    assert_eq!(publish(&b, &mut ctx, "new", "z", now).offset, 3);
}

/// What a metrics scrape reads of every topic does not keep them from being freed: a sweep
/// while the scrape works through the snapshot frees the idle ones. Before, the scrape got the
/// topics' states themselves, every topic looked in use, and a sweep then freed none.
#[test]
fn a_topic_snapshot_keeps_no_topic_from_being_freed() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for topic in ["a", "b", "c"] {
        publish(&b, &mut ctx, topic, "x", now);
    }
    drop(ctx);
    let (snapshot, _) = b.topic_snapshots_and_evicted_stats();
    assert_eq!(snapshot.len(), 3);
    assert_eq!(
        b.sweep_idle_topics(),
        3,
        "all idle, the snapshot held meanwhile"
    );
    let published: u64 = snapshot.iter().map(|(_, _, s)| s.published).sum();
    assert_eq!(published, 3);
}

/// `with_topics_frozen` says which topics the broker holds (published to and not freed), and no
/// topic is created while it runs: a publish to a new topic from another thread waits for it.
#[test]
fn topics_frozen_says_which_are_held_and_holds_off_new_ones() {
    let b = std::sync::Arc::new(Broker::new(BrokerConfig::default()));
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    publish(&b, &mut ctx, "a", "x", now);
    drop(ctx);
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let publisher = b.clone();
    let seen = b.with_topics_frozen(|held| {
        let during = std::thread::spawn(move || {
            started_tx.send(()).expect("send");
            let mut ctx = PublishContext::default();
            publish(&publisher, &mut ctx, "new", "y", Instant::now());
        });
        started_rx.recv().expect("started");
        // Given time, the other thread would have created "new" by now if it could.
        std::thread::sleep(std::time::Duration::from_millis(50));
        (held(b"a"), held(b"b"), held(b"new"), during)
    });
    assert!(seen.0 && !seen.1);
    assert!(!seen.2, "no topic is created while frozen");
    seen.3.join().expect("publisher");
    assert!(b.with_topics_frozen(|held| held(b"new")));
}

/// A detached member (its client stopped reading) gets nothing more; its queued messages go to
/// the other member; what it has in flight can still be acknowledged.
#[test]
fn a_detached_member_keeps_its_in_flight_and_loses_its_queue() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let a = sub(&b, "topic:jobs:group:w");
    let other = sub(&b, "topic:jobs:group:w");
    for i in 0..4 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    // `a` received one of its two (in flight), the other is still queued.
    let mut out = BytesMut::new();
    assert_eq!(b.drain(&a, &mut out, 1, now).frames, 1);
    let sent = decode_all(out.freeze());
    assert_eq!(a.queued(), 1);
    b.detach(&mut ctx, &a, now);
    assert_eq!((a.queued(), a.in_flight()), (0, 1));
    for i in 4..8 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    assert_eq!(a.queued(), 0, "nothing more is routed to it");
    assert_eq!(drain_all(&b, &other, now).len(), 2 + 1 + 4);
    b.ack(&a, Some(&t("jobs")), sent[0].offset, None)
        .expect("its delivery in flight can still be settled");
}

/// A seed-style group member (its deliveries carry no offset to ACK) is settled as it is
/// written: nothing waits in flight, the group's committed offset moves on.
#[test]
fn seed_style_group_members_settle_on_delivery() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let seed = sub_with(
        &b,
        "topic:jobs:group:w",
        SubscribeOptions {
            seed_form: true,
            ..SubscribeOptions::default()
        },
    );
    for i in 0..3 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    let mut out = BytesMut::new();
    assert_eq!(b.drain(&seed, &mut out, 64 * 1024, now).frames, 3);
    assert_eq!(seed.in_flight(), 0);
    let group = &b.groups()[0];
    assert_eq!(group.committed_offset(&t("jobs")), Some(3));
    // The frames are the seed's: bare PUBLISH, the body as the payload.
    assert_eq!(&out[..11], &[0x1F, 0x01, 0, 0, 0, 0, 1, 0, 0, 0, b'0']);
}

/// Detaching the only member keeps its group: a member that joins meanwhile gets the detached
/// member's redeliveries (not dropped), and nothing new is queued for the detached one.
#[test]
fn a_detached_only_member_hands_its_redeliveries_to_a_new_member() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let a = sub(&b, "topic:jobs:group:w");
    publish(&b, &mut ctx, "jobs", "job", t0);
    assert_eq!(drain_all(&b, &a, t0).len(), 1);
    b.detach(&mut ctx, &a, t0);
    let newcomer = sub(&b, "topic:jobs:group:w");
    assert_eq!(b.groups().len(), 1, "the same group");
    // A's delivery times out: it goes to the newcomer, as attempt 2.
    let later = t0 + BrokerConfig::default().ack_wait + Duration::from_millis(1);
    assert_eq!(b.expire_in_flight(&mut ctx, &a, later), 1);
    let got = drain_all(&b, &newcomer, later);
    assert_eq!((got.len(), got[0].attempt), (1, 2));
    assert_eq!(a.queued(), 0);
}

/// Members `a` and `other` of group `w` on `jobs`, and one job published, in flight on `a`.
fn a_holding_one_job(
    b: &Broker,
    ctx: &mut PublishContext,
    now: Instant,
) -> (Arc<Subscriber>, Arc<Subscriber>) {
    let a = sub(b, "topic:jobs:group:w");
    let other = sub(b, "topic:jobs:group:w");
    publish(b, ctx, "jobs", "job", now);
    assert_eq!(drain_all(b, &a, now).len(), 1, "the first turn is a's");
    (a, other)
}

/// A group whose last live member leaves while a detached member still holds an unsettled
/// delivery is kept: the delivery's redelivery reaches a member joining later (protocol.md
/// 7.4). Before, the group was dropped when its member list emptied, and the redelivery was
/// dropped as unsubscribed.
#[test]
fn a_group_outlives_its_live_members_while_a_detached_one_owes_redeliveries() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let (a, other) = a_holding_one_job(&b, &mut ctx, t0);
    b.detach(&mut ctx, &a, t0);
    b.unsubscribe(&mut ctx, &other, t0);
    assert_eq!(b.groups().len(), 1, "kept for the detached member");
    let newcomer = sub(&b, "topic:jobs:group:w");
    assert_eq!(b.groups().len(), 1, "the same group");
    let later = t0 + BrokerConfig::default().ack_wait + Duration::from_millis(1);
    assert_eq!(b.expire_in_flight(&mut ctx, &a, later), 1);
    let got = drain_all(&b, &newcomer, later);
    assert_eq!((got.len(), got[0].attempt), (1, 2));
    // Once the detached member is removed too, and the newcomer leaves, the group goes.
    b.unsubscribe(&mut ctx, &a, later);
    assert_eq!(b.groups().len(), 1, "the newcomer is still a member");
    b.unsubscribe(&mut ctx, &newcomer, later);
    assert!(b.groups().is_empty());
}

/// A group kept only for a detached member is not routed here: the cluster asks
/// `has_group` whether to forward a group's message to a peer's member instead.
#[test]
fn a_group_of_detached_members_only_is_not_routed_here() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let a = sub(&b, "topic:jobs:group:w");
    let filter = aqueduct_proto::TopicFilter::try_from("jobs").expect("filter");
    let group = a.group().expect("a member").id().clone();
    assert!(b.has_group(&filter, &group));
    b.detach(&mut ctx, &a, t0);
    assert_eq!(b.groups().len(), 1, "kept for the detached member");
    assert!(!b.has_group(&filter, &group));
}

/// A group member whose routing stops before it is removed (a revocation: the stream takes
/// it out of routing at once, ends it later) still hands its unsettled deliveries to its
/// group, which outlives its other members meanwhile.
#[test]
fn a_member_taken_out_of_routing_then_revoked_hands_its_deliveries_to_its_group() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let t0 = Instant::now();
    let (a, other) = a_holding_one_job(&b, &mut ctx, t0);
    b.stop_routing(&a);
    b.unsubscribe(&mut ctx, &other, t0);
    let newcomer = sub(&b, "topic:jobs:group:w");
    assert_eq!(b.groups().len(), 1, "the same group");
    assert!(b.revoke(&mut ctx, &a, t0));
    let got = drain_all(&b, &newcomer, t0);
    assert_eq!((got.len(), got[0].attempt), (1, 2));
    b.unsubscribe(&mut ctx, &newcomer, t0);
    assert!(b.groups().is_empty());
}

/// A consumer group keeps a watermark per topic it received; the watermarks of topics the
/// broker freed (idle, every message settled) go with them. Before, a long-lived group under a
/// wildcard kept one per topic name ever published, whatever the sweep freed.
#[test]
fn a_groups_watermarks_of_freed_topics_are_freed_with_them() {
    let b = Broker::new(BrokerConfig::default());
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let member = sub(&b, "topic:t/+:group:g");
    let n = MATCHED_TOPICS_KEPT + 4000;
    for i in 0..n {
        publish(&b, &mut ctx, &format!("t/{i}"), "x", now);
        let got = drain_all(&b, &member, now);
        assert_eq!(got.len(), 1, "t/{i}");
        b.ack(&member, Some(&t(&got[0].topic)), got[0].offset, None)
            .expect("acknowledged");
    }
    drop(ctx);
    b.sweep_idle_topics();
    assert!(b.topic_count() < n, "topics were freed");
    let [g] = &b.groups()[..] else {
        panic!("one group")
    };
    let marks = g.committed_offsets().len();
    assert!(
        marks <= b.topic_count(),
        "{marks} watermarks for {} topics",
        b.topic_count()
    );
}

#[test]
fn new_topics_take_their_first_offset_from_the_offset_source() {
    let b = Broker::new(BrokerConfig::default());
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    assert!(b.set_offset_source(Box::new(move |topic| {
        counter.fetch_add(1, Ordering::Relaxed);
        if topic.as_str() == "kept" {
            500
        } else {
            7
        }
    })));
    assert!(!b.set_offset_source(Box::new(|_| 0)), "set once");
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let first = b.publish(&mut ctx, &Publication::new(&t("kept"), b"x"), now);
    let second = b.publish(&mut ctx, &Publication::new(&t("kept"), b"y"), now);
    let other = b.publish(&mut ctx, &Publication::new(&t("other"), b"z"), now);
    assert_eq!((first.offset, second.offset, other.offset), (500, 501, 7));
    assert_eq!(
        asked.load(Ordering::Relaxed),
        2,
        "asked once per topic created"
    );
    // Evicted while idle, then published to again: asked again.
    drop(ctx);
    assert_eq!(b.sweep_idle_topics(), 2);
    let mut ctx = PublishContext::default();
    let again = b.publish(&mut ctx, &Publication::new(&t("kept"), b"w"), now);
    assert_eq!(again.offset, 500);
    assert_eq!(asked.load(Ordering::Relaxed), 3);
}

#[test]
fn an_unrouted_subscriber_gets_only_what_is_fed_with_its_offsets() {
    let b = Broker::new(BrokerConfig::default());
    let sub = b.subscribe_unrouted(
        &spec("topic:log/+"),
        SubscribeOptions {
            ack_mode: AckMode::Explicit,
            ..SubscribeOptions::default()
        },
    );
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    publish(&b, &mut ctx, "log/a", "live", now);
    assert!(
        drain_all(&b, &sub, now).is_empty(),
        "routing never feeds it"
    );
    let topic = t("log/a");
    for (o, body) in [(10u64, "x"), (11, "y"), (12, "z")] {
        assert!(b.feed(
            &mut ctx,
            &sub,
            &topic,
            o,
            &Publication::new(&topic, body.as_bytes()),
            Duration::ZERO,
            now
        ));
    }
    // Published long ago with a 1 s TTL: expired, not queued.
    let mut old = Publication::new(&topic, b"stale");
    old.ttl = Some(Duration::from_secs(1));
    assert!(b.feed(
        &mut ctx,
        &sub,
        &topic,
        13,
        &old,
        Duration::from_secs(5),
        now
    ));
    let got = drain_all(&b, &sub, now);
    assert_eq!(
        got.iter()
            .map(|g| (g.offset, g.body.clone()))
            .collect::<Vec<_>>(),
        vec![
            (10, b"x".to_vec()),
            (11, b"y".to_vec()),
            (12, b"z".to_vec())
        ]
    );
    assert_eq!(sub.unsettled_floor(), vec![(topic.clone(), 10)]);
    b.ack(&sub, Some(&topic), 10, None).expect("ack");
    b.ack(&sub, Some(&topic), 12, None).expect("ack");
    assert_eq!(sub.unsettled_floor(), vec![(topic.clone(), 11)]);
    b.ack(&sub, Some(&topic), 11, None).expect("ack");
    assert!(sub.unsettled_floor().is_empty());
    assert_eq!(b.subscriber_count(), 1);
    b.unsubscribe(&mut ctx, &sub, now);
    assert!(sub.is_closed());
    assert!(!b.feed(
        &mut ctx,
        &sub,
        &topic,
        14,
        &Publication::new(&topic, b"late"),
        Duration::ZERO,
        now
    ));
    assert_eq!(b.subscriber_count(), 0);
}

/// A durable (unrouted) group's note of a topic's settled offsets goes when the topic is
/// evicted, as a routed group's does: the sweep looked at routed groups only, so a long-lived
/// durable group kept an entry for every topic it ever had a hand-over or redelivery in.
#[test]
fn an_unrouted_group_forgets_evicted_topics() {
    let b = Broker::new(BrokerConfig::default());
    let (m1, m2, shared) = two_unrouted_members(&b, "topic:jobs/+:group:g:durable:g:earliest");
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    publish(&b, &mut ctx, "jobs/x", "live", now); // the topic's state
    let topic = t("jobs/x");
    assert!(b.feed(
        &mut ctx,
        &m1,
        &topic,
        0,
        &Publication::new(&topic, b"x"),
        Duration::ZERO,
        now
    ));
    assert_eq!(drain_all(&b, &m1, now).len(), 1);
    b.unsubscribe(&mut ctx, &m1, now); // handed to m2
    let got = drain_all(&b, &m2, now);
    assert_eq!(got.len(), 1);
    b.ack(&m2, Some(&topic), got[0].offset, None).expect("ack");
    assert!(!shared.committed_offsets().is_empty(), "noted");
    drop(ctx);
    for _ in 0..2 {
        b.sweep_idle_topics();
    }
    assert!(b.topic(&topic).is_none(), "evicted");
    assert_eq!(shared.committed_offsets(), vec![]);
}

/// A member of the durable (unrouted) group `subscribe` names, with explicit acks.
fn unrouted_member(b: &Broker, subscribe: &str) -> Arc<Subscriber> {
    let opts = SubscribeOptions {
        ack_mode: AckMode::Explicit,
        ..SubscribeOptions::default()
    };
    b.subscribe_unrouted(&spec(subscribe), opts)
}

/// Two members of the durable (unrouted) group `subscribe` names, with explicit acks, and
/// their group.
fn two_unrouted_members(
    b: &Broker,
    subscribe: &str,
) -> (Arc<Subscriber>, Arc<Subscriber>, Arc<GroupShared>) {
    let m1 = unrouted_member(b, subscribe);
    let m2 = unrouted_member(b, subscribe);
    let shared = m1.group().cloned().expect("a group");
    assert!(Arc::ptr_eq(&shared, m2.group().expect("same group")));
    (m1, m2, shared)
}

#[test]
fn an_unrouted_group_hands_a_leaving_members_messages_to_the_others() {
    let b = Broker::new(BrokerConfig::default());
    const GROUP: &str = "topic:jobs:group:g:durable:g:earliest";
    let (m1, m2, shared) = two_unrouted_members(&b, GROUP);
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    publish(&b, &mut ctx, "jobs", "live", now);
    assert!(
        drain_all(&b, &m1, now).is_empty() && drain_all(&b, &m2, now).is_empty(),
        "not routed"
    );
    let topic = t("jobs");
    // Round-robin over the members.
    let mut picked = Vec::new();
    for o in 0..4u64 {
        let m = b.group_member(&shared).expect("a member");
        picked.push(m.id());
        assert!(b.feed(
            &mut ctx,
            &m,
            &topic,
            o,
            &Publication::new(&topic, b"x"),
            Duration::ZERO,
            now
        ));
    }
    assert_ne!(picked[0], picked[1]);
    let got1 = drain_all(&b, &m1, now);
    let got2 = drain_all(&b, &m2, now);
    assert_eq!(got1.len() + got2.len(), 4);
    // m1 leaves without acknowledging: its in-flight messages go to m2.
    b.unsubscribe(&mut ctx, &m1, now);
    let again = drain_all(&b, &m2, now);
    assert_eq!(again.len(), got1.len());
    assert!(again.iter().all(|g| g.attempt == 2));
    // The last member leaves with its messages unacknowledged: they are parked, not dropped,
    // counted in the group's floor, and the next member takes them.
    b.unsubscribe(&mut ctx, &m2, now);
    assert!(b.group_member(&shared).is_none());
    let floor = shared.parked_floor();
    assert_eq!(floor.len(), 1);
    assert_eq!(floor[0].1, 0);
    let m3 = unrouted_member(&b, GROUP);
    assert!(
        Arc::ptr_eq(m3.group().expect("group"), &shared),
        "the same group"
    );
    assert_eq!(
        drain_all(&b, &m3, now).len(),
        4,
        "every unacknowledged message"
    );
    assert!(shared.parked_floor().is_empty());
    // Forgotten by its owner: a later member starts a new group.
    b.unsubscribe(&mut ctx, &m3, now);
    b.forget_unrouted_group(&shared);
    let m4 = unrouted_member(&b, GROUP);
    assert!(!Arc::ptr_eq(m4.group().expect("group"), &shared));
    assert!(drain_all(&b, &m4, now).is_empty());
}

/// The cluster's view of a subscription: told once when it is made and withdrawn once when it
/// stops being routed — at a detach (STOP_SENDING) or when it starts draining, not only at its
/// removal, so that peers stop sending to a member that takes nothing more.
#[test]
fn interest_is_withdrawn_once_when_a_subscription_stops_being_routed() {
    use std::sync::Mutex;
    let b = Broker::default();
    let told: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let t2 = told.clone();
    assert!(b.set_interest_listener(Box::new(move |key, delta| {
        t2.lock().expect("lock").push((format!("{key:?}"), delta));
    })));
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let member = sub(&b, "topic:jobs:group:g");
    let plain = sub(&b, "topic:news");
    let sums = |told: &[(String, i64)]| {
        let mut m: BTreeMap<String, i64> = BTreeMap::new();
        for (k, d) in told {
            *m.entry(k.clone()).or_default() += d;
        }
        m
    };
    assert_eq!(told.lock().expect("lock").len(), 2);
    b.detach(&mut ctx, &member, now);
    b.stop_routing(&plain);
    assert!(
        sums(&told.lock().expect("lock")).values().all(|v| *v == 0),
        "withdrawn when they stopped being routed: {:?}",
        told.lock().expect("lock")
    );
    // Their removal later withdraws nothing more.
    b.unsubscribe(&mut ctx, &member, now);
    b.unsubscribe(&mut ctx, &plain, now);
    let told = told.lock().expect("lock").clone();
    assert_eq!(told.len(), 4, "{told:?}");
    assert!(sums(&told).values().all(|v| *v == 0));
}

/// A copy the cluster routed to a group here whose last member left since (the mesh checked
/// `has_group`, then the member went before the publish) is offered to the orphan listener —
/// a member on another node — or dropped and counted: it was neither.
#[test]
fn a_copy_for_a_group_gone_from_here_is_offered_elsewhere() {
    use std::sync::Mutex;
    let b = Broker::default();
    let offered: Arc<Mutex<Vec<String>>> = Arc::default();
    let o2 = offered.clone();
    assert!(b.set_orphan_listener(Box::new(move |o| {
        o2.lock()
            .expect("lock")
            .push(String::from_utf8_lossy(&o.body).into_owned());
        &o.body[..] != b"declined"
    })));
    let now = Instant::now();
    let plain = sub(&b, "topic:jobs");
    let mut ctx = PublishContext::default();
    let key = aqueduct_core::mesh::GroupKey {
        filter: aqueduct_proto::TopicFilter::try_from("jobs").expect("filter"),
        group: aqueduct_proto::GroupId::try_from("w").expect("group"),
    };
    ctx.scope_only(true, std::slice::from_ref(&key));
    publish(&b, &mut ctx, "jobs", "job", now);
    publish(&b, &mut ctx, "jobs", "declined", now);
    assert_eq!(*offered.lock().expect("lock"), ["job", "declined"]);
    let dropped = b
        .topic(&t("jobs"))
        .expect("known")
        .stats()
        .snapshot()
        .dropped(DropReason::Unsubscribed);
    assert_eq!(dropped, 1, "the declined one is counted");
    // The plain subscriber the scope includes got both.
    assert_eq!(drain_all(&b, &plain, now).len(), 2);
}

/// The last member of a group leaving with messages in flight and queued: with an orphan
/// listener (the cluster) they are offered to it, with their attempts and what is left of their
/// TTL, instead of being dropped; one it declines is dropped and counted as before.
#[test]
fn the_last_member_s_messages_are_offered_to_the_orphan_listener() {
    use std::sync::Mutex;
    let b = Broker::default();
    let offered: Arc<Mutex<Vec<Orphan>>> = Arc::default();
    let o2 = offered.clone();
    assert!(b.set_orphan_listener(Box::new(move |o| {
        let take = &o.body[..] != b"declined";
        o2.lock().expect("lock").push(o);
        take
    })));
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let m = sub(&b, "topic:jobs:group:g");
    publish(&b, &mut ctx, "jobs", "in flight", now);
    let jobs = t("jobs");
    let mut p = Publication::new(&jobs, b"queued");
    p.ttl = Some(Duration::from_secs(10));
    b.publish(&mut ctx, &p, now);
    publish(&b, &mut ctx, "jobs", "declined", now);
    let mut out = BytesMut::new();
    b.drain(&m, &mut out, 1, now);
    assert_eq!(bodies(&decode_all(out.freeze())), ["in flight"]);
    b.unsubscribe(&mut ctx, &m, now + Duration::from_secs(4));
    let offered = offered.lock().expect("lock").clone();
    let mut got: Vec<(String, u32, Option<Duration>)> = offered
        .iter()
        .map(|o| {
            (
                String::from_utf8_lossy(&o.body).into_owned(),
                o.attempts,
                o.ttl,
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("declined".into(), 1, None),
            ("in flight".into(), 2, None),
            ("queued".into(), 1, Some(Duration::from_secs(6))),
        ]
    );
    assert!(offered.iter().all(|o| o.group.group.as_str() == "g"));
    let stats = b.topic(&t("jobs")).expect("known").stats().snapshot();
    assert_eq!(
        stats.dropped(DropReason::Unsubscribed),
        1,
        "the declined one"
    );
}

/// A member's queued messages count against its `max_in_flight`: each becomes unsettled once
/// written. A member with room for one unsettled message whose writer has not run yet takes
/// one, not every other message (which would then wait behind it while the other member idles);
/// under load this left a durable group's stuck member holding messages for good.
#[test]
fn a_member_takes_no_more_than_it_may_have_unsettled_even_before_its_writer_runs() {
    let b = Broker::default();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let narrow = sub_with(
        &b,
        "topic:jobs:group:g",
        SubscribeOptions {
            max_in_flight: Some(1),
            ..SubscribeOptions::default()
        },
    );
    let wide = sub(&b, "topic:jobs:group:g");
    for i in 0..10 {
        publish(&b, &mut ctx, "jobs", &i.to_string(), now);
    }
    assert_eq!(narrow.queued(), 1, "one for the narrow member");
    assert_eq!(wide.queued(), 9, "the rest for the other");
    assert_eq!(drain_all(&b, &narrow, now).len(), 1);
    assert_eq!(drain_all(&b, &wide, now).len(), 9);
}

/// A dead letter caused by a publish scoped to one group (a cluster copy for that group) is a
/// message of its own: the dead-letter topic's plain subscribers get it, and the scope holds
/// again after it.
#[test]
fn a_dead_letter_made_during_a_scoped_publish_reaches_plain_subscribers() {
    let b = Broker::new(BrokerConfig {
        queue_size: 1,
        backpressure_policy: OverflowPolicy::Disconnect,
        max_retries: 0,
        ..BrokerConfig::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let member = sub(&b, "topic:jobs:group:g");
    let dlq = sub(&b, "topic:__dlq__jobs");
    let plain = sub(&b, "topic:jobs");
    publish(&b, &mut ctx, "jobs", "first", now);
    let mut out = BytesMut::new();
    b.drain(&member, &mut out, 1, now);
    assert_eq!(member.in_flight(), 1);
    drain_all(&b, &plain, now);
    let g = aqueduct_core::mesh::GroupKey {
        filter: TopicFilter::try_from("jobs").expect("filter"),
        group: GroupId::try_from("g").expect("group"),
    };
    ctx.scope_only(false, std::slice::from_ref(&g));
    // The member's queue (1) overflows: it is closed as a slow consumer, and its in-flight
    // message, out of retries, becomes a dead letter.
    publish(&b, &mut ctx, "jobs", "second", now);
    publish(&b, &mut ctx, "jobs", "third", now);
    assert_eq!(member.close_reason(), Some(CloseReason::SlowConsumer));
    let dead = drain_all(&b, &dlq, now);
    assert_eq!(
        bodies(&dead),
        ["first"],
        "the dead letter reached its plain subscriber"
    );
    // The scope still holds: the plain subscriber of jobs got nothing of the scoped publishes.
    assert!(drain_all(&b, &plain, now).is_empty());
    ctx.clear_scope();
}

/// Redelivered `rounds` times on another thread (by NACKs, or by ack-wait timeouts when
/// `timeouts`), a message must be in every position read (`read_settled`) of its
/// subscriptions' places: a read made while the NACK had taken it out of the in-flight set and
/// not yet queued it again (or queued it in the other member before the read reached that
/// one) missed it, and a durable consumer's checkpoint saved a position past it. `members`
/// subscriptions (1: a plain one, 2: a group's).
fn redelivered_message_stays_in_read_positions(members: usize, timeouts: bool, rounds: usize) {
    let b = Arc::new(Broker::new(BrokerConfig {
        max_retries: u32::MAX,
        ..Default::default()
    }));
    let filter = if members == 1 {
        "topic:t"
    } else {
        "topic:t:group:g"
    };
    let subs: Vec<Arc<Subscriber>> = (0..members).map(|_| ack_sub(&b, filter)).collect();
    let now = Instant::now();
    publish(&b, &mut PublishContext::default(), "t", "x", now);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let nacker = {
        let (b, subs, done) = (b.clone(), subs.clone(), done.clone());
        std::thread::spawn(move || {
            let mut ctx = PublishContext::default();
            for _ in 0..rounds {
                for s in &subs {
                    drain_all(&b, s, now);
                }
                let holder = subs.iter().find(|s| s.in_flight() == 1).expect("in flight");
                if timeouts {
                    let later = now + b.config().ack_wait + Duration::from_secs(1);
                    assert_eq!(b.expire_in_flight(&mut ctx, holder, later), 1);
                } else {
                    b.nack(&mut ctx, holder, None, 0, None, None, now)
                        .expect("nacked");
                }
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let (mut kept, mut spoiled) = (0u64, 0u64);
    while !done.load(Ordering::SeqCst) {
        let read = subs[0].moves().read_settled(|| {
            subs.iter()
                .flat_map(|s| s.unsettled_floor())
                .collect::<Vec<_>>()
        });
        match read {
            Some(floor) => {
                kept += 1;
                assert_eq!(
                    floor,
                    vec![(t("t"), 0)],
                    "read {kept}: the message is missing"
                );
            }
            None => spoiled += 1,
        }
    }
    nacker.join().expect("nacker");
    assert!(kept > 0, "no read was kept ({spoiled} overlapped a move)");
    assert_eq!(subs[0].moves().in_progress(), 0);
}

#[test]
fn a_position_read_never_misses_a_redelivered_message() {
    redelivered_message_stays_in_read_positions(1, false, 30_000);
    redelivered_message_stays_in_read_positions(1, true, 30_000);
}

#[test]
fn a_group_position_read_never_misses_a_message_handed_to_another_member() {
    redelivered_message_stays_in_read_positions(2, false, 30_000);
    redelivered_message_stays_in_read_positions(2, true, 30_000);
}

/// A NACK's redelivery that overflows a `disconnect` member closes it, and a delivery it had in
/// flight on its last attempt becomes a dead letter; into a full `block` dead-letter queue that
/// holds the NACKing source (§7.3). The redelivery's own holds are dropped (it only moves a
/// message), and that cut dropped the dead letter's hold with them.
#[test]
fn a_dead_letter_made_by_a_nacks_redelivery_still_holds_the_source() {
    let b = Broker::new(BrokerConfig {
        queue_size: 1,
        max_retries: 1,
        ..Default::default()
    });
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    let member = |policy| {
        sub_with(
            &b,
            "topic:jobs:group:g",
            SubscribeOptions {
                ack_mode: AckMode::Explicit,
                overflow: Some(policy),
                ..Default::default()
            },
        )
    };
    let dlq = sub_with(
        &b,
        "topic:__dlq__jobs",
        SubscribeOptions {
            overflow: Some(OverflowPolicy::Block),
            ..Default::default()
        },
    );
    publish(&b, &mut ctx, "__dlq__jobs", "filler", now);
    assert_eq!(dlq.queued(), 1, "the dead-letter queue is full");
    // `a` alone: job 0 delivered, NACKed, delivered again: in flight on its last attempt.
    let a = member(OverflowPolicy::Disconnect);
    publish(&b, &mut ctx, "jobs", "0", now);
    assert_eq!(drain_all(&b, &a, now).len(), 1);
    b.nack(&mut ctx, &a, None, 0, None, None, now)
        .expect("in flight");
    assert_eq!(drain_all(&b, &a, now)[0].attempt, 2);
    // `a`'s queue full; `b2` joins with job 2 in flight and its queue full too.
    publish(&b, &mut ctx, "jobs", "1", now);
    assert_eq!(a.queued(), 1);
    let b2 = member(OverflowPolicy::Block);
    publish(&b, &mut ctx, "jobs", "2", now);
    assert_eq!(drain_all(&b, &b2, now).len(), 1);
    publish(&b, &mut ctx, "jobs", "3", now);
    while ctx.take_held().is_some() {}
    assert_eq!((a.queued(), b2.queued()), (1, 1), "both full");
    // `b2` NACKs job 2: every member is full, and its redelivery goes to one of them.
    b.nack(&mut ctx, &b2, None, 2, None, None, now)
        .expect("in flight");
    assert!(
        a.is_closed(),
        "the redelivery went to b2, which tests nothing: {}",
        b2.queued()
    );
    let held: Vec<_> = std::iter::from_fn(|| ctx.take_held()).collect();
    assert!(
        held.iter().any(|h| Arc::ptr_eq(h, &dlq)),
        "job 0's dead letter went into the full block queue without holding the NACK"
    );
    assert_eq!(dlq.queued(), 2, "queued, not dropped");
}
