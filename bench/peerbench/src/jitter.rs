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
    /// Run one such thread pinned to each CPU at once, and report each CPU's stalls (wake-ups
    /// later than --stall-us, grouped into episodes) and how many of them overlapped a stall
    /// on another CPU: whether the box stalls as a whole or one vCPU at a time.
    #[arg(long)]
    per_cpu: bool,
    /// With --per-cpu: a wake-up later than this many µs is part of a stall.
    #[arg(long, default_value_t = 300.0)]
    stall_us: f64,
}

pub async fn timer_jitter(a: JitterArgs) -> anyhow::Result<Value> {
    if a.per_cpu {
        return tokio::task::spawn_blocking(move || per_cpu(&a)).await?;
    }
    let total = (a.rate * a.secs).round() as u64;
    let rate = a.rate;
    let h = tokio::task::spawn_blocking(move || {
        let mut h = common::new_hist();
        paced_wakeups(rate, total, Instant::now(), |target, woke| {
            common::record_ns(
                &mut h,
                woke.saturating_duration_since(target).as_nanos() as u64,
            );
        });
        h
    })
    .await?;
    println!("config: rate={} wakeups/s secs={}", a.rate, a.secs);
    let lat = common::latency_report("wake-up lateness", &h);
    Ok(json!({"mode": "timer-jitter", "rate": a.rate, "secs": a.secs, "latency": lat}))
}

/// Wake up `total` times, `rate` times a second on an absolute schedule from `start`, as the
/// latency subcommands pace (`thread::sleep`, 1 ns timer slack); after each wake-up call
/// `woke(target, when it woke)`.
fn paced_wakeups(rate: f64, total: u64, start: Instant, mut woke: impl FnMut(Instant, Instant)) {
    common::tight_timer_slack();
    let period_ns = 1e9 / rate;
    for i in 0..total {
        let target = start + Duration::from_nanos((period_ns * i as f64) as u64);
        let now = Instant::now();
        if now < target {
            std::thread::sleep(target - now);
        }
        woke(target, Instant::now());
    }
}

/// A stall seen by one CPU's thread: from the first late wake-up's target to the last late
/// wake-up's actual time, in ns since the start, and its worst lateness.
#[derive(Debug, Clone, Copy)]
struct Stall {
    from: u64,
    to: u64,
    worst: u64,
}

/// The CPUs this process may run on (its affinity mask, e.g. under `taskset` or a cpuset);
/// elsewhere, or if it cannot be read, 0..the number of CPUs.
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set, which sched_getaffinity(0, ..) fills
        // for the calling thread; CPU_ISSET reads within it for every cpu < CPU_SETSIZE.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// Pin the calling thread to `cpu` (Linux); false where that is not possible.
fn pin(cpu: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it for
        // cpu < CPU_SETSIZE (checked); sched_setaffinity(0, ..) affects the calling thread only.
        unsafe {
            if cpu >= libc::CPU_SETSIZE as usize {
                return false;
            }
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        false
    }
}

fn per_cpu(a: &JitterArgs) -> anyhow::Result<Value> {
    let cpus = allowed_cpus();
    let (rate, total) = (a.rate, (a.rate * a.secs).round() as u64);
    let stall_ns = (a.stall_us * 1e3) as u64;
    let start = Instant::now() + Duration::from_millis(10);
    let threads: Vec<_> = cpus
        .into_iter()
        .map(|cpu| {
            std::thread::spawn(move || {
                let pinned = pin(cpu);
                let mut h = common::new_hist();
                let mut stalls: Vec<Stall> = Vec::new();
                paced_wakeups(rate, total, start, |target, woke| {
                    let late = woke.saturating_duration_since(target).as_nanos() as u64;
                    common::record_ns(&mut h, late);
                    if late > stall_ns {
                        let at = |t: Instant| t.saturating_duration_since(start).as_nanos() as u64;
                        match stalls.last_mut() {
                            // Still catching up on the same stall.
                            Some(s) if at(target) <= s.to => {
                                s.to = at(woke);
                                s.worst = s.worst.max(late);
                            }
                            _ => stalls.push(Stall {
                                from: at(target),
                                to: at(woke),
                                worst: late,
                            }),
                        }
                    }
                });
                (cpu, pinned, h, stalls)
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in threads {
        results.push(
            t.join()
                .map_err(|_| anyhow::anyhow!("a jitter thread panicked"))?,
        );
    }
    println!(
        "config: rate={} wakeups/s secs={} per CPU, stall = later than {} us",
        a.rate, a.secs, a.stall_us
    );
    let mut per = Vec::new();
    for (cpu, pinned, h, stalls) in &results {
        let shared = stalls
            .iter()
            .filter(|s| {
                results.iter().any(|(other, _, _, os)| {
                    other != cpu && os.iter().any(|o| o.from <= s.to && s.from <= o.to)
                })
            })
            .count();
        let worst = stalls.iter().map(|s| s.worst).max().unwrap_or(0) as f64 / 1e3;
        let lat = common::latency_report(&format!("cpu {cpu} wake-up lateness"), h);
        println!(
            "cpu {cpu}{}: {} stalls (worst {worst:.0} us), {shared} of them overlapping a stall on another CPU",
            if *pinned { "" } else { " (not pinned)" },
            stalls.len()
        );
        per.push(
            json!({"cpu": cpu, "pinned": pinned, "stalls": stalls.len(), "overlapping": shared,
                        "worst_stall_us": worst, "latency": lat}),
        );
    }
    Ok(
        json!({"mode": "timer-jitter-per-cpu", "rate": a.rate, "secs": a.secs, "stall_us": a.stall_us, "cpus": per}),
    )
}
