//! One segment file: creating it, reading it back whole (recovery, verify), and its index.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::crypto::{random_salt, MasterKey, SegmentCipher, TAG_LEN};
use crate::format::{
    self, batch_aad, check_frame, BodyHeader, FrameCheck, IndexFile, Kind, SegmentHeader,
    TopicSpan, BODY_HEADER, FRAME_PREFIX, HEADER_LEN,
};
use crate::LogError;

/// A topic gets a new index entry when its batch starts at least this far after the topic's
/// previous entry: a reader never reads more than this (plus one batch) of other topics'
/// batches per entry, and a dense topic costs one 16-byte entry per this many bytes.
pub(crate) const STRIDE: u64 = 64 * 1024;

/// The order of a log's segments as sealed or plaintext: `aal.allow_plaintext` is for the
/// segments a log wrote before its key was set, all older than its first sealed one, so a
/// plaintext segment after a sealed one was put there (by anyone who can write to the
/// directory). Fed the segments oldest first.
#[derive(Debug, Default)]
pub(crate) struct SealOrder {
    sealed_before: bool,
}

impl SealOrder {
    /// The next segment, at `path`, sealed with a key or not: an error if it is plaintext
    /// after a sealed one.
    pub(crate) fn next(&mut self, path: &Path, sealed: bool) -> Result<(), LogError> {
        if !sealed && self.sealed_before {
            return Err(LogError::BadFile {
                path: path.to_path_buf(),
                reason: "a plaintext segment after segments sealed with a key: \
                         aal.allow_plaintext accepts those a log wrote before its key was set, \
                         which come before its first sealed one; anyone who can write to the \
                         directory could have put this one there, and the broker refuses to \
                         start with it"
                    .into(),
            });
        }
        self.sealed_before |= sealed;
        Ok(())
    }
}

pub(crate) fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.seg"))
}

pub(crate) fn index_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.idx"))
}

/// Write a segment's index file atomically (temporary file, fsync, rename; the caller syncs the
/// directory), with its MAC when the segment is encrypted.
pub(crate) fn write_index_file(
    dir: &Path,
    id: u64,
    idx: &IndexFile,
    cipher: Option<&SegmentCipher>,
) -> Result<(), LogError> {
    let path = index_path(dir, id);
    let tmp = path.with_extension("idx.tmp");
    let mut bytes = idx.encode();
    if let Some(c) = cipher {
        let mac = c.index_mac(&bytes);
        bytes.extend_from_slice(&mac);
    }
    let mut f = File::create(&tmp).map_err(|e| LogError::io("creating index file", &tmp, e))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| LogError::io("writing index file", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| LogError::io("renaming index file", &path, e))
}

/// fsync a directory, so that files created, renamed or deleted in it stay so after a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| LogError::io("syncing the log directory", dir, e))
}

/// What the log knows about one segment.
#[derive(Debug)]
pub(crate) struct Segment {
    pub id: u64,
    pub generation: u64,
    /// Generations before this segment's that ended in a crash (from its header).
    pub unclean_before: u32,
    pub path: PathBuf,
    /// Bytes of whole, checked frames (and the header): where the next batch goes.
    pub len: u64,
    pub batches: u64,
    pub min_ts: u64,
    pub max_ts: u64,
    /// When it was created (its header's word): the age of a segment with no readable batch.
    pub created_ms: u64,
    pub cipher: Option<Arc<SegmentCipher>>,
    pub topics: Topics,
    pub damage: Vec<(u64, u64)>,
    /// Sealed normally (by rotation or a clean close), as its index file says.
    pub clean: bool,
}

impl Segment {
    fn empty(dir: &Path, header: &SegmentHeader, cipher: Option<Arc<SegmentCipher>>) -> Self {
        Segment {
            id: header.id,
            generation: header.generation,
            unclean_before: header.unclean_before,
            path: segment_path(dir, header.id),
            len: HEADER_LEN as u64,
            batches: 0,
            min_ts: u64::MAX,
            max_ts: 0,
            created_ms: header.created_ms,
            cipher,
            topics: Topics::Live(HashMap::new()),
            damage: Vec::new(),
            clean: false,
        }
    }

    /// Create a new, empty segment file (header written and synced; the directory is synced by
    /// the caller).
    pub fn create(
        dir: &Path,
        id: u64,
        generation: u64,
        unclean_before: u32,
        key: Option<&MasterKey>,
        now_ms: u64,
    ) -> Result<(Segment, File), LogError> {
        let path = segment_path(dir, id);
        let mut header = SegmentHeader {
            id,
            generation,
            unclean_before,
            created_ms: now_ms,
            encrypted: key.is_some(),
            salt: [0; 32],
            key_check: [0; TAG_LEN],
        };
        let cipher = match key {
            Some(k) => Some(Arc::new(seal_header(&mut header, k, &path)?)),
            None => {
                header.salt = fresh_salt(&path)?;
                None
            }
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| LogError::io("creating segment", &path, e))?;
        if let Err(e) = file
            .write_all(&header.encode())
            .and_then(|()| file.sync_all())
        {
            // Leave no half-made file behind: the next attempt uses the same name.
            let _ = std::fs::remove_file(&path);
            return Err(LogError::io("writing the header of segment", &path, e));
        }
        Ok((Segment::empty(dir, &header, cipher), file))
    }

    /// Note one record at batch position `pos`, keeping the sparse entries. Only the active
    /// segment is noted, and it is live.
    pub fn note(&mut self, kind: Kind, topic: &[u8], offset: u64, pos: u64) {
        let Topics::Live(topics) = &mut self.topics else {
            debug_assert!(false, "a sealed segment is never appended to");
            return;
        };
        let span = match topics.get_mut(topic) {
            Some(s) => s,
            None => topics.entry(topic.into()).or_default(),
        };
        span.high = span.high.max(offset);
        if kind == Kind::Mark {
            return;
        }
        span.data = Some(match span.data {
            Some((first, _)) => (first, offset),
            None => (offset, offset),
        });
        let add = match span.entries.last() {
            Some(&(_, last_pos)) => pos >= last_pos + STRIDE,
            None => true,
        };
        if add {
            span.entries.push((offset, pos));
        }
    }

    pub fn note_batch(&mut self, timestamp_ms: u64, end: u64) {
        self.batches += 1;
        self.min_ts = self.min_ts.min(timestamp_ms);
        self.max_ts = self.max_ts.max(timestamp_ms);
        self.len = end;
    }

    /// What its index file says. Only a live segment's is made here: a sealed one's entry
    /// points are in its index file already, and no longer in memory.
    pub fn index_file(&self) -> Result<IndexFile, LogError> {
        let Topics::Live(live) = &self.topics else {
            return Err(LogError::InvalidAppend(format!(
                "segment {} is sealed: its index is the file it was sealed with",
                self.id
            )));
        };
        let mut topics: Vec<(Vec<u8>, TopicSpan)> =
            live.iter().map(|(k, v)| (k.to_vec(), v.clone())).collect();
        topics.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(IndexFile {
            segment_id: self.id,
            covered_len: self.len,
            generation: self.generation,
            batches: self.batches,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            clean: self.clean,
            damage: self.damage.clone(),
            topics,
        })
    }

    /// Drop the entry points from memory, keeping each topic's offsets: once its index file is
    /// written, readers read them from there (see [`Topics`]).
    pub fn seal(&mut self) {
        if let Topics::Live(live) = &self.topics {
            self.topics = Topics::Sealed(SealedTopics::new(
                live.iter().map(|(name, span)| (&**name, Span::of(span))),
            ));
        }
    }

    /// Write the index file atomically (temporary file, fsync, rename; the caller syncs the
    /// directory).
    pub fn write_index(&self, dir: &Path) -> Result<(), LogError> {
        write_index_file(dir, self.id, &self.index_file()?, self.cipher.as_deref())
    }

    /// Take the index file's word for the segment's content.
    fn from_index(
        dir: &Path,
        header: &SegmentHeader,
        cipher: Option<Arc<SegmentCipher>>,
        idx: IndexFile,
    ) -> Segment {
        let mut s = Segment::empty(dir, header, cipher);
        s.len = idx.covered_len;
        s.batches = idx.batches;
        s.min_ts = idx.min_ts;
        s.max_ts = idx.max_ts;
        s.clean = idx.clean;
        s.damage = idx.damage;
        s.topics = Topics::Sealed(SealedTopics::new(
            idx.topics
                .iter()
                .map(|(name, span)| (&name[..], Span::of(span))),
        ));
        s
    }
}

/// A segment's topics.
///
/// The active segment's are live: every topic's span with its sparse entry points, noted as
/// batches are appended. A sealed segment (rotated, or loaded from its index file) keeps only
/// each topic's offsets, 40 bytes and its name; its entry points stay in its index file, and a
/// reader reads them from there when it gets to the segment (through the log's
/// [`EntryCache`](crate::reader::EntryCache)). Memory then no longer grows with the log's size
/// times its busy topics' entries (a dense topic has one per [`STRIDE`]: 25 KB per 100 MB
/// segment).
#[derive(Debug)]
pub(crate) enum Topics {
    Live(HashMap<Box<[u8]>, TopicSpan>),
    Sealed(SealedTopics),
}

/// A topic's offsets in a segment, without its entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    /// First and last data offsets (none if it holds only marks).
    pub data: Option<(u64, u64)>,
    /// Highest offset, marks included.
    pub high: u64,
}

impl Span {
    fn of(span: &TopicSpan) -> Span {
        Span {
            data: span.data,
            high: span.high,
        }
    }
}

impl Topics {
    pub fn get(&self, topic: &[u8]) -> Option<Span> {
        match self {
            Topics::Live(live) => live.get(topic).map(Span::of),
            Topics::Sealed(sealed) => sealed.get(topic),
        }
    }

    /// Every topic and its span, in no particular order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = (&[u8], Span)> + '_> {
        match self {
            Topics::Live(live) => {
                Box::new(live.iter().map(|(name, span)| (&**name, Span::of(span))))
            }
            Topics::Sealed(sealed) => Box::new(sealed.iter()),
        }
    }

    /// Bytes of memory its tables hold (not counting the map's own overhead).
    #[cfg(test)]
    pub fn heap_bytes(&self) -> usize {
        match self {
            Topics::Live(live) => live
                .iter()
                .map(|(name, span)| {
                    name.len()
                        + std::mem::size_of::<TopicSpan>()
                        + span.entries.capacity() * std::mem::size_of::<(u64, u64)>()
                })
                .sum(),
            Topics::Sealed(sealed) => sealed.names.len() + std::mem::size_of_val(&*sealed.spans),
        }
    }
}

/// A sealed segment's topics: their names end to end, sorted, and each one's span.
#[derive(Debug, Default)]
pub(crate) struct SealedTopics {
    names: Box<[u8]>,
    /// In name order: where each name ends in `names`, and its span.
    spans: Box<[(usize, Span)]>,
}

impl SealedTopics {
    fn new<'a>(topics: impl Iterator<Item = (&'a [u8], Span)>) -> SealedTopics {
        let mut sorted: Vec<(&[u8], Span)> = topics.collect();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut names = Vec::with_capacity(sorted.iter().map(|(name, _)| name.len()).sum());
        let spans = sorted
            .into_iter()
            .map(|(name, span)| {
                names.extend_from_slice(name);
                (names.len(), span)
            })
            .collect();
        SealedTopics {
            names: names.into_boxed_slice(),
            spans,
        }
    }

    fn name(&self, i: usize) -> &[u8] {
        let start = match i.checked_sub(1) {
            Some(before) => self.spans[before].0,
            None => 0,
        };
        &self.names[start..self.spans[i].0]
    }

    fn get(&self, topic: &[u8]) -> Option<Span> {
        let (mut lo, mut hi) = (0, self.spans.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.name(mid).cmp(topic) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.spans[mid].1),
            }
        }
        None
    }

    fn iter(&self) -> impl Iterator<Item = (&[u8], Span)> {
        (0..self.spans.len()).map(|i| (self.name(i), self.spans[i].1))
    }
}

/// Give `header` (of the segment at `path`) a fresh salt, and the key check of the data key
/// that `key` and that salt derive; returns that data key. Every segment sealed gets its own,
/// whether it is new or re-sealed (`rekey`), so no nonce meets a data key twice.
pub(crate) fn seal_header(
    header: &mut SegmentHeader,
    key: &MasterKey,
    path: &Path,
) -> Result<SegmentCipher, LogError> {
    header.encrypted = true;
    header.salt = fresh_salt(path)?;
    let cipher = derive(key, &header.salt, path)?;
    header.key_check = [0; TAG_LEN];
    header.key_check = cipher.key_check(SegmentHeader::check_aad(&header.encode()));
    Ok(cipher)
}

/// Fresh random bytes for the salt of the segment at `path`.
fn fresh_salt(path: &Path) -> Result<[u8; 32], LogError> {
    random_salt().map_err(|_| {
        LogError::io(
            "drawing a random salt for",
            path,
            std::io::Error::other("the system's random source failed"),
        )
    })
}

fn derive(key: &MasterKey, salt: &[u8; 32], path: &Path) -> Result<SegmentCipher, LogError> {
    SegmentCipher::derive(key, salt).map_err(|_| LogError::BadFile {
        path: path.to_path_buf(),
        reason: "could not derive the segment's data key".into(),
    })
}

/// How reading a segment from end to end went.
#[derive(Debug)]
pub(crate) struct Scanned {
    pub segment: Segment,
    /// Bytes after `segment.len` that are a torn write (no whole, checked frame follows).
    pub torn_bytes: u64,
    /// Topics whose offsets jump across a damaged batch.
    pub degraded: Vec<String>,
}

/// Open a segment file's header and find, by its key check, which of `keys` (the current key
/// first, then the previous ones; empty: no key) it was sealed with.
pub(crate) fn open_header(
    path: &Path,
    file: &File,
    keys: &[MasterKey],
    allow_plaintext: bool,
) -> Result<(SegmentHeader, Option<Arc<SegmentCipher>>), LogError> {
    let mut raw = [0u8; HEADER_LEN];
    file.read_exact_at(&mut raw, 0)
        .map_err(|e| LogError::BadFile {
            path: path.to_path_buf(),
            reason: format!("cannot read the segment header: {e}"),
        })?;
    let header = SegmentHeader::decode(&raw).map_err(|reason| LogError::BadFile {
        path: path.to_path_buf(),
        reason,
    })?;
    if !header.encrypted {
        if !keys.is_empty() && !allow_plaintext {
            return Err(LogError::BadFile {
                path: path.to_path_buf(),
                reason: "a plaintext segment in a log that has a key: anyone who can write to the \
                         directory could have put it there. If the log was plaintext before the \
                         key was set, allow it with aal.allow_plaintext: true"
                    .into(),
            });
        }
        return Ok((header, None));
    }
    if keys.is_empty() {
        return Err(LogError::KeyRequired {
            path: path.to_path_buf(),
        });
    }
    for (key_index, key) in keys.iter().enumerate() {
        let mut cipher = derive(key, &header.salt, path)?;
        if cipher.verify_key_check(SegmentHeader::check_aad(&raw), &header.key_check) {
            cipher.key_index = key_index;
            return Ok((header, Some(Arc::new(cipher))));
        }
    }
    Err(LogError::WrongKey {
        path: path.to_path_buf(),
        keys: keys.len(),
    })
}

/// Load a segment: from its index file if that is valid for the segment as it is on disk,
/// else by reading it through (see [`scan`]). Returns whether the index was rebuilt.
/// The segment's index file, if it is whole, authentic (with a key, its MAC) and covers the
/// segment's `file_len` bytes: an open then reads only it, and trusts every batch it lists.
pub(crate) fn valid_index(
    dir: &Path,
    id: u64,
    cipher: Option<&SegmentCipher>,
    file_len: u64,
) -> Result<Option<IndexFile>, LogError> {
    // Missing: read through. Unreadable for another reason (too many open files, EIO) is an
    // error, not a missing index: reading the newest segment through would call its clean
    // close a crash, and every topic's offsets would jump by the crash gap.
    let path = index_path(dir, id);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LogError::io("reading the index", path, e)),
    };
    // With a key, an index must carry a valid MAC; one that does not is read through instead
    // (the batches themselves are authenticated).
    let body = match cipher {
        Some(c) => match bytes
            .split_last_chunk::<{ crate::crypto::INDEX_MAC_LEN }>()
            .filter(|(body, mac)| c.verify_index_mac(body, &mac[..]))
        {
            Some((body, _)) => body,
            None => return Ok(None),
        },
        None => &bytes[..],
    };
    Ok(IndexFile::decode(body)
        .ok()
        .filter(|idx| idx.segment_id == id && idx.covered_len == file_len))
}

pub(crate) fn load(
    dir: &Path,
    path: &Path,
    keys: &[MasterKey],
    allow_plaintext: bool,
    last: bool,
) -> Result<(Scanned, bool), LogError> {
    let file = File::open(path).map_err(|e| LogError::io("opening segment", path, e))?;
    let (header, cipher) = open_header(path, &file, keys, allow_plaintext)?;
    let file_len = file
        .metadata()
        .map_err(|e| LogError::io("reading the size of segment", path, e))?
        .len();
    if let Some(idx) = valid_index(dir, header.id, cipher.as_deref(), file_len)? {
        let segment = Segment::from_index(dir, &header, cipher, idx);
        return Ok((
            Scanned {
                segment,
                torn_bytes: 0,
                degraded: Vec::new(),
            },
            false,
        ));
    }
    let scanned = scan(dir, &file, file_len, &header, cipher, last, &mut |_| {})?;
    Ok((scanned, true))
}

/// Read a whole segment, checking every frame, decrypting every batch and indexing its
/// records. `progress` is called with the bytes read so far.
///
/// Damage is told apart from a torn tail by what follows it: a frame whose CRC fails (or whose
/// length is impossible) is damage if a whole, checked frame with a later batch number follows
/// somewhere after it — the reader skips it and goes on — and a torn tail if nothing checked
/// follows; only a torn tail of the last segment is reported for truncation. A frame whose CRC
/// is right but whose tag fails was written whole and changed since: that is an error
/// ([`LogError::Tampered`]), never damage to skip.
pub(crate) fn scan(
    dir: &Path,
    file: &File,
    file_len: u64,
    header: &SegmentHeader,
    cipher: Option<Arc<SegmentCipher>>,
    last: bool,
    progress: &mut dyn FnMut(u64),
) -> Result<Scanned, LogError> {
    let mut seg = Segment::empty(dir, header, cipher);
    let path = seg.path.clone();
    let mut pos = HEADER_LEN as u64;
    let mut buf = Vec::new();
    // Per topic: last offset seen and the damage count then (to spot jumps across damage).
    let mut seen: HashMap<Vec<u8>, (u64, usize)> = HashMap::new();
    let mut degraded = Vec::new();
    let mut torn_bytes = 0;
    let mut next_batch = 0u64;
    while pos < file_len {
        let check = frame_at(file, pos, file_len, &mut buf)
            .map_err(|e| LogError::io("reading segment", &path, e))?;
        let len = match check {
            FrameCheck::Good { len } => len as u64,
            FrameCheck::Short | FrameCheck::BadLength | FrameCheck::BadCrc { .. } => {
                // Damage or a torn tail: look for a checked frame further on. Without a key a
                // frame's body holds message bodies as publishers sent them, which may look like
                // a whole checked frame: never search inside a body whose length is known — past
                // it for a bad CRC, nowhere for a frame cut short (the rest of the file is in
                // it). With a key, bodies are ciphertext and the search starts at the next byte,
                // which also finds frames after a damaged length.
                let from = match (&seg.cipher, &check) {
                    (None, FrameCheck::BadCrc { len }) => pos + *len as u64,
                    (None, FrameCheck::Short) => file_len,
                    _ => pos + 1,
                };
                match resync(file, from, file_len, file_len, next_batch, &mut buf)
                    .map_err(|e| LogError::io("reading segment", &path, e))?
                {
                    Some(found) => {
                        seg.damage.push((pos, found - pos));
                        pos = found;
                        continue;
                    }
                    None if last => {
                        torn_bytes = file_len - pos;
                        break;
                    }
                    None => {
                        seg.damage.push((pos, file_len - pos));
                        break;
                    }
                }
            }
        };
        let body = &mut buf[FRAME_PREFIX..];
        let bh = BodyHeader::decode(body).ok_or_else(|| LogError::BadFile {
            path: path.clone(),
            reason: format!("frame at byte {pos} is shorter than its header"),
        })?;
        if bh.batch_no < next_batch {
            // A checked frame out of order: copied or moved within the file.
            return Err(LogError::Tampered {
                path: path.clone(),
                position: pos,
            });
        }
        next_batch = bh.batch_no.saturating_add(1);
        let payload_len = match &seg.cipher {
            Some(c) => {
                let aad = batch_aad(seg.id, &body[..BODY_HEADER]);
                c.open(bh.batch_no, &aad, &mut body[BODY_HEADER..])
                    .ok_or_else(|| LogError::Tampered {
                        path: path.clone(),
                        position: pos,
                    })?
            }
            None => body.len() - BODY_HEADER,
        };
        let payload = &body[BODY_HEADER..BODY_HEADER + payload_len];
        match format::decode_records(payload, bh.count) {
            Ok(records) => {
                let damage_now = seg.damage.len();
                for r in records {
                    if r.kind == Kind::Data {
                        if let Some((last_off, damage_then)) = seen.get(r.topic) {
                            if *damage_then != damage_now
                                && Some(r.offset) != last_off.checked_add(1)
                            {
                                degraded.push(String::from_utf8_lossy(r.topic).into_owned());
                            }
                        }
                        seen.insert(r.topic.to_vec(), (r.offset, damage_now));
                    }
                    seg.note(r.kind, r.topic, r.offset, pos);
                }
                seg.note_batch(bh.timestamp_ms, pos + len);
            }
            // Authenticated (or checksummed) but not records: not ours to guess at; skip it.
            Err(_) => {
                seg.damage.push((pos, len));
                seg.len = pos + len;
            }
        }
        pos += len;
        progress(pos);
    }
    if seg.damage.last().is_some_and(|&(p, l)| p + l == file_len) {
        // Damage up to the end of a sealed segment: the segment's length stays the file's, so
        // nothing after the damage is ever overwritten or taken for free space.
        seg.len = file_len;
    }
    degraded.sort();
    degraded.dedup();
    Ok(Scanned {
        segment: seg,
        torn_bytes,
        degraded,
    })
}

/// Read and check the frame at `pos` into `buf` (prefix and body).
pub(crate) fn frame_at(
    file: &File,
    pos: u64,
    file_len: u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<FrameCheck> {
    let avail = file_len.saturating_sub(pos);
    if avail < FRAME_PREFIX as u64 {
        return Ok(FrameCheck::Short);
    }
    let mut prefix = [0u8; FRAME_PREFIX];
    file.read_exact_at(&mut prefix, pos)?;
    let body_len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    if !(BODY_HEADER..=format::MAX_BODY).contains(&body_len) {
        return Ok(FrameCheck::BadLength);
    }
    if avail < (FRAME_PREFIX + body_len) as u64 {
        return Ok(FrameCheck::Short);
    }
    buf.clear();
    buf.resize(FRAME_PREFIX + body_len, 0);
    file.read_exact_at(buf, pos)?;
    Ok(check_frame(buf))
}

/// A resync reads the rest of the file in chunks of this size.
const RESYNC_CHUNK: usize = 1 << 20;

/// Find the next checked frame starting at or after `from` and before `until` whose batch
/// number is `next_batch` or more — at most as many more as the rest of the file could hold
/// frames (a damaged region may swallow any number of them). A candidate must have a plausible
/// length and batch number before its CRC is computed, so the search costs little more than
/// reading the bytes.
/// Batch numbers failed writes may have used up between two written batches, as far as
/// [`resync`] looks.
const BURNED_BATCHES: u64 = 1 << 32;

pub(crate) fn resync(
    file: &File,
    from: u64,
    until: u64,
    file_len: u64,
    next_batch: u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<u64>> {
    let until = until.min(file_len);
    let mut chunk = vec![0u8; (file_len.saturating_sub(from)).min(RESYNC_CHUNK as u64) as usize];
    let mut base = from;
    while base < until && base + (FRAME_PREFIX + BODY_HEADER) as u64 <= file_len {
        let n = (file_len - base).min(RESYNC_CHUNK as u64) as usize;
        file.read_exact_at(&mut chunk[..n], base)?;
        let lookahead = FRAME_PREFIX + 8;
        for i in 0..n.saturating_sub(lookahead - 1) {
            if base + i as u64 >= until {
                return Ok(None);
            }
            let w = &chunk[i..i + lookahead];
            let body_len = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize;
            if !(BODY_HEADER..=format::MAX_BODY).contains(&body_len) {
                continue;
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&w[8..16]);
            let batch = u64::from_le_bytes(b);
            // At most one batch per smallest frame left, plus the numbers failed writes used up
            // (a disk-full episode burns one per refused write; any number fits, while a random
            // u64 falls in the window once in four billion, before its CRC is even computed).
            let most = next_batch
                .saturating_add((file_len - from) / (FRAME_PREFIX + BODY_HEADER) as u64)
                .saturating_add(BURNED_BATCHES);
            if batch < next_batch || batch > most {
                continue;
            }
            let at = base + i as u64;
            if let FrameCheck::Good { .. } = frame_at(file, at, file_len, buf)? {
                return Ok(Some(at));
            }
        }
        // Overlap so a candidate spanning two chunks is seen.
        base += (n - (lookahead - 1).min(n)).max(1) as u64;
    }
    Ok(None)
}
