//! The [`Store`] impl of [`MySqlStore`]: the claim protocol's statements.

use std::time::Duration;

use idemkey_core::{
    Begun, CommitError, Inserted, Members, NewRecord, Record, RecordId, Store, StoreError,
    StoredResponse, Timestamp,
};
use idemkey_sqlx::RecordRow;
use sqlx::mysql::{MySqlArguments, MySqlConnection, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Executor, FromRow, MySql, Transaction};

use crate::MySqlStore;
use crate::codes::{DEADLOCK, DUPLICATE_KEY, error, error_number};
use crate::sql;

/// A statement of the store's, its parameters bound in order.
pub(crate) type Statement = Query<'static, MySql, MySqlArguments>;

/// How many times a claim that InnoDB chose as a deadlock's victim begins again before it
/// answers "in flight". Each time needs yet another claimant of the same key to have won.
const DEADLOCK_ROUNDS: usize = 4;

/// A record's identity: the last parameters of a statement that finds one.
pub(crate) fn with_id(q: Statement, id: &RecordId) -> Statement {
    q.bind(&id.tenant).bind(&id.key_hash[..]).bind(&id.route)
}

/// A record's values, in the order of [`sql::INSERT`] (after the identity) and
/// [`sql::REPLACE`]: fingerprint, its parts, state, lease, created and updated (both the
/// claim's time), expiry, sealed key, fingerprint members, first sent.
fn values(q: Statement, r: &NewRecord) -> Statement {
    q.bind(&r.fingerprint.digest[..])
        .bind(&r.fingerprint.parts.to_bytes()[..])
        .bind(r.state.as_str())
        .bind(r.lease_expires_at.map(Timestamp::as_millis))
        .bind(r.now.as_millis())
        .bind(r.now.as_millis())
        .bind(r.expires_at.as_millis())
        .bind(r.sealed_key.as_deref())
        .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
        .bind(r.first_sent.map(Timestamp::as_millis))
}

/// A row of `idemkey_records` as a record.
pub(crate) fn record(row: &MySqlRow) -> Result<Record, StoreError> {
    Record::try_from(RecordRow::from_row(row).map_err(error)?)
}

/// Runs a token-guarded write: whether it matched the owner's row.
async fn guarded(conn: &mut MySqlConnection, q: Statement) -> Result<bool, StoreError> {
    Ok(q.execute(conn).await.map_err(error)?.rows_affected() == 1)
}

/// `innodb_lock_wait_timeout` for `wait`: whole seconds, rounded up so that a wait is
/// never cut shorter than asked, within InnoDB's range: at least 1 (a 1 ms bound waits 1 s),
/// at most 2^30.
fn lock_wait_seconds(wait: Duration) -> u64 {
    let whole = wait
        .as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0));
    whole.clamp(1, 1 << 30)
}

/// The claim's `INSERT`, and on a taken key (1062) the record that took it, read with a
/// locking read ([`sql::FETCH_LOCKED`]). The count of affected rows and the error number
/// say who won, never a warning (`sql::INSERT`).
async fn insert(conn: &mut MySqlConnection, r: &NewRecord) -> Result<Inserted, StoreError> {
    let insert = values(with_id(sqlx::query(sql::INSERT), &r.id), r).bind(r.token);
    match insert.execute(&mut *conn).await {
        Ok(done) if done.rows_affected() == 1 => return Ok(Inserted::Owned),
        Ok(_) => {}
        Err(e) if error_number(&e) == Some(DUPLICATE_KEY) => {}
        Err(e) => return Err(error(e)),
    }
    let row = with_id(sqlx::query(sql::FETCH_LOCKED), &r.id)
        .fetch_optional(conn)
        .await
        .map_err(error)?;
    Ok(match row.as_ref().map(record).transpose()? {
        Some(existing) => Inserted::Existing(Box::new(existing)),
        // Deleted since, on an autocommit connection whose statement ended with its lock.
        None => Inserted::Conflict,
    })
}

impl MySqlStore {
    /// Begins a transaction whose statements wait at most `wait` for a lock. One message:
    /// the session's `innodb_lock_wait_timeout`, set again by every transaction of the store
    /// (so a wait set for one does not outlast it on the pooled connection), then `BEGIN`.
    async fn begin_waiting(
        &self,
        wait: Duration,
    ) -> Result<Transaction<'static, MySql>, StoreError> {
        let begin = format!(
            "SET SESSION innodb_lock_wait_timeout = {}; BEGIN",
            lock_wait_seconds(wait)
        );
        self.pool
            .begin_with(AssertSqlSafe(begin))
            .await
            .map_err(error)
    }

    /// Runs `attempt` again, up to [`DEADLOCK_ROUNDS`] times, while InnoDB picks it as a
    /// deadlock's victim. Concurrent claims of one key deadlock when the owner rolls back:
    /// each waiter holds a shared lock on the key from its duplicate check and then wants
    /// to insert. InnoDB then rolls back the victim's WHOLE transaction, which held nothing
    /// but this claim, so beginning again is safe; the next round waits on the claimant that
    /// won, and replays its record. A lost race, never a second effect: the victim's insert
    /// never happened. Out of rounds, the last deadlock is [`StoreError::Busy`].
    async fn again_on_deadlock<T, F: Future<Output = Result<T, StoreError>>>(
        attempt: impl Fn() -> F,
    ) -> Result<T, StoreError> {
        let mut round = 1;
        loop {
            match attempt().await {
                Err(StoreError::Busy(e)) if round < DEADLOCK_ROUNDS && is_deadlock(&*e) => {
                    round += 1;
                }
                answer => return answer,
            }
        }
    }
}

fn is_deadlock(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(error_number)
        .is_some_and(|n| n == DEADLOCK)
}

impl Store for MySqlStore {
    type Connection = MySqlConnection;
    type Transaction = Transaction<'static, MySql>;
    type PooledConnection = PoolConnection<MySql>;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        self.begin_waiting(self.lock_wait).await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        tx.commit().await.map_err(error)
    }

    /// For the rest of the session: `innodb_lock_wait_timeout` in whole seconds, rounded
    /// up, at least 1 (InnoDB's least). The store's next transaction on the connection sets
    /// it again. A lock not granted in time is error 1205, read as "busy"; InnoDB then rolls
    /// back the statement only.
    async fn limit_lock_wait(
        &self,
        conn: &mut MySqlConnection,
        wait: Duration,
    ) -> Result<(), StoreError> {
        let set = format!(
            "SET SESSION innodb_lock_wait_timeout = {}",
            lock_wait_seconds(wait)
        );
        conn.execute(AssertSqlSafe(set)).await.map_err(error)?;
        Ok(())
    }

    /// The outcome stored and committed. On Galera another node's transaction that took the
    /// key first fails this one at `COMMIT` (certification) or at any statement before it
    /// (a replicated write aborting it), with error 1213: the server rolled the WHOLE
    /// transaction back, effect and claim, so nothing was committed
    /// ([`CommitError::NotCommitted`] with [`StoreError::Busy`], a lost race: read the record
    /// again). Only a commit whose answer never came is [`CommitError::Unknown`].
    async fn complete_and_commit(
        &self,
        mut tx: Self::Transaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        match self.complete(&mut tx, id, token, response, now).await {
            Ok(true) => {}
            Ok(false) => return Err(CommitError::Fenced),
            Err(e) => return Err(CommitError::NotCommitted(e)),
        }
        match tx.commit().await {
            Ok(()) => Ok(()),
            Err(e) if error_number(&e) == Some(DEADLOCK) => {
                Err(CommitError::NotCommitted(error(e)))
            }
            Err(e) => Err(CommitError::Unknown(error(e))),
        }
    }

    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        self.pool.acquire().await.map_err(error)
    }

    /// `SET` of the lock wait and `BEGIN` in one message, then the claim. A claim chosen as
    /// a deadlock's victim begins again (`again_on_deadlock`); a lock not granted in time
    /// (1205) is [`Begun::Held`].
    async fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> Result<Begun<Self::Transaction>, StoreError> {
        let wait = lock_wait.unwrap_or(self.lock_wait);
        let claimed = Self::again_on_deadlock(|| async move {
            let mut tx = self.begin_waiting(wait).await?;
            let inserted = insert(&mut tx, record).await?;
            Ok(Begun::Claimed(tx, inserted))
        })
        .await;
        match claimed {
            Err(StoreError::Busy(_)) => Ok(Begun::Held),
            claimed => claimed,
        }
    }

    /// The claim on a connection of its own, begun again while it is a deadlock's victim,
    /// as in [`begin_claim`](Store::begin_claim).
    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        Self::again_on_deadlock(|| async move {
            let mut conn = self.acquire_for_write().await?;
            insert(&mut conn, record).await
        })
        .await
    }

    /// On a transaction of the caller's, a deadlock (error 1213, "busy": the protocol
    /// answers "in flight") has rolled back the caller's WHOLE transaction, whatever it
    /// wrote before the claim.
    async fn insert(
        &self,
        conn: &mut MySqlConnection,
        r: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        insert(conn, r).await
    }

    async fn fetch(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        let row = with_id(sqlx::query(sql::FETCH), id)
            .fetch_optional(conn)
            .await
            .map_err(error)?;
        row.as_ref().map(record).transpose()
    }

    async fn replace(
        &self,
        conn: &mut MySqlConnection,
        r: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        // No `RETURNING` on MySQL: the statement raised the token it matched by one.
        let replace = with_id(values(sqlx::query(sql::REPLACE), r), &r.id).bind(token);
        Ok(guarded(conn, replace).await?.then_some(token + 1))
    }

    async fn complete(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let complete = sqlx::query(sql::COMPLETE)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(now.as_millis());
        guarded(conn, with_id(complete, id).bind(token)).await
    }

    async fn renew(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let renew = sqlx::query(sql::RENEW)
            .bind(lease_until.as_millis())
            .bind(now.as_millis());
        guarded(conn, with_id(renew, id).bind(token)).await
    }

    async fn mark_executing(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mark = sqlx::query(sql::MARK_EXECUTING)
            .bind(lease_until.as_millis())
            .bind(now.as_millis());
        guarded(conn, with_id(mark, id).bind(token)).await
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mark = sqlx::query(sql::MARK_INDETERMINATE).bind(now.as_millis());
        guarded(conn, with_id(mark, id).bind(token)).await
    }

    async fn release(
        &self,
        conn: &mut MySqlConnection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        guarded(conn, with_id(sqlx::query(sql::RELEASE), id).bind(token)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// InnoDB's wait is whole seconds, at least 1: a bound is rounded up, never cut.
    #[test]
    fn lock_waits_round_up_to_whole_seconds() {
        for (wait, seconds) in [
            (Duration::ZERO, 1),
            (Duration::from_millis(1), 1),
            (Duration::from_secs(1), 1),
            (Duration::from_millis(1500), 2),
            (Duration::from_secs(5), 5),
            (Duration::MAX, 1 << 30),
        ] {
            assert_eq!(lock_wait_seconds(wait), seconds, "{wait:?}");
        }
    }
}
