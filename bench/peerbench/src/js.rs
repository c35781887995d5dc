//! NATS JetStream baselines (file storage): confirmed publish throughput and a consumer's
//! replay rate, against a running `nats-server -js`.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::Context;
use async_nats::jetstream::{self, stream::StorageType};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::common::CpuMeter;

#[derive(Args, Debug, Clone)]
pub struct PublishArgs {
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    url: String,
    /// Messages to publish (each counted once its publish ack arrived).
    #[arg(long, default_value_t = 1_000_000)]
    msgs: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// Publishes awaiting their ack at a time.
    #[arg(long, default_value_t = 800)]
    window: usize,
    /// The stream (created anew, file storage) and its subject.
    #[arg(long, default_value = "BENCH")]
    stream: String,
    #[arg(long, default_value = "bench.js")]
    subject: String,
    /// PID of nats-server, to report its CPU seconds during the run.
    #[arg(long)]
    server_pid: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    url: String,
    /// Messages to read back (the stream must hold at least this many).
    #[arg(long, default_value_t = 1_000_000)]
    msgs: u64,
    #[arg(long, default_value = "BENCH")]
    stream: String,
    #[arg(long)]
    server_pid: Option<u32>,
}

/// Publish with acks, `window` outstanding, into a fresh file-storage stream.
pub async fn publish(a: PublishArgs) -> anyhow::Result<Value> {
    let client = async_nats::connect(&a.url).await.context("connect")?;
    let js = jetstream::new(client);
    let _ = js.delete_stream(&a.stream).await;
    js.create_stream(jetstream::stream::Config {
        name: a.stream.clone(),
        subjects: vec![a.subject.clone()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await
    .context("create stream")?;
    let payload = Bytes::from(vec![b'x'; a.size]);
    let cpu = CpuMeter::start(a.server_pid);
    let started = Instant::now();
    let mut pending = VecDeque::with_capacity(a.window);
    let mut acked = 0u64;
    for _ in 0..a.msgs {
        if pending.len() >= a.window.max(1) {
            let ack: jetstream::context::PublishAckFuture =
                pending.pop_front().context("a pending ack")?;
            ack.await.context("publish ack")?;
            acked += 1;
        }
        let ack = js
            .publish(a.subject.clone(), payload.clone())
            .await
            .context("publish")?;
        pending.push_back(ack);
    }
    for ack in pending {
        ack.await.context("publish ack")?;
        acked += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let rate = acked as f64 / secs;
    println!("jetstream publish: {acked} acked in {secs:.2} s = {rate:.0} msg/s");
    Ok(json!({
        "bench": "js-publish",
        "msgs": acked,
        "size": a.size,
        "window": a.window,
        "secs": secs,
        "msgs_per_s": rate,
        "cpu": cpu.stop(),
    }))
}

/// Read the stream back with an ordered consumer (no acks), from its first message.
pub async fn replay(a: ReplayArgs) -> anyhow::Result<Value> {
    let client = async_nats::connect(&a.url).await.context("connect")?;
    let js = jetstream::new(client);
    let stream = js.get_stream(&a.stream).await.context("get stream")?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .context("create consumer")?;
    let cpu = CpuMeter::start(a.server_pid);
    let started = Instant::now();
    let mut messages = consumer.messages().await.context("messages")?;
    let mut got = 0u64;
    while got < a.msgs {
        match tokio::time::timeout(std::time::Duration::from_secs(10), messages.next()).await {
            Ok(Some(Ok(_))) => got += 1,
            Ok(Some(Err(e))) => anyhow::bail!("consumer error after {got}: {e}"),
            Ok(None) => anyhow::bail!("consumer ended after {got}"),
            Err(_) => anyhow::bail!("replay stalled after {got} of {}", a.msgs),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let rate = got as f64 / secs;
    println!("jetstream replay: {got} in {secs:.2} s = {rate:.0} msg/s");
    Ok(json!({
        "bench": "js-replay",
        "msgs": got,
        "secs": secs,
        "msgs_per_s": rate,
        "cpu": cpu.stop(),
    }))
}
