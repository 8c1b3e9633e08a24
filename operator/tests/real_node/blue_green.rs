//! A blue/green version bump as a user makes it (issue 29): the CR's perspective has
//! `rebuild: blueGreen`; `kubectl apply` raises its `version` and changes its table's shape while
//! producers append and a reader — a pod of its own, psql querying the model ten times a second
//! — reads it. `Ready` stays True throughout, the reader sees the whole old model and then the
//! whole new one (never a mix, never an empty or missing table), and both versions are exact.
//!
//! The reader image (`localhost/e2e-psql:v1`, psql and the libraries it links) is packed and
//! imported by tests/e2e/node.sh.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use sqlx::{Connection, PgConnection};

use super::{
    assert_exactly_once, exit_code_of, pd_condition, ready_workers, Appender, World, LONG, PD,
    STREAMS,
};
use crate::support::{database_url, kubectl, kubectl_ok, poll};

/// The deployment with `seen` at `version`, built beside the live one on a bump. Version 2
/// changes the table's shape (a new column) and marks each row with its version's tag.
fn bg_yaml(schema: &str, version: u32) -> String {
    // v2's handler takes 20 ms an event, so its build lasts long enough for the CR to show it.
    let (columns, insert, update, sleep) = match version {
        1 => ("", "'v1'", "", "0"),
        _ => (
            ", last bigint NOT NULL",
            "'v2', :stream_version",
            ", last = :stream_version",
            "0.02",
        ),
    };
    format!(
        r#"apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata:
  name: {PD}
spec:
  schema: {schema}
  replicas: 2
  terminationGracePeriodSeconds: 20
  database:
    secretRef: {{name: shop-db}}
  worker:
    heartbeatIntervalSeconds: 2
    abandonStaleInstanceThresholdSeconds: 10
  perspectives:
    - name: seen
      version: {version}
      rebuild: blueGreen
      setup: |
        CREATE TABLE IF NOT EXISTS seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL, tag text NOT NULL{columns})
      handlers:
        Tick: |
          SELECT pg_sleep({sleep});
          INSERT INTO seen AS s VALUES (:stream_id, ARRAY[:stream_version], {insert})
          ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version{update}
"#
    )
}

/// The reader: psql in a pod, printing `<tags>|<rows>` of `seen` ten times a second
/// (`\watch`), from a script in a ConfigMap. Restricted pod security, as the namespace enforces.
fn reader_yaml(schema: &str, url: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: reader
data:
  read.sql: |
    SELECT coalesce(string_agg(DISTINCT tag, ',' ORDER BY tag), '-') || '|' || count(*) FROM {schema}.seen
    \watch 0.1
---
apiVersion: v1
kind: Pod
metadata:
  name: reader
spec:
  restartPolicy: Never
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    seccompProfile: {{type: RuntimeDefault}}
  volumes:
    - name: script
      configMap: {{name: reader}}
  containers:
    - name: psql
      image: localhost/e2e-psql:v1
      imagePullPolicy: Never
      args: ["-X", "-A", "-t", "-q", "-f", "/script/read.sql", "{url}"]
      volumeMounts:
        - {{name: script, mountPath: /script, readOnly: true}}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities: {{drop: [ALL]}}
"#
    )
}

/// The version `seen` runs live once nothing is being built (None while v2 builds).
async fn live_version(conn: &mut PgConnection, schema: &str) -> Option<i64> {
    sqlx::query_scalar::<_, Option<i64>>(&format!(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM {schema}.wh_perspective_versions WHERE state = 'building')
                THEN NULL ELSE (SELECT version::int8 FROM {schema}.wh_perspectives WHERE perspective_name = 'seen') END"
    ))
    .fetch_one(conn)
    .await
    .unwrap()
}

/// What holds a build back, for a timed-out wait: the jobs, the versions, each perspective's
/// dead letters and oldest unapplied work (the switch waits for a lag under 1 s), and the pods.
async fn build_state(schema: &str, ns: &str) -> String {
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    let rows: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT 'job ' || perspective_name || ' ' || kind || ' ' || state FROM {schema}.wh_perspective_jobs
         UNION ALL SELECT 'version ' || perspective_name || ' v' || version || ' ' || state FROM {schema}.wh_perspective_versions
         UNION ALL SELECT 'dead letters ' || perspective_name || ': ' || count(*) FROM {schema}.wh_dead_letters GROUP BY perspective_name
         UNION ALL SELECT 'pending ' || perspective_name || ': ' || count(*) || ', oldest '
                          || round(extract(epoch FROM now() - min(created_at))::numeric, 1) || ' s'
                   FROM {schema}.wh_perspective_events WHERE processed_at IS NULL GROUP BY perspective_name"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap_or_else(|e| vec![format!("(state unreadable: {e})")]);
    let pods = kubectl(&["get", "pods", "-n", ns, "-o", "wide"], None);
    format!(
        "{}\n{}",
        rows.join("\n"),
        String::from_utf8_lossy(&pods.stdout)
    )
}

/// Watches the CR until stopped: every `Ready` status seen, and every phase of `seen`.
struct CrWatch {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<(Vec<String>, Vec<String>)>>,
    thread: std::thread::JoinHandle<()>,
}

impl CrWatch {
    fn start(ns: &str) -> CrWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<(Vec<String>, Vec<String>)>> = Arc::default();
        let (ns, flag, store) = (ns.to_owned(), stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let ready = pd_condition(&ns, "Ready")
                    .map_or_else(|| "absent".into(), |(s, r, m)| format!("{s} {r}: {m}"));
                let phase = kubectl_ok(
                    &[
                        "-n",
                        &ns,
                        "get",
                        &format!("perspectivedeployment/{PD}"),
                        "-o",
                        "jsonpath={.status.perspectives[0].phase}",
                    ],
                    None,
                );
                let mut s = store.lock().unwrap();
                if s.0.last() != Some(&ready) {
                    s.0.push(ready);
                }
                if s.1.last() != Some(&phase) {
                    s.1.push(phase);
                }
                drop(s);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        CrWatch { stop, seen, thread }
    }

    /// The distinct `Ready` values and phases seen, in order.
    fn stop(self) -> (Vec<String>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        let seen = self.seen.lock().unwrap();
        seen.clone()
    }
}

/// Checks the reader's log: every read is one whole model of `streams` rows (`v1|n` or
/// `v2|n`), the old ones before the new ones, both seen.
fn assert_whole_models(log: &str, streams: usize) {
    let reads: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let (old, new) = (format!("v1|{streams}"), format!("v2|{streams}"));
    let bad: Vec<&&str> = reads.iter().filter(|r| **r != old && **r != new).collect();
    assert!(
        bad.is_empty(),
        "reads that are not one whole model ({} of {}): {:?}",
        bad.len(),
        reads.len(),
        &bad[..bad.len().min(5)]
    );
    let first_new = reads.iter().position(|r| *r == new);
    let last_old = reads.iter().rposition(|r| *r == old);
    match (last_old, first_new) {
        (Some(o), Some(n)) => assert!(o < n, "the old model was read again after the new one"),
        _ => panic!("the reader saw both models: {} reads", reads.len()),
    }
    eprintln!(
        "[real-node] blue/green: {} reads in a pod, {} of v1 then {} of v2, none mixed",
        reads.len(),
        first_new.unwrap(),
        reads.len() - first_new.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blue_green_bump_in_the_cr_keeps_ready_and_a_reader_pod_never_sees_a_mix() {
    let w = World::new().await;
    let pods = w.pods();
    let node = w.node.name.clone();
    w.install_operator(1);
    w.apply(&bg_yaml(&w.schema, 1));
    w.wait_pd_ready();
    ready_workers(&pods, &node, 2).await;

    // A history on every stream, applied by v1.
    let streams: BTreeMap<uuid::Uuid, i64> =
        (0..STREAMS).map(|_| (uuid::Uuid::now_v7(), 0)).collect();
    let appender = Appender::start(&w.schema, streams, 200);
    tokio::time::sleep(Duration::from_secs(5)).await; // producers at work, not a wait for state
    let history = appender.stop().await;
    assert_exactly_once(&w.schema, &history, "v1's history").await;

    // The reader pod reads v1 before anything changes.
    kubectl_ok(
        &["-n", &w.ns, "apply", "-f", "-"],
        Some(&reader_yaml(&w.schema, &w.pod_url)),
    );
    let reads = |model: &'static str| {
        let ns = w.ns.clone();
        move || {
            // Not yet started is not yet read (`kubectl logs` fails until the container runs).
            let out = kubectl(&["-n", &ns, "logs", "reader"], None);
            let read = String::from_utf8_lossy(&out.stdout).contains(&format!("{model}|{STREAMS}"));
            async move { Ok(read.then_some(())) }
        }
    };
    poll("the reader pod reads v1", LONG, reads("v1"))
        .await
        .unwrap();

    // The bump, with producers appending and the CR watched throughout.
    let watch = CrWatch::start(&w.ns);
    let appender = Appender::start(&w.schema, history, 50);
    let t = Instant::now();
    w.apply(&bg_yaml(&w.schema, 2));
    if let Err(e) = poll("v2 built and switched in", LONG, || async {
        let mut conn = PgConnection::connect(&database_url()).await?;
        Ok((live_version(&mut conn, &w.schema).await == Some(2)).then_some(()))
    })
    .await
    {
        panic!("{e:#}\n{}", build_state(&w.schema, &w.ns).await);
    }
    eprintln!(
        "[real-node] blue/green: v2 live {:?} after the apply",
        t.elapsed()
    );
    poll("the reader pod reads v2", LONG, reads("v2"))
        .await
        .unwrap();
    let appended = appender.stop().await;
    assert_exactly_once(&w.schema, &appended, "v2 after the switch").await;
    let (ready, phases) = watch.stop();

    // Ready never left True; the CR showed the build.
    assert!(
        ready.iter().all(|r| r.starts_with("True")),
        "Ready stays True during a blue/green bump: {ready:?}"
    );
    assert!(
        phases.iter().any(|p| p == "Building" || p == "Switching"),
        "the CR's status showed the build: {phases:?}"
    );
    // The operator announced the build and the switch, once each.
    let events = poll("Events VersionBuilt and VersionSwitched", LONG, || async {
        let events = kubectl_ok(
            &[
                "-n",
                &w.ns,
                "get",
                "events",
                "-o",
                "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
            ],
            None,
        );
        let both = events.contains("VersionBuilt") && events.contains("seen: switched to v2");
        Ok(both.then_some(events))
    })
    .await
    .unwrap();
    for reason in ["VersionBuilt", "VersionSwitched"] {
        let n = events.lines().filter(|l| l.starts_with(reason)).count();
        assert_eq!(n, 1, "one Event {reason}: {events}");
    }

    // The new shape serves under the old name.
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    let last: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.seen WHERE last = cardinality(versions) AND tag = 'v2'",
        w.schema
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(last, STREAMS as i64, "every row of v2 has its new column");

    // The reader ran throughout and saw one whole model per read.
    let pod: Pod = pods.get("reader").await.unwrap();
    assert_eq!(
        exit_code_of(&pod, "psql"),
        None,
        "the reader is still running"
    );
    let log = kubectl_ok(&["-n", &w.ns, "logs", "reader"], None);
    assert_whole_models(&log, STREAMS);
    w.shutdown().await;
}
