//! perspective-worker: materializes perspectives (read models) from a PostgreSQL event store.
//!
//! Producers append events with plain SQL; the schema's insert trigger assigns commit-ordered
//! stream versions and creates one work row per subscribed perspective in the same transaction.
//!
//! Configuration and compilation:
//! - [`config`]: the perspective config (also the `spec` of the operator's CRD), its loading and
//!   validation, and the `:name` parameter lexer for handler SQL ([`config::sql_params`])
//! - [`compile`]: apply functions and `wh_drain` rendered from `.sql` templates; definition hash
//!
//! The database:
//! - [`store`]: every SQL statement the worker sends at run time, one file per concern; the
//!   embedded migrations; channel names and cursor flags
//! - [`db`]: connections and human-readable database errors
//! - [`embedded`]: a private PostgreSQL for `run` and `demo` when `DATABASE_URL` is unset
//!
//! The runtime:
//! - [`engine`]: claim → drain → apply → complete; `PerspectiveRunner`, hooks, lifecycle
//! - [`dedup`]: the custom-runner path's cache of recently applied work rows
//! - [`completion_tracker`]: batched completion reports, pending → sent → acknowledged
//! - [`http`]: `/livez`, `/readyz` and `/metrics`
//! - [`metrics`]: the worker's Prometheus collectors
//!
//! What the commands do (the command line itself is the binary's `cli` module):
//! - [`migrate`]: schema creation and upgrade, subscriptions, perspective setup, handler checks
//! - [`append`]: JSON-lines event input
//! - [`jobs`]: backfill (a new perspective) and rebuild (a new version, or `rebuild`) jobs
//! - [`progress`]: a perspective's phase (Live, Backfilling, Rebuilding) and catch-up figures
//! - [`dead_letters`]: replay dead letters through the perspective's runner

pub mod append;
pub mod compile;
pub mod completion_tracker;
pub mod config;
pub mod db;
pub mod dead_letters;
pub mod dedup;
pub mod embedded;
pub mod engine;
pub mod http;
pub mod jobs;
pub mod metrics;
pub mod migrate;
pub mod progress;
pub mod store;
