//! Property tests: encode → decode is the identity for every message kind, and no input bytes
//! make any decoder panic.

use aqueduct_proto::batch::BatchIter;
use aqueduct_proto::frame::Message;
use aqueduct_proto::*;
use bytes::Bytes;
use proptest::prelude::*;

fn level() -> impl Strategy<Value = String> {
    "[a-z0-9_é$-]{0,6}"
}

fn topic_name() -> impl Strategy<Value = TopicName> {
    prop::collection::vec(level(), 1..5)
        .prop_map(|levels| levels.join("/"))
        .prop_filter_map("valid topic", |s| TopicName::try_from(s.as_str()).ok())
}

fn topic_filter() -> impl Strategy<Value = TopicFilter> {
    let lvl = prop_oneof![3 => level(), 1 => Just("+".to_string())];
    (prop::collection::vec(lvl, 1..5), any::<bool>())
        .prop_map(|(mut levels, hash)| {
            if hash {
                levels.push("#".into());
            }
            levels.join("/")
        })
        .prop_filter_map("valid filter", |s| TopicFilter::try_from(s.as_str()).ok())
}

fn ident() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_.-]{1,12}"
}

/// Boxed: the strategy's type (and value tree) is large, and unboxed it overflows a test
/// thread's stack in debug builds once nested in `message()`.
fn extensions() -> BoxedStrategy<Extensions> {
    (
        (
            prop::option::of((any::<[u8; 16]>(), any::<[u8; 8]>(), any::<u8>())),
            prop::option::of((any::<u8>(), any::<u32>())),
            prop::option::of(0u8..4),
            prop::option::of(topic_name()),
            prop::option::of(any::<u32>()),
            prop::option::of(any::<u64>()),
            prop::option::of(1u32..),
        ),
        (
            any::<bool>(),
            prop::option::of(any::<bool>()),
            prop::option::of(0usize..3),
            prop::option::of(topic_name()),
            prop::option::of(any::<u64>()),
            prop::option::of("[ -~é]{0,40}"),
            prop::option::of(any::<u32>()),
            prop::option::of(1u32..),
        ),
    )
        .prop_map(
            |(
                (trace, compression, priority, topic, ttl_ms, offset, attempt),
                (
                    confirm,
                    ack,
                    overflow,
                    original_topic,
                    original_offset,
                    reason,
                    attempts_made,
                    max_in_flight,
                ),
            )| Extensions {
                trace: trace.map(|(trace_id, span_id, flags)| TraceContext {
                    trace_id,
                    span_id,
                    flags,
                }),
                compression: compression.map(|(algorithm, uncompressed_len)| Compression {
                    algorithm,
                    uncompressed_len,
                }),
                priority: priority.and_then(Priority::new),
                topic,
                ttl_ms,
                offset,
                attempt,
                confirm,
                ack_mode: ack.map(|e| if e { AckMode::Explicit } else { AckMode::None }),
                overflow: overflow.map(|i| OverflowPolicy::ALL[i]),
                original_topic,
                original_offset,
                reason,
                attempts_made,
                max_in_flight,
            },
        )
        .boxed()
}

fn publish() -> BoxedStrategy<Publish> {
    (
        extensions(),
        topic_name(),
        prop::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(|(mut ext, topic, body)| {
            ext.topic = Some(topic);
            Publish::from_parts(ext, Bytes::from(body)).expect("topic extension present")
        })
        .boxed()
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        publish().prop_map(Message::Publish),
        topic_name().prop_map(|t| {
            // Legacy publish: the payload is the topic.
            Message::Publish(
                Publish::from_parts(Extensions::default(), t.to_bytes()).expect("legacy"),
            )
        }),
        (
            topic_filter(),
            prop::option::of(ident()),
            prop::option::of((
                ident(),
                prop_oneof![
                    any::<u64>().prop_map(DurableStart::Offset),
                    Just(DurableStart::Earliest),
                    Just(DurableStart::Latest),
                ]
            )),
            extensions()
        )
            .prop_map(|(filter, group, durable, ext)| {
                Message::Subscribe(Subscribe {
                    spec: SubscribeSpec {
                        filter,
                        group: group.map(|g| GroupId::try_from(g.as_str()).expect("valid")),
                        durable: durable.map(|(c, start)| Durable {
                            consumer: ConsumerId::try_from(c.as_str()).expect("valid"),
                            start,
                        }),
                    },
                    ext,
                })
            }),
        (topic_filter(), extensions())
            .prop_map(|(filter, ext)| Message::Unsubscribe(Unsubscribe { filter, ext })),
        prop::collection::vec(publish(), 0..8)
            .prop_map(|ps| Message::PublishBatch(PublishBatch::from_publishes(&ps))),
        (any::<u64>(), extensions()).prop_map(|(offset, ext)| Message::Nack(Nack { offset, ext })),
        (any::<u64>(), extensions()).prop_map(|(offset, ext)| Message::Ack(Ack { offset, ext })),
        prop::collection::vec(any::<u64>(), 0..20)
            .prop_map(|offsets| Message::Confirm(Confirm { offsets })),
        (any::<u16>(), "[ -~é]{0,60}").prop_map(|(code, reason)| Message::Error(ErrorFrame {
            code: ErrorCode(code),
            reason
        })),
        (
            prop::option::of(any::<u8>()),
            prop::option::of(any::<u32>()),
            prop::option::of(any::<u32>()),
            prop::option::of(any::<u32>()),
            prop::option::of("[ -~é]{1,60}"),
            prop::option::of(any::<bool>()),
        )
            .prop_map(
                |(
                    protocol,
                    max_data_len,
                    max_delivery_data_len,
                    max_subscriptions,
                    broker,
                    durable,
                )| {
                    Message::Info(Info {
                        protocol,
                        max_data_len,
                        max_delivery_data_len,
                        max_subscriptions,
                        broker,
                        durable,
                    })
                }
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn encode_decode_is_identity(msg in message(), stream_id in any::<u32>(), fwd in any::<bool>()) {
        let frame = Frame { stream_id, mesh_forwarded: fwd, message: msg };
        let bytes = frame.to_bytes();
        prop_assert_eq!(bytes.len(), frame.message.frame_len());
        let (back, used) = decode_frame(&bytes, &Limits::default()).expect("own encoding decodes");
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(&back, &frame);
        // Re-encoding the decoded frame gives the same bytes.
        prop_assert_eq!(back.to_bytes(), bytes);
    }

    #[test]
    fn batch_sub_frames_decode_in_order(ps in prop::collection::vec(publish(), 0..16)) {
        let batch = PublishBatch::from_publishes(&ps);
        let back: Vec<Publish> = batch.publishes().collect::<Result<_, _>>().expect("valid");
        // The borrowed decoder agrees with the owned one on everything a router uses.
        let refs: Vec<PublishRef<'_>> = batch.iter_refs().collect::<Result<_, _>>().expect("valid");
        prop_assert_eq!(refs.len(), back.len());
        for (r, p) in refs.iter().zip(&back) {
            same_publish(r, p)?;
        }
        prop_assert_eq!(back, ps);
    }

    #[test]
    fn a_decoded_batch_iterates_what_parsing_it_gives(
        ps in prop::collection::vec(prop_oneof![
            publish(),
            // Legacy sub-frames: the topic (and a `ttl:` prefix) in the payload.
            (topic_name(), prop::option::of(1u32..100_000)).prop_map(|(t, ttl)| {
                let body = match ttl {
                    Some(ms) => format!("ttl:{ms}:{t}"),
                    None => t.to_string(),
                };
                Publish::from_parts(Extensions::default(), Bytes::from(body)).expect("legacy")
            }),
        ], 0..16),
    ) {
        // A decoded batch iterates from what its validation found; a built one parses each
        // sub-frame on iteration. Both must give the same views.
        let built = PublishBatch::from_publishes(&ps);
        let decoded = PublishBatch::from_parts(Extensions::default(), built.payload().clone())
            .expect("valid");
        let parsed: Vec<PublishRef<'_>> = built.iter_refs().collect::<Result<_, _>>().expect("valid");
        let indexed: Vec<PublishRef<'_>> =
            decoded.iter_refs().collect::<Result<_, _>>().expect("valid");
        prop_assert_eq!(indexed.len(), ps.len());
        prop_assert_eq!(indexed, parsed);
        prop_assert_eq!(decoded, built);
    }

    #[test]
    fn delivery_ref_agrees_with_the_full_decoder(
        p in publish(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        // Mutate only after the header: it stays a PUBLISH frame of the same length.
        let mut data = Frame::new(1, Message::Publish(p)).to_bytes().to_vec();
        for (idx, byte) in flips {
            let i = HEADER_LEN + idx.index(data.len() - HEADER_LEN);
            data[i] = byte;
        }
        check_delivery_ref(Bytes::from(data))?;
    }

    #[test]
    fn delivery_ref_agrees_with_the_full_decoder_on_broker_frames(
        topic in topic_name(),
        offset in any::<u64>(),
        level in 0u8..4,
        attempt in 0u32..4,
        trace in prop::option::of(any::<[u8; 25]>()),
        body in prop::collection::vec(any::<u8>(), 0..64),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    ) {
        // A delivery exactly as a broker writes it (the layout the fast path reads), then
        // mutated after the header.
        let trace = trace.map(|t| TraceContext {
            trace_id: t[..16].try_into().expect("16"),
            span_id: t[16..24].try_into().expect("8"),
            flags: t[24],
        });
        let shared = SharedDelivery::encode(
            &mut aqueduct_proto::delivery::Arena::default(),
            &aqueduct_proto::delivery::DeliveryFields {
                topic: &topic,
                offset,
                priority: Priority::new(level).expect("0..=3"),
                trace: trace.as_ref(),
                compression: None,
                dead_letter: None,
                body: &body,
            },
        );
        let mut data = Vec::new();
        shared.write_frame(&mut data, 1, attempt);
        for (idx, byte) in flips {
            let i = HEADER_LEN + idx.index(data.len() - HEADER_LEN);
            data[i] = byte;
        }
        check_delivery_ref(Bytes::from(data))?;
    }

    #[test]
    fn topic_hints_change_no_verdict(
        topic in topic_name(),
        level in prop::option::of(0u8..4),
        bodies in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 1..8),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        // A batch whose sub-frames share one topic (so every one after the first is compared to
        // its predecessor's, not checked), then mutated.
        // With or without a priority: the two layouts clients write ([PRIORITY,] TOPIC).
        let ext = Extensions {
            topic: Some(topic),
            priority: level.map(|l| Priority::new(l).expect("0..=3")),
            ..Extensions::default()
        };
        let ps: Vec<Publish> = bodies
            .into_iter()
            .map(|b| Publish::from_parts(ext.clone(), Bytes::from(b)).expect("valid"))
            .collect();
        let mut payload = PublishBatch::from_publishes(&ps).payload().to_vec();
        for (idx, byte) in flips {
            let i = idx.index(payload.len());
            payload[i] = byte;
        }
        let payload = Bytes::from(payload);
        // Checking every entry on its own must give the same verdict and the same fields.
        let each: Result<Vec<PublishRef<'_>>, ProtoError> = BatchIter::new(&payload)
            .map(|sub| sub.and_then(|sub| PublishRef::parse(&sub)))
            .collect();
        // And each sub-frame read as a PUBLISH frame by the full decoder gives the same verdict
        // and fields as the borrowed one.
        for sub in BatchIter::new(&payload) {
            let Ok(sub) = sub else { break };
            let end = sub.payload_offset + sub.payload.len();
            let data = payload.slice(sub.offset + HEADER_LEN..end);
            let full = Frame::decode(&sub.header, data);
            match (PublishRef::parse(&sub), full) {
                (Ok(r), Ok(Frame { message: Message::Publish(p), .. })) => {
                    same_publish(&r, &p)?;
                }
                (Err(_), Err(_)) => {}
                (r, f) => prop_assert!(false, "borrowed {:?}, full {:?}", r, f),
            }
        }
        match PublishBatch::from_parts(Extensions::default(), payload.clone()) {
            Ok(batch) => {
                let each = each.expect("hinted validation accepted it, so must a full one");
                let hinted: Vec<PublishRef<'_>> =
                    batch.iter_refs().collect::<Result<_, _>>().expect("valid");
                prop_assert_eq!(hinted, each);
            }
            Err(_) => prop_assert!(each.is_err()),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..300)) {
        let bytes = Bytes::from(data);
        let _ = decode_frame(&bytes, &Limits::default());
        let _ = Extensions::parse(&bytes);
        let _ = SubscribeSpec::parse(&bytes);
        for item in BatchIter::new(&bytes) {
            let _ = item;
        }
        let _ = Publish::from_parts(Extensions::default(), bytes.clone());
    }

    #[test]
    fn mutated_frames_never_panic(msg in message(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        // Start from a valid frame so the mutation reaches deep decoder paths.
        let mut data = Frame::new(1, msg).to_bytes().to_vec();
        for (idx, byte) in flips {
            let i = idx.index(data.len());
            data[i] = byte;
        }
        let bytes = Bytes::from(data);
        match decode_frame(&bytes, &Limits::default()) {
            Ok((frame, used)) => prop_assert!(used <= bytes.len() && frame.message.frame_len() > 0),
            Err(DecodeError::Incomplete { need, have }) => prop_assert!(need > have),
            Err(DecodeError::Invalid(e)) => prop_assert!(ErrorCode::ALL.contains(&e.code())),
        }
    }
}

/// [`DeliveryRef::parse`] of a PUBLISH frame (header intact) agrees with the full decoder.
fn check_delivery_ref(bytes: Bytes) -> Result<(), TestCaseError> {
    let raw =
        aqueduct_proto::frame::split_frame(&bytes, &Limits::default()).expect("header intact");
    let header = raw.validate().expect("valid header");
    let body = bytes.slice(HEADER_LEN..raw.frame_len());
    let fast = DeliveryRef::parse(&header, &body);
    match Frame::decode(&header, body.clone()) {
        Ok(Frame {
            message: Message::Publish(full),
            ..
        }) if full.ext.topic.is_some() => {
            let d = fast.expect("the fast path accepts what the full decoder accepts");
            prop_assert_eq!(d.topic_in(&body), full.ext.topic.clone());
            prop_assert_eq!(d.offset, full.ext.offset);
            prop_assert_eq!(d.attempt, full.ext.attempt);
            prop_assert_eq!(d.priority, full.ext.priority);
            prop_assert_eq!(&body[d.body_start..], &full.body[..]);
            let rest = Extensions {
                topic: None,
                offset: None,
                attempt: None,
                priority: None,
                ..full.ext.clone()
            };
            prop_assert_eq!(d.more, rest != Extensions::default());
            // Not the parsed buffer: no name.
            prop_assert_eq!(d.topic_in(&Bytes::copy_from_slice(&body)), None);
            // With the topic as a hint (compared, not checked): the same result.
            let hinted = DeliveryRef::parse_after(&header, &body, full.ext.topic.as_ref());
            prop_assert_eq!(hinted, Ok(d));
        }
        // Legacy frames (no TOPIC extension) and errors: the fast path either agrees that it
        // is not a delivery it can read, or reports the error itself.
        other => prop_assert!(
            fast.is_err() || fast.is_ok_and(|d| d.topic.is_none()),
            "decode said {:?}",
            other
        ),
    }
    Ok(())
}

/// A borrowed sub-frame view and the full decoder's publish agree on everything a router uses.
fn same_publish(r: &PublishRef<'_>, p: &Publish) -> Result<(), TestCaseError> {
    prop_assert_eq!(r.topic, p.topic().borrowed());
    prop_assert_eq!(r.body, &p.body[..]);
    prop_assert_eq!(r.priority, p.priority());
    prop_assert_eq!(r.ttl_ms, p.ttl_ms());
    prop_assert_eq!(r.trace, p.ext.trace);
    prop_assert_eq!(r.compression, p.ext.compression);
    Ok(())
}
