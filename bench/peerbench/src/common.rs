//! Shared helpers: process-wide monotonic clock, latency histograms,
//! fixed-rate pacing on a dedicated OS thread, and CPU-time sampling.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{Value, json};

static ORIGIN: OnceLock<Instant> = OnceLock::new();

pub fn init_clock() {
    let _ = ORIGIN.get_or_init(Instant::now);
}

/// Nanoseconds since process start on the monotonic clock. Publisher and
/// subscriber live in the same process, so one-way latency = recv - send.
pub fn now_ns() -> u64 {
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Histogram of nanoseconds, 1 ns .. 60 s, 3 significant figures.
pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

pub fn record_ns(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record(ns.max(1));
}

/// Prints and returns p50/p90/p99/p99.9/max in microseconds.
pub fn latency_report(name: &str, h: &Histogram<u64>) -> Value {
    let us = |ns: u64| ns as f64 / 1000.0;
    let v = json!({
        "count": h.len(),
        "p50_us": us(h.value_at_quantile(0.50)),
        "p90_us": us(h.value_at_quantile(0.90)),
        "p99_us": us(h.value_at_quantile(0.99)),
        "p999_us": us(h.value_at_quantile(0.999)),
        "max_us": us(h.max()),
        "mean_us": h.mean() / 1000.0,
        "min_us": us(h.min()),
    });
    println!(
        "{name}: n={} p50={:.1}us p90={:.1}us p99={:.1}us p99.9={:.1}us max={:.1}us (min={:.1}us mean={:.1}us)",
        h.len(),
        v["p50_us"].as_f64().unwrap(),
        v["p90_us"].as_f64().unwrap(),
        v["p99_us"].as_f64().unwrap(),
        v["p999_us"].as_f64().unwrap(),
        v["max_us"].as_f64().unwrap(),
        v["min_us"].as_f64().unwrap(),
        v["mean_us"].as_f64().unwrap(),
    );
    v
}

pub struct PaceStats {
    pub sent: u64,
    pub elapsed: Duration,
    /// Worst lateness of a send versus its schedule.
    pub max_late: Duration,
}

/// Calls `f(seq)` `total` times at `rate` per second on the *current* OS
/// thread (intended to be a dedicated `std::thread`). Uses absolute
/// schedule times (start + i/rate) and `thread::sleep`, which on Linux is an
/// hrtimer; timer slack is lowered to 1 ns for this thread so pacing is
/// within a few µs rather than tokio's 1 ms timer wheel. Stops after `total`
/// sends or when `hard_deadline` elapses, whichever is first.
pub fn paced<F>(
    rate: f64,
    total: u64,
    hard_deadline: Duration,
    mut f: F,
) -> anyhow::Result<PaceStats>
where
    F: FnMut(u64) -> anyhow::Result<()>,
{
    tight_timer_slack();
    let period_ns = (1e9 / rate).max(1.0);
    let start = Instant::now();
    let mut max_late = Duration::ZERO;
    let mut sent = 0;
    for i in 0..total {
        let target = start + Duration::from_nanos((period_ns * i as f64) as u64);
        let now = Instant::now();
        if now < target {
            std::thread::sleep(target - now);
        } else {
            max_late = max_late.max(now - target);
        }
        if start.elapsed() > hard_deadline {
            break;
        }
        f(i)?;
        sent += 1;
    }
    Ok(PaceStats {
        sent,
        elapsed: start.elapsed(),
        max_late,
    })
}

/// user+system CPU seconds of this process.
pub fn self_cpu_secs() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a zeroed rusage struct.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// user+system CPU seconds of another process (e.g. nats-server) from
/// /proc/PID/stat; None if unreadable.
pub fn pid_cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the ")" of comm: state is field 3; utime=14, stime=15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / hz)
}

/// Samples CPU of this process and optionally a peer server process.
pub struct CpuMeter {
    self0: f64,
    peer: Option<(u32, f64)>,
    t0: Instant,
}

impl CpuMeter {
    pub fn start(peer_pid: Option<u32>) -> Self {
        let peer = peer_pid.and_then(|p| pid_cpu_secs(p).map(|c| (p, c)));
        CpuMeter {
            self0: self_cpu_secs(),
            peer,
            t0: Instant::now(),
        }
    }

    /// Returns json {wall_s, client_cpu_s, server_cpu_s?} and prints a line.
    pub fn stop(&self) -> Value {
        self.stop_active(None)
    }

    /// Like `stop`, but percentages are relative to `active_s` (the busy
    /// part of the run) instead of the whole measured wall time, which may
    /// include idle drain waits. CPU seconds are totals either way.
    pub fn stop_active(&self, active_s: Option<f64>) -> Value {
        let wall = active_s.unwrap_or_else(|| self.t0.elapsed().as_secs_f64());
        let me = self_cpu_secs() - self.self0;
        let peer = self
            .peer
            .and_then(|(p, c0)| pid_cpu_secs(p).map(|c| c - c0));
        match peer {
            Some(pc) => println!(
                "cpu: active={wall:.2}s peerbench={me:.2}s ({:.0}% of one core) server={pc:.2}s ({:.0}%)",
                100.0 * me / wall,
                100.0 * pc / wall
            ),
            None => println!(
                "cpu: active={wall:.2}s peerbench={me:.2}s ({:.0}% of one core)",
                100.0 * me / wall
            ),
        }
        json!({"active_s": wall, "client_cpu_s": me, "server_cpu_s": peer})
    }
}

pub fn mb_per_s(msgs: u64, size: usize, secs: f64) -> f64 {
    msgs as f64 * size as f64 / 1e6 / secs
}

/// Ask for 1 ns timer slack on the calling thread (the default 50 µs blurs paced sends).
pub fn tight_timer_slack() {
    // SAFETY: prctl(PR_SET_TIMERSLACK) only affects the calling thread.
    unsafe {
        libc::prctl(
            libc::PR_SET_TIMERSLACK,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        );
    }
}
