//! Every error a client can get from `idemkey serve` and `idemkey gateway` is problem+json,
//! those that no route answers included: a request head the server cannot read (400
//! `request-malformed`, 414 `uri-too-long`, 431 `headers-too-large`, sent on raw sockets),
//! a path no route has (404 `route-not-found`, `serve` and `relay`) and a method a route
//! lacks (405 `method-not-allowed`, with `Allow`). An application's own empty answer goes out
//! as it is.

mod common;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::gateway::{Gateway, serve_on_own_thread};
use common::{Api, Backend, TOKEN1};
use http::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A bound on how long the server takes to answer and close (a hang guard).
const CLOSE_BOUND: Duration = Duration::from_secs(30);

/// An answer read off a raw socket: its status, its header fields (names lower case) and
/// its body.
#[derive(Debug)]
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    /// Parses the first answer of `bytes`; the rest is returned.
    fn parse(bytes: &[u8]) -> (Self, &[u8]) {
        let end = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no whole head in {:?}", String::from_utf8_lossy(bytes)));
        let head = std::str::from_utf8(&bytes[..end]).expect("an ASCII head");
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap()[9..12].parse().expect("a status");
        let headers: Vec<(String, String)> = lines
            .map(|l| {
                let (name, value) = l.split_once(':').expect("name: value");
                (name.to_ascii_lowercase(), value.trim().to_owned())
            })
            .collect();
        let length: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map_or(0, |(_, v)| v.parse().expect("a length"));
        let body = &bytes[end + 4..end + 4 + length];
        let rest = &bytes[end + 4 + length..];
        let answer = Self {
            status,
            headers,
            body: body.to_vec(),
        };
        (answer, rest)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts a problem+json answer of `status` and type `name`, closing the connection.
    #[track_caller]
    fn assert_problem(&self, status: u16, name: &str) {
        let body = String::from_utf8_lossy(&self.body);
        assert_eq!(self.status, status, "{self:?} {body}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let problem: Value = serde_json::from_slice(&self.body).expect("a JSON body");
        assert_eq!(problem["type"], format!("urn:idemkey:problem:{name}"));
        assert_eq!(problem["status"], status);
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
}

/// Sends `request` on a new connection to `address` and reads until the server closes it
/// (a reset after the answer counts as closed). A failed write is fine: the server may stop
/// reading a head it refuses.
async fn exchange(address: &str, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    let _ = stream.write_all(request).await;
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(CLOSE_BOUND, read_all)
        .await
        .expect("the server did not close the connection");
    received
}

/// The heads the server cannot read, each with the status and problem type it answers.
fn unreadable_heads(address: &str) -> Vec<(&'static str, Vec<u8>, u16, &'static str)> {
    let host = format!("Host: {address}\r\n");
    let long_uri = format!("GET /{} HTTP/1.1\r\n{host}\r\n", "a".repeat(70_000));
    let big_field = format!(
        "GET /healthz HTTP/1.1\r\n{host}X-Big: {}\r\n\r\n",
        "b".repeat(500_000)
    );
    let many: String = (0..120).map(|i| format!("X-Field-{i}: v\r\n")).collect();
    let many_fields = format!("GET /healthz HTTP/1.1\r\n{host}{many}\r\n");
    vec![
        (
            "not HTTP",
            b"GARBAGE\r\n\r\n".to_vec(),
            400,
            "request-malformed",
        ),
        (
            "a space in a header name",
            format!("GET /healthz HTTP/1.1\r\n{host}Bad Name: x\r\n\r\n").into_bytes(),
            400,
            "request-malformed",
        ),
        ("a long URI", long_uri.into_bytes(), 414, "uri-too-long"),
        (
            "a huge field",
            big_field.into_bytes(),
            431,
            "headers-too-large",
        ),
        (
            "120 fields",
            many_fields.into_bytes(),
            431,
            "headers-too-large",
        ),
    ]
}

/// Each unreadable head gets its problem+json answer, `Connection: close`, and the
/// connection closed; a good request still gets its answer, and a bad one pipelined behind
/// it gets its problem after it.
async fn assert_unreadable_heads_answered(address: &str) {
    for (what, request, status, name) in unreadable_heads(address) {
        let received = exchange(address, &request).await;
        let (answer, rest) = Raw::parse(&received);
        answer.assert_problem(status, name);
        assert_eq!(answer.header("connection"), Some("close"), "{what}");
        assert!(answer.header("date").is_some(), "{what}: {answer:?}");
        assert!(rest.is_empty(), "{what}: more after the answer");
    }

    let pipelined =
        format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\nGARBAGE\r\n\r\n").into_bytes();
    let received = exchange(address, &pipelined).await;
    let (first, rest) = Raw::parse(&received);
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.body, b"ok\n");
    let (second, rest) = Raw::parse(rest);
    second.assert_problem(400, "request-malformed");
    assert!(rest.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_a_head_it_cannot_read_with_problem_json() {
    let backend = Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let address = server.base().strip_prefix("http://").unwrap().to_owned();
    assert_unreadable_heads_answered(&address).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_an_unknown_path_or_method_with_problem_json() {
    let backend = Backend::sqlite().await;
    let server = backend.start(&[]).await;
    let api = Api::new(server.base());
    for token in [None, Some(TOKEN1)] {
        let unknown = api.get("/v2/nothing-here", token).await;
        unknown.assert_problem(404, "route-not-found");
        assert!(
            unknown.json()["detail"]
                .as_str()
                .unwrap()
                .contains("GET /v2/nothing-here")
        );
    }

    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = server.base();
    let delete = client
        .delete(format!("{base}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(delete.headers()["allow"], "GET,HEAD");
    assert_eq!(delete.headers()["content-type"], "application/problem+json");
    let problem: Value = delete.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:method-not-allowed");
    assert_eq!(problem["status"], 405);

    // Behind the bearer token, the payments API's routes answer the same.
    let put = client
        .put(format!("{base}/v1/payments/pay_1"))
        .bearer_auth(TOKEN1)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(put.headers()["allow"], "GET,HEAD");
    let problem: Value = put.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:method-not-allowed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_what_it_cannot_route_with_problem_json_and_forwards_bare_answers() {
    // An upstream whose own answer is an empty 400, as bare as hyper's.
    let upstream = serve_on_own_thread(
        Router::new().route("/bare", get(|| async { StatusCode::BAD_REQUEST })),
    );
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let gateway = Gateway::start(&url, &format!("http://{upstream}"), dir.path(), &[]).await;
    let address = gateway.base.strip_prefix("http://").unwrap().to_owned();
    assert_unreadable_heads_answered(&address).await;

    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let delete = client
        .delete(format!("{}/healthz", gateway.base))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(delete.headers()["allow"], "GET,HEAD");
    let problem: Value = delete.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:method-not-allowed");

    let bare = client
        .get(format!("{}/bare", gateway.base))
        .bearer_auth(TOKEN1)
        .send()
        .await
        .unwrap();
    assert_eq!(
        bare.status(),
        StatusCode::BAD_REQUEST,
        "{}",
        gateway.log_text()
    );
    assert!(bare.headers().get("content-type").is_none(), "{bare:?}");
    assert!(
        bare.bytes().await.unwrap().is_empty(),
        "the upstream's answer was replaced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_answers_an_unknown_path_or_method_with_problem_json() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    common::idemkey_cli(vec!["migrate".into(), "--database-url".into(), url.clone()]).await;
    let mut relay = std::process::Command::new(env!("CARGO_BIN_EXE_idemkey"));
    relay
        .args(["relay", "--database-url", &url, "--listen", "127.0.0.1:0"])
        .args(["--outbox-webhook", "http://127.0.0.1:9/hook"])
        .env_remove("IDEMKEY_DATABASE_URL")
        .stderr(std::process::Stdio::null());
    let (_relay, metrics) =
        common::spawn_announcing(relay, "idemkey relay serving its metrics on ").await;
    let metrics = metrics.expect("the relay prints its address");
    let base = metrics.trim_end_matches("/metrics");

    let api = Api::new(base);
    api.get("/nothing", None)
        .await
        .assert_problem(404, "route-not-found");
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = client.post(&metrics).send().await.unwrap();
    assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(post.headers()["allow"], "GET,HEAD");
    let problem: Value = post.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:method-not-allowed");
}
