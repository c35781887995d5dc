//! The connection handle: connect, publish (single, batch, confirmed), subscribe.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aqueduct_proto::frame::Message as Wire;
use aqueduct_proto::{
    AckMode, ConsumerId, Durable, DurableStart, Frame, GroupId, OverflowPolicy, Priority,
    Subscribe, SubscribeSpec, TopicFilter,
};
use bytes::Bytes;

use crate::error::{ClientError, ConnectError};
use crate::options::{host_of, ConnectOptions};
use crate::publisher::Publisher;
use crate::reader::FrameReader;
use crate::subscription::{SubHandle, Subscription};

/// A connection to a broker. Cheap to clone; all clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    endpoint: quinn::Endpoint,
    pub(crate) conn: Arc<crate::link::Link>,
    pub(crate) ids: Arc<crate::ids::Ids>,
    /// The default publish stream.
    publisher: Publisher,
    /// The publish streams [`Client::publisher`] made, for [`Client::close`] to flush.
    others: std::sync::Mutex<Vec<crate::publisher::WeakPublisher>>,
}

/// How to publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishOptions {
    /// 0 (highest) ..= 3 (lowest); default 2.
    pub priority: Option<Priority>,
    /// Drop the message if not delivered within this time (whole milliseconds, rounded up; at
    /// most `u32::MAX` ms, about 49.7 days, the longest the protocol carries: a longer TTL is
    /// sent as that).
    pub ttl: Option<Duration>,
    /// Wait for the broker to assign offsets (returned) or refuse (error).
    pub confirm: bool,
    /// Trace context to carry (TRACE extension): the application's current span, or
    /// [`crate::new_trace`] to start a trace. In a batch, every message carries it.
    pub trace: Option<crate::TraceContext>,
}

/// How to subscribe.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscribeOptions {
    /// Join this consumer group: each message goes to one member.
    pub group: Option<String>,
    /// A durable consumer: its name and where to start when the broker has no position stored
    /// for it (a broker with its durable log on stores one; it then resumes from there, whatever
    /// start is given). Served from the log: messages arrive once they are durable.
    pub durable: Option<(String, DurableStart)>,
    /// Settle each message explicitly with [`crate::Message::ack`] / `nack` (always so in a group).
    pub ack: bool,
    /// This subscription's backpressure policy instead of the broker's default.
    pub overflow: Option<OverflowPolicy>,
    /// With `ack` (or in a group): at most this many unacknowledged messages at a time (a
    /// "prefetch"; the broker's `max_in_flight` if lower). 1 hands out one message at a time,
    /// so what is queued behind it stays in strict priority order.
    pub max_in_flight: Option<u32>,
}

/// A QUIC connection's statistics since it was opened ([`Client::quic_stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QuicStats {
    /// The smoothed round-trip time.
    pub rtt: Duration,
    /// The congestion window, bytes.
    pub congestion_window: u64,
    /// UDP datagrams sent.
    pub datagrams_sent: u64,
    /// UDP datagrams received.
    pub datagrams_received: u64,
    /// Bytes of UDP payload received.
    pub bytes_received: u64,
    /// Packets this end declared lost.
    pub packets_lost: u64,
    /// ACK frames sent.
    pub acks_sent: u64,
    /// ACK frames received.
    pub acks_received: u64,
    /// ACK_FREQUENCY frames sent: this end asked the broker for fewer ACKs.
    pub ack_frequency_sent: u64,
    /// ACK_FREQUENCY frames received: the broker asked this end for fewer ACKs.
    pub ack_frequency_received: u64,
    /// The path MTU now: the largest UDP payload this client sends, bytes (1452: it does not
    /// probe for more; the broker's datagrams to it grow up to [`ConnectOptions::max_mtu`]).
    pub path_mtu: u16,
    /// Times MTU discovery took large packets' loss for a path that no longer carries them.
    pub black_holes: u64,
}

fn transport(opts: &ConnectOptions) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // Each stream's window bounds what the broker may send it unread. The connection's own
    // window is left unbounded (quinn's default): a bounded one is shared by every stream, so a
    // few subscriptions the application stops reading (4 of them, at 32 MiB) stopped all the
    // others, and the publish stream's CONFIRMs too.
    t.stream_receive_window((8u32 << 20).into());
    t.receive_window(quinn::VarInt::MAX);
    t.send_window(32 << 20);
    // This client's own datagrams stay at 1452 (no discovery): with it on, a close sent while
    // a probe was outstanding sometimes never reached the broker (the CLI's closes in
    // tests/cli.rs, about one run in three; not understood yet). Its endpoint still accepts
    // `max_mtu`, so the broker's datagrams to it grow (the bulk of a subscriber's traffic).
    aqueduct_udp::path_mtu(&mut t, 1452, 1452);
    t.keep_alive_interval(Some(Duration::from_secs(10)));
    t.max_idle_timeout(quinn::IdleTimeout::try_from(Duration::from_secs(60)).ok());
    // Fewer ACKs from the broker for what this client publishes.
    t.ack_frequency_config(aqueduct_udp::ack_frequency(
        opts.ack_eliciting_threshold,
        opts.ack_delay,
    ));
    t
}

/// How long a connect waits for one address's handshake before it tries the next as well.
const HAPPY_EYEBALLS_DELAY: Duration = Duration::from_millis(250);

/// Every address in `addrs`, in order, the next one started [`HAPPY_EYEBALLS_DELAY`] after the
/// one before or as soon as it fails (as Happy Eyeballs does: `localhost` may give ::1 before
/// 127.0.0.1, and a broker may listen on one of them only; a handshake to an address where
/// nothing listens does not fail over UDP, it only times out). The first handshake to complete
/// wins; the others are dropped (closed). If none does within the connect timeout, the first
/// failure says why, even when a silent address ran into the timeout.
async fn dial_first(
    addrs: &[SocketAddr],
    config: &quinn::ClientConfig,
    server_name: &str,
    opts: &ConnectOptions,
) -> Result<(quinn::Endpoint, quinn::Connection), ConnectError> {
    use futures_util::StreamExt;
    let mut first_failure: Option<ConnectError> = None;
    let race = async {
        let mut dials = futures_util::stream::FuturesUnordered::new();
        let mut next = addrs.iter();
        let mut stagger = std::pin::pin!(tokio::time::sleep(Duration::ZERO));
        loop {
            tokio::select! {
                biased;
                Some(result) = dials.next(), if !dials.is_empty() => match result {
                    Ok(dialed) => return Some(dialed),
                    Err(e) => {
                        first_failure.get_or_insert(e);
                        stagger.as_mut().reset(tokio::time::Instant::now());
                    }
                },
                _ = &mut stagger, if next.len() > 0 => {
                    if let Some(&addr) = next.next() {
                        dials.push(dial(addr, config, server_name, opts));
                    }
                    stagger
                        .as_mut()
                        .reset(tokio::time::Instant::now() + HAPPY_EYEBALLS_DELAY);
                }
                else => return None,
            }
        }
    };
    let dialed = tokio::time::timeout(opts.timeout, race).await;
    match (dialed, first_failure) {
        (Ok(Some(dialed)), _) => Ok(dialed),
        (_, Some(e)) => Err(e),
        (_, None) => Err(ConnectError::Timeout {
            addr: opts.addr.clone(),
        }),
    }
}

/// One QUIC handshake to `addr`, from an endpoint of its own.
async fn dial(
    addr: SocketAddr,
    config: &quinn::ClientConfig,
    server_name: &str,
    opts: &ConnectOptions,
) -> Result<(quinn::Endpoint, quinn::Connection), ConnectError> {
    let failed = |reason: String| ConnectError::Connect {
        addr: opts.addr.clone(),
        reason,
    };
    let bind = SocketAddr::new(
        if addr.is_ipv6() {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        },
        0,
    );
    // The socket is registered for reading only (aqueduct-udp): a send does not wake the
    // runtime's other thread.
    let mut endpoint = std::net::UdpSocket::bind(bind)
        .and_then(|socket| {
            quinn::Endpoint::new(
                aqueduct_udp::endpoint_config(opts.max_mtu),
                None,
                socket,
                aqueduct_udp::runtime(),
            )
        })
        .map_err(|e| failed(e.to_string()))?;
    endpoint.set_default_client_config(config.clone());
    let connecting = endpoint
        .connect(addr, server_name)
        .map_err(|e| failed(e.to_string()))?;
    match connecting.await {
        Ok(conn) => Ok((endpoint, conn)),
        Err(e) => {
            let mut reason = crate::error::describe_connection_error(&e);
            if crate::error::is_local_tls_failure(&e) {
                // Our side refused the broker's certificate: say what was trusted, so a
                // stale or wrong file is easy to spot.
                reason = format!("{reason} (trusted: {})", opts.trust.describe());
            }
            Err(failed(reason))
        }
    }
}

impl Client {
    /// The connection's request ids (tests).
    #[cfg(test)]
    pub(crate) fn ids(&self) -> &crate::ids::Ids {
        &self.inner.ids
    }

    /// The publisher the `publish*` methods use (tests).
    #[cfg(test)]
    pub(crate) fn default_publisher(&self) -> &Publisher {
        &self.inner.publisher
    }

    /// Connect and complete the TLS handshake. Every address the name resolves to is tried, in
    /// order, the next 250 ms after the one before (or when it fails); the first to complete
    /// its handshake is used.
    pub async fn connect(mut opts: ConnectOptions) -> Result<Client, ConnectError> {
        let started = tokio::time::Instant::now();
        let host = host_of(&opts.addr).to_string();
        let mut addrs: Vec<SocketAddr> = Vec::new();
        // On a blocking thread (the system resolver blocks), within the connect timeout: a DNS
        // server that does not answer held a runtime thread for the resolver's own timeout.
        let resolved = tokio::time::timeout(opts.timeout, tokio::net::lookup_host(&opts.addr))
            .await
            .map_err(|_| ConnectError::Resolve {
                addr: opts.addr.clone(),
                reason: format!("no answer within {:?}", opts.timeout),
            })?
            .map_err(|e| ConnectError::Resolve {
                addr: opts.addr.clone(),
                reason: e.to_string(),
            })?;
        for addr in resolved {
            if !addrs.contains(&addr) {
                addrs.push(addr);
            }
        }
        if addrs.is_empty() {
            return Err(ConnectError::Resolve {
                addr: opts.addr.clone(),
                reason: "no address".into(),
            });
        }
        // The handshake gets what the lookup left of the timeout; opening a stream later, the
        // whole of it.
        let open_wait = opts.timeout;
        opts.timeout = opts.timeout.saturating_sub(started.elapsed());
        Self::connect_to(&addrs, opts, host, open_wait).await
    }

    /// Connect to the first of `addrs` that completes a handshake; `host` names the broker
    /// (its certificate's name, unless `opts.server_name` says otherwise).
    async fn connect_to(
        addrs: &[SocketAddr],
        opts: ConnectOptions,
        host: String,
        open_wait: Duration,
    ) -> Result<Client, ConnectError> {
        // The handshake and a WebTransport session's setup share the timeout: the session was
        // given all of it again once the handshake was done.
        let deadline = tokio::time::Instant::now() + opts.timeout;
        let mut crypto = crate::tls::client_crypto(&opts.trust, &host, opts.client_cert.as_ref())?;
        if let crate::link::Transport::WebTransport { .. } = &opts.transport {
            crypto.alpn_protocols = vec![web_transport_quinn::ALPN.as_bytes().to_vec()];
            crypto.enable_early_data = false;
        }
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| ConnectError::Tls(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(quic));
        config.transport_config(Arc::new(transport(&opts)));
        let server_name = opts.server_name.clone().unwrap_or(host);
        let (endpoint, conn) = dial_first(addrs, &config, &server_name, &opts).await?;
        let conn = match &opts.transport {
            crate::link::Transport::Quic => crate::link::Kind::Quic(conn),
            crate::link::Transport::WebTransport { path } => {
                let path = if path.starts_with('/') {
                    path.clone()
                } else {
                    format!("/{path}")
                };
                let url =
                    url::Url::parse(&format!("https://{}{path}", opts.addr)).map_err(|e| {
                        ConnectError::Connect {
                            addr: opts.addr.clone(),
                            reason: format!("WebTransport URL https://{}{path}: {e}", opts.addr),
                        }
                    })?;
                let mut request = web_transport_quinn::proto::ConnectRequest::new(url);
                request.protocols.push("aqueduct-v1".into());
                let session = tokio::time::timeout_at(
                    deadline,
                    web_transport_quinn::Session::connect(conn, request),
                )
                .await
                .map_err(|_| ConnectError::Timeout {
                    addr: opts.addr.clone(),
                })?
                .map_err(|e| ConnectError::Connect {
                    addr: opts.addr.clone(),
                    reason: format!("the WebTransport session was not accepted: {e}"),
                })?;
                crate::link::Kind::WebTransport(Box::new(session))
            }
        };
        let conn = Arc::new(crate::link::Link::new(conn, open_wait));
        let ids = Arc::new(crate::ids::Ids::default());
        Ok(Client {
            inner: Arc::new(Inner {
                endpoint,
                publisher: Publisher::new(conn.clone(), ids.clone()),
                conn,
                ids,
                others: std::sync::Mutex::default(),
            }),
        })
    }

    /// The broker's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.inner.conn.remote_address()
    }

    /// The QUIC connection's statistics since it was opened, for diagnostics.
    pub fn quic_stats(&self) -> QuicStats {
        let s = self.inner.conn.quic().stats();
        QuicStats {
            rtt: s.path.rtt,
            congestion_window: s.path.cwnd,
            datagrams_sent: s.udp_tx.datagrams,
            datagrams_received: s.udp_rx.datagrams,
            bytes_received: s.udp_rx.bytes,
            packets_lost: s.path.lost_packets,
            acks_sent: s.frame_tx.acks,
            acks_received: s.frame_rx.acks,
            ack_frequency_sent: s.frame_tx.ack_frequency,
            ack_frequency_received: s.frame_rx.ack_frequency,
            path_mtu: s.path.current_mtu,
            black_holes: s.path.black_holes_detected,
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
        self.inner.publisher.publish(topic_name, body).await
    }

    /// Publish with options; with `confirm`, returns the offset the broker assigned.
    pub async fn publish_with(
        &self,
        topic_name: &str,
        body: impl Into<Bytes>,
        opts: &PublishOptions,
    ) -> Result<Option<u64>, ClientError> {
        self.inner
            .publisher
            .publish_with(topic_name, body, opts)
            .await
    }

    /// Publish several messages in one PUBLISH_BATCH frame (all or nothing). With `confirm`,
    /// returns one offset per message, in order.
    pub async fn publish_batch<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, Bytes)>,
        opts: &PublishOptions,
    ) -> Result<Option<Vec<u64>>, ClientError> {
        self.inner.publisher.publish_batch(messages, opts).await
    }

    /// A new publish stream on this connection (the `publish*` methods use a default one).
    /// [`close`](Self::close) flushes it too, while it lives: one dropped before, without its
    /// own [`flush`](Publisher::flush), takes the broker's later answers with it (a refusal of
    /// a publish sent without confirm is then never reported).
    pub fn publisher(&self) -> Publisher {
        let publisher = Publisher::new(self.inner.conn.clone(), self.inner.ids.clone());
        let mut others = self.inner.others.lock().unwrap_or_else(|e| e.into_inner());
        others.retain(|p| p.upgrade().is_some());
        others.push(publisher.downgrade());
        publisher
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
        self.subscribe_many(&[filter], opts).await
    }

    /// Subscribe to several filters on one QUIC stream: one [`Subscription`] yields the messages
    /// of all of them (each [`crate::Message`] settles with its own subscription). Cheaper for
    /// the broker than a stream per filter when a client holds very many subscriptions. Returns
    /// once the broker has confirmed every one; if it refuses one, the error is returned and
    /// none stays subscribed. With [`SubscribeOptions::durable`], every filter's SUBSCRIBE names
    /// the same consumer, which a broker with its durable log on refuses for all but one
    /// (protocol.md §7.1): give a durable consumer one filter (a wildcard covers several).
    pub async fn subscribe_many(
        &self,
        filters: &[&str],
        opts: &SubscribeOptions,
    ) -> Result<Subscription, ClientError> {
        let spec = |filter: &str| -> Result<Subscribe, ClientError> {
            let filter =
                TopicFilter::try_from(filter).map_err(ClientError::invalid("topic filter"))?;
            let group = opts
                .group
                .as_deref()
                .map(GroupId::try_from)
                .transpose()
                .map_err(ClientError::invalid("group id"))?;
            let durable = match &opts.durable {
                Some((name, start)) => Some(Durable {
                    consumer: ConsumerId::try_from(name.as_str())
                        .map_err(ClientError::invalid("consumer id"))?,
                    start: *start,
                }),
                None => None,
            };
            let mut sub = Subscribe::new(SubscribeSpec {
                filter,
                group,
                durable,
            });
            sub.ext.confirm = true;
            sub.ext.ack_mode = opts.ack.then_some(AckMode::Explicit);
            sub.ext.overflow = opts.overflow;
            sub.ext.max_in_flight = opts.max_in_flight;
            Ok(sub)
        };
        let subs = filters
            .iter()
            .map(|f| spec(f))
            .collect::<Result<Vec<_>, _>>()?;
        if subs.is_empty() {
            return Err(ClientError::invalid("topic filter")(
                aqueduct_proto::TopicError::Empty,
            ));
        }
        // Consecutive ids: a delivery's stream id then tells its subscription by subtraction.
        let held = self.inner.ids.subscriptions(subs.len() as u32);
        let first = held.first();
        let (send, recv) = self.inner.conn.open_bi().await?;
        let mut send = crate::link::FrameSink::new(send);
        let mut bytes = bytes::BytesMut::new();
        let mut specs = Vec::with_capacity(subs.len());
        for (i, sub) in subs.into_iter().enumerate() {
            specs.push(sub.spec.filter.clone());
            Frame::new(first.wrapping_add(i as u32), Wire::Subscribe(sub)).encode(&mut bytes);
        }
        send.send([bytes.freeze()]).await?;
        let send = Arc::new(tokio::sync::Mutex::new(send));
        let handles: Vec<Arc<SubHandle>> = specs
            .into_iter()
            .enumerate()
            .map(|(i, filter)| {
                Arc::new(SubHandle::new(
                    first.wrapping_add(i as u32),
                    filter,
                    send.clone(),
                    self.inner.ids.clone(),
                ))
            })
            .collect();
        held.handed_over();
        let mut reader = FrameReader::new(recv);
        // One CONFIRM or ERROR per SUBSCRIBE, in order. A CONFIRM precedes its own
        // subscription's deliveries, but with several subscriptions a delivery of one confirmed
        // already may come before the next CONFIRM: it is kept for the application.
        let mut confirmed = 0;
        let mut early = Vec::new();
        // A durable SUBSCRIBE's CONFIRM says whether the broker's log serves it (protocol.md
        // §7.1); of several, in memory if any of them is, and unsaid if any says nothing.
        let mut durable_log = opts.durable.as_ref().map(|_| true);
        while confirmed < handles.len() {
            match reader.next_subscribe_answer().await? {
                Some(Frame {
                    message: Wire::Confirm(c),
                    ..
                }) => {
                    confirmed += 1;
                    durable_log = durable_log
                        .zip(durable_said(&c.offsets))
                        .map(|(all, this)| all && this);
                }
                Some(Frame {
                    stream_id,
                    message: Wire::Error(e),
                    ..
                }) if (stream_id.wrapping_sub(first) as usize) >= confirmed => {
                    return Err(ClientError::Broker {
                        code: e.code,
                        reason: e.reason,
                    })
                }
                // A delivery, or an ERROR, of a subscription confirmed already.
                Some(frame) if confirmed > 0 && !matches!(frame.message, Wire::Confirm(_)) => {
                    let index = frame.stream_id.wrapping_sub(first) as usize;
                    if let Some(handle) = handles.get(index).or(handles.first()) {
                        let stream_id = frame.stream_id;
                        early.extend(
                            crate::subscription::item(frame, handle).map(|it| (stream_id, it)),
                        );
                    }
                }
                Some(other) => {
                    return Err(ClientError::Connection(format!(
                        "expected CONFIRM for SUBSCRIBE, got {:?}",
                        other.message.opcode()
                    )))
                }
                // The broker finished the stream before confirming (it is shutting down, say):
                // not this side's close.
                None => {
                    return Err(ClientError::Connection(
                        "the broker ended the stream before confirming the subscription".into(),
                    ))
                }
            }
        }
        Subscription::start(handles, reader, early, durable_log).ok_or(ClientError::Closed)
    }

    /// Ask the broker what it allows (protocol.md §4.1): the largest frame it accepts from this
    /// client (`max_data_len`: a larger publish or batch would end its stream with
    /// FRAME_TOO_LARGE), what a client must be ready to receive, how many subscriptions a
    /// connection may hold, its name and version, and whether its durable log is on (whether a
    /// CONFIRM means stored, `durable`). On a stream of its own, closed after the answer. A broker older
    /// than INFO answers [`ClientError::Broker`] with [`ErrorCode::UNKNOWN_OPCODE`].
    ///
    /// [`ErrorCode::UNKNOWN_OPCODE`]: crate::ErrorCode::UNKNOWN_OPCODE
    pub async fn info(&self) -> Result<crate::BrokerInfo, ClientError> {
        let id = self.inner.ids.request();
        let (send, recv) = self.inner.conn.open_bi().await?;
        let mut send = crate::link::FrameSink::new(send);
        send.queue([Frame::new(id, Wire::Info(crate::BrokerInfo::request())).to_bytes()]);
        send.finish().await?;
        let mut reader = FrameReader::new(recv);
        match reader.next().await? {
            Some(Frame {
                message: Wire::Info(info),
                ..
            }) => {
                // The broker finishes its side once it has answered what came before our FIN:
                // read that end rather than stop the stream (which it would count as a client
                // that stopped reading). Not worth more than a moment's wait.
                let _ = tokio::time::timeout(Duration::from_secs(1), reader.next()).await;
                Ok(info)
            }
            Some(Frame {
                message: Wire::Error(e),
                ..
            }) => Err(ClientError::Broker {
                code: e.code,
                reason: e.reason,
            }),
            Some(other) => Err(ClientError::Connection(format!(
                "expected INFO, got {}",
                other.message.opcode().name()
            ))),
            None => Err(ClientError::Connection(
                "the broker ended the stream without answering INFO".into(),
            )),
        }
    }

    /// Wait until the broker has read everything published so far on the default publish
    /// stream (up to 10 s). An error says that a publish sent without `confirm` was refused
    /// ([`ClientError::Broker`] with the broker's code and reason: the first refusal), or that
    /// what was published may not all have been read (the stream or connection failed).
    pub async fn flush(&self) -> Result<(), ClientError> {
        self.inner.publisher.flush().await
    }

    /// Wait until the connection ends, and say why: the broker closed it (shutting down, an
    /// administrator's disconnect: [`ClientError::Connection`] with its code and reason), it
    /// was lost, or this client closed it ([`ClientError::Closed`]). The client does not
    /// reconnect by itself: to stay connected, wait for this, then connect again and subscribe
    /// again (a durable consumer resumes where it left off).
    pub async fn closed(&self) -> ClientError {
        self.inner.conn.closed().await
    }

    /// Flush every publish stream (the default one and those of [`publisher`](Self::publisher)
    /// still alive), close the connection, and wait for the broker to acknowledge the close.
    /// The connection is closed either way; the result is the flushes': an error says that a
    /// publish sent without `confirm` was refused, or that what was published may not all have
    /// been read (as [`flush`](Self::flush); the first such error).
    pub async fn close(&self) -> Result<(), ClientError> {
        let others: Vec<Publisher> = self
            .inner
            .others
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|p| p.upgrade())
            .collect();
        // All at once: each may wait up to 10 s for the broker.
        let (mut flushed, others) = futures_util::future::join(
            self.flush(),
            futures_util::future::join_all(others.iter().map(Publisher::flush)),
        )
        .await;
        for result in others {
            if flushed.is_ok() {
                flushed = result;
            }
        }
        self.inner.conn.close(b"client closed");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.inner.endpoint.wait_idle()).await;
        flushed
    }
}

/// What the CONFIRM of a durable SUBSCRIBE says (its `data`): `1` the broker's log serves it,
/// `0` in memory only; anything else — nothing, from a broker older than the rule, or a
/// reserved value — says nothing (protocol.md §7.1).
fn durable_said(data: &[u64]) -> Option<bool> {
    match data {
        [1] => Some(true),
        [0] => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::durable_said;

    /// A SUBSCRIBE or INFO whose stream the broker finishes unanswered (as one shutting down
    /// does) is the broker's doing: it was reported as `Closed`, which says this side closed.
    #[tokio::test]
    async fn a_stream_the_broker_ends_unanswered_is_not_a_local_close() {
        use crate::test_broker::{read_frame, within, FakeBroker};
        use crate::ClientError;
        let fake = FakeBroker::start();
        let (client, conn) = fake.client().await;
        let unanswered = || async {
            let (mut send, mut recv) = conn.accept_bi().await.expect("the stream");
            let _ = read_frame(&mut recv).await;
            send.finish().expect("finish");
            (send, recv)
        };
        let (subscribed, _s) =
            within(async { tokio::join!(client.subscribe("t"), unanswered()) }).await;
        let err = subscribed.expect_err("refused");
        assert!(
            matches!(&err, ClientError::Connection(why) if why.contains("before confirming")),
            "{err:?}"
        );
        let (info, _s) = within(async { tokio::join!(client.info(), unanswered()) }).await;
        let err = info.expect_err("unanswered");
        assert!(
            matches!(&err, ClientError::Connection(why) if why.contains("without answering")),
            "{err:?}"
        );
    }

    /// Every address a name resolves to is tried at once: one where nothing answers (a UDP
    /// socket that never replies, as an address the broker does not listen on) does not keep
    /// the client from the one where the broker is. Only the first was tried, and the
    /// connect timed out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_tries_every_address() {
        let broker = crate::test_broker::TestBroker::start().await;
        let broker_addr = broker.addr;
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("a silent socket");
        let silent_addr = silent.local_addr().expect("its address");
        let mut opts = broker.options();
        opts.timeout = std::time::Duration::from_secs(5);
        let client = super::Client::connect_to(
            &[silent_addr, broker_addr],
            opts,
            "localhost".into(),
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("connects through the second address");
        assert_eq!(client.remote_address(), broker_addr);
        client.close().await.expect("closed");
        broker.stop().await;
    }

    /// A WebTransport connect gives up at its timeout, the QUIC handshake and the session's
    /// setup together: the setup was given the whole timeout again after the handshake. Here
    /// the server takes 1.5 s to accept the handshake and then never answers the session's
    /// request; with a 2.5 s timeout the connect took 4 s.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_webtransport_connect_keeps_to_one_timeout() {
        let fake = crate::test_broker::FakeBroker::start_with_alpn(web_transport_quinn::ALPN);
        let endpoint = fake.endpoint();
        // Ends with the test (dropped: aborted), whatever the test's outcome.
        let mut server = tokio::task::JoinSet::new();
        server.spawn(async move {
            let incoming = endpoint.accept().await.expect("a connection");
            // A slow server, not a wait for a condition: the handshake is answered late.
            tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
            let conn = incoming.await.expect("handshake");
            // Holds the connection, answering nothing, until the client gives up.
            conn.closed().await
        });
        let mut opts = fake.options().transport(crate::Transport::WebTransport {
            path: "/aqueduct/wt".into(),
        });
        opts.timeout = std::time::Duration::from_millis(2_500);
        let started = std::time::Instant::now();
        let connected = crate::test_broker::within(super::Client::connect(opts)).await;
        let took = started.elapsed();
        assert!(
            matches!(connected, Err(crate::ConnectError::Timeout { .. })),
            "{:?}",
            connected.err()
        );
        assert!(
            took < std::time::Duration::from_millis(3_600),
            "took {took:?}"
        );
        server.shutdown().await;
    }

    /// After `close`, what is asked of the client fails as closed, not as a connection lost
    /// (`Connection("closed")`), which read as a network failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_close_everything_is_closed_not_lost() {
        let broker = crate::test_broker::TestBroker::start().await;
        let client = super::Client::connect(broker.options())
            .await
            .expect("connects");
        let mut sub = client.subscribe("t").await.expect("subscribed");
        client.close().await.expect("closed");
        let published = client.publish("t", "x").await;
        assert!(
            matches!(published, Err(crate::ClientError::Closed)),
            "{published:?}"
        );
        let subscribed = client.subscribe("u").await;
        assert!(
            matches!(subscribed, Err(crate::ClientError::Closed)),
            "{:?}",
            subscribed.err()
        );
        use futures_util::StreamExt;
        match sub.next().await {
            None | Some(Err(crate::ClientError::Closed)) => {}
            other => panic!("{other:?}"),
        }
        broker.stop().await;
    }

    #[test]
    fn a_durable_confirm_says_log_memory_or_nothing() {
        assert_eq!(durable_said(&[1]), Some(true));
        assert_eq!(durable_said(&[0]), Some(false));
        for unsaid in [&[][..], &[2], &[1, 1]] {
            assert_eq!(durable_said(unsaid), None, "{unsaid:?}");
        }
    }
}
