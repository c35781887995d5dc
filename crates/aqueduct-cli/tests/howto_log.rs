//! docs/howto-log.md, run as written: every ```sh block after a `<!-- howto-log: ... -->`
//! marker, in order (see `common/howto.rs`).

mod common;

const DOC: &str = include_str!("../../../docs/howto-log.md");

#[test]
fn the_log_howto_runs_as_written() {
    let outputs = common::howto::run_howto(DOC, "howto-log", 15, false);
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
    // After the key's rotation: old and new messages read alike, and verify counts what the
    // old key still seals (the tour's two segments).
    assert!(all.contains("published to orders at offset 2"), "{all}");
    assert!(
        all.contains("orders #0 p2: first order") && all.contains("orders #2 p2: third order"),
        "{all}"
    );
    assert!(
        all.contains("previous key 1 of 1: seals 2 segment(s)\nok"),
        "{all}"
    );
    // Re-sealed, the old key is no longer needed: the new one alone reads the whole log.
    assert!(
        all.contains("re-sealed 2 segment(s)")
            && all.contains("previous key 1 of 1: seals no segment (no longer needed)"),
        "{all}"
    );
    assert!(all.trim_end().ends_with("ok"), "{all}");
}
