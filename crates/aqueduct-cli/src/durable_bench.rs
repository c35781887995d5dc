//! `aqueduct bench-durable`: the durable log under load, against a broker with `aal.enabled`.
//!
//! - `publish`: one connection publishes `--messages` messages with CONFIRM, in batches of
//!   `--batch`, keeping up to `--window` batches awaiting their CONFIRM (as a JetStream publisher
//!   keeps several publish acks outstanding). Every message counts only once confirmed, i.e.
//!   durable as `aal.fsync` says.
//! - `replay`: a new durable consumer reads a topic from `earliest` (messages settled as
//!   written) until it has `--messages` of them: the log's read-back rate.
//!
//! Both print one line of text, or one JSON object with `--json`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_client::{Client, ClientError, DurableStart, PublishOptions, SubscribeOptions};
use bytes::Bytes;
use futures_util::StreamExt;

/// What to measure.
#[derive(Debug, Clone)]
pub enum Mode {
    Publish { batch: usize, window: usize },
    Replay { consumer: String },
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct Report {
    pub mode: &'static str,
    pub messages: u64,
    pub secs: f64,
    pub msgs_per_s: f64,
}

impl Report {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": self.mode,
            "messages": self.messages,
            "secs": self.secs,
            "msgs_per_s": self.msgs_per_s,
        })
    }

    pub fn text(&self) -> String {
        format!(
            "{}: {} messages in {:.2} s = {:.0} msg/s",
            self.mode, self.messages, self.secs, self.msgs_per_s
        )
    }
}

/// Run `mode` over `messages` messages of `payload_size` bytes on `topic`.
pub async fn run(
    client: Client,
    mode: Mode,
    topic: &str,
    messages: u64,
    payload_size: usize,
    progress: Option<indicatif::ProgressBar>,
) -> Result<Report, ClientError> {
    let started = Instant::now();
    let name = match &mode {
        Mode::Publish { batch, window } => {
            publish(
                &client,
                topic,
                messages,
                payload_size,
                *batch,
                *window,
                &progress,
            )
            .await?;
            "confirmed publish"
        }
        Mode::Replay { consumer } => {
            replay(&client, topic, messages, consumer, &progress).await?;
            "replay"
        }
    };
    let secs = started.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    client.close().await?;
    Ok(Report {
        mode: name,
        messages,
        secs,
        msgs_per_s: messages as f64 / secs.max(1e-9),
    })
}

async fn publish(
    client: &Client,
    topic: &str,
    messages: u64,
    payload_size: usize,
    batch: usize,
    window: usize,
    progress: &Option<indicatif::ProgressBar>,
) -> Result<(), ClientError> {
    let body = Bytes::from(vec![b'x'; payload_size]);
    let next = Arc::new(AtomicU64::new(0));
    let confirm = PublishOptions {
        confirm: true,
        ..PublishOptions::default()
    };
    // A JoinSet: the first failure returns, and dropping the set stops the other publishers.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..window.max(1) {
        let (client, next, body, topic, confirm, progress) = (
            client.clone(),
            next.clone(),
            body.clone(),
            topic.to_string(),
            confirm.clone(),
            progress.clone(),
        );
        tasks.spawn(async move {
            loop {
                let first = next.fetch_add(batch as u64, Ordering::Relaxed);
                if first >= messages {
                    return Ok::<(), ClientError>(());
                }
                let n = (messages - first).min(batch as u64) as usize;
                let items = (0..n).map(|_| (topic.as_str(), body.clone()));
                let offsets = client.publish_batch(items, &confirm).await?;
                if offsets.map_or(0, |o| o.len()) != n {
                    return Err(ClientError::Connection(
                        "a confirmed batch came back without an offset per message".into(),
                    ));
                }
                if let Some(p) = &progress {
                    p.inc(n as u64);
                }
            }
        });
    }
    while let Some(t) = tasks.join_next().await {
        t.map_err(|e| ClientError::Connection(format!("publisher task: {e}")))??;
    }
    Ok(())
}

async fn replay(
    client: &Client,
    topic: &str,
    messages: u64,
    consumer: &str,
    progress: &Option<indicatif::ProgressBar>,
) -> Result<(), ClientError> {
    let opts = SubscribeOptions {
        durable: Some((consumer.to_string(), DurableStart::Earliest)),
        ..SubscribeOptions::default()
    };
    let mut sub = client.subscribe_with(topic, &opts).await?;
    let mut got = 0u64;
    while got < messages {
        let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .map_err(|_| {
                ClientError::Connection(format!(
                    "replay stalled after {got} of {messages} messages (10 s without one)"
                ))
            })?;
        match m {
            Some(Ok(_)) => {
                got += 1;
                if got.is_multiple_of(4096) {
                    if let Some(p) = progress {
                        p.set_position(got);
                    }
                }
            }
            Some(Err(e)) => return Err(e),
            None => {
                return Err(ClientError::Connection(format!(
                    "the subscription ended after {got} of {messages} messages"
                )))
            }
        }
    }
    let _ = sub.close().await;
    Ok(())
}
