//! One writer at a time, queued in the process.
//!
//! SQLite has one write lock per database. When several pooled connections ask for it at
//! once (`BEGIN IMMEDIATE`), all but one wait in SQLite's busy handler, which sleeps
//! (1, 2, 5, 10, … ms) and retries: a writer can sleep long after the lock was freed, and
//! the slowest claims wait for tens of milliseconds behind a lock that is held for less than
//! one. So a [`SqliteStore`](crate::SqliteStore)'s write transactions take turns on one
//! connection of its own (the writer), from a fair (first come, first served) queue in
//! memory, and hold it until they commit or roll back; SQLite's busy handler is left with
//! the writers this queue does not see (autocommit statements on
//! [`acquire`](idemkey_core::Store::acquire)d connections, other processes).
//!
//! The writer is taken out of the pool once (so it has the pool's options and hooks) and
//! kept: a transaction does not pay the pool's ping on acquire and on release, and a
//! rollback queued on the writer when a transaction is dropped runs before the next
//! transaction's `BEGIN`, on the same connection, whatever task runs it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::StoreError;
use sqlx::SqlStr;
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteTransactionManager};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{Mutex, OnceCell, OwnedMutexGuard};

use crate::store::error;

/// The writer connection of a store and its clones (`None` until first used, and after it
/// failed), and how long a transaction waits for it.
#[derive(Debug)]
pub(crate) struct Writer {
    conn: Arc<Mutex<Option<SqliteConnection>>>,
    /// The busy time-out of the store's connections: the same bound applies in the queue.
    /// Read from the database (`PRAGMA busy_timeout`) on first use when the store was made
    /// from a pool.
    wait: OnceCell<Duration>,
}

/// A transaction gave up waiting for the writer: the busy time-out passed while other
/// transactions held it. Classified as [`StoreError::Busy`], like SQLite's `SQLITE_BUSY`.
#[derive(Debug, thiserror::Error)]
#[error("waited {0:?} (the busy time-out) for the SQLite writer")]
pub(crate) struct WriterTimedOut(Duration);

impl Writer {
    /// A writer whose waits are bounded by `busy_timeout`, or by the busy time-out the
    /// pool's connections report when `None`.
    pub(crate) fn new(busy_timeout: Option<Duration>) -> Self {
        Self {
            // tokio's mutex is fair: waiters get it in the order they asked.
            conn: Arc::new(Mutex::new(None)),
            wait: OnceCell::new_with(busy_timeout),
        }
    }

    /// Waits for the writer (first come, first served), then begins an immediate
    /// transaction on it: SQLite's write lock is taken now, not at the first write.
    pub(crate) async fn begin(&self, pool: &SqlitePool) -> Result<SqliteTransaction, StoreError> {
        let mut conn = match self.conn.clone().try_lock_owned() {
            Ok(conn) => conn,
            Err(_) => {
                let wait = self.wait(pool).await?;
                tokio::time::timeout(wait, self.conn.clone().lock_owned())
                    .await
                    .map_err(|_| StoreError::Busy(Box::new(WriterTimedOut(wait))))?
            }
        };
        let writer = match conn.as_mut() {
            Some(writer) => writer,
            None => conn.insert(pool.acquire().await.map_err(error)?.detach()),
        };
        // If this is cancelled, sqlx rolls back a `BEGIN` it ran; `conn` is dropped with it:
        // the next transaction goes.
        match SqliteTransactionManager::begin(writer, Some(SqlStr::from_static("BEGIN IMMEDIATE")))
            .await
        {
            Ok(()) => Ok(SqliteTransaction { conn, open: true }),
            Err(e) => {
                let e = error(e);
                if !matches!(e, StoreError::Busy(_)) {
                    // Whatever state it is in, a new connection starts clean.
                    *conn = None;
                }
                Err(e)
            }
        }
    }

    async fn wait(&self, pool: &SqlitePool) -> Result<Duration, StoreError> {
        self.wait
            .get_or_try_init(|| async {
                let ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                    .fetch_one(pool)
                    .await
                    .map_err(error)?;
                Ok(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
            })
            .await
            .copied()
    }
}

/// A write transaction on a [`SqliteStore`](crate::SqliteStore) (`BEGIN IMMEDIATE`): it
/// holds SQLite's write lock and the store's writer connection until it commits or rolls
/// back.
///
/// It dereferences to [`SqliteConnection`], so `&mut *tx` is an sqlx executor. Dropping it
/// without [`commit`](Self::commit) rolls it back (on a panic, or when the request's future
/// is dropped too): the rollback is queued on the writer ahead of the next transaction's
/// `BEGIN`.
#[derive(Debug)]
pub struct SqliteTransaction {
    /// The writer, `Some` while the transaction exists.
    conn: OwnedMutexGuard<Option<SqliteConnection>>,
    /// Until it is committed or rolled back.
    open: bool,
}

impl SqliteTransaction {
    /// Commits, then lets the next transaction in.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::commit(&mut self).await.map_err(error)?;
        self.open = false;
        Ok(())
    }

    /// Rolls back, then lets the next transaction in.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::rollback(&mut self).await.map_err(error)?;
        self.open = false;
        Ok(())
    }
}

impl Deref for SqliteTransaction {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.conn.as_ref().expect("the writer is there while a transaction is")
    }
}

impl DerefMut for SqliteTransaction {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.conn.as_mut().expect("the writer is there while a transaction is")
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        // As sqlx's own `Transaction` does: queue the rollback on the connection (it also
        // copes with a `COMMIT` that ran but whose answer was dropped). The writer is
        // released after this, so the next `BEGIN` on it runs after the rollback.
        if self.open {
            SqliteTransactionManager::start_rollback(self);
        }
    }
}
