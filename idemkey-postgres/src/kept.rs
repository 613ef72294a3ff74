//! Connections the store keeps between its own transactions, out of sqlx's pool.
//!
//! sqlx's pool tests every connection given back to it: a `Sync` round trip, in a task of
//! its own, unconditional in sqlx 0.9. A connection whose transaction the store ended itself
//! with a `COMMIT` the server confirmed needs no test: its state is known (out of any
//! transaction, or in the empty one `COMMIT; BEGIN` leaves, with its `ROLLBACK` queued to go
//! out with the connection's next message). The store keeps such connections here and
//! begins its next transaction on one of them; the pool still counts them as in use.
//!
//! Bounds, so the pool's other users and its own settings keep their due:
//! - at most half the pool is kept;
//! - a connection kept unused for [`IDLE`] goes back to the pool (a task checks every
//!   [`IDLE`] while the store lives), so the application's own queries on the pool wait at
//!   most about that long for what the store is not using;
//! - one connection in [`THROUGH_THE_POOL`] goes back to the pool instead of being kept,
//!   so the pool's test and lifetime limits still see every connection in use;
//! - once the pool is closed nothing is kept or handed out.
//!
//! A kept connection the server dropped meanwhile fails at its first message, which
//! `PgStore::begin_on_pool` retries on another connection, as for a pooled one.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPool;

/// How long a connection is kept unused before it goes back to the pool.
pub(crate) const IDLE: Duration = Duration::from_millis(50);

/// One connection in this many goes back to the pool rather than being kept.
pub(crate) const THROUGH_THE_POOL: u32 = 64;

/// The store's kept connections, shared by its clones.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    capacity: usize,
    /// [`IDLE`], but for tests that must not race the sweep.
    idle: Duration,
}

#[derive(Debug)]
struct State {
    /// Most recently kept last, each with when it was kept.
    connections: Vec<(PoolConnection<Postgres>, Instant)>,
    /// Connections offered since one last went back to the pool instead.
    offered: u32,
    sweeping: bool,
}

impl Kept {
    /// Keeps up to half of `pool`'s connections (at least one).
    pub(crate) fn new(pool: &PgPool) -> Self {
        Self::with_idle(pool, IDLE)
    }

    /// Like [`new`](Self::new), a connection kept unused for `idle` going back to the pool.
    pub(crate) fn with_idle(pool: &PgPool, idle: Duration) -> Self {
        let capacity = (pool.options().get_max_connections() as usize / 2).max(1);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    connections: Vec::new(),
                    offered: 0,
                    sweeping: false,
                }),
                capacity,
                idle,
            }),
        }
    }

    /// The most recently kept connection, else one from `pool` (nothing is kept once it is
    /// closed).
    pub(crate) async fn take_or_acquire(
        &self,
        pool: &PgPool,
    ) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        if pool.is_closed() {
            drop(self.inner.drain(|_| true));
        } else if let Some((conn, _)) = self.inner.lock().connections.pop() {
            return Ok(conn);
        }
        pool.acquire().await
    }

    /// Keeps `conn`, whose transaction the store ended with a confirmed `COMMIT`, or lets
    /// it go back to the pool (dropped: the pool tests it) when the bounds say so.
    pub(crate) fn keep(&self, conn: PoolConnection<Postgres>) {
        // The sweep needs a runtime; without one the pool has it back at once.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut state = self.inner.lock();
        state.offered += 1;
        if state.offered >= THROUGH_THE_POOL || state.connections.len() >= self.inner.capacity {
            if state.offered >= THROUGH_THE_POOL {
                state.offered = 0;
            }
            drop(state);
            drop(conn);
            return;
        }
        state.connections.push((conn, Instant::now()));
        if !state.sweeping {
            state.sweeping = true;
            runtime.spawn(sweep(Arc::downgrade(&self.inner)));
        }
    }

    /// How many connections are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().connections.len()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the list half-changed.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes out the kept connections `stale` picks by when they were kept, to be dropped
    /// (given back to the pool) after the lock is released.
    fn drain(&self, stale: impl Fn(Instant) -> bool) -> Vec<PoolConnection<Postgres>> {
        let mut state = self.lock();
        // Kept in order, so the stale ones are a prefix.
        let n = state
            .connections
            .iter()
            .take_while(|(_, kept_at)| stale(*kept_at))
            .count();
        state.connections.drain(..n).map(|(conn, _)| conn).collect()
    }
}

/// Every [`IDLE`], gives the connections kept unused that long back to the pool, until the
/// store is gone.
async fn sweep(inner: Weak<Inner>) {
    let Some(idle) = inner.upgrade().map(|inner| inner.idle) else {
        return;
    };
    loop {
        tokio::time::sleep(idle).await;
        let Some(inner) = inner.upgrade() else { return };
        let now = Instant::now();
        let stale = inner.drain(|kept_at| now.duration_since(kept_at) >= idle);
        drop(inner);
        drop(stale);
    }
}
