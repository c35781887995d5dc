//! docs/tutorial.md is examples/tutorial.rs, and the example works.
//!
//! - Its ```rust blocks are, in order, the example's `// ANCHOR: name` … `// ANCHOR_END: name`
//!   regions, and outside them the example has only comments: put together, the blocks are the
//!   whole program. That program compiles because `cargo test` builds the package's examples
//!   (`cargo test -p aqueduct-client` fails if examples/tutorial.rs does not compile), and this
//!   file compiles it a second time as a module, below.
//! - Its ```toml block names every crate the example uses, with the tokio features it needs,
//!   and points at aqueduct-client with a path that works outside this repository (absolute).
//! - The example's `run` (every section of the tutorial) runs to its end against a real broker
//!   on 127.0.0.1, port 0, with a development certificate in a temporary directory.

use std::path::Path;
use std::time::Duration;

use aqueduct_client::{Client, ConnectOptions};
use aqueduct_server::{Config, Server};

// `main` is the example's entry point; the test calls `run` with a client of its own.
#[allow(dead_code)]
#[path = "../examples/tutorial.rs"]
mod tutorial;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tutorial_md() -> String {
    read("../../docs/tutorial.md")
}

fn example_rs() -> String {
    read("examples/tutorial.rs")
}

/// The contents of the fenced blocks opened with "```{lang}", in order.
fn fenced_blocks(markdown: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in markdown.lines() {
        match current.as_mut() {
            None => {
                if line.trim_start().strip_prefix("```") == Some(lang) {
                    current = Some(Vec::new());
                }
            }
            Some(lines) => {
                if line.trim_start().starts_with("```") {
                    blocks.push(lines.join("\n"));
                    current = None;
                } else {
                    lines.push(line);
                }
            }
        }
    }
    assert!(current.is_none(), "unterminated ```{lang} block");
    blocks
}

/// The example's anchored regions `(name, text)`, in order. Panics if anything but comments and
/// blank lines is outside them, or if the anchors do not pair up.
fn anchored_regions(source: &str) -> Vec<(String, String)> {
    let mut regions = Vec::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for (i, line) in source.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim();
        if let Some(name) = trimmed.strip_prefix("// ANCHOR: ") {
            assert!(
                current.is_none(),
                "line {n}: ANCHOR {name} inside another region"
            );
            current = Some((name.to_string(), Vec::new()));
        } else if let Some(name) = trimmed.strip_prefix("// ANCHOR_END: ") {
            match current.take() {
                Some((open, lines)) if open == name => regions.push((open, lines.join("\n"))),
                other => panic!("line {n}: ANCHOR_END {name} does not close {other:?}"),
            }
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line);
        } else {
            assert!(
                trimmed.is_empty() || trimmed.starts_with("//"),
                "examples/tutorial.rs line {n} is code outside the regions the tutorial quotes: \
                 {line:?}"
            );
        }
    }
    assert!(current.is_none(), "unterminated region {current:?}");
    regions
}

#[test]
fn tutorial_code_is_the_example() {
    let blocks = fenced_blocks(&tutorial_md(), "rust");
    let regions = anchored_regions(&example_rs());
    assert!(
        !regions.is_empty(),
        "no anchored regions in examples/tutorial.rs"
    );
    for (i, (name, region)) in regions.iter().enumerate() {
        let Some(block) = blocks.get(i) else {
            panic!(
                "docs/tutorial.md lacks a ```rust block #{} for region `{name}`",
                i + 1
            );
        };
        if block != region {
            let (line, (doc, example)) = block
                .lines()
                .chain(std::iter::repeat("<end>"))
                .zip(region.lines().chain(std::iter::repeat("<end>")))
                .enumerate()
                .find(|(_, (a, b))| a != b)
                .expect("texts differ, so some line does");
            panic!(
                "```rust block #{} of docs/tutorial.md differs from region `{name}` of \
                 examples/tutorial.rs at its line {}:\n  doc:     {doc}\n  example: {example}",
                i + 1,
                line + 1
            );
        }
    }
    assert_eq!(
        blocks.len(),
        regions.len(),
        "docs/tutorial.md has ```rust blocks that are not regions of examples/tutorial.rs"
    );
}

/// The roots of the paths in `code` that name crates (`tokio::`, `bytes::`, …): lower-case
/// identifiers followed by `::` and not preceded by one. Comments are skipped.
fn crates_used(code: &str) -> std::collections::BTreeSet<String> {
    let mut crates = std::collections::BTreeSet::new();
    for line in code.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let bytes = line.as_bytes();
        let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let mut i = 0;
        while let Some(found) = line[i..].find("::") {
            let end = i + found;
            let mut start = end;
            while start > 0 && is_ident(bytes[start - 1]) {
                start -= 1;
            }
            let root = &line[start..end];
            let after_path = start >= 2 && &line[start - 2..start] == "::";
            if !after_path && root.starts_with(|c: char| c.is_ascii_lowercase()) {
                crates.insert(root.to_string());
            }
            i = end + 2;
        }
    }
    for builtin in ["std", "core", "alloc", "crate", "self", "super"] {
        crates.remove(builtin);
    }
    crates
}

#[test]
fn tutorial_dependencies_cover_the_example() {
    let md = tutorial_md();
    let tomls = fenced_blocks(&md, "toml");
    assert_eq!(
        tomls.len(),
        1,
        "docs/tutorial.md should have one ```toml block"
    );
    let toml = &tomls[0];
    // `name = …` lines under [dependencies].
    let mut deps = std::collections::BTreeMap::new();
    let mut in_deps = false;
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if let Some((name, spec)) = line.split_once('=').filter(|_| in_deps) {
            deps.insert(name.trim().replace('-', "_"), spec.trim().to_string());
        }
    }

    let code: String = anchored_regions(&example_rs())
        .into_iter()
        .map(|(_, text)| text + "\n")
        .collect();
    let used = crates_used(&code);
    for krate in &used {
        assert!(
            deps.contains_key(krate),
            "the example uses `{krate}`, which the tutorial's [dependencies] does not list: \
             {deps:?}"
        );
    }
    assert!(used.contains("aqueduct_client"), "crates used: {used:?}");

    // tokio features for what the example uses.
    let tokio = deps.get("tokio").map(String::as_str).unwrap_or_default();
    let needs = [
        ("#[tokio::main]", "\"macros\""),
        ("#[tokio::main]", "\"rt-multi-thread\""),
        ("tokio::time", "\"time\""),
    ];
    for (usage, feature) in needs {
        if code.contains(usage) {
            assert!(
                tokio.contains(feature),
                "the example uses {usage}: tokio needs feature {feature} ({tokio})"
            );
        }
    }

    // A path dependency must work from a project elsewhere: absolute, with the tutorial telling
    // the reader to replace it.
    let client = &deps["aqueduct_client"];
    if let Some(rest) = client.split("path").nth(1) {
        let path = rest.trim_start_matches([' ', '=']).trim_start_matches('"');
        assert!(
            path.starts_with('/'),
            "aqueduct-client's path should be absolute (a relative one works only inside the \
             repository): {client}"
        );
        assert!(
            md.contains("Replace") || md.contains("replace"),
            "the tutorial should say to replace the path"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tutorial_runs_against_a_broker() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dev_cert = dir.path().join("dev-cert.pem");
    let server = Server::bind(Config::for_tests(dev_cert.clone()))
        .await
        .expect("broker binds");
    let addr = server.local_addr();
    let dev_cert = server.dev_cert_file().cloned().unwrap_or(dev_cert);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let broker = tokio::spawn(server.serve(async move {
        let _ = stopped.await;
    }));

    // As the example's `main` connects, but to this broker and its development certificate.
    let options = ConnectOptions::new(addr.to_string()).dev_cert_file(&dev_cert);
    let client = Client::connect(options).await.expect("client connects");
    tokio::time::timeout(Duration::from_secs(60), tutorial::run(&client))
        .await
        .expect("the tutorial ends within 60 s")
        .expect("the tutorial runs without error");
    client
        .close()
        .await
        .expect("everything published was taken");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(20), broker)
        .await
        .expect("broker stops")
        .expect("serve task")
        .expect("serve returns Ok");
}
