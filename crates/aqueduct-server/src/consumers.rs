//! Durable consumers (`topic:<filter>:durable:<id>:<start>`) with the durable log on: served
//! from the log, positions stored.
//!
//! A durable subscription is not fed by routing. A feeder task reads the log from the
//! consumer's position, topic by topic, and queues each message for the subscription with the
//! offset it has in the log; the stream's writer delivers it like any other, and ACK, NACK,
//! redelivery and dead letters work as usual. When the feeder has caught up it waits for the log
//! writer's next write. So there is no switch from backfill to live: every message comes from
//! the log, in offset order per topic, once — and a durable consumer only ever sees messages that
//! are durable. A feeder that has caught up looks, after each write, only at the topics that
//! write changed (the log keeps the topics of its last [`MAX_CHANGES`] writes' runs; a feeder
//! further behind looks at all of its topics), so its cost does not grow with the number of
//! topics the log has seen.
//!
//! [`MAX_CHANGES`]: crate::durable
//!
//! Positions: for each topic, the next offset to deliver — the lowest offset the subscription
//! still has queued or unsettled, else the next one the feeder would read. They are saved to
//! the log directory's `consumers` file every [`CHECKPOINT_EVERY`] while anything changed, when
//! a subscription ends, and at shutdown. A consumer that comes back (after a reconnect or a
//! restart) resumes from its stored position, whatever start it asks for; unacknowledged
//! messages are delivered again (at least once). One subscription per consumer id at a time.
//!
//! Durable groups (`:group:` with `:durable:`): one feeder and one position for the group, its
//! members an unrouted group in the core (each message to one member with room; a leaving
//! member's messages to the others, or parked for the next member when it was the last). A
//! member is made, and the group ended, under the table's lock, so the two never interleave.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use aqueduct_core::group::GroupShared;
use aqueduct_core::moves::Moves;
use aqueduct_core::{matching, Broker, Publication, PublishContext, Subscriber, SubscriberId};
use aqueduct_log::{ConsumerPosition, LogError, PositionStore, Positions};
use aqueduct_proto::delivery::DeadLetter;
use aqueduct_proto::{DurableStart, TopicFilter, TopicName};
use tracing::{debug, info, warn};

use crate::durable::{Durable, StoredMessage, TopicsSeen};
use crate::warn_every::{held_back, WarnEvery};

/// How often changed positions are saved.
pub(crate) const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);
/// A durable group's feeder gives a member a message only while it has fewer than this many
/// queued: a member whose client stops reading then holds few (and its unacknowledged ones time
/// out to the others), and one stuck member never stalls the group.
const FEED_AHEAD: usize = 16;
/// Messages a feeder reads from one topic before looking at the others.
const READ_BATCH: usize = 512;
/// Topics a feeder reads at a time (then queues what it read)...
const READ_TOPICS: usize = 32;
/// ...and how many bytes of messages at most (past one message).
const READ_BYTES: usize = 4 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a feeder shares with the consumer table.
#[derive(Debug, Default)]
pub(crate) struct Fed {
    /// Per topic, the next offset the feeder will read (changed through [`Fed::set`], or with
    /// [`version`](Self::version) raised: a checkpoint saves nothing else).
    next: BTreeMap<Vec<u8>, u64>,
    /// The feeder must stop: set under this lock by [`Consumers::rewind`], checked under it by
    /// the feeder before each message it queues, so no message is queued after a rewind.
    stopped: bool,
    /// Times positions were taken out of `next` with the topics the log forgot: the feeder
    /// then forgets what it kept about them.
    forgotten: u64,
    /// Changes to `next` so far (see [`Sig`]).
    version: u64,
}

impl Fed {
    /// The feeder's positions (tests).
    #[cfg(test)]
    pub(crate) fn positions(&self) -> &BTreeMap<Vec<u8>, u64> {
        &self.next
    }

    /// Where the feeder reads `topic` next.
    pub(crate) fn set(&mut self, topic: &[u8], next: u64) {
        match self.next.get_mut(topic) {
            Some(at) => *at = next,
            None => {
                self.next.insert(topic.to_vec(), next);
            }
        }
        self.version += 1;
    }
}

/// What a live consumer's position is made of — its feeder's positions (by
/// [`Fed::version`]) and, per topic, the lowest offset its subscriptions hold (queued,
/// unsettled, parked; sorted) — so that a checkpoint can tell a position unchanged since the
/// last save without reading (or copying) a position per topic.
type Sig = (u64, Vec<(TopicName, u64)>);

pub(crate) type SharedFed = Arc<Mutex<Fed>>;

/// A consumer (or a durable group) with live subscriptions.
#[derive(Debug)]
struct Live {
    /// Its subscriptions: one for a consumer, the members for a group.
    members: Vec<Arc<Subscriber>>,
    /// A durable group's core state (unrouted group): its parked messages count in its position.
    group: Option<Arc<GroupShared>>,
    /// Wakes a group's feeder when a member joins (it waits while the group has none).
    joined: Arc<tokio::sync::Notify>,
    fed: SharedFed,
    filter: String,
    /// The feeder task: it serves the consumer or group and ends with its last subscription.
    feeder: Feeder,
    /// What its position was made of when last saved.
    saved_as: Option<Sig>,
    /// A position it is known not to be past: where it started (its claim's), then what a
    /// checkpoint saved for it. What a position read that moves kept unsettled falls back
    /// on: what came after is delivered again, as after a crash, but nothing is skipped.
    safe: ConsumerPosition,
}

#[derive(Debug)]
enum Feeder {
    /// Claimed by the first subscription, which is starting it.
    Starting,
    Running(tokio::task::AbortHandle),
    Stopped,
}

impl Live {
    /// Whether `sub` is one of its subscriptions. The stream layer names a consumer by key,
    /// read before it takes the table's lock: meanwhile that subscription may have ended and
    /// another claimed the id. What is asked of the one that ended must not reach the new one.
    fn holds(&self, sub: SubscriberId) -> bool {
        self.members.iter().any(|m| m.id() == sub)
    }

    /// Stop the feeder: nothing is queued after this returns.
    fn stop_feeder(&mut self) {
        lock(&self.fed).stopped = true;
        if let Feeder::Running(f) = std::mem::replace(&mut self.feeder, Feeder::Stopped) {
            f.abort();
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    /// Positions of consumers without a live subscription (as last saved or ended).
    stored: Positions,
    live: HashMap<String, Live>,
    /// Since when each stored consumer has had no live subscription (since this broker
    /// started, for those it found stored): forgotten after [`ConsumerLimits::retention`].
    idle_since: HashMap<String, Instant>,
    /// Changes to `stored` and to the set of live consumers so far.
    changes: u64,
}

impl Table {
    /// Consumers and groups known: stored, live, or both.
    fn known(&self) -> usize {
        self.stored.len()
            + self
                .live
                .keys()
                .filter(|k| !self.stored.contains_key(*k))
                .count()
    }

    /// Store `position` for `key` (its last subscription ended), also an empty one: a consumer
    /// whose feeder ran has started, matching topics or not, and topics that appear while it is
    /// away are then read from their first message. (A subscription taken back before its
    /// feeder ran never gets here: `keep_unless_unfed`.) An empty position was dropped, and a
    /// `latest` consumer coming back counted as new: it skipped what came while it was away.
    fn keep(&mut self, key: &str, position: ConsumerPosition) {
        self.stored.insert(key.to_string(), position);
        self.changes += 1;
        self.idle_since.insert(key.to_string(), Instant::now());
    }

    /// Stop `live`'s feeder and keep its position — unless its feeder never started (its
    /// SUBSCRIBE was taken back, or ended before it was fed anything): then what was stored
    /// stays as it was, and a new consumer stays unseen (the positions a `latest` consumer
    /// was given at its SUBSCRIBE are not a position it reached).
    fn keep_unless_unfed(&mut self, key: &str, live: &mut Live) {
        let unfed = matches!(live.feeder, Feeder::Starting);
        live.stop_feeder();
        if !unfed {
            // Its last position: worth waiting a moment for a settled read (rare: a
            // subscription's end).
            match position_of(live, REWIND_PATIENCE) {
                Some((position, _)) => self.keep(key, position),
                // Never settled: the last position known not to be past any of its messages
                // (lower, so nothing is skipped; what came after is delivered again).
                None => {
                    warn!(consumer = %key, "durable consumer: its messages kept moving (NACKs, redeliveries) while its position was read; kept its last saved position (what came after is delivered again)");
                    self.keep(key, live.safe.clone());
                }
            }
        } else if self.stored.contains_key(key) {
            self.idle_since.insert(key.to_string(), Instant::now());
        }
    }
}

/// How many consumers the broker keeps positions for, and for how long without a subscription
/// (`aal.max_consumers`, `aal.consumer_retention`): a client that subscribes with a new
/// consumer id every time must not grow the table (and its file, rewritten at every change)
/// without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerLimits {
    /// Consumers and durable groups whose positions are kept, live or not.
    pub max: usize,
    /// A consumer without a subscription for this long is forgotten (`None`: never).
    pub retention: Option<Duration>,
}

impl Default for ConsumerLimits {
    fn default() -> Self {
        ConsumerLimits {
            max: 10_000,
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

/// The durable consumers of a broker.
#[derive(Debug)]
pub(crate) struct Consumers {
    store: PositionStore,
    table: Mutex<Table>,
    /// The table as last saved (nothing is written while it is unchanged).
    saved: Mutex<Saved>,
    /// The durable groups' positions of the last save (see
    /// [`saved_group_positions`](Self::saved_group_positions)).
    saved_groups: Mutex<GroupPositions>,
    limits: ConsumerLimits,
}

/// Why a durable SUBSCRIBE was refused.
#[derive(Debug)]
pub(crate) enum ClaimError {
    /// Another subscription is this consumer already.
    InUse,
    /// The durable group exists with another filter.
    OtherFilter(String),
    /// A new consumer id, and the broker keeps as many as `aal.max_consumers` allows.
    TooMany(usize),
    /// The claim would make a new consumer, and its caller has not worked out where that one
    /// starts ([`Consumers::claim_with`]'s `initial` gave nothing): work it out, and claim again.
    Unwalked,
}

/// What a durable SUBSCRIBE joined.
#[derive(Debug)]
pub(crate) struct Claim {
    pub sub: Arc<Subscriber>,
    pub fed: SharedFed,
    pub joined: Arc<tokio::sync::Notify>,
    /// The consumer or group has a stored position.
    pub resumed: bool,
    /// The first live subscription: the caller starts the feeder ([`Consumers::start_feeder`]).
    pub first: bool,
}

impl Drop for Consumers {
    /// No feeder outlives the broker's consumers (connections end theirs; this is the backstop).
    fn drop(&mut self) {
        for live in lock(&self.table).live.values_mut() {
            live.stop_feeder();
        }
    }
}

impl Consumers {
    pub fn open(dir: &std::path::Path, limits: ConsumerLimits) -> Result<Consumers, LogError> {
        let (store, stored) = PositionStore::open(dir)?;
        let now = Instant::now();
        let idle_since = stored.keys().map(|k| (k.clone(), now)).collect();
        Ok(Consumers {
            store,
            saved: Mutex::new(Saved {
                positions: stored.clone(),
                // Nothing to compare live consumers with yet: the first checkpoint reads them.
                changes: u64::MAX,
                file_bytes: 0,
            }),
            saved_groups: Mutex::new(groups_of(&stored)),
            table: Mutex::new(Table {
                stored,
                live: HashMap::new(),
                idle_since,
                changes: 0,
            }),
            limits,
        })
    }

    /// Whether `key` has a stored position (it resumes from it, whatever start it asks).
    /// Would a claim of `key` now make a new consumer, which starts from the positions it is
    /// given (see [`claim_with`](Self::claim_with))? Not with a stored position, nor while one
    /// is live (the claim then joins its group or is refused; if it ends first, the claim says
    /// [`ClaimError::Unwalked`]). `Err(TooMany)` if the claim would be refused for being new:
    /// said before the caller works out where a new one starts (for `latest`, a walk of every
    /// topic), so that SUBSCRIBEs refused anyway never make the broker walk. The claim decides
    /// again.
    pub fn claims_new(&self, key: &str) -> Result<bool, ClaimError> {
        let t = lock(&self.table);
        if t.stored.contains_key(key) || t.live.contains_key(key) {
            return Ok(false);
        }
        if t.known() >= self.limits.max {
            return Err(ClaimError::TooMany(self.limits.max));
        }
        Ok(true)
    }

    #[cfg(test)]
    pub fn has_position(&self, key: &str) -> bool {
        lock(&self.table).stored.contains_key(key)
    }

    /// The durable consumers' say in which emptied topics the log may forget. `ends`: per
    /// topic, the offset past its last durable message. Takes out every topic some consumer or
    /// group has not read to its end: its position (stored, or its feeder's) is below it, it
    /// holds a message of it (queued, unsettled or parked), or its messages kept moving while
    /// that was read. A position at the end says no more than a consumer without one would
    /// (it reads the topic from its start once the topic is logged again, past the log's offset
    /// floor), so it does not hold the topic: [`forget_positions`](Self::forget_positions)
    /// drops it with the topic. One below would look, once the topic starts again past the
    /// floor, like retention deleting messages it had not read.
    pub fn retain_unread(&self, ends: &mut HashMap<Box<[u8]>, u64>) {
        let table = lock(&self.table);
        let mut unread: Vec<Box<[u8]>> = Vec::new();
        // A live consumer's stored position is the one it started from: its feeder's counts
        // (it replaces the stored one when the consumer ends).
        for (_, p) in table
            .stored
            .iter()
            .filter(|(k, _)| !table.live.contains_key(*k))
        {
            unread.extend(positioned(ends, &p.next, true));
        }
        for live in table.live.values() {
            // Under the feeder's lock (it queues a message and moves on under it) and settled
            // (no message on its way between two of the consumer's places): a message is then
            // held by a subscription or below the feeder's position, never neither.
            let read = |ends: &HashMap<Box<[u8]>, u64>| {
                let fed = lock(&live.fed);
                let mut unread = positioned(ends, &fed.next, true);
                let (_, held) = sig_of(live, &fed);
                unread.extend(held.iter().map(|(t, _)| Box::<[u8]>::from(t.as_bytes())));
                unread
            };
            let read = match moves_of(live) {
                Some(moves) => moves.read_settled_within(|| read(ends), SAVE_PATIENCE),
                None => Some(read(ends)),
            };
            // Moving all along: every topic it has a position in stays.
            unread.extend(read.unwrap_or_else(|| positioned(ends, &lock(&live.fed).next, false)));
        }
        for t in unread {
            ends.remove(&t);
        }
    }

    /// `forgotten` left the log (each with its end in `ends`, as given to
    /// [`retain_unread`](Self::retain_unread), which let it go): every position at that end (or
    /// past it) goes with it. A consumer finds the topic again when it is logged again, as a topic new to the
    /// log, and reads it from its start (past the log's offset floor). Call before the log
    /// writes again: the topic then reappears in the log's list of topics after its positions
    /// are gone, so no feeder overlooks it.
    pub fn forget_positions(&self, forgotten: &[Box<[u8]>], ends: &HashMap<Box<[u8]>, u64>) {
        let reached = |next: &BTreeMap<Vec<u8>, u64>, t: &[u8]| matches!((next.get(t), ends.get(t)), (Some(n), Some(end)) if n >= end);
        let mut table = lock(&self.table);
        let mut dropped = 0;
        let Table { stored, live, .. } = &mut *table;
        for (key, p) in stored.iter_mut() {
            // A live consumer's stored position is the one it started from (its feeder's let
            // the topic go): it could come back if the consumer ends unsettled.
            let started_from = live.contains_key(key);
            for t in forgotten {
                if started_from || reached(&p.next, t) {
                    dropped += usize::from(p.next.remove(&**t).is_some());
                }
            }
        }
        if dropped > 0 {
            table.changes += 1;
        }
        for live in table.live.values_mut() {
            // The topic was read to its end (`retain_unread`): the position to fall back on
            // reads it from its start once it is logged again, as the feeder's does.
            for t in forgotten {
                live.safe.next.remove(&**t);
            }
            let mut fed = lock(&live.fed);
            let before = fed.next.len();
            for t in forgotten {
                if reached(&fed.next, t) {
                    fed.next.remove(&**t);
                }
            }
            if fed.next.len() < before {
                fed.forgotten += 1;
                fed.version += 1;
            }
        }
    }

    /// The key a consumer's position is stored under.
    pub fn key(consumer: &str) -> String {
        format!("consumer:{consumer}")
    }

    /// The key a durable group's one position is stored under.
    pub fn group_key(group: &str) -> String {
        format!("group:{group}")
    }

    /// Make a live subscription of `key` — the only one of a consumer (refused if it has one),
    /// or one more member of a durable group (`group`) — created by `make` under the table's
    /// lock, so that joining a group and the group's end never interleave. Returns it with the
    /// feeder's positions: the stored ones, if any, else those `initial` gives (a new consumer
    /// starting at `latest`: see [`latest_positions`]).
    #[cfg(test)]
    pub fn claim(
        &self,
        key: &str,
        filter: &TopicFilter,
        group: bool,
        initial: impl FnOnce() -> BTreeMap<Vec<u8>, u64>,
        make: impl FnOnce() -> Arc<Subscriber>,
    ) -> Result<Claim, ClaimError> {
        self.claim_with(key, filter, group, || Some(initial()), make)
    }

    /// [`claim`](Self::claim), `initial` giving `None` where the caller has not worked out
    /// where a new consumer starts: a claim that would make one then makes nothing and says
    /// [`ClaimError::Unwalked`].
    pub fn claim_with(
        &self,
        key: &str,
        filter: &TopicFilter,
        group: bool,
        initial: impl FnOnce() -> Option<BTreeMap<Vec<u8>, u64>>,
        make: impl FnOnce() -> Arc<Subscriber>,
    ) -> Result<Claim, ClaimError> {
        let mut t = lock(&self.table);
        let resumed = t.stored.contains_key(key);
        if !resumed && !t.live.contains_key(key) && t.known() >= self.limits.max {
            return Err(ClaimError::TooMany(self.limits.max));
        }
        t.idle_since.remove(key);
        if let Some(live) = t.live.get_mut(key) {
            if !group {
                return Err(ClaimError::InUse);
            }
            if live.filter != filter.as_str() {
                return Err(ClaimError::OtherFilter(live.filter.clone()));
            }
            let sub = make();
            live.members.push(sub.clone());
            live.joined.notify_one();
            return Ok(Claim {
                sub,
                fed: live.fed.clone(),
                joined: live.joined.clone(),
                resumed,
                first: false,
            });
        }
        let start = match t.stored.get(key) {
            Some(c) => c.next.clone(),
            None => initial().ok_or(ClaimError::Unwalked)?,
        };
        let sub = make();
        let safe = ConsumerPosition {
            filter: filter.to_string(),
            next: start.clone(),
        };
        let fed = Arc::new(Mutex::new(Fed {
            next: start,
            ..Fed::default()
        }));
        let joined = Arc::new(tokio::sync::Notify::new());
        t.changes += 1;
        t.live.insert(
            key.to_string(),
            Live {
                members: vec![sub.clone()],
                group: sub.group().cloned(),
                joined: joined.clone(),
                fed: fed.clone(),
                filter: filter.to_string(),
                feeder: Feeder::Starting,
                saved_as: None,
                safe,
            },
        );
        Ok(Claim {
            sub,
            fed,
            joined,
            resumed,
            first: true,
        })
    }

    /// Start the feeder of `key` (its first subscription does, see [`Claim::first`]). The task
    /// ends with the consumer's or group's last subscription, or with these consumers.
    ///
    /// `fed` is the claim's: only the consumer it claimed gets the feeder. If that one ended
    /// meanwhile and another subscription claimed the id anew, the new claim starts its own.
    pub fn start_feeder(
        &self,
        key: &str,
        fed: &SharedFed,
        feed: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        // Spawned under the table's lock, and marked running before the lock is let go: a
        // feeder that ran while its consumer still looked unfed let the consumer's end store
        // nothing for messages it had already handed out (then skipped by a `latest` start).
        let unstarted = {
            let mut t = lock(&self.table);
            match t.live.get_mut(key) {
                Some(live)
                    if matches!(live.feeder, Feeder::Starting) && Arc::ptr_eq(&live.fed, fed) =>
                {
                    live.feeder = Feeder::Running(tokio::spawn(feed).abort_handle());
                    None
                }
                // Ended (or stopped) meanwhile: never started.
                _ => Some(feed),
            }
        };
        // Dropped without the lock: what it holds may lock the table as it goes.
        drop(unstarted);
    }

    /// `sub` (of `key`) ends: call before it is removed from the broker, while its unsettled
    /// messages are still known. A consumer's feeder stops and its position is kept. A group
    /// member stays counted until [`left`](Self::left): the broker hands its messages to the
    /// other members, or parks them in the group when it was the last.
    pub fn end(&self, key: &str, sub: &Subscriber) {
        let mut t = lock(&self.table);
        let single = t
            .live
            .get(key)
            .is_some_and(|live| live.group.is_none() && live.holds(sub.id()));
        if !single {
            return;
        }
        if let Some(mut live) = t.live.remove(key) {
            t.changes += 1;
            t.keep_unless_unfed(key, &mut live);
        }
    }

    /// `sub` is gone from the broker (after [`end`](Self::end)). A durable group whose last
    /// member this was ends: its position (the feeder's, lowered to what the group parked) is
    /// kept, its feeder stops, and the broker forgets the group.
    pub fn left(&self, key: &str, sub: &Subscriber, broker: &Broker) {
        let mut t = lock(&self.table);
        let Some(live) = t.live.get_mut(key) else {
            return;
        };
        live.members.retain(|m| m.id() != sub.id());
        if !live.members.is_empty() || live.group.is_none() {
            return;
        }
        if let Some(mut live) = t.live.remove(key) {
            t.changes += 1;
            t.keep_unless_unfed(key, &mut live);
            if let Some(g) = &live.group {
                broker.forget_unrouted_group(g);
            }
        }
    }

    /// `sub`'s client stopped reading (its subscription lives on until its stream ends). A
    /// consumer's queued messages are about to be dropped, and its unsettled ones, if NACKed or
    /// timed out before an ACK comes, will never be written again: its feeder stops and its
    /// positions go back to the lowest of them, so none is skipped (one settled meanwhile may
    /// come again after a resubscribe). A group member's go to the other members (or are
    /// parked in the group): nothing to do.
    pub fn rewind(&self, key: &str, sub: &Subscriber) {
        let mut t = lock(&self.table);
        if let Some(live) = t.live.get_mut(key) {
            if live.group.is_some() || !live.holds(sub.id()) {
                return;
            }
            live.stop_feeder();
            // A read that missed a message on its way between two places would move the
            // position past it for good: wait for a settled one (a move is short; its thread
            // may be preempted midway, which the quick reads of `settled` did not outlast).
            let floors = sub
                .moves()
                .read_settled_within(|| sub.unsettled_floor(), REWIND_PATIENCE);
            let mut fed = lock(&live.fed);
            fed.next = match floors {
                Some(floors) => floor(&fed.next, floors),
                // Back to where it is known to have been: what came after comes again.
                None => {
                    warn!(consumer = %key, "durable consumer: its messages kept moving for {REWIND_PATIENCE:?} while its client stopped reading; rewound to its last saved position (what came after is delivered again)");
                    live.safe.next.clone()
                }
            };
            fed.version += 1;
        }
    }

    /// A consumer's client finished its stream without acknowledging (written is settled): no
    /// more messages for it; what is queued is still written.
    pub fn pause(&self, key: &str, sub: SubscriberId) {
        if let Some(live) = lock(&self.table).live.get_mut(key) {
            if live.group.is_none() && live.holds(sub) {
                live.stop_feeder();
            }
        }
    }

    /// Every consumer's position now. One whose messages kept moving while it was read (see
    /// [`position_of`]) keeps its [`Live::safe`] position: what was last saved for this very
    /// subscription, or the one it started from (a consumer never saved yet: left out, a crash
    /// made it new, and a `latest` one then skipped what it had not settled) — not the key's
    /// last saved entry, which may be an earlier consumer's of the same id (forgotten by
    /// retention since, its forgetting not saved yet); the
    /// others are saved regardless. Also counts those not read, and returns what the others' positions
    /// were made of and the table's [`changes`](Table::changes) when read.
    fn snapshot(&self) -> Snapshot {
        let t = lock(&self.table);
        let mut all = t.stored.clone();
        let mut unread = 0;
        let mut sigs = Vec::with_capacity(t.live.len());
        let mut feds = Vec::with_capacity(t.live.len());
        for (key, live) in &t.live {
            feds.push((key.clone(), live.fed.clone()));
            match position_of(live, SAVE_PATIENCE) {
                Some((position, sig)) => {
                    all.insert(key.clone(), position);
                    sigs.push((key.clone(), sig));
                }
                None => {
                    unread += 1;
                    all.insert(key.clone(), live.safe.clone());
                }
            }
        }
        Snapshot {
            all,
            unread,
            sigs,
            feds,
            changes: t.changes,
        }
    }

    /// Forget the consumers that have had no subscription for longer than the retention.
    fn expire(&self, now: Instant) {
        let Some(retention) = self.limits.retention else {
            return;
        };
        let mut t = lock(&self.table);
        let Table {
            stored,
            live,
            idle_since,
            changes,
        } = &mut *t;
        idle_since.retain(|key, since| {
            if live.contains_key(key) || now.saturating_duration_since(*since) < retention {
                return true;
            }
            stored.remove(key);
            *changes += 1;
            info!(consumer = %key, "forgot a durable consumer's position: no subscription for {retention:?} (aal.consumer_retention)");
            false
        });
    }

    /// Whether no position can have changed since the last save: no consumer was stored,
    /// changed or forgotten, none started or ended, and every live one's position is made of
    /// what it was then ([`Sig`]: its feeder's version and the few offsets it holds) — read
    /// settled, as [`snapshot`](Self::snapshot) reads. Costs nothing per topic: a checkpoint
    /// copied and compared every position five times a second, a steady load for a wildcard
    /// consumer of many topics on an idle broker (22% of a core for 100,000 topics).
    fn unchanged(&self, saved: &Saved) -> bool {
        let t = lock(&self.table);
        t.changes == saved.changes
            && t.live.values().all(|live| {
                let Some(before) = &live.saved_as else {
                    return false;
                };
                let sig = || sig_of(live, &lock(&live.fed));
                let now = match moves_of(live) {
                    Some(moves) => moves.read_settled_within(sig, SAVE_PATIENCE),
                    None => Some(sig()),
                };
                now.as_ref() == Some(before)
            })
    }

    /// Each durable group's position as last saved (by group id): per topic, the next offset to
    /// deliver, every message below it settled (for the metrics, at most [`CHECKPOINT_EVERY`]
    /// behind while it moves). A copy of its own: `saved` is held across a checkpoint's wait
    /// for the log and its file write, which a scrape must not wait out.
    pub fn saved_group_positions(&self) -> GroupPositions {
        lock(&self.saved_groups).clone()
    }

    /// The size of the positions file written last (0 before the first).
    fn saved_file_bytes(&self) -> usize {
        lock(&self.saved).file_bytes
    }

    /// Save the positions if they changed since the last save (blocking file I/O), after
    /// forgetting the consumers idle past the retention. Returns whether it read them (then
    /// they were saved if they differed).
    /// `written`: `None` if the log has not yet written (or failed to write) what was queued
    /// before it, else the messages whose dead letters a failed write lost (topic, offset):
    /// see [`Durable::written_so_far`] and [`Durable::unlogged_dead_letters`].
    pub fn checkpoint(
        &self,
        written: impl FnOnce() -> Option<Vec<(Vec<u8>, u64)>>,
    ) -> Result<bool, LogError> {
        self.expire(Instant::now());
        let mut saved = lock(&self.saved);
        if self.unchanged(&saved) {
            return Ok(false);
        }
        let mut now = self.snapshot();
        if now.unread > 0 {
            debug!(consumers = now.unread, "durable consumers: messages kept moving while their positions were read; their saved positions stay until the next checkpoint");
        }
        // A position read past a dead-lettered message is saved only once the log is done with
        // its dead letter: until then the saved one stays (a crash delivers the message again
        // rather than losing it). One whose dead letter a failed write lost is saved no further
        // than that message.
        if saved.positions != now.all {
            let Some(unlogged) = written() else {
                return Ok(false);
            };
            for p in now.all.values_mut() {
                for (topic, offset) in &unlogged {
                    if let Some(next) = p.next.get_mut(topic) {
                        *next = (*next).min(*offset);
                    }
                }
            }
        }
        if saved.positions != now.all {
            saved.file_bytes = self.store.save(&now.all)?;
            saved.positions = now.all;
            *lock(&self.saved_groups) = groups_of(&saved.positions);
        }
        // What the saved positions were made of, for the next checkpoint to compare with —
        // unless consumers came or went meanwhile (then it reads them all again).
        let mut t = lock(&self.table);
        // Each consumer read that is still the same subscription falls back on what was saved
        // for it now, whatever came and went meanwhile (others' claims and ends would otherwise
        // keep a long-lived consumer's fallback at its claim).
        for (key, fed) in &now.feds {
            let Some(live) = t.live.get_mut(key) else {
                continue;
            };
            if let (true, Some(position)) = (Arc::ptr_eq(&live.fed, fed), saved.positions.get(key))
            {
                live.safe = position.clone();
            }
        }
        if t.changes == now.changes {
            for (key, sig) in now.sigs {
                if let Some(live) = t.live.get_mut(&key) {
                    live.saved_as = Some(sig);
                }
            }
            saved.changes = now.changes;
        }
        Ok(true)
    }
}

/// Durable groups' positions: by group id, per topic the next offset to deliver.
pub(crate) type GroupPositions = Vec<(String, BTreeMap<Vec<u8>, u64>)>;

/// The durable groups' positions among `positions`, by group id.
fn groups_of(positions: &Positions) -> GroupPositions {
    positions
        .iter()
        .filter_map(|(key, p)| {
            let group = key.strip_prefix("group:")?;
            Some((group.to_string(), p.next.clone()))
        })
        .collect()
}

/// The positions as last saved, and the table's [`changes`](Table::changes) then.
#[derive(Debug, Default)]
struct Saved {
    positions: Positions,
    changes: u64,
    /// The size of the file written last.
    file_bytes: usize,
}

/// What [`Consumers::snapshot`] read.
struct Snapshot {
    all: Positions,
    /// Live consumers whose position could not be read settled.
    unread: usize,
    /// What the others' positions were made of.
    sigs: Vec<(String, Sig)>,
    /// Each live consumer read, by its feeder's shared state (which tells the same
    /// subscription from one that claimed the id since).
    feds: Vec<(String, SharedFed)>,
    changes: u64,
}

/// How fast the positions file may be rewritten, in bytes per second: a large table (a
/// wildcard consumer behind in 100,000 topics holds ~2 MB of positions) is saved less often
/// than every [`CHECKPOINT_EVERY`], not five times a second, each time written whole and
/// synced. A position saved late means messages delivered again after a crash, never lost.
const SAVE_BYTES_PER_SEC: usize = 4 << 20;

/// What a checkpoint asks the log before it saves (see [`Consumers::checkpoint`]): `None` if the
/// writer is not done, within `within`, with the dead letters queued before; else the messages
/// whose dead letters a failed write lost.
pub(crate) fn log_done(d: &Durable, within: Duration) -> Option<Vec<(Vec<u8>, u64)>> {
    if !d.written_so_far(within) {
        warn!("durable consumers: positions not saved: the log has not written the dead letters queued before them within {within:?}; the saved positions stay, so what moved since is delivered again after a crash");
        return None;
    }
    Some(d.unlogged_dead_letters())
}

/// How long a checkpoint waits for the log to write what was queued before it (dead letters of
/// settled messages among it) before it gives up saving this time.
const WRITTEN_WAIT: Duration = Duration::from_secs(10);

/// How long after saving a positions file of `bytes` the next periodic save waits, at least.
fn pause_after_save(bytes: usize) -> Duration {
    Duration::from_secs_f64(bytes as f64 / SAVE_BYTES_PER_SEC as f64).max(CHECKPOINT_EVERY)
}

/// How long a rewind, or a consumer's end, waits for a read of its places that no move
/// overlapped (then it falls back on the consumer's last saved position). It blocks the
/// thread, an async task's, holding the consumer table: short.
const REWIND_PATIENCE: Duration = Duration::from_millis(20);

/// How long a periodic save waits for such a read before it keeps the position saved before
/// (it holds the consumer table meanwhile, so briefly: a move is short and never waits).
const SAVE_PATIENCE: Duration = Duration::from_millis(1);

/// The topics of `ends` that `next` has a position in (`below_end`: only those whose position
/// is below the topic's end).
fn positioned(
    ends: &HashMap<Box<[u8]>, u64>,
    next: &BTreeMap<Vec<u8>, u64>,
    below_end: bool,
) -> Vec<Box<[u8]>> {
    let counts = |n: u64, end: u64| !below_end || n < end;
    if next.len() < ends.len() {
        next.iter()
            .filter(|(t, n)| ends.get(t.as_slice()).is_some_and(|end| counts(**n, *end)))
            .map(|(t, _)| Box::from(t.as_slice()))
            .collect()
    } else {
        ends.iter()
            .filter(|(t, end)| next.get(&***t).is_some_and(|n| counts(*n, **end)))
            .map(|(t, _)| t.clone())
            .collect()
    }
}

/// A live consumer's position, read while none of its messages was on its way from one of its
/// places to another (a NACK's, an ack-wait timeout's or a leaving member's), for up to
/// `patience` (see [`Moves::read_settled_within`]): `None` if moves overlapped every read.
fn position_of(live: &Live, patience: Duration) -> Option<(ConsumerPosition, Sig)> {
    match moves_of(live) {
        Some(moves) => moves.read_settled_within(|| read_position(live), patience),
        None => Some(read_position(live)),
    }
}

/// The moves among a live consumer's places: its group's, or its subscription's.
fn moves_of(live: &Live) -> Option<&Moves> {
    match &live.group {
        Some(g) => Some(g.moves()),
        None => live.members.first().map(|m| m.moves()),
    }
}

/// A live consumer's position: per topic, the lowest offset any of its subscriptions has
/// queued or unsettled, else the feeder's next.
fn read_position(live: &Live) -> (ConsumerPosition, Sig) {
    let fed = lock(&live.fed);
    let sig = sig_of(live, &fed);
    let next = floor(&fed.next, sig.1.clone());
    let position = ConsumerPosition {
        filter: live.filter.clone(),
        next,
    };
    (position, sig)
}

/// What `live`'s position is made of (see [`Sig`]); `fed` is its feeder's, locked.
fn sig_of(live: &Live, fed: &Fed) -> Sig {
    let mut held = Vec::new();
    for m in &live.members {
        held.extend(m.unsettled_floor());
    }
    if let Some(g) = &live.group {
        held.extend(g.parked_floor());
    }
    held.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()).then(a.1.cmp(&b.1)));
    (fed.version, held)
}

/// `fed`, lowered to `floors` where they are lower.
fn floor(fed: &BTreeMap<Vec<u8>, u64>, floors: Vec<(TopicName, u64)>) -> BTreeMap<Vec<u8>, u64> {
    let mut next = fed.clone();
    for (topic, floor) in floors {
        let entry = next.entry(topic.as_bytes().to_vec()).or_insert(floor);
        *entry = (*entry).min(floor);
    }
    next
}

/// Save positions every [`CHECKPOINT_EVERY`] (a large table less often: [`pause_after_save`])
/// until `stop` (then once more).
pub(crate) async fn checkpointer(
    consumers: Arc<Consumers>,
    durable: Arc<Durable>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // No periodic save before this (a large table is saved less often).
    let mut due = Instant::now();
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        if !stopping && Instant::now() < due {
            continue;
        }
        let (c, d) = (consumers.clone(), durable.clone());
        let written = move || log_done(&d, WRITTEN_WAIT);
        match tokio::task::spawn_blocking(move || (c.checkpoint(written), c.saved_file_bytes()))
            .await
        {
            Ok((Ok(true), bytes)) => due = Instant::now() + pause_after_save(bytes),
            Ok((Ok(false), _)) => {}
            Ok((Err(e), _)) => warn!("durable consumers: saving positions failed: {e}"),
            Err(e) => warn!("durable consumers: checkpoint task failed: {e}"),
        }
        if stopping {
            return;
        }
    }
}

/// Where a new consumer that starts at `latest` begins in each topic matching `filter` that
/// exists now — the broker's topics (also those whose messages the log has not written yet) and
/// the log's: past every message published before its SUBSCRIBE. Taken while the SUBSCRIBE is
/// handled, before its CONFIRM, so a message published after it is never skipped; a topic that
/// appears later is read from its first message.
pub(crate) fn latest_positions(
    durable: &Durable,
    broker: &Broker,
    filter: &TopicFilter,
) -> BTreeMap<Vec<u8>, u64> {
    let mut at = BTreeMap::new();
    for t in broker.topics() {
        if matching::matches(filter, t.name()) {
            at.insert(t.name().as_bytes().to_vec(), t.next_offset());
        }
    }
    // A topic the broker does not hold (evicted, or not published to since a restart): where
    // its next message will be numbered, even if retention left none of its messages.
    for t in durable.topics_from(TopicsSeen::default()).0 {
        if !at.contains_key(&t) && topic_matches(filter, &t) {
            let next = durable.next_offset(&t);
            at.insert(t, next);
        }
    }
    at
}

/// Where a consumer starts in a topic it has no position for.
fn start_in(durable: &Durable, topic: &[u8], start: DurableStart, discovered: bool) -> u64 {
    let first = durable.index.first_offset(topic).unwrap_or(0);
    match start {
        // A topic that appears after the consumer started: all of it. A `latest` consumer's
        // positions in the topics that existed were given at its SUBSCRIBE
        // (`latest_positions`): any other topic appeared after it.
        _ if discovered => first,
        DurableStart::Earliest | DurableStart::Latest => first,
        DurableStart::Offset(n) => n.max(first),
    }
}

fn topic_matches(filter: &TopicFilter, topic: &[u8]) -> bool {
    std::str::from_utf8(topic)
        .ok()
        .and_then(|s| TopicName::try_from(s).ok())
        .is_some_and(|name| matching::matches(filter, &name))
}

/// Who a feeder feeds.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// A durable consumer's one subscription.
    One(Arc<Subscriber>),
    /// A durable group: each message to one member (the next with room), waiting while it has
    /// none; woken by `joined`.
    Group(Arc<GroupShared>, Arc<tokio::sync::Notify>),
}

/// Feed a durable consumer or group from the log until it is stopped (its last subscription
/// ended). `resumed`: it has a stored position.
pub(crate) async fn feed(
    durable: Arc<Durable>,
    broker: Arc<Broker>,
    target: Target,
    fed: SharedFed,
    start: DurableStart,
    resumed: bool,
) {
    let filter = match &target {
        Target::One(sub) => sub.filter().clone(),
        Target::Group(g, _) => g.filter().clone(),
    };
    let mut ctx = PublishContext::default();
    // Where this feeder is in the log's list of topics, and in its writes.
    let mut topics_seen = TopicsSeen::default();
    let mut writes_seen = None;
    // Topics that may have something to read: those the log's writes changed since, and those
    // not read to the end yet. The rest are not looked at (a wildcard consumer of many topics
    // would otherwise look up every one of them at every write of the log).
    let mut pending: BTreeSet<Vec<u8>> = BTreeSet::new();
    let mut first_pass = true;
    // Topics whose last read failed, and when to read them again.
    let mut retry_at: HashMap<Vec<u8>, Instant> = HashMap::new();
    // Failed reads and retention overtaking this consumer are warned about at most once a
    // minute each (a read that fails for good is retried every second; a wildcard consumer may
    // meet either in thousands of topics at once); the others are logged at debug level and
    // counted in the next warning.
    let mut read_warnings = Warnings::new(READ_WARN_EVERY);
    let mut overtaken_warnings = Warnings::new(READ_WARN_EVERY);
    // Topics whose position was set here while the log held none of their messages (all
    // deleted, or refused): their next messages may come at any offset above it, so a
    // position below the topic's oldest message is no sign of retention overtaking it.
    let mut unanchored: BTreeSet<Vec<u8>> = BTreeSet::new();
    // How many times the log's forgetting took positions out (`Fed::forgotten`) when this
    // feeder last looked.
    let mut forgotten_seen = 0;
    loop {
        let progress = durable.progress.notified();
        tokio::pin!(progress);
        progress.as_mut().enable();
        if lock(&fed).stopped || matches!(&target, Target::One(sub) if sub.is_closed()) {
            return;
        }
        // Topics matching the filter that the consumer has no position for yet: those the log
        // has had since this feeder last looked (a topic whose data retention deleted, or
        // whose first writes were refused, is one too: its next messages must not be missed).
        let (new_topics, seen) = durable.topics_from(topics_seen);
        topics_seen = seen;
        if !new_topics.is_empty() || first_pass {
            let mut fed_now = lock(&fed);
            for t in new_topics {
                if topic_matches(&filter, &t) && !fed_now.next.contains_key(&t) {
                    // A consumer that resumes reads topics it has no position for from their
                    // start: they appeared after it started. So does one that starts at
                    // `latest`: its positions in the topics that existed were taken when it
                    // subscribed (`latest_positions`).
                    let discovered =
                        resumed || !first_pass || matches!(start, DurableStart::Latest);
                    let at = start_in(&durable, &t, start, discovered);
                    if durable.index.first_offset(&t).is_none() {
                        unanchored.insert(t.clone());
                    }
                    fed_now.set(&t, at);
                    pending.insert(t);
                }
            }
            first_pass = false;
        }
        // The topics the log's writes changed since this feeder last looked (all of them the
        // first time, or after falling too far behind). Only topics the filter matches: a
        // stored position may hold others (the consumer subscribed with another filter
        // before); they stay stored, unread.
        let (changed, writes) = durable.changed_since(writes_seen);
        writes_seen = Some(writes);
        {
            let f = lock(&fed);
            if f.forgotten != forgotten_seen {
                // Topics the log forgot: nothing kept about them here either (they are found
                // again as new ones when they are logged again).
                forgotten_seen = f.forgotten;
                let known = |t: &Vec<u8>| f.next.contains_key(t);
                pending.retain(known);
                unanchored.retain(known);
                retry_at.retain(|t, _| known(t));
            }
            match changed {
                Some(changed) => pending.extend(
                    changed
                        .into_iter()
                        .filter(|t| f.next.contains_key(t) && topic_matches(&filter, t)),
                ),
                None => {
                    pending.extend(f.next.keys().filter(|t| topic_matches(&filter, t)).cloned())
                }
            }
        }
        let topics: Vec<(Vec<u8>, u64)> = {
            let f = lock(&fed);
            pending
                .iter()
                .filter_map(|t| f.next.get(t).map(|o| (t.clone(), *o)))
                .collect()
        };
        let mut moved = false;
        // What to read: (topic, from, up to), with its reader.
        let mut reads = Vec::new();
        for (topic, from) in topics {
            if let Some(at) = retry_at.get(&topic) {
                if Instant::now() < *at {
                    continue;
                }
                retry_at.remove(&topic);
            }
            // Nothing new and durable in the log for this topic: no read at all, and none
            // until a write changes it.
            let Some(bound) = durable.durable_next(&topic).filter(|next| *next > from) else {
                pending.remove(&topic);
                continue;
            };
            // Retention deleted messages of the topic this consumer had not read yet (it does
            // not wait for consumers): said, counted, and read on from the oldest one kept — or,
            // if it deleted every one below `bound`, from `bound` (there is nothing to read:
            // left where it was, the topic would be read again at every write, for good, and
            // never read to its end). Not for a topic found with none of its messages left
            // (`unanchored`): nothing was deleted under this consumer there.
            let first = durable.index.first_offset(&topic);
            let anchored = !unanchored.contains(&topic);
            let gone_to = match first {
                Some(first) if first > from && anchored => Some(first),
                None => Some(bound),
                Some(_) => None,
            };
            let from = match gone_to {
                Some(at) => {
                    let mut f = lock(&fed);
                    if f.stopped {
                        return;
                    }
                    if f.next.get(&topic) != Some(&from) {
                        // Its position went with the topic (the log forgot it) since this
                        // feeder looked: found again as a new topic when it is logged again.
                        pending.remove(&topic);
                        continue;
                    }
                    if anchored {
                        durable
                            .stats
                            .consumers_overtaken
                            .fetch_add(1, Ordering::Relaxed);
                        let last = at - 1;
                        log_warning(
                            &mut overtaken_warnings,
                            &String::from_utf8_lossy(&topic),
                            &filter,
                            "topics overtaken",
                            format_args!("retention deleted messages it had not read (offsets {from} to {last}); it goes on from offset {at}"),
                        );
                    }
                    f.set(&topic, at);
                    if first.is_none() {
                        drop(f);
                        unanchored.remove(&topic);
                        pending.remove(&topic);
                        continue;
                    }
                    at
                }
                None => from,
            };
            unanchored.remove(&topic);
            reads.push((topic, from, bound));
        }
        // In the order of the log, a few topics per read, through one cache of the batches read
        // last: topics whose messages share batches (a client publishing to many topics at
        // once) are read together, each batch read and decrypted once, not once per topic.
        // Last first: taken from the end. Where each starts may take reading a sealed
        // segment's index file: not on this thread, and segment by segment, so that each
        // index is read once (the log keeps only the last few).
        let index = durable.index.clone();
        let mut reads = if reads.is_empty() {
            Vec::new()
        } else {
            tokio::task::spawn_blocking(move || {
                let mut reads: Vec<_> = reads
                    .into_iter()
                    .map(|(topic, from, bound)| {
                        (index.first_segment(&topic, from), topic, from, bound)
                    })
                    .collect();
                reads.sort_unstable_by_key(|r| r.0);
                let mut reads: Vec<_> = reads
                    .into_iter()
                    .map(|(_, topic, from, bound)| {
                        (index.position(&topic, from), topic, from, bound)
                    })
                    .collect();
                reads.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
                reads
            })
            .await
            .unwrap_or_default()
        };
        let mut cache = aqueduct_log::ReadCache::default();
        while !reads.is_empty() {
            let chunk = reads.split_off(reads.len().saturating_sub(READ_TOPICS));
            let index = durable.index.clone();
            let (read, left, back) = tokio::task::spawn_blocking(move || {
                let (read, left) = read_topics(&index, chunk, &mut cache);
                // No segment file kept open while what was read is queued (retention may
                // delete it meanwhile).
                cache.close_file();
                (read, left, cache)
            })
            .await
            .unwrap_or_default();
            cache = back;
            reads.extend(left);
            for Read {
                topic,
                from,
                bound,
                records: read,
                complete,
            } in read
            {
                let Ok(name) = TopicName::try_from(String::from_utf8_lossy(&topic).as_ref()) else {
                    continue;
                };
                let mut skipped = false;
                // Left before all of it was queued.
                let mut stalled = false;
                for r in read {
                    let r = match r {
                        Ok(r) => r,
                        Err(e) if read_again(&e) => {
                            // A read that failed (out of file descriptors, permissions, an I/O
                            // error): nothing is skipped; the same position is read again later.
                            log_warning(
                                &mut read_warnings,
                                &name,
                                &filter,
                                "failed reads",
                                format_args!("cannot read the log, trying again every {READ_RETRY:?} (nothing after this point is delivered until it can be read): {e}"),
                            );
                            durable.stats.read_errors.fetch_add(1, Ordering::Relaxed);
                            retry_at.insert(topic.clone(), Instant::now() + READ_RETRY);
                            stalled = true;
                            break;
                        }
                        Err(e) => {
                            // Damage since it was indexed, or a segment retention deleted since:
                            // skipped, the reader goes on with what follows it. Warned about as
                            // above.
                            log_warning(
                                &mut read_warnings,
                                &name,
                                &filter,
                                "failed reads",
                                format_args!("cannot read part of the log, skipping it: {e}"),
                            );
                            durable.stats.read_skips.fetch_add(1, Ordering::Relaxed);
                            skipped = true;
                            continue;
                        }
                    };
                    let Some(m) = StoredMessage::decode(&r.data) else {
                        warn!(topic = %name, offset = r.offset, "durable consumer: a record that is not a message; skipped");
                        let mut f = lock(&fed);
                        if f.stopped {
                            return;
                        }
                        f.set(&topic, r.offset.saturating_add(1));
                        continue;
                    };
                    let info = m.dead_letter.as_ref().map(|d| DeadLetter {
                        original_topic: &d.original_topic,
                        original_offset: d.original_offset,
                        attempts_made: d.attempts_made,
                        reason: &d.reason,
                    });
                    let mut p = Publication::new(&name, &m.body);
                    if let Some(info) = &info {
                        p = p.with_dead_letter(info);
                    }
                    p.priority = m.priority;
                    p.ttl = m.ttl_ms.map(|ms| Duration::from_millis(u64::from(ms)));
                    p.trace = m.trace.as_ref();
                    p.compression = m.compression.as_ref();
                    let age = SystemTime::now()
                        .duration_since(
                            SystemTime::UNIX_EPOCH + Duration::from_millis(r.timestamp_ms),
                        )
                        .unwrap_or_default();
                    let member = match &target {
                        Target::One(sub) => sub.clone(),
                        Target::Group(g, joined) => {
                            match broker.group_member_with_room(g, FEED_AHEAD) {
                                Ok(m) => m,
                                Err(members) => {
                                    // No member can take a message now (or there is none): wait until
                                    // any one can, or a member joins, or this feeder is stopped; then read
                                    // on from the same position.
                                    let woken = joined.notified();
                                    tokio::pin!(woken);
                                    woken.as_mut().enable();
                                    let max = broker.config().max_in_flight;
                                    let room = std::future::poll_fn(|cx| {
                                        // Registers with every member, so room in any of them wakes us.
                                        let mut ready = false;
                                        for m in &members {
                                            ready |=
                                                m.poll_can_take(cx, max, FEED_AHEAD).is_ready();
                                        }
                                        if ready {
                                            std::task::Poll::Ready(())
                                        } else {
                                            std::task::Poll::Pending
                                        }
                                    });
                                    if !lock(&fed).stopped {
                                        tokio::select! {
                                            _ = room, if !members.is_empty() => {}
                                            _ = woken => {}
                                        }
                                    }
                                    moved = true;
                                    stalled = true;
                                    break;
                                }
                            }
                        }
                    };
                    {
                        // Queue and advance under the lock a rewind takes: never one without the
                        // other.
                        let mut f = lock(&fed);
                        if f.stopped {
                            return;
                        }
                        if !broker.feed(&mut ctx, &member, &name, r.offset, &p, age, Instant::now())
                        {
                            match &target {
                                Target::One(_) => return, // closed
                                // The member left between the pick and the feed: this message goes
                                // to another one, from the same position, right away.
                                Target::Group(..) => {
                                    moved = true;
                                    stalled = true;
                                    break;
                                }
                            }
                        }
                        f.set(&topic, r.offset.saturating_add(1));
                    }
                    moved = true;
                    if let Target::One(sub) = &target {
                        // Its queue is full: wait until it has drained (or is closed).
                        std::future::poll_fn(|cx| sub.poll_room(cx)).await;
                    }
                }
                // Damage with nothing readable after it yet: the position did not move, and a read
                // at every write of the log (to any topic) would only meet it again. Read again a
                // second from now, or once the log has moved on and the time has come.
                if skipped && lock(&fed).next.get(&topic) == Some(&from) {
                    retry_at.insert(topic.clone(), Instant::now() + READ_RETRY);
                }
                if complete && !skipped && !stalled {
                    // Read cleanly to `bound` and all of it queued: no message of the topic
                    // below `bound` is left (the gap after a crash, or offsets whose writes
                    // failed), so its position goes there; left below, the topic would be read
                    // again at every write, and never count as read to its end.
                    let mut f = lock(&fed);
                    if f.stopped {
                        return;
                    }
                    if f.next.get(&topic).is_some_and(|n| *n < bound) {
                        f.set(&topic, bound);
                    }
                }
            }
        }
        if !moved {
            match retry_at.values().min() {
                // A topic to read again: at its time, or sooner when the log moves on.
                Some(at) => {
                    let at = tokio::time::Instant::from_std(*at);
                    let _ = tokio::time::timeout_at(at, progress).await;
                }
                None => {
                    debug!(filter = %filter, "durable consumer caught up; waiting for the log");
                    progress.await;
                }
            }
        }
    }
}

/// What a feeder read of one topic.
#[derive(Debug)]
struct Read {
    topic: Vec<u8>,
    from: u64,
    /// Where its durable messages end (it read no further).
    bound: u64,
    records: Vec<Result<aqueduct_log::Record, LogError>>,
    /// It read to `bound` (or the log's end): not cut short by [`READ_BATCH`] or [`READ_BYTES`].
    complete: bool,
}

/// Read the topics of `chunk` ((where it starts in the log, topic, from, bound), in reverse
/// order: the last first) through `cache`, up to [`READ_BATCH`] messages of each and
/// [`READ_BYTES`] in all. Returns what was read, in the log's order, and the topics left
/// unread (in `chunk`'s order).
#[allow(clippy::type_complexity)]
fn read_topics(
    index: &aqueduct_log::LogIndex,
    mut chunk: Vec<(Option<(u64, u64)>, Vec<u8>, u64, u64)>,
    cache: &mut aqueduct_log::ReadCache,
) -> (Vec<Read>, Vec<(Option<(u64, u64)>, Vec<u8>, u64, u64)>) {
    let mut read = Vec::new();
    let mut bytes = 0;
    while bytes < READ_BYTES {
        let Some((_, topic, from, bound)) = chunk.pop() else {
            break;
        };
        let mut reader = index.read(&topic, from);
        let mut records = Vec::new();
        let complete = loop {
            if records.len() >= READ_BATCH || bytes >= READ_BYTES {
                break false;
            }
            match reader.next_with(cache) {
                None => break true,
                // Up to what is durable: a batch written but not yet synced is not the
                // consumer's yet.
                Some(Ok(r)) if r.offset >= bound => break true,
                Some(r) => {
                    bytes += r.as_ref().map_or(0, |r| r.data.len());
                    records.push(r);
                }
            }
        };
        // Retention may have deleted what the reader was to read since `bound` was taken (a
        // slow consumer's next chunk is read seconds later): then it is not read to `bound`,
        // and the feeder's next look tells the consumer it was overtaken.
        let complete = complete
            && index
                .first_offset(&topic)
                .is_some_and(|first| first <= from);
        read.push(Read {
            topic,
            from,
            bound,
            records,
            complete,
        });
    }
    (read, chunk)
}

/// How long a durable consumer waits before reading again where a read of the log failed.
const READ_RETRY: Duration = Duration::from_secs(1);
/// A feeder warns about failed reads, and about retention overtaking it, at most this often.
const READ_WARN_EVERY: Duration = Duration::from_secs(60);

/// Warnings of one kind from one feeder: one every [`READ_WARN_EVERY`] at most.
type Warnings = WarnEvery<()>;

/// Log `message` about `topic` as a warning if one is due in `warnings` (saying how many
/// `held` were held back since the last), else at debug level.
fn log_warning(
    warnings: &mut Warnings,
    topic: &dyn std::fmt::Display,
    filter: &dyn std::fmt::Display,
    held: &str,
    message: std::fmt::Arguments<'_>,
) {
    match warnings.due((), (), Instant::now()) {
        Some(more) => {
            let more = held_back(more, held);
            warn!(topic = %topic, filter = %filter, "durable consumer: {message}{more}")
        }
        None => debug!(topic = %topic, filter = %filter, "durable consumer: {message}"),
    }
}

/// Whether a failed read of the log is tried again rather than skipped: any I/O error but a
/// segment that no longer exists (retention deleted it after the reader was planned; what it
/// held is gone for good) or one shorter than its index says (cut since: damage). Damage is
/// skipped too: reading it again would fail the same way.
fn read_again(e: &LogError) -> bool {
    use std::io::ErrorKind::{NotFound, UnexpectedEof};
    matches!(e, LogError::Io { cause, .. } if !matches!(cause.kind(), NotFound | UnexpectedEof))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::{Durable, CRASH_OFFSET_GAP};
    use aqueduct_core::{BrokerConfig, SubscribeOptions};
    use aqueduct_log::{FsyncMode, Log, LogOptions};
    use aqueduct_proto::SubscribeSpec;

    fn log_options() -> LogOptions {
        LogOptions {
            allow_plaintext: true,
            crash_offset_gap: CRASH_OFFSET_GAP,
            ..LogOptions::default()
        }
    }

    /// Log options with 1 KiB segments (a few batches each), and a durable log started on
    /// them in `dir`.
    fn small_segments(dir: &std::path::Path) -> (LogOptions, Arc<Durable>) {
        let small = LogOptions {
            max_segment_bytes: 1024,
            ..log_options()
        };
        let (log, rec) = Log::open(dir, small.clone()).expect("log opens");
        let durable = Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts");
        (small, durable)
    }

    fn broker() -> Arc<Broker> {
        Arc::new(Broker::new(BrokerConfig {
            queue_size: 100_000,
            ..BrokerConfig::default()
        }))
    }

    /// Publish `offset` of `topic` and queue it for the log, as a client's publish is.
    fn write(broker: &Broker, durable: &Durable, topic: &TopicName, offset: u64) {
        let mut ctx = PublishContext::default();
        broker.publish(&mut ctx, &Publication::new(topic, b"x"), Instant::now());
        let state = broker.topic(topic).expect("created");
        let _order = lock(&durable.order);
        durable.queue_copies(std::iter::once((
            (state, offset),
            Publication::new(topic, b"x"),
        )));
    }

    /// Offsets `0..n` of `topic`, each written as a batch of its own and waited for until it
    /// is durable (a log with small segments then spreads them over several).
    async fn write_durably(broker: &Broker, durable: &Durable, topic: &str, n: u64) {
        let name = TopicName::try_from(topic).expect("valid");
        for offset in 0..n {
            write(broker, durable, &name, offset);
            let deadline = Instant::now() + Duration::from_secs(30);
            while durable.durable_next(topic.as_bytes()) != Some(offset + 1) {
                assert!(Instant::now() < deadline, "{topic} {offset} never durable");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// A consumer of `filter` from the earliest message, and its feeder (aborted when the set
    /// is dropped, also if an assertion fails first).
    fn feeding(
        durable: &Arc<Durable>,
        broker: &Arc<Broker>,
        filter: &str,
        fed: &SharedFed,
        resumed: bool,
    ) -> (Arc<Subscriber>, tokio::task::JoinSet<()>) {
        let sub = broker.subscribe_unrouted(
            &SubscribeSpec::new(TopicFilter::try_from(filter).expect("filter")),
            SubscribeOptions::default(),
        );
        let mut feeder = tokio::task::JoinSet::new();
        feeder.spawn(feed(
            durable.clone(),
            broker.clone(),
            Target::One(sub.clone()),
            fed.clone(),
            DurableStart::Earliest,
            resumed,
        ));
        (sub, feeder)
    }

    /// Wait (up to 30 s) until `sub` has `n` messages queued.
    async fn queued(sub: &Subscriber, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while sub.queued() < n {
            assert!(Instant::now() < deadline, "{} of {n} fed", sub.queued());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A passing read error is read again; a segment gone, one cut short and damage are
    /// skipped (reading them again would fail the same way).
    #[test]
    fn only_passing_read_errors_are_tried_again() {
        use std::io::ErrorKind;
        let io = |kind: ErrorKind| LogError::Io {
            action: "reading segment",
            path: "00000000000000000001.seg".into(),
            cause: std::io::Error::from(kind),
        };
        assert!(read_again(&io(ErrorKind::PermissionDenied)));
        assert!(read_again(&io(ErrorKind::Other)));
        assert!(!read_again(&io(ErrorKind::NotFound)));
        assert!(!read_again(&io(ErrorKind::UnexpectedEof)));
        assert!(!read_again(&LogError::Damaged {
            path: "00000000000000000001.seg".into(),
            position: 96,
            reason: "the batch's checksum fails".into(),
        }));
    }

    /// A caught-up wildcard consumer looks, at each write of the log, only at the topics that
    /// write changed: before, it looked up its position in every topic it matches (here 2,000)
    /// at every write, so its cost grew with the number of topics the log had ever seen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caught_up_wildcard_consumer_looks_only_at_changed_topics() {
        const TOPICS: usize = 2_000;
        const WRITES: u64 = 50;
        let dir = tempfile::tempdir().expect("temp dir");
        let (log, rec) = Log::open(dir.path(), log_options()).expect("log opens");
        let durable = Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts");
        let broker = broker();
        let names: Vec<TopicName> = (0..TOPICS)
            .map(|i| TopicName::try_from(format!("s/{i}").as_str()).expect("valid"))
            .collect();
        for t in &names {
            write(&broker, &durable, t, 0);
        }
        let fed = SharedFed::default();
        let (sub, feeder) = feeding(&durable, &broker, "s/#", &fed, false);
        queued(&sub, TOPICS).await;
        let before = durable.lookups.load(Ordering::Relaxed);
        for offset in 1..=WRITES {
            write(&broker, &durable, &names[0], offset);
            queued(&sub, TOPICS + offset as usize).await;
        }
        // The feeder may still have been on its pass after catching up (which finds every
        // topic read to the end and then leaves them alone): at most one look at each topic,
        // then a few per write.
        let looked = durable.lookups.load(Ordering::Relaxed) - before;
        assert!(
            looked <= TOPICS as u64 + 4 * WRITES,
            "{looked} lookups for {WRITES} writes to one topic"
        );
        drop(feeder);
        durable.close();
    }

    /// A durable log in `dir` that held offsets `0..n` of `t`, then enough of `u` that
    /// retention (applied at its restart) deleted every segment `t` was in.
    async fn emptied_by_retention(dir: &std::path::Path, n: u64) -> Arc<Durable> {
        let (small, durable) = small_segments(dir);
        let first_broker = broker();
        write_durably(&first_broker, &durable, "t", n).await;
        write_durably(&first_broker, &durable, "u", 4 * n).await;
        durable.close();
        let retained = LogOptions {
            retention_bytes: Some(2048),
            ..small
        };
        let (mut log, rec) = Log::open(dir, retained).expect("log opens");
        log.enforce_retention(std::time::SystemTime::now())
            .expect("retention");
        assert_eq!(log.first_offset(b"t"), None, "all of t deleted");
        Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts")
    }

    /// A new `latest` consumer's position in a topic the broker does not hold and whose
    /// messages retention deleted is where its next message will be numbered: not 0, which
    /// its next message would later look like retention overtaking it (counted and warned).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_latest_position_in_a_topic_retention_emptied_is_its_next_offset() {
        const N: u64 = 20;
        let dir = tempfile::tempdir().expect("temp dir");
        let durable = emptied_by_retention(dir.path(), N).await;
        let filter = TopicFilter::try_from("t").expect("filter");
        assert_eq!(
            latest_positions(&durable, &broker(), &filter),
            BTreeMap::from([(b"t".to_vec(), N)])
        );
        durable.close();
    }

    /// A durable consumer whose position retention overtook (its stored position is below the
    /// oldest message of the topic still in the log) is told about: counted and warned, and it
    /// goes on from the oldest message kept. It went on silently.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_consumer_that_retention_overtook_is_counted() {
        const N: u64 = 60;
        let dir = tempfile::tempdir().expect("temp dir");
        let (small, durable) = small_segments(dir.path());
        let first_broker = broker();
        // One batch each (the log's segments hold a few each).
        write_durably(&first_broker, &durable, "t", N).await;
        durable.close();
        // Restarted with a retention limit, which deletes the oldest segments.
        let retained = LogOptions {
            retention_bytes: Some(2048),
            ..small
        };
        let (mut log, rec) = Log::open(dir.path(), retained).expect("log opens");
        let deleted = log
            .enforce_retention(std::time::SystemTime::now())
            .expect("retention");
        assert!(!deleted.is_empty(), "retention deleted segments");
        let first = log.first_offset(b"t").expect("some kept");
        assert!(first > 0 && first < N, "{first}");
        let durable = Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts");
        let broker = broker();
        // The consumer's stored position: offset 0, long deleted.
        let fed = SharedFed::default();
        lock(&fed).next.insert(b"t".to_vec(), 0);
        let (sub, feeder) = feeding(&durable, &broker, "t", &fed, true);
        queued(&sub, (N - first) as usize).await;
        assert_eq!(durable.stats.consumers_overtaken.load(Ordering::Relaxed), 1);
        assert_eq!(lock(&fed).next.get(&b"t"[..]), Some(&N));
        drop(feeder);
        durable.close();
    }

    /// A consumer whose every unread message of a topic retention deleted (the log has none
    /// of the topic left) is told about too, and moves to the topic's end. Before, its
    /// position stayed where it was: nothing was counted, the topic was read again at every
    /// write of the log, for good, and the consumer never read it to its end (so the log could
    /// never forget it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_consumer_whose_unread_messages_retention_all_deleted_moves_to_the_end() {
        const N: u64 = 20;
        let dir = tempfile::tempdir().expect("temp dir");
        let durable = emptied_by_retention(dir.path(), N).await;
        // A read of what retention deleted since it was planned finds nothing, and is not
        // taken for a read to its end (which would move the position there uncounted).
        let (read, left) = read_topics(
            &durable.index,
            vec![(None, b"t".to_vec(), 3, N)],
            &mut aqueduct_log::ReadCache::default(),
        );
        assert!(left.is_empty());
        assert!(read[0].records.is_empty());
        assert!(!read[0].complete);
        // Its stored position: offset 3 of `t`.
        let fed = SharedFed::default();
        lock(&fed).next.insert(b"t".to_vec(), 3);
        let (_sub, feeder) = feeding(&durable, &broker(), "t", &fed, true);
        let deadline = Instant::now() + Duration::from_secs(30);
        while lock(&fed).next.get(&b"t"[..]) != Some(&N) {
            assert!(Instant::now() < deadline, "never moved to the end");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(durable.stats.consumers_overtaken.load(Ordering::Relaxed), 1);
        drop(feeder);
        durable.close();
    }

    /// Consumers in a temporary directory, a broker that redelivers forever, and the topic
    /// `jobs`.
    fn redelivering() -> (tempfile::TempDir, Consumers, Arc<Broker>, TopicName) {
        let dir = tempfile::tempdir().expect("tempdir");
        let consumers = Consumers::open(dir.path(), ConsumerLimits::default()).expect("open");
        let broker = Arc::new(Broker::new(BrokerConfig {
            max_retries: u32::MAX,
            ..BrokerConfig::default()
        }));
        (
            dir,
            consumers,
            broker,
            TopicName::try_from("jobs").expect("valid"),
        )
    }

    /// Queue the message at `offset` of `topic` for `sub` and write it (unsettled now).
    fn hand_out(broker: &Broker, sub: &Arc<Subscriber>, topic: &TopicName, offset: u64) {
        let p = Publication::new(topic, b"x");
        let now = Instant::now();
        let mut ctx = PublishContext::default();
        assert!(broker.feed(&mut ctx, sub, topic, offset, &p, Duration::ZERO, now));
        broker.drain(sub, &mut Vec::new(), 64 * 1024, now);
    }

    /// `claim` hands out 12 and 13 of `jobs` (its feeder at 14), 12 is acknowledged, and a
    /// move begins that never ends while the guard lives: a read of its position is never
    /// settled (and, unsettled, would say 13).
    fn twelve_settled_thirteen_not<'a>(
        broker: &Broker,
        claim: &'a Claim,
        jobs: &TopicName,
    ) -> aqueduct_core::moves::Moving<'a> {
        hand_out(broker, &claim.sub, jobs, 12);
        hand_out(broker, &claim.sub, jobs, 13);
        lock(&claim.fed).set(b"jobs", 14);
        broker.ack(&claim.sub, None, 12, None).expect("in flight");
        claim.sub.moves().begin()
    }

    /// A claim of `consumer:c` on `jobs` with explicit acknowledgements.
    fn claim_acked(consumers: &Consumers, broker: &Broker) -> Claim {
        let filter = TopicFilter::try_from("jobs").expect("valid filter");
        let opts = SubscribeOptions {
            ack_mode: aqueduct_proto::AckMode::Explicit,
            ..SubscribeOptions::default()
        };
        consumers
            .claim("consumer:c", &filter, false, BTreeMap::new, || {
                broker.subscribe_unrouted(&SubscribeSpec::new(filter.clone()), opts)
            })
            .unwrap_or_else(|e| panic!("{e:?}"))
    }

    /// A live consumer's key claims nothing new (a SUBSCRIBE for it joins or is refused: no
    /// walk for it); a claim that would make a new consumer without its start worked out makes
    /// nothing and says so, for the caller to work it out and claim again (the live one ended
    /// in between); with the start, it makes it.
    #[test]
    fn a_claim_without_its_start_makes_no_new_consumer() {
        let (_dir, consumers, broker, _) = redelivering();
        let filter = TopicFilter::try_from("jobs").expect("valid filter");
        assert!(matches!(consumers.claims_new("consumer:c"), Ok(true)));
        let live = claim_acked(&consumers, &broker);
        assert!(
            matches!(consumers.claims_new("consumer:c"), Ok(false)),
            "live"
        );
        consumers.end("consumer:c", &live.sub);
        let mut made = false;
        let unwalked = consumers.claim_with(
            "consumer:new",
            &filter,
            false,
            || None,
            || {
                made = true;
                broker.subscribe_unrouted(&SubscribeSpec::new(filter.clone()), Default::default())
            },
        );
        assert!(
            matches!(unwalked, Err(ClaimError::Unwalked)),
            "{unwalked:?}"
        );
        assert!(!made, "nothing made");
        assert!(
            matches!(consumers.claims_new("consumer:new"), Ok(true)),
            "still new"
        );
        let walked = consumers.claim_with(
            "consumer:new",
            &filter,
            false,
            || Some(BTreeMap::from([(b"jobs".to_vec(), 7)])),
            || broker.subscribe_unrouted(&SubscribeSpec::new(filter.clone()), Default::default()),
        );
        let walked = walked.unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(lock(&walked.fed).next.get(b"jobs".as_slice()), Some(&7));
    }

    /// The log may forget an emptied topic only where every consumer has read it to the end:
    /// a stored position below the end holds it, and so does a live consumer's message of it
    /// still unsettled although the feeder has moved past it; a position at the end does not,
    /// and goes with the topic (stored and live). Before, any position held a topic for good,
    /// so a wildcard consumer kept every topic it ever matched in the log and in its positions
    /// file.
    #[test]
    fn only_positions_short_of_the_end_hold_an_emptied_topic() {
        let (_dir, consumers, broker, jobs) = redelivering();
        let names = |ts: &[&str]| -> Vec<Box<[u8]>> {
            let mut v: Vec<Box<[u8]>> = ts.iter().map(|t| Box::from(t.as_bytes())).collect();
            v.sort();
            v
        };
        lock(&consumers.table).stored.insert(
            "consumer:s".into(),
            ConsumerPosition {
                filter: "#".into(),
                next: BTreeMap::from([(b"read".to_vec(), 4), (b"short".to_vec(), 2)]),
            },
        );
        // A live consumer with `jobs` 0 unsettled; its feeder is at 1, the end.
        let claim = claim_acked(&consumers, &broker);
        let p = Publication::new(&jobs, b"x");
        let now = Instant::now();
        assert!(broker.feed(
            &mut PublishContext::default(),
            &claim.sub,
            &jobs,
            0,
            &p,
            Duration::ZERO,
            now
        ));
        lock(&claim.fed)
            .next
            .extend([(b"jobs".to_vec(), 1), (b"read".to_vec(), 4)]);
        let ends = || -> HashMap<Box<[u8]>, u64> {
            [("read", 4), ("short", 3), ("jobs", 1), ("nobody", 7)]
                .into_iter()
                .map(|(t, e)| (Box::from(t.as_bytes()), e))
                .collect()
        };
        let free = |ends: &HashMap<Box<[u8]>, u64>| {
            let mut v: Vec<Box<[u8]>> = ends.keys().cloned().collect();
            v.sort();
            v
        };
        let mut left = ends();
        consumers.retain_unread(&mut left);
        assert_eq!(free(&left), names(&["nobody", "read"]));
        // Settled: `jobs` is read to its end too.
        let mut out = Vec::new();
        broker.drain(&claim.sub, &mut out, 64 * 1024, now);
        broker.ack(&claim.sub, None, 0, None).expect("in flight");
        let mut left = ends();
        consumers.retain_unread(&mut left);
        assert_eq!(free(&left), names(&["jobs", "nobody", "read"]));
        // The forgotten ones' positions go where they are at the end; `short` stays.
        consumers.forget_positions(&names(&["read", "jobs", "short", "nobody"]), &ends());
        let t = lock(&consumers.table);
        assert_eq!(
            t.stored["consumer:s"].next,
            BTreeMap::from([(b"short".to_vec(), 2)])
        );
        let fed = lock(&claim.fed);
        assert!(fed.next.is_empty(), "{:?}", fed.next);
        assert_eq!(fed.forgotten, 1, "the feeder is told");
    }

    /// After a crash, what is durable of a topic ends where the log's records of it end, not
    /// past the crash gap where its next offset is handed out: a consumer that read the topic
    /// to its end before the crash has still read it to its end (the log may forget the topic
    /// once retention empties it). Before, the end was put past the gap: every topic looked
    /// unread to every consumer after any crash (and once retention emptied it, a live feeder
    /// counted the gap as messages retention deleted).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_crash_a_topic_read_to_its_end_is_still_read_to_its_end() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (mut log, _) = Log::open(dir.path(), log_options()).expect("log opens");
        for offset in 0..3u64 {
            let entry = aqueduct_log::Entry {
                topic: b"t",
                offset,
                data: b"x",
            };
            log.append(&[entry], 1).expect("append");
        }
        log.commit().expect("commit");
        drop(log); // no close: a crash
        let (log, rec) = Log::open(dir.path(), log_options()).expect("log opens");
        let durable = Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts");
        assert_eq!(durable.next_offset(b"t"), 3 + CRASH_OFFSET_GAP, "the gap");
        assert_eq!(durable.durable_next(b"t"), Some(3), "what the log holds");
        let positions = tempfile::tempdir().expect("temp dir");
        let consumers = Consumers::open(positions.path(), ConsumerLimits::default()).expect("open");
        lock(&consumers.table).stored.insert(
            "consumer:c".into(),
            ConsumerPosition {
                filter: "t".into(),
                next: BTreeMap::from([(b"t".to_vec(), 3)]),
            },
        );
        let mut ends: HashMap<Box<[u8]>, u64> = [(
            Box::from(&b"t"[..]),
            durable.durable_next(b"t").unwrap_or(0),
        )]
        .into();
        consumers.retain_unread(&mut ends);
        assert!(ends.contains_key(&b"t"[..]), "read to its end");
        durable.close();
    }

    /// A live consumer's stored position (the one it started from) does not hold a topic: its
    /// feeder's position counts. Before, a consumer that came back while behind held every
    /// topic it had been behind in until it left again, however far its feeder had read.
    #[test]
    fn a_live_consumers_stored_position_does_not_hold_a_topic() {
        let (_dir, consumers, broker, _jobs) = redelivering();
        lock(&consumers.table).stored.insert(
            "consumer:c".into(),
            ConsumerPosition {
                filter: "jobs".into(),
                next: BTreeMap::from([(b"jobs".to_vec(), 0)]),
            },
        );
        let claim = claim_acked(&consumers, &broker);
        assert!(claim.resumed);
        let ends = || -> HashMap<Box<[u8]>, u64> { [(Box::from(&b"jobs"[..]), 4)].into() };
        let mut left = ends();
        consumers.retain_unread(&mut left);
        assert!(left.is_empty(), "its feeder is at 0 too");
        lock(&claim.fed).set(b"jobs", 4);
        let mut left = ends();
        consumers.retain_unread(&mut left);
        assert!(
            left.contains_key(&b"jobs"[..]),
            "its feeder read it to the end"
        );
        // Forgotten: gone from the position it started from too (which it would fall back to
        // if it ended unsettled), not only from its feeder's.
        consumers.forget_positions(&[Box::from(&b"jobs"[..])], &ends());
        let t = lock(&consumers.table);
        assert!(t.stored["consumer:c"].next.is_empty());
        assert!(lock(&claim.fed).next.is_empty());
    }

    /// A large positions table is saved less often than every 200 ms (at most 4 MiB of file
    /// a second): a wildcard consumer behind in 1,000,000 topics (~20 MB of positions) had
    /// its file rewritten and synced five times a second while it read.
    #[test]
    fn a_large_positions_table_is_saved_less_often() {
        assert_eq!(pause_after_save(0), CHECKPOINT_EVERY);
        assert_eq!(pause_after_save(59), CHECKPOINT_EVERY);
        assert_eq!(pause_after_save(2 << 20), Duration::from_millis(500));
        assert_eq!(pause_after_save(20 << 20), Duration::from_secs(5));
        // The size it goes by is the file's.
        let (dir, consumers, ..) = redelivering();
        lock(&consumers.table).stored.insert(
            "consumer:s".into(),
            ConsumerPosition {
                filter: "#".into(),
                next: (0..1000u32)
                    .map(|i| (i.to_be_bytes().to_vec(), 1))
                    .collect(),
            },
        );
        lock(&consumers.table).changes += 1;
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        let size = std::fs::metadata(dir.path().join("consumers"))
            .expect("file")
            .len();
        assert_eq!(consumers.saved_file_bytes() as u64, size);
        assert!(size > 14_000, "{size}");
    }

    /// A feeder never runs while its consumer still looks unfed: from its first step on, the
    /// table says it is running (an end then keeps the consumer's position). It was spawned
    /// before it was marked running, and could feed meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_feeder_is_marked_running_before_it_runs() {
        let (_dir, consumers, broker, _jobs) = redelivering();
        let consumers = Arc::new(consumers);
        for round in 0..200 {
            let claim = claim_acked(&consumers, &broker);
            let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
            let c = consumers.clone();
            consumers.start_feeder("consumer:c", &claim.fed, async move {
                let running = matches!(
                    lock(&c.table).live.get("consumer:c").map(|l| &l.feeder),
                    Some(Feeder::Running(_))
                );
                let _ = seen_tx.send(running);
            });
            let running = tokio::time::timeout(Duration::from_secs(10), seen_rx)
                .await
                .expect("the feeder ran")
                .expect("it said");
            assert!(running, "round {round}: ran while marked starting");
            consumers.end("consumer:c", &claim.sub);
            broker.unsubscribe(&mut PublishContext::default(), &claim.sub, Instant::now());
        }
    }

    /// A checkpoint whose positions moved saves them only once the log has written what was
    /// queued before (`written`: the dead letters of the settlements it saw); otherwise the
    /// saved file stays as it was, and the next checkpoint tries again.
    #[test]
    fn a_checkpoint_saves_nothing_until_the_log_has_written_what_came_before() {
        let (dir, consumers, broker, _jobs) = redelivering();
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        let file = dir.path().join("consumers");
        let before = std::fs::read(&file).ok();
        let claim = claim_acked(&consumers, &broker);
        lock(&claim.fed).set(b"jobs", 5);
        let mut asked = false;
        let saved = consumers
            .checkpoint(|| {
                asked = true;
                None
            })
            .expect("no error");
        assert!(asked, "the log was asked");
        assert!(!saved, "not saved");
        assert_eq!(std::fs::read(&file).ok(), before, "the file as it was");
        assert!(
            !consumers.unchanged(&lock(&consumers.saved)),
            "still to save"
        );
        // The log wrote it all, but lost the dead letter of jobs #3: saved no further than it.
        assert!(consumers
            .checkpoint(|| Some(vec![(b"jobs".to_vec(), 3)]))
            .expect("saved"));
        assert_ne!(std::fs::read(&file).ok(), before, "saved now");
        let (_, stored) = PositionStore::open(dir.path()).expect("the saved file");
        assert_eq!(stored["consumer:c"].next.get(&b"jobs"[..]), Some(&3));
    }

    /// A checkpoint finds, without reading the positions, whether any can have moved since
    /// the last save: a feeder's position, a message queued or settled, a stored consumer, a
    /// consumer starting or ending. Each change is saved; with none, nothing is read.
    #[test]
    fn a_checkpoint_tells_unmoved_positions_without_reading_them() {
        let (_dir, consumers, broker, jobs) = redelivering();
        let unchanged = || consumers.unchanged(&lock(&consumers.saved));
        let saved_now = |what: &str| {
            assert!(!unchanged(), "{what}: seen as a change");
            assert!(
                consumers.checkpoint(|| Some(Vec::new())).expect("saved"),
                "{what}: read"
            );
            assert!(unchanged(), "{what}: saved");
            assert!(
                !consumers.checkpoint(|| Some(Vec::new())).expect("saved"),
                "{what}: nothing more"
            );
        };
        let stored = |key: &str| lock(&consumers.table).stored.get(key).cloned();
        saved_now("the table as found");
        let claim = claim_acked(&consumers, &broker);
        saved_now("a consumer starts");
        lock(&claim.fed).set(b"jobs", 5);
        saved_now("its feeder moves on");
        let now = Instant::now();
        let p = Publication::new(&jobs, b"x");
        let mut ctx = PublishContext::default();
        assert!(broker.feed(&mut ctx, &claim.sub, &jobs, 3, &p, Duration::ZERO, now));
        saved_now("a message queued below it");
        let mut out = Vec::new();
        broker.drain(&claim.sub, &mut out, 64 * 1024, now);
        assert!(unchanged(), "written, not settled: still held");
        broker.ack(&claim.sub, None, 3, None).expect("in flight");
        saved_now("settled");
        let other = TopicName::try_from("other").expect("valid");
        let q = Publication::new(&other, b"x");
        assert!(broker.feed(&mut ctx, &claim.sub, &other, 7, &q, Duration::ZERO, now));
        saved_now("a message of a topic it has no position in");
        consumers.rewind("consumer:c", &claim.sub);
        saved_now("rewound to it");
        let forgotten: Vec<Box<[u8]>> = vec![Box::from(&b"jobs"[..])];
        let ends: HashMap<Box<[u8]>, u64> = [(Box::from(&b"jobs"[..]), 5)].into_iter().collect();
        consumers.forget_positions(&forgotten, &ends);
        saved_now("a live position forgotten");
        consumers.end("consumer:c", &claim.sub);
        saved_now("the consumer ends");
        assert_eq!(stored("consumer:c").map(|p| p.next.len()), Some(1));
        let ends: HashMap<Box<[u8]>, u64> = [(Box::from(&b"other"[..]), 7)].into_iter().collect();
        consumers.forget_positions(&[Box::from(&b"other"[..])], &ends);
        saved_now("a stored position forgotten");
        assert_eq!(stored("consumer:c").map(|p| p.next.len()), Some(0));
    }

    /// A checkpoint never saves a position past a message a NACK is redelivering (taken out
    /// of the in-flight set, not yet queued again): a crash before the next checkpoint then
    /// skipped it for good. A thread NACKs the consumer's one message over and over while
    /// positions are read.
    #[test]
    fn no_position_read_misses_a_message_being_redelivered() {
        const ROUNDS: usize = 20_000;
        let (_dir, consumers, broker, topic) = redelivering();
        let claim = claim_acked(&consumers, &broker);
        let now = Instant::now();
        let mut ctx = PublishContext::default();
        let p = Publication::new(&topic, b"x");
        assert!(broker.feed(&mut ctx, &claim.sub, &topic, 0, &p, Duration::ZERO, now));
        lock(&claim.fed).next.insert(b"jobs".to_vec(), 1);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let nacker = {
            let (broker, sub, done) = (broker.clone(), claim.sub.clone(), done.clone());
            std::thread::spawn(move || {
                let mut ctx = PublishContext::default();
                let mut out = Vec::new();
                for _ in 0..ROUNDS {
                    out.clear();
                    broker.drain(&sub, &mut out, 64 * 1024, now);
                    broker
                        .nack(&mut ctx, &sub, None, 0, None, None, now)
                        .expect("in flight");
                }
                done.store(true, Ordering::SeqCst);
            })
        };
        let mut kept = 0u64;
        while !done.load(Ordering::SeqCst) {
            let Snapshot { all, unread, .. } = consumers.snapshot();
            let position = all.get("consumer:c").expect("every live consumer is in");
            let next = position.next.get(&b"jobs"[..]).copied();
            if unread == 0 {
                kept += 1;
                assert_eq!(next, Some(0), "read {kept}: a position past the message");
            } else {
                assert_eq!(
                    next, None,
                    "not read: where it started (jobs from its start)"
                );
            }
        }
        nacker.join().expect("nacker");
        assert!(kept > 0, "no position was read");
    }

    /// A consumer whose position cannot be read settled (a move that never ends here) falls
    /// back on the last position known not to be past any of its messages: where it started
    /// until a checkpoint saved one, then the saved one. Before, a checkpoint left a consumer
    /// never saved out of the file (a crash made it new: a `latest` one skipped what it had not
    /// settled), and a rewind or an end took the unsettled read, which could miss a message.
    #[tokio::test]
    async fn an_unsettled_position_falls_back_on_the_last_known_one() {
        let (dir, consumers, broker, jobs) = redelivering();
        let filter = TopicFilter::try_from("jobs").expect("valid filter");
        let opts = SubscribeOptions {
            ack_mode: aqueduct_proto::AckMode::Explicit,
            ..SubscribeOptions::default()
        };
        // A new consumer starting at `latest`: the log's end of jobs was 10.
        let claim = consumers
            .claim(
                "consumer:c",
                &filter,
                false,
                || BTreeMap::from([(b"jobs".to_vec(), 10)]),
                || broker.subscribe_unrouted(&SubscribeSpec::new(filter.clone()), opts),
            )
            .unwrap_or_else(|e| panic!("{e:?}"));
        consumers.start_feeder("consumer:c", &claim.fed, std::future::pending());
        let saved_next = || {
            let (_, stored) = PositionStore::open(dir.path()).expect("the saved file");
            stored
                .get("consumer:c")
                .map(|p| p.next.get(jobs.as_bytes()).copied())
        };
        let in_flight = |offset| hand_out(&broker, &claim.sub, &jobs, offset);
        // It handed out 10 and 11 (unsettled); a move never ends.
        in_flight(10);
        in_flight(11);
        lock(&claim.fed).set(b"jobs", 12);
        let moving = claim.sub.moves().begin();
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        assert_eq!(saved_next(), Some(Some(10)), "saved where it started");
        // Settled: saved as read (10, unsettled). Then 10 and 11 are acknowledged and it
        // hands out 12 and 13; a move never ends again.
        drop(moving);
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        assert_eq!(saved_next(), Some(Some(10)));
        broker.ack(&claim.sub, None, 10, None).expect("in flight");
        broker.ack(&claim.sub, None, 11, None).expect("in flight");
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        assert_eq!(saved_next(), Some(Some(12)), "saved as read");
        // 12 is acknowledged, so a read (unsettled, not to be trusted) says 13.
        let moving = twelve_settled_thirteen_not(&broker, &claim, &jobs);
        consumers.end("consumer:c", &claim.sub);
        let kept = || {
            let kept = lock(&consumers.table).stored.get("consumer:c").cloned();
            kept.and_then(|p| p.next.get(&b"jobs"[..]).copied())
        };
        assert_eq!(kept(), Some(12), "kept the saved position at its end");
        drop(moving);
        broker.unsubscribe(&mut PublishContext::default(), &claim.sub, Instant::now());
        // It comes back (from 12), hands out 12 and 13, 12 is acknowledged; its client stops
        // reading while a move never ends.
        let claim = claim_acked(&consumers, &broker);
        consumers.start_feeder("consumer:c", &claim.fed, std::future::pending());
        let moving = twelve_settled_thirteen_not(&broker, &claim, &jobs);
        consumers.rewind("consumer:c", &claim.sub);
        let next = lock(&claim.fed).next.get(&b"jobs"[..]).copied();
        assert_eq!(next, Some(12), "rewound to where it came back");
        drop(moving);
    }

    /// A save moves a consumer's fallback position on also when other consumers came or went
    /// while it saved: it stayed at the consumer's claim, so a busy broker's long-lived
    /// consumer fell back to where it started (everything since delivered again).
    #[tokio::test]
    async fn the_fallback_follows_each_save_while_others_come_and_go() {
        let (_dir, consumers, broker, _jobs) = redelivering();
        let claim = claim_acked(&consumers, &broker);
        consumers.start_feeder("consumer:c", &claim.fed, std::future::pending());
        lock(&claim.fed).set(b"jobs", 7);
        let filter = TopicFilter::try_from("other").expect("valid filter");
        let saved = consumers
            .checkpoint(|| {
                // Another consumer starts while the save waits for the log.
                let other = consumers.claim("consumer:d", &filter, false, BTreeMap::new, || {
                    broker.subscribe_unrouted(
                        &SubscribeSpec::new(filter.clone()),
                        SubscribeOptions::default(),
                    )
                });
                assert!(other.is_ok());
                Some(Vec::new())
            })
            .expect("saved");
        assert!(saved);
        let _moving = claim.sub.moves().begin();
        consumers.rewind("consumer:c", &claim.sub);
        let next = lock(&claim.fed).next.get(&b"jobs"[..]).copied();
        assert_eq!(
            next,
            Some(7),
            "fell back to the saved position, not the claim's"
        );
    }

    /// A consumer whose client stops reading is rewound to its lowest queued or unsettled
    /// offset: read while an ack-wait timeout had taken its message out of the in-flight set
    /// (to queue it again, where the detach then drops it), that floor missed the message and
    /// the position stayed past it. Many rounds of a rewind racing a timeout.
    #[test]
    fn a_rewind_never_misses_a_message_a_timeout_is_moving() {
        const ROUNDS: usize = 3_000;
        let (_dir, consumers, broker, topic) = redelivering();
        let now = Instant::now();
        let later = now + broker.config().ack_wait + Duration::from_secs(1);
        for round in 0..ROUNDS {
            let claim = claim_acked(&consumers, &broker);
            let p = Publication::new(&topic, b"x");
            let mut ctx = PublishContext::default();
            assert!(broker.feed(&mut ctx, &claim.sub, &topic, 0, &p, Duration::ZERO, now));
            lock(&claim.fed).next.insert(b"jobs".to_vec(), 1);
            broker.drain(&claim.sub, &mut Vec::new(), 64 * 1024, now);
            let start = Arc::new(std::sync::Barrier::new(2));
            let timeout = {
                let (broker, sub, start) = (broker.clone(), claim.sub.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    broker.expire_in_flight(&mut PublishContext::default(), &sub, later)
                })
            };
            start.wait();
            consumers.rewind("consumer:c", &claim.sub);
            assert_eq!(timeout.join().expect("timeout"), 1);
            let next = lock(&claim.fed).next.get(&b"jobs"[..]).copied();
            assert_eq!(next, Some(0), "round {round}: rewound past the message");
            consumers.end("consumer:c", &claim.sub);
            broker.unsubscribe(&mut ctx, &claim.sub, now);
        }
    }

    /// What the stream layer asks for a subscription that ended (rewind, pause, end) does not
    /// reach another subscription that has claimed the consumer id since: it stopped the new
    /// one's feeder (a live subscription that got nothing more), or kept its position.
    #[tokio::test]
    async fn a_consumer_id_claimed_again_is_not_stopped_for_the_one_that_ended() {
        let dir = tempfile::tempdir().expect("tempdir");
        let consumers = Consumers::open(dir.path(), ConsumerLimits::default()).expect("open");
        let broker = Broker::new(BrokerConfig::default());
        let old = claim_acked(&consumers, &broker);
        consumers.start_feeder("consumer:c", &old.fed, async {});
        consumers.end("consumer:c", &old.sub);
        let new = claim_acked(&consumers, &broker);
        let (_keep, running) = tokio::sync::oneshot::channel::<()>();
        consumers.start_feeder("consumer:c", &new.fed, async move {
            let _ = running.await;
        });
        let feeding = |c: &Consumers| {
            matches!(
                lock(&c.table).live.get("consumer:c").map(|l| &l.feeder),
                Some(Feeder::Running(_))
            )
        };
        assert!(feeding(&consumers));
        consumers.rewind("consumer:c", &old.sub);
        consumers.pause("consumer:c", old.sub.id());
        consumers.end("consumer:c", &old.sub);
        assert!(feeding(&consumers), "the new claim's feeder runs on");
        consumers.pause("consumer:c", new.sub.id());
        assert!(!feeding(&consumers), "its own pause stops it");
    }

    /// The positions kept are bounded: a new consumer id beyond `max` is refused while known
    /// ones still resume, and one idle past the retention is forgotten (making room).
    #[tokio::test]
    async fn kept_positions_are_bounded_in_number_and_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = ConsumerLimits {
            max: 2,
            retention: Some(Duration::from_secs(3600)),
        };
        let consumers = Consumers::open(dir.path(), limits).expect("open");
        let broker = Broker::new(BrokerConfig::default());
        let filter = TopicFilter::try_from("jobs").expect("valid filter");
        let claim = |key: &str| {
            consumers.claim(key, &filter, false, BTreeMap::new, || {
                broker.subscribe_unrouted(
                    &SubscribeSpec::new(filter.clone()),
                    SubscribeOptions::default(),
                )
            })
        };
        // A claim taken back before its feeder started (a refused SUBSCRIBE) leaves nothing,
        // whatever positions it was given: the consumer stays unseen.
        let gone = claim("consumer:gone").unwrap_or_else(|e| panic!("{e:?}"));
        lock(&gone.fed).next.insert(b"jobs".to_vec(), 7);
        consumers.end("consumer:gone", &gone.sub);
        assert!(!consumers.has_position("consumer:gone"));
        // `a` reads to offset 5 (its feeder ran) and leaves: its position is kept.
        let a = claim("consumer:a").unwrap_or_else(|e| panic!("{e:?}"));
        consumers.start_feeder("consumer:a", &a.fed, async {});
        lock(&a.fed).next.insert(b"jobs".to_vec(), 5);
        consumers.end("consumer:a", &a.sub);
        assert!(consumers.has_position("consumer:a"));
        let _b = claim("consumer:b").unwrap_or_else(|e| panic!("{e:?}"));
        assert!(matches!(claim("consumer:c"), Err(ClaimError::TooMany(2))));
        // A known one still comes back.
        let a = claim("consumer:a").unwrap_or_else(|e| panic!("{e:?}"));
        assert!(a.resumed);
        consumers.end("consumer:a", &a.sub);
        // Not yet idle for the retention: kept.
        consumers.expire(Instant::now());
        assert!(matches!(claim("consumer:c"), Err(ClaimError::TooMany(2))));
        // Idle past it: forgotten (not the live `b`), and `c` fits.
        consumers.expire(Instant::now() + Duration::from_secs(3601));
        let c = claim("consumer:c").unwrap_or_else(|e| panic!("{e:?}"));
        assert!(!c.resumed);
        let a = claim("consumer:a");
        assert!(matches!(a, Err(ClaimError::TooMany(2))), "a was forgotten");
        assert!(consumers.checkpoint(|| Some(Vec::new())).expect("saved"));
        let (_, stored) = PositionStore::open(dir.path()).expect("reopen");
        assert!(!stored.contains_key("consumer:a"), "and is not saved");
    }

    /// A feeder still running when the broker's consumers go away (no connection ended it)
    /// does not outlive them.
    #[tokio::test]
    async fn dropping_the_consumers_stops_their_feeders() {
        let dir = tempfile::tempdir().expect("tempdir");
        let consumers = Consumers::open(dir.path(), ConsumerLimits::default()).expect("open");
        let broker = Broker::new(BrokerConfig::default());
        let filter = TopicFilter::try_from("jobs").expect("valid filter");
        let key = Consumers::key("billing");
        let claim = consumers
            .claim(&key, &filter, false, BTreeMap::new, || {
                broker.subscribe_unrouted(
                    &SubscribeSpec::new(filter.clone()),
                    SubscribeOptions::default(),
                )
            })
            .unwrap_or_else(|e| panic!("claim: {e:?}"));
        assert!(claim.first);
        let (held, gone) = tokio::sync::oneshot::channel::<()>();
        consumers.start_feeder(&key, &claim.fed, async move {
            let _held = held;
            std::future::pending::<()>().await
        });
        drop(consumers);
        // The task is aborted: its future (holding the sender) is dropped.
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the feeder ended with its consumers")
            .expect_err("nothing was sent, the sender was dropped");
    }
}
