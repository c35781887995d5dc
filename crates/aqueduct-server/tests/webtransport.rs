//! WebTransport on the broker's own UDP port, with a native WebTransport client
//! (`web-transport-quinn`, as a browser would do it: HTTP/3, `serverCertificateHashes` from
//! `GET /webtransport/cert-hash`): each stream of a session carries the frames of
//! docs/protocol.md. The same port serves a native `aqueduct-v1` client in the same test.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use aqueduct_proto::frame::{Message, Subscribe};
use aqueduct_proto::{
    decode_frame, DecodeError, Extensions, Frame, Limits, Publish, SubscribeSpec,
};
use bytes::{Buf, Bytes, BytesMut};
use common::relay::Relay;
use common::*;
use tokio::io::AsyncReadExt;

/// The browser certificate's hash and the UDP port to connect to, as a page fetches them.
async fn cert_hash_and_port(b: &TestBroker) -> (Vec<u8>, u16) {
    let (status, body) = get(b.metrics_addr, "/webtransport/cert-hash").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("JSON");
    assert_eq!(v["algorithm"], "sha-256");
    assert_eq!(v["path"], "/aqueduct/wt");
    // The test brokers listen on 127.0.0.1: a page on this machine must dial that, not
    // `localhost` (which a browser may resolve to ::1 only, for QUIC).
    assert_eq!(v["host"], "127.0.0.1", "{body}");
    let hex = v["value"].as_str().expect("value");
    let hash = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    let port = v["port"].as_u64().expect("port") as u16;
    (hash, port)
}

/// The browser certificate's hash, as a page fetches it.
async fn cert_hash(b: &TestBroker) -> Vec<u8> {
    let (hash, port) = cert_hash_and_port(b).await;
    // The QUIC port, which WebTransport shares: a page served elsewhere (the live view on the
    // metrics port) learns where to connect.
    assert_eq!(port, b.addr.port());
    hash
}

async fn wt_connect(
    b: &TestBroker,
    path: &str,
    origin: Option<&str>,
) -> Result<web_transport_quinn::Session, web_transport_quinn::ClientError> {
    wt_connect_to(b.addr.port(), cert_hash(b).await, path, origin).await
}

async fn wt_connect_to(
    port: u16,
    hash: Vec<u8>,
    path: &str,
    origin: Option<&str>,
) -> Result<web_transport_quinn::Session, web_transport_quinn::ClientError> {
    let client = web_transport_quinn::ClientBuilder::new()
        .with_server_certificate_hashes(vec![hash])
        .expect("client");
    let url = url::Url::parse(&format!("https://127.0.0.1:{port}{path}")).expect("url");
    let mut request = web_transport_quinn::proto::ConnectRequest::new(url);
    request.protocols.push("aqueduct-v1".into());
    if let Some(o) = origin {
        request
            .headers
            .insert("origin", o.parse().expect("header value"));
    }
    within("a WebTransport session", client.connect(request)).await
}

/// One bidirectional stream of a session, framed.
struct WtStream {
    send: web_transport_quinn::SendStream,
    recv: web_transport_quinn::RecvStream,
    buf: BytesMut,
}

impl WtStream {
    async fn open(s: &web_transport_quinn::Session) -> WtStream {
        let (send, recv) = within("a stream", s.open_bi()).await.expect("open_bi");
        WtStream {
            send,
            recv,
            buf: BytesMut::new(),
        }
    }

    async fn send(&mut self, frame: Frame) {
        let mut out = BytesMut::new();
        frame.encode(&mut out);
        self.send.write_all(&out).await.expect("write");
    }

    async fn next(&mut self) -> Frame {
        within("a frame over WebTransport", async {
            loop {
                let bytes = self.buf.clone().freeze();
                match decode_frame(&bytes, &Limits::default()) {
                    Ok((frame, used)) => {
                        self.buf.advance(used);
                        return frame;
                    }
                    Err(DecodeError::Incomplete { .. }) => {}
                    Err(DecodeError::Invalid(e)) => panic!("an invalid frame: {e}"),
                }
                let n = self.recv.read_buf(&mut self.buf).await.expect("read");
                assert!(n > 0, "the stream ended");
            }
        })
        .await
    }

    /// SUBSCRIBE with CONFIRM, and its CONFIRM.
    async fn subscribe(&mut self, stream_id: u32, spec: &str) {
        let spec = SubscribeSpec::parse(&Bytes::copy_from_slice(spec.as_bytes())).expect("spec");
        self.send(Frame::new(
            stream_id,
            Message::Subscribe(Subscribe {
                spec,
                ext: Extensions {
                    confirm: true,
                    ..Extensions::default()
                },
            }),
        ))
        .await;
        match self.next().await.message {
            Message::Confirm(_) => {}
            other => panic!("expected the SUBSCRIBE's CONFIRM, got {other:?}"),
        }
    }

    async fn delivery(&mut self) -> Publish {
        match self.next().await.message {
            Message::Publish(p) => p,
            other => panic!("expected a delivery, got {other:?}"),
        }
    }
}

fn publish_frame(topic: &str, body: &str, confirm: bool) -> Frame {
    let mut p = Publish::new(
        aqueduct_proto::TopicName::try_from(topic).expect("topic"),
        Bytes::copy_from_slice(body.as_bytes()),
    );
    p.ext.confirm = confirm;
    Frame::new(7, Message::Publish(p))
}

/// One UDP port: a WebTransport session and a native client publish to and subscribe from
/// each other (bytes intact, priorities in order), and share a consumer group (each job to
/// exactly one of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webtransport_session_and_a_native_client_share_one_port() {
    let b = TestBroker::start_with(|c| c.broker.max_in_flight = 64).await;
    let session = wt_connect(&b, "/aqueduct/wt", Some("http://localhost:8080"))
        .await
        .expect("session admitted");
    assert_eq!(session.protocol(), Some("aqueduct-v1"));
    let native = b.client().await;

    // Native → WebTransport, wildcard, binary body, priorities in order.
    let mut wt = WtStream::open(&session).await;
    wt.subscribe(1, "topic:sensors/#").await;
    let body = Bytes::from((0u8..=255).collect::<Vec<u8>>());
    native
        .publish_with(
            "sensors/hall/t1",
            body.clone(),
            &aqueduct_client::PublishOptions {
                confirm: true,
                priority: Some(aqueduct_client::Priority::new(1).expect("priority")),
                ..Default::default()
            },
        )
        .await
        .expect("publish");
    let d = wt.delivery().await;
    assert_eq!(d.topic().as_str(), "sensors/hall/t1");
    assert_eq!(d.body, body, "bytes intact");
    assert_eq!(d.priority().level(), 1);

    // WebTransport → native, confirmed with its offset.
    let mut sub = native.subscribe("from/browser").await.expect("subscribe");
    let mut pubs = WtStream::open(&session).await;
    pubs.send(publish_frame("from/browser", "hello from a page", true))
        .await;
    match pubs.next().await.message {
        Message::Confirm(c) => assert_eq!(c.offsets, vec![0]),
        other => panic!("expected a CONFIRM, got {other:?}"),
    }
    let m = next(&mut sub).await;
    assert_eq!(&m.body()[..], b"hello from a page");

    // A group with one member on each side: each job once, alternating.
    let mut member = WtStream::open(&session).await;
    member.subscribe(3, "topic:jobs:group:workers").await;
    let mut native_member = native
        .subscribe_group("jobs", "workers")
        .await
        .expect("member");
    for i in 0..10 {
        native
            .publish_with(
                "jobs",
                format!("j{i}"),
                &aqueduct_client::PublishOptions {
                    confirm: true,
                    ..Default::default()
                },
            )
            .await
            .expect("publish");
    }
    let mut seen = BTreeSet::new();
    for _ in 0..5 {
        let d = member.delivery().await;
        let offset = d.ext.offset.expect("offset");
        assert!(seen.insert(String::from_utf8_lossy(&d.body).into_owned()));
        // Settle it, as the spec says: ACK with the delivery's offset.
        member
            .send(Frame::new(
                3,
                Message::Ack(aqueduct_proto::frame::Ack {
                    offset,
                    ext: Extensions {
                        topic: Some(d.topic().clone()),
                        ..Extensions::default()
                    },
                }),
            ))
            .await;
    }
    for _ in 0..5 {
        let m = next(&mut native_member).await;
        assert!(
            seen.insert(String::from_utf8_lossy(m.body()).into_owned()),
            "once"
        );
        m.ack().await.expect("ack");
    }
    assert_eq!(seen.len(), 10);
    let metrics = get(b.metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&metrics, "aqueduct_webtransport_sessions_total"),
        Some(1.0)
    );
    session.close(0, b"done");
    b.stop().await.expect("clean shutdown");
}

/// A session on another path, from a page of another origin, or with an unknown token is
/// refused (and counted); a token the config names is admitted. A native client learns why from
/// the HTTP status; a browser (it sends `Origin`), which cannot see statuses, from a session that
/// selects no subprotocol and is closed at once with NOT_AUTHORIZED and a reason naming the
/// status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_refused_by_path_origin_and_token() {
    let b = TestBroker::start_with(|c| {
        c.webtransport
            .tokens
            .insert("a-long-enough-browser-token".into(), "dashboard".into());
    })
    .await;
    // Each refusal reaches a native client as its HTTP status (protocol.md §12), not as a
    // connection error.
    let status = |r: Result<web_transport_quinn::Session, web_transport_quinn::ClientError>| {
        use web_transport_quinn::{proto, ClientError, ConnectError};
        match r {
            Err(ClientError::HttpError(ConnectError::ErrorStatus(s)))
            | Err(ClientError::HttpError(ConnectError::ProtoError(
                proto::ConnectError::WrongStatus(Some(s)),
            ))) => s.as_u16(),
            Err(e) => panic!("refused without a status: {e}"),
            Ok(_) => panic!("admitted"),
        }
    };
    assert_eq!(
        status(wt_connect(&b, "/elsewhere", None).await),
        404,
        "path"
    );
    assert_eq!(
        status(wt_connect(&b, "/aqueduct/wt?token=guessed", None).await),
        401,
        "token"
    );
    // A page's: the session opens without the subprotocol it offered, then closes with
    // NOT_AUTHORIZED and a reason naming the status.
    let page = "http://localhost:8080";
    for (path, origin, code, why) in [
        (
            "/elsewhere",
            page,
            404,
            "is not under webtransport.path_prefix",
        ),
        (
            "/aqueduct/wt",
            "https://evil.example",
            403,
            "is not in webtransport.allowed_origins",
        ),
        ("/aqueduct/wt?token=guessed", page, 401, "unknown token"),
    ] {
        let session = wt_connect(&b, path, Some(origin))
            .await
            .unwrap_or_else(|e| panic!("{path} from {origin}: no session to close: {e}"));
        assert_eq!(session.protocol(), None, "{path} from {origin}");
        match within("the refused session to close", session.closed()).await {
            web_transport_quinn::SessionError::WebTransportError(
                web_transport_quinn::WebTransportError::Closed(c, reason),
            ) => {
                assert_eq!(c, 400, "{path} from {origin}: {reason}");
                assert!(
                    reason.starts_with(&format!("WebTransport session refused ({code}): "))
                        && reason.contains(why),
                    "{path} from {origin}: {reason}"
                );
            }
            other => panic!("{path} from {origin}: closed without a reason: {other}"),
        }
    }
    let ok = wt_connect(
        &b,
        "/aqueduct/wt?token=a-long-enough-browser-token",
        Some(page),
    )
    .await
    .expect("a known token");
    assert_eq!(ok.protocol(), Some("aqueduct-v1"));
    // The token names the client: the admin API's client list says so.
    until("the session to be listed as dashboard", || {
        b.control.client_ids().iter().any(|c| c == "dashboard")
    })
    .await;
    let metrics = get(b.metrics_addr, "/metrics").await.1;
    assert_eq!(
        value(&metrics, "aqueduct_webtransport_refused_total"),
        Some(5.0)
    );
    ok.close(0, b"done");
    b.stop().await.expect("clean shutdown");
}

/// The Rust client over WebTransport (what `aqueduct --transport webtransport` uses), trusting
/// the development certificate file as over QUIC: subscribe with a wildcard, publish singles
/// and a batch with confirmation, and a consumer group shared with a native QUIC member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_works_over_webtransport() {
    let b = TestBroker::start().await;
    let wt = within(
        "a WebTransport client",
        aqueduct_client::Client::connect(b.options().transport(
            aqueduct_client::Transport::WebTransport {
                path: "/aqueduct/wt".into(),
            },
        )),
    )
    .await
    .expect("connects over WebTransport");
    let native = b.client().await;
    // INFO (protocol.md §4.1) answers alike on either transport: the broker's defaults here.
    for client in [&wt, &native] {
        let info = client.info().await.expect("INFO");
        assert_eq!(
            (
                info.protocol,
                info.max_data_len,
                info.max_delivery_data_len,
                info.max_subscriptions
            ),
            (Some(1), Some(65536), Some(65536 + 1024), Some(10_000))
        );
    }
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    let mut on_wt = wt
        .subscribe("orders/+")
        .await
        .expect("subscribe over WebTransport");
    let mut on_quic = native
        .subscribe("orders/+")
        .await
        .expect("subscribe over QUIC");
    assert_eq!(
        native
            .publish_with("orders/eu", "from QUIC", &confirm)
            .await
            .expect("publish"),
        Some(0)
    );
    let batch = vec![
        ("orders/us", Bytes::from_static(b"from WT 1")),
        ("orders/us", Bytes::from_static(b"from WT 2")),
    ];
    assert_eq!(
        wt.publish_batch(batch, &confirm).await.expect("batch"),
        Some(vec![0, 1])
    );
    for sub in [&mut on_wt, &mut on_quic] {
        let got: Vec<String> = [next(sub).await, next(sub).await, next(sub).await]
            .iter()
            .map(|m| String::from_utf8_lossy(m.body()).into_owned())
            .collect();
        assert_eq!(got, ["from QUIC", "from WT 1", "from WT 2"]);
    }
    let mut g_wt = wt.subscribe_group("jobs", "w").await.expect("member");
    let mut g_quic = native.subscribe_group("jobs", "w").await.expect("member");
    for i in 0..6 {
        wt.publish_with("jobs", format!("j{i}"), &confirm)
            .await
            .expect("publish");
    }
    let mut seen = BTreeSet::new();
    for sub in [&mut g_wt, &mut g_quic] {
        for _ in 0..3 {
            let m = next(sub).await;
            assert!(seen.insert(String::from_utf8_lossy(m.body()).into_owned()));
            m.ack().await.expect("ack");
        }
    }
    assert_eq!(seen.len(), 6, "each job once");
    wt.close()
        .await
        .expect("close: everything published was taken");
    b.stop().await.expect("clean shutdown");
}

/// Accepts any server certificate: what this test checks is which protocol the broker speaks.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls_pki_types::CertificateDer<'_>,
        _intermediates: &[rustls_pki_types::CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A client endpoint that offers `alpn` and accepts any server certificate (these tests look at
/// what the broker shows, not at trust).
fn endpoint_offering(alpn: Vec<Vec<u8>>) -> quinn::Endpoint {
    let provider = aqueduct_server::tls::provider();
    let mut crypto = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_no_client_auth();
    crypto.alpn_protocols = alpn;
    client_endpoint(crypto, None)
}

/// A QUIC connection to `b` offering `alpn`, that sends nothing yet (and its endpoint, which
/// must live as long).
async fn connected_offering(
    b: &TestBroker,
    alpn: &[&[u8]],
) -> (quinn::Endpoint, quinn::Connection) {
    let endpoint = endpoint_offering(alpn.iter().map(|p| p.to_vec()).collect());
    let conn = within(
        "the handshake",
        endpoint.connect(b.addr, "localhost").expect("connect"),
    )
    .await
    .expect("handshake");
    (endpoint, conn)
}

/// A connection to `b` that agreed on `h3` (see [`connected_offering`]).
async fn h3_connection(b: &TestBroker) -> (quinn::Endpoint, quinn::Connection) {
    let (endpoint, conn) = connected_offering(b, &[b"h3"]).await;
    assert_eq!(negotiated(&conn).as_deref(), Some(&b"h3"[..]));
    (endpoint, conn)
}

/// The protocol a connection's handshake settled on.
fn negotiated(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.protocol)
}

/// The certificate the broker shows a connection offering `alpn`, and the protocol agreed.
async fn shown(b: &TestBroker, alpn: &[&[u8]]) -> (Vec<u8>, Option<Vec<u8>>) {
    let (_endpoint, conn) = connected_offering(b, alpn).await;
    let protocol = negotiated(&conn);
    let certs = conn
        .peer_identity()
        .and_then(|i| {
            i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .expect("the broker's certificate");
    conn.close(0u32.into(), b"done");
    (certs[0].to_vec(), protocol)
}

/// The certificate follows the protocol the handshake settles on, not what a client offers: a
/// client offering both `h3` and `aqueduct-v1` (in either order) speaks `aqueduct-v1`, which the
/// broker prefers, and is shown the development certificate, as a client trusting only that
/// one expects (docs/protocol.md §1). Before, offering `h3` at all got the browsers' one.
#[tokio::test]
async fn a_client_offering_h3_too_gets_the_certificate_of_the_protocol_agreed() {
    use rustls::pki_types::pem::PemObject;
    let b = TestBroker::start().await;
    let pem = std::fs::read(&b.dev_cert).expect("dev cert");
    let dev = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .next()
        .expect("a certificate")
        .expect("PEM")
        .to_vec();
    let browser_hash = cert_hash(&b).await;
    for offer in [
        &[&b"h3"[..], &b"aqueduct-v1"[..]][..],
        &[&b"aqueduct-v1"[..], &b"h3"[..]][..],
        &[&b"aqueduct-v1"[..]][..],
    ] {
        let (cert, protocol) = shown(&b, offer).await;
        assert_eq!(protocol.as_deref(), Some(&b"aqueduct-v1"[..]), "{offer:?}");
        assert!(
            cert == dev,
            "offering {offer:?}: not the development certificate"
        );
    }
    // A connection that will speak h3 gets the browsers' certificate.
    let (cert, protocol) = shown(&b, &[b"h3"]).await;
    assert_eq!(protocol.as_deref(), Some(&b"h3"[..]));
    let digest = ring::digest::digest(&ring::digest::SHA256, &cert);
    assert_eq!(digest.as_ref(), &browser_hash[..]);
    b.stop().await.expect("stops");
}

/// A ClientHello too large for one packet (Chromium's often is: its post-quantum key share
/// alone is over 1 KB) offering HTTP/3: the broker must read the negotiated protocol only once
/// all of it is in. It used to decide on the first packet, took about one browser session in
/// four for a native connection, and stopped the browser's HTTP/3 control stream.
#[tokio::test]
async fn a_client_hello_in_two_packets_still_gets_http3() {
    let b = TestBroker::start().await;
    // ~1.7 KB of protocol names the broker does not speak, then HTTP/3.
    let endpoint = endpoint_offering(
        (0..120)
            .map(|i| format!("x-padding-{i:03}").into_bytes())
            .chain([b"h3".to_vec()])
            .collect(),
    );
    for _ in 0..3 {
        // Each connection through a relay of its own: its second datagram comes late.
        let relay = Relay::start_delaying(b.addr, 2, Duration::from_millis(300)).await;
        let conn = within(
            "the handshake",
            endpoint.connect(relay.front, "localhost").expect("connect"),
        )
        .await
        .expect("handshake");
        assert_eq!(negotiated(&conn).as_deref(), Some(&b"h3"[..]));
        // An HTTP/3 server opens its control stream (type 0x00) at once; the broker's native
        // protocol never opens a unidirectional stream.
        let mut control = tokio::time::timeout(Duration::from_secs(5), conn.accept_uni())
            .await
            .expect("the broker opens its HTTP/3 control stream: it took the connection for HTTP/3")
            .expect("a stream");
        let mut kind = [0u8; 1];
        control.read_exact(&mut kind).await.expect("stream type");
        assert_eq!(kind, [0x00], "an HTTP/3 control stream");
        conn.close(0u32.into(), b"done");
    }
    b.stop().await.expect("stops");
}

/// `webtransport.listen_addr`: browsers get a UDP port of their own (the one the certificate
/// hash names), a native client is refused there with a reason, and the broker's own port
/// still serves both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webtransport_on_a_port_of_its_own() {
    let b = TestBroker::start_with(|c| {
        c.webtransport.listen_addr = Some("127.0.0.1:0".parse().expect("addr"));
    })
    .await;
    let (hash, port) = cert_hash_and_port(&b).await;
    assert_ne!(port, b.addr.port(), "the page is told the port of its own");
    // The live view's page names the same port (it falls back on it when there is no hash
    // to fetch, with a certificate of the broker's own).
    let page = get(b.metrics_addr, "/").await.1;
    assert!(
        page.contains(&format!("name=\"aqueduct-wt-port\" content=\"{port}\"")),
        "{page}"
    );
    let session = wt_connect_to(port, hash.clone(), "/aqueduct/wt", None)
        .await
        .expect("a session on the WebTransport port");
    let mut sub = WtStream::open(&session).await;
    sub.subscribe(3, "topic:news/#").await;
    let native = b.client().await;
    native
        .publish("news/eu", "on its own port")
        .await
        .expect("publish");
    let d = sub.delivery().await;
    assert_eq!(&d.body[..], b"on its own port");
    // The broker's own port serves browsers too.
    wt_connect_to(b.addr.port(), hash, "/aqueduct/wt", None)
        .await
        .expect("a session on the broker's port");
    // A native client on the WebTransport port: refused, saying where to go.
    let refused = aqueduct_client::Client::connect(
        aqueduct_client::ConnectOptions::new(format!("127.0.0.1:{port}"))
            .dev_cert_file(&b.dev_cert),
    )
    .await;
    let why = match refused {
        Ok(c) => match c
            .publish_with(
                "x",
                "y",
                &aqueduct_client::PublishOptions {
                    confirm: true,
                    ..Default::default()
                },
            )
            .await
        {
            Ok(_) => panic!("a native client was served on the WebTransport port"),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    assert!(why.contains("WebTransport (HTTP/3) only"), "{why}");
    until("the refusal counted", || {
        b.stats
            .webtransport_refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    b.stop().await.expect("stops");
}

/// An administrator's disconnect closes a WebTransport session through the session (code 0,
/// the reason), so a browser's `WebTransport.closed` resolves with them; a bare connection
/// close made it reject as a failed connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_closes_a_webtransport_session_with_its_reason() {
    let b = TestBroker::start_with(|c| {
        c.webtransport
            .tokens
            .insert("a-long-enough-browser-token".into(), "dashboard".into());
    })
    .await;
    let session = wt_connect(&b, "/aqueduct/wt?token=a-long-enough-browser-token", None)
        .await
        .expect("a session");
    until("the session to be listed", || {
        b.control.client_ids().iter().any(|c| c == "dashboard")
    })
    .await;
    assert_eq!(
        b.control
            .disconnect_client("dashboard", "disconnected by an administrator (test)"),
        1
    );
    match within("the session to close", session.closed()).await {
        web_transport_quinn::SessionError::WebTransportError(
            web_transport_quinn::WebTransportError::Closed(code, reason),
        ) => {
            assert_eq!(code, 0);
            assert_eq!(reason, "disconnected by an administrator (test)");
        }
        other => panic!("closed without the session's close message: {other}"),
    }
    b.stop().await.expect("clean shutdown");
}

/// A session's own CONNECT stream does not count against `transport.max_streams_per_connection`:
/// a page may open as many streams at once as a native client (it got one fewer, and its last
/// open waited forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_opens_as_many_streams_as_a_native_client() {
    const STREAMS: u32 = 4;
    let b = TestBroker::start_with(|c| c.transport.max_streams_per_connection = STREAMS).await;
    let session = wt_connect(&b, "/aqueduct/wt", None)
        .await
        .expect("a session");
    let mut open = Vec::new();
    for i in 0..STREAMS {
        let mut s = WtStream::open(&session).await;
        // Served: its SUBSCRIBE is confirmed (and it stays open).
        s.subscribe(i + 1, &format!("topic:limits/{i}")).await;
        open.push(s);
    }
    let native = b.client().await;
    let confirm = aqueduct_client::PublishOptions {
        confirm: true,
        ..Default::default()
    };
    native
        .publish_with("limits/3", Bytes::from_static(b"last"), &confirm)
        .await
        .expect("publish");
    assert_eq!(&open[3].delivery().await.body[..], b"last");
    session.close(0, b"done");
    b.stop().await.expect("clean shutdown");
}

/// `Client::closed` over WebTransport says who ended the session: the client's own close, or
/// the broker's shutdown (its close capsule, with SHUTTING_DOWN). The QUIC connection under the
/// session says the opposite (a capsule makes the client close QUIC; the client's close waits
/// for the broker to close it), which is what a first version reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_says_who_ended_a_webtransport_session() {
    let b = TestBroker::start().await;
    let wt_options = || {
        b.options()
            .transport(aqueduct_client::Transport::WebTransport {
                path: "/aqueduct/wt".into(),
            })
    };
    let own = within("a client", aqueduct_client::Client::connect(wt_options()))
        .await
        .expect("connects over WebTransport");
    let other = within("a client", aqueduct_client::Client::connect(wt_options()))
        .await
        .expect("connects over WebTransport");
    let waiting = tokio::spawn({
        let own = own.clone();
        async move { own.closed().await }
    });
    own.close().await.expect("close");
    let err = within("the own close", waiting).await.expect("joined");
    assert!(matches!(err, aqueduct_client::ClientError::Closed), "{err}");
    let stopping = tokio::spawn(b.stop());
    let err = within("the broker's close", other.closed()).await;
    assert!(
        matches!(err, aqueduct_client::ClientError::Connection(_))
            && err.to_string().to_lowercase().contains("shutting down"),
        "{err}"
    );
    within("the broker", stopping)
        .await
        .expect("joined")
        .expect("clean shutdown");
}

/// After `close`, what is asked of a WebTransport client fails as closed, as over QUIC: opening
/// a stream and writing said "connection lost" (the session's record of its own close).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_close_a_webtransport_client_is_closed_not_lost() {
    let b = TestBroker::start().await;
    let client = within(
        "a client",
        aqueduct_client::Client::connect(b.options().transport(
            aqueduct_client::Transport::WebTransport {
                path: "/aqueduct/wt".into(),
            },
        )),
    )
    .await
    .expect("connects over WebTransport");
    // A publisher whose stream is open when the client closes.
    let publisher = client.publisher();
    within("a first publish", publisher.publish("t", "x"))
        .await
        .expect("published");
    client.close().await.expect("close");
    let published = within("a publish after close", client.publish("t", "x")).await;
    assert!(
        matches!(published, Err(aqueduct_client::ClientError::Closed)),
        "{published:?}"
    );
    let subscribed = within("a subscribe after close", client.subscribe("u")).await;
    assert!(
        matches!(subscribed, Err(aqueduct_client::ClientError::Closed)),
        "{:?}",
        subscribed.err()
    );
    let written = within("a publish on an open stream", publisher.publish("t", "x")).await;
    assert!(
        matches!(written, Err(aqueduct_client::ClientError::Closed)),
        "{written:?}"
    );
    b.stop().await.expect("clean shutdown");
}

/// With WebTransport on, the broker offers QUIC datagrams (HTTP/3 must: RFC 9297, and a
/// browser closes a connection announcing H3_DATAGRAM without them), into a small buffer.
#[tokio::test]
async fn http3_connections_are_offered_datagrams() {
    let b = TestBroker::start().await;
    let (_endpoint, conn) = h3_connection(&b).await;
    assert!(conn.max_datagram_size().is_some());
    conn.close(0u32.into(), b"done");
    b.stop().await.expect("stops");
}

/// An HTTP/3 connection that never sets up its WebTransport session does not hold up a
/// shutdown: it is closed with SHUTTING_DOWN at once. Its wait for the session had a timeout of
/// its own (`transport.handshake_timeout`, started after the TLS handshake) and did not watch the
/// shutdown, so the broker's stop waited for it (up to its 10 s grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_http3_connection_does_not_hold_up_a_shutdown() {
    let b =
        TestBroker::start_with(|c| c.transport.handshake_timeout = Duration::from_secs(60)).await;
    let (_endpoint, conn) = h3_connection(&b).await;
    stopped_closing_with_501(b, &conn).await;
}

/// Stop `b` (within 5 s) and see `conn` closed by it with SHUTTING_DOWN (501).
async fn stopped_closing_with_501(b: TestBroker, conn: &quinn::Connection) {
    tokio::time::timeout(Duration::from_secs(5), b.stop())
        .await
        .expect("the broker stops at once")
        .expect("stops");
    match within("the close", conn.closed()).await {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, 501u32.into(), "{c:?}")
        }
        other => panic!("closed otherwise: {other}"),
    }
}

/// A refused session's connection that its client keeps open (to read the status) does not
/// hold up a shutdown: it is closed with SHUTTING_DOWN at once. It lingered its 2 s whatever
/// the shutdown, then was closed with code 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_session_kept_open_does_not_hold_up_a_shutdown() {
    use web_transport_quinn::proto;
    let b = TestBroker::start().await;
    let (_endpoint, conn) = h3_connection(&b).await;
    // The HTTP/3 setup and the CONNECT by hand: a client library drops its streams when it is
    // refused, and the broker's side then closes the connection itself.
    let mut settings = proto::Settings::default();
    settings.enable_webtransport(1);
    let mut control = conn.open_uni().await.expect("control stream");
    settings.write(&mut control).await.expect("settings");
    let url =
        url::Url::parse(&format!("https://127.0.0.1:{}/elsewhere", b.addr.port())).expect("url");
    let (mut send, mut recv) = conn.open_bi().await.expect("CONNECT stream");
    proto::ConnectRequest::new(url)
        .write(&mut send)
        .await
        .expect("CONNECT");
    match within("the refusal", proto::ConnectResponse::read(&mut recv)).await {
        Err(proto::ConnectError::WrongStatus(Some(s))) => assert_eq!(s.as_u16(), 404),
        other => panic!("not refused with 404: {other:?}"),
    }
    stopped_closing_with_501(b, &conn).await;
    drop((control, send, recv));
}

/// An HTTP/3 connection whose setup fails (its SETTINGS do not enable WebTransport) is closed
/// at once with code 100 and a reason saying why (protocol.md 1.1). It was left to its last
/// handle, which closed it with code 0 and no reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_http3_setup_is_closed_with_its_reason() {
    use web_transport_quinn::proto;
    let b =
        TestBroker::start_with(|c| c.transport.handshake_timeout = Duration::from_secs(60)).await;
    let (_endpoint, conn) = h3_connection(&b).await;
    let mut control = conn.open_uni().await.expect("control stream");
    proto::Settings::default()
        .write(&mut control)
        .await
        .expect("settings without WebTransport");
    match within("the close", conn.closed()).await {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, 100u32.into(), "{c:?}");
            let reason = String::from_utf8_lossy(&c.reason);
            assert!(
                reason.starts_with("WebTransport handshake failed: "),
                "{reason}"
            );
        }
        other => panic!("closed otherwise: {other}"),
    }
    drop(control);
    b.stop().await.expect("stops");
}

/// An HTTP/3 connection that does not set up its session within `transport.handshake_timeout`
/// (counted from its first packet, TLS included) is closed as a native one is: code 100,
/// reason `handshake timed out` (protocol.md 1.1). It was closed with code 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_http3_connection_is_closed_at_the_handshake_deadline() {
    let b = TestBroker::start_with(|c| c.transport.handshake_timeout = Duration::from_millis(500))
        .await;
    let (_endpoint, conn) = h3_connection(&b).await;
    match within("the close", conn.closed()).await {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, 100u32.into(), "{c:?}");
            assert_eq!(&c.reason[..], b"handshake timed out");
        }
        other => panic!("closed otherwise: {other}"),
    }
    b.stop().await.expect("stops");
}

/// A stream-fatal framing error on a WebTransport stream: the ERROR, then STOP_SENDING with
/// WebTransport's code 0 (protocol.md 1.1, 12), which a WebTransport client decodes as 0. The
/// broker let the library's receiving half go as it was, and quinn sent a raw QUIC 0, which is
/// no WebTransport code: the client saw none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_frame_on_a_webtransport_stream_stops_it_with_code_0() {
    let b = TestBroker::start().await;
    let session = wt_connect(&b, "/aqueduct/wt", None)
        .await
        .expect("a session");
    let mut s = WtStream::open(&session).await;
    s.send.write_all(&[0u8; 10]).await.expect("write");
    let Message::Error(e) = s.next().await.message else {
        panic!("no ERROR")
    };
    assert_eq!(e.code, aqueduct_proto::ErrorCode::BAD_MAGIC);
    let stopped = within("STOP_SENDING", s.send.stopped())
        .await
        .expect("the session lives");
    assert_eq!(stopped, Some(0));
    session.close(0, b"done");
    b.stop().await.expect("stops");
}
