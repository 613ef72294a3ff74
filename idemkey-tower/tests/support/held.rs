//! A handler on PostgreSQL that a test can hold after its effect, and the store it writes
//! to, for the files that race retries against a first attempt still running
//! (`#[path]`-included where used).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::Extension;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idemkey_postgres::PgStore;
use idemkey_tower::Tx;
use tokio::sync::{Notify, Semaphore};

/// A store on a fresh database of `connections`, migrated, with the `effects` table
/// [`create`] writes.
pub(crate) async fn store_with_effects(connections: u32) -> PgStore {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .unwrap();
    let store = PgStore::connect(&url, connections).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, label TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

/// Holds the handler after its effect until the test lets it go: `entered` is notified
/// once the effect is written, and the handler answers once `proceed` has a permit.
#[derive(Clone)]
pub(crate) struct Gate {
    pub(crate) entered: Arc<Notify>,
    pub(crate) proceed: Arc<Semaphore>,
}

/// Writes the body as an effect (`effects.label`) and answers 201 with the effect's id;
/// with a [`Gate`] in its extensions, waits on it after the effect.
pub(crate) async fn create(
    gate: Option<Extension<Gate>>,
    mut tx: Tx<PgStore>,
    body: Bytes,
) -> Response {
    let id: i64 = sqlx::query_scalar("INSERT INTO effects (label) VALUES ($1) RETURNING id")
        .bind(String::from_utf8_lossy(&body).into_owned())
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    if let Some(Extension(gate)) = gate {
        gate.entered.notify_one();
        let _ = gate.proceed.acquire().await.unwrap();
    }
    (StatusCode::CREATED, id.to_string()).into_response()
}
