//! An order service that uses idemkey the way any axum application would:
//!
//! 1. a store (here SQLite) that also holds the application's tables;
//! 2. an authentication middleware that puts the caller's [`Tenant`] into the request;
//! 3. the [`IdempotencyLayer`] on the write route, and a handler that writes its effect on
//!    the [`Tx`] it is given — the layer stores the response in the same transaction.
//!
//! Run it with `cargo run -p example-orders`, then:
//!
//! ```text
//! curl -i -X POST localhost:3000/orders -H 'X-Customer: alice' \
//!      -H 'Idempotency-Key: 5b1c0d2e' -H 'Content-Type: application/json' \
//!      -d '{"item": "book", "quantity": 2}'
//! ```
//!
//! Send it again: the same 201 and body come back with `Idempotent-Replayed: true`, and there
//! is still one order.

use axum::Router;
use axum::extract::Request;
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, Tenant, Tx};

/// The effect: one order row, written on the claim's transaction.
async fn create_order(mut tx: Tx<SqliteStore>, body: axum::body::Bytes) -> Response {
    let Ok(order) = serde_json::from_slice::<serde_json::Value>(&body) else {
        // A 400 is not stored: the transaction rolls back and the key stays free.
        return (StatusCode::BAD_REQUEST, "body must be JSON\n").into_response();
    };
    let item = order["item"].as_str().unwrap_or("unknown").to_owned();
    let quantity = order["quantity"].as_i64().unwrap_or(1);
    let id: i64 = match sqlx::query_scalar(
        "INSERT INTO orders (item, quantity) VALUES (?1, ?2) RETURNING id",
    )
    .bind(&item)
    .bind(quantity)
    .fetch_one(&mut *tx)
    .await
    {
        Ok(id) => id,
        // A 5xx rolls back too: no order, no record, and a retry runs afresh.
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    let body = serde_json::json!({ "id": id, "item": item, "quantity": quantity });
    (
        StatusCode::CREATED,
        [(http::header::LOCATION, format!("/orders/{id}"))],
        axum::Json(body),
    )
        .into_response()
}

/// Stand-in authentication: a real service derives the tenant from a verified credential,
/// never from a header the caller can set freely.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let tenant = req
        .headers()
        .get("x-customer")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(Tenant(tenant));
            next.run(req).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite:orders-example.db").await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders
             (id INTEGER PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    // Keep the secret stable and out of the code in a real deployment.
    let idempotency = IdempotencyLayer::new(store, KeyHasher::new(b"example secret, change me"));
    let app = Router::new()
        .route("/orders", post(create_order).layer(idempotency.required()))
        .layer(from_fn(authenticate));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("orders example on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
