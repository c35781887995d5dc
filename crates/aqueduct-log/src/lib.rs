//! Aqueduct's append-only log ("AAL"): where confirmed messages live across restarts.
//!
//! - **Shared segments.** Every topic's messages go into one sequence of segment files
//!   (`<id>.seg` in the log directory, `aal.file_path`), rotated at `aal.max_aal_size`. A
//!   hundred thousand topics need no more open files than one: the active segment, plus one per
//!   reader. Each segment has an index file (`<id>.idx`) with every topic's first, last and
//!   highest offset and sparse entry points, so reading one topic from an offset seeks and then
//!   reads forward; the cost of sharing is that a reader skips over other topics' batches
//!   within a window (at most [`STRIDE`](segment) bytes per entry point).
//! - **Batches** are the unit of writing: one frame, one CRC-32C over the bytes as stored, and
//!   (with a key) one AES-256-GCM seal under the segment's own data key and a counter nonce; see
//!   [`crypto`] for why nonces never repeat.
//! - **Recovery** reads index files, not data: only a segment without a valid index (the one
//!   being written when the broker crashed) is read through. A torn tail is cut; a checked
//!   batch that fails authentication stops the open ([`LogError::Tampered`]); damage in the
//!   middle is recorded, skipped by readers and never deleted.
//! - **Offsets** belong to the broker (per topic); the log refuses to take one twice (only the
//!   explicit [`Log::truncate_after`] rolls a topic back), keeps the offsets of failed appends
//!   as taken, and, after a crash, moves every topic past what may have been handed out unwritten
//!   ([`LogOptions::crash_offset_gap`]). A topic retention emptied can be *forgotten*
//!   ([`Log::enforce_retention_forgetting`]): the log then keeps nothing of it, and it starts
//!   past a log-wide offset floor (a mark under [`FLOOR_TOPIC`]) if it comes back.
//!
//! The API is narrow — [`Log::append`], [`Log::read`], [`Log::truncate_after`],
//! [`Log::purge_before`], [`Log::next_offset`] / [`Log::last_offset`] — so that the same
//! storage can later sit under a replicated log. The on-disk format is in [`format`].

pub mod crypto;
mod error;
pub mod format;
mod log;
mod positions;
mod reader;
mod rekey;
mod segment;
mod verify;

pub use crypto::MasterKey;
pub use error::LogError;
pub use log::{
    Entry, Forget, FsyncMode, Log, LogIndex, LogOptions, LogStats, LogView, Position, Recovery,
    FLOOR_TOPIC, LOCK_FILE,
};
pub use positions::{ConsumerPosition, PositionStore, Positions};
pub use reader::{ReadCache, Reader, Record};
pub use rekey::{rekey, RekeyReport};
pub use verify::{verify, VerifyReport};
