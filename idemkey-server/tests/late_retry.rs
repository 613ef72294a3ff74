//! A retry after the retention, end to end: the idempotency client against the payments API
//! on loopback. The client states its first attempt's time on every attempt, and an
//! operation resumed past the server's window ends with its typed error, never a retry;
//! without that time, the payment's reference still keeps it from being made twice.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::Request;
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use idemkey_client::{Error, IdempotentClient, Operation, RetryPolicy, header};
use idemkey_core::problem;
use idemkey_server::{ApiKeys, AppConfig, AppDb, KeySecrets, app};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{InFlightPolicy, Metrics};

const TOKEN: &str = "tok-late";

/// What the server saw of each attempt: its `Repeatability-First-Sent`.
type Seen = Arc<Mutex<Vec<Option<String>>>>;

/// A fresh SQLite file (kept while the directory lives).
async fn sqlite(dir: &std::path::Path) -> SqliteStore {
    let url = format!("sqlite:{}", dir.join("late.db").display());
    SqliteStore::connect(&url).await.unwrap()
}

/// The payments API with a one-hour retention on `db`, served on loopback. Its first keyed
/// attempt is answered 503 `store-unavailable` before it reaches the API (a database that
/// blinked), so an operation makes two attempts.
async fn server(db: impl AppDb) -> (String, Seen) {
    db.migrate_all().await.unwrap();
    let config = AppConfig {
        api_keys: ApiKeys::new([("t1".to_owned(), TOKEN.to_owned())]).unwrap(),
        simulate_latency: Duration::ZERO,
        retention: Duration::from_secs(3600),
        in_flight: InFlightPolicy::default(),
        first_sent: Default::default(),
        clock: Arc::new(idemkey_tower::SystemClock),
        outbox: None,
    };
    let secrets = KeySecrets::new(&b"late retry test secret of 32 bytes"[..], None);
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let router = app(db, &secrets, Metrics::new(), &config).layer(from_fn(
        move |req: Request, next: Next| {
            let log = log.clone();
            async move {
                if req.headers().contains_key("idempotency-key") {
                    let sent = req.headers().get(header::REPEATABILITY_FIRST_SENT);
                    let first = {
                        let mut log = log.lock().unwrap();
                        log.push(sent.and_then(|v| v.to_str().ok()).map(str::to_owned));
                        log.len() == 1
                    };
                    if first {
                        return blinked();
                    }
                }
                next.run(req).await
            }
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (base, seen)
}

fn blinked() -> Response {
    let p = &problem::STORE_UNAVAILABLE;
    let body = serde_json::json!({"type": p.uri, "title": p.title, "status": p.status});
    (
        http::StatusCode::SERVICE_UNAVAILABLE,
        [
            ("content-type", problem::PROBLEM_JSON),
            ("retry-after", "0"),
        ],
        body.to_string(),
    )
        .into_response()
}

fn payment(reference: &str) -> serde_json::Value {
    serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c-1", "reference": reference})
}

async fn total(base: &str) -> i64 {
    let list: serde_json::Value = reqwest::Client::new()
        .get(format!("{base}/v1/payments"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    list["total"].as_i64().unwrap()
}

/// An operation resumed two hours after its first attempt (the client keeps a longer
/// retention than the server's hour): the server refuses it with 412 and the client stops
/// with `Error::FirstSentExpired` at once; both attempts stated the same first-sent time.
#[tokio::test]
async fn a_resumed_operation_past_the_window_ends_with_the_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let (base, seen) = server(sqlite(dir.path()).await).await;
    let client = IdempotentClient::with_policy(
        reqwest::Client::new(),
        RetryPolicy::new().with_retention(Duration::from_secs(48 * 3600)),
    );
    let first_attempt_at = SystemTime::now() - Duration::from_secs(2 * 3600);
    let op = Operation::resume("op-resumed-late", first_attempt_at).unwrap();
    let request = client
        .inner()
        .post(format!("{base}/v1/payments"))
        .bearer_auth(TOKEN)
        .json(&payment("inv-late"));
    match client.send(&op, request).await {
        Err(Error::FirstSentExpired {
            problem, attempts, ..
        }) => {
            assert!(problem.is(problem::FIRST_SENT_EXPIRED.uri), "{problem:?}");
            assert_eq!(problem.http_status, 412);
            assert_eq!(attempts, 2, "the 503 was retried, the 412 was not");
        }
        other => panic!("expected the typed error, got {other:?}"),
    }
    let expected = Some(httpdate::fmt_http_date(first_attempt_at));
    assert_eq!(*seen.lock().unwrap(), [expected.clone(), expected]);
    assert_eq!(total(&base).await, 0, "nothing was created");
}

/// A fresh operation runs once; the same reference under another key, however late and
/// without a first-sent time, is answered 409 with the first payment's id, and a retry of
/// that key replays the 409.
#[tokio::test]
async fn a_used_reference_is_answered_with_the_existing_payment() {
    let dir = tempfile::tempdir().unwrap();
    reference_outlives_the_key(server(sqlite(dir.path()).await).await).await;
}

/// The same on PostgreSQL.
#[tokio::test]
async fn a_used_reference_is_answered_with_the_existing_payment_on_postgres() {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .unwrap();
    let db = idemkey_postgres::PgStore::connect(&url, 4).await.unwrap();
    reference_outlives_the_key(server(db).await).await;
}

async fn reference_outlives_the_key((base, seen): (String, Seen)) {
    let client = IdempotentClient::new(reqwest::Client::new());
    let op = Operation::new();
    let request = client
        .inner()
        .post(format!("{base}/v1/payments"))
        .bearer_auth(TOKEN)
        .json(&payment("inv-1"));
    let created = client.send(&op, request).await.unwrap();
    assert_eq!(created.status(), 201);
    let id: serde_json::Value = serde_json::from_slice(created.body()).unwrap();
    assert!(
        seen.lock().unwrap().iter().all(Option::is_some),
        "every attempt stated it"
    );

    let http = reqwest::Client::new();
    for _ in 0..2 {
        let again = http
            .post(format!("{base}/v1/payments"))
            .bearer_auth(TOKEN)
            .header("idempotency-key", "another-key")
            .json(&payment("inv-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), 409);
        let problem: serde_json::Value = again.json().await.unwrap();
        assert_eq!(problem["type"], problem::PAYMENT_REFERENCE_USED.uri);
        assert_eq!(problem["payment_id"], id["id"]);
    }
    assert_eq!(total(&base).await, 1);
}

/// The same on the rusqlite store, whose payment statements run one by one.
#[tokio::test]
async fn a_used_reference_is_answered_with_the_existing_payment_on_rusqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = idemkey_sqlite::RusqliteStore::open(dir.path().join("late.db")).unwrap();
    reference_outlives_the_key(server(db).await).await;
}
