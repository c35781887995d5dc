//! A fixed-bucket, lock-free histogram for publish → delivery latency: one relaxed atomic add per
//! observation (plus sum and count), read at scrape time. Buckets follow Prometheus conventions
//! (upper bounds, cumulative when exported).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (the last bucket is +Inf).
pub const BOUNDS_US: [u64; 19] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Counts per bucket (not cumulative), total count and sum.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; BOUNDS_US.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// A copy of a [`LatencyHistogram`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// Cumulative counts for each bound in [`BOUNDS_US`], then +Inf (= `count`).
    pub cumulative: Vec<u64>,
    pub sum: Duration,
    pub count: u64,
}

impl LatencyHistogram {
    /// Record one observation.
    pub fn observe(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let i = BOUNDS_US.partition_point(|&b| b < us);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX),
            Relaxed,
        );
        self.count.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        let mut acc = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Relaxed);
                acc
            })
            .collect();
        LatencySnapshot {
            cumulative,
            sum: Duration::from_nanos(self.sum_ns.load(Relaxed)),
            count: self.count.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_upper_bounds_and_cumulative() {
        let h = LatencyHistogram::default();
        h.observe(Duration::from_micros(5)); // ≤ 10
        h.observe(Duration::from_micros(10)); // ≤ 10
        h.observe(Duration::from_micros(11)); // ≤ 25
        h.observe(Duration::from_secs(60)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.cumulative.len(), BOUNDS_US.len() + 1);
        assert_eq!(&s.cumulative[..3], &[2, 3, 3]);
        assert_eq!(s.cumulative[BOUNDS_US.len() - 1], 3);
        assert_eq!(*s.cumulative.last().expect("+Inf"), 4);
        assert_eq!(s.count, 4);
        assert_eq!(
            s.sum,
            Duration::from_micros(5 + 10 + 11) + Duration::from_secs(60)
        );
    }
}
