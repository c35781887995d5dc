//! Re-sealing a log's older segments under its current master key (`aqueduct log rekey`), so
//! that a previous key (`aal.previous_keys`) can be dropped before retention deletes what it
//! sealed, e.g. after that key became known.
//!
//! Offline: the log's lock is taken, so a running broker makes it fail. The newest segment is
//! never re-sealed (it must be under the current key already). Each older segment sealed with
//! a previous key is written anew beside itself (`<id>.seg.tmp`): the same header but a fresh
//! salt (so a fresh data key) and key check, then every batch opened under the old data key and
//! sealed under the new one with the same batch number. A sealed batch is as long as before, so
//! every frame keeps its position and the segment's index stays true; it is written again only
//! for its MAC. The new file is synced and renamed over the old one, then the index is
//! replaced: a crash leaves each segment either as it was or re-sealed (with, at worst, an
//! index whose MAC no longer matches, which the next open reads through), readable with the
//! same keys either way.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::crypto::{MasterKey, SegmentCipher};
use crate::format::{self, batch_aad, BodyHeader, FrameCheck, SegmentHeader, BODY_HEADER};
use crate::format::{FRAME_PREFIX, HEADER_LEN};
use crate::log::{list_segments, lock_dir};
use crate::segment::{self, frame_at, index_path, open_header, sync_dir};
use crate::LogError;

/// What [`rekey`] did.
#[derive(Debug, Default)]
pub struct RekeyReport {
    /// Segments re-sealed under the current key.
    pub rekeyed: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Segments sealed with a previous key that were left as they are, and why (damage): they
    /// stay under that key, readable with it, until retention deletes them.
    pub skipped: Vec<(PathBuf, String)>,
    /// Per previous key (`keys[1..]`), the segments it still seals afterwards: a key at 0 is
    /// no longer needed.
    pub previous_key_segments: Vec<usize>,
}

/// Re-seal under `keys[0]` every segment of the log in `dir` that is sealed with one of
/// `keys[1..]` (see the module's documentation). `progress` is called with (bytes done, bytes
/// to do). Fails, changing nothing, if the log is open (a running broker), if `keys` is empty,
/// if a segment is sealed with none of `keys`, or if the newest segment is not sealed with
/// `keys[0]` (so the newest, the one a crash may have cut, is never re-sealed, and swapped keys
/// are caught); and on the first segment whose header cannot be read or whose batch fails
/// authentication (the segments re-sealed before it stay so, that one is left as it was).
/// Damaged segments are left as they were, and reported.
pub fn rekey(
    dir: &Path,
    keys: &[MasterKey],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RekeyReport, LogError> {
    let Some(current) = keys.first() else {
        return Err(LogError::KeyRequired {
            path: dir.to_path_buf(),
        });
    };
    let _lock = lock_dir(dir)?;
    let files = list_segments(dir)?;
    let mut report = RekeyReport {
        previous_key_segments: vec![0; keys.len() - 1],
        ..RekeyReport::default()
    };
    // Which segments to do, first (for the checks and the progress total).
    let mut todo = Vec::new();
    let mut newest_is_current = true;
    for (path_index, (_, path)) in files.iter().enumerate() {
        let file = File::open(path).map_err(|e| LogError::io("opening segment", path, e))?;
        let (_, cipher) = open_header(path, &file, keys, true)?;
        let key_index = cipher.as_ref().map(|c| c.key_index);
        if path_index + 1 == files.len() {
            newest_is_current = key_index == Some(0);
        } else if key_index.is_some_and(|i| i > 0) {
            let len = file
                .metadata()
                .map_err(|e| LogError::io("reading the size of segment", path, e))?
                .len();
            todo.push((path.clone(), len));
        }
    }
    if let Some((_, newest)) = files.last().filter(|_| !newest_is_current) {
        return Err(LogError::NotCurrentKey {
            path: newest.clone(),
        });
    }
    let total: u64 = todo.iter().map(|(_, len)| len).sum();
    let mut done = 0;
    for (path, len) in todo {
        match rekey_segment(dir, &path, keys, current)? {
            Ok(()) => {
                report.rekeyed += 1;
                report.bytes += len;
            }
            Err(why) => report.skipped.push((path, why)),
        }
        done += len;
        progress(done, total);
    }
    sync_dir(dir)?;
    for (_, path) in &files {
        let file = File::open(path).map_err(|e| LogError::io("opening segment", path, e))?;
        let (_, cipher) = open_header(path, &file, keys, true)?;
        if let Some(n) = cipher.and_then(|c| c.previous_key(&mut report.previous_key_segments)) {
            *n += 1;
        }
    }
    Ok(report)
}

/// Re-seal one segment (not the newest). The outer error stops the whole rekey; the inner one
/// (why) skips this segment, left as it was.
fn rekey_segment(
    dir: &Path,
    path: &Path,
    keys: &[MasterKey],
    current: &MasterKey,
) -> Result<Result<(), String>, LogError> {
    let (scanned, read_through) = segment::load(dir, path, keys, true, false)?;
    // Never the newest segment, so never a torn tail (`load` reports those of the last only).
    let old = scanned.segment;
    if !old.damage.is_empty() {
        return Ok(Err(format!(
            "it has {} damaged range(s), which cannot be re-sealed (`aqueduct log verify` shows \
             them)",
            old.damage.len()
        )));
    }
    let Some(old_cipher) = old.cipher.clone() else {
        return Ok(Err("it is not encrypted".into()));
    };
    let file = File::open(path).map_err(|e| LogError::io("opening segment", path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| LogError::io("reading the size of segment", path, e))?
        .len();
    if file_len != old.len {
        return Ok(Err(format!(
            "its file is {file_len} bytes but its whole frames end at byte {}",
            old.len
        )));
    }
    let mut raw = [0u8; HEADER_LEN];
    file.read_exact_at(&mut raw, 0)
        .map_err(|e| LogError::io("reading the header of segment", path, e))?;
    let header = SegmentHeader::decode(&raw).map_err(|reason| LogError::BadFile {
        path: path.to_path_buf(),
        reason,
    })?;
    let mut new_header = header;
    let new_cipher = segment::seal_header(&mut new_header, current, path)?;
    // Its index as it is, to carry a MAC under the new key (a sealed segment's entry points
    // are not kept in memory). Read before anything changes; none if it was read through.
    let index = match read_through {
        true => None,
        false => match segment::valid_index(dir, old.id, Some(&old_cipher), old.len) {
            Ok(index) => index,
            // Read a moment ago by `load`: left as it is, with the reason, not the whole rekey
            // stopped.
            Err(e) => return Ok(Err(format!("its index cannot be read: {e}"))),
        },
    };

    let tmp = path.with_extension("seg.tmp");
    let written = write_resealed(
        (&file, path),
        file_len,
        old.id,
        &old_cipher,
        &new_cipher,
        &new_header,
        &tmp,
    );
    match written {
        Ok(Ok(())) => {}
        Ok(Err(why)) => {
            let _ = std::fs::remove_file(&tmp);
            return Ok(Err(why));
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    std::fs::rename(&tmp, path)
        .map_err(|e| LogError::io("renaming the re-sealed segment", path, e))?;
    sync_dir(dir)?;
    match index {
        Some(index) => segment::write_index_file(dir, old.id, &index, Some(&new_cipher))?,
        None => {
            // Its index was missing or stale (lost, or a rekey cut short between the segment's
            // rename and its index's): the next open reads it through, as it would have.
            let idx = index_path(dir, old.id);
            match std::fs::remove_file(&idx) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(LogError::io("removing the stale index", &idx, e)),
            }
        }
    }
    Ok(Ok(()))
}

/// Write `tmp`: `new_header`, then every frame of `file` (at `path`; from the header to
/// `file_len`, all of them whole and checked) opened under `old` and sealed under `new`;
/// synced, with the permissions and owner of `file`.
fn write_resealed(
    (file, path): (&File, &Path),
    file_len: u64,
    segment_id: u64,
    old: &SegmentCipher,
    new: &SegmentCipher,
    new_header: &SegmentHeader,
    tmp: &Path,
) -> Result<Result<(), String>, LogError> {
    let out = File::create(tmp).map_err(|e| LogError::io("creating", tmp, e))?;
    keep_owner_and_mode(file, &out, path, tmp)?;
    let mut out = std::io::BufWriter::new(out);
    let write_err = |e| LogError::io("writing", tmp, e);
    out.write_all(&new_header.encode()).map_err(write_err)?;
    let mut buf = Vec::new();
    let mut frame = Vec::new();
    let mut pos = HEADER_LEN as u64;
    while pos < file_len {
        let check = frame_at(file, pos, file_len, &mut buf)
            .map_err(|e| LogError::io("reading segment", path, e))?;
        let FrameCheck::Good { len } = check else {
            return Ok(Err(format!("the frame at byte {pos} does not check")));
        };
        let body = &mut buf[FRAME_PREFIX..];
        let Some(bh) = BodyHeader::decode(body) else {
            return Ok(Err(format!(
                "the frame at byte {pos} is shorter than its header"
            )));
        };
        let aad = batch_aad(segment_id, &body[..BODY_HEADER]);
        let Some(plain_len) = old.open(bh.batch_no, &aad, &mut body[BODY_HEADER..]) else {
            return Err(LogError::Tampered {
                path: path.to_path_buf(),
                position: pos,
            });
        };
        // The body header as it was (the associated data of both seals), then the payload.
        frame.clear();
        frame.extend_from_slice(&[0u8; FRAME_PREFIX]);
        frame.extend_from_slice(&body[..BODY_HEADER + plain_len]);
        new.seal(bh.batch_no, &aad, &mut frame, FRAME_PREFIX + BODY_HEADER);
        format::finish_frame(&mut frame, 0);
        if frame.len() != len {
            return Ok(Err(format!(
                "the batch at byte {pos} would change length when re-sealed"
            )));
        }
        out.write_all(&frame).map_err(write_err)?;
        pos += len as u64;
    }
    let file = out
        .into_inner()
        .map_err(|e| LogError::io("writing", tmp, e.into_error()))?;
    file.sync_all()
        .map_err(|e| LogError::io("syncing", tmp, e))?;
    Ok(Ok(()))
}

/// Give `new` (at `tmp`) the permissions and owner of `old` (at `path`): a segment re-sealed
/// by root stays the broker user's, and the broker can still cut it back later.
fn keep_owner_and_mode(old: &File, new: &File, path: &Path, tmp: &Path) -> Result<(), LogError> {
    use std::os::unix::fs::MetadataExt;
    let was = old
        .metadata()
        .map_err(|e| LogError::io("reading the owner of segment", path, e))?;
    let is = new
        .metadata()
        .map_err(|e| LogError::io("reading the owner of", tmp, e))?;
    if (was.uid(), was.gid()) != (is.uid(), is.gid()) {
        std::os::unix::fs::fchown(new, Some(was.uid()), Some(was.gid())).map_err(|e| {
            LogError::io("giving the segment's owner to its re-sealed copy", tmp, e)
        })?;
    }
    new.set_permissions(was.permissions())
        .map_err(|e| LogError::io("giving the segment's mode to its re-sealed copy", tmp, e))
}
