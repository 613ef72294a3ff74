//! A throwaway three-node NATS cluster with JetStream, for tests: [`NatsCluster`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::nats::{STARTUP_TIMEOUT, nats_server_binary};
use crate::process::{PORT_ATTEMPTS, Process, Stop, free_port, port_taken, temporary_dir};

/// How many servers a [`NatsCluster`] runs: the smallest cluster that keeps a quorum when
/// one of them is down.
pub const CLUSTER_SIZE: usize = 3;

/// The cluster's name, in every node's configuration.
const CLUSTER_NAME: &str = "idemkey-test";

/// A running throwaway three-node JetStream cluster.
///
/// [`NatsCluster::start`] runs three `nats-server`s on 127.0.0.1, each with a client port, a
/// cluster (route) port and a monitoring port of its own, a store directory of its own, a
/// `server_name` (`n1`, `n2`, `n3`), and routes to all three; it returns once every node
/// answers its health check and the cluster has elected its JetStream meta leader. A node
/// can be stopped (gently or with `SIGKILL`) and started again on the same ports and store,
/// so a test can take servers away under running clients. Each node runs under the same
/// watchdog as [`NatsServer`](crate::NatsServer): if the test process dies, the nodes stop.
/// Everything is stopped and the directories deleted when the handle is dropped.
#[derive(Debug)]
pub struct NatsCluster {
    binary: PathBuf,
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
}

#[derive(Debug)]
struct Node {
    name: String,
    port: u16,
    route_port: u16,
    http_port: u16,
    running: Option<Process>,
}

impl NatsCluster {
    /// Starts three nodes on free ports with fresh store directories, and waits until each
    /// is healthy and JetStream has a meta leader.
    ///
    /// # Panics
    ///
    /// When `nats-server` is not installed (a test that needs NATS fails rather than
    /// skips), or the cluster is not ready within 30 s.
    #[track_caller]
    pub fn start() -> Self {
        let binary = nats_server_binary().unwrap_or_else(|message| panic!("{message}"));
        let dir = temporary_dir("idemkey-nats-cluster-", None);
        let mut cluster = Self {
            binary,
            dir,
            nodes: Vec::new(),
        };
        let mut failures = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            cluster.nodes = (1..=CLUSTER_SIZE)
                .map(|n| {
                    let port = || {
                        free_port()
                            .unwrap_or_else(|e| panic!("cannot pick a free port on 127.0.0.1: {e}"))
                    };
                    Node {
                        name: format!("n{n}"),
                        port: port(),
                        route_port: port(),
                        http_port: port(),
                        running: None,
                    }
                })
                .collect();
            match cluster.launch_all() {
                Ok(()) => return cluster,
                Err(message)
                    if cluster.nodes.iter().any(|n| {
                        [n.port, n.route_port, n.http_port]
                            .into_iter()
                            .any(port_taken)
                    }) =>
                {
                    failures.push(message)
                }
                Err(message) => panic!("{message}"),
            }
        }
        panic!(
            "cannot start the throwaway NATS cluster: a port was taken {PORT_ATTEMPTS} times \
             in a row:\n{}",
            failures.join("\n")
        );
    }

    /// The client URLs of all nodes, separated by commas:
    /// `nats://127.0.0.1:P1,nats://127.0.0.1:P2,nats://127.0.0.1:P3`.
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client URL of node `i` (from 0), the same across restarts.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// The `server_name` of node `i`: `n1`, `n2`, `n3`. JetStream names a stream's leader and
    /// replicas by it.
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// The index of the node named `name`, if there is one.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|node| node.name == name)
    }

    /// The JetStream store directory of node `i`, the same across restarts.
    pub fn store_dir(&self, i: usize) -> PathBuf {
        self.node_dir(i).join("jetstream")
    }

    /// Whether node `i` is running.
    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].running.is_some()
    }

    /// The names of the clients connected to node `i` (from its monitor's `/connz`): which
    /// node a client's connection landed on. Empty when the node is down.
    pub fn client_names(&self, i: usize) -> Vec<String> {
        let Some((200, body)) = http_get(self.nodes[i].http_port, "/connz") else {
            return Vec::new();
        };
        let connz: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        connz["connections"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .collect()
    }

    /// Stops node `i` and waits until its process is gone. With [`Stop::Kill`], a `SIGKILL`
    /// of the real `nats-server` process: a crash.
    pub fn stop(&mut self, i: usize, how: Stop) {
        if let Some(process) = self.nodes[i].running.take() {
            process.stop(how);
        }
    }

    /// Starts the stopped node `i` again, on the same ports and store, and waits until it is
    /// healthy (back in the cluster, with JetStream's meta leader known).
    ///
    /// # Panics
    ///
    /// When it is running already, or not healthy within 30 s.
    #[track_caller]
    pub fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].running.is_none(), "node {i} is running");
        let started = self.spawn(i).and_then(|mut process| {
            let (http_port, name) = (self.nodes[i].http_port, self.nodes[i].name.clone());
            process.wait_until(
                || node_ready(http_port),
                &format!("become healthy ({name})"),
                STARTUP_TIMEOUT,
            )?;
            self.nodes[i].running = Some(process);
            Ok(())
        });
        if let Err(message) = started {
            panic!("{message}");
        }
    }

    /// Spawns every node, then waits until all are ready.
    fn launch_all(&mut self) -> Result<(), String> {
        let mut spawned = Vec::new();
        for i in 0..self.nodes.len() {
            spawned.push(self.spawn(i)?);
        }
        let mut failure = None;
        for (i, mut process) in spawned.into_iter().enumerate() {
            if failure.is_some() {
                process.stop(Stop::Kill);
                continue;
            }
            let (http_port, name) = (self.nodes[i].http_port, self.nodes[i].name.clone());
            match process.wait_until(
                || node_ready(http_port),
                &format!("become healthy ({name})"),
                STARTUP_TIMEOUT,
            ) {
                Ok(()) => self.nodes[i].running = Some(process),
                Err(message) => failure = Some(message),
            }
        }
        match failure {
            None => Ok(()),
            Some(message) => {
                for i in 0..self.nodes.len() {
                    self.stop(i, Stop::Kill);
                }
                Err(message)
            }
        }
    }

    /// Writes node `i`'s configuration and runs it under its watchdog.
    fn spawn(&self, i: usize) -> Result<Process, String> {
        let dir = self.node_dir(i);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let config = dir.join("node.conf");
        std::fs::write(&config, self.config(i))
            .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        Process::spawn(
            "NATS server",
            &self.binary,
            &dir,
            &["-c".into(), config.into()],
        )
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[i].name)
    }

    /// Node `i`'s configuration file.
    fn config(&self, i: usize) -> String {
        let node = &self.nodes[i];
        let routes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("nats-route://127.0.0.1:{}", n.route_port))
            .collect();
        format!(
            "server_name: {name}\n\
             listen: 127.0.0.1:{port}\n\
             http: 127.0.0.1:{http}\n\
             jetstream {{ store_dir: {store:?} }}\n\
             cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{route}\n  routes: [{routes}]\n}}\n",
            name = node.name,
            port = node.port,
            http = node.http_port,
            store = path_text(&self.store_dir(i)),
            route = node.route_port,
            routes = routes.join(", "),
        )
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.stop(i, Stop::Kill);
        }
    }
}

fn path_text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Whether the node's monitor answers `/healthz` with 200 and `/jsz` names a meta leader.
fn node_ready(http_port: u16) -> bool {
    let healthy = http_get(http_port, "/healthz").is_some_and(|(status, _)| status == 200);
    healthy
        && http_get(http_port, "/jsz").is_some_and(|(status, body)| {
            status == 200 && meta_leader(&body).is_some_and(|leader| !leader.is_empty())
        })
}

/// `meta_cluster.leader` of a `/jsz` answer.
fn meta_leader(body: &str) -> Option<String> {
    let jsz: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(jsz.get("meta_cluster")?.get("leader")?.as_str()?.to_owned())
}

/// `GET path` from the monitor on `port`: the status and the body.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuses(url: &str) -> bool {
        let address: SocketAddr = url.trim_start_matches("nats://").parse().unwrap();
        TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_err()
    }

    #[test]
    fn starts_three_routed_nodes_and_restarts_a_killed_one() {
        let mut cluster = NatsCluster::start();
        let urls = cluster.urls();
        assert_eq!(urls.split(',').count(), CLUSTER_SIZE);
        for i in 0..CLUSTER_SIZE {
            assert_eq!(cluster.index_of(cluster.name(i)), Some(i));
            assert!(cluster.store_dir(i).is_dir(), "node {i} made its store");
        }
        let routes = http_get(cluster.nodes[0].http_port, "/routez").unwrap().1;
        let routez: serde_json::Value = serde_json::from_str(&routes).unwrap();
        let routed = routez["num_routes"].as_u64().unwrap();
        assert!(routed >= (CLUSTER_SIZE - 1) as u64, "{routes}");

        let url = cluster.url(1);
        cluster.stop(1, Stop::Kill);
        assert!(!cluster.is_running(1));
        assert!(refuses(&url), "killed, yet node 1 answers");
        cluster.restart(1);
        assert!(node_ready(cluster.nodes[1].http_port));
        assert_eq!(cluster.url(1), url);

        let dir = cluster.dir.path().to_owned();
        drop(cluster);
        assert!(refuses(&url), "dropped, yet node 1 answers");
        assert!(!dir.exists(), "the cluster's directory outlived it");
    }
}
