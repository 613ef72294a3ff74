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
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use crate::process::{
    PORT_ATTEMPTS, Process, Stop, free_port, installed_binary, port_taken, temporary_dir,
};

/// Environment variable naming the `nats-server` binary to run. Overrides discovery.
pub const NATS_SERVER_ENV: &str = "IDEMKEY_NATS_SERVER";

/// How long the server may take to accept connections.
pub(crate) const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A running (or stopped) throwaway `nats-server -js`.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    dir: tempfile::TempDir,
    running: Option<Process>,
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
        let dir = temporary_dir("idemkey-nats-", None);
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
        let mut process = Process::spawn("NATS server", &self.binary, self.dir.path(), &args)?;
        process.wait_until(
            || jetstream_ready(address),
            "accept connections with JetStream",
            STARTUP_TIMEOUT,
        )?;
        self.running = Some(process);
        Ok(())
    }
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
    installed_binary("nats-server").ok_or_else(|| {
        format!(
            "cannot find the `nats-server` binary (looked in {NATS_SERVER_ENV}, PATH, \
                 /usr/sbin, /usr/bin and /usr/local/bin): the NATS tests need it; install it \
                 with `apt-get install nats-server` (Debian's package) or set \
                 {NATS_SERVER_ENV}=/path/to/nats-server"
        )
    })
}

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
