//! The example as a client sees it: a verified tenant, a replay, the status resource the
//! problem answers point to, and the metrics; on SQLite, and on PostgreSQL behind PgBouncer
//! in transaction pooling mode.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use example_orders::OrdersDb;
use http::{Request, StatusCode};
use idemkey_postgres::PgStore;
use idemkey_sqlite::SqliteStore;
use tower::ServiceExt;

async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn order(token: Option<&str>, key: &str, body: &str) -> Request<Body> {
    let mut req = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    req.body(Body::from(body.to_owned())).unwrap()
}

#[tokio::test]
async fn orders_are_created_once_per_key_and_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("orders.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    orders_once_per_key_and_tenant(store, async || {
        sqlx::query_scalar("SELECT COUNT(*) FROM orders")
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
}

/// The same through PgBouncer in transaction mode (the URL says so to idemkey); the test
/// counts the orders on a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_are_created_once_per_key_and_tenant_through_pgbouncer() {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .unwrap();
    let direct = url.clone();
    let pooled = tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
        .await
        .unwrap();
    let pooled = format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER);
    let store = PgStore::connect(&pooled, 4).await.unwrap();
    assert!(store.through_pooler());
    store.migrate().await.unwrap();
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    orders_once_per_key_and_tenant(store, async || {
        sqlx::query_scalar("SELECT COUNT(*) FROM orders")
            .fetch_one(&admin)
            .await
            .unwrap()
    })
    .await;
}

async fn orders_once_per_key_and_tenant<S: OrdersDb>(store: S, orders: impl AsyncFn() -> i64) {
    let keys = HashMap::from([
        ("tok_alice".to_owned(), "alice".to_owned()),
        ("tok_bob".to_owned(), "bob".to_owned()),
    ]);
    let secret = b"a test secret of at least 32 bytes";
    let (app, _purge) = example_orders::app(store, secret, Arc::new(keys))
        .await
        .unwrap();
    let body = r#"{"item": "book", "quantity": 2}"#;

    let (status, _, _) = send(&app, order(None, "k1", body)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "no credential, no tenant");
    let (status, _, _) = send(&app, order(Some("forged"), "k1", body)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let (status, headers, first) = send(&app, order(Some("tok_alice"), "k1", body)).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert!(headers.contains_key("idempotency-key-expires"));
    let (status, headers, again) = send(&app, order(Some("tok_alice"), "k1", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first);
    // The same key from another tenant is another operation.
    let (status, headers, _) = send(&app, order(Some("tok_bob"), "k1", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(orders().await, 2);

    // The status resource is mounted, behind the same authentication.
    let status_req = |token: &str| {
        Request::get("/idempotency/v1/keys/k1")
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, text) = send(&app, status_req("tok_alice")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.contains("\"state\":\"completed\""), "{text}");

    let (status, _, metrics) =
        send(&app, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        metrics.contains("idemkey_requests_total{outcome=\"replayed\"} 1\n"),
        "{metrics}"
    );
}
