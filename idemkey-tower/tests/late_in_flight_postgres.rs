//! A late retry (its first-sent time past the window) that reaches another instance while
//! the first attempt still runs, on PostgreSQL in local mode: the first attempt's claim is not
//! committed, so a read of the record sees nothing; the late retry meets the claim's row and
//! answers 409 `request-in-flight`, not 412, and nothing of it lasts.

mod support;
use support::ManualClock;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{Clock, KeyHasher, Timestamp};
use idemkey_tower::{IdempotencyLayer, PROBLEM_TYPE_PREFIX, REPLAYED_HEADER};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

#[path = "support/held.rs"]
mod held;
use held::{Gate, create, store_with_effects};

/// A keyed request stating its first attempt at `sent`.
fn request(sent: Timestamp) -> Request<Body> {
    Request::post("/effects")
        .header("idempotency-key", "k-late-elsewhere")
        .header(
            "repeatability-first-sent",
            httpdate::fmt_http_date(sent.to_system_time()),
        )
        .body(Body::from("late"))
        .unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, bool, serde_json::Value) {
    let response = app.clone().oneshot(req).await.unwrap();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        replayed,
        serde_json::from_slice(&body).unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_retry_on_another_instance_meets_the_running_claim() {
    let store = store_with_effects(4).await;
    let clock = ManualClock::new();
    // Two instances: each layer made anew, as each process makes its own.
    let instance = || {
        let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(b"late elsewhere"))
            .retention(Duration::from_secs(8)) // margin: 2 s
            .no_replay_cache()
            .clock(clock.clone());
        Router::new().route("/effects", post(create).layer(layer))
    };
    let (one, other) = (instance(), instance());

    let sent = clock.now();
    let gate = Gate {
        entered: Arc::new(Notify::new()),
        proceed: Arc::new(Semaphore::new(0)),
    };
    let first = {
        let mut req = request(sent);
        req.extensions_mut().insert(gate.clone());
        let one = one.clone();
        tokio::spawn(async move { send(&one, req).await })
    };
    gate.entered.notified().await;
    clock.advance(Duration::from_secs(7)); // late, while the first attempt still runs

    let (status, _, problem) = send(&other, request(sent)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(
        problem["type"],
        format!("{PROBLEM_TYPE_PREFIX}request-in-flight")
    );

    gate.proceed.add_permits(1);
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    let (status, replayed, _) = send(&other, request(sent)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(
        replayed,
        "the late retry replays the first attempt's outcome"
    );
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(effects, 1);
}
