//! The client's link to the broker: a QUIC connection with ALPN `aqueduct-v1`, or a WebTransport
//! session (HTTP/3, as a browser connects: `docs/protocol.md` §12) on the same UDP port. Both
//! carry the same frames on bidirectional streams; only opening a stream, error codes and
//! closing differ, and that is all this module hides.

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
pub(crate) enum Link {
    Quic(quinn::Connection),
    WebTransport(Box<web_transport_quinn::Session>),
}

impl Link {
    pub(crate) async fn open_bi(&self) -> Result<(SendHalf, RecvHalf), ClientError> {
        match self {
            Link::Quic(c) => c
                .open_bi()
                .await
                .map(|(s, r)| (SendHalf::Quic(s), RecvHalf::Quic(r)))
                .map_err(|e| crate::error::connection_error(&e)),
            Link::WebTransport(s) => s
                .open_bi()
                .await
                .map(|(s, r)| (SendHalf::WebTransport(s), RecvHalf::WebTransport(r)))
                .map_err(|e| ClientError::Connection(session_error(&e))),
        }
    }

    /// The QUIC connection under it.
    fn quic(&self) -> &quinn::Connection {
        match self {
            Link::Quic(c) => c,
            Link::WebTransport(s) => s,
        }
    }

    pub(crate) fn remote_address(&self) -> SocketAddr {
        self.quic().remote_address()
    }

    pub(crate) fn close(&self, reason: &[u8]) {
        match self {
            Link::Quic(c) => c.close(0u32.into(), reason),
            Link::WebTransport(s) => s.close(0, reason),
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
    pub(crate) async fn write_all(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        match self {
            SendHalf::Quic(s) => s
                .write_all(bytes)
                .await
                .map_err(|e| crate::error::write_error(&e)),
            SendHalf::WebTransport(s) => s.write_all(bytes).await.map_err(|e| wt_write_error(&e)),
        }
    }

    pub(crate) async fn write_chunk(&mut self, bytes: Bytes) -> Result<(), ClientError> {
        match self {
            SendHalf::Quic(s) => s
                .write_chunk(bytes)
                .await
                .map_err(|e| crate::error::write_error(&e)),
            SendHalf::WebTransport(s) => s.write_chunk(bytes).await.map_err(|e| wt_write_error(&e)),
        }
    }

    /// Finish the sending side (FIN).
    pub(crate) fn finish(&mut self) -> Result<(), ClientError> {
        let done = match self {
            SendHalf::Quic(s) => s.finish().map_err(|e| e.to_string()),
            SendHalf::WebTransport(s) => s.finish().map_err(|e| e.to_string()),
        };
        done.map_err(ClientError::Connection)
    }
}

/// A stream's receiving half.
#[derive(Debug)]
pub(crate) enum RecvHalf {
    Quic(quinn::RecvStream),
    WebTransport(web_transport_quinn::RecvStream),
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

fn session_error(e: &web_transport_quinn::SessionError) -> String {
    match e {
        web_transport_quinn::SessionError::ConnectionError(c) => {
            crate::error::describe_connection_error(c)
        }
        other => other.to_string(),
    }
}

fn wt_write_error(e: &web_transport_quinn::WriteError) -> ClientError {
    ClientError::Connection(match e {
        web_transport_quinn::WriteError::Stopped(code) => format!(
            "the broker stopped reading the stream with {}",
            crate::error::app_code(u64::from(*code))
        ),
        web_transport_quinn::WriteError::SessionError(s) => session_error(s),
        other => other.to_string(),
    })
}
