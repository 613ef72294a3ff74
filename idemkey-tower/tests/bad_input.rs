//! Bad input at volume: random methods, header sets, keys, content types, body sizes, JSON
//! nesting depths and invalid UTF-8 thrown at the layer, in both modes, on a real SQLite
//! store. Whatever comes in: no panic, no 500 (the store is healthy here, so no answer may
//! blame it either), every error is problem+json, and no record is left without its
//! response once the request has ended.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Method, Request, StatusCode};
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, KeyRequirement, PROBLEM_JSON, Tx};
use proptest::prelude::*;
use tower::ServiceExt;

/// Local mode: one effect row on the layer's transaction, answered 201.
async fn local(mut tx: Tx<SqliteStore>, body: Bytes) -> Response {
    sqlx::query("INSERT INTO effects (size) VALUES (?1)")
        .bind(body.len() as i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    (StatusCode::CREATED, "{\"ok\":true}").into_response()
}

/// External mode: marks the point of no return, then answers 201.
async fn external(op: External<SqliteStore>) -> Response {
    if let Err(rejection) = op.point_of_no_return().await {
        return rejection.into_response();
    }
    (StatusCode::CREATED, "{\"ok\":true}").into_response()
}

struct App {
    _dir: tempfile::TempDir,
    store: SqliteStore,
    router: Router,
}

async fn app() -> App {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("fuzz.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id INTEGER PRIMARY KEY, size INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(b"fuzz"))
        .max_request_body(64 * 1024)
        .fingerprint_fields(["/amount", "/a/b"]);
    let router = Router::new()
        .route(
            "/local",
            post(local)
                .put(local)
                .patch(local)
                .delete(local)
                .layer(layer.clone().requirement(KeyRequirement::Required)),
        )
        .route(
            "/optional",
            post(local).layer(layer.clone().requirement(KeyRequirement::Optional)),
        )
        .route(
            "/external",
            post(external).layer(layer.external(Duration::from_secs(10))),
        );
    App {
        _dir: dir,
        store,
        router,
    }
}

/// A JSON document nested `depth` levels deep, arrays and objects by turns.
fn nested(depth: usize, leaf: &str) -> String {
    let mut s = String::new();
    for i in 0..depth {
        s.push_str(if i % 2 == 0 { "{\"a\":" } else { "[" });
    }
    s.push_str(leaf);
    for i in (0..depth).rev() {
        s.push(if i % 2 == 0 { '}' } else { ']' });
    }
    s
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        Just(Method::POST),
        Just(Method::PUT),
        Just(Method::PATCH),
        Just(Method::DELETE),
        Just(Method::GET),
        Just(Method::from_bytes(b"FROB").unwrap()),
    ]
}

/// Raw header values: well-formed keys, quoted keys, empty, overlong, forbidden characters,
/// and arbitrary (also non-UTF-8) bytes.
fn key_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[a-zA-Z0-9-]{1,40}".prop_map(String::into_bytes),
        "[a-z0-9]{1,20}".prop_map(|k| format!("\"{k}\"").into_bytes()),
        Just(Vec::new()),
        Just(vec![b'k'; 300]),
        Just(b"a,b".to_vec()),
        Just(b"\"unterminated".to_vec()),
        proptest::collection::vec(any::<u8>(), 1..40),
    ]
}

fn content_type() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        Just(Some(b"application/json".to_vec())),
        Just(Some(b"application/json; charset=utf-8".to_vec())),
        Just(Some(b"application/x-www-form-urlencoded".to_vec())),
        Just(Some(b"text/plain".to_vec())),
        Just(Some(b"application/json;;;==".to_vec())),
        proptest::collection::vec(any::<u8>(), 0..30).prop_map(Some),
    ]
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        (0usize..200, "[0-9]{1,5}").prop_map(|(d, leaf)| nested(d, &leaf).into_bytes()),
        "\\{\"amount\":[0-9]{1,6},\"a\":\\{\"b\":\"[a-z]{0,5}\"\\}\\}".prop_map(String::into_bytes),
        "[a-z]=[a-z0-9%&=+]{0,30}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..512),
        // Over the 64 KiB limit.
        (64 * 1024 + 1..80 * 1024usize).prop_map(|n| vec![b'x'; n]),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    method: Method,
    path: &'static str,
    keys: Vec<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    query: Option<String>,
    body: Vec<u8>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        method(),
        prop_oneof![Just("/local"), Just("/optional"), Just("/external")],
        proptest::collection::vec(key_value(), 0..3),
        content_type(),
        proptest::option::of("[a-z]{1,3}=[a-z0-9%+]{0,8}(&[a-z]{1,3}=[a-z0-9]{0,4}){0,3}"),
        body(),
    )
        .prop_map(|(method, path, keys, content_type, query, body)| Case {
            method,
            path,
            keys,
            content_type,
            query,
            body,
        })
}

fn request(case: &Case) -> Option<Request<Body>> {
    let uri = match &case.query {
        Some(q) => format!("{}?{q}", case.path),
        None => case.path.to_owned(),
    };
    let mut builder = Request::builder().method(case.method.clone()).uri(uri);
    for key in &case.keys {
        let value = http::HeaderValue::from_bytes(key).ok()?;
        builder = builder.header("idempotency-key", value);
    }
    if let Some(ct) = &case.content_type {
        let value = http::HeaderValue::from_bytes(ct).ok()?;
        builder = builder.header(http::header::CONTENT_TYPE, value);
    }
    builder.body(Body::from(case.body.clone())).ok()
}

async fn check(app: &App, case: &Case) -> Result<(), TestCaseError> {
    // Bytes `http` itself refuses in a header never reach a server; skip those.
    let Some(req) = request(case) else {
        return Ok(());
    };
    let response = app.router.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let is_problem = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v == PROBLEM_JSON);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    prop_assert!(
        !status.is_server_error(),
        "{status} for {case:?}: {}",
        String::from_utf8_lossy(&body)
    );
    if status.is_client_error() && status != StatusCode::METHOD_NOT_ALLOWED {
        prop_assert!(is_problem, "{status} without problem+json for {case:?}");
        let problem: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| TestCaseError::fail(format!("{status}: not JSON ({e}) for {case:?}")))?;
        prop_assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("urn:idemkey:problem:"))
        );
    }
    // No record without its response once the request has ended.
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idemkey_records WHERE state <> 'completed' OR response_status IS NULL",
    )
    .fetch_one(app.store.pool())
    .await
    .unwrap();
    prop_assert_eq!(
        unfinished,
        0,
        "a record without its response after {:?}",
        case
    );
    Ok(())
}

#[test]
fn bad_input_never_panics_never_500s_never_leaves_a_half_record() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let app = runtime.block_on(app());
    let cases: u32 = std::env::var("IDEMKEY_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&case(), |case| runtime.block_on(check(&app, &case)))
        .unwrap();
}
