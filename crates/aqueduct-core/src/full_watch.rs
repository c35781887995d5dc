//! Block-policy subscriptions left full by work that no source can be held back for.
//!
//! Under `block`, a frame that fills a subscription's queue holds its publisher's stream until
//! the queue drains to half; the server closes the subscription as a slow consumer if that
//! takes longer than `broker.block_timeout`. Some work fills a queue with no source to hold:
//! a group member's messages handed to the others as its stream or connection ends (an
//! UNSUBSCRIBE frame's hand-over holds its stream, as a publish does), a redelivery (a NACK or
//! an ack-wait timeout: it only moves a message back, and holding the NACKing stream kept its
//! ACKs unread), and the dead letters the broker makes by itself. Nothing bounded such a queue:
//! members that join a group, take messages and leave without settling them filled a stalled
//! member past its bound for as long as they came and went.
//!
//! Such subscriptions are watched here from the moment that work fills them (see
//! [`Broker::watch_full`](crate::Broker::watch_full)). The server takes those that, within
//! `broker.block_timeout`, neither drained to half nor took half their capacity off the queue
//! ([`Broker::overdue_full`](crate::Broker::overdue_full)) and closes them as slow consumers.
//! Each time one has taken that much, its time starts again; one that drains to half is
//! forgotten until work fills it again. That is more lenient than a held publisher's wait,
//! which ends only at half: a stalled or slower subscription is closed, and a draining one
//! never is, however far above its capacity hand-overs took it (a survivor given a departing
//! member's queue and unsettled messages). Progress is read from
//! [`Subscriber::drain_progress`]'s counters, not from the queue's length when the server
//! looks: a member that a held publisher refills as it drains is above half at most looks.
//!
//! An unrouted (durable) subscription is watched but never closed
//! ([`Broker::disconnect_slow`](crate::Broker::disconnect_slow)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use crate::subscriber::{DrainProgress, Subscriber, SubscriberId};

/// A watched subscription: since when it has made no progress, and its counters then.
#[derive(Debug)]
struct Entry {
    sub: Arc<Subscriber>,
    since: Instant,
    at: DrainProgress,
}

type Watched = HashMap<SubscriberId, Entry, RandomState>;

/// See the module documentation. Touched only when such work fills a queue, and by the
/// server's periodic look.
#[derive(Debug, Default)]
pub(crate) struct FullWatch {
    watched: Mutex<Watched>,
}

impl FullWatch {
    fn lock(&self) -> MutexGuard<'_, Watched> {
        self.watched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Watch `subs` from `now`. One watched already keeps its time, unless it drained to half
    /// since (this is a new fill).
    pub(crate) fn watch(&self, subs: impl IntoIterator<Item = Arc<Subscriber>>, now: Instant) {
        let mut subs = subs.into_iter().peekable();
        if subs.peek().is_none() {
            return;
        }
        // Each subscription's lock is taken outside the watch's.
        let subs: Vec<(Arc<Subscriber>, DrainProgress)> = subs
            .map(|sub| {
                let at = sub.drain_progress();
                (sub, at)
            })
            .collect();
        let mut watched = self.lock();
        // Closed since, or drained to half already: nothing to watch.
        for (sub, at) in subs.into_iter().filter(|(_, at)| !at.at_half) {
            let entry = watched.entry(sub.id()).or_insert(Entry {
                sub: sub.clone(),
                since: now,
                at,
            });
            if entry.at.halvings != at.halvings {
                *entry = Entry {
                    sub,
                    since: now,
                    at,
                };
            }
        }
    }

    /// Forget the subscriptions that drained to half since they were watched, or closed; start
    /// the time again for those that took half their capacity off the queue since it started;
    /// take out and return those that did neither for `limit` or longer (none without a limit).
    pub(crate) fn overdue(&self, now: Instant, limit: Option<Duration>) -> Vec<Arc<Subscriber>> {
        let mut overdue = Vec::new();
        self.lock().retain(|_, e| {
            let p = e.sub.drain_progress();
            if p.at_half || p.halvings != e.at.halvings {
                return false;
            }
            if p.taken.wrapping_sub(e.at.taken) >= p.half.max(1) {
                e.since = now;
                e.at = p;
                return true;
            }
            match limit {
                Some(limit) if now.saturating_duration_since(e.since) >= limit => {
                    overdue.push(e.sub.clone());
                    false
                }
                _ => true,
            }
        });
        overdue
    }

    /// How many are watched.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}
