//! The [`Store`] impl of [`SqliteStore`], the methods it does not share with
//! `RusqliteStore` (the rest are in `forward.rs`), and how its SQLite errors are read.

use std::time::Duration;

use idemkey_core::{
    Begun, CommitError, EvictionNotices, Inserted, NewRecord, RecordId, Store, StoreError,
    StoredResponse, Timestamp,
};
use idemkey_sqlx::{Code, classify_error};
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqlitePool};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::SqliteStore;
use crate::batch::{BEFORE_COMMIT, COMPLETE_AND_COMMIT, claim_statement, is_fenced};
use crate::driver::arguments;
use crate::evictions::{self, Evictions};
use crate::writer::{SqlitePooledConnection, SqliteTransaction};
use crate::{params, statements};

/// What a SQLite result code says: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their
/// extended codes, are busy. SQLite has no code for a lost connection (there is none to
/// lose: an I/O error is SQLITE_IOERR, a refused statement).
fn result_code(code: &str) -> Code {
    match code.parse::<i32>() {
        Ok(c) if matches!(c & 0xff, 5 | 6) => Code::Busy,
        _ => Code::Other,
    }
}

/// Reads through a connection from the pool.
impl Evictions for SqlitePool {
    async fn newest(&self) -> Result<i64, StoreError> {
        let mut conn = self.acquire().await.map_err(error)?;
        evictions::newest(&mut *conn).await
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        let mut conn = self.acquire().await.map_err(error)?;
        evictions::after(&mut *conn, seq).await
    }
}

pub(crate) fn error(e: sqlx::Error) -> StoreError {
    classify_error(e, result_code)
}

/// The extended result codes of a claim's `INSERT` refused because the key is taken:
/// SQLITE_CONSTRAINT_PRIMARYKEY (the records' key is their primary key), and
/// SQLITE_CONSTRAINT_UNIQUE.
const TAKEN: [&str; 2] = ["1555", "2067"];

/// The SQLite extended result code of `e`, if it is a database error.
fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

impl Store for SqliteStore {
    type Connection = SqliteConnection;
    type Transaction = SqliteTransaction;
    type PooledConnection = SqlitePooledConnection;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        // In turn behind this store's other writers, then IMMEDIATE: take the write lock
        // now rather than fail later when a read transaction tries to upgrade.
        self.writer.begin(&self.pool).await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.commit().await
    }

    /// One hand-off to the writer's worker thread for a fresh key: `BEGIN IMMEDIATE` and
    /// the claim's `INSERT` in one call (`claim_statement` in this file). A taken key fails
    /// that `INSERT` and leaves the transaction open, holding the write lock; sqlx is then
    /// told to count it, and the record that took the key is read in it: three hand-offs,
    /// as step by step. `lock_wait` does not apply: SQLite's bound is its busy time-out.
    async fn begin_claim(
        &self,
        record: &NewRecord,
        _lock_wait: Option<Duration>,
    ) -> Result<Begun<SqliteTransaction>, StoreError> {
        let Some(claim) = claim_statement(record) else {
            let mut tx = self.begin().await?;
            return match self.insert(&mut tx, record).await {
                Ok(inserted) => Ok(Begun::Claimed(tx, inserted)),
                Err(StoreError::Busy(_)) => Ok(Begun::Held),
                Err(e) => Err(e),
            };
        };
        let mut tx = self.writer.turn(&self.pool).await?;
        let refused = match tx
            .begin_with(AssertSqlSafe(claim).into_sql_str(), false)
            .await
        {
            Ok(()) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
            Err(e) => e,
        };
        if !code(&refused).is_some_and(|c| TAKEN.contains(&c.as_str())) {
            let e = error(refused);
            if matches!(e, StoreError::Busy(_)) {
                // Only the `BEGIN IMMEDIATE` waits for a lock (the `INSERT` runs holding the
                // write lock), and `sqlite3_exec` stops at the first failing statement: no
                // transaction was begun.
                tx.begun_nothing();
            }
            return Err(e);
        }
        tx.adopt().await.map_err(error)?;
        // This transaction holds the write lock: the record that took the key is committed.
        let inserted = statements::taken(&mut *tx, &record.id).await?;
        Ok(Begun::Claimed(tx, inserted))
    }

    /// One hand-off to the writer's worker thread: the completion, guarded, and `COMMIT` in
    /// one call (`COMPLETE_AND_COMMIT` in this file). When the completion matches no row
    /// carrying `token`, the guard fails before the `COMMIT` and the transaction is rolled
    /// back: [`CommitError::Fenced`].
    async fn complete_and_commit(
        &self,
        tx: SqliteTransaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        let mut args = SqliteArguments::default();
        if let Err(e) = arguments(params::completion(id, token, response, now), &mut args) {
            return Err(CommitError::NotCommitted(error(e)));
        }
        let batch = sqlx::query_with(COMPLETE_AND_COMMIT, args);
        let Err((changed, e)) = tx.commit_batch(batch, BEFORE_COMMIT, is_fenced).await else {
            return Ok(());
        };
        Err(match changed.len() {
            // The completion matched no row, and the guard refused: the `COMMIT` did not run.
            _ if is_fenced(&changed, &e) => CommitError::Fenced,
            n if n < BEFORE_COMMIT && matches!(e, sqlx::Error::Database(_)) => {
                CommitError::NotCommitted(error(e))
            }
            // The `COMMIT` ran and answered; only the `BEGIN` after it failed.
            n if n > BEFORE_COMMIT => return Ok(()),
            // The `COMMIT` failed, or the call did (the worker thread gone): as a failed
            // `commit`, the outcome is not known.
            _ => CommitError::Unknown(error(e)),
        })
    }

    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        let conn = self.pool.acquire().await.map_err(error)?;
        Ok(SqlitePooledConnection::pooled(conn))
    }

    /// The writer, in its turn: external mode's autocommit writes queue with the
    /// transactions instead of meeting them in SQLite's busy handler, and pay no pool ping.
    async fn acquire_for_write(&self) -> Result<Self::PooledConnection, StoreError> {
        let turn = self.writer.turn(&self.pool).await?;
        Ok(SqlitePooledConnection::writer(turn))
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.pool.clone()))
    }

    crate::forward::store_statements!();
}
