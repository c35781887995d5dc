//! `aqueduct-broker`: run the Aqueduct broker.

use std::path::PathBuf;
use std::process::ExitCode;

use aqueduct_server::{Config, Overrides, Server, Sources};
use clap::{CommandFactory, Parser};
use tracing::{error, info, warn};

/// The Aqueduct message broker: publish/subscribe over QUIC with priorities, TTLs, consumer
/// groups, acknowledgements and dead-letter topics.
///
/// With no options it listens on UDP :4242 with a self-signed development certificate, which it
/// writes to ~/.aqueduct/dev-cert.pem (or $AQUEDUCT_HOME/dev-cert.pem) so that `aqueduct pub`
/// and `aqueduct sub` on this machine can verify it without any setup.
///
/// Settings come from, in increasing precedence: built-in defaults, the YAML file (--config),
/// AQUEDUCT_* environment variables (AQUEDUCT_BROKER_QUEUE_SIZE for broker.queue_size, …),
/// and these flags. See config.example.yaml for every key.
///
/// SIGHUP re-reads the config file's `acl` and `broker.quotas` sections and applies them at once
/// (replacing changes made through the admin API), and re-reads `tls.crl_file` (connections of
/// certificates revoked since are closed); SIGTERM or Ctrl-C stops the broker gracefully.
#[derive(Debug, Parser)]
#[command(name = "aqueduct-broker", version)]
struct Args {
    /// YAML configuration file.
    /// The seed's single-dash forms work too: -config, -addr, -metrics-addr.
    /// An empty AQUEDUCT_CONFIG means none.
    // As the seed read it: clap refused an empty one as "a value is required for '--config'",
    // a flag that was not given.
    #[arg(
        long,
        short = 'c',
        env = "AQUEDUCT_CONFIG",
        value_name = "FILE",
        value_parser = clap::builder::OsStringValueParser::new()
    )]
    config: Option<std::ffi::OsString>,
    /// Address to listen on (UDP), e.g. ":4242" (every interface, IPv6 and IPv4: the
    /// default), "0.0.0.0:4242" (IPv4 only) or "127.0.0.1:4242" (key: listen_addr).
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// Address of the metrics, health and live-view endpoint (HTTP), default "127.0.0.1:9090"
    /// (key: metrics_addr).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<String>,
    /// TLS certificate chain, PEM (key: tls.cert_file). Needs --key.
    #[arg(long, value_name = "FILE")]
    cert: Option<String>,
    /// TLS private key, PEM (key: tls.key_file). Needs --cert.
    #[arg(long, value_name = "FILE")]
    key: Option<String>,
    /// Enable the durable, encrypted append-only log (key: aal.enabled).
    #[arg(long)]
    aal: bool,
    /// Log filter, e.g. "info", "debug", "aqueduct_server=debug".
    #[arg(
        long,
        env = "AQUEDUCT_LOG",
        default_value = "info",
        value_name = "FILTER"
    )]
    log: String,
}

fn main() -> ExitCode {
    // The seed's command line works as written: `-config config.yaml -addr :4242`.
    let args = Args::parse_from(aqueduct_cli::go_style_args(
        std::env::args_os().collect(),
        &Args::command(),
    ));
    // A filter that cannot be read stops the broker: it used to fall back on "info" unsaid, and
    // a misspelt level ("debgu") was taken as a target, which left the log empty.
    match aqueduct_cli::log_filter(&args.log) {
        Ok(filter) => aqueduct_cli::init_logging(filter),
        Err(e) => {
            eprintln!(
                "aqueduct-broker: configuration error: --log (AQUEDUCT_LOG) {:?}: {e}",
                args.log
            );
            return ExitCode::from(2);
        }
    }
    let overrides = Overrides {
        listen_addr: args.addr.clone(),
        metrics_addr: args.metrics_addr.clone(),
        cert_file: args.cert.clone(),
        key_file: args.key.clone(),
        aal: args.aal,
    };
    let config_file = args
        .config
        .clone()
        .filter(|c| !c.is_empty())
        .map(PathBuf::from);
    let sources = match Sources::from_process(config_file, overrides) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("aqueduct-broker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match Config::load(&sources) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("aqueduct-broker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = config.worker_threads {
        builder.worker_threads(n);
    }
    let spin = aqueduct_udp::IdleSpin::new(config.idle_spin);
    if !config.idle_spin.is_zero() {
        builder
            .on_thread_park(spin.before_park())
            .on_thread_unpark(spin.after_unpark());
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aqueduct-broker: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    if !config.idle_spin.is_zero() {
        if let Err(e) = spin.start(runtime.handle()) {
            // Spinning still works; a task woken from outside the runtime during a spin may
            // wait for another worker to find it.
            warn!("broker.idle_spin: cannot make the socket that wakes the runtime: {e}");
        }
    }
    info!(
        worker_threads = runtime.metrics().num_workers(),
        configured = config.worker_threads.is_some(),
        idle_spin = ?config.idle_spin,
        "async runtime started (broker.worker_threads, broker.idle_spin)"
    );
    runtime.block_on(async move {
        // Listen before binding: a SIGTERM from the moment the broker starts stops it cleanly,
        // and a SIGHUP then (a reload while the log recovers, say) is applied once it runs.
        let stop = aqueduct_cli::shutdown_signal();
        let hangups = aqueduct_cli::hangup_signal();
        let server = match Server::bind(config).await {
            Ok(s) => s,
            Err(e) => {
                // Once, on standard error (the log goes there too).
                error!("cannot start: {e}");
                return ExitCode::from(1);
            }
        };
        if let Some(path) = server.dev_cert_file() {
            info!(
                path = %path.display(),
                "using a generated self-signed certificate; local `aqueduct` commands trust it automatically"
            );
        }
        let reload = reload_on_sighup(server.control(), sources, hangups);
        let signal = async {
            tokio::select! {
                which = stop => info!("{which} received"),
                () = reload => {}
            }
        };
        match server.serve(signal).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("aqueduct-broker: {e}");
                ExitCode::from(1)
            }
        }
    })
}

/// SIGHUP: re-read the configuration and make its `acl` and `broker.quotas` sections the live
/// policy, and re-read `tls.crl_file` and `cluster.tls.crl_file` (closing connections whose
/// certificate they revoke). A
/// configuration that does not validate changes nothing (and says why). Never returns.
async fn reload_on_sighup(
    control: aqueduct_server::Control,
    sources: Sources,
    hangups: Option<aqueduct_cli::Hangups>,
) {
    if let Some(mut hup) = hangups {
        while hup.recv().await.is_some() {
            match Config::load(&sources) {
                Ok(config) => {
                    let named = |p: Option<&std::path::Path>| {
                        p.map_or("none".to_string(), |p| p.display().to_string())
                    };
                    for ((key, running), (_, read)) in
                        control.crl_files().into_iter().zip(config.crl_files())
                    {
                        if running != read {
                            error!(
                                "SIGHUP: {key} changed ({} -> {}): a new path, or adding or \
                                 removing the file, takes a restart; the lists of the file the \
                                 broker started with stay in force",
                                named(running),
                                named(read)
                            );
                        }
                    }
                    let stale = control.needs_restart(&config);
                    if !stale.is_empty() {
                        error!(
                            "SIGHUP: changed settings that take a restart: {} (the running \
                             values stay in force; a reload applies acl, broker.quotas and the \
                             contents of tls.crl_file and cluster.tls.crl_file)",
                            stale.join(", ")
                        );
                    }
                    match control.reload_access(&config.access).await {
                        Ok(closed) => {
                            let acl = control.acl();
                            info!(
                                acl_enabled = acl.enabled,
                                rules = acl.rules.len(),
                                closed_subscriptions = closed,
                                "SIGHUP: acl and broker.quotas reloaded from the configuration \
                                 (the file wins: rules and quotas set through the admin API \
                                 since were replaced)"
                            );
                        }
                        Err(e) => warn!("SIGHUP: the new policy is live but was not saved: {e}"),
                    }
                }
                Err(e) => {
                    error!("SIGHUP: configuration not reloaded, the running policy stays: {e}")
                }
            }
            let files = control.crl_keys().join(" and ");
            match control.reload_revocations().await {
                Ok(Some((revoked, closed))) => info!(
                    revoked_certificates = revoked,
                    closed_connections = closed,
                    "SIGHUP: {files} reloaded"
                ),
                Ok(None) => {}
                Err(e) => {
                    error!("SIGHUP: {files} not reloaded, the lists in force stay: {e}")
                }
            }
        }
    }
    std::future::pending::<()>().await
}
