//! Shared code of the operator's e2e tests; include it with `mod support;`.
//!
//! E2e tests run inside `tests/e2e/with-control-plane.sh`, which provides `KUBECONFIG` and
//! `E2E_DIR`; [`e2e`] fails the test with instructions when they are missing, so an e2e
//! test never passes without having run.

// Each test binary uses only part of this.
#![allow(dead_code)]

pub mod pod_runner;
pub mod real_node;

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use kube::Client;
use serde_json::json;

/// The control plane of this test run.
pub struct E2e {
    pub client: Client,
    /// `$E2E_DIR`: the control plane's dir; put test output (pod logs) under it.
    pub dir: PathBuf,
}

/// Connects to the control plane of `with-control-plane.sh`; panics (failing the test) with
/// the command to use when the test was not started through it.
pub async fn e2e() -> E2e {
    let (Some(kubeconfig), Some(dir)) =
        (std::env::var_os("KUBECONFIG"), std::env::var_os("E2E_DIR"))
    else {
        let test = std::env::args()
            .next()
            .and_then(|exe| {
                let stem = PathBuf::from(exe).file_stem()?.to_str()?.to_string();
                // target/debug/deps/NAME-HASH
                Some(
                    stem.rsplit_once('-')
                        .map_or(stem.clone(), |(name, _)| name.to_string()),
                )
            })
            .unwrap_or_else(|| "NAME".into());
        panic!(
            "this e2e test needs a control plane (KUBECONFIG and E2E_DIR are not set): run it via \
             `tests/e2e/with-control-plane.sh cargo test -p perspective-operator --test {test}`"
        );
    };
    let client = Client::try_default().await.unwrap_or_else(|e| {
        panic!(
            "no client for KUBECONFIG={}: {e}",
            kubeconfig.to_string_lossy()
        )
    });
    E2e {
        client,
        dir: PathBuf::from(dir),
    }
}

/// Polls `f` every 100 ms until it returns `Some`; fails after `timeout` with `what` and the
/// last error `f` returned, if any.
pub async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match f().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if tokio::time::Instant::now() >= deadline {
            match last_error {
                Some(e) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates a namespace named `PREFIX<random>` and waits for its `default` ServiceAccount
/// (pods are refused until it exists).
pub async fn fresh_namespace(client: &Client, prefix: &str) -> anyhow::Result<String> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"generateName": prefix}}))?;
    let ns = namespaces
        .create(&PostParams::default(), &ns)
        .await
        .context("creating a namespace")?;
    let name = ns.metadata.name.context("namespace without name")?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    poll(
        &format!("serviceaccount {name}/default"),
        Duration::from_secs(30),
        || async { Ok(accounts.get_opt("default").await?.map(|_| ())) },
    )
    .await?;
    Ok(name)
}

/// Deletes a namespace without waiting for it to go (the control plane is thrown away).
pub async fn delete_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.delete(name, &DeleteParams::default()).await?;
    Ok(())
}

/// The URL of the test PostgreSQL (`tests/pg/pg.sh with …` sets `TEST_DATABASE_URL`).
pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL").expect(
        "TEST_DATABASE_URL is not set: run through `tests/pg/pg.sh with tests/e2e/with-control-plane.sh cargo test ...`",
    )
}

/// Runs kubectl (from PATH, as the e2e wrapper sets it up) with optional stdin.
pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new("kubectl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl on PATH (run via tests/e2e/with-control-plane.sh)");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

/// [`kubectl`], failing the test unless it succeeds; returns its stdout.
pub fn kubectl_ok(args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl(args, stdin);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The Kubernetes release `tests/e2e/build-bins.sh` builds (its bin dir is keyed by it).
pub const K8S_VERSION: &str = "v1.36.3";

/// The repository's root (the parent of `operator/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("operator/ has a parent")
        .to_path_buf()
}

/// `name` from PATH (the e2e wrapper puts the built binaries there), else from the cache that
/// `tests/e2e/build-bins.sh` fills.
pub fn tool(name: &str) -> PathBuf {
    if let Some(found) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
    {
        return found;
    }
    let cache = std::env::var_os("PERSPECTIVE_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/perspective-operator"))
        })
        .expect("neither PERSPECTIVE_CACHE nor HOME is set");
    let fallback = cache.join("k8s").join(K8S_VERSION).join("bin").join(name);
    assert!(
        fallback.is_file(),
        "{name} is neither on PATH nor at {}: run tests/e2e/build-bins.sh",
        fallback.display()
    );
    fallback
}

/// The `perspective-worker` binary cargo built next to this test binary
/// (target/debug/deps/TEST-HASH -> target/debug/perspective-worker).
pub fn worker_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("perspective-worker");
    assert!(
        path.is_file(),
        "{} is missing: build it first (`cargo build -p perspective-worker`; `make test` does)",
        path.display()
    );
    path
}
