//! The [`Store`] impl of [`PgStore`]: the claim protocol's statements.

use std::time::Duration;

use idemkey_core::{
    Begun, CommitError, EvictionNotices, Inserted, NewRecord, Record, RecordId, Store, StoreError,
    StoredResponse, Timestamp,
};
use idemkey_sqlx::RecordRow;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgConnection;
use sqlx::{FromRow, Postgres, Row};

use crate::PgStore;
use crate::listen::follow;
use crate::literal::{self, Bind, Sql};
use crate::statements::{
    NOT_OWNED, PREPARE, UNDEFINED_PREPARED, UNIQUE_VIOLATION, bind_completion, bind_new_record,
    bind_record, code, set_lock_wait,
};
use crate::transaction::{PgTransaction, abandon};

pub(crate) use crate::sqlstate::error;

fn record(row: RecordRow) -> Result<Record, StoreError> {
    Record::try_from(row)
}

impl Store for PgStore {
    type Connection = PgConnection;
    type Transaction = PgTransaction;
    type PooledConnection = PoolConnection<Postgres>;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        let statement = self.lock_wait.map(|wait| {
            let mut begin = Sql::new("BEGIN");
            set_lock_wait(&mut begin, wait);
            begin.finish()
        });
        match self.begin_on_pool(statement).await {
            Ok(tx) => Ok(tx),
            Err((e, conn)) => {
                if let Some(conn) = conn {
                    abandon(conn, &e).await;
                }
                Err(error(e))
            }
        }
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.kept.keep(tx.commit_keeping().await?);
        Ok(())
    }

    /// One round trip for a fresh key: `BEGIN` and a plain `INSERT` of the record (the
    /// prepared `idemkey_claim_v3`, see `PREPARE` in `statements.rs`) go in one message. A taken
    /// key fails that `INSERT` (unique violation); then the transaction begins again
    /// (`ROLLBACK; BEGIN`, one message) and [`insert`](Store::insert) claims the usual way,
    /// reading the record that took the key. Such a replay costs one message more than the
    /// usual way, and the server logs the violation as an error; the replay cache answers
    /// most replays before they reach the store.
    async fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> Result<Begun<PgTransaction>, StoreError> {
        let lock_wait = lock_wait.or(self.lock_wait);
        let lock_timeout = |sql: &mut Sql| {
            if let Some(wait) = lock_wait {
                set_lock_wait(sql, wait);
            }
        };
        let mut begin = Sql::new("BEGIN");
        lock_timeout(&mut begin);
        let claim = literal::claim(begin, record)?;
        let (e, conn) = match self.begin_on_pool(Some(claim.clone())).await {
            Ok(tx) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
            Err(failed) => failed,
        };
        // A connection that has not prepared the two statements yet (a new one, or one a
        // pooler reset): prepare them and claim again, in one message.
        let (e, conn) = match conn {
            Some(conn) if code(&e).as_deref() == Some(UNDEFINED_PREPARED) => {
                let again = format!("ROLLBACK; {PREPARE}; {claim}");
                match PgTransaction::begin(conn, Some(again)).await {
                    Ok(tx) => return Ok(Begun::Claimed(tx, Inserted::Owned)),
                    Err((e, conn)) => (e, Some(conn)),
                }
            }
            conn => (e, conn),
        };
        let taken = code(&e).as_deref() == Some(UNIQUE_VIOLATION);
        let conn = match conn {
            Some(conn) if taken => conn,
            Some(conn) => {
                abandon(conn, &e).await;
                // Only the claim's insert waits on a lock in that message.
                return match error(e) {
                    StoreError::Busy(_) => Ok(Begun::Held),
                    e => Err(e),
                };
            }
            None => return Err(error(e)),
        };
        let mut again = Sql::new("ROLLBACK; BEGIN");
        lock_timeout(&mut again);
        let mut tx = match PgTransaction::begin(conn, Some(again.finish())).await {
            Ok(tx) => tx,
            Err((e, conn)) => {
                abandon(conn, &e).await;
                return Err(error(e));
            }
        };
        match self.insert(&mut tx, record).await {
            Ok(inserted) => Ok(Begun::Claimed(tx, inserted)),
            Err(StoreError::Busy(_)) => Ok(Begun::Held),
            Err(e) => Err(e),
        }
    }

    /// One round trip: the completion (the prepared `idemkey_complete_v1`, see `PREPARE` in
    /// `statements.rs`: guarded, it fails, and so skips the `COMMIT`, unless it matched the
    /// owner's row) and `COMMIT` go in one message.
    async fn complete_and_commit(
        &self,
        tx: PgTransaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        let statements =
            literal::completion(id, token, response, now).map_err(CommitError::NotCommitted)?;
        let conn = tx
            .commit_after(statements, |code| code == NOT_OWNED)
            .await?;
        self.kept.keep(conn);
        Ok(())
    }

    async fn limit_lock_wait(
        &self,
        conn: &mut PgConnection,
        wait: Duration,
    ) -> Result<(), StoreError> {
        // Transaction-local: the next statements of this transaction (the claim among them)
        // give up waiting for a lock after `wait` with SQLSTATE 55P03, read as "busy".
        literal::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", wait.as_millis().max(1)))
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(())
    }

    /// A kept connection when there is one (so the store's reads do not wait on what its
    /// transactions keep), else one from the pool. Either goes back to the pool when dropped.
    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        self.kept.take_or_acquire(&self.pool).await.map_err(error)
    }

    /// Concurrent reservations are committed in groups, one `INSERT` of up to 64 rows each,
    /// each answered once its group committed, as [`insert`](Store::insert) would have
    /// answered it alone (a key found taken is [`Inserted::Conflict`]); one that finds
    /// nothing being written goes at once, alone. (`idemkey_sqlx::group`,
    /// `PgStore::insert_group`.)
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.grouped.insert(self, record).await
    }

    /// Concurrent completions are committed in groups, one `UPDATE` of up to 64 rows each,
    /// each answered once its group committed, as [`complete`](Store::complete) would have
    /// answered it alone. (`idemkey_sqlx::group`, `PgStore::complete_group`.)
    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.grouped.complete(self, id, token, response, now).await
    }

    async fn insert(&self, conn: &mut PgConnection, r: &NewRecord) -> Result<Inserted, StoreError> {
        // One statement for the claim and, when the key is taken, the record. Every part of
        // it runs on the statement's one snapshot: the join sees a row committed before the
        // statement began, never the row `ins` inserted, nor one committed while the insert
        // waited on it (an owner finishing); then no record comes back and the caller reads
        // it with a statement of its own. `NOT EXISTS` keeps a row deleted after the
        // snapshot from being returned beside a successful insert.
        let insert = literal::query(
            "WITH ins AS (
                 INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint,
                        fingerprint_parts, state, token, lease_expires_at, created_at,
                        updated_at, expires_at, sealed_key, fingerprint_members, first_sent)
                 VALUES ($1, $2, $3, $4, $5, $6, $13, $7, $8, $8, $9, $10, $11, $12)
                 ON CONFLICT (tenant, key_hash, route) DO NOTHING
                 RETURNING token
             )
             SELECT EXISTS (SELECT 1 FROM ins) AS inserted, r.*
               FROM (VALUES (1)) AS one (n)
               LEFT JOIN idemkey_records AS r
                 ON r.tenant = $1 AND r.key_hash = $2 AND r.route = $3
                AND NOT EXISTS (SELECT 1 FROM ins)",
        );
        let row = bind_new_record(insert, r)
            .fetch_one(conn)
            .await
            .map_err(error)?;
        if row.try_get::<bool, _>("inserted").map_err(error)? {
            return Ok(Inserted::Owned);
        }
        if row
            .try_get::<Option<String>, _>("tenant")
            .map_err(error)?
            .is_none()
        {
            return Ok(Inserted::Conflict);
        }
        let existing = RecordRow::from_row(&row).map_err(error)?;
        Ok(Inserted::Existing(Box::new(record(existing)?)))
    }

    async fn fetch(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        literal::query_as::<RecordRow>(
            "SELECT * FROM idemkey_records WHERE tenant = $1 AND key_hash = $2 AND route = $3",
        )
        .bind_id(id)
        .fetch_optional(conn)
        .await
        .map_err(error)?
        .map(record)
        .transpose()
    }

    async fn replace(
        &self,
        conn: &mut PgConnection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        // The record's values are `$1` to `$12`, as in every statement that writes one.
        let replace = literal::query_scalar(
            "UPDATE idemkey_records
                SET fingerprint = $4, fingerprint_parts = $5, state = $6, token = token + 1,
                    lease_expires_at = $7, response_status = NULL, response_headers = NULL,
                    response_body = NULL, created_at = $8, updated_at = $8, expires_at = $9,
                    sealed_key = $10, fingerprint_members = $11, first_sent = $12
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $13
             RETURNING token",
        );
        bind_record(replace, r)
            .bind(token)
            .fetch_optional(conn)
            .await
            .map_err(error)
    }

    async fn complete(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let update = literal::query(
            "UPDATE idemkey_records
                SET state = 'completed', token = token + 1, lease_expires_at = NULL,
                    response_status = $5, response_headers = $6, response_body = $7,
                    updated_at = $8
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        );
        let done = bind_completion(update, id, token, response, now)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records SET lease_expires_at = $5, updated_at = $6
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind_id(id)
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
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records
                SET state = 'executing', lease_expires_at = $5, updated_at = $6
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind_id(id)
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
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "UPDATE idemkey_records
                SET state = 'indeterminate', lease_expires_at = NULL, updated_at = $5
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind_id(id)
        .bind(token)
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        let done = literal::query(
            "DELETE FROM idemkey_records
              WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4",
        )
        .bind_id(id)
        .bind(token)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    /// `None` through a pooler in transaction mode ([`PgStore::POOLER_PARAMETER`]): a
    /// `LISTEN` there would hold on a server connection other clients get next. A listener
    /// that does not hear its own probe notice (the parameter forgotten) never reports
    /// [`EvictionNotice::Listening`](idemkey_core::EvictionNotice::Listening) either.
    fn eviction_notices(&self) -> Option<EvictionNotices> {
        if self.pooled {
            return None;
        }
        Some(follow(&self.pool))
    }
}

#[cfg(test)]
mod tests;
