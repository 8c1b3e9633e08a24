//! `perspective-worker grants producer|worker|reader ROLE [--print]`.

use perspective_worker::db;
use perspective_worker::store::grants::{self, Role};

use super::context::Context;
use super::out::outln;

#[derive(clap::Args, Debug)]
#[command(after_help = "What each role gets:
  producer  USAGE on the schema, INSERT on wh_event_store, EXECUTE on append_events (the insert
            trigger and append_events run as the owner, so nothing else: no right on wh_streams,
            the work rows or the read models, and no read of the store)
  worker    what `run` needs: SELECT on the store; SELECT, INSERT, UPDATE, DELETE, TRUNCATE on
            the engine's other tables and the read models (also on tables the owner creates in
            the schema later, through default privileges); EXECUTE on the schema's functions
  reader    what `status` and the operator's status queries need: SELECT on the engine's
            bookkeeping tables (not the store, not the read models)

The role must exist (CREATE ROLE ... LOGIN). The name is used as written (quoted), so its case
matters. All statements run in one transaction.

Example:
  perspective-worker --config shop.yaml grants producer orders_service")]
pub struct GrantsArgs {
    /// Which rights to grant.
    #[arg(value_enum)]
    kind: Kind,
    /// The role to grant them to.
    role: String,
    /// Print the statements instead of running them.
    #[arg(long)]
    print: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Kind {
    Producer,
    Worker,
    Reader,
}

pub async fn execute(ctx: &Context, args: &GrantsArgs) -> anyhow::Result<()> {
    let kind = match args.kind {
        Kind::Producer => Role::Producer,
        Kind::Worker => Role::Worker,
        Kind::Reader => Role::Reader,
    };
    let statements = grants::statements(&ctx.config.schema, kind, &args.role);
    if args.print {
        for statement in &statements {
            outln!("{statement};")?;
        }
        return Ok(());
    }
    let mut conn = ctx.connect("grants").await?;
    grants::apply(&mut conn, &statements).await.map_err(|e| {
        anyhow::anyhow!(
            "granting {:?} the {:?} rights in schema {}: {}",
            args.role,
            args.kind,
            ctx.config.schema,
            db::describe_error(&e, None)
        )
    })?;
    outln!(
        "granted {:?} the {} rights in schema {} ({} statements)",
        args.role,
        format!("{:?}", args.kind).to_lowercase(),
        ctx.config.schema,
        statements.len()
    )?;
    Ok(())
}
