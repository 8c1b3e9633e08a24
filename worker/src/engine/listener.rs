//! The LISTEN connection: turns doorbell NOTIFYs into immediate claim polls (and a job's start,
//! the `jobs` payload, into a wake-up of the job runner; a change of the live workers, the
//! `orphan` payload, also into a recount by the heartbeat), reports its health
//! (the claim loop relaxes its safety-net cadence only while it is healthy), and reconnects.
//! sqlx has no TCP keepalive, so the idle session is probed every two quick deadlines (10 s by
//! default, see [`crate::store::Deadlines`]): over a dead link it would otherwise wait for
//! notifications (and count as healthy) for ever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::Notify;

use crate::store::names::{JOBS_PAYLOAD, ORPHAN_PAYLOAD};

use super::backoff::FailureStreak;
use super::Shared;

/// The listener task.
pub(crate) struct Listener {
    pub shared: Arc<Shared>,
    /// Its own pool of one connection, so LISTEN never waits behind applies.
    pub pool: PgPool,
    /// Whether the LISTEN connection is up, out (read by the claim loop).
    pub healthy: Arc<AtomicBool>,
    /// Wakes the job runner, out.
    pub jobs_wake: Arc<Notify>,
}

impl Listener {
    pub(crate) async fn run(mut self) {
        let shared = self.shared.clone();
        let ctx = &shared;
        let channel = crate::store::names::work_channel(ctx.store.schema());
        let mut failures = FailureStreak::new(
            "LISTEN connection",
            Duration::from_millis(100),
            Duration::from_secs(5),
        );
        while !ctx.shutdown.is_cancelled() {
            let connected = async {
                let mut l = PgListener::connect_with(&self.pool).await?;
                l.listen(&channel).await?;
                Ok::<_, sqlx::Error>(l)
            }
            .await;
            let mut listener = match connected {
                Ok(l) => l,
                Err(e) => {
                    let backoff = failures.failed(&crate::db::describe_error(&e, None));
                    tokio::select! {
                        _ = ctx.shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    continue;
                }
            };
            failures.succeeded();
            self.healthy.store(true, Ordering::Relaxed);
            ctx.metrics.listener_connected.set(1);
            tracing::info!(channel, "listening for the doorbell");
            // Work (or a job) may have arrived while we were not listening.
            ctx.hooks.request_immediate_poll();
            self.jobs_wake.notify_one();
            let mut probe = tokio::time::interval(ctx.store.deadlines().quick * 2);
            probe.reset();
            loop {
                let next = tokio::select! {
                    _ = ctx.shutdown.cancelled() => return,
                    n = listener.try_recv() => n,
                    _ = probe.tick() => match self.probe(&mut listener, &channel).await {
                        true => continue,
                        false => break,
                    },
                };
                match next {
                    Ok(Some(n)) if n.payload() == JOBS_PAYLOAD => self.jobs_wake.notify_one(),
                    Ok(Some(n)) if n.payload() == ORPHAN_PAYLOAD => {
                        // The live workers changed: a share of the drain and of the doorbell
                        // pace to recount, besides streams to claim.
                        ctx.metrics.notify_wakeups.inc();
                        ctx.recount.notify_one();
                        ctx.hooks.request_immediate_poll();
                    }
                    Ok(Some(_)) => {
                        ctx.metrics.notify_wakeups.inc();
                        ctx.hooks.request_immediate_poll();
                    }
                    // Ok(None): the connection was lost; Err: something else broke. Either way
                    // drop it and reconnect ourselves, tight polling meanwhile.
                    Ok(None) => {
                        tracing::warn!("LISTEN connection lost; reconnecting");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection failed; reconnecting");
                        break;
                    }
                }
            }
            self.healthy.store(false, Ordering::Relaxed);
            ctx.metrics.listener_connected.set(0);
            ctx.hooks.request_immediate_poll();
        }
    }

    /// Whether the LISTEN session answered a probe in time. If it did not, its connection cannot
    /// be closed through the listener, and the pool would wait for the lost statement's answer
    /// before taking it back: the listener gets a fresh pool, the old one is left to the kernel.
    async fn probe(&mut self, listener: &mut PgListener, channel: &str) -> bool {
        let quick = self.shared.store.deadlines().quick;
        let probed = crate::store::deadline::within(
            quick,
            "LISTEN session probe",
            crate::store::deadline::probe(listener, channel),
        )
        .await;
        let Err(e) = probed else { return true };
        tracing::warn!(error = %e, "LISTEN session did not answer; reconnecting");
        if crate::store::is_deadline_exceeded(&e) {
            let options = (*self.pool.connect_options()).clone();
            self.pool = crate::store::pool::pool_options(crate::store::pool::PoolRole::Listen)
                .connect_lazy_with(options);
        }
        false
    }
}
