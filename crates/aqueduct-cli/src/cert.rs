//! `aqueduct cert`: a small certificate authority for mTLS, so that a broker that requires client
//! certificates can be tried without an openssl recipe.
//!
//! Everything is X.509 v3 with ECDSA P-256 keys: the CA (`basicConstraints CA:TRUE`, key usages
//! for signing certificates), a broker certificate (`serverAuth`, the names given as
//! subjectAltNames) and client certificates (`clientAuth`, the client id as Common Name — the
//! broker takes a client's id from it). Keys are written with mode 0600; existing files are never
//! overwritten.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;

/// Validity of the certificates made here.
const VALID_DAYS: i64 = 365;

/// The files of the CA in `dir`.
fn ca_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("ca.pem"), dir.join("ca-key.pem"))
}

/// Valid from a few minutes ago (clocks differ a little) for [`VALID_DAYS`].
fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::days(VALID_DAYS);
}

/// Write `text` to `path`, refusing to replace a file; private keys get mode 0600.
fn write_new(path: &Path, text: &str, private: bool) -> Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut f = opts.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            anyhow!("{} exists already; not replacing it", path.display())
        } else {
            anyhow!("cannot write {}: {e}", path.display())
        }
    })?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Make a CA in `dir`: `ca.pem` (give it to brokers as `tls.client_ca_file` and to clients as
/// `--ca`) and `ca-key.pem` (keep it private).
pub fn make_ca(dir: &Path, common_name: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (cert_path, key_path) = ca_files(dir);
    let key = KeyPair::generate().context("generating the CA key")?;
    let params = ca_params(common_name)?;
    let cert = params.self_signed(&key).context("signing the CA")?;
    write_new(&cert_path, &cert.pem(), false)?;
    write_new(&key_path, &key.serialize_pem(), true)?;
    Ok(vec![cert_path, key_path])
}

fn ca_params(common_name: &str) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    validity(&mut params);
    Ok(params)
}

/// The CA made by [`make_ca`] in `dir`, ready to sign.
fn load_ca(dir: &Path) -> Result<Issuer<'static, KeyPair>> {
    let (cert_path, key_path) = ca_files(dir);
    let read = |p: &Path| {
        std::fs::read_to_string(p).with_context(|| {
            format!(
                "reading {} (make the CA first: aqueduct cert ca --out {})",
                p.display(),
                dir.display()
            )
        })
    };
    let key = KeyPair::from_pem(&read(&key_path)?)
        .map_err(|e| anyhow!("{}: not a private key ({e})", key_path.display()))?;
    let pem = read(&cert_path)?;
    let der = rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or_else(|| anyhow!("{}: no certificate in it", cert_path.display()))?
        .map_err(|e| anyhow!("{}: {e}", cert_path.display()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| anyhow!("{}: not an X.509 certificate ({e})", cert_path.display()))?;
    let subject = cert.subject();
    let cn = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| anyhow!("{}: the CA has no Common Name", cert_path.display()))?;
    // The issuer name of what we sign must be the CA's subject exactly: a CA made by
    // `aqueduct cert ca` has a Common Name and nothing else.
    if subject.iter().count() != 1 {
        bail!(
            "{}: only a CA made by `aqueduct cert ca` (a subject with just a Common Name) can sign here",
            cert_path.display()
        );
    }
    Ok(Issuer::new(ca_params(cn)?, key))
}

/// Sign a leaf certificate with the CA in `dir`; writes `<stem>.pem` and `<stem>-key.pem`.
fn make_leaf(
    dir: &Path,
    stem: &str,
    common_name: &str,
    names: &[String],
    usages: &[ExtendedKeyUsagePurpose],
) -> Result<Vec<PathBuf>> {
    let issuer = load_ca(dir)?;
    let mut params = CertificateParams::new(names.to_vec())
        .map_err(|e| anyhow!("invalid name in {names:?}: {e}"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = usages.to_vec();
    params.use_authority_key_identifier_extension = true;
    validity(&mut params);
    let key = KeyPair::generate().context("generating a key")?;
    let cert = params.signed_by(&key, &issuer).context("signing")?;
    let cert_path = dir.join(format!("{stem}.pem"));
    let key_path = dir.join(format!("{stem}-key.pem"));
    write_new(&cert_path, &cert.pem(), false)?;
    write_new(&key_path, &key.serialize_pem(), true)?;
    Ok(vec![cert_path, key_path])
}

/// A broker certificate for `names` (DNS names or IP addresses), signed by the CA in `dir`.
pub fn make_server(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>> {
    let first = names
        .first()
        .ok_or_else(|| anyhow!("give at least one --name"))?;
    make_leaf(
        dir,
        "server",
        first,
        names,
        &[ExtendedKeyUsagePurpose::ServerAuth],
    )
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
    {
        bail!("{what} name {name:?}: use letters, digits and - _ . @ (it is also a file name)");
    }
    Ok(())
}

/// A client certificate whose Common Name is the client id `name`, signed by the CA in `dir`.
pub fn make_client(dir: &Path, name: &str) -> Result<Vec<PathBuf>> {
    check_name("client", name)?;
    make_leaf(dir, name, name, &[], &[ExtendedKeyUsagePurpose::ClientAuth])
}

/// The DNS name every cluster node verifies in its peers' certificates (so that addresses need
/// not be in them): `aqueduct-mesh`.
pub const MESH_NAME: &str = "aqueduct-mesh";

/// A cluster node's certificate: Common Name the node id `node`, DNS names `aqueduct-mesh` (what
/// peers verify) and `names` (what clients use to reach this node), good for both ends of a
/// TLS connection (a node dials its peers and serves clients and peers).
pub fn make_peer(dir: &Path, node: &str, names: &[String]) -> Result<Vec<PathBuf>> {
    check_name("node", node)?;
    let mut all = vec![MESH_NAME.to_string()];
    all.extend(names.iter().cloned());
    make_leaf(
        dir,
        node,
        node,
        &all,
        &[
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_server_and_client_certificates_chain_and_refuse_to_overwrite() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), "Test CA").expect("ca");
        assert!(make_ca(dir.path(), "Test CA").is_err(), "never overwrites");
        make_server(dir.path(), &["localhost".into(), "127.0.0.1".into()]).expect("server");
        make_client(dir.path(), "alice").expect("client");
        assert!(make_client(dir.path(), "../x").is_err());
        make_peer(
            dir.path(),
            "aqueduct-0",
            &["aqueduct-0.aqueduct-headless".into()],
        )
        .expect("peer");
        let read = |f: &str| std::fs::read(dir.path().join(f)).expect("file");
        let der = |f: &str| {
            rustls_pki_types::CertificateDer::pem_slice_iter(&read(f))
                .next()
                .expect("one")
                .expect("pem")
        };
        let (ca, client) = (der("ca.pem"), der("alice.pem"));
        let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca).expect("ca parses");
        let (_, client_cert) = x509_parser::parse_x509_certificate(&client).expect("parses");
        assert_eq!(client_cert.version(), x509_parser::x509::X509Version::V3);
        assert_eq!(client_cert.issuer(), ca_cert.subject());
        let eku = client_cert
            .extended_key_usage()
            .expect("ok")
            .expect("present");
        assert!(eku.value.client_auth);
        let peer = der("aqueduct-0.pem");
        let (_, peer_cert) = x509_parser::parse_x509_certificate(&peer).expect("parses");
        let eku = peer_cert
            .extended_key_usage()
            .expect("ok")
            .expect("present");
        assert!(eku.value.client_auth && eku.value.server_auth);
        let san = peer_cert
            .subject_alternative_name()
            .expect("ok")
            .expect("present");
        let names: Vec<String> = san
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert!(
            names.iter().any(|n| n.contains(MESH_NAME))
                && names
                    .iter()
                    .any(|n| n.contains("aqueduct-0.aqueduct-headless")),
            "{names:?}"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("alice-key.pem"))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "private key readable by others: {mode:o}");
        }
    }
}
