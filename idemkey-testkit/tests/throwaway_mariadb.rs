//! Tests of the throwaway MariaDB server: it starts from the installed packages, answers the
//! test user over TCP, runs as `mysql` under root, survives `SIGKILL` with its committed
//! rows, and leaves nothing behind.

use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
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

    let data = PathBuf::from(server.query("SELECT @@datadir").unwrap());
    let dir = data.parent().unwrap().parent().unwrap().to_owned();
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
