//! Helpers shared by the binaries' tests: the real broker on a free port, read from its log;
//! bounded waits for child processes.
#![allow(dead_code)]

pub mod howto;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const BROKER: &str = env!("CARGO_BIN_EXE_aqueduct-broker");
pub const CLIENT: &str = env!("CARGO_BIN_EXE_aqueduct");
pub const WAIT: Duration = Duration::from_secs(30);

/// Start the broker on a free port; returns it and its address, read from its log.
pub fn start_broker(home: &std::path::Path) -> (Broker, String, mpsc::Receiver<String>) {
    let (child, addr, _metrics, logs) = start_broker_with(home, &[]);
    (child, addr, logs)
}

/// Like `start_broker`, with extra environment; also returns the metrics address.
// The caller waits for the child (after SIGTERM), in `stop`.
#[allow(clippy::zombie_processes)]
pub fn start_broker_with(
    home: &std::path::Path,
    env: &[(&str, &str)],
) -> (Broker, String, String, mpsc::Receiver<String>) {
    start_broker_cmd(
        home,
        &["--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"],
        env,
    )
}

/// Start the broker with these arguments (plus `--log info`) and environment.
#[allow(clippy::zombie_processes)]
pub fn start_broker_cmd(
    home: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Broker, String, String, mpsc::Receiver<String>) {
    let mut cmd = Command::new(BROKER);
    cmd.args(args);
    start_broker_process(cmd, home, env)
}

/// Start the broker with this config file, on `addr` (QUIC) and a free metrics port.
pub fn start_broker_config(
    home: &std::path::Path,
    config: &std::path::Path,
    addr: &str,
    env: &[(&str, &str)],
) -> (Broker, String, String, mpsc::Receiver<String>) {
    let config = config.display().to_string();
    start_broker_cmd(
        home,
        &[
            "--config",
            &config,
            "--addr",
            addr,
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        env,
    )
}

/// Start a broker process (`cmd` runs it, perhaps through a shell that sets limits), with
/// `--log info`, this home and environment; returns it, its address and metrics address (read
/// from its log), and its further log lines.
#[allow(clippy::zombie_processes)]
pub fn start_broker_process(
    mut cmd: Command,
    home: &std::path::Path,
    env: &[(&str, &str)],
) -> (Broker, String, String, mpsc::Receiver<String>) {
    cmd.envs(env.iter().copied()).env("AQUEDUCT_HOME", home);
    start_listening(cmd)
}

/// Start `cmd` (a broker command with its environment set) with `--log info`; returns it, its
/// address and metrics address (read from its log), and its further log lines.
#[allow(clippy::zombie_processes)]
pub fn start_listening(mut cmd: Command) -> (Broker, String, String, mpsc::Receiver<String>) {
    let mut child = cmd
        .args(["--log", "info"])
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("broker starts");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let field = |line: &str| {
        line.split("addr=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .expect("address in the log line")
            .to_string()
    };
    let (mut addr, mut metrics) = (None, None);
    while addr.is_none() || metrics.is_none() {
        let line = rx.recv_timeout(WAIT).expect("broker log line");
        if line.contains("broker listening") {
            addr = Some(field(&line));
        } else if line.contains("metrics endpoint listening") {
            metrics = Some(field(&line));
        }
    }
    (
        Broker(Some(child)),
        addr.unwrap_or_default(),
        metrics.unwrap_or_default(),
        rx,
    )
}

/// A broker process started by a test: stopped cleanly with [`stop`], and killed if the test
/// fails before that (a panicking test must not leave its broker running).
#[derive(Debug)]
pub struct Broker(Option<Child>);

impl Broker {
    /// The process, for a test that stops it its own way (the guard then does nothing).
    pub fn into_child(mut self) -> Child {
        self.0.take().expect("a running broker")
    }
}

impl From<Child> for Broker {
    fn from(child: Child) -> Broker {
        Broker(Some(child))
    }
}

impl std::ops::Deref for Broker {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a running broker")
    }
}

impl std::ops::DerefMut for Broker {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a running broker")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn stop(broker: Broker) {
    let mut broker = broker.into_child();
    let _ = Command::new("kill")
        .args(["-TERM", &broker.id().to_string()])
        .status();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(broker.wait());
    });
    let exit = rx.recv_timeout(WAIT).expect("broker exits").expect("wait");
    assert!(exit.success(), "exit status {exit:?}");
}

/// SIGTERM `child` and wait (at most `WAIT`) for its output.
pub fn sigterm(child: Child, what: &str) -> std::process::Output {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    output_within(child, what)
}

/// SIGTERM an `aqueduct sub`: it must exit 0 at once, saying it closed its connection.
pub fn sigterm_closes_cleanly(sub: Child, what: &str) -> String {
    let out = sigterm(sub, what);
    assert_ok(&out);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("SIGTERM: closed the connection"), "{err}");
    err
}

/// Wait for a child's output, at most `WAIT`: a hung client fails the test (and is killed)
/// instead of hanging the suite.
pub fn output_within(child: Child, what: &str) -> std::process::Output {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(WAIT) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("{what} did not exit within {WAIT:?}");
        }
    }
}

/// Run `aqueduct ARGS` with the test's home; its output.
pub fn run_client(home: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(CLIENT)
        .args(args)
        .env("AQUEDUCT_HOME", home)
        .output()
        .expect("aqueduct runs")
}

/// Start `aqueduct ARGS` with the test's home, its output piped (read it with
/// [`output_within`]).
pub fn spawn_client(home: &std::path::Path, args: &[&str]) -> Child {
    Command::new(CLIENT)
        .args(args)
        .env("AQUEDUCT_HOME", home)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aqueduct starts")
}

/// Start `aqueduct pub TOPIC` reading standard input (its output piped); returns it and its
/// standard input, to write lines to.
pub fn spawn_stdin_publisher(
    home: &std::path::Path,
    addr: &str,
    topic: &str,
) -> (Child, std::process::ChildStdin) {
    let mut publisher = Command::new(CLIENT)
        .args(["--addr", addr, "pub", topic])
        .env("AQUEDUCT_HOME", home)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aqueduct pub starts");
    let input = publisher.stdin.take().expect("stdin");
    (publisher, input)
}

/// Fail with the command's standard error unless it succeeded.
pub fn assert_ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Read broker log lines until one contains `needle`.
pub fn wait_for_log(logs: &mpsc::Receiver<String>, needle: &str) {
    loop {
        let line = logs
            .recv_timeout(WAIT)
            .unwrap_or_else(|_| panic!("no broker log line with {needle:?}"));
        if line.contains(needle) {
            return;
        }
    }
}

/// Read broker log lines until the admin API's `admin API listening addr=...`; that address.
pub fn admin_addr(logs: &mpsc::Receiver<String>) -> String {
    let mut seen = Vec::new();
    loop {
        let line = logs.recv_timeout(WAIT).unwrap_or_else(|_| {
            panic!("no `admin API listening` log line in:\n{}", seen.join("\n"))
        });
        if line.contains("admin API listening") {
            return line
                .split("addr=")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .expect("admin address")
                .to_string();
        }
        seen.push(line);
    }
}

// ----- clusters of real processes -----

/// A UDP port free now (for a node that must be named in the others' `cluster.peers`).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The sum of a metric's samples (every label set) on a metrics endpoint, if it has any.
pub fn metric(addr: &str, name: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let values: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                return None;
            }
            rest.rsplit(' ').next()?.trim().parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Start `aqueduct-broker` as node `i` of a cluster of `peers` on UDP `port` (certificates
/// `node-i.pem` / `node-i-key.pem` and `ca.pem` in `home/certs`, its own home `home/home-i`),
/// with extra environment `env`; returns it, its address and its metrics address.
pub fn cluster_node(
    home: &std::path::Path,
    i: usize,
    port: u16,
    peers: &[String],
    env: &[(&str, &str)],
) -> (Broker, String, String) {
    let certs = home.join("certs");
    let config = home.join(format!("node-{i}.yaml"));
    std::fs::write(
        &config,
        format!(
            "cluster:\n  enabled: true\n  peers: [{}]\n  tls:\n    ca_file: {ca}\n    cert_file: {cert}\n    key_file: {key}\n",
            peers.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", "),
            ca = certs.join("ca.pem").display(),
            cert = certs.join(format!("node-{i}.pem")).display(),
            key = certs.join(format!("node-{i}-key.pem")).display(),
        ),
    )
    .expect("config");
    let node_home = home.join(format!("home-{i}"));
    std::fs::create_dir_all(&node_home).expect("home");
    let (child, addr, metrics, _logs) =
        start_broker_config(&node_home, &config, &format!("127.0.0.1:{port}"), env);
    (child, addr, metrics)
}
