//! The perspective configuration: which schema to use, the perspectives (read models) with
//! their handler SQL, and the worker's tuning options.
//!
//! The same document is the `spec` of the operator's custom resource, so every type here also
//! derives a JSON schema; the doc comments on the fields become the CRD's field descriptions.
//! Loading always validates, and validation reports every problem it finds at once, each with
//! the path of the offending field.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;

use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::de::{Deserializer, Error as _, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use sql_params::ParsedStatement;

pub mod sql_params;
pub mod yaml_limits;

/// Longest allowed schema name. NOTIFY channels are named `<schema>_work`, `<schema>_applied`
/// and so on, and PostgreSQL truncates identifiers beyond 63 bytes, so the schema leaves room.
pub const MAX_SCHEMA_LEN: usize = 40;
/// Longest allowed perspective name (PostgreSQL's identifier limit).
pub const MAX_PERSPECTIVE_NAME_LEN: usize = 63;
/// Longest allowed event type.
pub const MAX_EVENT_TYPE_LEN: usize = 200;

pub const SCHEMA_PATTERN: &str = "^[a-z_][a-z0-9_]{0,39}$";
const PERSPECTIVE_NAME_PATTERN: &str = "^[a-z_][a-z0-9_]{0,62}$";
const RESERVED_SCHEMAS: [&str; 3] = ["public", "pg_catalog", "information_schema"];
/// PostgreSQL's reserved keywords (`pg_get_keywords()` categories R and T, PostgreSQL 15–18):
/// not usable as a schema name unless quoted, and the generated SQL does not quote it.
const RESERVED_KEYWORDS: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

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

/// A perspective deployment: one PostgreSQL schema, its perspectives and worker options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// PostgreSQL schema holding this deployment's event store, work tables and models (lower-case, at most 40 characters).
    #[schemars(pattern(SCHEMA_PATTERN))]
    pub schema: String,
    /// The perspectives (read models) to keep up to date; at least one.
    #[schemars(length(min = 1))]
    pub perspectives: Vec<PerspectiveConfig>,
    /// Tuning of the perspective worker that applies events; every field has a default.
    #[serde(default)]
    pub worker: WorkerOptions,
    /// Tuning of the claim worker that polls for new work; every field has a default.
    #[serde(default)]
    pub claim_worker: ClaimWorkerOptions,
}

/// One perspective: a read model maintained by SQL handlers, one per event type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PerspectiveConfig {
    /// Perspective name, unique in the deployment (lower-case letters, digits and underscores).
    #[schemars(pattern(PERSPECTIVE_NAME_PATTERN))]
    pub name: String,
    /// Version of the model built by these handlers (default 1). Raising it makes migrate rebuild the perspective online from the event store, stream by stream (needs `reset`).
    #[serde(default = "default_perspective_version")]
    #[schemars(range(min = 1))]
    pub version: u32,
    /// Order of applying a stream's events: commit (default) or eventId (rewinds on late events).
    #[serde(default)]
    pub ordering: Ordering,
    /// Idempotent DDL run by migrate with the schema on the search_path; cannot use :parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// SQL that removes one stream's share of the model (may use :stream_id); enables rewind and rebuild.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    /// Event type to SQL run once per event in the apply transaction, with :stream_id, :data and other parameters.
    // Kept in file order: handlers are listed, registered and reported as the user wrote them.
    #[serde(deserialize_with = "deserialize_handlers")]
    #[schemars(with = "BTreeMap<String, String>", extend("minProperties" = 1))]
    pub handlers: IndexMap<String, String>,
}

fn default_perspective_version() -> u32 {
    1
}

/// The order in which a stream's events are applied to a perspective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Ordering {
    /// Apply in stream version (commit) order.
    #[default]
    Commit,
    /// Apply in event id order; an event older than the last applied one rewinds the stream.
    EventId,
}

/// How applied work rows are removed from the work table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum CompletionStrategy {
    /// Delete applied work rows in batches after the apply transaction commits.
    #[default]
    Batched,
    /// Delete applied work rows inside the apply transaction.
    Instant,
}

/// Largest `worker.handlerTimeoutMilliseconds`: twice it must fit PostgreSQL's
/// `statement_timeout` (a 32-bit count of ms).
pub const MAX_HANDLER_TIMEOUT_MILLISECONDS: u64 = 1_000_000_000;

/// Options of the perspective worker (names and defaults follow PerspectiveWorkerOptions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WorkerOptions {
    /// Apply attempts before a work row is dead-lettered; null never dead-letters (default 10).
    #[schemars(range(min = 1))]
    pub max_perspective_event_attempts: Option<u32>,
    /// Custom PerspectiveRunner only: lease on the work rows handed to the runner (no other live instance takes a leased row before it expires), and how long the worker's dedup cache keeps skipping applied rows after their completion was flushed, in seconds (default 300). No effect on compiled SQL perspectives: wh_drain claims and applies rows in one transaction under the stream's ownership, without row leases or the dedup cache.
    #[schemars(range(min = 1))]
    pub lease_seconds: u32,
    /// Seconds without a heartbeat before an instance is abandoned and its streams and leases released (default 30).
    #[schemars(range(min = 1))]
    pub abandon_stale_instance_threshold_seconds: u32,
    /// Keep completed work rows for debugging, stamped with processed_at, instead of deleting them (default false).
    pub debug_mode: bool,
    /// Consecutive empty claim polls before the worker reports itself idle (the WorkProcessingIdle hook) (default 2).
    #[schemars(range(min = 1))]
    pub idle_threshold_polls: u32,
    /// Most events of one (stream, perspective) handed to one call of its apply function (or of a custom PerspectiveRunner); the model change and the cursor advance of a call commit together (default 100).
    #[schemars(range(min = 1))]
    pub perspective_batch_size: u32,
    /// Custom PerspectiveRunner only: (stream, perspective) groups of one drain batch applied concurrently, each on its own connection (default 30). No effect on compiled SQL perspectives: one wh_drain call applies a whole batch inside the database, so their parallelism is maxConcurrentDrainConsumers.
    #[schemars(range(min = 1))]
    pub max_concurrent_perspectives: u32,
    /// Parallel drain consumer loops, each applying its own batch of streams (default 4).
    #[schemars(range(min = 1))]
    pub max_concurrent_drain_consumers: u32,
    /// Drain rounds one batch runs for a stream that still has due work before handing it back to the drain queue; 1 is single-pass (default 5).
    #[schemars(range(min = 1))]
    pub drain_loop_max_iterations: u32,
    /// Work rows a drain round must take for a stream (all perspectives together) for the stream to be fetched again in the same batch (default 2).
    #[schemars(range(min = 1))]
    pub drain_loop_refetch_min_batch: u32,
    /// Sliding-window batching of drain signals (defaults 300 ms window, 3000 ms max wait, 1000 signals).
    pub drain_batcher: DrainBatcherOptions,
    /// Retry with backoff for unacknowledged completion reports (defaults 1 s, exponential x2, max 60 s).
    pub retry_options: RetryOptions,
    /// When applied work rows are deleted: Batched (default) or Instant.
    pub completion_strategy: CompletionStrategy,
    /// Interval between heartbeats in wh_service_instances, in seconds (default 10).
    #[schemars(range(min = 1))]
    pub heartbeat_interval_seconds: u32,
    /// First retry delay after a handler fails, in ms; doubles with each further failure of the event: 1 s, 2 s, 4 s … with the default, up to failureRetryMaxMilliseconds (default 1000).
    #[schemars(range(min = 1))]
    pub failure_retry_base_milliseconds: u64,
    /// Longest retry delay after a handler fails, in ms (default 300000).
    #[schemars(range(min = 1))]
    pub failure_retry_max_milliseconds: u64,
    /// Longest an event's SQL handler may run, in ms; null: no limit (default 30000). A handler still running is cancelled once it has run this long, at the latest twice this long (the bound is the statement timeout of the wh_drain call, which starts no event after this long), and the event fails like any other: retried with backoff, then dead-lettered. A lock wait outside the handlers is cancelled the same way and recorded on its (stream, perspective). Compiled SQL perspectives only; a custom PerspectiveRunner bounds its own work.
    #[schemars(range(min = 1, max = 1_000_000_000))]
    pub handler_timeout_milliseconds: Option<u64>,
    /// Lifecycle stages: fire the PostPerspective hook once per event and perspective after it is applied, and once every subscribed perspective applied an event, NOTIFY `<schema>_applied` with its id (read-your-writes) and fire the PostAllPerspectives / PostLifecycle hooks, recorded in wh_lifecycle_completions (default false).
    pub notify_applied: bool,
    /// Extra key/value metadata recorded with this instance in wh_service_instances (default empty).
    pub instance_metadata: BTreeMap<String, String>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            max_perspective_event_attempts: Some(10),
            lease_seconds: 300,
            abandon_stale_instance_threshold_seconds: 30,
            debug_mode: false,
            idle_threshold_polls: 2,
            perspective_batch_size: 100,
            max_concurrent_perspectives: 30,
            max_concurrent_drain_consumers: 4,
            drain_loop_max_iterations: 5,
            drain_loop_refetch_min_batch: 2,
            drain_batcher: DrainBatcherOptions::default(),
            retry_options: RetryOptions::default(),
            completion_strategy: CompletionStrategy::Batched,
            heartbeat_interval_seconds: 10,
            failure_retry_base_milliseconds: 1000,
            failure_retry_max_milliseconds: 300_000,
            handler_timeout_milliseconds: Some(30_000),
            notify_applied: false,
            instance_metadata: BTreeMap::new(),
        }
    }
}

/// Sliding-window batching of drain signals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DrainBatcherOptions {
    /// Quiet period that closes a batch of drain signals, in ms (default 300). Only while another batch is being applied: an idle worker drains a lone signal at once, and signals that arrive together never wait.
    pub sliding_window_milliseconds: u64,
    /// Longest a batch of drain signals is held open, in ms (default 3000).
    pub max_wait_milliseconds: u64,
    /// Stream ids that close a batch at once (default 1000). The worker sizes batches so that one drain call stays near 10000 rows: until a call has reported how many rows its streams had, and whenever they are deep, at 10000 / (perspectiveBatchSize × number of perspectives) ids (50 with the defaults and 2 perspectives); when the last call found fewer rows per stream, proportionally more, up to maxSize (1000 streams of one event each fill one call).
    #[schemars(range(min = 1))]
    pub max_size: u32,
}

impl Default for DrainBatcherOptions {
    fn default() -> Self {
        Self {
            sliding_window_milliseconds: 300,
            max_wait_milliseconds: 3000,
            max_size: 1000,
        }
    }
}

/// Retry of completion reports that were not acknowledged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RetryOptions {
    /// Seconds before an unacknowledged report is retried the first time (default 1).
    pub retry_timeout_seconds: u32,
    /// Multiply the retry timeout by backoffMultiplier on every retry (default true).
    pub enable_exponential_backoff: bool,
    /// Factor applied to the retry timeout per retry, at least 1.0 (default 2.0).
    #[schemars(range(min = 1.0))]
    pub backoff_multiplier: f64,
    /// Upper bound of the retry timeout, in seconds (default 60).
    pub max_backoff_seconds: u32,
}

impl Default for RetryOptions {
    fn default() -> Self {
        Self {
            retry_timeout_seconds: 1,
            enable_exponential_backoff: true,
            backoff_multiplier: 2.0,
            max_backoff_seconds: 60,
        }
    }
}

/// Options of the claim worker, which polls for claimable work and feeds the drain consumers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ClaimWorkerOptions {
    /// Base interval between claim polls while LISTEN/NOTIFY is unavailable, in ms (default 250).
    #[schemars(range(min = 1))]
    pub polling_interval_milliseconds: u64,
    /// Base interval between claim polls while LISTEN/NOTIFY is healthy, in ms; never below pollingIntervalMilliseconds (default 5000).
    #[schemars(range(min = 1))]
    pub notify_healthy_polling_interval_milliseconds: u64,
    /// Cap of the interval while LISTEN/NOTIFY is healthy, which doubles with each consecutive empty poll, in ms; never below the base interval nor above a third of abandonStaleInstanceThresholdSeconds (default 10000). While NOTIFY is down every poll waits pollingIntervalMilliseconds.
    #[schemars(range(min = 1))]
    pub polling_max_interval_milliseconds: u64,
    /// Unowned streams one claim poll takes, and streams it hands to the drain consumers beyond those already queued or being drained, at most (default 1000).
    #[schemars(range(min = 1))]
    pub max_streams_per_batch: u32,
    /// Keep polling on a timer while NOTIFY is healthy, in case a notification is lost (default true).
    pub enable_safety_net_poll: bool,
}

impl Default for ClaimWorkerOptions {
    fn default() -> Self {
        Self {
            polling_interval_milliseconds: 250,
            notify_healthy_polling_interval_milliseconds: 5000,
            polling_max_interval_milliseconds: 10_000,
            max_streams_per_batch: 1000,
            enable_safety_net_poll: true,
        }
    }
}

/// Options an older worker accepted that had no effect, with what to do instead. A config that
/// still sets one is rejected with this message rather than serde's bare "unknown field".
pub const REMOVED_OPTIONS: [(&str, &str); 4] = [
    (
        "worker.pollingIntervalMilliseconds",
        "use claimWorker.pollingIntervalMilliseconds (the claim loop is the only poller)",
    ),
    (
        "worker.notifyHealthyPollingIntervalMilliseconds",
        "use claimWorker.notifyHealthyPollingIntervalMilliseconds (the claim loop is the only poller)",
    ),
    (
        "worker.maxStreamsPerBatch",
        "use claimWorker.maxStreamsPerBatch (streams claimed per poll)",
    ),
    (
        "worker.partitionCount",
        "streams are hashed into a fixed 10000 partitions (compute_partition); delete the option",
    ),
];

/// A problem for every removed option `text` still sets (none when it is not YAML).
fn removed_option_problems(text: &str) -> Vec<Problem> {
    let Ok(document) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        return Vec::new();
    };
    REMOVED_OPTIONS
        .iter()
        .filter(|(path, _)| {
            let (section, field) = path.split_once('.').expect("section.field");
            document.get(section).and_then(|s| s.get(field)).is_some()
        })
        .map(|(path, instead)| Problem::new(*path, format!("was removed: {instead}")))
        .collect()
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
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
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

impl Config {
    /// Parses and validates a YAML config; `source` names it in error messages.
    pub fn from_yaml_str(text: &str, source: &str) -> Result<Config, ConfigError> {
        let error = |problems| ConfigError {
            source: source.to_owned(),
            problems,
        };
        if let Some(refusal) = yaml_limits::refusal(text) {
            return Err(error(vec![Problem::new("", refusal)]));
        }
        let config: Config = serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(
            text,
        ))
        .map_err(|e| {
            // A removed option is an unknown field to serde: say what replaced it.
            let mut problems = removed_option_problems(text);
            let problem = yaml_problem(&e);
            if !problems.iter().any(|p| p.path == problem.path) {
                problems.push(problem);
            }
            error(problems)
        })?;
        let problems = config.problems();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(error(problems))
        }
    }

    /// Reads, parses and validates a YAML config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let source = path.display().to_string();
        let refused = |message| ConfigError {
            source: source.clone(),
            problems: vec![Problem::new("", message)],
        };
        // Not read at all when too large (it could be a device that never ends).
        let size = std::fs::metadata(path)
            .map_err(|e| refused(format!("cannot read file: {e}")))?
            .len();
        if size > yaml_limits::MAX_CONFIG_BYTES as u64 {
            return Err(refused(yaml_limits::too_large(size)));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| refused(format!("cannot read file: {e}")))?;
        Config::from_yaml_str(&text, &source)
    }

    /// Validates an already-deserialized config (for example a custom resource's spec).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = self.problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError {
                source: "config".to_owned(),
                problems,
            })
        }
    }

    /// Every validation problem of the config; empty when it is valid.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if let Err(message) = check_schema_name(&self.schema) {
            problems.push(Problem::new("schema", message));
        }
        if self.perspectives.is_empty() {
            problems.push(Problem::new(
                "perspectives",
                "at least one perspective is required",
            ));
        }
        let mut seen = HashSet::new();
        for (index, perspective) in self.perspectives.iter().enumerate() {
            let label = perspective_label(index, &perspective.name);
            if !seen.insert(perspective.name.as_str()) {
                problems.push(Problem::new(
                    format!("{label}.name"),
                    format!("duplicate perspective name `{}`", perspective.name),
                ));
            }
            perspective.check(&label, &mut problems);
        }
        self.worker.check(&mut problems);
        self.claim_worker.check(&mut problems);
        problems
    }

    /// Every (perspective, event type) pair the config subscribes to, in config order.
    pub fn subscriptions(&self) -> Vec<(String, String)> {
        self.perspectives
            .iter()
            .flat_map(|p| {
                p.event_types()
                    .map(|event_type| (p.name.clone(), event_type.to_owned()))
            })
            .collect()
    }

    /// The perspective with this name.
    pub fn perspective(&self, name: &str) -> Option<&PerspectiveConfig> {
        self.perspectives.iter().find(|p| p.name == name)
    }
}

impl PerspectiveConfig {
    /// The event types this perspective handles, in config order.
    pub fn event_types(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }

    /// Each handler's statements, in config order.
    ///
    /// # Panics
    /// If a handler does not lex; call only on a config that passed validation.
    pub fn compiled_handlers(&self) -> Vec<(String, Vec<ParsedStatement>)> {
        self.handlers
            .iter()
            .map(|(event_type, sql)| {
                let statements = sql_params::parse_statements(sql).unwrap_or_else(|e| {
                    panic!(
                        "handler {event_type} of {} is not validated: {e}",
                        self.name
                    )
                });
                (event_type.clone(), statements)
            })
            .collect()
    }

    /// The `reset` statements, if the perspective has any.
    ///
    /// # Panics
    /// If `reset` does not lex; call only on a config that passed validation.
    pub fn compiled_reset(&self) -> Option<Vec<ParsedStatement>> {
        self.reset.as_deref().map(|sql| {
            sql_params::parse_statements(sql)
                .unwrap_or_else(|e| panic!("reset of {} is not validated: {e}", self.name))
        })
    }

    fn check(&self, label: &str, problems: &mut Vec<Problem>) {
        if let Err(message) = check_identifier(&self.name, MAX_PERSPECTIVE_NAME_LEN) {
            problems.push(Problem::new(
                format!("{label}.name"),
                format!("invalid perspective name `{}`: {message}", self.name),
            ));
        }
        if self.version == 0 {
            problems.push(Problem::new(
                format!("{label}.version"),
                "version starts at 1; raise it to rebuild the perspective",
            ));
        }
        if let Some(setup) = &self.setup {
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
        }
        if let Some(reset) = &self.reset {
            // An empty reset would let a rewind replay events on top of the old model.
            check_apply_sql(reset, "reset", &format!("{label}.reset"), problems);
        }
        if self.ordering == Ordering::EventId && self.reset.is_none() {
            problems.push(Problem::new(
                format!("{label}.reset"),
                "ordering: eventId needs a reset: a late event rewinds the stream (reset, then replay in event-id order)",
            ));
        }
        if self.handlers.is_empty() {
            problems.push(Problem::new(
                format!("{label}.handlers"),
                "at least one handler (event type: SQL) is required",
            ));
        }
        for (event_type, sql) in &self.handlers {
            if let Err(message) = check_event_type(event_type) {
                problems.push(Problem::new(
                    format!("{label}.handlers[{event_type:?}]"),
                    format!("invalid event type mapping: {message}"),
                ));
                continue;
            }
            check_apply_sql(
                sql,
                "handler",
                &format!("{label}.handlers.{event_type}"),
                problems,
            );
        }
    }
}

/// Rows one drain claim+fetch aims for; it caps the stream ids of a drain batch (see
/// [`WorkerOptions::drain_batch_limit`]).
pub const DRAIN_ROWS_PER_FETCH: usize = 10_000;

impl WorkerOptions {
    /// Stream ids one drain batch may hold: `drainBatcher.maxSize`, capped so that the batch's
    /// full-depth groups (`perspectiveBatchSize` rows for each of `perspectives`) stay within
    /// [`DRAIN_ROWS_PER_FETCH`] rows; at least 1. What the channel holds beyond it goes to the
    /// other drain consumers, which work in parallel.
    pub fn drain_batch_limit(&self, perspectives: usize) -> usize {
        let per_stream = self.perspective_batch_size.max(1) as usize * perspectives.max(1);
        (self.drain_batcher.max_size as usize).min((DRAIN_ROWS_PER_FETCH / per_stream).max(1))
    }

    fn check(&self, problems: &mut Vec<Problem>) {
        let at_least_one = [
            ("leaseSeconds", self.lease_seconds.into()),
            (
                "abandonStaleInstanceThresholdSeconds",
                self.abandon_stale_instance_threshold_seconds.into(),
            ),
            ("idleThresholdPolls", self.idle_threshold_polls.into()),
            ("perspectiveBatchSize", self.perspective_batch_size.into()),
            (
                "maxConcurrentPerspectives",
                self.max_concurrent_perspectives.into(),
            ),
            (
                "maxConcurrentDrainConsumers",
                self.max_concurrent_drain_consumers.into(),
            ),
            (
                "drainLoopMaxIterations",
                self.drain_loop_max_iterations.into(),
            ),
            (
                "drainLoopRefetchMinBatch",
                self.drain_loop_refetch_min_batch.into(),
            ),
            ("drainBatcher.maxSize", self.drain_batcher.max_size.into()),
            (
                "heartbeatIntervalSeconds",
                self.heartbeat_interval_seconds.into(),
            ),
        ];
        check_at_least_one("worker", &at_least_one, problems);
        if let Some(t) = self.handler_timeout_milliseconds {
            if !(1..=MAX_HANDLER_TIMEOUT_MILLISECONDS).contains(&t) {
                problems.push(Problem::new(
                    "worker.handlerTimeoutMilliseconds",
                    format!(
                        "must be between 1 and {MAX_HANDLER_TIMEOUT_MILLISECONDS}, or null for no limit, got {t}"
                    ),
                ));
            }
        }
        if self.max_perspective_event_attempts == Some(0) {
            problems.push(Problem::new(
                "worker.maxPerspectiveEventAttempts",
                "must be at least 1, or null to never dead-letter",
            ));
        }
        let multiplier = self.retry_options.backoff_multiplier;
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            problems.push(Problem::new(
                "worker.retryOptions.backoffMultiplier",
                format!("must be a number of at least 1.0, got {multiplier}"),
            ));
        }
        // A live instance that heartbeats less often than the abandonment threshold would
        // have its leases taken away while it is still working.
        if self.heartbeat_interval_seconds >= self.abandon_stale_instance_threshold_seconds
            && self.heartbeat_interval_seconds > 0
        {
            problems.push(Problem::new(
                "worker.heartbeatIntervalSeconds",
                format!(
                    "must be less than abandonStaleInstanceThresholdSeconds ({}), or live instances are abandoned",
                    self.abandon_stale_instance_threshold_seconds
                ),
            ));
        }
    }
}

impl ClaimWorkerOptions {
    fn check(&self, problems: &mut Vec<Problem>) {
        let at_least_one = [
            (
                "pollingIntervalMilliseconds",
                self.polling_interval_milliseconds,
            ),
            (
                "notifyHealthyPollingIntervalMilliseconds",
                self.notify_healthy_polling_interval_milliseconds,
            ),
            (
                "pollingMaxIntervalMilliseconds",
                self.polling_max_interval_milliseconds,
            ),
            ("maxStreamsPerBatch", self.max_streams_per_batch.into()),
        ];
        check_at_least_one("claimWorker", &at_least_one, problems);
    }
}

fn check_at_least_one(prefix: &str, fields: &[(&str, u64)], problems: &mut Vec<Problem>) {
    for (field, value) in fields {
        if *value < 1 {
            problems.push(Problem::new(
                format!("{prefix}.{field}"),
                format!("must be at least 1, got {value}"),
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
            }
        }
    }
}

fn perspective_label(index: usize, name: &str) -> String {
    if name.is_empty() {
        format!("perspectives[{index}]")
    } else {
        format!("perspectives[{index}] ({name})")
    }
}

/// Checks an unquoted lower-case PostgreSQL identifier: `[a-z_][a-z0-9_]*`, at most `max_len`.
fn check_identifier(name: &str, max_len: usize) -> Result<(), String> {
    let mut chars = name.chars();
    match chars.next() {
        None => return Err("must not be empty".to_owned()),
        Some(c) if !(c.is_ascii_lowercase() || c == '_') => {
            return Err("must start with a lower-case letter or underscore".to_owned())
        }
        Some(_) => {}
    }
    if let Some(c) = chars.find(|&c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')) {
        return Err(format!(
            "contains {c:?}; use lower-case letters, digits and underscores"
        ));
    }
    let len = name.len();
    if len > max_len {
        return Err(format!(
            "is {len} characters long; at most {max_len} are allowed"
        ));
    }
    Ok(())
}

fn check_schema_name(schema: &str) -> Result<(), String> {
    check_identifier(schema, MAX_SCHEMA_LEN).map_err(|message| {
        let message = format!("invalid schema name `{schema}`: {message}");
        if schema.len() > MAX_SCHEMA_LEN {
            // Say why the limit is lower than PostgreSQL's own.
            format!("{message} so that NOTIFY channel names such as `{schema}_work` stay valid")
        } else {
            message
        }
    })?;
    if RESERVED_KEYWORDS.contains(&schema) {
        return Err(format!(
            "invalid schema name `{schema}`: it is a reserved SQL keyword in PostgreSQL; \
             choose another name (e.g. `{schema}_events`)"
        ));
    }
    if RESERVED_SCHEMAS.contains(&schema) {
        return Err(format!(
            "schema `{schema}` is reserved; give each deployment a schema of its own"
        ));
    }
    if schema.starts_with("pg_") {
        return Err(format!(
            "invalid schema name `{schema}`: names starting with pg_ are reserved by PostgreSQL"
        ));
    }
    Ok(())
}

/// Checks an event type key: `[A-Za-z_][A-Za-z0-9_.:+-]*`, at most 200 characters.
fn check_event_type(event_type: &str) -> Result<(), String> {
    let mut chars = event_type.chars();
    match chars.next() {
        None => return Err("the event type is empty".to_owned()),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err(format!(
                "event type {event_type:?} must start with a letter or underscore"
            ))
        }
        Some(_) => {}
    }
    if let Some(c) = chars.find(|&c| !(c.is_ascii_alphanumeric() || "_.:+-".contains(c))) {
        return Err(format!(
            "event type {event_type:?} contains {c:?}; use letters, digits and _ . : + -"
        ));
    }
    let len = event_type.chars().count();
    if len > MAX_EVENT_TYPE_LEN {
        return Err(format!(
            "event type is {len} characters long; at most {MAX_EVENT_TYPE_LEN} are allowed"
        ));
    }
    Ok(())
}

/// Turns a YAML parse or type error into a problem whose path is the full field path
/// (including an unknown key) and whose message keeps serde_yaml's wording.
fn yaml_problem(error: &serde_path_to_error::Error<serde_yaml::Error>) -> Problem {
    let path = match error.path().to_string() {
        // `.` is the document root and `?` an unknown position (syntax errors).
        root if root == "." || root == "?" => String::new(),
        path => path,
    };
    let inner = error.inner();
    let text = inner.to_string();
    // serde_yaml puts its own location and (shorter) path into the text; drop the path, which
    // the problem already carries, and move the location to the end in our format.
    let Some(location) = inner.location() else {
        return Problem::new(&path, strip_path_prefix(&text, &path));
    };
    let (line, column) = (location.line(), location.column());
    let text = text.replacen(&format!(" at line {line} column {column}"), "", 1);
    let message = format!(
        "{} at line {line}, column {column}",
        strip_path_prefix(&text, &path)
    );
    Problem::new(path, message)
}

/// Removes a leading `<prefix of path>: ` from `message`.
fn strip_path_prefix<'a>(message: &'a str, path: &str) -> &'a str {
    let cuts = path
        .char_indices()
        .filter(|&(_, c)| c == '.' || c == '[')
        .map(|(i, _)| i)
        .chain([path.len()]);
    let mut cuts: Vec<usize> = cuts.filter(|&i| i > 0).collect();
    cuts.reverse();
    cuts.into_iter()
        .find_map(|end| {
            message
                .strip_prefix(&path[..end])
                .and_then(|rest| rest.strip_prefix(": "))
        })
        .unwrap_or(message)
}

/// Deserializes the handler map, keeping file order and rejecting a repeated event type
/// (plain map deserialization would silently keep only the last one).
fn deserialize_handlers<'de, D>(deserializer: D) -> Result<IndexMap<String, String>, D::Error>
where
    D: Deserializer<'de>,
{
    struct HandlersVisitor;

    impl<'de> Visitor<'de> for HandlersVisitor {
        type Value = IndexMap<String, String>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a mapping from event type to handler SQL")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut handlers = IndexMap::with_capacity(map.size_hint().unwrap_or(0));
            while let Some(event_type) = map.next_key::<String>()? {
                if handlers.contains_key(&event_type) {
                    return Err(A::Error::custom(format!(
                        "duplicate event type `{event_type}` in handlers"
                    )));
                }
                let sql = map.next_value::<String>()?;
                handlers.insert(event_type, sql);
            }
            Ok(handlers)
        }
    }

    deserializer.deserialize_map(HandlersVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "\
schema: shop
perspectives:
  - name: order_summary
    handlers:
      OrderPlaced: INSERT INTO order_summary (order_id) VALUES (:stream_id)
";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_yaml_str(text, "test.yaml")
    }

    #[test]
    fn example_shop_config_is_valid() {
        let config =
            Config::from_yaml_str(include_str!("../../../examples/shop.yaml"), "shop.yaml")
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.schema, "shop");
        let names: Vec<_> = config
            .perspectives
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, ["order_summary", "customer_stats"]);
        let orders = config.perspective("order_summary").unwrap();
        assert_eq!(
            orders.event_types().collect::<Vec<_>>(),
            ["OrderPlaced", "OrderShipped", "OrderCancelled"]
        );
        let uses_user_id = orders
            .compiled_handlers()
            .iter()
            .flat_map(|(_, statements)| statements)
            .any(|s| s.params().contains(&sql_params::Param::UserId));
        assert!(uses_user_id, "order_summary records the last user");
        for perspective in &config.perspectives {
            assert!(perspective.setup.is_some());
            assert!(!perspective.compiled_reset().unwrap().is_empty());
        }
        assert_eq!(
            config.subscriptions(),
            [
                ("order_summary", "OrderPlaced"),
                ("order_summary", "OrderShipped"),
                ("order_summary", "OrderCancelled"),
                ("customer_stats", "OrderPlaced"),
                ("customer_stats", "OrderCancelled"),
            ]
            .map(|(p, e)| (p.to_owned(), e.to_owned()))
        );
    }

    #[test]
    fn missing_and_empty_sections_give_defaults() {
        let config = parse(&format!("{MINIMAL}worker:\nclaimWorker: {{}}\n")).unwrap();
        assert_eq!(config.worker, WorkerOptions::default());
        assert_eq!(config.claim_worker, ClaimWorkerOptions::default());
        assert_eq!(parse(MINIMAL).unwrap().worker, WorkerOptions::default());

        let worker = &config.worker;
        assert_eq!(worker.max_perspective_event_attempts, Some(10));
        assert_eq!(worker.handler_timeout_milliseconds, Some(30_000));
        assert_eq!(worker.lease_seconds, 300);
        assert_eq!(worker.abandon_stale_instance_threshold_seconds, 30);
        assert!(!worker.debug_mode);
        assert_eq!(worker.idle_threshold_polls, 2);
        assert_eq!(worker.perspective_batch_size, 100);
        assert_eq!(worker.max_concurrent_perspectives, 30);
        assert_eq!(worker.max_concurrent_drain_consumers, 4);
        assert_eq!(worker.drain_loop_max_iterations, 5);
        assert_eq!(worker.drain_loop_refetch_min_batch, 2);
        assert_eq!(worker.drain_batcher.sliding_window_milliseconds, 300);
        assert_eq!(worker.drain_batcher.max_wait_milliseconds, 3000);
        assert_eq!(worker.drain_batcher.max_size, 1000);
        assert_eq!(worker.retry_options.retry_timeout_seconds, 1);
        assert!(worker.retry_options.enable_exponential_backoff);
        assert_eq!(worker.retry_options.backoff_multiplier, 2.0);
        assert_eq!(worker.retry_options.max_backoff_seconds, 60);
        assert_eq!(worker.completion_strategy, CompletionStrategy::Batched);
        assert_eq!(worker.heartbeat_interval_seconds, 10);
        assert!(worker.instance_metadata.is_empty());

        let claim = &config.claim_worker;
        assert_eq!(claim.polling_interval_milliseconds, 250);
        assert_eq!(claim.notify_healthy_polling_interval_milliseconds, 5000);
        assert_eq!(claim.polling_max_interval_milliseconds, 10_000);
        assert_eq!(claim.max_streams_per_batch, 1000);
        assert!(claim.enable_safety_net_poll);

        let perspective = &config.perspectives[0];
        assert_eq!(perspective.ordering, Ordering::Commit);
        assert_eq!(perspective.setup, None);
        assert_eq!(perspective.reset, None);
    }

    #[test]
    fn options_override_defaults_and_null_attempts_never_dead_letter() {
        let config = parse(&format!(
            "{MINIMAL}worker:
  maxPerspectiveEventAttempts: null
  handlerTimeoutMilliseconds: null
  perspectiveBatchSize: 50
  completionStrategy: Instant
  drainBatcher: {{ maxSize: 10 }}
  instanceMetadata: {{ zone: eu-1 }}
claimWorker:
  enableSafetyNetPoll: false
"
        ))
        .unwrap();
        assert_eq!(config.worker.max_perspective_event_attempts, None);
        assert_eq!(
            config.worker.handler_timeout_milliseconds, None,
            "null: no limit"
        );
        assert_eq!(config.worker.perspective_batch_size, 50);
        assert_eq!(
            config.worker.completion_strategy,
            CompletionStrategy::Instant
        );
        assert_eq!(config.worker.drain_batcher.max_size, 10);
        assert_eq!(config.worker.drain_batcher.max_wait_milliseconds, 3000);
        assert_eq!(config.worker.instance_metadata["zone"], "eu-1");
        assert_eq!(config.worker.lease_seconds, 300);
        assert!(!config.claim_worker.enable_safety_net_poll);
    }

    #[test]
    fn ordering_event_id_is_accepted_with_a_reset() {
        let text = MINIMAL.replace(
            "    handlers:",
            "    ordering: eventId\n    reset: DELETE FROM t WHERE id = :stream_id\n    handlers:",
        );
        let config = parse(&text).unwrap();
        assert_eq!(config.perspectives[0].ordering, Ordering::EventId);
        let without = MINIMAL.replace("    handlers:", "    ordering: eventId\n    handlers:");
        let err = parse(&without).unwrap_err().to_string();
        assert!(
            err.contains(".reset: ordering: eventId needs a reset"),
            "{err}"
        );
    }

    #[test]
    fn handler_order_is_preserved() {
        let config = parse(
            "schema: s
perspectives:
  - name: p
    handlers:
      Zeta: SELECT 1
      Alpha: SELECT 2
      Mid.Event: SELECT 3
",
        )
        .unwrap();
        let perspective = &config.perspectives[0];
        assert_eq!(
            perspective.event_types().collect::<Vec<_>>(),
            ["Zeta", "Alpha", "Mid.Event"]
        );
        let compiled: Vec<_> = perspective
            .compiled_handlers()
            .into_iter()
            .map(|(event_type, statements)| (event_type, statements[0].to_positional().0))
            .collect();
        assert_eq!(compiled[1], ("Alpha".to_owned(), "SELECT 2".to_owned()));
    }

    #[test]
    fn serialization_round_trips() {
        let config = parse(include_str!("../../../examples/shop.yaml")).unwrap();
        let text = serde_yaml::to_string(&config).unwrap();
        assert_eq!(parse(&text).unwrap(), config);
    }

    #[test]
    fn json_schema_describes_handlers_as_string_map() {
        let schema = serde_json::to_value(schemars::schema_for!(Config)).unwrap();
        let perspective = &schema["$defs"]["PerspectiveConfig"];
        let handlers = &perspective["properties"]["handlers"];
        assert_eq!(handlers["type"], "object");
        assert_eq!(handlers["additionalProperties"]["type"], "string");
        assert_eq!(handlers["minProperties"], 1);
        let worker = &schema["$defs"]["WorkerOptions"]["properties"];
        assert_eq!(worker["perspectiveBatchSize"]["default"], 100);
        assert!(worker["leaseSeconds"]["description"]
            .as_str()
            .unwrap()
            .contains("default 300"));
    }

    /// Each case: config text, expected problem path, fragment of the message.
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
                "at least 1.0, got 0.5",
            ),
            (
                format!("{MINIMAL}worker:\n  heartbeatIntervalSeconds: 30\n"),
                "worker.heartbeatIntervalSeconds",
                "less than abandonStaleInstanceThresholdSeconds (30)",
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

    /// Cases about handler and reset SQL.
    fn handler_cases() -> Vec<Case> {
        vec![
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

    /// A config setting `option` under `worker:` is refused with exactly one problem, at the
    /// option's path, that names what to do instead.
    fn assert_removed(option: &str, instead: &str) {
        let error = parse(&format!("{MINIMAL}worker:\n  {option}: 5\n")).unwrap_err();
        let expected = Problem::new(
            format!("worker.{option}"),
            format!("was removed: {instead}"),
        );
        assert_eq!(error.problems, [expected], "{error}");
    }

    #[test]
    fn removed_worker_polling_interval_milliseconds_names_the_claim_worker_option() {
        assert_removed(
            "pollingIntervalMilliseconds",
            "use claimWorker.pollingIntervalMilliseconds (the claim loop is the only poller)",
        );
    }

    #[test]
    fn removed_worker_notify_healthy_polling_interval_names_the_claim_worker_option() {
        assert_removed(
            "notifyHealthyPollingIntervalMilliseconds",
            "use claimWorker.notifyHealthyPollingIntervalMilliseconds (the claim loop is the only poller)",
        );
    }

    #[test]
    fn removed_worker_max_streams_per_batch_names_the_claim_worker_option() {
        assert_removed(
            "maxStreamsPerBatch",
            "use claimWorker.maxStreamsPerBatch (streams claimed per poll)",
        );
    }

    #[test]
    fn removed_worker_partition_count_says_partitions_are_fixed() {
        assert_removed(
            "partitionCount",
            "streams are hashed into a fixed 10000 partitions (compute_partition); delete the option",
        );
    }

    #[test]
    fn removed_options_are_reported_together_and_beside_other_errors() {
        let text = format!(
            "{MINIMAL}claimWorker:\n  pollingIntervalMillis: 1\nworker:\n  partitionCount: 5\n  maxStreamsPerBatch: 5\n"
        );
        let paths: Vec<String> = parse(&text)
            .unwrap_err()
            .problems
            .into_iter()
            .map(|p| p.path)
            .collect();
        assert_eq!(
            paths,
            [
                "worker.maxStreamsPerBatch",
                "worker.partitionCount",
                "claimWorker.pollingIntervalMillis",
            ]
        );
        // The replacements themselves are accepted.
        let claim = parse(&format!(
            "{MINIMAL}claimWorker:\n  maxStreamsPerBatch: 7\n  pollingIntervalMilliseconds: 9\n"
        ))
        .unwrap()
        .claim_worker;
        assert_eq!(
            (
                claim.max_streams_per_batch,
                claim.polling_interval_milliseconds
            ),
            (7, 9)
        );
    }

    #[test]
    fn removed_options_are_not_in_the_schema() {
        let schema = serde_json::to_value(schemars::schema_for!(Config)).unwrap();
        let worker = &schema["$defs"]["WorkerOptions"]["properties"];
        for (path, _) in REMOVED_OPTIONS {
            let field = path.strip_prefix("worker.").unwrap();
            assert!(worker.get(field).is_none(), "{path} is still in the schema");
        }
    }

    #[test]
    fn drain_batcher_max_size_is_capped_by_the_rows_of_one_fetch() {
        let with = |max_size: u32, batch: u32| WorkerOptions {
            perspective_batch_size: batch,
            drain_batcher: DrainBatcherOptions {
                max_size,
                ..DrainBatcherOptions::default()
            },
            ..WorkerOptions::default()
        };
        // The defaults (1000 ids, 100 rows per pair): one perspective caps a batch at 100 ids,
        // as the option's doc says.
        assert_eq!(WorkerOptions::default().drain_batch_limit(1), 100);
        assert_eq!(WorkerOptions::default().drain_batch_limit(4), 25);
        // Below the cap maxSize decides.
        assert_eq!(with(10, 100).drain_batch_limit(1), 10);
        assert_eq!(with(1000, 5).drain_batch_limit(2), 1000);
        assert_eq!(with(5000, 1).drain_batch_limit(1), 5000);
        // Never less than one id.
        assert_eq!(with(1000, 20_000).drain_batch_limit(3), 1);
        assert_eq!(with(1000, 100).drain_batch_limit(0), 100);
    }

    #[test]
    fn load_names_the_file() {
        let missing = Path::new("/nonexistent/dir/shop.yaml");
        let error = Config::load(missing).unwrap_err();
        assert_eq!(error.source, "/nonexistent/dir/shop.yaml");
        assert!(error
            .to_string()
            .starts_with("/nonexistent/dir/shop.yaml: cannot read file: "));

        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/shop.yaml");
        assert_eq!(Config::load(&example).unwrap().schema, "shop");
    }

    #[test]
    fn hostile_yaml_is_refused_before_it_is_expanded() {
        let aliased = format!("{MINIMAL}worker: &w {{}}\nclaimWorker: *w\n");
        let error = Config::from_yaml_str(&aliased, "shop.yaml").unwrap_err();
        assert_eq!(
            error.to_string(),
            "shop.yaml: YAML anchors (`&name`) are not accepted; write the value out at line 6, \
             column 9"
        );
        let nested = format!("{MINIMAL}x: {}", "[".repeat(100_000));
        let error = Config::from_yaml_str(&nested, "shop.yaml").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("shop.yaml: more than 64 unclosed"),
            "{error}"
        );

        let big = std::env::temp_dir().join(format!("perspective-big-{}.yaml", std::process::id()));
        std::fs::write(&big, " ".repeat(yaml_limits::MAX_CONFIG_BYTES + 1)).unwrap();
        let error = Config::load(&big).unwrap_err();
        std::fs::remove_file(&big).unwrap();
        assert!(
            error
                .to_string()
                .ends_with(": the config is 1048577 bytes; at most 1048576 (1 MiB) are read"),
            "{error}"
        );
    }

    #[test]
    fn accepts_realistic_event_type_names() {
        for event_type in [
            "OrderPlaced",
            "shop.orders.v2:OrderPlaced",
            "Outer+Inner",
            "order-placed",
            "_x",
        ] {
            assert_eq!(check_event_type(event_type), Ok(()), "{event_type}");
        }
        assert!(check_event_type(&"E".repeat(201)).is_err());
        assert_eq!(check_event_type(&"E".repeat(200)), Ok(()));
    }
}
