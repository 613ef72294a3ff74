//! A throwaway NATS server with JetStream, for tests.
//!
//! [`NatsServer::start`] runs the installed `nats-server` (Debian's `nats-server` package)
//! with `-js` on a free port of 127.0.0.1 and a store directory of its own, and returns once
//! it accepts connections with JetStream on. The server can be stopped (gently or with
//! `SIGKILL`) and started again on the same port and store directory, so a test can restart
//! NATS under a running client. It is stopped and its directory deleted when the handle is
//! dropped.
//!
//! Like the throwaway PostgreSQL, the server runs under a small `sh` watchdog whose standard
//! input is a pipe held by the test process: if the test process dies in any way, the pipe
//! closes and the watchdog stops the server. (The store directory is then left in the
//! temporary directory.)

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the `nats-server` binary to run. Overrides discovery.
pub const NATS_SERVER_ENV: &str = "IDEMKEY_NATS_SERVER";

/// How long the server may take to accept connections.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// How many times a first start is retried when its port was taken in the meantime.
pub(crate) const PORT_ATTEMPTS: usize = 5;

/// The server's log, in its directory.
const LOG: &str = "nats.log";
/// Written by the watchdog when the server exits, in its directory.
const EXITED: &str = "nats.exited";

/// A running (or stopped) throwaway `nats-server -js`.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    dir: tempfile::TempDir,
    running: Option<Process>,
}

/// How to stop the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `SIGTERM`: NATS shuts down in order.
    Graceful,
    /// `SIGKILL`: a crash.
    Kill,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh store directory.
    ///
    /// # Panics
    ///
    /// When `nats-server` is not installed (a test that needs NATS fails rather than
    /// skips), or the server does not accept connections within 30 s.
    #[track_caller]
    pub fn start() -> Self {
        let binary = nats_server_binary().unwrap_or_else(|message| panic!("{message}"));
        let dir = temporary_dir("idemkey-nats-");
        let mut server = Self {
            binary,
            port: 0,
            dir,
            running: None,
        };
        let mut failures = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            server.port = match free_port() {
                Ok(port) => port,
                Err(e) => panic!("cannot pick a free port on 127.0.0.1: {e}"),
            };
            match server.launch() {
                Ok(()) => return server,
                Err(message) if port_taken(server.port) => failures.push(message),
                Err(message) => panic!("{message}"),
            }
        }
        panic!(
            "cannot start the throwaway NATS server: its port was taken {PORT_ATTEMPTS} times \
             in a row:\n{}",
            failures.join("\n")
        );
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The port, the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory, the same across restarts.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("jetstream")
    }

    /// Whether the server is running (it was started and not stopped).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops the server and waits until it is gone (its port free).
    pub fn stop(&mut self, how: Stop) {
        if let Some(process) = self.running.take() {
            process.stop(how);
        }
    }

    /// Starts the stopped server again, on the same port and store directory: JetStream
    /// recovers its streams from the store.
    ///
    /// # Panics
    ///
    /// When it is running already, or does not accept connections within 30 s.
    #[track_caller]
    pub fn restart(&mut self) {
        assert!(self.running.is_none(), "the NATS server is running");
        if let Err(message) = self.launch() {
            panic!("{message}");
        }
    }

    /// Runs the server under its watchdog and waits until it accepts connections.
    fn launch(&mut self) -> Result<(), String> {
        let args: Vec<OsString> = vec![
            "-js".into(),
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            self.port.to_string().into(),
            "-sd".into(),
            self.store_dir().into(),
            "-n".into(),
            "idemkey-test-nats".into(),
        ];
        let address = SocketAddr::from(([127, 0, 0, 1], self.port));
        let mut process = Process::spawn(&self.binary, self.dir.path(), &args)?;
        process.wait_until(
            || jetstream_ready(address),
            "accept connections with JetStream",
        )?;
        self.running = Some(process);
        Ok(())
    }
}

/// One `nats-server` under its watchdog, its log and exit marker in a directory of its own.
#[derive(Debug)]
pub(crate) struct Process {
    watchdog: Child,
    lifeline: ChildStdin,
    binary: PathBuf,
    dir: PathBuf,
    args: Vec<OsString>,
}

impl Process {
    /// Runs `binary args` in `dir` under the watchdog (which stops it when this process is
    /// gone), its output in `dir/nats.log`.
    pub(crate) fn spawn(binary: &Path, dir: &Path, args: &[OsString]) -> Result<Self, String> {
        let _ = std::fs::remove_file(dir.join(EXITED));
        let mut watchdog = Command::new("/bin/sh");
        watchdog
            .args(["-c", WATCHDOG_SCRIPT, "idemkey-nats-watchdog"])
            .arg(binary)
            .arg(dir.join(EXITED))
            .arg(dir.join(LOG))
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Keep terminal signals away from the watchdog: it must outlive the test process.
        std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
        let mut child = watchdog
            .spawn()
            .map_err(|e| format!("cannot start the NATS watchdog /bin/sh: {e}"))?;
        let lifeline = child.stdin.take().expect("stdin is piped");
        Ok(Self {
            watchdog: child,
            lifeline,
            binary: binary.to_owned(),
            dir: dir.to_owned(),
            args: args.to_vec(),
        })
    }

    /// Waits until `ready()` (polled every 20 ms, for at most 30 s); when the server exits
    /// or the time is up, kills it and answers why, with its log.
    pub(crate) fn wait_until(
        &mut self,
        mut ready: impl FnMut() -> bool,
        what: &str,
    ) -> Result<(), String> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let failure = loop {
            if self.dir.join(EXITED).exists() {
                break "exited during startup".to_owned();
            }
            if ready() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                break format!("did not {what} within {STARTUP_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = self.lifeline.write_all(b"kill\n");
        let _ = self.lifeline.flush();
        let _ = self.watchdog.wait();
        Err(self.failure(&failure))
    }

    /// `the throwaway NATS server (…) <failure>`, and its log.
    fn failure(&self, failure: &str) -> String {
        let log = self.dir.join(LOG);
        let log_text = std::fs::read_to_string(&log)
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", log.display()));
        let command: Vec<_> = self.args.iter().map(|a| a.to_string_lossy()).collect();
        format!(
            "the throwaway NATS server ({} {}) {failure}.\n\
             --- server log ---\n{}\n--- end of server log ---",
            self.binary.display(),
            command.join(" "),
            log_text.trim_end()
        )
    }

    /// Stops the server and waits until it is gone.
    pub(crate) fn stop(mut self, how: Stop) {
        if how == Stop::Kill {
            let _ = self.lifeline.write_all(b"kill\n");
            let _ = self.lifeline.flush();
        }
        drop(self.lifeline);
        let _ = self.watchdog.wait();
    }
}

/// Whether another process holds `port` on 127.0.0.1 (a listener cannot bind it), asked once
/// a start failed and its server is stopped: whether the port was taken in the meantime.
/// Told by the bind's error kind, not by the server's log.
pub(crate) fn port_taken(port: u16) -> bool {
    matches!(
        TcpListener::bind(("127.0.0.1", port)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse
    )
}

/// A fresh temporary directory named `prefix…`.
#[track_caller]
pub(crate) fn temporary_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot create a directory for a throwaway NATS server: {e}"))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop(Stop::Kill);
    }
}

/// Whether a server at `address` greets with an `INFO` that has JetStream on.
fn jetstream_ready(address: SocketAddr) -> bool {
    let Ok(stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).is_ok()
        && line.starts_with("INFO ")
        && line.contains("\"jetstream\":true")
}

pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The `nats-server` binary: [`NATS_SERVER_ENV`], else `PATH`, else `/usr/sbin` and
/// `/usr/bin` (Debian installs it in `/usr/sbin`, which a user's `PATH` may lack).
pub fn nats_server_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "{NATS_SERVER_ENV}={} is not a file",
                path.display()
            ))
        };
    }
    let from_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    from_path
        .into_iter()
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join("nats-server"))
        .find(|path| Path::new(path).is_file())
        .ok_or_else(|| {
            format!(
                "cannot find the `nats-server` binary (looked in {NATS_SERVER_ENV}, PATH, \
                 /usr/sbin, /usr/bin and /usr/local/bin): the NATS tests need it; install it \
                 with `apt-get install nats-server` (Debian's package) or set \
                 {NATS_SERVER_ENV}=/path/to/nats-server"
            )
        })
}

/// Runs `nats-server` and stops it when stdin says `kill` (`SIGKILL`) or reaches
/// end-of-file (`SIGTERM`, escalated to `SIGKILL` after 10 s): the test process stops it, or
/// is gone.
///
/// Arguments: `$1` the binary, `$2` a file written when the server exits, `$3` its log,
/// then the server's own arguments.
const WATCHDOG_SCRIPT: &str = r#"
trap '' HUP INT
exec 3<&0
nats=$1 exited=$2 log=$3
shift 3
"$nats" "$@" </dev/null >"$log" 2>&1 3<&- &
server=$!
{
    signal=TERM
    while read -r line <&3; do
        if [ "$line" = kill ]; then signal=KILL; break; fi
    done
    kill -"$signal" "$server" 2>/dev/null
    n=0
    while kill -0 "$server" 2>/dev/null && [ "$n" -lt 100 ]; do
        sleep 0.1
        n=$((n + 1))
    done
    kill -KILL "$server" 2>/dev/null
} &
reader=$!
exec 3<&- 0</dev/null
wait "$server"
echo "$?" >"$exited"
wait "$reader"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn refuses(port: u16) -> bool {
        TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(1),
        )
        .is_err()
    }

    #[test]
    fn starts_stops_and_restarts_on_the_same_port_and_store() {
        let mut server = NatsServer::start();
        let port = server.port();
        assert!(server.url().ends_with(&format!(":{port}")));
        assert!(jetstream_ready(SocketAddr::from(([127, 0, 0, 1], port))));
        assert!(server.store_dir().is_dir(), "JetStream made its store");
        for how in [Stop::Kill, Stop::Graceful] {
            server.stop(how);
            assert!(!server.is_running());
            assert!(refuses(port), "stopped ({how:?}), yet the port answers");
            server.restart();
            assert_eq!(server.port(), port);
            assert!(jetstream_ready(SocketAddr::from(([127, 0, 0, 1], port))));
        }
        let dir = server.store_dir();
        drop(server);
        assert!(refuses(port), "dropped, yet the port answers");
        assert!(!dir.exists(), "the store directory outlived the server");
    }
}
