//! One writer at a time, queued in the process.
//!
//! SQLite has one write lock per database. When several pooled connections ask for it at
//! once (`BEGIN IMMEDIATE`), all but one wait in SQLite's busy handler, which sleeps
//! (1, 2, 5, 10, … ms) and retries: a writer can sleep long after the lock was freed, and
//! the slowest claims wait for tens of milliseconds behind a lock that is held for less than
//! one. So a [`SqliteStore`](crate::SqliteStore)'s write transactions first take its one
//! writer slot, from a fair (first come, first served) queue in memory, and hold it until
//! they commit or roll back; SQLite's busy handler is left with the writers this queue does
//! not see (autocommit statements on [`acquire`](idemkey_core::Store::acquire)d connections,
//! other processes).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use idemkey_core::StoreError;
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{Sqlite, Transaction};
use tokio::sync::{OnceCell, OwnedSemaphorePermit, Semaphore};

use crate::store::error;

/// The writer slot of a store and its clones, and how long a writer waits for it.
#[derive(Debug)]
pub(crate) struct Writer {
    slot: Arc<Semaphore>,
    /// The busy time-out of the store's connections: the same bound applies in the queue.
    /// Read from the database (`PRAGMA busy_timeout`) on first use when the store was made
    /// from a pool.
    wait: OnceCell<Duration>,
}

/// A writer gave up waiting for the writer slot: the busy time-out passed while other
/// transactions held it. Classified as [`StoreError::Busy`], like SQLite's `SQLITE_BUSY`.
#[derive(Debug, thiserror::Error)]
#[error("waited {0:?} (the busy time-out) for the SQLite writer slot")]
pub(crate) struct SlotTimedOut(Duration);

impl Writer {
    /// A writer slot whose waits are bounded by `busy_timeout`, or by the busy time-out the
    /// pool's connections report when `None`.
    pub(crate) fn new(busy_timeout: Option<Duration>) -> Self {
        Self {
            slot: Arc::new(Semaphore::new(1)),
            wait: OnceCell::new_with(busy_timeout),
        }
    }

    /// Waits for the slot (first come, first served), then begins an immediate transaction:
    /// SQLite's write lock is taken now, not at the first write.
    pub(crate) async fn begin(&self, pool: &SqlitePool) -> Result<SqliteTransaction, StoreError> {
        let wait = *self
            .wait
            .get_or_try_init(|| async {
                let ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                    .fetch_one(pool)
                    .await
                    .map_err(error)?;
                Ok::<_, StoreError>(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
            })
            .await?;
        let slot = match self.slot.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => tokio::time::timeout(wait, self.slot.clone().acquire_owned())
                .await
                .map_err(|_| StoreError::Busy(Box::new(SlotTimedOut(wait))))?
                // The semaphore is never closed.
                .map_err(|e| StoreError::Database(Box::new(e)))?,
        };
        // If this fails or is cancelled, `slot` is dropped with it: the next writer goes.
        let tx = pool.begin_with("BEGIN IMMEDIATE").await.map_err(error)?;
        Ok(SqliteTransaction {
            tx: Some(tx),
            slot: Some(slot),
        })
    }
}

/// A write transaction on a [`SqliteStore`](crate::SqliteStore) (`BEGIN IMMEDIATE`): it
/// holds SQLite's write lock and the store's writer slot until it commits or rolls back.
///
/// It dereferences to [`SqliteConnection`], so `&mut *tx` is an sqlx executor. Dropping it
/// without [`commit`](Self::commit) rolls it back (on a panic, or when the request's future
/// is dropped too); the next writer is let in once the rollback has run, so it never meets
/// the lock in SQLite's busy handler.
#[derive(Debug)]
pub struct SqliteTransaction {
    /// `Some` until the transaction ends.
    tx: Option<Transaction<'static, Sqlite>>,
    /// `Some` until the transaction ends; released after it.
    slot: Option<OwnedSemaphorePermit>,
}

impl SqliteTransaction {
    /// Commits, then lets the next writer in.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        let tx = self.tx.take().expect("a transaction is open until it ends");
        let done = tx.commit().await.map_err(error);
        drop(self.slot.take());
        done
    }

    /// Rolls back, then lets the next writer in.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        let tx = self.tx.take().expect("a transaction is open until it ends");
        let done = tx.rollback().await.map_err(error);
        drop(self.slot.take());
        done
    }
}

impl Deref for SqliteTransaction {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.tx.as_deref().expect("a transaction is open until it ends")
    }
}

impl DerefMut for SqliteTransaction {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.tx
            .as_deref_mut()
            .expect("a transaction is open until it ends")
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        let (Some(tx), slot) = (self.tx.take(), self.slot.take()) else {
            return;
        };
        // Roll back before the next writer begins. Without a runtime (or if the task never
        // runs), dropping the transaction queues its rollback on the connection's worker
        // instead, ahead of anything else on that connection, and the slot is freed at once:
        // a writer on another connection may then wait out the rollback in SQLite's busy
        // handler, as every writer did before this queue.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = tx.rollback().await;
                    drop(slot);
                });
            }
            Err(_) => drop((tx, slot)),
        }
    }
}
