//! The steady-state hot path allocates nothing: publish → enqueue → drain for an exact-topic
//! subscriber (and for a fan-out to 100 subscribers, and publish → enqueue → drain → ACK for an
//! explicit-ACK consumer group), counted with a counting global allocator over 100k messages
//! after a warm-up.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use aqueduct_core::{Broker, BrokerConfig, Publication, PublishContext, SubscribeOptions};
use aqueduct_proto::{SubscribeSpec, TopicFilter, TopicName};
use bytes::BytesMut;

struct Counting;

thread_local! {
    // Count only on the measuring thread: the test harness, and the other tests running at the
    // same time, allocate on their own threads.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: delegates every call to the system allocator unchanged; only counts.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn count<R>(f: impl FnOnce() -> R) -> (R, u64) {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (r, ALLOCATIONS.with(Cell::get))
}

fn run(subscribers: usize, messages: usize, batch: usize) -> u64 {
    let broker = Broker::new(BrokerConfig::default());
    let filter = TopicFilter::try_from("orders/eu").expect("valid");
    let subs: Vec<_> = (0..subscribers)
        .map(|i| {
            broker.subscribe(
                &SubscribeSpec::new(filter.clone()),
                SubscribeOptions {
                    stream_id: i as u32,
                    ..Default::default()
                },
            )
        })
        .collect();
    let topic = TopicName::try_from("orders/eu").expect("valid");
    let body = [7u8; 128];
    let mut ctx = PublishContext::default();
    let mut out = BytesMut::with_capacity(64 * 1024);
    let now = Instant::now();
    let step = |ctx: &mut PublishContext, out: &mut BytesMut| {
        if batch == 1 {
            broker.publish(ctx, &Publication::new(&topic, &body), now);
        } else {
            let publications = (0..batch).map(|_| Publication::new(&topic, &body));
            broker.publish_batch(ctx, publications, now, |_, _| {});
        }
        for s in &subs {
            let d = broker.drain(s, out, 64 * 1024, now);
            assert_eq!(d.frames, batch);
            out.clear();
        }
    };
    // Warm-up: queues, scratch vectors, the encoding arena and the topic table reach steady size.
    let steps = messages / batch;
    for _ in 0..10_000 / batch {
        step(&mut ctx, &mut out);
    }
    let ((), allocations) = count(|| {
        for _ in 0..steps {
            step(&mut ctx, &mut out);
        }
    });
    let delivered = broker
        .topic(&topic)
        .expect("published")
        .stats()
        .snapshot()
        .delivered;
    assert_eq!(
        delivered as usize,
        (10_000 / batch + steps) * batch * subscribers
    );
    allocations
}

#[test]
fn steady_state_publish_enqueue_drain_allocates_nothing() {
    assert_eq!(
        run(1, 100_000, 1),
        0,
        "allocations for 100k messages to one subscriber"
    );
    assert_eq!(
        run(1, 100_000, 100),
        0,
        "allocations for 100k messages in batches of 100"
    );
    assert_eq!(
        run(100, 10_000, 1),
        0,
        "allocations for 10k messages fanned out to 100 subscribers"
    );
    assert_eq!(
        run(10, 10_000, 100),
        0,
        "allocations for batches of 100 fanned out to 10 subscribers"
    );
}

/// A consumer group of two explicit-ACK members, settled 100 messages behind: publish, drain,
/// ACK in steady state allocate nothing either. The group's record of what it has out (for its
/// committed offset) allocated about once per 5–10 messages.
#[test]
fn steady_state_group_with_explicit_acks_allocates_nothing() {
    let broker = Broker::new(BrokerConfig::default());
    let spec =
        SubscribeSpec::parse(&bytes::Bytes::from_static(b"topic:jobs:group:g")).expect("valid");
    let members: Vec<_> = (0..2)
        .map(|i| {
            broker.subscribe(
                &spec,
                SubscribeOptions {
                    stream_id: i,
                    ack_mode: aqueduct_proto::AckMode::Explicit,
                    ..Default::default()
                },
            )
        })
        .collect();
    let topic = TopicName::try_from("jobs").expect("valid");
    let body = [7u8; 128];
    let mut ctx = PublishContext::default();
    let mut out = BytesMut::with_capacity(64 * 1024);
    let now = Instant::now();
    let mut next = 0u64;
    let mut settled = 0u64;
    let mut step = |ctx: &mut PublishContext, out: &mut BytesMut| {
        broker.publish(ctx, &Publication::new(&topic, &body), now);
        next += 1;
        for m in &members {
            broker.drain(m, out, 64 * 1024, now);
            out.clear();
        }
        while next - settled > 100 {
            let acked = members
                .iter()
                .any(|m| broker.ack(m, None, settled, None).is_ok());
            assert!(acked, "offset {settled} in flight on a member");
            settled += 1;
        }
    };
    for _ in 0..10_000 {
        step(&mut ctx, &mut out);
    }
    let ((), allocations) = count(|| {
        for _ in 0..100_000 {
            step(&mut ctx, &mut out);
        }
    });
    let group = members[0].group().expect("a member");
    assert_eq!(group.committed_offset(&topic), Some(settled));
    assert_eq!(allocations, 0, "allocations for 100k messages to a group");
}

/// The publish path's access checks (a cached ACL decision among 10,000 rules, a quota take)
/// allocate nothing once the topic has been seen.
#[test]
fn cached_acl_and_quota_checks_allocate_nothing() {
    use aqueduct_core::acl::{Acl, AclCache, AclPolicy, AclRule, Permission};
    use aqueduct_core::quota::{Bucket, QuotaSpec};
    let mut rules: Vec<AclRule> = (0..10_000)
        .map(|i| {
            AclRule::parse(&format!("svc-{i}"), &format!("orders/{i}/#"), "all").expect("rule")
        })
        .collect();
    rules.push(AclRule::parse("bench", "orders/eu", "publish").expect("rule"));
    let acl = Acl::new(AclPolicy {
        enabled: true,
        default: Permission::None,
        rules,
    });
    let mut cache = AclCache::default();
    assert!(cache.may_publish(&acl, "bench", b"orders/eu"));
    assert!(!cache.may_publish(&acl, "bench", b"orders/us"));
    let bucket = Bucket::new(QuotaSpec {
        rate: 1_000_000,
        burst: 1_000_000,
    });
    let (allowed, n) = count(|| {
        let mut allowed = 0;
        for i in 0..100_000u64 {
            allowed += usize::from(cache.may_publish(&acl, "bench", b"orders/eu"));
            allowed += usize::from(cache.may_publish(&acl, "bench", b"orders/us"));
            assert!(bucket.take(1, i * 1000).is_zero());
        }
        allowed
    });
    assert_eq!(allowed, 100_000);
    assert_eq!(
        n, 0,
        "allocations for 200k cached ACL checks and 100k quota takes"
    );
}

#[test]
fn the_counter_counts() {
    // Guard against a test that could never fail: an allocation is seen.
    let (v, n) = count(|| vec![1u8; 64]);
    assert_eq!(v.len(), 64);
    assert!(n >= 1);
}
