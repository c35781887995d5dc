//! Noise floor of the box: how late does a paced OS thread wake up?
//! Same pacing loop as the latency subcommands (absolute schedule,
//! thread::sleep, 1 ns timer slack), no I/O. If p99.9/max here are already
//! milliseconds, no latency figure on this box can be better than that.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{Value, json};

use crate::common;

#[derive(Args, Debug, Clone)]
pub struct JitterArgs {
    /// Wake-ups per second.
    #[arg(long, default_value_t = 10_000.0)]
    rate: f64,
    /// Duration.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
}

pub async fn timer_jitter(a: JitterArgs) -> anyhow::Result<Value> {
    let total = (a.rate * a.secs).round() as u64;
    let rate = a.rate;
    let h = tokio::task::spawn_blocking(move || {
        crate::common::tight_timer_slack();
        let mut h = common::new_hist();
        let period_ns = 1e9 / rate;
        let start = Instant::now();
        for i in 0..total {
            let target = start + Duration::from_nanos((period_ns * i as f64) as u64);
            let now = Instant::now();
            if now < target {
                std::thread::sleep(target - now);
            }
            common::record_ns(
                &mut h,
                Instant::now().saturating_duration_since(target).as_nanos() as u64,
            );
        }
        h
    })
    .await?;
    println!("config: rate={} wakeups/s secs={}", a.rate, a.secs);
    let lat = common::latency_report("wake-up lateness", &h);
    Ok(json!({"mode": "timer-jitter", "rate": a.rate, "secs": a.secs, "latency": lat}))
}
