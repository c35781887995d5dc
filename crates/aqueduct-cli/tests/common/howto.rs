//! Run a how-to page as written: every ```sh block after a `<!-- NAME: KIND -->` marker, in
//! order, in an empty directory with the built binaries on PATH.
//!
//! - `run`: the block runs in bash (after the `env` blocks so far) and must succeed;
//! - `env`: its `export` lines apply to every later block;
//! - `broker`: the block starts the broker in the background (the previous one is stopped with
//!   SIGTERM first, as Ctrl-C would), and the runner waits for it to listen.
//!
//! The broker listens on free ports rather than 4242/9091 (tests run side by side); the runner
//! points the `aqueduct` commands at it through `AQUEDUCT_ADDR` and `AQUEDUCT_ADMIN_ADDR`,
//! which the tool reads.

use std::path::Path;
use std::process::{Child, Command};

use super::*;

#[derive(Debug, PartialEq)]
enum Kind {
    Run,
    Env,
    Broker,
}

fn blocks(doc: &str, name: &str) -> Vec<(Kind, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let kind = match line.trim().strip_prefix(&format!("<!-- {name}: ")) {
            Some("run -->") => Kind::Run,
            Some("env -->") => Kind::Env,
            Some("broker -->") => Kind::Broker,
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

/// Run the page's steps; returns each `run` step's standard output (and standard error, after
/// it). `admin`: the page's broker serves the admin API (its address is read from the log).
pub fn run_howto(doc: &str, name: &str, min_blocks: usize, admin: bool) -> Vec<String> {
    let blocks = blocks(doc, name);
    assert!(
        blocks.len() >= min_blocks,
        "the howto's steps were found: {blocks:?}"
    );
    let dir = tempfile::tempdir().expect("dir");
    let mut prelude = String::new();
    let mut broker: Option<Child> = None;
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
            Kind::Run => {
                let out = bash(dir.path(), &prelude, script, &env)
                    .output()
                    .expect("bash runs");
                let stdout = String::from_utf8_lossy(&out.stdout).to_string();
                let stderr = String::from_utf8_lossy(&out.stderr).to_string();
                assert!(
                    out.status.success(),
                    "step failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}"
                );
                println!("$ {script}\n{stdout}{stderr}");
                outputs.push(format!("{stdout}{stderr}"));
            }
        }
    }
    if let Some(b) = broker.take() {
        stop(b);
    }
    outputs
}
