//! Messages on their way from one place of a durable consumer to another.
//!
//! A durable consumer's position is read from several places one after another: its feeder's
//! next offsets, each subscription's queue and unsettled deliveries, its group's parked
//! messages. A NACK, an ack-wait timeout or a member leaving takes a message out of one place
//! and puts it into another (the same subscription's queue, another member's, the group's
//! parked ones); a position read while the message is between the two, or read from the new
//! place before and the old one after the move, misses it, and a checkpoint that saves that
//! position skips it for good if the broker crashes before the next one.
//!
//! [`Moves`] counts moves begun and finished (a seqlock without a writer lock): every move takes
//! a [`Moving`] before it takes a message out and drops it once the message is placed, and a
//! reader keeps what it read only if no move was in progress at any moment while it read.
//! A move is short (no I/O, no waiting), so a reader that retries soon reads a settled state.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// Reads [`Moves::read_settled_within`] tries again at once before it pauses between them.
const QUICK_READS: usize = 1_000;

/// Moves begun and finished among one durable consumer's places (its subscription's for a
/// plain consumer, its group's for a group).
#[derive(Debug, Default)]
pub struct Moves {
    begun: AtomicU64,
    finished: AtomicU64,
}

impl Moves {
    /// A move begins: hold the guard from before the message is taken out until it is placed.
    /// (Public so that tests elsewhere can hold a move open: a reader then never settles.)
    #[doc(hidden)]
    pub fn begin(&self) -> Moving<'_> {
        self.begun.fetch_add(1, SeqCst);
        Moving(self)
    }

    /// A move begins whose end is not tied to a scope: [`end`](Self::end) must follow.
    pub(crate) fn begin_detached(&self) {
        self.begun.fetch_add(1, SeqCst);
    }

    /// The end of a move begun with [`begin_detached`](Self::begin_detached).
    pub(crate) fn end(&self) {
        self.finished.fetch_add(1, SeqCst);
    }

    /// What `read` returns, if no move was in progress at any moment while it ran; `None`
    /// otherwise (read again). `read` must take the locks of the places it reads: a move
    /// that took a message out of a place `read` saw without it had begun before that lock
    /// was released, and so is counted here.
    pub fn read_settled<T>(&self, read: impl FnOnce() -> T) -> Option<T> {
        let finished = self.finished.load(SeqCst);
        let value = read();
        (self.begun.load(SeqCst) == finished).then_some(value)
    }

    /// [`read_settled`](Self::read_settled), read again until a read is settled: at once at
    /// first (a move is short), then after growing pauses — the thread making the move may have
    /// been preempted in the middle of it, on a busy machine for milliseconds — for at most
    /// `patience` in all. `None` if moves overlapped every read meanwhile. Blocks the thread:
    /// for a reader that must not go on with an unsettled read.
    pub fn read_settled_within<T>(
        &self,
        mut read: impl FnMut() -> T,
        patience: Duration,
    ) -> Option<T> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        for attempt in 0.. {
            if let Some(value) = self.read_settled(&mut read) {
                return Some(value);
            }
            if start.elapsed() >= patience {
                break;
            }
            if attempt < QUICK_READS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
        None
    }

    /// Moves in progress now (for tests and diagnostics).
    pub fn in_progress(&self) -> u64 {
        let finished = self.finished.load(SeqCst);
        self.begun.load(SeqCst).saturating_sub(finished)
    }
}

/// A move in progress (see [`Moves::begin`]); it ends when dropped.
#[derive(Debug)]
#[must_use = "the move ends when this is dropped"]
pub struct Moving<'a>(&'a Moves);

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_overlapping_a_move_is_not_kept() {
        let moves = Moves::default();
        assert_eq!(moves.read_settled(|| 1), Some(1));
        let moving = moves.begin();
        assert_eq!(moves.read_settled(|| 2), None, "a move was in progress");
        assert_eq!(moves.in_progress(), 1);
        drop(moving);
        assert_eq!(moves.read_settled(|| 3), Some(3));
        // A move that begins while the read runs, and even ends before it returns, spoils it.
        assert_eq!(moves.read_settled(|| drop(moves.begin())), None);
        moves.begin_detached();
        assert_eq!(moves.read_settled(|| 4), None);
        moves.end();
        assert_eq!(moves.read_settled(|| 5), Some(5));
        assert_eq!(moves.in_progress(), 0);
    }

    /// A move whose thread is held up in the middle of it (preempted, on a busy machine) for
    /// longer than a thousand quick reads: a patient read waits it out and reads the message in
    /// its new place, rather than giving up (a durable consumer's rewind then went on with a
    /// read that missed the message, and its position skipped it).
    #[test]
    fn a_patient_read_waits_out_a_move_held_up_midway() {
        use std::sync::{Arc, Mutex};
        let moves = Arc::new(Moves::default());
        // The message's places: (in flight, queued).
        let places = Arc::new(Mutex::new((Some(7u64), None::<u64>)));
        moves.begin_detached();
        places.lock().expect("places").0 = None; // taken out
        let mover = {
            let (moves, places) = (moves.clone(), places.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50)); // held up
                places.lock().expect("places").1 = Some(7); // placed
                moves.end();
            })
        };
        let read = || {
            let p = places.lock().expect("places");
            p.0.or(p.1)
        };
        let got = moves.read_settled_within(read, Duration::from_secs(30));
        assert_eq!(got, Some(Some(7)), "read where the move placed it");
        mover.join().expect("mover");
        // A move that never ends: the read gives up once its patience is spent.
        moves.begin_detached();
        assert_eq!(
            moves.read_settled_within(read, Duration::from_millis(20)),
            None
        );
    }
}
