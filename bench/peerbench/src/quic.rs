//! Raw QUIC baselines: in-process quinn server + client on 127.0.0.1,
//! self-signed certificate (rcgen), rustls with quinn's default crypto
//! provider (ring, via quinn's default `rustls-ring` feature), ALPN "peerbench".

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use bytes::{BufMut, BytesMut};
use clap::Args;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::rustls;
use quinn::{Connection, Endpoint, EndpointConfig, TransportConfig};
use serde_json::{Value, json};

use crate::common::{self, CpuMeter};

pub const ALPN: &[u8] = b"peerbench";
const COALESCE: usize = 64 * 1024;

/// Options shared by both QUIC subcommands.
#[derive(Args, Debug, Clone)]
pub struct QuicOpts {
    /// TLS 1.3 cipher suite: default (provider order), aes128, aes256, chacha.
    #[arg(long, default_value = "default")]
    cipher: String,
    /// Set SO_RCVBUF/SO_SNDBUF (bytes) on both UDP sockets; the kernel caps
    /// it at net.core.rmem_max/wmem_max. Default: OS default (~208 KiB).
    #[arg(long)]
    udp_buf: Option<usize>,
    /// Hard limit for the whole run.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
}

fn set_udp_buf(sock: &UdpSocket, bytes: Option<usize>) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let Some(b) = bytes else { return Ok(()) };
    let v: libc::c_int = b.try_into()?;
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: valid fd and a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            bail!("setsockopt: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct CeilingArgs {
    /// Frame payload size in bytes (each frame = 4-byte LE length + payload).
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// Number of frames.
    #[arg(long, default_value_t = 10_000_000)]
    msgs: u64,
    /// One write_all per frame instead of coalescing frames into 64 KiB writes.
    #[arg(long)]
    frame_writes: bool,
    #[command(flatten)]
    q: QuicOpts,
}

#[derive(Args, Debug, Clone)]
pub struct LatencyArgs {
    /// Frames per second.
    #[arg(long, default_value_t = 10_000.0)]
    rate: f64,
    /// Duration of the paced send phase.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Frame payload size (min 8: holds the send timestamp).
    #[arg(long, default_value_t = 128)]
    size: usize,
    /// Leading frames excluded from the histogram (connection warm-up).
    #[arg(long, default_value_t = 1000)]
    warmup_msgs: u64,
    #[command(flatten)]
    q: QuicOpts,
}

fn provider(cipher: &str) -> anyhow::Result<Arc<rustls::crypto::CryptoProvider>> {
    let mut p = rustls::crypto::ring::default_provider();
    let want = match cipher {
        "default" => None,
        "aes128" => Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256),
        "aes256" => Some(rustls::CipherSuite::TLS13_AES_256_GCM_SHA384),
        "chacha" => Some(rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256),
        other => bail!("unknown --cipher {other}"),
    };
    if let Some(w) = want {
        // QUIC needs TLS13_AES_128_GCM_SHA256 available for Initial packets;
        // put the wanted suite first and keep the rest as fallbacks.
        p.cipher_suites.sort_by_key(|s| s.suite() != w);
    }
    Ok(Arc::new(p))
}

fn transport(_q: &QuicOpts) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(Some(Duration::from_secs(30).try_into().unwrap()));
    Arc::new(t)
}

fn endpoint_config(_q: &QuicOpts) -> anyhow::Result<EndpointConfig> {
    // quinn defaults: PMTU starts at 1200 and discovery probes up to 1452,
    // i.e. what a real Ethernet path gives (loopback's 64 KiB MTU is not used).
    Ok(EndpointConfig::default())
}

pub struct Pair {
    pub server: Endpoint,
    pub client: Endpoint,
    pub server_addr: SocketAddr,
    pub suite: String,
}

/// Builds a server endpoint and a client endpoint, both on 127.0.0.1.
pub fn make_pair(q: &QuicOpts) -> anyhow::Result<Pair> {
    let prov = provider(&q.cipher)?;
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    let cert_der = ck.cert.der().clone();
    let key_der = rustls::pki_types::PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der());

    let mut scfg = rustls::ServerConfig::builder_with_provider(prov.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der.clone()], key_der.into())?;
    scfg.alpn_protocols = vec![ALPN.to_vec()];
    scfg.max_early_data_size = 0;
    let mut server_cfg =
        quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(scfg)?));
    server_cfg.transport_config(transport(q));

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der)?;
    let mut ccfg = rustls::ClientConfig::builder_with_provider(prov.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    ccfg.alpn_protocols = vec![ALPN.to_vec()];
    let mut client_cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(ccfg)?));
    client_cfg.transport_config(transport(q));

    let runtime = quinn::default_runtime().ok_or_else(|| anyhow!("no async runtime"))?;
    let ssock = UdpSocket::bind("127.0.0.1:0")?;
    let server_addr = ssock.local_addr()?;
    set_udp_buf(&ssock, q.udp_buf)?;
    let server = Endpoint::new(
        endpoint_config(q)?,
        Some(server_cfg),
        ssock,
        runtime.clone(),
    )?;
    let csock = UdpSocket::bind("127.0.0.1:0")?;
    set_udp_buf(&csock, q.udp_buf)?;
    let mut client = Endpoint::new(endpoint_config(q)?, None, csock, runtime)?;
    client.set_default_client_config(client_cfg);
    let suite = format!("{:?}", prov.cipher_suites[0].suite());
    Ok(Pair {
        server,
        client,
        server_addr,
        suite,
    })
}

async fn accept_one(server: &Endpoint) -> anyhow::Result<Connection> {
    let inc = server
        .accept()
        .await
        .ok_or_else(|| anyhow!("server endpoint closed"))?;
    Ok(inc.await?)
}

/// Counts length-prefixed frames across arbitrary chunk boundaries.
#[derive(Default)]
struct FrameCounter {
    hdr: [u8; 4],
    hdr_have: usize,
    remaining: usize,
    frames: u64,
    bytes: u64,
}

impl FrameCounter {
    fn feed(&mut self, mut data: &[u8]) {
        self.bytes += data.len() as u64;
        while !data.is_empty() {
            if self.remaining > 0 {
                let k = self.remaining.min(data.len());
                self.remaining -= k;
                data = &data[k..];
                if self.remaining == 0 {
                    self.frames += 1;
                }
                continue;
            }
            let k = (4 - self.hdr_have).min(data.len());
            self.hdr[self.hdr_have..self.hdr_have + k].copy_from_slice(&data[..k]);
            self.hdr_have += k;
            data = &data[k..];
            if self.hdr_have == 4 {
                self.hdr_have = 0;
                let len = u32::from_le_bytes(self.hdr) as usize;
                if len == 0 {
                    self.frames += 1;
                } else {
                    self.remaining = len;
                }
            }
        }
    }
}

fn crypto_note(suite: &str) -> String {
    format!(
        "rustls {} + ring (quinn default feature rustls-ring), first suite {suite}",
        "0.23"
    )
}

pub async fn ceiling(a: CeilingArgs) -> anyhow::Result<Value> {
    let limit = Duration::from_secs(a.q.timeout_secs);
    tokio::time::timeout(limit, ceiling_inner(a))
        .await
        .map_err(|_| anyhow!("quic-ceiling hit --timeout-secs"))?
}

async fn ceiling_inner(a: CeilingArgs) -> anyhow::Result<Value> {
    let pair = make_pair(&a.q)?;
    let server_ep = pair.server.clone();
    let server = tokio::spawn(async move {
        let conn = accept_one(&server_ep).await?;
        let (mut send, mut recv) = conn.accept_bi().await?;
        let mut fc = FrameCounter::default();
        let t0 = Instant::now();
        while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
            fc.feed(&chunk.bytes);
        }
        let secs = t0.elapsed().as_secs_f64();
        let mut ack = BytesMut::with_capacity(16);
        ack.put_u64_le(fc.frames);
        ack.put_u64_le(fc.bytes);
        send.write_all(&ack).await?;
        send.finish()?;
        // Keep the connection until the client closes it.
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
        anyhow::Ok((fc.frames, fc.bytes, secs))
    });

    let conn = pair
        .client
        .connect(pair.server_addr, "localhost")?
        .await
        .context("client connect")?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let payload = vec![0xC3u8; a.size];
    let mut frame = Vec::with_capacity(4 + a.size);
    frame.extend_from_slice(&(a.size as u32).to_le_bytes());
    frame.extend_from_slice(&payload);

    let cpu = CpuMeter::start(None);
    let t0 = Instant::now();
    let mut writes = 0u64;
    if a.frame_writes {
        for _ in 0..a.msgs {
            send.write_all(&frame).await?;
            writes += 1;
        }
    } else {
        let mut buf = BytesMut::with_capacity(COALESCE.max(frame.len()));
        for _ in 0..a.msgs {
            if !buf.is_empty() && buf.len() + frame.len() > COALESCE {
                send.write_all(&buf).await?;
                writes += 1;
                buf.clear();
            }
            buf.put_u32_le(a.size as u32);
            buf.put_slice(&payload);
        }
        if !buf.is_empty() {
            send.write_all(&buf).await?;
            writes += 1;
        }
    }
    let t_written = t0.elapsed().as_secs_f64();
    send.finish()?;
    let mut ack = [0u8; 16];
    recv.read_exact(&mut ack).await?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu_v = cpu.stop();
    let frames = u64::from_le_bytes(ack[..8].try_into().unwrap());
    let bytes = u64::from_le_bytes(ack[8..].try_into().unwrap());
    let stats = conn.stats();
    conn.close(0u32.into(), b"done");
    let (_, _, server_secs) = server.await??;
    let _ = tokio::time::timeout(Duration::from_secs(2), pair.client.wait_idle()).await;

    let rate = a.msgs as f64 / secs;
    let wire_mb = bytes as f64 / 1e6 / secs;
    println!(
        "config: size={}B msgs={} mode={} udp_buf={} crypto: {}",
        a.size,
        a.msgs,
        if a.frame_writes {
            "write_all per frame"
        } else {
            "64KiB coalesced writes"
        },
        a.q.udp_buf
            .map(|m| m.to_string())
            .unwrap_or("os default".into()),
        crypto_note(&pair.suite)
    );
    println!(
        "result: {rate:.0} msgs/s, {:.1} MB/s payload ({wire_mb:.1} MB/s stream bytes) over {secs:.3}s; {writes} writes; all written after {t_written:.3}s; server counted {frames} frames ({} ok), server read time {server_secs:.3}s",
        common::mb_per_s(a.msgs, a.size, secs),
        if frames == a.msgs { "all" } else { "MISMATCH" }
    );
    println!(
        "udp: client sent {} datagrams ({} bytes, {:.0} B/datagram), {} ios; path mtu {}; lost packets {}",
        stats.udp_tx.datagrams,
        stats.udp_tx.bytes,
        stats.udp_tx.bytes as f64 / stats.udp_tx.datagrams.max(1) as f64,
        stats.udp_tx.ios,
        stats.path.current_mtu,
        stats.path.lost_packets
    );
    if frames != a.msgs {
        bail!("server counted {frames} frames, expected {}", a.msgs);
    }
    Ok(json!({
        "mode": if a.frame_writes { "quic-ceiling-frame-writes" } else { "quic-ceiling" },
        "size": a.size, "msgs": a.msgs, "udp_buf": a.q.udp_buf, "cipher": pair.suite,
        "msgs_per_s": rate, "mb_per_s": common::mb_per_s(a.msgs, a.size, secs),
        "stream_mb_per_s": wire_mb, "secs": secs, "writes": writes,
        "frames_counted": frames,
        "udp_datagrams": stats.udp_tx.datagrams, "udp_ios": stats.udp_tx.ios,
        "path_mtu": stats.path.current_mtu, "lost_packets": stats.path.lost_packets,
        "cpu": cpu_v,
    }))
}

pub async fn latency(a: LatencyArgs) -> anyhow::Result<Value> {
    let limit = Duration::from_secs(a.q.timeout_secs);
    tokio::time::timeout(limit, latency_inner(a))
        .await
        .map_err(|_| anyhow!("quic-latency hit --timeout-secs"))?
}

async fn latency_inner(a: LatencyArgs) -> anyhow::Result<Value> {
    let size = a.size.max(8);
    let total = (a.rate * a.secs).round() as u64;
    let warmup = a.warmup_msgs;
    let pair = make_pair(&a.q)?;
    let server_ep = pair.server.clone();
    let server = tokio::spawn(async move {
        let conn = accept_one(&server_ep).await?;
        let (_send, mut recv) = conn.accept_bi().await?;
        let mut h = common::new_hist();
        let mut n = 0u64;
        let mut hdr = [0u8; 4];
        let mut body = vec![0u8; 1 << 16];
        loop {
            match recv.read_exact(&mut hdr).await {
                Ok(()) => {}
                Err(quinn::ReadExactError::FinishedEarly(_)) => break,
                Err(e) => return Err(e.into()),
            }
            let len = u32::from_le_bytes(hdr) as usize;
            if body.len() < len {
                body.resize(len, 0);
            }
            recv.read_exact(&mut body[..len]).await?;
            let now = common::now_ns();
            let ts = u64::from_le_bytes(body[..8].try_into().unwrap());
            n += 1;
            if n > warmup {
                common::record_ns(&mut h, now.saturating_sub(ts));
            }
        }
        // Return the connection so it stays open until the client closes it.
        anyhow::Ok((n, h, conn))
    });

    let conn = pair
        .client
        .connect(pair.server_addr, "localhost")?
        .await
        .context("client connect")?;
    let (send, _recv) = conn.open_bi().await?;
    let cpu = CpuMeter::start(None);
    let handle = tokio::runtime::Handle::current();
    let (rate, secs) = (a.rate, a.secs);
    let pacer = std::thread::spawn(move || {
        let mut send = send;
        let mut frame = vec![0x7Eu8; 4 + size];
        frame[..4].copy_from_slice(&(size as u32).to_le_bytes());
        let stats = common::paced(
            rate,
            total,
            Duration::from_secs_f64(secs * 2.0 + 5.0),
            |_| {
                frame[4..12].copy_from_slice(&common::now_ns().to_le_bytes());
                handle.block_on(send.write_all(&frame))?;
                Ok(())
            },
        );
        let _ = send.finish();
        stats
    });
    let stats = tokio::task::spawn_blocking(move || pacer.join())
        .await?
        .map_err(|_| anyhow!("pacer thread panicked"))??;
    // The server task ends when it sees the stream FIN; bound the wait.
    let (n, h, server_conn) = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .map_err(|_| anyhow!("server did not drain within 10 s"))???;
    let cpu_v = cpu.stop();
    conn.close(0u32.into(), b"done");
    drop(server_conn);
    let _ = tokio::time::timeout(Duration::from_secs(2), pair.client.wait_idle()).await;
    let achieved = stats.sent as f64 / stats.elapsed.as_secs_f64();
    println!(
        "config: rate={} msg/s secs={} size={}B crypto: {}; sent {} in {:.3}s ({achieved:.0} msg/s, worst pacing lateness {:.0}us); received {}",
        a.rate,
        a.secs,
        size,
        crypto_note(&pair.suite),
        stats.sent,
        stats.elapsed.as_secs_f64(),
        stats.max_late.as_secs_f64() * 1e6,
        n
    );
    let lat = common::latency_report("quic one-way latency", &h);
    Ok(json!({
        "mode": "quic-latency", "rate": a.rate, "secs": a.secs, "size": size,
        "sent": stats.sent, "received": n, "lost": stats.sent.saturating_sub(n),
        "achieved_rate": achieved, "warmup_msgs": warmup, "cipher": pair.suite,
        "latency": lat, "cpu": cpu_v,
    }))
}
