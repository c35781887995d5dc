//! ACL decisions checked against a brute-force model of the documented precedence
//! (crate docs of `aqueduct_core::acl`): every applicable rule is collected, the most specific
//! ones decide, ties are intersected, nothing applies → the default. Subscriptions are checked
//! topic by topic over a small universe of topics.

use aqueduct_core::acl::{AclPolicy, AclRule, Action, Permission};
use aqueduct_core::matching::{
    covers, covers_any, deny_reaches, matches, matches_any_bytes, overlaps,
};
use aqueduct_proto::{TopicFilter, TopicName};
use proptest::prelude::*;

const CLIENTS: &[&str] = &["svc-a", "svc-b", "admin-1", "anonymous"];
const PATTERNS: &[&str] = &[
    "svc-a",
    "svc-b",
    "admin-1",
    "anonymous",
    "svc-*",
    "svc-a*",
    "admin-*",
    "*",
];
/// Topic levels: the filters' literals, the empty level, and one no filter names (so that a
/// wildcard always matches something no literal rule does).
const LEVELS: &[&str] = &["a", "b", "", "c"];

/// Every topic of one to four levels (one more than a generated filter's literal levels) over
/// `LEVELS`, under a first level from `LEVELS`, `__x` or `$s` (system topics).
fn universe() -> Vec<TopicName> {
    let mut names: Vec<String> = Vec::new();
    let mut frontier: Vec<String> = LEVELS.iter().map(|l| l.to_string()).collect();
    frontier.push("__x".into());
    frontier.push("$s".into());
    for _ in 0..4 {
        names.extend(frontier.iter().cloned());
        frontier = frontier
            .iter()
            .flat_map(|p| LEVELS.iter().map(move |l| format!("{p}/{l}")))
            .collect();
    }
    names
        .into_iter()
        .filter_map(|n| TopicName::try_from(n.as_str()).ok())
        .collect()
}

fn filter_strategy() -> impl Strategy<Value = String> {
    let first = prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("+".to_string()),
        Just("__x".to_string()),
        Just("$s".to_string()),
    ];
    let rest = prop::collection::vec(prop_oneof![Just("a"), Just("b"), Just("+"), Just("")], 0..3);
    (first, rest, any::<bool>()).prop_map(|(first, rest, hash)| {
        let mut f = first;
        for l in rest {
            f.push('/');
            f.push_str(l);
        }
        if hash {
            f.push_str("/#");
        }
        if f == "+/#" || f == "a/#" {
            // Keep some bare `#` too.
            return if f.starts_with('+') { "#".into() } else { f };
        }
        f
    })
}

fn rule_strategy() -> impl Strategy<Value = AclRule> {
    (
        prop::sample::select(PATTERNS),
        filter_strategy(),
        prop::sample::select(&["none", "publish", "subscribe", "all"][..]),
    )
        .prop_map(|(c, t, p)| AclRule::parse(c, &t, p).expect("generated rules are valid"))
}

fn policy_strategy() -> impl Strategy<Value = AclPolicy> {
    (
        prop::sample::select(&["none", "publish", "subscribe", "all"][..]),
        prop::collection::vec(rule_strategy(), 0..12),
    )
        .prop_map(|(d, rules)| AclPolicy {
            enabled: true,
            default: d.parse().expect("permission"),
            rules,
        })
}

/// The model's specificity, computed from the text.
fn key(r: &AclRule) -> (bool, usize, bool, usize, bool) {
    let c = r.client.as_str();
    let (exact, prefix) = match c.strip_suffix('*') {
        Some(p) => (false, p.len()),
        None => (true, c.len()),
    };
    let t = r.topic.as_str();
    let literal = t.split('/').filter(|l| *l != "+" && *l != "#").count();
    (
        exact,
        prefix,
        !t.contains(['+', '#']),
        literal,
        !t.ends_with('#'),
    )
}

fn client_matches(pattern: &str, client: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(p) => client.starts_with(p),
        None => pattern == client,
    }
}

fn bits(p: Permission, action: Action) -> bool {
    matches!(
        (p, action),
        (Permission::All, _)
            | (Permission::Publish, Action::Publish)
            | (Permission::Subscribe, Action::Subscribe)
    )
}

/// A filter whose first level names system topics (`$…`, `__…`).
fn is_system_filter(filter: &TopicFilter) -> bool {
    let b = filter.as_bytes();
    b.first() == Some(&b'$') || b.starts_with(b"__")
}

/// Does rule `r`'s filter reach `topic`? A deny (`none`) reaches system topics through a
/// leading wildcard too; other rules do not (the MQTT rule).
fn reaches(r: &AclRule, topic: &TopicName) -> bool {
    match r.permission {
        Permission::None => matches_any_bytes(r.topic.as_bytes(), topic.as_bytes()),
        _ => matches(&r.topic, topic),
    }
}

/// The model: may `client` do `action` on the single topic `topic`?
fn model(policy: &AclPolicy, client: &str, action: Action, topic: &TopicName) -> bool {
    let applicable: Vec<&AclRule> = policy
        .rules
        .iter()
        .filter(|r| client_matches(r.client.as_str(), client) && reaches(r, topic))
        .collect();
    let Some(best) = applicable.iter().map(|r| key(r)).max() else {
        // System topics are opened only by rules that name them, never by the default.
        return !topic.is_system() && bits(policy.default, action);
    };
    applicable
        .iter()
        .filter(|r| key(r) == best)
        .all(|r| bits(r.permission, action))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn publish_decisions_match_the_model(policy in policy_strategy()) {
        for client in CLIENTS {
            for topic in universe() {
                let want = model(&policy, client, Action::Publish, &topic);
                let got = policy.allows(client, Action::Publish, &TopicFilter::from(topic.clone()));
                prop_assert_eq!(got, want, "client {} topic {} policy {:?}", client, topic, policy);
            }
        }
    }

    #[test]
    fn subscribe_decisions_are_sound_and_refuse_only_in_the_documented_corner(
        policy in policy_strategy(),
        filters in prop::collection::vec(filter_strategy(), 1..8),
    ) {
        let topics = universe();
        for client in CLIENTS {
            for f in &filters {
                let filter = TopicFilter::try_from(f.as_str()).expect("valid");
                let want = topics
                    .iter()
                    .filter(|t| matches(&filter, t))
                    .all(|t| model(&policy, client, Action::Subscribe, t));
                let got = policy.allows(client, Action::Subscribe, &filter);
                if got {
                    prop_assert!(want, "allowed {} for {} but a topic is refused: {:?}", f, client, policy);
                } else if want {
                    // Only the two documented corners may cause a conservative refusal: the rules
                    // covering the whole filter (or the default) refuse, though rules covering
                    // parts of it allow every topic; or a rule covering part of it refuses.
                    let mine: Vec<&AclRule> = policy
                        .rules
                        .iter()
                        .filter(|r| client_matches(r.client.as_str(), client))
                        .collect();
                    let covers_it = |r: &AclRule| match r.permission {
                        Permission::None => covers_any(&r.topic, &filter),
                        _ => covers(&r.topic, &filter),
                    };
                    let covering: Vec<&&AclRule> =
                        mine.iter().filter(|r| covers_it(r)).collect();
                    let best = covering.iter().map(|r| key(r)).max();
                    let whole = match best {
                        Some(best) => covering
                            .iter()
                            .filter(|r| key(r) == best)
                            .all(|r| bits(r.permission, Action::Subscribe)),
                        None => {
                            !is_system_filter(&filter) && bits(policy.default, Action::Subscribe)
                        }
                    };
                    // Only partial refusals at least as specific as the covering rules count.
                    let partial_refusal = mine.iter().any(|r| {
                        best.is_none_or(|b| key(r) >= b)
                            && !bits(r.permission, Action::Subscribe)
                            && match r.permission {
                                Permission::None => deny_reaches(&r.topic, &filter),
                                _ => overlaps(&r.topic, &filter),
                            }
                            && !covers_it(r)
                    });
                    let corner = !whole || partial_refusal;
                    prop_assert!(corner, "refused {} for {} without cause: {:?}", f, client, policy);
                }
                if !filter.is_wildcard() {
                    prop_assert_eq!(got, want, "exact filter {} for {}", f, client);
                }
            }
        }
    }

    /// `covers` and `overlaps` agree with matching over the universe.
    #[test]
    fn filter_relations_agree_with_matching(a in filter_strategy(), b in filter_strategy()) {
        let (fa, fb) = (
            TopicFilter::try_from(a.as_str()).expect("valid"),
            TopicFilter::try_from(b.as_str()).expect("valid"),
        );
        let topics = universe();
        let both = topics.iter().any(|t| matches(&fa, t) && matches(&fb, t));
        prop_assert_eq!(overlaps(&fa, &fb), both, "{} overlaps {}", a, b);
        if covers(&fa, &fb) {
            prop_assert!(topics.iter().filter(|t| matches(&fb, t)).all(|t| matches(&fa, t)));
        }
    }
}
