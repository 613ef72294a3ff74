//! The HTTP server under `serve` and `gateway`: the accept loop, hyper's connection settings
//! and the limits that keep slow, idle or too many clients from holding the server.
//!
//! - **Header-read timeout**: hyper's own (`header_read_timeout`, on a [`TokioTimer`]). It
//!   runs from the moment a connection waits for a request (on accept, and after each
//!   response) until the whole head has arrived: a half-sent head is closed.
//! - **Idle timeout**: a connection with no request in progress for that long is shut down
//!   the graceful way (hyper's `graceful_shutdown`): an idle one closes at once, one in the
//!   middle of a head is left to the header-read timeout.
//! - **Request-body deadline**: the whole body must arrive within it, counted from the head;
//!   a body still arriving then fails to read, which the handler answers (the idempotency
//!   layer: 400 `request-unreadable`, nothing claimed) and the connection is closed.
//! - **Connection limit**: past it, a connection is answered 503 `server-overloaded` with
//!   `Retry-After` and closed, without reaching the application.
//!
//! On the shutdown signal the listener is closed, idle connections close, and the server
//! returns once the requests in progress are answered.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::problem::ApiError;

/// How long the accept loop pauses after an error that is not about one connection (out of
/// file descriptors, say), as axum's `serve` does, rather than spin.
const ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// File descriptors kept for what is not a client connection (the database, log files,
/// the listener) when `--max-client-connections` is checked against the open-file limit.
const RESERVED_FDS: u64 = 64;

/// The limits of the HTTP server of `serve` and `gateway` (their flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a client has to send a whole request head, from the moment the connection
    /// waits for it (`--header-read-timeout`).
    pub header_read_timeout: Duration,
    /// How long a connection may stay open with no request in progress (`--idle-timeout`);
    /// at most `header_read_timeout`, which closes such a connection anyway.
    pub idle_timeout: Duration,
    /// How long a client has to send a whole request body, counted from its head
    /// (`--request-body-deadline`).
    pub request_body_deadline: Duration,
    /// How many client connections are served at once (`--max-client-connections`); one
    /// more is answered 503 `server-overloaded` and closed.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    /// The flags' defaults: 10 s, 5 s, 20 s and 400 connections.
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            request_body_deadline: Duration::from_secs(20),
            max_connections: 400,
        }
    }
}

impl HttpLimits {
    /// Whether these limits can hold together, on a process that may open `open_files`
    /// files and needs `fds_per_connection` descriptors for each client connection (the
    /// gateway: one more for the upstream). The message names the flag to change.
    pub fn check(&self, open_files: Option<u64>, fds_per_connection: u64) -> Result<(), String> {
        if self.idle_timeout > self.header_read_timeout {
            return Err(format!(
                "--idle-timeout {} is longer than --header-read-timeout {}: the header-read \
                 timeout runs while a connection waits for its next request, so it would close \
                 an idle connection first; raise --header-read-timeout or lower --idle-timeout",
                humantime::format_duration(self.idle_timeout),
                humantime::format_duration(self.header_read_timeout)
            ));
        }
        let needed = (self.max_connections as u64)
            .saturating_mul(fds_per_connection)
            .saturating_add(RESERVED_FDS);
        if let Some(limit) = open_files
            && needed > limit
        {
            return Err(format!(
                "--max-client-connections {} cannot hold: the open-file limit of this process is \
                 {limit} (`ulimit -n`), and {needed} descriptors would be needed ({fds_per_connection} \
                 per connection and {RESERVED_FDS} for the rest); lower the flag or raise the limit",
                self.max_connections
            ));
        }
        Ok(())
    }
}

/// The soft limit of open files of this process, if it has one.
fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Checks `limits` (see [`HttpLimits::check`]), then binds `address`.
pub(crate) async fn bind(
    address: SocketAddr,
    limits: &HttpLimits,
    fds_per_connection: u64,
) -> anyhow::Result<TcpListener> {
    limits
        .check(open_file_limit(), fds_per_connection)
        .map_err(anyhow::Error::msg)?;
    TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))
}

/// Serves `app` on `listener` under `limits` until `shutdown` resolves, then stops
/// accepting, closes idle connections and returns once every connection is closed (the
/// requests in progress answered).
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let max = limits.max_connections;
    let overloaded =
        Router::new().fallback(move || async move { ApiError::Overloaded(max).into_response() });
    let slots = Arc::new(Semaphore::new(max));
    // Every connection task holds a `closed` receiver: the sender's `closed()` is when the
    // last one is gone. `stop` tells them to shut down.
    let (stop, stop_rx) = watch::channel(());
    let (closed, closed_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "cannot accept connections; pausing");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let slot = slots.clone().try_acquire_owned().ok();
        let service = if slot.is_some() {
            app.clone()
        } else {
            tracing::warn!(limit = max, "at the client connection limit; answering 503");
            overloaded.clone()
        };
        tokio::spawn(connection(
            stream,
            service,
            slot,
            limits,
            stop_rx.clone(),
            closed_rx.clone(),
        ));
    }
    drop(listener);
    drop(closed_rx);
    let _ = stop.send(());
    closed.closed().await;
}

/// Errors of one connection that `accept` reports; the next `accept` is fine.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection: with a `slot`, the application with keep-alive; without one, the
/// 503 answer, then close.
async fn connection(
    stream: TcpStream,
    app: Router,
    slot: Option<OwnedSemaphorePermit>,
    limits: HttpLimits,
    mut stop: watch::Receiver<()>,
    _closed: watch::Receiver<()>,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::default());
    let service = Service {
        app,
        body_deadline: limits.request_body_deadline,
        activity: activity.clone(),
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(slot.is_some());
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let idle = idle(&activity, limits.idle_timeout);
    tokio::pin!(idle);
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection closed");
                }
                break;
            }
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            () = idle.as_mut(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
    drop(slot);
}

/// Resolves once no request has been in progress on the connection for `timeout`. One timer
/// per connection, looked at when it fires: requests only touch two atomics, and wake
/// nothing.
async fn idle(activity: &Activity, timeout: Duration) {
    loop {
        let since = activity.idle_since().unwrap_or_else(Instant::now);
        tokio::time::sleep_until(since + timeout).await;
        if activity
            .idle_since()
            .is_some_and(|since| since.elapsed() >= timeout)
        {
            return;
        }
    }
}

/// What [`idle`] reads of a connection: the requests in progress, and when the last one
/// ended.
struct Activity {
    /// When the connection was accepted: the origin of `last_end`.
    start: Instant,
    in_progress: AtomicUsize,
    /// Nanoseconds from `start` to the end of the last request.
    last_end: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            in_progress: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
        }
    }
}

impl Activity {
    /// Since when no request has been in progress; `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        if self.in_progress.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(self.start + Duration::from_nanos(self.last_end.load(Ordering::Acquire)))
    }
}

/// The hyper service of one connection: each request's body under the deadline, and the
/// count of requests in progress that [`idle`] reads.
#[derive(Clone)]
struct Service {
    app: Router,
    body_deadline: Duration,
    activity: Arc<Activity>,
}

impl hyper::service::Service<Request<Incoming>> for Service {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let in_progress = InProgress::start(self.activity.clone());
        let deadline = self.body_deadline;
        let request = request.map(|body| Body::new(DeadlineBody::new(body, deadline)));
        let app = self.app.clone();
        Box::pin(async move {
            let response = app.oneshot(request).await;
            drop(in_progress);
            response
        })
    }
}

/// One request in progress, counted until it is answered (or dropped).
struct InProgress(Arc<Activity>);

impl InProgress {
    fn start(activity: Arc<Activity>) -> Self {
        activity.in_progress.fetch_add(1, Ordering::AcqRel);
        Self(activity)
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let activity = &self.0;
        let end = u64::try_from(activity.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        activity.last_end.store(end, Ordering::Release);
        activity.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request body that fails once its deadline has passed: one timer for the whole body,
/// which a trickle of bytes does not reset.
struct DeadlineBody {
    body: Incoming,
    /// When the head arrived: the deadline counts from it.
    start: Instant,
    /// The timer, made the first time the body is not ready at once (most bodies arrive
    /// with their head and never need one).
    deadline: Option<Pin<Box<Sleep>>>,
    limit: Duration,
}

impl DeadlineBody {
    fn new(body: Incoming, limit: Duration) -> Self {
        Self {
            body,
            start: Instant::now(),
            deadline: None,
            limit,
        }
    }
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(axum::Error::new)));
        }
        let (start, limit) = (this.start, this.limit);
        let deadline = (this.deadline)
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(start + limit)));
        if deadline.as_mut().poll(cx).is_ready() {
            tracing::info!(deadline = ?this.limit, "request body cut at its deadline");
            let cut = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the request body did not arrive within {}",
                    humantime::format_duration(this.limit)
                ),
            );
            return Poll::Ready(Some(Err(axum::Error::new(cut))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_timeout_past_the_header_read_timeout_is_refused() {
        let limits = HttpLimits {
            idle_timeout: Duration::from_secs(11),
            ..HttpLimits::default()
        };
        let e = limits.check(None, 1).unwrap_err();
        assert!(e.contains("--idle-timeout 11s"), "{e}");
        assert!(HttpLimits::default().check(None, 1).is_ok());
    }

    #[test]
    fn a_connection_limit_past_the_open_file_limit_is_refused() {
        // The defaults fit the common limit of 1024, for the gateway's two per connection too.
        let limits = HttpLimits::default();
        assert!(limits.check(Some(1024), 2).is_ok());
        let e = limits.check(Some(512), 2).unwrap_err();
        assert!(
            e.contains("--max-client-connections 400 cannot hold"),
            "{e}"
        );
        assert!(e.contains("864"), "{e}");
    }
}
