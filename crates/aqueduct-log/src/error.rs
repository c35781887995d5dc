//! What can go wrong with the log, each with the context an operator needs.

use std::path::PathBuf;

/// A log error. Variants that stop the broker at startup name the file and say what to do.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Reading or writing a file failed (disk full, permissions, a failing disk).
    /// The cause is part of the message, and not also given as the error's `source()`: a
    /// printer of error chains (`{:#}` of anyhow) said it twice.
    #[error("{action} {}: {cause}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// An encrypted segment's key check matches none of the `keys` given (the current one and
    /// the previous ones): the wrong `aal.key`, or a rotated key missing from
    /// `aal.previous_keys`. Nothing was changed on disk.
    #[error(
        "{}: this segment was sealed with none of the {keys} key(s) given: the key is wrong \
         (the broker's aal.key or AQUEDUCT_AAL_KEY, `aqueduct log`'s --key-file), or the key \
         was changed and the one it had before is missing from aal.previous_keys \
         (AQUEDUCT_AAL_PREVIOUS_KEYS, `aqueduct log`'s --previous-key-file), or the file was \
         replaced; nothing was changed on disk",
        path.display()
    )]
    WrongKey { path: PathBuf, keys: usize },
    /// `rekey` was given a current key that the log's newest segment is not sealed with: the
    /// keys are swapped, or the broker has not run with the new key yet. Nothing was changed.
    #[error(
        "{}, the log's newest segment, is not sealed with the key given as the current one: \
         rekey re-seals old segments under the key the broker uses now (aal.key). Check that \
         --key-file and --previous-key-file are not swapped, or start the broker once with \
         the new aal.key and the old one in aal.previous_keys (it begins a segment sealed \
         with the new key); nothing was changed on disk",
        path.display()
    )]
    NotCurrentKey { path: PathBuf },
    /// A record's checksum is right but its authentication tag is not: the bytes were written
    /// whole, then changed (tampering), or sealed under another key. Never truncated.
    #[error(
        "{} at byte {position}: a record with a valid checksum fails authentication (tampered \
         with, or sealed with another key); refusing to go on, nothing was changed on disk",
        path.display()
    )]
    Tampered { path: PathBuf, position: u64 },
    /// Another process (a second broker) has the log directory open. Nothing was read or
    /// changed.
    #[error(
        "{} is in use by another process (another broker running with the same aal.file_path?); \
         the log was not opened, nothing was changed on disk",
        path.display()
    )]
    Locked { path: PathBuf },
    /// Encrypted segments exist but no key was given.
    #[error(
        "{} is encrypted but no key was given (the broker: set aal.key or AQUEDUCT_AAL_KEY; \
         `aqueduct log`: pass --key-file FILE)",
        path.display()
    )]
    KeyRequired { path: PathBuf },
    /// A file in the log directory is not what its name says (bad magic or header checksum).
    #[error("{}: {reason}", path.display())]
    BadFile { path: PathBuf, reason: String },
    /// An append that would re-use or go back on a topic's offsets.
    #[error(
        "offset {offset} of topic {topic:?} is not above the topic's last offset {last}: offsets \
         are never re-used"
    )]
    OffsetNotIncreasing {
        topic: String,
        offset: u64,
        last: u64,
    },
    /// An append the log cannot take (empty, a topic name too long, a batch too large).
    #[error("invalid append: {0}")]
    InvalidAppend(String),
    /// An earlier `fsync` failed: what the operating system holds for the log can no longer be
    /// trusted to reach the disk, so the log takes no more appends until it is reopened.
    #[error("the log stopped taking appends after a failed fsync ({0}); restart the broker")]
    Poisoned(String),
    /// A batch a reader needed could not be read back (damaged since it was indexed).
    #[error("{} at byte {position}: {reason}", path.display())]
    Damaged {
        path: PathBuf,
        position: u64,
        reason: String,
    },
}

impl LogError {
    /// An I/O error saying a file was not there (a segment retention deleted meanwhile).
    pub fn is_not_found(&self) -> bool {
        matches!(self, LogError::Io { cause, .. } if cause.kind() == std::io::ErrorKind::NotFound)
    }

    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        cause: std::io::Error,
    ) -> Self {
        LogError::Io {
            action,
            path: path.into(),
            cause,
        }
    }

    /// True for errors that come from the disk or the operating system (full disk, failing
    /// writes), as opposed to bad input or bad data.
    pub fn is_io(&self) -> bool {
        matches!(self, LogError::Io { .. } | LogError::Poisoned(_))
    }
}

#[cfg(test)]
mod tests {
    use super::LogError;

    /// An I/O error's cause is said once by a printer of error chains (as the CLI prints with
    /// anyhow's `{:#}`: the message, then each `source()`). It was said twice.
    #[test]
    fn an_io_error_says_its_cause_once() {
        let e = LogError::io(
            "reading segment",
            "00000000000000000001.seg",
            std::io::Error::other("the disk is failing"),
        );
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain.push_str(&format!(": {s}"));
            source = s.source();
        }
        assert_eq!(
            chain,
            "reading segment 00000000000000000001.seg: the disk is failing"
        );
    }
}
