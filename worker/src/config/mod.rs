//! The perspective configuration: which schema to use, the perspectives (read models) with
//! their handler SQL, and the worker's tuning options.
//!
//! The same document is the `spec` of the operator's custom resource, so every type here also
//! derives a JSON schema; the doc comments on the fields become the CRD's field descriptions.
//! Loading always validates, and validation reports every problem it finds at once, each with
//! the path of the offending field.
//!
//! This module holds the document ([`Config`]) and its entry points: [`Config::load`] and
//! [`Config::from_yaml_str`] (YAML limits, parse errors turned into problems, removed options
//! named), [`Config::validate`] for an already-deserialized spec. The parts, each re-exported
//! here so `config::X` names them all:
//! - `perspective`: [`PerspectiveConfig`], [`Ordering`] and the handler map;
//! - `worker_options`: the `worker:` options ([`WorkerOptions`], [`CompletionStrategy`],
//!   [`DrainBatcherOptions`], [`RetryOptions`]) and [`REMOVED_OPTIONS`];
//! - `claim_options`: the `claimWorker:` options ([`ClaimWorkerOptions`]);
//! - `names`: what the schema, perspectives and event types may be called;
//! - `validate`: the rules, [`Problem`] and [`ConfigError`];
//! - [`yaml_limits`]: what a config's YAML may hold before it is parsed;
//! - [`sql_params`]: the `:name` parameter lexer for handler SQL.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod claim_options;
mod names;
mod perspective;
pub mod sql_params;
mod validate;
pub mod versions;
mod worker_options;
pub mod yaml_limits;

pub use claim_options::ClaimWorkerOptions;
pub use names::{MAX_EVENT_TYPE_LEN, MAX_PERSPECTIVE_NAME_LEN, MAX_SCHEMA_LEN, SCHEMA_PATTERN};
pub use perspective::{
    Ordering, PerspectiveConfig, Rebuild, Sequencing, DEFAULT_KEEP_PREVIOUS_VERSIONS,
    MAX_KEEP_PREVIOUS_VERSIONS,
};
pub use validate::{ConfigError, Problem};
pub use worker_options::{
    CompletionStrategy, DatabaseOptions, DrainBatcherOptions, RetryOptions, WorkerOptions,
    CONTENTION_METADATA_KEY, DRAIN_ROWS_PER_FETCH, MAX_CONNECTIONS_RANGE,
    MAX_HANDLER_TIMEOUT_MILLISECONDS, REMOVED_OPTIONS,
};

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

/// How long reading a config file may take: a named pipe nobody writes to blocks its reader
/// (at open) for ever.
const CONFIG_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// At most the config limit plus one byte of `path`, within `timeout` (read on a thread of its
/// own, which a blocked pipe leaves behind; the command then ends with the error).
fn read_bounded(path: &Path, timeout: std::time::Duration) -> std::io::Result<Vec<u8>> {
    let path = path.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let read = std::fs::File::open(&path).and_then(|file| {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(
                &mut std::io::Read::take(file, yaml_limits::MAX_CONFIG_BYTES as u64 + 1),
                &mut bytes,
            )
            .map(|_| bytes)
        });
        let _ = tx.send(read);
    });
    rx.recv_timeout(timeout).unwrap_or_else(|_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "nothing to read within {} s (a named pipe nobody writes to?)",
                timeout.as_secs()
            ),
        ))
    })
}

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
        // Not read at all when the file says it is too large, and never more than the limit
        // plus one byte: a device or pipe reports no size, and may never end (`/dev/zero`).
        let cannot_read = |e: std::io::Error| refused(format!("cannot read file: {e}"));
        let size = std::fs::metadata(path).map_err(cannot_read)?.len();
        if size > yaml_limits::MAX_CONFIG_BYTES as u64 {
            return Err(refused(yaml_limits::too_large(size)));
        }
        let bytes = read_bounded(path, CONFIG_READ_TIMEOUT).map_err(cannot_read)?;
        if bytes.len() > yaml_limits::MAX_CONFIG_BYTES {
            return Err(refused(format!(
                "the config is longer than {} bytes (1 MiB), the most that is read; stopped reading there",
                yaml_limits::MAX_CONFIG_BYTES
            )));
        }
        let text = String::from_utf8(bytes).map_err(|e| refused(format!("not UTF-8 text: {e}")))?;
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
        validate::problems(self)
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

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const MINIMAL: &str = "\
schema: shop
perspectives:
  - name: order_summary
    handlers:
      OrderPlaced: INSERT INTO order_summary (order_id) VALUES (:stream_id)
";

    pub(super) fn parse(text: &str) -> Result<Config, ConfigError> {
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
        assert_eq!(worker.drain_consumers_per_deployment, 4);
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

    /// Issue 26, finding 7: a named pipe nobody writes to is given up on, not waited for.
    #[test]
    fn a_pipe_nobody_writes_to_is_given_up_on() {
        let dir = std::env::temp_dir().join(format!("perspective-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("config.yaml");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let started = std::time::Instant::now();
        let error = read_bounded(&fifo, std::time::Duration::from_millis(300)).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(error.to_string().contains("named pipe"), "{error}");
        // Unblock the reader left behind, then clean up.
        let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 26, finding 7: a file that reports no size and never ends is read up to the limit
    /// and refused (it used to be read until memory ran out).
    #[test]
    fn an_endless_file_is_read_only_up_to_the_limit() {
        let error = Config::load(Path::new("/dev/zero")).unwrap_err();
        assert!(
            error.to_string().contains("stopped reading there"),
            "{error}"
        );
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
}
