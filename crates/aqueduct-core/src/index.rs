//! The subscription index: which entries' filters match a topic.
//!
//! Exact filters live in a hash map keyed by the topic bytes; wildcard filters live in a trie with
//! one node per level and dedicated `+` and `#` branches. Routing a topic costs one hash lookup
//! plus a walk over the trie paths that can match it, so it does not grow with the number of
//! subscriptions that do not match. Nodes emptied by removals are pruned, so memory follows the
//! live subscriptions.
//!
//! Trie nodes are shared, copy-on-write, between an index and its clones: a clone costs the
//! root's map of references (and the exact map, copied whole), and a change to either copies
//! only the nodes on its path that the other still holds. (The cluster clones peers' wildcard
//! interest into every routing snapshot; the broker's own index is never cloned, so its nodes
//! are never copied.)

use std::collections::HashMap;
use std::sync::Arc;

use aqueduct_proto::{TopicFilter, TopicName};
use foldhash::fast::RandomState;

/// A map from topic filters to entries of type `V`, queried by topic name.
#[derive(Debug, Clone)]
pub struct SubscriptionIndex<V> {
    exact: HashMap<TopicName, Vec<V>, RandomState>,
    root: Node<V>,
    len: usize,
}

#[derive(Debug, Clone)]
struct Node<V> {
    children: HashMap<Arc<[u8]>, Arc<Node<V>>, RandomState>,
    plus: Option<Arc<Node<V>>>,
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
                _ => node.children.get(level).map(|n| &**n),
            };
            match next {
                Some(n) => node = n,
                None => return &[],
            }
        }
        &node.here
    }

    /// Call `f` for every entry whose filter matches `topic`. Allocation-free.
    pub fn for_each_match<'a>(&'a self, topic: &TopicName, f: impl FnMut(&'a V)) {
        self.for_each_match_bytes(topic.as_bytes(), f);
    }

    /// [`for_each_match`](Self::for_each_match) on the bytes of a valid topic name.
    pub fn for_each_match_bytes<'a>(&'a self, topic: &[u8], mut f: impl FnMut(&'a V)) {
        if let Some(list) = self.exact.get(topic) {
            list.iter().for_each(&mut f);
        }
        let system = crate::matching::is_system(topic);
        walk(&self.root, Some(topic), true, system, &mut f);
    }

    /// True if any entry's filter matches `topic`.
    pub fn has_match(&self, topic: &TopicName) -> bool {
        self.has_match_bytes(topic.as_bytes())
    }

    /// [`has_match`](Self::has_match) on the bytes of a valid topic name. It visits every match:
    /// a walk that could stop at the first one made the broker's lookups 9–17% slower
    /// (criterion `route_lookup_4_levels`).
    pub fn has_match_bytes(&self, topic: &[u8]) -> bool {
        let mut found = false;
        self.for_each_match_bytes(topic, |_| found = true);
        found
    }

    /// Every entry, in no particular order.
    pub fn for_each<'a>(&'a self, mut f: impl FnMut(&'a V)) {
        self.exact.values().flatten().for_each(&mut f);
        each(&self.root, &mut f);
    }
}

/// Changes: `V: Clone` because a node that a clone of the index still holds is copied before
/// it changes.
impl<V: Clone> SubscriptionIndex<V> {
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
                b"+" => node = Arc::make_mut(node.plus.get_or_insert_with(Arc::default)),
                _ => node = Arc::make_mut(node.children.entry(level.into()).or_default()),
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
                b"+" => node = Arc::make_mut(node.plus.as_mut()?),
                _ => node = Arc::make_mut(node.children.get_mut(level)?),
            }
        }
        Some(&mut node.here)
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
}

fn each<'a, V>(node: &'a Node<V>, f: &mut impl FnMut(&'a V)) {
    node.hash.iter().chain(&node.here).for_each(&mut *f);
    if let Some(p) = &node.plus {
        each(p, f);
    }
    for child in node.children.values() {
        each(child, f);
    }
}

/// Returns true if `node` became empty and can be pruned by its parent.
fn remove_in<V: Clone>(
    node: &mut Node<V>,
    path: &[&[u8]],
    take: &mut impl FnMut(&mut Vec<V>),
) -> bool {
    match path.split_first() {
        None => take(&mut node.here),
        Some((&b"#", _)) => take(&mut node.hash),
        Some((&b"+", rest)) => {
            if let Some(p) = node.plus.as_mut() {
                if remove_in(Arc::make_mut(p), rest, take) {
                    node.plus = None;
                }
            }
        }
        Some((level, rest)) => {
            if let Some(child) = node.children.get_mut(*level) {
                if remove_in(Arc::make_mut(child), rest, take) {
                    node.children.remove(*level);
                }
            }
        }
    }
    node.is_empty()
}

/// `rest` is the unconsumed part of the topic (`None` once every level is consumed).
fn walk<'a, V>(
    node: &'a Node<V>,
    rest: Option<&[u8]>,
    first: bool,
    system: bool,
    f: &mut impl FnMut(&'a V),
) {
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

    /// Nodes are shared between an index and its clone until one of them changes: a change to
    /// either is never seen by the other.
    #[test]
    fn a_clone_and_its_original_change_apart() {
        let mut original = SubscriptionIndex::new();
        original.insert(&f("a/+/c"), 1);
        original.insert(&f("a/+/c"), 2);
        original.insert(&f("a/b/#"), 3);
        original.insert(&f("a/b/c"), 4);
        let mut copy = original.clone();
        copy.insert(&f("a/+/c"), 5);
        assert_eq!(original.remove_where(&f("a/b/#"), |_| true), vec![3]);
        if let Some(list) = copy.entries_mut(&f("a/+/c")) {
            list.retain(|v| *v != 1);
        }
        assert_eq!(matching(&original, "a/b/c"), [1, 2, 4]);
        assert_eq!(matching(&copy, "a/b/c"), [2, 3, 4, 5]);
        assert_eq!(original.entries(&f("a/+/c")), &[1, 2]);
        drop(copy);
        assert_eq!(original.remove_where(&f("a/+/c"), |_| true).len(), 2);
        assert_eq!(matching(&original, "a/b/c"), [4]);
        assert!(original.root.is_empty(), "trie pruned");
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
