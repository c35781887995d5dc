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
//!
//! # Spinning before a worker sleeps
//!
//! [`IdleSpin`]: runtime hooks that keep a worker about to sleep watching the endpoints'
//! sockets for a while, so that on a VM whose idle vCPUs halt at once the next packet does not
//! wait for the hypervisor to wake one (docs/architecture.md, "Spinning before sleeping").
//!
//! # Fewer acknowledgements
//!
//! Another transport setting both ends share: [`ack_frequency`], which asks the peer to
//! acknowledge fewer packets (docs/architecture.md, "Fewer ACKs").
//!
//! # Larger datagrams
//!
//! And [`path_mtu`] with [`endpoint_config`]: path-MTU discovery may probe up to
//! [`MAX_MTU`] bytes of UDP payload (quinn's default stops at 1452, standard Ethernet), and the
//! endpoint accepts datagrams that large. Where the path carries them (loopback, jumbo-frame
//! networks) a packet holds four times the messages, and per-packet work (encryption, headers,
//! acknowledgements, system calls) falls with it; elsewhere the probes are lost and the path
//! stays at what it carries (docs/architecture.md, "Larger datagrams").
//!
//! # A private directory when there is no home
//!
//! [`private_dir`]: where both ends keep the development certificate when neither
//! `AQUEDUCT_HOME` nor `HOME` is set, a directory of this user's own in the temporary directory.

use std::sync::Arc;

mod idle;
pub mod private_dir;
#[cfg(unix)]
mod unix;

pub use idle::{stats as idle_spin_stats, IdleSpin, IdleSpinStats};

/// The runtime, ready for [`quinn::Endpoint::new`] (which must be called on a tokio runtime).
pub fn runtime() -> Arc<dyn quinn::Runtime> {
    #[cfg(unix)]
    return Arc::new(unix::Runtime::new());
    #[cfg(not(unix))]
    return Arc::new(quinn::TokioRuntime);
}

/// The shortest delay a quinn peer accepts (its `min_ack_delay`, quinn's timer granularity),
/// and the default [`ack_frequency`] asks for.
pub const MIN_ACK_DELAY: std::time::Duration = std::time::Duration::from_millis(1);

/// QUIC's default `max_ack_delay` (RFC 9000 §18.2), the longest delay worth asking for.
pub const MAX_ACK_DELAY: std::time::Duration = std::time::Duration::from_millis(25);

/// The acknowledgement policy to ask of the peer (the QUIC ACK-frequency extension,
/// draft-ietf-quic-ack-frequency, as quinn implements it): it may leave up to `threshold`
/// ack-eliciting packets unacknowledged and must acknowledge the next one at once, and it
/// acknowledges any packet within `delay` (clamped to [`MIN_ACK_DELAY`]..=[`MAX_ACK_DELAY`]).
/// `threshold` 1 (or 0) is QUIC's own rule, an ACK for every second packet: `None`, nothing is
/// asked. A peer that does not support the extension (does not announce `min_ack_delay`) is
/// asked nothing either way.
///
/// Every ACK a peer sends is a datagram the other end must receive and handle in user space
/// (TCP's are absorbed by the kernel); at 10,000 messages/s, each in its own packet, QUIC's
/// own rule makes 5,000 of them a second in each direction. The trade-off is at low rates: a
/// packet that is not followed by `threshold` more within `delay` is acknowledged alone once
/// `delay` passes, so a flow whose packets come further apart than `delay` (but closer than
/// 25 ms) gets an ACK per packet instead of one per two (docs/architecture.md, "Fewer ACKs").
pub fn ack_frequency(
    threshold: u32,
    delay: std::time::Duration,
) -> Option<quinn::AckFrequencyConfig> {
    if threshold <= 1 {
        return None;
    }
    let mut config = quinn::AckFrequencyConfig::default();
    config
        .ack_eliciting_threshold(threshold.into())
        .max_ack_delay(Some(delay.clamp(MIN_ACK_DELAY, MAX_ACK_DELAY)));
    Some(config)
}

/// The largest UDP payload either end uses, bytes. A segmentation-offload (GSO) send hands the
/// kernel several datagrams at once, and together they must fit a single UDP datagram (65,507
/// bytes): with datagrams too large for the batch every such send fails, and the losses make
/// MTU discovery fall back to 1,200.
pub const MAX_MTU: u16 = 6500;

/// The most datagrams of [`MAX_MTU`] bytes one GSO send may carry (10): this crate's socket
/// tells quinn no more (quinn's own limit is also 10 today, a private constant).
pub const MAX_GSO_SEGMENTS: usize = 65_507 / MAX_MTU as usize;

/// The smallest UDP payload QUIC allows (RFC 9000 §14).
pub const MIN_MTU: u16 = 1200;

/// The endpoint both ends use: it accepts datagrams of up to `max_mtu` bytes of UDP payload
/// (clamped to [`MIN_MTU`]..=[`MAX_MTU`]) and tells peers so, which lets them send that large.
pub fn endpoint_config(max_mtu: u16) -> quinn::EndpointConfig {
    let mut config = quinn::EndpointConfig::default();
    // Within quinn's 1200..=65527: cannot fail.
    let _ = config.max_udp_payload_size(max_mtu.clamp(MIN_MTU, MAX_MTU));
    config
}

/// Start a connection's path MTU at `initial` and let discovery probe up to `max` (both
/// clamped to [`MIN_MTU`]..=[`MAX_MTU`], `initial` to at most `max`). The peer's own limit
/// (its endpoint's largest UDP payload) caps the probes too.
pub fn path_mtu(t: &mut quinn::TransportConfig, initial: u16, max: u16) {
    let max = max.clamp(MIN_MTU, MAX_MTU);
    t.initial_mtu(initial.clamp(MIN_MTU, max));
    let mut discovery = quinn::MtuDiscoveryConfig::default();
    discovery.upper_bound(max);
    t.mtu_discovery_config(Some(discovery));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten datagrams of the largest size fit one GSO send (one UDP datagram, IPv4 or IPv6).
    #[test]
    fn the_largest_datagrams_fit_one_segmentation_offload_send() {
        assert!(MAX_GSO_SEGMENTS * MAX_MTU as usize <= 65_507);
        assert_eq!(
            MAX_GSO_SEGMENTS, 10,
            "as many as quinn batches: GSO's gain kept"
        );
        let shown = format!("{:?}", endpoint_config(60_000));
        assert!(shown.contains("max_udp_payload_size: 6500"), "{shown}");
        let mut t = quinn::TransportConfig::default();
        path_mtu(&mut t, 9000, 7000);
        let shown = format!("{t:?}");
        assert!(shown.contains("initial_mtu: 6500"), "{shown}");
        assert!(shown.contains("upper_bound: 6500"), "{shown}");
        path_mtu(&mut t, 1452, 1300);
        let shown = format!("{t:?}");
        assert!(shown.contains("initial_mtu: 1300"), "{shown}");
    }

    #[test]
    fn threshold_one_asks_nothing() {
        assert!(ack_frequency(0, MIN_ACK_DELAY).is_none());
        assert!(ack_frequency(1, MIN_ACK_DELAY).is_none());
        // quinn's Debug output is the only view of the config it keeps.
        let asked = format!("{:?}", ack_frequency(9, MIN_ACK_DELAY).expect("asked"));
        assert!(asked.contains("ack_eliciting_threshold: 9"), "{asked}");
        assert!(asked.contains("max_ack_delay: Some(1ms)"), "{asked}");
        let clamped = format!("{:?}", ack_frequency(2, std::time::Duration::ZERO));
        assert!(clamped.contains("max_ack_delay: Some(1ms)"), "{clamped}");
        let clamped = format!("{:?}", ack_frequency(2, std::time::Duration::from_secs(1)));
        assert!(clamped.contains("max_ack_delay: Some(25ms)"), "{clamped}");
    }
}
