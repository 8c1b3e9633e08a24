//! The operator's Prometheus metrics: reconciles, failures by reason, durations, leadership.

use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Metrics of one operator process.
pub struct OperatorMetrics {
    registry: Registry,
    reconciles: IntCounter,
    failures: IntCounterVec,
    duration: Histogram,
    /// 1 while this process holds the leader lease (or runs without election).
    pub leader: IntGauge,
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounter::new(
            "perspective_operator_reconciles_total",
            "Reconciles of PerspectiveDeployments, successful or not",
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "perspective_operator_reconcile_failures_total",
                "Reconciles that failed and were retried, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "perspective_operator_reconcile_duration_seconds",
                "Duration of one reconcile",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )
        .expect("valid metric");
        let leader = IntGauge::new(
            "perspective_operator_leader",
            "1 while this operator process is the leader and reconciles",
        )
        .expect("valid metric");
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(leader.clone()),
        ] {
            registry.register(c).expect("metric registered once");
        }
        OperatorMetrics {
            registry,
            reconciles,
            failures,
            duration,
            leader,
        }
    }

    /// Records one reconcile; `failure` is the reason label of a failed one.
    pub fn observe_reconcile(&self, took: Duration, failure: Option<&str>) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(reason) = failure {
            self.failures.with_label_values(&[reason]).inc();
        }
    }

    /// The Prometheus text exposition of all metrics.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("metrics are UTF-8")
    }
}

impl perspective_worker::http::MetricsSource for OperatorMetrics {
    fn render(&self) -> String {
        OperatorMetrics::render(self)
    }
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}
