//! docs/howto-browser.md, run as written: every ```sh block after a `<!-- howto-browser: ... -->`
//! marker, in order (see `common/howto.rs`), with a real `aqueduct-broker` on the ports the page
//! names (127.0.0.1, UDP 7461 and TCP 9461: below the ephemeral range, so no other test's port-0
//! sockets take them), and the outputs the page shows. (What the page shows in a browser:
//! tests/browser.rs.)

mod common;

const DOC: &str = include_str!("../../../docs/howto-browser.md");

#[test]
fn the_browser_howto_runs_as_written() {
    let outputs = common::howto::run_howto(DOC, "howto-browser", 7, false);
    let all = outputs.join("");
    for shown in [
        "<title>Aqueduct · live view</title>",
        "published 5 message(s) to demo/hello",
        "published to demo/alarm at offset 0",
        r#""algorithm":"sha-256""#,
        r#""path":"/aqueduct/wt""#,
        r#""port":7461"#,
        r#""host":"127.0.0.1""#,
    ] {
        assert!(
            all.contains(shown),
            "the page shows {shown:?}; the run printed:\n{all}"
        );
    }
    let token = outputs.last().expect("the token step").trim();
    assert!(
        token.len() >= 16
            && token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_=".contains(c)),
        "a token for webtransport.tokens (at least 16 URL-safe characters): {token:?}"
    );
}
