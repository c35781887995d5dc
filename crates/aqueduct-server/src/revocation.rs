//! Client certificates checked against a CA and, with `tls.crl_file`, against that CA's
//! certificate revocation lists — lists that can be replaced while the broker runs.
//!
//! One [`ClientVerifier`] serves every place that verifies client certificates of a CA: the
//! client listener's handshake, the cluster's client check ([`MeshTls`]) and, when it shares
//! the CA, the admin API. [`ClientVerifier::reload`] (SIGHUP) re-reads the file and swaps the
//! verifier, so new handshakes see the new lists at once; [`ClientVerifier::is_revoked`] then
//! tells which live connections hold a certificate revoked since (the server closes them).
//!
//! Only end-entity certificates are checked (a list revokes the client certificates its CA
//! issued, which is what `aqueduct cert revoke` makes). A client certificate whose issuer has no
//! list in the file is refused (fail closed: a list of the wrong CA would otherwise revoke
//! nothing, silently) — except on the admin API when its CA is not the clients' CA.
//!
//! [`MeshTls`]: crate::mesh_tls::MeshTls

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, UnixTime};

use crate::tls::{provider, read_certs, TlsError};

/// The configuration key of the revocation lists.
pub const CRL_KEY: &str = "tls.crl_file";

/// Verifies client certificates of one CA (see the module docs).
#[derive(Debug)]
pub struct ClientVerifier {
    roots: Arc<rustls::RootCertStore>,
    /// A client without a certificate is let in (`tls.require_client_cert: false`).
    optional: bool,
    /// A certificate of an issuer the lists do not cover passes.
    allow_unknown: bool,
    crl_file: Option<PathBuf>,
    /// The CA subjects a server names to clients (the same whatever the lists).
    hints: Vec<DistinguishedName>,
    current: RwLock<Arc<dyn ClientCertVerifier>>,
}

impl ClientVerifier {
    /// Client certificates of the CA in `ca` (read under the key `ca_key`), checked against the
    /// lists in `crl_file` if given.
    pub fn new(
        ca_key: &'static str,
        ca: &Path,
        optional: bool,
        crl_file: Option<&Path>,
        allow_unknown: bool,
    ) -> Result<ClientVerifier, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in read_certs(ca_key, ca)? {
            roots
                .add(cert)
                .map_err(|e| TlsError::Rustls(format!("{ca_key}: {e}")))?;
        }
        let roots = Arc::new(roots);
        let crls = match crl_file {
            Some(path) => read_crls(path)?.0,
            None => Vec::new(),
        };
        let current = build(&roots, optional, allow_unknown, crls)?;
        Ok(ClientVerifier {
            hints: current.root_hint_subjects().to_vec(),
            roots,
            optional,
            allow_unknown,
            crl_file: crl_file.map(Path::to_owned),
            current: RwLock::new(current),
        })
    }

    /// Re-read the revocation lists; the lists in force stay if the file cannot be read or
    /// does not hold valid lists. Returns how many certificates the new lists revoke (`None`
    /// without `tls.crl_file`).
    pub fn reload(&self) -> Result<Option<usize>, TlsError> {
        let Some(path) = &self.crl_file else {
            return Ok(None);
        };
        let (crls, revoked) = read_crls(path)?;
        let verifier = build(&self.roots, self.optional, self.allow_unknown, crls)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = verifier;
        Ok(Some(revoked))
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the lists in force revoke `chain` (a live connection's certificates, end entity
    /// first). Any other verification failure (an expired certificate, say) is not revocation.
    pub fn is_revoked(&self, chain: &[CertificateDer<'_>]) -> bool {
        let Some((end, rest)) = chain.split_first() else {
            return false;
        };
        matches!(
            self.current()
                .verify_client_cert(end, rest, UnixTime::now()),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked
            ))
        )
    }
}

fn build(
    roots: &Arc<rustls::RootCertStore>,
    optional: bool,
    allow_unknown: bool,
    crls: Vec<CertificateRevocationListDer<'static>>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let mut builder = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider());
    if !crls.is_empty() {
        builder = builder.with_crls(crls).only_check_end_entity_revocation();
        if allow_unknown {
            builder = builder.allow_unknown_revocation_status();
        }
    }
    if optional {
        builder = builder.allow_unauthenticated();
    }
    builder
        .build()
        .map_err(|e| TlsError::Rustls(format!("{CRL_KEY}: {e}")))
}

/// The lists in `path` (PEM `X509 CRL` blocks, or one DER list) and how many certificates they
/// revoke. Each is parsed here, so a damaged file is reported at startup (or by the reload)
/// naming the key, not at a client's handshake.
fn read_crls(path: &Path) -> Result<(Vec<CertificateRevocationListDer<'static>>, usize), TlsError> {
    let bad = |reason: String| TlsError::Pem {
        key: CRL_KEY,
        path: path.to_owned(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let mut crls: Vec<CertificateRevocationListDer<'static>> =
        CertificateRevocationListDer::pem_slice_iter(&bytes)
            .collect::<Result<_, _>>()
            .map_err(|e| bad(e.to_string()))?;
    if crls.is_empty() && bytes.first() == Some(&0x30) {
        // Not PEM: one list in DER (what `openssl ca -gencrl -outform DER` writes).
        crls.push(CertificateRevocationListDer::from(bytes));
    }
    if crls.is_empty() {
        return Err(bad(
            "no revocation list in it (PEM `-----BEGIN X509 CRL-----` blocks or one DER list)"
                .into(),
        ));
    }
    let mut revoked = 0;
    for (i, crl) in crls.iter().enumerate() {
        let (_, parsed) = x509_parser::parse_x509_crl(crl)
            .map_err(|e| bad(format!("list {} is not a revocation list: {e}", i + 1)))?;
        revoked += parsed.iter_revoked_certificates().count();
    }
    Ok((crls, revoked))
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        !self.optional
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
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}
