//! The SQL runner: the [`PerspectiveRunner`] that applies a (stream, perspective) group through
//! the perspective's compiled apply function (see `compile`).

use std::collections::HashMap;

use futures::future::BoxFuture;
use sqlx::postgres::PgConnection;

use crate::config::Config;
use crate::contract::{ApplyMode, ApplyOutcome, Group, PerspectiveRunner, RunnerError};
use crate::store::apply::ApplyArgs;
use crate::store::names::apply_function_name;

/// The runner for SQL handlers: one call of the perspective's apply function per group.
#[derive(Debug, Clone)]
pub struct SqlRunner {
    schema: String,
    functions: HashMap<String, String>,
    args: ApplyArgs,
}

impl SqlRunner {
    pub fn new(config: &Config) -> Self {
        SqlRunner {
            schema: config.schema.clone(),
            functions: config
                .perspectives
                .iter()
                .map(|p| (p.name.clone(), apply_function_name(&p.name)))
                .collect(),
            args: ApplyArgs {
                retry_base_ms: config.worker.failure_retry_base_milliseconds as f64,
                retry_max_ms: config.worker.failure_retry_max_milliseconds as f64,
                notify_applied: config.worker.notify_applied,
            },
        }
    }
}

impl PerspectiveRunner for SqlRunner {
    fn needs_event_payloads(&self) -> bool {
        false
    }

    fn server_side_drain(&self) -> bool {
        true
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        group: &'a Group,
        mode: ApplyMode,
    ) -> BoxFuture<'a, Result<ApplyOutcome, RunnerError>> {
        Box::pin(async move {
            let Some(function) = self.functions.get(&group.perspective) else {
                return Err(RunnerError::Rejected(format!(
                    "perspective {} is not in the config",
                    group.perspective
                )));
            };
            crate::store::apply::call_apply_function(
                conn,
                &self.schema,
                function,
                group,
                mode,
                self.args,
            )
            .await
            .map_err(RunnerError::from)
        })
    }
}
