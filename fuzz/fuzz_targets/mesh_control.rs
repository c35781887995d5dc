//! The mesh's control messages and forwarded copies' routing from any bytes: no panic; anything
//! decoded encodes back to something that decodes the same.
#![no_main]
use aqueduct_core::mesh_codec::{decode_control, decode_forward, encode_control, encode_forward};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((control, used)) = decode_control(data) {
        assert!(used <= data.len());
        let mut again = Vec::new();
        encode_control(&control, &mut again);
        let (back, n) = decode_control(&again).expect("re-encoded control decodes");
        assert_eq!(back, control);
        assert_eq!(n, again.len());
    }
    if let Ok(forward) = decode_forward(data) {
        let mut again = Vec::new();
        encode_forward(&forward, &mut again);
        assert_eq!(decode_forward(&again).expect("re-encoded forward decodes"), forward);
    }
});
