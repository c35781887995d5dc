//! The Aqueduct broker on the network.
//!
//! [`Server::bind`] sets up TLS 1.3 (ALPN `aqueduct-v1`) and a quinn endpoint from a validated
//! [`Config`]; [`Server::serve`] accepts connections until a shutdown signal, then stops
//! accepting, flushes queued deliveries and closes every connection with a reason. [`run`] does
//! both. Routing, queueing and settlement are `aqueduct-core`'s; this crate is the I/O around it:
//!
//! - [`config`]: YAML + `AQUEDUCT_*` env + flags, validated once;
//! - [`access`]: ACL, publish quotas, the admin state file;
//! - [`tls`]: certificates (files or generated dev certificate), mTLS, client ids;
//! - `connection`: handshake, 0-RTT gating, per-connection subscription table;
//! - `stream`: frame reader and coalescing writer for one QUIC stream.

pub mod access;
pub mod admin;
pub mod cluster;
pub mod config;
mod connection;
mod consumers;
pub mod discovery;
pub mod durable;
mod eviction;
mod http;
pub mod mesh;
pub mod mesh_tls;
pub mod metrics;
pub mod otel;
pub mod revocation;
mod server;
pub mod stats;
mod stream;
pub mod tls;
mod warn_every;
pub mod webtransport;

pub use config::{Config, ConfigError, Overrides, Sources};
pub use consumers::ConsumerLimits;
pub use server::{run, Control, Server, ServerError};
pub use stats::ServerStats;
