//! The worker's Prometheus metrics (DESIGN §8), served as text on `/metrics`.
//!
//! Every collector lives in one [`WorkerMetrics`] that owns its own [`Registry`] rather than
//! the process-global default registry: tests and embedders can run several workers in one
//! process without their series colliding, and nothing else in the process can inject series
//! into the worker's `/metrics`. The collectors are public fields; prometheus handles are cheap
//! to clone and lock-free to update, so engine code clones the ones it needs.
//!
//! Names follow the seeds with a `perspective_` prefix. Labelled families only appear once a
//! label value is used; [`WorkerMetrics::init_perspective`] creates the zero series for a
//! perspective up front so `rate()` and alerts see a series from the first scrape.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::store::catchup::progress::{Phase, Progress};

/// Buckets for durations inside the worker (a claim, a batch): 1 ms … 30 s.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
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
    /// `perspective_queue_vacuums_total{table}`: vacuums of a queue table run by this worker
    /// (between autovacuum's visits, see `engine::vacuum`).
    pub queue_vacuums: IntCounterVec,
}

impl WorkerMetrics {
    /// Creates every collector and registers it in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let reg = |c: Box<dyn prometheus::core::Collector>| {
            registry
                .register(c)
                .expect("worker metric names are unique and valid")
        };

        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            reg(Box::new(c.clone()));
            c
        };
        let counter_vec = |name: &str, help: &str| {
            let c =
                IntCounterVec::new(Opts::new(name, help), &[PERSPECTIVE]).expect("valid metric");
            reg(Box::new(c.clone()));
            c
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect("valid metric");
            reg(Box::new(h.clone()));
            h
        };

        let events_processed = counter_vec(
            "perspective_events_processed_total",
            "Events applied to a perspective (model change and cursor advance committed).",
        );
        let empty_batches = counter(
            "perspective_empty_batches_total",
            "Claim cycles that found no work for this instance.",
        );
        let batches = counter(
            "perspective_batches_total",
            "Claim cycles that returned work and were processed.",
        );
        let batch_duration = histogram(
            "perspective_batch_duration_seconds",
            "Wall time of one batch: claim, fetch, apply to every perspective, complete.",
            DURATION_BUCKETS,
        );
        let claim_duration = histogram(
            "perspective_claim_duration_seconds",
            "Round trip of one claim_work call (leasing work rows).",
            DURATION_BUCKETS,
        );
        let pending_events = IntGaugeVec::new(
            Opts::new(
                "perspective_pending_events",
                "Work rows of a perspective not yet applied (its lag in events), as last measured.",
            ),
            &[PERSPECTIVE],
        )
        .expect("valid metric");
        reg(Box::new(pending_events.clone()));
        let lag_seconds = GaugeVec::new(
            Opts::new(
                "perspective_lag_seconds",
                "Age of a perspective's oldest work row not yet applied, in seconds (0 when nothing \
                 is pending), as last measured.",
            ),
            &[PERSPECTIVE],
        )
        .expect("valid metric");
        reg(Box::new(lag_seconds.clone()));
        let dead_letters = counter_vec(
            "perspective_dead_letters_total",
            "Events dead-lettered for a perspective after exhausting their attempts.",
        );
        let failures = counter_vec(
            "perspective_failures_total",
            "Failed attempts to apply an event to a perspective (each one retried or \
             dead-lettered).",
        );
        let rewinds = counter(
            "perspective_rewinds_total",
            "Perspective cursors rewound because an event arrived behind the cursor.",
        );
        let apply_latency = histogram(
            "perspective_apply_latency_seconds",
            "Time from the event's append (its created_at) until a perspective applied it; one observation per event and perspective.",
            APPLY_LATENCY_BUCKETS,
        );
        let notify_wakeups = counter(
            "perspective_notify_wakeups_total",
            "Times a NOTIFY for new work woke the worker before its poll interval.",
        );
        let listener_connected = IntGauge::new(
            "perspective_listener_connected",
            "1 while the LISTEN connection for work notifications is up, 0 while the worker \
             relies on polling alone.",
        )
        .expect("valid metric");
        reg(Box::new(listener_connected.clone()));
        let completions_flushed = counter(
            "perspective_completions_flushed_total",
            "Completed work rows deleted in batches by the completion flush worker.",
        );
        let completion_flush_failures = counter(
            "perspective_completion_flush_failures_total",
            "Completion flushes that failed; their rows are flushed again after the retry \
             backoff (worker.retryOptions), at once when the worker stops, or retired by a later drain.",
        );
        let tables_analyzed = IntCounterVec::new(
            Opts::new(
                "perspective_tables_analyzed_total",
                "ANALYZEs the worker ran on a table of its schema whose rows outgrew its planner \
                 statistics (so cached plans made while it was small stop scanning it); one that \
                 found the table locked by another ANALYZE, a VACUUM or DDL skipped it.",
            ),
            &["table"],
        )
        .expect("valid metric");
        reg(Box::new(tables_analyzed.clone()));
        let hook_events_dropped = counter(
            "perspective_hook_events_dropped_total",
            "Hook events not delivered because a subscriber had fallen the channel's capacity behind \
             (lifecycle stages dropped are not recorded as done and fire again at the next start).",
        );

        let phase = IntGaugeVec::new(
            Opts::new(
                "perspective_phase",
                "1 for the phase a perspective is in (Live, Backfilling, Rebuilding), 0 for the others.",
            ),
            &[PERSPECTIVE, "phase"],
        )
        .expect("valid metric");
        reg(Box::new(phase.clone()));
        let catchup_remaining_events = IntGaugeVec::new(
            Opts::new(
                "perspective_catchup_remaining_events",
                "Events a perspective's backfill or rebuild has still to apply (0 when live).",
            ),
            &[PERSPECTIVE],
        )
        .expect("valid metric");
        reg(Box::new(catchup_remaining_events.clone()));
        let catchup_progress = GaugeVec::new(
            Opts::new(
                "perspective_catchup_progress_ratio",
                "Share of a perspective's backfill or rebuild applied, 0 to 1 (1 when live).",
            ),
            &[PERSPECTIVE],
        )
        .expect("valid metric");
        reg(Box::new(catchup_progress.clone()));
        let queue_vacuums = IntCounterVec::new(
            Opts::new(
                "perspective_queue_vacuums_total",
                "Vacuums of a queue table (wh_perspective_events, wh_active_streams) this worker ran \
                 because it held as many dead rows as live ones.",
            ),
            &["table"],
        )
        .expect("valid metric");
        reg(Box::new(queue_vacuums.clone()));

        WorkerMetrics {
            registry,
            events_processed,
            empty_batches,
            batches,
            batch_duration,
            claim_duration,
            pending_events,
            lag_seconds,
            dead_letters,
            failures,
            rewinds,
            apply_latency,
            notify_wakeups,
            listener_connected,
            completions_flushed,
            completion_flush_failures,
            tables_analyzed,
            hook_events_dropped,
            phase,
            catchup_remaining_events,
            catchup_progress,
            queue_vacuums,
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
        "perspective_rewinds_total",
        "perspective_apply_latency_seconds",
        "perspective_notify_wakeups_total",
        "perspective_listener_connected",
        "perspective_completions_flushed_total",
        "perspective_completion_flush_failures_total",
        "perspective_tables_analyzed_total",
        "perspective_hook_events_dropped_total",
        "perspective_phase",
        "perspective_catchup_remaining_events",
        "perspective_catchup_progress_ratio",
        "perspective_queue_vacuums_total",
    ];

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
        m.rewinds.inc();
        m.apply_latency.observe(0.04);
        m.notify_wakeups.inc();
        m.listener_connected.set(1);
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
