//! A PostgreSQL server of one test's own, which the test may stop, start and restart
//! (`pg_ctl … -m fast|immediate`) while `idemkey serve` runs on it. The test kit's shared
//! server cannot be restarted: every other test of the process uses it.
//!
//! The data directory lives under `/tmp`; when the tests run as root, every PostgreSQL
//! command runs as the `postgres` user (through `runuser`), as in the test kit. A small `sh`
//! watchdog, whose standard input is a pipe held by the test process, stops the server
//! (`-m immediate`) and deletes the directory once the [`PgCluster`] is dropped or the test
//! process is gone, however it ended.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The user PostgreSQL runs as when the tests run as root.
const ROOT_FALLBACK_USER: &str = "postgres";

/// Stops the server and deletes `$1` when standard input ends. `$2` is `pg_ctl`.
const WATCHDOG: &str = r#"
trap '' HUP INT
while read -r _; do :; done
"$2" -D "$1/data" -m immediate -w -t 20 stop >/dev/null 2>&1
rm -rf "$1"
"#;

/// A PostgreSQL server, initialised and stopped until [`start`](Self::start).
#[derive(Debug)]
pub(crate) struct PgCluster {
    base: PathBuf,
    port: u16,
    bindir: PathBuf,
    run_as: bool,
    _watchdog: Child,
    lifeline: Option<ChildStdin>,
}

impl PgCluster {
    /// Runs `initdb` in a new directory and picks a free port; the server is not started.
    /// (Blocking: call it from `spawn_blocking` in async tests.)
    pub(crate) fn init() -> Self {
        let bindir = idemkey_testkit::postgres_binary("pg_ctl")
            .parent()
            .expect("pg_ctl's directory")
            .to_owned();
        let run_as = current_uid() == 0;
        let base = tempfile::Builder::new()
            .prefix("idemkey-chaos-pg-")
            .tempdir_in("/tmp")
            .expect("a directory in /tmp")
            .keep();
        if run_as {
            let status = Command::new("chown")
                .arg(format!("{ROOT_FALLBACK_USER}:"))
                .arg(&base)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown {}", base.display());
        }
        let mut watchdog = command(Path::new("/bin/sh"), run_as, &base);
        watchdog
            .args(["-c", WATCHDOG, "idemkey-chaos-pg-watchdog"])
            .arg(&base)
            .arg(bindir.join("pg_ctl"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
        let mut watchdog = watchdog.spawn().expect("start the watchdog");
        let lifeline = watchdog.stdin.take();
        let cluster = Self {
            port: free_port(),
            base,
            bindir,
            run_as,
            _watchdog: watchdog,
            lifeline,
        };
        let output = cluster
            .command("initdb")
            .arg("-D")
            .arg(cluster.data())
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .arg("--no-locale")
            .output()
            .expect("run initdb");
        assert!(output.status.success(), "initdb: {}", describe(&output));
        // fsync off: the machine does not crash in these tests, only PostgreSQL does, and
        // what a COMMIT wrote to the kernel survives that. synchronous_commit stays on: a
        // commit is acknowledged only once its WAL is written, so `-m immediate` loses
        // nothing that was acknowledged.
        let conf = format!(
            "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\nfull_page_writes = off\nmax_connections = 200\n\
             shared_buffers = 32MB\n",
            cluster.port,
            cluster.base.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(cluster.data().join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .expect("write postgresql.conf");
        cluster
    }

    fn data(&self) -> PathBuf {
        self.base.join("data")
    }

    fn log(&self) -> PathBuf {
        self.base.join("postgres.log")
    }

    fn command(&self, program: &str) -> Command {
        let mut c = command(&self.bindir.join(program), self.run_as, &self.base);
        c.stdin(Stdio::null());
        c
    }

    /// The port it listens on (when running).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/DATABASE?sslmode=disable`.
    pub(crate) fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable",
            self.port
        )
    }

    fn pg_ctl(&self, args: &[&str]) {
        let output = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(["-w", "-t", "60"])
            .args(args)
            .output()
            .expect("run pg_ctl");
        assert!(
            output.status.success(),
            "pg_ctl {args:?}: {}\n--- server log ---\n{}",
            describe(&output),
            self.log_tail()
        );
    }

    /// Starts the server and waits until it accepts connections.
    pub(crate) fn start(&self) {
        self.pg_ctl(&["start"]);
    }

    /// Stops the server: `mode` is `smart`, `fast` or `immediate`.
    pub(crate) fn stop(&self, mode: &str) {
        self.pg_ctl(&["-m", mode, "stop"]);
    }

    /// `pg_ctl restart -m MODE`: stops (`fast`: active transactions are rolled back;
    /// `immediate`: the server is killed and recovers from its WAL at start) and starts
    /// again; returns once it accepts connections, and how long that took.
    pub(crate) fn restart(&self, mode: &str) -> Duration {
        let started = Instant::now();
        self.pg_ctl(&["-m", mode, "restart"]);
        started.elapsed()
    }

    /// Creates a database (the server must run).
    pub(crate) fn create_database(&self, name: &str) {
        let output = self
            .command("psql")
            .args([
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &self.url("postgres"),
            ])
            .arg("-c")
            .arg(format!("CREATE DATABASE \"{name}\""))
            .output()
            .expect("run psql");
        assert!(
            output.status.success(),
            "CREATE DATABASE: {}",
            describe(&output)
        );
    }

    /// The last lines of the server's log.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        // The watchdog stops the server and deletes the directory.
        self.lifeline.take();
    }
}

fn current_uid() -> u32 {
    let output = Command::new("id").arg("-u").output().expect("run id -u");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("a uid")
}

fn command(program: &Path, run_as: bool, dir: &Path) -> Command {
    let mut c = if run_as {
        let runuser = ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .unwrap_or("runuser");
        let mut c = Command::new(runuser);
        c.args(["-u", ROOT_FALLBACK_USER, "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    c.current_dir(dir);
    c
}

/// A port outside the kernel's ephemeral range (clients' source ports come from there, and
/// could take it while the server is down), free right now.
fn free_port() -> u16 {
    for _ in 0..200 {
        let port = 20_000 + (rand::random::<u16>() % 12_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 20000 and 32000");
}

fn describe(output: &Output) -> String {
    format!(
        "{}: {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout).trim(),
        String::from_utf8_lossy(&output.stderr).trim()
    )
}

impl super::Backend {
    /// A backend on an existing PostgreSQL database at `url` (a [`PgCluster`]'s): the
    /// servers it starts get that URL, running or not.
    pub(crate) fn postgres_at(url: String) -> Self {
        Self {
            kind: super::Kind::Postgres,
            direct: url.clone(),
            url,
            dir: tempfile::tempdir().expect("temporary directory"),
            started: std::sync::atomic::AtomicUsize::new(0),
            nodes: Vec::new(),
        }
    }

    /// The directory of the SQLite file and the servers' logs.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }
}
