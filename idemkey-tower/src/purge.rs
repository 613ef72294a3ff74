//! The purge: expired records deleted in the background, in bounded batches.

use std::sync::Arc;
use std::time::Duration;

use idemkey_core::{Clock, Store, protocol};
use tokio::sync::watch;

use crate::{IdempotencyLayer, Metrics};

/// Rows deleted per statement (each batch commits on its own, so live traffic is never
/// blocked for long).
pub const PURGE_BATCH: u32 = 1000;

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

/// A background task that deletes expired records every interval, in batches of
/// [`PURGE_BATCH`], counting them in the layer's [`Metrics`] (`idemkey_purged_total`).
/// The first round runs at once. The task stops when this handle is dropped.
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
    /// with `clock`'s time. (A layer's [`spawn_purge`](IdempotencyLayer::spawn_purge) fills
    /// in its own store, metrics and clock.)
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use std::time::Duration;
    /// # use idemkey_core::SystemClock;
    /// # use idemkey_sqlite::SqliteStore;
    /// # use idemkey_tower::{Metrics, PurgeTask};
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
            let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let result = protocol::purge_expired(&store, clock.now(), PURGE_BATCH).await;
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
