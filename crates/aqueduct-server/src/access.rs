//! Who may do what, at run time: the ACL and the publish quotas, their config sections (`acl.*`,
//! `broker.quotas.*`, `admin.*`), and the state file that keeps changes made through the admin
//! API across restarts.
//!
//! ## How the config file and the state file combine
//! The live policy (ACL default and rules, default quota and per-client quotas) starts from the
//! config file. A change through the admin API is applied at once and written to the state file
//! (`admin.state_file`, replaced atomically: write, fsync, rename, fsync the directory) together
//! with a fingerprint of the config file's `acl` and `broker.quotas` sections. At startup the
//! state file wins when that fingerprint still matches — the API's changes survive a restart —
//! and the config file wins when its sections were edited since (the broker logs which). `SIGHUP`
//! makes the config file's sections the live policy again, replacing changes made through the
//! API, and rewrites the state file to match (so does a start at which the config file won, so
//! that reverting the config file later does not bring old API changes back). `acl.enabled` and
//! `broker.quotas.action` always come from the config file, and are not in the fingerprint:
//! turning access control on at a restart checks the rules staged through the API while it was
//! off (a SIGHUP that turns it on makes the file's rules live, replacing them, as it replaces
//! every API change).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use aqueduct_core::acl::{Acl, AclPolicy, AclRule, ClientPattern, Permission};
use aqueduct_core::quota::{QuotaPolicy, QuotaSpec, Quotas};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::{invalid, ConfigError};

/// One ACL rule as the config file (and the state file) writes it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AclRuleSection {
    pub client: String,
    pub topic: String,
    pub permission: String,
}

impl From<&AclRule> for AclRuleSection {
    fn from(r: &AclRule) -> Self {
        AclRuleSection {
            client: r.client.to_string(),
            topic: r.topic.to_string(),
            permission: r.permission.to_string(),
        }
    }
}

/// `acl.*` (the seed's keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AclSection {
    pub enabled: bool,
    /// What a client may do where no rule applies: `none`, `publish`, `subscribe`, `all`.
    pub default: String,
    pub rules: Vec<AclRuleSection>,
}

impl Default for AclSection {
    fn default() -> Self {
        AclSection {
            enabled: false,
            default: "none".into(),
            rules: Vec::new(),
        }
    }
}

/// One client's quota override under `broker.quotas.clients`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientQuotaSection {
    /// Messages per second; 0 = unlimited.
    pub publish_rate: u64,
    /// Burst, messages; absent: `default_burst_size`.
    pub burst_size: Option<u64>,
}

/// `broker.quotas.*` (seed keys, plus `action` and `clients`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuotasSection {
    /// Messages per second per client; 0 = unlimited.
    pub default_publish_rate: u64,
    /// Token-bucket burst, messages.
    pub default_burst_size: u64,
    /// `throttle` (stop reading the client until it may publish again; nothing is lost) or
    /// `reject` (answer ERROR RATE_LIMITED).
    pub action: String,
    /// Per-client overrides: client id → rate and burst.
    pub clients: BTreeMap<String, ClientQuotaSection>,
}

impl Default for QuotasSection {
    fn default() -> Self {
        QuotasSection {
            default_publish_rate: 0,
            default_burst_size: 1000,
            action: "throttle".into(),
            clients: BTreeMap::new(),
        }
    }
}

/// `admin.*`: the gRPC admin API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    pub enabled: bool,
    pub listen_addr: String,
    /// Client certificates whose CN matches this pattern may call the API.
    pub allowed_cn: String,
    /// CA that signs admin client certificates; empty: `tls.client_ca_file`.
    pub client_ca_file: String,
    /// Where changes made through the API are kept; empty: `$AQUEDUCT_HOME/admin-state.json`,
    /// else `$HOME/.aqueduct/admin-state.json`.
    pub state_file: String,
}

impl Default for AdminSection {
    fn default() -> Self {
        AdminSection {
            enabled: false,
            listen_addr: "127.0.0.1:9091".into(),
            allowed_cn: "admin-*".into(),
            client_ca_file: String::new(),
            state_file: String::new(),
        }
    }
}

/// What an over-quota publisher gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaAction {
    /// Its streams are not read until the quota allows more (QUIC flow control holds it).
    Throttle,
    /// ERROR RATE_LIMITED; the frame is not published.
    Reject,
}

/// The validated access configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessConfig {
    pub acl: AclPolicy,
    pub quotas: QuotaPolicy,
    pub action: QuotaAction,
    /// Fingerprint of the `acl` and `broker.quotas` sections (see the module docs), but for
    /// `acl.enabled`, which always comes from the config file: turning access control on
    /// checks the rules staged through the admin API meanwhile, it does not drop them.
    pub fingerprint: String,
    /// The fingerprint as written before it left `acl.enabled` out: a state file written
    /// then still matches the config it derived from.
    pub fingerprint_with_enabled: String,
}

impl Default for AccessConfig {
    fn default() -> Self {
        validate(&AclSection::default(), &QuotasSection::default())
            .unwrap_or_else(|e| panic!("built-in access defaults are invalid: {e}"))
    }
}

/// The validated admin API configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    pub listen_addr: SocketAddr,
    pub allowed_cn: ClientPattern,
    pub client_ca_file: PathBuf,
    pub state_file: PathBuf,
}

fn rule_key(field: &str) -> &'static str {
    match field {
        "client" => "acl.rules[].client",
        "topic" => "acl.rules[].topic",
        _ => "acl.rules[].permission",
    }
}

/// Check the `acl` and `broker.quotas` sections.
pub fn validate(acl: &AclSection, quotas: &QuotasSection) -> Result<AccessConfig, ConfigError> {
    let default: Permission = acl.default.parse().map_err(|e| invalid("acl.default", e))?;
    let mut rules = Vec::with_capacity(acl.rules.len());
    for (i, r) in acl.rules.iter().enumerate() {
        let rule = AclRule::parse(&r.client, &r.topic, &r.permission)
            .map_err(|e| invalid(rule_key(e.field), format!("rule {i}: {}", e.problem)))?;
        rules.push(rule);
    }
    if quotas.default_burst_size == 0 {
        return Err(invalid(
            "broker.quotas.default_burst_size",
            "must be at least 1 (a bucket of 0 tokens would never let a message through)",
        ));
    }
    let action = match quotas.action.trim() {
        "throttle" | "" => QuotaAction::Throttle,
        "reject" => QuotaAction::Reject,
        other => {
            return Err(invalid(
                "broker.quotas.action",
                format!("{other:?} is not one of throttle, reject"),
            ))
        }
    };
    let default_spec = QuotaSpec {
        rate: quotas.default_publish_rate,
        burst: quotas.default_burst_size,
    };
    let mut clients = std::collections::HashMap::new();
    for (id, q) in &quotas.clients {
        if id.trim().is_empty() {
            return Err(invalid("broker.quotas.clients", "a client id is empty"));
        }
        if id.contains('*') {
            return Err(invalid(
                "broker.quotas.clients",
                format!(
                    "{id:?}: a quota names one client id exactly; `*` patterns are for acl \
                     rules (set default_publish_rate, or each client's)"
                ),
            ));
        }
        let burst = q.burst_size.unwrap_or(quotas.default_burst_size);
        if burst == 0 {
            return Err(invalid(
                "broker.quotas.clients",
                format!("{id}: burst_size must be at least 1"),
            ));
        }
        clients.insert(
            id.clone(),
            QuotaSpec {
                rate: q.publish_rate,
                burst,
            },
        );
    }
    Ok(AccessConfig {
        acl: AclPolicy {
            enabled: acl.enabled,
            default,
            rules,
        },
        quotas: QuotaPolicy {
            default: default_spec,
            clients,
        },
        action,
        fingerprint: fingerprint(
            &AclSection {
                enabled: false,
                ..acl.clone()
            },
            quotas,
        ),
        fingerprint_with_enabled: fingerprint(acl, quotas),
    })
}

/// A stable digest of the sections (the serde form, so formatting and comments do not count).
fn fingerprint(acl: &AclSection, quotas: &QuotasSection) -> String {
    let text = serde_json::to_string(&(
        acl,
        &quotas.default_publish_rate,
        &quotas.default_burst_size,
        &quotas.clients,
    ))
    .unwrap_or_default();
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl AdminSection {
    /// Where the state file is (`admin.state_file`, or `admin-state.json` in the Aqueduct
    /// home), whether the admin API is on or not; `None` if there is no home to put it in.
    pub fn state_file_path(&self, env: &[(String, String)]) -> Option<PathBuf> {
        match self.state_file.trim() {
            "" => crate::config::aqueduct_home(env).map(|h| h.join("admin-state.json")),
            p => Some(PathBuf::from(p)),
        }
    }

    /// `None` when the admin API is off. Checked although it is off, so a typo shows early.
    pub fn validate(
        &self,
        tls_client_ca: Option<&Path>,
        env: &[(String, String)],
    ) -> Result<Option<AdminConfig>, ConfigError> {
        let listen_addr = crate::config::parse_addr("admin.listen_addr", &self.listen_addr)?;
        let allowed_cn: ClientPattern = self
            .allowed_cn
            .parse()
            .map_err(|e| invalid("admin.allowed_cn", e))?;
        if !self.enabled {
            return Ok(None);
        }
        let ca = match self.client_ca_file.trim() {
            "" => tls_client_ca.map(Path::to_path_buf),
            p => Some(PathBuf::from(p)),
        };
        let Some(client_ca_file) = ca else {
            return Err(invalid(
                "admin.client_ca_file",
                "required when admin.enabled is true (or set tls.client_ca_file): the admin API \
                 only accepts clients with a certificate signed by this CA (e.g. made with \
                 `aqueduct cert ca` and `aqueduct cert client admin-alice`)",
            ));
        };
        if !client_ca_file.is_file() {
            return Err(invalid(
                "admin.client_ca_file",
                format!(
                    "{} does not exist or is not a file",
                    client_ca_file.display()
                ),
            ));
        }
        let state_file = self.state_file_path(env).ok_or_else(|| {
            invalid(
                "admin.state_file",
                "required when neither AQUEDUCT_HOME nor HOME is set (the state file grants \
                 permissions, so it is not put in a shared temporary directory)",
            )
        })?;
        Ok(Some(AdminConfig {
            listen_addr,
            allowed_cn,
            client_ca_file,
            state_file,
        }))
    }
}

/// The state file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    version: u32,
    /// The config sections this state was derived from.
    config_fingerprint: String,
    acl_default: String,
    acl_rules: Vec<AclRuleSection>,
    quota_default: QuotaEntry,
    quota_clients: BTreeMap<String, QuotaEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaEntry {
    rate: u64,
    burst: u64,
}

impl From<QuotaSpec> for QuotaEntry {
    fn from(s: QuotaSpec) -> Self {
        QuotaEntry {
            rate: s.rate,
            burst: s.burst,
        }
    }
}

impl From<QuotaEntry> for QuotaSpec {
    fn from(s: QuotaEntry) -> Self {
        QuotaSpec {
            rate: s.rate,
            burst: s.burst.max(1),
        }
    }
}

/// Why the state file could not be used or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: {problem}")]
    Io { path: PathBuf, problem: String },
    #[error("state file {path}: {problem}")]
    Invalid { path: PathBuf, problem: String },
}

/// Access control and quotas as they run: the ACL behind an atomic swap, the quota buckets,
/// and where changes are persisted.
#[derive(Debug)]
pub struct Access {
    pub acl: Acl,
    pub quotas: Quotas,
    /// `broker.quotas.action` is `reject` (reloaded by SIGHUP like the rest).
    reject: AtomicBool,
    /// Where changes are persisted (the admin API is on).
    state_file: Option<PathBuf>,
    /// The config sections' fingerprint the live policy derives from.
    fingerprint: Mutex<String>,
    /// Serialises persisting, so the file always holds the latest change.
    persist: Mutex<()>,
    /// Changes applied (API calls and reloads).
    pub changes: AtomicU64,
    /// The state file's lock (`<file>.lock`, an advisory `flock`), held while the broker runs:
    /// two brokers writing one state file would each lose the other's changes at a restart.
    _lock: Option<std::fs::File>,
}

/// Take the state file's lock for as long as the broker runs, or say which key to change.
fn lock_state_file(path: &Path) -> Result<std::fs::File, StateError> {
    let mut lock = path.as_os_str().to_owned();
    lock.push(".lock");
    let lock = PathBuf::from(lock);
    let io = |e: std::io::Error| StateError::Io {
        path: path.to_path_buf(),
        problem: format!("{e} (its lock {})", lock.display()),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StateError::Io {
            path: path.to_path_buf(),
            problem: "in use by another broker with the admin API on (each would lose the \
                      other's changes at its next start): give each broker its own \
                      admin.state_file (AQUEDUCT_ADMIN_STATE_FILE)"
                .into(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

impl Access {
    /// The live policy at startup: the config's, or the state file's if it derives from the same
    /// config sections (see the module docs). Returns a note saying which, for the log.
    pub fn start(config: &AccessConfig, state_file: Option<PathBuf>) -> Result<Access, StateError> {
        let mut acl = config.acl.clone();
        let mut quotas = config.quotas.clone();
        let mut config_won = false;
        let lock = state_file.as_deref().map(lock_state_file).transpose()?;
        if let Some(path) = &state_file {
            match read_state(path)? {
                Some(state)
                    if state.config_fingerprint == config.fingerprint
                        || state.config_fingerprint == config.fingerprint_with_enabled =>
                {
                    let (a, q) = state.policies(path, acl.enabled)?;
                    info!(
                        path = %path.display(),
                        rules = a.rules.len(),
                        client_quotas = q.clients.len(),
                        "access policy: using the state file (the policy last set through the admin API or by a SIGHUP reload)"
                    );
                    acl = a;
                    quotas = q;
                }
                Some(_) => {
                    warn!(
                        path = %path.display(),
                        "access policy: the config file's acl/broker.quotas sections changed since \
                         the state file was written; using the config file and rewriting the \
                         state file (the admin API changes of before are dropped)"
                    );
                    config_won = true;
                }
                None => {}
            }
        }
        let access = Access {
            acl: Acl::new(acl),
            quotas: Quotas::new(quotas),
            reject: AtomicBool::new(config.action == QuotaAction::Reject),
            state_file,
            fingerprint: Mutex::new(config.fingerprint.clone()),
            persist: Mutex::new(()),
            changes: AtomicU64::new(0),
            _lock: lock,
        };
        if config_won {
            // Otherwise reverting the config file later would bring the old changes back.
            access.persist()?;
        }
        Ok(access)
    }

    /// What an over-quota publisher gets now.
    pub fn action(&self) -> QuotaAction {
        if self.reject.load(Ordering::Relaxed) {
            QuotaAction::Reject
        } else {
            QuotaAction::Throttle
        }
    }

    /// `SIGHUP`: the config file's sections become the live policy (and the state file's).
    pub fn reload(&self, config: &AccessConfig) -> Result<(), StateError> {
        self.apply(config);
        self.changed()
    }

    /// The config file's sections become the live policy, without saving it (no I/O): call
    /// [`changed`](Self::changed) after, once what the new policy refuses is closed.
    ///
    /// No save runs meanwhile, and the fingerprint changes last: a save (an admin call's) that
    /// ran between would write the new fingerprint with the old policy, and a crash before
    /// this change is saved would then bring the old policy back as if it were the config's.
    pub fn apply(&self, config: &AccessConfig) {
        let _no_save = self.persist.lock().unwrap_or_else(|e| e.into_inner());
        self.acl.replace(config.acl.clone());
        self.quotas.replace(config.quotas.clone());
        self.reject
            .store(config.action == QuotaAction::Reject, Ordering::Relaxed);
        *self.fingerprint.lock().unwrap_or_else(|e| e.into_inner()) = config.fingerprint.clone();
    }

    /// After a change: count it and persist the live policy (blocking file I/O: call it off the
    /// async workers).
    pub fn changed(&self) -> Result<(), StateError> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        self.persist()
    }

    fn persist(&self) -> Result<(), StateError> {
        let Some(path) = &self.state_file else {
            return Ok(());
        };
        let _one_at_a_time = self.persist.lock().unwrap_or_else(|e| e.into_inner());
        let acl = self.acl.policy();
        let quotas = self.quotas.policy();
        let state = StateFile {
            version: 1,
            config_fingerprint: self
                .fingerprint
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            acl_default: acl.default.to_string(),
            acl_rules: acl.rules.iter().map(AclRuleSection::from).collect(),
            quota_default: quotas.default.into(),
            quota_clients: quotas
                .clients
                .iter()
                .map(|(k, v)| (k.clone(), QuotaEntry::from(*v)))
                .collect(),
        };
        write_state(path, &state)
    }

    /// With the admin API off, a state file left from when it was on is moved aside (to
    /// `<file>.off`, replacing an older one): otherwise turning the API on again later would
    /// bring its old changes back, as a config edit meanwhile would not. Returns where it went.
    pub fn set_aside_state_file(path: &Path) -> Result<Option<PathBuf>, StateError> {
        if !path.exists() {
            return Ok(None);
        }
        // Not from under a broker that runs with the admin API on and this file.
        let _lock = lock_state_file(path)?;
        let mut aside = path.as_os_str().to_owned();
        aside.push(".off");
        let aside = PathBuf::from(aside);
        std::fs::rename(path, &aside).map_err(|e| StateError::Io {
            path: path.to_path_buf(),
            problem: format!(
                "the admin API is off, and the file could not be moved aside to {}: {e}",
                aside.display()
            ),
        })?;
        warn!(
            path = %path.display(),
            moved_to = %aside.display(),
            "the admin API is off: the changes made through it are dropped (the config file's \
             acl and broker.quotas apply); its state file was moved aside"
        );
        Ok(Some(aside))
    }

    /// Where changes are persisted, if anywhere.
    pub fn state_file(&self) -> Option<&Path> {
        self.state_file.as_deref()
    }
}

impl StateFile {
    fn policies(&self, path: &Path, enabled: bool) -> Result<(AclPolicy, QuotaPolicy), StateError> {
        let bad = |problem: String| StateError::Invalid {
            path: path.to_path_buf(),
            problem,
        };
        let default = self.acl_default.parse().map_err(bad)?;
        let rules = self
            .acl_rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                AclRule::parse(&r.client, &r.topic, &r.permission)
                    .map_err(|e| bad(format!("rule {i}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((
            AclPolicy {
                enabled,
                default,
                rules,
            },
            QuotaPolicy {
                default: self.quota_default.into(),
                clients: self
                    .quota_clients
                    .iter()
                    .map(|(k, v)| (k.clone(), QuotaSpec::from(*v)))
                    .collect(),
            },
        ))
    }
}

fn read_state(path: &Path) -> Result<Option<StateFile>, StateError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(StateError::Io {
                path: path.to_path_buf(),
                problem: e.to_string(),
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| StateError::Invalid {
            path: path.to_path_buf(),
            problem: format!("{e} (fix or remove it; it is rewritten at the next change)"),
        })
}

/// Where the next state is written before it is renamed over `path`: `<file>.tmp`, the whole
/// name kept. (Replacing the extension gave `state.node1` and `state.node2`, two brokers' own
/// files, the same temp file: each could then rename the other's state over its own.)
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Write, fsync, rename over, fsync the directory: the file is always either the old or the new
/// state, whole.
fn write_state(path: &Path, state: &StateFile) -> Result<(), StateError> {
    let io = |e: std::io::Error| StateError::Io {
        path: path.to_path_buf(),
        problem: e.to_string(),
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = temp_path(path);
    let text = serde_json::to_vec_pretty(state).map_err(|e| io(std::io::Error::other(e)))?;
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&text).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io)?;
    Ok(())
}

/// The ACL identity of a connection: its certificate's CN, or [`ANONYMOUS`].
///
/// [`ANONYMOUS`]: aqueduct_core::acl::ANONYMOUS
pub fn identity(client_id: Option<&str>) -> &str {
    client_id.unwrap_or(aqueduct_core::acl::ANONYMOUS)
}

/// Shared handle.
pub type SharedAccess = Arc<Access>;

#[cfg(test)]
mod tests {
    use super::*;

    fn sections(rules: &[(&str, &str, &str)]) -> (AclSection, QuotasSection) {
        let acl = AclSection {
            enabled: true,
            default: "none".into(),
            rules: rules
                .iter()
                .map(|(c, t, p)| AclRuleSection {
                    client: c.to_string(),
                    topic: t.to_string(),
                    permission: p.to_string(),
                })
                .collect(),
        };
        (acl, QuotasSection::default())
    }

    #[test]
    fn bad_values_name_the_key() {
        let (acl, q) = sections(&[("a", "x", "read")]);
        let e = validate(&acl, &q).expect_err("bad permission").to_string();
        assert!(e.starts_with("acl.rules[].permission: rule 0:"), "{e}");
        let (mut acl, q) = sections(&[]);
        acl.default = "maybe".into();
        assert!(validate(&acl, &q)
            .expect_err("bad default")
            .to_string()
            .starts_with("acl.default:"));
        let (acl, mut q) = sections(&[]);
        q.action = "drop".into();
        assert!(validate(&acl, &q)
            .expect_err("bad action")
            .to_string()
            .starts_with("broker.quotas.action:"));
        q.action = "reject".into();
        q.default_burst_size = 0;
        assert!(validate(&acl, &q)
            .expect_err("zero burst")
            .to_string()
            .starts_with("broker.quotas.default_burst_size:"));
    }

    #[test]
    fn state_file_survives_restart_until_the_config_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state").join("admin-state.json");
        let (acl, q) = sections(&[("a", "x", "all")]);
        let config = validate(&acl, &q).expect("valid");
        let access = Access::start(&config, Some(path.clone())).expect("start");
        access.acl.update(|p| {
            p.rules
                .push(AclRule::parse("b", "y", "publish").expect("rule"))
        });
        access.quotas.update(|p| {
            p.clients
                .insert("b".into(), QuotaSpec { rate: 5, burst: 2 });
        });
        access.changed().expect("persist");
        // A second broker on the same state file is refused (each would lose the other's
        // changes), naming the key.
        let e = Access::start(&config, Some(path.clone())).expect_err("in use");
        assert!(e.to_string().contains("admin.state_file"), "{e}");
        drop(access);
        // Same config: the API's changes are back.
        let again = Access::start(&config, Some(path.clone())).expect("restart");
        assert_eq!(again.acl.policy().rules.len(), 2);
        assert_eq!(
            again.quotas.policy().spec_for("b"),
            QuotaSpec { rate: 5, burst: 2 }
        );
        drop(again);
        // Edited config: it wins.
        let (acl2, q2) = sections(&[("c", "z", "all")]);
        let edited = validate(&acl2, &q2).expect("valid");
        let fresh = Access::start(&edited, Some(path.clone())).expect("restart");
        assert_eq!(fresh.acl.policy().rules, edited.acl.rules);
        drop(fresh);
        // Reverting the config file does not bring the dropped API changes back.
        let reverted = Access::start(&config, Some(path.clone())).expect("restart");
        assert_eq!(reverted.acl.policy().rules, config.acl.rules);
        // A reload rewrites the state file for the new sections.
        reverted.reload(&edited).expect("reload");
        drop(reverted);
        let after = Access::start(&edited, Some(path)).expect("restart");
        assert_eq!(after.acl.policy().rules, edited.acl.rules);
    }

    /// Two brokers' own state files that differ only after the last dot (`state.node1`,
    /// `state.node2`) are written through temp files of their own: with the extension replaced
    /// both used `state.json.tmp`, and each could rename the other's state over its own.
    #[test]
    fn each_state_file_has_its_own_temp_file() {
        let dir = Path::new("/var/lib/aqueduct");
        let one = temp_path(&dir.join("state.node1"));
        let two = temp_path(&dir.join("state.node2"));
        assert_ne!(one, two);
        assert_eq!(one, dir.join("state.node1.tmp"));
        assert_ne!(
            temp_path(&dir.join("state")),
            temp_path(&dir.join("state.json"))
        );
    }

    /// A save that comes while a reload is applying (an admin call's, here held behind a walk
    /// over the subscriptions that the reload's ACL change waits for) writes either the old
    /// policy with the old fingerprint or the new with the new: never the new fingerprint with
    /// the old policy, which a crash before the reload's own save would then bring back as the
    /// config's.
    #[test]
    fn a_save_during_a_reload_never_pairs_the_new_fingerprint_with_the_old_policy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("admin-state.json");
        let (acl, q) = sections(&[("a", "x", "all")]);
        let old = validate(&acl, &q).expect("valid");
        let (acl2, q2) = sections(&[("b", "y", "all"), ("c", "z", "all")]);
        let new = validate(&acl2, &q2).expect("valid");
        let access = Arc::new(Access::start(&old, Some(path.clone())).expect("start"));
        let walk = access.acl.hold_changes();
        let reloading = {
            let (access, new) = (access.clone(), new.clone());
            std::thread::spawn(move || access.apply(&new))
        };
        // The reload waits for the walk, inside its ACL change.
        let waited = std::time::Instant::now();
        while access.acl.waiting_for_changes() == 0 {
            assert!(waited.elapsed() < std::time::Duration::from_secs(10));
            std::thread::yield_now();
        }
        let (saved_tx, saved_rx) = std::sync::mpsc::channel();
        let saving = {
            let access = access.clone();
            std::thread::spawn(move || {
                access.changed().expect("saved");
                let _ = saved_tx.send(());
            })
        };
        let consistent = || {
            let state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
            let fingerprint = state["config_fingerprint"].as_str().expect("fingerprint");
            let rules = state["acl_rules"].as_array().expect("rules").len();
            let pairs =
                |c: &AccessConfig| c.fingerprint == fingerprint && c.acl.rules.len() == rules;
            assert!(pairs(&old) || pairs(&new), "{state}");
        };
        // Without the fix the save is done at once, with the pair mixed.
        if saved_rx
            .recv_timeout(std::time::Duration::from_millis(500))
            .is_ok()
        {
            consistent();
        }
        drop(walk);
        reloading.join().expect("reload");
        saving.join().expect("save");
        consistent();
    }

    /// Rules staged through the admin API while `acl.enabled` is false are checked once the
    /// config turns it on (admin-api.md): turning it on changed the fingerprint, so the config
    /// won at the next start and the staged rules were dropped. A state file written with the
    /// fingerprint of before (which counted `enabled`) still matches.
    #[test]
    fn turning_access_control_on_keeps_the_rules_staged_meanwhile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("admin-state.json");
        let (mut acl, q) = sections(&[("a", "x", "all")]);
        acl.enabled = false;
        let off = validate(&acl, &q).expect("valid");
        let access = Access::start(&off, Some(path.clone())).expect("start");
        access.acl.update(|p| {
            p.rules
                .push(AclRule::parse("b", "y", "publish").expect("rule"))
        });
        access.changed().expect("persist");
        drop(access);
        acl.enabled = true;
        let on = validate(&acl, &q).expect("valid");
        let restarted = Access::start(&on, Some(path.clone())).expect("restart");
        let policy = restarted.acl.policy();
        assert!(policy.enabled);
        assert_eq!(policy.rules.len(), 2, "the staged rule is kept");
        drop(restarted);
        // A state file of before, whose fingerprint counted `enabled`.
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        state["config_fingerprint"] = on.fingerprint_with_enabled.clone().into();
        std::fs::write(&path, state.to_string()).expect("write");
        let upgraded = Access::start(&on, Some(path)).expect("restart");
        assert_eq!(upgraded.acl.policy().rules.len(), 2, "still matches");
    }

    #[test]
    fn a_broken_state_file_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("admin-state.json");
        std::fs::write(&path, "{not json").expect("write");
        let e = Access::start(&AccessConfig::default(), Some(path))
            .expect_err("broken")
            .to_string();
        assert!(
            e.contains("admin-state.json") && e.contains("fix or remove"),
            "{e}"
        );
    }
}
