//! The pure builders and the status computation, without a cluster.

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetStatus};
use k8s_openapi::jiff::Timestamp;
use perspective_operator::crd::{
    PerspectiveDeploymentSpec, PerspectiveDeploymentStatus, PerspectivePhase,
};
use perspective_operator::migration_job::{self, JobState};
use perspective_operator::status::condition as conditions;
use perspective_operator::status::observed::DatabaseProblem;
use perspective_operator::status::{compute, Observed};
use perspective_operator::{config_map, labels, validate, workers};
use perspective_worker::store::catchup::progress::{Phase, Progress};
use perspective_worker::store::status::{PerspectiveStatus, Status};

fn spec() -> PerspectiveDeploymentSpec {
    serde_yaml::from_str(
        r#"
schema: shop
replicas: 3
database: {secretRef: {name: shop-db}}
perspectives:
  - name: order_summary
    setup: CREATE TABLE IF NOT EXISTS order_summary (id uuid PRIMARY KEY)
    handlers:
      OrderPlaced: INSERT INTO order_summary VALUES (:stream_id)
  - name: order_count
    handlers:
      OrderPlaced: SELECT 1
"#,
    )
    .unwrap()
}

fn probe_path(probe: &Option<k8s_openapi::api::core::v1::Probe>) -> Option<&str> {
    probe.as_ref()?.http_get.as_ref()?.path.as_deref()
}

fn env_of(sts: &StatefulSet) -> Vec<(String, String)> {
    let container = &sts
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    container
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| {
            let source = match (&e.value, &e.value_from) {
                (Some(v), _) => v.clone(),
                (_, Some(from)) => match (&from.field_ref, &from.secret_key_ref) {
                    (Some(f), _) => format!("field:{}", f.field_path),
                    (_, Some(s)) => format!("secret:{}/{}", s.name, s.key),
                    _ => "?".into(),
                },
                _ => String::new(),
            };
            (e.name, source)
        })
        .collect()
}

#[test]
fn statefulset_runs_workers_with_pod_uid_identity_and_secret_url() {
    let spec = spec();
    let (_, config_hash) = config_map::render(&spec.worker_config());
    let target = migration_job::target("shop", &spec, "worker:1");
    let cm = labels::config_map_name("shop", &config_hash);
    let sts = workers::statefulset(
        "shop",
        "ns",
        &spec,
        "worker:1",
        &cm,
        &config_hash,
        &target.hash,
    );
    let env = env_of(&sts);
    assert!(env.contains(&(
        "PERSPECTIVE_INSTANCE_ID".into(),
        "field:metadata.uid".into()
    )));
    assert!(env.contains(&("DATABASE_URL".into(), "secret:shop-db/url".into())));
    assert!(env.contains(&(
        "PERSPECTIVE_CONFIG".into(),
        "/etc/perspective/config.yaml".into()
    )));
    let s = sts.spec.as_ref().unwrap();
    assert_eq!(s.replicas, Some(3));
    assert_eq!(s.service_name.as_deref(), Some("shop-workers"));
    let pod = s.template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    assert_eq!(c.args.as_deref(), Some(&["run".to_owned()][..]));
    assert_eq!(probe_path(&c.readiness_probe), Some("/readyz"));
    assert_eq!(probe_path(&c.liveness_probe), Some("/livez"));
    assert_eq!(pod.termination_grace_period_seconds, Some(30));
    assert_eq!(
        workers::template_config_map(&s.template).as_deref(),
        Some(cm.as_str())
    );
    assert_eq!(
        workers::template_migration_hash(&s.template),
        Some(target.hash.clone())
    );
    // The URL itself is nowhere in the rendered objects.
    let rendered = serde_json::to_string(&sts).unwrap()
        + &serde_json::to_string(&config_map::build("shop", "ns", &spec.worker_config())).unwrap();
    assert!(!rendered.contains("postgres://"));
}

fn database_secret_of(pod: &k8s_openapi::api::core::v1::PodSpec) -> String {
    let env = pod.containers[0].env.as_ref().unwrap();
    let url = env.iter().find(|e| e.name == "DATABASE_URL").unwrap();
    let s = url
        .value_from
        .as_ref()
        .and_then(|f| f.secret_key_ref.as_ref())
        .unwrap();
    format!("{}/{}", s.name, s.key)
}

/// Issue 26: the migration Job gets `migrationSecretRef`, the worker pods `workerSecretRef`
/// (so handlers need not run as the schema owner); `secretRef` is the default of both.
#[test]
fn separate_secrets_go_to_the_migration_job_and_the_workers() {
    let build = |spec: &PerspectiveDeploymentSpec| {
        let target = migration_job::target("shop", spec, "worker:1");
        let job = migration_job::build("shop", "ns", spec, "worker:1", "cm", &target);
        let sts = workers::statefulset("shop", "ns", spec, "worker:1", "cm", "h", &target.hash);
        let job_pod = job.spec.unwrap().template.spec.unwrap();
        let sts_pod = sts.spec.unwrap().template.spec.unwrap();
        (database_secret_of(&job_pod), database_secret_of(&sts_pod))
    };
    let shared = spec();
    assert_eq!(
        build(&shared),
        ("shop-db/url".to_owned(), "shop-db/url".to_owned())
    );
    let mut split = spec();
    split.database = serde_yaml::from_str(
        "secretRef: {name: shop-db}\n\
         migrationSecretRef: {name: shop-owner, key: dsn}\n\
         workerSecretRef: {name: shop-worker}\n\
         statusSecretRef: {name: shop-reader}\n",
    )
    .unwrap();
    assert_eq!(
        build(&split),
        ("shop-owner/dsn".to_owned(), "shop-worker/url".to_owned())
    );
    assert!(validate::problems("shop", &split).is_empty());
    split.database.worker_secret_ref.as_mut().unwrap().key = "a b".into();
    split.database.status_secret_ref.as_mut().unwrap().name = String::new();
    let joined = validate::problems("shop", &split).join("\n");
    assert!(
        joined.contains("spec.database.workerSecretRef.key: \"a b\" is not a valid Secret key")
            && joined.contains("spec.database.statusSecretRef.name: must name a Secret"),
        "{joined}"
    );
}

#[test]
fn migration_target_follows_handlers_and_image_not_worker_tuning() {
    let base = spec();
    let t0 = migration_job::target("shop", &base, "worker:1");
    let mut tuned = base.clone();
    tuned.worker.perspective_batch_size = 7;
    assert_eq!(migration_job::target("shop", &tuned, "worker:1"), t0);
    assert_ne!(
        config_map::render(&tuned.worker_config()).1,
        config_map::render(&base.worker_config()).1,
        "worker tuning rolls the pods through the config hash"
    );
    let mut handler = base.clone();
    handler.perspectives[0].handlers.insert(
        "OrderPlaced".into(),
        "INSERT INTO order_summary VALUES (:stream_id) ON CONFLICT DO NOTHING".into(),
    );
    assert_ne!(
        migration_job::target("shop", &handler, "worker:1").job_name,
        t0.job_name
    );
    assert_ne!(
        migration_job::target("shop", &base, "worker:2").job_name,
        t0.job_name
    );
    // Everything the worker's definition hash covers (what `run` verifies) moves the target too.
    let mut reset = base.clone();
    reset.perspectives[0].reset = Some("DELETE FROM order_summary WHERE id = :stream_id".into());
    let mut ordering = reset.clone();
    ordering.perspectives[0].ordering = perspective_worker::config::Ordering::EventId;
    let mut setup = base.clone();
    setup.perspectives[1].setup = Some("SELECT 1".into());
    let mut schema = base.clone();
    schema.schema = "shop2".into();
    // A version bump runs migrate, which marks the perspective for rebuild.
    let mut version = reset.clone();
    version.perspectives[0].version = 2;
    for (what, changed, from) in [
        ("reset", &reset, &base),
        ("version", &version, &reset),
        ("ordering", &ordering, &reset),
        ("setup", &setup, &base),
        ("schema", &schema, &base),
    ] {
        assert_ne!(
            migration_job::target("shop", changed, "worker:1").job_name,
            migration_job::target("shop", from, "worker:1").job_name,
            "{what}"
        );
    }
    let job = migration_job::build("shop", "ns", &base, "worker:1", "cm", &t0);
    let js = job.spec.unwrap();
    assert_eq!(js.backoff_limit, Some(2));
    let pod = js.template.spec.unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    assert_eq!(
        pod.containers[0].args.as_deref(),
        Some(&["migrate".to_owned()][..])
    );
}

#[test]
fn validation_names_fields() {
    let mut s = spec();
    s.perspectives[1].name = "order_summary".into();
    s.schema = "Bad Schema".into();
    s.image = Some("has space".into());
    let problems = validate::problems(&"x".repeat(41), &s);
    let joined = problems.join("\n");
    for wanted in [
        "spec.schema",
        "spec.perspectives[1]",
        "metadata.name",
        "spec.image",
    ] {
        assert!(joined.contains(wanted), "{wanted} not named in:\n{joined}");
    }
    assert!(validate::problems("shop", &spec()).is_empty());
}

fn observed(job: Option<JobState>, sts: Option<StatefulSet>) -> Observed {
    let spec = spec();
    let (_, config_hash) = config_map::render(&spec.worker_config());
    Observed {
        instance: "shop".into(),
        generation: Some(4),
        paused: false,
        problems: vec![],
        secret_problem: None,
        rejected: None,
        target: migration_job::target("shop", &spec, "worker:1"),
        config_hash,
        job,
        migration_failures: 0,
        next_migration_attempt: None,
        statefulset: sts,
        desired_replicas: 3,
        migrated_hash: None,
        database: None,
    }
}

fn rolled_sts(o: &Observed, ready: i32) -> StatefulSet {
    let spec = spec();
    let mut sts = workers::statefulset(
        "shop",
        "ns",
        &spec,
        "worker:1",
        "cm",
        &o.config_hash,
        &o.target.hash,
    );
    sts.metadata.generation = Some(2);
    sts.status = Some(StatefulSetStatus {
        observed_generation: Some(2),
        replicas: 3,
        ready_replicas: Some(ready),
        updated_replicas: Some(3),
        current_revision: Some("r1".into()),
        update_revision: Some("r1".into()),
        ..StatefulSetStatus::default()
    });
    sts
}

fn condition<'a>(
    s: &'a PerspectiveDeploymentStatus,
    t: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    s.conditions
        .iter()
        .find(|c| c.type_ == t)
        .unwrap_or_else(|| panic!("no {t}"))
}

#[test]
fn ready_only_when_migrated_rolled_and_pods_ready() {
    let now = Timestamp::from_second(1_000).unwrap();
    let mut o = observed(Some(JobState::Succeeded), None);
    let sts = rolled_sts(&o, 3);
    o.statefulset = Some(sts.clone());
    let s = compute(&Default::default(), &o, now);
    assert_eq!(condition(&s, conditions::READY).status, "True");
    assert_eq!(condition(&s, conditions::PROGRESSING).status, "False");
    assert_eq!(condition(&s, conditions::MIGRATIONS_APPLIED).status, "True");
    assert_eq!(s.observed_generation, Some(4));
    assert_eq!(s.replicas_summary.as_deref(), Some("3/3"));

    // Not ready yet: every pod must be ready the first time.
    o.statefulset = Some(rolled_sts(&o, 2));
    let s2 = compute(&Default::default(), &o, now);
    assert_eq!(condition(&s2, conditions::READY).reason, "WaitingForPods");
    assert_eq!(condition(&s2, conditions::READY).status, "False");
    // Once ready, one pod being replaced leaves it ready; Progressing says what is missing.
    let s2 = compute(&s, &o, now);
    assert_eq!(condition(&s2, conditions::READY).reason, "MinimumAvailable");
    assert_eq!(condition(&s2, conditions::READY).status, "True");
    assert_eq!(
        condition(&s2, conditions::PROGRESSING).reason,
        "WaitingForPods"
    );
    // Two of three down is not available.
    o.statefulset = Some(rolled_sts(&o, 1));
    let s2 = compute(&s, &o, now);
    assert_eq!(condition(&s2, conditions::READY).status, "False");
    assert_eq!(condition(&s2, conditions::READY).reason, "WaitingForPods");

    // A template from an older migration target: rolling, not ready.
    let mut old = sts;
    old.spec
        .as_mut()
        .unwrap()
        .template
        .metadata
        .as_mut()
        .unwrap()
        .annotations
        .as_mut()
        .unwrap()
        .insert(labels::MIGRATION_HASH.into(), "old".into());
    o.statefulset = Some(old);
    let s3 = compute(&Default::default(), &o, now);
    assert_eq!(condition(&s3, conditions::READY).reason, "RollingOut");
    assert_eq!(condition(&s3, conditions::PROGRESSING).status, "True");
    // The same rollout of a ready deployment: the old pods keep it ready.
    let s3 = compute(&s, &o, now);
    assert_eq!(condition(&s3, conditions::READY).status, "True");
    assert_eq!(condition(&s3, conditions::PROGRESSING).reason, "RollingOut");
}

fn db_with(perspectives: Vec<PerspectiveStatus>) -> Option<Result<Status, DatabaseProblem>> {
    Some(Ok(Status {
        schema: "shop".into(),
        live_instances: 3,
        perspectives,
        ..Default::default()
    }))
}

/// Issue 10: a perspective added to a ready deployment migrates, rolls out and backfills while
/// the deployment stays Ready; Progressing reports each step and then the catch-up.
#[test]
fn an_added_perspective_catches_up_while_the_deployment_stays_ready() {
    let now = Timestamp::from_second(1_000).unwrap();
    let live = PerspectiveStatus {
        name: "order_summary".into(),
        ..Default::default()
    };
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    o.database = db_with(vec![live.clone()]);
    let ready = compute(&Default::default(), &o, now);
    assert_eq!(condition(&ready, conditions::READY).reason, "Available");
    assert_eq!(ready.phase.as_deref(), Some("Live"));

    // The spec gains a perspective: a new target whose Job runs while the old pods serve.
    let running_old_template = o.statefulset.clone();
    let mut o = observed(Some(JobState::Running), running_old_template);
    o.target.hash = "new-target".into();
    o.target.job_name = "shop-migrate-new".into();
    o.database = db_with(vec![live.clone()]);
    let migrating = compute(&ready, &o, now);
    let r = condition(&migrating, conditions::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("True", "MinimumAvailable")
    );
    assert!(r.message.contains("shop-migrate-new"), "{}", r.message);
    assert_eq!(
        condition(&migrating, conditions::PROGRESSING).reason,
        "MigrationRunning"
    );

    // Migrated and rolled out; the new perspective backfills.
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let backfilling = PerspectiveStatus {
        name: "order_totals".into(),
        pending_events: 50,
        phase: Phase::Backfilling,
        progress: Some(Progress {
            step: "applying".into(),
            streams_done: 6_100,
            streams_total: 10_000,
            events_total: 10_000,
            events_remaining: 3_900,
            percent: 61.0,
            eta_seconds: Some(39.6),
            version: None,
            waiting_for: None,
        }),
        ..Default::default()
    };
    o.database = db_with(vec![live.clone(), backfilling.clone()]);
    let s = compute(&migrating, &o, now);
    assert_eq!(condition(&s, conditions::READY).status, "True");
    assert_eq!(condition(&s, conditions::READY).reason, "Available");
    let p = condition(&s, conditions::PROGRESSING);
    assert_eq!(
        (p.status.as_str(), p.reason.as_str()),
        ("True", "CatchingUp")
    );
    assert_eq!(
        p.message,
        "order_totals backfilling: 61% (6 100/10 000 events, 6 100/10 000 streams), about 40 s left"
    );
    assert_eq!(s.phase.as_deref(), Some("Backfilling 61%"));
    let totals = &s.perspectives[1];
    assert_eq!(totals.phase, PerspectivePhase::Backfilling);
    let progress = totals.progress.as_ref().unwrap();
    assert_eq!(
        (
            progress.percent,
            progress.eta_seconds,
            progress.events_remaining
        ),
        (61, Some(40), 3_900)
    );
    assert_eq!(s.perspectives[0].phase, PerspectivePhase::Live);
    assert_eq!(s.perspectives[0].progress, None);

    // A rollout under way and a catch-up: both in the message, the rollout's reason.
    let mut rolling = o.clone();
    rolling.statefulset = Some(rolled_sts(&o, 2));
    let r = compute(&s, &rolling, now);
    let p = condition(&r, conditions::PROGRESSING);
    assert_eq!(p.reason, "WaitingForPods");
    assert!(
        p.message
            .starts_with("2/3 worker pods ready; order_totals backfilling: 61%"),
        "{}",
        p.message
    );

    // All live: back to Complete.
    o.database = db_with(vec![
        live,
        PerspectiveStatus {
            name: "order_totals".into(),
            ..Default::default()
        },
    ]);
    let done = compute(&s, &o, now);
    let p = condition(&done, conditions::PROGRESSING);
    assert_eq!(
        (p.status.as_str(), p.reason.as_str()),
        ("False", "Complete")
    );
    assert_eq!(done.phase.as_deref(), Some("Live"));
    assert!(done.perspectives.iter().all(|p| p.progress.is_none()));
}

/// Ready means serving: a migration that fails leaves the running workers (and `Ready`) as
/// they were; `Degraded` says what failed and `Progressing` when it runs again.
#[test]
fn a_failed_migration_leaves_a_serving_deployment_ready() {
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let ready = compute(&Default::default(), &o, Timestamp::now());
    assert_eq!(condition(&ready, conditions::READY).status, "True");
    o.job = Some(JobState::Failed {
        reason: "BackoffLimitExceeded".into(),
        message: "boom".into(),
        at: None,
    });
    let s = compute(&ready, &o, Timestamp::now());
    let r = condition(&s, conditions::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("True", "PreviousSpecServing")
    );
    assert_eq!(
        condition(&s, conditions::DEGRADED).reason,
        "MigrationFailed"
    );
    assert_eq!(
        condition(&s, conditions::PROGRESSING).reason,
        "MigrationRetryScheduled"
    );
    // Its pods gone, it no longer serves.
    o.statefulset = Some(rolled_sts(&o, 0));
    let s = compute(&s, &o, Timestamp::now());
    assert_eq!(condition(&s, conditions::READY).reason, "MigrationFailed");
    assert_eq!(condition(&s, conditions::READY).status, "False");
}

#[test]
fn failed_migration_is_degraded_with_the_jobs_reason() {
    let o = observed(
        Some(JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "relation nope does not exist".into(),
            at: None,
        }),
        None,
    );
    let s = compute(&Default::default(), &o, Timestamp::now());
    let applied = condition(&s, conditions::MIGRATIONS_APPLIED);
    assert_eq!(
        (applied.status.as_str(), applied.reason.as_str()),
        ("False", "BackoffLimitExceeded")
    );
    assert!(applied.message.contains("relation nope"));
    let degraded = condition(&s, conditions::DEGRADED);
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "MigrationFailed")
    );
    assert_eq!(condition(&s, conditions::READY).status, "False");
}

#[test]
fn invalid_spec_keeps_migration_condition_and_reports_fields() {
    let now = Timestamp::now();
    let mut o = observed(Some(JobState::Succeeded), None);
    let before = compute(&Default::default(), &o, now);
    o.problems = vec!["spec.database.secretRef.name: Secret \"x\" not found".into()];
    let s = compute(&before, &o, now);
    let degraded = condition(&s, conditions::DEGRADED);
    assert_eq!(degraded.reason, "InvalidSpec");
    assert!(degraded.message.contains("spec.database.secretRef.name"));
    assert_eq!(condition(&s, conditions::MIGRATIONS_APPLIED).status, "True");
    assert_eq!(condition(&s, conditions::READY).reason, "InvalidSpec");
}

#[test]
fn paused_and_lag_are_reported() {
    let mut o = observed(Some(JobState::Succeeded), None);
    o.paused = true;
    o.database = Some(Ok(Status {
        schema: "shop".into(),
        live_instances: 0,
        perspectives: vec![
            PerspectiveStatus {
                name: "order_summary".into(),
                pending_events: 5,
                oldest_pending_seconds: Some(75.4),
                dead_letters: 1,
                ..Default::default()
            },
            PerspectiveStatus {
                name: "order_count".into(),
                pending_events: 2,
                oldest_pending_seconds: Some(3.0),
                ..Default::default()
            },
        ],
        ..Default::default()
    }));
    let s = compute(&Default::default(), &o, Timestamp::now());
    assert_eq!(
        condition(&s, conditions::RECONCILIATION_PAUSED).status,
        "True"
    );
    assert_eq!(s.pending_events, Some(7));
    assert_eq!(s.oldest_pending_seconds, Some(75));
    assert_eq!(s.lag.as_deref(), Some("1m15s"));
    assert_eq!(s.dead_letters, Some(1));
    assert_eq!(condition(&s, conditions::DEGRADED).reason, "EventsFailing");
    assert_eq!(s.perspectives.len(), 2);
}

#[test]
fn failed_migrations_are_retried_with_a_growing_delay() {
    let base = std::time::Duration::from_secs(30);
    let delays: Vec<u64> = (1..=8)
        .map(|n| migration_job::retry_delay(n, base).as_secs())
        .collect();
    assert_eq!(delays, [30, 60, 120, 240, 480, 600, 600, 600]);
}

#[test]
fn an_unreachable_database_is_degraded_and_not_ready() {
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    o.database = db_with(vec![]);
    let ready = compute(&Default::default(), &o, Timestamp::now());
    assert_eq!(condition(&ready, conditions::READY).status, "True");
    o.database = Some(Err(DatabaseProblem::Unreachable(
        "connection refused".into(),
    )));
    let s = compute(&ready, &o, Timestamp::now());
    let degraded = condition(&s, conditions::DEGRADED);
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "DatabaseUnreachable")
    );
    assert!(degraded.message.contains("connection refused"));
    // The pods may pass their probes, but nothing is applied without the database.
    let not_ready = condition(&s, conditions::READY);
    assert_eq!(
        (not_ready.status.as_str(), not_ready.reason.as_str()),
        ("False", "DatabaseUnreachable")
    );
    assert_eq!(s.pending_events, None, "no stale lag");
    assert_eq!(s.lag.as_deref(), Some("Unknown"));
}

#[test]
fn ready_waits_for_workers_to_register_in_the_database() {
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let db = |live: i64| Status {
        schema: "shop".into(),
        live_instances: live,
        ..Default::default()
    };
    o.database = Some(Ok(db(2)));
    let s = compute(&Default::default(), &o, Timestamp::now());
    let ready = condition(&s, conditions::READY);
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "WaitingForWorkers")
    );
    assert!(
        ready.message.contains("2/3 workers registered"),
        "{}",
        ready.message
    );
    o.database = Some(Ok(db(3)));
    let s = compute(&s, &o, Timestamp::now());
    assert_eq!(condition(&s, conditions::READY).status, "True");
}

/// The chart's worker PodMonitor selects `labels::all_workers_selector()`: it must match the
/// worker pods of any deployment and never a migration pod (which serves no metrics).
#[test]
fn one_selector_finds_the_worker_pods_of_every_deployment() {
    let selector = labels::all_workers_selector();
    let matches = |pod_labels: &std::collections::BTreeMap<String, String>| {
        selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
    };
    for instance in ["shop", "billing"] {
        let sts = workers::statefulset(instance, "ns", &spec(), "worker:1", "cm", "c", "m");
        let template = sts.spec.unwrap().template;
        let pod_labels = template.metadata.unwrap().labels.unwrap();
        assert!(matches(&pod_labels), "{instance}: {pod_labels:?}");
    }
    let target = migration_job::target("shop", &spec(), "worker:1");
    let job = migration_job::build("shop", "ns", &spec(), "worker:1", "cm", &target);
    let job_pod_labels = job.spec.unwrap().template.metadata.unwrap().labels.unwrap();
    assert!(!matches(&job_pod_labels), "{job_pod_labels:?}");
}

/// Issue 13: paused then scaled is "paused", not `WaitingForPods 3/5`.
#[test]
fn paused_then_scaled_says_it_is_paused() {
    let now = Timestamp::now();
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let ready = compute(&Default::default(), &o, now);
    assert_eq!(ready.summary.as_deref(), Some("Ready"));
    o.paused = true;
    o.desired_replicas = 5;
    let s = compute(&ready, &o, now);
    let r = condition(&s, conditions::READY);
    assert_eq!((r.status.as_str(), r.reason.as_str()), ("False", "Paused"));
    assert_eq!(
        r.message,
        "spec.paused is true: 3 worker pods (3 ready), scaled to 5 when it is false"
    );
    let p = condition(&s, conditions::PROGRESSING);
    assert_eq!((p.status.as_str(), p.reason.as_str()), ("False", "Paused"));
    assert!(
        p.message.contains("scaled to 5 when it is false"),
        "{}",
        p.message
    );
    assert_eq!(s.summary.as_deref(), Some("Paused"));
    // Scaled down while paused: the running pods keep it ready, and say why the count differs.
    o.desired_replicas = 2;
    let s = compute(&ready, &o, now);
    let r = condition(&s, conditions::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("True", "MinimumAvailable")
    );
    assert_eq!(
        r.message,
        "spec.paused is true: 3 worker pods (3 ready), scaled to 2 when it is false"
    );
    assert_eq!(s.summary.as_deref(), Some("Paused"));
}

/// Issue 13: a spec changed while paused says its migration waits for the unpause, not that it
/// waits for a Job that is never created.
#[test]
fn paused_with_a_changed_spec_says_the_migration_waits_for_the_unpause() {
    let now = Timestamp::now();
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let ready = compute(&Default::default(), &o, now);
    // A new target whose Job does not exist, while paused.
    o.paused = true;
    o.job = None;
    o.target.hash = "new-target".into();
    o.target.job_name = "shop-migrate-new".into();
    let s = compute(&ready, &o, now);
    let applied = condition(&s, conditions::MIGRATIONS_APPLIED);
    assert_eq!(applied.reason, "Paused");
    assert_eq!(
        applied.message,
        "migration Job shop-migrate-new will be created when spec.paused is false"
    );
    // The running workers keep it ready; the message says why nothing moves.
    let r = condition(&s, conditions::READY);
    assert_eq!(r.reason, "MinimumAvailable");
    assert!(
        r.message
            == "spec.paused is true: migration Job shop-migrate-new for the current spec is created when it is false",
        "{}",
        r.message
    );
    assert!(!r.message.contains("waiting for migration Job"));
    // Never ready before: not ready, reason Paused.
    let s = compute(&Default::default(), &o, now);
    assert_eq!(condition(&s, conditions::READY).reason, "Paused");
    assert_eq!(s.summary.as_deref(), Some("Paused"));
}

/// Issue 13: a missing Secret is `SecretMissing` (it recovers without a spec change), not
/// `InvalidSpec`; a spec problem still wins.
#[test]
fn a_missing_secret_is_reported_as_such() {
    let now = Timestamp::now();
    let mut o = observed(Some(JobState::Succeeded), None);
    o.statefulset = Some(rolled_sts(&o, 3));
    let ready = compute(&Default::default(), &o, now);
    o.secret_problem = Some("spec.database.secretRef.name: Secret \"shop-db\" not found".into());
    let s = compute(&ready, &o, now);
    let d = condition(&s, conditions::DEGRADED);
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "SecretMissing")
    );
    assert!(d.message.contains("\"shop-db\" not found"), "{}", d.message);
    assert_eq!(condition(&s, conditions::READY).reason, "SecretMissing");
    let p = condition(&s, conditions::PROGRESSING);
    assert_eq!(p.reason, "SecretMissing");
    assert!(!p.message.contains("spec change"), "{}", p.message);
    assert_eq!(s.summary.as_deref(), Some("Degraded: SecretMissing"));
    // Nothing ran for it: the migration condition stays.
    assert_eq!(condition(&s, conditions::MIGRATIONS_APPLIED).status, "True");

    o.problems = vec!["spec.perspectives[1]: duplicate".into()];
    let s = compute(&ready, &o, now);
    assert_eq!(condition(&s, conditions::DEGRADED).reason, "InvalidSpec");
}

/// Issue 13: a child the API server refuses is `Degraded=ChildRejected` with its message.
#[test]
fn a_rejected_child_is_degraded_with_the_servers_message() {
    let now = Timestamp::now();
    let mut o = observed(None, None);
    o.rejected = Some(
        "Job shop-migrate-1 rejected by the API server: Job.batch \"shop-migrate-1\" is invalid: \
         spec.template.spec.nodeSelector: Invalid value: \"bad key!\""
            .into(),
    );
    let s = compute(&Default::default(), &o, now);
    let d = condition(&s, conditions::DEGRADED);
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "ChildRejected")
    );
    assert!(
        d.message.contains("nodeSelector: Invalid value"),
        "{}",
        d.message
    );
    let r = condition(&s, conditions::READY);
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", "ChildRejected")
    );
    assert_eq!(condition(&s, conditions::PROGRESSING).reason, "Stalled");
    assert_eq!(s.summary.as_deref(), Some("Degraded: ChildRejected"));
}

/// The `Status` column for each situation the issue names.
#[test]
fn the_status_column_explains_a_false_ready() {
    let now = Timestamp::now();
    let mut o = observed(Some(JobState::Running), None);
    let s = compute(&Default::default(), &o, now);
    assert_eq!(s.summary.as_deref(), Some("Migrating"));

    o.job = Some(JobState::Succeeded);
    o.statefulset = Some(rolled_sts(&o, 3));
    o.database = db_with(vec![PerspectiveStatus {
        name: "order_totals".into(),
        phase: Phase::Backfilling,
        progress: Some(Progress {
            step: "applying".into(),
            streams_done: 1,
            streams_total: 2,
            events_total: 100,
            events_remaining: 39,
            percent: 61.0,
            eta_seconds: None,
            version: None,
            waiting_for: None,
        }),
        ..Default::default()
    }]);
    let s = compute(&Default::default(), &o, now);
    assert_eq!(s.summary.as_deref(), Some("Backfilling 61%"));

    o.database = db_with(vec![PerspectiveStatus {
        name: "order_totals".into(),
        dead_letters: 2,
        ..Default::default()
    }]);
    let s = compute(&Default::default(), &o, now);
    assert_eq!(s.summary.as_deref(), Some("Degraded: EventsFailing"));

    o.database = db_with(vec![]);
    let s = compute(&Default::default(), &o, now);
    assert_eq!(s.summary.as_deref(), Some("Ready"));

    o.statefulset = Some(rolled_sts(&o, 1));
    let s = compute(&Default::default(), &o, now);
    assert_eq!(s.summary.as_deref(), Some("WaitingForPods"));
}

fn pod_specs(spec: &PerspectiveDeploymentSpec) -> Vec<k8s_openapi::api::core::v1::PodSpec> {
    let target = migration_job::target("shop", spec, "worker:1");
    let job = migration_job::build("shop", "ns", spec, "worker:1", "cm", &target);
    let sts = workers::statefulset("shop", "ns", spec, "worker:1", "cm", "h", &target.hash);
    vec![
        job.spec.unwrap().template.spec.unwrap(),
        sts.spec.unwrap().template.spec.unwrap(),
    ]
}

/// Issue 26, finding 2: seccomp `RuntimeDefault` on every container and on the pod; AppArmor
/// `RuntimeDefault` only when the operator is told every node has AppArmor.
#[test]
fn finding_2_every_pod_and_container_runs_with_seccomp_runtime_default() {
    for pod in pod_specs(&spec()) {
        let context = pod.security_context.clone().expect("a pod securityContext");
        assert_eq!(context.seccomp_profile.unwrap().type_, "RuntimeDefault");
        assert_eq!(context.run_as_non_root, Some(true));
        assert_eq!(context.app_armor_profile, None, "off by default");
        for c in &pod.containers {
            let sc = c.security_context.clone().unwrap();
            assert_eq!(sc.seccomp_profile.unwrap().type_, "RuntimeDefault");
            assert_eq!(sc.allow_privilege_escalation, Some(false));
        }
        let mut hardened = pod.clone();
        perspective_operator::pod::harden(&mut hardened, true);
        let apparmor = hardened
            .security_context
            .unwrap()
            .app_armor_profile
            .unwrap();
        assert_eq!(apparmor.type_, "RuntimeDefault");
        let mut unchanged = pod.clone();
        perspective_operator::pod::harden(&mut unchanged, false);
        assert_eq!(unchanged, pod);
    }
}

/// Issue 26, finding 6: workers and the migration Job request and are limited to the defaults
/// when the spec gives no resources; the spec's own replace them whole.
#[test]
fn finding_6_pods_get_default_requests_and_limits() {
    use perspective_operator::pod::{DEFAULT_LIMITS, DEFAULT_REQUESTS};
    let quantity = |r: &Option<std::collections::BTreeMap<String, _>>, k: &str| {
        let q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity =
            r.as_ref().unwrap().get(k).unwrap();
        q.0.clone()
    };
    for pod in pod_specs(&spec()) {
        let resources = pod.containers[0].resources.clone().expect("resources");
        assert_eq!(quantity(&resources.requests, "cpu"), DEFAULT_REQUESTS.0);
        assert_eq!(quantity(&resources.requests, "memory"), DEFAULT_REQUESTS.1);
        assert_eq!(quantity(&resources.limits, "cpu"), DEFAULT_LIMITS.0);
        assert_eq!(quantity(&resources.limits, "memory"), DEFAULT_LIMITS.1);
    }
    let mut own = spec();
    own.resources = serde_yaml::from_str("{limits: {memory: 1Gi}}").unwrap();
    for pod in pod_specs(&own) {
        let resources = pod.containers[0].resources.clone().unwrap();
        assert_eq!(resources.requests, None, "the spec's, whole");
        assert_eq!(quantity(&resources.limits, "memory"), "1Gi");
    }
    assert_eq!(
        (DEFAULT_REQUESTS, DEFAULT_LIMITS),
        (("100m", "128Mi"), ("1", "512Mi"))
    );
}
