//! `Degraded`: something needs a look — the first of: an invalid spec, a missing Secret, a
//! refused child, a failed migration, an unreachable database, failing events.

use super::{Desired, DEGRADED};
use crate::migration_job::JobState;
use crate::status::facts::Facts;

/// `True` with the reason of the first problem found, else `False` (`AsExpected`).
pub fn desired(f: &Facts) -> Desired {
    let o = f.observed;
    let degraded = |reason: &str, message: String| Desired::new(DEGRADED, true, reason, message);
    if f.invalid {
        degraded("InvalidSpec", o.problems.join("; "))
    } else if let Some(problem) = &o.secret_problem {
        degraded("SecretMissing", problem.clone())
    } else if let Some(message) = f.rejected {
        degraded("ChildRejected", message.to_owned())
    } else if let Some(JobState::Failed {
        reason, message, ..
    }) = &o.job
    {
        degraded("MigrationFailed", format!("{reason}: {message}"))
    } else if let Some(e) = f.database_error {
        degraded(
            "DatabaseUnreachable",
            format!("cannot read status from the database: {e}"),
        )
    } else if f.dead_letters > 0 || f.failed_streams > 0 {
        degraded(
            "EventsFailing",
            format!(
                "{} dead letter(s) waiting for replay, {} stream(s) retrying after a failure",
                f.dead_letters, f.failed_streams
            ),
        )
    } else {
        Desired::new(DEGRADED, false, "AsExpected", "")
    }
}
