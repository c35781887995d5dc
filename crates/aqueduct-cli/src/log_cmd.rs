//! `aqueduct log verify|dump`: the durable log, offline. Neither changes anything on disk, so
//! both may run next to a broker that is using the log.

use std::io::Write;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use aqueduct_log::{LogView, MasterKey};
use aqueduct_server::durable::StoredMessage;

/// Logs at least this large get a progress bar (on a terminal).
const PROGRESS_FROM_BYTES: u64 = 64 << 20;

/// The key from `--key-file` (a file holding the base64 key, as `aal.key` takes it), else from
/// `AQUEDUCT_AAL_KEY`; none for a plaintext log.
pub fn load_key(key_file: Option<&Path>) -> Result<Option<MasterKey>> {
    let text = match key_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the key file {}", path.display()))?,
        ),
        None => std::env::var("AQUEDUCT_AAL_KEY").ok(),
    };
    let Some(text) = text.filter(|t| !t.trim().is_empty()) else {
        return Ok(None);
    };
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|e| anyhow!("the key is not valid base64 ({e})"))?;
    MasterKey::from_bytes(&bytes)
        .map(Some)
        .ok_or_else(|| anyhow!("the key decodes to {} bytes; it must be 32", bytes.len()))
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

/// Check every record of the log in `dir`; an error (exit code 1) if anything is damaged or
/// cannot be read.
pub fn verify(dir: &Path, key_file: Option<&Path>) -> Result<()> {
    let key = load_key(key_file)?;
    if !dir.is_dir() {
        bail!("{} is not a directory (aal.file_path)", dir.display());
    }
    let total = log_size(dir);
    let bar = (total >= PROGRESS_FROM_BYTES
        && std::io::IsTerminal::is_terminal(&std::io::stderr()))
    .then(|| {
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style);
        }
        bar
    });
    let report = aqueduct_log::verify(dir, key.as_ref(), &mut |done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    println!(
        "{}: {} segment(s), {} batch(es), {} topic(s), {} bytes",
        dir.display(),
        report.segments,
        report.batches,
        report.topics,
        report.bytes
    );
    if report.torn_tail > 0 {
        println!(
            "torn tail: {} byte(s) at the end of the last segment (a crash cut a write short; \
             the broker cuts them at its next start)",
            report.torn_tail
        );
    }
    for (path, pos, len) in &report.damage {
        println!("damaged: {} bytes {pos}..{}", path.display(), pos + len);
    }
    for (_, why) in &report.failures {
        // The reason names the file.
        println!("failed: {why}");
    }
    if report.is_ok() {
        println!("ok");
        Ok(())
    } else {
        bail!(
            "{} damaged range(s), {} segment(s) unreadable",
            report.damage.len(),
            report.failures.len()
        )
    }
}

/// Print the messages of `topic` from offset `from`: one line each, `offset`, `priority`,
/// `time` (ms since the epoch) and the body (as text, with non-UTF-8 bytes replaced). Without a
/// topic, list the log's topics.
pub fn dump(
    dir: &Path,
    topic: Option<&str>,
    from: u64,
    limit: Option<u64>,
    key_file: Option<&Path>,
) -> Result<()> {
    let key = load_key(key_file)?;
    if !dir.is_dir() {
        bail!("{} is not a directory (aal.file_path)", dir.display());
    }
    let view = LogView::open(dir, key.as_ref())?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let Some(topic) = topic else {
        for t in view.topics() {
            writeln!(out, "{}", String::from_utf8_lossy(&t))?;
        }
        return Ok(out.flush()?);
    };
    let records = view.read(topic.as_bytes(), from);
    for r in records.take(limit.map_or(usize::MAX, |l| l.min(usize::MAX as u64) as usize)) {
        let r = r?;
        match StoredMessage::decode(&r.data) {
            Some(m) => writeln!(
                out,
                "{}\t{}\t{}\t{}",
                r.offset,
                m.priority.level(),
                r.timestamp_ms,
                String::from_utf8_lossy(&m.body).escape_debug()
            )?,
            None => writeln!(
                out,
                "{}\t?\t{}\t<not a stored message>",
                r.offset, r.timestamp_ms
            )?,
        }
    }
    out.flush()?;
    Ok(())
}
