//! Names and flags the worker shares with its SQL, defined once.

use sha2::{Digest, Sha256};

/// NOTIFY channel on which producers ring the doorbell for new work (empty payload), workers
/// announce abandoned instances ([`ORPHAN_PAYLOAD`]) and jobs announce their start
/// ([`JOBS_PAYLOAD`]).
pub fn work_channel(schema: &str) -> String {
    format!("{schema}_work")
}

/// NOTIFY channel carrying the id of each event every subscribed perspective has applied
/// (with `worker.notifyApplied`).
pub fn applied_channel(schema: &str) -> String {
    format!("{schema}_applied")
}

/// Payload on the work channel when silent instances were abandoned.
pub const ORPHAN_PAYLOAD: &str = "orphan";

/// Payload on the work channel when a perspective job starts (`wh_job_start`).
pub const JOBS_PAYLOAD: &str = "jobs";

/// Flags of `wh_perspective_cursors.status` (the seeds' PerspectiveProcessingStatus) that the
/// worker writes or reads; statements spell them `{cursor_completed}` / `{cursor_failed}`.
/// `wh_drain`'s `o_contended_sqlstate` for a pair of a key- or serial-sequenced perspective that
/// was not applied because another applier held one of its keys (its turn comes; no conflict).
pub const SEQUENCING_BUSY: &str = "WH423";

/// `wh_drain`'s `o_contended_sqlstate` for a pair whose perspective's apply function was dropped
/// while the call ran (a blue/green switch replaced the version it belonged to): nothing was
/// recorded; the worker retries it soon, and the call compiled after the switch applies it under
/// the version that serves. Neither a failure nor a conflict.
pub const SWITCHED_AWAY: &str = "WH424";

pub mod cursor_status {
    /// The last apply succeeded.
    pub const COMPLETED: i16 = 2;
    /// The last apply failed on an event (it is retried with backoff).
    pub const FAILED: i16 = 4;
}

/// Values of `wh_dead_letters.recovery_status`; statements spell them `{dead_letter_pending}` /
/// `{dead_letter_replayed}` / `{dead_letter_discarded}`.
pub mod recovery_status {
    pub const PENDING: &str = "pending";
    pub const REPLAYED: &str = "replayed";
    pub const DISCARDED: &str = "discarded";
}

/// Values of `wh_perspective_jobs.kind` (spelled in the table's CHECK, and in the functions
/// `wh_backfill_gated` and `claim_work`).
pub mod job_kind {
    pub const BACKFILL: &str = "backfill";
    pub const REBUILD: &str = "rebuild";
}

/// Name of the apply function of `perspective` (always a valid identifier of at most 63 bytes).
pub fn apply_function_name(perspective: &str) -> String {
    generated_name("wh_apply_", perspective)
}

/// Name of the batch function of `perspective` (compiled from `compile/batch_function.sql`; the same rule as
/// [`apply_function_name`]).
pub fn batch_function_name(perspective: &str) -> String {
    generated_name("wh_batch_", perspective)
}

/// Name of the key function of a `sequencing: key` perspective (`compile::sequencing`; the same
/// rule as [`apply_function_name`]).
pub fn key_function_name(perspective: &str) -> String {
    generated_name("wh_key_", perspective)
}

/// `prefix` + `perspective`, or, past PostgreSQL's 63 bytes, its first 44 bytes and a hash.
fn generated_name(prefix: &str, perspective: &str) -> String {
    let name = format!("{prefix}{perspective}");
    if name.len() <= 63 {
        name
    } else {
        let hash = hex::encode(&Sha256::digest(perspective.as_bytes())[..4]);
        format!("{prefix}{}_{hash}", &perspective[..44])
    }
}
