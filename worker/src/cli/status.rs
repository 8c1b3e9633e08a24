//! `perspective-worker status`, and the status table the demo ends with.

use perspective_worker::db;
use perspective_worker::store::deadline;
use perspective_worker::store::status::{read_status, Status};
use perspective_worker::store::Deadlines;

use super::context::Context;
use super::out::{out, outln};
use super::table::{Column, Style, Table};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn execute(ctx: &Context, args: &StatusArgs) -> anyhow::Result<()> {
    let mut conn = ctx.connect("status").await?;
    let schema = &ctx.config.schema;
    let stale = ctx.config.worker.abandon_stale_instance_threshold_seconds as f64;
    // A dead link must not hang the command: the routine statements' deadline.
    let names = ctx.perspective_names();
    let st = deadline::within(
        Deadlines::default().routine,
        "reading status",
        read_status(&mut conn, schema, &names, stale),
    )
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "reading status of schema {schema}: {}",
            db::describe_error(&e, None)
        )
    })?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&st)?)?;
    } else {
        out!("{}", render(&st))?;
    }
    Ok(())
}

/// A summary line, then one row per perspective; below the table one line per catch-up in
/// progress and one per perspective whose lock conflicts persist (at least
/// [`PERSISTENT_LOCK_CONFLICTS_PER_MINUTE`](perspective_worker::store::status::PERSISTENT_LOCK_CONFLICTS_PER_MINUTE)
/// a minute), naming the perspective's `sequencing` option.
pub fn render(st: &Status) -> String {
    let mut table = Table::new(
        Style::Plain,
        vec![
            Column::left("PERSPECTIVE"),
            Column::left("PHASE"),
            Column::right("PENDING").min_width(10),
            Column::right("OLDEST (s)").min_width(14),
            Column::right("FAILED STREAMS").min_width(14),
            Column::right("DEAD LETTERS").min_width(12),
            Column::right("LOCK CONFLICTS/MIN").min_width(18),
        ],
    );
    for p in &st.perspectives {
        let name = if p.configured {
            p.name.clone()
        } else {
            format!("{} (not configured)", p.name)
        };
        let phase = p.phase.label(p.progress.as_ref());
        table.row(vec![
            name,
            phase,
            p.pending_events.to_string(),
            p.oldest_pending_seconds
                .map_or("-".to_string(), |s| format!("{s:.1}")),
            p.failed_streams.to_string(),
            p.dead_letters.to_string(),
            p.lock_conflicts_per_minute.to_string(),
        ]);
    }
    // Below the table, one line per catch-up in progress, then per persistent contention.
    let catching_up = st.perspectives.iter().filter_map(|p| p.phase_message());
    let contended = st
        .perspectives
        .iter()
        .filter_map(|p| p.lock_contention_message());
    let below: String = catching_up
        .chain(contended)
        .map(|line| format!("{line}\n"))
        .collect();
    format!(
        "schema {} (migration {}), {} live instance(s), {} active stream(s)\n{}{}",
        st.schema,
        st.schema_version
            .map_or("none".to_string(), |v| v.to_string()),
        st.live_instances,
        st.active_streams,
        table.render(),
        below
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use perspective_worker::store::catchup::progress::{Phase, Progress};
    use perspective_worker::store::status::PerspectiveStatus;

    fn perspective(name: &str, pending: i64, oldest: Option<f64>) -> PerspectiveStatus {
        PerspectiveStatus {
            name: name.into(),
            configured: true,
            pending_events: pending,
            oldest_pending_seconds: oldest,
            failed_streams: 0,
            dead_letters: 0,
            phase: Phase::Live,
            progress: None,
            version: Some(1),
            next_version: None,
            rollback: false,
            lock_conflicts_per_minute: 0,
            lock_conflict_sqlstate: None,
            newest_dead_letters: vec![],
        }
    }

    #[test]
    fn the_table_is_the_one_status_always_printed() {
        let st = Status {
            schema: "shop".into(),
            schema_version: Some(2),
            perspectives: vec![
                perspective("customer_stats", 0, None),
                perspective("order_summary", 12, Some(3.04159)),
            ],
            live_instances: 1,
            active_streams: 4,
        };
        assert_eq!(
            render(&st),
            "schema shop (migration 2), 1 live instance(s), 4 active stream(s)\n\
             PERSPECTIVE     PHASE     PENDING      OLDEST (s)  FAILED STREAMS  DEAD LETTERS  LOCK CONFLICTS/MIN\n\
             customer_stats  Live            0               -               0             0                   0\n\
             order_summary   Live           12             3.0               0             0                   0\n"
        );
    }

    #[test]
    fn an_unconfigured_perspective_widens_the_name_column() {
        let st = Status {
            schema: "s".into(),
            perspectives: vec![
                perspective("a", 0, None),
                PerspectiveStatus {
                    configured: false,
                    dead_letters: 2,
                    ..perspective("gone", 1, Some(10.0))
                },
            ],
            ..Status::default()
        };
        assert_eq!(
            render(&st),
            "schema s (migration none), 0 live instance(s), 0 active stream(s)\n\
             PERSPECTIVE            PHASE     PENDING      OLDEST (s)  FAILED STREAMS  DEAD LETTERS  LOCK CONFLICTS/MIN\n\
             a                      Live            0               -               0             0                   0\n\
             gone (not configured)  Live            1            10.0               0             2                   0\n"
        );
    }

    #[test]
    fn a_catch_up_shows_its_phase_in_the_table_and_its_progress_below() {
        let progress = Progress {
            step: "queueing".into(),
            streams_done: 6_100,
            streams_total: 10_000,
            events_total: 1_000,
            events_remaining: 390,
            percent: 61.0,
            eta_seconds: Some(39.0),
            version: None,
            waiting_for: None,
        };
        let st = Status {
            schema: "s".into(),
            perspectives: vec![PerspectiveStatus {
                phase: Phase::Backfilling,
                progress: Some(progress),
                ..perspective("totals", 390, Some(2.0))
            }],
            ..Status::default()
        };
        assert_eq!(
            render(&st),
            "schema s (migration none), 0 live instance(s), 0 active stream(s)\n\
             PERSPECTIVE  PHASE               PENDING      OLDEST (s)  FAILED STREAMS  DEAD LETTERS  LOCK CONFLICTS/MIN\n\
             totals       Backfilling 61%         390             2.0               0             0                   0\n\
             totals backfilling: 61% (610/1 000 events, 6 100/10 000 streams), about 39 s left\n"
        );
    }

    #[test]
    fn persistent_lock_conflicts_get_a_hint_naming_sequencing() {
        let contended = |name: &str, per_minute: i64| PerspectiveStatus {
            lock_conflicts_per_minute: per_minute,
            lock_conflict_sqlstate: Some("55P03".into()),
            ..perspective(name, 0, None)
        };
        let st = Status {
            schema: "s".into(),
            perspectives: vec![
                contended("customer_stats", 40),
                contended("daily", 9),
                contended("totals", 10),
            ],
            ..Status::default()
        };
        assert_eq!(
            render(&st),
            "schema s (migration none), 0 live instance(s), 0 active stream(s)\n\
             PERSPECTIVE     PHASE     PENDING      OLDEST (s)  FAILED STREAMS  DEAD LETTERS  LOCK CONFLICTS/MIN\n\
             customer_stats  Live            0               -               0             0                  40\n\
             daily           Live            0               -               0             0                   9\n\
             totals          Live            0               -               0             0                  10\n\
             customer_stats: 40 lock conflicts a minute between appliers; see sequencing\n\
             totals: 10 lock conflicts a minute between appliers; see sequencing\n"
        );
    }
}
