//! The operator's Prometheus metrics: reconciles, failures by reason, durations, leadership,
//! and each deployment's status as gauges (what the chart's PrometheusRule alerts on when the
//! worker's own metrics cannot say it: migrations, live instances, dead letters).
//!
//! Per-deployment series are labelled `deployment_namespace` and `deployment`, not `namespace`:
//! a scrape adds the operator pod's own `namespace` target label, which would rename ours.

use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::conditions;
use crate::crd::PerspectiveDeploymentStatus;

/// Labels of the per-deployment series.
const DEPLOYMENT_LABELS: [&str; 2] = ["deployment_namespace", "deployment"];

/// Metrics of one operator process.
pub struct OperatorMetrics {
    registry: Registry,
    reconciles: IntCounter,
    failures: IntCounterVec,
    duration: Histogram,
    /// 1 while this process holds the leader lease (or runs without election).
    pub leader: IntGauge,
    condition: IntGaugeVec,
    desired_replicas: IntGaugeVec,
    ready_replicas: IntGaugeVec,
    live_instances: IntGaugeVec,
    dead_letters: IntGaugeVec,
    migration_failures: IntGaugeVec,
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
        let gauge = |name: &str, help: &str, extra: Option<&str>| {
            let mut labels = DEPLOYMENT_LABELS.to_vec();
            labels.extend(extra);
            IntGaugeVec::new(Opts::new(name, help), &labels).expect("valid metric")
        };
        let condition = gauge(
            "perspective_operator_condition",
            "1 while a PerspectiveDeployment's status condition of this type is True, 0 while False",
            Some("type"),
        );
        let desired_replicas = gauge(
            "perspective_operator_desired_replicas",
            "Worker replicas a PerspectiveDeployment asks for (spec.replicas)",
            None,
        );
        let ready_replicas = gauge(
            "perspective_operator_ready_replicas",
            "Worker pods of a PerspectiveDeployment that are ready (status.readyReplicas)",
            None,
        );
        let live_instances = gauge(
            "perspective_operator_live_instances",
            "Worker instances with a recent heartbeat in the database (status.liveInstances)",
            None,
        );
        let dead_letters = gauge(
            "perspective_operator_dead_letters",
            "Dead letters waiting for replay, over all perspectives (status.deadLetters)",
            None,
        );
        let migration_failures = gauge(
            "perspective_operator_migration_failures",
            "Failed runs of the current migration Job (status.migrationFailures)",
            None,
        );
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(leader.clone()),
            Box::new(condition.clone()),
            Box::new(desired_replicas.clone()),
            Box::new(ready_replicas.clone()),
            Box::new(live_instances.clone()),
            Box::new(dead_letters.clone()),
            Box::new(migration_failures.clone()),
        ] {
            registry.register(c).expect("metric registered once");
        }
        OperatorMetrics {
            registry,
            reconciles,
            failures,
            duration,
            leader,
            condition,
            desired_replicas,
            ready_replicas,
            live_instances,
            dead_letters,
            migration_failures,
        }
    }

    /// Records the status just computed for deployment `namespace/name`. A value the status
    /// does not know (database not read yet) has no series rather than a misleading 0.
    pub fn observe_deployment(
        &self,
        namespace: &str,
        name: &str,
        desired_replicas: i32,
        status: &PerspectiveDeploymentStatus,
    ) {
        let id = [namespace, name];
        for type_ in conditions::TYPES {
            let labels = [namespace, name, type_];
            match status.conditions.iter().find(|c| c.type_ == type_) {
                Some(c) => self
                    .condition
                    .with_label_values(&labels)
                    .set(i64::from(c.status == "True")),
                None => {
                    let _ = self.condition.remove_label_values(&labels);
                }
            }
        }
        self.desired_replicas
            .with_label_values(&id)
            .set(i64::from(desired_replicas));
        self.ready_replicas
            .with_label_values(&id)
            .set(i64::from(status.ready_replicas));
        self.migration_failures
            .with_label_values(&id)
            .set(i64::from(status.migration_failures));
        for (gauge, value) in [
            (&self.live_instances, status.live_instances),
            (&self.dead_letters, status.dead_letters),
        ] {
            match value {
                Some(v) => gauge.with_label_values(&id).set(v),
                None => {
                    let _ = gauge.remove_label_values(&id);
                }
            }
        }
    }

    /// Removes every series of a deleted deployment.
    pub fn forget_deployment(&self, namespace: &str, name: &str) {
        let id = [namespace, name];
        for type_ in conditions::TYPES {
            let _ = self
                .condition
                .remove_label_values(&[namespace, name, type_]);
        }
        for gauge in [
            &self.desired_replicas,
            &self.ready_replicas,
            &self.live_instances,
            &self.dead_letters,
            &self.migration_failures,
        ] {
            let _ = gauge.remove_label_values(&id);
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

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    fn condition(type_: &str, status: &str) -> Condition {
        Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: "Test".to_owned(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn deployment_status_becomes_gauges_and_goes_with_the_deployment() {
        let m = OperatorMetrics::new();
        let status = PerspectiveDeploymentStatus {
            conditions: vec![
                condition(conditions::READY, "True"),
                condition(conditions::MIGRATIONS_APPLIED, "False"),
            ],
            ready_replicas: 2,
            migration_failures: 3,
            dead_letters: Some(7),
            ..Default::default()
        };
        m.observe_deployment("shop", "orders", 3, &status);
        let text = m.render();
        let id = r#"deployment="orders",deployment_namespace="shop""#;
        for line in [
            format!(r#"perspective_operator_condition{{{id},type="Ready"}} 1"#),
            format!(r#"perspective_operator_condition{{{id},type="MigrationsApplied"}} 0"#),
            format!("perspective_operator_desired_replicas{{{id}}} 3"),
            format!("perspective_operator_ready_replicas{{{id}}} 2"),
            format!("perspective_operator_migration_failures{{{id}}} 3"),
            format!("perspective_operator_dead_letters{{{id}}} 7"),
        ] {
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        // Unknown until the database is read: no series, not 0.
        assert!(!text.contains("perspective_operator_live_instances{"));
        assert!(!text.contains(r#"type="Degraded""#));

        m.forget_deployment("shop", "orders");
        assert!(!m.render().contains("orders"), "{}", m.render());
    }
}
