//! The worker's Prometheus metrics (DESIGN §8), served as text on `/metrics`.
//!
//! Every collector lives in one [`WorkerMetrics`] that owns its own [`Registry`] rather than
//! the process-global default registry: tests and embedders can run several workers in one
//! process without their series colliding, and nothing else in the process can inject series
//! into the worker's `/metrics`. The collectors are public fields; prometheus handles are cheap
//! to clone and lock-free to update, so engine code clones the ones it needs. Each metric
//! family (name, help text, labels, buckets) is defined by one constructor function named after
//! its field, below the `WorkerMetrics` impl.
//!
//! Names follow the seeds with a `perspective_` prefix. Labelled families only appear once a
//! label value is used; [`WorkerMetrics::init_perspective`] creates the zero series for a
//! perspective up front so `rate()` and alerts see a series from the first scrape.

use prometheus::core::Collector;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::store::catchup::progress::{Phase, Progress};

/// Buckets for durations inside the worker (a claim, a batch): 1 ms … 30 s. Finer from 10 to
/// 50 ms, where claims under load fall: with only 25 and 50 ms there, a p99 read from the
/// histogram said 48 ms whenever a few claims passed 25 ms (the server's own durations put the
/// slowest at 30-40 ms, issue 28).
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Buckets for append → applied latency: 1 ms … 30 s. Steady state is tens of
/// milliseconds (NOTIFY wake-up plus one apply); the tail shows backlogs and slow polls.
const APPLY_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The label naming a perspective.
const PERSPECTIVE: &str = "perspective";

/// All worker metrics and the registry that exposes them.
#[derive(Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    /// `perspective_events_processed_total{perspective}`: events applied to a perspective.
    pub events_processed: IntCounterVec,
    /// `perspective_empty_batches_total`: claim cycles that returned no work.
    pub empty_batches: IntCounter,
    /// `perspective_batches_total`: claim cycles that returned work.
    pub batches: IntCounter,
    /// `perspective_batch_duration_seconds`: claim → apply → complete of one batch.
    pub batch_duration: Histogram,
    /// `perspective_claim_duration_seconds`: one `claim_work` round trip.
    pub claim_duration: Histogram,
    /// `perspective_pending_events{perspective}`: work rows not yet applied.
    pub pending_events: IntGaugeVec,
    /// `perspective_lag_seconds{perspective}`: age of the oldest work row not yet applied (0 when
    /// nothing is pending).
    pub lag_seconds: GaugeVec,
    /// `perspective_dead_letters_total{perspective}`: events moved to dead letters.
    pub dead_letters: IntCounterVec,
    /// `perspective_failures_total{perspective}`: failed apply attempts.
    pub failures: IntCounterVec,
    /// `perspective_contention_retries_total{perspective,sqlstate}`: applies of a (stream,
    /// perspective) or custom-runner group stopped by a lock conflict with another applier
    /// (deadlock 40P01, serialization failure 40001, lock timeout 55P03) and retried soon, not
    /// counted as failures. `perspective="*"`: a whole `wh_drain` call.
    pub contention_retries: IntCounterVec,
    /// `perspective_sequencing_waits_total{perspective}`: (stream, perspective) pairs of a key-
    /// or serial-sequenced perspective left for a later call because another applier was
    /// applying one of their keys: their turn comes soon; not a conflict.
    pub sequencing_waits: IntCounterVec,
    /// `perspective_rewinds_total`: perspective cursors rewound for late events.
    pub rewinds: IntCounter,
    /// `perspective_apply_latency_seconds`: append → applied, one observation per event and
    /// perspective, measured from the event's `created_at` (the appending transaction's start;
    /// PostgreSQL records no commit time without `track_commit_timestamp`).
    pub apply_latency: Histogram,
    /// `perspective_notify_wakeups_total`: wake-ups caused by a NOTIFY.
    pub notify_wakeups: IntCounter,
    /// `perspective_listener_connected`: 1 while the LISTEN connection is healthy.
    pub listener_connected: IntGauge,
    /// `perspective_claim_awake`: 1 while the claim loop runs at its pace without waiting for
    /// doorbells (producers then do not ring for this worker).
    pub claim_awake: IntGauge,
    /// `perspective_claim_awake_total`: times the claim loop went awake.
    pub claim_awake_total: IntCounter,
    /// `perspective_drain_consumers`: drain consumers this worker runs now, its share of
    /// `drainConsumersPerDeployment` among the live workers.
    pub drain_consumers: IntGauge,
    /// `perspective_reregistrations_total`: times this worker found that its peers may have
    /// abandoned it (heartbeat stale or instance row gone), dropped the work it held and
    /// registered again.
    pub reregistrations: IntCounter,
    /// `perspective_completions_flushed_total`: completed work rows deleted by the flush worker.
    pub completions_flushed: IntCounter,
    /// `perspective_completion_flush_failures_total`: flushes that failed (their rows are
    /// flushed again after the retry backoff, or retired by a later drain).
    pub completion_flush_failures: IntCounter,
    /// `perspective_tables_analyzed_total{table}`: ANALYZEs (SKIP_LOCKED) of a schema table that
    /// outgrew its planner statistics (see `engine::statistics`).
    pub tables_analyzed: IntCounterVec,
    /// `perspective_hook_events_dropped_total`: hook events not delivered because a subscriber
    /// had fallen the channel's capacity behind.
    pub hook_events_dropped: IntCounter,
    /// `perspective_phase{perspective,phase}`: 1 for the perspective's phase (Live, Backfilling,
    /// Rebuilding), 0 for the others.
    pub phase: IntGaugeVec,
    /// `perspective_catchup_remaining_events{perspective}`: events a backfill or rebuild has
    /// still to apply (0 when live).
    pub catchup_remaining_events: IntGaugeVec,
    /// `perspective_catchup_progress_ratio{perspective}`: share of a backfill's or rebuild's
    /// events applied, 0–1 (1 when live).
    pub catchup_progress: GaugeVec,
    /// `perspective_catchup_pace{perspective}`: how hard this worker runs a perspective's
    /// catch-up, in chunk loops at full duty (its chunk loops × their duty; see
    /// `engine::catchup::pace`).
    pub catchup_pace: GaugeVec,
    /// `perspective_queue_vacuums_total{table}`: vacuums of a queue table run by this worker
    /// (between autovacuum's visits, see `engine::vacuum`).
    pub queue_vacuums: IntCounterVec,
    /// `perspective_version_switches_total{perspective,version}`: blue/green switches this
    /// worker made, by the version switched to.
    pub version_switches: IntCounterVec,
    /// `perspective_version_switches_refused_total{perspective,version}`: turns on which this
    /// worker found a version ready to switch but its role lacks the schema owner's rights.
    pub version_switches_refused: IntCounterVec,
}

impl WorkerMetrics {
    /// Creates every collector and registers it in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let r = Registrar(&registry);
        WorkerMetrics {
            events_processed: events_processed(&r),
            empty_batches: empty_batches(&r),
            batches: batches(&r),
            batch_duration: batch_duration(&r),
            claim_duration: claim_duration(&r),
            pending_events: pending_events(&r),
            lag_seconds: lag_seconds(&r),
            dead_letters: dead_letters(&r),
            failures: failures(&r),
            contention_retries: contention_retries(&r),
            sequencing_waits: sequencing_waits(&r),
            rewinds: rewinds(&r),
            apply_latency: apply_latency(&r),
            notify_wakeups: notify_wakeups(&r),
            listener_connected: listener_connected(&r),
            claim_awake: claim_awake(&r),
            claim_awake_total: claim_awake_total(&r),
            drain_consumers: drain_consumers(&r),
            reregistrations: reregistrations(&r),
            completions_flushed: completions_flushed(&r),
            completion_flush_failures: completion_flush_failures(&r),
            tables_analyzed: tables_analyzed(&r),
            hook_events_dropped: hook_events_dropped(&r),
            phase: phase(&r),
            catchup_remaining_events: catchup_remaining_events(&r),
            catchup_progress: catchup_progress(&r),
            catchup_pace: catchup_pace(&r),
            queue_vacuums: queue_vacuums(&r),
            version_switches: version_switches(&r),
            version_switches_refused: version_switches_refused(&r),
            registry,
        }
    }

    /// Record a perspective's phase and, while it catches up, its progress.
    pub fn set_catchup(&self, perspective: &str, phase: Phase, progress: Option<&Progress>) {
        for p in Phase::ALL {
            self.phase
                .with_label_values(&[perspective, p.as_str()])
                .set(i64::from(p == phase));
        }
        self.catchup_remaining_events
            .with_label_values(&[perspective])
            .set(progress.map_or(0, |p| p.events_remaining));
        self.catchup_progress
            .with_label_values(&[perspective])
            .set(progress.map_or(1.0, |p| p.percent / 100.0));
        if progress.is_none() {
            // No catch-up (any more): nothing runs.
            self.catchup_pace.with_label_values(&[perspective]).set(0.0);
        }
    }

    /// The registry holding every worker collector (to add more, or to gather directly).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Creates the zero-valued series of a perspective's labelled metrics, so they are scraped
    /// before its first event.
    pub fn init_perspective(&self, perspective: &str) {
        self.events_processed.with_label_values(&[perspective]);
        self.pending_events.with_label_values(&[perspective]);
        self.lag_seconds.with_label_values(&[perspective]);
        self.dead_letters.with_label_values(&[perspective]);
        self.failures.with_label_values(&[perspective]);
        self.sequencing_waits.with_label_values(&[perspective]);
        self.set_catchup(perspective, Phase::Live, None);
    }

    /// Every metric in the Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!("could not encode metrics: {e}");
        }
        String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into())
    }
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").finish_non_exhaustive()
    }
}

/// Creates collectors and registers each one in the worker's registry.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn register<C: Collector + Clone + 'static>(&self, collector: C) -> C {
        self.0
            .register(Box::new(collector.clone()))
            .expect("worker metric names are unique and valid");
        collector
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help).expect("valid metric"))
    }

    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.register(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn int_gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).expect("valid metric"))
    }

    fn int_gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.register(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.register(GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.register(Histogram::with_opts(opts).expect("valid metric"))
    }
}

// One constructor per metric family: its name, help text, labels and buckets. Each is named
// after the `WorkerMetrics` field it fills, whose doc comment says what it counts.

fn events_processed(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_events_processed_total",
        "Events applied to a perspective (model change and cursor advance committed).",
        &[PERSPECTIVE],
    )
}

fn empty_batches(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_empty_batches_total",
        "Claim cycles that found no work for this instance.",
    )
}

fn batches(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_batches_total",
        "Claim cycles that returned work and were processed.",
    )
}

fn batch_duration(r: &Registrar) -> Histogram {
    r.histogram(
        "perspective_batch_duration_seconds",
        "Wall time of one batch: claim, fetch, apply to every perspective, complete.",
        DURATION_BUCKETS,
    )
}

fn claim_duration(r: &Registrar) -> Histogram {
    r.histogram(
        "perspective_claim_duration_seconds",
        "Round trip of one claim_work call (leasing work rows).",
        DURATION_BUCKETS,
    )
}

fn pending_events(r: &Registrar) -> IntGaugeVec {
    r.int_gauge_vec(
        "perspective_pending_events",
        "Work rows of a perspective not yet applied (its lag in events), as last measured.",
        &[PERSPECTIVE],
    )
}

fn lag_seconds(r: &Registrar) -> GaugeVec {
    r.gauge_vec(
        "perspective_lag_seconds",
        "Age of a perspective's oldest work row not yet applied, in seconds (0 when nothing \
         is pending), as last measured.",
        &[PERSPECTIVE],
    )
}

fn dead_letters(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_dead_letters_total",
        "Events dead-lettered for a perspective after exhausting their attempts.",
        &[PERSPECTIVE],
    )
}

fn failures(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_failures_total",
        "Failed attempts to apply an event to a perspective (each one retried or \
         dead-lettered).",
        &[PERSPECTIVE],
    )
}

fn contention_retries(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_contention_retries_total",
        "Applies stopped by a lock conflict with another applier (deadlock, serialization \
         failure, lock timeout: by SQLSTATE) and retried soon; not failures. perspective=\"*\": \
         a whole wh_drain call.",
        &[PERSPECTIVE, "sqlstate"],
    )
}

fn sequencing_waits(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_sequencing_waits_total",
        "Pairs of a key- or serial-sequenced perspective left for a later call because another \
         applier was applying one of their keys (their turn comes soon; not a conflict).",
        &[PERSPECTIVE],
    )
}

fn rewinds(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_rewinds_total",
        "Perspective cursors rewound because an event arrived behind the cursor.",
    )
}

fn apply_latency(r: &Registrar) -> Histogram {
    r.histogram(
        "perspective_apply_latency_seconds",
        "Time from the event's append (its created_at) until a perspective applied it; one observation per event and perspective.",
        APPLY_LATENCY_BUCKETS,
    )
}

fn notify_wakeups(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_notify_wakeups_total",
        "Times a NOTIFY for new work woke the worker before its poll interval.",
    )
}

fn reregistrations(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_reregistrations_total",
        "Times the worker found its peers may have abandoned it and registered again.",
    )
}

fn drain_consumers(r: &Registrar) -> IntGauge {
    r.int_gauge(
        "perspective_drain_consumers",
        "Drain consumers this worker runs: its share of worker.drainConsumersPerDeployment \
         among the live workers (recounted each heartbeat), at most maxConcurrentDrainConsumers.",
    )
}

fn listener_connected(r: &Registrar) -> IntGauge {
    r.int_gauge(
        "perspective_listener_connected",
        "1 while the LISTEN connection for work notifications is up, 0 while the worker \
         relies on polling alone.",
    )
}

fn claim_awake(r: &Registrar) -> IntGauge {
    r.int_gauge(
        "perspective_claim_awake",
        "1 while the claim loop claims at its pace without waiting for doorbells: under load, \
         when doorbells come faster than the pace. While every worker is awake, producers do \
         not NOTIFY (and stay off PostgreSQL's global notify lock at commit).",
    )
}

fn claim_awake_total(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_claim_awake_total",
        "Times the claim loop went awake (see perspective_claim_awake).",
    )
}

fn completions_flushed(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_completions_flushed_total",
        "Completed work rows deleted in batches by the completion flush worker.",
    )
}

fn completion_flush_failures(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_completion_flush_failures_total",
        "Completion flushes that failed; their rows are flushed again after the retry \
         backoff (worker.retryOptions), at once when the worker stops, or retired by a later drain.",
    )
}

fn tables_analyzed(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_tables_analyzed_total",
        "ANALYZEs the worker ran on a table of its schema whose rows outgrew its planner \
         statistics (so cached plans made while it was small stop scanning it); one that \
         found the table locked by another ANALYZE, a VACUUM or DDL skipped it.",
        &["table"],
    )
}

fn hook_events_dropped(r: &Registrar) -> IntCounter {
    r.counter(
        "perspective_hook_events_dropped_total",
        "Hook events not delivered because a subscriber had fallen the channel's capacity behind \
         (lifecycle stages dropped are not recorded as done and fire again at the next start).",
    )
}

fn phase(r: &Registrar) -> IntGaugeVec {
    r.int_gauge_vec(
        "perspective_phase",
        "1 for the phase a perspective is in (Live, Backfilling, Rebuilding), 0 for the others.",
        &[PERSPECTIVE, "phase"],
    )
}

fn catchup_remaining_events(r: &Registrar) -> IntGaugeVec {
    r.int_gauge_vec(
        "perspective_catchup_remaining_events",
        "Events a perspective's backfill or rebuild has still to apply (0 when live).",
        &[PERSPECTIVE],
    )
}

fn catchup_progress(r: &Registrar) -> GaugeVec {
    r.gauge_vec(
        "perspective_catchup_progress_ratio",
        "Share of a perspective's backfill or rebuild applied, 0 to 1 (1 when live).",
        &[PERSPECTIVE],
    )
}

fn catchup_pace(r: &Registrar) -> GaugeVec {
    r.gauge_vec(
        "perspective_catchup_pace",
        "How hard this worker runs a perspective's backfill, rebuild or blue/green build, in \
         chunk loops at full duty (chunk loops x duty): one per drain consumer without live \
         work, less while the live perspectives' apply latency is high or their apply rate \
         falls (producers slowed by the catch-up).",
        &[PERSPECTIVE],
    )
}

fn queue_vacuums(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_queue_vacuums_total",
        "Vacuums of a queue table (wh_perspective_events, wh_active_streams) this worker ran \
         because it held as many dead rows as live ones.",
        &["table"],
    )
}

fn version_switches(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_version_switches_total",
        "Blue/green switches this worker made: the perspective's tables replaced by those of the \
         version built beside them (or kept, for a rollback).",
        &[PERSPECTIVE, "version"],
    )
}

fn version_switches_refused(r: &Registrar) -> IntCounterVec {
    r.counter_vec(
        "perspective_version_switches_refused_total",
        "Turns on which this worker found a version built and caught up but could not switch to \
         it: its database role lacks the schema owner's rights (the old version keeps serving \
         until a worker running as the owner switches).",
        &[PERSPECTIVE, "version"],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: &[&str] = &[
        "perspective_events_processed_total",
        "perspective_empty_batches_total",
        "perspective_batches_total",
        "perspective_batch_duration_seconds",
        "perspective_claim_duration_seconds",
        "perspective_pending_events",
        "perspective_lag_seconds",
        "perspective_dead_letters_total",
        "perspective_failures_total",
        "perspective_contention_retries_total",
        "perspective_sequencing_waits_total",
        "perspective_rewinds_total",
        "perspective_apply_latency_seconds",
        "perspective_notify_wakeups_total",
        "perspective_listener_connected",
        "perspective_claim_awake",
        "perspective_claim_awake_total",
        "perspective_drain_consumers",
        "perspective_reregistrations_total",
        "perspective_completions_flushed_total",
        "perspective_completion_flush_failures_total",
        "perspective_tables_analyzed_total",
        "perspective_hook_events_dropped_total",
        "perspective_phase",
        "perspective_catchup_remaining_events",
        "perspective_catchup_progress_ratio",
        "perspective_catchup_pace",
        "perspective_queue_vacuums_total",
    ];

    #[test]
    fn claim_durations_between_25_and_50_ms_fall_in_their_own_buckets() {
        let m = WorkerMetrics::new();
        m.claim_duration.observe(0.035);
        let text = m.render();
        let count = |le: &str| {
            let key = format!("perspective_claim_duration_seconds_bucket{{le=\"{le}\"}} ");
            let line = text
                .lines()
                .find(|l| l.starts_with(&key))
                .unwrap_or_else(|| panic!("no {key} in\n{text}"));
            line[key.len()..].trim().parse::<u64>().unwrap()
        };
        assert_eq!((count("0.03"), count("0.04")), (0, 1));
    }

    #[test]
    fn render_contains_every_metric_after_touching_each() {
        let m = WorkerMetrics::new();
        m.events_processed.with_label_values(&["orders"]).inc_by(3);
        m.empty_batches.inc();
        m.batches.inc();
        m.batch_duration.observe(0.02);
        m.claim_duration.observe(0.003);
        m.pending_events.with_label_values(&["orders"]).set(7);
        m.lag_seconds.with_label_values(&["orders"]).set(2.5);
        m.dead_letters.with_label_values(&["orders"]).inc();
        m.failures.with_label_values(&["orders"]).inc();
        m.contention_retries
            .with_label_values(&["orders", "40P01"])
            .inc();
        m.sequencing_waits.with_label_values(&["orders"]).inc();
        m.rewinds.inc();
        m.apply_latency.observe(0.04);
        m.notify_wakeups.inc();
        m.listener_connected.set(1);
        m.drain_consumers.set(2);
        m.reregistrations.inc();
        m.completions_flushed.inc_by(10);
        m.completion_flush_failures.inc();
        m.tables_analyzed.with_label_values(&["orders"]).inc();
        m.hook_events_dropped.inc();
        m.queue_vacuums
            .with_label_values(&["wh_active_streams"])
            .inc();
        let progress = Progress {
            events_remaining: 400,
            percent: 60.0,
            ..Progress::default()
        };
        m.set_catchup("orders", Phase::Backfilling, Some(&progress));
        m.catchup_pace.with_label_values(&["orders"]).set(0.25);

        let text = m.render();
        for name in NAMES {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no help in:\n{text}"
            );
            assert!(
                text.contains(&format!("\n{name}")),
                "{name} missing in:\n{text}"
            );
        }
        assert!(text.contains(r#"perspective_events_processed_total{perspective="orders"} 3"#));
        assert!(text.contains(r#"perspective_pending_events{perspective="orders"} 7"#));
        assert!(text.contains(r#"perspective_lag_seconds{perspective="orders"} 2.5"#));
        assert!(text.contains("perspective_listener_connected 1"));
        assert!(text.contains(
            r#"perspective_contention_retries_total{perspective="orders",sqlstate="40P01"} 1"#
        ));
        assert!(text.contains(r#"perspective_phase{perspective="orders",phase="Backfilling"} 1"#));
        assert!(text.contains(r#"perspective_phase{perspective="orders",phase="Live"} 0"#));
        assert!(text.contains(r#"perspective_catchup_remaining_events{perspective="orders"} 400"#));
        assert!(text.contains(r#"perspective_catchup_progress_ratio{perspective="orders"} 0.6"#));
        assert!(text.contains(r#"perspective_apply_latency_seconds_bucket{le="0.001"} 0"#));
        assert!(text.contains(r#"perspective_apply_latency_seconds_bucket{le="30"} 1"#));
    }

    #[test]
    fn init_perspective_creates_zero_series() {
        let m = WorkerMetrics::new();
        m.init_perspective("carts");
        let text = m.render();
        assert!(text.contains(r#"perspective_events_processed_total{perspective="carts"} 0"#));
        assert!(text.contains(r#"perspective_failures_total{perspective="carts"} 0"#));
        assert!(text.contains(r#"perspective_dead_letters_total{perspective="carts"} 0"#));
        assert!(text.contains(r#"perspective_pending_events{perspective="carts"} 0"#));
        assert!(text.contains(r#"perspective_lag_seconds{perspective="carts"} 0"#));
        assert!(text.contains(r#"perspective_phase{perspective="carts",phase="Live"} 1"#));
        assert!(text.contains(r#"perspective_catchup_progress_ratio{perspective="carts"} 1"#));
    }

    #[test]
    fn registries_are_independent() {
        let a = WorkerMetrics::new();
        let b = WorkerMetrics::default();
        a.rewinds.inc();
        assert!(a.render().contains("perspective_rewinds_total 1"));
        assert!(b.render().contains("perspective_rewinds_total 0"));
    }
}
