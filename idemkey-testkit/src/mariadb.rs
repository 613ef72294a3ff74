//! A throwaway MariaDB server ([`MariaDb`]) and a throwaway MariaDB Galera cluster
//! ([`GaleraCluster`]), for tests, run from the installed Debian packages (`mariadb-server`,
//! `galera-4`, `rsync`).
//!
//! Each server gets a directory of its own (data, socket, pid file, option file, log) and
//! free ports of 127.0.0.1, and listens on 127.0.0.1 only; nothing of the packaged service
//! (`/etc/mysql`, port 3306, `/run/mysqld`) is read or used. `mariadb-install-db` creates
//! the data directory with a user `idemkey`, a random password and a database `idemkey`, so
//! a test connects as an application does, with a password over TCP (the grant tables are
//! on). When the tests run as root, the servers run as the `mysql` user (`--user=mysql`,
//! their directories handed to it).
//!
//! The kit talks SQL to the servers through the `mariadb` command-line client, installed
//! with the server ([`MariaDb::client`], [`MariaDb::query`]). Every wait is bounded and a
//! server that does not come up is a failure naming its log, never a skipped test. Each
//! server runs under the same watchdog as the NATS servers: if the test process ends without
//! dropping the handle (it is killed, or keeps the handle in a `static`), the servers stop and
//! their directory is deleted; dropping the handle kills them and deletes it at once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::postgres::{RunAs, describe_output, run_as_when_root};
use crate::process::{
    Janitor, LOG, PORT_ATTEMPTS, Process, Stop, free_port, installed_binary, poll, port_taken,
    temporary_dir,
};

/// The user a test connects as (it holds every privilege, so a test can create databases).
const USER: &str = "idemkey";
/// The database a URL names.
const DATABASE: &str = "idemkey";
/// The user the servers run as when the tests run as root (mariadbd refuses root).
const SERVICE_USER: &str = "mysql";
/// The Galera cluster's name (`wsrep_cluster_name`).
const CLUSTER_NAME: &str = "idemkey-test";

/// How long a server may take to accept connections, or a cluster's first node to
/// bootstrap it.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a Galera node may take to join (a state transfer included), and the cluster to
/// notice a node gone.
const JOIN_TIMEOUT: Duration = Duration::from_secs(180);

/// Where the Galera 4 provider is installed: Debian's `galera-4` first.
const GALERA_PROVIDERS: &[&str] = &[
    "/usr/lib/galera/libgalera_smm.so",
    "/usr/lib/galera-4/libgalera_smm.so",
    "/usr/lib64/galera-4/libgalera_smm.so",
    "/usr/lib64/galera/libgalera_smm.so",
];

/// The settings every server gets, install included: small InnoDB files (the suite starts
/// many servers), `utf8mb4` (Debian's packaged default; the server's own is `latin1`),
/// commits written to the OS at once but not synced (a killed server keeps them, a crashed
/// machine may not).
const SETTINGS: &[&str] = &[
    "skip-name-resolve",
    "character-set-server=utf8mb4",
    "collation-server=utf8mb4_general_ci",
    "max-connections=300",
    "innodb-buffer-pool-size=64M",
    "innodb-log-file-size=16M",
    "innodb-flush-log-at-trx-commit=2",
];

/// The settings every Galera node gets beside its addresses.
const GALERA_SETTINGS: &[&str] = &[
    "wsrep-on=ON",
    "wsrep-sst-method=rsync",
    "binlog-format=ROW",
    "innodb-autoinc-lock-mode=2",
    "default-storage-engine=InnoDB",
];

/// A running throwaway MariaDB server.
///
/// [`MariaDb::start`] creates a data directory with `mariadb-install-db` and runs `mariadbd`
/// on a free port of 127.0.0.1, and returns once the test user can connect and run
/// `SELECT 1`. [`MariaDb::kill9`] and [`MariaDb::restart`] crash and start it again on the
/// same port and data. Dropped, it is killed and its directory deleted.
#[derive(Debug)]
pub struct MariaDb {
    kit: Kit,
    node: Node,
}

impl MariaDb {
    /// Starts a server with a fresh data directory on a free port.
    ///
    /// # Panics
    ///
    /// When MariaDB is not installed (a test that needs it fails rather than skips), or the
    /// server does not accept connections within 60 s (the message names its log).
    #[track_caller]
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|message| panic!("{message}"))
    }

    fn try_start() -> Result<Self, String> {
        let kit = Kit::new("idemkey-mariadb-")?;
        let mut server = Self {
            node: Node::new("server"),
            kit,
        };
        server.kit.install(&server.node)?;
        let mut failures = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            server.node.port = pick_port()?;
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(message) if port_taken(server.node.port) => failures.push(message),
                Err(message) => return Err(message),
            }
        }
        Err(format!(
            "cannot start the throwaway MariaDB server: its port was taken {PORT_ATTEMPTS} \
             times in a row:\n{}",
            failures.join("\n")
        ))
    }

    /// `mysql://idemkey:PASSWORD@127.0.0.1:PORT/idemkey`, the same across restarts.
    pub fn url(&self) -> String {
        self.kit.url(self.node.port)
    }

    /// Creates an empty database of its own for a test (the server is shared by a test
    /// binary's tests): its URL.
    ///
    /// # Panics
    ///
    /// When `CREATE DATABASE` fails.
    pub fn fresh_database(&self) -> String {
        let name = self
            .kit
            .create_fresh_database(self.node.port)
            .unwrap_or_else(|e| panic!("cannot create a database: {e}"));
        self.kit.database_url(self.node.port, &name)
    }

    /// The port, the same across restarts.
    pub fn port(&self) -> u16 {
        self.node.port
    }

    /// The `mariadb` client, connected as the test user to the `idemkey` database over TCP,
    /// in batch mode without column names (one row a line, tab-separated), unbuffered; add
    /// `--execute SQL`, or pipe statements to its standard input.
    pub fn client(&self) -> Command {
        self.kit.client(self.node.port)
    }

    /// Runs `sql` (one or more statements) with [`client`](Self::client): its output, or
    /// the client's error (`ERROR 1213 (40001) at line 1: …`).
    pub fn query(&self, sql: &str) -> Result<String, String> {
        self.kit.query(self.node.port, sql)
    }

    /// The server's log (its standard output and error, across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.kit.node_dir(&self.node).join(LOG)
    }

    /// Whether the server is running (started, and not killed since).
    pub fn is_running(&self) -> bool {
        self.node.running.is_some()
    }

    /// Kills the server with `SIGKILL`, as a crash would, and waits until it is gone.
    pub fn kill9(&mut self) {
        if let Some(process) = self.node.running.take() {
            process.stop(Stop::Kill);
        }
    }

    /// Starts the server again on the same port and data (InnoDB recovers what it had
    /// committed), after stopping it (`SIGTERM`) if it runs.
    ///
    /// # Panics
    ///
    /// When it does not accept connections within 60 s.
    #[track_caller]
    pub fn restart(&mut self) {
        if let Some(process) = self.node.running.take() {
            process.stop(Stop::Graceful);
        }
        if let Err(message) = self.launch() {
            panic!("{message}");
        }
    }

    fn launch(&mut self) -> Result<(), String> {
        self.kit.write_config(&self.node, None)?;
        let mut process = self.kit.spawn("MariaDB server", &self.node, &[])?;
        let kit = &self.kit;
        let port = self.node.port;
        process.wait_until(
            || kit.query(port, "SELECT 1").is_ok(),
            "accept connections",
            STARTUP_TIMEOUT,
        )?;
        self.node.running = Some(process);
        Ok(())
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A running throwaway MariaDB Galera cluster on 127.0.0.1.
///
/// [`GaleraCluster::start`] gives each node a MySQL port, a group communication port
/// (`gmcast.listen_addr`), an incremental state transfer port (`ist.recv_addr`) and a state
/// snapshot transfer address (`wsrep_sst_receive_address`) of its own, all on 127.0.0.1, and
/// the same `wsrep_cluster_address` naming every node's group port. Node 0 bootstraps the
/// cluster (`--wsrep-new-cluster`) with a data directory from `mariadb-install-db`; the
/// others start empty and join by a state snapshot transfer (`rsync`). It returns once every
/// node reports `wsrep_ready = ON`, `wsrep_local_state_comment = Synced` and the cluster's
/// full size.
///
/// Nodes are numbered from 0. [`GaleraCluster::kill9`] crashes one and waits until the
/// others have left it out of their view; [`GaleraCluster::restart`] starts it again on the
/// same ports and data, and it rejoins: by an incremental transfer after a `SIGTERM`, by a
/// snapshot after a `SIGKILL`, which leaves its position unknown (`rsync` sends only what
/// differs). Dropped, every node is killed and the directory deleted.
#[derive(Debug)]
pub struct GaleraCluster {
    kit: Kit,
    provider: PathBuf,
    nodes: Vec<Node>,
}

impl GaleraCluster {
    /// Starts a cluster of `size` nodes (3 for one that keeps a quorum with a node down).
    ///
    /// # Panics
    ///
    /// When `size` is 0, when MariaDB, Galera or `rsync` is not installed (a test that needs
    /// them fails rather than skips), or when the cluster is not ready in time (60 s to
    /// bootstrap, 180 s for each join; the message names the node and its log).
    #[track_caller]
    pub fn start(size: usize) -> Self {
        Self::try_start(size).unwrap_or_else(|message| panic!("{message}"))
    }

    fn try_start(size: usize) -> Result<Self, String> {
        if size == 0 {
            return Err("a Galera cluster needs at least one node; 0 were asked for".to_owned());
        }
        let provider = GALERA_PROVIDERS
            .iter()
            .map(PathBuf::from)
            .find(|path| path.is_file())
            .ok_or_else(|| {
                format!(
                    "cannot find the Galera provider (looked for {}): the Galera tests need \
                     it; install it with `apt-get install galera-4` (Debian's package)",
                    GALERA_PROVIDERS.join(", ")
                )
            })?;
        if installed_binary("rsync").is_none() {
            return Err(
                "cannot find `rsync`, which the Galera nodes' state transfers run: \
                        install it with `apt-get install rsync`"
                    .to_owned(),
            );
        }
        let mut cluster = Self {
            kit: Kit::new("idemkey-galera-")?,
            provider,
            nodes: (1..=size).map(|n| Node::new(&format!("n{n}"))).collect(),
        };
        let mut failures = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            for node in &mut cluster.nodes {
                node.port = pick_port()?;
                node.galera = Some(GaleraPorts {
                    group: pick_port()?,
                    ist: pick_port()?,
                    sst: pick_port()?,
                });
            }
            match cluster.launch_all() {
                Ok(()) => return Ok(cluster),
                Err(message) => {
                    cluster.kill_all();
                    let taken = cluster.nodes.iter().any(|node| {
                        let galera = node.galera.as_ref().expect("ports were picked");
                        [node.port, galera.group, galera.ist, galera.sst]
                            .into_iter()
                            .any(port_taken)
                    });
                    if !taken {
                        return Err(message);
                    }
                    failures.push(message);
                }
            }
        }
        Err(format!(
            "cannot start the throwaway Galera cluster: a port was taken {PORT_ATTEMPTS} times \
             in a row:\n{}",
            failures.join("\n")
        ))
    }

    /// The three-node cluster a test binary's tests share, started by the first that asks.
    /// A test that kills or restarts a node takes it with `write()`; the others `read()`.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub async fn shared() -> &'static tokio::sync::RwLock<GaleraCluster> {
        static CLUSTER: std::sync::OnceLock<tokio::sync::RwLock<GaleraCluster>> =
            std::sync::OnceLock::new();
        if let Some(cluster) = CLUSTER.get() {
            return cluster;
        }
        tokio::task::spawn_blocking(|| {
            CLUSTER.get_or_init(|| {
                let started = std::time::Instant::now();
                let cluster = GaleraCluster::start(3);
                println!("Galera cluster of 3 started in {:?}", started.elapsed());
                tokio::sync::RwLock::new(cluster)
            })
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// How many nodes the cluster has, running or not.
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// `mysql://idemkey:PASSWORD@127.0.0.1:PORT/idemkey` for node `i` (from 0), the same
    /// across restarts.
    pub fn node_url(&self, i: usize) -> String {
        self.kit.url(self.nodes[i].port)
    }

    /// Creates an empty database of its own for a test: its URL on each running node, node 0
    /// first.
    ///
    /// Node 0 creates it; Galera orders the statement cluster-wide but another node applies
    /// it in its own time, and a connection naming the database there a moment later could
    /// find none (error 1049). So each other node then runs `CREATE DATABASE IF NOT EXISTS`
    /// itself, which returns once that node has applied everything ordered before it.
    ///
    /// # Panics
    ///
    /// When a `CREATE DATABASE` fails.
    pub fn fresh_database(&self) -> Vec<String> {
        let name = self
            .kit
            .create_fresh_database(self.nodes[0].port)
            .unwrap_or_else(|e| panic!("cannot create a database: {e}"));
        for node in self.nodes.iter().skip(1).filter(|n| n.running.is_some()) {
            self.kit
                .query(node.port, &format!("CREATE DATABASE IF NOT EXISTS {name}"))
                .unwrap_or_else(|e| panic!("cannot see database {name} on {}: {e}", node.name));
        }
        self.nodes
            .iter()
            .map(|node| self.kit.database_url(node.port, &name))
            .collect()
    }

    /// The MySQL port of node `i`.
    pub fn node_port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// The `mariadb` client connected to node `i`, as [`MariaDb::client`].
    pub fn client(&self, i: usize) -> Command {
        self.kit.client(self.nodes[i].port)
    }

    /// Runs `sql` on node `i`, as [`MariaDb::query`].
    pub fn query(&self, i: usize, sql: &str) -> Result<String, String> {
        self.kit.query(self.nodes[i].port, sql)
    }

    /// The log of node `i` (across restarts).
    pub fn log_path(&self, i: usize) -> PathBuf {
        self.kit.node_dir(&self.nodes[i]).join(LOG)
    }

    /// Whether node `i` is running.
    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].running.is_some()
    }

    /// Kills node `i` with `SIGKILL`, as a crash would, and waits until the running nodes
    /// have left it out of their view (each reports a `wsrep_cluster_size` of the nodes
    /// still running). Killing a majority leaves the rest without a quorum (non-Primary),
    /// as it would in production.
    ///
    /// # Panics
    ///
    /// When the running nodes do not agree on their new size within 180 s.
    #[track_caller]
    pub fn kill9(&mut self, i: usize) {
        if let Some(process) = self.nodes[i].running.take() {
            process.stop(Stop::Kill);
        }
        let running = self.running();
        let settled = poll(JOIN_TIMEOUT, || {
            running
                .iter()
                .all(|&j| self.status(j).is_some_and(|s| s.size == running.len()))
                .then_some(())
        });
        if settled.is_none() {
            panic!(
                "{}",
                self.not_ready(&format!(
                    "did not leave out the killed node {} within {JOIN_TIMEOUT:?}",
                    self.nodes[i].name
                ))
            );
        }
    }

    /// Starts node `i` again on the same ports and data, after stopping it (`SIGTERM`) if it
    /// runs, and waits until it has rejoined: every running node `Synced`, ready and
    /// counting it.
    ///
    /// # Panics
    ///
    /// When no other node runs (a whole cluster is not bootstrapped again), or the node has
    /// not rejoined within 180 s.
    #[track_caller]
    pub fn restart(&mut self, i: usize) {
        if let Some(process) = self.nodes[i].running.take() {
            process.stop(Stop::Graceful);
        }
        if self.running().is_empty() {
            panic!(
                "node {} cannot rejoin the Galera cluster: no other node is running",
                self.nodes[i].name
            );
        }
        if let Err(message) = self.join(i, false) {
            panic!("{message}");
        }
    }

    /// Bootstraps the cluster on node 0, then starts the others and waits until all are in.
    fn launch_all(&mut self) -> Result<(), String> {
        for node in &self.nodes {
            let dir = self.kit.node_dir(node);
            if dir.exists() {
                std::fs::remove_dir_all(&dir)
                    .map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
            }
        }
        self.kit.install(&self.nodes[0])?;
        for node in &self.nodes[1..] {
            self.kit.empty_data_dir(node)?;
        }
        self.join(0, true)?;
        let mut joining = Vec::new();
        for i in 1..self.nodes.len() {
            self.kit.write_config(&self.nodes[i], Some(self.wsrep(i)))?;
            let label = format!("Galera node {}", self.nodes[i].name);
            joining.push((i, self.kit.spawn(&label, &self.nodes[i], &[])?));
        }
        // The joiners take their state transfers one after the other (one donor at a time):
        // each wait is a join's.
        let mut failure = None;
        for (i, mut process) in joining {
            if failure.is_some() {
                process.stop(Stop::Kill);
                continue;
            }
            match process.wait_until(
                || self.status(i).is_some_and(|s| s.synced()),
                "join the cluster (state transfer by rsync)",
                JOIN_TIMEOUT,
            ) {
                Ok(()) => self.nodes[i].running = Some(process),
                Err(message) => failure = Some(message),
            }
        }
        match failure {
            Some(message) => Err(message),
            None => self.wait_for_all(self.nodes.len()),
        }
    }

    /// Starts node `i` (bootstrapping a new cluster when `bootstrap`) and waits until every
    /// running node, `i` included, is ready and counts them all.
    fn join(&mut self, i: usize, bootstrap: bool) -> Result<(), String> {
        self.kit.write_config(&self.nodes[i], Some(self.wsrep(i)))?;
        let label = format!("Galera node {}", self.nodes[i].name);
        let extra: &[&str] = if bootstrap {
            &["--wsrep-new-cluster"]
        } else {
            &[]
        };
        let mut process = self.kit.spawn(&label, &self.nodes[i], extra)?;
        let count = self.running().len() + 1;
        let (what, timeout) = if bootstrap {
            ("bootstrap the cluster", STARTUP_TIMEOUT)
        } else {
            ("rejoin the cluster (state transfer)", JOIN_TIMEOUT)
        };
        let ready = process.wait_until(
            || {
                self.status(i)
                    .is_some_and(|s| s.synced() && s.size == count)
            },
            what,
            timeout,
        );
        if ready.is_ok() {
            self.nodes[i].running = Some(process);
        }
        ready?;
        self.wait_for_all(count)
    }

    /// Waits until every running node is ready, `Synced` and counts `count` nodes.
    fn wait_for_all(&self, count: usize) -> Result<(), String> {
        let running = self.running();
        poll(JOIN_TIMEOUT, || {
            running
                .iter()
                .all(|&j| {
                    self.status(j)
                        .is_some_and(|s| s.synced() && s.size == count)
                })
                .then_some(())
        })
        .ok_or_else(|| {
            self.not_ready(&format!(
                "did not all report {count} nodes, ready and synced, within {JOIN_TIMEOUT:?}"
            ))
        })
    }

    /// `the throwaway Galera cluster's nodes <failure>`, each running node's status and the
    /// path of its log.
    fn not_ready(&self, failure: &str) -> String {
        let nodes: Vec<String> = self
            .running()
            .into_iter()
            .map(|j| {
                let status = match self.status(j) {
                    Some(s) => format!(
                        "wsrep_ready={}, wsrep_cluster_size={}, wsrep_local_state_comment={}",
                        if s.ready { "ON" } else { "OFF" },
                        s.size,
                        s.state
                    ),
                    None => "does not answer".to_owned(),
                };
                format!(
                    "  {} (port {}): {status}; log {}",
                    self.nodes[j].name,
                    self.nodes[j].port,
                    self.log_path(j).display()
                )
            })
            .collect();
        format!(
            "the throwaway Galera cluster's running nodes {failure}:\n{}",
            nodes.join("\n")
        )
    }

    /// The indexes of the running nodes.
    fn running(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&j| self.nodes[j].running.is_some())
            .collect()
    }

    /// Node `i`'s Galera status, if it answers.
    fn status(&self, i: usize) -> Option<WsrepStatus> {
        let output = self
            .query(
                i,
                "SHOW GLOBAL STATUS WHERE Variable_name IN \
                 ('wsrep_ready', 'wsrep_cluster_size', 'wsrep_local_state_comment')",
            )
            .ok()?;
        let mut status = WsrepStatus::default();
        for line in output.lines() {
            match line.split_once('\t')? {
                ("wsrep_ready", value) => status.ready = value == "ON",
                ("wsrep_cluster_size", value) => status.size = value.parse().ok()?,
                ("wsrep_local_state_comment", value) => status.state = value.to_owned(),
                _ => {}
            }
        }
        Some(status)
    }

    /// Node `i`'s Galera settings: its addresses and everyone's group ports.
    fn wsrep(&self, i: usize) -> Vec<String> {
        let ports = |node: &Node| node.galera.clone().expect("ports were picked");
        let peers: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", ports(node).group))
            .collect();
        let node = &self.nodes[i];
        let own = ports(node);
        let mut settings: Vec<String> = GALERA_SETTINGS.iter().map(|s| s.to_string()).collect();
        settings.extend([
            format!("wsrep-provider={}", self.provider.display()),
            format!("wsrep-cluster-name={CLUSTER_NAME}"),
            format!("wsrep-cluster-address=gcomm://{}", peers.join(",")),
            format!("wsrep-node-name={}", node.name),
            format!("wsrep-node-address=127.0.0.1:{}", own.group),
            format!("wsrep-node-incoming-address=127.0.0.1:{}", node.port),
            format!(
                "wsrep-provider-options=\"gmcast.listen_addr=tcp://127.0.0.1:{};\
                 ist.recv_addr=127.0.0.1:{};gcache.size=16M\"",
                own.group, own.ist
            ),
            format!("wsrep-sst-receive-address=127.0.0.1:{}", own.sst),
        ]);
        settings
    }

    fn kill_all(&mut self) {
        for node in &mut self.nodes {
            if let Some(process) = node.running.take() {
                process.stop(Stop::Kill);
            }
        }
    }
}

impl Drop for GaleraCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// What a node says of itself and its cluster.
#[derive(Debug, Default)]
struct WsrepStatus {
    ready: bool,
    size: usize,
    state: String,
}

impl WsrepStatus {
    fn synced(&self) -> bool {
        self.ready && self.state == "Synced"
    }
}

/// A Galera node's ports beside its MySQL port.
#[derive(Debug, Clone)]
struct GaleraPorts {
    /// Group communication (`gmcast.listen_addr`, also `wsrep_node_address`).
    group: u16,
    /// Incremental state transfers it receives (`ist.recv_addr`).
    ist: u16,
    /// State snapshot transfers it receives (`wsrep_sst_receive_address`).
    sst: u16,
}

/// One `mariadbd`: its name (its directory's), its port, the process while it runs.
#[derive(Debug)]
struct Node {
    name: String,
    port: u16,
    galera: Option<GaleraPorts>,
    running: Option<Process>,
}

impl Node {
    fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            port: 0,
            galera: None,
            running: None,
        }
    }
}

/// What the servers of one handle share: the programs, the user they run as, the test
/// user's password, and the directory that holds one directory per server.
#[derive(Debug)]
struct Kit {
    server: PathBuf,
    install_db: PathBuf,
    client: PathBuf,
    run_as: Option<RunAs>,
    password: String,
    dir: tempfile::TempDir,
    /// Deletes `dir` when the test process ends without dropping the handle.
    _janitor: Janitor,
}

impl Kit {
    fn new(prefix: &str) -> Result<Self, String> {
        let find = |name: &str| {
            installed_binary(name).ok_or_else(|| {
                format!(
                    "cannot find the MariaDB program `{name}` (looked in PATH, /usr/sbin, \
                     /usr/bin and /usr/local/bin): the MariaDB tests need it; install it with \
                     `apt-get install mariadb-server galera-4 rsync` (Debian's packages)"
                )
            })
        };
        let (server, install_db, client) = (
            find("mariadbd")?,
            find("mariadb-install-db")?,
            find("mariadb")?,
        );
        let run_as = run_as_when_root(SERVICE_USER, "MariaDB", "")?;
        // /tmp is reachable by every user, unlike a custom TMPDIR.
        let dir = temporary_dir(prefix, run_as.as_ref().map(|_| Path::new("/tmp")));
        hand_over(dir.path(), run_as.as_ref())?;
        let janitor = Janitor::watch(dir.path())?;
        Ok(Self {
            server,
            install_db,
            client,
            run_as,
            password: format!("{:016x}", rand::random::<u64>()),
            dir,
            _janitor: janitor,
        })
    }

    fn url(&self, port: u16) -> String {
        self.database_url(port, DATABASE)
    }

    fn database_url(&self, port: u16, database: &str) -> String {
        format!(
            "mysql://{USER}:{}@127.0.0.1:{port}/{database}",
            self.password
        )
    }

    /// Creates a database no other caller in this process got, through the server on
    /// `port`: its name.
    fn create_fresh_database(&self, port: u16) -> Result<String, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!("fresh{}", NEXT.fetch_add(1, Ordering::Relaxed));
        self.query(port, &format!("CREATE DATABASE {name}"))?;
        Ok(name)
    }

    fn node_dir(&self, node: &Node) -> PathBuf {
        self.dir.path().join(&node.name)
    }

    /// Creates `node`'s directory with a data directory from `mariadb-install-db`, which
    /// also creates the test user and database.
    fn install(&self, node: &Node) -> Result<(), String> {
        let dir = self.node_dir(node);
        create_dir(&dir, self.run_as.as_ref())?;
        // Its own directory for temporary tables: installs running at once in the shared
        // /tmp removed each other's, and one failed (`Unknown table 'mysql.tmp_user_sys'`).
        create_dir(&dir.join("tmp"), self.run_as.as_ref())?;
        let setup = dir.join("setup.sql");
        // In bootstrap mode the grant tables are loaded by FLUSH PRIVILEGES.
        std::fs::write(
            &setup,
            format!(
                "FLUSH PRIVILEGES;\n\
                 CREATE USER '{USER}'@'%' IDENTIFIED BY '{}';\n\
                 GRANT ALL PRIVILEGES ON *.* TO '{USER}'@'%';\n\
                 CREATE DATABASE {DATABASE};\n",
                self.password
            ),
        )
        .map_err(|e| format!("cannot write {}: {e}", setup.display()))?;
        let mut install = Command::new(&self.install_db);
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--tmpdir={}", dir.join("tmp").display()))
            .arg("--skip-test-db")
            .arg(format!("--extra-file={}", setup.display()))
            .args(SETTINGS.iter().map(|s| format!("--{s}")))
            .current_dir(&dir)
            .stdin(Stdio::null());
        if let Some(run_as) = &self.run_as {
            install.arg(format!("--user={}", run_as.user));
        }
        match install.output() {
            Ok(output) if output.status.success() => Ok(()),
            Ok(output) => Err(format!(
                "mariadb-install-db failed for a throwaway MariaDB server: {install:?}: {}",
                describe_output(&output)
            )),
            Err(e) => Err(format!("cannot run {install:?}: {e}")),
        }
    }

    /// Creates `node`'s directory with an empty data directory, which a Galera joiner
    /// fills by a state transfer.
    fn empty_data_dir(&self, node: &Node) -> Result<(), String> {
        let dir = self.node_dir(node);
        create_dir(&dir, self.run_as.as_ref())?;
        create_dir(&dir.join("data"), self.run_as.as_ref())
    }

    /// Writes `node`'s option file: its paths and port, the common settings, and `wsrep`
    /// (a Galera node's settings) if any.
    fn write_config(&self, node: &Node, wsrep: Option<Vec<String>>) -> Result<(), String> {
        let dir = self.node_dir(node);
        create_dir(&dir.join("tmp"), self.run_as.as_ref())?;
        let mut lines = vec![
            "[mariadbd]".to_owned(),
            format!("datadir={}", dir.join("data").display()),
            format!("tmpdir={}", dir.join("tmp").display()),
            format!("socket={}", dir.join("mariadb.sock").display()),
            format!("pid-file={}", dir.join("mariadb.pid").display()),
            format!("port={}", node.port),
            "bind-address=127.0.0.1".to_owned(),
        ];
        if let Some(run_as) = &self.run_as {
            lines.push(format!("user={}", run_as.user));
        }
        lines.extend(SETTINGS.iter().map(|s| s.to_string()));
        lines.extend(wsrep.into_iter().flatten());
        let config = dir.join("my.cnf");
        std::fs::write(&config, lines.join("\n") + "\n")
            .map_err(|e| format!("cannot write {}: {e}", config.display()))
    }

    /// Runs `mariadbd` for `node` under its watchdog, with its option file only.
    fn spawn(&self, label: &str, node: &Node, extra: &[&str]) -> Result<Process, String> {
        let dir = self.node_dir(node);
        let mut args: Vec<OsString> = vec![
            // Must come first: no /etc/mysql, nor ~/.my.cnf.
            format!("--defaults-file={}", dir.join("my.cnf").display()).into(),
        ];
        args.extend(extra.iter().map(OsString::from));
        Process::spawn(label, &self.server, &dir, &args)
    }

    fn client(&self, port: u16) -> Command {
        let mut command = Command::new(&self.client);
        command
            // Must come first: no /etc/mysql, nor ~/.my.cnf.
            .arg("--no-defaults")
            .args(["--protocol=TCP", "--host=127.0.0.1"])
            .arg(format!("--port={port}"))
            .arg(format!("--user={USER}"))
            .arg(format!("--database={DATABASE}"))
            .args(["--batch", "--skip-column-names", "--unbuffered"])
            .arg("--connect-timeout=5")
            // Not on the command line, where `ps` would show it.
            .env("MYSQL_PWD", &self.password)
            .stdin(Stdio::null());
        command
    }

    fn query(&self, port: u16, sql: &str) -> Result<String, String> {
        let output = self
            .client(port)
            .arg("--execute")
            .arg(sql)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.client.display()))?;
        if output.status.success() {
            let stdout = String::from_utf8_lossy(&output.stdout);
            Ok(stdout.strip_suffix('\n').unwrap_or(&stdout).to_owned())
        } else {
            Err(format!(
                "`{sql}` on 127.0.0.1:{port}: {}",
                describe_output(&output)
            ))
        }
    }
}

/// A port of 127.0.0.1 that was free a moment ago.
fn pick_port() -> Result<u16, String> {
    free_port().map_err(|e| format!("cannot pick a free port on 127.0.0.1: {e}"))
}

/// Creates `dir`, owned by `run_as` if any.
fn create_dir(dir: &Path, run_as: Option<&RunAs>) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    hand_over(dir, run_as)
}

/// Gives `path` to `run_as`, if any.
fn hand_over(path: &Path, run_as: Option<&RunAs>) -> Result<(), String> {
    match run_as {
        Some(run_as) => {
            std::os::unix::fs::chown(path, Some(run_as.uid), Some(run_as.gid)).map_err(|e| {
                format!(
                    "cannot hand {} to user {}: {e}",
                    path.display(),
                    run_as.user
                )
            })
        }
        None => Ok(()),
    }
}
