//! Rust client for the Aqueduct broker.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use aqueduct_client::{Client, ConnectOptions};
//! use futures_util::StreamExt;
//!
//! let client = Client::connect(ConnectOptions::new("localhost:4242")).await?;
//! let mut orders = client.subscribe("orders/#").await?;
//! client.publish("orders/eu", "hello").await?;
//! if let Some(Ok(msg)) = orders.next().await {
//!     println!("{} #{}: {:?}", msg.topic(), msg.offset(), msg.body());
//! }
//! # Ok(()) }
//! ```
//!
//! [`Client`] is a cheap `Clone` handle over one QUIC connection (or, with
//! [`ConnectOptions::transport`], one WebTransport session, as browsers connect). Publishes share one stream;
//! each subscription has its own stream and is a [`futures_core::Stream`] of [`Message`]s.
//! Dropping a [`Subscription`] inside a Tokio runtime unsubscribes (outside one, its stream is
//! only finished). Broker refusals are [`ClientError::Broker`] with
//! the ERROR code and reason. The client does not reconnect by itself: [`Client::closed`] says
//! when and why the connection ended.

mod client;
mod error;
mod ids;
mod link;
mod options;
mod publisher;
mod reader;
mod subscription;
#[cfg(test)]
mod test_broker;
mod tls;
pub mod trace;

/// What [`Client::info`] answers: the broker's limits and version (protocol.md §4.1).
pub use aqueduct_proto::Info as BrokerInfo;
pub use aqueduct_proto::{DurableStart, ErrorCode, OverflowPolicy, Priority};
pub use client::QuicStats;
pub use client::{Client, PublishOptions, SubscribeOptions};
pub use error::{ClientError, ConnectError};
pub use link::Transport;
pub use options::{
    default_dev_cert_file, ConnectOptions, Trust, DEFAULT_ACK_DELAY,
    DEFAULT_ACK_ELICITING_THRESHOLD, MAX_ACK_ELICITING_THRESHOLD,
};
pub use publisher::Publisher;
pub use subscription::{Message, MessageRef, Settler, Subscription};
pub use trace::{new_trace, TraceContext};
