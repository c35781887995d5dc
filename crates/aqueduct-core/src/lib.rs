//! The Aqueduct broker without sockets.
//!
//! Everything here is synchronous and takes the current time as an argument, so every rule is
//! tested deterministically with a fake clock:
//! - [`matching`]: MQTT filter semantics (`+`, `#`, system topics);
//! - [`index`]: the subscription index (hash map for exact filters, trie for wildcards);
//! - [`queue`]: per-subscriber bounded priority queues and overflow policies;
//! - [`subscriber`]: a subscription's queues, in-flight deliveries and drain;
//! - [`group`]: consumer-group watermarks (committed offsets);
//! - [`moves`]: messages on their way between a durable consumer's places (consistent positions);
//! - [`broker`]: publish/fan-out, groups, ACK/NACK, redelivery, ack-wait timeouts, dead letters;
//! - [`topic`]: per-topic offsets and counters read by the metrics layer;
//! - [`acl`]: who may publish or subscribe to what (rules, precedence, per-stream cache);
//! - [`quota`]: per-client publish token buckets;
//! - [`mesh`]: the cluster mesh's decisions (peers, interest, forwarding), sans-IO;
//! - [`discovery`]: when to look peers up in DNS and what an answer changes;
//! - [`mesh_codec`]: the bytes of the mesh's control messages and forwarded copies' routing.
//!
//! The server crate owns sockets and tasks; it calls [`Broker::publish`] from each connection's
//! reader and [`Broker::drain`] from each subscription's writer. See `docs/architecture.md` for the
//! concurrency model.

pub mod acl;
pub mod broker;
pub mod config;
pub mod discovery;
pub mod full_watch;
pub mod group;
pub mod index;
pub mod latency;
pub mod matching;
pub mod mesh;
pub mod mesh_codec;
pub mod moves;
pub mod queue;
pub mod quota;
pub mod subscriber;
pub mod topic;

pub use broker::{
    dlq_topic, Broker, DeadLetterRecord, DeadLetterRouter, OffsetSource, Orphan, OrphanListener,
    Publication, PublishContext, PublishOutcome, SubscribeOptions, TopicSnapshot, DLQ_PREFIX,
    IDLE_TOPIC_SWEEP_MIN, MATCHED_TOPICS_KEPT,
};
pub use config::BrokerConfig;
pub use group::{GroupShared, RoundRobin};
pub use latency::{LatencyHistogram, LatencySnapshot};
pub use subscriber::{
    CloseReason, Delivery, DrainProgress, Drained, SettleError, Subscriber, SubscriberId, Waker,
};
pub use topic::{DropReason, TopicState, TopicStats, TopicStatsSnapshot};
