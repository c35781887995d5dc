//! Sealing batches with AES-256-GCM so that a (key, nonce) pair is never used twice.
//!
//! The master key (`aal.key`, 32 bytes) never encrypts data itself. Every segment has its own
//! data key, derived with HKDF-SHA256 from the master key and a fresh random 32-byte salt kept
//! in the segment's header. A batch's nonce is its number within the segment (a counter from
//! 0). Since a segment is only ever appended to by the process that created it — every open,
//! and every truncation, starts a new segment with a new salt — no counter value is used twice
//! under one data key, across restarts, rotations and crashes. Re-sealing a segment under a new
//! master key (`rekey`) draws a new salt too, so the same counters meet a new data key. Two
//! segments share a data key only if their random salts collide (2^-256).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

/// Bytes of an AES-256-GCM tag.
pub const TAG_LEN: usize = 16;
/// Bytes of a segment's salt.
pub const SALT_LEN: usize = 32;
const INFO: &[u8] = b"aqueduct-aal segment key v1";
const INDEX_INFO: &[u8] = b"aqueduct-aal index mac v1";
/// Bytes of an index file's MAC (HMAC-SHA256).
pub const INDEX_MAC_LEN: usize = 32;
/// The key check's nonce: all ones, a value the batch counter (whose first four bytes are
/// zero) never takes.
const CHECK_NONCE: [u8; NONCE_LEN] = [0xFF; NONCE_LEN];

/// The log's master key (`aal.key`).
#[derive(Clone, PartialEq, Eq)]
pub struct MasterKey([u8; 32]);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// A key from exactly 32 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<MasterKey> {
        Some(MasterKey(bytes.try_into().ok()?))
    }
}

/// Fresh random bytes for a segment's salt.
pub(crate) fn random_salt() -> Result<[u8; SALT_LEN], ring::error::Unspecified> {
    let mut salt = [0u8; SALT_LEN];
    SystemRandom::new().fill(&mut salt)?;
    Ok(salt)
}

struct KeyLen;

impl hkdf::KeyType for KeyLen {
    fn len(&self) -> usize {
        32
    }
}

/// One segment's data key, and the key that authenticates its index file.
pub(crate) struct SegmentCipher {
    key: LessSafeKey,
    index_mac: ring::hmac::Key,
    /// Which of the log's keys (see [`crate::LogOptions::previous_keys`]) the segment was sealed
    /// with: 0 the current one, `n` the n-th previous one.
    pub(crate) key_index: usize,
}

impl std::fmt::Debug for SegmentCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SegmentCipher(..)")
    }
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

impl SegmentCipher {
    /// Fails only if `ring` refuses its own fixed sizes (32 bytes from HKDF-SHA256, a 32-byte
    /// AES key), which it does not.
    pub(crate) fn derive(
        master: &MasterKey,
        salt: &[u8; SALT_LEN],
    ) -> Result<SegmentCipher, ring::error::Unspecified> {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(&master.0);
        let mut data_key = [0u8; 32];
        prk.expand(&[INFO], KeyLen)?.fill(&mut data_key)?;
        let mut mac_key = [0u8; 32];
        prk.expand(&[INDEX_INFO], KeyLen)?.fill(&mut mac_key)?;
        let unbound = UnboundKey::new(&AES_256_GCM, &data_key)?;
        Ok(SegmentCipher {
            key: LessSafeKey::new(unbound),
            index_mac: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &mac_key),
            key_index: 0,
        })
    }

    /// If the segment is sealed with a previous key, that key's entry in `per_previous_key`.
    pub(crate) fn previous_key<'a, T>(&self, per_previous_key: &'a mut [T]) -> Option<&'a mut T> {
        per_previous_key.get_mut(self.key_index.checked_sub(1)?)
    }

    /// The tag that proves a key is the segment's: seals nothing under a nonce batches never
    /// use, bound to the header bytes.
    pub(crate) fn key_check(&self, header: &[u8]) -> [u8; TAG_LEN] {
        let mut empty: [u8; 0] = [];
        let tag = self.key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(CHECK_NONCE),
            Aad::from(header),
            &mut empty,
        );
        let mut out = [0u8; TAG_LEN];
        if let Ok(tag) = tag {
            out.copy_from_slice(tag.as_ref());
        }
        out
    }

    pub(crate) fn verify_key_check(&self, header: &[u8], tag: &[u8; TAG_LEN]) -> bool {
        let mut buf = *tag;
        self.key
            .open_in_place(
                Nonce::assume_unique_for_key(CHECK_NONCE),
                Aad::from(header),
                &mut buf,
            )
            .is_ok()
    }

    /// The MAC of an index file's bytes: without the master key nobody can change an index
    /// (to hide data or lower a topic's offsets) unnoticed.
    pub(crate) fn index_mac(&self, bytes: &[u8]) -> [u8; INDEX_MAC_LEN] {
        let tag = ring::hmac::sign(&self.index_mac, bytes);
        let mut out = [0u8; INDEX_MAC_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    pub(crate) fn verify_index_mac(&self, bytes: &[u8], mac: &[u8]) -> bool {
        ring::hmac::verify(&self.index_mac, bytes, mac).is_ok()
    }

    /// Encrypt `data` in place and append the tag.
    pub(crate) fn seal(&self, counter: u64, aad: &[u8], data: &mut Vec<u8>, start: usize) {
        let tag =
            self.key
                .seal_in_place_separate_tag(nonce(counter), Aad::from(aad), &mut data[start..]);
        match tag {
            Ok(tag) => data.extend_from_slice(tag.as_ref()),
            // Only for inputs over 64 GiB; batches are bounded far below that.
            Err(_) => data.extend_from_slice(&[0u8; TAG_LEN]),
        }
    }

    /// Decrypt `data` (ciphertext then tag) in place; returns the plaintext's length.
    pub(crate) fn open(&self, counter: u64, aad: &[u8], data: &mut [u8]) -> Option<usize> {
        self.key
            .open_in_place(nonce(counter), Aad::from(aad), data)
            .ok()
            .map(|p| p.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_wrong_key() -> Result<(), ring::error::Unspecified> {
        let master = MasterKey([7; 32]);
        let salt = [1; SALT_LEN];
        let c = SegmentCipher::derive(&master, &salt)?;
        let mut data = b"hello".to_vec();
        c.seal(3, b"aad", &mut data, 0);
        assert_eq!(data.len(), 5 + TAG_LEN);
        let mut copy = data.clone();
        assert_eq!(c.open(3, b"aad", &mut copy), Some(5));
        assert_eq!(&copy[..5], b"hello");
        // Wrong counter, wrong aad, wrong key, other salt: all refused.
        assert_eq!(c.open(4, b"aad", &mut data.clone()), None);
        assert_eq!(c.open(3, b"aaD", &mut data.clone()), None);
        let other = SegmentCipher::derive(&MasterKey([8; 32]), &salt)?;
        assert_eq!(other.open(3, b"aad", &mut data.clone()), None);
        let other_salt = SegmentCipher::derive(&master, &[2; SALT_LEN])?;
        assert_eq!(other_salt.open(3, b"aad", &mut data.clone()), None);
        let check = c.key_check(b"header");
        assert!(c.verify_key_check(b"header", &check));
        assert!(!other.verify_key_check(b"header", &check));
        assert!(!c.verify_key_check(b"headeR", &check));
        Ok(())
    }
}
