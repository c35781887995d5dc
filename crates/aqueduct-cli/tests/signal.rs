//! `shutdown_signal` and `hangup_signal` listen from the moment they are called, not from a
//! first poll: a SIGTERM that arrives in between (a broker told to stop while it is still
//! starting up) is kept for the clean shutdown, and a SIGHUP (a reload while it starts) for the
//! reload, instead of killing the process. Alone in their test binary: they signal themselves,
//! each only once its own listener is set up.

/// Send this process the signal `flag` names (`kill -TERM`, say).
fn signal_self(flag: &str) {
    let me = std::process::id().to_string();
    let sent = std::process::Command::new("kill")
        .args([flag, &me])
        .status()
        .expect("kill runs");
    assert!(sent.success());
}

#[test]
fn a_sigterm_before_the_first_poll_is_kept() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let stop = aqueduct_cli::shutdown_signal();
        signal_self("-TERM");
        // Still alive: the listener took the signal. And the future reports it.
        let which = tokio::time::timeout(std::time::Duration::from_secs(20), stop)
            .await
            .expect("the signal is reported");
        assert_eq!(which, "SIGTERM");
    });
}

/// The broker's SIGHUP listener was set up only once it served, after binding (which can take a
/// while: recovering a large durable log), and a SIGHUP before that killed it.
#[cfg(unix)]
#[test]
fn a_sighup_before_anyone_waits_is_kept() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut hangups = aqueduct_cli::hangup_signal().expect("a SIGHUP listener");
        signal_self("-HUP");
        let got = tokio::time::timeout(std::time::Duration::from_secs(20), hangups.recv())
            .await
            .expect("the signal is reported");
        assert_eq!(got, Some(()));
    });
}
