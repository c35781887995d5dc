//! A broker in this process for the crate's unit tests (the integration tests have their own).
#![cfg(test)]

use std::net::SocketAddr;
use std::path::PathBuf;

/// A broker on 127.0.0.1 port 0 with a development certificate, served until [`stop`].
///
/// [`stop`]: TestBroker::stop
pub(crate) struct TestBroker {
    _dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The serving task: stopped with [`stop`](Self::stop), aborted if the broker is dropped
    /// (a test that failed before it stopped it), so it never outlives the test's broker.
    task: Option<tokio::task::JoinHandle<Result<(), aqueduct_server::ServerError>>>,
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl TestBroker {
    pub(crate) async fn start() -> TestBroker {
        let dir = tempfile::tempdir().expect("temp dir");
        let cert = dir.path().join("dev-cert.pem");
        let server =
            aqueduct_server::Server::bind(aqueduct_server::Config::for_tests(cert.clone()))
                .await
                .expect("broker binds");
        let addr = server.local_addr();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = stopped.await;
        }));
        TestBroker {
            _dir: dir,
            cert,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Options to connect to it, trusting its development certificate.
    pub(crate) fn options(&self) -> crate::ConnectOptions {
        crate::ConnectOptions::new(self.addr.to_string()).dev_cert_file(&self.cert)
    }

    /// Stop it and wait (at most 10 s) until it has.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut task) = self.task.take() {
            let limit = std::time::Duration::from_secs(10);
            if tokio::time::timeout(limit, &mut task).await.is_err() {
                task.abort();
            }
        }
    }
}

/// Not a broker: a QUIC endpoint on 127.0.0.1 port 0 with a self-signed certificate (ALPN
/// `aqueduct-v1`) that hands a test the connections it accepts, for answers a real broker never
/// sends (a later version's frames, broken ones).
pub(crate) struct FakeBroker {
    _dir: tempfile::TempDir,
    cert: PathBuf,
    endpoint: quinn::Endpoint,
}

impl FakeBroker {
    pub(crate) fn start() -> FakeBroker {
        Self::start_with_alpn("aqueduct-v1")
    }

    /// One that speaks `alpn` instead (e.g. HTTP/3's, to stand for a WebTransport server).
    pub(crate) fn start_with_alpn(alpn: &str) -> FakeBroker {
        Self::build(alpn, quinn::TransportConfig::default())
    }

    /// One that lets a client send at most `window` bytes on a stream beyond what it has read
    /// (a broker that stops reading a stream then holds the client's writes on it).
    pub(crate) fn start_with_stream_window(window: u32) -> FakeBroker {
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(window.into());
        Self::build("aqueduct-v1", transport)
    }

    fn build(alpn: &str, transport: quinn::TransportConfig) -> FakeBroker {
        let dir = tempfile::tempdir().expect("temp dir");
        let cert = dir.path().join("fake-cert.pem");
        let key = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).expect("cert");
        std::fs::write(&cert, key.cert.pem()).expect("write cert");
        let der = rustls_pki_types::CertificateDer::from(key.cert.der().to_vec());
        let secret = rustls_pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
        let mut tls = rustls::ServerConfig::builder_with_provider(aqueduct_server::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls13")
            .with_no_client_auth()
            .with_single_cert(vec![der], secret)
            .expect("server cert");
        tls.alpn_protocols = vec![alpn.as_bytes().to_vec()];
        let mut config = quinn::ServerConfig::with_crypto(std::sync::Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).expect("quic"),
        ));
        config.transport_config(std::sync::Arc::new(transport));
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().expect("addr"))
            .expect("endpoint");
        FakeBroker {
            _dir: dir,
            cert,
            endpoint,
        }
    }

    /// Options to connect to it, trusting its certificate.
    pub(crate) fn options(&self) -> crate::ConnectOptions {
        let addr = self.endpoint.local_addr().expect("addr");
        crate::ConnectOptions::new(addr.to_string()).dev_cert_file(&self.cert)
    }

    /// Its endpoint, to accept connections in a test's own way.
    pub(crate) fn endpoint(&self) -> quinn::Endpoint {
        self.endpoint.clone()
    }

    /// The next connection, handshake done.
    pub(crate) async fn accept(&self) -> quinn::Connection {
        let incoming = self.endpoint.accept().await.expect("a connection");
        incoming.await.expect("handshake")
    }

    /// A client connected to it, and that connection as the fake broker sees it.
    pub(crate) async fn client(&self) -> (crate::Client, quinn::Connection) {
        let (client, conn) = tokio::join!(crate::Client::connect(self.options()), self.accept());
        (client.expect("connect"), conn)
    }
}

/// `fut`'s output, if it comes within 10 s (else the test fails).
pub(crate) async fn within<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(10), fut)
        .await
        .expect("in time")
}

/// Read one whole frame from `recv`: (its stream id, the frame's bytes).
pub(crate) async fn read_frame(recv: &mut quinn::RecvStream) -> (u32, Vec<u8>) {
    let mut frame = vec![0u8; aqueduct_proto::HEADER_LEN];
    recv.read_exact(&mut frame).await.expect("header");
    let stream_id = u32::from_le_bytes(frame[2..6].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(frame[6..10].try_into().expect("4 bytes")) as usize;
    frame.resize(aqueduct_proto::HEADER_LEN + len, 0);
    recv.read_exact(&mut frame[aqueduct_proto::HEADER_LEN..])
        .await
        .expect("data");
    (stream_id, frame)
}

/// The fake broker's side of a SUBSCRIBE on `conn`: the stream it comes on, read, and
/// confirmed: (send, receive, the SUBSCRIBE's stream id).
pub(crate) async fn confirm_subscribe(
    conn: &quinn::Connection,
) -> (quinn::SendStream, quinn::RecvStream, u32) {
    let (mut send, mut recv) = conn.accept_bi().await.expect("the subscription's stream");
    let (id, _) = read_frame(&mut recv).await;
    send.write_all(&confirm(id, vec![])).await.expect("write");
    (send, recv, id)
}

/// A CONFIRM of the frame of stream id `id`, listing `offsets`, encoded.
pub(crate) fn confirm(id: u32, offsets: Vec<u64>) -> bytes::Bytes {
    use aqueduct_proto::frame::{Confirm, Message};
    aqueduct_proto::Frame::new(id, Message::Confirm(Confirm { offsets })).to_bytes()
}

/// A delivery of `body` on topic `t` to the subscription of stream id `id`, encoded.
pub(crate) fn delivery(id: u32, body: &[u8]) -> bytes::Bytes {
    use aqueduct_proto::frame::Message;
    let topic = aqueduct_proto::TopicName::try_from("t").expect("topic");
    let publish = aqueduct_proto::Publish::new(topic, bytes::Bytes::copy_from_slice(body));
    aqueduct_proto::Frame::new(id, Message::Publish(publish)).to_bytes()
}

/// A frame of opcode 0x3E (reserved: what a later broker might send) with stream id `id` and
/// three bytes of data.
pub(crate) fn unknown_frame(id: u32) -> Vec<u8> {
    let mut f = vec![0x1F, 0x3E];
    f.extend_from_slice(&id.to_le_bytes());
    f.extend_from_slice(&3u32.to_le_bytes());
    f.extend_from_slice(&[1, 2, 3]);
    f
}
