//! Model-based test: the subscription index must return exactly what checking every filter with
//! the reference matcher returns, over random subscribe / unsubscribe / publish sequences.

use std::collections::BTreeSet;

use aqueduct_core::index::SubscriptionIndex;
use aqueduct_core::matching::matches;
use aqueduct_proto::{TopicFilter, TopicName};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Subscribe(String, u32),
    Unsubscribe(String, u32),
    Publish(String),
}

const LEVELS: &[&str] = &["a", "b", "", "$s", "__d", "sport"];

fn topic() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(LEVELS), 1..5)
        .prop_map(|l| l.join("/"))
        .prop_filter("non-empty", |t| !t.is_empty())
}

fn filter() -> impl Strategy<Value = String> {
    let level = prop_oneof![4 => prop::sample::select(LEVELS).prop_map(String::from), 2 => Just("+".to_string())];
    (prop::collection::vec(level, 1..5), any::<bool>())
        .prop_map(|(mut l, hash)| {
            if hash {
                l.push("#".into());
            }
            l.join("/")
        })
        .prop_filter("non-empty", |f| !f.is_empty())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (filter(), 0u32..6).prop_map(|(f, id)| Op::Subscribe(f, id)),
        1 => (filter(), 0u32..6).prop_map(|(f, id)| Op::Unsubscribe(f, id)),
        3 => topic().prop_map(Op::Publish),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn index_agrees_with_naive_model(ops in prop::collection::vec(op(), 1..60)) {
        let mut index = SubscriptionIndex::new();
        // The model: a flat list of (filter, id).
        let mut model: Vec<(TopicFilter, u32)> = Vec::new();
        for op in ops {
            match op {
                Op::Subscribe(f, id) => {
                    let f = TopicFilter::try_from(f.as_str()).expect("generated filters are valid");
                    index.insert(&f, id);
                    model.push((f, id));
                }
                Op::Unsubscribe(f, id) => {
                    let f = TopicFilter::try_from(f.as_str()).expect("valid");
                    let removed = index.remove_where(&f, |v| *v == id);
                    let before = model.len();
                    model.retain(|(mf, mid)| !(mf == &f && *mid == id));
                    prop_assert_eq!(removed.len(), before - model.len());
                }
                Op::Publish(t) => {
                    let t = TopicName::try_from(t.as_str()).expect("generated topics are valid");
                    let mut got = Vec::new();
                    index.for_each_match(&t, |v| got.push(*v));
                    got.sort_unstable();
                    let mut want: Vec<u32> = model.iter().filter(|(f, _)| matches(f, &t)).map(|(_, id)| *id).collect();
                    want.sort_unstable();
                    prop_assert_eq!(index.has_match(&t), !want.is_empty(), "topic {}", t);
                    prop_assert_eq!(got, want, "topic {}", t);
                }
            }
            prop_assert_eq!(index.len(), model.len());
        }
        let mut all = BTreeSet::new();
        index.for_each(|v| { all.insert(*v); });
        let model_ids: BTreeSet<u32> = model.iter().map(|(_, id)| *id).collect();
        prop_assert_eq!(all, model_ids);
    }
}

/// The obvious split-based statement of the MQTT rules, to check the optimised matcher against.
fn reference_matches(filter: &str, topic: &str) -> bool {
    let system = topic.starts_with('$') || topic.starts_with("__");
    let first = filter.split('/').next().unwrap_or("");
    if system && (first == "+" || first == "#") {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn matcher_agrees_with_reference(f in filter(), t in topic()) {
        let filter = TopicFilter::try_from(f.as_str()).expect("valid");
        let name = TopicName::try_from(t.as_str()).expect("valid");
        prop_assert_eq!(matches(&filter, &name), reference_matches(&f, &t), "{} vs {}", f, t);
    }
}
