//! `shutdown_signal` listens from the moment it is called, not from its first poll: a SIGTERM
//! that arrives in between (a broker told to stop while it is still starting up) is kept for the
//! clean shutdown instead of killing the process. Alone in its test binary: it signals itself.

#[test]
fn a_sigterm_before_the_first_poll_is_kept() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let stop = aqueduct_cli::shutdown_signal();
        let me = std::process::id().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &me])
            .status()
            .expect("kill runs");
        assert!(sent.success());
        // Still alive: the listener took the signal. And the future reports it.
        let which = tokio::time::timeout(std::time::Duration::from_secs(20), stop)
            .await
            .expect("the signal is reported");
        assert_eq!(which, "SIGTERM");
    });
}
