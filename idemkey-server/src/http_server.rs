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
//!   `Retry-After` and closed, without reaching the application and without being held:
//!   once its request has arrived (within half a second, 16 such connections at most), or at
//!   once. The log counts the refused connections in one line per 10 s.
//! - **Errors of its own in problem+json**: hyper's bare answer to a request head it cannot
//!   read (400, 414, 431) goes out as `request-malformed`, `uri-too-long` or
//!   `headers-too-large` ([`ProblemIo`]), and a method a route lacks is 405
//!   `method-not-allowed`.
//!
//! On the shutdown signal the listener is closed, idle connections close, and the server
//! returns once the requests in progress are answered.

use std::convert::Infallible;
use std::future::Future;
use std::io::{IoSlice, Read as _, Write as _};
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
use bytes::{Buf as _, Bytes, BytesMut};
use http::Request;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::problem::ApiError;

/// How long the accept loop pauses after an error that is not about one connection (out of
/// file descriptors, say), as axum's `serve` does, rather than spin.
const ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// How often, at most, the accept loop writes that it refused connections at the limit;
/// each line counts those refused since the one before.
const REFUSAL_REPORT_PERIOD: Duration = Duration::from_secs(10);

/// How many connections past the limit may wait at once for their request before they are
/// refused (each holds a descriptor, among the [`RESERVED_FDS`]); past them, a connection is
/// refused at once.
const REFUSING: usize = 16;

/// How long a connection past the limit may take to send its request before it is refused.
const REFUSAL_GRACE: Duration = Duration::from_millis(500);

/// How many reads of 4 KiB a refusal makes of what the client sent, at most.
const REFUSAL_READS: usize = 16;

/// File descriptors kept for what is not a client connection (the database, log files,
/// the listener, the connections past the limit being refused) when
/// `--max-client-connections` is checked against the open-file limit.
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
/// requests in progress answered). A method a route of `app` lacks is answered 405
/// `method-not-allowed`.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let app = crate::problem::method_not_allowed(app);
    let max = limits.max_connections;
    let answers = Arc::new(Answers::new(max).await);
    let slots = Arc::new(Semaphore::new(max));
    let refusing = Arc::new(Semaphore::new(REFUSING));
    // Every connection task holds a `closed` receiver: the sender's `closed()` is when the
    // last one is gone. `stop` tells them to shut down.
    let (stop, stop_rx) = watch::channel(());
    let (closed, closed_rx) = watch::channel(());
    let mut refusals = Refusals::new(REFUSAL_REPORT_PERIOD);
    // When the refusals not reported yet are due; polled only while there are some.
    let report = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(report);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, say: retrying at once would spin, and the
                    // connections in progress may free some.
                    tracing::error!(
                        error = %e,
                        pause = ?ACCEPT_PAUSE,
                        "cannot accept connections; pausing"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(ACCEPT_PAUSE) => continue,
                        () = &mut shutdown => break,
                    }
                }
            },
            () = &mut report, if refusals.pending > 0 => {
                if let Some(n) = refusals.take(Instant::now()) {
                    report_refusals(n, max);
                }
                continue;
            }
            () = &mut shutdown => break,
        };
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tokio::spawn(connection(
                    stream,
                    app.clone(),
                    slot,
                    limits,
                    answers.clone(),
                    stop_rx.clone(),
                    closed_rx.clone(),
                ));
            }
            Err(_) => {
                match refusing.clone().try_acquire_owned() {
                    Ok(permit) => {
                        tokio::spawn(refuse_after_request(stream, answers.clone(), permit));
                    }
                    Err(_) => refuse(stream, &answers.overloaded),
                }
                match refusals.refused(Instant::now()) {
                    Some(n) => report_refusals(n, max),
                    None if refusals.pending == 1 => report.as_mut().reset(refusals.due()),
                    None => {}
                }
            }
        }
    }
    drop(listener);
    if let Some(n) = refusals.take(Instant::now()) {
        report_refusals(n, max);
    }
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

/// Refuses a connection past the limit once its request has arrived, or [`REFUSAL_GRACE`]
/// has passed: an HTTP client reads an answer to the request it sent, where it may take one
/// that comes before as a broken connection. Holds one of the [`REFUSING`] permits.
async fn refuse_after_request(
    stream: TcpStream,
    answers: Arc<Answers>,
    _permit: OwnedSemaphorePermit,
) {
    let deadline = Instant::now() + REFUSAL_GRACE;
    // `readable` may wake without a byte to read: only a read tells.
    while tokio::time::timeout_at(deadline, stream.readable())
        .await
        .is_ok()
    {
        match stream.try_read(&mut [0u8; 1]) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            _ => break,
        }
    }
    refuse(stream, &answers.overloaded);
}

/// Refuses a connection past the limit without waiting: reads what the client has sent
/// already (so that the close is a FIN rather than a reset, when that was all), writes
/// `answer` once (a socket just accepted has room for it), and closes the socket. Nothing
/// here waits for the client.
fn refuse(stream: TcpStream, answer: &[u8]) {
    // The socket leaves the runtime as it is, non-blocking.
    let Ok(mut stream) = stream.into_std() else {
        return;
    };
    let mut sent = [0u8; 4096];
    for _ in 0..REFUSAL_READS {
        if !matches!(stream.read(&mut sent), Ok(n) if n > 0) {
            break;
        }
    }
    let _ = stream.write(answer);
}

/// Writes the line that says `n` connections were refused at the limit of `max`.
fn report_refusals(n: u64, max: usize) {
    tracing::warn!(
        refused = n,
        limit = max,
        "at the client connection limit: {n} connection(s) answered 503 server-overloaded and \
         closed since the last report"
    );
}

/// The connections refused at the limit, reported at most once per period: the first at
/// once, those that follow within the period in one line when it ends. Reads no clock: the
/// caller gives the time.
#[derive(Debug)]
struct Refusals {
    period: Duration,
    /// When the last line was written.
    last: Option<Instant>,
    /// Refused since then.
    pending: u64,
}

impl Refusals {
    fn new(period: Duration) -> Self {
        Self {
            period,
            last: None,
            pending: 0,
        }
    }

    /// One more connection refused at `now`: the count to report at once, when no line was
    /// written within the period.
    fn refused(&mut self, now: Instant) -> Option<u64> {
        self.pending += 1;
        match self.last {
            Some(last) if now < last + self.period => None,
            _ => self.take(now),
        }
    }

    /// When those refused since the last line are due to be reported.
    fn due(&self) -> Instant {
        self.last
            .map_or_else(Instant::now, |last| last + self.period)
    }

    /// The count not reported yet, if any, reported at `now`.
    fn take(&mut self, now: Instant) -> Option<u64> {
        if self.pending == 0 {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.pending))
    }
}

/// The answers the server writes itself, made once from the problem helper: the 503 past
/// the limit, and those it writes instead of hyper's bare answers to a head it could not
/// read.
struct Answers {
    /// 503 `server-overloaded`, whole.
    overloaded: Bytes,
    request_malformed: Canned,
    uri_too_long: Canned,
    headers_too_large: Canned,
}

impl Answers {
    async fn new(max_connections: usize) -> Self {
        Self {
            overloaded: Canned::of(ApiError::Overloaded(max_connections))
                .await
                .with(""),
            request_malformed: Canned::of(ApiError::RequestMalformed).await,
            uri_too_long: Canned::of(ApiError::UriTooLong).await,
            headers_too_large: Canned::of(ApiError::HeadersTooLarge).await,
        }
    }

    /// The answer that stands for hyper's bare one of `status`.
    fn instead_of(&self, status: u16) -> Option<&Canned> {
        match status {
            400 => Some(&self.request_malformed),
            414 => Some(&self.uri_too_long),
            431 => Some(&self.headers_too_large),
            _ => None,
        }
    }
}

/// An answer on a connection that closes after it, as bytes: its head up to the blank line
/// that ends it (`Content-Length` and `Connection: close` included), and its body.
struct Canned {
    head: Vec<u8>,
    body: Bytes,
}

impl Canned {
    async fn of(error: ApiError) -> Self {
        let (parts, body) = error.into_response().into_parts();
        // A problem's body is whole already: reading it does not fail.
        let body = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default();
        let mut head = format!("HTTP/1.1 {}\r\n", parts.status).into_bytes();
        for (name, value) in &parts.headers {
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(
            format!("content-length: {}\r\nconnection: close\r\n", body.len()).as_bytes(),
        );
        Self { head, body }
    }

    /// The whole answer, with the header `lines` (each ending in CRLF) after its own.
    fn with(&self, lines: &str) -> Bytes {
        let mut all = BytesMut::with_capacity(self.head.len() + lines.len() + 2 + self.body.len());
        all.extend_from_slice(&self.head);
        all.extend_from_slice(lines.as_bytes());
        all.extend_from_slice(b"\r\n");
        all.extend_from_slice(&self.body);
        all.freeze()
    }
}

/// Serves one connection, which holds `slot` until it closes: the application, with
/// keep-alive.
async fn connection(
    stream: TcpStream,
    app: Router,
    slot: OwnedSemaphorePermit,
    limits: HttpLimits,
    answers: Arc<Answers>,
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
        .header_read_timeout(limits.header_read_timeout);
    let io = ProblemIo {
        stream,
        activity: activity.clone(),
        answers,
        heads: 0,
        replacing: None,
    };
    let conn = builder.serve_connection(TokioIo::new(io), service);
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

/// A client connection as hyper reads and writes it: the socket, where hyper's own bare
/// answer to a request head it could not read (400, 414 or 431, without a body) goes out as
/// the server's problem+json instead.
///
/// hyper writes that answer without calling the service, then closes the connection. It is
/// known by its shape (one of those statuses, and only `connection: close`,
/// `content-length: 0` and `date`) where a response head starts a write, when every answer
/// of the service has had its head written already: the service counts its answers
/// ([`Activity::answered`]) before hyper writes their heads, and this counts the heads that
/// start a write. A head that does not start one (a pipelined request's, behind an answer
/// not sent yet) is not counted, so the heads after it are all taken for the service's:
/// then hyper's answer goes out bare, and an answer of the service is never replaced.
struct ProblemIo {
    stream: TcpStream,
    activity: Arc<Activity>,
    answers: Arc<Answers>,
    /// The service's answers whose head started a write.
    heads: usize,
    /// The answer written instead of hyper's: what is left of it, and the length of
    /// hyper's.
    replacing: Option<(Bytes, usize)>,
}

/// What a write starts with.
enum Start {
    /// The head of an answer of the service.
    Service,
    /// hyper's bare answer, to be replaced by these bytes; its length.
    Bare(Bytes, usize),
    /// Anything else: the rest of an answer, an interim `100 Continue`.
    Other,
}

impl ProblemIo {
    fn start(&self, buf: &[u8]) -> Start {
        if !buf.starts_with(b"HTTP/1.1 ") || buf.get(9) == Some(&b'1') {
            return Start::Other;
        }
        if self.heads < self.activity.answered.load(Ordering::Acquire) {
            return Start::Service;
        }
        match bare_answer(buf) {
            Some((status, date, len)) => match self.answers.instead_of(status) {
                Some(answer) => Start::Bare(answer.with(&format!("{date}\r\n")), len),
                None => Start::Other,
            },
            None => Start::Other,
        }
    }

    /// Writes `first` (the first bytes hyper gives) with `write`, or the answer that stands
    /// for them.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        first: &[u8],
        write: impl FnOnce(Pin<&mut TcpStream>, &mut Context<'_>) -> Poll<std::io::Result<usize>>,
    ) -> Poll<std::io::Result<usize>> {
        if self.replacing.is_none() {
            match self.start(first) {
                Start::Other => return write(Pin::new(&mut self.stream), cx),
                Start::Service => {
                    let written = std::task::ready!(write(Pin::new(&mut self.stream), cx))?;
                    if written > 0 {
                        self.heads += 1;
                    }
                    return Poll::Ready(Ok(written));
                }
                Start::Bare(answer, len) => {
                    tracing::debug!(answer = ?first.get(..12), "a request head could not be read");
                    self.replacing = Some((answer, len));
                }
            }
        }
        loop {
            let Some((rest, len)) = &mut self.replacing else {
                return Poll::Ready(Ok(0));
            };
            if rest.is_empty() {
                let len = *len;
                self.replacing = None;
                return Poll::Ready(Ok(len));
            }
            let n = std::task::ready!(Pin::new(&mut self.stream).poll_write(cx, rest))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            rest.advance(n);
        }
    }
}

/// hyper's own answer to a head it could not read, at the start of `buf`: its status, its
/// `date` line and its length.
fn bare_answer(buf: &[u8]) -> Option<(u16, &str, usize)> {
    let head = &buf[..buf.len().min(256)];
    let len = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = std::str::from_utf8(&head[..len - 4]).ok()?;
    let mut lines = text.split("\r\n");
    let status = lines.next()?.get(9..12)?.parse().ok()?;
    let mut rest: Vec<&str> = lines.collect();
    rest.sort_unstable();
    match rest[..] {
        ["connection: close", "content-length: 0", date] if date.starts_with("date: ") => {
            Some((status, date, len))
        }
        _ => None,
    }
}

impl AsyncRead for ProblemIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ProblemIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, buf, |stream, cx| stream.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        self.get_mut()
            .poll_write_with(cx, first, |stream, cx| stream.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
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
/// ended; and what [`ProblemIo`] reads: how many the service answered.
struct Activity {
    /// When the connection was accepted: the origin of `last_end`.
    start: Instant,
    in_progress: AtomicUsize,
    /// The requests the service answered: each is counted before hyper writes its head.
    answered: AtomicUsize,
    /// Nanoseconds from `start` to the end of the last request.
    last_end: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            in_progress: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
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
            in_progress.0.answered.fetch_add(1, Ordering::AcqRel);
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
    fn refusals_are_reported_at_once_then_once_per_period_with_their_count() {
        let period = Duration::from_secs(10);
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        let mut refusals = Refusals::new(period);
        assert_eq!(refusals.take(at(0)), None, "nothing to report");
        assert_eq!(refusals.refused(at(0)), Some(1), "the first, at once");
        for _ in 0..299 {
            assert_eq!(refusals.refused(at(1)), None);
        }
        assert_eq!(refusals.due(), at(10));
        assert_eq!(refusals.take(at(10)), Some(299), "at the end of the period");
        assert_eq!(refusals.take(at(11)), None);
        assert_eq!(
            refusals.refused(at(15)),
            None,
            "within the period of the last line"
        );
        assert_eq!(
            refusals.refused(at(20)),
            Some(2),
            "a period after the last line"
        );
    }

    #[test]
    fn only_hypers_bare_answer_is_taken_for_one() {
        let date = "date: Sat, 05 Dec 2026 10:27:19 GMT";
        let bare = format!(
            "HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n{date}\r\n\r\n"
        );
        assert_eq!(bare_answer(bare.as_bytes()), Some((431, date, bare.len())));
        let with_type = bare.replace(
            "content-length: 0",
            "content-type: text/plain\r\ncontent-length: 0",
        );
        assert_eq!(bare_answer(with_type.as_bytes()), None);
        let with_body = bare.replace("content-length: 0", "content-length: 2");
        assert_eq!(bare_answer(with_body.as_bytes()), None);
        assert_eq!(
            bare_answer(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n"),
            None
        );
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
