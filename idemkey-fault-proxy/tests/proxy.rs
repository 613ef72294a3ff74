//! The fault-injecting proxy against a small counting upstream on loopback.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use idemkey_fault_proxy::{FaultConfig, FaultProxy, ProxyStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that counts the requests it served and echoes what it received.
struct Upstream {
    addr: SocketAddr,
    served: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Upstream {
        let served = Arc::new(AtomicU64::new(0));
        let app = Router::new().fallback(echo).with_state(Arc::clone(&served));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Upstream { addr, served, task }
    }

    fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Answers `201` to POST and `200` otherwise, with the request's body, method, path and query,
/// `Host` and whether the hop-by-hop test header `x-hop` arrived.
async fn echo(State(served): State<Arc<AtomicU64>>, request: Request) -> impl IntoResponse {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    served.fetch_add(1, Ordering::SeqCst);
    let status = if parts.method == "POST" {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut headers = HeaderMap::new();
    headers.insert("x-custom", HeaderValue::from_static("custom-value"));
    let seen = format!("{} {}", parts.method, parts.uri);
    headers.insert("x-seen", HeaderValue::from_str(&seen).unwrap());
    if let Some(host) = parts.headers.get("host") {
        headers.insert("x-seen-host", host.clone());
    }
    let hop = if parts.headers.contains_key("x-hop") {
        "yes"
    } else {
        "no"
    };
    headers.insert("x-seen-hop", HeaderValue::from_static(hop));
    (status, headers, body)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// The status, custom header and body of a response.
async fn summary(response: reqwest::Response) -> (u16, String, Bytes) {
    let status = response.status().as_u16();
    let custom = response.headers()["x-custom"].to_str().unwrap().to_owned();
    (status, custom, response.bytes().await.unwrap())
}

/// Asserts that `result` failed in transport, not with an HTTP status.
fn assert_transport_error(result: Result<reqwest::Response, reqwest::Error>) {
    match result {
        Ok(response) => panic!("expected a transport error, got HTTP {}", response.status()),
        Err(error) => {
            assert!(error.status().is_none(), "{error:?}");
            assert!(error.is_request() || error.is_connect(), "{error:?}");
            assert!(!error.is_timeout(), "{error:?}");
        }
    }
}

#[tokio::test]
async fn without_faults_requests_and_responses_pass_through() {
    let upstream = Upstream::start().await;
    let proxy = FaultProxy::start(upstream.addr, FaultConfig::default())
        .await
        .unwrap();
    assert_eq!(proxy.url(), format!("http://{}", proxy.addr()));
    assert_eq!(proxy.addr().ip(), Ipv4Addr::LOCALHOST);
    let client = client();

    let path = "/orders/7?expand=lines&x=%20y";
    let direct = client
        .get(format!("http://{}{path}", upstream.addr))
        .send()
        .await
        .unwrap();
    let proxied = client
        .get(format!("{}{path}", proxy.url()))
        .header("connection", "x-hop")
        .header("x-hop", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(proxied.headers()["x-seen"], format!("GET {path}").as_str());
    assert_eq!(
        proxied.headers()["x-seen-host"],
        upstream.addr.to_string().as_str()
    );
    assert_eq!(proxied.headers()["x-seen-hop"], "no");
    assert_eq!(summary(proxied).await, summary(direct).await);

    let body = r#"{"sku":"A-1","qty":3}"#;
    let post = |url: String| {
        client
            .post(url)
            .header("content-type", "application/json")
            .header("idempotency-key", "k-1")
            .body(body)
            .send()
    };
    let direct = post(format!("http://{}/orders", upstream.addr))
        .await
        .unwrap();
    let proxied = post(format!("{}/orders", proxy.url())).await.unwrap();
    let proxied = summary(proxied).await;
    assert_eq!(proxied, summary(direct).await);
    assert_eq!(proxied.0, 201);
    assert_eq!(proxied.2, body.as_bytes());

    assert_eq!(upstream.served(), 4);
    assert_eq!(
        proxy.stats(),
        ProxyStats {
            requests: 2,
            forwarded: 2,
            ..ProxyStats::default()
        }
    );
}

#[tokio::test]
async fn a_lost_response_was_served_but_never_reaches_the_client() {
    let upstream = Upstream::start().await;
    let config = FaultConfig {
        lose_response: 1.0,
        ..FaultConfig::default()
    };
    let proxy = FaultProxy::start(upstream.addr, config).await.unwrap();

    let result = client()
        .post(format!("{}/orders", proxy.url()))
        .body("pay 10")
        .send()
        .await;
    assert_transport_error(result);
    assert_eq!(upstream.served(), 1);
    assert_eq!(
        proxy.stats(),
        ProxyStats {
            requests: 1,
            forwarded: 1,
            responses_lost: 1,
            ..ProxyStats::default()
        }
    );
}

#[tokio::test]
async fn a_lost_response_sends_no_bytes_at_all() {
    let upstream = Upstream::start().await;
    let config = FaultConfig {
        lose_response: 1.0,
        ..FaultConfig::default()
    };
    let proxy = FaultProxy::start(upstream.addr, config).await.unwrap();

    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    stream
        .write_all(b"POST /orders HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\npay 10")
        .await
        .unwrap();
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut received))
        .await
        .expect("the proxy should close the connection");
    // A clean close (EOF) or a reset are both fine; a single byte of response is not.
    if let Err(error) = read {
        assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}");
    }
    assert!(
        received.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&received)
    );
    assert_eq!(upstream.served(), 1);
    assert_eq!(proxy.stats().responses_lost, 1);
}

#[tokio::test]
async fn a_reset_before_forwarding_never_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let config = FaultConfig {
        reset_before: 1.0,
        ..FaultConfig::default()
    };
    let proxy = FaultProxy::start(upstream.addr, config).await.unwrap();

    let result = client()
        .post(format!("{}/orders", proxy.url()))
        .body("pay 10")
        .send()
        .await;
    assert_transport_error(result);
    assert_eq!(upstream.served(), 0);
    assert_eq!(
        proxy.stats(),
        ProxyStats {
            requests: 1,
            resets: 1,
            ..ProxyStats::default()
        }
    );
}

/// Sends `n` sequential POSTs on one keep-alive client; returns which were lost.
async fn lost_pattern(proxy: &FaultProxy, n: usize) -> Vec<bool> {
    let client = client();
    let mut lost = Vec::with_capacity(n);
    for i in 0..n {
        let result = client
            .post(format!("{}/orders/{i}", proxy.url()))
            .body(format!("request {i}"))
            .send()
            .await;
        match result {
            Ok(response) => {
                let (status, _, body) = summary(response).await;
                assert_eq!(status, 201);
                assert_eq!(body, format!("request {i}").as_bytes());
                lost.push(false);
            }
            Err(error) => {
                assert_transport_error(Err(error));
                lost.push(true);
            }
        }
    }
    lost
}

#[tokio::test]
async fn lost_responses_are_per_request_and_reproducible_with_a_seed() {
    let upstream = Upstream::start().await;
    let config = FaultConfig {
        lose_response: 0.3,
        seed: Some(7),
        ..FaultConfig::default()
    };
    let proxy = FaultProxy::start(upstream.addr, config.clone())
        .await
        .unwrap();

    let lost = lost_pattern(&proxy, 200).await;
    let lost_count = lost.iter().filter(|&&lost| lost).count() as u64;
    assert_eq!(proxy.stats().responses_lost, lost_count);
    assert!((30..=90).contains(&lost_count), "{lost_count} lost");
    // Every request reached the upstream exactly once: a lost response on a kept-alive
    // connection did not poison later requests, and nothing was retried.
    assert_eq!(upstream.served(), 200);
    assert_eq!(
        proxy.stats(),
        ProxyStats {
            requests: 200,
            forwarded: 200,
            responses_lost: lost_count,
            ..ProxyStats::default()
        }
    );

    let again = FaultProxy::start(upstream.addr, config).await.unwrap();
    assert_eq!(lost_pattern(&again, 50).await, lost[..50]);
}

#[tokio::test]
async fn a_delay_is_added_before_the_response() {
    let upstream = Upstream::start().await;
    let config = FaultConfig {
        delay: Some(Duration::from_millis(200)),
        delay_rate: 1.0,
        ..FaultConfig::default()
    };
    let proxy = FaultProxy::start(upstream.addr, config).await.unwrap();

    let started = Instant::now();
    let response = client().get(proxy.url()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(proxy.stats().delayed, 1);
    assert_eq!(upstream.served(), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_bad_gateway() {
    let gone = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let gone_addr = gone.local_addr().unwrap();
    drop(gone);
    let proxy = FaultProxy::start(gone_addr, FaultConfig::default())
        .await
        .unwrap();

    let response = client().get(proxy.url()).send().await.unwrap();
    assert_eq!(response.status(), 502);
    assert_eq!(proxy.stats().upstream_errors, 1);
}

#[tokio::test]
async fn dropping_the_proxy_stops_accepting() {
    let upstream = Upstream::start().await;
    let proxy = FaultProxy::start(upstream.addr, FaultConfig::default())
        .await
        .unwrap();
    let addr = proxy.addr();
    drop(proxy);
    // The accept task is aborted asynchronously; give it a moment to close the listener.
    for _ in 0..100 {
        if TcpStream::connect(addr).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the proxy still accepts connections after being dropped");
}
