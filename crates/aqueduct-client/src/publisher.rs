//! A publish stream: publishes, batches and confirmations on one QUIC stream, in order.
//!
//! Every [`crate::Client`] has a default one (used by `Client::publish*`); `Client::publisher()`
//! opens another, so independent publishers on one connection do not queue behind each other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aqueduct_proto::frame::Message as Wire;
use aqueduct_proto::{BatchBuilder, Extensions, Frame, Publish, TopicName};
use bytes::Bytes;
use tokio::sync::oneshot;
use tracing::warn;

use crate::client::PublishOptions;
use crate::error::ClientError;
use crate::reader::FrameReader;

type Pending = Arc<Mutex<HashMap<u32, oneshot::Sender<Result<Vec<u64>, ClientError>>>>>;

/// A publish stream. Cheap to clone; clones share the stream.
///
/// # Cancel safety
///
/// A publish whose future is dropped (a `select!`, a timeout) before it was first polled past
/// waiting for the stream sends nothing. Once its frame is queued on the stream it is sent
/// whole, even if the future is dropped while the broker's flow control holds it back: the
/// next publish or `flush` on the stream writes the rest first. A stream never carries part of
/// a frame followed by another.
#[derive(Debug, Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Arc<crate::link::Link>,
    /// Request ids (`stream_id` of confirmed frames), unique per connection.
    next_id: Arc<AtomicU32>,
    /// Opened on first use. A tokio mutex: writes await.
    send: tokio::sync::Mutex<Option<Stream>>,
    /// Confirmations awaited, by request id.
    pending: Pending,
}

/// An open publish stream: its sending half, and word from the task reading its replies that
/// the broker finished the stream (`true`) — which it does only after handling every frame on
/// it — or that it failed (`false`).
#[derive(Debug)]
struct Stream {
    send: crate::link::FrameSink,
    done: oneshot::Receiver<Result<(), ClientError>>,
}

/// The most a batch's buffer makes room for before its messages are written.
const MAX_BATCH_RESERVE: usize = 1 << 20;

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

fn ttl_ms(opts: &PublishOptions) -> Option<u32> {
    opts.ttl
        .map(|t| t.as_millis().min(u128::from(u32::MAX)) as u32)
}

impl Publisher {
    pub(crate) fn new(conn: Arc<crate::link::Link>, next_id: Arc<AtomicU32>) -> Publisher {
        Publisher {
            inner: Arc::new(Inner {
                conn,
                next_id,
                send: tokio::sync::Mutex::new(None),
                pending: Arc::default(),
            }),
        }
    }

    /// Publish `body` to `topic` (priority 2, no TTL, no confirmation).
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
        Ok(offsets.and_then(|o| o.first().copied()))
    }

    /// Publish several messages in one PUBLISH_BATCH frame (all or nothing). With `confirm`,
    /// returns one offset per message, in order.
    pub async fn publish_batch<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, Bytes)>,
        opts: &PublishOptions,
    ) -> Result<Option<Vec<u64>>, ClientError> {
        let batch = build_batch(messages.into_iter(), opts)?;
        self.send(Wire::PublishBatch(batch), opts.confirm).await
    }

    async fn send(&self, message: Wire, confirm: bool) -> Result<Option<Vec<u64>>, ClientError> {
        let (id, rx) = if confirm {
            let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            self.inner
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, tx);
            (id, Some(rx))
        } else {
            (0, None)
        };
        // Until the frame is queued on the stream, a cancelled or failed call takes its
        // confirmation slot back (nothing would ever answer it).
        let mut slot = Slot {
            pending: &self.inner.pending,
            id: confirm.then_some(id),
        };
        // A batch's payload is sent as it was built, after its head: not copied again.
        let (head, tail) = Frame::new(id, message).encode_split();
        {
            let mut send = self.inner.send.lock().await;
            if send.is_none() {
                *send = Some(self.open().await?);
            }
            if let Some(Stream { send, .. }) = send.as_mut() {
                // Queued whole: from here on the frame is sent even if this call is cancelled
                // (the next write on the stream finishes it), and its confirmation may come.
                send.queue([head].into_iter().chain(tail));
                slot.id = None;
                send.write_queued().await?;
            }
        }
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
        tokio::spawn(replies(
            FrameReader::new(recv),
            self.inner.pending.clone(),
            tx,
        ));
        Ok(Stream {
            send: crate::link::FrameSink::new(send),
            done,
        })
    }

    /// Wait until the broker has handled everything published on this stream so far (up to
    /// 10 s). The next publish opens a new stream.
    ///
    /// QUIC's own acknowledgement of the data is not enough: it says the broker *received* it,
    /// and a connection closed right after could still lose what the broker had not read yet.
    /// So the stream is finished and the broker's end of it awaited: the broker finishes its
    /// side only after handling every frame.
    pub async fn flush(&self) -> Result<(), ClientError> {
        let Some(Stream { mut send, done }) = self.inner.send.lock().await.take() else {
            return Ok(());
        };
        send.finish().await?;
        match tokio::time::timeout(Duration::from_secs(10), done).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(ClientError::Connection(format!(
                "the broker may not have read everything published: {}",
                match e {
                    ClientError::Connection(why) => why,
                    other => other.to_string(),
                }
            ))),
            Ok(Err(_)) => Err(ClientError::Connection(
                "the publish stream failed before the broker had read all of it".into(),
            )),
            Err(_) => Err(ClientError::Connection(
                "the broker did not read the publish stream within 10 s".into(),
            )),
        }
    }
}

/// A confirmation awaited for a frame not yet queued on the stream: dropped with an `id`, it
/// removes that entry from the pending map.
struct Slot<'a> {
    pending: &'a Pending,
    id: Option<u32>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        }
    }
}

/// Route CONFIRM and ERROR replies on a publish stream to the waiting publishers.
async fn replies(
    mut reader: FrameReader,
    pending: Pending,
    done: oneshot::Sender<Result<(), ClientError>>,
) {
    let take = |id: u32| {
        pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
    };
    let finished = loop {
        let frame = match reader.next().await {
            Ok(Some(frame)) => frame,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        match frame.message {
            Wire::Confirm(c) => {
                if let Some(tx) = take(frame.stream_id) {
                    let _ = tx.send(Ok(c.offsets));
                }
            }
            Wire::Error(e) => match take(frame.stream_id) {
                Some(tx) => {
                    let _ = tx.send(Err(ClientError::Broker {
                        code: e.code,
                        reason: e.reason,
                    }));
                }
                None => warn!(code = %e.code, reason = %e.reason, "broker refused a publish"),
            },
            other => warn!(opcode = ?other.opcode(), "unexpected frame on the publish stream"),
        }
    };
    // The stream is gone: fail whoever still waits, with the reason it ended (e.g. "the broker
    // requires a client certificate"), not a generic one.
    let failure = match &finished {
        Err(e) => e.clone(),
        Ok(()) => ClientError::Connection(
            "the broker finished the publish stream before answering".into(),
        ),
    };
    let _ = done.send(finished);
    let waiting: Vec<_> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .collect();
    for (_, tx) in waiting {
        let _ = tx.send(Err(failure.clone()));
    }
}
