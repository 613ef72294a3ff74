//! The layer in external mode: a handler that calls another service, counted here by an
//! in-process "bank" (a counter of calls that went out).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{KeyHasher, ListFilter, RecordState, Store};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, InFlightPolicy, Metrics, REPLAYED_HEADER};
use serde_json::Value;
use tempfile::TempDir;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Bank {
    calls: Arc<AtomicUsize>,
}

/// Steered by the body: `{"before": "fail"|"ok", "after": "ok"|"unknown"|"panic"|"502",
/// "sleep_ms": N}`. "before" happens before the point of no return, "after" after the call.
async fn transfer(State(bank): State<Bank>, op: External<SqliteStore>, body: Bytes) -> Response {
    let steer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if steer["before"] == "fail" {
        return (StatusCode::SERVICE_UNAVAILABLE, "not sent").into_response();
    }
    if let Err(rejection) = op.point_of_no_return().await {
        return rejection.into_response();
    }
    let n = bank.calls.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(ms) = steer["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match steer["after"].as_str() {
        Some("unknown") => {
            op.outcome_unknown();
            (StatusCode::GATEWAY_TIMEOUT, "the bank did not answer").into_response()
        }
        Some("panic") => panic!("the handler failed after calling out"),
        Some("502") => (StatusCode::BAD_GATEWAY, "the bank failed").into_response(),
        _ => (StatusCode::CREATED, format!("{{\"transfer\":{n}}}")).into_response(),
    }
}

async fn setup(
    lease: Duration,
    policy: InFlightPolicy,
) -> (TempDir, SqliteStore, Bank, Router, Metrics) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let bank = Bank::default();
    let metrics = Metrics::new();
    let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(b"secret"))
        .external(lease)
        .in_flight(policy)
        .metrics(metrics.clone());
    let app = Router::new()
        .route("/transfers", post(transfer).layer(layer))
        .with_state(bank.clone());
    (dir, store, bank, app, metrics)
}

async fn send(app: &Router, key: &str, body: &str) -> (StatusCode, bool, String) {
    let request = Request::post("/transfers")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        replayed,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

async fn states(store: &SqliteStore) -> Vec<RecordState> {
    let mut conn = store.acquire().await.unwrap();
    let records = store.list(&mut conn, &ListFilter::default()).await.unwrap();
    records.into_iter().map(|r| r.state).collect()
}

const LEASE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn completes_and_replays_without_calling_out_again() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let first = send(&app, "t-1", "{}").await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    let again = send(&app, "t-1", "{}").await;
    assert_eq!(again, (StatusCode::CREATED, true, first.2.clone()));
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(states(&store).await, [RecordState::Completed]);
}

#[tokio::test]
async fn unknown_outcome_is_never_re_executed() {
    let (_dir, store, bank, app, metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let body = r#"{"after":"unknown"}"#;
    assert_eq!(send(&app, "t-2", body).await.0, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(states(&store).await, [RecordState::Indeterminate]);
    for _ in 0..3 {
        let (status, _, text) = send(&app, "t-2", body).await;
        assert_eq!(status, StatusCode::CONFLICT, "{text}");
        assert!(text.contains("outcome-unknown"), "{text}");
    }
    assert_eq!(
        bank.calls.load(Ordering::SeqCst),
        1,
        "never called out again"
    );
    let text = metrics.render();
    assert!(
        text.contains("idemkey_marked_indeterminate_total 1\n"),
        "{text}"
    );
}

#[tokio::test]
async fn failure_before_the_point_of_no_return_frees_the_key() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let failed = send(&app, "t-3", r#"{"before":"fail"}"#).await;
    assert_eq!(failed.0, StatusCode::SERVICE_UNAVAILABLE);
    assert!(states(&store).await.is_empty(), "the key was released");
    assert_eq!(bank.calls.load(Ordering::SeqCst), 0);
    // The same key, now with a request that goes through, executes.
    let ok = send(&app, "t-3b", "{}").await;
    assert_eq!(ok.0, StatusCode::CREATED);
    let retry = send(&app, "t-3", r#"{"before":"ok"}"#).await;
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, false));
    assert_eq!(bank.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn failures_after_the_point_of_no_return_are_indeterminate() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let panicked = send(&app, "t-4", r#"{"after":"panic"}"#).await;
    assert_eq!(panicked.0, StatusCode::INTERNAL_SERVER_ERROR);
    let failed = send(&app, "t-5", r#"{"after":"502"}"#).await;
    assert_eq!(failed.0, StatusCode::BAD_GATEWAY);
    assert_eq!(
        states(&store).await,
        [RecordState::Indeterminate, RecordState::Indeterminate]
    );
    assert_eq!(
        send(&app, "t-4", r#"{"after":"panic"}"#).await.0,
        StatusCode::CONFLICT
    );
    assert_eq!(
        send(&app, "t-5", r#"{"after":"502"}"#).await.0,
        StatusCode::CONFLICT
    );
    assert_eq!(bank.calls.load(Ordering::SeqCst), 2, "neither ran twice");
}

/// A lease of 300 ms survives a 1.2 s call because the layer renews it: a retry arriving
/// meanwhile waits and replays, instead of finding a lapsed lease past the point of no return
/// (which would make the operation indeterminate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_renewed_while_the_handler_works() {
    let (_dir, store, bank, app, _metrics) = setup(
        Duration::from_millis(300),
        InFlightPolicy::Wait(Duration::from_secs(5)),
    )
    .await;
    let body = r#"{"sleep_ms":1200}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-6", body).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    let retry = send(&app, "t-6", body).await;
    let first = first.await.unwrap();
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    assert_eq!(retry, (StatusCode::CREATED, true, first.2));
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(states(&store).await, [RecordState::Completed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_policy_answers_409_while_the_first_attempt_runs() {
    let (_dir, _store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::Reject).await;
    let body = r#"{"sleep_ms":500}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-7", body).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _, text) = send(&app, "t-7", body).await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert!(text.contains("request-in-flight"), "{text}");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
}
