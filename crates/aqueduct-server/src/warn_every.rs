//! Warnings that could repeat many times a second (a peer refused at every reconnect, a dial
//! failing at every retry, a read of the log failing at every try): each is warned about once,
//! then again only after an interval or when what it says changes. The ones held back meanwhile
//! are for the caller to log at debug level; the next warning says how many there were.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Per key (what a warning is about): what was last warned about, when, and how many warnings
/// were held back since.
#[derive(Debug)]
pub(crate) struct WarnEvery<K, W = ()> {
    every: Duration,
    warned: HashMap<K, Warned<W>>,
}

#[derive(Debug)]
struct Warned<W> {
    what: W,
    at: Instant,
    held_back: u64,
}

impl<K: Eq + Hash, W: PartialEq> WarnEvery<K, W> {
    pub(crate) fn new(every: Duration) -> Self {
        WarnEvery {
            every,
            warned: HashMap::new(),
        }
    }

    /// Whether a warning about `key` saying `what` is due at `now`: none was given about `key`,
    /// or it said something else, or it was `every` or longer ago. If due, it is noted and the
    /// count held back since the last one saying the same is returned (and reset; 0 when what
    /// is said changed); if not, `None`, and one more is counted as held back.
    pub(crate) fn due(&mut self, key: K, what: W, now: Instant) -> Option<u64> {
        let every = self.every;
        match self.warned.get_mut(&key) {
            Some(w) if w.what == what && now.saturating_duration_since(w.at) < every => {
                w.held_back += 1;
                None
            }
            Some(w) => {
                let held_back = std::mem::take(&mut w.held_back);
                w.at = now;
                if w.what == what {
                    Some(held_back)
                } else {
                    w.what = what;
                    Some(0)
                }
            }
            None => {
                let held_back = 0;
                self.warned.insert(
                    key,
                    Warned {
                        what,
                        at: now,
                        held_back,
                    },
                );
                Some(held_back)
            }
        }
    }

    /// Forget `key` (it recovered): the next warning about it is due at once. Returns whether
    /// it had been warned about.
    pub(crate) fn forget(&mut self, key: &K) -> bool {
        self.warned.remove(key).is_some()
    }

    /// Keep only the keys `keep` says yes to.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.warned.retain(|k, _| keep(k));
    }

    /// Forget the keys last warned about `every` or longer before `now`: their next warning is
    /// due anyway, and keys that never come back leave nothing behind (what was held back of
    /// them is not counted in a later warning).
    pub(crate) fn forget_expired(&mut self, now: Instant) {
        let every = self.every;
        self.warned
            .retain(|_, w| now.saturating_duration_since(w.at) < every);
    }

    /// The keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.warned.len()
    }
}

/// How a warning says that `more` of its kind were logged at debug level since the last one.
pub(crate) fn held_back(more: u64, what: &str) -> String {
    match more {
        0 => String::new(),
        n => format!(" (and {n} more {what} since the last such warning, logged at debug level)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn once_per_interval_per_key_counting_what_was_held_back() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w: WarnEvery<&str> = WarnEvery::new(MINUTE);
        assert_eq!(w.due("a", (), t0), Some(0));
        assert_eq!(w.due("a", (), t0 + s(5)), None);
        assert_eq!(w.due("a", (), t0 + s(59)), None);
        assert_eq!(w.due("b", (), t0 + s(1)), Some(0), "another key");
        assert_eq!(w.due("a", (), t0 + MINUTE), Some(2), "two held back");
        assert_eq!(w.due("a", (), t0 + MINUTE + s(1)), None);
        assert_eq!(
            w.due("a", (), t0 + 2 * MINUTE),
            Some(1),
            "the count restarts"
        );
    }

    #[test]
    fn a_change_in_what_is_said_is_due_at_once() {
        let t0 = Instant::now();
        let mut w: WarnEvery<u8, &str> = WarnEvery::new(MINUTE);
        assert_eq!(w.due(1, "timed out", t0), Some(0));
        assert_eq!(w.due(1, "timed out", t0), None);
        assert_eq!(
            w.due(1, "refused", t0),
            Some(0),
            "what was held back said otherwise"
        );
        assert_eq!(w.due(1, "refused", t0), None);
        let later = t0 + MINUTE;
        assert_eq!(w.due(1, "refused", later), Some(1));
    }

    #[test]
    fn forgotten_keys_are_due_again_and_expired_ones_leave_nothing() {
        let t0 = Instant::now();
        let mut w: WarnEvery<u8> = WarnEvery::new(MINUTE);
        assert_eq!(w.due(1, (), t0), Some(0));
        assert!(w.forget(&1));
        assert!(!w.forget(&1), "once");
        assert_eq!(w.due(1, (), t0), Some(0));
        assert_eq!(w.due(2, (), t0 + Duration::from_secs(30)), Some(0));
        assert_eq!(w.due(3, (), t0 + Duration::from_secs(30)), Some(0));
        w.retain(|k| *k != 3);
        assert_eq!(w.len(), 2);
        w.forget_expired(t0 + MINUTE);
        assert_eq!(w.len(), 1, "1 expired, 2 is within the minute");
        assert_eq!(w.due(2, (), t0 + MINUTE), None);
    }

    #[test]
    fn a_warning_says_how_many_were_held_back() {
        assert_eq!(held_back(0, "refusals"), "");
        assert_eq!(
            held_back(3, "failures"),
            " (and 3 more failures since the last such warning, logged at debug level)"
        );
    }
}
