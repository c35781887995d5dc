//! TLS for the broker: TLS 1.3 only, ALPN `aqueduct-v1`, one crypto provider (ring).
//!
//! Certificates come from `tls.cert_file`/`tls.key_file`, or — with `tls.generate` and no files —
//! a self-signed certificate made at startup for `localhost`, `127.0.0.1` and `::1`. Its public
//! half is written to `tls.dev_cert_file`, which the `aqueduct` CLI trusts for local addresses,
//! so a developer never handles certificates; connections to other hosts verify as usual.
//! With `tls.require_client_cert` the broker verifies client certificates against
//! `tls.client_ca_file` and uses the certificate's Common Name as the client id.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::TlsConfig;
use crate::revocation::ClientVerifier;

/// The ALPN protocol id.
pub const ALPN: &[u8] = b"aqueduct-v1";

/// The ALPN protocol a handshake will settle on: the first of the server's `ours` that the
/// client offers (the server's order decides, as rustls does). A certificate resolver must pick
/// by this, not by what a client merely offers: a client offering `h3` and `aqueduct-v1` speaks
/// `aqueduct-v1` and must be shown the certificate `aqueduct-v1` clients trust.
pub(crate) fn chosen_alpn<'a>(
    ours: &'a [Vec<u8>],
    hello: &rustls::server::ClientHello<'_>,
) -> Option<&'a [u8]> {
    ours.iter().map(Vec::as_slice).find(|p| {
        hello
            .alpn()
            .is_some_and(|mut theirs| theirs.any(|t| t == *p))
    })
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key}: cannot read {path}: {reason}")]
    Pem {
        key: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{key}: {path} holds no certificate")]
    NoCertificate { key: &'static str, path: PathBuf },
    #[error("generating the development certificate failed: {0}")]
    Generate(String),
    #[error("cannot write the development certificate to {path}: {reason}")]
    WriteDevCert { path: PathBuf, reason: String },
    #[error("TLS configuration rejected: {0}")]
    Rustls(String),
}

/// The process-wide crypto provider. Installing it as the default keeps any library that asks
/// for "the default provider" on ring too (there must never be two). rustls 0.23.48 deprecates
/// its *ring* provider (no post-quantum key exchange); the broker stays on *ring* (one provider,
/// no aws-lc-rs C build; `.ci/run` checks it), so the deprecation is allowed here, the one place
/// the broker and its tests name it.
#[allow(deprecated)]
pub fn provider() -> Arc<CryptoProvider> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut p = rustls::crypto::ring::default_provider();
    prefer_aes128(&mut p.cipher_suites);
    Arc::new(p)
}

/// Order TLS 1.3 suites AES-128-GCM, AES-256-GCM, then the rest. Every packet of a QUIC
/// connection is sealed with the negotiated suite, and AES-128 costs less per byte than AES-256
/// for a security level no deployment of this broker lacks (Go's and BoringSSL's TLS 1.3 prefer
/// it too); measured in docs/benchmarks.md.
fn prefer_aes128(suites: &mut [rustls::SupportedCipherSuite]) {
    suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
}

pub(crate) fn read_certs(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Pem {
            key,
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            key,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The certificate chain and key the broker presents (QUIC and the admin API), plus a generated
/// dev cert to publish.
#[derive(Debug)]
pub struct Identity {
    pub(crate) certs: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivateKeyDer<'static>,
    dev_cert: Option<DevCert>,
}

impl Identity {
    /// A certificate generated at startup (no `tls.cert_file`).
    pub fn is_generated(&self) -> bool {
        self.dev_cert.is_some()
    }
}

/// A generated development certificate, to be written where local clients look for it — only
/// once the broker has bound its sockets, so that a second broker started by mistake (which
/// fails with "address in use") cannot replace the running broker's certificate.
///
/// The file is shared by every broker of this machine that uses it (one `AQUEDUCT_HOME`, two
/// ports): each keeps a section of its own, headed `# aqueduct-broker port=<udp port>
/// pid=<process>`, and replaces only that one, so a local client trusting the file trusts every
/// running broker. Sections of brokers that are gone (their process has ended, or a new broker
/// took their port) are dropped at each write.
#[derive(Debug, Clone)]
pub struct DevCert {
    pub path: PathBuf,
    pem: String,
    /// The UDP port of the broker whose section this is (0 until bound).
    port: u16,
}

impl DevCert {
    /// A file at `path` with no certificate of its own yet (tests).
    #[cfg(test)]
    pub(crate) fn at(path: PathBuf) -> DevCert {
        DevCert {
            path,
            pem: String::new(),
            port: 0,
        }
    }

    /// The broker bound this UDP port: its section of the file is keyed by it.
    pub fn bound_to(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Write it (atomically).
    pub fn write(&self) -> Result<(), TlsError> {
        self.write_with("")
    }

    /// Write it followed by `also` (the certificate WebTransport clients are shown), so that a
    /// local client trusting the file trusts either.
    pub fn write_with(&self, also: &str) -> Result<(), TlsError> {
        let err = |e: std::io::Error| TlsError::WriteDevCert {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Without a home, this user's own directory in the temporary directory: made
            // private, and refused if someone else made it first.
            if dir == aqueduct_udp::private_dir::path() {
                aqueduct_udp::private_dir::ensure(dir)
            } else {
                std::fs::create_dir_all(dir)
            }
            .map_err(err)?;
        }
        // Read, merge and replace under a lock of the brokers sharing the file (a sibling
        // file: the certificate file itself is replaced by a rename), so that two brokers
        // starting or renewing at once keep both their sections.
        let mut lock_path = self.path.clone().into_os_string();
        lock_path.push(".lock");
        // Best effort: where the file system has no locks, brokers starting at the same
        // instant may drop each other's section (a restart puts it back).
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .ok()
            .filter(|f| f.lock().is_ok());
        let existing = std::fs::read_to_string(&self.path).unwrap_or_default();
        let ours = format!("{}{also}", self.pem);
        let merged = merge_dev_cert(
            &existing,
            self.port,
            std::process::id(),
            &ours,
            process_alive,
        );
        // Atomically (temp file + rename), so a client never reads half a certificate.
        // Named for this write (this process may hold several brokers: tests).
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tmp = self.path.with_extension(format!(
            "tmp.{}.{}",
            std::process::id(),
            WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let written = std::fs::write(&tmp, merged).and_then(|()| std::fs::rename(&tmp, &self.path));
        if written.is_err() {
            // A broker retries a failed renewal: leave no temporary file per try.
            let _ = std::fs::remove_file(&tmp);
        }
        drop(lock);
        written.map_err(err)
    }
}

/// At most this many sections of other brokers are kept (the oldest go first): where it cannot
/// be told whether a process still runs, sections of brokers on ever new ports would pile up.
const MAX_OTHER_SECTIONS: usize = 15;

/// The header of a broker's section of the development certificate file.
const DEV_CERT_SECTION: &str = "# aqueduct-broker ";

/// The file's new text: the sections of other live brokers (another port, a running process),
/// then ours. Text before the first section (a file from a broker that wrote no sections) is
/// dropped.
fn merge_dev_cert(
    existing: &str,
    port: u16,
    pid: u32,
    pem: &str,
    alive: impl Fn(u32) -> bool,
) -> String {
    let mut kept: Vec<String> = Vec::new();
    let mut keep = false;
    for line in existing.split_inclusive('\n') {
        if let Some(header) = line.strip_prefix(DEV_CERT_SECTION) {
            let field = |name: &str| {
                header
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix(name)?.parse::<u32>().ok())
            };
            keep = match (field("port="), field("pid=")) {
                (Some(p), Some(owner)) => p != u32::from(port) && (owner == pid || alive(owner)),
                _ => false,
            };
            if keep {
                kept.push(String::new());
            }
        }
        if let Some(section) = kept.last_mut().filter(|_| keep) {
            section.push_str(line);
            if !line.ends_with('\n') {
                section.push('\n');
            }
        }
    }
    let first = kept.len().saturating_sub(MAX_OTHER_SECTIONS);
    let mut out = kept[first..].concat();
    out.push_str(&format!("{DEV_CERT_SECTION}port={port} pid={pid}\n{pem}"));
    out
}

/// Whether process `pid` runs (Linux: `/proc/<pid>`; elsewhere assumed so, and the section stays
/// until a broker takes its port or [`MAX_OTHER_SECTIONS`] newer ones push it out).
fn process_alive(pid: u32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The broker's certificate: from the files, or generated once per process start.
pub fn identity(cfg: &TlsConfig) -> Result<Identity, TlsError> {
    if let (Some(cert), Some(key)) = (&cfg.cert_file, &cfg.key_file) {
        let certs = read_certs("tls.cert_file", cert)?;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Pem {
            key: "tls.key_file",
            path: key.clone(),
            reason: e.to_string(),
        })?;
        return Ok(Identity {
            certs,
            key,
            dev_cert: None,
        });
    }
    let (cert, signing_key) =
        dev_certificate("aqueduct development broker").map_err(TlsError::Generate)?;
    let dev_cert = DevCert {
        path: cfg.dev_cert_file.clone(),
        pem: cert.pem(),
        port: 0,
    };
    let key = PrivateKeyDer::try_from(signing_key.serialize_der())
        .map_err(|e| TlsError::Generate(e.to_string()))?;
    Ok(Identity {
        certs: vec![cert.der().clone()],
        key,
        dev_cert: Some(dev_cert),
    })
}

/// The names a development certificate is for.
pub(crate) const DEV_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// A new self-signed ECDSA P-256 certificate for [`DEV_NAMES`], its subject (and so its
/// issuer) `CN=<label> <16 hex digits of its public key's SHA-256>`; `adjust` changes what
/// else differs (the browsers' one's validity).
///
/// Its own name: the dev-cert file holds the certificates of several brokers, each its own
/// issuer, and a TLS library that picks the trusted certificate by the issuer's name (OpenSSL,
/// and clients built on it such as aioquic) takes the first one of that name. With one name for
/// all (rcgen's default, `CN=rcgen self signed cert`), every broker but the first failed
/// verification there with "self-signed certificate".
pub(crate) fn dev_certificate_with(
    label: &str,
    adjust: impl FnOnce(&mut rcgen::CertificateParams),
) -> Result<(rcgen::Certificate, rcgen::KeyPair), String> {
    let key =
        rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| e.to_string())?;
    let mut params = rcgen::CertificateParams::new(DEV_NAMES.map(String::from).to_vec())
        .map_err(|e| e.to_string())?;
    let mut name = rcgen::DistinguishedName::new();
    name.push(
        rcgen::DnType::CommonName,
        format!("{label} {}", key_tag(&key, 8)),
    );
    params.distinguished_name = name;
    adjust(&mut params);
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    Ok((cert, key))
}

/// The first `bytes` bytes of the SHA-256 of `key`'s public key, in hex: a tag that gives each
/// key's certificate a name of its own (a development certificate's; a CA's, `aqueduct cert
/// ca`).
pub fn key_tag(key: &rcgen::KeyPair, bytes: usize) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.public_key_raw());
    digest.as_ref()[..bytes.min(32)]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn dev_certificate(label: &str) -> Result<(rcgen::Certificate, rcgen::KeyPair), String> {
    dev_certificate_with(label, |_| {})
}

/// The broker's QUIC crypto configuration and, if generated, the dev certificate (not written
/// yet: see [`DevCert`]).
///
/// With WebTransport on, the broker also offers ALPN `h3`, and `browser` (with a generated
/// development certificate) is what connections offering `h3` are shown (webtransport.rs).
pub fn server_crypto(
    cfg: &TlsConfig,
    id: &Identity,
    clients: Option<Arc<ClientVerifier>>,
    mesh: Option<&crate::mesh_tls::MeshTls>,
    webtransport: bool,
    browser: Option<&Arc<crate::webtransport::BrowserCerts>>,
) -> Result<(quinn::crypto::rustls::QuicServerConfig, Option<DevCert>), TlsError> {
    let mut tls = match mesh {
        // With the cluster on: the mesh's ALPN and certificates next to the clients' (mesh_tls.rs).
        Some(mesh) => mesh.server_config(cfg, id)?,
        None => client_server_config(id, clients)?,
    };
    if webtransport {
        tls.alpn_protocols
            .push(crate::webtransport::H3_ALPN.to_vec());
        if let Some(certs) = browser {
            tls.cert_resolver = Arc::new(crate::webtransport::ForBrowsers {
                inner: tls.cert_resolver.clone(),
                certs: certs.clone(),
                alpn: tls.alpn_protocols.clone(),
            });
        }
    }
    // The broker's order (AES-128-GCM first) decides, whatever a client prefers.
    tls.ignore_client_order = true;
    // 0-RTT is accepted; the connection layer holds back everything but replay-safe frames
    // until the handshake is confirmed (see connection.rs).
    tls.max_early_data_size = u32::MAX;
    let quic = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    Ok((quic, id.dev_cert.clone()))
}

/// The QUIC TLS for clients only (no cluster); `clients` verifies their certificates
/// (`tls.client_ca_file`, `tls.crl_file`, `tls.require_client_cert`), if configured.
fn client_server_config(
    id: &Identity,
    clients: Option<Arc<ClientVerifier>>,
) -> Result<rustls::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    let builder = match clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut tls = builder
        .with_single_cert(id.certs.clone(), id.key.clone_key())
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tls)
}

/// The admin API's TLS: TLS 1.3, HTTP/2, the broker's certificate, and a client certificate
/// that `verifier` accepts required (no certificate: the handshake fails).
pub fn admin_crypto(
    id: &Identity,
    verifier: Arc<ClientVerifier>,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError::Rustls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.certs.clone(), id.key.clone_key())
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    // No resumption: a resumed TLS 1.3 session is not checked against the revocation lists
    // again (each call checks its certificate too, see `admin::authorize`); administrators
    // connect rarely, a full handshake each time costs nothing that matters.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    Ok(tls)
}

/// The Common Name of a certificate; `None` without one, or with more than one (which of
/// several names the client is a matter of convention — the first, the last — that a CA's
/// issuing policy and the broker could read differently).
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let mut names = cert.subject().iter_common_name();
    let cn = names.next()?;
    if names.next().is_some() {
        return None;
    }
    cn.as_str().ok().map(str::to_owned)
}

/// The validity of a certificate, `notBefore` and `notAfter`, seconds since the Unix epoch.
pub fn validity(cert: &CertificateDer<'_>) -> Option<(i64, i64)> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let v = cert.validity();
    Some((v.not_before.timestamp(), v.not_after.timestamp()))
}

/// The certificate chain the peer of `conn` presented, end entity first, if any.
pub(crate) fn peer_certificates(conn: &quinn::Connection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()
        .map(|chain| *chain)
}

/// The Common Name of the client's certificate, if it presented one.
pub fn client_common_name(conn: &quinn::Connection) -> Option<String> {
    common_name(peer_certificates(conn)?.first()?)
}

#[cfg(test)]
mod tests {
    use super::{dev_certificate, merge_dev_cert, DevCert};

    /// The common name of a development certificate made with `label`, read from its DER (as
    /// subject and as issuer), with how often it occurs there.
    fn common_name(label: &str) -> (String, usize) {
        let (cert, _) = dev_certificate(label).expect("generate");
        let der = cert.der().to_vec();
        let at: Vec<usize> = der
            .windows(label.len())
            .enumerate()
            .filter(|(_, w)| *w == label.as_bytes())
            .map(|(i, _)| i)
            .collect();
        assert!(!at.is_empty(), "the label is in the certificate");
        let name = String::from_utf8(der[at[0]..at[0] + label.len() + 17].to_vec()).expect("utf-8");
        (name, at.len())
    }

    /// Several brokers' certificates share the dev-cert file, and a client that finds the
    /// trusted certificate by its issuer's name (OpenSSL) takes the first of a name: each must
    /// have its own (they were all `CN=rcgen self signed cert`).
    #[test]
    fn each_development_certificate_has_a_name_of_its_own() {
        let label = "aqueduct development broker";
        let (a, seen) = common_name(label);
        assert_eq!(seen, 2, "subject and issuer: {a}");
        let (b, _) = common_name(label);
        assert_ne!(a, b);
        let tag = &a[label.len() + 1..];
        assert!(
            tag.len() == 16 && tag.bytes().all(|c| c.is_ascii_hexdigit()),
            "{a}"
        );
    }

    const A: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    const B: &str = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n";
    const C: &str = "-----BEGIN CERTIFICATE-----\nCCCC\n-----END CERTIFICATE-----\n";

    #[test]
    fn each_broker_replaces_only_its_own_section_of_the_development_certificate_file() {
        let everyone_alive = |_| true;
        // A file from a broker that wrote no sections: replaced.
        let first = merge_dev_cert(A, 4242, 10, B, everyone_alive);
        assert_eq!(first, format!("# aqueduct-broker port=4242 pid=10\n{B}"));
        // A second broker on another port keeps the first one's section.
        let both = merge_dev_cert(&first, 7461, 20, C, everyone_alive);
        assert_eq!(
            both,
            format!(
                "# aqueduct-broker port=4242 pid=10\n{B}# aqueduct-broker port=7461 pid=20\n{C}"
            )
        );
        // A broker renewing (same port, same process) replaces its own section only.
        let renewed = merge_dev_cert(&both, 4242, 10, A, everyone_alive);
        assert_eq!(
            renewed,
            format!(
                "# aqueduct-broker port=7461 pid=20\n{C}# aqueduct-broker port=4242 pid=10\n{A}"
            )
        );
        // A new broker on a port another process had: that section goes.
        let taken = merge_dev_cert(&both, 7461, 30, A, everyone_alive);
        assert_eq!(
            taken,
            format!(
                "# aqueduct-broker port=4242 pid=10\n{B}# aqueduct-broker port=7461 pid=30\n{A}"
            )
        );
        // At most MAX_OTHER_SECTIONS of other brokers stay, the newest.
        let mut many = String::new();
        for p in 1..=20u16 {
            many = merge_dev_cert(&many, p, 10, A, everyone_alive);
        }
        let crowded = merge_dev_cert(&many, 4242, 10, B, everyone_alive);
        assert_eq!(crowded.matches("# aqueduct-broker ").count(), 16);
        assert!(!crowded.contains("port=5 ") && crowded.contains("port=6 "));
        assert!(crowded.ends_with(&format!("port=4242 pid=10\n{B}")));
        // Sections of processes that have ended go; this process's other sections stay.
        let gone = merge_dev_cert(&both, 9000, 20, A, |pid| pid != 10);
        assert_eq!(
            gone,
            format!(
                "# aqueduct-broker port=7461 pid=20\n{C}# aqueduct-broker port=9000 pid=20\n{A}"
            )
        );
    }

    /// Brokers writing the shared file at the same instant keep each other's sections: the
    /// read-merge-replace is serialized by the lock file (threads here, each with a file
    /// description of its own, as processes would have).
    #[test]
    fn brokers_writing_the_development_certificate_at_once_keep_every_section() {
        const WRITERS: u16 = 8;
        for round in 0..20 {
            let dir = tempfile::tempdir().expect("dir");
            let path = dir.path().join("dev-cert.pem");
            let barrier = std::sync::Barrier::new(usize::from(WRITERS));
            std::thread::scope(|s| {
                for i in 0..WRITERS {
                    let cert = DevCert {
                        path: path.clone(),
                        pem: A.to_string(),
                        port: 0,
                    }
                    .bound_to(5000 + i);
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        cert.write().expect("write");
                    });
                }
            });
            let text = std::fs::read_to_string(&path).expect("written");
            for i in 0..WRITERS {
                assert!(
                    text.contains(&format!("port={} ", 5000 + i)),
                    "round {round}: the section of port {} was lost:\n{text}",
                    5000 + i
                );
            }
        }
    }
}
