//! The outbox's metrics, in the Prometheus text format.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use idemkey_core::Timestamp;
use idemkey_core::outbox::OutboxStats;

/// Counters of deliveries by outcome, and the last-read sizes of the outbox. Cheap to
/// clone: clones share their counts.
#[derive(Debug, Clone, Default)]
pub struct OutboxMetrics {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    acknowledged: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
    pending_now: AtomicU64,
    dead_now: AtomicU64,
    /// Milliseconds since the epoch; 0 when nothing is pending.
    oldest_pending: AtomicI64,
    read_at: AtomicI64,
}

/// What became of one delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    Acknowledged,
    Failed,
    Dead,
}

impl OutboxMetrics {
    /// Empty counters.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn delivery(&self, outcome: Delivery) {
        let counter = match outcome {
            Delivery::Acknowledged => &self.inner.acknowledged,
            Delivery::Failed => &self.inner.failed,
            Delivery::Dead => &self.inner.dead,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn observe(&self, stats: OutboxStats, now: Timestamp) {
        self.inner
            .pending_now
            .store(stats.pending, Ordering::Relaxed);
        self.inner.dead_now.store(stats.dead, Ordering::Relaxed);
        self.inner.oldest_pending.store(
            stats.oldest_pending.map_or(0, Timestamp::as_millis),
            Ordering::Relaxed,
        );
        self.inner.read_at.store(now.as_millis(), Ordering::Relaxed);
    }

    /// Deliveries the sink acknowledged.
    pub fn acknowledged(&self) -> u64 {
        self.inner.acknowledged.load(Ordering::Relaxed)
    }

    /// Deliveries that failed and will be tried again.
    pub fn failed(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// Deliveries that failed for the last time: their message is dead.
    pub fn dead(&self) -> u64 {
        self.inner.dead.load(Ordering::Relaxed)
    }

    /// `idemkey_outbox_*` in the Prometheus text format.
    pub fn render(&self) -> String {
        let i = &self.inner;
        let oldest = i.oldest_pending.load(Ordering::Relaxed);
        let read_at = i.read_at.load(Ordering::Relaxed);
        let age = if oldest == 0 {
            0.0
        } else {
            (read_at - oldest).max(0) as f64 / 1000.0
        };
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP idemkey_outbox_pending Outbox messages waiting to be delivered.\n\
             # TYPE idemkey_outbox_pending gauge\n\
             idemkey_outbox_pending {}\n\
             # HELP idemkey_outbox_dead Outbox messages whose attempts ran out.\n\
             # TYPE idemkey_outbox_dead gauge\n\
             idemkey_outbox_dead {}\n\
             # HELP idemkey_outbox_oldest_pending_age_seconds Age of the oldest pending message.\n\
             # TYPE idemkey_outbox_oldest_pending_age_seconds gauge\n\
             idemkey_outbox_oldest_pending_age_seconds {age:.3}\n\
             # HELP idemkey_outbox_deliveries_total Delivery attempts by outcome.\n\
             # TYPE idemkey_outbox_deliveries_total counter\n\
             idemkey_outbox_deliveries_total{{outcome=\"acknowledged\"}} {}\n\
             idemkey_outbox_deliveries_total{{outcome=\"failed\"}} {}\n\
             idemkey_outbox_deliveries_total{{outcome=\"dead\"}} {}",
            i.pending_now.load(Ordering::Relaxed),
            i.dead_now.load(Ordering::Relaxed),
            i.acknowledged.load(Ordering::Relaxed),
            i.failed.load(Ordering::Relaxed),
            i.dead.load(Ordering::Relaxed),
        );
        out
    }
}
