//! A write that fails (the disk is full) refuses that append and damages nothing written before.
//!
//! The failure is real, not simulated: the test runs itself again under `ulimit -f` (the
//! kernel then fails writes past 1 MiB with EFBIG, as it would with ENOSPC on a full disk), with
//! SIGXFSZ ignored so the write returns an error instead of killing the process.

use std::process::Command;

use aqueduct_log::{Entry, Log, LogOptions};

const CHILD: &str = "AQUEDUCT_LOG_IO_ERROR_CHILD";

#[test]
fn a_full_disk_refuses_the_append_and_keeps_what_was_written() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new("sh")
        .arg("-c")
        // 2048 blocks of 512 bytes: files may grow to 1 MiB.
        .arg("trap '' XFSZ; ulimit -f 2048 && exec \"$0\" --exact a_full_disk_refuses_the_append_and_keeps_what_was_written --nocapture --test-threads 1")
        .arg(exe)
        .env(CHILD, "1")
        .output()
        .expect("run sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("child: all checks passed"),
        "child failed: {}\n{stdout}\n{stderr}",
        out.status
    );
}

fn child() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let (mut log, _) = Log::open(tmp.path(), LogOptions::default()).expect("open");
    let body = vec![0xA5u8; 16 * 1024];
    let mut acked = 0u64;
    let err = loop {
        let e = Entry {
            topic: b"t",
            offset: acked,
            data: &body,
        };
        match log.append(&[e], 0).and_then(|p| log.commit().map(|_| p)) {
            Ok(_) => acked += 1,
            Err(e) => break e,
        }
        assert!(acked < 1000, "the file size limit did not apply");
    };
    assert!(err.is_io(), "{err}");
    assert!(acked > 10, "only {acked} appends before the limit");
    println!("child: refused after {acked} appends: {err}");
    // The failed append left nothing: everything acknowledged reads back whole.
    let read: Vec<_> = log.read(b"t", 0).collect::<Result<_, _>>().expect("read");
    assert_eq!(read.len() as u64, acked);
    assert!(read.iter().all(|r| r.data == body));
    // The refused offset stays taken.
    let reuse = log.append(
        &[Entry {
            topic: b"t",
            offset: acked,
            data: b"small",
        }],
        0,
    );
    assert!(
        matches!(
            reuse,
            Err(aqueduct_log::LogError::OffsetNotIncreasing { .. })
        ),
        "{reuse:?}"
    );
    // A small append still fits and goes on after it; the refused offset is written as a mark
    // first, so no later run hands it out again.
    assert!(log.has_burned());
    log.append(
        &[Entry {
            topic: b"t",
            offset: acked + 1,
            data: b"small",
        }],
        0,
    )
    .expect("a small append after the failure");
    assert!(!log.has_burned());
    drop(log); // crash
    let (log, rec) = Log::open(tmp.path(), LogOptions::default()).expect("reopen");
    assert_eq!(
        rec.truncated_bytes, 0,
        "the failed write left no torn frame"
    );
    assert_eq!(log.read(b"t", 0).count() as u64, acked + 1);
    println!("child: all checks passed");
}
