//! The `worker:` options: tuning of the perspective worker that applies events (attempts and
//! leases, batch sizes and drain concurrency, the drain batcher, completion reports and their
//! retry, heartbeats, handler timeouts and failure backoff), with their defaults, and the
//! options an older worker accepted that are now refused. The ranges are checked in `validate`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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

/// Upper bounds of the numeric `worker:` options (DESIGN §12.3: every numeric option is
/// bounded). Each is far above any useful value and far below what would break the worker:
/// `maxConcurrentDrainConsumers: 4294967295` allocated until the process aborted, a batch size
/// of 2^32 − 1 applied nothing, and a retry delay of 2^64 − 1 ms overflowed PostgreSQL's
/// timestamps. `validate` checks them; the CRD's schema carries them too.
pub const MAX_EVENT_ATTEMPTS: u32 = 1_000;
pub const MAX_LEASE_SECONDS: u32 = 86_400;
pub const MAX_STALE_THRESHOLD_SECONDS: u32 = 3_600;
pub const MAX_IDLE_THRESHOLD_POLLS: u32 = 1_000;
pub const MAX_PERSPECTIVE_BATCH_SIZE: u32 = 10_000;
pub const MAX_CONCURRENT_PERSPECTIVES: u32 = 256;
pub const MAX_DRAIN_CONSUMERS: u32 = 64;
pub const MAX_DRAIN_CONSUMERS_PER_DEPLOYMENT: u32 = 4_096;
pub const MAX_DRAIN_LOOP_ITERATIONS: u32 = 1_000;
pub const MAX_DRAIN_REFETCH_MIN_BATCH: u32 = 10_000;
pub const MAX_HEARTBEAT_INTERVAL_SECONDS: u32 = 3_600;
/// One day.
pub const MAX_FAILURE_RETRY_BASE_MILLISECONDS: u64 = 86_400_000;
/// A week.
pub const MAX_FAILURE_RETRY_MAX_MILLISECONDS: u64 = 604_800_000;
pub const MAX_SLIDING_WINDOW_MILLISECONDS: u64 = 60_000;
pub const MAX_BATCH_WAIT_MILLISECONDS: u64 = 600_000;
pub const MAX_DRAIN_BATCH_SIZE: u32 = 100_000;
pub const MAX_RETRY_TIMEOUT_SECONDS: u32 = 3_600;
pub const MAX_BACKOFF_MULTIPLIER: f64 = 100.0;
pub const MAX_BACKOFF_SECONDS: u32 = 86_400;

/// The key of an instance's metadata (`wh_service_instances.metadata`) under which its
/// heartbeat publishes the lock conflicts of the last minute; `worker.instanceMetadata` may not
/// use it.
pub const CONTENTION_METADATA_KEY: &str = "contention";

/// Options of the perspective worker (names and defaults follow PerspectiveWorkerOptions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WorkerOptions {
    /// Apply attempts before a work row is dead-lettered; null never dead-letters (default 10).
    #[schemars(range(min = 1, max = MAX_EVENT_ATTEMPTS))]
    pub max_perspective_event_attempts: Option<u32>,
    /// Custom PerspectiveRunner only: lease on the work rows handed to the runner (no other live instance takes a leased row before it expires), and how long the worker's dedup cache keeps skipping applied rows after their completion was flushed, in seconds (default 300). No effect on compiled SQL perspectives: wh_drain claims and applies rows in one transaction under the stream's ownership, without row leases or the dedup cache.
    #[schemars(range(min = 1, max = MAX_LEASE_SECONDS))]
    pub lease_seconds: u32,
    /// Seconds without a heartbeat before an instance is abandoned and its streams and leases released (default 30).
    #[schemars(range(min = 1, max = MAX_STALE_THRESHOLD_SECONDS))]
    pub abandon_stale_instance_threshold_seconds: u32,
    /// Keep completed work rows for debugging, stamped with processed_at, instead of deleting them (default false).
    pub debug_mode: bool,
    /// Consecutive empty claim polls before the worker reports itself idle (the WorkProcessingIdle hook) (default 2).
    #[schemars(range(min = 1, max = MAX_IDLE_THRESHOLD_POLLS))]
    pub idle_threshold_polls: u32,
    /// Most events of one (stream, perspective) handed to one call of its apply function (or of a custom PerspectiveRunner); the model change and the cursor advance of a call commit together (default 100).
    #[schemars(range(min = 1, max = MAX_PERSPECTIVE_BATCH_SIZE))]
    pub perspective_batch_size: u32,
    /// Custom PerspectiveRunner only: (stream, perspective) groups of one drain batch applied concurrently, each on its own connection (default 30). No effect on compiled SQL perspectives: one wh_drain call applies a whole batch inside the database, so their parallelism is the drain consumers the worker runs (maxConcurrentDrainConsumers, or its share of drainConsumersPerDeployment).
    #[schemars(range(min = 1, max = MAX_CONCURRENT_PERSPECTIVES))]
    pub max_concurrent_perspectives: u32,
    /// Parallel drain consumer loops, each applying its own batch of streams (default 4). At most this many run in one worker; `drainConsumersPerDeployment` may leave fewer running.
    #[schemars(range(min = 1, max = MAX_DRAIN_CONSUMERS))]
    pub max_concurrent_drain_consumers: u32,
    /// Drain consumers of all of the deployment's workers together (default 4, one worker's worth): each worker runs this / live workers of them (rounded down; at least 1, at most `maxConcurrentDrainConsumers`), recounting the live workers at each heartbeat, and as many catch-up chunk loops. Each consumer's wh_drain call keeps a database core busy; more calls than the database has cores only queue for them and pay each call's fixed cost more often (on a 2-core PostgreSQL, 3 workers x 4 consumers drained a cross-stream backlog at about 19 000 applies/s, 3 x 1 at about 28 000). Raise it to about the database cores you want applying.
    #[schemars(range(min = 1, max = MAX_DRAIN_CONSUMERS_PER_DEPLOYMENT))]
    pub drain_consumers_per_deployment: u32,
    /// Drain rounds one batch runs for a stream that still has due work before handing it back to the drain queue; 1 is single-pass (default 5).
    #[schemars(range(min = 1, max = MAX_DRAIN_LOOP_ITERATIONS))]
    pub drain_loop_max_iterations: u32,
    /// Work rows a drain round must take for a stream (all perspectives together) for the stream to be fetched again in the same batch (default 2).
    #[schemars(range(min = 1, max = MAX_DRAIN_REFETCH_MIN_BATCH))]
    pub drain_loop_refetch_min_batch: u32,
    /// Sliding-window batching of drain signals (defaults 300 ms window, 3000 ms max wait, 1000 signals).
    pub drain_batcher: DrainBatcherOptions,
    /// Retry with backoff for unacknowledged completion reports (defaults 1 s, exponential x2, max 60 s).
    pub retry_options: RetryOptions,
    /// When applied work rows are deleted: Batched (default: in batches after the apply, but a drain of at most 500 rows deletes its own in its transaction) or Instant (always in the apply transaction).
    pub completion_strategy: CompletionStrategy,
    /// Interval between heartbeats in wh_service_instances, in seconds (default 10).
    #[schemars(range(min = 1, max = MAX_HEARTBEAT_INTERVAL_SECONDS))]
    pub heartbeat_interval_seconds: u32,
    /// First retry delay after a handler fails, in ms; doubles with each further failure of the event: 1 s, 2 s, 4 s … with the default, up to failureRetryMaxMilliseconds (default 1000).
    #[schemars(range(min = 1, max = MAX_FAILURE_RETRY_BASE_MILLISECONDS))]
    pub failure_retry_base_milliseconds: u64,
    /// Longest retry delay after a handler fails, in ms (default 300000).
    #[schemars(range(min = 1, max = MAX_FAILURE_RETRY_MAX_MILLISECONDS))]
    pub failure_retry_max_milliseconds: u64,
    /// Longest an event's SQL handler may run, in ms; null: no limit (default 30000). A handler still running is cancelled once it has run this long, at the latest twice this long (the bound is the statement timeout of the wh_drain call, which starts no event after this long), and the event fails like any other: retried with backoff, then dead-lettered. A wait for a lock held by another transaction is not a failure: past 100 ms it gives up, and the (stream, perspective) is drained again shortly after, uncounted (`perspective_contention_retries_total`). Compiled SQL perspectives only; a custom PerspectiveRunner bounds its own work. The worker itself waits for a wh_drain call at most twice this + 5 s (10 minutes with null) before it gives up on the connection.
    #[schemars(range(min = 1, max = 1_000_000_000))]
    pub handler_timeout_milliseconds: Option<u64>,
    /// Lifecycle stages: fire the PostPerspective hook once per event and perspective after it is applied, and once every subscribed perspective applied an event, NOTIFY `<schema>_applied` with its id (read-your-writes) and fire the PostAllPerspectives / PostLifecycle hooks, recorded in wh_lifecycle_completions (default false).
    pub notify_applied: bool,
    /// Extra key/value metadata recorded with this instance in wh_service_instances (default empty). The key `contention` is the engine's: each heartbeat records there the lock conflicts between appliers of the last minute, by perspective.
    pub instance_metadata: BTreeMap<String, String>,
    /// The worker's connections to PostgreSQL (default maxConnections 10).
    pub database: DatabaseOptions,
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
            drain_consumers_per_deployment: 4,
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
            database: DatabaseOptions::default(),
        }
    }
}

/// Rows one drain claim+fetch aims for; it caps the stream ids of a drain batch (see
/// [`WorkerOptions::drain_batch_limit`]).
pub const DRAIN_ROWS_PER_FETCH: usize = 10_000;

impl WorkerOptions {
    /// Drain consumers one worker runs while `live_workers` (itself included) are live: its
    /// share of `drainConsumersPerDeployment` (rounded down, so that all of them together stay
    /// within it), within 1 and `maxConcurrentDrainConsumers`.
    pub fn drain_consumers(&self, live_workers: usize) -> usize {
        (self.drain_consumers_per_deployment as usize / live_workers.max(1))
            .clamp(1, self.max_concurrent_drain_consumers.max(1) as usize)
    }

    /// Stream ids one drain batch may hold: `drainBatcher.maxSize`, capped so that the batch's
    /// full-depth groups (`perspectiveBatchSize` rows for each of `perspectives`) stay within
    /// [`DRAIN_ROWS_PER_FETCH`] rows; at least 1. What the channel holds beyond it goes to the
    /// other drain consumers, which work in parallel.
    pub fn drain_batch_limit(&self, perspectives: usize) -> usize {
        let per_stream = self.perspective_batch_size.max(1) as usize * perspectives.max(1);
        (self.drain_batcher.max_size as usize).min((DRAIN_ROWS_PER_FETCH / per_stream).max(1))
    }
}

/// Bounds of `worker.database.maxConnections`: the engine needs two connections at least (a
/// drain and the heartbeat beside it); PostgreSQL's own `max_connections` is 100 by default.
pub const MAX_CONNECTIONS_RANGE: std::ops::RangeInclusive<u32> = 2..=1000;

/// The worker's connections to PostgreSQL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DatabaseOptions {
    /// Connections of each worker's statement pool, 2 to 1000 (default 10); the LISTEN session is one more. Drain consumers, catch-up chunk loops, the completion flush, the claim loop, the heartbeat and the housekeepers share it; a statement waits up to 10 s for a free connection. `perspective-worker run --max-connections` overrides it.
    #[schemars(range(min = 2, max = 1000))]
    pub max_connections: u32,
}

impl Default for DatabaseOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
        }
    }
}

/// Sliding-window batching of drain signals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DrainBatcherOptions {
    /// Quiet period that closes a batch of drain signals, in ms (default 300). Only while another batch is being applied: an idle worker drains a lone signal at once, and signals that arrive together never wait.
    #[schemars(range(max = MAX_SLIDING_WINDOW_MILLISECONDS))]
    pub sliding_window_milliseconds: u64,
    /// Longest a batch of drain signals is held open, in ms (default 3000).
    #[schemars(range(max = MAX_BATCH_WAIT_MILLISECONDS))]
    pub max_wait_milliseconds: u64,
    /// Stream ids that close a batch at once (default 1000). The worker sizes batches so that one drain call stays near 10000 rows: until a call has reported how many rows its streams had, and whenever they are deep, at 10000 / (perspectiveBatchSize × number of perspectives) ids (50 with the defaults and 2 perspectives); when the last call found fewer rows per stream, proportionally more, up to maxSize (1000 streams of one event each fill one call).
    #[schemars(range(min = 1, max = MAX_DRAIN_BATCH_SIZE))]
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
    #[schemars(range(max = MAX_RETRY_TIMEOUT_SECONDS))]
    pub retry_timeout_seconds: u32,
    /// Multiply the retry timeout by backoffMultiplier on every retry (default true).
    pub enable_exponential_backoff: bool,
    /// Factor applied to the retry timeout per retry, at least 1.0 (default 2.0).
    #[schemars(range(min = 1.0, max = MAX_BACKOFF_MULTIPLIER))]
    pub backoff_multiplier: f64,
    /// Upper bound of the retry timeout, in seconds (default 60).
    #[schemars(range(max = MAX_BACKOFF_SECONDS))]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{parse, MINIMAL};
    use crate::config::Config;

    #[test]
    fn each_worker_runs_its_share_of_the_deployments_drain_consumers() {
        let options = WorkerOptions::default(); // 4 per worker, 4 per deployment
        let widths: Vec<usize> = (1..=6).map(|live| options.drain_consumers(live)).collect();
        assert_eq!(
            widths,
            [4, 2, 1, 1, 1, 1],
            "within the 4 in all, at least 1 each"
        );
        assert_eq!(
            options.drain_consumers(0),
            4,
            "no count yet: this worker alone"
        );
        let six = WorkerOptions {
            drain_consumers_per_deployment: 6,
            ..WorkerOptions::default()
        };
        let widths: Vec<usize> = (1..=4).map(|live| six.drain_consumers(live)).collect();
        assert_eq!(
            widths,
            [4, 3, 2, 1],
            "never above maxConcurrentDrainConsumers"
        );
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
    fn the_pool_size_is_read_and_bounded() {
        assert_eq!(parse(MINIMAL).unwrap().worker.database.max_connections, 10);
        let with = |n: i64| {
            parse(&format!(
                "{MINIMAL}worker:\n  database: {{ maxConnections: {n} }}\n"
            ))
        };
        assert_eq!(with(2).unwrap().worker.database.max_connections, 2);
        assert_eq!(with(1000).unwrap().worker.database.max_connections, 1000);
        for bad in [0, 1, 1001] {
            let error = with(bad).unwrap_err();
            assert_eq!(
                error.problems,
                [crate::config::Problem::new(
                    "worker.database.maxConnections",
                    format!("must be between 2 and 1000, got {bad}")
                )],
                "{error}"
            );
        }
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
}
