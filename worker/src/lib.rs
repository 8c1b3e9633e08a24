//! perspective-worker: materializes perspectives (read models) from a PostgreSQL event store.
//!
//! Producers append events with plain SQL; the schema's insert trigger assigns commit-ordered
//! stream versions and creates one work row per subscribed perspective in the same transaction.
//!
//! The layers, each importing only those below it (`make lint` checks that no two modules
//! import each other):
//! - [`admin`]: what the commands do besides running the engine: `migrate`, `append`,
//!   dead-letter replay (the command line itself is the binary's `cli` module)
//! - [`engine`]: claim → drain → apply → complete; catch-up jobs, heartbeats, lifecycle hooks,
//!   `/livez` `/readyz` `/metrics`
//! - [`compile`]: apply functions and `wh_drain` rendered from `.sql` templates; definition hash
//! - [`store`]: every SQL statement the worker sends at run time, one file per concern; the
//!   embedded migrations and engine functions (one `.sql` file each); channel names, cursor flags
//!   and generated function names
//! - [`contract`]: the types the store and the engine share: work items, groups, apply modes
//!   and outcomes, the `PerspectiveRunner` trait, the appended event
//! - [`config`]: the perspective config (also the `spec` of the operator's CRD), its loading and
//!   validation, and the `:name` parameter lexer for handler SQL ([`config::sql_params`])
//! - [`db`]: connections, human-readable database errors, the embedded PostgreSQL

pub mod admin;
pub mod compile;
pub mod config;
pub mod contract;
pub mod db;
pub mod engine;
pub mod store;
