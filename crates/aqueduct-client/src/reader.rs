//! Frames from a QUIC receive stream: read in chunks, decode with `aqueduct-proto`.

use aqueduct_proto::frame::split_frame;
use aqueduct_proto::{DecodeError, Frame, Limits, HEADER_LEN};
use bytes::{Buf, BytesMut};
use tokio::io::AsyncReadExt;

use crate::error::ClientError;

/// Largest frame the client accepts from a broker.
const MAX_FRAME: u32 = 16 << 20;

pub(crate) struct FrameReader {
    recv: quinn::RecvStream,
    buf: BytesMut,
}

impl FrameReader {
    pub(crate) fn new(recv: quinn::RecvStream) -> Self {
        FrameReader {
            recv,
            buf: BytesMut::new(),
        }
    }

    /// A frame already buffered, without reading; `Ok(None)` if none is complete.
    pub(crate) fn try_next(&mut self) -> Result<Option<Frame>, ClientError> {
        let limits = Limits {
            max_data_len: MAX_FRAME,
        };
        match split_frame(&self.buf, &limits) {
            Ok(raw) => {
                let mut data = self.buf.split_to(raw.frame_len()).freeze();
                data.advance(HEADER_LEN);
                let header = raw.validate()?;
                Ok(Some(Frame::decode(&header, data)?))
            }
            Err(DecodeError::Incomplete { .. }) => Ok(None),
            Err(DecodeError::Invalid(e)) => Err(ClientError::Protocol(e)),
        }
    }

    /// The next frame; `Ok(None)` when the broker finished the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, ClientError> {
        loop {
            if let Some(frame) = self.try_next()? {
                return Ok(Some(frame));
            }
            // Small while idle; reserve grows the buffer as data comes in.
            if self.buf.capacity() - self.buf.len() < 4 * 1024 {
                self.buf
                    .reserve((self.buf.capacity() * 2).clamp(8 * 1024, 64 * 1024));
            }
            match self.recv.read_buf(&mut self.buf).await {
                Ok(0) if self.buf.is_empty() => return Ok(None),
                Ok(0) => {
                    return Err(ClientError::Connection(format!(
                        "stream ended inside a frame ({} bytes left)",
                        self.buf.len()
                    )))
                }
                Ok(_) => {}
                Err(e) => return Err(ClientError::Connection(e.to_string())),
            }
        }
    }
}
