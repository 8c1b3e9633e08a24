//! `claim_work`: the only query the worker polls.

use uuid::Uuid;

use super::Store;

const CLAIM_WORK: &str = "SELECT stream_id FROM {schema}.claim_work($1, $2, $3, $4, $5)";
const CLAIM_AWAKE: &str = "SELECT {schema}.wh_claim_awake($1, $2)";

/// The arguments of one claim.
#[derive(Debug, Clone)]
pub struct ClaimArgs {
    pub instance_id: Uuid,
    /// Unowned streams taken at most, and streams returned at most (the `offered` ones are
    /// never among them).
    pub max_streams: i32,
    /// Streams the caller has queued or is draining already: the claim does not return them
    /// (nor probe their work), and leaves retiring held streams to the caller's settler while
    /// there are any.
    pub offered: Vec<Uuid>,
    /// Heartbeat age after which an instance no longer counts as live.
    pub stale_seconds: f64,
}

impl Store {
    /// Streams this instance should drain now: the ones it owns with due work, plus unowned ones
    /// of its partition share (see `functions/claim_work.sql`).
    pub async fn claim_work(&self, args: ClaimArgs) -> Result<Vec<Uuid>, sqlx::Error> {
        let mut c = self.quick_conn("claim_work").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(CLAIM_WORK))
                    .bind(args.instance_id)
                    .bind(args.max_streams)
                    .bind(args.stale_seconds)
                    .bind(args.offered.len().min(i32::MAX as usize) as i32)
                    .bind(&args.offered)
                    .fetch_all(&mut *c),
            )
            .await
    }

    /// Say whether this instance claims at its pace without a doorbell (producers then need not
    /// ring for it); returns the state it is in now, which stays awake while a producer is
    /// between a stream's first pending row and its commit (see `functions/wh_claim_awake.sql`).
    /// After going to sleep, claim once more before waiting for the doorbell.
    pub async fn set_claim_awake(
        &self,
        instance_id: Uuid,
        awake: bool,
    ) -> Result<bool, sqlx::Error> {
        let mut c = self.quick_conn("wh_claim_awake").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(CLAIM_AWAKE))
                    .bind(instance_id)
                    .bind(awake)
                    .fetch_one(&mut *c),
            )
            .await
    }
}
