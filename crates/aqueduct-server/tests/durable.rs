//! The durable log end to end, in process: confirmed publishes are in the log, live delivery
//! goes on, offsets continue across a restart, a new topic starts at 0.

mod common;

use std::path::Path;

use aqueduct_client::{Priority, PublishOptions};
use aqueduct_log::{FsyncMode, Log, LogOptions, MasterKey};
use aqueduct_server::config::AalConfig;
use aqueduct_server::durable::StoredMessage;
use bytes::Bytes;
use common::*;

fn key() -> MasterKey {
    MasterKey::from_bytes(&[0x5A; 32]).expect("32 bytes")
}

fn aal(dir: &Path, fsync: FsyncMode) -> AalConfig {
    AalConfig {
        dir: dir.to_path_buf(),
        key: Some(key()),
        max_segment_bytes: 1 << 20,
        fsync,
        retention_bytes: None,
        retention_age: None,
    }
}

fn confirm() -> PublishOptions {
    PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    }
}

/// What the log holds for `topic`, read offline (and closed cleanly again).
fn logged(dir: &Path, topic: &str) -> Vec<(u64, StoredMessage)> {
    let (log, rec) = Log::open(
        dir,
        LogOptions {
            key: Some(key()),
            ..LogOptions::default()
        },
    )
    .expect("log opens");
    assert!(rec.clean, "the broker closed its log cleanly");
    let got = log
        .read(topic.as_bytes(), 0)
        .map(|r| {
            let r = r.expect("readable");
            (
                r.offset,
                StoredMessage::decode(&r.data).expect("a stored message"),
            )
        })
        .collect();
    log.close().expect("close");
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_publishes_are_logged_and_offsets_go_on_after_a_restart() {
    for fsync in [FsyncMode::Batch, FsyncMode::Always, FsyncMode::Never] {
        let dir = tempfile::tempdir().expect("temp dir");
        let b = TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), fsync))).await;
        let client = b.client().await;
        let mut live = client.subscribe("orders").await.expect("subscribe");
        for i in 0..10u64 {
            let opts = PublishOptions {
                priority: Priority::new((i % 4) as u8),
                ..confirm()
            };
            let offset = client
                .publish_with("orders", format!("single {i}"), &opts)
                .await
                .expect("publish");
            assert_eq!(offset, Some(i));
        }
        let batch = (0..20).map(|i| ("orders", Bytes::from(format!("batched {i}"))));
        let offsets = client
            .publish_batch(batch, &confirm())
            .await
            .expect("batch");
        assert_eq!(offsets, Some((10..30).collect::<Vec<u64>>()));
        // Live delivery is not held back by the log.
        for i in 0..30u64 {
            assert_eq!(next(&mut live).await.offset(), i);
        }
        // Not confirmed, still logged.
        client
            .publish("orders", "unconfirmed")
            .await
            .expect("publish");
        assert_eq!(next(&mut live).await.offset(), 30);
        drop(live);
        client.close().await;
        b.stop().await.expect("clean shutdown");

        let got = logged(dir.path(), "orders");
        assert_eq!(got.len(), 31, "{fsync:?}");
        for (i, (offset, m)) in got.iter().enumerate() {
            assert_eq!(*offset, i as u64);
            let want = match i {
                0..10 => format!("single {i}"),
                10..30 => format!("batched {}", i - 10),
                _ => "unconfirmed".into(),
            };
            assert_eq!(m.body, want.as_bytes());
            if i < 10 {
                assert_eq!(m.priority.level(), (i % 4) as u8);
            }
        }

        let b = TestBroker::start_with(|c| c.aal = Some(aal(dir.path(), fsync))).await;
        let client = b.client().await;
        let offset = client
            .publish_with("orders", "after restart", &confirm())
            .await
            .expect("publish");
        assert_eq!(offset, Some(31), "offsets go on after a restart");
        let fresh = client
            .publish_with("fresh", "first", &confirm())
            .await
            .expect("publish");
        assert_eq!(fresh, Some(0), "a topic the log never saw starts at 0");
        client.close().await;
        b.stop().await.expect("clean shutdown");
        assert_eq!(logged(dir.path(), "orders").len(), 32);
    }
}
