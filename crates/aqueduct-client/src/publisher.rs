//! A publish stream: publishes, batches and confirmations on one QUIC stream, in order.
//!
//! Every [`crate::Client`] has a default one (used by `Client::publish*`); `Client::publisher()`
//! opens another, so independent publishers on one connection do not queue behind each other.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aqueduct_proto::frame::{ErrorFrame, Message as Wire};
use aqueduct_proto::{BatchBuilder, ErrorCode, Extensions, Frame, Publish, TopicName};
use bytes::Bytes;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::client::PublishOptions;
use crate::error::ClientError;
use crate::reader::FrameReader;

/// The confirmations awaited on one stream, by request id; `None` once the stream's replies
/// are over (each waiter then got its answer or the stream's failure).
type Pending = Arc<Mutex<Option<HashMap<u32, oneshot::Sender<Result<Vec<u64>, ClientError>>>>>>;

/// A publish stream. Cheap to clone; clones share the stream.
///
/// # Cancel safety
///
/// A publish whose future is dropped (a `select!`, a timeout) before it was first polled past
/// waiting for the stream sends nothing. Once its frame is queued on the stream it is sent
/// whole, even if the future is dropped while the broker's flow control holds it back: the
/// next publish or `flush` on the stream writes the rest first (a cancelled `flush` leaves the
/// stream in place, too). A stream never carries part of a frame followed by another.
///
/// When the broker stops reading a stream (a frame above its `transport.max_buf_size` gets
/// FRAME_TOO_LARGE), or the stream fails, the next publish opens a new one.
#[derive(Debug, Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Arc<crate::link::Link>,
    /// Request ids (`stream_id` of confirmed frames), unique per connection.
    ids: Arc<crate::ids::Ids>,
    /// Opened on first use, and again after the broker ended it. A tokio mutex: writes await.
    send: tokio::sync::Mutex<Option<Stream>>,
    /// Why a replaced stream ended before the broker had read all of it (a stream-fatal ERROR,
    /// a failure): the next `flush` reports it, since it cannot vouch for what was sent there.
    lost: Mutex<Option<ClientError>>,
    /// The ends of finished streams that a flush was still waiting for when it was cancelled:
    /// the next flush waits for them too, so that what they say is not lost.
    unread_ends: Mutex<Vec<Done>>,
    /// One flush at a time (see [`Publisher::flush`]).
    flush_turn: tokio::sync::Mutex<()>,
    /// The outcome of each flush called and not yet done, by a number of its own: a flush
    /// covers what was published before it was called, some of which a flush called earlier
    /// may have taken to wait for.
    flushes: Mutex<Vec<(u64, FlushOutcome)>>,
    /// Numbers the flushes.
    next_flush: std::sync::atomic::AtomicU64,
    /// The tasks reading each stream's replies (a replaced stream's too, until the broker ends
    /// it). Aborted when the publisher goes: nothing can await their answers then.
    readers: Mutex<tokio::task::JoinSet<()>>,
}

/// An open publish stream: its sending half, the confirmations awaited on it (by request id),
/// and word from the task reading its replies that the broker finished the stream (`Ok`) —
/// which it does only after handling every frame on it — or that it failed.
#[derive(Debug)]
struct Stream {
    send: crate::link::FrameSink,
    pending: Pending,
    done: Done,
    /// Set by its replies task on a stream-fatal ERROR: the broker reads nothing more here.
    fatal: Fatal,
}

/// A stream-fatal ERROR's reason, once one came.
type Fatal = Arc<Mutex<Option<ClientError>>>;

/// What a flush came to, once it is done (`None` until then).
type FlushOutcome = tokio::sync::watch::Receiver<Option<Result<(), ClientError>>>;

/// How a stream ended, from the task reading its replies.
type Done = oneshot::Receiver<Result<(), ClientError>>;

impl Stream {
    /// `None` while the stream in `slot` is live (or there is none). Otherwise nothing written
    /// to it now would be read: it ended (`Ok`), or the broker stopped reading it after a
    /// framing error (FRAME_TOO_LARGE, BAD_MAGIC) or it failed (`Err`, why); and it is taken
    /// out of `slot`. Always taken: its end has been read from `done`, which must not be
    /// awaited again (`flush` would, and a tokio oneshot panics when polled after it
    /// completed).
    fn take_if_over(slot: &mut Option<Stream>) -> Option<Result<(), ClientError>> {
        let stream = slot.as_mut()?;
        let over = match lock(&stream.fatal).clone() {
            Some(why) => Some(Err(why)),
            None => match stream.done.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => None,
                Ok(ended) => Some(ended),
                Err(oneshot::error::TryRecvError::Closed) => Some(Err(ClientError::Closed)),
            },
        };
        if over.is_some() {
            *slot = None;
        }
        over
    }
}

/// The most a batch's buffer makes room for before its messages are written.
const MAX_BATCH_RESERVE: usize = 1 << 20;

/// A CONFIRM's offsets for `sent` messages: one per message (protocol.md §6.4), or it is not
/// their confirmation (a single publish returned `Ok(None)`, or the first of several offsets).
fn one_per_message(
    offsets: Option<Vec<u64>>,
    sent: usize,
) -> Result<Option<Vec<u64>>, ClientError> {
    match offsets {
        Some(o) if o.len() != sent => Err(ClientError::Protocol(
            aqueduct_proto::ProtoError::BadPayload {
                opcode: "CONFIRM",
                problem: if sent == 1 {
                    "a confirmed publish's CONFIRM must name exactly one offset"
                } else {
                    "a confirmed batch's CONFIRM must name one offset per message"
                },
                len: o.len() * 8,
            },
        )),
        offsets => Ok(offsets),
    }
}

/// The PUBLISH_BATCH frame of `messages` (not async: nothing of the iterator is held across a
/// wait).
fn build_batch<'a>(
    messages: impl Iterator<Item = (&'a str, Bytes)>,
    opts: &PublishOptions,
) -> Result<aqueduct_proto::PublishBatch, ClientError> {
    let mut builder = BatchBuilder::new();
    let mut last: Option<TopicName> = None;
    let ttl = ttl_ms(opts);
    let expected = messages.size_hint().0;
    for (t, body) in messages {
        // Validate each distinct topic once, not once per message.
        let name = match last.take() {
            Some(n) if n.as_str() == t => n,
            _ => topic(t)?,
        };
        builder.push_traced(&name, &body, opts.priority, ttl, opts.trace.as_ref());
        if builder.len() == 1 {
            // Room for the rest at once, taking them to be the size of the first (bounded: a
            // large first message need not be followed by large ones).
            let rest = builder
                .encoded_len()
                .saturating_mul(expected.saturating_sub(1));
            builder.reserve(rest.min(MAX_BATCH_RESERVE));
        }
        last = Some(name);
    }
    Ok(builder.finish(Extensions {
        confirm: opts.confirm,
        ..Extensions::default()
    }))
}

pub(crate) fn topic(name: &str) -> Result<TopicName, ClientError> {
    TopicName::try_from(name).map_err(ClientError::invalid("topic name"))
}

/// A TTL in whole milliseconds, rounded up: at least 1 ms (a TTL of 0 on the wire means none,
/// protocol.md §3, so a TTL under a millisecond must not become "never expires").
fn ttl_ms(opts: &PublishOptions) -> Option<u32> {
    opts.ttl.map(|t| {
        t.as_nanos()
            .div_ceil(1_000_000)
            .clamp(1, u128::from(u32::MAX)) as u32
    })
}

/// A publisher that does not keep its stream alive ([`Publisher::downgrade`]).
#[derive(Debug, Clone)]
pub(crate) struct WeakPublisher(std::sync::Weak<Inner>);

impl WeakPublisher {
    pub(crate) fn upgrade(&self) -> Option<Publisher> {
        self.0.upgrade().map(|inner| Publisher { inner })
    }
}

impl Publisher {
    pub(crate) fn downgrade(&self) -> WeakPublisher {
        WeakPublisher(Arc::downgrade(&self.inner))
    }

    pub(crate) fn new(conn: Arc<crate::link::Link>, ids: Arc<crate::ids::Ids>) -> Publisher {
        Publisher {
            inner: Arc::new(Inner {
                conn,
                ids,
                send: tokio::sync::Mutex::new(None),
                lost: Mutex::new(None),
                unread_ends: Mutex::new(Vec::new()),
                flush_turn: tokio::sync::Mutex::new(()),
                flushes: Mutex::new(Vec::new()),
                next_flush: std::sync::atomic::AtomicU64::new(0),
                readers: Mutex::new(tokio::task::JoinSet::new()),
            }),
        }
    }

    /// Publish `body` to `topic` (priority 2, no TTL, no confirmation).
    ///
    /// `Ok` means the frame was handed to the connection, not that the broker took it: a
    /// refusal (an ACL, a body over the broker's frame limit) is reported by the next `flush`
    /// or `close`, and frames sent after a refused one on the same stream may not be read. For
    /// an answer per message, use [`PublishOptions::confirm`]. Call `flush` or `close` before
    /// the client is dropped: dropping it (with the last subscription, message or settler it
    /// gave, which hold the connection too) closes the connection at once, and what was not
    /// sent yet is lost.
    pub async fn publish(
        &self,
        topic_name: &str,
        body: impl Into<Bytes>,
    ) -> Result<(), ClientError> {
        self.publish_with(topic_name, body, &PublishOptions::default())
            .await
            .map(|_| ())
    }

    /// Publish with options; with `confirm`, returns the offset the broker assigned.
    pub async fn publish_with(
        &self,
        topic_name: &str,
        body: impl Into<Bytes>,
        opts: &PublishOptions,
    ) -> Result<Option<u64>, ClientError> {
        let mut p = Publish::new(topic(topic_name)?, body.into());
        p.ext.priority = opts.priority;
        p.ext.ttl_ms = ttl_ms(opts);
        p.ext.confirm = opts.confirm;
        p.ext.trace = opts.trace;
        let offsets = self.send(Wire::Publish(p), opts.confirm).await?;
        Ok(one_per_message(offsets, 1)?.and_then(|o| o.first().copied()))
    }

    /// Publish several messages in one PUBLISH_BATCH frame (all or nothing). With `confirm`,
    /// returns one offset per message, in order.
    pub async fn publish_batch<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, Bytes)>,
        opts: &PublishOptions,
    ) -> Result<Option<Vec<u64>>, ClientError> {
        let batch = build_batch(messages.into_iter(), opts)?;
        let messages = batch.len();
        one_per_message(
            self.send(Wire::PublishBatch(batch), opts.confirm).await?,
            messages,
        )
    }

    async fn send(&self, message: Wire, confirm: bool) -> Result<Option<Vec<u64>>, ClientError> {
        let rx = {
            let mut guard = self.inner.send.lock().await;
            let mut fresh = false;
            let (stream, id, rx) = loop {
                if let Some(Err(why)) = Stream::take_if_over(&mut guard) {
                    // Publish on a new stream instead; `flush` will say what the old one lost.
                    lock(&self.inner.lost).get_or_insert(why);
                }
                if guard.is_none() {
                    *guard = Some(self.open().await?);
                    fresh = true;
                }
                let Some(stream) = guard.as_mut() else {
                    return Err(ClientError::Closed);
                };
                // What an earlier call left queued when it was cancelled goes out first. This
                // wait is cancel-safe and comes before this call queues anything: cancelled
                // calls (a publish under a timeout while the broker does not read) cannot pile
                // their frames up, each to be sent later.
                if let Err(e) = stream.send.write_queued().await {
                    // The stream broke under what earlier calls left: this message goes on a
                    // new one, and the next flush says what may not have been read, in the
                    // broker's words if its replies already said why (not waited for here,
                    // under the lock every publish takes).
                    let broken = guard.take();
                    let why = broken.as_ref().and_then(|b| lock(&b.fatal).clone());
                    lock(&self.inner.lost).get_or_insert(why.unwrap_or(e));
                    continue;
                }
                let Some(stream) = guard.as_mut() else {
                    return Err(ClientError::Closed);
                };
                if !confirm {
                    break (stream, 0, None);
                }
                let id = self.inner.ids.request();
                let (tx, rx) = oneshot::channel();
                let inserted = match lock(&stream.pending).as_mut() {
                    Some(waiting) => {
                        waiting.insert(id, tx);
                        true
                    }
                    None => false,
                };
                if inserted {
                    break (stream, id, Some(rx));
                }
                // Its replies ended just now: nothing was sent yet, so use a new stream (once;
                // a new stream that ends at once is the connection failing, and says why).
                if fresh {
                    return Err(match Stream::take_if_over(&mut guard) {
                        Some(Err(why)) => why,
                        _ => ClientError::Closed,
                    });
                }
                // How it ended is known (its replies task says so before it stops taking
                // confirmations): kept for the next flush if it lost anything.
                match Stream::take_if_over(&mut guard) {
                    Some(Err(why)) => {
                        lock(&self.inner.lost).get_or_insert(why);
                    }
                    Some(Ok(())) => {}
                    None => *guard = None,
                }
            };
            // A batch's payload is sent as it was built, after its head: not copied again.
            let (head, tail) = Frame::new(id, message).encode_split();
            // Queued whole: from here on the frame is sent even if this call is cancelled (the
            // next write on the stream finishes it), and its confirmation may come.
            stream.send.queue([head].into_iter().chain(tail));
            if let Err(e) = stream.send.write_queued().await {
                // The stream is broken: the next publish opens another, and the next flush
                // says that what went out on this one may not have been read.
                let broken = guard.take();
                // Said at once, under the lock: a flush meanwhile (or after this call is
                // cancelled in the waits below) reports the loss. The broker's reason, once
                // known, replaces it if no flush has taken it yet.
                lock(&self.inner.lost).get_or_insert(e.clone());
                drop(guard);
                let why = why_it_broke(rx, broken).await;
                let Some(why) = why else { return Err(e) };
                if let Some(said) = lock(&self.inner.lost).as_mut().filter(|l| **l == e) {
                    *said = why.clone();
                }
                return Err(why);
            }
            rx
        };
        match rx {
            None => Ok(None),
            Some(rx) => match rx.await {
                Ok(result) => result.map(Some),
                Err(_) => Err(ClientError::Closed),
            },
        }
    }

    async fn open(&self) -> Result<Stream, ClientError> {
        let (send, recv) = self.inner.conn.open_bi().await?;
        let (tx, done) = oneshot::channel();
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        // Ends with the stream (or the connection), at the latest with this publisher.
        let fatal = Fatal::default();
        let mut readers = lock(&self.inner.readers);
        while readers.try_join_next().is_some() {}
        readers.spawn(replies(
            FrameReader::new(recv),
            pending.clone(),
            fatal.clone(),
            tx,
        ));
        drop(readers);
        Ok(Stream {
            send: crate::link::FrameSink::new(send),
            pending,
            done,
            fatal,
        })
    }

    /// Wait until the broker has handled everything published on this stream so far (up to
    /// 10 s). The next publish opens a new stream.
    ///
    /// QUIC's own acknowledgement of the data is not enough: it says the broker *received* it,
    /// and a connection closed right after could still lose what the broker had not read yet.
    /// So the stream is finished and the broker's end of it awaited: the broker finishes its
    /// side only after handling every frame.
    ///
    /// An error says that something published since the last flush was refused (an ERROR
    /// answered a publish sent without `confirm`: [`ClientError::Broker`], the first one) or
    /// may not have been read (the stream or connection failed).
    ///
    /// Flushes called together (one in a task of its own, and [`Client::close`], say) each
    /// wait for everything published before they were called, and each says what went wrong
    /// with it: a flush called while another was waiting for the broker's answer returned
    /// `Ok` at once, as the stream it covered had been taken by the other. Each keeps to its
    /// own 10 s, waiting for the others included.
    ///
    /// [`Client::close`]: crate::Client::close
    pub async fn flush(&self) -> Result<(), ClientError> {
        let deadline = tokio::time::Instant::now() + FLUSH_WAIT;
        let (done, outcome) = tokio::sync::watch::channel(None);
        let me = self.inner.next_flush.fetch_add(1, Ordering::Relaxed);
        let earlier: Vec<FlushOutcome> = {
            let mut flushes = lock(&self.inner.flushes);
            let earlier = flushes.iter().map(|(_, o)| o.clone()).collect();
            flushes.push((me, outcome));
            earlier
        };
        // Taken out when this call ends, done or cancelled (a cancelled one says nothing: what
        // it was waiting for goes back to the next flush, `Unread`).
        let _registered = Registered {
            inner: &self.inner,
            me,
        };
        let turn = tokio::time::timeout_at(deadline, self.inner.flush_turn.lock()).await;
        let (mine, passed_on) = match turn {
            Ok(_turn) => self.flush_once(deadline).await,
            Err(_) => (Err(stuck()), Ok(())),
        };
        let _ = done.send(Some(passed_on));
        // Then what the flushes called before this one came to (waited for without the turn:
        // one that asks for it after this one does waits for this one), by the same deadline.
        let mut first_error = None;
        for mut outcome in earlier {
            match tokio::time::timeout_at(deadline, outcome.wait_for(Option::is_some)).await {
                Ok(Ok(o)) => {
                    if let Some(Err(e)) = &*o {
                        first_error.get_or_insert(e.clone());
                    }
                }
                // Cancelled: what it waited for went back to the flushes after it.
                Ok(Err(_)) => {}
                Err(_) => {
                    first_error.get_or_insert(stuck());
                }
            }
        }
        match (mine, first_error) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        }
    }

    /// One flush, with the turn held, by `deadline` (see [`flush`](Self::flush)). Returns its
    /// outcome, and what it passes on to the flushes called while it ran: the same, except a
    /// flush that could not take the stream in time, which took nothing (the next flush finishes
    /// what it would have, and says how that went).
    async fn flush_once(
        &self,
        deadline: tokio::time::Instant,
    ) -> (Result<(), ClientError>, Result<(), ClientError>) {
        // Bounded too: a publish the broker's flow control holds (it does not read the stream:
        // a `block` subscriber, a throttled quota) holds the stream's lock, and the rest of a
        // frame may still have to be written. Cancelled, what is queued stays for the next
        // publish or flush, and so does an earlier stream's loss (taken only once finished).
        let taken = tokio::time::timeout_at(deadline, async {
            let mut guard = self.inner.send.lock().await;
            let finished = match guard.as_mut() {
                None => Ok(()),
                Some(stream) => {
                    // Finished in place: a flush cancelled while the rest of a frame is still
                    // being written leaves it queued on the stream, for the next publish or
                    // flush.
                    let finished = stream.send.finish().await;
                    if let Some(Stream { done, .. }) = guard.take() {
                        lock(&self.inner.unread_ends).push(done);
                    }
                    finished
                }
            };
            // An earlier stream that ended badly: reported after the current one is flushed
            // (what went out on it must not be dropped with the connection meanwhile).
            let lost = lock(&self.inner.lost).take();
            (finished, lost)
        })
        .await;
        let Ok((finished, lost)) = taken else {
            return (Err(stuck()), Ok(()));
        };
        // The ends to wait for: this stream's, and those of streams an earlier flush was
        // cancelled while waiting for. What is not read yet when this flush is cancelled in
        // turn goes back for the next one (`Unread`'s drop), and so does an earlier stream's
        // loss.
        let mut ends = Unread {
            ends: std::mem::take(&mut *lock(&self.inner.unread_ends)),
            lost,
            inner: &self.inner,
        };
        let lost = ends.lost.clone();
        let mut first_error = lost.map(flush_error).or(finished.err());
        while let Some(end) = ends.ends.first_mut() {
            let result = match tokio::time::timeout_at(deadline, end).await {
                Ok(Ok(Ok(()))) => Ok(()),
                Ok(Ok(Err(e))) => Err(flush_error(e)),
                Ok(Err(_)) => Err(ClientError::Connection(
                    "the publish stream failed before the broker had read all of it".into(),
                )),
                Err(_) => Err(ClientError::Timeout(format!(
                    "the broker did not finish the publish stream within {FLUSH_WAIT:?} of the \
                     flush (what was published may or may not have been handled)"
                ))),
            };
            ends.ends.remove(0);
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        // Said by this flush: not put back.
        ends.lost = None;
        let outcome = first_error.map_or(Ok(()), Err);
        (outcome.clone(), outcome)
    }
}

/// A flush's entry in [`Inner::flushes`], taken out when the flush ends.
struct Registered<'a> {
    inner: &'a Inner,
    me: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        lock(&self.inner.flushes).retain(|(n, _)| *n != self.me);
    }
}

/// How long a flush waits, in all.
const FLUSH_WAIT: Duration = Duration::from_secs(10);

/// A flush that could not take the stream (another flush, or a publish the broker's flow
/// control holds, kept it) within [`FLUSH_WAIT`].
fn stuck() -> ClientError {
    ClientError::Timeout(format!(
        "the broker did not take what was published within {FLUSH_WAIT:?} (it is not reading \
         the publish stream: a subscriber with the block policy, a quota?)"
    ))
}

/// Stream ends a flush waits for, and an earlier stream's loss it is to report; what it has not
/// read or said when it is dropped (cancelled) goes back to the publisher, for the next flush.
struct Unread<'a> {
    ends: Vec<Done>,
    lost: Option<ClientError>,
    inner: &'a Inner,
}

impl Drop for Unread<'_> {
    fn drop(&mut self) {
        if !self.ends.is_empty() {
            lock(&self.inner.unread_ends).append(&mut self.ends);
        }
        if let Some(lost) = self.lost.take() {
            lock(&self.inner.lost).get_or_insert(lost);
        }
    }
}

/// What a flush says of a stream that ended badly: a refusal as the broker gave it (those
/// publishes were handled: not published), anything else as "may not have been read".
fn flush_error(e: ClientError) -> ClientError {
    match e {
        e @ ClientError::Broker { .. } => e,
        e => ClientError::Connection(format!(
            "the broker may not have read everything published: {}",
            reason(e)
        )),
    }
}

/// Why the broker stopped reading a stream a write just failed on, if it said so before it
/// stopped (FRAME_TOO_LARGE for this very frame, or an earlier one): its answer beats the bare
/// write error ("stopped reading the stream"). It comes as the failed frame's answer (`rx`, with
/// `confirm`), or as how the stream ended. Waits at most [`REASON_WAIT`] for each.
async fn why_it_broke(
    rx: Option<oneshot::Receiver<Result<Vec<u64>, ClientError>>>,
    broken: Option<Stream>,
) -> Option<ClientError> {
    if let Some(rx) = rx {
        if let Ok(Ok(Err(answer))) = tokio::time::timeout(REASON_WAIT, rx).await {
            return Some(answer);
        }
    }
    let broken = broken?;
    match tokio::time::timeout(REASON_WAIT, broken.done).await {
        Ok(Ok(Err(end))) => Some(end),
        _ => lock(&broken.fatal).clone(),
    }
}

/// How long a publish whose write failed waits for the broker's reason.
const REASON_WAIT: Duration = Duration::from_secs(2);

fn reason(e: ClientError) -> String {
    match e {
        ClientError::Connection(why) => why,
        other => other.to_string(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Route CONFIRM and ERROR replies on a publish stream to the waiting publishers.
async fn replies(
    mut reader: FrameReader,
    pending: Pending,
    fatal: Fatal,
    done: oneshot::Sender<Result<(), ClientError>>,
) {
    let take = |id: u32| lock(&pending).as_mut().and_then(|w| w.remove(&id));
    // ERRORs answering publishes nobody waits for (sent without `confirm`): the first, and how
    // many. The stream's outcome says so, for `flush`.
    let mut refused: Option<(ErrorFrame, usize)> = None;
    // An answer nobody waits for that could not be read (it may have been a refusal): the
    // stream's outcome says so too, unless a refusal does.
    let mut unreadable: Option<ClientError> = None;
    let finished = loop {
        let frame = match reader.next_or_bad().await {
            Ok(Some(Ok(frame))) => frame,
            // A whole frame that does not decode: its publish (if one waits) fails with why;
            // the answers after it are still read.
            Ok(Some(Err(bad))) => {
                warn!(
                    stream_id = bad.stream_id,
                    "unreadable answer on the publish stream: {}", bad.error
                );
                match take(bad.stream_id) {
                    Some(tx) => {
                        if let Err(Err(e)) = tx.send(Err(bad.error)) {
                            unreadable.get_or_insert(e);
                        }
                    }
                    None => {
                        unreadable.get_or_insert(bad.error);
                    }
                }
                continue;
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        match frame.message {
            Wire::Confirm(c) => {
                if let Some(tx) = take(frame.stream_id) {
                    let _ = tx.send(Ok(c.offsets));
                }
            }
            Wire::Error(e) => {
                if matches!(e.code, ErrorCode::BAD_MAGIC | ErrorCode::FRAME_TOO_LARGE) {
                    // The broker lost the frame boundary: it reads nothing after the bad frame
                    // (protocol.md 1.1). The stream counts as over from now on, so the next
                    // publish uses a new one, but it is read to its end: answers to earlier
                    // frames (the durable log's) may still come before the broker's FIN.
                    *lock(&fatal) = Some(ClientError::Connection(format!(
                        "the broker stopped reading the publish stream after {}: {}",
                        e.code, e.reason
                    )));
                }
                // A refusal nobody waits for (sent without `confirm`, or its confirmed publish
                // was cancelled after its frame was queued: it was still sent) is the stream's
                // to report, at the next flush.
                let unclaimed = match take(frame.stream_id) {
                    Some(tx) => tx
                        .send(Err(ClientError::Broker {
                            code: e.code,
                            reason: e.reason.clone(),
                        }))
                        .is_err(),
                    None => true,
                };
                if unclaimed {
                    debug!(code = %e.code, reason = %e.reason, "broker refused a publish");
                    match &mut refused {
                        Some((_, n)) => *n += 1,
                        None => refused = Some((e, 1)),
                    }
                }
            }
            other => warn!(opcode = ?other.opcode(), "unexpected frame on the publish stream"),
        }
    };
    // The stream is gone: fail whoever still waits, with the reason it ended (e.g. "the broker
    // requires a client certificate", or the stream-fatal ERROR), not a generic one.
    let finished = match (finished, lock(&fatal).clone()) {
        (Ok(()), Some(why)) => Err(why),
        (other, _) => other,
    };
    let failure = match &finished {
        Err(e) => e.clone(),
        Ok(()) => ClientError::Connection(
            "the broker finished the publish stream before answering".into(),
        ),
    };
    // Read to its end, and every frame handled: but some were refused, or unreadable.
    let finished = match (finished, refused) {
        (Ok(()), None) => unreadable.map_or(Ok(()), Err),
        (Ok(()), Some((first, n))) => Err(ClientError::Broker {
            code: first.code,
            reason: match n {
                1 => first.reason,
                n => format!(
                    "{} (the first of {n} publish frames refused on this stream)",
                    first.reason
                ),
            },
        }),
        (other, _) => other,
    };
    let _ = done.send(finished);
    // Closed under the lock: a publish that comes later sees it and uses a new stream.
    let waiting = lock(&pending).take().unwrap_or_default();
    for (_, tx) in waiting {
        let _ = tx.send(Err(failure.clone()));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::test_broker::within;

    const CONFIRM: PublishOptions = PublishOptions {
        priority: None,
        ttl: None,
        confirm: true,
        trace: None,
    };

    type Confirmed = Result<Option<u64>, ClientError>;

    /// Two confirmed publishes on `client`'s publish stream, with `broker` (the fake broker's
    /// side, holding its streams until it ends) alongside: their outcomes.
    async fn two_confirmed<S>(
        client: &crate::Client,
        broker: impl std::future::Future<Output = S>,
    ) -> (Confirmed, Confirmed) {
        let publishes = async {
            let first = client.publish_with("t", "a", &CONFIRM).await;
            let second = client.publish_with("t", "b", &CONFIRM).await;
            (first, second)
        };
        within(async { tokio::join!(publishes, broker) }).await.0
    }

    /// A flush called while another waits for the broker's answer waits too, and says what the
    /// broker answered: `Client::close` after a `flush` in another task returned `Ok` at once
    /// (the stream it covered had been taken by the other flush) while the broker was about to
    /// refuse what was published.
    #[tokio::test]
    async fn a_flush_called_while_another_waits_waits_for_the_same_answer() {
        use crate::test_broker::{read_frame, FakeBroker};
        use aqueduct_proto::frame::Message;
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        client.publish("t", "a").await.expect("sent");
        let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
        let (id, _) = read_frame(&mut recv).await;
        assert_eq!(id, 0, "sent without confirm");
        let first = tokio::spawn({
            let client = client.clone();
            async move { client.flush().await }
        });
        // The first flush has finished the stream: it waits for the broker's end of it.
        let mut rest = Vec::new();
        within(recv.read_to_end(1024))
            .await
            .map(|b| rest.extend(b))
            .expect("the stream's end");
        assert!(rest.is_empty(), "nothing after the publish");
        let publisher = client.default_publisher().clone();
        let closing = tokio::spawn(async move { client.close().await });
        // Both flushes called before the broker answers.
        within(async {
            while lock(&publisher.inner.flushes).len() < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        let refusal = ErrorFrame {
            code: ErrorCode::NOT_AUTHORIZED,
            reason: "no".into(),
        };
        send.write_all(&aqueduct_proto::Frame::new(0, Message::Error(refusal)).to_bytes())
            .await
            .expect("write");
        send.finish().expect("finish");
        for (what, result) in [
            ("flush", within(first).await.expect("joined")),
            ("close", within(closing).await.expect("joined")),
        ] {
            match result {
                Err(ClientError::Broker { code, .. }) => {
                    assert_eq!(code, ErrorCode::NOT_AUTHORIZED, "{what}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    /// A flush cancelled while it waits for the broker's end of the stream leaves what it was
    /// to report — a refusal on an earlier stream among it — to the next flush: the refusal was
    /// dropped with the cancelled flush, and the next flush said `Ok`.
    #[tokio::test]
    async fn a_cancelled_flush_leaves_an_earlier_loss_to_the_next() {
        use crate::test_broker::{read_frame, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let publisher = client.default_publisher().clone();
        client.publish("t", "a").await.expect("sent");
        let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
        read_frame(&mut recv).await;
        // An earlier stream ended with a refusal, not yet reported.
        let refusal = ClientError::Broker {
            code: ErrorCode::NOT_AUTHORIZED,
            reason: "no".into(),
        };
        *lock(&publisher.inner.lost) = Some(refusal.clone());
        let cancelled = tokio::time::timeout(Duration::from_millis(100), client.flush()).await;
        assert!(
            cancelled.is_err(),
            "the broker has not finished the stream yet"
        );
        within(recv.read_to_end(1024)).await.expect("the FIN");
        send.finish().expect("finish");
        assert_eq!(within(client.flush()).await, Err(refusal));
    }

    /// A flush keeps to its 10 s also while a publish the broker does not read (its flow
    /// control holds the stream) holds the stream: it waited for the stream's lock for good.
    #[tokio::test]
    async fn a_flush_keeps_to_its_deadline_while_a_publish_is_held() {
        use crate::test_broker::FakeBroker;
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        // More than the stream's flow-control window, and the broker reads nothing.
        let big = bytes::Bytes::from(vec![7u8; 4 << 20]);
        let held = tokio::spawn({
            let client = client.clone();
            async move { client.publish("t", big).await }
        });
        let (_send, _recv) = within(conn.accept_bi()).await.expect("the publish stream");
        let flushed = tokio::time::timeout(FLUSH_WAIT + Duration::from_secs(10), client.flush())
            .await
            .expect("the flush ends");
        match flushed {
            Err(ClientError::Timeout(why)) => assert!(why.contains("did not take"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(!held.is_finished(), "the publish is still held");
        held.abort();
    }

    /// A later broker's frame (an opcode this client does not know) on a publish stream is
    /// skipped, as protocol.md §10 says: the answer after it still reaches its publish. Before,
    /// the stream's reader stopped at it, and every publish waiting there failed.
    #[tokio::test]
    async fn a_frame_of_an_unknown_opcode_on_the_publish_stream_is_skipped() {
        use crate::test_broker::{confirm, read_frame, unknown_frame, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
            for offset in [7u64, 8] {
                let (id, _) = read_frame(&mut recv).await;
                send.write_all(&unknown_frame(id)).await.expect("write");
                send.write_all(&confirm(id, vec![offset]))
                    .await
                    .expect("write");
            }
            (send, recv)
        };
        let (first, second) = two_confirmed(&client, broker).await;
        assert_eq!(first.expect("confirmed"), Some(7));
        assert_eq!(second.expect("confirmed"), Some(8));
    }

    /// A CONFIRM naming no offset, or two, for one message is not its confirmation: it
    /// returned `Ok(None)` (or the first offset) as if all were well.
    #[tokio::test]
    async fn a_confirm_without_one_offset_per_message_is_an_error() {
        use crate::test_broker::{confirm, read_frame, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
            for offsets in [vec![], vec![1, 2]] {
                let (id, _) = read_frame(&mut recv).await;
                send.write_all(&confirm(id, offsets)).await.expect("write");
            }
            (send, recv)
        };
        let (first, second) = two_confirmed(&client, broker).await;
        for answer in [first, second] {
            match answer {
                Err(ClientError::Protocol(e)) => {
                    assert!(e.to_string().contains("exactly one offset"), "{e}")
                }
                other => panic!("{other:?}"),
            }
        }
        // A batch of two confirmed with one offset (on a stream of its own: the fake broker
        // let go of the first one).
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
            let (id, _) = read_frame(&mut recv).await;
            send.write_all(&confirm(id, vec![5])).await.expect("write");
            (send, recv)
        };
        let publisher = client.publisher();
        let batch =
            publisher.publish_batch([("t", Bytes::from("a")), ("t", Bytes::from("b"))], &CONFIRM);
        let (answer, _) = within(async { tokio::join!(batch, broker) }).await;
        match answer {
            Err(ClientError::Protocol(e)) => {
                assert!(e.to_string().contains("one offset per message"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// An answer that does not decode (a CONFIRM whose data is not whole offsets) fails the
    /// publish it answers, with why, and the stream goes on: the next publish on it is
    /// confirmed.
    #[tokio::test]
    async fn an_unreadable_answer_fails_its_publish_only() {
        use crate::test_broker::{confirm, read_frame, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the publish stream");
            let (id, _) = read_frame(&mut recv).await;
            // CONFIRM (0x07) with 5 bytes of data: not a whole u64.
            let mut bad = vec![0x1F, 0x07];
            bad.extend_from_slice(&id.to_le_bytes());
            bad.extend_from_slice(&5u32.to_le_bytes());
            bad.extend_from_slice(&[0; 5]);
            send.write_all(&bad).await.expect("write");
            let (id, _) = read_frame(&mut recv).await;
            send.write_all(&confirm(id, vec![9])).await.expect("write");
            (send, recv)
        };
        let (first, second) = two_confirmed(&client, broker).await;
        match first {
            Err(ClientError::Protocol(_)) => {}
            other => panic!("expected a protocol error, got {other:?}"),
        }
        assert_eq!(second.expect("confirmed"), Some(9));
    }

    /// A TTL is rounded up to whole milliseconds, at least 1: a TTL of 0 on the wire means
    /// none, so 500 µs became "never expires".
    #[test]
    fn a_ttl_rounds_up_to_a_millisecond() {
        let ttl = |t: Duration| {
            ttl_ms(&PublishOptions {
                ttl: Some(t),
                ..PublishOptions::default()
            })
        };
        assert_eq!(ttl(Duration::from_micros(500)), Some(1));
        assert_eq!(ttl(Duration::ZERO), Some(1));
        assert_eq!(ttl(Duration::from_micros(1500)), Some(2));
        assert_eq!(ttl(Duration::from_secs(2)), Some(2000));
        assert_eq!(ttl(Duration::from_secs(u64::MAX)), Some(u32::MAX));
        assert_eq!(ttl_ms(&PublishOptions::default()), None);
    }

    /// A stream whose end has been read is taken out of its slot, so that nothing awaits that
    /// end a second time. Before the fix, a publish whose just-opened stream ended at once read
    /// the end and left the stream in place; the `flush` after it (`Client::close`) awaited it
    /// again and tokio's oneshot panicked ("called after complete"). The race that led there is
    /// too narrow to provoke from outside; this checks the rule that closes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_whose_end_was_read_leaves_its_slot() {
        let broker = crate::test_broker::TestBroker::start().await;
        let client = within(crate::Client::connect(broker.options()))
            .await
            .expect("connects");
        let publisher = client.publisher();
        let mut slot = Some(publisher.open().await.expect("a stream"));
        assert!(
            Stream::take_if_over(&mut slot).is_none(),
            "a live stream is not over"
        );
        assert!(slot.is_some(), "a live stream stays");

        // The connection goes: the stream's replies end, with the reason, and the reader task
        // finishes after it has sent the end.
        client
            .close()
            .await
            .expect("close: everything published was taken");
        let mut readers = std::mem::take(&mut *lock(&publisher.inner.readers));
        within(readers.join_next())
            .await
            .expect("a replies task")
            .expect("the replies task finished without panicking");
        let over = Stream::take_if_over(&mut slot).expect("the stream is over");
        assert!(over.is_err(), "ended by a closed connection: {over:?}");
        assert!(
            slot.is_none(),
            "a stream whose end was read must leave its slot"
        );
        assert!(Stream::take_if_over(&mut slot).is_none());

        broker.stop().await;
    }
}
