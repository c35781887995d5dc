//! Reading one topic from an offset: seek with the sparse index, then read forward.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use crate::crypto::SegmentCipher;
use crate::format::HEADER_LEN;
use crate::format::{
    batch_aad, decode_records, BodyHeader, FrameCheck, Kind, BODY_HEADER, FRAME_PREFIX,
};
use crate::segment::{frame_at, resync, valid_index, Segment, Topics, STRIDE};
use crate::LogError;

/// One message read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    /// When its batch was appended (milliseconds since the Unix epoch).
    pub timestamp_ms: u64,
    pub data: Vec<u8>,
}

/// The byte ranges of one segment where the topic's batches start.
#[derive(Debug)]
struct Plan {
    path: PathBuf,
    id: u64,
    len: u64,
    cipher: Option<Arc<SegmentCipher>>,
    damage: Vec<(u64, u64)>,
    /// (first batch position, end: no batch of the topic starts at or after it in this window).
    windows: VecDeque<(u64, u64)>,
    /// A sealed segment's windows are made from its index file when the reader gets to it.
    sealed: bool,
    /// One past the batch number of the last batch read here: a frame found past damage has
    /// this one or a later one.
    next_batch: u64,
}

/// Sealed segments' entry points, read from their index files when a reader gets to the
/// segment (a sealed segment keeps none in memory, see [`Topics`]). The last
/// [`ENTRY_SEGMENTS`] segments read are kept, for a log's readers to share: readers of many
/// topics catching up through the same segments read each index once.
#[derive(Debug, Default)]
pub(crate) struct EntryCache(Mutex<VecDeque<Arc<SegmentEntries>>>);

/// Sealed segments whose entry points an [`EntryCache`] keeps.
const ENTRY_SEGMENTS: usize = 8;

/// A topic's entry points in a segment: (first offset of the topic in a batch, the batch's
/// position).
type EntryPoints = Vec<(u64, u64)>;

/// One sealed segment's entry points, by topic (sorted by name); `None` when its index file
/// is missing, damaged or no longer describes the segment (remembered too: each reader would
/// otherwise try it again; one that failed to read for an I/O error is not kept).
#[derive(Debug)]
struct SegmentEntries {
    id: u64,
    len: u64,
    topics: Option<Vec<(Vec<u8>, EntryPoints)>>,
}

impl EntryCache {
    /// The windows of `plan`'s sealed segment where batches of `topic` from offset `from` on
    /// start. When its index file cannot be read, or no longer describes the segment (gone
    /// with it, or replaced), or has no entry point for the topic, the whole segment is one
    /// window: slower, never less.
    fn windows(&self, plan: &Plan, topic: &[u8], from: u64) -> VecDeque<(u64, u64)> {
        let seg = self.get(plan);
        let entries = seg.topics.as_ref().and_then(|topics| {
            let i = topics
                .binary_search_by(|(name, _)| name[..].cmp(topic))
                .ok()?;
            Some(&topics[i].1).filter(|entries| !entries.is_empty())
        });
        match entries {
            Some(entries) => windows_of(entries, from, plan.len),
            None => VecDeque::from([(HEADER_LEN as u64, plan.len)]),
        }
    }

    fn get(&self, plan: &Plan) -> Arc<SegmentEntries> {
        let kept = |cache: &VecDeque<Arc<SegmentEntries>>| {
            cache
                .iter()
                .find(|s| s.id == plan.id && s.len == plan.len)
                .cloned()
        };
        if let Some(seg) = kept(&self.lock()) {
            return seg;
        }
        // Read without the lock: other readers go on meanwhile (two may read the same index).
        let read = plan
            .path
            .parent()
            .map(|dir| valid_index(dir, plan.id, plan.cipher.as_deref(), plan.len));
        let idx = match read {
            Some(Ok(idx)) => idx,
            // Not read (out of file descriptors, an I/O error): maybe not so for the next
            // reader, so not remembered. This one reads the segment whole.
            _ => {
                return Arc::new(SegmentEntries {
                    id: plan.id,
                    len: plan.len,
                    topics: None,
                })
            }
        };
        let topics = idx.map(|idx| {
            let mut topics: Vec<(Vec<u8>, EntryPoints)> = idx
                .topics
                .into_iter()
                .map(|(name, span)| (name, span.entries))
                .collect();
            topics.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            topics
        });
        let seg = Arc::new(SegmentEntries {
            id: plan.id,
            len: plan.len,
            topics,
        });
        let mut cache = self.lock();
        if let Some(seg) = kept(&cache) {
            return seg;
        }
        if cache.len() >= ENTRY_SEGMENTS {
            cache.pop_front();
        }
        cache.push_back(seg.clone());
        seg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<SegmentEntries>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Segments kept, and how many of them with entry points.
    #[cfg(test)]
    pub(crate) fn segments(&self) -> (usize, usize) {
        let cache = self.lock();
        let read = cache.iter().filter(|s| s.topics.is_some()).count();
        (cache.len(), read)
    }
}

/// The windows to read, from the entry points of a topic in a segment of `len` bytes, for
/// offsets from `from` on: each entry's batch position, up to the next entry or [`STRIDE`]
/// after it.
fn windows_of(entries: &[(u64, u64)], from: u64, len: u64) -> VecDeque<(u64, u64)> {
    let start = entries
        .iter()
        .rposition(|&(offset, _)| offset <= from)
        .unwrap_or(0);
    let entries = &entries[start..];
    entries
        .iter()
        .enumerate()
        .map(|(i, &(_, pos))| {
            let next = entries.get(i + 1).map_or(len, |&(_, p)| p);
            (pos, next.min(pos.saturating_add(STRIDE)).min(len))
        })
        .collect()
}

/// Batches read lately, decrypted and decoded, for readers of several topics to share: a
/// wildcard consumer reading thousands of topics whose messages share batches (a client
/// publishing to many topics in one frame) then reads and decrypts each batch once, not once
/// per topic. Holds the last [`CACHE_BATCHES`] batches read, up to [`CACHE_BYTES`] of frames
/// beyond the last one, and the segment file last opened.
#[derive(Debug)]
pub struct ReadCache {
    file: Option<(u64, File)>,
    /// The frame being read (then its payload, decrypted in place).
    buf: Vec<u8>,
    /// Oldest first.
    batches: VecDeque<Decoded>,
    /// Frame bytes in `batches`.
    bytes: usize,
    max_batches: usize,
}

impl Default for ReadCache {
    fn default() -> Self {
        ReadCache::keeping(CACHE_BATCHES)
    }
}

/// The batches a [`ReadCache`] keeps at most...
pub const CACHE_BATCHES: usize = 64;
/// ...and the frame bytes beyond its last one.
pub const CACHE_BYTES: usize = 1 << 20;

/// One batch as read: where it was, and its data records.
#[derive(Debug)]
struct Decoded {
    segment: u64,
    pos: u64,
    batch_no: u64,
    frame_len: u64,
    timestamp_ms: u64,
    payload: Vec<u8>,
    /// Its data records' (topic, offset, data), as ranges of `payload` (the whole frame, its
    /// payload decrypted), in batch order.
    records: Vec<(Range<usize>, u64, Range<usize>)>,
    /// `records`' indexes sorted by topic (then batch order), made when a second reader reads
    /// the batch: readers of the many topics of one batch then find theirs without walking
    /// all of them (a reader of one topic reads each batch once, and walks it).
    by_topic: Option<Vec<u32>>,
}

impl Decoded {
    /// The indexes in `records` of `topic`'s records, in batch order (sorting them first).
    fn sorted_of(&mut self, topic: &[u8]) -> &[u32] {
        let records = &self.records;
        let payload = &self.payload;
        let sorted = self.by_topic.get_or_insert_with(|| {
            let mut sorted: Vec<u32> = (0..records.len() as u32).collect();
            // Stable: a topic's records stay in batch (offset) order.
            sorted.sort_by(|&a, &b| {
                payload[records[a as usize].0.clone()].cmp(&payload[records[b as usize].0.clone()])
            });
            sorted
        });
        let key = |i: &u32| &payload[records[*i as usize].0.clone()];
        let start = sorted.partition_point(|i| key(i) < topic);
        let len = sorted[start..]
            .iter()
            .take_while(|i| key(i) == topic)
            .count();
        &sorted[start..start + len]
    }
}

impl ReadCache {
    fn keeping(max_batches: usize) -> ReadCache {
        ReadCache {
            file: None,
            buf: Vec::new(),
            batches: VecDeque::new(),
            bytes: 0,
            max_batches: max_batches.max(1),
        }
    }

    /// Close the segment file it holds open (it is opened again when needed).
    pub fn close_file(&mut self) {
        self.file = None;
    }

    fn find(&self, segment: u64, pos: u64) -> Option<usize> {
        self.batches
            .iter()
            .rposition(|b| b.segment == segment && b.pos == pos)
    }

    /// Keep `d` as the newest, dropping the oldest beyond its limits (their buffers are
    /// reused for the next read).
    fn keep(&mut self, d: Decoded) -> usize {
        self.bytes += d.payload.len();
        self.batches.push_back(d);
        while self.batches.len() > self.max_batches
            || (self.batches.len() > 1 && self.bytes > CACHE_BYTES + self.newest_len())
        {
            if let Some(old) = self.batches.pop_front() {
                self.bytes -= old.payload.len();
                if old.payload.capacity() > self.buf.capacity() {
                    self.buf = old.payload;
                }
            }
        }
        self.batches.len() - 1
    }

    fn newest_len(&self) -> usize {
        self.batches.back().map_or(0, |b| b.payload.len())
    }
}

/// The messages of one topic from an offset on, as the log held them when the reader was
/// made. Reads only the index's windows for the topic: a topic that is rare in a busy log costs
/// about one [`STRIDE`] of reading per index entry, not the whole segment.
#[derive(Debug)]
pub struct Reader {
    topic: Vec<u8>,
    next: u64,
    plans: VecDeque<Plan>,
    ready: VecDeque<Record>,
    /// Where sealed segments' entry points are read.
    entries: Arc<EntryCache>,
    /// For reading on its own (as an iterator).
    own: ReadCache,
}

impl Reader {
    /// Plans for the segments that hold `topic` at `from` or later; a sealed segment's windows
    /// are left for when the reader gets to it (no file is read here, under the index's lock).
    pub(crate) fn new(
        segments: &[Segment],
        entries: &Arc<EntryCache>,
        topic: &[u8],
        from: u64,
    ) -> Reader {
        let mut plans = VecDeque::new();
        for seg in segments {
            match seg.topics.get(topic).and_then(|span| span.data) {
                Some((_, last)) if last >= from => {}
                _ => continue,
            }
            let (windows, sealed) = match &seg.topics {
                Topics::Live(live) => match live.get(topic) {
                    Some(span) => (windows_of(&span.entries, from, seg.len), false),
                    None => continue,
                },
                Topics::Sealed(_) => (VecDeque::new(), true),
            };
            plans.push_back(Plan {
                path: seg.path.clone(),
                id: seg.id,
                len: seg.len,
                cipher: seg.cipher.clone(),
                damage: seg.damage.clone(),
                windows,
                sealed,
                next_batch: 0,
            });
        }
        Reader {
            topic: topic.to_vec(),
            next: from,
            plans,
            ready: VecDeque::new(),
            entries: entries.clone(),
            // On its own, a reader reads each batch once: it needs none but the last.
            own: ReadCache::keeping(1),
        }
    }

    /// Make the windows of the sealed segment of `plan`, from the reader's next offset on.
    fn unseal(&mut self, plan: usize) {
        let Some(p) = self.plans.get(plan).filter(|p| p.sealed) else {
            return;
        };
        let windows = self.entries.windows(p, &self.topic, self.next);
        if let Some(p) = self.plans.get_mut(plan) {
            p.windows = windows;
            p.sealed = false;
        }
    }

    /// Where in the log it reads first: (segment id, byte position), `None` if it has nothing
    /// to read. Readers of several topics sharing a [`ReadCache`] read best in this order.
    /// May read a sealed segment's index file.
    pub fn position(&mut self) -> Option<(u64, u64)> {
        for i in 0..self.plans.len() {
            self.unseal(i);
            if let Some(&(pos, _)) = self.plans[i].windows.front() {
                return Some((self.plans[i].id, pos));
            }
        }
        None
    }

    /// The next message, reading through `cache` (shared with other readers).
    pub fn next_with(&mut self, cache: &mut ReadCache) -> Option<Result<Record, LogError>> {
        loop {
            if let Some(r) = self.ready.pop_front() {
                return Some(Ok(r));
            }
            match self.advance(cache) {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Read the next batch of the current window into `ready`. Returns false when the reader
    /// has nothing left to read.
    fn advance(&mut self, cache: &mut ReadCache) -> Result<bool, LogError> {
        self.unseal(0);
        let Some(plan) = self.plans.front_mut() else {
            return Ok(false);
        };
        let Some(&(pos, end)) = plan.windows.front() else {
            self.plans.pop_front();
            return Ok(true);
        };
        if pos >= end {
            plan.windows.pop_front();
            return Ok(true);
        }
        if let Some(&(_, len)) = plan.damage.iter().find(|&&(p, _)| p == pos) {
            plan.windows[0].0 = pos.saturating_add(len.max(1));
            return Ok(true);
        }
        // Read just now: walked (the only reader of a batch never sorts it).
        let (at, walk) = match cache.find(plan.id, pos) {
            Some(at) => (at, false),
            None => {
                let d = read_batch(plan, pos, cache)?;
                (cache.keep(d), true)
            }
        };
        let d = &mut cache.batches[at];
        plan.windows[0].0 = pos + d.frame_len;
        // Read by another reader first (a shared cache): its number counts here too.
        plan.next_batch = plan.next_batch.max(d.batch_no.saturating_add(1));
        let mut take = |d: &Decoded, i: usize| {
            let (_, offset, data) = &d.records[i];
            if *offset >= self.next {
                self.next = offset.saturating_add(1);
                self.ready.push_back(Record {
                    offset: *offset,
                    timestamp_ms: d.timestamp_ms,
                    data: d.payload[data.clone()].to_vec(),
                });
            }
        };
        if walk {
            for (i, (topic, ..)) in d.records.iter().enumerate() {
                if d.payload[topic.clone()] == *self.topic {
                    take(d, i);
                }
            }
        } else {
            let ours = d.sorted_of(&self.topic).to_vec();
            for i in ours {
                take(d, i as usize);
            }
        }
        Ok(true)
    }
}

/// Read, check, decrypt and decode the batch at `pos` of `plan`'s segment. An error gives up
/// what it must (the segment, the window, or just the batch) in `plan`.
fn read_batch(plan: &mut Plan, pos: u64, cache: &mut ReadCache) -> Result<Decoded, LogError> {
    let file = match &mut cache.file {
        Some((id, f)) if *id == plan.id => f,
        other => match File::open(&plan.path) {
            Ok(f) => &mut other.insert((plan.id, f)).1,
            Err(e) => {
                // Gone (deleted by retention since): nothing more to read there. The reader
                // moves on to its next plan.
                let path = plan.path.clone();
                plan.windows.clear();
                return Err(LogError::io("opening segment", path, e));
            }
        },
    };
    let buf = &mut cache.buf;
    let check = match frame_at(file, pos, plan.len, buf) {
        Ok(c) => c,
        Err(e) => {
            // Not again and again: this window is given up.
            let path = plan.path.clone();
            plan.windows.pop_front();
            return Err(LogError::io("reading segment", path, e));
        }
    };
    let len = match check {
        FrameCheck::Good { len } => len,
        bad => {
            let path = plan.path.clone();
            // Where reading goes on: past the batch if its length still reads; otherwise at the
            // next checked frame in this window, searched for as the segment's open does (not
            // inside a plaintext body, which may hold anything) — or the next window.
            let resume = match (&plan.cipher, bad) {
                (_, FrameCheck::BadCrc { len }) => Some(pos.saturating_add(len as u64)),
                (None, FrameCheck::Short) => None,
                _ => {
                    let end = plan.windows[0].1;
                    resync(file, pos + 1, end, plan.len, plan.next_batch, buf)
                        .ok()
                        .flatten()
                }
            };
            match resume {
                Some(at) => plan.windows[0].0 = at,
                None => {
                    plan.windows.pop_front();
                }
            }
            return Err(LogError::Damaged {
                path,
                position: pos,
                reason: "the batch's checksum fails (damaged since it was indexed)".into(),
            });
        }
    };
    // Whatever follows, this batch is done with.
    plan.windows[0].0 = pos + len as u64;
    let body = &mut buf[FRAME_PREFIX..];
    let damaged = |reason: &str| LogError::Damaged {
        path: plan.path.clone(),
        position: pos,
        reason: reason.into(),
    };
    let header = BodyHeader::decode(body).ok_or_else(|| damaged("short batch"))?;
    let payload_len = match &plan.cipher {
        Some(c) => {
            let aad = batch_aad(plan.id, &body[..BODY_HEADER]);
            c.open(header.batch_no, &aad, &mut body[BODY_HEADER..])
                .ok_or_else(|| LogError::Tampered {
                    path: plan.path.clone(),
                    position: pos,
                })?
        }
        None => body.len() - BODY_HEADER,
    };
    // Its number is the key's word now (or, without one, the CRC's).
    plan.next_batch = header.batch_no.saturating_add(1);
    // Ranges of the whole frame's buffer, which the cache keeps as it is.
    let frame = &buf[..];
    let start = FRAME_PREFIX + BODY_HEADER;
    let at = |part: &[u8]| {
        let from = part.as_ptr() as usize - frame.as_ptr() as usize;
        from..from + part.len()
    };
    let records = decode_records(&frame[start..start + payload_len], header.count)
        .map_err(|e| damaged(&e))?
        .into_iter()
        .filter(|r| r.kind == Kind::Data)
        .map(|r| (at(r.topic), r.offset, at(r.data)))
        .collect();
    Ok(Decoded {
        segment: plan.id,
        pos,
        batch_no: header.batch_no,
        frame_len: len as u64,
        timestamp_ms: header.timestamp_ms,
        payload: std::mem::take(&mut cache.buf),
        records,
        by_topic: None,
    })
}

impl Iterator for Reader {
    type Item = Result<Record, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut own = std::mem::take(&mut self.own);
        let next = self.next_with(&mut own);
        self.own = own;
        next
    }
}
