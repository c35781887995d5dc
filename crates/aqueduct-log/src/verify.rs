//! Checking a log offline (`aqueduct log verify`): every frame of every segment, read-only.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::crypto::MasterKey;
use crate::segment::{open_header, scan, segment_path};
use crate::LogError;

/// What [`verify`] found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub segments: usize,
    pub batches: u64,
    pub bytes: u64,
    pub topics: usize,
    /// Damaged byte ranges: (segment file, position, length).
    pub damage: Vec<(PathBuf, u64, u64)>,
    /// Bytes at the end of the last segment that a crash left half-written (the broker cuts
    /// them at its next start).
    pub torn_tail: u64,
    /// Segments that could not be checked at all, and why (bad header, wrong key, tampering).
    pub failures: Vec<(PathBuf, String)>,
    /// Per previous key given (`keys[1..]`): the segments sealed with it. A key whose count is
    /// 0 is no longer needed.
    pub previous_key_segments: Vec<usize>,
    /// Segments listed at the start that were gone when their turn came: deleted by a running
    /// broker's retention meanwhile, not damage.
    pub deleted_meanwhile: usize,
}

impl VerifyReport {
    /// Nothing damaged, nothing that failed; a torn tail alone is not a problem.
    pub fn is_ok(&self) -> bool {
        self.damage.is_empty() && self.failures.is_empty()
    }
}

/// Read every segment in `dir` through, without changing anything. `keys`: the current key,
/// then any previous ones (as `LogOptions::previous_keys`); empty for a plaintext log.
/// `progress` is called with (bytes checked, total bytes).
pub fn verify(
    dir: &Path,
    keys: &[MasterKey],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VerifyReport, LogError> {
    let ids: Vec<(u64, u64)> = crate::log::list_segments_read_only(dir)?
        .into_iter()
        .map(|(id, path)| (id, std::fs::metadata(path).map_or(0, |m| m.len())))
        .collect();
    let total: u64 = ids.iter().map(|(_, len)| len).sum();
    let mut report = VerifyReport {
        previous_key_segments: vec![0; keys.len().saturating_sub(1)],
        ..VerifyReport::default()
    };
    let mut done = 0;
    let mut topics = std::collections::HashSet::new();
    // A plaintext segment after a sealed one is a failure: the broker refuses it at open.
    let mut seal_order = crate::segment::SealOrder::default();
    for (i, &(id, len)) in ids.iter().enumerate() {
        let path = segment_path(dir, id);
        // Gone since the listing: retention (the oldest segments) on a running broker.
        if i + 1 < ids.len() && !path.exists() {
            report.deleted_meanwhile += 1;
            done += len;
            continue;
        }
        report.segments += 1;
        let result = File::open(&path)
            .map_err(|e| LogError::io("opening segment", &path, e))
            .and_then(|file| {
                // Reporting, not trusting: plaintext segments are read too.
                let (header, cipher) = open_header(&path, &file, keys, true)?;
                seal_order.next(&path, cipher.is_some())?;
                let counts = &mut report.previous_key_segments;
                if let Some(n) = cipher.as_deref().and_then(|c| c.previous_key(counts)) {
                    *n += 1;
                }
                // A bad end of the newest segment is a torn tail, which the next start cuts;
                // unless an index covers it (a clean close): the broker then trusts the index,
                // cuts nothing, and that batch is damage.
                let last = i + 1 == ids.len()
                    && crate::segment::valid_index(dir, header.id, cipher.as_deref(), len)?
                        .is_none();
                scan(dir, &file, len, &header, cipher, last, &mut |pos| {
                    progress(done + pos, total)
                })
            });
        match result {
            Ok(scanned) => {
                let seg = scanned.segment;
                report.batches += seg.batches;
                report.bytes += len;
                report.torn_tail += scanned.torn_bytes;
                report
                    .damage
                    .extend(seg.damage.iter().map(|&(p, l)| (path.clone(), p, l)));
                topics.extend(
                    seg.topics
                        .iter()
                        .map(|(name, _)| name)
                        .filter(|&t| t != crate::log::FLOOR_TOPIC)
                        .map(Box::<[u8]>::from),
                );
            }
            Err(e) => report.failures.push((path, e.to_string())),
        }
        done += len;
        progress(done, total);
    }
    report.topics = topics.len();
    Ok(report)
}
