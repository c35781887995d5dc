//! A subscription as a `futures::Stream` of messages, and settling them.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use aqueduct_proto::frame::Message as Wire;
use aqueduct_proto::{
    Ack, ErrorCode, Extensions, Frame, Nack, Priority, TopicFilter, TopicName, Unsubscribe,
};
use bytes::Bytes;
use futures_core::Stream;
use tokio::sync::mpsc;

use crate::client::Inner;
use crate::error::ClientError;
use crate::reader::FrameReader;

/// Batches buffered between the network and the application before the client stops reading
/// (the broker's backpressure policy then applies).
const BUFFER: usize = 16;
/// Most messages in one batch.
const MAX_BATCH: usize = 1024;

type Batch = Vec<Result<Message, ClientError>>;

/// The subscription's identity and its stream's sending half (for ACK, NACK, UNSUBSCRIBE).
#[derive(Debug)]
pub(crate) struct SubHandle {
    id: u32,
    filter: TopicFilter,
    send: tokio::sync::Mutex<quinn::SendStream>,
}

impl SubHandle {
    pub(crate) fn new(id: u32, filter: TopicFilter, send: quinn::SendStream) -> Self {
        SubHandle {
            id,
            filter,
            send: tokio::sync::Mutex::new(send),
        }
    }

    async fn send(&self, message: Wire) -> Result<(), ClientError> {
        let bytes = Frame::new(self.id, message).to_bytes();
        self.send
            .lock()
            .await
            .write_all(&bytes)
            .await
            .map_err(|e| ClientError::Connection(e.to_string()))
    }
}

/// One delivered message.
#[derive(Debug, Clone)]
pub struct Message {
    topic: TopicName,
    body: Bytes,
    offset: u64,
    priority: Priority,
    attempt: u32,
    ext: Extensions,
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
        self.offset
    }
    pub fn priority(&self) -> Priority {
        self.priority
    }
    /// 1 for the first delivery, +1 for each redelivery.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// Every extension the broker sent (trace, compression, dead-letter origin, …).
    pub fn extensions(&self) -> &Extensions {
        &self.ext
    }

    fn settle_ext(&self) -> Extensions {
        Extensions {
            // Offsets are per topic: a wildcard subscription must say which topic.
            topic: self.handle.filter.is_wildcard().then(|| self.topic.clone()),
            attempt: Some(self.attempt),
            ..Extensions::default()
        }
    }

    /// Settle this delivery. Refusals (e.g. already redelivered) arrive on the subscription
    /// stream as `Err` items.
    pub async fn ack(&self) -> Result<(), ClientError> {
        let mut ack = Ack::new(self.offset);
        ack.ext = self.settle_ext();
        self.handle.send(Wire::Ack(ack)).await
    }

    /// Reject this delivery: the broker redelivers it, or dead-letters it after its retries.
    pub async fn nack(&self, reason: Option<&str>) -> Result<(), ClientError> {
        let mut nack = Nack::new(self.offset);
        nack.ext = self.settle_ext();
        nack.ext.reason = reason.map(str::to_owned);
        self.handle.send(Wire::Nack(nack)).await
    }
}

/// A live subscription. Dropping it unsubscribes.
#[derive(Debug)]
pub struct Subscription {
    rx: mpsc::Receiver<Batch>,
    /// Received from the reader task, not yet handed out.
    ready: VecDeque<Result<Message, ClientError>>,
    handle: Arc<SubHandle>,
    unsubscribed: bool,
}

impl Subscription {
    pub(crate) fn start(
        handle: Arc<SubHandle>,
        reader: FrameReader,
        _client: Arc<Inner>,
    ) -> Subscription {
        let (tx, rx) = mpsc::channel(BUFFER);
        tokio::spawn(forward(reader, handle.clone(), tx));
        Subscription {
            rx,
            ready: VecDeque::new(),
            handle,
            unsubscribed: false,
        }
    }

    /// The filter subscribed to.
    pub fn filter(&self) -> &TopicFilter {
        &self.handle.filter
    }

    /// The next message (`None` once the subscription has ended).
    pub async fn next_message(&mut self) -> Option<Result<Message, ClientError>> {
        std::future::poll_fn(|cx| self.poll_item(cx)).await
    }

    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message, ClientError>>> {
        loop {
            if let Some(item) = self.ready.pop_front() {
                return Poll::Ready(Some(item));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(batch)) => self.ready.extend(batch),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Unsubscribe and wait until the request is sent.
    pub async fn unsubscribe(mut self) -> Result<(), ClientError> {
        self.unsubscribed = true;
        unsubscribe(&self.handle).await
    }
}

async fn unsubscribe(handle: &SubHandle) -> Result<(), ClientError> {
    let u = Unsubscribe {
        filter: handle.filter.clone(),
        ext: Extensions::default(),
    };
    handle.send(Wire::Unsubscribe(u)).await?;
    let _ = handle.send.lock().await.finish();
    Ok(())
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.unsubscribed {
            return;
        }
        let handle = self.handle.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = unsubscribe(&handle).await;
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

/// What one frame means to the application; `None` for frames it does not see.
fn item(frame: Frame, handle: &Arc<SubHandle>) -> Option<Result<Message, ClientError>> {
    match frame.message {
        Wire::Publish(p) => Some(Ok(Message {
            topic: p.topic().clone(),
            offset: p.ext.offset.unwrap_or_default(),
            priority: p.priority(),
            attempt: p.ext.attempt.unwrap_or(1),
            body: p.body.clone(),
            ext: p.ext,
            handle: handle.clone(),
        })),
        Wire::Error(e) => Some(Err(ClientError::Broker {
            code: e.code,
            reason: e.reason,
        })),
        _ => None,
    }
}

/// Turn frames from the subscription stream into messages and errors, handing them to the
/// application in batches (everything decoded from one read) to keep channel traffic low.
async fn forward(mut reader: FrameReader, handle: Arc<SubHandle>, tx: mpsc::Sender<Batch>) {
    loop {
        let mut batch = Vec::new();
        let mut end = false;
        let first = reader.next().await;
        let push = |frame: Result<Option<Frame>, ClientError>, batch: &mut Batch| match frame {
            Ok(Some(frame)) => {
                if let Some(it) = item(frame, &handle) {
                    // The broker closes a slow consumer's subscription after this error.
                    let fatal = matches!(&it, Err(e) if e.code() == Some(ErrorCode::SLOW_CONSUMER));
                    batch.push(it);
                    fatal
                } else {
                    false
                }
            }
            Ok(None) => true,
            Err(e) => {
                batch.push(Err(e));
                true
            }
        };
        end |= push(first, &mut batch);
        while !end && batch.len() < MAX_BATCH {
            match reader.try_next() {
                Ok(None) => break,
                other => end |= push(other, &mut batch),
            }
        }
        if (!batch.is_empty() && tx.send(batch).await.is_err()) || end {
            return;
        }
    }
}
