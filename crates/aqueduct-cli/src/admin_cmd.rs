//! `aqueduct admin`: the gRPC admin API from the command line (quotas, ACL rules, clients,
//! topics, broker info, the cluster). Output is a table by default, JSON with `--json` (its
//! fields named as in the `.proto`'s responses).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use aqueduct_client::ConnectOptions;
use aqueduct_server::admin::proto;
use clap::Subcommand;
use serde_json::{json, Value};

type AdminClient = proto::admin_service_client::AdminServiceClient<tonic::transport::Channel>;

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Publish quotas: get, set or remove one client's, or list them.
    Quota {
        #[command(subcommand)]
        what: QuotaCommand,
    },
    /// ACL rules: list, add, remove, or replace them all.
    Acl {
        #[command(subcommand)]
        what: AclCommand,
    },
    /// Connected clients: connection id, client id, address, since, subscriptions, counts.
    Clients,
    /// Disconnect a client: every connection of CLIENT, or one with --connection.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["client", "connection"])))]
    Kick {
        /// The client id (certificate CN, or `anonymous`).
        client: Option<String>,
        /// One connection, by the id `aqueduct admin clients` shows.
        #[arg(long)]
        connection: Option<u64>,
        /// Told to the client in the connection close.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Topics with their counters.
    Topics,
    /// Version, uptime and configuration summary.
    Info,
    /// This node's view of the cluster: its id, and per connected peer what it advertised
    /// wanting (filters, groups) and what the mesh sent it and got from it.
    Cluster,
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// A client's quota (its own, or the default it follows).
    Get { client: String },
    /// Set a client's quota: RATE messages/s (0 = unlimited), and the burst.
    Set {
        /// The client id (a certificate's Common Name, a WebTransport token's client, or
        /// anonymous).
        client: String,
        /// Messages per second it may publish (0 = unlimited).
        rate: u64,
        /// Messages it may publish at once (default: its current burst).
        #[arg(long)]
        burst: Option<u64>,
    },
    /// Remove a client's own quota: it follows the default again.
    #[command(visible_alias = "remove")]
    Rm {
        /// The client id.
        client: String,
    },
    /// Every client with its own quota, and the default.
    List,
}

#[derive(Debug, Subcommand)]
pub enum AclCommand {
    /// The rules, the default and whether access control is on.
    List,
    /// Add a rule: CLIENT (id or prefix*), TOPIC (filter), PERMISSION (publish, subscribe, all,
    /// none).
    Add {
        /// The client id, or a prefix ending in * (admin-*, or * for every client).
        client: String,
        /// A topic, or a filter with + and # (orders/+, #).
        topic: String,
        /// What the client may do there: all (or pubsub), publish, subscribe, none (or deny).
        permission: String,
    },
    /// Remove the rule with exactly these fields.
    #[command(visible_alias = "remove")]
    Rm {
        /// The rule's client, as listed.
        client: String,
        /// The rule's topic or filter, as listed.
        topic: String,
        /// The rule's permission, as listed.
        permission: String,
    },
    /// Replace every rule with those in FILE (YAML or JSON: a list of {client, topic,
    /// permission}, or the config file's acl section with `rules:` and `default:`, or what
    /// `admin --json acl list` prints; `-` reads standard input). An `enabled:` in the file is
    /// read and not used: whether the ACL is on is the broker's config (acl.enabled), which
    /// the admin API does not change.
    Replace {
        /// The rules file (YAML or JSON), or `-` for standard input.
        file: PathBuf,
        /// Also set the default permission.
        #[arg(long)]
        default: Option<String>,
    },
}

/// Where the admin API is and how to trust it.
#[derive(Debug)]
pub struct AdminTarget {
    pub addr: String,
    pub opts: ConnectOptions,
    pub json: bool,
}

async fn connect(target: &AdminTarget) -> Result<AdminClient> {
    // The admin API always requires one (admin.client_ca_file): say so before dialing, instead
    // of a TLS handshake per address of the name that the broker refuses.
    if !target.opts.has_client_cert() {
        bail!(
            "the admin API requires an admin client certificate: pass --cert FILE --key FILE \
             (signed by the broker's admin.client_ca_file, CN matching admin.allowed_cn)"
        );
    }
    let tls = target
        .opts
        .tls_config(b"h2")
        .context("admin API TLS settings")?;
    aqueduct_server::admin::connect(
        target.addr.clone(),
        tls,
        &target.opts.verified_name(),
        Duration::from_secs(10),
    )
    .await
    .map_err(|e| {
        let text = e.to_string();
        if text.contains("UnknownIssuer") || text.contains("invalid peer certificate") {
            // This side refused the broker's certificate.
            anyhow!(
                "{text} (the broker's certificate is not trusted: {}; --ca FILE names the CA \
                 that signed it)",
                target.opts.trust_description()
            )
        } else if text.to_lowercase().contains("connection refused") {
            anyhow!(
                "{text} (nothing listens there: is admin.enabled on, and is {} its \
                 admin.listen_addr? --admin-addr sets the address; --addr is the broker's \
                 client address)",
                target.addr
            )
        } else {
            anyhow!("{text} (is admin.enabled on, and --cert/--key an admin certificate?)")
        }
    })
}

fn status(e: tonic::Status) -> anyhow::Error {
    let hint = match e.code() {
        // The call's deadline (tonic reports it as Cancelled "Timeout expired"): the broker
        // may have applied a change whose answer did not come in time.
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded if is_timeout(&e) => {
            " (the call timed out: a change may still have been applied; `aqueduct admin acl \
             list` or `quota list` shows what is in force)"
        }
        // The broker ended the TLS session after its handshake: it did not accept the client
        // certificate (TLS 1.3 checks it after the client thinks it is connected). tonic
        // reports the dropped connection as one of these, depending on when it noticed
        // ("operation was canceled", "transport error").
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
            if e.message().contains("transport error") || e.code() != tonic::Code::Unknown =>
        {
            " (the broker did not accept the client certificate: is --cert/--key signed by its \
             admin.client_ca_file? Or it had all 64 admin connections open, or 8 TLS handshakes \
             from this address in progress)"
        }
        // The broker's message names the CN and the pattern already.
        tonic::Code::PermissionDenied if e.message().contains("admin.allowed_cn") => "",
        tonic::Code::PermissionDenied => {
            " (the certificate's CN must match the broker's admin.allowed_cn, default admin-*)"
        }
        _ => "",
    };
    // The broker's message says what went wrong; the gRPC code's name adds nothing for a user.
    let what = if e.message().is_empty() {
        format!("{:?}", e.code())
    } else {
        e.message().to_string()
    };
    anyhow!("{what}{hint}")
}

/// Whether `e` is a call that ran out of time, not one the broker cut.
fn is_timeout(e: &tonic::Status) -> bool {
    e.code() == tonic::Code::DeadlineExceeded || e.message().contains("Timeout expired")
}

/// Run one admin command, printing its result.
pub async fn run(target: &AdminTarget, cmd: &AdminCommand) -> Result<()> {
    let mut c = connect(target).await?;
    let out = match cmd {
        AdminCommand::Quota { what } => quota(&mut c, what).await?,
        AdminCommand::Acl { what } => acl(&mut c, what).await?,
        AdminCommand::Clients => {
            let r = c
                .list_clients(proto::ListClientsRequest {})
                .await
                .map_err(status)?
                .into_inner();
            clients(&r)
        }
        AdminCommand::Kick {
            client,
            connection,
            reason,
        } => {
            use proto::disconnect_client_request::Target;
            let who = match (client, connection) {
                (_, Some(id)) => Target::ConnectionId(*id),
                (Some(id), None) => Target::ClientId(id.clone()),
                (None, None) => bail!("give a client id or --connection"),
            };
            let r = c
                .disconnect_client(proto::DisconnectClientRequest {
                    target: Some(who),
                    reason: reason.clone(),
                })
                .await
                .map_err(status)?
                .into_inner();
            Output {
                json: json!({ "disconnected": r.disconnected }),
                text: format!("disconnected {} connection(s)", r.disconnected),
            }
        }
        AdminCommand::Topics => {
            let r = c
                .list_topics(proto::ListTopicsRequest {})
                .await
                .map_err(status)?
                .into_inner();
            topics(&r)
        }
        AdminCommand::Info => {
            let r = c
                .get_broker_info(proto::GetBrokerInfoRequest {})
                .await
                .map_err(status)?
                .into_inner();
            info(&r)
        }
        AdminCommand::Cluster => {
            let r = c
                .get_cluster(proto::GetClusterRequest {})
                .await
                .map_err(status)?
                .into_inner();
            cluster(&r)
        }
    };
    if target.json {
        crate::print_line(&out.json.to_string())?;
    } else {
        crate::print_line(&out.text)?;
    }
    Ok(())
}

/// What a command prints, both ways.
struct Output {
    json: Value,
    text: String,
}

/// Columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(header.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

fn quota_json(q: &proto::ClientQuota) -> Value {
    json!({
        "client_id": q.client_id,
        "rate": q.rate,
        "burst": q.burst,
        "is_override": q.is_override,
        "throttled_seconds": q.throttled_seconds,
        "rejected_messages": q.rejected_messages,
    })
}

fn rate(r: u64) -> String {
    if r == 0 {
        "unlimited".into()
    } else {
        format!("{r}/s")
    }
}

fn quota_rows(qs: &[&proto::ClientQuota]) -> String {
    table(
        &["CLIENT", "RATE", "BURST", "OWN", "THROTTLED", "REJECTED"],
        &qs.iter()
            .map(|q| {
                vec![
                    if q.client_id.is_empty() {
                        "(default)".into()
                    } else {
                        q.client_id.clone()
                    },
                    rate(q.rate),
                    q.burst.to_string(),
                    if q.is_override { "yes" } else { "no" }.into(),
                    format!("{:.1}s", q.throttled_seconds),
                    q.rejected_messages.to_string(),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

async fn quota(c: &mut AdminClient, what: &QuotaCommand) -> Result<Output> {
    let one = |q: proto::ClientQuota| Output {
        json: quota_json(&q),
        text: quota_rows(&[&q]),
    };
    Ok(match what {
        QuotaCommand::Get { client } => one(c
            .get_client_quota(proto::GetClientQuotaRequest {
                client_id: client.clone(),
            })
            .await
            .map_err(status)?
            .into_inner()),
        QuotaCommand::Set {
            client,
            rate,
            burst,
        } => one(c
            .set_client_quota(proto::SetClientQuotaRequest {
                client_id: client.clone(),
                rate: *rate,
                burst: *burst,
            })
            .await
            .map_err(status)?
            .into_inner()),
        QuotaCommand::Rm { client } => one(c
            .remove_client_quota(proto::RemoveClientQuotaRequest {
                client_id: client.clone(),
            })
            .await
            .map_err(status)?
            .into_inner()),
        QuotaCommand::List => {
            let r = c
                .list_client_quotas(proto::ListClientQuotasRequest {})
                .await
                .map_err(status)?
                .into_inner();
            let mut all: Vec<&proto::ClientQuota> = r.default_quota.iter().collect();
            all.extend(r.clients.iter());
            Output {
                json: json!({
                    "action": r.action,
                    "default_quota": r.default_quota.as_ref().map(quota_json),
                    "clients": r.clients.iter().map(quota_json).collect::<Vec<_>>(),
                }),
                text: format!("{}\n(over quota: {})", quota_rows(&all), r.action),
            }
        }
    })
}

fn acl_output(a: &proto::Acl) -> Output {
    let rules: Vec<Value> = a
        .rules
        .iter()
        .map(|r| json!({"client_id": r.client_id, "topic": r.topic, "permission": r.permission}))
        .collect();
    let rows: Vec<Vec<String>> = a
        .rules
        .iter()
        .map(|r| vec![r.client_id.clone(), r.topic.clone(), r.permission.clone()])
        .collect();
    Output {
        json: json!({"enabled": a.enabled, "default_permission": a.default_permission, "rules": rules}),
        text: format!(
            "access control {}; default {}; {} rule(s)\n{}",
            if a.enabled {
                "on"
            } else {
                "OFF (acl.enabled: false: everything is allowed; the rules and default below \
                 apply once it is on)"
            },
            a.default_permission,
            a.rules.len(),
            table(&["CLIENT", "TOPIC", "PERMISSION"], &rows)
        ),
    }
}

/// Rules from a file: a list, or a mapping with `rules` (and `default`).
fn read_rules(file: &Path) -> Result<(Vec<proto::AclRule>, Option<String>)> {
    let text = if file == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
    };
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Rule {
        // `client_id`: as `--json acl list` prints it, so that its output can be read back.
        #[serde(alias = "client_id")]
        client: String,
        topic: String,
        permission: String,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Section {
        #[serde(default, alias = "default_permission")]
        default: Option<String>,
        rules: Vec<Rule>,
        #[serde(default)]
        #[allow(dead_code)]
        enabled: Option<bool>,
    }
    // The shape is told by the first line that says anything, so that an error is that shape's
    // own, naming the field and line (tried both ways, a misspelt `permision` was reported as
    // "did not match any variant").
    let list = text
        .lines()
        .map(|l| {
            // A document marker is no content: what follows it on its line may be.
            let l = l.trim();
            l.strip_prefix("---").map_or(l, str::trim_start)
        })
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.starts_with('-') || l.starts_with('['));
    let (rules, default) = if list {
        let rules: Vec<Rule> = serde_saphyr::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: a list of rules, each {{client, topic, permission}}: {e}",
                file.display()
            )
        })?;
        (rules, None)
    } else {
        let s: Section = serde_saphyr::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: a mapping with `rules:` (a list of {{client, topic, permission}}) and \
                 perhaps `default:`, or a list of rules: {e}",
                file.display()
            )
        })?;
        (s.rules, s.default)
    };
    Ok((
        rules
            .into_iter()
            .map(|r| proto::AclRule {
                client_id: r.client,
                topic: r.topic,
                permission: r.permission,
            })
            .collect(),
        default,
    ))
}

async fn acl(c: &mut AdminClient, what: &AclCommand) -> Result<Output> {
    let r = match what {
        AclCommand::List => c.list_acl(proto::ListAclRequest {}).await,
        AclCommand::Add {
            client,
            topic,
            permission,
        } => {
            c.add_acl_rule(proto::AclRule {
                client_id: client.clone(),
                topic: topic.clone(),
                permission: permission.clone(),
            })
            .await
        }
        AclCommand::Rm {
            client,
            topic,
            permission,
        } => {
            c.remove_acl_rule(proto::AclRule {
                client_id: client.clone(),
                topic: topic.clone(),
                permission: permission.clone(),
            })
            .await
        }
        AclCommand::Replace { file, default } => {
            let (rules, file_default) = read_rules(file)?;
            c.update_acl(proto::UpdateAclRequest {
                rules,
                default_permission: default.clone().or(file_default),
            })
            .await
        }
    };
    Ok(acl_output(&r.map_err(status)?.into_inner()))
}

fn since(ms: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(ms);
    let secs = ((now - ms).max(0) / 1000) as u64;
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        _ => format!("{}h", secs / 3600),
    }
}

fn clients(r: &proto::ListClientsResponse) -> Output {
    let rows: Vec<Vec<String>> = r
        .clients
        .iter()
        .map(|c| {
            vec![
                c.connection_id.to_string(),
                c.client_id.clone(),
                c.address.clone(),
                since(c.connected_since_unix_ms),
                c.subscriptions
                    .iter()
                    .map(|s| {
                        if s.group.is_empty() {
                            s.filter.clone()
                        } else {
                            format!("{} (group {})", s.filter, s.group)
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                c.published.to_string(),
                c.delivered.to_string(),
            ]
        })
        .collect();
    let json: Vec<Value> = r
        .clients
        .iter()
        .map(|c| {
            json!({
                "connection_id": c.connection_id,
                "client_id": c.client_id,
                "address": c.address,
                "connected_since_unix_ms": c.connected_since_unix_ms,
                "subscriptions": c.subscriptions.iter().map(|s| json!({
                    "stream_id": s.stream_id, "filter": s.filter, "group": s.group,
                    "queued": s.queued, "in_flight": s.in_flight,
                })).collect::<Vec<_>>(),
                "published": c.published,
                "delivered": c.delivered,
            })
        })
        .collect();
    Output {
        json: Value::Array(json),
        text: table(
            &[
                "CONN",
                "CLIENT",
                "ADDRESS",
                "SINCE",
                "SUBSCRIPTIONS",
                "PUBLISHED",
                "DELIVERED",
            ],
            &rows,
        ),
    }
}

fn topics(r: &proto::ListTopicsResponse) -> Output {
    let rows: Vec<Vec<String>> = r
        .topics
        .iter()
        .map(|t| {
            vec![
                t.name.clone(),
                t.subscribers.to_string(),
                t.published.to_string(),
                t.delivered.to_string(),
                t.dropped.to_string(),
                t.expired.to_string(),
                t.dead_lettered.to_string(),
            ]
        })
        .collect();
    let json: Vec<Value> = r
        .topics
        .iter()
        .map(|t| {
            json!({
                "name": t.name, "subscribers": t.subscribers, "published": t.published,
                "delivered": t.delivered, "dropped": t.dropped, "expired": t.expired,
                "dead_lettered": t.dead_lettered,
            })
        })
        .collect();
    Output {
        json: Value::Array(json),
        text: table(
            &[
                "TOPIC",
                "SUBSCRIBERS",
                "PUBLISHED",
                "DELIVERED",
                "DROPPED",
                "EXPIRED",
                "DEAD-LETTERED",
            ],
            &rows,
        ),
    }
}

fn info(r: &proto::BrokerInfo) -> Output {
    let mut config: Vec<(&String, &String)> = r.config.iter().collect();
    config.sort();
    let mut text = format!(
        "aqueduct-broker {}, up {:.0}s\nlisten {}  metrics {}\nconnections {}  subscriptions {}  topics {}\naccess control {} ({} rules)\n",
        r.version,
        r.uptime_seconds,
        r.listen_addr,
        r.metrics_addr,
        r.connections,
        r.subscriptions,
        r.topics,
        if r.acl_enabled { "on" } else { "off" },
        r.acl_rules
    );
    text.push_str(&table(
        &["KEY", "VALUE"],
        &config
            .iter()
            .map(|(k, v)| vec![k.to_string(), v.to_string()])
            .collect::<Vec<_>>(),
    ));
    Output {
        json: json!({
            "version": r.version, "uptime_seconds": r.uptime_seconds,
            "listen_addr": r.listen_addr, "metrics_addr": r.metrics_addr,
            "connections": r.connections, "subscriptions": r.subscriptions, "topics": r.topics,
            "acl_enabled": r.acl_enabled, "acl_rules": r.acl_rules, "config": r.config,
        }),
        text,
    }
}

fn counters_json(c: &proto::PeerCounters) -> Value {
    json!({
        "forwarded": c.forwarded, "dropped": c.dropped, "bytes": c.bytes,
        "raw_bytes": c.raw_bytes, "expired": c.expired, "queued": c.queued,
        "received": c.received, "received_bytes": c.received_bytes,
        "reconnects": c.reconnects, "not_stored": c.not_stored,
    })
}

fn cluster(r: &proto::ClusterInfo) -> Output {
    if !r.cluster_enabled {
        return Output {
            json: json!({
                "cluster_enabled": false, "node_id": r.node_id,
                "refused_blocks": r.refused_blocks, "peers": [],
            }),
            text: "cluster off (cluster.enabled: false)".into(),
        };
    }
    let interest = |p: &proto::ClusterPeer| p.interest.unwrap_or_default();
    let rows: Vec<Vec<String>> = r
        .peers
        .iter()
        .map(|p| {
            let i = interest(p);
            let mut row = vec![
                p.node_id.clone(),
                format!("{} ({} subs)", i.filters, i.subscriptions),
                format!("{} ({} members)", i.groups, i.group_members),
            ];
            match &p.counters {
                Some(c) => row.extend(
                    [
                        c.forwarded,
                        c.dropped,
                        c.expired,
                        c.queued,
                        c.received,
                        c.bytes,
                        c.raw_bytes,
                        c.received_bytes,
                        c.reconnects,
                        c.not_stored,
                    ]
                    .map(|v| v.to_string()),
                ),
                None => row.extend(std::iter::repeat_n("-".to_string(), 10)),
            }
            row
        })
        .collect();
    let peers: Vec<Value> = r
        .peers
        .iter()
        .map(|p| {
            let i = interest(p);
            json!({
                "node_id": p.node_id,
                "interest": {
                    "filters": i.filters, "subscriptions": i.subscriptions,
                    "groups": i.groups, "group_members": i.group_members,
                },
                "counters": p.counters.as_ref().map(counters_json),
            })
        })
        .collect();
    Output {
        json: json!({
            "cluster_enabled": true, "node_id": r.node_id,
            "refused_blocks": r.refused_blocks, "peers": peers,
        }),
        text: format!(
            "node {}: cluster on, {} peer(s) connected, {} block(s) refused\n{}",
            r.node_id,
            r.peers.len(),
            r.refused_blocks,
            table(
                &[
                    "PEER",
                    "FILTERS",
                    "GROUPS",
                    "FORWARDED",
                    "DROPPED",
                    "EXPIRED",
                    "QUEUED",
                    "RECEIVED",
                    "BYTES-OUT",
                    "RAW-BYTES-OUT",
                    "BYTES-IN",
                    "RECONNECTS",
                    "NOT-STORED",
                ],
                &rows,
            )
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that ran out of time says so, and that a change may have been applied: it was
    /// told "the broker did not accept the client certificate".
    #[test]
    fn a_timed_out_call_is_not_blamed_on_the_certificate() {
        let timeout = status(tonic::Status::cancelled("Timeout expired")).to_string();
        assert!(timeout.contains("timed out"), "{timeout}");
        assert!(!timeout.contains("certificate"), "{timeout}");
        let cut = status(tonic::Status::cancelled("operation was canceled")).to_string();
        assert!(cut.contains("client certificate"), "{cut}");
    }

    #[test]
    fn tables_pad_columns() {
        let t = table(
            &["A", "BB"],
            &[vec!["xxx".into(), "y".into()], vec!["z".into(), "".into()]],
        );
        assert_eq!(t, "A    BB\nxxx  y\nz");
    }

    #[test]
    fn rules_files_in_both_shapes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let list = dir.path().join("list.yaml");
        std::fs::write(&list, "- client: a\n  topic: x/#\n  permission: publish\n").expect("write");
        let (rules, default) = read_rules(&list).expect("list");
        assert_eq!((rules.len(), default), (1, None));
        let section = dir.path().join("section.yaml");
        std::fs::write(
            &section,
            "default: subscribe\nrules:\n  - {client: b, topic: t2, permission: all}\n",
        )
        .expect("write");
        let (rules, default) = read_rules(&section).expect("section");
        assert_eq!(rules[0].client_id, "b");
        assert_eq!(default.as_deref(), Some("subscribe"));
        std::fs::write(&section, "nope: 1\n").expect("write");
        assert!(read_rules(&section).is_err());
        // A misspelt field is named, in either shape.
        std::fs::write(
            &list,
            "# rules\n- client: a\n  topic: x\n  permision: publish\n",
        )
        .expect("write");
        let e = format!("{:#}", read_rules(&list).expect_err("misspelt"));
        assert!(e.contains("permision"), "{e}");
        std::fs::write(
            &section,
            "--- # the rules\nrules:\n  - {client: b, topic: t, permision: all}\n",
        )
        .expect("write");
        let e = format!("{:#}", read_rules(&section).expect_err("misspelt"));
        assert!(e.contains("permision"), "{e}");
    }
}
