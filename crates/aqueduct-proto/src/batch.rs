//! PUBLISH_BATCH: a payload that is a flat sequence of complete PUBLISH frames.
//!
//! [`BatchIter`] walks the sub-frames of a batch payload, yielding borrowed [`RawFrameRef`]s
//! (header + extension block + payload as slices of the batch) without allocating or touching a
//! reference count. [`crate::PublishBatch::publishes`] builds on it to give owned
//! [`crate::Publish`] values whose bytes are `Bytes::slice`s of the batch buffer.

use crate::error::{DecodeError, ProtoError};
use crate::ext::MAX_EXT_LEN;
use crate::header::{FrameHeader, Opcode, RawHeader, HEADER_LEN};

/// One sub-frame of a batch, borrowed from the batch payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawFrameRef<'a> {
    pub header: FrameHeader,
    /// Extension entries (without the `ext_len` prefix); empty when there is no block.
    pub ext_block: &'a [u8],
    pub payload: &'a [u8],
    /// Byte offset of the sub-frame's header within the batch payload.
    pub offset: usize,
    /// Byte offset of `ext_block` within the batch payload.
    pub ext_offset: usize,
    /// Byte offset of `payload` within the batch payload.
    pub payload_offset: usize,
}

/// Split a frame's data (the bytes after the header) into extension block and payload, returning
/// their offsets within `data`: `(ext_start, ext_end)`; the payload is `data[ext_end..]`.
#[inline]
pub(crate) fn split_data(header: &FrameHeader, data: &[u8]) -> Result<(usize, usize), ProtoError> {
    if !header.has_extensions {
        return Ok((0, 0));
    }
    let Some(&[lo, hi]) = data.first_chunk::<2>() else {
        return Err(ProtoError::MissingExtLen {
            data_len: header.data_len,
        });
    };
    let ext_len = usize::from(u16::from_le_bytes([lo, hi]));
    if ext_len > MAX_EXT_LEN {
        return Err(ProtoError::ExtensionBlockTooLarge {
            len: ext_len,
            max: MAX_EXT_LEN,
        });
    }
    if 2 + ext_len > data.len() {
        return Err(ProtoError::ExtensionBlockOverrun {
            ext_len,
            available: data.len() - 2,
        });
    }
    Ok((2, 2 + ext_len))
}

/// Iterates over the sub-frames of a PUBLISH_BATCH payload. Stops after the first error.
#[derive(Debug, Clone)]
pub struct BatchIter<'a> {
    buf: &'a [u8],
    at: usize,
    index: usize,
    failed: bool,
}

impl<'a> BatchIter<'a> {
    pub fn new(payload: &'a [u8]) -> Self {
        BatchIter {
            buf: payload,
            at: 0,
            index: 0,
            failed: false,
        }
    }

    #[inline]
    fn next_frame(&mut self) -> Result<RawFrameRef<'a>, ProtoError> {
        let offset = self.at;
        let rest = &self.buf[offset..];
        let raw = match RawHeader::parse(rest) {
            Ok(raw) => raw,
            Err(DecodeError::Invalid(e)) => return Err(e),
            Err(DecodeError::Incomplete { need, have }) => {
                return Err(ProtoError::BadPayload {
                    opcode: "PUBLISH_BATCH",
                    problem: "sub-frame header cut short",
                    len: have.min(need),
                })
            }
        };
        let header = raw.validate()?;
        if header.opcode != Opcode::Publish {
            return Err(ProtoError::BadPayload {
                opcode: "PUBLISH_BATCH",
                problem: "sub-frames must be PUBLISH frames",
                len: rest.len(),
            });
        }
        if header.mesh_forwarded {
            // A PUBLISH with this bit is refused on its own (only cluster peers set it), so it
            // is no valid sub-frame either.
            return Err(ProtoError::BadPayload {
                opcode: "PUBLISH_BATCH",
                problem: "sub-frames must not set the MeshForwarded bit (0x80)",
                len: rest.len(),
            });
        }
        let Some(data) = rest.get(HEADER_LEN..raw.frame_len()) else {
            return Err(ProtoError::BadPayload {
                opcode: "PUBLISH_BATCH",
                problem: "sub-frame data runs past the end of the batch",
                len: rest.len(),
            });
        };
        let (ext_start, ext_end) = split_data(&header, data)?;
        let base = offset + HEADER_LEN;
        self.at = offset + raw.frame_len();
        Ok(RawFrameRef {
            header,
            ext_block: &data[ext_start..ext_end],
            payload: &data[ext_end..],
            offset,
            ext_offset: base + ext_start,
            payload_offset: base + ext_end,
        })
    }
}

impl<'a> Iterator for BatchIter<'a> {
    type Item = Result<RawFrameRef<'a>, ProtoError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.at >= self.buf.len() {
            return None;
        }
        let index = self.index;
        let offset = self.at;
        self.index += 1;
        match self.next_frame() {
            Ok(frame) => Some(Ok(frame)),
            Err(source) => {
                self.failed = true;
                Some(Err(ProtoError::BadBatchEntry {
                    index,
                    offset,
                    reason: Box::new(source),
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::write_header;

    fn sub(payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_header(&mut out, 0x01, 0, payload.len() as u32);
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn walks_sub_frames() {
        let mut batch = sub(b"a");
        batch.extend(sub(b"bc"));
        let frames: Vec<_> = BatchIter::new(&batch)
            .collect::<Result<_, _>>()
            .expect("ok");
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].payload, b"a");
        assert_eq!(frames[1].payload, b"bc");
        assert_eq!(frames[1].offset, 11);
        assert_eq!(frames[1].payload_offset, 21);
    }

    #[test]
    fn rejects_bad_sub_frames() {
        let mut batch = sub(b"a");
        batch.extend_from_slice(&[0x1F, 0x01, 0, 0]);
        let results: Vec<_> = BatchIter::new(&batch).collect();
        assert_eq!(results.len(), 2);
        assert!(matches!(
            &results[1],
            Err(ProtoError::BadBatchEntry {
                index: 1,
                offset: 11,
                ..
            })
        ));

        let mut nested = Vec::new();
        write_header(&mut nested, 0x04, 0, 0);
        let err = BatchIter::new(&nested).next().expect("one item");
        assert!(err.is_err());

        let mut flagged = sub(b"a");
        flagged[1] |= crate::header::FLAG_MESH_FORWARDED;
        let err = BatchIter::new(&flagged).next().expect("one item");
        assert!(
            err.is_err_and(|e| e.to_string().contains("MeshForwarded")),
            "a sub-frame with the MeshForwarded bit is refused"
        );

        let mut overrun = Vec::new();
        write_header(&mut overrun, 0x01, 0, 50);
        assert!(BatchIter::new(&overrun).next().expect("one").is_err());
        assert_eq!(BatchIter::new(&[]).count(), 0);
    }
}
