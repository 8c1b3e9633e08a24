//! What `kubectl pd status` and `kubectl pd dead-letters list` print, from the deployment's
//! status and its pods. Pure.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::crd::{LastAction, PerspectiveDeployment};

/// Columns padded to their widest cell, two spaces apart, no trailing spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            out.push_str(cell);
            if i + 1 < cells.len() {
                out.push_str(&" ".repeat(w - cell.chars().count() + 2));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// A log (or why it could not be read) for the summary: its last lines, indented.
#[derive(Debug, Clone)]
pub struct LogTail {
    /// What it is the log of, e.g. `job/shop-replay-1a2b…`.
    pub of: String,
    pub text: Result<String, String>,
}

/// The CloudNativePG-style summary of one deployment.
pub fn status(pd: &PerspectiveDeployment, pods: &[Pod], logs: &[LogTail]) -> String {
    let st = pd.status.clone().unwrap_or_default();
    let mut out = header(pd);
    out.push_str("\nConditions:\n");
    let rows: Vec<Vec<String>> = st
        .conditions
        .iter()
        .map(|c| {
            vec![
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.message.clone(),
            ]
        })
        .collect();
    out.push_str(&indent(&table(
        &["TYPE", "STATUS", "REASON", "MESSAGE"],
        &rows,
    )));
    out.push_str("\nPerspectives:\n");
    out.push_str(&indent(&perspectives(&st)));
    if st.perspectives.iter().any(|p| p.dead_letters > 0) {
        out.push_str("\nDead letters (the newest 3 of each perspective):\n");
        out.push_str(&indent(&dead_letters(pd, None)));
    }
    out.push_str("\nPods:\n");
    let rows: Vec<Vec<String>> = pods.iter().map(pod_row).collect();
    out.push_str(&indent(&table(
        &["NAME", "READY", "PHASE", "RESTARTS"],
        &rows,
    )));
    out.push_str(&format!(
        "\nLast action:    {}\n",
        last_action(st.last_action.as_ref())
    ));
    for log in logs {
        out.push_str(&format!("\nLog of {} (last lines):\n", log.of));
        match &log.text {
            Ok(text) if text.trim().is_empty() => out.push_str("    (empty)\n"),
            Ok(text) => out.push_str(&indent(text)),
            Err(e) => out.push_str(&format!("    (not available: {e})\n")),
        }
    }
    out
}

/// The name and the deployment's figures, one per line.
fn header(pd: &PerspectiveDeployment) -> String {
    let st = pd.status.clone().unwrap_or_default();
    let or_unknown = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    let mut out = format!(
        "PerspectiveDeployment {} (namespace {})\n",
        pd.name_any(),
        pd.namespace().unwrap_or_default()
    );
    let image = pd
        .spec
        .image
        .clone()
        .unwrap_or_else(|| "(operator default)".to_owned());
    let fields = [
        ("Status", or_unknown(st.summary.clone())),
        ("Schema", pd.spec.schema.clone()),
        ("Image", image),
        ("Replicas", or_unknown(st.replicas_summary.clone())),
        (
            "Database",
            st.database.map_or("-".to_owned(), |d| format!("{d:?}")),
        ),
        ("Lag", or_unknown(st.lag.clone())),
        (
            "Pending events",
            or_unknown(st.pending_events.map(|n| n.to_string())),
        ),
        (
            "Dead letters",
            or_unknown(st.dead_letters.map(|n| n.to_string())),
        ),
        (
            "Migration Job",
            st.migration_job.clone().map_or("-".to_owned(), |j| {
                format!("{j} (failures: {})", st.migration_failures)
            }),
        ),
    ];
    for (k, v) in fields {
        out.push_str(&format!("{:<16}{v}\n", format!("{k}:")));
    }
    out
}

/// The per-perspective table: phase (with progress), pending, lag, failures, dead letters.
fn perspectives(st: &crate::crd::PerspectiveDeploymentStatus) -> String {
    let rows: Vec<Vec<String>> = st
        .perspectives
        .iter()
        .map(|p| {
            let phase = match &p.progress {
                Some(progress) => format!("{} {}%", p.phase.as_str(), progress.percent),
                None => p.phase.as_str().to_owned(),
            };
            vec![
                p.name.clone(),
                phase,
                p.pending_events.to_string(),
                p.oldest_pending_seconds
                    .map_or("0s".to_owned(), crate::status::format_lag),
                p.failed_streams.to_string(),
                p.dead_letters.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "PHASE",
            "PENDING",
            "LAG",
            "FAILED STREAMS",
            "DEAD LETTERS",
        ],
        &rows,
    )
}

/// One line about the last day-2 action, e.g. "perspectives.dev/replay-dead-letters
/// order_summary: Succeeded (Job shop-replay-…): replayed the dead letters of order_summary".
pub fn last_action(a: Option<&LastAction>) -> String {
    match a {
        None => "none".to_owned(),
        Some(a) => {
            let job = a
                .job
                .as_ref()
                .map_or(String::new(), |j| format!(" (Job {j})"));
            format!(
                "{} {}: {}{job}, started {}: {}",
                a.annotation,
                a.target,
                a.phase.as_str(),
                a.started_at.0,
                a.message
            )
        }
    }
}

/// The dead letters status shows (the newest few per perspective), of `perspective` or all.
pub fn dead_letters(pd: &PerspectiveDeployment, perspective: Option<&str>) -> String {
    let st = pd.status.clone().unwrap_or_default();
    let rows: Vec<Vec<String>> = st
        .perspectives
        .iter()
        .filter(|p| perspective.is_none_or(|name| p.name == name))
        .flat_map(|p| {
            p.newest_dead_letters.iter().map(move |d| {
                vec![
                    p.name.clone(),
                    d.id.to_string(),
                    d.event_type.clone(),
                    d.stream_id.clone(),
                    d.first_failed_at.0.to_string(),
                    d.error.clone().unwrap_or_default().replace('\n', " "),
                ]
            })
        })
        .collect();
    let counts: Vec<String> = st
        .perspectives
        .iter()
        .filter(|p| perspective.is_none_or(|name| p.name == name))
        .filter(|p| p.dead_letters > 0)
        .map(|p| format!("{}: {}", p.name, p.dead_letters))
        .collect();
    if counts.is_empty() {
        return "no dead letters\n".to_owned();
    }
    let mut out = table(
        &[
            "PERSPECTIVE",
            "ID",
            "EVENT TYPE",
            "STREAM",
            "FIRST FAILED",
            "ERROR",
        ],
        &rows,
    );
    out.push_str(&format!("waiting for replay: {}\n", counts.join(", ")));
    out
}

fn pod_row(pod: &Pod) -> Vec<String> {
    let status = pod.status.clone().unwrap_or_default();
    let containers = status.container_statuses.unwrap_or_default();
    let ready = containers.iter().filter(|c| c.ready).count();
    let restarts: i32 = containers.iter().map(|c| c.restart_count).sum();
    vec![
        pod.name_any(),
        format!("{ready}/{}", containers.len().max(1)),
        status.phase.unwrap_or_else(|| "-".to_owned()),
        restarts.to_string(),
    ]
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::crd::{ActionPhase, DeadLetterSample, PerspectiveDeploymentStatus, PerspectiveLag};

    fn deployment() -> PerspectiveDeployment {
        let mut pd: PerspectiveDeployment = serde_yaml::from_str(
            "apiVersion: perspectives.dev/v1alpha1\nkind: PerspectiveDeployment\n\
             metadata: {name: shop, namespace: prod}\n\
             spec: {schema: shop, database: {secretRef: {name: db}}, perspectives: []}",
        )
        .unwrap();
        pd.status = Some(PerspectiveDeploymentStatus {
            summary: Some("Degraded: EventsFailing".into()),
            dead_letters: Some(4),
            conditions: vec![Condition {
                type_: "Degraded".into(),
                status: "True".into(),
                reason: "EventsFailing".into(),
                message: "4 dead letter(s)".into(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
            }],
            perspectives: vec![PerspectiveLag {
                name: "totals".into(),
                dead_letters: 4,
                newest_dead_letters: vec![DeadLetterSample {
                    id: 9,
                    event_type: "OrderPlaced".into(),
                    stream_id: "s-1".into(),
                    error: Some("division\nby zero".into()),
                    first_failed_at: Time(Timestamp::UNIX_EPOCH),
                }],
                ..Default::default()
            }],
            last_action: Some(LastAction {
                annotation: "perspectives.dev/rebuild".into(),
                target: "totals".into(),
                phase: ActionPhase::Failed,
                job: Some("shop-rebuild-1".into()),
                started_at: Time(Timestamp::UNIX_EPOCH),
                finished_at: None,
                message: "it failed".into(),
            }),
            ..Default::default()
        });
        pd
    }

    #[test]
    fn dead_letters_are_listed_from_status_with_their_counts() {
        let pd = deployment();
        assert_eq!(
            dead_letters(&pd, None),
            "PERSPECTIVE  ID  EVENT TYPE   STREAM  FIRST FAILED          ERROR\n\
             totals       9   OrderPlaced  s-1     1970-01-01T00:00:00Z  division by zero\n\
             waiting for replay: totals: 4\n"
        );
        assert_eq!(dead_letters(&pd, Some("carts")), "no dead letters\n");
    }

    #[test]
    fn the_summary_has_conditions_perspectives_pods_the_last_action_and_its_log() {
        let logs = [LogTail {
            of: "job/shop-rebuild-1".into(),
            text: Err("pod gone".into()),
        }];
        let out = status(&deployment(), &[], &logs);
        for part in [
            "PerspectiveDeployment shop (namespace prod)\nStatus:         Degraded: EventsFailing\n",
            "Dead letters:   4\n",
            "    Degraded  True    EventsFailing  4 dead letter(s)\n",
            "    totals  Live   0        0s   0               4\n",
            "Last action:    perspectives.dev/rebuild totals: Failed (Job shop-rebuild-1), started \
             1970-01-01T00:00:00Z: it failed\n",
            "Log of job/shop-rebuild-1 (last lines):\n    (not available: pod gone)\n",
        ] {
            assert!(out.contains(part), "missing {part:?} in\n{out}");
        }
    }
}
