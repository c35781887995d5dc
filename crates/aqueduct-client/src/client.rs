//! The connection handle: connect, publish (single, batch, confirmed), subscribe.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aqueduct_proto::frame::Message as Wire;
use aqueduct_proto::{
    AckMode, ConsumerId, Durable, Frame, GroupId, OverflowPolicy, Priority, Publish, PublishBatch,
    Subscribe, SubscribeSpec, TopicFilter, TopicName,
};
use bytes::{Bytes, BytesMut};
use tokio::sync::oneshot;
use tracing::warn;

use crate::error::{ClientError, ConnectError};
use crate::options::{host_of, ConnectOptions};
use crate::reader::FrameReader;
use crate::subscription::{SubHandle, Subscription};

type Pending = Arc<Mutex<HashMap<u32, oneshot::Sender<Result<Vec<u64>, ClientError>>>>>;

/// A connection to a broker. Cheap to clone; all clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    endpoint: quinn::Endpoint,
    pub(crate) conn: quinn::Connection,
    next_id: AtomicU32,
    /// The stream publishes go out on, opened on first use. A tokio mutex: writes await.
    publisher: tokio::sync::Mutex<Option<quinn::SendStream>>,
    /// Confirmations awaited, by the `stream_id` of the request.
    pending: Pending,
}

/// How to publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishOptions {
    /// 0 (highest) ..= 3 (lowest); default 2.
    pub priority: Option<Priority>,
    /// Drop the message if not delivered within this time.
    pub ttl: Option<Duration>,
    /// Wait for the broker to assign offsets (returned) or refuse (error).
    pub confirm: bool,
}

/// How to subscribe.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscribeOptions {
    /// Join this consumer group: each message goes to one member.
    pub group: Option<String>,
    /// Durable consumer name and start offset.
    pub durable: Option<(String, u64)>,
    /// Settle each message explicitly with [`crate::Message::ack`] / `nack` (always so in a group).
    pub ack: bool,
    /// This subscription's backpressure policy instead of the broker's default.
    pub overflow: Option<OverflowPolicy>,
}

fn topic(name: &str) -> Result<TopicName, ClientError> {
    TopicName::try_from(name).map_err(|source| ClientError::InvalidName {
        what: "topic name",
        source,
    })
}

fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window((8u32 << 20).into());
    t.receive_window((32u32 << 20).into());
    t.send_window(32 << 20);
    t.initial_mtu(1452);
    t.keep_alive_interval(Some(Duration::from_secs(10)));
    t.max_idle_timeout(quinn::IdleTimeout::try_from(Duration::from_secs(60)).ok());
    t
}

impl Client {
    /// Connect and complete the TLS handshake.
    pub async fn connect(opts: ConnectOptions) -> Result<Client, ConnectError> {
        let host = host_of(&opts.addr).to_string();
        let addr: SocketAddr = opts
            .addr
            .to_socket_addrs()
            .map_err(|e| ConnectError::Resolve {
                addr: opts.addr.clone(),
                reason: e.to_string(),
            })?
            .next()
            .ok_or_else(|| ConnectError::Resolve {
                addr: opts.addr.clone(),
                reason: "no address".into(),
            })?;
        let crypto = crate::tls::client_crypto(&opts.trust, &host, opts.client_cert.as_ref())?;
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| ConnectError::Tls(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(quic));
        config.transport_config(Arc::new(transport()));
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0"
                .parse()
                .map_err(|_| ConnectError::Tls("bind address".into()))?
        } else {
            "0.0.0.0:0"
                .parse()
                .map_err(|_| ConnectError::Tls("bind address".into()))?
        };
        let mut endpoint = quinn::Endpoint::client(bind).map_err(|e| ConnectError::Connect {
            addr: opts.addr.clone(),
            reason: e.to_string(),
        })?;
        endpoint.set_default_client_config(config);
        let server_name = opts.server_name.clone().unwrap_or(host);
        let connecting =
            endpoint
                .connect(addr, &server_name)
                .map_err(|e| ConnectError::Connect {
                    addr: opts.addr.clone(),
                    reason: e.to_string(),
                })?;
        let conn = match tokio::time::timeout(opts.timeout, connecting).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                return Err(ConnectError::Connect {
                    addr: opts.addr.clone(),
                    reason: e.to_string(),
                })
            }
            Err(_) => return Err(ConnectError::Timeout { addr: opts.addr }),
        };
        Ok(Client {
            inner: Arc::new(Inner {
                endpoint,
                conn,
                next_id: AtomicU32::new(1),
                publisher: tokio::sync::Mutex::new(None),
                pending: Arc::default(),
            }),
        })
    }

    /// The broker's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.inner.conn.remote_address()
    }

    pub(crate) fn next_id(&self) -> u32 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
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
        p.ext.ttl_ms = opts
            .ttl
            .map(|t| t.as_millis().min(u128::from(u32::MAX)) as u32);
        p.ext.confirm = opts.confirm;
        let offsets = self.send_publish(Wire::Publish(p), opts.confirm).await?;
        Ok(offsets.and_then(|o| o.first().copied()))
    }

    /// Publish several messages in one PUBLISH_BATCH frame (all or nothing). With `confirm`,
    /// returns one offset per message, in order.
    pub async fn publish_batch<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, Bytes)>,
        opts: &PublishOptions,
    ) -> Result<Option<Vec<u64>>, ClientError> {
        let mut publishes = Vec::new();
        for (t, body) in messages {
            let mut p = Publish::new(topic(t)?, body);
            p.ext.priority = opts.priority;
            p.ext.ttl_ms = opts
                .ttl
                .map(|t| t.as_millis().min(u128::from(u32::MAX)) as u32);
            publishes.push(p);
        }
        let mut batch = PublishBatch::from_publishes(&publishes);
        batch.ext.confirm = opts.confirm;
        self.send_publish(Wire::PublishBatch(batch), opts.confirm)
            .await
    }

    async fn send_publish(
        &self,
        message: Wire,
        confirm: bool,
    ) -> Result<Option<Vec<u64>>, ClientError> {
        let (id, rx) = if confirm {
            let id = self.next_id();
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
        let mut bytes = BytesMut::with_capacity(message.frame_len());
        Frame::new(id, message).encode(&mut bytes);
        {
            let mut publisher = self.inner.publisher.lock().await;
            if publisher.is_none() {
                *publisher = Some(self.open_publisher().await?);
            }
            if let Some(send) = publisher.as_mut() {
                send.write_all(&bytes)
                    .await
                    .map_err(|e| ClientError::Connection(e.to_string()))?;
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

    async fn open_publisher(&self) -> Result<quinn::SendStream, ClientError> {
        let (send, recv) = self
            .inner
            .conn
            .open_bi()
            .await
            .map_err(|e| ClientError::Connection(e.to_string()))?;
        let pending = self.inner.pending.clone();
        tokio::spawn(publisher_replies(FrameReader::new(recv), pending));
        Ok(send)
    }

    /// Subscribe to every message matching `filter`.
    pub async fn subscribe(&self, filter: &str) -> Result<Subscription, ClientError> {
        self.subscribe_with(filter, &SubscribeOptions::default())
            .await
    }

    /// Join consumer group `group` on `filter`.
    pub async fn subscribe_group(
        &self,
        filter: &str,
        group: &str,
    ) -> Result<Subscription, ClientError> {
        let opts = SubscribeOptions {
            group: Some(group.to_string()),
            ack: true,
            ..SubscribeOptions::default()
        };
        self.subscribe_with(filter, &opts).await
    }

    /// Subscribe with options. Returns once the broker confirms the subscription is active.
    pub async fn subscribe_with(
        &self,
        filter: &str,
        opts: &SubscribeOptions,
    ) -> Result<Subscription, ClientError> {
        let filter = TopicFilter::try_from(filter).map_err(|source| ClientError::InvalidName {
            what: "topic filter",
            source,
        })?;
        let group = opts
            .group
            .as_deref()
            .map(GroupId::try_from)
            .transpose()
            .map_err(|source| ClientError::InvalidName {
                what: "group id",
                source,
            })?;
        let durable = match &opts.durable {
            Some((name, offset)) => Some(Durable {
                consumer: ConsumerId::try_from(name.as_str()).map_err(|source| {
                    ClientError::InvalidName {
                        what: "consumer id",
                        source,
                    }
                })?,
                offset: *offset,
            }),
            None => None,
        };
        let mut sub = Subscribe::new(SubscribeSpec {
            filter: filter.clone(),
            group,
            durable,
        });
        sub.ext.confirm = true;
        sub.ext.ack_mode = opts.ack.then_some(AckMode::Explicit);
        sub.ext.overflow = opts.overflow;
        let id = self.next_id();
        let (mut send, recv) = self
            .inner
            .conn
            .open_bi()
            .await
            .map_err(|e| ClientError::Connection(e.to_string()))?;
        send.write_all(&Frame::new(id, Wire::Subscribe(sub)).to_bytes())
            .await
            .map_err(|e| ClientError::Connection(e.to_string()))?;
        let mut reader = FrameReader::new(recv);
        match reader.next().await? {
            Some(Frame {
                message: Wire::Confirm(_),
                ..
            }) => {}
            Some(Frame {
                message: Wire::Error(e),
                ..
            }) => {
                return Err(ClientError::Broker {
                    code: e.code,
                    reason: e.reason,
                })
            }
            Some(other) => {
                return Err(ClientError::Connection(format!(
                    "expected CONFIRM for SUBSCRIBE, got {:?}",
                    other.message.opcode()
                )))
            }
            None => return Err(ClientError::Closed),
        }
        let handle = Arc::new(SubHandle::new(id, filter, send));
        Ok(Subscription::start(handle, reader, self.inner.clone()))
    }

    /// Wait until the broker has read everything published so far (up to 10 s). The next
    /// publish opens a new publish stream.
    pub async fn flush(&self) -> Result<(), ClientError> {
        let Some(mut send) = self.inner.publisher.lock().await.take() else {
            return Ok(());
        };
        send.finish()
            .map_err(|e| ClientError::Connection(e.to_string()))?;
        match tokio::time::timeout(Duration::from_secs(10), send.stopped()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(ClientError::Connection(e.to_string())),
            Err(_) => Err(ClientError::Connection(
                "the broker did not read the publish stream within 10 s".into(),
            )),
        }
    }

    /// Flush, close the connection, and wait for the broker to acknowledge the close.
    pub async fn close(&self) {
        let _ = self.flush().await;
        self.inner.conn.close(0u32.into(), b"client closed");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.inner.endpoint.wait_idle()).await;
    }
}

/// Route CONFIRM and ERROR replies on the publish stream to the waiting publishers.
async fn publisher_replies(mut reader: FrameReader, pending: Pending) {
    let take = |id: u32| {
        pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
    };
    loop {
        let frame = match reader.next().await {
            Ok(Some(frame)) => frame,
            Ok(None) | Err(_) => break,
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
    }
    // The stream is gone: fail whoever still waits.
    let waiting: Vec<_> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .collect();
    for (_, tx) in waiting {
        let _ = tx.send(Err(ClientError::Connection("publish stream closed".into())));
    }
}
