//! What the engine knows of its link to PostgreSQL, and what it tells `/readyz` and `/livez`
//! (through the shared [`Readiness`]).
//!
//! Ready means: registered, the first claim done, and neither the last claim nor the last
//! heartbeat failed or has gone unanswered for [`Health::unanswered_after`]. A dead link does not
//! fail a statement, it hangs it (packets dropped, the socket open): so a claim or heartbeat
//! still waiting after that long counts as failed already. A successful claim clears its own
//! failure; a successful heartbeat clears both (the database answers).
//!
//! Abandoned means: peers may have abandoned this instance (their heartbeat sweep deletes
//! instances silent for `abandonStaleInstanceThresholdSeconds` and releases their streams, and
//! `claim_work` takes over a silent owner's streams before that). Either the last successful
//! heartbeat started longer ago than the threshold (by this process's clock, which runs no
//! slower than the server's age of that heartbeat), or a heartbeat found the instance's row gone
//! or stale. The engine then drops what it holds and registers again (see `Engine`).

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::http::Readiness;

/// A task whose statements tell whether the database answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    Claim,
    Heartbeat,
}

impl Probe {
    fn name(self) -> &'static str {
        match self {
            Probe::Claim => "claim_work",
            Probe::Heartbeat => "heartbeat",
        }
    }
}

#[derive(Debug)]
enum Phase {
    Running,
    /// Abandoned: reconnecting and registering again, for this reason.
    Reregistering(String),
    Stopping,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    first_claim: bool,
    /// Why the last claim failed; `None`: it did not.
    claim: Option<String>,
    /// Why the last heartbeat failed; `None`: it did not.
    heartbeat: Option<String>,
    /// When the last successful heartbeat (or the registration) started.
    last_beat: Instant,
    /// Set by a heartbeat that found the instance's row gone or stale.
    abandoned: Option<String>,
}

/// The engine's view of its database link; one per engine, shared by every task of it.
pub(crate) struct Health {
    readiness: Readiness,
    stale: Duration,
    unanswered_after: Duration,
    state: Mutex<State>,
    changed: Notify,
}

/// How long a claim or heartbeat may go unanswered before the worker reports not ready: 3 s, or
/// one heartbeat interval if that is shorter. Both statements take milliseconds.
pub(crate) fn unanswered_after(heartbeat_interval: Duration) -> Duration {
    heartbeat_interval.clamp(Duration::from_millis(100), Duration::from_secs(3))
}

impl Health {
    pub(crate) fn new(readiness: Readiness, heartbeat_interval: Duration, stale: Duration) -> Self {
        Health {
            readiness,
            stale,
            unanswered_after: unanswered_after(heartbeat_interval),
            state: Mutex::new(State {
                phase: Phase::Running,
                first_claim: false,
                claim: None,
                heartbeat: None,
                last_beat: Instant::now(),
                abandoned: None,
            }),
            changed: Notify::new(),
        }
    }

    pub(crate) fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// `abandonStaleInstanceThresholdSeconds`.
    pub(crate) fn stale(&self) -> Duration {
        self.stale
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut state);
        match verdict(&state) {
            None => self.readiness.set_ready(),
            Some(reason) => self.readiness.set_not_ready(reason),
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// A new registration (started at `started`): running, first claim pending.
    pub(crate) fn registered(&self, started: Instant) {
        self.update(|s| {
            *s = State {
                phase: Phase::Running,
                first_claim: false,
                claim: None,
                heartbeat: None,
                last_beat: started,
                abandoned: None,
            }
        });
    }

    /// Abandoned; registering again (`reason`: why, or why the last attempt failed).
    pub(crate) fn reregistering(&self, reason: String) {
        self.update(|s| s.phase = Phase::Reregistering(reason));
    }

    /// Shutting down: not ready from now on, whatever the tasks report.
    pub(crate) fn stopping(&self) {
        self.update(|s| s.phase = Phase::Stopping);
    }

    /// The outcome of one statement of `probe`.
    pub(crate) fn report(&self, probe: Probe, outcome: Result<(), String>) {
        self.update(|s| match (probe, outcome) {
            (Probe::Claim, Ok(())) => {
                s.first_claim = true;
                s.claim = None;
            }
            (Probe::Claim, Err(e)) => s.claim = Some(e),
            (Probe::Heartbeat, Ok(())) => {
                s.heartbeat = None;
                s.claim = None;
            }
            (Probe::Heartbeat, Err(e)) => s.heartbeat = Some(e),
        });
    }

    /// Whether the last claim or heartbeat failed or is still unanswered past
    /// [`unanswered_after`].
    pub(crate) fn unreachable(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.claim.is_some() || state.heartbeat.is_some()
    }

    /// A heartbeat that started at `started` was recorded.
    pub(crate) fn beat_recorded(&self, started: Instant) {
        self.update(|s| s.last_beat = s.last_beat.max(started));
    }

    /// A heartbeat found that peers may have abandoned this instance.
    pub(crate) fn abandoned(&self, reason: String) {
        self.update(|s| s.abandoned = Some(reason));
    }

    /// Runs `statement` of `probe`, reporting its outcome; if it has not answered after
    /// [`unanswered_after`], reports it failed meanwhile (it keeps waiting: the caller's deadline,
    /// if any, ends it).
    pub(crate) async fn watch<T>(
        &self,
        probe: Probe,
        statement: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        tokio::pin!(statement);
        let result = tokio::select! {
            r = &mut statement => r,
            _ = tokio::time::sleep(self.unanswered_after) => {
                self.report(probe, Err(format!(
                    "{} has not answered for {:.1} s",
                    probe.name(),
                    self.unanswered_after.as_secs_f64()
                )));
                statement.await
            }
        };
        let outcome = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(format!(
                "{} failed: {}",
                probe.name(),
                crate::db::describe_error(e, None)
            )),
        };
        self.report(probe, outcome);
        result
    }

    /// Why this instance counts as abandoned now, if it does.
    fn abandonment(&self) -> Result<String, Instant> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.abandoned {
            return Ok(reason.clone());
        }
        let deadline = state.last_beat + self.stale;
        if Instant::now() >= deadline {
            return Ok(format!(
                "no heartbeat recorded for {:.1} s, longer than the stale threshold ({} s): \
                 peers may have taken this instance's streams",
                state.last_beat.elapsed().as_secs_f64(),
                self.stale.as_secs()
            ));
        }
        Err(deadline)
    }

    /// Waits until this instance counts as abandoned; returns why.
    pub(crate) async fn until_abandoned(&self) -> String {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.abandonment() {
                Ok(reason) => return reason,
                Err(deadline) => {
                    tokio::select! {
                        _ = changed => {}
                        _ = tokio::time::sleep_until(deadline.into()) => {}
                    }
                }
            }
        }
    }
}

/// Why the worker is not ready; `None`: it is.
fn verdict(s: &State) -> Option<String> {
    match &s.phase {
        Phase::Stopping => return Some("shutting down".into()),
        Phase::Reregistering(why) => return Some(format!("abandoned, registering again: {why}")),
        Phase::Running => {}
    }
    if let Some(e) = &s.heartbeat {
        Some(format!("database unreachable: {e}"))
    } else if let Some(e) = &s.claim {
        Some(format!("database unreachable: {e}"))
    } else if !s.first_claim {
        Some("first claim pending".into())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> Health {
        Health::new(
            Readiness::default(),
            Duration::from_millis(200),
            Duration::from_millis(600),
        )
    }

    #[test]
    fn ready_after_the_first_claim_until_a_claim_or_heartbeat_fails() {
        let h = health();
        h.registered(Instant::now());
        assert_eq!(h.readiness.reason().as_deref(), Some("first claim pending"));
        h.report(Probe::Claim, Ok(()));
        assert!(h.readiness.is_ready());
        assert!(!h.unreachable());
        h.report(Probe::Claim, Err("claim_work failed: refused".into()));
        assert!(h.readiness.reason().unwrap().contains("claim_work failed"));
        assert!(h.unreachable());
        h.report(Probe::Claim, Ok(()));
        assert!(h.readiness.is_ready(), "a claim clears its own failure");
        h.report(Probe::Heartbeat, Err("heartbeat failed: refused".into()));
        h.report(Probe::Claim, Ok(()));
        assert!(
            h.readiness.reason().unwrap().contains("heartbeat failed"),
            "only a heartbeat clears a failed heartbeat"
        );
        h.report(Probe::Claim, Err("claim_work failed".into()));
        h.report(Probe::Heartbeat, Ok(()));
        assert!(h.readiness.is_ready(), "a heartbeat clears both");
        h.stopping();
        h.report(Probe::Heartbeat, Ok(()));
        assert_eq!(h.readiness.reason().as_deref(), Some("shutting down"));
    }

    #[tokio::test]
    async fn a_statement_unanswered_for_too_long_reports_not_ready_while_it_waits() {
        let h = health();
        h.registered(Instant::now());
        h.report(Probe::Claim, Ok(()));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let watched = h.watch(Probe::Claim, async {
            let _ = rx.await;
            Ok::<_, sqlx::Error>(())
        });
        tokio::pin!(watched);
        let waited = tokio::time::timeout(Duration::from_millis(400), &mut watched).await;
        assert!(waited.is_err(), "still waiting");
        let reason = h.readiness.reason().expect("not ready while it hangs");
        assert!(reason.contains("claim_work has not answered"), "{reason}");
        tx.send(()).unwrap();
        watched.await.unwrap();
        assert!(h.readiness.is_ready(), "its answer clears it");
    }

    #[tokio::test]
    async fn abandoned_once_no_heartbeat_was_recorded_for_the_stale_threshold() {
        let h = health();
        let t0 = Instant::now();
        h.registered(t0);
        // Heartbeats keep it from counting as abandoned.
        tokio::time::sleep(Duration::from_millis(400)).await;
        h.beat_recorded(Instant::now());
        let reason = h.until_abandoned().await;
        let after = t0.elapsed();
        assert!(after >= Duration::from_millis(1000), "{after:?}");
        assert!(reason.contains("no heartbeat recorded"), "{reason}");
        // A heartbeat's finding ends the wait at once.
        h.registered(Instant::now());
        h.abandoned("the instance row was gone".into());
        assert_eq!(h.until_abandoned().await, "the instance row was gone");
    }
}
