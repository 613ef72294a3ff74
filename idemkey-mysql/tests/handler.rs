//! The layer over `MySqlStore`: a handler writes its effect on `Tx<MySqlStore>`, the
//! claim's transaction, served over HTTP on loopback; a retry with the same key replays the
//! first answer and runs nothing.

mod common;

use axum::Router;
use axum::routing::post;
use common::MySqlHarness;
use idemkey_core::KeyHasher;
use idemkey_mysql::MySqlStore;
use idemkey_testkit::Harness;
use idemkey_tower::{IdempotencyLayer, REPLAYED_HEADER, Tx};

async fn create(mut tx: Tx<MySqlStore>) -> (axum::http::StatusCode, &'static str) {
    sqlx::query("INSERT INTO effects (label) VALUES ('order')")
        .execute(&mut *tx)
        .await
        .expect("effect");
    (axum::http::StatusCode::CREATED, "{\"ordered\":true}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_on_tx_runs_once_and_its_retry_replays() {
    let h = MySqlHarness::new().await;
    let layer = IdempotencyLayer::new(h.store.clone(), KeyHasher::new(b"secret"));
    let app = Router::new().route("/orders", post(layer.handler(create)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("loopback");
    let url = format!("http://{}/orders", listener.local_addr().expect("address"));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(&url)
            .header("idempotency-key", "order-1")
            .header("content-type", "application/json")
            .body("{\"sku\":\"a\"}")
            .send()
    };
    let first = send().await.expect("first");
    assert_eq!(first.status(), reqwest::StatusCode::CREATED);
    assert!(first.headers().get(REPLAYED_HEADER).is_none());
    let first = first.text().await.expect("body");
    let again = send().await.expect("again");
    assert_eq!(again.status(), reqwest::StatusCode::CREATED);
    assert!(again.headers().get(REPLAYED_HEADER).is_some());
    assert_eq!(again.text().await.expect("body"), first);
    assert_eq!(h.count_effects().await, 1);
    server.abort();
}
