//! Any bytes as an extension block: no panic; parsed blocks re-encode to an equivalent block.
#![no_main]
use aqueduct_proto::Extensions;
use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(ext) = Extensions::parse(&Bytes::copy_from_slice(data)) {
        let mut out = BytesMut::new();
        ext.encode(&mut out);
        assert_eq!(out.len(), ext.encoded_len());
        assert_eq!(Extensions::parse(&out.freeze()).expect("re-encoded block parses"), ext);
    }
});
