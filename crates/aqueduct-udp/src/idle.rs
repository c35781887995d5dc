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
//! hooks (and [`IdleSpin::start`]ed on it), a worker about to sleep first watches, for up to
//! its `max`, whether any endpoint socket made by this crate's [`runtime`](crate::runtime) has
//! a datagram waiting, or a task was queued from outside the runtime; on either it goes on to
//! sleep at once. For a datagram the runtime's own wait then returns at once, without a
//! wake-up. A queued task is different: tokio calls the hook before it counts the worker as
//! asleep, so whoever queued the task woke nobody, and a worker that is not searching for work
//! does not look at the queue again before it sleeps. So the spin *kicks* the runtime (a
//! datagram to a socket of its own, which a task of the runtime reads), and the sleep that
//! follows ends at once. Between looks it calls `sched_yield`, so a thread of any other
//! process, or of this one, that wants the CPU gets it: the spin takes only cycles that would
//! otherwise be idle.
//!
//! It spins only while it pays: a worker spins before a sleep only if its previous stretch
//! without work (its spin and its sleep together) was no longer than `max`. Every wake-up
//! counts (a timer's too), not only messages: an idle broker does not spin, a broker receiving
//! messages further apart than `max` spins about once per stretch of idleness before the rule
//! sees it was long, and messages closer together than `max` keep the worker looking. While a
//! worker spins, tokio counts it as awake, so work that other workers queue waits for it (or
//! for them) for up to one spin. Spinning is counted in [`stats`].

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
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
/// # fn main() -> std::io::Result<()> {
/// let spin = aqueduct_udp::IdleSpin::new(std::time::Duration::from_micros(100));
/// let runtime = tokio::runtime::Builder::new_multi_thread()
///     .on_thread_park(spin.before_park())
///     .on_thread_unpark(spin.after_unpark())
///     .enable_all()
///     .build()?;
/// spin.start(runtime.handle())?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdleSpin {
    max: Duration,
    /// Whether a watched socket has a datagram waiting ([`sockets::readable`]; tests put
    /// their own).
    readable: fn() -> bool,
    /// The socket a spin that found a queued task sends to, once [`IdleSpin::start`]ed.
    kick: Arc<OnceLock<Arc<tokio::net::UdpSocket>>>,
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
            kick: Arc::default(),
        }
    }

    /// Make the socket a spin kicks and spawn the task reading it, on the runtime whose hooks
    /// these are. Without it, a task queued from outside during a spin may wait until another
    /// worker comes to the queue (see the module documentation).
    pub fn start(&self, runtime: &tokio::runtime::Handle) -> std::io::Result<()> {
        let _entered = runtime.enter();
        let socket = std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
        socket.connect(socket.local_addr()?)?;
        socket.set_nonblocking(true)?;
        let socket = Arc::new(tokio::net::UdpSocket::from_std(socket)?);
        let reader = Arc::clone(&socket);
        runtime.spawn(async move {
            let mut buf = [0u8; 16];
            while reader.recv(&mut buf).await.is_ok() {}
        });
        let _ = self.kick.set(socket);
        Ok(())
    }

    /// Wake the runtime: its next sleep ends at once.
    fn kick(kick: &OnceLock<Arc<tokio::net::UdpSocket>>) {
        if let Some(socket) = kick.get() {
            // A full buffer (the reader is behind) already means a wake-up is pending.
            let _ = socket.try_send(&[1]);
        }
    }

    /// The hook for `tokio::runtime::Builder::on_thread_park`.
    pub fn before_park(&self) -> impl Fn() + Send + Sync + 'static {
        let (max, readable, kick) = (self.max, self.readable, Arc::clone(&self.kick));
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
            let mut task_queued = false;
            let found = spin_until(start + max, || {
                task_queued = queued.as_ref().is_some_and(|m| m.global_queue_depth() > 0);
                task_queued || readable()
            });
            if task_queued {
                IdleSpin::kick(&kick);
            }
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

    /// Each watched socket's descriptor, and the id [`watch`] gave it.
    static SOCKETS: Mutex<Vec<(RawFd, u64)>> = Mutex::new(Vec::new());
    static NEXT_ID: AtomicU64 = AtomicU64::new(0);
    /// Bumped at every change of `SOCKETS`, so that a thread's copy is renewed only then.
    static GENERATION: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// This thread's copy of `SOCKETS` as `poll` takes it, and its generation.
        static COPY: RefCell<(u64, Vec<libc::pollfd>)> = const { RefCell::new((u64::MAX, Vec::new())) };
    }

    /// Watch `fd` from now on; returns the id to [`forget`] it by, which must be done
    /// before it is closed.
    pub(crate) fn watch(fd: RawFd) -> u64 {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut fds) = SOCKETS.lock() {
            fds.push((fd, id));
            GENERATION.fetch_add(1, Ordering::Release);
        }
        id
    }

    /// Stop watching `fd`. (A spin that copied the list just before may look at it once more:
    /// if the number was reused meanwhile, it may see a readable descriptor that is not a
    /// socket of ours, and the worker sleeps a spin early. Nothing worse.)
    pub(crate) fn forget(id: u64) {
        if let Ok(mut fds) = SOCKETS.lock() {
            if let Some(i) = fds.iter().position(|&(_, i)| i == id) {
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
                copy.1.extend(fds.iter().map(|&(fd, _)| libc::pollfd {
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
        // More than `poll` can take cannot happen (the sockets of one process); were it to,
        // nothing is reported readable rather than a count larger than the array.
        let Ok(count) = libc::nfds_t::try_from(fds.len()) else {
            return false;
        };
        // SAFETY: `fds` is a live, exclusively borrowed array of `count` initialised `pollfd`s,
        // which `poll` only reads and writes within; a timeout of 0 returns at once. A
        // descriptor closed meanwhile is reported in `revents` (POLLNVAL), not a memory error.
        #[allow(unsafe_code)]
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), count, 0) };
        // Only a datagram counts: an error or a closed descriptor (POLLERR, POLLNVAL) is not
        // work for the runtime.
        ready > 0 && fds.iter().any(|p| p.revents & libc::POLLIN != 0)
    }

    /// Whether the socket `watch` gave this id is watched.
    #[cfg(test)]
    pub(crate) fn watched(id: u64) -> bool {
        SOCKETS
            .lock()
            .is_ok_and(|fds| fds.iter().any(|&(_, i)| i == id))
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

    /// A datagram arriving at a socket ends a spin whose deadline is a minute away; with none
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let spinner =
            std::thread::spawn(move || spin_until(deadline, || sockets::any_readable(&mut fds)));
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sender.send_to(b"x", addr).expect("send");
        assert!(
            spinner.join().expect("spinner"),
            "no datagram seen in a minute"
        );
    }

    /// A closed descriptor is not work: `poll` reports it (POLLNVAL), but not as readable.
    #[cfg(unix)]
    #[test]
    fn a_closed_descriptor_is_not_readable() {
        let mut fds = [libc::pollfd {
            fd: i32::MAX,
            events: libc::POLLIN,
            revents: 0,
        }];
        assert!(!sockets::any_readable(&mut fds));
        assert_ne!(
            fds[0].revents & libc::POLLNVAL,
            0,
            "poll saw the bad descriptor"
        );
    }

    /// The registry: a socket is watched from `watch` to `forget`, by its id, and `readable`
    /// sees a datagram at a socket watched after its thread's copy of the list was made.
    #[cfg(unix)]
    #[test]
    fn watched_sockets_are_seen_until_forgotten() {
        use std::os::fd::AsRawFd;
        let _ = sockets::readable(); // makes this thread's copy of the list
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = socket.local_addr().expect("addr");
        let id = sockets::watch(socket.as_raw_fd());
        assert!(sockets::watched(id));
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        sender.send_to(b"x", addr).expect("send");
        let deadline = Instant::now() + Duration::from_secs(60);
        assert!(
            spin_until(deadline, sockets::readable),
            "the new socket was not seen"
        );
        sockets::forget(id);
        assert!(!sockets::watched(id));
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
                    kick: Arc::default(),
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

    /// A kick wakes a runtime whose only worker sleeps: it parks again afterwards.
    #[test]
    fn a_kick_wakes_the_sleeping_runtime() {
        let spin = IdleSpin::new(Duration::from_micros(1));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        spin.start(runtime.handle()).expect("start");
        let metrics = runtime.metrics();
        let parks = || metrics.worker_park_count(0);
        // Asleep: the reader task has run and waits for a datagram, and the worker's count of
        // parks stays put (checked every 50 ms: there is no event to wait on).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = parks();
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let now = parks();
            if now == last && now > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "the runtime never slept");
            last = now;
        }
        IdleSpin::kick(&spin.kick);
        let deadline = Instant::now() + Duration::from_secs(60);
        while parks() == last {
            assert!(Instant::now() < deadline, "the kick woke nothing");
            std::thread::yield_now();
        }
    }
}
