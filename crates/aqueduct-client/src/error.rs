//! Client errors, one enum per kind of operation.

use aqueduct_proto::{ErrorCode, ProtoError, TopicError};

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot resolve {addr}: {reason}")]
    Resolve { addr: String, reason: String },
    #[error(
        "no way to verify the broker at {host}: pass a CA certificate (--ca / ConnectOptions::ca_file) \
         or a pinned certificate fingerprint; the development certificate is trusted only for localhost"
    )]
    NoTrust { host: String },
    #[error("cannot read {what} {path}: {reason}")]
    Pem {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("connection to {addr} failed: {reason}")]
    Connect { addr: String, reason: String },
    #[error(
        "connection to {addr} timed out: is a broker running on UDP {addr}? (QUIC runs over UDP; \
         a firewall may drop it)"
    )]
    Timeout { addr: String },
}

/// Why an operation on a connected client failed. More kinds may come: match with a
/// catch-all arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The broker answered with an ERROR frame.
    #[error("broker error {code}: {reason}")]
    Broker { code: ErrorCode, reason: String },
    #[error("invalid {what}: {reason}")]
    InvalidName {
        what: &'static str,
        // Not named `source`: it is shown in the message above, and as an error source too it
        // would be printed twice in an error chain.
        reason: TopicError,
    },
    #[error("the broker sent an invalid frame: {0}")]
    Protocol(ProtoError),
    #[error("connection lost: {0}")]
    Connection(String),
    /// The broker did not do what was waited for in time (read a publish stream, finish it);
    /// the connection may be fine. What was published may or may not have been handled.
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("the subscription or client is closed")]
    Closed,
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Protocol(e)
    }
}

impl ClientError {
    /// For `map_err`: a name (`what`: "topic filter", "group id", …) that failed validation.
    pub(crate) fn invalid(what: &'static str) -> impl FnOnce(TopicError) -> ClientError {
        move |reason| ClientError::InvalidName { what, reason }
    }

    /// The broker's error code, if the broker refused the operation.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Broker { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// An application error code (stream reset, STOP_SENDING, connection close) in words. A WebTransport stream's code arrives mapped into HTTP/3's
/// code space (protocol.md §12): it is mapped back first.
pub(crate) fn app_code(code: u64) -> String {
    let code = stream_code(code);
    if code == 0 {
        // Not an ERROR code (§9 has none): the broker's plain "no particular error".
        return "code 0".into();
    }
    match u16::try_from(code) {
        Ok(c) => ErrorCode(c).to_string(),
        Err(_) => format!("code {code}"),
    }
}

/// A TLS alert that ended a handshake, in plain words (RFC 8446 alert numbers; QUIC carries
/// them as transport error 0x100 + alert).
fn tls_alert(alert: u8) -> String {
    let what = match alert {
        116 => "the broker requires a client certificate (one signed by a CA in its tls.client_ca_file)",
        48 => "unknown issuer: the broker does not trust the CA that signed the client certificate",
        42 => "the broker rejected the client certificate (bad certificate)",
        43 => "the broker does not support the client certificate (an X.509 v1 certificate, or one without the clientAuth extended key usage?)",
        44 => "the client certificate was revoked",
        45 => "the client certificate has expired (or is not valid yet)",
        46 => "the broker could not verify the client certificate",
        51 => "the broker could not verify the client certificate's signature: it is not signed by a CA the broker trusts (its tls.client_ca_file)",
        49 => "access denied by the broker",
        40 => "the TLS handshake failed (no common parameters)",
        120 => "the broker does not speak the protocol offered (ALPN aqueduct-v1; or h3 for \
                WebTransport: is webtransport.enabled on?)",
        _ => return format!("the broker ended the TLS handshake with alert {alert}"),
    };
    what.to_string()
}

/// True if this side ended the TLS handshake (QUIC crypto error 0x100 + alert raised locally):
/// on a client, it did not accept the broker's certificate.
pub(crate) fn is_local_tls_failure(e: &quinn::ConnectionError) -> bool {
    matches!(e, quinn::ConnectionError::TransportError(t) if is_tls_alert(u64::from(t.code)))
}

/// QUIC carries TLS alerts as transport errors 0x100 + alert.
fn is_tls_alert(code: u64) -> bool {
    (0x100..0x200).contains(&code)
}

/// A QUIC connection error in plain words.
pub(crate) fn describe_connection_error(e: &quinn::ConnectionError) -> String {
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => {
            let code = u64::from(c.error_code);
            if is_tls_alert(code) {
                tls_alert((code - 0x100) as u8)
            } else {
                format!("the broker closed the connection: {c}")
            }
        }
        quinn::ConnectionError::ApplicationClosed(a) => {
            let code = a.error_code.into_inner();
            let reason = String::from_utf8_lossy(&a.reason);
            if code == u64::from(ErrorCode::SHUTTING_DOWN.0) {
                format!("the broker is shutting down ({})", app_code(code))
            } else if code == 0 {
                // No error code: the reason says it all (e.g. an administrator's disconnect).
                format!("the broker closed the connection: {reason}")
            } else {
                format!(
                    "the connection was closed with {}: {reason}",
                    app_code(code)
                )
            }
        }
        quinn::ConnectionError::TransportError(t) => {
            if is_tls_alert(u64::from(t.code)) {
                // rustls words its catch-all error "unexpected error: ..."; ours are expected.
                format!(
                    "TLS: {}",
                    t.reason
                        .strip_prefix("unexpected error: ")
                        .unwrap_or(&t.reason)
                )
            } else {
                t.to_string()
            }
        }
        quinn::ConnectionError::TimedOut => {
            "the broker stopped answering (idle timeout)".to_string()
        }
        other => other.to_string(),
    }
}

/// A stream's application error code as the broker chose it (over WebTransport a stream
/// code is one byte, mapped into HTTP/3's range: protocol.md §12).
fn stream_code(code: u64) -> u64 {
    match web_transport_quinn::proto::error_from_http3(code) {
        Some(wt) => u64::from(aqueduct_proto::ErrorCode::from_webtransport_stream(wt).0),
        None => code,
    }
}

/// A stream read failure as a client error. A reset with SLOW_CONSUMER (300) is the broker
/// closing a slow consumer whose writes were blocked: the same as the ERROR it sends otherwise
/// (protocol.md §7.3), so it carries that code.
pub(crate) fn read_error(e: &quinn::ReadError) -> ClientError {
    // This side closed the connection (`Client::close`): closed, not lost.
    if let quinn::ReadError::ConnectionLost(quinn::ConnectionError::LocallyClosed) = e {
        return ClientError::Closed;
    }
    if let quinn::ReadError::Reset(code) = e {
        if stream_code(code.into_inner()) == u64::from(aqueduct_proto::ErrorCode::SLOW_CONSUMER.0) {
            return ClientError::Broker {
                code: aqueduct_proto::ErrorCode::SLOW_CONSUMER,
                reason: "the broker reset the delivery stream: a subscription on it overflowed \
                         its queue (policy disconnect), or held a publisher past \
                         broker.block_timeout (policy block), while the client was not reading"
                    .into(),
            };
        }
    }
    ClientError::Connection(match e {
        quinn::ReadError::Reset(code) => {
            format!(
                "the broker reset the stream with {}",
                app_code(code.into_inner())
            )
        }
        quinn::ReadError::ConnectionLost(c) => describe_connection_error(c),
        other => other.to_string(),
    })
}

/// A stream write failure as a client error.
pub(crate) fn write_error(e: &quinn::WriteError) -> ClientError {
    if let quinn::WriteError::ConnectionLost(quinn::ConnectionError::LocallyClosed) = e {
        return ClientError::Closed;
    }
    ClientError::Connection(match e {
        quinn::WriteError::Stopped(code) => format!(
            "the broker stopped reading the stream with {}",
            app_code(code.into_inner())
        ),
        quinn::WriteError::ConnectionLost(c) => describe_connection_error(c),
        // This side let go of the stream (the subscription or publisher was closed): the
        // connection is fine.
        quinn::WriteError::ClosedStream => {
            return ClientError::Closed;
        }
        other => other.to_string(),
    })
}

/// An I/O error from reading a stream: the QUIC error inside it, in words.
pub(crate) fn io_read_error(e: &std::io::Error) -> ClientError {
    match e
        .get_ref()
        .and_then(|i| i.downcast_ref::<quinn::ReadError>())
    {
        Some(r) => read_error(r),
        None => ClientError::Connection(e.to_string()),
    }
}

/// Failure to open a stream.
pub(crate) fn connection_error(e: &quinn::ConnectionError) -> ClientError {
    match e {
        quinn::ConnectionError::LocallyClosed => ClientError::Closed,
        e => ClientError::Connection(describe_connection_error(e)),
    }
}
