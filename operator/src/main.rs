//! `perspective-operator`: the Kubernetes operator for `PerspectiveDeployment` resources.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use kube::Client;
use perspective_operator::controller;
use perspective_operator::crd::crd_yaml;
use perspective_operator::events::Publisher;
use perspective_operator::lag::LagReader;
use perspective_operator::leader::{self, Election};
use perspective_operator::metrics::OperatorMetrics;
use perspective_operator::pod_policy::PodPolicy;
use perspective_operator::reconcile::{Context, Options};
use perspective_operator::webhook;
use perspective_operator::webhook::tls::Certificate;
use perspective_worker::engine::http::Readiness;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// Runs perspective workers on Kubernetes: each PerspectiveDeployment (perspectives.dev/v1alpha1)
/// becomes a ConfigMap, a migration Job, a worker StatefulSet, a headless Service and a
/// PodDisruptionBudget, with Ready / MigrationsApplied / Progressing / Degraded /
/// ReconciliationPaused conditions and lag read from the database.
///
/// Install: `perspective-operator crd | kubectl apply --server-side -f -` (or `helm install`
/// the chart in charts/perspective-operator), then create a PerspectiveDeployment and
/// `kubectl wait --for=condition=Ready pd/NAME`.
#[derive(Parser)]
#[command(name = "perspective-operator", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile PerspectiveDeployments (uses KUBECONFIG, or the in-cluster service account).
    Run(Box<RunArgs>),
    /// Print the CustomResourceDefinition YAML (what crds/ and the Helm chart hold).
    Crd,
    /// Print the CRD and config reference as Markdown (what docs/reference/crd.md holds).
    CrdReference,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Address of /livez, /readyz and /metrics; port 0 picks a free port (logged).
    #[arg(
        long,
        env = "PERSPECTIVE_OPERATOR_HTTP_ADDR",
        default_value = "0.0.0.0:8080"
    )]
    http_addr: SocketAddr,
    /// Only watch this namespace (default: all namespaces).
    #[arg(long, env = "WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Worker image for deployments whose spec has no `image` (default: the one `make images`
    /// builds).
    #[arg(long, env = "DEFAULT_WORKER_IMAGE", default_value = concat!("localhost/perspective-worker:", env!("CARGO_PKG_VERSION")))]
    default_worker_image: String,
    /// Run only worker images that start with this prefix (repeatable; default: any image). A
    /// deployment with another image (or the default one) is `Degraded` `InvalidSpec` and gets no
    /// child. The image runs with the deployment's database Secret: list only images you trust,
    /// ending prefixes with `:` or `@` or `/` so that `repo` does not also allow `repo-evil`.
    #[arg(long = "allowed-image-prefix", value_name = "PREFIX")]
    allowed_image_prefixes: Vec<String>,
    /// A priority class deployments may name in `spec.priorityClassName` (repeatable; default:
    /// none, so worker pods get the cluster's default priority). Any other is `InvalidSpec`.
    #[arg(long = "allowed-priority-class", value_name = "NAME")]
    allowed_priority_classes: Vec<String>,
    /// A service account deployments may name in `spec.serviceAccountName` besides `default`
    /// (repeatable; default: only `default`). Any other is `InvalidSpec`.
    #[arg(long = "allowed-service-account", value_name = "NAME")]
    allowed_service_accounts: Vec<String>,
    /// Give worker and migration pods AppArmor `RuntimeDefault` (pod securityContext). Only
    /// when every node runs AppArmor: kubelet refuses such pods on a node without it.
    #[arg(long)]
    apparmor_runtime_default: bool,
    /// How often each deployment's status (lag, dead letters) is refreshed from its database.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    status_interval_seconds: u64,
    /// Seconds before a failed migration Job is run again; doubles with each failure, up to 20×.
    /// Also the wait between reruns of a migration whose schema has gone from the database (the
    /// first rerun is immediate).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    migration_retry_seconds: u64,
    /// Only the holder of a coordination.k8s.io Lease reconciles (for more than one replica).
    #[arg(long)]
    leader_election: bool,
    /// Name of the leader Lease.
    #[arg(long, default_value = "perspective-operator")]
    lease_name: String,
    /// Namespace of the leader Lease (default: $POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// Seconds a leader's lease lasts without renewal; a dead leader is replaced after this.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..))]
    lease_seconds: u64,
    /// This replica's identity in the Lease and in Events (default: $POD_NAME, else host and pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Serve the validating admission webhook (`POST /validate-perspectivedeployment`, HTTPS) on
    /// this address, with --webhook-cert-dir; port 0 picks a free port (logged). Every replica
    /// serves it, leader or not. Default: no webhook (invalid specs are then reported only in
    /// status, as `Degraded` `InvalidSpec`).
    #[arg(
        long,
        env = "PERSPECTIVE_OPERATOR_WEBHOOK_ADDR",
        requires = "webhook_cert_dir"
    )]
    webhook_addr: Option<SocketAddr>,
    /// Directory with the webhook's serving certificate: `tls.crt` (chain, PEM) and `tls.key`
    /// (PEM), e.g. a mounted kubernetes.io/tls Secret; re-read when the files change.
    #[arg(
        long,
        env = "PERSPECTIVE_OPERATOR_WEBHOOK_CERT_DIR",
        requires = "webhook_addr"
    )]
    webhook_cert_dir: Option<std::path::PathBuf>,
    /// Log format (default: json when stderr is not a terminal).
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", crd_yaml());
            ExitCode::SUCCESS
        }
        Command::CrdReference => {
            print!("{}", perspective_operator::reference::crd_reference());
            ExitCode::SUCCESS
        }
        Command::Run(args) => {
            init_tracing(args.log_format);
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(run(*args)) {
                Ok(code) => code,
                Err(e) => {
                    error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let client = Client::try_default()
        .await
        .context("cannot configure a Kubernetes client (KUBECONFIG or in-cluster)")?;
    let metrics = Arc::new(OperatorMetrics::new());
    let readiness = Readiness::new("connecting to the API server");
    // The worker's endpoints: /livez, /readyz (ready once the API server answered; a standby
    // replica is ready too, so rollouts do not wait on leadership) and /metrics.
    let (bound, _server) = perspective_worker::engine::http::serve(
        args.http_addr,
        readiness.clone(),
        metrics.clone(),
        shutdown.clone(),
    )
    .await?;
    info!(addr = %bound, "serving /livez /readyz /metrics");

    let options = options(&args);
    if let (Some(addr), Some(dir)) = (args.webhook_addr, &args.webhook_cert_dir) {
        let certificate = Certificate::load(dir).await?;
        let (bound, _webhook) =
            webhook::server::serve(addr, certificate, options.clone(), shutdown.clone()).await?;
        info!(webhook_addr = %bound, "serving the admission webhook");
    }

    let api = controller::deployments_api(client.clone(), args.watch_namespace.as_deref());
    controller::check_crd(&api).await?;
    readiness.set_ready();

    let leadership = if args.leader_election {
        let namespace = args
            .lease_namespace
            .clone()
            .context("--leader-election needs --lease-namespace (or POD_NAMESPACE)")?;
        let election = Election {
            lease_name: args.lease_name.clone(),
            namespace,
            identity: identity.clone(),
            lease_seconds: args.lease_seconds,
        };
        match leader::acquire(client.clone(), &election, &shutdown).await? {
            Some(l) => Some(l),
            None => return Ok(ExitCode::SUCCESS),
        }
    } else {
        None
    };
    metrics.leader.set(1);

    let stop = shutdown.child_token();
    if let Some(l) = &leadership {
        let (lost, stop) = (l.lost.clone(), stop.clone());
        tokio::spawn(async move {
            lost.cancelled().await;
            stop.cancel();
        });
    }
    let ctx = Arc::new(Context {
        client: client.clone(),
        events: Publisher::new(client, "perspective-operator", &identity),
        metrics: metrics.clone(),
        options,
        lag: LagReader::default(),
    });
    info!(
        namespace = perspective_operator::controller::scope(args.watch_namespace.as_deref()),
        "reconciling PerspectiveDeployments"
    );
    controller::run(ctx, args.watch_namespace, stop).await;
    metrics.leader.set(0);

    match leadership {
        Some(l) if l.lost.is_cancelled() => {
            error!("lost the leader lease; exiting so a fresh process rejoins the election");
            Ok(ExitCode::FAILURE)
        }
        Some(l) => {
            l.release().await;
            info!("stopped");
            Ok(ExitCode::SUCCESS)
        }
        None => {
            info!("stopped");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The reconciler's (and the webhook's) settings from the flags.
fn options(args: &RunArgs) -> Options {
    Options {
        default_worker_image: args.default_worker_image.clone(),
        status_interval: Duration::from_secs(args.status_interval_seconds),
        migration_retry_base: Duration::from_secs(args.migration_retry_seconds),
        allowed_image_prefixes: args.allowed_image_prefixes.clone(),
        pod_policy: PodPolicy {
            priority_classes: args.allowed_priority_classes.clone(),
            service_accounts: args.allowed_service_accounts.clone(),
        },
        app_armor_runtime_default: args.apparmor_runtime_default,
    }
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "operator".to_owned());
    format!("{host}-{}", std::process::id())
}

fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: finishing in-flight reconciles"),
            _ = tokio::signal::ctrl_c() => info!("SIGINT: finishing in-flight reconciles"),
        }
        shutdown.cancel();
    });
}

fn init_tracing(format: Option<LogFormat>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Text) => false,
        None => !std::io::stderr().is_terminal(),
    };
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
