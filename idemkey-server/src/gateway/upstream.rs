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
//! The other hazard is an upstream that answers once too often (a framework writing a
//! response twice): HTTP/1.1 pairs answers with requests by their order alone, so an extra
//! answer would be taken for the next request's, and stored under its key. So a connection
//! - is kept for the tenant whose request it carried, and reused for that tenant only: an
//!   extra answer never reaches another tenant;
//! - is reused only if nothing arrived on it since its last answer (what its task read, and
//!   what waits unread in the socket, checked together with marking the next request sent);
//! - tells whether an answer's head came before its request was written whole: an answer
//!   to a request the upstream cannot have read is not this request's, and is not stored.
//!
//! A connection goes back to the pool only after a complete answer, read whole; one that is
//! dropped instead is closed at once.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustix::net::RecvFlags;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::task::AbortHandle;

/// At most this many idle connections are kept (all tenants together); the oldest go first.
const MAX_IDLE: usize = 256;

/// A connection to the upstream, ready for one request.
#[derive(Debug)]
pub(super) struct Connection {
    pub(super) sender: SendRequest<Body>,
    wire: Arc<Wire>,
    /// Closes the connection when dropped.
    _task: Task,
    /// Kept from an earlier request (else opened for this one).
    pub(super) reused: bool,
}

impl Connection {
    /// Marks a request about to be written, whose body is `body`, if nothing arrived on the
    /// connection since its last answer and it is still open; answers the body to send,
    /// which tells when it was handed over whole. `None`: the connection must not carry the
    /// request (nothing was sent).
    pub(super) fn begin(&self, body: Body) -> Option<Body> {
        let mut wire = self.wire.lock();
        if !wire.quiet() {
            return None;
        }
        wire.phase = Phase::Writing { body_sent: false };
        Some(Body::new(Outgoing {
            body,
            wire: self.wire.clone(),
        }))
    }

    /// Whether the answer whose head just came arrived before the request was written
    /// whole: then the upstream cannot have read the request, and the answer is not (or not
    /// only) this request's.
    pub(super) fn answered_early(&self) -> bool {
        self.wire.lock().phase != Phase::Written
    }
}

/// The kept connections, per tenant, the most recently kept last.
#[derive(Debug)]
pub(super) struct Connections {
    authority: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    tenant: String,
    connection: Connection,
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

    /// A connection ready for a request of `tenant`: with `reuse`, the most recently kept
    /// one of that tenant that is still fresh and open, with nothing read from it since, if
    /// any; else a new one. An error means nothing was sent.
    pub(super) async fn get(&self, tenant: &str, reuse: bool) -> io::Result<Connection> {
        while let Some(mut connection) = reuse.then(|| self.take_fresh(tenant)).flatten() {
            // Ready means the connection has finished its last exchange and still reads;
            // one the upstream closed answers an error, or stays unready past the bound. One
            // its task read from while idle is spoiled; the socket itself is looked at once,
            // as the request is marked sent ([`Connection::begin`]).
            match tokio::time::timeout(self.connect_timeout, connection.sender.ready()).await {
                Ok(Ok(()))
                    if !connection.sender.is_closed()
                        && connection.wire.lock().phase == Phase::Idle =>
                {
                    return Ok(connection);
                }
                // Dropped: closed.
                _ => continue,
            }
        }
        let (sender, wire, task) = self.connect().await?;
        Ok(Connection {
            sender,
            wire,
            _task: Task(task),
            reused: false,
        })
    }

    /// A new connection of its own for one request, within the connect time-out; it ends
    /// once the request's answer has been read (or dropped). An error means nothing was sent.
    pub(super) async fn open(&self) -> io::Result<SendRequest<Body>> {
        let (sender, wire, _) = self.connect().await?;
        // Its one answer may come at any time.
        wire.lock().phase = Phase::Written;
        Ok(sender)
    }

    /// A new connection: its sender, its wire, and its task, which ends on its own once the
    /// sender is dropped and the last answer read.
    async fn connect(&self) -> io::Result<(SendRequest<Body>, Arc<Wire>, AbortHandle)> {
        let connecting = TcpStream::connect(self.authority.as_str());
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(stream) => stream?,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
        };
        let wire = Arc::new(Wire {
            state: Mutex::new(WireState {
                stream,
                phase: Phase::Idle,
            }),
        });
        let io = TokioIo::new(WireIo(wire.clone()));
        let (sender, connection) = http1::handshake::<_, Body>(io)
            .await
            .map_err(io::Error::other)?;
        let task = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok((sender, wire, task.abort_handle()))
    }

    /// Keeps `connection`, whose last answer was read whole, for a later request of
    /// `tenant`.
    pub(super) fn put(&self, tenant: &str, connection: Connection) {
        connection.wire.lock().phase = Phase::Idle;
        if self.idle_timeout.is_zero() || connection.sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.drop_stale(&mut idle);
        if idle.len() >= MAX_IDLE {
            idle.remove(0);
        }
        idle.push(Idle {
            tenant: tenant.to_owned(),
            connection,
            since: Instant::now(),
        });
    }

    /// The most recently kept connection of `tenant`, if one has not sat idle too long.
    fn take_fresh(&self, tenant: &str) -> Option<Connection> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.drop_stale(&mut idle);
        let i = idle.iter().rposition(|kept| kept.tenant == tenant)?;
        let mut connection = idle.remove(i).connection;
        connection.reused = true;
        Some(connection)
    }

    /// Closes the connections idle too long: the first ones, kept in order.
    fn drop_stale(&self, idle: &mut Vec<Idle>) {
        let stale = idle.partition_point(|kept| kept.since.elapsed() >= self.idle_timeout);
        idle.drain(..stale);
    }
}

/// Ends a connection's task, and so closes its socket, when dropped.
#[derive(Debug)]
struct Task(AbortHandle);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One connection's socket and what it saw, shared by its I/O (which hyper's connection task
/// drives) and the gateway: the lock makes a read and the check of what was read one step.
#[derive(Debug)]
struct Wire {
    state: Mutex<WireState>,
}

impl Wire {
    fn lock(&self) -> MutexGuard<'_, WireState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug)]
struct WireState {
    stream: TcpStream,
    phase: Phase,
}

/// Where a connection is in its exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No request outstanding: nothing may arrive.
    Idle,
    /// A request is being written; `body_sent` once its body was handed over whole.
    Writing { body_sent: bool },
    /// The request was written whole (on a connection of its own for one request: from the
    /// start): its answer may come.
    Written,
    /// Bytes arrived while no request was outstanding: the connection is not used again.
    Spoiled,
}

impl WireState {
    /// Whether nothing arrived since the last answer: none was read while idle, and none
    /// waits unread in the socket (nor did the upstream close it).
    fn quiet(&mut self) -> bool {
        if self.phase != Phase::Idle {
            return false;
        }
        match peek(&self.stream) {
            Err(rustix::io::Errno::WOULDBLOCK) => true,
            // Closed by the upstream, or unusable.
            Ok(0) | Err(_) => false,
            Ok(_) => {
                self.spoil();
                false
            }
        }
    }

    /// Notes that bytes arrived with no request outstanding.
    fn spoil(&mut self) {
        tracing::warn!(
            "the upstream wrote on a kept connection with no request outstanding \
             (an extra answer?); the connection is closed"
        );
        self.phase = Phase::Spoiled;
    }
}

/// Looks at what waits unread in `stream`, without taking it or waiting: `Ok(0)` when the
/// upstream closed it, `Ok(1)` when bytes wait, `WOULDBLOCK` when none do.
fn peek(stream: &TcpStream) -> rustix::io::Result<usize> {
    let mut byte = [0u8; 1];
    rustix::net::recv(stream, &mut byte[..], RecvFlags::PEEK | RecvFlags::DONTWAIT)
        .map(|(read, _)| read)
}

/// The socket as hyper reads and writes it, noting what arrives while no request is
/// outstanding and when a request has been written whole.
struct WireIo(Arc<Wire>);

impl AsyncRead for WireIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut wire = self.0.lock();
        let before = buf.filled().len();
        let read = Pin::new(&mut wire.stream).poll_read(cx, buf);
        if buf.filled().len() > before && wire.phase == Phase::Idle {
            wire.spoil();
        }
        read
    }
}

impl AsyncWrite for WireIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0.lock().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0.lock().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.lock().stream.is_write_vectored()
    }

    /// hyper flushes once all it buffered is written: after the body was handed over whole,
    /// the request has been written.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut wire = self.0.lock();
        let flushed = Pin::new(&mut wire.stream).poll_flush(cx);
        if matches!(flushed, Poll::Ready(Ok(())))
            && wire.phase == (Phase::Writing { body_sent: true })
        {
            wire.phase = Phase::Written;
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0.lock().stream).poll_shutdown(cx)
    }
}

/// A request body that notes on its connection when hyper has taken it whole.
struct Outgoing {
    body: Body,
    wire: Arc<Wire>,
}

impl Outgoing {
    fn sent(&self) {
        let mut wire = self.wire.lock();
        if let Phase::Writing { .. } = wire.phase {
            wire.phase = Phase::Writing { body_sent: true };
        }
    }
}

impl HttpBody for Outgoing {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            self.sent();
        }
        frame
    }

    /// hyper asks after each frame: the end is the body handed over whole.
    fn is_end_stream(&self) -> bool {
        let end = self.body.is_end_stream();
        if end {
            self.sent();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::sync::mpsc;

    use http_body_util::BodyExt;

    use super::*;

    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// An extra answer that arrived while the connection sat idle, before its task could
    /// read it (the runtime's one thread is busy with the test), is seen before a request
    /// goes on the connection.
    #[test]
    fn a_connection_with_an_unread_extra_answer_is_not_reused() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        let (extra, extra_rx) = mpsc::channel::<()>();
        let (written, written_rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            stream.write_all(ANSWER).unwrap();
            extra_rx.recv().unwrap();
            stream.write_all(ANSWER).unwrap();
            written.send(()).unwrap();
            // Open until the other side closes, then the next connection.
            let _ = stream.read(&mut byte);
            let _next = listener.accept();
        });
        runtime.block_on(async {
            let connections =
                Connections::new(authority, Duration::from_secs(5), Duration::from_secs(60));
            let mut connection = connections.get("t", true).await.unwrap();
            assert!(!connection.reused);
            let body = connection.begin(Body::empty()).unwrap();
            let request = http::Request::get("/").body(body).unwrap();
            let response = connection.sender.try_send_request(request).await.unwrap();
            assert!(!connection.answered_early());
            response.into_body().collect().await.unwrap();
            connections.put("t", connection);

            extra.send(()).unwrap();
            written_rx.recv().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while peek(
                &connections.idle.lock().unwrap()[0]
                    .connection
                    .wire
                    .lock()
                    .stream,
            )
            .ok()
                != Some(1)
            {
                assert!(Instant::now() < deadline, "the extra answer never arrived");
                std::thread::yield_now();
            }
            let next = connections.get("t", true).await.unwrap();
            assert!(
                !next.reused || next.begin(Body::empty()).is_none(),
                "a request was about to go on a connection with an extra answer"
            );
        });
    }

    #[tokio::test]
    async fn connections_are_kept_per_tenant() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            // Accepts and holds connections; answers nothing.
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let connections =
            Connections::new(authority, Duration::from_secs(5), Duration::from_secs(60));
        let connection = connections.get("t1", true).await.unwrap();
        connections.put("t1", connection);
        assert!(!connections.get("t2", true).await.unwrap().reused);
        assert!(connections.get("t1", true).await.unwrap().reused);
    }
}
