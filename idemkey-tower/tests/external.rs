//! The layer in external mode: a handler that calls another service, counted here by an
//! in-process "bank" (a counter of calls that went out).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemkey_core::{AfterEffect, AnswerRule, Clock};
use support::ManualClock;
use tokio::sync::{Notify, Semaphore};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{KeyHasher, ListFilter, RecordState, Store};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{
    EXPIRES_HEADER, External, IdempotencyLayer, InFlightPolicy, Metrics, REPLAYED_HEADER,
    SystemClock,
};
use serde_json::Value;
use tempfile::TempDir;
use tower::ServiceExt;

#[derive(Clone)]
struct Bank {
    calls: Arc<AtomicUsize>,
    /// Told when a held call has reached the bank.
    entered: Arc<Notify>,
    /// A held call waits here for a permit.
    proceed: Arc<Semaphore>,
}

impl Default for Bank {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            entered: Arc::default(),
            proceed: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Bank {
    /// Lets `n` held calls answer.
    fn release(&self, n: usize) {
        self.proceed.add_permits(n);
    }
}

/// Steered by the body: `{"before": "fail"|"ok", "sent": false, "after":
/// "ok"|"unknown"|"panic"|STATUS, "hold": true}`. "before" happens before the point of no
/// return, "sent": false just after it (the call handed back unwritten); the bank counts
/// the call (its effect), then, when held, waits for [`Bank::release`]; "after" is what comes
/// back.
async fn transfer(State(bank): State<Bank>, op: External<SqliteStore>, body: Bytes) -> Response {
    let steer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if steer["before"] == "fail" {
        return (StatusCode::SERVICE_UNAVAILABLE, "not sent").into_response();
    }
    if let Err(rejection) = op.point_of_no_return().await {
        return rejection.into_response();
    }
    if steer["sent"] == false {
        // The call was handed back unwritten (a kept-alive connection found closed).
        op.nothing_sent();
        return (StatusCode::SERVICE_UNAVAILABLE, "handed back unsent").into_response();
    }
    let n = bank.calls.fetch_add(1, Ordering::SeqCst) + 1;
    if steer["hold"] == true {
        bank.entered.notify_one();
        bank.proceed.acquire().await.expect("open").forget();
    }
    match &steer["after"] {
        Value::String(s) if s == "unknown" => {
            op.outcome_unknown();
            (StatusCode::GATEWAY_TIMEOUT, "the bank did not answer").into_response()
        }
        Value::String(s) if s == "panic" => panic!("the handler failed after calling out"),
        Value::Number(status) => {
            let status = StatusCode::from_u16(status.as_u64().unwrap() as u16).unwrap();
            (status, "the bank answered this after its effect").into_response()
        }
        _ => (StatusCode::CREATED, format!("{{\"transfer\":{n}}}")).into_response(),
    }
}

async fn setup(
    lease: Duration,
    policy: InFlightPolicy,
) -> (TempDir, SqliteStore, Bank, Router, Metrics) {
    setup_with(lease, policy, AnswerRule::default()).await
}

async fn setup_with(
    lease: Duration,
    policy: InFlightPolicy,
    answers: AnswerRule,
) -> (TempDir, SqliteStore, Bank, Router, Metrics) {
    setup_on(lease, policy, answers, Arc::new(SystemClock)).await
}

async fn setup_on(
    lease: Duration,
    policy: InFlightPolicy,
    answers: AnswerRule,
    clock: Arc<dyn Clock>,
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
        .answers(answers)
        .metrics(metrics.clone())
        .clock(clock);
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

/// Sends like [`send`] and answers the status and `Idempotency-Key-Expires`, if any.
async fn send_expiry(app: &Router, key: &str, body: &str) -> (StatusCode, Option<String>) {
    let request = Request::post("/transfers")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let expires = response
        .headers()
        .get(EXPIRES_HEADER)
        .map(|v| v.to_str().unwrap().to_owned());
    (response.status(), expires)
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
    let (status, first_expires) = send_expiry(&app, "t-2", body).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert!(
        first_expires.is_some(),
        "the owner tells the kept record's expiry"
    );
    assert_eq!(states(&store).await, [RecordState::Indeterminate]);
    for _ in 0..3 {
        let (status, _, text) = send(&app, "t-2", body).await;
        assert_eq!(status, StatusCode::CONFLICT, "{text}");
        assert!(text.contains("outcome-unknown"), "{text}");
    }
    assert_eq!(
        send_expiry(&app, "t-2", body).await,
        (StatusCode::CONFLICT, first_expires),
        "409 outcome-unknown carries the record's expiry"
    );
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
    let failed = send_expiry(&app, "t-3", r#"{"before":"fail"}"#).await;
    assert_eq!(
        failed,
        (StatusCode::SERVICE_UNAVAILABLE, None),
        "a released key has no record to tell the expiry of"
    );
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
async fn a_call_handed_back_unsent_after_the_point_of_no_return_frees_the_key() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let handed_back = send_expiry(&app, "t-3c", r#"{"sent":false}"#).await;
    assert_eq!(handed_back, (StatusCode::SERVICE_UNAVAILABLE, None));
    assert!(
        states(&store).await.is_empty(),
        "the key was released, not left indeterminate"
    );
    let retry = send(&app, "t-3c", "{}").await;
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, false));
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1, "the retry ran once");
}

#[tokio::test]
async fn failures_after_the_point_of_no_return_are_indeterminate() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let panicked = send(&app, "t-4", r#"{"after":"panic"}"#).await;
    assert_eq!(panicked.0, StatusCode::INTERNAL_SERVER_ERROR);
    let failed = send(&app, "t-5", r#"{"after":502}"#).await;
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
        send(&app, "t-5", r#"{"after":502}"#).await.0,
        StatusCode::CONFLICT
    );
    assert_eq!(bank.calls.load(Ordering::SeqCst), 2, "neither ran twice");
}

/// A lease of 300 ms survives a long call because the layer renews it (every third of it,
/// on the layer's clock): after the clock moved past twice the lease, the record's lease
/// still runs, and a retry waits and replays, instead of finding a lapsed lease past the
/// point of no return (which would make the operation indeterminate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_renewed_while_the_handler_works() {
    let lease = Duration::from_millis(300);
    let clock = ManualClock::new();
    let (_dir, store, bank, app, _metrics) = setup_on(
        lease,
        InFlightPolicy::Wait(Duration::from_secs(5)),
        AnswerRule::default(),
        clock.clone(),
    )
    .await;
    let body = r#"{"hold":true}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-6", body).await })
    };
    bank.entered.notified().await;
    // The renewal task sleeps a third of the lease; each step wakes it, and it sleeps again
    // once the renewal is written.
    clock.sleeping(1).await;
    let begun = clock.sleeps_begun();
    for step in 1..=6 {
        clock.advance(lease / 3);
        clock.sleeping(begun + step).await;
    }
    let mut conn = store.acquire().await.unwrap();
    let records = store.list(&mut conn, &ListFilter::default()).await.unwrap();
    drop(conn);
    let lease_ends = records[0].lease_expires_at.expect("a lease");
    assert!(
        lease_ends > clock.now(),
        "renewed past twice the lease: ends {lease_ends:?}, now {:?}",
        clock.now()
    );
    let retry = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-6", body).await })
    };
    bank.release(1);
    let first = first.await.unwrap();
    let retry = retry.await.unwrap();
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    assert_eq!(retry, (StatusCode::CREATED, true, first.2));
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(states(&store).await, [RecordState::Completed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_policy_answers_409_while_the_first_attempt_runs() {
    let (_dir, _store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::Reject).await;
    let body = r#"{"hold":true}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-7", body).await })
    };
    bank.entered.notified().await;
    let (status, _, text) = send(&app, "t-7", body).await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert!(text.contains("request-in-flight"), "{text}");
    let (status, expires) = send_expiry(&app, "t-7", body).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        expires.is_some(),
        "409 request-in-flight carries the owner's expiry"
    );
    bank.release(1);
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
}

/// (answers, body, first status, retry status, retry replayed, calls, record state)
type Row<'a> = (
    &'a AnswerRule,
    &'a str,
    u16,
    u16,
    bool,
    usize,
    Option<RecordState>,
);

/// Every row of the after-effect table (`docs/guide/contract.md`), in the layer's external mode:
/// what the retry gets and how many times the bank was called.
#[tokio::test]
async fn every_row_of_the_after_effect_table() {
    let rule: AnswerRule = "503=release 500=store".parse().unwrap();
    let rows: [Row<'_>; 8] = [
        (
            &AnswerRule::default(),
            r#"{"before":"fail"}"#,
            503,
            201,
            false,
            1,
            Some(RecordState::Completed),
        ),
        (
            &AnswerRule::default(),
            r#"{"after":"unknown"}"#,
            504,
            409,
            false,
            1,
            Some(RecordState::Indeterminate),
        ),
        (
            &AnswerRule::default(),
            r#"{"after":"panic"}"#,
            500,
            409,
            false,
            1,
            Some(RecordState::Indeterminate),
        ),
        (
            &AnswerRule::default(),
            r#"{}"#,
            201,
            201,
            true,
            1,
            Some(RecordState::Completed),
        ),
        (
            &AnswerRule::default(),
            r#"{"after":429}"#,
            429,
            429,
            false,
            2,
            None,
        ),
        (
            &AnswerRule::default(),
            r#"{"after":500}"#,
            500,
            409,
            false,
            1,
            Some(RecordState::Indeterminate),
        ),
        (
            &rule,
            r#"{"after":500}"#,
            500,
            500,
            true,
            1,
            Some(RecordState::Completed),
        ),
        (&rule, r#"{"after":503}"#, 503, 503, false, 2, None),
    ];
    for (i, (answers, body, first, retry, replayed, calls, state)) in rows.into_iter().enumerate() {
        let (_dir, store, bank, app, _metrics) =
            setup_with(LEASE, InFlightPolicy::default(), answers.clone()).await;
        let row = format!("row {i}: {body} under {answers}");
        assert_eq!(send(&app, "k", body).await.0.as_u16(), first, "{row}");
        // A retry of the same operation; a released key runs again, this time through.
        let again = if body.contains("before") { "{}" } else { body };
        let (status, is_replay, text) = send(&app, "k", again).await;
        assert_eq!(
            (status.as_u16(), is_replay),
            (retry, replayed),
            "{row}: {text}"
        );
        if retry == 409 {
            assert!(text.contains("outcome-unknown"), "{row}: {text}");
        }
        assert_eq!(bank.calls.load(Ordering::SeqCst), calls, "{row}");
        assert_eq!(
            states(&store).await,
            state.into_iter().collect::<Vec<_>>(),
            "{row}"
        );
    }
    assert_eq!(
        AnswerRule::default().classify(500),
        AfterEffect::Indeterminate,
        "the default leaves a 5xx after the effect unknown"
    );
}

/// The owner runs on a task of its own: a client that hangs up after the call went out
/// does not stop it, and the retry replays what the owner stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_whose_client_hung_up_still_records_the_outcome() {
    let (_dir, store, bank, app, _metrics) = setup(LEASE, InFlightPolicy::default()).await;
    let body = r#"{"hold":true}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "t-8", body).await })
    };
    bank.entered.notified().await;
    first.abort(); // the client hangs up while the bank works
    assert!(first.await.unwrap_err().is_cancelled());
    bank.release(1);
    let (status, replayed, text) = send(&app, "t-8", body).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "{text}");
    assert_eq!(text, r#"{"transfer":1}"#);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(states(&store).await, [RecordState::Completed]);
}

/// An answer too large to store came after the call went out: 500 `response-too-large`
/// that says so and links the status resource; the operation is left indeterminate and
/// never called again.
#[tokio::test]
async fn an_answer_too_large_to_store_is_indeterminate() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let bank = Bank::default();
    let layer = IdempotencyLayer::new(
        store.clone(),
        KeyHasher::new(b"a key secret of thirty-two bytes or more"),
    )
    .external(LEASE)
    .max_stored_response(4);
    let app = Router::new()
        .route("/transfers", post(transfer).layer(layer))
        .with_state(bank.clone());

    let (status, _, text) = send(&app, "t-9", "{}").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{text}");
    let problem: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:response-too-large");
    assert_eq!(problem["status_url"], "/idempotency/v1/keys/t-9");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("may have taken effect"),
        "{text}"
    );
    let (status, _, text) = send(&app, "t-9", "{}").await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert!(text.contains("outcome-unknown"), "{text}");
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(states(&store).await, [RecordState::Indeterminate]);
}
