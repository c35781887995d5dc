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
    #[error("connection to {addr} timed out")]
    Timeout { addr: String },
}

/// Why an operation on a connected client failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The broker answered with an ERROR frame.
    #[error("broker error {code}: {reason}")]
    Broker { code: ErrorCode, reason: String },
    #[error("invalid {what}: {source}")]
    InvalidName {
        what: &'static str,
        #[source]
        source: TopicError,
    },
    #[error("the broker sent an invalid frame: {0}")]
    Protocol(#[from] ProtoError),
    #[error("connection lost: {0}")]
    Connection(String),
    #[error("the subscription or client is closed")]
    Closed,
}

impl ClientError {
    /// The broker's error code, if the broker refused the operation.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Broker { code, .. } => Some(*code),
            _ => None,
        }
    }
}
