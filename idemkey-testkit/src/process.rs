//! A server process under a watchdog, free ports and directories: what the throwaway NATS and
//! MariaDB servers share.
//!
//! Each server runs under a small `sh` watchdog whose standard input is a pipe held by the
//! test process: if the test process dies in any way, the pipe closes and the watchdog stops
//! the server.

use std::ffi::OsString;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// How many times a first start is retried when its port was taken in the meantime.
pub(crate) const PORT_ATTEMPTS: usize = 5;

/// The server's output, in its directory.
pub(crate) const LOG: &str = "server.log";
/// Written by the watchdog when the server exits, in its directory.
const EXITED: &str = "server.exited";

/// How many lines of a server's log a failure shows (the whole log stays in its file).
const LOG_TAIL_LINES: usize = 80;

/// How to stop a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `SIGTERM`: the server shuts down in order.
    Graceful,
    /// `SIGKILL`: a crash.
    Kill,
}

/// One server under its watchdog, its log and exit marker in a directory of its own.
#[derive(Debug)]
pub(crate) struct Process {
    watchdog: Child,
    lifeline: ChildStdin,
    label: String,
    binary: PathBuf,
    dir: PathBuf,
    args: Vec<OsString>,
}

impl Process {
    /// Runs `binary args` in `dir` under the watchdog (which stops it when this process is
    /// gone), its output in `dir/server.log`. `label` names it in messages ("NATS server").
    pub(crate) fn spawn(
        label: &str,
        binary: &Path,
        dir: &Path,
        args: &[OsString],
    ) -> Result<Self, String> {
        let _ = std::fs::remove_file(dir.join(EXITED));
        let mut watchdog = Command::new("/bin/sh");
        watchdog
            .args(["-c", WATCHDOG_SCRIPT, "idemkey-watchdog"])
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
            .map_err(|e| format!("cannot start the {label}'s watchdog /bin/sh: {e}"))?;
        let lifeline = child.stdin.take().expect("stdin is piped");
        Ok(Self {
            watchdog: child,
            lifeline,
            label: label.to_owned(),
            binary: binary.to_owned(),
            dir: dir.to_owned(),
            args: args.to_vec(),
        })
    }

    /// Whether the server has exited (the watchdog wrote its marker).
    pub(crate) fn exited(&self) -> bool {
        self.dir.join(EXITED).exists()
    }

    /// Waits until `ready()` (polled every 20 ms, for at most `timeout`); when the server
    /// exits or the time is up, kills it and answers why, with its log.
    pub(crate) fn wait_until(
        &mut self,
        mut ready: impl FnMut() -> bool,
        what: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        let mut failure = None;
        let done = poll(timeout, || {
            if self.exited() {
                failure = Some("exited during startup".to_owned());
                return Some(());
            }
            ready().then_some(())
        });
        if done.is_some() && failure.is_none() {
            return Ok(());
        }
        let failure = failure.unwrap_or_else(|| format!("did not {what} within {timeout:?}"));
        let _ = self.lifeline.write_all(b"kill\n");
        let _ = self.lifeline.flush();
        let _ = self.watchdog.wait();
        Err(self.failure(&failure))
    }

    /// `the throwaway <label> (<command>) <failure>`, the log's path and its last lines.
    pub(crate) fn failure(&self, failure: &str) -> String {
        let command: Vec<_> = self.args.iter().map(|a| a.to_string_lossy()).collect();
        format!(
            "the throwaway {} ({} {}) {failure}.\n{}",
            self.label,
            self.binary.display(),
            command.join(" "),
            log_tail(&self.dir.join(LOG)),
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

/// Deletes a directory of servers once the test process is gone, however it ends: a handle
/// kept in a `static` is never dropped, and a killed process runs nothing. A `sh` whose
/// standard input is a pipe held by the test process waits for end-of-file, then for every
/// server below the directory to have exited (their watchdogs saw the same end-of-file; at
/// most 15 s), then removes the directory.
#[derive(Debug)]
pub(crate) struct Janitor {
    _sh: Child,
    _lifeline: ChildStdin,
}

impl Janitor {
    pub(crate) fn watch(dir: &Path) -> Result<Self, String> {
        let mut sh = Command::new("/bin/sh");
        sh.args(["-c", JANITOR_SCRIPT, "idemkey-janitor"])
            .arg(dir)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut sh, 0);
        let mut child = sh
            .spawn()
            .map_err(|e| format!("cannot start the janitor of {}: {e}", dir.display()))?;
        let lifeline = child.stdin.take().expect("stdin is piped");
        Ok(Self {
            _sh: child,
            _lifeline: lifeline,
        })
    }
}

/// `$1`: the directory, whose subdirectories each hold a server's `server.log` and, once it
/// has exited, `server.exited`.
const JANITOR_SCRIPT: &str = r#"
trap '' HUP INT
dir=$1
while read -r _; do :; done
n=0
while [ "$n" -lt 150 ]; do
    running=0
    for log in "$dir"/*/server.log; do
        [ -e "$log" ] || continue
        [ -e "${log%/server.log}/server.exited" ] || running=1
    done
    [ "$running" = 0 ] && break
    sleep 0.1
    n=$((n + 1))
done
rm -rf "$dir"
"#;

/// `--- log <path> (last lines) ---`, the last lines of the log, and its end.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log)
        .unwrap_or_else(|e| format!("<cannot read {}: {e}>", log.display()));
    let lines: Vec<&str> = text.trim_end().lines().collect();
    let shown = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    let heading = if shown.len() < lines.len() {
        format!("last {} lines", shown.len())
    } else {
        "all of it".to_owned()
    };
    format!(
        "--- server log {} ({heading}) ---\n{}\n--- end of server log ---",
        log.display(),
        shown.join("\n")
    )
}

/// Calls `check` every 20 ms until it answers something, for at most `timeout`: a bounded
/// poll of another process, which tells no one when it is ready.
pub(crate) fn poll<T>(timeout: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(answer) = check() {
            return Some(answer);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
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

/// A fresh temporary directory named `prefix…`, in `parent` (the temporary directory when
/// `None`).
#[track_caller]
pub(crate) fn temporary_dir(prefix: &str, parent: Option<&Path>) -> tempfile::TempDir {
    let mut builder = tempfile::Builder::new();
    builder.prefix(prefix);
    match parent {
        Some(parent) => builder.tempdir_in(parent),
        None => builder.tempdir(),
    }
    .unwrap_or_else(|e| panic!("cannot create a directory {prefix}… for a throwaway server: {e}"))
}

/// A port of 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The installed binary `name`: on `PATH`, else in `/usr/sbin`, `/usr/bin` or
/// `/usr/local/bin` (Debian installs servers in `/usr/sbin`, which a user's `PATH` may lack).
pub(crate) fn installed_binary(name: &str) -> Option<PathBuf> {
    let from_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    from_path
        .into_iter()
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

/// Runs a server and stops it when stdin says `kill` (`SIGKILL`) or reaches end-of-file
/// (`SIGTERM`, escalated to `SIGKILL` after 10 s): the test process stops it, or is gone.
///
/// Arguments: `$1` the binary, `$2` a file written when the server exits, `$3` its log,
/// then the server's own arguments.
const WATCHDOG_SCRIPT: &str = r#"
trap '' HUP INT
exec 3<&0
server=$1 exited=$2 log=$3
shift 3
"$server" "$@" </dev/null >>"$log" 2>&1 3<&- &
pid=$!
{
    signal=TERM
    while read -r line <&3; do
        if [ "$line" = kill ]; then signal=KILL; break; fi
    done
    kill -"$signal" "$pid" 2>/dev/null
    n=0
    while kill -0 "$pid" 2>/dev/null && [ "$n" -lt 100 ]; do
        sleep 0.1
        n=$((n + 1))
    done
    kill -KILL "$pid" 2>/dev/null
} &
reader=$!
exec 3<&- 0</dev/null
wait "$pid"
echo "$?" >"$exited"
wait "$reader"
"#;
