//! `aqueduct log verify|dump|rekey`: the durable log, offline. `verify` and `dump` change
//! nothing on disk, so both may run next to a broker that is using the log; `rekey` re-seals
//! segments, so it takes the log's lock and refuses a log in use.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use aqueduct_log::{LogView, MasterKey};
use aqueduct_server::durable::StoredMessage;

/// Logs at least this large get a progress bar (on a terminal).
const PROGRESS_FROM_BYTES: u64 = 64 << 20;

/// The log's keys, as the broker has them in `aal.key` and `aal.previous_keys`.
#[derive(Debug, clap::Args)]
pub struct LogKeys {
    /// File holding the base64 key (default: AQUEDUCT_AAL_KEY; none for a plaintext log).
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// File holding a key the log had before the current one (aal.previous_keys), to read the
    /// segments sealed with it; repeat for several (default: AQUEDUCT_AAL_PREVIOUS_KEYS,
    /// comma-separated).
    #[arg(long, value_name = "FILE")]
    previous_key_file: Vec<PathBuf>,
}

impl LogKeys {
    /// The current key, then the previous ones; empty for a plaintext log.
    fn load(&self) -> Result<Vec<MasterKey>> {
        use aqueduct_server::config::{decode_master_key, decode_previous_keys, split_list};
        let current = match &self.key_file {
            Some(path) => decode_master_key(&read_key_file(path)?)
                .map_err(|why| anyhow!("the key in {} {why}", path.display()))?,
            None => decode_master_key(&std::env::var("AQUEDUCT_AAL_KEY").unwrap_or_default())
                .map_err(|why| anyhow!("AQUEDUCT_AAL_KEY {why}"))?,
        };
        let mut previous = Vec::new();
        for path in &self.previous_key_file {
            let key = decode_master_key(&read_key_file(path)?)
                .map_err(|why| anyhow!("the previous key in {} {why}", path.display()))?
                .ok_or_else(|| anyhow!("the previous key file {} is empty", path.display()))?;
            previous.push(key);
        }
        if self.previous_key_file.is_empty() {
            let listed = std::env::var("AQUEDUCT_AAL_PREVIOUS_KEYS").unwrap_or_default();
            previous = decode_previous_keys(&split_list(&listed))
                .map_err(|why| anyhow!("AQUEDUCT_AAL_PREVIOUS_KEYS: {why}"))?;
        }
        match current {
            Some(current) => Ok(std::iter::once(current).chain(previous).collect()),
            None if previous.is_empty() => Ok(Vec::new()),
            None => bail!(
                "previous keys are given but no key (--key-file or AQUEDUCT_AAL_KEY): they only \
                 read the segments of before a key change, next to the current key"
            ),
        }
    }
}

/// `println!` that does not panic when standard output is closed (`aqueduct log verify | head`):
/// a closed pipe ends the output quietly, another write error is the command's.
macro_rules! out {
    ($($arg:tt)*) => {
        crate::print_line(&format!($($arg)*))?
    };
}

fn read_key_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("reading the key file {}", path.display()))
}

fn log_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The log directory: given on the command line, or the broker's default one (from
/// AQUEDUCT_AAL_FILE_PATH or AQUEDUCT_HOME, as the broker finds it).
#[derive(Debug)]
pub struct LogDir {
    pub path: std::path::PathBuf,
    pub given: bool,
}

/// The log directory exists, is a directory and holds a segment; otherwise an error saying
/// which, and, for the default one, how to name another. (A directory without segments is no
/// log: `verify` said "ok" of it, and `rekey` that the previous key was no longer needed.)
fn check_log_dir(dir: &LogDir) -> Result<()> {
    let path = dir.path.display();
    let problem = match std::fs::metadata(&dir.path) {
        Ok(m) if m.is_dir() => {
            let has_segment = std::fs::read_dir(&dir.path)
                .with_context(|| format!("reading {path}"))?
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".seg"));
            if has_segment {
                return Ok(());
            }
            "holds no log segment (*.seg): it is not a durable log's directory".to_owned()
        }
        Ok(_) => "is not a directory".to_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        Err(e) => format!("cannot be read: {e}"),
    };
    if dir.given {
        bail!("the log directory {path} {problem}");
    }
    bail!(
        "{path} {problem}: with no directory given, `aqueduct log` reads the broker's \
         (aal.file_path: AQUEDUCT_AAL_FILE_PATH, else $AQUEDUCT_HOME/aal or ~/.aqueduct/aal); give \
         the log's directory, or set AQUEDUCT_AAL_FILE_PATH as the broker has it"
    )
}

/// Check every record of the log in `dir`; an error (exit code 1) if anything is damaged or
/// cannot be read.
pub fn verify(dir: &LogDir, keys: &LogKeys) -> Result<()> {
    let keys = keys.load()?;
    check_log_dir(dir)?;
    let dir = dir.path.as_path();
    let bar = progress_bar(log_size(dir));
    let report = aqueduct_log::verify(dir, &keys, &mut |done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let unreadable = match report.failures.len() {
        0 => String::new(),
        n => format!(" ({n} of them unreadable, below)"),
    };
    out!(
        "{}: {} segment(s){unreadable}, {} batch(es), {} topic(s), {} bytes",
        dir.display(),
        report.segments,
        report.batches,
        report.topics,
        report.bytes
    );
    if report.torn_tail > 0 {
        out!(
            "torn tail: {} byte(s) at the end of the last segment (a crash cut a write short; \
             the broker cuts them at its next start)",
            report.torn_tail
        );
    }
    for (path, pos, len) in &report.damage {
        out!("damaged: {} bytes {pos}..{}", path.display(), pos + len);
    }
    for line in failure_lines(&report.failures) {
        out!("{line}");
    }
    if report.deleted_meanwhile > 0 {
        out!(
            "{} older segment(s) were deleted while this ran (the broker's retention): not checked",
            report.deleted_meanwhile
        );
    }
    print_previous_keys(&report.previous_key_segments)?;
    if report.is_ok() {
        out!("ok");
        Ok(())
    } else {
        bail!(
            "{} damaged range(s), {} segment(s) unreadable",
            report.damage.len(),
            report.failures.len()
        )
    }
}

/// `verify`'s lines for segments it could not read. Each reason names the file first; one
/// explained already (every segment under a wrong key, say) is not explained again.
fn failure_lines(failures: &[(std::path::PathBuf, String)]) -> Vec<String> {
    let mut said: Option<&str> = None;
    let mut lines = Vec::with_capacity(failures.len());
    for (path, why) in failures {
        let prefix = format!("{}: ", path.display());
        let reason = why.strip_prefix(prefix.as_str());
        if reason.is_some() && reason == said {
            lines.push(format!("failed: {}: the same as above", path.display()));
        } else {
            lines.push(format!("failed: {why}"));
            said = reason;
        }
    }
    lines
}

/// A progress bar for work over `total` bytes, on a terminal and for logs large enough to be
/// worth one.
fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    (total >= PROGRESS_FROM_BYTES && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(
        || {
            let bar = indicatif::ProgressBar::new(total);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            ) {
                bar.set_style(style);
            }
            bar
        },
    )
}

/// Per previous key given, how many segments it seals.
fn print_previous_keys(segments_per_key: &[usize]) -> Result<()> {
    for (i, segments) in segments_per_key.iter().enumerate() {
        let which = format!("previous key {} of {}", i + 1, segments_per_key.len());
        match segments {
            0 => out!("{which}: seals no segment (no longer needed)"),
            n => out!("{which}: seals {n} segment(s)"),
        };
    }
    Ok(())
}

/// Re-seal the segments sealed with a previous key under the current one (the log must not be
/// in use); an error (exit code 1) if a segment had to be left under its old key.
pub fn rekey(dir: &LogDir, keys: &LogKeys) -> Result<()> {
    let keys = keys.load()?;
    if keys.len() < 2 {
        bail!(
            "give the current key (--key-file or AQUEDUCT_AAL_KEY) and the previous one(s) to \
             replace (--previous-key-file or AQUEDUCT_AAL_PREVIOUS_KEYS)"
        );
    }
    check_log_dir(dir)?;
    let dir = dir.path.as_path();
    let mut bar = None;
    let report = aqueduct_log::rekey(dir, &keys, &mut |done, total| {
        let b = bar.get_or_insert_with(|| progress_bar(total));
        if let Some(b) = b {
            b.set_position(done);
        }
    })
    .map_err(|e| match e {
        aqueduct_log::LogError::Locked { .. } => {
            anyhow!("{e}: a broker is using the log; stop it, then run rekey again")
        }
        e => e.into(),
    })?;
    if let Some(Some(b)) = bar {
        b.finish_and_clear();
    }
    out!(
        "{}: re-sealed {} segment(s), {} bytes, under the current key",
        dir.display(),
        report.rekeyed,
        report.bytes
    );
    for (path, why) in &report.skipped {
        out!("left under its previous key: {}: {why}", path.display());
    }
    print_previous_keys(&report.previous_key_segments)?;
    if report.skipped.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} segment(s) left under a previous key: keep that key in aal.previous_keys",
            report.skipped.len()
        )
    }
}

/// Print the messages of `topic` from offset `from`: one line each, `offset`, `priority`,
/// `time` (ms since the epoch) and the body (as text, with non-UTF-8 bytes replaced). Without a
/// topic, list the log's topics.
pub fn dump(
    dir: &LogDir,
    topic: Option<&str>,
    from: u64,
    limit: Option<u64>,
    keys: &LogKeys,
) -> Result<()> {
    // A reader that stopped early (`| head`) is no failure.
    match dump_to_stdout(dir, topic, from, limit, keys) {
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn dump_to_stdout(
    dir: &LogDir,
    topic: Option<&str>,
    from: u64,
    limit: Option<u64>,
    keys: &LogKeys,
) -> Result<()> {
    let keys = keys.load()?;
    check_log_dir(dir)?;
    let view = LogView::open(&dir.path, &keys)?;
    // Said first, on standard error, and the command fails at its end: what follows lacks them.
    for path in &view.skipped {
        eprintln!(
            "aqueduct: {}: unreadable (a damaged header), left out of what follows; `aqueduct log verify` says more",
            path.display()
        );
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let Some(topic) = topic else {
        // Escaped as bodies are: a topic name may hold a newline or a terminal's escapes.
        for t in view.topics() {
            writeln!(out, "{}", String::from_utf8_lossy(&t).escape_debug())?;
        }
        out.flush()?;
        note_deleted(view.deleted_meanwhile);
        return skipped_is_failure(&view);
    };
    let mut deleted = view.deleted_meanwhile;
    // Gone since the view was opened (retention): counted, and the reader goes on with the
    // next segment; `--limit` counts messages only.
    let records = view.read(topic.as_bytes(), from).filter(|r| match r {
        Err(e) if e.is_not_found() => {
            deleted += 1;
            false
        }
        _ => true,
    });
    for r in records.take(limit.map_or(usize::MAX, |l| l.min(usize::MAX as u64) as usize)) {
        let r = r?;
        match StoredMessage::decode(&r.data) {
            Some(m) => writeln!(out, "{}", dump_line(r.offset, r.timestamp_ms, &m))?,
            None => writeln!(
                out,
                "{}\t?\t{}\t<not a stored message>",
                r.offset, r.timestamp_ms
            )?,
        }
    }
    out.flush()?;
    note_deleted(deleted);
    skipped_is_failure(&view)
}

/// Said on standard error, not a failure: segments the broker's retention deleted while the
/// dump ran (as `verify` says them).
fn note_deleted(n: usize) {
    if n > 0 {
        eprintln!(
            "aqueduct: {n} older segment(s) were deleted while this ran (the broker's retention): their messages are not shown"
        );
    }
}

/// A dump that left unreadable segments out is no success (exit code 1).
fn skipped_is_failure(view: &LogView) -> Result<()> {
    match view.skipped.len() {
        0 => Ok(()),
        n => bail!("{n} unreadable segment(s) left out (named above)"),
    }
}

/// One message as `log dump` prints it: offset, priority, time (ms since the epoch) and body,
/// tab-separated; a dead letter has a fifth column saying where it came from.
fn dump_line(offset: u64, timestamp_ms: u64, m: &StoredMessage) -> String {
    let mut line = format!(
        "{offset}\t{}\t{timestamp_ms}\t{}",
        m.priority.level(),
        String::from_utf8_lossy(&m.body).escape_debug()
    );
    if let Some(d) = &m.dead_letter {
        let reason = d.reason.escape_debug().to_string();
        let topic = d.original_topic.as_str().escape_debug().to_string();
        let origin = crate::dead_letter_origin(
            &topic,
            Some(d.original_offset),
            Some(d.attempts_made),
            Some(reason.as_str()).filter(|r| !r.is_empty()),
        );
        line.push('\t');
        line.push_str(&origin);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use aqueduct_proto::{Priority, TopicName};
    use aqueduct_server::durable::StoredDeadLetter;

    /// Every segment under a wrong key failed with one long explanation, printed once per
    /// segment: it is printed once, and a different reason in full again.
    #[test]
    fn a_reason_repeated_for_several_segments_is_explained_once() {
        let failure = |name: &str, why: &str| {
            let path = std::path::PathBuf::from(format!("aal/{name}.seg"));
            let text = format!("{}: {why}", path.display());
            (path, text)
        };
        let lines = failure_lines(&[
            failure("1", "sealed with none of the keys"),
            failure("2", "sealed with none of the keys"),
            failure("3", "a damaged header"),
            failure("4", "a damaged header"),
        ]);
        assert_eq!(
            lines,
            [
                "failed: aal/1.seg: sealed with none of the keys",
                "failed: aal/2.seg: the same as above",
                "failed: aal/3.seg: a damaged header",
                "failed: aal/4.seg: the same as above",
            ]
        );
    }

    #[test]
    fn a_dead_letter_is_dumped_with_its_origin() {
        let mut m = StoredMessage {
            priority: Priority::new(2).expect("valid"),
            ttl_ms: None,
            trace: None,
            compression: None,
            dead_letter: None,
            body: b"poison".to_vec(),
        };
        assert_eq!(dump_line(0, 17, &m), "0\t2\t17\tpoison");
        m.dead_letter = Some(StoredDeadLetter {
            original_topic: TopicName::try_from("jobs").expect("valid"),
            original_offset: 10,
            attempts_made: 4,
            reason: "nacked".into(),
        });
        assert_eq!(
            dump_line(0, 17, &m),
            "0\t2\t17\tpoison\tdead letter of jobs #10 after 4 attempts: nacked"
        );
    }

    /// A directory with no segment is not taken for a log: `verify` said "ok" of one, and
    /// `rekey` that the previous key was no longer needed.
    #[test]
    fn a_directory_without_segments_is_no_log() {
        let dir = tempfile::tempdir().expect("dir");
        let log = LogDir {
            path: dir.path().to_path_buf(),
            given: true,
        };
        let e = check_log_dir(&log).expect_err("empty").to_string();
        assert!(e.contains("holds no log segment"), "{e}");
        std::fs::write(dir.path().join("00000000000000000001.seg"), b"").expect("write");
        check_log_dir(&log).expect("a segment");
    }
}
