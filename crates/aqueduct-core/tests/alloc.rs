//! The steady-state hot path allocates nothing: publish → enqueue → drain for an exact-topic
//! subscriber (and for a fan-out to 100 subscribers), counted with a counting global allocator
//! over 100k messages after a warm-up.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use aqueduct_core::{Broker, BrokerConfig, Publication, PublishContext, SubscribeOptions};
use aqueduct_proto::{SubscribeSpec, TopicFilter, TopicName};
use bytes::BytesMut;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    // Count only on the measuring thread: the test harness allocates on its own threads.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: delegates every call to the system allocator unchanged; only counts.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
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
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn count<R>(f: impl FnOnce() -> R) -> (R, u64) {
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (r, ALLOCATIONS.load(Ordering::Relaxed))
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

#[test]
fn the_counter_counts() {
    // Guard against a test that could never fail: an allocation is seen.
    let (v, n) = count(|| vec![1u8; 64]);
    assert_eq!(v.len(), 64);
    assert!(n >= 1);
}
