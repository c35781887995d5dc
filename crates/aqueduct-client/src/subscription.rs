//! A subscription as a `futures::Stream` of messages, and settling them.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use aqueduct_proto::frame::Message as Wire;
use aqueduct_proto::{
    Ack, DeliveryRef, ErrorCode, Extensions, Frame, FrameHeader, Nack, Opcode, Priority, Publish,
    TopicFilter, TopicName, TopicRef, Unsubscribe,
};
use bytes::{Buf, Bytes};
use futures_core::Stream;

use crate::error::ClientError;
use crate::reader::FrameReader;

/// The subscription's identity and its stream's sending half (for ACK, NACK, UNSUBSCRIBE).
#[derive(Debug)]
pub(crate) struct SubHandle {
    id: u32,
    filter: TopicFilter,
    /// Shared by every subscription made on the same stream.
    send: Arc<tokio::sync::Mutex<crate::link::FrameSink>>,
    /// The connection's ids: this one is free again when the handle goes.
    ids: Arc<crate::ids::Ids>,
    /// Its UNSUBSCRIBE was written: a later attempt (the drop's, after a `close` cut short)
    /// does not send it again (the broker would answer NOT_SUBSCRIBED, unread).
    unsubscribed: std::sync::atomic::AtomicBool,
}

impl Drop for SubHandle {
    fn drop(&mut self) {
        self.ids.release(self.id);
    }
}

impl SubHandle {
    pub(crate) fn new(
        id: u32,
        filter: TopicFilter,
        send: Arc<tokio::sync::Mutex<crate::link::FrameSink>>,
        ids: Arc<crate::ids::Ids>,
    ) -> Self {
        SubHandle {
            id,
            filter,
            send,
            ids,
            unsubscribed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    async fn send(&self, message: Wire) -> Result<(), ClientError> {
        let bytes = Frame::new(self.id, message).to_bytes();
        self.send.lock().await.send([bytes]).await
    }
}

/// One delivered message.
///
/// Kept small (it is moved several times between the network and the application): the
/// extensions every delivery carries are fields, anything rarer (trace context, dead-letter
/// origin, …) is boxed, and only when present.
#[derive(Debug, Clone)]
pub struct Message {
    topic: TopicName,
    body: Bytes,
    offset: Option<u64>,
    attempt: Option<u32>,
    priority: Option<Priority>,
    /// Whether the topic came as an extension (not the seed's legacy topic-as-body form).
    topic_ext: bool,
    /// The other extensions, if the broker sent any.
    rare: Option<Box<Extensions>>,
    handle: Arc<SubHandle>,
}

impl Message {
    /// The concrete topic (also for wildcard subscriptions).
    pub fn topic(&self) -> &TopicName {
        &self.topic
    }
    pub fn body(&self) -> &Bytes {
        &self.body
    }
    /// The message's offset in its topic.
    pub fn offset(&self) -> u64 {
        self.offset.unwrap_or_default()
    }
    pub fn priority(&self) -> Priority {
        self.priority.unwrap_or_default()
    }
    /// 1 for the first delivery, +1 for each redelivery.
    pub fn attempt(&self) -> u32 {
        self.attempt.unwrap_or(1)
    }
    /// The message's trace context, if its publisher sent one. With a broker that exports
    /// traces, its span id is the broker's `publish` span: make the processing span its child.
    pub fn trace(&self) -> Option<crate::TraceContext> {
        self.rare.as_ref().and_then(|e| e.trace)
    }

    /// [`trace`](Self::trace) as an OpenTelemetry span context (remote), to parent a span on.
    #[cfg(feature = "opentelemetry")]
    pub fn span_context(&self) -> Option<opentelemetry::trace::SpanContext> {
        self.trace().map(|t| crate::trace::span_context(&t))
    }

    /// Every extension the broker sent (trace, compression, dead-letter origin, …), as on the
    /// wire.
    pub fn extensions(&self) -> Extensions {
        let mut ext = self.rare.as_deref().cloned().unwrap_or_default();
        ext.topic = self.topic_ext.then(|| self.topic.clone());
        ext.offset = self.offset;
        ext.attempt = self.attempt;
        ext.priority = self.priority;
        ext
    }

    /// A delivery that carries only the usual extensions (topic, offset, attempt, priority).
    fn plain(
        topic: TopicName,
        body: Bytes,
        (offset, attempt, priority): (Option<u64>, Option<u32>, Option<Priority>),
        handle: &Arc<SubHandle>,
    ) -> Message {
        Message {
            topic,
            body,
            offset,
            attempt,
            priority,
            topic_ext: true,
            rare: None,
            handle: handle.clone(),
        }
    }

    fn from_wire(p: Publish, handle: &Arc<SubHandle>) -> Message {
        let topic = p.topic().clone();
        let mut ext = p.ext;
        let (offset, attempt, priority) =
            (ext.offset.take(), ext.attempt.take(), ext.priority.take());
        let topic_ext = ext.topic.take().is_some();
        Message {
            topic,
            body: p.body,
            offset,
            attempt,
            priority,
            topic_ext,
            rare: (ext != Extensions::default()).then(|| Box::new(ext)),
            handle: handle.clone(),
        }
    }

    /// What settling this delivery takes, as a [`Settler`] also does.
    fn settler(&self) -> Settler {
        Settler::new(
            &self.handle,
            || self.topic.clone(),
            self.offset(),
            self.attempt(),
        )
    }

    /// Settle this delivery. Refusals (e.g. already redelivered) arrive on the subscription
    /// stream as `Err` items.
    pub async fn ack(&self) -> Result<(), ClientError> {
        self.settler().ack().await
    }

    /// Reject this delivery: the broker redelivers it, or dead-letters it after its retries.
    /// `reason` goes to the dead letter's REASON; the protocol carries at most 255 bytes of it,
    /// and a longer one is cut to that (at a character boundary).
    pub async fn nack(&self, reason: Option<&str>) -> Result<(), ClientError> {
        self.settler().nack(reason).await
    }
}

/// What settling one delivery takes, without its body ([`MessageRef::settler`]): to acknowledge
/// or reject a message lent by [`Subscription::next_batch`] once the call has returned.
#[derive(Debug, Clone)]
pub struct Settler {
    handle: Arc<SubHandle>,
    /// The topic, for a wildcard subscription only (offsets are per topic).
    topic: Option<TopicName>,
    offset: u64,
    attempt: u32,
}

impl Settler {
    fn new(
        handle: &Arc<SubHandle>,
        topic: impl FnOnce() -> TopicName,
        offset: u64,
        attempt: u32,
    ) -> Settler {
        Settler {
            handle: handle.clone(),
            // Offsets are per topic: a wildcard subscription must say which topic.
            topic: handle.filter.is_wildcard().then(topic),
            offset,
            attempt,
        }
    }

    fn ext(&self) -> Extensions {
        Extensions {
            topic: self.topic.clone(),
            attempt: Some(self.attempt),
            ..Extensions::default()
        }
    }

    /// As [`Message::ack`].
    pub async fn ack(&self) -> Result<(), ClientError> {
        let mut ack = Ack::new(self.offset);
        ack.ext = self.ext();
        self.handle.send(Wire::Ack(ack)).await
    }

    /// As [`Message::nack`].
    pub async fn nack(&self, reason: Option<&str>) -> Result<(), ClientError> {
        let mut nack = Nack::new(self.offset);
        nack.ext = self.ext();
        nack.ext.reason = reason.map(str::to_owned);
        self.handle.send(Wire::Nack(nack)).await
    }
}

/// A live subscription. Dropping it unsubscribes.
///
/// Messages are read from the subscription's QUIC stream and decoded when the application asks
/// for them, in the application's own task: no reader task, no channel in between. While the
/// application does not ask, nothing is read, QUIC flow control holds the broker, and the
/// subscription's backpressure policy applies there. Each subscription's stream holds up to
/// 8 MiB unread, and only itself back: the other streams of the connection go on.
pub struct Subscription {
    reader: FrameReader,
    /// The first (usually the only) subscription delivered on this stream.
    handle: Arc<SubHandle>,
    /// Further subscriptions on the same stream ([`crate::Client::subscribe_many`]), with
    /// consecutive ids after `handle`'s.
    more: Vec<Arc<SubHandle>>,
    /// Deliveries that arrived while later SUBSCRIBEs of the stream were being confirmed.
    early: std::collections::VecDeque<Result<Message, ClientError>>,
    /// Subscriptions of this stream the broker closed (slow consumers).
    closed_ids: Vec<u32>,
    /// The previous delivery's topic, shared with the next one when it is the same.
    last_topic: Option<TopicName>,
    /// The stream ended (or failed): nothing more comes.
    ended: bool,
    unsubscribed: bool,
    /// A `close` is under way: it ends the sending side itself, after its UNSUBSCRIBEs.
    closing: bool,
    /// See [`Subscription::durable_log`].
    durable_log: Option<bool>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("handle", &self.handle)
            .field("ended", &self.ended)
            .finish()
    }
}

impl Subscription {
    /// `early`: what came for subscriptions already confirmed while the others were being
    /// confirmed, with the stream id it came with.
    pub(crate) fn start(
        handles: Vec<Arc<SubHandle>>,
        reader: FrameReader,
        early: Vec<(u32, Result<Message, ClientError>)>,
        durable_log: Option<bool>,
    ) -> Option<Subscription> {
        let mut handles = handles.into_iter();
        let handle = handles.next()?;
        let mut sub = Subscription {
            reader,
            handle,
            more: handles.collect(),
            early: std::collections::VecDeque::with_capacity(early.len()),
            closed_ids: Vec::new(),
            last_topic: None,
            ended: false,
            unsubscribed: false,
            closing: false,
            durable_log,
        };
        // Ended only once these are read (`poll_item` takes them first).
        for (stream_id, it) in early {
            if let Err(e) = &it {
                sub.note_closed(stream_id, e);
            }
            sub.early.push_back(it);
        }
        Some(sub)
    }

    /// For a durable subscription ([`crate::SubscribeOptions::durable`]): `Some(true)` if the
    /// broker serves it from its durable log (its position is stored and survives restarts),
    /// `Some(false)` if the broker runs without the log and made it an in-memory consumer
    /// group instead (nothing is replayed; protocol.md §7.1). `None` for any other
    /// subscription, or from a broker that does not say.
    pub fn durable_log(&self) -> Option<bool> {
        self.durable_log
    }

    /// The filter subscribed to.
    pub fn filter(&self) -> &TopicFilter {
        &self.handle.filter
    }

    /// The next message (`None` once the subscription has ended).
    pub async fn next_message(&mut self) -> Option<Result<Message, ClientError>> {
        std::future::poll_fn(|cx| self.poll_item(cx)).await
    }

    /// A message already received, without waiting; `None` if there is none right now (which
    /// does not mean the subscription has ended). Cheaper than [`Self::next_message`] when
    /// draining a burst.
    pub fn try_next_message(&mut self) -> Option<Result<Message, ClientError>> {
        match self.poll_item(&mut Context::from_waker(std::task::Waker::noop())) {
            Poll::Ready(item) => item,
            Poll::Pending => None,
        }
    }

    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message, ClientError>>> {
        if let Some(early) = self.early.pop_front() {
            return Poll::Ready(Some(early));
        }
        loop {
            if self.ended {
                self.end_sending();
                return Poll::Ready(None);
            }
            match self.reader.try_next_raw() {
                Ok(Some((header, data))) => {
                    if let Some(it) = self.take_frame(&header, data) {
                        return Poll::Ready(Some(it));
                    }
                }
                Ok(None) => match self.reader.poll_read_more(cx) {
                    Poll::Ready(Ok(true)) => {}
                    Poll::Ready(Ok(false)) => self.ended = true,
                    Poll::Ready(Err(e)) => {
                        self.ended = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                    Poll::Pending => return Poll::Pending,
                },
                Err(e) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    /// What one frame of the stream means to the application (`None` for frames it does not
    /// see), keeping the stream's own account of which of its subscriptions the broker closed.
    fn take_frame(
        &mut self,
        header: &FrameHeader,
        data: Bytes,
    ) -> Option<Result<Message, ClientError>> {
        let handle = handle_for(&self.handle, &self.more, header.stream_id);
        let it = fast_item(header, data, handle, &mut self.last_topic)?;
        if let Err(e) = &it {
            self.note_closed(header.stream_id, e);
        }
        Some(it)
    }

    /// The broker closes a subscription after ERROR SLOW_CONSUMER (§7.3) or NOT_AUTHORIZED (its
    /// permission was revoked, §11) with its stream id; the stream's other subscriptions, if
    /// any, go on until they are closed too. Once all are, the subscription ends.
    fn note_closed(&mut self, stream_id: u32, e: &ClientError) {
        let ours = self.handle.id == stream_id || self.more.iter().any(|h| h.id == stream_id);
        if ours && closes_subscription(e) && !self.closed_ids.contains(&stream_id) {
            self.closed_ids.push(stream_id);
            self.ended = self.closed_ids.len() > self.more.len();
        }
    }

    /// Wait for a message, then hand it and every further message already read with it, up to
    /// `max` in all, to `f`, in order, each as a [`MessageRef`] borrowed from the subscription's
    /// read buffer. One call lends what one read of the stream brought (and what an earlier
    /// call left): what it lends arrived together. A delivery that carries only the usual extensions (topic, offset, attempt,
    /// priority) is read in place: nothing is copied, allocated or reference-counted for it,
    /// except a copy of its topic name when that differs from the previous delivery's. Others
    /// (trace context, dead-letter origin, the seed's legacy form) are decoded into an owned
    /// [`Message`] first and lent from that, in their place. Returns how many `f` was given, or
    /// `None` once the subscription has ended; an error comes after the messages received
    /// before it, in a call of its own.
    ///
    /// The fastest way to consume a busy subscription (`aqueduct bench` uses it). To keep a
    /// message past the call, take it with [`MessageRef::to_message`] (which copies its body);
    /// to acknowledge or reject it afterwards, take its [`MessageRef::settler`].
    ///
    /// Cancel safe: `f` is called only in the poll that completes the future, so a future
    /// dropped before it completes has lent nothing and consumed nothing. If `f` panics, the
    /// message it was given may be lent again by a later call.
    ///
    /// ```no_run
    /// # async fn f(mut sub: aqueduct_client::Subscription) -> Result<(), aqueduct_client::ClientError> {
    /// let mut bytes = 0;
    /// while let Some(n) = sub.next_batch(1024, |m| bytes += m.body().len()).await {
    ///     let n = n?;
    ///     println!("{n} messages, {bytes} bytes so far");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next_batch<F>(
        &mut self,
        max: usize,
        mut f: F,
    ) -> Option<Result<usize, ClientError>>
    where
        F: FnMut(MessageRef<'_>),
    {
        let max = max.max(1);
        std::future::poll_fn(|cx| self.poll_batch(cx, max, &mut f)).await
    }

    fn poll_batch<F>(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        f: &mut F,
    ) -> Poll<Option<Result<usize, ClientError>>>
    where
        F: FnMut(MessageRef<'_>),
    {
        let mut n = 0;
        while n < max {
            // Owned items come first: they arrived before anything still in the buffer.
            if let Some(item) = self.early.pop_front() {
                match item {
                    Ok(m) => {
                        f(MessageRef(View::Owned(&m)));
                        n += 1;
                    }
                    Err(e) if n == 0 => return Poll::Ready(Some(Err(e))),
                    Err(e) => {
                        self.early.push_front(Err(e));
                        break;
                    }
                }
                continue;
            }
            if self.ended {
                break;
            }
            match self.reader.peek_raw() {
                Ok(Some((header, len))) => {
                    let handle = handle_for(&self.handle, &self.more, header.stream_id);
                    let data = self.reader.frame_data(len);
                    if let Some(m) = borrowed(&header, data, handle, &mut self.last_topic) {
                        f(m);
                        self.reader.consume(len);
                        n += 1;
                        continue;
                    }
                    // Anything else, errors included: owned, through the full decoder.
                    match self.reader.try_next_raw() {
                        Ok(Some((header, data))) => {
                            if let Some(it) = self.take_frame(&header, data) {
                                self.early.push_back(it);
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            self.ended = true;
                            self.early.push_back(Err(e));
                        }
                    }
                }
                // What one read brought is lent: the next read is the next call's, so that
                // what a call lends arrived together (a caller timing arrivals reads its clock
                // once per call).
                Ok(None) if n > 0 => break,
                Ok(None) => match self.reader.poll_read_more(cx) {
                    Poll::Ready(Ok(true)) => {}
                    Poll::Ready(Ok(false)) => self.ended = true,
                    Poll::Ready(Err(e)) => {
                        self.ended = true;
                        self.early.push_back(Err(e));
                    }
                    Poll::Pending => return Poll::Pending,
                },
                Err(e) => {
                    self.ended = true;
                    self.early.push_back(Err(e));
                }
            }
        }
        if n == 0 && self.ended {
            self.end_sending();
        }
        Poll::Ready((n > 0).then_some(Ok(n)))
    }

    /// The stream is over (the broker closed its subscriptions, reset or finished it, or its
    /// frame boundary was lost): end this side too, as protocol.md §13 asks. Until then the
    /// broker kept the stream's subscriptions registered, detached, for as long as the
    /// application held the ended subscription. Not while a `close` or `unsubscribe` holds the
    /// stream: it ends it itself.
    fn end_sending(&mut self) {
        if self.unsubscribed || self.closing {
            return;
        }
        if let Ok(mut sink) = self.handle.send.try_lock() {
            if sink.finish_now() {
                self.unsubscribed = true;
            }
        }
    }

    /// Unsubscribe and wait (up to 10 s) until the request is sent. If it is not sent by then,
    /// or the future is dropped first, dropping the subscription sends it.
    pub async fn unsubscribe(mut self) -> Result<(), ClientError> {
        let sent = tokio::time::timeout(
            UNSUBSCRIBE_WAIT,
            unsubscribe(self.all_handles(), &self.closed_ids),
        )
        .await;
        match sent {
            Ok(result) => {
                // Sent, or the stream is gone: nothing for the drop to do.
                self.unsubscribed = true;
                result
            }
            Err(_) => Err(ClientError::Timeout(
                "the broker did not take the UNSUBSCRIBE within 10 s".into(),
            )),
        }
    }

    /// Unsubscribe and wait (up to 10 s) until the broker has handled everything sent on the
    /// subscription's stream — the ACKs and NACKs before the UNSUBSCRIBE included — and finished
    /// its side. Messages still arriving meanwhile are discarded: with explicit ACKs (always so
    /// in a group) they were not acknowledged, and a group or durable consumer gets them again;
    /// without, they count as settled when the broker wrote them. Prefer it to dropping the subscription, or closing the
    /// client, right after acknowledging: those may cut ACKs that are still on their way, and
    /// their messages are then delivered again.
    ///
    /// An ERROR the broker sends meanwhile (an ACK or NACK it refused, a subscription it
    /// closed as a slow consumer) is reported once the stream is finished: the first one, as
    /// [`ClientError::Broker`], with how many there were.
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.closing = true;
        let (handles, closed) = (self.all_handles(), self.closed_ids.clone());
        let mut refused: Option<(ClientError, usize)> = None;
        // The first error that is not the broker's (a delivery that did not decode, the
        // connection's end): reported once the stream is done with, not in its place.
        let mut failed: Option<ClientError> = None;
        // One deadline for all of it, and the stream read while the UNSUBSCRIBEs are written:
        // a broker that stops reading the stream until its replies are read (or never reads
        // it again) held the writes, outside the deadline, for ever.
        let drained = tokio::time::timeout(UNSUBSCRIBE_WAIT, async {
            let sending = unsubscribe(handles, &closed);
            let draining = async {
                loop {
                    match self.next_message().await {
                        None => return Ok::<(), ClientError>(()),
                        Some(Err(e)) if e.code().is_none() => {
                            failed.get_or_insert(e);
                        }
                        Some(Err(e)) => match &mut refused {
                            Some((_, n)) => *n += 1,
                            None => refused = Some((e, 1)),
                        },
                        Some(Ok(_)) => {}
                    }
                }
            };
            tokio::try_join!(sending, draining).map(|_| ())
        })
        .await;
        if drained.is_ok() {
            // Done with, whatever the outcome: nothing for the drop to do. Cut short (by the
            // deadline, or this future dropped), the drop still unsubscribes.
            self.unsubscribed = true;
        }
        match (drained, refused, failed) {
            // The broker's refusal says more than the stream's end it may have caused (a
            // write stopped after a slow-consumer reset, say).
            (Ok(_), Some((first, n)), _) => Err(first_of(first, n)),
            (Ok(Err(e)), None, _) | (Ok(Ok(())), None, Some(e)) => Err(e),
            (Ok(Ok(())), None, None) => Ok(()),
            (Err(_), ..) => Err(ClientError::Timeout(
                "the broker did not finish the subscription's stream within 10 s".into(),
            )),
        }
    }

    fn all_handles(&self) -> Vec<Arc<SubHandle>> {
        std::iter::once(self.handle.clone())
            .chain(self.more.iter().cloned())
            .collect()
    }
}

/// How long `unsubscribe`, `close` and a dropped subscription wait for the broker to take the
/// UNSUBSCRIBEs (and, for `close`, to finish the stream).
const UNSUBSCRIBE_WAIT: Duration = Duration::from_secs(10);

/// The first of `n` ERRORs the broker sent while a subscription closed, saying how many.
fn first_of(first: ClientError, n: usize) -> ClientError {
    match first {
        ClientError::Broker { code, reason } if n > 1 => ClientError::Broker {
            code,
            reason: format!("{reason} (the first of {n} errors while the subscription closed)"),
        },
        other => other,
    }
}

/// UNSUBSCRIBE every subscription of the stream but those the broker `closed` (it would answer
/// NOT_SUBSCRIBED, which `close` then reported as an error), then finish it.
async fn unsubscribe(handles: Vec<Arc<SubHandle>>, closed: &[u32]) -> Result<(), ClientError> {
    use std::sync::atomic::Ordering;
    for handle in handles.iter().filter(|h| !closed.contains(&h.id)) {
        if handle.unsubscribed.load(Ordering::Acquire) {
            continue;
        }
        let u = Unsubscribe {
            filter: handle.filter.clone(),
            ext: Extensions::default(),
        };
        let frame = Frame::new(handle.id, Wire::Unsubscribe(u)).to_bytes();
        let mut sink = handle.send.lock().await;
        sink.write_queued().await?;
        sink.queue([frame]);
        // Queued: whichever write comes next sends it (this one, or a later attempt's).
        handle.unsubscribed.store(true, Ordering::Release);
        sink.write_queued().await?;
    }
    if let Some(h) = handles.first() {
        let _ = h.send.lock().await.finish().await;
    }
    Ok(())
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.unsubscribed {
            return;
        }
        let handles = self.all_handles();
        let closed = std::mem::take(&mut self.closed_ids);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            // Bounded, as `close` is: a broker that does not read the stream any more held this
            // task, and with it the connection, for good. Past the deadline the stream is
            // reset, which ends its subscriptions as surely (protocol.md §7.4).
            rt.spawn(async move {
                let sent =
                    tokio::time::timeout(UNSUBSCRIBE_WAIT, unsubscribe(handles.clone(), &closed))
                        .await;
                if sent.is_err() {
                    if let Some(h) = handles.first() {
                        h.send.lock().await.reset(0);
                    }
                }
            });
        }
    }
}

impl Stream for Subscription {
    type Item = Result<Message, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_item(cx)
    }
}

/// The subscription of a stream a delivery with `stream_id` belongs to: `first`, or one of
/// `more` (consecutive ids after `first`'s, see `Client::subscribe_many`).
fn handle_for<'a>(
    first: &'a Arc<SubHandle>,
    more: &'a [Arc<SubHandle>],
    stream_id: u32,
) -> &'a Arc<SubHandle> {
    let index = stream_id.wrapping_sub(first.id) as usize;
    match index.checked_sub(1).and_then(|i| more.get(i)) {
        Some(h) => h,
        None => first,
    }
}

/// What one frame means to the application; `None` for frames it does not see.
pub(crate) fn item(frame: Frame, handle: &Arc<SubHandle>) -> Option<Result<Message, ClientError>> {
    match frame.message {
        Wire::Publish(p) => Some(Ok(Message::from_wire(p, handle))),
        Wire::Error(e) => Some(Err(ClientError::Broker {
            code: e.code,
            reason: e.reason,
        })),
        _ => None,
    }
}

/// A delivery read straight from its frame when it carries only the usual extensions (topic,
/// offset, attempt, priority): no `Frame`, no `Extensions`, and the topic shared with the
/// previous delivery's when it is the same. Anything else goes through the full decoder.
fn fast_item(
    header: &FrameHeader,
    data: Bytes,
    handle: &Arc<SubHandle>,
    last_topic: &mut Option<TopicName>,
) -> Option<Result<Message, ClientError>> {
    let fast = if header.opcode == Opcode::Publish {
        DeliveryRef::parse_after(header, &data, last_topic.as_ref())
            .ok()
            .and_then(|d| {
                let t = d.topic.filter(|_| !d.more)?;
                let topic = match last_topic {
                    Some(last) if last.as_bytes() == t.as_bytes() => last.clone(),
                    _ => {
                        let name = d.topic_in(&data)?;
                        *last_topic = Some(name.clone());
                        name
                    }
                };
                Some((topic, d.offset, d.attempt, d.priority, d.body_start))
            })
    } else {
        None
    };
    match fast {
        Some((topic, offset, attempt, priority, body_start)) => {
            let mut body = data;
            body.advance(body_start);
            Some(Ok(Message::plain(
                topic,
                body,
                (offset, attempt, priority),
                handle,
            )))
        }
        // Everything else, errors included (with the full decoder's exact reason).
        None => match Frame::decode(header, data) {
            Ok(frame) => item(frame, handle),
            Err(e) => Some(Err(e.into())),
        },
    }
}

/// A delivery read in place ([`Subscription::next_batch`]) when it carries only the usual
/// extensions; `None` sends the frame through the full decoder. The topic is kept (as a copy, so
/// that the read buffer is not held) to compare the next delivery's with.
fn borrowed<'a>(
    header: &FrameHeader,
    data: &'a [u8],
    handle: &'a Arc<SubHandle>,
    last_topic: &mut Option<TopicName>,
) -> Option<MessageRef<'a>> {
    if header.opcode != Opcode::Publish {
        return None;
    }
    let d = DeliveryRef::parse_after(header, data, last_topic.as_ref()).ok()?;
    let topic = d.topic.filter(|_| !d.more)?;
    if last_topic
        .as_ref()
        .is_none_or(|last| last.as_bytes() != topic.as_bytes())
    {
        *last_topic = Some(topic.to_name());
    }
    Some(MessageRef(View::Borrowed {
        topic,
        body: data.get(d.body_start..)?,
        offset: d.offset,
        attempt: d.attempt,
        priority: d.priority,
        handle,
    }))
}

/// A message lent by [`Subscription::next_batch`] for the length of one call of its closure:
/// its topic and body point into the subscription's read buffer.
#[derive(Clone, Copy)]
pub struct MessageRef<'a>(View<'a>);

#[derive(Clone, Copy)]
enum View<'a> {
    /// Read in place.
    Borrowed {
        topic: TopicRef<'a>,
        body: &'a [u8],
        offset: Option<u64>,
        attempt: Option<u32>,
        priority: Option<Priority>,
        handle: &'a Arc<SubHandle>,
    },
    /// One that went through the full decoder (rare extensions, the seed's legacy form).
    Owned(&'a Message),
}

impl<'a> MessageRef<'a> {
    /// The concrete topic (also for wildcard subscriptions).
    pub fn topic(&self) -> &'a str {
        match self.0 {
            View::Borrowed { topic, .. } => topic.as_str(),
            View::Owned(m) => m.topic.as_str(),
        }
    }
    pub fn body(&self) -> &'a [u8] {
        match self.0 {
            View::Borrowed { body, .. } => body,
            View::Owned(m) => &m.body,
        }
    }
    /// The message's offset in its topic.
    pub fn offset(&self) -> u64 {
        match self.0 {
            View::Borrowed { offset, .. } => offset.unwrap_or_default(),
            View::Owned(m) => m.offset(),
        }
    }
    pub fn priority(&self) -> Priority {
        match self.0 {
            View::Borrowed { priority, .. } => priority.unwrap_or_default(),
            View::Owned(m) => m.priority(),
        }
    }
    /// 1 for the first delivery, +1 for each redelivery.
    pub fn attempt(&self) -> u32 {
        match self.0 {
            View::Borrowed { attempt, .. } => attempt.unwrap_or(1),
            View::Owned(m) => m.attempt(),
        }
    }
    /// What acknowledging or rejecting this message later takes, without copying its body.
    pub fn settler(&self) -> Settler {
        match self.0 {
            View::Borrowed { handle, topic, .. } => {
                Settler::new(handle, || topic.to_name(), self.offset(), self.attempt())
            }
            View::Owned(m) => m.settler(),
        }
    }

    /// The message as an owned [`Message`] (its body copied), to keep, to acknowledge, or for
    /// what only a [`Message`] tells (trace context, every extension).
    pub fn to_message(&self) -> Message {
        match self.0 {
            View::Borrowed {
                topic,
                body,
                offset,
                attempt,
                priority,
                handle,
            } => Message::plain(
                topic.to_name(),
                Bytes::copy_from_slice(body),
                (offset, attempt, priority),
                handle,
            ),
            View::Owned(m) => m.clone(),
        }
    }
}

impl std::fmt::Debug for MessageRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageRef")
            .field("topic", &self.topic())
            .field("offset", &self.offset())
            .field("attempt", &self.attempt())
            .field("priority", &self.priority())
            .field("body_len", &self.body().len())
            .finish()
    }
}

/// Does this error, received on a delivery stream with a subscription's stream id, close that
/// subscription? SLOW_CONSUMER (§7.3) and NOT_AUTHORIZED (revoked, §11) do.
fn closes_subscription(e: &ClientError) -> bool {
    matches!(
        e.code(),
        Some(ErrorCode::SLOW_CONSUMER | ErrorCode::NOT_AUTHORIZED)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `next_batch` call lends what one read of the stream brought, not what later reads
    /// bring: the bench stamps a call's messages with one clock read, and messages read after
    /// it were stamped as received before they were (some before they were sent).
    #[tokio::test]
    async fn a_batch_lends_what_one_read_brought() {
        use crate::test_broker::{confirm_subscribe, delivery, within, FakeBroker};
        const N: usize = 400;
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let (sub, (mut send, _recv, id)) =
            within(async { tokio::join!(client.subscribe("t"), confirm_subscribe(&conn)) }).await;
        let mut sub = sub.expect("subscribed");
        // ~45 KB of deliveries, all taken by the client's QUIC stack before it reads any.
        for i in 0..N {
            let body = format!("{i:0>100}");
            send.write_all(&delivery(id, body.as_bytes()))
                .await
                .expect("write");
        }
        send.finish().expect("finish");
        let taken = within(send.stopped()).await;
        assert!(matches!(taken, Ok(None)), "taken, not stopped: {taken:?}");
        let mut bodies = Vec::new();
        let first = sub
            .next_batch(1024, |m| bodies.push(m.body().to_vec()))
            .await
            .expect("a batch")
            .expect("not an error");
        assert!(first < N, "one call lent all {first}: more than one read");
        while bodies.len() < N {
            sub.next_batch(1024, |m| bodies.push(m.body().to_vec()))
                .await
                .expect("a batch")
                .expect("not an error");
        }
        let expected: Vec<Vec<u8>> = (0..N).map(|i| format!("{i:0>100}").into_bytes()).collect();
        assert_eq!(bodies, expected);
    }

    /// A delivery stream whose frame boundary is lost (bad magic) ends the subscription, and
    /// the client stops reading the stream (STOP_SENDING with BAD_MAGIC, protocol.md §13): it
    /// only set the subscription ended, so the broker went on filling the stream's window.
    #[tokio::test]
    async fn a_lost_frame_boundary_stops_the_stream() {
        use crate::test_broker::{confirm_subscribe, delivery, within, FakeBroker};
        use futures_util::StreamExt;
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let (sub, (mut send, _recv, id)) =
            within(async { tokio::join!(client.subscribe("t"), confirm_subscribe(&conn)) }).await;
        let mut sub = sub.expect("subscribed");
        send.write_all(&delivery(id, b"first"))
            .await
            .expect("write");
        let mut bad = delivery(id, b"second").to_vec();
        bad[0] = 0x20;
        send.write_all(&bad).await.expect("write");
        let first = within(sub.next()).await.expect("a message").expect("ok");
        assert_eq!(first.body(), &b"first"[..]);
        let lost = within(sub.next()).await.expect("the error");
        assert!(matches!(lost, Err(ClientError::Protocol(_))), "{lost:?}");
        let stopped = within(send.stopped()).await;
        assert_eq!(
            stopped.expect("stopped, not closed"),
            Some(quinn::VarInt::from(aqueduct_proto::ErrorCode::BAD_MAGIC.0))
        );
        assert!(within(sub.next()).await.is_none(), "ended");
    }

    /// Subscriptions on one stream, for a stream window that holds few of their UNSUBSCRIBEs.
    const MANY: usize = 100;

    /// [`MANY`] subscriptions on one stream to `fake` (started with a 512-byte stream window:
    /// ~4 KB of UNSUBSCRIBEs against it), confirmed, as [`confirmed_on_one_stream`] returns
    /// them.
    async fn many_on_a_small_window(
        fake: &crate::test_broker::FakeBroker,
    ) -> (
        (crate::Client, quinn::Connection),
        Subscription,
        (quinn::SendStream, quinn::RecvStream, Vec<u32>),
    ) {
        let filters: Vec<String> = (0..MANY)
            .map(|i| format!("a/long/enough/filter/{i:04}"))
            .collect();
        let filters: Vec<&str> = filters.iter().map(String::as_str).collect();
        confirmed_on_one_stream(fake, &filters).await
    }

    /// A subscription to each of `filters` on one stream to `fake`, each confirmed. Returns the
    /// client and the broker's side of its connection (the test holds both: the connection ends
    /// with the last), the subscription, and the broker's side of the stream with their ids.
    async fn confirmed_on_one_stream(
        fake: &crate::test_broker::FakeBroker,
        filters: &[&str],
    ) -> (
        (crate::Client, quinn::Connection),
        Subscription,
        (quinn::SendStream, quinn::RecvStream, Vec<u32>),
    ) {
        use crate::test_broker::{confirm, read_frame, within};
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the stream");
            let mut ids = Vec::new();
            for _ in filters {
                let (id, _) = read_frame(&mut recv).await;
                send.write_all(&confirm(id, vec![])).await.expect("write");
                ids.push(id);
            }
            (send, recv, ids)
        };
        let opts = crate::SubscribeOptions::default();
        let (sub, stream) =
            within(async { tokio::join!(client.subscribe_many(filters, &opts), broker) }).await;
        ((client, conn), sub.expect("subscribed"), stream)
    }

    /// A delivery that does not decode does not cut `close` short: it still unsubscribes
    /// everything, finishes the stream and waits for the broker's end, then reports the bad
    /// frame. It returned at the bad frame, dropping the UNSUBSCRIBEs flow control still held,
    /// and the stream was never finished (the drop took the subscription for unsubscribed).
    #[tokio::test]
    async fn close_goes_on_past_a_delivery_that_does_not_decode() {
        let fake = crate::test_broker::FakeBroker::start_with_stream_window(512);
        let (_connection, sub, (mut send, mut recv, ids)) = many_on_a_small_window(&fake).await;
        // A PUBLISH whose data is too short for its topic: a whole frame that does not decode.
        let mut bad = vec![0x1F, 0x01];
        bad.extend_from_slice(&ids[0].to_le_bytes());
        bad.extend_from_slice(&2u32.to_le_bytes());
        bad.extend_from_slice(&[0xFF, 0xFF]);
        send.write_all(&bad).await.expect("write");
        let broker = async move {
            let mut unsubscribed = 0;
            let mut header = [0u8; aqueduct_proto::HEADER_LEN];
            while recv.read_exact(&mut header).await.is_ok() {
                let len = u32::from_le_bytes(header[6..10].try_into().expect("4 bytes"));
                let mut data = vec![0u8; len as usize];
                recv.read_exact(&mut data).await.expect("data");
                unsubscribed += 1;
            }
            send.finish().expect("finish");
            unsubscribed
        };
        let (closed, unsubscribed) = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::join!(sub.close(), broker)
        })
        .await
        .expect("the stream was finished");
        assert_eq!(unsubscribed, MANY);
        assert!(
            matches!(closed, Err(ClientError::Protocol(_))),
            "{closed:?}"
        );
    }

    /// A `close` cut short (its future dropped while flow control held the UNSUBSCRIBEs)
    /// leaves the drop to unsubscribe and finish the stream. It took the subscription for
    /// unsubscribed from its start: the stream ended inside a half-written UNSUBSCRIBE, or
    /// (a message or settler still holding it) was never finished, and the broker kept the
    /// subscriptions it had not unsubscribed.
    #[tokio::test]
    async fn a_close_cut_short_still_finishes_the_stream() {
        let fake = crate::test_broker::FakeBroker::start_with_stream_window(512);
        let (_connection, sub, (_send, mut recv, _)) = many_on_a_small_window(&fake).await;
        // Polled once (it writes what the window takes), then dropped.
        let cut = tokio::time::timeout(Duration::ZERO, sub.close()).await;
        assert!(cut.is_err(), "not done in one poll");
        let finished = tokio::time::timeout(Duration::from_secs(20), async {
            let mut frames = 0;
            let mut header = [0u8; aqueduct_proto::HEADER_LEN];
            while recv.read_exact(&mut header).await.is_ok() {
                let len = u32::from_le_bytes(header[6..10].try_into().expect("4 bytes"));
                let mut data = vec![0u8; len as usize];
                recv.read_exact(&mut data)
                    .await
                    .expect("whole frames until the FIN");
                frames += 1;
            }
            frames
        })
        .await;
        // One UNSUBSCRIBE each: those `close` wrote are not sent again.
        assert_eq!(finished, Ok(MANY), "the stream was never finished");
    }

    /// A dropped subscription whose UNSUBSCRIBEs the broker never takes (it stopped reading
    /// the stream) resets the stream after the same 10 s `close` waits. Its task waited for
    /// flow control for good, holding the stream and the connection.
    #[tokio::test]
    async fn a_dropped_subscriptions_unsubscribe_keeps_to_a_deadline() {
        let fake = crate::test_broker::FakeBroker::start_with_stream_window(512);
        let (_connection, sub, (_send, mut recv, _)) = many_on_a_small_window(&fake).await;
        drop(sub);
        // Waits for a reset without reading (reading would let the UNSUBSCRIBEs through).
        let reset = tokio::time::timeout(Duration::from_secs(30), recv.received_reset())
            .await
            .expect("reset within the deadline");
        assert_eq!(
            reset.expect("the stream, not the connection"),
            Some(0u32.into())
        );
    }

    /// A CONFIRM is a SUBSCRIBE's confirmation whatever its data (protocol.md §7.1), also one
    /// with an extension block this client cannot read: the SUBSCRIBE failed.
    #[tokio::test]
    async fn any_confirm_confirms_a_subscribe() {
        use crate::test_broker::{read_frame, within, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the stream");
            let (id, _) = read_frame(&mut recv).await;
            // CONFIRM with an extension block: an ATTEMPT of 12 bytes (it has 4).
            let mut f = vec![0x1F, 0x07 | 0x40];
            f.extend_from_slice(&id.to_le_bytes());
            f.extend_from_slice(&16u32.to_le_bytes());
            f.extend_from_slice(&14u16.to_le_bytes());
            f.extend_from_slice(&[0x07, 12]);
            f.extend_from_slice(&[0; 12]);
            send.write_all(&f).await.expect("write");
            (send, recv)
        };
        let (sub, _stream) = within(async { tokio::join!(client.subscribe("t"), broker) }).await;
        sub.expect("subscribed");
    }

    /// A subscription the broker closed (here as a slow consumer) ends its sending side once the
    /// application has seen the end, although the application still holds it (protocol.md
    /// §13): the broker kept its subscriptions registered, detached, until the drop.
    #[tokio::test]
    async fn a_subscription_the_broker_closed_ends_its_side() {
        use crate::test_broker::{confirm_subscribe, within, FakeBroker};
        use aqueduct_proto::frame::{ErrorFrame, Message};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let (sub, (mut send, mut recv, id)) =
            within(async { tokio::join!(client.subscribe("t"), confirm_subscribe(&conn)) }).await;
        let mut sub = sub.expect("subscribed");
        let slow = ErrorFrame {
            code: ErrorCode::SLOW_CONSUMER,
            reason: "slow".into(),
        };
        send.write_all(&aqueduct_proto::Frame::new(id, Message::Error(slow)).to_bytes())
            .await
            .expect("write");
        let closed = within(sub.next_message()).await.expect("the ERROR");
        assert_eq!(
            closed.err().and_then(|e| e.code()),
            Some(ErrorCode::SLOW_CONSUMER)
        );
        assert!(within(sub.next_message()).await.is_none(), "ended");
        let rest = within(recv.read_to_end(1 << 20)).await;
        assert_eq!(rest.expect("finished, not reset"), Vec::<u8>::new());
        drop(sub);
    }

    /// An ERROR that closes a subscription ends the stream only with the id of one of its
    /// subscriptions: one with another id (no broker sends it) ended a `subscribe_many`
    /// stream whose subscriptions were all live.
    #[tokio::test]
    async fn an_error_for_another_id_does_not_end_the_stream() {
        use crate::test_broker::{delivery, within, FakeBroker};
        use aqueduct_proto::frame::{ErrorFrame, Message};
        let fake = FakeBroker::start();
        let (_connection, mut sub, (mut send, _recv, ids)) =
            confirmed_on_one_stream(&fake, &["a", "b"]).await;
        for stray in [ids[1].wrapping_add(1000), ids[1].wrapping_add(1001)] {
            let slow = ErrorFrame {
                code: ErrorCode::SLOW_CONSUMER,
                reason: "slow".into(),
            };
            send.write_all(&aqueduct_proto::Frame::new(stray, Message::Error(slow)).to_bytes())
                .await
                .expect("write");
        }
        send.write_all(&delivery(ids[1], b"live"))
            .await
            .expect("write");
        for _ in 0..2 {
            let e = within(sub.next_message()).await.expect("an item");
            assert_eq!(
                e.err().and_then(|e| e.code()),
                Some(ErrorCode::SLOW_CONSUMER)
            );
        }
        let live = within(sub.next_message()).await.expect("not ended");
        assert_eq!(live.expect("a message").body(), &b"live"[..]);
    }

    /// `close` keeps to its 10 s deadline when the broker stops reading the stream: writing the
    /// UNSUBSCRIBEs, which flow control then holds, was outside it, and `close` hung.
    #[tokio::test]
    async fn close_keeps_to_its_deadline_when_the_broker_stops_reading() {
        let fake = crate::test_broker::FakeBroker::start_with_stream_window(512);
        // The broker reads nothing more.
        let (_connection, sub, _stream) = many_on_a_small_window(&fake).await;
        let closed = tokio::time::timeout(Duration::from_secs(30), sub.close())
            .await
            .expect("close kept to its deadline");
        assert!(matches!(closed, Err(ClientError::Timeout(_))), "{closed:?}");
    }

    /// `unsubscribe` keeps to a 10 s deadline when the broker stops reading the stream: it
    /// waited for flow control to take the UNSUBSCRIBEs for ever.
    #[tokio::test]
    async fn unsubscribe_keeps_to_its_deadline_when_the_broker_stops_reading() {
        let fake = crate::test_broker::FakeBroker::start_with_stream_window(512);
        // The broker reads nothing more.
        let (_connection, sub, _stream) = many_on_a_small_window(&fake).await;
        let sent = tokio::time::timeout(Duration::from_secs(30), sub.unsubscribe())
            .await
            .expect("unsubscribe kept to its deadline");
        assert!(matches!(sent, Err(ClientError::Timeout(_))), "{sent:?}");
    }

    /// A subscription's id is held while it lives and free again once it is gone (its handle
    /// dropped), so that a SUBSCRIBE after the ids wrap never takes a live one's.
    #[tokio::test]
    async fn a_subscription_holds_its_id_until_it_is_gone() {
        use crate::test_broker::{confirm_subscribe, within, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let (sub, (_send, _recv, id)) =
            within(async { tokio::join!(client.subscribe("t"), confirm_subscribe(&conn)) }).await;
        let sub = sub.expect("subscribed");
        let ids = client.ids();
        assert!(ids.is_held(id), "held while it lives");
        // Its drop sends the UNSUBSCRIBE from a task, which holds the handle until it is sent.
        drop(sub);
        within(async {
            while ids.is_held(id) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
    }

    /// Closing a stream of several subscriptions, one of which the broker closed already (a
    /// slow consumer), unsubscribes only the others: the UNSUBSCRIBE for the closed one got
    /// NOT_SUBSCRIBED, and `close` returned it as an error although nothing failed.
    #[tokio::test]
    async fn closing_skips_a_subscription_the_broker_closed() {
        use crate::test_broker::{within, FakeBroker};
        use aqueduct_proto::frame::{ErrorFrame, Message};
        let fake = FakeBroker::start();
        let (_connection, mut sub, (mut send, mut recv, ids)) =
            confirmed_on_one_stream(&fake, &["a", "b"]).await;
        let slow = ErrorFrame {
            code: ErrorCode::SLOW_CONSUMER,
            reason: "slow".into(),
        };
        send.write_all(&aqueduct_proto::Frame::new(ids[0], Message::Error(slow)).to_bytes())
            .await
            .expect("write");
        let closed = within(sub.next_message()).await.expect("an item");
        assert_eq!(
            closed.err().and_then(|e| e.code()),
            Some(ErrorCode::SLOW_CONSUMER)
        );
        let broker = async move {
            // What the client unsubscribes (a real broker answers NOT_SUBSCRIBED for the
            // closed one), until its FIN.
            let mut unsubscribed = Vec::new();
            let mut header = [0u8; aqueduct_proto::HEADER_LEN];
            while recv.read_exact(&mut header).await.is_ok() {
                let id = u32::from_le_bytes(header[2..6].try_into().expect("4 bytes"));
                let len = u32::from_le_bytes(header[6..10].try_into().expect("4 bytes"));
                let mut data = vec![0u8; len as usize];
                recv.read_exact(&mut data).await.expect("data");
                unsubscribed.push(id);
                if id == ids[0] {
                    let no = ErrorFrame {
                        code: ErrorCode::NOT_SUBSCRIBED,
                        reason: "not subscribed".into(),
                    };
                    send.write_all(&aqueduct_proto::Frame::new(id, Message::Error(no)).to_bytes())
                        .await
                        .expect("write");
                }
            }
            send.finish().expect("finish");
            (unsubscribed, ids[1])
        };
        let (closed, (unsubscribed, open)) =
            within(async { tokio::join!(sub.close(), broker) }).await;
        assert_eq!(unsubscribed, vec![open], "only the open one");
        closed.expect("closed cleanly");
    }

    /// A later broker's frame (an opcode this client does not know) on a subscription's stream
    /// is skipped (protocol.md §10), whether messages are taken one by one or in batches: the
    /// deliveries after it arrive. Before, the subscription ended at it with an error.
    #[tokio::test]
    async fn a_frame_of_an_unknown_opcode_on_a_subscription_is_skipped() {
        use crate::test_broker::{confirm_subscribe, delivery, unknown_frame, within, FakeBroker};
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let broker = async {
            let (mut send, recv, id) = confirm_subscribe(&conn).await;
            for body in ["one", "two"] {
                send.write_all(&unknown_frame(id)).await.expect("write");
                send.write_all(&delivery(id, body.as_bytes()))
                    .await
                    .expect("write");
            }
            (send, recv)
        };
        let (sub, _streams) = within(async { tokio::join!(client.subscribe("t"), broker) }).await;
        let mut sub = sub.expect("subscribed");
        let first = within(sub.next_message())
            .await
            .expect("a message")
            .expect("not an error");
        assert_eq!(first.body().as_ref(), b"one");
        let mut bodies = Vec::new();
        let n = within(sub.next_batch(8, |m| bodies.push(m.body().to_vec())))
            .await
            .expect("a batch")
            .expect("not an error");
        assert_eq!((n, bodies), (1, vec![b"two".to_vec()]));
    }

    #[test]
    fn a_message_stays_small() {
        // It is moved several times per delivery; the rare extensions live behind a Box.
        let size = std::mem::size_of::<Message>();
        eprintln!("Message: {size} bytes");
        assert!(size <= 128, "{size}");
    }
}
