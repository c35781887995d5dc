//! The Unix implementation: see the crate documentation.

use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use quinn::{AsyncTimer, AsyncUdpSocket, UdpPoller};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// quinn's tokio runtime with read-only socket registration (see the crate documentation).
/// Timers and tasks are quinn's tokio ones.
#[derive(Debug)]
pub(crate) struct Runtime {
    tokio: quinn::TokioRuntime,
}

impl Runtime {
    pub(crate) fn new() -> Runtime {
        Runtime {
            tokio: quinn::TokioRuntime,
        }
    }
}

/// The socket registered with the current tokio reactor for reading only.
#[allow(unsafe_code)]
fn register_for_reading(socket: std::net::UdpSocket) -> io::Result<AsyncFd<std::net::UdpSocket>> {
    // SAFETY: a `UdpSocket` owns its descriptor and reports that one from `as_raw_fd`, and the
    // `AsyncFd` takes the socket by value, so the descriptor stays open and the same until the
    // `AsyncFd` (which deregisters it first) is dropped.
    Ok(unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }?)
}

/// A duplicate of `fd`, registered with the current tokio reactor for writing only.
#[allow(unsafe_code)]
fn register_duplicate_for_writing(fd: BorrowedFd<'_>) -> io::Result<AsyncFd<OwnedFd>> {
    let fd = fd.try_clone_to_owned()?;
    // SAFETY: as above: the `OwnedFd` is the duplicate's only owner, and the `AsyncFd` keeps it
    // open until it has deregistered it.
    Ok(unsafe { AsyncFd::register_with_interest(fd, Interest::WRITABLE) }?)
}

impl quinn::Runtime for Runtime {
    fn new_timer(&self, t: Instant) -> Pin<Box<dyn AsyncTimer>> {
        self.tokio.new_timer(t)
    }

    fn spawn(&self, future: Pin<Box<dyn std::future::Future<Output = ()> + Send>>) {
        self.tokio.spawn(future)
    }

    fn wrap_udp_socket(&self, sock: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        Ok(Arc::new(Socket::new(sock)?))
    }

    fn now(&self) -> Instant {
        self.tokio.now()
    }
}

struct Socket {
    /// Its id among the sockets an idle spin watches (`idle::sockets`).
    watched: u64,
    /// Registered for reading only.
    io: AsyncFd<std::net::UdpSocket>,
    state: UdpSocketState,
    /// The last send was refused for want of buffer space: the next `poll_writable` waits
    /// for space.
    full: AtomicBool,
    /// The wait for that space, shared by every connection waiting.
    space: WriteWait,
}

impl Drop for Socket {
    fn drop(&mut self) {
        // Before the descriptor is closed (the fields are dropped after this).
        crate::idle::sockets::forget(self.watched);
    }
}

impl Socket {
    fn new(sock: std::net::UdpSocket) -> io::Result<Socket> {
        // `UdpSocketState::new` also makes the socket non-blocking.
        let state = UdpSocketState::new((&sock).into())?;
        let io = register_for_reading(sock)?;
        let watched = crate::idle::sockets::watch(io.as_raw_fd());
        Ok(Socket {
            watched,
            io,
            state,
            full: AtomicBool::new(false),
            space: WriteWait::default(),
        })
    }
}

/// How long a connection waits before it tries a refused send again when the wait for write
/// space could not be registered (no descriptor left for the duplicate, say).
const RETRY_AFTER: Duration = Duration::from_millis(1);

/// A wait for write space, boxed: the shared registration's `writable()`, or a retry timer.
type SpaceWait = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// The wait for write space of a socket registered for reading only: one duplicate of its
/// descriptor registered for writing, made when the first sender waits and shared by all that
/// wait with it (quinn asks every connection with something to send), so that a full socket
/// costs one registration, not one per connection.
#[derive(Default)]
struct WriteWait {
    registered: Mutex<Option<Arc<AsyncFd<OwnedFd>>>>,
}

impl WriteWait {
    /// Completes once `fd` has write space: at once if it has some now (epoll reports a
    /// descriptor's state when it is registered, so space freed since the refused send is not
    /// missed). If the registration cannot be made, after [`RETRY_AFTER`] instead: the send is
    /// tried again then, and the connection never waits on an error.
    fn wait(&self, fd: BorrowedFd<'_>) -> SpaceWait {
        self.wait_with(fd, register_duplicate_for_writing)
    }

    /// [`Self::wait`], registering with `register`.
    fn wait_with(
        &self,
        fd: BorrowedFd<'_>,
        register: impl FnOnce(BorrowedFd<'_>) -> io::Result<AsyncFd<OwnedFd>>,
    ) -> SpaceWait {
        let shared = {
            let mut registered = self.registered.lock().unwrap_or_else(|e| e.into_inner());
            match registered.as_ref() {
                Some(shared) => Ok(shared.clone()),
                None => register(fd).map(|r| {
                    let r = Arc::new(r);
                    *registered = Some(r.clone());
                    r
                }),
            }
        };
        match shared {
            // An error here means the reactor is gone: the send tried next says what is wrong.
            Ok(shared) => Box::pin(async move {
                let _ = shared.writable().await;
            }),
            Err(_) => Box::pin(tokio::time::sleep(RETRY_AFTER)),
        }
    }

    /// Space was seen: the registration goes (its readiness stays set, so a later wait must
    /// not reuse it), and sends raise no write events again. Waits still holding it complete,
    /// as they saw the same space.
    fn seen(&self) {
        *self.registered.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    #[cfg(test)]
    fn is_registered(&self) -> bool {
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

impl fmt::Debug for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Socket")
            .field("local_addr", &self.io.get_ref().local_addr().ok())
            .field("full", &self.full.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for Socket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(Poller {
            socket: self,
            wait: None,
        })
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let sent = self.state.send(self.io.get_ref().into(), transmit);
        if matches!(&sent, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            self.full.store(true, Ordering::Relaxed);
        }
        sent
    }

    /// An error other than WouldBlock is returned to quinn, which skips a connection reset and
    /// otherwise ends the endpoint, loudly. (quinn's own tokio runtime retries every error at
    /// once, which spins on one that persists.) An unconnected UDP socket without `IP_RECVERR`,
    /// as quinn's is, reports no ICMP errors, so on Linux this is for real failures only.
    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.io.poll_read_ready(cx))?;
            // `try_io` clears the readiness on WouldBlock, and the loop waits for the next
            // event.
            if let Ok(received) =
                guard.try_io(|io| self.state.recv(io.get_ref().into(), bufs, meta))
            {
                return Poll::Ready(received);
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.get_ref().local_addr()
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }

    fn max_transmit_segments(&self) -> usize {
        self.state.max_gso_segments().min(crate::MAX_GSO_SEGMENTS)
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// One connection's (or the endpoint's) wait for write space.
struct Poller {
    socket: Arc<Socket>,
    /// While the socket is full: this connection's part in the socket's [`WriteWait`].
    wait: Option<SpaceWait>,
}

impl fmt::Debug for Poller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Poller")
            .field("waiting", &self.wait.is_some())
            .finish_non_exhaustive()
    }
}

impl UdpPoller for Poller {
    /// Never an error: a wait that cannot be registered becomes a short timer (see
    /// [`WriteWait::wait`]). An error would end the connection's driver without closing the
    /// connection, and its application would wait for ever.
    fn poll_writable(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.socket.full.load(Ordering::Relaxed) {
            // Another connection's wait saw the space first.
            self.wait = None;
            return Poll::Ready(Ok(()));
        }
        let this = &mut *self;
        let wait = this
            .wait
            .get_or_insert_with(|| this.socket.space.wait(this.socket.io.get_ref().as_fd()));
        ready!(wait.as_mut().poll(cx));
        // Space: let the next send find out whether it is enough.
        self.wait = None;
        self.socket.full.store(false, Ordering::Relaxed);
        self.socket.space.seen();
        Poll::Ready(Ok(()))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::future::poll_fn;
    use std::net::{Ipv4Addr, UdpSocket};
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    use super::*;

    const EPOLLIN: u32 = 0x1;
    const EPOLLOUT: u32 = 0x4;

    fn bound() -> UdpSocket {
        UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0")
    }

    /// A socket is watched by idle spins from its making to its drop.
    #[test]
    fn a_socket_is_watched_while_it_lives() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _entered = runtime.enter();
        let socket = Socket::new(bound()).expect("socket");
        let id = socket.watched;
        assert!(crate::idle::sockets::watched(id));
        drop(socket);
        assert!(!crate::idle::sockets::watched(id));
    }

    /// The event masks this process's epoll instances hold for the file (socket) with inode
    /// `ino`, under any descriptor of it (Linux: the `tfd:` lines of an epoll descriptor's
    /// `/proc/self/fdinfo` entry; the reactor holds two descriptors of its epoll instance, so
    /// identical lines are one registration).
    fn epoll_masks(ino: u64) -> Vec<u32> {
        let mut seen = std::collections::HashSet::new();
        let mut masks = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fdinfo").expect("/proc/self/fdinfo") {
            let Ok(text) = std::fs::read_to_string(entry.expect("fdinfo entry").path()) else {
                continue; // closed meanwhile
            };
            for line in text.lines().filter(|l| l.starts_with("tfd:")) {
                let field = |name: &str| {
                    let at = line.find(name).expect("field") + name.len();
                    line[at..]
                        .split_whitespace()
                        .next()
                        .expect("value")
                        .to_owned()
                };
                let target = u64::from_str_radix(&field("ino:"), 16).expect("hex inode");
                if target == ino && seen.insert(line.to_owned()) {
                    masks.push(u32::from_str_radix(&field("events:"), 16).expect("hex mask"));
                }
            }
        }
        masks
    }

    fn inode(socket: &Socket) -> u64 {
        fd_inode(socket.io.get_ref().as_fd())
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A whole segmentation-offload batch of the largest datagrams is one send the kernel
    /// takes: at ten datagrams of 9,000 bytes (over 64 KiB) every such send failed.
    #[test]
    fn a_full_batch_of_the_largest_datagrams_is_sent() {
        runtime().block_on(async {
            let (a, b) = (
                Socket::new(bound()).expect("a"),
                Socket::new(bound()).expect("b"),
            );
            let segments = a.max_transmit_segments();
            assert!(segments <= crate::MAX_GSO_SEGMENTS, "{segments}");
            let size = crate::MAX_MTU as usize;
            let contents = vec![7u8; segments * size];
            a.try_send(&Transmit {
                destination: b.local_addr().expect("addr"),
                ecn: None,
                contents: &contents,
                segment_size: (segments > 1).then_some(size),
                src_ip: None,
            })
            .expect("the kernel takes the whole batch");
            let mut received = 0;
            while received < contents.len() {
                let mut buf = vec![0u8; 1 << 16];
                let mut meta = [RecvMeta::default()];
                tokio::time::timeout(
                    Duration::from_secs(5),
                    poll_fn(|cx| b.poll_recv(cx, &mut [io::IoSliceMut::new(&mut buf)], &mut meta)),
                )
                .await
                .expect("datagrams within 5 s")
                .expect("recv");
                assert_eq!(meta[0].stride, size, "datagrams of {size} bytes");
                received += meta[0].len;
            }
            assert_eq!(received, contents.len());
        });
    }

    #[test]
    fn the_socket_is_registered_for_reading_only() {
        runtime().block_on(async {
            let socket = Socket::new(bound()).expect("socket");
            let masks = epoll_masks(inode(&socket));
            assert_eq!(masks.len(), 1, "one registration: {masks:x?}");
            assert_eq!(masks[0] & EPOLLIN, EPOLLIN, "readable: {:#x}", masks[0]);
            assert_eq!(masks[0] & EPOLLOUT, 0, "not writable: {:#x}", masks[0]);
        });
    }

    #[test]
    fn datagrams_go_out_and_come_in() {
        runtime().block_on(async {
            let (a, b) = (
                Socket::new(bound()).expect("a"),
                Socket::new(bound()).expect("b"),
            );
            let to = b.local_addr().expect("addr");
            for body in [&b"one"[..], b"two"] {
                a.try_send(&Transmit {
                    destination: to,
                    ecn: None,
                    contents: body,
                    segment_size: None,
                    src_ip: None,
                })
                .expect("send");
            }
            let mut got = Vec::new();
            while got.len() < 2 {
                let mut buf = [0u8; 1500];
                let mut meta = [RecvMeta::default()];
                let n = tokio::time::timeout(
                    Duration::from_secs(5),
                    poll_fn(|cx| b.poll_recv(cx, &mut [io::IoSliceMut::new(&mut buf)], &mut meta)),
                )
                .await
                .expect("a datagram within 5 s")
                .expect("recv");
                assert_eq!(n, 1);
                got.push(buf[..meta[0].len].to_vec());
            }
            assert_eq!(got, [b"one".to_vec(), b"two".to_vec()]);
            // Nothing more: the receive waits (the readiness was cleared), it does not spin.
            let mut buf = [0u8; 1500];
            let mut meta = [RecvMeta::default()];
            let waits = poll_fn(|cx| {
                let r = b.poll_recv(cx, &mut [io::IoSliceMut::new(&mut buf)], &mut meta);
                Poll::Ready(r.is_pending())
            })
            .await;
            assert!(waits, "an empty socket reported a datagram");
        });
    }

    /// A datagram socket that cannot be written to: its peer (returned too) reads nothing.
    fn filled() -> (
        std::os::unix::net::UnixDatagram,
        std::os::unix::net::UnixDatagram,
    ) {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().expect("pair");
        a.set_nonblocking(true).expect("non-blocking");
        loop {
            match a.send(&[0u8; 1024]) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return (a, b),
                Err(e) => panic!("filling the socket: {e}"),
            }
        }
    }

    fn fd_inode(fd: BorrowedFd<'_>) -> u64 {
        use std::os::fd::AsRawFd;
        std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .expect("fd metadata")
            .ino()
    }

    /// Two connections waiting for space on one full socket share one registration, both go on
    /// once there is space, and after it the socket is registered for writing no more.
    #[test]
    fn waits_for_space_share_one_registration_and_all_end_with_the_space() {
        runtime().block_on(async {
            let (full, peer) = filled();
            let ino = fd_inode(full.as_fd());
            let space = WriteWait::default();
            let mut waits = [space.wait(full.as_fd()), space.wait(full.as_fd())];
            for wait in &mut waits {
                let pending = poll_fn(|cx| Poll::Ready(wait.as_mut().poll(cx).is_pending())).await;
                assert!(pending, "no space yet");
            }
            let masks = epoll_masks(ino);
            assert_eq!(
                masks.iter().filter(|m| *m & EPOLLOUT != 0).count(),
                1,
                "one registration for writing: {masks:x?}"
            );
            // Room: the peer reads what waits for it.
            peer.set_nonblocking(true).expect("non-blocking");
            let mut buf = [0u8; 1024];
            while peer.recv(&mut buf).is_ok() {}
            let [a, b] = waits;
            tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(a, b) })
                .await
                .expect("both waits end within 5 s once there is space");
            space.seen();
            assert!(!space.is_registered());
            assert!(epoll_masks(ino).iter().all(|m| m & EPOLLOUT == 0));
        });
    }

    /// A wait that cannot be registered (no descriptor left for the duplicate) is a short
    /// timer, never an error: an error would stop the connection's driver for good.
    #[test]
    fn a_wait_that_cannot_be_registered_retries_after_a_while() {
        runtime().block_on(async {
            let (full, _peer) = filled();
            let space = WriteWait::default();
            let wait = space.wait_with(full.as_fd(), |_| {
                Err(io::Error::from_raw_os_error(24)) // EMFILE
            });
            let started = Instant::now();
            tokio::time::timeout(Duration::from_secs(5), wait)
                .await
                .expect("the retry comes within 5 s");
            assert!(started.elapsed() >= RETRY_AFTER);
            assert!(!space.is_registered());
        });
    }

    #[test]
    fn a_full_socket_waits_for_write_space_then_drops_the_wait() {
        runtime().block_on(async {
            let socket = Arc::new(Socket::new(bound()).expect("socket"));
            let ino = inode(&socket);
            let mut poller = socket.clone().create_io_poller();
            // Not full: ready at once, and no registration for writing.
            poll_fn(|cx| poller.as_mut().poll_writable(cx))
                .await
                .expect("writable");
            assert!(epoll_masks(ino).iter().all(|m| m & EPOLLOUT == 0));
            // As after a send refused with WouldBlock.
            socket.full.store(true, Ordering::Relaxed);
            let mut polls = 0;
            let mut waited_with = Vec::new();
            tokio::time::timeout(
                Duration::from_secs(5),
                poll_fn(|cx| {
                    polls += 1;
                    let ready = poller.as_mut().poll_writable(cx);
                    if ready.is_pending() {
                        waited_with = epoll_masks(ino);
                    }
                    ready
                }),
            )
            .await
            .expect("write space within 5 s")
            .expect("writable");
            // It waited for the reactor's word, through a registration for writing.
            assert!(polls >= 2, "resolved without waiting");
            assert!(
                waited_with.iter().any(|m| m & EPOLLOUT != 0),
                "no registration for writing while waiting: {waited_with:x?}"
            );
            // Then the space is known and the extra registration gone.
            assert!(!socket.full.load(Ordering::Relaxed));
            let after = epoll_masks(ino);
            assert_eq!(after.len(), 1, "{after:x?}");
            assert_eq!(after[0] & EPOLLOUT, 0, "{after:x?}");
        });
    }
}
