//! Access control: which client may publish to or subscribe to which topics.
//!
//! A policy is a default permission and a list of rules `client × topic filter × permission`
//! (the seed's `acl.rules`). Decisions, for a client `C` and an action on a topic `T`:
//!
//! 1. The rules that *apply* are those whose client pattern matches `C` (an exact id, or a prefix
//!    ending in `*`: `admin-*`, `*`) and whose topic filter matches `T` (MQTT rules: `+`, `#`,
//!    and a filter starting with a wildcard never matches a system topic, `$…` or `__…`,
//!    except in a rule whose permission is `none`: a deny reaches everything it names, so
//!    `{client: bob, topic: "#", permission: none}` shuts `bob` out of the system topics too).
//! 2. Of those, only the **most specific** decide. Specificity compares, in this order: an exact
//!    client id over a pattern; a longer pattern prefix over a shorter one; an exact topic over a
//!    filter; more literal levels over fewer; a filter without `#` over one with it.
//! 3. Equally specific rules are combined by intersection: **deny beats allow** among them.
//! 4. A rule's permission is everything the client may do on those topics: `publish` allows
//!    publishing and refuses subscribing; `all` (or `pubsub`) allows both; `none` (or `deny`)
//!    neither.
//! 5. No rule applies: the policy's default.
//!
//! A subscription to a filter `F` needs subscribing to be allowed on every topic `F` can match.
//! The broker decides it from two checks: (a) the rules that cover all of `F` (every topic `F`
//! matches, they match), most specific first and intersected as above, or the default if none
//! does, allow subscribing; and (b) no rule at least as specific as those, which matches only
//! part of `F`'s topics, refuses subscribing. This never allows a topic the rules refuse. It
//! errs towards refusing in two corners: when `F`'s topics are allowed piecewise by rules none
//! of which covers all of `F` (`a/+` and `a/+/+/#` do not allow `a/+/#`), and when a partial
//! refusal is itself overridden by a still more specific rule. Subscribing to the narrower
//! filters works in both.
//!
//! [`Acl`] holds the policy behind an atomic pointer swap: readers never lock and a change is
//! visible to every check that starts after [`Acl::replace`] returns. [`AclCache`] is a
//! per-stream cache of publish decisions: one atomic load and one hash lookup per publish.

use std::cmp::Ordering as CmpOrdering;
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use aqueduct_proto::TopicFilter;
use arc_swap::ArcSwap;
use foldhash::fast::RandomState;

use crate::matching::{
    covers, covers_any, deny_reaches, is_system, matches_any_bytes, matches_bytes, overlaps,
};

/// The client id of a connection without a client certificate.
pub const ANONYMOUS: &str = "anonymous";

/// What a rule (or the default) allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permission {
    None,
    Publish,
    Subscribe,
    All,
}

impl Permission {
    const PUBLISH: u8 = 1;
    const SUBSCRIBE: u8 = 2;

    fn bits(self) -> u8 {
        match self {
            Permission::None => 0,
            Permission::Publish => Self::PUBLISH,
            Permission::Subscribe => Self::SUBSCRIBE,
            Permission::All => Self::PUBLISH | Self::SUBSCRIBE,
        }
    }

    fn from_bits(bits: u8) -> Permission {
        match bits & 3 {
            0 => Permission::None,
            1 => Permission::Publish,
            2 => Permission::Subscribe,
            _ => Permission::All,
        }
    }

    /// Does this permission allow `action`?
    pub fn allows(self, action: Action) -> bool {
        self.bits() & action.bit() != 0
    }

    /// The canonical name (`none`, `publish`, `subscribe`, `all`).
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::None => "none",
            Permission::Publish => "publish",
            Permission::Subscribe => "subscribe",
            Permission::All => "all",
        }
    }
}

impl FromStr for Permission {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "deny" => Ok(Permission::None),
            "publish" | "pub" => Ok(Permission::Publish),
            "subscribe" | "sub" => Ok(Permission::Subscribe),
            "all" | "pubsub" => Ok(Permission::All),
            other => Err(format!(
                "unknown permission {other:?} (expected publish, subscribe, all (or pubsub), \
                 none (or deny))"
            )),
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a client wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Publish,
    Subscribe,
}

impl Action {
    fn bit(self) -> u8 {
        match self {
            Action::Publish => Permission::PUBLISH,
            Action::Subscribe => Permission::SUBSCRIBE,
        }
    }

    /// `publish` or `subscribe` (metric labels, messages).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Publish => "publish",
            Action::Subscribe => "subscribe",
        }
    }
}

/// A rule's client: an exact id, or a prefix pattern ending in `*` (`*` alone: everyone).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClientPattern {
    text: String,
    prefix: bool,
}

impl ClientPattern {
    /// Does the pattern name `client`?
    pub fn matches(&self, client: &str) -> bool {
        if self.prefix {
            client.starts_with(&self.text[..self.text.len() - 1])
        } else {
            self.text == client
        }
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// (exact, prefix length): larger is more specific.
    fn specificity(&self) -> (bool, usize) {
        if self.prefix {
            (false, self.text.len() - 1)
        } else {
            (true, self.text.len())
        }
    }
}

impl FromStr for ClientPattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("empty client (use \"*\" for every client)".into());
        }
        let stars = s.matches('*').count();
        if stars > 1 || (stars == 1 && !s.ends_with('*')) {
            return Err(format!(
                "{s:?}: `*` may only end a client pattern (e.g. \"admin-*\" or \"*\")"
            ));
        }
        Ok(ClientPattern {
            text: s.to_string(),
            prefix: stars == 1,
        })
    }
}

impl fmt::Display for ClientPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// One rule.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AclRule {
    pub client: ClientPattern,
    pub topic: TopicFilter,
    pub permission: Permission,
}

/// Why a rule was refused: which field, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct RuleError {
    /// `client`, `topic` or `permission`.
    pub field: &'static str,
    pub problem: String,
}

impl AclRule {
    /// Parse the three fields as the config file and the admin API give them.
    pub fn parse(client: &str, topic: &str, permission: &str) -> Result<AclRule, RuleError> {
        let err = |field, problem| RuleError { field, problem };
        Ok(AclRule {
            client: client.parse().map_err(|e| err("client", e))?,
            topic: TopicFilter::try_from(topic.trim())
                .map_err(|e| err("topic", format!("{topic:?}: {e}")))?,
            permission: permission.parse().map_err(|e| err("permission", e))?,
        })
    }

    fn specificity(&self) -> Specificity {
        let (client_exact, client_prefix) = self.client.specificity();
        let f = self.topic.as_bytes();
        let levels = f.split(|&b| b == b'/');
        Specificity {
            client_exact,
            client_prefix,
            topic_exact: !self.topic.is_wildcard(),
            literal_levels: levels.filter(|l| *l != b"+" && *l != b"#").count(),
            no_multi: !f.ends_with(b"#"),
        }
    }
}

impl fmt::Display for AclRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.client, self.topic, self.permission)
    }
}

/// How specific a rule is; compared field by field, larger wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Specificity {
    client_exact: bool,
    client_prefix: usize,
    topic_exact: bool,
    literal_levels: usize,
    no_multi: bool,
}

/// A whole policy: on/off, the default and the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AclPolicy {
    /// Off: everything is allowed.
    pub enabled: bool,
    pub default: Permission,
    pub rules: Vec<AclRule>,
}

impl Default for AclPolicy {
    /// Access control off.
    fn default() -> Self {
        AclPolicy {
            enabled: false,
            default: Permission::None,
            rules: Vec::new(),
        }
    }
}

impl AclPolicy {
    /// The rules that name `client`, ready for its decisions.
    pub fn for_client(&self, client: &str) -> ClientRules {
        let mut rules: Vec<(Specificity, TopicFilter, Permission)> = self
            .rules
            .iter()
            .filter(|r| r.client.matches(client))
            .map(|r| (r.specificity(), r.topic.clone(), r.permission))
            .collect();
        rules.sort_by_key(|r| std::cmp::Reverse(r.0));
        ClientRules {
            enabled: self.enabled,
            default: self.default,
            rules,
        }
    }

    /// One decision, without a cache (admin tools, tests).
    pub fn allows(&self, client: &str, action: Action, topic: &TopicFilter) -> bool {
        let rules = self.for_client(client);
        match action {
            Action::Publish => rules.may_publish(topic.as_bytes()),
            Action::Subscribe => rules.may_subscribe(topic),
        }
    }
}

/// The rules of a policy that name one client, most specific first.
#[derive(Debug, Clone)]
pub struct ClientRules {
    enabled: bool,
    default: Permission,
    rules: Vec<(Specificity, TopicFilter, Permission)>,
}

impl Default for ClientRules {
    fn default() -> Self {
        AclPolicy::default().for_client("")
    }
}

impl ClientRules {
    /// The permission on the topics `applies` selects: the most specific rules, intersected.
    /// Returns the deciding specificity too (`None`: no rule applied). No rule applied: the
    /// default, except on system topics (`system`: the topic, or the filter's first level,
    /// starts with `$` or `__`), which only a rule naming them opens.
    fn decide(
        &self,
        system: bool,
        mut applies: impl FnMut(&TopicFilter, Permission) -> bool,
    ) -> (Permission, Option<Specificity>) {
        let mut best: Option<(Specificity, u8)> = None;
        for (spec, filter, perm) in &self.rules {
            if let Some((b, _)) = best {
                if spec.cmp(&b) == CmpOrdering::Less {
                    break;
                }
            }
            if applies(filter, *perm) {
                best = Some(match best {
                    Some((b, bits)) => (b, bits & perm.bits()),
                    None => (*spec, perm.bits()),
                });
            }
        }
        match best {
            Some((spec, bits)) => (Permission::from_bits(bits), Some(spec)),
            None if system => (Permission::None, None),
            None => (self.default, None),
        }
    }

    /// May the client publish to `topic` (a valid topic name's bytes)?
    pub fn may_publish(&self, topic: &[u8]) -> bool {
        if !self.enabled {
            return true;
        }
        let (perm, _) = self.decide(is_system(topic), |f, p| match p {
            Permission::None => matches_any_bytes(f.as_bytes(), topic),
            _ => matches_bytes(f.as_bytes(), topic),
        });
        perm.allows(Action::Publish)
    }

    /// May the client subscribe to `filter` (see the module docs for filters)?
    pub fn may_subscribe(&self, filter: &TopicFilter) -> bool {
        if !self.enabled {
            return true;
        }
        let (perm, spec) = self.decide(is_system(filter.as_bytes()), |f, p| match p {
            Permission::None => covers_any(f, filter),
            _ => covers(f, filter),
        });
        if !perm.allows(Action::Subscribe) {
            return false;
        }
        // A rule as specific as the deciding ones that refuses part of the filter's topics.
        !self.rules.iter().any(|(s, f, p)| {
            spec.is_none_or(|d| *s >= d)
                && !p.allows(Action::Subscribe)
                && match p {
                    Permission::None => deny_reaches(f, filter) && !covers_any(f, filter),
                    _ => overlaps(f, filter) && !covers(f, filter),
                }
        })
    }
}

/// The live policy, swapped atomically.
#[derive(Debug)]
pub struct Acl {
    policy: ArcSwap<AclPolicy>,
    /// Bumped after every swap: caches compare it to know they are stale.
    generation: AtomicU64,
    /// Held by every change, and by whoever must act on one policy while no change lands (see
    /// [`Acl::hold_changes`]).
    changes: Mutex<()>,
    /// How many wait for `changes` now.
    waiting: AtomicUsize,
}

impl Acl {
    pub fn new(policy: AclPolicy) -> Acl {
        Acl {
            policy: ArcSwap::from_pointee(policy),
            generation: AtomicU64::new(1),
            changes: Mutex::new(()),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Keep the policy as it is until the guard is dropped: [`Acl::replace`] and [`Acl::update`]
    /// wait. For work that acts on the live policy (closing the subscriptions it refuses): two
    /// such walks then run one after the other, each under the policy live during it, so an
    /// older policy's walk cannot close what a newer one allows. Do not change the policy while
    /// holding it (that would wait forever).
    pub fn hold_changes(&self) -> MutexGuard<'_, ()> {
        if let Some(free) = self.try_hold_changes() {
            return free;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let held = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        held
    }

    /// How many changes and walks wait for the one holding the policy now (see
    /// [`Acl::hold_changes`]).
    pub fn waiting_for_changes(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// [`Acl::hold_changes`] if no change or walk holds it now; `None` (at once) if one does.
    pub fn try_hold_changes(&self) -> Option<MutexGuard<'_, ()>> {
        match self.changes.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The current policy.
    pub fn policy(&self) -> Arc<AclPolicy> {
        self.policy.load_full()
    }

    /// Is access control on (a quick check; the policy may change right after)?
    pub fn enabled(&self) -> bool {
        self.policy.load().enabled
    }

    /// Install `policy`. Every check that starts after this returns uses it.
    pub fn replace(&self, policy: AclPolicy) {
        let _changing = self.hold_changes();
        self.policy.store(Arc::new(policy));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Change the policy with `f` (copy-on-write; concurrent updates are applied one after the
    /// other, none lost). Returns what `f` returned.
    pub fn update<T>(&self, f: impl FnOnce(&mut AclPolicy) -> T) -> T {
        let _changing = self.hold_changes();
        let mut next = AclPolicy::clone(&self.policy.load());
        let out = f(&mut next);
        self.policy.store(Arc::new(next));
        self.generation.fetch_add(1, Ordering::AcqRel);
        out
    }

    /// Changes so far (for caches).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

impl Default for Acl {
    fn default() -> Self {
        Acl::new(AclPolicy::default())
    }
}

/// Topics a client may publish to, cached (bounded), refreshed when the policy changes. Only
/// allowances are kept: a refused publish is answered with an ERROR anyway, and caching
/// refusals would let a client without rights pin memory with made-up topic names.
#[derive(Debug, Default)]
pub struct AclCache {
    generation: u64,
    rules: ClientRules,
    publish: HashSet<Box<[u8]>, RandomState>,
    /// Bytes of the topic names in `publish`.
    bytes: usize,
}

/// Topics an [`AclCache`] remembers before it starts over.
pub const ACL_CACHE_TOPICS: usize = 4096;
/// Bytes of topic names an [`AclCache`] holds before it starts over (each stream has one).
pub const ACL_CACHE_BYTES: usize = 64 * 1024;

impl AclCache {
    fn refresh(&mut self, acl: &Acl, client: &str) {
        let generation = acl.generation();
        if generation != self.generation {
            // Policy first, then the generation it belongs to at least.
            self.rules = acl.policy().for_client(client);
            self.publish.clear();
            self.bytes = 0;
            self.generation = generation;
        }
    }

    /// Is access control on for `client` under the current policy (one atomic load in steady
    /// state)? When it is off, callers can skip walking the topics of a frame at all.
    pub fn enabled(&mut self, acl: &Acl, client: &str) -> bool {
        self.refresh(acl, client);
        self.rules.enabled
    }

    /// May `client` publish to `topic` under the current policy? In steady state one atomic
    /// load and one hash lookup; no allocation.
    pub fn may_publish(&mut self, acl: &Acl, client: &str, topic: &[u8]) -> bool {
        self.refresh(acl, client);
        if !self.rules.enabled {
            return true;
        }
        if self.publish.contains(topic) {
            return true;
        }
        let allowed = self.rules.may_publish(topic);
        if allowed {
            if self.publish.len() >= ACL_CACHE_TOPICS || self.bytes + topic.len() > ACL_CACHE_BYTES
            {
                self.publish.clear();
                self.bytes = 0;
            }
            self.bytes += topic.len();
            self.publish.insert(topic.into());
        }
        allowed
    }

    /// May `client` subscribe to `filter` under the current policy? (Not cached: subscribing
    /// is rare.)
    pub fn may_subscribe(&mut self, acl: &Acl, client: &str, filter: &TopicFilter) -> bool {
        self.refresh(acl, client);
        self.rules.may_subscribe(filter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(default: &str, rules: &[(&str, &str, &str)]) -> AclPolicy {
        AclPolicy {
            enabled: true,
            default: default.parse().expect("permission"),
            rules: rules
                .iter()
                .map(|(c, t, p)| AclRule::parse(c, t, p).expect("rule"))
                .collect(),
        }
    }

    fn f(s: &str) -> TopicFilter {
        TopicFilter::try_from(s).expect("filter")
    }

    /// A deny of system topics alone does not refuse a filter starting with a wildcard, which
    /// matches no system topic: subscribing to `#` or `+/x` was refused beside
    /// `{*, "$SYS/#", none}`, since the two filters overlap when system topics are counted.
    #[test]
    fn a_deny_of_system_topics_leaves_wildcard_filters_alone() {
        let p = policy("none", &[("*", "#", "all"), ("*", "$SYS/#", "none")]);
        for ok in ["#", "+/x", "+", "a/#"] {
            assert!(p.allows("x", Action::Subscribe, &f(ok)), "{ok}");
        }
        for refused in ["$SYS/#", "$SYS/up"] {
            assert!(!p.allows("x", Action::Subscribe, &f(refused)), "{refused}");
        }
        // A deny reaching every topic still refuses them.
        let p = policy("none", &[("*", "#", "all"), ("*", "a/#", "none")]);
        assert!(!p.allows("x", Action::Subscribe, &f("#")));
        assert!(!p.allows("x", Action::Subscribe, &f("+/b")));
    }

    /// While a walk holds the policy steady, changes wait for it; both kinds of change hold the
    /// lock. Without it an older policy's walk could close what a newer one allows.
    #[test]
    fn changes_wait_while_the_policy_is_held() {
        let acl = Arc::new(Acl::new(policy("all", &[])));
        // update holds the lock while it changes the policy.
        let held_during_update = acl.update(|p| {
            p.default = Permission::None;
            acl.changes.try_lock().is_err()
        });
        assert!(held_during_update);
        let before = acl.generation();
        assert!(acl.try_hold_changes().is_some(), "free: taken at once");
        let steady = acl.hold_changes();
        assert!(acl.try_hold_changes().is_none(), "held: refused at once");
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let changer = {
            let acl = acl.clone();
            std::thread::spawn(move || {
                acl.replace(policy("publish", &[]));
                done_tx.send(()).expect("send");
            })
        };
        // The change waits (counted as waiting) and nothing lands while held.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while acl.waiting_for_changes() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the change never waited"
            );
            std::thread::yield_now();
        }
        assert!(done_rx.try_recv().is_err());
        assert_eq!(acl.generation(), before);
        assert_eq!(acl.policy().default, Permission::None);
        drop(steady);
        done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the change lands once released");
        changer.join().expect("changer");
        assert_eq!(acl.waiting_for_changes(), 0);
        assert_eq!(acl.policy().default, Permission::Publish);
        assert_eq!(acl.generation(), before + 1);
    }

    /// `acl.default` does not open system topics: a client may not forge dead letters or read
    /// `$…` topics because the default is permissive; only a rule naming them opens them.
    #[test]
    fn the_default_does_not_open_system_topics() {
        let p = policy("all", &[("ops", "__dlq__orders/#", "subscribe")]);
        for action in [Action::Publish, Action::Subscribe] {
            assert!(!p.allows("x", action, &f("__dlq__orders")), "{action:?}");
            assert!(!p.allows("x", action, &f("$SYS/#")), "{action:?}");
        }
        assert!(p.allows("x", Action::Publish, &f("orders")));
        assert!(
            p.allows("x", Action::Subscribe, &f("#")),
            "`#` never matches them"
        );
        assert!(p.allows("ops", Action::Subscribe, &f("__dlq__orders")));
        assert!(!p.allows("ops", Action::Publish, &f("__dlq__orders")));
    }

    #[test]
    fn seed_example() {
        let p = policy("none", &[("service-a", "orders", "publish")]);
        assert!(p.allows("service-a", Action::Publish, &f("orders")));
        assert!(!p.allows("service-a", Action::Subscribe, &f("orders")));
        assert!(!p.allows("service-b", Action::Publish, &f("orders")));
        assert!(!p.allows("service-a", Action::Publish, &f("orders/eu")));
    }

    #[test]
    fn most_specific_wins_and_deny_beats_allow_among_equals() {
        let p = policy(
            "none",
            &[
                ("*", "#", "subscribe"),
                ("service-*", "orders/#", "all"),
                ("service-b", "orders/#", "none"),
                ("service-c", "orders/+", "publish"),
                ("service-c", "+/eu", "all"),
            ],
        );
        // The exact client beats the pattern.
        assert!(!p.allows("service-b", Action::Publish, &f("orders/eu")));
        assert!(p.allows("service-a", Action::Publish, &f("orders/eu")));
        // Client specificity before topic specificity: `service-*` beats `*` everywhere.
        assert!(p.allows("service-a", Action::Subscribe, &f("orders/eu")));
        assert!(p.allows("guest", Action::Subscribe, &f("orders/eu")));
        assert!(!p.allows("guest", Action::Publish, &f("orders/eu")));
        // Equal specificity (one literal level, no `#`): intersection.
        assert!(p.allows("service-c", Action::Publish, &f("orders/eu")));
        assert!(!p.allows("service-c", Action::Subscribe, &f("orders/eu")));
        assert!(p.allows("service-c", Action::Subscribe, &f("stock/eu")));
    }

    #[test]
    fn subscriptions_need_every_topic() {
        let p = policy(
            "none",
            &[
                ("*", "orders/#", "subscribe"),
                ("*", "orders/secret", "none"),
            ],
        );
        assert!(p.allows("x", Action::Subscribe, &f("orders/eu")));
        assert!(!p.allows("x", Action::Subscribe, &f("orders/secret")));
        assert!(!p.allows("x", Action::Subscribe, &f("orders/#")));
        assert!(!p.allows("x", Action::Subscribe, &f("orders/+")));
        assert!(p.allows("x", Action::Subscribe, &f("orders/+/x")));
        // Default `none` and only a partial allow: refused.
        assert!(!p.allows("x", Action::Subscribe, &f("#")));
    }

    #[test]
    fn system_topics_are_not_matched_by_leading_wildcards() {
        let p = policy(
            "none",
            &[("*", "#", "all"), ("ops-*", "__dlq__orders", "subscribe")],
        );
        assert!(!p.allows("app", Action::Subscribe, &f("__dlq__orders")));
        assert!(!p.allows("app", Action::Publish, &f("$SYS/x")));
        assert!(p.allows("ops-1", Action::Subscribe, &f("__dlq__orders")));
        assert!(p.allows("app", Action::Publish, &f("orders")));
    }

    #[test]
    fn disabled_allows_everything() {
        let mut p = policy("none", &[]);
        p.enabled = false;
        assert!(p.allows("x", Action::Publish, &f("a")));
        assert!(p.allows("x", Action::Subscribe, &f("#")));
    }

    #[test]
    fn bad_rules_name_the_field() {
        let field = |c, t, p| AclRule::parse(c, t, p).err().map(|e| e.field);
        assert_eq!(field("a*b", "x", "all"), Some("client"));
        assert_eq!(field("", "x", "all"), Some("client"));
        assert_eq!(field("a", "x/#/y", "all"), Some("topic"));
        assert_eq!(field("a", "x", "read"), Some("permission"));
        assert_eq!(
            AclRule::parse("a", "x", "PubSub").expect("ok").permission,
            Permission::All
        );
    }

    #[test]
    fn cache_follows_swaps() {
        let acl = Acl::new(policy("none", &[("c", "a", "publish")]));
        let mut cache = AclCache::default();
        assert!(cache.may_publish(&acl, "c", b"a"));
        assert!(!cache.may_publish(&acl, "c", b"b"));
        acl.replace(policy("none", &[("c", "b", "publish")]));
        assert!(!cache.may_publish(&acl, "c", b"a"));
        assert!(cache.may_publish(&acl, "c", b"b"));
        let added = acl.update(|p| {
            p.rules.push(AclRule::parse("c", "a", "all").expect("rule"));
            p.rules.len()
        });
        assert_eq!(added, 2);
        assert!(cache.may_publish(&acl, "c", b"a"));
    }

    #[test]
    fn concurrent_updates_are_all_kept() {
        let acl = Arc::new(Acl::new(policy("none", &[])));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let acl = acl.clone();
                std::thread::spawn(move || {
                    for i in 0..100 {
                        let rule = AclRule::parse(&format!("c{t}-{i}"), "x", "all").expect("rule");
                        acl.update(|p| p.rules.push(rule.clone()));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(acl.policy().rules.len(), 400);
        assert!(acl.generation() >= 401);
    }

    /// A revoked client is shut out with one `none` rule on `#`, system topics included: a
    /// leading wildcard never reached them, so a pattern rule granting a dead-letter topic kept
    /// deciding for it. An allowing rule on `#` still does not open them.
    #[test]
    fn a_deny_on_a_leading_wildcard_reaches_system_topics() {
        let p = policy(
            "none",
            &[
                ("ops-*", "__dlq__orders/#", "subscribe"),
                ("ops-*", "$SYS/#", "all"),
                ("ops-bob", "#", "none"),
                ("*", "#", "all"),
            ],
        );
        let filter = |f: &str| TopicFilter::try_from(f).expect("filter");
        assert!(p.allows("ops-alice", Action::Subscribe, &filter("__dlq__orders/#")));
        assert!(!p.allows("ops-bob", Action::Subscribe, &filter("__dlq__orders/#")));
        assert!(!p.allows("ops-bob", Action::Publish, &filter("$SYS/x")));
        assert!(p.allows("ops-alice", Action::Publish, &filter("$SYS/x")));
        assert!(!p.allows("ops-bob", Action::Subscribe, &filter("#")));
        // `*` on `#` with `all` opens the ordinary topics, not the system ones.
        assert!(p.allows("carol", Action::Publish, &filter("orders/1")));
        assert!(!p.allows("carol", Action::Subscribe, &filter("__dlq__orders/#")));
    }

    #[test]
    fn cache_is_bounded() {
        let acl = Acl::new(policy("all", &[]));
        let mut cache = AclCache::default();
        for i in 0..ACL_CACHE_TOPICS * 2 {
            assert!(cache.may_publish(&acl, "c", format!("t{i}").as_bytes()));
            assert!(cache.publish.len() <= ACL_CACHE_TOPICS);
        }
    }

    /// Long names fill the cache's bytes before its count: 4,096 names of 255 bytes held
    /// ~1 MiB per stream, and refused ones were kept too (a client without rights pinned
    /// memory with made-up topics).
    #[test]
    fn cache_is_bounded_in_bytes_and_keeps_no_refusals() {
        let acl = Acl::new(policy("none", &[("c", "ok/#", "publish")]));
        let mut cache = AclCache::default();
        for i in 0..ACL_CACHE_TOPICS * 2 {
            let refused = format!("no/{i:0>250}");
            assert!(!cache.may_publish(&acl, "c", refused.as_bytes()));
            assert!(
                !cache.publish.iter().any(|t| t.starts_with(b"no/")),
                "no refusal kept"
            );
            let allowed = format!("ok/{i:0>250}");
            assert!(cache.may_publish(&acl, "c", allowed.as_bytes()));
            let held: usize = cache.publish.iter().map(|t| t.len()).sum();
            assert_eq!(held, cache.bytes);
            assert!(held <= ACL_CACHE_BYTES, "{held} bytes");
        }
    }
}
