//! How far a perspective is from live: its phase and, while a job catches it up, the figures a
//! user watches (streams caught up or queued, events applied, an estimate of the time left). Pure: built from
//! a job's stored figures, shared by `status`, `/metrics` and the operator's status.

use serde::{Deserialize, Serialize};

use super::{JobKind, JobRow, JobState};

/// Where a perspective is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Applying events as they are appended.
    #[default]
    Live,
    /// New to the schema: its history is being applied.
    Backfilling,
    /// Its version changed (or `rebuild` ran): each stream is reset and replayed.
    Rebuilding,
    /// Its version changed with `rebuild: blueGreen`: the new version is being built beside the
    /// live one, which serves meanwhile.
    Building,
    /// The new version is built: it switches once it has caught up (see the README, "Blue/green
    /// versions"); the old one serves until then.
    Switching,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Live => "Live",
            Phase::Backfilling => "Backfilling",
            Phase::Rebuilding => "Rebuilding",
            Phase::Building => "Building",
            Phase::Switching => "Switching",
        }
    }

    /// The phase as `status` shows it: `Live`, `Backfilling 61%`, `Building v3 61%`, `Switching`.
    pub fn label(self, progress: Option<&Progress>) -> String {
        let Some(progress) = progress else {
            return self.as_str().to_string();
        };
        let percent = progress.percent.floor();
        match (self, progress.version) {
            (Phase::Building, Some(version)) => format!("Building v{version} {percent}%"),
            _ => format!("{} {percent}%", self.as_str()),
        }
    }

    pub const ALL: [Phase; 5] = [
        Phase::Live,
        Phase::Backfilling,
        Phase::Rebuilding,
        Phase::Building,
        Phase::Switching,
    ];
}

/// A catch-up in progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// `waiting` (for transactions that appended before the job started), `queueing` (streams)
    /// or `applying` (the history).
    pub step: String,
    /// Streams whose history is applied (or, queued for the workers), of those listed.
    pub streams_done: i64,
    pub streams_total: i64,
    /// Events of the perspective's types stored when the job listed the streams.
    pub events_total: i64,
    /// Events still to apply: in streams not queued yet, plus the perspective's pending work.
    pub events_remaining: i64,
    /// Share of `events_total` applied, 0–100.
    pub percent: f64,
    /// At the rate so far; None until something was applied.
    pub eta_seconds: Option<f64>,
    /// While `Building`: the version built beside the live one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// While `waiting`: the transactions waited for, by backend ("pid 4242 (psql, user app,
    /// open 310 s)"); a long one holds the job until it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
}

impl Progress {
    /// The phase and progress a job's figures show.
    pub fn of(job: &JobRow) -> (Phase, Progress) {
        let phase = match job.kind {
            JobKind::Backfill => Phase::Backfilling,
            JobKind::Rebuild => Phase::Rebuilding,
        };
        let streams_total = job.streams_total.unwrap_or(0);
        let events_total = job.events_total.unwrap_or(0);
        let listed = job.state != JobState::Waiting;
        let events_remaining = if listed {
            job.events_unqueued + job.pending_events
        } else {
            0
        };
        // Pending work includes live events appended since: never below zero done.
        let events_done = (events_total - events_remaining).max(0);
        let percent = if !listed {
            0.0
        } else if events_total == 0 {
            100.0
        } else {
            (events_done as f64 * 100.0 / events_total as f64).min(100.0)
        };
        let eta_seconds = match job.running_seconds {
            Some(secs) if events_done > 0 && secs > 0.0 => {
                Some(events_remaining as f64 / (events_done as f64 / secs))
            }
            _ => None,
        };
        let step = match job.state {
            JobState::Waiting => "waiting",
            JobState::Queueing => "queueing",
            _ => "applying",
        };
        (
            phase,
            Progress {
                step: step.to_string(),
                streams_done: if listed {
                    streams_total - job.streams_left
                } else {
                    0
                },
                streams_total,
                events_total,
                events_remaining,
                percent,
                eta_seconds,
                version: None,
                waiting_for: job.waiting_for.clone(),
            },
        )
    }

    /// One line for people: "order_totals backfilling: 61% (610 000/1 000 000 events,
    /// 10 000/10 000 streams), about 40 s left".
    pub fn message(&self, perspective: &str, phase: Phase) -> String {
        let verb = match (phase, self.version) {
            (Phase::Building, Some(version)) => format!("building v{version}"),
            _ => phase.as_str().to_lowercase(),
        };
        if self.step == "waiting" {
            let mut line =
                format!("{perspective} {verb}: waiting for transactions older than the job to end");
            if let Some(blockers) = &self.waiting_for {
                line.push_str(&format!(": {blockers}"));
            }
            return line;
        }
        let mut line = format!(
            "{perspective} {verb}: {}% ({}/{} events, {}/{} streams)",
            self.percent.floor() as i64,
            thousands(self.events_total - self.events_remaining.min(self.events_total)),
            thousands(self.events_total),
            thousands(self.streams_done),
            thousands(self.streams_total),
        );
        if let Some(eta) = self.eta_seconds {
            line.push_str(&format!(", about {} left", duration(eta)));
        }
        line
    }
}

/// 1234567 → "1 234 567".
fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Seconds → "40 s", "3 min", "2 h 5 min".
fn duration(seconds: f64) -> String {
    let s = seconds.round().max(0.0) as u64;
    match s {
        0..=89 => format!("{} s", s.max(1)),
        90..=5399 => format!("{} min", (s + 30) / 60),
        _ => format!("{} h {} min", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(state: JobState) -> JobRow {
        JobRow {
            perspective: "order_totals".into(),
            kind: JobKind::Backfill,
            state,
            streams_total: Some(10_000),
            events_total: Some(1_000_000),
            streams_left: 3_900,
            events_unqueued: 390_000,
            pending_events: 0,
            running_seconds: Some(61.0),
            waiting_for: None,
        }
    }

    #[test]
    fn progress_counts_events_applied_and_estimates_from_the_rate_so_far() {
        let (phase, p) = Progress::of(&job(JobState::Queueing));
        assert_eq!(phase, Phase::Backfilling);
        assert_eq!((p.streams_done, p.streams_total), (6_100, 10_000));
        assert_eq!(p.events_remaining, 390_000);
        assert_eq!(p.percent, 61.0);
        // 610 000 events in 61 s: 10 000/s, so 39 s for the rest.
        assert_eq!(p.eta_seconds, Some(39.0));
        assert_eq!(
            p.message("order_totals", phase),
            "order_totals backfilling: 61% (610 000/1 000 000 events, 6 100/10 000 streams), about 39 s left"
        );
    }

    #[test]
    fn live_work_beyond_the_history_never_makes_progress_negative() {
        let mut j = job(JobState::Applying);
        j.streams_left = 0;
        j.events_unqueued = 0;
        j.pending_events = 1_200_000;
        let (_, p) = Progress::of(&j);
        assert_eq!(p.percent, 0.0);
        assert_eq!(p.eta_seconds, None);
        assert_eq!(p.streams_done, 10_000);
    }

    #[test]
    fn a_waiting_job_has_listed_nothing_yet() {
        let mut j = job(JobState::Waiting);
        j.kind = JobKind::Rebuild;
        j.streams_total = None;
        j.events_total = None;
        j.running_seconds = None;
        let (phase, p) = Progress::of(&j);
        assert_eq!(phase, Phase::Rebuilding);
        assert_eq!(
            (p.percent, p.streams_total, p.events_remaining),
            (0.0, 0, 0)
        );
        assert_eq!(
            p.message("carts", phase),
            "carts rebuilding: waiting for transactions older than the job to end"
        );
    }

    #[test]
    fn a_waiting_job_names_the_transactions_it_waits_for() {
        let mut j = job(JobState::Waiting);
        j.waiting_for = Some("pid 4242 (psql, user app, open 310 s)".into());
        let (phase, p) = Progress::of(&j);
        assert_eq!(
            p.message("order_totals", phase),
            "order_totals backfilling: waiting for transactions older than the job to end: \
             pid 4242 (psql, user app, open 310 s)"
        );
        // Once listed, nothing is waited for.
        let (_, p) = Progress::of(&job(JobState::Queueing));
        assert_eq!(p.waiting_for, None);
    }

    #[test]
    fn an_empty_history_is_complete() {
        let mut j = job(JobState::Applying);
        j.streams_total = Some(0);
        j.events_total = Some(0);
        j.streams_left = 0;
        j.events_unqueued = 0;
        assert_eq!(Progress::of(&j).1.percent, 100.0);
    }

    #[test]
    fn a_version_built_beside_the_live_one_is_labelled_with_it() {
        let (_, mut p) = Progress::of(&job(JobState::Queueing));
        p.version = Some(3);
        assert_eq!(Phase::Building.label(Some(&p)), "Building v3 61%");
        assert_eq!(Phase::Switching.label(None), "Switching");
        assert_eq!(Phase::Backfilling.label(Some(&p)), "Backfilling 61%");
        assert!(p
            .message("orders", Phase::Building)
            .starts_with("orders building v3: 61% ("));
    }

    #[test]
    fn numbers_and_durations_read_well() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1 000");
        assert_eq!(thousands(1_234_567), "1 234 567");
        assert_eq!(duration(0.2), "1 s");
        assert_eq!(duration(40.0), "40 s");
        assert_eq!(duration(180.0), "3 min");
        assert_eq!(duration(7_500.0), "2 h 5 min");
    }
}
