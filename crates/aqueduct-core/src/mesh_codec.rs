//! The bytes of the mesh's control messages ([`Control`]) and of a forwarded copy's routing
//! ([`Forward`]), as they travel between nodes. All integers little-endian; every name is
//! length-prefixed (u8) and validated as the core's topic filter, group id or node id.
//!
//! ```text
//! control  = len u32 | kind u8 (1 snapshot, 2 delta) | session u64 | seq u64 | n u32 | entry*n
//! entry    = 1 u8 | filter | count u32                       (plain)
//!          | 2 u8 | filter | group | count u32               (group)
//! forward  = flags u8 (bit 0: plain) | n u8 | (filter | group)*n | m u8 | node*m
//! name     = len u8 | bytes
//! ```
//!
//! `len` counts the bytes after it; a control message is at most [`MAX_CONTROL`] bytes.
//! Decoding distinguishes "need more bytes" from "invalid", never panics and never allocates
//! more than the input justifies.

use bytes::{Buf, BufMut};

use crate::mesh::{Control, Forward, GroupKey, Interest, Key, NodeId, Update};
use aqueduct_proto::{GroupId, TopicFilter};

/// Largest encoded control message (a snapshot of a node's whole interest).
pub const MAX_CONTROL: usize = 16 << 20;
/// Groups one forwarded record may name (mesh-protocol.md §4): with 255-byte names its routing
/// stays well under its 64 KiB length field; a copy for more groups is sent as several records.
pub const MAX_GROUPS_PER_RECORD: usize = 32;

/// Why bytes are not a mesh message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshCodecError {
    #[error("incomplete: {need} more bytes needed")]
    Incomplete { need: usize },
    #[error("control message of {len} bytes, above the {MAX_CONTROL}-byte limit")]
    TooLarge { len: usize },
    #[error("invalid mesh message at byte {offset}: {problem}")]
    Invalid { offset: usize, problem: String },
}

fn put_name(out: &mut Vec<u8>, name: &[u8]) {
    // Names are at most 255 bytes (validated types).
    out.put_u8(name.len() as u8);
    out.put_slice(name);
}

fn put_key(out: &mut Vec<u8>, key: &Key) {
    match key {
        Key::Plain(f) => {
            out.put_u8(1);
            put_name(out, f.as_bytes());
        }
        Key::Group(g) => {
            out.put_u8(2);
            put_name(out, g.filter.as_bytes());
            put_name(out, g.group.as_bytes());
        }
    }
}

/// Append `control`, framed, to `out`.
pub fn encode_control(control: &Control, out: &mut Vec<u8>) {
    let start = out.len();
    out.put_u32_le(0);
    let (kind, session, seq, updates) = match control {
        Control::Snapshot {
            session,
            seq,
            interest,
        } => (1u8, *session, *seq, interest.updates()),
        Control::Delta {
            session,
            seq,
            updates,
        } => (2u8, *session, *seq, updates.clone()),
        Control::SnapshotPart {
            session,
            seq,
            updates,
        } => (3u8, *session, *seq, updates.clone()),
        Control::Leaving => (4u8, 0, 0, Vec::new()),
    };
    out.put_u8(kind);
    out.put_u64_le(session);
    out.put_u64_le(seq);
    out.put_u32_le(updates.len() as u32);
    for u in &updates {
        put_key(out, &u.key);
        out.put_u32_le(u.count);
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// A reader over one message's bytes that reports where it failed.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn invalid(&self, problem: impl Into<String>) -> MeshCodecError {
        MeshCodecError::Invalid {
            offset: self.pos,
            problem: problem.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MeshCodecError> {
        let rest = &self.buf[self.pos..];
        if rest.len() < n {
            return Err(self.invalid(format!("{n} bytes needed, {} left", rest.len())));
        }
        self.pos += n;
        Ok(&rest[..n])
    }

    fn u8(&mut self) -> Result<u8, MeshCodecError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, MeshCodecError> {
        let mut b = self.take(4)?;
        Ok(b.get_u32_le())
    }

    fn u64(&mut self) -> Result<u64, MeshCodecError> {
        let mut b = self.take(8)?;
        Ok(b.get_u64_le())
    }

    fn name(&mut self) -> Result<&'a [u8], MeshCodecError> {
        let n = self.u8()? as usize;
        self.take(n)
    }

    fn filter(&mut self) -> Result<TopicFilter, MeshCodecError> {
        let at = self.pos;
        let bytes = self.name()?;
        TopicFilter::from_slice(bytes).map_err(|e| MeshCodecError::Invalid {
            offset: at,
            problem: format!("filter: {e}"),
        })
    }

    fn group(&mut self) -> Result<GroupId, MeshCodecError> {
        let at = self.pos;
        let bytes = self.name()?;
        GroupId::from_slice(bytes).map_err(|e| MeshCodecError::Invalid {
            offset: at,
            problem: format!("group: {e}"),
        })
    }

    fn key(&mut self) -> Result<Key, MeshCodecError> {
        match self.u8()? {
            1 => Ok(Key::Plain(self.filter()?)),
            2 => Ok(Key::Group(GroupKey {
                filter: self.filter()?,
                group: self.group()?,
            })),
            k => Err(self.invalid(format!("unknown interest kind {k}"))),
        }
    }
}

/// Decode one framed control message from the front of `buf`; returns it and how many bytes
/// it took.
pub fn decode_control(buf: &[u8]) -> Result<(Control, usize), MeshCodecError> {
    if buf.len() < 4 {
        return Err(MeshCodecError::Incomplete {
            need: 4 - buf.len(),
        });
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > MAX_CONTROL {
        return Err(MeshCodecError::TooLarge { len });
    }
    if buf.len() < 4 + len {
        return Err(MeshCodecError::Incomplete {
            need: 4 + len - buf.len(),
        });
    }
    let mut r = Reader {
        buf: &buf[..4 + len],
        pos: 4,
    };
    let kind = r.u8()?;
    let session = r.u64()?;
    let seq = r.u64()?;
    let n = r.u32()? as usize;
    // Each entry takes at least 6 bytes: no more entries than the input holds, and room made
    // for at most as many as a few KiB of it (an entry in memory is larger than its minimum
    // encoding: reserving for `n` up front would take ~13 times the bytes received).
    if n > len / 6 {
        return Err(r.invalid(format!("{n} entries cannot fit in {len} bytes")));
    }
    // Senders split larger snapshots into parts of this many: a message with more is refused
    // before it is decoded (its keys would take ~13 times its bytes in memory).
    if n > crate::mesh::ENTRIES_PER_MESSAGE {
        return Err(r.invalid(format!(
            "{n} entries in one message (at most {})",
            crate::mesh::ENTRIES_PER_MESSAGE
        )));
    }
    let mut updates = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let key = r.key()?;
        let count = r.u32()?;
        updates.push(Update { key, count });
    }
    if r.pos != 4 + len {
        return Err(r.invalid(format!("{} bytes left over", 4 + len - r.pos)));
    }
    let control = match kind {
        1 => {
            let mut interest = Interest::default();
            for u in &updates {
                interest.apply(u);
            }
            Control::Snapshot {
                session,
                seq,
                interest,
            }
        }
        2 => Control::Delta {
            session,
            seq,
            updates,
        },
        3 => Control::SnapshotPart {
            session,
            seq,
            updates,
        },
        4 if session == 0 && seq == 0 && updates.is_empty() => Control::Leaving,
        4 => {
            return Err(MeshCodecError::Invalid {
                offset: 4,
                problem: "a leaving message carries no session, sequence number or entries".into(),
            })
        }
        k => {
            return Err(MeshCodecError::Invalid {
                offset: 4,
                problem: format!("unknown control kind {k}"),
            })
        }
    };
    Ok((control, 4 + len))
}

/// Append a copy's routing to `out` (it travels in an extension, at most 1024 bytes: a copy
/// names few groups and nodes; the caller checks the length).
pub fn encode_forward(f: &Forward, out: &mut Vec<u8>) {
    out.put_u8(u8::from(f.plain));
    out.put_u8(f.groups.len().min(255) as u8);
    for g in f.groups.iter().take(255) {
        put_name(out, g.filter.as_bytes());
        put_name(out, g.group.as_bytes());
    }
    out.put_u8(f.visited.len().min(255) as u8);
    for n in f.visited.iter().take(255) {
        put_name(out, n.as_str().as_bytes());
    }
}

/// Decode a copy's routing (the whole of `buf`).
pub fn decode_forward(buf: &[u8]) -> Result<Forward, MeshCodecError> {
    let mut r = Reader { buf, pos: 0 };
    let flags = r.u8()?;
    if flags & !1 != 0 {
        return Err(r.invalid(format!("unknown flags 0x{flags:02x}")));
    }
    let n = r.u8()?;
    if usize::from(n) > MAX_GROUPS_PER_RECORD {
        return Err(r.invalid(format!(
            "{n} groups in one record (at most {MAX_GROUPS_PER_RECORD})"
        )));
    }
    let mut groups = Vec::with_capacity(n as usize);
    for _ in 0..n {
        groups.push(GroupKey {
            filter: r.filter()?,
            group: r.group()?,
        });
    }
    let m = r.u8()?;
    let mut visited = Vec::with_capacity(m as usize);
    for _ in 0..m {
        let at = r.pos;
        let name = r.name()?;
        let node = std::str::from_utf8(name)
            .ok()
            .and_then(|s| NodeId::try_from(s).ok())
            .ok_or_else(|| MeshCodecError::Invalid {
                offset: at,
                problem: "node id is not 1-255 bytes of UTF-8".into(),
            })?;
        visited.push(node);
    }
    if r.pos != buf.len() {
        return Err(r.invalid(format!("{} bytes left over", buf.len() - r.pos)));
    }
    Ok(Forward {
        plain: flags & 1 != 0,
        groups,
        visited,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(s: &str) -> TopicFilter {
        TopicFilter::try_from(s).expect("filter")
    }

    fn g(filter: &str, id: &str) -> GroupKey {
        GroupKey {
            filter: f(filter),
            group: GroupId::try_from(id).expect("group"),
        }
    }

    #[test]
    fn control_round_trips_and_frames() {
        let mut interest = Interest::default();
        interest.add(Key::Plain(f("orders/#")), 2);
        interest.add(Key::Group(g("jobs", "w")), 3);
        let msgs = [
            Control::Snapshot {
                session: 7,
                seq: 1,
                interest,
            },
            Control::Delta {
                session: 7,
                seq: 2,
                updates: vec![Update {
                    key: Key::Plain(f("a/+")),
                    count: 0,
                }],
            },
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            encode_control(m, &mut buf);
        }
        let (first, n) = decode_control(&buf).expect("first");
        assert_eq!(first, msgs[0]);
        let (second, m) = decode_control(&buf[n..]).expect("second");
        assert_eq!(second, msgs[1]);
        assert_eq!(n + m, buf.len());
        // Cut anywhere: incomplete, never invalid, never a panic.
        for cut in 0..n {
            assert!(matches!(
                decode_control(&buf[..cut]),
                Err(MeshCodecError::Incomplete { .. })
            ));
        }
    }

    /// A leaving message is kind 4 with nothing in it: 21 bytes after the length.
    #[test]
    fn leaving_is_kind_4_with_no_session_and_no_entries() {
        let mut buf = Vec::new();
        encode_control(&Control::Leaving, &mut buf);
        let mut want = vec![21, 0, 0, 0, 4];
        want.extend_from_slice(&[0; 20]);
        assert_eq!(buf, want);
        assert_eq!(decode_control(&buf), Ok((Control::Leaving, 25)));
        // With a session, a sequence number or an entry it is not a leaving message.
        for at in [5, 13, 21] {
            let mut bad = buf.clone();
            bad[at] = 1;
            let e = decode_control(&bad).expect_err("refused");
            assert!(
                matches!(e, MeshCodecError::Invalid { .. }),
                "byte {at}: {e}"
            );
        }
    }

    #[test]
    fn bad_control_is_refused_with_where() {
        assert_eq!(
            decode_control(&(MAX_CONTROL as u32 + 1).to_le_bytes()),
            Err(MeshCodecError::TooLarge {
                len: MAX_CONTROL + 1
            })
        );
        // Claims a billion entries in 21 bytes.
        let mut buf = Vec::new();
        buf.put_u32_le(21);
        buf.put_u8(1);
        buf.put_u64_le(1);
        buf.put_u64_le(1);
        buf.put_u32_le(1 << 30);
        assert!(matches!(
            decode_control(&buf),
            Err(MeshCodecError::Invalid { .. })
        ));
        // An invalid filter.
        let mut buf = Vec::new();
        let body = [
            &[2u8][..],
            &[0; 16],
            &1u32.to_le_bytes(),
            &[1, 3],
            b"a#b",
            &[0; 4],
        ]
        .concat();
        buf.put_u32_le(body.len() as u32);
        buf.extend_from_slice(&body);
        let e = decode_control(&buf).expect_err("bad filter");
        assert!(e.to_string().contains("filter"), "{e}");
    }

    /// A message holds at most `ENTRIES_PER_MESSAGE` entries (what senders split at): one
    /// with exactly that many decodes, one more is refused before its keys are built.
    #[test]
    fn a_message_with_more_entries_than_senders_make_is_refused() {
        use crate::mesh::ENTRIES_PER_MESSAGE;
        let delta = |n: usize| Control::Delta {
            session: 1,
            seq: 1,
            updates: (0..n)
                .map(|i| Update {
                    key: Key::Plain(f(&format!("t/{i}"))),
                    count: 1,
                })
                .collect(),
        };
        let mut buf = Vec::new();
        encode_control(&delta(ENTRIES_PER_MESSAGE), &mut buf);
        let (decoded, used) = decode_control(&buf).expect("the largest message senders make");
        assert_eq!(used, buf.len());
        assert_eq!(decoded, delta(ENTRIES_PER_MESSAGE));
        let mut buf = Vec::new();
        encode_control(&delta(ENTRIES_PER_MESSAGE + 1), &mut buf);
        let e = decode_control(&buf).expect_err("one entry too many");
        assert!(
            matches!(e, MeshCodecError::Invalid { .. }) && e.to_string().contains("at most 16384"),
            "{e}"
        );
    }

    #[test]
    fn forward_round_trips() {
        let fwd = Forward {
            plain: true,
            groups: vec![g("jobs", "w"), g("a/#", "x")],
            visited: vec![NodeId::try_from("node-1").expect("id")],
        };
        let mut buf = Vec::new();
        encode_forward(&fwd, &mut buf);
        assert_eq!(decode_forward(&buf), Ok(fwd));
        assert!(decode_forward(&buf[..buf.len() - 1]).is_err());
        assert!(decode_forward(&[4, 0, 0]).is_err(), "unknown flag");
    }

    /// A record names at most `MAX_GROUPS_PER_RECORD` groups (what senders split at).
    #[test]
    fn a_record_with_more_groups_than_senders_make_is_refused() {
        let forward = |n: usize| Forward {
            plain: false,
            groups: (0..n).map(|i| g(&format!("jobs/{i}"), "w")).collect(),
            visited: Vec::new(),
        };
        let mut buf = Vec::new();
        encode_forward(&forward(MAX_GROUPS_PER_RECORD), &mut buf);
        assert_eq!(decode_forward(&buf), Ok(forward(MAX_GROUPS_PER_RECORD)));
        let mut buf = Vec::new();
        encode_forward(&forward(MAX_GROUPS_PER_RECORD + 1), &mut buf);
        let e = decode_forward(&buf).expect_err("one group too many");
        assert!(e.to_string().contains("at most 32"), "{e}");
    }
}
