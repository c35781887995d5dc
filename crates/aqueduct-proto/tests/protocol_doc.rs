//! `docs/protocol.md` is normative: every hex example in it must decode to the frame this file
//! says it is, and re-encode to the same bytes. Run with `PRINT_PROTOCOL_EXAMPLES=1` to print the
//! hex of every example (used to write the doc).

use aqueduct_proto::delivery::{Arena, DeadLetter, DeliveryFields};
use aqueduct_proto::frame::Message;
use aqueduct_proto::*;
use bytes::{Bytes, BytesMut};

fn topic(s: &str) -> TopicName {
    TopicName::try_from(s).expect("valid topic")
}

fn spec(s: &str) -> SubscribeSpec {
    SubscribeSpec::parse(&Bytes::copy_from_slice(s.as_bytes())).expect("valid spec")
}

fn delivery(fields: &DeliveryFields<'_>, stream_id: u32, attempt: u32) -> Bytes {
    let mut arena = Arena::default();
    let shared = SharedDelivery::encode(&mut arena, fields);
    let mut out = BytesMut::new();
    shared.write_frame(&mut out, stream_id, attempt);
    out.freeze()
}

/// A delivery in the seed's form (for a SUBSCRIBE sent without an extension block).
fn seed_delivery(fields: &DeliveryFields<'_>, stream_id: u32) -> Bytes {
    let mut arena = Arena::default();
    let shared = SharedDelivery::encode(&mut arena, fields);
    let mut out = BytesMut::new();
    shared.write_seed_frame(&mut out, stream_id);
    out.freeze()
}

/// (name in the doc, the frame's bytes as built by the library)
fn examples() -> Vec<(&'static str, Bytes)> {
    let orders = topic("orders");
    let mut v = vec![];
    let f = |stream_id, m| Frame::new(stream_id, m).to_bytes();

    v.push((
        "publish",
        f(
            1,
            Message::Publish(Publish::new(orders.clone(), Bytes::from_static(b"hello"))),
        ),
    ));
    v.push((
        "publish-ttl-confirm",
        f(
            2,
            Message::Publish(
                Publish::new(topic("sensors/t1"), Bytes::from_static(b"21.5"))
                    .with_priority(Priority::HIGHEST)
                    .with_ttl_ms(5000)
                    .with_confirm(),
            ),
        ),
    ));
    let mut traced = Publish::new(topic("logs"), Bytes::from_static(b"\x28\xb5\x2f\xfd"));
    traced.ext.trace = Some(TraceContext {
        trace_id: [0x11; 16],
        span_id: [0x22; 8],
        flags: 1,
    });
    traced.ext.compression = Some(Compression {
        algorithm: Compression::ZSTD,
        uncompressed_len: 1000,
    });
    v.push(("publish-trace-compression", f(3, Message::Publish(traced))));
    v.push((
        "legacy-publish",
        f(
            3,
            Message::Publish(
                Publish::from_parts(Extensions::default(), Bytes::from_static(b"orders"))
                    .expect("legacy"),
            ),
        ),
    ));
    v.push((
        "legacy-publish-ttl",
        f(
            3,
            Message::Publish(
                Publish::from_parts(
                    Extensions::default(),
                    Bytes::from_static(b"ttl:1500:topic:orders"),
                )
                .expect("legacy"),
            ),
        ),
    ));
    v.push((
        "subscribe",
        f(1, Message::Subscribe(Subscribe::new(spec("topic:orders")))),
    ));
    let mut group_sub = Subscribe::new(spec("topic:sensors/+:group:ingest"));
    group_sub.ext.ack_mode = Some(AckMode::Explicit);
    group_sub.ext.overflow = Some(OverflowPolicy::DropNewest);
    v.push(("subscribe-group", f(5, Message::Subscribe(group_sub))));
    let mut durable = Subscribe::new(spec("topic:orders:group:billing:durable:c1:100"));
    durable.ext.confirm = true;
    v.push(("subscribe-durable", f(7, Message::Subscribe(durable))));
    v.push((
        "unsubscribe",
        f(
            1,
            Message::Unsubscribe(Unsubscribe {
                filter: TopicFilter::try_from("orders").expect("valid"),
                ext: Extensions::default(),
            }),
        ),
    ));
    v.push((
        "publish-batch",
        f(
            9,
            Message::PublishBatch(PublishBatch::from_publishes(&[
                Publish::new(topic("a"), Bytes::from_static(b"1")),
                Publish::new(topic("b"), Bytes::from_static(b"2")),
            ])),
        ),
    ));
    v.push((
        "delivery",
        delivery(
            &DeliveryFields {
                topic: &orders,
                offset: 42,
                priority: Priority::DEFAULT,
                trace: None,
                compression: None,
                dead_letter: None,
                body: b"hello",
            },
            1,
            1,
        ),
    ));
    v.push((
        "delivery-dead-letter",
        delivery(
            &DeliveryFields {
                topic: &topic("__dlq__orders"),
                offset: 0,
                priority: Priority::DEFAULT,
                trace: None,
                compression: None,
                dead_letter: Some(DeadLetter {
                    original_topic: &orders,
                    original_offset: 42,
                    attempts_made: 4,
                    reason: "nacked",
                }),
                body: b"hello",
            },
            4,
            1,
        ),
    ));
    v.push((
        "subscribe-seed",
        f(7, Message::Subscribe(Subscribe::new(spec("topic:orders")))),
    ));
    v.push((
        "delivery-seed",
        seed_delivery(
            &DeliveryFields {
                topic: &orders,
                offset: 42,
                priority: Priority::DEFAULT,
                trace: None,
                compression: None,
                dead_letter: None,
                body: b"orders",
            },
            7,
        ),
    ));
    v.push((
        "delivery-seed-priority",
        seed_delivery(
            &DeliveryFields {
                topic: &orders,
                offset: 43,
                priority: Priority::HIGHEST,
                trace: None,
                compression: None,
                dead_letter: None,
                body: b"orders",
            },
            7,
        ),
    ));
    v.push(("ack", f(1, Message::Ack(Ack::new(42)))));
    let mut wild_ack = Ack::new(7);
    wild_ack.ext.topic = Some(topic("sensors/t1"));
    wild_ack.ext.attempt = Some(2);
    v.push(("ack-wildcard", f(5, Message::Ack(wild_ack))));
    v.push(("nack", f(1, Message::Nack(Nack::new(42)))));
    let mut nack = Nack::new(42);
    nack.ext.reason = Some("bad json".into());
    v.push(("nack-reason", f(1, Message::Nack(nack))));
    v.push((
        "confirm",
        f(2, Message::Confirm(Confirm { offsets: vec![42] })),
    ));
    v.push((
        "confirm-subscribe",
        f(1, Message::Confirm(Confirm { offsets: vec![] })),
    ));
    v.push((
        "confirm-subscribe-durable",
        f(7, Message::Confirm(Confirm { offsets: vec![1] })),
    ));
    let mut confirmed_sub = Subscribe::new(spec("topic:orders"));
    confirmed_sub.ext.confirm = true;
    v.push(("subscribe-confirm", f(1, Message::Subscribe(confirmed_sub))));
    v.push((
        "confirm-batch",
        f(
            9,
            Message::Confirm(Confirm {
                offsets: vec![0, 7],
            }),
        ),
    ));
    v.push((
        "error",
        f(
            5,
            Message::Error(ErrorFrame {
                code: ErrorCode::INVALID_TOPIC,
                reason: "bad topic".into(),
            }),
        ),
    ));
    v.push(("info-request", f(3, Message::Info(Info::request()))));
    v.push((
        "info",
        f(
            3,
            Message::Info(Info {
                protocol: Some(1),
                max_data_len: Some(65536),
                max_delivery_data_len: Some(66560),
                max_subscriptions: Some(10_000),
                broker: Some("aqueduct-broker 0.1.0".into()),
                durable: Some(false),
            }),
        ),
    ));
    v
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|line| {
            line.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every ```hex block in the doc, keyed by its `example=NAME` tag. `#` starts a comment.
fn doc_examples() -> Vec<(String, Vec<u8>)> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/protocol.md"
    ))
    .expect("docs/protocol.md is readable");
    let mut out = vec![];
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(tag) = line.trim().strip_prefix("```hex example=") else {
            continue;
        };
        let mut bytes = vec![];
        for body in lines.by_ref() {
            if body.trim() == "```" {
                break;
            }
            let code = body.split('#').next().unwrap_or("");
            for tok in code.split_whitespace() {
                bytes.push(
                    u8::from_str_radix(tok, 16)
                        .unwrap_or_else(|_| panic!("example {tag}: {tok:?} is not a hex byte")),
                );
            }
        }
        out.push((tag.trim().to_string(), bytes));
    }
    out
}

#[test]
fn every_doc_example_decodes_and_re_encodes() {
    let want = examples();
    if std::env::var_os("PRINT_PROTOCOL_EXAMPLES").is_some() {
        for (name, bytes) in &want {
            println!("```hex example={name}\n{}\n```\n", hex(bytes));
        }
    }
    let doc = doc_examples();
    for (name, bytes) in &want {
        let found = doc
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("docs/protocol.md lacks example {name}"));
        assert_eq!(
            hex(&found.1),
            hex(bytes),
            "docs/protocol.md example {name} differs from what the library encodes"
        );
        let buf = Bytes::copy_from_slice(&found.1);
        let (frame, used) = decode_frame(&buf, &Limits::default())
            .unwrap_or_else(|e| panic!("example {name} does not decode: {e}"));
        assert_eq!(used, buf.len(), "example {name} has trailing bytes");
        assert_eq!(
            frame.to_bytes(),
            buf,
            "example {name} does not re-encode identically"
        );
    }
    for (name, _) in &doc {
        assert!(
            want.iter().any(|(n, _)| n == name),
            "docs/protocol.md example {name} is not checked by this test"
        );
    }
}

#[test]
fn doc_examples_mean_what_the_doc_says() {
    let get = |name: &str| {
        let (_, bytes) = examples()
            .into_iter()
            .find(|(n, _)| *n == name)
            .expect("example exists");
        decode_frame(&bytes, &Limits::default()).expect("decodes").0
    };
    let Message::Publish(p) = get("legacy-publish-ttl").message else {
        panic!("not a publish")
    };
    assert_eq!((p.topic().as_str(), p.ttl_ms()), ("orders", Some(1500)));
    let Message::Publish(p) = get("delivery-dead-letter").message else {
        panic!("not a publish")
    };
    assert_eq!(
        p.ext.original_topic.as_ref().map(|t| t.as_str()),
        Some("orders")
    );
    assert_eq!(p.ext.attempts_made, Some(4));
    let Message::Error(e) = get("error").message else {
        panic!("not an error")
    };
    assert_eq!(e.code, ErrorCode::INVALID_TOPIC);
    // §4.1: the answer's limits, as the comments in the example say.
    let Message::Info(i) = get("info").message else {
        panic!("not an INFO")
    };
    assert_eq!(
        (i.max_data_len, i.max_delivery_data_len, i.max_subscriptions),
        (Some(65536), Some(65536 + 1024), Some(10_000))
    );
    assert_eq!(i.broker.as_deref(), Some("aqueduct-broker 0.1.0"));
    assert_eq!(i.durable, Some(false));
    // Seed-style deliveries: the body is the whole payload; no topic, offset or attempt.
    for name in ["delivery-seed", "delivery-seed-priority"] {
        let Message::Publish(p) = get(name).message else {
            panic!("not a publish")
        };
        assert_eq!(&p.body[..], b"orders");
        assert_eq!(
            (p.ext.topic.as_ref(), p.ext.offset, p.ext.attempt),
            (None, None, None)
        );
    }
    let Message::Subscribe(s) = get("subscribe-durable").message else {
        panic!("not a subscribe")
    };
    assert!(
        s.ext.confirm,
        "a group subscription with an extension block"
    );
    // §6.3: sub-frames count from 0, and a BAD_BATCH reason names the first invalid one and its
    // byte offset in the batch's payload: the example with its second sub-frame's magic broken.
    let (_, mut batch) = doc_examples()
        .into_iter()
        .find(|(n, _)| n == "publish-batch")
        .expect("example exists");
    batch[10 + 16] = 0x00;
    let err = match decode_frame(&Bytes::from(batch), &Limits::default()) {
        Err(DecodeError::Invalid(e)) => e,
        other => panic!("a broken sub-frame: {other:?}"),
    };
    assert_eq!(err.code(), ErrorCode::BAD_BATCH);
    assert!(
        err.to_string()
            .starts_with("batch sub-frame 1 at byte 16: "),
        "{err}"
    );
}

/// §6.5: a delivery's extension block is at most 808 bytes (TRACE and COMPRESSION aside, which
/// the publisher's own frame carried too), so its `data_len` is at most `max_buf_size + 808`.
#[test]
fn largest_delivery_extension_block() {
    let long = |prefix: &str| topic(&format!("{prefix}{}", "x".repeat(255 - prefix.len())));
    let (dlq, original) = (long("__dlq__"), long(""));
    // Longer than 255 bytes: cut to 255.
    let reason = "r".repeat(300);
    let trace = TraceContext {
        trace_id: [1; 16],
        span_id: [2; 8],
        flags: 0,
    };
    let compression = Compression {
        algorithm: Compression::ZSTD,
        uncompressed_len: 1,
    };
    let overhead = |trace, compression| {
        let dead_letter = DeadLetter {
            original_topic: &original,
            original_offset: u64::MAX,
            attempts_made: u32::MAX,
            reason: &reason,
        };
        let frame = delivery(
            &DeliveryFields {
                topic: &dlq,
                offset: u64::MAX,
                priority: Priority::LOWEST,
                trace,
                compression,
                dead_letter: Some(dead_letter),
                body: b"body",
            },
            1,
            u32::MAX,
        );
        let data_len = u32::from_le_bytes(frame[6..10].try_into().expect("header")) as usize;
        assert_eq!(frame.len(), 10 + data_len);
        decode_frame(&frame, &Limits::default()).expect("decodes");
        data_len - b"body".len()
    };
    assert_eq!(overhead(None, None), 808);
    assert_eq!(overhead(Some(&trace), Some(&compression)), 808 + 27 + 7);
}
