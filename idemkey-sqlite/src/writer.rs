//! One writer at a time, queued in the process.
//!
//! SQLite has one write lock per database. When several pooled connections ask for it at
//! once (`BEGIN IMMEDIATE`), all but one wait in SQLite's busy handler, which sleeps
//! (1, 2, 5, 10, … ms) and retries: a writer can sleep long after the lock was freed, and
//! the slowest claims wait for tens of milliseconds behind a lock that is held for less than
//! one. So a [`SqliteStore`](crate::SqliteStore)'s write transactions take turns, from a
//! fair (first come, first served) queue in memory, and hold their turn until they commit
//! or roll back; SQLite's busy handler is left with
//! the writers this queue does not see (autocommit statements on
//! [`acquire`](idemkey_core::Store::acquire)d connections, other processes).
//!
//! A store from [`connect`](crate::SqliteStore::connect) takes its writer out of the pool
//! once (so it has the pool's options) and keeps it: a transaction does not pay the pool's
//! ping on acquire and on release, and a rollback queued on the writer when a transaction is
//! dropped runs before the next transaction's `BEGIN`, on the same connection. A store made
//! with [`new`](crate::SqliteStore::new) on the application's pool takes each transaction's
//! connection from the pool instead, in the same queue, so the pool's `before_acquire`
//! hooks still run for every transaction; there, a rollback of a dropped transaction may
//! still be running when the next transaction begins on another connection, and SQLite's
//! busy handler covers that.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteTransactionManager};
use sqlx::{SqlStr, Sqlite};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{Mutex, OnceCell, OwnedMutexGuard};

use crate::store::error;

/// The writer turn of a store and its clones, and how long a transaction waits for it.
#[derive(Debug)]
pub(crate) struct Writer {
    /// The turn, with the writer connection when the store keeps one of its own (`None`
    /// until first used, and after it failed).
    turn: Arc<Mutex<Option<SqliteConnection>>>,
    /// Whether the store keeps a writer connection of its own, or takes one from the pool
    /// for each transaction.
    own: bool,
    /// The busy time-out of the store's connections: the same bound applies in the queue.
    /// Read from the database (`PRAGMA busy_timeout`) on first use when the store was made
    /// from a pool.
    wait: OnceCell<Duration>,
}

/// A transaction gave up waiting for its turn: the busy time-out passed while other
/// transactions held it. Classified as [`StoreError::Busy`], like SQLite's `SQLITE_BUSY`.
#[derive(Debug, thiserror::Error)]
#[error("waited {0:?} (the busy time-out) for the SQLite writer")]
pub(crate) struct WriterTimedOut(Duration);

impl Writer {
    /// A writer queue whose waits are bounded by `busy_timeout`, or by the busy time-out the
    /// pool's connections report when `None`; with a connection of its own when `own`.
    pub(crate) fn new(busy_timeout: Option<Duration>, own: bool) -> Self {
        Self {
            // tokio's mutex is fair: waiters get it in the order they asked.
            turn: Arc::new(Mutex::new(None)),
            own,
            wait: OnceCell::new_with(busy_timeout),
        }
    }

    /// Waits for the turn (first come, first served), then begins an immediate transaction:
    /// SQLite's write lock is taken now, not at the first write.
    pub(crate) async fn begin(&self, pool: &SqlitePool) -> Result<SqliteTransaction, StoreError> {
        let mut turn = match self.turn.clone().try_lock_owned() {
            Ok(turn) => turn,
            Err(_) => {
                let wait = self.wait(pool).await?;
                tokio::time::timeout(wait, self.turn.clone().lock_owned())
                    .await
                    .map_err(|_| StoreError::Busy(Box::new(WriterTimedOut(wait))))?
            }
        };
        let pooled = if self.own {
            if turn.is_none() {
                *turn = Some(pool.acquire().await.map_err(error)?.detach());
            }
            None
        } else {
            Some(pool.acquire().await.map_err(error)?)
        };
        let mut tx = SqliteTransaction {
            turn,
            pooled,
            open: false,
        };
        // If this is cancelled, sqlx rolls back a `BEGIN` it ran, and the turn is dropped
        // with `tx`: the next transaction goes.
        let begun =
            SqliteTransactionManager::begin(&mut tx, Some(SqlStr::from_static("BEGIN IMMEDIATE")))
                .await
                .map_err(error);
        match begun {
            Ok(()) => {
                tx.open = true;
                Ok(tx)
            }
            Err(e) => {
                if tx.pooled.is_none() && !matches!(e, StoreError::Busy(_)) {
                    // Whatever state the writer is in, a new connection starts clean.
                    *tx.turn = None;
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
/// holds SQLite's write lock and the store's writer turn until it commits or rolls back.
///
/// It dereferences to [`SqliteConnection`], so `&mut *tx` is an sqlx executor. Dropping it
/// without [`commit`](Self::commit) rolls it back (on a panic, or when the request's future
/// is dropped too), as sqlx's own transaction does.
#[derive(Debug)]
pub struct SqliteTransaction {
    /// The writer turn, holding the store's own writer connection if it keeps one.
    turn: OwnedMutexGuard<Option<SqliteConnection>>,
    /// The connection taken from the pool for this transaction, if the store keeps no
    /// writer of its own. Declared after `turn`, but dropped before it: see `Drop`.
    pooled: Option<PoolConnection<Sqlite>>,
    /// Until it is committed or rolled back.
    open: bool,
}

impl SqliteTransaction {
    /// Commits, then lets the next transaction in.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::commit(&mut self)
            .await
            .map_err(error)?;
        self.open = false;
        Ok(())
    }

    /// Rolls back, then lets the next transaction in.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::rollback(&mut self)
            .await
            .map_err(error)?;
        self.open = false;
        Ok(())
    }
}

impl Deref for SqliteTransaction {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        match &self.pooled {
            Some(conn) => conn,
            None => self
                .turn
                .as_ref()
                .expect("the writer is there while a transaction is"),
        }
    }
}

impl DerefMut for SqliteTransaction {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match &mut self.pooled {
            Some(conn) => conn,
            None => self
                .turn
                .as_mut()
                .expect("the writer is there while a transaction is"),
        }
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        // As sqlx's own `Transaction` does: queue the rollback on the connection (it also
        // copes with a `COMMIT` that ran but whose answer was dropped). On the store's own
        // writer, the next `BEGIN` runs after it on the same connection.
        if self.open {
            SqliteTransactionManager::start_rollback(self);
        }
        // A pooled connection goes back to the pool before the turn is released.
        drop(self.pooled.take());
    }
}
