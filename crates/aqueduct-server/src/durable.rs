//! The broker's side of the durable log: a queue that publishing streams fill, and one writer
//! thread that appends what gathered as one batch, syncs as `aal.fsync` says, and only then
//! sends the CONFIRMs of the frames in it (a group commit).
//!
//! Publishing with the log on: a stream routes its frame (live delivery goes on at once) and
//! queues the frame's messages with their offsets, both under [`Durable::order`], so each
//! topic's offsets enter the queue in order. What the log owes is bounded ([`MAX_OWED`]
//! messages queued, being written or about to be queued; [`MAX_QUEUED_BYTES`] queued): a stream
//! takes room for its frame's messages before routing it ([`Durable::wait_room`]), and waits
//! while there is none, so a slow disk slows publishers down through QUIC flow control. Far
//! fewer offsets than the log's crash gap can be handed out and not yet written, which is what
//! lets recovery skip them.
//!
//! The writer runs on its own thread: `pwrite` and `fdatasync` block, and must not stall the
//! async workers. Queued messages hold their topic's state, so the core cannot evict a topic
//! whose offsets are not written yet; the writer records each topic's next offset before it
//! lets them go, and the core asks that table (its offset source) when it creates a topic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use aqueduct_core::{DeadLetterRecord, Publication, PublishContext, TopicState};
use aqueduct_log::{Entry, FsyncMode, Log, LogError, Recovery};
use aqueduct_proto::frame::Message;
use aqueduct_proto::{
    Compression, Confirm, ErrorCode, ErrorFrame, Frame, Priority, TopicName, TraceContext,
};
use tracing::{debug, error, info, warn};

use crate::stats::ServerStats;
use crate::stream::StreamOut;

/// Bytes queued for the writer before publishers wait.
pub(crate) const MAX_QUEUED_BYTES: usize = 16 << 20;
/// Messages admitted to the log and not yet written (queued, being written, or reserved by a
/// stream about to route a frame) before publishers wait. A frame is admitted whole, also past
/// this when nothing is owed (a batch of up to `transport.max_buf_size` / 15 bytes, under
/// 560,000 messages at the 8 MiB cap); so fewer than [`CRASH_OFFSET_GAP`] offsets are ever
/// handed out and not written. Room for about two group commits of 65,536: one being written
/// while the next gathers.
pub(crate) const MAX_OWED: usize = 131_072;
/// Offsets every topic skips after a crash: more than can be handed out and not yet written
/// (see [`MAX_OWED`]).
pub(crate) const CRASH_OFFSET_GAP: u64 = 1 << 20;
/// The most bytes of queued messages one log batch takes (a batch's limit is 64 MiB).
const MAX_CHUNK_BYTES: usize = 32 << 20;
/// Dead letters queued together are split into groups of about this many bytes: well within
/// a log batch, whatever their framing adds.
const DEAD_LETTER_GROUP_BYTES: usize = MAX_CHUNK_BYTES / 2;
/// Topics looked at under one hold of the broker's topic map when retention forgets topics.
const FORGET_CHUNK: usize = 4096;
/// How often the writer applies retention.
const RETENTION_EVERY: Duration = Duration::from_secs(10);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Raise `map[topic]` to at least `n`; true if the topic was not in the map.
fn raise(map: &mut HashMap<Box<[u8]>, u64>, topic: &[u8], n: u64) -> bool {
    match map.get_mut(topic) {
        Some(v) => {
            *v = (*v).max(n);
            false
        }
        None => {
            map.insert(Box::from(topic), n);
            true
        }
    }
}

/// Writes' topics a durable consumer can catch up on without looking at all of its topics
/// (see [`Durable::changed_since`]); one further behind looks at all of them.
const MAX_CHANGES: usize = 1 << 16;

/// What the log's writes changed, for durable consumers: they look only at the topics that
/// changed since they last looked, not at every topic the log has (a wildcard consumer of a log
/// with a million topics would read a million positions at every write).
#[derive(Debug, Default)]
struct Changes {
    /// Every topic the log has, in the order it appeared: a consumer reads on from where it
    /// stopped to find new ones its filter matches. A topic the log forgot is left as an empty
    /// name (no topic has one) until they are more than half of the list; then the list is
    /// compacted and `epoch` counts up, and consumers read it again from its start.
    topics: Vec<Box<[u8]>>,
    /// Empty names in `topics`.
    forgotten: usize,
    /// Compactions of `topics` so far.
    epoch: u64,
    /// Writes so far.
    writes: u64,
    /// The topics each recent write made durable data for: (write, topic), oldest first, at
    /// most [`MAX_CHANGES`].
    recent: std::collections::VecDeque<(u64, Box<[u8]>)>,
    /// The last write some of whose entries `recent` has dropped.
    dropped_through: u64,
}

/// Where a durable consumer is in the log's list of topics ([`Durable::topics_from`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TopicsSeen {
    epoch: u64,
    index: usize,
}

/// Who has a say in which topics the log forgets (see [`Durable::forget`]); weak, as the
/// broker's offset source holds the durable log.
#[derive(Debug)]
struct ForgetGate {
    broker: std::sync::Weak<aqueduct_core::Broker>,
    consumers: std::sync::Weak<crate::consumers::Consumers>,
}

/// The broker's say in which topics the log's retention forgets: none until the server set the
/// gate ([`Durable::set_forget_gate`]); else those the broker holds no state for and every
/// durable consumer has read to the end (see [`Consumers::retain_unread`]), whose positions in
/// them go with them.
///
/// [`Consumers::retain_unread`]: crate::consumers::Consumers::retain_unread
struct BrokerForgets<'a> {
    durable: &'a Durable,
    gate: Option<(Arc<aqueduct_core::Broker>, Arc<crate::consumers::Consumers>)>,
}

impl BrokerForgets<'_> {
    /// Of `topics`, those every durable consumer has read to the end, each with that end (the
    /// offset past its last durable message). No message is made durable during a pass (the
    /// writer runs it), so the ends stay put until it is over.
    fn read_to_end(
        &self,
        consumers: &crate::consumers::Consumers,
        topics: &[Box<[u8]>],
    ) -> HashMap<Box<[u8]>, u64> {
        let mut ends: HashMap<Box<[u8]>, u64> = {
            let durable = lock(&self.durable.durable_next);
            topics
                .iter()
                .map(|t| (t.clone(), durable.get(t).copied().unwrap_or(0)))
                .collect()
        };
        // Without the broker's lock (a SUBSCRIBE takes the consumers' table, then the
        // broker's topics).
        consumers.retain_unread(&mut ends);
        ends
    }
}

impl aqueduct_log::Forget for BrokerForgets<'_> {
    fn choose(&mut self, emptied: &[Box<[u8]>]) -> Vec<Box<[u8]>> {
        let Some((broker, consumers)) = &self.gate else {
            return Vec::new();
        };
        // Topics that were busy when the broker last freed idle ones (their messages waited
        // for this writer) are idle now: freed first, they can be forgotten in this pass
        // (otherwise only once the broker holds twice as many topics as then).
        broker.sweep_idle_topics();
        let candidates: Vec<Box<[u8]>> = self.read_to_end(consumers, emptied).into_keys().collect();
        let mut chosen = Vec::with_capacity(candidates.len());
        for chunk in candidates.chunks(FORGET_CHUNK) {
            broker.with_topics_frozen(|held| {
                chosen.extend(chunk.iter().filter(|t| !held(t)).cloned());
            });
        }
        chosen
    }

    fn forget(&mut self, chosen: &[Box<[u8]>], floor: u64) -> Vec<Box<[u8]>> {
        let Some((broker, consumers)) = &self.gate else {
            return Vec::new();
        };
        // Again (a consumer may have found one since): a consumer that finds one of these
        // topics between this and the forgetting starts it at its oldest message, as for any
        // topic (`consumers::start_in`); see docs/architecture.md, "Offsets".
        let ends = self.read_to_end(consumers, chosen);
        let forgotten = self
            .durable
            .forget(broker, ends.keys().cloned().collect(), floor);
        // Before the writer writes again, so a topic logged again reappears in the log's list
        // of topics after the positions in it are gone.
        consumers.forget_positions(&forgotten, &ends);
        forgotten
    }
}

/// A retention pass that forgot this many topics (their states, names and offsets in the
/// broker and the log) gives the memory it freed back to the system.
const TRIM_AFTER_FORGETTING: u64 = FORGET_CHUNK as u64;

/// Give the memory the process freed back to the system, on a thread of its own (one at a
/// time). glibc's allocator keeps freed memory for reuse, so a broker that held a burst of
/// topics until retention forgot them stayed at the burst's size (250–320 MB after bursts of
/// 200,000 topics) for good; `malloc_trim` returns the free pages of every arena. It walks
/// them (30–95 ms after such a burst), which the log writer does not wait for; an allocation
/// in an arena being trimmed does (glibc holds the arena's lock meanwhile): a short stall, at
/// most once per pass that forgot thousands of topics.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static TRIMMING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if TRIMMING.swap(true, Ordering::AcqRel) {
            return;
        }
        let trim = || {
            let started = Instant::now();
            #[allow(unsafe_code)]
            // SAFETY: malloc_trim only releases memory the allocator holds free; it takes the
            // arenas' locks like any allocation and invalidates no pointer the program holds.
            unsafe {
                libc::malloc_trim(0);
            }
            debug!(took = ?started.elapsed(), "gave the memory a retention pass freed back to the system");
            TRIMMING.store(false, Ordering::Release);
        };
        if std::thread::Builder::new()
            .name("aqueduct-trim".into())
            .spawn(trim)
            .is_err()
        {
            TRIMMING.store(false, Ordering::Release);
        }
    }
}

/// Where the stored bytes of the first `recs` records end.
fn data_end(work: &Queue, recs: usize) -> usize {
    recs.checked_sub(1).map_or(0, |i| work.recs[i].end)
}

/// A message as the log stores it: what a subscriber needs to receive it again.
///
/// ```text
/// stored := flags:u8 priority:u8 [ttl_ms:u32] [trace_id:16 span_id:8 trace_flags:1]
///           [algorithm:u8 uncompressed_len:u32]
///           [topic_len:u16 original_topic original_offset:u64 attempts:u32 reason_len:u16 reason]
///           body
/// flags  := bit 0 ttl, bit 1 trace, bit 2 compression, bit 3 dead letter
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub priority: Priority,
    pub ttl_ms: Option<u32>,
    pub trace: Option<TraceContext>,
    pub compression: Option<Compression>,
    /// Set for a dead letter: where it came from.
    pub dead_letter: Option<StoredDeadLetter>,
    pub body: Vec<u8>,
}

/// A dead letter's origin, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDeadLetter {
    pub original_topic: TopicName,
    pub original_offset: u64,
    pub attempts_made: u32,
    pub reason: String,
}

/// The parts of a message the log stores, borrowed.
struct Parts<'a> {
    priority: Priority,
    ttl: Option<Duration>,
    trace: Option<&'a TraceContext>,
    compression: Option<&'a Compression>,
    dead_letter: Option<(&'a TopicName, u64, u32, &'a str)>,
    body: &'a [u8],
}

impl Parts<'_> {
    fn encode(&self, out: &mut Vec<u8>) {
        let ttl = self
            .ttl
            .map(|d| d.as_millis().min(u128::from(u32::MAX)) as u32);
        let flags = ttl.is_some() as u8
            | (self.trace.is_some() as u8) << 1
            | (self.compression.is_some() as u8) << 2
            | (self.dead_letter.is_some() as u8) << 3;
        out.push(flags);
        out.push(self.priority.level());
        if let Some(ttl) = ttl {
            out.extend_from_slice(&ttl.to_le_bytes());
        }
        if let Some(t) = self.trace {
            out.extend_from_slice(&t.trace_id);
            out.extend_from_slice(&t.span_id);
            out.push(t.flags);
        }
        if let Some(c) = self.compression {
            out.push(c.algorithm);
            out.extend_from_slice(&c.uncompressed_len.to_le_bytes());
        }
        if let Some((topic, offset, attempts, reason)) = self.dead_letter {
            let topic = topic.as_bytes();
            out.extend_from_slice(&(topic.len() as u16).to_le_bytes());
            out.extend_from_slice(topic);
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&attempts.to_le_bytes());
            let reason = &reason.as_bytes()[..reason.len().min(u16::MAX as usize)];
            out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
            out.extend_from_slice(reason);
        }
        out.extend_from_slice(self.body);
    }
}

impl StoredMessage {
    pub(crate) fn encode(p: &Publication<'_>, out: &mut Vec<u8>) {
        Parts {
            priority: p.priority,
            ttl: p.ttl,
            trace: p.trace,
            compression: p.compression,
            // A dead letter made on a cluster peer and forwarded here.
            dead_letter: p.dead_letter().map(|d| {
                (
                    d.original_topic,
                    d.original_offset,
                    d.attempts_made,
                    d.reason,
                )
            }),
            body: p.body,
        }
        .encode(out);
    }

    fn encode_dead_letter(d: &DeadLetterRecord, out: &mut Vec<u8>) {
        Parts {
            priority: d.priority,
            ttl: None,
            trace: d.trace.as_ref(),
            compression: d.compression.as_ref(),
            dead_letter: Some((
                &d.original_topic,
                d.original_offset,
                d.attempts_made,
                &d.reason,
            )),
            body: &d.body,
        }
        .encode(out);
    }

    /// Decode a stored message; `None` if the bytes are not one.
    pub fn decode(b: &[u8]) -> Option<StoredMessage> {
        let (&flags, rest) = b.split_first()?;
        let (&prio, mut rest) = rest.split_first()?;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, tail) = rest.split_at_checked(n)?;
            rest = tail;
            Some(head)
        };
        let ttl_ms = match flags & 1 {
            0 => None,
            _ => Some(u32::from_le_bytes(take(4)?.try_into().ok()?)),
        };
        let trace = match flags & 2 {
            0 => None,
            _ => {
                let t = take(25)?;
                Some(TraceContext {
                    trace_id: t[..16].try_into().ok()?,
                    span_id: t[16..24].try_into().ok()?,
                    flags: t[24],
                })
            }
        };
        let compression = match flags & 4 {
            0 => None,
            _ => {
                let c = take(5)?;
                Some(Compression {
                    algorithm: c[0],
                    uncompressed_len: u32::from_le_bytes(c[1..5].try_into().ok()?),
                })
            }
        };
        let dead_letter = match flags & 8 {
            0 => None,
            _ => {
                let n = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
                let topic = std::str::from_utf8(take(n)?).ok()?;
                let original_topic = TopicName::try_from(topic).ok()?.detached();
                let original_offset = u64::from_le_bytes(take(8)?.try_into().ok()?);
                let attempts_made = u32::from_le_bytes(take(4)?.try_into().ok()?);
                let n = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
                let reason = String::from_utf8_lossy(take(n)?).into_owned();
                Some(StoredDeadLetter {
                    original_topic,
                    original_offset,
                    attempts_made,
                    reason,
                })
            }
        };
        Some(StoredMessage {
            priority: Priority::new(prio)?,
            ttl_ms,
            trace,
            compression,
            dead_letter,
            body: rest.to_vec(),
        })
    }
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct DurableStats {
    pub segments: AtomicU64,
    /// Segments sealed with a key of `aal.previous_keys`.
    pub previous_key_segments: AtomicU64,
    pub bytes: AtomicU64,
    pub topics: AtomicU64,
    pub deleted_segments: AtomicU64,
    pub truncated_bytes: AtomicU64,
    pub damaged_batches: AtomicU64,
    pub appended_records: AtomicU64,
    pub group_commits: AtomicU64,
    pub syncs: AtomicU64,
    /// Publish frames refused with STORAGE_FAILED.
    pub write_errors: AtomicU64,
    /// Microseconds from a client's publish frame being queued to its batch being durable, summed.
    pub commit_wait_us: AtomicU64,
    /// Clients' publish frames made durable (not dead letters or cluster copies: no publisher
    /// waits for those); `commit_wait_us` sums the wait of the same frames.
    pub frames_committed: AtomicU64,
    pub queued: AtomicU64,
    /// Reads of the log for durable consumers that failed (other than a segment retention
    /// deleted): each is tried again, from the same position.
    pub read_errors: AtomicU64,
    /// Reads of the log for durable consumers that met damage (or a segment deleted since it
    /// was planned) and skipped it.
    pub read_skips: AtomicU64,
    /// Times a durable consumer's position was found below a topic's oldest message kept:
    /// retention deleted messages it had not read.
    pub consumers_overtaken: AtomicU64,
    /// Topics retention emptied that the log forgot (it keeps nothing of them; see
    /// [`Durable::forget`]): the log's count.
    pub forgotten_topics: AtomicU64,
}

/// Who gets told how a frame's messages fared.
///
/// While one lives, its stream counts it as unanswered ([`StreamOut::await_log`]) and does not
/// finish: the client reads a FIN as "every frame before it was handled" (protocol.md §1.1), and
/// this frame's CONFIRM or STORAGE_FAILED is still to come. The answer is queued on the stream
/// before the waiter is dropped.
#[derive(Debug)]
pub(crate) struct Waiter {
    /// Private: a waiter is made by [`Waiter::new`] only, which counts it on its stream.
    out: Arc<StreamOut>,
    pub stream_id: u32,
    /// The publisher asked for a CONFIRM.
    pub confirm: bool,
}

impl Waiter {
    pub(crate) fn new(out: Arc<StreamOut>, stream_id: u32, confirm: bool) -> Waiter {
        out.await_log();
        Waiter {
            out,
            stream_id,
            confirm,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.out.log_answered();
    }
}

/// Why a frame is answered STORAGE_FAILED without being published.
const REFUSED: &str = "the durable log cannot write (see the broker's log); nothing of this \
                       frame was published";

#[derive(Debug)]
struct Rec {
    topic: Arc<TopicState>,
    offset: u64,
    /// End of its stored bytes in `Queue::data` (the start is the previous record's end).
    end: usize,
}

#[derive(Debug)]
struct Group {
    /// End of its records in `Queue::recs`.
    recs_end: usize,
    /// Who to tell; none for messages the broker published itself (dead letters).
    waiter: Option<Waiter>,
    queued_at: Instant,
}

#[derive(Debug, Default)]
struct Queue {
    data: Vec<u8>,
    recs: Vec<Rec>,
    groups: Vec<Group>,
    /// Groups (by index) that carry no records, only an answer to send in their turn: an ERROR
    /// for a frame that came after frames whose answers the log still owed, or STORAGE_FAILED
    /// for a frame refused while the log fails.
    answers: Vec<(usize, Frame, usize)>,
    /// Dead letters among `recs` (by index): where each came from (topic, offset).
    origins: Vec<(usize, TopicName, u64)>,
    closing: bool,
}

/// Room for one frame's messages, taken by [`Durable::wait_room`] before the frame is routed;
/// given back when dropped (the messages it queued count on until the writer has written them).
#[must_use = "the room is given back when this is dropped: hold it while routing the frame"]
pub(crate) struct Room<'a> {
    durable: &'a Durable,
    n: usize,
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        self.durable.pay(self.n);
    }
}

/// One stream counted in `Durable::room_waiters` while it waits for room; uncounted when it
/// stops waiting, also when its wait is dropped unfinished.
struct RoomWaiter<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> RoomWaiter<'a> {
    fn new(count: &'a std::sync::atomic::AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        RoomWaiter(count)
    }
}

impl Drop for RoomWaiter<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The durable log as the broker uses it.
#[derive(Debug)]
pub(crate) struct Durable {
    queue: Mutex<Queue>,
    ready: Condvar,
    room: tokio::sync::Notify,
    /// Held while a stream routes a publish frame and queues its messages.
    pub order: Mutex<()>,
    /// Messages queued or being written, plus the rooms streams hold (see [`MAX_OWED`]).
    /// Taken (checked, then added) only under the `queue` lock; paid back without it, which
    /// can only make a check under the lock more careful than it needs to be.
    owed: std::sync::atomic::AtomicUsize,
    /// Streams waiting in [`Durable::wait_room`]: paying back wakes them only if there are any
    /// (counted before they check, so none is missed).
    room_waiters: std::sync::atomic::AtomicUsize,
    /// Each topic's next offset as handed out to the log (written or refused; at startup, as
    /// recovered): where a topic the core creates again starts.
    next: Mutex<HashMap<Box<[u8]>, u64>>,
    /// Each topic's next offset past what is durable (written and, as the fsync mode says,
    /// synced): durable consumers read no further.
    durable_next: Mutex<HashMap<Box<[u8]>, u64>>,
    /// The last write failed: publishes are refused (STORAGE_FAILED) without being routed until
    /// the log writes again, so the offsets the log owes as marks stay few.
    failing: std::sync::atomic::AtomicBool,
    /// [`Durable::close`] was called.
    closed: std::sync::atomic::AtomicBool,
    /// Records ever queued ([`Durable::owe`]) and ever handed back by the writer (written, or
    /// refused by a failed write): what a checkpoint of the durable consumers' positions waits
    /// for ([`Durable::written_so_far`]).
    pushed: AtomicU64,
    /// `pushed` as of the last dead letters queued: a checkpoint waits for the writer to hand
    /// back this many records, not everything queued (a backlog of publishes under
    /// `aal.fsync: always` would hold every save back).
    dead_letters_through: AtomicU64,
    handed_back: Mutex<u64>,
    handed_back_cv: Condvar,
    /// Messages whose dead letter a failed write lost, by topic: the lowest offset. Durable
    /// consumers' positions are saved no further than these until a restart, which delivers
    /// them again ([`Durable::unlogged_dead_letters`]).
    unlogged: Mutex<HashMap<Box<[u8]>, u64>>,
    /// What readers of the log (durable consumers) read through.
    pub index: aqueduct_log::LogIndex,
    /// Woken after every write: durable consumers that have caught up wait on it.
    pub progress: tokio::sync::Notify,
    /// The topics the log has and what its writes changed, for durable consumers.
    changes: Mutex<Changes>,
    /// Calls of [`durable_next`](Self::durable_next) (what a feeder's look at a topic costs).
    #[cfg(test)]
    pub(crate) lookups: AtomicU64,
    /// A topic the log does not know (never logged, or forgotten) starts here: past the gaps
    /// of earlier crashes and the log's offset floor. Changed only under the `next` lock.
    floor: AtomicU64,
    /// Set once the broker and the durable consumers exist: until then no topic is forgotten.
    forget_gate: std::sync::OnceLock<ForgetGate>,
    /// Tests only ([`crate::Control::apply_log_retention`]): apply retention at once.
    retention_asked: std::sync::atomic::AtomicBool,
    /// Tests only: milliseconds between retention passes, if not [`RETENTION_EVERY`] (0).
    retention_every_ms: AtomicU64,
    fsync: FsyncMode,
    pub stats: DurableStats,
    /// The server's counters (ERROR frames sent).
    server_stats: Arc<ServerStats>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Tests only ([`crate::Control::hold_log_writes`]): while true the writer writes nothing.
    held: Mutex<bool>,
    held_changed: Condvar,
}

impl Durable {
    /// Take over an opened log: start the writer thread.
    pub fn start(
        log: Log,
        recovery: &Recovery,
        fsync: FsyncMode,
        server_stats: Arc<ServerStats>,
    ) -> std::io::Result<Arc<Durable>> {
        let next: HashMap<Box<[u8]>, u64> = log
            .topics()
            .map(|t| (Box::from(t), log.next_offset(t)))
            .collect();
        // What is durable ends where the log's records end, not where the next offset is
        // handed out (past the gap after a crash): a consumer that read a topic to its end
        // before the crash has still read it to its end.
        let durable_next: HashMap<Box<[u8]>, u64> = log
            .topics()
            .map(|t| (Box::from(t), log.logged_end(t).unwrap_or(0)))
            .collect();
        let changes = Changes {
            topics: next.keys().cloned().collect(),
            ..Changes::default()
        };
        let stats = DurableStats::default();
        stats
            .truncated_bytes
            .store(recovery.truncated_bytes, Ordering::Relaxed);
        stats
            .damaged_batches
            .store(recovery.damaged_batches as u64, Ordering::Relaxed);
        let durable = Arc::new(Durable {
            queue: Mutex::default(),
            ready: Condvar::new(),
            room: tokio::sync::Notify::new(),
            order: Mutex::new(()),
            owed: std::sync::atomic::AtomicUsize::new(0),
            room_waiters: std::sync::atomic::AtomicUsize::new(0),
            floor: AtomicU64::new(log.new_topic_offset()),
            forget_gate: std::sync::OnceLock::new(),
            retention_asked: std::sync::atomic::AtomicBool::new(false),
            retention_every_ms: AtomicU64::new(0),
            durable_next: Mutex::new(durable_next),
            next: Mutex::new(next),
            failing: std::sync::atomic::AtomicBool::new(false),
            closed: std::sync::atomic::AtomicBool::new(false),
            pushed: AtomicU64::new(0),
            dead_letters_through: AtomicU64::new(0),
            handed_back: Mutex::new(0),
            handed_back_cv: Condvar::new(),
            unlogged: Mutex::default(),
            index: log.index(),
            progress: tokio::sync::Notify::new(),
            changes: Mutex::new(changes),
            #[cfg(test)]
            lookups: AtomicU64::new(0),
            fsync,
            stats,
            server_stats,
            writer: Mutex::new(None),
            held: Mutex::new(false),
            held_changed: Condvar::new(),
        });
        durable.note_log(&log);
        let d = durable.clone();
        // Without its writer nothing would ever be stored or confirmed: a failure to start it
        // stops the broker's start.
        let handle = std::thread::Builder::new()
            .name("aqueduct-log-writer".into())
            .spawn(move || d.run(log))?;
        *lock(&durable.writer) = Some(handle);
        Ok(durable)
    }

    /// How long between retention passes.
    fn retention_every(&self) -> Duration {
        match self.retention_every_ms.load(Ordering::Relaxed) {
            0 => RETENTION_EVERY,
            ms => Duration::from_millis(ms),
        }
    }

    /// Tests only: no retention pass but those asked for ([`Durable::ask_retention`]).
    #[cfg(test)]
    pub(crate) fn only_asked_retention(&self) {
        self.retention_every_ms.store(u64::MAX, Ordering::Relaxed);
    }

    /// Tests only: apply retention now, not at the writer's next 10 s tick.
    pub(crate) fn ask_retention(&self) {
        self.retention_asked.store(true, Ordering::SeqCst);
        // Under the queue's lock: the writer checks the flag under it before it waits.
        let _q = lock(&self.queue);
        self.ready.notify_one();
    }

    /// Tests only: while `hold` is true the writer writes (and answers) nothing; what is queued
    /// waits. Shutdown releases it.
    pub(crate) fn hold_writes(&self, hold: bool) {
        *lock(&self.held) = hold;
        self.held_changed.notify_all();
    }

    /// Wait while writes are held (tests), or until the log closes.
    fn wait_while_held(&self) {
        let mut held = lock(&self.held);
        while *held && !self.is_closed() {
            held = self
                .held_changed
                .wait_timeout(held, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The offset a topic's next message gets when the core creates its state.
    pub fn next_offset(&self, topic: &[u8]) -> u64 {
        let next = lock(&self.next);
        next.get(topic)
            .copied()
            .unwrap_or_else(|| self.floor.load(Ordering::Relaxed))
    }

    /// One past the highest durable offset of `topic` (`None`: none yet). Durable consumers
    /// read no further: a message written but not yet synced is not theirs yet.
    pub fn durable_next(&self, topic: &[u8]) -> Option<u64> {
        #[cfg(test)]
        self.lookups.fetch_add(1, Ordering::Relaxed);
        lock(&self.durable_next).get(topic).copied()
    }

    /// The topics the log has that appeared since `seen` (all of them from
    /// `TopicsSeen::default()`, or when the list was compacted since), in the order they
    /// appeared, and where the next call starts (for durable consumers' wildcard filters).
    pub fn topics_from(&self, seen: TopicsSeen) -> (Vec<Vec<u8>>, TopicsSeen) {
        let c = lock(&self.changes);
        let from = if seen.epoch == c.epoch { seen.index } else { 0 };
        let new = c.topics.get(from..).unwrap_or_default();
        (
            new.iter()
                .filter(|t| !t.is_empty())
                .map(|t| t.to_vec())
                .collect(),
            TopicsSeen {
                epoch: c.epoch,
                index: c.topics.len(),
            },
        )
    }

    /// Let the log forget topics retention emptied that `broker` holds no state for and every
    /// durable consumer in `consumers` has read to the end (see [`Durable::forget`]).
    pub fn set_forget_gate(
        &self,
        broker: &Arc<aqueduct_core::Broker>,
        consumers: &Arc<crate::consumers::Consumers>,
    ) {
        let _ = self.forget_gate.set(ForgetGate {
            broker: Arc::downgrade(broker),
            consumers: Arc::downgrade(consumers),
        });
    }

    /// What the log's retention asks about the topics it empties (see [`BrokerForgets`]).
    fn forgetter(&self) -> BrokerForgets<'_> {
        let gate = self
            .forget_gate
            .get()
            .and_then(|g| Some((g.broker.upgrade()?, g.consumers.upgrade()?)));
        BrokerForgets {
            durable: self,
            gate,
        }
    }

    /// Forget `chosen` (their offsets are all below `floor`, which the log has on disk): those
    /// the broker holds no state for and nothing past `floor` was handed out for. Decided
    /// while the broker can create no topic, and their next offsets dropped before it can
    /// again: one published to again asks the offset source, which then answers `floor` (or
    /// more).
    fn forget(
        &self,
        broker: &aqueduct_core::Broker,
        chosen: std::collections::HashSet<Box<[u8]>>,
        floor: u64,
    ) -> Vec<Box<[u8]>> {
        // The floor first: a topic dropped below answers it from then on.
        {
            let _next = lock(&self.next);
            self.floor.fetch_max(floor, Ordering::Relaxed);
        }
        // Then wait for the streams handing out offsets now (under `order`, with queueing):
        // every offset given from the old floor is then queued, and the writer appends it at
        // its next write, before it ends the log's grace for the old floor (`run`).
        drop(lock(&self.order));
        let chosen: Vec<Box<[u8]>> = chosen.into_iter().collect();
        let mut forgotten: Vec<Box<[u8]>> = Vec::new();
        // In chunks: each topic's check and drop are atomic with its creation, and publishing
        // to new topics waits for one chunk at most, not the whole pass.
        for chunk in chosen.chunks(FORGET_CHUNK) {
            broker.with_topics_frozen(|held| {
                let mut next = lock(&self.next);
                let mut durable = lock(&self.durable_next);
                for t in chunk {
                    if !held(t) && next.get(t).is_none_or(|n| *n <= floor) {
                        next.remove(t);
                        durable.remove(t);
                        forgotten.push(t.clone());
                    }
                }
            });
        }
        {
            let mut next = lock(&self.next);
            if next.len() < next.capacity() / 4 {
                next.shrink_to_fit();
                lock(&self.durable_next).shrink_to_fit();
            }
        }
        if !forgotten.is_empty() {
            let gone: std::collections::HashSet<&[u8]> = forgotten.iter().map(|t| &**t).collect();
            let mut c = lock(&self.changes);
            let mut emptied = 0;
            for t in c.topics.iter_mut() {
                if !t.is_empty() && gone.contains(&**t) {
                    *t = Box::default();
                    emptied += 1;
                }
            }
            c.forgotten += emptied;
            if c.forgotten * 2 > c.topics.len() {
                c.topics.retain(|t| !t.is_empty());
                c.topics.shrink_to_fit();
                c.forgotten = 0;
                c.epoch += 1;
            }
        }
        forgotten
    }

    /// The topics the log's writes made durable data for since write `seen` (`None`: since
    /// ever), and the writes so far (the next call's `seen`). `None` for the topics if they are
    /// no longer all known (too long ago, or `seen` is `None`): look at every topic then.
    pub fn changed_since(&self, seen: Option<u64>) -> (Option<Vec<Vec<u8>>>, u64) {
        let c = lock(&self.changes);
        let changed = seen.filter(|&s| s >= c.dropped_through).map(|s| {
            let start = c.recent.partition_point(|(w, _)| *w <= s);
            let mut topics: Vec<Vec<u8>> =
                c.recent.range(start..).map(|(_, t)| t.to_vec()).collect();
            topics.sort_unstable();
            topics.dedup();
            topics
        });
        (changed, c.writes)
    }

    /// The last write failed and nothing has been written since: a publish now must be
    /// refused before it is routed. Check under [`Durable::order`].
    pub fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    /// Closed (at shutdown): nothing more is written.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Wait until the log can take `n` more messages, and hold room for them (before routing a
    /// publish frame of `n` messages; keep the room until it is queued). Room is taken under the
    /// queue's lock, so streams woken together cannot all pass one check: what is owed to the
    /// log stays at most [`MAX_OWED`], or one frame when nothing else is. Closed: at once (the
    /// frame is refused then).
    pub async fn wait_room(&self, n: usize) -> Room<'_> {
        if let Some(room) = self.try_room(n) {
            return room;
        }
        // Counted until this returns or is dropped (its stream or connection ended meanwhile).
        let _waiting = RoomWaiter::new(&self.room_waiters);
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if let Some(got) = self.try_room(n) {
                return got;
            }
            room.await;
        }
    }

    /// Streams waiting in [`wait_room`](Self::wait_room) (`pay` wakes them only if there are).
    #[cfg(test)]
    fn room_waiters(&self) -> usize {
        self.room_waiters.load(Ordering::SeqCst)
    }

    /// Room for `n` messages if there is some now.
    fn try_room(&self, n: usize) -> Option<Room<'_>> {
        let q = lock(&self.queue);
        self.fits(&q, n).then(|| {
            self.owed.fetch_add(n, Ordering::SeqCst);
            Room { durable: self, n }
        })
    }

    fn fits(&self, q: &Queue, n: usize) -> bool {
        let owed = self.owed.load(Ordering::SeqCst);
        owed == 0 || (owed + n <= MAX_OWED && q.data.len() < MAX_QUEUED_BYTES) || self.is_closed()
    }

    /// The log owes as much as it may ([`MAX_OWED`], [`MAX_QUEUED_BYTES`]): not even one more
    /// message would get room.
    pub fn is_full(&self) -> bool {
        !self.fits(&lock(&self.queue), 1)
    }

    /// Count `n` records just pushed (under the queue lock).
    fn owe(&self, n: usize) {
        self.owed.fetch_add(n, Ordering::SeqCst);
        self.pushed.fetch_add(n as u64, Ordering::SeqCst);
    }

    /// Wait, up to `within`, until the writer is done with the dead letters queued before
    /// this call (written, or lost to a failed write: see [`unlogged_dead_letters`]), and with
    /// everything queued before them; false if it is not in time. Takes [`Durable::order`]
    /// first, so a broker call that ran under it before this one (a NACK whose message was
    /// dead-lettered: settled at once, its dead letter queued right after) has queued its dead
    /// letters. A checkpoint of the durable consumers' positions saves only after this: a
    /// position past a dead-lettered message is never stored before its dead letter is, so a
    /// crash cannot lose the message (it is delivered again).
    ///
    /// [`unlogged_dead_letters`]: Self::unlogged_dead_letters
    pub fn written_so_far(&self, within: Duration) -> bool {
        let mark = {
            let _order = lock(&self.order);
            self.dead_letters_through.load(Ordering::SeqCst)
        };
        let deadline = Instant::now() + within;
        let mut done = lock(&self.handed_back);
        while *done < mark {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            done = self
                .handed_back_cv
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Messages whose dead letter a failed write lost (a full disk): each topic's lowest such
    /// offset. A checkpoint saves no durable consumer's position in those topics past them, so
    /// after a restart they are delivered again instead of being lost with their dead letter.
    pub fn unlogged_dead_letters(&self) -> Vec<(Vec<u8>, u64)> {
        lock(&self.unlogged)
            .iter()
            .map(|(t, o)| (t.to_vec(), *o))
            .collect()
    }

    /// `n` messages no longer owed (a room given back, or records written); wakes the streams
    /// waiting for room, if any.
    fn pay(&self, n: usize) {
        self.owed.fetch_sub(n, Ordering::SeqCst);
        if self.room_waiters.load(Ordering::SeqCst) > 0 {
            self.room.notify_waiters();
        }
    }

    /// Queue the messages of one routed publish frame. `records` gives each message's topic
    /// state and offset with the publication itself. Call under [`Durable::order`].
    pub fn queue_frame<'a>(
        &self,
        records: impl Iterator<Item = ((Arc<TopicState>, u64), Publication<'a>)>,
        waiter: Waiter,
    ) {
        let mut q = lock(&self.queue);
        let n = Self::push_records(&mut q, records);
        self.owe(n);
        // Even with no messages (an empty PUBLISH_BATCH): its CONFIRM comes in order.
        self.close_group(q, Some(waiter));
    }

    /// Queue copies a cluster peer forwarded (published here with these offsets; no one to
    /// confirm them to). Call under [`Durable::order`], like [`queue_frame`](Self::queue_frame).
    pub fn queue_copies<'a>(
        &self,
        records: impl Iterator<Item = ((Arc<TopicState>, u64), Publication<'a>)>,
    ) {
        let mut q = lock(&self.queue);
        let n = Self::push_records(&mut q, records);
        if n > 0 {
            self.owe(n);
            self.close_group(q, None);
        }
    }

    /// Encode `records` into the queue; returns how many.
    fn push_records<'a>(
        q: &mut Queue,
        records: impl Iterator<Item = ((Arc<TopicState>, u64), Publication<'a>)>,
    ) -> usize {
        let mut n = 0;
        for ((topic, offset), p) in records {
            StoredMessage::encode(&p, &mut q.data);
            let end = q.data.len();
            q.recs.push(Rec { topic, offset, end });
            n += 1;
        }
        n
    }

    /// End a group of records just queued (the caller added some) and wake the writer.
    fn close_group(&self, mut q: MutexGuard<'_, Queue>, waiter: Option<Waiter>) {
        let recs_end = q.recs.len();
        q.groups.push(Group {
            recs_end,
            waiter,
            queued_at: Instant::now(),
        });
        self.stats
            .queued
            .store(q.recs.len() as u64, Ordering::Relaxed);
        drop(q);
        self.ready.notify_one();
    }

    /// Answer a publish frame STORAGE_FAILED, in order with the answers to earlier frames,
    /// without publishing it (the log is failing).
    pub fn queue_refusal(&self, waiter: Waiter) {
        let refused = LogError::InvalidAppend(REFUSED.into());
        // Not an I/O error of its own: the failure was logged when it happened.
        if self.stats.write_errors.fetch_add(1, Ordering::Relaxed) == 0 {
            error!("durable log: could not store 1 publish frame(s): {refused}");
        }
        self.server_stats.error_sent(ErrorCode::STORAGE_FAILED);
        let frame = Frame::new(
            waiter.stream_id,
            Message::Error(ErrorFrame {
                code: ErrorCode::STORAGE_FAILED,
                reason: format!("not stored in the durable log: {refused}"),
            }),
        );
        self.queue_answer(waiter, frame);
    }

    /// Send `frame` (an ERROR answering a frame of `waiter`'s stream) in order with the answers
    /// the log owes that stream for earlier frames: answers on a stream come in request order
    /// (docs/protocol.md §6.4). If the log is closed, at once.
    pub fn queue_answer(&self, waiter: Waiter, frame: Frame) {
        let mut q = lock(&self.queue);
        if q.closing {
            // The writer's last pass may have taken the queue already: nothing queued now would
            // be answered, and the log owes nothing more anyway.
            drop(q);
            waiter.out.push_frame(&frame);
            return;
        }
        let index = q.groups.len();
        // Counted on its stream until it is queued there (the stream's limit on unread
        // replies).
        let bytes = frame.to_bytes().len();
        waiter.out.reply_in_log(bytes);
        q.answers.push((index, frame, bytes));
        self.close_group(q, Some(waiter));
    }

    /// Queue dead letters the broker published (no one to confirm them to). Call under
    /// [`Durable::order`], like [`queue_frame`](Self::queue_frame).
    pub fn queue_dead_letters(&self, records: impl Iterator<Item = DeadLetterRecord>) {
        if self.is_closed() {
            // The shutdown stops everything that makes dead letters before it closes the log;
            // if one still comes, say so rather than lose it silently.
            let late = records.count();
            if late > 0 {
                error!(
                    "durable log: {late} dead letter(s) made after the log closed were not \
                     stored (live subscribers may have them)"
                );
            }
            return;
        }
        let mut q = lock(&self.queue);
        let before = q.recs.len();
        let mut group_start = q.data.len();
        for d in records {
            let at = q.recs.len();
            q.origins
                .push((at, d.original_topic.clone(), d.original_offset));
            StoredMessage::encode_dead_letter(&d, &mut q.data);
            let end = q.data.len();
            q.recs.push(Rec {
                topic: d.topic,
                offset: d.offset,
                end,
            });
            // Many dead letters at once (a stalled group's whole backlog in one tick) are
            // several groups: a group is written in one log batch, which has a size limit, and
            // no publisher waits for these together.
            if end - group_start >= DEAD_LETTER_GROUP_BYTES {
                let recs_end = q.recs.len();
                q.groups.push(Group {
                    recs_end,
                    waiter: None,
                    queued_at: Instant::now(),
                });
                group_start = end;
            }
        }
        if q.recs.len() == before {
            return;
        }
        self.owe(q.recs.len() - before);
        self.dead_letters_through
            .store(self.pushed.load(Ordering::SeqCst), Ordering::SeqCst);
        if q.groups.last().is_some_and(|g| g.recs_end == q.recs.len()) {
            // Every record is in a group already.
            self.stats
                .queued
                .store(q.recs.len() as u64, Ordering::Relaxed);
            drop(q);
            self.ready.notify_one();
        } else {
            self.close_group(q, None);
        }
    }

    /// Run `f` (a broker call that may publish dead letters: a NACK, the ack-wait timer, a
    /// subscription ending) so that its dead letters reach the log in order: under
    /// [`Durable::order`], with the context recording them, queued right after.
    pub fn with_order<T>(
        &self,
        ctx: &mut PublishContext,
        f: impl FnOnce(&mut PublishContext) -> T,
    ) -> T {
        let _order = lock(&self.order);
        ctx.record_dead_letters();
        let result = f(ctx);
        self.queue_dead_letters(ctx.take_dead_letters());
        result
    }

    /// Write what is queued, close the log cleanly and stop the writer.
    pub fn close(&self) {
        {
            // Under the order lock: a publish that comes after this is refused before it is
            // routed (it would hand out offsets the closed log never records).
            let _order = lock(&self.order);
            self.closed.store(true, Ordering::Release);
            lock(&self.queue).closing = true;
        }
        self.ready.notify_one();
        // Streams waiting for room go on (and are refused).
        self.room.notify_waiters();
        let handle = lock(&self.writer).take();
        if let Some(h) = handle {
            if h.join().is_err() {
                error!("the log writer thread panicked");
            }
        }
    }

    fn note_log(&self, log: &Log) {
        let s = log.stats();
        let st = &self.stats;
        st.segments.store(s.segments, Ordering::Relaxed);
        st.previous_key_segments
            .store(s.previous_key_segments, Ordering::Relaxed);
        st.bytes.store(s.bytes, Ordering::Relaxed);
        st.topics.store(s.topics, Ordering::Relaxed);
        st.deleted_segments
            .store(s.deleted_segments, Ordering::Relaxed);
        st.forgotten_topics
            .store(s.forgotten_topics, Ordering::Relaxed);
        st.syncs.store(s.syncs, Ordering::Relaxed);
    }

    fn run(&self, mut log: Log) {
        let mut work = Queue::default();
        let mut last_retention = Instant::now();
        // A retention pass raised the offset floor: what was handed out from the one before is
        // queued, and the log takes it until the next write is done (`Log::end_forget_grace`).
        let mut grace = false;
        let tick = match self.fsync {
            FsyncMode::Interval(every) => every.min(RETENTION_EVERY),
            _ => RETENTION_EVERY,
        };
        loop {
            let closing = {
                let mut q = lock(&self.queue);
                while q.groups.is_empty()
                    && !q.closing
                    && !self.retention_asked.load(Ordering::SeqCst)
                {
                    let (g, timeout) = self
                        .ready
                        .wait_timeout(q, tick)
                        .unwrap_or_else(|e| e.into_inner());
                    q = g;
                    if timeout.timed_out() && q.groups.is_empty() {
                        break;
                    }
                }
                std::mem::swap(&mut *q, &mut work);
                q.closing = work.closing;
                self.stats.queued.store(0, Ordering::Relaxed);
                work.closing
            };
            if !work.groups.is_empty() {
                self.wait_while_held();
                self.write(&mut log, &work);
                // Written (or answered STORAGE_FAILED): no longer owed.
                self.pay(work.recs.len());
                *lock(&self.handed_back) += work.recs.len() as u64;
                self.handed_back_cv.notify_all();
                work.data.clear();
                work.recs.clear();
                work.groups.clear();
                work.answers.clear();
                work.origins.clear();
            } else {
                self.retry_after_failure(&mut log);
                match log.commit() {
                    // An interval sync with nothing new queued: it poisoned the log, so what
                    // comes next is refused before it is routed, as after a failed write.
                    Err(e) if !matches!(e, LogError::Poisoned(_)) => {
                        self.failing.store(true, Ordering::Release);
                        error!("durable log: sync failed: {e}")
                    }
                    // A poisoned log was reported when it happened.
                    _ => {}
                }
            }
            if std::mem::take(&mut grace) {
                log.end_forget_grace();
            }
            let asked = self.retention_asked.swap(false, Ordering::SeqCst);
            if asked || last_retention.elapsed() >= self.retention_every() {
                grace = true;
                last_retention = Instant::now();
                let before = log.stats().forgotten_topics;
                let mut forget = self.forgetter();
                match log.enforce_retention_forgetting(SystemTime::now(), &mut forget) {
                    Ok(deleted) if !deleted.is_empty() => {
                        let forgotten = log.stats().forgotten_topics - before;
                        info!(segments = ?deleted, forgotten_topics = forgotten, "durable log: retention deleted sealed segments");
                        if forgotten >= TRIM_AFTER_FORGETTING {
                            release_free_memory();
                        }
                    }
                    Ok(_) => {}
                    Err(e) => warn!("durable log: retention failed: {e}"),
                }
            }
            self.note_log(&log);
            if closing {
                break;
            }
        }
        match log.close() {
            Ok(()) => info!("durable log closed cleanly"),
            Err(e) => error!("durable log: closing failed ({e}); the next start recovers it"),
        }
    }

    fn write(&self, log: &mut Log, work: &Queue) {
        // Under steady refused traffic the queue is never empty at a swap: try here too.
        self.retry_after_failure(log);
        let mut entries = Vec::with_capacity(work.recs.len());
        let mut start = 0;
        for r in &work.recs {
            entries.push(Entry {
                topic: r.topic.name().as_bytes(),
                offset: r.offset,
                data: &work.data[start..r.end],
            });
            start = r.end;
        }
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // Chunks of whole groups: each group alone with `always` (one sync per publish frame),
        // else as many as fit in one log batch (a batch has a size limit).
        let always = self.fsync == FsyncMode::Always;
        let mut chunks: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
        let (mut g0, mut r0, mut bytes) = (0, 0, 0usize);
        for (gi, g) in work.groups.iter().enumerate() {
            let g_first = if gi == 0 {
                0
            } else {
                work.groups[gi - 1].recs_end
            };
            // Stored data plus each record's framing (kind, lengths, offset, topic).
            let g_bytes = data_end(work, g.recs_end) - data_end(work, g_first)
                + work.recs[g_first..g.recs_end]
                    .iter()
                    .map(|r| 15 + r.topic.name().as_bytes().len())
                    .sum::<usize>();
            if gi > g0 && (always || bytes + g_bytes > MAX_CHUNK_BYTES) {
                chunks.push((g0..gi, r0..g_first));
                (g0, r0, bytes) = (gi, g_first, 0);
            }
            bytes += g_bytes;
        }
        chunks.push((g0..work.groups.len(), r0..work.recs.len()));
        let mut results = Vec::with_capacity(chunks.len());
        for (_, recs) in &chunks {
            let appended = if recs.is_empty() {
                Ok(())
            } else {
                log.append(&entries[recs.clone()], now_ms).map(|_| ())
            };
            let result = if always {
                appended.and_then(|()| log.commit().map(|_| ()))
            } else {
                appended
            };
            results.push(result);
        }
        if !always {
            // One sync for everything appended: the group commit.
            if let Err(e) = log.commit() {
                let failed = e.to_string();
                for r in results.iter_mut().filter(|r| r.is_ok()) {
                    *r = Err(LogError::Poisoned(failed.clone()));
                }
            }
        }
        // Only chunks that wrote something tell whether the log can write: a write of nothing
        // but refusals or empty frames says nothing (and must not end the refusals).
        let wrote: Vec<&Result<(), LogError>> = chunks
            .iter()
            .zip(&results)
            .filter(|((_, recs), _)| !recs.is_empty())
            .map(|(_, r)| r)
            .collect();
        if !wrote.is_empty() {
            let ok = wrote.iter().all(|r| r.is_ok());
            self.failing.store(!ok, Ordering::Release);
        }
        // Dead letters a failed write lost: their messages must not be skipped for good.
        for ((_, recs), result) in chunks.iter().zip(&results) {
            if result.is_ok() {
                continue;
            }
            for (_, topic, offset) in work.origins.iter().filter(|(at, ..)| recs.contains(at)) {
                error!(
                    topic = %topic, offset,
                    "durable log: the dead letter of this message was not written; durable consumers' saved positions in its topic stay at or below it until a restart, which delivers it again"
                );
                let mut unlogged = lock(&self.unlogged);
                let floor = unlogged
                    .entry(Box::from(topic.as_bytes()))
                    .or_insert(*offset);
                *floor = (*floor).min(*offset);
            }
        }
        // Answer-only groups, in group order like the chunks.
        let mut answers = work.answers.iter().peekable();
        for ((groups, recs), result) in chunks.iter().zip(&results) {
            let mut first = recs.start;
            for gi in groups.clone() {
                let g = &work.groups[gi];
                if let Some((_, answer, bytes)) = answers.next_if(|(i, ..)| *i == gi) {
                    // No records: only its answer, in its turn.
                    if let Some(w) = &g.waiter {
                        w.out.push_frame(answer);
                        w.out.reply_out_of_log(*bytes);
                    }
                } else {
                    self.settle(std::slice::from_ref(g), first, work, result);
                }
                first = g.recs_end;
            }
        }
        self.stats.group_commits.fetch_add(1, Ordering::Relaxed);
        // Record the topics' next offsets before their states go: every offset handed out
        // (written or refused, for new topics' first offsets), and what is durable (for durable
        // consumers, who read no further).
        let mut next = lock(&self.next);
        let mut durable = lock(&self.durable_next);
        let mut changes = lock(&self.changes);
        changes.writes += 1;
        let write = changes.writes;
        for ((_, recs), result) in chunks.iter().zip(&results) {
            let recs = &work.recs[recs.clone()];
            // Offsets go up within a topic in queue order: the last record of each run of one
            // topic is all the maps need.
            for (i, r) in recs.iter().enumerate() {
                if recs
                    .get(i + 1)
                    .is_some_and(|next| Arc::ptr_eq(&next.topic, &r.topic))
                {
                    continue;
                }
                let name = r.topic.name().as_bytes();
                let n = r.offset.saturating_add(1);
                if raise(&mut next, name, n) {
                    changes.topics.push(Box::from(name));
                }
                if result.is_ok() {
                    raise(&mut durable, name, n);
                    if changes.recent.len() == MAX_CHANGES {
                        if let Some((w, _)) = changes.recent.pop_front() {
                            changes.dropped_through = w;
                        }
                    }
                    changes.recent.push_back((write, Box::from(name)));
                }
            }
        }
        drop((next, durable, changes));
        // After the changes are recorded: a consumer that looked before this write is woken.
        self.progress.notify_waiters();
    }

    /// The log could not write: try the offsets it owes as marks (they are the first thing it
    /// writes anyway); once that works, publishing goes on.
    fn retry_after_failure(&self, log: &mut Log) {
        if !self.failing.load(Ordering::Acquire) && !log.has_burned() {
            return;
        }
        match log.flush_burned().and_then(|_| log.commit()) {
            Ok(_) => {
                if self.failing.swap(false, Ordering::AcqRel) {
                    info!("durable log: writing again");
                }
            }
            Err(e) => debug!("durable log: still failing: {e}"),
        }
    }

    /// Tell the publishers of `groups` (whose records start at `first`) how their batch fared.
    fn settle(
        &self,
        groups: &[Group],
        mut first: usize,
        work: &Queue,
        result: &Result<(), LogError>,
    ) {
        match result {
            Ok(()) => {
                self.stats.appended_records.fetch_add(
                    (groups.last().map_or(first, |g| g.recs_end) - first) as u64,
                    Ordering::Relaxed,
                );
                for g in groups {
                    // Clients' publish frames only: dead letters and cluster copies have no
                    // publisher waiting here.
                    if g.waiter.is_some() {
                        self.stats.frames_committed.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .commit_wait_us
                            .fetch_add(g.queued_at.elapsed().as_micros() as u64, Ordering::Relaxed);
                    }
                    if let Some(w) = g.waiter.as_ref().filter(|w| w.confirm) {
                        let offsets = work.recs[first..g.recs_end]
                            .iter()
                            .map(|r| r.offset)
                            .collect();
                        w.out.push_frame(&Frame::new(
                            w.stream_id,
                            Message::Confirm(Confirm { offsets }),
                        ));
                    }
                    first = g.recs_end;
                }
            }
            Err(e) => {
                if self
                    .stats
                    .write_errors
                    .fetch_add(groups.len() as u64, Ordering::Relaxed)
                    == 0
                    || e.is_io()
                {
                    error!(
                        "durable log: could not store {} publish frame(s): {e}",
                        groups.len()
                    );
                }
                for g in groups {
                    let Some(w) = &g.waiter else {
                        continue; // dead letters: counted and logged above
                    };
                    self.server_stats.error_sent(ErrorCode::STORAGE_FAILED);
                    w.out.push_frame(&Frame::new(
                        w.stream_id,
                        Message::Error(ErrorFrame {
                            code: ErrorCode::STORAGE_FAILED,
                            reason: format!("not stored in the durable log: {e}"),
                        }),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aqueduct_proto::TopicName;

    /// A plaintext log in `dir`, fsync never, its writer started.
    fn plaintext_log(dir: &std::path::Path) -> Arc<Durable> {
        let opts = aqueduct_log::LogOptions {
            allow_plaintext: true,
            crash_offset_gap: CRASH_OFFSET_GAP,
            ..aqueduct_log::LogOptions::default()
        };
        let (log, rec) = Log::open(dir, opts).expect("log opens");
        Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts")
    }

    /// Streams woken together cannot all take room: what the log owes stays at most
    /// `MAX_OWED` (or one frame, when nothing else is owed), and it is paid back as the writer
    /// writes. Before, every stream woken at a swap found the queue empty and queued its whole
    /// frame, and the offsets handed out and not written could pass the crash gap.
    #[tokio::test]
    async fn room_is_taken_under_the_lock_and_given_back_as_the_writer_writes() {
        use futures_util::task::noop_waker_ref;
        use futures_util::FutureExt;
        use std::task::{Context, Poll};
        let dir = tempfile::tempdir().expect("temp dir");
        let d = plaintext_log(dir.path());
        let half = MAX_OWED / 2;
        let big = d
            .wait_room(half + 1)
            .now_or_never()
            .expect("nothing owed: a frame of any size gets room");
        let mut waiting: Vec<_> = (0..3).map(|_| Some(Box::pin(d.wait_room(half)))).collect();
        fn poll_all<'a, F: std::future::Future<Output = Room<'a>>>(
            waiting: &mut [Option<std::pin::Pin<Box<F>>>],
        ) -> Vec<Room<'a>> {
            let mut cx = Context::from_waker(noop_waker_ref());
            let mut rooms = Vec::new();
            for w in waiting.iter_mut() {
                if let Some(fut) = w {
                    if let Poll::Ready(room) = fut.as_mut().poll(&mut cx) {
                        rooms.push(room);
                        *w = None;
                    }
                }
            }
            rooms
        }
        assert!(poll_all(&mut waiting).is_empty(), "over MAX_OWED: all wait");
        drop(big);
        let rooms = poll_all(&mut waiting);
        assert_eq!(
            rooms.len(),
            2,
            "two halves fit in MAX_OWED, the third waits"
        );
        assert_eq!(d.owed.load(Ordering::Relaxed), MAX_OWED);
        // Messages queued under a room stay owed after it is given back, until written.
        let broker = aqueduct_core::Broker::new(aqueduct_core::BrokerConfig::default());
        let topic = TopicName::try_from("t").expect("valid");
        let mut ctx = PublishContext::default();
        broker.publish(&mut ctx, &Publication::new(&topic, b"x"), Instant::now());
        let state = broker.topic(&topic).expect("created");
        d.hold_writes(true);
        {
            let _order = lock(&d.order);
            d.queue_copies((0..3).map(|o| ((state.clone(), o), Publication::new(&topic, b"x"))));
        }
        drop(rooms);
        assert_eq!(d.owed.load(Ordering::Relaxed), 3, "queued, not yet written");
        let third = poll_all(&mut waiting);
        assert_eq!(third.len(), 1, "room again for the third");
        assert_eq!(d.owed.load(Ordering::Relaxed), 3 + half);
        d.hold_writes(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.owed.load(Ordering::Relaxed) != half {
            assert!(
                Instant::now() < deadline,
                "the writer pays back what it wrote"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(third);
        assert_eq!(d.owed.load(Ordering::Relaxed), 0);
        d.close();
    }

    /// Durable consumers learn which topics the log's writes changed since they last looked,
    /// and the topics that appeared; one that fell too far behind is told to look at all.
    #[tokio::test]
    async fn the_log_says_which_topics_its_writes_changed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = plaintext_log(dir.path());
        let broker = aqueduct_core::Broker::new(aqueduct_core::BrokerConfig::default());
        let write = |names: &[String]| {
            let mut ctx = PublishContext::default();
            let states: Vec<_> = names
                .iter()
                .map(|n| {
                    let topic = TopicName::try_from(n.as_str()).expect("valid");
                    broker.publish(&mut ctx, &Publication::new(&topic, b"x"), Instant::now());
                    (topic.clone(), broker.topic(&topic).expect("created"))
                })
                .collect();
            let _order = lock(&d.order);
            d.queue_copies(
                states
                    .iter()
                    .map(|(t, s)| ((s.clone(), 0), Publication::new(t, b"x"))),
            );
        };
        let (changed, start) = d.changed_since(None);
        assert!(changed.is_none(), "never looked: look at all");
        write(&["a".into(), "b".into()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.changed_since(Some(start)).1 == start {
            assert!(Instant::now() < deadline, "written");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (changed, after) = d.changed_since(Some(start));
        assert_eq!(changed, Some(vec![b"a".to_vec(), b"b".to_vec()]));
        let (changed, _) = d.changed_since(Some(after));
        assert_eq!(changed, Some(vec![]), "nothing since");
        let (topics, seen) = d.topics_from(TopicsSeen::default());
        assert_eq!(topics, [b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(d.topics_from(seen).0, Vec::<Vec<u8>>::new());
        // One write of more topics than the changes keep: a consumer that had not seen it is
        // told to look at all.
        let many: Vec<String> = (0..MAX_CHANGES + 10).map(|i| format!("m/{i}")).collect();
        write(&many);
        while d.changed_since(Some(after)).1 == after {
            assert!(Instant::now() < deadline, "written");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(d.changed_since(Some(after)).0.is_none(), "too far behind");
        let (changed, now) = d.changed_since(None);
        assert!(changed.is_none());
        assert_eq!(d.changed_since(Some(now)).0, Some(vec![]));
        assert_eq!(d.topics_from(seen).0.len(), MAX_CHANGES + 10);
        d.close();
    }

    /// Forgetting topics: only those the broker holds no state for and nothing past the floor
    /// was handed out for; their next offsets go, the floor answers for them, and the list of
    /// topics durable consumers read drops them — as empty names at first, compacted (with a
    /// new epoch, so a consumer reads it again from its start) once they are the most.
    #[tokio::test]
    async fn forgotten_topics_start_at_the_floor_and_leave_the_topic_list() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = plaintext_log(dir.path());
        let (broker, consumers, _positions) = broker_and_consumers();
        let name = |i: usize| format!("t/{i}").into_bytes().into_boxed_slice();
        {
            let mut next = lock(&d.next);
            let mut durable = lock(&d.durable_next);
            let mut changes = lock(&d.changes);
            for i in 0..10 {
                next.insert(name(i), 3);
                durable.insert(name(i), 3);
                changes.topics.push(name(i));
            }
            // Offsets past the floor were handed out for this one: kept.
            next.insert(Box::from(&b"big"[..]), 9);
            changes.topics.push(Box::from(&b"big"[..]));
            next.insert(Box::from(&b"held"[..]), 1);
            changes.topics.push(Box::from(&b"held"[..]));
        }
        let held = TopicName::try_from("held").expect("valid");
        broker.publish(
            &mut PublishContext::default(),
            &Publication::new(&held, b"x"),
            Instant::now(),
        );
        // In use (as by a message queued for the log): not idle, so not freed.
        let _in_use = broker.topic(&held).expect("created");
        let before = d.topics_from(TopicsSeen::default()).1;
        use aqueduct_log::Forget;
        let offer = |names: &[&[u8]]| names.iter().map(|n| Box::from(*n)).collect::<Vec<_>>();
        // No gate yet: nothing is chosen or forgotten.
        assert!(d.forgetter().choose(&offer(&[b"t/0"])).is_empty());
        assert!(d.forgetter().forget(&offer(&[b"t/0"]), 5).is_empty());
        d.set_forget_gate(&broker, &consumers);
        // The broker holds "held": not chosen. "big" is, but it is not forgotten: offsets past
        // the floor were handed out for it.
        let mut chosen = d.forgetter().choose(&offer(&[b"t/0", b"big", b"held"]));
        chosen.sort();
        assert_eq!(chosen, offer(&[b"big", b"t/0"]));
        // One of twelve: left as an empty name, the list not compacted.
        assert_eq!(d.forgetter().forget(&chosen, 5), offer(&[b"t/0"]));
        assert_eq!(d.next_offset(b"t/0"), 5, "the floor");
        assert_eq!(d.durable_next(b"t/0"), None);
        assert_eq!(d.next_offset(b"big"), 9);
        assert_eq!(d.next_offset(b"held"), 1);
        assert!(!lock(&d.next).contains_key(&b"t/0"[..]), "dropped");
        let (all, seen) = d.topics_from(TopicsSeen::default());
        assert_eq!(all.len(), 11);
        assert!(!all.contains(&b"t/0".to_vec()));
        assert_eq!(
            seen, before,
            "not compacted: a consumer goes on where it was"
        );
        // Six more: seven of twelve are forgotten, and the list is compacted.
        let mut six: Vec<Box<[u8]>> = (1..7).map(name).collect();
        let mut got = d.forgetter().forget(&six, 5);
        got.sort();
        six.sort();
        assert_eq!(got, six);
        let (again, seen) = d.topics_from(before);
        assert_eq!(
            again.len(),
            5,
            "a new epoch: read again from the start: {again:?}"
        );
        assert_ne!(seen, before);
        assert_eq!(lock(&d.changes).topics.len(), 5);
        assert_eq!(d.topics_from(seen).0, Vec::<Vec<u8>>::new());
        d.close();
    }

    /// A broker, and durable consumers (none yet) with their positions in a temporary directory.
    fn broker_and_consumers() -> (
        Arc<aqueduct_core::Broker>,
        Arc<crate::consumers::Consumers>,
        tempfile::TempDir,
    ) {
        let broker = Arc::new(aqueduct_core::Broker::new(
            aqueduct_core::BrokerConfig::default(),
        ));
        let positions = tempfile::tempdir().expect("temp dir");
        let consumers = Arc::new(
            crate::consumers::Consumers::open(positions.path(), Default::default())
                .expect("consumers"),
        );
        (broker, consumers, positions)
    }

    /// A durable log with 1 KiB segments and 4 KiB of retention (passes only when asked), a
    /// broker whose offset source it is, and the gate that lets it forget topics.
    struct Forgetting {
        d: Arc<Durable>,
        broker: Arc<aqueduct_core::Broker>,
        consumers: Arc<crate::consumers::Consumers>,
        _dirs: [tempfile::TempDir; 2],
        deadline: Instant,
    }

    impl Forgetting {
        /// A durable consumer `key` of `filter` from the earliest message (`at`: the positions
        /// it starts with), its feeder not started.
        fn claim(
            &self,
            key: &str,
            filter: &str,
            at: std::collections::BTreeMap<Vec<u8>, u64>,
        ) -> crate::consumers::Claim {
            let filter = aqueduct_proto::TopicFilter::try_from(filter).expect("valid");
            let spec = aqueduct_proto::SubscribeSpec::new(filter.clone());
            self.consumers
                .claim(
                    key,
                    &filter,
                    false,
                    || at,
                    || {
                        self.broker
                            .subscribe_unrouted(&spec, aqueduct_core::SubscribeOptions::default())
                    },
                )
                .unwrap_or_else(|e| panic!("{e:?}"))
        }

        /// Start the feeder of `key`, claimed as `claim`.
        fn feed(&self, key: &str, claim: &crate::consumers::Claim) {
            use crate::consumers::{feed, Target};
            self.consumers.start_feeder(
                key,
                &claim.fed,
                feed(
                    self.d.clone(),
                    self.broker.clone(),
                    Target::One(claim.sub.clone()),
                    claim.fed.clone(),
                    aqueduct_proto::DurableStart::Earliest,
                    false,
                ),
            );
        }

        fn start() -> Forgetting {
            let dir = tempfile::tempdir().expect("temp dir");
            let opts = aqueduct_log::LogOptions {
                allow_plaintext: true,
                crash_offset_gap: CRASH_OFFSET_GAP,
                max_segment_bytes: 1024,
                retention_bytes: Some(4096),
                ..aqueduct_log::LogOptions::default()
            };
            let (log, rec) = Log::open(dir.path(), opts).expect("log opens");
            let d = Durable::start(log, &rec, FsyncMode::Never, Arc::default()).expect("starts");
            // However slow the machine, no pass before the one a test asks for.
            d.only_asked_retention();
            let (broker, consumers, positions) = broker_and_consumers();
            broker.set_offset_source(Box::new({
                let d = d.clone();
                move |t| d.next_offset(t.as_bytes())
            }));
            d.set_forget_gate(&broker, &consumers);
            Forgetting {
                d,
                broker,
                consumers,
                _dirs: [dir, positions],
                deadline: Instant::now() + Duration::from_secs(20),
            }
        }

        /// Publish one message of `name` (not queued for the log): its topic state, kept (as a
        /// queued message keeps it), and offset.
        fn hand_out(&self, name: &TopicName) -> (Arc<aqueduct_core::TopicState>, u64) {
            let mut ctx = PublishContext::default();
            let offset = self
                .broker
                .publish(&mut ctx, &Publication::new(name, b"x"), Instant::now())
                .offset;
            (self.broker.topic(name).expect("created"), offset)
        }

        /// Queue what [`hand_out`](Self::hand_out) gave (call under `order`).
        fn queue(&self, name: &TopicName, (state, offset): (Arc<aqueduct_core::TopicState>, u64)) {
            self.d.queue_copies(std::iter::once((
                (state, offset),
                Publication::new(name, b"x"),
            )));
        }

        /// Publish one message of `topic` and queue it, as a stream does; its offset.
        fn publish(&self, topic: &str) -> u64 {
            let name = TopicName::try_from(topic).expect("valid");
            let _order = lock(&self.d.order);
            let given = self.hand_out(&name);
            let offset = given.1;
            self.queue(&name, given);
            offset
        }

        /// Wait until `topic`'s messages up to `next` are written.
        async fn written(&self, topic: &str, next: u64) {
            while self.d.durable_next(topic.as_bytes()) != Some(next) {
                assert!(Instant::now() < self.deadline, "{topic} never written");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }

    /// A checkpoint of positions waits for what was queued before it — a dead letter of a
    /// message whose settlement moved a position — to be written, and is told when it was not
    /// (still unwritten after the wait: a crash now would lose the dead letter, while the saved
    /// position would skip its message). Before, positions were saved on their own timer,
    /// whatever the writer had done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_waits_for_the_dead_letters_queued_before_it() {
        let f = Forgetting::start();
        assert!(f.d.written_so_far(Duration::from_secs(5)), "nothing queued");
        f.d.hold_writes(true);
        // Publishes waiting for the writer are not waited for (a backlog under `always` would
        // hold every save back): only dead letters are.
        f.publish("jobs");
        assert!(
            f.d.written_so_far(Duration::from_millis(1)),
            "a queued publish is not waited for"
        );
        let dlq = TopicName::try_from("__dlq__jobs").expect("valid");
        let (topic, offset) = f.hand_out(&dlq);
        {
            let _order = lock(&f.d.order);
            f.d.queue_dead_letters(std::iter::once(DeadLetterRecord {
                topic,
                offset,
                priority: aqueduct_proto::Priority::new(2).expect("valid"),
                body: bytes::Bytes::from_static(b"poison"),
                trace: None,
                compression: None,
                original_topic: TopicName::try_from("jobs").expect("valid"),
                original_offset: 7,
                attempts_made: 4,
                reason: "nacked".into(),
            }));
        }
        assert!(
            !f.d.written_so_far(Duration::from_millis(100)),
            "the dead letter is not written yet"
        );
        // A consumer's position moved meanwhile: the checkpoint saves nothing yet.
        let claim = f.claim("consumer:c", "jobs", Default::default());
        lock(&claim.fed).set(b"jobs", 8);
        let positions = f._dirs[1].path().join("consumers");
        let checkpoint = |wait| {
            f.consumers
                .checkpoint(|| crate::consumers::log_done(&f.d, wait))
                .expect("no error")
        };
        assert!(
            !checkpoint(Duration::from_millis(100)),
            "saved before the dead letter"
        );
        assert!(!positions.exists(), "nothing saved");
        f.d.hold_writes(false);
        assert!(f.d.written_so_far(Duration::from_secs(10)), "written now");
        assert!(checkpoint(Duration::from_secs(10)), "saved now");
        let (_, saved) = aqueduct_log::PositionStore::open(f._dirs[1].path()).expect("saved");
        assert_eq!(saved["consumer:c"].next.get(&b"jobs"[..]), Some(&8));
        f.written("__dlq__jobs", offset + 1).await;
        f.d.close();
    }

    /// A wildcard durable consumer that has read its topics to the end does not keep the log
    /// from forgetting them: its positions in them go with them, and it still gets a forgotten
    /// topic's next message, past the floor (found again as a new topic, not taken for
    /// retention overtaking it). A consumer short of a topic's end keeps that one. Before, any
    /// position kept a topic for good: a `#` consumer kept every topic the log ever had.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_consumer_that_read_its_topics_to_the_end_lets_the_log_forget_them() {
        use std::collections::BTreeMap;
        let f = Forgetting::start();
        for i in 0..10 {
            f.publish(&format!("old/{i}"));
            f.written(&format!("old/{i}"), 1).await;
        }
        // `w` reads all ten; `s` is at offset 0 of old/9 (not fed: it reads nothing).
        let w = f.claim("consumer:w", "old/#", BTreeMap::new());
        let s = f.claim(
            "consumer:s",
            "old/9",
            BTreeMap::from([(b"old/9".to_vec(), 0)]),
        );
        f.feed("consumer:w", &w);
        let drained = |n: usize| {
            let sub = w.sub.clone();
            let broker = f.broker.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(20);
                let mut got = 0;
                while got < n {
                    assert!(Instant::now() < deadline, "{got} of {n} fed");
                    let mut out = Vec::new();
                    got += broker.drain(&sub, &mut out, 1 << 20, Instant::now()).frames;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        };
        drained(10).await;
        for i in 0..100 {
            f.publish("filler");
            f.written("filler", i + 1).await;
        }
        f.d.ask_retention();
        while f.d.stats.forgotten_topics.load(Ordering::Relaxed) < 9 {
            assert!(Instant::now() < f.deadline, "retention forgot old/0..=8");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            f.d.durable_next(b"old/9"),
            Some(1),
            "kept: `s` has not read it"
        );
        assert_eq!(
            lock(&w.fed).positions().keys().cloned().collect::<Vec<_>>(),
            vec![b"old/9".to_vec()],
            "the positions in the forgotten topics went"
        );
        // Logged again: past the floor, and `w` gets it.
        let floor = f.d.next_offset(b"never-seen");
        assert!(floor >= 1);
        assert_eq!(f.publish("old/3"), floor);
        f.written("old/3", floor + 1).await;
        drained(1).await;
        assert_eq!(
            lock(&w.fed).positions().get(&b"old/3"[..]),
            Some(&(floor + 1))
        );
        assert_eq!(f.d.stats.consumers_overtaken.load(Ordering::Relaxed), 0);
        drop(s);
        f.d.close();
    }

    /// A feeder that read a topic cleanly up to where its durable messages end, with offsets
    /// below that end holding no message (offsets whose writes failed, written as marks), moves
    /// its position to that end. Before, it stayed after the last message: the topic was read
    /// again at every write of the log, and never counted as read to its end (so the log could
    /// never forget it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_feeder_that_read_a_topic_to_its_end_moves_past_offsets_without_messages() {
        let f = Forgetting::start();
        for i in 0..3 {
            assert_eq!(f.publish("t"), i);
            f.written("t", i + 1).await;
        }
        // Offsets 3..=9 taken by writes that failed: what is durable of `t` ends at 10.
        lock(&f.d.durable_next).insert(Box::from(&b"t"[..]), 10);
        let c = f.claim("consumer:c", "t", Default::default());
        f.feed("consumer:c", &c);
        while lock(&c.fed).positions().get(&b"t"[..]) != Some(&10) {
            assert!(
                Instant::now() < f.deadline,
                "at {:?}, {} queued",
                lock(&c.fed).positions().get(&b"t"[..]),
                c.sub.queued()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(c.sub.queued(), 3, "every message, then the end");
        assert_eq!(f.d.stats.consumers_overtaken.load(Ordering::Relaxed), 0);
        f.d.close();
    }

    /// A topic new to the log whose first offset the broker handed out from the floor before a
    /// retention pass raised it (its message waited for the writer) is still stored after the
    /// pass. Before, the log refused it (its offset was below the new floor) and with it the
    /// whole batch: STORAGE_FAILED for every publisher in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_topic_given_the_floor_before_a_pass_is_stored_after_it() {
        let f = Forgetting::start();
        // Ten topics at offset 0, then enough of another that retention empties them.
        for i in 0..10 {
            assert_eq!(f.publish(&format!("old/{i}")), 0);
            f.written(&format!("old/{i}"), 1).await;
        }
        for i in 0..100 {
            f.publish("filler");
            f.written("filler", i + 1).await;
        }
        // A new topic: its first offset handed out now (the floor, 0), its message not queued yet.
        let fresh = TopicName::try_from("fresh").expect("valid");
        let given = f.hand_out(&fresh);
        assert_eq!(given.1, 0);
        f.d.ask_retention();
        while f.d.stats.forgotten_topics.load(Ordering::Relaxed) < 10 {
            assert!(
                Instant::now() < f.deadline,
                "retention forgot the old topics"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(f.d.next_offset(b"old/3"), 1, "past the floor");
        {
            let _order = lock(&f.d.order);
            f.queue(&fresh, given);
        }
        f.written("fresh", 1).await;
        assert_eq!(f.d.stats.write_errors.load(Ordering::Relaxed), 0);
        assert!(!f.d.is_failing());
        // A forgotten topic goes on from the floor.
        assert_eq!(f.publish("old/3"), 1);
        f.written("old/3", 2).await;
        f.d.close();
    }

    /// A stream that got a new topic's first offset from the floor just before a retention
    /// pass raised it, and queues the message only after the pass: the pass waits for it
    /// (under `order`, where offsets are handed out and queued), so the writer appends it while
    /// the log still takes the old floor. Without that wait the pass ended, the writer ended
    /// the log's grace at its next write, and the late message was refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_waits_for_offsets_handed_out_before_it_to_be_queued() {
        let f = Forgetting::start();
        f.publish("old");
        f.written("old", 1).await;
        for i in 0..100 {
            f.publish("filler");
            f.written("filler", i + 1).await;
        }
        // A stream routing a frame: it holds `order`, and got the floor (0) for a new topic.
        let order = lock(&f.d.order);
        let late = TopicName::try_from("late").expect("valid");
        let given = f.hand_out(&late);
        assert_eq!(given.1, 0);
        f.d.ask_retention();
        while f.d.next_offset(b"never-seen") == 0 {
            assert!(Instant::now() < f.deadline, "the pass raises the floor");
            std::thread::yield_now();
        }
        // Another stream's frame: a pass that did not wait would end now, and the writer's
        // next write (this one) would end the log's grace before `late` is queued. Waited for
        // up to half a second: with the wait in the pass, it is written only after `order` is
        // released.
        let other = TopicName::try_from("other").expect("valid");
        f.queue(&other, f.hand_out(&other));
        let until = Instant::now() + Duration::from_millis(500);
        while f.d.durable_next(b"other").is_none() && Instant::now() < until {
            std::thread::yield_now();
        }
        f.queue(&late, given);
        drop(order);
        f.written("late", 1).await;
        assert_eq!(f.d.stats.write_errors.load(Ordering::Relaxed), 0);
        assert_eq!(f.d.stats.forgotten_topics.load(Ordering::Relaxed), 1);
        f.d.close();
    }

    /// A stream whose wait for room ends unfinished (its stream or connection closed) is no
    /// longer counted as waiting: before, the count stayed up for good and every payment woke
    /// the waiters' `Notify` for nobody.
    #[tokio::test]
    async fn a_wait_for_room_dropped_unfinished_is_no_longer_counted() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let d = plaintext_log(dir.path());
        let big = d
            .wait_room(MAX_OWED)
            .now_or_never()
            .expect("nothing owed: room at once");
        let mut waiting = Box::pin(d.wait_room(1));
        assert!((&mut waiting).now_or_never().is_none(), "over MAX_OWED");
        assert_eq!(d.room_waiters(), 1);
        drop(waiting);
        assert_eq!(d.room_waiters(), 0, "uncounted when dropped");
        let got = d.wait_room(1);
        drop(big);
        let _room = got.now_or_never().expect("room once it is given back");
        assert_eq!(d.room_waiters(), 0);
        d.close();
    }

    /// Many dead letters made at once (here two of 40 MiB: a batch holds at most 64 MiB) are
    /// all stored: they are split into groups a log batch takes. Before, they were one group,
    /// its batch was refused, nothing of it was stored and the log counted as failing.
    #[tokio::test]
    async fn dead_letters_larger_than_a_batch_together_are_all_stored() {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = plaintext_log(dir.path());
        let broker = aqueduct_core::Broker::new(aqueduct_core::BrokerConfig::default());
        let dlq = TopicName::try_from("__dlq__t").expect("valid");
        let mut ctx = PublishContext::default();
        broker.publish(&mut ctx, &Publication::new(&dlq, b"x"), Instant::now());
        let state = broker.topic(&dlq).expect("created");
        let original = TopicName::try_from("t").expect("valid");
        let body = bytes::Bytes::from(vec![7u8; 40 << 20]);
        let records = (0..2u64).map(|i| DeadLetterRecord {
            topic: state.clone(),
            offset: i,
            priority: aqueduct_proto::Priority::DEFAULT,
            body: body.clone(),
            trace: None,
            compression: None,
            original_topic: original.clone(),
            original_offset: i,
            attempts_made: 3,
            reason: "nacked".into(),
        });
        {
            let _order = lock(&d.order);
            d.queue_dead_letters(records);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while d.index.last_offset(b"__dlq__t") != Some(1) {
            assert!(!d.is_failing(), "the log refused the dead letters");
            assert!(
                Instant::now() < deadline,
                "the dead letters were not stored"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!d.is_failing());
        d.close();
    }

    #[test]
    fn stored_messages_round_trip() {
        let topic = TopicName::try_from("a/b").expect("valid");
        let trace = TraceContext {
            trace_id: [1; 16],
            span_id: [2; 8],
            flags: 1,
        };
        let comp = Compression {
            algorithm: 1,
            uncompressed_len: 99,
        };
        let mut p = Publication::new(&topic, b"body");
        for (ttl, tr, c) in [
            (None, None, None),
            (Some(Duration::from_millis(1500)), Some(&trace), Some(&comp)),
            (None, Some(&trace), None),
        ] {
            p.ttl = ttl;
            p.trace = tr;
            p.compression = c;
            p.priority = Priority::new(3).expect("valid");
            let mut out = Vec::new();
            StoredMessage::encode(&p, &mut out);
            let m = StoredMessage::decode(&out).expect("decodes");
            assert_eq!(m.body, b"body");
            assert_eq!(m.ttl_ms, ttl.map(|d| d.as_millis() as u32));
            assert_eq!(m.trace.as_ref(), tr);
            assert_eq!(m.compression.as_ref(), c);
            assert_eq!(m.priority.level(), 3);
            for cut in 0..2 {
                assert!(StoredMessage::decode(&out[..cut]).is_none());
            }
        }
    }
}
