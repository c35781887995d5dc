//! ACL rules and decisions from any text: the first line is a topic or filter, every other line
//! a rule `client topic permission`. No panic in parsing or deciding; the cached publish
//! decision equals the uncached one; a filter that covers another also overlaps it.
#![no_main]
use aqueduct_core::acl::{Acl, AclCache, AclPolicy, AclRule, Action, Permission};
use aqueduct_core::matching::{covers, overlaps};
use aqueduct_proto::TopicFilter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.lines();
    let Some(first) = lines.next() else {
        return;
    };
    let rules: Vec<AclRule> = lines
        .filter_map(|l| {
            let mut f = l.split(' ');
            AclRule::parse(f.next()?, f.next()?, f.next()?).ok()
        })
        .collect();
    let Ok(filter) = TopicFilter::try_from(first) else {
        return;
    };
    for r in &rules {
        if covers(&r.topic, &filter) {
            assert!(overlaps(&r.topic, &filter), "{} covers {first} but does not overlap it", r.topic);
        }
    }
    let policy = AclPolicy {
        enabled: true,
        default: Permission::None,
        rules,
    };
    for client in ["svc-a", "anonymous", "admin-1"] {
        let sub = policy.allows(client, Action::Subscribe, &filter);
        if !filter.is_wildcard() {
            let publish = policy.allows(client, Action::Publish, &filter);
            let acl = Acl::new(policy.clone());
            let mut cache = AclCache::default();
            assert_eq!(cache.may_publish(&acl, client, filter.as_bytes()), publish);
            assert_eq!(cache.may_publish(&acl, client, filter.as_bytes()), publish);
            assert_eq!(cache.may_subscribe(&acl, client, &filter), sub);
        }
    }
});
