//! Validated names: [`TopicName`], [`TopicFilter`], [`GroupId`], [`ConsumerId`].
//!
//! Each is a cheap-to-clone [`Bytes`] that is guaranteed valid UTF-8 and within the rules below, so
//! code holding one never re-checks it. Building one from a received frame borrows the frame's
//! buffer (no copy, no allocation).
//!
//! Rules (normative copy in `docs/protocol.md`):
//! - every name is 1..=255 bytes of UTF-8 and contains neither `:` nor NUL;
//! - topics are `/`-separated levels; empty levels are allowed (`a//b`);
//! - a [`TopicName`] contains no `+` or `#`;
//! - in a [`TopicFilter`], `+` must be a whole level and `#` must be the whole last level.

use std::borrow::Borrow;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

/// Longest topic name, filter, group id or consumer id, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Why a name was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("empty")]
    Empty,
    #[error("{len} bytes long (max {MAX_NAME_LEN})")]
    TooLong { len: usize },
    #[error("not valid UTF-8")]
    NotUtf8,
    #[error("contains forbidden character {ch:?} at byte {at}")]
    Forbidden { ch: char, at: usize },
    #[error("wildcard {ch:?} at byte {at} is not allowed in a topic name")]
    WildcardInName { ch: char, at: usize },
    #[error("wildcard {ch:?} at byte {at} must occupy a whole level")]
    PartialWildcard { ch: char, at: usize },
    #[error("'#' at byte {at} must be the last level")]
    HashNotLast { at: usize },
}

fn check_common(bytes: &[u8]) -> Result<(), TopicError> {
    if bytes.is_empty() {
        return Err(TopicError::Empty);
    }
    if bytes.len() > MAX_NAME_LEN {
        return Err(TopicError::TooLong { len: bytes.len() });
    }
    for (at, &b) in bytes.iter().enumerate() {
        if b == b':' || b == 0 {
            return Err(TopicError::Forbidden {
                ch: char::from(b),
                at,
            });
        }
    }
    // Most names are ASCII: a cheap check first, the full UTF-8 validation only when needed.
    if !bytes.is_ascii() && std::str::from_utf8(bytes).is_err() {
        return Err(TopicError::NotUtf8);
    }
    Ok(())
}

/// View validated bytes as `&str`. The constructors guarantee UTF-8; the fallback is unreachable.
fn as_str(bytes: &Bytes) -> &str {
    std::str::from_utf8(bytes).unwrap_or_default()
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $what:expr, $check:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Bytes);

        impl $name {
            /// Validate `bytes` (borrowing their buffer, no copy).
            pub fn from_bytes(bytes: Bytes) -> Result<Self, TopicError> {
                ($check)(&bytes[..])?;
                Ok(Self(bytes))
            }

            /// Validate and copy a slice.
            pub fn from_slice(bytes: &[u8]) -> Result<Self, TopicError> {
                ($check)(bytes)?;
                Ok(Self(Bytes::copy_from_slice(bytes)))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                as_str(&self.0)
            }

            /// The raw bytes (always valid UTF-8).
            pub fn as_bytes(&self) -> &[u8] {
                &self.0
            }

            /// The underlying buffer.
            pub fn to_bytes(&self) -> Bytes {
                self.0.clone()
            }

            /// A copy that owns its bytes, so it does not pin a larger frame buffer in memory.
            pub fn detached(&self) -> Self {
                Self(Bytes::copy_from_slice(&self.0))
            }

            /// Length in bytes.
            pub fn len(&self) -> usize {
                self.0.len()
            }

            /// Always false: names are never empty. Present for API symmetry with `len`.
            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }

            pub(crate) const WHAT: &'static str = $what;
        }

        impl FromStr for $name {
            type Err = TopicError;
            fn from_str(s: &str) -> Result<Self, TopicError> {
                Self::from_slice(s.as_bytes())
            }
        }

        impl TryFrom<&str> for $name {
            type Error = TopicError;
            fn try_from(s: &str) -> Result<Self, TopicError> {
                Self::from_slice(s.as_bytes())
            }
        }

        impl Borrow<[u8]> for $name {
            fn borrow(&self) -> &[u8] {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.as_str())
            }
        }
    };
}

fn check_name(bytes: &[u8]) -> Result<(), TopicError> {
    check_common(bytes)?;
    if let Some(at) = bytes.iter().position(|&b| b == b'+' || b == b'#') {
        return Err(TopicError::WildcardInName {
            ch: char::from(bytes[at]),
            at,
        });
    }
    Ok(())
}

fn check_filter(bytes: &[u8]) -> Result<(), TopicError> {
    check_common(bytes)?;
    let mut level_start = 0;
    for (at, &b) in bytes.iter().enumerate() {
        match b {
            b'/' => level_start = at + 1,
            b'+' | b'#' => {
                let level_end = at + 1;
                let whole =
                    at == level_start && (level_end == bytes.len() || bytes[level_end] == b'/');
                if !whole {
                    return Err(TopicError::PartialWildcard {
                        ch: char::from(b),
                        at,
                    });
                }
                if b == b'#' && level_end != bytes.len() {
                    return Err(TopicError::HashNotLast { at });
                }
            }
            _ => {}
        }
    }
    Ok(())
}

name_type!(
    /// A concrete topic, the destination of a publish: `orders/eu/42`.
    TopicName,
    "topic name",
    check_name
);
name_type!(
    /// A subscription pattern: a topic name, or one with `+` (one level) and `#` (the rest) levels.
    TopicFilter,
    "topic filter",
    check_filter
);
name_type!(
    /// The name of a consumer group.
    GroupId,
    "group id",
    check_common
);
name_type!(
    /// The name of a durable consumer.
    ConsumerId,
    "consumer id",
    check_common
);

/// A borrowed, validated topic name: what a decoder hands out without copying or counting
/// references. [`TopicRef::to_name`] makes an owned [`TopicName`]. Holds bytes (valid UTF-8 by
/// construction) so that borrowing a [`TopicName`] costs nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicRef<'a>(&'a [u8]);

impl<'a> TopicRef<'a> {
    /// Validate `bytes` as a topic name.
    pub fn new(bytes: &'a [u8]) -> Result<TopicRef<'a>, TopicError> {
        check_name(bytes)?;
        Ok(TopicRef(bytes))
    }

    /// Bytes equal to a name already validated.
    pub(crate) fn validated(bytes: &'a [u8]) -> TopicRef<'a> {
        TopicRef(bytes)
    }

    /// [`new`](Self::new), given `known`, a name already validated (or empty): bytes equal to
    /// it are compared, not checked again (the result is the same).
    pub(crate) fn new_after(bytes: &'a [u8], known: &[u8]) -> Result<TopicRef<'a>, TopicError> {
        if !known.is_empty() && bytes == known {
            Ok(TopicRef(bytes))
        } else {
            TopicRef::new(bytes)
        }
    }

    /// The name as text (validated at construction; re-checked here, off the hot path).
    pub fn as_str(&self) -> &'a str {
        std::str::from_utf8(self.0).unwrap_or_default()
    }

    pub fn as_bytes(&self) -> &'a [u8] {
        self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: names are never empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// True for system topics (`$…`, `__…`).
    pub fn is_system(&self) -> bool {
        self.0.first() == Some(&b'$') || self.0.starts_with(b"__")
    }

    /// An owned copy.
    pub fn to_name(&self) -> TopicName {
        TopicName(Bytes::copy_from_slice(self.0))
    }
}

impl fmt::Display for TopicRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for TopicRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TopicRef({:?})", self.as_str())
    }
}

impl TopicName {
    /// Borrow as a [`TopicRef`].
    pub fn borrowed(&self) -> TopicRef<'_> {
        TopicRef(&self.0)
    }

    /// Wrap bytes already validated as a topic name (by [`TopicRef::new`]).
    pub(crate) fn from_validated(bytes: Bytes) -> TopicName {
        TopicName(bytes)
    }

    /// True for system topics (`$…`, `__…`), which filters starting with a wildcard never match.
    pub fn is_system(&self) -> bool {
        self.0.first() == Some(&b'$') || self.0.starts_with(b"__")
    }
}

impl TopicFilter {
    /// True if the filter contains `+` or `#`.
    pub fn is_wildcard(&self) -> bool {
        self.0.iter().any(|&b| b == b'+' || b == b'#')
    }

    /// The concrete topic this filter names, if it has no wildcard.
    pub fn as_topic(&self) -> Option<TopicName> {
        if self.is_wildcard() {
            None
        } else {
            Some(TopicName(self.0.clone()))
        }
    }
}

impl From<TopicName> for TopicFilter {
    fn from(name: TopicName) -> Self {
        TopicFilter(name.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in [
            "a",
            "a/b",
            "a//b",
            "/",
            "sport/tennis",
            "é/ü",
            "__dlq__orders",
            "$SYS/x",
        ] {
            assert!(TopicName::try_from(ok).is_ok(), "{ok}");
        }
        assert_eq!(TopicName::try_from(""), Err(TopicError::Empty));
        assert_eq!(
            TopicName::try_from("a:b"),
            Err(TopicError::Forbidden { ch: ':', at: 1 })
        );
        assert_eq!(
            TopicName::try_from("a\0"),
            Err(TopicError::Forbidden { ch: '\0', at: 1 })
        );
        assert_eq!(
            TopicName::try_from("a/+"),
            Err(TopicError::WildcardInName { ch: '+', at: 2 })
        );
        assert_eq!(TopicName::from_slice(&[0xff]), Err(TopicError::NotUtf8));
        let long = "x".repeat(256);
        assert_eq!(
            TopicName::try_from(long.as_str()),
            Err(TopicError::TooLong { len: 256 })
        );
        assert!(TopicName::try_from(&long[..255]).is_ok());
    }

    #[test]
    fn filters() {
        for ok in ["#", "+", "a/+", "+/b", "a/#", "+/+/#", "a//+", "+/"] {
            let f = TopicFilter::try_from(ok).expect(ok);
            assert!(f.is_wildcard());
            assert!(f.as_topic().is_none());
        }
        assert!(TopicFilter::try_from("a/b")
            .expect("plain")
            .as_topic()
            .is_some());
        assert_eq!(
            TopicFilter::try_from("a+"),
            Err(TopicError::PartialWildcard { ch: '+', at: 1 })
        );
        assert_eq!(
            TopicFilter::try_from("a/#b"),
            Err(TopicError::PartialWildcard { ch: '#', at: 2 })
        );
        assert_eq!(
            TopicFilter::try_from("#/a"),
            Err(TopicError::HashNotLast { at: 0 })
        );
        assert_eq!(
            TopicFilter::try_from("a/b+/c"),
            Err(TopicError::PartialWildcard { ch: '+', at: 3 })
        );
    }

    #[test]
    fn system_topics() {
        assert!(TopicName::try_from("$SYS/x").expect("t").is_system());
        assert!(TopicName::try_from("__dlq__a").expect("t").is_system());
        assert!(!TopicName::try_from("_a").expect("t").is_system());
    }

    #[test]
    fn borrows_without_copy() {
        let buf = Bytes::from_static(b"xxorders");
        let t = TopicName::from_bytes(buf.slice(2..)).expect("valid");
        assert_eq!(t.as_str(), "orders");
        assert_eq!(t.as_bytes().as_ptr(), buf[2..].as_ptr());
        assert_ne!(t.detached().as_bytes().as_ptr(), buf[2..].as_ptr());
    }
}
