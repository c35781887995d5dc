//! ZSTD for payloads marked with the COMPRESSION extension (`0x02`: algorithm 1 = zstd, and the
//! uncompressed length): what mesh peers use for the batches they forward to each other
//! (feature `zstd`).
//!
//! Decompression is bounded before anything is allocated: the claimed length must be within
//! [`Limits::max_len`] and within [`Limits::max_ratio`] times the compressed size, the output
//! buffer is allocated at the claimed length (no more), zstd refuses to write past it, and the
//! result must be exactly as long as claimed. A compression bomb is refused with an error, never
//! an allocation of the size it claims.

use bytes::Bytes;

use crate::error::ErrorCode;
use crate::ext::Compression;

/// What a receiver accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest uncompressed payload.
    pub max_len: u32,
    /// Largest uncompressed / compressed size ratio.
    pub max_ratio: u32,
}

impl Default for Limits {
    fn default() -> Self {
        // Real batches of similar messages compress 5-250x; a bomb claims thousands.
        Limits {
            max_len: 16 << 20,
            max_ratio: 1024,
        }
    }
}

/// Why a compressed payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompressionError {
    #[error("compression algorithm {0} is not supported (1 = zstd)")]
    Algorithm(u8),
    #[error("claims {claimed} bytes uncompressed, above the limit of {limit}")]
    TooLarge { claimed: u32, limit: u32 },
    #[error(
        "claims {claimed} bytes from {compressed} compressed, a ratio above the limit of {limit}"
    )]
    Ratio {
        claimed: u32,
        compressed: usize,
        limit: u32,
    },
    #[error("zstd data is invalid: {0}")]
    Corrupt(String),
    #[error("decompressed to {actual} bytes, not the {claimed} claimed")]
    Length { claimed: u32, actual: usize },
}

impl CompressionError {
    /// The ERROR code for it.
    pub fn code(&self) -> ErrorCode {
        ErrorCode::BAD_PAYLOAD
    }
}

/// Compress `data` at `level`; returns the extension to send with it and the compressed bytes.
/// `None` if it does not get smaller (send it uncompressed then), is too large to describe, or
/// shrinks by more than a receiver with the default [`Limits`] accepts (long runs of one byte
/// look like a bomb): what this returns, such a receiver always takes.
pub fn compress(data: &[u8], level: i32) -> Option<(Compression, Bytes)> {
    let len = u32::try_from(data.len()).ok()?;
    let packed = zstd::bulk::compress(data, level).ok()?;
    let ratio_ok = u64::from(len) <= packed.len() as u64 * u64::from(Limits::default().max_ratio);
    (packed.len() < data.len() && ratio_ok).then(|| {
        (
            Compression {
                algorithm: Compression::ZSTD,
                uncompressed_len: len,
            },
            Bytes::from(packed),
        )
    })
}

/// Undo [`compress`], within `limits`.
pub fn decompress(
    data: &[u8],
    ext: &Compression,
    limits: &Limits,
) -> Result<Bytes, CompressionError> {
    if ext.algorithm != Compression::ZSTD {
        return Err(CompressionError::Algorithm(ext.algorithm));
    }
    let claimed = ext.uncompressed_len;
    if claimed > limits.max_len {
        return Err(CompressionError::TooLarge {
            claimed,
            limit: limits.max_len,
        });
    }
    if u64::from(claimed) > data.len() as u64 * u64::from(limits.max_ratio) {
        return Err(CompressionError::Ratio {
            claimed,
            compressed: data.len(),
            limit: limits.max_ratio,
        });
    }
    let out = zstd::bulk::decompress(data, claimed as usize)
        .map_err(|e| CompressionError::Corrupt(e.to_string()))?;
    if out.len() != claimed as usize {
        return Err(CompressionError::Length {
            claimed,
            actual: out.len(),
        });
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_ratio() {
        let data: Vec<u8> = (0..10_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect();
        let (ext, packed) = compress(&data, 3).expect("compresses");
        assert_eq!(ext.uncompressed_len as usize, data.len());
        assert!(
            packed.len() * 4 < data.len(),
            "ratio {}",
            data.len() / packed.len()
        );
        let back = decompress(&packed, &ext, &Limits::default()).expect("decompresses");
        assert_eq!(&back[..], &data[..]);
        // Random bytes do not shrink: sent as they are.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..1000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        assert!(compress(&noise, 3).is_none());
    }

    #[test]
    fn a_bomb_is_refused_before_any_allocation_of_its_claim() {
        // 64 MiB of zeros compress to a few KiB (`compress` itself would not send that).
        let zeros = vec![0u8; 64 << 20];
        assert!(
            compress(&zeros, 3).is_none(),
            "past the ratio a receiver takes"
        );
        let packed = zstd::bulk::compress(&zeros, 3).expect("compresses");
        let ext = Compression {
            algorithm: Compression::ZSTD,
            uncompressed_len: zeros.len() as u32,
        };
        assert!(packed.len() < 64 << 10);
        let e = decompress(&packed, &ext, &Limits::default()).expect_err("too large");
        assert!(matches!(e, CompressionError::TooLarge { .. }), "{e}");
        let wide = Limits {
            max_len: u32::MAX,
            ..Limits::default()
        };
        let e = decompress(&packed, &ext, &wide).expect_err("ratio");
        assert!(matches!(e, CompressionError::Ratio { .. }), "{e}");
        // A claim that understates the real size: zstd stops at the claim.
        let lying = Compression {
            algorithm: 1,
            uncompressed_len: 1000,
        };
        let small = compress(&vec![7u8; 4000], 3).expect("compresses").1;
        let e = decompress(&small, &lying, &Limits::default()).expect_err("longer than claimed");
        assert!(matches!(e, CompressionError::Corrupt(_)), "{e}");
    }

    /// What `compress` makes, a receiver with the default limits takes, however compressible:
    /// 64 KiB of one repeated small record shrinks ~1,900x, past the 1,024x limit, and used to
    /// be sent compressed (a cluster peer then cut the link as if it were a bomb).
    #[test]
    fn what_is_compressed_is_always_accepted() {
        let record = b"aqueduct:heartbeat:node-1:ok:000000\n";
        for data in [
            vec![0u8; 65_520],
            record.repeat(65_520 / record.len()),
            vec![7u8; 4000],
            record.repeat(10),
        ] {
            if let Some((ext, packed)) = compress(&data, 3) {
                let back = decompress(&packed, &ext, &Limits::default())
                    .unwrap_or_else(|e| panic!("{} bytes: {e}", data.len()));
                assert_eq!(back, data);
            }
        }
    }

    #[test]
    fn garbage_and_other_algorithms_are_errors() {
        let ext = Compression {
            algorithm: 1,
            uncompressed_len: 10,
        };
        assert!(matches!(
            decompress(b"not zstd at all", &ext, &Limits::default()),
            Err(CompressionError::Corrupt(_))
        ));
        let other = Compression {
            algorithm: 9,
            uncompressed_len: 10,
        };
        assert_eq!(
            decompress(b"x", &other, &Limits::default()),
            Err(CompressionError::Algorithm(9))
        );
    }
}
