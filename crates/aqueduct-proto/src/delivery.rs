//! Deliveries encoded once, shared by every subscriber.
//!
//! A delivery is a PUBLISH frame from broker to subscriber whose extension block carries the
//! concrete topic, the per-topic offset, the priority and the attempt number. Everything but the
//! header (whose `stream_id` names the subscription) and the attempt entry is the same for every
//! subscriber, so the broker encodes it once into a [`SharedDelivery`] — a reference-counted
//! buffer — and each subscriber's writer adds its own 10-byte header and 6-byte attempt entry
//! while copying into its coalescing buffer ([`SharedDelivery::write_frame`]).
//!
//! The bytes written are exactly what [`crate::Frame::encode`] produces for the same delivery.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::ProtoError;
use crate::ext::{types, Compression, Extensions, Priority, TraceContext};
use crate::header::{write_header, FLAG_HAS_EXTENSIONS, HEADER_LEN};
use crate::topic::TopicName;

/// How much a publisher's encoding arena grows at a time.
pub const ARENA_CHUNK: usize = 64 * 1024;

/// Where a dead-lettered message came from (carried on `__dlq__<topic>` deliveries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter<'a> {
    pub original_topic: &'a TopicName,
    pub original_offset: u64,
    pub attempts_made: u32,
    pub reason: &'a str,
}

/// The fields of a delivery that do not depend on the subscriber.
#[derive(Debug, Clone)]
pub struct DeliveryFields<'a> {
    pub topic: &'a TopicName,
    pub offset: u64,
    pub priority: Priority,
    pub trace: Option<&'a TraceContext>,
    pub compression: Option<&'a Compression>,
    pub dead_letter: Option<DeadLetter<'a>>,
    pub body: &'a [u8],
}

/// The subscriber-independent part of a delivery frame: extension entries and body.
#[derive(Clone, PartialEq, Eq)]
pub struct SharedDelivery {
    /// `[entries before ATTEMPT][entries after ATTEMPT][body]`
    bytes: Bytes,
    /// Length of the entries that sort before the ATTEMPT entry.
    pre_len: u16,
    /// Length of all shared entries.
    ext_len: u16,
}

/// Size of the per-subscriber ATTEMPT entry.
const ATTEMPT_ENTRY: usize = 6;

impl std::fmt::Debug for SharedDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDelivery")
            .field("ext_len", &self.ext_len)
            .field("body_len", &self.body_len())
            .finish()
    }
}

impl SharedDelivery {
    /// Encode `fields` into `arena` and split the result off as a shared buffer.
    ///
    /// No allocation in steady state: the arena grows by [`ARENA_CHUNK`] only when its spare
    /// capacity runs out, and `BytesMut::reserve` reuses the old block once every delivery cut
    /// from it has been dropped.
    pub fn encode(arena: &mut BytesMut, fields: &DeliveryFields<'_>) -> SharedDelivery {
        let pre_len = 3
            + 2
            + fields.topic.len()
            + 10
            + fields.trace.map_or(0, |_| 27)
            + fields.compression.map_or(0, |_| 7);
        let post_len = fields.dead_letter.as_ref().map_or(0, |d| {
            2 + d.original_topic.len() + 10 + 2 + reason_len(d.reason) + 6
        });
        let need = pre_len + post_len + fields.body.len();
        if arena.capacity() - arena.len() < need {
            arena.reserve(need.max(ARENA_CHUNK));
        }
        if let Some(t) = fields.trace {
            arena.put_slice(&[types::TRACE, 25]);
            arena.put_slice(&t.trace_id);
            arena.put_slice(&t.span_id);
            arena.put_u8(t.flags);
        }
        if let Some(c) = fields.compression {
            arena.put_slice(&[types::COMPRESSION, 5, c.algorithm]);
            arena.put_u32_le(c.uncompressed_len);
        }
        arena.put_slice(&[types::PRIORITY, 1, fields.priority.level()]);
        arena.put_slice(&[types::TOPIC, fields.topic.len() as u8]);
        arena.put_slice(fields.topic.as_bytes());
        arena.put_slice(&[types::OFFSET, 8]);
        arena.put_u64_le(fields.offset);
        if let Some(d) = &fields.dead_letter {
            arena.put_slice(&[types::ORIGINAL_TOPIC, d.original_topic.len() as u8]);
            arena.put_slice(d.original_topic.as_bytes());
            arena.put_slice(&[types::ORIGINAL_OFFSET, 8]);
            arena.put_u64_le(d.original_offset);
            let rlen = reason_len(d.reason);
            arena.put_slice(&[types::REASON, rlen as u8]);
            arena.put_slice(&d.reason.as_bytes()[..rlen]);
            arena.put_slice(&[types::ATTEMPTS_MADE, 4]);
            arena.put_u32_le(d.attempts_made);
        }
        arena.put_slice(fields.body);
        SharedDelivery {
            bytes: arena.split().freeze(),
            pre_len: pre_len as u16,
            ext_len: (pre_len + post_len) as u16,
        }
    }

    /// Length of the frame [`write_frame`](Self::write_frame) writes.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + 2 + ATTEMPT_ENTRY + self.bytes.len()
    }

    /// Append the full delivery frame for one subscriber.
    pub fn write_frame<B: BufMut>(&self, out: &mut B, stream_id: u32, attempt: u32) {
        let data_len = 2 + ATTEMPT_ENTRY + self.bytes.len();
        write_header(
            out,
            crate::header::Opcode::Publish as u8 | FLAG_HAS_EXTENSIONS,
            stream_id,
            data_len as u32,
        );
        out.put_u16_le(self.ext_len + ATTEMPT_ENTRY as u16);
        let pre = usize::from(self.pre_len);
        out.put_slice(&self.bytes[..pre]);
        out.put_slice(&[types::ATTEMPT, 4]);
        out.put_u32_le(attempt);
        out.put_slice(&self.bytes[pre..]);
    }

    /// The message body (shares the buffer).
    pub fn body(&self) -> Bytes {
        self.bytes.slice(usize::from(self.ext_len)..)
    }

    /// Body length in bytes.
    pub fn body_len(&self) -> usize {
        self.bytes.len() - usize::from(self.ext_len)
    }

    /// Decode the shared extension entries (used off the hot path, e.g. to dead-letter).
    pub fn extensions(&self) -> Result<Extensions, ProtoError> {
        Extensions::parse(&self.bytes.slice(..usize::from(self.ext_len)))
    }
}

fn reason_len(reason: &str) -> usize {
    let mut len = reason.len().min(255);
    while !reason.is_char_boundary(len) {
        len -= 1;
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode_frame, Limits, Message};

    #[test]
    fn delivery_frame_matches_the_generic_encoder() {
        let topic = TopicName::try_from("orders/eu").expect("valid");
        let original = TopicName::try_from("orders").expect("valid");
        let trace = TraceContext {
            trace_id: [7; 16],
            span_id: [8; 8],
            flags: 1,
        };
        let mut arena = BytesMut::new();
        for dead_letter in [
            None,
            Some(DeadLetter {
                original_topic: &original,
                original_offset: 9,
                attempts_made: 4,
                reason: "nacked",
            }),
        ] {
            let shared = SharedDelivery::encode(
                &mut arena,
                &DeliveryFields {
                    topic: &topic,
                    offset: 42,
                    priority: Priority::HIGHEST,
                    trace: Some(&trace),
                    compression: None,
                    dead_letter,
                    body: b"hello",
                },
            );
            assert_eq!(&shared.body()[..], b"hello");
            let mut out = BytesMut::new();
            shared.write_frame(&mut out, 77, 3);
            assert_eq!(out.len(), shared.frame_len());
            let bytes = out.freeze();
            let (frame, used) = decode_frame(&bytes, &Limits::default()).expect("decodes");
            assert_eq!(used, bytes.len());
            assert_eq!(frame.stream_id, 77);
            let Message::Publish(p) = &frame.message else {
                panic!("not a publish: {frame:?}");
            };
            assert_eq!(p.topic(), &topic);
            assert_eq!(p.ext.offset, Some(42));
            assert_eq!(p.ext.attempt, Some(3));
            assert_eq!(p.ext.trace, Some(trace));
            assert_eq!(&p.body[..], b"hello");
            // Byte-identical to the generic encoder.
            assert_eq!(frame.to_bytes(), bytes);
            assert_eq!(shared.extensions().expect("valid").offset, Some(42));
        }
    }
}
