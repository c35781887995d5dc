//! The subscription index: which entries' filters match a topic.
//!
//! Exact filters live in a hash map keyed by the topic bytes; wildcard filters live in a trie with
//! one node per level and dedicated `+` and `#` branches. Routing a topic costs one hash lookup
//! plus a walk over the trie paths that can match it, so it does not grow with the number of
//! subscriptions that do not match. Nodes emptied by removals are pruned, so memory follows the
//! live subscriptions.

use std::collections::HashMap;

use aqueduct_proto::{TopicFilter, TopicName};
use foldhash::fast::RandomState;

/// A map from topic filters to entries of type `V`, queried by topic name.
#[derive(Debug)]
pub struct SubscriptionIndex<V> {
    exact: HashMap<TopicName, Vec<V>, RandomState>,
    root: Node<V>,
    len: usize,
}

#[derive(Debug)]
struct Node<V> {
    children: HashMap<Box<[u8]>, Node<V>, RandomState>,
    plus: Option<Box<Node<V>>>,
    /// Entries whose filter ends with `#` right after this node's level.
    hash: Vec<V>,
    /// Entries whose filter ends at this node.
    here: Vec<V>,
}

impl<V> Default for Node<V> {
    fn default() -> Self {
        Node {
            children: HashMap::default(),
            plus: None,
            hash: Vec::new(),
            here: Vec::new(),
        }
    }
}

impl<V> Node<V> {
    fn is_empty(&self) -> bool {
        self.children.is_empty()
            && self.plus.is_none()
            && self.hash.is_empty()
            && self.here.is_empty()
    }
}

impl<V> Default for SubscriptionIndex<V> {
    fn default() -> Self {
        SubscriptionIndex {
            exact: HashMap::default(),
            root: Node::default(),
            len: 0,
        }
    }
}

fn levels(filter: &TopicFilter) -> impl Iterator<Item = &[u8]> {
    filter.as_bytes().split(|&b| b == b'/')
}

impl<V> SubscriptionIndex<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Add an entry under `filter`.
    pub fn insert(&mut self, filter: &TopicFilter, value: V) {
        self.len += 1;
        if let Some(topic) = filter.as_topic() {
            self.exact.entry(topic.detached()).or_default().push(value);
            return;
        }
        let mut node = &mut self.root;
        for level in levels(filter) {
            match level {
                b"#" => {
                    node.hash.push(value);
                    return;
                }
                b"+" => node = node.plus.get_or_insert_with(Box::default),
                _ => node = node.children.entry(level.into()).or_default(),
            }
        }
        node.here.push(value);
    }

    /// The entries stored under exactly `filter` (not the ones matching it).
    pub fn entries_mut(&mut self, filter: &TopicFilter) -> Option<&mut Vec<V>> {
        if filter.as_topic().is_some() {
            return self.exact.get_mut(filter.as_bytes());
        }
        let mut node = &mut self.root;
        for level in levels(filter) {
            match level {
                b"#" => return Some(&mut node.hash),
                b"+" => node = node.plus.as_deref_mut()?,
                _ => node = node.children.get_mut(level)?,
            }
        }
        Some(&mut node.here)
    }

    /// The entries stored under exactly `filter`.
    pub fn entries(&self, filter: &TopicFilter) -> &[V] {
        if filter.as_topic().is_some() {
            return self.exact.get(filter.as_bytes()).map_or(&[], Vec::as_slice);
        }
        let mut node = &self.root;
        for level in levels(filter) {
            let next = match level {
                b"#" => return &node.hash,
                b"+" => node.plus.as_deref(),
                _ => node.children.get(level),
            };
            match next {
                Some(n) => node = n,
                None => return &[],
            }
        }
        &node.here
    }

    /// Remove the entries under `filter` for which `remove` returns true; returns them.
    /// Emptied trie nodes and map slots are pruned.
    pub fn remove_where(
        &mut self,
        filter: &TopicFilter,
        mut remove: impl FnMut(&V) -> bool,
    ) -> Vec<V> {
        let mut removed = Vec::new();
        let mut take = |list: &mut Vec<V>| {
            let mut i = 0;
            while i < list.len() {
                if remove(&list[i]) {
                    removed.push(list.swap_remove(i));
                } else {
                    i += 1;
                }
            }
        };
        if filter.as_topic().is_some() {
            if let Some(list) = self.exact.get_mut(filter.as_bytes()) {
                take(list);
                if list.is_empty() {
                    self.exact.remove(filter.as_bytes());
                }
            }
        } else {
            let path: Vec<&[u8]> = levels(filter).collect();
            remove_in(&mut self.root, &path, &mut take);
        }
        self.len -= removed.len();
        removed
    }

    /// Call `f` for every entry whose filter matches `topic`. Allocation-free.
    pub fn for_each_match(&self, topic: &TopicName, mut f: impl FnMut(&V)) {
        if let Some(list) = self.exact.get(topic.as_bytes()) {
            list.iter().for_each(&mut f);
        }
        walk(
            &self.root,
            Some(topic.as_bytes()),
            true,
            topic.is_system(),
            &mut f,
        );
    }

    /// True if any entry's filter matches `topic`.
    pub fn has_match(&self, topic: &TopicName) -> bool {
        let mut found = false;
        self.for_each_match(topic, |_| found = true);
        found
    }

    /// Every entry, in no particular order.
    pub fn for_each(&self, mut f: impl FnMut(&V)) {
        self.exact.values().flatten().for_each(&mut f);
        each(&self.root, &mut f);
    }
}

fn each<V>(node: &Node<V>, f: &mut impl FnMut(&V)) {
    node.hash.iter().chain(&node.here).for_each(&mut *f);
    if let Some(p) = &node.plus {
        each(p, f);
    }
    for child in node.children.values() {
        each(child, f);
    }
}

/// Returns true if `node` became empty and can be pruned by its parent.
fn remove_in<V>(node: &mut Node<V>, path: &[&[u8]], take: &mut impl FnMut(&mut Vec<V>)) -> bool {
    match path.split_first() {
        None => take(&mut node.here),
        Some((&b"#", _)) => take(&mut node.hash),
        Some((&b"+", rest)) => {
            if let Some(p) = node.plus.as_deref_mut() {
                if remove_in(p, rest, take) {
                    node.plus = None;
                }
            }
        }
        Some((level, rest)) => {
            if let Some(child) = node.children.get_mut(*level) {
                if remove_in(child, rest, take) {
                    node.children.remove(*level);
                }
            }
        }
    }
    node.is_empty()
}

/// `rest` is the unconsumed part of the topic (`None` once every level is consumed).
fn walk<V>(node: &Node<V>, rest: Option<&[u8]>, first: bool, system: bool, f: &mut impl FnMut(&V)) {
    let wildcards_allowed = !(first && system);
    if wildcards_allowed {
        // `#` here matches the remaining levels, zero or more.
        node.hash.iter().for_each(&mut *f);
    }
    let Some(rest) = rest else {
        node.here.iter().for_each(&mut *f);
        return;
    };
    let (level, next) = match rest.iter().position(|&b| b == b'/') {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    if let Some(child) = node.children.get(level) {
        walk(child, next, false, system, f);
    }
    if wildcards_allowed {
        if let Some(plus) = &node.plus {
            walk(plus, next, false, system, f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(s: &str) -> TopicFilter {
        TopicFilter::try_from(s).expect("valid filter")
    }
    fn t(s: &str) -> TopicName {
        TopicName::try_from(s).expect("valid topic")
    }
    fn matching(index: &SubscriptionIndex<u32>, topic: &str) -> Vec<u32> {
        let mut out = vec![];
        index.for_each_match(&t(topic), |v| out.push(*v));
        out.sort_unstable();
        out
    }

    #[test]
    fn exact_and_wildcards() {
        let mut idx = SubscriptionIndex::new();
        idx.insert(&f("sport/tennis"), 1);
        idx.insert(&f("sport/+"), 2);
        idx.insert(&f("sport/#"), 3);
        idx.insert(&f("#"), 4);
        idx.insert(&f("+/+"), 5);
        idx.insert(&f("news"), 6);
        assert_eq!(idx.len(), 6);
        assert_eq!(matching(&idx, "sport/tennis"), [1, 2, 3, 4, 5]);
        assert_eq!(matching(&idx, "sport"), [3, 4]);
        assert_eq!(matching(&idx, "news"), [4, 6]);
        assert_eq!(matching(&idx, "__dlq__sport"), Vec::<u32>::new());
        assert_eq!(idx.entries(&f("sport/+")), &[2]);
        assert_eq!(idx.entries(&f("nothing/+")), &[] as &[u32]);
    }

    #[test]
    fn removal_prunes() {
        let mut idx = SubscriptionIndex::new();
        idx.insert(&f("a/b/c/+"), 1);
        idx.insert(&f("a/b/c/+"), 2);
        idx.insert(&f("x"), 3);
        assert_eq!(idx.remove_where(&f("a/b/c/+"), |v| *v == 1), vec![1]);
        assert_eq!(matching(&idx, "a/b/c/d"), [2]);
        assert_eq!(idx.remove_where(&f("a/b/c/+"), |_| true), vec![2]);
        assert_eq!(idx.remove_where(&f("x"), |_| true), vec![3]);
        assert!(idx.is_empty());
        assert!(idx.root.is_empty(), "trie pruned");
        assert!(idx.exact.is_empty(), "map pruned");
        assert!(idx.remove_where(&f("never/#"), |_| true).is_empty());
    }
}
