//! DNS discovery for the cluster (`cluster.discovery`): every `interval` the peers' name is
//! looked up, and a changed answer replaces the mesh's peer set (with the static
//! `cluster.peers` added), so scale-up connects and scale-down disconnects. The decisions (when
//! to look, what a failed or empty answer means) are `aqueduct_core::discovery`'s; lookups go
//! through a [`Resolver`], which tests replace.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aqueduct_core::discovery::{Answer, Discovery};
use tokio::sync::watch;
use tracing::{info, warn};

/// A name lookup.
pub type Lookup<'a> = Pin<Box<dyn Future<Output = Result<Vec<SocketAddr>, String>> + Send + 'a>>;

/// Looks up the addresses of `host:port`.
pub trait Resolver: Send + Sync + std::fmt::Debug {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> Lookup<'a>;
}

/// The system's resolver (`getaddrinfo`, through tokio).
#[derive(Debug, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> Lookup<'a> {
        Box::pin(async move {
            tokio::net::lookup_host((host, port))
                .await
                .map(|addrs| addrs.collect())
                .map_err(|e| e.to_string())
        })
    }
}

/// The static `cluster.peers`, looked up again at each refresh: a name that does not resolve
/// yet (a container not started) is tried again, and one whose address changed (a container
/// restarted) follows it. A name whose lookup fails keeps its last addresses.
#[derive(Debug)]
pub(crate) struct StaticPeers {
    names: Vec<String>,
    last: std::collections::HashMap<String, Vec<SocketAddr>>,
    failing: std::collections::HashSet<String>,
}

/// How often the static peers are looked up again when DNS discovery is off.
pub(crate) const STATIC_REFRESH: Duration = Duration::from_secs(10);

impl StaticPeers {
    pub(crate) fn new(names: Vec<String>) -> Self {
        StaticPeers {
            names,
            last: Default::default(),
            failing: Default::default(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Every static peer's addresses, after looking each name up once more (bounded by
    /// `limit` per name). A failure is logged when a name starts failing, not at every try.
    pub(crate) async fn resolve(&mut self, limit: Duration) -> BTreeSet<SocketAddr> {
        for name in &self.names {
            let found =
                match tokio::time::timeout(limit, tokio::net::lookup_host(name.as_str())).await {
                    Ok(Ok(addrs)) => Ok(addrs.collect::<Vec<_>>()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {limit:?}")),
                };
            match found {
                Ok(addrs) if !addrs.is_empty() => {
                    if self.failing.remove(name) {
                        info!(peer = %name, "cluster.peers: resolves again");
                    }
                    self.last.insert(name.clone(), addrs);
                }
                Ok(_) | Err(_) => {
                    if self.failing.insert(name.clone()) {
                        let why = found.err().unwrap_or_else(|| "no address".into());
                        warn!(peer = %name, "cluster.peers: cannot resolve ({why}); trying again, keeping its last addresses");
                    }
                }
            }
        }
        self.last.values().flatten().copied().collect()
    }
}

/// `work`, unless `stop` comes first (`None`): a lookup that hangs (a resolver that does not
/// answer) must not hold up the broker's shutdown.
async fn unless_stopped<T>(
    stop: &mut watch::Receiver<bool>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        done = work => Some(done),
        _ = stop.wait_for(|s| *s) => None,
    }
}

/// Without DNS discovery: hand the static peers to the mesh, and again whenever their
/// addresses change, until `stop`.
pub(crate) async fn run_static(
    mut statics: StaticPeers,
    peers: impl Fn(Vec<SocketAddr>),
    mut stop: watch::Receiver<bool>,
) {
    let mut sent: Option<BTreeSet<SocketAddr>> = None;
    loop {
        let Some(all) = unless_stopped(&mut stop, statics.resolve(STATIC_REFRESH)).await else {
            return;
        };
        if sent.as_ref() != Some(&all) && !(sent.is_none() && all.is_empty()) {
            peers(all.iter().copied().collect());
            sent = Some(all);
        }
        tokio::select! {
            _ = tokio::time::sleep(STATIC_REFRESH) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Look up `host` every `interval` until `stop`; hand the peer set — the last answer plus the
/// static peers — to the mesh whenever it changes. The static peers are handed over at once,
/// whatever the first lookup says: they are always kept.
pub(crate) async fn run(
    resolver: Arc<dyn Resolver>,
    host: String,
    port: u16,
    interval: Duration,
    mut statics: StaticPeers,
    peers: impl Fn(Vec<SocketAddr>),
    mut stop: watch::Receiver<bool>,
) {
    let mut d = Discovery::new(Instant::now(), interval);
    let mut found: BTreeSet<SocketAddr> = BTreeSet::new();
    let mut sent: Option<BTreeSet<SocketAddr>> = None;
    let Some(mut fixed) = unless_stopped(&mut stop, statics.resolve(interval)).await else {
        return;
    };
    loop {
        let all: BTreeSet<SocketAddr> = found.union(&fixed).copied().collect();
        if sent.as_ref() != Some(&all) && !(sent.is_none() && all.is_empty()) {
            info!(%host, peers = all.len(), "cluster discovery: the peer set changed");
            peers(all.iter().copied().collect());
            sent = Some(all);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(d.poll_timeout().into()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let lookup = tokio::time::timeout(interval, resolver.resolve(&host, port));
        let answer = match unless_stopped(&mut stop, lookup).await {
            None => return,
            Some(Ok(a)) => a,
            Some(Err(_)) => Err(format!("no answer within {interval:?}")),
        };
        match d.handle_answer(Instant::now(), answer) {
            Answer::Changed(now) => found = now,
            Answer::Unchanged => {}
            Answer::Failed { why, keeping } => {
                warn!(%host, "cluster discovery: lookup failed ({why}); keeping the last {keeping} peers")
            }
        }
        if !statics.is_empty() {
            match unless_stopped(&mut stop, statics.resolve(interval)).await {
                Some(now) => fixed = now,
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resolver that never answers, and says when it was asked.
    #[derive(Debug)]
    struct Hanging(tokio::sync::Notify);

    impl Resolver for Hanging {
        fn resolve<'a>(&'a self, _host: &'a str, _port: u16) -> Lookup<'a> {
            self.0.notify_one();
            Box::pin(std::future::pending())
        }
    }

    /// A lookup that never answers does not hold up the stop: the discovery task ends when
    /// told to, not when its lookup times out (after the interval, an hour here). It held up
    /// the mesh task, which the broker's shutdown then aborted after 2 s.
    #[tokio::test]
    async fn a_hanging_lookup_does_not_hold_up_the_stop() {
        let resolver = Arc::new(Hanging(tokio::sync::Notify::new()));
        let (stop_tx, stop) = watch::channel(false);
        let asked = resolver.0.notified();
        let discovery = run(
            resolver.clone(),
            "peers.example".into(),
            4242,
            Duration::from_secs(3600),
            StaticPeers::new(Vec::new()),
            |_| {},
            stop,
        );
        // Stop once a lookup is under way; both in this task, nothing left running after.
        let stopper = async {
            asked.await;
            stop_tx.send_replace(true);
        };
        tokio::time::timeout(Duration::from_secs(20), async {
            tokio::join!(discovery, stopper)
        })
        .await
        .expect("the discovery task stopped once a lookup was under way");
    }
}
