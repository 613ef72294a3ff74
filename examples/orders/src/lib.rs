//! An order service that uses idemkey the way any axum application would:
//!
//! 1. a store (SQLite, or PostgreSQL directly or behind a pooler in transaction mode) that
//!    also holds the application's tables ([`OrdersDb`]);
//! 2. an authentication middleware that verifies the caller's bearer token and puts the
//!    tenant it belongs to into the request ([`Tenant`]): keys are scoped by it, so it must
//!    come from a verified credential, never from a header the caller sets freely;
//! 3. the [`IdempotencyLayer`] on the write route, and a handler that writes its effect on
//!    the [`Tx`] it is given — the layer stores the response in the same transaction;
//! 4. the status resource that a 409 `outcome-unknown` or `request-in-flight` points to,
//!    behind the same authentication; `/metrics` in the Prometheus format; and the purge of
//!    expired records in the background.
//!
//! `src/main.rs` runs it; `tests/orders.rs` drives it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use http::{StatusCode, header};
use idemkey_core::{KeyHasher, StoreAdmin};
use idemkey_postgres::PgStore;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{IdempotencyLayer, Metrics, PurgeTask, Tenant, Tx, status_router};

/// Bearer token → tenant.
pub type ApiKeys = Arc<HashMap<String, String>>;

/// The application's own SQL, per store: its table, and the order its handler writes on the
/// claim's transaction.
pub trait OrdersDb: StoreAdmin + Clone + Send + Sync + 'static {
    /// Creates the `orders` table if it is not there.
    fn create_table(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Writes an order on `conn` (the claim's transaction); returns its id.
    fn insert_order<'a>(
        &'a self,
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        item: &'a str,
        quantity: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;
}

impl OrdersDb for SqliteStore {
    async fn create_table(&self) -> Result<(), sqlx::Error> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS orders
                 (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, item TEXT NOT NULL,
                  quantity INTEGER NOT NULL)",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn insert_order(
        &self,
        conn: &mut sqlx::SqliteConnection,
        tenant: &str,
        item: &str,
        quantity: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO orders (tenant, item, quantity) VALUES (?1, ?2, ?3) RETURNING id",
        )
        .bind(tenant)
        .bind(item)
        .bind(quantity)
        .fetch_one(conn)
        .await
    }
}

impl OrdersDb for PgStore {
    async fn create_table(&self) -> Result<(), sqlx::Error> {
        // No parameters: sqlx sends it as one simple query, which a pooler in transaction
        // mode passes whole to one server connection.
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS orders
                 (id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, item TEXT NOT NULL,
                  quantity BIGINT NOT NULL)",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn insert_order(
        &self,
        conn: &mut sqlx::PgConnection,
        tenant: &str,
        item: &str,
        quantity: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO orders (tenant, item, quantity) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(tenant)
        .bind(item)
        .bind(quantity)
        // Behind a pooler in transaction mode the next transaction may be on another server
        // connection: the statement must not be kept prepared there.
        .persistent(!self.through_pooler())
        .fetch_one(conn)
        .await
    }
}

/// The application, and its purge (which stops when the handle is dropped).
pub async fn app<S: OrdersDb>(
    store: S,
    key_secret: &[u8],
    api_keys: ApiKeys,
) -> Result<(Router, PurgeTask), sqlx::Error> {
    store.create_table().await?;
    let metrics = Metrics::new();
    let hasher = KeyHasher::new(key_secret);
    let idempotency = IdempotencyLayer::new(store.clone(), hasher.clone()).metrics(metrics.clone());
    let purge = idempotency.spawn_purge(Duration::from_secs(60));
    let authenticated = Router::new()
        .route(
            "/orders",
            post(create_order::<S>)
                .layer(idempotency.required())
                .with_state(store.clone()),
        )
        .merge(status_router(store, hasher))
        .layer(from_fn_with_state(api_keys, authenticate));
    let app = Router::new()
        .route(
            "/metrics",
            get(move || async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    metrics.render(),
                )
            }),
        )
        .merge(authenticated);
    Ok((app, purge))
}

/// The effect: one order row, written on the claim's transaction.
async fn create_order<S: OrdersDb>(
    State(store): State<S>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    mut tx: Tx<S>,
    body: axum::body::Bytes,
) -> Response {
    let Ok(order) = serde_json::from_slice::<serde_json::Value>(&body) else {
        // A 400 is not stored: the transaction rolls back and the key stays free.
        return (StatusCode::BAD_REQUEST, "body must be JSON\n").into_response();
    };
    let item = order["item"].as_str().unwrap_or("unknown").to_owned();
    let quantity = order["quantity"].as_i64().unwrap_or(1);
    let id = match store.insert_order(&mut tx, &tenant, &item, quantity).await {
        Ok(id) => id,
        // A 5xx rolls back too: no order, no record, and a retry runs afresh.
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    let body = serde_json::json!({ "id": id, "item": item, "quantity": quantity });
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        axum::Json(body),
    )
        .into_response()
}

/// The tenant from a verified credential: `Authorization: Bearer <token>` looked up in the
/// configured keys; anything else is 401.
async fn authenticate(State(keys): State<ApiKeys>, mut req: Request, next: Next) -> Response {
    let tenant = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|token| keys.get(token.trim()))
        .cloned();
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(Tenant(tenant));
            next.run(req).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
        )
            .into_response(),
    }
}
