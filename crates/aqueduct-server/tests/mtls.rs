//! mTLS end to end: with `tls.require_client_cert`, a client without a certificate is refused,
//! a client with one signed by `tls.client_ca_file` is served, and the broker identifies it by
//! the certificate's Common Name (checked in the broker's log line).

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use aqueduct_client::{Client, PublishOptions};
use common::*;
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};

/// Collects the broker's log lines (this test binary has one test, so a global subscriber is ok).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// Why a client connecting with `opts` was not served: the connection failed, or it was closed
/// right after the handshake (in TLS 1.3 the client may finish before the broker has checked
/// its certificate), which a confirmed publish shows. `None`: served.
async fn refusal(opts: aqueduct_client::ConnectOptions) -> Option<String> {
    let client = match within("connect", Client::connect(opts)).await {
        Err(e) => return Some(e.to_string()),
        Ok(client) => client,
    };
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    within("the refusal", client.publish_with("t", "x", &confirm))
        .await
        .err()
        .map(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_are_required_and_name_the_client() {
    let logs = Logs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_env_filter("aqueduct_server=info")
        .init();

    let dir = tempfile::tempdir().expect("temp dir");
    // A CA, and a client certificate for "alice" signed by it.
    let TestCa {
        pem: ca_pem,
        issuer,
    } = test_ca();
    let alice_key = KeyPair::generate().expect("key");
    let mut alice_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    alice_params
        .distinguished_name
        .push(DnType::CommonName, "alice");
    alice_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let alice = alice_params.signed_by(&alice_key, &issuer).expect("signed");
    let ca_file = dir.path().join("ca.pem");
    let cert_file = dir.path().join("alice.pem");
    let key_file = dir.path().join("alice.key");
    std::fs::write(&ca_file, ca_pem).expect("write");
    std::fs::write(&cert_file, alice.pem()).expect("write");
    std::fs::write(&key_file, alice_key.serialize_pem()).expect("write");

    let b = TestBroker::start_with(|c| {
        c.tls.require_client_cert = true;
        c.tls.client_ca_file = Some(ca_file.clone());
    })
    .await;

    // Without a certificate: the handshake fails, or the connection is closed right after it
    // (in TLS 1.3 the client may finish before the broker has checked its certificate).
    assert!(
        refusal(b.options()).await.is_some(),
        "a client without a certificate must not be served"
    );
    // Counted as a failed handshake, and never logged as connected (before the fix it was:
    // the handshake's failure read as its success).
    until("the refused handshake is counted", || {
        b.stats
            .handshakes_failed
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1
    })
    .await;

    // With alice's certificate: served, and known as "alice".
    let client = within(
        "mTLS connect",
        Client::connect(b.options().client_cert(&cert_file, &key_file)),
    )
    .await
    .expect("connects with a client certificate");
    let mut sub = client.subscribe("secure").await.expect("subscribe");
    client
        .publish_with(
            "secure",
            "hi",
            &PublishOptions {
                confirm: true,
                ..PublishOptions::default()
            },
        )
        .await
        .expect("publish");
    assert_eq!(next(&mut sub).await.body().as_ref(), b"hi");
    until("the connect log line", || {
        logs.text().contains("connected client=alice@127.0.0.1")
    })
    .await;
    assert!(
        logs.text().contains("subscribed client=alice@127.0.0.1"),
        "{}",
        logs.text()
    );
    assert!(
        !logs.text().contains("connected client=127.0.0.1"),
        "the refused client was logged as connected: {}",
        logs.text()
    );

    // A certificate of the same CA without a Common Name (subject alternative names only): it
    // names no client, and is refused, saying why. It was served as `anonymous`.
    let nameless_key = KeyPair::generate().expect("key");
    let mut nameless_params =
        CertificateParams::new(vec!["svc.example".to_string()]).expect("params");
    nameless_params.distinguished_name = rcgen::DistinguishedName::new();
    nameless_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let nameless = nameless_params
        .signed_by(&nameless_key, &issuer)
        .expect("signed");
    let nameless_cert = dir.path().join("nameless.pem");
    let nameless_key_file = dir.path().join("nameless.key");
    std::fs::write(&nameless_cert, nameless.pem()).expect("write");
    std::fs::write(&nameless_key_file, nameless_key.serialize_pem()).expect("write");
    let opts = b.options().client_cert(&nameless_cert, &nameless_key_file);
    let refusal = refusal(opts).await.expect("refused");
    assert!(refusal.contains("Common Name"), "{refusal}");
    b.stop().await.expect("clean shutdown");
}
