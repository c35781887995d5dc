//! Decode errors and the ERROR-frame code table.
//!
//! [`DecodeError`] separates "read more" from "reject"; [`ProtoError`] names what was wrong and
//! where. [`ErrorCode`] is the numeric code a broker puts in an ERROR frame (table in
//! `docs/protocol.md`); [`ProtoError::code`] maps each decode failure onto it.

use std::fmt;

use crate::topic::TopicError;

/// Result of trying to decode a frame from a buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The buffer holds the start of a valid frame but not all of it: read at least `need` bytes
    /// in total (the buffer has `have`).
    #[error("incomplete frame: need {need} bytes, have {have}")]
    Incomplete { need: usize, have: usize },
    /// The bytes can never become a valid frame.
    #[error(transparent)]
    Invalid(#[from] ProtoError),
}

/// Everything that makes a frame invalid. Each variant carries the context needed to explain it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The first byte of a frame was not `0x1F`.
    #[error("bad magic byte 0x{found:02x} (expected 0x1f)")]
    BadMagic { found: u8 },
    /// The opcode (low 6 bits of the command byte) is not one this version knows.
    #[error("unknown opcode 0x{opcode:02x}")]
    UnknownOpcode { opcode: u8 },
    /// `data_len` exceeds the receiver's limit.
    #[error("frame data of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u32, max: u32 },
    /// HasExtensions is set but `data_len` cannot hold the 2-byte `ext_len`.
    #[error("extension flag set but data is only {data_len} bytes (need 2 for ext_len)")]
    MissingExtLen { data_len: u32 },
    /// `ext_len` is above the 1024-byte limit.
    #[error("extension block of {len} bytes exceeds the limit of {max} bytes")]
    ExtensionBlockTooLarge { len: usize, max: usize },
    /// `ext_len` runs past the end of the frame data.
    #[error(
        "extension block of {ext_len} bytes overruns the frame data ({available} bytes available)"
    )]
    ExtensionBlockOverrun { ext_len: usize, available: usize },
    /// An extension entry is cut short inside the block.
    #[error("extension entry at block offset {offset} truncated: need {need} bytes, have {have}")]
    TruncatedExtension {
        offset: usize,
        need: usize,
        have: usize,
    },
    /// A known extension has the wrong length or a value out of range.
    #[error("extension 0x{ext_type:02x} is invalid: {problem}")]
    BadExtension { ext_type: u8, problem: &'static str },
    /// The same known extension appears twice.
    #[error("extension 0x{ext_type:02x} appears more than once")]
    DuplicateExtension { ext_type: u8 },
    /// A topic name or filter (or group / consumer id) failed validation.
    #[error("invalid {what}: {reason}")]
    InvalidTopic {
        what: &'static str,
        // Not named `source`: it is shown in the message above, and as an error source too it
        // would be printed twice in an error chain.
        reason: TopicError,
    },
    /// A SUBSCRIBE / UNSUBSCRIBE payload does not follow the grammar.
    #[error("malformed subscribe payload: {problem}")]
    BadSubscribe { problem: &'static str },
    /// A payload has the wrong size or shape for its opcode.
    #[error("bad {opcode} payload: {problem} (payload is {len} bytes)")]
    BadPayload {
        opcode: &'static str,
        problem: &'static str,
        len: usize,
    },
    /// A sub-frame inside a PUBLISH_BATCH is invalid.
    #[error("batch sub-frame {index} at byte {offset}: {reason}")]
    BadBatchEntry {
        index: usize,
        offset: usize,
        // Not named `source`: it is shown in the message above, and as an error source too it
        // would be printed twice in an error chain.
        reason: Box<ProtoError>,
    },
}

impl ProtoError {
    /// The ERROR-frame code a broker reports for this decode failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::BadMagic { .. } => ErrorCode::BAD_MAGIC,
            ProtoError::UnknownOpcode { .. } => ErrorCode::UNKNOWN_OPCODE,
            ProtoError::FrameTooLarge { .. } => ErrorCode::FRAME_TOO_LARGE,
            ProtoError::MissingExtLen { .. }
            | ProtoError::ExtensionBlockTooLarge { .. }
            | ProtoError::ExtensionBlockOverrun { .. }
            | ProtoError::TruncatedExtension { .. }
            | ProtoError::BadExtension { .. }
            | ProtoError::DuplicateExtension { .. } => ErrorCode::BAD_EXTENSION,
            ProtoError::InvalidTopic { .. } => ErrorCode::INVALID_TOPIC,
            ProtoError::BadSubscribe { .. } => ErrorCode::BAD_SUBSCRIBE,
            ProtoError::BadPayload { .. } => ErrorCode::BAD_PAYLOAD,
            ProtoError::BadBatchEntry { .. } => ErrorCode::BAD_BATCH,
        }
    }

    /// A short, stable, label-safe name for metrics (`frames_rejected_total{reason}`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            ProtoError::BadMagic { .. } => "bad_magic",
            ProtoError::UnknownOpcode { .. } => "unknown_opcode",
            ProtoError::FrameTooLarge { .. } => "frame_too_large",
            ProtoError::MissingExtLen { .. }
            | ProtoError::ExtensionBlockTooLarge { .. }
            | ProtoError::ExtensionBlockOverrun { .. }
            | ProtoError::TruncatedExtension { .. }
            | ProtoError::BadExtension { .. }
            | ProtoError::DuplicateExtension { .. } => "bad_extension",
            ProtoError::InvalidTopic { .. } => "invalid_topic",
            ProtoError::BadSubscribe { .. } => "bad_subscribe",
            ProtoError::BadPayload { .. } => "bad_payload",
            ProtoError::BadBatchEntry { .. } => "bad_batch",
        }
    }
}

/// The numeric code of an ERROR frame. Unknown values are kept as they are (forward compatible).
///
/// Ranges: 1xx framing, 2xx request semantics, 3xx flow control, 4xx authorization, 5xx broker.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ErrorCode(pub u16);

macro_rules! error_codes {
    ($($name:ident = $value:expr, $label:expr;)*) => {
        impl ErrorCode {
            $(#[doc = $label] pub const $name: ErrorCode = ErrorCode($value);)*
            /// Every code this version defines, in numeric order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name),*];

            /// The symbolic name (`"BAD_MAGIC"`), or `None` for a code this version does not know.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($value => Some(stringify!($name)),)*
                    _ => None,
                }
            }
        }
    };
}

error_codes! {
    MALFORMED_FRAME = 100, "The stream ended inside a frame (or a handshake timed out, as a close code).";
    BAD_MAGIC = 101, "The first byte of a frame was not 0x1F; the broker stops reading the stream and finishes it.";
    UNKNOWN_OPCODE = 102, "The opcode is not defined; the frame was skipped.";
    FRAME_TOO_LARGE = 103, "data_len exceeds the broker's limit; the broker stops reading the stream and finishes it.";
    BAD_EXTENSION = 104, "The extension block is malformed or a known extension is invalid.";
    BAD_PAYLOAD = 105, "The payload has the wrong size or shape for its opcode.";
    BAD_BATCH = 106, "A PUBLISH_BATCH sub-frame is invalid; nothing in the batch was published.";
    INVALID_TOPIC = 200, "A topic name or filter is invalid.";
    BAD_SUBSCRIBE = 201, "A SUBSCRIBE or UNSUBSCRIBE payload does not follow the grammar.";
    NOT_SUBSCRIBED = 202, "No subscription is bound to this stream id (ACK, NACK, UNSUBSCRIBE).";
    NOT_IN_FLIGHT = 203, "The ACK/NACK names a message that is not awaiting settlement.";
    STALE_ATTEMPT = 204, "The ACK/NACK names an earlier delivery attempt than the current one.";
    TOPIC_REQUIRED = 205, "An ACK/NACK on a wildcard subscription must carry the topic extension.";
    UNSUPPORTED = 206, "The request uses a feature this broker does not support.";
    SLOW_CONSUMER = 300, "The subscriber's queue overflowed under the disconnect policy.";
    RATE_LIMITED = 301, "The client is over its publish quota (`broker.quotas.action: reject`): the frame was not published.";
    NOT_AUTHORIZED = 400, "The ACL does not allow this client to publish to or subscribe to the topic named in the reason; nothing was done.";
    INTERNAL = 500, "The broker failed internally; the request may be retried.";
    SHUTTING_DOWN = 501, "The broker is shutting down.";
    STORAGE_FAILED = 502, "The durable log could not store the message (disk full, I/O error): it is not durable, though live subscribers may have received it.";
}

impl ErrorCode {
    /// The earlier name of [`ErrorCode::RATE_LIMITED`] (same value, 301).
    #[deprecated(note = "renamed RATE_LIMITED (same value, 301)")]
    pub const QUOTA_EXCEEDED: ErrorCode = ErrorCode::RATE_LIMITED;
    /// The earlier name of [`ErrorCode::NOT_AUTHORIZED`] (same value, 400).
    #[deprecated(note = "renamed NOT_AUTHORIZED (same value, 400)")]
    pub const UNAUTHORIZED: ErrorCode = ErrorCode::NOT_AUTHORIZED;

    /// The one-byte stream error code (RESET_STREAM, STOP_SENDING) that stands for this code on
    /// a WebTransport stream: browsers' `WebTransportError.streamErrorCode` is one byte
    /// (protocol.md §12). `SLOW_CONSUMER` (300) is 30, `SHUTTING_DOWN` (501) is 51; a code
    /// under 256 is itself; any other is 0.
    pub fn to_webtransport_stream(self) -> u8 {
        match self {
            ErrorCode::SLOW_CONSUMER => 30,
            ErrorCode::SHUTTING_DOWN => 51,
            ErrorCode(c) => u8::try_from(c).unwrap_or(0),
        }
    }

    /// The code a one-byte WebTransport stream error code stands for (the inverse of
    /// [`to_webtransport_stream`](Self::to_webtransport_stream)).
    pub fn from_webtransport_stream(code: u32) -> ErrorCode {
        match code {
            30 => ErrorCode::SLOW_CONSUMER,
            51 => ErrorCode::SHUTTING_DOWN,
            c => ErrorCode(u16::try_from(c).unwrap_or(0)),
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name}({})", self.0),
            None => write!(f, "ErrorCode({})", self.0),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn webtransport_stream_codes_fit_a_byte_and_map_back() {
        use super::ErrorCode;
        for code in [
            ErrorCode::SLOW_CONSUMER,
            ErrorCode::SHUTTING_DOWN,
            ErrorCode(0),
        ] {
            let wt = code.to_webtransport_stream();
            assert_eq!(ErrorCode::from_webtransport_stream(u32::from(wt)), code);
        }
        assert_eq!(ErrorCode::SLOW_CONSUMER.to_webtransport_stream(), 30);
        assert_eq!(ErrorCode::SHUTTING_DOWN.to_webtransport_stream(), 51);
    }

    use super::*;

    #[test]
    fn codes_are_unique_and_named() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(seen.insert(code.0), "duplicate code {}", code.0);
            assert!(code.name().is_some());
        }
        assert_eq!(ErrorCode(9999).name(), None);
        assert_eq!(format!("{}", ErrorCode::BAD_MAGIC), "BAD_MAGIC(101)");
    }

    #[test]
    fn every_decode_error_maps_to_a_defined_code() {
        let err = ProtoError::BadBatchEntry {
            index: 3,
            offset: 40,
            reason: Box::new(ProtoError::BadMagic { found: 0 }),
        };
        assert_eq!(err.code(), ErrorCode::BAD_BATCH);
        assert!(ErrorCode::ALL.contains(&err.code()));
        assert_eq!(
            err.to_string(),
            "batch sub-frame 3 at byte 40: bad magic byte 0x00 (expected 0x1f)"
        );
    }
}
