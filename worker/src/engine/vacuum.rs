//! Vacuuming the queue tables between autovacuum's visits.
//!
//! Every applied event leaves a dead work row per perspective, and every drained stream a dead
//! `wh_active_streams` row. Autovacuum visits a database once per `autovacuum_naptime` (a
//! server-wide setting, 1 min by default), and at tens of thousands of applies per second a
//! minute of dead rows is hundreds of megabytes: the tables bloat, and so does the time to scan
//! them. So while claims find work, the engine looks at the statistics every [`CHECK_EVERY`] and vacuums a queue table
//! itself once it holds as many dead rows as live ones (and at least [`MIN_DEAD_ROWS`]), which
//! keeps each table within about twice its live size and each vacuum short. Rows a vacuum could
//! not remove (an older transaction may still see them) do not count towards the next one, so
//! a long transaction elsewhere does not make the worker vacuum in vain every few seconds. One
//! worker of a deployment vacuums at a time; a role that does not own the tables leaves it to
//! autovacuum.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::catchup::LastWork;
use super::Shared;
use crate::store::vacuum::TableRows;

/// How often the statistics are read (one catalog query).
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(2);

/// How long after the last claim that found work the checks go on: the last deletions
/// (completion flushes) come after it.
pub(crate) const BUSY_GRACE: Duration = Duration::from_secs(10);

/// Dead rows below which a table is left alone: a vacuum costs a scan of the table and its
/// indexes, worth it only once there is something to reclaim.
pub(crate) const MIN_DEAD_ROWS: i64 = 20_000;

/// Whether a queue table should be vacuumed now; `left` is what the last vacuum could not
/// remove (0 before the first).
pub(crate) fn vacuum_due(rows: &TableRows, left: i64) -> bool {
    let new_dead = rows.dead - left;
    rows.owned && new_dead >= MIN_DEAD_ROWS && new_dead >= rows.live
}

/// The vacuum task.
pub(crate) struct Vacuum {
    pub shared: Arc<Shared>,
    /// When a claim last found work: a worker idle for [`BUSY_GRACE`] sends nothing (what is
    /// left dead then is autovacuum's).
    pub last_work: Arc<LastWork>,
}

impl Vacuum {
    pub(crate) async fn run(self) {
        let shared = &self.shared;
        let mut warned_not_owner = false;
        // Per table: the dead rows its last vacuum left behind.
        let mut left: HashMap<String, i64> = HashMap::new();
        loop {
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = tokio::time::sleep(CHECK_EVERY) => {}
            }
            if !self.last_work.within(BUSY_GRACE) {
                continue;
            }
            let tables = match shared.store.queue_table_rows().await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(error = %crate::db::describe_error(&e, None), "reading queue table statistics failed");
                    continue;
                }
            };
            if !warned_not_owner && tables.iter().any(|t| !t.owned) {
                warned_not_owner = true;
                tracing::info!(
                    schema = shared.store.schema(),
                    "this database role does not own the queue tables, so the worker leaves vacuuming them to autovacuum"
                );
            }
            for t in tables.iter() {
                // Dead rows below what a vacuum left: a later vacuum (autovacuum's) did better.
                let floor = left.get(&t.table).copied().unwrap_or(0).min(t.dead);
                if !vacuum_due(t, floor) {
                    continue;
                }
                let started = std::time::Instant::now();
                match shared.store.vacuum_queue_table(&t.table).await {
                    Ok(true) => {
                        shared
                            .metrics
                            .queue_vacuums
                            .with_label_values(&[t.table.as_str()])
                            .inc();
                        let after = shared.store.queue_table_rows().await.ok().and_then(|rows| {
                            rows.into_iter()
                                .find(|r| r.table == t.table)
                                .map(|r| r.dead)
                        });
                        left.insert(t.table.clone(), after.unwrap_or(0));
                        tracing::debug!(table = %t.table, live = t.live, dead = t.dead, left = ?after,
                            ms = started.elapsed().as_millis() as u64, "vacuumed queue table");
                    }
                    Ok(false) => {} // another worker of the deployment is vacuuming
                    Err(e) => {
                        tracing::warn!(table = %t.table, error = %crate::db::describe_error(&e, None), "vacuuming a queue table failed");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(live: i64, dead: i64, owned: bool) -> TableRows {
        TableRows {
            table: "wh_perspective_events".into(),
            live,
            dead,
            owned,
        }
    }

    #[test]
    fn vacuums_once_dead_rows_outnumber_live_ones_and_are_worth_a_scan() {
        assert!(vacuum_due(&rows(0, MIN_DEAD_ROWS, true), 0));
        assert!(vacuum_due(&rows(50_000, 50_000, true), 0));
        assert!(
            !vacuum_due(&rows(50_000, 49_999, true), 0),
            "fewer dead than live"
        );
        assert!(
            !vacuum_due(&rows(0, MIN_DEAD_ROWS - 1, true), 0),
            "too few to be worth it"
        );
        assert!(
            !vacuum_due(&rows(0, 1_000_000, false), 0),
            "not ours to vacuum"
        );
    }

    #[test]
    fn rows_the_last_vacuum_could_not_remove_do_not_count() {
        // A long transaction kept 500 000 dead rows: no vacuum until as many again are new.
        assert!(!vacuum_due(&rows(1_000, 500_000, true), 500_000));
        assert!(!vacuum_due(
            &rows(1_000, 500_000 + MIN_DEAD_ROWS - 1, true),
            500_000
        ));
        assert!(vacuum_due(
            &rows(1_000, 500_000 + MIN_DEAD_ROWS, true),
            500_000
        ));
    }
}
