//! The layer's counters and latency histograms, kept with `prometheus-client`: each
//! series's handle is made once, with the metrics, so recording is a few atomic adds,
//! without a look-up by name or a lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemkey_core::AfterEffect;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet, prometheus_text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

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

impl Outcome {
    /// Every outcome, in the order of the handles kept for them.
    const ALL: [Outcome; 8] = [
        Outcome::Executed,
        Outcome::NotStored,
        Outcome::Replayed,
        Outcome::Mismatched,
        Outcome::InFlight,
        Outcome::Indeterminate,
        Outcome::StoreError,
        Outcome::Rejected,
    ];

    /// Its value of the `outcome` label.
    fn label(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::NotStored => "not_stored",
            Outcome::Replayed => "replayed",
            Outcome::Mismatched => "mismatched",
            Outcome::InFlight => "in_flight",
            Outcome::Indeterminate => "indeterminate",
            Outcome::StoreError => "store_error",
            Outcome::Rejected => "rejected",
        }
    }

    /// Its place in [`Outcome::ALL`].
    fn index(self) -> usize {
        self as usize
    }
}

/// The writes an external-mode owner makes once it is done, in the order of their handles.
const OWNER_WRITES: [AfterEffect; 3] = [
    AfterEffect::Complete,
    AfterEffect::Release,
    AfterEffect::Indeterminate,
];

/// Its value of the `write` label and its place in [`OWNER_WRITES`].
fn owner_write(write: AfterEffect) -> (&'static str, usize) {
    match write {
        AfterEffect::Complete => ("complete", 0),
        AfterEffect::Release => ("release", 1),
        AfterEffect::Indeterminate => ("indeterminate", 2),
    }
}

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// One label, as the families here are keyed.
type Label = [(&'static str, &'static str); 1];

/// A latency histogram over [`BUCKETS`], in atomics: an observation is three atomic adds
/// (prometheus-client's `Histogram` takes a lock, which a preempted holder makes every
/// request wait for). prometheus-client encodes it.
#[derive(Debug, Clone, Default)]
struct Latency(Arc<LatencyCounts>);

#[derive(Debug, Default)]
struct LatencyCounts {
    /// Observations per bucket, not cumulative; those over the last bound are only counted.
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Latency {
    fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|bound| secs <= *bound) {
            self.0.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.0.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.0.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = BUCKETS
            .iter()
            .zip(&self.0.buckets)
            .map(|(bound, n)| (*bound, n.load(Ordering::Relaxed)))
            .collect();
        let sum = self.0.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let count = self.0.count.load(Ordering::Relaxed);
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[derive(Debug)]
struct Inner {
    attempts: Counter,
    requests: Family<Label, Counter>,
    latency: Family<Label, Latency>,
    owner_write_failures: Family<Label, Counter>,
    /// The series of the families above, by [`Outcome::index`] and [`owner_write`].
    by_outcome: [(Counter, Latency); Outcome::ALL.len()],
    by_owner_write: [Counter; OWNER_WRITES.len()],
    purged: Counter,
    purge_rounds: Counter,
    marked_indeterminate: Counter,
    replay_cache_hits: Counter,
    undecodable_responses: Counter,
    waiting_in_process: Gauge,
}

impl Default for Inner {
    fn default() -> Self {
        let requests = Family::<Label, Counter>::default();
        let latency = Family::<Label, Latency>::default();
        let owner_write_failures = Family::<Label, Counter>::default();
        let by_outcome = Outcome::ALL.map(|o| {
            let label = [("outcome", o.label())];
            (
                requests.get_or_create_owned(&label),
                latency.get_or_create_owned(&label),
            )
        });
        let by_owner_write = OWNER_WRITES
            .map(|w| owner_write_failures.get_or_create_owned(&[("write", owner_write(w).0)]));
        Self {
            attempts: Counter::default(),
            requests,
            latency,
            owner_write_failures,
            by_outcome,
            by_owner_write,
            purged: Counter::default(),
            purge_rounds: Counter::default(),
            marked_indeterminate: Counter::default(),
            replay_cache_hits: Counter::default(),
            undecodable_responses: Counter::default(),
            waiting_in_process: Gauge::default(),
        }
    }
}

/// One request counted in `idemkey_waiting_in_process` while it lives.
pub(crate) struct Waiting(Gauge);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The layer's metrics: the layers given one (`.metrics(m)`) count into it, and an
/// application shows it with its own (`register` in its [`Registry`]) or alone (`render`).
/// Cheap to clone; clones share their counts.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    inner: Arc<Inner>,
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
    ///     // .route("/orders", post(idempotency.handler(create_order)))
    ///     .route("/metrics", get(move || async move { metrics.render() }));
    /// # let _ = idempotency;
    /// # }
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds every `idemkey_*` family of the layer to `registry`, which the application
    /// encodes with its own metrics (`prometheus_client::encoding::prometheus_text::encode`).
    /// The families stay live: the registry shows the counts at each encoding.
    ///
    /// ```
    /// use idemkey_tower::Metrics;
    /// use prometheus_client::{encoding::prometheus_text::encode, registry::Registry};
    ///
    /// let metrics = Metrics::new(); // also given to each layer with `.metrics(metrics.clone())`
    /// let mut registry = Registry::default();
    /// metrics.register(&mut registry);
    /// // … the application's own metrics, in the same registry …
    /// let mut text = String::new();
    /// encode(&mut text, &registry).unwrap();
    /// assert!(text.contains("idemkey_attempts_total 0\n"));
    /// ```
    pub fn register(&self, registry: &mut Registry) {
        let i = &self.inner;
        registry.register(
            "idemkey_attempts",
            "Write requests on keyed routes: every transport attempt, refused ones included",
            i.attempts.clone(),
        );
        registry.register(
            "idemkey_requests",
            "Keyed requests by outcome",
            i.requests.clone(),
        );
        registry.register(
            "idemkey_request_duration_seconds",
            "Latency of keyed requests by outcome",
            i.latency.clone(),
        );
        registry.register(
            "idemkey_purged",
            "Expired records deleted by the purge",
            i.purged.clone(),
        );
        registry.register(
            "idemkey_purge_rounds",
            "Rounds of the purge that ended, with or without an error",
            i.purge_rounds.clone(),
        );
        registry.register(
            "idemkey_marked_indeterminate",
            "Operations sent upstream whose outcome became unknown (time-out, reset, closed connection)",
            i.marked_indeterminate.clone(),
        );
        registry.register(
            "idemkey_owner_write_failures",
            "An owner's final writes that failed after every retry; the record is left to its lease",
            i.owner_write_failures.clone(),
        );
        registry.register(
            "idemkey_replay_cache_hits",
            "Keyed requests answered from the in-process replay cache, without the store (replays and key-reused refusals; also counted in idemkey_requests_total)",
            i.replay_cache_hits.clone(),
        );
        registry.register(
            "idemkey_undecodable_responses",
            "Stored answers whose body does not decode as their Content-Encoding says (within 16 times the stored-answer limit): every retry gets them as stored, in that coding",
            i.undecodable_responses.clone(),
        );
        registry.register(
            "idemkey_waiting_in_process",
            "Keyed requests waiting in memory, without a database connection, for another attempt of their key in this process",
            i.waiting_in_process.clone(),
        );
    }

    /// These metrics alone in the Prometheus text format (`text/plain; version=0.0.4`), for
    /// an application with no metrics of its own; otherwise see [`Metrics::register`].
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
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut text = String::new();
        // Writing to a `String` does not fail.
        let _ = prometheus_text::encode(&mut text, &registry);
        text
    }

    /// Counts one transport attempt on a keyed route (refused ones included), so attempts
    /// equal the sum of the outcomes.
    pub(crate) fn attempt(&self) {
        self.inner.attempts.inc();
    }

    /// Counts an outcome and its latency.
    pub(crate) fn record(&self, outcome: Outcome, elapsed: Duration) {
        let (count, latency) = &self.inner.by_outcome[outcome.index()];
        count.inc();
        latency.observe(elapsed);
    }

    /// Counts records deleted by the purge.
    pub(crate) fn purged(&self, n: u64) {
        self.inner.purged.inc_by(n);
    }

    /// Counts a round of the purge that ended (with or without an error).
    pub(crate) fn purge_round(&self) {
        self.inner.purge_rounds.inc();
    }

    /// Counts an operation this process marked indeterminate (sent, no complete answer).
    pub(crate) fn marked_indeterminate(&self) {
        self.inner.marked_indeterminate.inc();
    }

    /// Counts an owner's final write (complete, release, mark indeterminate) that the store
    /// kept refusing after every retry: the record is left to its lease.
    pub(crate) fn owner_write_failed(&self, write: AfterEffect) {
        self.inner.by_owner_write[owner_write(write).1].inc();
    }

    /// Counts a keyed request answered from the replay cache, without the store (a replay,
    /// or a 422 for a different request); it is also counted by its outcome.
    pub(crate) fn replay_cache_hit(&self) {
        self.inner.replay_cache_hits.inc();
    }

    /// Counts a stored answer whose body does not decode as its `Content-Encoding` says.
    pub(crate) fn undecodable_response(&self) {
        self.inner.undecodable_responses.inc();
    }

    /// Counts a request waiting, in memory, for another attempt of its key in this process,
    /// until the returned guard is dropped.
    pub(crate) fn waiting(&self) -> Waiting {
        let gauge = self.inner.waiting_in_process.clone();
        gauge.inc();
        Waiting(gauge)
    }

    /// How many of an owner's final writes of this kind failed.
    pub fn owner_write_failures(&self, write: AfterEffect) -> u64 {
        self.inner.by_owner_write[owner_write(write).1].get()
    }

    /// How many keyed requests the replay cache answered.
    pub fn replay_cache_hits(&self) -> u64 {
        self.inner.replay_cache_hits.get()
    }

    /// How many stored answers did not decode as their `Content-Encoding` says (and are
    /// replayed as stored, in that coding, to every retry).
    pub fn undecodable_responses(&self) -> u64 {
        self.inner.undecodable_responses.get()
    }

    /// Requests waiting now, in memory and without a database connection, for another
    /// attempt of their key in this process to end.
    pub fn waiting_in_process(&self) -> u64 {
        u64::try_from(self.inner.waiting_in_process.get()).unwrap_or(0)
    }

    /// How many requests ended in `outcome`.
    pub fn count(&self, outcome: Outcome) -> u64 {
        self.inner.by_outcome[outcome.index()].0.get()
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
        let text = m.render();
        assert!(
            text.contains("idemkey_marked_indeterminate_total 1\n"),
            "{text}"
        );
        m.owner_write_failed(AfterEffect::Release);
        let text = m.render();
        assert!(text.contains("idemkey_owner_write_failures_total{write=\"release\"} 1\n"));
        assert!(text.contains("idemkey_owner_write_failures_total{write=\"complete\"} 0\n"));
        assert_eq!(m.owner_write_failures(AfterEffect::Release), 1);
        m.replay_cache_hit();
        assert!(m.render().contains("idemkey_replay_cache_hits_total 1\n"));
        assert_eq!(m.replay_cache_hits(), 1);
    }

    /// Each outcome's handles are the series of its label, whatever the enum's order.
    #[test]
    fn each_outcome_counts_under_its_own_label() {
        let m = Metrics::new();
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                m.record(outcome, Duration::from_millis(1));
            }
        }
        let text = m.render();
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            let label = outcome.label();
            assert_eq!(m.count(outcome), n as u64 + 1);
            assert!(
                text.contains(&format!(
                    "idemkey_requests_total{{outcome=\"{label}\"}} {}\n",
                    n + 1
                )),
                "{label}: {text}"
            );
            assert!(
                text.contains(&format!(
                    "idemkey_request_duration_seconds_count{{outcome=\"{label}\"}} {}\n",
                    n + 1
                )),
                "{label}: {text}"
            );
        }
        for write in OWNER_WRITES {
            assert_eq!(m.owner_write_failures(write), 0);
        }
    }

    /// Buckets are cumulative; an observation past the last bound is only in `+Inf`.
    #[test]
    fn renders_cumulative_buckets_and_the_sum_in_seconds() {
        let m = Metrics::new();
        m.record(Outcome::Executed, Duration::from_micros(700));
        m.record(Outcome::Executed, Duration::from_millis(2));
        m.record(Outcome::Executed, Duration::from_secs(20));
        let text = m.render();
        let series = |le: &str, n: u64| {
            format!(
                "idemkey_request_duration_seconds_bucket{{outcome=\"executed\",le=\"{le}\"}} {n}\n"
            )
        };
        for (le, n) in [
            ("0.0005", 0),
            ("0.001", 1),
            ("0.0025", 2),
            ("10", 2),
            ("+Inf", 3),
        ] {
            assert!(text.contains(&series(le, n)), "le {le}: {text}");
        }
        assert!(text.contains("idemkey_request_duration_seconds_count{outcome=\"executed\"} 3\n"));
        assert!(
            text.contains("idemkey_request_duration_seconds_sum{outcome=\"executed\"} 20.0027\n"),
            "{text}"
        );
    }

    /// The gauge of waiting requests follows the guards' lives.
    #[test]
    fn waiting_counts_while_the_guard_lives() {
        let m = Metrics::new();
        let first = m.waiting();
        let second = m.waiting();
        assert_eq!(m.waiting_in_process(), 2);
        drop(first);
        assert!(m.render().contains("idemkey_waiting_in_process 1\n"));
        drop(second);
        assert_eq!(m.waiting_in_process(), 0);
    }
}
