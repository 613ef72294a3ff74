//! The layer with a compressing middleware (tower-http's `CompressionLayer`, gzip and br)
//! inside it, between the layer and the handler, and outside it. Whatever a retry's
//! `Accept-Encoding`, its replay decodes to what the first answer decoded to, in a coding
//! the retry accepts (or none), and the handler ran once.

use std::time::Duration;

use async_compression::tokio::bufread::{BrotliDecoder, GzipDecoder};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::{HeaderMap, Request, StatusCode, header};
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, KeyRequirement, REPLAYED_HEADER, Tx};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::AsyncReadExt;
use tower::ServiceExt;
use tower_http::compression::CompressionLayer;

const ROUTE: &str = "/effects";

async fn setup() -> (TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("test.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id INTEGER PRIMARY KEY AUTOINCREMENT)")
        .execute(store.pool())
        .await
        .unwrap();
    (dir, store)
}

fn layer(store: &SqliteStore) -> IdempotencyLayer<SqliteStore> {
    let hasher = KeyHasher::new(b"a key secret of thirty-two bytes or more");
    IdempotencyLayer::new(store.clone(), hasher).requirement(KeyRequirement::Required)
}

/// Writes one effect row and answers a JSON document large enough to be compressed, naming
/// the row (a second execution would show), with a strong `ETag` of its own.
async fn create(mut tx: Tx<SqliteStore>) -> Response {
    let id = sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap()
        .last_insert_rowid();
    let items: Vec<Value> = (0..50).map(|i| json!({"line": i, "sku": "abc"})).collect();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ETAG, format!("\"effect-{id}\""))
        .body(Body::from(
            json!({ "effect": id, "items": items }).to_string(),
        ))
        .unwrap()
}

/// Compression between the layer and the handler: the layer sees compressed answers.
fn compression_inside(store: &SqliteStore) -> Router {
    Router::new().route(
        ROUTE,
        post(create)
            .layer(CompressionLayer::new())
            .layer(layer(store)),
    )
}

/// Compression around the layer: it compresses every answer the layer gives, replays too.
fn compression_outside(store: &SqliteStore) -> Router {
    Router::new()
        .route(ROUTE, post(create).layer(layer(store)))
        .layer(CompressionLayer::new())
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: impl header::AsHeaderName) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// The body decoded as its `Content-Encoding` says, as JSON.
    async fn decoded(&self) -> Value {
        let mut plain = Vec::new();
        let body = &self.body[..];
        match self.header(header::CONTENT_ENCODING) {
            None => plain.extend_from_slice(body),
            Some("gzip") => {
                GzipDecoder::new(body)
                    .read_to_end(&mut plain)
                    .await
                    .unwrap();
            }
            Some("br") => {
                BrotliDecoder::new(body)
                    .read_to_end(&mut plain)
                    .await
                    .unwrap();
            }
            Some(other) => panic!("unexpected coding {other}"),
        }
        serde_json::from_slice(&plain).unwrap_or_else(|e| {
            panic!("the body does not decode to JSON ({e}): {:?}", self.headers)
        })
    }
}

async fn send(app: &Router, key: &str, accept_encoding: Option<&str>) -> Answer {
    let mut req = Request::post(ROUTE)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key);
    if let Some(accept) = accept_encoding {
        req = req.header(header::ACCEPT_ENCODING, accept);
    }
    let response = app
        .clone()
        .oneshot(req.body(Body::from(r#"{"order":1}"#)).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = tokio::time::timeout(
        Duration::from_secs(10),
        axum::body::to_bytes(body, usize::MAX),
    )
    .await
    .expect("the body ends")
    .unwrap();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

async fn effects(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// What a request with `accept` may be answered in.
fn takes(accept: Option<&str>, coding: Option<&str>) -> bool {
    match coding {
        None => true,
        Some(coding) => accept.is_some_and(|a| a.split(',').any(|c| c.trim() == coding)),
    }
}

/// For each first attempt's `Accept-Encoding`, a key: the first answer, then retries with
/// every `Accept-Encoding`, each a replay in a coding it accepts that decodes to the first
/// answer's JSON. With compression `inside` the layer, a replay carries the stored strong
/// `ETag` exactly when it carries the stored coding.
async fn replays_decode_to_the_first_answer(app: Router, store: &SqliteStore, inside: bool) {
    let accepts = [Some("gzip"), Some("br"), Some("gzip, br"), None];
    for (n, first_accept) in accepts.iter().enumerate() {
        let key = format!("k-{n}");
        let first = send(&app, &key, *first_accept).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let coding = first.header(header::CONTENT_ENCODING).map(str::to_owned);
        if first_accept.is_some() {
            assert!(
                coding.is_some(),
                "the middleware compresses: {first_accept:?}"
            );
        }
        let original = first.decoded().await;
        for retry_accept in accepts {
            let replay = send(&app, &key, retry_accept).await;
            let what = format!("first {first_accept:?}, retry {retry_accept:?}");
            assert_eq!(replay.status, StatusCode::CREATED, "{what}");
            assert_eq!(replay.header(REPLAYED_HEADER), Some("true"), "{what}");
            let replay_coding = replay.header(header::CONTENT_ENCODING);
            assert!(
                takes(retry_accept, replay_coding),
                "{what}: sent in {replay_coding:?}"
            );
            assert_eq!(replay.decoded().await, original, "{what}");
            if inside {
                // Stored as the middleware sent it: a retry that takes that coding gets it
                // with its strong `ETag`; any other gets it decoded, without that `ETag`.
                let same_coding = replay_coding == coding.as_deref();
                assert_eq!(
                    same_coding,
                    takes(retry_accept, coding.as_deref()),
                    "{what}"
                );
                if same_coding {
                    assert_eq!(replay.body, first.body, "{what}: byte for byte");
                    assert_eq!(
                        replay.headers.get(header::ETAG),
                        first.headers.get(header::ETAG)
                    );
                } else {
                    assert_eq!(replay.headers.get(header::ETAG), None, "{what}");
                }
            }
        }
        assert_eq!(effects(store).await, n as i64 + 1, "one effect per key");
    }
}

#[tokio::test]
async fn replays_decode_to_the_first_answer_with_compression_inside() {
    let (_dir, store) = setup().await;
    replays_decode_to_the_first_answer(compression_inside(&store), &store, true).await;
}

#[tokio::test]
async fn replays_decode_to_the_first_answer_with_compression_outside() {
    let (_dir, store) = setup().await;
    replays_decode_to_the_first_answer(compression_outside(&store), &store, false).await;
}
