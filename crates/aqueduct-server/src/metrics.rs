//! Prometheus exposition of the broker's counters, gathered at scrape time.
//!
//! Nothing here runs per message: the core counts into per-topic atomics it already holds
//! (`TopicStats`), the server into `ServerStats`; a scrape walks them and renders text format
//! 0.0.4. Topic label values are bounded: the first `metrics.max_topic_labels` topic names seen
//! by a scrape keep their own label for the life of the process, every later topic is counted
//! under `topic="__other__"` — so a client cannot grow the metrics without bound. A labelled
//! topic the broker evicted (idle, no subscriber) keeps its series at its last counts and
//! continues from there if published to again; evicted topics without a label keep counting
//! under `__other__`. No series ever goes down.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use aqueduct_core::latency::BOUNDS_US;
use aqueduct_core::{DropReason, TopicStatsSnapshot};
use aqueduct_proto::{ErrorCode, Priority, TopicName};

use crate::server::Shared;

/// Label value for topics beyond the cardinality bound.
pub const OTHER_TOPIC: &str = "__other__";

/// Upper bounds for the queue-depth distribution of subscribers.
const DEPTH_BOUNDS: [usize; 6] = [0, 10, 100, 1_000, 10_000, 100_000];

/// Reads one counter out of a topic's snapshot.
type Getter = fn(&TopicStatsSnapshot) -> u64;

/// Which topics have their own label (decided once per topic name, never revoked), and the
/// counts shown under each.
#[derive(Debug, Default)]
pub(crate) struct TopicLabels {
    state: Mutex<LabelState>,
}

#[derive(Debug, Default)]
struct LabelState {
    /// Per labelled topic name: the counts of its earlier lives (the broker freed its state, and
    /// maybe made it anew), and its live counts as the previous scrape read them.
    labelled: HashMap<TopicName, Labelled>,
}

#[derive(Debug, Default)]
struct Labelled {
    earlier: TopicStatsSnapshot,
    last_live: TopicStatsSnapshot,
    /// The [`TopicState::life`](aqueduct_core::TopicState::life) `last_live` was read from.
    life: u64,
}

/// One live topic as a scrape reads it: name, life, counts.
type LiveTopic = aqueduct_core::TopicSnapshot;

impl LabelState {
    /// Assign labels for this scrape and return the per-topic series (name order, `__other__`
    /// last when it has anything). `live`: the broker's topics now, in name order; `evicted`:
    /// the broker's counts of every topic it freed, read at the same instant (each topic is in
    /// one or the other). Scrapes must run one at a time, each reading after the previous one.
    fn series(
        &mut self,
        max: usize,
        live: &[LiveTopic],
        evicted: TopicStatsSnapshot,
    ) -> Vec<(String, TopicStatsSnapshot)> {
        // A labelled topic that was freed keeps its series at its last counts, and continues
        // from there if it comes back: its counts never move to `__other__` (which would show
        // there as a burst), and no series goes down. (What it counted between the previous
        // scrape and being freed is in `__other__`.)
        let live_names: HashMap<&TopicName, u64> =
            live.iter().map(|(n, life, _)| (n, *life)).collect();
        for (name, l) in &mut self.labelled {
            // Freed, or freed and made anew (another life) since the previous scrape.
            let ended = live_names.get(name) != Some(&l.life);
            if ended {
                let last = std::mem::take(&mut l.last_live);
                l.earlier.add(&last);
            }
        }
        let mut named = Vec::new();
        let mut other = TopicStatsSnapshot::default();
        let mut other_seen = false;
        for (name, life, snap) in live {
            // A topic named like the overflow series is counted in it: its own series would
            // have the same labels (a duplicate Prometheus drops, and promtool refuses).
            if !self.labelled.contains_key(name)
                && self.labelled.len() < max
                && name.as_str() != OTHER_TOPIC
            {
                self.labelled.insert(name.clone(), Labelled::default());
            }
            match self.labelled.get_mut(name) {
                Some(l) => {
                    let mut shown = l.earlier.clone();
                    shown.add(snap);
                    l.last_live = snap.clone();
                    l.life = *life;
                    named.push((name.as_str().to_owned(), shown));
                }
                None => {
                    other_seen = true;
                    other.add(snap);
                }
            }
        }
        // The part of the evicted counts shown under topics' own labels (their earlier lives)
        // is not counted again under `__other__`.
        let mut rest = evicted;
        for (name, l) in &self.labelled {
            rest.saturating_sub(&l.earlier);
            if !live_names.contains_key(name) {
                named.push((name.as_str().to_owned(), l.earlier.clone()));
            }
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        // Freed topics that had no label of their own keep counting here, so totals never go
        // down.
        if rest != TopicStatsSnapshot::default() {
            other_seen = true;
            other.add(&rest);
        }
        if other_seen {
            named.push((OTHER_TOPIC.to_owned(), other));
        }
        named
    }

    fn is_labelled(&self, topic: &TopicName) -> bool {
        self.labelled.contains_key(topic)
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    /// A metric with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
        self.header(name, kind, help);
        self.sample(name, &[], value);
    }
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// One group's committed offset in a topic, into `offsets` (at most `max` series): the same
/// group id seen twice (on two filters) keeps the lower offset.
fn note_offset(
    offsets: &mut BTreeMap<(String, String), u64>,
    (group, topic): (&str, &str),
    offset: u64,
    max: usize,
) {
    let key = (group.to_owned(), topic.to_owned());
    let full = offsets.len() >= max;
    match offsets.get_mut(&key) {
        Some(o) => *o = (*o).min(offset),
        None if !full => {
            offsets.insert(key, offset);
        }
        None => {}
    }
}

/// Client ids that get a label of their own in the quota metrics; the rest add up under
/// `client="__other__"`.
pub const MAX_CLIENT_LABELS: usize = 1000;

/// Cluster mesh metrics (with the cluster on): peers, and per peer what was forwarded.
fn mesh_metrics(out: &mut Out, shared: &Shared) {
    let Some(mesh) = &shared.mesh else {
        return;
    };
    let counters = mesh.peer_counters();
    out.single(
        "aqueduct_mesh_peers",
        "gauge",
        "Cluster peers connected now.",
        counters.len(),
    );
    type Get = fn(&crate::mesh::PeerCounters) -> u64;
    let families: [(&str, &str, &str, Get); 10] = [
        (
            "aqueduct_mesh_forwarded_total",
            "counter",
            "Copies of messages queued for a peer (its plain subscribers, groups picked there).",
            |c| c.forwarded,
        ),
        (
            "aqueduct_mesh_dropped_total",
            "counter",
            "Copies dropped because a peer's queue was full (cluster.peer_queue_size; oldest first).",
            |c| c.dropped,
        ),
        (
            "aqueduct_mesh_bytes_sent_total",
            "counter",
            "Bytes of copies written to a peer (after compression).",
            |c| c.bytes,
        ),
        (
            "aqueduct_mesh_bytes_uncompressed_total",
            "counter",
            "Bytes of copies for a peer before compression (divided by bytes sent: the ratio).",
            |c| c.raw_bytes,
        ),
        (
            "aqueduct_mesh_expired_total",
            "counter",
            "Copies whose TTL ran out while they waited in a peer's queue (not sent).",
            |c| c.expired,
        ),
        (
            "aqueduct_mesh_queue_depth",
            "gauge",
            "Copies waiting in a peer's queue now.",
            |c| c.queued,
        ),
        (
            "aqueduct_mesh_received_total",
            "counter",
            "Copies of messages received from a peer.",
            |c| c.received,
        ),
        (
            "aqueduct_mesh_bytes_received_total",
            "counter",
            "Bytes of copies received from a peer (as sent, compressed or not).",
            |c| c.received_bytes,
        ),
        (
            "aqueduct_mesh_reconnects_total",
            "counter",
            "Times a peer was connected again after being disconnected.",
            |c| c.reconnects,
        ),
        (
            "aqueduct_mesh_not_stored_total",
            "counter",
            "Copies from a peer dropped because the durable log here was failing or closed.",
            |c| c.not_stored,
        ),
    ];
    for (name, kind, help, get) in families {
        out.header(name, kind, help);
        for c in &counters {
            out.sample(name, &[("peer", c.node.as_str())], get(c));
        }
    }
    out.single(
        "aqueduct_mesh_discarded_total",
        "counter",
        "Copies not sent because their peer went away: still queued when it did, or routed to it just after.",
        mesh.discarded.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_unplaced_total",
        "counter",
        "Consumer-group copies received from peers whose group had no member left here or on any node they had not been to: dropped.",
        mesh.unplaced.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_duplicates_retired_total",
        "counter",
        "Duplicate mesh connections (both ends dialed) retired: finished, read to the end, closed.",
        mesh.retired.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_control_overflows_total",
        "counter",
        "Mesh connections closed because the peer did not read its control stream (65,536 interest updates waiting).",
        mesh.control_overflows.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_interest_refused_total",
        "counter",
        "Mesh connections closed because the peer's interest (topic filters and consumer groups) went beyond cluster.max_peer_interest.",
        mesh.interest_refused.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_connections_refused_total",
        "counter",
        &format!(
            "Mesh connections closed at once because their peer already had {} open to this node.",
            crate::mesh::MAX_CONNECTIONS_PER_PEER
        ),
        mesh.connections_refused
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_interest_refused_by_peer_total",
        "counter",
        "Mesh connections a peer closed because this node's interest went beyond its cluster.max_peer_interest.",
        mesh.refused_by_peer.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_protocol_errors_total",
        "counter",
        "Mesh connections this node closed because the peer broke the mesh protocol: an undecodable or out-of-order control message, a malformed data block, or a leave not finished within 7 s.",
        mesh.protocol_errors.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_group_handovers_total",
        "counter",
        "Consumer-group messages given to a member on another node because no member was left here.",
        mesh.handed_over.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_leaves_unconfirmed_total",
        "counter",
        "Peers that did not confirm, while this node was shutting down, that they had published every copy it sent them (within 5 s).",
        mesh.leaves_unconfirmed.load(std::sync::atomic::Ordering::Relaxed),
    );
    out.single(
        "aqueduct_mesh_blocks_refused_total",
        "counter",
        "Blocks of copies refused from peers (a compression bomb, a malformed block); the connection is closed.",
        mesh.refused_blocks.load(std::sync::atomic::Ordering::Relaxed),
    );
}

/// ACL, quota and admin API metrics.
fn access_metrics(out: &mut Out, shared: &Shared) {
    let stats = &shared.stats;
    out.header(
        "aqueduct_acl_denied_total",
        "counter",
        "Requests the ACL refused (publish frames; subscriptions, including live ones closed when the rules changed).",
    );
    for (action, n) in [
        ("publish", &stats.acl_denied_publish),
        ("subscribe", &stats.acl_denied_subscribe),
    ] {
        out.sample(
            "aqueduct_acl_denied_total",
            &[("action", action)],
            n.load(Ordering::Relaxed),
        );
    }
    let acl = shared.access.acl.policy();
    out.single(
        "aqueduct_acl_enabled",
        "gauge",
        "1 if access control is on.",
        u8::from(acl.enabled),
    );
    out.single(
        "aqueduct_acl_rules",
        "gauge",
        "ACL rules in force.",
        acl.rules.len(),
    );
    out.single(
        "aqueduct_access_policy_changes_total",
        "counter",
        "ACL and quota changes applied (admin API calls and SIGHUP reloads).",
        shared.access.changes.load(Ordering::Relaxed),
    );
    // Per client, bounded: the first MAX_CLIENT_LABELS ids in order, the rest summed.
    let buckets = shared.access.quotas.buckets();
    let mut rows: Vec<(String, f64, u64)> = Vec::new();
    let mut other = (0.0, 0u64, false);
    for (i, (id, bucket)) in buckets.iter().enumerate() {
        let (held, rejected) = bucket.counters();
        if i < MAX_CLIENT_LABELS && id != OTHER_TOPIC {
            rows.push((id.clone(), held.as_secs_f64(), rejected));
        } else {
            other = (other.0 + held.as_secs_f64(), other.1 + rejected, true);
        }
    }
    if other.2 {
        rows.push((OTHER_TOPIC.to_owned(), other.0, other.1));
    }
    out.header(
        "aqueduct_quota_throttled_seconds_total",
        "counter",
        "Time a client's publishing streams were not read because it was over its quota (broker.quotas.action: throttle).",
    );
    for (id, held, _) in &rows {
        out.sample(
            "aqueduct_quota_throttled_seconds_total",
            &[("client", id)],
            held,
        );
    }
    out.header(
        "aqueduct_quota_rejected_messages_total",
        "counter",
        "Messages refused with RATE_LIMITED because the client was over its quota (broker.quotas.action: reject).",
    );
    for (id, _, rejected) in &rows {
        out.sample(
            "aqueduct_quota_rejected_messages_total",
            &[("client", id)],
            rejected,
        );
    }
    out.single(
        "aqueduct_admin_handshakes_failed_total",
        "counter",
        "Admin API TLS handshakes refused (no or untrusted client certificate, timeout).",
        stats.admin_handshakes_failed.load(Ordering::Relaxed),
    );
    out.single(
        "aqueduct_admin_calls_denied_total",
        "counter",
        "Admin API calls refused because the certificate CN does not match admin.allowed_cn.",
        stats.admin_denied.load(Ordering::Relaxed),
    );
}

/// Render every metric.
pub(crate) fn render(shared: &Shared, labels: &TopicLabels) -> String {
    let broker = &shared.broker;
    let max = shared.config.metrics.max_topic_labels;
    // Per topic, with the cardinality bound applied.
    // One scrape at a time, each reading the counters after the previous one did: the lock is
    // taken before they are read.
    let mut state = labels.state.lock().unwrap_or_else(|e| e.into_inner());
    let (mut topics, evicted) = broker.topic_snapshots_and_evicted_stats();
    topics.sort_by(|a, b| a.0.cmp(&b.0));
    let named = state.series(max, &topics, evicted);

    let mut out = Out(String::with_capacity(16 * 1024 + named.len() * 1024));
    let per_topic: [(&str, &str, Getter); 5] = [
        (
            "aqueduct_messages_published_total",
            "Messages accepted for a topic.",
            |s| s.published,
        ),
        (
            "aqueduct_messages_delivered_total",
            "Deliveries written to subscribers.",
            |s| s.delivered,
        ),
        (
            "aqueduct_messages_nacked_total",
            "Deliveries rejected by a NACK.",
            |s| s.nacked,
        ),
        (
            "aqueduct_messages_redelivered_total",
            "Redeliveries (NACK, ack timeout, member left).",
            |s| s.redelivered,
        ),
        (
            "aqueduct_messages_dead_lettered_total",
            "Messages moved to __dlq__<topic>.",
            |s| s.dead_lettered,
        ),
    ];
    for (name, help, get) in per_topic {
        out.header(name, "counter", help);
        for (topic, s) in &named {
            out.sample(name, &[("topic", topic)], get(s));
        }
    }
    out.header(
        "aqueduct_messages_expired_total",
        "counter",
        "Messages dropped because their TTL passed before delivery.",
    );
    for (topic, s) in &named {
        for level in 0..Priority::LEVELS as u8 {
            let p = Priority::new(level).unwrap_or_default();
            out.sample(
                "aqueduct_messages_expired_total",
                &[("topic", topic), ("priority", &level.to_string())],
                s.expired(p),
            );
        }
    }
    out.header(
        "aqueduct_messages_dropped_total",
        "counter",
        "Messages dropped without delivery; label policy: drop_oldest, drop_newest, disconnect (queue overflow), unsubscribed or retries_exhausted.",
    );
    for (topic, s) in &named {
        for reason in DropReason::ALL {
            out.sample(
                "aqueduct_messages_dropped_total",
                &[("topic", topic), ("policy", reason.label())],
                s.dropped(reason),
            );
        }
    }

    let subscribers = broker.subscribers();
    out.single(
        "aqueduct_active_subscribers",
        "gauge",
        "Live subscriptions.",
        subscribers.len(),
    );
    out.single(
        "aqueduct_topics",
        "gauge",
        "Topics the broker holds state for (idle topics without subscribers are evicted).",
        topics.len(),
    );
    out.single(
        "aqueduct_topics_evicted_total",
        "counter",
        "Idle topics without subscribers whose state was freed.",
        broker.topics_evicted(),
    );

    out.header(
        "aqueduct_consumer_offset",
        "gauge",
        "Committed offset of a consumer group per topic: every message below it is settled.",
    );
    // Bounded too: group ids are the clients' to choose, and each group could add a series
    // per labelled topic: the first `max` (group id, topic) pairs in that order, routed and
    // durable groups alike (so the set shown does not change from scrape to scrape). One
    // series per pair: the same id on two filters is one consumer for the dashboard, at the
    // lower (further behind) of its offsets. Durable groups are fed by the log, not by
    // routing: their committed offset is their position as last saved.
    let mut all: Vec<(String, TopicName, u64)> = Vec::new();
    for g in broker.groups() {
        for (topic, offset) in g.committed_offsets() {
            all.push((g.id().as_str().to_owned(), topic, offset));
        }
    }
    let durable = shared
        .consumers
        .as_ref()
        .map(|c| c.saved_group_positions())
        .unwrap_or_default();
    for (group, next) in durable {
        for (topic, offset) in next {
            if let Ok(topic) = TopicName::from_slice(&topic) {
                all.push((group.clone(), topic, offset));
            }
        }
    }
    all.sort_by(|a, b| (&a.0, a.1.as_bytes()).cmp(&(&b.0, b.1.as_bytes())));
    let mut offsets: BTreeMap<(String, String), u64> = BTreeMap::new();
    for (group, topic, offset) in &all {
        // Offsets do not add up; topics beyond the label bound are left out.
        if state.is_labelled(topic) {
            note_offset(&mut offsets, (group, topic.as_str()), *offset, max);
        }
    }
    for ((consumer, topic), offset) in &offsets {
        out.sample(
            "aqueduct_consumer_offset",
            &[("consumer", consumer), ("topic", topic)],
            *offset,
        );
    }

    out.single(
        "aqueduct_slow_consumers_disconnected_total",
        "counter",
        "Subscriptions closed because their queue overflowed under the disconnect policy.",
        broker.slow_consumers_disconnected(),
    );

    // Queue depth distribution: how many subscribers have at most N messages queued.
    let depths: Vec<usize> = subscribers.iter().map(|s| s.queued()).collect();
    out.header(
        "aqueduct_subscribers_by_queue_depth",
        "gauge",
        "Subscribers whose queue holds at most `max_depth` messages (a snapshot distribution).",
    );
    for bound in DEPTH_BOUNDS {
        let n = depths.iter().filter(|d| **d <= bound).count();
        out.sample(
            "aqueduct_subscribers_by_queue_depth",
            &[("max_depth", &bound.to_string())],
            n,
        );
    }
    out.sample(
        "aqueduct_subscribers_by_queue_depth",
        &[("max_depth", "+Inf")],
        depths.len(),
    );
    out.single(
        "aqueduct_subscriber_queue_depth_max",
        "gauge",
        "The deepest subscriber queue, in messages.",
        depths.iter().max().copied().unwrap_or(0),
    );

    access_metrics(&mut out, shared);
    mesh_metrics(&mut out, shared);

    let lat = broker.latency();
    out.header(
        "aqueduct_delivery_latency_seconds",
        "histogram",
        "Time from the broker accepting a message to writing it to a subscriber.",
    );
    for (i, bound) in BOUNDS_US.iter().enumerate() {
        let le = format!("{}", *bound as f64 / 1e6);
        out.sample(
            "aqueduct_delivery_latency_seconds_bucket",
            &[("le", &le)],
            lat.cumulative[i],
        );
    }
    // The last cumulative bucket, not the count read after the buckets: a flush between the two
    // reads could make +Inf lower than a finite bucket.
    let all = lat.cumulative.last().copied().unwrap_or(lat.count);
    out.sample(
        "aqueduct_delivery_latency_seconds_bucket",
        &[("le", "+Inf")],
        all,
    );
    out.sample(
        "aqueduct_delivery_latency_seconds_sum",
        &[],
        lat.sum.as_secs_f64(),
    );
    out.sample("aqueduct_delivery_latency_seconds_count", &[], all);

    let st = &shared.stats;
    out.single(
        "aqueduct_connections",
        "gauge",
        "Open client connections.",
        shared.connections.load(Ordering::Acquire),
    );
    out.single(
        "aqueduct_runtime_worker_threads",
        "gauge",
        "Worker threads of the async runtime serving the broker (broker.worker_threads).",
        tokio::runtime::Handle::current().metrics().num_workers(),
    );
    let rt = tokio::runtime::Handle::current().metrics();
    let workers = 0..rt.num_workers();
    out.single(
        "aqueduct_runtime_worker_parks_total",
        "counter",
        "Times a runtime worker thread went to sleep for want of work (each is woken again later: a wake-up between threads).",
        workers.clone().map(|w| rt.worker_park_count(w)).sum::<u64>(),
    );
    out.single(
        "aqueduct_runtime_worker_busy_seconds_total",
        "counter",
        "Time the runtime's worker threads spent running tasks, summed over the threads.",
        workers
            .map(|w| rt.worker_total_busy_duration(w).as_secs_f64())
            .sum::<f64>(),
    );
    let spins = aqueduct_udp::idle_spin_stats();
    out.header(
        "aqueduct_runtime_idle_spins_total",
        "counter",
        "Spins of a runtime thread out of work before it slept (broker.idle_spin), by how they ended: found_work (a packet, or a task queued from outside the runtime, came) or expired (it slept after all).",
    );
    out.sample(
        "aqueduct_runtime_idle_spins_total",
        &[("outcome", "found_work")],
        spins.found_work,
    );
    out.sample(
        "aqueduct_runtime_idle_spins_total",
        &[("outcome", "expired")],
        spins.expired,
    );
    out.single(
        "aqueduct_runtime_idle_spin_seconds_total",
        "counter",
        "Time runtime threads spent spinning before they slept (broker.idle_spin), summed over the threads: CPU time, given up to any other thread that wants the CPU.",
        std::time::Duration::from_nanos(spins.spin_nanos).as_secs_f64(),
    );
    out.single(
        "aqueduct_quota_throttled_frames",
        "gauge",
        "Publish frames waiting now for their client's quota (broker.quotas.action throttle); each holds its stream.",
        st.quota_waiting.load(Ordering::Relaxed),
    );
    let counters: [(&str, &str, u64); 16] = [
        (
            "aqueduct_direct_writes_total",
            "Deliveries written by the publishing stream task straight into an idle subscriber stream, without waking its writer.",
            st.direct_writes.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_streams_stopped_total",
            "Delivery streams whose client stopped reading (STOP_SENDING); their subscriptions get nothing more.",
            st.streams_stopped.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_connections_revoked_total",
            "Connections closed (NOT_AUTHORIZED) because tls.crl_file revokes their client certificate (open ones on a reload, resumed sessions).",
            st.connections_revoked.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_stream_finish_timeouts_total",
            "Streams the client finished but did not read: a write of which it took nothing for 5 s (stream reset, subscriptions ended), in the final flush too.",
            st.finish_timeouts.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_stream_task_panics_total",
            "Stream tasks that panicked (a bug: the broker logs it and goes on; the stream's subscriptions ended with it).",
            st.stream_task_panics.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_connections_total",
            "Connections accepted since start.",
            st.connections_total.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_connections_refused_total",
            "Connections refused (transport.max_connections).",
            st.connections_refused.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_handshakes_failed_total",
            "TLS handshakes that failed or timed out.",
            st.handshakes_failed.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_webtransport_sessions_total",
            "WebTransport sessions established (browsers, native WebTransport clients).",
            st.webtransport_sessions.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_webtransport_refused_total",
            "WebTransport sessions refused (path, origin or token).",
            st.webtransport_refused.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_bytes_received_total",
            "Bytes read from client streams.",
            st.bytes_in.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_bytes_sent_total",
            "Bytes written to client streams.",
            st.bytes_out.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_slow_consumer_stream_resets_total",
            "Delivery streams reset because a slow consumer blocked them.",
            st.slow_consumer_resets.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_publish_holds_total",
            "Times a publishing stream was held because a block-policy subscriber's queue was full.",
            st.publish_holds.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_stream_reads_held_total",
            "Times a stream stopped being read because its client left over 1 MiB of replies unread, or the durable log owed it too many answers.",
            st.reads_held.load(Ordering::Relaxed),
        ),
        (
            "aqueduct_subscriptions_refused_total",
            "SUBSCRIBEs refused by transport.max_subscriptions_per_connection.",
            st.subscriptions_refused.load(Ordering::Relaxed),
        ),
    ];
    out.single(
        "aqueduct_live_streams",
        "gauge",
        "QUIC streams being served now (each by one task).",
        st.live_streams.load(Ordering::Relaxed),
    );
    for (name, help, v) in counters {
        out.single(name, "counter", help, v);
    }
    out.single(
        "aqueduct_publish_held_seconds_total",
        "counter",
        "Time publishing streams spent held by full block-policy subscriber queues.",
        st.publish_held_us.load(Ordering::Relaxed) as f64 / 1e6,
    );
    if let Some(t) = &shared.tracer {
        let ts = &t.stats;
        for (name, help, v) in [
            (
                "aqueduct_trace_spans_recorded_total",
                "Trace spans made (tracing.otlp_endpoint set: publish, route and deliver spans of sampled messages).",
                &ts.recorded,
            ),
            (
                "aqueduct_trace_spans_exported_total",
                "Trace spans the collector accepted.",
                &ts.exported,
            ),
            (
                "aqueduct_trace_spans_dropped_total",
                "Trace spans lost: the export queue was full, or the collector refused or could not be reached.",
                &ts.dropped,
            ),
            (
                "aqueduct_trace_export_failures_total",
                "Export requests to the collector that failed.",
                &ts.export_failures,
            ),
        ] {
            out.single(name, "counter", help, v.load(Ordering::Relaxed));
        }
    }
    if let Some(d) = &shared.durable {
        let ds = &d.stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        for (name, kind, help, v) in [
            (
                "aqueduct_log_segments",
                "gauge",
                "Segment files of the durable log.",
                load(&ds.segments),
            ),
            (
                "aqueduct_log_previous_key_segments",
                "gauge",
                "Segments of the durable log sealed with a key of aal.previous_keys: at 0 none of them is needed any more.",
                load(&ds.previous_key_segments),
            ),
            (
                "aqueduct_log_topics",
                "gauge",
                "Topics whose offsets the durable log keeps: those with messages in it, and those retention emptied that it could not forget (about 0.7 KB of memory each).",
                load(&ds.topics),
            ),
            (
                "aqueduct_log_topics_forgotten_total",
                "counter",
                "Topics retention emptied that the durable log forgot (the broker held no state for them and every durable consumer had read them to the end); one published to again goes on past the log's offset floor.",
                load(&ds.forgotten_topics),
            ),
            (
                "aqueduct_log_bytes",
                "gauge",
                "Bytes in the durable log's segments.",
                load(&ds.bytes),
            ),
            (
                "aqueduct_log_queued_messages",
                "gauge",
                "Messages waiting for the log writer.",
                load(&ds.queued),
            ),
            (
                "aqueduct_log_damaged_batches",
                "gauge",
                "Damaged batches found in the log (skipped by readers, kept on disk).",
                load(&ds.damaged_batches),
            ),
            (
                "aqueduct_log_segments_deleted_total",
                "counter",
                "Sealed segments deleted by retention.",
                load(&ds.deleted_segments),
            ),
            (
                "aqueduct_log_truncated_bytes_total",
                "counter",
                "Bytes of torn writes cut from the log's tail at startup.",
                load(&ds.truncated_bytes),
            ),
            (
                "aqueduct_log_records_appended_total",
                "counter",
                "Messages written to the durable log.",
                load(&ds.appended_records),
            ),
            (
                "aqueduct_log_group_commits_total",
                "counter",
                "Group commits (appends of everything queued).",
                load(&ds.group_commits),
            ),
            (
                "aqueduct_log_syncs_total",
                "counter",
                "fdatasync calls on the log.",
                load(&ds.syncs),
            ),
            (
                "aqueduct_log_write_errors_total",
                "counter",
                "Publish frames answered STORAGE_FAILED (the log could not store them).",
                load(&ds.write_errors),
            ),
            (
                "aqueduct_log_read_errors_total",
                "counter",
                "Reads of the log for durable consumers that failed and are tried again.",
                load(&ds.read_errors),
            ),
            (
                "aqueduct_log_read_skips_total",
                "counter",
                "Reads of the log for durable consumers that met damage and skipped it.",
                load(&ds.read_skips),
            ),
            (
                "aqueduct_log_consumers_overtaken_total",
                "counter",
                "Times retention deleted messages a durable consumer had not read yet.",
                load(&ds.consumers_overtaken),
            ),
        ] {
            out.single(name, kind, help, v);
        }
        out.single(
            "aqueduct_log_frames_committed_total",
            "counter",
            "Clients' publish frames made durable (each confirmed, if it asked; not dead letters or cluster copies).",
            load(&ds.frames_committed),
        );
        out.single(
            "aqueduct_log_commit_wait_seconds_total",
            "counter",
            "Time those publish frames waited from being queued to being durable, summed.",
            load(&ds.commit_wait_us) as f64 / 1e6,
        );
    }
    out.header(
        "aqueduct_frames_rejected_total",
        "counter",
        "Client frames rejected, by reason.",
    );
    for (reason, n) in st.rejected_frames() {
        out.sample("aqueduct_frames_rejected_total", &[("reason", reason)], n);
    }
    out.header(
        "aqueduct_error_frames_sent_total",
        "counter",
        "ERROR frames sent to clients, by code.",
    );
    for (code, n) in st.errors_sent() {
        let name = ErrorCode(code).name().unwrap_or("UNKNOWN");
        out.sample(
            "aqueduct_error_frames_sent_total",
            &[("code", &code.to_string()), ("name", name)],
            n,
        );
    }
    out.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        let mut out = Out(String::new());
        out.sample("m", &[("topic", "a\"b\\c")], 1);
        assert_eq!(out.0, "m{topic=\"a\\\"b\\\\c\"} 1\n");
    }

    fn published(n: u64) -> TopicStatsSnapshot {
        TopicStatsSnapshot {
            published: n,
            ..TopicStatsSnapshot::default()
        }
    }

    fn topic(name: &str, life: u64, n: u64) -> LiveTopic {
        (
            TopicName::from_slice(name.as_bytes()).expect("topic"),
            life,
            published(n),
        )
    }

    fn shown(series: &[(String, TopicStatsSnapshot)]) -> Vec<(&str, u64)> {
        series
            .iter()
            .map(|(t, s)| (t.as_str(), s.published))
            .collect()
    }

    /// A topic named `__other__` (topics may start with `__`) gets no label of its own: it is
    /// counted in the overflow series, not beside it under the same labels.
    #[test]
    fn a_topic_named_other_is_counted_in_the_overflow_series() {
        let mut s = LabelState::default();
        let none = TopicStatsSnapshot::default();
        let shown_now = s.series(2, &[topic("__other__", 1, 4), topic("a", 2, 5)], none);
        assert_eq!(shown(&shown_now), [("a", 5), ("__other__", 4)]);
    }

    /// A labelled topic the broker frees keeps its series at its counts (they do not jump into
    /// `__other__`) and continues from there when it comes back; unlabelled topics' counts stay
    /// in `__other__` whether live or freed; no series goes down.
    #[test]
    fn freed_topics_keep_their_label_and_counts_and_nothing_jumps_into_other() {
        let mut s = LabelState::default();
        let none = TopicStatsSnapshot::default();
        let first = s.series(
            2,
            &[topic("a", 1, 5), topic("b", 2, 7), topic("c", 3, 3)],
            none.clone(),
        );
        assert_eq!(shown(&first), [("a", 5), ("b", 7), ("__other__", 3)]);
        // `a` (5, plus 1 after that scrape) and `c` (3) are freed.
        let freed = s.series(2, &[topic("b", 2, 8)], published(6 + 3));
        assert_eq!(shown(&freed), [("a", 5), ("b", 8), ("__other__", 1 + 3)]);
        // `a` comes back (a new life): it continues from its count; a new topic has no label
        // left.
        let back = s.series(
            2,
            &[topic("a", 4, 2), topic("b", 2, 8), topic("d", 5, 4)],
            published(9),
        );
        assert_eq!(shown(&back), [("a", 7), ("b", 8), ("__other__", 4 + 4)]);
        // `b` is freed (at 8) and made anew between two scrapes, and its new life has already
        // counted more than the old one had: still seen as a new life, its series continues
        // from what it had shown.
        let anew = s.series(
            2,
            &[topic("a", 4, 2), topic("b", 6, 20), topic("d", 5, 4)],
            published(9 + 8),
        );
        assert_eq!(shown(&anew), [("a", 7), ("b", 28), ("__other__", 4 + 4)]);
        assert!(s.is_labelled(&TopicName::from_slice(b"a").expect("topic")));
        assert!(!s.is_labelled(&TopicName::from_slice(b"d").expect("topic")));
    }
}
