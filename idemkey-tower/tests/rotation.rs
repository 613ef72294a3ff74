//! Key-secret rotation, in process on a fresh SQLite file per test: records made under the
//! previous secret still answer (replay, 422, status resource) while new ones are made under
//! the current secret only.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::{Request, StatusCode, header};
use idemkey_core::{IdempotencyKey, KeyHasher, Scope, Store};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, REPLAYED_HEADER, Tx};
use serde_json::{Value, json};
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

fn secret_a() -> KeyHasher {
    KeyHasher::new(b"secret A")
}

fn secret_b() -> KeyHasher {
    KeyHasher::new(b"secret B")
}

/// Writes one effect row; answers 201 with its id, so a replay is told from a re-execution.
async fn create(mut tx: Tx<SqliteStore>, _body: Bytes) -> Response {
    let id = sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap()
        .last_insert_rowid();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "effect": id }).to_string()))
        .unwrap()
}

fn app(layer: IdempotencyLayer<SqliteStore>) -> Router {
    Router::new()
        .route(ROUTE, post(create).layer(layer.clone()))
        .merge(layer.status_router())
}

async fn send(app: &Router, key: &str, body: &str) -> (StatusCode, bool, Value) {
    let request = Request::post(ROUTE)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, serde_json::from_slice(&bytes).unwrap())
}

async fn status_of(app: &Router, key: &str) -> StatusCode {
    let request = Request::get(format!("/idempotency/v1/keys/{key}"))
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

async fn effects(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// Whether the record of `key` on the route exists under `hasher`'s identity.
async fn stored_under(store: &SqliteStore, hasher: &KeyHasher, key: &str) -> bool {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    let id = hasher.record_id(&Scope::new("default", "POST", ROUTE), &key);
    let mut conn = store.acquire().await.unwrap();
    store.fetch(&mut conn, &id).await.unwrap().is_some()
}

#[tokio::test]
async fn replays_records_made_under_the_previous_secret() {
    let (_dir, store) = setup().await;
    let before = app(IdempotencyLayer::new(store.clone(), secret_a()));
    let (status, replayed, first) = send(&before, "k-old", "{\"amount\":1}").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert!(stored_under(&store, &secret_a(), "k-old").await);

    let rotated =
        app(IdempotencyLayer::new(store.clone(), secret_b()).previous_key_hasher(secret_a()));
    let (status, replayed, again) = send(&rotated, "k-old", "{\"amount\":1}").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first, "the stored answer, not a second execution");
    assert_eq!(effects(&store).await, 1);
    assert!(
        !stored_under(&store, &secret_b(), "k-old").await,
        "answered from the previous secret's record, nothing claimed under the new one"
    );
    // The same key with another request is still refused, and the status resource finds it.
    let (status, _, problem) = send(&rotated, "k-old", "{\"amount\":2}").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(status_of(&rotated, "k-old").await, StatusCode::OK);

    // A fresh key is stored under the new secret only.
    let (status, replayed, _) = send(&rotated, "k-new", "{\"amount\":3}").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert!(stored_under(&store, &secret_b(), "k-new").await);
    assert!(!stored_under(&store, &secret_a(), "k-new").await);
    let (_, replayed, _) = send(&rotated, "k-new", "{\"amount\":3}").await;
    assert!(replayed);
    assert_eq!(effects(&store).await, 2);
}

#[tokio::test]
async fn without_the_previous_secret_an_old_key_executes_again() {
    let (_dir, store) = setup().await;
    let before = app(IdempotencyLayer::new(store.clone(), secret_a()));
    let (status, _, _) = send(&before, "k-old", "{\"amount\":1}").await;
    assert_eq!(status, StatusCode::CREATED);

    // What the rotation guards against: the new secret alone does not know the old record.
    let forgetful = app(IdempotencyLayer::new(store.clone(), secret_b()));
    assert_eq!(status_of(&forgetful, "k-old").await, StatusCode::NOT_FOUND);
    let (status, replayed, _) = send(&forgetful, "k-old", "{\"amount\":1}").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(effects(&store).await, 2, "executed twice");
}
