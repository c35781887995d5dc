//! `aqueduct`: command-line client for the Aqueduct broker.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use aqueduct_client::{
    Client, ConnectOptions, OverflowPolicy, Priority, PublishOptions, SubscribeOptions,
};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use futures_util::StreamExt;

/// Publish and subscribe to an Aqueduct broker.
///
/// On localhost the broker's generated development certificate (~/.aqueduct/dev-cert.pem) is
/// trusted automatically. For any other host pass --ca (a CA certificate) or --pin (the SHA-256
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
    /// Accept only the broker certificate with this SHA-256 fingerprint (64 hex digits).
    #[arg(long, global = true, value_name = "HEX")]
    pin: Option<String>,
    /// Name to verify in the broker's certificate (default: the host of --addr).
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish a message (or, without MESSAGE, one message per line of standard input).
    Pub {
        /// Topic, e.g. orders/eu.
        topic: String,
        /// Message body.
        message: Option<String>,
        /// Publish the message this many times.
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u64,
        /// Priority: 0 (highest) to 3 (lowest).
        #[arg(long, short = 'p', default_value_t = 2)]
        priority: u8,
        /// Time to live, e.g. 500ms, 10s.
        #[arg(long, value_parser = humantime_duration)]
        ttl: Option<Duration>,
        /// Wait for the broker to confirm and print the offsets.
        #[arg(long)]
        confirm: bool,
    },
    /// Subscribe and print each message with its topic, offset and priority.
    Sub {
        /// Topic filter, e.g. orders/+ or sensors/#.
        filter: String,
        /// Join this consumer group (each message goes to one member).
        #[arg(long, short = 'g')]
        group: Option<String>,
        /// Acknowledge each message after printing it (explicit-ack mode).
        #[arg(long)]
        ack: bool,
        /// Exit after this many messages.
        #[arg(long, short = 'n')]
        count: Option<u64>,
        /// Backpressure policy for this subscription: drop_oldest, drop_newest, disconnect.
        #[arg(long)]
        overflow: Option<OverflowPolicy>,
    },
    /// Measure throughput: one publisher sends MESSAGES messages in batches to SUBSCRIBERS
    /// subscribers on a fresh topic; reports publish and delivered rates and losses.
    Bench {
        /// Messages to publish.
        #[arg(long, default_value_t = 1_000_000)]
        messages: u64,
        /// Payload bytes per message.
        #[arg(long, default_value_t = 128)]
        payload_size: usize,
        /// Messages per PUBLISH_BATCH frame (1 = single PUBLISH frames).
        #[arg(long, default_value_t = 100)]
        batch: usize,
        /// Subscribers (each on its own connection).
        #[arg(long, default_value_t = 1)]
        subscribers: usize,
        /// Give up waiting for deliveries after this long without progress.
        #[arg(long, default_value = "5s", value_parser = humantime_duration)]
        idle: Duration,
    },
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 500ms or 10s"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    }
}

fn parse_pin(hex: &str) -> Result<[u8; 32]> {
    let hex: String = hex.chars().filter(|c| *c != ':').collect();
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

async fn connect(cli: &Cli) -> Result<Client> {
    let mut opts = ConnectOptions::new(cli.addr.clone());
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
    Client::connect(opts).await.map_err(|e| anyhow!(e))
}

async fn run(cli: Cli) -> Result<()> {
    let client = connect(&cli).await?;
    match &cli.command {
        Command::Pub {
            topic,
            message,
            count,
            priority,
            ttl,
            confirm,
        } => {
            let opts = PublishOptions {
                priority: Some(
                    Priority::new(*priority).ok_or_else(|| anyhow!("--priority must be 0..=3"))?,
                ),
                ttl: *ttl,
                confirm: *confirm,
            };
            let bodies: Vec<Bytes> = match message {
                Some(m) => vec![Bytes::from(m.clone())],
                None => std::io::stdin()
                    .lock()
                    .lines()
                    .map(|l| l.map(Bytes::from))
                    .collect::<Result<_, _>>()
                    .context("reading standard input")?,
            };
            let mut sent = 0u64;
            for _ in 0..*count {
                for body in &bodies {
                    let offset = client.publish_with(topic, body.clone(), &opts).await?;
                    if let Some(o) = offset {
                        println!("published to {topic} at offset {o}");
                    }
                    sent += 1;
                }
            }
            // Closing waits until the broker has read every publish.
            client.close().await;
            if !*confirm {
                println!("published {sent} message(s) to {topic}");
            }
        }
        Command::Sub {
            filter,
            group,
            ack,
            count,
            overflow,
        } => {
            let opts = SubscribeOptions {
                group: group.clone(),
                ack: *ack || group.is_some(),
                overflow: *overflow,
                ..SubscribeOptions::default()
            };
            let mut sub = client.subscribe_with(filter, &opts).await?;
            eprintln!(
                "subscribed to {filter}{}",
                group
                    .as_ref()
                    .map(|g| format!(" (group {g})"))
                    .unwrap_or_default()
            );
            let mut received = 0u64;
            while let Some(item) = sub.next().await {
                let msg = item?;
                println!(
                    "{} #{} p{}{}: {}",
                    msg.topic(),
                    msg.offset(),
                    msg.priority().level(),
                    if msg.attempt() > 1 {
                        format!(" (attempt {})", msg.attempt())
                    } else {
                        String::new()
                    },
                    String::from_utf8_lossy(msg.body())
                );
                if opts.ack {
                    msg.ack().await?;
                }
                received += 1;
                if count.is_some_and(|c| received >= c) {
                    break;
                }
            }
        }
        Command::Bench {
            messages,
            payload_size,
            batch,
            subscribers,
            idle,
        } => {
            bench(
                &cli,
                &client,
                *messages,
                *payload_size,
                (*batch).max(1),
                *subscribers,
                *idle,
            )
            .await?
        }
    }
    Ok(())
}

/// One publisher → N subscribers on a fresh topic.
async fn bench(
    cli: &Cli,
    publisher: &Client,
    messages: u64,
    size: usize,
    batch: usize,
    subscribers: usize,
    idle: Duration,
) -> Result<()> {
    use std::time::Instant;
    let topic = format!("bench/{}", std::process::id());
    let mut tasks = Vec::new();
    let start = std::sync::Arc::new(tokio::sync::OnceCell::<Instant>::new());
    for _ in 0..subscribers {
        let client = connect(cli).await?;
        let mut sub = client.subscribe(&topic).await?;
        let start = start.clone();
        tasks.push(tokio::spawn(async move {
            let mut received = 0u64;
            let mut last = Instant::now();
            // A timer per message would cost more than the message: re-arm it every 4096.
            let idle_timer = tokio::time::sleep(idle);
            tokio::pin!(idle_timer);
            while received < messages {
                tokio::select! {
                    biased;
                    item = sub.next() => match item {
                        Some(Ok(_)) => {
                            received += 1;
                            if received.is_multiple_of(4096) || received == messages {
                                last = Instant::now();
                                idle_timer.as_mut().reset(tokio::time::Instant::now() + idle);
                            }
                        }
                        _ => break,
                    },
                    _ = &mut idle_timer => break,
                }
            }
            let elapsed = start
                .get()
                .map(|s| last.duration_since(*s))
                .unwrap_or_default();
            drop(client);
            (received, elapsed)
        }));
    }
    let body = Bytes::from(vec![0xA5u8; size]);
    let begin = Instant::now();
    let _ = start.set(begin);
    let mut sent = 0u64;
    let opts = PublishOptions::default();
    while sent < messages {
        let n = (messages - sent).min(batch as u64);
        if batch == 1 {
            publisher.publish_with(&topic, body.clone(), &opts).await?;
        } else {
            let items = (0..n).map(|_| (topic.as_str(), body.clone()));
            publisher.publish_batch(items, &opts).await?;
        }
        sent += n;
    }
    publisher.flush().await?;
    let publish_secs = begin.elapsed().as_secs_f64();
    let mut total = 0u64;
    let mut slowest = Duration::ZERO;
    let mut per_sub = Vec::new();
    for t in tasks {
        let (received, elapsed) = t.await?;
        total += received;
        slowest = slowest.max(elapsed);
        per_sub.push(received as f64 / elapsed.as_secs_f64().max(1e-9));
    }
    let lost = messages * subscribers as u64 - total;
    let aggregate = total as f64 / slowest.as_secs_f64().max(1e-9);
    println!("messages {messages} x {size} B, batch {batch}, subscribers {subscribers}");
    println!(
        "publish   {:>12.0} msg/s  {:>8.1} MB/s",
        messages as f64 / publish_secs,
        messages as f64 * size as f64 / publish_secs / 1e6
    );
    for (i, rate) in per_sub.iter().enumerate() {
        println!("sub {i:<5} {rate:>12.0} msg/s");
    }
    println!(
        "delivered {aggregate:>12.0} msg/s  {:>8.1} MB/s (aggregate)",
        aggregate * size as f64 / 1e6
    );
    println!("lost      {lost}");
    println!(
        "RESULT {{\"pub_msgs_per_s\":{:.0},\"agg_delivered_msgs_per_s\":{aggregate:.0},\"sub_min_msgs_per_s\":{:.0},\"lost_total\":{lost}}}",
        messages as f64 / publish_secs,
        per_sub.iter().copied().fold(f64::INFINITY, f64::min)
    );
    if lost > 0 {
        bail!("{lost} message(s) were not delivered: the run is not a success (see the broker's drop counters)");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AQUEDUCT_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aqueduct: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aqueduct: {e:#}");
            ExitCode::FAILURE
        }
    }
}
