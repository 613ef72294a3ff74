//! Runs the order service of `src/lib.rs` on 127.0.0.1:3000:
//!
//! ```text
//! ORDERS_API_KEYS=alice=tok_alice ORDERS_KEY_SECRET=change-me cargo run -p example-orders
//! curl -i -X POST localhost:3000/orders -H 'Authorization: Bearer tok_alice' \
//!      -H 'Idempotency-Key: 5b1c0d2e' -H 'Content-Type: application/json' \
//!      -d '{"item": "book", "quantity": 2}'
//! ```
//!
//! Send it again: the same 201 and body come back with `Idempotent-Replayed: true`, and there
//! is still one order. `GET /idempotency/v1/keys/5b1c0d2e` (same token) shows the record;
//! `GET /metrics` the counters.

use std::collections::HashMap;
use std::sync::Arc;

use example_orders::app;
use idemkey_sqlite::SqliteStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let keys = std::env::var("ORDERS_API_KEYS").unwrap_or_else(|_| {
        eprintln!("ORDERS_API_KEYS is not set: using the demo token alice=tok_alice");
        "alice=tok_alice".to_owned()
    });
    let api_keys: HashMap<String, String> = keys
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(tenant, token)| (token.trim().to_owned(), tenant.trim().to_owned()))
        .collect();
    // Keep the secret stable, out of the code and out of the database in a real deployment.
    let secret = std::env::var("ORDERS_KEY_SECRET").unwrap_or_else(|_| {
        eprintln!("ORDERS_KEY_SECRET is not set: using a fixed example secret");
        "example secret, change me".to_owned()
    });

    let store = SqliteStore::connect("sqlite:orders-example.db").await?;
    store.migrate().await?;
    let (app, _purge) = app(store, secret.as_bytes(), Arc::new(api_keys)).await?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("orders example on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
