//! The e2e pod runner (`tests/support/pod_runner.rs`) against the real control plane:
//! Jobs completing and failing through it (kwok without `pod-complete`), a StatefulSet's
//! processes following its scale, restarts, and a missing Secret.
//!
//! Run: `tests/e2e/with-control-plane.sh cargo test -p perspective-operator --test pod_runner`

mod support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{ensure, Context};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use support::pod_runner::{PodProcess, PodRunner, ProcState};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A namespace, and a runner for it with its logs under `$E2E_DIR/pods/<namespace>`.
async fn setup(prefix: &str) -> anyhow::Result<(Client, String, PodRunner)> {
    let e2e = support::e2e().await;
    let ns = support::fresh_namespace(&e2e.client, prefix).await?;
    let log_dir = e2e.dir.join("pods").join(&ns);
    let runner = PodRunner::start(e2e.client.clone(), &ns, HashMap::new(), vec![], log_dir).await?;
    Ok((e2e.client, ns, runner))
}

async fn create<K>(client: &Client, ns: &str, manifest: Value) -> anyhow::Result<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let obj: K = serde_json::from_value(manifest)?;
    Ok(api.create(&PostParams::default(), &obj).await?)
}

/// Waits for the Job condition `kind` (Complete, Failed) to be True.
async fn wait_job_condition(
    client: &Client,
    ns: &str,
    name: &str,
    kind: &str,
) -> anyhow::Result<Job> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    support::poll(
        &format!("job {ns}/{name} condition {kind}"),
        TIMEOUT,
        || async {
            let job = jobs.get(name).await?;
            let conditions = job
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default();
            Ok(conditions
                .iter()
                .any(|c| c.type_ == kind && c.status == "True")
                .then_some(job))
        },
    )
    .await
}

async fn job_pod(client: &Client, ns: &str, job: &str) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await?;
    ensure!(
        list.items.len() == 1,
        "expected 1 pod of job {job}, got {}",
        list.items.len()
    );
    Ok(list.items.into_iter().next().unwrap())
}

/// `containerStatuses[0].state.terminated` of a pod, as JSON.
fn terminated(pod: &Pod) -> Value {
    let status = serde_json::to_value(pod.status.clone().unwrap_or_default()).unwrap_or_default();
    status["containerStatuses"][0]["state"]["terminated"].clone()
}

fn phase(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

/// Whether `pid` exists and is not a zombie (an orphan may wait a moment for its reaper).
fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// Live processes in process group `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    let entries = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    entries
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            // /proc/PID/stat: "pid (comm) state ppid pgrp ..."
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let fields: Vec<&str> = stat
                .rsplit_once(") ")
                .map(|(_, r)| r.split(' ').collect())
                .unwrap_or_default();
            fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
        })
        .collect()
}

/// A bare pod running `script` with `sh -c`.
fn sh_pod(name: &str, grace_seconds: i64, script: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": grace_seconds,
            "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script]}],
        },
    })
}

#[tokio::test]
async fn job_gets_env_secrets_and_mounted_config() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-job-").await?;
    create::<Secret>(
        &client,
        &ns,
        json!({
            "metadata": {"name": "creds"},
            "stringData": {"password": "s3cret"},
        }),
    )
    .await?;
    create::<ConfigMap>(
        &client,
        &ns,
        json!({
            "metadata": {"name": "cfg"},
            "data": {"settings.conf": "mode=test", "LEVEL": "debug"},
        }),
    )
    .await?;
    // The script gets the mounted file as $1: args and env values are rewritten to local
    // paths, paths inside the script are not.
    let script = r#"{
        echo "PASSWORD=$PASSWORD"
        echo "POD_UID=$POD_UID"
        echo "GREETING=$GREETING"
        echo "LEVEL=$CFG_LEVEL"
        echo "SETTINGS=$(cat "$1")"
        echo "OPTIONAL=${OPTIONAL-unset}"
        echo "KUBECONFIG=${KUBECONFIG-unset}"
        echo "PWD=$PWD"
      } > "$OUT""#;
    create::<Job>(&client, &ns, json!({
        "metadata": {"name": "env"},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", script, "sh", "/etc/app/settings.conf"],
                    "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                    "env": [
                        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "GREETING", "value": "hello-$(POD_NAME)"},
                        {"name": "OPTIONAL", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": true}}},
                        {"name": "OUT", "value": "/out/env.txt"},
                    ],
                    "volumeMounts": [
                        {"name": "cfg", "mountPath": "/etc/app"},
                        {"name": "out", "mountPath": "/out"},
                    ],
                }],
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "out", "emptyDir": {}},
                ],
            }},
        },
    }))
    .await?;

    wait_job_condition(&client, &ns, "env", "Complete").await?;
    let pod = job_pod(&client, &ns, "env").await?;
    let uid = pod.metadata.uid.clone().context("pod uid")?;
    let name = pod.metadata.name.clone().context("pod name")?;
    // kwok left the status the runner wrote alone.
    assert_eq!(phase(&pod), "Succeeded");
    let term = terminated(&pod);
    assert_eq!(term["exitCode"], 0, "{term}");
    assert_eq!(term["reason"], "Completed", "{term}");

    let proc: PodProcess = runner
        .pods()
        .into_iter()
        .find(|p| p.uid == uid)
        .context("the runner does not know the job's pod")?;
    assert_eq!(proc.state, ProcState::Terminated { exit_code: 0 });
    assert_eq!(proc.owner_kind.as_deref(), Some("Job"));
    let out = std::fs::read_to_string(proc.path("/out/env.txt"))?;
    let got: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    let root = proc.root.display().to_string();
    let greeting = format!("hello-{name}");
    let want: BTreeMap<&str, &str> = [
        ("PASSWORD", "s3cret"),
        ("POD_UID", uid.as_str()),
        ("GREETING", greeting.as_str()),
        ("LEVEL", "debug"),
        ("SETTINGS", "mode=test"),
        ("OPTIONAL", "unset"),
        ("KUBECONFIG", "unset"),
        ("PWD", root.as_str()),
    ]
    .into();
    assert_eq!(got, want, "output of the job:\n{out}");

    runner.shutdown().await;
    support::delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn failing_job_fails_with_the_output_as_message() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-fail-").await?;
    create::<Job>(&client, &ns, json!({
        "metadata": {"name": "fail"},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", "echo boom; exit 3"]}],
            }},
        },
    }))
    .await?;

    let job = wait_job_condition(&client, &ns, "fail", "Failed").await?;
    assert_eq!(job.status.as_ref().and_then(|s| s.failed), Some(1));
    let pod = job_pod(&client, &ns, "fail").await?;
    assert_eq!(phase(&pod), "Failed");
    let term = terminated(&pod);
    assert_eq!(term["exitCode"], 3, "{term}");
    assert_eq!(term["reason"], "Error", "{term}");
    assert!(
        term["message"]
            .as_str()
            .unwrap_or_default()
            .contains("boom"),
        "{term}"
    );
    assert!(
        runner
            .pods()
            .iter()
            .any(|p| p.state == ProcState::Terminated { exit_code: 3 }),
        "{:#?}",
        runner.pods()
    );

    runner.shutdown().await;
    support::delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn statefulset_processes_follow_scale_and_restart() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-sts-").await?;
    create::<StatefulSet>(&client, &ns, json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "1000"]}],
                },
            },
        },
    }))
    .await?;

    let running = runner
        .wait_running("2 StatefulSet pods running", TIMEOUT, |r| {
            r.len() == 2
                && r.iter()
                    .all(|p| p.owner_kind.as_deref() == Some("StatefulSet"))
        })
        .await?;
    for p in &running {
        // /proc/PID/cmdline can read empty for a moment right after the spawn.
        let cmdline = support::poll(&format!("cmdline of pid {}", p.pid), TIMEOUT, || async {
            let c = std::fs::read(format!("/proc/{}/cmdline", p.pid))?;
            Ok((!c.is_empty()).then_some(c))
        })
        .await?;
        assert_eq!(cmdline, b"sleep\x001000\x00", "pid {} of {}", p.pid, p.name);
    }

    // A crash: the runner restarts the process and counts the restart in the pod status.
    let old = runner.kill("web-0", libc::SIGKILL)?;
    let restarted = runner
        .wait_running("web-0 restarted", TIMEOUT, |r| {
            r.iter().any(|p| p.name == "web-0" && p.restarts == 1)
        })
        .await?;
    let new = restarted.iter().find(|p| p.name == "web-0").unwrap().pid;
    assert_ne!(new, old);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = support::poll("restartCount 1 on web-0", TIMEOUT, || async {
        let pod = pods.get("web-0").await?;
        let cs = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.clone())
            .unwrap_or_default();
        Ok((cs.first().map(|c| c.restart_count) == Some(1)).then_some(pod))
    })
    .await?;
    assert_eq!(phase(&pod), "Running");
    let status = serde_json::to_value(pod.status.clone().unwrap_or_default())?;
    assert_eq!(
        status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"], 137,
        "{status}"
    );

    // Scale to 0: the pods are deleted, their processes stopped.
    let pids: Vec<u32> = runner.running().iter().map(|p| p.pid).collect();
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    sts.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 0}})),
    )
    .await?;
    runner
        .wait_for("no pods left", TIMEOUT, |pods| {
            pods.is_empty().then_some(())
        })
        .await?;
    for pid in pids {
        assert!(!pid_alive(pid), "pid {pid} survived its pod");
    }
    support::poll("pods of web deleted", TIMEOUT, || async {
        Ok(pods
            .list(&ListParams::default().labels("app=web"))
            .await?
            .items
            .is_empty()
            .then_some(()))
    })
    .await?;

    runner.shutdown().await;
    support::delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn missing_secret_is_a_config_error_until_it_exists() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-cfgerr-").await?;
    create::<Pod>(&client, &ns, json!({
        "metadata": {"name": "late"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": "busybox",
                "command": ["sh", "-c", "echo token=$TOKEN"],
                "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "token"}}}],
            }],
        },
    }))
    .await?;

    let err = runner
        .wait_for("a config error", TIMEOUT, |pods| {
            pods.iter().find_map(|p| match &p.state {
                ProcState::ConfigError(e) => Some(e.clone()),
                _ => None,
            })
        })
        .await?;
    assert!(err.contains(r#"secret "late" not found"#), "{err}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    support::poll(
        "CreateContainerConfigError in the pod status",
        TIMEOUT,
        || async {
            let status = serde_json::to_value(pods.get("late").await?.status)?;
            let reason = &status["containerStatuses"][0]["state"]["waiting"]["reason"];
            Ok((reason == "CreateContainerConfigError").then_some(()))
        },
    )
    .await?;

    create::<Secret>(
        &client,
        &ns,
        json!({"metadata": {"name": "late"}, "stringData": {"token": "t0k"}}),
    )
    .await?;
    let proc = runner
        .wait_for("the pod to run once the secret exists", TIMEOUT, |pods| {
            pods.iter()
                .find(|p| matches!(p.state, ProcState::Terminated { .. }))
                .cloned()
        })
        .await?;
    assert_eq!(proc.state, ProcState::Terminated { exit_code: 0 });
    assert_eq!(std::fs::read_to_string(&proc.log)?, "token=t0k\n");
    let pod = support::poll("pod late Succeeded", TIMEOUT, || async {
        let pod = pods.get("late").await?;
        Ok((phase(&pod) == "Succeeded").then_some(pod))
    })
    .await?;
    assert_eq!(terminated(&pod)["exitCode"], 0);

    runner.shutdown().await;
    support::delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn pod_ignoring_sigterm_is_killed_after_its_grace_period() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-grace-").await?;
    // The ignored TERM is inherited by sleep: the whole group ignores it.
    create::<Pod>(
        &client,
        &ns,
        sh_pod("stubborn", 1, "trap '' TERM; sleep 1000 & wait"),
    )
    .await?;
    let running = runner
        .wait_running("stubborn running", TIMEOUT, |r| r.len() == 1)
        .await?;
    let members = support::poll("sh and sleep in the pod's group", TIMEOUT, || async {
        let m = group_members(running[0].pid);
        Ok((m.len() == 2).then_some(m))
    })
    .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let t0 = std::time::Instant::now();
    pods.delete("stubborn", &Default::default()).await?;
    runner
        .wait_for("stubborn stopped", TIMEOUT, |p| p.is_empty().then_some(()))
        .await?;
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "stopped after {took:?}, before its 1 s grace period"
    );
    support::poll(
        "the pod's processes gone",
        Duration::from_secs(5),
        || async { Ok(members.iter().all(|&pid| !pid_alive(pid)).then_some(())) },
    )
    .await?;

    runner.shutdown().await;
    support::delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn dropping_the_runner_kills_its_processes() -> anyhow::Result<()> {
    let (client, ns, runner) = setup("pr-drop-").await?;
    create::<Pod>(&client, &ns, sh_pod("orphan", 30, "sleep 1000 & wait")).await?;
    let running = runner
        .wait_running("orphan running", TIMEOUT, |r| r.len() == 1)
        .await?;
    let members = support::poll("sh and sleep in the pod's group", TIMEOUT, || async {
        let m = group_members(running[0].pid);
        Ok((m.len() == 2).then_some(m))
    })
    .await?;

    // As when a test fails before its shutdown().
    drop(runner);
    support::poll(
        "the pod's processes gone",
        Duration::from_secs(5),
        || async { Ok(members.iter().all(|&pid| !pid_alive(pid)).then_some(())) },
    )
    .await?;
    support::delete_namespace(&client, &ns).await
}
