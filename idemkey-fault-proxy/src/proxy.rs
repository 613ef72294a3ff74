//! A fault-injecting HTTP/1.1 proxy for loopback tests and demos.
//!
//! [`FaultProxy`] sits between a client and an upstream HTTP server and, per request,
//! simulates the failures that make idempotency keys necessary: a response lost after the
//! upstream produced it, a connection reset before anything reached the upstream, and added
//! latency. See [`FaultConfig`].

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use idemkey_core::hop::strip_hop_by_hop;

use crate::listen::accept_loop;

/// Which faults a [`FaultProxy`] injects, and how often.
///
/// Every rate is a probability from `0.0` (never) to `1.0` (always), drawn independently
/// for each request (not each connection). [`FaultConfig::default`] injects no faults.
///
/// For each request the proxy first reads the whole request from the client, then:
/// 1. with probability [`reset_before`](Self::reset_before) closes the client's connection
///    without contacting the upstream;
/// 2. otherwise forwards the request and reads the upstream's whole response, then with
///    probability [`lose_response`](Self::lose_response) closes the client's connection
///    without sending any of it;
/// 3. otherwise, with probability [`delay_rate`](Self::delay_rate), waits
///    [`delay`](Self::delay) before sending the response to the client.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Rate of lost responses: the upstream handled the request, the client never hears it.
    pub lose_response: f64,
    /// Rate of connections closed before the request is forwarded: nothing reaches the upstream.
    pub reset_before: f64,
    /// Latency added before a response is forwarded; `None` adds none.
    pub delay: Option<Duration>,
    /// Rate at which [`delay`](Self::delay) is applied.
    pub delay_rate: f64,
    /// Seed for the fault decisions; `None` seeds from the OS. With a seed, the decisions
    /// for the n-th request handled are reproducible (requests sent one after another are
    /// handled in order).
    pub seed: Option<u64>,
}

/// Counts of what a [`FaultProxy`] did, as returned by [`FaultProxy::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ProxyStats {
    /// Requests read completely from clients.
    pub requests: u64,
    /// Requests sent to the upstream (whether or not it answered).
    pub forwarded: u64,
    /// Responses received from the upstream and then withheld from the client.
    pub responses_lost: u64,
    /// Client connections closed before the request was forwarded.
    pub resets: u64,
    /// Responses sent to the client after the added delay.
    pub delayed: u64,
    /// Requests the upstream did not answer; the client got `502 Bad Gateway`.
    pub upstream_errors: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    forwarded: AtomicU64,
    responses_lost: AtomicU64,
    resets: AtomicU64,
    delayed: AtomicU64,
    upstream_errors: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ProxyStats {
        ProxyStats {
            requests: self.requests.load(Ordering::Relaxed),
            forwarded: self.forwarded.load(Ordering::Relaxed),
            responses_lost: self.responses_lost.load(Ordering::Relaxed),
            resets: self.resets.load(Ordering::Relaxed),
            delayed: self.delayed.load(Ordering::Relaxed),
            upstream_errors: self.upstream_errors.load(Ordering::Relaxed),
        }
    }
}

/// A fault-injecting HTTP/1.1 proxy listening on `127.0.0.1`, forwarding to one upstream.
///
/// Requests and responses are buffered whole. Hop-by-hop headers are dropped and `Host` is
/// set to the upstream's address; method, path and query, the other headers and the body
/// are forwarded unchanged, as are the response's status, headers and body. An unreachable
/// upstream yields `502 Bad Gateway`.
///
/// A dropped or lost response is simulated by closing the client's connection without
/// writing any response bytes, so the client sees a transport error (connection closed or
/// reset), never an HTTP status.
///
/// Dropping the proxy stops accepting connections and aborts the connections in progress.
pub struct FaultProxy {
    addr: SocketAddr,
    counters: Arc<Counters>,
    accept: JoinHandle<()>,
}

struct Shared {
    upstream: SocketAddr,
    config: FaultConfig,
    rng: Mutex<StdRng>,
    counters: Arc<Counters>,
}

/// The fault decisions for one request, all drawn up front so a seed fixes them per request.
struct Faults {
    reset_before: bool,
    lose_response: bool,
    delay: Option<Duration>,
}

impl Shared {
    fn draw(&self) -> Faults {
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // `gen::<f64>()` is in [0, 1): a rate of 0.0 (or NaN) never fires, 1.0 always does.
        let reset_before = rng.r#gen::<f64>() < self.config.reset_before;
        let lose_response = rng.r#gen::<f64>() < self.config.lose_response;
        let delayed = rng.r#gen::<f64>() < self.config.delay_rate;
        Faults {
            reset_before,
            lose_response,
            delay: self.config.delay.filter(|_| delayed),
        }
    }
}

/// The service's error: makes hyper close the client's connection without a response.
#[derive(Debug)]
struct Dropped(&'static str);

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fault proxy dropped the connection: {}", self.0)
    }
}

impl std::error::Error for Dropped {}

type ProxyBody = Full<Bytes>;

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1` (an ephemeral port) forwarding to `upstream`.
    ///
    /// Must be called within a Tokio runtime; the proxy runs on spawned tasks.
    pub async fn start(upstream: SocketAddr, config: FaultConfig) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let counters = Arc::new(Counters::default());
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        let shared = Arc::new(Shared {
            upstream,
            config,
            rng: Mutex::new(rng),
            counters: Arc::clone(&counters),
        });
        let accept = tokio::spawn(accept_loop(listener, move |stream| {
            serve_connection(stream, Arc::clone(&shared))
        }));
        Ok(FaultProxy {
            addr,
            counters,
            accept,
        })
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy's base URL, `http://127.0.0.1:PORT`, with no trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        self.counters.snapshot()
    }
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the listener and the connection tasks' `JoinSet`, so aborting
        // it closes the listener and aborts every connection.
        self.accept.abort();
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |request| {
        let shared = Arc::clone(&shared);
        async move { handle(request, &shared).await }
    });
    // Errors include the faults themselves (a service error closes the connection without
    // writing a response) and clients going away; there is nobody to report them to.
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

async fn handle(
    request: Request<Incoming>,
    shared: &Shared,
) -> Result<Response<ProxyBody>, Dropped> {
    let (parts, body) = request.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Err(Dropped("could not read the request body")),
    };
    let counters = &shared.counters;
    Counters::bump(&counters.requests);
    let faults = shared.draw();

    if faults.reset_before {
        Counters::bump(&counters.resets);
        return Err(Dropped("reset before forwarding"));
    }

    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |path_and_query| path_and_query.as_str());
    let mut upstream_request = Request::new(Full::new(body));
    *upstream_request.method_mut() = parts.method;
    *upstream_request.uri_mut() = path
        .parse::<Uri>()
        .unwrap_or_else(|_| Uri::from_static("/"));
    *upstream_request.headers_mut() = without_hop_by_hop(parts.headers);
    if let Ok(host) = HeaderValue::from_str(&shared.upstream.to_string()) {
        upstream_request.headers_mut().insert(header::HOST, host);
    }

    Counters::bump(&counters.forwarded);
    let response = match send_upstream(shared.upstream, upstream_request).await {
        Ok(response) => response,
        Err(_) => {
            Counters::bump(&counters.upstream_errors);
            let mut response = Response::new(Full::new(Bytes::from_static(b"upstream error\n")));
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            return Ok(response);
        }
    };

    if faults.lose_response {
        Counters::bump(&counters.responses_lost);
        return Err(Dropped("response lost"));
    }
    if let Some(delay) = faults.delay {
        tokio::time::sleep(delay).await;
        Counters::bump(&counters.delayed);
    }
    Ok(response)
}

/// Sends `request` on a fresh connection to `upstream` and reads the whole response.
async fn send_upstream(
    upstream: SocketAddr,
    request: Request<ProxyBody>,
) -> Result<Response<ProxyBody>, Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(upstream).await?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, ProxyBody>(TokioIo::new(stream)).await?;
    let exchange = async move {
        let response = sender.send_request(request).await?;
        // Dropping the sender lets `connection` finish once the body has been read.
        drop(sender);
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, hyper::Error>(Response::from_parts(parts, body))
    };
    let (response, _) = tokio::join!(exchange, connection);
    let (mut parts, body) = response?.into_parts();
    parts.headers = without_hop_by_hop(parts.headers);
    Ok(Response::from_parts(parts, Full::new(body)))
}

/// `headers` without the hop-by-hop ones.
fn without_hop_by_hop(mut headers: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    headers
}
