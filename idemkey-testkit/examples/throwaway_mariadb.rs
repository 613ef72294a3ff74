//! A throwaway MariaDB server, or a throwaway MariaDB Galera cluster of N nodes, for a script:
//! the test kit's [`MariaDb`] and [`GaleraCluster`] on loopback, with a database `bench`.
//!
//! Once every server takes connections it prints one line per server (node 0 first) on
//! standard output, `URL PID`: the URL of the `bench` database as the test user, and the
//! `mariadbd` process's id (for `idemkey bench --database-pid`). Then it waits until its
//! standard input is closed or it gets `SIGTERM` or `SIGINT`, and stops the servers and
//! deletes their directory. If it dies another way, the kit's watchdogs do the same.
//! A server that does not start is an error naming its log, and the exit status is not 0.
//!
//! ```text
//! cargo run -q -p idemkey-testkit --example throwaway_mariadb -- [--galera N]
//! ```
//!
//! `scripts/bench_mysql.sh` runs it.

use std::process::ExitCode;

use idemkey_testkit::{GaleraCluster, MariaDb};
use tokio::signal::unix::{SignalKind, signal};

/// The database the printed URLs name.
const DATABASE: &str = "bench";

const USAGE: &str = "usage: throwaway_mariadb [--galera N]\n\
    \n\
    Starts a throwaway MariaDB server (or a Galera cluster of N nodes) on loopback, prints\n\
    `URL PID` for each server, and stops them when standard input closes or on SIGTERM.";

/// The servers, kept until the end: dropping them stops them.
enum Servers {
    One(MariaDb),
    Cluster(GaleraCluster),
}

impl Servers {
    fn start(nodes: Option<usize>) -> Self {
        match nodes {
            None => Self::One(MariaDb::start()),
            Some(size) => Self::Cluster(GaleraCluster::start(size)),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Cluster(cluster) => cluster.size(),
        }
    }

    fn url(&self, i: usize) -> String {
        match self {
            Self::One(server) => server.url(),
            Self::Cluster(cluster) => cluster.node_url(i),
        }
    }

    fn query(&self, i: usize, sql: &str) -> Result<String, String> {
        match self {
            Self::One(server) => server.query(sql),
            Self::Cluster(cluster) => cluster.query(i, sql),
        }
    }

    /// `URL PID` of server `i`, after making sure the `bench` database is there. On a
    /// cluster each node runs the `CREATE DATABASE IF NOT EXISTS` itself: Galera orders the
    /// statements cluster-wide, so when a node's returns, the database is on that node.
    fn line(&self, i: usize) -> Result<String, String> {
        self.query(i, &format!("CREATE DATABASE IF NOT EXISTS {DATABASE}"))?;
        let url = self.url(i);
        let (server, _) = url
            .rsplit_once('/')
            .ok_or_else(|| format!("the kit's URL {url} names no database"))?;
        let pid_file = self.query(i, "SELECT @@pid_file")?;
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(|e| format!("cannot read mariadbd's pid file {pid_file}: {e}"))?;
        let pid: u32 = pid
            .trim()
            .parse()
            .map_err(|_| format!("mariadbd's pid file {pid_file} holds no process id"))?;
        Ok(format!("{server}/{DATABASE} {pid}"))
    }
}

/// `--galera N` → `Some(N)`; nothing → `None` (one server).
fn parse_args(args: &[String]) -> Result<Option<usize>, String> {
    match args {
        [] => Ok(None),
        [flag, n] if flag == "--galera" => match n.parse::<usize>() {
            Ok(0) | Err(_) => Err(format!(
                "--galera takes a number of nodes of at least 1, not {n:?}"
            )),
            Ok(size) => Ok(Some(size)),
        },
        _ => Err(format!("unexpected arguments {args:?}")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let nodes = match parse_args(&args) {
        Ok(nodes) => nodes,
        Err(message) => {
            eprintln!("throwaway_mariadb: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(nodes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("throwaway_mariadb: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(nodes: Option<usize>) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a Tokio runtime: {e}"))?;
    // Registered before the servers start, so a signal during their start is kept and ends
    // the wait at once.
    let (mut term, mut interrupt) = runtime
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })
        .map_err(|e| format!("cannot listen for signals: {e}"))?;
    let servers = Servers::start(nodes);
    for i in 0..servers.len() {
        println!("{}", servers.line(i)?);
    }
    let (closed, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    // A thread of its own: nothing ends a read of standard input but its end, and the
    // process exits without waiting for it.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = closed.send(());
    });
    runtime.block_on(async {
        tokio::select! {
            _ = term.recv() => {}
            _ = interrupt.recv() => {}
            _ = stdin_closed => {}
        }
    });
    drop(servers);
    Ok(())
}
