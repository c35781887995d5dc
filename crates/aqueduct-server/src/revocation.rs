//! Client certificates checked against a CA and, with `tls.crl_file`, against that CA's
//! certificate revocation lists — lists that can be replaced while the broker runs.
//!
//! One [`ClientVerifier`] serves every place that verifies client certificates of a CA: the
//! client listener's handshake, the cluster's client check ([`MeshTls`]) and the admin API
//! (its own). A reload (SIGHUP, `Control::reload_revocations`) reads the file once
//! ([`Lists::read`]), checks the lists against every verifier's CAs
//! ([`ClientVerifier::prepare`]), and only then swaps them all, so new handshakes see the new
//! lists at once; [`ClientVerifier::is_revoked`] then tells which live connections hold a
//! certificate revoked since (the server closes them, the admin API refuses their calls).
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

/// The configuration key of the clients' revocation lists.
pub const CRL_KEY: &str = "tls.crl_file";
/// The configuration key of the cluster's (peer certificates, `cluster.tls.ca_file`).
pub const MESH_CRL_KEY: &str = "cluster.tls.crl_file";

/// Verifies client certificates of one CA (see the module docs).
#[derive(Debug)]
pub struct ClientVerifier {
    /// The CA certificates (`ca_key`), to check the lists against.
    ca_key: &'static str,
    cas: Vec<CertificateDer<'static>>,
    roots: Arc<rustls::RootCertStore>,
    /// A client without a certificate is let in (`tls.require_client_cert: false`).
    optional: bool,
    /// A certificate of an issuer the lists do not cover passes.
    allow_unknown: bool,
    /// The CA subjects a server names to clients (the same whatever the lists).
    hints: Vec<DistinguishedName>,
    current: RwLock<Arc<dyn ClientCertVerifier>>,
}

impl ClientVerifier {
    /// Client certificates of the CA in `ca` (read under the key `ca_key`), checked against the
    /// lists in `crl_file` (read under the key `crl_key`) if given.
    pub fn new(
        ca_key: &'static str,
        ca: &Path,
        optional: bool,
        (crl_key, crl_file): (&'static str, Option<&Path>),
        allow_unknown: bool,
    ) -> Result<ClientVerifier, TlsError> {
        let cas = read_certs(ca_key, ca)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in &cas {
            roots
                .add(cert.clone())
                .map_err(|e| TlsError::Rustls(format!("{ca_key}: {e}")))?;
        }
        let roots = Arc::new(roots);
        let mut v = ClientVerifier {
            ca_key,
            cas,
            hints: Vec::new(),
            roots: roots.clone(),
            optional,
            allow_unknown,
            current: RwLock::new(build(&roots, optional, allow_unknown, None)?),
        };
        if let Some(path) = crl_file {
            let lists = Lists::read(crl_key, path)?;
            let built = v.prepare(&lists)?;
            v.install(built);
        }
        v.hints = v.current().root_hint_subjects().to_vec();
        Ok(v)
    }

    /// The verifier for `lists`, once they are checked against this verifier's CAs: each list
    /// of one of them must carry its signature, and (unless certificates of uncovered issuers
    /// pass) each of them must have a list — a file that would revoke nothing, or refuse every
    /// client at its handshake, is refused here instead. Lists of other CAs are left to the
    /// verifiers of those (one file serves the clients' CA and an admin CA of its own).
    pub(crate) fn prepare(&self, lists: &Lists) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
        let bad = |reason: String| TlsError::Pem {
            key: lists.key,
            path: lists.path.clone(),
            reason,
        };
        let mut cas = Vec::new();
        for der in &self.cas {
            let (_, ca) = x509_parser::parse_x509_certificate(der)
                .map_err(|e| TlsError::Rustls(format!("{}: {e}", self.ca_key)))?;
            cas.push(ca);
        }
        let mut covered = vec![false; cas.len()];
        for (i, der) in lists.crls.iter().enumerate() {
            let (_, crl) = x509_parser::parse_x509_crl(der)
                .map_err(|e| bad(format!("list {} is not a revocation list: {e}", i + 1)))?;
            // A list of another CA (the file may serve several verifiers: the clients' CA and
            // an admin CA of its own) is not this verifier's to use.
            if let Some(at) = cas.iter().position(|ca| ca.subject() == crl.issuer()) {
                crl.verify_signature(cas[at].public_key()).map_err(|e| {
                    bad(format!(
                        "list {} names {} as its issuer but is not signed by that CA's key in {} ({e})",
                        i + 1,
                        crl.issuer(),
                        self.ca_key
                    ))
                })?;
                covered[at] = true;
            }
        }
        if let Some(at) = covered.iter().position(|c| !c) {
            if !self.allow_unknown {
                return Err(bad(format!(
                    "no revocation list of {}, a CA in {}: its client certificates could not be checked (each would be refused)",
                    cas[at].subject(),
                    self.ca_key
                )));
            }
            tracing::warn!(
                "{} has no revocation list of {}, a CA in {}: its certificates are not checked \
                 for revocation (add that CA's list to the file to check them)",
                lists.key,
                cas[at].subject(),
                self.ca_key
            );
        }
        build(
            &self.roots,
            self.optional,
            self.allow_unknown,
            Some((lists.key, lists.crls.clone())),
        )
    }

    /// Whether `issuer` is one of this verifier's CAs.
    fn has_ca(&self, issuer: &x509_parser::x509::X509Name<'_>) -> bool {
        self.cas.iter().any(|der| {
            x509_parser::parse_x509_certificate(der).is_ok_and(|(_, ca)| ca.subject() == issuer)
        })
    }

    /// Put a verifier made by [`prepare`](Self::prepare) in force.
    pub(crate) fn install(&self, verifier: Arc<dyn ClientCertVerifier>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = verifier;
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the lists in force revoke `chain` (a live connection's certificates, end entity
    /// first). Any other verification failure is not revocation. Checked at a moment inside the
    /// certificate's validity: a certificate that has expired since is checked for revocation
    /// all the same (verified now, the expiry would hide it: it is checked first).
    pub fn is_revoked(&self, chain: &[CertificateDer<'_>]) -> bool {
        let Some((end, rest)) = chain.split_first() else {
            return false;
        };
        let now = UnixTime::now();
        let at = match crate::tls::validity(end) {
            Some((from, until)) => {
                let from = u64::try_from(from).unwrap_or(0);
                let until = u64::try_from(until).unwrap_or(0).max(from);
                UnixTime::since_unix_epoch(std::time::Duration::from_secs(
                    now.as_secs().clamp(from, until),
                ))
            }
            None => now,
        };
        matches!(
            self.current().verify_client_cert(end, rest, at),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked
            ))
        )
    }
}

/// `lists`: the key they were read under and the lists, if any.
fn build(
    roots: &Arc<rustls::RootCertStore>,
    optional: bool,
    allow_unknown: bool,
    lists: Option<(&'static str, Vec<CertificateRevocationListDer<'static>>)>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let mut builder = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider());
    let key = lists.as_ref().map_or(CRL_KEY, |(k, _)| k);
    if let Some((_, crls)) = lists.filter(|(_, crls)| !crls.is_empty()) {
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
        .map_err(|e| TlsError::Rustls(format!("{key}: {e}")))
}

/// Every list in `lists` is of a CA of one of `verifiers` (those that use the file): a list of
/// another CA would revoke nothing, and is refused as [`ClientVerifier::prepare`] refuses a list
/// that cannot be read.
pub(crate) fn all_claimed(
    lists: &Lists,
    verifiers: &[Option<&ClientVerifier>],
) -> Result<(), TlsError> {
    for (i, der) in lists.crls.iter().enumerate() {
        let Ok((_, crl)) = x509_parser::parse_x509_crl(der) else {
            continue; // prepare says what is wrong with it
        };
        if !verifiers.iter().flatten().any(|v| v.has_ca(crl.issuer())) {
            let cas: Vec<&str> = verifiers.iter().flatten().map(|v| v.ca_key).collect();
            return Err(TlsError::Pem {
                key: lists.key,
                path: lists.path.clone(),
                reason: format!(
                    "list {} is of {}, a CA in none of {}: it would revoke nothing (a list of \
                     an old CA?)",
                    i + 1,
                    crl.issuer(),
                    cas.join(" and ")
                ),
            });
        }
    }
    Ok(())
}

/// The revocation lists of a file (`tls.crl_file`, `cluster.tls.crl_file`), as read.
#[derive(Debug, Clone)]
pub struct Lists {
    /// The key the file was named by.
    key: &'static str,
    path: PathBuf,
    crls: Vec<CertificateRevocationListDer<'static>>,
    /// How many certificates they revoke.
    pub revoked: usize,
    /// The lists past their `nextUpdate` (still used: an expired list is not enforced, see
    /// docs/architecture.md), described for a warning.
    pub expired: Vec<String>,
}

impl Lists {
    /// The key the file is named by.
    pub fn key(&self) -> &'static str {
        self.key
    }

    /// The lists in `path` (PEM `X509 CRL` blocks, or one DER list). Each is parsed here, so a
    /// damaged file is reported at startup (or by the reload) naming the key, not at a
    /// client's handshake.
    pub fn read(key: &'static str, path: &Path) -> Result<Lists, TlsError> {
        let (crls, revoked) = read_crls(key, path)?;
        let now = x509_parser::time::ASN1Time::now();
        let expired = crls
            .iter()
            .enumerate()
            .filter_map(|(i, der)| {
                let (_, crl) = x509_parser::parse_x509_crl(der).ok()?;
                let due = crl.next_update().filter(|due| *due < now)?;
                Some(format!("list {} of {} (due {})", i + 1, crl.issuer(), due))
            })
            .collect();
        Ok(Lists {
            key,
            path: path.to_owned(),
            crls,
            revoked,
            expired,
        })
    }

    /// Say which lists are past their `nextUpdate` (at startup and at each reload): they are
    /// still used, but a CA that stopped publishing new ones goes unnoticed otherwise.
    pub fn warn_expired(&self) {
        if !self.expired.is_empty() {
            tracing::warn!(
                "{}: {} past its next update; still used, but renew it (`aqueduct cert revoke \
                 --out DIR` re-signs this CA's list)",
                self.key,
                self.expired.join(", ")
            );
        }
    }
}

fn read_crls(
    key: &'static str,
    path: &Path,
) -> Result<(Vec<CertificateRevocationListDer<'static>>, usize), TlsError> {
    let bad = |reason: String| TlsError::Pem {
        key,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A list past its `nextUpdate` is still read (and used), and named for a warning: an
    /// expired list went unnoticed.
    #[test]
    fn lists_past_their_next_update_are_named() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::KeyCertSign,
        ];
        let issuer = rcgen::Issuer::new(params, key);
        let crl = |next_update| {
            rcgen::CertificateRevocationListParams {
                this_update: rcgen::date_time_ymd(2020, 1, 1),
                next_update,
                crl_number: rcgen::SerialNumber::from(1u64),
                issuing_distribution_point: None,
                revoked_certs: Vec::new(),
                key_identifier_method: rcgen::KeyIdMethod::Sha256,
            }
            .signed_by(&issuer)
            .expect("signed")
            .pem()
            .expect("pem")
        };
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("crl.pem");
        let text = crl(rcgen::date_time_ymd(2100, 1, 1)) + &crl(rcgen::date_time_ymd(2021, 1, 1));
        std::fs::write(&path, text).expect("write");
        let lists = Lists::read(CRL_KEY, &path).expect("read");
        assert_eq!(lists.expired.len(), 1, "{:?}", lists.expired);
        assert!(
            lists.expired[0].starts_with("list 2 of "),
            "{:?}",
            lists.expired
        );
    }
}
