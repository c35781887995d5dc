//! The cluster's configuration (`cluster.*`, the seed's keys and the mesh's own), checked at
//! startup even while the cluster is off so that a typo shows before it is switched on. The mesh
//! decisions are `aqueduct_core::mesh`; `mesh.rs` and `mesh_tls.rs` carry them out.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{invalid, parse_duration, range, ConfigError};

/// A value the seed writes either as a number or as a string (`port: "4242"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberOrText {
    Number(u64),
    Text(String),
}

/// `cluster.discovery.*` (seed keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoverySection {
    pub enabled: bool,
    #[serde(rename = "type")]
    pub kind: String,
    pub host: String,
    pub port: NumberOrText,
    pub interval: String,
}

impl Default for DiscoverySection {
    fn default() -> Self {
        DiscoverySection {
            enabled: false,
            kind: "dns".into(),
            host: String::new(),
            port: NumberOrText::Number(4242),
            interval: "10s".into(),
        }
    }
}

/// `cluster.tls.*`: how peers authenticate each other.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterTlsSection {
    /// CA that signs every node's peer certificate.
    pub ca_file: String,
    /// This node's peer certificate ("" = `tls.cert_file`); its CN is the node's id.
    pub cert_file: String,
    pub key_file: String,
    /// Revocation lists of the cluster CA: revoked peer certificates are no peers ("" = none).
    pub crl_file: String,
}

/// `cluster.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    pub enabled: bool,
    /// Static peers, `host:port` (with or besides discovery).
    pub peers: Vec<String>,
    pub tls: ClusterTlsSection,
    /// Batches to peers: `zstd` or `none`.
    pub compression: String,
    pub compression_level: i64,
    /// Batches smaller than this many bytes go uncompressed.
    pub compression_threshold: u64,
    /// Messages queued per peer before the oldest are dropped (counted).
    pub peer_queue_size: u64,
    /// Interest keys (topic filters and consumer groups) one peer may hold here; a peer that
    /// sends more is disconnected (counted).
    pub max_peer_interest: u64,
    pub discovery: DiscoverySection,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            enabled: false,
            peers: Vec::new(),
            tls: ClusterTlsSection::default(),
            compression: "zstd".into(),
            compression_level: 3,
            compression_threshold: 4096,
            peer_queue_size: 65_536,
            max_peer_interest: aqueduct_core::mesh::DEFAULT_MAX_PEER_INTEREST as u64,
            discovery: DiscoverySection::default(),
        }
    }
}

/// How batches to peers are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Zstd { level: i32, threshold: usize },
}

/// The cluster's settings, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub enabled: bool,
    pub peers: Vec<String>,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// `cluster.tls.crl_file`: revocation lists of the cluster CA (re-read on SIGHUP).
    pub crl_file: Option<PathBuf>,
    pub compression: Compression,
    pub peer_queue_size: usize,
    pub max_peer_interest: usize,
    /// DNS discovery: host, port, interval.
    pub discovery: Option<(String, u16, Duration)>,
}

impl ClusterSection {
    /// Check every key (also while off).
    pub fn validate(&self, tls: &crate::config::TlsSection) -> Result<ClusterConfig, ConfigError> {
        for p in &self.peers {
            let ok = p
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(invalid(
                    "cluster.peers",
                    format!("{p:?} is not host:port (e.g. \"aqueduct-1.internal:4242\")"),
                ));
            }
        }
        // Checked whatever `compression` says, so a bad value shows before it is used.
        let level = range("cluster.compression_level", self.compression_level, 1, 19)? as i32;
        let threshold = range(
            "cluster.compression_threshold",
            self.compression_threshold,
            0,
            16 << 20,
        )? as usize;
        let compression = match self.compression.trim() {
            "none" => Compression::None,
            "zstd" | "" => Compression::Zstd { level, threshold },
            other => {
                return Err(invalid(
                    "cluster.compression",
                    format!("{other:?} is not one of zstd, none"),
                ))
            }
        };
        let peer_queue_size =
            range("cluster.peer_queue_size", self.peer_queue_size, 1, 1 << 24)? as usize;
        let max_peer_interest = range(
            "cluster.max_peer_interest",
            self.max_peer_interest,
            1,
            1 << 26,
        )? as usize;
        let d = &self.discovery;
        let interval = parse_duration("cluster.discovery.interval", &d.interval)?;
        if interval.is_zero() {
            return Err(invalid(
                "cluster.discovery.interval",
                "must be greater than zero",
            ));
        }
        let port = match &d.port {
            NumberOrText::Number(n) => u16::try_from(*n).ok(),
            NumberOrText::Text(t) => t.trim().parse().ok(),
        }
        .filter(|p| *p > 0)
        .ok_or_else(|| invalid("cluster.discovery.port", "is not a port number (1-65535)"))?;
        if d.kind.trim() != "dns" {
            return Err(invalid(
                "cluster.discovery.type",
                format!("{:?} is not supported (dns)", d.kind),
            ));
        }
        if d.enabled && !self.enabled {
            return Err(invalid(
                "cluster.discovery.enabled",
                "needs cluster.enabled: true (discovery finds the peers of a cluster)",
            ));
        }
        if d.enabled && d.host.trim().is_empty() {
            return Err(invalid(
                "cluster.discovery.host",
                "required when cluster.discovery.enabled is true (e.g. the headless Service's \
                 name)",
            ));
        }
        let path = |s: &str| (!s.trim().is_empty()).then(|| PathBuf::from(s.trim()));
        if self.enabled {
            let exists = |key: &'static str, p: &str| match path(p) {
                Some(f) if f.is_file() => Ok(()),
                Some(f) => Err(invalid(
                    key,
                    format!("{} does not exist or is not a file", f.display()),
                )),
                None => Err(invalid(key, "required when cluster.enabled is true")),
            };
            exists("cluster.tls.ca_file", &self.tls.ca_file).map_err(|e| match e {
                ConfigError::Invalid { key, problem } => ConfigError::Invalid {
                    key,
                    problem: format!(
                        "{problem} (the CA that signs every node's peer certificate, e.g. made \
                         with `aqueduct cert ca`)"
                    ),
                },
                other => other,
            })?;
            let own = !self.tls.cert_file.trim().is_empty();
            if !own && !self.tls.key_file.trim().is_empty() {
                // It would be ignored for tls.key_file, with tls.cert_file's certificate.
                return Err(invalid(
                    "cluster.tls.key_file",
                    "is set but cluster.tls.cert_file is not: give both (this node's peer \
                     certificate and its key), or neither to use tls.cert_file and tls.key_file",
                ));
            }
            // The keys named are those read: cluster.tls.*, or tls.* in their place.
            let (cert_key, cert, key_key, key) = if own {
                (
                    "cluster.tls.cert_file",
                    &self.tls.cert_file,
                    "cluster.tls.key_file",
                    &self.tls.key_file,
                )
            } else {
                (
                    "cluster.tls.cert_file",
                    &tls.cert_file,
                    "tls.key_file",
                    &tls.key_file,
                )
            };
            exists(cert_key, cert).map_err(|_| {
                invalid(
                    "cluster.tls.cert_file",
                    "required when cluster.enabled is true (this node's peer certificate, made \
                     by `aqueduct cert peer NODE`; its CN is the node id), or tls.cert_file",
                )
            })?;
            exists(key_key, key)?;
            if !self.tls.crl_file.trim().is_empty() {
                exists("cluster.tls.crl_file", &self.tls.crl_file)?;
            }
        }
        Ok(ClusterConfig {
            enabled: self.enabled,
            peers: self.peers.clone(),
            ca_file: path(&self.tls.ca_file),
            cert_file: path(&self.tls.cert_file),
            key_file: path(&self.tls.key_file),
            crl_file: path(&self.tls.crl_file),
            compression,
            peer_queue_size,
            max_peer_interest,
            discovery: d
                .enabled
                .then(|| (d.host.trim().to_string(), port, interval)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_key() {
        let key = |s: ClusterSection| match s.validate(&Default::default()) {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        let d = ClusterSection::default;
        let peers = ClusterSection {
            peers: vec!["nohost".into()],
            ..d()
        };
        assert_eq!(key(peers), "cluster.peers");
        let algo = ClusterSection {
            compression: "lz4".into(),
            ..d()
        };
        assert_eq!(key(algo), "cluster.compression");
        let level = ClusterSection {
            compression_level: 40,
            ..d()
        };
        assert_eq!(key(level), "cluster.compression_level");
        let unused_level = ClusterSection {
            compression: "none".into(),
            compression_level: 99,
            ..d()
        };
        assert_eq!(
            key(unused_level),
            "cluster.compression_level",
            "checked although unused"
        );
        for bad in [0, (1 << 26) + 1] {
            let interest = ClusterSection {
                max_peer_interest: bad,
                ..d()
            };
            assert_eq!(key(interest), "cluster.max_peer_interest");
        }
        let mut port = d();
        port.discovery.port = NumberOrText::Text("http".into());
        assert_eq!(key(port), "cluster.discovery.port");
        let mut kind = d();
        kind.discovery.kind = "srv".into();
        assert_eq!(key(kind), "cluster.discovery.type");
        let mut alone = d();
        alone.discovery.enabled = true;
        alone.discovery.host = "aqueduct-headless".into();
        assert_eq!(key(alone), "cluster.discovery.enabled");
        let on = ClusterSection {
            enabled: true,
            ..d()
        };
        assert_eq!(key(on), "cluster.tls.ca_file");
        // The key named is the one read: without cluster.tls.cert_file, tls.key_file (it
        // named cluster.tls.key_file); and a cluster.tls.key_file alone is refused (it was
        // ignored for tls.key_file).
        let dir = std::env::temp_dir();
        let file = std::env::current_exe().expect("a file that exists");
        let file = file.to_str().expect("utf-8");
        let with_tls = |cluster: ClusterSection, tls: &crate::config::TlsSection| match cluster
            .validate(tls)
        {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        let enabled = |key_file: &str| {
            let mut s = ClusterSection {
                enabled: true,
                ..d()
            };
            s.tls.ca_file = file.into();
            s.tls.key_file = key_file.into();
            s
        };
        let tls = crate::config::TlsSection {
            cert_file: file.into(),
            key_file: dir.join("no-such-key.pem").display().to_string(),
            ..Default::default()
        };
        assert_eq!(with_tls(enabled(""), &tls), "tls.key_file");
        assert_eq!(with_tls(enabled(file), &tls), "cluster.tls.key_file");
    }

    #[test]
    fn defaults_validate_and_the_seed_port_may_be_text() {
        let mut s = ClusterSection {
            peers: vec!["aqueduct-1:4242".into(), "[::1]:4242".into()],
            ..ClusterSection::default()
        };
        s.discovery.port = NumberOrText::Text("4242".into());
        let c = s.validate(&Default::default()).expect("valid");
        assert_eq!(c.max_peer_interest, 1 << 20);
        assert_eq!(
            c.compression,
            Compression::Zstd {
                level: 3,
                threshold: 4096
            }
        );
        assert!(!c.enabled);
    }
}
