//! Links between the documents (README.md, docs/*.md, clients/js/README.md) lead somewhere: the
//! file exists and, with a `#fragment`, one of its headings has that anchor (as GitHub makes
//! them: lower case, punctuation other than `-` and `_` dropped, spaces as `-`). Three links to
//! headings that had been renamed were found by a new user's cold run of the docs, and one more
//! later, by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The anchor GitHub gives a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A document's text without its fenced code blocks (a `#` there is no heading, and a `](` no
/// link).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn links_between_the_documents_lead_to_a_file_and_a_heading() {
    let root = root();
    let mut docs: Vec<PathBuf> = vec![root.join("README.md"), root.join("clients/js/README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let anchors: BTreeMap<PathBuf, BTreeSet<String>> = docs
        .iter()
        .map(|doc| {
            let text = prose(&std::fs::read_to_string(doc).expect("readable"));
            let headings = text
                .lines()
                .filter_map(|l| l.strip_prefix('#'))
                .map(|l| slug(l.trim_start_matches('#')))
                .collect();
            (canonical(doc), headings)
        })
        .collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = prose(&std::fs::read_to_string(doc).expect("readable"));
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let link = &rest[..end];
            if link.contains("://") || link.starts_with("mailto:") || link.contains(' ') {
                continue;
            }
            let (file, fragment) = match link.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (link, None),
            };
            let target = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().expect("in a directory").join(file)
            };
            checked += 1;
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", doc.display()));
                continue;
            }
            if let Some(fragment) = fragment {
                match anchors.get(&canonical(&target)) {
                    Some(headings) if !headings.contains(fragment) => broken.push(format!(
                        "{}: {link}: no heading with that anchor",
                        doc.display()
                    )),
                    _ => {}
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parsing right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
