//! `Subscription::next_batch` against a scripted broker: a QUIC endpoint that confirms the
//! SUBSCRIBE, then writes a fixed sequence of frames in one write and finishes the stream. The
//! order of deliveries, ERROR frames and a broken frame on the stream is then fixed, which a real
//! broker does not guarantee between an ERROR and the deliveries around it.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use aqueduct_client::{Client, ClientError, ConnectOptions, ErrorCode, Subscription};
use aqueduct_proto::delivery::{Arena, DeliveryFields};
use aqueduct_proto::frame::{ErrorFrame, Message as Wire};
use aqueduct_proto::{
    decode_frame, DecodeError, Frame, Limits, Priority, SharedDelivery, TopicName,
};
use bytes::BytesMut;
use common::within;
use tokio::task::JoinHandle;

/// What the scripted broker writes after the CONFIRM, given the subscription's stream id.
enum Item {
    Delivery(&'static str, u64, &'static str),
    Error(ErrorCode),
    /// Bytes that are no frame (wrong magic): the client must stop reading there.
    Garbage,
}

fn encode(items: &[Item], stream_id: u32) -> Vec<u8> {
    let mut arena = Arena::default();
    let mut out = BytesMut::new();
    for item in items {
        match item {
            Item::Delivery(topic, offset, body) => {
                let topic = TopicName::try_from(*topic).expect("topic");
                let shared = SharedDelivery::encode(
                    &mut arena,
                    &DeliveryFields {
                        topic: &topic,
                        offset: *offset,
                        priority: Priority::DEFAULT,
                        trace: None,
                        compression: None,
                        dead_letter: None,
                        body: body.as_bytes(),
                    },
                );
                shared.write_frame(&mut out, stream_id, 1);
            }
            Item::Error(code) => Frame::new(
                stream_id,
                Wire::Error(ErrorFrame {
                    code: *code,
                    reason: "scripted".into(),
                }),
            )
            .encode(&mut out),
            Item::Garbage => out.extend_from_slice(&[0x7F; 16]),
        }
    }
    out.to_vec()
}

/// A one-connection broker that answers the first SUBSCRIBE with a CONFIRM carrying `confirm`
/// as its data, and `items`.
async fn scripted(confirm: Vec<u8>, items: Vec<Item>) -> (SocketAddr, String, JoinHandle<()>) {
    let provider = aqueduct_server::tls::provider();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let pem = cert.cert.pem();
    let key = rustls_pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let mut crypto = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .expect("server cert");
    crypto.alpn_protocols = vec![b"aqueduct-v1".to_vec()];
    let config = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(crypto).expect("quic crypto"),
    ));
    let endpoint =
        quinn::Endpoint::server(config, "127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    let addr = endpoint.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        let conn = endpoint
            .accept()
            .await
            .expect("a connection")
            .await
            .expect("handshake");
        let (mut send, mut recv) = conn.accept_bi().await.expect("a stream");
        let mut buf = BytesMut::new();
        let limits = Limits {
            max_data_len: 1 << 20,
        };
        let id = loop {
            match decode_frame(&buf.clone().freeze(), &limits) {
                Ok((frame, _)) => break frame.stream_id,
                Err(DecodeError::Incomplete { .. }) => {
                    let chunk = recv.read_chunk(4096, true).await.expect("read");
                    buf.extend_from_slice(&chunk.expect("a SUBSCRIBE").bytes);
                }
                Err(e) => panic!("not a frame: {e:?}"),
            }
        };
        let mut out = BytesMut::new();
        out.extend_from_slice(&[0x1F, 0x07]);
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&(confirm.len() as u32).to_le_bytes());
        out.extend_from_slice(&confirm);
        out.extend_from_slice(&encode(&items, id));
        send.write_all(&out).await.expect("write");
        send.finish().expect("finish");
        conn.closed().await;
    });
    (addr, pem, task)
}

async fn subscribe(items: Vec<Item>) -> (Client, Subscription, JoinHandle<()>) {
    subscribe_confirmed_with(Vec::new(), items).await
}

/// As [`subscribe`], the SUBSCRIBE confirmed with `confirm` as the CONFIRM's data.
async fn subscribe_confirmed_with(
    confirm: Vec<u8>,
    items: Vec<Item>,
) -> (Client, Subscription, JoinHandle<()>) {
    let (addr, pem, task) = scripted(confirm, items).await;
    let opts = ConnectOptions::new(addr.to_string())
        .server_name("localhost")
        .ca_pem(pem.into_bytes());
    let client = within("connect", Client::connect(opts))
        .await
        .expect("connected");
    let sub = within("subscribe", client.subscribe("s/#"))
        .await
        .expect("subscribed");
    (client, sub, task)
}

/// What one `next_batch` call gave: `Ok` with the bodies lent, or the error it returned, or
/// `None` at the end.
async fn call(sub: &mut Subscription, max: usize) -> Option<Result<Vec<String>, ClientError>> {
    let mut bodies = Vec::new();
    let r = within(
        "next_batch",
        sub.next_batch(max, |m| {
            bodies.push(String::from_utf8(m.body().to_vec()).expect("utf-8"))
        }),
    )
    .await?;
    Some(r.map(|n| {
        assert_eq!(n, bodies.len(), "next_batch counts what it lent");
        bodies
    }))
}

/// Every call until the end: bodies of consecutive `Ok` calls merged, each error on its own.
async fn all_calls(sub: &mut Subscription, max: usize) -> Vec<Result<Vec<String>, ErrorCode>> {
    let mut seen: Vec<Result<Vec<String>, ErrorCode>> = Vec::new();
    while let Some(r) = call(sub, max).await {
        match (r, seen.last_mut()) {
            (Ok(bodies), Some(Ok(last))) => last.extend(bodies),
            (Ok(bodies), _) => seen.push(Ok(bodies)),
            (Err(ClientError::Broker { code, .. }), _) => seen.push(Err(code)),
            (Err(ClientError::Protocol(_)), _) => seen.push(Err(ErrorCode::BAD_MAGIC)),
            (Err(e), _) => panic!("unexpected error: {e}"),
        }
    }
    seen
}

fn bodies(list: &[&str]) -> Result<Vec<String>, ErrorCode> {
    Ok(list.iter().map(|s| s.to_string()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_between_deliveries_comes_in_a_call_of_its_own_after_those_before_it() {
    let (_client, mut sub, task) = subscribe(vec![
        Item::Delivery("s/a", 0, "one"),
        Item::Delivery("s/a", 1, "two"),
        Item::Error(ErrorCode::NOT_IN_FLIGHT),
        Item::Delivery("s/b", 0, "three"),
        Item::Error(ErrorCode::NOT_SUBSCRIBED),
        Item::Error(ErrorCode::NOT_IN_FLIGHT),
        Item::Delivery("s/a", 2, "four"),
    ])
    .await;
    // Nothing is lost or reordered around the errors, each error is a call of its own, and the
    // end of the stream ends the subscription (`None`).
    assert_eq!(
        all_calls(&mut sub, 64).await,
        vec![
            bodies(&["one", "two"]),
            Err(ErrorCode::NOT_IN_FLIGHT),
            bodies(&["three"]),
            Err(ErrorCode::NOT_SUBSCRIBED),
            Err(ErrorCode::NOT_IN_FLIGHT),
            bodies(&["four"]),
        ]
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_frame_ends_the_subscription_after_the_deliveries_before_it() {
    let (_client, mut sub, task) = subscribe(vec![
        Item::Delivery("s/a", 0, "one"),
        Item::Delivery("s/a", 1, "two"),
        Item::Garbage,
        Item::Delivery("s/a", 2, "never"),
    ])
    .await;
    assert_eq!(
        all_calls(&mut sub, 64).await,
        vec![bodies(&["one", "two"]), Err(ErrorCode::BAD_MAGIC)]
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bounds_each_call() {
    let items = (0..10)
        .map(|i| {
            Item::Delivery(
                "s/a",
                i,
                ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"][i as usize],
            )
        })
        .collect();
    let (_client, mut sub, task) = subscribe(items).await;
    let mut sizes = Vec::new();
    let mut got = Vec::new();
    while let Some(r) = call(&mut sub, 3).await {
        let b = r.expect("deliveries");
        sizes.push(b.len());
        got.extend(b);
    }
    assert_eq!(got, (0..10).map(|i| i.to_string()).collect::<Vec<_>>());
    assert!(sizes.iter().all(|n| (1..=3).contains(n)), "{sizes:?}");
    // All ten arrive in one write: calls are filled up to `max`, not one message each.
    assert!(sizes.contains(&3), "{sizes:?}");
    task.abort();
}

/// protocol.md §7.1: a client MUST accept any CONFIRM as a SUBSCRIBE's confirmation, whatever its
/// data. The client refused one whose data was not whole u64s (a protocol error: no
/// subscription).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_confirm_of_any_length_confirms() {
    for confirm in [vec![1u8], vec![1, 0, 0], vec![0; 12], vec![7; 16]] {
        let len = confirm.len();
        let (_client, mut sub, task) =
            subscribe_confirmed_with(confirm, vec![Item::Delivery("s/a", 1, "one")]).await;
        assert_eq!(
            all_calls(&mut sub, 8).await,
            vec![bodies(&["one"])],
            "CONFIRM of {len} bytes"
        );
        task.abort();
    }
}
