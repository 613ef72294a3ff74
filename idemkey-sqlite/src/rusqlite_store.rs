//! A SQLite store whose statements run on the calling thread, through rusqlite.
//!
//! sqlx's SQLite driver runs each connection on a thread of its own and hands every
//! statement there and back. Inside the writer's turn, those hand-offs cost a fresh request
//! more than SQLite's own work does (docs/decisions.md, "SQLite's writer without sqlx's
//! worker thread"). [`RusqliteStore`] calls SQLite directly instead, on the task's thread, while it
//! holds the turn: a statement is not a hand-off, and the turn is as long as the work.
//!
//! The application's effect runs on the same connection, so it is written with rusqlite
//! too: [`RusqliteTransaction`] dereferences to [`rusqlite::Connection`]. Statements are
//! synchronous and must stay short. A connection is not `Sync`, so a handler cannot hold a
//! statement across an `.await`.
//!
//! The SQL is the one [`SqliteStore`](crate::SqliteStore) runs (`sql.rs`), and the two
//! share a database file and its migrations; so is the Rust of each statement
//! (`statements.rs`), run through rusqlite's adapter (`driver.rs`), and the trait methods
//! that only call it (`forward.rs`). This file holds the methods that differ.

use idemkey_core::{EvictionNotices, Store, StoreError};
use rusqlite::Connection;

use crate::evictions::{self, Evictions};
use crate::rusqlite_connection::IdleOrWriter;
use crate::{RusqliteConnection, RusqliteStore, RusqliteTransaction};

pub(crate) fn error(e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
    match e.sqlite_error_code() {
        Some(DatabaseBusy | DatabaseLocked) => StoreError::Busy(Box::new(e)),
        _ => StoreError::Database(Box::new(e)),
    }
}

impl Store for RusqliteStore {
    type Connection = Connection;
    type Transaction = RusqliteTransaction;
    type PooledConnection = RusqliteConnection;

    async fn begin(&self) -> Result<RusqliteTransaction, StoreError> {
        let mut turn = self.shared.turn().await?;
        let conn = turn.as_mut().expect("the turn opened the writer");
        if !conn.is_autocommit() {
            // Not left so by this store; closing it rolls back whatever is open on it.
            *turn = Some(self.shared.writer_connection()?);
        }
        turn.as_ref()
            .expect("the writer is open")
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(error)?;
        Ok(RusqliteTransaction {
            turn,
            shared: self.shared.clone(),
        })
    }

    async fn commit(&self, tx: RusqliteTransaction) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn acquire(&self) -> Result<RusqliteConnection, StoreError> {
        let conn = self.shared.idle_connection()?;
        Ok(RusqliteConnection(IdleOrWriter::Idle(
            Some(conn),
            self.shared.clone(),
        )))
    }

    async fn acquire_for_write(&self) -> Result<RusqliteConnection, StoreError> {
        let turn = self.shared.turn().await?;
        Ok(RusqliteConnection(IdleOrWriter::Writer(
            turn,
            self.shared.clone(),
        )))
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.clone()))
    }

    crate::forward::store_statements!();
}

/// Reads through an idle connection of the store's, outside the writer's turn.
impl Evictions for RusqliteStore {
    async fn newest(&self) -> Result<i64, StoreError> {
        let mut conn = self.shared.idle_connection()?;
        let newest = evictions::newest(&mut conn).await;
        self.shared.give_back(conn);
        newest
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        let mut conn = self.shared.idle_connection()?;
        let after = evictions::after(&mut conn, seq).await;
        self.shared.give_back(conn);
        after
    }
}
