//! One subscription: its queues, its unsettled deliveries, and how it is drained.
//!
//! A [`Subscriber`] owns all of its mutable state behind one short-held mutex: publishers take it
//! to enqueue, the connection's writer takes it to drain, the reader takes it to settle. It is
//! never held across another lock or an `.await`.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use aqueduct_proto::{
    AckMode, ErrorCode, OverflowPolicy, Priority, SharedDelivery, TopicFilter, TopicName,
};
use bytes::BufMut;
use foldhash::fast::RandomState;

use crate::group::GroupShared;
use crate::latency::{LatencyHistogram, LocalLatency};
use crate::moves::Moving;
use crate::queue::{PriorityQueues, Pushed};
use crate::topic::{DropReason, TopicState};

/// Identifies a subscriber within one broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriberId(pub u64);

/// Called when a subscriber has something new for its writer (see [`Subscriber`] docs).
pub type Waker = Box<dyn Fn() + Send + Sync>;

/// One message queued for, or in flight to, one subscriber. Cloning bumps reference counts only.
#[derive(Clone)]
pub struct Delivery {
    pub(crate) topic: Arc<TopicState>,
    pub(crate) shared: SharedDelivery,
    pub(crate) offset: u64,
    pub(crate) priority: Priority,
    pub(crate) attempt: u32,
    pub(crate) expires_at: Option<Instant>,
    /// When the broker accepted the message (for the publish → delivery latency histogram).
    pub(crate) published_at: Instant,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("topic", self.topic.name())
            .field("offset", &self.offset)
            .field("priority", &self.priority)
            .field("attempt", &self.attempt)
            .finish()
    }
}

impl Delivery {
    pub fn topic(&self) -> &TopicName {
        self.topic.name()
    }
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn priority(&self) -> Priority {
        self.priority
    }
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// When the broker accepted the message.
    pub fn published_at(&self) -> Instant {
        self.published_at
    }
    pub fn body_len(&self) -> usize {
        self.shared.body_len()
    }
    /// The trace context the message carries, if any.
    pub fn trace(&self) -> Option<aqueduct_proto::TraceContext> {
        self.shared.trace()
    }
    /// Whether that trace context names a span made by another process (a copy a cluster peer
    /// forwarded, see [`Publication::with_remote_trace`](crate::Publication::with_remote_trace)).
    pub fn trace_is_remote(&self) -> bool {
        self.shared.trace_is_remote()
    }
}

/// What [`Subscriber::enqueue_many`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Enqueued {
    /// Every item was queued (or dropped by a drop policy, counted).
    Queued,
    /// Every item was queued, and a queue is now full under the block policy: whoever published
    /// must wait for [`Subscriber::poll_room`] before publishing more.
    Full,
    /// Some items were not queued (they are in `refused`).
    Refused(Refused),
}

/// Why [`Subscriber::enqueue_many`] could not queue some items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The subscriber was closed before.
    Closed,
    /// A queue overflowed under the disconnect policy.
    Overflow,
}

/// Why a subscriber stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Its queue overflowed under the disconnect policy (ERROR `SLOW_CONSUMER`).
    SlowConsumer,
    /// Unsubscribed, or its stream or connection closed.
    Unsubscribed,
    /// Its client lost the permission to subscribe when the ACL changed (ERROR
    /// `NOT_AUTHORIZED`).
    Revoked,
}

/// Why an ACK or NACK was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    #[error("no delivery of {topic} offset {offset} is awaiting settlement on this subscription")]
    NotInFlight { topic: TopicName, offset: u64 },
    #[error(
        "attempt {given} of {topic} offset {offset} is stale: the current attempt is {current}"
    )]
    StaleAttempt {
        topic: TopicName,
        offset: u64,
        given: u32,
        current: u32,
    },
    #[error("the subscription's filter has wildcards: the ACK/NACK must name the topic")]
    TopicRequired,
}

impl SettleError {
    /// The ERROR-frame code for this refusal.
    pub fn code(&self) -> ErrorCode {
        match self {
            SettleError::NotInFlight { .. } => ErrorCode::NOT_IN_FLIGHT,
            SettleError::StaleAttempt { .. } => ErrorCode::STALE_ATTEMPT,
            SettleError::TopicRequired => ErrorCode::TOPIC_REQUIRED,
        }
    }
}

/// What one [`crate::Broker::drain`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// Frames written.
    pub frames: usize,
    /// Bytes written.
    pub bytes: usize,
    /// Messages found expired and dropped.
    pub expired: usize,
    /// True if sending stopped because `max_in_flight` deliveries await settlement.
    pub blocked: bool,
}

struct InFlight {
    delivery: Delivery,
    deadline: Instant,
}

#[derive(Default)]
struct State {
    queue: PriorityQueues<Delivery>,
    in_flight: HashMap<(TopicName, u64), InFlight, RandomState>,
    closed: Option<CloseReason>,
    /// Publishers held by a full queue under the block policy ([`Subscriber::poll_room`]),
    /// woken once it has drained to [`Subscriber::resume_at`], or it is closed or detached.
    held: Vec<std::task::Waker>,
    /// Whoever waits to give it more ([`Subscriber::poll_can_take`]: a durable group's
    /// feeder), woken as held publishers are and also when a settlement or an ack timeout makes
    /// room under `max_in_flight`. Apart from `held`: a settlement leaves the queue as long as
    /// it was, so waking held publishers for it only made each look and wait again.
    takers: Vec<std::task::Waker>,
    /// Publishers that went away while this full queue held them (their stream reset, their
    /// connection closed), since it last drained to [`Subscriber::resume_at`]: see
    /// [`MAX_ORPHANED_HOLDS`].
    orphaned_holds: u32,
    /// Its client stopped reading: nothing more is queued (see [`crate::Broker::detach`]).
    detached: bool,
    /// Times a drain took the queue from above half its capacity to half or below (when held
    /// publishers go on), and messages drains took off it (both wrapping): see
    /// [`Subscriber::drain_progress`].
    halvings: u64,
    taken: u64,
    /// No delivery in flight has an ack-wait deadline before this (a lower bound: a settlement
    /// leaves it as it was). The ack ticker looks through `in_flight` only once it has passed,
    /// not every tick: a client holding many unsettled deliveries made every tick scan them all.
    next_deadline: Option<Instant>,
    /// Times [`Subscriber::take_overdue`] looked through `in_flight` (see
    /// [`Subscriber::overdue_scans`]).
    overdue_scans: u64,
}

impl State {
    /// Wake held publishers and takers alike (the subscriber is closed or detached).
    fn wake_all_waiters(&mut self) {
        std::mem::take(&mut self.held)
            .into_iter()
            .chain(std::mem::take(&mut self.takers))
            .for_each(std::task::Waker::wake);
    }
}

/// Under the block policy a frame may fill a queue past its capacity, its publisher then held
/// until the queue drains: the overshoot is at most one frame per publisher held. A publisher
/// that goes away while held (a stream reset, a connection closed — also one that just got its
/// CONFIRM and is done) leaves its overshoot behind and could come back on a new stream to add
/// another, without end. Once this many have gone away without the queue draining to half, a
/// frame that finds a level at twice its capacity closes the subscription as a slow consumer
/// (as `disconnect` would), so its queue stays bounded; below that it is held as before, so a
/// few one-shot publishers to a briefly full queue close nothing.
pub const MAX_ORPHANED_HOLDS: u32 = 16;

/// How a subscription's queue has been draining ([`Subscriber::drain_progress`]); the counters
/// wrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainProgress {
    /// Times a drain took the queue from above half its capacity to half or below: when
    /// publishers its full queue held go on.
    pub halvings: u64,
    /// Messages drains took off the queue (written, or dropped as expired).
    pub taken: u64,
    /// The queue is at half its capacity or below now (or the subscription is closed or
    /// detached): a held publisher would go on.
    pub at_half: bool,
    /// Half its capacity: what a held publisher waits for it to drain to.
    pub half: u64,
}

/// A subscription.
///
/// Contract with the writer that serves it: the waker is called when the queue goes from empty to
/// non-empty, when settlements or ack-wait timeouts make room under `max_in_flight` (with
/// something queued), and when the subscriber is closed.
/// A writer drains until `drain` writes nothing (or reports `blocked`) before it waits again.
pub struct Subscriber {
    id: SubscriberId,
    stream_id: u32,
    filter: TopicFilter,
    group: Option<Arc<GroupShared>>,
    ack_mode: AckMode,
    policy: OverflowPolicy,
    /// Bound of each priority queue (`queue_size`).
    capacity: usize,
    waker: Option<Waker>,
    /// Deliveries in the seed's form (see [`SubscriberInit::seed_form`]).
    seed_form: bool,
    /// The subscription's own bound on unsettled deliveries (below the broker's).
    max_in_flight: Option<usize>,
    unrouted: bool,
    /// Counted up when it closes: its connection's count of closed subscriptions, which tells
    /// a full table of them when a sweep for closed ones can find any.
    closes: Option<Arc<AtomicU64>>,
    closed: AtomicBool,
    /// Its interest is told to the cluster mesh (from when it is made until it stops being
    /// routed: detached, draining, or removed), so it is withdrawn exactly once.
    advertised: AtomicBool,
    /// Copies of the queue length and the in-flight count, written under `state`'s lock and read
    /// without it by consumer-group picks (which run under the routing lock and so must not take
    /// a subscriber's lock).
    queued_len: AtomicUsize,
    in_flight_len: AtomicUsize,
    /// A plain subscription's moves (a NACK's or a timeout's redelivery); a group member's are
    /// its group's (see [`moves`](Self::moves)).
    moves: crate::moves::Moves,
    state: Mutex<State>,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("id", &self.id)
            .field("stream_id", &self.stream_id)
            .field("filter", &self.filter)
            .field("group", &self.group.as_ref().map(|g| g.id()))
            .finish()
    }
}

/// Fields fixed when a subscriber is created.
pub(crate) struct SubscriberInit {
    pub id: SubscriberId,
    pub stream_id: u32,
    pub filter: TopicFilter,
    pub group: Option<Arc<GroupShared>>,
    pub ack_mode: AckMode,
    pub policy: OverflowPolicy,
    pub capacity: usize,
    pub waker: Option<Waker>,
    /// Deliver in the seed's form: PUBLISH with the body as the whole payload and only the
    /// extensions the message carries end to end (no topic, offset or attempt).
    pub seed_form: bool,
    /// The subscription's own bound on unsettled deliveries, if it asked for one.
    pub max_in_flight: Option<usize>,
    /// Fed from the durable log, not by routing (see `Broker::subscribe_unrouted`).
    pub unrouted: bool,
    pub closes: Option<Arc<AtomicU64>>,
}

impl Subscriber {
    pub(crate) fn new(init: SubscriberInit) -> Subscriber {
        Subscriber {
            id: init.id,
            stream_id: init.stream_id,
            filter: init.filter,
            // Group members settle explicitly: that is how a group knows what to redeliver.
            // Seed-style subscriptions cannot (their deliveries carry no offset to name), so
            // they are settled when written, group or not: at most once, as in the seed.
            ack_mode: if init.seed_form {
                AckMode::None
            } else if init.group.is_some() {
                AckMode::Explicit
            } else {
                init.ack_mode
            },
            group: init.group,
            policy: init.policy,
            capacity: init.capacity,
            waker: init.waker,
            seed_form: init.seed_form,
            max_in_flight: init.max_in_flight,
            unrouted: init.unrouted,
            closes: init.closes,
            closed: AtomicBool::new(false),
            advertised: AtomicBool::new(false),
            queued_len: AtomicUsize::new(0),
            in_flight_len: AtomicUsize::new(0),
            moves: crate::moves::Moves::default(),
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State half-updated in a way that matters
        // more than losing the subscriber; keep serving rather than cascade the panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publish the lengths for lock-free readers; call under the lock after a change.
    fn note_lengths(&self, st: &State) {
        self.queued_len.store(st.queue.len(), Ordering::Relaxed);
        self.in_flight_len
            .store(st.in_flight.len(), Ordering::Relaxed);
    }

    /// True if a message given now would be queued without hitting the queue bound and sent
    /// without waiting for settlements (`max_in_flight`): what is queued counts against the
    /// limit too, since every queued message becomes unsettled once written — else a member
    /// whose writer lags takes more than it can ever have unsettled, and the rest waits behind
    /// a stalled one. Lock-free and approximate (the lengths may be a moment old): good enough
    /// to steer a consumer group's round-robin away from members that are stalled or saturated.
    pub fn has_room(&self, max_in_flight: usize) -> bool {
        let max_in_flight = self.in_flight_limit(max_in_flight);
        let queued = self.queued_len.load(Ordering::Relaxed);
        !self.is_closed()
            && queued < self.capacity
            && (self.ack_mode != AckMode::Explicit
                || queued + self.in_flight_len.load(Ordering::Relaxed) < max_in_flight)
    }

    /// The bound on unsettled deliveries: the broker's, or the subscription's own if lower.
    fn in_flight_limit(&self, broker: usize) -> usize {
        self.max_in_flight.map_or(broker, |own| own.min(broker))
    }

    fn wake(&self) {
        if let Some(w) = &self.waker {
            w();
        }
    }

    pub fn id(&self) -> SubscriberId {
        self.id
    }

    /// The `stream_id` of the SUBSCRIBE frame; deliveries carry it.
    pub fn stream_id(&self) -> u32 {
        self.stream_id
    }

    pub fn filter(&self) -> &TopicFilter {
        &self.filter
    }

    pub fn group(&self) -> Option<&Arc<GroupShared>> {
        self.group.as_ref()
    }

    /// Moves of this subscription's messages between the places a durable position is read
    /// from: its own for a plain subscription, its group's for a member (a message may go from
    /// one member to another).
    pub fn moves(&self) -> &crate::moves::Moves {
        match &self.group {
            Some(g) => g.moves(),
            None => &self.moves,
        }
    }

    pub fn ack_mode(&self) -> AckMode {
        self.ack_mode
    }

    /// Fed from the durable log rather than by routing: its queue's producer waits for room,
    /// so it is never closed as a slow consumer for being full.
    pub fn is_unrouted(&self) -> bool {
        self.unrouted
    }

    pub fn policy(&self) -> OverflowPolicy {
        self.policy
    }

    /// Why the subscriber was closed, if it was.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.lock().closed
    }

    /// Cheap check, no lock.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Messages waiting to be sent, as of the last change (lock-free, may be a moment old: for
    /// picks made under the routing lock, which must not take a subscriber's lock).
    pub fn queued_approx(&self) -> usize {
        self.queued_len.load(Ordering::Relaxed)
    }

    /// Messages waiting to be sent.
    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    /// Deliveries awaiting ACK/NACK.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight.len()
    }

    /// Queue `items` under one lock, applying the overflow policy; messages it evicts or rejects
    /// are counted as dropped here (as expired if past their TTL at `now`). Items that cannot
    /// be queued at all go to `refused`, and the return value says why: the subscriber was
    /// already closed, or a queue overflowed under the disconnect policy (the caller then
    /// closes it).
    pub(crate) fn enqueue_many(
        &self,
        items: impl Iterator<Item = Delivery>,
        refused: &mut Vec<Delivery>,
        now: Instant,
    ) -> Enqueued {
        let mut items = items;
        let mut outcome = Enqueued::Queued;
        let mut wake = false;
        {
            let mut st = self.lock();
            if st.closed.is_some() || st.detached {
                refused.extend(items);
                return Enqueued::Refused(Refused::Closed);
            }
            // Publishers that left while held (enough of them) no longer hold it to its bound:
            // beyond twice its capacity a level takes nothing more (see MAX_ORPHANED_HOLDS).
            let hard = (self.policy == OverflowPolicy::Block
                && st.orphaned_holds >= MAX_ORPHANED_HOLDS)
                .then(|| self.capacity.saturating_mul(2));
            for d in items.by_ref() {
                if hard.is_some_and(|hard| st.queue.level_len(d.priority) >= hard) {
                    refused.push(d);
                    outcome = Enqueued::Refused(Refused::Overflow);
                    break;
                }
                match st.queue.push(d.priority, d, self.capacity, self.policy) {
                    Pushed::Queued { was_empty } => wake |= was_empty,
                    Pushed::QueuedFull { was_empty } => {
                        wake |= was_empty;
                        outcome = Enqueued::Full;
                    }
                    Pushed::Evicted(lost) | Pushed::Rejected(lost) => {
                        // One past its TTL is counted as expired, as everywhere else (§6.6).
                        crate::broker::count_lost(&lost, DropReason::Policy(self.policy), now);
                        if let Some(g) = &self.group {
                            g.note_settled(lost.topic.name(), lost.offset);
                        }
                    }
                    Pushed::Overflow(d) => {
                        refused.push(d);
                        outcome = Enqueued::Refused(Refused::Overflow);
                        break;
                    }
                }
            }
            self.note_lengths(&st);
        }
        if let Enqueued::Refused(_) = outcome {
            refused.extend(items);
        }
        if wake {
            self.wake();
        }
        outcome
    }

    /// Write deliveries to `out`, highest priority first, until about `max_bytes` are written
    /// (always at least one frame if any is ready).
    pub(crate) fn drain<B: BufMut, W: FnMut(&Delivery)>(
        &self,
        out: &mut B,
        max_bytes: usize,
        now: Instant,
        (ack_wait, max_in_flight): (Duration, usize),
        latency: &LatencyHistogram,
        mut written: W,
    ) -> Drained {
        let mut done = Drained::default();
        let max_in_flight = self.in_flight_limit(max_in_flight);
        // Count deliveries per run of one topic: one atomic add per run, not per message.
        let mut run: Option<(Arc<TopicState>, u64)> = None;
        // Likewise per run of one publish instant (a publish frame's deliveries): one latency.
        let mut local = LocalLatency::default();
        let mut published: Option<(Instant, u32)> = None;
        let mut st = self.lock();
        let above_half = st.queue.len() > self.resume_at();
        let explicit = self.ack_mode == AckMode::Explicit;
        while done.bytes < max_bytes || done.frames == 0 {
            if explicit && st.in_flight.len() >= max_in_flight {
                done.blocked = true;
                break;
            }
            let Some(d) = st.queue.pop() else { break };
            if d.expires_at.is_some_and(|at| at <= now) {
                d.topic.stats().expired(d.priority);
                if let Some(g) = &self.group {
                    g.note_settled(d.topic.name(), d.offset);
                }
                done.expired += 1;
                continue;
            }
            if self.seed_form {
                d.shared.write_seed_frame(out, self.stream_id);
            } else {
                d.shared.write_frame(out, self.stream_id, d.attempt);
            }
            written(&d);
            match &mut published {
                Some((at, n)) if *at == d.published_at => *n += 1,
                _ => {
                    if let Some((at, n)) = published.replace((d.published_at, 1)) {
                        local.observe_n(now.saturating_duration_since(at), n);
                    }
                }
            }
            done.frames += 1;
            done.bytes += d.shared.frame_len();
            match &mut run {
                Some((topic, n)) if Arc::ptr_eq(topic, &d.topic) => *n += 1,
                _ => {
                    if let Some((topic, n)) = run.replace((d.topic.clone(), 1)) {
                        topic.stats().delivered(n);
                    }
                }
            }
            if !explicit {
                // Settled as it is written (a group's committed offset moves on).
                if let Some(g) = &self.group {
                    g.note_settled(d.topic.name(), d.offset);
                }
            } else {
                let key = (d.topic.name().clone(), d.offset);
                let deadline = now + ack_wait;
                st.next_deadline = Some(st.next_deadline.map_or(deadline, |n| n.min(deadline)));
                st.in_flight.insert(
                    key,
                    InFlight {
                        delivery: d,
                        deadline,
                    },
                );
            }
        }
        self.note_lengths(&st);
        st.taken = st.taken.wrapping_add((done.frames + done.expired) as u64);
        // Drained to half: held publishers go on, and those that left while held are forgotten.
        let held = if st.queue.len() <= self.resume_at() {
            if above_half {
                st.halvings = st.halvings.wrapping_add(1);
            }
            st.orphaned_holds = 0;
            let mut held = std::mem::take(&mut st.held);
            held.append(&mut st.takers);
            held
        } else {
            Vec::new()
        };
        drop(st);
        held.into_iter().for_each(std::task::Waker::wake);
        if let Some((topic, n)) = run {
            topic.stats().delivered(n);
        }
        if let Some((at, n)) = published {
            local.observe_n(now.saturating_duration_since(at), n);
        }
        local.flush(latency);
        done
    }

    /// For each topic with messages queued or awaiting settlement, the lowest such offset: where
    /// a durable consumer's position stands (everything below it is settled).
    pub fn unsettled_floor(&self) -> Vec<(TopicName, u64)> {
        let st = self.lock();
        let mut floor: HashMap<TopicName, u64, RandomState> = HashMap::default();
        let queued = st.queue.iter().map(|d| (d.topic.name(), d.offset));
        let in_flight = st.in_flight.keys().map(|(t, o)| (t, *o));
        for (topic, offset) in queued.chain(in_flight) {
            match floor.get_mut(topic) {
                Some(f) => *f = (*f).min(offset),
                None => {
                    floor.insert(topic.clone(), offset);
                }
            }
        }
        floor.into_iter().collect()
    }

    /// Held publishers go on once the queue is down to half its capacity: they then have room
    /// for a good burst rather than one message.
    fn resume_at(&self) -> usize {
        self.capacity / 2
    }

    /// Ready once this subscriber can take a message now: fewer than `queued_below` queued (and
    /// than its queue's capacity, as [`has_room`](Self::has_room) asks) and (when it
    /// acknowledges) room under `max_in_flight`; never for a closed or detached one. For a
    /// feeder that keeps each member's queue short.
    pub fn poll_can_take(
        &self,
        cx: &mut std::task::Context<'_>,
        max_in_flight: usize,
        queued_below: usize,
    ) -> std::task::Poll<()> {
        let mut st = self.lock();
        let limit = self.in_flight_limit(max_in_flight);
        // Queued ones count: each becomes unsettled once written (see `has_room`).
        let in_flight_room =
            self.ack_mode != AckMode::Explicit || st.in_flight.len() + st.queue.len() < limit;
        if st.closed.is_some() || st.detached {
            // Never again: the caller's other members (or a new one) must wake it.
            return std::task::Poll::Pending;
        }
        if st.queue.len() < queued_below.min(self.capacity) && in_flight_room {
            return std::task::Poll::Ready(());
        }
        if !st.takers.iter().any(|w| w.will_wake(cx.waker())) {
            st.takers.push(cx.waker().clone());
        }
        std::task::Poll::Pending
    }

    /// How its queue has been draining so far, for a watcher that looks now and then (see
    /// [`DrainProgress`]).
    pub fn drain_progress(&self) -> DrainProgress {
        let st = self.lock();
        DrainProgress {
            halvings: st.halvings,
            taken: st.taken,
            at_half: st.closed.is_some() || st.detached || st.queue.len() <= self.resume_at(),
            half: self.resume_at() as u64,
        }
    }

    /// A publisher this subscriber's full queue held went away before the queue drained (its
    /// stream was reset or its connection closed while it waited): counted towards
    /// [`MAX_ORPHANED_HOLDS`]. Nothing if the queue has drained to half since.
    pub fn note_orphaned_hold(&self) {
        let mut st = self.lock();
        if st.queue.len() > self.resume_at() {
            st.orphaned_holds = st.orphaned_holds.saturating_add(1);
        }
    }

    /// Ready once a publisher held by this subscriber's full queue (block policy) may go on: the
    /// queue has drained to half its capacity, or the subscriber is closed.
    pub fn poll_room(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let mut st = self.lock();
        if st.closed.is_some() || st.detached || st.queue.len() <= self.resume_at() {
            return std::task::Poll::Ready(());
        }
        if !st.held.iter().any(|w| w.will_wake(cx.waker())) {
            st.held.push(cx.waker().clone());
        }
        std::task::Poll::Pending
    }

    /// Remove a delivery from the in-flight set after checking the ACK/NACK names it.
    pub(crate) fn settle(
        &self,
        topic: Option<&TopicName>,
        offset: u64,
        attempt: Option<u32>,
    ) -> Result<Delivery, SettleError> {
        let topic = match topic {
            Some(t) => t.clone(),
            None => self.filter.as_topic().ok_or(SettleError::TopicRequired)?,
        };
        let (delivery, wake) = {
            let mut st = self.lock();
            let delivery: Delivery = match st.in_flight.entry((topic, offset)) {
                Entry::Vacant(v) => {
                    let (topic, offset) = v.into_key();
                    return Err(SettleError::NotInFlight { topic, offset });
                }
                Entry::Occupied(e) => {
                    let current = e.get().delivery.attempt;
                    match attempt {
                        Some(given) if given != current => {
                            let (topic, offset) = e.key().clone();
                            return Err(SettleError::StaleAttempt {
                                topic,
                                offset,
                                given,
                                current,
                            });
                        }
                        _ => e.remove().delivery,
                    }
                }
            };
            self.note_lengths(&st);
            // Room under max_in_flight: whoever waits to give this subscriber more (a durable
            // group's feeder) may go on. Held publishers wait for the queue, which this leaves
            // as it was.
            let held = std::mem::take(&mut st.takers);
            (delivery, (!st.queue.is_empty(), held))
        };
        let (wake, held) = wake;
        held.into_iter().for_each(std::task::Waker::wake);
        if wake {
            self.wake();
        }
        Ok(delivery)
    }

    /// How many times [`take_overdue`](Self::take_overdue) has looked through the deliveries in
    /// flight (wrapping): only when the earliest deadline may have passed, not at every tick.
    pub fn overdue_scans(&self) -> u64 {
        self.lock().overdue_scans
    }

    /// Take the in-flight deliveries whose ack-wait deadline has passed. That makes room under
    /// `max_in_flight` as a settlement does, and wakes the same: the writer if something is
    /// queued (a redelivery into a non-empty queue would not wake it), and whoever waits to
    /// give this subscriber more. When it takes any, a move of them has begun (see
    /// [`moves`](Self::moves)): it ends when the returned guard is dropped, after they are placed.
    pub(crate) fn take_overdue(&self, now: Instant) -> (Vec<Delivery>, Option<Moving<'_>>) {
        let (mut out, wake, held, moving) = {
            let mut st = self.lock();
            if st.in_flight.is_empty() || st.next_deadline.is_some_and(|n| now < n) {
                return (Vec::new(), None);
            }
            st.overdue_scans = st.overdue_scans.wrapping_add(1);
            let mut overdue: Vec<(TopicName, u64)> = Vec::new();
            let mut next: Option<Instant> = None;
            for (k, f) in &st.in_flight {
                if f.deadline <= now {
                    overdue.push(k.clone());
                } else {
                    next = Some(next.map_or(f.deadline, |n| n.min(f.deadline)));
                }
            }
            st.next_deadline = next;
            if overdue.is_empty() {
                return (Vec::new(), None);
            }
            // Before they leave the in-flight set: a position read meanwhile is not kept.
            let moving = self.moves().begin();
            let out: Vec<Delivery> = overdue
                .iter()
                .filter_map(|k| st.in_flight.remove(k).map(|f| f.delivery))
                .collect();
            self.note_lengths(&st);
            (
                out,
                !st.queue.is_empty(),
                std::mem::take(&mut st.takers),
                moving,
            )
        };
        held.into_iter().for_each(std::task::Waker::wake);
        if wake {
            self.wake();
        }
        out.sort_by_key(|d| (d.priority, d.offset));
        (out, Some(moving))
    }

    /// Mark its interest told (`true`) or withdrawn (`false`); returns whether that changed it.
    pub(crate) fn set_advertised(&self, on: bool) -> bool {
        self.advertised.swap(on, Ordering::AcqRel) != on
    }

    /// Detach: take everything queued (not in flight) and refuse anything more, as if closed,
    /// while in-flight deliveries can still be settled.
    pub(crate) fn detach(&self) -> Vec<Delivery> {
        let mut st = self.lock();
        st.detached = true;
        let queued = st.queue.take_all();
        self.note_lengths(&st);
        st.wake_all_waiters();
        queued
    }

    /// Close and take everything still queued and in flight.
    pub(crate) fn close(&self, reason: CloseReason) -> (Vec<Delivery>, Vec<Delivery>) {
        let taken = {
            let mut st = self.lock();
            if st.closed.is_none() {
                st.closed = Some(reason);
            }
            self.closed.store(true, Ordering::Release);
            // After the flag: whoever sees the count move sees this one closed.
            if let Some(closes) = &self.closes {
                closes.fetch_add(1, Ordering::Release);
            }
            st.wake_all_waiters();
            let queued = st.queue.take_all();
            let mut in_flight: Vec<Delivery> =
                st.in_flight.drain().map(|(_, f)| f.delivery).collect();
            in_flight.sort_by_key(|d| (d.priority, d.offset));
            self.note_lengths(&st);
            (queued, in_flight)
        };
        self.wake();
        taken
    }
}
