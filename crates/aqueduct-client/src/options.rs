//! How to reach and trust a broker.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default location of the development certificate a local broker writes (and that the CLI
/// trusts for localhost): `$AQUEDUCT_HOME/dev-cert.pem`, else `$HOME/.aqueduct/dev-cert.pem`,
/// else, with neither set, `<temp>/aqueduct-<uid>/dev-cert.pem`, trusted only while that
/// directory is this user's own and private.
pub fn default_dev_cert_file() -> PathBuf {
    if let Some(home) = std::env::var_os("AQUEDUCT_HOME").filter(|h| !h.is_empty()) {
        return Path::new(&home).join("dev-cert.pem");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => Path::new(&home).join(".aqueduct").join("dev-cert.pem"),
        None => aqueduct_udp::private_dir::path().join("dev-cert.pem"),
    }
}

/// How the broker's certificate is verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// CA certificates (PEM file).
    CaFile(PathBuf),
    /// CA certificates (PEM text).
    CaPem(Vec<u8>),
    /// Accept exactly the certificate with this SHA-256 fingerprint (of its DER bytes).
    Fingerprint([u8; 32]),
    /// For localhost only: the development certificate the broker wrote at this path.
    /// For any other host: refuse to connect without a CA or a pin.
    Auto(PathBuf),
}

impl Trust {
    /// What is trusted, for error messages.
    pub fn describe(&self) -> String {
        match self {
            Trust::CaFile(p) => format!(
                "CA file {} (a broker without tls.cert_file shows its generated development \
                 certificate, which no CA signs: for a local one, leave out --ca, \
                 ConnectOptions::ca_file, to trust its dev-cert file)",
                p.display()
            ),
            Trust::CaPem(_) => "the CA certificates given in memory".into(),
            Trust::Fingerprint(_) => "a pinned certificate fingerprint".into(),
            Trust::Auto(p) => format!(
                "the development certificate {} (written by a local broker at startup; a broker \
                 restarted elsewhere or another broker on this port has another one; a broker \
                 with a CA-signed certificate needs --ca FILE, ConnectOptions::ca_file)",
                p.display()
            ),
        }
    }
}

/// Connection settings (builder).
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub(crate) addr: String,
    pub(crate) server_name: Option<String>,
    pub(crate) trust: Trust,
    pub(crate) client_cert: Option<(PathBuf, PathBuf)>,
    pub(crate) timeout: Duration,
    pub(crate) transport: crate::link::Transport,
    pub(crate) ack_eliciting_threshold: u32,
    pub(crate) ack_delay: Duration,
    pub(crate) max_mtu: u16,
}

impl ConnectOptions {
    /// `addr` is `host:port` (`localhost:4242`, `127.0.0.1:4242`, `broker.example:4242`).
    pub fn new(addr: impl Into<String>) -> Self {
        ConnectOptions {
            addr: addr.into(),
            server_name: None,
            trust: Trust::Auto(default_dev_cert_file()),
            client_cert: None,
            timeout: Duration::from_secs(10),
            transport: crate::link::Transport::Quic,
            ack_eliciting_threshold: DEFAULT_ACK_ELICITING_THRESHOLD,
            ack_delay: DEFAULT_ACK_DELAY,
            max_mtu: aqueduct_udp::MAX_MTU,
        }
    }

    /// Connect over QUIC with ALPN `aqueduct-v1` (the default) or over WebTransport, as a
    /// browser does (`docs/protocol.md` §12). With the development certificate, the broker
    /// writes the certificate it shows WebTransport clients into the same file, so the default
    /// trust works for both.
    pub fn transport(mut self, transport: crate::link::Transport) -> Self {
        self.transport = transport;
        self
    }

    /// The name to verify in the broker's certificate (default: the host part of `addr`).
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Trust the CA certificates in this PEM file.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.trust = Trust::CaFile(path.into());
        self
    }

    /// Trust the CA certificates in this PEM text.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.trust = Trust::CaPem(pem.into());
        self
    }

    /// Accept only the certificate with this SHA-256 fingerprint.
    pub fn pin_sha256(mut self, fingerprint: [u8; 32]) -> Self {
        self.trust = Trust::Fingerprint(fingerprint);
        self
    }

    /// For localhost: trust the development certificate at `path` (default
    /// [`default_dev_cert_file`]).
    pub fn dev_cert_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.trust = Trust::Auto(path.into());
        self
    }

    /// Present this client certificate and key (PEM files) for mTLS.
    pub fn client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Whether a client certificate is set (`client_cert`).
    pub fn has_client_cert(&self) -> bool {
        self.client_cert.is_some()
    }

    /// What verifies the broker's certificate, in words (for error messages).
    pub fn trust_description(&self) -> String {
        self.trust.describe()
    }

    /// The address as given (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The name the broker's certificate must carry: [`server_name`](Self::server_name), or the
    /// host part of the address.
    pub fn verified_name(&self) -> String {
        self.server_name
            .clone()
            .unwrap_or_else(|| host_of(&self.addr).to_string())
    }

    /// The TLS 1.3 client configuration these options describe (trust, client certificate),
    /// offering `alpn`: for other connections to the broker (the admin API speaks `h2`).
    pub fn tls_config(&self, alpn: &[u8]) -> Result<rustls::ClientConfig, crate::ConnectError> {
        let mut config =
            crate::tls::client_crypto(&self.trust, host_of(&self.addr), self.client_cert.as_ref())?;
        config.alpn_protocols = vec![alpn.to_vec()];
        config.enable_early_data = false;
        Ok(config)
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.timeout
    }

    /// Give up connecting after this long (default 10 s). Opening a stream later (a
    /// `subscribe`, a publisher's first publish) waits at most this long too, for the broker
    /// to allow one more (`transport.max_streams_per_connection`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many packets from this client the broker may leave unacknowledged (default 9, so
    /// it acknowledges every tenth; clamped to 1..=[`MAX_ACK_ELICITING_THRESHOLD`]; 1, or 0,
    /// is QUIC's own rule, an ACK for every second packet, and asks nothing). Asked through
    /// the QUIC ACK-frequency extension, with every packet acknowledged within
    /// [`ConnectOptions::ack_delay`]. Fewer ACKs are fewer datagrams for this client and the
    /// broker to handle while it publishes (the broker asks the same of the client for its
    /// deliveries: `transport.ack_eliciting_threshold`).
    pub fn ack_eliciting_threshold(mut self, packets: u32) -> Self {
        self.ack_eliciting_threshold = packets.clamp(1, MAX_ACK_ELICITING_THRESHOLD);
        self
    }

    /// The longest the broker may hold an acknowledgement of this client's packets back when
    /// fewer than [`ConnectOptions::ack_eliciting_threshold`] more follow (default 1 ms;
    /// clamped to 1..=25 ms). Short keeps the latency tail low at high rates; a client that
    /// publishes a few hundred messages a second gets one ACK per packet below it, and 25 ms
    /// (QUIC's default) avoids that (docs/architecture.md, "Fewer ACKs").
    pub fn ack_delay(mut self, delay: Duration) -> Self {
        self.ack_delay = delay;
        self
    }

    /// The largest datagram (bytes of UDP payload) this client accepts, which lets the broker's
    /// MTU discovery grow its datagrams to it (default and most [`aqueduct_udp::MAX_MTU`],
    /// 6500; clamped to 1200..=6500). Where the path carries large datagrams (loopback, jumbo
    /// frames) a delivery packet then holds several times the messages; elsewhere the broker's
    /// probes are lost and the path stays at what it carries. 1452 (standard Ethernet) keeps
    /// them at 1452. The broker's `transport.max_mtu` caps it as well. The client's own
    /// datagrams stay at 1452 for now.
    pub fn max_mtu(mut self, bytes: u16) -> Self {
        self.max_mtu = bytes.clamp(aqueduct_udp::MIN_MTU, aqueduct_udp::MAX_MTU);
        self
    }
}

/// [`ConnectOptions::ack_eliciting_threshold`]'s default, as the broker's.
pub const DEFAULT_ACK_ELICITING_THRESHOLD: u32 = 9;

/// The largest [`ConnectOptions::ack_eliciting_threshold`], as the broker's: beyond it ACKs
/// come too seldom for congestion control and loss detection to go by.
pub const MAX_ACK_ELICITING_THRESHOLD: u32 = 64;

/// [`ConnectOptions::ack_delay`]'s default, as the broker's.
pub const DEFAULT_ACK_DELAY: Duration = Duration::from_millis(1);

/// Split `host:port`, accepting `[::1]:4242`.
pub(crate) fn host_of(addr: &str) -> &str {
    let host = match addr.rfind(':') {
        Some(i) if !addr[..i].ends_with(']') && addr[..i].contains(':') => addr, // bare IPv6, no port
        Some(i) => &addr[..i],
        None => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Hosts for which the development certificate is trusted.
pub(crate) fn is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1") || host.starts_with("127.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(host_of("localhost:4242"), "localhost");
        assert_eq!(host_of("[::1]:4242"), "::1");
        assert_eq!(host_of("10.0.0.1:1"), "10.0.0.1");
        assert!(is_local("127.0.0.1") && is_local("::1") && is_local("localhost"));
        assert!(!is_local("broker.example"));
    }
}
