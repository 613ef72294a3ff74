//! The replay cache: completed records answered from memory, exactly as from the store, and
//! never past their expiry or (on a store without eviction notices) past the bound.

mod support;
use support::ManualClock;

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::{HeaderMap, Request, StatusCode, header};
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{
    EXPIRES_HEADER, IdempotencyLayer, Metrics, Outcome, REPLAY_CACHE_UNNOTIFIED_BOUND,
    REPLAYED_HEADER, Tx,
};
use serde_json::Value;
use tempfile::TempDir;
use tower::ServiceExt;

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

/// Writes one effect row and answers 201 with its id, so a replay is told apart from a
/// second execution.
async fn create(mut tx: Tx<SqliteStore>, _body: Bytes) -> Response {
    let id = sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap()
        .last_insert_rowid();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("{ROUTE}/{id}"))
        .body(Body::from(format!("{{\"effect\":{id}}}")))
        .unwrap()
}

fn app(layer: IdempotencyLayer<SqliteStore>) -> Router {
    Router::new().route(ROUTE, post(create).layer(layer))
}

fn layer(store: &SqliteStore, metrics: &Metrics) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store.clone(), KeyHasher::new(b"secret")).metrics(metrics.clone())
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get(REPLAYED_HEADER)
            .is_some_and(|v| v == "true")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn send(app: &Router, key: &str, body: &str) -> Answer {
    let req = Request::post(ROUTE)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let (parts, body) = app.clone().oneshot(req).await.unwrap().into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: axum::body::to_bytes(body, usize::MAX).await.unwrap(),
    }
}

async fn effects(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// Takes the records table away: from here on, anything that asks the store fails.
async fn break_store(store: &SqliteStore) {
    sqlx::query("ALTER TABLE idemkey_records RENAME TO idemkey_records_gone")
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn replays_from_the_cache_without_the_store() {
    let (_dir, store) = setup().await;
    let metrics = Metrics::new();
    let cached = app(layer(&store, &metrics));
    let uncached = app(layer(&store, &Metrics::new()).no_replay_cache());
    let first = send(&cached, "k1", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);

    break_store(&store).await;
    let replay = send(&cached, "k1", "{}").await;
    assert_eq!(
        replay.status,
        StatusCode::CREATED,
        "body: {:?}",
        replay.body
    );
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "byte for byte");
    assert_eq!(
        replay.headers.get(header::LOCATION),
        first.headers.get(header::LOCATION)
    );
    assert_eq!(
        replay.headers.get(EXPIRES_HEADER),
        first.headers.get(EXPIRES_HEADER)
    );
    assert_eq!(metrics.count(Outcome::Replayed), 1);
    assert_eq!(metrics.replay_cache_hits(), 1);
    assert!(
        metrics
            .render()
            .contains("idemkey_replay_cache_hits_total 1\n")
    );

    // The store really is gone: a fresh key, and the same key without a cache, get 503.
    assert_eq!(
        send(&cached, "k2", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        send(&uncached, "k1", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn a_replay_from_the_store_fills_the_cache() {
    let (_dir, store) = setup().await;
    let first = send(&app(layer(&store, &Metrics::new())), "k1", "{}").await;
    // Another instance (its own cache) replays from the store, and keeps the record.
    let metrics = Metrics::new();
    let other = app(layer(&store, &metrics));
    let from_store = send(&other, "k1", "{}").await;
    assert!(from_store.replayed());
    assert_eq!(metrics.replay_cache_hits(), 0);

    break_store(&store).await;
    let from_cache = send(&other, "k1", "{}").await;
    assert!(from_cache.replayed(), "body: {:?}", from_cache.body);
    assert_eq!(from_cache.body, first.body);
    assert_eq!(metrics.replay_cache_hits(), 1);
}

#[tokio::test]
async fn mismatch_from_the_cache_is_the_same_422() {
    let (_dir, store) = setup().await;
    let metrics = Metrics::new();
    let cached = app(layer(&store, &metrics));
    let uncached = app(layer(&store, &Metrics::new()).no_replay_cache());
    send(&cached, "k1", r#"{"amount":1,"currency":"EUR"}"#).await;
    let other = r#"{"currency":"EUR","amount":2}"#;
    let from_store = send(&uncached, "k1", other).await;
    assert_eq!(from_store.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(from_store.json()["pointer"], "/amount");

    break_store(&store).await;
    let from_cache = send(&cached, "k1", other).await;
    assert_eq!(
        from_cache.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "body: {:?}",
        from_cache.body
    );
    assert_eq!(from_cache.body, from_store.body);
    assert_eq!(from_cache.headers, from_store.headers);
    assert_eq!(metrics.count(Outcome::Mismatched), 1);
    assert_eq!(metrics.replay_cache_hits(), 1);
}

#[tokio::test]
async fn expired_entry_is_not_replayed() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let metrics = Metrics::new();
    let retention = Duration::from_secs(2);
    assert!(retention < REPLAY_CACHE_UNNOTIFIED_BOUND);
    let app = app(layer(&store, &metrics)
        .retention(retention)
        .clock(clock.clone()));
    let first = send(&app, "k1", "{}").await;
    assert!(send(&app, "k1", "{}").await.replayed());
    assert_eq!(metrics.replay_cache_hits(), 1);

    clock.advance(retention);
    let again = send(&app, "k1", "{}").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "an expired record runs again");
    assert_ne!(again.body, first.body);
    assert_eq!(effects(&store).await, 2);
    assert_eq!(metrics.replay_cache_hits(), 1);
}

/// SQLite announces an eviction by another process (`idemkey keys evict` runs in its own)
/// in a table every serving process polls: the cached answer is dropped and the next
/// request runs again, with no bound to wait out.
#[tokio::test]
async fn an_eviction_by_another_process_reaches_the_cache() {
    use idemkey_core::{ListFilter, Store, StoreAdmin};
    let (_dir, store) = setup().await;
    let metrics = Metrics::new();
    let layer = layer(&store, &metrics);
    let mut changes = layer.replay_cache_changes().expect("a cache");
    let app = app(layer);
    let first = send(&app, "k1", "{}").await;
    // The first keyed request starts following the store's announcements; they flow once
    // the cache has read where they stand.
    tokio::time::timeout(Duration::from_secs(10), changes.changed())
        .await
        .expect("the cache follows SQLite's evictions")
        .unwrap();
    let cached = send(&app, "k1", "{}").await;
    assert!(cached.replayed());
    assert_eq!(metrics.replay_cache_hits(), 1);

    // The operator's eviction, as `idemkey keys evict` makes it: delete and announce.
    let mut conn = store.acquire().await.unwrap();
    let id = store.list(&mut conn, &ListFilter::default()).await.unwrap()[0]
        .id
        .clone();
    drop(conn);
    let mut tx = store.begin().await.unwrap();
    assert!(store.evict(&mut tx, &id).await.unwrap());
    store.notify_evicted(&mut tx, &id).await.unwrap();
    store.commit(tx).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), changes.changed())
        .await
        .expect("the eviction reaches the cache")
        .unwrap();

    let again = send(&app, "k1", "{}").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "evicted: runs again");
    assert_ne!(again.body, first.body);
    assert_eq!(effects(&store).await, 2);
}

#[tokio::test]
async fn external_mode_caches_the_completed_outcome() {
    let (_dir, store) = setup().await;
    let metrics = Metrics::new();
    async fn call_out(op: idemkey_tower::External<SqliteStore>) -> (StatusCode, &'static str) {
        op.point_of_no_return().await.unwrap();
        (StatusCode::CREATED, "sent")
    }
    let app = Router::new().route(
        ROUTE,
        post(call_out).layer(layer(&store, &metrics).external(Duration::from_secs(10))),
    );
    let first = send(&app, "k1", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    break_store(&store).await;
    let replay = send(&app, "k1", "{}").await;
    assert!(replay.replayed(), "body: {:?}", replay.body);
    assert_eq!(replay.body, first.body);
    assert_eq!(metrics.replay_cache_hits(), 1);
}
