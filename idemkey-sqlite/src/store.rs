//! The [`Store`] impl of [`SqliteStore`], and how its SQLite errors are read.

use std::time::Duration;

use idemkey_core::{
    AuditEntry, Begun, CommitError, EvictionNotices, Inserted, ListFilter, Members, NewRecord,
    Purged, Record, RecordId, Store, StoreAdmin, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlx::{AuditRow, Code, RecordRow, bind_completion, classify_error};
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::SqliteStore;
use crate::batch::{BEFORE_COMMIT, COMPLETE_AND_COMMIT, claim_statement, is_fenced};
use crate::evictions::{self, EVICTION_KEPT, Evictions};
use crate::sql;
use crate::writer::{SqlitePooledConnection, SqliteTransaction};

/// What a SQLite result code says: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their
/// extended codes, are busy. SQLite has no code for a lost connection (there is none to
/// lose: an I/O error is SQLITE_IOERR, a refused statement).
fn result_code(code: &str) -> Code {
    match code.parse::<i32>() {
        Ok(c) if matches!(c & 0xff, 5 | 6) => Code::Busy,
        _ => Code::Other,
    }
}

impl Evictions for SqlitePool {
    async fn newest(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar(evictions::NEWEST)
            .fetch_one(self)
            .await
            .map_err(error)
    }

    async fn after(&self, seq: i64) -> Result<Vec<(i64, Vec<u8>)>, StoreError> {
        sqlx::query_as(evictions::AFTER)
            .bind(seq)
            .fetch_all(self)
            .await
            .map_err(error)
    }
}

pub(crate) fn error(e: sqlx::Error) -> StoreError {
    classify_error(e, result_code)
}

fn record(row: RecordRow) -> Result<Record, StoreError> {
    Record::try_from(row)
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
        let inserted = match self.fetch(&mut tx, &record.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        };
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
        let batch = bind_completion(sqlx::query(COMPLETE_AND_COMMIT), id, token, response, now);
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

    /// Concurrent reservations are written in groups, one multi-row `INSERT` in one turn of
    /// the writer each, each answered once its group committed, as [`insert`](Store::insert)
    /// would have answered it alone (a key found taken is [`Inserted::Conflict`]); one that
    /// finds nothing being written goes at once, alone. (`idemkey_sqlx::group`,
    /// `SqliteStore::insert_group`.)
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.grouped.insert(self, record).await
    }

    /// Concurrent completions are written in groups, one `UPDATE` in one turn of the writer
    /// each, each answered once its group committed, as [`complete`](Store::complete) would
    /// have answered it alone. (`idemkey_sqlx::group`, `SqliteStore::complete_group`.)
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.grouped.complete(self, id, token, response, now).await
    }

    async fn insert(
        &self,
        conn: &mut SqliteConnection,
        r: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        // Two statements. In the claim's `BEGIN IMMEDIATE` transaction this connection holds
        // the only write lock, so the row the insert conflicted with is committed and the
        // read finds it. On an autocommit connection (external mode) it may be gone by the
        // read: then `Conflict`, and the protocol reads again.
        let row: Option<i64> = sqlx::query_scalar(sql::INSERT)
            .bind(&r.id.tenant)
            .bind(&r.id.key_hash[..])
            .bind(&r.id.route)
            .bind(&r.fingerprint.digest[..])
            .bind(&r.fingerprint.parts.to_bytes()[..])
            .bind(r.state.as_str())
            .bind(r.lease_expires_at.map(Timestamp::as_millis))
            .bind(r.now.as_millis())
            .bind(r.expires_at.as_millis())
            .bind(r.sealed_key.as_deref())
            .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
            .bind(r.first_sent.map(Timestamp::as_millis))
            .fetch_optional(&mut *conn)
            .await
            .map_err(error)?;
        if row.is_some() {
            return Ok(Inserted::Owned);
        }
        Ok(match self.fetch(conn, &r.id).await? {
            Some(existing) => Inserted::Existing(Box::new(existing)),
            None => Inserted::Conflict,
        })
    }

    async fn fetch(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        sqlx::query_as::<_, RecordRow>(sql::FETCH)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .fetch_optional(conn)
            .await
            .map_err(error)?
            .map(record)
            .transpose()
    }

    async fn replace(
        &self,
        conn: &mut SqliteConnection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        sqlx::query_scalar(sql::REPLACE)
            .bind(&r.id.tenant)
            .bind(&r.id.key_hash[..])
            .bind(&r.id.route)
            .bind(&r.fingerprint.digest[..])
            .bind(&r.fingerprint.parts.to_bytes()[..])
            .bind(r.state.as_str())
            .bind(r.lease_expires_at.map(Timestamp::as_millis))
            .bind(r.now.as_millis())
            .bind(r.expires_at.as_millis())
            .bind(token)
            .bind(r.sealed_key.as_deref())
            .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
            .bind(r.first_sent.map(Timestamp::as_millis))
            .fetch_optional(conn)
            .await
            .map_err(error)
    }

    async fn complete(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = bind_completion(sqlx::query(sql::COMPLETE), id, token, response, now)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RENEW)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .bind(token)
            .bind(lease_until.as_millis())
            .bind(now.as_millis())
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_executing(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::MARK_EXECUTING)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .bind(token)
            .bind(lease_until.as_millis())
            .bind(now.as_millis())
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::MARK_INDETERMINATE)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .bind(token)
            .bind(now.as_millis())
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RELEASE)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .bind(token)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        Some(evictions::follow(self.pool.clone()))
    }
}

impl StoreAdmin for SqliteStore {
    async fn list(
        &self,
        conn: &mut SqliteConnection,
        filter: &ListFilter,
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query_as::<_, RecordRow>(sql::LIST)
            .bind(filter.tenant.as_deref())
            .bind(filter.state.map(|s| s.as_str()))
            .bind(filter.created_before.map(Timestamp::as_millis))
            .bind(filter.effective_limit())
            .fetch_all(conn)
            .await
            .map_err(error)?;
        rows.into_iter().map(record).collect()
    }

    async fn find_by_key(
        &self,
        conn: &mut SqliteConnection,
        tenant: &str,
        key_hash: &[u8; 32],
    ) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query_as::<_, RecordRow>(sql::FIND_BY_KEY)
            .bind(tenant)
            .bind(&key_hash[..])
            .fetch_all(conn)
            .await
            .map_err(error)?;
        rows.into_iter().map(record).collect()
    }

    async fn evict(&self, conn: &mut SqliteConnection, id: &RecordId) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::EVICT)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_batch(
        &self,
        conn: &mut SqliteConnection,
        now: Timestamp,
        from: Option<Timestamp>,
        batch: u32,
    ) -> Result<Purged, StoreError> {
        // SQLite has one writer at a time, so there are no locked rows to skip; a small
        // batch keeps the write lock short.
        let gone: Vec<i64> = sqlx::query_scalar(sql::PURGE_BATCH)
            .bind(now.as_millis())
            .bind(from.map_or(i64::MIN, Timestamp::as_millis))
            .bind(i64::from(batch))
            .fetch_all(conn)
            .await
            .map_err(error)?;
        Ok(Purged {
            deleted: gone.len() as u64,
            through: gone.into_iter().max().map(Timestamp),
        })
    }

    async fn append_audit(
        &self,
        conn: &mut SqliteConnection,
        entry: &AuditEntry,
    ) -> Result<(), StoreError> {
        sqlx::query(sql::APPEND_AUDIT)
            .bind(&entry.id.tenant)
            .bind(&entry.id.key_hash[..])
            .bind(&entry.id.route)
            .bind(entry.at.as_millis())
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.detail)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    async fn audit(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = sqlx::query_as::<_, AuditRow>(sql::AUDIT)
            .bind(&id.tenant)
            .bind(&id.key_hash[..])
            .bind(&id.route)
            .fetch_all(conn)
            .await
            .map_err(error)?;
        rows.into_iter().map(AuditEntry::try_from).collect()
    }

    async fn notify_evicted(
        &self,
        conn: &mut SqliteConnection,
        id: &RecordId,
    ) -> Result<(), StoreError> {
        // On the eviction's transaction: other processes read it once it commits.
        let now = Timestamp::now();
        sqlx::query(sql::TRIM_EVICTIONS)
            .bind(now.minus(EVICTION_KEPT).as_millis())
            .execute(&mut *conn)
            .await
            .map_err(error)?;
        sqlx::query(sql::NOTE_EVICTION)
            .bind(&id.digest()[..])
            .bind(now.as_millis())
            .execute(&mut *conn)
            .await
            .map_err(error)?;
        Ok(())
    }
}
