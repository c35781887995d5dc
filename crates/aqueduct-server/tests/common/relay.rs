//! A UDP relay in the test process: datagrams to its front address go to `target`, the answers
//! back to whoever sent the last one. It can drop everything both ways (`cut`: a network
//! partition without root or network namespaces), hold one outbound datagram back (as a
//! network may, or a client that paces its first flight), or hold every outbound datagram
//! until the test lets them through (`start_gated`). Its tasks end when it is dropped.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

pub struct Relay {
    pub front: SocketAddr,
    cut: Arc<AtomicBool>,
    /// Outbound datagrams held while gated (`None`: not gated).
    gate: Gate,
    back: Arc<UdpSocket>,
    target: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

type Gate = Arc<Mutex<Option<VecDeque<Vec<u8>>>>>;

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        Self::start_holding(target, None).await
    }

    /// Every outbound datagram is held, in order, until [`Relay::release_one`] or
    /// [`Relay::open`] lets it through; answers pass at once.
    pub async fn start_gated(target: SocketAddr) -> Relay {
        let relay = Self::start_holding(target, None).await;
        *relay.gate.lock().expect("lock") = Some(VecDeque::new());
        relay
    }

    /// Outbound datagram number `nth` (from 1) is sent `delay` late; the others at once.
    pub async fn start_delaying(target: SocketAddr, nth: usize, delay: Duration) -> Relay {
        Self::start_holding(target, Some((nth, delay))).await
    }

    async fn start_holding(target: SocketAddr, hold: Option<(usize, Duration)>) -> Relay {
        let bind =
            || async { Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("relay socket")) };
        let (front, back) = (bind().await, bind().await);
        let cut = Arc::new(AtomicBool::new(false));
        let gate: Gate = Arc::default();
        let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let outbound = {
            let (front, back, cut, client, gate) = (
                front.clone(),
                back.clone(),
                cut.clone(),
                client.clone(),
                gate.clone(),
            );
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_536];
                let mut seen = 0usize;
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *client.lock().expect("lock") = Some(from);
                    seen += 1;
                    if cut.load(Ordering::Relaxed) {
                        continue;
                    }
                    if let Some(held) = gate.lock().expect("lock").as_mut() {
                        held.push_back(buf[..n].to_vec());
                        continue;
                    }
                    match hold {
                        Some((nth, delay)) if nth == seen => {
                            let (back, datagram) = (back.clone(), buf[..n].to_vec());
                            tokio::spawn(async move {
                                tokio::time::sleep(delay).await;
                                let _ = back.send_to(&datagram, target).await;
                            });
                        }
                        _ => {
                            let _ = back.send_to(&buf[..n], target).await;
                        }
                    }
                }
            })
        };
        let inbound = {
            let (front, back, cut) = (front.clone(), back.clone(), cut.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_536];
                while let Ok((n, _)) = back.recv_from(&mut buf).await {
                    let to = *client.lock().expect("lock");
                    if let (Some(to), false) = (to, cut.load(Ordering::Relaxed)) {
                        let _ = front.send_to(&buf[..n], to).await;
                    }
                }
            })
        };
        Relay {
            front: front.local_addr().expect("addr"),
            cut,
            gate,
            back,
            target,
            tasks: vec![outbound, inbound],
        }
    }

    /// How many outbound datagrams the gate holds.
    pub fn held(&self) -> usize {
        self.gate
            .lock()
            .expect("lock")
            .as_ref()
            .map_or(0, VecDeque::len)
    }

    /// Let the oldest held datagram through; false if none is held.
    pub async fn release_one(&self) -> bool {
        let next = self
            .gate
            .lock()
            .expect("lock")
            .as_mut()
            .and_then(VecDeque::pop_front);
        match next {
            Some(datagram) => {
                let _ = self.back.send_to(&datagram, self.target).await;
                true
            }
            None => false,
        }
    }

    /// Let everything held through, and all that follows.
    pub async fn open(&self) {
        let held = self.gate.lock().expect("lock").take().unwrap_or_default();
        for datagram in held {
            let _ = self.back.send_to(&datagram, self.target).await;
        }
    }

    /// Drop everything both ways while `cut`.
    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
