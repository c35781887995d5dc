//! Deliveries encoded once, shared by every subscriber.
//!
//! A delivery is a PUBLISH frame from broker to subscriber whose extension block carries the
//! concrete topic, the per-topic offset, the priority and the attempt number. Everything but the
//! header (whose `stream_id` names the subscription) and the attempt entry is the same for every
//! subscriber, so the broker encodes it once into a [`SharedDelivery`] — a reference-counted
//! buffer — and each subscriber's writer adds its own 18-byte prefix (header, `ext_len`, and the
//! ATTEMPT entry, which the canonical order puts first) while copying into its coalescing buffer
//! ([`SharedDelivery::write_frame`]).
//!
//! The bytes written are exactly what [`crate::Frame::encode`] produces for the same delivery.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::ProtoError;
use crate::ext::{reason_len, types, Compression, Extensions, Priority, TraceContext};
use crate::header::{Opcode, FLAG_HAS_EXTENSIONS, HEADER_LEN, MAGIC};
use crate::topic::TopicName;

/// Size of an encoding arena block.
pub const ARENA_CHUNK: usize = 64 * 1024;

/// Where a publisher encodes deliveries: two blocks used in turn.
///
/// Each delivery is cut from the current block (`BytesMut::split`, a reference count, no copy,
/// no allocation). When the current block is full it is reused if every delivery cut from it has
/// been dropped; otherwise the publisher switches to the spare block, which was filled before the
/// current one and so has most likely been drained by then. A new block is allocated only when
/// both are still referenced, i.e. when subscribers hold more than a block's worth of this
/// publisher's messages.
#[derive(Debug, Default)]
pub struct Arena {
    current: BytesMut,
    spare: BytesMut,
}

impl Arena {
    fn make_room(&mut self, need: usize) -> &mut BytesMut {
        if self.current.capacity() - self.current.len() < need && !self.current.try_reclaim(need) {
            std::mem::swap(&mut self.current, &mut self.spare);
            if !self.current.try_reclaim(need) {
                self.current.reserve(need.max(ARENA_CHUNK));
            }
        }
        &mut self.current
    }
}

/// Where a dead-lettered message came from (carried on `__dlq__<topic>` deliveries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// `[extension entries except ATTEMPT][body]`
    bytes: Bytes,
    /// Length of the shared extension entries.
    ext_len: u16,
    /// The trace context names a span made by another process (a cluster peer's `publish`
    /// span): what a `deliver` span made here records as a remote parent. Not on the wire.
    remote_trace: bool,
}

/// Size of the per-subscriber ATTEMPT entry.
const ATTEMPT_ENTRY: usize = 6;
/// Header + `ext_len` + ATTEMPT entry: what [`SharedDelivery::write_frame`] writes per subscriber.
const PREFIX_LEN: usize = HEADER_LEN + 2 + ATTEMPT_ENTRY;

impl std::fmt::Debug for SharedDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDelivery")
            .field("ext_len", &self.ext_len)
            .field("body_len", &self.body_len())
            .finish()
    }
}

impl SharedDelivery {
    /// Encode `fields` into `arena` and split the result off as a shared buffer. No allocation
    /// in steady state (see [`Arena`]).
    pub fn encode(arena: &mut Arena, fields: &DeliveryFields<'_>) -> SharedDelivery {
        let fixed = fields.trace.map_or(0, |_| 27)
            + fields.compression.map_or(0, |_| 7)
            + 5
            + fields.topic.len()
            + 10;
        let post_len = fields.dead_letter.as_ref().map_or(0, |d| {
            2 + d.original_topic.len() + 10 + 2 + reason_len(d.reason) + 6
        });
        let arena = arena.make_room(fixed + post_len + fields.body.len());
        if let Some(t) = fields.trace {
            let mut e = [0u8; 27];
            e[0] = types::TRACE;
            e[1] = 25;
            e[2..18].copy_from_slice(&t.trace_id);
            e[18..26].copy_from_slice(&t.span_id);
            e[26] = t.flags;
            arena.put_slice(&e);
        }
        if let Some(c) = fields.compression {
            let mut e = [types::COMPRESSION, 5, c.algorithm, 0, 0, 0, 0];
            e[3..].copy_from_slice(&c.uncompressed_len.to_le_bytes());
            arena.put_slice(&e);
        }
        // TopicName guarantees 1..=255 bytes, so the length fits in u8.
        arena.put_slice(&[
            types::PRIORITY,
            1,
            fields.priority.level(),
            types::TOPIC,
            fields.topic.len() as u8,
        ]);
        arena.put_slice(fields.topic.as_bytes());
        let mut e = [types::OFFSET, 8, 0, 0, 0, 0, 0, 0, 0, 0];
        e[2..].copy_from_slice(&fields.offset.to_le_bytes());
        arena.put_slice(&e);
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
            ext_len: (fixed + post_len) as u16,
            remote_trace: false,
        }
    }

    /// The same delivery, its trace context marked as made by another process when `remote`
    /// (see [`trace_is_remote`](Self::trace_is_remote)).
    pub fn with_remote_trace(mut self, remote: bool) -> SharedDelivery {
        self.remote_trace = remote && self.trace().is_some();
        self
    }

    /// Whether the trace context names a span made by another process (a cluster peer): set
    /// with [`with_remote_trace`](Self::with_remote_trace), never read from the wire.
    pub fn trace_is_remote(&self) -> bool {
        self.remote_trace
    }

    /// The message's trace context, if it carries one (read from the shared bytes, where its
    /// entry comes first).
    pub fn trace(&self) -> Option<TraceContext> {
        let e = self.bytes.get(..27)?;
        if usize::from(self.ext_len) < 27 || e[0] != types::TRACE || e[1] != 25 {
            return None;
        }
        let mut t = TraceContext {
            trace_id: [0; 16],
            span_id: [0; 8],
            flags: e[26],
        };
        t.trace_id.copy_from_slice(&e[2..18]);
        t.span_id.copy_from_slice(&e[18..26]);
        Some(t)
    }

    /// Length of the frame [`write_frame`](Self::write_frame) writes.
    pub fn frame_len(&self) -> usize {
        PREFIX_LEN + self.bytes.len()
    }

    /// Append the full delivery frame for one subscriber: an 18-byte prefix (header, `ext_len`,
    /// ATTEMPT entry) and the shared bytes.
    pub fn write_frame<B: BufMut>(&self, out: &mut B, stream_id: u32, attempt: u32) {
        let data_len = (2 + ATTEMPT_ENTRY + self.bytes.len()) as u32;
        let ext_len = self.ext_len + ATTEMPT_ENTRY as u16;
        let mut p = [0u8; PREFIX_LEN];
        p[0] = MAGIC;
        p[1] = Opcode::Publish as u8 | FLAG_HAS_EXTENSIONS;
        p[2..6].copy_from_slice(&stream_id.to_le_bytes());
        p[6..10].copy_from_slice(&data_len.to_le_bytes());
        p[10..12].copy_from_slice(&ext_len.to_le_bytes());
        p[12] = types::ATTEMPT;
        p[13] = 4;
        p[14..18].copy_from_slice(&attempt.to_le_bytes());
        out.put_slice(&p);
        out.put_slice(&self.bytes);
    }

    /// Append the delivery in the seed's form, for subscriptions made the seed's way (a
    /// SUBSCRIBE without an extension block): the body is the whole payload, and only the
    /// extensions that travel end to end are kept — TRACE and COMPRESSION when the message has
    /// them, PRIORITY when it is not the default (2). With none of those the frame is a bare
    /// PUBLISH (command 0x01). No TOPIC, OFFSET, ATTEMPT or dead-letter entries.
    pub fn write_seed_frame<B: BufMut>(&self, out: &mut B, stream_id: u32) {
        let ext = &self.bytes[..usize::from(self.ext_len)];
        // The canonical order puts TRACE, then COMPRESSION, then PRIORITY first.
        let mut at = 0;
        for (kind, len) in [(types::TRACE, 27), (types::COMPRESSION, 7)] {
            if ext.get(at) == Some(&kind) {
                at += len;
            }
        }
        let carried = &ext[..at.min(ext.len())];
        let priority = match ext.get(at..at + 3) {
            Some([types::PRIORITY, 1, level]) if *level != Priority::DEFAULT.level() => {
                Some([types::PRIORITY, 1, *level])
            }
            _ => None,
        };
        let body = &self.bytes[usize::from(self.ext_len)..];
        let entries = carried.len() + priority.map_or(0, |p| p.len());
        if entries == 0 {
            crate::header::write_header(out, Opcode::Publish as u8, stream_id, body.len() as u32);
        } else {
            crate::header::write_header(
                out,
                Opcode::Publish as u8 | FLAG_HAS_EXTENSIONS,
                stream_id,
                (2 + entries + body.len()) as u32,
            );
            out.put_u16_le(entries as u16);
            out.put_slice(carried);
            if let Some(p) = priority {
                out.put_slice(&p);
            }
        }
        out.put_slice(body);
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
        let mut arena = Arena::default();
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
            assert_eq!(shared.trace(), Some(trace));
            // Marking the context remote changes nothing on the wire.
            assert!(!shared.trace_is_remote());
            let remote = shared.clone().with_remote_trace(true);
            assert!(remote.trace_is_remote());
            let mut again = BytesMut::new();
            remote.write_frame(&mut again, 77, 3);
            assert_eq!(again.freeze(), bytes);
        }
        // Without a TRACE entry there is none to read, even when the body looks like one.
        let mut body = vec![types::TRACE, 25];
        body.extend_from_slice(&[9; 25]);
        let untraced = SharedDelivery::encode(
            &mut arena,
            &DeliveryFields {
                topic: &topic,
                offset: 1,
                priority: Priority::DEFAULT,
                trace: None,
                compression: None,
                dead_letter: None,
                body: &body,
            },
        );
        assert_eq!(untraced.trace(), None);
        assert!(
            !untraced.with_remote_trace(true).trace_is_remote(),
            "no context to be remote"
        );
    }

    #[test]
    fn seed_form_is_the_body_with_end_to_end_extensions_only() {
        let topic = TopicName::try_from("orders").expect("valid");
        let trace = TraceContext {
            trace_id: [7; 16],
            span_id: [8; 8],
            flags: 1,
        };
        let mut arena = Arena::default();
        let encode = |arena: &mut Arena, priority, trace| {
            SharedDelivery::encode(
                arena,
                &DeliveryFields {
                    topic: &topic,
                    offset: 5,
                    priority,
                    trace,
                    compression: None,
                    dead_letter: None,
                    body: b"orders",
                },
            )
        };
        // A plain message: exactly the seed's bare PUBLISH, body as the whole payload.
        let mut out = BytesMut::new();
        encode(&mut arena, Priority::DEFAULT, None).write_seed_frame(&mut out, 3);
        assert_eq!(
            &out[..],
            &[0x1F, 0x01, 3, 0, 0, 0, 6, 0, 0, 0, b'o', b'r', b'd', b'e', b'r', b's']
        );
        // Priority 0 and a trace travel; topic, offset and attempt do not.
        let mut out = BytesMut::new();
        encode(&mut arena, Priority::HIGHEST, Some(&trace)).write_seed_frame(&mut out, 3);
        let bytes = out.freeze();
        let (frame, used) = decode_frame(&bytes, &Limits::default()).expect("decodes");
        assert_eq!(used, bytes.len());
        assert_eq!(bytes[1], 0x41);
        let Message::Publish(p) = &frame.message else {
            panic!("not a publish: {frame:?}");
        };
        assert_eq!(&p.body[..], b"orders");
        assert_eq!(p.ext.priority, Some(Priority::HIGHEST));
        assert_eq!(p.ext.trace, Some(trace));
        assert_eq!(
            (p.ext.topic.as_ref(), p.ext.offset, p.ext.attempt),
            (None, None, None)
        );
    }
}
