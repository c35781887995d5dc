//! Shared code of the `aqueduct` command-line tools: the client command line ([`client_cmd`]),
//! the load tool ([`bench`]), Go-style flags and signal handling.

pub mod admin_cmd;
pub mod bench;
pub mod cert;
pub mod client_cmd;
pub mod durable_bench;
pub mod log_cmd;
pub mod trace_sink;

use std::ffi::OsString;

/// Accept the seed's Go-style flags: a single dash before a long flag name (`-config x`,
/// `-metrics-addr=:9090`) is read as two (`--config x`). Only names that are long flags of
/// `cmd` or one of its subcommands are rewritten, so short flags (`-c`, `-n 5`) and values that
/// start with a dash are left alone; nothing after `--` is touched.
pub fn go_style_args(args: Vec<OsString>, cmd: &clap::Command) -> Vec<OsString> {
    let mut longs = Vec::new();
    collect_longs(cmd, &mut longs);
    let mut out = Vec::with_capacity(args.len());
    let mut rest = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || rest {
            out.push(arg);
            continue;
        }
        let Some(text) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            rest = true;
            out.push(arg);
            continue;
        }
        let go_style = text
            .strip_prefix('-')
            .filter(|t| !t.starts_with('-'))
            .map(|t| t.split_once('=').map_or(t, |(name, _)| name))
            .is_some_and(|name| name.len() > 1 && longs.iter().any(|l| l == name));
        if go_style {
            out.push(OsString::from(format!("-{text}")));
        } else {
            out.push(arg);
        }
    }
    out
}

fn collect_longs(cmd: &clap::Command, out: &mut Vec<String>) {
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            out.push(long.to_string());
        }
    }
    for sub in cmd.get_subcommands() {
        collect_longs(sub, out);
    }
    // clap's built-ins.
    out.extend(["help".to_string(), "version".to_string()]);
}

/// Start listening for Ctrl-C and SIGTERM now; the future completes on the first of them and
/// says which. The listeners are registered when this is called, not when the future is first
/// polled: a signal that arrives in between is kept, never left to its default action (which
/// ends the process without a clean shutdown). Call it inside the runtime, early.
pub fn shutdown_signal() -> impl std::future::Future<Output = &'static str> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let interrupt = signal(SignalKind::interrupt()).ok();
        let terminate = signal(SignalKind::terminate()).ok();
        async move {
            match (interrupt, terminate) {
                (Some(mut int), Some(mut term)) => tokio::select! {
                    _ = int.recv() => "Ctrl-C",
                    _ = term.recv() => "SIGTERM",
                },
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                    "Ctrl-C"
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

/// The SIGHUPs from now on, as a stream whose `recv` completes once per signal (several sent
/// close together may come as one). Registered when this is called: a SIGHUP that arrives
/// before anyone waits for it (a `reload` while the broker is still starting) is kept for later,
/// not left to its default action, which ends the process. `None` off Unix, or if the listener
/// cannot be set up. Call it inside the runtime, early.
pub fn hangup_signal() -> Option<Hangups> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::hangup()).ok().map(Hangups)
    }
    #[cfg(not(unix))]
    None
}

/// SIGHUPs received (see [`hangup_signal`]).
#[derive(Debug)]
pub struct Hangups(#[cfg(unix)] tokio::signal::unix::Signal);

impl Hangups {
    /// The next SIGHUP (one that came before this call completes it at once).
    pub async fn recv(&mut self) -> Option<()> {
        #[cfg(unix)]
        {
            self.0.recv().await
        }
        #[cfg(not(unix))]
        None
    }
}

/// Print `line` and a newline on standard output. `Ok(false)`: whoever read the output went
/// away (`aqueduct sub ... | head`, a closed pipe): the caller stops as if interrupted, quietly,
/// instead of the panic `println!` makes of it.
pub fn print_line(line: &str) -> std::io::Result<bool> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}") {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e),
    }
}

/// Where a dead letter came from, as `aqueduct sub` and `aqueduct log dump` both show it:
/// `dead letter of jobs #10 after 4 attempts: nacked` (each part only when known).
pub fn dead_letter_origin(
    topic: &str,
    offset: Option<u64>,
    attempts: Option<u32>,
    reason: Option<&str>,
) -> String {
    let mut s = format!("dead letter of {topic}");
    if let Some(o) = offset {
        s.push_str(&format!(" #{o}"));
    }
    match attempts {
        Some(1) => s.push_str(" after 1 attempt"),
        Some(n) => s.push_str(&format!(" after {n} attempts")),
        None => {}
    }
    if let Some(r) = reason {
        s.push_str(&format!(": {r}"));
    }
    s
}

/// `eprintln!` that loses the line, instead of panicking, when standard error cannot be written
/// to (a pipe whose reader left: `aqueduct sub t 2>&1 | head -n 2`).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// The log filter `--log`/`AQUEDUCT_LOG` names (`info`, `debug`, `aqueduct_server=debug`, …), or
/// why it is refused. tracing's own parser takes a word it does not know as a target to log
/// everything of, and nothing else: `debgu` would silence the whole log. A bare word one edit
/// from a level's name (a swap of two letters counting as one) is therefore refused as a
/// misspelt level; `WORD=trace` names a target of that name.
pub fn log_filter(spec: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    for directive in spec.split(',').map(str::trim) {
        let bare = !directive.contains(['=', '[', ':']);
        let word = directive.to_ascii_lowercase();
        if bare && word.len() >= 3 && !LEVELS.contains(&word.as_str()) {
            let nearest = LEVELS
                .iter()
                .map(|l| (strsim::damerau_levenshtein(l, &word), l))
                .min();
            if let Some((1, level)) = nearest {
                return Err(format!(
                    "{directive:?} is not a level ({}); did you mean {level:?}? (to log \
                     everything of a target of that name, write {directive}=trace)",
                    LEVELS.join(", ")
                ));
            }
        }
    }
    tracing_subscriber::EnvFilter::try_new(spec).map_err(|e| {
        format!("{e} (a filter is a level such as \"info\", or TARGET=LEVEL pairs separated by commas, such as \"info,aqueduct_server=debug\")")
    })
}

/// Log to standard error, coloured only on a terminal (a log file or a pipe gets plain text).
/// A standard error that cannot be written to (closed, a pipe whose reader left) loses the log
/// lines but never stops the process: tracing-subscriber would otherwise report the failed write
/// with `eprintln!`, which panics on the same broken stream.
///
/// web-transport-quinn warns whenever a session ends without its closing capsule (a browser tab
/// closed, a client that closed its connection): the broker logs the disconnection itself, so
/// unless the filter names it, that crate logs errors only.
pub fn init_logging(mut filter: tracing_subscriber::EnvFilter) {
    if !filter.to_string().contains("web_transport") {
        if let Ok(quiet) = "web_transport_quinn=error".parse() {
            filter = filter.add_directive(quiet);
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .log_internal_errors(false)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Demo {
        #[arg(long, short = 'c')]
        config: Option<String>,
        #[arg(long)]
        metrics_addr: Option<String>,
        #[arg(short = 'n')]
        count: Option<i64>,
    }

    #[test]
    fn log_filters_that_would_silence_the_log_are_refused() {
        for good in [
            "info",
            "DEBUG",
            "warn,aqueduct_server=debug",
            "aqueduct_server",
            "quinn",
        ] {
            assert!(log_filter(good).is_ok(), "{good}");
        }
        let typo = log_filter("debgu").expect_err("a misspelt level");
        assert!(typo.contains("did you mean \"debug\""), "{typo}");
        assert!(typo.contains("debgu=trace"), "{typo}");
        assert!(log_filter("info,wran").is_err_and(|e| e.contains("\"warn\"")));
        assert!(
            log_filter("inf").is_err_and(|e| e.contains("\"info\"")),
            "the nearest"
        );
        // Two edits away: a target (crates named so exist).
        for target in ["init", "wasm", "quinn", "rustls"] {
            assert!(log_filter(target).is_ok(), "{target}");
        }
        // One edit away from a level, and a target's name too: the error says how to name it.
        assert!(log_filter("into").is_err_and(|e| e.contains("write into=trace")));
        assert!(log_filter("into=trace").is_ok());
        let bad = log_filter("aqueduct_server=loud").expect_err("not a level");
        assert!(bad.contains("TARGET=LEVEL"), "{bad}");
    }

    fn rewrite(args: &[&str]) -> Vec<String> {
        use clap::CommandFactory;
        go_style_args(args.iter().map(OsString::from).collect(), &Demo::command())
            .into_iter()
            .map(|a| a.into_string().expect("utf-8"))
            .collect()
    }

    #[test]
    fn single_dash_long_flags_become_double_dash() {
        assert_eq!(
            rewrite(&[
                "x",
                "-config",
                "c.yaml",
                "-metrics-addr=:9090",
                "-c",
                "y",
                "-n",
                "-5"
            ]),
            [
                "x",
                "--config",
                "c.yaml",
                "--metrics-addr=:9090",
                "-c",
                "y",
                "-n",
                "-5"
            ]
        );
        assert_eq!(
            rewrite(&["x", "--config", "a", "--", "-config"]),
            ["x", "--config", "a", "--", "-config"]
        );
        let demo = Demo::parse_from(rewrite(&["x", "-config", "a", "-metrics-addr", ":1"]));
        assert_eq!(demo.config.as_deref(), Some("a"));
        assert_eq!(demo.metrics_addr.as_deref(), Some(":1"));
        // Unknown names are left for clap to refuse.
        assert_eq!(rewrite(&["x", "-bogus"]), ["x", "-bogus"]);
    }

    /// `aqueduct sub` and `aqueduct log dump` say where a dead letter came from in the same
    /// words (dump wrote "attempt(s)" where sub wrote "attempts"), in the singular for one.
    #[test]
    fn a_dead_letter_s_origin_reads_the_same_everywhere() {
        assert_eq!(
            dead_letter_origin("jobs", Some(10), Some(4), Some("nacked")),
            "dead letter of jobs #10 after 4 attempts: nacked"
        );
        assert_eq!(
            dead_letter_origin("jobs", Some(0), Some(1), None),
            "dead letter of jobs #0 after 1 attempt"
        );
        assert_eq!(
            dead_letter_origin("jobs", None, None, None),
            "dead letter of jobs"
        );
    }
}
