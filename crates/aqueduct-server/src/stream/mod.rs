//! One QUIC bidirectional stream: a reader that decodes and handles the client's frames, and a
//! coalescing writer that sends replies (CONFIRM, ERROR) and the deliveries of every subscription
//! whose SUBSCRIBE arrived on this stream.
//!
//! The writer flushes when `broker.batch_size` bytes are pending, or at most
//! `broker.flush_interval` after it started gathering, always taking the highest priority first
//! (the core's drain order). It only waits while the stream is busy (its last write was less than
//! a window ago); on a quiet stream a message is written at once. A window of 1 ms or more (at
//! most 100 ms, see the config) sleeps on a timer. Tokio's timers cannot wait less, so a shorter
//! window (the default is 50 µs) is not waited for at all: the writer takes everything queued
//! when it runs, and what publishers add while it writes goes out together in the next write.
//! Waiting by yielding to the runtime instead, as this writer once did, cost latency and gained
//! no throughput: each `yield_now` of a multi-thread runtime wakes another worker thread
//! (docs/benchmarks.md, "The coalescing window's yields").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use aqueduct_core::acl::AclCache;
use aqueduct_core::{
    CloseReason, Publication, PublishContext, SubscribeOptions, Subscriber, SubscriberId,
    TopicState,
};
use aqueduct_proto::frame::{split_frame, Message};
use aqueduct_proto::{
    AckMode, Confirm, DecodeError, ErrorCode, ErrorFrame, Frame, Info, OverflowPolicy, HEADER_LEN,
};
use bytes::{Buf, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::sync::{watch, Notify};
use tracing::{debug, info, warn};

use crate::connection::{AddSubError, ConnState, SubEntry};

mod access;
mod direct;
mod io;
use crate::consumers::{ClaimError, Consumers};
use crate::durable::{Durable, Waiter};
use crate::otel;
use crate::server::Shared;
pub(crate) use access::request_revoke;
use access::revoke;
pub(crate) use io::{RecvHalf, SendHalf, WriteFailure};

/// Reply bytes a client may leave unread before the broker stops reading its stream.
const MAX_PENDING_CONTROL: usize = 1 << 20;
/// Frames of a stream the durable log may owe answers to (CONFIRMs, and ERRORs waiting behind
/// them) before the broker stops reading the stream until the log catches up.
const MAX_LOG_UNANSWERED: usize = 1 << 16;
/// How long a finished stream waits for the client to read what is left.
const FINISH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Coalescing windows at least this long wait on a timer; shorter ones (tokio timers have a
/// 1 ms resolution) are not waited for (see the module docs).
const TIMER_WINDOW: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether a write starting `now` waits for the coalescing `window` (`broker.flush_interval`):
/// only on a busy stream (its last write less than a window ago), and only for a window long
/// enough to wait on a timer.
fn coalesces(last_write: Option<Instant>, now: Instant, window: std::time::Duration) -> bool {
    window >= TIMER_WINDOW && last_write.is_some_and(|t| now.duration_since(t) < window)
}
/// Read granularity: publishers' frames are read in chunks of up to this many bytes.
const READ_CHUNK: usize = 64 * 1024;
/// A throttled reader re-checks its quota at least this often.
const QUOTA_RECHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// What the reader shares with the writer of the same stream.
#[derive(Debug, Default)]
pub(crate) struct StreamOut {
    /// Encoded reply frames waiting for the writer.
    control: Mutex<BytesMut>,
    /// Subscriptions delivered on this stream. Locked by the reader to add, by the writer to
    /// drain; the writer takes each subscriber's own lock while holding it (never the reverse).
    subs: Mutex<Vec<Arc<Subscriber>>>,
    /// Subscriptions to close because the ACL no longer allows them (see [`request_revoke`]).
    revoking: Mutex<Vec<Arc<Subscriber>>>,
    /// `revoking` is not empty (checked first, so the writer takes no lock for it normally).
    revoke_pending: AtomicBool,
    /// Durable consumers (and durable group members) among them: subscriber → the key of its
    /// consumer or group. Ending the subscription ends it there too (the last one stops the
    /// feeder, so no feeder outlives its consumer's subscriptions).
    durables: Mutex<HashMap<SubscriberId, String>>,
    /// Wakes the writer: new replies, new deliveries, state changes.
    pub(crate) notify: Notify,
    /// Wakes the reader when the writer has flushed replies (backpressure on unread replies).
    flushed: Notify,
    /// The reader is done (client finished its side, or a fatal framing error).
    reader_done: AtomicBool,
    /// When the client finished its side (or a fatal framing error ended the reading): from
    /// then on a write the client does not take within [`FINISH_WAIT`] is given up
    /// (protocol.md 7.4).
    finished_at: std::sync::OnceLock<Instant>,
    /// The reader has ended, however (also a reset or the connection's end): the writer's
    /// last duty, taking revocations after it stopped writing, ends too.
    read_ended: AtomicBool,
    /// Publish frames of this stream whose answer (CONFIRM, or STORAGE_FAILED) the durable log
    /// still owes: the stream does not finish before they are answered.
    log_unanswered: AtomicUsize,
    /// Bytes of replies to this stream (ERROR, INFO) waiting in the durable log's queue behind
    /// the answers it owes: they count toward [`MAX_PENDING_CONTROL`] as the replies queued in
    /// `control` do (the log pushes them all there at once when it answers).
    log_reply_bytes: AtomicUsize,
    /// Where in `subs` the next write starts draining (see `fill`).
    drain_from: AtomicUsize,
    /// The stream is over: the writer must stop (peer stopped reading, connection closed).
    aborted: AtomicBool,
    /// The client stopped reading the stream (STOP_SENDING), or its connection is gone: its
    /// sending half is reset with the client's code when dropped, not with 0 by the writer.
    stopped_by_client: AtomicBool,
    /// The stream's task has ended (its subscriptions are ended): no revocation is taken.
    pub(crate) ended: AtomicBool,
    /// The reader was stopped by shutdown before the client finished the stream.
    interrupted: AtomicBool,
    /// A SLOW_CONSUMER ERROR is in the writer's buffer, not yet accepted by QUIC: if its write
    /// blocks on flow control, the stream is reset with that code instead.
    slow_error_pending: AtomicBool,
    /// The writer's sending half while it is idle, for publishers to write into directly
    /// (`direct.rs`).
    direct: Mutex<Option<direct::Parked>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StreamOut {
    /// A publish frame went to the durable log, which will answer it on this stream.
    pub(crate) fn await_log(&self) {
        self.log_unanswered.fetch_add(1, Ordering::AcqRel);
    }

    /// A reply of `bytes` waits in the durable log's queue (see `log_reply_bytes`).
    pub(crate) fn reply_in_log(&self, bytes: usize) {
        self.log_reply_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// The log queued here a reply of `bytes` that waited in its queue. A reader held by it is
    /// woken if it may read now (after STOP_SENDING the reply was dropped, and no flush will
    /// wake it).
    pub(crate) fn reply_out_of_log(&self, bytes: usize) {
        self.log_reply_bytes.fetch_sub(bytes, Ordering::AcqRel);
        if self.may_read() {
            self.flushed.notify_waiters();
        }
    }

    /// The log answered one (its answer is already queued here).
    pub(crate) fn log_answered(&self) {
        let before = self.log_unanswered.fetch_sub(1, Ordering::AcqRel);
        self.notify.notify_one();
        if before == MAX_LOG_UNANSWERED + 1 {
            // Back at the bound the reader waits for (see `Reader::run`).
            self.flushed.notify_waiters();
        }
    }

    pub(crate) fn push_frame(&self, frame: &Frame) {
        {
            let mut control = lock(&self.control);
            // Once the stream is over for writing (the client stopped reading it, or it is
            // gone) no reply is ever sent: dropped, so that a reader that goes on reading
            // (after STOP_SENDING) is not held back by replies that cannot go out.
            if self.aborted.load(Ordering::Acquire) {
                return;
            }
            frame.encode(&mut *control);
        }
        self.notify.notify_one();
    }

    fn control_len(&self) -> usize {
        lock(&self.control).len()
    }

    /// May the reader read more of the stream? Not while the client leaves too many replies
    /// unread, nor while the durable log owes too many answers (the writer, or the log's
    /// answer, wakes `flushed` when that changes).
    fn may_read(&self) -> bool {
        self.control_len() + self.log_reply_bytes.load(Ordering::Acquire) <= MAX_PENDING_CONTROL
            && self.log_unanswered.load(Ordering::Acquire) <= MAX_LOG_UNANSWERED
    }

    /// Wait until the reader may read on (backpressure: a client that does not read its
    /// replies, or a durable log that owes too many answers, stops the reading; `held` counts
    /// the waits). False if the stream was reset (or its connection lost) meanwhile: it ends
    /// at once (§1.1). The `Notified` is registered before the check, so a flush in between is
    /// not missed. After STOP_SENDING (`aborted`) no reply is kept, so only the log's answers
    /// can hold the reader, and it waits for them: the stream is still read (§1.1).
    async fn wait_to_read(&self, recv: &mut impl RecvHalf, held: &AtomicU64) -> bool {
        let mut counted = false;
        loop {
            let flushed = self.flushed.notified();
            tokio::pin!(flushed);
            flushed.as_mut().enable();
            if self.may_read() {
                return true;
            }
            if !counted {
                counted = true;
                held.fetch_add(1, Ordering::Relaxed);
            }
            tokio::select! {
                () = flushed => {}
                () = recv.reset() => return false,
            }
        }
    }

    /// Queue `sub` to be closed by this stream's task (see [`request_revoke`]). False if it is
    /// queued already, or if the task has ended: its subscriptions are ended then, and one kept
    /// here would hold this stream's state alive through its waker (a reference cycle).
    pub(crate) fn queue_revocation(&self, sub: &Arc<Subscriber>) -> bool {
        let mut revoking = lock(&self.revoking);
        if self.ended.load(Ordering::Acquire) || revoking.iter().any(|s| Arc::ptr_eq(s, sub)) {
            return false;
        }
        revoking.push(sub.clone());
        self.revoke_pending.store(true, Ordering::Release);
        true
    }

    /// The stream's task has ended: no revocation is taken from now on, and those taken are
    /// let go (their subscriptions were ended with the stream).
    fn end_revocations(&self) {
        let mut revoking = lock(&self.revoking);
        self.ended.store(true, Ordering::Release);
        revoking.clear();
    }

    pub(crate) fn abort(&self) {
        {
            // Under the replies' lock, as `push_frame` checks it: none is queued after this.
            let mut control = lock(&self.control);
            self.aborted.store(true, Ordering::Release);
            control.clear();
        }
        self.notify.notify_one();
        // A reader waiting for unread replies to be flushed must see it too: nothing will flush
        // them any more.
        self.flushed.notify_waiters();
    }
}

/// How the reader ended.
enum ReadEnd {
    /// The client finished its sending side (FIN), or the frame boundary was lost (bad magic,
    /// oversized frame: ERROR sent): the client will send nothing more here.
    Finished,
    /// The stream was reset or the connection closed.
    Gone,
    /// The broker is shutting down and stopped reading, perhaps before the client's last frames.
    Interrupted,
}

/// Ends the stream's subscriptions and counts the stream as gone, however the stream task ends
/// (also when it is aborted with its connection).
struct StreamGuard {
    shared: Arc<Shared>,
    conn: Arc<ConnState>,
    out: Arc<StreamOut>,
}

impl StreamGuard {
    fn new(shared: &Arc<Shared>, conn: &Arc<ConnState>, out: &Arc<StreamOut>) -> StreamGuard {
        shared.stats.live_streams.fetch_add(1, Ordering::Relaxed);
        StreamGuard {
            shared: shared.clone(),
            conn: conn.clone(),
            out: out.clone(),
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // A task that ended while its writer was parked (aborted with its connection) leaves
        // the sending half here, holding the connection's state: let both go with the task.
        // Taken first: a publisher could otherwise still write deliveries straight into it
        // (lost with the connection, uncounted) instead of leaving them queued for the ends
        // below to count.
        let parked = lock(&self.out.direct).take();
        end_subscriptions(&self.shared, &self.conn, &self.out, |_| true);
        drop(parked);
        // Revocations asked for after the writer ended: the subscriptions are ended above.
        self.out.end_revocations();
        self.shared
            .stats
            .live_streams
            .fetch_sub(1, Ordering::Release);
        self.shared.stream_ended.notify_waiters();
    }
}

/// Unsubscribe the subscriptions delivered on this stream for which `which` holds.
fn end_subscriptions(
    shared: &Shared,
    conn: &ConnState,
    out: &StreamOut,
    which: impl Fn(&Subscriber) -> bool,
) {
    let ending: Vec<Arc<Subscriber>> = {
        let mut subs = lock(&out.subs);
        let (ending, keep) = std::mem::take(&mut *subs)
            .into_iter()
            .partition(|s| which(s));
        *subs = keep;
        ending
    };
    if ending.is_empty() {
        return;
    }
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for sub in ending {
        if !conn.end_with_stream(&sub) {
            continue;
        }
        let key = lock(&out.durables).remove(&sub.id());
        unsubscribe(shared, &mut ctx, &sub, key.as_deref(), now);
    }
    // The stream is ending: nothing to hold back for what its members handed on.
    shared.broker.watch_full(&mut ctx, now);
}

/// Run a broker call that may publish dead letters (a NACK, a subscription ending, a slow
/// consumer closed) so that, with the durable log, they are logged in order (see
/// [`Durable::with_order`]).
pub(crate) fn logged<T>(
    shared: &Shared,
    ctx: &mut PublishContext,
    f: impl FnOnce(&mut PublishContext) -> T,
) -> T {
    match &shared.durable {
        Some(d) => d.with_order(ctx, f),
        None => f(ctx),
    }
}

/// Remove a subscription from the broker (its dead letters logged in order). A durable one
/// (`key`: its consumer or group) ends there too: told before, while its unsettled messages are
/// still known (a position must not skip them), and after, once the broker has handed them on.
fn unsubscribe(
    shared: &Shared,
    ctx: &mut PublishContext,
    sub: &Arc<Subscriber>,
    key: Option<&str>,
    now: Instant,
) {
    close(shared, ctx, sub, key, CloseReason::Unsubscribed, now)
}

fn close(
    shared: &Shared,
    ctx: &mut PublishContext,
    sub: &Arc<Subscriber>,
    key: Option<&str>,
    reason: CloseReason,
    now: Instant,
) {
    let consumers = shared.consumers.as_ref().zip(key);
    if let Some((consumers, key)) = consumers {
        consumers.end(key, sub);
    }
    logged(shared, ctx, |ctx| match reason {
        CloseReason::Revoked => {
            shared.broker.revoke(ctx, sub, now);
        }
        _ => shared.broker.unsubscribe(ctx, sub, now),
    });
    if let Some((consumers, key)) = consumers {
        consumers.left(key, sub, &shared.broker);
    }
}

/// A durable consumer whose client stopped reading: its feeder stops and its position is
/// rewound to what it has not settled (the broker is about to drop its queue); it ends with its
/// stream, after whatever acknowledgements are still on their way.
fn stop_feeding(shared: &Shared, out: &StreamOut, sub: &Subscriber) {
    let key = lock(&out.durables).get(&sub.id()).cloned();
    if let (Some(key), Some(consumers)) = (key, &shared.consumers) {
        consumers.rewind(&key, sub);
    }
}

/// Stop routing to the subscriptions delivered on this stream (see [`Broker::detach`]).
///
/// [`Broker::detach`]: aqueduct_core::Broker::detach
fn detach_subscriptions(shared: &Shared, out: &StreamOut) {
    let subs: Vec<Arc<Subscriber>> = lock(&out.subs).clone();
    let mut ctx = PublishContext::default();
    let now = Instant::now();
    for sub in &subs {
        stop_feeding(shared, out, sub);
        logged(shared, &mut ctx, |ctx| shared.broker.detach(ctx, sub, now));
    }
    // Nothing here to hold back for what the members handed on: watched instead.
    shared.broker.watch_full(&mut ctx, now);
}

/// Route nothing more to the subscriptions delivered on this stream; what is queued for them
/// stays, for the writer's final flush.
fn stop_routing(shared: &Shared, out: &StreamOut) {
    for sub in lock(&out.subs).iter() {
        shared.broker.stop_routing(sub);
    }
}

/// The stream's subscriptions get nothing new: routing stops, and durable consumers' feeders
/// (which do not route) pause. What is queued is still written.
fn feed_nothing_more(shared: &Shared, out: &StreamOut) {
    stop_routing(shared, out);
    if let Some(consumers) = &shared.consumers {
        for (sub, key) in lock(&out.durables).iter() {
            consumers.pause(key, *sub);
        }
    }
}

/// Serve one stream until both directions are done. The reader and the writer run in this one
/// task (no detached writer), so aborting the task with its connection stops both, and the
/// guard still ends the stream's subscriptions.
pub(crate) async fn serve<S: SendHalf + 'static, R: RecvHalf>(
    send: S,
    recv: R,
    shared: Arc<Shared>,
    conn: Arc<ConnState>,
    shutdown: watch::Receiver<bool>,
) {
    let out = Arc::new(StreamOut::default());
    let _guard = StreamGuard::new(&shared, &conn, &out);
    let mut stop = shutdown.clone();
    let writer = write_loop(send, &out, &shared, &conn, shutdown);
    let read = async {
        let mut reader = Reader {
            shared: &shared,
            conn: &conn,
            out: &out,
            ctx: PublishContext::default(),
            routed: Vec::new(),
            acl: AclCache::default(),
        };
        // On shutdown stop reading at once; the writer flushes what is queued and finishes.
        let end = tokio::select! {
            biased;
            end = reader.run(recv) => end,
            _ = stop.wait_for(|stopping| *stopping) => ReadEnd::Interrupted,
        };
        match end {
            ReadEnd::Finished => {
                // Closing the sending side ends the stream's subscriptions: acknowledged ones
                // (group members, explicit ACK) at once, as an UNSUBSCRIBE would (a group
                // member's messages go to the other members); plain ones get nothing new and
                // end after the writer has sent what was queued.
                end_subscriptions(&shared, &conn, &out, |s| s.ack_mode() == AckMode::Explicit);
                feed_nothing_more(&shared, &out);
                let _ = out.finished_at.set(Instant::now());
                out.reader_done.store(true, Ordering::Release);
                out.notify.notify_one();
            }
            ReadEnd::Interrupted => {
                // The shutdown: the writer sends what is queued and finishes (§1.1). Nothing
                // new may be routed or fed meanwhile (peers' copies, redeliveries, durable
                // consumers' feeders), or it would never run dry and the connection would be
                // closed under deliveries written but not read.
                feed_nothing_more(&shared, &out);
                out.interrupted.store(true, Ordering::Release);
                out.reader_done.store(true, Ordering::Release);
                out.notify.notify_one();
            }
            ReadEnd::Gone => out.abort(),
        }
        out.read_ended.store(true, Ordering::Release);
        out.notify.notify_one();
    };
    let writer = async {
        writer.await;
        take_revocations_until_read_ends(&out, &shared, &conn).await;
    };
    tokio::join!(read, writer);
}

/// After the writer has stopped (the client stopped reading the stream, or it is gone) the
/// stream's subscriptions may still be revoked (the ACL changed) while the reader goes on:
/// this task still takes those revocations, so that ACK, NACK and UNSUBSCRIBE naming them get
/// NOT_SUBSCRIBED and a group member's in-flight messages go to the others (§11).
async fn take_revocations_until_read_ends(out: &StreamOut, shared: &Shared, conn: &ConnState) {
    loop {
        let notified = out.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        take_revocations(out, shared, conn);
        if out.read_ended.load(Ordering::Acquire) {
            return;
        }
        notified.await;
    }
}

/// Close the subscriptions queued for revocation (see [`request_revoke`]). On this stream's
/// own task only.
fn take_revocations(out: &StreamOut, shared: &Shared, conn: &ConnState) {
    if !out.revoke_pending.swap(false, Ordering::AcqRel) {
        return;
    }
    let revoking = std::mem::take(&mut *lock(&out.revoking));
    for sub in &revoking {
        revoke(shared, conn, out, sub);
    }
}

struct Reader<'a> {
    shared: &'a Arc<Shared>,
    conn: &'a Arc<ConnState>,
    out: &'a Arc<StreamOut>,
    ctx: PublishContext,
    /// With the durable log: each routed message's topic and offset, for the log's queue.
    routed: Vec<(Arc<TopicState>, u64)>,
    /// This stream's cached ACL decisions (filled only once the client's identity is known).
    acl: AclCache,
}

impl Reader<'_> {
    async fn run<R: RecvHalf>(&mut self, mut recv: R) -> ReadEnd {
        let limits = aqueduct_proto::Limits {
            max_data_len: self.shared.config.transport.max_frame_data,
        };
        // Start small (an idle stream costs little) and grow while reads fill the buffer.
        let mut buf = BytesMut::new();
        let mut chunk = self.shared.config.transport.read_buf_size.min(READ_CHUNK);
        loop {
            if !self
                .out
                .wait_to_read(&mut recv, &self.shared.stats.reads_held)
                .await
            {
                return ReadEnd::Gone;
            }
            if buf.capacity() - buf.len() < chunk / 4 {
                buf.reserve(chunk);
            }
            let spare = buf.capacity() - buf.len();
            match recv.read_buf(&mut buf).await {
                Ok(0) => {
                    if !buf.is_empty() {
                        // A frame cut off by the end of the stream.
                        let stream_id = stream_id_of(&buf);
                        self.reject(
                            stream_id,
                            ErrorCode::MALFORMED_FRAME,
                            "malformed",
                            format!(
                                "stream ended inside a frame ({} bytes left over)",
                                buf.len()
                            ),
                        );
                    }
                    return ReadEnd::Finished;
                }
                Ok(n) => {
                    self.shared.stats.add_in(n);
                    if n == spare {
                        chunk = (chunk * 2).min(READ_CHUNK);
                    }
                }
                Err(e) => {
                    debug!("stream read ended: {e}");
                    return ReadEnd::Gone;
                }
            }
            loop {
                match split_frame(&buf, &limits) {
                    Ok(raw) => {
                        let mut frame = buf.split_to(raw.frame_len()).freeze();
                        frame.advance(HEADER_LEN);
                        // Handling may wait (the handshake, the quota, room in the log, a
                        // full `block` queue) without reading: a reset meanwhile ends the
                        // stream at once, the frame then maybe not handled (§1.1). Most frames
                        // are handled without waiting, and then the reset is not looked at.
                        let handling = self.handle_raw(raw, frame);
                        tokio::pin!(handling);
                        tokio::select! {
                            biased;
                            () = &mut handling => {}
                            () = recv.reset() => return ReadEnd::Gone,
                        }
                    }
                    Err(DecodeError::Incomplete { .. }) => break,
                    Err(DecodeError::Invalid(e)) => {
                        // The frame boundary is lost or the frame is refused outright: say why,
                        // then close this stream. The connection's other streams go on.
                        let stream_id = stream_id_of(&buf);
                        self.reject(stream_id, e.code(), e.reason_label(), e.to_string());
                        return ReadEnd::Finished;
                    }
                }
            }
        }
    }

    fn reject(&self, stream_id: u32, code: ErrorCode, label: &'static str, reason: String) {
        self.shared.stats.rejected(label);
        self.send_error(stream_id, code, reason);
    }

    /// Why a SUBSCRIBE is refused for want of room on the connection (counted, at the limit).
    fn sub_refusal(&self, e: AddSubError, stream_id: u32, max: usize) -> String {
        match e {
            AddSubError::InUse => {
                format!("stream id {stream_id} already has a subscription on this connection")
            }
            AddSubError::Limit => {
                self.shared
                    .stats
                    .subscriptions_refused
                    .fetch_add(1, Ordering::Relaxed);
                format!(
                    "this connection already has {max} subscriptions \
                     (transport.max_subscriptions_per_connection)"
                )
            }
        }
    }

    fn send_error(&self, stream_id: u32, code: ErrorCode, reason: String) {
        debug!(stream_id, %code, %reason, "ERROR to {}", self.conn.remote);
        self.shared.stats.error_sent(code);
        self.send_reply(Frame::new(
            stream_id,
            Message::Error(ErrorFrame { code, reason }),
        ));
    }

    /// An answer to a frame of this stream (ERROR, INFO). Answers on a stream come in request
    /// order: while the durable log still owes this stream answers to earlier publish frames,
    /// this one goes behind them.
    fn send_reply(&self, frame: Frame) {
        let stream_id = frame.stream_id;
        match &self.shared.durable {
            Some(d) if self.out.log_unanswered.load(Ordering::Acquire) > 0 => {
                d.queue_answer(self.waiter(stream_id, false), frame);
            }
            _ => self.out.push_frame(&frame),
        }
    }

    async fn handle_raw(&mut self, raw: aqueduct_proto::header::RawHeader, data: bytes::Bytes) {
        // When the frame came off the stream (a traced message's `publish` span starts here).
        let received = self.shared.tracer.is_some().then(SystemTime::now);
        let header = match raw.validate() {
            Ok(h) => h,
            Err(e) => return self.reject(raw.stream_id, e.code(), e.reason_label(), e.to_string()),
        };
        if header.mesh_forwarded {
            // Only cluster peers may mark a frame as forwarded; a client that could would make
            // the broker skip its own checks and routing rules for it.
            return self.reject(
                raw.stream_id,
                ErrorCode::UNSUPPORTED,
                "mesh_forwarded",
                "the MeshForwarded bit (0x80 in the command byte) may only be set by cluster peers"
                    .into(),
            );
        }
        let frame = match Frame::decode(&header, data) {
            Ok(f) => f,
            Err(e) => return self.reject(raw.stream_id, e.code(), e.reason_label(), e.to_string()),
        };
        // 0-RTT data can be replayed by an attacker: only SUBSCRIBE/UNSUBSCRIBE run before the
        // handshake is confirmed; everything else waits for it. With access control on, or
        // revocation lists, those wait too: the client's identity (and whether its certificate
        // is revoked) is only known then.
        if !matches!(
            frame.message,
            Message::Subscribe(_) | Message::Unsubscribe(_)
        ) || self.shared.access.acl.enabled()
            || self.shared.config.tls.crl_file.is_some()
        {
            self.conn.wait_confirmed().await;
        }
        // The publish quota, then access control, before anything of a publish frame is
        // routed. The ACL is checked after every wait (a throttled client can wait long), so
        // that a rule removed meanwhile applies: a PUBLISH's topic here, a batch's topics where
        // its sub-frames are decoded (`handle`), once. A refused frame still counts against the
        // quota.
        let stream_id = frame.stream_id;
        let publishes = match &frame.message {
            Message::Publish(_) => Some(1),
            Message::PublishBatch(b) => Some(b.len()),
            _ => None,
        };
        let mut room = None;
        if let Some(n) = publishes {
            let Some(owed) = self.take_quota(stream_id, n).await else {
                return;
            };
            if let Some(d) = self.shared.durable.as_deref() {
                // Room in the log for the frame's messages, held until they are queued: the
                // log owes at most so many offsets (its crash gap must cover them).
                room = Some(d.wait_room(n).await);
            }
            // The frame goes on (a refusal by the ACL below still counts, as documented).
            owed.paid();
        } else if let (Message::Nack(_), Some(d)) = (&frame.message, self.shared.durable.as_deref())
        {
            // A NACK may make a dead letter, which the log must store: like a publish it waits
            // while the log owes all it may, so that NACKs (many subscriptions' of one message
            // each) cannot grow the log's queue past its bounds.
            room = Some(d.wait_room(1).await);
        }
        if let Message::Publish(p) = &frame.message {
            if !self.authorize_publish(stream_id, std::iter::once(p.topic().as_bytes())) {
                return;
            }
        }
        // What this frame queues for idle subscriber streams is written into them here, once
        // it is handled (see direct.rs).
        let shared = self.shared;
        direct::scoped(shared, || {
            self.handle(frame, header.has_extensions, received)
        });
        drop(room);
        self.wait_for_room().await;
    }

    /// Block policy: while a subscriber that this frame queued into (a publish, or a NACK's
    /// redelivery or dead letter) has a full queue, stop reading the stream (QUIC flow control
    /// then holds the client) until it has drained.
    async fn wait_for_room(&mut self) {
        let shared = self.shared;
        let stats = &shared.stats;
        // Each held subscriber stays in `holds` until its wait is over: if this future is
        // dropped first (the stream reset, the connection closed), those left are told.
        let mut holds = Holds::default();
        // One `block_timeout` for the whole hold, from its start: each subscription still full
        // then has held the publisher that long. Timed one after another, N stuck subscriptions
        // (one client may make thousands) held it N times as long.
        let mut deadline = None;
        loop {
            while let Some(sub) = self.ctx.take_held() {
                // Once each: one departure is one.
                if holds.ids.insert(sub.id()) {
                    holds.subs.push(sub);
                }
            }
            let Some(sub) = holds.subs.last().cloned() else {
                break;
            };
            let started = Instant::now();
            let mut waited = false;
            let room = std::future::poll_fn(|cx| {
                let room = sub.poll_room(cx);
                if room.is_pending() && !waited {
                    // Counted when the hold starts, so that one in progress shows.
                    waited = true;
                    stats.publish_holds.fetch_add(1, Ordering::Relaxed);
                }
                room
            });
            let timed_out = match shared.config.block_timeout {
                Some(limit) => {
                    let at = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + limit);
                    tokio::time::timeout_at(at, room).await.is_err()
                }
                None => {
                    room.await;
                    false
                }
            };
            // One stuck consumer must not hold its publishers forever (a durable one is only
            // let go of: the broker does not close it, see `Broker::disconnect_slow`).
            if timed_out
                && logged(shared, &mut self.ctx, |ctx| {
                    shared.broker.disconnect_slow(ctx, &sub, Instant::now())
                })
            {
                warn!(
                    filter = %sub.filter(),
                    "a block-policy subscription held its publishers for {:?}: closed it as a slow consumer",
                    shared.config.block_timeout.unwrap_or_default()
                );
            }
            if waited {
                stats
                    .publish_held_us
                    .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
            }
            if let Some(done) = holds.subs.pop() {
                holds.ids.remove(&done.id());
            }
        }
    }

    /// `has_extensions`: the frame carried an extension block (a SUBSCRIBE without one is a
    /// seed-style subscription).
    ///
    /// `received`: when the frame came off the stream, if trace export is on.
    fn handle(&mut self, frame: Frame, has_extensions: bool, received: Option<SystemTime>) {
        let stream_id = frame.stream_id;
        let now = Instant::now();
        let broker = &self.shared.broker;
        match frame.message {
            Message::Publish(p) => {
                // Access control and quota were applied by `handle_raw`.
                self.conn.published.fetch_add(1, Ordering::Relaxed);
                let mut publication = Publication::from_publish(&p);
                // A traced message the broker records: its deliveries name the broker's span.
                let recording = self.begin_trace(p.ext.trace.as_ref(), received);
                let traced = recording.as_ref().map(otel::Recording::context);
                if traced.is_some() {
                    publication.trace = traced.as_ref();
                }
                let route_start = recording.map(|_| SystemTime::now());
                let mut outcome = None;
                let mut published = true;
                if let Some(d) = &self.shared.durable {
                    let waiter = self.waiter(stream_id, p.ext.confirm);
                    published = self.publish_durable(d, std::iter::once(publication), waiter, now);
                } else {
                    let o = match &self.shared.mesh {
                        Some(mesh) => mesh.publish(&mut self.ctx, &publication, |ctx| {
                            broker.publish(ctx, &publication, now)
                        }),
                        None => broker.publish(&mut self.ctx, &publication, now),
                    };
                    if p.ext.confirm {
                        self.confirm(stream_id, vec![o.offset]);
                    }
                    outcome = Some(o);
                }
                // A frame the durable log refused was not published: no spans for it.
                if let (Some(r), Some(start), true) = (&recording, route_start, published) {
                    let offset = outcome.map(|o| o.offset);
                    self.end_trace(
                        r,
                        start,
                        &publication,
                        (offset, offset),
                        outcome.map(|o| o.routed),
                        (1, p.body.len()),
                    );
                }
            }
            Message::PublishBatch(batch) => {
                let mut offsets = Vec::new();
                let confirm = batch.ext.confirm;
                // Validated in full when decoded, so every sub-frame is Ok. Borrowed views, decoded
                // once into one vector per batch frame (the core looks ahead along it for runs).
                let mut refs = Vec::with_capacity(batch.len());
                refs.extend(batch.iter_refs().filter_map(Result::ok));
                if !self.authorize_publish(stream_id, refs.iter().map(|r| r.topic.as_bytes())) {
                    return;
                }
                self.conn
                    .published
                    .fetch_add(refs.len() as u64, Ordering::Relaxed);
                // Traced runs the broker records (first index, length): one publish span each,
                // which their deliveries name.
                let mut recordings = Vec::new();
                if self.shared.tracer.is_some() {
                    for (first, len, t) in otel::trace_runs(&refs) {
                        if let Some(rec) = self.begin_trace(Some(&t), received) {
                            let ctx = rec.context();
                            refs[first..first + len]
                                .iter_mut()
                                .for_each(|r| r.trace = Some(ctx));
                            recordings.push((first, len, rec));
                        }
                    }
                }
                let route_start = (!recordings.is_empty()).then(SystemTime::now);
                let want_offsets = confirm || !recordings.is_empty();
                let mut published = true;
                if let Some(d) = &self.shared.durable {
                    let waiter = self.waiter(stream_id, confirm);
                    let publications = refs.iter().map(Publication::from_ref);
                    published = self.publish_durable(d, publications, waiter, now);
                } else {
                    match &self.shared.mesh {
                        // In a cluster, runs of one topic go through the mesh (copies for the
                        // peers that want them) — unless no peer wants anything.
                        Some(mesh) if !mesh.peers_want_nothing() => {
                            let pubs: Vec<_> = refs.iter().map(Publication::from_ref).collect();
                            mesh.publish_batch(&mut self.ctx, &pubs, |ctx, run| {
                                broker.publish_batch(ctx, run.iter().copied(), now, |_, o| {
                                    if want_offsets {
                                        offsets.push(o);
                                    }
                                });
                            });
                        }
                        _ => {
                            broker.publish_batch(
                                &mut self.ctx,
                                refs.iter().map(Publication::from_ref),
                                now,
                                |_, o| {
                                    if want_offsets {
                                        offsets.push(o);
                                    }
                                },
                            );
                        }
                    }
                }
                // (A frame the durable log refused was not published: no spans for it.)
                if let (Some(start), true) = (route_start, published) {
                    for (first, len, rec) in &recordings {
                        let run = &refs[*first..first + len];
                        let p = Publication::from_ref(&run[0]);
                        let offsets = (
                            offsets.get(*first).copied(),
                            offsets.get(first + len - 1).copied(),
                        );
                        let bytes = run.iter().map(|r| r.body.len()).sum();
                        self.end_trace(rec, start, &p, offsets, None, (*len, bytes));
                    }
                }
                if confirm && self.shared.durable.is_none() {
                    self.confirm(stream_id, offsets);
                }
            }
            Message::Subscribe(s) => {
                let client = self.conn.identity();
                // If the rules change between this check and the registration below, the
                // admin side's re-check may not see this subscription yet: check again then.
                let checked = self.shared.access.acl.generation();
                // A SUBSCRIBE in 0-RTT data runs before the client's identity is known (only
                // while the ACL is off; a reload may turn it on right now): it is checked once
                // the identity is, below or by the handshake (`admin::recheck_connection`),
                // never under `anonymous` for a client that has a name.
                let provisional = !self.conn.is_identified();
                if !provisional && !self.may_subscribe(&s.spec.filter) {
                    self.shared
                        .stats
                        .acl_denied(aqueduct_core::acl::Action::Subscribe);
                    let reason = format!(
                        "client {client} may not subscribe to {}: refused by the ACL",
                        s.spec.filter
                    );
                    debug!(client = %self.conn.describe(), "{reason}");
                    return self.send_error(stream_id, ErrorCode::NOT_AUTHORIZED, reason);
                }
                if self.out.aborted.load(Ordering::Acquire) {
                    // The client stopped reading this stream (or it was reset): nothing could
                    // ever be delivered on it, nor an answer.
                    self.shared.stats.rejected("subscribe_on_closed_stream");
                    return;
                }
                let max = self
                    .shared
                    .config
                    .transport
                    .max_subscriptions_per_connection;
                let out = self.out.clone();
                // With the durable log, a durable consumer (or a durable group: `:group:` with
                // `:durable:`) is served from the log by a feeder, not by routing (see
                // consumers.rs).
                let durable_consumer =
                    match (&self.shared.consumers, &s.spec.durable, &s.spec.group) {
                        (Some(c), Some(d), None) => {
                            Some((c, Consumers::key(d.consumer.as_str()), d.start))
                        }
                        (Some(c), Some(d), Some(g)) => {
                            Some((c, Consumers::group_key(g.as_str()), d.start))
                        }
                        _ => None,
                    };
                let waker_out = out.clone();
                let opts = SubscribeOptions {
                    stream_id,
                    ack_mode: s.ack_mode(),
                    overflow: s.overflow(),
                    waker: Some(Box::new(move || direct::wake(&waker_out))),
                    seed_form: !has_extensions,
                    max_in_flight: s.ext.max_in_flight.map(|n| n as usize),
                    closes: Some(self.conn.sub_closes()),
                };
                // A durable one is made under the consumer table's lock (joining a group never
                // interleaves with its end), then registered on the connection.
                let mut opts = Some(opts);
                let claimed = match &durable_consumer {
                    Some((consumers, key, start)) => {
                        let group = s.spec.group.is_some();
                        // Taken before the claim, outside the consumer table's lock (it walks
                        // every topic): only for a new consumer, which starts there, and only
                        // once the cheap refusals are ruled out (a client must not make the
                        // broker walk every topic with SUBSCRIBEs refused anyway).
                        if let Err(e) = self.conn.room_for_sub(stream_id, max) {
                            let why = self.sub_refusal(e, stream_id, max);
                            return self.send_error(stream_id, ErrorCode::BAD_SUBSCRIBE, why);
                        }
                        // Where a new consumer starts: for `latest`, the walk; for the other
                        // starts, nothing to work out (the feeder starts each topic there).
                        let latest = match (start, &self.shared.durable) {
                            (aqueduct_proto::DurableStart::Latest, Some(d)) => Some(d),
                            _ => None,
                        };
                        let walk = || {
                            latest.map(|d| {
                                self.shared
                                    .stats
                                    .durable_latest_walks
                                    .fetch_add(1, Ordering::Relaxed);
                                crate::consumers::latest_positions(d, broker, &s.spec.filter)
                            })
                        };
                        let mut make = || {
                            let opts = opts.take().unwrap_or_default();
                            broker.subscribe_unrouted(&s.spec, opts)
                        };
                        let filter = &s.spec.filter;
                        let claim = consumers.claims_new(key).and_then(|new| {
                            // Walked only when the claim would make a new consumer: not for one
                            // that joins a live group or is refused as in use.
                            let initial =
                                (new || latest.is_none()).then(|| walk().unwrap_or_default());
                            match consumers.claim_with(key, filter, group, || initial, &mut make) {
                                // The live one ended between the look and the claim: now new.
                                Err(ClaimError::Unwalked) => consumers.claim_with(
                                    key,
                                    filter,
                                    group,
                                    || Some(walk().unwrap_or_default()),
                                    &mut make,
                                ),
                                other => other,
                            }
                        });
                        match claim {
                            Ok(claim) => Some(claim),
                            Err(e) => {
                                // The id as the client gave it, not the stored key's form.
                                let id = key.split_once(':').map_or(key.as_str(), |(_, id)| id);
                                let why = match e {
                                    ClaimError::InUse => format!(
                                        "durable consumer {id} is already subscribed (one \
                                         subscription per durable consumer at a time)"
                                    ),
                                    ClaimError::OtherFilter(f) => format!(
                                        "durable group {id} reads {f}; all its members must \
                                         subscribe with that filter"
                                    ),
                                    ClaimError::TooMany(max) => format!(
                                        "durable consumer {id} is new, and the broker already \
                                         keeps the positions of {max} durable consumers and \
                                         groups (aal.max_consumers); one without a \
                                         subscription for aal.consumer_retention is forgotten"
                                    ),
                                    // Never: the second claim has its start.
                                    ClaimError::Unwalked => {
                                        format!("durable consumer {id}: its claim did not settle")
                                    }
                                };
                                return self.send_error(stream_id, ErrorCode::BAD_SUBSCRIBE, why);
                            }
                        }
                    }
                    None => None,
                };
                // A durable subscription's key is recorded before it becomes visible in the
                // connection's table: an UNSUBSCRIBE on another stream may end it at once, and
                // must then end its consumer too.
                if let (Some(claim), Some((_, key, _))) = (&claimed, &durable_consumer) {
                    lock(&self.out.durables).insert(claim.sub.id(), key.clone());
                }
                // Check and insert under the connection table's lock, so two SUBSCRIBEs with
                // one id on two streams cannot both succeed.
                let added = self.conn.add_sub_with(stream_id, max, || {
                    let sub = match &claimed {
                        Some(claim) => claim.sub.clone(),
                        None => broker.subscribe(&s.spec, opts.take().unwrap_or_default()),
                    };
                    SubEntry { sub, out }
                });
                let refused = added
                    .as_ref()
                    .err()
                    .copied()
                    .map(|e| self.sub_refusal(e, stream_id, max));
                if let Some(why) = refused {
                    // A durable subscription made for nothing is taken back (a refused SUBSCRIBE
                    // changes nothing: a group it was alone in ends unfed, nothing stored). If it
                    // was the first of a group, members that joined meanwhile still need the
                    // feeder: started after, it runs only if the group still lives.
                    if let (Some(claim), Some((consumers, key, start)), Some(d)) =
                        (&claimed, &durable_consumer, &self.shared.durable)
                    {
                        lock(&self.out.durables).remove(&claim.sub.id());
                        unsubscribe(self.shared, &mut self.ctx, &claim.sub, Some(key), now);
                        if claim.first {
                            if let Some(g) = claim.sub.group() {
                                consumers.start_feeder(
                                    key,
                                    &claim.fed,
                                    crate::consumers::feed(
                                        d.clone(),
                                        self.shared.broker.clone(),
                                        crate::consumers::Target::Group(
                                            g.clone(),
                                            claim.joined.clone(),
                                        ),
                                        claim.fed.clone(),
                                        *start,
                                        claim.resumed,
                                    ),
                                );
                            }
                        }
                    }
                    return self.send_error(stream_id, ErrorCode::BAD_SUBSCRIBE, why);
                }
                let sub = match (&claimed, added) {
                    (Some(claim), _) => claim.sub.clone(),
                    (None, Ok(sub)) => sub,
                    (None, Err(_)) => return,
                };
                let feeder = durable_consumer
                    .as_ref()
                    .zip(claimed)
                    .map(|((_, key, start), claim)| (key.clone(), *start, claim));
                info!(
                    client = %self.conn.describe(),
                    filter = %s.spec.filter,
                    group = %s.spec.group.as_ref().map_or("none", |g| g.as_str()),
                    durable = %feeder.as_ref().map_or_else(|| "no".to_string(), |(key, start, claim)| {
                        if claim.resumed { format!("{key}, resumed from its stored position") } else { format!("{key}, from {start}") }
                    }),
                    stream_id,
                    seed_form = !has_extensions,
                    "subscribed"
                );
                // The subscription is routable now. Queue the CONFIRM before the writer may
                // drain it, so the CONFIRM always precedes its first delivery. A durable
                // SUBSCRIBE's CONFIRM says whether the log serves it (1) or it became an
                // in-memory group because the broker has no log (0): protocol.md §7.1.
                if s.ext.confirm {
                    let says = match &s.spec.durable {
                        Some(_) => vec![u64::from(feeder.is_some())],
                        None => Vec::new(),
                    };
                    self.confirm(stream_id, says);
                }
                lock(&self.out.subs).push(sub.clone());
                self.out.notify.notify_one();
                if let (Some((key, start, claim)), Some(d), Some(consumers)) =
                    (feeder, &self.shared.durable, &self.shared.consumers)
                {
                    // Not if an UNSUBSCRIBE on another stream ended it already (its consumer
                    // was ended then; a group's feeder is started for the other members).
                    if claim.first && (!sub.is_closed() || sub.group().is_some()) {
                        let target = match sub.group() {
                            Some(g) => crate::consumers::Target::Group(g.clone(), claim.joined),
                            None => crate::consumers::Target::One(sub.clone()),
                        };
                        let fed = claim.fed.clone();
                        consumers.start_feeder(
                            &key,
                            &fed,
                            crate::consumers::feed(
                                d.clone(),
                                self.shared.broker.clone(),
                                target,
                                claim.fed,
                                start,
                                claim.resumed,
                            ),
                        );
                    }
                }
                // The rules changed while this subscription was being made, or it was not
                // checked (its identity unknown): check it now, after its durable bookkeeping,
                // so that a revocation ends it completely. If the identity is still unknown,
                // the handshake's own check (`admin::recheck_connection`, after the identity is
                // set and the connection listed) comes after the registration above and sees
                // it: `identify` sets the identity before it looks at the subscriptions, under
                // the lock the registration took.
                let recheck = self.shared.access.acl.generation() != checked || provisional;
                if recheck && self.conn.is_identified() && !self.may_subscribe(&s.spec.filter) {
                    revoke(self.shared, self.conn, self.out, &sub);
                }
            }
            Message::Unsubscribe(u) => match self.conn.sub(stream_id) {
                // Whoever takes it out of the connection's table ends it (a revocation may be
                // ending it on its own stream right now).
                Some(entry)
                    if entry.sub.filter() == &u.filter
                        && self.conn.remove_sub(stream_id, &entry.sub) =>
                {
                    let key = lock(&entry.out.durables).remove(&entry.sub.id());
                    unsubscribe(self.shared, &mut self.ctx, &entry.sub, key.as_deref(), now);
                    // Out of its stream's list now: the writer would drop it at its next fill,
                    // but a writer blocked on flow control does not fill, and SUBSCRIBE and
                    // UNSUBSCRIBE pairs would pile up there without bound.
                    // (Only if the UNSUBSCRIBE closed it: one closed as a slow consumer or
                    // revoked just before still owes its ERROR, which the writer sends.)
                    if entry.sub.close_reason() == Some(CloseReason::Unsubscribed) {
                        lock(&entry.out.subs).retain(|s| !Arc::ptr_eq(s, &entry.sub));
                    }
                    entry.out.notify.notify_one();
                    debug!(client = %self.conn.describe(), filter = %u.filter, "unsubscribed");
                }
                _ => self.send_error(
                    stream_id,
                    ErrorCode::NOT_SUBSCRIBED,
                    format!("no subscription to {} with stream id {stream_id}", u.filter),
                ),
            },
            Message::Ack(a) => {
                let Some(entry) = self.sub_or_error(stream_id) else {
                    return;
                };
                if let Err(e) =
                    broker.ack(&entry.sub, a.ext.topic.as_ref(), a.offset, a.ext.attempt)
                {
                    self.send_error(stream_id, e.code(), e.to_string());
                }
            }
            Message::Nack(n) => {
                let Some(entry) = self.sub_or_error(stream_id) else {
                    return;
                };
                let result = logged(self.shared, &mut self.ctx, |ctx| {
                    broker.nack(
                        ctx,
                        &entry.sub,
                        n.ext.topic.as_ref(),
                        n.offset,
                        n.ext.attempt,
                        n.ext.reason.as_deref(),
                        now,
                    )
                });
                if let Err(e) = result {
                    self.send_error(stream_id, e.code(), e.to_string());
                }
            }
            // Answered on the stream it came on, whatever else the stream carries, in order with
            // its other answers.
            Message::Info(_) => {
                let t = &self.shared.config.transport;
                let info = Info {
                    protocol: Some(1),
                    max_data_len: Some(t.max_frame_data),
                    // What protocol.md §10 tells clients to accept: a delivery's body is at
                    // most a publish's data, and its extension block is within 1 KiB.
                    max_delivery_data_len: Some(
                        t.max_frame_data
                            .saturating_add(aqueduct_proto::ext::MAX_EXT_LEN as u32),
                    ),
                    max_subscriptions: Some(
                        u32::try_from(t.max_subscriptions_per_connection).unwrap_or(u32::MAX),
                    ),
                    broker: Some(concat!("aqueduct-broker ", env!("CARGO_PKG_VERSION")).into()),
                    durable: Some(self.shared.durable.is_some()),
                };
                self.send_reply(Frame::new(stream_id, Message::Info(info)));
            }
            Message::Confirm(_) | Message::Error(_) => {
                self.shared.stats.rejected("client_sent_broker_frame");
                self.send_error(
                    stream_id,
                    ErrorCode::UNSUPPORTED,
                    "CONFIRM and ERROR frames go from the broker to clients; the broker does not \
                     accept them"
                        .into(),
                );
            }
        }
    }

    /// Start recording a message with trace context `trace`, if trace export is on and its
    /// trace is sampled.
    fn begin_trace(
        &self,
        trace: Option<&aqueduct_proto::TraceContext>,
        received: Option<SystemTime>,
    ) -> Option<otel::Recording> {
        let tracer = self.shared.tracer.as_ref()?;
        tracer.begin(trace?, received.unwrap_or_else(SystemTime::now))
    }

    /// The `publish` and `route` spans of recorded messages (`messages` of them with `bytes`
    /// of bodies, the first `p`, with the first and last offsets when known), routed since
    /// `route_start`.
    fn end_trace(
        &self,
        r: &otel::Recording,
        route_start: SystemTime,
        p: &Publication<'_>,
        (offset, last_offset): (Option<u64>, Option<u64>),
        routed: Option<usize>,
        (messages, bytes): (usize, usize),
    ) {
        if let Some(tracer) = &self.shared.tracer {
            tracer.published(
                r,
                (route_start, SystemTime::now()),
                &otel::Published {
                    topic: p.topic.as_bytes(),
                    priority: p.priority,
                    body_len: bytes,
                    offset,
                    routed,
                    client: self.conn.identity(),
                    messages,
                    last_offset,
                },
            );
        }
    }

    fn waiter(&self, stream_id: u32, confirm: bool) -> Waiter {
        Waiter::new(self.out.clone(), stream_id, confirm)
    }

    /// Route a publish frame's messages (live delivery at once) and queue them for the durable
    /// log, whose writer confirms them once they are durable. Routing and queueing happen under
    /// the log's order lock, so each topic's offsets reach the log in order. False if the log
    /// refused the frame (closed or failing): nothing of it was published.
    fn publish_durable<'p>(
        &mut self,
        d: &Durable,
        publications: impl Iterator<Item = Publication<'p>> + Clone,
        waiter: Waiter,
        now: Instant,
    ) -> bool {
        let _order = lock(&d.order);
        if d.is_closed() {
            // Shutting down: the log writes nothing more.
            self.shared.stats.error_sent(ErrorCode::STORAGE_FAILED);
            self.out.push_frame(&Frame::new(
                waiter.stream_id,
                Message::Error(ErrorFrame {
                    code: ErrorCode::STORAGE_FAILED,
                    reason: "not stored: the broker is shutting down and its durable log is \
                             closed; nothing of this frame was published"
                        .into(),
                }),
            ));
            return false;
        }
        if d.is_failing() {
            // The log cannot write: refuse the frame before it is routed, so that no offset is
            // handed out that the log cannot record (it owes few enough as it is). The ERROR
            // goes through the writer's queue, behind the answers to earlier frames.
            d.queue_refusal(waiter);
            return false;
        }
        self.ctx.record_dead_letters();
        let routed = &mut self.routed;
        // Walked twice without a copy: to route, then to queue for the log.
        let broker = &self.shared.broker;
        match &self.shared.mesh {
            Some(mesh) if !mesh.peers_want_nothing() => {
                let pubs: Vec<_> = publications.clone().collect();
                mesh.publish_batch(&mut self.ctx, &pubs, |ctx, run| {
                    broker.publish_batch(ctx, run.iter().copied(), now, |topic, o| {
                        routed.push((topic.clone(), o))
                    });
                });
            }
            _ => {
                broker.publish_batch(&mut self.ctx, publications.clone(), now, |topic, o| {
                    routed.push((topic.clone(), o))
                });
            }
        }
        d.queue_frame(routed.drain(..).zip(publications), waiter);
        // Dead letters this publish caused (a group member closed as a slow consumer whose
        // messages ran out of retries), after the frame's own messages.
        d.queue_dead_letters(self.ctx.take_dead_letters());
        true
    }

    fn sub_or_error(&self, stream_id: u32) -> Option<SubEntry> {
        let entry = self.conn.sub(stream_id);
        if entry.is_none() {
            self.send_error(
                stream_id,
                ErrorCode::NOT_SUBSCRIBED,
                format!("no subscription with stream id {stream_id} on this connection"),
            );
        }
        entry
    }

    fn confirm(&self, stream_id: u32, offsets: Vec<u64>) {
        self.out.push_frame(&Frame::new(
            stream_id,
            Message::Confirm(Confirm { offsets }),
        ));
    }
}

/// The stream id of a frame whose header may be incomplete or invalid (0 if unknown).
fn stream_id_of(buf: &[u8]) -> u32 {
    match buf.get(2..6) {
        Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
        _ => 0,
    }
}

/// Run the revocations requested for this stream's subscriptions, then collect pending
/// replies and deliveries into `buf`, up to about `budget` bytes (see [`fill_queued`]). Only
/// the stream's writer calls this: revocations run on its task (see access.rs).
fn fill(
    out: &StreamOut,
    shared: &Shared,
    conn: &ConnState,
    buf: &mut BytesMut,
    budget: usize,
    hint: usize,
) {
    take_revocations(out, shared, conn);
    fill_queued(out, shared, conn, buf, budget, hint);
}

/// Collect pending replies and deliveries into `buf`, up to about `budget` bytes. Closed
/// subscriptions are removed; a slow-consumer close gets its ERROR frame. `hint` is how much
/// room to make at once when deliveries are waiting.
fn fill_queued(
    out: &StreamOut,
    shared: &Shared,
    conn: &ConnState,
    buf: &mut BytesMut,
    budget: usize,
    hint: usize,
) {
    let starting = buf.is_empty();
    // The subscriptions are locked before the replies are taken: a SUBSCRIBE queues its
    // CONFIRM before it adds its subscription here, so a fill that sees the subscription has
    // its CONFIRM too — also a publisher's direct write (direct.rs), which may run while this
    // stream's reader is in the middle of that SUBSCRIBE. (Lock order: subs, then control.)
    let mut subs = lock(&out.subs);
    {
        let mut control = lock(&out.control);
        if !control.is_empty() {
            buf.extend_from_slice(&control);
            control.clear();
            out.flushed.notify_waiters();
        }
    }
    let now = Instant::now();
    // Deliveries are waiting and a new write starts: make room for it in one allocation. Each
    // write hands the buffer to QUIC, so the next one starts anew, and growing that by doubling
    // copies it at every step. (Only when this fill starts the write: one that adds to a write
    // being gathered must not reallocate what it holds.) A stream with nothing queued allocates
    // nothing.
    if starting && hint > buf.capacity() - buf.len() && subs.iter().any(|s| s.queued_approx() > 0) {
        buf.reserve(hint);
    }
    subs.retain(|sub| {
        if !sub.is_closed() {
            return true;
        }
        if sub.close_reason() == Some(CloseReason::Revoked) {
            info!(client = %conn.describe(), filter = %sub.filter(), stream_id = sub.stream_id(), "subscription closed: the ACL no longer allows it");
            shared.stats.error_sent(ErrorCode::NOT_AUTHORIZED);
            Frame::new(
                sub.stream_id(),
                Message::Error(ErrorFrame {
                    code: ErrorCode::NOT_AUTHORIZED,
                    reason: format!(
                        "subscription to {} closed: the ACL changed and client {} may no longer subscribe to it",
                        sub.filter(),
                        conn.identity()
                    ),
                }),
            )
            .encode(buf);
        }
        if sub.close_reason() == Some(CloseReason::SlowConsumer) {
            warn!(filter = %sub.filter(), stream_id = sub.stream_id(), "slow consumer disconnected");
            shared.stats.error_sent(ErrorCode::SLOW_CONSUMER);
            out.slow_error_pending.store(true, Ordering::Release);
            Frame::new(
                sub.stream_id(),
                Message::Error(ErrorFrame {
                    code: ErrorCode::SLOW_CONSUMER,
                    reason: slow_consumer_reason(sub, shared.config.block_timeout),
                }),
            )
            .encode(buf);
        }
        false
    });
    // Subscriptions sharing the stream take turns: when the budget runs out, the next write
    // starts with the first one that got no turn, so a busy one cannot starve the others.
    let n = subs.len();
    let first = out.drain_from.load(Ordering::Relaxed) % n.max(1);
    for k in 0..n {
        let at = (first + k) % n;
        let sub = &subs[at];
        if buf.len() >= budget {
            out.drain_from.store(at, Ordering::Relaxed);
            break;
        }
        // Nothing queued (as of its last change, which the enqueue that woke this writer made
        // before waking it): its lock is not taken. A stream with thousands of idle
        // subscriptions and one busy one took every one of their locks per write.
        if sub.queued_approx() == 0 {
            continue;
        }
        let max = budget - buf.len();
        let drained = match &shared.tracer {
            None => shared.broker.drain(sub, buf, max, now),
            Some(tracer) => {
                // Consecutive deliveries of one recorded run are one deliver span. Spans are
                // made after the drain: it holds the subscriber's lock, which publishers need.
                let mut span: Option<otel::Delivered> = None;
                let mut done: Vec<otel::Delivered> = Vec::new();
                let drained = shared.broker.drain_observed(sub, buf, max, now, |d| {
                    let Some(t) = d.trace().filter(|t| tracer.samples(t)) else {
                        return;
                    };
                    if span.as_mut().is_some_and(|g| g.absorb(d, &t)) {
                        return;
                    }
                    if let Some(g) = span.replace(otel::Delivered::new(d, t)) {
                        done.push(g);
                    }
                });
                done.extend(span);
                // Written: handed to the stream's buffer, which goes to QUIC next.
                let (at, at_sys) = (Instant::now(), SystemTime::now());
                for g in &done {
                    tracer.delivered(g, sub, conn.identity(), at, at_sys);
                }
                drained
            }
        };
        conn.delivered
            .fetch_add(drained.frames as u64, Ordering::Relaxed);
    }
}

/// The ERROR `SLOW_CONSUMER` reason: why this subscription was closed, by its policy (a `block`
/// subscription for staying full past `broker.block_timeout`, holding a publisher or not).
fn slow_consumer_reason(sub: &Subscriber, block_timeout: Option<Duration>) -> String {
    match sub.policy() {
        OverflowPolicy::Block => format!(
            "subscription to {} closed: its queue stayed full longer than broker.block_timeout ({}) (policy block)",
            sub.filter(),
            humantime::format_duration(block_timeout.unwrap_or_default())
        ),
        policy => format!(
            "subscription to {} closed: its queue overflowed (policy {})",
            sub.filter(),
            policy.as_str()
        ),
    }
}

/// Why a blocked write is given up.
enum GiveUp {
    /// A subscription on this stream was closed as a slow consumer, or the write in progress
    /// carries the ERROR of one closed earlier: the stream is reset with SLOW_CONSUMER.
    SlowConsumer,
    /// The stream is done for (the client reset its sending side, or stopped reading): its
    /// subscriptions end, nothing more is written.
    Aborted,
    /// The client finished the stream, and a write has waited [`FINISH_WAIT`] since both the
    /// FIN and the last part of it the client took: the stream is reset and its subscriptions
    /// end.
    FinishTimedOut,
}

/// Completes when a blocked write on this stream must be given up, and says why. One future
/// for both: `out.notify` wakes one waiter. Meanwhile it takes the revocations of the
/// stream's subscriptions (their ERROR follows the blocked write). Made anew for each part of
/// a write: its start is the write's last progress.
async fn give_up_blocked_write(out: &StreamOut, shared: &Shared, conn: &ConnState) -> GiveUp {
    // First polled when the write it watches did not complete at once: the clock is read only
    // for a write that blocked.
    let started = Instant::now();
    loop {
        let notified = out.notify.notified();
        take_revocations(out, shared, conn);
        if out.aborted.load(Ordering::Acquire) {
            return GiveUp::Aborted;
        }
        let slow = out.slow_error_pending.load(Ordering::Acquire)
            || lock(&out.subs)
                .iter()
                .any(|s| s.is_closed() && s.close_reason() == Some(CloseReason::SlowConsumer));
        if slow {
            return GiveUp::SlowConsumer;
        }
        // A client reading slowly keeps its stream: only a write that has made no way for
        // FINISH_WAIT after the FIN (and after its last progress) is given up.
        let deadline = out
            .finished_at
            .get()
            .map(|&fin| fin.max(started) + FINISH_WAIT);
        match deadline {
            Some(by) if Instant::now() >= by => return GiveUp::FinishTimedOut,
            Some(by) => {
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep_until(by.into()) => {}
                }
            }
            None => notified.await,
        }
    }
}

fn has_subs(out: &StreamOut) -> bool {
    !lock(&out.subs).is_empty()
}

/// Room made in a write buffer beyond the flush budget: a drain stops after the frame that
/// crosses the budget, so that frame must fit too (most deliveries are much smaller).
const DRAIN_SLACK: usize = 4096;

/// Wait until the connection's handshake is confirmed, the broker stops, or the stream is
/// aborted (reset by the client, or its connection gone). Returns whether it is confirmed.
async fn wait_confirmed(
    conn: &ConnState,
    out: &StreamOut,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let aborted = async {
        loop {
            let notified = out.notify.notified();
            if out.aborted.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    };
    tokio::select! {
        () = conn.wait_confirmed() => {}
        _ = shutdown.wait_for(|s| *s) => {}
        () = aborted => {}
    }
    conn.is_confirmed()
}

async fn write_loop<S: SendHalf + 'static>(
    send: S,
    out: &StreamOut,
    shared: &Shared,
    conn: &Arc<ConnState>,
    mut shutdown: watch::Receiver<bool>,
) {
    // Boxed once: parked for direct writes while idle, the box moves (direct.rs).
    let mut send = Box::new(send);
    let batch = shared.config.batch_size;
    let window = shared.config.flush_interval;
    // Sized by `fill` when deliveries wait (see `hint` below); an idle stream allocates
    // nothing.
    let mut buf = BytesMut::new();
    let mut hint = 0;
    let mut last_write: Option<Instant> = None;
    // A stream of a 0-RTT connection writes nothing (no delivery, no answer) before the
    // handshake is confirmed: its early SUBSCRIBEs are checked against the ACL in force then
    // (`identify`), and a reload that turned the ACL on meanwhile did not see the connection.
    // Their deliveries went out in the meantime, for as long as the client held back its
    // handshake (up to `transport.handshake_timeout`).
    if !conn.is_confirmed() {
        // The broker is stopping, or the stream is gone (the client reset it), before the
        // handshake (and its check) completed: nothing queued here goes out, not even in the
        // shutdown's last flush, and the subscriptions end with the task now, not when the
        // handshake ends (they stayed routed meanwhile: a `block` one held publishers).
        if !wait_confirmed(conn, out, &mut shutdown).await {
            detach_subscriptions(shared, out);
            send.reset(0);
            return;
        }
    }
    'writes: loop {
        if out.aborted.load(Ordering::Acquire) {
            // The client stopped reading (STOP_SENDING) or the stream is gone: nothing more can
            // be delivered here. Route nothing more to its subscriptions (a group member leaves
            // its group, its queued messages go to the others) but let what is in flight still
            // be settled by ACKs already on their way; the subscriptions end with the stream.
            detach_subscriptions(shared, out);
            // Reset, not finished (dropping the sending half would finish it): the replies
            // queued here were dropped, and a FIN would say the stream ended cleanly. Not after
            // the client's STOP_SENDING: dropping the half then resets the stream with the
            // client's code, as QUIC asks (protocol.md 1.1).
            if !out.stopped_by_client.load(Ordering::Acquire) {
                send.reset(0);
            }
            return;
        }
        fill(out, shared, conn, &mut buf, batch, hint);
        if buf.is_empty() {
            // On shutdown too, the reader says when it is done (it stops at once then): only
            // it knows whether the client's frames were all read. And the durable log must
            // have answered every frame it took: a FIN says they were all handled.
            if out.reader_done.load(Ordering::Acquire)
                && out.log_unanswered.load(Ordering::Acquire) == 0
            {
                break;
            }
            // Wait for work, the shutdown, or the client to stop reading. Meanwhile the sending
            // half is parked where publishers can write into it directly (direct.rs), if this
            // kind of stream allows it.
            let stopped = match send.stopped_owned() {
                Some(stopped) => {
                    out.park(
                        send,
                        conn.clone(),
                        std::mem::take(&mut buf),
                        last_write,
                        hint,
                    );
                    let stopped = tokio::select! {
                        _ = out.notify.notified() => None,
                        _ = shutdown.changed() => None,
                        stopped = stopped => Some(stopped),
                    };
                    let Some(back) = out.unpark::<S>() else {
                        // Cannot happen: only this writer parks and takes its half.
                        tracing::error!("a stream writer lost its parked sending half");
                        out.abort();
                        return;
                    };
                    send = back.send;
                    buf = back.buf;
                    last_write = back.last_write;
                    hint = back.hint;
                    stopped
                }
                None => tokio::select! {
                    _ = out.notify.notified() => None,
                    _ = shutdown.changed() => None,
                    stopped = send.stopped() => Some(stopped),
                },
            };
            match stopped {
                Some(Some(stopped)) => {
                    debug!("the client stopped reading the stream: {stopped}");
                    shared.stats.streams_stopped.fetch_add(1, Ordering::Relaxed);
                    out.stopped_by_client.store(true, Ordering::Release);
                    out.abort();
                }
                // The connection is gone (it ends every stream): not counted as the client
                // stopping one, which inflated the count at every lost connection.
                Some(None) => out.abort(),
                None => {}
            }
            continue;
        }
        // Coalesce: give publishers until the flush interval to add to this write — but only
        // while the stream is busy (the previous write was less than a window ago). A message on
        // a quiet stream goes out at once: waiting would add the window to its latency and
        // gather nothing. A window under a timer's resolution is not waited for (see the module
        // docs): what publishers add while this write is made goes out with the next one.
        let now = Instant::now();
        if buf.len() < batch && coalesces(last_write, now, window) {
            let deadline = now + window;
            tokio::select! {
                _ = tokio::time::sleep_until(deadline.into()) => {}
                _ = shutdown.changed() => {}
            }
            fill(out, shared, conn, &mut buf, batch, hint);
        }
        // A subscriber that stops reading blocks this write on flow control; if the core then
        // closes it (disconnect policy) the ERROR frame could never get through, so the stream is
        // reset with the SLOW_CONSUMER code instead.
        // Handed to quinn without a copy; `buf` keeps the rest of its allocation for the next
        // fill (or allocates anew once quinn still holds it).
        let mut chunk = buf.split().freeze();
        let len = chunk.len();
        let written = loop {
            let written = tokio::select! {
            // A write that QUIC takes at once goes through, even one carrying a SLOW_CONSUMER
            // ERROR; only a blocked one is abandoned for the reset. Each part QUIC takes is
            // progress: the wait for the client to read starts again after it.
            biased;
            r = send.write_some(&mut chunk) => r,
            why = give_up_blocked_write(out, shared, conn) => {
                match why {
                    GiveUp::SlowConsumer => {
                        warn!("slow consumer: resetting its blocked delivery stream");
                        shared.stats.slow_consumer_resets.fetch_add(1, Ordering::Relaxed);
                        send.reset(u32::from(ErrorCode::SLOW_CONSUMER.0));
                        out.abort();
                    }
                    // The client reset the stream (or stopped reading it) while the write was
                    // blocked: what it holds is abandoned, the loop's top ends the stream.
                    GiveUp::Aborted => send.reset(0),
                    // Part of the abandoned write may have gone out: the stream cannot be
                    // finished cleanly, so it is reset; what is still queued is dropped and
                    // counted as its subscriptions end.
                    GiveUp::FinishTimedOut => {
                        debug!("the client did not read the end of the stream within {FINISH_WAIT:?}: resetting it");
                        shared.stats.finish_timeouts.fetch_add(1, Ordering::Relaxed);
                        send.reset(0);
                        end_subscriptions(shared, conn, out, |_| true);
                        return;
                    }
                }
                continue 'writes;
            }
            };
            if written.is_err() || chunk.is_empty() {
                break written;
            }
        };
        out.slow_error_pending.store(false, Ordering::Release);
        if let Err(e) = written {
            debug!("stream write ended: {e}");
            if matches!(e, WriteFailure::Stopped) {
                shared.stats.streams_stopped.fetch_add(1, Ordering::Relaxed);
                out.stopped_by_client.store(true, Ordering::Release);
            }
            out.abort();
            continue;
        }
        shared.stats.add_out(len);
        // Room for twice this write, at most `batch` bytes, plus the frame a drain may write
        // past the budget. A quiet stream's writes are small, and so is what it keeps between
        // them (`buf` holds on to the rest of its allocation).
        hint = (2 * len).min(batch) + DRAIN_SLACK.min(len);
        if buf.capacity() > 2 * hint {
            // Busy before, quiet now: let go of the large allocation (a buffer's later ones are
            // at least as large as its first) and start small.
            buf = BytesMut::new();
        }
        last_write = Some(Instant::now());
    }
    // Final flush (shutdown, or the client finished the stream), bounded: a client that does
    // not read any more must not keep this task (and a held publisher) forever. As above, the
    // client has FINISH_WAIT after each part it takes to take the next. (A shutdown bounds
    // the whole flush per connection.)
    let interrupted = out.interrupted.load(Ordering::Acquire);
    let flushed = 'flush: loop {
        fill(out, shared, conn, &mut buf, batch, hint);
        let mut chunk = buf.split().freeze();
        let len = chunk.len();
        if len == 0 {
            break true;
        }
        while !chunk.is_empty() {
            match tokio::time::timeout(FINISH_WAIT, send.write_some(&mut chunk)).await {
                Ok(Ok(())) => {}
                // The stream is gone: nothing more can be written, nothing to reset.
                Ok(Err(_)) => break 'flush true,
                Err(_) => break 'flush false,
            }
        }
        shared.stats.add_out(len);
    };
    if !flushed {
        // Part of a frame may have gone out, and what is left is lost: a FIN would tell the
        // client it got everything (§1.1). Reset, as a blocked write after the FIN is.
        debug!(
            "the client did not read the end of the stream within {FINISH_WAIT:?}: resetting it"
        );
        if !interrupted {
            shared.stats.finish_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        send.reset(if interrupted {
            u32::from(ErrorCode::SHUTTING_DOWN.0)
        } else {
            0
        });
        end_subscriptions(shared, conn, out, |_| true);
        return;
    }
    // What is still subscribed here ends with the stream (after the flush above sent what was
    // queued).
    let had_subs = has_subs(out);
    end_subscriptions(shared, conn, out, |_| true);
    if interrupted && !had_subs {
        // Shutdown stopped the reader before the client finished this stream: frames it sent may
        // never have been read. A clean FIN would tell it they were all handled; a reset with
        // SHUTTING_DOWN tells it they may not have been.
        send.reset(u32::from(ErrorCode::SHUTTING_DOWN.0));
        return;
    }
    send.finish();
    // Closing the connection abandons data the client has not acknowledged yet: wait (bounded)
    // until it has read the stream to the end.
    let _ = tokio::time::timeout(FINISH_WAIT, send.stopped()).await;
}

/// The subscribers a publishing stream is held by (block policy) and has not finished waiting
/// for. Dropped with some left, its publisher went away while held: each is told
/// ([`Subscriber::note_orphaned_hold`]), so publishers that keep coming back on new streams cannot
/// grow its queue without end.
#[derive(Default)]
struct Holds {
    subs: Vec<Arc<Subscriber>>,
    /// Their ids: each is in `subs` once, found in constant time. A fixed hasher: the ids are
    /// the broker's own (no flooding to fear), and a `Holds` is made for every frame, so its
    /// set must cost nothing to create (std's `RandomState` touches a thread-local).
    ids: std::collections::HashSet<aqueduct_core::SubscriberId, foldhash::fast::FixedState>,
}

impl Drop for Holds {
    fn drop(&mut self) {
        for sub in self.subs.drain(..) {
            sub.note_orphaned_hold();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use aqueduct_core::{Broker, BrokerConfig};
    use aqueduct_proto::SubscribeSpec;
    use bytes::Bytes;

    use super::*;

    /// Whether `notified` is ready now, without waiting.
    fn ready(notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        notified.poll(&mut cx).is_ready()
    }

    /// The reader stops once the durable log owes the stream more than `MAX_LOG_UNANSWERED`
    /// answers, and the answer that brings it back to the bound wakes it (a reader parked on
    /// `flushed` has nothing else to wake it: a lost wake-up would stall the stream for good).
    #[test]
    fn the_reader_waits_while_the_log_owes_too_many_answers() {
        let out = StreamOut::default();
        for _ in 0..MAX_LOG_UNANSWERED {
            out.await_log();
        }
        assert!(out.may_read(), "at the bound the reader goes on");
        out.await_log();
        assert!(!out.may_read(), "one past the bound, it waits");
        let mut flushed = std::pin::pin!(out.flushed.notified());
        flushed.as_mut().enable();
        assert!(!ready(flushed.as_mut()));
        out.log_answered();
        assert!(out.may_read());
        assert!(
            ready(flushed.as_mut()),
            "the answer back at the bound wakes the reader"
        );
        // Answers below the bound wake only the writer: the reader is not waiting then.
        let mut again = std::pin::pin!(out.flushed.notified());
        again.as_mut().enable();
        out.log_answered();
        assert!(!ready(again.as_mut()));
    }

    /// Replies waiting in the durable log's queue count toward the unread replies' limit: a
    /// client that kept the log owing it an answer could queue there ERRORs without bound
    /// (65,536 per stream of up to ~300 bytes), all pushed to it at once when the log answered.
    /// Their leaving the log wakes a reader they held: after STOP_SENDING the replies are
    /// dropped, and nothing else would wake it (the stream is still read, §1.1).
    #[test]
    fn replies_waiting_in_the_log_count_toward_the_unread_replies() {
        let out = StreamOut::default();
        out.reply_in_log(MAX_PENDING_CONTROL);
        assert!(out.may_read(), "at the bound the reader goes on");
        out.reply_in_log(1);
        assert!(!out.may_read(), "one past the bound, it waits");
        out.abort();
        let mut flushed = std::pin::pin!(out.flushed.notified());
        flushed.as_mut().enable();
        out.reply_out_of_log(MAX_PENDING_CONTROL + 1);
        assert!(out.may_read());
        assert!(ready(flushed.as_mut()), "the reader is woken");
    }

    /// A stream of a connection whose handshake is not confirmed stops waiting for it once
    /// the stream is aborted (the client reset it): it waited for the handshake or the
    /// shutdown only, so its subscriptions stayed routed until the handshake ended (up to
    /// `transport.handshake_timeout`).
    #[test]
    fn an_unconfirmed_streams_wait_ends_when_the_stream_is_aborted() {
        let conn = crate::connection::ConnState::new(1, "127.0.0.1:1".parse().expect("addr"));
        let out = StreamOut::default();
        let (_stop, mut shutdown) = watch::channel(false);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut wait = std::pin::pin!(wait_confirmed(&conn, &out, &mut shutdown));
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "it waits");
        out.notify.notify_one();
        assert!(
            wait.as_mut().poll(&mut cx).is_pending(),
            "work alone does not end it"
        );
        out.abort();
        assert_eq!(
            wait.as_mut().poll(&mut cx),
            std::task::Poll::Ready(false),
            "aborted, not confirmed"
        );
    }

    /// A receiving half that is never reset and never reads.
    struct Idle;

    impl tokio::io::AsyncRead for Idle {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Pending
        }
    }

    impl RecvHalf for Idle {
        fn reset(&mut self) -> impl Future<Output = ()> + Send {
            std::future::pending()
        }
    }

    /// After STOP_SENDING the stream is still read (§1.1): a reader held because the durable
    /// log owes too many answers waits for them. It ended the stream (and its subscriptions).
    #[test]
    fn after_stop_sending_the_reader_waits_for_the_log_and_reads_on() {
        let out = StreamOut::default();
        let held = AtomicU64::new(0);
        let mut recv = Idle;
        for _ in 0..=MAX_LOG_UNANSWERED {
            out.await_log();
        }
        out.abort();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut wait = std::pin::pin!(out.wait_to_read(&mut recv, &held));
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "it waits");
        assert_eq!(held.load(Ordering::Relaxed), 1, "counted once");
        out.log_answered();
        assert_eq!(wait.as_mut().poll(&mut cx), std::task::Poll::Ready(true));
    }

    /// Unread replies stop the reader the same way.
    #[test]
    fn the_reader_waits_while_replies_are_unread() {
        let out = StreamOut::default();
        lock(&out.control).resize(MAX_PENDING_CONTROL, 0);
        assert!(out.may_read());
        lock(&out.control).extend_from_slice(b"!");
        assert!(!out.may_read());
    }

    /// A revocation asked for after the stream's task ended is not taken: the subscription
    /// holds the stream's state through its waker, so keeping it in the stream's list would
    /// keep both alive for good.
    #[test]
    fn no_revocation_is_taken_after_the_stream_ended() {
        let broker = Broker::new(BrokerConfig::default());
        let out = Arc::new(StreamOut::default());
        let spec = SubscribeSpec::parse(&Bytes::from_static(b"topic:a")).expect("a spec");
        let waker_out = out.clone();
        let sub = broker.subscribe(
            &spec,
            SubscribeOptions {
                waker: Some(Box::new(move || waker_out.notify.notify_one())),
                ..Default::default()
            },
        );
        assert!(out.queue_revocation(&sub));
        assert!(!out.queue_revocation(&sub), "asked once");
        out.end_revocations();
        assert!(lock(&out.revoking).is_empty(), "let go with the stream");
        assert!(!out.queue_revocation(&sub), "none taken after the end");
        assert!(lock(&out.revoking).is_empty());
        // Nothing but this test holds the stream's state once the subscription is gone.
        let mut ctx = PublishContext::default();
        broker.unsubscribe(&mut ctx, &sub, Instant::now());
        drop(sub);
        assert_eq!(Arc::strong_count(&out), 1);
    }
}
