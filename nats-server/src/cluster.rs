//! Several `nats-server`s clustered on loopback, JetStream on every node with fsync per write:
//! for the cluster tests and `chorus chaos`.
//!
//! ```no_run
//! let mut cluster = chorus_nats_server::Cluster::start()?;
//! println!("clients may use {:?}", cluster.urls());
//! cluster.nodes[1].kill();
//! cluster.nodes[1].restart()?; // same ports, same store: it rejoins
//! # Ok::<(), chorus_nats_server::Error>(())
//! ```
//!
//! Every port is chosen by the server (`-1`) and read back from its ports file. Nodes start
//! one after the other, each routed to the ones before it (the routes gossip the full mesh);
//! then each node's config is rewritten with the ports it got, so a restarted node comes back
//! on the same ports and rejoins.
//!
//! One node may be made *isolatable* ([`ClusterBuilder::isolatable`]): it reaches its peers
//! only through addresses the caller gives (proxies it controls), and no peer ever dials it,
//! so cutting those proxies partitions it from the others.

use std::fmt;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use crate::{Error, NatsServer, Result, ServerBuilder};

/// An address that refuses connections (port 1 on loopback). A cluster's first node routes
/// to it until its peers exist (JetStream in a cluster refuses to start without a route), and
/// an isolatable node advertises it, so no peer learns an address that would bypass its
/// proxies.
pub const DEAD_ADDRESS: &str = "127.0.0.1:1";

/// The name of the cluster every [`Cluster`] forms.
const CLUSTER_NAME: &str = "chorus-test";

/// How an isolatable node reaches peer `to`, whose route listener is `real` (`host:port`).
type Via = Arc<dyn Fn(usize, &str) -> String + Send + Sync>;

/// How to start a [`Cluster`].
#[derive(Clone)]
pub struct ClusterBuilder {
    size: usize,
    isolatable: Option<(usize, Via)>,
    leafnodes: bool,
}

impl fmt::Debug for ClusterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBuilder")
            .field("size", &self.size)
            .field("isolatable", &self.isolatable.as_ref().map(|(i, _)| *i))
            .finish()
    }
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        ClusterBuilder {
            size: 3,
            isolatable: None,
            leafnodes: false,
        }
    }
}

impl ClusterBuilder {
    /// How many nodes (default 3; at least 2).
    pub fn size(mut self, size: usize) -> Self {
        self.size = size.max(2);
        self
    }

    /// Makes node `node` reach each peer through the address `via(peer, real)` returns for
    /// that peer's route listener `real`, typically a proxy the caller can cut. Its peers never
    /// dial it: they do not list it, and it advertises [`DEAD_ADDRESS`], so that no gossip
    /// leads a peer around the proxies. The node starts last, once its peers' addresses are
    /// known.
    pub fn isolatable(
        mut self,
        node: usize,
        via: impl Fn(usize, &str) -> String + Send + Sync + 'static,
    ) -> Self {
        self.isolatable = Some((node, Arc::new(via)));
        self
    }

    /// Makes every node take leaf node connections (and serve monitoring, where its leaf node
    /// port is read back from), its JetStream in the domain [`HUB_DOMAIN`]:
    /// [`Cluster::leafnode_address`].
    pub fn leafnodes(mut self, on: bool) -> Self {
        self.leafnodes = on;
        self
    }

    /// Starts the nodes and waits until each listens.
    ///
    /// # Errors
    /// [`Error::Io`] when the cluster's directory or a node's config cannot be written; a node's
    /// start error ([`Error::NotFound`], [`Error::Exited`], [`Error::TimedOut`]); [`Error::Ports`]
    /// when a node does not report its route port (or, with leaf nodes, its leaf node port).
    pub fn start(self) -> Result<Cluster> {
        let dir = tempfile::Builder::new()
            .prefix("chorus-cluster-")
            .tempdir()
            .map_err(Error::io("cannot create a temp dir"))?;
        let size = self.size;
        let isolated = self
            .isolatable
            .as_ref()
            .map(|(i, _)| *i)
            .filter(|i| *i < size);
        let order: Vec<usize> = (0..size)
            .filter(|i| Some(*i) != isolated)
            .chain(isolated)
            .collect();
        let mut nodes: Vec<Option<NatsServer>> = (0..size).map(|_| None).collect();
        let mut routes: Vec<Option<String>> = vec![None; size];
        let mut leafs: Vec<Option<String>> = vec![None; size];
        let route_list = |i: usize, routes: &[Option<String>]| -> Vec<String> {
            let mut list: Vec<String> = routes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i && Some(*j) != isolated)
                .filter_map(|(j, r)| r.as_deref().map(|real| (j, real)))
                .map(|(j, real)| match &self.isolatable {
                    Some((k, via)) if *k == i => via(j, real),
                    _ => real.to_owned(),
                })
                .collect();
            if list.is_empty() {
                list.push(DEAD_ADDRESS.to_owned());
            }
            list
        };
        for &i in &order {
            let conf = dir.path().join(format!("n{i}.conf"));
            let text = config(
                dir.path(),
                i,
                "127.0.0.1:-1",
                "127.0.0.1:-1",
                &route_list(i, &routes),
                Some(i) == isolated,
                self.leafnodes.then_some("127.0.0.1:-1"),
            );
            fs::write(&conf, text).map_err(Error::io("cannot write a cluster node's config"))?;
            let node = ServerBuilder::default().config(&conf).start()?;
            routes[i] = Some(route_address(&node)?);
            if self.leafnodes {
                leafs[i] = Some(leaf_address(&node)?);
            }
            nodes[i] = Some(node);
        }
        let nodes: Vec<NatsServer> = nodes.into_iter().flatten().collect();
        for (i, node) in nodes.iter().enumerate() {
            let client = node.url().rsplit("://").next().unwrap_or(node.url());
            let listen = routes[i].as_deref().unwrap_or(DEAD_ADDRESS);
            let text = config(
                dir.path(),
                i,
                client,
                listen,
                &route_list(i, &routes),
                Some(i) == isolated,
                leafs[i].as_deref(),
            );
            fs::write(dir.path().join(format!("n{i}.conf")), text)
                .map_err(Error::io("cannot rewrite a cluster node's config"))?;
        }
        Ok(Cluster {
            nodes,
            routes: routes.into_iter().flatten().collect(),
            leafs,
            _dir: dir,
        })
    }
}

/// One node's config: its name `n<i>`, listeners, JetStream store with fsync per write, the
/// routes it dials, and its leaf node listener when it takes leaf nodes.
fn config(
    dir: &Path,
    i: usize,
    client: &str,
    route: &str,
    routes: &[String],
    isolated: bool,
    leaf: Option<&str>,
) -> String {
    let route_list = routes
        .iter()
        .map(|r| format!("nats-route://{r}"))
        .collect::<Vec<_>>()
        .join(", ");
    let advertise = if isolated {
        format!("  advertise: \"{DEAD_ADDRESS}\"\n")
    } else {
        String::new()
    };
    // A cluster that takes leaf nodes runs JetStream in the hub's domain.
    let domain = if leaf.is_some() {
        format!("  domain: {HUB_DOMAIN}\n")
    } else {
        String::new()
    };
    format!(
        "server_name: n{i}\nlisten: \"{client}\"\njetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n{domain}}}\ncluster {{\n  name: {CLUSTER_NAME}\n  listen: \"{route}\"\n{advertise}  routes: [{route_list}]\n}}\n{}",
        dir.join(format!("store-{i}")).display(),
        leaf_config(leaf),
    )
}

/// The JetStream domain of a cluster that takes leaf nodes: a leaf without JetStream reaches
/// the hub's as `$JS.hub.API`.
pub const HUB_DOMAIN: &str = "hub";

/// The leaf node listener (and the monitoring it is read back from) of a node, when it takes
/// leaf nodes: `listen` is `host:port`, `-1` for a port of the server's choosing.
fn leaf_config(listen: Option<&str>) -> String {
    match listen {
        Some(listen) => {
            // Not advertised: a leaf reaches the hub only by the address it was given (a proxy
            // a test can cut), never around it by another node's gossiped address.
            format!(
                "http: \"127.0.0.1:-1\"\nleafnodes {{\n  listen: \"{listen}\"\n  no_advertise: true\n}}\n"
            )
        }
        None => String::new(),
    }
}

/// The leaf node address of a node, as `host:port`, from its monitoring `/varz` (the ports
/// file does not list leaf node listeners).
fn leaf_address(node: &NatsServer) -> Result<String> {
    use std::io::{Read, Write};
    let missing = |what: &str| Error::Ports(format!("{what} for the node at {}", node.url()));
    let monitor = node
        .monitor_url()
        .ok_or_else(|| missing("no monitoring port"))?;
    let address = monitor.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(address)
        .map_err(|e| missing(&format!("monitoring unreachable ({e})")))?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .map_err(|e| missing(&format!("monitoring ({e})")))?;
    write!(stream, "GET /varz HTTP/1.0\r\nHost: {address}\r\n\r\n")
        .map_err(|e| missing(&format!("monitoring ({e})")))?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .map_err(|e| missing(&format!("monitoring ({e})")))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let varz: serde_json::Value =
        serde_json::from_str(body).map_err(|e| missing(&format!("unreadable /varz ({e})")))?;
    let port = varz["leaf"]["port"]
        .as_u64()
        .filter(|p| *p > 0)
        .ok_or_else(|| missing("no leaf node port"))?;
    Ok(format!("127.0.0.1:{port}"))
}

/// The route (cluster) address a node reports in its ports file, as `host:port`.
fn route_address(node: &NatsServer) -> Result<String> {
    let missing = |what: &str| Error::Ports(format!("{what} for the node at {}", node.url()));
    let text = fs::read_dir(node.dir().join("ports"))
        .ok()
        .and_then(|mut entries| entries.next())
        .and_then(std::result::Result::ok)
        .and_then(|entry| fs::read_to_string(entry.path()).ok())
        .ok_or_else(|| missing("no ports file"))?;
    let ports: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| missing(&format!("unreadable ports file ({e})")))?;
    let url = ports["cluster"][0]
        .as_str()
        .ok_or_else(|| missing("no cluster port"))?;
    Ok(url
        .rsplit("://")
        .next()
        .unwrap_or(url)
        .replace("0.0.0.0", "127.0.0.1"))
}

/// Nodes clustered on loopback. Each is killed, and the whole directory removed, on drop.
#[derive(Debug)]
pub struct Cluster {
    /// The nodes, in order; node `i` is named `n<i>`.
    pub nodes: Vec<NatsServer>,
    routes: Vec<String>,
    leafs: Vec<Option<String>>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts three nodes ([`ClusterBuilder`] for other shapes).
    ///
    /// # Errors
    /// Those of [`ClusterBuilder::start`]: a directory or config that cannot be written, a node
    /// that does not start, or one that does not report its ports.
    pub fn start() -> Result<Cluster> {
        ClusterBuilder::default().start()
    }

    /// A builder for another shape.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// Every node's client URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url().to_owned()).collect()
    }

    /// Node `i`'s route listener, `host:port`.
    pub fn route_address(&self, i: usize) -> Option<&str> {
        self.routes.get(i).map(String::as_str)
    }

    /// Node `i`'s leaf node listener, `host:port`, when the cluster takes leaf nodes
    /// ([`ClusterBuilder::leafnodes`]).
    pub fn leafnode_address(&self, i: usize) -> Option<&str> {
        self.leafs.get(i).and_then(|l| l.as_deref())
    }

    /// The index of the node with server name `name` (`n<i>`).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix('n')
            .and_then(|i| i.parse().ok())
            .filter(|i| *i < self.nodes.len())
    }
}
