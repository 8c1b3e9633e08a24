//! perspective-worker: materializes perspectives (read models) from a PostgreSQL event store.
//!
//! Producers append events with plain SQL; the schema's insert trigger assigns commit-ordered
//! stream versions and creates one work row per subscribed perspective in the same transaction.
//!
//! - [`config`]: the perspective config (also the `spec` of the operator's CRD) and its validation
//! - [`sql_params`]: the `:name` parameter lexer for handler SQL
//! - [`migrations`]: the embedded, versioned schema SQL
//! - [`migrate`]: schema creation and upgrade, subscriptions, perspective setup, handler checks
//! - [`compile`]: generates the apply functions and `wh_drain` from `.sql` templates; definition hash
//! - [`append`]: JSON-lines event input (the `append` command)
//! - [`rebuild`]: rebuild a perspective from the event store
//! - [`status`]: read-only lag / failure / dead-letter queries
//! - [`db`]: connections and human-readable database errors

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
pub mod metrics;
pub mod migrate;
pub mod migrations;
pub mod rebuild;
pub mod sql_params;
pub mod status;
