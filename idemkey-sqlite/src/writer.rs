//! One writer at a time, queued in the process.
//!
//! SQLite has one write lock per database. When several pooled connections ask for it at
//! once (`BEGIN IMMEDIATE`), all but one wait in SQLite's busy handler, which sleeps
//! (1, 2, 5, 10, … ms) and retries: a writer can sleep long after the lock was freed, and
//! the slowest claims wait for tens of milliseconds behind a lock that is held for less than
//! one. So a [`SqliteStore`](crate::SqliteStore)'s write transactions take turns, from a
//! fair (first come, first served) queue in memory, and hold their turn until they commit
//! or roll back. External mode's writes that commit on their own (the reservation, the
//! lease's writes) take the same turn, on the same connection
//! ([`acquire_for_write`](idemkey_core::Store::acquire_for_write)); reservations and
//! completions that arrive together share one turn and one statement
//! (`idemkey_sqlx::group`). SQLite's busy handler is
//! left with the writers this queue does not see (the application's autocommit statements
//! on [`acquire`](idemkey_core::Store::acquire)d connections, other processes).
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

use futures::StreamExt;
use idemkey_core::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqlitePool, SqliteTransactionManager};
use sqlx::{Either, Executor, SqlStr, Sqlite};
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
pub(crate) struct WriterTimedOut(pub(crate) Duration);

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
        let mut tx = self.turn(pool).await?;
        match tx
            .begin_with(SqlStr::from_static("BEGIN IMMEDIATE"), true)
            .await
        {
            Ok(()) => Ok(tx),
            Err(e) => {
                let e = error(e);
                if tx.pooled.is_none() && !matches!(e, StoreError::Busy(_)) {
                    // Whatever state the writer is in, a new connection starts clean.
                    tx.discard();
                }
                Err(e)
            }
        }
    }

    /// Waits for the turn (first come, first served) and takes the connection the
    /// transaction will run on; nothing is begun on it yet
    /// ([`SqliteTransaction::begin_with`] does).
    pub(crate) async fn turn(&self, pool: &SqlitePool) -> Result<SqliteTransaction, StoreError> {
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
        Ok(SqliteTransaction {
            turn,
            pooled,
            state: State::Idle,
        })
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

/// A connection for statements that commit on their own, from
/// [`Store::acquire`](idemkey_core::Store::acquire) (one from the pool) or
/// [`Store::acquire_for_write`](idemkey_core::Store::acquire_for_write) (the store's writer,
/// in its turn behind the transactions queued before it; nothing is begun on it). It
/// dereferences to [`SqliteConnection`].
#[derive(Debug)]
pub struct SqlitePooledConnection(PoolOrWriter);

#[derive(Debug)]
enum PoolOrWriter {
    Pool(PoolConnection<Sqlite>),
    Writer(SqliteTransaction),
}

impl SqlitePooledConnection {
    pub(crate) fn pooled(conn: PoolConnection<Sqlite>) -> Self {
        Self(PoolOrWriter::Pool(conn))
    }

    pub(crate) fn writer(turn: SqliteTransaction) -> Self {
        debug_assert_eq!(turn.state, State::Idle);
        Self(PoolOrWriter::Writer(turn))
    }
}

impl Deref for SqlitePooledConnection {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        match &self.0 {
            PoolOrWriter::Pool(conn) => conn,
            PoolOrWriter::Writer(turn) => turn,
        }
    }
}

impl DerefMut for SqlitePooledConnection {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match &mut self.0 {
            PoolOrWriter::Pool(conn) => conn,
            PoolOrWriter::Writer(turn) => turn,
        }
    }
}

/// A write transaction on a [`SqliteStore`](crate::SqliteStore) (`BEGIN IMMEDIATE`): it
/// holds SQLite's write lock and the store's writer turn until it commits or rolls back.
///
/// It dereferences to [`SqliteConnection`], so `&mut *tx` is an sqlx executor. It is begun
/// and ended through sqlx's transaction manager, which counts it: a handler's own `begin()`
/// on `&mut *tx` makes a savepoint. Dropping it without [`commit`](Self::commit) rolls it
/// back (on a panic, or when the request's future is dropped too), as sqlx's own
/// transaction does.
#[derive(Debug)]
pub struct SqliteTransaction {
    /// The writer turn, holding the store's own writer connection if it keeps one.
    turn: OwnedMutexGuard<Option<SqliteConnection>>,
    /// The connection taken from the pool for this transaction, if the store keeps no
    /// writer of its own. Declared after `turn`, but dropped before it: see `Drop`.
    pooled: Option<PoolConnection<Sqlite>>,
    /// What dropping it has to undo.
    state: State,
}

/// Where a [`SqliteTransaction`]'s connection stands, for what dropping it has to undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing begun, or ended: nothing to undo.
    Idle,
    /// Begun through sqlx's transaction manager, which counts it: dropping queues its
    /// rollback.
    Open,
    /// Not known: a statement that begins or ends the transaction failed or was cut short,
    /// and may have left SQLite in a transaction that sqlx does not count (or sqlx counting
    /// one that SQLite ended). The connection is not used again: closing it rolls back
    /// whatever is open on it.
    Unknown,
}

impl SqliteTransaction {
    /// Commits, then lets the next transaction in.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::commit(&mut self)
            .await
            .map_err(error)?;
        self.state = State::Idle;
        Ok(())
    }

    /// Rolls back, then lets the next transaction in.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        SqliteTransactionManager::rollback(&mut self)
            .await
            .map_err(error)?;
        self.state = State::Idle;
        Ok(())
    }

    /// Begins the transaction with `statement`, which starts with `BEGIN IMMEDIATE`; what
    /// follows it (when `alone` is false) runs in the transaction, in the same call to
    /// SQLite: one hand-off to the connection's worker thread. It is sent through sqlx's
    /// transaction manager, which runs it with `sqlite3_exec` (so it takes no bound
    /// parameters) and counts the transaction when it succeeds and leaves one open.
    ///
    /// A `BEGIN` sent `alone` that fails begins nothing, and one cut short after it ran is
    /// rolled back by sqlx. With statements after it, a failure or a call cut short leaves
    /// the state unknown (a statement after the `BEGIN` failed, leaving SQLite in a
    /// transaction sqlx does not count): the connection is not used again unless the caller
    /// says otherwise ([`begun_nothing`](Self::begun_nothing), [`adopt`](Self::adopt)).
    pub(crate) async fn begin_with(
        &mut self,
        statement: SqlStr,
        alone: bool,
    ) -> Result<(), sqlx::Error> {
        self.state = if alone { State::Idle } else { State::Unknown };
        SqliteTransactionManager::begin(self, Some(statement)).await?;
        self.state = State::Open;
        Ok(())
    }

    /// The connection is not used again: closing it rolls back whatever is open on it.
    pub(crate) fn discard(&mut self) {
        self.state = State::Unknown;
    }

    /// The statement [`begin_with`](Self::begin_with) sent failed at its `BEGIN`, which
    /// leaves no transaction: the connection is as it was.
    pub(crate) fn begun_nothing(&mut self) {
        self.state = State::Idle;
    }

    /// Has sqlx count the transaction that a failed [`begin_with`](Self::begin_with) left
    /// open: its `BEGIN IMMEDIATE` ran, a statement after it failed without ending the
    /// transaction (a constraint error ends only its statement). Runs no statement, but
    /// hands off to the worker thread once. Fails (and the connection is not used again)
    /// if SQLite is not in a transaction after all.
    pub(crate) async fn adopt(&mut self) -> Result<(), sqlx::Error> {
        // sqlx checks that the connection is in a transaction after its `BEGIN` statement,
        // and counts it: an empty statement runs nothing and leaves SQLite as it is.
        SqliteTransactionManager::begin(self, Some(SqlStr::from_static(""))).await?;
        self.state = State::Open;
        Ok(())
    }

    /// Runs `batch` on the transaction and commits it with the batch's own `COMMIT`, in one
    /// call (one hand-off to the worker thread). The batch holds `commit_at` statements,
    /// then `COMMIT; BEGIN`: the `BEGIN` leaves SQLite in a (deferred, empty) transaction,
    /// as sqlx counts it, which dropping `self` then rolls back (queued behind the batch on
    /// the connection, not waited for).
    ///
    /// On an error, returns it with the rows each of the batch's statements that completed
    /// before it changed, one count per statement. When it is the first `commit_at`
    /// statements that failed (fewer counts than `commit_at`), nothing was committed and, if
    /// `keep(&counts, &error)`, the transaction is still open, as sqlx counts it: dropping
    /// `self` rolls it back. On any other error the connection is not used again.
    pub(crate) async fn commit_batch(
        mut self,
        batch: Query<'_, Sqlite, SqliteArguments>,
        commit_at: usize,
        keep: impl Fn(&[u64], &sqlx::Error) -> bool,
    ) -> Result<(), (Vec<u64>, sqlx::Error)> {
        self.state = State::Unknown;
        let mut changed = Vec::new();
        let conn: &mut SqliteConnection = &mut self;
        let mut results = conn.fetch_many(batch);
        while let Some(result) = results.next().await {
            match result {
                Ok(Either::Left(done)) => changed.push(done.rows_affected()),
                Ok(Either::Right(_)) => {}
                Err(e) => {
                    drop(results);
                    if changed.len() < commit_at && keep(&changed, &e) {
                        self.state = State::Open;
                    }
                    return Err((changed, e));
                }
            }
        }
        drop(results);
        // Committed, and `BEGIN` ran again: one transaction open, as sqlx counts it.
        self.state = State::Open;
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
        match self.state {
            State::Idle => {}
            // As sqlx's own `Transaction` does: queue the rollback on the connection (it
            // also copes with a `COMMIT` that ran but whose answer was dropped). On the
            // store's own writer, the next `BEGIN` runs after it on the same connection.
            State::Open => SqliteTransactionManager::start_rollback(self),
            // Closing the connection rolls back whatever is open on it; the store's own
            // writer is opened again by the next transaction.
            State::Unknown => match &mut self.pooled {
                Some(conn) => conn.close_on_drop(),
                None => *self.turn = None,
            },
        }
        // A pooled connection goes back to the pool before the turn is released.
        drop(self.pooled.take());
    }
}
