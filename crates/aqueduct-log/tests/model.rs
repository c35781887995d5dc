//! The log against a simple in-memory model, over random appends, rotations (small
//! segments), retention, truncations, clean reopens and crashes.

use std::collections::BTreeMap;
use std::time::SystemTime;

use aqueduct_log::{Entry, FsyncMode, Log, LogOptions, MasterKey, Position};
use proptest::prelude::*;

const TOPICS: [&[u8]; 3] = [b"a", b"b/c", b"d"];
const GAP: u64 = 100;

#[derive(Debug, Clone)]
enum Op {
    /// (topic, size of each message) per message of one batch.
    Append(Vec<(usize, usize)>),
    Reopen,
    Crash,
    Retention(u64),
    /// Truncate after the n-th remembered append (modulo how many there are).
    Truncate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::collection::vec((0..TOPICS.len(), 0..300usize), 1..12).prop_map(Op::Append),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        1 => (0..3_000u64).prop_map(Op::Retention),
        1 => any::<usize>().prop_map(Op::Truncate),
    ]
}

/// What the log should hold.
#[derive(Debug, Clone, Default)]
struct Model {
    records: BTreeMap<Vec<u8>, Vec<(u64, Vec<u8>)>>,
    /// Per topic: highest offset taken, and the crash count when it was taken.
    high: BTreeMap<Vec<u8>, (u64, u64)>,
}

impl Model {
    fn next_offset(&self, topic: &[u8], crashes: u64) -> u64 {
        match self.high.get(topic) {
            Some(&(h, at)) => h + 1 + GAP * (crashes - at),
            None => GAP * crashes,
        }
    }
}

fn options(key: &Option<MasterKey>, segment: u64, retention: Option<u64>) -> LogOptions {
    LogOptions {
        key: key.clone(),
        max_segment_bytes: segment,
        retention_bytes: retention,
        fsync: FsyncMode::Never,
        crash_offset_gap: GAP,
        ..LogOptions::default()
    }
}

fn check(log: &Log, model: &Model, crashes: u64) -> Result<(), TestCaseError> {
    for t in TOPICS {
        let want = model.records.get(t).cloned().unwrap_or_default();
        let got: Vec<(u64, Vec<u8>)> = log
            .read(t, 0)
            .map(|r| r.map(|r| (r.offset, r.data)))
            .collect::<Result<_, _>>()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&got, &want, "topic {:?}", String::from_utf8_lossy(t));
        if let Some(&(mid, _)) = want.get(want.len() / 2) {
            let from_mid = log.read(t, mid).count();
            prop_assert_eq!(from_mid, want.len() - want.len() / 2);
        }
        prop_assert_eq!(log.next_offset(t), model.next_offset(t, crashes));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn log_matches_model(
        ops in prop::collection::vec(op(), 1..40),
        segment in 200u64..3_000,
        encrypted in any::<bool>(),
    ) {
        let tmp = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let key = encrypted.then(|| MasterKey::from_bytes(&[5; 32])).flatten();
        let open = |retention| Log::open(tmp.path(), options(&key, segment, retention))
            .map_err(|e| TestCaseError::fail(e.to_string()));
        let (mut log, _) = open(None)?;
        let mut model = Model::default();
        let mut crashes = 0u64;
        // (position after the append, model after it), for truncations.
        let mut marks: Vec<(Position, Model)> = Vec::new();
        let mut stamp = 0u64;
        for op in ops {
            match op {
                Op::Append(msgs) => {
                    let mut next: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
                    let mut owned = Vec::new();
                    for (t, size) in msgs {
                        let topic = TOPICS[t].to_vec();
                        let o = *next.entry(topic.clone()).or_insert_with(|| model.next_offset(&topic, crashes));
                        next.insert(topic.clone(), o + 1);
                        stamp += 1;
                        let data: Vec<u8> = (0..size).map(|i| (i as u64 + stamp) as u8).collect();
                        owned.push((topic, o, data));
                    }
                    let entries: Vec<Entry<'_>> = owned
                        .iter()
                        .map(|(t, o, d)| Entry { topic: t, offset: *o, data: d })
                        .collect();
                    let pos = log.append(&entries, 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    for (t, o, d) in owned {
                        model.records.entry(t.clone()).or_default().push((o, d));
                        model.high.insert(t, (o, crashes));
                    }
                    marks.push((pos, model.clone()));
                }
                Op::Reopen => {
                    log.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    log = open(None)?.0;
                }
                Op::Crash => {
                    drop(log);
                    crashes += 1;
                    log = open(None)?.0;
                }
                Op::Retention(bytes) => {
                    log.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let (mut l, _) = open(Some(bytes))?;
                    l.enforce_retention(SystemTime::now()).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(l.stats().bytes <= bytes + 200 || l.stats().segments == 1, "{:?}", l.stats());
                    // What is left of each topic is its newest messages; offsets stay.
                    for t in TOPICS {
                        let left = l.read(t, 0).count();
                        if let Some(v) = model.records.get_mut(t) {
                            prop_assert!(left <= v.len());
                            v.drain(..v.len() - left);
                        }
                    }
                    marks.clear();
                    log = l;
                }
                Op::Truncate(n) => {
                    if marks.is_empty() {
                        continue;
                    }
                    let i = n % marks.len();
                    let (pos, snapshot) = marks[i].clone();
                    log.truncate_after(pos).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    // Offsets fall back to what remains, with the crash count of then.
                    model = snapshot;
                    marks.truncate(i + 1);
                }
            }
            check(&log, &model, crashes)?;
        }
    }
}
