//! OpenTelemetry export (`tracing.otlp_endpoint`): spans for a traced message's receipt,
//! routing and each delivery, sent over OTLP/gRPC.
//!
//! The broker continues traces, it does not start them: only a message whose publisher sent a
//! TRACE extension with the W3C `sampled` flag set can be recorded, and of those the fraction
//! `tracing.sample_ratio`, decided on the trace id (the rule of OpenTelemetry's
//! `TraceIdRatioBased` sampler, so every node and every service with the same ratio keeps or
//! drops the same traces).
//!
//! For a recorded message the broker makes three kinds of spans:
//! - `publish` (kind server), child of the publisher's span: from the frame read off the
//!   stream until it was routed (quota, durable-log room and routing included);
//! - `route` (internal), child of `publish`: the routing itself;
//! - `deliver` (producer), child of `publish`, one per subscription the message is written
//!   to: from the publish until its frame was handed to QUIC.
//!
//! A batch frame's consecutive messages with one trace context and one topic (what a client
//! sends when it traces the batch as one operation) share one `publish` and one `route` span
//! (`messaging.batch.message_count`), and the messages of such a run that one writer sends to
//! one subscription in one go share one `deliver` span: a traced batch of 100 is a handful of
//! spans, not 300.
//!
//! The delivered TRACE extension then names the broker's `publish` span (trace id and flags
//! unchanged), so a subscriber that continues the trace makes its span a child of the
//! broker's: publisher → broker → subscriber, one trace. Spans are built here as plain data and
//! exported by one task in batches; nothing of this runs when export is off (`Shared::tracer`
//! is `None`, one branch per frame and per written delivery batch).

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aqueduct_core::{Delivery, Subscriber};
use aqueduct_proto::{Priority, PublishRef, TopicName, TraceContext};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::config::{cert_and_key, invalid, opt_path, ConfigError};

/// Spans waiting for the exporter; beyond this they are dropped and counted.
const QUEUE: usize = 16 * 1024;
/// Spans per export request.
const MAX_BATCH: usize = 512;
/// How often the queued spans are exported.
const EXPORT_EVERY: Duration = Duration::from_millis(250);
/// How long one export request may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// An export that takes longer (connecting included, which `EXPORT_TIMEOUT` does not cover) is
/// given up, its spans counted as dropped, and the exporter built again.
const EXPORT_HANG: Duration = Duration::from_secs(12);

/// `tracing.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingSection {
    /// The OTLP/gRPC collector, e.g. `http://127.0.0.1:4317` or `https://otel.example:4317`;
    /// empty: no export.
    pub otlp_endpoint: String,
    /// With an `https://` endpoint: the PEM certificates the collector's certificate must chain
    /// to; empty: the system's trusted roots.
    pub otlp_ca_file: String,
    /// With an `https://` endpoint, for a collector that asks for a client certificate: this
    /// broker's certificate chain (PEM), with `otlp_key_file`.
    pub otlp_cert_file: String,
    /// The private key (PEM) of `otlp_cert_file`.
    pub otlp_key_file: String,
    /// Fraction of sampled traces the broker records (0.0 ..= 1.0).
    pub sample_ratio: f64,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

impl Default for TracingSection {
    fn default() -> Self {
        TracingSection {
            otlp_endpoint: String::new(),
            otlp_ca_file: String::new(),
            otlp_cert_file: String::new(),
            otlp_key_file: String::new(),
            sample_ratio: 1.0,
            service_name: "aqueduct".into(),
        }
    }
}

/// Export settings, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    pub otlp_endpoint: String,
    /// TLS to the collector: `Some` exactly for an `https://` endpoint.
    pub tls: Option<OtlpTls>,
    pub sample_ratio: f64,
    pub service_name: String,
}

/// TLS to an `https://` collector, read from the files at startup.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct OtlpTls {
    /// The name the collector's certificate must carry: the endpoint's host.
    pub domain: String,
    /// PEM certificates to trust (`tracing.otlp_ca_file`); `None`: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate chain and key presented to the collector, if it asks.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

// Never prints the key.
impl std::fmt::Debug for OtlpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpTls")
            .field("domain", &self.domain)
            .field("own_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity_pem.is_some())
            .finish()
    }
}

impl OtlpTls {
    /// `tracing.otlp_ca_file`, `otlp_cert_file` and `otlp_key_file`, each read once and
    /// checked as TLS will use it (errors name the key).
    fn read(section: &TracingSection, domain: String) -> Result<OtlpTls, ConfigError> {
        let ca_pem = match opt_path(&section.otlp_ca_file) {
            Some(path) => {
                let pem = read_file("tracing.otlp_ca_file", &path)?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in pem_certs("tracing.otlp_ca_file", &path, &pem)? {
                    roots.add(cert).map_err(|e| {
                        let at = path.display();
                        invalid(
                            "tracing.otlp_ca_file",
                            format!("{at} holds a certificate that cannot be a root: {e}"),
                        )
                    })?;
                }
                Some(pem)
            }
            None => None,
        };
        let identity_pem = match cert_and_key(
            ("tracing.otlp_cert_file", opt_path(&section.otlp_cert_file)),
            ("tracing.otlp_key_file", opt_path(&section.otlp_key_file)),
        )? {
            Some((cert, key)) => {
                let (cert_pem, key_pem) = (
                    read_file("tracing.otlp_cert_file", &cert)?,
                    read_file("tracing.otlp_key_file", &key)?,
                );
                let chain = pem_certs("tracing.otlp_cert_file", &cert, &cert_pem)?;
                use rustls_pki_types::pem::PemObject;
                let private =
                    rustls_pki_types::PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                        let at = key.display();
                        invalid(
                            "tracing.otlp_key_file",
                            format!("cannot read a PEM private key from {at}: {e}"),
                        )
                    })?;
                // The pair as TLS will use it: a key of another certificate is refused here,
                // naming the key, rather than by every export.
                rustls::ClientConfig::builder_with_provider(crate::tls::provider())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| invalid("tracing.otlp_cert_file", e.to_string()))?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| {
                        let (key, cert) = (key.display(), cert.display());
                        invalid(
                            "tracing.otlp_key_file",
                            format!(
                                "{key} is not the private key of tracing.otlp_cert_file \
                                 {cert} ({e})"
                            ),
                        )
                    })?;
                Some((cert_pem, key_pem))
            }
            None => None,
        };
        Ok(OtlpTls {
            domain,
            ca_pem,
            identity_pem,
        })
    }

    /// tonic's TLS settings for the collector.
    fn client_config(&self) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let mut tls = ClientTlsConfig::new().domain_name(self.domain.clone());
        tls = match &self.ca_pem {
            Some(pem) => tls.ca_certificate(Certificate::from_pem(pem)),
            None => tls.with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity_pem {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        tls
    }
}

fn read_file(key: &'static str, path: &std::path::Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))
}

/// The certificates of `pem` (the contents of `path`): at least one.
fn pem_certs(
    key: &'static str,
    path: &std::path::Path,
    pem: &[u8],
) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, ConfigError> {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(
            key,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

// The ratio is checked to be within 0.0..=1.0, never NaN.
impl Eq for TracingConfig {}

impl TracingSection {
    /// `None` when export is off. The ratio is checked either way.
    pub fn validate(&self) -> Result<Option<TracingConfig>, ConfigError> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid(
                "tracing.sample_ratio",
                format!(
                    "must be between 0.0 and 1.0 (a fraction of traces), got {}",
                    self.sample_ratio
                ),
            ));
        }
        if self.service_name.trim().is_empty() {
            return Err(invalid("tracing.service_name", "must not be empty"));
        }
        let endpoint = self.otlp_endpoint.trim();
        let expected = || {
            invalid(
                "tracing.otlp_endpoint",
                format!(
                    "{endpoint:?}: expected http://HOST:PORT or https://HOST:PORT, e.g. \
                     http://127.0.0.1:4317"
                ),
            )
        };
        if endpoint.is_empty() {
            return Ok(None);
        }
        let (rest, secure) = match (
            endpoint.strip_prefix("http://"),
            endpoint.strip_prefix("https://"),
        ) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => return Err(expected()),
        };
        let authority = rest.split('/').next().unwrap_or_default();
        let host = url::Url::parse(endpoint)
            .ok()
            .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_string()))
            .filter(|h| !h.is_empty());
        let Some(host) = host.filter(|_| !authority.is_empty()) else {
            return Err(expected());
        };
        // `http://` without one dialled port 80: never a collector's (OTLP/gRPC's is 4317).
        // `https://` without one is port 443, where hosted collectors listen.
        let has_port = secure
            || authority.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty() && !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
            });
        if !has_port {
            return Err(invalid(
                "tracing.otlp_endpoint",
                format!("{endpoint:?} has no port: OTLP/gRPC's is usually 4317, e.g. http://{authority}:4317"),
            ));
        }
        // OTLP/gRPC has no path; `/v1/traces` is OTLP/HTTP's, which the broker does not speak.
        let path = &rest[authority.len()..];
        if !path.trim_end_matches('/').is_empty() {
            return Err(invalid(
                "tracing.otlp_endpoint",
                format!(
                    "{endpoint:?} has a path ({path}): the broker exports over OTLP/gRPC, whose \
                     endpoint is only http(s)://HOST:PORT (usually port 4317); a path such as \
                     /v1/traces belongs to OTLP/HTTP, which it does not speak"
                ),
            ));
        }
        let tls = if secure {
            Some(OtlpTls::read(self, host)?)
        } else {
            let tls_keys = [
                ("tracing.otlp_ca_file", &self.otlp_ca_file),
                ("tracing.otlp_cert_file", &self.otlp_cert_file),
                ("tracing.otlp_key_file", &self.otlp_key_file),
            ];
            if let Some((key, _)) = tls_keys.iter().find(|(_, v)| !v.trim().is_empty()) {
                return Err(invalid(
                    key,
                    format!(
                        "is for TLS to the collector, but tracing.otlp_endpoint {endpoint:?} is \
                         plain http://: use https://"
                    ),
                ));
            }
            None
        };
        Ok(Some(TracingConfig {
            otlp_endpoint: endpoint.to_string(),
            tls,
            sample_ratio: self.sample_ratio,
            service_name: self.service_name.trim().to_string(),
        }))
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct TracerStats {
    /// Spans made.
    pub recorded: AtomicU64,
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans lost: the queue was full, or the collector refused or could not be reached.
    pub dropped: AtomicU64,
    /// Export requests that failed.
    pub export_failures: AtomicU64,
}

/// Makes the broker's spans and queues them for the exporter.
#[derive(Debug)]
pub struct Tracer {
    /// Records a sampled trace iff `(lower 64 bits of its trace id) >> 1 < bound`.
    bound: u64,
    tx: mpsc::Sender<SpanData>,
    scope: InstrumentationScope,
    pub stats: TracerStats,
}

/// A message being recorded: its trace and the broker's `publish` span.
#[derive(Debug, Clone, Copy)]
pub struct Recording {
    trace_id: [u8; 16],
    /// The publisher's span.
    parent: [u8; 8],
    flags: u8,
    /// The broker's `publish` span.
    span_id: [u8; 8],
    received: SystemTime,
}

impl Recording {
    /// The trace context deliveries carry: the broker's `publish` span.
    pub fn context(&self) -> TraceContext {
        TraceContext {
            trace_id: self.trace_id,
            span_id: self.span_id,
            flags: self.flags,
        }
    }
}

/// A span's place in its trace.
struct Ids {
    trace_id: [u8; 16],
    flags: u8,
    span_id: [u8; 8],
    parent: [u8; 8],
    remote_parent: bool,
}

/// What a `publish` span says about its message.
#[derive(Debug)]
pub struct Published<'a> {
    pub topic: &'a [u8],
    pub priority: Priority,
    pub body_len: usize,
    /// Its offset in the topic, when known here.
    pub offset: Option<u64>,
    /// Subscriptions it was handed to, when known (a batch's messages are routed together).
    pub routed: Option<usize>,
    /// The publishing client's id.
    pub client: &'a str,
    /// Messages the span covers (a run of a batch frame with one trace context and topic).
    pub messages: usize,
    /// The last one's offset, when `messages` > 1 and known.
    pub last_offset: Option<u64>,
}

/// The runs of a batch frame's messages that are one `publish` span: consecutive messages with
/// the same trace context and topic, as (first index, length, context).
pub fn trace_runs(refs: &[PublishRef<'_>]) -> Vec<(usize, usize, TraceContext)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < refs.len() {
        let Some(t) = refs[i].trace else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while j < refs.len() && refs[j].trace == Some(t) && refs[j].topic == refs[i].topic {
            j += 1;
        }
        runs.push((i, j - i, t));
        i = j;
    }
    runs
}

/// Deliveries that are one `deliver` span: consecutive messages of one recorded trace context
/// (one `publish` span), topic and attempt, written to one subscription in one go.
#[derive(Debug)]
pub struct Delivered {
    trace: TraceContext,
    /// The trace context names another node's `publish` span (a cluster copy).
    remote: bool,
    topic: TopicName,
    attempt: u32,
    priority: Priority,
    first_offset: u64,
    last_offset: u64,
    messages: usize,
    bytes: usize,
    /// When the earliest was published.
    since: Instant,
}

impl Delivered {
    pub fn new(d: &Delivery, trace: TraceContext) -> Delivered {
        Delivered {
            trace,
            remote: d.trace_is_remote(),
            topic: d.topic().clone(),
            attempt: d.attempt(),
            priority: d.priority(),
            first_offset: d.offset(),
            last_offset: d.offset(),
            messages: 1,
            bytes: d.body_len(),
            since: d.published_at(),
        }
    }

    /// Take `d` (with context `trace`) into this span if it belongs there.
    pub fn absorb(&mut self, d: &Delivery, trace: &TraceContext) -> bool {
        // (One trace context names one publish span, made on one node: remote alike.)
        if *trace != self.trace || d.attempt() != self.attempt || d.topic() != &self.topic {
            return false;
        }
        self.last_offset = d.offset();
        self.messages += 1;
        self.bytes += d.body_len();
        self.since = self.since.min(d.published_at());
        true
    }
}

thread_local! {
    static RNG: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 8];
    // A failing system RNG leaves a time-based seed: span ids need only be unique.
    if ring::rand::SystemRandom::new().fill(&mut b).is_err() {
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        b = (t.as_nanos() as u64).to_le_bytes();
    }
    u64::from_le_bytes(b) | 1
}

/// A random non-zero span id (splitmix64 on a per-thread state).
fn span_id() -> [u8; 8] {
    RNG.with(|s| {
        let mut z = s.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        s.set(z);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        z.max(1).to_be_bytes()
    })
}

/// The sampling bound for `ratio`, as OpenTelemetry's `TraceIdRatioBased` computes it.
fn bound(ratio: f64) -> u64 {
    if ratio >= 1.0 {
        u64::MAX
    } else {
        (ratio.max(0.0) * (1u64 << 63) as f64) as u64
    }
}

fn to_system(at: Instant, now: Instant, now_sys: SystemTime) -> SystemTime {
    now_sys
        .checked_sub(now.saturating_duration_since(at))
        .unwrap_or(now_sys)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The OTLP/gRPC exporter `config` asks for (its channel connects lazily, on the runtime).
fn build_exporter(config: &TracingConfig) -> Result<opentelemetry_otlp::SpanExporter, String> {
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_otlp::WithTonicConfig;
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(config.otlp_endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT);
    if let Some(tls) = &config.tls {
        builder = builder.with_tls_config(tls.client_config());
    }
    let system_roots = config.tls.as_ref().is_some_and(|t| t.ca_pem.is_none());
    let mut exporter = builder.build().map_err(|e| {
        let hint = if system_roots {
            " (the collector is verified against the system's trusted roots: install them, \
                 e.g. Debian's ca-certificates, or name the collector's CA in \
                 tracing.otlp_ca_file)"
        } else {
            ""
        };
        format!(
            "tracing.otlp_endpoint {:?}: {e}{hint}",
            config.otlp_endpoint
        )
    })?;
    exporter.set_resource(
        &opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(config.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build(),
    );
    Ok(exporter)
}

impl Tracer {
    /// The tracer and its export task (run it with [`Export::run`]). Must be called inside a
    /// tokio runtime (the gRPC channel is set up lazily on it).
    pub fn start(config: &TracingConfig) -> Result<(Arc<Tracer>, Export), String> {
        let exporter = build_exporter(config)?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let tracer = Arc::new(Tracer {
            bound: bound(config.sample_ratio),
            tx,
            scope: InstrumentationScope::builder("aqueduct-broker")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            stats: TracerStats::default(),
        });
        let export = Export {
            exporter,
            rx,
            tracer: tracer.clone(),
            endpoint: config.otlp_endpoint.clone(),
            config: config.clone(),
        };
        Ok((tracer, export))
    }

    /// Does the broker record this trace?
    pub fn samples(&self, t: &TraceContext) -> bool {
        // All-zero ids are invalid (W3C, OpenTelemetry's `SpanContext::is_valid`): not recorded
        // (a zero trace id passed every ratio; backends may refuse the batch it is in). The
        // context still travels on to subscribers as it came.
        if !t.is_sampled() || t.trace_id == [0; 16] || t.span_id == [0; 8] {
            return false;
        }
        let mut low = [0u8; 8];
        low.copy_from_slice(&t.trace_id[8..]);
        (u64::from_be_bytes(low) >> 1) < self.bound
    }

    /// Start recording a message received at `received`, if its trace is sampled.
    pub fn begin(&self, t: &TraceContext, received: SystemTime) -> Option<Recording> {
        self.samples(t).then(|| Recording {
            trace_id: t.trace_id,
            parent: t.span_id,
            flags: t.flags,
            span_id: span_id(),
            received,
        })
    }

    fn span(
        &self,
        ids: Ids,
        kind: SpanKind,
        name: &'static str,
        (start, end): (SystemTime, SystemTime),
        attributes: Vec<KeyValue>,
    ) {
        let span = SpanData {
            span_context: SpanContext::new(
                TraceId::from_bytes(ids.trace_id),
                SpanId::from_bytes(ids.span_id),
                TraceFlags::new(ids.flags),
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::from_bytes(ids.parent),
            parent_span_is_remote: ids.remote_parent,
            span_kind: kind,
            name: Cow::Borrowed(name),
            start_time: start,
            end_time: end.max(start),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        };
        self.stats.recorded.fetch_add(1, Ordering::Relaxed);
        if self.tx.try_send(span).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The `publish` and `route` spans of a recorded message: routed from `route.0` to
    /// `route.1`, done (its answer queued) now.
    pub fn published(&self, r: &Recording, route: (SystemTime, SystemTime), p: &Published<'_>) {
        let mut attrs = vec![
            KeyValue::new("messaging.system", "aqueduct"),
            KeyValue::new("messaging.operation.name", "publish"),
            KeyValue::new("messaging.destination.name", text(p.topic)),
            KeyValue::new("messaging.message.body.size", p.body_len as i64),
            KeyValue::new("messaging.client.id", p.client.to_string()),
            KeyValue::new("aqueduct.priority", i64::from(p.priority.level())),
        ];
        if let Some(o) = p.offset {
            attrs.push(KeyValue::new("aqueduct.offset", o as i64));
        }
        if p.messages > 1 {
            attrs.push(KeyValue::new(
                "messaging.batch.message_count",
                p.messages as i64,
            ));
            if let Some(o) = p.last_offset {
                attrs.push(KeyValue::new("aqueduct.offset.last", o as i64));
            }
        }
        let mut route_attrs = vec![KeyValue::new("messaging.destination.name", text(p.topic))];
        if let Some(n) = p.routed {
            route_attrs.push(KeyValue::new("aqueduct.routed", n as i64));
        }
        let done = SystemTime::now();
        self.span(
            Ids {
                trace_id: r.trace_id,
                flags: r.flags,
                span_id: r.span_id,
                parent: r.parent,
                remote_parent: true,
            },
            SpanKind::Server,
            "publish",
            (r.received, done),
            attrs,
        );
        self.span(
            Ids {
                trace_id: r.trace_id,
                flags: r.flags,
                span_id: span_id(),
                parent: r.span_id,
                remote_parent: false,
            },
            SpanKind::Internal,
            "route",
            route,
            route_attrs,
        );
    }

    /// The `deliver` span of the recorded deliveries `g` (their trace context names the
    /// broker's `publish` span), just written to `sub`'s stream for `client`.
    pub fn delivered(
        &self,
        g: &Delivered,
        sub: &Subscriber,
        client: &str,
        now: Instant,
        now_sys: SystemTime,
    ) {
        let mut attrs = vec![
            KeyValue::new("messaging.system", "aqueduct"),
            KeyValue::new("messaging.operation.name", "deliver"),
            KeyValue::new("messaging.destination.name", g.topic.as_str().to_string()),
            KeyValue::new(
                "messaging.destination.subscription.name",
                sub.filter().to_string(),
            ),
            KeyValue::new("messaging.client.id", client.to_string()),
            KeyValue::new("messaging.message.body.size", g.bytes as i64),
            KeyValue::new("aqueduct.priority", i64::from(g.priority.level())),
            KeyValue::new("aqueduct.offset", g.first_offset as i64),
            KeyValue::new("aqueduct.attempt", i64::from(g.attempt)),
            KeyValue::new("aqueduct.stream_id", i64::from(sub.stream_id())),
        ];
        if g.messages > 1 {
            attrs.push(KeyValue::new(
                "messaging.batch.message_count",
                g.messages as i64,
            ));
            attrs.push(KeyValue::new("aqueduct.offset.last", g.last_offset as i64));
        }
        if let Some(group) = sub.group() {
            attrs.push(KeyValue::new(
                "messaging.consumer.group.name",
                group.id().to_string(),
            ));
        }
        let t = &g.trace;
        self.span(
            Ids {
                trace_id: t.trace_id,
                flags: t.flags,
                span_id: span_id(),
                parent: t.span_id,
                // The broker's publish span: this node's, or a cluster peer's for a copy it
                // forwarded.
                remote_parent: g.remote,
            },
            SpanKind::Producer,
            "deliver",
            (to_system(g.since, now, now_sys), now_sys),
            attrs,
        );
    }
}

/// Sends the queued spans to the collector in batches.
#[derive(Debug)]
pub struct Export {
    exporter: opentelemetry_otlp::SpanExporter,
    rx: mpsc::Receiver<SpanData>,
    tracer: Arc<Tracer>,
    endpoint: String,
    /// To build a new exporter when one hangs (see [`EXPORT_HANG`]).
    config: TracingConfig,
}

impl Export {
    /// Export until `stop`, then export what is queued (within `EXPORT_TIMEOUT`) and end.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        info!(endpoint = %self.endpoint, "exporting trace spans (OTLP/gRPC)");
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut failing = false;
        // Polled on a clock, not woken per span: a stream task queueing a span wakes no one
        // (waking this task, and the worker thread it sleeps on, per span cost more than the
        // span).
        let mut tick = tokio::time::interval(EXPORT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.changed() => break,
                _ = tick.tick() => {}
            }
            while let Ok(span) = self.rx.try_recv() {
                batch.push(span);
                if batch.len() == MAX_BATCH {
                    failing = self.send(&mut batch, failing).await;
                }
            }
            failing = self.send(&mut batch, failing).await;
        }
        // Stopping: what is queued still goes out.
        while let Ok(span) = self.rx.try_recv() {
            batch.push(span);
            if batch.len() == MAX_BATCH {
                failing = self.send(&mut batch, failing).await;
            }
        }
        self.send(&mut batch, failing).await;
        if let Err(e) = self.exporter.shutdown() {
            debug!("trace exporter shutdown: {e}");
        }
    }

    /// Export `batch` (emptied); returns whether it failed. A failure is logged when the
    /// export starts failing and when it recovers, not for every request.
    async fn send(&mut self, batch: &mut Vec<SpanData>, failing: bool) -> bool {
        if batch.is_empty() {
            return failing;
        }
        let n = batch.len() as u64;
        let stats = &self.tracer.stats;
        let exported =
            tokio::time::timeout(EXPORT_HANG, self.exporter.export(std::mem::take(batch))).await;
        let result = match exported {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => {
                // The exporter's own timeout covers the gRPC call, not the connection it makes
                // first (a collector that takes the TCP connection and never answers the TLS
                // handshake, an address that drops packets): its channel stays stuck in that
                // connect, and every later export behind it. A new exporter starts afresh.
                match build_exporter(&self.config) {
                    Ok(fresh) => self.exporter = fresh,
                    Err(e) => debug!("trace exporter not rebuilt: {e}"),
                }
                Err(format!(
                    "no answer within {EXPORT_HANG:?} (the connection to the collector did not \
                     complete)"
                ))
            }
        };
        match result {
            Ok(()) => {
                stats.exported.fetch_add(n, Ordering::Relaxed);
                if failing {
                    info!(endpoint = %self.endpoint, "trace export works again");
                }
                false
            }
            Err(e) => {
                stats.dropped.fetch_add(n, Ordering::Relaxed);
                stats.export_failures.fetch_add(1, Ordering::Relaxed);
                if !failing {
                    warn!(endpoint = %self.endpoint, "trace export failed, {n} spans lost (aqueduct_trace_spans_dropped_total counts them; logged again when it works): {e}");
                }
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(low: u64, flags: u8) -> TraceContext {
        let mut trace_id = [1u8; 16];
        trace_id[8..].copy_from_slice(&low.to_be_bytes());
        TraceContext {
            trace_id,
            span_id: [2; 8],
            flags,
        }
    }

    /// A tracer whose queue holds one span (kept while the receiver lives).
    fn tracer_with_queue(ratio: f64) -> (Tracer, mpsc::Receiver<SpanData>) {
        let (tx, rx) = mpsc::channel(1);
        let t = Tracer {
            bound: bound(ratio),
            tx,
            scope: InstrumentationScope::builder("t").build(),
            stats: TracerStats::default(),
        };
        (t, rx)
    }

    fn tracer(ratio: f64) -> Tracer {
        tracer_with_queue(ratio).0
    }

    #[test]
    fn sampling_follows_the_flag_and_the_trace_id_ratio() {
        let all = tracer(1.0);
        assert!(all.samples(&trace(u64::MAX, 1)));
        assert!(!all.samples(&trace(0, 0)), "unsampled by the publisher");
        assert!(!tracer(0.0).samples(&trace(0, 1)));
        // Invalid (all-zero) ids are never recorded: a zero trace id passed every ratio.
        let zero_trace = TraceContext {
            trace_id: [0; 16],
            span_id: [2; 8],
            flags: 1,
        };
        assert!(!tracer(0.5).samples(&zero_trace));
        let zero_span = TraceContext {
            span_id: [0; 8],
            ..trace(0, 1)
        };
        assert!(!all.samples(&zero_span));
        let tenth = tracer(0.1);
        // The ratio applies to the trace id's lower 64 bits (>> 1) against ratio * 2^63.
        assert!(tenth.samples(&trace((u64::MAX / 10) - 1024, 1)));
        assert!(!tenth.samples(&trace((u64::MAX / 10) + 1024, 1)));
        // Over many random trace ids, about the ratio.
        let kept = (0..100_000u64)
            .filter(|_| tenth.samples(&trace(u64::from_be_bytes(span_id()), 1)))
            .count();
        assert!((9_000..11_000).contains(&kept), "{kept}");
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let (t, mut rx) = tracer_with_queue(1.0);
        let r = t.begin(&trace(1, 1), SystemTime::now()).expect("sampled");
        assert_ne!(r.context().span_id, [2; 8], "the broker's own span");
        let now = SystemTime::now();
        let p = Published {
            topic: b"t",
            priority: Priority::DEFAULT,
            body_len: 1,
            offset: Some(0),
            routed: Some(1),
            client: "c",
            messages: 1,
            last_offset: None,
        };
        t.published(&r, (now, now), &p);
        // publish and route: the queue holds one, the other is dropped.
        assert_eq!(t.stats.recorded.load(Ordering::Relaxed), 2);
        assert_eq!(t.stats.dropped.load(Ordering::Relaxed), 1);
        let publish = rx.try_recv().expect("queued");
        assert_eq!(publish.name, "publish");
        assert_eq!(
            publish.span_context.span_id().to_bytes(),
            r.context().span_id
        );
        assert_eq!(publish.parent_span_id.to_bytes(), [2; 8]);
    }

    #[test]
    fn endpoint_and_ratio_are_checked() {
        let ok = |e: &str| TracingSection {
            otlp_endpoint: e.into(),
            ..TracingSection::default()
        };
        assert!(matches!(ok("").validate(), Ok(None)));
        assert!(ok("http://127.0.0.1:4317")
            .validate()
            .expect("ok")
            .is_some());
        for bad in [
            "127.0.0.1:4317",
            "grpc://collector:4317",
            "http://",
            "http://a b",
            "http://127.0.0.1:4318/v1/traces",
            "http://collector",
            "http://[::1]",
        ] {
            let e = ok(bad).validate().expect_err(bad).to_string();
            assert!(e.contains("tracing.otlp_endpoint"), "{e}");
        }
        let ratio = TracingSection {
            sample_ratio: 1.5,
            ..TracingSection::default()
        };
        assert!(ratio
            .validate()
            .expect_err("ratio")
            .to_string()
            .contains("tracing.sample_ratio"));
    }

    #[test]
    fn tls_to_the_collector_is_checked_naming_each_key() {
        let dir = tempfile::tempdir().expect("dir");
        let generated =
            rcgen::generate_simple_self_signed(vec!["collector".to_string()]).expect("cert");
        let (cert, key, junk) = (
            dir.path().join("c.pem"),
            dir.path().join("c.key"),
            dir.path().join("junk.pem"),
        );
        std::fs::write(&cert, generated.cert.pem()).expect("write");
        std::fs::write(&key, generated.signing_key.serialize_pem()).expect("write");
        std::fs::write(&junk, "not PEM at all").expect("write");
        let path = |p: &std::path::Path| p.display().to_string();
        let section = |endpoint: &str, ca: &str, cert: &str, key: &str| TracingSection {
            otlp_endpoint: endpoint.into(),
            otlp_ca_file: ca.into(),
            otlp_cert_file: cert.into(),
            otlp_key_file: key.into(),
            ..TracingSection::default()
        };
        // https:// alone: the system's roots, no client certificate.
        let system = section("https://collector:4317", "", "", "")
            .validate()
            .expect("valid")
            .expect("on");
        assert_eq!(
            system.tls,
            Some(OtlpTls {
                domain: "collector".into(),
                ..OtlpTls::default()
            })
        );
        // Everything given: read at startup; the key never shows in the debug form.
        let full = section(
            "https://[::1]:4317",
            &path(&cert),
            &path(&cert),
            &path(&key),
        )
        .validate()
        .expect("valid")
        .expect("on");
        let tls = full.tls.expect("tls");
        assert_eq!(tls.domain, "::1");
        assert_eq!(tls.ca_pem.as_deref(), Some(generated.cert.pem().as_bytes()));
        assert!(tls.identity_pem.is_some());
        assert!(!format!("{tls:?}").contains("PRIVATE KEY"));
        let refused = |s: TracingSection, key: &str, words: &str| {
            let e = s.validate().expect_err(key).to_string();
            assert!(e.contains(key) && e.contains(words), "{key}: {e}");
        };
        refused(
            section("http://collector:4317", &path(&cert), "", ""),
            "tracing.otlp_ca_file",
            "use https://",
        );
        refused(
            section("http://collector:4317", "", "", &path(&key)),
            "tracing.otlp_key_file",
            "use https://",
        );
        refused(
            section("https://collector:4317", "", &path(&cert), ""),
            "tracing.otlp_key_file",
            "required when tracing.otlp_cert_file is set",
        );
        refused(
            section("https://collector:4317", "", "", &path(&key)),
            "tracing.otlp_cert_file",
            "required when tracing.otlp_key_file is set",
        );
        refused(
            section("https://collector:4317", "/nonexistent/ca.pem", "", ""),
            "tracing.otlp_ca_file",
            "/nonexistent/ca.pem",
        );
        refused(
            section("https://collector:4317", &path(&junk), "", ""),
            "tracing.otlp_ca_file",
            "no PEM certificate",
        );
        refused(
            section("https://collector:4317", "", &path(&cert), &path(&cert)),
            "tracing.otlp_key_file",
            "private key",
        );
        let other = rcgen::generate_simple_self_signed(vec!["other".to_string()]).expect("cert");
        let other_key = dir.path().join("other.key");
        std::fs::write(&other_key, other.signing_key.serialize_pem()).expect("write");
        refused(
            section(
                "https://collector:4317",
                "",
                &path(&cert),
                &path(&other_key),
            ),
            "tracing.otlp_key_file",
            "is not the private key of tracing.otlp_cert_file",
        );
    }

    #[test]
    fn a_batch_is_one_publish_span_per_run_of_one_context_and_topic() {
        let topic = |t: &'static str| aqueduct_proto::TopicRef::new(t.as_bytes()).expect("valid");
        let (a, b) = (trace(1, 1), trace(2, 1));
        let msg = |t: &'static str, trace: Option<TraceContext>| PublishRef {
            topic: topic(t),
            body: b"",
            priority: Priority::DEFAULT,
            ttl_ms: None,
            trace,
            compression: None,
        };
        let refs = [
            msg("x", Some(a)),
            msg("x", Some(a)),
            msg("y", Some(a)),
            msg("y", None),
            msg("y", Some(b)),
            msg("y", Some(b)),
            msg("y", Some(a)),
        ];
        assert_eq!(
            trace_runs(&refs),
            [(0, 2, a), (2, 1, a), (4, 2, b), (6, 1, a)],
            "split by topic and by context; untraced messages are in none"
        );
    }
}
