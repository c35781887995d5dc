//! Access control and quotas end to end, with real certificates made in the test: the ACL on
//! publish and subscribe (rules, wildcards, the default, anonymous clients), changes through the
//! admin API applied to live connections, the admin API's own access rules, and publish quotas
//! (throttle, reject, overrides).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use aqueduct_client::{Client, ClientError, ConnectOptions, ErrorCode, PublishOptions};
use aqueduct_server::access::{self, AclRuleSection, AclSection, QuotasSection};
use aqueduct_server::admin::proto;
use aqueduct_server::config::AdminConfig;
use common::relay::Relay;
use common::*;
use std::sync::atomic::Ordering;

const CONFIRM: PublishOptions = PublishOptions {
    priority: None,
    ttl: None,
    confirm: true,
    trace: None,
};

fn rules(list: &[(&str, &str, &str)]) -> Vec<AclRuleSection> {
    list.iter()
        .map(|(c, t, p)| AclRuleSection {
            client: c.to_string(),
            topic: t.to_string(),
            permission: p.to_string(),
        })
        .collect()
}

/// A broker with the ACL on (`default`, `rules`), quotas as given, the admin API on, and a CA
/// whose client certificates it accepts (a client without one is `anonymous`).
struct Setup {
    b: TestBroker,
    ca: TestCa,
    dir: tempfile::TempDir,
}

impl Setup {
    async fn start(default: &str, acl: &[(&str, &str, &str)], quotas: QuotasSection) -> Setup {
        Self::start_with(default, acl, quotas, |_| {}).await
    }

    /// Everything allowed, every client throttled to 1 message a second (burst 1).
    async fn throttled() -> Setup {
        let one_a_second = QuotasSection {
            default_publish_rate: 1,
            default_burst_size: 1,
            ..QuotasSection::default()
        };
        Self::start("all", &[], one_a_second).await
    }

    async fn start_with(
        default: &str,
        acl: &[(&str, &str, &str)],
        quotas: QuotasSection,
        adjust: impl FnOnce(&mut aqueduct_server::Config),
    ) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = test_ca();
        let ca_file = ca.write(dir.path());
        let acl = AclSection {
            enabled: true,
            default: default.into(),
            rules: rules(acl),
        };
        let access = access::validate(&acl, &quotas).expect("valid access config");
        let state_file = dir.path().join("admin-state.json");
        let b = TestBroker::start_with(|c| {
            c.tls.client_ca_file = Some(ca_file.clone());
            c.access = access;
            c.admin = Some(AdminConfig {
                listen_addr: "127.0.0.1:0".parse().expect("addr"),
                allowed_cn: "admin-*".parse().expect("pattern"),
                client_ca_file: ca_file.clone(),
                state_file,
            });
            adjust(c);
        })
        .await;
        Setup { b, ca, dir }
    }

    fn options(&self, cn: Option<&str>) -> ConnectOptions {
        let opts = self.b.options();
        match cn {
            Some(cn) => {
                let (c, k) = self.ca.client(self.dir.path(), cn);
                opts.client_cert(c, k)
            }
            None => opts,
        }
    }

    async fn client(&self, cn: Option<&str>) -> Client {
        within("connect", Client::connect(self.options(cn)))
            .await
            .expect("connects")
    }

    async fn admin(
        &self,
        cn: Option<&str>,
    ) -> Result<
        proto::admin_service_client::AdminServiceClient<tonic::transport::Channel>,
        aqueduct_server::admin::AdminConnectError,
    > {
        self.admin_with(cn.map(|cn| self.ca.client(self.dir.path(), cn)))
            .await
    }

    /// An admin connection with the client certificate and key `cert`, if any.
    async fn admin_with(
        &self,
        cert: Option<(PathBuf, PathBuf)>,
    ) -> Result<
        proto::admin_service_client::AdminServiceClient<tonic::transport::Channel>,
        aqueduct_server::admin::AdminConnectError,
    > {
        let addr: SocketAddr = self.b.admin_addr.expect("admin API on");
        let mut opts = ConnectOptions::new(addr.to_string()).dev_cert_file(&self.b.dev_cert);
        if let Some((c, k)) = cert {
            opts = opts.client_cert(c, k);
        }
        let tls = opts.tls_config(b"h2").expect("tls config");
        aqueduct_server::admin::connect(
            addr.to_string(),
            tls,
            &opts.verified_name(),
            Duration::from_secs(5),
        )
        .await
    }

    fn state_file(&self) -> PathBuf {
        self.dir.path().join("admin-state.json")
    }
}

/// The ACL on: `writer` may publish to `jobs`, clients without a certificate (`anonymous`) may
/// subscribe to it, nothing else.
async fn jobs_setup() -> Setup {
    Setup::start(
        "none",
        &[
            ("writer", "jobs", "publish"),
            ("anonymous", "jobs", "subscribe"),
        ],
        QuotasSection::default(),
    )
    .await
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> Option<ErrorCode> {
    match r {
        Ok(v) => panic!("expected an ERROR, got {v:?}"),
        Err(e) => e.code(),
    }
}

fn rule(c: &str, t: &str, p: &str) -> proto::AclRule {
    proto::AclRule {
        client_id: c.into(),
        topic: t.into(),
        permission: p.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_decide_publish_and_subscribe() {
    let s = Setup::start(
        "none",
        &[
            ("service-a", "orders/#", "publish"),
            ("service-b", "orders/+", "subscribe"),
            ("*", "public/#", "all"),
            ("anonymous", "public/#", "subscribe"),
        ],
        QuotasSection::default(),
    )
    .await;
    let a = s.client(Some("service-a")).await;
    let b = s.client(Some("service-b")).await;
    let guest = s.client(Some("guest")).await;
    let anon = s.client(None).await;

    // service-b may subscribe to orders/+ (covered by its rule), not to orders/# (deeper
    // topics are not), and may not publish there.
    let mut orders = b.subscribe("orders/+").await.expect("allowed subscribe");
    assert_eq!(
        code(b.subscribe("orders/#").await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    let refused = b.publish_with("orders/eu", "x", &CONFIRM).await;
    let e = refused.expect_err("service-b may not publish");
    assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED));
    assert!(e.to_string().contains("orders/eu"), "{e}");
    // service-a publishes; service-b receives it. service-a may not subscribe.
    a.publish_with("orders/eu", "first", &CONFIRM)
        .await
        .expect("allowed publish");
    let m = next(&mut orders).await;
    assert_eq!(&m.body()[..], b"first");
    assert_eq!(
        code(a.subscribe("orders/eu").await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    // The wildcard client rule: any certificate may use public/#; anonymous clients only
    // subscribe there (their exact rule is more specific than `*`).
    let mut public = anon
        .subscribe("public/#")
        .await
        .expect("anonymous subscribe");
    guest
        .publish_with("public/news", "hello", &CONFIRM)
        .await
        .expect("guest publishes on public/#");
    assert_eq!(&next(&mut public).await.body()[..], b"hello");
    assert_eq!(
        code(anon.publish_with("public/news", "x", &CONFIRM).await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    // The default (none) everywhere else; a batch with one refused topic is refused whole.
    assert_eq!(
        code(guest.publish_with("other", "x", &CONFIRM).await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    let batch = a
        .publish_batch(
            [("orders/1", "a".into()), ("other/x", "b".into())],
            &CONFIRM,
        )
        .await;
    assert_eq!(code(batch), Some(ErrorCode::NOT_AUTHORIZED));
    // System topics: a leading wildcard never grants them.
    assert_eq!(
        code(guest.subscribe("__dlq__orders").await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    let m = get(s.b.metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&m, "aqueduct_acl_denied_total{action=\"publish\"}"),
        Some(4.0)
    );
    assert_eq!(
        value(&m, "aqueduct_acl_denied_total{action=\"subscribe\"}"),
        Some(3.0)
    );
    // Nothing refused was delivered: the next message on orders/+ is the next allowed one.
    a.publish_with("orders/us", "second", &CONFIRM)
        .await
        .expect("allowed");
    assert_eq!(&next(&mut orders).await.body()[..], b"second");
    s.b.stop().await.expect("clean shutdown");
}

/// A broker whose ACL lets service-a publish and service-b subscribe to `orders/#`; both
/// connected, service-b subscribed.
async fn two_services() -> (Setup, Client, Client, aqueduct_client::Subscription) {
    let s = Setup::start(
        "none",
        &[
            ("service-a", "orders/#", "publish"),
            ("service-b", "orders/#", "subscribe"),
        ],
        QuotasSection::default(),
    )
    .await;
    let a = s.client(Some("service-a")).await;
    let b = s.client(Some("service-b")).await;
    let sub = b.subscribe("orders/#").await.expect("subscribe");
    (s, a, b, sub)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_apply_to_live_connections() {
    let (s, a, b, mut sub) = two_services().await;
    a.publish_with("orders/1", "one", &CONFIRM)
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"one");

    let mut admin = s.admin(Some("admin-alice")).await.expect("admin connects");
    // Take service-b's permission away: its live subscription ends with NOT_AUTHORIZED.
    admin
        .remove_acl_rule(rule("service-b", "orders/#", "subscribe"))
        .await
        .expect("removed");
    let ended = within("the revoked subscription to end", sub.next_message()).await;
    match ended {
        Some(Err(e)) => assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED), "{e}"),
        other => panic!("expected NOT_AUTHORIZED, got {other:?}"),
    }
    // ... and then it ends (it used to stay open, silent, until the connection ended).
    assert!(
        within("the end of the subscription", sub.next_message())
            .await
            .is_none(),
        "ended"
    );
    assert_eq!(s.b.broker.subscriber_count(), 0);
    // service-a loses publishing on the same connection, without reconnecting...
    admin
        .update_acl(proto::UpdateAclRequest {
            rules: vec![rule("service-b", "orders/#", "subscribe")],
            default_permission: None,
        })
        .await
        .expect("replaced");
    assert_eq!(
        code(a.publish_with("orders/2", "x", &CONFIRM).await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    // ... and gets it back.
    let acl = admin
        .add_acl_rule(rule("service-a", "orders/#", "publish"))
        .await
        .expect("added")
        .into_inner();
    assert_eq!(acl.rules.len(), 2);
    let mut sub = b.subscribe("orders/#").await.expect("subscribe again");
    a.publish_with("orders/3", "three", &CONFIRM)
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"three");
    // The change is saved for the next start.
    let state = std::fs::read_to_string(s.state_file()).expect("state file written");
    assert!(
        state.contains("service-a") && state.contains("orders/#"),
        "{state}"
    );
    s.b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_an_admin_certificate() {
    let s = Setup::start("all", &[], QuotasSection::default()).await;
    // No certificate: the TLS handshake fails (the first call fails, at the latest).
    let refused = match s.admin(None).await {
        Err(_) => true,
        Ok(mut c) => c
            .get_broker_info(proto::GetBrokerInfoRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate must not get in");
    // A certificate whose CN is not admin-*: PERMISSION_DENIED.
    let mut guest = s.admin(Some("guest")).await.expect("TLS works");
    let e = guest
        .list_acl(proto::ListAclRequest {})
        .await
        .expect_err("denied");
    assert_eq!(e.code(), tonic::Code::PermissionDenied);
    assert!(e.message().contains("guest"), "{}", e.message());
    // An admin.
    let mut admin = s.admin(Some("admin-bob")).await.expect("connects");
    let info = admin
        .get_broker_info(proto::GetBrokerInfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert!(info.acl_enabled);
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    let _client = s.client(Some("service-a")).await;
    let clients = admin
        .list_clients(proto::ListClientsRequest {})
        .await
        .expect("clients")
        .into_inner()
        .clients;
    assert!(
        clients.iter().any(|c| c.client_id == "service-a"),
        "{clients:?}"
    );
    let kicked = admin
        .disconnect_client(proto::DisconnectClientRequest {
            target: Some(proto::disconnect_client_request::Target::ClientId(
                "service-a".into(),
            )),
            reason: "test".into(),
        })
        .await
        .expect("kicked")
        .into_inner();
    assert_eq!(kicked.disconnected, 1);
    let m = get(s.b.metrics_addr, "/metrics").await.1;
    assert!(value(&m, "aqueduct_admin_calls_denied_total").unwrap_or(0.0) >= 1.0);
    s.b.stop().await.expect("clean shutdown");
}

/// Publish `n` messages from `client` as fast as it can take them (no confirm), then flush.
async fn flood(client: Client, topic: &'static str, n: u64) -> Client {
    for i in 0..n {
        client
            .publish(topic, i.to_le_bytes().to_vec())
            .await
            .expect("publish");
    }
    client.flush().await.expect("flush");
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_a_publisher_to_its_rate_and_loses_nothing() {
    const RATE: u64 = 1000;
    const BURST: u64 = 50;
    const SECONDS: u64 = 5;
    let s = Setup::start(
        "all",
        &[],
        QuotasSection {
            default_publish_rate: RATE,
            default_burst_size: BURST,
            ..QuotasSection::default()
        },
    )
    .await;
    let sub_client = s.client(Some("reader")).await;
    let mut sub = sub_client.subscribe("q").await.expect("subscribe");
    // One client on two streams, one sending single messages and one batches of 10: they
    // share the client's bucket, and a batch counts per message.
    let publisher = s.client(Some("writer")).await;
    let n = BURST + RATE * SECONDS;
    let half = n / 2;
    let started = Instant::now();
    let singles = publisher.publisher();
    let batches = publisher.publisher();
    let sending = tokio::spawn(async move {
        let one = async {
            for i in 0..half {
                let body = [0u8]
                    .into_iter()
                    .chain(i.to_le_bytes())
                    .collect::<Vec<u8>>();
                singles.publish("q", body).await.expect("publish");
            }
            singles.flush().await.expect("flush");
        };
        let many = async {
            let mut i = 0u64;
            while i < n - half {
                let batch: Vec<(&str, bytes::Bytes)> = (i..(i + 10).min(n - half))
                    .map(|j| {
                        let body = [1u8]
                            .into_iter()
                            .chain(j.to_le_bytes())
                            .collect::<Vec<u8>>();
                        ("q", bytes::Bytes::from(body))
                    })
                    .collect();
                i += batch.len() as u64;
                batches
                    .publish_batch(batch, &PublishOptions::default())
                    .await
                    .expect("batch");
            }
            batches.flush().await.expect("flush");
        };
        tokio::join!(one, many);
        publisher
    });
    let mut next_of = [0u64; 2];
    for _ in 0..n {
        let m = within("a message", sub.next_message())
            .await
            .expect("open")
            .expect("message");
        let (stream, seq) = (m.body()[0] as usize, &m.body()[1..]);
        assert_eq!(
            seq,
            next_of[stream].to_le_bytes(),
            "in order per stream, none lost"
        );
        next_of[stream] += 1;
    }
    assert_eq!(next_of, [half, n - half]);
    let elapsed = started.elapsed().as_secs_f64();
    let rate = (n - BURST) as f64 / elapsed;
    assert!(
        (RATE as f64 * 0.9..=RATE as f64 * 1.1).contains(&rate),
        "measured {rate:.0} msg/s over {elapsed:.2} s for a quota of {RATE}/s"
    );
    within("the publisher", sending).await.expect("joined");
    let m = get(s.b.metrics_addr, "/metrics").await.1;
    let held = value(
        &m,
        "aqueduct_quota_throttled_seconds_total{client=\"writer\"}",
    )
    .expect("throttled time of writer");
    assert!(held > 1.0, "the publisher was held back: {held} s");
    s.b.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_mode_answers_rate_limited_and_overrides_apply_at_once() {
    let s = Setup::start(
        "all",
        &[],
        QuotasSection {
            default_publish_rate: 1,
            default_burst_size: 3,
            action: "reject".into(),
            ..QuotasSection::default()
        },
    )
    .await;
    let c = s.client(Some("svc")).await;
    for _ in 0..3 {
        c.publish_with("r", "x", &CONFIRM)
            .await
            .expect("within the burst");
    }
    let e = c
        .publish_with("r", "x", &CONFIRM)
        .await
        .expect_err("over quota");
    assert_eq!(e.code(), Some(ErrorCode::RATE_LIMITED), "{e}");
    assert!(
        e.to_string().contains(
            "client svc is over its publish quota of 1 messages/s (burst 3): 1 message(s) not \
             published; it would pass in"
        ) && e.to_string().ends_with(" ms"),
        "{e}"
    );
    // A batch counts per message: 2 messages do not fit in what is left.
    assert_eq!(
        code(
            c.publish_batch([("r", "a".into()), ("r", "b".into())], &CONFIRM)
                .await
        ),
        Some(ErrorCode::RATE_LIMITED)
    );
    // An override through the API applies to the live connection at once.
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    // A pattern names no client: refused (it was stored, and applied to nobody).
    let refused = admin
        .set_client_quota(proto::SetClientQuotaRequest {
            client_id: "sv*".into(),
            rate: 1_000_000,
            burst: Some(1000),
        })
        .await
        .expect_err("a pattern");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("exactly"), "{refused:?}");
    let q = admin
        .set_client_quota(proto::SetClientQuotaRequest {
            client_id: "svc".into(),
            rate: 1_000_000,
            burst: Some(1000),
        })
        .await
        .expect("set")
        .into_inner();
    assert!(q.is_override);
    assert!(q.rejected_messages >= 3, "{q:?}");
    for _ in 0..500 {
        c.publish_with("r", "x", &CONFIRM)
            .await
            .expect("raised quota");
    }
    // Removed: back to the default, which is exhausted again.
    admin
        .remove_client_quota(proto::RemoveClientQuotaRequest {
            client_id: "svc".into(),
        })
        .await
        .expect("removed");
    let mut refused = false;
    for _ in 0..10 {
        if c.publish_with("r", "x", &CONFIRM).await.is_err() {
            refused = true;
            break;
        }
    }
    assert!(refused, "the default quota applies again");
    let m = get(s.b.metrics_addr, "/metrics").await.1;
    assert!(
        value(&m, "aqueduct_quota_rejected_messages_total{client=\"svc\"}").unwrap_or(0.0) >= 4.0
    );
    s.b.stop().await.expect("clean shutdown");
}

/// An ACL under which client `svc` may publish to `ok` only: a publish to `r` is refused with
/// NOT_AUTHORIZED, whenever it comes (a quota's refusals depend on the clock).
async fn refusing_setup() -> Setup {
    Setup::start(
        "none",
        &[("svc", "ok", "publish")],
        QuotasSection::default(),
    )
    .await
}

/// A confirmed publish whose caller stopped waiting (a timeout) after its frame was queued is
/// still sent, and its refusal is the stream's to report: the next flush says so. It was lost
/// (its waiter was gone), and the flush said everything was taken.
///
/// On one thread, broker and client alike: no answer can come within the publish's one poll.
/// (It used a zero timeout on two threads, and on a busy machine the answer came first every
/// time.)
#[tokio::test(flavor = "current_thread")]
async fn the_refusal_of_a_cancelled_confirmed_publish_is_reported_by_flush() {
    let s = refusing_setup().await;
    let c = s.client(Some("svc")).await;
    c.publish_with("ok", "x", &CONFIRM).await.expect("allowed");
    // Polled once (the frame is queued and written), then dropped. (A zero timeout is no
    // single poll: its timer fires only at the driver's next tick, by when the answer came.)
    let once = futures_util::FutureExt::now_or_never(c.publish_with("r", "y", &CONFIRM));
    assert!(
        once.is_none(),
        "cancelled while waiting for its answer: {once:?}"
    );
    let e = within("flush", c.flush()).await.expect_err("refused");
    assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED), "{e}");
    s.b.stop().await.expect("clean shutdown");
}

/// `Client::close` flushes the publish streams of `Client::publisher` too: a refusal there is
/// its error. It flushed the default stream only, and closed the connection under the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_flushes_every_publisher_of_the_client() {
    let s = refusing_setup().await;
    let c = s.client(Some("svc")).await;
    let p = c.publisher();
    p.publish("r", "x").await.expect("sent");
    let e = within("close", c.close()).await.expect_err("refused");
    assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED), "{e}");
    s.b.stop().await.expect("clean shutdown");
}

/// A frame that waits for its quota and is never published (its connection closed) gives its
/// tokens back. The debt it ran up stayed: one client could send a few large batches, go away,
/// and hold every publisher of its client id (all anonymous ones, say) for as long as those
/// batches would have taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_abandoned_while_throttled_gives_its_quota_back() {
    let s = Setup::start(
        "all",
        &[],
        QuotasSection {
            default_publish_rate: 10,
            default_burst_size: 10,
            ..QuotasSection::default()
        },
    )
    .await;
    let waiting = || s.b.stats.quota_waiting.load(Ordering::Relaxed);
    let a = s.client(Some("shared")).await;
    // 2,000 messages at 10/s: 200 s of debt for the id.
    let batch: Vec<(&str, bytes::Bytes)> = (0..2_000).map(|_| ("t", "x".into())).collect();
    a.publish_batch(batch, &PublishOptions::default())
        .await
        .expect("sent");
    until("the batch to wait for its quota", || waiting() == 1).await;
    drop(a);
    until("the wait to be given up", || waiting() == 0).await;
    let b = s.client(Some("shared")).await;
    within(
        "a publish of the same client id",
        b.publish_with("t", "y", &CONFIRM),
    )
    .await
    .expect("published");
    s.b.stop().await.expect("clean shutdown");
}

/// Lift `client`'s quota through the admin API (unlimited).
async fn unthrottle(
    admin: &mut proto::admin_service_client::AdminServiceClient<tonic::transport::Channel>,
    client: &str,
) {
    admin
        .set_client_quota(proto::SetClientQuotaRequest {
            client_id: client.into(),
            rate: 0,
            burst: None,
        })
        .await
        .expect("unlimited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_client_speeds_up_when_its_quota_is_raised() {
    let s = Setup::throttled().await;
    let c = s.client(Some("slow")).await;
    // 200 messages at 1/s would take minutes; the raise below lets them through at once.
    let sending = tokio::spawn(flood(c, "t", 200));
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    // Wait until the publisher is being held back.
    let metrics = s.b.metrics_addr;
    within("the publisher to be throttled", async {
        loop {
            let m = get(metrics, "/metrics").await.1;
            if value(
                &m,
                "aqueduct_quota_throttled_seconds_total{client=\"slow\"}",
            )
            .is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    unthrottle(&mut admin, "slow").await;
    within("the publisher to finish", sending)
        .await
        .expect("joined");
    s.b.stop().await.expect("clean shutdown");
}

/// Publishes cancelled while the broker does not read their stream (a throttled client, each
/// call under a timeout) do not pile up: a cancelled call queued its whole frame, and every one
/// was sent once the stream moved again, so an application that retries on a timeout published
/// each message as many times as it had retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_cancelled_while_throttled_are_not_all_sent_later() {
    let s = Setup::throttled().await;
    let reader = s.client(Some("reader")).await;
    let mut sub = reader.subscribe("big").await.expect("subscribed");
    let c = s.client(Some("slow")).await;
    let body = bytes::Bytes::from(vec![b'x'; 60_000]);
    let (mut done, mut cancelled) = (0, 0);
    for _ in 0..100 {
        match tokio::time::timeout(Duration::from_millis(10), c.publish("big", body.clone())).await
        {
            Ok(r) => {
                r.expect("published");
                done += 1;
            }
            Err(_) => cancelled += 1,
        }
    }
    assert!(
        cancelled >= 20,
        "the stream never stopped moving: {done} done"
    );
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    unthrottle(&mut admin, "slow").await;
    c.publish("big", "end").await.expect("published");
    c.flush().await.expect("flushed");
    let mut received = 0;
    loop {
        let m = next(&mut sub).await;
        if m.body().as_ref() == b"end" {
            break;
        }
        received += 1;
    }
    // What returned Ok, and at most the one cancelled call whose frame had started to go out.
    assert!(
        received <= done + 1,
        "{received} delivered for {done} published and {cancelled} cancelled"
    );
    c.close().await.expect("closed");
    reader.close().await.expect("closed");
    s.b.stop().await.expect("clean shutdown");
}

/// The ACL replaced 100 times while a publisher runs at full speed: nothing is lost for the
/// client that stays allowed, and after each replacement returns, the toggled permission is
/// exactly what the new rules say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_under_load_is_exact_and_loses_nothing() {
    // Block: a subscriber that falls behind holds the publisher instead of losing messages, so
    // anything missing would be the ACL's doing.
    let s = Setup::start_with(
        "none",
        &[
            ("steady", "keep/#", "all"),
            ("toggler", "toggle", "publish"),
        ],
        QuotasSection::default(),
        |c| c.broker.backpressure_policy = aqueduct_client::OverflowPolicy::Block,
    )
    .await;
    let steady = s.client(Some("steady")).await;
    let toggler = s.client(Some("toggler")).await;
    let mut sub = steady.subscribe("keep/#").await.expect("subscribe");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let publisher = steady.clone();
    let pumping = tokio::spawn(async move {
        let mut sent = 0u64;
        while !*stop_rx.borrow_and_update() {
            let batch: Vec<(&str, bytes::Bytes)> = (0..50)
                .map(|i| {
                    (
                        "keep/a",
                        bytes::Bytes::from((sent + i).to_le_bytes().to_vec()),
                    )
                })
                .collect();
            publisher
                .publish_batch(batch, &PublishOptions::default())
                .await
                .expect("steady stays allowed");
            sent += 50;
        }
        publisher.flush().await.expect("flush");
        sent
    });
    let (count_tx, count_rx) = tokio::sync::watch::channel(0u64);
    let reading = tokio::spawn(async move {
        let mut received = 0u64;
        while let Some(m) = sub.next_message().await {
            let m = m.expect("a message");
            assert_eq!(m.body()[..], received.to_le_bytes(), "in order, none lost");
            received += 1;
            let _ = count_tx.send(received);
        }
    });
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    for round in 0..100 {
        let allowed = round % 2 == 0;
        let mut rules = vec![rule("steady", "keep/#", "all")];
        if allowed {
            rules.push(rule("toggler", "toggle", "publish"));
        }
        admin
            .update_acl(proto::UpdateAclRequest {
                rules,
                default_permission: None,
            })
            .await
            .expect("replaced");
        let r = toggler.publish_with("toggle", "t", &CONFIRM).await;
        assert_eq!(r.is_ok(), allowed, "round {round}: {r:?}");
    }
    let _ = stop_tx.send(true);
    let sent = within("the publisher", pumping).await.expect("joined");
    assert!(sent > 0);
    let mut count_rx = count_rx;
    within("every message", count_rx.wait_for(|n| *n >= sent))
        .await
        .expect("reader alive");
    assert_eq!(*count_rx.borrow(), sent, "nothing extra either");
    s.b.stop().await.expect("clean shutdown");
    within("the reader", reading).await.expect("reader ok");
}

/// A publish sent without `confirm` that the ACL refuses is reported by the next flush, with
/// the broker's ERROR (a flush means "handled": these were, by being refused); the publishes
/// allowed around it are delivered. Before, the refusal was only logged and the flush said Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_unconfirmed_publish_is_reported_by_flush() {
    let s = jobs_setup().await;
    let reader = s.client(None).await;
    let mut sub = reader.subscribe("jobs").await.expect("subscribe");
    let writer = s.client(Some("writer")).await;
    writer.publish("jobs", "one").await.expect("sent");
    writer.publish("elsewhere", "no").await.expect("sent");
    writer.publish("elsewhere", "no").await.expect("sent");
    writer.publish("jobs", "two").await.expect("sent");
    let refused = writer.flush().await.expect_err("refused");
    assert_eq!(refused.code(), Some(ErrorCode::NOT_AUTHORIZED), "{refused}");
    assert!(refused.to_string().contains("the first of 2"), "{refused}");
    assert_eq!(&next(&mut sub).await.body()[..], b"one");
    assert_eq!(&next(&mut sub).await.body()[..], b"two");
    writer.flush().await.expect("reported once");
    reader
        .close()
        .await
        .expect("close: everything published was taken");
    close_and_stop(writer, s.b).await;
}

/// A subscription revoked after its client stopped reading its stream (STOP_SENDING; the
/// stream's writer has stopped, its reader goes on) is closed all the same: ACKs naming it get
/// NOT_SUBSCRIBED (§11). Before, only the stopped writer took revocations, so it stayed
/// registered and settleable until the stream ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_revoked_after_its_client_stopped_reading_is_closed() {
    let s = jobs_setup().await;
    let raw = Raw::connect(&s.b, 1 << 20).await;
    let mut delivery = raw.stream().await;
    // A group member (settled explicitly), with an empty extension block.
    delivery
        .write(&raw_frame(0x42, 1, b"\0\0topic:jobs:group:w"))
        .await;
    until("the subscription", || s.b.broker.subscriber_count() == 1).await;
    let publisher = s.client(Some("writer")).await;
    publisher
        .publish_with("jobs", "one", &CONFIRM)
        .await
        .expect("publish");
    let got = delivery.read_frame().await.expect("the delivery");
    let aqueduct_proto::frame::Message::Publish(p) = got.message else {
        panic!("not a delivery: {got:?}")
    };
    let offset = p.ext.offset.expect("offset");
    delivery.stop_reading();
    until("the writer to see STOP_SENDING", || {
        s.b.stats
            .streams_stopped
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1
    })
    .await;
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    admin
        .remove_acl_rule(rule("anonymous", "jobs", "subscribe"))
        .await
        .expect("removed");
    until("the revoked subscription to be closed", || {
        s.b.broker.subscriber_count() == 0
    })
    .await;
    let mut other = raw.stream().await;
    other
        .write_frame(&aqueduct_proto::Frame::new(
            1,
            aqueduct_proto::frame::Message::Ack(aqueduct_proto::frame::Ack {
                offset,
                ext: Default::default(),
            }),
        ))
        .await;
    let answer = other.read_frame().await.expect("an answer");
    assert_eq!(error_code(&answer), ErrorCode::NOT_SUBSCRIBED, "{answer:?}");
    raw.forget();
    close_and_stop(publisher, s.b).await;
}

/// A subscription revoked while its stream's write is blocked (its client reads nothing) is
/// closed at once, not when the write goes through (which may be never).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_revoked_while_its_write_is_blocked_is_closed_at_once() {
    let s = jobs_setup().await;
    let stalled = Raw::connect(&s.b, 4096).await;
    let mut delivery = stalled.stream().await;
    delivery.write(&raw_frame(0x42, 1, b"\0\0topic:jobs")).await;
    until("the subscription", || s.b.broker.subscriber_count() == 1).await;
    let publisher = s.client(Some("writer")).await;
    block_a_write(&s.b.broker, &publisher, "jobs").await;
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    admin
        .remove_acl_rule(rule("anonymous", "jobs", "subscribe"))
        .await
        .expect("removed");
    until("the revoked subscription to be closed", || {
        s.b.broker.subscriber_count() == 0
    })
    .await;
    stalled.conn.close(0u32.into(), b"bye");
    close_and_stop(publisher, s.b).await;
}

/// A durable consumer whose permission is taken away ends completely: once the permission is
/// back, the same consumer id can subscribe again and resumes from its position (its name is
/// not left claimed by the revoked subscription).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_durable_consumer_can_come_back() {
    let log = tempfile::tempdir().expect("log dir");
    let s = Setup::start_with(
        "none",
        &[
            ("reader", "jobs", "subscribe"),
            ("writer", "jobs", "publish"),
        ],
        QuotasSection::default(),
        |c| {
            c.aal = Some(aqueduct_server::config::AalConfig {
                dir: log.path().to_path_buf(),
                key: None,
                previous_keys: Vec::new(),
                allow_plaintext: true,
                max_segment_bytes: 1 << 20,
                fsync: aqueduct_log::FsyncMode::Batch,
                retention_bytes: None,
                retention_age: None,
                consumers: Default::default(),
            })
        },
    )
    .await;
    let writer = s.client(Some("writer")).await;
    let reader = s.client(Some("reader")).await;
    let durable = aqueduct_client::SubscribeOptions {
        durable: Some(("d1".into(), aqueduct_client::DurableStart::Earliest)),
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    };
    let mut sub = reader
        .subscribe_with("jobs", &durable)
        .await
        .expect("durable");
    writer
        .publish_with("jobs", "one", &CONFIRM)
        .await
        .expect("publish");
    let m = next(&mut sub).await;
    assert_eq!(&m.body()[..], b"one");
    m.ack().await.expect("ack");
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    admin
        .remove_acl_rule(rule("reader", "jobs", "subscribe"))
        .await
        .expect("removed");
    match within("the revoked subscription to end", sub.next_message()).await {
        Some(Err(e)) => assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED), "{e}"),
        other => panic!("expected NOT_AUTHORIZED, got {other:?}"),
    }
    assert_eq!(
        code(reader.subscribe_with("jobs", &durable).await),
        Some(ErrorCode::NOT_AUTHORIZED)
    );
    writer
        .publish_with("jobs", "two", &CONFIRM)
        .await
        .expect("publish");
    admin
        .add_acl_rule(rule("reader", "jobs", "subscribe"))
        .await
        .expect("added");
    // The same consumer id again: not "already subscribed", and it goes on after "one".
    let mut again = within("resubscribe", reader.subscribe_with("jobs", &durable))
        .await
        .expect("the consumer id is free again");
    // "one" was ACKed, but the ACK travels on its own and the revocation may have closed the
    // subscription before the broker read it: then "one" is redelivered (at least once, as
    // for any unsettled message of a durable consumer), and "two" follows.
    let mut m = next(&mut again).await;
    if &m.body()[..] == b"one" {
        m = next(&mut again).await;
    }
    assert_eq!(&m.body()[..], b"two");
    s.b.stop().await.expect("clean shutdown");
}

/// The ACL is checked after a frame's quota wait, not before it: a rule removed while a
/// throttled PUBLISH waited applies to it (as it always did to a PUBLISH_BATCH), so nothing is
/// published after the admin call returns that the new rules refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_removed_while_a_publish_waits_for_its_quota_applies_to_it() {
    let s = Setup::start(
        "none",
        &[
            ("service-a", "orders/#", "publish"),
            ("service-b", "orders/#", "subscribe"),
        ],
        QuotasSection {
            default_publish_rate: 1,
            default_burst_size: 1,
            ..QuotasSection::default()
        },
    )
    .await;
    let a = s.client(Some("service-a")).await;
    let b = s.client(Some("service-b")).await;
    let mut sub = b.subscribe("orders/#").await.expect("subscribe");
    let metrics = s.b.metrics_addr;
    let waiting = |n: f64| async move {
        within("publish frames to wait for their quota", async {
            loop {
                let m = get(metrics, "/metrics").await.1;
                if value(&m, "aqueduct_quota_throttled_frames") == Some(n) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    };
    // A batch of 30 puts the shared bucket ~30 s in debt, and waits; so does a PUBLISH on a
    // second stream after it.
    let batch = a.publisher();
    let batch = tokio::spawn(async move {
        let items = (0..30).map(|_| ("orders/batch", bytes::Bytes::from_static(b"batch")));
        batch.publish_batch(items, &CONFIRM).await
    });
    waiting(1.0).await;
    let single = a.publisher();
    let single = tokio::spawn(async move {
        single
            .publish_with("orders/single", "single", &CONFIRM)
            .await
    });
    waiting(2.0).await;
    let mut admin = s.admin(Some("admin-alice")).await.expect("admin connects");
    admin
        .remove_acl_rule(rule("service-a", "orders/#", "publish"))
        .await
        .expect("removed");
    // End the waits at once.
    admin
        .set_client_quota(proto::SetClientQuotaRequest {
            client_id: "service-a".into(),
            rate: 0,
            burst: None,
        })
        .await
        .expect("unlimited");
    let single = within("the waiting PUBLISH", single).await.expect("joined");
    assert_eq!(code(single), Some(ErrorCode::NOT_AUTHORIZED));
    let batch = within("the waiting batch", batch).await.expect("joined");
    assert_eq!(code(batch), Some(ErrorCode::NOT_AUTHORIZED));
    waiting(0.0).await;
    // Allowed again: the first message the subscriber sees is the one published now.
    admin
        .add_acl_rule(rule("service-a", "orders/#", "publish"))
        .await
        .expect("added");
    a.publish_with("orders/after", "after", &CONFIRM)
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"after");
    s.b.stop().await.expect("clean shutdown");
}

/// Ordinary clients whose certificates the admin CA also signs cannot lock administrators out
/// by holding every admin connection: at most `MAX_DENIED_CONNECTIONS` of theirs stay open (for
/// `DENIED_LIFETIME`, told why on each call), the rest are closed after the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_admin_certificates_cannot_hold_every_admin_connection() {
    use aqueduct_server::admin::{MAX_CONNECTIONS, MAX_DENIED_CONNECTIONS};
    let s = Setup::start("all", &[], QuotasSection::default()).await;
    let mut held = Vec::new();
    let mut denied = 0;
    for _ in 0..MAX_CONNECTIONS {
        let Ok(mut c) = s.admin(Some("dashboard")).await else {
            continue;
        };
        let r = c.get_broker_info(proto::GetBrokerInfoRequest {}).await;
        match r {
            Err(e) if e.code() == tonic::Code::PermissionDenied => denied += 1,
            // Closed after its handshake: nothing was answered.
            Err(_) => {}
            Ok(_) => panic!("a non-admin certificate was answered"),
        }
        held.push(c);
    }
    // At most MAX_DENIED_CONNECTIONS at a time (more over the loop only on a machine so slow
    // that the first ones reached their DENIED_LIFETIME).
    assert!(
        (1..MAX_CONNECTIONS).contains(&denied),
        "{denied} non-admin connections were served (at most {MAX_DENIED_CONNECTIONS} at once)"
    );
    let mut admin = within("an admin connection", s.admin(Some("admin-alice")))
        .await
        .expect("connects");
    let info = within(
        "an admin call while non-admins hold connections",
        admin.get_broker_info(proto::GetBrokerInfoRequest {}),
    )
    .await
    .expect("answered");
    assert!(info.into_inner().acl_enabled);
    drop(held);
    s.b.stop().await.expect("clean shutdown");
}

/// Connections that never start their TLS handshake (anyone who reaches the port may open
/// them; each was waited for 10 s) cannot lock administrators out: at most 8 handshakes from
/// one address are waited for at once, the rest are closed at once, and a connection takes one
/// of the 64 slots only once its handshake is done. Before, 64 such connections from anywhere
/// held every slot, and an administrator's call waited for them to time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_handshake_cannot_lock_administrators_out() {
    use aqueduct_server::admin::{MAX_CONNECTIONS, MAX_HANDSHAKES_PER_ADDRESS};
    let s = Setup::start("all", &[], QuotasSection::default()).await;
    let addr: SocketAddr = s.b.admin_addr.expect("admin API on");
    // From another loopback address than the administrator's.
    let idle = idle_connections_from_elsewhere(addr, MAX_CONNECTIONS + 16).await;
    // Well within the 10 s the idle ones would each be waited for.
    let answered = tokio::time::timeout(Duration::from_secs(5), async {
        let mut admin = s.admin(Some("admin-alice")).await.expect("connects");
        admin
            .get_broker_info(proto::GetBrokerInfoRequest {})
            .await
            .expect("answered")
    })
    .await;
    assert!(
        answered.is_ok(),
        "an administrator waited behind {} idle connections (at most {MAX_HANDSHAKES_PER_ADDRESS} of them waited for)",
        idle.len()
    );
    drop(idle);
    s.b.stop().await.expect("clean shutdown");
}

/// An admin certificate that expires while its connection stays open (gRPC keeps it alive) is
/// refused from then on: each call checks it, as it checks revocation. It used to go on being
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_certificate_that_expires_on_an_open_connection_is_refused() {
    let s = Setup::start("all", &[], QuotasSection::default()).await;
    let not_after = std::time::SystemTime::now() + Duration::from_secs(4);
    let (cert, key) = s.ca.client_until(s.dir.path(), "admin-brief", not_after);
    let mut admin = within(
        "an admin connection",
        s.admin_with(Some((cert.clone(), key.clone()))),
    )
    .await
    .expect("connects");
    // A second connection that never calls again: it ends once the certificate has expired
    // (an attacker with a leaked short-lived key held the slots it opened before expiry).
    let mut idle = within(
        "an admin connection",
        s.admin_with(Some((cert.clone(), key))),
    )
    .await
    .expect("connects");
    for a in [&mut admin, &mut idle] {
        a.get_broker_info(proto::GetBrokerInfoRequest {})
            .await
            .expect("answered while the certificate is valid");
    }
    assert_eq!(s.b.control.admin_connections(), 2);
    until_expired(&cert).await;
    let e = admin
        .get_broker_info(proto::GetBrokerInfoRequest {})
        .await
        .expect_err("refused once it has expired");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("expired"), "{e}");
    until("both connections to end", || {
        s.b.control.admin_connections() == 0
    })
    .await;
    drop(idle);
    s.b.stop().await.expect("clean shutdown");
}

/// Turned off, then on again months later, the admin API brought back the grants made through
/// it before (the state file still matched the unchanged config). A broker started with the API
/// off moves a state file it names aside, so the config file's policy is what applies next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_admin_api_off_its_old_state_file_is_set_aside() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("admin-state.json");
    // What the API left: an extra grant, for the config sections of this broker.
    let config = access::validate(&AclSection::default(), &QuotasSection::default()).expect("ok");
    let live = access::Access::start(&config, Some(path.clone())).expect("start");
    live.acl.update(|p| {
        p.rules.push(
            aqueduct_core::acl::AclRule::parse("contractor-*", "orders/#", "subscribe")
                .expect("rule"),
        )
    });
    live.changed().expect("persist");
    drop(live); // that broker stopped
    let b = TestBroker::start_with(|c| c.admin_state_when_off = Some(path.clone())).await;
    assert!(!path.exists(), "moved aside");
    let aside = dir.path().join("admin-state.json.off");
    let kept = std::fs::read_to_string(&aside).expect("kept aside");
    assert!(kept.contains("contractor-*"), "{kept}");
    // The API on again: the config file's policy, without the old grant.
    let again = access::Access::start(&config, Some(path)).expect("start");
    assert!(again.acl.policy().rules.is_empty());
    b.stop().await.expect("clean shutdown");
}

/// Holds the ACL on a thread of its own, as a long walk over the live subscriptions does, until
/// let go or for at most 10 s.
struct AclHolder {
    release: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<bool>,
}

impl AclHolder {
    fn hold(control: &aqueduct_server::Control) -> AclHolder {
        let control = control.clone();
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let _held = control.hold_acl_changes();
            held_tx.send(()).expect("say it is held");
            release_rx.recv_timeout(Duration::from_secs(10)).is_ok()
        });
        held_rx.recv().expect("the ACL is held");
        AclHolder { release, thread }
    }

    /// Let go; true if it was told to (false: it gave up waiting, because the one runtime
    /// thread that would tell it was blocked).
    fn release(self) -> bool {
        let _ = self.release.send(());
        self.thread.join().expect("holder thread")
    }
}

/// A walk over the live subscriptions, and a change waiting for one in progress, run off the
/// async workers: on a runtime with one thread (broker and clients alike), each of them waits
/// while that thread goes on serving. Before, a SIGHUP reload and an admin change each waited
/// on the async worker itself, and a walk over many subscriptions stalled every connection the
/// worker served. A new connection does not wait for the walk at all.
#[tokio::test(flavor = "current_thread")]
async fn acl_changes_and_walks_hold_no_async_worker() {
    let (s, a, _b, mut sub) = two_services().await;
    let control = s.b.control.clone();

    // 1. A reload (what SIGHUP does) that takes service-b's permission away.
    let holder = AclHolder::hold(&control);
    let access = access::validate(
        &AclSection {
            enabled: true,
            default: "none".into(),
            rules: rules(&[("service-a", "orders/#", "publish")]),
        },
        &QuotasSection::default(),
    )
    .expect("valid");
    let reloading = tokio::spawn({
        let control = control.clone();
        async move { control.reload_access(&access).await }
    });
    until("the reload to wait for the ACL", || {
        control.acl_waiters() == 1
    })
    .await;
    assert!(
        holder.release(),
        "the runtime's thread went on while it waited"
    );
    let closed = within("the reload", reloading)
        .await
        .expect("joined")
        .expect("reloaded and saved");
    assert_eq!(closed, 1, "service-b's subscription");
    match within("the revoked subscription to end", sub.next_message()).await {
        Some(Err(e)) => assert_eq!(e.code(), Some(ErrorCode::NOT_AUTHORIZED), "{e}"),
        other => panic!("expected NOT_AUTHORIZED, got {other:?}"),
    }

    // 2. An admin change that gives it back.
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    let holder = AclHolder::hold(&control);
    let adding = tokio::spawn(async move {
        admin
            .add_acl_rule(rule("service-b", "orders/#", "subscribe"))
            .await
    });
    until("the admin change to wait for the ACL", || {
        control.acl_waiters() == 1
    })
    .await;
    assert!(
        holder.release(),
        "the runtime's thread went on while it waited"
    );
    let acl = within("the admin change", adding)
        .await
        .expect("joined")
        .expect("added")
        .into_inner();
    assert_eq!(acl.rules.len(), 2);

    // 3. A new connection while a walk is in progress: it has no subscriptions to check (with
    // the ACL on, even 0-RTT data waits for the handshake), so it is served at once. Before, its
    // handshake waited for the walk to end.
    let holder = AclHolder::hold(&control);
    let c = within(
        "connect while a walk holds the ACL",
        Client::connect(s.options(Some("service-b"))),
    )
    .await
    .expect("connects");
    let mut sub = within(
        "subscribe while a walk holds the ACL",
        c.subscribe("orders/#"),
    )
    .await
    .expect("allowed again");
    a.publish_with("orders/1", "one", &CONFIRM)
        .await
        .expect("publish");
    assert_eq!(&next(&mut sub).await.body()[..], b"one");
    assert_eq!(control.acl_waiters(), 0, "nothing waited for the walk");
    assert!(holder.release(), "served while the ACL was held");
    s.b.stop().await.expect("clean shutdown");
}

/// An admin ACL change whose call is dropped while it waits (here: its deadline passes while a
/// walk holds the ACL) still lands whole: live and saved. Before, the change and the walk ran
/// on the blocking pool and the save only once the call resumed, so a dropped call left the
/// change live but unsaved, and a restart undid it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_change_whose_call_is_dropped_is_saved_all_the_same() {
    let (s, _a, _b, _sub) = two_services().await;
    let mut admin = s.admin(Some("admin-ops")).await.expect("admin");
    let control = s.b.control.clone();
    let holder = AclHolder::hold(&control);
    let mut req = tonic::Request::new(rule("service-c", "orders/#", "subscribe"));
    req.set_timeout(Duration::from_secs(3));
    let call = tokio::spawn(async move { admin.add_acl_rule(req).await });
    until("the change to wait for the ACL", || {
        control.acl_waiters() == 1
    })
    .await;
    let status = within("the call's deadline", call)
        .await
        .expect("joined")
        .expect_err("the deadline passes while the ACL is held");
    // The client gives up at the deadline (Cancelled) and resets the request, or the broker
    // answers DeadlineExceeded: either way the broker drops the call.
    assert!(
        matches!(
            status.code(),
            tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
        ),
        "{status}"
    );
    assert!(holder.release(), "let go");
    until("the dropped call's change to be saved", || {
        std::fs::read_to_string(s.state_file()).is_ok_and(|t| t.contains("service-c"))
    })
    .await;
    assert_eq!(control.acl().rules.len(), 3, "and live");
    s.b.stop().await.expect("clean shutdown");
}

/// A SUBSCRIBE in 0-RTT data is handled before the handshake completes, unchecked while the ACL
/// is off. If a reload turns the ACL on meanwhile, its walk does not see the connection (it is
/// listed only once its handshake completes): the handshake's own check must, and revokes the
/// subscription the new rules refuse. Nothing is delivered to it before that check: messages
/// published meanwhile went out for as long as the client held back its handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0rtt_subscription_made_before_the_acl_went_on_is_checked_at_the_handshake() {
    a_0rtt_subscription_held_back(false).await;
}

/// As above, with the broker stopping while the client holds its handshake back: nothing queued
/// for the unchecked subscription goes out in the shutdown's last flush either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0rtt_subscription_gets_nothing_from_a_broker_stopping_before_the_check() {
    a_0rtt_subscription_held_back(true).await;
}

async fn a_0rtt_subscription_held_back(then_stop: bool) {
    let acl = |enabled| {
        access::validate(
            &AclSection {
                enabled,
                default: "none".into(),
                rules: Vec::new(),
            },
            &QuotasSection::default(),
        )
        .expect("valid")
    };
    let s = Setup::start_with("none", &[], QuotasSection::default(), |c| {
        c.access = acl(false)
    })
    .await;
    let endpoint = zero_rtt_endpoint(&s.b);
    // A first connection, for a session ticket (it follows the handshake: one round trip).
    let first = within(
        "first connect",
        endpoint.connect(s.b.addr, "localhost").expect("connect"),
    )
    .await
    .expect("handshake");
    let (send, recv) = first.open_bi().await.expect("stream");
    let mut probe = RawStream::new(send, recv);
    probe.write_frame(&confirmed_publish(1, "probe", "p")).await;
    let confirm = probe.read_frame().await.expect("the PUBLISH's CONFIRM");
    assert!(
        matches!(confirm.message, aqueduct_proto::frame::Message::Confirm(_)),
        "{confirm:?}"
    );
    first.close(0u32.into(), b"bye");

    // The second one resumes through a relay that holds the client's datagrams.
    let relay = Relay::start_gated(s.b.addr).await;
    let connecting = endpoint.connect(relay.front, "localhost").expect("connect");
    let (conn, _accepted) = connecting
        .into_0rtt()
        .unwrap_or_else(|_| panic!("0-RTT should be offered with a ticket"));
    let (send, recv) = conn.open_bi().await.expect("stream");
    let mut stream = RawStream::new(send, recv);
    // The SUBSCRIBE, then an UNSUBSCRIBE of nothing (answered NOT_SUBSCRIBED, once the handshake
    // is confirmed: nothing is written on the stream before).
    let mut early = raw_frame(0x02, 7, b"topic:orders/#");
    early.extend(raw_frame(0x03, 8, b"topic:other"));
    stream.write(&early).await;
    // Everything the client sent so far is held, and none of it can complete the handshake:
    // that needs the broker's answer to the first datagram.
    until("the 0-RTT data to be held by the relay", || {
        let sent = conn.stats();
        sent.frame_tx.stream >= 1 && relay.held() as u64 == sent.udp_tx.datagrams
    })
    .await;
    let listed = s.b.stats.connections_total.load(Ordering::Relaxed);
    for _ in 0..relay.held() {
        relay.release_one().await;
    }
    // Both handled (the UNSUBSCRIBE's ERROR queued, not yet written): so that ERROR comes
    // before the revocation's below.
    let not_subscribed = ErrorCode::NOT_SUBSCRIBED.0;
    until("the 0-RTT SUBSCRIBE and UNSUBSCRIBE handled", || {
        s.b.broker.subscriber_count() == 1
            && s.b
                .stats
                .errors_sent()
                .get(&not_subscribed)
                .is_some_and(|n| *n >= 1)
    })
    .await;
    assert_eq!(
        s.b.stats.connections_total.load(Ordering::Relaxed),
        listed,
        "the handshake is not complete yet"
    );
    let closed = within("the reload", s.b.control.reload_access(&acl(true)))
        .await
        .expect("reloaded");
    assert_eq!(closed, 0, "the reload's walk does not see the connection");
    // Published after the reload, before the handshake's check: routed to the subscription,
    // never delivered.
    let topic = aqueduct_proto::TopicName::try_from("orders/1").expect("topic");
    let routed = s.b.broker.publish(
        &mut aqueduct_core::PublishContext::default(),
        &aqueduct_core::Publication::new(&topic, b"secret"),
        Instant::now(),
    );
    assert_eq!(routed.routed, 1, "queued for the 0-RTT subscription");
    if then_stop {
        let read_all = async {
            let mut frames = Vec::new();
            while let Some(f) = stream.read_frame().await {
                frames.push(f);
            }
            frames
        };
        let (stopped, frames) =
            within("the stop", async { tokio::join!(s.b.stop(), read_all) }).await;
        stopped.expect("clean shutdown");
        assert!(frames.is_empty(), "written before the check: {frames:?}");
        return;
    }
    relay.open().await;
    let answer = stream.read_frame().await.expect("the UNSUBSCRIBE's answer");
    assert_eq!(error_code(&answer), ErrorCode::NOT_SUBSCRIBED, "{answer:?}");
    let next = within("the subscription's end", stream.read_frame())
        .await
        .expect("a frame");
    assert_eq!(
        error_code(&next),
        ErrorCode::NOT_AUTHORIZED,
        "the ERROR, and no delivery before it: {next:?}"
    );
    until("the subscription to end", || {
        s.b.broker.subscriber_count() == 0
    })
    .await;
    assert_eq!(s.b.stats.acl_denied_subscribe.load(Ordering::Relaxed), 1);
    s.b.stop().await.expect("clean shutdown");
}

/// `tls.crl_file`: a revoked client certificate is refused at the handshake; a reload (what
/// SIGHUP does) makes a newly revoked one refused too and closes its live connection with
/// NOT_AUTHORIZED, while other clients go on; a damaged file leaves the lists in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_client_certificates_are_refused_and_closed_on_reload() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let (mallory, mallory_key) = ca.client(dir.path(), "mallory");
    let (alice, alice_key) = ca.client(dir.path(), "alice");
    let (bob, bob_key) = ca.client(dir.path(), "bob");
    let crl_file = dir.path().join("crl.pem");
    ca.write_crl(&crl_file, &[&mallory], 1);
    let b = TestBroker::start_with(|c| {
        c.tls.require_client_cert = true;
        c.tls.client_ca_file = Some(ca_file.clone());
        c.tls.crl_file = Some(crl_file.clone());
    })
    .await;
    let connect = |cert: &PathBuf, key: &PathBuf| {
        Client::connect(b.options().client_cert(cert.clone(), key.clone()))
    };
    let refused = |cert: PathBuf, key: PathBuf| {
        let opts = b.options().client_cert(cert, key);
        async move {
            match within("connect", Client::connect(opts)).await {
                Err(e) => e.to_string(),
                Ok(c) => within("the refusal", c.publish_with("t", "x", &CONFIRM))
                    .await
                    .expect_err("a revoked certificate must not be served")
                    .to_string(),
            }
        }
    };
    let why = refused(mallory.clone(), mallory_key.clone()).await;
    assert!(why.contains("revoked"), "{why}");

    let alice_client = within("alice", connect(&alice, &alice_key))
        .await
        .expect("alice is not revoked");
    let bob_client = within("bob", connect(&bob, &bob_key))
        .await
        .expect("bob is not revoked");
    alice_client
        .publish_with("t", "x", &CONFIRM)
        .await
        .expect("alice served");

    // Alice is revoked now: the reload closes her connection and refuses her next one.
    ca.write_crl(&crl_file, &[&mallory, &alice], 2);
    assert_eq!(
        b.control.reload_revocations().await.expect("reloaded"),
        Some((2, 1))
    );
    assert_eq!(b.stats.connections_revoked.load(Ordering::Relaxed), 1);
    let end = within("alice's connection to close", async {
        loop {
            if let Err(e) = alice_client.publish_with("t", "x", &CONFIRM).await {
                break e;
            }
        }
    })
    .await;
    assert!(
        end.to_string().contains("client certificate revoked"),
        "{end}"
    );
    let why = refused(alice.clone(), alice_key.clone()).await;
    assert!(why.contains("revoked"), "{why}");
    bob_client
        .publish_with("t", "x", &CONFIRM)
        .await
        .expect("bob goes on");

    // A damaged file, or a list made by a CA of the same name with another key (the CA made
    // anew): the reload fails naming the key and why, and the lists in force stay.
    std::fs::write(&crl_file, "not a list").expect("write");
    let err = b
        .control
        .reload_revocations()
        .await
        .expect_err("a damaged file is refused");
    assert!(err.contains("tls.crl_file"), "{err}");
    test_ca().write_crl(&crl_file, &[], 3);
    let err = b
        .control
        .reload_revocations()
        .await
        .expect_err("a list of another key is refused");
    assert!(err.contains("not signed by that CA's key in "), "{err}");
    assert!(!err.contains("  "), "one space between words: {err}");
    let why = refused(alice, alice_key).await;
    assert!(why.contains("revoked"), "{why}");
    within("bob", connect(&bob, &bob_key))
        .await
        .expect("bob still connects");
    b.stop().await.expect("clean shutdown");
}

/// A broker that requires client certificates of `ca`, with the revocation list `crl_file`.
async fn mtls_broker(ca_file: &std::path::Path, crl_file: &std::path::Path) -> TestBroker {
    let (ca_file, crl_file) = (ca_file.to_path_buf(), crl_file.to_path_buf());
    TestBroker::start_with(|c| {
        c.tls.require_client_cert = true;
        c.tls.client_ca_file = Some(ca_file);
        c.tls.crl_file = Some(crl_file);
    })
    .await
}

/// A quinn endpoint presenting `cert`, keeping session tickets and sending 0-RTT data on the
/// connections it resumes; it has made a first connection (for a ticket) and closed it.
async fn endpoint_with_a_ticket(b: &TestBroker, cert: &PathBuf, key: &PathBuf) -> quinn::Endpoint {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_file_iter(cert)
        .expect("cert")
        .collect::<Result<Vec<_>, _>>()
        .expect("pem");
    let key = rustls_pki_types::PrivateKeyDer::from_pem_file(key).expect("key");
    let mut crypto = rustls::ClientConfig::builder_with_provider(aqueduct_server::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(dev_cert_roots(b))
        .with_client_auth_cert(certs, key)
        .expect("client auth");
    crypto.alpn_protocols = vec![b"aqueduct-v1".to_vec()];
    crypto.enable_early_data = true;
    let endpoint = client_endpoint(crypto, None);
    // A first connection, for a session ticket (it follows the handshake: one round trip).
    let first = within(
        "first connect",
        endpoint.connect(b.addr, "localhost").expect("connect"),
    )
    .await
    .expect("handshake");
    let (send, recv) = first.open_bi().await.expect("stream");
    let mut probe = RawStream::new(send, recv);
    probe.write_frame(&confirmed_publish(1, "probe", "p")).await;
    probe.read_frame().await.expect("the PUBLISH's CONFIRM");
    first.close(0u32.into(), b"bye");
    until("the first connection to end", || {
        b.control.client_ids().is_empty()
    })
    .await;
    endpoint
}

/// Resume the endpoint's session, send a confirmed PUBLISH to `topic` at once, and return how
/// the broker closed the connection (code, reason); the PUBLISH must not have been handled.
async fn resume_and_be_closed(
    b: &TestBroker,
    endpoint: &quinn::Endpoint,
    topic: &str,
) -> (u64, String) {
    let connecting = endpoint.connect(b.addr, "localhost").expect("connect");
    let Ok((conn, _)) = connecting.into_0rtt() else {
        panic!("the session was not resumed: no ticket")
    };
    // What it sends at once is never handled.
    if let Ok((mut send, _recv)) = conn.open_bi().await {
        let _ = send
            .write_all(&confirmed_publish(1, topic, "x").to_bytes())
            .await;
    }
    let closed = within("the resumed connection to be closed", conn.closed()).await;
    let quinn::ConnectionError::ApplicationClosed(close) = closed else {
        panic!("closed otherwise: {closed:?}")
    };
    assert!(
        b.broker.topic(&topic.try_into().expect("topic")).is_none(),
        "a frame of the refused connection was handled"
    );
    (
        u64::from(close.error_code),
        String::from_utf8_lossy(&close.reason).into_owned(),
    )
}

/// A client revoked after its first connection cannot get back in by resuming its TLS session
/// (TLS 1.3 resumption does not verify the client certificate again): the broker checks the
/// resumed connection's certificate against the lists in force as it lists it, and closes it
/// with NOT_AUTHORIZED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_certificate_cannot_resume_its_session() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let (alice, alice_key) = ca.client(dir.path(), "alice");
    let crl_file = dir.path().join("crl.pem");
    ca.write_crl(&crl_file, &[], 1);
    let b = mtls_broker(&ca_file, &crl_file).await;
    let endpoint = endpoint_with_a_ticket(&b, &alice, &alice_key).await;
    ca.write_crl(&crl_file, &[&alice], 2);
    assert_eq!(
        b.control.reload_revocations().await.expect("reloaded"),
        Some((1, 0))
    );
    let (code, reason) = resume_and_be_closed(&b, &endpoint, "revoked").await;
    assert_eq!((code, reason.as_str()), (400, "client certificate revoked"));
    assert_eq!(b.stats.connections_revoked.load(Ordering::Relaxed), 1);
    b.stop().await.expect("clean shutdown");
}

/// Wait until `cert` has expired (its notAfter is past, by the wall clock).
async fn until_expired(cert: &PathBuf) {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_file(cert).expect("a cert");
    let (_, not_after) = aqueduct_server::tls::validity(&der).expect("validity");
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs() as i64
    };
    until("the certificate to expire", || now() > not_after).await;
}

/// A broker requiring client certificates of `ca`, with an empty revocation list, and a client
/// certificate of that CA valid for 4 more seconds.
struct Brief {
    ca: TestCa,
    cert: PathBuf,
    key: PathBuf,
    crl_file: PathBuf,
    b: TestBroker,
}

impl Brief {
    async fn start(dir: &std::path::Path) -> Brief {
        let ca = test_ca();
        let ca_file = ca.write(dir);
        let crl_file = dir.join("crl.pem");
        ca.write_crl(&crl_file, &[], 1);
        let b = mtls_broker(&ca_file, &crl_file).await;
        // Made once the broker runs: its few seconds are the test's.
        let not_after = std::time::SystemTime::now() + Duration::from_secs(4);
        let (cert, key) = ca.client_until(dir, "brief", not_after);
        Brief {
            ca,
            cert,
            key,
            crl_file,
            b,
        }
    }
}

/// A client certificate that has expired since its session began cannot resume that session
/// (resumption verifies nothing, and a ticket lives a day): the broker closes the resumed
/// connection with NOT_AUTHORIZED, before handling its frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_cannot_resume_its_session() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Brief {
        cert: brief,
        key: brief_key,
        b,
        ..
    } = Brief::start(dir.path()).await;
    let endpoint = endpoint_with_a_ticket(&b, &brief, &brief_key).await;
    until_expired(&brief).await;
    let (code, reason) = resume_and_be_closed(&b, &endpoint, "expired").await;
    assert_eq!((code, reason.as_str()), (400, "client certificate expired"));
    b.stop().await.expect("clean shutdown");
}

/// A certificate revoked after it expired is still revoked: a reload closes its live
/// connection. Checked at the current time, the expiry hid the revocation (it is checked
/// first), and the connection went on being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_revoked_after_it_expired_is_closed_on_reload() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Brief {
        ca,
        cert: brief,
        key: brief_key,
        crl_file,
        b,
    } = Brief::start(dir.path()).await;
    let client = within(
        "connect",
        Client::connect(b.options().client_cert(brief.clone(), brief_key)),
    )
    .await
    .expect("valid for now");
    client
        .publish_with("t", "x", &CONFIRM)
        .await
        .expect("served");
    until_expired(&brief).await;
    ca.write_crl(&crl_file, &[&brief], 2);
    assert_eq!(
        b.control.reload_revocations().await.expect("reloaded"),
        Some((1, 1))
    );
    let end = within("the connection to close", client.closed()).await;
    assert!(
        end.to_string().contains("client certificate revoked"),
        "{end}"
    );
    b.stop().await.expect("clean shutdown");
}

/// A client certificate with two Common Names is refused: which of them names the client is a
/// convention (the first, the last) that a CA's issuing policy may read otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_with_two_common_names_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = test_ca();
    let ca_file = ca.write(dir.path());
    let (two, two_key) = ca.client_named(dir.path(), "two", &["intern-x", "service-a"]);
    let b = TestBroker::start_with(|c| {
        c.tls.require_client_cert = true;
        c.tls.client_ca_file = Some(ca_file.clone());
    })
    .await;
    let why = match within(
        "connect",
        Client::connect(b.options().client_cert(two, two_key)),
    )
    .await
    {
        Err(e) => e.to_string(),
        Ok(c) => within("the refusal", c.publish_with("t", "x", &CONFIRM))
            .await
            .expect_err("refused")
            .to_string(),
    };
    assert!(why.contains("no Common Name"), "{why}");
    b.stop().await.expect("clean shutdown");
}

/// The admin API and `tls.crl_file`: a revoked admin certificate fails the handshake, and one
/// revoked by a reload while its HTTP/2 connection stays open gets its next call refused
/// (PERMISSION_DENIED), not served for as long as the connection lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_admin_certificate_is_refused_on_a_live_connection_too() {
    a_revoked_admin_certificate_is_refused(false, true).await;
}

/// The same with an admin CA of its own (`admin.client_ca_file`, as admin-api.md suggests):
/// its list goes in `tls.crl_file` beside the clients' CA's. The clients' verifier refused a
/// list of a CA not its own, so the broker would not start with it (nor reload it), and an
/// admin certificate of that CA could not be revoked at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_certificate_of_an_admin_ca_of_its_own_can_be_revoked() {
    a_revoked_admin_certificate_is_refused(true, true).await;
}

/// An admin CA with no clients' CA at all (clients anonymous): its list in `tls.crl_file` is
/// taken (the configuration refused the file without `tls.client_ca_file`), and must cover it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_ca_alone_can_have_its_certificates_revoked() {
    a_revoked_admin_certificate_is_refused(true, false).await;
}

/// A list in `tls.crl_file` of a CA that neither the clients' nor the admin API's CA file
/// holds (an old admin CA's) would revoke nothing: it stops startup and is refused by a
/// reload, naming the list. It was taken without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_list_of_no_ca_in_use_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clients_ca = test_ca();
    let clients_ca_file = clients_ca.write(dir.path());
    let old_ca = test_ca_named("Aqueduct old admin CA");
    let ours = dir.path().join("clients-crl.pem");
    clients_ca.write_crl(&ours, &[], 1);
    let theirs = dir.path().join("old-crl.pem");
    old_ca.write_crl(&theirs, &[], 1);
    let both = dir.path().join("crl.pem");
    let mut text = std::fs::read(&ours).expect("ours");
    text.extend(std::fs::read(&theirs).expect("theirs"));
    std::fs::write(&both, &text).expect("write");
    let config = |crl: &PathBuf| {
        let mut c = aqueduct_server::Config::for_tests(dir.path().join("dev-cert.pem"));
        c.tls.client_ca_file = Some(clients_ca_file.clone());
        c.tls.crl_file = Some(crl.clone());
        c
    };
    let e = match aqueduct_server::Server::bind(config(&both)).await {
        Ok(_) => panic!("started with a list of no CA in use"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("tls.crl_file") && e.contains("list 2") && e.contains("a CA in none of"),
        "{e}"
    );
    // Started with its own list; a reload that brings the other is refused whole.
    let live = dir.path().join("live-crl.pem");
    std::fs::copy(&ours, &live).expect("copy");
    let b = TestBroker::start_with(|c| *c = config(&live)).await;
    std::fs::write(&live, &text).expect("write");
    let e = b
        .control
        .reload_revocations()
        .await
        .expect_err("a list of no CA in use");
    assert!(e.contains("a CA in none of"), "{e}");
    b.stop().await.expect("clean shutdown");
}

async fn a_revoked_admin_certificate_is_refused(own_ca: bool, with_clients_ca: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clients_ca = test_ca();
    let clients_ca_file = clients_ca.write(dir.path());
    let admin_dir = tempfile::tempdir().expect("tempdir");
    let admin_ca = own_ca.then(|| test_ca_named("Aqueduct admin test CA"));
    let ca = admin_ca.as_ref().unwrap_or(&clients_ca);
    let ca_file = ca.write(admin_dir.path());
    let (ops, ops_key) = ca.client(dir.path(), "admin-ops");
    let crl_file = dir.path().join("crl.pem");
    // One file: the admin CA's list, and the clients' CA's when that is another CA.
    let write_lists = |revoked: &[&PathBuf], number: u64| {
        ca.write_crl(&crl_file, revoked, number);
        if own_ca && with_clients_ca {
            let clients_list = dir.path().join("clients-crl.pem");
            clients_ca.write_crl(&clients_list, &[], number);
            let mut both = std::fs::read(&crl_file).expect("admin list");
            both.extend(std::fs::read(&clients_list).expect("clients' list"));
            std::fs::write(&crl_file, both).expect("write");
        }
    };
    write_lists(&[], 1);
    let state_file = dir.path().join("admin-state.json");
    let b = TestBroker::start_with(|c| {
        c.tls.client_ca_file = with_clients_ca.then(|| clients_ca_file.clone());
        c.tls.crl_file = Some(crl_file.clone());
        c.admin = Some(AdminConfig {
            listen_addr: "127.0.0.1:0".parse().expect("addr"),
            allowed_cn: "admin-*".parse().expect("pattern"),
            client_ca_file: ca_file.clone(),
            state_file,
        });
    })
    .await;
    let addr: SocketAddr = b.admin_addr.expect("admin API on");
    let connect = || {
        let opts = ConnectOptions::new(addr.to_string())
            .dev_cert_file(&b.dev_cert)
            .client_cert(ops.clone(), ops_key.clone());
        let tls = opts.tls_config(b"h2").expect("tls config");
        let name = opts.verified_name();
        async move {
            aqueduct_server::admin::connect(addr.to_string(), tls, &name, Duration::from_secs(5))
                .await
        }
    };
    let mut admin = connect().await.expect("admin-ops connects");
    within(
        "a call",
        admin.get_broker_info(proto::GetBrokerInfoRequest {}),
    )
    .await
    .expect("served");
    // Every admin slot taken by admin-ops.
    let mut held = Vec::new();
    for _ in 1..aqueduct_server::admin::MAX_CONNECTIONS {
        let mut more = connect().await.expect("admin-ops connects");
        within(
            "a call",
            more.get_broker_info(proto::GetBrokerInfoRequest {}),
        )
        .await
        .expect("served");
        held.push(more);
    }
    write_lists(&[&ops], 2);
    b.control.reload_revocations().await.expect("reloaded");
    let refused = within(
        "a call",
        admin.get_broker_info(proto::GetBrokerInfoRequest {}),
    )
    .await
    .expect_err("a revoked certificate's call");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("revoked"), "{refused:?}");
    // The revoked administrator's connections end DENIED_LIFETIME after the reload, all of
    // them, called on or not: they held every slot, and other administrators could not connect
    // until a restart. (The refused call above ends its own connection: two are needed.)
    let served = |cn: &'static str| {
        let (cert, key) = ca.client(dir.path(), cn);
        let opts = ConnectOptions::new(addr.to_string())
            .dev_cert_file(&b.dev_cert)
            .client_cert(cert, key);
        let tls = opts.tls_config(b"h2").expect("tls config");
        let name = opts.verified_name();
        within("another administrator to be served", async move {
            loop {
                let timeout = Duration::from_secs(5);
                if let Ok(mut a) =
                    aqueduct_server::admin::connect(addr.to_string(), tls.clone(), &name, timeout)
                        .await
                {
                    if a.get_broker_info(proto::GetBrokerInfoRequest {})
                        .await
                        .is_ok()
                    {
                        return a;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let _two = served("admin-two").await;
    let _three = served("admin-three").await;
    drop(held);
    let again = match connect().await {
        Err(e) => e.to_string(),
        Ok(mut a) => within("a call", a.get_broker_info(proto::GetBrokerInfoRequest {}))
            .await
            .expect_err("a revoked certificate is not served")
            .to_string(),
    };
    assert!(!again.is_empty());
    b.stop().await.expect("clean shutdown");
}
