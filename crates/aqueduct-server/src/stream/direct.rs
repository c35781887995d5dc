//! Direct writes: a publisher writes a delivery straight into an idle subscriber stream.
//!
//! A message on its way through the broker is handled by a chain of tasks: quinn's endpoint
//! driver, the publisher's connection driver, the publisher's stream task (which routes it), the
//! subscriber's stream task (which writes it) and the subscriber's connection driver (which
//! encrypts and sends it). Tokio runs a task woken by the one it is running next, on the same
//! thread, but only three times in a row; the fourth hand-over goes to the run queue and wakes
//! another worker, which may take the task to the other core. Each such wake-up crosses CPUs,
//! which on a virtual machine is most of a message's latency at moderate rates
//! (docs/benchmarks.md, "The coalescing window's yields, and direct writes").
//!
//! So while a stream's writer has nothing to do, it parks its sending half here
//! ([`StreamOut::park`]), and the publishing stream task, once it has handled a frame (no lock
//! held), drains the subscriptions it woke into their parked streams itself ([`scoped`]):
//! one hand-over fewer, and the chain fits. The writer stays in charge of everything else: a
//! stream with a backlog (more than [`DIRECT_MAX_QUEUED`] messages: a batch frame, a burst;
//! under load the drains of many streams then run on their own tasks, in parallel), one that is
//! busy while the coalescing window is long enough to be waited for (its last write less than a
//! `broker.flush_interval` of 1 ms or more ago), one with a revocation or a SLOW_CONSUMER ERROR
//! to send, or whose write did not go through at once (flow control) is handed to it by waking
//! it, as before; so are all but the first [`DIRECT_MAX_STREAMS`] streams one frame woke (a wide
//! fan-out is written by the streams' own tasks, in parallel). Only one side holds the parked
//! half at a time (its mutex), so writes never interleave.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::{coalesces, fill_queued, lock, SendHalf, StreamOut, WriteFailure, DRAIN_SLACK};
use crate::connection::ConnState;
use crate::server::Shared;

/// A parked sending half, as publishers use it: written into, or taken back by its writer.
trait ParkedSend: Send {
    fn write_now(&mut self, chunk: &mut Bytes) -> Result<bool, WriteFailure>;
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<S: SendHalf + 'static> ParkedSend for S {
    fn write_now(&mut self, chunk: &mut Bytes) -> Result<bool, WriteFailure> {
        SendHalf::write_now(self, chunk)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A writer's sending half and buffer while it waits for work.
pub(super) struct Parked {
    send: Box<dyn ParkedSend>,
    conn: Arc<ConnState>,
    pub(super) buf: BytesMut,
    /// What a direct write could not get out at once; the writer sends it first.
    pub(super) pending: Bytes,
    pub(super) last_write: Option<Instant>,
    pub(super) hint: usize,
}

impl std::fmt::Debug for Parked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parked")
            .field("buf", &self.buf.len())
            .field("pending", &self.pending.len())
            .field("last_write", &self.last_write)
            .finish()
    }
}

/// What the writer gets back when it takes its half again.
pub(super) struct Unparked<S> {
    /// The box the writer parked: moving it in and out allocates nothing.
    pub(super) send: Box<S>,
    pub(super) buf: BytesMut,
    pub(super) last_write: Option<Instant>,
    pub(super) hint: usize,
}

impl StreamOut {
    /// Park the writer's sending half (see the module docs). The writer keeps its half boxed
    /// for its whole life, so that parking (once per idle period) moves the box and allocates
    /// nothing.
    pub(super) fn park<S: SendHalf + 'static>(
        &self,
        send: Box<S>,
        conn: Arc<ConnState>,
        buf: BytesMut,
        last_write: Option<Instant>,
        hint: usize,
    ) {
        *lock(&self.direct) = Some(Parked {
            send,
            conn,
            buf,
            pending: Bytes::new(),
            last_write,
            hint,
        });
    }

    /// Take the parked half back: what a direct write left unsent is put before the buffer.
    /// `None` only if nothing is parked, or what is parked is not an `S` (neither happens: the
    /// writer parks its own half and is the only one to take it).
    pub(super) fn unpark<S: SendHalf + 'static>(&self) -> Option<Unparked<S>> {
        let p = lock(&self.direct).take()?;
        let send = p.send.into_any().downcast::<S>().ok()?;
        let buf = if p.pending.is_empty() {
            p.buf
        } else {
            let mut b = BytesMut::with_capacity(p.pending.len() + p.buf.len());
            b.extend_from_slice(&p.pending);
            b.extend_from_slice(&p.buf);
            b
        };
        Some(Unparked {
            send,
            buf,
            last_write: p.last_write,
            hint: p.hint,
        })
    }

    /// Write what this stream's subscriptions have queued into its parked half, if the stream
    /// is idle and quiet and nothing else waits; otherwise wake its writer.
    fn write_direct(&self, shared: &Shared) {
        if !self.try_write_direct(shared) {
            self.notify.notify_one();
        }
    }

    /// Messages queued for this stream's subscriptions (approximately: without their locks).
    fn backlog(&self) -> usize {
        lock(&self.subs).iter().map(|s| s.queued_approx()).sum()
    }

    /// `true` if the writer need not be woken: everything drained was written.
    fn try_write_direct(&self, shared: &Shared) -> bool {
        // Held by the writer taking its half back, or by another publisher writing here.
        let Ok(mut slot) = self.direct.try_lock() else {
            return false;
        };
        let Some(p) = slot.as_mut() else {
            return false;
        };
        let now = Instant::now();
        // Replies queued meanwhile need no care: the drain takes them first, as the writer's
        // would (`fill_queued`).
        let unusual = !p.pending.is_empty()
            || !p.buf.is_empty()
            || self.aborted.load(Ordering::Acquire)
            || self.revoke_pending.load(Ordering::Acquire)
            || self.slow_error_pending.load(Ordering::Acquire);
        // A busy stream's writes are coalesced by its writer: one waiting on a timer window,
        // or one with a backlog (a batch frame, a burst). A backlog is the writer's also so that
        // the drains of many subscriber streams run on their own tasks, spread over the
        // runtime's threads, not all on the publisher's.
        let busy = coalesces(p.last_write, now, shared.config.flush_interval);
        if unusual || busy || self.backlog() > DIRECT_MAX_QUEUED {
            return false;
        }
        let batch = shared.config.batch_size;
        // Not `fill`: revocations are the writer's (access.rs). One requested meanwhile is
        // left to it: the deliveries drained here were routed before it.
        fill_queued(self, shared, &p.conn, &mut p.buf, batch, p.hint);
        let revocation = self.revoke_pending.load(Ordering::Acquire);
        if p.buf.is_empty() {
            return !revocation;
        }
        if self.slow_error_pending.load(Ordering::Acquire) {
            // A SLOW_CONSUMER ERROR is in the buffer: its write needs the writer's watch for a
            // blocked stream (which it resets instead).
            return false;
        }
        let mut chunk = p.buf.split().freeze();
        let len = chunk.len();
        match p.send.write_now(&mut chunk) {
            Ok(true) => {
                shared.stats.add_out(len);
                shared.stats.direct_writes.fetch_add(1, Ordering::Relaxed);
                p.hint = (2 * len).min(batch) + DRAIN_SLACK.min(len);
                if p.buf.capacity() > 2 * p.hint {
                    p.buf = BytesMut::new();
                }
                p.last_write = Some(now);
                // A full budget may have left more queued, and the next enqueue will not wake
                // anyone (its queue is not empty): the writer takes the rest, coalescing.
                len < batch && !revocation
            }
            // Flow control held some back, or the write failed: the writer sends the rest, or
            // meets the failure itself.
            Ok(false) | Err(_) => {
                shared.stats.add_out(len - chunk.len());
                p.pending = chunk;
                false
            }
        }
    }
}

/// A stream with more messages queued than this is left to its writer (see
/// [`StreamOut::try_write_direct`]): a direct write is for the lone message of a quiet stream.
const DIRECT_MAX_QUEUED: usize = 8;

/// At most this many streams are written directly after one frame; the others' writers are
/// woken, so that a wide fan-out is written in parallel.
const DIRECT_MAX_STREAMS: usize = 4;

thread_local! {
    /// The streams woken while a stream task handles a frame (see [`scoped`]); `None` outside.
    static WOKEN: RefCell<Option<Vec<Arc<StreamOut>>>> = const { RefCell::new(None) };
    /// The list's allocation between frames, so that handling a frame allocates nothing.
    static SPARE: Cell<Vec<Arc<StreamOut>>> = const { Cell::new(Vec::new()) };
}

/// A spare list larger than this is let go rather than kept for the next frame.
const SPARE_MAX: usize = 1024;

/// A subscription of `out` has something new: inside [`scoped`], note the stream for a direct
/// write; elsewhere, wake its writer.
pub(crate) fn wake(out: &Arc<StreamOut>) {
    let noted = WOKEN
        .try_with(|w| match w.borrow_mut().as_mut() {
            Some(list) => {
                // Only the last one is compared (a stream's subscriptions are woken one after
                // another), so that a fan-out to N streams costs N, not N². A stream noted twice
                // is harmless: the second try finds nothing queued.
                if !list.last().is_some_and(|o| Arc::ptr_eq(o, out)) {
                    list.push(out.clone());
                }
                true
            }
            None => false,
        })
        .unwrap_or(false);
    if !noted {
        out.notify.notify_one();
    }
}

/// Run `f` (a stream task handling one frame, synchronously), then write into the streams it
/// woke: directly where they are idle, by waking their writers elsewhere. Called where no lock
/// is held, so the direct writes may take the locks their drain needs.
pub(super) fn scoped<R>(shared: &Shared, f: impl FnOnce() -> R) -> R {
    scoped_with(f, |out| out.write_direct(shared))
}

/// [`scoped`], with `write` doing the direct write of each stream noted (or waking its writer).
fn scoped_with<R>(f: impl FnOnce() -> R, mut write: impl FnMut(&StreamOut)) -> R {
    let outer = WOKEN.with(|w| {
        let mut w = w.borrow_mut();
        let outer = w.is_some();
        if !outer {
            *w = Some(SPARE.take());
        }
        outer
    });
    if outer {
        return f();
    }
    let mut noted = Noted {
        list: Vec::new(),
        written: 0,
    };
    let r = f();
    noted.list = WOKEN.with(|w| w.borrow_mut().take()).unwrap_or_default();
    // A wide fan-out is written by the streams' own writers, in parallel over the runtime's
    // threads, except for the first few: woken first, so that they start while this task
    // writes.
    for out in noted.list.iter().skip(DIRECT_MAX_STREAMS) {
        out.notify.notify_one();
    }
    noted.list.truncate(DIRECT_MAX_STREAMS);
    while let Some(out) = noted.list.get(noted.written) {
        write(out);
        noted.written += 1;
    }
    r
}

/// The streams a frame woke, of which the first `written` are written. Dropped, it wakes the
/// writers of the rest, and so of all of them if handling the frame panicked (then the list
/// is still in `WOKEN`): a subscriber is woken only when its queue stops being empty, so a lost
/// wake-up would stall it. Then it keeps its allocation for the next frame.
struct Noted {
    list: Vec<Arc<StreamOut>>,
    written: usize,
}

impl Drop for Noted {
    fn drop(&mut self) {
        if let Ok(Some(list)) = WOKEN.try_with(|w| w.borrow_mut().take()) {
            self.list = list;
            self.written = 0;
        }
        for out in &self.list[self.written.min(self.list.len())..] {
            out.notify.notify_one();
        }
        if self.list.capacity() <= SPARE_MAX {
            self.list.clear();
            let spare = std::mem::take(&mut self.list);
            let _ = SPARE.try_with(|s| s.set(spare));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    /// A sending half that only tells itself apart.
    struct Half(u32);

    impl SendHalf for Half {
        fn write_some(
            &mut self,
            chunk: &mut Bytes,
        ) -> impl Future<Output = Result<(), WriteFailure>> + Send {
            chunk.clear();
            std::future::ready(Ok(()))
        }
        fn stopped(&mut self) -> impl Future<Output = Option<String>> + Send {
            std::future::pending()
        }
        fn reset(&mut self, _: u32) {}
        fn finish(&mut self) {}
    }

    fn conn() -> Arc<ConnState> {
        Arc::new(ConnState::new(
            1,
            "127.0.0.1:1".parse().expect("an address"),
        ))
    }

    /// Parking moves the writer's box and taking it back returns the same box: an idle period
    /// costs no allocation (a writer that parks after every message would otherwise allocate once
    /// per message).
    #[test]
    fn parking_moves_the_writers_box() {
        let out = StreamOut::default();
        let conn = conn();
        let mut send = Box::new(Half(7));
        for round in 0..3 {
            let at: *const Half = &*send;
            out.park(send, conn.clone(), BytesMut::new(), None, round);
            let back = out.unpark::<Half>().expect("the parked half");
            assert!(std::ptr::eq(&*back.send, at), "round {round}: a new box");
            assert_eq!(back.send.0, 7);
            assert_eq!(back.hint, round);
            send = back.send;
        }
        assert!(out.unpark::<Half>().is_none(), "nothing parked any more");
    }

    /// Whether `out`'s writer has been woken (a stored permit), without waiting.
    fn woken(out: &StreamOut) -> bool {
        let notified = std::pin::pin!(out.notify.notified());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        notified.poll(&mut cx).is_ready()
    }

    /// The first few streams a frame woke are written directly; the writers of the rest are
    /// woken (and not the first ones': their write was done).
    #[test]
    fn a_frame_writes_the_first_streams_and_wakes_the_rest() {
        let outs: Vec<Arc<StreamOut>> = (0..DIRECT_MAX_STREAMS + 2)
            .map(|_| Arc::new(StreamOut::default()))
            .collect();
        let mut written = Vec::new();
        scoped_with(
            || outs.iter().for_each(wake),
            |out| written.push(out as *const StreamOut),
        );
        let expected: Vec<*const StreamOut> =
            outs[..DIRECT_MAX_STREAMS].iter().map(Arc::as_ptr).collect();
        assert_eq!(written, expected);
        let woke: Vec<bool> = outs.iter().map(|o| woken(o)).collect();
        let mut want = vec![false; DIRECT_MAX_STREAMS];
        want.extend([true, true]);
        assert_eq!(woke, want);
    }

    /// A frame whose handling panicked still wakes every stream it had noted (a subscriber is
    /// woken only when its queue stops being empty: a lost wake-up would stall it for good), and
    /// the thread is left outside any scope, so that later wake-ups go straight to the writers.
    #[test]
    fn a_panic_while_handling_a_frame_loses_no_wake_up() {
        let (a, b, later) = (
            Arc::new(StreamOut::default()),
            Arc::new(StreamOut::default()),
            Arc::new(StreamOut::default()),
        );
        let mut writes = 0;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scoped_with(
                || {
                    wake(&a);
                    wake(&b);
                    panic!("a bug while handling a frame");
                },
                |_| writes += 1,
            )
        }));
        assert!(r.is_err());
        assert_eq!(writes, 0, "nothing written after the panic");
        assert!(woken(&a) && woken(&b), "both writers woken");
        wake(&later);
        assert!(
            woken(&later),
            "outside a scope, a wake-up reaches the writer at once"
        );
    }

    /// What a direct write left unsent goes before the buffer when the writer takes its half back.
    #[test]
    fn unpark_puts_the_unsent_rest_first() {
        let out = StreamOut::default();
        let conn = conn();
        out.park(
            Box::new(Half(1)),
            conn,
            BytesMut::from(&b"later"[..]),
            None,
            0,
        );
        lock(&out.direct).as_mut().expect("parked").pending = Bytes::from_static(b"first ");
        let back = out.unpark::<Half>().expect("the parked half");
        assert_eq!(&back.buf[..], b"first later");
    }
}
