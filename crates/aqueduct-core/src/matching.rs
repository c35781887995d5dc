//! MQTT topic matching for one filter against one topic: the reference semantics.
//!
//! - `+` matches exactly one level, which may be empty;
//! - `#` matches the rest: any number of levels, including none (`sport/#` matches `sport`);
//! - a filter whose first level is a wildcard never matches a system topic (`$…`, `__…`).
//!
//! The [`crate::index::SubscriptionIndex`] implements the same rules over a trie; the model-based
//! proptest in `tests/index_model.rs` checks the two agree.

use aqueduct_proto::{TopicFilter, TopicName};

/// Does `filter` match `topic`? Allocation-free, one pass over both.
pub fn matches(filter: &TopicFilter, topic: &TopicName) -> bool {
    matches_bytes(filter.as_bytes(), topic.as_bytes())
}

/// [`matches`] on raw bytes: `filter` a valid filter, `topic` a valid topic name.
pub fn matches_bytes(f: &[u8], t: &[u8]) -> bool {
    if is_system(t) && starts_with_wildcard(f) {
        return false;
    }
    matches_any_bytes(f, t)
}

/// [`matches_bytes`] without the rule for system topics: a filter whose first level is a
/// wildcard matches them too (the ACL's deny rules, see acl.rs).
pub fn matches_any_bytes(f: &[u8], t: &[u8]) -> bool {
    // `i` and `j` are at the start of a level in the filter and the topic.
    let (mut i, mut j) = (0, 0);
    loop {
        if &f[i..] == b"#" {
            return true;
        }
        if f.get(i) == Some(&b'+') && f.get(i + 1).is_none_or(|&b| b == b'/') {
            i += 1;
            j += t[j..]
                .iter()
                .position(|&b| b == b'/')
                .unwrap_or(t.len() - j);
        } else {
            while i < f.len() && f[i] != b'/' {
                if t.get(j) != Some(&f[i]) {
                    return false;
                }
                i += 1;
                j += 1;
            }
            if j < t.len() && t[j] != b'/' {
                return false;
            }
        }
        // Both are at the end of a level.
        match (i == f.len(), j == t.len()) {
            (true, true) => return true,
            (true, false) => return false,
            // The topic has no more levels: only a trailing `/#` still matches (zero levels).
            (false, true) => return &f[i..] == b"/#",
            (false, false) => {
                i += 1;
                j += 1;
            }
        }
    }
}

/// A system topic (`$…`, `__…`), or a filter whose first level names system topics.
pub(crate) fn is_system(name: &[u8]) -> bool {
    name.first() == Some(&b'$') || name.starts_with(b"__")
}

/// Does filter `outer` match every topic that filter `inner` matches? (ACL rules: a rule covers
/// a subscription.) Exact for the MQTT semantics above, including system topics.
pub fn covers(outer: &TopicFilter, inner: &TopicFilter) -> bool {
    let (o, i) = (outer.as_bytes(), inner.as_bytes());
    if starts_with_wildcard(o) && is_system(i) {
        // Every topic `inner` matches is a system topic, which `outer` never matches.
        return false;
    }
    covers_any(outer, inner)
}

/// [`covers`] without the rule for system topics (see [`matches_any_bytes`]).
pub fn covers_any(outer: &TopicFilter, inner: &TopicFilter) -> bool {
    let (o, i) = (outer.as_bytes(), inner.as_bytes());
    // `+/#` matches every topic, as `#` does: a topic has at least one level, and `#` matches
    // its parent. Deeper down, `#` matches the parent level `+` needs (below, it does not).
    if o == b"+/#" && i == b"#" {
        return true;
    }
    let mut o = o.split(|&b| b == b'/');
    let mut i = i.split(|&b| b == b'/');
    loop {
        match (o.next(), i.next()) {
            (Some(b"#"), _) => return true,
            (None, None) => return true,
            // `inner` matches longer topics than `outer` does, or shorter ones (`inner` ended:
            // `outer` needs more levels, none of which is `#`).
            (None, Some(_)) | (Some(_), None) => return false,
            (Some(b"+"), Some(level)) if level != b"#" => {}
            (Some(lit), Some(level)) if lit == level && lit != b"+" => {}
            _ => return false,
        }
    }
}

/// Is there a topic that both filters match?
pub fn overlaps(a: &TopicFilter, b: &TopicFilter) -> bool {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    if (starts_with_wildcard(x) && is_system(y)) || (starts_with_wildcard(y) && is_system(x)) {
        return false;
    }
    overlaps_any(a, b)
}

/// [`overlaps`] without the rule for system topics (see [`matches_any_bytes`]).
pub fn overlaps_any(a: &TopicFilter, b: &TopicFilter) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut a = a.split(|&c| c == b'/');
    let mut b = b.split(|&c| c == b'/');
    loop {
        match (a.next(), b.next()) {
            (Some(b"#"), _) | (_, Some(b"#")) => return true,
            (None, None) => return true,
            (None, Some(_)) | (Some(_), None) => return false,
            (Some(x), Some(y)) if x == b"+" || y == b"+" || x == y => {}
            _ => return false,
        }
    }
}

/// Is there a topic that `filter` matches (the MQTT rules above) and a deny rule's `rule`
/// matches as [`matches_any_bytes`] does (system topics included)? A filter starting with a
/// wildcard matches no system topic, so a deny of system topics alone (`$SYS/#`) reaches none
/// of its topics, though [`overlaps_any`] says the two overlap.
pub fn deny_reaches(rule: &TopicFilter, filter: &TopicFilter) -> bool {
    if starts_with_wildcard(filter.as_bytes()) && is_system(rule.as_bytes()) {
        return false;
    }
    overlaps_any(rule, filter)
}

/// True if the first level of a filter is `+` or `#`.
fn starts_with_wildcard(filter: &[u8]) -> bool {
    matches!(filter, [b'+' | b'#'] | [b'+' | b'#', b'/', ..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(filter: &str, topic: &str) -> bool {
        matches(
            &TopicFilter::try_from(filter).expect("valid filter"),
            &TopicName::try_from(topic).expect("valid topic"),
        )
    }

    /// MQTT 3.1.1 §4.7 and common broker test vectors.
    #[test]
    fn mqtt_vectors() {
        let cases = [
            ("sport/tennis/player1", "sport/tennis/player1", true),
            ("sport/tennis/player1/#", "sport/tennis/player1", true),
            (
                "sport/tennis/player1/#",
                "sport/tennis/player1/ranking",
                true,
            ),
            (
                "sport/tennis/player1/#",
                "sport/tennis/player1/score/wimbledon",
                true,
            ),
            ("sport/#", "sport", true),
            ("sport/#", "sport/", true),
            ("#", "sport/tennis", true),
            ("#", "/", true),
            ("sport/tennis/+", "sport/tennis/player1", true),
            ("sport/tennis/+", "sport/tennis/player1/ranking", false),
            ("sport/tennis/+", "sport/tennis", false),
            ("sport/+", "sport", false),
            ("sport/+", "sport/", true),
            ("+", "sport", true),
            ("+", "/finance", false),
            ("+/+", "/finance", true),
            ("/+", "/finance", true),
            ("+/#", "/finance", true),
            ("+/+/+", "a//c", true),
            ("a/+/c", "a//c", true),
            ("a/#", "b", false),
            ("a/b", "a/b/c", false),
            ("a/b/c", "a/b", false),
            ("a//b", "a/b", false),
            ("+/tennis/#", "sport/tennis/x", true),
            ("sport/+/#", "sport/tennis", true),
            ("sport/+/#", "sport", false),
        ];
        for (filter, topic, want) in cases {
            assert_eq!(m(filter, topic), want, "{filter} vs {topic}");
        }
    }

    fn f(s: &str) -> TopicFilter {
        TopicFilter::try_from(s).expect("valid filter")
    }

    #[test]
    fn covers_vectors() {
        let cases = [
            ("#", "a/b", true),
            ("#", "a/#", true),
            ("a/#", "a", true),
            ("a/#", "a/+/c", true),
            ("a/+", "a/b", true),
            ("a/+", "a/+", true),
            ("a/+", "a/#", false),
            ("a/b", "a/+", false),
            ("a/b", "a/b", true),
            ("a/b", "a/b/c", false),
            ("a/+/#", "a", false),
            ("a/+/#", "a/b", true),
            ("+", "a/b", false),
            ("#", "$SYS/x", false),
            ("+/x", "__dlq__a/x", false),
            ("$SYS/#", "$SYS/+", true),
            ("__dlq__a", "__dlq__a", true),
            // `+/#` matches every topic `#` does (it said it did not: an ACL rule `+/#` refused
            // a `#` subscription); deeper, `#` matches the parent level `+` needs.
            ("+/#", "#", true),
            ("+/#", "+/#", true),
            ("+/+/#", "#", false),
            ("a/+/#", "a/#", false),
        ];
        for (outer, inner, want) in cases {
            assert_eq!(covers(&f(outer), &f(inner)), want, "{outer} covers {inner}");
        }
    }

    #[test]
    fn overlaps_vectors() {
        let cases = [
            ("a/#", "a", true),
            ("a", "a/#", true),
            ("a/+", "a", false),
            ("a/+", "+/b", true),
            ("a/b", "a/c", false),
            ("a/+/c", "a/b/+", true),
            ("#", "$SYS/x", false),
            ("$SYS/#", "$SYS/+", true),
            ("+", "__x", false),
            ("a/b/c", "a/#", true),
            ("a/b/c", "a/+", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(overlaps(&f(a), &f(b)), want, "{a} overlaps {b}");
            assert_eq!(overlaps(&f(b), &f(a)), want, "{b} overlaps {a}");
        }
    }

    #[test]
    fn system_topics_need_a_literal_first_level() {
        assert!(!m("#", "$SYS/uptime"));
        assert!(!m("+/uptime", "$SYS/uptime"));
        assert!(!m("#", "__dlq__orders"));
        assert!(!m("+", "__dlq__orders"));
        assert!(m("$SYS/#", "$SYS/uptime"));
        assert!(m("$SYS/+", "$SYS/uptime"));
        assert!(m("__dlq__orders", "__dlq__orders"));
        assert!(m("__dlq__orders/#", "__dlq__orders"));
        // Not system topics: a single underscore, or `$` later in the name.
        assert!(m("#", "_orders"));
        assert!(m("+/x", "a$/x"));
    }
}
