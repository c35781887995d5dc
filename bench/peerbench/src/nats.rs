//! NATS core pub/sub baselines using async-nats against a running nats-server.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use async_nats::{Client, ConnectOptions, Event, Subject};
use bytes::{BufMut, Bytes, BytesMut};
use clap::Args;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{Barrier, oneshot};

use crate::common::{self, CpuMeter};

#[derive(Args, Debug, Clone)]
pub struct ThroughputArgs {
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    url: String,
    /// Connect the subscribers to this server instead of --url (another node of a cluster).
    /// The run then starts with probes (empty messages, not counted) until every subscriber
    /// has seen one: the publishers' server learns of the subscriptions over the route.
    #[arg(long)]
    sub_url: Option<String>,
    /// Total messages published (split evenly across publishers).
    #[arg(long, default_value_t = 1_000_000)]
    msgs: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// Number of publishers (one connection each).
    #[arg(long, default_value_t = 1)]
    pubs: usize,
    /// Number of subscribers (one connection each, same subject).
    #[arg(long, default_value_t = 1)]
    subs: usize,
    /// async-nats per-subscription buffer (messages); client drops when full.
    #[arg(long, default_value_t = 65_536)]
    sub_capacity: usize,
    /// Stop waiting for subscribers after this long without progress.
    #[arg(long, default_value_t = 2000)]
    idle_ms: u64,
    /// Hard limit for the whole run.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
    /// PID of nats-server, to report its CPU seconds during the run.
    #[arg(long)]
    server_pid: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct LatencyArgs {
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    url: String,
    /// Connect the subscriber to this server instead of --url (as for nats-throughput).
    #[arg(long)]
    sub_url: Option<String>,
    /// Messages per second (single publisher).
    #[arg(long, default_value_t = 10_000.0)]
    rate: f64,
    /// Duration of the paced send phase.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Payload size in bytes (min 8: holds the send timestamp).
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// Leading messages excluded from the histogram (connection warm-up).
    #[arg(long, default_value_t = 1000)]
    warmup_msgs: u64,
    /// PID of nats-server, to report its CPU seconds during the run.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Write every timed message to FILE as CSV, `sent_ns,latency_ns`, in arrival order (as
    /// `aqueduct bench --latency-trace`).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
}

async fn connect(url: &str, sub_capacity: usize, slow: Arc<AtomicU64>) -> anyhow::Result<Client> {
    let client = ConnectOptions::new()
        .subscription_capacity(sub_capacity)
        .event_callback(move |ev| {
            let slow = slow.clone();
            async move {
                match ev {
                    Event::SlowConsumer(_) => {
                        slow.fetch_add(1, Ordering::Relaxed);
                    }
                    Event::Connected => {}
                    other => eprintln!("nats event: {other}"),
                }
            }
        })
        .connect(url)
        .await
        .with_context(|| format!("connect {url}"))?;
    Ok(client)
}

/// How long probes may take to reach every subscriber.
const PROBE_TIMEOUT: Duration = Duration::from_secs(15);

/// Publish empty messages on `subject` with `client` until `probed` reaches `want`.
async fn probe(
    client: &Client,
    subject: &Subject,
    probed: &AtomicU64,
    want: u64,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    while probed.load(Ordering::Acquire) < want {
        if Instant::now() > deadline {
            bail!(
                "only {} of {want} subscribers saw a probe within {PROBE_TIMEOUT:?}: is the route up?",
                probed.load(Ordering::Acquire)
            );
        }
        client.publish(subject.clone(), Bytes::new()).await?;
        client.flush().await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

struct SubResult {
    count: u64,
    bytes: u64,
    first: Option<Instant>,
    last: Option<Instant>,
}

pub async fn throughput(a: ThroughputArgs) -> anyhow::Result<Value> {
    if a.pubs == 0 || a.subs == 0 || a.msgs == 0 {
        bail!("--pubs, --subs and --msgs must be > 0");
    }
    let deadline = Instant::now() + Duration::from_secs(a.timeout_secs);
    let subject = Subject::from(format!(
        "peerbench.tp.{}.{}",
        std::process::id(),
        common::now_ns()
    ));
    let payload = Bytes::from(vec![0xA5u8; a.size]);
    let total = a.msgs;
    let slow = Arc::new(AtomicU64::new(0));

    // Subscribers first; flush so the server has registered the interest.
    let mut subs = Vec::new();
    let mut sub_clients = Vec::new();
    let mut progress = Vec::new();
    let mut stops = Vec::new();
    let sub_url = a.sub_url.clone().unwrap_or_else(|| a.url.clone());
    let probed = Arc::new(AtomicU64::new(0));
    for _ in 0..a.subs {
        let client = connect(&sub_url, a.sub_capacity, slow.clone()).await?;
        let mut sub = client.subscribe(subject.clone()).await?;
        client.flush().await?;
        let counter = Arc::new(AtomicU64::new(0));
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let c2 = counter.clone();
        let probed = probed.clone();
        subs.push(tokio::spawn(async move {
            let mut r = SubResult {
                count: 0,
                bytes: 0,
                first: None,
                last: None,
            };
            let mut seen_probe = false;
            loop {
                tokio::select! {
                    biased;
                    m = sub.next() => match m {
                        // A probe (the measured payloads are never empty): not counted.
                        Some(m) if m.payload.is_empty() => {
                            if !seen_probe {
                                seen_probe = true;
                                probed.fetch_add(1, Ordering::AcqRel);
                            }
                        }
                        Some(m) => {
                            let now = Instant::now();
                            if r.first.is_none() { r.first = Some(now); }
                            r.last = Some(now);
                            r.count += 1;
                            r.bytes += m.payload.len() as u64;
                            c2.store(r.count, Ordering::Relaxed);
                            if r.count >= total { break; }
                        }
                        None => break,
                    },
                    _ = &mut stop_rx => break,
                }
            }
            r
        }));
        sub_clients.push(client);
        progress.push(counter);
        stops.push(stop_tx);
    }

    if a.sub_url.is_some() {
        let client = connect(&a.url, a.sub_capacity, slow.clone()).await?;
        probe(&client, &subject, &probed, a.subs as u64).await?;
        drop(client);
    }

    // Publishers: connect, then start together.
    let barrier = Arc::new(Barrier::new(a.pubs + 1));
    let mut pubs = Vec::new();
    for p in 0..a.pubs {
        let n = total / a.pubs as u64 + u64::from((p as u64) < total % a.pubs as u64);
        let client = connect(&a.url, a.sub_capacity, slow.clone()).await?;
        let barrier = barrier.clone();
        let subject = subject.clone();
        let payload = payload.clone();
        pubs.push(tokio::spawn(async move {
            barrier.wait().await;
            let t0 = Instant::now();
            for _ in 0..n {
                client.publish(subject.clone(), payload.clone()).await?;
            }
            client.flush().await?;
            let t1 = Instant::now();
            anyhow::Ok((n, t0, t1, client))
        }));
    }

    let cpu = CpuMeter::start(a.server_pid);
    let t0 = Instant::now();
    barrier.wait().await;
    let mut pub_end = t0;
    let mut pub_rates = Vec::new();
    let mut pub_clients = Vec::new();
    for h in pubs {
        let (n, s, e, c) = h.await??;
        pub_end = pub_end.max(e);
        pub_rates.push(n as f64 / (e - s).as_secs_f64());
        pub_clients.push(c);
    }
    let pub_secs = (pub_end - t0).as_secs_f64();

    // Wait until every subscriber has everything, or progress stalls.
    let mut last_sum = 0;
    let mut last_change = Instant::now();
    loop {
        let counts: Vec<u64> = progress.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        if counts.iter().all(|&c| c >= total) {
            break;
        }
        let sum: u64 = counts.iter().sum();
        if sum != last_sum {
            last_sum = sum;
            last_change = Instant::now();
        } else if last_change.elapsed() > Duration::from_millis(a.idle_ms) {
            eprintln!("subscribers stalled at {counts:?} of {total}; stopping");
            break;
        }
        if Instant::now() > deadline {
            eprintln!("hard timeout; stopping");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for s in stops {
        let _ = s.send(());
    }
    let mut results = Vec::new();
    for h in subs {
        results.push(h.await?);
    }
    let active = results
        .iter()
        .filter_map(|r| r.last)
        .max()
        .unwrap_or(pub_end)
        .max(pub_end)
        .duration_since(t0)
        .as_secs_f64();
    let cpu_v = cpu.stop_active(Some(active));

    let pub_rate = total as f64 / pub_secs;
    println!(
        "config: pubs={} subs={} msgs={} size={}B url={} sub_url={}",
        a.pubs, a.subs, total, a.size, a.url, sub_url
    );
    println!(
        "publish: {:.0} msgs/s, {:.1} MB/s over {:.3}s (per publisher: {})",
        pub_rate,
        common::mb_per_s(total, a.size, pub_secs),
        pub_secs,
        pub_rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut sub_v = Vec::new();
    let mut lost_total = 0;
    for (i, r) in results.iter().enumerate() {
        let span = r.last.map(|l| (l - t0).as_secs_f64()).unwrap_or(f64::NAN);
        let span_first = match (r.first, r.last) {
            (Some(f), Some(l)) => (l - f).as_secs_f64(),
            _ => f64::NAN,
        };
        let rate = r.count as f64 / span;
        let lost = total.saturating_sub(r.count);
        lost_total += lost;
        println!(
            "subscriber {i}: received {} of {} (lost {}), {:.0} msgs/s, {:.1} MB/s over {:.3}s since publish start",
            r.count,
            total,
            lost,
            rate,
            r.bytes as f64 / 1e6 / span,
            span
        );
        sub_v.push(json!({
            "received": r.count, "lost": lost, "msgs_per_s": rate,
            "mb_per_s": r.bytes as f64 / 1e6 / span, "secs": span, "secs_first_to_last": span_first,
        }));
    }
    let slow_n = slow.load(Ordering::Relaxed);
    println!(
        "all subscribers complete: {} (lost total {}, client slow-consumer events {})",
        lost_total == 0,
        lost_total,
        slow_n
    );
    let min_sub = sub_v
        .iter()
        .filter_map(|s| s["msgs_per_s"].as_f64())
        .fold(f64::INFINITY, f64::min);
    let agg = results.iter().map(|r| r.count).sum::<u64>() as f64
        / results
            .iter()
            .filter_map(|r| r.last)
            .max()
            .map(|l| (l - t0).as_secs_f64())
            .unwrap_or(f64::NAN);
    println!("aggregate delivered: {agg:.0} msgs/s (sum over subscribers)");
    drop(sub_clients);
    drop(pub_clients);
    Ok(json!({
        "mode": "nats-throughput",
        "url": a.url, "sub_url": a.sub_url,
        "pubs": a.pubs, "subs": a.subs, "msgs": total, "size": a.size,
        "pub_msgs_per_s": pub_rate,
        "pub_mb_per_s": common::mb_per_s(total, a.size, pub_secs),
        "pub_secs": pub_secs,
        "sub_min_msgs_per_s": min_sub,
        "sub_min_mb_per_s": min_sub * a.size as f64 / 1e6,
        "delivered_msgs_per_s": agg,
        "subscribers": sub_v,
        "lost_total": lost_total,
        "complete": lost_total == 0,
        "slow_consumer_events": slow_n,
        "cpu": cpu_v,
    }))
}

pub async fn latency(a: LatencyArgs) -> anyhow::Result<Value> {
    let size = a.size.max(8);
    let total = (a.rate * a.secs).round() as u64;
    let slow = Arc::new(AtomicU64::new(0));
    let subject = Subject::from(format!(
        "peerbench.lat.{}.{}",
        std::process::id(),
        common::now_ns()
    ));
    let sub_url = a.sub_url.clone().unwrap_or_else(|| a.url.clone());
    let sub_client = connect(&sub_url, 65_536, slow.clone()).await?;
    let mut sub = sub_client.subscribe(subject.clone()).await?;
    sub_client.flush().await?;
    let pub_client = connect(&a.url, 65_536, slow.clone()).await?;

    let received = Arc::new(AtomicU64::new(0));
    let probed = Arc::new(AtomicU64::new(0));
    let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
    let rcv = received.clone();
    let probed2 = probed.clone();
    let warmup = a.warmup_msgs;
    let tracing = a.trace.is_some();
    let sub_task = tokio::spawn(async move {
        let mut h = common::new_hist();
        let mut trace = Vec::with_capacity(if tracing { total as usize } else { 0 });
        let mut n = 0u64;
        loop {
            tokio::select! {
                biased;
                m = sub.next() => match m {
                    // A probe: not counted.
                    Some(m) if m.payload.is_empty() => {
                        probed2.store(1, Ordering::Release);
                    }
                    Some(m) => {
                        let now = common::now_ns();
                        let ts = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                        n += 1;
                        if n > warmup {
                            common::record_ns(&mut h, now.saturating_sub(ts));
                            if tracing { trace.push((ts, now.saturating_sub(ts))); }
                        }
                        rcv.store(n, Ordering::Relaxed);
                        if n >= total { break; }
                    }
                    None => break,
                },
                _ = &mut stop_rx => break,
            }
        }
        (n, h, trace)
    });

    if a.sub_url.is_some() {
        probe(&pub_client, &subject, &probed, 1).await?;
    }
    let cpu = CpuMeter::start(a.server_pid);
    let handle = tokio::runtime::Handle::current();
    let pc = pub_client.clone();
    let (rate, secs) = (a.rate, a.secs);
    let pacer = std::thread::spawn(move || {
        let stats = common::paced(
            rate,
            total,
            Duration::from_secs_f64(secs * 2.0 + 5.0),
            |_| {
                let mut b = BytesMut::with_capacity(size);
                b.put_u64_le(common::now_ns());
                b.resize(size, 0x5A);
                handle.block_on(pc.publish(subject.clone(), b.freeze()))?;
                Ok(())
            },
        );
        handle.block_on(pc.flush())?;
        stats
    });
    let stats = tokio::task::spawn_blocking(move || pacer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("pacer thread panicked"))??;

    // Drain: wait until everything arrived or 2 s without progress.
    let mut last = 0;
    let mut last_change = Instant::now();
    while received.load(Ordering::Relaxed) < stats.sent {
        let r = received.load(Ordering::Relaxed);
        if r != last {
            last = r;
            last_change = Instant::now();
        } else if last_change.elapsed() > Duration::from_secs(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop_tx.send(());
    let (n, h, trace) = sub_task.await?;
    if let Some(path) = &a.trace {
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        writeln!(out, "sent_ns,latency_ns")?;
        for (sent, latency) in &trace {
            writeln!(out, "{sent},{latency}")?;
        }
        out.flush()?;
    }
    let cpu_v = cpu.stop();
    let achieved = stats.sent as f64 / stats.elapsed.as_secs_f64();
    println!(
        "config: rate={} msg/s secs={} size={}B url={} sub_url={sub_url}; sent {} in {:.3}s ({achieved:.0} msg/s, worst pacing lateness {:.0}us); received {} (lost {})",
        a.rate,
        a.secs,
        size,
        a.url,
        stats.sent,
        stats.elapsed.as_secs_f64(),
        stats.max_late.as_secs_f64() * 1e6,
        n,
        stats.sent.saturating_sub(n)
    );
    let lat = common::latency_report("nats one-way latency", &h);
    Ok(json!({
        "mode": "nats-latency", "url": a.url, "sub_url": a.sub_url, "rate": a.rate, "secs": a.secs, "size": size,
        "sent": stats.sent, "received": n, "lost": stats.sent.saturating_sub(n),
        "achieved_rate": achieved, "warmup_msgs": warmup,
        "latency": lat, "cpu": cpu_v,
    }))
}
