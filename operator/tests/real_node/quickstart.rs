//! The README's Kubernetes quickstart, run as it is written: the fenced block after the
//! `<!-- quickstart` marker in README.md, one command per line, with `bash` in the repository
//! root, so the README and what works cannot drift apart.
//!
//! What differs here, and only this (each substitution must match exactly once, so a changed
//! README fails the test instead of silently running something else):
//! - the Secret's URL placeholder `postgres://USER:PASSWORD@HOST:5432/DB` becomes the test
//!   server's URL as the pods reach it (through the node's forward);
//! - `helm install` gets `--set watchNamespace=shop`: the real-node tests share one control
//!   plane, and a cluster-wide operator would also reconcile the other tests' deployments.
//!
//! The images are the ones `with-control-plane.sh --real-node` imports into the node
//! (`images/build.sh` from the debug binaries, named as `make images` names them), which
//! stands for the README's image step. Afterwards `helm uninstall` must leave no Lease behind.

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use sqlx::{Connection, PgConnection};

use super::{helm_ok, retarget};
use crate::support::real_node::{Forward, RealNode};
use crate::support::{database_url, e2e, poll};

const PLACEHOLDER: &str = "postgres://USER:PASSWORD@HOST:5432/DB";
const HELM_INSTALL: &str =
    "helm install perspective-operator charts/perspective-operator -n perspective-system --create-namespace";

fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The commands of the README's quickstart block, in order.
fn quickstart_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let after = readme
        .split_once("<!-- quickstart")
        .expect("README.md has a `<!-- quickstart` marker")
        .1;
    let block = after
        .split_once("```sh\n")
        .expect("a ```sh block after the quickstart marker")
        .1;
    let block = block.split_once("```").expect("the block ends").0;
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// `commands` adapted to this environment (see the module doc).
fn adapt(commands: &[String], pod_url: &str) -> Vec<String> {
    let (mut urls, mut installs) = (0, 0);
    let adapted = commands
        .iter()
        .map(|c| {
            let mut c = c.clone();
            if c.contains(PLACEHOLDER) {
                urls += 1;
                c = c.replace(PLACEHOLDER, pod_url);
            }
            if c == HELM_INSTALL {
                installs += 1;
                c.push_str(" --set watchNamespace=shop");
            }
            c
        })
        .collect();
    assert_eq!(
        (urls, installs),
        (1, 1),
        "the quickstart has one database URL placeholder and one `{HELM_INSTALL}`: {commands:#?}"
    );
    adapted
}

fn run(command: &str) -> String {
    eprintln!("[quickstart] $ {command}");
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", command])
        .current_dir(repo_root())
        .output()
        .expect("bash");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "quickstart command failed: {command}\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{stdout}");
    stdout
}

async fn drop_schema() {
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    sqlx::query("DROP SCHEMA IF EXISTS shop CASCADE")
        .execute(&mut conn)
        .await
        .unwrap();
}

#[test]
fn the_quickstart_block_is_found_and_adapted_only_where_documented() {
    let commands = quickstart_commands();
    assert!(commands
        .iter()
        .any(|c| c.starts_with("kubectl -n shop wait")));
    let adapted = adapt(&commands, "postgres://u@10.0.0.1:5432/db");
    let changed = commands
        .iter()
        .zip(&adapted)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(changed, 2, "only the Secret and the helm install change");
    // docs/quickstart.md repeats the block: it must say the same.
    let docs = std::fs::read_to_string(repo_root().join("docs/quickstart.md")).unwrap();
    for command in &commands {
        assert!(
            docs.contains(command.as_str()),
            "docs/quickstart.md lacks `{command}` of the README's quickstart"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_quickstart_works_verbatim() {
    let env = e2e().await;
    let node = RealNode::from_env();
    let (_, target) = retarget(&database_url(), "127.0.0.1:1".parse().unwrap());
    let pg = Forward::start(&node.ip, target).await.unwrap();
    let (pod_url, _) = retarget(&database_url(), pg.addr);
    drop_schema().await;

    let commands = adapt(&quickstart_commands(), &pod_url);
    let mut last = String::new();
    for command in &commands {
        last = run(command);
    }
    // The last command is `kubectl -n shop get pd`: the deployment is Ready.
    let row = last
        .lines()
        .find(|l| l.starts_with("shop "))
        .unwrap_or_else(|| panic!("no row for shop in:\n{last}"));
    let columns: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(columns[1], "True", "READY: {row}");

    // It serves: an event appended with SQL is applied.
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    sqlx::query(
        "SELECT * FROM shop.append_events(gen_random_uuid(), 0, jsonb_build_array(jsonb_build_object(\
         'event_type', 'OrderPlaced', 'event_data', jsonb_build_object('customer', 'ada', 'total', 12, \
         'items', jsonb_build_array(jsonb_build_object('qty', 2))))))",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    poll("the order applied", Duration::from_secs(60), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM shop.order_summary")
            .fetch_one(&mut PgConnection::connect(&database_url()).await?)
            .await?;
        Ok((n == 1).then_some(()))
    })
    .await
    .unwrap();

    // `helm uninstall` leaves no Lease behind (the chart owns it), also once its pods are gone.
    helm_ok(&[
        "uninstall",
        "perspective-operator",
        "-n",
        "perspective-system",
        "--wait",
    ]);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), "perspective-system");
    poll(
        "the operator pods gone",
        Duration::from_secs(90),
        || async {
            Ok(pods
                .list(&ListParams::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        },
    )
    .await
    .unwrap();
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), "perspective-system");
    let left: Vec<String> = leases
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|l| l.metadata.name)
        .collect();
    assert!(
        left.is_empty(),
        "helm uninstall left Leases behind: {left:?}"
    );

    for ns in ["shop", "perspective-system"] {
        let _ = crate::support::delete_namespace(&env.client, ns).await;
    }
    drop_schema().await;
}
