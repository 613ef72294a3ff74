//! The outbox's metrics, kept with `prometheus-client`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use idemkey_core::Timestamp;
use idemkey_core::outbox::OutboxStats;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Counters of deliveries by outcome, and the last-read sizes of the outbox: a relay given
/// one (`Relay::metrics`) counts into it, and an application shows it with its own metrics
/// (`register` in its [`Registry`]) or alone (`render`). Cheap to clone: clones share their
/// counts.
#[derive(Debug, Clone, Default)]
pub struct OutboxMetrics {
    inner: Arc<Inner>,
}

type Label = [(&'static str, &'static str); 1];

#[derive(Debug)]
struct Inner {
    deliveries: Family<Label, Counter>,
    acknowledged: Counter,
    failed: Counter,
    dead: Counter,
    pending_now: Gauge,
    dead_now: Gauge,
    oldest_pending_age: Gauge<f64, AtomicU64>,
}

impl Default for Inner {
    fn default() -> Self {
        let deliveries = Family::<Label, Counter>::default();
        let series = |outcome| deliveries.get_or_create_owned(&[("outcome", outcome)]);
        let (acknowledged, failed, dead) =
            (series("acknowledged"), series("failed"), series("dead"));
        Self {
            deliveries,
            acknowledged,
            failed,
            dead,
            pending_now: Gauge::default(),
            dead_now: Gauge::default(),
            oldest_pending_age: Gauge::default(),
        }
    }
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

    /// Adds the `idemkey_outbox_*` families to `registry`, which the application encodes
    /// with its own metrics (`prometheus_client::encoding::prometheus_text::encode`).
    pub fn register(&self, registry: &mut Registry) {
        let i = &self.inner;
        registry.register(
            "idemkey_outbox_pending",
            "Outbox messages waiting to be delivered",
            i.pending_now.clone(),
        );
        registry.register(
            "idemkey_outbox_dead",
            "Outbox messages whose attempts ran out",
            i.dead_now.clone(),
        );
        registry.register(
            "idemkey_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending message",
            i.oldest_pending_age.clone(),
        );
        registry.register(
            "idemkey_outbox_deliveries",
            "Delivery attempts by outcome",
            i.deliveries.clone(),
        );
    }

    /// `idemkey_outbox_*` alone in the Prometheus text format (`text/plain; version=0.0.4`);
    /// beside other metrics, see [`OutboxMetrics::register`].
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut text = String::new();
        // Writing to a `String` does not fail.
        let _ = prometheus_text::encode(&mut text, &registry);
        text
    }

    pub(crate) fn delivery(&self, outcome: Delivery) {
        match outcome {
            Delivery::Acknowledged => &self.inner.acknowledged,
            Delivery::Failed => &self.inner.failed,
            Delivery::Dead => &self.inner.dead,
        }
        .inc();
    }

    pub(crate) fn observe(&self, stats: OutboxStats, now: Timestamp) {
        let i = &self.inner;
        i.pending_now.set(saturating_i64(stats.pending));
        i.dead_now.set(saturating_i64(stats.dead));
        let age_ms = stats
            .oldest_pending
            .map_or(0, |oldest| (now.as_millis() - oldest.as_millis()).max(0));
        i.oldest_pending_age.set(age_ms as f64 / 1000.0);
    }

    /// Deliveries the sink acknowledged.
    pub fn acknowledged(&self) -> u64 {
        self.inner.acknowledged.get()
    }

    /// Deliveries that failed and will be tried again.
    pub fn failed(&self) -> u64 {
        self.inner.failed.get()
    }

    /// Deliveries that failed for the last time: their message is dead.
    pub fn dead(&self) -> u64 {
        self.inner.dead.get()
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_sizes_read_and_the_deliveries_counted() {
        let m = OutboxMetrics::new();
        let text = m.render();
        assert!(text.contains("idemkey_outbox_pending 0\n"), "{text}");
        assert!(text.contains("idemkey_outbox_oldest_pending_age_seconds 0.0\n"));
        assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"dead\"} 0\n"));

        m.delivery(Delivery::Acknowledged);
        m.delivery(Delivery::Acknowledged);
        m.delivery(Delivery::Failed);
        m.delivery(Delivery::Dead);
        let now = Timestamp(1_000_000);
        m.observe(
            OutboxStats {
                pending: 3,
                dead: 1,
                oldest_pending: Some(Timestamp(1_000_000 - 2_500)),
            },
            now,
        );
        let text = m.render();
        assert!(text.contains("idemkey_outbox_pending 3\n"), "{text}");
        assert!(text.contains("idemkey_outbox_dead 1\n"), "{text}");
        assert!(text.contains("idemkey_outbox_oldest_pending_age_seconds 2.5\n"));
        assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"acknowledged\"} 2\n"));
        assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"failed\"} 1\n"));
        assert!(text.contains("idemkey_outbox_deliveries_total{outcome=\"dead\"} 1\n"));
        assert_eq!((m.acknowledged(), m.failed(), m.dead()), (2, 1, 1));

        // Nothing pending: the age is 0 again.
        m.observe(
            OutboxStats {
                pending: 0,
                dead: 1,
                oldest_pending: None,
            },
            now,
        );
        assert!(
            m.render()
                .contains("idemkey_outbox_oldest_pending_age_seconds 0.0\n")
        );
    }
}
