//! In-process integration tests of the idempotency layer: an axum router whose handler
//! writes an effect row on the layer's transaction, on a fresh SQLite file per test.

mod support;
use support::ManualClock;

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use http::{HeaderMap, Request, StatusCode, header};
use idemkey_core::{Clock, KeyHasher};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{
    EXPIRES_HEADER, IdempotencyLayer, KeyRequirement, Metrics, Outcome, PROBLEM_JSON,
    PROBLEM_TYPE_PREFIX, REPLAYED_HEADER, Tenant, Tx, status_router,
};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

const ROUTE: &str = "/effects";

/// A fresh database: the store's migrations plus the application's `effects` table. The
/// directory lives as long as the returned guard.
async fn setup() -> (TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("test.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE effects (
             id     INTEGER PRIMARY KEY AUTOINCREMENT,
             status INTEGER NOT NULL
         )",
    )
    .execute(store.pool())
    .await
    .unwrap();
    (dir, store)
}

fn hasher() -> KeyHasher {
    KeyHasher::new(b"secret")
}

fn layer(store: &SqliteStore) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store.clone(), hasher())
}

/// Holds a handler after its effect until the test lets it go: put it in the request's
/// extensions.
#[derive(Clone)]
struct Gate {
    entered: Arc<Notify>,
    proceed: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            entered: Arc::new(Notify::new()),
            proceed: Arc::new(Semaphore::new(0)),
        }
    }
}

/// The handler, steered by its JSON body: `{"status": 201, "panic": false, "sleep_ms": 0,
/// "pad": 0}`. It writes one effect row on the transaction, then answers with the row's id
/// (so a replay is told apart from a second execution), a `Location`, and a header the layer
/// does not store. A request carrying a [`Gate`] waits at it after the effect.
async fn create(gate: Option<Extension<Gate>>, mut tx: Tx<SqliteStore>, body: Bytes) -> Response {
    let steer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let status = steer["status"].as_u64().unwrap_or(201) as u16;
    let panics = steer["panic"].as_bool().unwrap_or(false);
    let sleep_ms = steer["sleep_ms"].as_u64().unwrap_or(0);
    let pad = steer["pad"].as_u64().unwrap_or(0) as usize;

    let id = sqlx::query("INSERT INTO effects (status) VALUES (?1)")
        .bind(i64::from(status))
        .execute(&mut *tx)
        .await
        .unwrap()
        .last_insert_rowid();
    if sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(sleep_ms)).await; // the work takes time
    }
    if let Some(Extension(gate)) = gate {
        gate.entered.notify_one();
        gate.proceed.acquire().await.unwrap().forget();
    }
    if panics {
        panic!("the handler panics on request");
    }
    let body = json!({ "effect": id, "status": status, "pad": "x".repeat(pad) }).to_string();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("{ROUTE}/{id}"))
        .header("x-not-stored", "1")
        .body(Body::from(body))
        .unwrap()
}

/// A safe-method handler that needs no transaction: the number of effects.
async fn count(State(store): State<SqliteStore>) -> String {
    effects(&store).await.to_string()
}

/// The application: `POST /effects` behind `layer`.
fn app(layer: IdempotencyLayer<SqliteStore>) -> Router {
    Router::new().route(ROUTE, post(layer.handler(create)))
}

fn request(key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post(ROUTE).header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

fn for_tenant(mut req: Request<Body>, tenant: &str) -> Request<Body> {
    req.extensions_mut().insert(Tenant(tenant.into()));
    req
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header(REPLAYED_HEADER) == Some("true")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// Asserts a problem+json answer with `status` and problem type `name`; returns it.
    #[track_caller]
    fn problem(&self, status: StatusCode, name: &str) -> Value {
        assert_eq!(self.status, status, "body: {:?}", self.body);
        assert_eq!(self.header("content-type"), Some(PROBLEM_JSON));
        let problem = self.json();
        assert_eq!(problem["type"], format!("{PROBLEM_TYPE_PREFIX}{name}"));
        assert_eq!(problem["status"], status.as_u16());
        problem
    }
}

async fn send(app: &Router, req: Request<Body>) -> Answer {
    let response = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = response.into_parts();
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

async fn records(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idemkey_records")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn replays_completed_response_byte_for_byte() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let body = r#"{"status": 201}"#;

    let first = send(&app, request(Some("k-replay"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.headers.get(REPLAYED_HEADER).is_none());
    assert!(first.header(EXPIRES_HEADER).is_some());
    assert_eq!(first.header("x-not-stored"), Some("1"));

    let second = send(&app, request(Some("k-replay"), body)).await;
    assert_eq!(second.status, first.status);
    assert_eq!(second.body, first.body, "the stored body, byte for byte");
    assert_eq!(second.header("content-type"), first.header("content-type"));
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(second.header("location"), Some("/effects/1"));
    assert!(second.replayed());
    assert_eq!(second.header(EXPIRES_HEADER), first.header(EXPIRES_HEADER));
    // Only allowlisted headers are stored and replayed.
    assert!(second.headers.get("x-not-stored").is_none());

    assert_eq!(effects(&store).await, 1);
    assert_eq!(records(&store).await, 1);
}

#[tokio::test]
async fn json_bodies_differing_only_in_spelling_are_the_same_request() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));

    let first = send(
        &app,
        request(
            Some("k-spelling"),
            r#"{"status":201,"amount":1,"note":"a"}"#,
        ),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = send(
        &app,
        request(
            Some("k-spelling"),
            "{ \"note\" : \"\\u0061\",\n  \"amount\": 1.0, \"status\": 201 }",
        ),
    )
    .await;
    assert_eq!(
        second.status,
        StatusCode::CREATED,
        "body: {:?}",
        second.body
    );
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn rejects_mismatched_body_with_422_naming_the_part() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));

    let first = send(&app, request(Some("k-mismatch"), r#"{"amount": 1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(&app, request(Some("k-mismatch"), r#"{"amount": 2}"#)).await;
    let problem = other.problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(problem["type"], "urn:idemkey:problem:key-reused");
    let differs: Vec<&str> = problem["differs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(differs.contains(&"body"), "{problem}");
    assert!(!differs.contains(&"query"), "{problem}");
    assert_eq!(problem["pointer"], "/amount", "{problem}");
    assert!(!other.replayed());
    assert_eq!(
        other.header(EXPIRES_HEADER),
        first.header(EXPIRES_HEADER),
        "the 422 tells the stored record's expiry"
    );
    assert!(other.header(EXPIRES_HEADER).is_some());
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn rejects_reused_key_naming_the_first_differing_member() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let cases = [
        // (key, first body, retry body, pointer)
        (
            "k-amount",
            r#"{"amount":500,"currency":"EUR"}"#,
            r#"{"currency":"EUR","amount":600}"#,
            "/amount",
        ),
        (
            "k-nested",
            r#"{"items":[{"qty":1},{"qty":1},{"qty":1}]}"#,
            r#"{"items":[{"qty":1},{"qty":1},{"qty":3}]}"#,
            "/items/2/qty",
        ),
        (
            "k-added",
            r#"{"amount":500}"#,
            r#"{"amount":500,"note":"gift"}"#,
            "/note",
        ),
        (
            "k-removed",
            r#"{"amount":500,"meta":{"a":1,"b":2}}"#,
            r#"{"amount":500,"meta":{"a":1}}"#,
            "/meta",
        ),
    ];
    for (key, first_body, retry_body, pointer) in cases {
        let first = send(&app, request(Some(key), first_body)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}");
        let retry = send(&app, request(Some(key), retry_body)).await;
        let problem = retry.problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
        assert_eq!(problem["pointer"], pointer, "{key}: {problem}");
        assert_eq!(problem["differs"], json!(["body"]), "{key}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("\"{pointer}\"")),
            "{key}: {detail}"
        );
        assert!(retry.header(EXPIRES_HEADER).is_some(), "{key}");
        assert_eq!(retry.header(EXPIRES_HEADER), first.header(EXPIRES_HEADER));
    }
    assert_eq!(effects(&store).await, cases.len() as i64);
}

#[tokio::test]
async fn rejects_missing_empty_overlong_comma_and_doubled_keys_with_400() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let body = r#"{"status": 201}"#;
    let overlong = "a".repeat(256);

    let missing = send(&app, request(None, body)).await;
    missing.problem(StatusCode::BAD_REQUEST, "key-missing");

    for bad in [
        "",
        "\"\"",
        "   ",
        overlong.as_str(),
        "a,b",
        "\"a\", \"b\"",
        "a b",
        "\"open",
    ] {
        let answer = send(&app, request(Some(bad), body)).await;
        answer.problem(StatusCode::BAD_REQUEST, "key-invalid");
    }

    let doubled = Request::post(ROUTE)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", "k1")
        .header("idempotency-key", "k1")
        .body(Body::from(body))
        .unwrap();
    send(&app, doubled)
        .await
        .problem(StatusCode::BAD_REQUEST, "key-invalid");

    // 255 characters is still a key.
    let longest = "a".repeat(255);
    let ok = send(&app, request(Some(&longest), body)).await;
    assert_eq!(ok.status, StatusCode::CREATED);

    assert_eq!(effects(&store).await, 1, "only the valid key executed");
    assert_eq!(records(&store).await, 1);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let body = r#"{"status": 201}"#;

    let bare = send(&app, request(Some("8e03978e-40d5"), body)).await;
    assert_eq!(bare.status, StatusCode::CREATED);
    let quoted = send(&app, request(Some("\"8e03978e-40d5\""), body)).await;
    assert_eq!(quoted.status, StatusCode::CREATED);
    assert!(quoted.replayed());
    assert_eq!(quoted.body, bare.body);
    assert_eq!(effects(&store).await, 1);
    assert_eq!(records(&store).await, 1);
}

#[tokio::test]
async fn handler_400_and_500_roll_back_and_free_the_key() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));

    for (done, (key, status)) in [("k-400", 400u16), ("k-500", 500)].into_iter().enumerate() {
        let done = done as i64; // committed by the earlier rounds' corrected retries
        let body = format!(r#"{{"status": {status}}}"#);
        let failed = send(&app, request(Some(key), &body)).await;
        assert_eq!(failed.status.as_u16(), status);
        assert!(!failed.replayed());
        // The handler's own response is passed through, not stored.
        assert_eq!(failed.json()["status"], status);
        assert!(failed.headers.get(EXPIRES_HEADER).is_none());
        assert_eq!(effects(&store).await, done, "{status}: effect rolled back");
        assert_eq!(records(&store).await, done, "{status}: key freed");

        let corrected = send(&app, request(Some(key), r#"{"status": 201}"#)).await;
        assert_eq!(
            corrected.status,
            StatusCode::CREATED,
            "{status}: retry executes"
        );
        assert!(!corrected.replayed());
    }
    assert_eq!(effects(&store).await, 2);
    assert_eq!(records(&store).await, 2);
}

#[tokio::test]
async fn declined_402_is_stored_and_replayed() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let body = r#"{"status": 402}"#;

    let declined = send(&app, request(Some("k-402"), body)).await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    assert!(!declined.replayed());
    assert!(declined.header(EXPIRES_HEADER).is_some());

    let again = send(&app, request(Some("k-402"), body)).await;
    assert_eq!(again.status, StatusCode::PAYMENT_REQUIRED);
    assert!(again.replayed());
    assert_eq!(again.body, declined.body);
    assert_eq!(effects(&store).await, 1);

    // The decline is the outcome of this key: another request under it is not a retry.
    let changed = send(&app, request(Some("k-402"), r#"{"status": 201}"#)).await;
    changed.problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn panic_rolls_back_and_answers_500_problem() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));

    let panicked = send(&app, request(Some("k-panic"), r#"{"panic": true}"#)).await;
    panicked.problem(StatusCode::INTERNAL_SERVER_ERROR, "internal-error");
    assert_eq!(effects(&store).await, 0);
    assert_eq!(records(&store).await, 0);

    let next = send(&app, request(Some("k-panic"), r#"{"status": 201}"#)).await;
    assert_eq!(next.status, StatusCode::CREATED);
    assert!(!next.replayed());
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn oversized_request_body_gets_413_without_record() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .max_request_body(100));
    let big = format!(r#"{{"status": 201, "filler": "{}"}}"#, "x".repeat(200));

    // Without Content-Length: the limit is found while reading.
    let streamed = send(&app, request(Some("k-big"), &big)).await;
    streamed.problem(StatusCode::PAYLOAD_TOO_LARGE, "request-too-large");

    // With a declared Content-Length over the limit: refused before reading.
    let mut declared = request(Some("k-big"), &big);
    declared
        .headers_mut()
        .insert(header::CONTENT_LENGTH, big.len().into());
    send(&app, declared)
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE, "request-too-large");

    assert_eq!(effects(&store).await, 0);
    assert_eq!(records(&store).await, 0);

    // A body within the limit under the same key executes: nothing was kept.
    let small = send(&app, request(Some("k-big"), r#"{"status": 201}"#)).await;
    assert_eq!(small.status, StatusCode::CREATED);
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn response_too_large_rolls_back() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .max_stored_response(10));

    let answer = send(&app, request(Some("k-large"), r#"{"status": 201}"#)).await;
    answer.problem(StatusCode::INTERNAL_SERVER_ERROR, "response-too-large");
    assert!(!answer.replayed());
    assert_eq!(effects(&store).await, 0, "the effect is rolled back");
    assert_eq!(records(&store).await, 0, "the key stays free");
}

#[tokio::test]
async fn optional_route_without_key_runs_unprotected() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Optional));
    let body = r#"{"status": 201}"#;

    for _ in 0..2 {
        let answer = send(&app, request(None, body)).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(effects(&store).await, 2, "both committed");
    assert_eq!(records(&store).await, 0);

    // A key still protects the request.
    let first = send(&app, request(Some("k-opt"), body)).await;
    let second = send(&app, request(Some("k-opt"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(effects(&store).await, 3);

    // Unkeyed requests commit under the same rule as keyed ones: a 500 rolls back.
    let failed = send(&app, request(None, r#"{"status": 500}"#)).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(effects(&store).await, 3);
}

#[tokio::test]
async fn off_route_ignores_keys() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Off));
    let body = r#"{"status": 201}"#;

    for key in [Some("k-off"), Some("k-off"), None, Some("a,b")] {
        let answer = send(&app, request(key, body)).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{key:?}");
        assert!(!answer.replayed());
    }
    assert_eq!(
        effects(&store).await,
        4,
        "every request committed its effect"
    );
    assert_eq!(records(&store).await, 0);
}

#[tokio::test]
async fn safe_methods_pass_through() {
    let (_dir, store) = setup().await;
    let app = Router::new().route(
        ROUTE,
        get(count)
            .with_state(store.clone())
            .post(create)
            .layer(layer(&store).requirement(KeyRequirement::Required)),
    );

    let created = send(&app, request(Some("k-safe"), r#"{"status": 201}"#)).await;
    assert_eq!(created.status, StatusCode::CREATED);

    let get = Request::get(ROUTE).body(Body::empty()).unwrap();
    let listed = send(&app, get).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.body, "1");
    assert!(!listed.replayed());

    // Even a malformed key is not looked at on a safe method.
    let get = Request::get(ROUTE)
        .header("idempotency-key", "a,b")
        .body(Body::empty())
        .unwrap();
    let listed = send(&app, get).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.body, "1");
    assert_eq!(records(&store).await, 1);
}

#[tokio::test]
async fn same_key_in_two_tenants_is_two_operations() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));
    let body = r#"{"status": 201}"#;

    let a = send(&app, for_tenant(request(Some("k-shared"), body), "a")).await;
    let b = send(&app, for_tenant(request(Some("k-shared"), body), "b")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed(), "tenant b's key is its own");
    assert_ne!(a.body, b.body);
    assert_eq!(effects(&store).await, 2);

    let a_again = send(&app, for_tenant(request(Some("k-shared"), body), "a")).await;
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(effects(&store).await, 2);
    assert_eq!(records(&store).await, 2);
}

#[tokio::test]
async fn expired_key_runs_again() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let retention = Duration::from_secs(3600);
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .retention(retention)
        .clock(clock.clone()));
    let body = r#"{"status": 201}"#;

    let first = send(&app, request(Some("k-expire"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let expires = clock.now().plus(retention).to_system_time();
    assert_eq!(
        first.header(EXPIRES_HEADER),
        Some(httpdate::fmt_http_date(expires).as_str())
    );
    clock.advance(retention - Duration::from_millis(1));
    let replay = send(&app, request(Some("k-expire"), body)).await;
    assert!(replay.replayed(), "replayed until its expiry");
    clock.advance(Duration::from_millis(1));
    let second = send(&app, request(Some("k-expire"), body)).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed(), "an expired record is never replayed");
    assert_ne!(second.body, first.body);
    assert_eq!(effects(&store).await, 2);

    // The new outcome is stored and replayed in its turn.
    let third = send(&app, request(Some("k-expire"), body)).await;
    assert!(third.replayed());
    assert_eq!(third.body, second.body);
    assert_eq!(effects(&store).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_same_key_requests_execute_once() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required));

    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                send(
                    &app,
                    request(Some("k-race"), r#"{"status": 201, "sleep_ms": 100}"#),
                )
                .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }

    assert_eq!(effects(&store).await, 1, "executed exactly once");
    for answer in &answers {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "body: {:?}",
            answer.body
        );
        assert_eq!(answer.body, answers[0].body);
    }
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, 15);
}

#[tokio::test]
async fn status_resource_shows_own_records() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store).requirement(KeyRequirement::Required))
        .merge(status_router(store.clone(), hasher()));

    let done = send(&app, request(Some("k-status"), r#"{"status": 201}"#)).await;
    assert_eq!(done.status, StatusCode::CREATED);

    let get = |tenant: Option<&str>, key: &str| {
        let mut req = Request::get(format!("/idempotency/v1/keys/{key}"))
            .body(Body::empty())
            .unwrap();
        if let Some(tenant) = tenant {
            req.extensions_mut().insert(Tenant(tenant.into()));
        }
        req
    };

    let own = send(&app, get(None, "k-status")).await;
    assert_eq!(own.status, StatusCode::OK, "body: {:?}", own.body);
    let view = own.json();
    assert_eq!(view["records"].as_array().unwrap().len(), 1, "{view}");
    assert_eq!(view["records"][0]["state"], "completed");
    assert_eq!(view["records"][0]["response_status"], 201);
    assert_eq!(view["records"][0]["route"], "POST /effects");
    assert!(
        !view.to_string().contains("k-status"),
        "the raw key is not shown"
    );

    // The same tenant spelled out finds the same record.
    let default = send(&app, get(Some(Tenant::DEFAULT), "k-status")).await;
    assert_eq!(default.status, StatusCode::OK);

    send(&app, get(Some("other"), "k-status"))
        .await
        .problem(StatusCode::NOT_FOUND, "key-not-found");
    send(&app, get(None, "k-unknown"))
        .await
        .problem(StatusCode::NOT_FOUND, "key-not-found");
}

#[tokio::test]
async fn metrics_count_outcomes() {
    let (_dir, store) = setup().await;
    let m = Metrics::new();
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .metrics(m.clone()));

    let first = send(&app, request(Some("k-m"), r#"{"amount": 1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&app, request(Some("k-m"), r#"{"amount": 1}"#)).await;
    assert!(replay.replayed());
    let reused = send(&app, request(Some("k-m"), r#"{"amount": 2}"#)).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    let failed = send(&app, request(Some("k-m2"), r#"{"status": 500}"#)).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let invalid = send(&app, request(Some("a,b"), r#"{"amount": 1}"#)).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);

    assert_eq!(m.count(Outcome::Executed), 1);
    assert_eq!(m.count(Outcome::Replayed), 1);
    assert_eq!(m.count(Outcome::Mismatched), 1);
    assert_eq!(m.count(Outcome::NotStored), 1);
    assert_eq!(m.count(Outcome::Rejected), 1);
    assert_eq!(m.count(Outcome::InFlight), 0);
    let text = m.render();
    assert!(
        text.contains("idemkey_requests_total{outcome=\"replayed\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("idemkey_requests_total{outcome=\"executed\"} 1\n"));
    assert!(text.contains("idemkey_requests_total{outcome=\"mismatched\"} 1\n"));
    assert!(text.contains("idemkey_attempts_total 5\n"), "{text}");
}

#[tokio::test]
async fn handler_without_layer_gets_500_transaction_unavailable() {
    let (_dir, store) = setup().await;
    let app = Router::new().route(ROUTE, post(create));

    let answer = send(&app, request(Some("k-bare"), r#"{"status": 201}"#)).await;
    answer.problem(StatusCode::INTERNAL_SERVER_ERROR, "transaction-unavailable");
    assert_eq!(effects(&store).await, 0);
    assert_eq!(records(&store).await, 0);
}

#[tokio::test]
async fn store_header_adds_a_replayed_header() {
    let (_dir, store) = setup().await;
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .store_header(http::HeaderName::from_static("x-not-stored")));
    let body = r#"{"status": 201}"#;

    let first = send(&app, request(Some("k-hdr"), body)).await;
    let second = send(&app, request(Some("k-hdr"), body)).await;
    assert!(second.replayed());
    assert_eq!(second.header("x-not-stored"), first.header("x-not-stored"));
    assert_eq!(second.header("x-not-stored"), Some("1"));
}

/// SQLite takes its write lock in `store.begin()` (`BEGIN IMMEDIATE`), so a request that
/// arrives while another attempt holds it waits there. That lock is the whole database's:
/// when the wait runs out the layer cannot tell this key from any other writer, so the answer
/// is 503 `store-busy` + `Retry-After` (nothing ran), not a claim that the key is in flight.
/// (A retry of the *same* key waits in memory for the first attempt instead: see
/// `retry_storm.rs`.)
///
/// The store here has a 200 ms busy time-out; the first attempt holds the lock until the
/// other key's request has its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_sqlite_lock_answers_503_store_busy_and_runs_nothing() {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("busy.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id INTEGER PRIMARY KEY, status INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let m = Metrics::new();
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .metrics(m.clone()));
    let body = r#"{"status": 201}"#;

    let gate = Gate::new();
    let owner = {
        let (app, gate) = (app.clone(), gate.clone());
        let mut req = request(Some("k-busy"), body);
        req.extensions_mut().insert(gate);
        tokio::spawn(async move { send(&app, req).await })
    };
    // The owner holds the key (and SQLite's write lock) in its handler.
    gate.entered.notified().await;
    let retry = send(&app, request(Some("k-busy-other"), body)).await;
    gate.proceed.add_permits(1);
    let owner = owner.await.unwrap();
    assert_eq!(owner.status, StatusCode::CREATED);
    assert_eq!(effects(&store).await, 1);

    retry.problem(StatusCode::SERVICE_UNAVAILABLE, "store-busy");
    assert!(retry.header("retry-after").is_some());
    assert_eq!(m.count(Outcome::InFlight), 0);
    assert_eq!(m.count(Outcome::StoreError), 1);
}

/// The purge a library user spawns from the layer deletes expired records (and only those),
/// in the background, every interval of the layer's clock, and counts them.
#[tokio::test]
async fn spawned_purge_deletes_expired_records() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let retention = Duration::from_secs(3600);
    let metrics = Metrics::new();
    let idempotency = layer(&store)
        .requirement(KeyRequirement::Required)
        .retention(retention)
        .clock(clock.clone())
        .metrics(metrics.clone());
    let app = app(idempotency.clone());
    for key in ["k-old-1", "k-old-2", "k-old-3"] {
        send(&app, request(Some(key), r#"{"status": 201}"#)).await;
    }
    clock.advance(retention);
    send(&app, request(Some("k-new"), r#"{"status": 201}"#)).await;
    assert_eq!(records(&store).await, 4);

    let purge = idempotency.spawn_purge(Duration::from_secs(60));
    let mut stats = purge.stats();
    let done = stats.wait_for(|s| s.rounds >= 1);
    let done = tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .expect("the first round runs at once")
        .unwrap()
        .to_owned();
    assert_eq!((done.purged, done.failures), (3, 0));
    assert_eq!(records(&store).await, 1, "the live record stays");
    assert!(
        metrics.render().contains("idemkey_purged_total 3\n"),
        "{}",
        metrics.render()
    );

    // The next round waits on the layer's clock: moving it past the interval (and the last
    // record's retention) runs the round at once.
    clock.sleeping(1).await;
    clock.advance(retention);
    let done = stats.wait_for(|s| s.rounds >= 2).await.unwrap().to_owned();
    assert_eq!((done.purged, done.failures), (4, 0));
    assert_eq!(records(&store).await, 0);
}

/// A `COMMIT` that fails leaves the outcome unknown to the layer: the answer is 503
/// `store-unavailable` saying the request may have been executed and to retry with the same
/// key, never that nothing was executed. (Here a deferred foreign key fails the commit, so
/// nothing was, and the retry executes.)
#[tokio::test]
async fn a_failed_commit_says_the_outcome_is_unknown() {
    let (_dir, store) = setup().await;
    sqlx::query(
        "CREATE TABLE parents (id INTEGER PRIMARY KEY);
         CREATE TABLE children (parent INTEGER NOT NULL
             REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    async fn orphan(mut tx: Tx<SqliteStore>, body: Bytes) -> StatusCode {
        let parent: i64 = if body.as_ref() == b"orphan" { 7 } else { 1 };
        if parent == 1 {
            sqlx::query("INSERT OR IGNORE INTO parents (id) VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        sqlx::query("INSERT INTO children (parent) VALUES (?1)")
            .bind(parent)
            .execute(&mut *tx)
            .await
            .unwrap();
        StatusCode::CREATED
    }
    let app = Router::new().route(
        ROUTE,
        post(orphan).layer(layer(&store).requirement(KeyRequirement::Required)),
    );
    let failed = send(&app, request(Some("k-commit"), "orphan")).await;
    let problem = failed.problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("may have been executed"), "{detail}");
    assert!(detail.contains("same Idempotency-Key"), "{detail}");
    assert!(failed.header("retry-after").is_some());
    let children: i64 = sqlx::query_scalar("SELECT count(*) FROM children")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(children, 0, "the failed commit left nothing");
    let retried = send(&app, request(Some("k-commit"), "orphan")).await;
    assert_eq!(
        retried.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "nothing stored: executed again"
    );
}

/// A duplicate that waits in memory for the first attempt is counted in
/// `idemkey_waiting_in_process` while it waits, and no longer once its request is dropped
/// (the client hung up) or answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waiting_in_memory_is_counted_until_it_goes() {
    let (_dir, store) = setup().await;
    let metrics = Metrics::new();
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .metrics(metrics.clone()));
    let body = r#"{"status": 201}"#;
    let gate = Gate::new();
    let owner = {
        let (app, gate) = (app.clone(), gate.clone());
        let mut req = request(Some("k-wait"), body);
        req.extensions_mut().insert(gate);
        tokio::spawn(async move { send(&app, req).await })
    };
    gate.entered.notified().await;
    let hung_up = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, request(Some("k-wait"), body)).await })
    };
    let waiting = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, request(Some("k-wait"), body)).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    while metrics.waiting_in_process() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicates never waited"
        );
        tokio::task::yield_now().await;
    }
    hung_up.abort();
    assert!(hung_up.await.is_err_and(|e| e.is_cancelled()));
    assert_eq!(
        metrics.waiting_in_process(),
        1,
        "the dropped request is no longer counted"
    );
    gate.proceed.add_permits(1);
    let first = owner.await.unwrap();
    let second = waiting.await.unwrap();
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(metrics.waiting_in_process(), 0);
}

/// A duplicate waits for the first attempt as long as the `wait` bound on the layer's
/// clock: once the clock passes it, the duplicate answers 409 `request-in-flight`, and the
/// first attempt still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waits_until_the_bound_passes_on_the_layers_clock() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let bound = Duration::from_secs(5);
    let app = app(layer(&store)
        .requirement(KeyRequirement::Required)
        .in_flight(idemkey_tower::InFlightPolicy::Wait(bound))
        .clock(clock.clone()));
    let body = r#"{"status": 201}"#;
    let gate = Gate::new();
    let owner = {
        let (app, gate) = (app.clone(), gate.clone());
        let mut req = request(Some("k-bound"), body);
        req.extensions_mut().insert(gate);
        tokio::spawn(async move { send(&app, req).await })
    };
    gate.entered.notified().await;
    let duplicate = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, request(Some("k-bound"), body)).await })
    };
    clock.sleeping(1).await;
    clock.advance(bound);
    let refused = duplicate.await.unwrap();
    assert_eq!(
        refused.status,
        StatusCode::CONFLICT,
        "body: {:?}",
        refused.body
    );
    assert_eq!(
        refused.json()["type"],
        "urn:idemkey:problem:request-in-flight"
    );
    gate.proceed.add_permits(1);
    let first = owner.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn a_far_future_expiry_is_answered_and_replayed_without_a_panic() {
    let (_dir, store) = setup().await;
    // The largest bounds a library user can give: the record expires past what any date
    // can spell, and a retry waits as long as the clock can count.
    let layer = layer(&store)
        .retention(Duration::MAX)
        .in_flight(idemkey_tower::InFlightPolicy::Wait(Duration::MAX))
        .requirement(KeyRequirement::Required);
    let app = app(layer).merge(status_router(store.clone(), hasher()));

    let first = send(&app, request(Some("k-far"), r#"{"status": 201}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED, "body: {:?}", first.body);
    assert_eq!(
        first.header(EXPIRES_HEADER),
        Some("Fri, 31 Dec 9999 23:59:59 GMT")
    );
    let replay = send(&app, request(Some("k-far"), r#"{"status": 201}"#)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header(EXPIRES_HEADER), first.header(EXPIRES_HEADER));

    let status = Request::get("/idempotency/v1/keys/k-far")
        .body(Body::empty())
        .unwrap();
    let view = send(&app, status).await;
    assert_eq!(view.status, StatusCode::OK, "body: {:?}", view.body);
    assert_eq!(
        view.json()["records"][0]["expires_at"],
        "9999-12-31T23:59:59.999Z"
    );
    assert_eq!(effects(&store).await, 1);
}

// ---------------------------------------------------------------------------------------
// The first attempt's time: `Repeatability-First-Sent`.

const HOUR: Duration = Duration::from_secs(3600);

/// `request` with `Repeatability-First-Sent: sent`.
fn sent_at(key: &str, body: &str, sent: idemkey_core::Timestamp) -> Request<Body> {
    let mut req = request(Some(key), body);
    let date = httpdate::fmt_http_date(sent.to_system_time());
    req.headers_mut()
        .insert("repeatability-first-sent", date.parse().unwrap());
    req
}

/// A retry whose record was purged, stating a first attempt older than the retention, is
/// refused with 412 and runs nothing; before the first-sent time was read it ran again.
#[tokio::test]
async fn refuses_a_late_retry_whose_record_was_purged() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store).retention(HOUR).clock(clock.clone()));
    let sent = clock.now();
    let first = send(&app, sent_at("k-late", r#"{"status": 201}"#, sent)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("repeatability-result"), Some("accepted"));

    clock.advance(2 * HOUR);
    let purged = idemkey_core::protocol::purge_expired(&store, clock.now(), 100).await;
    assert_eq!(purged.unwrap(), 1);
    let retry = send(&app, sent_at("k-late", r#"{"status": 201}"#, sent)).await;
    let problem = retry.problem(StatusCode::PRECONDITION_FAILED, "first-sent-expired");
    assert_eq!(retry.header("repeatability-result"), Some("rejected"));
    assert_eq!(problem["retention_secs"], 3600);
    assert_eq!(problem["margin_secs"], 300.0);
    assert_eq!(effects(&store).await, 1, "nothing ran again");
    assert_eq!(records(&store).await, 0, "nothing was stored");
}

/// A 30 s retention still works: a current first-sent time runs, once, and its retries
/// replay; the record and the status resource keep the time.
#[tokio::test]
async fn a_current_first_sent_runs_once_on_a_short_retention() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let idempotency = layer(&store)
        .retention(Duration::from_secs(30))
        .clock(clock.clone());
    let app = app(idempotency.clone()).merge(idempotency.status_router());
    let sent = clock.now();
    let first = send(&app, sent_at("k-short", r#"{"status": 201}"#, sent)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    clock.advance(Duration::from_secs(20));
    let retry = send(&app, sent_at("k-short", r#"{"status": 201}"#, sent)).await;
    assert!(retry.replayed(), "{:?}", retry.body);
    assert_eq!(retry.header("repeatability-result"), Some("accepted"));
    assert_eq!(effects(&store).await, 1);

    let status = send(
        &app,
        Request::get("/idempotency/v1/keys/k-short")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status.status, StatusCode::OK);
    assert_eq!(
        status.json()["records"][0]["first_sent"],
        "2027-01-15T08:00:00.000Z"
    );
}

/// A late retry whose record is still live is answered by it: a replay, without a claim.
#[tokio::test]
async fn a_late_retry_of_a_live_record_replays() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store)
        .retention(HOUR)
        .no_replay_cache()
        .clock(clock.clone()));
    let sent = clock.now();
    send(&app, sent_at("k-live", r#"{"status": 201}"#, sent)).await;
    // Inside the retention, past the retention less the 5 min margin.
    clock.advance(HOUR - Duration::from_secs(60));
    let retry = send(&app, sent_at("k-live", r#"{"status": 201}"#, sent)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(effects(&store).await, 1);
}

/// A first-sent time further ahead than the skew allowance, a malformed one, or none where
/// the route requires it: 400, nothing runs, nothing is stored.
#[tokio::test]
async fn refuses_future_malformed_and_missing_first_sent_with_400() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let optional = app(layer(&store).clock(clock.clone()));
    let ahead = clock.now().plus(Duration::from_secs(6 * 60));
    let future = send(&optional, sent_at("k-future", "{}", ahead)).await;
    future.problem(StatusCode::BAD_REQUEST, "first-sent-invalid");
    assert_eq!(future.header("repeatability-result"), Some("rejected"));
    let near = clock.now().plus(Duration::from_secs(4 * 60));
    let within = send(&optional, sent_at("k-near", "{}", near)).await;
    assert_eq!(within.status, StatusCode::CREATED, "within the allowance");

    let mut malformed = request(Some("k-malformed"), "{}");
    malformed
        .headers_mut()
        .insert("repeatability-first-sent", "yesterday".parse().unwrap());
    send(&optional, malformed)
        .await
        .problem(StatusCode::BAD_REQUEST, "first-sent-invalid");

    let required = app(layer(&store)
        .first_sent(idemkey_core::FirstSentRequirement::Required)
        .clock(clock.clone()));
    let missing = send(&required, request(Some("k-missing"), "{}")).await;
    missing.problem(StatusCode::BAD_REQUEST, "first-sent-missing");
    assert_eq!(missing.header("repeatability-result"), None);
    assert_eq!(effects(&store).await, 1);
    assert_eq!(records(&store).await, 1);
}

/// A retry that states another first-sent time is another request (422 naming it); one that
/// states none replays.
#[tokio::test]
async fn rejects_a_changed_first_sent_as_a_different_request() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store).clock(clock.clone()));
    let sent = clock.now();
    send(&app, sent_at("k-changed", "{}", sent)).await;
    let earlier = sent.minus(Duration::from_secs(1));
    let changed = send(&app, sent_at("k-changed", "{}", earlier)).await;
    let problem = changed.problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(problem["differs"], json!(["first-sent"]));
    let without = send(&app, request(Some("k-changed"), "{}")).await;
    assert!(without.replayed());
    assert_eq!(without.header("repeatability-result"), None);
    assert_eq!(effects(&store).await, 1);
}

/// Many attempts of one late key at once: every one is refused, none runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_late_attempts_at_once_are_all_refused() {
    const ATTEMPTS: usize = 32;
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store).retention(HOUR).clock(clock.clone()));
    let sent = clock.now().minus(2 * HOUR);
    let barrier = Arc::new(tokio::sync::Barrier::new(ATTEMPTS));
    let tasks: Vec<_> = (0..ATTEMPTS)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, sent_at("k-storm", r#"{"status": 201}"#, sent)).await
            })
        })
        .collect();
    for task in tasks {
        task.await
            .unwrap()
            .problem(StatusCode::PRECONDITION_FAILED, "first-sent-expired");
    }
    assert_eq!(effects(&store).await, 0);
    assert_eq!(records(&store).await, 0);
}

/// A late retry that arrives while the first attempt still runs (its record not committed
/// yet) is answered 409 `request-in-flight`, as in external mode, not 412: the first attempt
/// may still store its outcome, which the next retry then replays.
#[tokio::test]
async fn a_late_retry_while_the_first_attempt_runs_is_in_flight() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let retention = Duration::from_secs(8); // margin: 2 s
    let app = app(layer(&store)
        .retention(retention)
        .no_replay_cache()
        .clock(clock.clone()));
    let sent = clock.now();
    let gate = Gate::new();
    let first = tokio::spawn({
        let (app, gate) = (app.clone(), gate.clone());
        let mut req = sent_at("k-late-running", r#"{"status": 201}"#, sent);
        req.extensions_mut().insert(gate);
        async move { send(&app, req).await }
    });
    gate.entered.notified().await;
    // Past the retention less the margin: late, while the first attempt still runs.
    clock.advance(Duration::from_secs(7));
    let retry = send(&app, sent_at("k-late-running", r#"{"status": 201}"#, sent)).await;
    retry.problem(StatusCode::CONFLICT, "request-in-flight");
    assert_eq!(retry.header("retry-after"), Some("1"));
    assert_eq!(retry.header("repeatability-result"), Some("rejected"));

    gate.proceed.add_permits(1);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let replay = send(&app, sent_at("k-late-running", r#"{"status": 201}"#, sent)).await;
    assert!(replay.replayed(), "{:?}", replay.body);
    assert_eq!(replay.header("repeatability-result"), Some("accepted"));
    assert_eq!(effects(&store).await, 1);
}

/// A valid date before 1970 is a first attempt very long ago, not a malformed header: 412,
/// repeating the date as sent; a date that is not one stays 400.
#[tokio::test]
async fn a_first_sent_before_1970_is_late_not_malformed() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store).clock(clock.clone()));
    for (date, status, name) in [
        (
            "Thu, 01 Jan 1920 00:00:00 GMT",
            StatusCode::PRECONDITION_FAILED,
            "first-sent-expired",
        ),
        (
            "Mon, 01 Jan 1920 00:00:00 GMT",
            StatusCode::BAD_REQUEST,
            "first-sent-invalid",
        ),
    ] {
        let mut req = request(Some("k-1920"), "{}");
        req.headers_mut()
            .insert("repeatability-first-sent", date.parse().unwrap());
        let answer = send(&app, req).await;
        let problem = answer.problem(status, name);
        if status == StatusCode::PRECONDITION_FAILED {
            assert_eq!(problem["first_sent"], date);
        }
        assert_eq!(answer.header("repeatability-result"), Some("rejected"));
    }
    assert_eq!(effects(&store).await, 0);
    assert_eq!(records(&store).await, 0);
}

/// Retention 8 s with the default 5 min skew: a client whose clock runs 290 s fast would have
/// its first attempt run and, once the record expired, a retry run again (its first-sent time
/// not yet counting as late). The allowance ahead is the margin, 2 s: it is refused at once.
#[tokio::test]
async fn a_client_clock_290_s_fast_is_not_charged_twice() {
    let (_dir, store) = setup().await;
    let clock = ManualClock::new();
    let app = app(layer(&store)
        .retention(Duration::from_secs(8))
        .clock(clock.clone()));
    let fast = clock.now().plus(Duration::from_secs(290));
    let first = send(&app, sent_at("k-fast", r#"{"status": 201}"#, fast)).await;
    let problem = first.problem(StatusCode::BAD_REQUEST, "first-sent-invalid");
    assert_eq!(
        problem["detail"],
        "Repeatability-First-Sent is 290 s ahead of the server's clock, more than the 2 s allowed"
    );
    clock.advance(Duration::from_secs(10));
    idemkey_core::protocol::purge_expired(&store, clock.now(), 100)
        .await
        .unwrap();
    let retry = send(&app, sent_at("k-fast", r#"{"status": 201}"#, fast)).await;
    retry.problem(StatusCode::BAD_REQUEST, "first-sent-invalid");
    assert_eq!(effects(&store).await, 0, "charged never, not twice");
}
