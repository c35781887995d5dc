//! Durable consumers' positions: per consumer, per topic, the next offset to deliver (everything
//! below it is settled).
//!
//! One small file, `consumers`, in the log directory, replaced whole on every save: written to a
//! temporary file, `fsync`ed, renamed over the old one, and the directory `fsync`ed — so a crash
//! leaves either the old or the new table, never a mix, and a save that returned is durable. A
//! CRC-32C over the content catches damage. The table is small (a few bytes per consumer and
//! topic) and saved at most a few times a second, so a whole-file write costs less than keeping
//! a second log; the log itself would need compaction to drop old positions.
//!
//! ```text
//! file     := "AQDCONS1" count:u32 consumer* crc32c:u32
//! consumer := key_len:u16 key filter_len:u16 filter topics:u32 (topic_len:u16 topic next:u64)*
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::segment::sync_dir;
use crate::LogError;

const MAGIC: &[u8; 8] = b"AQDCONS1";
const FILE: &str = "consumers";

/// One consumer's stored state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerPosition {
    /// The filter it last subscribed with (for operators; positions are kept per topic).
    pub filter: String,
    /// Topic → the next offset to deliver.
    pub next: BTreeMap<Vec<u8>, u64>,
}

/// Every consumer's position, by key.
pub type Positions = BTreeMap<String, ConsumerPosition>;

/// The positions file of a log directory.
#[derive(Debug, Clone)]
pub struct PositionStore {
    dir: PathBuf,
}

impl PositionStore {
    /// The store in `dir` and what it holds (empty if there is no file yet). A damaged file is an
    /// error that names it: starting with no positions would replay every consumer from its
    /// start.
    pub fn open(dir: &Path) -> Result<(PositionStore, Positions), LogError> {
        let store = PositionStore {
            dir: dir.to_path_buf(),
        };
        let path = store.path();
        let _ = std::fs::remove_file(path.with_extension("tmp"));
        let positions = match std::fs::read(&path) {
            Ok(bytes) => decode(&bytes).map_err(|reason| LogError::BadFile {
                path: path.clone(),
                reason: format!(
                    "{reason}; the durable consumers' positions cannot be read (move the file \
                     aside to start every consumer from the start it asks for)"
                ),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Positions::new(),
            Err(e) => return Err(LogError::io("reading", path, e)),
        };
        Ok((store, positions))
    }

    fn path(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    /// Replace the stored table with `positions`, durably.
    /// Returns the file's size.
    pub fn save(&self, positions: &Positions) -> Result<usize, LogError> {
        let path = self.path();
        let tmp = path.with_extension("tmp");
        let bytes = encode(positions);
        let mut f = std::fs::File::create(&tmp).map_err(|e| LogError::io("creating", &tmp, e))?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| LogError::io("writing", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| LogError::io("renaming", &path, e))?;
        sync_dir(&self.dir)?;
        Ok(bytes.len())
    }
}

fn encode(positions: &Positions) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&(positions.len() as u32).to_le_bytes());
    for (key, c) in positions {
        for text in [key.as_bytes(), c.filter.as_bytes()] {
            let text = &text[..text.len().min(u16::MAX as usize)];
            b.extend_from_slice(&(text.len() as u16).to_le_bytes());
            b.extend_from_slice(text);
        }
        b.extend_from_slice(&(c.next.len() as u32).to_le_bytes());
        for (topic, next) in &c.next {
            let topic = &topic[..topic.len().min(u16::MAX as usize)];
            b.extend_from_slice(&(topic.len() as u16).to_le_bytes());
            b.extend_from_slice(topic);
            b.extend_from_slice(&next.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

fn decode(b: &[u8]) -> Result<Positions, String> {
    let (body, crc) = b
        .split_last_chunk::<4>()
        .ok_or_else(|| "file too short".to_string())?;
    if crc32c::crc32c(body) != u32::from_le_bytes(*crc) {
        return Err("checksum mismatch".into());
    }
    let mut r = body
        .strip_prefix(MAGIC)
        .ok_or_else(|| "not an Aqueduct consumers file (bad magic)".to_string())?;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let (head, tail) = r
            .split_at_checked(n)
            .ok_or_else(|| "file cut short".to_string())?;
        r = tail;
        Ok(head)
    };
    let u16_of = |s: &[u8]| u16::from_le_bytes([s[0], s[1]]) as usize;
    let u32_of = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize;
    let mut positions = Positions::new();
    let count = u32_of(take(4)?);
    for _ in 0..count {
        let n = u16_of(take(2)?);
        let key = String::from_utf8_lossy(take(n)?).into_owned();
        let n = u16_of(take(2)?);
        let filter = String::from_utf8_lossy(take(n)?).into_owned();
        let topics = u32_of(take(4)?);
        let mut next = BTreeMap::new();
        for _ in 0..topics {
            let n = u16_of(take(2)?);
            let topic = take(n)?.to_vec();
            let mut o = [0u8; 8];
            o.copy_from_slice(take(8)?);
            next.insert(topic, u64::from_le_bytes(o));
        }
        positions.insert(key, ConsumerPosition { filter, next });
    }
    if !r.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(positions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() -> Result<(), LogError> {
        let tmp = tempfile::tempdir().map_err(|e| LogError::io("temp", "/tmp", e))?;
        let (store, empty) = PositionStore::open(tmp.path())?;
        assert!(empty.is_empty());
        let mut p = Positions::new();
        p.insert(
            "consumer:c1".into(),
            ConsumerPosition {
                filter: "orders/+".into(),
                next: [(b"orders/eu".to_vec(), 7), (b"orders/us".to_vec(), 0)].into(),
            },
        );
        store.save(&p)?;
        let (_, back) = PositionStore::open(tmp.path())?;
        assert_eq!(back, p);
        let bytes = encode(&p);
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err());
        }
        let mut flipped = bytes.clone();
        flipped[12] ^= 1;
        assert!(decode(&flipped).is_err());
        std::fs::write(tmp.path().join(FILE), &flipped)
            .map_err(|e| LogError::io("write", "x", e))?;
        let e = PositionStore::open(tmp.path()).map(|_| ());
        assert!(matches!(e, Err(LogError::BadFile { .. })), "{e:?}");
        Ok(())
    }
}
