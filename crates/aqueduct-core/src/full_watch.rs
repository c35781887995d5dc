//! Block-policy subscriptions left full by work that no source can be held back for.
//!
//! Under `block`, a frame that fills a subscription's queue holds its publisher's stream until
//! the queue drains to half; the server closes the subscription as a slow consumer if that
//! takes longer than `broker.block_timeout`. Some work fills a queue with no source to hold:
//! a group member's messages handed to the others as it leaves (its stream or connection is
//! ending), a redelivery (a NACK or an ack-wait timeout: it only moves a message back, and
//! holding the NACKing stream kept its ACKs unread), and the ack-wait timer's dead letters.
//! Nothing bounded such a queue: members that join a group, take messages and leave without
//! settling them filled a stalled member past its bound for as long as they came and went.
//!
//! Such subscriptions are watched here from the moment that work fills them (see
//! [`Broker::watch_full`](crate::Broker::watch_full)); the server takes those that have not
//! drained to half once in the `broker.block_timeout` since
//! ([`Broker::overdue_full`](crate::Broker::overdue_full)) and closes them as slow consumers,
//! as a held publisher's wait would. One that drains is forgotten until work fills it again.
//! Draining is told by [`Subscriber::halvings`], not by the queue's length when the server
//! looks: a busy member that a held publisher refills each time it drains is above half at
//! most looks, and is healthy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;

use crate::subscriber::{Subscriber, SubscriberId};

/// Each watched subscription, when work filled it, and its halvings then.
type Watched = HashMap<SubscriberId, (Arc<Subscriber>, Instant, u64), RandomState>;

/// See the module documentation. Touched only when such work fills a queue, and by the
/// server's periodic look.
#[derive(Debug, Default)]
pub(crate) struct FullWatch {
    full_since: Mutex<Watched>,
}

impl FullWatch {
    fn lock(&self) -> MutexGuard<'_, Watched> {
        self.full_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Watch `subs` from `now` (those watched already keep their time).
    pub(crate) fn watch(&self, subs: impl IntoIterator<Item = Arc<Subscriber>>, now: Instant) {
        let mut subs = subs.into_iter().peekable();
        if subs.peek().is_none() {
            return;
        }
        // Each subscription's lock is taken outside the watch's.
        let subs: Vec<(Arc<Subscriber>, u64)> = subs
            .map(|sub| {
                let halvings = sub.halvings();
                (sub, halvings)
            })
            .collect();
        let mut watched = self.lock();
        for (sub, halvings) in subs {
            watched.entry(sub.id()).or_insert((sub, now, halvings));
        }
    }

    /// Forget the subscriptions that drained to half since they were watched, or closed; take
    /// out and return those that have not for `limit` or longer (none without a limit).
    pub(crate) fn overdue(&self, now: Instant, limit: Option<Duration>) -> Vec<Arc<Subscriber>> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut overdue = Vec::new();
        self.lock().retain(|_, (sub, since, halvings)| {
            if sub.is_closed() || sub.poll_room(&mut cx).is_ready() || sub.halvings() != *halvings {
                return false;
            }
            match limit {
                Some(limit) if now.saturating_duration_since(*since) >= limit => {
                    overdue.push(sub.clone());
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
