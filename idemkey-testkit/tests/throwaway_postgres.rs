//! Tests of the throwaway PostgreSQL server and `fresh_database_url`.
//!
//! Some tests re-run this test binary as a child process (the ignored
//! `child_helper` test, steered by `IDEMKEY_TESTKIT_CHILD`) to observe what
//! happens when a test process that started a server exits.

use std::collections::HashSet;
use std::io::{BufRead as _, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemkey_testkit::{fresh_database_url, postgres_binary, postgres_url};

const CHILD_ENV: &str = "IDEMKEY_TESTKIT_CHILD";
const CHILD_LINE: &str = "IDEMKEY_TESTKIT_CHILD_REPORT";

/// Runs `psql -Atc <sql> <url>` and returns its trimmed output.
fn psql(url: &str, sql: &str) -> String {
    let output = Command::new(postgres_binary("psql"))
        .args(["-X", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql, url])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "psql -c {sql:?} {url} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// The database name of a URL (the last path segment, before any query).
fn database_name(url: &str) -> &str {
    let without_query = url.split(['?', '#']).next().unwrap();
    without_query.rsplit('/').next().unwrap()
}

#[test]
fn fresh_databases_are_distinct_and_exist() {
    let server = postgres_url();
    assert!(server.starts_with("postgres"), "{server}");
    assert_eq!(psql(&server, "select 1"), "1");

    let a = fresh_database_url();
    let b = fresh_database_url();
    assert_ne!(a, b);
    for url in [&a, &b] {
        let name = database_name(url);
        assert!(name.starts_with("idemkey_test_"), "{url}");
        assert_eq!(psql(url, "select current_database()"), name);
        // Fresh means empty: no user tables.
        assert_eq!(
            psql(
                url,
                "select count(*) from pg_class c join pg_namespace n on n.oid = c.relnamespace \
                 where n.nspname not in ('pg_catalog', 'information_schema', 'pg_toast')"
            ),
            "0"
        );
    }
    // Databases are independent.
    psql(&a, "create table only_in_a (x int)");
    assert_eq!(
        psql(
            &b,
            "select count(*) from pg_tables where tablename = 'only_in_a'"
        ),
        "0"
    );
}

#[test]
fn fresh_database_url_is_safe_concurrently() {
    let urls: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..24).map(|_| scope.spawn(fresh_database_url)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let distinct: HashSet<&String> = urls.iter().collect();
    assert_eq!(distinct.len(), urls.len());
    for url in &urls {
        assert_eq!(psql(url, "select current_database()"), database_name(url));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usable_from_async_tests() {
    let url = tokio::task::spawn_blocking(fresh_database_url)
        .await
        .unwrap();
    assert!(url.contains("/idemkey_test_"), "{url}");
}

#[test]
fn database_url_is_respected() {
    // Point a child process at this process's server through DATABASE_URL;
    // it must use that server instead of starting its own.
    let server = postgres_url();
    let existing = fresh_database_url();
    let report = run_child("database_url", Some(&existing), false);
    let (child_server, child_fresh) = {
        let mut parts = report.trim().split(' ');
        (
            parts.next().unwrap().to_owned(),
            parts.next().unwrap().to_owned(),
        )
    };
    assert_eq!(child_server, existing);
    assert_ne!(child_fresh, existing);
    assert_eq!(
        child_fresh.replacen(
            &format!("/{}", database_name(&child_fresh)),
            &format!("/{}", database_name(&existing)),
            1
        ),
        existing,
        "same server and parameters, other database"
    );
    // The database the child created exists on this process's server.
    let name = database_name(&child_fresh);
    assert_eq!(
        psql(
            &server,
            &format!("select count(*) from pg_database where datname = '{name}'")
        ),
        "1"
    );
}

#[test]
fn server_stops_when_the_test_process_exits() {
    assert_server_cleaned_up(run_child("exit", None, false));
}

#[test]
fn server_stops_when_the_test_process_is_killed() {
    assert_server_cleaned_up(run_child("hold", None, true));
}

/// Starts a child whose throwaway server reports `port data_directory`,
/// lets it end, then checks that the server and its directory go away.
fn assert_server_cleaned_up(report: String) {
    let mut parts = report.split(' ');
    let port: u16 = parts.next().unwrap().parse().unwrap();
    let data = PathBuf::from(parts.next().unwrap());
    let base = data.parent().unwrap().to_owned();
    assert!(
        base.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("idemkey-pg-"),
        "{}",
        base.display()
    );

    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let listening = TcpStream::connect(("127.0.0.1", port)).is_ok();
        let processes = processes_using(&base);
        let exists = base.exists();
        if !listening && processes.is_empty() && !exists {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "15 s after the test process ended: listening on {port}: {listening}, \
             {} exists: {exists}, processes using it: {processes:?}",
            base.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Processes whose command line mentions `dir` or whose working directory is
/// inside it (PostgreSQL backends run in the data directory).
fn processes_using(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        let in_dir = std::fs::read_link(entry.path().join("cwd"))
            .map(|cwd| cwd.starts_with(dir))
            .unwrap_or(false);
        if in_dir || cmdline.contains(&needle) {
            let short: String = cmdline.trim().chars().take(120).collect();
            found.push(format!("{pid}: {short}"));
        }
    }
    found
}

/// Runs the child helper in `mode` and returns its report line; for
/// `kill`, SIGKILLs the child right after the report instead of letting it
/// exit.
fn run_child(mode: &str, database_url: Option<&str>, kill: bool) -> String {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["child_helper", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_ENV, mode)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match database_url {
        Some(url) => command.env("DATABASE_URL", url),
        None => command.env_remove("DATABASE_URL"),
    };
    let mut child: Child = command.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut report = None;
    for line in stdout.lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix(CHILD_LINE) {
            report = Some(rest.trim().to_owned());
            if kill {
                child.kill().unwrap();
                break;
            }
        }
    }
    let output = child.wait_with_output().unwrap();
    if !kill {
        assert!(
            output.status.success(),
            "child failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    report.unwrap_or_else(|| {
        panic!(
            "child reported nothing: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Not a test by itself: the child process of the tests above.
#[test]
#[ignore = "helper process for other tests; does nothing unless IDEMKEY_TESTKIT_CHILD is set"]
fn child_helper() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    match mode.as_str() {
        "exit" | "hold" => {
            let url = fresh_database_url();
            let port = url.rsplit_once(':').unwrap().1.split('/').next().unwrap();
            let data = psql(&url, "show data_directory");
            println!("{CHILD_LINE} {port} {data}");
            if mode == "hold" {
                std::thread::sleep(Duration::from_secs(120));
                panic!("the parent should have killed this process");
            }
        }
        "database_url" => {
            println!("{CHILD_LINE} {} {}", postgres_url(), fresh_database_url());
        }
        other => panic!("unknown {CHILD_ENV}={other}"),
    }
}
