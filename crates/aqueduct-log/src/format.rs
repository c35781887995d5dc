//! The bytes on disk: segment headers, batch frames, records and index files. Pure functions
//! over byte slices (no files), so they are unit-tested and fuzzed directly. All integers are
//! little-endian. The layout is specified in `docs/architecture.md` ("The durable log").
//!
//! ```text
//! segment  := header(96) frame*
//! header   := "AQDLOG01" version:u16 flags:u16 unclean_before:u32 segment_id:u64 generation:u64
//!             created_ms:u64 salt:[32] key_check:[16] reserved:u32 crc32c(header[0..92]):u32
//! frame    := body_len:u32 crc32c(body):u32 body
//! body     := batch_no:u64 count:u32 flags:u32 timestamp_ms:u64 payload
//! payload  := records (plaintext segment) | seal(records) ‖ tag:[16] (encrypted segment)
//! record   := kind:u8 topic_len:u16 topic offset:u64 data_len:u32 data
//! ```
//!
//! The CRC covers the body as stored (ciphertext and tag): it tells a torn or flipped write
//! apart from a whole record that fails authentication (wrong key or tampering).

/// Bytes of a segment header.
pub const HEADER_LEN: usize = 96;
/// Bytes before a frame's body: its length and CRC.
pub const FRAME_PREFIX: usize = 8;
/// Bytes of a body's header (before the payload).
pub const BODY_HEADER: usize = 24;
/// The largest body a frame may claim; anything larger is damage, not a batch.
pub const MAX_BODY: usize = 64 << 20;

const SEGMENT_MAGIC: &[u8; 8] = b"AQDLOG01";
const INDEX_MAGIC: &[u8; 8] = b"AQDLIDX1";
const VERSION: u16 = 1;
const FLAG_ENCRYPTED: u16 = 1;

/// A record's kind: a message, or a mark that says "offsets up to here were used" (written
/// before retention deletes a topic's last records, so its offsets are never re-used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Data = 0,
    Mark = 1,
}

/// A segment's header fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentHeader {
    pub id: u64,
    pub generation: u64,
    /// How many earlier generations (runs of the broker) ended without a clean close.
    pub unclean_before: u32,
    pub created_ms: u64,
    pub encrypted: bool,
    pub salt: [u8; 32],
    pub key_check: [u8; 16],
}

impl SegmentHeader {
    /// The bytes the key check is bound to (everything before it).
    pub fn check_aad(bytes: &[u8; HEADER_LEN]) -> &[u8] {
        &bytes[..72]
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(SEGMENT_MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.encrypted { FLAG_ENCRYPTED } else { 0 };
        b[10..12].copy_from_slice(&flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.unclean_before.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.created_ms.to_le_bytes());
        b[40..72].copy_from_slice(&self.salt);
        b[72..88].copy_from_slice(&self.key_check);
        let crc = crc32c::crc32c(&b[..92]);
        b[92..96].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<SegmentHeader, String> {
        let b: &[u8; HEADER_LEN] = b
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| format!("shorter than a segment header ({HEADER_LEN} bytes)"))?;
        if &b[0..8] != SEGMENT_MAGIC {
            return Err("not an Aqueduct log segment (bad magic)".into());
        }
        if crc32c::crc32c(&b[..92]) != u32_at(b, 92) {
            return Err("segment header checksum mismatch".into());
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(format!(
                "segment format version {version} (this build reads {VERSION})"
            ));
        }
        let flags = u16::from_le_bytes([b[10], b[11]]);
        let mut salt = [0u8; 32];
        salt.copy_from_slice(&b[40..72]);
        let mut key_check = [0u8; 16];
        key_check.copy_from_slice(&b[72..88]);
        Ok(SegmentHeader {
            id: u64_at(b, 16),
            generation: u64_at(b, 24),
            unclean_before: u32_at(b, 12),
            created_ms: u64_at(b, 32),
            encrypted: flags & FLAG_ENCRYPTED != 0,
            salt,
            key_check,
        })
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// A batch body's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyHeader {
    pub batch_no: u64,
    pub count: u32,
    pub timestamp_ms: u64,
}

impl BodyHeader {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.batch_no.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.timestamp_ms.to_le_bytes());
    }

    pub fn decode(body: &[u8]) -> Option<BodyHeader> {
        if body.len() < BODY_HEADER {
            return None;
        }
        Some(BodyHeader {
            batch_no: u64_at(body, 0),
            count: u32_at(body, 8),
            timestamp_ms: u64_at(body, 16),
        })
    }
}

/// The associated data a batch is sealed with: its segment and its body header, so a batch
/// cannot be moved to another place or segment unnoticed.
pub fn batch_aad(segment_id: u64, body_header: &[u8]) -> [u8; 8 + BODY_HEADER] {
    let mut aad = [0u8; 8 + BODY_HEADER];
    aad[..8].copy_from_slice(&segment_id.to_le_bytes());
    aad[8..].copy_from_slice(&body_header[..BODY_HEADER]);
    aad
}

/// What the frame at some position holds, as far as its prefix and CRC tell.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameCheck {
    /// A whole frame whose CRC matches: `len` bytes in all, prefix included.
    Good { len: usize },
    /// Fewer bytes than a prefix, or than the body the prefix claims: a write cut short.
    Short,
    /// The claimed length is impossible (too small or over [`MAX_BODY`]).
    BadLength,
    /// A whole frame whose CRC does not match: `len` bytes in all.
    BadCrc { len: usize },
}

/// Check the frame at the start of `bytes`.
pub fn check_frame(bytes: &[u8]) -> FrameCheck {
    if bytes.len() < FRAME_PREFIX {
        return FrameCheck::Short;
    }
    let body_len = u32_at(bytes, 0) as usize;
    if !(BODY_HEADER..=MAX_BODY).contains(&body_len) {
        return FrameCheck::BadLength;
    }
    let Some(body) = bytes.get(FRAME_PREFIX..FRAME_PREFIX + body_len) else {
        return FrameCheck::Short;
    };
    let len = FRAME_PREFIX + body_len;
    if crc32c::crc32c(body) == u32_at(bytes, 4) {
        FrameCheck::Good { len }
    } else {
        FrameCheck::BadCrc { len }
    }
}

/// Begin a frame in `out`: room for the prefix, then the body header. Returns where the frame
/// starts; finish it with [`finish_frame`] after appending the payload.
pub fn start_frame(out: &mut Vec<u8>, header: &BodyHeader) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_PREFIX]);
    header.encode_into(out);
    start
}

/// Fill in the prefix of the frame that starts at `start` and runs to the end of `out`.
pub fn finish_frame(out: &mut [u8], start: usize) {
    let body = &out[start + FRAME_PREFIX..];
    let body_len = body.len() as u32;
    let crc = crc32c::crc32c(body);
    out[start..start + 4].copy_from_slice(&body_len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Append one record to a payload.
pub fn encode_record(out: &mut Vec<u8>, kind: Kind, topic: &[u8], offset: u64, data: &[u8]) {
    out.push(kind as u8);
    out.extend_from_slice(&(topic.len() as u16).to_le_bytes());
    out.extend_from_slice(topic);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
}

/// Bytes a record takes.
pub fn record_len(topic: &[u8], data: &[u8]) -> usize {
    1 + 2 + topic.len() + 8 + 4 + data.len()
}

/// One decoded record, borrowing from the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRef<'a> {
    pub kind: Kind,
    pub topic: &'a [u8],
    pub offset: u64,
    pub data: &'a [u8],
}

/// Walk the records of a plaintext payload. Every record must be whole and the payload must
/// hold exactly `count` of them.
pub fn decode_records(payload: &[u8], count: u32) -> Result<Vec<RecordRef<'_>>, String> {
    let mut out = Vec::with_capacity((count as usize).min(payload.len() / 15 + 1));
    let mut rest = payload;
    for i in 0..count {
        let bad = |what: &str| format!("record {i} of {count}: {what}");
        let (&kind, r) = rest.split_first().ok_or_else(|| bad("missing"))?;
        let kind = match kind {
            0 => Kind::Data,
            1 => Kind::Mark,
            k => return Err(bad(&format!("unknown kind {k}"))),
        };
        let tl = r.get(..2).ok_or_else(|| bad("cut short"))?;
        let tl = u16::from_le_bytes([tl[0], tl[1]]) as usize;
        if tl == 0 {
            return Err(bad("empty topic"));
        }
        let r = &r[2..];
        let topic = r.get(..tl).ok_or_else(|| bad("cut short"))?;
        let r = &r[tl..];
        let fixed = r.get(..12).ok_or_else(|| bad("cut short"))?;
        let offset = u64_at(fixed, 0);
        let dl = u32_at(fixed, 8) as usize;
        let r = &r[12..];
        let data = r.get(..dl).ok_or_else(|| bad("cut short"))?;
        rest = &r[dl..];
        out.push(RecordRef {
            kind,
            topic,
            offset,
            data,
        });
    }
    if !rest.is_empty() {
        return Err(format!(
            "{} bytes after the last of {count} records",
            rest.len()
        ));
    }
    Ok(out)
}

/// One topic's part of a segment, as the index keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopicSpan {
    /// First and last data offsets in the segment (none if it holds only marks).
    pub data: Option<(u64, u64)>,
    /// Highest offset in the segment, marks included.
    pub high: u64,
    /// Sparse entry points: (first offset of the topic in a batch, the batch's position).
    pub entries: Vec<(u64, u64)>,
}

/// A segment's index file: what recovery would learn by reading the whole segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexFile {
    pub segment_id: u64,
    /// The segment's length the index describes; a segment of another length is re-read.
    pub covered_len: u64,
    pub generation: u64,
    /// The next batch number (batches in the segment).
    pub batches: u64,
    pub min_ts: u64,
    pub max_ts: u64,
    /// Written by a clean close (false: written by recovery after a crash).
    pub clean: bool,
    /// Damaged batches found when the segment was read (position, length).
    pub damage: Vec<(u64, u64)>,
    pub topics: Vec<(Vec<u8>, TopicSpan)>,
}

impl IndexFile {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.topics.len() * 48);
        b.extend_from_slice(INDEX_MAGIC);
        for v in [
            self.segment_id,
            self.covered_len,
            self.generation,
            self.batches,
            self.min_ts,
            self.max_ts,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(self.clean as u8);
        b.extend_from_slice(&(self.damage.len() as u32).to_le_bytes());
        for (pos, len) in &self.damage {
            b.extend_from_slice(&pos.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
        }
        b.extend_from_slice(&(self.topics.len() as u32).to_le_bytes());
        for (name, span) in &self.topics {
            b.extend_from_slice(&(name.len() as u16).to_le_bytes());
            b.extend_from_slice(name);
            let (has, first, last) = match span.data {
                Some((f, l)) => (1u8, f, l),
                None => (0, 0, 0),
            };
            b.push(has);
            b.extend_from_slice(&first.to_le_bytes());
            b.extend_from_slice(&last.to_le_bytes());
            b.extend_from_slice(&span.high.to_le_bytes());
            b.extend_from_slice(&(span.entries.len() as u32).to_le_bytes());
            for (o, p) in &span.entries {
                b.extend_from_slice(&o.to_le_bytes());
                b.extend_from_slice(&p.to_le_bytes());
            }
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<IndexFile, String> {
        let (body, crc) = b
            .split_last_chunk::<4>()
            .ok_or_else(|| "index file too short".to_string())?;
        if crc32c::crc32c(body) != u32::from_le_bytes(*crc) {
            return Err("index checksum mismatch".into());
        }
        let mut r = Cursor { b: body, at: 0 };
        if r.take(8)? != INDEX_MAGIC {
            return Err("not an Aqueduct log index (bad magic)".into());
        }
        let mut idx = IndexFile {
            segment_id: r.u64()?,
            covered_len: r.u64()?,
            generation: r.u64()?,
            batches: r.u64()?,
            min_ts: r.u64()?,
            max_ts: r.u64()?,
            clean: r.take(1)?[0] == 1,
            ..IndexFile::default()
        };
        let damage = r.u32()? as usize;
        for _ in 0..damage {
            let pos = r.u64()?;
            let len = r.u64()?;
            idx.damage.push((pos, len));
        }
        let topics = r.u32()? as usize;
        for _ in 0..topics {
            let nl = r.u16()? as usize;
            let name = r.take(nl)?.to_vec();
            let has = r.take(1)?[0] == 1;
            let (first, last, high) = (r.u64()?, r.u64()?, r.u64()?);
            let n = r.u32()? as usize;
            // Each entry is 16 bytes: refuse a count the file cannot hold before allocating.
            if n > (r.b.len() - r.at) / 16 {
                return Err("index entry count exceeds the file".into());
            }
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                entries.push((r.u64()?, r.u64()?));
            }
            idx.topics.push((
                name,
                TopicSpan {
                    data: has.then_some((first, last)),
                    high,
                    entries,
                },
            ));
        }
        if r.at != body.len() {
            return Err("trailing bytes in index file".into());
        }
        Ok(idx)
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| "index file cut short".to_string())?;
        self.at += n;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, String> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32_at(self.take(4)?, 0))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64_at(self.take(8)?, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_damage() {
        let h = SegmentHeader {
            id: 5,
            generation: 2,
            unclean_before: 1,
            created_ms: 1_700_000_000_000,
            encrypted: true,
            salt: [9; 32],
            key_check: [3; 16],
        };
        let b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        let mut bad = b;
        bad[20] ^= 1;
        assert!(SegmentHeader::decode(&bad).is_err());
        assert!(SegmentHeader::decode(&b[..50]).is_err());
    }

    #[test]
    fn frame_and_records() {
        let mut out = Vec::new();
        let start = start_frame(
            &mut out,
            &BodyHeader {
                batch_no: 1,
                count: 2,
                timestamp_ms: 42,
            },
        );
        encode_record(&mut out, Kind::Data, b"a/b", 7, b"hello");
        encode_record(&mut out, Kind::Mark, b"c", 9, b"");
        finish_frame(&mut out, start);
        assert_eq!(check_frame(&out), FrameCheck::Good { len: out.len() });
        assert_eq!(check_frame(&out[..out.len() - 1]), FrameCheck::Short);
        let body = &out[FRAME_PREFIX..];
        let h = BodyHeader::decode(body).expect("whole header");
        assert_eq!((h.batch_no, h.count, h.timestamp_ms), (1, 2, 42));
        let recs = decode_records(&body[BODY_HEADER..], 2).expect("valid records");
        assert_eq!(recs[0].topic, b"a/b");
        assert_eq!(recs[0].data, b"hello");
        assert_eq!((recs[1].kind, recs[1].offset), (Kind::Mark, 9));
        assert!(decode_records(&body[BODY_HEADER..], 1).is_err());
        assert!(decode_records(&body[BODY_HEADER..], 3).is_err());
        let mut flipped = out.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        assert!(matches!(check_frame(&flipped), FrameCheck::BadCrc { .. }));
        let mut huge = out.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(check_frame(&huge), FrameCheck::BadLength);
    }

    #[test]
    fn index_round_trip() {
        let idx = IndexFile {
            segment_id: 3,
            covered_len: 1000,
            generation: 1,
            batches: 4,
            min_ts: 1,
            max_ts: 2,
            clean: true,
            damage: vec![(500, 40)],
            topics: vec![(
                b"t".to_vec(),
                TopicSpan {
                    data: Some((1, 9)),
                    high: 9,
                    entries: vec![(1, 96), (5, 600)],
                },
            )],
        };
        let b = idx.encode();
        assert_eq!(IndexFile::decode(&b), Ok(idx));
        for cut in 0..b.len() {
            assert!(IndexFile::decode(&b[..cut]).is_err());
        }
    }
}
