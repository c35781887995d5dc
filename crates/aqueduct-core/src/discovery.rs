//! DNS discovery's decisions, without sockets: when to look the peers up (every
//! `cluster.discovery.interval`), and what an answer means. The server does the lookups (behind a
//! resolver trait, so tests feed answers) and hands a changed peer set to
//! [`Mesh::handle_peer_set`](crate::mesh::Mesh::handle_peer_set), which dials the new peers and
//! closes the connections to the ones that left.
//!
//! A failed lookup keeps the last good set (and says so); so does an empty answer, since a
//! headless Service always lists the asking pod itself: an empty list is a DNS problem, not a
//! cluster of none.

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

/// The polling state.
#[derive(Debug)]
pub struct Discovery {
    interval: Duration,
    next: Instant,
    last_good: Option<BTreeSet<SocketAddr>>,
    failures: u64,
}

impl Discovery {
    /// Look up at once, then every `interval`.
    pub fn new(now: Instant, interval: Duration) -> Discovery {
        Discovery {
            interval,
            next: now,
            last_good: None,
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
        if self.last_good.as_ref() == Some(&addrs) {
            return Answer::Unchanged;
        }
        self.last_good = Some(addrs.clone());
        Answer::Changed(addrs)
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

    /// A fake resolver scales the service 3 → 5 → 2; within one interval of each change the
    /// node dials the new peers and closes the connections to those gone, and a DNS failure
    /// in between changes nothing.
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
                2 | 3 => addrs(2..=5).into_iter().collect(),
                _ => addrs([4]).into_iter().collect(),
            };
            assert_eq!(connected, want, "after round {round}");
            now += interval;
        }
        assert_eq!(d.failures(), 2);
    }
}
