//! Tests of the throwaway MariaDB Galera cluster: three nodes on loopback replicate a write,
//! certification refuses the second of two commits of the same key at `COMMIT`, and a node
//! killed with `SIGKILL` rejoins and catches up.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use idemkey_testkit::GaleraCluster;

/// Starts a three-node cluster, printing how long it took.
fn start() -> GaleraCluster {
    let started = Instant::now();
    let cluster = GaleraCluster::start(3);
    println!("Galera cluster of 3 started in {:?}", started.elapsed());
    cluster
}

/// The cluster the tests that kill no node share, each with tables of its own: one start
/// fewer on a CI machine's two cores. It stops, and its directory goes, when the process ends.
fn shared() -> &'static GaleraCluster {
    static CLUSTER: OnceLock<GaleraCluster> = OnceLock::new();
    CLUSTER.get_or_init(start)
}

/// `sql` on node `i` after the node has applied every write the cluster ordered before it
/// (`wsrep_sync_wait = 1`: reads wait for the node to catch up).
fn read_synced(cluster: &GaleraCluster, i: usize, sql: &str) -> String {
    cluster
        .query(i, &format!("SET SESSION wsrep_sync_wait = 1; {sql}"))
        .unwrap_or_else(|e| panic!("node {i}: {e}"))
}

fn cluster_size(cluster: &GaleraCluster, i: usize) -> String {
    cluster
        .query(i, "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'WSREP_CLUSTER_SIZE'")
        .unwrap()
}

#[test]
fn a_row_written_on_node_1_is_read_on_nodes_2_and_3() {
    let cluster = shared();
    assert_eq!(cluster.size(), 3);
    for i in 0..3 {
        assert_eq!(cluster_size(cluster, i), "3", "node {i}");
        assert!(
            cluster
                .node_url(i)
                .ends_with(&format!(":{}/idemkey", cluster.node_port(i))),
            "{}",
            cluster.node_url(i)
        );
    }
    cluster
        .query(
            0,
            "CREATE TABLE replicated (id INT PRIMARY KEY, v VARCHAR(20)); INSERT INTO replicated VALUES (1, 'from n1')",
        )
        .unwrap();
    for i in 1..3 {
        assert_eq!(
            read_synced(cluster, i, "SELECT v FROM replicated WHERE id = 1"),
            "from n1",
            "node {i}"
        );
    }
}

/// A `mariadb` client reading statements from a pipe: a session a test drives a statement
/// at a time.
struct Session {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Session {
    fn open(cluster: &GaleraCluster, i: usize) -> Self {
        let mut child = cluster
            .client(i)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Self {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// Sends `sql` (one statement a line) and waits until the client has run it: it ends with
    /// a `SELECT` of a marker, read back.
    fn run(&mut self, sql: &str, marker: &str) {
        writeln!(self.stdin, "{sql}\nSELECT '{marker}';").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim_end(), marker);
    }
}

#[test]
fn the_same_key_committed_on_two_nodes_at_once_fails_one_commit_with_1213() {
    let cluster = shared();
    cluster
        .query(
            0,
            "CREATE TABLE conflict (id INT PRIMARY KEY, v VARCHAR(20))",
        )
        .unwrap();
    assert_eq!(
        read_synced(cluster, 1, "SELECT COUNT(*) FROM conflict"),
        "0"
    );

    // Both transactions hold their row before either commits: the nodes do not see each
    // other's until the commit replicates it.
    let mut sessions = [Session::open(cluster, 0), Session::open(cluster, 1)];
    for (i, session) in sessions.iter_mut().enumerate() {
        session.run(
            &format!(
                "BEGIN;\nINSERT INTO conflict VALUES (1, 'from n{}');",
                i + 1
            ),
            "inserted",
        );
    }
    // Line 4 of each session: BEGIN, INSERT, the marker, COMMIT.
    for session in &mut sessions {
        writeln!(session.stdin, "COMMIT;\nSELECT 'committed';").unwrap();
    }
    let outcomes: Vec<_> = sessions
        .into_iter()
        .map(|session| {
            drop(session.stdin);
            let Session {
                child, mut stdout, ..
            } = session;
            let mut rest = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
            let output = child.wait_with_output().unwrap();
            (
                output.status.success(),
                rest,
                String::from_utf8_lossy(&output.stderr).into_owned(),
            )
        })
        .collect();
    let committed: Vec<usize> = (0..2).filter(|&i| outcomes[i].0).collect();
    assert_eq!(
        committed.len(),
        1,
        "exactly one commit succeeds: {outcomes:?}"
    );
    let (winner, loser) = (committed[0], 1 - committed[0]);
    assert_eq!(outcomes[winner].1.trim_end(), "committed");
    // The client echoes the failed statement above its error.
    let error = &outcomes[loser].2;
    assert!(
        error.contains("\nCOMMIT\n")
            && error.contains("ERROR 1213 (40001) at line 4: Deadlock found"),
        "the other fails at COMMIT with a deadlock (certification): {outcomes:?}"
    );
    assert_eq!(outcomes[loser].1, "", "nothing after the failed COMMIT ran");
    for i in 0..3 {
        assert_eq!(
            read_synced(cluster, i, "SELECT v FROM conflict"),
            format!("from n{}", winner + 1),
            "node {i} holds the winner's row only"
        );
    }
}

#[test]
fn a_node_killed_with_sigkill_rejoins_and_sees_what_was_written_while_it_was_down() {
    let mut cluster = start();
    cluster
        .query(0, "CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(20))")
        .unwrap();
    assert_eq!(read_synced(&cluster, 2, "SELECT COUNT(*) FROM t"), "0");

    let killed = Instant::now();
    cluster.kill9(2);
    println!("node 3 killed and left out in {:?}", killed.elapsed());
    assert!(!cluster.is_running(2));
    assert!(cluster.query(2, "SELECT 1").is_err());
    for i in 0..2 {
        assert_eq!(cluster_size(&cluster, i), "2", "node {i}");
    }
    cluster
        .query(0, "INSERT INTO t VALUES (1, 'while down')")
        .unwrap();
    cluster
        .query(1, "INSERT INTO t VALUES (2, 'also')")
        .unwrap();

    let restarted = Instant::now();
    cluster.restart(2);
    println!("node 3 rejoined in {:?}", restarted.elapsed());
    for i in 0..3 {
        assert_eq!(cluster_size(&cluster, i), "3", "node {i}");
    }
    assert_eq!(
        read_synced(&cluster, 2, "SELECT id, v FROM t ORDER BY id"),
        "1\twhile down\n2\talso"
    );
    // And it takes writes again, which the others see.
    cluster
        .query(2, "INSERT INTO t VALUES (3, 'back')")
        .unwrap();
    assert_eq!(
        read_synced(&cluster, 0, "SELECT v FROM t WHERE id = 3"),
        "back"
    );

    // The node that bootstrapped the cluster, stopped in order and started again, joins it
    // like any other.
    let restarted = Instant::now();
    cluster.restart(0);
    println!("node 1 restarted in {:?}", restarted.elapsed());
    assert_eq!(cluster_size(&cluster, 0), "3");
    assert_eq!(read_synced(&cluster, 0, "SELECT COUNT(*) FROM t"), "3");
}

#[test]
#[should_panic(expected = "a Galera cluster needs at least one node")]
fn a_cluster_of_no_nodes_is_refused() {
    GaleraCluster::start(0);
}
