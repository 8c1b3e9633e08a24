//! Validation: every rule a config must follow beyond its types, and the [`Problem`] and
//! [`ConfigError`] types that report what is wrong.
//!
//! Validation reports every problem it finds at once, each with the path of the offending
//! field: names ([`super::names`]), perspectives (handler, `reset` and `setup` SQL lexed with
//! [`super::sql_params`]), the `worker:` and `claimWorker:` ranges.

use std::collections::HashSet;
use std::fmt;

use super::claim_options::{
    ClaimWorkerOptions, MAX_POLLING_INTERVAL_MILLISECONDS, MAX_STREAMS_PER_BATCH,
};
use super::names::{
    check_event_type, check_identifier, check_schema_name, MAX_PERSPECTIVE_NAME_LEN,
};
use super::perspective::{
    Ordering, PerspectiveConfig, Rebuild, Sequencing, MAX_KEEP_PREVIOUS_VERSIONS,
};
use super::sql_params::{self, Param};
use super::worker_options::*;
use super::Config;

/// Statements that would end or split the worker's apply transaction.
const TRANSACTION_CONTROL: [&str; 8] = [
    "begin",
    "start",
    "commit",
    "end",
    "rollback",
    "abort",
    "savepoint",
    "release",
];

/// Statements a handler or `reset` cannot run: the compiled apply function is PL/pgSQL inside
/// the worker's transaction, so these would migrate and then fail (or dead-letter) every event,
/// or, for a role switch, run the rest of the transaction as someone else. Each is the start of
/// a statement (its first words) and why.
const NOT_IN_A_HANDLER: &[(&[&str], &str)] = &[
    (
        &["copy"],
        "COPY streams to or from a client, which a handler does not have",
    ),
    (
        &["listen"],
        "LISTEN is a session command; a handler runs inside the worker's transaction",
    ),
    (
        &["unlisten"],
        "UNLISTEN is a session command; a handler runs inside the worker's transaction",
    ),
    (
        &["set", "role"],
        "SET ROLE would switch the role the worker's transaction runs as",
    ),
    (
        &["set", "local", "role"],
        "SET LOCAL ROLE would switch the role the worker's transaction runs as",
    ),
    (
        &["set", "session", "authorization"],
        "SET SESSION AUTHORIZATION would switch the worker's role",
    ),
    (
        &["set", "local", "session"],
        "SET LOCAL SESSION AUTHORIZATION would switch the worker's role",
    ),
    (
        &["reset", "role"],
        "RESET ROLE would switch the role the worker's transaction runs as",
    ),
    (
        &["reset", "session"],
        "RESET SESSION AUTHORIZATION would switch the worker's role",
    ),
    (
        &["discard"],
        "DISCARD is a session command and cannot run inside a transaction",
    ),
    (&["vacuum"], "VACUUM cannot run inside a transaction"),
    (
        &["create", "database"],
        "CREATE DATABASE cannot run inside a transaction",
    ),
    (
        &["drop", "database"],
        "DROP DATABASE cannot run inside a transaction",
    ),
    (
        &["create", "tablespace"],
        "CREATE TABLESPACE cannot run inside a transaction",
    ),
    (
        &["drop", "tablespace"],
        "DROP TABLESPACE cannot run inside a transaction",
    ),
    (
        &["alter", "system"],
        "ALTER SYSTEM cannot run inside a transaction",
    ),
    (
        &["prepare", "transaction"],
        "PREPARE TRANSACTION would end the worker's transaction",
    ),
    (
        &["commit", "prepared"],
        "COMMIT PREPARED cannot run inside a transaction",
    ),
    (
        &["rollback", "prepared"],
        "ROLLBACK PREPARED cannot run inside a transaction",
    ),
    (
        &["create", "index", "concurrently"],
        "CREATE INDEX CONCURRENTLY cannot run inside a transaction",
    ),
    (
        &["drop", "index", "concurrently"],
        "DROP INDEX CONCURRENTLY cannot run inside a transaction",
    ),
    (
        &["reindex"],
        "REINDEX belongs in setup or a maintenance job, not in a handler",
    ),
];

/// Why `words` (a statement's first words, lower case) cannot run in a handler, if it cannot.
fn not_in_a_handler(words: &[String]) -> Option<String> {
    if words.len() >= 4 && words[..3] == ["create", "unique", "index"] && words[3] == "concurrently"
    {
        return Some("CREATE UNIQUE INDEX CONCURRENTLY cannot run inside a transaction".into());
    }
    NOT_IN_A_HANDLER
        .iter()
        .find(|(start, _)| words.len() >= start.len() && words[..start.len()] == **start)
        .map(|(_, why)| (*why).to_string())
}

/// One thing wrong with a config: the field it concerns and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Field path such as `schema`, `worker.perspectiveBatchSize` or
    /// `perspectives[0] (order_summary).handlers.OrderPlaced`; empty for the whole document.
    pub path: String,
    pub message: String,
}

impl Problem {
    pub(super) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// A config that could not be read, parsed or validated, with every problem found.
///
/// `std::error::Error` is implemented by hand: thiserror treats a field named `source` as
/// the underlying error, and here it is the file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where the config came from (a file name, or a description such as `config`).
    pub source: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {problem}", self.source)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Every validation problem of `config`; empty when it is valid.
pub(super) fn problems(config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    if let Err(message) = check_schema_name(&config.schema) {
        problems.push(Problem::new("schema", message));
    }
    if config.perspectives.is_empty() {
        problems.push(Problem::new(
            "perspectives",
            "at least one perspective is required",
        ));
    }
    let mut seen = HashSet::new();
    for (index, perspective) in config.perspectives.iter().enumerate() {
        let label = perspective_label(index, &perspective.name);
        if !seen.insert(perspective.name.as_str()) {
            problems.push(Problem::new(
                format!("{label}.name"),
                format!("duplicate perspective name `{}`", perspective.name),
            ));
        }
        check_perspective(perspective, &label, &mut problems);
    }
    check_worker_options(&config.worker, &mut problems);
    check_claim_worker_options(&config.claim_worker, &mut problems);
    problems
}

/// The problems of one perspective, `label` naming it in their paths.
fn check_perspective(perspective: &PerspectiveConfig, label: &str, problems: &mut Vec<Problem>) {
    if let Err(message) = check_identifier(&perspective.name, MAX_PERSPECTIVE_NAME_LEN) {
        problems.push(Problem::new(
            format!("{label}.name"),
            format!("invalid perspective name `{}`: {message}", perspective.name),
        ));
    }
    if perspective.version == 0 {
        problems.push(Problem::new(
            format!("{label}.version"),
            "version starts at 1; raise it to rebuild the perspective",
        ));
    }
    if let Some(setup) = &perspective.setup {
        // Setup runs once, at migrate time, when there is no event to take values from.
        match sql_params::parameter_uses(setup) {
            Ok(uses) => {
                if let Some(first) = uses.first() {
                    problems.push(Problem::new(
                        format!("{label}.setup"),
                        format!(
                            "setup runs at migrate time and cannot use {} (line {}, column {})",
                            first.param, first.line, first.column
                        ),
                    ));
                }
            }
            Err(e) => problems.push(Problem::new(format!("{label}.setup"), e.to_string())),
        }
        check_setup_transaction(setup, &format!("{label}.setup"), problems);
    }
    if let Some(reset) = &perspective.reset {
        // An empty reset would let a rewind replay events on top of the old model.
        check_apply_sql(reset, "reset", &format!("{label}.reset"), problems);
        check_no_events(reset, "reset", &format!("{label}.reset"), problems);
    }
    if perspective.ordering == Ordering::EventId && perspective.reset.is_none() {
        problems.push(Problem::new(
            format!("{label}.reset"),
            "ordering: eventId needs a reset: a late event rewinds the stream (reset, then replay in event-id order)",
        ));
    }
    check_sequencing(perspective, label, problems);
    check_rebuild(perspective, label, problems);
    if perspective.handlers.is_empty() {
        problems.push(Problem::new(
            format!("{label}.handlers"),
            "at least one handler (event type: SQL) is required",
        ));
    }
    for (event_type, sql) in &perspective.handlers {
        if let Err(message) = check_event_type(event_type) {
            problems.push(Problem::new(
                format!("{label}.handlers[{event_type:?}]"),
                format!("invalid event type mapping: {message}"),
            ));
            continue;
        }
        let path = format!("{label}.handlers.{event_type}");
        check_apply_sql(sql, "handler", &path, problems);
        check_batch_handler(sql, &path, problems);
    }
}

/// A handler that reads `:events` is a batch handler: it runs once per run of its events and
/// has no single event whose `:data` (or any other per-event parameter) it could mean.
fn check_batch_handler(sql: &str, path: &str, problems: &mut Vec<Problem>) {
    let Ok(uses) = sql_params::parameter_uses(sql) else {
        return; // (reported by check_apply_sql)
    };
    if !uses.iter().any(|u| u.param == Param::Events) {
        return;
    }
    if let Some(per_event) = uses.iter().find(|u| u.param != Param::Events) {
        problems.push(Problem::new(
            path,
            format!(
                "{} (line {}, column {}) is one event's value, but this handler reads :events, so it runs once for a run of events: read each event's value from :events (columns {})",
                per_event.param, per_event.line, per_event.column, sql_params::EVENTS_COLUMNS
            ),
        ));
    }
}

/// `:events` (a batch handler's run) means nothing outside a handler.
fn check_no_events(sql: &str, what: &str, path: &str, problems: &mut Vec<Problem>) {
    let Ok(uses) = sql_params::parameter_uses(sql) else {
        return; // (reported with the other checks of this SQL)
    };
    if let Some(u) = uses.iter().find(|u| u.param == Param::Events) {
        problems.push(Problem::new(
            path,
            format!(
                ":events (line {}, column {}) is only for handlers, which then run once per run of events; a {what} has no such run",
                u.line, u.column
            ),
        ));
    }
}

/// The problems of the `worker:` options.
/// The `worker:` options that count things, with their bounds.
fn worker_count_ranges(worker: &WorkerOptions) -> Vec<(&'static str, u64, u64, u64)> {
    vec![
        (
            "leaseSeconds",
            worker.lease_seconds.into(),
            1,
            MAX_LEASE_SECONDS.into(),
        ),
        (
            "abandonStaleInstanceThresholdSeconds",
            worker.abandon_stale_instance_threshold_seconds.into(),
            1,
            MAX_STALE_THRESHOLD_SECONDS.into(),
        ),
        (
            "idleThresholdPolls",
            worker.idle_threshold_polls.into(),
            1,
            MAX_IDLE_THRESHOLD_POLLS.into(),
        ),
        (
            "perspectiveBatchSize",
            worker.perspective_batch_size.into(),
            1,
            MAX_PERSPECTIVE_BATCH_SIZE.into(),
        ),
        (
            "maxConcurrentPerspectives",
            worker.max_concurrent_perspectives.into(),
            1,
            MAX_CONCURRENT_PERSPECTIVES.into(),
        ),
        (
            "maxConcurrentDrainConsumers",
            worker.max_concurrent_drain_consumers.into(),
            1,
            MAX_DRAIN_CONSUMERS.into(),
        ),
        (
            "drainConsumersPerDeployment",
            worker.drain_consumers_per_deployment.into(),
            1,
            MAX_DRAIN_CONSUMERS_PER_DEPLOYMENT.into(),
        ),
        (
            "drainLoopMaxIterations",
            worker.drain_loop_max_iterations.into(),
            1,
            MAX_DRAIN_LOOP_ITERATIONS.into(),
        ),
        (
            "drainLoopRefetchMinBatch",
            worker.drain_loop_refetch_min_batch.into(),
            1,
            MAX_DRAIN_REFETCH_MIN_BATCH.into(),
        ),
        (
            "heartbeatIntervalSeconds",
            worker.heartbeat_interval_seconds.into(),
            1,
            MAX_HEARTBEAT_INTERVAL_SECONDS.into(),
        ),
        (
            "maxPerspectiveEventAttempts",
            // (0 has its own message below.)
            worker.max_perspective_event_attempts.unwrap_or(1).into(),
            0,
            MAX_EVENT_ATTEMPTS.into(),
        ),
    ]
}

/// The `worker:` options that are durations, and the drain batcher's size, with their bounds.
fn worker_time_ranges(worker: &WorkerOptions) -> Vec<(&'static str, u64, u64, u64)> {
    vec![
        (
            "failureRetryBaseMilliseconds",
            worker.failure_retry_base_milliseconds,
            1,
            MAX_FAILURE_RETRY_BASE_MILLISECONDS,
        ),
        (
            "failureRetryMaxMilliseconds",
            worker.failure_retry_max_milliseconds,
            1,
            MAX_FAILURE_RETRY_MAX_MILLISECONDS,
        ),
        (
            "drainBatcher.slidingWindowMilliseconds",
            worker.drain_batcher.sliding_window_milliseconds,
            0,
            MAX_SLIDING_WINDOW_MILLISECONDS,
        ),
        (
            "drainBatcher.maxWaitMilliseconds",
            worker.drain_batcher.max_wait_milliseconds,
            0,
            MAX_BATCH_WAIT_MILLISECONDS,
        ),
        (
            "drainBatcher.maxSize",
            worker.drain_batcher.max_size.into(),
            1,
            MAX_DRAIN_BATCH_SIZE.into(),
        ),
        (
            "retryOptions.retryTimeoutSeconds",
            worker.retry_options.retry_timeout_seconds.into(),
            0,
            MAX_RETRY_TIMEOUT_SECONDS.into(),
        ),
        (
            "retryOptions.maxBackoffSeconds",
            worker.retry_options.max_backoff_seconds.into(),
            0,
            MAX_BACKOFF_SECONDS.into(),
        ),
    ]
}

fn check_worker_options(worker: &WorkerOptions, problems: &mut Vec<Problem>) {
    let mut ranges = worker_count_ranges(worker);
    ranges.extend(worker_time_ranges(worker));
    check_ranges("worker", &ranges, problems);
    if let Some(t) = worker.handler_timeout_milliseconds {
        if !(1..=MAX_HANDLER_TIMEOUT_MILLISECONDS).contains(&t) {
            problems.push(Problem::new(
                "worker.handlerTimeoutMilliseconds",
                format!(
                    "must be between 1 and {MAX_HANDLER_TIMEOUT_MILLISECONDS}, or null for no limit, got {t}"
                ),
            ));
        }
    }
    let connections = worker.database.max_connections;
    if !MAX_CONNECTIONS_RANGE.contains(&connections) {
        problems.push(Problem::new(
            "worker.database.maxConnections",
            format!(
                "must be between {} and {}, got {connections}",
                MAX_CONNECTIONS_RANGE.start(),
                MAX_CONNECTIONS_RANGE.end()
            ),
        ));
    }
    if worker
        .instance_metadata
        .contains_key(CONTENTION_METADATA_KEY)
    {
        problems.push(Problem::new(
            format!("worker.instanceMetadata.{CONTENTION_METADATA_KEY}"),
            "is reserved: each heartbeat records the lock conflicts of the last minute there",
        ));
    }
    if worker.max_perspective_event_attempts == Some(0) {
        problems.push(Problem::new(
            "worker.maxPerspectiveEventAttempts",
            "must be at least 1, or null to never dead-letter",
        ));
    }
    let multiplier = worker.retry_options.backoff_multiplier;
    if !(multiplier.is_finite() && (1.0..=MAX_BACKOFF_MULTIPLIER).contains(&multiplier)) {
        problems.push(Problem::new(
            "worker.retryOptions.backoffMultiplier",
            format!(
                "must be a number of at least 1.0 and at most {MAX_BACKOFF_MULTIPLIER}, got {multiplier}"
            ),
        ));
    }
    // A live instance that heartbeats less often than the abandonment threshold would
    // have its leases taken away while it is still working.
    if worker.heartbeat_interval_seconds >= worker.abandon_stale_instance_threshold_seconds
        && worker.heartbeat_interval_seconds > 0
    {
        problems.push(Problem::new(
            "worker.heartbeatIntervalSeconds",
            format!(
                "must be less than abandonStaleInstanceThresholdSeconds ({}), or live instances are abandoned",
                worker.abandon_stale_instance_threshold_seconds
            ),
        ));
    }
}

/// The problems of the `claimWorker:` options.
fn check_claim_worker_options(claim: &ClaimWorkerOptions, problems: &mut Vec<Problem>) {
    let ranges = [
        (
            "pollingIntervalMilliseconds",
            claim.polling_interval_milliseconds,
            1,
            MAX_POLLING_INTERVAL_MILLISECONDS,
        ),
        (
            "notifyHealthyPollingIntervalMilliseconds",
            claim.notify_healthy_polling_interval_milliseconds,
            1,
            MAX_POLLING_INTERVAL_MILLISECONDS,
        ),
        (
            "pollingMaxIntervalMilliseconds",
            claim.polling_max_interval_milliseconds,
            1,
            MAX_POLLING_INTERVAL_MILLISECONDS,
        ),
        (
            "maxStreamsPerBatch",
            claim.max_streams_per_batch.into(),
            1,
            MAX_STREAMS_PER_BATCH.into(),
        ),
    ];
    check_ranges("claimWorker", &ranges, problems);
}

/// Each (field, value, min, max) of `prefix` out of its range is a problem naming both ends.
fn check_ranges(prefix: &str, fields: &[(&str, u64, u64, u64)], problems: &mut Vec<Problem>) {
    for (field, value, min, max) in fields {
        if value < min {
            problems.push(Problem::new(
                format!("{prefix}.{field}"),
                format!("must be at least {min}, got {value}"),
            ));
        } else if value > max {
            problems.push(Problem::new(
                format!("{prefix}.{field}"),
                format!("must be at most {max}, got {value}"),
            ));
        }
    }
}

/// Validates handler or reset SQL: it must lex, hold at least one statement and leave the
/// worker's transaction alone.
fn check_apply_sql(sql: &str, what: &str, path: &str, problems: &mut Vec<Problem>) {
    let statements = match sql_params::parse_statements(sql) {
        Ok(statements) => statements,
        Err(e) => {
            problems.push(Problem::new(path, e.to_string()));
            return;
        }
    };
    if statements.is_empty() {
        problems.push(Problem::new(
            path,
            format!("{what} contains no SQL statement"),
        ));
    }
    for statement in &statements {
        if let Some(keyword) = statement.leading_keyword() {
            if TRANSACTION_CONTROL.contains(&keyword.as_str()) {
                problems.push(Problem::new(
                    path,
                    format!(
                        "{} is not allowed: the {what} runs inside the worker's transaction, which commits the model change together with the cursor",
                        keyword.to_uppercase()
                    ),
                ));
                continue;
            }
        }
        if let Some(why) = not_in_a_handler(&statement.leading_words(4)) {
            problems.push(Problem::new(
                path,
                format!("not allowed in a {what}: {why}"),
            ));
        }
    }
}

/// `setup` runs inside `migrate`'s one transaction: a statement that ends or splits it would
/// commit half a migration.
fn check_setup_transaction(setup: &str, path: &str, problems: &mut Vec<Problem>) {
    let Ok(statements) = sql_params::parse_statements(setup) else {
        return; // (reported with the parameter check)
    };
    for keyword in statements.iter().filter_map(|s| s.leading_keyword()) {
        if TRANSACTION_CONTROL.contains(&keyword.as_str()) {
            problems.push(Problem::new(
                path,
                format!(
                    "{} is not allowed: setup runs inside migrate's transaction, which applies the whole migration or none of it",
                    keyword.to_uppercase()
                ),
            ));
        }
    }
}

/// The longest `sequencingKey` accepted (it is compiled into `wh_drain`).
pub const MAX_SEQUENCING_KEY_LEN: usize = 4096;

/// `sequencingKey` is required by `sequencing: key`, used by nothing else, and one expression.
fn check_sequencing(perspective: &PerspectiveConfig, label: &str, problems: &mut Vec<Problem>) {
    let path = format!("{label}.sequencingKey");
    let key = match (perspective.sequencing, perspective.sequencing_key.as_deref()) {
        (Sequencing::Key, Some(key)) => key,
        (Sequencing::Key, None) => {
            return problems.push(Problem::new(
                path,
                "sequencing: key needs a sequencingKey, an SQL expression over the event's parameters (e.g. :data->>'customer')",
            ))
        }
        (mode, Some(_)) => {
            return problems.push(Problem::new(
                path,
                format!(
                    "sequencingKey is used only with sequencing: key (this perspective has sequencing: {})",
                    mode.as_str()
                ),
            ))
        }
        (_, None) => return,
    };
    if key.len() > MAX_SEQUENCING_KEY_LEN {
        return problems.push(Problem::new(
            path,
            format!("longer than {MAX_SEQUENCING_KEY_LEN} bytes"),
        ));
    }
    let statements = match sql_params::parse_statements(key) {
        Ok(statements) => statements,
        Err(e) => return problems.push(Problem::new(path, e.to_string())),
    };
    check_no_events(key, "sequencingKey", &path, problems);
    let statement_keyword = statements
        .first()
        .and_then(|s| s.leading_keyword())
        .filter(|k| EXPRESSION_IS_A_STATEMENT.contains(&k.as_str()));
    if statements.len() != 1 || key.trim_end().ends_with(';') || statement_keyword.is_some() {
        problems.push(Problem::new(
            path,
            "sequencingKey must be one SQL expression (e.g. :data->>'customer' or (SELECT …)), not a statement or a list of them",
        ));
    }
}

/// `keepPreviousVersions` is bounded and belongs to `rebuild: blueGreen`; a blue/green
/// perspective's name may not look like the internal name of one of its versions, and what
/// blue/green does not support yet is refused.
fn check_rebuild(perspective: &PerspectiveConfig, label: &str, problems: &mut Vec<Problem>) {
    if let Some(keep) = perspective.keep_previous_versions {
        if perspective.rebuild != Rebuild::BlueGreen {
            problems.push(Problem::new(
                format!("{label}.keepPreviousVersions"),
                "keepPreviousVersions is used only with rebuild: blueGreen (this perspective rebuilds in place)",
            ));
        } else if keep > MAX_KEEP_PREVIOUS_VERSIONS {
            problems.push(Problem::new(
                format!("{label}.keepPreviousVersions"),
                format!("{keep} is out of range: at most {MAX_KEEP_PREVIOUS_VERSIONS} previous versions are kept"),
            ));
        }
    }
    if crate::config::versions::looks_internal(&perspective.name) {
        problems.push(Problem::new(
            format!("{label}.name"),
            format!(
                "`{}` ends like the internal name of a perspective's version (`<name>__v<N>`); choose another name",
                perspective.name
            ),
        ));
    }
    if perspective.rebuild == Rebuild::BlueGreen && perspective.ordering == Ordering::EventId {
        problems.push(Problem::new(
            format!("{label}.rebuild"),
            "rebuild: blueGreen does not support ordering: eventId yet (a rollback catches up from the kept cursors, which assumes commit order); use rebuild: inPlace",
        ));
    }
}

/// Leading keywords that make a statement, which a `sequencingKey` expression cannot start with.
const EXPRESSION_IS_A_STATEMENT: [&str; 10] = [
    "select", "insert", "update", "delete", "with", "values", "merge", "create", "drop", "perform",
];

fn perspective_label(index: usize, name: &str) -> String {
    if name.is_empty() {
        format!("perspectives[{index}]")
    } else {
        format!("perspectives[{index}] ({name})")
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{parse, MINIMAL};

    /// A config that fails validation, the problem path it must report and a fragment of the
    /// message.
    type Case = (String, &'static str, &'static str);

    /// A one-perspective config whose OrderPlaced handler is `sql`.
    fn with_handler(sql: &str) -> String {
        format!(
            "schema: shop\nperspectives:\n  - name: order_summary\n    handlers:\n      OrderPlaced: {sql}\n"
        )
    }

    /// Cases about identifiers, names, handlers and the document's shape.
    fn shape_cases() -> Vec<Case> {
        vec![
            (
                MINIMAL.replace("schema: shop", "schema: Shop"),
                "schema",
                "must start with a lower-case letter",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: my-shop"),
                "schema",
                "contains '-'",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: public"),
                "schema",
                "`public` is reserved",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: information_schema"),
                "schema",
                "is reserved",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: pg_shop"),
                "schema",
                "pg_ are reserved",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: select"),
                "schema",
                "invalid schema name `select`: it is a reserved SQL keyword in PostgreSQL",
            ),
            (
                MINIMAL.replace("schema: shop", "schema: user"),
                "schema",
                "`user`: it is a reserved SQL keyword",
            ),
            (
                MINIMAL.replace("schema: shop", &format!("schema: {}", "s".repeat(41))),
                "schema",
                "at most 40 are allowed",
            ),
            (
                MINIMAL.replace("name: order_summary", "name: OrderSummary"),
                "perspectives[0] (OrderSummary).name",
                "invalid perspective name",
            ),
            (
                format!(
                "{MINIMAL}  - name: order_summary\n    handlers:\n      OrderShipped: SELECT 1\n"
            ),
                "perspectives[1] (order_summary).name",
                "duplicate perspective name",
            ),
            (
                "schema: shop\nperspectives: []\n".to_owned(),
                "perspectives",
                "at least one perspective",
            ),
            (
                format!("{MINIMAL}workers: {{}}\n"),
                "workers",
                "unknown field `workers`",
            ),
            (
                MINIMAL.replace("    handlers:", "    keepPreviousVersions: 2\n    handlers:"),
                "perspectives[0] (order_summary).keepPreviousVersions",
                "used only with rebuild: blueGreen",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    rebuild: blueGreen\n    keepPreviousVersions: 6\n    handlers:",
                ),
                "perspectives[0] (order_summary).keepPreviousVersions",
                "at most 5 previous versions",
            ),
            (
                MINIMAL.replace("    handlers:", "    rebuild: sideways\n    handlers:"),
                "perspectives[0].rebuild",
                "unknown variant `sideways`",
            ),
            (
                MINIMAL.replace("name: order_summary", "name: order_summary__v2"),
                "perspectives[0] (order_summary__v2).name",
                "internal name of a perspective's version",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    rebuild: blueGreen\n    ordering: eventId\n    reset: DELETE FROM t\n    handlers:",
                ),
                "perspectives[0] (order_summary).rebuild",
                "does not support ordering: eventId",
            ),
            (
                MINIMAL.replace("    handlers:", "    handlrs: {}\n    handlers:"),
                "perspectives[0].handlrs",
                "unknown field `handlrs`, expected one of",
            ),
        ]
    }

    /// Cases about worker and claim-worker options.
    fn option_cases() -> Vec<Case> {
        vec![
            (
                format!("{MINIMAL}worker:\n  leaseSecs: 5\n"),
                "worker.leaseSecs",
                "unknown field `leaseSecs`",
            ),
            (
                format!("{MINIMAL}worker:\n  drainBatcher: {{ maxSise: 5 }}\n"),
                "worker.drainBatcher.maxSise",
                "unknown field `maxSise`",
            ),
            (
                format!("{MINIMAL}worker:\n  leaseSeconds: -5\n"),
                "worker.leaseSeconds",
                "integer `-5`, expected u32",
            ),
            (
                "schema: shop\nperspectives: [\n".to_owned(),
                "perspectives",
                "at line 3, column 1",
            ),
            (
                "schema: shop\n  bad indent: 1\n".to_owned(),
                "",
                "mapping values are not allowed in this context",
            ),
            (
                "perspectives: []\n".to_owned(),
                "",
                "missing field `schema`",
            ),
            (
                format!("{MINIMAL}worker:\n  perspectiveBatchSize: 0\n"),
                "worker.perspectiveBatchSize",
                "must be at least 1, got 0",
            ),
            (
                format!("{MINIMAL}worker:\n  drainBatcher:\n    maxSize: 0\n"),
                "worker.drainBatcher.maxSize",
                "must be at least 1",
            ),
            (
                format!("{MINIMAL}worker:\n  maxPerspectiveEventAttempts: 0\n"),
                "worker.maxPerspectiveEventAttempts",
                "or null to never dead-letter",
            ),
            (
                format!("{MINIMAL}worker:\n  handlerTimeoutMilliseconds: 0\n"),
                "worker.handlerTimeoutMilliseconds",
                "or null for no limit, got 0",
            ),
            (
                format!("{MINIMAL}worker:\n  retryOptions: {{ backoffMultiplier: 0.5 }}\n"),
                "worker.retryOptions.backoffMultiplier",
                "at least 1.0 and at most 100, got 0.5",
            ),
            (
                format!("{MINIMAL}worker:\n  heartbeatIntervalSeconds: 30\n"),
                "worker.heartbeatIntervalSeconds",
                "less than abandonStaleInstanceThresholdSeconds (30)",
            ),
            (
                format!("{MINIMAL}worker:\n  instanceMetadata: {{ contention: low }}\n"),
                "worker.instanceMetadata.contention",
                "is reserved",
            ),
            (
                format!("{MINIMAL}claimWorker:\n  pollingIntervalMilliseconds: 0\n"),
                "claimWorker.pollingIntervalMilliseconds",
                "must be at least 1",
            ),
            (
                format!("{MINIMAL}worker:\n  completionStrategy: Eventually\n"),
                "worker.completionStrategy",
                "unknown variant `Eventually`",
            ),
        ]
    }

    /// Issue 26, finding 6: the values that broke the worker are refused, naming the bound
    /// (`maxConcurrentDrainConsumers: 4294967295` allocated until it aborted, a batch size of
    /// 2^32 − 1 applied nothing, a retry delay of 2^64 − 1 ms overflowed the timestamps).
    #[test]
    fn finding_6_every_numeric_option_has_an_upper_bound() {
        for (yaml, path, message) in [
            (
                "worker:\n  maxConcurrentDrainConsumers: 4294967295\n",
                "worker.maxConcurrentDrainConsumers",
                "must be at most 64, got 4294967295",
            ),
            (
                "worker:\n  perspectiveBatchSize: 4294967295\n",
                "worker.perspectiveBatchSize",
                "must be at most 10000, got 4294967295",
            ),
            (
                "worker:\n  failureRetryBaseMilliseconds: 18446744073709551615\n",
                "worker.failureRetryBaseMilliseconds",
                "must be at most 86400000",
            ),
            (
                "worker:\n  failureRetryMaxMilliseconds: 18446744073709551615\n",
                "worker.failureRetryMaxMilliseconds",
                "must be at most 604800000",
            ),
            (
                "worker:\n  retryOptions: { backoffMultiplier: 1000 }\n",
                "worker.retryOptions.backoffMultiplier",
                "at most 100, got 1000",
            ),
            (
                "claimWorker:\n  maxStreamsPerBatch: 4294967295\n",
                "claimWorker.maxStreamsPerBatch",
                "must be at most 100000",
            ),
            (
                "worker:\n  drainBatcher: { maxWaitMilliseconds: 18446744073709551615 }\n",
                "worker.drainBatcher.maxWaitMilliseconds",
                "must be at most 600000",
            ),
        ] {
            let text = format!("{}{yaml}", super::super::tests::MINIMAL);
            let error = crate::config::Config::from_yaml_str(&text, "test.yaml").unwrap_err();
            let problem = error
                .problems
                .iter()
                .find(|p| p.path == path)
                .unwrap_or_else(|| panic!("no problem at {path}: {error}"));
            assert!(
                problem.message.contains(message),
                "{path}: {}",
                problem.message
            );
        }
    }

    /// Cases about handler and reset SQL.
    fn handler_cases() -> Vec<Case> {
        vec![
            (
                with_handler("INSERT INTO t SELECT count(*), :data FROM :events"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                ":data (line 1, column 32) is one event's value, but this handler reads :events, so it runs once for a run of events: read each event's value from :events (columns stream_id,",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    reset: DELETE FROM t WHERE id IN (SELECT stream_id FROM :events)\n    handlers:",
                ),
                "perspectives[0] (order_summary).reset",
                ":events (line 1, column 50) is only for handlers, which then run once per run of events; a reset has no such run",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    sequencing: key\n    sequencingKey: (SELECT 1 FROM :events)\n    handlers:",
                ),
                "perspectives[0] (order_summary).sequencingKey",
                ":events (line 1, column 16) is only for handlers",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    setup: CREATE TABLE t AS SELECT * FROM :events\n    handlers:",
                ),
                "perspectives[0] (order_summary).setup",
                "setup runs at migrate time and cannot use :events",
            ),
            (
                with_handler("|\n        UPDATE order_summary\n        SET total = :totl"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "unknown parameter :totl at line 2, column 13 (known: :stream_id",
            ),
            (
                with_handler("SELECT 'unterminated"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "unterminated quoted string starting at line 1, column 8",
            ),
            (
                with_handler("UPDATE t SET a = 1 WHERE id = $1"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "positional parameter $1",
            ),
            (
                with_handler("-- nothing here"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "handler contains no SQL statement",
            ),
            (
                with_handler("COPY t FROM STDIN"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "not allowed in a handler: COPY streams",
            ),
            (
                with_handler("listen somewhere"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "not allowed in a handler: LISTEN is a session command",
            ),
            (
                with_handler("INSERT INTO t VALUES (1); SET ROLE postgres"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "not allowed in a handler: SET ROLE would switch",
            ),
            (
                with_handler("set  session   authorization admin"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "not allowed in a handler: SET SESSION AUTHORIZATION",
            ),
            (
                with_handler("CREATE UNIQUE INDEX CONCURRENTLY i ON t (a)"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "CREATE UNIQUE INDEX CONCURRENTLY cannot run inside a transaction",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    setup: CREATE TABLE t (a int); COMMIT; CREATE TABLE u (a int)\n    handlers:",
                ),
                "perspectives[0] (order_summary).setup",
                "COMMIT is not allowed: setup runs inside migrate's transaction",
            ),
            (
                with_handler("SELECT 1; COMMIT"),
                "perspectives[0] (order_summary).handlers.OrderPlaced",
                "COMMIT is not allowed",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    setup: CREATE TABLE t (id uuid DEFAULT :stream_id)\n    handlers:",
                ),
                "perspectives[0] (order_summary).setup",
                "setup runs at migrate time and cannot use :stream_id (line 1, column 33)",
            ),
            (
                MINIMAL.replace(
                    "    handlers:",
                    "    reset: DELETE FROM t WHERE x = :nope\n    handlers:",
                ),
                "perspectives[0] (order_summary).reset",
                "unknown parameter :nope",
            ),
            (
                MINIMAL.replace("    handlers:", "    reset: ''\n    handlers:"),
                "perspectives[0] (order_summary).reset",
                "reset contains no SQL statement",
            ),
            (
                "schema: shop\nperspectives:\n  - name: p\n    handlers: {}\n".to_owned(),
                "perspectives[0] (p).handlers",
                "at least one handler",
            ),
            (
                with_handler("SELECT 1\n      Order Placed: SELECT 2"),
                "perspectives[0] (order_summary).handlers[\"Order Placed\"]",
                "invalid event type mapping",
            ),
            (
                with_handler("SELECT 1\n      1Order: SELECT 2"),
                "perspectives[0] (order_summary).handlers[\"1Order\"]",
                "must start with a letter",
            ),
            (
                with_handler("SELECT 1\n      OrderPlaced: SELECT 2"),
                "perspectives[0].handlers",
                "duplicate event type `OrderPlaced`",
            ),
            (
                with_handler("\n        sql: SELECT 1"),
                "perspectives[0].handlers.OrderPlaced",
                "invalid type: map, expected a string",
            ),
        ]
    }

    #[test]
    fn invalid_configs_name_the_field_and_the_problem() {
        let long_name_path = format!("perspectives[0] ({}).name", "p".repeat(64));
        let mut cases: Vec<(String, &str, &str)> = shape_cases()
            .into_iter()
            .chain(handler_cases())
            .chain(option_cases())
            .collect();
        cases.push((
            MINIMAL.replace("name: order_summary", &format!("name: {}", "p".repeat(64))),
            &long_name_path,
            "at most 63",
        ));
        // Check every case before failing, so one run shows all mismatches.
        let mut failures = Vec::new();
        for (text, path, fragment) in &cases {
            match parse(text) {
                Ok(_) => failures.push(format!("accepted:\n{text}")),
                Err(error) => {
                    assert_eq!(error.source, "test.yaml");
                    let found = error
                        .problems
                        .iter()
                        .any(|p| p.path == *path && p.message.contains(fragment));
                    if !found {
                        failures.push(format!(
                            "expected `{path}` with `{fragment}`, got:\n{error}\nfor:\n{text}"
                        ));
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
        assert!(cases.len() >= 14);
    }

    #[test]
    fn all_problems_are_reported_together_one_line_each() {
        let error = parse(
            "schema: public
perspectives:
  - name: Bad
    setup: CREATE TABLE t (a text DEFAULT :user_id)
    handlers:
      A: SELECT :totl
  - name: Bad
    handlers:
      B: SELECT 1
worker:
  leaseSeconds: 0
",
        )
        .unwrap_err();
        let paths: Vec<_> = error.problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "schema",
                "perspectives[0] (Bad).name",
                "perspectives[0] (Bad).setup",
                "perspectives[0] (Bad).handlers.A",
                "perspectives[1] (Bad).name",
                "perspectives[1] (Bad).name",
                "worker.leaseSeconds",
            ]
        );
        let text = error.to_string();
        assert_eq!(text.lines().count(), paths.len());
        assert!(text
            .lines()
            .all(|line| line.starts_with("test.yaml: perspectives[")
                || line.starts_with("test.yaml: schema: ")
                || line.starts_with("test.yaml: worker.")));
        assert!(text.contains(
            "test.yaml: perspectives[0] (Bad).handlers.A: unknown parameter :totl at line 1, column 8 (known: "
        ));
    }

    #[test]
    fn validate_checks_a_deserialized_config() {
        let mut config = parse(MINIMAL).unwrap();
        assert_eq!(config.validate(), Ok(()));
        config.worker.perspective_batch_size = 0;
        let error = config.validate().unwrap_err();
        assert_eq!(error.source, "config");
        assert_eq!(error.problems[0].path, "worker.perspectiveBatchSize");
    }
}
