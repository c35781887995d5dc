//! Shared helpers for the end-to-end tests: a real broker on 127.0.0.1 port 0 with a generated
//! certificate in a temporary directory, the real client, and a raw QUIC client for sending
//! hand-made frames. Every wait is on a condition, bounded by a timeout.
#![allow(dead_code)]

pub mod otlp;
pub mod relay;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use aqueduct_client::{Client, ConnectOptions, Message, Subscription};
use aqueduct_core::Broker;
use aqueduct_proto::{decode_frame, DecodeError, Frame, Limits};
use aqueduct_server::{Config, Server, ServerError, ServerStats};
use bytes::{Buf, BytesMut};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Generous: CI machines are shared and tests run in debug builds.
pub const WAIT: Duration = Duration::from_secs(20);

pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// Poll `cond` until it holds (every 5 ms), or fail after [`WAIT`].
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// Close `client` (everything it published must have been taken) and stop `broker` cleanly.
pub async fn close_and_stop(client: Client, broker: TestBroker) {
    client
        .close()
        .await
        .expect("close: everything published was taken");
    broker.stop().await.expect("clean shutdown");
}

pub struct TestBroker {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub dev_cert: PathBuf,
    pub broker: Arc<Broker>,
    pub stats: Arc<ServerStats>,
    /// The admin API's address, when enabled.
    pub admin_addr: Option<SocketAddr>,
    pub control: aqueduct_server::Control,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServerError>>>,
    _dir: tempfile::TempDir,
}

impl TestBroker {
    pub async fn start() -> TestBroker {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> TestBroker {
        Self::start_custom(adjust, |_| {}).await
    }

    /// Like `start_with`, and `before` may change the bound server before it serves.
    pub async fn start_custom(
        adjust: impl FnOnce(&mut Config),
        before: impl FnOnce(&mut Server),
    ) -> TestBroker {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = Config::for_tests(dir.path().join("dev-cert.pem"));
        adjust(&mut config);
        let mut server = Server::bind(config).await.expect("broker binds");
        before(&mut server);
        let addr = server.local_addr();
        let metrics_addr = server.metrics_addr();
        let dev_cert = server
            .dev_cert_file()
            .cloned()
            .unwrap_or_else(|| dir.path().join("dev-cert.pem"));
        let broker = server.broker();
        let stats = server.stats();
        let admin_addr = server.admin_addr();
        let control = server.control();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = rx.await;
        }));
        TestBroker {
            addr,
            metrics_addr,
            dev_cert,
            broker,
            stats,
            admin_addr,
            control,
            stop: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    pub fn options(&self) -> ConnectOptions {
        ConnectOptions::new(self.addr.to_string()).dev_cert_file(&self.dev_cert)
    }

    pub async fn client(&self) -> Client {
        within("client connect", Client::connect(self.options()))
            .await
            .expect("client connects")
    }

    /// Graceful shutdown; returns what `serve` returned.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let task = self.task.take().expect("running");
        within("broker shutdown", task).await.expect("serve task")
    }
}

/// Publish 300 messages of 1,000 bytes to `topic` and wait until the broker's write to a
/// subscriber that reads nothing (its stream window small) is blocked by flow control: what
/// came after its last fill waits in its queue.
pub async fn block_a_write(broker: &Broker, publisher: &Client, topic: &str) {
    let body = "x".repeat(1000);
    for _ in 0..300 {
        publisher
            .publish(topic, body.clone())
            .await
            .expect("publish");
    }
    until("the write to block", || {
        broker.subscribers().iter().any(|sub| sub.queued() >= 50)
    })
    .await;
}

/// The next message, or panic.
pub async fn next(sub: &mut Subscription) -> Message {
    within("a message", sub.next())
        .await
        .expect("subscription still open")
        .expect("a message, not an error")
}

/// A PUBLISH of `body` to `topic` asking for a CONFIRM.
pub fn confirmed_publish(stream_id: u32, topic: &str, body: &str) -> Frame {
    Frame::new(
        stream_id,
        aqueduct_proto::frame::Message::Publish(
            aqueduct_proto::Publish::new(
                aqueduct_proto::TopicName::try_from(topic).expect("valid"),
                bytes::Bytes::from(body.to_string()),
            )
            .with_confirm(),
        ),
    )
}

/// A hand-made frame: header and data as given.
pub fn raw_frame(command: u8, stream_id: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    aqueduct_proto::header::write_header(&mut out, command, stream_id, data.len() as u32);
    out.extend_from_slice(data);
    out
}

/// The code of an ERROR frame, or panic.
pub fn error_code(frame: &Frame) -> aqueduct_proto::ErrorCode {
    match &frame.message {
        aqueduct_proto::frame::Message::Error(e) => e.code,
        other => panic!("expected an ERROR, got {other:?}"),
    }
}

/// A raw QUIC connection speaking hand-made frames.
pub struct Raw {
    pub conn: quinn::Connection,
    _endpoint: quinn::Endpoint,
}

pub struct RawStream {
    pub send: quinn::SendStream,
    recv: quinn::RecvStream,
    buf: BytesMut,
}

impl Raw {
    /// Connect trusting the broker's dev certificate; `stream_window` limits how much the broker
    /// may send on a stream before we read (small values make a stalled subscriber).
    pub async fn connect(b: &TestBroker, stream_window: u32) -> Raw {
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(stream_window.into());
        let endpoint = client_endpoint(dev_cert_crypto(b), Some(transport));
        let conn = within(
            "raw connect",
            endpoint.connect(b.addr, "localhost").expect("connect"),
        )
        .await
        .expect("handshake");
        Raw {
            conn,
            _endpoint: endpoint,
        }
    }

    /// Vanish without closing: no CONNECTION_CLOSE is ever sent (the endpoint keeps running
    /// until the test process ends), so the broker only notices at its idle timeout.
    pub fn forget(self) {
        std::mem::forget(self);
    }

    pub async fn stream(&self) -> RawStream {
        let (send, recv) = self.conn.open_bi().await.expect("open stream");
        RawStream {
            send,
            recv,
            buf: BytesMut::new(),
        }
    }
}

use rustls_pki_types::pem::PemObject;

/// The broker's dev certificate as the only trusted root.
pub fn dev_cert_roots(b: &TestBroker) -> rustls::RootCertStore {
    let pem = std::fs::read(&b.dev_cert).expect("dev cert");
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.expect("pem")).expect("root");
    }
    roots
}

/// TLS 1.3 client settings that trust the broker's dev certificate only, ALPN `aqueduct-v1`.
pub fn dev_cert_crypto(b: &TestBroker) -> rustls::ClientConfig {
    let roots = dev_cert_roots(b);
    let mut crypto = rustls::ClientConfig::builder_with_provider(aqueduct_server::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_no_client_auth();
    crypto.alpn_protocols = vec![b"aqueduct-v1".to_vec()];
    crypto
}

/// A quinn client endpoint on 127.0.0.1 with `crypto` (and `transport`, else quinn's defaults).
pub fn client_endpoint(
    crypto: rustls::ClientConfig,
    transport: Option<quinn::TransportConfig>,
) -> quinn::Endpoint {
    let mut config = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(crypto).expect("quic crypto"),
    ));
    if let Some(t) = transport {
        config.transport_config(Arc::new(t));
    }
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    endpoint.set_default_client_config(config);
    endpoint
}

/// A client endpoint that trusts the broker's dev certificate, keeps session tickets and sends
/// 0-RTT data on the connections it resumes (`Connecting::into_0rtt`).
pub fn zero_rtt_endpoint(b: &TestBroker) -> quinn::Endpoint {
    let mut crypto = dev_cert_crypto(b);
    crypto.enable_early_data = true;
    client_endpoint(crypto, None)
}

impl RawStream {
    /// A stream opened by hand (e.g. on a 0-RTT connection).
    pub fn new(send: quinn::SendStream, recv: quinn::RecvStream) -> RawStream {
        RawStream {
            send,
            recv,
            buf: BytesMut::new(),
        }
    }

    pub async fn write(&mut self, bytes: &[u8]) {
        self.send.write_all(bytes).await.expect("write");
    }

    /// Finish our sending side (FIN) and keep reading.
    pub fn finish(&mut self) {
        self.send.finish().expect("finish");
    }

    /// Reset our sending side (RESET_STREAM) and keep reading.
    pub fn reset(&mut self, code: u32) {
        self.send.reset(code.into()).expect("reset");
    }

    /// Read (and drop) frames to the end of the stream: `Ok` if the broker finished it, `Err`
    /// with the code if it reset it.
    pub async fn stream_end(&mut self) -> Result<(), u64> {
        within("the end of the stream", async {
            loop {
                self.buf.clear();
                match self.recv.read_buf(&mut self.buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => {}
                    Err(e) => match e
                        .get_ref()
                        .and_then(|i| i.downcast_ref::<quinn::ReadError>())
                    {
                        Some(quinn::ReadError::Reset(code)) => return Err(code.into_inner()),
                        _ => panic!("stream read failed: {e}"),
                    },
                }
            }
        })
        .await
    }

    /// Ask the broker to stop sending on this stream (STOP_SENDING) and keep writing.
    pub fn stop_reading(&mut self) {
        self.recv.stop(0u32.into()).expect("stop");
    }

    pub async fn write_frame(&mut self, frame: &Frame) {
        self.write(&frame.to_bytes()).await;
    }

    /// Read until the broker says this stream's subscription was closed as a slow consumer —
    /// an ERROR frame with SLOW_CONSUMER if its writer was not blocked, or a reset with that
    /// code if it was (`docs/protocol.md` §7.3); which one depends on timing. Returns the code.
    pub async fn slow_consumer_notice(&mut self) -> u64 {
        within("the slow-consumer notice", async {
            loop {
                let bytes = self.buf.clone().freeze();
                match decode_frame(&bytes, &Limits::default()) {
                    Ok((frame, used)) => {
                        self.buf.advance(used);
                        if let aqueduct_proto::frame::Message::Error(e) = frame.message {
                            return u64::from(e.code.0);
                        }
                        continue;
                    }
                    Err(DecodeError::Incomplete { .. }) => {}
                    Err(DecodeError::Invalid(e)) => panic!("broker sent an invalid frame: {e}"),
                }
                match self.recv.read_buf(&mut self.buf).await {
                    Ok(0) => panic!("the stream ended without a slow-consumer notice"),
                    Ok(_) => {}
                    Err(e) => match e
                        .get_ref()
                        .and_then(|i| i.downcast_ref::<quinn::ReadError>())
                    {
                        Some(quinn::ReadError::Reset(code)) => return code.into_inner(),
                        _ => panic!("stream read failed: {e}"),
                    },
                }
            }
        })
        .await
    }

    /// The next frame from the broker, `None` when the broker finished the stream.
    pub async fn read_frame(&mut self) -> Option<Frame> {
        within("a frame from the broker", async {
            loop {
                let bytes = self.buf.clone().freeze();
                match decode_frame(&bytes, &Limits::default()) {
                    Ok((frame, used)) => {
                        self.buf.advance(used);
                        return Some(frame);
                    }
                    Err(DecodeError::Incomplete { .. }) => {}
                    Err(DecodeError::Invalid(e)) => panic!("broker sent an invalid frame: {e}"),
                }
                match self.recv.read_buf(&mut self.buf).await {
                    Ok(0) => return None,
                    Ok(_) => {}
                    Err(_) => return None,
                }
            }
        })
        .await
    }
}

/// A test certificate authority: its PEM file and an issuer to sign leaf certificates with.
pub struct TestCa {
    pub pem: String,
    pub issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

pub fn test_ca() -> TestCa {
    test_ca_named("Aqueduct test CA")
}

/// A test CA whose certificate's Common Name is `cn`.
pub fn test_ca_named(cn: &str) -> TestCa {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, cn);
    let cert = params.self_signed(&key).expect("ca");
    TestCa {
        pem: cert.pem(),
        issuer: rcgen::Issuer::new(params, key),
    }
}

impl TestCa {
    /// A certificate signed by this CA, for `names` (DNS names or IP addresses), with common
    /// name `cn` if given and the key usages `usages`, valid until `not_after` if given (else rcgen's
    /// default, far off), written to `dir` as `<file>.pem` and `<file>.key`.
    fn leaf(
        &self,
        dir: &std::path::Path,
        file: &str,
        names: &[&str],
        cn: Option<&str>,
        usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
        not_after: Option<std::time::SystemTime>,
    ) -> (PathBuf, PathBuf) {
        use rcgen::{CertificateParams, DnType, KeyPair};
        let key = KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("params");
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        if let Some(at) = not_after {
            params.not_before = (std::time::SystemTime::now() - Duration::from_secs(60)).into();
            params.not_after = at.into();
        }
        params.extended_key_usages = usages;
        self.sign_and_write(params, key, dir, file)
    }

    /// Sign `params` (with `key`) and write the certificate and key to `dir` as `<file>.pem` and
    /// `<file>.key`.
    fn sign_and_write(
        &self,
        params: rcgen::CertificateParams,
        key: rcgen::KeyPair,
        dir: &std::path::Path,
        file: &str,
    ) -> (PathBuf, PathBuf) {
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let (c, k) = (
            dir.join(format!("{file}.pem")),
            dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write cert");
        std::fs::write(&k, key.serialize_pem()).expect("write key");
        (c, k)
    }

    /// A client certificate for `cn`, written to `dir` as `<cn>.pem` and `<cn>.key`.
    pub fn client(&self, dir: &std::path::Path, cn: &str) -> (PathBuf, PathBuf) {
        use rcgen::ExtendedKeyUsagePurpose::ClientAuth;
        self.leaf(dir, cn, &[], Some(cn), vec![ClientAuth], None)
    }

    /// A client certificate whose subject holds each of `cns` as a Common Name, written to
    /// `dir` as `<file>.pem` and `<file>.key`.
    pub fn client_named(
        &self,
        dir: &std::path::Path,
        file: &str,
        cns: &[&str],
    ) -> (PathBuf, PathBuf) {
        use rcgen::{CertificateParams, DnType, DnValue, KeyPair};
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        // rcgen keeps one value per type: the second Common Name goes in as another type's
        // entry with the CN object identifier.
        for cn in cns {
            params.distinguished_name.push(
                DnType::CustomDnType(vec![2, 5, 4, 3]),
                DnValue::Utf8String(cn.to_string()),
            );
        }
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        self.sign_and_write(params, key, dir, file)
    }

    /// A client certificate for `cn` valid until `not_after` (and since a minute ago).
    pub fn client_until(
        &self,
        dir: &std::path::Path,
        cn: &str,
        not_after: std::time::SystemTime,
    ) -> (PathBuf, PathBuf) {
        use rcgen::ExtendedKeyUsagePurpose::ClientAuth;
        self.leaf(dir, cn, &[], Some(cn), vec![ClientAuth], Some(not_after))
    }

    /// A cluster node's certificate for `node` (CN = node id, DNS names aqueduct-mesh and
    /// localhost, server and client auth), written to `dir` as `<node>.pem` and `<node>.key`.
    pub fn peer(&self, dir: &std::path::Path, node: &str) -> (PathBuf, PathBuf) {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let names = ["aqueduct-mesh", "localhost"];
        self.leaf(
            dir,
            node,
            &names,
            Some(node),
            vec![ServerAuth, ClientAuth],
            None,
        )
    }

    /// A server certificate for `hosts` (DNS names or IP addresses), written to `dir` as
    /// `<name>.pem` and `<name>.key`.
    pub fn server(&self, dir: &std::path::Path, name: &str, hosts: &[&str]) -> (PathBuf, PathBuf) {
        use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
        self.leaf(dir, name, hosts, None, vec![ServerAuth], None)
    }

    /// A revocation list signed by this CA, revoking the certificates in `revoked`, written to `path`.
    pub fn write_crl(&self, path: &std::path::Path, revoked: &[&PathBuf], number: u64) {
        use rustls_pki_types::pem::PemObject;
        let revoked_certs = revoked
            .iter()
            .map(|cert| {
                let der = rustls_pki_types::CertificateDer::from_pem_file(cert).expect("a cert");
                let (_, parsed) = x509_parser::parse_x509_certificate(&der).expect("parses");
                rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from_slice(parsed.raw_serial()),
                    revocation_time: rcgen::date_time_ymd(2020, 1, 1),
                    reason_code: None,
                    invalidity_date: None,
                }
            })
            .collect();
        let params = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2020, 1, 1),
            next_update: rcgen::date_time_ymd(2100, 1, 1),
            crl_number: rcgen::SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs,
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        let crl = params.signed_by(&self.issuer).expect("signed");
        std::fs::write(path, crl.pem().expect("pem")).expect("write");
    }

    /// Write the CA certificate to `dir/ca.pem`.
    pub fn write(&self, dir: &std::path::Path) -> PathBuf {
        let path = dir.join("ca.pem");
        std::fs::write(&path, &self.pem).expect("write CA");
        path
    }
}

/// One HTTP/1.1 exchange with the metrics endpoint: (status, the whole response).
pub async fn http_response(addr: SocketAddr, request: &str) -> (u16, String) {
    within("an HTTP response", async {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        let status = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, out)
    })
    .await
}

/// One HTTP/1.1 exchange with the metrics endpoint: (status, body).
pub async fn http(addr: SocketAddr, request: &str) -> (u16, String) {
    let (status, out) = http_response(addr, request).await;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// `n` TCP connections to `addr` from 127.0.0.2 (another loopback address than the tests'
/// clients' 127.0.0.1) that send nothing: what anyone who reaches a port may open.
pub async fn idle_connections_from_elsewhere(
    addr: SocketAddr,
    n: usize,
) -> Vec<tokio::net::TcpStream> {
    let mut idle = Vec::new();
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().expect("addr"))
            .expect("bind 127.0.0.2");
        idle.push(
            within("a TCP connect", socket.connect(addr))
                .await
                .expect("connects"),
        );
    }
    idle
}

pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    http(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")).await
}

/// The value of the sample with exactly this name and label set, e.g. `m{a="b"}`.
pub fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Every query (`expr`) of the repository's Grafana dashboard.
pub fn dashboard_queries() -> Vec<String> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{root}/deploy/grafana/dashboards/aqueduct.json"))
            .expect("dashboard"),
    )
    .expect("dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            queries.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    queries
}

// ----- the durable log -----

/// The master key the tests' logs use.
pub fn key() -> aqueduct_log::MasterKey {
    aqueduct_log::MasterKey::from_bytes(&[0x5A; 32]).expect("32 bytes")
}

/// A durable log in `dir` with the tests' key.
pub fn aal(
    dir: &std::path::Path,
    fsync: aqueduct_log::FsyncMode,
) -> aqueduct_server::config::AalConfig {
    aqueduct_server::config::AalConfig {
        dir: dir.to_path_buf(),
        key: Some(key()),
        previous_keys: Vec::new(),
        allow_plaintext: false,
        max_segment_bytes: 1 << 20,
        fsync,
        retention_bytes: None,
        retention_age: None,
        consumers: Default::default(),
    }
}

/// What the log in `dir` holds for `topic`, read offline (and closed cleanly again).
pub fn logged(
    dir: &std::path::Path,
    topic: &str,
) -> Vec<(u64, aqueduct_server::durable::StoredMessage)> {
    let (log, rec) = aqueduct_log::Log::open(
        dir,
        aqueduct_log::LogOptions {
            key: Some(key()),
            ..aqueduct_log::LogOptions::default()
        },
    )
    .expect("log opens");
    assert!(rec.clean, "the broker closed its log cleanly");
    let got = log
        .read(topic.as_bytes(), 0)
        .map(|r| {
            let r = r.expect("readable");
            (
                r.offset,
                aqueduct_server::durable::StoredMessage::decode(&r.data).expect("a stored message"),
            )
        })
        .collect();
    log.close().expect("close");
    got
}
