//! The durable log with the real broker binary: `kill -9` at random moments while publishers
//! confirm at full speed, torn tails cut at random points, and a full disk.
//!
//! What must hold: every confirmed message is in the log exactly once, in offset order, with its
//! bytes; each topic's offsets only go up, across every crash and restart; a write the disk
//! refuses gets STORAGE_FAILED while subscribers go on receiving.
//!
//! The random moments come from a seed printed at the start (set AQUEDUCT_TEST_SEED to replay).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aqueduct_client::{Client, ClientError, ConnectOptions, ErrorCode, PublishOptions};
use aqueduct_log::{LogView, MasterKey};
use aqueduct_server::durable::StoredMessage;
use bytes::Bytes;
use common::*;
use futures_util::StreamExt;

const KEY_B64: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const TOPICS: [&str; 3] = ["orders", "sensors/a", "sensors/b"];

fn key() -> MasterKey {
    MasterKey::from_bytes(&(0u8..32).collect::<Vec<u8>>()).expect("32 bytes")
}

fn env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("AQUEDUCT_AAL_ENABLED", "true"),
        ("AQUEDUCT_AAL_KEY", KEY_B64),
    ]
}

/// A small xorshift generator: the test's randomness, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn from_env() -> Rng {
        let seed = std::env::var("AQUEDUCT_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
                    | 1
            });
        println!("AQUEDUCT_TEST_SEED={seed}");
        Rng(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn confirm() -> PublishOptions {
    PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    }
}

async fn connect(home: &Path, addr: &str) -> Client {
    let opts = ConnectOptions::new(addr).dev_cert_file(home.join("dev-cert.pem"));
    tokio::time::timeout(WAIT, Client::connect(opts))
        .await
        .expect("connect in time")
        .expect("client connects")
}

/// Confirmed messages: topic → offset → body.
type Confirmed = BTreeMap<String, BTreeMap<u64, Vec<u8>>>;

/// Everything the log holds, checked: per topic, offsets strictly increasing (each message
/// once, in order); returns topic → offset → body.
fn read_log(dir: &Path) -> Confirmed {
    let view = LogView::open(dir, &[key()]).expect("the log opens");
    let mut all = Confirmed::new();
    for t in TOPICS {
        let mut last = None;
        let topic = all.entry(t.to_string()).or_default();
        for r in view.read(t.as_bytes(), 0) {
            let r = r.expect("every record reads back");
            assert!(
                last.is_none_or(|l| r.offset > l),
                "{t}: offset {} after {last:?}",
                r.offset
            );
            last = Some(r.offset);
            let m = StoredMessage::decode(&r.data).expect("a stored message");
            topic.insert(r.offset, m.body);
        }
    }
    all
}

fn assert_contains(log: &Confirmed, confirmed: &Confirmed) {
    for (topic, msgs) in confirmed {
        for (offset, body) in msgs {
            assert_eq!(
                log.get(topic).and_then(|m| m.get(offset)),
                Some(body),
                "confirmed {topic}@{offset} is not in the log as confirmed"
            );
        }
    }
}

fn assert_no_body_twice(log: &Confirmed) {
    let mut seen = HashSet::new();
    for msgs in log.values() {
        for body in msgs.values() {
            assert!(
                seen.insert(body.clone()),
                "stored twice: {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }
}

/// Publish confirmed batches from `tasks` publishers until the broker goes away; records what
/// was confirmed.
async fn publish_until_gone(
    client: &Client,
    round: u32,
    tasks: u32,
    confirmed: Arc<Mutex<Confirmed>>,
    progress: Arc<tokio::sync::Notify>,
) {
    let mut handles = Vec::new();
    for task in 0..tasks {
        let client = client.clone();
        let confirmed = confirmed.clone();
        let progress = progress.clone();
        handles.push(tokio::spawn(async move {
            let topic = TOPICS[task as usize % TOPICS.len()];
            for seq in 0u64.. {
                let bodies: Vec<Bytes> = (0..20)
                    .map(|i| Bytes::from(format!("r{round}-p{task}-{seq}-{i}")))
                    .collect();
                let items = bodies.iter().map(|b| (topic, b.clone()));
                match client.publish_batch(items, &confirm()).await {
                    Ok(Some(offsets)) => {
                        let mut c = confirmed.lock().expect("lock");
                        let t = c.entry(topic.to_string()).or_default();
                        for (o, b) in offsets.into_iter().zip(bodies) {
                            assert!(
                                t.insert(o, b.to_vec()).is_none(),
                                "{topic}@{o} confirmed twice"
                            );
                        }
                        drop(c);
                        progress.notify_one();
                    }
                    Ok(None) => panic!("no offsets for a confirmed batch"),
                    Err(_) => return,
                }
            }
        }));
    }
    for h in handles {
        h.await.expect("publisher task");
    }
}

#[test]
fn confirmed_messages_survive_kill_9_and_offsets_are_never_reused() {
    let home = tempfile::tempdir().expect("dir");
    let dir = home.path().join("aal");
    let env = env();
    let mut rng = Rng::from_env();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut confirmed_total = Confirmed::new();
    let mut high_before: BTreeMap<String, u64> = BTreeMap::new();
    for round in 0..10u32 {
        let (mut broker, addr, _metrics, _logs) = start_broker_with(home.path(), &env);
        let confirmed = Arc::new(Mutex::new(Confirmed::new()));
        let progress = Arc::new(tokio::sync::Notify::new());
        rt.block_on(async {
            let client = connect(home.path(), &addr).await;
            let publishing = tokio::spawn({
                let client = client.clone();
                let confirmed = confirmed.clone();
                let progress = progress.clone();
                async move { publish_until_gone(&client, round, 4, confirmed, progress).await }
            });
            // Some confirmed first (waiting on the publishers' signal), then a random moment.
            loop {
                let more = progress.notified();
                tokio::pin!(more);
                more.as_mut().enable();
                if confirmed
                    .lock()
                    .expect("lock")
                    .values()
                    .map(|m| m.len())
                    .sum::<usize>()
                    >= 20
                {
                    break;
                }
                tokio::time::timeout(WAIT, more)
                    .await
                    .expect("something confirmed in time");
            }
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
            broker.kill().expect("kill -9");
            let _ = broker.wait();
            // Publishers waiting for CONFIRMs from the dead broker would only learn of its death
            // at the idle timeout; what was confirmed is recorded already.
            publishing.abort();
            let _ = publishing.await;
        });
        let confirmed = std::mem::take(&mut *confirmed.lock().expect("lock"));
        // New offsets are above everything logged before this run.
        for (topic, msgs) in &confirmed {
            if let (Some(first), Some(high)) = (msgs.keys().next(), high_before.get(topic)) {
                assert!(
                    first > high,
                    "{topic}: offset {first} re-used (log had up to {high})"
                );
            }
        }
        for (topic, msgs) in confirmed {
            confirmed_total.entry(topic).or_default().extend(msgs);
        }
        let log = read_log(&dir);
        assert_contains(&log, &confirmed_total);
        assert_no_body_twice(&log);
        for (topic, msgs) in &log {
            if let Some((&high, _)) = msgs.last_key_value() {
                high_before.insert(topic.clone(), high);
            }
        }
        println!(
            "round {round}: {} confirmed so far, {} in the log",
            confirmed_total.values().map(|m| m.len()).sum::<usize>(),
            log.values().map(|m| m.len()).sum::<usize>()
        );
    }

    // A durable subscriber from `earliest` gets everything the log holds — every confirmed
    // message among it — exactly once, in offset order per topic, with the right bytes.
    let logged = read_log(&dir);
    let total: usize = logged.values().map(|m| m.len()).sum();
    let (broker, addr, _metrics, _logs) = start_broker_with(home.path(), &env);
    let got = rt.block_on(async {
        let client = connect(home.path(), &addr).await;
        let opts = aqueduct_client::SubscribeOptions {
            durable: Some(("checker".into(), aqueduct_client::DurableStart::Earliest)),
            ..aqueduct_client::SubscribeOptions::default()
        };
        let mut sub = client
            .subscribe_with("#", &opts)
            .await
            .expect("durable subscribe");
        let mut got = Confirmed::new();
        for _ in 0..total {
            let m = tokio::time::timeout(WAIT, sub.next())
                .await
                .expect("a message in time")
                .expect("open")
                .expect("a message");
            let t = got.entry(m.topic().as_str().to_string()).or_default();
            if let Some((&last, _)) = t.last_key_value() {
                assert!(
                    m.offset() > last,
                    "{}: {} after {last}",
                    m.topic(),
                    m.offset()
                );
            }
            assert!(
                t.insert(m.offset(), m.body().to_vec()).is_none(),
                "delivered twice"
            );
        }
        client
            .close()
            .await
            .expect("close: everything published was taken");
        got
    });
    stop(broker);
    assert_eq!(
        got, logged,
        "the durable subscriber got exactly what the log holds"
    );
    assert_contains(&got, &confirmed_total);

    // Torn tails: cut the last segment at random points; the broker recovers, everything
    // before the cut is intact, and offsets go on above what is left.
    let before = read_log(&dir);
    let last = last_segment(&dir);
    let len = std::fs::metadata(&last).expect("segment").len();
    for _ in 0..3 {
        let copy = tempfile::tempdir().expect("dir");
        let copy_dir = copy.path().join("aal");
        copy_dir_all(&dir, &copy_dir);
        let cut = 96 + rng.below(len.saturating_sub(96).max(1));
        let seg = copy_dir.join(last.file_name().expect("name"));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .and_then(|f| f.set_len(cut))
            .expect("truncate");
        let _ = std::fs::remove_file(seg.with_extension("idx"));
        let (broker, addr, _metrics, _logs) = start_broker_with(copy.path(), &env);
        let offset = rt.block_on(async {
            let client = connect(copy.path(), &addr).await;
            let o = client
                .publish_with("orders", "after the cut", &confirm())
                .await
                .expect("publish after recovery");
            client
                .close()
                .await
                .expect("close: everything published was taken");
            o.expect("an offset")
        });
        stop(broker);
        println!("cut the last segment at byte {cut} of {len}");
        let after = read_log(&copy_dir);
        for (topic, msgs) in &after {
            for (o, body) in msgs {
                if topic == "orders" && *o == offset {
                    assert_eq!(body, b"after the cut");
                } else {
                    assert_eq!(before[topic].get(o), Some(body), "{topic}@{o} changed");
                }
            }
        }
        let high = before["orders"].keys().last().copied().unwrap_or(0);
        assert!(
            offset > high,
            "offset {offset} re-used after a torn tail (had {high})"
        );
    }
}

fn last_segment(dir: &Path) -> PathBuf {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("log dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .filter(|p| std::fs::metadata(p).map(|m| m.len() > 96).unwrap_or(false))
        .collect();
    segs.sort();
    segs.pop().expect("a segment with data")
}

fn copy_dir_all(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read dir") {
        let p = e.expect("entry").path();
        std::fs::copy(&p, to.join(p.file_name().expect("name"))).expect("copy");
    }
}

/// A disk that refuses writes (the broker runs under `ulimit -f`: files may not grow past
/// 2 MiB, and writes past that fail with EFBIG as they would with ENOSPC): confirmed publishes
/// get STORAGE_FAILED, subscribers keep receiving, the metric counts it, and what was confirmed
/// before is intact after a restart without the limit.
#[test]
fn a_full_disk_answers_storage_failed_and_subscribers_go_on() {
    let home = tempfile::tempdir().expect("dir");
    let env = env();
    let (broker, addr, metrics, _logs) = start_broker_process(on_a_small_disk(), home.path(), &env);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut confirmed = Confirmed::new();
    rt.block_on(async {
        let client = connect(home.path(), &addr).await;
        let mut live = client.subscribe("big").await.expect("subscribe");
        let body = Bytes::from(vec![b'x'; 32 * 1024]);
        let mut refused = None;
        for i in 0..400u64 {
            match client.publish_with("big", body.clone(), &confirm()).await {
                Ok(Some(o)) => {
                    confirmed
                        .entry("big".into())
                        .or_default()
                        .insert(o, body.to_vec());
                }
                Ok(None) => panic!("no offset"),
                Err(ClientError::Broker { code, reason }) => {
                    assert_eq!(code, ErrorCode::STORAGE_FAILED, "{reason}");
                    assert!(
                        reason.contains("File too large") || reason.contains("space"),
                        "{reason}"
                    );
                    refused = Some(i);
                    break;
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
        let refused = refused.expect("the 2 MiB limit refused a write");
        assert!(refused > 5, "refused after only {refused} messages");
        // Live delivery goes on: the subscriber got every message, the refused one too (it was
        // routed before the log refused it).
        for _ in 0..=refused {
            let _ = tokio::time::timeout(WAIT, live.next())
                .await
                .expect("delivery")
                .expect("a message");
        }
        // While the log cannot write, a publish is refused before it is routed (no offset is
        // handed out that the log could not record); in between, the writer tries the marks it
        // owes, which fit, so every other big message is routed and then refused by the disk.
        // Either way every one gets STORAGE_FAILED, and a message that still fits is stored.
        for _ in 0..4 {
            match client.publish_with("big", body.clone(), &confirm()).await {
                Err(ClientError::Broker { code, .. }) => {
                    assert_eq!(code, ErrorCode::STORAGE_FAILED)
                }
                other => panic!("expected STORAGE_FAILED, got {other:?}"),
            }
        }
        let mut small_ok = false;
        for _ in 0..4 {
            match client.publish_with("big", "small", &confirm()).await {
                Ok(Some(o)) => {
                    confirmed
                        .entry("big".into())
                        .or_default()
                        .insert(o, b"small".to_vec());
                    small_ok = true;
                    break;
                }
                Err(ClientError::Broker { code, reason }) => {
                    assert_eq!(code, ErrorCode::STORAGE_FAILED, "{reason}");
                    assert!(
                        reason.contains("nothing of this frame was published"),
                        "{reason}"
                    );
                }
                other => panic!("unexpected: {other:?}"),
            }
        }
        assert!(small_ok, "a message that fits is stored again");
        let errors = log_write_errors(&metrics);
        assert!(errors >= 1.0, "{errors}");
        client
            .close()
            .await
            .expect("close: everything published was taken");
    });
    stop(broker);
    // Without the limit: everything confirmed is there.
    let (broker, _addr, _metrics, _logs) = start_broker_with(home.path(), &env);
    stop(broker);
    let view = LogView::open(&home.path().join("aal"), &[key()]).expect("opens");
    let logged: BTreeMap<u64, Vec<u8>> = view
        .read(b"big", 0)
        .map(|r| {
            let r = r.expect("readable");
            (
                r.offset,
                StoredMessage::decode(&r.data).expect("stored").body,
            )
        })
        .collect();
    for (o, body) in &confirmed["big"] {
        assert_eq!(logged.get(o), Some(body), "confirmed big@{o} lost");
    }
}

/// The broker on a disk that refuses writes: it runs under `ulimit -f`, so files may not grow
/// past 2 MiB and writes past that fail with EFBIG, as they would with ENOSPC.
fn on_a_small_disk() -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("trap '' XFSZ; ulimit -f 4096 && exec \"$0\" --addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \"$@\"")
        .arg(BROKER);
    cmd
}

/// `aqueduct_log_write_errors_total` of the broker whose metrics are at `metrics`.
fn log_write_errors(metrics: &str) -> f64 {
    metric(metrics, "aqueduct_log_write_errors_total").expect("the write error metric")
}

/// The next message of `sub`, which must be offset `job` (`what`: what the wait is for).
async fn the_job(
    sub: &mut aqueduct_client::Subscription,
    job: u64,
    what: &str,
) -> aqueduct_client::Message {
    let m = tokio::time::timeout(WAIT, sub.next())
        .await
        .expect(what)
        .expect("open")
        .expect("a message");
    assert_eq!(m.offset(), job);
    m
}

/// A message dead-lettered while the disk refuses writes: its dead letter is lost with the
/// failed write, so the durable consumer's saved position must not pass the message. After a
/// restart with room on the disk, the consumer gets it again (at least once). Before, the
/// position was saved past it — the message was settled by being dead-lettered — and it was
/// lost: neither its dead letter nor the consumer ever had it again.
#[test]
fn a_dead_letter_the_disk_refuses_leaves_its_message_to_be_delivered_again() {
    let home = tempfile::tempdir().expect("dir");
    let mut env = env();
    // The first NACK dead-letters.
    env.push(("AQUEDUCT_BROKER_MAX_RETRIES", "0"));
    let (broker, addr, metrics, _logs) = start_broker_process(on_a_small_disk(), home.path(), &env);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let opts = aqueduct_client::SubscribeOptions {
        durable: Some(("worker".into(), aqueduct_client::DurableStart::Earliest)),
        ack: true,
        ..aqueduct_client::SubscribeOptions::default()
    };
    let job = rt.block_on(async {
        let client = connect(home.path(), &addr).await;
        let mut sub = client
            .subscribe_with("jobs", &opts)
            .await
            .expect("durable subscribe");
        let body = Bytes::from(vec![b'j'; 32 * 1024]);
        let job = client
            .publish_with("jobs", body.clone(), &confirm())
            .await
            .expect("stored")
            .expect("its offset");
        let m = the_job(&mut sub, job, "the job in time").await;
        // Fill the disk: the dead letter (as large as the job) will not fit.
        let mut full = false;
        for _ in 0..400 {
            match client
                .publish_with("filler", body.clone(), &confirm())
                .await
            {
                Ok(_) => {}
                Err(ClientError::Broker { code, .. }) if code == ErrorCode::STORAGE_FAILED => {
                    full = true;
                    break;
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
        assert!(full, "the 2 MiB limit refused a write");
        let before = log_write_errors(&metrics);
        m.nack(Some("failed")).await.expect("nack");
        // The dead letter's write fails.
        let deadline = std::time::Instant::now() + WAIT;
        while log_write_errors(&metrics) <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the dead letter was written"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = client.close().await;
        job
    });
    // A clean stop: the last checkpoint saves the positions.
    stop(broker);
    let (broker, addr, _metrics, _logs) = start_broker_with(home.path(), &env);
    rt.block_on(async {
        let client = connect(home.path(), &addr).await;
        let mut sub = client
            .subscribe_with("jobs", &opts)
            .await
            .expect("durable subscribe");
        let m = the_job(&mut sub, job, "the job is delivered again").await;
        m.ack().await.expect("ack");
        client.close().await.expect("close");
    });
    stop(broker);
}

/// `aqueduct log dump` prints what a broker logged; `aqueduct log verify` says ok, then finds a
/// flipped byte (exit status 1); neither changes the log.
#[test]
fn log_verify_and_dump_work_offline() {
    let home = tempfile::tempdir().expect("dir");
    let env = env();
    let (broker, addr, _metrics, _logs) = start_broker_with(home.path(), &env);
    for body in ["one", "two", "three"] {
        assert_ok(&run_client(
            home.path(),
            &["--addr", &addr, "pub", "orders", body, "--confirm"],
        ));
    }
    stop(broker);
    let dir = home.path().join("aal");
    let key_file = home.path().join("aal.key");
    std::fs::write(&key_file, format!("{KEY_B64}\n")).expect("key file");
    let log = |args: &[&str]| {
        Command::new(CLIENT)
            .arg("log")
            .args(args)
            .env_remove("AQUEDUCT_AAL_KEY")
            .output()
            .expect("aqueduct log runs")
    };
    let d = dir.to_str().expect("utf-8 path");
    let k = key_file.to_str().expect("utf-8 path");
    let dump = log(&[
        "dump",
        d,
        "--key-file",
        k,
        "--topic",
        "orders",
        "--from",
        "1",
    ]);
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let text = String::from_utf8_lossy(&dump.stdout);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!((lines[0][0], lines[0][3]), ("1", "two"));
    assert_eq!((lines[1][0], lines[1][3]), ("2", "three"));
    let topics = log(&["dump", d, "--key-file", k]);
    assert_eq!(String::from_utf8_lossy(&topics.stdout).trim(), "orders");
    // Without the key: told how to give it.
    let keyless = log(&["verify", d]);
    assert!(!keyless.status.success());
    let out = String::from_utf8_lossy(&keyless.stdout);
    assert!(out.contains("pass --key-file FILE"), "{out}");
    // A previous key without a current one is a mistake, not a plaintext log.
    let no_current = log(&["verify", d, "--previous-key-file", k]);
    assert_eq!(no_current.status.code(), Some(1));
    let err = String::from_utf8_lossy(&no_current.stderr);
    assert!(err.contains("previous keys are given but no key"), "{err}");
    // Without a directory: the broker's default one, $AQUEDUCT_HOME/aal here (a blank
    // AQUEDUCT_AAL_FILE_PATH means the default, as for the broker).
    for file_path in [None, Some(" ")] {
        let mut cmd = Command::new(CLIENT);
        cmd.args(["log", "dump", "--key-file", k, "--topic", "orders"])
            .env("AQUEDUCT_HOME", home.path())
            .env_remove("AQUEDUCT_AAL_FILE_PATH");
        if let Some(p) = file_path {
            cmd.env("AQUEDUCT_AAL_FILE_PATH", p);
        }
        let default_dir = cmd.output().expect("aqueduct log runs");
        assert!(
            default_dir.status.success(),
            "{file_path:?}: {}",
            String::from_utf8_lossy(&default_dir.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&default_dir.stdout).lines().count(),
            3
        );
    }
    // A directory that does not exist is said to be missing; a file, not to be a directory.
    // The default one (no directory given) is named as the broker's, with how to give another.
    let missing = home.path().join("no-such-log");
    for (path, words) in [
        (missing.to_str().expect("utf-8"), "does not exist"),
        (k, "is not a directory"),
    ] {
        for command in ["verify", "dump"] {
            let o = log(&[command, path, "--key-file", k]);
            assert_eq!(o.status.code(), Some(1), "{command} {path}");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains(&format!("the log directory {path} {words}"))
                    && !err.contains("aal.file_path"),
                "{command} {path}: {err}"
            );
        }
        let o = Command::new(CLIENT)
            .args(["log", "verify", "--key-file", k])
            .env("AQUEDUCT_AAL_FILE_PATH", path)
            .output()
            .expect("aqueduct log runs");
        assert_eq!(o.status.code(), Some(1), "default {path}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(&format!(
                "{path} {words}: with no directory given, `aqueduct log` reads the broker's"
            )) && err.contains("AQUEDUCT_AAL_FILE_PATH"),
            "default {path}: {err}"
        );
    }
    let before: Vec<(PathBuf, Vec<u8>)> = snapshot(&dir);
    let ok = log(&["verify", d, "--key-file", k]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    assert!(String::from_utf8_lossy(&ok.stdout)
        .trim_end()
        .ends_with("ok"));
    let no_key = log(&["verify", d]);
    assert_eq!(no_key.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&no_key.stdout).contains("no key was given"));
    // Another key: said in the words of this tool too (--key-file), not only the broker's.
    let other_key = home.path().join("other.key");
    std::fs::write(&other_key, format!("{}=\n", "A".repeat(43))).expect("key file");
    let wrong = log(&[
        "verify",
        d,
        "--key-file",
        other_key.to_str().expect("utf-8"),
    ]);
    assert_eq!(wrong.status.code(), Some(1));
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&wrong.stdout),
        String::from_utf8_lossy(&wrong.stderr)
    );
    assert!(
        out.contains("sealed with none of the 1 key(s) given") && out.contains("--key-file"),
        "{out}"
    );
    // The summary does not read as an empty log (explained once however many segments: a
    // unit test of log_cmd.rs).
    assert!(
        out.contains("1 segment(s) (1 of them unreadable, below)"),
        "{out}"
    );
    assert_eq!(snapshot(&dir), before, "verify and dump change nothing");
    // Flip a byte inside the first batch of the segment holding the messages.
    let seg = last_segment(&dir);
    let mut bytes = std::fs::read(&seg).expect("segment");
    bytes[96 + 40] ^= 0x10;
    std::fs::write(&seg, &bytes).expect("write");
    let damaged = log(&["verify", d, "--key-file", k]);
    assert_eq!(damaged.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&damaged.stdout).contains("damaged: "),
        "{}",
        String::from_utf8_lossy(&damaged.stdout)
    );
}

fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| {
            let p = e.expect("entry").path();
            let b = std::fs::read(&p).expect("read");
            (p, b)
        })
        .collect();
    v.sort();
    v
}

/// A broker restarted with a new `aal.key` and the old one in `AQUEDUCT_AAL_PREVIOUS_KEYS`
/// reads what the old key sealed, seals what comes after with the new one, and counts the old
/// key's segments in `aqueduct_log_previous_key_segments`.
#[test]
fn a_rotated_key_reads_the_old_log_and_is_counted() {
    const NEW_KEY_B64: &str = "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
    let home = tempfile::tempdir().expect("dir");
    let publish = |addr: &str, body: &str| {
        assert_ok(&run_client(
            home.path(),
            &["--addr", addr, "pub", "orders", body, "--confirm"],
        ))
    };
    let (broker, addr, _metrics, _logs) = start_broker_with(home.path(), &env());
    publish(&addr, "before");
    stop(broker);
    let rotated = [
        ("AQUEDUCT_AAL_ENABLED", "true"),
        ("AQUEDUCT_AAL_KEY", NEW_KEY_B64),
        ("AQUEDUCT_AAL_PREVIOUS_KEYS", KEY_B64),
    ];
    let (broker, addr, metrics, _logs) = start_broker_with(home.path(), &rotated);
    assert_eq!(
        metric(&metrics, "aqueduct_log_previous_key_segments"),
        Some(1.0),
        "the first run's segment"
    );
    publish(&addr, "after");
    // Re-sealing needs the broker stopped, and says so.
    let (old_file, new_file) = (home.path().join("old.key"), home.path().join("new.key"));
    std::fs::write(&old_file, KEY_B64).expect("key file");
    std::fs::write(&new_file, NEW_KEY_B64).expect("key file");
    let dir = home.path().join("aal");
    let rekey = |dir: &Path| {
        Command::new(CLIENT)
            .arg("log")
            .arg("rekey")
            .arg(dir)
            .arg("--key-file")
            .arg(&new_file)
            .arg("--previous-key-file")
            .arg(&old_file)
            .output()
            .expect("aqueduct log runs")
    };
    let busy = rekey(&dir);
    assert_eq!(busy.status.code(), Some(1));
    let err = String::from_utf8_lossy(&busy.stderr);
    assert!(err.contains("stop it, then run rekey again"), "{err}");
    let out = run_client(
        home.path(),
        &[
            "--addr",
            &addr,
            "sub",
            "orders",
            "--durable",
            "r",
            "--count",
            "2",
        ],
    );
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("orders #0 p2: before") && text.contains("orders #1 p2: after"),
        "{text}"
    );
    stop(broker);
    // The new key alone cannot read the first run's segment; the old one alone, not the rest.
    let new_key = MasterKey::from_bytes(&(32u8..64).collect::<Vec<u8>>()).expect("32 bytes");
    assert!(LogView::open(&dir, std::slice::from_ref(&new_key)).is_err());
    assert!(LogView::open(&dir, &[key()]).is_err());
    assert!(LogView::open(&dir, &[new_key.clone(), key()]).is_ok());
    // Stopped, the log is re-sealed: the new key alone reads it.
    let done = rekey(&dir);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let text = String::from_utf8_lossy(&done.stdout);
    assert!(
        text.contains("seals no segment (no longer needed)"),
        "{text}"
    );
    let view = LogView::open(&dir, &[new_key]).expect("the new key alone opens the log");
    assert_eq!(view.read(b"orders", 0).count(), 2);
}
