//! The operator against a real control plane (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, kwok) and a real PostgreSQL: the operator runs as a process, and the pod
//! runner runs every pod it creates (migration Jobs, worker StatefulSet pods) as a local
//! `perspective-worker` process with the env the operator rendered.
//!
//! Run through `tests/pg/pg.sh with tests/e2e/with-control-plane.sh cargo test -p
//! perspective-operator --test e2e` (as `make test` does).

mod support;

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use perspective_operator::crd::{DatabaseState, PerspectiveDeployment};
use perspective_worker::store::grants::{self, Role};
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use support::pod_runner::{PodRunner, ProcState};
use support::{database_url, e2e, fresh_namespace, kubectl, kubectl_ok, poll, worker_binary};

const LONG: Duration = Duration::from_secs(120);

// --- helpers -------------------------------------------------------------------------------

async fn db() -> PgConnection {
    PgConnection::connect(&database_url())
        .await
        .expect("connect to the test PostgreSQL")
}

fn unique_schema(prefix: &str) -> String {
    format!("{prefix}_{}", &uuid_like()[..12])
}

fn uuid_like() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("{:016x}{:016x}", h.finish(), std::process::id())
}

/// Installs the CRD once per test process (tests run in parallel) and waits until it is served.
fn install_crd() {
    static INSTALLED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut installed = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
    if *installed {
        return;
    }
    let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds");
    kubectl_ok(
        &["apply", "--server-side", "-f", crds.to_str().unwrap()],
        None,
    );
    // `kubectl wait` fails outright while the new CRD has no conditions yet: poll instead.
    let deadline = std::time::Instant::now() + LONG;
    loop {
        let out = kubectl(
            &[
                "get",
                "crd/perspectivedeployments.perspectives.dev",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
            ],
            None,
        );
        if String::from_utf8_lossy(&out.stdout).trim() == "True" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the CRD was not Established in time"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    *installed = true;
}
/// A running operator process, killed on drop.
struct Operator {
    child: Child,
    log: PathBuf,
}

impl Operator {
    fn start(dir: &std::path::Path, namespace: &str, name: &str, extra: &[&str]) -> Operator {
        Self::start_with_env(dir, namespace, name, extra, &[])
    }

    fn start_with_env(
        dir: &std::path::Path,
        namespace: &str,
        name: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Operator {
        let log = dir.join(format!("{namespace}_{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_perspective-operator"));
        cmd.args([
            "run",
            "--http-addr=127.0.0.1:0",
            "--watch-namespace",
            namespace,
            "--default-worker-image=perspective-worker:e2e",
            "--log-format=json",
            "--identity",
            name,
        ])
        // A status refresh every second unless the test sets its own interval.
        .args(
            (!extra
                .iter()
                .any(|a| a.starts_with("--status-interval-seconds")))
            .then_some("--status-interval-seconds=1"),
        )
        .args(extra)
        .env("RUST_LOG", "info,perspective_operator=debug")
        .envs(env.iter().copied())
        .stdout(file.try_clone().unwrap())
        .stderr(file);
        let child = cmd.spawn().expect("start perspective-operator");
        eprintln!(
            "[e2e] operator {name} pid {} log {}",
            child.id(),
            log.display()
        );
        Operator { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The HTTP address the operator logged.
    fn http_addr(&self) -> Option<String> {
        let log = self.log();
        let at = log.find("\"addr\":\"127.0.0.1:")?;
        let rest = &log[at + 8..];
        Some(rest[..rest.find('"')?].to_owned())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A test's world: namespace, database Secret, schema, operator, pod runner.
struct World {
    client: Client,
    ns: String,
    schema: String,
    dir: PathBuf,
    runner: Option<PodRunner>,
    operators: Vec<Operator>,
}

impl World {
    async fn new(prefix: &str, operators: &[(&str, &[&str])]) -> World {
        Self::with_worker(prefix, operators, worker_binary()).await
    }

    /// A world whose pods run `worker` as `perspective-worker` (what the image holds).
    async fn with_worker(prefix: &str, operators: &[(&str, &[&str])], worker: PathBuf) -> World {
        let env = e2e().await;
        install_crd();
        let ns = fresh_namespace(&env.client, &format!("{prefix}-"))
            .await
            .unwrap();
        let schema = unique_schema(prefix);
        kubectl_ok(
            &[
                "-n",
                &ns,
                "create",
                "secret",
                "generic",
                "shop-db",
                &format!("--from-literal=url={}", database_url()),
            ],
            None,
        );
        let dir = env.dir.join("e2e").join(&ns);
        std::fs::create_dir_all(&dir).unwrap();
        let runner = PodRunner::start(
            env.client.clone(),
            &ns,
            HashMap::from([("perspective-worker".to_owned(), worker)]),
            vec![
                // Every "pod" shares loopback: each worker picks its own free port.
                ("PERSPECTIVE_HTTP_ADDR".to_owned(), "127.0.0.1:0".to_owned()),
                ("RUST_LOG".to_owned(), "info,sqlx=warn".to_owned()),
            ],
            dir.join("pods"),
        )
        .await
        .unwrap();
        let operators = operators
            .iter()
            .map(|(name, extra)| Operator::start(&dir, &ns, name, extra))
            .collect();
        World {
            client: env.client,
            ns,
            schema,
            dir,
            runner: Some(runner),
            operators,
        }
    }

    fn runner(&self) -> &PodRunner {
        self.runner.as_ref().unwrap()
    }

    fn pds(&self) -> Api<PerspectiveDeployment> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn apply(&self, yaml: &str) {
        kubectl_ok(
            &["-n", &self.ns, "apply", "--server-side", "-f", "-"],
            Some(yaml),
        );
    }

    async fn pd(&self, name: &str) -> PerspectiveDeployment {
        self.pds().get(name).await.unwrap()
    }

    /// Waits until condition `type_` of `name` has `status` (and, if given, `reason`) for the
    /// current generation.
    async fn wait_condition(
        &self,
        name: &str,
        type_: &str,
        status: &str,
        reason: Option<&str>,
    ) -> PerspectiveDeployment {
        let what = format!("{name}: {type_}={status} {reason:?}");
        let result = poll(&what, LONG, || async {
            let pd = self.pds().get(name).await?;
            let st = pd.status.clone().unwrap_or_default();
            let fresh = st.observed_generation == pd.metadata.generation;
            let ok = st.conditions.iter().any(|c| {
                c.type_ == type_ && c.status == status && reason.is_none_or(|r| c.reason == r)
            });
            Ok((fresh && ok).then_some(pd))
        })
        .await;
        match result {
            Ok(pd) => pd,
            Err(e) => {
                let pd = self.pds().get(name).await.ok();
                panic!(
                    "{e:#}\nstatus: {:#?}\noperator logs:\n{}",
                    pd.and_then(|p| p.status),
                    self.operators
                        .iter()
                        .map(|o| tail(&o.log(), 4000).to_owned())
                        .collect::<Vec<_>>()
                        .join("\n---\n")
                )
            }
        }
    }

    async fn statefulset(&self, name: &str) -> Option<StatefulSet> {
        Api::<StatefulSet>::namespaced(self.client.clone(), &self.ns)
            .get_opt(name)
            .await
            .unwrap()
    }

    async fn jobs(&self) -> Vec<Job> {
        Api::<Job>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
    }

    async fn shutdown(mut self) {
        for o in &mut self.operators {
            o.kill();
        }
        if let Some(r) = self.runner.take() {
            r.shutdown().await;
        }
        let _ = support::delete_namespace(&self.client, &self.ns).await;
        let mut conn = db().await;
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
            .execute(&mut conn)
            .await;
    }
}

/// How many `K` in the world's namespace match `lp`.
async fn count<K>(w: &World, lp: &ListParams) -> anyhow::Result<usize>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Ok(Api::<K>::namespaced(w.client.clone(), &w.ns)
        .list(lp)
        .await?
        .items
        .len())
}

/// Condition `type_` of `pd`'s status (the test fails if it is missing).
fn condition(
    pd: &PerspectiveDeployment,
    type_: &str,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    pd.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_).cloned())
        .unwrap_or_else(|| panic!("{} has no {type_} condition", pd.name_any()))
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(0);
    &s[start..]
}

/// A deployment with two perspectives; `version` goes into order_summary rows (a handler change),
/// `extra` is appended to the spec (indented by the caller).
fn pd_yaml(name: &str, schema: &str, replicas: i32, version: &str, extra: &str) -> String {
    format!(
        r#"apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata:
  name: {name}
spec:
  schema: {schema}
  replicas: {replicas}
  database:
    secretRef: {{name: shop-db}}
  worker:
    heartbeatIntervalSeconds: 2
    abandonStaleInstanceThresholdSeconds: 10
  perspectives:
    - name: order_summary
      setup: |
        CREATE TABLE IF NOT EXISTS order_summary (
          order_id uuid PRIMARY KEY, total numeric NOT NULL, version text NOT NULL)
      handlers:
        OrderPlaced: |
          INSERT INTO order_summary (order_id, total, version)
          VALUES (:stream_id, (:data->>'total')::numeric, '{version}')
    - name: order_count
      setup: |
        CREATE TABLE IF NOT EXISTS order_count (id int PRIMARY KEY, n bigint NOT NULL);
        INSERT INTO order_count VALUES (1, 0) ON CONFLICT DO NOTHING
      handlers:
        OrderPlaced: UPDATE order_count SET n = n + 1 WHERE id = 1
{extra}"#
    )
}

async fn append_orders(conn: &mut PgConnection, schema: &str, n: usize) {
    for i in 0..n {
        sqlx::query(&format!(
            "SELECT * FROM {schema}.append_events(gen_random_uuid(), 0, \
             jsonb_build_array(jsonb_build_object('event_type', 'OrderPlaced', 'event_data', jsonb_build_object('total', $1::int))))"
        ))
        .bind(i as i32 + 1)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
}

/// Waits until `sql` (one bigint) returns `want`.
async fn wait_sql(conn: &mut PgConnection, what: &str, sql: &str, want: i64) {
    let mut last: Option<String>;
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        match sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(v) if v == want => return,
            other => last = Some(format!("{other:?}")),
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}: `{sql}` last gave {last:?}, want {want}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn schema_exists(conn: &mut PgConnection, schema: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

fn template_annotation(sts: &StatefulSet, key: &str) -> Option<String> {
    sts.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(key)
        .cloned()
}

// --- tests ---------------------------------------------------------------------------------

/// Acceptance 1, 2, 3, 6, 7, 8: install, create, materialize, change a handler, pause, scale,
/// lag, delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_of_a_deployment() {
    let w = World::new("life", &[("op", &[])]).await;
    // Discovery may lag the CRD's establishment by a moment.
    let explain = poll("kubectl explain pd.spec.perspectives", LONG, || async {
        let out = kubectl(&["explain", "pd.spec.perspectives"], None);
        Ok(out
            .status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
    })
    .await
    .unwrap();
    for field in ["handlers", "ordering", "setup", "reset", "name"] {
        assert!(
            explain.contains(field),
            "kubectl explain lacks {field}:\n{explain}"
        );
    }

    // 2. Create: migration Job first, then 3 workers with distinct instance ids.
    w.apply(&pd_yaml("shop", &w.schema, 3, "v1", ""));
    let ready = kubectl(
        &[
            "-n",
            &w.ns,
            "wait",
            "--for=condition=Ready",
            "pd/shop",
            "--timeout=120s",
        ],
        None,
    );
    assert!(
        ready.status.success(),
        "kubectl wait Ready failed: {}",
        String::from_utf8_lossy(&ready.stderr)
    );
    let mut conn = db().await;
    assert!(
        schema_exists(&mut conn, &w.schema).await,
        "the migration Job created the schema"
    );
    let jobs = w.jobs().await;
    assert_eq!(jobs.len(), 1, "one migration Job");
    let first_job = jobs[0].name_any();
    let sts = w
        .statefulset("shop")
        .await
        .expect("StatefulSet after the migration");
    let completed = jobs[0]
        .status
        .as_ref()
        .and_then(|s| s.completion_time.clone())
        .expect("Job completed");
    let created = sts.metadata.creation_timestamp.clone().unwrap();
    assert!(
        completed.0 <= created.0,
        "the StatefulSet ({created:?}) waited for the migration ({completed:?})"
    );
    let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
    assert!(
        events.contains("MigrationStarted") && events.contains("MigrationSucceeded"),
        "migration events recorded"
    );
    assert_eq!(sts.spec.as_ref().unwrap().replicas, Some(3));
    let workers = w
        .runner()
        .wait_running("3 worker processes", LONG, |r| {
            r.iter()
                .filter(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
                .count()
                == 3
        })
        .await
        .unwrap();
    let uids: BTreeSet<String> = workers
        .iter()
        .filter(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
        .map(|p| p.uid.clone())
        .collect();
    assert_eq!(uids.len(), 3);
    // Each worker registered under its own pod uid (PERSPECTIVE_INSTANCE_ID from metadata.uid).
    let instances_sql = format!(
        "SELECT count(*) FROM {}.wh_service_instances WHERE instance_id::text = ANY(ARRAY[{}])",
        w.schema,
        uids.iter()
            .map(|u| format!("'{u}'"))
            .collect::<Vec<_>>()
            .join(",")
    );
    wait_sql(
        &mut conn,
        "3 registered worker instances",
        &instances_sql,
        3,
    )
    .await;

    append_orders(&mut conn, &w.schema, 20).await;
    let summary_v1 = format!(
        "SELECT count(*) FROM {}.order_summary WHERE version = 'v1'",
        w.schema
    );
    wait_sql(&mut conn, "20 orders materialized", &summary_v1, 20).await;
    wait_sql(
        &mut conn,
        "order count",
        &format!("SELECT n FROM {}.order_count", w.schema),
        20,
    )
    .await;

    // The operator exports the deployment's status for the chart's alerts (at each scrape, from
    // its cache): Ready, 3 wanted, 3 live in the database, no dead letters.
    let operator_addr = w.operators[0]
        .http_addr()
        .expect("the operator logged its HTTP address");
    let id = format!(r#"deployment="shop",deployment_namespace="{}""#, w.ns);
    let status_series = [
        format!(r#"perspective_operator_condition{{{id},type="Ready"}} 1"#),
        format!(r#"perspective_operator_condition{{{id},type="MigrationsApplied"}} 1"#),
        format!("perspective_operator_desired_replicas{{{id}}} 3"),
        format!("perspective_operator_live_instances{{{id}}} 3"),
        format!("perspective_operator_dead_letters{{{id}}} 0"),
    ];
    poll("the operator's per-deployment gauges", LONG, || async {
        let metrics = http_get(&operator_addr, "/metrics")?;
        Ok(status_series
            .iter()
            .all(|s| metrics.contains(s.as_str()))
            .then_some(()))
    })
    .await
    .unwrap();

    // 3. Change a handler: a new Job (new name) runs, then the template rolls.
    let old_hash = template_annotation(&sts, "perspectives.dev/migration-hash").unwrap();
    w.apply(&pd_yaml("shop", &w.schema, 3, "v2", ""));
    // Ready stays True meanwhile (the old workers serve): the rollout is done when Progressing is.
    let pd = w
        .wait_condition("shop", "Progressing", "False", Some("Complete"))
        .await;
    assert_eq!(condition(&pd, "Ready").status, "True");
    let st = pd.status.clone().unwrap();
    assert_eq!(st.observed_generation, pd.metadata.generation);
    assert_eq!(pd.metadata.generation, Some(2));
    let new_job = st.migration_job.clone().unwrap();
    assert_ne!(new_job, first_job, "a new migration target is a new Job");
    let sts = w.statefulset("shop").await.unwrap();
    let new_hash = template_annotation(&sts, "perspectives.dev/migration-hash").unwrap();
    assert_ne!(new_hash, old_hash);
    assert_eq!(Some(new_hash), st.migrated_hash);
    poll("superseded Job deleted", LONG, || async {
        let names: Vec<String> = w.jobs().await.iter().map(|j| j.name_any()).collect();
        Ok((!names.contains(&first_job)).then_some(()))
    })
    .await
    .unwrap();
    append_orders(&mut conn, &w.schema, 5).await;
    let summary_v2 = format!(
        "SELECT count(*) FROM {}.order_summary WHERE version = 'v2'",
        w.schema
    );
    wait_sql(
        &mut conn,
        "new orders through the new handler",
        &summary_v2,
        5,
    )
    .await;

    // 6. Pause: children frozen (a replica change waits), unpause resumes.
    w.apply(&pd_yaml("shop", &w.schema, 2, "v2", "  paused: true\n"));
    w.wait_condition("shop", "ReconciliationPaused", "True", Some("Paused"))
        .await;
    assert_eq!(
        w.statefulset("shop").await.unwrap().spec.unwrap().replicas,
        Some(3),
        "paused: StatefulSet untouched"
    );
    // Issue 13: the replica count that waits says it waits for the unpause (not "3/2 ready").
    let pd = w
        .wait_condition("shop", "Ready", "True", Some("MinimumAvailable"))
        .await;
    assert_eq!(
        condition(&pd, "Ready").message,
        "spec.paused is true: 3 worker pods (3 ready), scaled to 2 when it is false"
    );
    let table = kubectl_ok(&["-n", &w.ns, "get", "pd", "shop"], None);
    assert!(
        table.lines().next().unwrap().contains("STATUS")
            && table.lines().nth(1).unwrap().contains("Paused"),
        "the STATUS column says paused: {table}"
    );
    w.apply(&pd_yaml("shop", &w.schema, 2, "v2", ""));
    w.wait_condition("shop", "ReconciliationPaused", "False", None)
        .await;
    w.wait_condition("shop", "Ready", "True", None).await;
    assert_eq!(
        w.statefulset("shop").await.unwrap().spec.unwrap().replicas,
        Some(2)
    );

    // 8. Lag: no workers (scale subresource), appended events show as pending in `kubectl get`.
    kubectl_ok(&["-n", &w.ns, "scale", "pd/shop", "--replicas=0"], None);
    // Not only "not running": a worker that got SIGTERM finishes its in-flight work first.
    w.runner()
        .wait_for("no worker process alive", LONG, |pods| {
            pods.iter()
                .filter(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
                .all(|p| {
                    !matches!(
                        p.state,
                        ProcState::Running { .. }
                            | ProcState::Stopping { .. }
                            | ProcState::Starting
                    )
                })
                .then_some(())
        })
        .await
        .unwrap();
    append_orders(&mut conn, &w.schema, 4).await;
    poll("pending events and lag in kubectl get", LONG, || async {
        let out = kubectl_ok(&["-n", &w.ns, "get", "pd", "shop", "-o", "json"], None);
        let v: Value = serde_json::from_str(&out)?;
        let pending = v["status"]["pendingEvents"].as_i64().unwrap_or(0);
        let oldest = v["status"]["oldestPendingSeconds"].as_i64().unwrap_or(0);
        let per = v["status"]["perspectives"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let per_ok = per.iter().all(|p| p["pendingEvents"].as_i64() == Some(4));
        Ok((pending == 8 && oldest >= 1 && per.len() == 2 && per_ok).then_some(()))
    })
    .await
    .unwrap();
    let table = kubectl_ok(&["-n", &w.ns, "get", "pd", "shop"], None);
    assert!(
        table.contains("PENDING") && table.contains("LAG") && table.contains("DEADLETTERS"),
        "{table}"
    );
    let row = table.lines().nth(1).unwrap().to_owned();
    assert!(
        row.split_whitespace().any(|c| c == "8"),
        "pending 8 shown: {table}"
    );
    kubectl_ok(&["-n", &w.ns, "scale", "pd/shop", "--replicas=1"], None);
    wait_sql(
        &mut conn,
        "backlog applied",
        &format!("SELECT n FROM {}.order_count", w.schema),
        29,
    )
    .await;
    poll("lag back to zero", LONG, || async {
        let st = w.pd("shop").await.status.unwrap_or_default();
        Ok((st.pending_events == Some(0)).then_some(()))
    })
    .await
    .unwrap();

    // 7. Delete: children garbage-collected, the schema stays.
    kubectl_ok(&["-n", &w.ns, "delete", "pd", "shop"], None);
    poll("children garbage-collected", LONG, || async {
        let lp = ListParams::default().labels("app.kubernetes.io/instance=shop");
        let n = count::<StatefulSet>(&w, &lp).await?
            + count::<Job>(&w, &lp).await?
            + count::<ConfigMap>(&w, &lp).await?
            + count::<Service>(&w, &lp).await?
            + count::<PodDisruptionBudget>(&w, &lp).await?
            + count::<Pod>(&w, &lp).await?;
        Ok((n == 0).then_some(()))
    })
    .await
    .unwrap();
    assert!(
        schema_exists(&mut conn, &w.schema).await,
        "deleting the CR leaves the schema"
    );
    poll("the deleted deployment's series gone", LONG, || async {
        Ok((!http_get(&operator_addr, "/metrics")?.contains(&id)).then_some(()))
    })
    .await
    .unwrap();
    wait_sql(
        &mut conn,
        "models intact",
        &format!("SELECT count(*) FROM {}.order_summary", w.schema),
        29,
    )
    .await;
    w.shutdown().await;
}

/// Acceptance 4: a failing migration keeps the old template; fixing the spec recovers. Ready
/// means serving (issue 27): a handler typo the migration finds, then one validation finds,
/// leave a serving deployment Ready (`PreviousSpecServing`) while its worker applies events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_migration_keeps_the_running_workers() {
    let w = World::new("fail", &[("op", &[])]).await;
    let no_retry = "  migrations:\n    backoffLimit: 0\n";
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", no_retry));
    w.wait_condition("shop", "Ready", "True", None).await;
    let good_hash = template_annotation(
        &w.statefulset("shop").await.unwrap(),
        "perspectives.dev/migration-hash",
    );
    let worker_uid = w
        .runner()
        .wait_running("a worker", LONG, |r| {
            r.iter()
                .any(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
        })
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
        .unwrap()
        .uid;

    // A typo in a handler that only the migration finds (valid config, SQL that does not parse).
    let broken = pd_yaml("shop", &w.schema, 1, "v1", no_retry).replace(
        "OrderPlaced: UPDATE order_count SET n = n + 1 WHERE id = 1",
        "OrderPlaced: UPDTE order_count SET n = n + 1 WHERE id = 1",
    );
    w.apply(&broken);
    let pd = w
        .wait_condition(
            "shop",
            "MigrationsApplied",
            "False",
            Some("BackoffLimitExceeded"),
        )
        .await;
    let degraded = w
        .wait_condition("shop", "Degraded", "True", Some("MigrationFailed"))
        .await;
    let message = condition(&degraded, "Degraded").message;
    let job = degraded.status.clone().unwrap().migration_job.unwrap();
    assert!(
        message.contains(&format!("kubectl logs job/{job}")),
        "the status says where the Job's output is: {message}"
    );
    // Ready means serving: the previous spec's worker keeps applying events.
    let ready = condition(&pd, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "PreviousSpecServing"),
        "{ready:?}"
    );
    let progressing = w
        .wait_condition(
            "shop",
            "Progressing",
            "False",
            Some("MigrationRetryScheduled"),
        )
        .await;
    let message = condition(&progressing, "Progressing").message;
    assert!(
        message.contains("the next attempt runs at 20"),
        "Progressing says when the migration runs again: {message}"
    );
    let mut conn = db().await;
    append_orders(&mut conn, &w.schema, 2).await;
    wait_sql(
        &mut conn,
        "orders applied by the previous spec's worker",
        &format!(
            "SELECT count(*) FROM {}.order_summary WHERE version = 'v1'",
            w.schema
        ),
        2,
    )
    .await;
    // A spec error validation finds: Degraded InvalidSpec, Ready as it was.
    w.apply(&broken.replace("'v1')", ":no_such_parameter)"));
    let invalid = w
        .wait_condition("shop", "Degraded", "True", Some("InvalidSpec"))
        .await;
    assert_eq!(
        condition(&invalid, "Ready").reason,
        "PreviousSpecServing",
        "an invalid spec leaves a serving deployment Ready"
    );
    assert!(condition(&invalid, "Ready").status == "True");
    let sts = w.statefulset("shop").await.unwrap();
    assert_eq!(
        template_annotation(&sts, "perspectives.dev/migration-hash"),
        good_hash,
        "old template kept"
    );
    assert!(
        w.runner().running().iter().any(|p| p.uid == worker_uid),
        "the old worker keeps running"
    );
    let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
    assert!(
        events.contains("MigrationFailed") && events.contains("MigrationStarted"),
        "events recorded"
    );

    // Fix: a new target, a new Job, and the workers roll.
    w.apply(&pd_yaml("shop", &w.schema, 1, "v3", no_retry));
    w.wait_condition("shop", "MigrationsApplied", "True", None)
        .await;
    w.wait_condition("shop", "Degraded", "False", None).await;
    w.wait_condition("shop", "Ready", "True", None).await;
    let sts = w.statefulset("shop").await.unwrap();
    assert_ne!(
        template_annotation(&sts, "perspectives.dev/migration-hash"),
        good_hash
    );
    append_orders(&mut conn, &w.schema, 3).await;
    wait_sql(
        &mut conn,
        "orders through the fixed deployment",
        &format!(
            "SELECT count(*) FROM {}.order_summary WHERE version = 'v3'",
            w.schema
        ),
        3,
    )
    .await;
    w.shutdown().await;
}

/// Acceptance 5: invalid specs are rejected by the API server or reported as Degraded with the
/// field named, without touching a valid deployment in the same namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_are_rejected_or_reported() {
    let w = World::new("bad", &[("op", &[])]).await;
    w.apply(&pd_yaml("good", &w.schema, 1, "v1", ""));
    w.wait_condition("good", "Ready", "True", None).await;
    let good_sts = w.statefulset("good").await.unwrap();

    // The documented example passes the API server's validation as it is.
    let example =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/shop-deployment.yaml");
    kubectl_ok(
        &[
            "-n",
            &w.ns,
            "apply",
            "--server-side",
            "--dry-run=server",
            "-f",
            example.to_str().unwrap(),
        ],
        None,
    );

    let valid = pd_yaml("bad", &w.schema, 1, "v1", "");
    // (what, spec, Err(substring of kubectl's error) | Ok(substring of the Degraded message))
    let cases: Vec<(&str, String, Result<&str, &str>)> = vec![
        (
            "bad perspective name",
            valid.replace("name: order_count", "name: Order-Count"),
            Err("spec.perspectives[1].name"),
        ),
        (
            "bad schema identifier",
            valid.replace(&format!("schema: {}", w.schema), "schema: \"shop;drop\""),
            Err("spec.schema"),
        ),
        (
            "unknown option",
            valid.replace(
                "abandonStaleInstanceThresholdSeconds: 10",
                "abandonStaleInstanceThresholdSeconds: 10\n    bogusOption: 1",
            ),
            Err("bogusOption"),
        ),
        (
            "wrong type",
            valid.replace(
                "abandonStaleInstanceThresholdSeconds: 10",
                "abandonStaleInstanceThresholdSeconds: ten",
            ),
            Err("abandonStaleInstanceThresholdSeconds"),
        ),
        (
            "negative replicas",
            valid.replace("replicas: 1", "replicas: -1"),
            Err("spec.replicas"),
        ),
        (
            "unknown completion strategy",
            valid.replace(
                "abandonStaleInstanceThresholdSeconds: 10",
                "completionStrategy: Sometimes",
            ),
            Err("completionStrategy"),
        ),
        (
            "missing Secret",
            valid.replace("name: shop-db", "name: no-such-secret"),
            Ok("spec.database.secretRef:"),
        ),
        (
            "missing Secret key",
            valid.replace(
                "secretRef: {name: shop-db}",
                "secretRef: {name: shop-db, key: nope}",
            ),
            Ok("spec.database.secretRef:"),
        ),
        // CEL rules of the CRD (issue 27: admission-time validation), in the worker's words.
        (
            "duplicate perspective",
            valid.replace("name: order_count", "name: order_summary"),
            Err("spec.perspectives: Invalid value: duplicate perspective name"),
        ),
        (
            "sequencing key without its key",
            valid.replace("    - name: order_count\n", "    - name: order_count\n      sequencing: key\n"),
            Err("spec.perspectives[1].sequencingKey: Invalid value: sequencing: key needs a sequencingKey"),
        ),
        (
            "a key without sequencing: key",
            valid.replace(
                "    - name: order_count\n",
                "    - name: order_count\n      sequencingKey: \":data->>'customer'\"\n",
            ),
            Err("spec.perspectives[1].sequencingKey: Invalid value: sequencingKey is used only with sequencing: key (this perspective has sequencing: stream)"),
        ),
        (
            "unknown handler parameter",
            valid.replace("WHERE id = 1", "WHERE id = :no_such_param"),
            Ok("no_such_param"),
        ),
        (
            "parameter in setup",
            valid.replace(
                "ON CONFLICT DO NOTHING",
                "ON CONFLICT DO NOTHING; SELECT :stream_id",
            ),
            Ok("setup"),
        ),
        (
            "name too long",
            valid.replace("name: bad\n", &format!("name: {}\n", "b".repeat(45))),
            Ok("metadata.name"),
        ),
    ];
    for (what, yaml, expected) in &cases {
        let out = kubectl(
            &["-n", &w.ns, "apply", "--server-side", "-f", "-"],
            Some(yaml),
        );
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        match expected {
            Err(field) => {
                assert!(!out.status.success(), "{what}: accepted by the API server");
                assert!(
                    stderr.contains(field),
                    "{what}: error does not name {field}: {stderr}"
                );
            }
            Ok(field) => {
                assert!(out.status.success(), "{what}: rejected: {stderr}");
                let name = yaml
                    .lines()
                    .find_map(|l| l.strip_prefix("  name: "))
                    .unwrap()
                    .to_owned();
                let reason = if field.starts_with("spec.database.secretRef") {
                    "SecretMissing"
                } else {
                    "InvalidSpec"
                };
                let pd = w
                    .wait_condition(&name, "Degraded", "True", Some(reason))
                    .await;
                let message = condition(&pd, "Degraded").message;
                assert!(
                    message.contains(field),
                    "{what}: Degraded message does not name {field}: {message}"
                );
                let lp =
                    ListParams::default().labels(&format!("app.kubernetes.io/instance={name}"));
                assert!(
                    Api::<Job>::namespaced(w.client.clone(), &w.ns)
                        .list(&lp)
                        .await
                        .unwrap()
                        .items
                        .is_empty(),
                    "{what}: a Job was created"
                );
                assert!(
                    w.statefulset(&name).await.is_none(),
                    "{what}: a StatefulSet was created"
                );
                kubectl_ok(&["-n", &w.ns, "delete", "pd", &name, "--wait=true"], None);
            }
        }
    }
    // The valid neighbour never changed and stayed Ready.
    let after = w.statefulset("good").await.unwrap();
    assert_eq!(after.metadata.generation, good_sts.metadata.generation);
    let pd = w.pd("good").await;
    assert!(pd
        .status
        .unwrap()
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
    assert!(
        events.contains("InvalidSpec"),
        "validation errors are Events too"
    );
    w.shutdown().await;
}

/// Acceptance 9: two operator replicas, only the leader reconciles; killing it hands over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_hands_over() {
    let mut w = World::new("lead", &[]).await;
    let ns = w.ns.clone();
    let args: Vec<String> = vec![
        "--leader-election".into(),
        "--lease-namespace".into(),
        ns.clone(),
        "--lease-seconds=4".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    w.operators
        .push(Operator::start(&w.dir, &ns, "op-a", &args));
    w.operators
        .push(Operator::start(&w.dir, &ns, "op-b", &args));
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), &ns);
    let holder = poll("a leader", LONG, || async {
        Ok(leases
            .get_opt("perspective-operator")
            .await?
            .and_then(|l| l.spec?.holder_identity))
    })
    .await
    .unwrap();
    assert!(holder == "op-a" || holder == "op-b", "holder {holder}");
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", ""));
    w.wait_condition("shop", "Ready", "True", None).await;

    // Only the leader reconciled.
    let reconciles = |o: &Operator| -> anyhow::Result<f64> {
        let addr = o.http_addr().context("no HTTP address logged yet")?;
        let body = http_get(&addr, "/metrics")?;
        Ok(body
            .lines()
            .find_map(|l| l.strip_prefix("perspective_operator_reconciles_total "))
            .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0)))
    };
    let (leader_idx, standby_idx) = if holder == "op-a" { (0, 1) } else { (1, 0) };
    poll("standby serving metrics", LONG, || async {
        Ok(w.operators[standby_idx].http_addr())
    })
    .await
    .unwrap();
    assert!(
        reconciles(&w.operators[leader_idx]).unwrap() > 0.0,
        "the leader reconciled"
    );
    assert_eq!(
        reconciles(&w.operators[standby_idx]).unwrap(),
        0.0,
        "the standby did not reconcile"
    );

    // Kill the leader (no lease release): the standby takes over after expiry and reconciles.
    w.operators[leader_idx].kill();
    let standby = if holder == "op-a" { "op-b" } else { "op-a" };
    poll("the standby takes the lease", LONG, || async {
        let h = leases
            .get_opt("perspective-operator")
            .await?
            .and_then(|l| l.spec?.holder_identity);
        Ok((h.as_deref() == Some(standby)).then_some(()))
    })
    .await
    .unwrap();
    w.apply(&pd_yaml("shop", &w.schema, 2, "v1", ""));
    w.wait_condition("shop", "Ready", "True", None).await;
    assert_eq!(
        w.statefulset("shop").await.unwrap().spec.unwrap().replicas,
        Some(2)
    );
    assert!(reconciles(&w.operators[standby_idx]).unwrap() > 0.0);

    // A graceful stop (SIGTERM) exits 0 and gives the lease up for the next replica.
    w.operators
        .push(Operator::start(&w.dir, &ns, "op-c", &args));
    let pid = w.operators[standby_idx].child.id();
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let deadline = std::time::Instant::now() + LONG;
    let status = loop {
        if let Some(status) = w.operators[standby_idx].child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the leader did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "SIGTERM exit status {status:?}: {}",
        w.operators[standby_idx].log()
    );
    poll("op-c takes the lease", LONG, || async {
        let h = leases
            .get_opt("perspective-operator")
            .await?
            .and_then(|l| l.spec?.holder_identity);
        Ok((h.as_deref() == Some("op-c")).then_some(()))
    })
    .await
    .unwrap();
    w.shutdown().await;
}

/// Issue 13: a leader stopped with SIGTERM releases the Lease and a standby takes it within
/// about a second (it reads the Lease every second), not when the 30 s lease it last read would
/// have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_hands_over_at_once() {
    let mut w = World::new("handover", &[]).await;
    let ns = w.ns.clone();
    let args = [
        "--leader-election",
        "--lease-namespace",
        ns.as_str(),
        "--lease-seconds=30",
    ];
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), &ns);
    let holder = || async {
        anyhow::Ok(
            leases
                .get_opt("perspective-operator")
                .await?
                .and_then(|l| l.spec?.holder_identity),
        )
    };
    w.operators
        .push(Operator::start(&w.dir, &ns, "op-a", &args));
    poll("op-a leads", LONG, || async {
        Ok((holder().await?.as_deref() == Some("op-a")).then_some(()))
    })
    .await
    .unwrap();
    w.operators
        .push(Operator::start(&w.dir, &ns, "op-b", &args));
    poll("op-b stands by", LONG, || async {
        Ok(w.operators[1]
            .log()
            .contains("waiting for leadership")
            .then_some(()))
    })
    .await
    .unwrap();
    // Past op-b's first look at the Lease, so it has read op-a's 30 s lease.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(holder().await.unwrap().as_deref(), Some("op-a"));

    let pid = w.operators[0].child.id();
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let deadline = std::time::Instant::now() + LONG;
    let status = loop {
        if let Some(status) = w.operators[0].child.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "op-a did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{}", w.operators[0].log());
    let stopped = std::time::Instant::now();
    poll("op-b takes the lease", LONG, || async {
        Ok((holder().await?.as_deref() == Some("op-b")).then_some(()))
    })
    .await
    .unwrap();
    let took = stopped.elapsed();
    eprintln!("[e2e] handover took {took:?}");
    assert!(
        took < Duration::from_secs(4),
        "handover took {took:?}; a released lease should be taken within about a second"
    );
    w.shutdown().await;
}

/// A minimal HTTP/1.0 GET against one of our own loopback processes.
fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    if !body.starts_with("HTTP/1.0 200") && !body.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", body.lines().next().unwrap_or(""));
    }
    Ok(body)
}

/// The operator running with exactly the Helm chart's RBAC (a namespace-scoped install,
/// impersonating the chart's ServiceAccount) reconciles a deployment to Ready and leads.
/// (Impersonating a ServiceAccount without those grants instead fails with `forbidden`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_works_with_the_charts_rbac() {
    let mut w = World::new("rbac", &[]).await;
    let ns = w.ns.clone();
    let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/perspective-operator");
    let out = Command::new("helm")
        .args([
            "install",
            "po",
            chart.to_str().unwrap(),
            "-n",
            &ns,
            "--wait=false",
        ])
        .args(["--set", &format!("watchNamespace={ns}")])
        .args([
            "--set",
            "replicaCount=0",
            "--set",
            "serviceAccount.name=po-operator",
        ])
        .output()
        .expect("helm on PATH (run via tests/e2e/with-control-plane.sh)");
    assert!(
        out.status.success(),
        "helm install: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A kubeconfig that acts as the chart's ServiceAccount.
    let admin: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(std::env::var("KUBECONFIG").unwrap()).unwrap(),
    )
    .unwrap();
    let mut as_sa = admin.clone();
    for user in as_sa["users"].as_sequence_mut().unwrap() {
        user["user"]["as"] = format!("system:serviceaccount:{ns}:po-operator").into();
    }
    let kubeconfig = w.dir.join("kubeconfig-chart-rbac");
    std::fs::write(&kubeconfig, serde_yaml::to_string(&as_sa).unwrap()).unwrap();
    let args = [
        "--leader-election",
        "--lease-namespace",
        ns.as_str(),
        "--lease-name",
        "po",
    ];
    w.operators.push(Operator::start_with_env(
        &w.dir,
        &ns,
        "op-rbac",
        &args,
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    ));

    w.apply(&pd_yaml("shop", &w.schema, 2, "v1", ""));
    w.wait_condition("shop", "Ready", "True", None).await;
    let mut conn = db().await;
    append_orders(&mut conn, &w.schema, 5).await;
    wait_sql(
        &mut conn,
        "orders materialized",
        &format!("SELECT n FROM {}.order_count", w.schema),
        5,
    )
    .await;
    // A new spec: a new Job and ConfigMap; the superseded ones are deleted with these grants.
    let first_job = w.pd("shop").await.status.unwrap().migration_job.unwrap();
    w.apply(&pd_yaml("shop", &w.schema, 2, "v2", ""));
    poll("the superseded Job deleted", LONG, || async {
        let jobs: Vec<String> = w.jobs().await.iter().map(|j| j.name_any()).collect();
        Ok((jobs.len() == 1 && jobs[0] != first_job).then_some(()))
    })
    .await
    .unwrap();
    // A day-2 action with these grants: the deployment read and its annotation removed, the
    // action Job created and marked reported.
    kubectl_ok(
        &[
            "-n",
            &ns,
            "annotate",
            "pd/shop",
            "perspectives.dev/discard-dead-letters=all",
        ],
        None,
    );
    wait_last_action(
        &w,
        "shop",
        "perspectives.dev/discard-dead-letters",
        perspective_operator::crd::ActionPhase::Succeeded,
    )
    .await;
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), &ns);
    let holder = leases
        .get("po")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some("op-rbac"));
    let log = w.operators[0].log();
    assert!(
        !log.contains("forbidden"),
        "the chart's RBAC lacks a permission:\n{}",
        tail(&log, 4000)
    );
    let events = kubectl_ok(&["-n", &ns, "get", "events", "-o", "json"], None);
    assert!(
        events.contains("MigrationSucceeded"),
        "events published with the chart's RBAC"
    );
    w.shutdown().await;
}

/// A migration that fails for a reason outside the spec (here: a table it needs does not exist
/// yet) is retried with backoff — the same Job name run again — and succeeds once the cause is
/// gone, without any change to the resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_migration_is_retried_with_backoff() {
    let w = World::new("retry", &[("op", &["--migration-retry-seconds=1"])]).await;
    let dep = format!("{}_dep", w.schema);
    let yaml = pd_yaml(
        "shop",
        &w.schema,
        1,
        "v1",
        "  migrations:\n    backoffLimit: 0\n",
    )
    .replace(
        "INSERT INTO order_count VALUES (1, 0) ON CONFLICT DO NOTHING",
        &format!("INSERT INTO order_count SELECT 1, 0 FROM {dep}.ready ON CONFLICT DO NOTHING"),
    );
    w.apply(&yaml);
    let failed = w
        .wait_condition(
            "shop",
            "MigrationsApplied",
            "False",
            Some("BackoffLimitExceeded"),
        )
        .await;
    let job = failed.status.clone().unwrap().migration_job.unwrap();
    assert!(failed.status.unwrap().migration_failures >= 1);

    let mut conn = db().await;
    sqlx::query(&format!("CREATE SCHEMA {dep}"))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE TABLE {dep}.ready AS SELECT 1 AS ok"))
        .execute(&mut conn)
        .await
        .unwrap();
    let pd = w.wait_condition("shop", "Ready", "True", None).await;
    let st = pd.status.unwrap();
    assert_eq!(
        st.migration_job.as_deref(),
        Some(job.as_str()),
        "the same target, run again"
    );
    assert!(
        st.migration_failures >= 1,
        "failures are counted: {}",
        st.migration_failures
    );
    assert_eq!(pd.metadata.generation, Some(1), "no spec change was needed");
    let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
    assert!(
        events.contains("MigrationRetrying"),
        "the retry is an Event"
    );
    append_orders(&mut conn, &w.schema, 2).await;
    wait_sql(
        &mut conn,
        "orders applied",
        &format!("SELECT n FROM {}.order_count", w.schema),
        2,
    )
    .await;
    sqlx::query(&format!("DROP SCHEMA {dep} CASCADE"))
        .execute(&mut conn)
        .await
        .unwrap();
    w.shutdown().await;
}

/// A deployment whose Secret does not exist yet is reported (`SecretMissing`, the field named,
/// nothing created) and recovers by itself once the Secret appears — no spec change needed; a
/// Secret deleted later is reported the same way and its re-creation recovers in seconds (a short
/// re-check, not the status interval, which is 10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_7_a_missing_secret_is_reported_generically_until_it_exists() {
    let w = World::new("secret", &[("op", &["--status-interval-seconds=10"])]).await;
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", "").replace("name: shop-db", "name: later-db"));
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("SecretMissing"))
        .await;
    let message = condition(&pd, "Degraded").message;
    // Issue 26, finding 7: the field, not the Secret's name or key, nor whether it exists.
    assert!(
        message.contains("spec.database.secretRef:")
            && message.contains("missing or has no value under its key")
            && !message.contains("later-db")
            && !message.contains("\"url\""),
        "{message}"
    );
    assert_eq!(condition(&pd, "Ready").reason, "SecretMissing");
    assert!(
        !condition(&pd, "Progressing")
            .message
            .contains("spec change"),
        "a Secret is not a spec change"
    );
    assert!(
        w.jobs().await.is_empty(),
        "nothing runs without the database URL"
    );
    let create_secret = || {
        kubectl_ok(
            &[
                "-n",
                &w.ns,
                "create",
                "secret",
                "generic",
                "later-db",
                &format!("--from-literal=url={}", database_url()),
            ],
            None,
        )
    };
    create_secret();
    w.wait_condition("shop", "Ready", "True", None).await;
    w.wait_condition("shop", "Degraded", "False", None).await;
    let mut conn = db().await;
    append_orders(&mut conn, &w.schema, 3).await;
    wait_sql(
        &mut conn,
        "orders applied",
        &format!("SELECT n FROM {}.order_count", w.schema),
        3,
    )
    .await;

    // Deleted later: SecretMissing (within a status interval); recreated: Ready within seconds.
    kubectl_ok(&["-n", &w.ns, "delete", "secret", "later-db"], None);
    w.wait_condition("shop", "Degraded", "True", Some("SecretMissing"))
        .await;
    create_secret();
    let recreated = std::time::Instant::now();
    w.wait_condition("shop", "Ready", "True", None).await;
    let took = recreated.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "recovery took {took:?}: the Secret is re-checked every few seconds, not every status interval (10 s)"
    );
    eprintln!("[e2e] Ready again {took:?} after the Secret was recreated");
    w.wait_condition("shop", "Degraded", "False", None).await;
    w.shutdown().await;
}

/// Issue 13: every Event says what just happened. Three different invalid specs in a row are
/// three Warning Events with three messages, in order (kube-runtime's recorder showed the first
/// message three times); a migration Event names its Job as the related object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_says_what_just_happened() {
    use k8s_openapi::api::events::v1::Event;
    let w = World::new("events", &[("op", &[])]).await;
    let valid = pd_yaml("shop", &w.schema, 1, "v1", "");
    let params = [":first_unknown", ":second_unknown", ":third_unknown"];
    for param in params {
        w.apply(&valid.replace("WHERE id = 1", &format!("WHERE id = {param}")));
        let pd = w
            .wait_condition("shop", "Degraded", "True", Some("InvalidSpec"))
            .await;
        let message = condition(&pd, "Degraded").message;
        assert!(message.contains(param), "{message}");
    }
    let events: Api<Event> = Api::namespaced(w.client.clone(), &w.ns);
    let about_shop = |reason: &'static str| {
        let events = events.clone();
        async move {
            let mut list: Vec<Event> = events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("shop")
                })
                .collect();
            list.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
            anyhow::Ok(list)
        }
    };
    let invalid = poll("three InvalidSpec Events", LONG, || async {
        let list = about_shop("InvalidSpec").await?;
        Ok((list.len() >= 3).then_some(list))
    })
    .await
    .unwrap();
    assert_eq!(invalid.len(), 3, "one Event per message");
    for (event, param) in invalid.iter().zip(params) {
        let note = event.note.clone().unwrap_or_default();
        assert!(note.contains(param), "in order: {param} not in {note}");
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert!(
            event.series.is_none(),
            "not folded into a series: {event:?}"
        );
    }

    // Fixed: the migration Events are about the Job created for this spec.
    w.apply(&valid);
    let pd = w.wait_condition("shop", "Ready", "True", None).await;
    let job = pd.status.unwrap().migration_job.unwrap();
    for reason in ["MigrationStarted", "MigrationSucceeded"] {
        let list = poll(reason, LONG, || async {
            let list = about_shop(reason).await?;
            Ok((!list.is_empty()).then_some(list))
        })
        .await
        .unwrap();
        let related = list[0].related.clone().expect("a related object");
        assert_eq!(
            (related.kind.as_deref(), related.name.as_deref()),
            (Some("Job"), Some(job.as_str())),
            "{reason}"
        );
        assert!(list[0].note.as_deref().unwrap_or_default().contains(&job));
    }
    w.shutdown().await;
}

/// Issue 13: a spec the CRD schema accepts but whose child the API server refuses (here a
/// node selector key that is not a label key: the Job is invalid) is `Degraded=ChildRejected`
/// with the server's message and a Warning Event — not only a log line — and leaves no
/// ConfigMap behind. Fixing the spec recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_the_api_server_refuses_is_reported() {
    use k8s_openapi::api::events::v1::Event;
    let w = World::new("reject", &[("op", &[])]).await;
    let valid = pd_yaml("shop", &w.schema, 1, "v1", "");
    w.apply(&format!("{valid}  nodeSelector:\n    \"bad key!\": x\n"));
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("ChildRejected"))
        .await;
    let message = condition(&pd, "Degraded").message;
    assert!(
        message.starts_with("Job shop-migrate-") && message.contains("nodeSelector"),
        "the server's message, naming the object: {message}"
    );
    assert_eq!(condition(&pd, "Ready").reason, "ChildRejected");
    assert_eq!(
        pd.status.as_ref().unwrap().summary.as_deref(),
        Some("Degraded: ChildRejected")
    );
    let events: Api<Event> = Api::namespaced(w.client.clone(), &w.ns);
    let warning = poll("a ChildRejected Event", LONG, || async {
        Ok(events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("ChildRejected")))
    })
    .await
    .unwrap();
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert!(warning.note.unwrap_or_default().contains("nodeSelector"));
    let instance = ListParams::default().labels("app.kubernetes.io/instance=shop");
    assert_eq!(
        count::<ConfigMap>(&w, &instance).await.unwrap(),
        0,
        "no ConfigMap left"
    );
    assert!(w.jobs().await.is_empty());
    // The operator's log: JSON lines, one `message` each, the object as plain fields.
    let log = w.operators[0].log();
    let degraded: Vec<Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            assert!(
                l.matches("\"message\":").count() == 1,
                "one message key per line: {l}"
            );
            serde_json::from_str::<Value>(l).unwrap()
        })
        .filter(|v| v["fields"]["message"] == "PerspectiveDeployment degraded")
        .collect();
    assert!(!degraded.is_empty(), "the refusal is logged:\n{log}");
    for line in &degraded {
        let fields = &line["fields"];
        assert_eq!(
            (fields["namespace"].as_str(), fields["name"].as_str()),
            (Some(w.ns.as_str()), Some("shop")),
            "{fields}"
        );
        assert_eq!(fields["reason"], "ChildRejected");
    }

    // The manifest without the selector: server-side apply drops the field.
    w.apply(&valid);
    w.wait_condition("shop", "Ready", "True", None).await;
    w.wait_condition("shop", "Degraded", "False", None).await;
    w.shutdown().await;
}

/// A deployment whose perspectives are `names` (each from [`catch_up_perspective`]).
fn catch_up_yaml(schema: &str, perspectives: &[(&str, u32)]) -> String {
    format!(
        r#"apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata:
  name: shop
spec:
  schema: {schema}
  replicas: 2
  database:
    secretRef: {{name: shop-db}}
  worker:
    heartbeatIntervalSeconds: 2
    abandonStaleInstanceThresholdSeconds: 10
  perspectives:
{}"#,
        perspectives
            .iter()
            .map(|(name, version)| catch_up_perspective(name, *version))
            .collect::<String>()
    )
}

/// One row per order; each event takes a millisecond, and waits while a session holds the
/// advisory lock [`catch_up_gate`] of the perspective, so a test can hold a backfill until the
/// status has shown it.
fn catch_up_perspective(name: &str, version: u32) -> String {
    format!(
        r#"    - name: {name}
      version: {version}
      setup: |
        CREATE TABLE IF NOT EXISTS {name} (order_id uuid PRIMARY KEY, total bigint NOT NULL)
      reset: DELETE FROM {name} WHERE order_id = :stream_id
      handlers:
        OrderPlaced: |
          INSERT INTO {name} (order_id, total)
          SELECT :stream_id, (:data->>'total')::bigint
          FROM pg_sleep(0.001), pg_advisory_xact_lock_shared(hashtext('{name}'))
"#
    )
}

/// Hold `perspective`'s handlers (see [`catch_up_perspective`]) on `conn` until `release`.
async fn catch_up_gate(conn: &mut sqlx::PgConnection, perspective: &str, release: bool) {
    let f = if release {
        "pg_advisory_unlock"
    } else {
        "pg_advisory_lock"
    };
    sqlx::query(&format!("SELECT {f}(hashtext($1))::text"))
        .bind(perspective)
        .execute(conn)
        .await
        .unwrap();
}

/// Wait until the status of `shop` shows `pendingEvents` above 0 while a perspective catches up
/// (the backfill held by [`catch_up_gate`]), then let the backfill go.
async fn release_when_pending_shown(w: &World, mut gate: sqlx::PgConnection, perspective: &str) {
    let shown = poll("pendingEvents above 0 while catching up", LONG, || async {
        let st = w.pds().get("shop").await?.status.unwrap_or_default();
        let catching_up = st
            .perspectives
            .iter()
            .any(|p| p.phase != perspective_operator::crd::PerspectivePhase::Live);
        Ok((catching_up && st.pending_events.is_some_and(|n| n > 0)).then_some(()))
    })
    .await;
    catch_up_gate(&mut gate, perspective, true).await;
    shown.unwrap();
}

/// Issue 10, acceptance 6: a perspective added to a running deployment with history gets a new
/// migration Job, backfills while `Progressing` says so, ends `Live` and complete, and the
/// deployment stays `Ready` throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_perspective_backfills_while_the_deployment_stays_ready() {
    const ORDERS: i64 = 4_000;
    // A long status interval: the operator must refresh sooner by itself while catching up.
    let w = World::new("catchup", &[("op", &["--status-interval-seconds=15"])]).await;
    w.apply(&catch_up_yaml(&w.schema, &[("order_rows", 1)]));
    w.wait_condition("shop", "Ready", "True", None).await;
    let first_job = w.pd("shop").await.status.unwrap().migration_job.unwrap();
    let mut conn = db().await;
    // History: ORDERS streams of one event each, appended in one statement.
    sqlx::query(&format!(
        "SELECT count(*) FROM generate_series(1, {ORDERS}) AS g(i), LATERAL {}.append_events(
           gen_random_uuid(), 0, jsonb_build_array(jsonb_build_object(
             'event_type', 'OrderPlaced', 'event_data', jsonb_build_object('total', g.i))))",
        w.schema
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    wait_sql(
        &mut conn,
        "the history applied to the first perspective",
        &format!("SELECT count(*) FROM {}.order_rows", w.schema),
        ORDERS,
    )
    .await;

    // The backfill waits for this gate until the status has shown its pending events, so a
    // fast machine cannot finish it between two status reads.
    let mut gate = db().await;
    catch_up_gate(&mut gate, "order_totals", false).await;
    w.apply(&catch_up_yaml(
        &w.schema,
        &[("order_rows", 1), ("order_totals", 1)],
    ));
    let totals_sql = format!(
        "SELECT count(DISTINCT order_id) FILTER (WHERE total BETWEEN 1 AND {ORDERS}) \
         + CASE WHEN sum(total) = {ORDERS} * ({ORDERS} + 1) / 2 THEN 0 ELSE -1 END \
         FROM {}.order_totals",
        w.schema
    );
    let CatchUp {
        readiness,
        progressing,
        phases,
        pending_while_catching_up,
        end_seen_after,
        done,
    } = tokio::join!(
        watch_catch_up(&w),
        release_when_pending_shown(&w, gate, "order_totals")
    )
    .0;
    let st = done.status.clone().unwrap();
    // Issue 27: PENDING counts what the backfill still has to apply, and with a 15 s status
    // interval the status still follows the catch-up every few seconds.
    assert!(
        pending_while_catching_up.iter().any(|n| *n > 0),
        "pendingEvents above 0 during the backfill: {pending_while_catching_up:?}"
    );
    assert!(
        end_seen_after < Duration::from_secs(8),
        "the status said the backfill was over {end_seen_after:?} after it last said it ran"
    );
    assert_ne!(
        st.migration_job.as_deref(),
        Some(first_job.as_str()),
        "the new perspective is a new migration Job"
    );
    assert!(
        progressing
            .iter()
            .any(|p| p.starts_with("True ") && p.contains("order_totals backfilling")),
        "Progressing reported the backfill: {progressing:#?}"
    );
    assert!(
        phases.iter().any(|p| p.starts_with("Backfilling")),
        "the Phase column showed the backfill: {phases:?}"
    );
    assert!(
        readiness.iter().all(|r| r.starts_with("True ")),
        "Ready stayed True throughout: {readiness:?}"
    );
    assert_eq!(st.phase.as_deref(), Some("Live"));
    // Every stream's row, each exactly once with its own total.
    wait_sql(&mut conn, "the backfill complete", &totals_sql, ORDERS).await;
    wait_sql(
        &mut conn,
        "the first perspective not re-applied",
        &format!("SELECT count(*) FROM {}.order_rows", w.schema),
        ORDERS,
    )
    .await;
    let table = kubectl_ok(&["-n", &w.ns, "get", "pd", "shop"], None);
    assert!(table.contains("PHASE") && table.contains("Live"), "{table}");
    // `-o wide` adds the image, the migration Job, the live workers and the database's state.
    let wide = kubectl_ok(&["-n", &w.ns, "get", "pd", "shop", "-o", "wide"], None);
    let job = st.migration_job.clone().unwrap();
    for column in [
        "IMAGE",
        "MIGRATION",
        "WORKERS",
        "DATABASE",
        "perspective-worker:e2e",
        "Reachable",
    ] {
        assert!(wide.contains(column), "{column} in:\n{wide}");
    }
    assert!(wide.contains(&job), "{job} in:\n{wide}");

    // A version bump rebuilds order_totals online (its damaged rows put right), through a new
    // Job, with Progressing saying so, and the deployment stays Ready.
    let second_job = st.migration_job.clone().unwrap();
    sqlx::query(&format!("UPDATE {}.order_totals SET total = -1", w.schema))
        .execute(&mut conn)
        .await
        .unwrap();
    w.apply(&catch_up_yaml(
        &w.schema,
        &[("order_rows", 1), ("order_totals", 2)],
    ));
    let CatchUp {
        readiness,
        progressing,
        done,
        ..
    } = watch_catch_up(&w).await;
    let st = done.status.clone().unwrap();
    assert_ne!(st.migration_job.as_deref(), Some(second_job.as_str()));
    assert!(
        progressing
            .iter()
            .any(|p| p.starts_with("True ") && p.contains("order_totals rebuilding")),
        "Progressing reported the rebuild: {progressing:#?}"
    );
    assert!(
        readiness.iter().all(|r| r.starts_with("True ")),
        "Ready stayed True throughout the rebuild: {readiness:?}"
    );
    wait_sql(&mut conn, "the rebuild complete", &totals_sql, ORDERS).await;

    // Removing order_totals: its migration says so in an Event, its table stays.
    w.apply(&catch_up_yaml(&w.schema, &[("order_rows", 1)]));
    let events = poll("the catch-up and removal Events", LONG, || async {
        let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
        Ok(events.contains("PerspectiveRemoved").then_some(events))
    })
    .await
    .unwrap();
    for reason in ["BackfillFinished", "RebuildFinished"] {
        assert_eq!(
            events.matches(&format!("\"reason\": \"{reason}\"")).count(),
            1,
            "one {reason} Event"
        );
    }
    assert!(events.contains("perspective order_totals is no longer in the spec"));
    assert_eq!(
        sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {}.order_totals", w.schema))
            .fetch_one(&mut conn)
            .await
            .unwrap(),
        ORDERS,
        "the removed perspective's table is kept"
    );
    w.shutdown().await;
}

/// What [`watch_catch_up`] saw on the way: Ready's changes, every Progressing message, every
/// Phase summary, the `pendingEvents` while a perspective caught up, how long after the last
/// status saying so the status said it was over, and the deployment then.
struct CatchUp {
    readiness: Vec<String>,
    progressing: BTreeSet<String>,
    phases: BTreeSet<String>,
    pending_while_catching_up: BTreeSet<i64>,
    end_seen_after: Duration,
    done: PerspectiveDeployment,
}

/// Poll the deployment until its spec is observed, both perspectives are `Live` and
/// `Progressing` is `Complete`.
async fn watch_catch_up(w: &World) -> CatchUp {
    // Sampled on every poll: Ready (each change), and what Progressing and the Phase column said.
    let seen = std::cell::RefCell::new((
        Vec::<String>::new(),
        BTreeSet::<String>::new(),
        BTreeSet::<String>::new(),
        BTreeSet::<i64>::new(),
        None::<Instant>,
    ));
    let done = poll("the new perspective live and complete", LONG, || async {
        let pd = w.pds().get("shop").await?;
        let st = pd.status.clone().unwrap_or_default();
        let ready = st
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map_or("Missing".to_owned(), |c| {
                format!("{} {}", c.status, c.reason)
            });
        let mut seen = seen.borrow_mut();
        if seen.0.last() != Some(&ready) {
            seen.0.push(ready);
        }
        if let Some(p) = st.conditions.iter().find(|c| c.type_ == "Progressing") {
            seen.1
                .insert(format!("{} {}: {}", p.status, p.reason, p.message));
        }
        seen.2.extend(st.phase.clone());
        let catching_up = st
            .perspectives
            .iter()
            .any(|p| p.phase != perspective_operator::crd::PerspectivePhase::Live);
        if catching_up {
            seen.3.extend(st.pending_events);
            seen.4 = Some(Instant::now());
        }
        drop(seen);
        let fresh = st.observed_generation == pd.metadata.generation;
        let all_live = st.perspectives.len() == 2
            && st.perspectives.iter().all(|p| {
                p.phase == perspective_operator::crd::PerspectivePhase::Live && p.progress.is_none()
            });
        let complete = st
            .conditions
            .iter()
            .any(|c| c.type_ == "Progressing" && c.status == "False" && c.reason == "Complete");
        Ok((fresh && all_live && complete).then_some(pd))
    })
    .await;
    let (readiness, progressing, phases, pending, last_catching_up) = seen.into_inner();
    let done = done.unwrap_or_else(|e| {
        panic!("{e:#}\nProgressing seen: {progressing:#?}\nPhases seen: {phases:?}")
    });
    eprintln!(
        "[e2e] Progressing seen: {progressing:#?}\n[e2e] Phases seen: {phases:?}\n[e2e] pending \
         while catching up: {pending:?}"
    );
    CatchUp {
        readiness,
        progressing,
        phases,
        pending_while_catching_up: pending,
        end_seen_after: last_catching_up.map_or(Duration::ZERO, |t| t.elapsed()),
        done,
    }
}

/// A worker "image" that prints the database URL from its Secret in shapes no redactor knows
/// (hex, base64, reversed) and fails, as a hostile image could.
fn hostile_worker(dir: &std::path::Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("hostile-worker.sh");
    std::fs::write(
        &path,
        "#!/bin/sh\n\
         echo \"hex: $(printf %s \"$DATABASE_URL\" | od -An -tx1 | tr -d ' \\n')\"\n\
         echo \"base64: $(printf %s \"$DATABASE_URL\" | base64 -w0)\"\n\
         echo \"reversed: $(printf %s \"$DATABASE_URL\" | rev)\"\n\
         exit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Issue 12: the author of a deployment chooses its image, and the image runs with the
/// database Secret. What its container prints never reaches status or Events (people who may
/// not read the Secret read those): a failed migration is its reason and a pointer to
/// `kubectl logs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_migrations_output_never_reaches_status_or_events() {
    let dir = e2e().await.dir.join("hostile-bin");
    let w = World::with_worker("hostile", &[("op", &[])], hostile_worker(&dir)).await;
    w.apply(&pd_yaml(
        "shop",
        &w.schema,
        1,
        "v1",
        "  migrations:\n    backoffLimit: 0\n",
    ));
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("MigrationFailed"))
        .await;
    let job = pd.status.clone().unwrap().migration_job.unwrap();
    let message = condition(&pd, "Degraded").message;
    assert!(
        message.contains(&format!("kubectl logs job/{job}")),
        "{message}"
    );
    let url = database_url();
    let shapes = [
        url.clone(),
        hex::encode(&url),
        serde_json::to_string(&k8s_openapi::ByteString(url.clone().into_bytes()))
            .unwrap()
            .trim_matches('"')
            .to_owned(),
        url.chars().rev().collect(),
    ];
    // The output was there to be copied: the failed pod's termination message holds it (the pod
    // runner copies the output's end there, as `FallbackToLogsOnError` would).
    let pods = kubectl_ok(&["-n", &w.ns, "get", "pods", "-o", "json"], None);
    assert!(
        pods.contains(&shapes[1]),
        "the hostile output reached the pod"
    );
    let events = poll("the MigrationFailed Event", LONG, || async {
        let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
        Ok(events.contains("MigrationFailed").then_some(events))
    })
    .await
    .unwrap();
    let published = format!(
        "{}{events}",
        kubectl_ok(&["-n", &w.ns, "get", "pd", "shop", "-o", "json"], None)
    );
    for shape in &shapes {
        assert!(
            !published.contains(shape.as_str()),
            "the Secret's value ({shape}) reached status or Events:\n{published}"
        );
    }
    w.shutdown().await;
}

/// Issue 12: `--allowed-image-prefix` runs only the listed images. Another image (here the
/// operator's default) is `Degraded` `InvalidSpec` naming it, with no child created; an allowed
/// image runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowed_images_run() {
    let w = World::new(
        "images",
        &[(
            "op",
            &["--allowed-image-prefix=registry.example/perspective-worker:"],
        )],
    )
    .await;
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", ""));
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("InvalidSpec"))
        .await;
    let message = condition(&pd, "Degraded").message;
    assert!(
        message.contains(
            "spec.image: \"perspective-worker:e2e\" (the operator's default) is not allowed"
        ) && message.contains("\"registry.example/perspective-worker:\""),
        "{message}"
    );
    assert!(w.jobs().await.is_empty(), "no migration Job");
    assert!(w.statefulset("shop").await.is_none(), "no StatefulSet");
    let config_maps = Api::<ConfigMap>::namespaced(w.client.clone(), &w.ns)
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=perspective-operator"))
        .await
        .unwrap();
    assert!(config_maps.items.is_empty(), "no ConfigMap");

    w.apply(&pd_yaml(
        "shop",
        &w.schema,
        1,
        "v1",
        "  image: registry.example/perspective-worker:1.0\n",
    ));
    w.wait_condition("shop", "Ready", "True", None).await;
    w.wait_condition("shop", "Degraded", "False", None).await;
    w.shutdown().await;
}

/// Issue 24: lock conflicts between appliers that persist are named: the figure the workers'
/// heartbeats publish (`wh_service_instances.metadata`, summed over the live instances) in
/// `status.perspectives[].lockConflictsPerMinute`, `Degraded=True` `LockContention` with a
/// message naming the perspective and `sequencing`, and one Warning Event per change — not one
/// per status refresh while the figure moves. Here a second "worker" heartbeats every second
/// with the figures the test sets (the worker side is tested in worker/tests/contention.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_lock_contention_is_degraded_with_one_event_per_change() {
    use k8s_openapi::api::events::v1::Event;
    let w = World::new("contend", &[("op", &[])]).await;
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", ""));
    w.wait_condition("shop", "Ready", "True", None).await;

    let metadata = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    let heartbeats = tokio_util::sync::CancellationToken::new();
    let beating = {
        let (metadata, stop) = (metadata.clone(), heartbeats.clone());
        let sql = format!(
            "SELECT {}.record_heartbeat($1, 'contended-worker', 'e2e', 1, $2)",
            w.schema
        );
        let instance = uuid::Uuid::new_v4();
        tokio::spawn(async move {
            let mut conn = db().await;
            while !stop.is_cancelled() {
                let m = metadata.lock().unwrap().clone();
                sqlx::query(&sql)
                    .bind(instance)
                    .bind(m)
                    .execute(&mut conn)
                    .await
                    .unwrap();
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        })
    };
    let conflicts = |n: i64| {
        *metadata.lock().unwrap() = serde_json::json!({
            "contention": {"order_count": {"perMinute": n, "sqlstate": "55P03"}}
        });
    };
    let events: Api<Event> = Api::namespaced(w.client.clone(), &w.ns);
    let contention_events = || async {
        let list: Vec<Event> = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some("LockContention")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("shop")
            })
            .collect();
        anyhow::Ok(list)
    };
    let figure = |pd: &PerspectiveDeployment| {
        pd.status.as_ref().and_then(|s| {
            s.perspectives
                .iter()
                .find(|p| p.name == "order_count")
                .map(|p| p.lock_conflicts_per_minute)
        })
    };
    let wait_figure = |n: i64| {
        let w = &w;
        async move {
            poll(&format!("lockConflictsPerMinute {n}"), LONG, || async {
                let pd = w.pds().get("shop").await?;
                Ok((figure(&pd) == Some(n)).then_some(pd))
            })
            .await
            .unwrap()
        }
    };

    // A few a minute: figures only.
    conflicts(9);
    let pd = wait_figure(9).await;
    assert_eq!(condition(&pd, "Degraded").status, "False");
    // Persistent: Degraded, the STATUS column and one Warning Event.
    conflicts(40);
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("LockContention"))
        .await;
    let message = "order_count: 40 lock conflicts a minute between appliers; see sequencing";
    assert_eq!(condition(&pd, "Degraded").message, message);
    assert_eq!(figure(&pd), Some(40));
    let st = pd.status.clone().unwrap();
    assert_eq!(st.summary.as_deref(), Some("Degraded: LockContention"));
    assert_eq!(condition(&pd, "Ready").status, "True", "it still serves");
    let first = poll("a LockContention Event", LONG, || async {
        let list = contention_events().await?;
        Ok((!list.is_empty()).then_some(list))
    })
    .await
    .unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].type_.as_deref(), Some("Warning"));
    assert_eq!(first[0].note.as_deref(), Some(message));
    // Another figure, still persistent: the message follows, no new Event.
    conflicts(41);
    let pd = wait_figure(41).await;
    assert!(
        condition(&pd, "Degraded")
            .message
            .starts_with("order_count: 41 lock conflicts"),
        "{:?}",
        condition(&pd, "Degraded")
    );
    let list = contention_events().await.unwrap();
    assert_eq!(list.len(), 1, "one Event per change: {list:#?}");
    assert!(list[0].series.is_none(), "{list:#?}");
    // Calm: Degraded clears; back: a new Event.
    conflicts(0);
    w.wait_condition("shop", "Degraded", "False", Some("AsExpected"))
        .await;
    conflicts(25);
    poll("a second LockContention Event", LONG, || async {
        let list = contention_events().await?;
        Ok((list.len() == 2).then_some(()))
    })
    .await
    .unwrap();

    heartbeats.cancel();
    beating.await.unwrap();
    w.shutdown().await;
}

/// `url` with its database name replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let at = base.rfind('/').expect("a database URL with a path");
    let mut out = format!("{}/{database}", &base[..at]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A deployment whose database is dropped under it: `Ready=False` (`DatabaseUnreachable`, a
/// Warning Event, the figures unknown instead of stale zeros); recreated empty: `SchemaMissing`,
/// the same migration Job runs again by itself, and `Ready=True` comes back with a Normal Event
/// and workers that apply events again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_is_not_ready_and_migrated_again_once_back() {
    use k8s_openapi::api::events::v1::Event;
    let w = World::new("lostdb", &[("op", &["--migration-retry-seconds=1"])]).await;
    // A database of its own, so that the test can drop it.
    let database = w.schema.clone();
    let mut admin = db().await;
    let create = format!("CREATE DATABASE {database}");
    sqlx::query(&create).execute(&mut admin).await.unwrap();
    let url = with_database(&database_url(), &database);
    kubectl_ok(&["-n", &w.ns, "delete", "secret", "shop-db"], None);
    kubectl_ok(
        &[
            "-n",
            &w.ns,
            "create",
            "secret",
            "generic",
            "shop-db",
            &format!("--from-literal=url={url}"),
        ],
        None,
    );
    w.apply(&pd_yaml("shop", &w.schema, 1, "v1", ""));
    let ready = w.wait_condition("shop", "Ready", "True", None).await;
    let st = ready.status.unwrap();
    assert_eq!(st.pending_events, Some(0));
    let job = st.migration_job.unwrap();
    let events: Api<Event> = Api::namespaced(w.client.clone(), &w.ns);
    let reasons = || async {
        let list = events.list(&ListParams::default()).await?.items;
        anyhow::Ok(
            list.into_iter()
                .filter_map(|e| Some((e.reason?, e.type_?, e.note.unwrap_or_default())))
                .collect::<Vec<_>>(),
        )
    };

    // Dropped: not ready, said why, once.
    sqlx::query(&format!("DROP DATABASE {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
    let lost = w
        .wait_condition("shop", "Ready", "False", Some("DatabaseUnreachable"))
        .await;
    let degraded = condition(&lost, "Degraded");
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "DatabaseUnreachable")
    );
    // Issue 26, finding 7: the SQLSTATE, not the server's text (it names the database); that
    // is in the operator's log.
    assert_eq!(
        degraded.message,
        "cannot read status from the database: the server refused the read (SQLSTATE 3D000)"
    );
    assert!(
        w.operators[0]
            .log()
            .contains(&format!("database \\\"{database}\\\" does not exist")),
        "the server's text is logged:\n{}",
        tail(&w.operators[0].log(), 3000)
    );
    let st = lost.status.clone().unwrap();
    assert_eq!(st.pending_events, None, "no stale Pending: {st:#?}");
    assert_eq!(st.dead_letters, None);
    assert_eq!(st.lag.as_deref(), Some("Unknown"));
    assert!(st.perspectives.is_empty(), "{st:#?}");
    let warning = poll("a DatabaseUnreachable Event", LONG, || async {
        let list = reasons().await?;
        Ok(list
            .into_iter()
            .find(|(r, _, _)| r == "DatabaseUnreachable"))
    })
    .await
    .unwrap();
    assert_eq!(warning.1, "Warning");
    assert!(!warning.2.contains(&database), "{}", warning.2);
    assert_eq!(w.jobs().await.len(), 1, "no Job while the database is down");

    // Recreated empty: the same Job runs again by itself, and the deployment is ready again.
    sqlx::query(&create).execute(&mut admin).await.unwrap();
    let back = w.wait_condition("shop", "Ready", "True", None).await;
    let st = back.status.unwrap();
    assert_eq!(st.migration_job.as_deref(), Some(job.as_str()));
    assert_eq!(st.schema_recreations, 1);
    assert_eq!(
        back.metadata.generation,
        Some(1),
        "no spec change was needed"
    );
    let list = reasons().await.unwrap();
    let count = |reason: &str| list.iter().filter(|(r, _, _)| r == reason).count();
    assert_eq!(
        count("DatabaseUnreachable"),
        1,
        "once per change: {list:#?}"
    );
    assert_eq!(count("SchemaMissing"), 1, "{list:#?}");
    assert_eq!(count("MigrationRerun"), 1, "{list:#?}");
    poll("a DatabaseReachable Event", LONG, || async {
        let list = reasons().await?;
        Ok(list
            .into_iter()
            .find(|(r, t, _)| r == "DatabaseReachable" && t == "Normal"))
    })
    .await
    .unwrap();
    // The workers apply events again.
    let mut conn = PgConnection::connect(&url).await.unwrap();
    append_orders(&mut conn, &w.schema, 2).await;
    wait_sql(
        &mut conn,
        "orders applied",
        &format!("SELECT n FROM {}.order_count", w.schema),
        2,
    )
    .await;
    drop(conn);
    w.shutdown().await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await;
}

/// Issue 26, finding 1: a deployment named like a neighbour's objects never takes them over.
/// An admin's PodDisruptionBudget `victim` and Service `victim-workers` exist; the deployment
/// `victim` (whose workers' PDB and Service take those names) is `Degraded=ChildRejected`
/// naming both, with one Warning Event; neither object changes (no owner reference, the same
/// spec) and none of the deployment's children is written. Once they are gone it comes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_1_a_neighbours_objects_are_never_taken_over() {
    use k8s_openapi::api::events::v1::Event;
    let w = World::new("takeover", &[("op", &[])]).await;
    w.apply(
        r#"apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: victim, labels: {owner: admin}}
spec:
  minAvailable: 2
  selector: {matchLabels: {app: admins-app}}
---
apiVersion: v1
kind: Service
metadata: {name: victim-workers, labels: {owner: admin}}
spec:
  selector: {app: admins-app}
  ports: [{name: web, port: 80}]
"#,
    );
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(w.client.clone(), &w.ns);
    let services: Api<Service> = Api::namespaced(w.client.clone(), &w.ns);
    let (pdb_before, svc_before) = (
        pdbs.get("victim").await.unwrap(),
        services.get("victim-workers").await.unwrap(),
    );
    w.apply(&pd_yaml("victim", &w.schema, 1, "v1", ""));
    let pd = w
        .wait_condition("victim", "Degraded", "True", Some("ChildRejected"))
        .await;
    let message = condition(&pd, "Degraded").message;
    assert!(
        message.contains("Service victim-workers")
            && message.contains("PodDisruptionBudget victim")
            && message.contains("not controlled by this PerspectiveDeployment"),
        "{message}"
    );
    assert_eq!(condition(&pd, "Ready").reason, "ChildRejected");
    // Two more reconciles (a status refresh a second) write nothing either.
    let reconciles = || -> anyhow::Result<f64> {
        let addr = w.operators[0]
            .http_addr()
            .context("no HTTP address logged yet")?;
        Ok(http_get(&addr, "/metrics")?
            .lines()
            .find_map(|l| l.strip_prefix("perspective_operator_reconciles_total "))
            .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0)))
    };
    let seen = reconciles().unwrap();
    poll("two more reconciles", LONG, || async {
        Ok((reconciles()? >= seen + 2.0).then_some(()))
    })
    .await
    .unwrap();
    let (pdb_after, svc_after) = (
        pdbs.get("victim").await.unwrap(),
        services.get("victim-workers").await.unwrap(),
    );
    for (kind, before, after) in [
        ("PDB", &pdb_before.metadata, &pdb_after.metadata),
        ("Service", &svc_before.metadata, &svc_after.metadata),
    ] {
        assert_eq!(after.owner_references, None, "{kind}: no owner reference");
        assert_eq!(
            after.resource_version, before.resource_version,
            "{kind}: not written at all"
        );
        assert_eq!(after.labels, before.labels, "{kind}: labels");
    }
    assert_eq!(pdb_after.spec, pdb_before.spec);
    assert_eq!(svc_after.spec, svc_before.spec);
    let instance = ListParams::default().labels("app.kubernetes.io/instance=victim");
    assert_eq!(
        count::<ConfigMap>(&w, &instance).await.unwrap(),
        0,
        "no ConfigMap"
    );
    assert!(w.jobs().await.is_empty(), "no migration Job");
    assert!(w.statefulset("victim").await.is_none(), "no StatefulSet");

    // The neighbour's objects gone: the deployment comes up and owns its own.
    pdbs.delete("victim", &Default::default()).await.unwrap();
    services
        .delete("victim-workers", &Default::default())
        .await
        .unwrap();
    w.wait_condition("victim", "Ready", "True", None).await;
    w.wait_condition("victim", "Degraded", "False", None).await;
    let pdb = pdbs.get("victim").await.unwrap();
    assert_eq!(
        pdb.metadata.owner_references.unwrap()[0].uid,
        w.pd("victim").await.metadata.uid.unwrap()
    );
    // One Warning Event for the one change, however often it was reconciled meanwhile.
    let events: Api<Event> = Api::namespaced(w.client.clone(), &w.ns);
    let rejected: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("ChildRejected"))
        .collect();
    assert_eq!(rejected.len(), 1, "{rejected:#?}");
    assert_eq!(rejected[0].type_.as_deref(), Some("Warning"));
    assert!(
        rejected[0].series.is_none(),
        "published once: {rejected:#?}"
    );
    w.shutdown().await;
}

/// Issue 26, finding 2: pod-level settings outside the operator's policy are refused, each
/// `Degraded=InvalidSpec` naming its field, and get no child: a priority class or service
/// account not on the allow-lists, an AppArmor or seccomp annotation (any key under
/// kubernetes.io), a toleration of the control plane's taint or of every taint. What the lists
/// allow is passed to the pods, which run with seccomp `RuntimeDefault`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_2_pod_level_settings_outside_the_policy_are_refused() {
    let w = World::new(
        "podpolicy",
        &[(
            "op",
            &[
                "--allowed-priority-class=workers-low",
                "--allowed-service-account=shop-sa",
            ],
        )],
    )
    .await;
    let cases = [
        (
            "prio",
            "  priorityClassName: system-node-critical\n",
            "spec.priorityClassName: \"system-node-critical\" is not allowed",
        ),
        (
            "account",
            "  serviceAccountName: admin-sa\n",
            "spec.serviceAccountName: \"admin-sa\" is not allowed",
        ),
        (
            "apparmor",
            "  podAnnotations:\n    container.apparmor.security.beta.kubernetes.io/worker: unconfined\n",
            "spec.podAnnotations: key \"container.apparmor.security.beta.kubernetes.io/worker\"",
        ),
        (
            "seccomp",
            "  podAnnotations:\n    seccomp.security.alpha.kubernetes.io/pod: unconfined\n",
            "spec.podAnnotations: key \"seccomp.security.alpha.kubernetes.io/pod\"",
        ),
        (
            "controlplane",
            "  tolerations:\n    - {key: node-role.kubernetes.io/control-plane, operator: Exists}\n",
            "spec.tolerations[0]: \"node-role.kubernetes.io/control-plane\" is refused",
        ),
        (
            "everywhere",
            "  tolerations:\n    - {operator: Exists}\n",
            "spec.tolerations[0]: a toleration without a key",
        ),
    ];
    for (name, extra, _) in &cases {
        w.apply(&pd_yaml(name, &w.schema, 1, "v1", extra));
    }
    for (name, _, field) in &cases {
        let pd = w
            .wait_condition(name, "Degraded", "True", Some("InvalidSpec"))
            .await;
        let message = condition(&pd, "Degraded").message;
        assert!(message.contains(field), "{name}: {message}");
        let instance = ListParams::default().labels(&format!("app.kubernetes.io/instance={name}"));
        assert_eq!(
            count::<Job>(&w, &instance).await.unwrap(),
            0,
            "{name}: a Job"
        );
        assert_eq!(
            count::<ConfigMap>(&w, &instance).await.unwrap(),
            0,
            "{name}"
        );
        assert!(w.statefulset(name).await.is_none(), "{name}: a StatefulSet");
    }

    // What the lists allow runs, with the pod-level seccomp profile.
    w.apply(
        "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata: {name: workers-low}\n\
         value: 10\n---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {name: shop-sa}\n",
    );
    w.apply(&pd_yaml(
        "allowed",
        &w.schema,
        1,
        "v1",
        "  priorityClassName: workers-low\n  serviceAccountName: shop-sa\n",
    ));
    w.wait_condition("allowed", "Ready", "True", None).await;
    let sts = w.statefulset("allowed").await.unwrap();
    let job = w
        .jobs()
        .await
        .into_iter()
        .next()
        .expect("the migration Job");
    let pod = sts.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.priority_class_name.as_deref(), Some("workers-low"));
    for pod in [pod, job.spec.unwrap().template.spec.unwrap()] {
        assert_eq!(pod.service_account_name.as_deref(), Some("shop-sa"));
        let seccomp = pod.security_context.unwrap().seccomp_profile.unwrap();
        assert_eq!(seccomp.type_, "RuntimeDefault");
    }
    w.shutdown().await;
}

/// Issue 26, finding 3: the API server refuses a deployment over the CRD's size bounds: one
/// `setup` over 64 Ki characters, or perspectives whose text totals over 256 Ki characters (the
/// CEL rule); just under the total is accepted. Server-side dry runs: nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_3_the_api_server_refuses_oversized_deployments() {
    let w = World::new("size", &[]).await;
    let deployment = |setups: &[usize]| {
        let perspectives: String = setups
            .iter()
            .enumerate()
            .map(|(i, len)| {
                format!(
                    "    - name: p{i}\n      setup: \"SELECT 1 --{}\"\n      handlers: {{A: SELECT 1}}\n",
                    "x".repeat(len - 11)
                )
            })
            .collect();
        format!(
            "apiVersion: perspectives.dev/v1alpha1\nkind: PerspectiveDeployment\n\
             metadata: {{name: big}}\nspec:\n  schema: {}\n  database: {{secretRef: {{name: shop-db}}}}\n  \
             perspectives:\n{perspectives}",
            w.schema
        )
    };
    let dry_run = |yaml: &str| {
        kubectl(
            &[
                "-n",
                &w.ns,
                "apply",
                "--server-side",
                "--dry-run=server",
                "-f",
                "-",
            ],
            Some(yaml),
        )
    };
    let one_too_long = dry_run(&deployment(&[65_537]));
    let stderr = String::from_utf8_lossy(&one_too_long.stderr);
    assert!(!one_too_long.status.success(), "accepted");
    assert!(
        stderr.contains("spec.perspectives[0].setup") && stderr.contains("65536"),
        "{stderr}"
    );
    let too_much = dry_run(&deployment(&[60_000; 5]));
    let stderr = String::from_utf8_lossy(&too_much.stderr);
    assert!(!too_much.status.success(), "accepted");
    assert!(
        stderr.contains("setup, reset, handlers and event types total more than 262144"),
        "{stderr}"
    );
    let under = dry_run(&deployment(&[65_536, 65_536, 65_536, 65_000]));
    assert!(
        under.status.success(),
        "{}",
        String::from_utf8_lossy(&under.stderr)
    );
    w.shutdown().await;
}

/// Issue 26, finding 3: many deployments of the largest size the API server accepts (a spec
/// just under the CRD's 256 Ki total, plus 250 KiB of annotations, the API server's bound) keep
/// the operator far under the chart's 256 Mi memory limit: the cache drops foreign annotations
/// and managedFields. It still reconciles each one and stops at once on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_3_many_maximum_size_deployments_keep_the_operator_within_its_memory() {
    const DEPLOYMENTS: usize = 30;
    // A slow status refresh, not the tests' 1 s: a refresh a second of 30 such deployments
    // keeps a debug-built operator busy beside the other suites in CI, where it twice took over
    // 15 s to stop (if it happens again, the failure shows the end of its log).
    let mut w = World::new("mem", &[("op", &["--status-interval-seconds=30"])]).await;
    let setup = format!("SELECT 1 --{}", "x".repeat(64_000));
    let junk = "j".repeat(250_000);
    let docs: Vec<String> = (0..DEPLOYMENTS)
        .map(|i| {
            let perspectives: String = (0..4)
                .map(|p| format!("    - name: p{p}\n      setup: \"{setup}\"\n      handlers: {{A: SELECT 1}}\n"))
                .collect();
            // A Secret that does not exist: each is reconciled (SecretMissing) and nothing runs.
            format!(
                "apiVersion: perspectives.dev/v1alpha1\nkind: PerspectiveDeployment\n\
                 metadata: {{name: big{i}, annotations: {{junk: {junk}}}}}\nspec:\n  schema: {}\n  \
                 database: {{secretRef: {{name: absent}}}}\n  perspectives:\n{perspectives}",
                w.schema
            )
        })
        .collect();
    let pid = w.operators[0].child.id();
    let rss = |field: &str| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            / 1024
    };
    let before = rss("VmRSS:");
    for doc in &docs {
        kubectl_ok(
            &["-n", &w.ns, "apply", "--server-side", "-f", "-"],
            Some(doc),
        );
    }
    for i in 0..DEPLOYMENTS {
        w.wait_condition(
            &format!("big{i}"),
            "Degraded",
            "True",
            Some("SecretMissing"),
        )
        .await;
    }
    let peak = rss("VmHWM:");
    eprintln!("[e2e] operator RSS {before} MiB before, peak {peak} MiB with {DEPLOYMENTS} deployments of about 500 KiB");
    assert!(
        peak < 128,
        "operator peak RSS {peak} MiB with {DEPLOYMENTS} maximum-size deployments (chart limit 256 Mi)"
    );
    let started = std::time::Instant::now();
    let op = &mut w.operators[0];
    assert_eq!(
        unsafe { libc::kill(op.child.id() as i32, libc::SIGTERM) },
        0
    );
    let deadline = started + Duration::from_secs(15);
    while op.child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() >= deadline {
            let log = op.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "the operator did not stop within 15 s of SIGTERM; the end of its log:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "[e2e] the operator stopped {:?} after SIGTERM",
        started.elapsed()
    );
    w.shutdown().await;
}

/// The test database's URL as `role` (the test PostgreSQL trusts local roles: no password).
fn url_as(role: &str) -> String {
    let url = database_url();
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{role}@{host}")
}

/// Runs `perspective-worker grants KIND ROLE`'s statements for `schema` as the schema owner.
async fn grant(conn: &mut PgConnection, schema: &str, kind: Role, role: &str) {
    grants::apply(conn, &grants::statements(schema, kind, role))
        .await
        .unwrap_or_else(|e| panic!("grants {kind:?} {role}: {e}"));
}

/// Sessions of `role` whose `application_name` starts with `app`.
async fn sessions_as(conn: &mut PgConnection, role: &str, app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND application_name LIKE $2",
    )
    .bind(role)
    .bind(format!("{app}%"))
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Issue 26 (DESIGN §12.3): the migration Job runs as the schema owner
/// (`migrationSecretRef`), the workers as a role that owns nothing (`workerSecretRef`, granted
/// with `grants worker`) and the operator reads status as a read-only role (`statusSecretRef`,
/// `grants reader`): the deployment becomes Ready, applies events with the workers connected as
/// their role, and its figures come through the reader (before the reader's grants they do not).
/// Until the workers' Secret exists the deployment is `SecretMissing`, naming only its field.
/// Issue 29 through those roles: a blue/green bump built by the worker role and switched by the
/// operator as the owner, then a rollback to the kept version, caught up and switched back alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_secrets_run_workers_and_status_as_their_own_roles() {
    use perspective_operator::crd::ActionPhase;
    let w = World::new("roles", &[("op", &["--status-interval-seconds=2"])]).await;
    let mut conn = db().await;
    let (worker, reader) = (
        format!("{}_worker", w.schema),
        format!("{}_reader", w.schema),
    );
    for role in [&worker, &reader] {
        sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let create_secret = |secret: &str, url: String| {
        kubectl_ok(
            &[
                "-n",
                &w.ns,
                "create",
                "secret",
                "generic",
                secret,
                &format!("--from-literal=dsn={url}"),
            ],
            None,
        )
    };
    create_secret("shop-owner", database_url());
    create_secret("shop-reader", url_as(&reader));
    let yaml = pd_yaml("shop", &w.schema, 2, "v1", "").replace(
        "    secretRef: {name: shop-db}\n",
        "    secretRef: {name: shop-db}\n    \
         migrationSecretRef: {name: shop-owner, key: dsn}\n    \
         workerSecretRef: {name: shop-worker, key: dsn}\n    \
         statusSecretRef: {name: shop-reader, key: dsn}\n",
    );
    w.apply(&yaml);
    // A missing role's Secret is reported like `secretRef`'s, naming its field only.
    let pd = w
        .wait_condition("shop", "Degraded", "True", Some("SecretMissing"))
        .await;
    let message = condition(&pd, "Degraded").message;
    assert!(
        message.starts_with("spec.database.workerSecretRef: the Secret it names is missing")
            && !message.contains("shop-worker")
            && !message.contains("secretRef:"),
        "{message}"
    );
    assert!(
        w.jobs().await.is_empty(),
        "nothing runs without every Secret"
    );
    create_secret("shop-worker", url_as(&worker));
    w.wait_condition("shop", "MigrationsApplied", "True", None)
        .await;
    // The reader has no rights yet: the operator, reading as it, gets no figures.
    let unread = poll("status read and refused as the reader", LONG, || async {
        let st = w.pds().get("shop").await?.status.unwrap_or_default();
        Ok(st.database.filter(|d| *d != DatabaseState::Reachable))
    })
    .await
    .unwrap();
    eprintln!("[e2e] before the reader's grants: {unread:?}");
    assert_ne!(condition(&w.pd("shop").await, "Ready").status, "True");
    // Both need the migrated schema (`grants` names its tables); until then the worker pods
    // fail and are restarted.
    grant(&mut conn, &w.schema, Role::Worker, &worker).await;
    grant(&mut conn, &w.schema, Role::Reader, &reader).await;
    let pd = w.wait_condition("shop", "Ready", "True", None).await;
    let status = pd.status.unwrap();
    assert_eq!(status.database, Some(DatabaseState::Reachable));
    append_orders(&mut conn, &w.schema, 5).await;
    wait_sql(
        &mut conn,
        "orders applied by the worker role",
        &format!("SELECT n FROM {}.order_count", w.schema),
        5,
    )
    .await;
    assert!(sessions_as(&mut conn, &worker, "perspective-worker").await > 0);
    assert!(sessions_as(&mut conn, &reader, "perspective-operator").await > 0);
    // The read models belong to the owner (the migration Job), not the worker role.
    let owner: String = sqlx::query_scalar(
        "SELECT tableowner::text FROM pg_tables WHERE schemaname = $1 AND tablename = 'order_count'",
    )
    .bind(&w.schema)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let me: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(owner, me);
    // Each worker pod's environment names the worker Secret, the Job's the owner's.
    let sts = w.statefulset("shop").await.unwrap();
    let env = serde_json::to_string(&sts.spec.unwrap().template).unwrap();
    assert!(
        env.contains("shop-worker") && !env.contains("shop-db"),
        "{env}"
    );
    let jobs = serde_json::to_string(&w.jobs().await).unwrap();
    assert!(
        jobs.contains("shop-owner") && !jobs.contains("shop-worker") && !jobs.contains("shop-db"),
        "{jobs}"
    );

    // Issue 29: a blue/green version bump. The workers (the worker role) build version 2 but
    // may not switch to it; status shows it Switching, and the operator runs the switch as the
    // owner by itself (an action Job with the migration Secret): version 2 serves.
    let v2 = yaml.replace("'v1'", "'v2'").replace(
        "    - name: order_summary\n",
        "    - name: order_summary\n      version: 2\n      rebuild: blueGreen\n",
    );
    assert_ne!(v2, yaml);
    w.apply(&v2);
    let switched = wait_last_action(
        &w,
        "shop",
        "perspectives.dev/switch",
        ActionPhase::Succeeded,
    )
    .await;
    assert_eq!(switched.target, "order_summary");
    assert!(switched.message.contains("by the operator"), "{switched:?}");
    wait_sql(
        &mut conn,
        "version 2 serves, built by the worker role",
        &format!(
            "SELECT count(*) FROM {}.order_summary WHERE version = 'v2'",
            w.schema
        ),
        5,
    )
    .await;
    w.wait_condition("shop", "Ready", "True", None).await;

    // Rollback, through the worker role too: version 1 is kept, so setting it back makes the
    // workers catch it up on what it missed (two orders appended while version 2 served) and the
    // operator switch back as the owner — without a rebuild, and announced as a rollback.
    append_orders(&mut conn, &w.schema, 2).await;
    let in_v2 = format!(
        "SELECT count(*) FROM {}.order_summary WHERE version = 'v2'",
        w.schema
    );
    wait_sql(&mut conn, "version 2 applies new orders", &in_v2, 7).await;
    let back = yaml.replace(
        "    - name: order_summary\n",
        "    - name: order_summary\n      version: 1\n      rebuild: blueGreen\n",
    );
    assert_ne!(back, yaml);
    w.apply(&back);
    events_at_least(&w, "shop", "VersionRolledBack", 1).await;
    wait_sql(
        &mut conn,
        "version 1 serves again, caught up by the worker role",
        &format!(
            "SELECT count(*) FROM {}.order_summary WHERE version = 'v1'",
            w.schema
        ),
        7,
    )
    .await;
    // The switch back is the operator's second switch Job; while it runs, its `lastAction`
    // shows no `finishedAt` (a status patch once kept the first one's).
    let again = poll("the switch back reported", LONG, || async {
        let pd = w.pds().get("shop").await?;
        let a = pd.status.and_then(|s| s.last_action);
        if let Some(a) = a.as_ref().filter(|a| a.job != switched.job) {
            assert!(
                a.annotation == "perspectives.dev/switch"
                    && a.target == "order_summary"
                    && a.message.contains("by the operator")
                    && (a.phase == ActionPhase::Succeeded) == a.finished_at.is_some(),
                "{a:?} after {switched:?}"
            );
        }
        Ok(a.filter(|a| a.job != switched.job && a.phase == ActionPhase::Succeeded))
    })
    .await
    .unwrap();
    eprintln!("[e2e] switched back: {again:?}");
    w.wait_condition("shop", "Ready", "True", None).await;
    w.shutdown().await;
    for role in [&worker, &reader] {
        let _ = sqlx::query(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .execute(&mut conn)
            .await;
    }
}

/// A deployment whose order_summary handler fails while `gate.broken` is true (a division by
/// zero at run time), dead-lettering at the first failure.
fn gated_yaml(name: &str, schema: &str) -> String {
    format!(
        r#"apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata:
  name: {name}
spec:
  schema: {schema}
  replicas: 1
  database:
    secretRef: {{name: shop-db}}
  worker:
    heartbeatIntervalSeconds: 2
    abandonStaleInstanceThresholdSeconds: 10
    maxPerspectiveEventAttempts: 1
  perspectives:
    - name: order_summary
      setup: |
        CREATE TABLE IF NOT EXISTS gate (broken boolean NOT NULL);
        INSERT INTO gate SELECT true WHERE NOT EXISTS (SELECT 1 FROM gate);
        CREATE TABLE IF NOT EXISTS order_summary (order_id uuid PRIMARY KEY, total numeric NOT NULL)
      handlers:
        OrderPlaced: |
          INSERT INTO order_summary (order_id, total)
          SELECT :stream_id, (:data->>'total')::numeric / (CASE WHEN g.broken THEN 0 ELSE 1 END)
          FROM gate g
    - name: order_count
      setup: |
        CREATE TABLE IF NOT EXISTS order_count (id int PRIMARY KEY, n bigint NOT NULL);
        INSERT INTO order_count VALUES (1, 0) ON CONFLICT DO NOTHING
      reset: UPDATE order_count SET n = 0
      handlers:
        OrderPlaced: UPDATE order_count SET n = n + 1 WHERE id = 1
"#
    )
}

async fn scalar(conn: &mut PgConnection, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// Events of `reason` about deployment `name`, once there are at least `n` (the operator
/// publishes an Event after the status write that a test may have waited on).
async fn events_at_least(
    w: &World,
    name: &str,
    reason: &str,
    n: usize,
) -> Vec<k8s_openapi::api::events::v1::Event> {
    poll(&format!("{n} {reason} Event(s)"), LONG, || async {
        let list = events_of(w, name, reason).await?;
        Ok((list.len() >= n).then_some(list))
    })
    .await
    .unwrap()
}

/// Events of `reason` about deployment `name`.
async fn events_of(
    w: &World,
    name: &str,
    reason: &str,
) -> anyhow::Result<Vec<k8s_openapi::api::events::v1::Event>> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(w.client.clone(), &w.ns);
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .collect())
}

/// Runs `kubectl pd ARGS` in the world's namespace, as a user would: kubectl finds the plugin
/// `kubectl-pd` (built with this crate) on the PATH; it reads the test's kubeconfig.
fn kubectl_pd(w: &World, args: &[&str]) -> std::process::Output {
    let plugin = PathBuf::from(env!("CARGO_BIN_EXE_kubectl-pd"));
    let path = format!(
        "{}:{}",
        plugin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("kubectl")
        .args(["pd", "-n", &w.ns])
        .args(args)
        .env("PATH", path)
        .output()
        .expect("run kubectl pd")
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until the status of `name` counts `n` dead letters.
async fn wait_dead_letters(w: &World, name: &str, n: i64) -> PerspectiveDeployment {
    poll(&format!("{n} dead letters in status"), LONG, || async {
        let pd = w.pds().get(name).await?;
        let count = pd.status.as_ref().and_then(|s| s.dead_letters);
        Ok((count == Some(n)).then_some(pd))
    })
    .await
    .unwrap()
}

/// Waits until `status.lastAction` of `name` is in `phase` for `annotation`.
async fn wait_last_action(
    w: &World,
    name: &str,
    annotation: &str,
    phase: perspective_operator::crd::ActionPhase,
) -> perspective_operator::crd::LastAction {
    let what = format!("{name}: lastAction {annotation} {phase:?}");
    let found = poll(&what, LONG, || async {
        let pd = w.pds().get(name).await?;
        Ok(pd
            .status
            .and_then(|s| s.last_action)
            .filter(|a| a.annotation == annotation && a.phase == phase))
    })
    .await;
    match found {
        Ok(a) => a,
        Err(e) => panic!(
            "{e:#}\nstatus: {:#?}\noperator log:\n{}",
            w.pd(name).await.status,
            tail(&w.operators[0].log(), 4000)
        ),
    }
}

/// Issue 27: dead letters in status (count, newest, Degraded naming them, a Warning Event),
/// then refused, replayed and discarded through annotations, each by a Job that runs the real
/// worker against the real PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_reported_and_handled_by_annotation() {
    use perspective_operator::crd::ActionPhase;
    let w = World::new("dl", &[("op", &[])]).await;
    w.apply(&gated_yaml("shop", &w.schema));
    w.wait_condition("shop", "Ready", "True", None).await;
    let mut conn = db().await;
    append_orders(&mut conn, &w.schema, 4).await;

    // 1. Status: the count and the newest per perspective, Degraded naming them, one Event.
    let pd = wait_dead_letters(&w, "shop", 4).await;
    assert_eq!(condition(&pd, "Degraded").reason, "EventsFailing");
    let st = pd.status.clone().unwrap();
    let summary = st
        .perspectives
        .iter()
        .find(|p| p.name == "order_summary")
        .expect("order_summary in status");
    assert_eq!(summary.dead_letters, 4);
    assert_eq!(summary.newest_dead_letters.len(), 3, "the newest 3 of 4");
    let newest = &summary.newest_dead_letters[0];
    assert_eq!(newest.event_type, "OrderPlaced");
    assert!(
        newest
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("division by zero"),
        "{newest:?}"
    );
    assert!(
        newest.id > summary.newest_dead_letters[1].id,
        "newest first"
    );
    let degraded = condition(&pd, "Degraded").message;
    assert!(
        degraded.starts_with("4 dead letter(s) waiting for replay (order_summary: 4; newest: order_summary OrderPlaced on stream ")
            && degraded.contains("division by zero"),
        "{degraded}"
    );
    // One Event per increase, each new dead letter counted once over them (an Event is
    // published after the status write that showed its count: wait for all 4).
    let new_in = |e: &k8s_openapi::api::events::v1::Event| -> i64 {
        let note = e.note.as_deref().unwrap_or_default();
        let rest = note.strip_prefix("order_summary: ").unwrap_or_default();
        rest.split(' ')
            .next()
            .unwrap_or_default()
            .parse()
            .unwrap_or(0)
    };
    let warned = poll("a DeadLetters Event", LONG, || async {
        let list = events_of(&w, "shop", "DeadLetters").await?;
        Ok((list.iter().map(new_in).sum::<i64>() >= 4).then_some(list))
    })
    .await
    .unwrap();
    assert_eq!(warned[0].type_.as_deref(), Some("Warning"));
    assert!(
        warned[0]
            .note
            .as_deref()
            .unwrap_or_default()
            .starts_with("order_summary: "),
        "{warned:?}"
    );
    assert_eq!(warned.iter().map(new_in).sum::<i64>(), 4, "{warned:#?}");
    let warnings_before = warned.len();

    // The plugin shows the same from status, with the kubeconfig only.
    let status = kubectl_pd(&w, &["status", "shop"]);
    assert!(status.status.success(), "{status:?}");
    let text = stdout(&status);
    for part in [
        "PerspectiveDeployment shop (namespace ",
        "Status:         Degraded: EventsFailing\n",
        "Dead letters:   4\n",
        "    Degraded ",
        "order_summary  Live ",
        "Pods:\n    NAME ",
        "Last action:    none\n",
        "Log of job/shop-migrate-",
    ] {
        assert!(
            text.contains(part),
            "kubectl pd status lacks {part:?}:\n{text}"
        );
    }
    let list = stdout(&kubectl_pd(
        &w,
        &["dead-letters", "list", "shop", "order_summary"],
    ));
    assert!(list.starts_with("PERSPECTIVE    ID "), "{list}");
    assert_eq!(list.matches("OrderPlaced").count(), 3, "{list}");
    assert!(list.contains("division by zero"), "{list}");
    assert!(
        list.ends_with("waiting for replay: order_summary: 4\n"),
        "{list}"
    );
    // The worker pods' logs, through the API (kwok runs no kubelet: each pod says why not).
    let logs = kubectl_pd(&w, &["logs", "shop", "--tail", "5"]);
    assert!(logs.status.success(), "{logs:?}");
    assert!(
        stdout(&logs).starts_with("==> pod/shop-0 <==\n"),
        "{logs:?}"
    );
    // A value the operator would refuse is refused at once, and nothing is annotated.
    let typo = kubectl_pd(&w, &["rebuild", "shop", "order_sumary"]);
    assert!(!typo.status.success());
    assert!(
        String::from_utf8_lossy(&typo.stderr)
            .contains("annotation perspectives.dev/rebuild: \"order_sumary\" is not a perspective"),
        "{typo:?}"
    );

    // 2. A bad value: refused with the annotation and the value named, no Job, annotation gone.
    kubectl_ok(
        &[
            "-n",
            &w.ns,
            "annotate",
            "pd/shop",
            "perspectives.dev/rebuild=order_sumary",
        ],
        None,
    );
    let refused =
        wait_last_action(&w, "shop", "perspectives.dev/rebuild", ActionPhase::Refused).await;
    assert!(
        refused.message.starts_with(
            "annotation perspectives.dev/rebuild: \"order_sumary\" is not a perspective of spec.perspectives"
        ),
        "{refused:?}"
    );
    assert_eq!(refused.job, None);
    let action_jobs = || async {
        w.jobs()
            .await
            .into_iter()
            .filter(|j| {
                j.labels()
                    .get("app.kubernetes.io/component")
                    .map(String::as_str)
                    == Some("action")
            })
            .collect::<Vec<_>>()
    };
    assert!(action_jobs().await.is_empty(), "no Job for a refused value");
    poll("the refused annotation removed", LONG, || async {
        let pd = w.pds().get("shop").await?;
        Ok((!pd.annotations().contains_key("perspectives.dev/rebuild")).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        events_at_least(&w, "shop", "ActionRefused", 1).await.len(),
        1
    );

    // 3. A replay while the handler still fails: its Job fails; Failed with a pointer to the
    // log, a Warning Event, the annotation removed (it does not loop), the letters pending.
    kubectl_ok(
        &[
            "-n",
            &w.ns,
            "annotate",
            "pd/shop",
            "perspectives.dev/replay-dead-letters=all",
        ],
        None,
    );
    let failed = wait_last_action(
        &w,
        "shop",
        "perspectives.dev/replay-dead-letters",
        ActionPhase::Failed,
    )
    .await;
    assert!(
        failed
            .message
            .starts_with("perspectives.dev/replay-dead-letters all failed (")
            && failed
                .message
                .contains("its output: kubectl logs job/shop-replay-"),
        "{failed:?}"
    );
    poll("the failed action's annotation removed", LONG, || async {
        let pd = w.pds().get("shop").await?;
        Ok((!pd
            .annotations()
            .contains_key("perspectives.dev/replay-dead-letters"))
        .then_some(()))
    })
    .await
    .unwrap();
    let failed_events = events_at_least(&w, "shop", "ActionFailed", 1).await;
    assert_eq!(failed_events.len(), 1, "{failed_events:?}");
    assert_eq!(failed_events[0].type_.as_deref(), Some("Warning"));
    let pending = format!(
        "SELECT count(*) FROM {}.wh_dead_letters WHERE recovery_status = 'pending'",
        w.schema
    );
    assert_eq!(scalar(&mut conn, &pending).await, 4);

    // 4. The handler fixed (the gate opened): a replay of order_summary applies the 4 events.
    sqlx::query(&format!("UPDATE {}.gate SET broken = false", w.schema))
        .execute(&mut conn)
        .await
        .unwrap();
    // Through the plugin, which sets the annotation and waits for the outcome.
    let replay = kubectl_pd(&w, &["dead-letters", "replay", "shop", "order_summary"]);
    let said = stdout(&replay);
    assert!(replay.status.success(), "{replay:?}");
    assert!(
        said.starts_with("annotated shop: perspectives.dev/replay-dead-letters=order_summary\n")
            && said.contains("Succeeded: replayed the dead letters of order_summary"),
        "{said}"
    );
    let replayed = wait_last_action(
        &w,
        "shop",
        "perspectives.dev/replay-dead-letters",
        ActionPhase::Succeeded,
    )
    .await;
    assert_eq!(replayed.target, "order_summary");
    assert!(
        replayed
            .message
            .starts_with("replayed the dead letters of order_summary"),
        "{replayed:?}"
    );
    assert_eq!(
        scalar(
            &mut conn,
            &format!("SELECT count(*) FROM {}.order_summary", w.schema)
        )
        .await,
        4
    );
    assert_eq!(
        scalar(
            &mut conn,
            &format!(
                "SELECT count(*) FROM {}.wh_dead_letters WHERE recovery_status = 'replayed'",
                w.schema
            )
        )
        .await,
        4
    );
    let pd = w.pd("shop").await;
    assert!(!pd
        .annotations()
        .contains_key("perspectives.dev/replay-dead-letters"));
    let jobs = action_jobs().await;
    assert_eq!(jobs.len(), 1, "one action Job, kept for its log");
    assert_eq!(Some(jobs[0].name_any()), replayed.job);
    let text = stdout(&kubectl_pd(&w, &["status", "shop"]));
    assert!(
        text.contains("Last action:    perspectives.dev/replay-dead-letters order_summary: Succeeded (Job shop-replay-"),
        "{text}"
    );
    w.wait_condition("shop", "Degraded", "False", Some("AsExpected"))
        .await;
    assert_eq!(
        events_at_least(&w, "shop", "ActionSucceeded", 1)
            .await
            .len(),
        1
    );

    // 5. Broken again: a new dead letter, discarded for all perspectives.
    sqlx::query(&format!("UPDATE {}.gate SET broken = true", w.schema))
        .execute(&mut conn)
        .await
        .unwrap();
    append_orders(&mut conn, &w.schema, 1).await;
    // A failed stream is EventsFailing too, before its event is dead-lettered: wait for that.
    wait_dead_letters(&w, "shop", 1).await;
    // Only this increase is a new Event: none while the count stayed or fell (the replays).
    let warned = events_at_least(&w, "shop", "DeadLetters", warnings_before + 1).await;
    assert_eq!(warned.len(), warnings_before + 1, "{warned:#?}");
    assert!(
        warned
            .iter()
            .any(|e| e.note.as_deref().unwrap_or_default().starts_with(
                "order_summary: 1 new dead letter(s), 1 waiting for replay; newest: OrderPlaced"
            )),
        "{warned:#?}"
    );
    kubectl_ok(
        &[
            "-n",
            &w.ns,
            "annotate",
            "pd/shop",
            "perspectives.dev/discard-dead-letters=all",
        ],
        None,
    );
    wait_last_action(
        &w,
        "shop",
        "perspectives.dev/discard-dead-letters",
        ActionPhase::Succeeded,
    )
    .await;
    assert_eq!(
        scalar(
            &mut conn,
            &format!(
                "SELECT count(*) FROM {}.wh_dead_letters WHERE recovery_status = 'discarded'",
                w.schema
            )
        )
        .await,
        1
    );
    assert_eq!(
        action_jobs().await.len(),
        1,
        "the earlier action Job deleted"
    );
    w.wait_condition("shop", "Degraded", "False", Some("AsExpected"))
        .await;

    // 6. A rebuild through the plugin: order_count (spoilt here) reset and replayed from the
    // store: 5 orders.
    sqlx::query(&format!("UPDATE {}.order_count SET n = 99", w.schema))
        .execute(&mut conn)
        .await
        .unwrap();
    let rebuild = kubectl_pd(&w, &["rebuild", "shop", "order_count"]);
    assert!(rebuild.status.success(), "{rebuild:?}");
    assert!(
        stdout(&rebuild).contains("Succeeded: rebuild of order_count started"),
        "{rebuild:?}"
    );
    wait_sql(
        &mut conn,
        "order_count rebuilt",
        &format!("SELECT n FROM {}.order_count", w.schema),
        5,
    )
    .await;

    // 7. A switch through the plugin (issue 29): its Job runs `perspective-worker switch` as the
    // owner; with no version being built there is nothing to switch, and it succeeds.
    let switch = kubectl_pd(&w, &["switch", "shop", "all"]);
    assert!(switch.status.success(), "{switch:?}");
    assert!(
        stdout(&switch).contains("Succeeded: switch of all perspectives done"),
        "{switch:?}"
    );
    let jobs = action_jobs().await;
    let args = jobs[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .args
        .clone()
        .unwrap_or_default();
    assert_eq!(args, ["switch", "--wait-seconds", "60"]);
    w.shutdown().await;
}

/// A CA and a serving certificate for 127.0.0.1 written to `dir` as `tls.crt`/`tls.key` (what
/// a kubernetes.io/tls Secret holds); returns the CA's PEM, the webhook's `caBundle`.
fn webhook_certificate(dir: &std::path::Path) -> String {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "perspective-operator webhook CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &Issuer::from_params(&ca_params, &ca_key))
        .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    ca.pem()
}

/// The webhook configuration of a test: what the chart's template holds, but calling the
/// operator process at `url` and scoped to namespace `ns` (tests run side by side). Deleted
/// on drop.
struct WebhookConfiguration(String);

impl WebhookConfiguration {
    fn create(ns: &str, url: &str, ca_pem: &str) -> WebhookConfiguration {
        use k8s_openapi::ByteString;
        let name = format!("perspective-operator-{ns}");
        let ca = serde_json::to_value(ByteString(ca_pem.as_bytes().to_vec())).unwrap();
        let config = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "validate.perspectives.dev",
                "clientConfig": {"url": url, "caBundle": ca},
                "rules": [{
                    "apiGroups": ["perspectives.dev"],
                    "apiVersions": ["v1alpha1"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": ["perspectivedeployments"],
                    "scope": "Namespaced",
                }],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }],
        });
        kubectl_ok(&["apply", "-f", "-"], Some(&config.to_string()));
        WebhookConfiguration(name)
    }
}

impl Drop for WebhookConfiguration {
    fn drop(&mut self) {
        let _ = kubectl(
            &[
                "delete",
                "validatingwebhookconfiguration",
                &self.0,
                "--wait=false",
            ],
            None,
        );
    }
}

/// Issue 27, admission-time validation: with the operator's webhook registered (failurePolicy
/// Fail, served by a standby replica), `kubectl apply` of a deployment with a handler typo fails at once with the message the
/// reconciler gives as `InvalidSpec`, and stores nothing; a valid one is stored; with the
/// operator down, the API server refuses rather than store unchecked specs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_refuses_an_invalid_deployment_at_apply() {
    let mut w = World::new("hook", &[]).await;
    let ca = webhook_certificate(&w.dir.join("webhook-tls"));
    let cert_dir = w.dir.join("webhook-tls");
    // Every replica serves the webhook: the one called here is a standby.
    let ns = w.ns.clone();
    let election = ["--leader-election", "--lease-namespace", &ns];
    w.operators
        .push(Operator::start(&w.dir, &ns, "leader", &election));
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), &ns);
    poll("the first replica leads", LONG, || async {
        let holder = leases
            .get_opt("perspective-operator")
            .await?
            .and_then(|l| l.spec?.holder_identity);
        Ok((holder.as_deref() == Some("leader")).then_some(()))
    })
    .await
    .unwrap();
    let mut args = election.to_vec();
    args.extend([
        "--webhook-addr=127.0.0.1:0",
        "--webhook-cert-dir",
        cert_dir.to_str().unwrap(),
    ]);
    let op = Operator::start(&w.dir, &ns, "standby", &args);
    let addr = poll("the webhook's address in the log", LONG, || {
        let log = op.log();
        async move {
            let at = log
                .find("\"webhook_addr\":\"")
                .map(|i| &log[i + 16..])
                .and_then(|rest| rest.find('"').map(|end| rest[..end].to_owned()));
            Ok(at)
        }
    })
    .await
    .unwrap();
    w.operators.push(op);
    let _config = WebhookConfiguration::create(
        &w.ns,
        &format!("https://{addr}/validate-perspectivedeployment"),
        &ca,
    );

    let typo = pd_yaml("typo", &w.schema, 1, "v1", "").replace("WHERE id = 1", "WHERE id = :totl");
    let apply = |yaml: &str, dry_run: bool| {
        let mut args = vec!["-n", w.ns.as_str(), "apply", "--server-side", "-f", "-"];
        if dry_run {
            args.push("--dry-run=server");
        }
        let out = kubectl(&args, Some(yaml));
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // The API server picks a new webhook configuration up within a moment.
    poll("the webhook registered", LONG, || {
        let (ok, stderr) = apply(&typo, true);
        async move { Ok((!ok && stderr.contains("denied the request")).then_some(())) }
    })
    .await
    .unwrap();

    let started = Instant::now();
    let (ok, stderr) = apply(&typo, false);
    assert!(!ok, "an invalid spec was accepted");
    assert!(
        stderr.contains(
            "admission webhook \"validate.perspectives.dev\" denied the request: \
             spec.perspectives[1] (order_count).handlers.OrderPlaced: unknown parameter :totl \
             at line 1"
        ),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(5), "not at once");
    assert!(w.pds().get_opt("typo").await.unwrap().is_none(), "stored");

    let (ok, stderr) = apply(&pd_yaml("valid", &w.schema, 1, "v1", ""), false);
    assert!(ok, "a valid spec was refused: {stderr}");
    assert!(w.pds().get_opt("valid").await.unwrap().is_some());

    let holder = leases
        .get("perspective-operator")
        .await
        .unwrap()
        .spec
        .and_then(|l| l.holder_identity);
    assert_eq!(
        holder.as_deref(),
        Some("leader"),
        "the webhook's replica was a standby"
    );

    // The operator down: failurePolicy Fail refuses every create and update.
    for o in &mut w.operators {
        o.kill();
    }
    let (ok, stderr) = apply(&pd_yaml("unchecked", &w.schema, 1, "v1", ""), false);
    assert!(!ok, "accepted with the webhook down");
    assert!(stderr.contains("failed calling webhook"), "{stderr}");
    assert!(w.pds().get_opt("unchecked").await.unwrap().is_none());
    w.shutdown().await;
}
