//! The log against a simple in-memory model, over random appends, rotations (small
//! segments), retention, truncations, clean reopens and crashes.

use std::collections::BTreeMap;
use std::time::SystemTime;

use aqueduct_log::{Entry, Forget, FsyncMode, Log, LogOptions, MasterKey, Position};
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
    /// Retention that chooses the emptied topics whose bit (by their place in `TOPICS`) is set
    /// in the first mask, and forgets those of them set in the second.
    RetentionForgetting(u64, u8, u8),
    /// Truncate after the n-th remembered append (modulo how many there are).
    Truncate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::collection::vec((0..TOPICS.len(), 0..300usize), 1..12).prop_map(Op::Append),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        1 => (0..3_000u64).prop_map(Op::Retention),
        1 => (0..3_000u64, any::<u8>(), any::<u8>()).prop_map(|(b, c, f)| Op::RetentionForgetting(b, c, f)),
        1 => any::<usize>().prop_map(Op::Truncate),
    ]
}

/// What the log should hold.
#[derive(Debug, Clone, Default)]
struct Model {
    records: BTreeMap<Vec<u8>, Vec<(u64, Vec<u8>)>>,
    /// Per topic: highest offset taken, and the crash count when it was taken.
    high: BTreeMap<Vec<u8>, (u64, u64)>,
    /// The offset floor, as a topic's high: where forgotten (and new) topics start.
    floor: Option<(u64, u64)>,
}

impl Model {
    fn next_offset(&self, topic: &[u8], crashes: u64) -> u64 {
        match self.high.get(topic) {
            Some(&(h, at)) => h + 1 + GAP * (crashes - at),
            None => self.new_topic_offset(crashes),
        }
    }

    fn new_topic_offset(&self, crashes: u64) -> u64 {
        let floor = self.floor.map_or(0, |(h, at)| h + 1 + GAP * (crashes - at));
        (GAP * crashes).max(floor)
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

/// Chooses the offered topics whose bit (by their place in `TOPICS`) is set in `mask`, and
/// forgets those of them set in `forget_mask` (and names the offered topics it did not choose,
/// which the log must keep); remembers what it was offered, chose and forgot, and the floors it
/// was told.
#[derive(Default)]
struct Forgetter {
    mask: u8,
    forget_mask: u8,
    offered: Vec<Vec<Vec<u8>>>,
    chosen: Vec<Vec<u8>>,
    not_chosen: Vec<Box<[u8]>>,
    forgotten: Vec<Vec<u8>>,
    floors: Vec<u64>,
}

fn in_mask(mask: u8, topic: &[u8]) -> bool {
    TOPICS
        .iter()
        .position(|x| *x == topic)
        .is_some_and(|i| mask & (1 << i) != 0)
}

impl Forget for Forgetter {
    fn choose(&mut self, emptied: &[Box<[u8]>]) -> Vec<Box<[u8]>> {
        self.offered
            .push(emptied.iter().map(|t| t.to_vec()).collect());
        let chosen: Vec<Box<[u8]>> = emptied
            .iter()
            .filter(|t| in_mask(self.mask, t))
            .cloned()
            .collect();
        self.chosen = chosen.iter().map(|t| t.to_vec()).collect();
        self.not_chosen = emptied
            .iter()
            .filter(|t| !in_mask(self.mask, t))
            .cloned()
            .collect();
        chosen
    }

    fn forget(&mut self, chosen: &[Box<[u8]>], floor: u64) -> Vec<Box<[u8]>> {
        self.floors.push(floor);
        let mut forgotten: Vec<Box<[u8]>> = chosen
            .iter()
            .filter(|t| in_mask(self.forget_mask, t))
            .cloned()
            .collect();
        self.forgotten = forgotten.iter().map(|t| t.to_vec()).collect();
        forgotten.extend(self.not_chosen.iter().cloned());
        forgotten
    }
}

/// After retention: what is left of each topic is its newest messages (offsets stay).
fn drop_deleted(log: &Log, model: &mut Model) -> Result<(), TestCaseError> {
    for t in TOPICS {
        let left = log.read(t, 0).count();
        if let Some(v) = model.records.get_mut(t) {
            prop_assert!(left <= v.len());
            v.drain(..v.len() - left);
        }
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
                    drop_deleted(&l, &mut model)?;
                    marks.clear();
                    log = l;
                }
                Op::RetentionForgetting(bytes, mask, forget_mask) => {
                    log.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let (mut l, _) = open(Some(bytes))?;
                    let mut f = Forgetter { mask, forget_mask, ..Forgetter::default() };
                    l.enforce_retention_forgetting(SystemTime::now(), &mut f)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    drop_deleted(&l, &mut model)?;
                    prop_assert!(f.offered.len() <= 1);
                    prop_assert_eq!(f.floors.len(), usize::from(!f.chosen.is_empty()));
                    for t in f.offered.concat() {
                        // Offered: topics with nothing left.
                        prop_assert!(model.records.get(&t).is_none_or(|v| v.is_empty()));
                    }
                    if let Some(floor) = f.floors.pop() {
                        // The floor goes past every offset of the chosen topics.
                        let highest = f.chosen.iter().map(|t| model.next_offset(t, crashes) - 1).max();
                        if let Some(h) = highest.filter(|h| *h >= model.new_topic_offset(crashes)) {
                            model.floor = Some((h, crashes));
                        }
                        prop_assert_eq!(floor, model.new_topic_offset(crashes));
                        for t in &f.forgotten {
                            model.high.remove(t);
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
