//! `idemkey gateway` in front of upstreams that break HTTP/1.1's pairing of answers with
//! requests (a raw `TcpListener` on loopback that writes what it likes), with two tenants,
//! and requests it must refuse or forward whole.
//!
//! - An upstream that writes an answer once too often on a kept connection: no tenant ever
//!   gets, or has stored, an answer to another tenant's request.
//! - A reconcile endpoint that does the same: no tenant's operation is settled with the
//!   answer about another's.
//! - An upstream that answers before it has read the whole request: the answer is not
//!   stored; the operation is left indeterminate (504 `upstream-outcome-unknown`, then 409
//!   `outcome-unknown`).
//! - `CONNECT`, which a reverse proxy cannot carry: 405 `method-not-allowed` with `Allow`,
//!   nothing forwarded, keyed route or not.
//! - A `GET` with a chunked body: forwarded with its body.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use common::gateway::{Gateway, serve_on_own_thread};

/// How the raw upstream breaks the protocol.
#[derive(Debug, Clone, Copy)]
enum Misbehaviour {
    /// On a connection, before its answer to a request, writes its answer to the previous
    /// request once more: a framework that wrote a response twice, the second copy read
    /// only once the next request was written.
    RepeatsTheLastAnswer,
    /// Answers a request as soon as it has read its head, without reading its body, and
    /// holds the connection until released.
    AnswersBeforeTheBody,
    /// Closes the connection on a `POST` once read, without an answer (its outcome is
    /// unknown); answers a `GET` (the reconciler's) as [`Self::RepeatsTheLastAnswer`] does.
    LosesWritesRepeatsLookups,
}

/// A raw HTTP/1.1 upstream on loopback. Its answer to a request is 201 with JSON naming the
/// request's `Authorization` (the gateway forwards it: it tells the tenant), its
/// `Idemkey-Tenant` (the reconciler's), its `Idempotency-Key` and the connection it came on.
struct RawUpstream {
    base: String,
    /// Requests that reached it.
    requests: Arc<AtomicUsize>,
    /// Releases the connections held by [`Misbehaviour::AnswersBeforeTheBody`].
    release: Arc<Notify>,
}

impl RawUpstream {
    async fn start(misbehaviour: Misbehaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        let requests = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let (counted, held) = (requests.clone(), release.clone());
        tokio::spawn(async move {
            for connection in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (counted, held) = (counted.clone(), held.clone());
                tokio::spawn(serve(stream, connection, misbehaviour, counted, held));
            }
        });
        Self {
            base,
            requests,
            release,
        }
    }
}

/// One request's head: its method, and its header fields with lower-cased names.
struct Head {
    method: String,
    fields: Vec<(String, String)>,
}

impl Head {
    fn get(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request head from `stream` (after what `buffered` holds); answers it and what
/// was read past it, or `None` at the end of the connection.
async fn read_head(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<Head> {
    loop {
        if let Some(end) = buffered.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffered[..end]).into_owned();
            buffered.drain(..end + 4);
            let method = head.split(' ').next().unwrap_or_default().to_owned();
            let fields = head
                .lines()
                .skip(1)
                .filter_map(|line| line.split_once(':'))
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
                .collect();
            return Some(Head { method, fields });
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffered.extend_from_slice(&chunk[..n]),
        }
    }
}

fn answer(head: &Head, connection: usize) -> Vec<u8> {
    let body = json!({
        "authorization": head.get("authorization"),
        "tenant": head.get("idemkey-tenant"),
        "key": head.get("idempotency-key"),
        "connection": connection,
    })
    .to_string();
    format!(
        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn serve(
    mut stream: TcpStream,
    connection: usize,
    misbehaviour: Misbehaviour,
    requests: Arc<AtomicUsize>,
    release: Arc<Notify>,
) {
    let mut buffered = Vec::new();
    let mut last: Option<Vec<u8>> = None;
    while let Some(head) = read_head(&mut stream, &mut buffered).await {
        requests.fetch_add(1, Ordering::SeqCst);
        let this = answer(&head, connection);
        if let Misbehaviour::AnswersBeforeTheBody = misbehaviour {
            if stream.write_all(&this).await.is_ok() {
                release.notified().await;
            }
            return;
        }
        let length: usize = head
            .get("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        while buffered.len() < length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffered.extend_from_slice(&chunk[..n]),
            }
        }
        buffered.drain(..length);
        if let Misbehaviour::LosesWritesRepeatsLookups = misbehaviour
            && head.method == "POST"
        {
            return;
        }
        let mut out = last.take().unwrap_or_default();
        out.extend_from_slice(&this);
        if stream.write_all(&out).await.is_err() {
            return;
        }
        last = Some(this);
    }
}

/// Tenant `t1`'s and `t2`'s tokens.
const TENANTS: [&str; 2] = ["tok1", "tok2"];

async fn gateway(upstream: &str, dir: &tempfile::TempDir, extra: &[&str]) -> Gateway {
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let flags = [
        &[
            "--api-key",
            "t1=tok1",
            "--api-key",
            "t2=tok2",
            // Kept connections stay fresh for the whole test, however slow the machine.
            "--upstream-idle-timeout",
            "60s",
        ][..],
        extra,
    ]
    .concat();
    Gateway::start_with(&url, upstream, dir.path(), &flags).await
}

/// An answer of the gateway.
struct Answer {
    status: u16,
    body: Value,
}

async fn post(gateway: &Gateway, token: &str, key: &str, body: Vec<u8>) -> Answer {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/transfers", gateway.base))
        .bearer_auth(token)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("the gateway answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    Answer { status, body }
}

/// Asserts that `answer` is a 201 to a request of `token`'s tenant.
fn assert_tenants(answer: &Answer, token: &str, what: &str) {
    assert_eq!(answer.status, 201, "{what}: {}", answer.body);
    assert_eq!(
        answer.body["authorization"],
        format!("Bearer {token}"),
        "{what}: an answer to another tenant's request: {}",
        answer.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extra_answer_never_reaches_another_tenant() {
    let upstream = RawUpstream::start(Misbehaviour::RepeatsTheLastAnswer).await;
    let dir = tempfile::tempdir().expect("temporary directory");
    let gateway = gateway(&upstream.base, &dir, &[]).await;
    let [one, two] = TENANTS;
    // Tenant 1's request leaves a connection whose next answer is tenant 1's again.
    let first = post(&gateway, one, "k1", b"{}".to_vec()).await;
    assert_tenants(&first, one, "tenant 1, first request");
    assert_eq!(first.body["key"], "k1");
    // Tenant 2 never gets it, now or replayed.
    let other = post(&gateway, two, "k2", b"{}".to_vec()).await;
    assert_tenants(&other, two, "tenant 2, right after");
    assert_eq!(other.body["key"], "k2", "{}", other.body);
    let replayed = post(&gateway, two, "k2", b"{}".to_vec()).await;
    assert_tenants(&replayed, two, "tenant 2's answer replayed");
    assert_eq!(replayed.body, other.body);
    // Nor tenant 1 tenant 2's; whatever each got first is what each has stored.
    for (token, key) in [(one, "k3"), (two, "k4"), (one, "k5"), (two, "k6")] {
        let answer = post(&gateway, token, key, b"{}".to_vec()).await;
        assert_tenants(&answer, token, key);
        let replayed = post(&gateway, token, key, b"{}".to_vec()).await;
        assert_tenants(&replayed, token, &format!("{key} replayed"));
        assert_eq!(replayed.body, answer.body, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_whole_request_is_not_stored() {
    let upstream = RawUpstream::start(Misbehaviour::AnswersBeforeTheBody).await;
    let dir = tempfile::tempdir().expect("temporary directory");
    let gateway = gateway(&upstream.base, &dir, &["--max-request-body", "64MiB"]).await;
    // Far more than the sockets' buffers hold: the gateway is still writing it when the
    // answer comes.
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(32 << 20)).into_bytes();
    let early = post(&gateway, TENANTS[0], "big", body.clone()).await;
    upstream.release.notify_waiters();
    assert_eq!(early.status, 504, "{}", early.body);
    assert_eq!(
        early.body["type"], "urn:idemkey:problem:upstream-outcome-unknown",
        "{}",
        early.body
    );
    let retried = post(&gateway, TENANTS[0], "big", body).await;
    assert_eq!(retried.status, 409, "{}", retried.body);
    assert_eq!(
        retried.body["type"], "urn:idemkey:problem:outcome-unknown",
        "{}",
        retried.body
    );
    assert_eq!(upstream.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extra_lookup_answer_never_settles_another_tenants_operation() {
    let upstream = RawUpstream::start(Misbehaviour::LosesWritesRepeatsLookups).await;
    let dir = tempfile::tempdir().expect("temporary directory");
    let lookup = format!("{}/v1/lookup?key={{key}}", upstream.base);
    let reconciling = ["--reconcile-url", &lookup, "--reconcile-interval", "100ms"];
    let gateway = gateway(&upstream.base, &dir, &reconciling).await;
    let tenants = [("tok1", "t1", "u1"), ("tok2", "t2", "u2")];
    for (token, _, key) in tenants {
        let lost = post(&gateway, token, key, b"{}".to_vec()).await;
        assert_eq!(lost.status, 504, "{key}: {}", lost.body);
    }
    // A bounded poll until the reconciler has settled both.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for (token, tenant, key) in tenants {
        let settled = loop {
            let answer = post(&gateway, token, key, b"{}".to_vec()).await;
            if answer.status != 409 {
                break answer;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{key} never settled: {}",
                answer.body
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(settled.status, 201, "{key}: {}", settled.body);
        assert_eq!(
            settled.body["tenant"], tenant,
            "{key} settled with another tenant's answer: {}",
            settled.body
        );
    }
}

/// What the echoing upstream saw: method and body of each request.
type Seen = Arc<Mutex<Vec<(Method, Bytes)>>>;

/// An upstream that answers 200 with the request's body, and notes each request.
fn echo_upstream() -> (String, Seen) {
    let seen = Seen::default();
    let noted = seen.clone();
    let app = Router::new().fallback(move |method: Method, body: Bytes| {
        let noted = noted.clone();
        async move {
            noted.lock().unwrap().push((method, body.clone()));
            body
        }
    });
    (format!("http://{}", serve_on_own_thread(app)), seen)
}

/// Writes `request` to the gateway raw, on a connection of its own that it closes after
/// the answer; answers the whole answer as text.
async fn raw(gateway: &Gateway, request: &str) -> String {
    let address = gateway.base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("the gateway answers")
        .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_not_forwarded() {
    let (upstream, seen) = echo_upstream();
    let dir = tempfile::tempdir().expect("temporary directory");
    // Every method on every path is keyed (required), or keyless requests are plain: both
    // refuse.
    for route in [
        &["--route", "* *"][..],
        &["--optional-route", "* *"][..],
        &[],
    ] {
        let gateway = gateway(&upstream, &dir, route).await;
        for key in ["", "idempotency-key: c1\r\n"] {
            let answer = raw(
                &gateway,
                &format!(
                    "CONNECT 127.0.0.1:9 HTTP/1.1\r\nhost: 127.0.0.1:9\r\n\
                     authorization: Bearer tok1\r\n{key}connection: close\r\n\r\n"
                ),
            )
            .await;
            let lower = answer.to_ascii_lowercase();
            assert!(answer.starts_with("HTTP/1.1 405 "), "{route:?}: {answer}");
            assert!(
                lower.contains("content-type: application/problem+json"),
                "{answer}"
            );
            assert!(
                lower.contains("allow: get, head, options, post, put, patch, delete\r\n"),
                "{answer}"
            );
            assert!(
                answer.contains("urn:idemkey:problem:method-not-allowed"),
                "{answer}"
            );
        }
    }
    assert!(seen.lock().unwrap().is_empty(), "CONNECT was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_chunked_body_is_forwarded_with_it() {
    let (upstream, seen) = echo_upstream();
    let dir = tempfile::tempdir().expect("temporary directory");
    let gateway = gateway(&upstream, &dir, &[]).await;
    let answer = raw(
        &gateway,
        "GET /v1/search HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer tok1\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         6\r\n{\"q\":1\r\n1\r\n}\r\n0\r\n\r\n",
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 200 "),
        "{answer}\n{}",
        gateway.log_text()
    );
    let seen = seen.lock().unwrap();
    assert_eq!(
        *seen,
        [(Method::GET, Bytes::from_static(b"{\"q\":1}"))],
        "{answer}"
    );
}
