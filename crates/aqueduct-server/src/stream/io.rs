//! The two halves of a client stream as the stream task uses them. A stream is a QUIC stream of
//! an `aqueduct-v1` connection, or a WebTransport stream of a browser's session (whose stream
//! error codes HTTP/3 maps into a space of its own, so it has its own types): the task is
//! written once, over these traits.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;

/// Why a write did not go through.
#[derive(Debug)]
pub(crate) enum WriteFailure {
    /// The client stopped reading the stream (STOP_SENDING).
    Stopped,
    /// The stream or the connection is gone.
    Gone(String),
}

impl std::fmt::Display for WriteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteFailure::Stopped => f.write_str("the client stopped reading"),
            WriteFailure::Gone(why) => f.write_str(why),
        }
    }
}

/// The sending half: deliveries and replies go out here.
pub(crate) trait SendHalf: Send {
    /// Write as much of `chunk` as the stream takes (without a copy), waiting until it takes
    /// some; what is left stays in `chunk`. Cancel safe: if it does not complete, nothing was
    /// written. Each completion is progress: a client that reads, however slowly, makes it.
    fn write_some(
        &mut self,
        chunk: &mut Bytes,
    ) -> impl Future<Output = Result<(), WriteFailure>> + Send;
    /// Resolves when the client stopped reading (`Some`: its STOP_SENDING, described) or the
    /// stream or its connection ended otherwise (`None`: a lost connection is not the client
    /// stopping a stream).
    fn stopped(&mut self) -> impl Future<Output = Option<String>> + Send;
    /// Abandon the stream with an application error code.
    fn reset(&mut self, code: u32);
    /// End the stream cleanly (FIN) after what was written.
    fn finish(&mut self);
    /// What [`Self::stopped`] waits for, as a future that does not borrow the stream, if this
    /// kind of stream has one. A stream that has one can be parked for direct writes while its
    /// writer is idle (see `direct.rs`); one that has none (WebTransport) never is.
    fn stopped_owned(&self) -> Option<impl Future<Output = Option<String>> + Send + 'static> {
        None::<std::future::Pending<Option<String>>>
    }
    /// Write as much of `chunk` as the stream takes now, without waiting: `Ok(true)` if all of
    /// it went, `Ok(false)` if flow control held some back (what is left stays in `chunk`).
    fn write_now(&mut self, chunk: &mut Bytes) -> Result<bool, WriteFailure> {
        let _ = chunk;
        Ok(false)
    }
}

/// The receiving half: the client's frames come in here.
pub(crate) trait RecvHalf: tokio::io::AsyncRead + Unpin + Send {
    /// Completes once the client has reset its sending side (RESET_STREAM) or the connection
    /// is gone; never otherwise. For a reader that is not reading (held by backpressure, a
    /// quota, the log or a full queue) and must still notice the stream's end (§1.1).
    fn reset(&mut self) -> impl Future<Output = ()> + Send;
}

/// A QUIC stream's STOP_SENDING, described; `None` if it ended otherwise (the connection lost).
fn stop_code(stopped: Result<Option<quinn::VarInt>, quinn::StoppedError>) -> Option<String> {
    match stopped {
        Ok(Some(code)) => Some(format!("STOP_SENDING with code {code}")),
        _ => None,
    }
}

impl SendHalf for quinn::SendStream {
    async fn write_some(&mut self, chunk: &mut Bytes) -> Result<(), WriteFailure> {
        // `write_chunks` advances a partly written chunk in place, and is cancel safe.
        quinn::SendStream::write_chunks(self, std::slice::from_mut(chunk))
            .await
            .map(drop)
            .map_err(|e| match e {
                quinn::WriteError::Stopped(_) => WriteFailure::Stopped,
                e => WriteFailure::Gone(e.to_string()),
            })
    }

    async fn stopped(&mut self) -> Option<String> {
        stop_code(quinn::SendStream::stopped(self).await)
    }

    fn reset(&mut self, code: u32) {
        let _ = quinn::SendStream::reset(self, code.into());
    }

    fn finish(&mut self) {
        let _ = quinn::SendStream::finish(self);
    }

    fn stopped_owned(&self) -> Option<impl Future<Output = Option<String>> + Send + 'static> {
        let stopped = quinn::SendStream::stopped(self);
        Some(async move { stop_code(stopped.await) })
    }

    fn write_now(&mut self, chunk: &mut Bytes) -> Result<bool, WriteFailure> {
        let mut chunks = [std::mem::take(chunk)];
        // One poll: quinn's `write_chunks` writes what flow control allows, or nothing if it is
        // not ready (it is cancel safe). A blocked stream registers this no-op waker; the
        // writer task, told to take over, polls again with its own.
        let mut cx = Context::from_waker(Waker::noop());
        let written = match pin!(self.write_chunks(&mut chunks)).poll(&mut cx) {
            Poll::Ready(Ok(w)) => Ok(w.chunks == 1),
            Poll::Ready(Err(quinn::WriteError::Stopped(_))) => Err(WriteFailure::Stopped),
            Poll::Ready(Err(e)) => Err(WriteFailure::Gone(e.to_string())),
            Poll::Pending => Ok(false),
        };
        // What was not written (all of it, on a failure) stays the caller's.
        let [rest] = chunks;
        *chunk = rest;
        written
    }
}

impl RecvHalf for quinn::RecvStream {
    async fn reset(&mut self) {
        // `Ok(None)`: finished and read, or stopped — no reset will come.
        if let Ok(None) = self.received_reset().await {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the client's STOP_SENDING is the client stopping a stream: a lost connection also
    /// completes quinn's `stopped`, and was counted in `aqueduct_streams_stopped_total` (and
    /// logged as the client stopping its reads) for every idle stream of the connection.
    #[test]
    fn only_a_stop_sending_is_a_stop() {
        let code = quinn::VarInt::from(7u32);
        assert_eq!(
            stop_code(Ok(Some(code))).as_deref(),
            Some("STOP_SENDING with code 7")
        );
        let lost = quinn::ConnectionError::TimedOut;
        assert_eq!(
            stop_code(Err(quinn::StoppedError::ConnectionLost(lost))),
            None
        );
        assert_eq!(stop_code(Ok(None)), None);
    }
}
