//! Any bytes through the frame decoder: no panic; a decoded frame re-encodes to bytes that decode
//! to the same frame. The subscriber's fast path (`DeliveryRef`) sees the same bytes and must
//! agree with the full decoder on every delivery that has a TOPIC extension.
#![no_main]
use aqueduct_proto::frame::{split_frame, Message};
use aqueduct_proto::{decode_frame, DeliveryRef, Frame, Limits, Opcode, HEADER_LEN};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let buf = Bytes::copy_from_slice(data);
    if let Ok((frame, used)) = decode_frame(&buf, &Limits::default()) {
        assert!(used <= buf.len());
        let again = frame.to_bytes();
        let (back, _) = decode_frame(&again, &Limits::default()).expect("re-encoded frame decodes");
        assert_eq!(back, frame);
    }
    let Ok(raw) = split_frame(&buf, &Limits::default()) else {
        return;
    };
    let Ok(header) = raw.validate() else {
        return;
    };
    if header.opcode != Opcode::Publish {
        return;
    }
    let body = buf.slice(HEADER_LEN..raw.frame_len());
    let fast = DeliveryRef::parse(&header, &body);
    match Frame::decode(&header, body.clone()).map(|f| f.message) {
        Ok(Message::Publish(full)) if full.ext.topic.is_some() => {
            let d = fast.expect("fast path accepts what the full decoder accepts");
            assert_eq!(d.topic_in(&body), full.ext.topic);
            assert_eq!(
                (d.offset, d.attempt, d.priority),
                (full.ext.offset, full.ext.attempt, full.ext.priority)
            );
            assert_eq!(&body[d.body_start..], &full.body[..]);
        }
        _ => assert!(fast.map_or(true, |d| d.topic.is_none())),
    }
});
