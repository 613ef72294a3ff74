//! Content codings the layer meets in the wild, in answers and in requests.
//!
//! Answers: a handler's body in `Content-Encoding: deflate` with or without the zlib wrapper,
//! a truncated gzip body, and a gzip body that decodes past the bound. A retry that does not
//! take the stored coding gets the body decoded when it decodes, and otherwise the whole
//! stored body with its `Content-Encoding`, never a cut stream; a body that does not decode
//! is counted in `idemkey_undecodable_responses_total`.
//!
//! Requests: the fingerprint is of the decoded body, so a client that compresses its retry
//! anew (another gzip header) gets a replay; a body in a coding the layer does not know is
//! 415 `encoding-unsupported`, one that does not decode 400 `request-undecodable`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_compression::tokio::bufread::{DeflateEncoder, GzipEncoder, ZlibEncoder};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::{HeaderMap, Request, StatusCode, header};
use idemkey_core::KeyHasher;
use idemkey_core::{IdempotencyKey, Scope};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, KeyRequirement, Metrics, REPLAYED_HEADER, Tenant};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::AsyncReadExt;
use tower::ServiceExt;

/// The stored-answer limit of the layer here: a stored body may decode to 16 times it.
const MAX_STORED: usize = 64 * 1024;

/// The layer's key secret here.
const SECRET: &[u8] = b"a key secret of 32 bytes or more";

/// A JSON document of some size, the same each time.
fn document() -> Vec<u8> {
    let items: Vec<Value> = (0..200).map(|i| json!({"line": i, "sku": "abc"})).collect();
    json!({ "order": 1, "items": items })
        .to_string()
        .into_bytes()
}

async fn gzip(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    GzipEncoder::new(plain).read_to_end(&mut out).await.unwrap();
    out
}

async fn zlib(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    ZlibEncoder::new(plain).read_to_end(&mut out).await.unwrap();
    out
}

async fn raw_deflate(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    DeflateEncoder::new(plain)
        .read_to_end(&mut out)
        .await
        .unwrap();
    out
}

/// `plain` in gzip with `mtime` in its header: the same content, other bytes.
async fn gzip_at(plain: &[u8], mtime: u32) -> Vec<u8> {
    let mut out = gzip(plain).await;
    // RFC 1952: MTIME is bytes 4 to 7; without FHCRC nothing else covers them.
    out[4..8].copy_from_slice(&mtime.to_le_bytes());
    out
}

struct App {
    _dir: TempDir,
    router: Router,
    metrics: Metrics,
    /// How many times the handler ran.
    runs: Arc<AtomicUsize>,
}

/// A route answering 201 with `body` in `coding`, whatever the request, counting its runs.
async fn app(coding: &'static str, body: Vec<u8>) -> App {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("test.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let metrics = Metrics::new();
    let layer = IdempotencyLayer::new(store, KeyHasher::new(SECRET))
        .requirement(KeyRequirement::Required)
        .max_stored_response(MAX_STORED)
        .metrics(metrics.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let body = Bytes::from(body);
    let handler = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            let body = body.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::CONTENT_ENCODING, coding)
                    .header(header::ETAG, "\"e1\"")
                    .body(Body::from(body))
                    .unwrap()
            }
        }
    };
    let router = Router::new().route("/orders", post(handler).layer(layer));
    App {
        _dir: dir,
        router,
        metrics,
        runs,
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    /// The body as far as it came, and whether it ended without an error.
    body: Vec<u8>,
    whole: bool,
}

impl Answer {
    fn header(&self, name: header::HeaderName) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn problem_type(&self) -> String {
        let problem: Value = serde_json::from_slice(&self.body).unwrap();
        problem["type"].as_str().unwrap().to_owned()
    }
}

/// `POST /orders` with `key`, `Accept-Encoding: accept` when given, and `body` in
/// `Content-Encoding: coding` when given.
async fn send(
    app: &App,
    key: &str,
    accept: Option<&str>,
    coding: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let mut req = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key);
    if let Some(accept) = accept {
        req = req.header(header::ACCEPT_ENCODING, accept);
    }
    if let Some(coding) = coding {
        req = req.header(header::CONTENT_ENCODING, coding);
    }
    let response = app
        .router
        .clone()
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let (parts, mut body) = response.into_parts();
    let mut read = Vec::new();
    let mut whole = true;
    let reading = async {
        use http_body_util::BodyExt;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        read.extend_from_slice(&data);
                    }
                }
                Err(_) => {
                    whole = false;
                    break;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), reading)
        .await
        .expect("the body ends");
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: read,
        whole,
    }
}

fn undecodable(metrics: &Metrics) -> bool {
    metrics
        .render()
        .contains("idemkey_undecodable_responses_total 1\n")
}

/// The first attempt takes the coding and gets the stored bytes; a retry that does not take
/// it gets the document decoded, without the coding, its length or the strong `ETag`.
async fn decodes_for_a_retry(coding: &'static str, encoded: Vec<u8>) {
    let app = app(coding, encoded.clone()).await;
    let first = send(&app, "k", Some(coding), None, b"{}".to_vec()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, encoded);
    for accept in [None, Some("identity"), Some("br")] {
        let retry = send(&app, "k", accept, None, b"{}".to_vec()).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{accept:?}");
        assert_eq!(retry.header(REPLAYED_HEADER.parse().unwrap()), Some("true"));
        assert!(retry.whole, "{coding}, {accept:?}: the stream was cut");
        assert_eq!(retry.header(header::CONTENT_ENCODING), None, "{accept:?}");
        assert_eq!(retry.header(header::ETAG), None, "{accept:?}");
        assert_eq!(retry.body, document(), "{coding}, {accept:?}");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert!(!undecodable(&app.metrics), "{}", app.metrics.render());
}

#[tokio::test]
async fn replays_zlib_deflate_decoded() {
    decodes_for_a_retry("deflate", zlib(&document()).await).await;
}

#[tokio::test]
async fn replays_raw_deflate_decoded() {
    decodes_for_a_retry("deflate", raw_deflate(&document()).await).await;
}

#[tokio::test]
async fn replays_codings_applied_in_turn_decoded() {
    // `deflate, gzip`: raw DEFLATE first, then gzip over it.
    let encoded = gzip(&raw_deflate(&document()).await).await;
    decodes_for_a_retry("deflate, gzip", encoded).await;
}

/// A stored body that does not decode is replayed whole, as stored, with its coding, to a
/// retry that does not take it too; it is counted once, when it is stored.
async fn replays_as_stored(coding: &'static str, encoded: Vec<u8>) {
    let app = app(coding, encoded.clone()).await;
    let first = send(&app, "k", Some(coding), None, b"{}".to_vec()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, encoded);
    assert!(undecodable(&app.metrics), "{}", app.metrics.render());
    for accept in [None, Some("br"), Some(coding)] {
        let retry = send(&app, "k", accept, None, b"{}".to_vec()).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{accept:?}");
        assert!(retry.whole, "{accept:?}: the stream was cut");
        assert_eq!(retry.header(header::CONTENT_ENCODING), Some(coding));
        assert_eq!(retry.header(header::ETAG), Some("\"e1\""));
        assert_eq!(retry.body, encoded, "{accept:?}: the stored bytes, whole");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert!(undecodable(&app.metrics), "{}", app.metrics.render());
}

#[tokio::test]
async fn replays_a_truncated_gzip_body_as_stored() {
    let mut encoded = gzip(&document()).await;
    encoded.truncate(encoded.len() / 2);
    replays_as_stored("gzip", encoded).await;
}

#[tokio::test]
async fn replays_a_corrupt_deflate_body_as_stored() {
    replays_as_stored("deflate", b"not deflate at all".to_vec()).await;
}

#[tokio::test]
async fn replays_a_body_that_decodes_past_the_bound_as_stored() {
    // A few hundred bytes that decode to more than 16 times the stored-answer limit.
    let bomb = gzip(&vec![b' '; 16 * MAX_STORED + 1]).await;
    assert!(bomb.len() < MAX_STORED / 16);
    replays_as_stored("gzip", bomb).await;
}

/// A route answering 201 to the same JSON in any coding: a key's retry compressed anew is a
/// replay; another JSON under the key is 422.
#[tokio::test]
async fn fingerprints_a_compressed_request_by_its_content() {
    let app = app("identity", b"{\"ok\":true}".to_vec()).await;
    let order = br#"{"order":1,"sku":"abc"}"#;
    let first = send(&app, "k", None, Some("gzip"), gzip_at(order, 1).await).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = gzip_at(order, 2).await;
    assert_ne!(again, gzip_at(order, 1).await);
    let retry = send(&app, "k", None, Some("gzip"), again).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(retry.header(REPLAYED_HEADER.parse().unwrap()), Some("true"));
    // The same content in no coding, or in deflate, is the same request too.
    let plain = send(&app, "k", None, None, order.to_vec()).await;
    assert_eq!(plain.status, StatusCode::CREATED);
    let deflated = send(&app, "k", None, Some("deflate"), raw_deflate(order).await).await;
    assert_eq!(deflated.status, StatusCode::CREATED);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);

    let other = gzip_at(br#"{"order":2,"sku":"abc"}"#, 1).await;
    let reused = send(&app, "k", None, Some("gzip"), other).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.problem_type(), "urn:idemkey:problem:key-reused");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn refuses_a_request_body_in_an_unknown_coding() {
    let app = app("identity", b"{}".to_vec()).await;
    let answer = send(&app, "k", None, Some("compress"), b"\x1f\x9d".to_vec()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        answer.header(header::CONTENT_TYPE),
        Some("application/problem+json")
    );
    assert_eq!(
        answer.problem_type(),
        "urn:idemkey:problem:encoding-unsupported"
    );
    assert_eq!(
        answer.header(header::ACCEPT_ENCODING),
        Some("gzip, deflate, br, zstd")
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn refuses_a_request_body_that_does_not_decode() {
    let app = app("identity", b"{}".to_vec()).await;
    let mut truncated = gzip(br#"{"order":1}"#).await;
    truncated.truncate(truncated.len() - 4);
    for body in [truncated, b"not gzip".to_vec()] {
        let answer = send(&app, "k", None, Some("gzip"), body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            answer.problem_type(),
            "urn:idemkey:problem:request-undecodable"
        );
    }
    // Past the bound (16 times the request limit): too large, as a plain body would be.
    let bomb = gzip(&vec![b' '; 16 * 1024 * 1024 + 1]).await;
    let answer = send(&app, "k", None, Some("gzip"), bomb).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        answer.problem_type(),
        "urn:idemkey:problem:request-too-large"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
}

/// Collects what the log subscriber writes.
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// A stored body that does not decode is a warning, when stored and when replayed as stored,
/// in the request's span: the key's scope by its derived id and the route, never the raw key.
#[tokio::test]
async fn warns_with_the_key_scope_when_a_stored_body_does_not_decode() {
    let mut truncated = gzip(&document()).await;
    truncated.truncate(truncated.len() / 2);
    let app = app("gzip", truncated).await;
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let raw = "order-4711-customer-alice";
    let first = send(&app, raw, Some("gzip"), None, b"{}".to_vec()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let stored = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let retry = send(&app, raw, None, None, b"{}".to_vec()).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    let all = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let replayed = &all[stored.len()..];

    let key = IdempotencyKey::parse(raw.as_bytes()).unwrap();
    let key_id = KeyHasher::new(SECRET)
        .record_id(&Scope::new(Tenant::DEFAULT, "POST", "/orders"), &key)
        .key_id();
    for (when, logs) in [("stored", &stored[..]), ("replayed", replayed)] {
        let line = logs
            .lines()
            .find(|l| l.contains("does not decode as its Content-Encoding says"))
            .unwrap_or_else(|| panic!("{when}: no warning in {logs:?}"));
        assert!(line.contains(" WARN "), "{when}: {line}");
        assert!(line.contains(&format!("key_id={key_id}")), "{when}: {line}");
        assert!(line.contains("route=POST /orders"), "{when}: {line}");
        assert!(line.contains("gzip"), "{when}: names the coding: {line}");
    }
    assert!(!all.contains(raw), "the raw key is never logged: {all}");
}
