//! Typed frames: decode from bytes, encode to bytes.
//!
//! A [`Frame`] is the header's routing fields (`stream_id`, MeshForwarded) plus a [`Message`], one
//! variant per opcode. Decoding borrows the input buffer: topics and bodies are `Bytes::slice`s,
//! never copies. Encoding is exact: `decode(encode(f)) == f` for every frame (proptest-checked).

use bytes::{BufMut, Bytes, BytesMut};

use crate::batch::{split_data, BatchIter, RawFrameRef};
use crate::error::{DecodeError, ErrorCode, ProtoError};
use crate::ext::{
    walk_after, AckMode, Compression, Entry, Extensions, OverflowPolicy, Priority, TraceContext,
};
use crate::header::{write_header, FrameHeader, Opcode, RawHeader, HEADER_LEN};
use crate::subscribe::{parse_unsubscribe, SubscribeSpec};
use crate::topic::{TopicFilter, TopicName, TopicRef};

/// Receiver limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted `data_len`. Default 1 MiB.
    pub max_data_len: u32,
}

impl Limits {
    pub const DEFAULT_MAX_DATA_LEN: u32 = 1024 * 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_data_len: Self::DEFAULT_MAX_DATA_LEN,
        }
    }
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Chosen by the client; echoed by the broker in replies (CONFIRM, ERROR) and in deliveries
    /// (the stream id of the SUBSCRIBE that created the subscription).
    pub stream_id: u32,
    /// Set on frames one broker forwards to another.
    pub mesh_forwarded: bool,
    pub message: Message,
}

/// One variant per opcode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Publish(Publish),
    Subscribe(Subscribe),
    Unsubscribe(Unsubscribe),
    PublishBatch(PublishBatch),
    Nack(Nack),
    Ack(Ack),
    Confirm(Confirm),
    Error(ErrorFrame),
    Info(Info),
}

/// PUBLISH: a message for a topic (client → broker), or a delivery (broker → client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// Extensions as on the wire.
    pub ext: Extensions,
    /// The payload as on the wire: the opaque body (for legacy frames, the topic text itself).
    pub body: Bytes,
    topic: TopicName,
    legacy_ttl_ms: Option<u32>,
}

/// SUBSCRIBE: the seed's grammar plus options carried as extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    pub spec: SubscribeSpec,
    pub ext: Extensions,
}

/// UNSUBSCRIBE `topic:<filter>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    pub filter: TopicFilter,
    pub ext: Extensions,
}

/// PUBLISH_BATCH: validated sub-frames, kept as the raw payload. A decoded batch also keeps what
/// validating it found (where each sub-frame's topic and body lie, its extensions), so that
/// iterating it parses nothing a second time; a batch built here is parsed on iteration.
#[derive(Debug, Clone)]
pub struct PublishBatch {
    pub ext: Extensions,
    payload: Bytes,
    count: usize,
    /// One entry per sub-frame for a decoded batch; empty for a built one.
    index: Vec<SubFrame>,
}

impl PartialEq for PublishBatch {
    /// Two batches are equal when their frames are: the index is derived from the payload.
    fn eq(&self, other: &Self) -> bool {
        self.ext == other.ext && self.payload == other.payload && self.count == other.count
    }
}

impl Eq for PublishBatch {}

/// The most sub-frames a batch's index makes room for before it has seen them.
const MAX_INDEX_RESERVE: usize = 1024;

/// A validated sub-frame's [`PublishRef`] as plain data: its topic's and body's ranges in the batch
/// payload and its decoded extensions.
#[derive(Debug, Clone, Copy)]
struct SubFrame {
    topic: (u32, u32),
    body: (u32, u32),
    priority: Priority,
    ttl_ms: Option<u32>,
    trace: Option<TraceContext>,
    compression: Option<Compression>,
}

impl SubFrame {
    /// `p`'s parts as ranges of `payload`, which `p` borrows from.
    fn of(p: &PublishRef<'_>, payload: &[u8]) -> SubFrame {
        // A frame's data length is a u32, so a decoded payload's offsets fit one.
        debug_assert!(u32::try_from(payload.len()).is_ok());
        let range = |part: &[u8]| {
            let start = part.as_ptr() as usize - payload.as_ptr() as usize;
            (start as u32, (start + part.len()) as u32)
        };
        SubFrame {
            topic: range(p.topic.as_bytes()),
            body: range(p.body),
            priority: p.priority,
            ttl_ms: p.ttl_ms,
            trace: p.trace,
            compression: p.compression,
        }
    }

    fn view<'a>(&self, payload: &'a [u8]) -> PublishRef<'a> {
        let part = |(start, end): (u32, u32)| &payload[start as usize..end as usize];
        PublishRef {
            topic: TopicRef::validated(part(self.topic)),
            body: part(self.body),
            priority: self.priority,
            ttl_ms: self.ttl_ms,
            trace: self.trace,
            compression: self.compression,
        }
    }
}

/// ACK: settle the delivery at `offset` (topic extension required for wildcard subscriptions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub offset: u64,
    pub ext: Extensions,
}

/// NACK (seed): reject the delivery at `offset`; the broker redelivers or dead-letters it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nack {
    pub offset: u64,
    pub ext: Extensions,
}

/// CONFIRM: the offsets assigned to a confirmed PUBLISH (one) or PUBLISH_BATCH (one per message);
/// empty for a confirmed SUBSCRIBE (the subscription is active).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirm {
    pub offsets: Vec<u64>,
}

/// ERROR: a request failed. `stream_id` of the frame is that of the offending frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    pub code: ErrorCode,
    pub reason: String,
}

/// INFO (protocol.md §4.1): a client's request (every field `None`: an empty payload) or the
/// broker's answer. The payload is entries `key u8 | len u8 | value`, laid out as extension
/// entries; a key this version does not know is skipped, a known one must have its length and
/// come at most once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Info {
    /// Key 0x01, 1 byte: the protocol version the broker speaks (1).
    pub protocol: Option<u8>,
    /// Key 0x02, u32: the largest `data_len` the broker accepts in a frame from this client
    /// (`transport.max_buf_size`); a larger frame gets FRAME_TOO_LARGE and ends the stream.
    pub max_data_len: Option<u32>,
    /// Key 0x03, u32: the `data_len` a client must be ready to accept in a frame from the
    /// broker (protocol.md §10: `max_buf_size + 1024`).
    pub max_delivery_data_len: Option<u32>,
    /// Key 0x04, u32: how many live subscriptions a connection may hold
    /// (`transport.max_subscriptions_per_connection`).
    pub max_subscriptions: Option<u32>,
    /// Key 0x05, 1..=255 bytes of UTF-8: the broker's name and version. An empty name is not
    /// sent (the entry must not be empty), so it decodes as `None`.
    pub broker: Option<String>,
    /// Key 0x06, 1 byte (0 or 1): whether the broker's durable log is on (`aal.enabled`), i.e.
    /// whether a CONFIRM means the message is stored (protocol.md §6.4) or only routed.
    pub durable: Option<bool>,
}

/// INFO entry keys (protocol.md §4.1).
pub mod info_key {
    pub const PROTOCOL: u8 = 0x01;
    pub const MAX_DATA_LEN: u8 = 0x02;
    pub const MAX_DELIVERY_DATA_LEN: u8 = 0x03;
    pub const MAX_SUBSCRIPTIONS: u8 = 0x04;
    pub const BROKER: u8 = 0x05;
    pub const DURABLE: u8 = 0x06;
}

impl Info {
    /// A client's request: no entries.
    pub fn request() -> Info {
        Info::default()
    }

    /// The entries, in ascending key order. A `broker` longer than 255 bytes is cut at a
    /// character boundary.
    fn entries(&self) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        if let Some(v) = self.protocol {
            out.push((info_key::PROTOCOL, vec![v]));
        }
        for (key, v) in [
            (info_key::MAX_DATA_LEN, self.max_data_len),
            (info_key::MAX_DELIVERY_DATA_LEN, self.max_delivery_data_len),
            (info_key::MAX_SUBSCRIPTIONS, self.max_subscriptions),
        ] {
            if let Some(v) = v {
                out.push((key, v.to_le_bytes().to_vec()));
            }
        }
        if let Some(b) = self.broker.as_deref().filter(|b| !b.is_empty()) {
            let end = crate::ext::reason_len(b);
            out.push((info_key::BROKER, b.as_bytes()[..end].to_vec()));
        }
        if let Some(on) = self.durable {
            out.push((info_key::DURABLE, vec![u8::from(on)]));
        }
        out
    }

    fn encoded_len(&self) -> usize {
        self.entries().iter().map(|(_, v)| 2 + v.len()).sum()
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        for (key, value) in self.entries() {
            out.put_u8(key);
            out.put_u8(value.len() as u8);
            out.put_slice(&value);
        }
    }

    /// Decode an INFO payload.
    pub fn decode(payload: &[u8]) -> Result<Info, ProtoError> {
        let bad = |problem: &'static str| ProtoError::BadPayload {
            opcode: "INFO",
            problem,
            len: payload.len(),
        };
        let mut info = Info::default();
        let mut seen = crate::ext::Seen::default();
        let mut rest = payload;
        while !rest.is_empty() {
            let (key, value, next) =
                crate::ext::split_entry(rest).map_err(|_| bad("an entry is cut short"))?;
            rest = next;
            // Every known key's arm below starts with this.
            let mut once = |key: u8| {
                if seen.first(key) {
                    Ok(())
                } else {
                    Err(bad("a key appears twice"))
                }
            };
            let u32_of = |v: &[u8]| -> Result<u32, ProtoError> {
                v.try_into()
                    .map(u32::from_le_bytes)
                    .map_err(|_| bad("a u32 entry must be 4 bytes"))
            };
            match key {
                info_key::PROTOCOL => {
                    once(key)?;
                    match value {
                        [v] => info.protocol = Some(*v),
                        _ => return Err(bad("PROTOCOL must be 1 byte")),
                    }
                }
                info_key::MAX_DATA_LEN => {
                    once(key)?;
                    info.max_data_len = Some(u32_of(value)?)
                }
                info_key::MAX_DELIVERY_DATA_LEN => {
                    once(key)?;
                    info.max_delivery_data_len = Some(u32_of(value)?)
                }
                info_key::MAX_SUBSCRIPTIONS => {
                    once(key)?;
                    info.max_subscriptions = Some(u32_of(value)?)
                }
                info_key::BROKER => {
                    once(key)?;
                    let b = std::str::from_utf8(value).map_err(|_| bad("BROKER must be UTF-8"))?;
                    if b.is_empty() {
                        return Err(bad("BROKER must not be empty"));
                    }
                    info.broker = Some(b.to_owned());
                }
                info_key::DURABLE => {
                    once(key)?;
                    match value {
                        [0] => info.durable = Some(false),
                        [1] => info.durable = Some(true),
                        _ => return Err(bad("DURABLE must be 1 byte, 0 or 1")),
                    }
                }
                // A key of a later version.
                _ => {}
            }
        }
        Ok(info)
    }
}

impl Publish {
    /// A publish with the topic in an extension and an opaque body.
    pub fn new(topic: TopicName, body: Bytes) -> Publish {
        Publish {
            ext: Extensions {
                topic: Some(topic.clone()),
                ..Extensions::default()
            },
            body,
            topic,
            legacy_ttl_ms: None,
        }
    }

    /// Build from wire parts, resolving the topic (extension, or the legacy payload form).
    pub fn from_parts(ext: Extensions, body: Bytes) -> Result<Publish, ProtoError> {
        let (topic, legacy_ttl_ms) = match &ext.topic {
            Some(topic) => (topic.clone(), None),
            None => parse_legacy(&body)?,
        };
        Ok(Publish {
            ext,
            body,
            topic,
            legacy_ttl_ms,
        })
    }

    /// The destination topic.
    pub fn topic(&self) -> &TopicName {
        &self.topic
    }

    /// True when the topic came from the payload (the seed's reference clients).
    pub fn is_legacy(&self) -> bool {
        self.ext.topic.is_none()
    }

    /// Time to live in ms: the TTL extension, else a legacy `ttl:<ms>:` prefix. 0 or absent = none.
    pub fn ttl_ms(&self) -> Option<u32> {
        self.ext.ttl_ms.or(self.legacy_ttl_ms).filter(|&t| t > 0)
    }

    /// The priority extension, or the default (2).
    pub fn priority(&self) -> Priority {
        self.ext.priority.unwrap_or_default()
    }

    /// Set the priority (builder style).
    pub fn with_priority(mut self, p: Priority) -> Publish {
        self.ext.priority = Some(p);
        self
    }

    /// Set the TTL (builder style).
    pub fn with_ttl_ms(mut self, ttl: u32) -> Publish {
        self.ext.ttl_ms = Some(ttl);
        self
    }

    /// Request a CONFIRM (builder style).
    pub fn with_confirm(mut self) -> Publish {
        self.ext.confirm = true;
        self
    }
}

/// The seed's reference clients send the topic as the payload: `[ttl:<ms>:][topic:]<name>`.
fn parse_legacy(payload: &Bytes) -> Result<(TopicName, Option<u32>), ProtoError> {
    let (topic, at, ttl) = legacy_target(payload)?;
    Ok((
        TopicName::from_validated(payload.slice(at..at + topic.len())),
        ttl,
    ))
}

/// The seed's payload form `[ttl:<ms>:][topic:]<name>`: the topic, where it starts, the TTL.
fn legacy_target(payload: &[u8]) -> Result<(TopicRef<'_>, usize, Option<u32>), ProtoError> {
    let mut start = 0;
    let mut ttl = None;
    if let Some(rest) = payload.strip_prefix(b"ttl:") {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || rest.get(digits) != Some(&b':') {
            return Err(ProtoError::BadPayload {
                opcode: "PUBLISH",
                problem: "legacy \"ttl:\" prefix must be \"ttl:<ms>:\"",
                len: payload.len(),
            });
        }
        let ms = rest[..digits].iter().try_fold(0u32, |acc, &d| {
            acc.checked_mul(10)?.checked_add(u32::from(d - b'0'))
        });
        let Some(ms) = ms else {
            return Err(ProtoError::BadPayload {
                opcode: "PUBLISH",
                problem: "legacy ttl does not fit in 32 bits of milliseconds",
                len: payload.len(),
            });
        };
        ttl = Some(ms);
        start = 4 + digits + 1;
    }
    if payload[start..].starts_with(b"topic:") {
        start += 6;
    }
    let topic = TopicRef::new(&payload[start..]).map_err(|source| ProtoError::InvalidTopic {
        what: "legacy topic payload",
        reason: source,
    })?;
    Ok((topic, start, ttl))
}

/// A PUBLISH frame as a subscriber receives it (a delivery), decoded without allocating or
/// counting references: the extensions every delivery carries. `more` says whether the frame
/// carries others too (trace context, dead-letter origin, …); [`Frame::decode`] reads those.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryRef<'a> {
    /// The TOPIC extension; `None` for a legacy frame (topic in the payload).
    pub topic: Option<TopicRef<'a>>,
    pub offset: Option<u64>,
    pub attempt: Option<u32>,
    pub priority: Option<Priority>,
    /// Where the body (the payload after the extension block) starts in the frame's data.
    pub body_start: usize,
    /// Known extensions other than the four above are present.
    pub more: bool,
}

impl<'a> DeliveryRef<'a> {
    /// Decode and validate the data of a PUBLISH frame: it is an error exactly when
    /// [`Frame::decode`] of a frame with a TOPIC extension is one.
    pub fn parse(header: &FrameHeader, data: &'a [u8]) -> Result<DeliveryRef<'a>, ProtoError> {
        Self::parse_after(header, data, None)
    }

    /// [`parse`](Self::parse), given the previous delivery's topic: when this one has the same
    /// topic it is compared, not checked again (the result is the same).
    pub fn parse_after(
        header: &FrameHeader,
        data: &'a [u8],
        previous: Option<&TopicName>,
    ) -> Result<DeliveryRef<'a>, ProtoError> {
        let (ext_start, ext_end) = split_data(header, data)?;
        if let Some(d) = Self::broker_layout(&data[ext_start..ext_end], previous) {
            return Ok(DeliveryRef {
                body_start: ext_end,
                ..d
            });
        }
        let mut d = DeliveryRef {
            topic: None,
            offset: None,
            attempt: None,
            priority: None,
            body_start: ext_end,
            more: false,
        };
        let previous = previous.map(TopicName::borrowed);
        walk_after(data, ext_start, ext_end, previous, |e| match e {
            Entry::Topic(t, _) => d.topic = Some(t),
            Entry::Offset(o) => d.offset = Some(o),
            Entry::Attempt(a) => d.attempt = Some(a),
            Entry::Priority(p) => d.priority = Some(p),
            _ => d.more = true,
        })?;
        Ok(d)
    }

    /// The block every plain delivery of a broker carries, exactly: ATTEMPT, PRIORITY, TOPIC,
    /// OFFSET in that order (see `SharedDelivery::write_frame`), read without the general walk.
    /// `None` for any other block, or one with a value the general walk would refuse: the
    /// caller then walks it, so the result is always the general walk's.
    #[inline]
    fn broker_layout(ext: &'a [u8], previous: Option<&TopicName>) -> Option<DeliveryRef<'a>> {
        use crate::ext::types::{ATTEMPT, OFFSET, PRIORITY, TOPIC};
        let [ATTEMPT, 4, a0, a1, a2, a3, PRIORITY, 1, level, TOPIC, n, rest @ ..] = ext else {
            return None;
        };
        let (topic, rest) = rest.split_at_checked(usize::from(*n))?;
        let [OFFSET, 8, offset @ ..] = rest else {
            return None;
        };
        let offset = u64::from_le_bytes(offset.try_into().ok()?);
        let attempt = u32::from_le_bytes([*a0, *a1, *a2, *a3]);
        if attempt == 0 {
            return None;
        }
        let known = previous.map_or(&[][..], |p| p.as_bytes());
        let topic = TopicRef::new_after(topic, known).ok()?;
        Some(DeliveryRef {
            topic: Some(topic),
            offset: Some(offset),
            attempt: Some(attempt),
            priority: Some(Priority::new(*level)?),
            body_start: 0,
            more: false,
        })
    }

    /// The topic as an owned name sharing `data`, which must be the buffer that was parsed
    /// (`None` if it is not, or for a legacy frame).
    pub fn topic_in(&self, data: &Bytes) -> Option<TopicName> {
        let t = self.topic?.as_bytes();
        let start = (t.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
        let end = start.checked_add(t.len())?;
        (end <= data.len()).then(|| TopicName::from_validated(data.slice(start..end)))
    }
}

/// A PUBLISH sub-frame of a batch, decoded without copying or counting references: what a
/// broker needs to route it. Extensions other than those below are validated and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishRef<'a> {
    pub topic: TopicRef<'a>,
    pub body: &'a [u8],
    pub priority: Priority,
    /// The TTL extension, else a legacy `ttl:<ms>:` prefix; 0 means none.
    pub ttl_ms: Option<u32>,
    pub trace: Option<TraceContext>,
    pub compression: Option<Compression>,
}

impl<'a> PublishRef<'a> {
    /// Decode and fully validate a sub-frame (the same rules as [`Publish`]).
    pub fn parse(sub: &RawFrameRef<'a>) -> Result<PublishRef<'a>, ProtoError> {
        Self::parse_after(sub, None)
    }

    /// [`parse`](Self::parse), given the previous sub-frame's topic: when this one has the same
    /// topic it is compared, not checked again (the result is the same).
    pub fn parse_after(
        sub: &RawFrameRef<'a>,
        previous: Option<TopicRef<'_>>,
    ) -> Result<PublishRef<'a>, ProtoError> {
        if let Some(p) = Self::client_layout(sub, previous) {
            return Ok(p);
        }
        let (mut topic, mut priority, mut ttl_ms, mut trace, mut compression) =
            (None, None, None, None, None);
        walk_after(
            sub.ext_block,
            0,
            sub.ext_block.len(),
            previous,
            |e| match e {
                Entry::Topic(t, _) => topic = Some(t),
                Entry::Priority(p) => priority = Some(p),
                Entry::Ttl(ms) => ttl_ms = Some(ms),
                Entry::Trace(t) => trace = Some(t),
                Entry::Compression(c) => compression = Some(c),
                _ => {}
            },
        )?;
        let topic = match topic {
            Some(t) => t,
            None => {
                let (t, _, legacy_ttl) = legacy_target(sub.payload)?;
                ttl_ms = ttl_ms.or(legacy_ttl);
                t
            }
        };
        Ok(PublishRef {
            topic,
            body: sub.payload,
            priority: priority.unwrap_or_default(),
            ttl_ms: ttl_ms.filter(|&t| t > 0),
            trace,
            compression,
        })
    }

    /// The block most publishes carry, exactly: TOPIC, or PRIORITY then TOPIC (as
    /// [`BatchBuilder`] writes them), read without the general walk. `None` for any other block,
    /// or one with a value the general walk would refuse: the caller then walks it, so the
    /// result is always the general walk's.
    #[inline]
    fn client_layout(sub: &RawFrameRef<'a>, previous: Option<TopicRef<'_>>) -> Option<Self> {
        use crate::ext::types::{PRIORITY, TOPIC};
        let (priority, rest) = match sub.ext_block {
            [PRIORITY, 1, level, rest @ ..] => (Priority::new(*level)?, rest),
            rest => (Priority::default(), rest),
        };
        let [TOPIC, n, topic @ ..] = rest else {
            return None;
        };
        if topic.len() != usize::from(*n) {
            return None;
        }
        let known = previous.map_or(&[][..], |p| p.as_bytes());
        let topic = TopicRef::new_after(topic, known).ok()?;
        Some(PublishRef {
            topic,
            body: sub.payload,
            priority,
            ttl_ms: None,
            trace: None,
            compression: None,
        })
    }
}

impl Subscribe {
    pub fn new(spec: SubscribeSpec) -> Subscribe {
        Subscribe {
            spec,
            ext: Extensions::default(),
        }
    }

    /// Explicit ACK requested (consumer groups always use it, whatever this says).
    pub fn ack_mode(&self) -> AckMode {
        self.ext.ack_mode.unwrap_or_default()
    }

    /// Overflow policy override for this subscription, if any.
    pub fn overflow(&self) -> Option<OverflowPolicy> {
        self.ext.overflow
    }
}

impl PublishBatch {
    /// Encode `publishes` as sub-frames (stream id 0).
    pub fn from_publishes(publishes: &[Publish]) -> PublishBatch {
        let mut buf = BytesMut::new();
        for p in publishes {
            write_publish(&mut buf, 0, &p.ext, &p.body);
        }
        PublishBatch {
            ext: Extensions::default(),
            payload: buf.freeze(),
            count: publishes.len(),
            index: Vec::new(),
        }
    }

    /// Validate a batch payload.
    pub fn from_parts(ext: Extensions, payload: Bytes) -> Result<PublishBatch, ProtoError> {
        let mut count = 0;
        let mut previous = None;
        let mut index = Vec::new();
        for sub in BatchIter::new(&payload) {
            let sub = sub?;
            // Full validation now, so that a broker can reject the whole batch before routing any
            // of it (borrowed: no reference counts); what it found is kept for iterating.
            match PublishRef::parse_after(&sub, previous) {
                Ok(p) => {
                    if index.is_empty() {
                        // Most batches hold messages of one size: room for that many at once
                        // (bounded: a tiny first sub-frame must not reserve for a huge batch).
                        let frames = payload.len() / (HEADER_LEN + sub.header.data_len as usize);
                        index.reserve(frames.min(MAX_INDEX_RESERVE));
                    }
                    index.push(SubFrame::of(&p, &payload));
                    previous = Some(p.topic);
                }
                Err(source) => {
                    return Err(ProtoError::BadBatchEntry {
                        index: count,
                        offset: sub.offset,
                        reason: Box::new(source),
                    })
                }
            }
            count += 1;
        }
        Ok(PublishBatch {
            ext,
            payload,
            count,
            index,
        })
    }

    /// Number of sub-frames.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The raw payload (concatenated sub-frames).
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The sub-frames as borrowed [`PublishRef`]s (cheapest). A decoded batch was validated, so
    /// the items are `Ok`, and they come from what validation found (no second parse).
    pub fn iter_refs(
        &self,
    ) -> impl Iterator<Item = Result<PublishRef<'_>, ProtoError>> + Clone + '_ {
        let payload = &self.payload[..];
        let indexed = self.index.iter().map(move |s| Ok(s.view(payload)));
        // A built batch has no index: parse it.
        let unindexed = if self.index.is_empty() { payload } else { &[] };
        indexed.chain(BatchIter::new(unindexed).scan(None, |previous, sub| {
            let parsed = sub.and_then(|sub| PublishRef::parse_after(&sub, *previous));
            if let Ok(p) = &parsed {
                *previous = Some(p.topic);
            }
            Some(parsed)
        }))
    }

    /// The sub-frames as publishes, each borrowing the batch buffer. The batch was validated
    /// when decoded, so the items are `Ok` for a decoded batch.
    pub fn publishes(&self) -> impl Iterator<Item = Result<Publish, ProtoError>> + '_ {
        BatchIter::new(&self.payload).map(|sub| publish_from_ref(&self.payload, &sub?))
    }
}

fn publish_from_ref(
    buf: &Bytes,
    sub: &crate::batch::RawFrameRef<'_>,
) -> Result<Publish, ProtoError> {
    let ext = if sub.header.has_extensions {
        Extensions::parse_in(buf, sub.ext_offset, sub.ext_offset + sub.ext_block.len())?
    } else {
        Extensions::default()
    };
    Publish::from_parts(
        ext,
        buf.slice(sub.payload_offset..sub.payload_offset + sub.payload.len()),
    )
}

/// Append one PUBLISH frame (no clone of the message).
fn write_publish<B: BufMut>(out: &mut B, stream_id: u32, ext: &Extensions, body: &[u8]) {
    let ext_len = ext.encoded_len();
    let mut command = Opcode::Publish as u8;
    let block = if ext_len > 0 {
        command |= crate::header::FLAG_HAS_EXTENSIONS;
        2 + ext_len
    } else {
        0
    };
    write_header(out, command, stream_id, (block + body.len()) as u32);
    if ext_len > 0 {
        out.put_u16_le(ext_len as u16);
        ext.encode(out);
    }
    out.put_slice(body);
}

/// Builds a PUBLISH_BATCH payload message by message, writing each sub-frame straight into one
/// buffer (no intermediate `Publish` values). Only valid sub-frames can be written, so the result
/// needs no validation.
#[derive(Debug, Default)]
pub struct BatchBuilder {
    buf: BytesMut,
    count: usize,
}

impl BatchBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a message to `topic`.
    pub fn push(
        &mut self,
        topic: &TopicName,
        body: &[u8],
        priority: Option<Priority>,
        ttl_ms: Option<u32>,
    ) {
        self.push_traced(topic, body, priority, ttl_ms, None);
    }

    /// Append a message to `topic` carrying a trace context.
    pub fn push_traced(
        &mut self,
        topic: &TopicName,
        body: &[u8],
        priority: Option<Priority>,
        ttl_ms: Option<u32>,
        trace: Option<&crate::ext::TraceContext>,
    ) {
        let entries = 2
            + topic.len()
            + trace.map_or(0, |_| 27)
            + priority.map_or(0, |_| 3)
            + ttl_ms.map_or(0, |_| 6);
        write_header(
            &mut self.buf,
            Opcode::Publish as u8 | crate::header::FLAG_HAS_EXTENSIONS,
            0,
            (2 + entries + body.len()) as u32,
        );
        self.buf.put_u16_le(entries as u16);
        if let Some(t) = trace {
            self.buf.put_slice(&[crate::ext::types::TRACE, 25]);
            self.buf.put_slice(&t.trace_id);
            self.buf.put_slice(&t.span_id);
            self.buf.put_u8(t.flags);
        }
        if let Some(p) = priority {
            self.buf
                .put_slice(&[crate::ext::types::PRIORITY, 1, p.level()]);
        }
        // TopicName guarantees 1..=255 bytes.
        self.buf
            .put_slice(&[crate::ext::types::TOPIC, topic.len() as u8]);
        self.buf.put_slice(topic.as_bytes());
        if let Some(ttl) = ttl_ms {
            self.buf.put_slice(&[crate::ext::types::TTL, 4]);
            self.buf.put_u32_le(ttl);
        }
        self.buf.put_slice(body);
        self.count += 1;
    }

    /// Messages pushed so far.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Bytes of the payload so far.
    pub fn encoded_len(&self) -> usize {
        self.buf.len()
    }

    /// Make room for `additional` more payload bytes at once (the payload otherwise grows by
    /// doubling, copying what it holds each time).
    pub fn reserve(&mut self, additional: usize) {
        self.buf.reserve(additional);
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The batch, with `ext` on the batch frame (e.g. CONFIRM).
    pub fn finish(self, ext: Extensions) -> PublishBatch {
        PublishBatch {
            ext,
            payload: self.buf.freeze(),
            count: self.count,
            index: Vec::new(),
        }
    }
}

impl Ack {
    pub fn new(offset: u64) -> Ack {
        Ack {
            offset,
            ext: Extensions::default(),
        }
    }
}

impl Nack {
    pub fn new(offset: u64) -> Nack {
        Nack {
            offset,
            ext: Extensions::default(),
        }
    }
}

fn offset_payload(opcode: &'static str, payload: &[u8]) -> Result<u64, ProtoError> {
    let bytes: [u8; 8] = payload.try_into().map_err(|_| ProtoError::BadPayload {
        opcode,
        problem: "payload must be the 8-byte little-endian offset",
        len: payload.len(),
    })?;
    Ok(u64::from_le_bytes(bytes))
}

impl Message {
    /// The opcode of this message.
    pub fn opcode(&self) -> Opcode {
        match self {
            Message::Publish(_) => Opcode::Publish,
            Message::Subscribe(_) => Opcode::Subscribe,
            Message::Unsubscribe(_) => Opcode::Unsubscribe,
            Message::PublishBatch(_) => Opcode::PublishBatch,
            Message::Nack(_) => Opcode::Nack,
            Message::Ack(_) => Opcode::Ack,
            Message::Confirm(_) => Opcode::Confirm,
            Message::Error(_) => Opcode::Error,
            Message::Info(_) => Opcode::Info,
        }
    }

    fn ext(&self) -> Option<&Extensions> {
        match self {
            Message::Publish(m) => Some(&m.ext),
            Message::Subscribe(m) => Some(&m.ext),
            Message::Unsubscribe(m) => Some(&m.ext),
            Message::PublishBatch(m) => Some(&m.ext),
            Message::Nack(m) => Some(&m.ext),
            Message::Ack(m) => Some(&m.ext),
            Message::Confirm(_) | Message::Error(_) | Message::Info(_) => None,
        }
    }

    /// Decode the data of a frame (the bytes after the header; exactly `header.data_len` long).
    pub fn decode(header: &FrameHeader, data: Bytes) -> Result<Message, ProtoError> {
        let (ext_start, ext_end) = split_data(header, &data)?;
        let ext = if ext_end > ext_start {
            Extensions::parse_in(&data, ext_start, ext_end)?
        } else {
            Extensions::default()
        };
        let payload = data.slice(ext_end..);
        let no_ext = |opcode: &'static str| {
            if ext.is_empty() {
                Ok(())
            } else {
                Err(ProtoError::BadPayload {
                    opcode,
                    problem: "this opcode takes no extensions",
                    len: payload.len(),
                })
            }
        };
        Ok(match header.opcode {
            Opcode::Publish => Message::Publish(Publish::from_parts(ext, payload)?),
            Opcode::Subscribe => Message::Subscribe(Subscribe {
                spec: SubscribeSpec::parse(&payload)?,
                ext,
            }),
            Opcode::Unsubscribe => Message::Unsubscribe(Unsubscribe {
                filter: parse_unsubscribe(&payload)?,
                ext,
            }),
            Opcode::PublishBatch => Message::PublishBatch(PublishBatch::from_parts(ext, payload)?),
            Opcode::Nack => Message::Nack(Nack {
                offset: offset_payload("NACK", &payload)?,
                ext,
            }),
            Opcode::Ack => Message::Ack(Ack {
                offset: offset_payload("ACK", &payload)?,
                ext,
            }),
            Opcode::Confirm => {
                no_ext("CONFIRM")?;
                if !payload.len().is_multiple_of(8) {
                    return Err(ProtoError::BadPayload {
                        opcode: "CONFIRM",
                        problem: "payload must be a sequence of 8-byte offsets",
                        len: payload.len(),
                    });
                }
                let offsets = payload
                    .chunks_exact(8)
                    .map(|c| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(c);
                        u64::from_le_bytes(b)
                    })
                    .collect();
                Message::Confirm(Confirm { offsets })
            }
            Opcode::Error => {
                no_ext("ERROR")?;
                let Some((code, reason)) = payload.split_first_chunk::<2>() else {
                    return Err(ProtoError::BadPayload {
                        opcode: "ERROR",
                        problem: "payload must start with a 2-byte code",
                        len: payload.len(),
                    });
                };
                // The code is what a receiver acts on (§9): a reason that is not UTF-8 is
                // shown with its bad bytes replaced, not a reason to lose the code.
                Message::Error(ErrorFrame {
                    code: ErrorCode(u16::from_le_bytes(*code)),
                    reason: String::from_utf8_lossy(reason).into_owned(),
                })
            }
            // A request's extensions are accepted and ignored (as on any frame they mean
            // nothing for, §3); the broker's answer carries none.
            Opcode::Info => Message::Info(Info::decode(&payload)?),
        })
    }

    fn payload_len(&self) -> usize {
        match self {
            Message::Publish(m) => m.body.len(),
            Message::Subscribe(m) => m.spec.encode().len(),
            Message::Unsubscribe(m) => 6 + m.filter.len(),
            Message::PublishBatch(m) => m.payload.len(),
            Message::Nack(_) | Message::Ack(_) => 8,
            Message::Confirm(m) => 8 * m.offsets.len(),
            Message::Error(m) => 2 + m.reason.len(),
            Message::Info(m) => m.encoded_len(),
        }
    }

    fn write_payload<B: BufMut>(&self, out: &mut B) {
        match self {
            Message::Publish(m) => out.put_slice(&m.body),
            Message::Subscribe(m) => out.put_slice(m.spec.encode().as_bytes()),
            Message::Unsubscribe(m) => {
                out.put_slice(b"topic:");
                out.put_slice(m.filter.as_bytes());
            }
            Message::PublishBatch(m) => out.put_slice(&m.payload),
            Message::Nack(Nack { offset, .. }) | Message::Ack(Ack { offset, .. }) => {
                out.put_u64_le(*offset)
            }
            Message::Confirm(m) => m.offsets.iter().for_each(|o| out.put_u64_le(*o)),
            Message::Error(m) => {
                out.put_u16_le(m.code.0);
                out.put_slice(m.reason.as_bytes());
            }
            Message::Info(m) => m.encode(out),
        }
    }

    /// Length of the whole frame, header included.
    pub fn frame_len(&self) -> usize {
        let ext_len = self.ext().map_or(0, Extensions::encoded_len);
        let ext_block = if ext_len > 0 { 2 + ext_len } else { 0 };
        HEADER_LEN + ext_block + self.payload_len()
    }

    /// Append the complete frame to `out`.
    pub fn encode_frame<B: BufMut>(&self, out: &mut B, stream_id: u32, mesh_forwarded: bool) {
        self.encode_head(out, stream_id, mesh_forwarded);
        self.write_payload(out);
    }

    /// The frame's header and extension block: [`encode_frame`](Self::encode_frame) without the
    /// payload.
    fn encode_head<B: BufMut>(&self, out: &mut B, stream_id: u32, mesh_forwarded: bool) {
        let ext_len = self.ext().map_or(0, Extensions::encoded_len);
        let mut command = self.opcode() as u8;
        if mesh_forwarded {
            command |= crate::header::FLAG_MESH_FORWARDED;
        }
        let ext_block = if ext_len > 0 {
            command |= crate::header::FLAG_HAS_EXTENSIONS;
            2 + ext_len
        } else {
            0
        };
        let data_len = ext_block + self.payload_len();
        write_header(out, command, stream_id, data_len as u32);
        if let Some(ext) = self.ext().filter(|_| ext_len > 0) {
            out.put_u16_le(ext_len as u16);
            ext.encode(out);
        }
    }
}

impl Frame {
    pub fn new(stream_id: u32, message: Message) -> Frame {
        Frame {
            stream_id,
            mesh_forwarded: false,
            message,
        }
    }

    /// Append the encoded frame to `out`.
    pub fn encode<B: BufMut>(&self, out: &mut B) {
        self.message
            .encode_frame(out, self.stream_id, self.mesh_forwarded);
    }

    /// The encoded frame in two parts, to be sent one after the other: a PUBLISH_BATCH's head
    /// (header and extension block) in a new buffer, and its payload as it is, shared rather
    /// than copied; any other frame whole, with no second part. Together the parts are exactly
    /// [`to_bytes`](Self::to_bytes).
    pub fn encode_split(&self) -> (Bytes, Option<Bytes>) {
        match &self.message {
            Message::PublishBatch(b) => {
                let mut head = BytesMut::with_capacity(self.message.frame_len() - b.payload.len());
                self.message
                    .encode_head(&mut head, self.stream_id, self.mesh_forwarded);
                (head.freeze(), Some(b.payload.clone()))
            }
            _ => (self.to_bytes(), None),
        }
    }

    /// The encoded frame as a new buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.message.frame_len());
        self.encode(&mut out);
        out.freeze()
    }

    /// Decode one complete frame given its header and data.
    pub fn decode(header: &FrameHeader, data: Bytes) -> Result<Frame, ProtoError> {
        Ok(Frame {
            stream_id: header.stream_id,
            mesh_forwarded: header.mesh_forwarded,
            message: Message::decode(header, data)?,
        })
    }
}

/// Check that `buf` starts with a complete frame within `limits`, returning its raw header.
///
/// `Incomplete` means read more; `Invalid(BadMagic | FrameTooLarge)` means the frame boundary is
/// lost or the frame is refused: the receiver must stop reading the stream (the broker sends an
/// ERROR first, then finishes its side). Anything else wrong with the
/// frame is reported by [`Frame::decode`] after the frame has been split off, so the receiver can
/// skip exactly that frame and go on.
pub fn split_frame(buf: &[u8], limits: &Limits) -> Result<RawHeader, DecodeError> {
    let raw = RawHeader::parse(buf)?;
    if raw.data_len > limits.max_data_len {
        return Err(ProtoError::FrameTooLarge {
            len: raw.data_len,
            max: limits.max_data_len,
        }
        .into());
    }
    if buf.len() < raw.frame_len() {
        return Err(DecodeError::Incomplete {
            need: raw.frame_len(),
            have: buf.len(),
        });
    }
    Ok(raw)
}

/// Decode the first frame in `buf`, returning it and the number of bytes it used.
pub fn decode_frame(buf: &Bytes, limits: &Limits) -> Result<(Frame, usize), DecodeError> {
    let raw = split_frame(buf, limits)?;
    let header = raw.validate()?;
    let frame = Frame::decode(&header, buf.slice(HEADER_LEN..raw.frame_len()))?;
    Ok((frame, raw.frame_len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// INFO entries: unknown keys are skipped (later versions add some), a known key must have
    /// its length and come once, and an entry must be whole.
    #[test]
    fn info_entries_are_checked_and_unknown_keys_skipped() {
        assert_eq!(Info::decode(&[]), Ok(Info::request()));
        for on in [false, true] {
            let info = Info {
                durable: Some(on),
                ..Info::default()
            };
            let bytes = Frame::new(1, Message::Info(info.clone())).to_bytes();
            assert_eq!(&bytes[10..], [0x06, 1, u8::from(on)]);
            assert_eq!(Info::decode(&bytes[10..]), Ok(info));
        }
        let answer = Info::decode(&[0x01, 1, 1, 0x7F, 3, 9, 9, 9, 0x04, 4, 0x10, 0x27, 0, 0])
            .expect("an unknown key in the middle");
        assert_eq!(
            (
                answer.protocol,
                answer.max_subscriptions,
                answer.max_data_len
            ),
            (Some(1), Some(10_000), None)
        );
        for (bytes, problem) in [
            (&[0x01, 1, 1, 0x01, 1, 2][..], "a key appears twice"),
            (&[0x02, 2, 0, 1][..], "a u32 entry must be 4 bytes"),
            (&[0x01, 2, 1, 1][..], "PROTOCOL must be 1 byte"),
            (&[0x05, 0][..], "BROKER must not be empty"),
            (&[0x05, 1, 0xFF][..], "BROKER must be UTF-8"),
            (&[0x06, 1, 2][..], "DURABLE must be 1 byte, 0 or 1"),
            (&[0x06, 0][..], "DURABLE must be 1 byte, 0 or 1"),
            (&[0x06, 1, 1, 0x06, 1, 1][..], "a key appears twice"),
            (&[0x7F, 5, 1][..], "an entry is cut short"),
            (&[0x01][..], "an entry is cut short"),
        ] {
            match Info::decode(bytes) {
                Err(ProtoError::BadPayload {
                    opcode, problem: p, ..
                }) => {
                    assert_eq!((opcode, p), ("INFO", problem), "{bytes:?}")
                }
                other => panic!("{bytes:?}: {other:?}"),
            }
        }
    }

    /// A broker name longer than an entry holds is cut at a character boundary, never inside
    /// one (the answer must stay UTF-8).
    #[test]
    fn a_long_info_broker_name_is_cut_at_a_character() {
        let info = Info {
            broker: Some(format!("{}é", "x".repeat(254))),
            ..Info::default()
        };
        let bytes = Frame::new(1, Message::Info(info)).to_bytes();
        let (back, _) = decode_frame(&bytes, &Limits::default()).expect("decodes");
        let Message::Info(back) = back.message else {
            panic!("not an INFO")
        };
        assert_eq!(back.broker, Some("x".repeat(254)));
    }

    /// An ERROR whose reason is not UTF-8 keeps its code (what a receiver acts on, §9): the
    /// bad bytes are replaced. Refusing the frame lost the code (the client saw BAD_PAYLOAD).
    #[test]
    fn an_error_with_a_reason_not_utf8_keeps_its_code() {
        // code 200 (INVALID_TOPIC), reason 0xFF 'x'
        let bytes = Bytes::from_static(&[0x1F, 0x08, 3, 0, 0, 0, 4, 0, 0, 0, 200, 0, 0xFF, b'x']);
        let (frame, used) = decode_frame(&bytes, &Limits::default()).expect("decodes");
        assert_eq!(used, bytes.len());
        assert_eq!(
            frame,
            Frame::new(
                3,
                Message::Error(ErrorFrame {
                    code: ErrorCode::INVALID_TOPIC,
                    reason: "\u{FFFD}x".into(),
                })
            )
        );
        // Fewer than the code's 2 bytes is still refused.
        assert!(matches!(
            decode_frame(
                &Bytes::from_static(&[0x1F, 0x08, 3, 0, 0, 0, 1, 0, 0, 0, 200]),
                &Limits::default()
            ),
            Err(DecodeError::Invalid(ProtoError::BadPayload {
                opcode: "ERROR",
                ..
            }))
        ));
    }

    fn topic(s: &str) -> TopicName {
        TopicName::try_from(s).expect("valid topic")
    }

    #[test]
    fn a_batch_index_reserves_a_bounded_room() {
        // A tiny first sub-frame, then a large one: the index must not make room for the
        // ~7,000 tiny frames the payload could have held.
        let topic = TopicName::try_from("a").expect("valid");
        let mut b = BatchBuilder::new();
        b.push(&topic, b"", None, None);
        b.push(&topic, &[7u8; 100_000], None, None);
        let built = b.finish(Extensions::default());
        let decoded = PublishBatch::from_parts(Extensions::default(), built.payload().clone())
            .expect("valid");
        assert_eq!(decoded.index.len(), 2);
        assert!(
            decoded.index.capacity() <= MAX_INDEX_RESERVE,
            "{}",
            decoded.index.capacity()
        );
        // Uniform batches get their room at once.
        let mut b = BatchBuilder::new();
        for _ in 0..100 {
            b.push(&topic, &[1u8; 128], None, None);
        }
        let built = b.finish(Extensions::default());
        let decoded = PublishBatch::from_parts(Extensions::default(), built.payload().clone())
            .expect("valid");
        assert!((100..200).contains(&decoded.index.capacity()));
    }

    fn round_trip(frame: Frame) {
        let bytes = frame.to_bytes();
        assert_eq!(bytes.len(), frame.message.frame_len());
        let (back, used) = decode_frame(&bytes, &Limits::default()).expect("decodes");
        assert_eq!(used, bytes.len());
        assert_eq!(back, frame);
    }

    #[test]
    fn round_trips() {
        round_trip(Frame::new(
            7,
            Message::Publish(
                Publish::new(topic("a/b"), Bytes::from_static(b"hi"))
                    .with_priority(Priority::HIGHEST)
                    .with_ttl_ms(500)
                    .with_confirm(),
            ),
        ));
        round_trip(Frame::new(
            1,
            Message::Subscribe(Subscribe::new(
                SubscribeSpec::parse(&Bytes::from_static(b"topic:a/+:group:g")).expect("ok"),
            )),
        ));
        round_trip(Frame::new(
            2,
            Message::Confirm(Confirm {
                offsets: vec![1, 2, u64::MAX],
            }),
        ));
        round_trip(Frame::new(
            3,
            Message::Error(ErrorFrame {
                code: ErrorCode::INVALID_TOPIC,
                reason: "nope".into(),
            }),
        ));
        let batch = PublishBatch::from_publishes(&[
            Publish::new(topic("x"), Bytes::from_static(b"1")),
            Publish::new(topic("y"), Bytes::from_static(b"22")),
        ]);
        assert_eq!(batch.len(), 2);
        round_trip(Frame::new(4, Message::PublishBatch(batch.clone())));
        // Sent in two parts, the batch's payload unchanged and not copied.
        let confirmed = PublishBatch {
            ext: Extensions {
                confirm: true,
                ..Extensions::default()
            },
            ..batch.clone()
        };
        let frame = Frame::new(4, Message::PublishBatch(confirmed));
        let (head, tail) = frame.encode_split();
        let tail = tail.expect("a batch has a tail");
        assert_eq!(tail.as_ptr(), batch.payload().as_ptr());
        assert_eq!([&head[..], &tail[..]].concat(), frame.to_bytes());
        let ack = Frame::new(4, Message::Ack(Ack::new(7)));
        assert_eq!(ack.encode_split(), (ack.to_bytes(), None));
        // The builder writes the same bytes as the generic encoder.
        let mut b = BatchBuilder::new();
        b.push(&topic("x"), b"1", Some(Priority::HIGHEST), Some(5));
        b.push(&topic("y"), b"22", None, None);
        let trace = crate::TraceContext {
            trace_id: [7; 16],
            span_id: [8; 8],
            flags: 1,
        };
        b.push_traced(
            &topic("z"),
            b"3",
            Some(Priority::LOWEST),
            None,
            Some(&trace),
        );
        let built = b.finish(Extensions::default());
        let mut traced =
            Publish::new(topic("z"), Bytes::from_static(b"3")).with_priority(Priority::LOWEST);
        traced.ext.trace = Some(trace);
        let generic = PublishBatch::from_publishes(&[
            Publish::new(topic("x"), Bytes::from_static(b"1"))
                .with_priority(Priority::HIGHEST)
                .with_ttl_ms(5),
            Publish::new(topic("y"), Bytes::from_static(b"22")),
            traced,
        ]);
        assert_eq!(built, generic);
        assert_eq!(
            PublishBatch::from_parts(Extensions::default(), built.payload().clone()),
            Ok(built)
        );
    }

    #[test]
    fn legacy_publish() {
        let cases: [(&[u8], &str, Option<u32>); 4] = [
            (b"orders", "orders", None),
            (b"topic:orders", "orders", None),
            (b"ttl:1500:orders", "orders", Some(1500)),
            (b"ttl:1500:topic:a/b", "a/b", Some(1500)),
        ];
        for (payload, want_topic, want_ttl) in cases {
            let p = Publish::from_parts(Extensions::default(), Bytes::copy_from_slice(payload))
                .expect("legacy parses");
            assert!(p.is_legacy());
            assert_eq!(p.topic().as_str(), want_topic);
            assert_eq!(p.ttl_ms(), want_ttl);
            assert_eq!(&p.body[..], payload, "delivered with the original payload");
        }
        for bad in [
            &b"ttl:x:orders"[..],
            b"ttl:5",
            b"a+b",
            b"",
            b"ttl:99999999999:a",
        ] {
            assert!(
                Publish::from_parts(Extensions::default(), Bytes::copy_from_slice(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn incomplete_vs_invalid() {
        let frame = Frame::new(
            9,
            Message::Publish(Publish::new(topic("t"), Bytes::from_static(b"body"))),
        )
        .to_bytes();
        for cut in 0..frame.len() {
            match decode_frame(&frame.slice(..cut), &Limits::default()) {
                Err(DecodeError::Incomplete { need, have }) => {
                    assert_eq!(have, cut);
                    assert!(need > cut);
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        let limits = Limits { max_data_len: 4 };
        assert_eq!(
            decode_frame(&frame, &limits),
            Err(DecodeError::Invalid(ProtoError::FrameTooLarge {
                len: frame.len() as u32 - 10,
                max: 4
            }))
        );
    }

    #[test]
    fn bad_payloads() {
        let mut out = BytesMut::new();
        write_header(&mut out, 0x06, 1, 3);
        out.put_slice(&[1, 2, 3]);
        assert!(matches!(
            decode_frame(&out.freeze(), &Limits::default()),
            Err(DecodeError::Invalid(ProtoError::BadPayload {
                opcode: "ACK",
                ..
            }))
        ));
        let mut out = BytesMut::new();
        write_header(&mut out, 0x41, 1, 1);
        out.put_u8(0);
        assert_eq!(
            decode_frame(&out.freeze(), &Limits::default()),
            Err(DecodeError::Invalid(ProtoError::MissingExtLen {
                data_len: 1
            }))
        );
        let mut out = BytesMut::new();
        write_header(&mut out, 0x41, 1, 4);
        out.put_slice(&[10, 0, 0, 0]);
        assert_eq!(
            decode_frame(&out.freeze(), &Limits::default()),
            Err(DecodeError::Invalid(ProtoError::ExtensionBlockOverrun {
                ext_len: 10,
                available: 2
            }))
        );
    }
}
