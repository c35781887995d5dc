//! Access control and quotas on a stream: the ACL checks of publish frames and SUBSCRIBEs, the
//! publish quota (throttle or RATE_LIMITED), and closing subscriptions the ACL no longer allows.

use std::sync::Arc;
use std::time::Instant;

use aqueduct_core::acl::AclCache;
use aqueduct_core::{CloseReason, PublishContext, Subscriber};
use aqueduct_proto::ErrorCode;
use tracing::debug;

use super::{close, lock, Reader, StreamOut, QUOTA_RECHECK};
use crate::access::QuotaAction;
use crate::connection::{ConnState, SubEntry};
use crate::server::Shared;

/// Ask the stream that delivers `entry` to close it because its client lost the permission to
/// subscribe (the ACL changed). Routing to it stops at once; the rest (the connection's table,
/// a durable consumer's bookkeeping, the ERROR NOT_AUTHORIZED) is done by that stream's own task
/// (`take_revocations`: before each write, while a write is blocked, and after the writer has
/// stopped until the reader ends), which cannot interleave with its reader making a
/// subscription.
/// Returns false if it was already asked.
pub(crate) fn request_revoke(shared: &Shared, entry: &SubEntry) -> bool {
    if !entry.out.queue_revocation(&entry.sub) {
        // Ended with its stream, or already asked.
        return false;
    }
    shared.broker.stop_routing(&entry.sub);
    entry.out.notify.notify_one();
    true
}

/// Close `sub`, delivered on `out`, with [`CloseReason::Revoked`]: as an UNSUBSCRIBE, and the
/// writer then sends ERROR NOT_AUTHORIZED with its stream id. Runs on the stream's own task.
/// Every revocation ends here (a walk's through [`request_revoke`]), and is counted here once.
pub(super) fn revoke(shared: &Shared, conn: &ConnState, out: &StreamOut, sub: &Arc<Subscriber>) {
    // An UNSUBSCRIBE on another stream may have taken it first: it ends it then.
    if !conn.remove_sub(sub.stream_id(), sub) {
        return;
    }
    shared
        .stats
        .acl_denied(aqueduct_core::acl::Action::Subscribe);
    let key = lock(&out.durables).remove(&sub.id());
    let mut ctx = PublishContext::default();
    close(
        shared,
        &mut ctx,
        sub,
        key.as_deref(),
        CloseReason::Revoked,
        Instant::now(),
    );
    shared.broker.watch_full(&mut ctx, Instant::now());
    out.notify.notify_one();
}

impl Reader<'_> {
    /// May this client publish to every topic of the frame? If not, ERROR NOT_AUTHORIZED naming
    /// the first refused topic, and nothing of the frame is published.
    pub(super) fn authorize_publish<'t>(
        &mut self,
        stream_id: u32,
        mut topics: impl Iterator<Item = &'t [u8]>,
    ) -> bool {
        let client = self.conn.identity();
        let acl = &self.shared.access.acl;
        if !self.acl.enabled(acl, client) {
            // Off: a batch's sub-frames are not walked.
            return true;
        }
        let Some(refused) = topics.find(|t| !self.acl.may_publish(acl, client, t)) else {
            return true;
        };
        self.shared
            .stats
            .acl_denied(aqueduct_core::acl::Action::Publish);
        let reason = format!(
            "client {client} may not publish to {}: refused by the ACL (nothing of this frame was published)",
            String::from_utf8_lossy(refused)
        );
        debug!(client = %self.conn.describe(), "{reason}");
        self.send_error(stream_id, ErrorCode::NOT_AUTHORIZED, reason);
        false
    }

    /// Take `n` messages from the client's quota, before the frame is routed. Throttle: the
    /// tokens are taken (into debt if need be) and, while the bucket is in debt, this stream is
    /// not read and the frame waits (QUIC flow control then holds the client; nothing is lost);
    /// re-checked at least every 50 ms, so a quota raised meanwhile applies at once. Reject:
    /// taken only if they are there, else ERROR RATE_LIMITED and the frame is dropped (`None`).
    /// The tokens taken are given back unless the caller says the frame went on
    /// ([`Owed::paid`]): a frame abandoned while it waits (here, or later for room in the
    /// durable log) as its stream or connection closes is never published.
    pub(super) async fn take_quota(&mut self, stream_id: u32, n: usize) -> Option<Owed> {
        let Some(bucket) = self.conn.bucket.get() else {
            return Some(Owed(None));
        };
        if bucket.unlimited() {
            return Some(Owed(None));
        }
        let now = self.shared.now_ns();
        match self.shared.access.action() {
            QuotaAction::Throttle => {
                let (wait, taken) = bucket.take_costing(n as u64, now);
                let owed = Owed(Some((bucket.clone(), taken)));
                if !wait.is_zero() {
                    let started = Instant::now();
                    let _waiting = Waiting::new(&self.shared.stats.quota_waiting);
                    loop {
                        let wait = bucket.wait(self.shared.now_ns());
                        if wait.is_zero() {
                            break;
                        }
                        tokio::time::sleep(wait.min(QUOTA_RECHECK)).await;
                    }
                    bucket.record_throttled(started.elapsed());
                }
                Some(owed)
            }
            // Taken only when there (no debt): nothing worth giving back.
            QuotaAction::Reject => match bucket.try_take(n as u64, now) {
                Ok(()) => Some(Owed(None)),
                Err(wait) => {
                    bucket.record_rejected(n as u64);
                    let spec = bucket.spec();
                    let hint = if n as u64 > spec.burst {
                        format!(
                            "a frame of {n} messages can never pass a burst of {}: send \
                             smaller batches",
                            spec.burst
                        )
                    } else {
                        // Whole milliseconds, rounded up: enough to decide when to retry.
                        format!(
                            "it would pass in {} ms",
                            wait.as_micros().div_ceil(1000).max(1)
                        )
                    };
                    let reason = format!(
                        "client {} is over its publish quota of {} messages/s (burst {}): {n} \
                         message(s) not published; {hint}",
                        self.conn.identity(),
                        spec.rate,
                        spec.burst
                    );
                    self.send_error(stream_id, ErrorCode::RATE_LIMITED, reason);
                    None
                }
            },
        }
    }

    /// May this client subscribe to `filter`? Before the handshake is confirmed (0-RTT) the
    /// identity is not final: decide without filling this stream's cache.
    pub(super) fn may_subscribe(&mut self, filter: &aqueduct_proto::TopicFilter) -> bool {
        let acl = &self.shared.access.acl;
        let client = self.conn.identity();
        if self.conn.is_confirmed() {
            self.acl.may_subscribe(acl, client, filter)
        } else {
            AclCache::default().may_subscribe(acl, client, filter)
        }
    }
}

/// The tokens a frame took from its client's quota (by their cost): given back unless it
/// goes on to be published.
pub(super) struct Owed(
    Option<(
        Arc<aqueduct_core::quota::Bucket>,
        aqueduct_core::quota::Taken,
    )>,
);

impl Owed {
    /// The frame goes on: its tokens stay taken.
    pub(super) fn paid(mut self) {
        self.0 = None;
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        if let Some((bucket, taken)) = self.0.take() {
            bucket.refund(taken);
        }
    }
}

/// Counts one frame waiting for its quota while it lives (also when the wait is cancelled, as
/// the stream closes).
struct Waiting<'a>(&'a std::sync::atomic::AtomicU64);

impl<'a> Waiting<'a> {
    fn new(count: &'a std::sync::atomic::AtomicU64) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
