//! Any bytes through the frame decoder: no panic; a decoded frame re-encodes to bytes that decode
//! to the same frame.
#![no_main]
use aqueduct_proto::{decode_frame, Limits};
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
});
