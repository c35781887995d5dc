//! Reading one topic from an offset: seek with the sparse index, then read forward.

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use crate::crypto::SegmentCipher;
use crate::format::{
    batch_aad, decode_records, BodyHeader, FrameCheck, Kind, BODY_HEADER, FRAME_PREFIX,
};
use crate::segment::{frame_at, Segment, STRIDE};
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
}

/// The messages of one topic from an offset on, as the log held them when the reader was
/// made. Reads only the index's windows for the topic: a topic that is rare in a busy log costs
/// about one [`STRIDE`] of reading per index entry, not the whole segment.
#[derive(Debug)]
pub struct Reader {
    topic: Vec<u8>,
    next: u64,
    plans: VecDeque<Plan>,
    file: Option<(u64, File)>,
    ready: VecDeque<Record>,
    buf: Vec<u8>,
}

impl Reader {
    pub(crate) fn new(segments: &[Segment], topic: &[u8], from: u64) -> Reader {
        let mut plans = VecDeque::new();
        for seg in segments {
            let Some(span) = seg.topics.get(topic) else {
                continue;
            };
            match span.data {
                Some((_, last)) if last >= from => {}
                _ => continue,
            }
            let start = span
                .entries
                .iter()
                .rposition(|&(offset, _)| offset <= from)
                .unwrap_or(0);
            let entries = &span.entries[start..];
            let windows = entries
                .iter()
                .enumerate()
                .map(|(i, &(_, pos))| {
                    let next = entries.get(i + 1).map_or(seg.len, |&(_, p)| p);
                    (pos, next.min(pos.saturating_add(STRIDE)).min(seg.len))
                })
                .collect();
            plans.push_back(Plan {
                path: seg.path.clone(),
                id: seg.id,
                len: seg.len,
                cipher: seg.cipher.clone(),
                damage: seg.damage.clone(),
                windows,
            });
        }
        Reader {
            topic: topic.to_vec(),
            next: from,
            plans,
            file: None,
            ready: VecDeque::new(),
            buf: Vec::new(),
        }
    }

    /// Read the next batch of the current window into `ready`. Returns false when the reader
    /// has nothing left to read.
    fn advance(&mut self) -> Result<bool, LogError> {
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
        if self.file.as_ref().is_none_or(|(id, _)| *id != plan.id) {
            let f = match File::open(&plan.path) {
                Ok(f) => f,
                Err(e) => {
                    // Gone (deleted by retention since): nothing more to read there.
                    let path = plan.path.clone();
                    self.plans.pop_front();
                    return Err(LogError::io("opening segment", path, e));
                }
            };
            self.file = Some((plan.id, f));
        }
        let Some((_, file)) = &self.file else {
            return Ok(true);
        };
        let check = match frame_at(file, pos, plan.len, &mut self.buf) {
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
                match bad {
                    // Its length still reads: skip just this batch.
                    FrameCheck::BadCrc { len } => {
                        plan.windows[0].0 = pos.saturating_add(len as u64)
                    }
                    // The frame boundary is lost: give up this window, go on with the next.
                    _ => {
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
        plan.windows[0].0 = pos + len as u64;
        let body = &mut self.buf[FRAME_PREFIX..];
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
        let records = decode_records(&body[BODY_HEADER..BODY_HEADER + payload_len], header.count)
            .map_err(|e| damaged(&e))?;
        for r in records {
            if r.kind == Kind::Data && r.topic == self.topic.as_slice() && r.offset >= self.next {
                self.next = r.offset.saturating_add(1);
                self.ready.push_back(Record {
                    offset: r.offset,
                    timestamp_ms: header.timestamp_ms,
                    data: r.data.to_vec(),
                });
            }
        }
        Ok(true)
    }
}

impl Iterator for Reader {
    type Item = Result<Record, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(r) = self.ready.pop_front() {
                return Some(Ok(r));
            }
            match self.advance() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}
