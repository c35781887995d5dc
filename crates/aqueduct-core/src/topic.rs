//! Per-topic state: the offset sequence and the counters the metrics layer reads.
//!
//! One [`TopicState`] exists per topic ever published to (or dead-lettered to). It is shared by
//! `Arc` with every queued delivery of that topic, so counting a drop or an expiry is one atomic
//! add on a handle already in hand: no map lookup, no label formatting on the hot path.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use aqueduct_proto::{OverflowPolicy, Priority, TopicName};

/// Why a message was dropped without being delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The subscriber's queue overflowed under this policy.
    Policy(OverflowPolicy),
    /// Its subscriber went away and no other consumer could take it.
    Unsubscribed,
    /// A dead letter exhausted its own retries (dead letters are not dead-lettered again).
    RetriesExhausted,
}

impl DropReason {
    pub const ALL: [DropReason; 5] = [
        DropReason::Policy(OverflowPolicy::DropOldest),
        DropReason::Policy(OverflowPolicy::DropNewest),
        DropReason::Policy(OverflowPolicy::Disconnect),
        DropReason::Unsubscribed,
        DropReason::RetriesExhausted,
    ];

    /// The `policy` label value of `aqueduct_messages_dropped_total`.
    pub fn label(self) -> &'static str {
        match self {
            DropReason::Policy(p) => p.as_str(),
            DropReason::Unsubscribed => "unsubscribed",
            DropReason::RetriesExhausted => "retries_exhausted",
        }
    }

    fn index(self) -> usize {
        match self {
            DropReason::Policy(OverflowPolicy::DropOldest) => 0,
            DropReason::Policy(OverflowPolicy::DropNewest) => 1,
            DropReason::Policy(OverflowPolicy::Disconnect) => 2,
            DropReason::Unsubscribed => 3,
            DropReason::RetriesExhausted => 4,
            // Block never drops; a slot of its own keeps the mapping total.
            DropReason::Policy(OverflowPolicy::Block) => 5,
        }
    }
}

/// Counters of one topic. Monotonic; read at scrape time.
#[derive(Debug, Default)]
pub struct TopicStats {
    published: AtomicU64,
    delivered: AtomicU64,
    dropped: [AtomicU64; 6],
    expired: [AtomicU64; Priority::LEVELS],
    nacked: AtomicU64,
    redelivered: AtomicU64,
    dead_lettered: AtomicU64,
}

/// A point-in-time copy of [`TopicStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopicStatsSnapshot {
    pub published: u64,
    pub delivered: u64,
    /// Indexed like [`DropReason::ALL`].
    pub dropped: [u64; 6],
    /// Indexed by priority level.
    pub expired: [u64; Priority::LEVELS],
    pub nacked: u64,
    pub redelivered: u64,
    pub dead_lettered: u64,
}

impl TopicStatsSnapshot {
    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &TopicStatsSnapshot) {
        self.combine(other, |a, b| a + b);
    }

    /// Take `other`'s counts from these (none below zero).
    pub fn saturating_sub(&mut self, other: &TopicStatsSnapshot) {
        self.combine(other, u64::saturating_sub);
    }

    /// Every count becomes `f(this count, other's count)`.
    fn combine(&mut self, other: &TopicStatsSnapshot, f: impl Fn(u64, u64) -> u64) {
        self.published = f(self.published, other.published);
        self.delivered = f(self.delivered, other.delivered);
        self.nacked = f(self.nacked, other.nacked);
        self.redelivered = f(self.redelivered, other.redelivered);
        self.dead_lettered = f(self.dead_lettered, other.dead_lettered);
        for (a, b) in self.dropped.iter_mut().zip(other.dropped) {
            *a = f(*a, b);
        }
        for (a, b) in self.expired.iter_mut().zip(other.expired) {
            *a = f(*a, b);
        }
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }

    pub fn expired(&self, priority: Priority) -> u64 {
        self.expired[priority.index()]
    }
}

impl TopicStats {
    pub(crate) fn published(&self, n: u64) {
        self.published.fetch_add(n, Relaxed);
    }
    pub(crate) fn delivered(&self, n: u64) {
        self.delivered.fetch_add(n, Relaxed);
    }
    pub(crate) fn dropped(&self, reason: DropReason) {
        self.dropped[reason.index()].fetch_add(1, Relaxed);
    }
    pub(crate) fn expired(&self, priority: Priority) {
        self.expired[priority.index()].fetch_add(1, Relaxed);
    }
    pub(crate) fn nacked(&self) {
        self.nacked.fetch_add(1, Relaxed);
    }
    pub(crate) fn redelivered(&self) {
        self.redelivered.fetch_add(1, Relaxed);
    }
    pub(crate) fn dead_lettered(&self) {
        self.dead_lettered.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> TopicStatsSnapshot {
        let load = |a: &AtomicU64| a.load(Relaxed);
        TopicStatsSnapshot {
            published: load(&self.published),
            delivered: load(&self.delivered),
            dropped: self.dropped.each_ref().map(load),
            expired: self.expired.each_ref().map(load),
            nacked: load(&self.nacked),
            redelivered: load(&self.redelivered),
            dead_lettered: load(&self.dead_lettered),
        }
    }
}

/// Everything the broker keeps per topic.
#[derive(Debug)]
pub struct TopicState {
    name: TopicName,
    next_offset: AtomicU64,
    stats: TopicStats,
    life: u64,
}

/// The next [`TopicState::life`].
static NEXT_LIFE: AtomicU64 = AtomicU64::new(1);

impl TopicState {
    pub(crate) fn new(name: &TopicName, next_offset: u64) -> TopicState {
        TopicState {
            // Own copy: the caller's name may borrow a large frame buffer.
            name: name.detached(),
            next_offset: AtomicU64::new(next_offset),
            stats: TopicStats::default(),
            life: NEXT_LIFE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// A number no other topic state of this process has: a topic that was evicted and made
    /// anew under the same name has another (its counters start again from 0).
    pub fn life(&self) -> u64 {
        self.life
    }

    pub fn name(&self) -> &TopicName {
        &self.name
    }

    pub fn stats(&self) -> &TopicStats {
        &self.stats
    }

    /// The offset the next message will get.
    pub fn next_offset(&self) -> u64 {
        self.next_offset.load(Relaxed)
    }

    /// Reserve `n` consecutive offsets; returns the first.
    pub(crate) fn assign_offsets(&self, n: u64) -> u64 {
        self.next_offset.fetch_add(n, Relaxed)
    }
}
