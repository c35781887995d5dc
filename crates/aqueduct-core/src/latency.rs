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

/// Observations gathered locally (no atomics) and added to a [`LatencyHistogram`] in one go:
/// a writer draining a hundred deliveries pays a handful of atomic adds, not three per message.
#[derive(Debug)]
pub struct LocalLatency {
    buckets: [u32; BOUNDS_US.len() + 1],
    sum_ns: u64,
    count: u32,
}

impl Default for LocalLatency {
    fn default() -> Self {
        LocalLatency {
            buckets: [0; BOUNDS_US.len() + 1],
            sum_ns: 0,
            count: 0,
        }
    }
}

/// Nanoseconds in u64 arithmetic (no u128 on the hot path; saturates after 584 years).
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// The bucket of a latency: a linear scan, which ends after a step or two for the common
/// sub-millisecond latencies.
fn bucket(ns: u64) -> usize {
    // Rounded up: 10.5 µs is above the 10 µs bound (truncated, it was counted under it).
    let us = ns.div_ceil(1_000);
    BOUNDS_US
        .iter()
        .position(|&b| us <= b)
        .unwrap_or(BOUNDS_US.len())
}

impl LocalLatency {
    pub fn observe(&mut self, latency: Duration) {
        self.observe_n(latency, 1);
    }

    /// `n` observations of the same latency (deliveries of one publish frame drained together).
    pub fn observe_n(&mut self, latency: Duration, n: u32) {
        let ns = nanos(latency);
        self.buckets[bucket(ns)] += n;
        self.sum_ns = self.sum_ns.saturating_add(ns.saturating_mul(u64::from(n)));
        self.count += n;
    }

    /// Add everything to `into`.
    pub fn flush(&self, into: &LatencyHistogram) {
        if self.count == 0 {
            return;
        }
        for (shared, &n) in into.buckets.iter().zip(&self.buckets) {
            if n > 0 {
                shared.fetch_add(u64::from(n), Relaxed);
            }
        }
        into.sum_ns.fetch_add(self.sum_ns, Relaxed);
        into.count.fetch_add(u64::from(self.count), Relaxed);
    }
}

impl LatencyHistogram {
    /// Record one observation.
    pub fn observe(&self, latency: Duration) {
        let ns = nanos(latency);
        self.buckets[bucket(ns)].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
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
    fn local_batches_add_up_to_the_same() {
        let direct = LatencyHistogram::default();
        let batched = LatencyHistogram::default();
        let mut local = LocalLatency::default();
        for us in [0, 0, 1, 10, 10, 11, 400, 400, 2_000_000, 99_000_000, 0, 400] {
            direct.observe(Duration::from_micros(us));
            local.observe(Duration::from_micros(us));
        }
        // A run of one latency at once.
        for _ in 0..3 {
            direct.observe(Duration::from_micros(30));
        }
        local.observe_n(Duration::from_micros(30), 3);
        local.flush(&batched);
        assert_eq!(direct.snapshot(), batched.snapshot());
    }

    #[test]
    fn buckets_are_upper_bounds_and_cumulative() {
        let h = LatencyHistogram::default();
        h.observe(Duration::from_micros(5)); // ≤ 10
        h.observe(Duration::from_micros(10)); // ≤ 10
        h.observe(Duration::from_micros(11)); // ≤ 25
        h.observe(Duration::from_nanos(10_500)); // above 10: ≤ 25
        h.observe(Duration::from_secs(60)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.cumulative.len(), BOUNDS_US.len() + 1);
        assert_eq!(&s.cumulative[..3], &[2, 4, 4]);
        assert_eq!(s.cumulative[BOUNDS_US.len() - 1], 4);
        assert_eq!(*s.cumulative.last().expect("+Inf"), 5);
        assert_eq!(s.count, 5);
        assert_eq!(
            s.sum,
            Duration::from_micros(5 + 10 + 11)
                + Duration::from_nanos(10_500)
                + Duration::from_secs(60)
        );
    }
}
