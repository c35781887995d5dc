//! The broker with certificate files (`tls.cert_file` / `tls.key_file`), and the client's trust
//! modes: a CA file, a pinned fingerprint (right and wrong), and the refusal to use the dev
//! certificate for a non-local name.

mod common;

use aqueduct_client::{Client, ConnectOptions, PublishOptions};
use aqueduct_server::{Config, Server};
use common::*;
use rcgen::{CertificateParams, KeyPair};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_files_ca_trust_and_pinning() {
    let dir = tempfile::tempdir().expect("dir");
    let TestCa {
        pem: ca_pem,
        issuer,
    } = test_ca();
    let broker_key = KeyPair::generate().expect("key");
    let broker_cert =
        CertificateParams::new(vec!["broker.test".to_string(), "127.0.0.1".to_string()])
            .expect("params")
            .signed_by(&broker_key, &issuer)
            .expect("signed");
    let (ca_file, cert_file, key_file) = (
        dir.path().join("ca.pem"),
        dir.path().join("broker.pem"),
        dir.path().join("broker.key"),
    );
    std::fs::write(&ca_file, ca_pem).expect("write");
    std::fs::write(&cert_file, broker_cert.pem()).expect("write");
    std::fs::write(&key_file, broker_key.serialize_pem()).expect("write");

    let b = TestBroker::start_with(|c| {
        c.tls.generate = false;
        c.tls.cert_file = Some(cert_file.clone());
        c.tls.key_file = Some(key_file.clone());
    })
    .await;
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    let addr = b.addr.to_string();

    // CA file, verifying the name in the certificate.
    let client = within(
        "connect",
        Client::connect(
            ConnectOptions::new(&addr)
                .server_name("broker.test")
                .ca_file(&ca_file),
        ),
    )
    .await
    .expect("verified by the CA");
    client
        .publish_with("t", "x", &confirm)
        .await
        .expect("served");

    // The wrong name is refused even with the right CA.
    let wrong_name = Client::connect(
        ConnectOptions::new(&addr)
            .server_name("other.test")
            .ca_file(&ca_file),
    )
    .await;
    assert!(wrong_name.is_err());

    // A pinned fingerprint: the right one connects, any other is refused.
    let digest = ring::digest::digest(&ring::digest::SHA256, broker_cert.der());
    let mut pin = [0u8; 32];
    pin.copy_from_slice(digest.as_ref());
    let pinned = within(
        "connect",
        Client::connect(ConnectOptions::new(&addr).pin_sha256(pin)),
    )
    .await
    .expect("pinned certificate accepted");
    pinned
        .publish_with("t", "y", &confirm)
        .await
        .expect("served");
    pin[0] ^= 0xFF;
    let refused = Client::connect(ConnectOptions::new(&addr).pin_sha256(pin))
        .await
        .expect_err("another fingerprint is refused")
        .to_string();
    let actual: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        refused.contains(&format!(
            "the broker's certificate (SHA-256 {actual}) does not match the pinned fingerprint"
        )) && !refused.contains("unexpected error"),
        "{refused}"
    );

    // No dev certificate was generated, and the default trust finds none.
    assert!(
        Client::connect(ConnectOptions::new(&addr).dev_cert_file(dir.path().join("none.pem")))
            .await
            .is_err()
    );
    b.stop().await.expect("clean shutdown");
}

/// A second broker started by mistake on a port in use fails, and leaves the running broker's
/// development certificate alone (its clients keep connecting); a metrics port in use is
/// reported under metrics_addr. Each says what usually holds the port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_the_same_port_keeps_the_first_ones_certificate() {
    let b = TestBroker::start().await;
    let before = std::fs::read(&b.dev_cert).expect("dev cert");
    for (key, flag) in [
        ("listen_addr", "--addr"),
        ("metrics_addr", "--metrics-addr"),
        ("webtransport.listen_addr", "webtransport.listen_addr"),
    ] {
        let mut second = Config::for_tests(b.dev_cert.clone());
        match key {
            "listen_addr" => second.listen_addr = b.addr,
            "metrics_addr" => second.metrics_addr = b.metrics_addr,
            _ => second.webtransport.listen_addr = Some(b.addr),
        }
        let err = Server::bind(second).await.expect_err("port in use");
        assert!(err.to_string().starts_with(key), "{err}");
        // Says what usually holds the port, and how to choose another.
        assert!(
            err.to_string().contains("still running?") && err.to_string().contains(flag),
            "{err}"
        );
        assert_eq!(std::fs::read(&b.dev_cert).expect("dev cert"), before);
        b.client()
            .await
            .publish("t", "x")
            .await
            .expect("still trusted");
    }
    b.stop().await.expect("clean shutdown");
}

/// Two brokers on one machine share a development certificate file (one AQUEDUCT_HOME, two
/// ports): the second adds its certificate next to the first one's instead of replacing it, so
/// a local client trusting the file reaches both (it used to get BadSignature from the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_local_brokers_sharing_a_development_certificate_file_are_both_trusted() {
    let first = TestBroker::start().await;
    let shared = first.dev_cert.clone();
    let second = TestBroker::start_with(|c| c.tls.dev_cert_file = shared.clone()).await;
    assert_eq!(second.dev_cert, first.dev_cert);
    let file = std::fs::read_to_string(&shared).expect("dev cert");
    for b in [&first, &second] {
        assert!(
            file.contains(&format!("# aqueduct-broker port={} ", b.addr.port())),
            "a section for each broker:\n{file}"
        );
    }
    for b in [&first, &second] {
        let client = within(
            "connect",
            Client::connect(ConnectOptions::new(b.addr.to_string()).dev_cert_file(&shared)),
        )
        .await
        .expect("trusted through the shared file");
        client
            .publish_with(
                "t",
                "x",
                &PublishOptions {
                    confirm: true,
                    ..PublishOptions::default()
                },
            )
            .await
            .expect("served");
    }
    second.stop().await.expect("clean shutdown");
    first.stop().await.expect("clean shutdown");
}

/// A native client that refuses the broker's certificate (here: another pinned fingerprint)
/// is a failed handshake, not a connection: the broker counts it in
/// aqueduct_handshakes_failed_total (it used to count it as a connection, served with 0-RTT
/// until the handshake failed, and log it as a client that disconnected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refusing_the_brokers_certificate_is_a_failed_handshake() {
    use std::sync::atomic::Ordering;
    let b = TestBroker::start().await;
    let refused = Client::connect(b.options().pin_sha256([7u8; 32])).await;
    assert!(refused.is_err(), "a wrong pin is refused");
    until("the failed handshake to be counted", || {
        b.stats.handshakes_failed.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(b.stats.connections_total.load(Ordering::Relaxed), 0);
    // A client that trusts it is a connection, and no failure.
    b.client().await.publish("t", "x").await.expect("served");
    until("the connection to be counted", || {
        b.stats.connections_total.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(b.stats.handshakes_failed.load(Ordering::Relaxed), 1);
    b.stop().await.expect("clean shutdown");
}
