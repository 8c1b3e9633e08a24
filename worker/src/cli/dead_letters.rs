//! `perspective-worker dead-letters list|replay|discard`.

use perspective_worker::admin::dead_letters;
use perspective_worker::db;
use perspective_worker::engine::SqlRunner;
use perspective_worker::store::dead_letters::{self as store, DeadLetter};
use sqlx::postgres::PgConnection;

use super::context::{Context, InvalidInput};
use super::out::{out, outln};
use super::table::{escape_control, Column, Style, Table};

#[derive(clap::Subcommand, Debug)]
pub enum DeadLettersCommand {
    /// List dead letters (pending ones unless --all).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Re-apply pending dead letters through their perspective (after fixing the handler and
    /// running `migrate`): the given ids, or every pending one with --all. Each replay commits
    /// with its dead letter marked `replayed`, or not at all.
    Replay {
        /// Dead letter ids (see `dead-letters list`).
        ids: Vec<i64>,
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this perspective's dead letters.
        #[arg(long, value_name = "NAME", requires = "all")]
        perspective: Option<String>,
    },
    /// Mark pending dead letters `discarded`: they are never applied (their events may then be
    /// pruned by retention). The given ids, or every pending one with --all.
    Discard {
        /// Dead letter ids (see `dead-letters list`).
        ids: Vec<i64>,
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only this perspective's dead letters.
        #[arg(long, value_name = "NAME", requires = "all")]
        perspective: Option<String>,
    },
}

pub async fn execute(ctx: &Context, command: &DeadLettersCommand) -> anyhow::Result<()> {
    let mut conn = ctx.connect("dead-letters").await?;
    match command {
        DeadLettersCommand::List { all, json } => list(ctx, &mut conn, *all, *json).await,
        DeadLettersCommand::Replay {
            ids,
            all,
            perspective,
        } => {
            let perspective = known_perspective(ctx, perspective.as_deref())?;
            replay(ctx, &mut conn, ids, *all, perspective).await
        }
        DeadLettersCommand::Discard {
            ids,
            all,
            perspective,
        } => {
            let perspective = known_perspective(ctx, perspective.as_deref())?;
            discard(ctx, &mut conn, ids, *all, perspective).await
        }
    }
}

/// `--perspective NAME`, refused unless NAME is in the config.
fn known_perspective<'a>(ctx: &Context, name: Option<&'a str>) -> anyhow::Result<Option<&'a str>> {
    match name {
        Some(n) if !ctx.perspective_names().iter().any(|p| p == n) => Err(InvalidInput::error(
            format!("--perspective {n}: no such perspective in the config"),
        )),
        other => Ok(other),
    }
}

async fn discard(
    ctx: &Context,
    conn: &mut PgConnection,
    ids: &[i64],
    all: bool,
    perspective: Option<&str>,
) -> anyhow::Result<()> {
    if !all && ids.is_empty() {
        return Err(InvalidInput::error(
            "name dead letter ids to discard, or pass --all",
        ));
    }
    let n = store::discard(conn, &ctx.config.schema, ids, all, perspective)
        .await
        .map_err(|e| {
            anyhow::anyhow!("discarding dead letters: {}", db::describe_error(&e, None))
        })?;
    outln!("{n} dead letter(s) discarded")?;
    if !all && n < ids.len() as u64 {
        anyhow::bail!(
            "{} of the {} id(s) named were not pending dead letters",
            ids.len() as u64 - n,
            ids.len()
        );
    }
    Ok(())
}

async fn list(ctx: &Context, conn: &mut PgConnection, all: bool, json: bool) -> anyhow::Result<()> {
    let letters = store::list(conn, &ctx.config.schema, all)
        .await
        .map_err(|e| anyhow::anyhow!("listing dead letters: {}", db::describe_error(&e, None)))?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&letters)?)?;
    } else if letters.is_empty() {
        outln!("no dead letters in schema {}", ctx.config.schema)?;
    } else {
        out!("{}", render(&letters))?;
    }
    Ok(())
}

/// The `dead-letters list` table.
fn render(letters: &[DeadLetter]) -> String {
    let mut table = Table::new(
        Style::Plain,
        vec![
            Column::right("ID").min_width(6),
            Column::left("PERSPECTIVE").min_width(24),
            Column::left("STREAM").min_width(36),
            Column::right("VERSION").min_width(7),
            Column::left("EVENT TYPE").min_width(20),
            Column::right("ATTEMPTS").min_width(8),
            Column::left("STATUS").min_width(9),
            Column::left("ERROR"),
        ],
    );
    for d in letters {
        table.row(vec![
            d.id.to_string(),
            d.perspective.clone(),
            d.stream_id.to_string(),
            d.stream_version.to_string(),
            d.event_type.clone(),
            d.attempts.to_string(),
            d.recovery_status.clone(),
            d.error.clone().unwrap_or_default(),
        ]);
    }
    table.render()
}

async fn replay(
    ctx: &Context,
    conn: &mut PgConnection,
    ids: &[i64],
    all: bool,
    perspective: Option<&str>,
) -> anyhow::Result<()> {
    let schema = &ctx.config.schema;
    let ids: Vec<i64> = if all {
        store::list(conn, schema, false)
            .await?
            .iter()
            .filter(|d| perspective.is_none_or(|p| d.perspective == p))
            .map(|d| d.id)
            .collect()
    } else if ids.is_empty() {
        return Err(InvalidInput::error(
            "name dead letter ids to replay, or pass --all",
        ));
    } else {
        ids.to_vec()
    };
    let runner = SqlRunner::new(&ctx.config);
    let mut failed = 0;
    for id in &ids {
        match dead_letters::replay(conn, schema, &runner, *id).await {
            Ok(()) => outln!("replayed dead letter {id}")?,
            Err(e) => {
                failed += 1;
                eprintln!("error: {}", escape_control(&e.to_string()));
            }
        }
    }
    outln!(
        "{} of {} dead letter(s) replayed",
        ids.len() - failed,
        ids.len()
    )?;
    if failed > 0 {
        anyhow::bail!("{failed} dead letter(s) could not be replayed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_keeps_its_column_widths_and_ends_with_the_error() {
        let letter = DeadLetter {
            id: 3,
            perspective: "order_summary".into(),
            stream_id: "0190f5c2-6c1a-7000-8000-000000000001".parse().unwrap(),
            stream_version: 2,
            event_id: uuid::Uuid::nil(),
            event_type: "OrderShipped".into(),
            attempts: 5,
            error: Some("division by zero".into()),
            dead_lettered_at: chrono::DateTime::UNIX_EPOCH,
            recovery_status: "pending".into(),
        };
        let unexplained = DeadLetter {
            id: 12,
            error: None,
            recovery_status: "replayed".into(),
            ..letter.clone()
        };
        assert_eq!(
            render(&[letter, unexplained]),
            "    ID  PERSPECTIVE               STREAM                                VERSION  EVENT TYPE            ATTEMPTS  STATUS     ERROR\n\
             \x20    3  order_summary             0190f5c2-6c1a-7000-8000-000000000001        2  OrderShipped                 5  pending    division by zero\n\
             \x20   12  order_summary             0190f5c2-6c1a-7000-8000-000000000001        2  OrderShipped                 5  replayed\n"
        );
    }
}
