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

/// Validity of the certificates made here (never beyond their CA's).
const VALID_DAYS: i64 = 365;
/// Validity of a CA: ten years, so that the certificates it signs within that time do not
/// outlive it (a leaf's validity is cut at its CA's end).
const CA_VALID_DAYS: i64 = 3650;

/// The files of the CA in `dir`.
fn ca_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("ca.pem"), dir.join("ca-key.pem"))
}

/// Valid from a few minutes ago (clocks differ a little) for `days`, and not beyond `until`
/// (the CA's end, for what it signs).
fn validity(params: &mut CertificateParams, days: i64, until: Option<time::OffsetDateTime>) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    let end = now + time::Duration::days(days);
    params.not_after = until.map_or(end, |u| end.min(u));
}

/// Write a certificate and its key, both new: neither is written if either exists (a new
/// certificate next to an old key, or the reverse, would be a pair that does not match).
fn write_pair(cert_path: &Path, cert: &str, key_path: &Path, key: &str) -> Result<()> {
    for p in [cert_path, key_path] {
        if p.exists() {
            bail!(
                "{} exists already; not replacing it (nor writing {})",
                p.display(),
                if p == cert_path { key_path } else { cert_path }.display()
            );
        }
    }
    write_new(cert_path, cert, false)?;
    if let Err(e) = write_new(key_path, key, true) {
        let _ = std::fs::remove_file(cert_path);
        return Err(e);
    }
    Ok(())
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
pub fn make_ca(dir: &Path, common_name: Option<&str>) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (cert_path, key_path) = ca_files(dir);
    let key = KeyPair::generate().context("generating the CA key")?;
    let named = common_name.map_or_else(|| default_ca_name(&key), str::to_string);
    let mut params = ca_params(&named)?;
    validity(&mut params, CA_VALID_DAYS, None);
    let cert = params.self_signed(&key).context("signing the CA")?;
    write_pair(&cert_path, &cert.pem(), &key_path, &key.serialize_pem())?;
    Ok(vec![cert_path, key_path])
}

/// "Aqueduct CA" and the first 8 hex digits of the SHA-256 of the CA's public key: a name of
/// its own for each CA. A revocation list names its CA by name only, so the broker cannot tell
/// two CAs of one name apart and refuses their lists (`tls.crl_file`); every CA made with the
/// default name "Aqueduct CA" made a rollover (the new CA trusted beside the old one) fail so.
fn default_ca_name(key: &KeyPair) -> String {
    format!("Aqueduct CA {}", aqueduct_server::tls::key_tag(key, 4))
}

fn ca_params(common_name: &str) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    // It signs leaves only: no intermediate CA under it.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    Ok(params)
}

/// The CA made by [`make_ca`] in `dir`, ready to sign, and when it ends.
fn load_ca(dir: &Path) -> Result<(Issuer<'static, KeyPair>, time::OffsetDateTime)> {
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
    let der = first_cert_of(read(&cert_path)?.as_bytes(), &cert_path)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| anyhow!("{}: not an X.509 certificate ({e})", cert_path.display()))?;
    // What it signs must chain to the certificate clients and brokers are given.
    if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        bail!(
            "{} is not the certificate of the key {} (one of the two was replaced): make a new \
             CA in another directory",
            cert_path.display(),
            key_path.display()
        );
    }
    let until = cert.validity().not_after.to_datetime();
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
    Ok((Issuer::new(ca_params(cn)?, key), until))
}

/// Sign a leaf certificate with the CA in `dir`; writes `<stem>.pem` and `<stem>-key.pem`.
fn make_leaf(
    dir: &Path,
    stem: &str,
    common_name: &str,
    names: &[String],
    usages: &[ExtendedKeyUsagePurpose],
) -> Result<Vec<PathBuf>> {
    for name in names {
        check_san(name)?;
    }
    let (issuer, ca_until) = load_ca(dir)?;
    let mut params = CertificateParams::new(names.to_vec())
        .map_err(|e| anyhow!("invalid name in {names:?}: {e}"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    // ECDSA keys sign; they encipher nothing (RFC 8813: no keyEncipherment).
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages.to_vec();
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, VALID_DAYS, Some(ca_until));
    let key = KeyPair::generate().context("generating a key")?;
    let cert = params.signed_by(&key, &issuer).context("signing")?;
    let cert_path = dir.join(format!("{stem}.pem"));
    let key_path = dir.join(format!("{stem}-key.pem"));
    write_pair(&cert_path, &cert.pem(), &key_path, &key.serialize_pem())?;
    Ok(vec![cert_path, key_path])
}

/// A subjectAltName as `--name` gives it: an IP address, or a DNS name (an optional leading
/// `*.`, then labels of letters, digits and `-`). A port or URL there made a name no client
/// could match.
fn check_san(name: &str) -> Result<()> {
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let host = name.strip_prefix("*.").unwrap_or(name);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        bail!(
            "--name {name:?}: not a DNS name or an IP address (no port, scheme or path: e.g. \
             broker.example.com, 10.0.0.5 or ::1)"
        );
    }
    Ok(())
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
    // Its files would be the CA's, the broker's or the revocation list's.
    if ["ca", "ca-key", "server", "crl"].contains(&name) {
        bail!("{what} name {name:?}: the tool's own files use that name; choose another");
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

/// The revocation list in `dir` that [`revoke`] keeps: the broker's `tls.crl_file`.
pub const CRL_FILE: &str = "crl.pem";

/// Revoke the certificates `certs` (made by the CA in `dir`): their serial numbers join those
/// already in `DIR/crl.pem` (created if missing, empty if `certs` is), in a new list signed by
/// the CA with the next CRL number, valid for [`VALID_DAYS`] (so no certificate also renews
/// it). Returns the list's path and what was added (a certificate revoked before is not added
/// twice).
pub fn revoke(dir: &Path, certs: &[PathBuf]) -> Result<(PathBuf, Vec<String>)> {
    let (issuer, _) = load_ca(dir)?;
    let (ca_path, _) = ca_files(dir);
    let ca_der = first_cert(&ca_path)?;
    let (_, ca) = x509_parser::parse_x509_certificate(&ca_der)
        .map_err(|e| anyhow!("{}: not an X.509 certificate ({e})", ca_path.display()))?;
    let crl_path = dir.join(CRL_FILE);
    let (mut revoked, number) = match std::fs::read(&crl_path) {
        Ok(pem) => read_crl(&crl_path, &pem, ca.subject())?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), 0),
        Err(e) => bail!("cannot read {}: {e}", crl_path.display()),
    };
    let now = time::OffsetDateTime::now_utc();
    let mut added = Vec::new();
    for path in certs {
        let der = first_cert(path)?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| anyhow!("{}: not an X.509 certificate ({e})", path.display()))?;
        if cert.issuer() != ca.subject() {
            bail!(
                "{}: issued by {}, not by this CA ({})",
                path.display(),
                cert.issuer(),
                ca.subject()
            );
        }
        // Two CAs can have one name: the signature tells them apart.
        if cert.verify_signature(Some(ca.public_key())).is_err() {
            bail!(
                "{}: names this CA ({}) as its issuer but was not signed by its key (another CA \
                 with the same name made it): revoke it with that CA",
                path.display(),
                ca.subject()
            );
        }
        let serial = cert.raw_serial().to_vec();
        let name = format!(
            "{} (serial {})",
            cert.subject(),
            cert.raw_serial_as_string()
        );
        if revoked
            .iter()
            .any(|r: &rcgen::RevokedCertParams| r.serial_number.as_ref() == serial.as_slice())
        {
            crate::print_line(&format!("{name}: revoked already"))?;
            continue;
        }
        revoked.push(rcgen::RevokedCertParams {
            serial_number: rcgen::SerialNumber::from(serial),
            revocation_time: now,
            reason_code: None,
            invalidity_date: None,
        });
        added.push(name);
    }
    let params = rcgen::CertificateRevocationListParams {
        this_update: now - time::Duration::minutes(5),
        next_update: now + time::Duration::days(VALID_DAYS),
        crl_number: rcgen::SerialNumber::from(
            number
                .checked_add(1)
                .ok_or_else(|| anyhow!("{}: its CRL number is at its end", crl_path.display()))?,
        ),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    let crl = params
        .signed_by(&issuer)
        .context("signing the revocation list")?;
    let pem = crl.pem().context("encoding the revocation list")?;
    // Replaced whole (a new file, then renamed over the old): a broker reading it meanwhile sees
    // the old list or the new one.
    let tmp = dir.join(format!(".{CRL_FILE}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    write_new(&tmp, &pem, false)?;
    std::fs::rename(&tmp, &crl_path)
        .with_context(|| format!("replacing {}", crl_path.display()))?;
    Ok((crl_path, added))
}

/// The first certificate of a PEM file.
fn first_cert(path: &Path) -> Result<rustls_pki_types::CertificateDer<'static>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    first_cert_of(&pem, path)
}

/// The first certificate of `pem`, read from `path`.
fn first_cert_of(pem: &[u8], path: &Path) -> Result<rustls_pki_types::CertificateDer<'static>> {
    rustls_pki_types::CertificateDer::pem_slice_iter(pem)
        .next()
        .ok_or_else(|| anyhow!("{}: no certificate in it", path.display()))?
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The revoked certificates and CRL number of a list made by [`revoke`] for the CA `subject`.
fn read_crl(
    path: &Path,
    pem: &[u8],
    subject: &x509_parser::x509::X509Name<'_>,
) -> Result<(Vec<rcgen::RevokedCertParams>, u64)> {
    use rustls_pki_types::CertificateRevocationListDer;
    let der = CertificateRevocationListDer::pem_slice_iter(pem)
        .next()
        .ok_or_else(|| anyhow!("{}: no revocation list (X509 CRL) in it", path.display()))?
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let (_, crl) = x509_parser::parse_x509_crl(&der)
        .map_err(|e| anyhow!("{}: not a revocation list ({e})", path.display()))?;
    if crl.issuer() != subject {
        bail!(
            "{}: a list of another CA ({}); this one is {subject}",
            path.display(),
            crl.issuer()
        );
    }
    let number = match crl.crl_number().map(|n| n.to_bytes_be()) {
        None => 0,
        Some(b) if b.len() <= 8 => b.iter().fold(0u64, |n, &d| (n << 8) | u64::from(d)),
        Some(_) => bail!("{}: its CRL number is beyond 64 bits", path.display()),
    };
    let mut revoked = Vec::new();
    for r in crl.iter_revoked_certificates() {
        let at = time::OffsetDateTime::from_unix_timestamp(r.revocation_date.timestamp())
            .map_err(|e| anyhow!("{}: a revocation date out of range ({e})", path.display()))?;
        revoked.push(rcgen::RevokedCertParams {
            serial_number: rcgen::SerialNumber::from_slice(r.raw_serial()),
            revocation_time: at,
            reason_code: None,
            invalidity_date: None,
        });
    }
    Ok((revoked, number))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Common Name of the CA in `dir`.
    fn ca_name(dir: &Path) -> String {
        let pem = std::fs::read(ca_files(dir).0).expect("ca.pem");
        let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).expect("pem");
        let cert = pem.parse_x509().expect("certificate");
        let cn = cert.subject().iter_common_name().next();
        cn.and_then(|cn| cn.as_str().ok())
            .expect("a Common Name")
            .to_string()
    }

    /// Two CAs made with the default name are named apart, so a new one can be trusted beside
    /// the one it replaces with both revocation lists (the broker refuses the lists of two CAs of
    /// one name). Every CA was "Aqueduct CA".
    #[test]
    fn each_ca_gets_a_name_of_its_own_by_default() {
        let (old, new) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        make_ca(old.path(), None).expect("ca");
        make_ca(new.path(), None).expect("ca");
        let (old, new) = (ca_name(old.path()), ca_name(new.path()));
        for name in [&old, &new] {
            let digits = name.strip_prefix("Aqueduct CA ").expect("the default name");
            assert!(
                digits.len() == 8 && digits.chars().all(|c| c.is_ascii_hexdigit()),
                "{name}"
            );
        }
        assert_ne!(old, new);
        let named = tempfile::tempdir().expect("dir");
        make_ca(named.path(), Some("Example Corp CA")).expect("ca");
        assert_eq!(ca_name(named.path()), "Example Corp CA");
    }

    #[test]
    fn ca_server_and_client_certificates_chain_and_refuse_to_overwrite() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), Some("Test CA")).expect("ca");
        assert!(
            make_ca(dir.path(), Some("Test CA")).is_err(),
            "never overwrites"
        );
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

    /// `aqueduct cert revoke`: the list grows by each certificate once, its number goes up,
    /// it is signed by the CA; a certificate of another CA is refused.
    #[test]
    fn revoking_adds_each_certificate_once_to_a_signed_list() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), Some("Test CA")).expect("ca");
        make_client(dir.path(), "alice").expect("client");
        make_client(dir.path(), "bob").expect("client");
        let cert = |f: &str| dir.path().join(f);
        let list = |path: &Path| {
            let pem = std::fs::read(path).expect("crl.pem");
            let der = rustls_pki_types::CertificateRevocationListDer::pem_slice_iter(&pem)
                .next()
                .expect("one list")
                .expect("pem");
            let (_, crl) = x509_parser::parse_x509_crl(&der).expect("parses");
            let serials: Vec<Vec<u8>> = crl
                .iter_revoked_certificates()
                .map(|r| r.raw_serial().to_vec())
                .collect();
            let number = crl.crl_number().map(|n| n.to_string());
            (serials, number, crl.issuer().to_string())
        };
        let serial = |f: &str| {
            let der = first_cert(&cert(f)).expect("cert");
            let (_, c) = x509_parser::parse_x509_certificate(&der).expect("parses");
            c.raw_serial().to_vec()
        };
        let (path, added) = revoke(dir.path(), &[]).expect("an empty list");
        assert!(added.is_empty());
        assert_eq!(list(&path), (vec![], Some("1".into()), "CN=Test CA".into()));
        let (_, added) = revoke(dir.path(), &[cert("alice.pem")]).expect("revoke alice");
        assert_eq!(added.len(), 1, "{added:?}");
        let (_, added) = revoke(dir.path(), &[cert("alice.pem"), cert("bob.pem")]).expect("bob");
        assert_eq!(added.len(), 1, "alice was revoked already: {added:?}");
        let (serials, number, _) = list(&path);
        assert_eq!(serials, vec![serial("alice.pem"), serial("bob.pem")]);
        assert_eq!(number.as_deref(), Some("3"));
        // Another CA's certificate: refused by its issuer's name, or, from another CA of the
        // same name, by its signature (it said "revoked").
        for (cn, said) in [
            ("Other CA", "not by this CA"),
            ("Test CA", "not signed by its key"),
        ] {
            let other = tempfile::tempdir().expect("dir");
            make_ca(other.path(), Some(cn)).expect("ca");
            make_client(other.path(), "eve").expect("client");
            let err = revoke(dir.path(), &[other.path().join("eve.pem")]).expect_err(cn);
            assert!(err.to_string().contains(said), "{cn}: {err}");
            assert_eq!(list(&path).0.len(), 2, "{cn}: nothing written");
        }
    }

    /// A certificate is never written without its key or next to another's: with the CA's key
    /// left and its certificate gone, `cert ca` wrote a new certificate before it refused, and
    /// everything signed after did not chain to it. A CA whose certificate is not its key's is
    /// refused.
    #[test]
    fn a_certificate_and_its_key_are_written_together_and_must_match() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), Some("Test CA")).expect("ca");
        let (cert_path, key_path) = ca_files(dir.path());
        let old_key = std::fs::read(&key_path).expect("key");
        std::fs::remove_file(&cert_path).expect("rm");
        let err = make_ca(dir.path(), Some("Test CA")).expect_err("the key is there");
        assert!(
            err.to_string().contains("ca-key.pem exists already"),
            "{err}"
        );
        assert!(
            !cert_path.exists(),
            "no certificate written beside the old key"
        );
        assert_eq!(std::fs::read(&key_path).expect("key"), old_key);
        // A certificate of another key in its place: nothing is signed with the pair.
        let other = tempfile::tempdir().expect("dir");
        make_ca(other.path(), Some("Test CA")).expect("ca");
        std::fs::copy(ca_files(other.path()).0, &cert_path).expect("copy");
        let err = make_client(dir.path(), "alice").expect_err("a mismatched CA");
        assert!(
            err.to_string()
                .contains("is not the certificate of the key"),
            "{err}"
        );
        assert!(!dir.path().join("alice.pem").exists());
    }

    /// The CA lives ten years and what it signs at most to its end; leaves have no
    /// keyEncipherment (ECDSA); the CA signs no CA (path length 0).
    #[test]
    fn validity_and_usages() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), Some("Test CA")).expect("ca");
        make_client(dir.path(), "alice").expect("client");
        let parse = |f: &str| {
            let der = first_cert(&dir.path().join(f)).expect("cert");
            let (_, c) = x509_parser::parse_x509_certificate(&der).expect("parses");
            let days =
                (c.validity().not_after.timestamp() - c.validity().not_before.timestamp()) / 86_400;
            let ku = c
                .key_usage()
                .expect("ok")
                .map(|k| (k.value.digital_signature(), k.value.key_encipherment()));
            let bc = c
                .basic_constraints()
                .expect("ok")
                .map(|b| b.value.path_len_constraint);
            (days, ku, bc)
        };
        let (ca_days, _, ca_bc) = parse("ca.pem");
        assert_eq!((ca_days, ca_bc), (3650, Some(Some(0))));
        let (leaf_days, leaf_ku, _) = parse("alice.pem");
        assert_eq!(leaf_days, 365);
        assert_eq!(
            leaf_ku,
            Some((true, false)),
            "digitalSignature, no keyEncipherment"
        );
    }

    /// `--name` takes DNS names and IP addresses only; the tool's own file names are no
    /// client's or node's.
    #[test]
    fn names_are_checked() {
        let dir = tempfile::tempdir().expect("dir");
        make_ca(dir.path(), Some("Test CA")).expect("ca");
        for bad in ["broker.example.com:4242", "https://x y", "-x.example", ""] {
            let err = make_server(dir.path(), &[bad.into()]).expect_err(bad);
            assert!(
                err.to_string().contains("not a DNS name or an IP address"),
                "{err}"
            );
        }
        assert!(!dir.path().join("server.pem").exists());
        for name in ["crl", "ca", "ca-key", "server"] {
            let err = make_client(dir.path(), name).expect_err(name);
            assert!(err.to_string().contains("the tool's own files"), "{err}");
        }
        make_server(dir.path(), &["*.example.com".into(), "::1".into()]).expect("good names");
    }
}
