//! The Unix implementation: see the crate documentation.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

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

/// `io` registered with the current tokio reactor for `interest` only.
#[allow(unsafe_code)]
fn register<T: AsRawFd + Into<OwnedFd>>(io: T, interest: Interest) -> io::Result<AsyncFd<T>> {
    // SAFETY: `T` owns its descriptor (it converts into an `OwnedFd`: a `std::net::UdpSocket`
    // or an `OwnedFd` here), and the `AsyncFd` takes `io` by value, so the descriptor stays open
    // and the same until the `AsyncFd` (which deregisters it) is dropped.
    Ok(unsafe { AsyncFd::register_with_interest(io, interest) }?)
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
    /// Registered for reading only.
    io: AsyncFd<std::net::UdpSocket>,
    state: UdpSocketState,
    /// The last send was refused for want of buffer space: the next `poll_writable` waits
    /// for space.
    full: AtomicBool,
}

impl Socket {
    fn new(sock: std::net::UdpSocket) -> io::Result<Socket> {
        // `UdpSocketState::new` also makes the socket non-blocking.
        let state = UdpSocketState::new((&sock).into())?;
        Ok(Socket {
            io: register(sock, Interest::READABLE)?,
            state,
            full: AtomicBool::new(false),
        })
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
        self.state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// One connection's (or the endpoint's) wait for write space.
struct Poller {
    socket: Arc<Socket>,
    /// While the socket is full: a duplicate of its descriptor registered for writability.
    wait: Option<AsyncFd<OwnedFd>>,
}

impl fmt::Debug for Poller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Poller")
            .field("waiting", &self.wait.is_some())
            .finish_non_exhaustive()
    }
}

impl UdpPoller for Poller {
    fn poll_writable(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.socket.full.load(Ordering::Relaxed) {
            // Another connection's wait saw the space first.
            self.wait = None;
            return Poll::Ready(Ok(()));
        }
        if self.wait.is_none() {
            let fd = self.socket.io.get_ref().as_fd().try_clone_to_owned()?;
            self.wait = Some(register(fd, Interest::WRITABLE)?);
        }
        let Some(wait) = self.wait.as_ref() else {
            return Poll::Ready(Ok(()));
        };
        drop(ready!(wait.poll_write_ready(cx))?);
        // Space: let the next send find out whether it is enough. The registration goes, so
        // that sends raise no events again.
        self.socket.full.store(false, Ordering::Relaxed);
        self.wait = None;
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
        let fd = socket.io.get_ref().as_raw_fd();
        std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .expect("fd metadata")
            .ino()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
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
