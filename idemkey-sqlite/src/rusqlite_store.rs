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
//! (`statements.rs`), run through rusqlite's adapter (`driver.rs`).

use idemkey_core::{
    AuditEntry, EvictionNotices, Inserted, ListFilter, NewRecord, Purged, Record, RecordId, Store,
    StoreAdmin, StoreError, StoredResponse, Timestamp,
};
use rusqlite::Connection;

use crate::evictions::{self, Evictions};
use crate::rusqlite_connection::IdleOrWriter;
use crate::statements;
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

    /// Concurrent reservations are written in groups, in one transaction in one turn of the
    /// writer each, each answered once its group committed, as [`insert`](Store::insert)
    /// would have answered it alone (`idemkey_sqlx::group`).
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.shared.grouped.insert(self, record).await
    }

    /// Concurrent completions are written in groups, as reservations are.
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.shared
            .grouped
            .complete(self, id, token, response, now)
            .await
    }

    async fn acquire_for_write(&self) -> Result<RusqliteConnection, StoreError> {
        let turn = self.shared.turn().await?;
        Ok(RusqliteConnection(IdleOrWriter::Writer(
            turn,
            self.shared.clone(),
        )))
    }

    async fn insert(&self, conn: &mut Connection, r: &NewRecord) -> Result<Inserted, StoreError> {
        statements::insert(conn, r).await
    }

    async fn fetch(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        statements::fetch(conn, id).await
    }

    async fn replace(
        &self,
        conn: &mut Connection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        statements::replace(conn, r, token).await
    }

    async fn complete(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        statements::complete(conn, id, token, response, now).await
    }

    async fn renew(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        statements::renew(conn, id, token, lease_until, now).await
    }

    async fn mark_executing(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        statements::mark_executing(conn, id, token, lease_until, now).await
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        statements::mark_indeterminate(conn, id, token, now).await
    }

    async fn release(
        &self,
        conn: &mut Connection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        statements::release(conn, id, token).await
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.clone()))
    }
}

impl StoreAdmin for RusqliteStore {
    async fn list(
        &self,
        conn: &mut Connection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        statements::list(conn, filter).await
    }

    async fn find_by_key(
        &self,
        conn: &mut Connection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        statements::find_by_key(conn, tenant, key_hash).await
    }

    async fn evict(&self, conn: &mut Connection, id: &RecordId) -> Result<bool, StoreError> {
        statements::evict(conn, id).await
    }

    async fn purge_batch(
        &self,
        conn: &mut Connection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        statements::purge_batch(conn, now, from, batch).await
    }

    async fn append_audit(
        &self,
        conn: &mut Connection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        statements::append_audit(conn, entry).await
    }

    async fn audit(
        &self,
        conn: &mut Connection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        statements::audit(conn, id).await
    }

    async fn notify_evicted(&self, conn: &mut Connection, id: &RecordId) -> Result<(), StoreError> {
        statements::notify_evicted(conn, id).await
    }
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
