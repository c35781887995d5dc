//! The mesh's decompression path on any input: the first 4 bytes are the claimed uncompressed
//! length (u32 LE), the rest the zstd data. No panic, no allocation beyond the limit (the
//! limits are checked before zstd runs), and a success is exactly as long as claimed. Any input
//! compressed and decompressed again is unchanged.
#![no_main]
use aqueduct_proto::compress::{compress, decompress, Limits};
use aqueduct_proto::Compression;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_len: 1 << 20,
        max_ratio: 1024,
    };
    if data.len() >= 4 {
        let claimed = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let ext = Compression {
            algorithm: Compression::ZSTD,
            uncompressed_len: claimed,
        };
        if let Ok(out) = decompress(&data[4..], &ext, &limits) {
            assert_eq!(out.len(), claimed as usize);
            assert!(claimed <= limits.max_len);
        }
    }
    if let Some((ext, packed)) = compress(data, 1) {
        let back = decompress(&packed, &ext, &Limits::default()).expect("round trip");
        assert_eq!(&back[..], data);
    }
});
