//! Server-level counters (connections, rejected frames, ERROR frames sent, bytes). Atomics on the
//! hot path; maps only on error paths. The metrics endpoint (a later issue) reads them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use aqueduct_proto::ErrorCode;

/// Counters shared by every connection.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_total: AtomicU64,
    pub connections_refused: AtomicU64,
    pub handshakes_failed: AtomicU64,
    /// WebTransport sessions established, and refused (path, origin or token).
    pub webtransport_sessions: AtomicU64,
    pub webtransport_refused: AtomicU64,
    /// Delivery streams reset because a slow consumer blocked them (disconnect policy).
    pub slow_consumer_resets: AtomicU64,
    /// Times a publishing stream was held by a full queue under the block policy, and the time
    /// spent held (microseconds).
    pub publish_holds: AtomicU64,
    pub publish_held_us: AtomicU64,
    /// Times a stream stopped being read because its client left more than 1 MiB of replies
    /// unread, or the durable log owed it too many answers.
    pub reads_held: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Stream tasks alive now (each serves one QUIC stream: its reader and its writer). Back to
    /// zero when every connection is gone, however it ended: no task outlives its connection.
    pub live_streams: AtomicU64,
    /// Streams whose client stopped reading (STOP_SENDING) while the broker still served them.
    pub streams_stopped: AtomicU64,
    /// Streams the client finished but did not read to the end within 5 s: reset, what was
    /// still queued for their subscriptions dropped and counted.
    pub finish_timeouts: AtomicU64,
    /// Stream tasks that panicked (a bug; logged).
    pub stream_task_panics: AtomicU64,
    /// Connections closed because a reload of `tls.crl_file` revoked their client certificate.
    pub connections_revoked: AtomicU64,
    /// New durable consumers set up to start at `latest` (each such SUBSCRIBE walks every
    /// topic to find where they start).
    pub durable_latest_walks: AtomicU64,
    /// Writes a publisher made straight into an idle subscriber stream (stream/direct.rs).
    pub direct_writes: AtomicU64,
    /// Publish frames waiting now for their client's quota (`throttle`): each holds its stream.
    pub quota_waiting: AtomicU64,
    /// SUBSCRIBEs refused by `transport.max_subscriptions_per_connection`.
    pub subscriptions_refused: AtomicU64,
    /// Requests the ACL refused: publish frames, subscriptions (including live ones closed
    /// when the rules changed).
    pub acl_denied_publish: AtomicU64,
    pub acl_denied_subscribe: AtomicU64,
    /// Admin API: TLS handshakes refused (no or untrusted client certificate, timeouts), and
    /// calls refused because the CN does not match `admin.allowed_cn`.
    pub admin_handshakes_failed: AtomicU64,
    pub admin_denied: AtomicU64,
    /// Frames rejected, by reason label (`bad_magic`, `frame_too_large`, …).
    rejected: Mutex<BTreeMap<&'static str, u64>>,
    /// ERROR frames sent, by code.
    errors: Mutex<BTreeMap<u16, u64>>,
}

impl ServerStats {
    pub(crate) fn rejected(&self, reason: &'static str) {
        let mut m = self.rejected.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(reason).or_default() += 1;
    }

    pub(crate) fn error_sent(&self, code: ErrorCode) {
        let mut m = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(code.0).or_default() += 1;
    }

    pub(crate) fn acl_denied(&self, action: aqueduct_core::acl::Action) {
        match action {
            aqueduct_core::acl::Action::Publish => &self.acl_denied_publish,
            aqueduct_core::acl::Action::Subscribe => &self.acl_denied_subscribe,
        }
        .fetch_add(1, Relaxed);
    }

    pub(crate) fn add_in(&self, n: usize) {
        self.bytes_in.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_out(&self, n: usize) {
        self.bytes_out.fetch_add(n as u64, Relaxed);
    }

    /// Frames rejected so far, by reason.
    pub fn rejected_frames(&self) -> BTreeMap<&'static str, u64> {
        self.rejected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// ERROR frames sent so far, by code.
    pub fn errors_sent(&self) -> BTreeMap<u16, u64> {
        self.errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
