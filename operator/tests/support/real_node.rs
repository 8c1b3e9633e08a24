//! The real kubelet node of `tests/e2e/with-control-plane.sh --real-node` (tests/e2e/node.sh):
//! its address, a TCP forwarder that lets pods reach a loopback server through the node
//! address, and a look at a container's process from the host (`/proc`), which is how a test
//! proves what the kubelet and runc really enforced.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use k8s_openapi::api::core::v1::Pod;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The node started by `with-control-plane.sh --real-node`.
pub struct RealNode {
    pub name: String,
    /// The node's address: the gateway of the pods' bridge.
    pub ip: String,
}

impl RealNode {
    /// From the environment `with-control-plane.sh --real-node` exports; panics (failing the
    /// test) with the command to use otherwise.
    pub fn from_env() -> RealNode {
        match (std::env::var("E2E_NODE_NAME"), std::env::var("E2E_NODE_IP")) {
            (Ok(name), Ok(ip)) => RealNode { name, ip },
            _ => panic!(
                "this test needs a real kubelet node (E2E_NODE_NAME/E2E_NODE_IP are not set): run \
                 it via `tests/pg/pg.sh with tests/e2e/with-control-plane.sh --real-node cargo \
                 test -p perspective-operator --test real_node`"
            ),
        }
    }
}

/// Forwards TCP connections from `listen` to `target` until dropped: pods reach PostgreSQL on
/// loopback through the node address this way (the server itself listens on 127.0.0.1 only).
pub struct Forward {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Forward {
    pub async fn start(listen_ip: &str, target: SocketAddr) -> anyhow::Result<Forward> {
        let listener = TcpListener::bind((listen_ip, 0))
            .await
            .with_context(|| format!("bind {listen_ip}:0 for the forwarder"))?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Forward { addr, task })
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The host PID of the main process of `pod`'s container `container` (found through the
/// container's cgroup, which the kubelet names after the pod UID and containerd after the
/// container id).
pub fn container_pid(pod: &Pod, container: &str) -> anyhow::Result<u32> {
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == container))
        .with_context(|| format!("no status for container {container}"))?;
    let id = status
        .container_id
        .as_deref()
        .and_then(|id| id.strip_prefix("containerd://"))
        .with_context(|| format!("container {container} has no containerd id yet"))?;
    let dir = find_dir(Path::new("/sys/fs/cgroup/pids/kubepods"), id)?
        .with_context(|| format!("no cgroup named {id} under /sys/fs/cgroup/pids/kubepods"))?;
    let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
    let pids: Vec<u32> = procs
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    // The container's init is the process whose parent is outside the cgroup (the shim).
    for pid in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let ppid: u32 = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .context("parse /proc/PID/stat")?;
        if !pids.contains(&ppid) {
            return Ok(*pid);
        }
    }
    bail!("no process in the cgroup of container {container} ({id})")
}

fn find_dir(root: &Path, name: &str) -> anyhow::Result<Option<PathBuf>> {
    for entry in std::fs::read_dir(root).with_context(|| format!("read {}", root.display()))? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        if entry.file_name() == name {
            return Ok(Some(entry.path()));
        }
        if let Some(found) = find_dir(&entry.path(), name)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// What the kernel says about a container's process: the facts the pod security settings
/// (`runAsNonRoot`, `readOnlyRootFilesystem`, dropped capabilities, no privilege escalation)
/// must produce.
#[derive(Debug)]
pub struct ProcessFacts {
    pub uid: u32,
    pub gid: u32,
    /// Effective capability set (hex mask).
    pub cap_eff: u64,
    pub no_new_privs: bool,
    /// The container's root filesystem is mounted read-only.
    pub root_read_only: bool,
    /// Writable mounts other than the kernel's (/proc, /sys, /dev ...) — the emptyDirs.
    pub writable_mounts: Vec<String>,
}

pub fn process_facts(pid: u32) -> anyhow::Result<ProcessFacts> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    let first = |v: String| -> anyhow::Result<u32> {
        Ok(v.split_whitespace().nth(1).context("uid/gid")?.parse()?)
    };
    let uid = first(field("Uid:")?)?;
    let gid = first(field("Gid:")?)?;
    let cap_eff = u64::from_str_radix(&field("CapEff:")?, 16)?;
    let no_new_privs = field("NoNewPrivs:")? == "1";
    // /proc/PID/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPER".
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let mut root_read_only = false;
    let mut writable_mounts = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(mount_point), Some(options)) = (fields.get(4), fields.get(5)) else {
            continue;
        };
        let read_only = options.split(',').any(|o| o == "ro");
        if *mount_point == "/" {
            root_read_only = read_only;
        } else if !read_only
            && !["/proc", "/sys", "/dev"]
                .iter()
                .any(|k| mount_point == k || mount_point.starts_with(&format!("{k}/")))
        {
            writable_mounts.push((*mount_point).to_owned());
        }
    }
    Ok(ProcessFacts {
        uid,
        gid,
        cap_eff,
        no_new_privs,
        root_read_only,
        writable_mounts,
    })
}
