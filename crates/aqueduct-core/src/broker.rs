//! The broker: routing, fan-out, consumer groups, settlement, redelivery and dead letters.
//!
//! # Concurrency model
//! - `routes` (RwLock): the subscription index and, inside it, each consumer group's members and
//!   round-robin cursor. Publishers take the read lock only long enough to collect their targets
//!   into a reusable buffer (no allocation, no enqueueing under the lock); subscribe and
//!   unsubscribe take the write lock.
//! - `topics` (RwLock): topic name → [`TopicState`] (offset sequence, counters). Read-locked for a
//!   lookup, write-locked only the first time a topic is seen. A [`PublishContext`] caches the
//!   last topic, so a batch to one topic looks it up once.
//! - each [`Subscriber`] has its own mutex over its queues and in-flight set.
//! - each group has a mutex over its watermarks ([`GroupShared`]).
//!
//! Two nestings exist, always in this order: a subscriber's mutex → its group's watermarks (a
//! delivery noted as handed out, from inside an enqueue or a drain), and `routes` → a durable
//! group's `parked` list (a message parked, or taken by a joining member). Nothing takes
//! `routes` or `topics` while holding a subscriber's mutex, and group picks under `routes` read
//! only atomics; keep it so. Publishes from different connections proceed in parallel; they
//! meet only on the subscribers they share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use aqueduct_proto::delivery::{Arena, DeadLetter, DeliveryFields};
use aqueduct_proto::{
    AckMode, Compression, GroupId, OverflowPolicy, Priority, Publish, PublishRef, SharedDelivery,
    SubscribeSpec, TopicName, TopicRef, TraceContext,
};
use bytes::{BufMut, Bytes};
use foldhash::fast::RandomState;

use crate::config::BrokerConfig;
use crate::group::{GroupShared, RoundRobin};
use crate::index::SubscriptionIndex;
use crate::latency::{LatencyHistogram, LatencySnapshot};
use crate::subscriber::{
    CloseReason, Delivery, Drained, Enqueued, Refused, SettleError, Subscriber, SubscriberId,
    SubscriberInit, Waker,
};
use crate::topic::{DropReason, TopicState, TopicStatsSnapshot};

/// Prefix of dead-letter topics.
pub const DLQ_PREFIX: &str = "__dlq__";

/// A message to publish, borrowed from wherever it was decoded.
#[derive(Debug, Clone, Copy)]
pub struct Publication<'a> {
    pub topic: TopicRef<'a>,
    pub body: &'a [u8],
    pub priority: Priority,
    /// The message's own TTL (a priority TTL from the config overrides it).
    pub ttl: Option<Duration>,
    pub trace: Option<&'a TraceContext>,
    pub compression: Option<&'a Compression>,
    /// Set only when the broker dead-letters a message.
    pub(crate) dead_letter: Option<&'a DeadLetter<'a>>,
    /// Delivery attempts already made elsewhere (a group message handed over by a cluster
    /// peer): its first delivery here is attempt `attempts + 1`.
    pub(crate) attempts: u32,
    /// Its trace context names a span made by another process (a cluster peer's copy).
    pub(crate) remote_trace: bool,
}

impl<'a> Publication<'a> {
    /// Default priority, no TTL.
    pub fn new(topic: &'a TopicName, body: &'a [u8]) -> Self {
        Publication {
            topic: topic.borrowed(),
            body,
            priority: Priority::DEFAULT,
            ttl: None,
            trace: None,
            compression: None,
            dead_letter: None,
            attempts: 0,
            remote_trace: false,
        }
    }

    /// A sub-frame of a PUBLISH_BATCH, decoded without copies.
    pub fn from_ref(p: &'a PublishRef<'a>) -> Self {
        Publication {
            topic: p.topic,
            body: p.body,
            priority: p.priority,
            ttl: p.ttl_ms.map(|ms| Duration::from_millis(u64::from(ms))),
            trace: p.trace.as_ref(),
            compression: p.compression.as_ref(),
            dead_letter: None,
            attempts: 0,
            remote_trace: false,
        }
    }

    /// The same publication as the dead letter described by `info` (a dead letter read back from
    /// the durable log, or forwarded by a cluster peer).
    pub fn with_dead_letter(mut self, info: &'a DeadLetter<'a>) -> Self {
        self.dead_letter = Some(info);
        self
    }

    /// Everything a decoded PUBLISH frame says.
    pub fn from_publish(p: &'a Publish) -> Self {
        Publication {
            topic: p.topic().borrowed(),
            body: &p.body,
            priority: p.priority(),
            ttl: p.ttl_ms().map(|ms| Duration::from_millis(u64::from(ms))),
            trace: p.ext.trace.as_ref(),
            compression: p.ext.compression.as_ref(),
            dead_letter: None,
            attempts: 0,
            remote_trace: false,
        }
    }

    /// What it is a dead letter of, if it is one.
    pub fn dead_letter(&self) -> Option<&'a DeadLetter<'a>> {
        self.dead_letter
    }

    /// Delivery attempts already made on another node (see [`Orphan`]): this node's first
    /// delivery is attempt `attempts + 1`, so `max_retries` holds across a hand-over.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The same message with `attempts` delivery attempts already made elsewhere.
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    /// The same message, its trace context (if any) naming a span made by another process: a
    /// copy a cluster peer forwarded, whose context names that peer's `publish` span. Its
    /// deliveries say so ([`Delivery::trace_is_remote`]).
    pub fn with_remote_trace(mut self) -> Self {
        self.remote_trace = true;
        self
    }
}

/// What a publish did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOutcome {
    /// The offset assigned in the topic.
    pub offset: u64,
    /// Subscriptions it was handed to (one per matching plain subscription, one per group).
    pub routed: usize,
}

/// Per-caller scratch space: reuse one per connection (or thread) so publishing allocates nothing
/// in steady state.
#[derive(Debug, Default)]
pub struct PublishContext {
    arena: Arena,
    targets: Vec<Arc<Subscriber>>,
    pending: Vec<Delivery>,
    refused: Vec<Delivery>,
    last_topic: Option<Arc<TopicState>>,
    /// Subscribers whose queue filled up under the block policy since the last `take_held`.
    held: Vec<Arc<Subscriber>>,
    /// Their ids: each is in `held` once, found in constant time (a scan of `held` made a
    /// publish that filled N `block` queues cost N² comparisons).
    held_ids: std::collections::HashSet<SubscriberId, RandomState>,
    /// Keep a record of every dead letter published through this context (for the durable log).
    record_dead_letters: bool,
    /// Which subscriptions routing may pick (the cluster mesh narrows it); `None`: all.
    scope: Option<Scope>,
    dead_letters: Vec<DeadLetterRecord>,
    /// Group hand-offs not made yet (see [`Broker::hand_to_group`]): a hand-off that closes a
    /// full member hands its messages on in turn, and those wait here instead of recursing.
    handoffs: std::collections::VecDeque<(Arc<GroupShared>, Delivery, Option<SubscriberId>)>,
    /// A hand-off loop is running further up the stack: new hand-offs join its queue.
    handing_off: bool,
    /// Groups the scope names that routing found no member of here (see [`Broker::route`]).
    unplaced: Vec<crate::mesh::GroupKey>,
}

/// Which subscriptions a publish may be routed to.
#[derive(Debug, Default)]
struct Scope {
    plain: bool,
    groups: Vec<crate::mesh::GroupKey>,
    /// `groups` are the groups *not* to route to (else the only ones).
    except: bool,
}

impl Scope {
    fn allows_group(&self, g: &GroupShared) -> bool {
        let listed = self
            .groups
            .iter()
            .any(|k| k.group == *g.id() && k.filter == *g.filter());
        listed != self.except
    }
}

/// A dead letter the broker published, with its offset in the dead-letter topic: what the
/// durable log stores of it.
#[derive(Debug, Clone)]
pub struct DeadLetterRecord {
    /// The dead-letter topic's state.
    pub topic: Arc<TopicState>,
    pub offset: u64,
    pub priority: Priority,
    pub body: bytes::Bytes,
    pub trace: Option<TraceContext>,
    pub compression: Option<Compression>,
    pub original_topic: TopicName,
    pub original_offset: u64,
    pub attempts_made: u32,
    pub reason: String,
}

impl PublishContext {
    /// From now on, keep a [`DeadLetterRecord`] of every dead letter published through this
    /// context, to be taken with [`take_dead_letters`](Self::take_dead_letters).
    pub fn record_dead_letters(&mut self) {
        self.record_dead_letters = true;
    }

    /// Route what is published through this context next to plain subscriptions only if
    /// `plain`, and to consumer groups only if `groups` lists them (a copy a cluster peer sent
    /// this node for its plain subscribers and the groups it picked here).
    /// [`clear_scope`](Self::clear_scope) goes back to routing to all.
    pub fn scope_only(&mut self, plain: bool, groups: &[crate::mesh::GroupKey]) {
        self.set_scope(plain, groups, false);
    }

    /// Route what is published through this context next to every matching subscription but the
    /// consumer groups in `groups` (the cluster mesh picked members on other nodes for them).
    pub fn scope_except(&mut self, groups: &[crate::mesh::GroupKey]) {
        self.set_scope(true, groups, true);
    }

    fn set_scope(&mut self, plain: bool, groups: &[crate::mesh::GroupKey], except: bool) {
        let scope = self.scope.get_or_insert_with(Scope::default);
        scope.plain = plain;
        scope.except = except;
        scope.groups.clear();
        scope.groups.extend_from_slice(groups);
    }

    /// Route to every matching subscription again.
    pub fn clear_scope(&mut self) {
        self.scope = None;
    }

    /// The dead letters recorded since the last call.
    pub fn take_dead_letters(&mut self) -> std::vec::Drain<'_, DeadLetterRecord> {
        self.dead_letters.drain(..)
    }

    /// A subscriber that work through this context (a publish, a redelivery, a dead letter) left
    /// with a full queue under the block policy: the caller should stop taking work from its
    /// source until [`Subscriber::poll_room`] is ready (and call this again until it returns
    /// `None`).
    pub fn take_held(&mut self) -> Option<Arc<Subscriber>> {
        let sub = self.held.pop()?;
        self.held_ids.remove(&sub.id());
        Some(sub)
    }

    /// Forget held subscribers: for a caller that has nothing to hold back (and leaves them
    /// unwatched: see [`Broker::watch_full`]).
    pub fn clear_held(&mut self) {
        self.held.clear();
        self.held_ids.clear();
    }
}

/// How a subscription is made (besides its SUBSCRIBE payload).
pub struct SubscribeOptions {
    /// The SUBSCRIBE frame's stream id; deliveries carry it.
    pub stream_id: u32,
    /// Explicit ACKs for a plain subscription (group members always ack).
    pub ack_mode: AckMode,
    /// Overrides the broker's default overflow policy.
    pub overflow: Option<OverflowPolicy>,
    /// Called when the subscriber has something for its writer.
    pub waker: Option<Waker>,
    /// Deliver in the seed's form (a SUBSCRIBE sent without an extension block): see
    /// `docs/protocol.md`, "Seed-style subscriptions".
    pub seed_form: bool,
    /// At most this many unsettled deliveries at a time (a "prefetch"); the broker's
    /// `max_in_flight` if lower.
    pub max_in_flight: Option<usize>,
    /// Counted up when the subscription closes (its connection's: see
    /// [`Subscriber::closes`](crate::Subscriber)).
    pub closes: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl std::fmt::Debug for SubscribeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscribeOptions")
            .field("stream_id", &self.stream_id)
            .field("ack_mode", &self.ack_mode)
            .field("overflow", &self.overflow)
            .field("seed_form", &self.seed_form)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            stream_id: 0,
            ack_mode: AckMode::None,
            overflow: None,
            waker: None,
            seed_form: false,
            max_in_flight: None,
            closes: None,
        }
    }
}

/// `Clone` only because the index's trie nodes are copy-on-write (index.rs): the broker's
/// index is never cloned, so no route is ever copied.
#[derive(Debug, Clone)]
enum Route {
    Plain(Arc<Subscriber>),
    Group(GroupEntry),
}

#[derive(Debug, Clone)]
struct GroupEntry {
    shared: Arc<GroupShared>,
    members: Vec<Arc<Subscriber>>,
    /// Members detached (their client stopped reading) but not yet removed: they may still
    /// hand unsettled deliveries back to the group, so it stays while any is left.
    detached: Vec<SubscriberId>,
    turn: RoundRobin,
}

impl GroupEntry {
    fn new(shared: &Arc<GroupShared>) -> GroupEntry {
        GroupEntry {
            shared: shared.clone(),
            members: Vec::new(),
            detached: Vec::new(),
            turn: RoundRobin::default(),
        }
    }

    /// The next member in round-robin order that can take a message now (not stalled with a
    /// full queue, not at `max_in_flight`), preferring any other than `exclude` (the member
    /// handing a message back). `exclude` is taken when it has room and no other member has:
    /// only when every member is full does the turn fall back to a live member (whose policy
    /// then applies), again another than `exclude` first.
    fn pick(
        &self,
        exclude: Option<SubscriberId>,
        max_in_flight: usize,
    ) -> Option<&Arc<Subscriber>> {
        let other = |m: &Arc<Subscriber>| Some(m.id()) != exclude;
        let room = |m: &Arc<Subscriber>| m.has_room(max_in_flight);
        let live = |m: &Arc<Subscriber>| !m.is_closed();
        let pick =
            |eligible: &dyn Fn(&Arc<Subscriber>) -> bool| self.turn.pick(&self.members, eligible);
        pick(&|m| other(m) && room(m))
            .or_else(|| exclude.and_then(|_| pick(&room)))
            .or_else(|| pick(&|m| other(m) && live(m)))
            .or_else(|| exclude.and_then(|_| pick(&live)))
    }
}

#[derive(Debug, Default)]
struct Routes {
    index: SubscriptionIndex<Route>,
    subscribers: HashMap<SubscriberId, Arc<Subscriber>, RandomState>,
    /// Consumer groups that routing never feeds: durable groups, fed from the durable log (see
    /// [`Broker::subscribe_unrouted`]). Their members leave, redeliver and hand over messages as
    /// any group's do.
    unrouted_groups: Vec<GroupEntry>,
}

impl Routes {
    /// Take `sub` out of the index (and out of its group). `detaching`: `sub` stays with its
    /// group as a detached member, whose unsettled deliveries still come back to the group;
    /// otherwise it leaves for good. A group is dropped when it has neither members nor
    /// detached members left. Idempotent.
    fn unroute(&mut self, sub: &Subscriber, detaching: bool) {
        match sub.group() {
            // An unrouted group stays, members or not, until `forget_unrouted_group`: what it
            // has parked must wait for the next member (its owner decides when it is over).
            Some(shared) if sub.is_unrouted() => {
                if let Some(g) = self
                    .unrouted_groups
                    .iter_mut()
                    .find(|g| Arc::ptr_eq(&g.shared, shared))
                {
                    g.members.retain(|m| m.id() != sub.id());
                }
            }
            Some(shared) => {
                let mut empty = false;
                if let Some(list) = self.index.entries_mut(sub.filter()) {
                    for r in list.iter_mut() {
                        if let Route::Group(g) = r {
                            if Arc::ptr_eq(&g.shared, shared) {
                                let was_member = g.members.iter().any(|m| m.id() == sub.id());
                                g.members.retain(|m| m.id() != sub.id());
                                if !detaching {
                                    g.detached.retain(|&id| id != sub.id());
                                } else if was_member {
                                    g.detached.push(sub.id());
                                }
                                empty = g.members.is_empty() && g.detached.is_empty();
                            }
                        }
                    }
                }
                if empty {
                    self.index.remove_where(
                        sub.filter(),
                        |r| matches!(r, Route::Group(g) if Arc::ptr_eq(&g.shared, shared)),
                    );
                }
            }
            None => {
                self.index.remove_where(
                    sub.filter(),
                    |r| matches!(r, Route::Plain(s) if s.id() == sub.id()),
                );
            }
        }
    }

    fn group(&self, shared: &Arc<GroupShared>) -> Option<&GroupEntry> {
        self.index
            .entries(shared.filter())
            .iter()
            .find_map(|r| match r {
                Route::Group(g) if Arc::ptr_eq(&g.shared, shared) => Some(g),
                _ => None,
            })
            .or_else(|| {
                self.unrouted_groups
                    .iter()
                    .find(|g| Arc::ptr_eq(&g.shared, shared))
            })
    }
}

/// The broker core. Share it by `Arc`; every method takes `&self`.
#[derive(Debug, Default)]
pub struct Broker {
    config: BrokerConfig,
    routes: RwLock<Routes>,
    topics: RwLock<HashMap<TopicName, Arc<TopicState>, RandomState>>,
    next_id: AtomicU64,
    /// Publish → write latency of every delivery.
    latency: LatencyHistogram,
    /// Subscriptions closed by the disconnect policy.
    slow_consumers: AtomicU64,
    /// Topic count at which the next idle-topic sweep runs (see [`Broker::sweep_idle_topics`]).
    sweep_at: AtomicUsize,
    /// A sweep is running (one at a time).
    sweeping: AtomicBool,
    topics_evicted: AtomicU64,
    /// Counters of evicted topics, so that totals never go down. Locked only by sweeps and
    /// metric scrapes.
    evicted_stats: Mutex<TopicStatsSnapshot>,
    /// Where a topic's first offset comes from when its state is created (see
    /// [`Broker::set_offset_source`]); without one, `offset_floor`.
    offset_source: OffsetSourceCell,
    /// The highest next offset of any topic whose state was freed (0 before the first): without
    /// an offset source a topic created later starts here, so that a topic freed and published
    /// to again never hands out an offset twice. Changed only under the topic map's write lock.
    offset_floor: AtomicU64,
    /// Told of every routed subscription made or removed (the cluster mesh's interest).
    interest: InterestCell,
    /// Given the messages of a consumer group that no member here can take (the cluster mesh
    /// gives them to a member on another node).
    orphans: OrphanCell,
    /// Publishes dead letters across the cluster.
    dead_letter_router: DeadLetterCell,
    /// Block-policy subscriptions left full by work with no source to hold back.
    full: crate::full_watch::FullWatch,
}

/// A message of a routed consumer group that has no live member on this node any more (its
/// last one left with the message queued or unsettled). An [`OrphanListener`] can give it to a
/// member elsewhere (the cluster mesh); without one it is dropped and counted.
#[derive(Debug, Clone)]
pub struct Orphan {
    pub group: crate::mesh::GroupKey,
    pub topic: TopicName,
    pub body: Bytes,
    pub priority: Priority,
    /// What is left of its lifetime (`None`: no TTL).
    pub ttl: Option<Duration>,
    pub trace: Option<aqueduct_proto::TraceContext>,
    pub compression: Option<aqueduct_proto::Compression>,
    /// The attempt number its next delivery has (1: never delivered; a redelivery counts on).
    pub attempts: u32,
}

/// Publishes a dead letter the broker made: given the context, the dead letter and the local
/// publish to run. The cluster mesh runs the local publish (leaving out groups whose member it
/// picked on another node) and sends copies to the peers that want the dead-letter topic.
/// Called without the broker's locks held.
pub type DeadLetterRouter = Box<
    dyn Fn(&mut PublishContext, &Publication<'_>, &mut dyn FnMut(&mut PublishContext))
        + Send
        + Sync,
>;

#[derive(Default)]
struct DeadLetterCell(std::sync::OnceLock<DeadLetterRouter>);

impl std::fmt::Debug for DeadLetterCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeadLetterRouter")
    }
}

/// Takes an [`Orphan`] (returns true) or declines it (false: it is dropped and counted). Called
/// without the broker's locks held; it must not call back into the broker.
pub type OrphanListener = Box<dyn Fn(Orphan) -> bool + Send + Sync>;

#[derive(Default)]
struct OrphanCell(std::sync::OnceLock<OrphanListener>);

impl std::fmt::Debug for OrphanCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrphanListener")
    }
}

/// Called with a subscription's interest key and +1 when it is made, -1 when it is removed
/// (routed subscriptions only; under the routing lock, so it must be quick and not call back).
pub type InterestListener = Box<dyn Fn(crate::mesh::Key, i64) + Send + Sync>;

#[derive(Default)]
struct InterestCell(std::sync::OnceLock<InterestListener>);

impl std::fmt::Debug for InterestCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InterestListener")
    }
}

/// Count a message that leaves without being delivered (its subscription ended, no member is
/// left): as expired if its lifetime is over (§6.6), else as dropped for `reason`.
pub(crate) fn count_lost(d: &Delivery, reason: DropReason, now: Instant) {
    if d.expires_at.is_some_and(|at| at <= now) {
        d.topic.stats().expired(d.priority);
    } else {
        d.topic.stats().dropped(reason);
    }
}

/// The mesh interest key of a routed subscription.
fn interest_key(sub: &Subscriber) -> crate::mesh::Key {
    match sub.group() {
        Some(g) => crate::mesh::Key::Group(crate::mesh::GroupKey {
            filter: sub.filter().clone(),
            group: g.id().clone(),
        }),
        None => crate::mesh::Key::Plain(sub.filter().clone()),
    }
}

/// Gives the offset a topic's next message gets when the broker creates the topic's state (first
/// publish, or again after the topic was evicted while idle). The durable log's, so offsets go
/// on across restarts and evictions instead of starting at 0.
pub type OffsetSource = Box<dyn Fn(&TopicName) -> u64 + Send + Sync>;

/// A topic's name, [`life`](TopicState::life) and counters, as
/// [`Broker::topic_snapshots_and_evicted_stats`] copies them out.
pub type TopicSnapshot = (TopicName, u64, TopicStatsSnapshot);

#[derive(Default)]
struct OffsetSourceCell(std::sync::OnceLock<OffsetSource>);

impl std::fmt::Debug for OffsetSourceCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "OffsetSource(set)"
        } else {
            "OffsetSource(none)"
        })
    }
}

/// Topics held before idle ones are swept; after a sweep the next one runs at twice the number
/// left (at least this), so sweeping costs O(1) amortized per new topic.
pub const IDLE_TOPIC_SWEEP_MIN: usize = 4096;

/// Idle topics that a subscription matches keep their state (their offsets go on one by one)
/// while a sweep would leave at most this many topics; beyond it they are freed too, so that a
/// wildcard subscriber (`#`) does not make publishing to ever new names grow memory without
/// bound. A freed topic published to again resumes above every offset it used (see
/// [`Broker::sweep_idle_topics`]).
pub const MATCHED_TOPICS_KEPT: usize = 16_384;

/// The dead-letter topic of `topic`: `__dlq__<topic>`, cut at a character boundary to 255 bytes.
pub fn dlq_topic(topic: &TopicName) -> TopicName {
    let room = aqueduct_proto::topic::MAX_NAME_LEN - DLQ_PREFIX.len();
    let name = topic.as_str();
    let mut cut = name.len().min(room);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut s = String::with_capacity(DLQ_PREFIX.len() + cut);
    s.push_str(DLQ_PREFIX);
    s.push_str(&name[..cut]);
    // A valid name with a valid prefix and at most 255 bytes is valid.
    TopicName::try_from(s.as_str()).unwrap_or_else(|_| topic.clone())
}

impl Broker {
    pub fn new(config: BrokerConfig) -> Broker {
        Broker {
            config,
            sweep_at: AtomicUsize::new(IDLE_TOPIC_SWEEP_MIN),
            ..Broker::default()
        }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// Be told of routed subscriptions made and removed (once; later calls are ignored and
    /// return false). Subscriptions made before are not reported: set it before serving.
    pub fn set_interest_listener(&self, listener: InterestListener) -> bool {
        self.interest.0.set(listener).is_ok()
    }

    /// Be given the messages of consumer groups left without a member here (once; later calls
    /// are ignored and return false).
    pub fn set_orphan_listener(&self, listener: OrphanListener) -> bool {
        self.orphans.0.set(listener).is_ok()
    }

    /// Have dead letters published through `router` (once; later calls are ignored and return
    /// false).
    pub fn set_dead_letter_router(&self, router: DeadLetterRouter) -> bool {
        self.dead_letter_router.0.set(router).is_ok()
    }

    /// For a caller with no source to hold back (a stream or connection ending, the ack-wait
    /// timer): watch the block-policy subscriptions that work through `ctx` left full, instead
    /// of holding anything for them (see [`overdue_full`](Self::overdue_full)). A redelivery
    /// (which holds no source) has its own watched already.
    pub fn watch_full(&self, ctx: &mut PublishContext, now: Instant) {
        ctx.held_ids.clear();
        self.full.watch(ctx.held.drain(..), now);
    }

    /// The watched block-policy subscriptions (see [`watch_full`](Self::watch_full) and the
    /// module [`full_watch`](crate::full_watch)) that, for `limit`, have neither drained to half
    /// nor taken half their capacity off their queue: taken out, for the caller to close as slow
    /// consumers ([`disconnect_slow`](Self::disconnect_slow)), as a publisher held that long
    /// would. Those that drained to half or closed are forgotten. Without a limit, none are
    /// overdue. A caller that watches must call this now and then: the watch holds its
    /// subscriptions until then.
    pub fn overdue_full(&self, now: Instant, limit: Option<Duration>) -> Vec<Arc<Subscriber>> {
        self.full.overdue(now, limit)
    }

    /// How many block-policy subscriptions are watched as full (see
    /// [`watch_full`](Self::watch_full)).
    pub fn watched_full(&self) -> usize {
        self.full.len()
    }

    /// Tell the interest listener that `sub` is routed (+1) or no longer is (-1), once each way:
    /// a subscription that stops being routed before it is removed (detached, draining) is
    /// withdrawn then, and not again at its removal.
    fn tell_interest(&self, sub: &Subscriber, delta: i64) {
        if let Some(l) = self.interest.0.get() {
            if !sub.is_unrouted() && sub.set_advertised(delta > 0) {
                l(interest_key(sub), delta);
            }
        }
    }

    /// Set where new topics' first offsets come from; once, before publishing starts. Returns
    /// false (and changes nothing) if one was set already.
    ///
    /// A topic is evicted only when nothing else holds its state (see
    /// [`sweep_idle_topics`](Self::sweep_idle_topics)), so a caller that keeps the
    /// `Arc<TopicState>` of every message it has not yet recorded (the durable log's queue does)
    /// can answer with its recorded offsets and never hand out an offset twice.
    pub fn set_offset_source(&self, source: OffsetSource) -> bool {
        self.offset_source.0.set(source).is_ok()
    }

    fn read_routes(&self) -> RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_routes(&self) -> RwLockWriteGuard<'_, Routes> {
        self.routes.write().unwrap_or_else(PoisonError::into_inner)
    }

    // ----- subscriptions -----

    /// Create a subscription. Group subscriptions (`:group:`, or `:durable:` alone, which forms a
    /// group named after the consumer) join the group with the same id and filter.
    pub fn subscribe(&self, spec: &SubscribeSpec, opts: SubscribeOptions) -> Arc<Subscriber> {
        // Its names are kept as long as the subscription (and its group) lives: copied, so as
        // not to pin the read buffer the SUBSCRIBE came in (64 KiB or more for a 20-byte
        // frame, once per subscription).
        let spec = &spec.detached();
        let id = SubscriberId(self.next_id.fetch_add(1, Relaxed));
        let group_id: Option<GroupId> = spec.group.clone().or_else(|| {
            spec.durable
                .as_ref()
                .and_then(|d| GroupId::from_bytes(d.consumer.to_bytes()).ok())
        });
        let mut routes = self.write_routes();
        let group = group_id.map(|gid| {
            let existing = routes
                .index
                .entries(&spec.filter)
                .iter()
                .find_map(|r| match r {
                    Route::Group(g) if g.shared.id() == &gid => Some(g.shared.clone()),
                    _ => None,
                });
            existing.unwrap_or_else(|| {
                let durable = spec.durable.clone();
                let shared = Arc::new(GroupShared::new(gid, spec.filter.clone(), durable));
                routes
                    .index
                    .insert(&spec.filter, Route::Group(GroupEntry::new(&shared)));
                shared
            })
        });
        let policy = opts.overflow.unwrap_or(self.config.backpressure_policy);
        let sub = self.new_subscriber(id, spec, opts, group.clone(), policy, false);
        match &group {
            Some(shared) => {
                let entries = routes.index.entries_mut(&spec.filter);
                if let Some(Route::Group(g)) = entries.and_then(|list| {
                    list.iter_mut()
                        .find(|r| matches!(r, Route::Group(g) if Arc::ptr_eq(&g.shared, shared)))
                }) {
                    g.members.push(sub.clone());
                }
            }
            None => routes.index.insert(&spec.filter, Route::Plain(sub.clone())),
        }
        routes.subscribers.insert(id, sub.clone());
        self.tell_interest(&sub, 1);
        sub
    }

    fn new_subscriber(
        &self,
        id: SubscriberId,
        spec: &SubscribeSpec,
        opts: SubscribeOptions,
        group: Option<Arc<GroupShared>>,
        policy: OverflowPolicy,
        unrouted: bool,
    ) -> Arc<Subscriber> {
        Arc::new(Subscriber::new(SubscriberInit {
            id,
            stream_id: opts.stream_id,
            filter: spec.filter.clone(),
            group,
            ack_mode: opts.ack_mode,
            policy,
            capacity: self.config.queue_size,
            waker: opts.waker,
            seed_form: opts.seed_form,
            max_in_flight: opts.max_in_flight.map(|n| n.max(1)),
            unrouted,
            closes: opts.closes,
        }))
    }

    /// Create a subscription that routing never feeds: a durable consumer's, fed from the durable
    /// log with [`feed`](Self::feed). Settlement, redelivery, dead letters and removal work as
    /// for any subscription. Its queue holds publishers (the feeder) when full, whatever the
    /// broker's policy: nothing is dropped, the feeder waits on [`Subscriber::poll_room`].
    pub fn subscribe_unrouted(
        &self,
        spec: &SubscribeSpec,
        opts: SubscribeOptions,
    ) -> Arc<Subscriber> {
        // Kept as long as the subscription lives: copied (see `subscribe`).
        let spec = &spec.detached();
        let id = SubscriberId(self.next_id.fetch_add(1, Relaxed));
        let mut routes = self.write_routes();
        // With `:group:`, a durable group: members join the unrouted group of that id and filter.
        let group = spec.group.as_ref().map(|gid| {
            let existing = routes
                .unrouted_groups
                .iter()
                .find(|g| g.shared.id() == gid && g.shared.filter() == &spec.filter)
                .map(|g| g.shared.clone());
            existing.unwrap_or_else(|| {
                let shared = Arc::new(GroupShared::new_unrouted(
                    gid.clone(),
                    spec.filter.clone(),
                    spec.durable.clone(),
                ));
                routes.unrouted_groups.push(GroupEntry::new(&shared));
                shared
            })
        });
        let sub = self.new_subscriber(id, spec, opts, group.clone(), OverflowPolicy::Block, true);
        if let Some(shared) = &group {
            if let Some(g) = routes
                .unrouted_groups
                .iter_mut()
                .find(|g| Arc::ptr_eq(&g.shared, shared))
            {
                g.members.push(sub.clone());
            }
        }
        routes.subscribers.insert(id, sub.clone());
        // Messages the group parked while it had no member: this one takes them (taken under
        // the routes lock, so none is parked in between and left behind).
        let _moving = group.as_ref().map(|g| g.moves().begin());
        let parked = group.as_ref().map(|g| g.take_parked()).unwrap_or_default();
        drop(routes);
        {
            if !parked.is_empty() {
                let mut ctx = PublishContext::default();
                self.deliver(&mut ctx, &sub, parked.into_iter(), Instant::now());
            }
        }
        sub
    }

    /// Forget an unrouted group (its owner has stored its position and it has no member): what
    /// it parked is dropped with it.
    pub fn forget_unrouted_group(&self, shared: &Arc<GroupShared>) {
        self.write_routes()
            .unrouted_groups
            .retain(|g| !Arc::ptr_eq(&g.shared, shared));
        shared.take_parked();
    }

    /// The member of an unrouted (durable) group that should take the next message: the next in
    /// round-robin order that has room, else any live one; `None` when the group has no member.
    pub fn group_member(&self, shared: &Arc<GroupShared>) -> Option<Arc<Subscriber>> {
        let routes = self.read_routes();
        routes
            .group(shared)
            .and_then(|g| g.pick(None, self.config.max_in_flight))
            .cloned()
    }

    /// For a feeder that keeps members' queues short: the next member, round-robin, with room
    /// under `max_in_flight` and fewer than `queued_below` queued — or `Err` with every member
    /// (to wait for room in any of them; empty when the group has no member).
    pub fn group_member_with_room(
        &self,
        shared: &Arc<GroupShared>,
        queued_below: usize,
    ) -> Result<Arc<Subscriber>, Vec<Arc<Subscriber>>> {
        let routes = self.read_routes();
        let Some(g) = routes.group(shared) else {
            return Err(Vec::new());
        };
        let max = self.config.max_in_flight;
        g.turn
            .pick(&g.members, |m| {
                m.has_room(max) && m.queued_approx() < queued_below
            })
            .cloned()
            .ok_or_else(|| g.members.clone())
    }

    /// Queue one message that already has its offset (read back from the durable log) for `sub`.
    /// `age` is how long ago it was published: its lifetime (priority TTL or its own TTL) counts
    /// from then, so a message that has outlived it is counted as expired, not queued. Returns
    /// false if `sub` is closed; a full queue takes it anyway (block policy) and the caller then
    /// waits on [`Subscriber::poll_room`] before feeding more.
    #[allow(clippy::too_many_arguments)]
    pub fn feed(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        topic: &TopicName,
        offset: u64,
        p: &Publication<'_>,
        age: Duration,
        now: Instant,
    ) -> bool {
        let state = self.topic_state(ctx, topic.borrowed());
        let lifetime = self.config.lifetime(p.priority, p.ttl);
        if lifetime.is_some_and(|l| l <= age) {
            state.stats().expired(p.priority);
            return !sub.is_closed();
        }
        let mut d = self.delivery(&mut ctx.arena, &state, offset, p, now);
        d.expires_at = lifetime.map(|l| now + (l - age));
        let mut refused = std::mem::take(&mut ctx.refused);
        let outcome = sub.enqueue_many(std::iter::once(d), &mut refused, now);
        refused.clear();
        ctx.refused = refused;
        !matches!(outcome, Enqueued::Refused(_))
    }

    /// Remove a subscription. A group member's queued and unsettled messages go to the remaining
    /// members (unsettled ones as a new attempt); a plain subscription's are dropped and counted.
    pub fn unsubscribe(&self, ctx: &mut PublishContext, sub: &Arc<Subscriber>, now: Instant) {
        self.remove_subscriber(ctx, sub, CloseReason::Unsubscribed, &mut Vec::new(), now);
    }

    /// Stop routing to a subscription whose client stopped reading its deliveries (STOP_SENDING)
    /// but may still settle what it received: new messages go elsewhere, its queued ones go to
    /// the other members of its group (a plain subscription's are dropped and counted), and its
    /// in-flight deliveries stay to be settled — by ACK/NACK, the ack-wait timer, or
    /// [`unsubscribe`](Self::unsubscribe) when its stream ends.
    ///
    /// A group left without members keeps its entry (and its state: the committed offset), so a
    /// member that joins meanwhile joins the same group and gets the detached member's
    /// redeliveries; a group with no members takes no messages.
    pub fn detach(&self, ctx: &mut PublishContext, sub: &Arc<Subscriber>, now: Instant) {
        {
            let mut routes = self.write_routes();
            self.tell_interest(sub, -1);
            routes.unroute(sub, true);
        }
        let _moving = sub.group().map(|g| g.moves().begin());
        for d in sub.detach() {
            match sub.group() {
                Some(g) => self.hand_to_group(ctx, g, d, Some(sub.id()), now),
                None => count_lost(&d, DropReason::Unsubscribed, now),
            }
        }
    }

    /// Route nothing more to `sub`, leaving what is queued for it to be drained (a plain
    /// subscription whose client finished its stream: the broker sends what was queued, then
    /// ends it with [`unsubscribe`](Self::unsubscribe)). A group member stays with its group
    /// as a detached one until it is removed, so that what it still holds (handed back as it
    /// ends, e.g. by a revocation) finds the group.
    pub fn stop_routing(&self, sub: &Subscriber) {
        let mut routes = self.write_routes();
        self.tell_interest(sub, -1);
        routes.unroute(sub, sub.group().is_some());
    }

    /// Close a subscription whose client lost the permission to subscribe: as
    /// [`unsubscribe`](Self::unsubscribe), with the reason [`CloseReason::Revoked`]. Returns
    /// whether it was still open.
    pub fn revoke(&self, ctx: &mut PublishContext, sub: &Arc<Subscriber>, now: Instant) -> bool {
        self.remove_subscriber(ctx, sub, CloseReason::Revoked, &mut Vec::new(), now)
    }

    /// Close a subscription as a slow consumer, as the disconnect policy does on overflow: for a
    /// `block` subscription that has stayed full too long (holding its publishers, or see
    /// [`overdue_full`](Self::overdue_full)). Its queued messages are
    /// dropped and counted under `disconnect` (a group member's go to the other members).
    /// An unrouted (durable) subscription is never closed this way: its queue's producer waits
    /// for room, and closing it would lose its place in the log. Returns whether it was closed.
    pub fn disconnect_slow(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        now: Instant,
    ) -> bool {
        if sub.is_unrouted() {
            return false;
        }
        let closed =
            self.remove_subscriber(ctx, sub, CloseReason::SlowConsumer, &mut Vec::new(), now);
        if closed {
            self.slow_consumers.fetch_add(1, Relaxed);
        }
        closed
    }

    /// Returns false if `sub` was already removed. `overflowed` (what its queue refused) is
    /// handed on or counted either way: a publisher whose deliveries overflowed a subscription
    /// that another publisher, an UNSUBSCRIBE or its stream's end is removing at the same time
    /// still accounts for them.
    fn remove_subscriber(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        reason: CloseReason,
        overflowed: &mut Vec<Delivery>,
        now: Instant,
    ) -> bool {
        let drop_reason = match reason {
            CloseReason::SlowConsumer => DropReason::Policy(OverflowPolicy::Disconnect),
            CloseReason::Unsubscribed | CloseReason::Revoked => DropReason::Unsubscribed,
        };
        let removed = {
            let mut routes = self.write_routes();
            let removed = routes.subscribers.remove(&sub.id()).is_some();
            if removed {
                self.tell_interest(sub, -1);
                routes.unroute(sub, false);
            }
            removed
        };
        if !removed {
            // Already removed (its remover handled the queue and the in-flight deliveries).
            for d in overflowed.drain(..) {
                match sub.group() {
                    Some(shared) => self.hand_to_group(ctx, shared, d, Some(sub.id()), now),
                    None => count_lost(&d, drop_reason, now),
                }
            }
            return false;
        }
        // A member's messages go to the others: a move from before they leave it.
        let _moving = sub.group().map(|g| g.moves().begin());
        let (queued, in_flight) = sub.close(reason);
        match sub.group() {
            Some(shared) => {
                for d in queued.into_iter().chain(overflowed.drain(..)) {
                    self.hand_to_group(ctx, shared, d, Some(sub.id()), now);
                }
                for d in in_flight {
                    self.retry(ctx, sub, d, "consumer left the group", now);
                }
            }
            None => {
                for d in queued
                    .iter()
                    .chain(&in_flight)
                    .chain(overflowed.drain(..).as_slice())
                {
                    count_lost(d, drop_reason, now);
                }
            }
        }
        true
    }

    /// Every live subscription.
    pub fn subscribers(&self) -> Vec<Arc<Subscriber>> {
        self.read_routes().subscribers.values().cloned().collect()
    }

    /// Publish → delivery latency of every delivery written so far.
    pub fn latency(&self) -> LatencySnapshot {
        self.latency.snapshot()
    }

    /// Subscriptions closed so far by the disconnect policy.
    pub fn slow_consumers_disconnected(&self) -> u64 {
        self.slow_consumers.load(Relaxed)
    }

    /// Every consumer group routed here: with at least one member, live or detached (one
    /// whose client stopped reading, still owing the group its unsettled deliveries).
    pub fn groups(&self) -> Vec<Arc<GroupShared>> {
        let mut groups = Vec::new();
        self.read_routes().index.for_each(|r| {
            if let Route::Group(g) = r {
                groups.push(g.shared.clone());
            }
        });
        groups
    }

    /// Is consumer group `group` with filter `filter` routed here now (it has a member that is
    /// not detached)? A group kept only for its detached members takes no messages: it is
    /// not routed here.
    pub fn has_group(&self, filter: &aqueduct_proto::TopicFilter, group: &GroupId) -> bool {
        self.read_routes().index.entries(filter).iter().any(
            |r| matches!(r, Route::Group(g) if g.shared.id() == group && !g.members.is_empty()),
        )
    }

    /// Number of live subscriptions.
    pub fn subscriber_count(&self) -> usize {
        self.read_routes().subscribers.len()
    }

    // ----- publishing -----

    fn topic_state(&self, ctx: &mut PublishContext, name: TopicRef<'_>) -> Arc<TopicState> {
        if let Some(t) = &ctx.last_topic {
            if t.name().as_bytes() == name.as_bytes() {
                return t.clone();
            }
        }
        let found = self
            .topics
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name.as_bytes())
            .cloned();
        let state = match found {
            Some(state) => state,
            None => {
                let (state, held) = {
                    let mut topics = self.topics.write().unwrap_or_else(PoisonError::into_inner);
                    let owned = name.to_name();
                    let state = topics
                        .entry(owned.clone())
                        .or_insert_with(|| {
                            let next = match self.offset_source.0.get() {
                                Some(source) => source(&owned),
                                None => self.offset_floor.load(Relaxed),
                            };
                            Arc::new(TopicState::new(&owned, next))
                        })
                        .clone();
                    (state, topics.len())
                };
                if held >= self.sweep_at.load(Relaxed).max(IDLE_TOPIC_SWEEP_MIN) {
                    self.sweep_idle_topics();
                }
                state
            }
        };
        ctx.last_topic = Some(state.clone());
        state
    }

    /// Free the state of idle topics: nothing queued or in flight refers to them (no other
    /// reference to their state) and no subscription matches them — or, once keeping the matched
    /// ones would leave more than [`MATCHED_TOPICS_KEPT`] topics, matched ones too. A topic
    /// published to again starts where the offset source says (see
    /// [`set_offset_source`](Self::set_offset_source)); without one, at the highest next offset
    /// of any topic freed so far, so that its offsets only grow (with gaps) and an offset never
    /// names two messages of one topic while the broker runs. Their counters are kept in
    /// [`Broker::evicted_topic_stats`]. Runs by itself once the number of topics reaches twice
    /// what the previous sweep left (at least [`IDLE_TOPIC_SWEEP_MIN`]), so that publishing to
    /// ever new topic names cannot grow memory without bound. Returns how many topics were
    /// evicted.
    pub fn sweep_idle_topics(&self) -> usize {
        if self
            .sweeping
            .swap(true, std::sync::atomic::Ordering::Acquire)
        {
            return 0;
        }
        // Three short phases, never two locks at once: candidates (topics read lock), minus the
        // topics a subscription matches (routes read lock), removed if still idle (write lock).
        let (mut idle, held): (Vec<TopicName>, usize) = {
            let topics = self.topics.read().unwrap_or_else(PoisonError::into_inner);
            let idle = topics
                .iter()
                .filter(|(_, t)| Arc::strong_count(t) == 1)
                .map(|(n, _)| n.clone())
                .collect();
            (idle, topics.len())
        };
        {
            let routes = self.read_routes();
            let (unmatched, matched): (Vec<TopicName>, Vec<TopicName>) =
                idle.into_iter().partition(|n| !routes.index.has_match(n));
            idle = unmatched;
            if held - idle.len() > MATCHED_TOPICS_KEPT {
                idle.extend(matched);
            }
        }
        let mut evicted = TopicStatsSnapshot::default();
        let (removed, left) = {
            let mut topics = self.topics.write().unwrap_or_else(PoisonError::into_inner);
            let mut removed = Vec::new();
            for name in idle {
                if let Some(t) = topics.get(name.as_bytes()) {
                    if Arc::strong_count(t) == 1 {
                        evicted.add(&t.stats().snapshot());
                        self.offset_floor.fetch_max(t.next_offset(), Relaxed);
                        topics.remove(name.as_bytes());
                        removed.push(name);
                    }
                }
            }
            if !removed.is_empty() {
                topics.shrink_to_fit();
            }
            // Counted as evicted before the topics lock is released: a reader of both (see
            // `topics_and_evicted_stats`) sees each topic either live or in here, never in
            // neither or both.
            self.evicted_stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .add(&evicted);
            (removed, topics.len())
        };
        // The groups' watermarks of those topics go too (each group's lock on its own), the
        // durable (unrouted) groups' as well: their hand-overs and redeliveries note them.
        if !removed.is_empty() {
            let unrouted: Vec<Arc<GroupShared>> = self
                .read_routes()
                .unrouted_groups
                .iter()
                .map(|g| g.shared.clone())
                .collect();
            for g in self.groups().into_iter().chain(unrouted) {
                g.forget_settled(&removed);
            }
        }
        let removed = removed.len();
        self.topics_evicted.fetch_add(removed as u64, Relaxed);
        self.sweep_at
            .store((left * 2).max(IDLE_TOPIC_SWEEP_MIN), Relaxed);
        self.sweeping
            .store(false, std::sync::atomic::Ordering::Release);
        removed
    }

    /// Idle topics evicted so far.
    pub fn topics_evicted(&self) -> u64 {
        self.topics_evicted.load(Relaxed)
    }

    /// The counters of every evicted topic, added up.
    pub fn evicted_topic_stats(&self) -> TopicStatsSnapshot {
        self.evicted_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Number of topics the broker holds state for.
    pub fn topic_count(&self) -> usize {
        self.topics
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The state of a topic that has been published to.
    pub fn topic(&self, name: &TopicName) -> Option<Arc<TopicState>> {
        self.topics
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name.as_bytes())
            .cloned()
    }

    /// Every topic's name, [`life`](TopicState::life) and counters, and
    /// [`evicted_topic_stats`](Self::evicted_topic_stats), read at one instant as far as
    /// evictions go: each topic is either in the list or in the counts. Read under the topics'
    /// lock and copied out, so that no topic's state is held after it: a sweep meanwhile (the
    /// broker's own, or a durable log's retention pass) sees idle topics as idle. (Handing out
    /// the states themselves, as for a metrics scrape, made every topic look in use while the
    /// caller worked through them, and such a sweep freed none.)
    pub fn topic_snapshots_and_evicted_stats(&self) -> (Vec<TopicSnapshot>, TopicStatsSnapshot) {
        let topics = self.topics.read().unwrap_or_else(PoisonError::into_inner);
        let evicted = self
            .evicted_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let snapshots = topics
            .values()
            .map(|t| (t.name().clone(), t.life(), t.stats().snapshot()))
            .collect();
        (snapshots, evicted)
    }

    /// Run `f` while no topic's state can be created or evicted, giving it a test of whether
    /// the broker holds a topic's state now. For a durable log deciding which topics it may
    /// forget: a topic the broker does not hold gets its next offset from the offset source
    /// ([`set_offset_source`](Self::set_offset_source)) when it is created, which cannot happen
    /// before `f` returns. Keep `f` short (publishes to new topics wait).
    pub fn with_topics_frozen<R>(&self, f: impl FnOnce(&dyn Fn(&[u8]) -> bool) -> R) -> R {
        let topics = self.topics.read().unwrap_or_else(PoisonError::into_inner);
        f(&|name: &[u8]| topics.contains_key(name))
    }

    /// Every topic the broker holds state for (published to, and not evicted since).
    pub fn topics(&self) -> Vec<Arc<TopicState>> {
        self.topics
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Publish one message: assign its offset, encode it once, and hand it to every matching
    /// plain subscription and to one member of every matching group.
    pub fn publish(
        &self,
        ctx: &mut PublishContext,
        p: &Publication<'_>,
        now: Instant,
    ) -> PublishOutcome {
        let mut offset = 0;
        let routed = self.publish_batch(ctx, std::iter::once(*p), now, |_, o| offset = o);
        PublishOutcome { offset, routed }
    }

    /// Publish a sequence of messages in order; `offset` is called with each message's topic and
    /// assigned offset.
    /// Returns how many subscriptions the messages were handed to in total.
    ///
    /// Consecutive messages to one topic form a run: the topic and its routes are looked up once
    /// per run and each subscriber's lock is taken once per run, unless a consumer group matches,
    /// in which case every message is routed on its own so the group's round-robin sees it.
    pub fn publish_batch<'a, I>(
        &self,
        ctx: &mut PublishContext,
        publications: I,
        now: Instant,
        mut offset: impl FnMut(&Arc<TopicState>, u64),
    ) -> usize
    where
        I: IntoIterator<Item = Publication<'a>>,
        I::IntoIter: Clone,
    {
        let mut targets = std::mem::take(&mut ctx.targets);
        let mut pending = std::mem::take(&mut ctx.pending);
        let mut routed = 0;
        let mut iter = publications.into_iter();
        while let Some(first) = iter.clone().next() {
            let topic = self.topic_state(ctx, first.topic);
            let mut unplaced = std::mem::take(&mut ctx.unplaced);
            unplaced.clear();
            let has_groups = self.route(&topic, &mut targets, ctx.scope.as_ref(), &mut unplaced);
            // A run: consecutive messages to one topic, found by looking ahead on a copy of the
            // iterator. With a group, route message by message so the round-robin sees each
            // one; then there is no run to look for (looking ahead for each message would walk
            // the rest of the batch each time: quadratic in the batch's length).
            let run_len = if has_groups || !unplaced.is_empty() {
                1
            } else {
                iter.clone()
                    .take_while(|p| p.topic.as_bytes() == first.topic.as_bytes())
                    .count()
            };
            let base = topic.assign_offsets(run_len as u64);
            topic.stats().published(run_len as u64);
            routed += targets.len() * run_len;
            let mut run = iter.by_ref().take(run_len).enumerate().map(|(i, p)| {
                let o = base + i as u64;
                offset(&topic, o);
                (o, p)
            });
            if !unplaced.is_empty() {
                // The cluster picked a member here of these groups, and none is left (the
                // last one went since the pick): offered to a member on another node, as a
                // leaving member's messages are; else dropped and counted.
                if let Some((o, p)) = run.next() {
                    let d = self.delivery(&mut ctx.arena, &topic, o, &p, now);
                    for g in unplaced.drain(..) {
                        if !self.hand_to_cluster(g, &d, now) {
                            topic.stats().dropped(DropReason::Unsubscribed);
                        }
                    }
                    if !targets.is_empty() {
                        pending.push(d);
                        self.flush_run(ctx, &mut targets, &mut pending, now);
                    }
                }
                targets.clear();
                ctx.unplaced = unplaced;
                continue;
            }
            ctx.unplaced = unplaced;
            match targets.len() {
                // Nobody listens: the offsets are taken, nothing is encoded.
                0 => run.for_each(drop),
                // One subscriber (the common case): encode straight into its queue under one
                // lock, without staging the run. The arena is moved out of `ctx` so that the
                // lazy iterator and `deliver` can both borrow what they need.
                1 => {
                    let mut arena = std::mem::take(&mut ctx.arena);
                    let deliveries =
                        run.map(|(o, p)| self.delivery(&mut arena, &topic, o, &p, now));
                    self.deliver(ctx, &targets[0], deliveries, now);
                    ctx.arena = arena;
                    targets.clear();
                }
                _ => {
                    for (o, p) in run {
                        let d = self.delivery(&mut ctx.arena, &topic, o, &p, now);
                        pending.push(d);
                    }
                    self.flush_run(ctx, &mut targets, &mut pending, now);
                }
            }
        }
        ctx.targets = targets;
        ctx.pending = pending;
        routed
    }

    /// Encode one message (once, for all its subscribers).
    fn delivery(
        &self,
        arena: &mut Arena,
        topic: &Arc<TopicState>,
        offset: u64,
        p: &Publication<'_>,
        now: Instant,
    ) -> Delivery {
        let shared = SharedDelivery::encode(
            arena,
            &DeliveryFields {
                topic: topic.name(),
                offset,
                priority: p.priority,
                trace: p.trace,
                compression: p.compression,
                dead_letter: p.dead_letter.copied(),
                body: p.body,
            },
        )
        .with_remote_trace(p.remote_trace);
        Delivery {
            topic: topic.clone(),
            shared,
            offset,
            priority: p.priority,
            attempt: p.attempts.saturating_add(1),
            expires_at: self.config.lifetime(p.priority, p.ttl).map(|ttl| now + ttl),
            published_at: now,
        }
    }

    /// Collect the subscriptions that get a message on `topic` into `targets`: every matching
    /// plain subscription and one member of each matching group. Returns true if a group matched.
    ///
    /// A scope that names the groups to route to (the cluster picked a member here for each)
    /// may name one with no member here any more (its last one left since the pick): those go
    /// to `unplaced`, for the caller to offer elsewhere.
    fn route(
        &self,
        topic: &TopicState,
        targets: &mut Vec<Arc<Subscriber>>,
        scope: Option<&Scope>,
        unplaced: &mut Vec<crate::mesh::GroupKey>,
    ) -> bool {
        let mut has_groups = false;
        let routes = self.read_routes();
        routes
            .index
            .for_each_match(topic.name(), |route| match route {
                Route::Plain(_) if scope.is_some_and(|s| !s.plain) => {}
                Route::Plain(s) => targets.push(s.clone()),
                Route::Group(g) if scope.is_some_and(|s| !s.allows_group(&g.shared)) => {}
                Route::Group(g) => {
                    has_groups = true;
                    if let Some(m) = g.pick(None, self.config.max_in_flight) {
                        targets.push(m.clone());
                    }
                }
            });
        if let Some(s) = scope.filter(|s| !s.except) {
            let placed = |k: &crate::mesh::GroupKey| {
                targets.iter().any(|t| {
                    t.group()
                        .is_some_and(|g| *g.id() == k.group && *g.filter() == k.filter)
                })
            };
            unplaced.extend(s.groups.iter().filter(|k| !placed(k)).cloned());
        }
        has_groups
    }

    /// Hand the run's messages to its targets (the last target takes them without cloning).
    fn flush_run(
        &self,
        ctx: &mut PublishContext,
        targets: &mut Vec<Arc<Subscriber>>,
        pending: &mut Vec<Delivery>,
        now: Instant,
    ) {
        let last = targets.len().saturating_sub(1);
        for (i, sub) in targets.iter().enumerate() {
            if i == last {
                self.deliver(ctx, sub, pending.drain(..), now);
            } else {
                self.deliver(ctx, sub, pending.iter().cloned(), now);
            }
        }
        pending.clear();
        targets.clear();
    }

    /// Queue deliveries for `sub`, applying its overflow policy.
    fn deliver(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        items: impl Iterator<Item = Delivery>,
        now: Instant,
    ) {
        let mut refused = std::mem::take(&mut ctx.refused);
        let outcome = match sub.group() {
            Some(g) => {
                let noted = items.inspect(|d| g.note_delivered(d.topic.name(), d.offset));
                sub.enqueue_many(noted, &mut refused, now)
            }
            None => sub.enqueue_many(items, &mut refused, now),
        };
        match outcome {
            Enqueued::Queued => {}
            Enqueued::Full => {
                if ctx.held_ids.insert(sub.id()) {
                    ctx.held.push(sub.clone());
                }
            }
            Enqueued::Refused(Refused::Overflow) => {
                if self.remove_subscriber(ctx, sub, CloseReason::SlowConsumer, &mut refused, now) {
                    self.slow_consumers.fetch_add(1, Relaxed);
                }
            }
            // Closed between routing and enqueueing: a group gives them to another member;
            // a plain subscription's are counted under why it closed (a slow consumer's under
            // `disconnect`, as its queue's are).
            Enqueued::Refused(Refused::Closed) => {
                let why = match sub.close_reason() {
                    Some(CloseReason::SlowConsumer) => {
                        DropReason::Policy(OverflowPolicy::Disconnect)
                    }
                    _ => DropReason::Unsubscribed,
                };
                for d in refused.drain(..) {
                    match sub.group() {
                        Some(g) => self.hand_to_group(ctx, g, d, Some(sub.id()), now),
                        None => count_lost(&d, why, now),
                    }
                }
            }
        }
        refused.clear();
        ctx.refused = refused;
    }

    /// Give `d` to a member of the group other than `exclude` (or `exclude` itself if it is the
    /// only live member); dropped and counted if the group has no live member.
    ///
    /// Handing a message to a full member under `disconnect` closes that member, whose
    /// messages are handed on in turn, and so on through every full member: that cascade runs
    /// in this loop, not by recursion, so a group of thousands of stalled members cannot
    /// overflow the stack. Every hand-off is made before the outermost call returns.
    fn hand_to_group(
        &self,
        ctx: &mut PublishContext,
        shared: &Arc<GroupShared>,
        d: Delivery,
        exclude: Option<SubscriberId>,
        now: Instant,
    ) {
        // Each hand-off is a move of the group's until it is made (the caller's own move may
        // end before an outer call's loop makes it).
        shared.moves().begin_detached();
        ctx.handoffs.push_back((shared.clone(), d, exclude));
        if ctx.handing_off {
            return;
        }
        ctx.handing_off = true;
        while let Some((shared, d, exclude)) = ctx.handoffs.pop_front() {
            self.hand_one_to_group(ctx, &shared, d, exclude, now);
            shared.moves().end();
        }
        ctx.handing_off = false;
    }

    fn hand_one_to_group(
        &self,
        ctx: &mut PublishContext,
        shared: &Arc<GroupShared>,
        d: Delivery,
        exclude: Option<SubscriberId>,
        now: Instant,
    ) {
        let (member, d) = {
            let routes = self.read_routes();
            let member = routes
                .group(shared)
                .and_then(|g| g.pick(exclude, self.config.max_in_flight))
                .cloned();
            if member.is_none() && shared.is_unrouted() {
                // A durable group's messages wait for its next member (they are in its
                // position). Parked under the routes lock a joining member takes for writing,
                // so it either sees this message parked or is the member found here.
                shared.park(d);
                return;
            }
            (member, d)
        };
        match member {
            Some(m) => self.deliver(ctx, &m, std::iter::once(d), now),
            None => {
                shared.note_settled(d.topic.name(), d.offset);
                let key = crate::mesh::GroupKey {
                    filter: shared.filter().clone(),
                    group: shared.id().clone(),
                };
                if !self.hand_to_cluster(key, &d, now) {
                    count_lost(&d, DropReason::Unsubscribed, now);
                }
            }
        }
    }

    /// Offer the orphan listener (the cluster) a message of `group` no member here can take.
    fn hand_to_cluster(&self, group: crate::mesh::GroupKey, d: &Delivery, now: Instant) -> bool {
        let Some(listener) = self.orphans.0.get() else {
            return false;
        };
        let ttl = match d.expires_at {
            Some(at) if at <= now => {
                d.topic.stats().expired(d.priority);
                return true;
            }
            Some(at) => Some(at - now),
            None => None,
        };
        // Our own encoding: it parses; without it the copy only loses trace and compression.
        let ext = d.shared.extensions().unwrap_or_default();
        listener(Orphan {
            group,
            topic: d.topic.name().clone(),
            body: d.shared.body(),
            priority: d.priority,
            ttl,
            trace: ext.trace,
            compression: ext.compression,
            attempts: d.attempt,
        })
    }

    // ----- delivery -----

    /// Write `sub`'s next deliveries to `out`, highest priority first, up to about `max_bytes`
    /// (at least one frame when one is ready). Expired messages are dropped and counted;
    /// deliveries that need settling are recorded in flight with the ack-wait deadline.
    pub fn drain<B: BufMut>(
        &self,
        sub: &Subscriber,
        out: &mut B,
        max_bytes: usize,
        now: Instant,
    ) -> Drained {
        // A no-op observer: compiled away, so draining costs what it did before tracing.
        self.drain_observed(sub, out, max_bytes, now, |_| {})
    }

    /// [`drain`](Self::drain), calling `written` with each delivery as its frame is written
    /// (for tracing).
    pub fn drain_observed<B: BufMut>(
        &self,
        sub: &Subscriber,
        out: &mut B,
        max_bytes: usize,
        now: Instant,
        written: impl FnMut(&Delivery),
    ) -> Drained {
        sub.drain(
            out,
            max_bytes,
            now,
            (self.config.ack_wait, self.config.max_in_flight),
            &self.latency,
            written,
        )
    }

    // ----- settlement -----

    /// Settle a delivery. `topic` may be omitted for a subscription without wildcards;
    /// `attempt`, when given, must be the current attempt.
    pub fn ack(
        &self,
        sub: &Subscriber,
        topic: Option<&TopicName>,
        offset: u64,
        attempt: Option<u32>,
    ) -> Result<(), SettleError> {
        let d = sub.settle(topic, offset, attempt)?;
        if let Some(g) = sub.group() {
            g.note_settled(d.topic.name(), d.offset);
        }
        Ok(())
    }

    /// Reject a delivery: it is redelivered with the next attempt number (to another group member
    /// when there is one), or dead-lettered once `max_retries` redeliveries are used up.
    #[allow(clippy::too_many_arguments)]
    pub fn nack(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        topic: Option<&TopicName>,
        offset: u64,
        attempt: Option<u32>,
        reason: Option<&str>,
        now: Instant,
    ) -> Result<(), SettleError> {
        // From before the delivery leaves the in-flight set until it is queued again.
        let _moving = sub.moves().begin();
        let d = sub.settle(topic, offset, attempt)?;
        d.topic.stats().nacked();
        self.retry(ctx, sub, d, reason.unwrap_or("nacked"), now);
        Ok(())
    }

    /// Redeliver every delivery of `sub` whose ack-wait deadline has passed. Returns how many.
    pub fn expire_in_flight(
        &self,
        ctx: &mut PublishContext,
        sub: &Arc<Subscriber>,
        now: Instant,
    ) -> usize {
        let (overdue, _moving) = sub.take_overdue(now);
        let n = overdue.len();
        for d in overdue {
            self.retry(ctx, sub, d, "ack timeout", now);
        }
        n
    }

    /// [`expire_in_flight`](Self::expire_in_flight) for every subscription.
    pub fn tick(&self, ctx: &mut PublishContext, now: Instant) -> usize {
        self.subscribers()
            .iter()
            .map(|s| self.expire_in_flight(ctx, s, now))
            .sum()
    }

    fn retry(
        &self,
        ctx: &mut PublishContext,
        from: &Arc<Subscriber>,
        mut d: Delivery,
        reason: &str,
        now: Instant,
    ) {
        // Past its lifetime: dropped and counted as expired, as it would be in a queue — not
        // tried again, not dead-lettered (a dead letter has no TTL, so its body would reach the
        // dead-letter topic's readers after the lifetime its publisher gave it).
        if d.expires_at.is_some_and(|at| at <= now) {
            d.topic.stats().expired(d.priority);
            if let Some(g) = from.group() {
                g.note_settled(d.topic.name(), d.offset);
            }
            return;
        }
        if d.attempt > self.config.max_retries {
            self.dead_letter(ctx, from, d, reason, now);
            return;
        }
        d.attempt += 1;
        d.topic.stats().redelivered();
        // A redelivery moves a message from in flight back to a queue: it adds nothing to hold
        // a source back for. Holding the stream that NACKed (under block, into a full queue)
        // kept the ACKs that come on it unread, so the queue could never drain. The targets it
        // filled are watched instead (see `watch_full`).
        let held_before = ctx.held.len();
        match from.group() {
            Some(g) => self.hand_to_group(ctx, g, d, Some(from.id()), now),
            None if !from.is_closed() => self.deliver(ctx, from, std::iter::once(d), now),
            None => d.topic.stats().dropped(DropReason::Unsubscribed),
        }
        // Only the redelivery's own targets are let go of: a dead letter it caused (a
        // `disconnect` member it overflowed, whose last attempts are dead-lettered) into a full
        // `block` queue holds the source as any dead letter does (§7.3).
        let target = |held: &Arc<Subscriber>| match from.group() {
            Some(g) => held.group().is_some_and(|hg| Arc::ptr_eq(hg, g)),
            None => held.id() == from.id(),
        };
        if ctx.held.len() > held_before {
            let (watched, held): (Vec<_>, Vec<_>) =
                ctx.held.drain(held_before..).partition(|h| target(h));
            ctx.held.extend(held);
            for w in &watched {
                ctx.held_ids.remove(&w.id());
            }
            self.full.watch(watched, now);
        }
    }

    fn dead_letter(
        &self,
        ctx: &mut PublishContext,
        from: &Subscriber,
        d: Delivery,
        reason: &str,
        now: Instant,
    ) {
        if let Some(g) = from.group() {
            g.note_settled(d.topic.name(), d.offset);
        }
        if d.topic.name().as_str().starts_with(DLQ_PREFIX) {
            d.topic.stats().dropped(DropReason::RetriesExhausted);
            return;
        }
        d.topic.stats().dead_lettered();
        // Our own encoding: parsing cannot fail; without it the dead letter only loses trace/compression.
        let ext = d.shared.extensions().unwrap_or_default();
        let dlq = dlq_topic(d.topic.name());
        let body = d.shared.body();
        let info = DeadLetter {
            original_topic: d.topic.name(),
            original_offset: d.offset,
            attempts_made: d.attempt,
            reason,
        };
        let publication = Publication {
            topic: dlq.borrowed(),
            body: &body,
            priority: d.priority,
            ttl: None,
            trace: ext.trace.as_ref(),
            compression: ext.compression.as_ref(),
            dead_letter: Some(&info),
            attempts: 0,
            remote_trace: d.shared.trace_is_remote(),
        };
        let mut logged = None;
        let record = ctx.record_dead_letters;
        {
            let mut publish_here = |ctx: &mut PublishContext| {
                self.publish_batch(ctx, std::iter::once(publication), now, |topic, offset| {
                    if record {
                        logged = Some((topic.clone(), offset));
                    }
                });
            };
            // A dead letter is a message of its own: not bound by the scope of the publish that
            // caused it (a cluster copy for one group), which is restored after.
            let outer = ctx.scope.take();
            match self.dead_letter_router.0.get() {
                Some(router) => router(ctx, &publication, &mut publish_here),
                None => publish_here(ctx),
            }
            ctx.scope = outer;
        }
        if let Some((topic, offset)) = logged {
            ctx.dead_letters.push(DeadLetterRecord {
                topic,
                offset,
                priority: d.priority,
                body: body.clone(),
                trace: ext.trace,
                compression: ext.compression,
                original_topic: d.topic.name().clone(),
                original_offset: d.offset,
                attempts_made: d.attempt,
                reason: reason.to_string(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subscription (plain, in a group, a durable one unrouted) does not keep the buffer its
    /// SUBSCRIBE was parsed from: its names borrowed it, and a 64 KiB read buffer stayed alive
    /// per 20-byte SUBSCRIBE for as long as the subscription.
    #[test]
    fn a_subscription_does_not_pin_the_buffer_it_was_parsed_from() {
        let b = Broker::new(BrokerConfig::default());
        for payload in [
            &b"topic:a"[..],
            b"topic:a/+:group:g",
            b"topic:a/#:durable:c1:latest",
        ] {
            let mut buffer = payload.to_vec();
            let len = buffer.len();
            buffer.resize(65_536, 0);
            let buffer = bytes::Bytes::from(buffer);
            let spec = SubscribeSpec::parse(&buffer.slice(..len)).expect("spec");
            let routed = b.subscribe(&spec, SubscribeOptions::default());
            let unrouted = b.subscribe_unrouted(&spec, SubscribeOptions::default());
            drop(spec);
            let mut buffer = buffer;
            assert!(
                buffer.is_unique(),
                "{}: a subscription holds the read buffer",
                String::from_utf8_lossy(payload)
            );
            buffer.clear();
            drop((routed, unrouted));
        }
    }

    /// A publisher whose deliveries overflow a `disconnect` subscription that is being removed
    /// at the same moment (by another publisher that overflowed it first, an UNSUBSCRIBE or its
    /// stream's end) counts them: before, they vanished, counted nowhere.
    #[test]
    fn an_overflow_into_a_subscription_being_removed_is_counted() {
        let b = Broker::new(BrokerConfig {
            queue_size: 1,
            backpressure_policy: OverflowPolicy::Disconnect,
            ..BrokerConfig::default()
        });
        let spec = SubscribeSpec::parse(&bytes::Bytes::from_static(b"topic:t")).expect("spec");
        let sub = b.subscribe(&spec, SubscribeOptions::default());
        let topic = TopicName::try_from("t").expect("topic");
        let mut ctx = PublishContext::default();
        let now = Instant::now();
        b.publish(&mut ctx, &Publication::new(&topic, b"queued"), now);
        assert_eq!(sub.queued(), 1);
        // The first half of another remover's work: out of the table, still routed and open.
        b.write_routes().subscribers.remove(&sub.id());
        b.publish(&mut ctx, &Publication::new(&topic, b"overflows"), now);
        let stats = b.topic(&topic).expect("known").stats().snapshot();
        assert_eq!(
            stats.dropped(DropReason::Policy(OverflowPolicy::Disconnect)),
            1,
            "the overflowing delivery is counted"
        );
    }
}
