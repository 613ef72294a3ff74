//! The example as a client sees it: a verified tenant, a replay, the status resource the
//! problem answers point to, and the metrics.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use http::{Request, StatusCode};
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
    let keys = HashMap::from([
        ("tok_alice".to_owned(), "alice".to_owned()),
        ("tok_bob".to_owned(), "bob".to_owned()),
    ]);
    let (app, _purge) = example_orders::app(store.clone(), b"test secret", Arc::new(keys))
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
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(orders, 2);

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
