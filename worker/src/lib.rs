//! perspective-worker: materializes perspectives (read models) from a PostgreSQL event store.
//!
//! Producers append events with plain SQL; the schema's insert trigger assigns commit-ordered
//! stream versions and creates one work row per subscribed perspective in the same transaction.
//!
//! - [`config`]: the perspective config (also the `spec` of the operator's CRD) and its validation
//! - [`sql_params`]: the `:name` parameter lexer for handler SQL
//! - [`migrate`]: schema creation and upgrade, subscriptions, perspective setup, handler checks
//! - [`compile`]: generates the apply functions and `wh_drain` from `.sql` templates; definition hash
//! - [`append`]: JSON-lines event input (the `append` command)
//! - [`rebuild`]: rebuild a perspective from the event store
//! - [`store`]: every SQL statement the worker sends at run time, one file per concern
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
pub mod rebuild;
pub mod sql_params;
pub mod store;
