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
    let f = filter.as_bytes();
    let t = topic.as_bytes();
    if topic.is_system() && starts_with_wildcard(f) {
        return false;
    }
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
