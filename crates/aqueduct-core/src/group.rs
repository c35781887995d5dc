//! Consumer-group state that outlives a single routing decision: the committed-offset watermark.
//!
//! Membership and the round-robin cursor live in the routing table (`broker.rs`), next to the
//! filter they belong to, so picking a member happens under the routing read lock with one atomic
//! increment and no extra lock. What is here is touched only by deliveries to the group and by
//! settlements, under this group's own mutex.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use aqueduct_proto::{Durable, GroupId, TopicFilter, TopicName};
use foldhash::fast::RandomState;

/// Round-robin choice among a group's members: one relaxed atomic increment per pick, so
/// concurrent publishers spread messages evenly without a lock.
#[derive(Debug, Default)]
pub struct RoundRobin {
    cursor: AtomicUsize,
}

/// A copy continues from the same turn.
impl Clone for RoundRobin {
    fn clone(&self) -> RoundRobin {
        RoundRobin {
            cursor: AtomicUsize::new(self.cursor.load(Relaxed)),
        }
    }
}

impl RoundRobin {
    /// The next member in turn for which `eligible` holds; `None` if no member is eligible.
    ///
    /// Each pick takes one turn and looks at every member from there: concurrent picks each
    /// look at all of them. (Taking a turn per member looked at let two publishers' turns
    /// interleave, so one could miss the only member with room and fall back to a full one.)
    /// The next turn starts after the member chosen, unless another pick moved on meanwhile.
    pub fn pick<'a, T>(&self, members: &'a [T], eligible: impl Fn(&T) -> bool) -> Option<&'a T> {
        let n = members.len();
        if n == 0 {
            return None;
        }
        let start = self.cursor.fetch_add(1, Relaxed);
        let Some(k) = (0..n).find(|k| eligible(&members[start.wrapping_add(*k) % n])) else {
            // None eligible: the turn goes once round (n in all, as a turn per member looked
            // at did), so that the caller's fallback pick starts where this one did. Taking one
            // turn moved every fallback on by one more, and with every member full the same
            // members got every message.
            self.cursor.fetch_add(n - 1, Relaxed);
            return None;
        };
        if k > 0 {
            let _ = self.cursor.compare_exchange(
                start.wrapping_add(1),
                start.wrapping_add(k + 1),
                Relaxed,
                Relaxed,
            );
        }
        Some(&members[start.wrapping_add(k) % n])
    }
}

/// Per topic: which offsets were handed to the group and not yet settled.
#[derive(Debug, Default)]
struct Watermark {
    /// One past the highest offset handed out.
    next: u64,
    /// Offsets handed out and not settled (acked, dead-lettered, expired or dropped).
    outstanding: Outstanding,
}

impl Watermark {
    /// The highest offset below which every message handed to the group is settled.
    fn committed(&self) -> u64 {
        self.outstanding.first().unwrap_or(self.next)
    }
}

/// A set of offsets, kept as a sorted ring: offsets are handed out mostly in increasing order
/// (appended) and settled mostly oldest first (taken from the front), so in steady state it
/// allocates nothing, where a `BTreeSet` allocated a node about every 5–10 messages. An offset
/// settled out of order is only marked (a binary search), and marked ones leave when they reach
/// the front, or all at once when they are half the ring: a member that stalls holding the
/// oldest offsets costs the others' settlements no shifting, and the ring stays within about
/// twice what is outstanding.
#[derive(Debug, Default)]
struct Outstanding {
    /// Offsets in increasing order, each with whether it has been settled since.
    ring: VecDeque<(u64, bool)>,
    /// How many in `ring` are marked settled.
    settled: usize,
}

impl Outstanding {
    /// Capacity kept however few remain (beyond it, a ring a quarter full is halved).
    const KEEP: usize = 1024;

    fn insert(&mut self, offset: u64) {
        match self.ring.back() {
            Some(&(last, _)) if offset <= last => {
                match self.ring.binary_search_by_key(&offset, |&(o, _)| o) {
                    // Out again (handed to the group again after it was settled).
                    Ok(at) => {
                        if std::mem::replace(&mut self.ring[at].1, false) {
                            self.settled -= 1;
                        }
                    }
                    Err(at) => self.ring.insert(at, (offset, false)),
                }
            }
            _ => self.ring.push_back((offset, false)),
        }
    }

    fn remove(&mut self, offset: u64) {
        match self.ring.front() {
            Some(&(first, _)) if first == offset => {
                self.ring.pop_front();
            }
            _ => match self.ring.binary_search_by_key(&offset, |&(o, _)| o) {
                Ok(at) if !self.ring[at].1 => {
                    self.ring[at].1 = true;
                    self.settled += 1;
                }
                _ => return,
            },
        }
        while self.ring.front().is_some_and(|&(_, settled)| settled) {
            self.ring.pop_front();
            self.settled -= 1;
        }
        if self.settled > 64 && self.settled * 2 > self.ring.len() {
            self.ring.retain(|&(_, settled)| !settled);
            self.settled = 0;
        }
        let cap = self.ring.capacity();
        if cap > Self::KEEP && self.ring.len() < cap / 4 {
            self.ring.shrink_to(cap / 2);
        }
    }

    /// The lowest offset out (never a settled one: those leave the front at once).
    fn first(&self) -> Option<u64> {
        self.ring.front().map(|&(o, _)| o)
    }

    fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

/// A consumer group: the subscriptions sharing a group id and a filter.
#[derive(Debug)]
pub struct GroupShared {
    id: GroupId,
    filter: TopicFilter,
    durable: Option<Durable>,
    watermarks: Mutex<HashMap<TopicName, Watermark, RandomState>>,
    /// Fed from the durable log, not by routing (see `Broker::subscribe_unrouted`).
    unrouted: bool,
    /// An unrouted group's messages that had no member to go to (every member had left):
    /// kept for the next member instead of dropped, and counted in the group's position.
    parked: Mutex<Vec<crate::subscriber::Delivery>>,
    /// Messages on their way between members, or between a member and `parked`.
    moves: crate::moves::Moves,
}

impl GroupShared {
    pub(crate) fn new(id: GroupId, filter: TopicFilter, durable: Option<Durable>) -> Self {
        GroupShared {
            id,
            filter,
            durable,
            watermarks: Mutex::default(),
            unrouted: false,
            parked: Mutex::default(),
            moves: crate::moves::Moves::default(),
        }
    }

    /// A group fed from the durable log (see `Broker::subscribe_unrouted`).
    pub(crate) fn new_unrouted(id: GroupId, filter: TopicFilter, durable: Option<Durable>) -> Self {
        GroupShared {
            unrouted: true,
            ..GroupShared::new(id, filter, durable)
        }
    }

    /// Moves of the group's messages between its members and its parked ones.
    pub fn moves(&self) -> &crate::moves::Moves {
        &self.moves
    }

    pub fn is_unrouted(&self) -> bool {
        self.unrouted
    }

    pub(crate) fn park(&self, d: crate::subscriber::Delivery) {
        self.parked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(d);
    }

    pub(crate) fn take_parked(&self) -> Vec<crate::subscriber::Delivery> {
        std::mem::take(&mut *self.parked.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// For each topic with parked messages, the lowest parked offset.
    pub fn parked_floor(&self) -> Vec<(TopicName, u64)> {
        let parked = self.parked.lock().unwrap_or_else(PoisonError::into_inner);
        let mut floor: HashMap<TopicName, u64, RandomState> = HashMap::default();
        for d in parked.iter() {
            let f = floor.entry(d.topic.name().clone()).or_insert(d.offset);
            *f = (*f).min(d.offset);
        }
        floor.into_iter().collect()
    }

    pub fn id(&self) -> &GroupId {
        &self.id
    }

    pub fn filter(&self) -> &TopicFilter {
        &self.filter
    }

    /// The durable consumer name and where it asked to start, if durable.
    pub fn durable(&self) -> Option<&Durable> {
        self.durable.as_ref()
    }

    pub(crate) fn note_delivered(&self, topic: &TopicName, offset: u64) {
        let mut marks = self
            .watermarks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mark = match marks.get_mut(topic.as_bytes()) {
            Some(mark) => mark,
            None => marks.entry(topic.clone()).or_insert(Watermark {
                next: offset,
                outstanding: Outstanding::default(),
            }),
        };
        mark.outstanding.insert(offset);
        mark.next = mark.next.max(offset.saturating_add(1));
    }

    pub(crate) fn note_settled(&self, topic: &TopicName, offset: u64) {
        let mut marks = self
            .watermarks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(mark) = marks.get_mut(topic.as_bytes()) {
            mark.outstanding.remove(offset);
        }
    }

    /// The committed offset for `topic`: every message of the group below it is settled.
    pub fn committed_offset(&self, topic: &TopicName) -> Option<u64> {
        let marks = self
            .watermarks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        marks.get(topic.as_bytes()).map(Watermark::committed)
    }

    /// Forget the watermarks of `topics` (freed by the broker's idle-topic sweep) where every
    /// message handed to the group is settled: nothing refers to them any more, and a topic
    /// published to again starts a new one. Keeps a group under a wildcard from holding one
    /// per topic name ever published.
    pub(crate) fn forget_settled(&self, topics: &[TopicName]) {
        let mut marks = self
            .watermarks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let before = marks.len();
        for t in topics {
            if marks
                .get(t.as_bytes())
                .is_some_and(|m| m.outstanding.is_empty())
            {
                marks.remove(t.as_bytes());
            }
        }
        if marks.len() < before && marks.capacity() > 2 * marks.len().max(16) {
            marks.shrink_to_fit();
        }
    }

    /// Committed offsets of every topic the group has received.
    pub fn committed_offsets(&self) -> Vec<(TopicName, u64)> {
        let marks = self
            .watermarks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        marks
            .iter()
            .map(|(t, m)| (t.clone(), m.committed()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Outstanding` answers as a `BTreeSet` does, whatever the order of inserts and removes
    /// (repeated, absent, out of order), and gives back room once mostly empty.
    #[test]
    fn outstanding_is_a_set() {
        let mut model = std::collections::BTreeSet::new();
        let mut set = Outstanding::default();
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = 0u64;
        for _ in 0..200_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let op = rng % 100;
            if op < 45 {
                // Mostly increasing, sometimes behind or repeated.
                let offset = if op < 40 {
                    next += 1 + rng % 3;
                    next
                } else {
                    next.saturating_sub(rng % 64)
                };
                model.insert(offset);
                set.insert(offset);
            } else {
                // Mostly the oldest, sometimes any (present or not).
                let offset = match model.first() {
                    Some(&first) if op < 85 => first,
                    _ => next.saturating_sub(rng % 256),
                };
                model.remove(&offset);
                set.remove(offset);
            }
            assert_eq!(set.first(), model.first().copied());
            assert_eq!(set.is_empty(), model.is_empty());
        }
        let left = set.ring.iter().filter(|&&(_, settled)| !settled);
        assert!(left.map(|&(o, _)| o).eq(model.iter().copied()));
        assert_eq!(
            set.settled,
            set.ring.iter().filter(|&&(_, settled)| settled).count()
        );
        let mut big = Outstanding::default();
        (0..100_000).for_each(|o| big.insert(o));
        (0..99_990).for_each(|o| big.remove(o));
        assert!(
            big.ring.capacity() < 4 * Outstanding::KEEP,
            "{}",
            big.ring.capacity()
        );
        assert_eq!(big.first(), Some(99_990));
        // The oldest held while everything after it is settled: the ring keeps about twice
        // what is out, at most.
        let mut pinned = Outstanding::default();
        (0..100_000).for_each(|o| pinned.insert(o));
        (1..100_000).for_each(|o| pinned.remove(o));
        assert!(pinned.ring.len() <= 130, "{}", pinned.ring.len());
        assert_eq!(pinned.first(), Some(0));
        pinned.remove(0);
        assert!(pinned.is_empty());
    }

    #[test]
    fn round_robin_is_even_and_skips_ineligible() {
        let rr = RoundRobin::default();
        let members = [1, 2, 3];
        let picks: Vec<i32> = (0..6)
            .filter_map(|_| rr.pick(&members, |_| true))
            .copied()
            .collect();
        assert_eq!(picks, [1, 2, 3, 1, 2, 3]);
        let picks: Vec<i32> = (0..4)
            .filter_map(|_| rr.pick(&members, |m| *m != 2))
            .copied()
            .collect();
        assert_eq!(picks, [1, 3, 1, 3]);
        assert_eq!(rr.pick(&members, |_| false), None);
        assert_eq!(rr.pick(&[] as &[i32], |_| true), None);
    }

    /// Picks made at the same time (other publishers under the routes read lock) each look at
    /// every member: with [full, room, full], a pick whose turns interleaved with another's
    /// missed the member with room and returned none (its caller then fell back to a full
    /// member, whose policy dropped a message or closed it).
    #[test]
    fn concurrent_picks_each_look_at_every_member() {
        let rr = RoundRobin::default();
        let members = ["full-a", "room", "full-c"];
        for round in 0..6 {
            // Another publisher's pick takes its turn while this one looks at its first member.
            let looked = std::cell::Cell::new(0);
            let got = rr.pick(&members, |m| {
                if looked.replace(looked.get() + 1) == 0 {
                    rr.cursor.fetch_add(1, Relaxed);
                }
                *m == "room"
            });
            assert_eq!(got, Some(&"room"), "round {round}");
        }
    }

    /// With every member full, a group's pick finds none with room and falls back to any
    /// member (`GroupEntry::pick`): the fallbacks still go round. A pick that found none took
    /// one turn, so each message moved the turn on by two and, with two members, every one
    /// went to the same member.
    #[test]
    fn fallback_picks_go_round_when_no_member_is_eligible() {
        let rr = RoundRobin::default();
        for members in [&[0, 1][..], &[0, 1, 2, 3][..]] {
            let mut got = vec![0; members.len()];
            for _ in 0..4 * members.len() {
                assert_eq!(rr.pick(members, |_| false), None);
                let m = rr.pick(members, |_| true).expect("any member");
                got[*m] += 1;
            }
            assert!(got.iter().all(|&g| g == 4), "{members:?}: {got:?}");
        }
    }

    #[test]
    fn watermark_is_the_lowest_unsettled_offset() {
        let g = GroupShared::new(
            GroupId::try_from("g").expect("valid"),
            TopicFilter::try_from("t").expect("valid"),
            None,
        );
        let t = TopicName::try_from("t").expect("valid");
        assert_eq!(g.committed_offset(&t), None);
        for o in 10..15 {
            g.note_delivered(&t, o);
        }
        assert_eq!(g.committed_offset(&t), Some(10));
        g.note_settled(&t, 11);
        g.note_settled(&t, 12);
        assert_eq!(g.committed_offset(&t), Some(10));
        g.note_settled(&t, 10);
        assert_eq!(g.committed_offset(&t), Some(13));
        g.note_settled(&t, 14);
        g.note_settled(&t, 13);
        assert_eq!(g.committed_offset(&t), Some(15));
        assert_eq!(g.committed_offsets(), vec![(t, 15)]);
    }
}
