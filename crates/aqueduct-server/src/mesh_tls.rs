//! TLS between cluster nodes, on the broker's own QUIC port: ALPN `aqueduct-mesh` next to
//! `aqueduct-v1`.
//!
//! - A node presents its peer certificate (`cluster.tls.cert_file`, CN = node id, DNS name
//!   `aqueduct-mesh`) to peers and its client-facing certificate to clients, chosen by the ALPN
//!   the client offers.
//! - Peers dial with their peer certificate and verify the DNS name `aqueduct-mesh` against
//!   `cluster.tls.ca_file`, so node addresses need not be in certificates.
//! - One QUIC server config accepts a client certificate from either CA (the clients' and the
//!   cluster's); after the handshake, the negotiated ALPN decides which one it had to be: a mesh
//!   connection needs a certificate of the cluster CA ([`MeshTls::peer_of`]), and a client
//!   connection's certificate, if any, must come from the clients' CA
//!   ([`MeshTls::check_client`]). A client certificate cannot open a mesh connection.

use std::sync::Arc;

use aqueduct_core::mesh::NodeId;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use crate::cluster::ClusterConfig;
use crate::config::TlsConfig;
use crate::revocation::{ClientVerifier, MESH_CRL_KEY};
use crate::tls::{common_name, provider, read_certs, Identity, TlsError};

/// The mesh's ALPN.
pub const MESH_ALPN: &[u8] = b"aqueduct-mesh";
/// The DNS name every node verifies in its peers' certificates.
pub const MESH_NAME: &str = "aqueduct-mesh";

fn rustls_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Rustls(e.to_string())
}

/// A node's TLS for the mesh.
#[derive(Debug)]
pub struct MeshTls {
    /// This node's id: its peer certificate's CN.
    pub node: NodeId,
    key: Arc<CertifiedKey>,
    client: Arc<rustls::ClientConfig>,
    /// Verifies peer certificates (`cluster.tls.ca_file`, `cluster.tls.crl_file`), mandatory.
    peers: Arc<ClientVerifier>,
    /// Verifies client certificates (`tls.client_ca_file`, `tls.crl_file`), if configured.
    clients: Option<Arc<ClientVerifier>>,
}

fn roots(key: &'static str, path: &std::path::Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in read_certs(key, path)? {
        roots.add(cert).map_err(rustls_err)?;
    }
    Ok(roots)
}

impl MeshTls {
    /// Load the node's peer certificate and the cluster CA (`cluster.tls.*`; the certificate
    /// defaults to the broker's `tls.cert_file`).
    pub fn load(
        cluster: &ClusterConfig,
        tls: &TlsConfig,
        clients: Option<Arc<ClientVerifier>>,
    ) -> Result<MeshTls, TlsError> {
        let provider = provider();
        let ca = cluster.ca_file.as_deref().ok_or_else(|| {
            TlsError::Rustls("cluster.tls.ca_file is required for the mesh".into())
        })?;
        // The keys named in errors are those read: the cluster's own, or the broker's.
        let ((cert_key, cert_path), (key_key, key_path)) =
            match (&cluster.cert_file, &cluster.key_file) {
                (Some(c), Some(k)) => (("cluster.tls.cert_file", c), ("cluster.tls.key_file", k)),
                _ => match (&tls.cert_file, &tls.key_file) {
                    (Some(c), Some(k)) => (("tls.cert_file", c), ("tls.key_file", k)),
                    _ => return Err(TlsError::Rustls(
                        "the mesh needs a peer certificate: cluster.tls.cert_file and key_file \
                         (made by `aqueduct cert peer`)"
                            .into(),
                    )),
                },
            };
        let certs = read_certs(cert_key, cert_path)?;
        let key = PrivateKeyDer::from_pem_file(key_path).map_err(|e| TlsError::Pem {
            key: key_key,
            path: key_path.clone(),
            reason: e.to_string(),
        })?;
        let node = certs
            .first()
            .and_then(common_name)
            .and_then(|cn| NodeId::try_from(cn.as_str()).ok())
            .ok_or_else(|| {
                TlsError::Rustls(format!(
                    "{cert_key}: {} has no Common Name to serve as the node id",
                    cert_path.display()
                ))
            })?;
        let certified = Arc::new(
            CertifiedKey::from_der(certs.clone(), key.clone_key(), &provider)
                .map_err(rustls_err)?,
        );
        let peer_roots = Arc::new(roots("cluster.tls.ca_file", ca)?);
        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(rustls_err)?
            .with_root_certificates(peer_roots.clone())
            .with_client_auth_cert(certs, key)
            .map_err(rustls_err)?;
        client.alpn_protocols = vec![MESH_ALPN.to_vec()];
        let peers = Arc::new(ClientVerifier::new(
            "cluster.tls.ca_file",
            ca,
            false,
            (MESH_CRL_KEY, cluster.crl_file.as_deref()),
            false,
        )?);
        Ok(MeshTls {
            node,
            key: certified,
            client: Arc::new(client),
            peers,
            clients,
        })
    }

    /// The verifier of peer certificates, whose revocation lists (`cluster.tls.crl_file`) a
    /// reload replaces.
    pub(crate) fn peer_certs(&self) -> &Arc<ClientVerifier> {
        &self.peers
    }

    /// Whether the lists in force revoke the certificate of a mesh connection's peer (checked
    /// again after a reload: the live connections of a peer revoked since are closed).
    pub fn peer_revoked(&self, conn: &quinn::Connection) -> bool {
        crate::tls::peer_certificates(conn).is_some_and(|chain| self.peers.is_revoked(&chain))
    }

    /// The TLS configuration for dialing peers (verify the name [`MESH_NAME`]). The dialled
    /// peer's certificate is checked against the revocation lists too, by
    /// [`peer_of`](Self::peer_of) once the handshake is done (a resumed session shows none to
    /// the handshake).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.client.clone()
    }

    /// The server side: the broker's QUIC TLS with the mesh added (ALPNs, certificate by ALPN,
    /// client certificates from either CA).
    pub(crate) fn server_config(
        &self,
        tls: &TlsConfig,
        id: &Identity,
    ) -> Result<rustls::ServerConfig, TlsError> {
        let provider = provider();
        let mut hints: Vec<DistinguishedName> = self.peers.root_hint_subjects().to_vec();
        if let Some(c) = &self.clients {
            hints.extend(c.root_hint_subjects().iter().cloned());
        }
        let verifier = Arc::new(EitherCa {
            peers: self.peers.clone() as Arc<dyn ClientCertVerifier>,
            clients: self
                .clients
                .clone()
                .map(|c| c as Arc<dyn ClientCertVerifier>),
            hints,
            mandatory: tls.require_client_cert,
        });
        let client_key = Arc::new(
            CertifiedKey::from_der(id.certs.clone(), id.key.clone_key(), &provider)
                .map_err(rustls_err)?,
        );
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(rustls_err)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(ByAlpn {
                clients: client_key,
                peers: self.key.clone(),
                alpn: server_alpn(),
            }));
        config.alpn_protocols = server_alpn();
        Ok(config)
    }

    /// The node id of a mesh connection's peer: its certificate must chain to the cluster CA
    /// *and* name `aqueduct-mesh` (so that a client certificate of the same CA is no peer).
    pub fn peer_of(&self, conn: &quinn::Connection) -> Result<NodeId, String> {
        let certs = crate::tls::peer_certificates(conn)
            .ok_or("a mesh connection needs a peer certificate")?;
        let (end, rest) = certs.split_first().ok_or("an empty certificate chain")?;
        self.peers
            .verify_client_cert(end, rest, UnixTime::now())
            .map_err(|e| match e {
                rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked) => {
                    "the peer certificate is revoked (cluster.tls.crl_file)".to_string()
                }
                e => format!("the peer certificate is not from cluster.tls.ca_file: {e}"),
            })?;
        if !names_mesh(end) {
            return Err(format!(
                "the certificate does not name {MESH_NAME}: not a peer certificate (make one with \
                 `aqueduct cert peer`)"
            ));
        }
        let cn = common_name(end).ok_or("the peer certificate has no Common Name")?;
        NodeId::try_from(cn.as_str())
    }

    /// A client connection's certificate, if it presented one, must come from the clients' CA,
    /// and must not be a peer certificate (a node is not a client identity).
    pub fn check_client(&self, conn: &quinn::Connection) -> Result<(), String> {
        let Some(certs) = crate::tls::peer_certificates(conn) else {
            return Ok(());
        };
        let Some((end, rest)) = certs.split_first() else {
            return Ok(());
        };
        if names_mesh(end) {
            return Err(PEER_IS_NO_CLIENT.into());
        }
        match &self.clients {
            Some(v) => v
                .verify_client_cert(end, rest, UnixTime::now())
                .map(|_| ())
                .map_err(|e| format!("the client certificate is not from tls.client_ca_file: {e}")),
            None => Err("client certificates need tls.client_ca_file".into()),
        }
    }
}

/// Why a connection presenting a peer certificate as a client's is refused.
pub const PEER_IS_NO_CLIENT: &str =
    "a peer certificate (it names aqueduct-mesh) is not a client identity";

/// Does the connection's client present a peer certificate (one that names `aqueduct-mesh`)?
pub fn presents_peer_certificate(conn: &quinn::Connection) -> bool {
    crate::tls::peer_certificates(conn)
        .as_deref()
        .and_then(<[_]>::first)
        .is_some_and(names_mesh)
}

/// Does the certificate name `aqueduct-mesh` (a peer certificate)?
pub fn names_mesh(cert: &CertificateDer<'_>) -> bool {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert) else {
        return false;
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return false;
    };
    san.value
        .general_names
        .iter()
        .any(|n| matches!(n, x509_parser::extensions::GeneralName::DNSName(d) if *d == MESH_NAME))
}

/// The negotiated ALPN of a connection.
pub fn alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<quinn::crypto::rustls::HandshakeData>()
        .ok()?
        .protocol
}

/// The client-facing certificate for clients, the peer certificate for peers.
#[derive(Debug)]
struct ByAlpn {
    clients: Arc<CertifiedKey>,
    peers: Arc<CertifiedKey>,
    /// The server's ALPN protocols, in its order of preference ([`server_alpn`]).
    alpn: Vec<Vec<u8>>,
}

/// What a node's endpoint offers with the cluster on, in its order of preference: clients'
/// `aqueduct-v1` first, then the mesh's (WebTransport's `h3` is added after both).
fn server_alpn() -> Vec<Vec<u8>> {
    vec![crate::tls::ALPN.to_vec(), MESH_ALPN.to_vec()]
}

impl ResolvesServerCert for ByAlpn {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // By the protocol the handshake settles on, not by what is offered.
        let mesh = crate::tls::chosen_alpn(&self.alpn, &hello) == Some(MESH_ALPN);
        Some(if mesh {
            self.peers.clone()
        } else {
            self.clients.clone()
        })
    }
}

/// Accepts a client certificate from either CA during the handshake; the connection's ALPN
/// decides afterwards which one it had to be.
#[derive(Debug)]
struct EitherCa {
    peers: Arc<dyn ClientCertVerifier>,
    clients: Option<Arc<dyn ClientCertVerifier>>,
    hints: Vec<DistinguishedName>,
    mandatory: bool,
}

impl ClientCertVerifier for EitherCa {
    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self
            .peers
            .verify_client_cert(end_entity, intermediates, now)
        {
            Ok(v) => Ok(v),
            Err(e) => match &self.clients {
                Some(c) => c.verify_client_cert(end_entity, intermediates, now),
                None => Err(e),
            },
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.peers.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.peers.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.peers.supported_verify_schemes()
    }
}
