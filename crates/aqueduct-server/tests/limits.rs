//! Connection-level limits and 0-RTT.

mod common;

use aqueduct_client::{Client, PublishOptions};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_refused() {
    let b = TestBroker::start_with(|c| c.transport.max_connections = 2).await;
    let first = b.client().await;
    let _second = b.client().await;
    let third = Client::connect(b.options()).await;
    assert!(third.is_err(), "a third connection must be refused");
    assert_eq!(
        b.stats
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The admitted ones are unaffected.
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    first
        .publish_with("t", "x", &confirm)
        .await
        .expect("still served");
    b.stop().await.expect("clean shutdown");
}

/// A returning client publishes in its first flight (0-RTT). The broker takes it, but applies the
/// PUBLISH only once the handshake is confirmed; the publish then succeeds normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_rtt_publish_is_applied_after_the_handshake() {
    let b = TestBroker::start().await;
    let endpoint = zero_rtt_endpoint(&b);
    // First connection: full handshake, receives a session ticket.
    let conn = within(
        "first connect",
        endpoint.connect(b.addr, "localhost").expect("connect"),
    )
    .await
    .expect("handshake");
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    let probe = confirmed_publish(1, "zr", "a");
    send.write_all(&probe.to_bytes()).await.expect("write");
    let mut buf = vec![0u8; 18];
    within("confirm", recv.read_exact(&mut buf))
        .await
        .expect("confirm");
    conn.close(0u32.into(), b"bye");
    // Second connection: 0-RTT.
    let connecting = endpoint.connect(b.addr, "localhost").expect("connect");
    let (conn, accepted) = connecting
        .into_0rtt()
        .unwrap_or_else(|_| panic!("0-RTT should be offered with a ticket"));
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    let frame = confirmed_publish(2, "zr", "b");
    send.write_all(&frame.to_bytes())
        .await
        .expect("write in 0-RTT");
    let mut buf = vec![0u8; 18];
    within("confirm", recv.read_exact(&mut buf))
        .await
        .expect("confirm");
    assert_eq!(&buf[..2], &[0x1F, 0x07], "a CONFIRM");
    assert_eq!(
        u64::from_le_bytes(buf[10..18].try_into().expect("8 bytes")),
        1,
        "offset 1 of zr"
    );
    assert!(
        within("0-RTT verdict", accepted).await,
        "the broker accepted 0-RTT"
    );
    b.stop().await.expect("clean shutdown");
}

/// A native client may send no QUIC datagrams: without WebTransport (whose HTTP/3 must offer
/// them, into a 16 KiB buffer) the broker does not offer them (the protocol has none, and quinn
/// would hold up to 1.25 MB of a connection's unread ones), so the client's own stack refuses
/// to send one.
#[tokio::test]
async fn a_client_cannot_send_datagrams_for_the_broker_to_hold() {
    let b = TestBroker::start_with(|c| c.webtransport.enabled = false).await;
    let raw = Raw::connect(&b, 1 << 20).await;
    assert_eq!(raw.conn.max_datagram_size(), None);
    assert!(matches!(
        raw.conn.send_datagram(bytes::Bytes::from_static(b"x")),
        Err(quinn::SendDatagramError::UnsupportedByPeer)
    ));
    raw.conn.close(0u32.into(), b"done");
    b.stop().await.expect("stops");
}

/// Past the broker's streams per connection, a subscribe says so within the connect timeout:
/// opening its stream waited for ever (the broker answers a stream over its limit with no
/// error: the stream just cannot be opened until another ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_past_the_stream_limit_says_so() {
    let b = TestBroker::start_with(|c| c.transport.max_streams_per_connection = 4).await;
    let c = within(
        "connect",
        Client::connect(b.options().timeout(std::time::Duration::from_secs(1))),
    )
    .await
    .expect("connects");
    let mut held = Vec::new();
    let refused = within("the subscriptions", async {
        for i in 0..10 {
            match c.subscribe(&format!("t/{i}")).await {
                Ok(sub) => held.push(sub),
                Err(e) => return e,
            }
        }
        panic!("10 subscriptions on a connection allowed 4 streams");
    })
    .await;
    assert!(held.len() <= 4, "{}", held.len());
    assert!(
        refused.to_string().contains("max_streams_per_connection"),
        "{refused}"
    );
    // One closed frees its stream: the next subscribe goes through.
    if let Some(sub) = held.pop() {
        sub.close().await.expect("closed");
    }
    let again = within("a subscribe", c.subscribe("t/again")).await;
    assert!(again.is_ok(), "{again:?}");
    c.close().await.expect("closed");
    b.stop().await.expect("clean shutdown");
}
