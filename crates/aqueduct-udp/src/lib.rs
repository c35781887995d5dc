//! quinn's runtime for tokio, with one change: the endpoint's UDP socket is registered with
//! tokio's reactor for *reading* only.
//!
//! # Why
//!
//! quinn's own [`quinn::TokioRuntime`] wraps the socket in a `tokio::net::UdpSocket`, which
//! registers it for both readable and writable events (edge-triggered epoll). Linux signals a
//! UDP socket's write space each time a sent datagram's buffer is released — on loopback during
//! the very `sendmsg` — so every datagram sent raised an `EPOLLOUT` event. Nothing waits for it
//! (the socket is almost never full), but the event still wakes the runtime thread blocked in
//! `epoll_wait`, usually the *other* worker, which finds no work and sleeps again. Measured
//! with `strace -e epoll_wait` at 5,000 msg/s: a quarter of the broker's wake-ups and a sixth
//! of a client's carried nothing but `EPOLLOUT` (docs/benchmarks.md, "Sends that woke the
//! other thread").
//!
//! # How
//!
//! The socket is registered with [`Interest::READABLE`] only, so the write-space wake-ups no
//! longer reach epoll. A send is tried directly; only when the kernel refuses one
//! (`WouldBlock`: the socket buffer is full) do connections wait for write space, through a
//! second registration of a duplicate descriptor with [`Interest::WRITABLE`], made when the
//! first one waits, shared by all that wait with it, and dropped once the space is seen. Epoll
//! reports a descriptor that is already writable when it is registered, so a wait cannot miss
//! the space freed between the refused send and the registration. If the registration cannot
//! be made (no descriptor left for the duplicate), the connection tries again after a
//! millisecond instead of failing: an error there would stop its driver without closing it.

//!
//! On platforms other than Unix, [`runtime`] is quinn's own tokio runtime.

use std::sync::Arc;

#[cfg(unix)]
mod unix;

/// The runtime, ready for [`quinn::Endpoint::new`] (which must be called on a tokio runtime).
pub fn runtime() -> Arc<dyn quinn::Runtime> {
    #[cfg(unix)]
    return Arc::new(unix::Runtime::new());
    #[cfg(not(unix))]
    return Arc::new(quinn::TokioRuntime);
}
