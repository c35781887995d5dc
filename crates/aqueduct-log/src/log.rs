//! The log: opening (recovery), appending, syncing, rotation, retention and truncation.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::crypto::MasterKey;
use crate::format::{
    batch_aad, encode_record, finish_frame, record_len, start_frame, BodyHeader, Kind, BODY_HEADER,
    FRAME_PREFIX, HEADER_LEN, MAX_BODY,
};
use crate::reader::{EntryCache, Reader};
use crate::segment::{self, index_path, segment_path, sync_dir, Segment};
use crate::LogError;

/// When appended batches are flushed to the disk (`aal.fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// Every [`Log::commit`] syncs; the broker commits after every publish frame.
    Always,
    /// Every [`Log::commit`] syncs; the broker gathers what arrives meanwhile into one append
    /// (a group commit), so one sync covers many publishers.
    Batch,
    /// [`Log::commit`] syncs when the last sync is at least this old.
    Interval(Duration),
    /// Never synced by the log; the operating system writes back when it likes.
    Never,
}

/// How to open a log.
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// Seal batches with AES-256-GCM under keys derived from this one; `None`: plaintext.
    pub key: Option<MasterKey>,
    /// Keys the log was sealed with before `key` (a rotated master key): segments sealed with
    /// one of them are still read, with it; every new segment is sealed with `key`. A key is
    /// needed as long as a segment sealed with it is kept ([`Recovery::previous_key_segments`]
    /// says how many are left). Ignored without `key`.
    pub previous_keys: Vec<MasterKey>,
    /// With a key, still read plaintext segments (a log that was plaintext before the key was
    /// set); otherwise one is refused, as anyone who can write to the directory could add it.
    pub allow_plaintext: bool,
    /// A segment is sealed and a new one started before it would grow past this many bytes
    /// (`aal.max_aal_size`). A single batch larger than this gets a segment to itself.
    pub max_segment_bytes: u64,
    /// Delete the oldest sealed segments while all segments together are larger than this.
    pub retention_bytes: Option<u64>,
    /// Delete sealed segments whose newest batch is older than this.
    pub retention_age: Option<Duration>,
    pub fsync: FsyncMode,
    /// After a crash, each topic's offsets go on this far past its last logged offset: the
    /// broker promises that fewer offsets than this per topic are handed out and not yet
    /// written, so none handed out before the crash is handed out again.
    pub crash_offset_gap: u64,
}

impl LogOptions {
    /// The keys a segment may be sealed with: `key`, then `previous_keys`; none without `key`.
    fn keys(&self) -> Vec<MasterKey> {
        match &self.key {
            Some(key) => std::iter::once(key)
                .chain(&self.previous_keys)
                .cloned()
                .collect(),
            None => Vec::new(),
        }
    }
}

/// Per previous key of `opts`: how many of `segments` are sealed with it.
fn previous_key_segments(segments: &[Segment], opts: &LogOptions) -> Vec<usize> {
    let mut counts = vec![
        0;
        if opts.key.is_some() {
            opts.previous_keys.len()
        } else {
            0
        }
    ];
    for s in segments {
        if let Some(n) = s
            .cipher
            .as_deref()
            .and_then(|c| c.previous_key(&mut counts))
        {
            *n += 1;
        }
    }
    counts
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            key: None,
            previous_keys: Vec::new(),
            allow_plaintext: false,
            max_segment_bytes: 100 * 1024 * 1024,
            retention_bytes: None,
            retention_age: None,
            fsync: FsyncMode::Batch,
            crash_offset_gap: 1 << 20,
        }
    }
}

/// One message to append.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub topic: &'a [u8],
    pub offset: u64,
    pub data: &'a [u8],
}

/// A place in the log: the end of a batch (segment id, byte in that segment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub segment: u64,
    pub byte: u64,
}

/// What opening the log found and did, for the startup log line and metrics.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// The previous run closed the log cleanly.
    pub clean: bool,
    pub segments: usize,
    pub topics: usize,
    pub bytes: u64,
    /// Segments whose index was missing, stale or damaged, and were read through instead.
    pub rebuilt_indexes: usize,
    /// Bytes cut from the end of the last segment: a write torn by the crash.
    pub truncated_bytes: u64,
    /// Empty segment files left by a crash during their creation, removed.
    pub removed_empty_segments: usize,
    /// Damaged batches in the log (skipped by readers, kept on disk).
    pub damaged_batches: usize,
    /// Topics whose offsets jump across a damaged batch found by this open.
    pub degraded_topics: Vec<String>,
    /// The newest segment file, if it held only a header that could not be read (a crash while
    /// it was created): moved aside to this path (`<id>.seg.unreadable`), with the reason.
    pub unreadable_segments: Vec<(PathBuf, String)>,
    /// Per previous key ([`LogOptions::previous_keys`], in order): the segments still sealed
    /// with it. A key whose count is 0 is no longer needed.
    pub previous_key_segments: Vec<usize>,
    pub elapsed: Duration,
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    pub segments: u64,
    pub bytes: u64,
    /// Topics whose offsets the log keeps: those with messages or marks in it (a topic
    /// retention emptied is kept in a mark unless it was forgotten: see `next_offset`).
    pub topics: u64,
    pub deleted_segments: u64,
    /// Topics retention emptied and the log then forgot (see
    /// [`Log::enforce_retention_forgetting`]).
    pub forgotten_topics: u64,
    pub truncated_bytes: u64,
    pub damaged_batches: u64,
    pub appended_batches: u64,
    pub appended_records: u64,
    pub syncs: u64,
    pub write_errors: u64,
    /// Segments sealed with a key of [`LogOptions::previous_keys`]: at 0, none is needed.
    pub previous_key_segments: u64,
}

/// The name the log keeps its *offset floor* under, as a mark: a topic it does not know (never
/// logged, or forgotten, see [`Log::enforce_retention_forgetting`]) starts past it. No topic
/// can have this name (topic names contain no NUL, docs/protocol.md §3); it is never listed
/// among the log's topics, and data appended under it is refused.
pub const FLOOR_TOPIC: &[u8] = b"\0floor";

/// Who says which topics retention may forget ([`Log::enforce_retention_forgetting`]): for a
/// broker, those it holds no state for and no consumer has a position in. Two steps, so that
/// the log raises its offset floor (a mark, synced) only for topics that will likely be
/// forgotten, and before any is.
pub trait Forget {
    /// Of `emptied` (the topics retention is about to empty), those that may be forgotten as
    /// far as can be said now. Nothing is forgotten yet.
    fn choose(&mut self, emptied: &[Box<[u8]>]) -> Vec<Box<[u8]>>;
    /// Forget what of `chosen` can still be forgotten, and return it. The log's offset floor
    /// is now `floor`, on disk: past every offset the chosen topics had, and where a topic the
    /// log does not know starts.
    fn forget(&mut self, chosen: &[Box<[u8]>], floor: u64) -> Vec<Box<[u8]>>;
}

/// Where a topic's offsets stand.
#[derive(Debug, Clone, Copy)]
struct TopicState {
    /// Highest offset logged (marks included).
    high: u64,
    /// The segment holding `high`.
    high_segment: u64,
    /// That segment's `unclean_before`.
    unclean_at_high: u32,
}

/// What readers need of the log's segments, shared with the log's owner: readers on other
/// threads take a snapshot of one topic's plan under the read lock (see [`LogIndex::read`]);
/// the owner takes the write lock to note each appended batch. Sealed segments' entry points
/// are read from their index files, through a cache the clones share. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct LogIndex {
    segments: Arc<RwLock<Vec<Segment>>>,
    entries: Arc<EntryCache>,
}

impl LogIndex {
    fn new(segments: Vec<Segment>) -> LogIndex {
        LogIndex {
            segments: Arc::new(RwLock::new(segments)),
            entries: Arc::default(),
        }
    }

    fn get(&self) -> RwLockReadGuard<'_, Vec<Segment>> {
        self.segments.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn get_mut(&self) -> RwLockWriteGuard<'_, Vec<Segment>> {
        self.segments
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Read `topic` from offset `from` on: what the log holds now (a reader made later sees
    /// more).
    pub fn read(&self, topic: &[u8], from: u64) -> Reader {
        Reader::new(&self.get(), &self.entries, topic, from)
    }

    /// Every topic with messages in the log, sorted.
    pub fn topics(&self) -> Vec<Vec<u8>> {
        topics_of(&self.get())
    }

    /// Where a reader of `topic` from `from` reads first (segment id, byte position), as
    /// [`Reader::position`] says. May read a sealed segment's index file.
    pub fn position(&self, topic: &[u8], from: u64) -> Option<(u64, u64)> {
        // The first segment's plan only (a reader plans every segment holding the topic);
        // the file, if any, is read after the lock is let go.
        let mut first = {
            let segments = self.get();
            let i = first_of(&segments, topic, from)?;
            Reader::new(&segments[i..=i], &self.entries, topic, from)
        };
        // A segment whose windows came out empty has nothing to read: the whole plan then.
        first
            .position()
            .or_else(|| self.read(topic, from).position())
    }

    /// The segment a reader of `topic` from `from` reads first, reading no file: to order
    /// calls to [`position`](Self::position) so that topics starting in the same segment are
    /// looked up together, from one read of its index file.
    pub fn first_segment(&self, topic: &[u8], from: u64) -> Option<u64> {
        let segments = self.get();
        first_of(&segments, topic, from).map(|i| segments[i].id)
    }

    /// The highest offset of a message of `topic` still in the log.
    pub fn last_offset(&self, topic: &[u8]) -> Option<u64> {
        self.get()
            .iter()
            .rev()
            .find_map(|s| s.topics.get(topic).and_then(|span| span.data))
            .map(|(_, last)| last)
    }

    /// The lowest offset of a message of `topic` still in the log.
    pub fn first_offset(&self, topic: &[u8]) -> Option<u64> {
        self.get()
            .iter()
            .find_map(|s| s.topics.get(topic).and_then(|span| span.data))
            .map(|(first, _)| first)
    }
}

/// The index of the first of `segments` holding a message of `topic` at `from` or later.
fn first_of(segments: &[Segment], topic: &[u8], from: u64) -> Option<usize> {
    segments.iter().position(|s| {
        s.topics
            .get(topic)
            .and_then(|span| span.data)
            .is_some_and(|(_, last)| last >= from)
    })
}

fn topics_of(segments: &[Segment]) -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = segments
        .iter()
        .flat_map(|s| {
            s.topics
                .iter()
                .filter(|(_, span)| span.data.is_some())
                .map(|(name, _)| name.to_vec())
        })
        .collect();
    t.sort();
    t.dedup();
    t
}

/// The append-only log. One owner appends; [`Log::read`] (or a [`LogIndex`] from
/// [`Log::index`], on any thread) hands out readers that own what they need.
#[derive(Debug)]
pub struct Log {
    dir: PathBuf,
    opts: LogOptions,
    /// Oldest first; the last one is the active segment.
    segments: LogIndex,
    active: File,
    topics: HashMap<Box<[u8]>, TopicState>,
    /// Crashed generations before this run (this run's segments' `unclean_before`).
    unclean_now: u32,
    generation: u64,
    buf: Vec<u8>,
    dirty: bool,
    /// Records appended since the last sync: under `interval` and `never` the log syncs anyway
    /// once they reach a quarter of `crash_offset_gap` (see [`Log::commit`]).
    unsynced_records: u64,
    last_sync: Instant,
    poisoned: Option<String>,
    /// Per topic, the highest offset of appends that failed after their offsets were checked:
    /// the broker handed those offsets out (its subscribers may have them), so they are written
    /// as marks before anything else (see [`Log::flush_burned`]).
    burned: HashMap<Box<[u8]>, u64>,
    /// The last retention pass that raised the offset floor: where unknown topics started
    /// before it, and the topics it forgot; until [`Log::end_forget_grace`] (see
    /// [`Log::enforce_retention_forgetting`]).
    last_forget: Option<(u64, std::collections::HashSet<Box<[u8]>>)>,
    stats: LogStats,
    /// `LOCK` in the directory, locked while this log is open: a second broker on the same
    /// directory is refused instead of truncating what this one writes.
    _lock: File,
}

/// Create `dir` (and its parents) if missing; one this creates is readable by its owner only
/// (0700 on Unix), as the messages in a log without a key are plain text. An existing one is
/// left as it is.
fn create_private_dir(dir: &Path) -> Result<(), LogError> {
    create_private_dir_syncing(dir, sync_dir)
}

/// [`create_private_dir`], with `sync` syncing a directory. Each missing level is made on its
/// own and its parent synced after it: a new directory's entry is durable once its parent is
/// synced, and syncing only the last level's parent could lose, in a power cut, a first run's
/// whole log directory (`~/.aqueduct` new, then `~/.aqueduct/aal`: `$HOME` was never synced).
fn create_private_dir_syncing(
    dir: &Path,
    mut sync: impl FnMut(&Path) -> Result<(), LogError>,
) -> Result<(), LogError> {
    let mut missing = Vec::new();
    let mut level = Some(dir);
    while let Some(d) = level.filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        missing.push(d);
        level = d.parent();
    }
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    for d in missing.into_iter().rev() {
        match builder.create(d) {
            Ok(()) => {}
            // Made meanwhile (another process): it is there, and its maker syncs it.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => continue,
            Err(e) => return Err(LogError::io("creating", d, e)),
        }
        match d.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => sync(parent)?,
            None => sync(Path::new("."))?,
        }
    }
    Ok(())
}

/// The lock file's name in the log directory.
pub const LOCK_FILE: &str = "LOCK";

/// Take the directory's lock (an advisory `flock`, released when the process ends, however).
pub(crate) fn lock_dir(dir: &Path) -> Result<File, LogError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| LogError::io("creating the lock file", &path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(LogError::Locked { path }),
        Err(std::fs::TryLockError::Error(e)) => Err(LogError::io("locking", &path, e)),
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The segment files in `dir`, by id (oldest first). Temporary index and segment files (left by
/// a crash while one was written, or re-sealed by [`crate::rekey()`]) are removed.
pub(crate) fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, LogError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LogError::io("listing", dir, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".idx.tmp") || name.ends_with(".seg.tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    list_segments_read_only(dir)
}

impl Log {
    /// Open (or create) the log in `dir`: load every segment (from its index, or by reading it
    /// through after a crash), truncate a torn tail, and start a new active segment.
    pub fn open(dir: impl Into<PathBuf>, opts: LogOptions) -> Result<(Log, Recovery), LogError> {
        let started = Instant::now();
        let dir = dir.into();
        create_private_dir(&dir)?;
        let lock = lock_dir(&dir)?;
        let files = list_segments(&dir)?;
        let mut rec = Recovery::default();
        let mut segments: Vec<Segment> = Vec::new();
        let mut next_id = 0;
        // The previous run ended without a clean close, whatever its last index file says.
        let mut crash_evidence = false;
        // Rebuilt indexes, written only once the new active segment exists: damage found by
        // reading a segment through is crash evidence only while it has no index, and the new
        // segment's header is what counts the crash. An index written before it, by a start
        // that then died, left the next start without that evidence, and offsets the damaged
        // batches held could be handed out again.
        let mut index_later = Vec::new();
        let mut seal_order = segment::SealOrder::default();
        for (i, (id, path)) in files.iter().enumerate() {
            next_id = next_id.max(id.checked_add(1).ok_or_else(|| LogError::BadFile {
                path: path.clone(),
                reason: "segment id too large: no segment can follow it".into(),
            })?);
            let last = i + 1 == files.len();
            let loaded = segment::load(&dir, path, &opts.keys(), opts.allow_plaintext, last);
            let (scanned, rebuilt) = match loaded {
                Ok(s) => s,
                Err(LogError::BadFile { .. }) if last && short_or_blank(path) => {
                    // A crash while the segment was being created: nothing was ever in it. The
                    // run that created it did not close cleanly.
                    std::fs::remove_file(path)
                        .map_err(|e| LogError::io("removing empty segment", path, e))?;
                    let _ = std::fs::remove_file(index_path(&dir, *id));
                    rec.removed_empty_segments += 1;
                    crash_evidence = true;
                    continue;
                }
                Err(LogError::BadFile { reason, .. })
                    if last
                        && std::fs::metadata(path).is_ok_and(|m| m.len() <= HEADER_LEN as u64) =>
                {
                    // The newest segment holds a damaged header and nothing else (a crash while
                    // writing it): moved aside (`<id>.seg.unreadable`, kept for inspection; left
                    // among the segments it would be an unreadable *older* one at the next
                    // open, which refuses to start), and the run counts as crashed. One with
                    // batches after a bad header is damage, refused below like an older one.
                    let aside = path.with_extension("seg.unreadable");
                    std::fs::rename(path, &aside).map_err(|e| {
                        LogError::io("moving aside the unreadable segment", path, e)
                    })?;
                    let _ = std::fs::remove_file(index_path(&dir, *id));
                    rec.unreadable_segments.push((aside, reason));
                    crash_evidence = true;
                    continue;
                }
                Err(LogError::BadFile { path, reason }) => {
                    // An older segment that cannot be read at all would take the highest offsets
                    // of its topics with it, and they would be handed out again: refuse.
                    return Err(LogError::BadFile {
                        path,
                        reason: format!(
                            "{reason}; this segment cannot be read, and without it offsets it \
                             holds could be handed out again. Restore it from a backup, or move it \
                             out of the log directory to start without it (its messages are then \
                             lost, and its topics' offsets may repeat)"
                        ),
                    });
                }
                Err(e) => return Err(e),
            };
            let mut seg = scanned.segment;
            if seg.id != *id {
                // Renamed, or restored under another name: it would be read, sealed and deleted
                // under the name its header gives, not its own.
                return Err(LogError::BadFile {
                    path: path.clone(),
                    reason: format!(
                        "its header says it is segment {}: give it back its name, {}",
                        seg.id,
                        segment_path(&dir, seg.id).display()
                    ),
                });
            }
            seal_order.next(path, seg.cipher.is_some())?;
            if rebuilt && !seg.damage.is_empty() {
                // Damage found by reading through: what the damaged batches held is unknown,
                // maybe a topic's highest offsets. Go on past them as after a crash (each topic
                // skips the crash gap), or those offsets could be handed out again.
                crash_evidence = true;
            }
            if scanned.torn_bytes > 0 {
                let f = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| LogError::io("opening segment", path, e))?;
                f.set_len(seg.len)
                    .and_then(|()| f.sync_all())
                    .map_err(|e| LogError::io("truncating the torn tail of", path, e))?;
                rec.truncated_bytes += scanned.torn_bytes;
            }
            if rebuilt {
                rec.rebuilt_indexes += 1;
                // Sealed normally only if it was not the last segment of the run that crashed.
                seg.clean = !last;
                index_later.push(segments.len());
            }
            rec.degraded_topics.extend(scanned.degraded);
            segments.push(seg);
        }
        if rec.removed_empty_segments > 0 || rec.truncated_bytes > 0 {
            sync_dir(&dir)?;
        }
        let (generation, unclean_now, clean) = match segments.last() {
            None => (1, 0, true),
            Some(last) => {
                let crashed = !last.clean || crash_evidence;
                (
                    segments
                        .iter()
                        .map(|s| s.generation)
                        .max()
                        .unwrap_or(0)
                        .saturating_add(1),
                    last.unclean_before.saturating_add(u32::from(crashed)),
                    !crashed,
                )
            }
        };
        rec.clean = clean;
        #[cfg(test)]
        if tests::FAIL_BEFORE_ACTIVE.with(std::cell::Cell::get) {
            return Err(LogError::io(
                "creating the active segment",
                &dir,
                std::io::Error::other("injected by a test"),
            ));
        }
        let (active_seg, active) = Segment::create(
            &dir,
            next_id,
            generation,
            unclean_now,
            opts.key.as_ref(),
            now_ms(),
        )?;
        segments.push(active_seg);
        sync_dir(&dir)?;
        if !index_later.is_empty() {
            for &i in &index_later {
                segments[i].write_index(&dir)?;
                segments[i].seal();
            }
            sync_dir(&dir)?;
        }
        let mut log = Log {
            dir,
            opts,
            segments: LogIndex::new(segments),
            active,
            topics: HashMap::new(),
            unclean_now,
            generation,
            buf: Vec::new(),
            dirty: false,
            unsynced_records: 0,
            last_sync: Instant::now(),
            poisoned: None,
            burned: HashMap::new(),
            last_forget: None,
            stats: LogStats::default(),
            _lock: lock,
        };
        log.rebuild_topics();
        rec.segments = log.segments.get().len();
        rec.topics = log.topic_count();
        rec.bytes = log.bytes();
        rec.damaged_batches = log.segments.get().iter().map(|s| s.damage.len()).sum();
        rec.previous_key_segments = previous_key_segments(&log.segments.get(), &log.opts);
        log.stats.truncated_bytes = rec.truncated_bytes;
        log.stats.damaged_batches = rec.damaged_batches as u64;
        rec.elapsed = started.elapsed();
        Ok((log, rec))
    }

    fn rebuild_topics(&mut self) {
        self.topics.clear();
        let segments = self.segments.get();
        for seg in segments.iter() {
            for (name, span) in seg.topics.iter() {
                let state = TopicState {
                    high: span.high,
                    high_segment: seg.id,
                    unclean_at_high: seg.unclean_before,
                };
                // Segments go oldest first: on a tie the newer segment holds the high.
                match self.topics.get_mut(name) {
                    Some(t) if t.high > span.high => {}
                    Some(t) => *t = state,
                    None => {
                        self.topics.insert(name.into(), state);
                    }
                }
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Something of the active segment (the last one; `open` always makes one and nothing
    /// removes it).
    fn active<T>(&self, f: impl FnOnce(&Segment) -> T) -> Result<T, LogError> {
        self.segments
            .get()
            .last()
            .map(f)
            .ok_or_else(|| LogError::InvalidAppend("no active segment".into()))
    }

    /// The index readers on other threads use.
    pub fn index(&self) -> LogIndex {
        self.segments.clone()
    }

    fn bytes(&self) -> u64 {
        self.segments.get().iter().map(|s| s.len).sum()
    }

    /// The offset the next message of `topic` must have at least: one past its highest logged
    /// offset — plus `crash_offset_gap` for every crash since that offset was logged. A topic
    /// the log does not know (never logged, or forgotten) starts at
    /// [`new_topic_offset`](Self::new_topic_offset).
    pub fn next_offset(&self, topic: &[u8]) -> u64 {
        match self.topics.get(topic) {
            Some(t) => self.next_of(t),
            None => self.new_topic_offset(),
        }
    }

    /// One past the highest offset logged for `topic` (a message or a mark), with no crash
    /// gap: where what the log holds of it ends. `None` for a topic it does not know.
    pub fn logged_end(&self, topic: &[u8]) -> Option<u64> {
        self.topics.get(topic).map(|t| t.high.saturating_add(1))
    }

    fn next_of(&self, t: &TopicState) -> u64 {
        t.high
            .saturating_add(1)
            .saturating_add(self.opts.crash_offset_gap.saturating_mul(u64::from(
                self.unclean_now.saturating_sub(t.unclean_at_high),
            )))
    }

    /// The lowest offset an append of `topic` may have: [`next_offset`](Self::next_offset), but
    /// for a topic the log does not know and the last retention pass did not forget, the
    /// offset floor as it was before that pass, until [`end_forget_grace`](Self::end_forget_grace)
    /// (its first offset may have been handed out then: see
    /// [`enforce_retention_forgetting`](Self::enforce_retention_forgetting)).
    fn lowest_next(&self, topic: &[u8]) -> u64 {
        match self.topics.get(topic) {
            Some(t) => self.next_of(t),
            None => match &self.last_forget {
                Some((before, forgotten)) if !forgotten.contains(topic) => *before,
                _ => self.new_topic_offset(),
            },
        }
    }

    /// Where a topic the log does not know starts (what [`next_offset`](Self::next_offset)
    /// answers for it): past the gaps of earlier crashes, and past the offset floor, which
    /// covers every topic the log forgot.
    pub fn new_topic_offset(&self) -> u64 {
        let after_crashes = self
            .opts
            .crash_offset_gap
            .saturating_mul(u64::from(self.unclean_now));
        match self.topics.get(FLOOR_TOPIC) {
            Some(floor) => after_crashes.max(self.next_of(floor)),
            None => after_crashes,
        }
    }

    /// The highest offset of a message of `topic` still in the log.
    pub fn last_offset(&self, topic: &[u8]) -> Option<u64> {
        self.segments.last_offset(topic)
    }

    /// The lowest offset of a message of `topic` still in the log.
    pub fn first_offset(&self, topic: &[u8]) -> Option<u64> {
        self.segments.first_offset(topic)
    }

    /// Every topic with state in the log.
    pub fn topics(&self) -> impl Iterator<Item = &[u8]> {
        self.topics
            .keys()
            .map(|k| &**k)
            .filter(|k| *k != FLOOR_TOPIC)
    }

    /// How many topics [`topics`](Self::topics) lists.
    fn topic_count(&self) -> usize {
        self.topics.len() - usize::from(self.topics.contains_key(FLOOR_TOPIC))
    }

    pub fn stats(&self) -> LogStats {
        LogStats {
            segments: self.segments.get().len() as u64,
            bytes: self.bytes(),
            topics: self.topic_count() as u64,
            previous_key_segments: self
                .segments
                .get()
                .iter()
                .filter(|s| s.cipher.as_ref().is_some_and(|c| c.key_index > 0))
                .count() as u64,
            ..self.stats
        }
    }

    /// Append one batch. The bytes reach the operating system before this returns; they are
    /// durable after the [`commit`](Self::commit) (or [`sync`](Self::sync)) that follows.
    /// Offsets must go up within each topic, from at least [`next_offset`](Self::next_offset).
    /// On an error nothing of the batch stays in the log.
    pub fn append(
        &mut self,
        entries: &[Entry<'_>],
        timestamp_ms: u64,
    ) -> Result<Position, LogError> {
        self.append_kind(entries, Kind::Data, timestamp_ms)
    }

    fn append_kind(
        &mut self,
        entries: &[Entry<'_>],
        kind: Kind,
        timestamp_ms: u64,
    ) -> Result<Position, LogError> {
        if let Some(why) = &self.poisoned {
            return Err(LogError::Poisoned(why.clone()));
        }
        if entries.is_empty() {
            return Err(LogError::InvalidAppend("an empty batch".into()));
        }
        if kind != Kind::Data {
            return self.write_batch(entries, kind, timestamp_ms);
        }
        self.check_offsets(entries)?;
        // From here on the offsets count as used, written or not.
        let result = self
            .flush_burned()
            .and_then(|_| self.write_batch(entries, kind, timestamp_ms));
        if result.is_err() {
            for e in entries {
                let high = self.burned.entry(e.topic.into()).or_insert(e.offset);
                *high = (*high).max(e.offset);
            }
        }
        result
    }

    /// Offsets of appends that failed are still taken: write them as marks (one batch), so
    /// that no later run hands them out again. Done before the next append and at `close`;
    /// the broker also calls it to find out whether the log can write again. Returns whether
    /// there was anything to write.
    pub fn flush_burned(&mut self) -> Result<bool, LogError> {
        if self.burned.is_empty() {
            return Ok(false);
        }
        if let Some(why) = &self.poisoned {
            return Err(LogError::Poisoned(why.clone()));
        }
        let burned: Vec<(Box<[u8]>, u64)> =
            self.burned.iter().map(|(t, o)| (t.clone(), *o)).collect();
        // In batches of bounded size (many topics could exceed one batch's limit).
        for chunk in burned.chunks(4096) {
            self.write_batch(&mark_entries(chunk), Kind::Mark, now_ms())?;
            for (topic, _) in chunk {
                self.burned.remove(topic);
            }
        }
        Ok(true)
    }

    /// Everything handed out from the offset floor before the last retention pass is appended:
    /// from now on a topic the log does not know must start at the floor.
    pub fn end_forget_grace(&mut self) {
        self.last_forget = None;
    }

    /// Offsets some failed append took that are not written as marks yet.
    pub fn has_burned(&self) -> bool {
        !self.burned.is_empty()
    }

    /// Encode, seal and write one batch, and index it.
    fn write_batch(
        &mut self,
        entries: &[Entry<'_>],
        kind: Kind,
        timestamp_ms: u64,
    ) -> Result<Position, LogError> {
        let mut payload = 0usize;
        for e in entries {
            payload = payload.saturating_add(record_len(e.topic, e.data));
        }
        let tag = if self.opts.key.is_some() { 16 } else { 0 };
        let frame_len = FRAME_PREFIX + BODY_HEADER + payload + tag;
        if frame_len - FRAME_PREFIX > MAX_BODY || entries.len() > u32::MAX as usize {
            return Err(LogError::InvalidAppend(format!(
                "a batch of {payload} bytes (the most is {} bytes)",
                MAX_BODY - BODY_HEADER - tag
            )));
        }
        let active_len = self.active(|s| s.len)?;
        if active_len > HEADER_LEN as u64
            && active_len + frame_len as u64 > self.opts.max_segment_bytes
        {
            self.rotate()?;
        }
        let (seg_id, pos, batch_no, cipher) =
            self.active(|s| (s.id, s.len, s.batches, s.cipher.clone()))?;
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let header = BodyHeader {
            batch_no,
            count: entries.len() as u32,
            timestamp_ms,
        };
        let start = start_frame(&mut buf, &header);
        let payload_start = buf.len();
        for e in entries {
            encode_record(&mut buf, kind, e.topic, e.offset, e.data);
        }
        if let Some(c) = &cipher {
            let aad = batch_aad(seg_id, &buf[start + FRAME_PREFIX..payload_start]);
            c.seal(batch_no, &aad, &mut buf, payload_start);
        }
        finish_frame(&mut buf, start);
        let written = self.active.write_all_at(&buf, pos);
        self.buf = buf;
        if let Err(e) = written {
            self.stats.write_errors += 1;
            // The batch number is used up: part of the sealed frame may have reached the disk,
            // and a nonce must never seal two plaintexts (scans accept gaps in batch numbers).
            if let Some(seg) = self.segments.get_mut().last_mut() {
                seg.batches += 1;
            }
            let path = segment_path(&self.dir, seg_id);
            // Cut what part of the frame got written, so the next batch starts clean.
            if let Err(cut) = self.active.set_len(pos) {
                self.poisoned = Some(format!(
                    "a failed write to {} could not be undone: {cut}",
                    path.display()
                ));
            }
            return Err(LogError::io("appending to segment", path, e));
        }
        let end = pos + frame_len as u64;
        let unclean = self.unclean_now;
        let mut segments = self.segments.get_mut();
        let seg = segments
            .last_mut()
            .ok_or_else(|| LogError::InvalidAppend("no active segment".into()))?;
        for e in entries {
            seg.note(kind, e.topic, e.offset, pos);
            let state = TopicState {
                high: e.offset,
                high_segment: seg_id,
                unclean_at_high: unclean,
            };
            match self.topics.get_mut(e.topic) {
                Some(t) => *t = state,
                None => {
                    self.topics.insert(e.topic.into(), state);
                }
            }
        }
        seg.note_batch(timestamp_ms, end);
        drop(segments);
        self.dirty = true;
        self.unsynced_records = self.unsynced_records.saturating_add(entries.len() as u64);
        self.stats.appended_batches += 1;
        self.stats.appended_records += entries.len() as u64;
        Ok(Position {
            segment: seg_id,
            byte: end,
        })
    }

    /// Offsets go up within each topic, from `next_offset`.
    fn check_offsets(&self, entries: &[Entry<'_>]) -> Result<(), LogError> {
        let mut in_batch: HashMap<&[u8], u64> = HashMap::new();
        for e in entries {
            if e.topic == FLOOR_TOPIC {
                return Err(LogError::InvalidAppend(
                    "data under the log's offset floor name (a reserved name)".into(),
                ));
            }
            if e.topic.is_empty() || e.topic.len() > u16::MAX as usize {
                return Err(LogError::InvalidAppend(format!(
                    "a topic name of {} bytes (1 to {} allowed)",
                    e.topic.len(),
                    u16::MAX
                )));
            }
            let floor = match in_batch.get(e.topic) {
                Some(prev) => prev.saturating_add(1),
                None => {
                    let burned = self.burned.get(e.topic).map_or(0, |b| b.saturating_add(1));
                    self.lowest_next(e.topic).max(burned)
                }
            };
            if e.offset < floor {
                return Err(LogError::OffsetNotIncreasing {
                    topic: String::from_utf8_lossy(e.topic).into_owned(),
                    offset: e.offset,
                    last: floor.saturating_sub(1),
                });
            }
            in_batch.insert(e.topic, e.offset);
        }
        Ok(())
    }

    /// Make appended batches durable as the fsync mode says. Returns whether it synced.
    ///
    /// Under `interval` and `never` it also syncs once a quarter of `crash_offset_gap` records
    /// (262,144 by default) were appended since the last sync: a power cut loses what was not
    /// synced, and the offsets lost that way, with those still on their way to the log, must
    /// stay below the gap that the next start skips, or offsets would be handed out twice.
    pub fn commit(&mut self) -> Result<bool, LogError> {
        if let Some(why) = &self.poisoned {
            return Err(LogError::Poisoned(why.clone()));
        }
        let due = match self.opts.fsync {
            FsyncMode::Always | FsyncMode::Batch => true,
            FsyncMode::Interval(every) => self.last_sync.elapsed() >= every,
            FsyncMode::Never => false,
        } || self.unsynced_records >= self.opts.crash_offset_gap / 4;
        if due && self.dirty {
            self.sync()?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Flush everything appended so far to the disk (`fdatasync`). A failure poisons the log:
    /// after a failed fsync the kernel may have dropped the dirty pages, so nothing can vouch
    /// for what was appended since the last good sync.
    pub fn sync(&mut self) -> Result<(), LogError> {
        if let Some(why) = &self.poisoned {
            return Err(LogError::Poisoned(why.clone()));
        }
        if let Err(e) = self.active.sync_data() {
            let path = self.active(|s| s.path.clone())?;
            self.poisoned = Some(format!("fsync of {} failed: {e}", path.display()));
            return Err(LogError::io("syncing segment", path, e));
        }
        self.dirty = false;
        self.unsynced_records = 0;
        self.last_sync = Instant::now();
        self.stats.syncs += 1;
        Ok(())
    }

    /// Seal the active segment (sync, index file) and start a new one.
    fn rotate(&mut self) -> Result<(), LogError> {
        self.sync()?;
        let dir = self.dir.clone();
        let (next_id, generation, unclean, idx, cipher) = {
            let mut segments = self.segments.get_mut();
            let seg = segments
                .last_mut()
                .ok_or_else(|| LogError::InvalidAppend("no active segment".into()))?;
            // Sealed, but not a clean close: only `close` says that (a crash before the next
            // segment exists must still count as one).
            seg.clean = false;
            (
                seg.id + 1,
                seg.generation,
                seg.unclean_before,
                seg.index_file()?,
                seg.cipher.clone(),
            )
        };
        // Written without holding the index's lock: readers on other threads go on meanwhile.
        segment::write_index_file(&dir, next_id - 1, &idx, cipher.as_deref())?;
        let (seg, file) = Segment::create(
            &dir,
            next_id,
            generation,
            unclean,
            self.opts.key.as_ref(),
            now_ms(),
        )?;
        if let Err(e) = sync_dir(&dir) {
            // Not adopted: leave no file behind, or the next rotation's `create_new` of the same
            // name would fail until a restart.
            drop(file);
            let _ = std::fs::remove_file(segment_path(&dir, next_id));
            return Err(e);
        }
        {
            let mut segments = self.segments.get_mut();
            // Its index is on disk: its entry points need not stay in memory.
            if let Some(sealed) = segments.last_mut() {
                sealed.seal();
            }
            segments.push(seg);
        }
        self.active = file;
        Ok(())
    }

    /// Close cleanly: sync, write the active segment's index marked clean. The next open then
    /// reads no segment through and skips no offsets.
    pub fn close(mut self) -> Result<(), LogError> {
        // Offsets of failed appends must be on disk before the log may say it closed cleanly.
        // If they cannot be (a full disk), what was written is still synced before the error
        // is returned: the tail an `interval` or `never` log had not synced yet holds confirmed
        // messages.
        if let Err(e) = self.flush_burned() {
            let _ = self.sync();
            return Err(e);
        }
        self.sync()?;
        let dir = self.dir.clone();
        if let Some(seg) = self.segments.get_mut().last_mut() {
            seg.clean = true;
            seg.write_index(&dir)?;
        }
        sync_dir(&dir)
    }

    /// Read `topic` from offset `from` on, in offset order: messages logged up to now.
    pub fn read(&self, topic: &[u8], from: u64) -> Reader {
        self.segments.read(topic, from)
    }

    /// Delete sealed segments as retention says (never the active one). Topics whose highest
    /// offset would go with them get a mark in the active segment first, synced before any file
    /// is deleted, so their offsets are never handed out again. Returns the deleted segment ids.
    pub fn enforce_retention(&mut self, now: std::time::SystemTime) -> Result<Vec<u64>, LogError> {
        let doomed = self.retention_doomed(now);
        self.delete_oldest(doomed, None)
    }

    /// [`enforce_retention`](Self::enforce_retention), and *forget* topics it empties, so that
    /// the log's memory does not grow with every topic name it ever logged. The topics whose
    /// every message and mark is in the segments to delete are offered to `forget` (see
    /// [`Forget`]); those it forgets get no mark, and start at the log's offset floor when
    /// logged again. The others are kept, with a mark each as without forgetting.
    ///
    /// A pass that chooses topics raises the floor (if they had offsets past it). A topic new
    /// to the log whose first offset was handed out from the floor before the pass (its
    /// messages were waiting to be appended) is still accepted from that floor until
    /// [`end_forget_grace`](Self::end_forget_grace) (or the next pass that chooses topics): an
    /// appender that hands out new topics' offsets from
    /// [`new_topic_offset`](Self::new_topic_offset) appends what it handed out before the pass,
    /// then ends the grace. The topics the pass forgot must go on from the new floor.
    pub fn enforce_retention_forgetting(
        &mut self,
        now: std::time::SystemTime,
        forget: &mut dyn Forget,
    ) -> Result<Vec<u64>, LogError> {
        let doomed = self.retention_doomed(now);
        self.delete_oldest(doomed, Some(forget))
    }

    /// How many of the oldest segments retention deletes at `now`.
    fn retention_doomed(&self, now: std::time::SystemTime) -> usize {
        let now_ms = now
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut doomed = 0;
        let mut total = self.bytes();
        let segments = self.segments.get();
        for seg in &segments[..segments.len().saturating_sub(1)] {
            let over_bytes = self.opts.retention_bytes.is_some_and(|max| total > max);
            // A segment with no readable batch (empty, or every batch damaged) is as old as
            // its header says: taken for older than any age, a damaged one was deleted at the
            // next pass, before anyone could look at it.
            let newest = match seg.batches {
                0 => seg.created_ms,
                _ => seg.max_ts,
            };
            let too_old = self
                .opts
                .retention_age
                .is_some_and(|age| newest.saturating_add(age.as_millis() as u64) < now_ms);
            if !(over_bytes || too_old) {
                break;
            }
            total -= seg.len;
            doomed += 1;
        }
        doomed
    }

    /// Delete every sealed segment before `position`'s segment.
    pub fn purge_before(&mut self, position: Position) -> Result<Vec<u64>, LogError> {
        let n = {
            let segments = self.segments.get();
            segments[..segments.len().saturating_sub(1)]
                .iter()
                .take_while(|s| s.id < position.segment)
                .count()
        };
        self.delete_oldest(n, None)
    }

    fn delete_oldest(
        &mut self,
        n: usize,
        forget: Option<&mut dyn Forget>,
    ) -> Result<Vec<u64>, LogError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let ids: Vec<u64> = self.segments.get()[..n].iter().map(|s| s.id).collect();
        let last_doomed = ids[ids.len() - 1];
        // Marks for the topics whose highest offset lives only in the doomed segments.
        let mut marks: Vec<(Box<[u8]>, u64)> = self
            .topics
            .iter()
            .filter(|(_, t)| t.high_segment <= last_doomed)
            .map(|(name, t)| (name.clone(), self.next_of(t) - 1))
            .collect();
        if let Some(forget) = forget {
            self.forget_emptied(&mut marks, last_doomed, forget)?;
        }
        for chunk in marks.chunks(4096) {
            self.append_marks(&mark_entries(chunk))?;
        }
        if !marks.is_empty() {
            self.sync()?;
        }
        for id in &ids {
            remove_if_present(&segment_path(&self.dir, *id))?;
            let _ = std::fs::remove_file(index_path(&self.dir, *id));
            // Forgotten as soon as it is gone, so a failure part-way leaves the list true.
            self.segments.get_mut().remove(0);
            self.stats.deleted_segments += 1;
        }
        sync_dir(&self.dir)?;
        Ok(ids)
    }

    /// Offer the topics among `marks` (each with its highest offset) to `forget`; raise the
    /// offset floor past those it chooses (durably), forget those it then forgets, and take
    /// them out of `marks`.
    fn forget_emptied(
        &mut self,
        marks: &mut Vec<(Box<[u8]>, u64)>,
        last_doomed: u64,
        forget: &mut dyn Forget,
    ) -> Result<(), LogError> {
        let offered: Vec<Box<[u8]>> = marks
            .iter()
            .filter(|(name, _)| &**name != FLOOR_TOPIC)
            .map(|(name, _)| name.clone())
            .collect();
        if offered.is_empty() {
            return Ok(());
        }
        // Still known, with its highest offset in the doomed segments (the floor's own mark
        // may be among them, and is kept).
        let doomed = |log: &Log, name: &[u8]| {
            log.topics
                .get(name)
                .is_some_and(|t| t.high_segment <= last_doomed)
        };
        let chosen: Vec<Box<[u8]>> = forget
            .choose(&offered)
            .into_iter()
            .filter(|name| &**name != FLOOR_TOPIC && doomed(self, name))
            .collect();
        if chosen.is_empty() {
            return Ok(());
        }
        let chosen_set: std::collections::HashSet<&[u8]> = chosen.iter().map(|n| &**n).collect();
        let floor_before = self.new_topic_offset();
        // The floor goes past every offset a chosen topic had (its mark's), also those failed
        // appends took (written as marks later): on disk before anything is forgotten, so a
        // topic started at the floor never repeats an offset, also after a crash.
        let highest = marks
            .iter()
            .filter(|(name, _)| chosen_set.contains(&**name))
            .map(|(name, high)| (*high).max(self.burned.get(name).copied().unwrap_or(0)))
            .max()
            .unwrap_or(0);
        if highest >= floor_before {
            self.append_marks(&[Entry {
                topic: FLOOR_TOPIC,
                offset: highest,
                data: &[],
            }])?;
            self.sync()?;
        }
        let forgotten = forget.forget(&chosen, self.new_topic_offset());
        let mut gone = std::collections::HashSet::with_capacity(forgotten.len());
        for name in forgotten {
            // Only what was chosen (a topic with messages left must stay known).
            if chosen_set.contains(&*name) && doomed(self, &name) {
                self.topics.remove(&name);
                gone.insert(name);
            }
        }
        self.stats.forgotten_topics += gone.len() as u64;
        // The forgotten ones are no longer known; the floor's own mark, if it was in the
        // doomed segments, was just written anew.
        marks.retain(|(name, _)| doomed(self, name));
        if self.topics.len() < self.topics.capacity() / 4 {
            self.topics.shrink_to_fit();
        }
        self.last_forget = Some((floor_before, gone));
        Ok(())
    }

    /// Marks restate where a topic's offsets stand (`next_offset - 1`, which may equal its
    /// high), so they skip the increasing-offset check that data goes through.
    fn append_marks(&mut self, entries: &[Entry<'_>]) -> Result<(), LogError> {
        self.append_kind(entries, Kind::Mark, now_ms()).map(|_| ())
    }

    /// Remove every batch after `position` (for a replicated log's storage, or an operator
    /// undoing a bad import). Later segments are deleted, `position`'s segment is cut there and
    /// sealed, and a new active segment starts (never appending again to a segment under the
    /// same nonces). Topic offsets fall back to what remains — the offset floor too: topics
    /// forgotten after `position` could then start below offsets they had.
    pub fn truncate_after(&mut self, position: Position) -> Result<(), LogError> {
        let found = {
            let segments = self.segments.get();
            segments
                .iter()
                .position(|s| s.id == position.segment)
                .map(|i| (i, segments[i].path.clone(), segments[i].len))
        };
        let Some((i, path, seg_len)) = found else {
            return Err(LogError::InvalidAppend(format!(
                "no segment {} in the log",
                position.segment
            )));
        };
        self.sync()?;
        // Check that `position` is a batch boundary by reading the segment up to it.
        let file = File::open(&path).map_err(|e| LogError::io("opening segment", &path, e))?;
        let (header, cipher) =
            segment::open_header(&path, &file, &self.opts.keys(), self.opts.allow_plaintext)?;
        if position.byte > seg_len {
            return Err(LogError::InvalidAppend(format!(
                "byte {} is past the end of segment {}",
                position.byte, position.segment
            )));
        }
        let scanned = segment::scan(
            &self.dir,
            &file,
            position.byte,
            &header,
            cipher,
            false,
            &mut |_| {},
        )?;
        if scanned.segment.len != position.byte || !scanned.segment.damage.is_empty() {
            return Err(LogError::InvalidAppend(format!(
                "byte {} of segment {} is not the end of a batch",
                position.byte, position.segment
            )));
        }
        // From here on the log changes on disk: any failure leaves it in no state to append
        // to (the active segment may be gone, or cut under nonces already used), so it poisons
        // the log until it is reopened, which recovers from what is on disk.
        let result = self.cut_at(i, &path, position.byte, scanned.segment);
        if let Err(e) = &result {
            self.poisoned = Some(format!("truncate_after failed half-way: {e}"));
        }
        result?;
        self.rebuild_topics();
        self.last_forget = None;
        Ok(())
    }
}

impl Log {
    /// The destructive part of [`truncate_after`](Self::truncate_after): delete the later
    /// segments, cut segment `i` at `byte`, seal it, start a new active segment.
    fn cut_at(
        &mut self,
        i: usize,
        path: &Path,
        byte: u64,
        mut seg: Segment,
    ) -> Result<(), LogError> {
        let later: Vec<Segment> = self.segments.get_mut().drain(i + 1..).collect();
        // Newest first: a crash or an error part-way leaves a prefix of the log, never one
        // with a hole in it.
        for old in later.iter().rev() {
            // The index first: one left without its segment could be taken for the next
            // segment of that id.
            let _ = std::fs::remove_file(index_path(&self.dir, old.id));
            remove_if_present(&old.path)?;
        }
        let f = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| LogError::io("opening segment", path, e))?;
        f.set_len(byte)
            .and_then(|()| f.sync_all())
            .map_err(|e| LogError::io("truncating segment", path, e))?;
        // Not a clean close: a crash before the new active segment exists counts as one.
        seg.clean = false;
        seg.write_index(&self.dir)?;
        seg.seal();
        // Past every id the log had: a reader's cache and plans know segments by id and path,
        // and must not take the new segment for one of those deleted.
        let next_id = later.last().map_or(seg.id, |s| s.id) + 1;
        self.segments.get_mut()[i] = seg;
        let (active_seg, active) = Segment::create(
            &self.dir,
            next_id,
            self.generation,
            self.unclean_now,
            self.opts.key.as_ref(),
            now_ms(),
        )?;
        self.segments.get_mut().push(active_seg);
        self.active = active;
        sync_dir(&self.dir)
    }
}

/// Mark records (no data) for (topic, offset) pairs.
fn mark_entries(marks: &[(Box<[u8]>, u64)]) -> Vec<Entry<'_>> {
    marks
        .iter()
        .map(|(topic, offset)| Entry {
            topic,
            offset: *offset,
            data: &[],
        })
        .collect()
}

/// Delete a file; one already gone counts as deleted.
fn remove_if_present(path: &Path) -> Result<(), LogError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LogError::io("deleting segment", path, e)),
    }
}

/// A log opened for reading only (`aqueduct log dump`): nothing on disk is changed — no torn
/// tail is cut, no index written, no segment created — so it may be opened while a broker
/// appends to it (it sees what was there when opened).
#[derive(Debug)]
pub struct LogView {
    segments: Vec<Segment>,
    entries: Arc<EntryCache>,
    /// Bytes of torn writes at the end of the last segment (left in place).
    pub torn_bytes: u64,
    /// Segments that could not be read (a bad header), left out of what the view reads: a
    /// broker refuses to start on such a segment. (A newest one that holds no more than a
    /// header, or only zeros, may be being created right now, and is left out without a word.)
    pub skipped: Vec<PathBuf>,
    /// Segments listed, then gone before they were read: the broker's retention deleted them
    /// meanwhile (not damage).
    pub deleted_meanwhile: usize,
}

impl LogView {
    /// `keys`: the current key, then any previous ones (as [`LogOptions::previous_keys`]);
    /// empty for a plaintext log.
    pub fn open(dir: &Path, keys: &[MasterKey]) -> Result<LogView, LogError> {
        let files = list_segments_read_only(dir)?;
        let mut segments = Vec::new();
        let mut torn_bytes = 0;
        let mut skipped = Vec::new();
        let mut deleted_meanwhile = 0;
        let mut seal_order = segment::SealOrder::default();
        for (i, (_, path)) in files.iter().enumerate() {
            let last = i + 1 == files.len();
            // Read-only, for inspection: plaintext segments are shown too — but not one after
            // a sealed one, which the broker refuses (said, as an unreadable one is).
            match segment::load(dir, path, keys, true, last) {
                Ok((scanned, _))
                    if seal_order
                        .next(path, scanned.segment.cipher.is_some())
                        .is_err() =>
                {
                    skipped.push(path.clone());
                }
                Ok((scanned, _)) => {
                    torn_bytes += scanned.torn_bytes;
                    segments.push(scanned.segment);
                }
                // The newest one may be being created right now (no more than a header, or
                // blank): left out silently. Any other unreadable one, newest or older, is left
                // out and said.
                Err(LogError::BadFile { .. }) if last && header_at_most(path) => {}
                Err(LogError::BadFile { .. }) => skipped.push(path.clone()),
                // Listed, then gone: the broker's retention deleted it meanwhile.
                Err(e) if e.is_not_found() => deleted_meanwhile += 1,
                Err(e) => return Err(e),
            }
        }
        Ok(LogView {
            segments,
            entries: Arc::default(),
            torn_bytes,
            skipped,
            deleted_meanwhile,
        })
    }

    /// Read `topic` from offset `from` on.
    pub fn read(&self, topic: &[u8], from: u64) -> Reader {
        Reader::new(&self.segments, &self.entries, topic, from)
    }

    /// Every topic with messages in the log, sorted.
    pub fn topics(&self) -> Vec<Vec<u8>> {
        topics_of(&self.segments)
    }
}

/// The segment files in `dir`, by id, changing nothing.
pub(crate) fn list_segments_read_only(dir: &Path) -> Result<Vec<(u64, PathBuf)>, LogError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| LogError::io("listing", dir, e))? {
        let entry = entry.map_err(|e| LogError::io("listing", dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some((stem, id)) = name
            .strip_suffix(".seg")
            .and_then(|n| n.parse::<u64>().ok().map(|id| (n, id)))
        {
            // A segment is read, sealed and deleted under its canonical name: one under
            // another (`5.seg`) was opened, then not found there, and skipped as if retention
            // had deleted it.
            let canonical = format!("{id:020}");
            if stem != canonical {
                return Err(LogError::BadFile {
                    path: entry.path(),
                    reason: format!(
                        "a segment file is named by its id in 20 digits: give it back its name, \
                         {canonical}.seg"
                    ),
                });
            }
            found.push((id, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// A segment file that holds no batch: no longer than a header, or blank (a segment being
/// created, or one whose creation a crash cut short).
fn header_at_most(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() <= HEADER_LEN as u64)
        || short_or_blank(path)
}

/// A segment file too short for a header, or all of whose bytes are zero: what a crash while
/// it was created leaves (its header is synced before anything is written after it). A blank
/// header with anything after it is damage, not this.
fn short_or_blank(path: &Path) -> bool {
    use std::io::Read;
    let Ok(mut file) = File::open(path) else {
        return false;
    };
    match file.metadata() {
        Ok(m) if m.len() < HEADER_LEN as u64 => return true,
        Ok(_) => {}
        Err(_) => return false,
    }
    // Read in pieces: a segment may be as large as aal.max_aal_size allows, and a real one is
    // told at its first non-zero byte.
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match file.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) if buf[..n].iter().any(|&x| x != 0) => return false,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::Topics;

    thread_local! {
        /// Makes [`Log::open`] fail just before it creates the new active segment (a start
        /// that dies there).
        pub(super) static FAIL_BEFORE_ACTIVE: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }

    /// Damage found by reading through a sealed segment (its index gone) is crash evidence:
    /// the new active segment's header counts the crash. A start that died before that
    /// segment was made had already written the damaged segment's index, so the next start
    /// found no evidence and went on at the highest offset it could read: offset 1, which the
    /// damaged batch held, named a second message.
    #[test]
    fn crash_evidence_from_damage_survives_a_start_that_dies() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let opts = || LogOptions::default();
        let (mut log, _) = Log::open(tmp.path(), opts()).expect("open");
        let entry = |offset, data: &'static [u8]| Entry {
            topic: b"t",
            offset,
            data,
        };
        log.append(&[entry(0, b"first")], 0).expect("append");
        log.append(&[entry(1, b"second")], 0).expect("append");
        log.close().expect("close");
        // A second clean run: the first segment is no longer the newest.
        let (log, _) = Log::open(tmp.path(), opts()).expect("open");
        log.close().expect("close");
        let seg = segment_path(tmp.path(), 0);
        let mut b = std::fs::read(&seg).expect("read");
        let last = b.len() - 3;
        b[last] ^= 0xFF; // inside the last frame: offset 1's batch
        std::fs::write(&seg, &b).expect("write");
        std::fs::remove_file(index_path(tmp.path(), 0)).expect("remove the index");
        FAIL_BEFORE_ACTIVE.with(|f| f.set(true));
        let died = Log::open(tmp.path(), opts()).map(|_| ());
        FAIL_BEFORE_ACTIVE.with(|f| f.set(false));
        assert!(died.is_err());
        let (log, rec) = Log::open(tmp.path(), opts()).expect("open");
        assert!(!rec.clean, "counted as a crash");
        let gap = opts().crash_offset_gap;
        assert!(
            log.next_offset(b"t") > gap,
            "t goes on past the gap, not at {}",
            log.next_offset(b"t")
        );
    }

    /// Short, or zeros to the end (read in pieces, not whole: a segment may be large); any
    /// non-zero byte, however far in, makes it a segment with content.
    #[test]
    fn short_or_blank_reads_in_pieces_to_the_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = |name: &str, bytes: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).expect("write");
            p
        };
        assert!(short_or_blank(&file("short", &[1u8; 10])));
        assert!(short_or_blank(&file("zeros", &vec![0u8; 300 << 10])));
        let mut late = vec![0u8; 300 << 10];
        *late.last_mut().expect("a byte") = 1;
        assert!(!short_or_blank(&file("late", &late)));
        assert!(!short_or_blank(&dir.path().join("missing")));
    }

    /// Every level made is made private and its parent synced: on a first run `~/.aqueduct`
    /// and `~/.aqueduct/aal` are both new, and only `~/.aqueduct` was synced, so a power cut
    /// could lose the whole directory with every message confirmed into it.
    #[test]
    fn each_new_directory_level_is_synced_into_its_parent() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("home/.aqueduct/aal");
        std::fs::create_dir(base.path().join("home")).expect("home");
        let mut synced = Vec::new();
        create_private_dir_syncing(&dir, |d| {
            synced.push(d.to_path_buf());
            Ok(())
        })
        .expect("made");
        assert_eq!(
            synced,
            [base.path().join("home"), base.path().join("home/.aqueduct")]
        );
        #[cfg(unix)]
        for d in [base.path().join("home/.aqueduct"), dir.clone()] {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&d).expect("made").permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", d.display());
        }
        // Already there: nothing made, nothing synced.
        synced.clear();
        create_private_dir_syncing(&dir, |d| {
            synced.push(d.to_path_buf());
            Ok(())
        })
        .expect("there");
        assert!(synced.is_empty());
    }

    /// The middle entry point of topic `dense` in an index.
    fn middle_entry(idx: &crate::format::IndexFile) -> (u64, u64) {
        let (_, span) = idx
            .topics
            .iter()
            .find(|(n, _)| n == b"dense")
            .expect("dense");
        span.entries[span.entries.len() / 2]
    }

    /// A sealed segment keeps no entry points in memory (a dense topic has one per 64 KB,
    /// which grew with the log's size for the process's life): a reader reads them from the
    /// segment's index file when it gets there, seeks with them as before, and reads the whole
    /// segment when the index cannot be read. With and without a key (whose index carries a
    /// MAC), after rotation and after a reopen.
    #[test]
    fn sealed_segments_keep_their_entry_points_on_disk_only() {
        for key in [None, MasterKey::from_bytes(&[7; 32])] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let opts = || LogOptions {
                key: key.clone(),
                max_segment_bytes: 1 << 20,
                ..LogOptions::default()
            };
            let (mut log, _) = Log::open(tmp.path(), opts()).expect("open");
            let big = vec![0xA5; 20 << 10];
            for o in 0..300u64 {
                let mut entries = vec![Entry {
                    topic: b"dense",
                    offset: o,
                    data: &big,
                }];
                if o % 10 == 0 {
                    entries.push(Entry {
                        topic: b"sparse",
                        offset: o / 10,
                        data: b"s",
                    });
                }
                log.append(&entries, 1_000 + o).expect("append");
            }
            log.commit().expect("commit");
            let expect = |topic: &[u8], from: u64| -> Vec<u64> {
                match topic {
                    b"dense" => (from..300).collect(),
                    _ => (from..30).collect(),
                }
            };
            let offsets =
                |reader: Reader| -> Vec<u64> { reader.map(|r| r.expect("read").offset).collect() };
            let check = |log: &Log, what: &str| {
                let segments = log.segments.get();
                assert!(segments.len() >= 5, "{what}: {} segments", segments.len());
                for seg in &segments[..segments.len() - 1] {
                    let Topics::Sealed(_) = &seg.topics else {
                        panic!("{what}: segment {} is live", seg.id);
                    };
                    // Two topics' names and offsets, against the dozen and more entry points
                    // its index file holds for the dense one.
                    assert!(
                        seg.topics.heap_bytes() < 128,
                        "{what}: {}",
                        seg.topics.heap_bytes()
                    );
                    let idx =
                        segment::valid_index(tmp.path(), seg.id, seg.cipher.as_deref(), seg.len)
                            .expect("index read")
                            .expect("a valid index");
                    let dense = idx
                        .topics
                        .iter()
                        .find(|(n, _)| n == b"dense")
                        .expect("dense");
                    assert!(dense.1.entries.len() >= 12, "{what}: {:?}", dense.1.entries);
                }
                // From the middle of a sealed segment: the reader starts at the entry point
                // the index file gives, not at the segment's start.
                let third = &segments[2];
                let third_id = third.id;
                let idx =
                    segment::valid_index(tmp.path(), third.id, third.cipher.as_deref(), third.len)
                        .expect("index read")
                        .expect("a valid index");
                let (from, pos) = middle_entry(&idx);
                drop(segments);
                let mut reader = log.read(b"dense", from + 1);
                assert_eq!(reader.position(), Some((third_id, pos)), "{what}");
                assert_eq!(
                    log.index().first_segment(b"dense", from + 1),
                    Some(third_id),
                    "{what}"
                );
                assert!(log.segments.entries.segments().1 >= 1, "{what}");
                assert_eq!(offsets(reader), expect(b"dense", from + 1), "{what}");
                for (topic, from) in [(&b"dense"[..], 0), (b"sparse", 0), (b"sparse", 17)] {
                    assert_eq!(
                        offsets(log.read(topic, from)),
                        expect(topic, from),
                        "{what}"
                    );
                }
                // Without the index files' help (a cache that cannot read them): each sealed
                // segment is read whole, and nothing is missed.
                let saved: Vec<(PathBuf, Vec<u8>)> = log.segments.get()[..3]
                    .iter()
                    .map(|s| {
                        let path = index_path(tmp.path(), s.id);
                        let bytes = std::fs::read(&path).expect("index");
                        std::fs::write(&path, b"damaged").expect("damage");
                        (path, bytes)
                    })
                    .collect();
                // From the middle of the third segment, through `cache`: read from the
                // segment's start, nothing missed; `kept` is what the cache then holds.
                let read_whole = |cache: &Arc<EntryCache>, kept: (usize, usize), why: &str| {
                    let mut reader = Reader::new(&log.segments.get(), cache, b"dense", from + 1);
                    assert_eq!(
                        reader.position(),
                        Some((third_id, crate::format::HEADER_LEN as u64)),
                        "{what}"
                    );
                    assert_eq!(cache.segments(), kept, "{what}: {why}");
                    assert_eq!(offsets(reader), expect(b"dense", from + 1), "{what}");
                };
                let blind: Arc<EntryCache> = Arc::default();
                read_whole(&blind, (1, 0), "remembered as unreadable");
                let reader = Reader::new(&log.segments.get(), &blind, b"sparse", 3);
                assert_eq!(offsets(reader), expect(b"sparse", 3), "{what}");
                // One that cannot be read at all (here a directory in its place: an I/O error,
                // as running out of file descriptors is) is not remembered: it may be readable
                // for the next reader.
                let third_index = index_path(tmp.path(), third_id);
                std::fs::remove_file(&third_index).expect("remove");
                std::fs::create_dir(&third_index).expect("a directory in its place");
                read_whole(&Arc::default(), (0, 0), "not remembered");
                std::fs::remove_dir(&third_index).expect("remove the directory");
                for (path, bytes) in saved {
                    std::fs::write(path, bytes).expect("restore");
                }
            };
            check(&log, "after rotation");
            log.close().expect("close");
            let (log, _) = Log::open(tmp.path(), opts()).expect("reopen");
            check(&log, "after a reopen");
            log.close().expect("close");

            // Damage in a sealed segment, found by reading it through at open: readers skip
            // it, with the index's entry points and without them.
            let id = 1;
            let idx = {
                let (log, _) = Log::open(tmp.path(), opts()).expect("open");
                let idx = {
                    let seg = &log.segments.get()[id as usize];
                    segment::valid_index(tmp.path(), id, seg.cipher.as_deref(), seg.len)
                        .expect("index read")
                        .expect("a valid index")
                };
                log.close().expect("close");
                idx
            };
            let (lost, pos) = middle_entry(&idx);
            let path = segment_path(tmp.path(), id);
            let mut b = std::fs::read(&path).expect("segment");
            b[pos as usize + 100] ^= 0xFF;
            std::fs::write(&path, &b).expect("damage");
            std::fs::remove_file(index_path(tmp.path(), id)).expect("remove the index");
            let (log, rec) = Log::open(tmp.path(), opts()).expect("open");
            assert_eq!(rec.damaged_batches, 1);
            let dense: Vec<u64> = (0..300).filter(|o| *o != lost).collect();
            let sparse: Vec<u64> = (0..30)
                .filter(|o| lost % 10 != 0 || *o != lost / 10)
                .collect();
            assert_eq!(offsets(log.read(b"dense", 0)), dense);
            assert_eq!(offsets(log.read(b"sparse", 0)), sparse);
            std::fs::write(index_path(tmp.path(), id), b"damaged").expect("damage the index");
            let blind: Arc<EntryCache> = Arc::default();
            assert_eq!(
                offsets(Reader::new(&log.segments.get(), &blind, b"dense", 0)),
                dense
            );
            assert_eq!(
                offsets(Reader::new(&log.segments.get(), &blind, b"sparse", 0)),
                sparse
            );
        }
    }
}
