//! Scripted servers on 127.0.0.1 that record every attempt.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idemkey_client::{Clock, Sleep, Timestamp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One scripted answer.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    expires_in: Option<Duration>,
}

pub(crate) fn reply(status: u16) -> Reply {
    Reply {
        status,
        headers: Vec::new(),
        body: String::new(),
        expires_in: None,
    }
}

impl Reply {
    pub(crate) fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub(crate) fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    /// A problem+json body of the given type.
    pub(crate) fn problem(self, problem_type: &str) -> Self {
        let body = serde_json::json!({
            "type": problem_type,
            "title": "scripted problem",
            "status": self.status,
            "detail": format!("scripted {problem_type}"),
        });
        self.header("content-type", "application/problem+json")
            .body(body.to_string())
    }

    /// `Idempotency-Key-Expires` this far after the moment the answer is sent.
    pub(crate) fn expires_in(mut self, after: Duration) -> Self {
        self.expires_in = Some(after);
        self
    }
}

/// What the server saw of one attempt.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) method: String,
    pub(crate) key: Option<String>,
    pub(crate) keys: usize,
    pub(crate) body: Bytes,
}

#[derive(Clone)]
struct Scripted {
    script: Arc<Vec<Reply>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// A server answering attempt *n* with `script[n]` (the last reply repeats).
pub(crate) struct ScriptedServer {
    pub(crate) url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl ScriptedServer {
    pub(crate) async fn start(script: Vec<Reply>) -> Self {
        assert!(!script.is_empty());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let state = Scripted {
            script: Arc::new(script),
            seen: seen.clone(),
        };
        let app = axum::Router::new().fallback(answer).with_state(state);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url, seen }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub(crate) fn keys(&self) -> Vec<Option<String>> {
        self.seen().into_iter().map(|s| s.key).collect()
    }
}

async fn answer(
    State(state): State<Scripted>,
    method: axum::http::Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let values: Vec<String> = headers
        .get_all("idempotency-key")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let index = {
        let mut seen = state.seen.lock().unwrap();
        seen.push(Seen {
            method: method.to_string(),
            key: values.first().cloned(),
            keys: values.len(),
            body,
        });
        seen.len() - 1
    };
    let reply = &state.script[index.min(state.script.len() - 1)];
    let mut response = (
        StatusCode::from_u16(reply.status).unwrap(),
        reply.body.clone(),
    )
        .into_response();
    let h = response.headers_mut();
    for (name, value) in &reply.headers {
        h.insert(
            HeaderName::from_static(name),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    if let Some(after) = reply.expires_in {
        let at = httpdate::fmt_http_date(SystemTime::now() + after);
        h.insert(
            "idempotency-key-expires",
            HeaderValue::from_str(&at).unwrap(),
        );
    }
    response
}

/// A raw server that reads each request and, for the first `drops` connections, closes the
/// socket without answering; then answers `201 created`. Returns its URL and the key each
/// connection carried.
pub(crate) async fn flaky_server(drops: usize) -> (String, Arc<Mutex<Vec<Option<String>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let log = keys.clone();
    tokio::spawn(async move {
        let mut connections = 0;
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let head = read_request(&mut socket).await;
            log.lock()
                .unwrap()
                .push(header_of(&head, "idempotency-key"));
            connections += 1;
            if connections <= drops {
                drop(socket);
                continue;
            }
            let _ = socket
                .write_all(
                    b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\nconnection: close\r\n\r\ncreated",
                )
                .await;
            let _ = socket.shutdown().await;
        }
    });
    (url, keys)
}

/// Reads one request (head and `content-length` body); returns the head.
async fn read_request(socket: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let length: usize = header_of(&head, "content-length")
                .map(|v| v.parse().unwrap())
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                let n = socket.read(&mut chunk).await.unwrap();
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return head;
        }
        let n = socket.read(&mut chunk).await.unwrap();
        if n == 0 {
            return String::from_utf8_lossy(&buf).into_owned();
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn header_of(head: &str, name: &str) -> Option<String> {
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// A client that never goes through a proxy.
pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// A fast policy for scripted tests.
pub(crate) fn fast() -> idemkey_client::RetryPolicy {
    idemkey_client::RetryPolicy::new()
        .with_initial_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(50))
}

/// A clock whose waits take no time: `sleep` moves its time forward by the delay, records the
/// delay and returns at once.
#[derive(Debug)]
pub(crate) struct ManualClock {
    state: Mutex<ManualState>,
}

#[derive(Debug)]
struct ManualState {
    now: SystemTime,
    sleeps: Vec<Duration>,
}

impl ManualClock {
    /// Starts at the current time rounded down to the second (the scripted servers date their
    /// `Idempotency-Key-Expires` on the system clock; HTTP-dates made from it are exact).
    pub(crate) fn new() -> Arc<Self> {
        let since_epoch = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(since_epoch.as_secs());
        Arc::new(Self {
            state: Mutex::new(ManualState {
                now,
                sleeps: Vec::new(),
            }),
        })
    }

    /// Every delay the client waited, in order.
    pub(crate) fn sleeps(&self) -> Vec<Duration> {
        self.state.lock().unwrap().sleeps.clone()
    }

    /// The clock's time, as the client's API states times.
    pub(crate) fn time(&self) -> SystemTime {
        self.state.lock().unwrap().now
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        let since_epoch = self.time().duration_since(SystemTime::UNIX_EPOCH).unwrap();
        Timestamp(since_epoch.as_millis() as i64)
    }

    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        let mut state = self.state.lock().unwrap();
        state.now += duration;
        state.sleeps.push(duration);
        Box::pin(std::future::ready(()))
    }
}
