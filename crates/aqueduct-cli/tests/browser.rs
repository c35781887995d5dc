//! A real browser against the real broker: headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven by Python `selenium`, all installed by `.ci/run`) opens the broker's
//! live web view (`GET /` on the metrics endpoint), whose page uses the JavaScript client of
//! `clients/js` over WebTransport, and `tests/python/browser.py` checks, against the `aqueduct`
//! command line: a wildcard subscription gets what `aqueduct pub` sends (bytes intact) and a
//! stalled subscriber gets it in priority order; what the page publishes reaches `aqueduct sub`;
//! the page and a native `aqueduct sub --group` share a consumer group (each message to exactly
//! one, none lost); an ACL rule for the token's client id refuses it (NOT_AUTHORIZED, 400); an
//! unknown token's session is refused as such. It saves a screenshot of the live view with
//! messages flowing to `target/browser-test/web-view.png`. Then it runs the documentation's
//! JavaScript as written (the page of clients/js/README.md and the snippet of
//! docs/howto-browser.md, served from localhost; only the metrics port is the test broker's).
//!
//! Without Chromium, chromedriver or selenium the test prints `skipped: …` and passes, except
//! under CI (`CI` set), where it fails.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

/// The whole browser script, Chromium's start included.
const SCRIPT_WAIT: Duration = Duration::from_secs(240);
const TOKEN: &str = "browser-token-0123456789";

/// The token docs/howto-browser.md's snippet passes (`token: '...'`, in the section "## The
/// JavaScript client", the block browser.py runs): the broker knows it, as the test runs the
/// snippet as written.
fn doc_token() -> String {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/howto-browser.md");
    let text = std::fs::read_to_string(&doc).expect("docs/howto-browser.md");
    let (_, section) = text
        .split_once("\n## The JavaScript client\n")
        .expect("howto-browser.md has the section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let (_, rest) = section
        .split_once("token: '")
        .expect("howto-browser.md's snippet passes a token");
    rest.split_once('\'').expect("a quoted token").0.to_string()
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Chromium, chromedriver and selenium, or what is missing.
fn tools() -> Result<(PathBuf, PathBuf), String> {
    let mut missing = Vec::new();
    let chromium = ["chromium", "chromium-browser"]
        .iter()
        .find_map(|n| on_path(n));
    if chromium.is_none() {
        missing.push("chromium (Debian: apt-get install chromium)");
    }
    let driver = on_path("chromedriver");
    if driver.is_none() {
        missing.push("chromedriver (Debian: apt-get install chromium-driver)");
    }
    let selenium = Command::new(python())
        .args(["-c", "import selenium"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !selenium {
        missing.push("Python selenium (pip install selenium)");
    }
    match (chromium, driver) {
        (Some(c), Some(d)) if selenium => Ok((c, d)),
        _ => Err(missing.join(", ")),
    }
}

#[test]
fn a_browser_uses_the_live_view_and_the_js_client_against_the_real_broker() {
    let (chromium, chromedriver) = match tools() {
        Ok(t) => t,
        Err(missing) if std::env::var_os("CI").is_some() => panic!(
            "the browser test needs {missing}; .ci/run installs them (CI is set, so this fails \
             instead of skipping)"
        ),
        Err(missing) => {
            println!("skipped: the browser test needs {missing} (.ci/run installs them)");
            return;
        }
    };
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();
    let config = h.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "acl:\n  enabled: true\n  default: all\n  rules:\n    \
             - {{ client: \"browser-test\", topic: \"secret/#\", permission: \"none\" }}\n\
             webtransport:\n  tokens:\n    \"{TOKEN}\": \"browser-test\"\n    \
             \"{}\": \"dashboard\"\n",
            doc_token()
        ),
    )
    .expect("config");
    let (broker, addr, metrics, logs) = start_broker_config(h, &config, "127.0.0.1:0", &[]);
    let screenshot =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/browser-test/web-view.png");
    let _ = std::fs::remove_file(&screenshot);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/browser.py");
    let mut child = Command::new(python())
        .arg(&script)
        // As a user opens it: `localhost`, which Chromium resolves to ::1 first. The broker
        // listens on 127.0.0.1 only, so the page must dial the address /webtransport/cert-hash
        // names, not `localhost` (QUIC does not fall back to 127.0.0.1).
        .arg(format!(
            "http://localhost:{}/",
            metrics.rsplit(':').next().expect("a port")
        ))
        .arg(CLIENT)
        .arg(&addr)
        .arg(h)
        .arg(TOKEN)
        .arg(&screenshot)
        .env("CHROMIUM", &chromium)
        .env("CHROMEDRIVER", &chromedriver)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    let (mut out, mut err) = (
        child.stdout.take().expect("stdout"),
        child.stderr.take().expect("stderr"),
    );
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut o, mut e) = (String::new(), String::new());
        let _ = out.read_to_string(&mut o);
        let _ = err.read_to_string(&mut e);
        let _ = tx.send((o, e));
    });
    let (stdout, stderr) = match rx.recv_timeout(SCRIPT_WAIT) {
        Ok(output) => output,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the browser script did not finish within {SCRIPT_WAIT:?}");
        }
    };
    let status = child.wait().expect("wait");
    let broker_log: Vec<String> = logs.try_iter().collect();
    assert!(
        status.success(),
        "the browser script failed ({status}):\n{stdout}\n{stderr}\nbroker log:\n{}",
        broker_log.join("\n")
    );
    print!("{stdout}");
    for check in [
        "the live view connected over WebTransport",
        "a wildcard subscription (sensors/#) got what `aqueduct pub` sent, bytes intact",
        "delivered 0 first, then 1, 2, 3",
        "the live view lists them",
        "reached `aqueduct sub`",
        "each of 20 jobs to exactly one",
        "NOT_AUTHORIZED (400)",
        "screenshot of the live view",
        "a refused session (unknown token) shows the broker's reason",
        "clients/js/README.md's browser page, as written",
        "docs/howto-browser.md's snippet, as written",
        "all browser checks passed",
    ] {
        assert!(stdout.contains(check), "not checked: {check}\n{stdout}");
    }
    let png = std::fs::read(&screenshot).expect("the screenshot was saved");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} is not a PNG of a page ({} bytes)",
        screenshot.display(),
        png.len()
    );
    // The broker saw the browser as the token's client and refused it by the ACL.
    let log = broker_log.join("\n");
    assert!(log.contains("browser-test"), "{log}");
    stop(broker);
}
