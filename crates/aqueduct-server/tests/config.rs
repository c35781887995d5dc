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

#[test]
fn defaults_without_any_source() {
    let c = load(None, vec![], Overrides::default()).expect("defaults");
    assert_eq!(c.listen_addr.to_string(), "0.0.0.0:4242");
    assert_eq!(c.metrics_addr.to_string(), "127.0.0.1:9090");
    assert_eq!(c.broker.queue_size, 1024);
    assert_eq!(c.broker.backpressure_policy, OverflowPolicy::DropOldest);
    assert_eq!(c.batch_size, 65536);
    assert_eq!(c.flush_interval, Duration::from_micros(50));
    assert_eq!(c.broker.max_retries, 3);
    assert_eq!(c.transport.max_frame_data, 65536);
    assert!(c.tls.generate);
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
            Some("broker:\n  backpressure_policy: drop_all\n"),
            &[],
            "broker.backpressure_policy: unknown backpressure policy \"drop_all\"",
        ),
        (Some("broker:\n  queue_sise: 5\n"), &[], "queue_sise"),
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
            Some("aal:\n  enabled: true\n  dir: /var/lib/aqueduct\n"),
            &[],
            "aal.enabled is true, but the append-only log (persistence) is not implemented yet",
        ),
        (
            Some("cluster:\n  enabled: true\n"),
            &[],
            "cluster.enabled is true, but clustering is not implemented yet",
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
    assert!(got.contains("aal.enabled is true"), "{got}");
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
        "aal:\n  enabled: false\n  dir: ./data\nacl:\n  enabled: false\n  rules: []\n",
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
