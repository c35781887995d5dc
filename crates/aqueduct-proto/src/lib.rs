//! The Aqueduct wire format, and nothing else: no tokio, no quinn, no clock.
//!
//! Every frame is a 10-byte little-endian header (see [`header`]), an optional extension block of TLV
//! entries ([`ext`]) and a payload. [`frame`] turns bytes into typed [`Frame`]s and back; decoding
//! tells "incomplete, read more" ([`DecodeError::Incomplete`]) apart from "invalid, reject"
//! ([`DecodeError::Invalid`]), and every invalid case is a [`ProtoError`] with context. No input
//! can make this crate panic; the proptests and the `fuzz/` targets hold it to that.
//!
//! `docs/protocol.md` is the normative description; the tests in `tests/protocol_doc.rs` decode
//! and re-encode every hex example in it.

pub mod batch;
#[cfg(feature = "zstd")]
pub mod compress;
pub mod delivery;
pub mod error;
pub mod ext;
pub mod frame;
pub mod header;
pub mod subscribe;
pub mod topic;

pub use batch::{BatchIter, RawFrameRef};
pub use delivery::SharedDelivery;
pub use error::{DecodeError, ErrorCode, ProtoError};
pub use ext::{AckMode, Compression, Extensions, OverflowPolicy, Priority, TraceContext};
pub use frame::{
    decode_frame, Ack, BatchBuilder, Confirm, DeliveryRef, ErrorFrame, Frame, Info, Limits, Nack,
    Publish, PublishBatch, PublishRef, Subscribe, Unsubscribe,
};
pub use header::{FrameHeader, Opcode, HEADER_LEN, MAGIC};
pub use subscribe::{Durable, DurableStart, SubscribeSpec};
pub use topic::{ConsumerId, GroupId, TopicError, TopicFilter, TopicName, TopicRef};
