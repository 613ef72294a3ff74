//! A retry storm on one key must not slow anyone else: duplicates of a request in flight
//! wait in memory for it, without a database connection. Run on PostgreSQL, where a waiting
//! claim would otherwise hold a pooled connection on the owner's row lock.
//!
//! The pool has 8 connections; 150 duplicates of one request wait while its owner is held
//! in its handler; 5 requests with other keys must then complete while the owner is still
//! held. Were the duplicates waiting in the database, they would hold every connection and
//! the 5 would wait for the pool until it gave up (503).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::KeyHasher;
use idemkey_tower::{IdempotencyLayer, KeyRequirement, Metrics, REPLAYED_HEADER};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

#[path = "support/held.rs"]
mod held;
use held::{Gate, create, store_with_effects};

fn request(key: &str, body: &str) -> Request<Body> {
    Request::post("/effects")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, bool, Bytes) {
    let response = app.clone().oneshot(req).await.unwrap();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_wait_in_memory_and_other_keys_go_on() {
    const DUPLICATES: u64 = 150;
    let store = store_with_effects(8).await;
    let metrics = Metrics::new();
    let layer = IdempotencyLayer::new(store.clone(), KeyHasher::new(b"storm"))
        .requirement(KeyRequirement::Required)
        .metrics(metrics.clone());
    let app = Router::new().route("/effects", post(create).layer(layer));

    let gate = Gate {
        entered: Arc::new(Notify::new()),
        proceed: Arc::new(Semaphore::new(0)),
    };
    let owner = {
        let mut req = request("storm", "storm");
        req.extensions_mut().insert(gate.clone());
        let app = app.clone();
        tokio::spawn(async move { send(&app, req).await })
    };
    gate.entered.notified().await;
    let duplicates: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request("storm", "storm")).await })
        })
        .collect();
    // Every duplicate is waiting in memory (bounded: they give up after the 5 s in-flight
    // wait, which fails the assertions below).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    while metrics.waiting_in_process() < DUPLICATES {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {DUPLICATES} duplicates waiting in memory",
            metrics.waiting_in_process()
        );
        tokio::task::yield_now().await;
    }

    // Other keys go on while the owner is held and the duplicates wait.
    let others: Vec<_> = (0..5)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request(&format!("other-{i}"), "other")).await })
        })
        .collect();
    for other in others {
        let (status, replayed, _) = other.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(!replayed);
    }
    assert!(!owner.is_finished(), "the owner is still held");
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "the other keys went through while every duplicate was still waiting"
    );
    assert_eq!(metrics.waiting_in_process(), DUPLICATES);

    gate.proceed.add_permits(1);
    let (status, _, first) = owner.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    for duplicate in duplicates {
        let (status, replayed, body) = duplicate.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(replayed, "a duplicate is answered with the stored outcome");
        assert_eq!(body, first);
    }
    assert_eq!(metrics.waiting_in_process(), 0);
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        effects, 6,
        "one effect for the storm's key, one per other key"
    );
}
