//! Day-2 actions asked for by annotation on a deployment, and the short Job that carries one
//! out: `perspective-worker dead-letters replay|discard --all [--perspective P]`,
//! `perspective-worker rebuild --perspective P` or `perspective-worker switch [--perspective P]`
//! (the blue/green switch, for workers whose role may not make it), with the migration Job's image, pod policy and
//! Secret (the owner role). Pure: which action an annotation asks for (or why it is refused),
//! the Job, and what its outcome says.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::api::ObjectMeta;

use crate::crd::{
    ActionPhase, DatabaseRole, LastAction, PerspectiveDeploymentSpec, PerspectiveDeploymentStatus,
    PerspectivePhase,
};
use crate::labels;
use crate::migration_job::JobState;
use crate::pod;

/// The value of a dead-letter or switch annotation that means every perspective.
pub const ALL: &str = "all";

/// How long a switch Job waits for a version to catch up before it fails.
const SWITCH_WAIT_SECONDS: u64 = 60;

/// A day-2 action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    ReplayDeadLetters,
    DiscardDeadLetters,
    Rebuild,
    Switch,
}

impl Action {
    /// Every action, in the order their annotations are taken up.
    pub const ALL: [Action; 4] = [
        Action::ReplayDeadLetters,
        Action::DiscardDeadLetters,
        Action::Rebuild,
        Action::Switch,
    ];

    /// The annotation on the deployment that asks for it.
    pub fn annotation(self) -> &'static str {
        match self {
            Action::ReplayDeadLetters => labels::REPLAY_DEAD_LETTERS,
            Action::DiscardDeadLetters => labels::DISCARD_DEAD_LETTERS,
            Action::Rebuild => labels::REBUILD,
            Action::Switch => labels::SWITCH,
        }
    }

    /// The action of `annotation`.
    pub fn of_annotation(annotation: &str) -> Option<Action> {
        Action::ALL
            .into_iter()
            .find(|a| a.annotation() == annotation)
    }

    /// The word in its Job's name.
    pub fn verb(self) -> &'static str {
        match self {
            Action::ReplayDeadLetters => "replay",
            Action::DiscardDeadLetters => "discard",
            Action::Rebuild => "rebuild",
            Action::Switch => "switch",
        }
    }

    /// Whether `all` is a valid value.
    fn takes_all(self) -> bool {
        self != Action::Rebuild
    }

    /// The worker's arguments for target `target` (a perspective, or [`ALL`]).
    pub fn args(self, target: &str) -> Vec<String> {
        let mut args: Vec<String> = match self {
            Action::ReplayDeadLetters => {
                vec!["dead-letters".into(), "replay".into(), "--all".into()]
            }
            Action::DiscardDeadLetters => {
                vec!["dead-letters".into(), "discard".into(), "--all".into()]
            }
            Action::Rebuild => vec!["rebuild".into()],
            // A version caught up a moment ago may lag past the threshold for a turn.
            Action::Switch => vec![
                "switch".into(),
                "--wait-seconds".into(),
                SWITCH_WAIT_SECONDS.to_string(),
            ],
        };
        if target != ALL {
            args.extend(["--perspective".to_owned(), target.to_owned()]);
        }
        args
    }

    /// What a finished run did, e.g. "replayed the dead letters of order_summary".
    pub fn done(self, target: &str) -> String {
        let whose = if target == ALL {
            "all perspectives".to_owned()
        } else {
            target.to_owned()
        };
        match self {
            Action::ReplayDeadLetters => format!("replayed the dead letters of {whose}"),
            Action::DiscardDeadLetters => format!("discarded the dead letters of {whose}"),
            Action::Rebuild => format!("rebuild of {whose} started (status shows its progress)"),
            // The command fails while a version it was asked to switch is left, so a success
            // means each new version serves now (or there was none); its log names each switch.
            Action::Switch => format!(
                "switch of {whose} done: every new version serves now (the Job's log names each switch)"
            ),
        }
    }
}

/// An action asked for with a valid value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub action: Action,
    /// A configured perspective, or [`ALL`].
    pub target: String,
}

/// The first action the deployment's `annotations` ask for, in [`Action::ALL`]'s order: a
/// [`Request`], or (as `Err`) the annotation, its value and why it is refused.
pub fn requested(
    annotations: &BTreeMap<String, String>,
    perspectives: &[String],
) -> Option<Result<Request, Refusal>> {
    let (action, value) = Action::ALL
        .into_iter()
        .find_map(|a| annotations.get(a.annotation()).map(|v| (a, v)))?;
    let target = value.trim();
    let valid = (action.takes_all() && target == ALL) || perspectives.iter().any(|p| p == target);
    if valid {
        return Some(Ok(Request {
            action,
            target: target.to_owned(),
        }));
    }
    let expected = if action.takes_all() {
        format!("a perspective of spec.perspectives or `{ALL}`")
    } else {
        "a perspective of spec.perspectives".to_owned()
    };
    let known = if perspectives.is_empty() {
        "none".to_owned()
    } else {
        perspectives.join(", ")
    };
    Some(Err(Refusal {
        action,
        value: value.clone(),
        message: format!(
            "annotation {}: {value:?} is not {expected} (perspectives: {known}); nothing was run",
            action.annotation()
        ),
    }))
}

/// After a switch Job the operator started by itself failed, how long before it starts another
/// for the same perspective: a version with dead letters waiting does not catch up by itself.
pub const AUTO_SWITCH_AFTER_FAILURE_SECONDS: i64 = 300;

/// After any other switch of a perspective ended, how long before the operator starts one by
/// itself: status may still show the perspective `Switching` from before the switch.
pub const AUTO_SWITCH_AFTER_SWITCH_SECONDS: i64 = 30;

/// The switch the operator starts without an annotation: workers that run as a role of their
/// own (`spec.database.workerSecretRef`) may not switch, so a perspective that status shows
/// `Switching` waits for the owner. The first such perspective of the spec, unless a switch of
/// it is running or ended lately (see the pauses above); `status_at` is now.
pub fn auto_switch(
    spec: &PerspectiveDeploymentSpec,
    status: Option<&PerspectiveDeploymentStatus>,
    status_at: k8s_openapi::jiff::Timestamp,
) -> Option<Request> {
    spec.database.worker_secret_ref.as_ref()?;
    let status = status?;
    let last = status
        .last_action
        .as_ref()
        .filter(|a| a.annotation == labels::SWITCH);
    spec.perspectives
        .iter()
        .filter(|p| {
            status
                .perspectives
                .iter()
                .any(|s| s.name == p.name && s.phase == PerspectivePhase::Switching)
        })
        .find(|p| !switched_lately(last, &p.name, status_at))
        .map(|p| Request {
            action: Action::Switch,
            target: p.name.clone(),
        })
}

/// Whether `last` (the last switch action) is of `perspective` and running, or ended within its
/// pause.
fn switched_lately(
    last: Option<&LastAction>,
    perspective: &str,
    now: k8s_openapi::jiff::Timestamp,
) -> bool {
    let Some(a) = last.filter(|a| a.target == perspective || a.target == ALL) else {
        return false;
    };
    let pause = match a.phase {
        ActionPhase::Failed => AUTO_SWITCH_AFTER_FAILURE_SECONDS,
        _ => AUTO_SWITCH_AFTER_SWITCH_SECONDS,
    };
    match &a.finished_at {
        None => true,
        Some(at) => now.as_second() - at.0.as_second() < pause,
    }
}

/// A refused annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub action: Action,
    pub value: String,
    pub message: String,
}

/// The Job carrying out `request` for deployment `instance`, named `job_name`, reading its
/// config from ConfigMap `config_map`. No retries: a failed action is reported, not repeated.
pub fn build(
    instance: &str,
    namespace: &str,
    spec: &PerspectiveDeploymentSpec,
    image: &str,
    config_map: &str,
    request: &Request,
    job_name: &str,
) -> Job {
    let labels = labels::labels(instance, labels::ACTION_JOB);
    let annotations = BTreeMap::from([
        (
            labels::ACTION.to_owned(),
            request.action.annotation().to_owned(),
        ),
        (labels::ACTION_TARGET.to_owned(), request.target.clone()),
    ]);
    let args = request.action.args(&request.target);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let container = pod::container(
        request.action.verb(),
        image,
        spec,
        &args,
        pod::base_env(spec, DatabaseRole::Migration),
    );
    Job {
        metadata: ObjectMeta {
            name: Some(job_name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels.clone()),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(spec.migrations.active_deadline_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod::pod_spec(spec, config_map, container, "Never")),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// The request an action Job carries out, from its annotations.
pub fn request_of(job: &Job) -> Option<Request> {
    let annotations = job.metadata.annotations.as_ref()?;
    Some(Request {
        action: Action::of_annotation(annotations.get(labels::ACTION)?)?,
        target: annotations.get(labels::ACTION_TARGET)?.clone(),
    })
}

/// What status and the Event say about a finished action Job: what it did, or the Job
/// controller's message and where the output is (never the output: see
/// [`failure_message`]).
pub fn outcome_message(request: &Request, job_name: &str, state: &JobState) -> String {
    match state {
        JobState::Succeeded => format!(
            "{} (Job {job_name}; its output: kubectl logs job/{job_name})",
            request.action.done(&request.target)
        ),
        JobState::Failed {
            reason, message, ..
        } => format!(
            "{} {} failed ({reason}): {message}",
            request.action.annotation(),
            request.target
        ),
        JobState::Running => format!("Job {job_name} is running"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration_job::failure_message;

    fn annotated(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn names() -> Vec<String> {
        vec!["order_summary".into(), "order_count".into()]
    }

    #[test]
    fn an_annotation_names_a_perspective_or_all() {
        let none = annotated(&[("kubectl.kubernetes.io/last-applied-configuration", "{}")]);
        assert_eq!(requested(&none, &names()), None);
        let replay = annotated(&[(labels::REPLAY_DEAD_LETTERS, " order_summary ")]);
        assert_eq!(
            requested(&replay, &names()),
            Some(Ok(Request {
                action: Action::ReplayDeadLetters,
                target: "order_summary".into()
            }))
        );
        let discard = annotated(&[(labels::DISCARD_DEAD_LETTERS, "all")]);
        assert_eq!(
            requested(&discard, &names()).unwrap().unwrap().action,
            Action::DiscardDeadLetters
        );
        // Replay goes first when several are asked for.
        let both = annotated(&[
            (labels::REBUILD, "order_count"),
            (labels::REPLAY_DEAD_LETTERS, "all"),
        ]);
        assert_eq!(
            requested(&both, &names()).unwrap().unwrap().action,
            Action::ReplayDeadLetters
        );
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_annotation_and_the_value() {
        let typo = annotated(&[(labels::REPLAY_DEAD_LETTERS, "order_sumary")]);
        let refusal = requested(&typo, &names()).unwrap().unwrap_err();
        assert_eq!(
            refusal.message,
            "annotation perspectives.dev/replay-dead-letters: \"order_sumary\" is not a \
             perspective of spec.perspectives or `all` (perspectives: order_summary, \
             order_count); nothing was run"
        );
        // A rebuild of everything is not offered.
        let all = annotated(&[(labels::REBUILD, "all")]);
        let refusal = requested(&all, &names()).unwrap().unwrap_err();
        assert!(refusal.message.starts_with(
            "annotation perspectives.dev/rebuild: \"all\" is not a perspective of spec.perspectives ("
        ));
    }

    #[test]
    fn the_job_runs_the_workers_command_once_as_the_owner_role() {
        let spec: PerspectiveDeploymentSpec = serde_yaml::from_str(
            "schema: shop\ndatabase: {secretRef: {name: db}, migrationSecretRef: {name: owner}}\n\
             perspectives: []",
        )
        .unwrap();
        let request = Request {
            action: Action::ReplayDeadLetters,
            target: "order_summary".into(),
        };
        let job = build(
            "shop",
            "ns",
            &spec,
            "img:1",
            "shop-config-x",
            &request,
            "shop-replay-1",
        );
        let js = job.spec.as_ref().unwrap();
        assert_eq!(js.backoff_limit, Some(0));
        let pod = js.template.spec.as_ref().unwrap();
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("img:1"));
        assert_eq!(
            c.args.as_deref().unwrap(),
            [
                "dead-letters",
                "replay",
                "--all",
                "--perspective",
                "order_summary"
            ]
        );
        let secret = c
            .env
            .iter()
            .flatten()
            .find_map(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
            .expect("the database URL from a Secret");
        assert_eq!(secret.name, "owner");
        assert_eq!(request_of(&job), Some(request));
        assert_eq!(
            Action::Rebuild.args("carts"),
            ["rebuild", "--perspective", "carts"]
        );
        assert_eq!(
            Action::DiscardDeadLetters.args(ALL),
            ["dead-letters", "discard", "--all"]
        );
        assert_eq!(
            Action::Switch.args("orders"),
            ["switch", "--wait-seconds", "60", "--perspective", "orders"]
        );
        assert_eq!(Action::Switch.args(ALL), ["switch", "--wait-seconds", "60"]);
    }

    #[test]
    fn a_switch_is_asked_for_a_perspective_or_all_after_the_other_actions() {
        let switch = annotated(&[(labels::SWITCH, "order_summary")]);
        assert_eq!(
            requested(&switch, &names()),
            Some(Ok(Request {
                action: Action::Switch,
                target: "order_summary".into()
            }))
        );
        let all = annotated(&[(labels::SWITCH, "all")]);
        assert_eq!(requested(&all, &names()).unwrap().unwrap().target, ALL);
        let both = annotated(&[(labels::SWITCH, "all"), (labels::REBUILD, "order_count")]);
        assert_eq!(
            requested(&both, &names()).unwrap().unwrap().action,
            Action::Rebuild
        );
        assert_eq!(
            Action::Switch.done("order_summary"),
            "switch of order_summary done: every new version serves now (the Job's log names each switch)"
        );
    }

    #[test]
    fn the_operator_switches_by_itself_only_for_a_worker_role_and_not_again_at_once() {
        use crate::crd::PerspectiveLag;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        use k8s_openapi::jiff::Timestamp;
        let with_role: PerspectiveDeploymentSpec = serde_yaml::from_str(
            "schema: shop\ndatabase: {secretRef: {name: db}, workerSecretRef: {name: w}}\n\
             perspectives: [{name: orders, handlers: {A: SELECT 1}}, {name: carts, handlers: {A: SELECT 1}}]",
        )
        .unwrap();
        let lag = |name: &str, phase| PerspectiveLag {
            name: name.into(),
            phase,
            ..Default::default()
        };
        let mut status = PerspectiveDeploymentStatus {
            perspectives: vec![
                lag("orders", PerspectivePhase::Live),
                lag("carts", PerspectivePhase::Switching),
            ],
            ..Default::default()
        };
        let now = Timestamp::from_second(1_000_000).unwrap();
        let carts = Some(Request {
            action: Action::Switch,
            target: "carts".into(),
        });
        assert_eq!(auto_switch(&with_role, Some(&status), now), carts);
        // Workers running as the owner switch by themselves.
        let mut owner = with_role.clone();
        owner.database.worker_secret_ref = None;
        assert_eq!(auto_switch(&owner, Some(&status), now), None);
        assert_eq!(auto_switch(&with_role, None, now), None);
        // Not while its switch runs, nor soon after one ended; later after a failed one.
        let ended = |phase, seconds_ago: i64| LastAction {
            annotation: labels::SWITCH.into(),
            target: "carts".into(),
            phase,
            job: Some("j".into()),
            started_at: Time(Timestamp::from_second(1_000_000 - seconds_ago - 5).unwrap()),
            finished_at: Some(Time(
                Timestamp::from_second(1_000_000 - seconds_ago).unwrap(),
            )),
            message: String::new(),
        };
        let mut running = ended(ActionPhase::Running, 0);
        running.finished_at = None;
        for (last, expected) in [
            (running, None),
            (ended(ActionPhase::Succeeded, 10), None),
            (ended(ActionPhase::Succeeded, 31), carts.clone()),
            (ended(ActionPhase::Failed, 200), None),
            (ended(ActionPhase::Failed, 301), carts.clone()),
        ] {
            status.last_action = Some(last.clone());
            assert_eq!(
                auto_switch(&with_role, Some(&status), now),
                expected,
                "{last:?}"
            );
        }
        // Another action's outcome does not hold it back.
        let mut other = ended(ActionPhase::Failed, 1);
        other.annotation = labels::REBUILD.into();
        status.last_action = Some(other);
        assert_eq!(auto_switch(&with_role, Some(&status), now), carts);
    }

    #[test]
    fn a_failed_action_points_to_its_log_not_its_output() {
        let request = Request {
            action: Action::Rebuild,
            target: "carts".into(),
        };
        let failed = JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: failure_message("Job has reached the specified backoff limit", "j"),
            at: None,
        };
        assert_eq!(
            outcome_message(&request, "j", &failed),
            "perspectives.dev/rebuild carts failed (BackoffLimitExceeded): Job has reached the \
             specified backoff limit; its output: kubectl logs job/j"
        );
    }
}
