//! Publish quotas: a token bucket per client id (the seed's `broker.quotas`).
//!
//! A bucket holds `burst` tokens and refills at `rate` tokens per second; each published message
//! takes one (a batch takes one per message). It is kept as a GCRA "theoretical arrival time"
//! in one atomic, so a check is one load and one compare-and-swap, shared by every connection of
//! the client without a lock. Time is passed in as nanoseconds since any fixed origin.
//!
//! Two ways to use it: [`Bucket::take`] always takes the tokens, running into debt, and says how
//! long the caller should stop reading (the broker's `throttle` action: nothing is lost);
//! [`Bucket::try_take`] takes them only if they are there (the `reject` action).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A rate and a burst. `rate == 0` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuotaSpec {
    /// Messages per second; 0 = unlimited.
    pub rate: u64,
    /// Messages that may be published at once after a quiet time (at least 1).
    pub burst: u64,
}

impl QuotaSpec {
    pub const UNLIMITED: QuotaSpec = QuotaSpec { rate: 0, burst: 1 };

    fn interval_ns(self) -> u64 {
        1_000_000_000u64
            .checked_div(self.rate)
            .map_or(0, |interval| interval.max(1))
    }
}

/// Tokens [`Bucket::take_costing`] took: the time they cost then (ns; 0: none, an unlimited
/// bucket), and the bucket's rescale word then ([`Bucket::refund`] scales the cost by the
/// rescales since).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Taken {
    cost: u64,
    scale: u64,
}

/// The rescale word: the era (how many times a raised quota forgave the debt, wrapping) in the
/// high 16 bits; in the low 48, by how much faster rates shrank the time owed within the era, as
/// a base-2 logarithm in units of 2^-20 (a rate ten times faster adds log2(10) × 2^20). A
/// logarithm, not the product of the factors: rates toggled between faster-with-a-smaller-burst
/// and slower (a day/night schedule) shrink the product tenfold a day, and a fixed-point product
/// lost its precision and then reached 0, after which no refund gave anything back.
const SCALE_BITS: u32 = 48;
const SCALE_MASK: u64 = (1 << SCALE_BITS) - 1;
/// The logarithm's units per halving.
const SCALE_FRAC: f64 = (1u64 << 20) as f64;

/// The next era's rescale word (nothing shrunk yet).
fn next_era(word: u64) -> u64 {
    (word >> SCALE_BITS).wrapping_add(1) << SCALE_BITS
}

/// One client's bucket.
#[derive(Debug)]
pub struct Bucket {
    /// Nanoseconds per token; 0 = unlimited.
    interval: AtomicU64,
    /// The rate as set (the interval does not give it back exactly above ~31k/s).
    rate: AtomicU64,
    burst: AtomicU64,
    /// When the bucket will be full again (GCRA's theoretical arrival time), in ns.
    tat: AtomicU64,
    /// How the time owed was rescaled since the bucket was made (see [`Taken`]).
    scale: AtomicU64,
    /// Time publishers spent held back (throttle), ns; messages refused (reject).
    throttled_ns: AtomicU64,
    rejected: AtomicU64,
}

impl Bucket {
    pub fn new(spec: QuotaSpec) -> Bucket {
        Bucket {
            interval: AtomicU64::new(spec.interval_ns()),
            rate: AtomicU64::new(spec.rate),
            burst: AtomicU64::new(spec.burst.max(1)),
            tat: AtomicU64::new(0),
            scale: AtomicU64::new(0),
            throttled_ns: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Count time a publisher of this client was held back.
    pub fn record_throttled(&self, held: Duration) {
        self.throttled_ns
            .fetch_add(held.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Count messages refused.
    pub fn record_rejected(&self, n: u64) {
        self.rejected.fetch_add(n, Ordering::Relaxed);
    }

    /// (time held back, messages refused) so far.
    pub fn counters(&self) -> (Duration, u64) {
        (
            Duration::from_nanos(self.throttled_ns.load(Ordering::Relaxed)),
            self.rejected.load(Ordering::Relaxed),
        )
    }

    /// Change the rate and burst, at once for every holder. A raised quota (rate and burst
    /// both at least as high, one of them higher; or unlimited) forgives the debt run up under
    /// the old one, so it is felt immediately. A higher rate with a smaller burst keeps the
    /// messages owed, paid at the new rate (the time owed at the old rate held a client
    /// whose rate went from 10/s to 100,000/s for the 100 s its 1,000 messages had cost). A
    /// lower rate keeps the time owed: the client's held publishers would otherwise all go at
    /// once, with a fresh burst on top.
    /// `now_ns` is the clock the takes use.
    pub fn set(&self, spec: QuotaSpec, now_ns: u64) {
        let old = self.spec();
        let burst = spec.burst.max(1);
        let raised = spec.rate == 0
            || (old.rate != 0
                && spec.rate >= old.rate
                && burst >= old.burst
                && (spec.rate > old.rate || burst > old.burst));
        let faster = old.rate != 0 && spec.rate > old.rate;
        let (old_interval, new_interval) = (old.interval_ns(), spec.interval_ns());
        self.interval.store(new_interval, Ordering::Relaxed);
        self.rate.store(spec.rate, Ordering::Relaxed);
        self.burst.store(spec.burst.max(1), Ordering::Relaxed);
        if raised {
            self.tat.store(0, Ordering::Relaxed);
            let _ = self
                .scale
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                    Some(next_era(word))
                });
        } else if faster && old_interval > 0 {
            let _ = self
                .tat
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                    let owed = u128::from(tat.saturating_sub(now_ns));
                    let rescaled = owed * u128::from(new_interval) / u128::from(old_interval);
                    Some(now_ns.saturating_add(rescaled as u64).min(tat))
                });
            let _ = self
                .scale
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                    // Rounded up: a refund then gives back a hair less, never more.
                    let halvings = (old_interval as f64 / new_interval.max(1) as f64).log2();
                    let shrunk = (word & SCALE_MASK) + (halvings * SCALE_FRAC).ceil() as u64;
                    Some(if shrunk > SCALE_MASK {
                        next_era(word)
                    } else {
                        word & !SCALE_MASK | shrunk
                    })
                });
        }
    }

    /// The current rate and burst.
    pub fn spec(&self) -> QuotaSpec {
        QuotaSpec {
            rate: self.rate.load(Ordering::Relaxed),
            burst: self.burst.load(Ordering::Relaxed),
        }
    }

    /// Is the bucket unlimited?
    pub fn unlimited(&self) -> bool {
        self.interval.load(Ordering::Relaxed) == 0
    }

    /// Take `n` tokens, into debt if need be; returns how long the caller should wait before
    /// taking more (zero: none).
    pub fn take(&self, n: u64, now_ns: u64) -> Duration {
        self.take_costing(n, now_ns).0
    }

    /// [`take`](Self::take), also returning what was taken (what [`refund`](Self::refund)
    /// gives back: the interval may change meanwhile).
    pub fn take_costing(&self, n: u64, now_ns: u64) -> (Duration, Taken) {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return (Duration::ZERO, Taken::default());
        }
        let cost = interval.saturating_mul(n);
        let scale = self.scale.load(Ordering::Acquire);
        let prev = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.max(now_ns).saturating_add(cost))
            })
            .unwrap_or_else(|tat| tat);
        let tat = prev.max(now_ns).saturating_add(cost);
        (self.debt(tat, interval, now_ns), Taken { cost, scale })
    }

    /// Give back tokens [`take_costing`](Self::take_costing) took, for messages that were then
    /// not published (their frame was abandoned while it waited: the stream or connection
    /// closed). A debt run up by frames never published would hold every publisher of the
    /// client id.
    ///
    /// What goes back is the time the tokens cost when taken, rescaled as the time owed was
    /// since ([`set`](Self::set)): a faster rate rescaled what is owed, and giving back the
    /// old, larger cost would forgive other frames' debt too; a slower rate kept the time owed,
    /// which is what goes back. After a raised quota forgave the debt, nothing goes back (the
    /// tokens are no longer owed; giving them back would forgive frames taken since).
    /// A take or refund at the very moment the rate changes may use the rescale word from
    /// before the change: a take then gives back less later, a refund gives back its unscaled
    /// cost (at most that frame's own tokens at the old rate).
    pub fn refund(&self, taken: Taken) {
        let now = self.scale.load(Ordering::Acquire);
        if taken.cost == 0 || now >> SCALE_BITS != taken.scale >> SCALE_BITS {
            return;
        }
        let shrunk = (now & SCALE_MASK).saturating_sub(taken.scale & SCALE_MASK);
        // At most the cost taken (the factor is at most 1), so the cast cannot overflow.
        let cost = (taken.cost as f64 * (-(shrunk as f64) / SCALE_FRAC).exp2()) as u64;
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.saturating_sub(cost))
            });
    }

    /// Take `n` tokens if the bucket has them; otherwise take nothing and return how long until
    /// it would.
    pub fn try_take(&self, n: u64, now_ns: u64) -> Result<(), Duration> {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return Ok(());
        }
        let cost = interval.saturating_mul(n);
        let allowance = interval.saturating_mul(self.burst.load(Ordering::Relaxed));
        self.tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                let next = tat.max(now_ns).saturating_add(cost);
                (next - now_ns <= allowance).then_some(next)
            })
            .map(|_| ())
            .map_err(|tat| {
                let next = tat.max(now_ns).saturating_add(cost);
                Duration::from_nanos(next - now_ns - allowance)
            })
    }

    /// How long until the debt is paid (zero: none).
    pub fn wait(&self, now_ns: u64) -> Duration {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return Duration::ZERO;
        }
        self.debt(self.tat.load(Ordering::Acquire), interval, now_ns)
    }

    fn debt(&self, tat: u64, interval: u64, now_ns: u64) -> Duration {
        let allowance = interval.saturating_mul(self.burst.load(Ordering::Relaxed));
        Duration::from_nanos(tat.saturating_sub(now_ns).saturating_sub(allowance))
    }
}

/// The quota configuration: a default and per-client overrides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QuotaPolicy {
    pub default: QuotaSpec,
    pub clients: HashMap<String, QuotaSpec>,
}

impl Default for QuotaSpec {
    fn default() -> Self {
        QuotaSpec::UNLIMITED
    }
}

impl QuotaPolicy {
    /// The quota that applies to `client`.
    pub fn spec_for(&self, client: &str) -> QuotaSpec {
        self.clients.get(client).copied().unwrap_or(self.default)
    }
}

/// Every client's bucket and the policy they follow. Buckets are shared by all connections of
/// one client id. Past 10,000 buckets, those no connection holds that owe nothing are let go of
/// (client ids can churn: certificates issued per pod); their counters start again from zero if
/// the client comes back. Locked only on connect and on a policy change, never per message.
#[derive(Debug)]
pub struct Quotas {
    inner: Mutex<QuotasInner>,
    /// The origin of the quota clock ([`Quotas::now_ns`]).
    epoch: std::time::Instant,
}

impl Default for Quotas {
    fn default() -> Quotas {
        Quotas::new(QuotaPolicy::default())
    }
}

#[derive(Debug, Default)]
struct QuotasInner {
    policy: QuotaPolicy,
    buckets: HashMap<String, Arc<Bucket>>,
    /// Client ids in the order their buckets were made (metric labels stay stable).
    order: Vec<String>,
    /// The number of buckets at which the idle ones are let go of next.
    prune_at: usize,
}

/// Buckets kept before those no connection holds, and that owe nothing, are let go of (client
/// ids come and go: certificates issued per pod). One that owes is kept, or a client could
/// shed its debt by reconnecting.
const KEPT_BUCKETS: usize = 10_000;

impl QuotasInner {
    /// Give every bucket the spec `policy` assigns it (debt kept where nothing changed).
    fn apply(&mut self, now_ns: u64) {
        for (client, bucket) in &self.buckets {
            let spec = self.policy.spec_for(client);
            if bucket.spec() != spec {
                bucket.set(spec, now_ns);
            }
        }
    }
}

impl Quotas {
    pub fn new(policy: QuotaPolicy) -> Quotas {
        Quotas {
            inner: Mutex::new(QuotasInner {
                policy,
                buckets: HashMap::new(),
                order: Vec::new(),
                prune_at: KEPT_BUCKETS,
            }),
            epoch: std::time::Instant::now(),
        }
    }

    /// The quota clock: nanoseconds since these quotas were made. Takes and policy changes
    /// read the same clock.
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QuotasInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bucket of `client` (shared with its other connections).
    pub fn bucket(&self, client: &str) -> Arc<Bucket> {
        let mut inner = self.lock();
        if let Some(b) = inner.buckets.get(client) {
            return b.clone();
        }
        if inner.buckets.len() >= inner.prune_at {
            // Full again (GCRA: no time ahead of now), and held by nobody else: a new bucket
            // for that client would be the same.
            let now = self.now_ns();
            inner
                .buckets
                .retain(|_, b| Arc::strong_count(b) > 1 || b.tat.load(Ordering::Acquire) > now);
            let QuotasInner { buckets, order, .. } = &mut *inner;
            order.retain(|id| buckets.contains_key(id));
            // Amortized: the next sweep waits until as many again were made.
            inner.prune_at = KEPT_BUCKETS.max(2 * inner.buckets.len());
        }
        let bucket = Arc::new(Bucket::new(inner.policy.spec_for(client)));
        inner.buckets.insert(client.to_string(), bucket.clone());
        inner.order.push(client.to_string());
        bucket
    }

    /// The current policy.
    pub fn policy(&self) -> QuotaPolicy {
        self.lock().policy.clone()
    }

    /// Install a new policy; every existing bucket takes its new spec at once.
    pub fn replace(&self, policy: QuotaPolicy) {
        let mut inner = self.lock();
        inner.policy = policy;
        inner.apply(self.now_ns());
    }

    /// Change the policy with `f` and apply it, all under the lock: concurrent updates are
    /// applied one after the other, none lost.
    pub fn update<T>(&self, f: impl FnOnce(&mut QuotaPolicy) -> T) -> T {
        let mut inner = self.lock();
        let out = f(&mut inner.policy);
        inner.apply(self.now_ns());
        out
    }

    /// Known clients and their buckets, in the order the buckets were made.
    pub fn buckets(&self) -> Vec<(String, Arc<Bucket>)> {
        let inner = self.lock();
        inner
            .order
            .iter()
            .filter_map(|id| inner.buckets.get(id).map(|b| (id.clone(), b.clone())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn burst_then_rate() {
        let b = Bucket::new(QuotaSpec { rate: 10, burst: 5 });
        for _ in 0..5 {
            assert_eq!(b.take(1, 0), Duration::ZERO);
        }
        // The sixth is in debt by one interval (100 ms).
        assert_eq!(b.take(1, 0), Duration::from_millis(100));
        assert_eq!(b.wait(S / 20), Duration::from_millis(50));
        assert_eq!(b.wait(S / 10), Duration::ZERO);
    }

    /// Tokens given back are as if never taken: a debt run up for a frame that was then not
    /// published goes away with it.
    #[test]
    fn a_refund_takes_back_the_debt() {
        let b = Bucket::new(QuotaSpec {
            rate: 10,
            burst: 10,
        });
        assert_eq!(b.take(10, 0), Duration::ZERO);
        let (wait, cost) = b.take_costing(2_000, 0);
        assert_eq!(wait, Duration::from_secs(200));
        b.refund(cost);
        assert_eq!(b.wait(0), Duration::ZERO);
        // The burst the first take used stays used.
        assert_eq!(b.take(1, 0), Duration::from_millis(100));
        // Lowered while a frame waits: what is given back is what it took, not more (another
        // frame's debt stays).
        let b = Bucket::new(QuotaSpec {
            rate: 10,
            burst: 10,
        });
        b.take(10, 0);
        let (_, cost) = b.take_costing(2_000, 0);
        b.take(100, 0);
        b.set(QuotaSpec { rate: 1, burst: 10 }, 0);
        b.refund(cost);
        assert_eq!(
            b.wait(0),
            Duration::from_secs(1),
            "1 s + the other frame's 10 s - 10 s of burst"
        );
        // Unlimited: nothing taken, nothing to give back.
        let free = Bucket::new(QuotaSpec::UNLIMITED);
        let (wait, taken) = free.take_costing(5, 0);
        assert_eq!(wait, Duration::ZERO);
        free.refund(taken);
        assert_eq!(free.take(1, 0), Duration::ZERO);
    }

    #[test]
    fn long_run_rate_is_the_rate() {
        let b = Bucket::new(QuotaSpec {
            rate: 1000,
            burst: 10,
        });
        // A publisher that takes one token and then waits as told.
        let mut now = 0u64;
        let mut sent = 0u64;
        while now < 5 * S {
            let wait = b.take(1, now);
            sent += 1;
            now += wait.as_nanos() as u64;
        }
        assert!((5000..=5011).contains(&sent), "{sent}");
    }

    #[test]
    fn try_take_refuses_without_taking() {
        let b = Bucket::new(QuotaSpec { rate: 10, burst: 3 });
        assert!(b.try_take(3, 0).is_ok());
        assert_eq!(b.try_take(1, 0), Err(Duration::from_millis(100)));
        assert_eq!(b.try_take(1, S / 10), Ok(()));
        // A batch bigger than the burst can never pass.
        assert!(b.try_take(4, 100 * S).is_err());
    }

    #[test]
    fn concurrent_updates_are_all_kept() {
        let q = Arc::new(Quotas::default());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        q.update(|p| {
                            p.clients
                                .insert(format!("c{t}-{i}"), QuotaSpec { rate: i, burst: 1 });
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(q.policy().clients.len(), 800);
    }

    #[test]
    fn specs_round_trip_so_unrelated_changes_keep_debt() {
        let q = Quotas::new(QuotaPolicy {
            default: QuotaSpec {
                rate: 60_000,
                burst: 1,
            },
            clients: HashMap::new(),
        });
        let b = q.bucket("fast");
        assert_eq!(b.spec().rate, 60_000);
        b.take(1000, 0);
        let debt = b.wait(0);
        assert!(!debt.is_zero());
        q.update(|p| {
            p.clients
                .insert("other".into(), QuotaSpec { rate: 1, burst: 1 });
        });
        assert_eq!(
            b.wait(0),
            debt,
            "a change for another client forgave the debt"
        );
        assert_eq!(
            q.buckets()
                .into_iter()
                .map(|(id, _)| id)
                .collect::<Vec<_>>(),
            ["fast"]
        );
    }

    /// The buckets of clients gone (no connection holds them) that owe nothing are let go of
    /// once there are many: they were kept for every client id ever seen. Held ones, and ones
    /// that owe, stay.
    #[test]
    fn idle_buckets_of_clients_gone_are_let_go_of() {
        let q = Quotas::new(QuotaPolicy {
            default: QuotaSpec { rate: 10, burst: 1 },
            clients: HashMap::new(),
        });
        let held = q.bucket("held");
        let owing = q.bucket("owing");
        owing.take(100, q.now_ns());
        drop(owing);
        // One that published and has refilled since (at 10^9/s, a nanosecond later) owes
        // nothing: let go of like the unused ones.
        q.update(|p| {
            p.clients.insert(
                "refilled".into(),
                QuotaSpec {
                    rate: 1_000_000_000,
                    burst: 1,
                },
            )
        });
        let refilled = q.bucket("refilled");
        refilled.take(1, q.now_ns());
        drop(refilled);
        for i in 0..KEPT_BUCKETS + 10 {
            drop(q.bucket(&format!("pod-{i}")));
        }
        let ids: Vec<String> = q.buckets().into_iter().map(|(id, _)| id).collect();
        assert!(ids.len() < KEPT_BUCKETS, "{}", ids.len());
        assert!(ids.contains(&"held".to_string()));
        assert!(ids.contains(&"owing".to_string()), "its debt stays");
        assert!(!ids.contains(&"refilled".to_string()), "{ids:?}");
        assert!(Arc::ptr_eq(&q.bucket("held"), &held));
    }

    /// A faster rate with a smaller burst: the messages owed are paid at the new rate, not the
    /// time they cost at the old one (10/s to 100,000/s held a client 100 s for 1,000 messages).
    /// Raised to a faster rate (with a smaller burst, so the debt is rescaled, not forgiven)
    /// while a frame waits: giving back the time its tokens cost at the old rate forgave the
    /// other frames' debt as well.
    #[test]
    fn a_refund_after_a_faster_rate_gives_back_only_its_own_messages() {
        let b = Bucket::new(QuotaSpec { rate: 10, burst: 2 });
        b.take(2, 0);
        // Two frames wait: 100 messages (10 s at 10/s), then another 100.
        let (_, waiting) = b.take_costing(100, 0);
        b.take(100, 0);
        b.set(
            QuotaSpec {
                rate: 100,
                burst: 1,
            },
            0,
        );
        // 200 messages owed at 100/s.
        let owed = b.wait(0);
        assert!(owed >= Duration::from_millis(1_990), "{owed:?}");
        // The first frame is abandoned: the other's 100 messages are still owed (1 s, and
        // the burst's 2 taken first).
        b.refund(waiting);
        let owed = b.wait(0);
        assert!(
            owed >= Duration::from_millis(1_000) && owed <= Duration::from_millis(1_030),
            "{owed:?}"
        );
    }

    /// Lowered, then raised part of the way back (a smaller burst, so rescaled, not forgiven)
    /// while a frame waits: what goes back is that frame's share of the rescaled debt. Giving
    /// back the smaller of its old cost and its messages at today's rate (10 s) forgave the
    /// other frame's debt as well.
    #[test]
    fn a_refund_after_a_lower_then_faster_rate_gives_back_only_its_share() {
        let b = Bucket::new(QuotaSpec {
            rate: 10,
            burst: 10,
        });
        b.take(10, 0);
        // Two frames wait: 100 messages (10 s at 10/s), then another 100.
        let (_, waiting) = b.take_costing(100, 0);
        b.take(100, 0);
        // 1/s keeps the 21 s owed; 5/s rescales them to 4.2 s, the first frame's 10 s to 2 s.
        b.set(QuotaSpec { rate: 1, burst: 10 }, 0);
        b.set(QuotaSpec { rate: 5, burst: 5 }, 0);
        b.refund(waiting);
        // 2.2 s owed, less 1 s of burst.
        let owed = b.wait(0);
        assert!(
            owed >= Duration::from_millis(1_190) && owed <= Duration::from_millis(1_210),
            "{owed:?}"
        );
    }

    /// Rates toggled between faster-with-a-smaller-burst and slower (a day/night schedule)
    /// shrink the time owed tenfold a day: refunds go on working however often (a fixed-point
    /// product of the factors reached 0 after 15 toggles, and no refund gave anything back from
    /// then on).
    #[test]
    fn refunds_keep_working_after_many_rate_changes() {
        let day = QuotaSpec {
            rate: 100,
            burst: 10,
        };
        let night = QuotaSpec {
            rate: 10,
            burst: 100,
        };
        let b = Bucket::new(night);
        for _ in 0..1_000 {
            b.set(day, 0);
            b.set(night, 0);
        }
        b.set(day, 0);
        b.take(10, 0);
        let (wait, waiting) = b.take_costing(100, 0);
        assert_eq!(wait, Duration::from_secs(1));
        b.refund(waiting);
        assert_eq!(b.wait(0), Duration::ZERO, "given back");
        // Across a change: the frame's tokens rescaled with the rest (100 at 10/s, then 100/s).
        b.set(night, 0);
        b.take(100, 0);
        let (_, waiting) = b.take_costing(100, 0);
        b.take(100, 0);
        b.set(day, 0);
        // 300 messages owed at 100/s (3.01 s, with the burst's 10 before them) less 10 of
        // burst; the frame's 100 go back: 1.91 s.
        b.refund(waiting);
        let owed = b.wait(0);
        assert!(
            owed >= Duration::from_millis(1_905) && owed <= Duration::from_millis(1_915),
            "{owed:?}"
        );
    }

    /// A raised quota forgives the debt; a frame taken before it and abandoned after gives
    /// back nothing, or it would forgive the frames taken since.
    #[test]
    fn a_refund_after_a_raised_quota_gives_back_nothing() {
        let b = Bucket::new(QuotaSpec { rate: 10, burst: 1 });
        b.take(1, 0);
        let (_, waiting) = b.take_costing(100, 0);
        b.set(QuotaSpec { rate: 20, burst: 1 }, 0);
        assert_eq!(b.wait(0), Duration::ZERO, "forgiven");
        b.take(1, 0);
        b.take(40, 0);
        let owed = b.wait(0);
        assert_eq!(owed, Duration::from_secs(2));
        b.refund(waiting);
        assert_eq!(b.wait(0), owed, "the frames taken since still owe");
    }

    #[test]
    fn a_faster_rate_with_a_smaller_burst_owes_messages_not_time() {
        let b = Bucket::new(QuotaSpec {
            rate: 10,
            burst: 1000,
        });
        let now = 5_000_000_000;
        b.take(1000, now);
        b.take(10, now);
        assert!(
            b.wait(now) >= Duration::from_millis(900),
            "{:?}",
            b.wait(now)
        );
        b.set(
            QuotaSpec {
                rate: 100_000,
                burst: 1,
            },
            now,
        );
        let owed = b.wait(now);
        assert!(owed <= Duration::from_millis(11), "{owed:?}");
        assert!(owed >= Duration::from_millis(9), "still owed: {owed:?}");
        // Changed while the client waits, long after its last take: what is owed then counts,
        // not what was owed at the take (10/s, burst 1,000, 2,000 taken; 90 s later 20/s,
        // burst 500: 1,100 messages still owed, 55 s at the new rate, less 25 s of burst).
        let b = Bucket::new(QuotaSpec {
            rate: 10,
            burst: 1000,
        });
        b.take(2000, now);
        let later = now + 90_000_000_000;
        b.set(
            QuotaSpec {
                rate: 20,
                burst: 500,
            },
            later,
        );
        let owed = b.wait(later);
        assert!(
            owed >= Duration::from_millis(29_900) && owed <= Duration::from_millis(30_100),
            "{owed:?}"
        );
    }

    /// Lowering a throttled client's quota forgave its debt: every publisher it held went at
    /// once. Now only a raised quota does.
    #[test]
    fn a_lowered_quota_keeps_the_debt_a_raised_one_forgives_it() {
        let b = Bucket::new(QuotaSpec { rate: 10, burst: 1 });
        b.take(100, 0);
        let debt = b.wait(0);
        assert!(debt >= Duration::from_secs(9), "{debt:?}");
        b.set(QuotaSpec { rate: 5, burst: 1 }, 0);
        // Still owed (less the new burst's allowance, one token at the new rate).
        let owed = b.wait(0);
        assert_eq!(
            owed,
            debt - Duration::from_millis(100),
            "lowered: still owed"
        );
        b.set(QuotaSpec { rate: 5, burst: 0 }, 0);
        assert_eq!(b.wait(0), owed, "unchanged (a burst of 0 is 1)");
        b.set(
            QuotaSpec {
                rate: 100,
                burst: 1,
            },
            0,
        );
        assert_eq!(b.wait(0), Duration::ZERO, "raised: forgiven");
        b.take(100, 0);
        b.set(QuotaSpec::UNLIMITED, 0);
        assert_eq!(b.wait(0), Duration::ZERO);
        b.set(QuotaSpec { rate: 10, burst: 1 }, 0);
        assert_eq!(
            b.wait(0),
            Duration::ZERO,
            "no debt was run up while unlimited"
        );
    }

    #[test]
    fn unlimited_is_free() {
        let b = Bucket::new(QuotaSpec::UNLIMITED);
        assert!(b.unlimited());
        assert_eq!(b.take(1_000_000, 0), Duration::ZERO);
        assert!(b.try_take(u64::MAX, 0).is_ok());
    }

    #[test]
    fn policy_change_reaches_live_buckets() {
        let q = Quotas::new(QuotaPolicy {
            default: QuotaSpec { rate: 1, burst: 1 },
            clients: HashMap::new(),
        });
        let a = q.bucket("a");
        assert!(Arc::ptr_eq(&a, &q.bucket("a")));
        assert!(a.take(1, 0).is_zero());
        assert!(!a.take(1, 0).is_zero());
        q.update(|p| {
            p.clients.insert(
                "a".into(),
                QuotaSpec {
                    rate: 1000,
                    burst: 100,
                },
            );
        });
        assert_eq!(
            a.spec(),
            QuotaSpec {
                rate: 1000,
                burst: 100
            }
        );
        assert!(a.take(50, 0).is_zero());
        assert_eq!(q.bucket("b").spec(), QuotaSpec { rate: 1, burst: 1 });
    }
}
