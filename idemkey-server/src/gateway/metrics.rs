//! The gateway's metrics: the layer's, and its reconciler's `idemkey_reconciled_total`.

use idemkey_tower::Metrics;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// What the reconciler made of one operation whose outcome was unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reconciled {
    /// The other service knew the operation: its answer is stored and replayed.
    Completed,
    /// The other service did not know it: the key is free, the next retry executes.
    Released,
    /// No usable answer: still unknown, asked again later.
    StillUnknown,
}

impl Reconciled {
    /// Every result, in the order of their series.
    const ALL: [Reconciled; 3] = [
        Reconciled::Completed,
        Reconciled::Released,
        Reconciled::StillUnknown,
    ];

    /// Its value of the `result` label.
    fn label(self) -> &'static str {
        match self {
            Reconciled::Completed => "resolved_completed",
            Reconciled::Released => "resolved_released",
            Reconciled::StillUnknown => "still_unknown",
        }
    }
}

/// The layers' metrics and the reconciler's counts, shown together at `/metrics`.
#[derive(Debug, Clone)]
pub(crate) struct GatewayMetrics {
    /// What every route's layer counts into (and the purge).
    pub(crate) layer: Metrics,
    reconciled: Family<[(&'static str, &'static str); 1], Counter>,
    /// The series of `reconciled`, by [`Reconciled`] in the order of [`Reconciled::ALL`].
    by_result: [Counter; Reconciled::ALL.len()],
}

impl GatewayMetrics {
    pub(crate) fn new(layer: Metrics) -> Self {
        let reconciled = Family::default();
        let by_result =
            Reconciled::ALL.map(|r| reconciled.get_or_create_owned(&[("result", r.label())]));
        Self {
            layer,
            reconciled,
            by_result,
        }
    }

    /// Counts one reconciliation attempt by its result.
    pub(crate) fn reconciled(&self, result: Reconciled) {
        self.by_result[result as usize].inc();
    }

    /// Every family, for `/metrics`.
    pub(crate) fn registry(&self) -> Registry {
        let mut registry = Registry::default();
        self.layer.register(&mut registry);
        registry.register(
            "idemkey_reconciled",
            "Reconciliation attempts of operations whose outcome was unknown, by result",
            self.reconciled.clone(),
        );
        registry
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::prometheus_text::encode;

    use super::*;

    #[test]
    fn counts_each_result_under_its_label_beside_the_layers_families() {
        let metrics = GatewayMetrics::new(Metrics::new());
        metrics.reconciled(Reconciled::Released);
        metrics.reconciled(Reconciled::Completed);
        metrics.reconciled(Reconciled::Completed);
        let mut text = String::new();
        encode(&mut text, &metrics.registry()).unwrap();
        assert!(
            text.contains("idemkey_reconciled_total{result=\"resolved_released\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("idemkey_reconciled_total{result=\"resolved_completed\"} 2\n"));
        assert!(text.contains("idemkey_reconciled_total{result=\"still_unknown\"} 0\n"));
        assert!(text.contains("idemkey_attempts_total 0\n"), "{text}");
    }
}
