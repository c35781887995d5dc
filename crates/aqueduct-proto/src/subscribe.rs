//! The seed's SUBSCRIBE / UNSUBSCRIBE payload grammar, parsed once into types:
//!
//! ```text
//! subscribe   = "topic:" filter [ ":group:" group_id ] [ ":durable:" consumer_id ":" start ]
//! unsubscribe = "topic:" filter
//! start       = offset / "earliest" / "latest"
//! offset      = 1*DIGIT            ; decimal u64
//! ```
//! `:` cannot occur inside a filter, group id or consumer id, so the payload splits on `:`
//! unambiguously. The two options may appear in either order, each at most once; encoding writes
//! them in the order above.

use std::fmt::Write as _;

use bytes::Bytes;

use crate::error::ProtoError;
use crate::topic::{ConsumerId, GroupId, TopicError, TopicFilter};

/// Where a durable consumer asks to start (used when the broker has no stored position for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DurableStart {
    /// From this offset of each matching topic (or its first message still in the log, if later).
    Offset(u64),
    /// From the first message still in the log.
    Earliest,
    /// From the next message published: nothing already in the log.
    Latest,
}

impl std::fmt::Display for DurableStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DurableStart::Offset(o) => write!(f, "{o}"),
            DurableStart::Earliest => f.write_str("earliest"),
            DurableStart::Latest => f.write_str("latest"),
        }
    }
}

impl std::str::FromStr for DurableStart {
    type Err = ProtoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_start(s.as_bytes())
    }
}

/// A durable consumer: its name and where it asks to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    pub consumer: ConsumerId,
    pub start: DurableStart,
}

/// A parsed SUBSCRIBE payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeSpec {
    pub filter: TopicFilter,
    pub group: Option<GroupId>,
    pub durable: Option<Durable>,
}

fn bad(problem: &'static str) -> ProtoError {
    ProtoError::BadSubscribe { problem }
}

fn invalid(what: &'static str) -> impl Fn(TopicError) -> ProtoError {
    move |source| ProtoError::InvalidTopic {
        what,
        reason: source,
    }
}

/// Split `topic:<filter>` off the payload, returning the filter's byte range end.
fn filter_part(payload: &Bytes) -> Result<(TopicFilter, usize), ProtoError> {
    let rest = payload
        .strip_prefix(b"topic:")
        .ok_or_else(|| bad("payload must start with \"topic:\""))?;
    let end = 6 + rest.iter().position(|&b| b == b':').unwrap_or(rest.len());
    let filter =
        TopicFilter::from_bytes(payload.slice(6..end)).map_err(invalid(TopicFilter::WHAT))?;
    Ok((filter, end))
}

impl SubscribeSpec {
    /// A copy whose names own their bytes. A parsed spec's names borrow the buffer its frame
    /// was read into (which may hold much more); one kept for as long as a subscription lives
    /// would pin that buffer all that time.
    pub fn detached(&self) -> SubscribeSpec {
        SubscribeSpec {
            filter: self.filter.detached(),
            group: self.group.as_ref().map(GroupId::detached),
            durable: self.durable.as_ref().map(|d| Durable {
                consumer: d.consumer.detached(),
                start: d.start,
            }),
        }
    }

    /// A spec for a plain subscription.
    pub fn new(filter: TopicFilter) -> Self {
        SubscribeSpec {
            filter,
            group: None,
            durable: None,
        }
    }

    /// Parse a SUBSCRIBE payload. Names borrow `payload`'s buffer.
    pub fn parse(payload: &Bytes) -> Result<SubscribeSpec, ProtoError> {
        let (filter, mut at) = filter_part(payload)?;
        let mut spec = SubscribeSpec::new(filter);
        // Each token is the bytes between two ':' separators.
        let next_token = |at: &mut usize| -> Result<Bytes, ProtoError> {
            if *at >= payload.len() {
                return Err(bad("option is missing its value"));
            }
            let start = *at + 1; // skip ':'
            let len = payload[start..]
                .iter()
                .position(|&b| b == b':')
                .unwrap_or(payload.len() - start);
            *at = start + len;
            Ok(payload.slice(start..start + len))
        };
        while at < payload.len() {
            let key = next_token(&mut at)?;
            match &key[..] {
                b"group" => {
                    if spec.group.is_some() {
                        return Err(bad("\"group\" given twice"));
                    }
                    let id = next_token(&mut at)?;
                    spec.group = Some(GroupId::from_bytes(id).map_err(invalid(GroupId::WHAT))?);
                }
                b"durable" => {
                    if spec.durable.is_some() {
                        return Err(bad("\"durable\" given twice"));
                    }
                    let id = next_token(&mut at)?;
                    let consumer = ConsumerId::from_bytes(id).map_err(invalid(ConsumerId::WHAT))?;
                    let start = parse_start(&next_token(&mut at)?)?;
                    spec.durable = Some(Durable { consumer, start });
                }
                _ => return Err(bad("unknown option (expected \"group\" or \"durable\")")),
            }
        }
        Ok(spec)
    }

    /// The payload text.
    pub fn encode(&self) -> String {
        let mut s = format!("topic:{}", self.filter);
        if let Some(g) = &self.group {
            let _ = write!(s, ":group:{g}");
        }
        if let Some(d) = &self.durable {
            let _ = write!(s, ":durable:{}:{}", d.consumer, d.start);
        }
        s
    }
}

fn parse_start(token: &[u8]) -> Result<DurableStart, ProtoError> {
    match token {
        b"earliest" => return Ok(DurableStart::Earliest),
        b"latest" => return Ok(DurableStart::Latest),
        _ => {}
    }
    if token.is_empty() || token.len() > 20 || !token.iter().all(u8::is_ascii_digit) {
        return Err(bad(
            "durable start must be a decimal offset, \"earliest\" or \"latest\"",
        ));
    }
    token
        .iter()
        .try_fold(0u64, |acc, &d| {
            acc.checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(d - b'0')))
                .ok_or_else(|| bad("durable offset does not fit in 64 bits"))
        })
        .map(DurableStart::Offset)
}

/// Parse an UNSUBSCRIBE payload: `topic:<filter>` and nothing else.
pub fn parse_unsubscribe(payload: &Bytes) -> Result<TopicFilter, ProtoError> {
    let (filter, end) = filter_part(payload)?;
    if end != payload.len() {
        return Err(bad("UNSUBSCRIBE takes only \"topic:<filter>\""));
    }
    Ok(filter)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<SubscribeSpec, ProtoError> {
        SubscribeSpec::parse(&Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn grammar() {
        let s = parse("topic:orders").expect("plain");
        assert_eq!(s.filter.as_str(), "orders");
        assert_eq!((s.group, s.durable), (None, None));

        let s = parse("topic:orders/+:group:billing").expect("group");
        assert_eq!(s.group.expect("g").as_str(), "billing");

        let s = parse("topic:a/#:group:g:durable:c1:42").expect("durable");
        let d = s.durable.clone().expect("d");
        assert_eq!(
            (d.consumer.as_str(), d.start),
            ("c1", DurableStart::Offset(42))
        );
        assert_eq!(s.encode(), "topic:a/#:group:g:durable:c1:42");

        let swapped = parse("topic:a/#:durable:c1:42:group:g").expect("either order");
        assert_eq!(swapped, s);
        assert_eq!(
            parse(&format!("topic:x:durable:c:{}", u64::MAX))
                .expect("max")
                .durable
                .map(|d| d.start),
            Some(DurableStart::Offset(u64::MAX))
        );
        for (text, start) in [
            ("earliest", DurableStart::Earliest),
            ("latest", DurableStart::Latest),
        ] {
            let s = parse(&format!("topic:a/+:durable:c:{text}")).expect("named start");
            assert_eq!(s.durable.as_ref().map(|d| d.start), Some(start));
            assert_eq!(s.encode(), format!("topic:a/+:durable:c:{text}"));
        }
    }

    #[test]
    fn errors() {
        for (input, want) in [
            ("orders", "payload must start with \"topic:\""),
            ("topic:a:group", "option is missing its value"),
            (
                "topic:a:",
                "unknown option (expected \"group\" or \"durable\")",
            ),
            (
                "topic:a:queue:x",
                "unknown option (expected \"group\" or \"durable\")",
            ),
            ("topic:a:group:g:group:h", "\"group\" given twice"),
            // A separator after the last option: an option with an empty name (§10.1).
            (
                "topic:a:group:g:",
                "unknown option (expected \"group\" or \"durable\")",
            ),
            ("topic:a:durable:c", "option is missing its value"),
            (
                "topic:a:durable:c:x1",
                "durable start must be a decimal offset, \"earliest\" or \"latest\"",
            ),
            (
                "topic:a:durable:c:-1",
                "durable start must be a decimal offset, \"earliest\" or \"latest\"",
            ),
            (
                "topic:a:durable:c:18446744073709551616",
                "durable offset does not fit in 64 bits",
            ),
        ] {
            assert_eq!(parse(input), Err(bad(want)), "{input}");
        }
        assert!(matches!(
            parse("topic:a+b"),
            Err(ProtoError::InvalidTopic { .. })
        ));
        assert!(matches!(
            parse("topic:"),
            Err(ProtoError::InvalidTopic { .. })
        ));
        assert!(matches!(
            parse("topic:a:group:"),
            Err(ProtoError::InvalidTopic {
                what: "group id",
                ..
            })
        ));
        // protocol.md §10.1: an empty start is a missing value, an empty id an invalid id.
        assert!(matches!(
            parse("topic:a:durable:c:"),
            Err(ProtoError::BadSubscribe { .. })
        ));
        assert!(matches!(
            parse("topic:a:durable::0"),
            Err(ProtoError::InvalidTopic { .. })
        ));
    }

    #[test]
    fn the_options_may_come_in_either_order() {
        let a = parse("topic:f:group:g:durable:c:0").expect("group first");
        let b = parse("topic:f:durable:c:0:group:g").expect("durable first");
        assert_eq!(a, b);
        assert_eq!(a.group.as_ref().map(|g| g.as_str()), Some("g"));
        assert!(a.durable.is_some());
    }

    #[test]
    fn unsubscribe() {
        let p = |s: &str| parse_unsubscribe(&Bytes::copy_from_slice(s.as_bytes()));
        assert_eq!(p("topic:a/+").expect("ok").as_str(), "a/+");
        assert!(p("topic:a:group:g").is_err());
        assert!(p("a").is_err());
    }
}
