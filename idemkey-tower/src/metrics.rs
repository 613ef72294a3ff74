//! Counters and latency histograms, rendered in the Prometheus text format.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemkey_core::AfterEffect;

/// What happened to one keyed request; a label of the counters and histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its outcome was stored.
    Executed,
    /// The handler ran and its outcome was not stored (rolled back).
    NotStored,
    /// A stored outcome was replayed.
    Replayed,
    /// 422: the key was used with another request.
    Mismatched,
    /// 409: the first attempt is still running.
    InFlight,
    /// 409: the outcome is unknown.
    Indeterminate,
    /// 503: the store failed.
    StoreError,
    /// 400 / 412 / 413: the request was refused before any claim.
    Rejected,
}

const OUTCOMES: [(Outcome, &str); 8] = [
    (Outcome::Executed, "executed"),
    (Outcome::NotStored, "not_stored"),
    (Outcome::Replayed, "replayed"),
    (Outcome::Mismatched, "mismatched"),
    (Outcome::InFlight, "in_flight"),
    (Outcome::Indeterminate, "indeterminate"),
    (Outcome::StoreError, "store_error"),
    (Outcome::Rejected, "rejected"),
];

/// What a reconciler made of one operation whose outcome was unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reconciled {
    /// The other service knew the operation: its answer is stored and replayed.
    Completed,
    /// The other service did not know it: the key is free, the next retry executes.
    Released,
    /// No usable answer: still unknown, asked again later.
    StillUnknown,
}

const RECONCILED: [(Reconciled, &str); 3] = [
    (Reconciled::Completed, "resolved_completed"),
    (Reconciled::Released, "resolved_released"),
    (Reconciled::StillUnknown, "still_unknown"),
];

/// The writes an external-mode owner makes once it is done, as metric labels.
const OWNER_WRITES: [(AfterEffect, &str); 3] = [
    (AfterEffect::Complete, "complete"),
    (AfterEffect::Release, "release"),
    (AfterEffect::Indeterminate, "indeterminate"),
];

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    attempts: AtomicU64,
    outcomes: [AtomicU64; OUTCOMES.len()],
    latency: [Histogram; OUTCOMES.len()],
    purged: AtomicU64,
    purge_rounds: AtomicU64,
    marked_indeterminate: AtomicU64,
    owner_write_failures: [AtomicU64; OWNER_WRITES.len()],
    reconciled: [AtomicU64; RECONCILED.len()],
    replay_cache_hits: AtomicU64,
    waiting_in_process: AtomicU64,
}

/// One request counted in `idemkey_waiting_in_process` while it lives.
pub(crate) struct Waiting(Arc<Inner>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting_in_process.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The layer's metrics. Cheap to clone; share one between the layers of an application and
/// render it at `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    inner: Arc<Inner>,
}

fn index(outcome: Outcome) -> usize {
    OUTCOMES
        .iter()
        .position(|(o, _)| *o == outcome)
        .unwrap_or(OUTCOMES.len() - 1)
}

impl Metrics {
    /// Empty metrics. Share one across the layers of an application, and render it.
    ///
    /// ```no_run
    /// use axum::{Router, routing::get};
    /// use idemkey_core::KeyHasher;
    /// use idemkey_sqlite::SqliteStore;
    /// use idemkey_tower::{IdempotencyLayer, Metrics};
    ///
    /// # async fn run(store: SqliteStore) {
    /// let metrics = Metrics::new();
    /// let idempotency =
    ///     IdempotencyLayer::new(store, KeyHasher::new(b"secret")).metrics(metrics.clone());
    /// let app: Router = Router::new()
    ///     // .route("/orders", post(create_order).layer(idempotency.clone().required()))
    ///     .route("/metrics", get(move || async move { metrics.render() }));
    /// # let _ = idempotency;
    /// # }
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one transport attempt on a keyed route (refused ones included), so attempts
    /// equal the sum of the outcomes.
    pub fn attempt(&self) {
        self.inner.attempts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an outcome and its latency.
    pub fn record(&self, outcome: Outcome, elapsed: Duration) {
        let i = index(outcome);
        self.inner.outcomes[i].fetch_add(1, Ordering::Relaxed);
        let h = &self.inner.latency[i];
        let secs = elapsed.as_secs_f64();
        for (bucket, bound) in h.buckets.iter().zip(BUCKETS) {
            if secs <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        h.count.fetch_add(1, Ordering::Relaxed);
        h.sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    /// Counts records deleted by the purge.
    pub fn purged(&self, n: u64) {
        self.inner.purged.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a round of the purge that ended (with or without an error).
    pub fn purge_round(&self) {
        self.inner.purge_rounds.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an operation this process marked indeterminate (sent, no complete answer).
    pub fn marked_indeterminate(&self) {
        self.inner
            .marked_indeterminate
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an owner's final write (complete, release, mark indeterminate) that the store
    /// kept refusing after every retry: the record is left to its lease.
    pub fn owner_write_failed(&self, write: AfterEffect) {
        if let Some(i) = OWNER_WRITES.iter().position(|(w, _)| *w == write) {
            self.inner.owner_write_failures[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many of an owner's final writes of this kind failed.
    pub fn owner_write_failures(&self, write: AfterEffect) -> u64 {
        OWNER_WRITES
            .iter()
            .position(|(w, _)| *w == write)
            .map_or(0, |i| {
                self.inner.owner_write_failures[i].load(Ordering::Relaxed)
            })
    }

    /// Counts one reconciliation attempt by its result.
    pub fn reconciled(&self, result: Reconciled) {
        let i = RECONCILED
            .iter()
            .position(|(r, _)| *r == result)
            .unwrap_or(RECONCILED.len() - 1);
        self.inner.reconciled[i].fetch_add(1, Ordering::Relaxed);
    }

    /// How many reconciliation attempts ended in `result`.
    pub fn reconciled_count(&self, result: Reconciled) -> u64 {
        RECONCILED
            .iter()
            .position(|(r, _)| *r == result)
            .map_or(0, |i| self.inner.reconciled[i].load(Ordering::Relaxed))
    }

    /// Counts a keyed request answered from the replay cache, without the store (a replay,
    /// or a 422 for a different request); it is also counted by its outcome.
    pub fn replay_cache_hit(&self) {
        self.inner.replay_cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// How many keyed requests the replay cache answered.
    pub fn replay_cache_hits(&self) -> u64 {
        self.inner.replay_cache_hits.load(Ordering::Relaxed)
    }

    /// Counts a request waiting, in memory, for another attempt of its key in this process,
    /// until the returned guard is dropped.
    pub(crate) fn waiting(&self) -> Waiting {
        self.inner
            .waiting_in_process
            .fetch_add(1, Ordering::Relaxed);
        Waiting(self.inner.clone())
    }

    /// Requests waiting now, in memory and without a database connection, for another
    /// attempt of their key in this process to end.
    pub fn waiting_in_process(&self) -> u64 {
        self.inner.waiting_in_process.load(Ordering::Relaxed)
    }

    /// How many requests ended in `outcome`.
    pub fn count(&self, outcome: Outcome) -> u64 {
        self.inner.outcomes[index(outcome)].load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition of every metric.
    ///
    /// ```
    /// use axum::{Router, routing::get};
    /// use idemkey_tower::Metrics;
    ///
    /// let metrics = Metrics::new(); // also given to each layer with `.metrics(metrics.clone())`
    /// let app: Router = Router::new().route(
    ///     "/metrics",
    ///     get(move || {
    ///         let metrics = metrics.clone();
    ///         async move { metrics.render() }
    ///     }),
    /// );
    /// ```
    pub fn render(&self) -> String {
        let mut out = String::new();
        let inner = &self.inner;
        let _ = writeln!(
            out,
            "# HELP idemkey_attempts_total Write requests on keyed routes: every transport attempt, refused ones included.\n\
             # TYPE idemkey_attempts_total counter\n\
             idemkey_attempts_total {}",
            inner.attempts.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP idemkey_requests_total Keyed requests by outcome.\n\
             # TYPE idemkey_requests_total counter"
        );
        for (i, (_, name)) in OUTCOMES.iter().enumerate() {
            let _ = writeln!(
                out,
                "idemkey_requests_total{{outcome=\"{name}\"}} {}",
                inner.outcomes[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP idemkey_request_duration_seconds Latency of keyed requests by outcome.\n\
             # TYPE idemkey_request_duration_seconds histogram"
        );
        for (i, (_, name)) in OUTCOMES.iter().enumerate() {
            let h = &inner.latency[i];
            for (bucket, bound) in h.buckets.iter().zip(BUCKETS) {
                let _ = writeln!(
                    out,
                    "idemkey_request_duration_seconds_bucket{{outcome=\"{name}\",le=\"{bound}\"}} {}",
                    bucket.load(Ordering::Relaxed)
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "idemkey_request_duration_seconds_bucket{{outcome=\"{name}\",le=\"+Inf\"}} {count}\n\
                 idemkey_request_duration_seconds_sum{{outcome=\"{name}\"}} {}\n\
                 idemkey_request_duration_seconds_count{{outcome=\"{name}\"}} {count}",
                h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
            );
        }
        let _ = writeln!(
            out,
            "# HELP idemkey_purged_total Expired records deleted by the purge.\n\
             # TYPE idemkey_purged_total counter\n\
             idemkey_purged_total {}",
            inner.purged.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP idemkey_purge_rounds_total Rounds of the purge that ended, with or without an error.\n\
             # TYPE idemkey_purge_rounds_total counter\n\
             idemkey_purge_rounds_total {}",
            inner.purge_rounds.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP idemkey_marked_indeterminate_total Operations sent upstream whose outcome became unknown (time-out, reset, closed connection).\n\
             # TYPE idemkey_marked_indeterminate_total counter\n\
             idemkey_marked_indeterminate_total {}",
            inner.marked_indeterminate.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP idemkey_owner_write_failures_total An owner's final writes that failed after every retry; the record is left to its lease.\n\
             # TYPE idemkey_owner_write_failures_total counter"
        );
        for (i, (_, name)) in OWNER_WRITES.iter().enumerate() {
            let _ = writeln!(
                out,
                "idemkey_owner_write_failures_total{{write=\"{name}\"}} {}",
                inner.owner_write_failures[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP idemkey_reconciled_total Reconciliation attempts of operations whose outcome was unknown, by result.\n\
             # TYPE idemkey_reconciled_total counter"
        );
        for (i, (_, name)) in RECONCILED.iter().enumerate() {
            let _ = writeln!(
                out,
                "idemkey_reconciled_total{{result=\"{name}\"}} {}",
                inner.reconciled[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP idemkey_replay_cache_hits_total Keyed requests answered from the in-process replay cache, without the store (replays and key-reused refusals; also counted in idemkey_requests_total).\n\
             # TYPE idemkey_replay_cache_hits_total counter\n\
             idemkey_replay_cache_hits_total {}",
            inner.replay_cache_hits.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP idemkey_waiting_in_process Keyed requests waiting in memory, without a database connection, for another attempt of their key in this process.\n\
             # TYPE idemkey_waiting_in_process gauge\n\
             idemkey_waiting_in_process {}",
            inner.waiting_in_process.load(Ordering::Relaxed)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_histogram_buckets() {
        let m = Metrics::new();
        m.attempt();
        m.attempt();
        m.record(Outcome::Executed, Duration::from_millis(3));
        m.record(Outcome::Replayed, Duration::from_micros(200));
        let text = m.render();
        assert!(text.contains("idemkey_attempts_total 2\n"), "{text}");
        assert!(text.contains("idemkey_requests_total{outcome=\"executed\"} 1\n"));
        assert!(text.contains("idemkey_requests_total{outcome=\"mismatched\"} 0\n"));
        assert!(text.contains(
            "idemkey_request_duration_seconds_bucket{outcome=\"executed\",le=\"0.0025\"} 0\n"
        ));
        assert!(text.contains(
            "idemkey_request_duration_seconds_bucket{outcome=\"executed\",le=\"0.005\"} 1\n"
        ));
        assert_eq!(m.count(Outcome::Replayed), 1);
        m.marked_indeterminate();
        m.reconciled(Reconciled::Released);
        let text = m.render();
        assert!(
            text.contains("idemkey_marked_indeterminate_total 1\n"),
            "{text}"
        );
        assert!(text.contains("idemkey_reconciled_total{result=\"resolved_released\"} 1\n"));
        assert!(text.contains("idemkey_reconciled_total{result=\"still_unknown\"} 0\n"));
        assert_eq!(m.reconciled_count(Reconciled::Released), 1);
        m.owner_write_failed(AfterEffect::Release);
        let text = m.render();
        assert!(text.contains("idemkey_owner_write_failures_total{write=\"release\"} 1\n"));
        assert!(text.contains("idemkey_owner_write_failures_total{write=\"complete\"} 0\n"));
        assert_eq!(m.owner_write_failures(AfterEffect::Release), 1);
        m.replay_cache_hit();
        assert!(m.render().contains("idemkey_replay_cache_hits_total 1\n"));
        assert_eq!(m.replay_cache_hits(), 1);
    }
}
