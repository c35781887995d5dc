//! The binaries as a user runs them: help, config errors, and a real broker with `aqueduct pub`
//! and `aqueduct sub` trusting the generated development certificate, then SIGTERM → exit 0.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;

#[test]
fn help_explains_the_flags() {
    let out = Command::new(BROKER).arg("--help").output().expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--config",
        "--addr",
        "--metrics-addr",
        "--cert",
        "--key",
        "--aal",
        "AQUEDUCT_",
        "dev-cert.pem",
    ] {
        assert!(
            text.contains(needle),
            "aqueduct-broker --help lacks {needle}:\n{text}"
        );
    }
    let out = Command::new(CLIENT).arg("--help").output().expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["pub", "sub", "--addr", "--ca", "--pin"] {
        assert!(
            text.contains(needle),
            "aqueduct --help lacks {needle}:\n{text}"
        );
    }
}

/// Each command's help lists only the connection options it uses: the commands that need no
/// broker none, `admin` only the TLS ones (it has --admin-addr); the rest all of them. (They
/// are global options, which clap lists under every command; a new user read `aqueduct cert
/// --help` as asking for a broker's address.)
#[test]
fn each_commands_help_lists_the_connection_options_it_uses() {
    let help = |args: &[&str]| {
        let out = Command::new(CLIENT).args(args).output().expect("runs");
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Whether the help's option list has FLAG (a line "  --flag ..." or "  -a, --flag ...").
    let lists = |text: &str, flag: &str| {
        text.lines().map(str::trim_start).any(|line| {
            line.starts_with(flag) || line.get(4..).is_some_and(|rest| rest.starts_with(flag))
        })
    };
    let all = [
        "--addr ",
        "--ca ",
        "--pin ",
        "--server-name ",
        "--cert ",
        "--key ",
        "--dev-cert ",
        "--transport ",
        "--wt-path ",
    ];
    for args in [
        &["pub", "--help"][..],
        &["sub", "--help"],
        &["bench", "--help"],
        &["info", "--help"],
    ] {
        let text = help(args);
        for flag in all {
            assert!(lists(&text, flag), "{args:?} lacks {flag}:\n{text}");
        }
    }
    for args in [
        &["cert", "--help"][..],
        &["cert", "server", "--help"],
        &["log", "dump", "--help"],
        &["trace-sink", "--help"],
    ] {
        let text = help(args);
        for flag in all {
            assert!(!lists(&text, flag), "{args:?} lists {flag}:\n{text}");
        }
    }
    for args in [&["admin", "--help"][..], &["admin", "acl", "add", "--help"]] {
        let text = help(args);
        for flag in ["--admin-addr ", "--ca ", "--cert ", "--key ", "--pin "] {
            assert!(lists(&text, flag), "{args:?} lacks {flag}:\n{text}");
        }
        for flag in ["--addr ", "--transport ", "--wt-path "] {
            assert!(!lists(&text, flag), "{args:?} lists {flag}:\n{text}");
        }
    }
    // Hidden, not removed: given anyway, they are refused with the reason (below and in
    // commands_without_a_broker_refuse_connection_options).
    let home = tempfile::tempdir().expect("temp dir");
    for args in [
        &["admin", "--addr", "10.0.0.1:4242", "info"][..],
        &["--transport", "webtransport", "admin", "info"],
    ] {
        let o = run_client(home.path(), args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("`aqueduct admin` does not use --") && err.contains("--admin-addr"),
            "{args:?}: {err}"
        );
    }
    // A misspelling is not pointed at a hidden option the command would then refuse, but at
    // the nearest option it uses, if any; where the option is used, clap's suggestion stays.
    for (args, suggestion) in [
        (&["admin", "--adr", "x", "info"][..], None),
        (&["--adr", "x", "admin", "info"], None),
        (&["log", "dump", "--caa", "x", "dir"], None),
        (&["cert", "ca", "--pn", "x"], None),
        (&["log", "verify", "--ke", "x"], Some("'--key-file'")),
        (
            &["log", "--key-file", "x", "verify"],
            Some("'verify --key-file'"),
        ),
        (&["sub", "--adr", "x", "t"], Some("'--addr'")),
        (
            &["log", "dump", "--key-fle", "k", "dir"],
            Some("'--key-file'"),
        ),
    ] {
        let o = run_client(home.path(), args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("unexpected argument"), "{args:?}: {err}");
        assert!(err.contains("Usage:"), "{args:?}: {err}");
        match suggestion {
            Some(s) => assert!(err.contains(s), "{args:?}: {err}"),
            None => assert!(!err.contains("similar argument"), "{args:?}: {err}"),
        }
    }
}

/// Counts and durations that would make a run meaningless are refused before anything
/// connects, naming the flag: 0 publishers, streams, subscribers or batch were quietly taken
/// as 1, `--duration 0` reported an empty run as a success, `--idle 0` every message as lost,
/// weights adding to 0 (or past u32) published everything at priority 2, and `pub -n 0` said
/// it published 0 messages.
#[test]
fn meaningless_counts_are_refused_naming_the_flag() {
    let home = tempfile::tempdir().expect("temp dir");
    for (args, flag) in [
        (&["bench", "--publishers", "0"][..], "--publishers"),
        (&["bench", "--streams", "0"], "--streams"),
        (&["bench", "--subscribers", "0"], "--subscribers"),
        (&["bench", "--batch", "0"], "--batch"),
        (&["bench", "--duration", "0s"], "--duration"),
        (&["bench", "--idle", "0"], "--idle"),
        (
            &["bench-durable", "--messages", "0", "publish"],
            "--messages",
        ),
        (&["bench-durable", "publish", "--window", "0"], "--window"),
        (&["pub", "t", "x", "-n", "0"], "--count"),
        (&["bench", "--priority-mix", "0:0"], "add up to 0"),
        (
            &["bench", "--priority-mix", "0:4294967295,1:1"],
            "add up to more than",
        ),
    ] {
        let o = run_client(home.path(), args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn configuration_errors_stop_startup_naming_the_key() {
    let dir = tempfile::tempdir().expect("dir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "broker:\n  flush_interval: 50xs\n").expect("write");
    let out = Command::new(BROKER)
        .arg("--config")
        .arg(&bad)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("broker.flush_interval") && err.contains("50xs"),
        "{err}"
    );

    let out = Command::new(BROKER)
        .args(["--config", "/nonexistent.yaml"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.yaml: not found"));

    let out = Command::new(BROKER)
        .env("AQUEDUCT_BROKER_BACKPRESSURE_POLICY", "drop_everything")
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("broker.backpressure_policy"));
}

fn bench(home: &std::path::Path, addr: &str, args: &[&str]) -> std::process::Output {
    let child = Command::new(CLIENT)
        .args(["--addr", addr, "bench", "--json", "--idle", "3s"])
        .args(args)
        .env("AQUEDUCT_HOME", home)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bench runs");
    output_within(child, "aqueduct bench")
}

#[test]
fn bench_counts_every_message_and_reports_json() {
    let home = tempfile::tempdir().expect("dir");
    // Queues deep enough for a closed-loop burst in a debug build: nothing may be dropped here.
    let (broker, addr, _metrics, _logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_BROKER_QUEUE_SIZE", "100000")]);
    let out = bench(
        home.path(),
        &addr,
        &[
            "--messages",
            "5000",
            "--subscribers",
            "2",
            "--batch",
            "50",
            "--priority-mix",
            "0:1,3:1",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(r["msgs"], 5000);
    assert_eq!(
        (r["lost_total"].as_u64(), r["duplicates_total"].as_u64()),
        (Some(0), Some(0))
    );
    for sub in r["subscribers"].as_array().expect("subscribers") {
        assert_eq!(sub["received"], 5000);
    }
    assert_eq!(r["latency"]["samples"], 10_000);
    assert!(r["latency"]["p50_us"].as_f64().is_some_and(|v| v > 0.0));
    assert!(r["latency"]["p99_us"].as_f64() >= r["latency"]["p50_us"].as_f64());

    // A consumer group: each message to exactly one member.
    let out = bench(
        home.path(),
        &addr,
        &[
            "--messages",
            "3000",
            "--subscribers",
            "3",
            "--group",
            "--batch",
            "10",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let total: u64 = r["subscribers"]
        .as_array()
        .expect("subs")
        .iter()
        .filter_map(|s| s["received"].as_u64())
        .sum();
    assert_eq!((total, r["lost_total"].as_u64()), (3000, Some(0)));

    // Open loop at a fixed rate, single frames, several publishers and streams.
    let trace = home.path().join("trace.csv");
    let out = bench(
        home.path(),
        &addr,
        &[
            "--rate",
            "2000",
            "--duration",
            "1s",
            "--batch",
            "1",
            "--publishers",
            "2",
            "--streams",
            "2",
            "--warmup",
            "500",
            "--latency-trace",
            trace.to_str().expect("utf-8 path"),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(r["mode"], "aqueduct-latency");
    // Exactly the rate times the duration (it was one more or one fewer, by when the pacer
    // started against the clock).
    assert_eq!(r["msgs"].as_u64(), Some(2000), "2000/s for 1 s");
    // The warm-up's messages are delivered and counted, not timed.
    assert_eq!(r["subscribers"][0]["received"].as_u64(), Some(2000));
    assert_eq!(r["warmup_msgs"].as_u64(), Some(500));
    assert_eq!(r["latency"]["samples"].as_u64(), Some(1500));
    // How far behind its schedule the pacer fell (peerbench reports it too): a number, not
    // timed here.
    assert!(r["pacer_max_late_us"].as_f64().is_some(), "{r}");
    // --latency-trace: the same 1500 timed deliveries, in send order, whose latencies are the
    // histogram's (its largest within the histogram's 3 significant digits).
    let text = std::fs::read_to_string(&trace).expect("the trace was written");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("sent_ns,latency_ns"));
    let rows: Vec<(u64, u64)> = lines
        .map(|l| {
            let (a, b) = l.split_once(',').expect("two columns");
            (a.parse().expect("sent_ns"), b.parse().expect("latency_ns"))
        })
        .collect();
    assert_eq!(rows.len(), 1500);
    assert!(
        rows.windows(2).all(|w| w[0].0 <= w[1].0),
        "sorted by send time"
    );
    let max_us = rows.iter().map(|r| r.1).max().unwrap_or(0) as f64 / 1e3;
    let reported = r["latency"]["max_us"].as_f64().expect("max_us");
    assert!(
        (max_us - reported).abs() <= reported * 0.002 + 0.01,
        "trace max {max_us} us vs histogram max {reported} us"
    );
    // A warm-up that leaves nothing to time is refused before anything is sent.
    let out = bench(
        home.path(),
        &addr,
        &["--rate", "100", "--duration", "1s", "--warmup", "100"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--warmup 100 leaves no message to time: the run sends 100"),
        "{err}"
    );
    // A run whose count is not known up front (closed loop for a duration) that timed nothing
    // is not a success either.
    let out = bench(
        home.path(),
        &addr,
        &["--duration", "1s", "--warmup", "1000000000000"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no latency was measured"), "{err}");
    stop(broker);
}

#[test]
fn bench_refuses_to_call_a_lossy_run_a_success_and_says_why() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, _logs) = start_broker_with(
        home.path(),
        &[
            ("AQUEDUCT_BROKER_QUEUE_SIZE", "1"),
            ("AQUEDUCT_BROKER_BACKPRESSURE_POLICY", "drop_newest"),
        ],
    );
    let out = bench(
        home.path(),
        &addr,
        &[
            "--messages",
            "20000",
            "--batch",
            "100",
            "--overflow",
            "broker",
            "--metrics-addr",
            &metrics,
        ],
    );
    assert!(
        !out.status.success(),
        "a run with a 1-message queue must lose messages"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a successful run"), "{err}");
    assert!(err.contains("dropped by policy drop_newest"), "{err}");
    stop(broker);
}

#[test]
fn pub_and_sub_against_a_real_broker_then_sigterm() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    assert!(
        home.path().join("dev-cert.pem").is_file(),
        "the dev certificate was written"
    );

    let sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "orders/+", "--count", "2"],
    );
    // Wait until the broker has the subscription (its log says so), then publish.
    loop {
        let line = logs.recv_timeout(WAIT).expect("broker log line");
        if line.contains("subscribed") {
            break;
        }
    }
    let out = Command::new(CLIENT)
        .args([
            "--addr",
            &addr,
            "pub",
            "orders/eu",
            "hello",
            "--priority",
            "0",
        ])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("pub runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(CLIENT)
        .args(["--addr", &addr, "pub", "orders/us", "world", "--confirm"])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("pub runs");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("published to orders/us at offset 0"));

    let out = output_within(sub, "aqueduct sub (after 2 messages)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["orders/eu #0 p0: hello", "orders/us #0 p2: world"]
    );

    // A refused name is explained once, not once per layer of the error chain.
    let out = run_client(home.path(), &["--addr", &addr, "pub", "orders/#/x", "y"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("'#'").count(), 1, "{err}");

    // A host that is not local is not trusted on the dev certificate.
    let out = Command::new(CLIENT)
        .args(["--addr", "192.0.2.1:4242", "pub", "t", "x"])
        .env("AQUEDUCT_HOME", home.path())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no way to verify the broker"));

    // A CA given to a local broker that shows its development certificate: the error says to
    // leave --ca out (it said to pass the --ca that was passed).
    let certs = home.path().join("certs");
    let certs = certs.to_str().expect("utf-8");
    let made = run_client(home.path(), &["cert", "ca", "--out", certs]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let ca = format!("{certs}/ca.pem");
    let out = run_client(
        home.path(),
        &["--addr", &addr, "--ca", &ca, "pub", "t", "x"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("development certificate") && err.contains("leave out --ca"),
        "{err}"
    );

    // Graceful shutdown on SIGTERM, exit status 0.
    stop(broker);
}

/// `--transport webtransport`: the CLI over WebTransport (HTTP/3 on the broker's port, as a
/// browser connects), trusting the same development certificate file; a subscriber over
/// WebTransport gets what a publisher over QUIC sends and the other way round, and the bench
/// tool runs over it too.
#[test]
fn the_cli_works_over_webtransport() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let wt = ["--addr", addr.as_str(), "--transport", "webtransport"];
    let sub = Command::new(CLIENT)
        .args(wt)
        .args(["sub", "news/+", "--count", "2"])
        .env("AQUEDUCT_HOME", home.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sub starts");
    loop {
        let line = logs.recv_timeout(WAIT).expect("broker log line");
        if line.contains("subscribed") {
            break;
        }
    }
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "news/a", "over QUIC", "--confirm"],
    ));
    let mut args = wt.to_vec();
    args.extend(["pub", "news/b", "over WebTransport", "--confirm"]);
    let out = run_client(home.path(), &args);
    assert_ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("published to news/b at offset 0"));
    let out = output_within(sub, "aqueduct sub over WebTransport");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .collect::<Vec<_>>(),
        ["news/a #0 p2: over QUIC", "news/b #0 p2: over WebTransport"]
    );
    let mut args = wt.to_vec();
    args.extend([
        "bench",
        "--json",
        "--messages",
        "2000",
        "--payload-size",
        "64",
    ]);
    let out = run_client(home.path(), &args);
    assert_ok(&out);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("\"lost_total\":0,") && report.contains("\"received\":2000,"),
        "{report}"
    );
    stop(broker);
}

const BENCH: &str = env!("CARGO_BIN_EXE_aqueduct-bench");

/// The seed's command lines, as its README writes them (single-dash Go flags; the seed's own
/// config.yaml), and the client's `:PORT` address form.
#[test]
fn the_seeds_command_lines_work_as_written() {
    let home = tempfile::tempdir().expect("dir");
    let seed_config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../aqueduct-server/tests/fixtures/seed-v1.13-config.yaml"
    );
    let (broker, addr, _metrics, _logs) = start_broker_cmd(
        home.path(),
        &[
            "-config",
            seed_config,
            "-addr",
            "127.0.0.1:0",
            "-metrics-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    let child = Command::new(BENCH)
        .args([
            "-addr",
            &addr,
            "-streams",
            "10",
            "-messages",
            // Fewer than the seed config's queue_size (1024, drop_oldest): nothing can be
            // dropped even if the subscriber falls behind in a debug build.
            "1000",
            "-payload-size",
            "128",
        ])
        .env("AQUEDUCT_HOME", home.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aqueduct-bench runs");
    let out = output_within(child, "aqueduct-bench");
    assert_ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("1000"));
    let port = addr.rsplit(':').next().expect("port");
    let addr = format!(":{port}");
    assert_ok(&run_client(
        home.path(),
        &["-addr", &addr, "pub", "t", "x", "--confirm"],
    ));
    stop(broker);
}

/// The README's dead-letter step: a worker that rejects everything (`--nack`) makes a dead
/// letter, and `aqueduct sub` shows where it came from. A worker stopped with SIGTERM closes its
/// connection at once (the broker logs the disconnect well before any idle timeout).
#[test]
fn nack_makes_a_dead_letter_and_sigterm_closes_the_worker() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, _metrics, logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_TRANSPORT_IDLE_TIMEOUT", "120s")]);
    let dlq = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "__dlq__jobs", "--count", "1"],
    );
    wait_for_log(&logs, "subscribed");
    let worker = spawn_client(
        home.path(),
        &[
            "--addr", &addr, "sub", "jobs", "--group", "workers", "--nack",
        ],
    );
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "jobs", "poison"],
    ));
    let out = output_within(dlq, "the dead-letter subscriber");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("__dlq__jobs #0")
            && text.contains(
                "dead letter of jobs #0 after 4 attempts: rejected by aqueduct sub --nack"
            )
            && text.trim_end().ends_with(": poison"),
        "{text}"
    );
    sigterm_closes_cleanly(worker, "the worker after SIGTERM");
    wait_for_log(&logs, "disconnected");
    stop(broker);
}

/// `sub --durable` against a broker without the durable log says it got an in-memory consumer
/// group (the broker's CONFIRM tells), instead of letting the user believe the position is kept.
#[test]
fn sub_durable_says_when_the_broker_has_no_log() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let sub = spawn_client(
        home.path(),
        &[
            "--addr",
            &addr,
            "sub",
            "orders",
            "--durable",
            "audit",
            "--count",
            "1",
        ],
    );
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "orders", "kept?"],
    ));
    let out = output_within(sub, "the durable subscriber");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.contains("orders #0 p2: kept?"), "{stdout}");
    assert!(
        stderr.contains("durable consumer audit, in memory only") && stderr.contains("aal.enabled"),
        "{stderr}"
    );
    stop(broker);
}

/// Nothing is reported as published when the broker refused the TLS handshake, and the
/// refusal is said in plain words.
#[test]
fn pub_to_a_broker_requiring_client_certificates_fails_clearly() {
    let home = tempfile::tempdir().expect("dir");
    let ca = {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.self_signed(&key).expect("ca").pem()
    };
    let ca_file = home.path().join("ca.pem");
    std::fs::write(&ca_file, ca).expect("write");
    let ca_path = ca_file.to_string_lossy().into_owned();
    let (broker, addr, _metrics, _logs) = start_broker_with(
        home.path(),
        &[
            ("AQUEDUCT_TLS_REQUIRE_CLIENT_CERT", "true"),
            ("AQUEDUCT_TLS_CLIENT_CA_FILE", &ca_path),
        ],
    );
    for confirm in [false, false, true, true] {
        let mut args = vec!["--addr", &addr, "pub", "t", "x"];
        if confirm {
            args.push("--confirm");
        }
        let out = run_client(home.path(), &args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "reported success: {stdout}");
        assert!(!stdout.contains("published"), "{stdout}");
        assert!(stderr.contains("requires a client certificate"), "{stderr}");
        // How to give one, in the CLI's terms (the client library's own text named its Rust
        // API here).
        assert!(
            stderr.contains("pass --cert and --key") && !stderr.contains("ConnectOptions"),
            "{stderr}"
        );
        // Said once: the close fails for the same reason, and that was printed (first) too.
        assert_eq!(
            stderr.matches("requires a client certificate").count(),
            1,
            "{stderr}"
        );
    }
    stop(broker);
}

/// Commands that need no broker refuse the connection options instead of ignoring them:
/// `cert server --ca other/ca.pem` signed with the --out directory's CA all the same, and
/// `log dump --key aal.key` took the log's key for a TLS client key (found by a new user).
#[test]
fn commands_without_a_broker_refuse_connection_options() {
    let home = tempfile::tempdir().expect("temp dir");
    let out = home.path().join("certs");
    let out = out.to_str().expect("utf-8 path");
    for (args, flags, hint) in [
        (
            vec!["cert", "server", "--out", out, "--ca", "other/ca.pem"],
            "--ca",
            "ca-key.pem",
        ),
        (
            vec!["--addr", "10.0.0.1:4242", "cert", "ca", "--out", out],
            "--addr",
            "ca-key.pem",
        ),
        (
            vec!["cert", "-a", "10.0.0.1:4242", "ca", "--out", out],
            "--addr (-a)",
            "ca-key.pem",
        ),
        (
            vec!["log", "dump", "aal", "--key", "aal.key", "--topic", "t"],
            "--key",
            "--key-file",
        ),
        (
            vec!["trace-sink", "--pin", "ab", "--transport", "webtransport"],
            "--pin, --transport",
            "--listen",
        ),
    ] {
        let o = run_client(home.path(), &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(&format!("does not use {flags}")) && err.contains(hint),
            "{args:?}: {err}"
        );
    }
    assert!(!home.path().join("certs").exists(), "nothing was written");
    // Without them, and with AQUEDUCT_ADDR in the environment (not a mistake), it works.
    let o = Command::new(CLIENT)
        .args(["cert", "ca", "--out", out])
        .env("AQUEDUCT_HOME", home.path())
        .env("AQUEDUCT_ADDR", "10.0.0.1:4242")
        .output()
        .expect("aqueduct runs");
    assert_ok(&o);
    assert!(home.path().join("certs/ca-key.pem").exists());
    // A command that needs a broker, with no broker's certificate in this AQUEDUCT_HOME: the
    // error says where the file comes from.
    let o = run_client(home.path(), &["pub", "t", "m"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("cannot read development certificate") && err.contains("$AQUEDUCT_HOME"),
        "{err}"
    );
    // Bench inputs it cannot run are refused before connecting: a message count whose
    // bookkeeping it could not allocate (it aborted), a rate whose pacing interval is no
    // duration (it panicked) or that never ends.
    for (args, said) in [
        (
            vec!["bench", "--messages", "18446744073709551615"],
            "1..=1000000000",
        ),
        (vec!["bench", "--rate", "1e-300"], "a rate from 0.01"),
        (
            vec!["bench", "--rate", "inf", "--duration", "1s"],
            "a rate from 0.01",
        ),
    ] {
        let o = run_client(home.path(), &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
    // `admin kick` takes a client id or --connection: without either, the usage says both (it
    // named only <CLIENT>, which --help shows as optional).
    let o = run_client(home.path(), &["admin", "kick"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("<CLIENT|--connection <CONNECTION>>"), "{err}");
}

/// `aqueduct cert` makes a CA, a broker certificate and a client certificate that work together
/// for mutual TLS as written in docs/howto-tls.md: the broker names the client by its
/// certificate, and a client without one is refused.
#[test]
fn cert_makes_a_working_mutual_tls_setup() {
    let home = tempfile::tempdir().expect("dir");
    let certs = home.path().join("certs");
    let dir = certs.to_string_lossy().into_owned();
    for args in [
        vec!["cert", "ca", "--out", &dir],
        vec!["cert", "server", "--out", &dir],
        vec!["cert", "client", "alice", "--out", &dir],
    ] {
        assert_ok(&run_client(home.path(), &args));
    }
    let file = |name: &str| certs.join(name).to_string_lossy().into_owned();
    let (server, server_key, ca) = (file("server.pem"), file("server-key.pem"), file("ca.pem"));
    let (broker, addr, _metrics, logs) =
        start_mtls_broker(home.path(), (&server, &server_key), &ca, &[]);
    let (alice, alice_key) = (file("alice.pem"), file("alice-key.pem"));
    // A confirmed publish as alice; the broker's certificate is verified for the address, or
    // for `server_name` when given.
    let publish_as_alice = |server_name: Option<&str>| {
        let mut args = vec!["--addr", &addr];
        if let Some(name) = server_name {
            args.extend(["--server-name", name]);
        }
        args.extend([
            "--ca",
            &ca,
            "--cert",
            &alice,
            "--key",
            &alice_key,
            "pub",
            "t",
            "x",
            "--confirm",
        ]);
        assert_ok(&run_client(home.path(), &args));
    };
    publish_as_alice(None);
    wait_for_log(&logs, "client=alice@");
    // The broker certificate's default names cover IPv6 loopback too (the default listen
    // address serves it): verified as `::1` while connecting over 127.0.0.1.
    publish_as_alice(Some("::1"));
    let out = run_client(
        home.path(),
        &["--addr", &addr, "--ca", &ca, "pub", "t", "x"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("requires a client certificate"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stop(broker);
}

/// A broker on 127.0.0.1 with the certificate and key `server`, requiring client certificates
/// of the CAs in `cas`, with `more` environment.
fn start_mtls_broker(
    home: &std::path::Path,
    (cert, key): (&str, &str),
    cas: &str,
    more: &[(&str, &str)],
) -> (Broker, String, String, std::sync::mpsc::Receiver<String>) {
    let mut env = vec![
        ("AQUEDUCT_TLS_REQUIRE_CLIENT_CERT", "true"),
        ("AQUEDUCT_TLS_CLIENT_CA_FILE", cas),
    ];
    env.extend_from_slice(more);
    let args = [
        "--addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--cert",
        cert,
        "--key",
        key,
    ];
    start_broker_cmd(home, &args, &env)
}

/// A CA rollover as howto-tls describes it: two CAs made by `aqueduct cert ca`, both trusted
/// (`tls.client_ca_file`) with both revocation lists (`tls.crl_file`). Clients of either CA
/// connect, a revoked one of either is refused. Every CA was named "Aqueduct CA", and the
/// broker refused to start on two lists of one name.
#[test]
fn a_new_ca_can_be_trusted_beside_the_old_one_with_both_revocation_lists() {
    let home = tempfile::tempdir().expect("dir");
    let path = |dir: &str, name: &str| {
        home.path()
            .join(dir)
            .join(name)
            .to_string_lossy()
            .into_owned()
    };
    let (old, new) = (path("old", ""), path("new", ""));
    for args in [
        vec!["cert", "ca", "--out", &old],
        vec!["cert", "server", "--out", &old],
        vec!["cert", "client", "alice", "--out", &old],
        vec!["cert", "client", "mallory", "--out", &old],
        vec!["cert", "ca", "--out", &new],
        vec!["cert", "client", "bob", "--out", &new],
        vec!["cert", "client", "eve", "--out", &new],
    ] {
        assert_ok(&run_client(home.path(), &args));
    }
    let (mallory, eve) = (path("old", "mallory.pem"), path("new", "eve.pem"));
    assert_ok(&run_client(
        home.path(),
        &["cert", "revoke", &mallory, "--out", &old],
    ));
    assert_ok(&run_client(
        home.path(),
        &["cert", "revoke", &eve, "--out", &new],
    ));
    let both = |name: &str| {
        let joined = home.path().join(format!("both-{name}"));
        let text = [path("old", name), path("new", name)]
            .iter()
            .map(|p| std::fs::read_to_string(p).expect("read"))
            .collect::<String>();
        std::fs::write(&joined, text).expect("write");
        joined.to_string_lossy().into_owned()
    };
    let (cas, crls) = (both("ca.pem"), both("crl.pem"));
    let (server, server_key) = (path("old", "server.pem"), path("old", "server-key.pem"));
    let (broker, addr, _metrics, _logs) = start_mtls_broker(
        home.path(),
        (&server, &server_key),
        &cas,
        &[("AQUEDUCT_TLS_CRL_FILE", &crls)],
    );
    let ca = path("old", "ca.pem");
    let publish_as = |dir: &str, client: &str| {
        let (cert, key) = (
            path(dir, &format!("{client}.pem")),
            path(dir, &format!("{client}-key.pem")),
        );
        run_client(
            home.path(),
            &[
                "--addr",
                &addr,
                "--ca",
                &ca,
                "--cert",
                &cert,
                "--key",
                &key,
                "pub",
                "t",
                "x",
                "--confirm",
            ],
        )
    };
    assert_ok(&publish_as("old", "alice"));
    assert_ok(&publish_as("new", "bob"));
    for (dir, revoked) in [("old", "mallory"), ("new", "eve")] {
        let out = publish_as(dir, revoked);
        assert!(!out.status.success(), "{revoked} was let in");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("revoked"), "{revoked}: {err}");
    }
    stop(broker);
}

/// A Ctrl-C/SIGTERM that arrives while `aqueduct sub` is busy with a message (`--work`) is not
/// lost: the subscriber closes its connection at once.
#[test]
fn a_signal_during_work_stops_the_subscriber() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let mut worker = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "slow", "--ack", "--work", "60s"],
    );
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "slow", "job"],
    ));
    // Wait until it printed the message, i.e. it is "working" on it.
    let stdout = worker.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("a line");
    assert!(line.contains("slow #0"), "{line}");
    let err = sigterm_closes_cleanly(worker, "the subscriber after SIGTERM during --work");
    // It says that the message it printed was not acknowledged, and what becomes of it (a
    // plain subscription's: dropped); "after 0 message(s)" alone read as if nothing had come.
    assert!(
        err.contains(
            "SIGTERM: closed the connection after 0 message(s) handled; the last one printed was \
             not acknowledged, and a plain subscription's messages are not delivered again"
        ),
        "{err}"
    );
    // Stopped before --count messages came: it still closes cleanly, but does not exit 0
    // (`timeout 5 aqueduct sub t --count 1 && …` went on as if the message had come).
    let mut waiting = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "none", "--count", "1"],
    );
    // Once it says it is subscribed, a signal is its own to handle.
    let mut said = String::new();
    let mut stderr = BufReader::new(waiting.stderr.take().expect("stderr"));
    stderr.read_line(&mut said).expect("a line");
    assert!(said.contains("subscribed to none"), "{said}");
    let out = sigterm(waiting, "the subscriber waiting for --count after SIGTERM");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut err).expect("the rest of stderr");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("SIGTERM: closed the connection after 0 message(s)")
            && err.contains("SIGTERM before 1 message(s) arrived: 0 did"),
        "{err}"
    );
    // `aqueduct-bench` is `aqueduct bench`, and its help says how to run it.
    let out = Command::new(BENCH).arg("--help").output().expect("runs");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Usage: aqueduct bench"), "{help}");
    stop(broker);
}

/// A broker whose standard error goes away (a pipe whose reader exited, a closed terminal) loses
/// its log lines but keeps serving and stops cleanly: tracing-subscriber used to report the failed
/// write with `eprintln!`, which panicked on the same broken stream (exit status 101).
#[test]
fn a_broker_whose_stderr_is_closed_still_stops_cleanly() {
    let home = tempfile::tempdir().expect("dir");
    let mut child = common::Broker::from(
        Command::new(BROKER)
            .args([
                "--addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
                "--log",
                "info",
            ])
            .env("AQUEDUCT_HOME", home.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("broker starts"),
    );
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    while !line.contains("metrics endpoint listening") {
        line.clear();
        assert!(
            stderr.read_line(&mut line).expect("a log line") > 0,
            "broker exited early"
        );
    }
    drop(stderr); // the reader goes away: the broker's next log line fails to write
    stop(child);
}

/// `broker.worker_threads` sizes the broker's runtime (shown by its gauge), and a broker on one
/// thread serves a confirmed publish to a subscriber; unset, the runtime has a thread per CPU.
#[test]
fn worker_threads_sizes_the_runtime() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_BROKER_WORKER_THREADS", "1")]);
    assert_eq!(
        metric(&metrics, "aqueduct_runtime_worker_threads"),
        Some(1.0)
    );
    let sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "one/thread", "--count", "1"],
    );
    wait_for_log(&logs, "subscribed");
    let out = run_client(
        home.path(),
        &["--addr", &addr, "pub", "one/thread", "hi", "--confirm"],
    );
    assert_ok(&out);
    let out = output_within(sub, "aqueduct sub (after 1 message)");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "one/thread #0 p2: hi"
    );
    // The runtime's own counters: the one worker has run tasks, and has slept between them.
    let parks = metric(&metrics, "aqueduct_runtime_worker_parks_total").expect("parks");
    assert!(parks >= 1.0, "{parks}");
    let busy = metric(&metrics, "aqueduct_runtime_worker_busy_seconds_total").expect("busy");
    assert!(busy > 0.0, "{busy}");
    stop(broker);

    let home = tempfile::tempdir().expect("dir");
    let (broker, _addr, metrics, _logs) = start_broker_with(home.path(), &[]);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        metric(&metrics, "aqueduct_runtime_worker_threads"),
        Some(cpus as f64)
    );
    stop(broker);
}

/// `broker.idle_spin` is wired into the broker's runtime: by default its threads spin before
/// they sleep while messages come close together (counted), and with "0s" they never do.
#[test]
fn idle_spin_is_on_by_default_and_off_with_zero() {
    let spins = |metrics: &str| {
        let found = metric(metrics, "aqueduct_runtime_idle_spins_total").expect("spins");
        let seconds = metric(metrics, "aqueduct_runtime_idle_spin_seconds_total").expect("time");
        (found, seconds)
    };
    let bench = |home: &std::path::Path, addr: &str| {
        let out = run_client(
            home,
            &["--addr", addr, "bench", "--json", "--messages", "20000"],
        );
        assert_ok(&out);
    };

    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, _logs) = start_broker_with(home.path(), &[]);
    // A bench run keeps the broker's threads busy with short gaps; a few runs at most, on a
    // machine busy with other tests.
    let mut moved = false;
    for _ in 0..5 {
        bench(home.path(), &addr);
        if spins(&metrics).0 > 0.0 {
            moved = true;
            break;
        }
    }
    assert!(moved, "no spin counted: {:?}", spins(&metrics));
    assert!(spins(&metrics).1 > 0.0);
    stop(broker);

    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, _logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_BROKER_IDLE_SPIN", "0s")]);
    for _ in 0..3 {
        bench(home.path(), &addr);
        assert_eq!(spins(&metrics), (0.0, 0.0));
    }
    stop(broker);
}

/// `aqueduct info` prints what the broker's INFO answer says: its configured limits.
#[test]
fn info_prints_the_broker_s_limits() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, _metrics, _logs) = start_broker_with(
        home.path(),
        &[
            ("AQUEDUCT_TRANSPORT_MAX_BUF_SIZE", "4096"),
            ("AQUEDUCT_TRANSPORT_MAX_SUBSCRIPTIONS_PER_CONNECTION", "7"),
        ],
    );
    let out = run_client(home.path(), &["--addr", &addr, "info"]);
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(
        lines[0].starts_with("broker            aqueduct-broker "),
        "{text}"
    );
    assert_eq!(lines[1], "protocol          1");
    assert!(
        lines[2].starts_with("max frame in      4096 bytes "),
        "{text}"
    );
    assert!(
        lines[3].starts_with("max frame out     5120 bytes "),
        "{text}"
    );
    assert!(
        lines[4].starts_with("subscriptions     7 per connection "),
        "{text}"
    );
    assert!(lines[5].starts_with("durable log       off "), "{text}");
    let out = run_client(home.path(), &["--addr", &addr, "info", "--json"]);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["max_data_len"], 4096);
    assert_eq!(v["max_delivery_data_len"], 5120);
    assert_eq!(v["max_subscriptions"], 7);
    assert_eq!(v["protocol"], 1);
    assert_eq!(v["durable"], false);
    assert!(
        v["broker"]
            .as_str()
            .is_some_and(|b| b.starts_with("aqueduct-broker ")),
        "{v}"
    );
    stop(broker);
}

/// A command that fails after connecting (here a publish the broker refuses as too large)
/// still closes its connection: the broker logs the close at once, not an idle timeout later.
#[test]
fn a_failed_command_closes_its_connection() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, _metrics, logs) = start_broker_with(
        home.path(),
        &[
            ("AQUEDUCT_TRANSPORT_MAX_BUF_SIZE", "1024"),
            // Far beyond the wait below: a connection left open would only go at its timeout.
            ("AQUEDUCT_TRANSPORT_IDLE_TIMEOUT", "120s"),
        ],
    );
    let big = "x".repeat(2000);
    let out = run_client(
        home.path(),
        &["--addr", &addr, "pub", "too/big", &big, "--confirm"],
    );
    assert!(!out.status.success(), "a refused publish is an error");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("FRAME_TOO_LARGE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = loop {
        let line = logs
            .recv_timeout(WAIT)
            .expect("the broker logs the client's disconnect without waiting for a timeout");
        if line.contains("disconnected") {
            break line;
        }
    };
    assert!(!line.contains("timed out"), "{line}");
    stop(broker);
}

/// `aqueduct sub ... | head -1`: once its reader has gone, the subscriber stops quietly at the
/// next message (closing its connection cleanly, that message unsettled) instead of the panic
/// `println!` made of the broken pipe (exit status 101 and a backtrace).
#[test]
fn a_subscriber_whose_output_is_closed_stops_quietly() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let mut sub = spawn_client(home.path(), &["--addr", &addr, "sub", "piped"]);
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "piped", "first"],
    ));
    let stdout = sub.stdout.take().expect("stdout");
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).expect("a line");
    assert!(line.contains("piped #0"), "{line}");
    drop(reader);
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "piped", "second"],
    ));
    let out = output_within(sub, "the subscriber after its output closed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("standard output closed: closed the connection after 1 message(s)"),
        "{err}"
    );
    stop(broker);
}

/// The admin command's own options may follow its subcommand (`admin cluster --json
/// --admin-addr ...`, as howto-cluster.md writes them), and an admin address where nothing
/// listens is named, with the option that sets it.
#[test]
fn admin_options_follow_the_subcommand_and_a_refused_address_is_explained() {
    let home = tempfile::tempdir().expect("dir");
    let certs = home.path().join("certs");
    assert_ok(&run_client(
        home.path(),
        &["cert", "ca", "--out", certs.to_str().expect("utf-8")],
    ));
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = free.local_addr().expect("addr").to_string();
    drop(free);
    // An admin certificate: without one the CLI says so before dialing.
    assert_ok(&run_client(
        home.path(),
        &[
            "cert",
            "client",
            "admin-x",
            "--out",
            certs.to_str().expect("utf-8"),
        ],
    ));
    let path = |name: &str| certs.join(name).to_str().expect("utf-8").to_owned();
    let (ca, cert, key) = (path("ca.pem"), path("admin-x.pem"), path("admin-x-key.pem"));
    let out = run_client(
        home.path(),
        &[
            "--ca",
            &ca,
            "--cert",
            &cert,
            "--key",
            &key,
            "admin",
            "cluster",
            "--json",
            "--admin-addr",
            &addr,
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(
        err.contains(&format!("is {addr} its admin.listen_addr")) && err.contains("--admin-addr"),
        "{err}"
    );
}

/// `sub --ack` whose ACK the broker refuses (it came after the ack wait: the message is
/// delivered again) fails, naming the refusal. The close's error was dropped: the command exited
/// 0 as if the message had been acknowledged.
#[test]
fn sub_fails_when_the_broker_refused_its_ack() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, _metrics, logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_BROKER_ACK_WAIT", "1s")]);
    let sub = spawn_client(
        home.path(),
        &[
            "--addr", &addr, "sub", "w", "--ack", "--count", "1", "--work", "2500ms",
        ],
    );
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "w", "job"],
    ));
    let out = output_within(sub, "the subscriber");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("STALE_ATTEMPT"), "{err}");
    stop(broker);
}

/// A subscriber whose broker shuts down says so and fails: it exited 0, as if it had got the
/// messages it waited for.
#[test]
fn sub_fails_when_the_broker_shuts_down() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "x/#", "--count", "5"],
    );
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "x/a", "hello"],
    ));
    stop(broker);
    let out = output_within(sub, "the subscriber");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("shutting down") && err.contains("after 1 message(s)"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("x/a #0"));
}

/// `pub` without a message publishes each line of standard input as it is read (`tail -f log |
/// aqueduct pub logs`): it read all of it first, so nothing went out before the input ended.
#[test]
fn pub_publishes_each_line_of_its_input_as_it_comes() {
    use std::io::Write;
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let mut sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "lines", "--count", "2"],
    );
    wait_for_log(&logs, "subscribed");
    let (publisher, mut input) = spawn_stdin_publisher(home.path(), &addr, "lines");
    input.write_all(b"line-a\n").expect("write");
    input.flush().expect("flush");
    // The first line arrives while the input is still open.
    let mut received = BufReader::new(sub.stdout.take().expect("stdout"));
    let mut line = String::new();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = received.read_line(&mut line);
        let _ = tx.send((line, received));
    });
    let (line, mut received) = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("line-a arrives before the input ends");
    assert!(line.trim_end().ends_with(": line-a"), "{line}");
    input.write_all(b"line-b\r\n").expect("write");
    drop(input);
    assert_ok(&output_within(publisher, "the publisher"));
    let mut line = String::new();
    received.read_line(&mut line).expect("line-b");
    assert!(line.trim_end().ends_with(": line-b"), "{line}");
    assert_ok(&output_within(sub, "the subscriber"));
    stop(broker);
}

/// A subscriber whose standard output and standard error are both gone (`aqueduct sub t 2>&1 |
/// head -n 1`) stops without a panic: its last words to standard error panicked (exit 101).
#[test]
fn a_subscriber_whose_output_and_error_are_closed_stops_without_a_panic() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let mut sub = spawn_client(home.path(), &["--addr", &addr, "sub", "gone"]);
    wait_for_log(&logs, "subscribed");
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "gone", "first"],
    ));
    let mut reader = BufReader::new(sub.stdout.take().expect("stdout"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("a line");
    drop(reader);
    drop(sub.stderr.take());
    assert_ok(&run_client(
        home.path(),
        &["--addr", &addr, "pub", "gone", "second"],
    ));
    let out = output_within(sub, "the subscriber after its outputs closed");
    assert_eq!(out.status.code(), Some(0), "{:?}", out.status);
    stop(broker);
}

/// Flags that cannot mean anything are refused before connecting: `--count 0`, and
/// `--max-in-flight` on a subscription without acknowledgements (it did nothing).
#[test]
fn sub_refuses_flags_that_mean_nothing() {
    let home = tempfile::tempdir().expect("dir");
    let out = run_client(home.path(), &["sub", "x", "--count", "0"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run_client(home.path(), &["sub", "x", "--max-in-flight", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--max-in-flight goes with --ack"), "{err}");
}

/// Without AQUEDUCT_HOME and HOME (a systemd service without `User=`): the development
/// certificate goes to this user's private directory in the temporary directory, which local
/// clients trust only while it is private; the durable log needs a directory named, and is
/// never put in the temporary directory (a reboot may empty it).
#[cfg(unix)]
#[test]
fn without_a_home_the_dev_cert_is_private_and_the_log_needs_a_directory() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("dir");
    let homeless = |program: &str| {
        let mut cmd = Command::new(program);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("TMPDIR", tmp.path());
        cmd
    };
    let mut cmd = homeless(BROKER);
    cmd.args(["--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"]);
    let (broker, addr, _metrics, _logs) = start_listening(cmd);
    let private: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("listed")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(private.len(), 1, "{private:?}");
    let dir = &private[0];
    assert!(
        dir.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("aqueduct-")),
        "{dir:?}"
    );
    assert!(dir.join("dev-cert.pem").is_file());
    let mode = std::fs::metadata(dir).expect("meta").permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{dir:?}");
    // A client without a home trusts it there.
    let publish = || {
        homeless(CLIENT)
            .args(["--addr", &addr, "pub", "t", "x"])
            .output()
            .expect("runs")
    };
    assert_ok(&publish());
    // Opened to others (anyone could have put a certificate there): not trusted.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let out = publish();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not trusted") && err.contains("mode 777"),
        "{err}"
    );
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    stop(broker);

    // The durable log on its defaults has nowhere safe to go: startup stops, naming the key.
    let out = homeless(BROKER)
        .args([
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--aal",
        ])
        .env("AQUEDUCT_AAL_ALLOW_PLAINTEXT", "true")
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("aal.file_path") && err.contains("neither AQUEDUCT_HOME nor HOME"),
        "{err}"
    );
    // `aqueduct log` says to give the directory (an argument: there is no --dir).
    let out = homeless(CLIENT)
        .args(["log", "verify"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("give it as the command's DIR argument"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `aqueduct log verify` whose standard output cannot be written (here /dev/full: a full disk)
/// fails with the write's error. It panicked ("failed printing to stdout"), as it did on a
/// closed pipe (`aqueduct log verify | head -1`).
#[test]
fn log_verify_with_an_unwritable_output_fails_without_a_panic() {
    let dir = tempfile::tempdir().expect("dir");
    let (log, _) =
        aqueduct_log::Log::open(dir.path(), aqueduct_log::LogOptions::default()).expect("open");
    log.close().expect("close");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let out = Command::new(CLIENT)
        .args(["log", "verify"])
        .arg(dir.path())
        .stdout(full)
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("No space left"), "{err}");
}

/// A log filter the broker cannot use stops it, naming --log: it fell back on "info" unsaid,
/// and a misspelt level was taken as a target, which left the log empty.
#[test]
fn a_log_filter_that_cannot_work_stops_the_broker() {
    for (filter, says) in [
        ("debgu", "did you mean \"debug\""),
        ("aqueduct_server=loud", "TARGET=LEVEL"),
    ] {
        let out = Command::new(BROKER)
            .args(["--addr", "127.0.0.1:0", "--log", filter])
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "{filter}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--log") && err.contains(says),
            "{filter}: {err}"
        );
    }
}

/// Ctrl-C/SIGTERM ends `aqueduct hold` early, and its connections are closed (the broker says
/// so at once): it died with the signal, and the broker kept them until its idle timeout.
#[test]
fn a_signal_ends_hold_closing_its_connections() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let mut hold = spawn_client(
        home.path(),
        &[
            "--addr",
            &addr,
            "hold",
            "--connections",
            "2",
            "--seconds",
            "600s",
        ],
    );
    let mut out = std::io::BufReader::new(hold.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("a line");
    assert_eq!(line.trim(), "ready");
    let done = sigterm(hold, "hold after SIGTERM");
    let err = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(0), "{err}");
    assert!(
        err.contains("SIGTERM: closing the held connections"),
        "{err}"
    );
    for _ in 0..2 {
        wait_for_log(&logs, "disconnected");
    }
    stop(broker);
}

/// `aqueduct bench-durable` against a broker without the durable log says so and fails at once:
/// its confirmed publishes measured routing only, reported as the log's figure.
#[test]
fn bench_durable_refuses_a_broker_without_the_log() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, _logs) = start_broker_with(home.path(), &[]);
    for mode in [&["publish"][..], &["replay", "--consumer", "r1"]] {
        let mut args = vec!["--addr", &addr, "bench-durable", "--messages", "1000"];
        args.extend_from_slice(mode);
        let out = run_client(home.path(), &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{mode:?}: {err}");
        assert!(
            err.contains(
                "has no durable log (aal.enabled is false), and bench-durable measures the \
                 log: start the broker with AQUEDUCT_AAL_ENABLED=true (see docs/howto-log.md)"
            ),
            "{mode:?}: {err}"
        );
    }
    assert_eq!(
        metric(&metrics, "aqueduct_messages_published_total").unwrap_or(0.0),
        0.0,
        "nothing was published"
    );
    stop(broker);
}

/// Ctrl-C/SIGTERM ends `aqueduct bench-durable` with a failure, and its connection is closed
/// (the broker says so at once): it died with the signal, and the broker kept the connection
/// until its idle timeout.
#[test]
fn a_signal_ends_bench_durable_closing_its_connection() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, metrics, logs) = start_broker_with(
        home.path(),
        &[
            ("AQUEDUCT_AAL_ENABLED", "true"),
            (
                "AQUEDUCT_AAL_KEY",
                "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
            ),
        ],
    );
    let bench = spawn_client(
        home.path(),
        &[
            "--addr",
            &addr,
            "bench-durable",
            "--messages",
            "1000000000",
            "publish",
        ],
    );
    // Publishing: connected, and listening for signals (before it started).
    let deadline = std::time::Instant::now() + WAIT;
    while metric(&metrics, "aqueduct_messages_published_total").unwrap_or(0.0) < 1.0 {
        assert!(std::time::Instant::now() < deadline, "nothing published");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let out = sigterm(bench, "bench-durable after SIGTERM");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("SIGTERM: the durable bench was stopped before its end"),
        "{err}"
    );
    wait_for_log(&logs, "disconnected");
    stop(broker);
}

/// Ctrl-C/SIGTERM ends `aqueduct bench` early with a report of what was sent, its connections
/// closed, and a failure (the planned run was not made). It died with the signal, saying
/// nothing and closing nothing.
#[test]
fn a_signal_ends_bench_with_a_report_of_what_was_sent() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let bench = spawn_client(
        home.path(),
        &[
            "--addr",
            &addr,
            "bench",
            "--duration",
            "60s",
            "--rate",
            "1000",
            "--topic",
            "signalled",
        ],
    );
    // Its subscriber is there: it is connected, and its signal handler is in place.
    wait_for_log(&logs, "subscribed");
    let out = sigterm(bench, "bench after SIGTERM");
    let err = String::from_utf8_lossy(&out.stderr);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        report.contains("published") && report.contains("latency"),
        "{report}"
    );
    assert!(
        err.contains("SIGTERM: the bench was stopped early"),
        "{err}"
    );
    stop(broker);
}

/// Ctrl-C/SIGTERM ends `aqueduct pub` reading standard input cleanly: the lines read are
/// published, the connection closed, and it says how many went (it was killed by the signal).
/// A `pub -n N` stopped short of N exits 1.
#[test]
fn a_signal_ends_pub_cleanly_and_says_what_was_published() {
    use std::io::Write;
    let home = tempfile::tempdir().expect("dir");
    let (broker, addr, logs) = start_broker(home.path());
    let sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "lines", "--count", "2"],
    );
    wait_for_log(&logs, "subscribed");
    let (publisher, mut stdin) = spawn_stdin_publisher(home.path(), &addr, "lines");
    stdin.write_all(b"one\ntwo\n").expect("written");
    stdin.flush().expect("flushed");
    // Both arrived: the publisher is connected, reading, and has its handler.
    let out = output_within(sub, "the subscriber of two lines");
    assert_ok(&out);
    let out = sigterm(publisher, "pub after SIGTERM");
    drop(stdin);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("published 2 message(s) to lines"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(err.contains("SIGTERM: stopped publishing"), "{err}");

    // Asked for more than it sent: not a success.
    let sub = spawn_client(
        home.path(),
        &["--addr", &addr, "sub", "many", "--count", "1"],
    );
    wait_for_log(&logs, "subscribed");
    let publisher = spawn_client(
        home.path(),
        &["--addr", &addr, "pub", "many", "x", "-n", "1000000000"],
    );
    assert_ok(&output_within(sub, "the subscriber of one message"));
    let out = sigterm(publisher, "pub -n after SIGTERM");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("SIGTERM before 1000000000 message(s) were published"),
        "{err}"
    );
    stop(broker);
}

/// An empty AQUEDUCT_CONFIG means no file, as the seed read it: it was refused as "a value is
/// required for '--config'", a flag the user had not given.
#[test]
fn an_empty_aqueduct_config_means_no_file() {
    let home = tempfile::tempdir().expect("dir");
    let (broker, _addr, _metrics, _logs) =
        start_broker_with(home.path(), &[("AQUEDUCT_CONFIG", "")]);
    stop(broker);
}
