//! docs/howto-security.md, run as written: every ```sh block after a
//! `<!-- howto-security: ... -->` marker, in order (see `common/howto.rs`), and the outputs the
//! page shows.

mod common;

const DOC: &str = include_str!("../../../docs/howto-security.md");

#[test]
fn the_security_howto_runs_as_written() {
    let outputs = common::howto::run_howto(DOC, "howto-security", 7, true);
    let all = outputs.join("");
    for shown in [
        "published to orders/eu at offset 0",
        "broker error NOT_AUTHORIZED(400): client dashboard may not publish to orders/eu",
        "(refused)",
        "access control on; default none; 4 rule(s)",
        "dashboard  dashboard/#      all",
        "service-a  5000/s  500    yes",
        "dashboard  1000/s  100    no",
        "\"acl_rules\":4",
        "revoked CN=dashboard (serial ",
        "the client certificate was revoked",
    ] {
        assert!(
            all.contains(shown),
            "the page shows {shown:?}; the run printed:\n{all}"
        );
    }
}

/// The configuration snippet of docs/admin-api.md loads as written (with a CA where it says).
#[test]
fn the_admin_api_reference_config_loads() {
    let doc = include_str!("../../../docs/admin-api.md");
    let yaml = doc
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a yaml block");
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs").display().to_string();
    common::assert_ok(&common::run_client(
        dir.path(),
        &["cert", "ca", "--out", &certs],
    ));
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, yaml.replace("certs/", &format!("{certs}/"))).expect("write");
    let config = aqueduct_server::Config::load(&aqueduct_server::Sources {
        file: Some(file),
        env: vec![("AQUEDUCT_HOME".into(), dir.path().display().to_string())],
        overrides: Default::default(),
    })
    .expect("the snippet loads");
    let admin = config.admin.expect("admin on");
    assert_eq!(admin.listen_addr.port(), 9091);
    assert_eq!(admin.state_file, dir.path().join("admin-state.json"));
}
