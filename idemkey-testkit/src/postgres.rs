//! A PostgreSQL server for tests.
//!
//! [`postgres_url`] returns `DATABASE_URL` when it names a PostgreSQL server,
//! and otherwise starts one throwaway server per test process from the
//! installed PostgreSQL binaries. [`fresh_database_url`] creates a new, empty
//! database on that server for each caller.
//!
//! The throwaway server runs under a small `sh` watchdog whose standard input
//! is a pipe held open by the test process. When the test process exits — in
//! any way, including `SIGKILL` — the kernel closes the pipe, the watchdog
//! reads end-of-file, shuts PostgreSQL down and deletes the server's
//! directory. Test binaries never run static destructors, so nothing here
//! relies on `Drop`.

use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Environment variable naming a directory that holds the PostgreSQL binaries
/// (`initdb`, `postgres`, `pg_isready`, `psql`). Overrides discovery.
pub const PG_BINDIR_ENV: &str = "IDEMKEY_PG_BINDIR";

/// How long the throwaway server may take to accept connections.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// How many times startup is retried when the chosen port was taken by
/// someone else between picking it and PostgreSQL binding it.
const PORT_ATTEMPTS: usize = 5;

/// The user that runs the throwaway server when the tests run as root.
const ROOT_FALLBACK_USER: &str = "postgres";

/// Returns the URL of a PostgreSQL server for tests.
///
/// If `DATABASE_URL` is set to a `postgres://` or `postgresql://` URL, it is
/// returned unchanged. (Any other `DATABASE_URL`, e.g. a `sqlite:` one, is
/// ignored.) Otherwise one throwaway server is started — lazily, once per
/// test process, shared by all tests — and
/// `postgres://postgres@127.0.0.1:PORT/postgres` is returned.
///
/// # Panics
///
/// Panics with the reason (including the server log, when there is one) if
/// the throwaway server cannot be started. Every later call panics with the
/// same message without trying again.
#[track_caller]
pub fn postgres_url() -> String {
    if let Some(url) = database_url_from_env() {
        return url;
    }
    match throwaway_server() {
        Ok(server) => server.url.clone(),
        Err(message) => panic!("{message}"),
    }
}

/// Creates a fresh, empty database (`CREATE DATABASE idemkey_test_<hex>
/// TEMPLATE template0`) on the server of [`postgres_url`] and returns its URL:
/// the server URL with the database name replaced.
///
/// Safe to call concurrently from many threads and tests. The databases are
/// never dropped; on the throwaway server they vanish with the server.
///
/// # Panics
///
/// Panics if there is no server (see [`postgres_url`]), if `psql` cannot be
/// found, or if `CREATE DATABASE` fails.
#[track_caller]
pub fn fresh_database_url() -> String {
    let server_url = postgres_url();
    let psql = psql_path();
    // 64 random bits: a name collision is astronomically unlikely, and would fail the test
    // like any other refusal (psql tells no SQLSTATE to recognise it by).
    let name = format!("idemkey_test_{:016x}", rand::random::<u64>());
    let output = Command::new(&psql)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &server_url, "-c"])
        .arg(format!("CREATE DATABASE \"{name}\" TEMPLATE template0"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", psql.display()));
    if output.status.success() {
        return with_database(&server_url, &name);
    }
    panic!(
        "cannot create a test database on {}: {}",
        redact(&server_url),
        describe_output(&output)
    );
}

/// `DATABASE_URL`, if it is a PostgreSQL URL.
fn database_url_from_env() -> Option<String> {
    let url = std::env::var("DATABASE_URL").ok()?;
    let url = url.trim();
    (url.starts_with("postgres://") || url.starts_with("postgresql://")).then(|| url.to_owned())
}

/// Replaces the database name (the path) of a `postgres://` URL, keeping the
/// scheme, user info, host, port and query string.
fn with_database(url: &str, database: &str) -> String {
    let authority_start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[authority_start..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let after_authority = &rest[authority_len..];
    let suffix_start = after_authority
        .find(['?', '#'])
        .unwrap_or(after_authority.len());
    format!(
        "{}{}/{}{}",
        &url[..authority_start],
        &rest[..authority_len],
        database,
        &after_authority[suffix_start..]
    )
}

/// The URL with any password removed, for messages.
fn redact(url: &str) -> String {
    let authority_start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[authority_start..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_len];
    match authority.rfind('@') {
        Some(at) => match authority[..at].find(':') {
            Some(colon) => format!(
                "{}{}:***{}",
                &url[..authority_start],
                &authority[..colon],
                &url[authority_start + at..]
            ),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// A running throwaway server. Lives in a static for the whole process.
struct Server {
    url: String,
    /// The watchdog process. Never waited for; kept for completeness.
    _watchdog: Child,
    /// The write end of the watchdog's stdin. Closing it (which happens
    /// when the process exits) stops the server and deletes its directory.
    _lifeline: ChildStdin,
}

fn throwaway_server() -> &'static Result<Server, String> {
    static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
    SERVER.get_or_init(start_server)
}

/// Returns the path of an installed PostgreSQL binary such as `psql`,
/// `pg_dump` or `pg_isready`, found the way the throwaway server finds its
/// binaries: in `$IDEMKEY_PG_BINDIR`, else the newest
/// `/usr/lib/postgresql/*/bin`, else `pg_config --bindir`, else `PATH`.
///
/// # Panics
///
/// Panics if no such binary is found.
#[track_caller]
pub fn postgres_binary(name: &str) -> PathBuf {
    match find_bindir(name) {
        Ok(dir) => dir.join(name),
        Err(message) => panic!("{message}"),
    }
}

fn psql_path() -> PathBuf {
    static PSQL: OnceLock<PathBuf> = OnceLock::new();
    PSQL.get_or_init(|| postgres_binary("psql")).clone()
}

/// Finds a directory holding the PostgreSQL binary `required`: the
/// [`PG_BINDIR_ENV`] override, else the newest `/usr/lib/postgresql/*/bin`,
/// else `pg_config --bindir`, else `PATH`.
fn find_bindir(required: &str) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(PG_BINDIR_ENV) {
        let dir = PathBuf::from(dir);
        return if dir.join(required).is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "{PG_BINDIR_ENV}={} has no `{required}` binary",
                dir.display()
            ))
        };
    }

    let mut versioned: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(|part| part.parse::<u64>().ok())
                .collect::<Option<Vec<_>>>()?;
            let bin = entry.path().join("bin");
            bin.join(required).is_file().then_some((version, bin))
        })
        .collect();
    versioned.sort();
    if let Some((_, dir)) = versioned.pop() {
        return Ok(dir);
    }

    if let Ok(output) = Command::new("pg_config").arg("--bindir").output()
        && output.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if dir.join(required).is_file() {
            return Ok(dir);
        }
    }

    if let Some(path) = std::env::var_os("PATH")
        && let Some(dir) = std::env::split_paths(&path).find(|dir| dir.join(required).is_file())
    {
        return Ok(dir);
    }

    Err(format!(
        "cannot find the PostgreSQL binary `{required}` (looked in {PG_BINDIR_ENV}, \
         /usr/lib/postgresql/*/bin, `pg_config --bindir` and PATH); install PostgreSQL \
         or set DATABASE_URL=postgres://... to use an existing server"
    ))
}

fn start_server() -> Result<Server, String> {
    let bindir = find_bindir("initdb")?;
    for required in ["postgres", "pg_isready"] {
        if !bindir.join(required).is_file() {
            return Err(format!(
                "{} has `initdb` but no `{required}`",
                bindir.display()
            ));
        }
    }
    let run_as = root_fallback()?;

    let mut failures = Vec::new();
    for _ in 0..PORT_ATTEMPTS {
        match start_attempt(&bindir, run_as.as_ref()) {
            Ok(server) => return Ok(server),
            Err(Attempt::PortTaken(message)) => failures.push(message),
            Err(Attempt::Failed(message)) => return Err(message),
        }
    }
    Err(format!(
        "cannot start the throwaway PostgreSQL server: its port was taken {PORT_ATTEMPTS} \
         times in a row:\n{}",
        failures.join("\n")
    ))
}

/// The user to run servers as when the tests run as root (PostgreSQL and PgBouncer refuse
/// to run as root); `None` otherwise.
pub(crate) fn root_fallback() -> Result<Option<RunAs>, String> {
    run_as_when_root(
        ROOT_FALLBACK_USER,
        "PostgreSQL",
        ", or set DATABASE_URL=postgres://...",
    )
}

/// `user` (its ids), to run `server` as when the tests run as root; `None` otherwise. A
/// missing user is an error that names it, ending with `hint`.
pub(crate) fn run_as_when_root(
    user: &'static str,
    server: &str,
    hint: &str,
) -> Result<Option<RunAs>, String> {
    Ok(if current_uid()? == 0 {
        let ids = |flag: &str| {
            let output = Command::new("id")
                .args([flag, user])
                .output()
                .map_err(|e| format!("cannot run `id`: {e}"))?;
            if !output.status.success() {
                return Err(format!(
                    "the tests run as root, and {server} runs as `{user}` then; but there is \
                     no `{user}` user ({}). Create that user, run the tests as another \
                     user{hint}",
                    describe_output(&output)
                ));
            }
            String::from_utf8_lossy(&output.stdout)
                .trim()
                .parse::<u32>()
                .map_err(|e| format!("unexpected `id {flag} {user}` output: {e}"))
        };
        Some(RunAs {
            user,
            uid: ids("-u")?,
            gid: ids("-g")?,
        })
    } else {
        None
    })
}

/// A user to run a server as.
#[derive(Debug)]
pub(crate) struct RunAs {
    pub(crate) user: &'static str,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

enum Attempt {
    PortTaken(String),
    Failed(String),
}

fn current_uid() -> Result<u32, String> {
    let output = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| format!("cannot run `id -u`: {e}"))?;
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .map_err(|e| {
            format!(
                "unexpected `id -u` output ({e}): {}",
                describe_output(&output)
            )
        })
}

/// A command running `program` as `run_as`, with `base` as working
/// directory (the caller's may be unreadable for that user).
pub(crate) fn command(program: &Path, run_as: Option<&RunAs>, base: &Path) -> Command {
    let mut command = match run_as {
        Some(run_as) => {
            let runuser = ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
                .into_iter()
                .find(|path| Path::new(path).is_file())
                .unwrap_or("runuser");
            let mut command = Command::new(runuser);
            command.args(["-u", run_as.user, "--"]).arg(program);
            command
        }
        None => Command::new(program),
    };
    command.current_dir(base);
    command
}

fn start_attempt(bindir: &Path, run_as: Option<&RunAs>) -> Result<Server, Attempt> {
    let failed = Attempt::Failed;

    // The base directory holds the data directory, the Unix socket and the
    // log. /tmp is reachable by every user, unlike a custom TMPDIR.
    let parent = if run_as.is_some() {
        PathBuf::from("/tmp")
    } else {
        std::env::temp_dir()
    };
    let base = tempfile::Builder::new()
        .prefix("idemkey-pg-")
        .tempdir_in(&parent)
        .map_err(|e| {
            failed(format!(
                "cannot create a directory in {}: {e}",
                parent.display()
            ))
        })?
        .keep();
    let data = base.join("data");
    let log = base.join("postgres.log");
    let remove_base = || {
        let _ = std::fs::remove_dir_all(&base);
    };
    if let Some(run_as) = run_as {
        // Only the base itself needs handing over; everything below it is
        // created by the server user. Owning it lets the watchdog delete it
        // from the sticky /tmp.
        if let Err(e) = std::os::unix::fs::chown(&base, Some(run_as.uid), Some(run_as.gid)) {
            remove_base();
            return Err(failed(format!(
                "cannot hand {} to user {}: {e}",
                base.display(),
                run_as.user
            )));
        }
    }

    let mut initdb = command(&bindir.join("initdb"), run_as, &base);
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
        .arg("--no-locale")
        .stdin(Stdio::null());
    match initdb.output() {
        Ok(output) if output.status.success() => {}
        Ok(output) => {
            remove_base();
            return Err(failed(format!(
                "initdb failed for the throwaway PostgreSQL server: {initdb:?}: {}",
                describe_output(&output)
            )));
        }
        Err(e) => {
            remove_base();
            return Err(failed(format!("cannot run {initdb:?}: {e}")));
        }
    }

    let port = match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(address) => address.port(),
        Err(e) => {
            remove_base();
            return Err(failed(format!("cannot pick a free port on 127.0.0.1: {e}")));
        }
    };

    let mut watchdog = command(Path::new("/bin/sh"), run_as, &base);
    watchdog
        .args(["-c", WATCHDOG_SCRIPT, "idemkey-pg-watchdog"])
        .arg(bindir.join("postgres"))
        .arg(&base)
        .arg(port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Keep terminal signals (Ctrl-C) away from the watchdog: it must outlive
    // the test process to clean up after it.
    std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
    let mut child = match watchdog.spawn() {
        Ok(child) => child,
        Err(e) => {
            remove_base();
            return Err(failed(format!(
                "cannot start the PostgreSQL watchdog {:?}: {e}",
                watchdog.get_program()
            )));
        }
    };
    let lifeline = child.stdin.take().expect("stdin is piped");

    let exited = base.join("postgres.exited");
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let pg_isready = bindir.join("pg_isready");
    let port_arg = port.to_string();
    let failure = loop {
        if exited.exists() {
            break "exited during startup";
        }
        let ready = Command::new(&pg_isready)
            .args(["-q", "-h", "127.0.0.1", "-p", &port_arg, "-U", "postgres"])
            .args(["-d", "postgres", "-t", "2"])
            .stdin(Stdio::null())
            .status();
        match ready {
            Ok(status) if status.success() => {
                return Ok(Server {
                    url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
                    _watchdog: child,
                    _lifeline: lifeline,
                });
            }
            Ok(_) => {}
            Err(e) => {
                break if e.kind() == ErrorKind::NotFound {
                    "could not be probed (pg_isready missing)"
                } else {
                    "could not be probed (pg_isready failed to run)"
                };
            }
        }
        if Instant::now() >= deadline {
            break "did not accept connections within 30 s";
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    // Failure: grab the log, then let the watchdog stop the server (if it
    // is still running) and delete the directory.
    let log_text = std::fs::read_to_string(&log)
        .unwrap_or_else(|e| format!("<cannot read {}: {e}>", log.display()));
    drop(lifeline);
    // The watchdog deletes the directory once PostgreSQL is gone, which
    // may take a while for a hung server; don't wait for that.
    let give_up = Instant::now() + Duration::from_secs(2);
    while Instant::now() < give_up {
        if !matches!(child.try_wait(), Ok(None)) {
            remove_base();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let message = format!(
        "the throwaway PostgreSQL server ({} -D {} -p {port}) {failure}.\n\
         --- server log ---\n{}\n--- end of server log ---",
        bindir.join("postgres").display(),
        data.display(),
        log_text.trim_end(),
    );
    // Told by the port, not by the log: a server that exited at startup while another
    // process holds its port lost the race for it.
    if exited.exists() && crate::process::port_taken(port) {
        Err(Attempt::PortTaken(message))
    } else {
        Err(Attempt::Failed(message))
    }
}

/// Runs PostgreSQL and stops it when stdin reaches end-of-file, i.e. when
/// the test process (the only holder of the pipe's write end) is gone.
///
/// Arguments: `$1` the `postgres` binary, `$2` the base directory, `$3` the
/// port. Writes `$2/postgres.exited` when PostgreSQL exits, then, once the
/// test process is gone, deletes `$2`. Shutdown is a fast shutdown
/// (`SIGINT`), escalated to an immediate one (`SIGQUIT`) after 10 s and to
/// `SIGKILL` 5 s later.
const WATCHDOG_SCRIPT: &str = r#"
trap '' HUP INT
exec 3<&0
postgres=$1 base=$2 port=$3
"$postgres" -D "$base/data" -p "$port" \
    -c listen_addresses=127.0.0.1 -c unix_socket_directories="$base" \
    -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
    -c max_connections=300 -c shared_buffers=128MB \
    </dev/null >"$base/postgres.log" 2>&1 3<&- &
pg=$!
stop() {
    kill -"$1" "$pg" 2>/dev/null || return 0
    n=0
    while kill -0 "$pg" 2>/dev/null && [ "$n" -lt "$2" ]; do
        sleep 0.1
        n=$((n + 1))
    done
}
{
    while read -r _ <&3; do :; done
    stop INT 100
    stop QUIT 50
    stop KILL 0
} &
reader=$!
exec 3<&- 0</dev/null
wait "$pg"
echo "$?" >"$base/postgres.exited"
wait "$reader"
rm -rf "$base"
"#;

pub(crate) fn describe_output(output: &Output) -> String {
    let mut text = format!("{}", output.status);
    for (name, bytes) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
        let s = String::from_utf8_lossy(bytes);
        let s = s.trim();
        if !s.is_empty() {
            text.push_str(&format!("\n{name}: {s}"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_database_name() {
        let cases = [
            ("postgres://u@h:5432/db", "postgres://u@h:5432/new"),
            ("postgres://u@h:5432/", "postgres://u@h:5432/new"),
            ("postgres://u@h:5432", "postgres://u@h:5432/new"),
            (
                "postgresql://u:p@h/db?sslmode=disable",
                "postgresql://u:p@h/new?sslmode=disable",
            ),
            ("postgres://h?host=/tmp", "postgres://h/new?host=/tmp"),
            ("postgres://u@[::1]:5/a/b#x", "postgres://u@[::1]:5/new#x"),
        ];
        for (url, expected) in cases {
            assert_eq!(with_database(url, "new"), expected, "{url}");
        }
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }
}
