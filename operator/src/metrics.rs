//! The operator's Prometheus metrics: reconciles, failures by reason, durations, leadership,
//! and each deployment's status as gauges (what the chart's PrometheusRule alerts on when the
//! worker's own metrics cannot say it: migrations, live instances, dead letters).
//!
//! The status gauges are read from the controller's cache of `PerspectiveDeployment`s at each
//! scrape, not set while reconciling: a deleted deployment's series go with it, and only the
//! leader (the process whose controller runs) exports any.
//!
//! Per-deployment series are labelled `deployment_namespace` and `deployment`, not `namespace`:
//! a scrape adds the operator pod's own `namespace` target label, which would rename ours.

use std::time::Duration;

use std::sync::Mutex;

use kube::runtime::reflector::Store;
use kube::ResourceExt;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentStatus};

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
    /// The controller's cache, once it runs.
    deployments: Mutex<Option<Store<PerspectiveDeployment>>>,
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
            deployments: Mutex::new(None),
        }
    }

    /// Exports the status of every deployment in `store` (the controller's cache) from now on.
    pub fn export_deployments(&self, store: Store<PerspectiveDeployment>) {
        *self.deployments.lock().expect("metrics lock") = Some(store);
    }

    /// Replaces every per-deployment series with those of `deployments`.
    fn set_deployments<'a>(
        &self,
        deployments: impl IntoIterator<Item = &'a PerspectiveDeployment>,
    ) {
        for gauge in [
            &self.condition,
            &self.desired_replicas,
            &self.ready_replicas,
            &self.live_instances,
            &self.dead_letters,
            &self.migration_failures,
        ] {
            gauge.reset();
        }
        for pd in deployments {
            let namespace = pd.namespace().unwrap_or_default();
            let status = pd.status.clone().unwrap_or_default();
            self.observe_deployment(&namespace, &pd.name_any(), pd.spec.replicas, &status);
        }
    }

    /// The series of one deployment (after a reset). A value the status does not know (the
    /// database not read yet, a condition not set) has no series rather than a misleading 0.
    fn observe_deployment(
        &self,
        namespace: &str,
        name: &str,
        desired_replicas: i32,
        status: &PerspectiveDeploymentStatus,
    ) {
        let id = [namespace, name];
        for c in &status.conditions {
            self.condition
                .with_label_values(&[namespace, name, c.type_.as_str()])
                .set(i64::from(c.status == "True"));
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
            if let Some(v) = value {
                gauge.with_label_values(&id).set(v);
            }
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
        // Held until encoded: two scrapes at once must not mix their refreshes.
        let deployments = self.deployments.lock().expect("metrics lock");
        if let Some(store) = deployments.as_ref() {
            self.set_deployments(store.state().iter().map(|pd| pd.as_ref()));
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("metrics are UTF-8")
    }
}

impl perspective_worker::engine::http::MetricsSource for OperatorMetrics {
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
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::status::condition as conditions;

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

    fn deployment(
        namespace: &str,
        name: &str,
        status: PerspectiveDeploymentStatus,
    ) -> PerspectiveDeployment {
        let mut pd: PerspectiveDeployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "perspectives.dev/v1alpha1",
            "kind": "PerspectiveDeployment",
            "metadata": { "name": name, "namespace": namespace },
            "spec": {
                "replicas": 3,
                "database": { "secretRef": { "name": "db" } },
                "schema": "s",
                "perspectives": [{ "name": "p", "handlers": { "A": "SELECT 1" } }]
            }
        }))
        .unwrap();
        pd.status = Some(status);
        pd
    }

    #[test]
    fn the_cached_deployments_status_is_exported_and_goes_with_the_deployment() {
        let m = OperatorMetrics::new();
        assert!(!m.render().contains("perspective_operator_desired_replicas"));

        let (store, mut writer) = reflector::store();
        m.export_deployments(store);
        let orders = deployment(
            "shop",
            "orders",
            PerspectiveDeploymentStatus {
                conditions: vec![
                    condition(conditions::READY, "True"),
                    condition(conditions::MIGRATIONS_APPLIED, "False"),
                ],
                ready_replicas: 2,
                migration_failures: 3,
                dead_letters: Some(7),
                ..Default::default()
            },
        );
        writer.apply_watcher_event(&watcher::Event::Apply(orders.clone()));
        writer.apply_watcher_event(&watcher::Event::Apply(deployment(
            "shop",
            "billing",
            Default::default(),
        )));
        let text = m.render();
        let id = r#"deployment="orders",deployment_namespace="shop""#;
        for line in [
            format!(r#"perspective_operator_condition{{{id},type="Ready"}} 1"#),
            format!(r#"perspective_operator_condition{{{id},type="MigrationsApplied"}} 0"#),
            format!("perspective_operator_desired_replicas{{{id}}} 3"),
            format!("perspective_operator_ready_replicas{{{id}}} 2"),
            format!("perspective_operator_migration_failures{{{id}}} 3"),
            format!("perspective_operator_dead_letters{{{id}}} 7"),
            r#"perspective_operator_desired_replicas{deployment="billing",deployment_namespace="shop"} 3"#.to_owned(),
        ] {
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        // Unknown until the database is read or the condition is set: no series, not 0.
        assert!(
            !text.contains("perspective_operator_live_instances{"),
            "{text}"
        );
        assert!(!text.contains(r#"type="Degraded""#), "{text}");
        assert!(
            !text.contains(r#"deployment="billing",deployment_namespace="shop",type"#),
            "{text}"
        );

        writer.apply_watcher_event(&watcher::Event::Delete(orders));
        let text = m.render();
        assert!(!text.contains("orders"), "{text}");
        assert!(text.contains(r#"deployment="billing""#), "{text}");
    }
}
