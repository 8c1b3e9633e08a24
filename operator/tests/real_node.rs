//! The operator and the workers as real containers on a real kubelet node (containerd, runc,
//! CNI bridge; tests/e2e/node.sh), against a real control plane and PostgreSQL: the operator is
//! installed from its Helm chart and runs as pods of its image, reconciling in-cluster; a
//! `PerspectiveDeployment` gets a real migration Job pod and real StatefulSet pods whose probes
//! the kubelet calls; kills, rollouts, scaling and an operator failover happen for real.
//!
//! Run through `tests/pg/pg.sh with tests/e2e/with-control-plane.sh --real-node cargo test -p
//! perspective-operator --test real_node` (as `make test` does). The tests are in the module
//! `real_node`, so the kwok-based run of the workspace skips them with `--skip real_node::`.

mod support;

mod real_node {
    mod blue_green;
    mod quickstart;

    use std::collections::{BTreeMap, HashMap, HashSet};
    use std::net::SocketAddr;
    use std::process::Command;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use futures::StreamExt;
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::batch::v1::Job;
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ListParams};
    use kube::runtime::watcher;
    use kube::{Client, ResourceExt};
    use sqlx::{Connection, PgConnection};

    use crate::support::real_node::{container_pid, process_facts, Forward, RealNode};
    use crate::support::{database_url, e2e, fresh_namespace, kubectl_ok, poll, worker_binary};

    const LONG: Duration = Duration::from_secs(180);
    const VERSION: &str = env!("CARGO_PKG_VERSION");
    const PD: &str = "shop";
    const STREAMS: usize = 24;
    const CANARY: &str = "canary-pw-7f3a";

    fn helm_ok(args: &[&str]) -> String {
        let out = Command::new("helm")
            .args(args)
            .output()
            .expect("helm on PATH");
        assert!(
            out.status.success(),
            "helm {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `url` with its `127.0.0.1:PORT` replaced by `to` (how a pod reaches the same server).
    fn retarget(url: &str, to: SocketAddr) -> (String, SocketAddr) {
        let at = url
            .find("@127.0.0.1:")
            .expect("a TEST_DATABASE_URL on 127.0.0.1")
            + 1;
        let rest = &url[at..];
        let end = rest.find('/').unwrap_or(rest.len());
        let target: SocketAddr = rest[..end].parse().expect("host:port in TEST_DATABASE_URL");
        (format!("{}{to}{}", &url[..at], &rest[end..]), target)
    }

    /// The deployment: one perspective that records every version it applies per stream, so
    /// exactly-once and order are checked by comparing arrays with 1..n.
    fn pd_yaml(schema: &str, replicas: i32, tag: &str) -> String {
        format!(
            r#"apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata:
  name: {PD}
spec:
  schema: {schema}
  replicas: {replicas}
  terminationGracePeriodSeconds: 20
  database:
    secretRef: {{name: shop-db}}
  worker:
    heartbeatIntervalSeconds: 2
    abandonStaleInstanceThresholdSeconds: 10
  perspectives:
    - name: seen
      setup: |
        CREATE TABLE IF NOT EXISTS seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL, tag text NOT NULL)
      handlers:
        Tick: |
          INSERT INTO seen AS s VALUES (:stream_id, ARRAY[:stream_version], '{tag}')
          ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version, tag = '{tag}'
"#
        )
    }

    /// `yaml` with the owner's Secret for the migration Job and `shop-worker` for the pods.
    fn with_worker_secret(yaml: &str) -> String {
        let owner = "    secretRef: {name: shop-db}\n";
        assert!(yaml.contains(owner), "{yaml}");
        yaml.replace(
            owner,
            &format!("{owner}    migrationSecretRef: {{name: shop-db}}\n    workerSecretRef: {{name: shop-worker}}\n"),
        )
    }

    /// Appends `Tick` events round-robin to `STREAMS` streams from its own connection until
    /// stopped; remembers each stream's version.
    struct Appender {
        stop: Arc<AtomicBool>,
        task: tokio::task::JoinHandle<BTreeMap<uuid::Uuid, i64>>,
    }

    impl Appender {
        fn start(
            schema: &str,
            mut versions: BTreeMap<uuid::Uuid, i64>,
            per_second: u64,
        ) -> Appender {
            let stop = Arc::new(AtomicBool::new(false));
            let schema = schema.to_owned();
            let flag = stop.clone();
            let task = tokio::spawn(async move {
                let mut conn = PgConnection::connect(&database_url()).await.unwrap();
                let streams: Vec<uuid::Uuid> = versions.keys().copied().collect();
                let mut i = 0usize;
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
                while !flag.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let stream = streams[i % streams.len()];
                    let v = versions.get_mut(&stream).unwrap();
                    sqlx::query(&format!(
                        "SELECT * FROM {schema}.append_events($1, $2, '[{{\"event_type\": \"Tick\"}}]'::jsonb)"
                    ))
                    .bind(stream)
                    .bind(*v)
                    .execute(&mut conn)
                    .await
                    .unwrap();
                    *v += 1;
                    i += 1;
                }
                versions
            });
            Appender { stop, task }
        }

        async fn stop(self) -> BTreeMap<uuid::Uuid, i64> {
            self.stop.store(true, Ordering::Relaxed);
            self.task.await.unwrap()
        }
    }

    /// Waits until every appended event is applied, then checks each stream's recorded versions
    /// are exactly 1..=n: nothing lost, nothing twice, in order.
    async fn assert_exactly_once(schema: &str, appended: &BTreeMap<uuid::Uuid, i64>, what: &str) {
        let total: i64 = appended.values().sum();
        let mut conn = PgConnection::connect(&database_url()).await.unwrap();
        let sql =
            format!("SELECT coalesce(sum(cardinality(versions)), 0)::bigint FROM {schema}.seen");
        let deadline = Instant::now() + LONG;
        let applied = loop {
            let n: i64 = sqlx::query_scalar(&sql).fetch_one(&mut conn).await.unwrap();
            if n >= total {
                break n;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: only {n} of {total} events applied after {LONG:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let rows: Vec<(uuid::Uuid, Vec<i64>)> =
            sqlx::query_as(&format!("SELECT stream_id, versions FROM {schema}.seen"))
                .fetch_all(&mut conn)
                .await
                .unwrap();
        let rows: HashMap<_, _> = rows.into_iter().collect();
        for (stream, n) in appended {
            let want: Vec<i64> = (1..=*n).collect();
            assert_eq!(
                rows.get(stream),
                Some(&want),
                "{what}: stream {stream} applied out of order, twice or not at all"
            );
        }
        assert_eq!(applied, total, "{what}: more applications than events");
        eprintln!(
            "[real-node] {what}: {total} events over {} streams applied exactly once, in order",
            appended.len()
        );
    }

    fn worker_selector() -> String {
        format!("app.kubernetes.io/instance={PD},app.kubernetes.io/component=worker")
    }

    async fn worker_pods(pods: &Api<Pod>) -> Vec<Pod> {
        pods.list(&ListParams::default().labels(&worker_selector()))
            .await
            .unwrap()
            .items
    }

    fn is_ready(pod: &Pod) -> bool {
        pod.metadata.deletion_timestamp.is_none()
            && pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    }

    /// Waits for exactly `n` worker pods, all Ready on the real node, and returns them.
    async fn ready_workers(pods: &Api<Pod>, node: &str, n: usize) -> Vec<Pod> {
        poll(&format!("{n} Ready worker pods"), LONG, || async {
            let list = worker_pods(pods).await;
            let ready = list.len() == n
                && list.iter().all(|p| {
                    is_ready(p)
                        && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                });
            Ok(ready.then_some(list))
        })
        .await
        .unwrap()
    }

    async fn instance_ids(conn: &mut PgConnection, schema: &str) -> HashSet<String> {
        sqlx::query_scalar::<_, uuid::Uuid>(&format!(
            "SELECT instance_id FROM {schema}.wh_service_instances"
        ))
        .fetch_all(conn)
        .await
        .unwrap()
        .into_iter()
        .map(|u| u.to_string())
        .collect()
    }

    fn uids(pods: &[Pod]) -> HashSet<String> {
        pods.iter().filter_map(|p| p.metadata.uid.clone()).collect()
    }

    /// The pod security settings, as the kernel sees the container's process.
    fn assert_locked_down(pod: &Pod, container: &str) {
        let pid = container_pid(pod, container).unwrap();
        let facts = process_facts(pid).unwrap();
        let name = pod.name_any();
        assert_eq!(
            (facts.uid, facts.gid),
            (65532, 65532),
            "{name}: runs as non-root 65532"
        );
        assert_eq!(facts.cap_eff, 0, "{name}: no capabilities ({facts:?})");
        assert!(
            facts.no_new_privs,
            "{name}: no privilege escalation ({facts:?})"
        );
        assert!(
            facts.root_read_only,
            "{name}: read-only root filesystem ({facts:?})"
        );
        // Anything writable must be a volume the pod declares (an emptyDir), nothing else.
        let declared: HashSet<String> = pod
            .spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .flat_map(|c| c.volume_mounts.clone().unwrap_or_default())
            .filter(|m| m.read_only != Some(true))
            .map(|m| m.mount_path)
            .collect();
        // The kubelet's own per-pod files (root-owned, 0644 on the host: not writable by 65532).
        let kubelet_files = ["/etc/hosts", "/etc/hostname", "/etc/resolv.conf"];
        for m in facts
            .writable_mounts
            .iter()
            .filter(|m| !kubelet_files.contains(&m.as_str()))
        {
            assert!(
                declared.contains(m),
                "{name}: writable mount {m} is not a declared volume ({facts:?})"
            );
        }
    }

    /// Everything a test needs: namespace with the chart's operator, the database Secret that
    /// points pods at PostgreSQL through the node, the schema.
    struct World {
        client: Client,
        node: RealNode,
        ns: String,
        schema: String,
        /// The database URL the pods use (through the node's forward).
        pod_url: String,
        _pg: Forward,
    }

    impl World {
        async fn new() -> World {
            let env = e2e().await;
            let node = RealNode::from_env();
            let ns = fresh_namespace(&env.client, "real-").await.unwrap();
            // The API server enforces the strictest Pod Security Standard on every pod here.
            kubectl_ok(
                &[
                    "label",
                    "namespace",
                    &ns,
                    "pod-security.kubernetes.io/enforce=restricted",
                ],
                None,
            );
            let (_, target) = retarget(&database_url(), "127.0.0.1:1".parse().unwrap());
            let pg = Forward::start(&node.ip, target).await.unwrap();
            let (pod_url, _) = retarget(&database_url(), pg.addr);
            // A password the server never asks for (trust auth): a canary that must never show
            // up in status or Events.
            let pod_url = pod_url.replacen(
                "postgres://postgres@",
                &format!("postgres://postgres:{CANARY}@"),
                1,
            );
            assert!(
                pod_url.contains(CANARY),
                "TEST_DATABASE_URL is postgres://postgres@…: {pod_url}"
            );
            kubectl_ok(
                &[
                    "-n",
                    &ns,
                    "create",
                    "secret",
                    "generic",
                    "shop-db",
                    &format!("--from-literal=url={pod_url}"),
                ],
                None,
            );
            let schema = format!("real_{}", &ns.replace('-', "_"));
            World {
                client: env.client,
                node,
                ns,
                schema,
                pod_url,
                _pg: pg,
            }
        }

        /// Migrates the schema of deployment `yaml` as its owner, creates a login role that owns
        /// nothing, grants it what a worker needs (`perspective-worker grants worker`) and
        /// stores its URL (through the node) in Secret `shop-worker`. Returns the role.
        async fn worker_role(&self, yaml: &str) -> String {
            let perspectives = &yaml[yaml.find("  perspectives:\n").expect("perspectives")..];
            let config = std::env::temp_dir().join(format!("{}.yaml", self.schema));
            std::fs::write(
                &config,
                format!("schema: {}\n{}", self.schema, &perspectives[2..]),
            )
            .unwrap();
            let role = format!("{}_worker", self.schema);
            let mut conn = PgConnection::connect(&database_url()).await.unwrap();
            sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
                .execute(&mut conn)
                .await
                .unwrap();
            for args in [vec!["migrate"], vec!["grants", "worker", &role]] {
                let out = Command::new(worker_binary())
                    .arg("--config")
                    .arg(&config)
                    .args(&args)
                    .env("DATABASE_URL", database_url())
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "perspective-worker {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let url =
                self.pod_url
                    .replacen("postgres://postgres:", &format!("postgres://{role}:"), 1);
            kubectl_ok(
                &[
                    "-n",
                    &self.ns,
                    "create",
                    "secret",
                    "generic",
                    "shop-worker",
                    &format!("--from-literal=url={url}"),
                ],
                None,
            );
            role
        }

        fn pods(&self) -> Api<Pod> {
            Api::namespaced(self.client.clone(), &self.ns)
        }

        fn apply(&self, yaml: &str) {
            kubectl_ok(
                &["-n", &self.ns, "apply", "--server-side", "-f", "-"],
                Some(yaml),
            );
        }

        /// `spec.replicas` of the deployment, as `kubectl scale` would set it.
        fn scale(&self, replicas: i32) {
            kubectl_ok(
                &[
                    "-n",
                    &self.ns,
                    "scale",
                    &format!("perspectivedeployment/{PD}"),
                    &format!("--replicas={replicas}"),
                ],
                None,
            );
        }

        fn wait_pd_ready(&self) {
            kubectl_ok(
                &[
                    "-n",
                    &self.ns,
                    "wait",
                    "--for=condition=Ready",
                    &format!("perspectivedeployment/{PD}"),
                    "--timeout=180s",
                ],
                None,
            );
        }

        /// Helm-installs the operator from the chart, as pods of its image, watching this
        /// namespace; waits until its Deployment is available (real probes).
        fn install_operator(&self, replicas: u32) -> String {
            let chart = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../charts/perspective-operator"
            );
            let release = "op";
            helm_ok(&[
                "install",
                release,
                chart,
                "--namespace",
                &self.ns,
                "--wait=false",
                "--set",
                "image.repository=localhost/perspective-operator",
                "--set",
                &format!("image.tag={VERSION}"),
                "--set",
                "image.pullPolicy=Never",
                "--set",
                &format!("workerImage=localhost/perspective-worker:{VERSION}"),
                "--set",
                &format!("watchNamespace={}", self.ns),
                "--set",
                &format!("replicaCount={replicas}"),
                "--set",
                "statusIntervalSeconds=2",
            ]);
            let deploy = format!("{release}-perspective-operator");
            kubectl_ok(
                &[
                    "-n",
                    &self.ns,
                    "rollout",
                    "status",
                    &format!("deployment/{deploy}"),
                    "--timeout=180s",
                ],
                None,
            );
            deploy
        }

        async fn shutdown(self) {
            let _ = crate::support::delete_namespace(&self.client, &self.ns).await;
            if let Ok(mut conn) = PgConnection::connect(&database_url()).await {
                let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema))
                    .execute(&mut conn)
                    .await;
            }
        }
    }

    /// Records the last status of every worker pod seen, deleted ones included (the kubelet
    /// reports a terminated container's exit code before the pod object goes away).
    fn watch_last_status(
        pods: Api<Pod>,
    ) -> (
        Arc<Mutex<HashMap<String, Pod>>>,
        tokio::task::JoinHandle<()>,
    ) {
        let seen: Arc<Mutex<HashMap<String, Pod>>> = Arc::default();
        let store = seen.clone();
        let task = tokio::spawn(async move {
            let cfg = watcher::Config::default().labels(&worker_selector());
            let mut stream = watcher(pods, cfg).boxed();
            while let Some(Ok(event)) = stream.next().await {
                let pods = match event {
                    watcher::Event::Apply(p)
                    | watcher::Event::Delete(p)
                    | watcher::Event::InitApply(p) => vec![p],
                    _ => vec![],
                };
                for p in pods {
                    if let Some(uid) = p.metadata.uid.clone() {
                        store.lock().unwrap().insert(uid, p);
                    }
                }
            }
        });
        (seen, task)
    }

    fn exit_code(pod: &Pod) -> Option<i32> {
        exit_code_of(pod, "worker")
    }

    fn exit_code_of(pod: &Pod, container: &str) -> Option<i32> {
        pod.status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .iter()
            .find(|c| c.name == container)?
            .state
            .as_ref()?
            .terminated
            .as_ref()
            .map(|t| t.exit_code)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_chart_operator_and_real_worker_pods_survive_kills_rollouts_scaling_and_failover() {
        let w = World::new().await;
        let pods = w.pods();
        let node = w.node.name.clone();

        // --- the operator, installed by Helm, runs as 2 pods of its image ---------------------
        let t = Instant::now();
        let deploy = w.install_operator(2);
        // `rollout status` saw both available; the pods are read afterwards, so wait for what
        // they say too (one seen unready there once, on a loaded machine) and show why not.
        let deadline = Instant::now() + Duration::from_secs(60);
        let operator_pods = loop {
            let listed = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=perspective-operator"))
                .await
                .unwrap()
                .items;
            if listed.len() == 2 && listed.iter().all(is_ready) {
                break listed;
            }
            assert!(
                Instant::now() < deadline,
                "operator pods Ready (their probes passed) within 60 s: {:?}",
                listed
                    .iter()
                    .map(|p| (
                        p.name_any(),
                        p.status
                            .as_ref()
                            .map(|s| (&s.conditions, &s.container_statuses))
                    ))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        for p in &operator_pods {
            assert!(
                is_ready(p),
                "operator pod {} Ready (its probes passed)",
                p.name_any()
            );
            assert_locked_down(p, "operator");
        }
        eprintln!(
            "[real-node] operator {deploy}: 2 pods Ready in {:?}: {:?}",
            t.elapsed(),
            operator_pods
                .iter()
                .map(|p| p.name_any())
                .collect::<Vec<_>>()
        );

        // --- a deployment: a real migration Job pod, then real worker pods ----------------------
        // The workers run as a role of their own that owns nothing (issue 26): the schema's
        // owner migrates and grants it, and the deployment names the owner's Secret for the
        // migration Job and the worker role's for the pods.
        let worker_role = w.worker_role(&pd_yaml(&w.schema, 3, "v1")).await;
        let t = Instant::now();
        w.apply(&with_worker_secret(&pd_yaml(&w.schema, 3, "v1")));
        w.wait_pd_ready();
        let workers = ready_workers(&pods, &node, 3).await;
        let sessions: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND application_name LIKE 'perspective-worker%'",
        )
        .bind(&worker_role)
        .fetch_one(&mut PgConnection::connect(&database_url()).await.unwrap())
        .await
        .unwrap();
        assert!(sessions > 0, "the worker pods connect as {worker_role}");
        eprintln!(
            "[real-node] PerspectiveDeployment Ready with 3 worker pods in {:?}",
            t.elapsed()
        );
        let jobs: Vec<Job> = Api::<Job>::namespaced(w.client.clone(), &w.ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items;
        assert_eq!(jobs.len(), 1, "one migration Job");
        assert_eq!(jobs[0].status.as_ref().and_then(|s| s.succeeded), Some(1));
        let job_pods = pods
            .list(&ListParams::default().labels(&format!("job-name={}", jobs[0].name_any())))
            .await
            .unwrap()
            .items;
        let job_pod = job_pods.first().expect("the migration Job's pod is kept");
        assert_eq!(
            job_pod.spec.as_ref().unwrap().node_name.as_deref(),
            Some(node.as_str())
        );
        let terminated = job_pod
            .status
            .as_ref()
            .unwrap()
            .container_statuses
            .as_ref()
            .unwrap()[0]
            .state
            .as_ref()
            .unwrap()
            .terminated
            .clone()
            .expect("the migration container ran to its end");
        assert_eq!(terminated.exit_code, 0, "migrate exited 0: {terminated:?}");
        for p in &workers {
            assert_locked_down(p, "worker");
            let image = &p.spec.as_ref().unwrap().containers[0].image;
            assert_eq!(
                image.as_deref(),
                Some(format!("localhost/perspective-worker:{VERSION}").as_str())
            );
        }
        // PERSPECTIVE_INSTANCE_ID is the pod UID: the workers registered under their pods' UIDs.
        let mut conn = PgConnection::connect(&database_url()).await.unwrap();
        let want = uids(&workers);
        let deadline = Instant::now() + LONG;
        while instance_ids(&mut conn, &w.schema).await != want {
            assert!(
                Instant::now() < deadline,
                "instances {:?} are not the pod UIDs {want:?}",
                instance_ids(&mut conn, &w.schema).await
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // Events appended with plain SQL are applied by the pods.
        let streams: BTreeMap<uuid::Uuid, i64> =
            (0..STREAMS).map(|_| (uuid::Uuid::new_v4(), 0)).collect();
        let appender = Appender::start(&w.schema, streams, 200);
        tokio::time::sleep(Duration::from_secs(2)).await; // some load, not a wait for a result
        let appended = appender.stop().await;
        assert_exactly_once(&w.schema, &appended, "first load").await;

        // --- kills mid-load: a container SIGKILLed, a pod force-deleted -------------------------
        let appender = Appender::start(&w.schema, appended, 150);
        let victim = &workers[0];
        let pid = container_pid(victim, "worker").unwrap();
        // SAFETY: kill(2) on a pid we just read from the container's cgroup.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        eprintln!(
            "[real-node] SIGKILLed the worker process of {} (host pid {pid})",
            victim.name_any()
        );
        let restarted = poll("the killed container restarted and Ready", LONG, || async {
            let p = pods.get(&victim.name_any()).await?;
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map_or(0, |cs| cs[0].restart_count);
            Ok((restarts >= 1 && is_ready(&p)).then_some(p))
        })
        .await
        .unwrap();
        assert_eq!(
            restarted.metadata.uid, victim.metadata.uid,
            "same pod, container restarted"
        );
        let gone = workers[1].name_any();
        kubectl_ok(
            &[
                "-n",
                &w.ns,
                "delete",
                "pod",
                &gone,
                "--grace-period=0",
                "--force",
                "--wait=false",
            ],
            None,
        );
        eprintln!("[real-node] force-deleted pod {gone}");
        let workers = poll("the force-deleted pod recreated", LONG, || async {
            let list = ready_workers(&pods, &node, 3).await;
            let recreated = list
                .iter()
                .any(|p| p.name_any() == gone && p.metadata.uid != workers[1].metadata.uid);
            Ok(recreated.then_some(list))
        })
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await; // load continues on the new pods
        let appended = appender.stop().await;
        assert_exactly_once(&w.schema, &appended, "kills mid-load").await;

        // --- a handler change: the StatefulSet rolls only after the new Job succeeded ----------
        let sts_api: Api<StatefulSet> = Api::namespaced(w.client.clone(), &w.ns);
        let template_of = |s: &StatefulSet| {
            s.spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .clone()
                .unwrap_or_default()
        };
        let before = template_of(&sts_api.get(PD).await.unwrap());
        let jobs_api: Api<Job> = Api::namespaced(w.client.clone(), &w.ns);
        let old_jobs: HashSet<String> = jobs_api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|j| j.name_any())
            .collect();
        let appender = Appender::start(&w.schema, appended, 100);
        w.apply(&with_worker_secret(&pd_yaml(&w.schema, 3, "v2")));
        let deadline = Instant::now() + LONG;
        let new_job = loop {
            assert!(
                Instant::now() < deadline,
                "the new migration Job did not succeed in time"
            );
            let jobs = jobs_api.list(&ListParams::default()).await.unwrap().items;
            let new = jobs.into_iter().find(|j| !old_jobs.contains(&j.name_any()));
            let succeeded = new
                .as_ref()
                .and_then(|j| j.status.as_ref())
                .and_then(|s| s.succeeded)
                == Some(1);
            let sts = sts_api.get(PD).await.unwrap();
            if succeeded {
                break new.unwrap();
            }
            assert_eq!(
                template_of(&sts),
                before,
                "the StatefulSet changed before the new Job succeeded"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!(
            "[real-node] new Job {} succeeded; StatefulSet untouched until then",
            new_job.name_any()
        );
        // The operator applies the new template on its next reconcile after the Job's success;
        // only then does `rollout status` watch the right revision.
        poll("the StatefulSet gets the new template", LONG, || async {
            Ok((template_of(&sts_api.get(PD).await?) != before).then_some(()))
        })
        .await
        .unwrap();
        kubectl_ok(
            &[
                "-n",
                &w.ns,
                "rollout",
                "status",
                &format!("statefulset/{PD}"),
                "--timeout=180s",
            ],
            None,
        );
        // Every worker pod replaced, the new ones Ready (real readiness gated the rollout).
        let old = uids(&workers);
        poll("3 Ready worker pods, none of them old", LONG, || async {
            let list = ready_workers(&pods, &node, 3).await;
            Ok(uids(&list).is_disjoint(&old).then_some(()))
        })
        .await
        .unwrap();
        w.wait_pd_ready();
        let appended = appender.stop().await;
        assert_exactly_once(&w.schema, &appended, "rollout under load").await;
        let mut conn = PgConnection::connect(&database_url()).await.unwrap();
        let tags: Vec<String> =
            sqlx::query_scalar(&format!("SELECT DISTINCT tag FROM {}.seen", w.schema))
                .fetch_all(&mut conn)
                .await
                .unwrap();
        assert_eq!(
            tags,
            vec!["v2".to_owned()],
            "the new handler applied the events after the rollout"
        );

        // --- scale 3 -> 5 -> 2: the removed pods hand over on the kubelet's SIGTERM -------------
        let (last_status, watch) = watch_last_status(pods.clone());
        w.scale(5);
        let five = ready_workers(&pods, &node, 5).await;
        let appender = Appender::start(&w.schema, appended, 150);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = Instant::now();
        w.scale(2);
        let two = ready_workers(&pods, &node, 2).await;
        let removed: Vec<String> = uids(&five).difference(&uids(&two)).cloned().collect();
        assert_eq!(removed.len(), 3);
        let exits = poll("the removed pods' exit codes", LONG, || async {
            let seen = last_status.lock().unwrap();
            let codes: Vec<Option<i32>> = removed
                .iter()
                .map(|u| seen.get(u).and_then(exit_code))
                .collect();
            Ok(codes.iter().all(Option::is_some).then_some(codes))
        })
        .await
        .unwrap();
        assert!(
            exits.iter().all(|c| *c == Some(0)),
            "SIGTERM → graceful exit 0 (not killed after the grace period): {exits:?}"
        );
        eprintln!(
            "[real-node] scaled 5 -> 2 in {:?}; removed pods exited {exits:?}",
            t.elapsed()
        );
        // They deregistered themselves (no 10 s wait for the stale-instance sweep).
        let left = instance_ids(&mut conn, &w.schema).await;
        assert!(
            removed.iter().all(|u| !left.contains(u)),
            "removed pods deregistered: {left:?}"
        );
        watch.abort();
        let appended = appender.stop().await;
        assert_exactly_once(&w.schema, &appended, "scale 3 -> 5 -> 2 under load").await;

        // --- the operator's leader pod killed: the other replica takes over ------------------
        let leases: Api<Lease> = Api::namespaced(w.client.clone(), &w.ns);
        let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
        let leader = holder(&leases.get(&deploy).await.unwrap()).expect("a leader holds the Lease");
        // A crash, not a shutdown: the leader's process is stopped dead (SIGSTOP, so it can
        // neither renew nor release the Lease) and its pod force-deleted (the kubelet then
        // SIGKILLs it); a restart under the same pod name would simply be the same leader.
        let leader_pod = pods.get(&leader).await.unwrap();
        let pid = container_pid(&leader_pod, "operator").unwrap();
        let t = Instant::now();
        // SAFETY: kill(2) on a pid we just read from the container's cgroup.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
        kubectl_ok(
            &[
                "-n",
                &w.ns,
                "delete",
                "pod",
                &leader,
                "--grace-period=0",
                "--force",
                "--wait=false",
            ],
            None,
        );
        let new_leader = poll("another operator pod takes the Lease", LONG, || async {
            let h = holder(&leases.get(&deploy).await?);
            Ok(h.filter(|h| *h != leader))
        })
        .await
        .unwrap();
        eprintln!(
            "[real-node] operator leader {leader} stopped and force-deleted; {new_leader} leads after {:?}",
            t.elapsed()
        );
        // Whichever replica wins (the standby or the Deployment's replacement pod), it is a
        // live operator pod, and it reconciles.
        let new_leader_pod = pods.get(&new_leader).await.unwrap();
        assert!(is_ready(&new_leader_pod) || new_leader_pod.metadata.deletion_timestamp.is_none());
        w.scale(3);
        ready_workers(&pods, &node, 3).await;
        w.wait_pd_ready();

        w.shutdown().await;
    }

    /// Reads the deployment's status condition `type_` as (status, reason, message).
    fn pd_condition(ns: &str, type_: &str) -> Option<(String, String, String)> {
        let out = kubectl_ok(
            &[
                "-n",
                ns,
                "get",
                &format!("perspectivedeployment/{PD}"),
                "-o",
                "json",
            ],
            None,
        );
        let pd: serde_json::Value = serde_json::from_str(&out).unwrap();
        let c = pd["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)?
            .clone();
        let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
        Some((s("status"), s("reason"), s("message")))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_real_migration_pod_that_fails_keeps_the_running_workers_and_says_why() {
        let w = World::new().await;
        let pods = w.pods();
        let node = w.node.name.clone();
        w.install_operator(1);
        let no_retry = |yaml: String| {
            yaml.replace(
                "  worker:\n",
                "  migrations:\n    backoffLimit: 0\n  worker:\n",
            )
        };
        w.apply(&no_retry(pd_yaml(&w.schema, 1, "v1")));
        w.wait_pd_ready();
        let worker = ready_workers(&pods, &node, 1).await.remove(0);

        // Valid config, SQL that fails when `migrate` runs it in the Job's container.
        let broken = no_retry(pd_yaml(&w.schema, 1, "v1")).replace(
            "versions bigint[] NOT NULL, tag text NOT NULL)",
            "versions bigint[] NOT NULL, tag text NOT NULL);\n        CREATE TABLE IF NOT EXISTS broken (n no_such_type)",
        );
        w.apply(&broken);
        let (_, _, message) = poll("Degraded=True MigrationFailed", LONG, || async {
            Ok(pd_condition(&w.ns, "Degraded")
                .filter(|(s, r, _)| s == "True" && r == "MigrationFailed"))
        })
        .await
        .unwrap();
        eprintln!("[real-node] failed migration reported: {message}");
        // The container's output stays in its log; the status points there (README, "Trust
        // model").
        assert!(
            message.contains("kubectl logs job/") && !message.contains("no_such_type"),
            "the status points to the Job's log and carries none of it: {message}"
        );
        // The failed Job's pod really ran and failed in its container.
        let failed: Vec<Pod> = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=migration"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| exit_code_of(p, "migrate").is_some_and(|c| c != 0))
            .collect();
        assert!(
            !failed.is_empty(),
            "a migration pod whose container exited non-zero"
        );
        // And the error is where the status points: the container's log, served by the kubelet.
        let log = kubectl_ok(&["-n", &w.ns, "logs", &failed[0].name_any()], None);
        assert!(
            log.contains("no_such_type"),
            "the migrate container's log says what failed: {log}"
        );
        // The running worker was left alone: same pod, same container, still Ready.
        let still = pods.get(&worker.name_any()).await.unwrap();
        assert_eq!(still.metadata.uid, worker.metadata.uid);
        assert!(is_ready(&still));
        let restarts = still
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map(|cs| cs[0].restart_count);
        assert_eq!(restarts, Some(0));
        // Nothing the operator published carries the Secret's value.
        let published = format!(
            "{}{}",
            kubectl_ok(
                &[
                    "-n",
                    &w.ns,
                    "get",
                    &format!("perspectivedeployment/{PD}"),
                    "-o",
                    "json"
                ],
                None
            ),
            kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None)
        );
        assert!(
            !published.contains(CANARY),
            "the database password leaked into status or Events"
        );

        // Fixing the spec: a new Job succeeds and the deployment is Ready again.
        w.apply(&no_retry(pd_yaml(&w.schema, 1, "v2")));
        w.wait_pd_ready();
        poll("Degraded cleared", LONG, || async {
            Ok(pd_condition(&w.ns, "Degraded").filter(|(s, _, _)| s == "False"))
        })
        .await
        .unwrap();
        w.shutdown().await;
    }

    /// `url` with its database name replaced by `database`.
    fn with_database(url: &str, database: &str) -> String {
        let (base, query) = url
            .split_once('?')
            .map_or((url, None), |(b, q)| (b, Some(q)));
        let at = base.rfind('/').expect("a database URL with a path");
        match query {
            Some(q) => format!("{}/{database}?{q}", &base[..at]),
            None => format!("{}/{database}", &base[..at]),
        }
    }

    /// The acceptance test of a lost database: dropped under a running deployment, it is
    /// `Ready=False` within 30 s; recreated, the operator migrates it again and `Ready=True`
    /// returns without any manual step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_database_is_not_ready_and_recreated_is_migrated_again() {
        let w = World::new().await;
        let pods = w.pods();
        let node = w.node.name.clone();
        // A database of its own, to drop.
        let database = w.schema.clone();
        let mut admin = PgConnection::connect(&database_url()).await.unwrap();
        let create = format!("CREATE DATABASE {database}");
        sqlx::query(&create).execute(&mut admin).await.unwrap();
        kubectl_ok(&["-n", &w.ns, "delete", "secret", "shop-db"], None);
        let url = with_database(&w.pod_url, &database);
        let secret = format!("--from-literal=url={url}");
        kubectl_ok(
            &[
                "-n", &w.ns, "create", "secret", "generic", "shop-db", &secret,
            ],
            None,
        );
        w.install_operator(1);
        w.apply(&pd_yaml(&w.schema, 1, "v1"));
        w.wait_pd_ready();
        ready_workers(&pods, &node, 1).await;

        let t = Instant::now();
        sqlx::query(&format!("DROP DATABASE {database} WITH (FORCE)"))
            .execute(&mut admin)
            .await
            .unwrap();
        let (_, reason, message) = poll("Ready=False", Duration::from_secs(30), || async {
            Ok(pd_condition(&w.ns, "Ready").filter(|(s, _, _)| s == "False"))
        })
        .await
        .unwrap();
        eprintln!(
            "[real-node] database dropped: Ready=False ({reason}: {message}) after {:?}",
            t.elapsed()
        );
        assert_eq!(reason, "DatabaseUnreachable", "{message}");

        let t = Instant::now();
        sqlx::query(&create).execute(&mut admin).await.unwrap();
        let (_, reason, _) = poll("Ready=True again", LONG, || async {
            Ok(pd_condition(&w.ns, "Ready").filter(|(s, _, _)| s == "True"))
        })
        .await
        .unwrap();
        eprintln!(
            "[real-node] database recreated: migrated again, Ready=True ({reason}) after {:?}",
            t.elapsed()
        );
        let migrated: bool = {
            let mut conn = PgConnection::connect(&with_database(&database_url(), &database))
                .await
                .unwrap();
            sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(format!("{}.wh_schema_migrations", w.schema))
                .fetch_one(&mut conn)
                .await
                .unwrap()
        };
        assert!(migrated, "the recreated database holds the schema again");
        let events = kubectl_ok(&["-n", &w.ns, "get", "events", "-o", "json"], None);
        for reason in [
            "DatabaseUnreachable",
            "SchemaMissing",
            "MigrationRerun",
            "DatabaseReachable",
        ] {
            assert!(events.contains(reason), "an Event {reason}");
        }
        w.shutdown().await;
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }
}
