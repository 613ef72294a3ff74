//! The `Tx` extractor: the handler's share of the claim's transaction.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use http::request::Parts;
use idemkey_core::Store;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::IdempotencyRejection;

/// Where the layer keeps the transaction while the handler runs.
pub(crate) type Slot<S> = Arc<Mutex<Option<<S as Store>::Transaction>>>;

/// The request extension that carries the [`Slot`] to the extractor.
pub(crate) struct TxSlot<S: Store> {
    pub(crate) slot: Slot<S>,
    /// What [`Tx::operation_id`] answers.
    pub(crate) operation: Arc<str>,
}

impl<S: Store> Clone for TxSlot<S> {
    fn clone(&self) -> Self {
        Self {
            slot: self.slot.clone(),
            operation: self.operation.clone(),
        }
    }
}

/// The database transaction in which the layer claimed the key: write the handler's effect
/// on it, and the layer stores the response in it and commits.
///
/// The handler never commits: the layer commits when the response is one the route stores,
/// and rolls back otherwise (a rejected request, a 5xx, a panic, a dropped connection).
/// `Tx<S>` dereferences to the store's connection (`SqliteConnection`, `PgConnection`), so
/// `&mut *tx` is an sqlx executor.
///
/// Only write requests on a local route get one: safe methods (`GET`, `HEAD`, `OPTIONS`,
/// `TRACE`) pass the layer untouched, so a read handler uses the pool instead (asking for a
/// `Tx` there answers 500 `transaction-unavailable`). A route in external mode has none
/// either: [`IdempotencyLayer::handler`](crate::IdempotencyLayer::handler) refuses a handler
/// that takes one there when the router is built.
///
/// ```no_run
/// use idemkey_sqlite::SqliteStore;
/// use idemkey_tower::Tx;
///
/// async fn create_order(mut tx: Tx<SqliteStore>) -> &'static str {
///     sqlx::query("INSERT INTO orders (item) VALUES ('book')")
///         .execute(&mut *tx)
///         .await
///         .unwrap();
///     "created"
/// }
/// ```
pub struct Tx<S: Store> {
    guard: OwnedMutexGuard<Option<S::Transaction>>,
    operation: Arc<str>,
}

impl<S: Store> Tx<S> {
    /// Names the operation this transaction belongs to: for a keyed request, the hex of its
    /// record's [`RecordId::digest`](idemkey_core::RecordId::digest), the same on every
    /// attempt; without a key, an id of this transaction alone. The outbox orders a
    /// transaction's messages by it.
    pub fn operation_id(&self) -> &str {
        &self.operation
    }
}

impl<S: Store> std::fmt::Debug for Tx<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx(..)")
    }
}

impl<S: Store> Deref for Tx<S> {
    type Target = S::Connection;

    fn deref(&self) -> &S::Connection {
        // The extractor only builds a `Tx` over a slot that holds a transaction, and the
        // layer takes it out only after the handler (and so this guard) is gone.
        self.guard
            .as_ref()
            .map(|tx| &**tx)
            .expect("Tx holds a transaction")
    }
}

impl<S: Store> DerefMut for Tx<S> {
    fn deref_mut(&mut self) -> &mut S::Connection {
        self.guard
            .as_mut()
            .map(|tx| &mut **tx)
            .expect("Tx holds a transaction")
    }
}

impl<S: Store, State: Send + Sync> FromRequestParts<State> for Tx<S> {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &State) -> Result<Self, Self::Rejection> {
        let TxSlot { slot, operation } = parts
            .extensions
            .get::<TxSlot<S>>()
            .ok_or(IdempotencyRejection::TransactionUnavailable)?
            .clone();
        let guard = slot
            .try_lock_owned()
            .map_err(|_| IdempotencyRejection::TransactionUnavailable)?;
        if guard.is_none() {
            return Err(IdempotencyRejection::TransactionUnavailable);
        }
        Ok(Self { guard, operation })
    }
}
