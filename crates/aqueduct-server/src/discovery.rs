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

use crate::mesh::{Event, MeshHandle};

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

/// Look up `host` every `interval` until `stop`; hand changed answers (plus `fixed`) to the
/// mesh. A lookup is bounded by the interval itself.
pub(crate) async fn run(
    resolver: Arc<dyn Resolver>,
    host: String,
    port: u16,
    interval: Duration,
    fixed: Vec<SocketAddr>,
    mesh: MeshHandle,
    mut stop: watch::Receiver<bool>,
) {
    let mut d = Discovery::new(Instant::now(), interval);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(d.poll_timeout().into()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let answer = match tokio::time::timeout(interval, resolver.resolve(&host, port)).await {
            Ok(a) => a,
            Err(_) => Err(format!("no answer within {interval:?}")),
        };
        match d.handle_answer(Instant::now(), answer) {
            Answer::Changed(found) => {
                let mut all: BTreeSet<SocketAddr> = found;
                all.extend(fixed.iter().copied());
                info!(%host, peers = all.len(), "cluster discovery: the peer set changed");
                mesh.send(Event::Peers(all.into_iter().collect()));
            }
            Answer::Unchanged => {}
            Answer::Failed { why, keeping } => {
                warn!(%host, "cluster discovery: lookup failed ({why}); keeping the last {keeping} peers")
            }
        }
    }
}
