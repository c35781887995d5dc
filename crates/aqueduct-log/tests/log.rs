//! The log through its public API: round trips, reopen, crashes, torn tails, wrong keys,
//! tampering, damage, nonces, retention, truncation.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use aqueduct_log::format::{
    check_frame, FrameCheck, SegmentHeader, BODY_HEADER, FRAME_PREFIX, HEADER_LEN,
};
use aqueduct_log::{
    verify, Entry, Forget, FsyncMode, Log, LogError, LogOptions, MasterKey, Record, FLOOR_TOPIC,
};

type R = Result<(), Box<dyn std::error::Error>>;

fn key(b: u8) -> MasterKey {
    MasterKey::from_bytes(&[b; 32]).expect("32 bytes")
}

fn opts(key: Option<MasterKey>) -> LogOptions {
    LogOptions {
        key,
        ..LogOptions::default()
    }
}

/// Options for a log sealed with `current`, reading `previous_keys` too, in small segments.
fn rotated(current: MasterKey, previous_keys: Vec<MasterKey>) -> LogOptions {
    LogOptions {
        max_segment_bytes: 400,
        previous_keys,
        ..opts(Some(current))
    }
}

/// A record of topic `t` to append.
fn entry(offset: u64, data: &'static [u8]) -> Entry<'static> {
    Entry {
        topic: b"t",
        offset,
        data,
    }
}

fn msg(topic: &str, offset: u64) -> Vec<u8> {
    format!("{topic}#{offset}").into_bytes()
}

/// Append `n` single-topic batches of `per` messages each, from the topic's next offset.
fn fill(log: &mut Log, topic: &str, batches: usize, per: usize) -> Result<Vec<u64>, LogError> {
    let mut offsets = Vec::new();
    for _ in 0..batches {
        let first = log.next_offset(topic.as_bytes());
        let bodies: Vec<Vec<u8>> = (0..per as u64).map(|i| msg(topic, first + i)).collect();
        let entries: Vec<Entry<'_>> = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| Entry {
                topic: topic.as_bytes(),
                offset: first + i as u64,
                data: b,
            })
            .collect();
        log.append(&entries, 1_000)?;
        log.commit()?;
        offsets.extend(first..first + per as u64);
    }
    Ok(offsets)
}

fn read_all(log: &Log, topic: &str, from: u64) -> Result<Vec<Record>, LogError> {
    log.read(topic.as_bytes(), from).collect()
}

fn offsets(records: &[Record]) -> Vec<u64> {
    records.iter().map(|r| r.offset).collect()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("log dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

fn dir_bytes(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("log dir")
        .map(|e| {
            let p = e.expect("entry").path();
            let b = std::fs::read(&p).expect("read");
            (p, b)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn round_trip_encrypted_and_plain_across_clean_reopen() -> R {
    for k in [Some(key(1)), None] {
        let tmp = tempfile::tempdir()?;
        let (mut log, rec) = Log::open(tmp.path(), opts(k.clone()))?;
        assert!(rec.clean);
        assert_eq!(log.next_offset(b"a"), 0);
        fill(&mut log, "a", 3, 10)?;
        fill(&mut log, "b", 2, 5)?;
        fill(&mut log, "a", 1, 1)?;
        let all = read_all(&log, "a", 0)?;
        assert_eq!(offsets(&all), (0..31).collect::<Vec<_>>());
        assert!(all.iter().all(|r| r.data == msg("a", r.offset)));
        assert_eq!(
            offsets(&read_all(&log, "a", 25)?),
            (25..31).collect::<Vec<_>>()
        );
        assert_eq!(
            offsets(&read_all(&log, "b", 3)?),
            (3..10).collect::<Vec<_>>()
        );
        assert!(read_all(&log, "c", 0)?.is_empty());
        log.close()?;

        let (mut log, rec) = Log::open(tmp.path(), opts(k.clone()))?;
        assert!(rec.clean, "a closed log reopens clean");
        assert_eq!(
            rec.rebuilt_indexes, 0,
            "a clean reopen reads index files only"
        );
        assert_eq!(rec.topics, 2);
        assert_eq!(log.next_offset(b"a"), 31);
        assert_eq!(log.last_offset(b"b"), Some(9));
        assert_eq!(log.first_offset(b"b"), Some(0));
        fill(&mut log, "a", 1, 2)?;
        assert_eq!(offsets(&read_all(&log, "a", 29)?), vec![29, 30, 31, 32]);
    }
    Ok(())
}

#[test]
fn offsets_are_never_taken_twice() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(None))?;
    fill(&mut log, "a", 1, 3)?;
    for bad in [0, 2] {
        let e = log.append(
            &[Entry {
                topic: b"a",
                offset: bad,
                data: b"x",
            }],
            0,
        );
        assert!(
            matches!(e, Err(LogError::OffsetNotIncreasing { .. })),
            "{e:?}"
        );
    }
    // Within one batch too.
    let e = log.append(
        &[
            Entry {
                topic: b"a",
                offset: 5,
                data: b"x",
            },
            Entry {
                topic: b"a",
                offset: 5,
                data: b"y",
            },
        ],
        0,
    );
    assert!(
        matches!(e, Err(LogError::OffsetNotIncreasing { .. })),
        "{e:?}"
    );
    // A refused batch leaves nothing behind; gaps are allowed.
    log.append(
        &[Entry {
            topic: b"a",
            offset: 7,
            data: b"z",
        }],
        0,
    )?;
    assert_eq!(offsets(&read_all(&log, "a", 0)?), vec![0, 1, 2, 7]);
    assert!(matches!(
        log.append(&[], 0),
        Err(LogError::InvalidAppend(_))
    ));
    assert!(matches!(
        log.append(
            &[Entry {
                topic: b"",
                offset: 9,
                data: b"z"
            }],
            0
        ),
        Err(LogError::InvalidAppend(_))
    ));
    Ok(())
}

#[test]
fn a_crash_skips_the_gap_and_loses_nothing_written() -> R {
    let tmp = tempfile::tempdir()?;
    let gap = 1000;
    let o = || LogOptions {
        crash_offset_gap: gap,
        ..opts(Some(key(2)))
    };
    let (mut log, _) = Log::open(tmp.path(), o())?;
    fill(&mut log, "a", 4, 25)?;
    drop(log); // no close: a crash
    let (mut log, rec) = Log::open(tmp.path(), o())?;
    assert!(!rec.clean);
    assert_eq!(
        rec.rebuilt_indexes, 1,
        "only the crashed segment is read through"
    );
    assert_eq!(
        offsets(&read_all(&log, "a", 0)?),
        (0..100).collect::<Vec<_>>()
    );
    assert_eq!(log.next_offset(b"a"), 100 + gap);
    assert_eq!(
        log.next_offset(b"new"),
        gap,
        "a topic first seen now starts past the gap"
    );
    let reuse = log.append(
        &[Entry {
            topic: b"a",
            offset: 100,
            data: b"x",
        }],
        0,
    );
    assert!(
        matches!(reuse, Err(LogError::OffsetNotIncreasing { .. })),
        "{reuse:?}"
    );
    // A second crash with nothing written for "a": the gap grows again.
    drop(log);
    let (log, rec) = Log::open(tmp.path(), o())?;
    assert!(!rec.clean);
    assert_eq!(log.next_offset(b"a"), 100 + 2 * gap);
    log.close()?;
    let (log, rec) = Log::open(tmp.path(), o())?;
    assert!(rec.clean);
    assert_eq!(
        log.next_offset(b"a"),
        100 + 2 * gap,
        "a clean close adds no gap"
    );
    Ok(())
}

#[test]
fn a_torn_tail_is_cut_at_any_point() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(3))))?;
    fill(&mut log, "t", 5, 7)?;
    drop(log);
    let seg = segments(tmp.path()).pop().ok_or("no segment")?;
    let whole = std::fs::read(&seg)?;
    // Frame ends: where a cut leaves only whole batches.
    let ends: Vec<usize> = std::iter::once(HEADER_LEN)
        .chain(frames(&whole).into_iter().map(|(pos, len)| pos + len))
        .collect();
    assert_eq!(ends.len(), 6);
    for cut in (HEADER_LEN..whole.len())
        .step_by(13)
        .chain([whole.len() - 1])
    {
        let copy = tempfile::tempdir()?;
        for (p, b) in dir_bytes(tmp.path()) {
            std::fs::write(copy.path().join(p.file_name().ok_or("name")?), b)?;
        }
        let cseg = copy.path().join(seg.file_name().ok_or("name")?);
        std::fs::write(&cseg, &whole[..cut])?;
        let _ = std::fs::remove_file(cseg.with_extension("idx"));
        let (log, rec) = Log::open(copy.path(), opts(Some(key(3))))?;
        let kept = ends.iter().filter(|&&e| e <= cut).count() - 1;
        let last_end = ends[kept];
        assert_eq!(rec.truncated_bytes, (cut - last_end) as u64, "cut at {cut}");
        assert_eq!(std::fs::metadata(&cseg)?.len(), last_end as u64);
        assert_eq!(
            offsets(&read_all(&log, "t", 0)?),
            (0..7 * kept as u64).collect::<Vec<_>>(),
            "cut at {cut}"
        );
        assert_eq!(log.next_offset(b"t"), 7 * kept as u64 + (1 << 20));
    }
    Ok(())
}

/// The id of a segment file (`<id>.seg`).
fn segment_id(path: &Path) -> u64 {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("a segment name");
    stem.parse().expect("a numeric segment name")
}

/// A rotated master key: segments sealed with the old one are read with it while it is listed
/// among the previous keys (their index files too, with no read-through); every new segment is
/// sealed with the new key only; once retention has deleted the old key's segments, the new key
/// alone opens the log.
#[test]
fn a_rotated_key_reads_the_old_segments_and_seals_the_new_ones() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(1), vec![]))?;
    fill(&mut log, "t", 6, 3)?;
    log.close()?;
    let old = segments(tmp.path());
    assert!(old.len() > 1, "{old:?}");
    let first_new = old
        .iter()
        .map(|p| segment_id(p))
        .max()
        .ok_or("no segment")?
        + 1;

    // The new key alone cannot read them, and says where the old one goes.
    let e = Log::open(tmp.path(), rotated(key(2), vec![])).map(|_| ());
    assert!(
        matches!(e, Err(LogError::WrongKey { keys: 1, .. })),
        "{e:?}"
    );
    assert!(e
        .err()
        .ok_or("error")?
        .to_string()
        .contains("aal.previous_keys"));

    // With the old key among the previous ones it can (an unrelated previous key is harmless).
    let (mut log, rec) = Log::open(tmp.path(), rotated(key(2), vec![key(9), key(1)]))?;
    assert_eq!(rec.previous_key_segments, vec![0, old.len()]);
    assert_eq!(log.stats().previous_key_segments, old.len() as u64);
    assert_eq!(
        rec.rebuilt_indexes, 0,
        "the old indexes are checked with the old key"
    );
    assert_eq!(
        offsets(&read_all(&log, "t", 0)?),
        (0..18).collect::<Vec<_>>()
    );
    fill(&mut log, "t", 6, 3)?;
    log.close()?;
    let report = verify(tmp.path(), &[key(2), key(9), key(1)], &mut |_, _| {})?;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.previous_key_segments, vec![0, old.len()]);
    let report = verify(tmp.path(), &[key(2)], &mut |_, _| {})?;
    assert_eq!(report.failures.len(), old.len(), "{report:?}");

    // New segments are sealed with the new key only: the old key cannot open the log now.
    let e = Log::open(tmp.path(), rotated(key(1), vec![])).map(|_| ());
    assert!(matches!(e, Err(LogError::WrongKey { .. })), "{e:?}");

    // Retention deletes the old key's segments; then the new key is enough.
    let (mut log, _) = Log::open(tmp.path(), rotated(key(2), vec![key(1)]))?;
    log.purge_before(aqueduct_log::Position {
        segment: first_new,
        byte: 0,
    })?;
    log.close()?;
    let (log, rec) = Log::open(tmp.path(), rotated(key(2), vec![key(1)]))?;
    assert_eq!(
        rec.previous_key_segments,
        vec![0],
        "the old key is no longer needed"
    );
    assert_eq!(log.stats().previous_key_segments, 0);
    drop(log);
    let (log, _) = Log::open(tmp.path(), rotated(key(2), vec![]))?;
    assert_eq!(
        offsets(&read_all(&log, "t", 18)?),
        (18..36).collect::<Vec<_>>()
    );
    Ok(())
}

/// `truncate_after` into a segment sealed with a previous key writes that segment's index with
/// its own key (the next open reads no segment through), and a read-only view reads it given
/// the keys.
#[test]
fn truncating_into_a_previous_keys_segment_keeps_its_key() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(1))))?;
    let cut = log.append(&[entry(0, b"a"), entry(1, b"b")], 1)?;
    log.append(&[entry(2, b"c")], 2)?;
    log.close()?;
    let rotated = LogOptions {
        previous_keys: vec![key(1)],
        ..opts(Some(key(2)))
    };
    let (mut log, _) = Log::open(tmp.path(), rotated.clone())?;
    log.truncate_after(cut)?;
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![0, 1]);
    log.close()?;
    let (log, rec) = Log::open(tmp.path(), rotated)?;
    assert_eq!(rec.rebuilt_indexes, 0, "{rec:?}");
    assert_eq!(rec.previous_key_segments, vec![1]);
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![0, 1]);
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(2), key(1)])?;
    let viewed: Vec<Record> = view.read(b"t", 0).collect::<Result<_, _>>()?;
    assert_eq!(offsets(&viewed), vec![0, 1]);
    let e = aqueduct_log::LogView::open(tmp.path(), &[key(2)]).map(|_| ());
    assert!(matches!(e, Err(LogError::WrongKey { .. })), "{e:?}");
    Ok(())
}

/// A record as kept: (topic, offset, data).
type Kept = (String, u64, Vec<u8>);

/// Every record of `topics` in the log at `dir` opened with `o` (and closed cleanly again):
/// (topic, offset, data).
fn all_records(
    dir: &Path,
    o: LogOptions,
    topics: &[&str],
) -> Result<Vec<Kept>, Box<dyn std::error::Error>> {
    let (log, _) = Log::open(dir, o)?;
    let mut out = Vec::new();
    for t in topics {
        for r in read_all(&log, t, 0)? {
            out.push((t.to_string(), r.offset, r.data.to_vec()));
        }
    }
    log.close()?;
    Ok(out)
}

/// The header of the segment file `bytes`.
fn header_of(bytes: &[u8]) -> Result<SegmentHeader, String> {
    SegmentHeader::decode(&bytes[..HEADER_LEN])
}

/// `rekey` re-seals every segment sealed with a previous key under the current one: afterwards
/// the current key alone opens the log, with the same records and the same indexes (nothing
/// read through); each re-sealed header keeps its fields but the salt and key check; segments
/// already under the current key are untouched; a log in use is refused; a second run has
/// nothing to do. An index the rekey did not get to replace (a crash between the segment's
/// rename and its index's) only makes the next open read that segment through.
#[test]
fn rekey_reseals_the_old_segments_so_the_old_key_can_go() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(1), vec![]))?;
    fill(&mut log, "a", 3, 3)?;
    drop(log); // a crash: later segments carry it in their headers (unclean_before)
    let (mut log, _) = Log::open(tmp.path(), rotated(key(1), vec![]))?;
    fill(&mut log, "a", 3, 3)?;
    fill(&mut log, "b", 2, 2)?;
    log.close()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(2), vec![key(1)]))?;
    fill(&mut log, "a", 2, 3)?;
    // A log in use (a running broker) is not rekeyed.
    let e = aqueduct_log::rekey(tmp.path(), &[key(2), key(1)], &mut |_, _| {}).map(|_| ());
    assert!(matches!(e, Err(LogError::Locked { .. })), "{e:?}");
    log.close()?;
    let before = all_records(tmp.path(), rotated(key(2), vec![key(1)]), &["a", "b"])?;
    assert_eq!(before.len(), 6 * 3 + 2 * 2 + 2 * 3);
    let files_before = dir_bytes(tmp.path());
    let old = verify(tmp.path(), &[key(2), key(1)], &mut |_, _| {})?.previous_key_segments[0];
    assert!(old > 2, "{old}");

    let mut calls = 0;
    let report = aqueduct_log::rekey(tmp.path(), &[key(2), key(1)], &mut |_, _| calls += 1)?;
    assert_eq!(report.rekeyed, old, "{report:?}");
    assert!(report.skipped.is_empty(), "{report:?}");
    assert_eq!(report.previous_key_segments, vec![0]);
    assert_eq!(calls, old, "progress after each segment");
    let files_after = dir_bytes(tmp.path());
    let mut resealed = 0;
    for ((path, was), (_, is)) in files_before.iter().zip(&files_after) {
        if path.extension().is_none_or(|e| e != "seg") || was == is {
            continue;
        }
        resealed += 1;
        let (a, b) = (header_of(was)?, header_of(is)?);
        assert_ne!(a.salt, b.salt, "a fresh data key");
        let keep = |h: &SegmentHeader| {
            (
                h.id,
                h.generation,
                h.unclean_before,
                h.created_ms,
                h.encrypted,
            )
        };
        assert_eq!(keep(&a), keep(&b), "{path:?}");
        assert_eq!(was.len(), is.len(), "every batch keeps its place");
    }
    assert_eq!(resealed, old, "only the old key's segments change");
    assert!(
        files_before
            .iter()
            .any(|(p, b)| p.extension().is_some_and(|e| e == "seg")
                && header_of(b).is_ok_and(|h| h.unclean_before > 0)),
        "the crash is in some header, so keeping the field is tested"
    );

    let (log, rec) = Log::open(tmp.path(), rotated(key(2), vec![]))?;
    assert_eq!(
        rec.rebuilt_indexes, 0,
        "the indexes were rewritten under the new key"
    );
    assert!(rec.clean);
    log.close()?;
    assert_eq!(
        all_records(tmp.path(), rotated(key(2), vec![]), &["a", "b"])?,
        before
    );
    assert!(verify(tmp.path(), &[key(2)], &mut |_, _| {})?.is_ok());
    let e = aqueduct_log::LogView::open(tmp.path(), &[key(1)]).map(|_| ());
    assert!(matches!(e, Err(LogError::WrongKey { .. })), "{e:?}");
    let again = aqueduct_log::rekey(tmp.path(), &[key(2), key(1)], &mut |_, _| {})?;
    assert_eq!((again.rekeyed, again.previous_key_segments), (0, vec![0]));

    // A rekey cut short after a segment's rename: its old index (MAC under the old data key)
    // is read through instead, and nothing else changes.
    let (idx, old_idx) = files_before
        .iter()
        .find(|(p, b)| {
            p.extension().is_some_and(|e| e == "idx")
                && !files_after.contains(&(p.clone(), b.clone()))
        })
        .ok_or("a replaced index")?;
    std::fs::write(idx, old_idx)?;
    let (log, rec) = Log::open(tmp.path(), rotated(key(2), vec![]))?;
    assert_eq!(rec.rebuilt_indexes, 1);
    assert!(rec.clean);
    log.close()?;
    assert_eq!(
        all_records(tmp.path(), rotated(key(2), vec![]), &["a", "b"])?,
        before
    );
    Ok(())
}

/// `rekey` never re-seals the newest segment (the one a crash may have cut) and refuses to run
/// when it is not under the key given as current (swapped keys), changing nothing; a batch
/// damaged after indexing leaves its segment as it was (skipped, named); a `.seg.tmp` left by
/// a rekey that crashed is removed.
#[test]
fn rekey_refuses_swapped_keys_and_skips_damage() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(1), vec![]))?;
    fill(&mut log, "a", 6, 3)?;
    log.close()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(2), vec![key(1)]))?;
    fill(&mut log, "a", 1, 3)?;
    drop(log); // a crash: the newest segment has no index
               // Damage a batch of the first segment after it was indexed.
    let first = segments(tmp.path())
        .into_iter()
        .next()
        .ok_or("no segment")?;
    let mut b = std::fs::read(&first)?;
    let starts = frame_starts(&b);
    b[starts[0] + FRAME_PREFIX + BODY_HEADER + 3] ^= 0xFF;
    std::fs::write(&first, &b)?;

    let untouched = dir_bytes(tmp.path());
    let e = aqueduct_log::rekey(tmp.path(), &[key(1), key(2)], &mut |_, _| {}).map(|_| ());
    assert!(matches!(e, Err(LogError::NotCurrentKey { .. })), "{e:?}");
    assert_eq!(dir_bytes(tmp.path()), untouched, "nothing changed");

    let stale = tmp.path().join("00000000000000000000.seg.tmp");
    std::fs::write(&stale, b"left by a crash")?;
    let newest = segments(tmp.path()).pop().ok_or("no segment")?;
    let newest_bytes = std::fs::read(&newest)?;
    let report = aqueduct_log::rekey(tmp.path(), &[key(2), key(1)], &mut |_, _| {})?;
    assert_eq!(report.skipped.len(), 1, "{report:?}");
    assert_eq!(report.skipped[0].0, first);
    assert!(report.skipped[0].1.contains("does not check"), "{report:?}");
    assert_eq!(report.previous_key_segments, vec![1]);
    assert!(report.rekeyed > 1, "{report:?}");
    assert!(!stale.exists(), "a stale temporary segment is removed");
    assert_eq!(
        std::fs::read(&first)?,
        b,
        "the skipped segment is left as it was"
    );
    assert_eq!(
        std::fs::read(&newest)?,
        newest_bytes,
        "the newest is never re-sealed"
    );

    let (log, rec) = Log::open(tmp.path(), rotated(key(2), vec![key(1)]))?;
    assert!(!rec.clean, "the crash is still seen");
    assert_eq!(rec.previous_key_segments, vec![1]);
    let read: Vec<u64> = log
        .read(b"a", 0)
        .filter_map(|r| r.ok().map(|r| r.offset))
        .collect();
    assert_eq!(read.len(), 7 * 3 - 3, "all but the damaged batch: {read:?}");
    Ok(())
}

#[test]
fn the_wrong_key_is_refused_and_nothing_changes() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(4))))?;
    fill(&mut log, "a", 2, 3)?;
    drop(log); // crashed: the last segment would be read through, and a torn tail cut
    let before = dir_bytes(tmp.path());
    let e = Log::open(tmp.path(), opts(Some(key(5)))).map(|_| ());
    assert!(matches!(e, Err(LogError::WrongKey { .. })), "{e:?}");
    assert!(e.err().ok_or("error")?.to_string().contains("aal.key"));
    let e = Log::open(tmp.path(), opts(None)).map(|_| ());
    assert!(matches!(e, Err(LogError::KeyRequired { .. })), "{e:?}");
    assert_eq!(
        dir_bytes(tmp.path()),
        before,
        "a refused open changes nothing"
    );
    let (log, _) = Log::open(tmp.path(), opts(Some(key(4))))?;
    assert_eq!(read_all(&log, "a", 0)?.len(), 6);
    Ok(())
}

/// Flip a ciphertext byte of the first batch and fix its CRC: a whole, changed record.
fn tamper_first_batch(seg: &Path) -> R {
    let mut b = std::fs::read(seg)?;
    let at = HEADER_LEN + FRAME_PREFIX + BODY_HEADER + 2;
    b[at] ^= 0x01;
    let body_len = u32::from_le_bytes(b[HEADER_LEN..HEADER_LEN + 4].try_into()?) as usize;
    let crc = crc32c(&b[HEADER_LEN + FRAME_PREFIX..HEADER_LEN + FRAME_PREFIX + body_len]);
    b[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(seg, b)?;
    Ok(())
}

/// CRC-32C (Castagnoli), bitwise: the test's own, independent of the crate's.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn tampering_is_refused_never_truncated() -> R {
    // In the segment read through at open (after a crash): the open fails.
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(6))))?;
    fill(&mut log, "a", 3, 3)?;
    drop(log);
    let seg = segments(tmp.path()).pop().ok_or("no segment")?;
    tamper_first_batch(&seg)?;
    let before = dir_bytes(tmp.path());
    let e = Log::open(tmp.path(), opts(Some(key(6)))).map(|_| ());
    assert!(matches!(e, Err(LogError::Tampered { .. })), "{e:?}");
    assert_eq!(dir_bytes(tmp.path()), before);

    // In a sealed segment (trusted index): the reader reports it.
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(6))))?;
    fill(&mut log, "a", 3, 3)?;
    log.close()?;
    let seg = segments(tmp.path()).pop().ok_or("no segment")?;
    tamper_first_batch(&seg)?;
    let (log, _) = Log::open(tmp.path(), opts(Some(key(6))))?;
    let first = log.read(b"a", 0).next().ok_or("nothing read")?;
    assert!(matches!(first, Err(LogError::Tampered { .. })), "{first:?}");
    Ok(())
}

#[test]
fn damage_in_the_middle_is_skipped_and_kept() -> R {
    let tmp = tempfile::tempdir()?;
    let small = || LogOptions {
        max_segment_bytes: 500,
        ..opts(None)
    };
    let (mut log, _) = Log::open(tmp.path(), small())?;
    fill(&mut log, "a", 30, 4)?;
    log.close()?;
    let segs = segments(tmp.path());
    assert!(segs.len() >= 4, "rotation made {} segments", segs.len());
    // Flip a byte inside the second batch of the first segment and drop its index.
    let seg = &segs[0];
    let mut b = std::fs::read(seg)?;
    let FrameCheck::Good { len } = check_frame(&b[HEADER_LEN..]) else {
        return Err("first frame bad".into());
    };
    b[HEADER_LEN + len + FRAME_PREFIX + BODY_HEADER + 5] ^= 0xFF;
    std::fs::write(seg, &b)?;
    std::fs::remove_file(seg.with_extension("idx"))?;
    let (log, rec) = Log::open(tmp.path(), small())?;
    assert_eq!(rec.damaged_batches, 1);
    assert_eq!(rec.degraded_topics, vec!["a".to_string()]);
    assert_eq!(std::fs::read(seg)?, b, "damaged data is kept as it is");
    let got = offsets(&read_all(&log, "a", 0)?);
    let want: Vec<u64> = (0..4).chain(8..120).collect();
    assert_eq!(got, want, "everything but the damaged batch reads back");
    Ok(())
}

/// Damage found by reading through a sealed segment (its index gone) may have taken a topic's
/// highest offsets with it: the log goes on past them as after a crash. It went on from the
/// highest offset it could read, after a clean close, so offset 1 named a second message.
#[test]
fn damage_found_by_reading_through_skips_the_crash_gap() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    log.append(&[entry(0, b"first")], 0)?;
    log.append(&[entry(1, b"second")], 0)?;
    log.close()?;
    // A second clean run: the first segment is no longer the newest.
    let (log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    log.close()?;
    let segs = segments(tmp.path());
    assert!(segs.len() >= 2);
    let seg = &segs[0];
    let mut b = std::fs::read(seg)?;
    let last = b.len() - 3;
    b[last] ^= 0xFF; // inside the last frame: offset 1's batch
    std::fs::write(seg, &b)?;
    std::fs::remove_file(seg.with_extension("idx"))?;
    let (log, rec) = Log::open(tmp.path(), opts(Some(key(9))))?;
    assert_eq!(rec.damaged_batches, 1);
    assert!(!rec.clean, "counted as a crash");
    let gap = LogOptions::default().crash_offset_gap;
    assert!(
        log.next_offset(b"t") > gap,
        "t goes on past the gap, not at {}",
        log.next_offset(b"t")
    );
    Ok(())
}

/// Age retention dates a sealed segment with no readable batch (every batch damaged) by its
/// header's creation time. It took such a segment for older than any age and deleted it at the
/// next pass, before anyone could look at the damage.
#[test]
fn age_retention_dates_a_segment_with_no_readable_batch_by_its_creation() -> R {
    let tmp = tempfile::tempdir()?;
    let aged = || LogOptions {
        retention_age: Some(Duration::from_secs(3600)),
        ..opts(Some(key(9)))
    };
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    let created = SystemTime::now();
    log.append(&[entry(0, b"only")], 0)?;
    log.close()?;
    let (log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    log.close()?;
    let segs = segments(tmp.path());
    let seg = &segs[0];
    let mut b = std::fs::read(seg)?;
    let last = b.len() - 3;
    b[last] ^= 0xFF; // its only batch
    std::fs::write(seg, &b)?;
    std::fs::remove_file(seg.with_extension("idx"))?;
    let (mut log, rec) = Log::open(tmp.path(), aged())?;
    assert_eq!(rec.damaged_batches, 1, "{rec:?}");
    assert!(log.enforce_retention(created)?.is_empty());
    assert!(
        segments(tmp.path()).contains(seg),
        "kept while younger than the age"
    );
    // Then it goes, with the second run's segment (empty, as old).
    let later = SystemTime::now() + Duration::from_secs(3601);
    let ids: Vec<u64> = segs.iter().map(|s| segment_id(s)).collect();
    assert_eq!(log.enforce_retention(later)?, ids);
    assert!(!seg.exists());
    Ok(())
}

/// Under `never` (and `interval`) the log still syncs every quarter of the crash gap's records:
/// a power cut must not lose more offsets than the next start skips.
#[test]
fn fsync_never_still_syncs_within_the_crash_gap() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(
        tmp.path(),
        LogOptions {
            fsync: FsyncMode::Never,
            crash_offset_gap: 100,
            ..opts(None)
        },
    )?;
    let before = log.stats().syncs;
    for offset in 0..200 {
        log.append(&[entry(offset, b"x")], 0)?;
        log.commit()?;
    }
    assert_eq!(log.stats().syncs - before, 200 / 25);
    Ok(())
}

/// Batch numbers used up by failed writes (a full disk) leave a gap; damage before the gap
/// must not make recovery take what follows it for a torn tail. The search for the next whole
/// frame looked only a little past the expected number, missed the batches after the gap, and
/// cut them: confirmed messages deleted.
#[test]
fn damage_before_a_gap_in_batch_numbers_is_not_a_torn_tail() -> R {
    use aqueduct_log::format::finish_frame;
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(None))?;
    for offset in 0..8 {
        log.append(&[entry(offset, b"payload-of-some-length")], 0)?;
    }
    log.commit()?;
    drop(log); // a crash: the segment stays the newest, read through at the next open
    let seg = segments(tmp.path()).pop().ok_or("a segment")?;
    let mut b = std::fs::read(&seg)?;
    let frames = frames(&b);
    assert_eq!(frames.len(), 8);
    // Batches 6 and 7 become 40 and 41, as if 34 writes had failed between them and batch 5.
    for (k, &(pos, len)) in frames[6..].iter().enumerate() {
        let body = pos + FRAME_PREFIX;
        b[body..body + 8].copy_from_slice(&(40 + k as u64).to_le_bytes());
        finish_frame(&mut b[pos..pos + len], 0);
    }
    // Damage inside batch 5's body (its length intact).
    let (pos5, len5) = frames[5];
    b[pos5 + len5 - 2] ^= 0xFF;
    std::fs::write(&seg, &b)?;
    let _ = std::fs::remove_file(seg.with_extension("idx"));
    let (log, rec) = Log::open(tmp.path(), opts(None))?;
    assert_eq!(rec.truncated_bytes, 0, "nothing cut");
    assert_eq!(rec.damaged_batches, 1);
    let got = offsets(&read_all(&log, "t", 0)?);
    assert_eq!(got, [0, 1, 2, 3, 4, 6, 7]);
    Ok(())
}

/// `verify` calls a bad end of the newest segment damage, not a torn tail, when an index covers
/// it (a clean close): the broker trusts that index and cuts nothing, and readers skip the
/// batch. It said "torn tail … the broker cuts them" and exited 0.
#[test]
fn verify_calls_a_bad_indexed_end_damage() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(4))))?;
    for offset in 0..3 {
        log.append(&[entry(offset, b"confirmed")], 0)?;
    }
    log.close()?;
    let seg = segments(tmp.path()).pop().ok_or("a segment")?;
    let mut b = std::fs::read(&seg)?;
    let last = b.len() - 3;
    b[last] ^= 0xFF;
    std::fs::write(&seg, &b)?;
    let report = verify(tmp.path(), &[key(4)], &mut |_, _| {})?;
    assert_eq!(report.torn_tail, 0);
    assert_eq!(report.damage.len(), 1, "{report:?}");
    assert!(!report.is_ok());
    // Without its index the next start cuts it: then it is a torn tail.
    std::fs::remove_file(seg.with_extension("idx"))?;
    let report = verify(tmp.path(), &[key(4)], &mut |_, _| {})?;
    assert!(
        report.torn_tail > 0 && report.damage.is_empty(),
        "{report:?}"
    );
    Ok(())
}

/// A segment under another name than its header's id (renamed, or restored wrongly) stops the
/// open, naming the file and the name it should have: it was read under its header's name, and
/// sealed or deleted there, never through its own.
#[test]
fn a_segment_under_another_name_is_refused() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(None))?;
    log.append(&[entry(0, b"x")], 0)?;
    log.close()?;
    let seg = segments(tmp.path()).pop().ok_or("a segment")?;
    let renamed = tmp.path().join("00000000000000000007.seg");
    std::fs::rename(&seg, &renamed)?;
    let _ = std::fs::remove_file(seg.with_extension("idx"));
    let err = Log::open(tmp.path(), opts(None)).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("00000000000000000007.seg")
            && text.contains("its header says it is segment 0"),
        "{text}"
    );
    // Its own id, but not in 20 digits: it was opened, then not found under its canonical
    // name, and skipped as if retention had deleted it.
    let short = tmp.path().join("0.seg");
    std::fs::rename(&renamed, &short)?;
    for open in [
        Log::open(tmp.path(), opts(None)).map(|_| ()),
        aqueduct_log::LogView::open(tmp.path(), &[]).map(|_| ()),
    ] {
        let text = open.expect_err("refused").to_string();
        assert!(
            text.contains("0.seg") && text.contains("00000000000000000000.seg"),
            "{text}"
        );
    }
    Ok(())
}

#[test]
fn nonces_never_repeat_across_reopen_and_rotation() -> R {
    let tmp = tempfile::tempdir()?;
    let o = || LogOptions {
        max_segment_bytes: 400,
        ..opts(Some(key(7)))
    };
    for round in 0..4 {
        let (mut log, _) = Log::open(tmp.path(), o())?;
        fill(&mut log, "n", 10, 3)?;
        if round % 2 == 0 {
            log.close()?;
        } // else: crash
    }
    // (segment salt → data key, batch number → nonce): all pairs distinct.
    let mut salts = std::collections::HashSet::new();
    let mut pairs = std::collections::HashSet::new();
    let mut batches = 0;
    for seg in segments(tmp.path()) {
        let b = std::fs::read(&seg)?;
        let h = SegmentHeader::decode(&b)?;
        assert!(h.encrypted);
        assert!(salts.insert(h.salt), "salt reused in {}", seg.display());
        for (pos, _) in frames(&b) {
            let batch_no = u64::from_le_bytes(b[pos + 8..pos + 16].try_into()?);
            assert!(pairs.insert((h.salt, batch_no)), "nonce reused");
            batches += 1;
        }
    }
    assert_eq!(batches, 40);
    assert!(salts.len() >= 8, "{} segments", salts.len());
    Ok(())
}

#[test]
fn retention_deletes_only_sealed_segments_and_offsets_go_on() -> R {
    let tmp = tempfile::tempdir()?;
    let o = |bytes| LogOptions {
        max_segment_bytes: 400,
        retention_bytes: Some(bytes),
        ..opts(Some(key(8)))
    };
    let (mut log, _) = Log::open(tmp.path(), o(1_000))?;
    fill(&mut log, "old", 10, 3)?;
    fill(&mut log, "new", 10, 3)?;
    let before = log.stats();
    let deleted = log.enforce_retention(SystemTime::now())?;
    assert!(!deleted.is_empty());
    let after = log.stats();
    assert!(after.bytes <= 1_000 + 400, "{after:?}");
    assert_eq!(after.deleted_segments, deleted.len() as u64);
    assert!(after.segments < before.segments);
    // "old" lost its messages but keeps its offsets.
    assert!(read_all(&log, "old", 0)?.is_empty());
    assert_eq!(log.next_offset(b"old"), 30);
    log.close()?;
    let (log, _) = Log::open(tmp.path(), o(1_000))?;
    assert_eq!(log.next_offset(b"old"), 30, "the mark survives a reopen");
    assert_eq!(log.last_offset(b"new"), Some(29));
    // Retention by bytes never deletes the active segment, even at 0.
    let (mut log0, _) = {
        log.close()?;
        Log::open(tmp.path(), o(0))?
    };
    log0.enforce_retention(SystemTime::now())?;
    assert_eq!(log0.stats().segments, 1);
    assert_eq!(log0.next_offset(b"new"), 30);
    assert_eq!(log0.next_offset(b"old"), 30);
    drop(log0);

    // By age.
    let tmp = tempfile::tempdir()?;
    let aged = LogOptions {
        max_segment_bytes: 1_000,
        retention_age: Some(Duration::from_secs(60)),
        ..opts(None)
    };
    let (mut log, _) = Log::open(tmp.path(), aged)?;
    fill(&mut log, "a", 10, 3)?; // timestamps: 1000 ms after the epoch
    let segs = log.stats().segments;
    assert!(log
        .enforce_retention(SystemTime::UNIX_EPOCH + Duration::from_secs(30))?
        .is_empty());
    assert_eq!(
        log.enforce_retention(SystemTime::now())?.len() as u64,
        segs - 1
    );
    assert_eq!(log.next_offset(b"a"), 30);
    Ok(())
}

/// Retention that forgets the topics it empties: the log keeps nothing of them (they are not
/// listed or counted), and one logged again starts past every offset it had — also after a
/// reopen and after a crash — while a topic the caller keeps stays as with plain retention.
#[test]
fn retention_forgets_emptied_topics_behind_an_offset_floor() -> R {
    let tmp = tempfile::tempdir()?;
    let o = LogOptions {
        max_segment_bytes: 400,
        retention_bytes: Some(1_000),
        crash_offset_gap: 1_000,
        ..opts(Some(key(8)))
    };
    let (mut log, _) = Log::open(tmp.path(), o.clone())?;
    fill(&mut log, "gone", 10, 5)?; // offsets 0..=49
    fill(&mut log, "kept", 10, 3)?; // 0..=29
    fill(&mut log, "new", 10, 3)?;
    assert_eq!(log.stats().topics, 3);
    /// Chooses "gone" and "kept", then forgets only "gone".
    #[derive(Default)]
    struct OnlyGone {
        offered: Vec<Box<[u8]>>,
        floor: Option<u64>,
    }
    impl Forget for OnlyGone {
        fn choose(&mut self, emptied: &[Box<[u8]>]) -> Vec<Box<[u8]>> {
            self.offered = emptied.to_vec();
            emptied.to_vec()
        }
        fn forget(&mut self, chosen: &[Box<[u8]>], floor: u64) -> Vec<Box<[u8]>> {
            self.floor = Some(floor);
            chosen
                .iter()
                .filter(|t| &***t == b"gone")
                .cloned()
                .collect()
        }
    }
    let mut f = OnlyGone::default();
    log.enforce_retention_forgetting(SystemTime::now(), &mut f)?;
    f.offered.sort();
    assert_eq!(
        f.offered,
        vec![Box::from(&b"gone"[..]), Box::from(&b"kept"[..])]
    );
    assert_eq!(f.floor, Some(50), "past every offset of the chosen topics");
    assert_eq!(log.stats().topics, 2);
    assert_eq!(log.stats().forgotten_topics, 1);
    assert!(!log.topics().any(|t| t == b"gone"));
    assert_eq!(log.next_offset(b"gone"), 50);
    assert_eq!(log.next_offset(b"kept"), 30, "kept as without forgetting");
    assert_eq!(log.new_topic_offset(), 50);
    // The floor's name is no topic's: not listed, and no data goes under it.
    assert!(!log.topics().any(|t| t == FLOOR_TOPIC));
    let refused = log.append(
        &[Entry {
            topic: FLOOR_TOPIC,
            offset: 100,
            data: b"x",
        }],
        1,
    );
    assert!(
        matches!(refused, Err(LogError::InvalidAppend(_))),
        "{refused:?}"
    );
    // A topic new to the log whose first offset was handed out from the floor before the pass
    // (it waited to be appended) is still taken; a forgotten topic must go on from the new one.
    let at = |topic: &'static [u8], offset| {
        [Entry {
            topic,
            offset,
            data: b"x",
        }]
    };
    assert!(matches!(
        log.append(&at(b"gone", 0), 1),
        Err(LogError::OffsetNotIncreasing { .. })
    ));
    log.append(&at(b"fresh", 0), 1)?;
    assert_eq!(log.next_offset(b"fresh"), 1);
    // Until the appender says everything handed out before the pass is in.
    log.end_forget_grace();
    assert!(matches!(
        log.append(&at(b"late", 0), 1),
        Err(LogError::OffsetNotIncreasing { .. })
    ));
    log.close()?;

    let (mut log, rec) = Log::open(tmp.path(), o.clone())?;
    assert_eq!(rec.topics, 3, "the floor is not a topic");
    // After a reopen nothing waits to be appended: a new topic starts at the floor.
    assert!(matches!(
        log.append(&at(b"other", 0), 1),
        Err(LogError::OffsetNotIncreasing { .. })
    ));
    assert_eq!(log.next_offset(b"gone"), 50, "the floor survives a reopen");
    assert_eq!(log.next_offset(b"kept"), 30);
    assert_eq!(fill(&mut log, "gone", 1, 2)?, vec![50, 51]);
    assert_eq!(log.next_offset(b"gone"), 52);
    assert_eq!(verify(tmp.path(), &[key(8)], &mut |_, _| {})?.topics, 4);
    drop(log); // a crash: no clean close
    let (log, _) = Log::open(tmp.path(), o)?;
    assert_eq!(log.next_offset(b"gone"), 52 + 1_000);
    assert_eq!(
        log.new_topic_offset(),
        50 + 1_000,
        "the floor moves past the crash gap"
    );
    Ok(())
}

/// `truncate_after` into an older segment: the new active segment's id is past every segment
/// the log had (it took the id of the first segment deleted, which a reader's cache and plans
/// could take it for).
#[test]
fn truncating_into_an_older_segment_uses_a_new_id() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(16), vec![]))?;
    let cut = log.append(&[entry(0, b"a")], 1)?;
    log.commit()?;
    fill(&mut log, "t", 12, 3)?;
    let before = segments(tmp.path());
    assert!(before.len() >= 3, "{before:?}");
    let last_id = segment_id(before.last().expect("segments"));
    log.truncate_after(cut)?;
    let after = segments(tmp.path());
    assert_eq!(after.len(), 2, "{after:?}");
    assert_eq!(after[0], before[0]);
    assert_eq!(segment_id(&after[1]), last_id + 1);
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![0]);
    log.close()?;
    let (log, _) = Log::open(tmp.path(), rotated(key(16), vec![]))?;
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![0]);
    Ok(())
}

#[test]
fn truncate_after_and_purge_before() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    let p1 = log.append(&[entry(0, b"a"), entry(1, b"b")], 1)?;
    log.append(&[entry(2, b"c")], 2)?;
    log.truncate_after(p1)?;
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![0, 1]);
    assert_eq!(log.next_offset(b"t"), 2);
    log.append(&[entry(2, b"C")], 3)?;
    let got = read_all(&log, "t", 0)?;
    assert_eq!(got[2].data, b"C");
    assert!(log
        .truncate_after(aqueduct_log::Position {
            segment: p1.segment,
            byte: p1.byte - 1
        })
        .is_err());
    let p = log.append(&[entry(3, b"d")], 4)?;
    let purged = log.purge_before(p)?;
    assert_eq!(purged, vec![p1.segment]);
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![2, 3]);
    assert_eq!(log.first_offset(b"t"), Some(2));
    log.close()?;
    let (log, _) = Log::open(tmp.path(), opts(Some(key(9))))?;
    assert_eq!(offsets(&read_all(&log, "t", 0)?), vec![2, 3]);
    Ok(())
}

#[test]
fn a_rare_topic_in_a_busy_log_reads_through_the_index() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(None))?;
    let big = vec![7u8; 4000];
    for i in 0..400u64 {
        log.append(
            &[Entry {
                topic: b"busy",
                offset: i,
                data: &big,
            }],
            0,
        )?;
        if i % 100 == 0 {
            log.append(
                &[Entry {
                    topic: b"rare",
                    offset: i / 100,
                    data: b"r",
                }],
                0,
            )?;
        }
    }
    log.close()?;
    // Drop the index: rebuilt on open, and the result reads the same.
    for seg in segments(tmp.path()) {
        std::fs::remove_file(seg.with_extension("idx"))?;
    }
    let (log, rec) = Log::open(tmp.path(), opts(None))?;
    assert_eq!(rec.rebuilt_indexes, rec.segments - 1);
    assert_eq!(offsets(&read_all(&log, "rare", 0)?), vec![0, 1, 2, 3]);
    assert_eq!(offsets(&read_all(&log, "rare", 2)?), vec![2, 3]);
    assert_eq!(read_all(&log, "busy", 390)?.len(), 10);
    Ok(())
}

#[test]
fn readers_on_another_thread_see_a_whole_prefix_while_the_log_grows() -> R {
    let tmp = tempfile::tempdir()?;
    let o = LogOptions {
        max_segment_bytes: 4_000,
        ..opts(Some(key(10)))
    };
    let (mut log, _) = Log::open(tmp.path(), o)?;
    let index = log.index();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let done = done.clone();
        std::thread::spawn(move || -> Result<usize, String> {
            let mut reads = 0;
            loop {
                let finished = done.load(std::sync::atomic::Ordering::Acquire);
                let got: Vec<Record> = index
                    .read(b"t", 0)
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                for (i, r) in got.iter().enumerate() {
                    if r.offset != i as u64 || r.data != msg("t", r.offset) {
                        return Err(format!("read {} at position {i}", r.offset));
                    }
                }
                reads += 1;
                if finished {
                    return Ok(reads);
                }
            }
        })
    };
    fill(&mut log, "t", 300, 3)?;
    done.store(true, std::sync::atomic::Ordering::Release);
    let reads = reader.join().map_err(|_| "reader panicked")??;
    assert!(reads > 1);
    assert_eq!(log.index().read(b"t", 0).count(), 900);
    assert!(log.stats().segments > 3, "rotated while read");
    Ok(())
}

/// Frame start positions of a segment file's whole frames.
/// Where each whole frame of a segment starts, and its length, up to the first that is not.
fn frames(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut frames = Vec::new();
    let mut pos = HEADER_LEN;
    while let FrameCheck::Good { len } = check_frame(&bytes[pos..]) {
        frames.push((pos, len));
        pos += len;
    }
    frames
}

fn frame_starts(bytes: &[u8]) -> Vec<usize> {
    frames(bytes).into_iter().map(|(pos, _)| pos).collect()
}

#[test]
fn damage_over_many_batches_in_the_last_segment_is_kept_not_cut() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(11))))?;
    fill(&mut log, "a", 150, 1)?;
    drop(log); // crash: the last segment is read through at the next open
    let seg = segments(tmp.path())
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .ok_or("no segment")?;
    let mut b = std::fs::read(&seg)?;
    let starts = frame_starts(&b);
    assert_eq!(starts.len(), 150);
    // Zero batches 5..=100: far more than a few frames of damage.
    for x in &mut b[starts[5]..starts[101]] {
        *x = 0;
    }
    std::fs::write(&seg, &b)?;
    let _ = std::fs::remove_file(seg.with_extension("idx"));
    let (log, rec) = Log::open(tmp.path(), opts(Some(key(11))))?;
    assert_eq!(
        rec.truncated_bytes, 0,
        "checked batches follow: damage, not a torn tail"
    );
    assert_eq!(
        std::fs::metadata(&seg)?.len() as usize,
        b.len(),
        "nothing cut"
    );
    let got = offsets(&read_all(&log, "a", 0)?);
    let want: Vec<u64> = (0..5).chain(101..150).collect();
    assert_eq!(got, want);
    Ok(())
}

#[test]
fn a_crash_right_after_rotation_still_counts_as_a_crash() -> R {
    let tmp = tempfile::tempdir()?;
    let gap = 1_000;
    let o = || LogOptions {
        max_segment_bytes: 400,
        crash_offset_gap: gap,
        ..opts(None)
    };
    let (mut log, _) = Log::open(tmp.path(), o())?;
    fill(&mut log, "a", 4, 3)?;
    drop(log);
    // The newest segment (made by the last rotation) never reached the disk.
    let newest = segments(tmp.path()).pop().ok_or("no segment")?;
    std::fs::remove_file(&newest)?;
    let (log, rec) = Log::open(tmp.path(), o())?;
    assert!(!rec.clean, "a rotation-sealed segment is not a clean close");
    let high = log.last_offset(b"a").ok_or("data")?;
    assert_eq!(log.next_offset(b"a"), high + 1 + gap);
    Ok(())
}

#[test]
fn an_unreadable_older_segment_stops_the_open_and_a_damaged_newest_counts_as_a_crash() -> R {
    let tmp = tempfile::tempdir()?;
    let o = || LogOptions {
        max_segment_bytes: 400,
        ..opts(None)
    };
    let (mut log, _) = Log::open(tmp.path(), o())?;
    fill(&mut log, "a", 12, 3)?;
    log.close()?;
    // Opened and closed once more: the newest segment is an empty one.
    Log::open(tmp.path(), o())?.0.close()?;
    let segs = segments(tmp.path());
    assert!(segs.len() >= 3, "{} segments", segs.len());
    // The newest segment (only a header: the active one of a closed log) damaged, not blank:
    // moved aside, and the run counts as crashed.
    let newest = segs[segs.len() - 1].clone();
    let mut b = std::fs::read(&newest)?;
    assert_eq!(b.len(), HEADER_LEN);
    b[20] ^= 0xFF;
    std::fs::write(&newest, &b)?;
    let (log, rec) = Log::open(tmp.path(), o())?;
    assert!(!rec.clean);
    let aside = newest.with_extension("seg.unreadable");
    assert_eq!(rec.unreadable_segments.len(), 1);
    assert_eq!(rec.unreadable_segments[0].0, aside);
    assert!(!newest.exists() && aside.exists(), "moved aside, kept");
    log.close()?;
    // And the next start is not refused for it (left in place, it would be an unreadable
    // older segment then).
    let (log, rec) = Log::open(tmp.path(), o())?;
    assert!(rec.clean && rec.unreadable_segments.is_empty());
    assert_eq!(log.next_offset(b"a"), 36 + (1 << 20), "one crash's gap");
    drop(log);
    // An older one: refused, naming it.
    let older = segs[0].clone();
    let mut b = std::fs::read(&older)?;
    b[20] ^= 0xFF;
    std::fs::write(&older, &b)?;
    let e = Log::open(tmp.path(), o()).map(|_| ());
    match e {
        Err(LogError::BadFile { path, reason }) => {
            assert_eq!(path, older);
            assert!(reason.contains("handed out again"), "{reason}");
        }
        other => return Err(format!("expected BadFile, got {other:?}").into()),
    }
    Ok(())
}

#[test]
fn a_newest_segment_with_a_zeroed_header_and_batches_after_it_is_refused_not_removed() -> R {
    // A crash while a segment is created leaves it blank (its header is synced before any
    // batch is written); a zeroed header with batches after it is damage, and removing the
    // file would lose what was confirmed from it and hand its offsets out again.
    let tmp = tempfile::tempdir()?;
    let o = || LogOptions {
        crash_offset_gap: 10,
        ..opts(None)
    };
    let (mut log, _) = Log::open(tmp.path(), o())?;
    fill(&mut log, "t", 10, 10)?;
    drop(log);
    let newest = segments(tmp.path()).pop().ok_or("no segment")?;
    let mut b = std::fs::read(&newest)?;
    assert!(b.len() > HEADER_LEN, "batches after the header");
    b[..HEADER_LEN].fill(0);
    std::fs::write(&newest, &b)?;
    match Log::open(tmp.path(), o()).map(|_| ()) {
        Err(LogError::BadFile { path, .. }) => assert_eq!(path, newest),
        other => return Err(format!("expected BadFile, got {other:?}").into()),
    }
    assert!(newest.exists(), "kept in place");
    // A wholly blank one is what a crash during creation leaves: removed.
    b.fill(0);
    std::fs::write(&newest, &b)?;
    let (_, rec) = Log::open(tmp.path(), o())?;
    assert_eq!(rec.removed_empty_segments, 1);
    assert!(!newest.exists());
    Ok(())
}

#[test]
fn with_a_key_index_files_are_authenticated_and_plaintext_segments_refused() -> R {
    // An index changed without the key is not trusted: the segment is read through instead.
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(12))))?;
    fill(&mut log, "a", 3, 2)?;
    log.close()?;
    let seg = segments(tmp.path()).pop().ok_or("no segment")?;
    let idx_path = seg.with_extension("idx");
    let mut idx = std::fs::read(&idx_path)?;
    // Flip a byte of the index body and fix its CRC (the MAC after it stays as it was).
    let body_len = idx.len() - 32 - 4;
    // The last byte of the body: inside the last entry's position, so the index still decodes
    // and still covers the segment's length; only the MAC tells.
    idx[body_len - 1] ^= 1;
    let crc = crc32c(&idx[..body_len]);
    idx[body_len..body_len + 4].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&idx_path, &idx)?;
    let (log, rec) = Log::open(tmp.path(), opts(Some(key(12))))?;
    assert_eq!(rec.rebuilt_indexes, 1, "a tampered index is read through");
    assert_eq!(
        offsets(&read_all(&log, "a", 0)?),
        (0..6).collect::<Vec<_>>()
    );
    drop(log);

    // A plaintext log gets a key: its older plaintext segments are refused unless allowed.
    let tmp = tempfile::tempdir()?;
    let small = |key, allow| LogOptions {
        max_segment_bytes: 400,
        allow_plaintext: allow,
        ..opts(key)
    };
    let (mut log, _) = Log::open(tmp.path(), small(None, false))?;
    fill(&mut log, "p", 8, 3)?;
    log.close()?;
    let e = Log::open(tmp.path(), small(Some(key(13)), false)).map(|_| ());
    match e {
        Err(LogError::BadFile { reason, .. }) => {
            assert!(reason.contains("aal.allow_plaintext"), "{reason}")
        }
        other => return Err(format!("expected BadFile, got {other:?}").into()),
    }
    let (mut log, _) = Log::open(tmp.path(), small(Some(key(13)), true))?;
    assert_eq!(read_all(&log, "p", 0)?.len(), 24);
    fill(&mut log, "p", 1, 1)?;
    assert_eq!(read_all(&log, "p", 0)?.len(), 25);
    log.close()?;

    // A plaintext segment newer than the sealed ones (written by someone without the key) is
    // refused even so: it was read as the newest, its records served as authentic.
    let all = segments(tmp.path());
    let first = all.first().ok_or("a segment")?;
    let next = all.len() as u64 + 10;
    let mut forged = std::fs::read(first)?;
    forged[16..24].copy_from_slice(&next.to_le_bytes());
    let crc = crc32c(&forged[..92]);
    forged[92..96].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(tmp.path().join(format!("{next:020}.seg")), &forged)?;
    match Log::open(tmp.path(), small(Some(key(13)), true)).map(|_| ()) {
        Err(LogError::BadFile { reason, .. }) => {
            assert!(
                reason.contains("after segments sealed with a key"),
                "{reason}"
            )
        }
        other => return Err(format!("expected BadFile, got {other:?}").into()),
    }
    // The tools agree: verify counts it as a failure, dump leaves it out and names it.
    let forged_path = tmp.path().join(format!("{next:020}.seg"));
    let report = aqueduct_log::verify(tmp.path(), &[key(13)], &mut |_, _| {})?;
    assert!(
        report
            .failures
            .iter()
            .any(|(p, why)| *p == forged_path && why.contains("sealed")),
        "{:?}",
        report.failures
    );
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(13)])?;
    assert_eq!(view.skipped, vec![forged_path]);
    Ok(())
}

/// Files of this process open inside `dir` (other tests run at the same time: only this
/// test's directory counts).
fn open_files_in(dir: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| {
        d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.starts_with(dir))
            .count()
    })
}

#[test]
fn many_topics_share_few_files() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(14))))?;
    let names: Vec<String> = (0..20_000).map(|i| format!("t/{i}")).collect();
    for chunk in names.chunks(1_000) {
        let entries: Vec<Entry<'_>> = chunk
            .iter()
            .map(|t| Entry {
                topic: t.as_bytes(),
                offset: 0,
                data: b"x",
            })
            .collect();
        log.append(&entries, 0)?;
    }
    log.commit()?;
    assert_eq!(log.topics().count(), 20_000);
    let open = open_files_in(tmp.path());
    assert_eq!(
        open, 2,
        "{open} files open for 20,000 topics: the active segment and the directory's lock only"
    );
    assert_eq!(offsets(&read_all(&log, "t/12345", 0)?), vec![0]);
    log.close()?;
    let (log, rec) = Log::open(tmp.path(), opts(Some(key(14))))?;
    assert_eq!(rec.topics, 20_000);
    assert_eq!(log.next_offset(b"t/19999"), 1);
    Ok(())
}

/// Three batches of two messages of topic `a`, the middle one changed by `damage` (given the
/// segment's bytes and the batches' positions) after the log was closed and indexed; reopened,
/// the index still trusted: the offsets a reader of `a` gets, and how many errors.
fn read_past_damage(
    key_byte: Option<u8>,
    damage: impl FnOnce(&mut [u8], &[usize]),
) -> Result<(Vec<u64>, usize), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(key_byte.map(key)))?;
    fill(&mut log, "a", 3, 2)?;
    log.close()?;
    let seg = segments(tmp.path())
        .into_iter()
        .find(|p| std::fs::metadata(p).map(|m| m.len() > 96).unwrap_or(false))
        .ok_or("no segment")?;
    let mut b = std::fs::read(&seg)?;
    let starts = frame_starts(&b);
    assert_eq!(starts.len(), 3);
    damage(&mut b, &starts);
    std::fs::write(&seg, &b)?;
    let (log, rec) = Log::open(tmp.path(), opts(key_byte.map(key)))?;
    assert_eq!(rec.rebuilt_indexes, 0, "the index is still trusted");
    let items: Vec<Result<Record, LogError>> = log.read(b"a", 0).collect();
    let ok = items
        .iter()
        .filter_map(|r| r.as_ref().ok().map(|r| r.offset))
        .collect();
    Ok((ok, items.iter().filter(|r| r.is_err()).count()))
}

#[test]
fn a_reader_skips_a_batch_damaged_after_indexing_and_goes_on() -> R {
    let (ok, errors) = read_past_damage(None, |b, starts| {
        b[starts[1] + FRAME_PREFIX + BODY_HEADER + 3] ^= 0xFF;
    })?;
    assert_eq!(
        ok,
        vec![0, 1, 4, 5],
        "the batches after the damage still read"
    );
    assert_eq!(errors, 1);
    Ok(())
}

/// A batch whose length was damaged after indexing loses its frame boundary: the reader finds
/// the next checked frame in the window, as the open's read-through does, instead of giving
/// up the rest of the window (up to 64 KiB of messages). Not inside a plaintext frame cut
/// short, whose rest may be anything a publisher sent.
#[test]
fn a_reader_finds_the_next_batch_past_a_damaged_length() -> R {
    let cases: [(Option<u8>, u32, &[u64]); 4] = [
        (Some(15), u32::MAX, &[0, 1, 4, 5]),
        (Some(15), (BODY_HEADER + 100_000) as u32, &[0, 1, 4, 5]),
        (None, u32::MAX, &[0, 1, 4, 5]),
        (None, (BODY_HEADER + 100_000) as u32, &[0, 1]),
    ];
    for (k, len, want) in cases {
        let (ok, errors) = read_past_damage(k, |b, starts| {
            b[starts[1]..starts[1] + 4].copy_from_slice(&len.to_le_bytes());
        })?;
        assert_eq!(ok, want, "key {k:?}, length {len:#x}");
        assert_eq!(errors, 1);
    }
    Ok(())
}

/// A second open of a directory in use (a second broker with the same aal.file_path) is
/// refused before it reads or changes anything: it would cut the first one's batches as a torn
/// tail and hand out the same offsets. Once the first closes, the directory opens again.
#[test]
fn a_directory_in_use_is_refused() -> R {
    let dir = tempfile::tempdir()?;
    let (mut first, _) = Log::open(dir.path(), opts(None))?;
    fill(&mut first, "t", 2, 3)?;
    let before = segments(dir.path());
    match Log::open(dir.path(), opts(None)) {
        Err(LogError::Locked { path }) => {
            assert_eq!(path, dir.path().join(aqueduct_log::LOCK_FILE));
        }
        Err(e) => panic!("expected Locked, got {e}"),
        Ok(_) => panic!("a directory in use was opened twice"),
    }
    assert_eq!(segments(dir.path()), before, "nothing changed on disk");
    fill(&mut first, "t", 1, 1)?;
    first.close()?;
    let (again, _) = Log::open(dir.path(), opts(None))?;
    assert_eq!(
        offsets(&read_all(&again, "t", 0)?),
        (0..7).collect::<Vec<_>>()
    );
    Ok(())
}

/// A segment named with the largest id cannot be followed: refused with the file named, not a
/// panic or a wrapped id that would sort before every other segment.
#[test]
fn a_segment_with_the_largest_id_is_refused() -> R {
    let tmp = tempfile::tempdir()?;
    let (log, _) = Log::open(tmp.path(), opts(None))?;
    log.close()?;
    let only = segments(tmp.path()).pop().ok_or("a segment")?;
    let last = tmp.path().join(format!("{:020}.seg", u64::MAX));
    std::fs::copy(&only, &last)?;
    match Log::open(tmp.path(), opts(None)) {
        Err(LogError::BadFile { path, reason }) => {
            assert_eq!(path, last);
            assert!(reason.contains("too large"), "{reason}");
        }
        Err(e) => return Err(format!("expected BadFile, got {e}").into()),
        Ok(_) => return Err("opened".into()),
    }
    Ok(())
}

/// A log directory the log creates is its owner's only: without a key it holds messages in
/// plain text.
#[cfg(unix)]
#[test]
fn a_new_log_directory_is_private() -> R {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("aal");
    let (log, _) = Log::open(&dir, opts(None))?;
    assert_eq!(std::fs::metadata(&dir)?.permissions().mode() & 0o777, 0o700);
    log.close()?;
    Ok(())
}

/// In a log without a key a message body is stored as it came, so a publisher can make it look
/// like a whole checked frame. Recovery from a torn or damaged frame must not look inside that
/// frame's body for the next one: the fake frame (another topic, any offset) would be taken as
/// the log's own.
#[test]
fn a_frame_inside_a_plaintext_message_is_never_taken_for_the_logs_own() -> R {
    fn frames(seg: &[u8]) -> Vec<std::ops::Range<usize>> {
        let mut v = Vec::new();
        let mut pos = HEADER_LEN;
        while pos + FRAME_PREFIX <= seg.len() {
            let body = u32::from_le_bytes(seg[pos..pos + 4].try_into().expect("4 bytes")) as usize;
            v.push(pos..pos + FRAME_PREFIX + body);
            pos += FRAME_PREFIX + body;
        }
        v
    }
    // The fake: the second frame (batch 1) of another plaintext log, naming topic "fake".
    let other = tempfile::tempdir()?;
    let (mut log, _) = Log::open(other.path(), opts(None))?;
    fill(&mut log, "x", 1, 1)?;
    let entries = [Entry {
        topic: b"fake",
        offset: 1 << 40,
        data: b"forged",
    }];
    log.append(&entries, 0)?;
    log.commit()?;
    drop(log);
    let seg = std::fs::read(segments(other.path()).pop().ok_or("segment")?)?;
    let fake = seg[frames(&seg)[1].clone()].to_vec();
    assert_eq!(check_frame(&fake), FrameCheck::Good { len: fake.len() });

    for damage in ["torn", "flipped"] {
        let tmp = tempfile::tempdir()?;
        let (mut log, _) = Log::open(tmp.path(), opts(None))?;
        fill(&mut log, "t", 1, 1)?;
        let mut body = vec![b'-'; 64];
        body.extend_from_slice(&fake);
        body.extend_from_slice(&[b'-'; 64]);
        let entries = [Entry {
            topic: b"t",
            offset: 1,
            data: &body,
        }];
        log.append(&entries, 0)?;
        log.commit()?;
        drop(log); // not closed: the next open reads the segment through
        let path = segments(tmp.path()).pop().ok_or("segment")?;
        let mut bytes = std::fs::read(&path)?;
        let outer = frames(&bytes)[1].clone();
        let inner = outer.start
            + bytes[outer.clone()]
                .windows(fake.len())
                .position(|w| w == &fake[..])
                .ok_or("the fake is stored as it came")?;
        match damage {
            // Cut after the fake, inside the message: a torn tail.
            "torn" => bytes.truncate(inner + fake.len() + 10),
            // A byte of the message's padding changed: a frame whose CRC fails.
            _ => bytes[inner - 10] ^= 0xFF,
        }
        std::fs::write(&path, &bytes)?;
        let (log, _) = Log::open(tmp.path(), opts(None))?;
        let mut topics: Vec<&[u8]> = log.topics().collect();
        topics.sort();
        assert_eq!(
            topics,
            vec![&b"t"[..]],
            "{damage}: no topic from inside a message"
        );
        assert_eq!(log.next_offset(b"fake"), log.new_topic_offset(), "{damage}");
    }
    Ok(())
}

/// Readers of many topics sharing one `ReadCache` (as a wildcard durable consumer reads), in
/// the log's order and interleaved, read exactly what each reader reads on its own — across
/// segments, with batches that hold several topics, and more batches than the cache keeps.
#[test]
fn readers_sharing_a_cache_read_what_each_reads_alone() -> R {
    let dir = tempfile::tempdir()?;
    let options = LogOptions {
        max_segment_bytes: 64 << 10,
        ..opts(Some(key(7)))
    };
    let (mut log, _) = Log::open(dir.path(), options)?;
    let topics: Vec<String> = (0..20).map(|i| format!("t/{i}")).collect();
    // 400 batches of 5 topics each, 3 KiB per message: ~6 MiB, more than the cache holds.
    let mut state = 12345u64;
    for b in 0..400u64 {
        let picked: Vec<&String> = (0..5)
            .map(|k| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                &topics[((state >> 33) as usize + k) % topics.len()]
            })
            .collect();
        let mut bodies = Vec::new();
        let mut next: std::collections::HashMap<&str, u64> = Default::default();
        for t in &picked {
            let at = *next
                .entry(t.as_str())
                .or_insert_with(|| log.next_offset(t.as_bytes()));
            next.insert(t.as_str(), at + 1);
            let mut body = msg(t, at);
            body.resize(3 << 10, b as u8);
            bodies.push((t.as_bytes(), at, body));
        }
        let entries: Vec<Entry<'_>> = bodies
            .iter()
            .map(|(topic, offset, data)| Entry {
                topic,
                offset: *offset,
                data,
            })
            .collect();
        log.append(&entries, 1_000 + b)?;
    }
    log.commit()?;
    for from in [0, 7, 40] {
        let alone: Vec<Vec<Record>> = topics
            .iter()
            .map(|t| read_all(&log, t, from))
            .collect::<Result<_, _>>()?;
        assert!(
            alone.iter().all(|r| !r.is_empty()),
            "every topic has messages from {from}"
        );
        // Where each reads first (a sealed segment's may come from its index file).
        let mut readers: Vec<_> = topics
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut reader = log.read(t.as_bytes(), from);
                (reader.position(), i, reader)
            })
            .collect();
        for (at, i, _) in &readers {
            let t = topics[*i].as_bytes();
            // The segment a reader starts in, as the offsets kept in memory say (the byte
            // position may come from an index file).
            assert_eq!(
                at.map(|(segment, _)| segment),
                log.index().first_segment(t, from),
                "{i} from {from}"
            );
            // The index's answer plans the first segment only.
            assert_eq!(log.index().position(t, from), *at, "{i} from {from}");
        }
        readers.sort_by_key(|(at, ..)| *at);
        let mut cache = aqueduct_log::ReadCache::default();
        let mut shared: Vec<Vec<Record>> = vec![Vec::new(); topics.len()];
        // A few messages of each in turn, until every reader is done.
        let mut done = vec![false; topics.len()];
        while done.iter().any(|d| !d) {
            for (_, i, reader) in readers.iter_mut() {
                for _ in 0..3 {
                    match reader.next_with(&mut cache) {
                        Some(r) => shared[*i].push(r?),
                        None => {
                            done[*i] = true;
                            break;
                        }
                    }
                }
            }
        }
        for (i, t) in topics.iter().enumerate() {
            assert_eq!(shared[i], alone[i], "{t} from {from}");
        }
    }
    Ok(())
}

/// A closed log sealed with `key(3)` over three segments or more: (its directory, its
/// segment files in order).
fn closed_log_of_segments() -> Result<(tempfile::TempDir, Vec<PathBuf>), Box<dyn std::error::Error>>
{
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), rotated(key(3), vec![]))?;
    for offset in 0..30 {
        log.append(
            &[entry(offset, b"a record of some length to fill segments")],
            0,
        )?;
    }
    log.close()?;
    let segs = segments(tmp.path());
    assert!(segs.len() >= 3, "{segs:?}");
    Ok((tmp, segs))
}

/// `verify` on a log a running broker holds: a segment listed at the start and deleted by
/// retention before its turn is counted as deleted meanwhile, not as unreadable (it made
/// `aqueduct log verify` fail on a healthy live log).
#[test]
fn verify_counts_a_segment_retention_deleted_meanwhile() -> R {
    let (tmp, segs) = closed_log_of_segments()?;
    let second = segs[1].clone();
    // Deleted as the first segment's check ends, as retention would.
    let mut deleted = false;
    let report = verify(tmp.path(), &[key(3)], &mut |_, _| {
        if !deleted {
            deleted = true;
            let _ = std::fs::remove_file(&second);
            let _ = std::fs::remove_file(second.with_extension("idx"));
        }
    })?;
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(report.deleted_meanwhile, 1, "{report:?}");
    assert_eq!(report.segments, segs.len() - 1);
    assert!(report.is_ok());
    Ok(())
}

/// A view of a log with an unreadable older segment names it (`log dump` said nothing and left
/// its messages out); the newest segment, which may be being created, is left out silently.
#[test]
fn a_view_names_an_unreadable_older_segment() -> R {
    let (tmp, segs) = closed_log_of_segments()?;
    let mut b = std::fs::read(&segs[1])?;
    b[..16].fill(0xEE);
    std::fs::write(&segs[1], &b)?;
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(3)])?;
    assert_eq!(view.skipped, vec![segs[1].clone()]);
    Ok(())
}

/// The newest segment is left out silently only while it may be being created (no more than a
/// header, or blank): one whose damaged header has batches after it is named like an older
/// one. `log dump` printed nothing and exited 0 for a log whose only segment was unreadable.
#[test]
fn a_view_names_an_unreadable_newest_segment_with_batches() -> R {
    let (tmp, segs) = closed_log_of_segments()?;
    let newest = segs.last().expect("segments").clone();
    let whole = std::fs::read(&newest)?;
    assert!(
        whole.len() > 96,
        "the newest segment holds batches after its 96-byte header"
    );
    let mut b = whole.clone();
    b[..16].fill(0xEE);
    std::fs::write(&newest, &b)?;
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(3)])?;
    assert_eq!(view.skipped, vec![newest.clone()]);
    // Cut to a damaged header alone, as a segment being created: left out without a word.
    std::fs::write(&newest, &b[..16])?;
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(3)])?;
    assert!(view.skipped.is_empty(), "{:?}", view.skipped);
    Ok(())
}

/// `aqueduct log dump` beside a live broker: a segment its retention deletes after the view
/// listed it, or after the view opened, is counted as deleted meanwhile, and the rest is read.
/// The view failed to open (the segment's NotFound), or its reader's error ended the dump.
#[test]
fn a_view_goes_on_past_segments_deleted_meanwhile() -> R {
    let tmp = tempfile::tempdir()?;
    {
        let (mut log, _) = Log::open(tmp.path(), rotated(key(15), vec![]))?;
        fill(&mut log, "t", 12, 3)?;
    }
    let segs = segments(tmp.path());
    assert!(segs.len() >= 3, "{segs:?}");
    // Deleted after the view opened: its reader says so, and goes on with the next segment.
    let view = aqueduct_log::LogView::open(tmp.path(), &[key(15)])?;
    assert_eq!(view.deleted_meanwhile, 0);
    std::fs::remove_file(&segs[0])?;
    let (mut gone, mut read) = (0, Vec::new());
    for r in view.read(b"t", 0) {
        match r {
            Ok(r) => read.push(r.offset),
            Err(e) if e.is_not_found() => gone += 1,
            Err(e) => return Err(e.into()),
        }
    }
    assert_eq!(gone, 1);
    assert_eq!(read.last(), Some(&35), "{read:?}");
    assert!(!read.contains(&0), "{read:?}");
    // Listed, then gone before it was read (a dangling link stands for that moment).
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(tmp.path().join("gone"), &segs[0])?;
        let view = aqueduct_log::LogView::open(tmp.path(), &[key(15)])?;
        assert_eq!(view.deleted_meanwhile, 1);
        assert!(view.skipped.is_empty());
        let last = view.read(b"t", 0).filter_map(Result::ok).last();
        assert_eq!(last.map(|r| r.offset), Some(35));
    }
    Ok(())
}

/// An index that is there but cannot be read (EIO, too many open files; here a directory in
/// its place) stops the start with an error naming it. It was taken as missing: the newest
/// segment was read through, its clean close called a crash, and every topic's offsets
/// jumped by the crash gap.
#[test]
fn an_unreadable_index_is_an_error_not_a_crash() -> R {
    let tmp = tempfile::tempdir()?;
    let (mut log, _) = Log::open(tmp.path(), opts(Some(key(17))))?;
    log.append(&[entry(0, b"a")], 0)?;
    log.close()?;
    let newest = segments(tmp.path()).pop().ok_or("a segment")?;
    let idx = newest.with_extension("idx");
    let saved = std::fs::read(&idx)?;
    std::fs::remove_file(&idx)?;
    std::fs::create_dir(&idx)?;
    match Log::open(tmp.path(), opts(Some(key(17)))).map(|_| ()) {
        Err(e) => assert!(e.to_string().contains("reading the index"), "{e}"),
        Ok(()) => return Err("opened past an unreadable index".into()),
    }
    // Readable again: a clean start, nothing skipped.
    std::fs::remove_dir(&idx)?;
    std::fs::write(&idx, saved)?;
    let (log, rec) = Log::open(tmp.path(), opts(Some(key(17))))?;
    assert!(rec.clean, "{rec:?}");
    assert_eq!(log.next_offset(b"t"), 1, "{rec:?}");
    Ok(())
}
