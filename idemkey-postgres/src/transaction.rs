//! The store's transaction: a pooled connection inside a transaction, begun and ended with
//! sqlx's own transaction manager so that sqlx knows the depth (a handler's nested
//! `begin()` on it makes a savepoint, as on an `sqlx::Transaction`), but able to carry the
//! claim in its `BEGIN` message and the completing `UPDATE` in its `COMMIT` message; and how
//! the store begins one on a kept or pooled connection.

use std::ops::{Deref, DerefMut};

use idemkey_core::{CommitError, StoreError};

use crate::sqlstate::is_connection_lost;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgTransactionManager};
use sqlx::{AssertSqlSafe, Executor, Postgres, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use crate::PgStore;
use crate::store::error;

/// An open transaction on a pooled PostgreSQL connection, [`PgStore`](crate::PgStore)'s
/// [`Store::Transaction`](idemkey_core::Store::Transaction). It dereferences to the
/// connection, so `&mut *tx` is an sqlx executor; dropped without
/// [`commit`](Self::commit), it rolls back (the `ROLLBACK` goes out with the connection's
/// next message, as an `sqlx::Transaction`'s does).
#[derive(Debug)]
pub struct PgTransaction {
    /// `None` only once a commit has handed the connection back to the store.
    conn: Option<PoolConnection<Postgres>>,
    /// The transaction sqlx counts on the connection is ours to end.
    open: bool,
}

impl PgTransaction {
    /// Begins a transaction on `conn`: with `BEGIN`, or with `statement`, which must leave
    /// the connection in a transaction (it starts with `BEGIN`; what follows it in the same
    /// message runs in the transaction). On an error the connection is given back as it is:
    /// the server may still be in the aborted transaction the message began, which
    /// [`abandon`] or a statement starting with `ROLLBACK` ends.
    pub(crate) async fn begin(
        mut conn: PoolConnection<Postgres>,
        statement: Option<String>,
    ) -> Result<Self, (sqlx::Error, PoolConnection<Postgres>)> {
        let statement = statement.map(|s| AssertSqlSafe(s).into_sql_str());
        match PgTransactionManager::begin(&mut conn, statement).await {
            Ok(()) => Ok(Self {
                conn: Some(conn),
                open: true,
            }),
            Err(e) => Err((e, conn)),
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), StoreError> {
        self.commit_keeping().await.map(drop)
    }

    /// Commits, and hands back the connection, out of any transaction, for the store to
    /// keep (`crate::kept`).
    pub(crate) async fn commit_keeping(mut self) -> Result<PoolConnection<Postgres>, StoreError> {
        PgTransactionManager::commit(self.connection())
            .await
            .map_err(error)?;
        Ok(self.ended())
    }

    fn connection(&mut self) -> &mut PoolConnection<Postgres> {
        self.conn
            .as_mut()
            .expect("a transaction holds its connection until it ends")
    }

    /// The connection of a transaction that ended, sqlx's count of it included.
    fn ended(mut self) -> PoolConnection<Postgres> {
        self.open = false;
        self.conn
            .take()
            .expect("a transaction holds its connection until it ends")
    }

    /// Rolls back now (dropping the transaction rolls it back with the connection's next
    /// message).
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        PgTransactionManager::rollback(self.connection())
            .await
            .map_err(error)?;
        self.open = false;
        Ok(())
    }

    /// Sends `statements` followed by `COMMIT` in one message, and reports what that means
    /// for the transaction: committed, refused by the server (nothing committed), or
    /// unknown (the connection failed after the message may have reached the server).
    /// `is_fenced` reads the server's refusal as [`CommitError::Fenced`]. Committed, the
    /// connection is handed back for the store to keep (`crate::kept`).
    pub(crate) async fn commit_after(
        mut self,
        statements: String,
        is_fenced: impl Fn(&str) -> bool,
    ) -> Result<PoolConnection<Postgres>, CommitError> {
        // `BEGIN` again after the `COMMIT`: the connection stays in a transaction, as sqlx
        // counts it, and the empty transaction is rolled back by a `ROLLBACK` queued here,
        // which goes out with the connection's next message: no round trip of its own.
        let batch = format!("{statements}; COMMIT; BEGIN");
        let Err(e) = sqlx::raw_sql(AssertSqlSafe(batch))
            .execute(&mut **self.connection())
            .await
        else {
            PgTransactionManager::start_rollback(self.connection());
            return Ok(self.ended());
        };
        // Which statement failed is not known here, so the connection is not reused (the
        // server rolls back what is left of the transaction when it closes).
        self.open = false;
        self.connection().close_on_drop();
        let code = match &e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        Err(match code {
            Some(code) if is_fenced(&code) => CommitError::Fenced,
            // The server answered with an error of the statements or of the `COMMIT`
            // itself: either way the transaction did not commit. Not so when the session
            // itself ended (class 08, 57: shutdown, termination; 58, XX: system errors).
            Some(code) if !["08", "57", "58", "XX"].iter().any(|c| code.starts_with(c)) => {
                CommitError::NotCommitted(error(e))
            }
            _ => CommitError::Unknown(error(e)),
        })
    }
}

impl PgStore {
    /// Begins a transaction with `statement` (`None`: `BEGIN`) on a kept connection
    /// (`crate::kept`), else a pooled one.
    ///
    /// Neither kept nor pooled connections are pinged before use, so a connection the server
    /// dropped while it sat idle (a restart, a terminated backend, an idle time-out) fails
    /// here, at its first message. Nothing of a transaction that did not commit survives its
    /// connection, so beginning again on another connection is safe. The failed connection
    /// is closed, not returned; after a restart every idle one is dead, so the attempts are
    /// bounded by the pool size (plus one new connection), not one: the first request
    /// drains them rather than each of them failing a request. Any other error is returned
    /// with its connection, which may be in the aborted transaction the message began.
    pub(crate) async fn begin_on_pool(
        &self,
        statement: Option<String>,
    ) -> Result<PgTransaction, (sqlx::Error, Option<PoolConnection<Postgres>>)> {
        let attempts = self.pool.options().get_max_connections() + 1;
        let mut attempt = 1;
        loop {
            let conn = (self.kept.take_or_acquire(&self.pool).await).map_err(|e| (e, None))?;
            match PgTransaction::begin(conn, statement.clone()).await {
                Ok(tx) => return Ok(tx),
                Err((e, mut conn)) if attempt < attempts && is_connection_lost(&e) => {
                    conn.close_on_drop();
                    attempt += 1;
                }
                Err((e, conn)) => return Err((e, Some(conn))),
            }
        }
    }
}

/// Ends what a failed [`PgTransaction::begin`] may have left open on `conn`; a connection
/// that cannot is not handed out again.
pub(crate) async fn abandon(mut conn: PoolConnection<Postgres>, e: &sqlx::Error) {
    if is_connection_lost(e) || conn.execute("ROLLBACK").await.is_err() {
        conn.close_on_drop();
    }
}

impl Deref for PgTransaction {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
            .as_ref()
            .expect("a transaction holds its connection until it ends")
    }
}

impl DerefMut for PgTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.connection()
    }
}

impl Drop for PgTransaction {
    fn drop(&mut self) {
        if self.open
            && let Some(conn) = self.conn.as_mut()
        {
            PgTransactionManager::start_rollback(conn);
        }
    }
}
