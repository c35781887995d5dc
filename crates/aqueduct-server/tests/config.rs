//! Configuration: precedence flag > env > file > default, and errors that name the key.

use std::path::PathBuf;
use std::time::Duration;

use aqueduct_proto::OverflowPolicy;
use aqueduct_server::{Config, ConfigError, Overrides, Sources};

fn file(dir: &tempfile::TempDir, yaml: &str) -> PathBuf {
    let path = dir.path().join("aqueduct.yaml");
    std::fs::write(&path, yaml).expect("write config");
    path
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn load(
    file: Option<PathBuf>,
    env: Vec<(String, String)>,
    overrides: Overrides,
) -> Result<Config, ConfigError> {
    Config::load(&Sources {
        file,
        env,
        overrides,
    })
}

/// `tls.crl_file` with the admin API's own CA and no clients' CA: taken (it was refused as
/// needing `tls.client_ca_file`, so an admin certificate could not be revoked).
#[test]
fn a_revocation_list_for_the_admin_ca_alone_is_taken() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("a.pem");
    std::fs::write(&file, "x").expect("write");
    let f = file.display();
    let yaml = dir.path().join("config.yaml");
    std::fs::write(
        &yaml,
        format!(
            "tls:\n  crl_file: {f}\nadmin:\n  enabled: true\n  client_ca_file: {f}\n  \
             state_file: {f}.state\n"
        ),
    )
    .expect("write");
    let c = load(Some(yaml), vec![], Overrides::default()).expect("taken");
    assert_eq!(c.tls.crl_file.as_deref(), Some(file.as_path()));
}

#[test]
fn defaults_without_any_source() {
    let c = load(None, vec![], Overrides::default()).expect("defaults");
    assert_eq!(c.listen_addr.to_string(), "[::]:4242");
    assert_eq!(c.metrics_addr.to_string(), "127.0.0.1:9090");
    assert_eq!(c.broker.queue_size, 1024);
    assert_eq!(c.broker.backpressure_policy, OverflowPolicy::DropOldest);
    assert_eq!(c.batch_size, 65536);
    assert_eq!(c.flush_interval, Duration::from_micros(50));
    assert_eq!(c.broker.max_retries, 3);
    assert_eq!(c.transport.max_frame_data, 65536);
    assert!(c.tls.generate);
    assert_eq!(c.worker_threads, None, "one runtime thread per CPU");
    assert_eq!(c.idle_spin, Duration::from_micros(100));
}

/// `broker.idle_spin` from the file or the environment; "0s" (or "0") turns it off.
#[test]
fn idle_spin_from_the_file_or_the_environment() {
    let dir = tempfile::tempdir().expect("dir");
    let path = file(&dir, "broker:\n  idle_spin: 250us\n");
    let c = load(Some(path.clone()), vec![], Overrides::default()).expect("file");
    assert_eq!(c.idle_spin, Duration::from_micros(250));
    for off in ["0s", "0"] {
        let c = load(
            Some(path.clone()),
            env(&[("AQUEDUCT_BROKER_IDLE_SPIN", off)]),
            Overrides::default(),
        )
        .expect("env over file");
        assert_eq!(c.idle_spin, Duration::ZERO, "{off}");
    }
}

#[test]
fn worker_threads_from_the_file_or_the_environment() {
    let dir = tempfile::tempdir().expect("dir");
    let path = file(&dir, "broker:\n  worker_threads: 3\n");
    let c = load(Some(path.clone()), vec![], Overrides::default()).expect("file");
    assert_eq!(c.worker_threads, Some(3));
    let c = load(
        Some(path),
        env(&[("AQUEDUCT_BROKER_WORKER_THREADS", "1")]),
        Overrides::default(),
    )
    .expect("env over file");
    assert_eq!(c.worker_threads, Some(1));
    let c = load(
        None,
        env(&[("AQUEDUCT_BROKER_WORKER_THREADS", "0")]),
        Overrides::default(),
    )
    .expect("0");
    assert_eq!(c.worker_threads, None, "0 means one per CPU");
}

#[test]
fn precedence_flag_over_env_over_file_over_default() {
    let dir = tempfile::tempdir().expect("dir");
    let path = file(
        &dir,
        "listen_addr: \"127.0.0.1:5000\"\nbroker:\n  queue_size: 10\n  max_retries: 7\n  backpressure_policy: drop_newest\n  priority_ttls: [\"1s\", \"0s\", \"0s\", \"250ms\"]\ntransport:\n  max_buf_size: 1000\n",
    );
    // File over default.
    let c = load(Some(path.clone()), vec![], Overrides::default()).expect("file");
    assert_eq!(
        (
            c.listen_addr.port(),
            c.broker.queue_size,
            c.broker.max_retries
        ),
        (5000, 10, 7)
    );
    assert_eq!(c.broker.backpressure_policy, OverflowPolicy::DropNewest);
    assert_eq!(c.broker.priority_ttls[0], Duration::from_secs(1));
    assert_eq!(c.broker.priority_ttls[3], Duration::from_millis(250));
    assert_eq!(c.transport.max_frame_data, 1000);
    // Env over file.
    let e = env(&[
        ("AQUEDUCT_LISTEN_ADDR", "127.0.0.1:6000"),
        ("AQUEDUCT_BROKER_QUEUE_SIZE", "20"),
        ("AQUEDUCT_TLS_GENERATE", "true"),
        ("AQUEDUCT_HOME", "/tmp/ignored-by-config"),
        ("PATH", "/usr/bin"),
    ]);
    let c = load(Some(path.clone()), e.clone(), Overrides::default()).expect("env");
    // Text keys stay text even when the value looks like a number.
    let zeros = env(&[
        ("AQUEDUCT_BROKER_FLUSH_INTERVAL", "0"),
        ("AQUEDUCT_TRANSPORT_IDLE_TIMEOUT", "0"),
        ("AQUEDUCT_TLS_GENERATE", "false"),
        ("AQUEDUCT_TLS_CERT_FILE", "1234"),
        ("AQUEDUCT_TLS_KEY_FILE", "5678"),
    ]);
    let err =
        load(None, zeros.clone()[..2].to_vec(), Overrides::default()).expect("zero durations");
    assert_eq!(
        (err.flush_interval, err.transport.idle_timeout),
        (Duration::ZERO, Duration::ZERO)
    );
    let msg = load(None, zeros, Overrides::default())
        .expect_err("no such file")
        .to_string();
    assert!(msg.contains("tls.cert_file: 1234 does not exist"), "{msg}");
    assert_eq!(
        (
            c.listen_addr.port(),
            c.broker.queue_size,
            c.broker.max_retries
        ),
        (6000, 20, 7)
    );
    // Flag over env.
    let flags = Overrides {
        listen_addr: Some("127.0.0.1:7000".into()),
        ..Overrides::default()
    };
    let c = load(Some(path), e, flags).expect("flags");
    assert_eq!((c.listen_addr.port(), c.broker.queue_size), (7000, 20));
}

fn error(file_yaml: Option<&str>, env_pairs: &[(&str, &str)], overrides: Overrides) -> String {
    let dir = tempfile::tempdir().expect("dir");
    let path = file_yaml.map(|y| file(&dir, y));
    load(path, env(env_pairs), overrides)
        .expect_err("must be refused")
        .to_string()
}

/// (YAML file, environment, text the error must contain)
type ErrorCase = (
    Option<&'static str>,
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn errors_name_the_key_and_the_problem() {
    let cases: Vec<ErrorCase> = vec![
        (
            None,
            &[("AQUEDUCT_TRACING_SAMPLE_RATIO", "2")],
            "tracing.sample_ratio: must be between 0.0 and 1.0",
        ),
        (
            Some("tracing:\n  otlp_endpoint: grpc://collector:4317\n"),
            &[],
            "tracing.otlp_endpoint: \"grpc://collector:4317\": expected http://HOST:PORT or https://HOST:PORT",
        ),
        (
            Some("tracing:\n  otlp_endpoint: https://collector:4317\n"),
            &[("AQUEDUCT_TRACING_OTLP_CA_FILE", "/nonexistent/otel-ca.pem")],
            "tracing.otlp_ca_file: cannot read /nonexistent/otel-ca.pem",
        ),
        (
            Some("tracing:\n  otlp_endpoint: http://collector:4317\n  otlp_cert_file: c.pem\n"),
            &[],
            "tracing.otlp_cert_file: is for TLS to the collector, but tracing.otlp_endpoint \"http://collector:4317\" is plain http://: use https://",
        ),
        (
            Some("broker:\n  flush_interval: 50xs\n"),
            &[],
            "broker.flush_interval: \"50xs\" is not a duration",
        ),
        (
            Some("broker:\n  queue_size: -5\n"),
            &[],
            "broker.queue_size",
        ),
        (
            None,
            &[("AQUEDUCT_TRANSPORT_MAX_BUF_SIZE", "16777216")],
            "transport.max_buf_size: 16777216 is out of range 64..=8388608",
        ),
        (
            None,
            &[("AQUEDUCT_BROKER_IDLE_SPIN", "5ms")],
            "broker.idle_spin: \"5ms\" is above the maximum of 1ms",
        ),
        (
            Some("broker:\n  idle_spin: fast\n"),
            &[],
            "broker.idle_spin: \"fast\" is not a duration",
        ),
        (
            None,
            &[("AQUEDUCT_BROKER_WORKER_THREADS", "5000")],
            "broker.worker_threads: 5000 is out of range 0..=1024",
        ),
        // A deadline this far away would overflow the clock: refused at startup, not a panic
        // when the first connection or delivery computes it.
        (
            None,
            &[("AQUEDUCT_BROKER_ACK_WAIT", "500000000000y")],
            "broker.ack_wait: \"500000000000y\" is longer than 100 years",
        ),
        (
            None,
            &[("AQUEDUCT_TRANSPORT_HANDSHAKE_TIMEOUT", "200years")],
            "transport.handshake_timeout: \"200years\" is longer than 100 years",
        ),
        (
            Some("broker:\n  backpressure_policy: drop_all\n"),
            &[],
            "broker.backpressure_policy: unknown backpressure policy \"drop_all\"",
        ),
        (
            Some("broker:\n  queue_sise: 5\n"),
            &[],
            "broker.queue_sise: unknown key (did you mean `queue_size`?)",
        ),
        (
            Some("broker:\n  queue_size: three\n"),
            &[],
            "broker.queue_size: expected a whole number, found string \"three\"",
        ),
        (Some("listen_adr: \":1\"\n"), &[], "listen_adr"),
        (
            Some("broker:\n  queue_size: 0\n"),
            &[],
            "broker.queue_size: 0 is out of range",
        ),
        (
            Some("broker:\n  priority_ttls: [\"1s\"]\n"),
            &[],
            "broker.priority_ttls: needs exactly 4 durations",
        ),
        (
            Some("aal:\n  enabled: true\n  file_path: /var/lib/aqueduct\n"),
            &[],
            "aal.key: is empty, but aal.enabled is true",
        ),
        (
            Some("aal:\n  key: \"not base64!\"\n"),
            &[],
            "aal.key: is not valid base64: ' ' at position 3 is not a base64 character",
        ),
        (
            Some("aal:\n  key: \"c2hvcnQ=\"\n"),
            &[],
            "aal.key: decodes to 5 bytes; AES-256-GCM needs exactly 32",
        ),
        (
            None,
            &[("AQUEDUCT_AAL_PREVIOUS_KEYS", "c2hvcnQ=")],
            "aal.previous_keys: key 1 of 1 decodes to 5 bytes; AES-256-GCM needs exactly 32",
        ),
        (
            Some("aal:\n  previous_keys: [\"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\", \"\"]\n"),
            &[],
            "aal.previous_keys: key 2 of 2 is empty",
        ),
        (
            Some("aal:\n  enabled: true\n  allow_plaintext: true\n  previous_keys: [\"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"]\n"),
            &[],
            "aal.previous_keys: are given but aal.key is empty",
        ),
        (
            Some("aal:\n  fsync: sometimes\n"),
            &[],
            "aal.fsync: \"sometimes\" is not one of always, batch, interval, never",
        ),
        (
            Some("aal:\n  fsync: interval\n  fsync_interval: 0s\n"),
            &[],
            "aal.fsync_interval: must be greater than zero",
        ),
        // Checked although `fsync` is not `interval` (it was accepted until it was).
        (
            Some("aal:\n  fsync: batch\n  fsync_interval: bogus\n"),
            &[],
            "aal.fsync_interval: \"bogus\" is not a duration",
        ),
        (
            None,
            &[("AQUEDUCT_AAL_RETENTION_AGE", "7x")],
            "aal.retention_age: \"7x\" is not a duration",
        ),
        (
            Some("aal:\n  max_consumers: 0\n"),
            &[],
            "aal.max_consumers: ",
        ),
        (
            None,
            &[("AQUEDUCT_AAL_CONSUMER_RETENTION", "a week")],
            "aal.consumer_retention: \"a week\" is not a duration",
        ),
        (
            Some("aal:\n  enabled: true\n  allow_plaintext: true\n  file_path: /etc/hostname\n"),
            &[],
            "aal.file_path: /etc/hostname is a file; aal.file_path is the log's directory",
        ),
        (
            Some("cluster:\n  enabled: true\n"),
            &[],
            "cluster.tls.ca_file: required when cluster.enabled is true",
        ),
        (
            Some("tls:\n  cert_file: /nonexistent/cert.pem\n  key_file: /nonexistent/key.pem\n"),
            &[],
            "tls.cert_file: /nonexistent/cert.pem does not exist",
        ),
        (
            Some("tls:\n  require_client_cert: true\n"),
            &[],
            "tls.client_ca_file: required when tls.require_client_cert is true",
        ),
        (
            Some("broker:\n  quotas:\n    clients:\n      \"svc-*\":\n        publish_rate: 5\n"),
            &[],
            "broker.quotas.clients: \"svc-*\": a quota names one client id exactly",
        ),
        (
            Some("tls:\n  crl_file: /etc/hostname\n"),
            &[],
            "tls.crl_file: needs tls.client_ca_file (or, for the admin API alone, admin.client_ca_file)",
        ),
        (
            None,
            &[("AQUEDUCT_TLS_CRL_FILE", "/nonexistent/crl.pem")],
            "tls.crl_file: /nonexistent/crl.pem does not exist",
        ),
        (
            Some("listen_addr: nowhere\n"),
            &[],
            "listen_addr: \"nowhere\" is not a host:port address",
        ),
        (
            None,
            &[("AQUEDUCT_BROKER_QUEUESIZE", "5")],
            "unknown environment variable AQUEDUCT_BROKER_QUEUESIZE",
        ),
        (
            None,
            &[("AQUEDUCT_BROKER_ACK_WAIT", "soon")],
            "broker.ack_wait: \"soon\" is not a duration",
        ),
        (
            None,
            &[("AQUEDUCT_TRANSPORT_MAX_BUF_SIZE", "-1")],
            "transport.max_buf_size",
        ),
    ];
    for (yaml, env_pairs, want) in cases {
        let got = error(yaml, env_pairs, Overrides::default());
        assert!(
            got.contains(want),
            "expected {want:?} in {got:?} (yaml {yaml:?}, env {env_pairs:?})"
        );
    }
    let got = error(
        None,
        &[],
        Overrides {
            aal: true,
            ..Overrides::default()
        },
    );
    assert!(
        got.contains("aal.key: is empty, but aal.enabled is true"),
        "{got}"
    );
}

#[test]
fn a_missing_file_is_an_error() {
    let err = load(
        Some(PathBuf::from("/nonexistent/aqueduct.yaml")),
        vec![],
        Overrides::default(),
    )
    .expect_err("missing file");
    assert_eq!(
        err.to_string(),
        "config file /nonexistent/aqueduct.yaml: not found"
    );
}

#[test]
fn disabled_future_sections_are_accepted_with_their_keys() {
    let dir = tempfile::tempdir().expect("dir");
    let path = file(
        &dir,
        "aal:\n  enabled: false\n  file_path: ./data\n  key: \"\"\nacl:\n  enabled: false\n  rules: []\ncluster:\n  discovery:\n    enabled: false\n    host: aqueduct-headless\n    port: \"4242\"\n",
    );
    load(Some(path), vec![], Overrides::default()).expect("disabled sections load");
}

#[test]
fn the_example_config_documents_every_key_and_loads() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config.example.yaml");
    let c =
        load(Some(PathBuf::from(example)), vec![], Overrides::default()).expect("example loads");
    assert_eq!(
        c,
        load(None, vec![], Overrides::default()).expect("defaults"),
        "the example shows the defaults"
    );
    let text = std::fs::read_to_string(example).expect("readable");
    for key in aqueduct_server::config::ENV_KEYS {
        let leaf = key.rsplit('.').next().unwrap_or(key);
        assert!(
            text.contains(&format!("{leaf}:")),
            "config.example.yaml does not document {key}"
        );
        assert!(
            text.contains(&aqueduct_server::config::env_name(key)),
            "config.example.yaml does not name {}",
            aqueduct_server::config::env_name(key)
        );
    }
}

const SEED_CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/seed-v1.13-config.yaml"
);

/// The seed's `config.yaml`, exactly as its README prints it, loads and means what it says.
#[test]
fn the_seed_config_loads_verbatim() {
    let c = load(
        Some(PathBuf::from(SEED_CONFIG)),
        vec![],
        Overrides::default(),
    )
    .expect("the seed's config.yaml loads");
    assert_eq!(c.listen_addr.to_string(), "[::]:4242");
    assert_eq!(c.metrics_addr.to_string(), "[::]:9090");
    assert_eq!(c.broker.queue_size, 1024);
    assert_eq!(c.broker.backpressure_policy, OverflowPolicy::DropOldest);
    assert_eq!(c.batch_size, 65536);
    assert_eq!(c.flush_interval, Duration::from_micros(50));
    assert_eq!(c.transport.max_frame_data, 65536);
    assert_eq!(c.transport.read_buf_size, 1024);
    let fig = aqueduct_server::config::layered(&Sources {
        file: Some(PathBuf::from(SEED_CONFIG)),
        env: vec![],
        overrides: Overrides::default(),
    })
    .expect("layered");
    let burst: u64 = fig
        .extract_inner("broker.quotas.default_burst_size")
        .expect("burst");
    assert_eq!(burst, 1000);
    let rules: Vec<aqueduct_server::config::AclRuleSection> =
        fig.extract_inner("acl.rules").expect("acl rules");
    assert_eq!(
        rules,
        [aqueduct_server::config::AclRuleSection {
            client: "service-a".into(),
            topic: "orders".into(),
            permission: "publish".into(),
        }]
    );
}

/// Empty values load as the key's default, as the seed's Go YAML reader took them: a list with
/// every item commented out, a value left blank, a section holding only comments. They failed
/// with "invalid type: found unit".
#[test]
fn empty_values_in_the_file_are_the_defaults() {
    let dir = tempfile::tempdir().expect("dir");
    let path = file(
        &dir,
        "acl:\n  enabled: false\n  rules:\n  #  - client: a\n  #    topic: b\n\
         tls:\n  cert_file:\n  key_file: ~\n\
         broker:\n  # nothing set yet\n\
         cluster:\n",
    );
    let c = load(Some(path), vec![], Overrides::default()).expect("loads");
    assert_eq!(c.broker.queue_size, 1024);
    assert!(c.tls.cert_file.is_none() && c.tls.key_file.is_none());
}

/// Kubernetes gives every pod of a namespace with a Service named `aqueduct` variables of its
/// own under AQUEDUCT_ (service links): they are not config keys, and the broker starts; a typo
/// still stops it.
#[test]
fn kubernetes_service_links_are_not_config_errors() {
    let links = env(&[
        ("AQUEDUCT_SERVICE_HOST", "10.0.0.1"),
        ("AQUEDUCT_SERVICE_PORT", "4242"),
        ("AQUEDUCT_SERVICE_PORT_QUIC", "4242"),
        ("AQUEDUCT_PORT", "udp://10.0.0.1:4242"),
        ("AQUEDUCT_PORT_4242_UDP", "udp://10.0.0.1:4242"),
        ("AQUEDUCT_PORT_4242_UDP_PROTO", "udp"),
        ("AQUEDUCT_PORT_4242_UDP_PORT", "4242"),
        ("AQUEDUCT_PORT_4242_UDP_ADDR", "10.0.0.1"),
    ]);
    let c = load(None, links, Overrides::default()).expect("starts");
    assert_eq!(c.listen_addr.port(), 4242);
    let e = error(None, &[("AQUEDUCT_PORTS", "4242")], Overrides::default());
    assert!(e.contains("AQUEDUCT_PORTS"), "{e}");
}

/// A true/false setting from the environment takes what Go's strconv.ParseBool (the seed's)
/// takes; a number setting still takes 1 and 0 as numbers.
#[test]
fn environment_flags_take_the_seed_s_spellings() {
    for (v, want) in [("1", true), ("t", true), ("TRUE", true), ("True", true)] {
        let c = load(
            None,
            env(&[("AQUEDUCT_AAL_ENABLED", v)]),
            Overrides::default(),
        );
        // The log on needs its key: the error names aal.key, so the flag was read as true.
        match c {
            Ok(c) => assert_eq!(c.aal.is_some(), want, "{v}"),
            Err(e) => assert!(e.to_string().contains("aal.key"), "{v}: {e}"),
        }
    }
    for v in ["0", "f", "FALSE", "False"] {
        let c = load(
            None,
            env(&[("AQUEDUCT_AAL_ENABLED", v)]),
            Overrides::default(),
        )
        .expect(v);
        assert!(c.aal.is_none(), "{v}");
    }
    let c = load(
        None,
        env(&[("AQUEDUCT_BROKER_MAX_RETRIES", "1")]),
        Overrides::default(),
    )
    .expect("a number");
    assert_eq!(c.broker.max_retries, 1);
}

/// Every row of the seed's environment table (variable, key, example value) sets that key; the
/// broker then starts, or refuses with a message that names the key (a file that does not
/// exist, a feature of a later version switched on).
#[test]
fn every_seed_environment_variable_sets_its_key() {
    let table = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/seed-v1.13-env.tsv"
    ))
    .expect("table");
    let mut rows = 0;
    for line in table.lines() {
        let cols: Vec<&str> = line.split('\t').collect();
        let [var, key, example] = cols[..] else {
            panic!("bad row {line:?}");
        };
        rows += 1;
        assert_eq!(
            aqueduct_server::config::env_key(var),
            Some(key),
            "{var} must set {key}"
        );
        let sources = Sources {
            file: None,
            env: env(&[(var, example)]),
            overrides: Overrides::default(),
        };
        let fig = aqueduct_server::config::layered(&sources).expect("known variable");
        let value = fig.find_value(key).expect("the key is set");
        let text = value
            .as_str()
            .map(str::to_string)
            .or_else(|| value.to_u128().map(|n| n.to_string()))
            .or_else(|| value.to_bool().map(|b| b.to_string()))
            .expect("a scalar");
        assert_eq!(text, example, "{var}={example} sets {key}");
        if let Err(e) = Config::load(&sources) {
            let msg = e.to_string();
            let section = key.rsplit_once('.').map_or(key, |(s, _)| s);
            assert!(
                msg.contains(key) || msg.contains(&format!("{section}.enabled")),
                "{var}={example}: the error must name {key}: {msg}"
            );
        }
    }
    assert_eq!(rows, 24, "the seed's table has 24 rows");
}

/// A keep-alive at or above the idle timeout would let idle but healthy clients be dropped.
#[test]
fn keep_alive_must_be_below_idle_timeout() {
    let msg = error(
        Some("transport:\n  idle_timeout: 3s\n  keep_alive_interval: 5s\n"),
        &[],
        Overrides::default(),
    );
    assert!(
        msg.contains("transport.keep_alive_interval") && msg.contains("transport.idle_timeout"),
        "{msg}"
    );
    let dir = tempfile::tempdir().expect("dir");
    let ok = file(
        &dir,
        "transport:\n  idle_timeout: 3s\n  keep_alive_interval: 1s\n",
    );
    load(Some(ok), vec![], Overrides::default()).expect("1s keep-alive under 3s idle");
    // Only the idle timeout set: the keep-alive follows it (a third of it).
    let only_idle = file(&dir, "transport:\n  idle_timeout: 3s\n");
    let c = load(Some(only_idle), vec![], Overrides::default()).expect("derived keep-alive");
    assert_eq!(c.transport.keep_alive_interval, Duration::from_secs(1));
    let c = load(None, vec![], Overrides::default()).expect("defaults");
    assert_eq!(c.transport.keep_alive_interval, Duration::from_secs(10));
}

#[test]
fn flush_interval_is_bounded_and_access_keys_take_effect() {
    let msg = error(
        Some("broker:\n  flush_interval: 10s\n"),
        &[],
        Overrides::default(),
    );
    assert!(
        msg.contains("broker.flush_interval") && msg.contains("maximum"),
        "{msg}"
    );
    // The seed's quota and ACL variables set the live policy.
    let c = load(
        None,
        env(&[
            ("AQUEDUCT_BROKER_DEFAULT_PUBLISH_RATE", "100"),
            ("AQUEDUCT_BROKER_DEFAULT_BURST_SIZE", "10"),
            ("AQUEDUCT_ACL_ENABLED", "true"),
            ("AQUEDUCT_ACL_DEFAULT", "subscribe"),
            ("AQUEDUCT_BROKER_QUOTAS_ACTION", "reject"),
        ]),
        Overrides::default(),
    )
    .expect("quotas and acl");
    assert_eq!(c.access.quotas.default.rate, 100);
    assert_eq!(c.access.quotas.default.burst, 10);
    assert!(c.access.acl.enabled);
    assert_eq!(
        c.access.acl.default,
        aqueduct_core::acl::Permission::Subscribe
    );
    assert_eq!(
        c.access.action,
        aqueduct_server::config::QuotaAction::Reject
    );
    // Per-client overrides in the file; a missing burst is the default burst.
    let dir = tempfile::tempdir().expect("tempdir");
    let overrides = file(
        &dir,
        "broker:\n  quotas:\n    default_burst_size: 7\n    clients:\n      svc: { publish_rate: 5 }\n      big: { publish_rate: 0, burst_size: 9 }\n",
    );
    let c = load(Some(overrides), vec![], Overrides::default()).expect("overrides");
    let spec = |id: &str| c.access.quotas.spec_for(id);
    assert_eq!((spec("svc").rate, spec("svc").burst), (5, 7));
    assert_eq!((spec("big").rate, spec("big").burst), (0, 9));
    assert_eq!(spec("other").rate, 0);
    let msg = error(
        Some("acl:\n  enabled: true\n  rules:\n    - client: \"a*b\"\n      topic: x\n      permission: all\n"),
        &[],
        Overrides::default(),
    );
    assert!(
        msg.contains("acl.rules[].client") && msg.contains("rule 0"),
        "{msg}"
    );
    let msg = error(
        None,
        &[("AQUEDUCT_CLUSTER_DISCOVERY_ENABLED", "true")],
        Overrides::default(),
    );
    assert!(
        msg.contains("cluster.discovery.enabled: needs cluster.enabled: true"),
        "{msg}"
    );
    let msg = error(
        Some("aal:\n  enabled: false\n  dir: ./data\n"),
        &[],
        Overrides::default(),
    );
    assert!(
        msg.contains("dir"),
        "a typo in a disabled section is named: {msg}"
    );
    // The client's own variable, often exported in the same shell, is not a broker typo.
    load(
        None,
        env(&[("AQUEDUCT_ADDR", "localhost:4242")]),
        Overrides::default(),
    )
    .expect("AQUEDUCT_ADDR is the client's");
}

/// `aal.previous_keys` from the file (a list) or the environment (comma-separated), in order;
/// `Debug` shows neither them nor the key.
#[test]
fn previous_log_keys_from_the_file_or_the_environment() {
    use base64::Engine;
    let b64 = |b: u8| base64::engine::general_purpose::STANDARD.encode([b; 32]);
    let key = |b: u8| aqueduct_log::MasterKey::from_bytes(&[b; 32]).expect("32 bytes");
    let dir = tempfile::tempdir().expect("dir");
    let yaml = format!(
        "aal:\n  enabled: true\n  file_path: {}\n  key: {}\n  previous_keys: [{}, {}]\n",
        dir.path().join("aal").display(),
        b64(1),
        b64(2),
        b64(3)
    );
    let c = load(Some(file(&dir, &yaml)), vec![], Overrides::default()).expect("loads");
    let aal = c.aal.expect("on");
    assert_eq!(aal.previous_keys, vec![key(2), key(3)]);
    let opts = aal.log_options(1);
    assert_eq!(
        opts.previous_keys,
        vec![key(2), key(3)],
        "passed to the log"
    );
    let listed = format!("{} , {},", b64(4), b64(5));
    let c = load(
        Some(file(&dir, &yaml)),
        env(&[("AQUEDUCT_AAL_PREVIOUS_KEYS", &listed)]),
        Overrides::default(),
    )
    .expect("loads");
    assert_eq!(c.aal.expect("on").previous_keys, vec![key(4), key(5)]);
    // One comma-separated string in the file, as the environment writes it.
    let yaml = yaml.replace(
        &format!("[{}, {}]", b64(2), b64(3)),
        &format!("\"{},{}\"", b64(6), b64(7)),
    );
    let c = load(Some(file(&dir, &yaml)), vec![], Overrides::default()).expect("loads");
    assert_eq!(c.aal.expect("on").previous_keys, vec![key(6), key(7)]);
    // A value of the wrong kind is refused without showing it.
    for bad in [
        "aal:\n  key: 123456789\n",
        "aal:\n  key: [123456789]\n",
        "aal:\n  previous_keys: {123456789: x}\n",
        "aal:\n  previous_keys: [[123456789]]\n",
    ] {
        let e = error(Some(bad), &[], Overrides::default());
        assert!(
            e.contains("aal.") && e.contains("not shown: it is secret"),
            "{bad}: {e}"
        );
        assert!(!e.contains("123456789"), "{bad}: {e}");
    }
    // A WebTransport token is a key of its map: an error about its entry names it
    // `<a token>`, not the token (it was printed whole at startup and on SIGHUP).
    for bad in [
        "webtransport:\n  tokens: {secret-token-123456789: 42}\n",
        "webtransport:\n  tokens: {secret-token-123456789: [a]}\n",
        "webtransport:\n  tokens: secret-token-123456789\n",
        "webtransport:\n  tokens: [secret-token-123456789]\n",
    ] {
        let e = error(Some(bad), &[], Overrides::default());
        assert!(e.contains("webtransport.tokens"), "{bad}: {e}");
        assert!(!e.contains("secret-token"), "{bad}: {e}");
    }
    let section = aqueduct_server::config::AalSection {
        key: b64(1),
        previous_keys: vec![b64(2)],
        ..Default::default()
    };
    let shown = format!("{section:?}");
    assert!(
        !shown.contains(&b64(1)) && !shown.contains(&b64(2)),
        "{shown}"
    );
    assert!(shown.contains("(1 hidden)"), "{shown}");
}

#[test]
fn tracing_keys_from_the_environment() {
    let c = load(
        None,
        vec![
            (
                "AQUEDUCT_TRACING_OTLP_ENDPOINT".into(),
                "http://127.0.0.1:4317".into(),
            ),
            ("AQUEDUCT_TRACING_SAMPLE_RATIO".into(), "0.01".into()),
            ("AQUEDUCT_TRACING_SERVICE_NAME".into(), "42".into()),
        ],
        Overrides::default(),
    )
    .expect("loads");
    let t = c.tracing.expect("export on");
    assert_eq!(t.otlp_endpoint, "http://127.0.0.1:4317");
    assert_eq!(t.sample_ratio, 0.01);
    assert_eq!(t.service_name, "42");
    let whole = load(
        None,
        vec![
            (
                "AQUEDUCT_TRACING_OTLP_ENDPOINT".into(),
                "http://127.0.0.1:4317".into(),
            ),
            ("AQUEDUCT_TRACING_SAMPLE_RATIO".into(), "1".into()),
        ],
        Overrides::default(),
    )
    .expect("loads");
    assert_eq!(whole.tracing.expect("on").sample_ratio, 1.0);
    assert_eq!(
        load(None, vec![], Overrides::default())
            .expect("defaults")
            .tracing,
        None,
        "off by default"
    );
}

/// `transport.ack_eliciting_threshold` (9 by default) and `transport.ack_delay` (1 ms), from
/// the file or the environment; a value out of 1..=64 or 1ms..=25ms stops startup naming the key.
#[test]
fn ack_frequency_settings_are_bounded_and_named() {
    let c = load(None, vec![], Overrides::default()).expect("defaults");
    assert_eq!(c.transport.ack_eliciting_threshold, 9);
    let c = load(
        None,
        env(&[("AQUEDUCT_TRANSPORT_ACK_ELICITING_THRESHOLD", "1")]),
        Overrides::default(),
    )
    .expect("1: QUIC's own rule");
    assert_eq!(c.transport.ack_eliciting_threshold, 1);
    for bad in ["0", "65"] {
        let msg = error(
            Some(&format!("transport:\n  ack_eliciting_threshold: {bad}\n")),
            &[],
            Overrides::default(),
        );
        assert!(msg.contains("transport.ack_eliciting_threshold"), "{msg}");
    }
    assert_eq!(c.transport.ack_delay, Duration::from_millis(1), "default");
    let c = load(
        None,
        env(&[("AQUEDUCT_TRANSPORT_ACK_DELAY", "25ms")]),
        Overrides::default(),
    )
    .expect("25ms: QUIC's default");
    assert_eq!(c.transport.ack_delay, Duration::from_millis(25));
    for bad in ["500us", "26ms", "soon"] {
        let msg = error(
            Some(&format!("transport:\n  ack_delay: {bad}\n")),
            &[],
            Overrides::default(),
        );
        assert!(msg.contains("transport.ack_delay"), "{msg}");
    }
}

/// `transport.max_mtu` (6500 by default, the largest) and `transport.initial_mtu` (1452), from
/// the file or the environment; above 6500 (quinn's segmentation-offload sends would no longer
/// fit a UDP datagram), below 1200, or a max below the initial MTU stops startup naming the key.
#[test]
fn path_mtu_settings_are_bounded_and_named() {
    let c = load(None, vec![], Overrides::default()).expect("defaults");
    assert_eq!((c.transport.initial_mtu, c.transport.max_mtu), (1452, 6500));
    let c = load(
        None,
        env(&[("AQUEDUCT_TRANSPORT_MAX_MTU", "1452")]),
        Overrides::default(),
    )
    .expect("1452: no probing");
    assert_eq!(c.transport.max_mtu, 1452);
    for (yaml, key) in [
        ("max_mtu: 6501", "transport.max_mtu"),
        ("max_mtu: 1199", "transport.max_mtu"),
        ("initial_mtu: 9000", "transport.initial_mtu"),
        ("initial_mtu: 1500\n  max_mtu: 1400", "transport.max_mtu"),
    ] {
        let msg = error(
            Some(&format!("transport:\n  {yaml}\n")),
            &[],
            Overrides::default(),
        );
        assert!(msg.contains(key), "{yaml}: {msg}");
    }
    let msg = error(
        Some("transport:\n  initial_mtu: 1500\n  max_mtu: 1400\n"),
        &[],
        Overrides::default(),
    );
    assert!(msg.contains("transport.initial_mtu (1500)"), "{msg}");
}
