//! Runs the pods of the e2e control plane as local processes.
//!
//! kwok only fakes pod status, so nothing would ever run a pod's container. [`PodRunner`]
//! plays the container runtime for one namespace: it watches the pods and runs the first
//! container of every scheduled pod as a local process, with the environment, mounted
//! ConfigMaps/Secrets and restart behaviour a kubelet would give it, and reports exits in
//! the pod status. Use it with the kwok stages of `tests/e2e/with-control-plane.sh` (no
//! `pod-complete` stage), so that the runner, not kwok, decides when a Job pod ends.
//!
//! What a "pod" gets:
//! - program: `command[0]` of container 0 (no image, so no entrypoint: a container without
//!   `command` is a configuration error). Its basename is looked up in `binaries`, else on the
//!   test's `PATH`; argv\[0\] stays the container's `command[0]`. `command[1..]` + `args` are
//!   the arguments, with `$(VAR)` references expanded as the kubelet does.
//! - environment: only `PATH` and `HOME` of the test process, then `envFrom`, then `env`
//!   (`value` with `$(VAR)` expansion, `fieldRef`, `secretKeyRef`, `configMapKeyRef`, honouring
//!   `optional`), then the runner's `env_overrides`, then `E2E_POD_RUNNER_LOG_DIR` (lets
//!   `with-control-plane.sh` find processes a crashed test left behind). A missing Secret,
//!   ConfigMap or key is retried with backoff (1 s doubling to 10 s) while the pod exists, and
//!   reported as `CreateContainerConfigError` in the pod status, like the kubelet does.
//! - volumes: `configMap` and `secret` volumes are written as files to
//!   `<log_dir>/<pod uid>/<mountPath>` (honouring `items`, `subPath`, modes), `emptyDir` is an
//!   empty dir there; other volume types are ignored. Every arg and env value that starts
//!   with a mount path (`/etc/cfg/x.yaml`, also `--flag=/etc/cfg/x.yaml`) is rewritten to the
//!   local path. Paths inside a shell script are not: pass them as an arg or env var.
//! - working dir: `<log_dir>/<pod uid>/<workingDir>` (the pod's "root"), fresh per pod.
//! - output: stdout and stderr appended to `<log_dir>/<namespace>_<pod>.log`.
//! - its own process group; signals go to the whole group, and when the main process exits
//!   the rest of the group is killed (a container ends with its main process).
//!
//! Lifecycle, by `restartPolicy`:
//! - `Never` (Job pods), or `OnFailure` and exit 0: the pod status is patched to phase
//!   Succeeded (exit 0) or Failed, with `containerStatuses[0].state.terminated` (exit code,
//!   `Completed`/`Error`, times, and on failure the last 2 KiB / 80 lines of this run's output
//!   as message, like `terminationMessagePolicy: FallbackToLogsOnError`).
//! - `Always`, or `OnFailure` and a non-zero exit: restarted after a backoff (1 s doubling to
//!   10 s); the pod stays Running, its `restartCount` and `lastState` are updated.
//! - pod deleted (kwok removes pods as soon as they get a deletionTimestamp): SIGTERM, then
//!   SIGKILL after the grace period (the pod's, capped at [`MAX_GRACE`]).
//!
//! [`PodRunner::shutdown`] stops every process the same way; dropping the runner SIGKILLs
//! whatever is left, so a failing test leaves no processes behind. Only container 0 of a pod
//! is run; init and other containers are ignored. Every start, exit and kill is logged to
//! stderr as `[pod-runner NS/POD] ...`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Container, KeyToPath, Pod, Secret};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Upper bound on a pod's termination grace period, so tests never wait 30 s on a process
/// that ignores SIGTERM.
pub const MAX_GRACE: Duration = Duration::from_secs(10);
/// Restart and configuration-retry backoff: 1 s, doubling up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long a status patch waits for kwok to have marked the pod Running first, so that
/// kwok's `pod-ready` stage cannot overwrite it afterwards.
const KWOK_WAIT: Duration = Duration::from_secs(10);
/// Termination message: the tail of the output, as the kubelet takes it.
const MESSAGE_BYTES: usize = 2048;
const MESSAGE_LINES: usize = 80;
const FIELD_MANAGER: &str = "e2e-pod-runner";

/// What the runner is doing with a pod's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcState {
    /// Seen, not started yet.
    Starting,
    /// Cannot start: missing Secret/ConfigMap/key, no command, unknown program. Retried.
    ConfigError(String),
    /// The process (and process group) `pid` runs.
    Running { pid: u32 },
    /// Exited with `exit_code` (128 + signal if killed), restart pending.
    BackOff { exit_code: i32 },
    /// Exited for good; the pod status says Succeeded or Failed.
    Terminated { exit_code: i32 },
    /// The pod is being deleted or the runner shuts down: `pid` got SIGTERM.
    Stopping { pid: u32 },
}

/// A pod the runner handles, as of [`PodRunner::pods`].
#[derive(Debug, Clone)]
pub struct PodProcess {
    pub name: String,
    pub uid: String,
    /// Kind of the controlling owner (`Job`, `StatefulSet` (pods of a Deployment: `ReplicaSet`)).
    pub owner_kind: Option<String>,
    pub state: ProcState,
    /// Restarts so far (as in `restartCount`).
    pub restarts: u32,
    /// stdout + stderr of every run.
    pub log: PathBuf,
    /// Local stand-in for the container's `/`: mounts and the working dir are under it.
    pub root: PathBuf,
}

impl PodProcess {
    /// Local path of an absolute path inside the container, e.g. a file in an emptyDir mount.
    pub fn path(&self, container_path: &str) -> PathBuf {
        self.root.join(container_path.trim_start_matches('/'))
    }
}

/// A pod whose process is running, as of [`PodRunner::running`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningPod {
    pub name: String,
    pub uid: String,
    /// Pid of the main process; also its process group id.
    pub pid: u32,
    pub owner_kind: Option<String>,
    pub restarts: u32,
}

/// Runs the pods of one namespace as local processes; see the module docs.
pub struct PodRunner {
    shared: Arc<Shared>,
    watch_task: JoinHandle<()>,
}

struct Shared {
    client: Client,
    namespace: String,
    binaries: HashMap<String, PathBuf>,
    env_overrides: Vec<(String, String)>,
    log_dir: PathBuf,
    state: Mutex<State>,
    /// Bumped on every change of `state`; wakes [`PodRunner::wait_for`].
    changed: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    tasks: Mutex<JoinSet<()>>,
}

#[derive(Default)]
struct State {
    pods: BTreeMap<String, Tracked>,
    shutting_down: bool,
}

struct Tracked {
    info: PodProcess,
    /// Latest pod object from the watch, for the pod's supervisor task.
    updates: watch::Sender<Observed>,
    /// Process group to SIGKILL if the runner is dropped while it runs.
    pgid: Option<u32>,
}

#[derive(Clone)]
struct Observed {
    pod: Arc<Pod>,
    /// Deleted from the API (or missing from a re-list).
    gone: bool,
}

impl PodRunner {
    /// Starts watching pods in `namespace` and running each scheduled pod's first container.
    ///
    /// `binaries` maps a command name (basename of `command[0]`) to a local executable;
    /// other commands are looked up on `PATH` (so `sh -c ...` works). `env_overrides` are set
    /// last, over the container's env (e.g. `PERSPECTIVE_HTTP_ADDR=127.0.0.1:0`, since all
    /// "pods" share loopback); `$(VAR)` in command/args sees them too. Logs and pod roots go
    /// to `log_dir` (created; put it under `$E2E_DIR`).
    pub async fn start(
        client: Client,
        namespace: &str,
        binaries: HashMap<String, PathBuf>,
        env_overrides: Vec<(String, String)>,
        log_dir: PathBuf,
    ) -> anyhow::Result<PodRunner> {
        fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
        let log_dir = log_dir.canonicalize()?;
        for (name, path) in &binaries {
            if !is_executable(path) {
                bail!(
                    "binary for `{name}` is not an executable file: {}",
                    path.display()
                );
            }
        }
        let shared = Arc::new(Shared {
            client,
            namespace: namespace.to_string(),
            binaries,
            env_overrides,
            log_dir,
            state: Mutex::default(),
            changed: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            tasks: Mutex::new(JoinSet::new()),
        });
        let watch_task = tokio::spawn(watch_pods(shared.clone()));
        eprintln!(
            "[pod-runner {namespace}] watching pods; logs in {}",
            shared.log_dir.display()
        );
        Ok(PodRunner { shared, watch_task })
    }

    /// Every pod the runner has seen and that still exists, in uid order.
    pub fn pods(&self) -> Vec<PodProcess> {
        lock(&self.shared.state)
            .pods
            .values()
            .map(|t| t.info.clone())
            .collect()
    }

    /// The pods whose process is running now.
    pub fn running(&self) -> Vec<RunningPod> {
        self.pods()
            .into_iter()
            .filter_map(|p| match p.state {
                ProcState::Running { pid } => Some(RunningPod {
                    name: p.name,
                    uid: p.uid,
                    pid,
                    owner_kind: p.owner_kind,
                    restarts: p.restarts,
                }),
                _ => None,
            })
            .collect()
    }

    /// Waits until `check` returns `Some` for the current [`pods`](Self::pods), re-checking on
    /// every change; fails after `timeout` with `what` and the last snapshot.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&[PodProcess]) -> Option<T>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + timeout;
        let mut changed = self.shared.changed.subscribe();
        loop {
            changed.borrow_and_update();
            let pods = self.pods();
            if let Some(found) = check(&pods) {
                return Ok(found);
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                bail!("timed out after {timeout:?} waiting for {what}; pod processes: {pods:#?}");
            }
        }
    }

    /// Waits until `pred` holds for the running pods; returns them.
    pub async fn wait_running(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[RunningPod]) -> bool,
    ) -> anyhow::Result<Vec<RunningPod>> {
        self.wait_for(what, timeout, |_| {
            let running = self.running();
            pred(&running).then_some(running)
        })
        .await
    }

    /// Sends `signal` (e.g. `libc::SIGKILL`) to the process group of the running pod
    /// `pod_name`, as if its container crashed; returns the pid.
    pub fn kill(&self, pod_name: &str, signal: i32) -> anyhow::Result<u32> {
        let pid = self
            .running()
            .into_iter()
            .find(|p| p.name == pod_name)
            .map(|p| p.pid)
            .ok_or_else(|| anyhow!("no running process for pod {pod_name}"))?;
        eprintln!(
            "[pod-runner {}/{pod_name}] sending signal {signal} to pid {pid} (test request)",
            self.shared.namespace
        );
        if !signal_group(pid, signal) {
            bail!(
                "kill(-{pid}, {signal}) failed: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(pid)
    }

    /// Stops watching, SIGTERMs every process, SIGKILLs what is left after its grace period
    /// (at most [`MAX_GRACE`]) and waits for all of it.
    pub async fn shutdown(self) {
        self.watch_task.abort();
        lock(&self.shared.state).shutting_down = true;
        self.shared.shutdown.send_replace(true);
        let mut tasks = std::mem::take(&mut *lock(&self.shared.tasks));
        while tasks.join_next().await.is_some() {}
        eprintln!("[pod-runner {}] shut down", self.shared.namespace);
    }
}

impl Drop for PodRunner {
    /// Fallback for a test that panicked or returned early: nothing may outlive the runner.
    fn drop(&mut self) {
        self.watch_task.abort();
        let mut state = lock(&self.shared.state);
        state.shutting_down = true;
        for t in state.pods.values() {
            if let Some(pgid) = t.pgid {
                eprintln!(
                    "[pod-runner {}/{}] runner dropped: SIGKILL to process group {pgid}",
                    self.shared.namespace, t.info.name
                );
                signal_group(pgid, libc::SIGKILL);
            }
        }
        drop(state);
        self.shared.shutdown.send_replace(true);
        lock(&self.shared.tasks).abort_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not stop the cleanup paths.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// kill(2) on a process group; false if it failed (e.g. the group is gone).
fn signal_group(pgid: u32, signal: i32) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else {
        return false;
    };
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

// --- watching ---------------------------------------------------------------------------

async fn watch_pods(shared: Arc<Shared>) {
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    // uids listed since the last Init: after InitDone, pods not among them were deleted
    // while the watch was down.
    let mut relisted: Option<HashSet<String>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisted = Some(HashSet::new()),
            Ok(Event::InitApply(pod)) => {
                if let (Some(seen), Some(uid)) = (relisted.as_mut(), pod.metadata.uid.as_ref()) {
                    seen.insert(uid.clone());
                }
                shared.observe(pod, false);
            }
            Ok(Event::InitDone) => {
                if let Some(seen) = relisted.take() {
                    shared.forget_missing(&seen);
                }
            }
            Ok(Event::Apply(pod)) => shared.observe(pod, false),
            Ok(Event::Delete(pod)) => shared.observe(pod, true),
            Err(e) => eprintln!(
                "[pod-runner {}] pod watch error (retrying): {e}",
                shared.namespace
            ),
        }
    }
}

fn startable(pod: &Pod) -> bool {
    let scheduled = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    scheduled
        && pod.metadata.deletion_timestamp.is_none()
        && !matches!(phase, Some("Succeeded" | "Failed"))
}

impl Shared {
    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    fn set_state(&self, uid: &str, state: ProcState, restarts: u32) {
        if let Some(t) = lock(&self.state).pods.get_mut(uid) {
            t.info.state = state;
            t.info.restarts = restarts;
        }
        self.bump();
    }

    fn observe(self: &Arc<Self>, pod: Pod, gone: bool) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let mut state = lock(&self.state);
        if let Some(t) = state.pods.get(&uid) {
            t.updates.send_replace(Observed {
                pod: Arc::new(pod),
                gone,
            });
            return;
        }
        if gone || state.shutting_down || !startable(&pod) {
            return;
        }
        let name = pod.metadata.name.clone().unwrap_or_default();
        let owner_kind = pod.metadata.owner_references.as_ref().and_then(|refs| {
            let owner = refs
                .iter()
                .find(|r| r.controller == Some(true))
                .or(refs.first());
            owner.map(|r| r.kind.clone())
        });
        let info = PodProcess {
            log: self.log_dir.join(format!("{}_{name}.log", self.namespace)),
            root: self.log_dir.join(&uid),
            name,
            uid: uid.clone(),
            owner_kind,
            state: ProcState::Starting,
            restarts: 0,
        };
        let (updates, rx) = watch::channel(Observed {
            pod: Arc::new(pod),
            gone,
        });
        state.pods.insert(
            uid.clone(),
            Tracked {
                info,
                updates,
                pgid: None,
            },
        );
        drop(state);
        lock(&self.tasks).spawn(supervise(self.clone(), uid, rx));
        self.bump();
    }

    fn forget_missing(&self, seen: &HashSet<String>) {
        for t in lock(&self.state).pods.values() {
            if !seen.contains(&t.info.uid) {
                t.updates.send_modify(|o| o.gone = true);
            }
        }
    }

    fn forget(&self, uid: &str) {
        lock(&self.state).pods.remove(uid);
        self.bump();
    }

    fn api(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    async fn patch_status(&self, pod_name: &str, status: Value) {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        // Strategic merge: conditions merge by type; containerStatuses is replaced as a whole.
        let patch = Patch::Strategic(json!({ "status": status }));
        if let Err(e) = self.api().patch_status(pod_name, &params, &patch).await {
            eprintln!(
                "[pod-runner {}/{pod_name}] patching pod status failed: {e}",
                self.namespace
            );
        }
    }
}

// --- one pod ----------------------------------------------------------------------------

/// Why [`until_stop`] returned.
enum Stop {
    /// Pod deleted (or gone): use its grace period.
    Deleted,
    Shutdown,
}

fn stop_reason(
    pod_rx: &watch::Receiver<Observed>,
    shutdown: &watch::Receiver<bool>,
) -> Option<Stop> {
    if *shutdown.borrow() {
        return Some(Stop::Shutdown);
    }
    let o = pod_rx.borrow();
    (o.gone || o.pod.metadata.deletion_timestamp.is_some()).then_some(Stop::Deleted)
}

/// Resolves when the pod is deleted or the runner shuts down.
async fn until_stop(
    pod_rx: &mut watch::Receiver<Observed>,
    shutdown: &mut watch::Receiver<bool>,
) -> Stop {
    loop {
        if let Some(stop) = stop_reason(pod_rx, shutdown) {
            return stop;
        }
        tokio::select! {
            r = pod_rx.changed() => if r.is_err() { return Stop::Deleted },
            r = shutdown.changed() => if r.is_err() { return Stop::Shutdown },
        }
    }
}

/// Sleeps `delay`; `Some` if the pod should stop instead.
async fn sleep_or_stop(
    delay: Duration,
    pod_rx: &mut watch::Receiver<Observed>,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Stop> {
    tokio::select! {
        _ = tokio::time::sleep(delay) => stop_reason(pod_rx, shutdown),
        stop = until_stop(pod_rx, shutdown) => Some(stop),
    }
}

/// Waits (bounded) until the latest pod object satisfies `pred`; returns it, or `None` if
/// the pod is gone or the wait timed out.
async fn wait_pod(
    pod_rx: &mut watch::Receiver<Observed>,
    timeout: Duration,
    pred: impl Fn(&Pod) -> bool,
) -> Option<Arc<Pod>> {
    let wait = pod_rx.wait_for(|o| o.gone || pred(&o.pod));
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(o)) if !o.gone => Some(o.pod.clone()),
        _ => None,
    }
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// A status patch must come after kwok's own `Pending -> Running` one, or kwok overwrites it.
async fn wait_kwok_running(pod_rx: &mut watch::Receiver<Observed>) -> Option<Arc<Pod>> {
    wait_pod(pod_rx, KWOK_WAIT, |p| phase(p) != "Pending").await
}

fn grace_period(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or(pod
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds))
        .unwrap_or(30);
    Duration::from_secs(u64::try_from(secs).unwrap_or(0)).min(MAX_GRACE)
}

fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Container 0's status entry, keeping the other containers' entries (the list is replaced
/// as a whole by a patch).
fn container_statuses(pod: &Pod, entry: Value) -> Value {
    let name = entry["name"].as_str().unwrap_or_default().to_string();
    let mut list = vec![entry];
    let current = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    for cs in current.into_iter().flatten().filter(|cs| cs.name != name) {
        list.push(serde_json::to_value(cs).unwrap_or(Value::Null));
    }
    Value::Array(list)
}

fn status_entry(
    container: &Container,
    ready: bool,
    restarts: u32,
    state: Value,
    last_state: Value,
) -> Value {
    json!({
        "name": container.name,
        "image": container.image.clone().unwrap_or_default(),
        "imageID": "",
        "ready": ready,
        "started": state.get("running").is_some(),
        "restartCount": restarts,
        "state": state,
        "lastState": last_state,
    })
}

fn ready_conditions(ready: bool, reason: &str) -> Value {
    let (status, now) = (if ready { "True" } else { "False" }, now());
    let cond = |t: &str| {
        // null deletes a reason left from an earlier not-ready patch.
        let reason = if ready { Value::Null } else { json!(reason) };
        json!({"type": t, "status": status, "lastTransitionTime": now, "reason": reason})
    };
    json!([cond("Ready"), cond("ContainersReady")])
}

/// The tail of `log` from byte `from` on, as the kubelet cuts a termination message.
fn log_tail(log: &Path, from: u64) -> String {
    let mut buf = Vec::new();
    if let Ok(mut f) = fs::File::open(log) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let start = from.max(len.saturating_sub(MESSAGE_BYTES as u64));
        if f.seek(SeekFrom::Start(start)).is_ok() {
            let _ = f.read_to_end(&mut buf);
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    lines[lines.len().saturating_sub(MESSAGE_LINES)..].concat()
}

/// The supervisor of one pod: prepares, starts, restarts and stops its process, and
/// reports to the pod status. Ends when the pod is gone or the runner shuts down.
async fn supervise(shared: Arc<Shared>, uid: String, mut pod_rx: watch::Receiver<Observed>) {
    let mut shutdown = shared.shutdown.subscribe();
    let (name, log_path, root) = {
        let state = lock(&shared.state);
        let Some(t) = state.pods.get(&uid) else {
            return;
        };
        (t.info.name.clone(), t.info.log.clone(), t.info.root.clone())
    };
    let tag = format!("[pod-runner {}/{name}]", shared.namespace);
    let restart_policy = {
        let o = pod_rx.borrow();
        o.pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into())
    };
    let mut restarts = 0u32;
    let mut backoff = Duration::from_secs(1);
    let mut last_error: Option<String> = None;
    // Last exit, for `lastState` after a restart.
    let mut last_exit = json!({});

    loop {
        if stop_reason(&pod_rx, &shutdown).is_some() {
            break;
        }
        let pod = pod_rx.borrow().pod.clone();
        let Some(container) = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .cloned()
        else {
            break;
        };
        let prepared = match prepare(&shared, &mut pod_rx, &container, &root).await {
            Ok(p) => p,
            Err(e) => {
                let msg = format!("{e:#}");
                if last_error.as_ref() != Some(&msg) {
                    eprintln!("{tag} cannot start (CreateContainerConfigError, retrying): {msg}");
                    shared.set_state(&uid, ProcState::ConfigError(msg.clone()), restarts);
                    if let Some(pod) = wait_kwok_running(&mut pod_rx).await {
                        let waiting = json!({"waiting": {"reason": "CreateContainerConfigError", "message": msg}});
                        let entry =
                            status_entry(&container, false, restarts, waiting, last_exit.clone());
                        let status = json!({
                            "conditions": ready_conditions(false, "ContainersNotReady"),
                            "containerStatuses": container_statuses(&pod, entry),
                        });
                        shared.patch_status(&name, status).await;
                    }
                    last_error = Some(msg);
                }
                if sleep_or_stop(backoff, &mut pod_rx, &mut shutdown)
                    .await
                    .is_some()
                {
                    break;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };

        let started_at = now();
        // Spawn under the state lock: Drop (which takes it too) then either sees the pgid or
        // has set shutting_down before, so no process can escape it.
        let spawned = {
            let mut state = lock(&shared.state);
            if state.shutting_down {
                break;
            }
            let spawned = prepared.spawn(&log_path);
            if let (Ok((child, _)), Some(t)) = (&spawned, state.pods.get_mut(&uid)) {
                t.pgid = child.id();
            }
            spawned
        };
        let (mut child, log_offset) = match spawned {
            Ok(spawned) => spawned,
            Err(e) => {
                // Like a failed exec in a container: report and retry.
                let msg = format!("{e:#}");
                eprintln!("{tag} start failed (retrying): {msg}");
                shared.set_state(&uid, ProcState::ConfigError(msg.clone()), restarts);
                last_error = Some(msg);
                if sleep_or_stop(backoff, &mut pod_rx, &mut shutdown)
                    .await
                    .is_some()
                {
                    break;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let pid = child.id().unwrap_or(0);
        eprintln!(
            "{tag} started pid {pid} (run #{}): {} {:?}; log {}",
            restarts + 1,
            prepared.program.display(),
            prepared.args,
            log_path.display()
        );
        shared.set_state(&uid, ProcState::Running { pid }, restarts);

        // Only a restart or a recovery needs reporting: kwok already shows the first run.
        if restarts > 0 || last_error.is_some() {
            if let Some(pod) = wait_kwok_running(&mut pod_rx).await {
                let running = json!({"running": {"startedAt": started_at}});
                let entry = status_entry(&container, true, restarts, running, last_exit.clone());
                let status = json!({
                    "conditions": ready_conditions(true, ""),
                    "containerStatuses": container_statuses(&pod, entry),
                });
                shared.patch_status(&name, status).await;
            }
        }
        last_error = None;

        let stopped = tokio::select! {
            status = child.wait() => Err(status),
            stop = until_stop(&mut pod_rx, &mut shutdown) => Ok(stop),
        };
        let status = match stopped {
            Ok(stop) => {
                let grace = grace_period(&pod_rx.borrow().pod);
                let why = match stop {
                    Stop::Deleted => "pod deleted",
                    Stop::Shutdown => "runner shutting down",
                };
                eprintln!("{tag} {why}: SIGTERM to pid {pid}, grace {grace:?}");
                shared.set_state(&uid, ProcState::Stopping { pid }, restarts);
                signal_group(pid, libc::SIGTERM);
                let status = match tokio::time::timeout(grace, child.wait()).await {
                    Ok(status) => status,
                    Err(_) => {
                        eprintln!("{tag} pid {pid} still running after {grace:?}: SIGKILL");
                        signal_group(pid, libc::SIGKILL);
                        child.wait().await
                    }
                };
                finish_group(&shared, &uid, pid);
                match status {
                    Ok(s) => eprintln!("{tag} pid {pid} stopped, exit code {}", exit_code(s)),
                    Err(e) => eprintln!("{tag} waiting for pid {pid} failed: {e}"),
                }
                break;
            }
            Err(status) => status,
        };
        finish_group(&shared, &uid, pid);

        let finished_at = now();
        let code = match status {
            Ok(s) => exit_code(s),
            Err(e) => {
                eprintln!("{tag} waiting for pid {pid} failed: {e}");
                -1
            }
        };
        let message = if code == 0 {
            String::new()
        } else {
            log_tail(&log_path, log_offset)
        };
        if code == 0 {
            eprintln!("{tag} pid {pid} exited with code 0");
        } else {
            let output = if message.is_empty() {
                "(no output)\n"
            } else {
                &message
            };
            eprintln!("{tag} pid {pid} exited with code {code}; output ends with:\n{output}");
        }
        let mut terminated = json!({
            "exitCode": code,
            "reason": if code == 0 { "Completed" } else { "Error" },
            "startedAt": started_at,
            "finishedAt": finished_at,
        });
        if !message.is_empty() {
            terminated["message"] = json!(message);
        }

        let done = match restart_policy.as_str() {
            "Never" => true,
            "OnFailure" => code == 0,
            _ => false,
        };
        if done {
            shared.set_state(&uid, ProcState::Terminated { exit_code: code }, restarts);
            if let Some(pod) = wait_kwok_running(&mut pod_rx).await {
                let entry = status_entry(
                    &container,
                    false,
                    restarts,
                    json!({ "terminated": terminated }),
                    last_exit.clone(),
                );
                let status = json!({
                    "phase": if code == 0 { "Succeeded" } else { "Failed" },
                    "conditions": ready_conditions(false, "PodCompleted"),
                    "containerStatuses": container_statuses(&pod, entry),
                });
                shared.patch_status(&name, status).await;
                eprintln!(
                    "{tag} pod status: {}",
                    if code == 0 { "Succeeded" } else { "Failed" }
                );
            }
            until_stop(&mut pod_rx, &mut shutdown).await;
            break;
        }

        last_exit = json!({ "terminated": terminated });
        shared.set_state(&uid, ProcState::BackOff { exit_code: code }, restarts);
        eprintln!("{tag} restarting in {backoff:?} (restartPolicy {restart_policy})");
        if sleep_or_stop(backoff, &mut pod_rx, &mut shutdown)
            .await
            .is_some()
        {
            break;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
        restarts += 1;
    }
    if stop_reason(&pod_rx, &shutdown).is_some() {
        shared.forget(&uid);
    }
}

/// After the main process ended: a container's other processes end with it.
fn finish_group(shared: &Shared, uid: &str, pid: u32) {
    signal_group(pid, libc::SIGKILL);
    if let Some(t) = lock(&shared.state).pods.get_mut(uid) {
        t.pgid = None;
    }
}

// --- what to run ------------------------------------------------------------------------

/// A process ready to spawn.
struct Prepared {
    program: PathBuf,
    arg0: String,
    args: Vec<String>,
    env: BTreeMap<String, String>,
    cwd: PathBuf,
}

impl Prepared {
    /// Spawns in a new process group, output appended to `log`; returns the child and the
    /// log's length before this run (where this run's output starts).
    fn spawn(&self, log: &Path) -> anyhow::Result<(tokio::process::Child, u64)> {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let offset = out.metadata()?.len();
        let child = tokio::process::Command::new(&self.program)
            .arg0(&self.arg0)
            .args(&self.args)
            .env_clear()
            .envs(&self.env)
            .current_dir(&self.cwd)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {}", self.program.display()))?;
        Ok((child, offset))
    }
}

/// Reads Secrets and ConfigMaps once per preparation.
struct Sources<'a> {
    shared: &'a Shared,
    secrets: HashMap<String, Option<Secret>>,
    config_maps: HashMap<String, Option<ConfigMap>>,
}

/// Keys of a Secret or ConfigMap with their bytes.
type KeyData = BTreeMap<String, Vec<u8>>;

impl Sources<'_> {
    async fn secret(&mut self, name: &str) -> anyhow::Result<Option<KeyData>> {
        if !self.secrets.contains_key(name) {
            let api: Api<Secret> =
                Api::namespaced(self.shared.client.clone(), &self.shared.namespace);
            let secret = api
                .get_opt(name)
                .await
                .with_context(|| format!("reading secret {name:?}"))?;
            self.secrets.insert(name.to_string(), secret);
        }
        Ok(self.secrets[name].as_ref().map(|s| {
            let data = s.data.iter().flatten();
            data.map(|(k, v)| (k.clone(), v.0.clone())).collect()
        }))
    }

    async fn config_map(&mut self, name: &str) -> anyhow::Result<Option<KeyData>> {
        if !self.config_maps.contains_key(name) {
            let api: Api<ConfigMap> =
                Api::namespaced(self.shared.client.clone(), &self.shared.namespace);
            let cm = api
                .get_opt(name)
                .await
                .with_context(|| format!("reading configmap {name:?}"))?;
            self.config_maps.insert(name.to_string(), cm);
        }
        Ok(self.config_maps[name].as_ref().map(|cm| {
            let text = cm
                .data
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.clone().into_bytes()));
            let binary = cm
                .binary_data
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.0.clone()));
            text.chain(binary).collect()
        }))
    }

    /// `kind` is "secret" or "configmap"; `None` if it does not exist.
    async fn get(&mut self, kind: &str, name: &str) -> anyhow::Result<Option<KeyData>> {
        if kind == "secret" {
            self.secret(name).await
        } else {
            self.config_map(name).await
        }
    }
}

fn utf8(kind: &str, name: &str, key: &str, bytes: Vec<u8>) -> anyhow::Result<String> {
    String::from_utf8(bytes).map_err(|_| anyhow!("key {key} of {kind} {name:?} is not UTF-8"))
}

/// Builds command, environment, volumes and working dir like the kubelet would.
async fn prepare(
    shared: &Shared,
    pod_rx: &mut watch::Receiver<Observed>,
    c: &Container,
    root: &Path,
) -> anyhow::Result<Prepared> {
    let pod = pod_rx.borrow().pod.clone();
    let command = c.command.clone().unwrap_or_default();
    if command.is_empty() {
        bail!(
            "container {:?} has no command: the pod runner has no image, so no entrypoint to fall back on",
            c.name
        );
    }
    let mut src = Sources {
        shared,
        secrets: HashMap::new(),
        config_maps: HashMap::new(),
    };

    // envFrom, then env: later entries win, `$(VAR)` sees what came before.
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for from in c.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let (kind, name, optional) = match (&from.config_map_ref, &from.secret_ref) {
            (Some(r), _) => ("configmap", r.name.as_str(), r.optional == Some(true)),
            (None, Some(r)) => ("secret", r.name.as_str(), r.optional == Some(true)),
            (None, None) => continue,
        };
        match src.get(kind, name).await? {
            Some(data) => {
                for (k, v) in data {
                    let v = utf8(kind, name, &k, v)?;
                    env.insert(format!("{prefix}{k}"), v);
                }
            }
            None if optional => {}
            None => bail!("{kind} {name:?} not found"),
        }
    }
    for var in c.env.iter().flatten() {
        let value = match &var.value_from {
            None => Some(expand(var.value.as_deref().unwrap_or_default(), &env)),
            Some(from) => {
                if let Some(f) = &from.field_ref {
                    Some(field_value(pod_rx, &pod, &f.field_path).await?)
                } else if let Some(r) = &from.secret_key_ref {
                    key_value(
                        &mut src,
                        "secret",
                        &r.name,
                        &r.key,
                        r.optional == Some(true),
                    )
                    .await?
                } else if let Some(r) = &from.config_map_key_ref {
                    key_value(
                        &mut src,
                        "configmap",
                        &r.name,
                        &r.key,
                        r.optional == Some(true),
                    )
                    .await?
                } else {
                    bail!("env {}: only value, fieldRef, secretKeyRef and configMapKeyRef are supported", var.name)
                }
            }
        };
        if let Some(value) = value {
            env.insert(var.name.clone(), value);
        }
    }
    for (k, v) in &shared.env_overrides {
        env.insert(k.clone(), v.clone());
    }

    let mounts = materialize_volumes(&mut src, &pod, c, root).await?;
    let local = |s: String| rewrite_path(&s, &mounts);

    let mut argv: Vec<String> = command
        .iter()
        .chain(c.args.iter().flatten())
        .map(|a| expand(a, &env))
        .collect();
    let arg0 = argv.remove(0);
    let args = argv.into_iter().map(local).collect();
    let program = resolve_program(shared, &arg0)?;

    // The working dir is under the pod root unless it is (under) a mount.
    let cwd = match c.working_dir.as_deref() {
        Some(dir) => match rewrite_path(dir, &mounts) {
            local if local != dir => PathBuf::from(local),
            _ => root.join(dir.trim_start_matches('/')),
        },
        None => root.to_path_buf(),
    };
    fs::create_dir_all(&cwd).with_context(|| format!("creating working dir {}", cwd.display()))?;

    let mut full_env: BTreeMap<String, String> = ["PATH", "HOME"]
        .into_iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .collect();
    full_env.extend(env.into_iter().map(|(k, v)| (k, local(v))));
    full_env.insert(
        "E2E_POD_RUNNER_LOG_DIR".into(),
        shared.log_dir.display().to_string(),
    );
    Ok(Prepared {
        program,
        arg0,
        args,
        env: full_env,
        cwd,
    })
}

async fn key_value(
    src: &mut Sources<'_>,
    kind: &str,
    name: &str,
    key: &str,
    optional: bool,
) -> anyhow::Result<Option<String>> {
    match src.get(kind, name).await? {
        Some(mut data) => match data.remove(key) {
            Some(v) => Ok(Some(utf8(kind, name, key, v)?)),
            None if optional => Ok(None),
            None => bail!(
                "couldn't find key {key} in {kind} {}/{name}",
                src.shared.namespace
            ),
        },
        None if optional => Ok(None),
        None => bail!("{kind} {name:?} not found"),
    }
}

/// A downward-API field, as the kubelet resolves `fieldRef`.
async fn field_value(
    pod_rx: &mut watch::Receiver<Observed>,
    pod: &Pod,
    path: &str,
) -> anyhow::Result<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let subscript = |prefix: &str| {
        let rest = path
            .strip_prefix(prefix)?
            .strip_prefix("['")?
            .strip_suffix("']")?;
        Some(rest.to_string())
    };
    if let Some(key) = subscript("metadata.labels") {
        return Ok(meta
            .labels
            .as_ref()
            .and_then(|l| l.get(&key))
            .cloned()
            .unwrap_or_default());
    }
    if let Some(key) = subscript("metadata.annotations") {
        return Ok(meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(&key))
            .cloned()
            .unwrap_or_default());
    }
    let value = match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" | "status.podIPs" | "status.hostIP" | "status.hostIPs" => {
            // kwok assigns the IPs when it marks the pod Running.
            let pod = wait_pod(pod_rx, KWOK_WAIT, |p| {
                p.status.as_ref().is_some_and(|s| s.pod_ip.is_some())
            })
            .await
            .ok_or_else(|| anyhow!("no {path} yet (kwok has not marked the pod Running)"))?;
            let status = pod.status.clone().unwrap_or_default();
            let ips = |list: Option<Vec<String>>| list.map(|l| l.join(","));
            match path {
                "status.podIP" => status.pod_ip,
                "status.podIPs" => ips(status
                    .pod_ips
                    .map(|v| v.into_iter().map(|i| i.ip).collect())),
                "status.hostIP" => status.host_ip,
                _ => ips(status
                    .host_ips
                    .map(|v| v.into_iter().map(|i| i.ip).collect())),
            }
        }
        _ => bail!("fieldRef {path} is not supported by the pod runner"),
    };
    Ok(value.unwrap_or_default())
}

/// Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` is a literal `$`,
/// unknown references stay as they are.
fn expand(input: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(end) => {
                    let name = &inner[..end];
                    match vars.get(name) {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&format!("$({name})")),
                    }
                    rest = &inner[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = inner;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// A container path under one of `mounts` (longest first) as the local path; also the value
/// part of `--flag=/path` and `NAME=/path`.
fn rewrite_path(value: &str, mounts: &[(String, PathBuf)]) -> String {
    let under = |v: &str| {
        mounts.iter().find_map(|(mount, local)| {
            let rest = v.strip_prefix(mount.as_str())?;
            (rest.is_empty() || rest.starts_with('/')).then(|| format!("{}{rest}", local.display()))
        })
    };
    if let Some(local) = under(value) {
        return local;
    }
    if let Some((head, tail)) = value.split_once('=') {
        if let Some(local) = under(tail) {
            return format!("{head}={local}");
        }
    }
    value.to_string()
}

fn resolve_program(shared: &Shared, command0: &str) -> anyhow::Result<PathBuf> {
    let base = Path::new(command0)
        .file_name()
        .and_then(|b| b.to_str())
        .unwrap_or(command0);
    if let Some(path) = shared.binaries.get(base) {
        return Ok(path.clone());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(base))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            anyhow!(
                "command {command0:?}: {base:?} is neither in the runner's binaries nor on PATH"
            )
        })
}

/// Writes the container's configMap/secret volumes, creates its emptyDirs; returns
/// (mountPath, local path) pairs, longest mount path first.
async fn materialize_volumes(
    src: &mut Sources<'_>,
    pod: &Pod,
    c: &Container,
    root: &Path,
) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let volumes = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    let mut mounts = Vec::new();
    // Parents first: writing a volume replaces its dir, which would wipe a nested mount.
    let mut wanted: Vec<_> = c.volume_mounts.iter().flatten().collect();
    wanted.sort_by_key(|m| m.mount_path.len());
    for m in wanted {
        let mount_path = m.mount_path.trim_end_matches('/').to_string();
        if mount_path.is_empty() {
            continue;
        }
        let Some(vol) = volumes.iter().find(|v| v.name == m.name) else {
            bail!("volume mount {:?}: no volume of that name", m.name);
        };
        // With a subPath the volume lives apart and only a part of it is "mounted".
        let sub_path = m.sub_path.as_deref().filter(|s| !s.is_empty());
        let dir = match sub_path {
            Some(_) => root.join(".volumes").join(&vol.name),
            None => root.join(mount_path.trim_start_matches('/')),
        };
        let contents = if let Some(cm) = &vol.config_map {
            let mode = cm.default_mode;
            Some((
                "configmap",
                cm.name.clone(),
                cm.items.clone(),
                cm.optional == Some(true),
                mode,
            ))
        } else if let Some(s) = &vol.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            Some((
                "secret",
                name,
                s.items.clone(),
                s.optional == Some(true),
                s.default_mode,
            ))
        } else if vol.empty_dir.is_some() {
            None
        } else if vol.name.starts_with("kube-api-access-") {
            // The service account token every pod gets: nothing here uses it.
            continue;
        } else {
            eprintln!(
                "[pod-runner {}/{}] volume {:?}: type not supported, ignored",
                src.shared.namespace,
                pod.metadata.name.as_deref().unwrap_or_default(),
                vol.name
            );
            continue;
        };
        match contents {
            // emptyDir: kept across restarts, like the kubelet does.
            None => fs::create_dir_all(&dir)?,
            Some((kind, name, items, optional, mode)) => {
                let data = match src.get(kind, &name).await? {
                    Some(data) => data,
                    None if optional => BTreeMap::new(),
                    None => bail!("volume {:?}: {kind} {name:?} not found", vol.name),
                };
                write_volume(&dir, kind, &data, items.as_deref(), optional, mode)
                    .with_context(|| format!("volume {:?}", vol.name))?;
            }
        }
        let local = match sub_path {
            Some(sub) => dir.join(sub),
            None => dir,
        };
        mounts.push((mount_path, local));
    }
    mounts.sort_by_key(|(m, _)| std::cmp::Reverse(m.len()));
    Ok(mounts)
}

/// Replaces `dir` with the keys of a Secret/ConfigMap as files (or just `items`).
fn write_volume(
    dir: &Path,
    kind: &str,
    data: &KeyData,
    items: Option<&[KeyToPath]>,
    optional: bool,
    default_mode: Option<i32>,
) -> anyhow::Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir)?;
    }
    fs::create_dir_all(dir)?;
    let files: Vec<(String, &Vec<u8>, Option<i32>)> = match items {
        None => data.iter().map(|(k, v)| (k.clone(), v, None)).collect(),
        Some(items) => {
            let mut files = Vec::new();
            for item in items {
                match data.get(&item.key) {
                    Some(v) => files.push((item.path.clone(), v, item.mode)),
                    None if optional => {}
                    None => bail!("{kind} references non-existent key: {}", item.key),
                }
            }
            files
        }
    };
    for (path, bytes, mode) in files {
        let file = dir.join(&path);
        if let Some(parent) = file.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::write(&file, bytes)?;
        let mode = mode.or(default_mode).unwrap_or(0o644);
        fs::set_permissions(
            &file,
            fs::Permissions::from_mode(u32::try_from(mode).unwrap_or(0o644)),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_like_kubernetes() {
        let vars: BTreeMap<String, String> = [("A".to_string(), "x".to_string())].into();
        assert_eq!(
            expand("$(A)-$(B)-$$(A)-$$-$x-$(", &vars),
            "x-$(B)-$(A)-$-$x-$("
        );
        assert_eq!(expand("pre$(A)post", &vars), "prexpost");
    }

    #[test]
    fn rewrites_paths_under_mounts() {
        let mounts = vec![
            ("/etc/app/sub".to_string(), PathBuf::from("/l/sub")),
            ("/etc/app".to_string(), PathBuf::from("/l/app")),
        ];
        assert_eq!(rewrite_path("/etc/app/x.yaml", &mounts), "/l/app/x.yaml");
        assert_eq!(rewrite_path("/etc/app", &mounts), "/l/app");
        assert_eq!(rewrite_path("/etc/app/sub/y", &mounts), "/l/sub/y");
        assert_eq!(
            rewrite_path("--config=/etc/app/x", &mounts),
            "--config=/l/app/x"
        );
        assert_eq!(rewrite_path("/etc/apple", &mounts), "/etc/apple");
        assert_eq!(rewrite_path("echo /etc/app/x", &mounts), "echo /etc/app/x");
    }
}
