//! Frames from a receive stream (QUIC or WebTransport): read in chunks, decode with `aqueduct-proto`.

use aqueduct_proto::frame::{split_frame, Confirm, Message};
use aqueduct_proto::{DecodeError, Frame, FrameHeader, Limits, Opcode, HEADER_LEN};
use bytes::{Buf, Bytes, BytesMut};
use tracing::warn;

use crate::error::ClientError;

/// Largest frame the client accepts from a broker.
const MAX_FRAME: u32 = 16 << 20;

/// A whole frame from the broker that did not decode; the stream goes on after it.
#[derive(Debug)]
pub(crate) struct BadFrame {
    pub stream_id: u32,
    pub error: ClientError,
}

pub(crate) struct FrameReader {
    recv: crate::link::RecvHalf,
    buf: BytesMut,
}

impl FrameReader {
    pub(crate) fn new(recv: crate::link::RecvHalf) -> Self {
        FrameReader {
            recv,
            buf: BytesMut::new(),
        }
    }

    /// The next buffered frame's validated header and data (not decoded); `Ok(None)` if none
    /// is complete.
    pub(crate) fn try_next_raw(&mut self) -> Result<Option<(FrameHeader, Bytes)>, ClientError> {
        let Some((header, len)) = self.peek_raw()? else {
            return Ok(None);
        };
        let mut data = self.buf.split_to(len);
        data.advance(HEADER_LEN);
        Ok(Some((header, data.freeze())))
    }

    /// The next buffered frame's validated header and its length (header included), left in
    /// the buffer: read it with [`Self::frame_data`], then [`Self::consume`] it. `Ok(None)` if
    /// none is complete. A frame with an opcode this client does not know (one a later broker
    /// added) is skipped, as protocol.md §10 says a receiver does with a whole frame it cannot
    /// take; only a lost frame boundary (bad magic, a frame above the limit) is an error.
    pub(crate) fn peek_raw(&mut self) -> Result<Option<(FrameHeader, usize)>, ClientError> {
        let limits = Limits {
            max_data_len: MAX_FRAME,
        };
        loop {
            match split_frame(&self.buf, &limits) {
                Ok(raw) => match raw.validate() {
                    Ok(header) => return Ok(Some((header, raw.frame_len()))),
                    Err(e) => {
                        warn!(
                            stream_id = raw.stream_id,
                            "skipping a frame from the broker this client cannot read: {e}"
                        );
                        self.buf.advance(raw.frame_len());
                    }
                },
                Err(DecodeError::Incomplete { .. }) => return Ok(None),
                Err(DecodeError::Invalid(e)) => {
                    // The frame boundary is lost: nothing more of the stream can be read.
                    // STOP_SENDING (with the error's code) tells the broker to stop writing it,
                    // as protocol.md §13 asks; left open, it filled the stream's window.
                    self.recv.stop(e.code().0);
                    self.buf = BytesMut::new();
                    return Err(ClientError::Protocol(e));
                }
            }
        }
    }

    /// The data (after the header) of the frame [`Self::peek_raw`] returned `frame_len` for.
    pub(crate) fn frame_data(&self, frame_len: usize) -> &[u8] {
        &self.buf[HEADER_LEN..frame_len]
    }

    /// Drop the frame [`Self::peek_raw`] returned `frame_len` for from the buffer.
    pub(crate) fn consume(&mut self, frame_len: usize) {
        self.buf.advance(frame_len);
    }

    /// One read from the stream into the buffer; `Ok(false)` at a clean end of stream.
    pub(crate) fn poll_read_more(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<bool, ClientError>> {
        // Small while idle; reserve grows the buffer as data comes in.
        if self.buf.capacity() - self.buf.len() < 4 * 1024 {
            self.buf
                .reserve((self.buf.capacity() * 2).clamp(8 * 1024, 64 * 1024));
        }
        let read = std::task::ready!(tokio_util::io::poll_read_buf(
            std::pin::Pin::new(&mut self.recv),
            cx,
            &mut self.buf
        ));
        std::task::Poll::Ready(match read {
            Ok(0) if self.buf.is_empty() => Ok(false),
            Ok(0) => Err(ClientError::Connection(format!(
                "stream ended inside a frame ({} bytes left)",
                self.buf.len()
            ))),
            Ok(_) => Ok(true),
            Err(e) => Err(crate::error::io_read_error(&e)),
        })
    }

    /// The next frame; `Ok(None)` when the broker finished the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, ClientError> {
        match self.next_frame(false).await? {
            Some(Ok(frame)) => Ok(Some(frame)),
            Some(Err(bad)) => Err(bad.error),
            None => Ok(None),
        }
    }

    /// As [`Self::next`], except that a whole frame that does not decode (a bad payload or
    /// extension) is returned as a [`BadFrame`], past which the stream can still be read.
    pub(crate) async fn next_or_bad(
        &mut self,
    ) -> Result<Option<Result<Frame, BadFrame>>, ClientError> {
        self.next_frame(false).await
    }

    /// The next frame on a stream of SUBSCRIBEs, as [`Self::next`] except that any CONFIRM is
    /// a confirmation (protocol.md §7.1: "whatever its data"): one that does not decode comes
    /// back listing none, which says nothing about where it is served from.
    pub(crate) async fn next_subscribe_answer(&mut self) -> Result<Option<Frame>, ClientError> {
        match self.next_frame(true).await? {
            Some(Ok(frame)) => Ok(Some(frame)),
            Some(Err(bad)) => Err(bad.error),
            None => Ok(None),
        }
    }

    async fn next_frame(
        &mut self,
        any_confirm: bool,
    ) -> Result<Option<Result<Frame, BadFrame>>, ClientError> {
        loop {
            if let Some((header, data)) = self.try_next_raw()? {
                if any_confirm && header.opcode == Opcode::Confirm {
                    // Whatever its data: one that does not decode (not whole u64s, an
                    // extension block this client cannot read) lists none.
                    let frame = Frame::decode(&header, data).unwrap_or_else(|_| {
                        let confirm = Confirm {
                            offsets: Vec::new(),
                        };
                        Frame::new(header.stream_id, Message::Confirm(confirm))
                    });
                    return Ok(Some(Ok(frame)));
                }
                return Ok(Some(Frame::decode(&header, data).map_err(|e| BadFrame {
                    stream_id: header.stream_id,
                    error: e.into(),
                })));
            }
            if !std::future::poll_fn(|cx| self.poll_read_more(cx)).await? {
                return Ok(None);
            }
        }
    }
}
