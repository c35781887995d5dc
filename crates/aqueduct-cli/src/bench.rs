//! `aqueduct bench`: the load tool (the seed's `aqueduct-bench`).
//!
//! Publishers send messages whose first 16 payload bytes are a send timestamp (nanoseconds since
//! the run's start, on this process's monotonic clock) and a message index; subscribers in the
//! same process record one-way latency into an HdrHistogram and mark each index in a bitmap, so
//! losses and duplicates are counted exactly. Closed loop by default (as fast as the broker
//! takes them); with `--rate` an open loop paced on OS threads with 1 ns timer slack (timestamps
//! are taken at the actual send, so a late pacer is not counted as latency — no
//! coordinated-omission correction, the same convention and the same pacing as `bench/peerbench`).
//!
//! A run that lost or duplicated messages is reported as a failure, with the broker's drop and
//! expiry counters for the topic when its metrics endpoint is reachable.
//!
//! Subscribers may connect to another broker than the publishers ([`run_split`], `aqueduct
//! bench --sub-addr`), e.g. another node of a cluster. The publishers' broker then learns of the
//! subscriptions some time after they are active, so the run starts with probes: empty messages
//! on the topic, published until every subscriber has seen one (a group: one member). Probes
//! are not counted (a bench payload is never empty).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_client::{
    Client, OverflowPolicy, Priority, PublishOptions, Publisher, SubscribeOptions, Subscription,
};
use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;

/// Bytes at the start of every payload: timestamp (8) and index (8).
pub const HEADER: usize = 16;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub publishers: usize,
    /// Publish streams per publisher connection.
    pub streams: usize,
    pub subscribers: usize,
    /// Subscribers form one consumer group (each message to one of them, acknowledged).
    pub group: bool,
    /// The subscriptions' backpressure policy (default: the broker's).
    pub overflow: Option<OverflowPolicy>,
    /// Messages to publish (ignored when `duration` is set).
    pub messages: u64,
    /// Publish for this long instead of a fixed count (with `rate`: `rate` × this many).
    pub duration: Option<Duration>,
    pub payload_size: usize,
    /// Messages per PUBLISH_BATCH frame (1 = single PUBLISH frames).
    pub batch: usize,
    /// Total publish rate in msg/s (0 = as fast as possible).
    pub rate: f64,
    /// Priority weights, e.g. [(0, 1), (2, 9)]: 10% priority 0, 90% priority 2.
    pub priority_mix: Vec<(Priority, u32)>,
    /// Stop waiting for deliveries after this long without progress.
    pub idle: Duration,
    pub topic: String,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Where the subscribers connect when it is not the publishers' broker (reported only).
    pub sub_addr: Option<String>,
    /// Publish probes until every subscriber has seen one before the measured run (needed when
    /// the subscribers are on another broker than the publishers).
    pub probe: bool,
    /// How long the probes may take to reach the subscribers.
    pub probe_timeout: Duration,
    /// Every publish frame starts a trace (a new sampled W3C trace context; a batch's messages
    /// share it): what a broker exporting traces (tracing.otlp_endpoint) records.
    pub trace: bool,
    /// Messages whose sequence number is below this are delivered and counted but left out of
    /// the latency figures: a new connection's first messages meet cold caches, buffers not
    /// grown yet and a congestion window still opening (peerbench's `--warmup-msgs`).
    pub warmup: u64,
    /// Keep every timed message's send stamp and latency ([`BenchReport::trace`]), to see when
    /// the slow ones happened (`aqueduct bench --latency-trace FILE`).
    pub latency_trace: bool,
    /// Set to end publishing early (Ctrl-C): the run then waits for what was sent, as at its
    /// planned end, and reports it.
    pub stop: Arc<AtomicBool>,
}

/// Time between probes.
const PROBE_EVERY: Duration = Duration::from_millis(20);

/// One subscriber's results.
#[derive(Debug, Clone)]
pub struct SubscriberReport {
    pub received: u64,
    pub duplicates: u64,
    /// Messages on the topic that were not this run's (someone else publishing to it).
    pub foreign: u64,
    pub msgs_per_s: f64,
    pub secs: f64,
}

/// The whole run's results.
#[derive(Debug, Clone)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub sent: u64,
    pub publish_secs: f64,
    /// With a paced rate: the latest any send began after its scheduled time, ns. A sender
    /// that falls behind (blocked by flow control, say) sends late, and its messages' latency
    /// is timed from when they went, not from when they were due: this says how far behind.
    pub pacer_max_late_ns: u64,
    pub subscribers: Vec<SubscriberReport>,
    /// Messages no subscriber (group) / some subscriber (fan-out) received.
    pub lost: u64,
    pub duplicates: u64,
    pub delivered_msgs_per_s: f64,
    pub latency: Histogram<u64>,
    /// With [`BenchConfig::latency_trace`]: every timed delivery as (sent, latency), in ns,
    /// `sent` after the run's epoch, sorted by `sent` (a fan-out's copies are all there).
    pub trace: Vec<(u64, u64)>,
}

/// Why a bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("--payload-size must be at least {HEADER} bytes (timestamp and sequence number)")]
    PayloadTooSmall,
    #[error(transparent)]
    Client(#[from] aqueduct_client::ClientError),
    #[error(transparent)]
    Connect(#[from] aqueduct_client::ConnectError),
    #[error("a bench task failed: {0}")]
    Task(String),
    #[error(
        "not every subscriber saw a probe within {0:?}: the publishers' broker does not forward \
         to the subscribers' (two brokers that are not one cluster?)"
    )]
    NoProbe(Duration),
}

fn priority_of(index: u64, mix: &[(Priority, u32)]) -> Option<Priority> {
    let total: u32 = mix.iter().map(|(_, w)| *w).sum();
    if total == 0 {
        return None;
    }
    let mut slot = (index % u64::from(total)) as u32;
    for (p, w) in mix {
        if slot < *w {
            return Some(*p);
        }
        slot -= w;
    }
    None
}

/// Parse "0:1,2:9" into weights per priority.
pub fn parse_priority_mix(s: &str) -> Result<Vec<(Priority, u32)>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|part| {
            let (p, w) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?}: expected PRIORITY:WEIGHT, e.g. 0:1,2:9"))?;
            let p = p
                .trim()
                .parse::<u8>()
                .ok()
                .and_then(Priority::new)
                .ok_or_else(|| format!("{p:?}: priority must be 0..=3"))?;
            let w = w
                .trim()
                .parse::<u32>()
                .map_err(|_| format!("{w:?}: weight must be a whole number"))?;
            Ok((p, w))
        })
        .collect::<Result<Vec<_>, String>>()
        .and_then(|mix| {
            // Weights that sum to 0 chose no priority, and a sum past u32 wrapped: either way
            // every message went at priority 2, the mix silently ignored.
            let total = mix
                .iter()
                .try_fold(0u32, |sum, (_, w)| sum.checked_add(*w))
                .ok_or_else(|| format!("{s:?}: the weights add up to more than {}", u32::MAX))?;
            if total == 0 && !mix.is_empty() {
                return Err(format!("{s:?}: the weights add up to 0"));
            }
            Ok(mix)
        })
}

/// Nanoseconds since `epoch`: the send timestamp in a payload.
fn stamp(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

/// A bench payload: send time (ns since the run's epoch), message index, filler.
fn payload(buf: &mut BytesMut, sent_ns: u64, index: u64, size: usize) -> Bytes {
    buf.reserve(size);
    write_payload(buf, sent_ns, index, size);
    buf.split().freeze()
}

fn write_payload(buf: &mut BytesMut, sent_ns: u64, index: u64, size: usize) {
    buf.put_u64_le(sent_ns);
    buf.put_u64_le(index);
    buf.put_bytes(FILLER, size - HEADER);
}

/// What fills a bench payload after its header.
const FILLER: u8 = 0xA5;

/// Tracks what one subscriber received.
struct Recorder {
    seen: Vec<u64>,
    received: u64,
    duplicates: u64,
    /// Messages on the topic that are not this run's (not a bench payload of its size, or an
    /// index far past any sent): not counted, not timed.
    foreign: u64,
    payload_size: usize,
    latency: Histogram<u64>,
    /// Latencies not yet in `latency`: (value, how many). A batch's messages carry one send
    /// stamp and arrive together, so most have the latency of the one before.
    run: (u64, u64),
    last: Instant,
    /// Sequence numbers below this are not in `latency` ([`BenchConfig::warmup`]).
    warmup: u64,
    /// (sent, latency) of every timed message, if asked for ([`BenchConfig::latency_trace`]).
    trace: Option<Vec<(u64, u64)>>,
}

impl Recorder {
    fn new(capacity: u64, payload_size: usize, warmup: u64, trace: bool) -> Recorder {
        Recorder {
            seen: vec![0; capacity.div_ceil(64) as usize],
            received: 0,
            duplicates: 0,
            foreign: 0,
            payload_size,
            latency: new_histogram(),
            run: (0, 0),
            last: Instant::now(),
            warmup,
            // Reserved for at most 1 Mi entries up front (a group's subscriber gets only a share
            // of `capacity`); it grows beyond as needed.
            trace: trace
                .then(|| Vec::with_capacity(capacity.saturating_sub(warmup).min(1 << 20) as usize)),
        }
    }

    /// Record one message received at `now`, `now_ns` after the run's epoch. Returns whether
    /// it was one of the run's: anyone may publish to the bench's topic meanwhile, and a
    /// foreign message's bytes 8..16 read as an index made the seen-set grow to it (an
    /// allocation of exabytes, and an abort) and counted toward the messages received.
    fn record(&mut self, (now, now_ns): (Instant, u64), body: &[u8]) -> bool {
        let (Some(ts), Some(index)) = (read_u64(body, 0), read_u64(body, 8)) else {
            self.foreign += 1;
            return false;
        };
        let filler = &body[HEADER.min(body.len())..];
        let (word, bit) = ((index / 64) as usize, index % 64);
        // Indices grow by steps: the seen-set (sized for the run, or in duration mode for a
        // first part of it) is never outgrown by more than a margin at once.
        let plausible = word < self.seen.len().saturating_mul(2).saturating_add(1 << 14);
        if body.len() != self.payload_size
            || filler.first().is_some_and(|b| *b != FILLER)
            || filler.last().is_some_and(|b| *b != FILLER)
            || !plausible
        {
            self.foreign += 1;
            return false;
        }
        self.last = now;
        self.received += 1;
        if index >= self.warmup {
            let latency = now_ns.saturating_sub(ts).max(1);
            if let Some(t) = &mut self.trace {
                t.push((ts, latency));
            }
            if self.run.0 != latency {
                self.flush();
                self.run.0 = latency;
            }
            self.run.1 += 1;
        }
        if word >= self.seen.len() {
            self.seen.resize(word + 1, 0);
        }
        if self.seen[word] & (1 << bit) != 0 {
            self.duplicates += 1;
        }
        self.seen[word] |= 1 << bit;
        true
    }

    /// Move the pending latencies into the histogram.
    fn flush(&mut self) {
        if self.run.1 > 0 {
            let _ = self.latency.record_n(self.run.0, self.run.1);
            self.run.1 = 0;
        }
    }
}

/// Write a run's [`BenchReport::trace`] to `path` as CSV: a `sent_ns,latency_ns` header, then
/// one line per timed delivery.
pub fn write_trace(path: &std::path::Path, trace: &[(u64, u64)]) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(out, "sent_ns,latency_ns")?;
    for (sent, latency) in trace {
        writeln!(out, "{sent},{latency}")?;
    }
    out.flush()
}

/// 1 ns .. 60 s at 3 significant digits.
fn new_histogram() -> Histogram<u64> {
    let h = Histogram::new_with_bounds(1, 60_000_000_000, 3);
    h.expect("valid bounds") // ok: constant arguments, never fails
}

fn read_u64(body: &[u8], at: usize) -> Option<u64> {
    body.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
}

/// Run the bench against a broker reached with `connect`.
pub async fn run<F, Fut>(cfg: BenchConfig, connect: F) -> Result<BenchReport, BenchError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Client, aqueduct_client::ConnectError>>,
{
    run_split(cfg, &connect, &connect).await
}

/// Run the bench with the publishers connected by `connect_pub` and the subscribers by
/// `connect_sub` (another broker, e.g. another node of a cluster; set `cfg.probe` then).
pub async fn run_split<P, PFut, S, SFut>(
    cfg: BenchConfig,
    connect_pub: P,
    connect_sub: S,
) -> Result<BenchReport, BenchError>
where
    P: Fn() -> PFut,
    PFut: std::future::Future<Output = Result<Client, aqueduct_client::ConnectError>>,
    S: Fn() -> SFut,
    SFut: std::future::Future<Output = Result<Client, aqueduct_client::ConnectError>>,
{
    if cfg.payload_size < HEADER {
        return Err(BenchError::PayloadTooSmall);
    }
    let epoch = Instant::now();
    // How many messages will have been sent; u64::MAX while unknown (duration mode).
    let target = Arc::new(AtomicU64::new(if cfg.duration.is_some() {
        u64::MAX
    } else {
        cfg.messages
    }));
    let delivered = Arc::new(AtomicU64::new(0));
    // Subscribers that have seen a probe; whether the measured run has started.
    let probed = Arc::new(AtomicU64::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let reached = Arc::new(tokio::sync::Notify::new());
    let capacity = if cfg.duration.is_some() {
        1 << 20
    } else {
        cfg.messages
    };

    // Subscribers first, each on its own connection; `subscribe` returns once active.
    let mut sub_tasks = Vec::new();
    let mut sub_clients = Vec::new();
    for _ in 0..cfg.subscribers {
        let client = connect_sub().await?;
        let opts = SubscribeOptions {
            group: cfg.group.then(|| "bench".to_string()),
            ack: cfg.group,
            overflow: cfg.overflow,
            ..SubscribeOptions::default()
        };
        let sub = client.subscribe_with(&cfg.topic, &opts).await?;
        sub_clients.push(client);
        sub_tasks.push(tokio::spawn(subscriber(
            sub,
            epoch,
            capacity,
            cfg.clone(),
            Shared {
                target: target.clone(),
                delivered: delivered.clone(),
                probed: probed.clone(),
                go: go.clone(),
                reached: reached.clone(),
            },
        )));
    }

    let sent = Arc::new(AtomicU64::new(0));
    let max_late = Arc::new(AtomicU64::new(0));
    let workers = (cfg.publishers * cfg.streams).max(1);
    let mut pub_clients = Vec::new();
    for _ in 0..cfg.publishers.max(1) {
        pub_clients.push(connect_pub().await?);
    }
    if cfg.probe {
        let want = if cfg.group { 1 } else { cfg.subscribers as u64 };
        probe(
            &pub_clients[0].publisher(),
            &cfg.topic,
            &probed,
            want,
            cfg.probe_timeout,
        )
        .await?;
    }
    let progress = progress_bar(&cfg);
    let started = Instant::now();
    go.store(true, Ordering::Release);
    let mut pub_tasks = Vec::new();
    for w in 0..workers {
        let worker = Worker {
            publisher: pub_clients[w / cfg.streams.max(1) % pub_clients.len()].publisher(),
            cfg: cfg.clone(),
            plan: Plan {
                next: w as u64,
                step: workers as u64,
            },
            epoch,
            started,
            sent: sent.clone(),
            max_late: max_late.clone(),
            progress: progress.clone(),
        };
        if cfg.rate > 0.0 {
            let handle = tokio::runtime::Handle::current();
            pub_tasks.push(tokio::task::spawn_blocking(move || worker.paced(handle)));
        } else {
            pub_tasks.push(tokio::spawn(worker.closed_loop()));
        }
    }
    for t in pub_tasks {
        t.await.map_err(|e| BenchError::Task(e.to_string()))??;
    }
    let publish_secs = started.elapsed().as_secs_f64();
    let sent = sent.load(Ordering::Acquire);
    target.store(sent, Ordering::Release);
    // Subscribers that have it all already stop now, not at their idle timeout.
    reached.notify_waiters();
    if let Some(p) = &progress {
        p.set_length(sent * if cfg.group { 1 } else { cfg.subscribers as u64 });
        p.set_message("waiting for deliveries");
    }

    let mut reports = Vec::new();
    let mut latency = new_histogram();
    let mut trace = Vec::new();
    let mut union = vec![0u64; sent.div_ceil(64) as usize];
    let mut total_received = 0;
    let mut last = started;
    let mut dups_within = 0;
    for t in sub_tasks {
        let rec = t.await.map_err(|e| BenchError::Task(e.to_string()))?;
        let secs = rec.last.duration_since(started).as_secs_f64().max(1e-9);
        reports.push(SubscriberReport {
            received: rec.received,
            duplicates: rec.duplicates,
            foreign: rec.foreign,
            msgs_per_s: rec.received as f64 / secs,
            secs,
        });
        total_received += rec.received;
        dups_within += rec.duplicates;
        last = last.max(rec.last);
        let _ = latency.add(&rec.latency);
        trace.extend(rec.trace.unwrap_or_default());
        for (u, s) in union.iter_mut().zip(&rec.seen) {
            *u |= s;
        }
    }
    if let Some(p) = &progress {
        p.finish_and_clear();
    }
    let unique: u64 = union.iter().map(|w| u64::from(w.count_ones())).sum();
    let (lost, duplicates) = if cfg.group {
        (
            sent.saturating_sub(unique),
            total_received.saturating_sub(unique),
        )
    } else {
        (
            (sent * cfg.subscribers as u64).saturating_sub(total_received - dups_within),
            dups_within,
        )
    };
    let secs = last.duration_since(started).as_secs_f64().max(1e-9);
    drop(sub_clients);
    Ok(BenchReport {
        config: cfg,
        sent,
        publish_secs,
        pacer_max_late_ns: max_late.load(Ordering::Acquire),
        subscribers: reports,
        lost,
        duplicates,
        delivered_msgs_per_s: total_received as f64 / secs,
        latency,
        trace: {
            trace.sort_unstable();
            trace
        },
    })
}

/// Publish empty messages on `topic` until `want` subscribers have seen one (at most for
/// `timeout`).
async fn probe(
    publisher: &Publisher,
    topic: &str,
    probed: &AtomicU64,
    want: u64,
    timeout: Duration,
) -> Result<(), BenchError> {
    let deadline = Instant::now() + timeout;
    while probed.load(Ordering::Acquire) < want {
        if Instant::now() >= deadline {
            return Err(BenchError::NoProbe(timeout));
        }
        publisher.publish(topic, Bytes::new()).await?;
        publisher.flush().await?;
        tokio::time::sleep(PROBE_EVERY).await;
    }
    Ok(())
}

fn progress_bar(cfg: &BenchConfig) -> Option<indicatif::ProgressBar> {
    if !cfg.progress {
        return None;
    }
    let bar = match cfg.duration {
        Some(d) => indicatif::ProgressBar::new(d.as_secs().max(1)),
        None => indicatif::ProgressBar::new(cfg.messages),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_message("publishing");
    Some(bar)
}

/// The index sequence of worker `w` of `n`: w, w + n, w + 2n, …
struct Plan {
    next: u64,
    step: u64,
}

/// One publishing task: its publish stream and its share of the message indices.
struct Worker {
    publisher: Publisher,
    cfg: BenchConfig,
    plan: Plan,
    epoch: Instant,
    started: Instant,
    sent: Arc<AtomicU64>,
    /// The latest any paced send began after it was due, ns (all workers).
    max_late: Arc<AtomicU64>,
    progress: Option<indicatif::ProgressBar>,
}

impl Worker {
    /// Closed loop: publish as fast as the broker takes it.
    async fn closed_loop(mut self) -> Result<(), aqueduct_client::ClientError> {
        let mut buf = BytesMut::new();
        while let Some(batch) = next_batch(&self.cfg, &mut self.plan, self.started) {
            send_batch(&self.publisher, &self.cfg, &batch, &mut buf, self.epoch).await?;
            self.advance(batch.len() as u64);
        }
        self.publisher.flush().await
    }

    /// Open loop: send at `rate / workers` msg/s on an OS thread (sub-millisecond sleeps, unlike
    /// tokio's timer), timestamping each message when it is actually sent.
    fn paced(mut self, handle: tokio::runtime::Handle) -> Result<(), aqueduct_client::ClientError> {
        tight_timer_slack();
        let interval = Duration::from_secs_f64(
            self.cfg.batch.max(1) as f64 * self.plan.step as f64 / self.cfg.rate,
        );
        let mut buf = BytesMut::new();
        let mut due = Instant::now();
        let mut late = Duration::ZERO;
        while let Some(batch) = next_batch(&self.cfg, &mut self.plan, self.started) {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            } else {
                late = late.max(now - due);
            }
            due += interval;
            handle.block_on(send_batch(
                &self.publisher,
                &self.cfg,
                &batch,
                &mut buf,
                self.epoch,
            ))?;
            self.advance(batch.len() as u64);
        }
        let late = u64::try_from(late.as_nanos()).unwrap_or(u64::MAX);
        self.max_late.fetch_max(late, Ordering::AcqRel);
        handle.block_on(self.publisher.flush())
    }

    /// Count `count` sent messages and move the progress bar.
    fn advance(&self, count: u64) {
        self.sent.fetch_add(count, Ordering::AcqRel);
        if let Some(p) = &self.progress {
            match self.cfg.duration {
                Some(_) => p.set_position(self.started.elapsed().as_secs()),
                None => p.inc(count),
            }
        }
    }
}

/// Ask the kernel to wake this thread's sleeps on time: Linux lets a sleep end up to the
/// thread's timer slack (50 µs by default) late, to merge wake-ups, which at 10,000 msg/s sends
/// many messages in pairs instead of evenly spaced. 1 ns, as peerbench's pacer asks for
/// nats-server's client, so that both are paced alike.
fn tight_timer_slack() {
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1)) {
        tracing::debug!(error = %e, "could not lower the pacer's timer slack");
    }
}

/// The indices of the next batch, or `None` when the run is over: `--messages` of them; with
/// `--duration` and `--rate`, the rate times the duration (those the open loop schedules within
/// the duration, sent even if the publisher runs late); with `--duration` alone, as many as fit.
fn next_batch(cfg: &BenchConfig, plan: &mut Plan, started: Instant) -> Option<Vec<u64>> {
    if cfg.stop.load(Ordering::Acquire) {
        return None;
    }
    let mut batch = Vec::with_capacity(cfg.batch);
    while batch.len() < cfg.batch.max(1) {
        let done = match cfg.duration {
            Some(d) if cfg.rate > 0.0 => plan.next >= (cfg.rate * d.as_secs_f64()).round() as u64,
            Some(d) => started.elapsed() >= d || plan.next >= (1 << 40),
            None => plan.next >= cfg.messages,
        };
        if done {
            break;
        }
        batch.push(plan.next);
        plan.next += plan.step;
    }
    (!batch.is_empty()).then_some(batch)
}

async fn send_batch(
    publisher: &Publisher,
    cfg: &BenchConfig,
    batch: &[u64],
    buf: &mut BytesMut,
    epoch: Instant,
) -> Result<(), aqueduct_client::ClientError> {
    if let [index] = batch {
        let opts = PublishOptions {
            priority: priority_of(*index, &cfg.priority_mix),
            trace: cfg.trace.then(aqueduct_client::new_trace),
            ..PublishOptions::default()
        };
        publisher
            .publish_with(
                &cfg.topic,
                payload(buf, stamp(epoch), *index, cfg.payload_size),
                &opts,
            )
            .await
            .map(|_| ())
    } else {
        // One priority per batch frame: the first message's.
        let opts = PublishOptions {
            priority: priority_of(batch[0], &cfg.priority_mix),
            trace: cfg.trace.then(aqueduct_client::new_trace),
            ..PublishOptions::default()
        };
        // The messages of a batch leave together: one timestamp for all of them, and one buffer
        // (the bodies are slices of it).
        let sent_ns = stamp(epoch);
        let size = cfg.payload_size;
        buf.reserve(size * batch.len());
        for i in batch {
            write_payload(buf, sent_ns, *i, size);
        }
        let all = buf.split().freeze();
        let items: Vec<(&str, Bytes)> = (0..batch.len())
            .map(|k| (cfg.topic.as_str(), all.slice(k * size..(k + 1) * size)))
            .collect();
        publisher.publish_batch(items, &opts).await.map(|_| ())
    }
}

/// What the subscribers share with the run.
struct Shared {
    /// How many messages will have been sent (u64::MAX while unknown).
    target: Arc<AtomicU64>,
    /// Messages received by all (for a group).
    delivered: Arc<AtomicU64>,
    /// Subscribers that have seen a probe.
    probed: Arc<AtomicU64>,
    /// The measured run has started.
    go: Arc<AtomicBool>,
    /// Told when the target is known or, in a group, reached: a subscriber waiting for
    /// deliveries looks again.
    reached: Arc<tokio::sync::Notify>,
}

async fn subscriber(
    mut sub: Subscription,
    epoch: Instant,
    capacity: u64,
    cfg: BenchConfig,
    shared: Shared,
) -> Recorder {
    let Shared {
        target,
        delivered,
        probed,
        go,
        reached,
    } = shared;
    let mut rec = Recorder::new(capacity, cfg.payload_size, cfg.warmup, cfg.latency_trace);
    let mut seen_probe = false;
    let (mut count, mut stamp, mut to_ack) = (0u64, None, Vec::new());
    let idle = tokio::time::sleep(cfg.idle);
    tokio::pin!(idle);
    loop {
        // Registered before the look below: a target stored after it wakes this wait.
        let look_again = reached.notified();
        tokio::pin!(look_again);
        look_again.as_mut().enable();
        // In a group the subscribers share the target; otherwise each must see all of it.
        let goal = target.load(Ordering::Acquire);
        let have = if cfg.group {
            delivered.load(Ordering::Acquire)
        } else {
            rec.received
        };
        if have >= goal {
            break;
        }
        tokio::select! {
            biased;
            // What has already arrived (bounded), read in place. What arrived together (one
            // read of the stream: `next_batch` lends no more) is stamped together: one clock
            // read per burst.
            batch = sub.next_batch(1024, |msg| {
                if stamp.is_none() {
                    let now = Instant::now();
                    stamp = Some((now, now.duration_since(epoch).as_nanos() as u64));
                }
                // A probe (bench payloads are never empty): not counted.
                if msg.body().is_empty() {
                    if !seen_probe {
                        seen_probe = true;
                        probed.fetch_add(1, Ordering::AcqRel);
                    }
                } else if let Some(now) = stamp {
                    if rec.record(now, msg.body()) {
                        count += 1;
                    }
                }
                if cfg.group {
                    to_ack.push(msg.settler());
                }
            }) => {
                stamp = None;
                for msg in to_ack.drain(..) {
                    let _ = msg.ack().await;
                }
                let ended = !matches!(batch, Some(Ok(_)));
                let taken = std::mem::take(&mut count);
                let all = delivered.fetch_add(taken, Ordering::AcqRel) + taken;
                if cfg.group && taken > 0 && all >= target.load(Ordering::Acquire) {
                    // The group's last: the other members stop waiting too.
                    reached.notify_waiters();
                }
                if ended {
                    break;
                }
                idle.as_mut().reset(tokio::time::Instant::now() + cfg.idle);
            }
            () = &mut look_again => {}
            _ = &mut idle => {
                // Idle: give up only once publishing has started, the count is known, and
                // nothing arrives any more.
                if go.load(Ordering::Acquire) && target.load(Ordering::Acquire) != u64::MAX {
                    break;
                }
                idle.as_mut().reset(tokio::time::Instant::now() + cfg.idle);
            }
        }
    }
    rec.flush();
    rec
}

impl BenchReport {
    fn percentile_us(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1e3
    }

    /// Human-readable summary.
    pub fn text(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let mode = if c.rate > 0.0 {
            format!("open loop at {} msg/s", c.rate)
        } else {
            "closed loop".into()
        };
        let _ = writeln!(
            s,
            "{} publisher(s) x {} stream(s) -> {} subscriber(s){} on {}, {} B messages, batch {}, {mode}",
            c.publishers, c.streams, c.subscribers, if c.group { " (one group)" } else { "" }, c.topic, c.payload_size, c.batch
        );
        if let Some(addr) = &c.sub_addr {
            let _ = writeln!(
                s,
                "subscribers connected to {addr} (another broker than the publishers')"
            );
        }
        let pub_rate = self.sent as f64 / self.publish_secs.max(1e-9);
        let _ = writeln!(
            s,
            "published {:>12} msgs  {:>12.0} msg/s  {:>8.1} MB/s",
            self.sent,
            pub_rate,
            pub_rate * c.payload_size as f64 / 1e6
        );
        for (i, r) in self.subscribers.iter().enumerate() {
            let _ = writeln!(
                s,
                "sub {i:<5} {:>12} msgs  {:>12.0} msg/s  {:>8.1} MB/s  dup {}",
                r.received,
                r.msgs_per_s,
                r.msgs_per_s * c.payload_size as f64 / 1e6,
                r.duplicates
            );
        }
        let foreign: u64 = self.subscribers.iter().map(|r| r.foreign).sum();
        if foreign > 0 {
            let _ = writeln!(
                s,
                "ignored   {foreign} message(s) on {} that were not this run's (someone else \
                 publishes to it: choose another --topic)",
                c.topic
            );
        }
        let _ = writeln!(
            s,
            "delivered {:>12.0} msg/s aggregate  {:>8.1} MB/s",
            self.delivered_msgs_per_s,
            self.delivered_msgs_per_s * c.payload_size as f64 / 1e6
        );
        let _ = writeln!(
            s,
            "latency   p50 {:.1} us  p90 {:.1} us  p99 {:.1} us  p99.9 {:.1} us  max {:.1} us  ({} samples)",
            self.percentile_us(0.5),
            self.percentile_us(0.9),
            self.percentile_us(0.99),
            self.percentile_us(0.999),
            self.latency.max() as f64 / 1e3,
            self.latency.len()
        );
        if c.rate > 0.0 {
            let _ = writeln!(
                s,
                "pacing    {:.0} msg/s achieved of {:.0}; the latest send began {:.1} us after it was due",
                pub_rate,
                c.rate,
                self.pacer_max_late_ns as f64 / 1e3
            );
        }
        let _ = writeln!(s, "lost      {}  duplicated {}", self.lost, self.duplicates);
        s
    }

    /// Machine-readable summary (keys follow `shared/peerbench`'s RESULT lines).
    pub fn json(&self) -> serde_json::Value {
        let c = &self.config;
        let pub_rate = self.sent as f64 / self.publish_secs.max(1e-9);
        serde_json::json!({
            "mode": if c.rate > 0.0 { "aqueduct-latency" } else { "aqueduct-throughput" },
            "msgs": self.sent,
            "size": c.payload_size,
            "batch": c.batch,
            "pubs": c.publishers,
            "streams": c.streams,
            "subs": c.subscribers,
            "group": c.group,
            "overflow": c.overflow.map(OverflowPolicy::as_str),
            "rate": c.rate,
            "sub_addr": c.sub_addr,
            "pub_msgs_per_s": pub_rate,
            "pacer_max_late_us": self.pacer_max_late_ns as f64 / 1e3,
            "pub_mb_per_s": pub_rate * c.payload_size as f64 / 1e6,
            "delivered_msgs_per_s": self.delivered_msgs_per_s,
            "sub_min_msgs_per_s": self.subscribers.iter().map(|r| r.msgs_per_s).fold(f64::INFINITY, f64::min),
            "lost_total": self.lost,
            "duplicates_total": self.duplicates,
            "subscribers": self.subscribers.iter().map(|r| serde_json::json!({
                "received": r.received, "duplicates": r.duplicates, "foreign": r.foreign, "msgs_per_s": r.msgs_per_s, "secs": r.secs,
            })).collect::<Vec<_>>(),
            "latency": {
                "p50_us": self.percentile_us(0.5),
                "p90_us": self.percentile_us(0.9),
                "p99_us": self.percentile_us(0.99),
                "p999_us": self.percentile_us(0.999),
                "max_us": self.latency.max() as f64 / 1e3,
                "samples": self.latency.len(),
            },
            "warmup_msgs": c.warmup,
        })
    }
}

/// Explain losses from the broker's counters for `topic`, read from its metrics endpoint.
pub async fn explain_losses(metrics_addr: &str, topic: &str) -> String {
    let text = match fetch_metrics(metrics_addr).await {
        Ok(t) => t,
        Err(e) => {
            return format!(
                "the broker's metrics at {metrics_addr} are not reachable ({e}); cannot say why"
            )
        }
    };
    let mut reasons = Vec::new();
    for line in text.lines() {
        let is_topic = line.contains(&format!("topic=\"{topic}\""));
        if !is_topic {
            continue;
        }
        let value = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if value <= 0.0 {
            continue;
        }
        if line.starts_with("aqueduct_messages_dropped_total") {
            let policy = line
                .split("policy=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .unwrap_or("?");
            reasons.push(format!("{value} dropped by policy {policy} (a subscriber's queue was full: slow subscriber)"));
        } else if line.starts_with("aqueduct_messages_expired_total") {
            let p = line
                .split("priority=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .unwrap_or("?");
            reasons.push(format!(
                "{value} expired at priority {p} (TTL passed before delivery)"
            ));
        }
    }
    if reasons.is_empty() {
        "the broker counted no drops or expiries for the topic: messages were lost in transit or the subscribers stopped waiting (try a longer --idle)".to_string()
    } else {
        format!("broker counters for {topic}: {}", reasons.join("; "))
    }
}

async fn fetch_metrics(addr: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: aqueduct\r\n\r\n")
            .await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "timed out",
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pacer's sleeps end on time (1 ns slack, not Linux's default 50 µs), as peerbench's.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_pacer_asks_for_tight_timer_slack() {
        let slack = std::thread::spawn(|| {
            let before = rustix::thread::current_timer_slack().expect("slack");
            tight_timer_slack();
            (
                before,
                rustix::thread::current_timer_slack().expect("slack"),
            )
        })
        .join()
        .expect("thread");
        assert_eq!(slack.1, 1, "{slack:?}");
    }

    #[test]
    fn priority_mix() {
        let mix = parse_priority_mix("0:1,2:3").expect("valid");
        let ps: Vec<u8> = (0..8)
            .filter_map(|i| priority_of(i, &mix))
            .map(|p| p.level())
            .collect();
        assert_eq!(ps, [0, 2, 2, 2, 0, 2, 2, 2]);
        assert!(parse_priority_mix("4:1").is_err());
        assert!(parse_priority_mix("0").is_err());
        assert!(parse_priority_mix("0:0,1:0").is_err(), "no weight at all");
        assert!(parse_priority_mix("0:4294967295,1:1").is_err(), "past u32");
        assert_eq!(parse_priority_mix(""), Ok(Vec::new()));
        assert_eq!(priority_of(3, &[]), None);
    }

    #[test]
    fn recorder_counts_duplicates_and_latency() {
        let epoch = Instant::now();
        let mut buf = BytesMut::new();
        let mut rec = Recorder::new(10, 32, 0, false);
        let at = |ns: u64| (epoch + Duration::from_nanos(ns), ns);
        let a = payload(&mut buf, 1_000, 3, 32);
        rec.record(at(6_000), &a);
        rec.record(at(6_000), &a);
        rec.record(at(9_000), &payload(&mut buf, 1_000, 70, 32));
        rec.flush();
        assert_eq!((rec.received, rec.duplicates), (3, 1));
        // Two of 5 µs (one run), one of 8 µs.
        assert_eq!(rec.latency.len(), 3);
        assert_eq!(rec.latency.count_at(5_000), 2);
        assert_eq!(rec.latency.count_at(8_000), 1);
        // Nothing is lost when the run is flushed twice.
        rec.flush();
        assert_eq!(rec.latency.len(), 3);
        assert_eq!(a.len(), 32);
    }

    /// Messages numbered below the warm-up are counted as received but not timed.
    #[test]
    fn the_warm_up_is_received_but_not_timed() {
        let epoch = Instant::now();
        let mut buf = BytesMut::new();
        let mut rec = Recorder::new(10, 32, 5, true);
        let at = |ns: u64| (epoch + Duration::from_nanos(ns), ns);
        for (index, late) in [(0, 900_000), (4, 700_000), (5, 3_000), (9, 4_000)] {
            rec.record(at(1_000 + late), &payload(&mut buf, 1_000, index, 32));
        }
        // The trace holds what was timed, nothing else.
        assert_eq!(rec.trace, Some(vec![(1_000, 3_000), (1_000, 4_000)]));
        rec.flush();
        assert_eq!((rec.received, rec.duplicates), (4, 0));
        assert_eq!(rec.latency.len(), 2, "only numbers 5 and 9");
        assert!(
            rec.latency.max() < 10_000,
            "the warm-up's 700 µs are not in it"
        );
    }

    /// Messages on the bench's topic that are not the run's are neither counted nor timed: a
    /// foreign one of 16 bytes or more was read as an index, grew the seen-set to it (an abort
    /// on an allocation of exabytes) and counted as received, which could hide a lost message.
    #[test]
    fn foreign_messages_are_not_the_runs() {
        let epoch = Instant::now();
        let mut buf = BytesMut::new();
        let mut rec = Recorder::new(10, 32, 0, false);
        let at = |ns: u64| (epoch + Duration::from_nanos(ns), ns);
        let mut huge = payload(&mut buf, 1_000, 0, 32).to_vec();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut unfilled = payload(&mut buf, 1_000, 2, 32).to_vec();
        unfilled[31] = b'x';
        for foreign in [
            &b"xxxxxxxxxxxxxxxxxxxxxxxx"[..],
            b"short",
            &huge,
            &unfilled,
            &payload(&mut buf, 1_000, 1, 33),
        ] {
            assert!(!rec.record(at(2_000), foreign), "{foreign:?}");
        }
        assert!(rec.record(at(2_000), &payload(&mut buf, 1_000, 1, 32)));
        assert_eq!((rec.received, rec.foreign), (1, 5));
        assert!(rec.seen.len() <= 1, "{}", rec.seen.len());
        rec.flush();
        assert_eq!(rec.latency.len(), 1);
    }
}
