//! Client TLS: TLS 1.3 only, ALPN `aqueduct-v1`, ring, and the trust modes of [`Trust`].

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::pem::PemObject;

use crate::error::ConnectError;
use crate::options::{is_local, Trust};

/// The ALPN protocol id.
pub const ALPN: &[u8] = b"aqueduct-v1";

/// rustls 0.23.48 deprecates its *ring* provider (it has no post-quantum key exchange). This
/// project stays on *ring*: one crypto provider and no C toolchain for aws-lc-rs (`.ci/run`
/// checks that aws-lc-rs is not in the tree). The deprecation is allowed here, the one place
/// the client names it.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem_err(what: &'static str, path: &str, e: impl std::fmt::Display) -> ConnectError {
    ConnectError::Pem {
        what,
        path: path.to_string(),
        reason: e.to_string(),
    }
}

fn certs_from(
    what: &'static str,
    src: &str,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, ConnectError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(what, src, e))?;
    if certs.is_empty() {
        return Err(pem_err(what, src, "no certificate in it"));
    }
    Ok(certs)
}

fn read(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|e| pem_err(what, &path.display().to_string(), e))
}

/// Accepts exactly one certificate, by SHA-256 of its DER encoding; signatures are still checked.
#[derive(Debug)]
struct Pinned {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let digest = ring::digest::digest(&ring::digest::SHA256, end_entity.as_ref());
        if digest.as_ref() == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            let actual: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
            Err(rustls::Error::General(format!(
                "the broker's certificate (SHA-256 {actual}) does not match the pinned fingerprint"
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General(
            "TLS 1.2 is not used by Aqueduct".into(),
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Build the client's rustls configuration for `host`.
pub(crate) fn client_crypto(
    trust: &Trust,
    host: &str,
    client_cert: Option<&(std::path::PathBuf, std::path::PathBuf)>,
) -> Result<rustls::ClientConfig, ConnectError> {
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ConnectError::Tls(e.to_string()))?;
    let roots =
        |certs: Vec<CertificateDer<'static>>| -> Result<rustls::RootCertStore, ConnectError> {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs {
                roots.add(c).map_err(|e| ConnectError::Tls(e.to_string()))?;
            }
            Ok(roots)
        };
    let builder = match trust {
        Trust::CaFile(path) => {
            let pem = read("CA certificate", path)?;
            builder.with_root_certificates(roots(certs_from(
                "CA certificate",
                &path.display().to_string(),
                &pem,
            )?)?)
        }
        Trust::CaPem(pem) => {
            builder.with_root_certificates(roots(certs_from("CA certificate", "(PEM text)", pem)?)?)
        }
        Trust::Fingerprint(fingerprint) => {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Pinned {
                    fingerprint: *fingerprint,
                    provider: provider.clone(),
                }))
        }
        Trust::Auto(dev_cert) => {
            if !is_local(host) {
                return Err(ConnectError::NoTrust {
                    host: host.to_string(),
                });
            }
            // In the temporary directory, only this user's private directory is trusted:
            // anyone could have made it first, and put a certificate of their own there.
            if let Some(dir) = dev_cert
                .parent()
                .filter(|d| *d == aqueduct_udp::private_dir::path())
            {
                if let Err(e) = aqueduct_udp::private_dir::check(dir) {
                    return Err(pem_err(
                        "development certificate",
                        &dev_cert.display().to_string(),
                        format!("not trusted: {e} (set AQUEDUCT_HOME, or pass --ca or --pin)"),
                    ));
                }
            }
            let pem = std::fs::read(dev_cert).map_err(|e| {
                pem_err(
                    "development certificate",
                    &dev_cert.display().to_string(),
                    format!(
                        "{e} (a local broker with a generated certificate writes it to \
                         $AQUEDUCT_HOME/dev-cert.pem, or ~/.aqueduct/dev-cert.pem without \
                         AQUEDUCT_HOME: is one running, with the same AQUEDUCT_HOME as here? \
                         Else pass --ca or --pin)"
                    ),
                )
            })?;
            builder.with_root_certificates(roots(certs_from(
                "development certificate",
                &dev_cert.display().to_string(),
                &pem,
            )?)?)
        }
    };
    let mut config = match client_cert {
        Some((cert, key)) => {
            let certs = certs_from(
                "client certificate",
                &cert.display().to_string(),
                &read("client certificate", cert)?,
            )?;
            let key = PrivateKeyDer::from_pem_slice(&read("client key", key)?)
                .map_err(|e| pem_err("client key", &key.display().to_string(), e))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| ConnectError::Tls(e.to_string()))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    config.enable_early_data = true;
    Ok(config)
}
