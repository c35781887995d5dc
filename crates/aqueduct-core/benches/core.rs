//! Core benchmarks: wildcard match, group pick, route lookup vs subscription count, batch
//! publish → enqueue → drain throughput, fan-out cost per delivery, and which cluster peers
//! want a topic vs how many filters a peer has, and a publish held by N full `block` queues.
//! Figures and the exact command are in docs/benchmarks.md.

use std::hint::black_box;
use std::time::Instant;

use aqueduct_core::acl::{Acl, AclCache, AclPolicy, AclRule, Permission};
use aqueduct_core::index::SubscriptionIndex;
use aqueduct_core::matching::matches;
use aqueduct_core::quota::{Bucket, QuotaSpec};
use aqueduct_core::{
    Broker, BrokerConfig, Publication, PublishContext, RoundRobin, SubscribeOptions,
};
use aqueduct_proto::{SubscribeSpec, TopicFilter, TopicName};
use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn wildcard_match(c: &mut Criterion) {
    let filter = TopicFilter::try_from("sport/+/player1/#").expect("valid");
    let topic = TopicName::try_from("sport/tennis/player1/ranking").expect("valid");
    let miss = TopicName::try_from("sport/tennis/player2/ranking").expect("valid");
    c.bench_function("wildcard_match_hit", |b| {
        b.iter(|| matches(black_box(&filter), black_box(&topic)))
    });
    c.bench_function("wildcard_match_miss", |b| {
        b.iter(|| matches(black_box(&filter), black_box(&miss)))
    });
}

fn group_pick(c: &mut Criterion) {
    let rr = RoundRobin::default();
    let members = [1u64, 2, 3];
    c.bench_function("group_pick_3_members", |b| {
        b.iter(|| rr.pick(black_box(&members), |_| true).copied())
    });
}

/// `n` subscriptions, 10% wildcard filters, none matching the probe topic except one exact and one
/// wildcard subscription.
fn index_with(n: usize) -> SubscriptionIndex<u32> {
    let mut idx = SubscriptionIndex::new();
    for i in 0..n as u32 {
        let f = if i % 10 == 0 {
            format!("tenant{}/+/events/#", i)
        } else {
            format!("tenant{}/region{}/events/{}", i % 1000, i % 7, i)
        };
        idx.insert(&TopicFilter::try_from(f.as_str()).expect("valid"), i);
    }
    idx.insert(
        &TopicFilter::try_from("probe/eu/events/42").expect("valid"),
        u32::MAX,
    );
    idx.insert(
        &TopicFilter::try_from("probe/+/events/#").expect("valid"),
        u32::MAX - 1,
    );
    idx
}

fn route_lookup(c: &mut Criterion) {
    let topic = TopicName::try_from("probe/eu/events/42").expect("valid");
    let mut g = c.benchmark_group("route_lookup_4_levels");
    for n in [1_000usize, 10_000, 100_000] {
        let idx = index_with(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &idx, |b, idx| {
            b.iter(|| {
                let mut hits = 0u32;
                idx.for_each_match(black_box(&topic), |_| hits += 1);
                hits
            })
        });
    }
    g.finish();
}

fn batch_publish_drain(c: &mut Criterion) {
    let broker = Broker::new(BrokerConfig::default());
    let topic = TopicName::try_from("orders/eu").expect("valid");
    let sub = broker.subscribe(
        &SubscribeSpec::new(TopicFilter::from(topic.clone())),
        SubscribeOptions::default(),
    );
    let body = [0xABu8; 128];
    let mut ctx = PublishContext::default();
    let mut out = BytesMut::with_capacity(64 * 1024);
    let now = Instant::now();
    let mut g = c.benchmark_group("publish_enqueue_drain");
    g.throughput(Throughput::Elements(100));
    // What the server does with one PUBLISH_BATCH frame of 100 messages, then one writer flush.
    g.bench_function("batch_100x128B_1_subscriber", |b| {
        b.iter(|| {
            let publications = (0..100).map(|_| Publication::new(&topic, black_box(&body)));
            broker.publish_batch(&mut ctx, publications, now, |_, o| {
                black_box(o);
            });
            let d = broker.drain(&sub, &mut out, 64 * 1024, now);
            out.clear();
            d.frames
        })
    });
    // The same 100 messages as 100 single PUBLISH frames.
    g.bench_function("single_100x128B_1_subscriber", |b| {
        b.iter(|| {
            for _ in 0..100 {
                broker.publish(&mut ctx, &Publication::new(&topic, black_box(&body)), now);
            }
            let d = broker.drain(&sub, &mut out, 64 * 1024, now);
            out.clear();
            d.frames
        })
    });
    g.finish();
}

/// `n` plain subscriptions to exactly `topic`.
fn subscribed(
    broker: &Broker,
    topic: &TopicName,
    n: usize,
) -> Vec<std::sync::Arc<aqueduct_core::Subscriber>> {
    (0..n)
        .map(|_| {
            broker.subscribe(
                &SubscribeSpec::new(TopicFilter::from(topic.clone())),
                SubscribeOptions::default(),
            )
        })
        .collect()
}

fn fan_out(c: &mut Criterion) {
    let mut g = c.benchmark_group("fan_out_128B");
    for n in [1usize, 10, 100] {
        let broker = Broker::new(BrokerConfig::default());
        let topic = TopicName::try_from("news/world").expect("valid");
        let subs = subscribed(&broker, &topic, n);
        let body = [0xABu8; 128];
        let mut ctx = PublishContext::default();
        let mut out = BytesMut::with_capacity(64 * 1024);
        let now = Instant::now();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("subscribers", n), |b| {
            b.iter(|| {
                broker.publish(&mut ctx, &Publication::new(&topic, black_box(&body)), now);
                for s in &subs {
                    broker.drain(s, &mut out, 64 * 1024, now);
                }
                out.clear();
            })
        });
    }
    g.finish();
}

/// A publish into N `block` subscriptions whose queues are full: the publishing context records
/// each as holding the publisher once. (It looked for each among those already recorded: N²/2
/// comparisons per publish.) Each round publishes one message, takes the holds, and drains one
/// message from each queue, so the queues stay full.
fn held_by_full_block_queues(c: &mut Criterion) {
    let mut g = c.benchmark_group("held_by_full_block_queues");
    for n in [100usize, 2000] {
        let broker = Broker::new(BrokerConfig {
            queue_size: 1,
            backpressure_policy: aqueduct_proto::OverflowPolicy::Block,
            ..Default::default()
        });
        let topic = TopicName::try_from("jobs").expect("valid");
        let subs = subscribed(&broker, &topic, n);
        let body = [0xABu8; 128];
        let mut ctx = PublishContext::default();
        let mut out = BytesMut::with_capacity(64 * 1024);
        let now = Instant::now();
        broker.publish(&mut ctx, &Publication::new(&topic, &body), now);
        ctx.clear_held();
        let mut round = || {
            broker.publish(&mut ctx, &Publication::new(&topic, black_box(&body)), now);
            let mut held = 0;
            while ctx.take_held().is_some() {
                held += 1;
            }
            for s in &subs {
                broker.drain(s, &mut out, 1, now);
            }
            out.clear();
            held
        };
        assert_eq!(round(), n, "every queue full, each held once");
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("subscribers", n), |b| b.iter(&mut round));
    }
    g.finish();
}

/// What counting costs per message: our per-topic atomic (the counter is reached through the
/// topic state the message already points to) and the latency histogram, against the
/// alternative the design avoids — a label lookup per message.
fn metrics_cost(c: &mut Criterion) {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut g = c.benchmark_group("metrics_cost");
    let counter = AtomicU64::new(0);
    g.bench_function("per_topic_atomic_add", |b| {
        b.iter(|| counter.fetch_add(1, Ordering::Relaxed))
    });
    let hist = aqueduct_core::LatencyHistogram::default();
    g.bench_function("latency_histogram_observe", |b| {
        b.iter(|| hist.observe(black_box(std::time::Duration::from_micros(180))))
    });
    let labels: HashMap<String, AtomicU64> = (0..1000)
        .map(|i| (format!("tenant{i}/orders/eu"), AtomicU64::new(0)))
        .collect();
    let topic = "tenant500/orders/eu";
    g.bench_function("label_lookup_then_add_1000_topics", |b| {
        b.iter(|| {
            if let Some(c) = labels.get(black_box(topic)) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        })
    });
    g.finish();
}

/// A policy of `n` rules: one per client `svc-<i>` on `orders/<i>/#`, plus a few patterns.
pub fn big_policy(n: usize) -> AclPolicy {
    let mut rules: Vec<AclRule> = (0..n.saturating_sub(3))
        .map(|i| {
            AclRule::parse(&format!("svc-{i}"), &format!("orders/{i}/#"), "all").expect("rule")
        })
        .collect();
    rules.push(AclRule::parse("svc-*", "metrics/#", "publish").expect("rule"));
    rules.push(AclRule::parse("bench", "orders/eu", "publish").expect("rule"));
    rules.push(AclRule::parse("*", "orders/#", "subscribe").expect("rule"));
    AclPolicy {
        enabled: true,
        default: Permission::None,
        rules,
    }
}

/// The publish path's ACL check (cached, 10,000 rules) and quota check (a limited bucket that
/// is not binding, and an unlimited one).
fn access_checks(c: &mut Criterion) {
    let acl = Acl::new(big_policy(10_000));
    let mut cache = AclCache::default();
    let topic = b"orders/eu".as_slice();
    assert!(cache.may_publish(&acl, "bench", topic));
    c.bench_function("acl_check_cached_10000_rules", |b| {
        b.iter(|| cache.may_publish(black_box(&acl), black_box("bench"), black_box(topic)))
    });
    let policy = acl.policy();
    c.bench_function("acl_check_uncached_10000_rules", |b| {
        b.iter(|| {
            policy
                .for_client(black_box("bench"))
                .may_publish(black_box(topic))
        })
    });
    let limited = Bucket::new(QuotaSpec {
        rate: u64::MAX / 2,
        burst: u64::MAX / 2,
    });
    let mut now = 0u64;
    c.bench_function("quota_check_limited", |b| {
        b.iter(|| {
            now += 1;
            limited.take(black_box(1), now)
        })
    });
    let unlimited = Bucket::new(QuotaSpec::UNLIMITED);
    c.bench_function("quota_check_unlimited", |b| {
        b.iter(|| unlimited.take(black_box(1), black_box(0)))
    });
}

/// Which cluster peers want a topic, asked on every publish, against how many filters a peer
/// has. `exact_filters`: `n` exact filters (`tenant<i>/orders`) and 10 wildcard ones, and a
/// topic one exact filter names. `wildcard_filters`: `n` wildcard filters
/// (`tenant<i>/+/orders`) and a topic one of them matches. `wildcard_groups`: the whole route
/// (plain copies and group picks) with `n` wildcard groups (`tenant<i>/+/jobs`, group `w`).
fn peer_interest(c: &mut Criterion) {
    use aqueduct_core::mesh::{ConnId, Control, Interest, Key, Mesh, MeshConfig, NodeId, Update};
    use aqueduct_proto::GroupId;
    /// Node "a" with one peer "b" whose interest is `keys` (count 1 each).
    fn mesh_with(keys: impl Iterator<Item = Key>) -> Mesh {
        let mut mesh = Mesh::new(
            NodeId::try_from("a").expect("node"),
            MeshConfig::default(),
            1,
            1,
        );
        let peer = NodeId::try_from("b").expect("node");
        assert!(mesh.handle_connected(Instant::now(), ConnId(1), peer, None, false));
        let mut interest = Interest::default();
        for key in keys {
            interest.apply(&Update { key, count: 1 });
        }
        assert!(mesh.handle_control(
            ConnId(1),
            Control::Snapshot {
                session: 1,
                seq: 0,
                interest
            }
        ));
        mesh
    }
    fn table_with(keys: impl Iterator<Item = Key>) -> aqueduct_core::mesh::RouteTable {
        mesh_with(keys).table()
    }
    let filter = |f: String| TopicFilter::try_from(f.as_str()).expect("filter");
    let mut g = c.benchmark_group("mesh_peers_wanting_a_topic");
    for n in [10usize, 10_000, 100_000] {
        let table = table_with(
            (0..n)
                .map(|i| format!("tenant{i}/orders"))
                .chain((0..10).map(|i| format!("region{i}/+/orders/#")))
                .map(|f| Key::Plain(filter(f))),
        );
        let topic = format!("tenant{}/orders", n / 2);
        assert_eq!(table.plain_peers(topic.as_bytes()).count(), 1);
        g.bench_function(BenchmarkId::new("exact_filters", n), |b| {
            b.iter(|| table.plain_peers(black_box(topic.as_bytes())).count())
        });
    }
    for n in [10usize, 1_000, 10_000] {
        let table = table_with((0..n).map(|i| Key::Plain(filter(format!("tenant{i}/+/orders")))));
        let topic = format!("tenant{}/eu/orders", n / 2);
        assert_eq!(table.plain_peers(topic.as_bytes()).count(), 1);
        g.bench_function(BenchmarkId::new("wildcard_filters", n), |b| {
            b.iter(|| table.plain_peers(black_box(topic.as_bytes())).count())
        });
        let table = table_with((0..n).map(|i| {
            Key::Group(aqueduct_core::mesh::GroupKey {
                filter: filter(format!("tenant{i}/+/jobs")),
                group: GroupId::try_from("w").expect("group"),
            })
        }));
        let topic = format!("tenant{}/eu/jobs", n / 2);
        assert_eq!(table.route_bytes(topic.as_bytes()).forward.len(), 1);
        g.bench_function(BenchmarkId::new("wildcard_groups", n), |b| {
            b.iter(|| table.route_bytes(black_box(topic.as_bytes())))
        });
    }
    g.finish();
    // The routing snapshot is rebuilt (every node's interest copied) after each change of
    // interest: what that costs with a peer's `n` filters.
    let mut g = c.benchmark_group("mesh_route_table_rebuild");
    // `exact_groups`: groups `tenant<i>/jobs`, id `w` (a snapshot also gathers the round-robin
    // counter of every group).
    let key_of = |kind: &str, i: usize| match kind {
        "exact_filters" => Key::Plain(filter(format!("tenant{i}/orders"))),
        "wildcard_filters" => Key::Plain(filter(format!("tenant{i}/+/orders"))),
        _ => Key::Group(aqueduct_core::mesh::GroupKey {
            filter: filter(format!("tenant{i}/jobs")),
            group: GroupId::try_from("w").expect("group"),
        }),
    };
    for kind in ["exact_filters", "wildcard_filters", "exact_groups"] {
        let n = 10_000;
        let mut mesh = mesh_with((0..n).map(|i| key_of(kind, i)));
        g.bench_function(BenchmarkId::new(kind, n), |b| b.iter(|| mesh.table()));
        // A change of one of the peer's keys (a delta), then the rebuild, while the snapshot
        // made before it is still held (as the server holds the one in force).
        let key = key_of(kind, 0);
        let mut held = mesh.table();
        let mut seq = 0u64;
        g.bench_function(BenchmarkId::new(format!("change_then_{kind}"), n), |b| {
            b.iter(|| {
                seq += 1;
                let count = 1 + (seq % 2) as u32;
                assert!(mesh.handle_control(
                    ConnId(1),
                    Control::Delta {
                        session: 1,
                        seq,
                        updates: vec![Update {
                            key: key.clone(),
                            count
                        }],
                    }
                ));
                held = mesh.table();
            })
        });
        assert_eq!(held.nodes().len(), 2);
    }
    g.finish();
}

criterion_group!(
    benches,
    peer_interest,
    access_checks,
    wildcard_match,
    group_pick,
    route_lookup,
    batch_publish_drain,
    fan_out,
    held_by_full_block_queues,
    metrics_cost
);
criterion_main!(benches);
