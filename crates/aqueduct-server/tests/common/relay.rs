//! A UDP relay in the test process: datagrams to its front address go to `target`, the answers
//! back to whoever sent the last one. It can drop everything both ways (`cut`: a network
//! partition without root or network namespaces) or hold one outbound datagram back (as a
//! network may, or a client that paces its first flight). Its tasks end when it is dropped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

pub struct Relay {
    pub front: SocketAddr,
    cut: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        Self::start_holding(target, None).await
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
        let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let outbound = {
            let (front, back, cut, client) =
                (front.clone(), back.clone(), cut.clone(), client.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_536];
                let mut seen = 0usize;
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *client.lock().expect("lock") = Some(from);
                    seen += 1;
                    if cut.load(Ordering::Relaxed) {
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
            tasks: vec![outbound, inbound],
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
