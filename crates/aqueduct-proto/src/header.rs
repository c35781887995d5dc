//! The 10-byte frame header, fixed by the seed:
//!
//! ```text
//!  0      1        2               6               10
//! +------+--------+---------------+---------------+
//! | 0x1F | command| stream_id u32 | data_len u32  |   little-endian
//! +------+--------+---------------+---------------+
//! command = [MeshForwarded:1][HasExtensions:1][opcode:6]
//! ```
//! `data_len` counts every byte after the header: the extension block (when present) and the payload.

use bytes::BufMut;

use crate::error::{DecodeError, ProtoError};

/// The first byte of every frame.
pub const MAGIC: u8 = 0x1F;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 10;
/// Command bit 7: the frame was forwarded by another broker of the mesh; never forward it again.
pub const FLAG_MESH_FORWARDED: u8 = 0x80;
/// Command bit 6: an extension block follows the header.
pub const FLAG_HAS_EXTENSIONS: u8 = 0x40;
/// Command bits 0..=5: the opcode.
pub const OPCODE_MASK: u8 = 0x3F;

/// What a frame asks for. Values 0x01..=0x05 come from the seed; 0x06..=0x09 are Aqueduct's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Client → broker: publish one message. Broker → client: a delivery.
    Publish = 0x01,
    /// Client → broker: subscribe; the frame's stream becomes the delivery stream.
    Subscribe = 0x02,
    /// Client → broker: remove a subscription.
    Unsubscribe = 0x03,
    /// Client → broker: a sequence of complete PUBLISH frames.
    PublishBatch = 0x04,
    /// Client → broker: reject a delivery (redeliver, eventually dead-letter).
    Nack = 0x05,
    /// Client → broker: settle a delivery.
    Ack = 0x06,
    /// Broker → client: publish confirmation with the assigned offsets.
    Confirm = 0x07,
    /// Broker → client: a request failed.
    Error = 0x08,
    /// Client → broker: what does the broker allow? Broker → client: the answer (limits, its
    /// version).
    Info = 0x09,
}

impl Opcode {
    /// Every opcode, in numeric order.
    pub const ALL: [Opcode; 9] = [
        Opcode::Publish,
        Opcode::Subscribe,
        Opcode::Unsubscribe,
        Opcode::PublishBatch,
        Opcode::Nack,
        Opcode::Ack,
        Opcode::Confirm,
        Opcode::Error,
        Opcode::Info,
    ];

    /// Parse the low 6 bits of a command byte.
    #[inline]
    pub fn from_u8(value: u8) -> Option<Opcode> {
        Opcode::ALL.get(usize::from(value).wrapping_sub(1)).copied()
    }

    /// The protocol name, as in `docs/protocol.md`.
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Publish => "PUBLISH",
            Opcode::Subscribe => "SUBSCRIBE",
            Opcode::Unsubscribe => "UNSUBSCRIBE",
            Opcode::PublishBatch => "PUBLISH_BATCH",
            Opcode::Nack => "NACK",
            Opcode::Ack => "ACK",
            Opcode::Confirm => "CONFIRM",
            Opcode::Error => "ERROR",
            Opcode::Info => "INFO",
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub opcode: Opcode,
    pub mesh_forwarded: bool,
    pub has_extensions: bool,
    pub stream_id: u32,
    pub data_len: u32,
}

/// The fields of a header that only need the magic byte to be right: enough to skip a frame whose
/// opcode is unknown without losing the stream's frame boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawHeader {
    pub command: u8,
    pub stream_id: u32,
    pub data_len: u32,
}

impl RawHeader {
    /// Read the first [`HEADER_LEN`] bytes of `buf`.
    #[inline]
    pub fn parse(buf: &[u8]) -> Result<RawHeader, DecodeError> {
        let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
            if let Some(&found) = buf.first() {
                if found != MAGIC {
                    return Err(ProtoError::BadMagic { found }.into());
                }
            }
            return Err(DecodeError::Incomplete {
                need: HEADER_LEN,
                have: buf.len(),
            });
        };
        if h[0] != MAGIC {
            return Err(ProtoError::BadMagic { found: h[0] }.into());
        }
        Ok(RawHeader {
            command: h[1],
            stream_id: u32::from_le_bytes([h[2], h[3], h[4], h[5]]),
            data_len: u32::from_le_bytes([h[6], h[7], h[8], h[9]]),
        })
    }

    /// Total frame length (header + data).
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.data_len as usize
    }

    /// Interpret the command byte.
    #[inline]
    pub fn validate(&self) -> Result<FrameHeader, ProtoError> {
        let raw_opcode = self.command & OPCODE_MASK;
        // Not `ok_or(..)`: that would build (and drop) an error value on every valid frame.
        let Some(opcode) = Opcode::from_u8(raw_opcode) else {
            return Err(ProtoError::UnknownOpcode { opcode: raw_opcode });
        };
        Ok(FrameHeader {
            opcode,
            mesh_forwarded: self.command & FLAG_MESH_FORWARDED != 0,
            has_extensions: self.command & FLAG_HAS_EXTENSIONS != 0,
            stream_id: self.stream_id,
            data_len: self.data_len,
        })
    }
}

impl FrameHeader {
    /// The command byte: opcode plus flag bits.
    pub fn command(&self) -> u8 {
        let mut c = self.opcode as u8;
        if self.mesh_forwarded {
            c |= FLAG_MESH_FORWARDED;
        }
        if self.has_extensions {
            c |= FLAG_HAS_EXTENSIONS;
        }
        c
    }

    /// Append the 10 header bytes to `out`.
    pub fn encode<B: BufMut>(&self, out: &mut B) {
        write_header(out, self.command(), self.stream_id, self.data_len);
    }
}

/// Append a header given its raw fields.
pub fn write_header<B: BufMut>(out: &mut B, command: u8, stream_id: u32, data_len: u32) {
    let mut h = [0u8; HEADER_LEN];
    h[0] = MAGIC;
    h[1] = command;
    h[2..6].copy_from_slice(&stream_id.to_le_bytes());
    h[6..10].copy_from_slice(&data_len.to_le_bytes());
    out.put_slice(&h);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = FrameHeader {
            opcode: Opcode::Publish,
            mesh_forwarded: true,
            has_extensions: true,
            stream_id: 0x0403_0201,
            data_len: 0x0000_0105,
        };
        let mut out = Vec::new();
        h.encode(&mut out);
        assert_eq!(out, [0x1F, 0xC1, 1, 2, 3, 4, 5, 1, 0, 0]);
        let raw = RawHeader::parse(&out).expect("complete");
        assert_eq!(raw.validate(), Ok(h));
        assert_eq!(raw.frame_len(), 10 + 0x105);
    }

    #[test]
    fn header_errors() {
        assert_eq!(
            RawHeader::parse(&[0x1F, 1, 0]),
            Err(DecodeError::Incomplete { need: 10, have: 3 })
        );
        assert_eq!(
            RawHeader::parse(&[]),
            Err(DecodeError::Incomplete { need: 10, have: 0 })
        );
        // A wrong magic byte is rejected as soon as it is seen, not after 10 bytes arrive.
        assert_eq!(
            RawHeader::parse(&[0x20]),
            Err(DecodeError::Invalid(ProtoError::BadMagic { found: 0x20 }))
        );
        let raw = RawHeader::parse(&[0x1F, 0x3F, 0, 0, 0, 0, 0, 0, 0, 0]).expect("parses");
        assert_eq!(
            raw.validate(),
            Err(ProtoError::UnknownOpcode { opcode: 0x3F })
        );
        for op in 0..=0x3Fu8 {
            let known = Opcode::from_u8(op);
            assert_eq!(known.is_some(), (1..=9).contains(&op), "{op}");
            if let Some(o) = known {
                assert_eq!(o as u8, op);
            }
        }
    }
}
