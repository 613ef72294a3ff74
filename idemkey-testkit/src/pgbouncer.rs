//! A PgBouncer in transaction pooling mode for tests, in front of a PostgreSQL server.
//!
//! [`pgbouncer_url`] returns a database URL through one PgBouncer per test process, started
//! lazily in front of the server of [`postgres_url`](crate::postgres_url);
//! [`PgBouncer::start`] starts one of a test's own, which the test can kill (`SIGKILL`) and
//! start again on the same port.
//!
//! The pooler is set up as production runs it: `pool_mode = transaction`, and
//! `ignore_startup_parameters = extra_float_digits` (sqlx sends that one, PgBouncer refuses
//! any parameter it does not know), nothing else ignored. Like the PostgreSQL helper, it
//! runs under a small `sh` watchdog whose standard input is a pipe held by the test
//! process, so it stops when the test process exits in any way; PgBouncer refuses to run as
//! root, so under root it runs as the `postgres` user.
//!
//! A missing `pgbouncer` binary is a failure (a panic naming [`PGBOUNCER_ENV`]), never a
//! skipped test.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::postgres::{RunAs, command, root_fallback};

/// Environment variable naming the `pgbouncer` binary. Overrides discovery
/// (`/usr/sbin/pgbouncer`, else `PATH`).
pub const PGBOUNCER_ENV: &str = "IDEMKEY_PGBOUNCER";

/// How long PgBouncer may take to accept connections.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The `pgbouncer` binary: `$IDEMKEY_PGBOUNCER`, else `/usr/sbin/pgbouncer`, else the
/// first `pgbouncer` on `PATH`.
///
/// # Panics
///
/// Panics if there is none.
#[track_caller]
pub fn pgbouncer_binary() -> PathBuf {
    if let Some(path) = std::env::var_os(PGBOUNCER_ENV) {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("pgbouncer"));
    std::iter::once(PathBuf::from("/usr/sbin/pgbouncer"))
        .chain(on_path)
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no `pgbouncer` binary: install PgBouncer (`apt-get install pgbouncer`) or set \
                 {PGBOUNCER_ENV} to its path"
            )
        })
}

/// `database_url` (a database on the server of [`postgres_url`](crate::postgres_url), for
/// example one of [`fresh_database_url`](crate::fresh_database_url)) through this process's
/// PgBouncer in transaction mode: the same user, password and database, PgBouncer's port.
///
/// # Panics
///
/// Panics if PgBouncer cannot be started.
#[track_caller]
pub fn pgbouncer_url(database_url: &str) -> String {
    static SHARED: OnceLock<Result<PgBouncer, String>> = OnceLock::new();
    let shared = SHARED.get_or_init(|| PgBouncer::try_start(&crate::postgres_url(), 100));
    match shared {
        Ok(pgbouncer) => pgbouncer.url_for(database_url),
        Err(message) => panic!("{message}"),
    }
}

/// A running PgBouncer of a test's own, in transaction mode. Dropped, it is killed.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    base: PathBuf,
    run_as: Option<RunAs>,
    /// One per start: each watchdog removes the directory once its lifeline is closed.
    running: Vec<Running>,
}

#[derive(Debug)]
struct Running {
    /// Waited for when the helper is dropped.
    watchdog: Child,
    /// Closing it (dropping, or the test process exiting) stops PgBouncer.
    lifeline: ChildStdin,
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server `server_url` names (its host, port, user and
    /// password), with `pool_size` server connections per database and user.
    ///
    /// # Panics
    ///
    /// Panics if it cannot be started.
    #[track_caller]
    pub fn start(server_url: &str, pool_size: u32) -> Self {
        Self::try_start(server_url, pool_size).unwrap_or_else(|message| panic!("{message}"))
    }

    fn try_start(server_url: &str, pool_size: u32) -> Result<Self, String> {
        let binary = pgbouncer_binary();
        let run_as = root_fallback()?;
        let base = tempfile::Builder::new()
            .prefix("idemkey-pgbouncer-")
            .tempdir_in("/tmp")
            .map_err(|e| format!("cannot create a directory in /tmp: {e}"))?
            .keep();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("cannot pick a free port on 127.0.0.1: {e}"))?
            .port();
        let server = Address::parse(server_url);
        let quote = |s: &str| s.replace('"', "\"\"");
        std::fs::write(
            base.join("userlist.txt"),
            format!(
                "\"{}\" \"{}\"\n",
                quote(&server.user),
                quote(server.password.as_deref().unwrap_or(""))
            ),
        )
        .map_err(|e| format!("cannot write PgBouncer's auth file: {e}"))?;
        let password = server
            .password
            .as_deref()
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let config = format!(
            "[databases]\n\
             * = host={host} port={server_port} user={user}{password}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {base}/userlist.txt\n\
             pool_mode = transaction\n\
             ignore_startup_parameters = extra_float_digits\n\
             max_client_conn = 2000\n\
             default_pool_size = {pool_size}\n\
             logfile = {base}/pgbouncer.log\n",
            host = server.host,
            server_port = server.port,
            user = server.user,
            base = base.display(),
        );
        std::fs::write(base.join("pgbouncer.ini"), config)
            .map_err(|e| format!("cannot write PgBouncer's configuration: {e}"))?;
        if let Some(run_as) = &run_as {
            for path in [
                base.clone(),
                base.join("userlist.txt"),
                base.join("pgbouncer.ini"),
            ] {
                std::os::unix::fs::chown(&path, Some(run_as.uid), Some(run_as.gid)).map_err(
                    |e| format!("cannot hand {} to {}: {e}", path.display(), run_as.user),
                )?;
            }
        }
        let mut pgbouncer = Self {
            port,
            base,
            run_as,
            running: Vec::new(),
        };
        pgbouncer.try_restart(&binary)?;
        Ok(pgbouncer)
    }

    /// The URL of `database_url`'s database through this PgBouncer.
    pub fn url_for(&self, database_url: &str) -> String {
        let address = Address::parse(database_url);
        let password = address
            .password
            .map(|p| format!(":{p}"))
            .unwrap_or_default();
        format!(
            "postgres://{}{password}@127.0.0.1:{}/{}",
            address.user, self.port, address.database
        )
    }

    /// Kills PgBouncer with `SIGKILL`, as a crash would: its clients' connections break,
    /// the server connections it held close (their transactions roll back).
    pub fn kill(&mut self) {
        let pid = std::fs::read_to_string(self.base.join("pgbouncer.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            // Bounded poll of another process: its watchdog saw it exit.
            let deadline = Instant::now() + STARTUP_TIMEOUT;
            while !self.base.join("pgbouncer.exited").exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = std::fs::remove_file(self.base.join("pgbouncer.pid"));
        }
    }

    /// Starts PgBouncer again on the same port (after [`kill`](Self::kill)).
    ///
    /// # Panics
    ///
    /// Panics if it cannot be started.
    #[track_caller]
    pub fn restart(&mut self) {
        self.kill();
        if let Err(message) = self.try_restart(&pgbouncer_binary()) {
            panic!("{message}");
        }
    }

    fn try_restart(&mut self, binary: &Path) -> Result<(), String> {
        let _ = std::fs::remove_file(self.base.join("pgbouncer.pid"));
        let _ = std::fs::remove_file(self.base.join("pgbouncer.exited"));
        let mut watchdog = command(Path::new("/bin/sh"), self.run_as.as_ref(), &self.base);
        watchdog
            .args(["-c", WATCHDOG_SCRIPT, "idemkey-pgbouncer-watchdog"])
            .arg(binary)
            .arg(&self.base)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
        let mut child = watchdog
            .spawn()
            .map_err(|e| format!("cannot start PgBouncer's watchdog: {e}"))?;
        let lifeline = child.stdin.take().expect("stdin is piped");
        self.running.push(Running {
            watchdog: child,
            lifeline,
        });
        // Bounded poll of another process: PgBouncer accepting connections.
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.base.join("pgbouncer.exited").exists() {
                break;
            }
            if self.base.join("pgbouncer.pid").exists()
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = std::fs::read_to_string(self.base.join("pgbouncer.log")).unwrap_or_default();
        self.kill();
        if let Some(running) = self.running.pop() {
            drop(running.lifeline);
        }
        Err(format!(
            "PgBouncer ({}, {}/pgbouncer.ini, port {}) did not start.\n--- log ---\n{}\n--- end of log ---",
            binary.display(),
            self.base.display(),
            self.port,
            log.trim_end()
        ))
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.kill();
        for running in self.running.drain(..) {
            drop(running.lifeline);
            let mut watchdog = running.watchdog;
            let _ = watchdog.wait();
        }
    }
}

/// Runs PgBouncer (`$1`, with `$2/pgbouncer.ini`) and kills it when stdin reaches
/// end-of-file. Writes its process id to `$2/pgbouncer.pid` and `$2/pgbouncer.exited`
/// when it exits; once both happened (PgBouncer gone, the lifeline closed), deletes `$2`.
const WATCHDOG_SCRIPT: &str = r#"
trap '' HUP INT
exec 3<&0
pgbouncer=$1 base=$2
"$pgbouncer" "$base/pgbouncer.ini" </dev/null >>"$base/pgbouncer.log" 2>&1 3<&- &
pgb=$!
echo "$pgb" >"$base/pgbouncer.pid"
{
    while read -r _ <&3; do :; done
    kill -KILL "$pgb" 2>/dev/null
} &
reader=$!
exec 3<&- 0</dev/null
wait "$pgb"
echo "$?" >"$base/pgbouncer.exited"
wait "$reader"
rm -rf "$base"
"#;

/// The parts of a `postgres://user:password@host:port/database` URL PgBouncer needs.
struct Address {
    user: String,
    password: Option<String>,
    host: String,
    port: u16,
    database: String,
}

impl Address {
    fn parse(url: &str) -> Self {
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let database = path.split(['?', '#']).next().unwrap_or("").to_owned();
        let (userinfo, hostport) = authority
            .rsplit_once('@')
            .unwrap_or(("postgres", authority));
        let (user, password) = match userinfo.split_once(':') {
            Some((user, password)) => (user.to_owned(), Some(password.to_owned())),
            None => (userinfo.to_owned(), None),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((host, port)) => (host.to_owned(), port.parse().unwrap_or(5432)),
            None => (hostport.to_owned(), 5432),
        };
        Self {
            user,
            password,
            host,
            port,
            database: if database.is_empty() {
                "postgres".to_owned()
            } else {
                database
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_database_url() {
        let a = Address::parse("postgres://app:s3cret@127.0.0.1:5433/orders?sslmode=disable");
        assert_eq!(
            (a.user.as_str(), a.password.as_deref()),
            ("app", Some("s3cret"))
        );
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 5433));
        assert_eq!(a.database, "orders");
        let b = Address::parse("postgres://postgres@127.0.0.1:6000/postgres");
        assert_eq!((b.user.as_str(), b.password), ("postgres", None));
    }
}
