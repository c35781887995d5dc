//! docs/howto-tracing.md, run as written: every ```sh block after a `<!-- howto-tracing: ... -->`
//! marker, in order (see `common/howto.rs`), with a real `aqueduct-broker` exporting to
//! `aqueduct trace-sink` on the ports the page names (127.0.0.1, UDP 7471, TCP 9471 and 4317),
//! and the outputs the page shows.

mod common;

const DOC: &str = include_str!("../../../docs/howto-tracing.md");

#[test]
fn the_tracing_howto_runs_as_written() {
    let outputs = common::howto::run_howto(DOC, "howto-tracing", 8, false);
    let all = outputs.join("");
    for shown in [
        "aqueduct_trace_spans_recorded_total 3",
        "aqueduct_trace_spans_exported_total 3",
        "aqueduct_trace_spans_dropped_total 0",
        r#""spans":3,"traces":1"#,
    ] {
        assert!(
            all.contains(shown),
            "the page shows {shown:?}; the run printed:\n{all}"
        );
    }
    // The publisher's trace, the subscriber's delivery and the receiver's spans agree.
    let sent = all
        .lines()
        .find_map(|l| l.strip_prefix("trace 00-"))
        .expect("pub --trace prints the context it sent");
    let (trace_id, rest) = sent.split_once('-').expect("trace id");
    let publisher_span = rest.split('-').next().expect("span id");
    let delivered = all
        .lines()
        .find(|l| l.starts_with("orders/eu #0 p2 (trace 00-") && l.ends_with("): one order"))
        .expect("the subscriber shows the trace");
    assert!(delivered.contains(trace_id), "{delivered}");
    let span = |name: &str| {
        all.lines()
            .find(|l| l.starts_with(&format!("aqueduct {name} orders/eu trace {trace_id} ")))
            .unwrap_or_else(|| panic!("a {name} span of the trace in:\n{all}"))
            .to_string()
    };
    let publish = span("publish");
    assert!(
        publish.contains(&format!("parent {publisher_span} ")),
        "{publish}"
    );
    let publish_id = publish
        .split(" span ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("its span id");
    assert!(
        delivered.contains(&format!("-{publish_id}-01)")),
        "the delivery names the broker's span: {delivered}"
    );
    for child in ["route", "deliver"] {
        assert!(
            span(child).contains(&format!("parent {publish_id} ")),
            "{child} under publish"
        );
    }
}
