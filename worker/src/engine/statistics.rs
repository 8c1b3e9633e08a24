//! Keeps the planner's statistics of the schema's tables current while the worker is busy.
//!
//! Why: the worker's PL/pgSQL functions (`wh_drain`, the apply functions, `claim_work`) cache a
//! generic plan per connection after five calls, planned from the statistics of that moment.
//! In a fresh schema the tables are nearly empty then, so the cached plans scan them
//! sequentially, and keep doing so as they grow until an ANALYZE or VACUUM of the table
//! invalidates them; autovacuum gets there within a minute or more, long enough for a backlog
//! to crawl (measured: 16 000 cursor lookups at 1.2 ms each instead of 10 µs). So every
//! [`CHECK_EVERY`] while claims find work, each table of the schema (the engine's and the
//! users' read models alike) whose live rows outgrew its statistics is analyzed; the ANALYZE
//! invalidates every session's cached plans of it, and their next plans fit its size. One worker
//! of a deployment analyzes a table at a time, and only if it is still outgrown then (the
//! workers check on the same beat: each analyzed the same table in turn).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::catchup::LastWork;
use super::Shared;
use crate::store::statistics::TableSize;

/// How often a busy worker compares the tables' sizes with their statistics.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(2);

/// A table is analyzed once its live rows exceed this multiple of what its statistics assume…
const GROWTH: f64 = 4.0;

/// …or of this many rows, whichever is more: below it any plan is cheap, and a table analyzed
/// while empty is not analyzed again for every few rows.
const FLOOR_ROWS: f64 = 250.0;

/// How often a table this role may not analyze is reported again.
const DENIED_WARN_EVERY: Duration = Duration::from_secs(3600);

/// What to do about one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its statistics still describe it.
    Fresh,
    /// It outgrew them: analyze it.
    Analyze,
    /// It outgrew them, but this role may not analyze it (not its owner): autovacuum will.
    Denied,
}

/// Whether `live_rows` outgrew statistics that assume `analyzed_rows` (-1: never analyzed).
pub(crate) fn outgrew(live_rows: i64, analyzed_rows: f64) -> bool {
    live_rows as f64 > GROWTH * analyzed_rows.max(FLOOR_ROWS)
}

pub(crate) fn verdict(t: &TableSize) -> Verdict {
    match (outgrew(t.live_rows, t.analyzed_rows), t.may_analyze) {
        (false, _) => Verdict::Fresh,
        (true, true) => Verdict::Analyze,
        (true, false) => Verdict::Denied,
    }
}

/// Whether a denied table last reported at `last` (never: `None`) is reported again at `now`.
pub(crate) fn warn_again(last: Option<Instant>, now: Instant) -> bool {
    last.is_none_or(|at| now.duration_since(at) >= DENIED_WARN_EVERY)
}

/// The statistics task.
pub(crate) struct StatisticsKeeper {
    pub shared: Arc<Shared>,
    /// When a claim last found work (the worker is busy while it recently did).
    pub last_work: Arc<LastWork>,
}

impl StatisticsKeeper {
    pub(crate) async fn run(self) {
        let mut denied_warned: HashMap<String, Instant> = HashMap::new();
        loop {
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return,
                _ = tokio::time::sleep(CHECK_EVERY) => {}
            }
            if !self.last_work.recent() {
                continue;
            }
            if let Err(e) = self.round(&mut denied_warned).await {
                tracing::warn!(error = %crate::db::describe_error(&e, None), "could not refresh the planner statistics");
            }
        }
    }

    /// One comparison of every table with its statistics, and the ANALYZEs it calls for.
    async fn round(&self, denied_warned: &mut HashMap<String, Instant>) -> Result<(), sqlx::Error> {
        let shared = &self.shared;
        for t in shared.store.table_sizes().await? {
            match verdict(&t) {
                Verdict::Fresh => {}
                Verdict::Analyze => {
                    let started = Instant::now();
                    if !shared.store.analyze_if_due(&t.table, outgrew).await? {
                        // Another worker analyzed it, or is at it.
                        continue;
                    }
                    shared
                        .metrics
                        .tables_analyzed
                        .with_label_values(&[t.table.as_str()])
                        .inc();
                    tracing::info!(
                        table = %t.table,
                        live_rows = t.live_rows,
                        statistics_rows = t.analyzed_rows,
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "table outgrew its planner statistics; analyzed it (unless autovacuum or migrate held it)"
                    );
                }
                Verdict::Denied => {
                    let now = Instant::now();
                    if warn_again(denied_warned.get(&t.table).copied(), now) {
                        denied_warned.insert(t.table.clone(), now);
                        tracing::warn!(
                            table = %t.table,
                            live_rows = t.live_rows,
                            statistics_rows = t.analyzed_rows,
                            "table outgrew its planner statistics but this role may not ANALYZE it \
                             (not its owner); plans may scan it until autovacuum analyzes it"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(live_rows: i64, analyzed_rows: f64, may_analyze: bool) -> TableSize {
        TableSize {
            table: "t".into(),
            live_rows,
            analyzed_rows,
            may_analyze,
        }
    }

    #[test]
    fn a_table_never_analyzed_or_analyzed_empty_is_analyzed_past_the_floor() {
        for analyzed in [-1.0, 0.0, 100.0] {
            assert!(!outgrew(0, analyzed));
            assert!(!outgrew(1000, analyzed), "4 x the floor is not yet past it");
            assert!(outgrew(1001, analyzed));
        }
    }

    #[test]
    fn a_table_is_analyzed_again_once_it_quadrupled() {
        assert!(!outgrew(40_000, 10_000.0));
        assert!(outgrew(40_001, 10_000.0));
        // Shrinking never calls for it: the plans of a bigger table suit a smaller one.
        assert!(!outgrew(10, 10_000.0));
    }

    #[test]
    fn a_table_this_role_may_not_analyze_is_reported_not_analyzed() {
        assert_eq!(verdict(&table(5000, 0.0, true)), Verdict::Analyze);
        assert_eq!(verdict(&table(5000, 0.0, false)), Verdict::Denied);
        assert_eq!(verdict(&table(500, 0.0, false)), Verdict::Fresh);
        assert_eq!(verdict(&table(500, 0.0, true)), Verdict::Fresh);
    }

    #[test]
    fn a_denied_table_is_reported_once_an_hour() {
        let t0 = Instant::now();
        assert!(warn_again(None, t0));
        assert!(!warn_again(Some(t0), t0 + Duration::from_secs(60)));
        assert!(warn_again(Some(t0), t0 + DENIED_WARN_EVERY));
    }
}
