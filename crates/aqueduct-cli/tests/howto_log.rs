//! docs/howto-log.md, run as written: every ```sh block after a `<!-- howto-log: ... -->`
//! marker, in order, in an empty directory with the built binaries on PATH.
//!
//! - `run`: the block runs in bash (after the `env` blocks so far) and must succeed;
//! - `env`: its `export` lines apply to every later block;
//! - `broker`: the block starts the broker in the background (the previous one is stopped with
//!   SIGTERM first, as Ctrl-C would), and the test waits for it to listen.
//!
//! The broker listens on a free port rather than 4242 (tests run side by side); the test points
//! the `aqueduct` commands at it through `AQUEDUCT_ADDR`, which the tool reads.

mod common;

use std::path::Path;
use std::process::{Child, Command};

use common::*;

const DOC: &str = include_str!("../../../docs/howto-log.md");

#[derive(Debug, PartialEq)]
enum Kind {
    Run,
    Env,
    Broker,
}

fn blocks() -> Vec<(Kind, String)> {
    let mut out = Vec::new();
    let mut lines = DOC.lines();
    while let Some(line) = lines.next() {
        let kind = match line.trim() {
            "<!-- howto-log: run -->" => Kind::Run,
            "<!-- howto-log: env -->" => Kind::Env,
            "<!-- howto-log: broker -->" => Kind::Broker,
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

fn bash(dir: &Path, prelude: &str, script: &str, addr: Option<&str>) -> Command {
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
    if let Some(a) = addr {
        cmd.env("AQUEDUCT_ADDR", a);
    }
    cmd
}

fn stop_running(broker: &mut Option<Child>) {
    if let Some(b) = broker.take() {
        stop(b);
    }
}

#[test]
fn the_log_howto_runs_as_written() {
    let blocks = blocks();
    assert!(
        blocks.len() >= 6,
        "the howto's steps were found: {blocks:?}"
    );
    let dir = tempfile::tempdir().expect("dir");
    let mut prelude = String::new();
    let mut broker: Option<Child> = None;
    let mut addr: Option<String> = None;
    let mut outputs = Vec::new();
    for (kind, script) in &blocks {
        match kind {
            Kind::Env => {
                prelude.push_str(script);
                prelude.push('\n');
            }
            Kind::Broker => {
                stop_running(&mut broker);
                let mut cmd = bash(
                    dir.path(),
                    &prelude,
                    &format!("exec {script} --addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \"$@\""),
                    None,
                );
                cmd.arg("broker");
                let (child, a, _metrics, _logs) = start_broker_process(cmd, dir.path(), &[]);
                broker = Some(child);
                addr = Some(a);
            }
            Kind::Run => {
                let out = bash(dir.path(), &prelude, script, addr.as_deref())
                    .output()
                    .expect("bash runs");
                let stdout = String::from_utf8_lossy(&out.stdout).to_string();
                assert!(
                    out.status.success(),
                    "step failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                println!("$ {script}\n{stdout}");
                outputs.push(stdout);
            }
        }
    }
    stop_running(&mut broker);
    let all = outputs.join("");
    assert!(all.contains("published to orders at offset 0"), "{all}");
    assert!(
        all.contains("published to orders at offset 1"),
        "offsets go on after the restart: {all}"
    );
    assert!(
        all.contains("\tfirst order\n") && all.contains("\tsecond order\n"),
        "{all}"
    );
    assert!(all.trim_end().ends_with("ok"), "{all}");
}
