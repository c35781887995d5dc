//! The client's link to the broker: a QUIC connection with ALPN `aqueduct-v1`, or a WebTransport
//! session (HTTP/3, as a browser connects: `docs/protocol.md` §12) on the same UDP port. Both
//! carry the same frames on bidirectional streams; only opening a stream, error codes and
//! closing differ, and that is all this module hides.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::error::ClientError;

/// How a client reaches the broker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Transport {
    /// QUIC with ALPN `aqueduct-v1` (the default).
    #[default]
    Quic,
    /// A WebTransport session at this path (the broker's `webtransport.path_prefix`,
    /// `/aqueduct/wt` by default), as browsers connect.
    WebTransport { path: String },
}

#[derive(Debug)]
pub(crate) enum Kind {
    Quic(quinn::Connection),
    WebTransport(Box<web_transport_quinn::Session>),
}

/// The connection (or WebTransport session) to the broker.
#[derive(Debug)]
pub(crate) struct Link {
    kind: Kind,
    /// How long opening a stream may wait (the connect timeout).
    open_wait: std::time::Duration,
}

impl Link {
    pub(crate) fn new(kind: Kind, open_wait: std::time::Duration) -> Link {
        Link { kind, open_wait }
    }

    /// A new bidirectional stream. The broker allows a number of them at once per connection
    /// (`transport.max_streams_per_connection`); past it, opening one waits until another
    /// ends, and this waits at most the connect timeout for that, then says why: a
    /// `subscribe` past the limit hung for ever.
    pub(crate) async fn open_bi(&self) -> Result<(SendHalf, RecvHalf), ClientError> {
        let opened = async {
            match &self.kind {
                Kind::Quic(c) => c
                    .open_bi()
                    .await
                    .map(|(s, r)| (SendHalf::Quic(s), RecvHalf::Quic(r)))
                    .map_err(|e| crate::error::connection_error(&e)),
                Kind::WebTransport(s) => s
                    .open_bi()
                    .await
                    .map(|(s, r)| (SendHalf::WebTransport(s), RecvHalf::WebTransport(r)))
                    .map_err(|e| wt_session_error(&e)),
            }
        };
        tokio::time::timeout(self.open_wait, opened)
            .await
            .map_err(|_| {
                // Over WebTransport, opening a stream also writes its header, which waits for
                // the connection's flow control too.
                let or_flow = match self.kind {
                    Kind::Quic(_) => "",
                    Kind::WebTransport(_) => {
                        "; or the broker is not reading this connection's streams (their \
                         data fills the connection's flow-control window)"
                    }
                };
                ClientError::Timeout(format!(
                    "no stream could be opened within {:?}: every stream the broker allows \
                     this connection is in use (transport.max_streams_per_connection, 256 by \
                     default; each subscription and publisher holds one): close some, or put \
                     several subscriptions on one stream with subscribe_many{or_flow}",
                    self.open_wait
                ))
            })?
    }

    /// The QUIC connection under it.
    pub(crate) fn quic(&self) -> &quinn::Connection {
        match &self.kind {
            Kind::Quic(c) => c,
            Kind::WebTransport(s) => s,
        }
    }

    pub(crate) fn remote_address(&self) -> SocketAddr {
        self.quic().remote_address()
    }

    /// Wait until the connection (or session) ends: [`ClientError::Closed`] if this side closed
    /// it first, else why the broker closed it or it was lost. Over WebTransport the session's
    /// own record (the first close, local or the broker's capsule), not the QUIC connection's:
    /// a capsule from the broker makes this side close QUIC, and this side's close waits for
    /// the broker to close it.
    pub(crate) async fn closed(&self) -> ClientError {
        match &self.kind {
            Kind::Quic(c) => match c.closed().await {
                quinn::ConnectionError::LocallyClosed => ClientError::Closed,
                e => crate::error::connection_error(&e),
            },
            Kind::WebTransport(s) => wt_session_error(&s.closed().await),
        }
    }

    pub(crate) fn close(&self, reason: &[u8]) {
        match &self.kind {
            Kind::Quic(c) => c.close(0u32.into(), reason),
            Kind::WebTransport(s) => s.close(0, reason),
        }
    }
}

/// A stream's sending half.
#[derive(Debug)]
pub(crate) enum SendHalf {
    Quic(quinn::SendStream),
    WebTransport(web_transport_quinn::SendStream),
}

impl SendHalf {
    /// Write as much of `chunks` as the stream takes now (waiting until it takes some). Fully
    /// written chunks are left empty and a partly written one is advanced, in place.
    /// Cancel-safe: if this does not resolve, nothing was written.
    async fn write_chunks(&mut self, chunks: &mut [Bytes]) -> Result<usize, ClientError> {
        match self {
            SendHalf::Quic(s) => s
                .write_chunks(chunks)
                .await
                .map(|w| w.chunks)
                .map_err(|e| crate::error::write_error(&e)),
            SendHalf::WebTransport(s) => s
                .write_chunks(chunks)
                .await
                .map(|w| w.chunks)
                .map_err(|e| wt_write_error(&e)),
        }
    }

    /// Abandon the sending side (RESET_STREAM with `code`); nothing if it already ended.
    fn reset(&mut self, code: u16) {
        match self {
            SendHalf::Quic(s) => {
                let _ = s.reset(code.into());
            }
            SendHalf::WebTransport(s) => {
                let _ = s.reset(code.into());
            }
        }
    }

    /// Finish the sending side (FIN).
    fn finish(&mut self) -> Result<(), ClientError> {
        let done = match self {
            SendHalf::Quic(s) => s.finish().map_err(|e| e.to_string()),
            SendHalf::WebTransport(s) => s.finish().map_err(|e| e.to_string()),
        };
        done.map_err(ClientError::Connection)
    }
}

/// A stream's sending half that never leaves part of a frame on the stream followed by another
/// frame, even when the future writing it is dropped (a `select!`, a timeout).
///
/// QUIC writes are partial: a frame larger than the flow-control credit the broker has granted
/// goes out in pieces, with waits between them. A write cancelled after its first piece would
/// leave the stream inside a frame, and the next frame's bytes would be read as the rest of it
/// (the broker then answers BAD_MAGIC or MALFORMED_FRAME and resets the stream). So what a call
/// has not written yet stays queued here, and the next write (or `finish`) sends it first.
/// A frame is queued whole before any of it is written, so a cancelled frame is either not sent
/// at all or sent whole.
#[derive(Debug)]
pub(crate) struct FrameSink {
    half: SendHalf,
    /// Chunks of frames accepted by an earlier call but not written yet, in order.
    unsent: Vec<Bytes>,
}

impl FrameSink {
    pub(crate) fn new(half: SendHalf) -> FrameSink {
        FrameSink {
            half,
            unsent: Vec::new(),
        }
    }

    /// Queue `chunks` (whole frames) behind anything not written yet. Queued chunks are
    /// written by the next `write_queued`, `send` or `finish`, whichever call gets there.
    pub(crate) fn queue(&mut self, chunks: impl IntoIterator<Item = Bytes>) {
        self.unsent
            .extend(chunks.into_iter().filter(|c| !c.is_empty()));
    }

    /// Write what earlier, cancelled calls left queued, then queue `chunks` and write them. A
    /// call cancelled in the first wait has queued nothing: cancelled calls cannot pile up
    /// frames (each to be sent later) while the stream does not move.
    pub(crate) async fn send(
        &mut self,
        chunks: impl IntoIterator<Item = Bytes>,
    ) -> Result<(), ClientError> {
        self.write_queued().await?;
        self.queue(chunks);
        self.write_queued().await
    }

    /// Write everything queued. Cancel-safe: what a cancelled call did not write stays queued.
    pub(crate) async fn write_queued(&mut self) -> Result<(), ClientError> {
        while !self.unsent.is_empty() {
            // Each call either writes something (and the queue is updated before any further
            // wait) or nothing: the queue always holds exactly what is still to be written.
            let done = self.half.write_chunks(&mut self.unsent).await?;
            self.unsent.drain(..done);
        }
        Ok(())
    }

    /// Write whatever is still queued, then finish the sending side (FIN).
    pub(crate) async fn finish(&mut self) -> Result<(), ClientError> {
        self.write_queued().await?;
        self.half.finish()
    }

    /// Finish the sending side now if nothing is queued (no wait); whether it did.
    pub(crate) fn finish_now(&mut self) -> bool {
        self.unsent.is_empty() && self.half.finish().is_ok()
    }

    /// Abandon the stream (RESET_STREAM with `code`), dropping what is still queued: the
    /// peer reads no part of a frame as a whole one.
    pub(crate) fn reset(&mut self, code: u16) {
        self.unsent.clear();
        self.half.reset(code);
    }
}

impl Drop for FrameSink {
    fn drop(&mut self) {
        if self.unsent.is_empty() {
            return;
        }
        // Dropped with part of a cancelled frame still queued: write what the stream takes
        // without waiting. If some is still left, the stream ends inside that frame (quinn
        // finishes a dropped stream) and the broker reports the truncated frame; the whole
        // frames before it were handled.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut write = std::pin::pin!(self.write_queued());
        let _ = write.as_mut().poll(&mut cx);
    }
}

/// A stream's receiving half.
#[derive(Debug)]
pub(crate) enum RecvHalf {
    Quic(quinn::RecvStream),
    WebTransport(web_transport_quinn::RecvStream),
}

impl RecvHalf {
    /// Stop reading (STOP_SENDING with `code`); nothing if the stream already ended.
    pub(crate) fn stop(&mut self, code: u16) {
        match self {
            RecvHalf::Quic(r) => {
                let _ = r.stop(code.into());
            }
            RecvHalf::WebTransport(r) => {
                let _ = r.stop(code.into());
            }
        }
    }
}

impl tokio::io::AsyncRead for RecvHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            RecvHalf::Quic(r) => Pin::new(r).poll_read(cx, buf),
            RecvHalf::WebTransport(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

/// A session's end as a client error: [`ClientError::Closed`] if this side closed it (as over
/// QUIC, `error::connection_error`), else what ended it.
fn wt_session_error(e: &web_transport_quinn::SessionError) -> ClientError {
    match e {
        web_transport_quinn::SessionError::ConnectionError(
            quinn::ConnectionError::LocallyClosed,
        ) => ClientError::Closed,
        e => ClientError::Connection(session_error(e)),
    }
}

fn session_error(e: &web_transport_quinn::SessionError) -> String {
    match e {
        web_transport_quinn::SessionError::ConnectionError(c) => {
            crate::error::describe_connection_error(c)
        }
        other => other.to_string(),
    }
}

fn wt_write_error(e: &web_transport_quinn::WriteError) -> ClientError {
    // This side let go of the stream (as over QUIC, `error::write_error`): not a lost
    // connection.
    if matches!(e, web_transport_quinn::WriteError::ClosedStream) {
        return ClientError::Closed;
    }
    ClientError::Connection(match e {
        web_transport_quinn::WriteError::Stopped(code) => format!(
            "the broker stopped reading the stream with {}",
            crate::error::app_code(u64::from(*code))
        ),
        web_transport_quinn::WriteError::SessionError(s) => return wt_session_error(s),
        other => other.to_string(),
    })
}
