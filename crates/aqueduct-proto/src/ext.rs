//! The TLV extension block and the typed values it carries.
//!
//! ```text
//! ext_len u16 LE  (bytes of entries that follow, at most 1024)
//! entry*: [type u8][len u8][value: len bytes]
//! ```
//! Known types are validated (length and range) and may appear once each; unknown types are
//! skipped so older receivers accept newer senders. The table of types is in `docs/protocol.md`.

use bytes::{BufMut, Bytes};

use crate::error::ProtoError;
use crate::topic::{TopicName, TopicRef};

/// Largest extension block (`ext_len`), in bytes.
pub const MAX_EXT_LEN: usize = 1024;

/// Extension type codes. 0x01..=0x03 come from the seed.
pub mod types {
    /// Trace context: trace id (16) + span id (8) + flags (1).
    pub const TRACE: u8 = 0x01;
    /// Compression: algorithm u8 (1 = zstd) + uncompressed length u32 LE.
    pub const COMPRESSION: u8 = 0x02;
    /// Priority: one byte, 0 (highest) ..= 3 (lowest); default 2.
    pub const PRIORITY: u8 = 0x03;
    /// Topic name, 1..=255 bytes UTF-8.
    pub const TOPIC: u8 = 0x04;
    /// Time to live in milliseconds, u32 LE (0 = no expiry).
    pub const TTL: u8 = 0x05;
    /// Per-topic message offset, u64 LE.
    pub const OFFSET: u8 = 0x06;
    /// Delivery attempt number, u32 LE, starting at 1.
    pub const ATTEMPT: u8 = 0x07;
    /// Publish confirmation requested (empty value).
    pub const CONFIRM: u8 = 0x08;
    /// Subscription acknowledgement mode, one byte (0 = none, 1 = explicit ACK).
    pub const ACK_MODE: u8 = 0x09;
    /// Subscription overflow policy, one byte (0 drop_oldest, 1 drop_newest, 2 disconnect).
    pub const OVERFLOW: u8 = 0x0A;
    /// Dead letter: the topic the message was first published to.
    pub const ORIGINAL_TOPIC: u8 = 0x0B;
    /// Dead letter: the message's offset in its original topic, u64 LE.
    pub const ORIGINAL_OFFSET: u8 = 0x0C;
    /// Human-readable reason (NACK, dead letter), 0..=255 bytes UTF-8.
    pub const REASON: u8 = 0x0D;
    /// Dead letter: how many delivery attempts were made, u32 LE.
    pub const ATTEMPTS_MADE: u8 = 0x0E;
    /// SUBSCRIBE: at most this many unsettled deliveries at a time (u32, at least 1), below the
    /// broker's `max_in_flight` (a "prefetch" limit).
    pub const MAX_IN_FLIGHT: u8 = 0x0F;
}

/// Message priority: 0 is the highest, 3 the lowest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Priority(u8);

impl Priority {
    pub const HIGHEST: Priority = Priority(0);
    pub const DEFAULT: Priority = Priority(2);
    pub const LOWEST: Priority = Priority(3);
    /// Number of levels.
    pub const LEVELS: usize = 4;

    /// `Some` for 0..=3.
    pub fn new(level: u8) -> Option<Priority> {
        (usize::from(level) < Self::LEVELS).then_some(Priority(level))
    }

    /// The level, 0..=3.
    pub fn level(self) -> u8 {
        self.0
    }

    /// The level as an index into per-priority arrays.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl Default for Priority {
    fn default() -> Self {
        Priority::DEFAULT
    }
}

impl TryFrom<u8> for Priority {
    type Error = ProtoError;
    fn try_from(v: u8) -> Result<Self, ProtoError> {
        match Priority::new(v) {
            Some(p) => Ok(p),
            None => Err(ProtoError::BadExtension {
                ext_type: types::PRIORITY,
                problem: "priority must be 0..=3",
            }),
        }
    }
}

/// W3C-style trace context carried opaquely from publisher to subscriber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// The W3C `sampled` flag (bit 0 of `flags`).
    pub const SAMPLED: u8 = 0x01;

    /// The publisher recorded this trace (W3C `sampled` flag).
    pub fn is_sampled(&self) -> bool {
        self.flags & Self::SAMPLED != 0
    }

    /// The W3C `traceparent` header value: `00-<trace id>-<span id>-<flags>` in lowercase hex.
    pub fn to_traceparent(&self) -> String {
        use std::fmt::Write;
        let mut s = String::with_capacity(55);
        s.push_str("00-");
        self.trace_id.iter().for_each(|b| {
            let _ = write!(s, "{b:02x}");
        });
        s.push('-');
        self.span_id.iter().for_each(|b| {
            let _ = write!(s, "{b:02x}");
        });
        let _ = write!(s, "-{:02x}", self.flags);
        s
    }

    /// Parse a W3C `traceparent` (version 00; later versions are read by their first four
    /// fields, as the W3C spec says). All-zero trace or span ids are invalid there and here.
    pub fn from_traceparent(s: &str) -> Result<TraceContext, String> {
        let bad = |why: &str| format!("invalid traceparent {s:?}: {why}");
        let mut parts = s.trim().split('-');
        let (Some(version), Some(trace), Some(span), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("expected 00-<32 hex>-<16 hex>-<2 hex>"));
        };
        let hex_version = version.len() == 2
            && version
                .bytes()
                .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
        if !hex_version || version == "ff" || (version == "00" && parts.next().is_some()) {
            return Err(bad("unsupported version"));
        }
        fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
            if s.len() != 2 * N || !s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
                return None;
            }
            let mut out = [0u8; N];
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
            }
            Some(out)
        }
        let trace_id = hex::<16>(trace).ok_or_else(|| bad("trace id: 32 lowercase hex digits"))?;
        let span_id = hex::<8>(span).ok_or_else(|| bad("span id: 16 lowercase hex digits"))?;
        let [flags] = hex::<1>(flags).ok_or_else(|| bad("flags: 2 lowercase hex digits"))?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return Err(bad("all-zero ids are invalid"));
        }
        Ok(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }
}

/// Body compression, applied by the publisher and undone by the subscriber; the broker does not
/// look inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compression {
    /// 1 = zstd. Other values are passed through untouched.
    pub algorithm: u8,
    pub uncompressed_len: u32,
}

impl Compression {
    pub const ZSTD: u8 = 1;
}

/// Whether a subscription's deliveries wait for an ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AckMode {
    /// Delivered means done (plain subscriptions' default).
    #[default]
    None,
    /// Each delivery must be ACKed or NACKed (always so for consumer groups).
    Explicit,
}

/// What a full subscriber queue does with one more message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OverflowPolicy {
    /// Evict the oldest queued message of the same priority.
    #[default]
    DropOldest,
    /// Discard the incoming message.
    DropNewest,
    /// Close the subscription with SLOW_CONSUMER.
    Disconnect,
    /// Lose nothing: queue the message, and hold the publishers of what this subscription
    /// receives (stop reading their streams) until its queue has drained to half.
    Block,
}

impl OverflowPolicy {
    pub const ALL: [OverflowPolicy; 4] = [
        OverflowPolicy::DropOldest,
        OverflowPolicy::DropNewest,
        OverflowPolicy::Disconnect,
        OverflowPolicy::Block,
    ];

    /// The config / metrics spelling: `drop_oldest`, `drop_newest`, `disconnect`, `block`.
    pub fn as_str(self) -> &'static str {
        match self {
            OverflowPolicy::DropOldest => "drop_oldest",
            OverflowPolicy::DropNewest => "drop_newest",
            OverflowPolicy::Disconnect => "disconnect",
            OverflowPolicy::Block => "block",
        }
    }

    /// Index into per-policy arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    fn from_wire(v: u8) -> Option<OverflowPolicy> {
        OverflowPolicy::ALL.get(usize::from(v)).copied()
    }
}

impl std::str::FromStr for OverflowPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OverflowPolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                format!("unknown backpressure policy {s:?} (expected drop_oldest, drop_newest, disconnect or block)")
            })
    }
}

/// One known entry of an extension block, validated, borrowing its value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Entry<'a> {
    Trace(TraceContext),
    Compression(Compression),
    Priority(Priority),
    /// The topic and the offset of its value in the walked buffer.
    Topic(TopicRef<'a>, usize),
    Ttl(u32),
    Offset(u64),
    Attempt(u32),
    Confirm,
    AckMode(AckMode),
    Overflow(OverflowPolicy),
    OriginalTopic(TopicRef<'a>, usize),
    OriginalOffset(u64),
    Reason(&'a str),
    AttemptsMade(u32),
    MaxInFlight(u32),
}

/// Decode and validate one entry; `None` for a type this version does not know (skipped).
/// Every validation rule for known types lives here. `known_topic` is a name already validated
/// (or empty): a TOPIC value equal to it needs no second check — consecutive messages usually
/// share their topic, and comparing bytes is cheaper than checking a name.
fn decode_entry<'a>(
    ty: u8,
    value: &'a [u8],
    at: usize,
    known_topic: &[u8],
) -> Result<Option<Entry<'a>>, ProtoError> {
    let topic = |v, known| {
        TopicRef::new_after(v, known).map_err(|source| ProtoError::InvalidTopic {
            what: TopicName::WHAT,
            reason: source,
        })
    };
    Ok(Some(match ty {
        types::TRACE => {
            let v: [u8; 25] = fixed(ty, value)?;
            let mut trace_id = [0u8; 16];
            let mut span_id = [0u8; 8];
            trace_id.copy_from_slice(&v[..16]);
            span_id.copy_from_slice(&v[16..24]);
            Entry::Trace(TraceContext {
                trace_id,
                span_id,
                flags: v[24],
            })
        }
        types::COMPRESSION => {
            let v: [u8; 5] = fixed(ty, value)?;
            Entry::Compression(Compression {
                algorithm: v[0],
                uncompressed_len: u32::from_le_bytes([v[1], v[2], v[3], v[4]]),
            })
        }
        types::PRIORITY => {
            let [v] = fixed::<1>(ty, value)?;
            Entry::Priority(Priority::try_from(v)?)
        }
        types::TOPIC => Entry::Topic(topic(value, known_topic)?, at),
        types::TTL => Entry::Ttl(u32::from_le_bytes(fixed(ty, value)?)),
        types::OFFSET => Entry::Offset(u64::from_le_bytes(fixed(ty, value)?)),
        types::ATTEMPT => {
            let attempt = u32::from_le_bytes(fixed(ty, value)?);
            if attempt == 0 {
                return Err(bad(ty, "attempt numbers start at 1"));
            }
            Entry::Attempt(attempt)
        }
        types::CONFIRM => {
            if !value.is_empty() {
                return Err(bad(ty, "value must be empty"));
            }
            Entry::Confirm
        }
        types::ACK_MODE => Entry::AckMode(match fixed::<1>(ty, value)? {
            [0] => AckMode::None,
            [1] => AckMode::Explicit,
            _ => return Err(bad(ty, "ack mode must be 0 or 1")),
        }),
        types::OVERFLOW => {
            let [v] = fixed::<1>(ty, value)?;
            match OverflowPolicy::from_wire(v) {
                Some(p) => Entry::Overflow(p),
                None => return Err(bad(ty, "overflow policy must be 0..=3")),
            }
        }
        types::ORIGINAL_TOPIC => Entry::OriginalTopic(topic(value, &[])?, at),
        types::ORIGINAL_OFFSET => Entry::OriginalOffset(u64::from_le_bytes(fixed(ty, value)?)),
        types::REASON => {
            Entry::Reason(std::str::from_utf8(value).map_err(|_| bad(ty, "reason must be UTF-8"))?)
        }
        types::ATTEMPTS_MADE => Entry::AttemptsMade(u32::from_le_bytes(fixed(ty, value)?)),
        types::MAX_IN_FLIGHT => {
            let n = u32::from_le_bytes(fixed(ty, value)?);
            if n == 0 {
                return Err(bad(ty, "max in flight must be at least 1"));
            }
            Entry::MaxInFlight(n)
        }
        // Unknown types are skipped: forward compatibility.
        _ => return Ok(None),
    }))
}

/// Walk the extension block at `buf[start..end]`: every known entry is validated and handed to
/// `f`; a known type given twice, or an entry cut short, is an error. Allocation-free.
pub(crate) fn walk<'a>(
    buf: &'a [u8],
    start: usize,
    end: usize,
    f: impl FnMut(Entry<'a>),
) -> Result<(), ProtoError> {
    walk_after(buf, start, end, None, f)
}

/// [`walk`], with the topic of the previous message (already validated) as a hint: a TOPIC
/// entry equal to it is not checked again.
pub(crate) fn walk_after<'a>(
    buf: &'a [u8],
    start: usize,
    end: usize,
    previous: Option<TopicRef<'_>>,
    mut f: impl FnMut(Entry<'a>),
) -> Result<(), ProtoError> {
    let known_topic = previous.map_or(&[][..], |t| t.as_bytes());
    let len = end.saturating_sub(start);
    if len > MAX_EXT_LEN {
        return Err(ProtoError::ExtensionBlockTooLarge {
            len,
            max: MAX_EXT_LEN,
        });
    }
    let Some(block) = buf.get(start..end) else {
        return Err(ProtoError::TruncatedExtension {
            offset: 0,
            need: len,
            have: buf.len().saturating_sub(start),
        });
    };
    let mut seen = Seen::default();
    let mut rest = block;
    while !rest.is_empty() {
        let offset = block.len() - rest.len();
        let (ty, value, next) =
            split_entry(rest).map_err(|need| ProtoError::TruncatedExtension {
                offset,
                need,
                have: rest.len(),
            })?;
        if let Some(entry) = decode_entry(ty, value, start + offset + 2, known_topic)? {
            // Known types are 0x01..=0x0E.
            if !seen.first(ty) {
                return Err(ProtoError::DuplicateExtension { ext_type: ty });
            }
            f(entry);
        }
        rest = next;
    }
    Ok(())
}

/// The entry at the front of `rest`, laid out `type u8 | len u8 | value[len]` (extension
/// entries, and INFO's): its type, its value and what follows it; `Err(need)` when `rest` is
/// shorter than the whole entry (`need` bytes).
#[inline]
pub(crate) fn split_entry(rest: &[u8]) -> Result<(u8, &[u8], &[u8]), usize> {
    let Some((&[ty, len], after)) = rest.split_first_chunk::<2>() else {
        return Err(2);
    };
    let len = usize::from(len);
    match after.split_at_checked(len) {
        Some((value, next)) => Ok((ty, value, next)),
        None => Err(2 + len),
    }
}

/// The known types (or keys) of one block seen so far, 0x00..=0x1F: a type given twice is
/// refused.
#[derive(Default)]
pub(crate) struct Seen(u32);

impl Seen {
    /// Whether this is `ty`'s first time (and note it).
    #[inline]
    pub(crate) fn first(&mut self, ty: u8) -> bool {
        let bit = 1u32 << (ty & 31);
        let first = self.0 & bit == 0;
        self.0 |= bit;
        first
    }
}

/// The decoded extension block. Every field is `None`/`false` when its entry is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extensions {
    pub trace: Option<TraceContext>,
    pub compression: Option<Compression>,
    pub priority: Option<Priority>,
    pub topic: Option<TopicName>,
    pub ttl_ms: Option<u32>,
    pub offset: Option<u64>,
    pub attempt: Option<u32>,
    pub confirm: bool,
    pub ack_mode: Option<AckMode>,
    pub overflow: Option<OverflowPolicy>,
    pub original_topic: Option<TopicName>,
    pub original_offset: Option<u64>,
    pub reason: Option<String>,
    pub attempts_made: Option<u32>,
    /// SUBSCRIBE: at most this many unsettled deliveries at a time.
    pub max_in_flight: Option<u32>,
}

fn bad(ext_type: u8, problem: &'static str) -> ProtoError {
    ProtoError::BadExtension { ext_type, problem }
}

fn fixed<const N: usize>(ext_type: u8, value: &[u8]) -> Result<[u8; N], ProtoError> {
    value.try_into().map_err(|_| {
        bad(
            ext_type,
            match N {
                1 => "value must be 1 byte",
                4 => "value must be 4 bytes",
                5 => "value must be 5 bytes",
                8 => "value must be 8 bytes",
                25 => "value must be 25 bytes",
                _ => "value has the wrong length",
            },
        )
    })
}

impl Extensions {
    /// Parse the entries of an extension block (the bytes after `ext_len`). Topic values borrow
    /// `block`'s buffer.
    pub fn parse(block: &Bytes) -> Result<Extensions, ProtoError> {
        Self::parse_in(block, 0, block.len())
    }

    /// Parse the block at `buf[start..end]` without slicing `buf` first (one reference count
    /// fewer on the hot path).
    pub(crate) fn parse_in(
        buf: &Bytes,
        start: usize,
        end: usize,
    ) -> Result<Extensions, ProtoError> {
        let mut ext = Extensions::default();
        let name =
            |at: usize, t: TopicRef<'_>| TopicName::from_validated(buf.slice(at..at + t.len()));
        walk(buf, start, end, |entry| match entry {
            Entry::Trace(t) => ext.trace = Some(t),
            Entry::Compression(c) => ext.compression = Some(c),
            Entry::Priority(p) => ext.priority = Some(p),
            Entry::Topic(t, at) => ext.topic = Some(name(at, t)),
            Entry::Ttl(ms) => ext.ttl_ms = Some(ms),
            Entry::Offset(o) => ext.offset = Some(o),
            Entry::Attempt(a) => ext.attempt = Some(a),
            Entry::Confirm => ext.confirm = true,
            Entry::AckMode(m) => ext.ack_mode = Some(m),
            Entry::Overflow(p) => ext.overflow = Some(p),
            Entry::OriginalTopic(t, at) => ext.original_topic = Some(name(at, t)),
            Entry::OriginalOffset(o) => ext.original_offset = Some(o),
            Entry::Reason(r) => ext.reason = Some(r.to_owned()),
            Entry::AttemptsMade(n) => ext.attempts_made = Some(n),
            Entry::MaxInFlight(n) => ext.max_in_flight = Some(n),
        })?;
        Ok(ext)
    }

    /// True when no entry would be written.
    pub fn is_empty(&self) -> bool {
        self.encoded_len() == 0
    }

    /// Bytes of entries [`encode`](Self::encode) writes (excluding the `ext_len` prefix).
    pub fn encoded_len(&self) -> usize {
        let entry = |present: bool, len: usize| if present { 2 + len } else { 0 };
        entry(self.trace.is_some(), 25)
            + entry(self.compression.is_some(), 5)
            + entry(self.priority.is_some(), 1)
            + self.topic.as_ref().map_or(0, |t| 2 + t.len())
            + entry(self.ttl_ms.is_some(), 4)
            + entry(self.offset.is_some(), 8)
            + entry(self.attempt.is_some(), 4)
            + entry(self.confirm, 0)
            + entry(self.ack_mode.is_some(), 1)
            + entry(self.overflow.is_some(), 1)
            + self.original_topic.as_ref().map_or(0, |t| 2 + t.len())
            + entry(self.original_offset.is_some(), 8)
            + self.reason.as_ref().map_or(0, |r| 2 + reason_len(r))
            + entry(self.attempts_made.is_some(), 4)
            + entry(self.max_in_flight.is_some(), 4)
    }

    /// Append the entries (not the `ext_len` prefix) in canonical order: ATTEMPT first (so a
    /// broker can prepend it to a block shared by all subscribers), then ascending type.
    pub fn encode<B: BufMut>(&self, out: &mut B) {
        if let Some(a) = self.attempt {
            out.put_slice(&[types::ATTEMPT, 4]);
            out.put_u32_le(a);
        }
        if let Some(t) = &self.trace {
            out.put_slice(&[types::TRACE, 25]);
            out.put_slice(&t.trace_id);
            out.put_slice(&t.span_id);
            out.put_u8(t.flags);
        }
        if let Some(c) = &self.compression {
            out.put_slice(&[types::COMPRESSION, 5, c.algorithm]);
            out.put_u32_le(c.uncompressed_len);
        }
        if let Some(p) = self.priority {
            out.put_slice(&[types::PRIORITY, 1, p.level()]);
        }
        if let Some(t) = &self.topic {
            put_name(out, types::TOPIC, t);
        }
        if let Some(ttl) = self.ttl_ms {
            out.put_slice(&[types::TTL, 4]);
            out.put_u32_le(ttl);
        }
        if let Some(o) = self.offset {
            out.put_slice(&[types::OFFSET, 8]);
            out.put_u64_le(o);
        }
        if self.confirm {
            out.put_slice(&[types::CONFIRM, 0]);
        }
        if let Some(m) = self.ack_mode {
            out.put_slice(&[types::ACK_MODE, 1, u8::from(m == AckMode::Explicit)]);
        }
        if let Some(p) = self.overflow {
            out.put_slice(&[types::OVERFLOW, 1, p as u8]);
        }
        if let Some(t) = &self.original_topic {
            put_name(out, types::ORIGINAL_TOPIC, t);
        }
        if let Some(o) = self.original_offset {
            out.put_slice(&[types::ORIGINAL_OFFSET, 8]);
            out.put_u64_le(o);
        }
        if let Some(r) = &self.reason {
            let len = reason_len(r);
            out.put_slice(&[types::REASON, len as u8]);
            out.put_slice(&r.as_bytes()[..len]);
        }
        if let Some(a) = self.attempts_made {
            out.put_slice(&[types::ATTEMPTS_MADE, 4]);
            out.put_u32_le(a);
        }
        if let Some(n) = self.max_in_flight {
            out.put_slice(&[types::MAX_IN_FLIGHT, 4]);
            out.put_u32_le(n);
        }
    }
}

/// Reasons longer than 255 bytes are cut at the last character boundary that fits.
pub(crate) fn reason_len(reason: &str) -> usize {
    let mut len = reason.len().min(255);
    while !reason.is_char_boundary(len) {
        len -= 1;
    }
    len
}

fn put_name<B: BufMut>(out: &mut B, ty: u8, name: &TopicName) {
    // TopicName guarantees 1..=255 bytes, so the length fits in u8.
    out.put_slice(&[ty, name.len() as u8]);
    out.put_slice(name.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<Extensions, ProtoError> {
        Extensions::parse(&Bytes::copy_from_slice(bytes))
    }

    #[test]
    fn seed_extensions() {
        let mut block = vec![0x03, 1, 0];
        block.extend_from_slice(&[0x02, 5, 1, 0x00, 0x10, 0, 0]);
        block.extend_from_slice(&[0x01, 25]);
        block.extend((0..25).map(|i| i as u8));
        let ext = parse(&block).expect("valid");
        assert_eq!(ext.priority, Some(Priority::HIGHEST));
        assert_eq!(
            ext.compression,
            Some(Compression {
                algorithm: 1,
                uncompressed_len: 4096
            })
        );
        let trace = ext.trace.expect("trace");
        assert_eq!(trace.span_id, [16, 17, 18, 19, 20, 21, 22, 23]);
        assert_eq!(trace.flags, 24);
    }

    #[test]
    fn unknown_types_are_skipped() {
        let ext = parse(&[0x7F, 3, 1, 2, 3, 0x03, 1, 3]).expect("valid");
        assert_eq!(ext.priority, Some(Priority::LOWEST));
    }

    #[test]
    fn invalid_blocks() {
        assert_eq!(
            parse(&[0x03]),
            Err(ProtoError::TruncatedExtension {
                offset: 0,
                need: 2,
                have: 1
            })
        );
        assert_eq!(
            parse(&[0x03, 1, 0, 0x04, 5, b'a']),
            Err(ProtoError::TruncatedExtension {
                offset: 3,
                need: 7,
                have: 3
            })
        );
        assert_eq!(
            parse(&[0x03, 1, 4]),
            Err(bad(0x03, "priority must be 0..=3"))
        );
        assert_eq!(
            parse(&[0x03, 2, 0, 0]),
            Err(bad(0x03, "value must be 1 byte"))
        );
        assert_eq!(
            parse(&[0x03, 1, 0, 0x03, 1, 1]),
            Err(ProtoError::DuplicateExtension { ext_type: 3 })
        );
        assert!(matches!(
            parse(&[0x04, 3, b'a', b'+', b'b']),
            Err(ProtoError::InvalidTopic { .. })
        ));
        assert!(matches!(
            parse(&[0x04, 0]),
            Err(ProtoError::InvalidTopic { .. })
        ));
        assert_eq!(
            parse(&[0x07, 4, 0, 0, 0, 0]),
            Err(bad(0x07, "attempt numbers start at 1"))
        );
        assert_eq!(
            parse(&vec![0x7F; MAX_EXT_LEN + 1]),
            Err(ProtoError::ExtensionBlockTooLarge {
                len: 1025,
                max: 1024
            })
        );
    }

    #[test]
    fn long_reason_is_cut_on_a_char_boundary() {
        let ext = Extensions {
            reason: Some("é".repeat(200)),
            ..Extensions::default()
        };
        let mut out = Vec::new();
        ext.encode(&mut out);
        assert_eq!(out.len(), ext.encoded_len());
        assert_eq!(out[1], 254);
        let back = parse(&out).expect("valid");
        assert_eq!(back.reason.map(|r| r.chars().count()), Some(127));
    }

    #[test]
    fn policy_names() {
        for p in OverflowPolicy::ALL {
            assert_eq!(p.as_str().parse::<OverflowPolicy>(), Ok(p));
        }
        assert!("drop_all".parse::<OverflowPolicy>().is_err());
    }

    #[test]
    fn traceparent_round_trips_and_rejects_bad_values() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::from_traceparent(s).expect("valid");
        assert_eq!(t.trace_id[0], 0x4b);
        assert_eq!(t.span_id[7], 0xb7);
        assert!(t.is_sampled());
        assert_eq!(t.to_traceparent(), s);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(TraceContext::from_traceparent(bad).is_err(), "{bad}");
        }
        // A later version may add fields.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more";
        assert!(!TraceContext::from_traceparent(later)
            .expect("v01")
            .is_sampled());
    }
}
