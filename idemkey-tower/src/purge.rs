//! The purge: expired records deleted in the background, in bounded batches.

use std::sync::Arc;
use std::time::Duration;

use idemkey_core::{Clock, Store, StoreError, Timestamp};
use tokio::sync::watch;

use crate::{IdempotencyLayer, Metrics};

/// The most rows deleted per statement (each batch commits on its own, so live traffic is
/// never blocked for long).
pub const PURGE_BATCH: u32 = 1000;

/// The fewest rows a batch shrinks to.
const MIN_BATCH: u32 = 10;

/// How long one batch should hold the store: batches that take longer shrink, shorter ones
/// grow back (up to [`PURGE_BATCH`]).
const BATCH_TARGET: Duration = Duration::from_millis(10);

/// The size of the batch after one of `batch` rows that took `took`: halved when it held the
/// store more than twice [`BATCH_TARGET`], doubled when it took less than half of it.
fn next_batch(batch: u32, took: Duration) -> u32 {
    if took > BATCH_TARGET * 2 {
        (batch / 2).max(MIN_BATCH)
    } else if took < BATCH_TARGET / 2 {
        batch.saturating_mul(2).min(PURGE_BATCH)
    } else {
        batch
    }
}

/// One round of the purge: batches of expired records, the earliest expiry first, each
/// starting where the one before it ended, until one comes back short. Each
/// batch is a transaction of its own, so on SQLite it takes its turn in the store's writer
/// queue like any request rather than contending for the write lock; after each batch the
/// purge pauses as long as the batch took, so it holds the store at most half the time
/// while there is a backlog; and the batch size follows [`next_batch`], so one batch holds
/// it for about [`BATCH_TARGET`]. `batch` carries the size from round to round. The
/// batches are timed, and the pauses taken, on `clock`.
async fn purge_round<S: Store>(
    store: &S,
    clock: &dyn Clock,
    now: Timestamp,
    batch: &mut u32,
) -> Result<u64, StoreError> {
    let mut total = 0;
    let mut from = None;
    loop {
        let started = clock.now();
        let mut tx = store.begin().await?;
        let purged = store.purge_batch(&mut tx, now, from, *batch).await?;
        store.commit(tx).await?;
        total += purged.deleted;
        if purged.deleted < u64::from(*batch) {
            return Ok(total);
        }
        from = purged.through;
        let took = started.until(clock.now());
        *batch = next_batch(*batch, took);
        clock.sleep(took).await;
    }
}

/// What the purge has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeStats {
    /// Rounds finished (successful or not).
    pub rounds: u64,
    /// Records deleted in all.
    pub purged: u64,
    /// Rounds that failed (the store was unreachable, say); the next round tries again.
    pub failures: u64,
}

/// A background task that deletes expired records every interval, in batches of at most
/// [`PURGE_BATCH`], counting them in the layer's [`Metrics`] (`idemkey_purged_total`).
/// The first round runs at once. The task stops when this handle is dropped.
///
/// A backlog (a table full of expired records after downtime or a retention change) is
/// worked off paced: each batch in a transaction of its own, sized to hold the store for
/// about 10 ms, followed by a pause as long as it took, so requests wait behind at most one
/// batch and get the store at least half the time.
///
/// Expired records are never replayed whether or not they are purged; the purge keeps the
/// table (and its indexes) small. Start one per process, or one per database: several
/// purges on one PostgreSQL skip each other's rows.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idemkey_core::KeyHasher;
/// # use idemkey_sqlite::SqliteStore;
/// # use idemkey_tower::IdempotencyLayer;
/// # async fn run(store: SqliteStore) {
/// let idempotency = IdempotencyLayer::new(store, KeyHasher::new(b"a long random secret"));
/// let _purge = idempotency.spawn_purge(Duration::from_secs(60)); // keep it alive
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the purge stops when its handle is dropped"]
pub struct PurgeTask {
    task: tokio::task::JoinHandle<()>,
    stats: watch::Receiver<PurgeStats>,
}

impl PurgeTask {
    /// Purges `store` every `every` (at least one second apart), counting into `metrics`,
    /// reading the time and waiting between rounds on `clock`. (A layer's [`spawn_purge`](IdempotencyLayer::spawn_purge) fills
    /// in its own store, metrics and clock.)
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use std::time::Duration;
    /// # use idemkey_sqlite::SqliteStore;
    /// # use idemkey_tower::{Metrics, PurgeTask, SystemClock};
    /// # async fn run(store: SqliteStore) {
    /// let purge = PurgeTask::spawn(store, Duration::from_secs(60), Metrics::new(), Arc::new(SystemClock));
    /// let mut stats = purge.stats();
    /// stats.changed().await.ok(); // the first round, which runs at once
    /// println!("purged {} expired records", stats.borrow().purged);
    /// # }
    /// ```
    pub fn spawn<S: Store>(
        store: S,
        every: Duration,
        metrics: Metrics,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let (report, stats) = watch::channel(PurgeStats::default());
        let task = tokio::spawn(async move {
            let every = every.max(Duration::from_secs(1));
            let mut batch = PURGE_BATCH;
            loop {
                let started = clock.now();
                let result = purge_round(&store, &*clock, started, &mut batch).await;
                metrics.purge_round();
                match &result {
                    Ok(n) => {
                        metrics.purged(*n);
                        if *n > 0 {
                            tracing::info!(purged = n, "purged expired idempotency records");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "purge failed; will try again"),
                }
                report.send_modify(|s| {
                    s.rounds += 1;
                    match result {
                        Ok(n) => s.purged += n,
                        Err(_) => s.failures += 1,
                    }
                });
                // The next round starts `every` after this one started, or at once if this
                // one took longer.
                let next = started.plus(every);
                clock.sleep(clock.now().until(next)).await;
            }
        });
        Self { task, stats }
    }

    /// What the purge has done so far; `changed()` on it waits for the next round.
    pub fn stats(&self) -> watch::Receiver<PurgeStats> {
        self.stats.clone()
    }
}

impl Drop for PurgeTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// Starts the purge of this layer's store every `every`, counting into this layer's
    /// [`Metrics`] and reading this layer's clock. See [`PurgeTask`].
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use idemkey_core::KeyHasher;
    /// # use idemkey_sqlite::SqliteStore;
    /// # use idemkey_tower::IdempotencyLayer;
    /// # async fn run(store: SqliteStore) {
    /// let idempotency = IdempotencyLayer::new(store, KeyHasher::new(b"secret"));
    /// let purge = idempotency.spawn_purge(Duration::from_secs(60));
    /// // ... serve the application; dropping `purge` stops it.
    /// # drop(purge);
    /// # }
    /// ```
    pub fn spawn_purge(&self, every: Duration) -> PurgeTask {
        PurgeTask::spawn(
            self.store.clone(),
            every,
            self.config.metrics.clone(),
            self.config.clock.clone(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_batch_shrinks_and_a_quick_one_grows_back() {
        let slow = BATCH_TARGET * 3;
        let quick = BATCH_TARGET / 4;
        assert_eq!(next_batch(1000, slow), 500);
        assert_eq!(next_batch(500, BATCH_TARGET), 500, "on target: kept");
        assert_eq!(next_batch(500, quick), 1000);
        assert_eq!(
            next_batch(1000, quick),
            PURGE_BATCH,
            "never above the maximum"
        );
        let mut batch = PURGE_BATCH;
        for _ in 0..20 {
            batch = next_batch(batch, slow);
        }
        assert_eq!(batch, MIN_BATCH, "never below the minimum");
    }
}
