//! What the worker's commands do besides running the engine, as a library (the command line
//! itself is the binary's `cli` module):
//! - [`migrate`]: schema creation and upgrade, subscriptions, perspective setup, compiled
//!   functions, handler checks, catch-up jobs for new and rebuilt perspectives, removals;
//! - [`blue_green`]: `migrate`'s part of blue/green versions (builds, rollbacks, cancels);
//! - [`append`]: JSON-lines event input, appended through the producer contract;
//! - [`dead_letters`]: replaying dead letters through the perspective's runner.

pub mod append;
pub mod blue_green;
pub mod dead_letters;
pub mod migrate;
