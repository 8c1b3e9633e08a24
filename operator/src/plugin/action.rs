//! `kubectl pd dead-letters replay|discard` and `kubectl pd rebuild`: check the value as the
//! operator will ([`crate::action_job::requested`]), set the annotation, then follow
//! `status.lastAction` until the operator reports the outcome (progress on the way).

use std::collections::BTreeMap;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::{get, Wait, CALL_TIMEOUT};
use crate::action_job::{self, Action};
use crate::crd::{ActionPhase, LastAction, PerspectiveDeployment, PerspectivePhase};

/// How often the status is read while waiting.
const POLL: Duration = Duration::from_secs(1);

/// Asks deployment `name` for `action` on `target`; true when it succeeded (or, with
/// `--no-wait`, was asked for).
pub async fn ask(
    pds: &Api<PerspectiveDeployment>,
    name: &str,
    action: Action,
    target: &str,
    wait: &Wait,
) -> anyhow::Result<bool> {
    let pd = get(pds, name).await?;
    let perspectives: Vec<String> = pd
        .spec
        .perspectives
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let asked = BTreeMap::from([(action.annotation().to_owned(), target.to_owned())]);
    if let Some(Err(refusal)) = action_job::requested(&asked, &perspectives) {
        anyhow::bail!("{}", refusal.message);
    }
    let before = pd.status.and_then(|s| s.last_action);
    let patch = json!({"metadata": {"annotations": {action.annotation(): target}}});
    tokio::time::timeout(
        CALL_TIMEOUT,
        pds.patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no answer from the API server within {CALL_TIMEOUT:?}"))?
    .map_err(|e| anyhow::anyhow!("annotating {name}: {}", crate::reconcile::describe(&e)))?;
    println!("annotated {name}: {}={target}", action.annotation());
    if wait.no_wait {
        println!("the operator carries it out; follow it with `kubectl pd status {name}`");
        return Ok(true);
    }
    follow(pds, name, action, target, before.as_ref(), wait).await
}

/// Prints each new phase of the action until it ends; true when it succeeded.
async fn follow(
    pds: &Api<PerspectiveDeployment>,
    name: &str,
    action: Action,
    target: &str,
    before: Option<&LastAction>,
    wait: &Wait,
) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait.timeout_seconds);
    let mut said = String::new();
    loop {
        let pd = get(pds, name).await?;
        let st = pd.status.clone().unwrap_or_default();
        if let Some(a) = st
            .last_action
            .as_ref()
            .filter(|a| is_ours(a, action, target, before))
        {
            let line = progress_line(a, &pd, target);
            if line != said {
                println!("{line}");
                said = line;
            }
            match a.phase {
                ActionPhase::Running => {}
                // A rebuild's Job only queues it: follow the perspective until it is live.
                ActionPhase::Succeeded if action == Action::Rebuild && !is_live(&pd, target) => {}
                ActionPhase::Succeeded => return Ok(true),
                ActionPhase::Failed | ActionPhase::Refused => return Ok(false),
            }
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(
                "no outcome within {}s; the action goes on: `kubectl pd status {name}`",
                wait.timeout_seconds
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Whether `a` is the action just asked for, not the one that was there before.
fn is_ours(a: &LastAction, action: Action, target: &str, before: Option<&LastAction>) -> bool {
    a.annotation == action.annotation()
        && a.target.trim() == target.trim()
        && before.is_none_or(|b| (b.job.as_ref(), &b.started_at) != (a.job.as_ref(), &a.started_at))
}

/// Whether perspective `name` is live in the deployment's status.
fn is_live(pd: &PerspectiveDeployment, name: &str) -> bool {
    pd.status
        .as_ref()
        .and_then(|s| s.perspectives.iter().find(|p| p.name == name))
        .is_some_and(|p| p.phase == PerspectivePhase::Live)
}

/// "Running: …", "Succeeded: …"; while a rebuild runs, the perspective's phase too.
fn progress_line(a: &LastAction, pd: &PerspectiveDeployment, target: &str) -> String {
    let phase = pd
        .status
        .as_ref()
        .and_then(|s| s.perspectives.iter().find(|p| p.name == target))
        .map(|p| match &p.progress {
            Some(progress) => format!(" [{} {}%]", p.phase.as_str(), progress.percent),
            None => format!(" [{}]", p.phase.as_str()),
        })
        .unwrap_or_default();
    format!("{}: {}{phase}", a.phase.as_str(), a.message)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    fn action(job: &str, at: i64) -> LastAction {
        LastAction {
            annotation: "perspectives.dev/replay-dead-letters".into(),
            target: "all".into(),
            phase: ActionPhase::Succeeded,
            job: Some(job.into()),
            started_at: Time(Timestamp::from_second(at).unwrap()),
            finished_at: None,
            message: String::new(),
        }
    }

    #[test]
    fn an_earlier_outcome_of_the_same_action_is_not_taken_for_the_new_one() {
        let earlier = action("shop-replay-1", 10);
        assert!(!is_ours(
            &earlier,
            Action::ReplayDeadLetters,
            "all",
            Some(&earlier)
        ));
        assert!(is_ours(
            &action("shop-replay-2", 20),
            Action::ReplayDeadLetters,
            "all",
            Some(&earlier)
        ));
        assert!(is_ours(&earlier, Action::ReplayDeadLetters, "all", None));
        assert!(!is_ours(&earlier, Action::DiscardDeadLetters, "all", None));
        assert!(!is_ours(&earlier, Action::ReplayDeadLetters, "carts", None));
    }
}
