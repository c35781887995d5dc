//! Broker configuration: the seed's YAML sections and keys, `AQUEDUCT_*` environment variables
//! and command-line overrides, merged with precedence flag > env > file > default and validated
//! once into typed values.
//!
//! Unknown keys (in the file or as `AQUEDUCT_*` variables), malformed values ("50xs", a negative
//! size, an unknown policy) and missing files are errors that name the key and the problem. The
//! access-control sections (`acl`, `broker.quotas`, `admin`) are typed in `access.rs`, the
//! cluster's in `cluster.rs`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::access::{
    AccessConfig, AclRuleSection, AclSection, AdminConfig, AdminSection, ClientQuotaSection,
    QuotaAction, QuotasSection,
};
pub use crate::cluster::{
    ClusterConfig, ClusterSection, ClusterTlsSection, Compression, DiscoverySection, NumberOrText,
};
use aqueduct_core::BrokerConfig;
use aqueduct_proto::{OverflowPolicy, Priority};
use figment::providers::{Format, Serialized};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: not found")]
    FileNotFound { path: PathBuf },
    #[error("{0}")]
    Parse(String),
    #[error("{key}: {problem}")]
    Invalid { key: &'static str, problem: String },
    #[error("unknown environment variable {name} (no config key maps to it)")]
    UnknownEnv { name: String },
    #[error("{section}.enabled is true, but {feature} is not implemented yet in this version")]
    NotImplemented {
        section: &'static str,
        feature: &'static str,
    },
}

pub(crate) fn invalid(key: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        problem: problem.into(),
    }
}

/// `tls.*`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// Create a self-signed certificate at startup when no `cert_file` is given.
    pub generate: bool,
    pub cert_file: String,
    pub key_file: String,
    /// mTLS: refuse clients without a certificate signed by `client_ca_file`.
    pub require_client_cert: bool,
    pub client_ca_file: String,
    /// Certificate revocation lists (PEM `X509 CRL` blocks, or one DER list) of the client
    /// CAs: a revoked client certificate is refused. Re-read on SIGHUP.
    pub crl_file: String,
    /// Where the generated development certificate is written for local clients to trust.
    /// Empty: `$AQUEDUCT_HOME/dev-cert.pem`, else `$HOME/.aqueduct/dev-cert.pem`.
    pub dev_cert_file: String,
}

impl Default for TlsSection {
    fn default() -> Self {
        TlsSection {
            generate: true,
            cert_file: String::new(),
            key_file: String::new(),
            require_client_cert: false,
            client_ca_file: String::new(),
            crl_file: String::new(),
            dev_cert_file: String::new(),
        }
    }
}

/// `broker.*`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BrokerSection {
    pub queue_size: u64,
    pub backpressure_policy: String,
    pub batch_size: u64,
    pub flush_interval: String,
    pub max_retries: u32,
    pub ack_wait: String,
    pub max_in_flight: u64,
    /// One duration per priority 0..=3; "0s" means "use the message's own TTL".
    pub priority_ttls: Vec<String>,
    /// Block policy: a subscription that holds a publisher this long is closed as a slow
    /// consumer ("0s": never).
    pub block_timeout: String,
    /// Publish quotas (the seed's `broker.quotas`), see `access.rs`.
    pub quotas: QuotasSection,
    /// Threads of the broker's async runtime; 0 = one per CPU the process may use.
    pub worker_threads: u64,
    /// How long a runtime thread that ran out of work watches for more before it sleeps
    /// ("0s": never); see `aqueduct_udp::IdleSpin`.
    pub idle_spin: String,
}

impl Default for BrokerSection {
    fn default() -> Self {
        BrokerSection {
            queue_size: 1024,
            backpressure_policy: "drop_oldest".into(),
            batch_size: 64 * 1024,
            flush_interval: "50us".into(),
            max_retries: 3,
            ack_wait: "30s".into(),
            max_in_flight: 1024,
            priority_ttls: vec!["0s".into(); Priority::LEVELS],
            block_timeout: "30s".into(),
            quotas: QuotasSection::default(),
            worker_threads: 0,
            idle_spin: DEFAULT_IDLE_SPIN.into(),
        }
    }
}

/// `transport.*`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportSection {
    /// Largest frame data a client may send, in bytes (the seed's default: 65536).
    pub max_buf_size: u64,
    pub max_streams_per_connection: u64,
    /// Live subscriptions one connection may hold (over all its streams).
    pub max_subscriptions_per_connection: u64,
    pub max_connections: u64,
    pub idle_timeout: String,
    pub handshake_timeout: String,
    /// Unset: 10 s, or a third of `idle_timeout` if that is shorter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_alive_interval: Option<String>,
    /// Per-stream receive window, bytes.
    pub stream_receive_window: u64,
    /// Per-connection receive window, bytes.
    pub receive_window: u64,
    /// Per-connection send window, bytes.
    pub send_window: u64,
    /// UDP socket send and receive buffer, bytes (the kernel may clamp it).
    pub socket_buffer: u64,
    /// Initial path MTU guess, bytes of UDP payload (1200..=6500).
    pub initial_mtu: u64,
    /// The largest path MTU discovery probes for, bytes of UDP payload (initial_mtu..=6500):
    /// also the largest datagram the broker accepts. 1452 (standard Ethernet) probes nothing.
    pub max_mtu: u64,
    /// Packets from the broker a client may leave unacknowledged (1..=64; 1 is QUIC's own
    /// rule, an ACK for every second packet). Asked through the QUIC ACK-frequency extension.
    pub ack_eliciting_threshold: u64,
    /// The longest a client may hold an acknowledgement back (1ms..=25ms), asked with
    /// `ack_eliciting_threshold`.
    pub ack_delay: String,
    /// First read buffer of a stream, bytes (the seed's key); it doubles while reads fill it,
    /// up to 64 KiB, so an idle stream costs little and a busy one reads in large chunks.
    pub read_buf_size: u64,
}

impl Default for TransportSection {
    fn default() -> Self {
        TransportSection {
            max_buf_size: 65536,
            max_streams_per_connection: 256,
            max_subscriptions_per_connection: 10_000,
            max_connections: 10_000,
            idle_timeout: "30s".into(),
            handshake_timeout: "10s".into(),
            keep_alive_interval: None,
            stream_receive_window: 4 << 20,
            receive_window: 16 << 20,
            send_window: 16 << 20,
            socket_buffer: 4 << 20,
            initial_mtu: 1452,
            max_mtu: aqueduct_udp::MAX_MTU.into(),
            ack_eliciting_threshold: 9,
            ack_delay: "1ms".into(),
            read_buf_size: 1024,
        }
    }
}

/// `metrics.*`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Distinct `topic` label values; later topics are counted under `topic="__other__"`.
    pub max_topic_labels: u64,
    /// Concurrent HTTP connections to the metrics endpoint.
    pub max_connections: u64,
    /// Time allowed for an HTTP request head to arrive.
    pub header_timeout: String,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            max_topic_labels: 1000,
            max_connections: 16,
            header_timeout: "5s".into(),
        }
    }
}

/// `aal.*`: the durable append-only log. Its `Debug` form hides the key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AalSection {
    pub enabled: bool,
    /// The log's directory (the seed called it a file). Empty: `$AQUEDUCT_HOME/aal`, else
    /// `$HOME/.aqueduct/aal`.
    pub file_path: String,
    /// Base64-encoded 32-byte AES-256-GCM master key.
    pub key: String,
    /// Master keys the log was sealed with before `key` (a rotated key), base64 each: the
    /// segments sealed with them are still read. A list, or one comma-separated string (as in
    /// the environment).
    #[serde(deserialize_with = "list_or_commas")]
    pub previous_keys: Vec<String>,
    /// Run the log unencrypted when `key` is empty (otherwise an empty key is an error).
    pub allow_plaintext: bool,
    /// Rotate segments before they grow past this many bytes.
    pub max_aal_size: u64,
    /// `always` | `batch` | `interval` | `never`.
    pub fsync: String,
    /// For `fsync: interval`.
    pub fsync_interval: String,
    /// Delete the oldest sealed segments while the log is larger (0: no limit).
    pub retention_bytes: u64,
    /// Delete sealed segments older than this ("" or "0": keep).
    pub retention_age: String,
    /// Durable consumers and groups whose positions are kept (a new one beyond is refused).
    pub max_consumers: u64,
    /// A durable consumer without a subscription for this long is forgotten ("0": never).
    pub consumer_retention: String,
}

impl Default for AalSection {
    fn default() -> Self {
        AalSection {
            enabled: false,
            file_path: String::new(),
            key: String::new(),
            previous_keys: Vec::new(),
            allow_plaintext: false,
            max_aal_size: 100 << 20,
            fsync: "batch".into(),
            fsync_interval: "100ms".into(),
            retention_bytes: 0,
            retention_age: String::new(),
            max_consumers: 10_000,
            consumer_retention: "7d".into(),
        }
    }
}

/// The whole file, as written by users.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub listen_addr: String,
    pub metrics_addr: String,
    pub tls: TlsSection,
    pub broker: BrokerSection,
    pub transport: TransportSection,
    pub metrics: MetricsSection,
    /// Append-only log (persistence): later.
    pub aal: AalSection,
    pub acl: AclSection,
    pub admin: AdminSection,
    pub cluster: ClusterSection,
    pub webtransport: crate::webtransport::WebTransportSection,
    pub tracing: crate::otel::TracingSection,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            listen_addr: ":4242".into(),
            metrics_addr: "127.0.0.1:9090".into(),
            tls: TlsSection::default(),
            broker: BrokerSection::default(),
            transport: TransportSection::default(),
            metrics: MetricsSection::default(),
            aal: AalSection::default(),
            acl: AclSection::default(),
            admin: AdminSection::default(),
            cluster: ClusterSection::default(),
            webtransport: crate::webtransport::WebTransportSection::default(),
            tracing: crate::otel::TracingSection::default(),
        }
    }
}

/// Every scalar key, as `section.key`; `AQUEDUCT_<SECTION>_<KEY>` maps to it.
pub const ENV_KEYS: &[&str] = &[
    "listen_addr",
    "metrics_addr",
    "tls.generate",
    "tls.cert_file",
    "tls.key_file",
    "tls.require_client_cert",
    "tls.client_ca_file",
    "tls.crl_file",
    "tls.dev_cert_file",
    "broker.queue_size",
    "broker.backpressure_policy",
    "broker.batch_size",
    "broker.flush_interval",
    "broker.max_retries",
    "broker.ack_wait",
    "broker.max_in_flight",
    "broker.block_timeout",
    "broker.quotas.default_publish_rate",
    "broker.quotas.default_burst_size",
    "broker.quotas.action",
    "broker.worker_threads",
    "broker.idle_spin",
    "transport.max_buf_size",
    "transport.max_streams_per_connection",
    "transport.max_subscriptions_per_connection",
    "transport.max_connections",
    "transport.idle_timeout",
    "transport.handshake_timeout",
    "transport.keep_alive_interval",
    "transport.stream_receive_window",
    "transport.receive_window",
    "transport.send_window",
    "transport.socket_buffer",
    "transport.initial_mtu",
    "transport.max_mtu",
    "transport.ack_eliciting_threshold",
    "transport.ack_delay",
    "transport.read_buf_size",
    "metrics.max_topic_labels",
    "metrics.max_connections",
    "metrics.header_timeout",
    "aal.enabled",
    "aal.file_path",
    "aal.key",
    "aal.previous_keys",
    "aal.allow_plaintext",
    "aal.max_aal_size",
    "aal.fsync",
    "aal.fsync_interval",
    "aal.retention_bytes",
    "aal.retention_age",
    "aal.max_consumers",
    "aal.consumer_retention",
    "acl.enabled",
    "acl.default",
    "admin.enabled",
    "admin.listen_addr",
    "admin.allowed_cn",
    "admin.client_ca_file",
    "admin.state_file",
    "cluster.enabled",
    "cluster.tls.ca_file",
    "cluster.tls.cert_file",
    "cluster.tls.key_file",
    "cluster.tls.crl_file",
    "cluster.compression",
    "cluster.compression_level",
    "cluster.compression_threshold",
    "cluster.peer_queue_size",
    "cluster.max_peer_interest",
    "cluster.discovery.enabled",
    "cluster.discovery.type",
    "cluster.discovery.host",
    "cluster.discovery.port",
    "cluster.discovery.interval",
    "webtransport.enabled",
    "webtransport.listen_addr",
    "webtransport.path_prefix",
    "webtransport.require_token",
    "tracing.otlp_endpoint",
    "tracing.otlp_ca_file",
    "tracing.otlp_cert_file",
    "tracing.otlp_key_file",
    "tracing.sample_ratio",
    "tracing.service_name",
];

/// The seed's environment variables whose names are not `AQUEDUCT_` + the key's path:
/// (variable, key). The mechanical names work too.
pub const ENV_ALIASES: &[(&str, &str)] = &[
    ("AQUEDUCT_AAL_MAX_SIZE", "aal.max_aal_size"),
    (
        "AQUEDUCT_BROKER_DEFAULT_PUBLISH_RATE",
        "broker.quotas.default_publish_rate",
    ),
    (
        "AQUEDUCT_BROKER_DEFAULT_BURST_SIZE",
        "broker.quotas.default_burst_size",
    ),
];

/// The config key an `AQUEDUCT_*` variable sets, if any.
pub fn env_key(name: &str) -> Option<&'static str> {
    ENV_ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map(|(_, key)| *key)
        .or_else(|| ENV_KEYS.iter().find(|k| env_name(k) == name).copied())
}

/// `AQUEDUCT_*` variables that are not config keys but are used by the tools.
const ENV_OTHER: &[&str] = &[
    "AQUEDUCT_CONFIG",
    "AQUEDUCT_HOME",
    "AQUEDUCT_LOG",
    // The `aqueduct` client's broker and admin API addresses: often exported in the same shell.
    "AQUEDUCT_ADDR",
    "AQUEDUCT_ADMIN_ADDR",
];

/// What Kubernetes puts in every pod of a namespace that has a Service named `aqueduct` (its
/// "service links", on unless `enableServiceLinks: false`): `AQUEDUCT_SERVICE_HOST`,
/// `AQUEDUCT_SERVICE_PORT[_<name>]`, `AQUEDUCT_PORT`, `AQUEDUCT_PORT_4242_UDP[_PROTO|_PORT|_ADDR]`.
/// Not config keys, and not typos: left alone (they stopped the broker, so a pod of the seed's
/// manifests crash-looped).
fn is_service_link(name: &str) -> bool {
    name.starts_with("AQUEDUCT_SERVICE_")
        || name == "AQUEDUCT_PORT"
        || name
            .strip_prefix("AQUEDUCT_PORT_")
            .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
}

/// The environment variable for a config key: `broker.queue_size` → `AQUEDUCT_BROKER_QUEUE_SIZE`.
pub fn env_name(key: &str) -> String {
    format!("AQUEDUCT_{}", key.replace('.', "_").to_uppercase())
}

/// Values given on the command line; `None` means "not given".
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen_addr: Option<String>,
    pub metrics_addr: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    pub aal: bool,
}

/// Where the configuration comes from.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// YAML file; `None` means none (defaults + env + flags).
    pub file: Option<PathBuf>,
    /// Environment variables to consider (normally the process's: [`process_env`]).
    pub env: Vec<(String, String)>,
    pub overrides: Overrides,
}

impl Sources {
    /// Use the process environment. Fails on an `AQUEDUCT_*` variable that is not UTF-8.
    pub fn from_process(
        file: Option<PathBuf>,
        overrides: Overrides,
    ) -> Result<Sources, ConfigError> {
        Ok(Sources {
            file,
            env: process_env()?,
            overrides,
        })
    }
}

/// The process environment's variables as text: see [`env_from`].
pub fn process_env() -> Result<Vec<(String, String)>, ConfigError> {
    env_from(std::env::vars_os())
}

/// `vars` as text. A variable whose name or value is not UTF-8 is skipped unless its name
/// starts with `AQUEDUCT_`: that one is an error naming it. (`std::env::vars` panics on any
/// such variable, so one unrelated to the broker stopped it.)
pub fn env_from(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>, ConfigError> {
    let mut env = Vec::new();
    for (name, value) in vars {
        match (name.into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => env.push((name, value)),
            (name, _) => {
                let name = match name {
                    Ok(name) => name,
                    Err(name) => name.to_string_lossy().into_owned(),
                };
                if name.starts_with("AQUEDUCT_") {
                    return Err(ConfigError::Parse(format!(
                        "environment variable {name}: not valid UTF-8"
                    )));
                }
            }
        }
    }
    Ok(env)
}

/// Transport settings, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    pub max_frame_data: u32,
    pub max_streams_per_connection: u32,
    pub max_subscriptions_per_connection: usize,
    pub max_connections: usize,
    pub idle_timeout: Duration,
    pub handshake_timeout: Duration,
    pub keep_alive_interval: Duration,
    pub stream_receive_window: u32,
    pub receive_window: u32,
    pub send_window: u64,
    pub socket_buffer: usize,
    pub initial_mtu: u16,
    /// The largest path MTU discovery probes for (and the largest datagram accepted).
    pub max_mtu: u16,
    /// Packets a client may leave unacknowledged (1: QUIC's own rule).
    pub ack_eliciting_threshold: u32,
    /// The longest a client may hold an acknowledgement back.
    pub ack_delay: Duration,
    /// First read buffer of a stream, bytes.
    pub read_buf_size: usize,
}

/// Metrics endpoint settings, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    pub max_topic_labels: usize,
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// TLS settings, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub generate: bool,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub require_client_cert: bool,
    pub client_ca_file: Option<PathBuf>,
    /// Revocation lists of the client CAs (`tls.crl_file`).
    pub crl_file: Option<PathBuf>,
    pub dev_cert_file: PathBuf,
}

/// The validated configuration the server runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub listen_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub tls: TlsConfig,
    pub broker: BrokerConfig,
    /// Coalescing writer: flush when this many bytes are pending.
    pub batch_size: usize,
    /// Coalescing writer: or this long after the first pending frame.
    pub flush_interval: Duration,
    /// Block policy: close a subscription that holds a publisher longer than this (`None`:
    /// never).
    pub block_timeout: Option<Duration>,
    /// Threads of the async runtime (`None`: one per CPU). Read by whoever builds the runtime
    /// (the `aqueduct-broker` binary), before the server starts.
    pub worker_threads: Option<usize>,
    /// How long a runtime thread out of work watches the endpoints' sockets before it sleeps
    /// (zero: never). Read by whoever builds the runtime, as `worker_threads`.
    pub idle_spin: Duration,
    pub transport: TransportConfig,
    pub metrics: MetricsConfig,
    /// The durable log, if enabled.
    pub aal: Option<AalConfig>,
    /// ACL and publish quotas.
    pub access: AccessConfig,
    /// The gRPC admin API, if enabled.
    pub admin: Option<AdminConfig>,
    /// With the admin API off and `admin.state_file` set: that file (one left from when the
    /// API was on is moved aside at startup).
    pub admin_state_when_off: Option<std::path::PathBuf>,
    /// The cluster's settings.
    pub cluster: ClusterConfig,
    /// WebTransport for browsers on the broker's port.
    pub webtransport: crate::webtransport::WebTransportConfig,
    /// OpenTelemetry export, when `tracing.otlp_endpoint` is set.
    pub tracing: Option<crate::otel::TracingConfig>,
}

impl Config {
    /// The revocation-list files a SIGHUP re-reads, by key: `tls.crl_file` and
    /// `cluster.tls.crl_file`, as named at startup (`None`: not given).
    pub fn crl_files(&self) -> [(&'static str, Option<&Path>); 2] {
        [
            (crate::revocation::CRL_KEY, self.tls.crl_file.as_deref()),
            (
                crate::revocation::MESH_CRL_KEY,
                self.cluster.crl_file.as_deref(),
            ),
        ]
    }

    /// The settings of `new` (the configuration re-read for a SIGHUP) that differ from this
    /// one's and that a reload does not apply: each takes a restart. A reload applies `acl` and
    /// `broker.quotas`, and re-reads the files `tls.crl_file` and `cluster.tls.crl_file` named at
    /// startup (a new path for either is left out here: the reload names it on its own, see
    /// [`Config::crl_files`]).
    pub fn needs_restart(&self, new: &Config) -> Vec<&'static str> {
        let tls = |c: &Config| TlsConfig {
            crl_file: None,
            ..c.tls.clone()
        };
        let cluster = |c: &Config| crate::cluster::ClusterConfig {
            crl_file: None,
            ..c.cluster.clone()
        };
        let checks: [(&'static str, bool); 16] = [
            ("listen_addr", self.listen_addr != new.listen_addr),
            ("metrics_addr", self.metrics_addr != new.metrics_addr),
            ("tls", tls(self) != tls(new)),
            ("broker", self.broker != new.broker),
            ("batch_size", self.batch_size != new.batch_size),
            ("flush_interval", self.flush_interval != new.flush_interval),
            ("block_timeout", self.block_timeout != new.block_timeout),
            ("worker_threads", self.worker_threads != new.worker_threads),
            ("idle_spin", self.idle_spin != new.idle_spin),
            ("transport", self.transport != new.transport),
            ("metrics", self.metrics != new.metrics),
            ("aal", self.aal != new.aal),
            (
                "admin",
                self.admin != new.admin || self.admin_state_when_off != new.admin_state_when_off,
            ),
            ("cluster", cluster(self) != cluster(new)),
            ("webtransport", self.webtransport != new.webtransport),
            ("tracing", self.tracing != new.tracing),
        ];
        checks
            .into_iter()
            .filter(|(_, changed)| *changed)
            .map(|(name, _)| name)
            .collect()
    }
}

impl std::fmt::Debug for AalSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let AalSection {
            enabled,
            file_path,
            key,
            previous_keys,
            allow_plaintext,
            max_aal_size,
            fsync,
            fsync_interval,
            retention_bytes,
            retention_age,
            max_consumers,
            consumer_retention,
        } = self;
        f.debug_struct("AalSection")
            .field("enabled", enabled)
            .field("file_path", file_path)
            .field("key", &if key.is_empty() { "" } else { "(set, hidden)" })
            .field(
                "previous_keys",
                &format!("({} hidden)", previous_keys.len()),
            )
            .field("allow_plaintext", allow_plaintext)
            .field("max_aal_size", max_aal_size)
            .field("fsync", fsync)
            .field("fsync_interval", fsync_interval)
            .field("retention_bytes", retention_bytes)
            .field("retention_age", retention_age)
            .field("max_consumers", max_consumers)
            .field("consumer_retention", consumer_retention)
            .finish()
    }
}

/// The durable log's settings, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AalConfig {
    pub dir: PathBuf,
    /// `None`: plaintext (`aal.allow_plaintext`).
    pub key: Option<aqueduct_log::MasterKey>,
    /// `aal.previous_keys`: keys of before a rotation, for the segments sealed with them.
    pub previous_keys: Vec<aqueduct_log::MasterKey>,
    /// `aal.allow_plaintext`: also, with a key, read plaintext segments of before.
    pub allow_plaintext: bool,
    pub max_segment_bytes: u64,
    pub fsync: aqueduct_log::FsyncMode,
    pub retention_bytes: Option<u64>,
    pub retention_age: Option<Duration>,
    /// `aal.max_consumers` and `aal.consumer_retention`.
    pub consumers: crate::consumers::ConsumerLimits,
}

impl AalConfig {
    /// The log's options (the crash offset gap is the server's, see `log_writer`).
    pub fn log_options(&self, crash_offset_gap: u64) -> aqueduct_log::LogOptions {
        aqueduct_log::LogOptions {
            key: self.key.clone(),
            previous_keys: self.previous_keys.clone(),
            allow_plaintext: self.allow_plaintext,
            max_segment_bytes: self.max_segment_bytes,
            retention_bytes: self.retention_bytes,
            retention_age: self.retention_age,
            fsync: self.fsync,
            crash_offset_gap,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        // The defaults are valid by construction; the test `defaults_are_valid` holds us to it.
        RawConfig::default()
            .validate(&[])
            .unwrap_or_else(|e| panic!("built-in defaults are invalid: {e}"))
    }
}

impl Config {
    /// Load and validate from `sources`.
    pub fn load(sources: &Sources) -> Result<Config, ConfigError> {
        raw_figment(sources)?
            .extract::<RawConfig>()
            .map_err(|e| ConfigError::Parse(describe(e)))?
            .validate(&sources.env)
    }

    /// Settings that are valid together but probably not what was meant: logged as warnings at
    /// startup, each naming its keys.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.webtransport.enabled && self.tls.require_client_cert {
            w.push(
                "tls.require_client_cert is true and webtransport.enabled is true: browsers \
                 present no client certificate, so every browser's WebTransport session fails its \
                 TLS handshake; set webtransport.enabled: false to say browsers are not served, or \
                 let them in with webtransport.tokens and ACL rules instead of requiring \
                 certificates"
                    .to_string(),
            );
        }
        let wt = &self.webtransport;
        // The token travels in the URL's query, which decodes `+` as a space and `%xx` as a
        // byte: a page must URL-encode one with other characters (the JS client does).
        let mut clients: Vec<&String> = wt
            .tokens
            .iter()
            .filter(|(t, _)| {
                t.chars()
                    .any(|c| !(c.is_ascii_alphanumeric() || "-._~".contains(c)))
            })
            .map(|(_, client)| client)
            .collect();
        clients.sort();
        for client in clients {
            w.push(format!(
                "webtransport.tokens: the token for {client:?} has characters other than letters, \
                 digits and - . _ ~: a page must URL-encode it in the session URL (the JS client \
                 does; by hand, `+` is %2B, `/` is %2F, `=` is %3D); `openssl rand -hex 24` makes \
                 one that needs none"
            ));
        }
        if wt.enabled && !wt.tokens.is_empty() && !wt.require_token && !self.access.acl.enabled {
            w.push(
                "webtransport.tokens is set, but webtransport.require_token is false and acl.enabled \
                 is false: a page that sends no token is admitted as anonymous and may do anything; \
                 set webtransport.require_token: true, or enable the ACL"
                    .to_string(),
            );
        }
        if let (Some(addr), false) = (self.webtransport.listen_addr, self.webtransport.enabled) {
            w.push(format!(
                "webtransport.listen_addr is set ({addr}) but webtransport.enabled is false: not listening there"
            ));
        }
        w
    }

    /// A configuration for tests: loopback, port 0 (any free port), a generated certificate kept
    /// in `dev_cert_file`.
    pub fn for_tests(dev_cert_file: PathBuf) -> Config {
        let mut c = Config {
            listen_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            metrics_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            ..Config::default()
        };
        c.tls.dev_cert_file = dev_cert_file;
        c
    }
}

/// Every source merged, before extraction and validation: `find_value("broker.queue_size")`
/// tells what a key was set to and by which source (for tests and diagnostics).
pub fn layered(sources: &Sources) -> Result<Figment, ConfigError> {
    raw_figment(sources)
}

fn raw_figment(sources: &Sources) -> Result<Figment, ConfigError> {
    let defaults = Figment::from(Serialized::defaults(RawConfig::default()));
    let mut fig = defaults.clone();
    if let Some(path) = &sources.file {
        if !path.is_file() {
            return Err(ConfigError::FileNotFound { path: path.clone() });
        }
        fig = fig.merge(NoNulls(serde_saphyr::figment::Yaml::file_exact(path)));
    }
    // Environment: only names that map to a key; anything else starting with AQUEDUCT_ is a typo.
    let mut env_pairs = Vec::new();
    for (name, value) in &sources.env {
        let Some(_) = name.strip_prefix("AQUEDUCT_") else {
            continue;
        };
        if ENV_OTHER.contains(&name.as_str()) {
            continue;
        }
        let Some(key) = env_key(name) else {
            if is_service_link(name) {
                continue;
            }
            return Err(ConfigError::UnknownEnv { name: name.clone() });
        };
        // Two variables for one key (the seed's name and the mechanical one): which won
        // depended on their order in the environment.
        if let Some((_, other, _)) = env_pairs.iter().find(|(k, _, _)| *k == key) {
            return Err(invalid(
                key,
                format!("set by two environment variables, {other} and {name}: unset one of them"),
            ));
        }
        env_pairs.push((key, name.clone(), value.clone()));
    }
    for (key, name, value) in env_pairs {
        // A true/false setting (its default is one) takes the seed's spellings.
        let flag = matches!(
            defaults.find_value(key),
            Ok(figment::value::Value::Bool(..))
        );
        let value = parse_env_value(key, &value, flag);
        fig = fig.merge(Named::new(
            format!("environment variable {name}"),
            key,
            value,
        ));
    }
    let o = &sources.overrides;
    let flags: [(&str, &str, &Option<String>); 4] = [
        ("listen_addr", "--addr", &o.listen_addr),
        ("metrics_addr", "--metrics-addr", &o.metrics_addr),
        ("tls.cert_file", "--cert", &o.cert_file),
        ("tls.key_file", "--key", &o.key_file),
    ];
    for (key, flag, value) in flags {
        if let Some(v) = value {
            fig = fig.merge(Named::new(format!("flag {flag}"), key, v.clone()));
        }
    }
    if o.aal {
        fig = fig.merge(Named::new("flag --aal".into(), "aal.enabled", true));
    }
    Ok(fig)
}

/// One value for one key, with the name of where it came from (an environment variable or a
/// flag), so that an error about it can say so.
/// A provider whose empty values (YAML `key:` with nothing after it, `~`, `null`, a section
/// holding only comments) are left out, so the key keeps its default — as the seed's Go YAML
/// reader took them, where they were the empty value: `rules:` with every rule commented out,
/// `cert_file:` left blank. They failed as "invalid type: found unit".
struct NoNulls<P>(P);

impl<P: figment::Provider> figment::Provider for NoNulls<P> {
    fn metadata(&self) -> figment::Metadata {
        self.0.metadata()
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        let mut data = self.0.data()?;
        for dict in data.values_mut() {
            strip_empty(dict);
        }
        Ok(data)
    }
}

/// Remove the empty values of `dict`, in nested dictionaries too; a dictionary left empty stays
/// (an empty section is a section with nothing set).
fn strip_empty(dict: &mut figment::value::Dict) {
    use figment::value::Value;
    dict.retain(|_, v| !matches!(v, Value::Empty(..)));
    for v in dict.values_mut() {
        if let Value::Dict(_, inner) = v {
            strip_empty(inner);
        }
    }
}

struct Named {
    name: String,
    inner: Serialized<figment::value::Value>,
}

impl Named {
    fn new(name: String, key: &str, value: impl Into<figment::value::Value>) -> Named {
        Named {
            name,
            inner: Serialized::default(key, value.into()),
        }
    }
}

impl figment::Provider for Named {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.name.clone())
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        self.inner.data()
    }
}

/// The items of a comma-separated list, trimmed; empty ones (`a,,b`, a trailing comma) left
/// out.
pub fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A list of text, or one comma-separated string of its items (a value written as the
/// environment takes it).
fn list_or_commas<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrCommas {
        List(Vec<String>),
        Commas(String),
    }
    let value = ListOrCommas::deserialize(d)
        .map_err(|_| <D::Error as serde::de::Error>::custom(NOT_LIST_OR_COMMAS))?;
    Ok(match value {
        ListOrCommas::List(items) => items,
        ListOrCommas::Commas(s) => split_list(&s),
    })
}

/// What [`list_or_commas`] says of a value that is neither (and no more: it may be secret).
const NOT_LIST_OR_COMMAS: &str =
    "expected a list of text, or one string of items separated by commas";

/// Keys whose value is a list of text: an environment value for them is comma-separated
/// (`AQUEDUCT_AAL_PREVIOUS_KEYS=key1,key2`; base64 has no commas).
const LIST_KEYS: &[&str] = &["aal.previous_keys"];

/// Keys whose value is text (addresses, paths, policies, durations): an environment value for
/// them stays a string even when it looks like a number (`AQUEDUCT_BROKER_FLUSH_INTERVAL=0`).
const TEXT_KEYS: &[&str] = &[
    "listen_addr",
    "metrics_addr",
    "tls.cert_file",
    "tls.key_file",
    "tls.client_ca_file",
    "tls.crl_file",
    "tls.dev_cert_file",
    "broker.backpressure_policy",
    "broker.flush_interval",
    "broker.ack_wait",
    "broker.block_timeout",
    "broker.idle_spin",
    "transport.idle_timeout",
    "transport.handshake_timeout",
    "transport.keep_alive_interval",
    "transport.ack_delay",
    "metrics.header_timeout",
    "aal.file_path",
    "aal.key",
    "aal.fsync",
    "aal.fsync_interval",
    "aal.retention_age",
    "aal.consumer_retention",
    "acl.default",
    "broker.quotas.action",
    "admin.listen_addr",
    "admin.allowed_cn",
    "admin.client_ca_file",
    "admin.state_file",
    "cluster.tls.ca_file",
    "cluster.tls.cert_file",
    "cluster.tls.key_file",
    "cluster.tls.crl_file",
    "cluster.compression",
    "cluster.discovery.type",
    "cluster.discovery.host",
    "cluster.discovery.interval",
    "tracing.otlp_endpoint",
    "tracing.otlp_ca_file",
    "tracing.otlp_cert_file",
    "tracing.otlp_key_file",
    "tracing.service_name",
    "webtransport.listen_addr",
    "webtransport.path_prefix",
];

/// Environment values are text; give figment the type the key expects, so `true` and `1024`
/// work for flags and sizes while `0` stays a duration.
fn parse_env_value(key: &str, v: &str, flag: bool) -> figment::value::Value {
    use figment::value::Value;
    if LIST_KEYS.contains(&key) {
        return Value::from(split_list(v));
    }
    if TEXT_KEYS.contains(&key) {
        return Value::from(v.to_string());
    }
    // A flag: the spellings Go's strconv.ParseBool takes (the seed's), `1` and `0` included.
    if flag {
        match v {
            "1" | "t" | "T" | "true" | "TRUE" | "True" => return Value::from(true),
            "0" | "f" | "F" | "false" | "FALSE" | "False" => return Value::from(false),
            _ => {}
        }
    }
    if let Ok(b) = v.parse::<bool>() {
        return Value::from(b);
    }
    if let Ok(n) = v.parse::<u64>() {
        return Value::from(n);
    }
    if let Ok(n) = v.parse::<i64>() {
        return Value::from(n);
    }
    // A fraction (tracing.sample_ratio).
    if let Ok(x) = v.parse::<f64>() {
        if x.is_finite() {
            return Value::from(x);
        }
    }
    Value::from(v.to_string())
}

/// figment errors name the key and the source; keep all of them, one per line.
fn describe(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            // A map whose keys are secrets (webtransport.tokens: token -> client id): the key
            // in the path is a token, never shown.
            let mut path = e.path.clone();
            if path.len() > 2 && path[..2] == ["webtransport", "tokens"] {
                path.truncate(2);
                path.push("<a token>".into());
            }
            let key = if path.is_empty() {
                String::new()
            } else {
                format!("{}: ", path.join("."))
            };
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(src) => format!(" (from {} {src})", m.name),
                    None => format!(" (from {})", m.name),
                })
                .unwrap_or_default();
            let secret = SECRET_KEYS.iter().any(|k| path.join(".").starts_with(k));
            let kind = if secret {
                secret_kind_text(&e.kind)
            } else {
                kind_text(&e.kind)
            };
            format!("{key}{kind}{source}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Keys whose values are secret: an error about one never shows the value.
const SECRET_KEYS: &[&str] = &["aal.key", "aal.previous_keys", "webtransport.tokens"];

/// A figment error kind about a secret key, with the value's kind in place of the value.
fn secret_kind_text(kind: &figment::error::Kind) -> String {
    use figment::error::{Actual, Kind};
    let what = |a: &Actual| match a {
        Actual::Bool(_) => "a boolean",
        Actual::Unsigned(_) | Actual::Signed(_) | Actual::Float(_) => "a number",
        Actual::Char(_) | Actual::Str(_) | Actual::Bytes(_) => "text",
        Actual::Seq => "a list",
        Actual::Map => "a map",
        _ => "another kind of value",
    };
    match kind {
        Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
            format!(
                "expected {expected}, found {} (not shown: it is secret)",
                what(actual)
            )
        }
        Kind::InvalidLength(len, expected) => format!("expected {expected}, found {len} items"),
        Kind::Message(m) if m == NOT_LIST_OR_COMMAS => format!("{m} (not shown: it is secret)"),
        other @ (Kind::MissingField(_) | Kind::UnknownField(..) | Kind::DuplicateField(_)) => {
            kind_text(other)
        }
        _ => "not a valid value (not shown: it is secret)".into(),
    }
}

/// A figment error kind in plain words: an unknown key with the nearest known one, a number
/// where a whole number was wanted.
fn kind_text(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        // The error's path already ends with the unknown key.
        Kind::UnknownField(field, known) => {
            let near = known
                .iter()
                .map(|k| (edit_distance(k, field), *k))
                .min()
                .filter(|(d, _)| *d <= 2);
            match near {
                Some((_, k)) => format!("unknown key (did you mean `{k}`?)"),
                None => format!("unknown key (known here: {})", known.join(", ")),
            }
        }
        Kind::InvalidType(actual, expected)
            if ["u8", "u16", "u32", "u64", "usize"].contains(&expected.as_str()) =>
        {
            format!("expected a whole number, found {actual}")
        }
        other => other.to_string(),
    }
}

/// Levenshtein distance (keys are short).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(prev + usize::from(ca != *cb));
            prev = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Go-style addresses: ":4242" means every interface, IPv6 and IPv4 (as Go's listeners do):
/// `[::]:4242`, bound dual stack, or `0.0.0.0:4242` where the host has no IPv6 (see
/// `server::bind_with_ipv4_fallback`).
pub(crate) fn parse_addr(key: &'static str, s: &str) -> Result<SocketAddr, ConfigError> {
    let full = if s.starts_with(':') {
        format!("[::]{s}")
    } else {
        s.to_string()
    };
    full.to_socket_addrs()
        .map_err(|e| {
            // A bare port ("4242", as in `-addr 4242`) is the likeliest slip.
            let hint = match s.trim().parse::<u16>() {
                Ok(port) => format!("; for port {port} on every interface write \":{port}\""),
                Err(_) => String::new(),
            };
            invalid(key, format!("{s:?} is not a host:port address ({e}){hint}"))
        })?
        .next()
        .ok_or_else(|| invalid(key, format!("{s:?} resolves to no address")))
}

pub(crate) fn parse_duration(key: &'static str, s: &str) -> Result<Duration, ConfigError> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let d = humantime::parse_duration(s).map_err(|_| {
        invalid(
            key,
            format!("{s:?} is not a duration like \"50us\", \"10s\" or \"5m\""),
        )
    })?;
    // Far beyond any sensible setting, and small enough that a deadline `now + d` can never
    // overflow (humantime accepts up to ~584 billion years).
    if d > MAX_DURATION {
        return Err(invalid(key, format!("{s:?} is longer than 100 years")));
    }
    Ok(d)
}

/// The longest duration any key (or command-line option) takes.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The keep-alive when none is configured: 10 s, or a third of the idle timeout if that is
/// shorter, so that an idle but healthy client is never dropped.
fn default_keep_alive(idle: Duration) -> Duration {
    const KEEP_ALIVE: Duration = Duration::from_secs(10);
    if idle.is_zero() {
        KEEP_ALIVE
    } else {
        KEEP_ALIVE.min(idle / 3)
    }
}

/// The coalescing window: at most [`MAX_FLUSH_INTERVAL`], since every message on a busy stream
/// may wait that long.
fn parse_flush_interval(s: &str) -> Result<Duration, ConfigError> {
    parse_bounded_duration(
        "broker.flush_interval",
        s,
        MAX_FLUSH_INTERVAL,
        "each message on a busy stream may wait this long; the seed's default is 50us",
    )
}

/// `broker.idle_spin`: at most [`MAX_IDLE_SPIN`].
fn parse_idle_spin(s: &str) -> Result<Duration, ConfigError> {
    parse_bounded_duration(
        "broker.idle_spin",
        s,
        MAX_IDLE_SPIN,
        "a spin longer than that costs more CPU than the wake-up it saves; \"0s\" turns spinning off",
    )
}

/// A duration of at most `max`; above it, the error says `why`.
fn parse_bounded_duration(
    key: &'static str,
    s: &str,
    max: Duration,
    why: &str,
) -> Result<Duration, ConfigError> {
    let d = parse_duration(key, s)?;
    if d > max {
        return Err(invalid(
            key,
            format!("{s:?} is above the maximum of {max:?} ({why})"),
        ));
    }
    Ok(d)
}

/// Default of `broker.idle_spin`.
pub const DEFAULT_IDLE_SPIN: &str = "100us";

/// Upper bound of `broker.idle_spin`.
pub const MAX_IDLE_SPIN: Duration = Duration::from_millis(1);

/// Upper bound of `broker.flush_interval`.
pub const MAX_FLUSH_INTERVAL: Duration = Duration::from_millis(100);

/// A UDP payload size: at least QUIC's minimum, and at most [`aqueduct_udp::MAX_MTU`] (above
/// it, quinn's segmentation-offload sends, ten datagrams in one, no longer fit a UDP datagram
/// and all fail).
fn mtu(key: &'static str, v: u64) -> Result<u16, ConfigError> {
    range(
        key,
        v,
        aqueduct_udp::MIN_MTU.into(),
        aqueduct_udp::MAX_MTU.into(),
    )
    .map(|v| v as u16)
}

pub(crate) fn range<T: PartialOrd + std::fmt::Display + Copy>(
    key: &'static str,
    v: T,
    min: T,
    max: T,
) -> Result<T, ConfigError> {
    bounded(key, v, min, max, |x| x.to_string())
}

/// [`range`] for durations.
pub(crate) fn duration_range(
    key: &'static str,
    v: Duration,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    bounded(key, v, min, max, |d| format!("{d:?}"))
}

fn bounded<T: PartialOrd + Copy>(
    key: &'static str,
    v: T,
    min: T,
    max: T,
    show: impl Fn(T) -> String,
) -> Result<T, ConfigError> {
    if v < min || v > max {
        let (v, min, max) = (show(v), show(min), show(max));
        return Err(invalid(key, format!("{v} is out of range {min}..={max}")));
    }
    Ok(v)
}

pub(crate) fn opt_path(s: &str) -> Option<PathBuf> {
    (!s.trim().is_empty()).then(|| PathBuf::from(s))
}

/// A certificate file and its key file, given together or not at all (the error names the
/// missing one).
pub(crate) fn cert_and_key<T>(
    cert: (&'static str, Option<T>),
    key: (&'static str, Option<T>),
) -> Result<Option<(T, T)>, ConfigError> {
    match (cert, key) {
        ((_, Some(c)), (_, Some(k))) => Ok(Some((c, k))),
        ((_, None), (_, None)) => Ok(None),
        ((cert, Some(_)), (key, None)) => Err(invalid(key, format!("required when {cert} is set"))),
        ((cert, None), (key, Some(_))) => Err(invalid(cert, format!("required when {key} is set"))),
    }
}

/// The broker's own directory: `$AQUEDUCT_HOME`, else `$HOME/.aqueduct`; `None` without either
/// (callers then fall back to a name of their own in the temporary directory, or, for files
/// whose content must be trusted, insist on an explicit path).
pub fn aqueduct_home(env: &[(String, String)]) -> Option<PathBuf> {
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    if let Some(home) = get("AQUEDUCT_HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(home));
    }
    get("HOME")
        .filter(|h| !h.is_empty())
        .map(|home| Path::new(&home).join(".aqueduct"))
}

/// Where the development certificate goes when not configured: in the Aqueduct home, else in
/// this user's private directory in the temporary directory (`<temp>/aqueduct-<uid>`, made when
/// the certificate is written), never under a fixed name there that another user could claim.
pub fn default_dev_cert_file(env: &[(String, String)]) -> PathBuf {
    aqueduct_home(env)
        .unwrap_or_else(aqueduct_udp::private_dir::path)
        .join("dev-cert.pem")
}

impl RawConfig {
    /// Check every value and convert to typed configuration.
    pub fn validate(&self, env: &[(String, String)]) -> Result<Config, ConfigError> {
        // Checked although the cluster is off, so a typo shows before it is switched on.
        let cluster = self.cluster.validate(&self.tls)?;
        let b = &self.broker;
        let policy: OverflowPolicy = b
            .backpressure_policy
            .parse()
            .map_err(|e: String| invalid("broker.backpressure_policy", e))?;
        if b.priority_ttls.len() != Priority::LEVELS {
            return Err(invalid(
                "broker.priority_ttls",
                format!(
                    "needs exactly {} durations (one per priority 0..=3), got {}",
                    Priority::LEVELS,
                    b.priority_ttls.len()
                ),
            ));
        }
        let mut priority_ttls = [Duration::ZERO; Priority::LEVELS];
        for (slot, s) in priority_ttls.iter_mut().zip(&b.priority_ttls) {
            *slot = parse_duration("broker.priority_ttls", s)?;
        }
        let broker = BrokerConfig {
            queue_size: range("broker.queue_size", b.queue_size, 1, 1 << 24)? as usize,
            backpressure_policy: policy,
            max_retries: range("broker.max_retries", b.max_retries, 0, 1000)?,
            ack_wait: parse_duration("broker.ack_wait", &b.ack_wait)?,
            priority_ttls,
            max_in_flight: range("broker.max_in_flight", b.max_in_flight, 1, 1 << 24)? as usize,
        };
        if broker.ack_wait.is_zero() {
            return Err(invalid("broker.ack_wait", "must be greater than zero"));
        }
        let t = &self.transport;
        let idle_timeout = parse_duration("transport.idle_timeout", &t.idle_timeout)?;
        let transport = TransportConfig {
            // At most 8 MiB: what carries a frame on is sized for 16 MiB (the client's reader,
            // a cluster link's block, the durable log's batch) and a delivery or a re-encoded
            // batch is larger than what was published.
            max_frame_data: range("transport.max_buf_size", t.max_buf_size, 64, 8 << 20)? as u32,
            max_streams_per_connection: range(
                "transport.max_streams_per_connection",
                t.max_streams_per_connection,
                1,
                1 << 16,
            )? as u32,
            max_subscriptions_per_connection: range(
                "transport.max_subscriptions_per_connection",
                t.max_subscriptions_per_connection,
                1,
                1 << 24,
            )? as usize,
            max_connections: range("transport.max_connections", t.max_connections, 1, 1 << 20)?
                as usize,
            idle_timeout,
            handshake_timeout: parse_duration("transport.handshake_timeout", &t.handshake_timeout)?,
            keep_alive_interval: match &t.keep_alive_interval {
                Some(k) => parse_duration("transport.keep_alive_interval", k)?,
                None => default_keep_alive(idle_timeout),
            },
            stream_receive_window: range(
                "transport.stream_receive_window",
                t.stream_receive_window,
                16 << 10,
                1 << 30,
            )? as u32,
            receive_window: range(
                "transport.receive_window",
                t.receive_window,
                16 << 10,
                1 << 30,
            )? as u32,
            send_window: range("transport.send_window", t.send_window, 16 << 10, 1 << 32)?,
            socket_buffer: range("transport.socket_buffer", t.socket_buffer, 0, 1 << 30)? as usize,
            initial_mtu: mtu("transport.initial_mtu", t.initial_mtu)?,
            max_mtu: mtu("transport.max_mtu", t.max_mtu)?,
            // Above 64, a peer's ACKs would come too seldom for the sender's congestion control
            // and loss detection to go by (the 1 ms delay bounds them only in time).
            ack_eliciting_threshold: range(
                "transport.ack_eliciting_threshold",
                t.ack_eliciting_threshold,
                1,
                64,
            )? as u32,
            // quinn peers accept no shorter delay; QUIC's default is the longest.
            ack_delay: duration_range(
                "transport.ack_delay",
                parse_duration("transport.ack_delay", &t.ack_delay)?,
                Duration::from_millis(1),
                Duration::from_millis(25),
            )?,
            // Above 64 KiB it is the same as 64 KiB (the largest read chunk).
            read_buf_size: range("transport.read_buf_size", t.read_buf_size, 64, 1 << 30)? as usize,
        };
        if !transport.idle_timeout.is_zero()
            && !transport.keep_alive_interval.is_zero()
            && transport.keep_alive_interval >= transport.idle_timeout
        {
            return Err(invalid(
                "transport.keep_alive_interval",
                format!(
                    "{:?} is not below transport.idle_timeout ({:?}): idle but healthy clients \
                     would be dropped; make the keep-alive shorter (e.g. a third of the idle \
                     timeout), or \"0\" for none (idle clients then stay only if they send \
                     keep-alives of their own)",
                    transport.keep_alive_interval, transport.idle_timeout
                ),
            ));
        }
        if transport.max_mtu < transport.initial_mtu {
            return Err(invalid(
                "transport.max_mtu",
                format!(
                    "{} is below transport.initial_mtu ({}): path MTU discovery starts at the \
                     initial MTU and probes up to max_mtu; raise max_mtu or lower initial_mtu",
                    transport.max_mtu, transport.initial_mtu
                ),
            ));
        }
        if transport.handshake_timeout.is_zero() {
            return Err(invalid(
                "transport.handshake_timeout",
                "must be greater than zero",
            ));
        }
        let tls = TlsConfig {
            generate: self.tls.generate,
            cert_file: opt_path(&self.tls.cert_file),
            key_file: opt_path(&self.tls.key_file),
            require_client_cert: self.tls.require_client_cert,
            client_ca_file: opt_path(&self.tls.client_ca_file),
            crl_file: opt_path(&self.tls.crl_file),
            dev_cert_file: opt_path(&self.tls.dev_cert_file)
                .unwrap_or_else(|| default_dev_cert_file(env)),
        };
        let own = cert_and_key(
            ("tls.cert_file", tls.cert_file.as_ref()),
            ("tls.key_file", tls.key_file.as_ref()),
        )?;
        if own.is_none() && !tls.generate {
            return Err(invalid(
                "tls.cert_file",
                "no certificate: set tls.cert_file and tls.key_file, or tls.generate: true",
            ));
        }
        for (key, path) in [
            ("tls.cert_file", &tls.cert_file),
            ("tls.key_file", &tls.key_file),
            ("tls.client_ca_file", &tls.client_ca_file),
            ("tls.crl_file", &tls.crl_file),
        ] {
            if let Some(p) = path {
                if !p.is_file() {
                    return Err(invalid(
                        key,
                        format!("{} does not exist or is not a file", p.display()),
                    ));
                }
            }
        }
        if tls.require_client_cert && tls.client_ca_file.is_none() {
            return Err(invalid(
                "tls.client_ca_file",
                "required when tls.require_client_cert is true",
            ));
        }
        // The admin API's own CA (admin.client_ca_file) is the other one the lists can serve.
        let admin_ca = self.admin.enabled && !self.admin.client_ca_file.trim().is_empty();
        if tls.crl_file.is_some() && tls.client_ca_file.is_none() && !admin_ca {
            return Err(invalid(
                "tls.crl_file",
                "needs tls.client_ca_file (or, for the admin API alone, admin.client_ca_file): \
                 the lists revoke client certificates of those CAs",
            ));
        }
        let batch_size = range("broker.batch_size", b.batch_size, 1, 16 << 20)? as usize;
        let m = &self.metrics;
        let metrics = MetricsConfig {
            max_topic_labels: range("metrics.max_topic_labels", m.max_topic_labels, 0, 1 << 20)?
                as usize,
            max_connections: range("metrics.max_connections", m.max_connections, 1, 4096)? as usize,
            header_timeout: parse_duration("metrics.header_timeout", &m.header_timeout)?,
        };
        if metrics.header_timeout.is_zero() {
            return Err(invalid(
                "metrics.header_timeout",
                "must be greater than zero",
            ));
        }
        let listen_addr = parse_addr("listen_addr", &self.listen_addr)?;
        let webtransport = self.webtransport.validate()?;
        if let Some(wt) = webtransport.listen_addr.filter(|_| webtransport.enabled) {
            // Both are UDP: the second bind would fail as if another program held the port.
            // An unspecified IPv6 address is bound dual stack (it takes IPv4 too); an
            // unspecified IPv4 address only IPv4.
            let covers = |x: SocketAddr, y: SocketAddr| {
                x.ip().is_unspecified() && (x.is_ipv6() || y.is_ipv4())
            };
            let overlap =
                wt.ip() == listen_addr.ip() || covers(wt, listen_addr) || covers(listen_addr, wt);
            if wt.port() == listen_addr.port() && wt.port() != 0 && overlap {
                return Err(invalid(
                    "webtransport.listen_addr",
                    format!(
                        "{wt} is listen_addr's own port ({listen_addr}): browsers already reach \
                         the broker there; leave webtransport.listen_addr empty, or give it a \
                         port of its own"
                    ),
                ));
            }
        }
        Ok(Config {
            listen_addr,
            metrics_addr: parse_addr("metrics_addr", &self.metrics_addr)?,
            tls,
            broker,
            batch_size,
            flush_interval: parse_flush_interval(&b.flush_interval)?,
            block_timeout: Some(parse_duration("broker.block_timeout", &b.block_timeout)?)
                .filter(|d| !d.is_zero()),
            worker_threads: match range("broker.worker_threads", b.worker_threads, 0, 1024)? {
                0 => None,
                n => Some(n as usize),
            },
            idle_spin: parse_idle_spin(&b.idle_spin)?,
            transport,
            metrics,
            aal: self.aal.validate(env)?,
            access: crate::access::validate(&self.acl, &self.broker.quotas)?,
            admin: self
                .admin
                .validate(opt_path(&self.tls.client_ca_file).as_deref(), env)?,
            // Only a file named for this broker: the default one, in the Aqueduct home, may
            // be another broker's on the same machine.
            admin_state_when_off: (!self.admin.enabled && !self.admin.state_file.trim().is_empty())
                .then(|| self.admin.state_file_path(env))
                .flatten(),
            cluster,
            webtransport,
            tracing: self.tracing.validate()?,
        })
    }
}

impl AalSection {
    /// Checked although the log is off, so a bad value shows before it is switched on; `None`
    /// when off.
    fn validate(&self, env: &[(String, String)]) -> Result<Option<AalConfig>, ConfigError> {
        let key = parse_aal_key(&self.key)?;
        let previous_keys = parse_previous_keys(&self.previous_keys)?;
        // Parsed whatever `fsync` says, as every key here is (a bad value was accepted until
        // `fsync: interval` was set).
        let every = parse_duration("aal.fsync_interval", &self.fsync_interval)?;
        let fsync = match self.fsync.trim() {
            "always" => aqueduct_log::FsyncMode::Always,
            "batch" => aqueduct_log::FsyncMode::Batch,
            "never" => aqueduct_log::FsyncMode::Never,
            "interval" => {
                if every.is_zero() {
                    return Err(invalid(
                        "aal.fsync_interval",
                        "must be greater than zero with fsync: interval (use fsync: batch to \
                         sync every group commit)",
                    ));
                }
                aqueduct_log::FsyncMode::Interval(every)
            }
            other => {
                return Err(invalid(
                    "aal.fsync",
                    format!("{other:?} is not one of always, batch, interval, never"),
                ))
            }
        };
        let retention_age = match self.retention_age.trim() {
            "" => None,
            s => Some(parse_duration("aal.retention_age", s)?).filter(|d| !d.is_zero()),
        };
        let max_segment_bytes = range("aal.max_aal_size", self.max_aal_size, 1 << 20, 1 << 40)?;
        let consumers = crate::consumers::ConsumerLimits {
            max: range("aal.max_consumers", self.max_consumers, 1, 10_000_000)? as usize,
            retention: Some(parse_duration(
                "aal.consumer_retention",
                &self.consumer_retention,
            )?)
            .filter(|d| !d.is_zero()),
        };
        if !self.enabled {
            return Ok(None);
        }
        if key.is_none() && !self.allow_plaintext {
            return Err(invalid(
                "aal.key",
                "is empty, but aal.enabled is true: give a base64-encoded 32-byte key (e.g. \
                 `openssl rand -base64 32`), or set aal.allow_plaintext: true to keep the log \
                 unencrypted",
            ));
        }
        if key.is_none() && !previous_keys.is_empty() {
            return Err(invalid(
                "aal.previous_keys",
                "are given but aal.key is empty: previous keys read the segments sealed before \
                 a key change, and new segments are sealed with aal.key; set aal.key to the new \
                 key",
            ));
        }
        let dir =
            aal_dir(&self.file_path, env).ok_or_else(|| invalid("aal.file_path", NO_AAL_DIR))?;
        if dir.is_file() {
            return Err(invalid(
                "aal.file_path",
                format!(
                    "{} is a file; aal.file_path is the log's directory (segments and indexes \
                     go inside it). The seed's single-file log cannot be read by this version: \
                     point aal.file_path at a new directory",
                    dir.display()
                ),
            ));
        }
        Ok(Some(AalConfig {
            dir,
            key,
            previous_keys,
            allow_plaintext: self.allow_plaintext,
            max_segment_bytes,
            fsync,
            retention_bytes: Some(self.retention_bytes).filter(|&b| b > 0),
            retention_age,
            consumers,
        }))
    }
}

/// `aal.key`: empty, or base64 of exactly 32 bytes.
fn parse_aal_key(s: &str) -> Result<Option<aqueduct_log::MasterKey>, ConfigError> {
    decode_master_key(s).map_err(|why| invalid("aal.key", why))
}

/// `aal.previous_keys`.
fn parse_previous_keys(keys: &[String]) -> Result<Vec<aqueduct_log::MasterKey>, ConfigError> {
    decode_previous_keys(keys).map_err(|why| invalid("aal.previous_keys", why))
}

/// Keys as `aal.previous_keys` lists them, each base64 of exactly 32 bytes. The error names the
/// one at fault by its place in the list ("key 2 of 3 …"), never by its value, and not the
/// list's name (the caller adds it).
pub fn decode_previous_keys(keys: &[String]) -> Result<Vec<aqueduct_log::MasterKey>, String> {
    let mut out = Vec::with_capacity(keys.len());
    for (i, s) in keys.iter().enumerate() {
        let which = format!("key {} of {}", i + 1, keys.len());
        match decode_master_key(s) {
            Ok(Some(k)) => out.push(k),
            Ok(None) => {
                return Err(format!(
                    "{which} is empty: give the base64 key, or remove it"
                ))
            }
            Err(why) => return Err(format!("{which} {why}")),
        }
    }
    Ok(out)
}

/// A durable log key as `aal.key` (or a key file) writes it: 32 bytes in base64, surrounding
/// white space ignored; `None` when empty. The error says what is wrong without the key's name
/// (the caller adds it) and shows no more of the key than one offending character.
pub fn decode_master_key(s: &str) -> Result<Option<aqueduct_log::MasterKey>, String> {
    use base64::Engine;
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| match e {
            base64::DecodeError::InvalidByte(at, byte) => format!(
                "is not valid base64: {:?} at position {at} is not a base64 character \
                 (A-Z a-z 0-9 + /, = at the end)",
                char::from(byte)
            ),
            other => format!("is not valid base64 ({other})"),
        })?;
    aqueduct_log::MasterKey::from_bytes(&bytes)
        .map(Some)
        .ok_or_else(|| {
            format!(
                "decodes to {} bytes; AES-256-GCM needs exactly 32 (e.g. `openssl rand \
                 -base64 32`)",
                bytes.len()
            )
        })
}

/// The log's directory for an `aal.file_path` value: the value, or when it is blank
/// `$AQUEDUCT_HOME/aal`, else `$HOME/.aqueduct/aal`. `None` when it is blank and there is no
/// home: the log is never put in the temporary directory, which a reboot or a cleaner may empty.
pub fn aal_dir(file_path: &str, env: &[(String, String)]) -> Option<PathBuf> {
    opt_path(file_path).or_else(|| aqueduct_home(env).map(|h| h.join("aal")))
}

/// Why [`aal_dir`] found no directory.
pub const NO_AAL_DIR: &str = "is empty, and neither AQUEDUCT_HOME nor HOME is set (a systemd \
     service without User= has neither), so there is no default directory for the log: name \
     one. It is not put in the temporary directory, which may be emptied at a reboot";

#[cfg(test)]
mod tests {
    use super::*;

    /// Sources of these environment variables alone.
    fn env_only(env: &[(&str, &str)]) -> Sources {
        Sources {
            file: None,
            env: env
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            overrides: Overrides::default(),
        }
    }

    /// A SIGHUP applies `acl`, `broker.quotas` and the contents of `tls.crl_file`; every other
    /// change is named as taking a restart (an edit of `admin.allowed_cn` was ignored without
    /// a word).
    #[test]
    fn a_reload_names_the_settings_that_take_a_restart() {
        let old = Config::default();
        let mut new = old.clone();
        assert!(old.needs_restart(&new).is_empty());
        new.access.acl.default = aqueduct_core::acl::Permission::None;
        new.tls.crl_file = Some("/etc/aqueduct/crl.pem".into());
        new.cluster.crl_file = Some("/etc/aqueduct/crl.pem".into());
        assert_eq!(
            new.crl_files(),
            [
                ("tls.crl_file", Some(Path::new("/etc/aqueduct/crl.pem"))),
                (
                    "cluster.tls.crl_file",
                    Some(Path::new("/etc/aqueduct/crl.pem"))
                )
            ]
        );
        assert!(
            old.needs_restart(&new).is_empty(),
            "applied by the reload, or told apart"
        );
        new.admin = Some(AdminConfig {
            listen_addr: "127.0.0.1:9091".parse().expect("addr"),
            allowed_cn: "admin-root".parse().expect("pattern"),
            client_ca_file: "/etc/aqueduct/admin-ca.pem".into(),
            state_file: "/var/lib/aqueduct/admin-state.json".into(),
        });
        new.transport.idle_timeout = Duration::from_secs(3);
        assert_eq!(old.needs_restart(&new), vec!["transport", "admin"]);
    }

    /// WebTransport on the broker's own UDP port is refused as such (it failed at bind as if
    /// another program held the port); a bare port is answered with the ":PORT" form.
    #[test]
    fn webtransport_on_the_brokers_own_port_and_a_bare_port_are_explained() {
        let load = |env: &[(&str, &str)]| Config::load(&env_only(env));
        for (listen, wt) in [
            ("127.0.0.1:14999", "127.0.0.1:14999"),
            (":14999", "127.0.0.1:14999"),
            ("127.0.0.1:14999", "0.0.0.0:14999"),
        ] {
            let e = load(&[
                ("AQUEDUCT_LISTEN_ADDR", listen),
                ("AQUEDUCT_WEBTRANSPORT_LISTEN_ADDR", wt),
            ])
            .expect_err("one port for both")
            .to_string();
            assert!(
                e.starts_with("webtransport.listen_addr:") && e.contains("own port"),
                "{e}"
            );
        }
        for (listen, wt) in [
            ("127.0.0.1:0", "127.0.0.1:0"),
            ("127.0.0.1:14999", "127.0.0.1:15000"),
            ("127.0.0.1:14999", "127.0.0.2:14999"),
            ("0.0.0.0:14999", "[::1]:14999"),
        ] {
            assert!(
                load(&[
                    ("AQUEDUCT_LISTEN_ADDR", listen),
                    ("AQUEDUCT_WEBTRANSPORT_LISTEN_ADDR", wt),
                ])
                .is_ok(),
                "{listen} and {wt}"
            );
        }
        let e = load(&[("AQUEDUCT_LISTEN_ADDR", "4242")])
            .expect_err("a bare port")
            .to_string();
        assert!(e.contains("write \":4242\""), "{e}");
    }

    /// The seed's name for a key and its mechanical one, both set: refused, naming both (which
    /// one won depended on their order in the environment).
    #[test]
    fn one_key_set_by_two_environment_variables_is_refused() {
        for env in [
            [
                ("AQUEDUCT_AAL_MAX_SIZE", "1"),
                ("AQUEDUCT_AAL_MAX_AAL_SIZE", "104857600"),
            ],
            [
                ("AQUEDUCT_AAL_MAX_AAL_SIZE", "104857600"),
                ("AQUEDUCT_AAL_MAX_SIZE", "1"),
            ],
        ] {
            let e = Config::load(&env_only(&env))
                .expect_err("two names for one key")
                .to_string();
            assert!(e.starts_with("aal.max_aal_size:"), "{e}");
            assert!(
                e.contains("AQUEDUCT_AAL_MAX_SIZE") && e.contains("AQUEDUCT_AAL_MAX_AAL_SIZE"),
                "{e}"
            );
        }
    }

    /// A variable that is not UTF-8 stops the broker only if it is one of its own, naming it:
    /// any one used to panic at startup.
    #[test]
    fn an_environment_variable_that_is_not_utf8_is_skipped_unless_it_is_ours() {
        use std::os::unix::ffi::OsStringExt;
        let text = |s: &str| std::ffi::OsString::from(s);
        let bytes = |b: &[u8]| std::ffi::OsString::from_vec(b.to_vec());
        let env = env_from([
            (text("LANG"), text("C")),
            (text("SOME_UNRELATED"), bytes(b"caf\xe9")),
            (bytes(b"\xff"), text("x")),
            (text("AQUEDUCT_HOME"), text("/var/lib/aqueduct")),
        ])
        .expect("only an unrelated variable is not UTF-8");
        assert_eq!(
            env,
            vec![
                ("LANG".to_string(), "C".to_string()),
                ("AQUEDUCT_HOME".to_string(), "/var/lib/aqueduct".to_string())
            ]
        );
        let e = env_from([(text("AQUEDUCT_AAL_FILE_PATH"), bytes(b"/data/caf\xe9"))])
            .expect_err("ours")
            .to_string();
        assert!(
            e.contains("AQUEDUCT_AAL_FILE_PATH") && e.contains("UTF-8"),
            "{e}"
        );
    }

    #[test]
    fn the_log_key_is_not_in_debug_output() {
        let a = AalSection {
            key: "c2VjcmV0LWtleS1vZi0zMi1ieXRlcy1leGFjdGx5ISE=".into(),
            ..AalSection::default()
        };
        let shown = format!("{a:?}");
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
        assert!(shown.contains("(set, hidden)"), "{shown}");
    }

    /// With the admin API off, only a state file named in the config is moved aside at
    /// startup: the default one, in the Aqueduct home, may be another broker's.
    #[test]
    fn only_a_named_state_file_is_set_aside_with_the_admin_api_off() {
        let env = [("AQUEDUCT_HOME".to_string(), "/tmp/home".to_string())];
        let mut raw = RawConfig::default();
        let c = raw.validate(&env).expect("valid");
        assert_eq!(
            c.admin_state_when_off, None,
            "the default file is left alone"
        );
        raw.admin.state_file = "/var/lib/aqueduct/admin.json".into();
        let c = raw.validate(&env).expect("valid");
        assert_eq!(
            c.admin_state_when_off.as_deref(),
            Some(std::path::Path::new("/var/lib/aqueduct/admin.json"))
        );
    }

    /// Valid but self-defeating combinations are warned about, naming their keys.
    #[test]
    fn browsers_shut_out_by_required_client_certificates_are_warned_about() {
        let mut c = Config::default();
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        c.tls.require_client_cert = true;
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("tls.require_client_cert") && w[0].contains("webtransport.enabled"),
            "{w:?}"
        );
        c.webtransport.enabled = false;
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        c.webtransport.listen_addr = Some("127.0.0.1:4443".parse().expect("addr"));
        assert!(c.warnings()[0].contains("webtransport.listen_addr"));
    }

    /// Tokens without `require_token` and without the ACL protect nothing (a page that sends no
    /// token may do anything as `anonymous`): warned about; not with either of them.
    #[test]
    fn tokens_that_protect_nothing_are_warned_about() {
        let mut c = Config::default();
        c.webtransport
            .tokens
            .insert("0123456789abcdef".into(), "web".into());
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("webtransport.require_token") && w[0].contains("acl.enabled"));
        c.webtransport.require_token = true;
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        c.webtransport.require_token = false;
        c.access.acl.enabled = true;
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        // A token a page must URL-encode: said, naming its client.
        c.webtransport
            .tokens
            .insert("0123456789abcdef+/=".into(), "dashboard".into());
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("\"dashboard\"") && w[0].contains("URL-encode"),
            "{w:?}"
        );
    }

    #[test]
    fn defaults_are_valid() {
        let c = RawConfig::default()
            .validate(&[])
            .expect("defaults validate");
        assert_eq!(c.listen_addr.port(), 4242);
        assert_eq!(c.broker.queue_size, 1024);
        assert_eq!(c.flush_interval, Duration::from_micros(50));
        assert_eq!(c.transport.max_frame_data, 65536);
    }

    #[test]
    fn env_names() {
        assert_eq!(env_name("broker.queue_size"), "AQUEDUCT_BROKER_QUEUE_SIZE");
        assert_eq!(env_name("listen_addr"), "AQUEDUCT_LISTEN_ADDR");
        for key in ENV_KEYS {
            assert!(!ENV_OTHER.contains(&env_name(key).as_str()));
        }
    }

    #[test]
    fn durations_and_addresses() {
        assert_eq!(
            parse_duration("k", "50us").expect("ok"),
            Duration::from_micros(50)
        );
        assert_eq!(parse_duration("k", "0").expect("ok"), Duration::ZERO);
        let err = parse_duration("broker.flush_interval", "50xs").expect_err("bad unit");
        assert!(
            err.to_string()
                .starts_with("broker.flush_interval: \"50xs\" is not a duration"),
            "{err}"
        );
        assert_eq!(parse_addr("k", ":4242").expect("ok").port(), 4242);
        assert!(parse_addr("listen_addr", "nope").is_err());
    }
}
