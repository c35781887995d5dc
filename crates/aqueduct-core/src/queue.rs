//! A subscriber's four bounded priority queues and the overflow policy.
//!
//! Level 0 is served before 1, 1 before 2, 2 before 3; FIFO within a level. Each level is a
//! `VecDeque` that allocates only when first used and grows to at most `capacity` items, so an
//! idle subscriber costs no queue memory and a busy one reaches a steady state without allocating.

use std::collections::VecDeque;

use aqueduct_proto::{OverflowPolicy, Priority};

/// What [`PriorityQueues::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued; `was_empty` is true if every level was empty before (time to wake the writer).
    Queued { was_empty: bool },
    /// Queued although the level was full (block): the publisher must now wait for room.
    QueuedFull { was_empty: bool },
    /// Queued after evicting the oldest item of the same level (drop_oldest).
    Evicted(T),
    /// Not queued: the level is full (drop_newest).
    Rejected(T),
    /// Not queued: the level is full and the policy is disconnect.
    Overflow(T),
}

/// Four FIFO levels, each bounded by the same capacity.
#[derive(Debug)]
pub struct PriorityQueues<T> {
    levels: [VecDeque<T>; Priority::LEVELS],
    len: usize,
}

impl<T> Default for PriorityQueues<T> {
    fn default() -> Self {
        PriorityQueues {
            levels: Default::default(),
            len: 0,
        }
    }
}

impl<T> PriorityQueues<T> {
    /// Queue `item` at `priority`, applying `policy` if that level already holds `capacity` items.
    pub fn push(
        &mut self,
        priority: Priority,
        item: T,
        capacity: usize,
        policy: OverflowPolicy,
    ) -> Pushed<T> {
        let was_empty = self.len == 0;
        let level = &mut self.levels[priority.index()];
        if level.len() >= capacity {
            return match policy {
                OverflowPolicy::DropOldest => match level.pop_front() {
                    Some(old) => {
                        level.push_back(item);
                        Pushed::Evicted(old)
                    }
                    // capacity 0: nothing can be queued.
                    None => Pushed::Rejected(item),
                },
                OverflowPolicy::DropNewest => Pushed::Rejected(item),
                OverflowPolicy::Disconnect => Pushed::Overflow(item),
                OverflowPolicy::Block => {
                    level.push_back(item);
                    self.len += 1;
                    Pushed::QueuedFull { was_empty }
                }
            };
        }
        level.push_back(item);
        self.len += 1;
        Pushed::Queued { was_empty }
    }

    /// Put an item back at the front of its level, ignoring capacity (used to return an item
    /// that was taken but not sent).
    pub fn push_front(&mut self, priority: Priority, item: T) {
        self.levels[priority.index()].push_front(item);
        self.len += 1;
    }

    /// The next item in strict priority order.
    /// Every queued item, level by level.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.levels.iter().flatten()
    }

    pub fn pop(&mut self) -> Option<T> {
        let item = self.levels.iter_mut().find_map(VecDeque::pop_front)?;
        self.len -= 1;
        Some(item)
    }

    /// Items queued over all levels.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Items queued at one level.
    pub fn level_len(&self, priority: Priority) -> usize {
        self.levels[priority.index()].len()
    }

    /// Remove and return everything, highest priority first.
    pub fn take_all(&mut self) -> Vec<T> {
        self.len = 0;
        self.levels.iter_mut().flat_map(|l| l.drain(..)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(level: u8) -> Priority {
        Priority::new(level).expect("valid priority")
    }

    #[test]
    fn strict_priority_order_fifo_within_level() {
        let mut q = PriorityQueues::default();
        for (level, item) in [
            (3, "d1"),
            (2, "c1"),
            (0, "a1"),
            (3, "d2"),
            (1, "b1"),
            (0, "a2"),
        ] {
            q.push(p(level), item, 10, OverflowPolicy::DropOldest);
        }
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, ["a1", "a2", "b1", "c1", "d1", "d2"]);
        assert!(q.is_empty());
    }

    #[test]
    fn levels_allocate_lazily() {
        let mut q = PriorityQueues::default();
        q.push(p(1), 1u32, 4, OverflowPolicy::DropOldest);
        assert_eq!(q.levels[0].capacity(), 0);
        assert!(q.levels[1].capacity() > 0);
        assert_eq!(q.levels[2].capacity(), 0);
        assert_eq!(q.levels[3].capacity(), 0);
    }

    #[test]
    fn policies() {
        let mut q = PriorityQueues::default();
        assert_eq!(
            q.push(p(2), 1, 2, OverflowPolicy::DropOldest),
            Pushed::Queued { was_empty: true }
        );
        assert_eq!(
            q.push(p(2), 2, 2, OverflowPolicy::DropOldest),
            Pushed::Queued { was_empty: false }
        );
        assert_eq!(
            q.push(p(2), 3, 2, OverflowPolicy::DropOldest),
            Pushed::Evicted(1)
        );
        assert_eq!(
            q.push(p(2), 4, 2, OverflowPolicy::DropNewest),
            Pushed::Rejected(4)
        );
        assert_eq!(
            q.push(p(2), 5, 2, OverflowPolicy::Disconnect),
            Pushed::Overflow(5)
        );
        // Other levels have their own bound.
        assert_eq!(
            q.push(p(0), 6, 2, OverflowPolicy::Disconnect),
            Pushed::Queued { was_empty: false }
        );
        assert_eq!(q.len(), 3);
        assert_eq!(q.level_len(p(2)), 2);
        assert_eq!(q.take_all(), vec![6, 2, 3]);
        assert_eq!(
            q.push(p(0), 7, 0, OverflowPolicy::DropOldest),
            Pushed::Rejected(7)
        );
    }

    #[test]
    fn block_queues_past_capacity_and_says_so() {
        let mut q = PriorityQueues::default();
        assert_eq!(
            q.push(p(1), 1, 2, OverflowPolicy::Block),
            Pushed::Queued { was_empty: true }
        );
        q.push(p(1), 2, 2, OverflowPolicy::Block);
        assert_eq!(
            q.push(p(1), 3, 2, OverflowPolicy::Block),
            Pushed::QueuedFull { was_empty: false }
        );
        // Nothing is lost: the level holds more than its capacity.
        assert_eq!(q.take_all(), vec![1, 2, 3]);
    }
}
