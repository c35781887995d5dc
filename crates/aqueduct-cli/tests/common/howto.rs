//! Run a how-to page as written: every ```sh block after a `<!-- NAME: KIND -->` marker, in
//! order, in an empty directory with the built binaries on PATH.
//!
//! - `run`: the block runs in bash (after the `env` blocks so far) and must succeed;
//! - `env`: its `export` lines apply to every later block;
//! - `broker`: the block starts the broker in the background (the previous one is stopped with
//!   SIGTERM first, as Ctrl-C would), and the runner waits for it to listen;
//! - `node`: the block starts a broker in the background exactly as written (its own ports, from
//!   its config file), besides the ones already running (a cluster node each); the runner waits
//!   for it to listen, and stops every node with SIGTERM at the end (each must exit cleanly);
//! - `background`: the block runs in bash in the background (another terminal); it must end by
//!   itself, successfully, by the next `after` step or the end of the page;
//! - `poll` (or `poll "TEXT"`): the block runs again, every 100 ms, until it succeeds (and its
//!   standard output contains TEXT), at most `WAIT`: a step that shows something the cluster
//!   takes a moment to reach;
//! - `after`: waits for the `background` steps to end (at most `WAIT` each), then runs like `run`;
//! - `stopped`: stops the broker of the last `broker` step with SIGTERM (as Ctrl-C would; it
//!   must exit cleanly), then runs like `run`: a step that needs the broker stopped.
//!
//! The `broker` kind listens on free ports rather than 4242/9091 (tests run side by side); the
//! runner points the `aqueduct` commands at it through `AQUEDUCT_ADDR` and
//! `AQUEDUCT_ADMIN_ADDR`, which the tool reads. `node` steps keep the ports they name.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::*;

#[derive(Debug, PartialEq)]
enum Kind {
    Run,
    Env,
    Broker,
    Node,
    Background,
    /// Until it succeeds and, if given, its standard output contains the text.
    Poll(Option<String>),
    After,
    Stopped,
}

fn blocks(doc: &str, name: &str) -> Vec<(Kind, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let kind = match line.trim().strip_prefix(&format!("<!-- {name}: ")) {
            Some("run -->") => Kind::Run,
            Some("env -->") => Kind::Env,
            Some("broker -->") => Kind::Broker,
            Some("node -->") => Kind::Node,
            Some("background -->") => Kind::Background,
            Some("poll -->") => Kind::Poll(None),
            Some(other) if other.starts_with("poll \"") && other.ends_with("\" -->") => {
                let text = &other["poll \"".len()..other.len() - "\" -->".len()];
                Kind::Poll(Some(text.to_string()))
            }
            Some("after -->") => Kind::After,
            Some("stopped -->") => Kind::Stopped,
            _ => continue,
        };
        assert_eq!(
            lines.next().map(str::trim),
            Some("```sh"),
            "a sh block after the marker"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        out.push((kind, body.join("\n")));
    }
    out
}

fn bash(dir: &Path, prelude: &str, script: &str, env: &[(&str, String)]) -> Command {
    let bin = Path::new(BROKER).parent().expect("bin dir");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("bash");
    cmd.arg("-euo")
        .arg("pipefail")
        .arg("-c")
        .arg(format!("{prelude}\n{script}"))
        .current_dir(dir)
        .env("PATH", path)
        .env("AQUEDUCT_HOME", dir)
        .env("NO_COLOR", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Cluster nodes started by `node` steps, with their log lines (kept, so that their stderr stays
/// read). If the run fails midway, they are killed rather than left holding their ports.
struct Nodes(Vec<(super::Broker, std::sync::mpsc::Receiver<String>)>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for (node, _) in &mut self.0 {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}

/// Run one `run`-like step: whether it succeeded, its standard output and standard error.
fn run_step(
    dir: &Path,
    prelude: &str,
    script: &str,
    env: &[(&str, String)],
) -> (bool, String, String) {
    let out = bash(dir, prelude, script, env).output().expect("bash runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Wait for the background steps to end (each must succeed); their outputs.
fn join_background(background: &mut Vec<(Child, String)>) -> Vec<String> {
    background
        .drain(..)
        .map(|(child, script)| {
            let out = output_within(child, &format!("the background step {script:?}"));
            let stdout = String::from_utf8_lossy(&out.stdout).to_string();
            let stderr = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(
                out.status.success(),
                "background step failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}"
            );
            println!("$ {script} (in the background)\n{stdout}{stderr}");
            format!("{stdout}{stderr}")
        })
        .collect()
}

/// Run the page's steps; returns each `run`, `poll` and `after` step's standard output (and
/// standard error, after it), and each `background` step's when it ended. `admin`: the page's
/// broker serves the admin API (its address is read from the log).
pub fn run_howto(doc: &str, name: &str, min_blocks: usize, admin: bool) -> Vec<String> {
    let blocks = blocks(doc, name);
    assert!(
        blocks.len() >= min_blocks,
        "the howto's steps were found: {blocks:?}"
    );
    let dir = tempfile::tempdir().expect("dir");
    let mut prelude = String::new();
    let mut broker: Option<super::Broker> = None;
    let mut nodes = Nodes(Vec::new());
    let mut background: Vec<(Child, String)> = Vec::new();
    let mut env: Vec<(&str, String)> = Vec::new();
    let mut outputs = Vec::new();
    for (kind, script) in &blocks {
        match kind {
            Kind::Env => {
                prelude.push_str(script);
                prelude.push('\n');
            }
            Kind::Broker => {
                if let Some(b) = broker.take() {
                    stop(b);
                }
                let mut cmd = bash(
                    dir.path(),
                    &prelude,
                    &format!("exec {script} --addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \"$@\""),
                    &[],
                );
                cmd.arg("broker");
                let extra = [("AQUEDUCT_ADMIN_LISTEN_ADDR", "127.0.0.1:0")];
                let (child, a, _metrics, logs) =
                    start_broker_process(cmd, dir.path(), if admin { &extra } else { &[] });
                env = vec![("AQUEDUCT_ADDR", a)];
                if admin {
                    env.push(("AQUEDUCT_ADMIN_ADDR", admin_addr(&logs)));
                }
                broker = Some(child);
            }
            Kind::Node => {
                let mut cmd = bash(dir.path(), &prelude, &format!("exec {script} \"$@\""), &[]);
                cmd.arg("node");
                let (child, _addr, _metrics, logs) = start_broker_process(cmd, dir.path(), &[]);
                nodes.0.push((child, logs));
            }
            Kind::Background => {
                let child = bash(dir.path(), &prelude, script, &env)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("bash runs");
                background.push((child, script.clone()));
            }
            Kind::Run | Kind::Poll(_) | Kind::After | Kind::Stopped => {
                if *kind == Kind::After {
                    outputs.extend(join_background(&mut background));
                }
                if *kind == Kind::Stopped {
                    stop(
                        broker
                            .take()
                            .expect("a `stopped` step after a `broker` step"),
                    );
                }
                let start = Instant::now();
                let (stdout, stderr) = loop {
                    let (ok, stdout, stderr) = run_step(dir.path(), &prelude, script, &env);
                    let shows = match kind {
                        Kind::Poll(Some(text)) => stdout.contains(text.as_str()),
                        _ => true,
                    };
                    if ok && shows {
                        break (stdout, stderr);
                    }
                    let polling = matches!(kind, Kind::Poll(_));
                    assert!(
                        polling && start.elapsed() < WAIT,
                        "step failed{}:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}",
                        match kind {
                            Kind::Poll(Some(text)) => format!(" to show {text:?} within {WAIT:?}"),
                            Kind::Poll(None) => format!(" for {WAIT:?}"),
                            _ => String::new(),
                        }
                    );
                    std::thread::sleep(Duration::from_millis(100));
                };
                println!("$ {script}\n{stdout}{stderr}");
                outputs.push(format!("{stdout}{stderr}"));
            }
        }
    }
    outputs.extend(join_background(&mut background));
    if let Some(b) = broker.take() {
        stop(b);
    }
    for (node, _logs) in nodes.0.drain(..) {
        stop(node);
    }
    outputs
}
