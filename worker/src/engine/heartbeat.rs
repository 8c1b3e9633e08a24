//! Heartbeats in `wh_service_instances`, abandoning instances that stopped heartbeating, and
//! the pending-events gauge.

use std::sync::Arc;
use std::time::Duration;

use super::Ctx;

/// One heartbeat plus a stale-instance sweep. Returns how many instances were abandoned.
pub(crate) async fn beat(ctx: &Ctx) -> Result<i32, sqlx::Error> {
    ctx.store.record_heartbeat(&ctx.instance).await?;
    let abandoned = ctx
        .store
        .cleanup_stale_instances(
            ctx.instance_id,
            ctx.config.worker.abandon_stale_instance_threshold_seconds as f64,
        )
        .await?;
    // Lag per perspective for /metrics (one small aggregate per heartbeat).
    let pending = ctx.store.pending_per_perspective().await?;
    for p in &ctx.config.perspectives {
        let n = pending
            .iter()
            .find(|(name, _)| *name == p.name)
            .map_or(0, |(_, n)| *n);
        ctx.metrics
            .pending_events
            .with_label_values(&[p.name.as_str()])
            .set(n);
    }
    if abandoned > 0 {
        tracing::warn!(
            abandoned,
            "abandoned silent worker instances; their streams are up for grabs"
        );
        ctx.hooks.request_immediate_poll();
    }
    Ok(abandoned)
}

pub(crate) async fn run(ctx: Arc<Ctx>) {
    let every = Duration::from_secs(ctx.config.worker.heartbeat_interval_seconds.max(1) as u64);
    loop {
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) = beat(&ctx).await {
            tracing::warn!(error = %crate::db::describe_error(&e, None), "heartbeat failed");
        }
    }
}
