//! What the reconciler observed, the one input of [`super::compute`].

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use perspective_worker::store::status::Status as DbStatus;

use crate::migration_job::{JobState, MigrationTarget};

/// How soon a deployment whose Secret is missing is looked at again (the reconciler requeues
/// it so, and `Progressing` says so): recreating the Secret should recover it in seconds,
/// without a watch on Secrets (which would need `list`/`watch` on all of them in the namespace).
pub const SECRET_RECHECK: Duration = Duration::from_secs(3);

/// Everything the status is computed from.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The deployment's name.
    pub instance: String,
    pub generation: Option<i64>,
    pub paused: bool,
    /// Spec problems, each naming its field; non-empty means nothing was changed.
    pub problems: Vec<String>,
    /// Why the database Secret could not be read (missing, or without the key); nothing was
    /// changed either, and it is looked at again within [`SECRET_RECHECK`].
    pub secret_problem: Option<String>,
    /// A child object the API server refused, with its message.
    pub rejected: Option<String>,
    pub target: MigrationTarget,
    pub config_hash: String,
    /// The current target's Job, if it exists.
    pub job: Option<JobState>,
    pub migration_failures: i32,
    /// When the current target's failed Job runs again (none: it has not failed).
    pub next_migration_attempt: Option<k8s_openapi::jiff::Timestamp>,
    pub statefulset: Option<StatefulSet>,
    pub desired_replicas: i32,
    /// The target the status records as migrated last (`status.migratedHash`).
    pub migrated_hash: Option<String>,
    /// The database's view, when it was read (`Err` says why it could not be).
    pub database: Option<Result<DbStatus, DatabaseProblem>>,
}

/// Why the database's view of a deployment could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseProblem {
    /// Connecting or reading failed; says what failed without the server's text (e.g. `the
    /// server refused the read (SQLSTATE 3D000)`, `could not connect`, `no answer within 5s`).
    Unreachable(String),
    /// The database answers, but the deployment's schema has no migration history: dropped,
    /// or the database was recreated. Says which schema.
    SchemaMissing(String),
}

impl DatabaseProblem {
    /// The condition reason: `DatabaseUnreachable` or `SchemaMissing`.
    pub fn reason(&self) -> &'static str {
        match self {
            DatabaseProblem::Unreachable(_) => "DatabaseUnreachable",
            DatabaseProblem::SchemaMissing(_) => "SchemaMissing",
        }
    }

    /// What a condition or Event says about it.
    pub fn message(&self) -> String {
        match self {
            DatabaseProblem::Unreachable(e) => format!("cannot read status from the database: {e}"),
            DatabaseProblem::SchemaMissing(m) => m.clone(),
        }
    }
}
