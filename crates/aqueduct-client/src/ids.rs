//! The request ids (`stream_id`s, protocol.md §2) of one connection.
//!
//! Counted up from 1 and wrapping after `u32::MAX` (at 50,000 confirmed publishes a second, in
//! about a day). Never 0, the id of publishes sent without confirm: a confirmed publish with id
//! 0 took their refusals for its own answer. A subscription's id is never one a live
//! subscription of the connection holds: the broker refuses a SUBSCRIBE whose id is in use
//! (§7.1), and a subscription made at the start outlives many wraps of a busy publisher.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug)]
pub(crate) struct Ids {
    next: AtomicU32,
    /// The ids of live subscriptions.
    subscribed: Mutex<BTreeSet<u32>>,
}

impl Default for Ids {
    fn default() -> Self {
        Ids {
            next: AtomicU32::new(1),
            subscribed: Mutex::new(BTreeSet::new()),
        }
    }
}

impl Ids {
    /// The id of one request (a confirmed publish, an INFO).
    pub(crate) fn request(&self) -> u32 {
        loop {
            let id = self.next.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// `n` consecutive ids for subscriptions (a delivery's stream id tells its subscription by
    /// subtraction), none 0, none wrapping, none a live subscription's; each held until it is
    /// [`released`](Self::release) — by the guard, for those not handed to a subscription.
    pub(crate) fn subscriptions(self: &Arc<Self>, n: u32) -> Held {
        let first = self.reserve(n);
        Held {
            ids: self.clone(),
            first,
            n: n.max(1),
        }
    }

    fn reserve(&self, n: u32) -> u32 {
        let n = n.max(1);
        loop {
            let first = self.next.fetch_add(n, Ordering::Relaxed);
            let Some(last) = first.checked_add(n - 1) else {
                continue;
            };
            if first == 0 {
                continue;
            }
            let mut subscribed = self.subscribed.lock().unwrap_or_else(|e| e.into_inner());
            if subscribed.range(first..=last).next().is_some() {
                continue;
            }
            subscribed.extend(first..=last);
            return first;
        }
    }

    /// A subscription's id is free again (the subscription is gone).
    pub(crate) fn release(&self, id: u32) {
        self.subscribed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Whether `id` is a live subscription's (tests).
    #[cfg(test)]
    pub(crate) fn is_held(&self, id: u32) -> bool {
        self.subscribed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&id)
    }

    /// Count from `next` (tests).
    #[cfg(test)]
    pub(crate) fn starting_at(next: u32) -> Ids {
        let ids = Ids::default();
        ids.next.store(next, Ordering::Relaxed);
        ids
    }
}

/// Subscription ids reserved and not yet handed to their subscriptions: released when dropped
/// (the SUBSCRIBEs were not sent, or not all answered).
#[derive(Debug)]
pub(crate) struct Held {
    ids: Arc<Ids>,
    first: u32,
    n: u32,
}

impl Held {
    /// The first id.
    pub(crate) fn first(&self) -> u32 {
        self.first
    }

    /// The ids are their subscriptions' now: each releases its own when it goes.
    pub(crate) fn handed_over(mut self) {
        self.n = 0;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        for i in 0..self.n {
            self.ids.release(self.first + i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After the wrap: 0 is skipped, and so are live subscriptions' ids; a range does not wrap.
    #[test]
    fn ids_skip_zero_and_live_subscriptions() {
        let ids = Ids::starting_at(u32::MAX - 1);
        assert_eq!(ids.request(), u32::MAX - 1);
        assert_eq!(ids.request(), u32::MAX);
        assert_eq!(ids.request(), 1, "0 is the id of publishes without confirm");

        let ids = Arc::new(Ids::starting_at(4));
        let live = ids.subscriptions(1);
        assert_eq!(live.first(), 4);
        live.handed_over();
        ids.next.store(3, Ordering::Relaxed);
        let two = ids.subscriptions(2);
        assert_eq!(two.first(), 5, "3..=4 holds a live one: 5..=6");
        assert!(ids.is_held(5) && ids.is_held(6));
        drop(two);
        assert!(
            !ids.is_held(5) && !ids.is_held(6),
            "not handed over: released"
        );
        ids.release(4);
        ids.next.store(3, Ordering::Relaxed);
        assert_eq!(ids.subscriptions(1).first(), 3);
        assert_eq!(ids.subscriptions(1).first(), 4, "released: free again");

        let ids = Arc::new(Ids::starting_at(u32::MAX - 1));
        let held = ids.subscriptions(3);
        assert_eq!(held.first(), 1, "not across the wrap");
    }
}
