//! Spinning before a runtime worker sleeps: [`IdleSpin`].
//!
//! A tokio worker that runs out of tasks sleeps in `epoll_wait` (or on a condition variable),
//! and the CPU it ran on goes idle. On many virtual machines an idle vCPU halts at once
//! (cpuidle driver `haltpoll` with `guest_halt_poll_ns` 0, or no idle polling at all), and the
//! next packet then waits for the hypervisor to wake it: ~30 µs of every message's latency at
//! 10,000 msg/s on such a VM (docs/benchmarks.md, "The idle vCPU's wake-up"). Go's scheduler,
//! and so nats-server, spins a little before it sleeps for the same reason.
//!
//! With an [`IdleSpin`] installed as the runtime's `on_thread_park` and `on_thread_unpark`
//! hooks, a worker about to sleep first watches, for up to its `max`, whether any endpoint
//! socket made by this crate's [`runtime`](crate::runtime) has a datagram waiting, or a task
//! was queued from outside the runtime; on either it goes on to sleep at once, and the
//! runtime's own wait returns at once without a wake-up. Between looks it calls
//! `sched_yield`, so a thread of any other process, or of this one, that wants the CPU gets
//! it: the spin takes only cycles that would otherwise be idle.
//!
//! It spins only while it pays: a worker spins before a sleep only if its previous stretch
//! without work (its spin and its sleep together) was no longer than `max`. So an idle broker
//! never spins, and one receiving messages further apart than `max` (when a spin could not
//! reach the next one) spins at most once per burst; messages closer together than `max` keep
//! the worker looking. Spinning is counted in [`stats`].

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counters of every [`IdleSpin`] in the process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdleSpinStats {
    /// Spins that ended because work arrived (a datagram or a queued task).
    pub found_work: u64,
    /// Spins that reached their `max` without work; the worker then slept.
    pub expired: u64,
    /// Time spent spinning, summed over the threads, in nanoseconds.
    pub spin_nanos: u64,
}

static FOUND_WORK: AtomicU64 = AtomicU64::new(0);
static EXPIRED: AtomicU64 = AtomicU64::new(0);
static SPIN_NANOS: AtomicU64 = AtomicU64::new(0);

/// The process's spin counters so far.
pub fn stats() -> IdleSpinStats {
    IdleSpinStats {
        found_work: FOUND_WORK.load(Ordering::Relaxed),
        expired: EXPIRED.load(Ordering::Relaxed),
        spin_nanos: SPIN_NANOS.load(Ordering::Relaxed),
    }
}

/// Spinning before a runtime worker sleeps, up to `max` (see the module documentation).
///
/// ```
/// let spin = aqueduct_udp::IdleSpin::new(std::time::Duration::from_micros(100));
/// let runtime = tokio::runtime::Builder::new_multi_thread()
///     .on_thread_park(spin.before_park())
///     .on_thread_unpark(spin.after_unpark())
///     .enable_all()
///     .build()
///     .unwrap();
/// # drop(runtime);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct IdleSpin {
    max: Duration,
    /// Whether a watched socket has a datagram waiting ([`sockets::readable`]; tests put
    /// their own).
    readable: fn() -> bool,
}

thread_local! {
    /// When this thread last began to park (its spin included).
    static PARKED_AT: Cell<Option<Instant>> = const { Cell::new(None) };
    /// How long this thread's last stretch without work lasted, spin and sleep together.
    static LAST_IDLE: Cell<Option<Duration>> = const { Cell::new(None) };
}

impl IdleSpin {
    /// Spin for at most `max` before each sleep; zero never spins.
    pub fn new(max: Duration) -> IdleSpin {
        IdleSpin {
            max,
            readable: sockets::readable,
        }
    }

    /// The hook for `tokio::runtime::Builder::on_thread_park`.
    pub fn before_park(&self) -> impl Fn() + Send + Sync + 'static {
        let (max, readable) = (self.max, self.readable);
        move || {
            if max.is_zero() {
                return;
            }
            let start = Instant::now();
            PARKED_AT.with(|p| p.set(Some(start)));
            if !worth_spinning(LAST_IDLE.with(Cell::get), max) {
                return;
            }
            let queued = tokio::runtime::Handle::try_current()
                .ok()
                .map(|h| h.metrics());
            let found = spin_until(start + max, || {
                readable() || queued.as_ref().is_some_and(|m| m.global_queue_depth() > 0)
            });
            let counter = if found { &FOUND_WORK } else { &EXPIRED };
            counter.fetch_add(1, Ordering::Relaxed);
            let spun = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            SPIN_NANOS.fetch_add(spun, Ordering::Relaxed);
        }
    }

    /// The hook for `tokio::runtime::Builder::on_thread_unpark`: notes how long the thread
    /// was without work, which decides whether its next park spins.
    pub fn after_unpark(&self) -> impl Fn() + Send + Sync + 'static {
        let max = self.max;
        move || {
            if max.is_zero() {
                return;
            }
            if let Some(at) = PARKED_AT.with(Cell::take) {
                LAST_IDLE.with(|l| l.set(Some(at.elapsed())));
            }
        }
    }
}

/// Spin only if the last stretch without work was short enough for a spin to have bridged it
/// (none yet: no).
fn worth_spinning(last_idle: Option<Duration>, max: Duration) -> bool {
    last_idle.is_some_and(|idle| idle <= max)
}

/// Look at `found` until it says yes (true) or `deadline` passes (false), yielding the CPU
/// between looks.
fn spin_until(deadline: Instant, mut found: impl FnMut() -> bool) -> bool {
    loop {
        if found() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The endpoint sockets to watch: every socket this crate's runtime wrapped and has not
/// dropped yet.
#[cfg(unix)]
pub(crate) mod sockets {
    use std::os::fd::RawFd;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use super::RefCell;

    static SOCKETS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());
    /// Bumped at every change of `SOCKETS`, so that a thread's copy is renewed only then.
    static GENERATION: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// This thread's copy of `SOCKETS` as `poll` takes it, and its generation.
        static COPY: RefCell<(u64, Vec<libc::pollfd>)> = const { RefCell::new((u64::MAX, Vec::new())) };
    }

    /// Watch `fd` from now on. It must be [`forget`]-ed before it is closed.
    pub(crate) fn watch(fd: RawFd) {
        if let Ok(mut fds) = SOCKETS.lock() {
            fds.push(fd);
            GENERATION.fetch_add(1, Ordering::Release);
        }
    }

    /// Stop watching `fd`. (A spin that copied the list just before may look at it once more:
    /// if the number was reused meanwhile, it may see a readable descriptor that is not a
    /// socket of ours, and the worker sleeps a spin early. Nothing worse.)
    pub(crate) fn forget(fd: RawFd) {
        if let Ok(mut fds) = SOCKETS.lock() {
            if let Some(i) = fds.iter().position(|&f| f == fd) {
                fds.swap_remove(i);
                GENERATION.fetch_add(1, Ordering::Release);
            }
        }
    }

    /// Whether any watched socket has a datagram waiting.
    pub(crate) fn readable() -> bool {
        COPY.with(|copy| {
            let mut copy = copy.borrow_mut();
            let generation = GENERATION.load(Ordering::Acquire);
            if copy.0 != generation {
                let Ok(fds) = SOCKETS.lock() else {
                    return false;
                };
                copy.1.clear();
                copy.1.extend(fds.iter().map(|&fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                }));
                copy.0 = generation;
            }
            any_readable(&mut copy.1)
        })
    }

    /// Whether any of `fds` is readable (`poll` with no timeout).
    pub(crate) fn any_readable(fds: &mut [libc::pollfd]) -> bool {
        if fds.is_empty() {
            return false;
        }
        let count = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
        // SAFETY: `fds` is a live, exclusively borrowed array of `count` initialised `pollfd`s,
        // which `poll` only reads and writes within; a timeout of 0 returns at once. A
        // descriptor closed meanwhile is reported in `revents` (POLLNVAL), not a memory error.
        #[allow(unsafe_code)]
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), count, 0) };
        ready > 0
    }

    /// How many sockets are watched.
    #[cfg(test)]
    pub(crate) fn watched(fd: RawFd) -> bool {
        SOCKETS.lock().is_ok_and(|fds| fds.contains(&fd))
    }
}

/// Elsewhere nothing is watched: a spin ends on queued tasks or its deadline only.
#[cfg(not(unix))]
pub(crate) mod sockets {
    pub(crate) fn readable() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_only_after_a_short_stretch_without_work() {
        let max = Duration::from_micros(100);
        assert!(!worth_spinning(None, max), "no stretch seen yet");
        assert!(worth_spinning(Some(Duration::from_micros(40)), max));
        assert!(worth_spinning(Some(max), max));
        assert!(!worth_spinning(Some(Duration::from_micros(101)), max));
        assert!(
            !worth_spinning(Some(Duration::from_secs(5)), max),
            "an idle broker"
        );
    }

    #[test]
    fn a_spin_ends_when_work_is_found_or_at_its_deadline() {
        let mut looks = 0;
        let far = Instant::now() + Duration::from_secs(3600);
        assert!(spin_until(far, || {
            looks += 1;
            looks == 3
        }));
        assert_eq!(looks, 3);
        assert!(!spin_until(Instant::now(), || false));
    }

    /// A datagram arriving at a socket ends a spin whose deadline is an hour away; with none
    /// waiting, the socket is not readable.
    #[cfg(unix)]
    #[test]
    fn a_datagram_ends_the_spin() {
        use std::os::fd::AsRawFd;
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = socket.local_addr().expect("addr");
        let fd = socket.as_raw_fd();
        let mut fds = [libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }];
        assert!(!sockets::any_readable(&mut fds));
        let far = Instant::now() + Duration::from_secs(3600);
        let spinner =
            std::thread::spawn(move || spin_until(far, || sockets::any_readable(&mut fds)));
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sender.send_to(b"x", addr).expect("send");
        assert!(spinner.join().expect("spinner"));
    }

    /// The runtime's sockets are watched while they live.
    #[cfg(unix)]
    #[test]
    fn the_runtime_s_sockets_are_watched_while_they_live() {
        use std::os::fd::AsRawFd;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _guard = runtime.enter();
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let fd = socket.as_raw_fd();
        let wrapped = crate::runtime().wrap_udp_socket(socket).expect("wrap");
        assert!(sockets::watched(fd));
        drop(wrapped);
        assert!(!sockets::watched(fd));
    }

    /// A spin watches the runtime's queue of tasks from outside: one queued while the only
    /// worker is held up ends a spin whose deadline is two minutes away, and counts as found
    /// work. With nothing queued, a short spin ends at its deadline and counts as expired.
    #[test]
    fn a_task_queued_from_outside_ends_the_spin() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        // Hold the only worker, so that a task spawned from outside stays queued.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (holding, is_held) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            holding.send(()).expect("send");
            let _ = held.recv();
        });
        is_held.recv().expect("the worker is held");

        let handle = runtime.handle().clone();
        let (done, finished) = std::sync::mpsc::channel();
        let (spinning, is_spinning) = std::sync::mpsc::channel();
        let parker = std::thread::spawn(move || {
            let _entered = handle.enter();
            let run = |max| {
                // The process's sockets are left out: other tests' may be readable.
                let spin = IdleSpin {
                    max,
                    readable: || false,
                };
                let (park, unpark) = (spin.before_park(), spin.after_unpark());
                park();
                unpark(); // a short stretch without work: the next park spins
                park();
            };
            let before = stats();
            run(Duration::from_millis(10));
            let short = stats();
            spinning.send(()).expect("send");
            run(Duration::from_secs(120));
            done.send((before, short, stats())).expect("send");
        });
        is_spinning.recv().expect("spinning");
        let (ran, task_ran) = std::sync::mpsc::channel();
        runtime.spawn(async move { ran.send(()).expect("send") });
        let (before, short, after) = finished
            .recv_timeout(Duration::from_secs(30))
            .expect("the spin saw the queued task");
        parker.join().expect("parker");
        assert!(short.expired > before.expired, "{before:?} {short:?}");
        assert!(after.found_work > short.found_work, "{short:?} {after:?}");
        release.send(()).expect("release");
        task_ran
            .recv_timeout(Duration::from_secs(30))
            .expect("the task ran");
    }
}
