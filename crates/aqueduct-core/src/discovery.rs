//! DNS discovery's decisions, without sockets: when to look the peers up (every
//! `cluster.discovery.interval`), and what an answer means. The server does the lookups (behind a
//! resolver trait, so tests feed answers) and hands a changed peer set to
//! [`Mesh::handle_peer_set`](crate::mesh::Mesh::handle_peer_set), which dials the new peers and
//! closes the connections to the ones that left.
//!
//! A failed lookup keeps the last good set (and says so); so does an empty answer, since a
//! headless Service always lists the asking pod itself: an empty list is a DNS problem, not a
//! cluster of none. A new address is taken at once; one that an answer leaves out is dropped
//! only when [`MISSING_ANSWERS`] answers in a row leave it out, so that one partial answer (a
//! DNS server with a stale view, a pod briefly not ready) does not close a healthy peer's
//! connection and discard its queued copies.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What one lookup's answer changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A new peer set: apply it.
    Changed(BTreeSet<SocketAddr>),
    /// The same as before.
    Unchanged,
    /// The lookup failed (or came back empty): the last good set (of this many) stays.
    Failed { why: String, keeping: usize },
}

/// Good answers in a row that must leave an address out before it is dropped from the set.
pub const MISSING_ANSWERS: u32 = 2;

/// The polling state.
#[derive(Debug)]
pub struct Discovery {
    interval: Duration,
    next: Instant,
    last_good: Option<BTreeSet<SocketAddr>>,
    /// Addresses of the set that the latest good answers left out, with how many in a row.
    missing: std::collections::BTreeMap<SocketAddr, u32>,
    failures: u64,
}

impl Discovery {
    /// Look up at once, then every `interval`.
    pub fn new(now: Instant, interval: Duration) -> Discovery {
        Discovery {
            interval,
            next: now,
            last_good: None,
            missing: Default::default(),
            failures: 0,
        }
    }

    /// When the next lookup is due.
    pub fn poll_timeout(&self) -> Instant {
        self.next
    }

    /// Failed lookups so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The result of the lookup made at `now`.
    pub fn handle_answer(
        &mut self,
        now: Instant,
        answer: Result<Vec<SocketAddr>, String>,
    ) -> Answer {
        self.next = now + self.interval;
        let addrs = match answer {
            Ok(a) if !a.is_empty() => a.into_iter().collect::<BTreeSet<_>>(),
            Ok(_) => return self.failed("the name resolved to no address".into()),
            Err(why) => return self.failed(why),
        };
        // Keep what this answer leaves out until it has been left out MISSING_ANSWERS times.
        let mut set = addrs.clone();
        let before = self.last_good.clone().unwrap_or_default();
        let mut missing = std::collections::BTreeMap::new();
        for a in before.difference(&addrs) {
            let times = self.missing.get(a).copied().unwrap_or(0) + 1;
            if times < MISSING_ANSWERS {
                missing.insert(*a, times);
                set.insert(*a);
            }
        }
        self.missing = missing;
        if self.last_good.as_ref() == Some(&set) {
            return Answer::Unchanged;
        }
        self.last_good = Some(set.clone());
        Answer::Changed(set)
    }

    fn failed(&mut self, why: String) -> Answer {
        self.failures += 1;
        Answer::Failed {
            why,
            keeping: self.last_good.as_ref().map_or(0, BTreeSet::len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{ConnId, Mesh, MeshConfig, NodeId, Output};

    fn addrs(ids: impl IntoIterator<Item = u8>) -> Vec<SocketAddr> {
        ids.into_iter()
            .map(|i| SocketAddr::from(([10, 0, 0, i], 4242)))
            .collect()
    }

    /// One answer that leaves a healthy peer out (a DNS server with a stale view) changes
    /// nothing; two in a row drop it.
    #[test]
    fn one_partial_answer_does_not_drop_a_peer() {
        let now = Instant::now();
        let mut d = Discovery::new(now, Duration::from_secs(1));
        let all: BTreeSet<SocketAddr> = addrs(1..=3).into_iter().collect();
        assert_eq!(d.handle_answer(now, Ok(addrs(1..=3))), Answer::Changed(all));
        assert_eq!(d.handle_answer(now, Ok(addrs(1..=2))), Answer::Unchanged);
        assert_eq!(d.handle_answer(now, Ok(addrs(1..=3))), Answer::Unchanged);
        assert_eq!(d.handle_answer(now, Ok(addrs(1..=2))), Answer::Unchanged);
        assert_eq!(
            d.handle_answer(now, Ok(addrs(1..=2))),
            Answer::Changed(addrs(1..=2).into_iter().collect())
        );
    }

    /// A fake resolver scales the service 3 → 5 → 2; within one interval of each change the
    /// node dials the new peers, within two it closes the connections to those gone (left out
    /// of two answers in a row), and a DNS failure or an empty answer in between changes
    /// nothing.
    #[test]
    fn the_peer_set_follows_the_answers_within_one_interval() {
        let start = Instant::now();
        let interval = Duration::from_secs(10);
        let mut d = Discovery::new(start, interval);
        let me = NodeId::try_from("node-1").expect("id");
        let mut mesh = Mesh::new(me, MeshConfig::default(), 1, 1);
        let answers: Vec<Result<Vec<SocketAddr>, String>> = vec![
            Ok(addrs(1..=3)),
            Err("SERVFAIL".into()),
            Ok(addrs(1..=5)),
            Ok(vec![]),
            Ok(addrs([1, 4])),
            Ok(addrs([1, 4])),
        ];
        let mut connected: BTreeSet<SocketAddr> = BTreeSet::new();
        let mut conns: Vec<(SocketAddr, ConnId)> = Vec::new();
        let mut next_conn = 1;
        let mut now = start;
        for (round, answer) in answers.into_iter().enumerate() {
            assert!(d.poll_timeout() <= now, "a lookup is due each interval");
            match d.handle_answer(now, answer) {
                Answer::Changed(set) => mesh.handle_peer_set(now, set),
                Answer::Unchanged => {}
                Answer::Failed { keeping, .. } => assert_eq!(keeping, connected.len() + 1),
            }
            while let Some(o) = mesh.poll_output() {
                match o {
                    Output::Dial(a) if a == addrs([1])[0] => {
                        // Itself: the connection names this node.
                        let id = ConnId(next_conn);
                        next_conn += 1;
                        let me = NodeId::try_from("node-1").expect("id");
                        assert!(!mesh.handle_connected(now, id, me, Some(a), true));
                    }
                    Output::Dial(a) => {
                        let id = ConnId(next_conn);
                        next_conn += 1;
                        let peer =
                            NodeId::try_from(format!("node-{}", a.ip()).as_str()).expect("id");
                        assert!(mesh.handle_connected(now, id, peer, Some(a), true));
                        connected.insert(a);
                        conns.push((a, id));
                    }
                    Output::Close { conn, .. } => {
                        if let Some(&(a, _)) = conns.iter().find(|(_, c)| *c == conn) {
                            connected.remove(&a);
                        }
                        mesh.handle_disconnected(now, conn);
                    }
                    Output::Send { .. } => {}
                }
            }
            let want: BTreeSet<SocketAddr> = match round {
                0 | 1 => addrs(2..=3).into_iter().collect(),
                // Left out once: kept (a partial answer must not cut healthy peers).
                2..=4 => addrs(2..=5).into_iter().collect(),
                _ => addrs([4]).into_iter().collect(),
            };
            assert_eq!(connected, want, "after round {round}");
            now += interval;
        }
        assert_eq!(d.failures(), 2);
    }
}
