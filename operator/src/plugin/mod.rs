//! `kubectl pd`: a kubectl plugin for day two with a `PerspectiveDeployment`, through the
//! Kubernetes API only (the user's kubeconfig; never database credentials).
//!
//! - [`render`]: what `status` and `dead-letters list` print (pure)
//! - [`action`]: replay/discard/rebuild: set the annotation, then follow `status.lastAction`
//! - here: the command line and the reads (the deployment, its pods, logs)

pub mod action;
pub mod render;

use std::time::Duration;

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, LogParams};
use kube::Client;

use crate::action_job::Action;
use crate::crd::PerspectiveDeployment;
use crate::labels;
use render::LogTail;

/// How long one API call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Parser, Debug)]
#[command(
    name = "kubectl pd",
    bin_name = "kubectl pd",
    version,
    about = "Day two with a PerspectiveDeployment from kubectl: status, dead letters, rebuilds \
             and logs, through the Kubernetes API only (no database credentials, no exec).",
    after_help = "Examples:\n  \
      kubectl pd status shop\n  \
      kubectl pd dead-letters list shop order_summary\n  \
      kubectl pd dead-letters replay shop order_summary\n  \
      kubectl pd dead-letters discard shop all --no-wait\n  \
      kubectl pd rebuild shop order_summary\n  \
      kubectl pd logs shop --tail 50\n\n\
      Install: put the kubectl-pd binary on your PATH (kubectl finds plugins by name)."
)]
pub struct Cli {
    /// Namespace of the deployment (default: the kubeconfig context's).
    #[arg(short, long, global = true)]
    pub namespace: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// A summary of one deployment: conditions, per-perspective phase, lag and dead letters,
    /// worker pods, the last migration and day-2 action, and the tail of their Jobs' logs.
    ///
    /// Example: kubectl pd status shop
    Status {
        /// The PerspectiveDeployment.
        name: String,
    },
    /// List, replay or discard dead letters.
    #[command(subcommand)]
    DeadLetters(DeadLetters),
    /// Rebuild a perspective from the event store (its tables reset and replayed, online):
    /// sets the annotation perspectives.dev/rebuild and waits for the outcome.
    ///
    /// Example: kubectl pd rebuild shop order_summary
    Rebuild {
        /// The PerspectiveDeployment.
        name: String,
        perspective: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Switch PERSPECTIVE (or `all`) to its new blue/green version once it has caught up, as the
    /// owner role: for workers whose role may not switch (`status` shows the perspective
    /// `Switching` then). Sets the annotation perspectives.dev/switch and waits for the outcome.
    ///
    /// Example: kubectl pd switch shop order_summary
    Switch {
        /// The PerspectiveDeployment.
        name: String,
        /// A perspective, or `all`.
        perspective: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// The logs of the deployment's worker pods (each pod's last lines).
    ///
    /// Example: kubectl pd logs shop --tail 100
    Logs {
        /// The PerspectiveDeployment.
        name: String,
        /// Lines per pod.
        #[arg(long, default_value_t = 20)]
        tail: i64,
    },
}

#[derive(Subcommand, Debug)]
pub enum DeadLetters {
    /// The newest dead letters per perspective (up to 3 each) and the counts, from status.
    ///
    /// Example: kubectl pd dead-letters list shop order_summary
    List {
        /// The PerspectiveDeployment.
        name: String,
        /// Only this perspective's.
        perspective: Option<String>,
    },
    /// Re-apply the pending dead letters of PERSPECTIVE (or `all`) through the fixed handler:
    /// sets the annotation perspectives.dev/replay-dead-letters and waits for the outcome.
    ///
    /// Example: kubectl pd dead-letters replay shop order_summary
    Replay {
        /// The PerspectiveDeployment.
        name: String,
        /// A perspective, or `all`.
        perspective: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Mark the pending dead letters of PERSPECTIVE (or `all`) discarded: never applied. Sets
    /// the annotation perspectives.dev/discard-dead-letters and waits for the outcome.
    ///
    /// Example: kubectl pd dead-letters discard shop all
    Discard {
        /// The PerspectiveDeployment.
        name: String,
        /// A perspective, or `all`.
        perspective: String,
        #[command(flatten)]
        wait: Wait,
    },
}

/// Whether and how long to wait for an action's outcome.
#[derive(clap::Args, Debug, Clone)]
pub struct Wait {
    /// Return once the annotation is set; `kubectl pd status` shows the outcome later.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (the action goes on).
    #[arg(long, default_value_t = 600)]
    pub timeout_seconds: u64,
}

/// Runs `cli`; the exit code is 0 on success, 1 when an action failed or was refused.
pub async fn run(cli: Cli) -> anyhow::Result<bool> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| anyhow::anyhow!("cannot read the kubeconfig: {e}"))?;
    let namespace = cli
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config)?;
    let pds: Api<PerspectiveDeployment> = Api::namespaced(client.clone(), &namespace);
    match cli.command {
        Command::Status { name } => {
            let pd = get(&pds, &name).await?;
            let pods = worker_pods(&client, &namespace, &name).await?;
            let logs = job_logs(&client, &namespace, &pd).await;
            print!("{}", render::status(&pd, &pods, &logs));
            Ok(true)
        }
        Command::DeadLetters(DeadLetters::List { name, perspective }) => {
            let pd = get(&pds, &name).await?;
            print!("{}", render::dead_letters(&pd, perspective.as_deref()));
            Ok(true)
        }
        Command::DeadLetters(DeadLetters::Replay {
            name,
            perspective,
            wait,
        }) => action::ask(&pds, &name, Action::ReplayDeadLetters, &perspective, &wait).await,
        Command::DeadLetters(DeadLetters::Discard {
            name,
            perspective,
            wait,
        }) => action::ask(&pds, &name, Action::DiscardDeadLetters, &perspective, &wait).await,
        Command::Rebuild {
            name,
            perspective,
            wait,
        } => action::ask(&pds, &name, Action::Rebuild, &perspective, &wait).await,
        Command::Switch {
            name,
            perspective,
            wait,
        } => action::ask(&pds, &name, Action::Switch, &perspective, &wait).await,
        Command::Logs { name, tail } => {
            get(&pds, &name).await?;
            let pods = worker_pods(&client, &namespace, &name).await?;
            if pods.is_empty() {
                println!("no worker pods for {name}");
            }
            let api: Api<Pod> = Api::namespaced(client, &namespace);
            for pod in pods {
                let pod_name = pod.metadata.name.unwrap_or_default();
                println!("==> pod/{pod_name} <==");
                match log_tail(&api, &pod_name, tail).await {
                    Ok(text) => print!("{text}"),
                    Err(e) => println!("(not available: {e})"),
                }
            }
            Ok(true)
        }
    }
}

/// The deployment, or an error naming it and the namespace.
pub async fn get(
    pds: &Api<PerspectiveDeployment>,
    name: &str,
) -> anyhow::Result<PerspectiveDeployment> {
    match tokio::time::timeout(CALL_TIMEOUT, pds.get_opt(name)).await {
        Err(_) => anyhow::bail!("no answer from the API server within {CALL_TIMEOUT:?}"),
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "reading PerspectiveDeployment {name}: {}",
            crate::reconcile::describe(&e)
        )),
        Ok(Ok(None)) => anyhow::bail!(
            "PerspectiveDeployment {name} not found in namespace {} (see `kubectl get pd`)",
            pds.namespace().unwrap_or("?")
        ),
        Ok(Ok(Some(pd))) => Ok(pd),
    }
}

/// The worker pods of deployment `name`, by name.
async fn worker_pods(client: &Client, namespace: &str, name: &str) -> anyhow::Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = labels::selector_string(&labels::worker_selector(name));
    let list = tokio::time::timeout(
        CALL_TIMEOUT,
        api.list(&ListParams::default().labels(&selector)),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no answer from the API server within {CALL_TIMEOUT:?}"))?
    .map_err(|e| anyhow::anyhow!("listing worker pods: {}", crate::reconcile::describe(&e)))?;
    let mut pods = list.items;
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(pods)
}

/// The log tails of the migration Job and the last action's Job.
async fn job_logs(client: &Client, namespace: &str, pd: &PerspectiveDeployment) -> Vec<LogTail> {
    let st = pd.status.clone().unwrap_or_default();
    let jobs = [st.migration_job, st.last_action.and_then(|a| a.job)];
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut logs = Vec::new();
    for job in jobs.into_iter().flatten() {
        let text = job_log(&api, &job).await;
        logs.push(LogTail {
            of: format!("job/{job}"),
            text,
        });
    }
    logs
}

/// The last lines of the newest pod of Job `job`.
async fn job_log(api: &Api<Pod>, job: &str) -> Result<String, String> {
    let lp = ListParams::default().labels(&format!("job-name={job}"));
    let pods = tokio::time::timeout(CALL_TIMEOUT, api.list(&lp))
        .await
        .map_err(|_| "no answer from the API server".to_owned())?
        .map_err(|e| crate::reconcile::describe(&e))?
        .items;
    let newest = pods
        .iter()
        .max_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .and_then(|p| p.metadata.name.clone())
        .ok_or_else(|| "its pod is gone".to_owned())?;
    log_tail(api, &newest, 10).await
}

async fn log_tail(api: &Api<Pod>, pod: &str, lines: i64) -> Result<String, String> {
    let lp = LogParams {
        tail_lines: Some(lines),
        ..LogParams::default()
    };
    match tokio::time::timeout(CALL_TIMEOUT, api.logs(pod, &lp)).await {
        Err(_) => Err("no answer from the API server".to_owned()),
        Ok(Err(e)) => Err(crate::reconcile::describe(&e)),
        Ok(Ok(text)) => Ok(text),
    }
}
