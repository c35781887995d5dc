//! peerbench — peer-comparison load harness for the Aqueduct broker.
//!
//! Subcommands measure baselines on the local box (loopback only):
//!   * `nats-throughput` / `nats-latency` against a running nats-server,
//!   * `quic-ceiling` / `quic-latency` with an in-process quinn server + client.
//!
//! Every run prints human-readable lines and, last, one `RESULT {json}` line
//! that scripts (see `scripts/`) collect and aggregate.

mod common;
mod jitter;
mod js;
mod nats;
mod quic;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "peerbench",
    version,
    about = "Peer-comparison load harness (loopback only)"
)]
struct Cli {
    /// Tokio worker threads (default: number of CPUs).
    #[arg(long, global = true)]
    workers: Option<usize>,

    /// Free-form label copied into the RESULT line (e.g. "run=2").
    #[arg(long, global = true, default_value = "")]
    label: String,

    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// P publishers x S subscribers on one NATS subject, as fast as possible.
    NatsThroughput(nats::ThroughputArgs),
    /// One publisher at a fixed rate, one subscriber; one-way latency histogram.
    NatsLatency(nats::LatencyArgs),
    /// JetStream (file storage): publish with acks, a window of them outstanding.
    JsPublish(js::PublishArgs),
    /// JetStream: read a stream back with an ordered consumer.
    JsReplay(js::ReplayArgs),
    /// One quinn connection, one bidirectional stream, length-prefixed frames.
    QuicCeiling(quic::CeilingArgs),
    /// Fixed-rate timestamped frames over one quinn stream; one-way latency.
    QuicLatency(quic::LatencyArgs),
    /// Noise floor: lateness of a paced OS thread's wake-ups (no I/O).
    TimerJitter(jitter::JitterArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    common::init_clock();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(w) = cli.workers {
        rt.worker_threads(w);
    }
    let rt = rt.build()?;
    let label = cli.label.clone();
    let result = rt.block_on(async move {
        match cli.cmd {
            Cmd::NatsThroughput(a) => nats::throughput(a).await,
            Cmd::NatsLatency(a) => nats::latency(a).await,
            Cmd::JsPublish(a) => js::publish(a).await,
            Cmd::JsReplay(a) => js::replay(a).await,
            Cmd::QuicCeiling(a) => quic::ceiling(a).await,
            Cmd::QuicLatency(a) => quic::latency(a).await,
            Cmd::TimerJitter(a) => jitter::timer_jitter(a).await,
        }
    });
    // Do not wait for lingering background tasks (e.g. idle connections).
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    let mut v = result?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("label".into(), serde_json::Value::String(label));
    }
    println!("RESULT {v}");
    Ok(())
}
