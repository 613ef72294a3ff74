//! `idemkey` processes: a running `serve` ([`Server`]), its output, and one-shot CLI runs.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use super::*;

/// A child process, killed (and waited for) when dropped, the test passing or not.
pub(crate) struct Killed(pub(crate) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads a child's `stdout` to its end on a thread of its own (a process that prints again
/// when it stops must not meet a closed pipe), keeping its lines. The channel gets what
/// follows `announce` on the first line that starts with it: the address a server listens on.
pub(crate) fn read_stdout(
    stdout: ChildStdout,
    announce: &'static str,
) -> (mpsc::Receiver<String>, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    let kept = lines.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(base) = line.strip_prefix(announce)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(base.trim().to_owned());
            }
            kept.lock().unwrap().push(line);
        }
    });
    (rx, lines)
}

/// Starts `command` (its `stdout` piped here, its `stdin` closed) and waits at most
/// [`STARTUP_TIMEOUT`] for the line that starts with `announce`: the child, killed when the
/// guard is dropped, and what followed `announce` on that line, or why no such line came.
pub(crate) async fn spawn_announcing(
    mut command: Command,
    announce: &'static str,
) -> (Killed, Result<String, mpsc::RecvTimeoutError>) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the child process");
    let stdout = child.stdout.take().expect("piped stdout");
    let (announced, _) = read_stdout(stdout, announce);
    let said = tokio::task::spawn_blocking(move || announced.recv_timeout(STARTUP_TIMEOUT))
        .await
        .unwrap();
    (Killed(child), said)
}

/// A running `idemkey serve`; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub(crate) struct Server {
    child: Option<Child>,
    pid: u32,
    base: String,
    log: PathBuf,
    stdout: Arc<Mutex<Vec<String>>>,
}

impl Server {
    pub(super) fn spawn(url: &str, extra: &[String], log: PathBuf) -> Self {
        let stderr = std::fs::File::create(&log).expect("server log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url", url])
            .args(["--api-key", "t1=tok1", "--api-key", "t2=tok2"])
            .args(extra)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret([url]))
            .env_remove("IDEMKEY_DATABASE_URL")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start idemkey serve");
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        let (rx, lines) = read_stdout(stdout, "idemkey listening on ");
        let mut server = Self {
            child: Some(child),
            pid,
            base: String::new(),
            log,
            stdout: lines,
        };
        match rx.recv_timeout(STARTUP_TIMEOUT) {
            Ok(base) => {
                assert!(
                    base.starts_with("http://127.0.0.1:"),
                    "unexpected address {base}"
                );
                server.base = base;
                server
            }
            Err(e) => {
                server.kill9();
                panic!(
                    "idemkey serve did not print its address ({e}); log:\n{}",
                    server.log_tail()
                );
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// A client for this server.
    pub(crate) fn api(&self) -> Api {
        Api::new(&self.base)
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM (graceful shutdown), via `kill -TERM <pid>`.
    pub(crate) fn sigterm(&self) {
        assert!(self.child.is_some(), "the server has already exited");
        let status = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {} failed", self.pid);
    }

    /// Waits (bounded) for the process to exit by itself.
    pub(crate) async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self
                .child
                .as_mut()
                .expect("the server has already been reaped");
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            if Instant::now() >= deadline {
                self.kill9();
                panic!(
                    "the server did not exit within {timeout:?}; log:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Everything the server printed on stdout so far.
    pub(crate) fn stdout(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// The server's whole log (stderr) so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The end of the server's log (stderr).
    pub(crate) fn log_tail(&self) -> String {
        tail(&self.log, 40)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs the `idemkey` binary with `args` to completion; returns its stdout (panics on
/// failure).
pub(crate) async fn idemkey_cli(args: Vec<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
            .args(&args)
            .env_remove("IDEMKEY_API_KEYS")
            .env_remove("IDEMKEY_KEY_SECRET")
            .envs(postgres_secret(args.iter().map(String::as_str)))
            .env_remove("IDEMKEY_DATABASE_URL")
            .stdin(Stdio::null())
            .output()
            .expect("run idemkey");
        assert!(
            output.status.success(),
            "idemkey {args:?}: {:?}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).expect("UTF-8 output")
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}
