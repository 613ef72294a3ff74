//! The idempotency layer on `RusqliteStore`: an axum handler writes its effect with rusqlite
//! on the layer's transaction, on a fresh SQLite file per test.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::{Request, StatusCode, header};
use idemkey_core::KeyHasher;
use idemkey_sqlite::RusqliteStore;
use idemkey_sqlite::rusqlite::params;
use idemkey_tower::{IdempotencyLayer, KeyRequirement, PROBLEM_TYPE_PREFIX, REPLAYED_HEADER, Tx};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::Barrier;
use tower::ServiceExt;

const ROUTE: &str = "/effects";

async fn setup() -> (TempDir, RusqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = RusqliteStore::open(dir.path().join("test.db")).unwrap();
    store.migrate().await.unwrap();
    store
        .with_connection(|c| {
            c.execute_batch(
                "CREATE TABLE effects (id INTEGER PRIMARY KEY AUTOINCREMENT, status INTEGER)",
            )
        })
        .unwrap();
    (dir, store)
}

/// Writes one effect row on the claim's transaction and answers with its id; the body
/// steers the status (`{"status": 500}`) or a panic (`{"panic": true}`).
async fn create(tx: Tx<RusqliteStore>, body: Bytes) -> Response {
    let steer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let status = steer["status"].as_u64().unwrap_or(201) as u16;
    tx.execute("INSERT INTO effects (status) VALUES (?1)", params![status])
        .unwrap();
    let id = tx.last_insert_rowid();
    // The handler awaits after its effect while holding the transaction, as real ones do.
    tokio::task::yield_now().await;
    if steer["panic"].as_bool().unwrap_or(false) {
        panic!("the handler panics on request");
    }
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "effect": id }).to_string()))
        .unwrap()
}

fn app(store: &RusqliteStore) -> Router {
    let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(b"secret"))
        .requirement(KeyRequirement::Required);
    Router::new().route(ROUTE, post(create).layer(layer))
}

async fn send(app: &Router, key: &str, body: &str) -> (StatusCode, bool, Bytes) {
    let req = Request::post(ROUTE)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let replayed = response
        .headers()
        .get(REPLAYED_HEADER)
        .is_some_and(|v| v == "true");
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, body)
}

fn count(store: &RusqliteStore, table: &str) -> i64 {
    store
        .with_connection(|c| {
            c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
        })
        .unwrap()
}

#[tokio::test]
async fn the_effect_commits_with_its_record_and_is_replayed_byte_for_byte() {
    let (_dir, store) = setup().await;
    let app = app(&store);

    let (status, replayed, first) = send(&app, "k-1", r#"{"status": 201}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed);
    let (status, replayed, again) = send(&app, "k-1", r#"{"status": 201}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed);
    assert_eq!(again, first);
    assert_eq!(count(&store, "effects"), 1);
    assert_eq!(count(&store, "idemkey_records"), 1);

    let (status, _, body) = send(&app, "k-1", r#"{"status": 202}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], format!("{PROBLEM_TYPE_PREFIX}key-reused"));
    assert_eq!(count(&store, "effects"), 1);
}

#[tokio::test]
async fn a_failed_or_panicking_handler_leaves_neither_effect_nor_record() {
    let (_dir, store) = setup().await;
    let app = app(&store);

    let (status, _, _) = send(&app, "k-500", r#"{"status": 500}"#).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (status, _, _) = send(&app, "k-panic", r#"{"panic": true}"#).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count(&store, "effects"), 0);
    assert_eq!(count(&store, "idemkey_records"), 0);

    // The keys are free: the corrected retries execute.
    for key in ["k-500", "k-panic"] {
        let (status, replayed, _) = send(&app, key, r#"{"status": 201}"#).await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(!replayed);
    }
    assert_eq!(count(&store, "effects"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_attempts_of_one_key_execute_once() {
    let (_dir, store) = setup().await;
    let app = app(&store);
    let start = Arc::new(Barrier::new(32));

    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (app, start) = (app.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                send(&app, "k-race", r#"{"status": 201}"#).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }

    assert_eq!(count(&store, "effects"), 1, "executed exactly once");
    for (status, _, body) in &answers {
        assert_eq!(*status, StatusCode::CREATED, "body: {body:?}");
        assert_eq!(body, &answers[0].2);
    }
    assert_eq!(answers.iter().filter(|a| a.1).count(), 31);
}
