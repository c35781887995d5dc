//! `aqueduct`: command-line client for the Aqueduct broker (the `aqueduct` and `aqueduct-bench`
//! binaries run [`main_with`]).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::bench::{self, BenchConfig};
use anyhow::{anyhow, bail, Context, Result};
use aqueduct_client::{
    Client, ConnectOptions, DurableStart, OverflowPolicy, Priority, PublishOptions,
    SubscribeOptions,
};
use bytes::Bytes;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use futures_util::StreamExt;

/// Publish and subscribe to an Aqueduct broker.
///
/// On localhost the broker's generated development certificate ($AQUEDUCT_HOME/dev-cert.pem, or
/// ~/.aqueduct/dev-cert.pem without AQUEDUCT_HOME) is trusted automatically. For any other host pass --ca (a CA certificate) or --pin (the SHA-256
/// fingerprint of the broker's certificate); certificates are always verified.
#[derive(Debug, Parser)]
#[command(name = "aqueduct", version)]
struct Cli {
    /// Broker address.
    #[arg(
        long,
        short = 'a',
        global = true,
        env = "AQUEDUCT_ADDR",
        default_value = "localhost:4242"
    )]
    addr: String,
    /// CA certificate (PEM) to verify the broker with.
    #[arg(long, global = true, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Accept only the broker certificate with this SHA-256 fingerprint (64 hex digits, or
    /// OpenSSL's form with colons).
    #[arg(long, global = true, value_name = "HEX")]
    pin: Option<String>,
    /// Name to verify in the broker's certificate (default: the host of --addr, or of
    /// --admin-addr for `admin`).
    #[arg(long, global = true)]
    server_name: Option<String>,
    /// Client certificate (PEM) for brokers that require mTLS. Needs --key.
    #[arg(long, global = true, value_name = "FILE")]
    cert: Option<PathBuf>,
    /// Client private key (PEM). Needs --cert.
    #[arg(long, global = true, value_name = "FILE")]
    key: Option<PathBuf>,
    /// The development certificate to trust on localhost.
    #[arg(long, global = true, value_name = "FILE")]
    dev_cert: Option<PathBuf>,
    /// How to reach the broker: quic (ALPN aqueduct-v1) or webtransport (HTTP/3 on the same
    /// UDP port, as browsers connect).
    #[arg(long, global = true, value_enum, default_value_t = TransportArg::Quic)]
    transport: TransportArg,
    /// With --transport webtransport: the session's path (the broker's
    /// webtransport.path_prefix).
    #[arg(
        long,
        global = true,
        default_value = "/aqueduct/wt",
        value_name = "PATH"
    )]
    wt_path: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish a message (or, without MESSAGE, one message per line of standard input).
    Pub {
        /// Topic, e.g. orders/eu.
        topic: String,
        /// Message body. Without it, each line of standard input is one message, published as
        /// it is read (`tail -f app.log | aqueduct pub logs`); Ctrl-C or SIGTERM then ends it
        /// cleanly: the lines read so far are published, the connection is closed.
        message: Option<String>,
        /// Publish the message this many times.
        #[arg(long, short = 'n', default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        count: u64,
        /// Priority: 0 (highest) to 3 (lowest).
        #[arg(long, short = 'p', default_value_t = 2)]
        priority: u8,
        /// Time to live, e.g. 500ms, 10s, 5m (a bare number is seconds); leave it out for no
        /// expiry.
        #[arg(long, value_parser = ttl_duration)]
        ttl: Option<Duration>,
        /// Wait for the broker to confirm and print the offsets.
        #[arg(long)]
        confirm: bool,
        /// Spread the messages over this many topics, TOPIC/0 .. TOPIC/<N-1>, in turn (e.g. to
        /// see the broker free idle topics: --count 1000000 --topics 1000000).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        topics: u64,
        /// Start a trace: the message carries a new W3C trace context (sampled), printed on
        /// stderr as `trace <traceparent>`; a broker with tracing.otlp_endpoint set records
        /// its publish, route and deliver spans.
        #[arg(long, conflicts_with = "traceparent")]
        trace: bool,
        /// Continue this trace (a W3C traceparent, 00-<trace id>-<span id>-<flags>).
        #[arg(long, value_name = "TRACEPARENT", value_parser = parse_traceparent)]
        traceparent: Option<aqueduct_client::TraceContext>,
    },
    /// Subscribe and print each message with its topic, offset and priority.
    Sub {
        /// Topic filter, e.g. orders/+ or sensors/#.
        filter: String,
        /// Join this consumer group (each message goes to one member). A member acknowledges
        /// each message after printing it (and after --work): one it has not acknowledged when
        /// it stops goes to another member.
        #[arg(long, short = 'g')]
        group: Option<String>,
        /// Acknowledge each message after printing it (explicit-ack mode).
        #[arg(long)]
        ack: bool,
        /// Reject (NACK) each message after printing it: the broker redelivers it and, after
        /// broker.max_retries, moves it to __dlq__<topic>. For trying out dead letters.
        #[arg(long, conflicts_with = "ack")]
        nack: bool,
        /// With --ack, --nack, --group or --durable: at most this many unacknowledged messages at
        /// a time (1 = one at a time: what waits behind it stays in strict priority order).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_in_flight: Option<u32>,
        /// Take this long to "process" each message before acknowledging it (a slow consumer,
        /// for trying out priorities and backpressure), e.g. 500ms.
        #[arg(long, value_parser = humantime_duration)]
        work: Option<Duration>,
        /// Exit after this many messages.
        #[arg(long, short = 'n', value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Backpressure policy for this subscription: drop_oldest, drop_newest, disconnect, block.
        #[arg(long)]
        overflow: Option<OverflowPolicy>,
        /// Be the durable consumer ID: with the broker's durable log on, messages come from the
        /// log and the broker keeps ID's position (what was acknowledged), so the next
        /// `aqueduct sub --durable ID` goes on from there. With --group G (the same filter on
        /// every worker), the workers of the durable group G share one position. Acknowledges
        /// each message.
        #[arg(long, value_name = "ID")]
        durable: Option<String>,
        /// With --durable, where to start the first time (later the stored position wins): an
        /// offset, earliest (all the log holds) or latest (only new messages).
        #[arg(
            long,
            value_name = "START",
            default_value = "earliest",
            requires = "durable"
        )]
        from: DurableStart,
    },
    /// Make certificates for mutual TLS: a CA, a broker certificate, client certificates
    /// (X.509 v3, ECDSA P-256; the CA valid ten years, what it signs one year). Needs no broker.
    #[command(
        after_help = "Examples:\n  aqueduct cert ca --out certs\n  aqueduct cert server --out certs --name localhost --name 127.0.0.1 --name ::1\n  aqueduct cert client alice --out certs\n  aqueduct cert revoke certs/alice.pem --out certs\n  aqueduct cert peer aqueduct-0 --out certs --name aqueduct-0.aqueduct-headless.aqueduct.svc.cluster.local"
    )]
    Cert {
        #[command(subcommand)]
        what: CertCommand,
    },
    /// Measure the durable log of a broker with aal.enabled: confirmed publish throughput, or a
    /// durable consumer's replay rate.
    #[command(
        name = "bench-durable",
        after_help = "Examples:\n  aqueduct bench-durable --messages 1000000 publish --batch 100 --window 8\n  aqueduct bench-durable --messages 1000000 replay --consumer r1"
    )]
    BenchDurable {
        /// Messages to publish, or to read back.
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
        messages: u64,
        /// Bytes per message.
        #[arg(long, default_value_t = 128)]
        payload_size: usize,
        /// The topic.
        #[arg(long, default_value = "bench-durable")]
        topic: String,
        /// Print one JSON object instead of text (no progress bar).
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        mode: DurableBenchMode,
    },
    /// Manage a running broker through its gRPC admin API (admin.enabled): quotas, ACL rules,
    /// clients, topics, broker info, the cluster. Needs an admin client certificate (--cert/--key, CN matching the
    /// broker's admin.allowed_cn, default admin-*) and, for a broker with a CA-signed
    /// certificate, --ca.
    #[command(
        after_help = "Examples (--ca: the CA that signed the broker's certificate, if not the development one):\n  aqueduct --ca certs/ca.pem --cert certs/admin-alice.pem --key certs/admin-alice-key.pem admin info\n  aqueduct --ca ... --cert ... --key ... admin quota set service-a 500 --burst 100\n  aqueduct --ca ... --cert ... --key ... admin acl add 'service-*' 'orders/#' publish\n  aqueduct --ca ... --cert ... --key ... admin acl replace rules.yaml\n  aqueduct --ca ... --cert ... --key ... admin --json clients\n  aqueduct --ca ... --cert ... --key ... admin --admin-addr 10.0.0.5:9091 info   # admin.listen_addr elsewhere"
    )]
    Admin {
        /// The admin API's address (the broker's admin.listen_addr; --addr is the broker's
        /// client address, not this one).
        #[arg(
            long,
            global = true,
            env = "AQUEDUCT_ADMIN_ADDR",
            default_value = "localhost:9091"
        )]
        admin_addr: String,
        /// Print JSON instead of a table.
        #[arg(long, global = true)]
        json: bool,
        #[command(subcommand)]
        what: crate::admin_cmd::AdminCommand,
    },
    /// Inspect a durable log directory (aal.file_path) offline: check every record, or print a
    /// topic's messages (both change nothing on disk and need no broker); or re-seal it under a
    /// new master key (the broker stopped). The key comes from --key-file or AQUEDUCT_AAL_KEY
    /// (base64, as aal.key), older ones from --previous-key-file or AQUEDUCT_AAL_PREVIOUS_KEYS.
    #[command(
        after_help = "Examples:\n  aqueduct log verify --key-file aal.key                 # the broker's default directory\n  aqueduct log dump --key-file aal.key --topic orders --from 0\n  aqueduct log dump /var/lib/aqueduct/aal --key-file aal.key   # another directory: list topics\n  aqueduct log rekey --key-file new.key --previous-key-file old.key   # after aal.key changed"
    )]
    Log {
        #[command(subcommand)]
        what: LogCommand,
    },
    /// Ask the broker what it allows (the protocol's INFO): its version, the largest frame it
    /// accepts from a client, what a client must accept from it, and how many subscriptions a
    /// connection may hold. Any client may ask; the broker's state (connections, topics,
    /// cluster) is `aqueduct admin info` and needs an admin certificate.
    #[command(
        after_help = "Example:\n  aqueduct info\n  aqueduct --addr broker.example.com:4242 --ca ca.pem info --json"
    )]
    Info {
        /// Print one JSON object instead of text (a value the broker did not say is null).
        #[arg(long)]
        json: bool,
    },
    /// Open idle connections (and subscriptions) and hold them, to measure a broker's memory
    /// per connection and per subscription.
    Hold {
        /// Connections to open.
        #[arg(long, default_value_t = 1000)]
        connections: usize,
        /// Subscriptions per connection, to hold/<connection>/<n>.
        #[arg(long, default_value_t = 0)]
        subscriptions: usize,
        /// Subscriptions per stream (default 1: a stream each); more share a stream.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        per_stream: u64,
        /// How long to hold them.
        #[arg(long, default_value = "10s", value_parser = humantime_duration)]
        seconds: Duration,
    },
    /// Receive trace spans over OTLP/gRPC and print them: see what a broker with
    /// tracing.otlp_endpoint exports without installing a collector. Ends on Ctrl-C, SIGTERM or
    /// after --spans spans, printing the counts as JSON.
    #[command(
        name = "trace-sink",
        after_help = "Example:\n  aqueduct trace-sink --listen 127.0.0.1:4317 --print\n  AQUEDUCT_TRACING_OTLP_ENDPOINT=http://127.0.0.1:4317 aqueduct-broker"
    )]
    TraceSink {
        /// Address to listen on (TCP).
        #[arg(long, default_value = "127.0.0.1:4317")]
        listen: String,
        /// Print one line per span: service, name, topic, trace, span and parent ids, duration.
        #[arg(long)]
        print: bool,
        /// Stop after receiving this many spans.
        #[arg(long)]
        spans: Option<u64>,
    },
    /// Load test (the seed's aqueduct-bench): publishers → subscribers on a fresh topic;
    /// reports publish and delivery rates, MB/s, losses, duplicates and one-way latency
    /// percentiles. Exits non-zero, saying why, if any message was lost or duplicated. Ctrl-C
    /// stops publishing and reports what was sent (a second one exits at once).
    Bench {
        /// Messages to publish, at most 1,000,000,000 (ignored with --duration).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
        messages: u64,
        /// Publish for this long instead (e.g. 10s); with --rate, exactly rate × duration
        /// messages.
        #[arg(long, value_parser = positive_duration)]
        duration: Option<Duration>,
        /// Payload bytes per message (at least 16: timestamp and sequence number).
        #[arg(long, default_value_t = 128)]
        payload_size: usize,
        /// Publisher connections.
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        publishers: usize,
        /// Publish streams per publisher connection.
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        streams: usize,
        /// Subscriber connections.
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        subscribers: usize,
        /// Subscribers form one consumer group (each message goes to one, which acks it).
        #[arg(long)]
        group: bool,
        /// Backpressure policy of the bench's subscriptions: `block` (the default) holds the
        /// publishers to the subscribers' pace, so nothing is dropped and the delivered rate is
        /// what the broker sustains; `broker` uses the broker's own policy (drop_oldest by
        /// default: a fast publisher then outruns the subscribers and messages are dropped);
        /// or drop_oldest, drop_newest, disconnect.
        #[arg(long, default_value = "block", value_parser = parse_bench_overflow)]
        overflow: BenchOverflow,
        /// Messages per PUBLISH_BATCH frame (1 = single PUBLISH frames).
        #[arg(long, default_value_t = 100, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        batch: usize,
        /// Total publish rate in msg/s, open loop (0 = as fast as possible; else from 0.01 to
        /// 1,000,000,000). Use for latency.
        #[arg(long, default_value_t = 0.0, value_parser = bench_rate)]
        rate: f64,
        /// Priority mix as PRIORITY:WEIGHT pairs, e.g. 0:1,2:9 (default: all priority 2).
        #[arg(long, default_value = "", value_parser = priority_mix_arg)]
        priority_mix: PriorityMix,
        /// Topic (default: bench/<process id>).
        #[arg(long)]
        topic: Option<String>,
        /// Stop waiting for deliveries after this long without progress.
        #[arg(long, default_value = "5s", value_parser = positive_duration)]
        idle: Duration,
        /// The broker's metrics endpoint, to explain losses (default: 127.0.0.1:9090 for a local broker).
        #[arg(long)]
        metrics_addr: Option<String>,
        /// Connect the subscribers to this broker instead of --addr (e.g. another node of a
        /// cluster: publishers on one node, subscribers on another). The run then starts with
        /// probes (empty messages, not counted) until every subscriber has seen one, as the
        /// publishers' node learns of the subscriptions only after they are active. The same
        /// trust flags apply (--ca, --pin, --server-name, --cert/--key).
        #[arg(long, value_name = "ADDR")]
        sub_addr: Option<String>,
        /// The development certificate to trust for --sub-addr on localhost (default: the one
        /// --dev-cert or AQUEDUCT_HOME names, which holds the certificates of every local
        /// broker that writes it).
        #[arg(long, value_name = "FILE", requires = "sub_addr")]
        sub_dev_cert: Option<PathBuf>,
        /// With --sub-addr: give up (and fail) if the probes have not reached every subscriber
        /// after this long.
        #[arg(long, default_value = "15s", value_parser = humantime_duration)]
        probe_timeout: Duration,
        /// Every publish frame starts a trace (a new sampled W3C trace context, shared by a
        /// batch's messages), for measuring a broker that exports traces
        /// (tracing.otlp_endpoint, tracing.sample_ratio).
        #[arg(long)]
        trace: bool,
        /// Leave the first N messages (by sequence number) out of the latency figures: a new
        /// connection's first messages meet cold caches and a congestion window still opening.
        /// They are still delivered and counted. peerbench's nats-latency leaves out 1000 by
        /// default; the speed bar passes 1000 to both.
        #[arg(long, value_name = "N", default_value_t = 0)]
        warmup: u64,
        /// Write every timed delivery to FILE as CSV, `sent_ns,latency_ns` (nanoseconds, the
        /// send stamp counted from the run's start), sorted by send time: to see when the slow
        /// ones happened, e.g. whether a p99 comes from a few stalls or from many small delays.
        #[arg(long, value_name = "FILE")]
        latency_trace: Option<PathBuf>,
        /// Print one JSON object instead of text (no progress bar).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum DurableBenchMode {
    /// Publish with CONFIRM from one connection, keeping several batches awaiting their CONFIRM.
    Publish {
        /// Messages per PUBLISH_BATCH frame.
        #[arg(long, default_value_t = 100, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        batch: usize,
        /// Batches awaiting their CONFIRM at a time.
        #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        window: usize,
    },
    /// Read the topic back as a new durable consumer, from earliest.
    Replay {
        /// The durable consumer's id (a new one reads from the start).
        #[arg(long, default_value = "bench-replay")]
        consumer: String,
    },
}

#[derive(Debug, Subcommand)]
enum LogCommand {
    /// Read every segment through, checking each record's checksum and seal. Exit status 1 if
    /// anything is damaged or unreadable (a torn tail, which the broker cuts at startup, is
    /// reported but not an error).
    Verify {
        /// The log's directory (default: as the broker's on its defaults: AQUEDUCT_AAL_FILE_PATH,
        /// else $AQUEDUCT_HOME/aal, else ~/.aqueduct/aal).
        dir: Option<PathBuf>,
        #[command(flatten)]
        keys: crate::log_cmd::LogKeys,
    },
    /// Re-seal every segment sealed with a previous key (--previous-key-file, aal.previous_keys)
    /// under the current one (--key-file, aal.key), so that the previous key is no longer
    /// needed. Stop the broker first: the log must not be in use. Refused, changing nothing,
    /// unless the log's newest segment is already under the current key (the broker has run
    /// with the new aal.key). Exit status 1 if a damaged segment had to be left under its old
    /// key.
    Rekey {
        /// The log's directory (default: as the broker's on its defaults: AQUEDUCT_AAL_FILE_PATH,
        /// else $AQUEDUCT_HOME/aal, else ~/.aqueduct/aal).
        dir: Option<PathBuf>,
        #[command(flatten)]
        keys: crate::log_cmd::LogKeys,
    },
    /// Print a topic's messages (offset, priority, time in ms since the epoch, body), or list
    /// the topics without --topic.
    Dump {
        /// The log's directory (default: as the broker's on its defaults: AQUEDUCT_AAL_FILE_PATH,
        /// else $AQUEDUCT_HOME/aal, else ~/.aqueduct/aal).
        dir: Option<PathBuf>,
        /// The topic to print.
        #[arg(long)]
        topic: Option<String>,
        /// First offset to print.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Print at most this many messages.
        #[arg(long, short = 'n')]
        count: Option<u64>,
        #[command(flatten)]
        keys: crate::log_cmd::LogKeys,
    },
}

#[derive(Debug, Subcommand)]
enum CertCommand {
    /// A certificate authority: DIR/ca.pem (the broker's tls.client_ca_file, the clients'
    /// --ca) and DIR/ca-key.pem (keep it private).
    Ca {
        /// Directory for the files (created if missing; existing files are never replaced).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The CA's Common Name. Default: "Aqueduct CA" and 8 hex digits of its key's
        /// fingerprint, so that a new CA can be trusted beside the one it replaces (the broker
        /// refuses revocation lists of two CAs of one name).
        #[arg(long)]
        cn: Option<String>,
    },
    /// A broker certificate signed by the CA in DIR: DIR/server.pem and DIR/server-key.pem
    /// (tls.cert_file and tls.key_file).
    Server {
        /// Directory of the CA (made by `aqueduct cert ca`); the files are written there too.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A DNS name or IP address clients use to reach the broker (repeat for more).
        /// Default: localhost, 127.0.0.1 and ::1 (the broker's default ":4242" serves IPv6 too).
        #[arg(long = "name", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()])]
        names: Vec<String>,
    },
    /// A cluster node's certificate signed by the CA in DIR: DIR/NODE.pem and DIR/NODE-key.pem
    /// (cluster.tls.cert_file and key_file). Its Common Name is the node id; it names
    /// `aqueduct-mesh` (what peers verify) and each --name (what clients use); good for serving
    /// and for dialing.
    Peer {
        /// The node id (e.g. the pod name, aqueduct-0).
        node: String,
        /// Directory of the CA (made by `aqueduct cert ca`); the files are written there too.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A DNS name or IP address clients use to reach this node (repeat for more).
        #[arg(long = "name")]
        names: Vec<String>,
    },
    /// A client certificate signed by the CA in DIR, whose Common Name is the client id:
    /// DIR/NAME.pem and DIR/NAME-key.pem (--cert and --key).
    Client {
        /// The client id.
        name: String,
        /// Directory of the CA (made by `aqueduct cert ca`); the files are written there too.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Revoke certificates made by the CA in DIR: adds them to DIR/crl.pem (created if
    /// missing), a revocation list signed by the CA and valid one year. Brokers read it as
    /// tls.crl_file (client certificates) or cluster.tls.crl_file (peer certificates), at
    /// startup and on SIGHUP (which also closes the connections of the certificates revoked
    /// since). With no CERT, writes the list anew: an empty one to start
    /// with, or the same one renewed for a year.
    Revoke {
        /// The certificate files to revoke (e.g. DIR/alice.pem).
        #[arg(value_name = "CERT")]
        certs: Vec<PathBuf>,
        /// Directory of the CA (made by `aqueduct cert ca`); DIR/crl.pem is written there.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

/// The bench's `--overflow`: a policy, or `None` for the broker's own (`broker`).
#[derive(Debug, Clone, Copy)]
struct BenchOverflow(Option<OverflowPolicy>);

/// The bench's `--priority-mix`, checked as the command line is read (before connecting).
#[derive(Debug, Clone)]
struct PriorityMix(Vec<(Priority, u32)>);

fn priority_mix_arg(s: &str) -> Result<PriorityMix, String> {
    bench::parse_priority_mix(s).map(PriorityMix)
}

/// `aqueduct log`'s directory: the one given, else where the broker puts its log on its
/// defaults (AQUEDUCT_AAL_FILE_PATH, else $AQUEDUCT_HOME/aal, else ~/.aqueduct/aal).
fn log_dir(given: &Option<PathBuf>) -> Result<crate::log_cmd::LogDir> {
    let path = match given {
        Some(dir) => dir.clone(),
        None => {
            // Variables that are not UTF-8 are left out (an AQUEDUCT_* one stops the broker).
            let env: Vec<(String, String)> = std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect();
            let file_path = std::env::var("AQUEDUCT_AAL_FILE_PATH").unwrap_or_default();
            aqueduct_server::config::aal_dir(&file_path, &env).ok_or_else(|| {
                anyhow!(
                    "no log directory: give it as the command's DIR argument (AQUEDUCT_AAL_FILE_PATH {})",
                    aqueduct_server::config::NO_AAL_DIR
                )
            })?
        }
    };
    Ok(crate::log_cmd::LogDir {
        path,
        given: given.is_some(),
    })
}

fn parse_bench_overflow(s: &str) -> Result<BenchOverflow, String> {
    if s == "broker" {
        return Ok(BenchOverflow(None));
    }
    s.parse().map(|p| BenchOverflow(Some(p)))
}

/// `--rate`: 0 (closed loop), or a finite rate the open loop can pace (its interval between
/// batches must be a duration: a rate near 0 or infinite is not).
fn bench_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of messages per second"))?;
    if rate == 0.0 || (rate.is_finite() && (0.01..=1e9).contains(&rate)) {
        Ok(rate)
    } else {
        Err(format!(
            "{s} msg/s: give 0 (as fast as possible) or a rate from 0.01 to 1000000000"
        ))
    }
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

/// A duration above 0: `--duration 0` reported an empty run as a success, and `--idle 0` every
/// message as lost.
fn positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be more than 0".into()),
        d => Ok(d),
    }
}

/// A TTL: not 0, which reads as "no expiry" (0 on the wire) but was sent as 1 ms, so the
/// message expired at once and `pub` still said it was published; and no longer than the
/// protocol's TTL field holds (u32 milliseconds), which the client would shorten to that.
fn ttl_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(
            "a TTL of 0 would expire the message at once: leave --ttl out \
                                 for no expiry"
                .into(),
        ),
        d if d > Duration::from_millis(u64::from(u32::MAX)) => Err(format!(
            "the longest TTL a message can carry is {} ms (about 49.7 days): leave --ttl out \
             for no expiry",
            u32::MAX
        )),
        d => Ok(d),
    }
}

/// A duration as the options take it: a number (whole, or with a fractional part as in `1.5s`)
/// and a unit (`us`, `ms`, `s`, `m` or `h`; a bare number is seconds). Not the configuration's
/// parser (`aqueduct_server::config`, humantime), which takes neither a bare number nor a
/// fraction; both share its upper bound, `MAX_DURATION`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let not_a_duration = || format!("{s:?} is not a duration like 500ms, 1.5s or 10s");
    let too_long = || format!("{s:?} is too long (at most 100 years)");
    let nanos_per_unit: u64 = match unit {
        "us" => 1_000,
        "ms" => 1_000_000,
        // A bare number is seconds.
        "s" | "" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ if num.is_empty() => return Err(not_a_duration()),
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use us, ms, s, m or h)"
            ))
        }
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty()
        || !frac.bytes().all(|b| b.is_ascii_digit())
        || !whole.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(not_a_duration());
    }
    // Whole units exactly, in u128 nanoseconds: a u64 count times at most 3.6e12 cannot
    // overflow (a u128 count could).
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| too_long())?
    };
    let mut nanos = u128::from(whole) * u128::from(nanos_per_unit);
    // The fraction to the nanosecond; digits below it are dropped.
    let mut scale = u128::from(nanos_per_unit);
    for digit in frac.bytes() {
        scale /= 10;
        if scale == 0 {
            break;
        }
        nanos += u128::from(digit - b'0') * scale;
    }
    // A deadline `now + d` must not overflow the clock.
    if nanos > aqueduct_server::config::MAX_DURATION.as_nanos() {
        return Err(too_long());
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_long())?;
    // Below 1e9: fits.
    let sub = (nanos % 1_000_000_000) as u32;
    Ok(Duration::new(secs, sub))
}

fn parse_pin(hex: &str) -> Result<[u8; 32]> {
    let hex: String = hex.chars().filter(|c| *c != ':').collect();
    if !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!(
            "--pin is not hexadecimal (64 digits 0-9, a-f, optionally in pairs separated by ':')"
        );
    }
    if hex.len() != 64 {
        bail!(
            "--pin needs 64 hex digits (a SHA-256 fingerprint), got {}",
            hex.len()
        );
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte =
            u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).context("--pin is not hexadecimal")?;
    }
    Ok(out)
}

/// The broker address as given, with Go's ":4242" form (every interface, as the broker's own
/// `listen_addr` accepts it) read as this machine.
fn broker_addr(addr: &str) -> Result<String> {
    if let Some(port) = addr.strip_prefix(':') {
        if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
            return Ok(format!("localhost{addr}"));
        }
    }
    if addr.matches(':').count() > 1 && !addr.starts_with('[') {
        bail!("--addr {addr:?}: an IPv6 address goes in brackets before its port, e.g. [::1]:4242");
    }
    if !addr.contains(':') {
        bail!("--addr {addr:?} has no port: write it as HOST:PORT, e.g. {addr}:4242");
    }
    Ok(addr.to_string())
}

/// The connection settings the global flags describe.
fn connect_options(cli: &Cli) -> Result<ConnectOptions> {
    connect_options_to(cli, &cli.addr)
}

/// The global flags' trust and client certificate, for the broker at `addr`.
fn connect_options_to(cli: &Cli, addr: &str) -> Result<ConnectOptions> {
    let mut opts = ConnectOptions::new(broker_addr(addr)?);
    if let Some(name) = &cli.server_name {
        opts = opts.server_name(name);
    }
    if let Some(dev) = &cli.dev_cert {
        opts = opts.dev_cert_file(dev);
    }
    if let Some(ca) = &cli.ca {
        opts = opts.ca_file(ca);
    }
    if let Some(pin) = &cli.pin {
        opts = opts.pin_sha256(parse_pin(pin)?);
    }
    match (&cli.cert, &cli.key) {
        (Some(c), Some(k)) => opts = opts.client_cert(c, k),
        (None, None) => {}
        _ => bail!("--cert and --key go together"),
    }
    if cli.transport == TransportArg::Webtransport {
        if !cli.wt_path.starts_with('/') {
            bail!("--wt-path {:?} must start with '/'", cli.wt_path);
        }
        opts = opts.transport(aqueduct_client::Transport::WebTransport {
            path: cli.wt_path.clone(),
        });
    }
    Ok(opts)
}

/// `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TransportArg {
    Quic,
    Webtransport,
}

/// `aqueduct info`'s output: one line per thing the broker said, unknown ones as "not said".
fn info_text(info: &aqueduct_client::BrokerInfo) -> String {
    let said = |v: Option<String>| v.unwrap_or_else(|| "not said".into());
    let bytes = |v: Option<u32>| said(v.map(|n| format!("{n} bytes")));
    [
        format!("broker            {}", said(info.broker.clone())),
        format!(
            "protocol          {}",
            said(info.protocol.map(|v| v.to_string()))
        ),
        format!(
            "max frame in      {} (data_len of a frame to the broker: transport.max_buf_size)",
            bytes(info.max_data_len)
        ),
        format!(
            "max frame out     {} (data_len a client must accept from the broker)",
            bytes(info.max_delivery_data_len)
        ),
        format!(
            "subscriptions     {} per connection (transport.max_subscriptions_per_connection)",
            said(info.max_subscriptions.map(|v| v.to_string()))
        ),
        format!(
            "durable log       {}",
            said(info.durable.map(|on| if on {
                "on (aal.enabled: a CONFIRM means stored)".to_string()
            } else {
                "off (aal.enabled: false: a CONFIRM means routed, kept in memory only)".to_string()
            }))
        ),
    ]
    .join("\n")
}

async fn connect(cli: &Cli) -> Result<Client> {
    Client::connect(connect_options(cli)?)
        .await
        .map_err(|e| anyhow!(e))
}

/// `also`: set when closing failed too, for a different reason than the command's own error
/// (said after it).
async fn run(cli: Cli, also: &mut Option<String>) -> Result<()> {
    if let Command::Cert { what } = &cli.command {
        let written = match what {
            CertCommand::Ca { out, cn } => crate::cert::make_ca(out, cn.as_deref())?,
            CertCommand::Server { out, names } => crate::cert::make_server(out, names)?,
            CertCommand::Client { name, out } => crate::cert::make_client(out, name)?,
            CertCommand::Peer { node, out, names } => crate::cert::make_peer(out, node, names)?,
            CertCommand::Revoke { certs, out } => {
                let (crl, added) = crate::cert::revoke(out, certs)?;
                for name in added {
                    crate::print_line(&format!("revoked {name}"))?;
                }
                vec![crl]
            }
        };
        for path in written {
            crate::print_line(&format!("wrote {}", path.display()))?;
        }
        return Ok(());
    }
    if let Command::Admin {
        admin_addr,
        json,
        what,
    } = &cli.command
    {
        let target = crate::admin_cmd::AdminTarget {
            addr: broker_addr(admin_addr)?,
            opts: connect_options_to(&cli, admin_addr)?,
            json: *json,
        };
        return crate::admin_cmd::run(&target, what).await;
    }
    if let Command::Log { what } = &cli.command {
        return match what {
            LogCommand::Verify { dir, keys } => crate::log_cmd::verify(&log_dir(dir)?, keys),
            LogCommand::Rekey { dir, keys } => crate::log_cmd::rekey(&log_dir(dir)?, keys),
            LogCommand::Dump {
                dir,
                topic,
                from,
                count,
                keys,
            } => crate::log_cmd::dump(&log_dir(dir)?, topic.as_deref(), *from, *count, keys),
        };
    }
    if let Command::TraceSink {
        listen,
        print,
        spans,
    } = &cli.command
    {
        return crate::trace_sink::run(&crate::trace_sink::SinkOptions {
            listen: listen.clone(),
            print: *print,
            spans: *spans,
        })
        .await;
    }
    if let Command::Sub {
        max_in_flight: Some(_),
        ack: false,
        nack: false,
        group: None,
        durable: None,
        ..
    } = &cli.command
    {
        bail!(
            "--max-in-flight goes with --ack, --nack, --group or --durable: without \
             acknowledgements nothing is in flight"
        );
    }
    let client = connect(&cli).await?;
    let result = run_connected(&cli, &client).await;
    // On every way out, errors included (a refused publish, an ACL that closed the
    // subscription): close the connection, so that the broker forgets it now rather than at its
    // idle timeout (admin `clients` would list it, a group would keep feeding it). Closing
    // twice is harmless. The command's own error comes first; then the close's (a publish the
    // broker refused or may not have read).
    let closed = client.close().await;
    match (result, closed) {
        (Err(e), Err(closing)) => {
            // Both are worth knowing, the command's first — unless they are one failure seen
            // twice (a refused handshake fails the command and the close alike).
            let closing = closing.to_string();
            if !same_cause(&format!("{e:#}"), &closing) {
                *also = Some(closing);
            }
            Err(e)
        }
        (result, closed) => {
            result?;
            Ok(closed?)
        }
    }
}

/// What `aqueduct pub` publishes to, and how many it has published.
struct Outgoing<'a> {
    client: &'a Client,
    topic: &'a str,
    topics: u64,
    opts: &'a PublishOptions,
    sent: u64,
    name: String,
}

impl Outgoing<'_> {
    /// Publish one message: to the topic, or with --topics to the next of `topic/0..`.
    async fn publish(&mut self, body: Bytes) -> Result<()> {
        let to = if self.topics > 1 {
            self.name.clear();
            use std::fmt::Write;
            let _ = write!(self.name, "{}/{}", self.topic, self.sent % self.topics);
            self.name.as_str()
        } else {
            self.topic
        };
        let offset = self.client.publish_with(to, body, self.opts).await?;
        if let Some(o) = offset {
            crate::print_line(&format!("published to {to} at offset {o}"))?;
        }
        self.sent += 1;
        Ok(())
    }
}

/// The next line of standard input without its line end (`\n` or `\r\n`), any bytes; `None`
/// at its end.
async fn read_line(input: &mut (impl tokio::io::AsyncBufRead + Unpin)) -> Result<Option<Bytes>> {
    use tokio::io::AsyncBufReadExt;
    let mut line = Vec::new();
    if input
        .read_until(b'\n', &mut line)
        .await
        .context("reading standard input")?
        == 0
    {
        return Ok(None);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
    }
    Ok(Some(Bytes::from(line)))
}

/// Why a subscription's stream ended without an error frame: the connection's close reason
/// (a shutdown closes the connection within 5 s of ending its streams), or that the broker
/// ended it.
async fn why_the_subscription_ended(client: &Client) -> String {
    match tokio::time::timeout(Duration::from_secs(6), client.closed()).await {
        Ok(e) => e.to_string(),
        Err(_) => "the broker ended the subscription".to_string(),
    }
}

/// `aqueduct pub`'s messages: MESSAGE `count` times, or each line of standard input as it is
/// read (with `count` above 1, the lines read first, then sent `count` times), until `stop`
/// says which signal stopped it. Returns how many it was asked for, when that is known, and
/// the signal, if one stopped it.
async fn publish_input(
    out: &mut Outgoing<'_>,
    message: Option<&str>,
    count: u64,
    mut stop: tokio::sync::watch::Receiver<Option<&'static str>>,
) -> Result<(Option<u64>, Option<&'static str>)> {
    let bodies = match message {
        Some(m) => vec![Bytes::copy_from_slice(m.as_bytes())],
        None => {
            let mut lines = Vec::new();
            let mut input = tokio::io::BufReader::new(tokio::io::stdin());
            loop {
                // A line cut short by the signal (no line end read yet) is not sent.
                let line = tokio::select! {
                    biased;
                    signal = stop.wait_for(Option::is_some) => {
                        let signal = signal.ok().and_then(|s| *s);
                        // Streaming lines (count 1), a signal is the usual end. With a count,
                        // nothing was sent yet: stopped short of at least `count` messages,
                        // not a success.
                        let asked = (count > 1)
                            .then(|| count.saturating_mul(lines.len().max(1) as u64));
                        return Ok((asked, signal));
                    }
                    line = read_line(&mut input) => line?,
                };
                let Some(line) = line else { break };
                if count == 1 {
                    out.publish(line).await?;
                } else {
                    lines.push(line);
                }
            }
            if count == 1 {
                return Ok((None, None));
            }
            lines
        }
    };
    let asked = count.saturating_mul(bodies.len() as u64);
    for _ in 0..count {
        for body in &bodies {
            if let Some(signal) = *stop.borrow() {
                return Ok((Some(asked), Some(signal)));
            }
            out.publish(body.clone()).await?;
        }
    }
    Ok((Some(asked), None))
}

/// The commands that need a connection to the broker.
async fn run_connected(cli: &Cli, client: &Client) -> Result<()> {
    match &cli.command {
        Command::Pub {
            topic,
            message,
            count,
            priority,
            ttl,
            confirm,
            topics,
            trace,
            traceparent,
        } => {
            let trace = match (trace, traceparent) {
                (true, _) => Some(aqueduct_client::new_trace()),
                (false, t) => *t,
            };
            if let Some(t) = &trace {
                crate::say!("trace {}", t.to_traceparent());
            }
            let opts = PublishOptions {
                priority: Some(
                    Priority::new(*priority)
                        .ok_or_else(|| anyhow!("--priority must be 0 (highest) to 3 (lowest)"))?,
                ),
                ttl: *ttl,
                confirm: *confirm,
                trace,
            };
            let mut out = Outgoing {
                client,
                topic,
                topics: *topics,
                opts: &opts,
                sent: 0,
                name: String::new(),
            };
            // Ctrl-C/SIGTERM stops publishing between two messages; what was read is flushed
            // and the connection closed, as at the end of the input, and the summary says how
            // many went. Without it, `tail -f app.log | aqueduct pub logs` stopped with Ctrl-C
            // ended without closing, and the last lines it had read could be lost. A second one
            // while it still waits (a publish held by the broker's quota, the flush) ends the
            // process at once, as an unhandled one would.
            let (stopped, stop) = tokio::sync::watch::channel(None);
            let watcher = async move {
                let first = crate::shutdown_signal().await;
                let _ = stopped.send(Some(first));
                crate::shutdown_signal().await
            };
            let publishing = async {
                let (asked, interrupted) =
                    publish_input(&mut out, message.as_deref(), *count, stop).await?;
                let sent = out.sent;
                // Nothing counts as published until the broker has read it: a refused
                // handshake or a broker that stopped reading is an error here, not a success.
                client.flush().await?;
                client.close().await?;
                anyhow::Ok((sent, asked, interrupted))
            };
            let (sent, asked, interrupted) = tokio::select! {
                r = publishing => r?,
                again = watcher => {
                    crate::say!(
                        "aqueduct: {again} again: exiting without waiting for the broker (what \
                         was not yet flushed may be lost)"
                    );
                    std::process::exit(130)
                }
            };
            if !*confirm {
                if *topics > 1 {
                    crate::print_line(&format!(
                        "published {sent} message(s) to {topic}/0..{}",
                        topics - 1
                    ))?;
                } else {
                    crate::print_line(&format!("published {sent} message(s) to {topic}"))?;
                }
            }
            if let Some(signal) = interrupted {
                crate::say!("{signal}: stopped publishing and closed the connection");
                // Stopped short of what it was asked to send: not a success. Streaming lines
                // until interrupted is the usual way to end `tail -f … | aqueduct pub`.
                if let Some(asked) = asked.filter(|&a| sent < a) {
                    bail!("{signal} before {asked} message(s) were published: {sent} were");
                }
            }
        }
        Command::Sub {
            filter,
            group,
            ack,
            nack,
            max_in_flight,
            work,
            count,
            overflow,
            durable,
            from,
        } => {
            let opts = SubscribeOptions {
                group: group.clone(),
                durable: durable.as_ref().map(|id| (id.clone(), *from)),
                ack: *ack || *nack || group.is_some() || durable.is_some(),
                overflow: *overflow,
                max_in_flight: *max_in_flight,
            };
            let mut sub = client.subscribe_with(filter, &opts).await?;
            // One listener for the whole loop, polled first: a Ctrl-C that arrives while a
            // message is being handled (or --work sleeps) is not lost; the current message is
            // finished, then the connection closes. Made before it says it is subscribed, so a
            // signal sent once that is said is never the default one (that ends the process
            // without closing the connection).
            let signal = crate::shutdown_signal();
            tokio::pin!(signal);
            crate::say!(
                "subscribed to {filter}{}{}",
                group
                    .as_ref()
                    .map(|g| format!(" (group {g})"))
                    .unwrap_or_default(),
                durable
                    .as_ref()
                    .map(|d| match sub.durable_log() {
                        Some(true) => format!(" (durable consumer {d}, from the broker's log)"),
                        Some(false) => format!(
                            " (durable consumer {d}, in memory only: the broker runs without its \
                             durable log, aal.enabled, so nothing is replayed and the position \
                             is not kept across restarts)"
                        ),
                        None => format!(" (durable consumer {d})"),
                    })
                    .unwrap_or_default()
            );
            let mut received = 0u64;
            // Printed, whether or not handled since (settled, or counted without --ack).
            let mut printed = 0u64;
            // Set when the broker ended the subscription before --count (or at all without
            // it): the command fails, saying why, rather than exit as if it were done.
            let mut ended = None;
            let interrupted = loop {
                let item = tokio::select! {
                    biased;
                    signal = &mut signal => break Some(signal),
                    item = sub.next() => item,
                };
                let Some(item) = item else {
                    ended = Some(why_the_subscription_ended(client).await);
                    break None;
                };
                let msg = item?;
                if !crate::print_line(&describe(&msg))? {
                    // Our reader went away: this message is not settled (a group gives it to
                    // another member), and the connection closes cleanly.
                    break Some("standard output closed");
                }
                printed += 1;
                if let Some(work) = work {
                    tokio::select! {
                        _ = tokio::time::sleep(*work) => {}
                        // Interrupted while "working": this message is not settled (a group
                        // gives it to another member).
                        signal = &mut signal => break Some(signal),
                    }
                }
                if *nack {
                    msg.nack(Some("rejected by aqueduct sub --nack")).await?;
                } else if opts.ack {
                    msg.ack().await?;
                }
                received += 1;
                if count.is_some_and(|c| received >= c) {
                    break None;
                }
            };
            // Close cleanly, so that the broker ends the subscription at once (a group member
            // leaves its group; its unacknowledged messages go to the other members) instead of
            // waiting for the idle timeout — after it has read our last ACKs (a durable
            // consumer's position counts them).
            let from_log = sub.durable_log() == Some(true);
            // An ACK the broker refused meanwhile (too late: the ack wait ran out, and the
            // message goes to another member) is an error, not a clean end.
            let settled = match ended {
                Some(_) => Ok(()),
                None => sub.close().await,
            };
            if let (Some(why), None) = (&ended, interrupted) {
                return Err(anyhow!("{why}, after {received} message(s)"));
            }
            client.close().await?;
            if let Some(signal) = interrupted {
                // What becomes of the message it was working on depends on the subscription.
                let last = if printed <= received {
                    String::new()
                } else if !opts.ack {
                    " handled; it stopped while working on the last one printed".into()
                } else if let (Some(d), true) = (durable, from_log) {
                    format!(
                        " handled; the last one printed was not acknowledged: it comes again \
                         when durable consumer {d} resumes"
                    )
                } else if opts.group.is_some() || durable.is_some() {
                    " handled; the last one printed was not acknowledged: it goes to another \
                     member of the group, if there is one"
                        .into()
                } else {
                    " handled; the last one printed was not acknowledged, and a plain \
                     subscription's messages are not delivered again"
                        .into()
                };
                crate::say!("{signal}: closed the connection after {received} message(s){last}");
                // Stopped short of the --count asked for: not a success (`timeout 5 aqueduct sub
                // t --count 1 && …` must not go on as if the message had come).
                if let Some(c) = count.filter(|&c| received < c) {
                    settled?;
                    bail!("{signal} before {c} message(s) arrived: {received} did");
                }
            }
            return Ok(settled?);
        }
        // Handled above, before connecting.
        Command::Cert { .. }
        | Command::Log { .. }
        | Command::Admin { .. }
        | Command::TraceSink { .. } => {}
        Command::BenchDurable {
            messages,
            payload_size,
            topic,
            json,
            mode,
        } => {
            let mode = match mode {
                DurableBenchMode::Publish { batch, window } => {
                    crate::durable_bench::Mode::Publish {
                        batch: (*batch).max(1),
                        window: *window,
                    }
                }
                DurableBenchMode::Replay { consumer } => crate::durable_bench::Mode::Replay {
                    consumer: consumer.clone(),
                },
            };
            // Without the log a confirmed publish measures routing only, and a replay has
            // nothing to read: said at once rather than reported as the log's figure. (A broker
            // before INFO, or before its DURABLE entry, is taken at its word.)
            if client.info().await.ok().and_then(|i| i.durable) == Some(false) {
                bail!(
                    "the broker at {} has no durable log (aal.enabled is false), and \
                     bench-durable measures the log: start the broker with \
                     AQUEDUCT_AAL_ENABLED=true (see docs/howto-log.md)",
                    client.remote_address()
                );
            }
            let progress = (!*json && std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .then(|| indicatif::ProgressBar::new(*messages));
            // Ctrl-C/SIGTERM ends it; the connection is closed on the way out (it died with
            // the signal, leaving the connection to the broker's idle timeout).
            let stop = crate::shutdown_signal();
            let running = crate::durable_bench::run(
                client.clone(),
                mode,
                topic,
                *messages,
                *payload_size,
                progress,
            );
            let report = tokio::select! {
                report = running => report?,
                signal = stop => bail!("{signal}: the durable bench was stopped before its end"),
            };
            if *json {
                crate::print_line(&report.json().to_string())?;
            } else {
                crate::print_line(&report.text())?;
            }
            return Ok(());
        }
        Command::Info { json } => {
            let info = client.info().await.map_err(|e| match e {
                aqueduct_client::ClientError::Broker { code, .. }
                    if code == aqueduct_client::ErrorCode::UNKNOWN_OPCODE =>
                {
                    anyhow!(
                        "the broker at {} does not know INFO (a version before it): its limits \
                         are the defaults of docs/protocol.md §10 unless its configuration says \
                         otherwise",
                        client.remote_address()
                    )
                }
                e => anyhow!(e),
            })?;
            let text = if *json {
                serde_json::json!({
                    "broker": info.broker,
                    "protocol": info.protocol,
                    "max_data_len": info.max_data_len,
                    "max_delivery_data_len": info.max_delivery_data_len,
                    "max_subscriptions": info.max_subscriptions,
                    "durable": info.durable,
                })
                .to_string()
            } else {
                info_text(&info)
            };
            crate::print_line(&text)?;
            return Ok(());
        }
        Command::Hold {
            connections,
            subscriptions,
            per_stream,
            seconds,
        } => {
            let opts = connect_options(cli)?;
            let mut held = Vec::new();
            for i in 0..*connections {
                let c = Client::connect(opts.clone()).await?;
                let mut subs = Vec::new();
                let filters: Vec<String> = (0..*subscriptions)
                    .map(|j| format!("hold/{i}/{j}"))
                    .collect();
                for chunk in filters.chunks(*per_stream as usize) {
                    let chunk: Vec<&str> = chunk.iter().map(String::as_str).collect();
                    subs.push(
                        c.subscribe_many(&chunk, &SubscribeOptions::default())
                            .await?,
                    );
                }
                held.push((c, subs));
            }
            crate::say!(
                "holding {} connection(s) with {} subscription(s) each",
                held.len(),
                subscriptions
            );
            // Ctrl-C/SIGTERM ends the hold early; either way the connections are closed (they
            // were left to the broker's idle timeout). Listening before "ready" is said.
            let stop = crate::shutdown_signal();
            crate::print_line("ready")?;
            tokio::select! {
                () = tokio::time::sleep(*seconds) => {}
                signal = stop => {
                    crate::say!("{signal}: closing the held connections");
                }
            }
            futures_util::future::join_all(held.into_iter().map(|(c, subs)| async move {
                drop(subs);
                let _ = c.close().await;
            }))
            .await;
        }
        Command::Bench {
            messages,
            duration,
            payload_size,
            publishers,
            streams,
            subscribers,
            group,
            overflow,
            batch,
            rate,
            priority_mix,
            topic,
            idle,
            metrics_addr,
            sub_addr,
            sub_dev_cert,
            probe_timeout,
            trace,
            warmup,
            latency_trace,
            json,
        } => {
            use std::io::IsTerminal;
            let cfg = BenchConfig {
                publishers: *publishers,
                streams: *streams,
                subscribers: *subscribers,
                group: *group,
                overflow: overflow.0,
                messages: *messages,
                duration: *duration,
                payload_size: *payload_size,
                batch: *batch,
                rate: *rate,
                priority_mix: priority_mix.0.clone(),
                idle: *idle,
                topic: topic
                    .clone()
                    .unwrap_or_else(|| format!("bench/{}", std::process::id())),
                progress: !*json && std::io::stderr().is_terminal(),
                sub_addr: sub_addr.clone(),
                probe: sub_addr.is_some(),
                probe_timeout: *probe_timeout,
                trace: *trace,
                warmup: *warmup,
                latency_trace: latency_trace.is_some(),
                stop: Default::default(),
            };
            let planned = match (duration, *rate > 0.0) {
                (Some(d), true) => Some((rate * d.as_secs_f64()).round() as u64),
                (Some(_), false) => None,
                (None, _) => Some(*messages),
            };
            if let Some(planned) = planned.filter(|n| *warmup > 0 && warmup >= n) {
                bail!("--warmup {warmup} leaves no message to time: the run sends {planned}");
            }
            let opts = connect_options(cli)?;
            let sub_opts = match sub_addr {
                Some(addr) => {
                    let o = connect_options_to(cli, addr)?;
                    match sub_dev_cert {
                        Some(dev) => o.dev_cert_file(dev),
                        None => o,
                    }
                }
                None => opts.clone(),
            };
            // Ctrl-C/SIGTERM ends publishing; the run waits for what was sent, reports it and
            // closes its connections, then fails (the planned run was not made). A second one
            // exits at once. It died with the signal, without a word or a close.
            let stop = cfg.stop.clone();
            let (stopped_by, signalled) = tokio::sync::watch::channel(None);
            let watcher = async move {
                let first = crate::shutdown_signal().await;
                stop.store(true, std::sync::atomic::Ordering::Release);
                let _ = stopped_by.send(Some(first));
                crate::say!(
                    "aqueduct: {first}: the bench stops publishing and reports what was sent \
                     ({first} again to exit at once)"
                );
                crate::shutdown_signal().await
            };
            let running = bench::run_split(
                cfg.clone(),
                || Client::connect(opts.clone()),
                || Client::connect(sub_opts.clone()),
            );
            let report = tokio::select! {
                report = running => report?,
                again = watcher => {
                    crate::say!("aqueduct: {again} again: exiting without a report");
                    std::process::exit(130)
                }
            };
            let interrupted = *signalled.borrow();
            if *json {
                crate::print_line(&report.json().to_string())?;
            } else {
                crate::print_line(report.text().trim_end_matches('\n'))?;
            }
            // After the report: a trace that cannot be written does not lose the run's figures.
            if let Some(path) = latency_trace {
                bench::write_trace(path, &report.trace)
                    .with_context(|| format!("--latency-trace: writing {}", path.display()))?;
            }
            if report.lost > 0 || report.duplicates > 0 {
                let addr = metrics_addr
                    .clone()
                    .unwrap_or_else(|| "127.0.0.1:9090".to_string());
                let why = bench::explain_losses(&addr, &cfg.topic).await;
                bail!(
                    "not a successful run: {} lost, {} duplicated; {why}",
                    report.lost,
                    report.duplicates
                );
            }
            if let Some(signal) = interrupted {
                bail!(
                    "{signal}: the bench was stopped early; the figures above cover the {} \
                     message(s) sent",
                    report.sent
                );
            }
            if *warmup > 0 && report.latency.is_empty() {
                bail!(
                    "no latency was measured: all {} message(s) sent were within --warmup {warmup}",
                    report.sent
                );
            }
        }
    }
    Ok(())
}

/// One line per message: topic, offset, priority, attempt, where a dead letter came from, body.
fn describe(msg: &aqueduct_client::Message) -> String {
    let ext = msg.extensions();
    let mut line = format!(
        "{} #{} p{}",
        msg.topic(),
        msg.offset(),
        msg.priority().level()
    );
    if msg.attempt() > 1 {
        line.push_str(&format!(" (attempt {})", msg.attempt()));
    }
    if let Some(original) = &ext.original_topic {
        let origin = crate::dead_letter_origin(
            original.as_str(),
            ext.original_offset,
            ext.attempts_made,
            ext.reason.as_deref(),
        );
        line.push_str(&format!(" ({origin})"));
    }
    if let Some(t) = msg.trace() {
        line.push_str(&format!(" (trace {})", t.to_traceparent()));
    }
    line.push_str(": ");
    line.push_str(&String::from_utf8_lossy(msg.body()));
    line
}

fn parse_traceparent(s: &str) -> Result<aqueduct_client::TraceContext, String> {
    aqueduct_client::TraceContext::from_traceparent(s)
}

/// The options that say how to reach a broker (global, so that they may stand before or after
/// the command), by argument id and flag.
const CONNECTION_FLAGS: [(&str, &str); 9] = [
    ("addr", "--addr"),
    ("ca", "--ca"),
    ("pin", "--pin"),
    ("server_name", "--server-name"),
    ("cert", "--cert"),
    ("key", "--key"),
    ("dev_cert", "--dev-cert"),
    ("transport", "--transport"),
    ("wt_path", "--wt-path"),
];

/// The connection options a command does not use, with what it says to whoever gives one: the
/// commands that need no broker use none of them; `admin` reaches the admin API (--admin-addr,
/// gRPC over TLS) and uses only the TLS options.
struct UnusedConnectionFlags {
    command: &'static str,
    unused: Unused,
    why: &'static str,
}

enum Unused {
    /// Every connection option: the command connects to nothing.
    All,
    /// These, by argument id ([`CONNECTION_FLAGS`]'s ids).
    Only(&'static [&'static str]),
}

impl UnusedConnectionFlags {
    fn contains(&self, id: &str) -> bool {
        match self.unused {
            Unused::All => true,
            Unused::Only(ids) => ids.contains(&id),
        }
    }

    /// The (id, flag) pairs of the options it does not use.
    fn flags(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        CONNECTION_FLAGS
            .into_iter()
            .filter(|(id, _)| self.contains(id))
    }
}

const UNUSED_CONNECTION_FLAGS: [UnusedConnectionFlags; 4] = [
    UnusedConnectionFlags {
        command: "cert",
        unused: Unused::All,
        why: "the CA is the --out directory's ca.pem and ca-key.pem (made by `aqueduct cert ca`)",
    },
    UnusedConnectionFlags {
        command: "log",
        unused: Unused::All,
        why: "it reads the log directory offline; the log's key is --key-file (or AQUEDUCT_AAL_KEY)",
    },
    UnusedConnectionFlags {
        command: "trace-sink",
        unused: Unused::All,
        why: "it only listens (--listen)",
    },
    UnusedConnectionFlags {
        command: "admin",
        unused: Unused::Only(&["addr", "transport", "wt_path"]),
        why: "it calls the admin API at --admin-addr (the broker's admin.listen_addr) over gRPC with TLS",
    },
];

fn unused_connection_flags(command: &str) -> Option<&'static UnusedConnectionFlags> {
    UNUSED_CONNECTION_FLAGS
        .iter()
        .find(|u| u.command == command)
}

/// A command refuses the connection options it does not use when they are given on its command
/// line: ignored, they would mislead (`cert server --ca other/ca.pem` would sign with the --out
/// directory's CA all the same; `log dump --key aal.key` is the TLS client key, not the log's;
/// `admin --addr` is the broker's client address, not the admin API's). From the environment
/// (AQUEDUCT_ADDR) they are not a mistake.
fn refuse_connection_flags(matches: &clap::ArgMatches) -> Result<()> {
    let Some(unused) = matches.subcommand_name().and_then(unused_connection_flags) else {
        return Ok(());
    };
    let given: Vec<(&str, &str)> = unused
        .flags()
        .filter(|(id, _)| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        .collect();
    if given.is_empty() {
        return Ok(());
    }
    // Named with its short form too (`-a` is `--addr`): clap does not say which one was typed.
    let command = Cli::command();
    let given: Vec<String> = given
        .into_iter()
        .map(|(id, flag)| {
            match command
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(clap::Arg::get_short)
            {
                Some(short) => format!("{flag} (-{short})"),
                None => flag.to_owned(),
            }
        })
        .collect();
    let needs_no_broker = match unused.unused {
        Unused::All => " needs no broker and",
        Unused::Only(_) => "",
    };
    bail!(
        "`aqueduct {}`{needs_no_broker} does not use {}: {}",
        unused.command,
        given.join(", "),
        unused.why
    )
}

/// The command line, with each command's help listing only the connection options it uses (they
/// are global, so clap would list all of them under every command).
fn cli_command() -> clap::Command {
    fn hide(cmd: clap::Command, ids: &[&str]) -> clap::Command {
        // In place (`mut_arg` would reorder the arguments of a built command, whose index of
        // flags then points at the wrong ones); `build` gave every level its copies.
        let cmd = cmd.mut_args(|a| {
            if ids.iter().any(|id| a.get_id() == id) {
                a.hide(true)
            } else {
                a
            }
        });
        let subcommands: Vec<String> = cmd
            .get_subcommands()
            .map(|sc| sc.get_name().to_owned())
            .collect();
        subcommands.iter().fold(cmd, |cmd, name| {
            cmd.mut_subcommand(name, |sc| hide(sc, ids))
        })
    }
    let mut cmd = Cli::command();
    // Propagates the global options into every subcommand, where they can then be hidden.
    cmd.build();
    for unused in &UNUSED_CONNECTION_FLAGS {
        let ids: Vec<&str> = unused.flags().map(|(id, _)| id).collect();
        cmd = cmd.mut_subcommand(unused.command, |sc| hide(sc, &ids));
    }
    cmd
}

/// The commands the command line names, from the top (`[aqueduct, log, verify]`: the first word
/// that names a subcommand at each level), and how many subcommands come before `typed`, the
/// unknown option (the level clap found it at). clap's own parse, with errors ignored, stops at
/// that level. Used only to pick a suggestion.
fn command_chain<'c>(
    command: &'c clap::Command,
    args: &[OsString],
    typed: &str,
) -> (Vec<&'c clap::Command>, usize) {
    let mut chain = vec![command];
    let mut level = None;
    for arg in args.iter().skip(1).filter_map(|a| a.to_str()) {
        if level.is_none() && (arg == typed || arg.starts_with(&format!("{typed}="))) {
            level = Some(chain.len() - 1);
        }
        if let Some(sub) = chain[chain.len() - 1].find_subcommand(arg) {
            chain.push(sub);
        }
    }
    let level = level.unwrap_or(chain.len() - 1);
    (chain, level)
}

/// The visible long option nearest to `typed` (clap's measure and threshold: Jaro similarity
/// above 0.7) among those of the commands in `levels` (each with the words that lead to it from
/// where `typed` was given), except `refused`: `--key-file`, or `verify --key-file` for an
/// option of a subcommand named later on the line.
fn nearest_visible_option(
    levels: &[(String, &clap::Command)],
    typed: &str,
    refused: &[&str],
) -> Option<String> {
    let typed = typed.trim_start_matches('-');
    let typed = typed.split('=').next().unwrap_or(typed);
    let mut best: Option<(f64, String)> = None;
    for (prefix, cmd) in levels {
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            let Some(long) = arg.get_long() else { continue };
            if refused.contains(&format!("--{long}").as_str()) {
                continue;
            }
            let score = strsim::jaro(typed, long);
            if score > 0.7 && best.as_ref().is_none_or(|(b, _)| score > *b) {
                best = Some((score, format!("{prefix}--{long}")));
            }
        }
    }
    best.map(|(_, suggestion)| suggestion)
}

/// clap suggests the nearest option for a misspelt one, hidden or not: `aqueduct admin --adr`
/// got "a similar argument exists: '--addr'", which `admin` then refuses, and `log verify --ke`
/// got `--key` (the TLS key, refused there) rather than `--key-file`. When clap's suggestion is
/// a connection option the command does not use, the error is made again with the nearest
/// option the command does use as the suggestion, or none; otherwise `None` (clap's error
/// stands).
fn without_hidden_suggestion(
    command: &clap::Command,
    args: &[OsString],
    error: &clap::Error,
) -> Option<clap::Error> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if error.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let suggested: Vec<&str> = match error.get(ContextKind::SuggestedArg)? {
        ContextValue::String(s) => vec![s.as_str()],
        ContextValue::Strings(v) => v.iter().map(String::as_str).collect(),
        _ => return None,
    };
    let ContextValue::String(typed) = error.get(ContextKind::InvalidArg)? else {
        return None;
    };
    let (chain, level) = command_chain(command, args, typed);
    let unused = unused_connection_flags(chain.get(1)?.get_name())?;
    let refused: Vec<&str> = unused.flags().map(|(_, flag)| flag).collect();
    if !suggested.iter().any(|s| refused.contains(s)) {
        return None;
    }
    // The commands from the level the option was given at down to the last one named, each
    // with the words that lead to it from there.
    let mut prefix = String::new();
    let levels: Vec<(String, &clap::Command)> = chain[level..]
        .iter()
        .enumerate()
        .map(|(i, cmd)| {
            if i > 0 {
                prefix.push_str(cmd.get_name());
                prefix.push(' ');
            }
            (prefix.clone(), *cmd)
        })
        .collect();
    let mut rebuilt = clap::Error::new(ErrorKind::UnknownArgument).with_cmd(command);
    for (kind, value) in error.context() {
        if !matches!(kind, ContextKind::SuggestedArg | ContextKind::Suggested) {
            rebuilt.insert(kind, value.clone());
        }
    }
    if let Some(better) = nearest_visible_option(&levels, typed, &refused) {
        rebuilt.insert(ContextKind::SuggestedArg, ContextValue::String(better));
    }
    Some(rebuilt)
}

/// Run the `aqueduct` command line with these arguments (the first is the program name).
/// Go-style single-dash long flags (`-addr`) are accepted as the seed's tools wrote them.
pub fn main_with(args: Vec<OsString>) -> ExitCode {
    let command = cli_command();
    let args = crate::go_style_args(args, &command);
    let matches = match command.clone().try_get_matches_from(args.clone()) {
        Ok(matches) => matches,
        Err(e) => without_hidden_suggestion(&command, &args, &e)
            .unwrap_or(e)
            .exit(),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Err(e) = refuse_connection_flags(&matches) {
        crate::say!("aqueduct: {e:#}");
        return ExitCode::from(2);
    }
    // AQUEDUCT_LOG is the broker's too: one it cannot read is said, not dropped unsaid; the
    // command still runs, logging warnings.
    let filter = match std::env::var("AQUEDUCT_LOG") {
        Ok(spec) => crate::log_filter(&spec).unwrap_or_else(|e| {
            crate::say!("aqueduct: AQUEDUCT_LOG {spec:?} ignored: {e}");
            "warn".into()
        }),
        Err(_) => "warn".into(),
    };
    crate::init_logging(filter);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            crate::say!("aqueduct: {e}");
            return ExitCode::FAILURE;
        }
    };
    let without_cert = cli.cert.is_none();
    let mut also = None;
    let result = runtime.block_on(run(cli, &mut also));
    // Without waiting for blocking threads: `pub` stopped by a signal leaves one blocked
    // reading standard input (from a terminal or `tail -f`), which dropping the runtime would
    // wait for until the next line. Everything the command does is done by now.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let e = format!("{e:#}");
            // The client library's words; how to give a certificate is the CLI's to say.
            let hint = if without_cert && e.contains("requires a client certificate") {
                ": pass --cert and --key"
            } else {
                ""
            };
            crate::say!("aqueduct: {e}{hint}");
            if let Some(closing) = also {
                crate::say!("aqueduct: also, while closing: {closing}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Whether the close's error `closing` is the command's error `command` seen again: one
/// failure reported by both calls, the close's with a preface of its own ("the broker may not
/// have read everything published: ..."). Not for an empty text.
fn same_cause(command: &str, closing: &str) -> bool {
    const LOST: &str = "connection lost: ";
    let command = command.strip_prefix(LOST).unwrap_or(command).trim();
    let closing = closing.strip_prefix(LOST).unwrap_or(closing).trim();
    !command.is_empty() && closing.ends_with(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused handshake fails the command and its close alike: said once, not twice with
    /// the close's first (a new user's reading of howto-tls); different causes are both said.
    /// A --pin of the right length in bytes but not all hex digits is an error, not a panic
    /// (slicing a multi-byte character).
    #[test]
    fn a_pin_that_is_not_hexadecimal_is_refused() {
        let not_ascii = format!("a\u{e9}{}", "a".repeat(61));
        assert_eq!(not_ascii.len(), 64);
        assert!(parse_pin(&not_ascii).is_err());
        assert!(parse_pin(&format!("+{}", "a".repeat(63))).is_err());
        assert_eq!(parse_pin(&"ab".repeat(32)).expect("hex"), [0xab; 32]);
        let colons = vec!["AB"; 32].join(":");
        assert_eq!(parse_pin(&colons).expect("pairs"), [0xab; 32]);
    }

    #[test]
    fn one_failure_seen_twice_is_said_once() {
        assert!(same_cause(
            "connection lost: the broker requires a client certificate (one signed by a CA in its tls.client_ca_file)",
            "connection lost: the broker may not have read everything published: the broker requires a client certificate (one signed by a CA in its tls.client_ca_file)"
        ));
        assert!(!same_cause(
            "broker error NOT_AUTHORIZED(400): refused by the ACL",
            "connection lost: timed out"
        ));
        // Two refusals with empty reasons are not one because their (empty) ends agree.
        assert!(!same_cause(
            "broker error NOT_AUTHORIZED(400): ",
            "broker error RATE_LIMITED(301): "
        ));
        assert!(!same_cause("", "connection lost: "));
    }

    /// The lists of unused connection options name real options, and "all" is all of them.
    #[test]
    fn unused_connection_options_are_connection_options() {
        let ids: Vec<&str> = CONNECTION_FLAGS.iter().map(|(id, _)| *id).collect();
        let command = Cli::command();
        // Every global option of the top level is a connection option (a new one must be added
        // to CONNECTION_FLAGS, or it would stay visible, and accepted, where it does nothing).
        let globals: Vec<&str> = command
            .get_arguments()
            .filter(|a| a.is_global_set())
            .map(|a| a.get_id().as_str())
            .collect();
        assert_eq!(globals, ids);
        for unused in &UNUSED_CONNECTION_FLAGS {
            if let Unused::Only(only) = unused.unused {
                assert!(only.iter().all(|id| ids.contains(id)), "{}", unused.command);
            }
            assert!(
                command.find_subcommand(unused.command).is_some(),
                "{}",
                unused.command
            );
        }
        for (id, flag) in CONNECTION_FLAGS {
            let arg = command.get_arguments().find(|a| a.get_id() == id);
            assert_eq!(
                arg.and_then(|a| a.get_long()).map(|l| format!("--{l}")),
                Some(flag.to_string())
            );
        }
    }

    /// Go's ":4242" is this machine; an IPv6 address without brackets is told how to write it,
    /// not turned into "localhost::1:4242".
    #[test]
    fn broker_addresses_in_go_form_and_ipv6_without_brackets() {
        assert_eq!(broker_addr(":4242").expect("go form"), "localhost:4242");
        assert_eq!(broker_addr("[::1]:4242").expect("ipv6"), "[::1]:4242");
        assert_eq!(
            broker_addr("127.0.0.1:4242").expect("ipv4"),
            "127.0.0.1:4242"
        );
        for bare in ["::1:4242", "::1", "fe80::1:4242"] {
            let e = broker_addr(bare).expect_err(bare).to_string();
            assert!(e.contains("[::1]:4242") && e.contains("brackets"), "{e}");
        }
        assert!(broker_addr("localhost").is_err_and(|e| e.to_string().contains("no port")));
    }

    #[test]
    fn durations_with_and_without_a_unit_and_never_an_overflow() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        // Multiplied out, these overflowed (a panic in a debug build).
        assert!(parse_duration("18446744073709551615h").is_err_and(|e| e.contains("too long")));
        assert!(parse_duration("18446744073709551615m").is_err());
        // Not multiplied, but still past any clock's range as a deadline.
        assert!(parse_duration("18446744073709551615s").is_err_and(|e| e.contains("too long")));
        assert!(parse_duration("18446744073709551615ms").is_err());
        // 2^115 + 1 hours overflowed u128 nanoseconds (a panic, or a wrap to 1 h in release).
        assert!(parse_duration("41538374868278621028243970633760769h")
            .is_err_and(|e| e.contains("too long")));
        assert!(parse_duration("18446744073709551615").is_err());
        assert!(parse_duration("5d").is_err_and(|e| e.contains("unknown unit")));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(".5m"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2.5ms"), Ok(Duration::from_micros(2500)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("1.0000000001s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        for bad in [".", "1.2.3s", "1.s.", "ms", "", "-1s", "1e3s", "1,5s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was taken");
        }
        assert!(parse_duration("soon").is_err());
        // A TTL of 0 is refused (it read as none and expired the message at once).
        assert!(ttl_duration("0").is_err_and(|e| e.contains("leave --ttl out")));
        assert!(ttl_duration("0ms").is_err());
        assert_eq!(ttl_duration("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(
            ttl_duration("4294967295ms"),
            Ok(Duration::from_millis(u64::from(u32::MAX)))
        );
        assert!(ttl_duration("4294967296ms").is_err_and(|e| e.contains("49.7 days")));
        assert!(ttl_duration("2000h").is_err_and(|e| e.contains("leave --ttl out")));
    }
}
