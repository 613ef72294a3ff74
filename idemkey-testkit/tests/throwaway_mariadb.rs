//! Tests of the throwaway MariaDB server: it starts from the installed packages, answers the
//! test user over TCP, runs as `mysql` under root, survives `SIGKILL` with its committed
//! rows, and leaves nothing behind, even when the test process is killed.
//!
//! One test re-runs this test binary as a child (the ignored `child_helper` test, steered by
//! `IDEMKEY_TESTKIT_MARIADB_CHILD`) to kill a process that holds a server.

const CHILD_ENV: &str = "IDEMKEY_TESTKIT_MARIADB_CHILD";
const CHILD_LINE: &str = "IDEMKEY_TESTKIT_MARIADB_CHILD_REPORT";

use std::io::{BufRead as _, BufReader, Read as _};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemkey_testkit::MariaDb;

fn refuses(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_err()
}

fn uid_of(user: &str) -> u32 {
    let output = Command::new("id").args(["-u", user]).output().unwrap();
    String::from_utf8(output.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The server's directory (the parent of its data directory's parent).
fn server_dir(server: &MariaDb) -> PathBuf {
    let data = PathBuf::from(server.query("SELECT @@datadir").unwrap());
    data.parent().unwrap().parent().unwrap().to_owned()
}

/// The owner of the process whose id is in the server's pid file.
fn server_uid(server: &MariaDb) -> u32 {
    let pid_file = server.query("SELECT @@pid_file").unwrap();
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    std::fs::metadata(format!("/proc/{}", pid.trim()))
        .unwrap()
        .uid()
}

#[test]
fn a_server_starts_answers_select_1_and_is_removed_on_drop() {
    let started = Instant::now();
    let server = MariaDb::start();
    println!("MariaDB started in {:?}", started.elapsed());

    assert_eq!(server.query("SELECT 1").unwrap(), "1");
    let url = server.url();
    let port = server.port();
    assert!(
        url.starts_with("mysql://idemkey:") && url.ends_with(&format!("@127.0.0.1:{port}/idemkey")),
        "{url}"
    );
    assert_eq!(
        server
            .query("SELECT CURRENT_USER(), DATABASE(), @@bind_address, @@character_set_server")
            .unwrap(),
        "idemkey@%\tidemkey\t127.0.0.1\tutf8mb4"
    );
    // The grant tables are on: a wrong password is refused.
    let refused = server
        .client()
        .env("MYSQL_PWD", "not-the-password")
        .args(["--execute", "SELECT 1"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("ERROR 1045 (28000)"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    // Under root, mariadbd runs as `mysql`; else as the tests' user.
    let own_uid = std::fs::metadata("/proc/self").unwrap().uid();
    let expected_uid = if own_uid == 0 {
        uid_of("mysql")
    } else {
        own_uid
    };
    assert_eq!(server_uid(&server), expected_uid, "who runs mariadbd");

    let dir = server_dir(&server);
    assert!(dir.is_dir());
    assert!(server.log_path().starts_with(&dir));
    drop(server);
    assert!(refuses(port), "dropped, yet the port answers");
    assert!(
        !Path::new(&dir).exists(),
        "{} outlived the server",
        dir.display()
    );
}

#[test]
fn a_killed_server_restarts_with_its_committed_rows() {
    let mut server = MariaDb::start();
    let port = server.port();
    server
        .query(
            "CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(20)); INSERT INTO t VALUES (1, 'kept')",
        )
        .unwrap();

    let killed = Instant::now();
    server.kill9();
    assert!(!server.is_running());
    assert!(refuses(port), "killed, yet the port answers");
    assert!(server.query("SELECT 1").is_err());

    server.restart();
    println!("MariaDB killed and restarted in {:?}", killed.elapsed());
    assert_eq!(server.port(), port);
    assert_eq!(
        server.query("SELECT v FROM t WHERE id = 1").unwrap(),
        "kept"
    );

    // A restart of a running server stops it in order first.
    server.restart();
    assert_eq!(server.query("SELECT COUNT(*) FROM t").unwrap(), "1");
}

#[test]
fn a_server_is_stopped_and_removed_when_the_test_process_is_killed() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_helper", "--nocapture"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut report = None;
    let mut line = String::new();
    while stdout.read_line(&mut line).unwrap() > 0 {
        if let Some(rest) = line.trim_end().strip_prefix(CHILD_LINE) {
            report = Some(rest.trim().to_owned());
            break;
        }
        line.clear();
    }
    let Some(report) = report else {
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        panic!("the child reported no server: {stderr}");
    };
    let (port, dir) = report.split_once(' ').unwrap();
    let (port, dir): (u16, PathBuf) = (port.parse().unwrap(), dir.into());
    assert!(dir.is_dir() && !refuses(port), "the child's server runs");

    child.kill().unwrap();
    child.wait().unwrap();

    // Bounded poll of other processes: the server's watchdog stops it (SIGTERM), then the
    // directory is deleted.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !refuses(port) || dir.exists() {
        assert!(
            Instant::now() < deadline,
            "30 s after the test process was killed: port {port} answers: {}, {} exists: {}",
            !refuses(port),
            dir.display(),
            dir.exists()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Run by the test above in a child process: starts a server, reports its port and
/// directory, and holds it until killed.
#[test]
#[ignore = "run as a child process by a_server_is_stopped_and_removed_when_the_test_process_is_killed"]
fn child_helper() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let server = MariaDb::start();
    println!(
        "{CHILD_LINE} {} {}",
        server.port(),
        server_dir(&server).display()
    );
    // Holds the server until the parent kills this process: its stdin never ends before.
    let mut held = String::new();
    let _ = std::io::stdin().read_to_string(&mut held);
}
