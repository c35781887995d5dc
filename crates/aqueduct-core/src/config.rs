//! The broker-core settings (the seed's `broker.*` keys), already validated and typed.

use std::time::Duration;

use aqueduct_proto::{OverflowPolicy, Priority};

/// Routing, queueing and settlement settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Capacity of each of a subscriber's four priority queues (`broker.queue_size`).
    pub queue_size: usize,
    /// Default overflow policy (`broker.backpressure_policy`); a subscription may override it.
    pub backpressure_policy: OverflowPolicy,
    /// Redeliveries after the first attempt before a message is dead-lettered (`broker.max_retries`).
    pub max_retries: u32,
    /// How long a delivery may stay unsettled before it is redelivered (`broker.ack_wait`).
    pub ack_wait: Duration,
    /// Lifetime per priority; zero means "use the message's own TTL" (`broker.priority_ttls`).
    pub priority_ttls: [Duration; Priority::LEVELS],
    /// Unsettled deliveries a subscriber may hold before the broker stops sending it more
    /// (`broker.max_in_flight`). Bounds memory for consumers that never acknowledge.
    pub max_in_flight: usize,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            queue_size: 1024,
            backpressure_policy: OverflowPolicy::DropOldest,
            max_retries: 3,
            ack_wait: Duration::from_secs(30),
            priority_ttls: [Duration::ZERO; Priority::LEVELS],
            max_in_flight: 1024,
        }
    }
}

impl BrokerConfig {
    /// How long a message of `priority` with its own `ttl` may live: the priority's TTL when set,
    /// else the message's, else forever (`None`).
    pub fn lifetime(&self, priority: Priority, ttl: Option<Duration>) -> Option<Duration> {
        let by_priority = self.priority_ttls[priority.index()];
        if !by_priority.is_zero() {
            Some(by_priority)
        } else {
            ttl.filter(|t| !t.is_zero())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_ttl_overrides_message_ttl() {
        let mut c = BrokerConfig::default();
        let ms = Duration::from_millis;
        assert_eq!(c.lifetime(Priority::HIGHEST, None), None);
        assert_eq!(c.lifetime(Priority::HIGHEST, Some(ms(5))), Some(ms(5)));
        c.priority_ttls[0] = ms(100);
        assert_eq!(c.lifetime(Priority::HIGHEST, Some(ms(5))), Some(ms(100)));
        assert_eq!(c.lifetime(Priority::HIGHEST, None), Some(ms(100)));
        assert_eq!(c.lifetime(Priority::LOWEST, Some(ms(0))), None);
    }
}
