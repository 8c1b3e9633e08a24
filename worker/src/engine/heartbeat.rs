//! Heartbeats in `wh_service_instances` (with the lock conflicts of the last minute in the
//! metadata, see [`super::contention_rate`]), abandoning instances that stopped heartbeating,
//! and the pending-events and lag gauges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::backoff::FailureStreak;
use super::health::Probe;
use super::Shared;
use crate::store::instances::{heartbeat_metadata, Heartbeat as Beat, InstanceInfo};

/// When the first heartbeat after registering comes, at the latest.
const FIRST_RECOUNT: Duration = Duration::from_secs(1);
/// The least time between heartbeats when the listener asks for a recount (`orphan`
/// doorbells, which anyone may ring, cost at most this many beats a second).
const RECOUNT_SPACING: Duration = Duration::from_millis(250);

/// The heartbeat task.
pub(crate) struct Heartbeat {
    shared: Arc<Shared>,
    /// Who this instance is, as recorded with each heartbeat (the metadata is set at each).
    instance: InstanceInfo,
    /// When the pending-events gauges were last counted and how long that took.
    last_count: Option<(Instant, Duration)>,
}

/// Counting the pending work reads every pending work row (there is no index by perspective and
/// age on the queue table, which producers would pay for on every append): a few milliseconds
/// normally, 0.1–0.25 s at 200 000 pending rows (breadth benchmark), in proportion beyond.
/// Each count is followed by at least this many times its duration without one, so the gauges
/// take at most about 2% of one database backend whatever the backlog; they are then refreshed
/// less often than every heartbeat.
const COUNT_SPACING: u32 = 50;

/// Whether the pending-events gauges are counted again at `now`, given the last count (when it
/// started and how long it took). Every heartbeat while counting is cheap.
pub(crate) fn count_pending_due(now: Instant, last: Option<(Instant, Duration)>) -> bool {
    match last {
        None => true,
        Some((at, took)) => now.saturating_duration_since(at) >= took * COUNT_SPACING,
    }
}

impl Heartbeat {
    pub(crate) fn new(shared: Arc<Shared>, service_name: &str) -> Self {
        let instance = InstanceInfo {
            instance_id: shared.instance_id,
            service_name: service_name.to_string(),
            host_name: std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
            process_id: std::process::id() as i32,
            metadata: serde_json::Value::Null,
        };
        Heartbeat {
            shared,
            instance,
            last_count: None,
        }
    }

    /// One heartbeat: the previous heartbeat's age (`None`: the instance was not registered),
    /// and whether a peer is silent past the stale threshold. Resizes the drain to this worker's
    /// share among the live workers it counted.
    async fn record(&mut self) -> Result<Beat, sqlx::Error> {
        let shared = &self.shared;
        self.instance.metadata = heartbeat_metadata(
            &shared.config.worker.instance_metadata,
            &shared.contention.per_minute(),
        );
        let stale = shared
            .config
            .worker
            .abandon_stale_instance_threshold_seconds as f64;
        let beat = shared.store.record_heartbeat(&self.instance, stale).await?;
        let live_workers = beat.live_peers.max(0) as usize + 1;
        shared
            .live_workers
            .store(live_workers, std::sync::atomic::Ordering::Relaxed);
        self.resize_drain(live_workers);
        Ok(beat)
    }

    /// Runs this worker's share of `drainConsumersPerDeployment` while `live_workers` (itself
    /// included) are live.
    fn resize_drain(&self, live_workers: usize) {
        let shared = &self.shared;
        let width = shared.config.worker.drain_consumers(live_workers);
        let changed = shared.drain_width.send_if_modified(|w| {
            let changed = *w != width;
            *w = width;
            changed
        });
        shared.metrics.drain_consumers.set(width as i64);
        if changed {
            tracing::info!(
                live_workers,
                drain_consumers = width,
                "drain consumers resized to this worker's share of drainConsumersPerDeployment"
            );
        }
    }

    /// Abandons the silent peers (which can take a while: their streams are released).
    async fn sweep(&self) -> Result<(), sqlx::Error> {
        let shared = &self.shared;
        let abandoned = shared
            .store
            .cleanup_stale_instances(
                shared.instance_id,
                shared
                    .config
                    .worker
                    .abandon_stale_instance_threshold_seconds as f64,
            )
            .await?;
        if abandoned > 0 {
            tracing::warn!(
                abandoned,
                "abandoned silent worker instances; their streams are up for grabs"
            );
            shared.hooks.request_immediate_poll();
        }
        Ok(())
    }

    /// Lag per perspective for /metrics: one aggregate per heartbeat, spaced out when it is
    /// expensive (see COUNT_SPACING).
    async fn count_pending(&mut self) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        if count_pending_due(started, self.last_count) {
            let pending = self.shared.store.pending_per_perspective().await?;
            self.last_count = Some((started, started.elapsed()));
            self.set_pending_gauges(&pending);
        }
        Ok(())
    }

    /// Registers the instance (a new one, or one registering again after it was abandoned:
    /// whatever row it had does not matter), sweeps silent peers and counts the pending events.
    pub(crate) async fn register(&mut self) -> Result<(), sqlx::Error> {
        self.record().await?;
        self.sweep().await?;
        self.count_pending().await
    }

    fn set_pending_gauges(&self, pending: &[(String, i64, f64)]) {
        let shared = &self.shared;
        for p in &shared.config.perspectives {
            let (n, age) = pending
                .iter()
                .find(|(name, _, _)| *name == p.name)
                .map_or((0, 0.0), |(_, n, age)| (*n, *age));
            let label = [p.name.as_str()];
            shared
                .metrics
                .pending_events
                .with_label_values(&label)
                .set(n);
            shared
                .metrics
                .lag_seconds
                .with_label_values(&label)
                .set(age);
        }
    }

    /// Waits `next`, or less when the live workers changed (a peer began its stop, deregistered
    /// or was abandoned: the `orphan` doorbell): then the beat that recounts them comes
    /// [`RECOUNT_SPACING`] after the last one at the earliest. In a rolling update the new
    /// worker otherwise ran half its share of the drain until its next beat (up to
    /// `heartbeatIntervalSeconds` after the old worker's SIGTERM). False: shutdown.
    async fn wait_for_next_beat(&self, next: Duration, last_beat: Instant) -> bool {
        let shared = &self.shared;
        tokio::select! {
            _ = shared.shutdown.cancelled() => return false,
            _ = tokio::time::sleep(next) => return true,
            _ = shared.recount.notified() => {}
        }
        let spaced = (last_beat + RECOUNT_SPACING).saturating_duration_since(Instant::now());
        tokio::select! {
            _ = shared.shutdown.cancelled() => false,
            _ = tokio::time::sleep(spaced) => true,
        }
    }

    /// Heartbeats until shutdown, or until one finds that peers may have abandoned this
    /// instance (then it tells the engine's health and stops: the engine registers again).
    pub(crate) async fn run(mut self) {
        let every =
            Duration::from_secs(self.shared.config.worker.heartbeat_interval_seconds.max(1) as u64);
        let stale = self
            .shared
            .config
            .worker
            .abandon_stale_instance_threshold_seconds as f64;
        let health = self.shared.health.clone();
        // The interval stays fixed (peers judge us by it); the streaks only pace the logs.
        let mut failures = FailureStreak::new("heartbeat", every, every);
        let mut count_failures = FailureStreak::new("counting pending events", every, every);
        // The first beat comes sooner: workers of a deployment start together, and the first
        // to register counted none of the others when it sized its drain.
        let mut next = every.min(FIRST_RECOUNT);
        let mut last_beat = Instant::now();
        loop {
            if !self.wait_for_next_beat(next, last_beat).await {
                return;
            }
            next = every;
            let started = Instant::now();
            last_beat = started;
            // Only the heartbeat itself is watched: a sweep that releases many streams may
            // take seconds.
            let beat = match health.watch(Probe::Heartbeat, self.record()).await {
                Ok(beat) => beat,
                Err(e) => {
                    failures.failed(&crate::db::describe_error(&e, None));
                    continue;
                }
            };
            if let Some(reason) = abandoned_by(beat.previous_age, stale) {
                health.abandoned(reason);
                return;
            }
            health.beat_recorded(started);
            // The sweep only when the heartbeat saw a silent peer: one statement less every
            // interval of an idle worker.
            if beat.stale_peers {
                if let Err(e) = self.sweep().await {
                    let error = crate::db::describe_error(&e, None);
                    health.report(
                        Probe::Heartbeat,
                        Err(format!("cleanup_stale_instances failed: {error}")),
                    );
                    failures.failed(&error);
                    continue;
                }
            }
            failures.succeeded();
            match self.count_pending().await {
                Ok(()) => count_failures.succeeded(),
                Err(e) => {
                    count_failures.failed(&crate::db::describe_error(&e, None));
                }
            }
        }
    }
}

/// Whether a heartbeat that found the previous one `previous_age` seconds old (`None`: no row)
/// means peers may have abandoned this instance (`stale`: their threshold), and why.
pub(crate) fn abandoned_by(previous_age: Option<f64>, stale: f64) -> Option<String> {
    match previous_age {
        None => Some(
            "its instance row was gone (a peer's heartbeat sweep abandoned it): its streams \
             went to other instances"
                .into(),
        ),
        Some(age) if age > stale => Some(format!(
            "its previous heartbeat was {age:.1} s old, over the stale threshold ({stale} s): \
             peers may have taken its streams"
        )),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_that_finds_its_row_gone_or_stale_means_abandoned() {
        assert_eq!(abandoned_by(Some(1.0), 30.0), None);
        assert_eq!(abandoned_by(Some(30.0), 30.0), None);
        let gone = abandoned_by(None, 30.0).unwrap();
        assert!(gone.contains("row was gone"), "{gone}");
        let stale = abandoned_by(Some(31.5), 30.0).unwrap();
        assert!(stale.contains("31.5 s old"), "{stale}");
    }

    #[test]
    fn the_first_heartbeat_counts() {
        assert!(count_pending_due(Instant::now(), None));
    }

    #[test]
    fn a_cheap_count_runs_every_heartbeat() {
        let t0 = Instant::now();
        let last = Some((t0, Duration::from_millis(5)));
        // 5 ms × 50 = 250 ms: the next heartbeat (seconds later) counts again.
        assert!(count_pending_due(t0 + Duration::from_secs(1), last));
        assert!(!count_pending_due(t0 + Duration::from_millis(200), last));
    }

    #[test]
    fn an_expensive_count_waits_fifty_times_its_duration() {
        let t0 = Instant::now();
        let last = Some((t0, Duration::from_millis(400)));
        assert!(!count_pending_due(t0 + Duration::from_secs(10), last));
        assert!(!count_pending_due(t0 + Duration::from_millis(19_999), last));
        assert!(count_pending_due(t0 + Duration::from_secs(20), last));
    }
}
