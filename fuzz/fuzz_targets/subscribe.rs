//! Any bytes as a SUBSCRIBE / UNSUBSCRIBE payload: no panic; a parsed spec re-encodes to a payload
//! that parses to the same spec.
#![no_main]
use aqueduct_proto::subscribe::parse_unsubscribe;
use aqueduct_proto::SubscribeSpec;
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let buf = Bytes::copy_from_slice(data);
    let _ = parse_unsubscribe(&buf);
    if let Ok(spec) = SubscribeSpec::parse(&buf) {
        let text = spec.encode();
        assert_eq!(SubscribeSpec::parse(&Bytes::from(text)).expect("re-encoded spec parses"), spec);
    }
});
