//! A log directory of damaged or arbitrary bytes: opening, reading and verifying it never
//! panics. The first input byte picks a mode: bit 0 — segments encrypted (a fixed key) or
//! plain; bit 1 — fix each frame's CRC so the decoder behind it is reached; bit 2 — the input
//! also carries an index file; bit 3 — open with the wrong key; bit 4 — open with another key,
//! the segments' key listed as a previous one (a rotated key), after re-sealing them (`rekey`).
//! The rest is the segment's frames (after a valid header the target writes) and, with bit 2,
//! the index after a 0xFF 0xFF 0xFF 0xFF separator.
#![no_main]
use aqueduct_log::format::{SegmentHeader, FRAME_PREFIX, HEADER_LEN, MAX_BODY};
use aqueduct_log::{verify, Log, LogOptions, MasterKey};
use libfuzzer_sys::fuzz_target;

fn fix_crcs(frames: &mut [u8]) {
    let mut pos = 0;
    while pos + FRAME_PREFIX <= frames.len() {
        let len = u32::from_le_bytes([frames[pos], frames[pos + 1], frames[pos + 2], frames[pos + 3]]) as usize;
        if len > MAX_BODY || pos + FRAME_PREFIX + len > frames.len() {
            break;
        }
        let crc = crc32c::crc32c(&frames[pos + FRAME_PREFIX..pos + FRAME_PREFIX + len]);
        frames[pos + 4..pos + 8].copy_from_slice(&crc.to_le_bytes());
        pos += FRAME_PREFIX + len;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let key = MasterKey::from_bytes(&[0x42; 32]);
    let Ok(dir) = tempfile::tempdir() else { return };
    // A real, empty segment supplies a valid header (and key check) for the mode.
    {
        let opts = LogOptions { key: if mode & 1 != 0 { key.clone() } else { None }, ..LogOptions::default() };
        let Ok((log, _)) = Log::open(dir.path(), opts) else { return };
        drop(log);
    }
    let rotated = mode & 16 != 0;
    let new_key = MasterKey::from_bytes(&[0x43; 32]);
    if rotated && mode & 1 != 0 {
        // A newest segment under the new key, so that `rekey` takes up segment 0.
        let previous_keys = key.iter().cloned().collect();
        let opts = LogOptions { key: new_key.clone(), previous_keys, ..LogOptions::default() };
        let Ok((log, _)) = Log::open(dir.path(), opts) else { return };
        drop(log);
    }
    let seg = dir.path().join(format!("{:020}.seg", 0));
    let Ok(header) = std::fs::read(&seg) else { return };
    if header.len() < HEADER_LEN || SegmentHeader::decode(&header).is_err() {
        return;
    }
    let (frames, index) = match rest.windows(4).position(|w| w == [0xFF; 4]) {
        Some(at) if mode & 4 != 0 => (&rest[..at], Some(&rest[at + 4..])),
        _ => (rest, None),
    };
    let mut frames = frames.to_vec();
    if mode & 2 != 0 {
        fix_crcs(&mut frames);
    }
    let mut bytes = header[..HEADER_LEN].to_vec();
    bytes.extend_from_slice(&frames);
    if std::fs::write(&seg, &bytes).is_err() {
        return;
    }
    if let Some(index) = index {
        let _ = aqueduct_log::format::IndexFile::decode(index);
        let _ = std::fs::write(dir.path().join(format!("{:020}.idx", 0)), index);
    }
    let previous_keys: Vec<MasterKey> = if rotated { key.iter().cloned().collect() } else { Vec::new() };
    let open_key = if mode & 8 != 0 || rotated { new_key } else { key };
    let keys: Vec<MasterKey> = match &open_key {
        Some(k) => std::iter::once(k).chain(&previous_keys).cloned().collect(),
        None => Vec::new(),
    };
    let _ = verify(dir.path(), &keys, &mut |_, _| {});
    if rotated {
        // Re-sealing arbitrary segments never panics either (and what it leaves still opens or
        // fails cleanly below).
        let _ = aqueduct_log::rekey(dir.path(), &keys, &mut |_, _| {});
    }
    let opts = LogOptions { key: open_key, previous_keys, ..LogOptions::default() };
    if let Ok((log, _)) = Log::open(dir.path(), opts) {
        let topics: Vec<Vec<u8>> = log.topics().map(<[u8]>::to_vec).collect();
        for t in topics.iter().take(16) {
            for r in log.read(t, 0).take(10_000) {
                let _ = r;
            }
        }
    }
});
