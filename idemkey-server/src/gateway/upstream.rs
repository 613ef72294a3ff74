//! Connections to the upstream for keyed requests, kept open between requests (HTTP/1.1
//! keep-alive) so that a request does not pay a TCP connect and the upstream an accept.
//!
//! The hazard of a kept connection is the upstream closing it while it sits idle: a request
//! written just then may or may not have been read, and past the point of no return that
//! makes a sure non-event an unknown outcome. So a kept connection
//! - is reused only within `--upstream-idle-timeout` of its last answer, which must stay
//!   below the upstream's own keep-alive time-out (`0s` turns reuse off);
//! - is checked open and ready before the point of no return, and a closed one is dropped;
//! - is sent on with hyper's `try_send_request`, which hands a request back unwritten when
//!   the connection turned out closed after all: the caller then knows nothing was sent.
//!
//! A connection goes back to the pool only after a complete answer, read whole.

use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// At most this many idle connections are kept; more are closed.
const MAX_IDLE: usize = 256;

/// A connection to the upstream, ready for one request.
pub(super) struct Connection {
    pub(super) sender: SendRequest<Body>,
    /// Kept from an earlier request (else opened for this one).
    pub(super) reused: bool,
}

/// The kept connections, the most recently used last.
#[derive(Debug)]
pub(super) struct Connections {
    authority: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    sender: SendRequest<Body>,
    since: Instant,
}

impl Connections {
    pub(super) fn new(
        authority: String,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            authority,
            connect_timeout,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A connection ready for a request: with `reuse`, the most recently used kept one that
    /// is still fresh and open, if any; else a new one. An error means nothing was sent.
    pub(super) async fn get(&self, reuse: bool) -> io::Result<Connection> {
        while let Some(mut sender) = reuse.then(|| self.take_fresh()).flatten() {
            // Ready means the connection has finished its last exchange and still reads;
            // one the upstream closed answers an error, or stays unready past the bound.
            match tokio::time::timeout(self.connect_timeout, sender.ready()).await {
                Ok(Ok(())) if !sender.is_closed() => {
                    return Ok(Connection {
                        sender,
                        reused: true,
                    });
                }
                _ => continue,
            }
        }
        Ok(Connection {
            sender: self.open().await?,
            reused: false,
        })
    }

    /// A new connection, within the connect time-out. An error means nothing was sent.
    pub(super) async fn open(&self) -> io::Result<SendRequest<Body>> {
        let connecting = TcpStream::connect(self.authority.as_str());
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(stream) => stream?,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
        };
        let (sender, connection) = http1::handshake::<_, Body>(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }

    /// Keeps `sender`, whose last answer was read whole, for a later request.
    pub(super) fn put(&self, sender: SendRequest<Body>) {
        if self.idle_timeout.is_zero() || sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    /// The most recently kept connection, if it has not sat idle too long. The others were
    /// kept before it: when it is too old, so are they, and all are closed.
    fn take_fresh(&self) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let last = idle.pop()?;
        if last.since.elapsed() < self.idle_timeout {
            Some(last.sender)
        } else {
            idle.clear();
            None
        }
    }
}
