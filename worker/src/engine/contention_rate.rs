//! How often lock conflicts between appliers hit each perspective: a count over a sliding
//! window of the last 60 seconds (and the SQLSTATE most of them had), published with every
//! heartbeat (`wh_service_instances.metadata`, see
//! [`crate::store::instances::CONTENTION_METADATA_KEY`]) so that `perspective-worker status`
//! and the operator can name a contention that persists. Each conflict is also counted in
//! `perspective_contention_retries_total` (for rates over any window, with Prometheus).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::instances::LockConflicts;

/// The window the rate is counted over.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Lock conflicts per perspective over the last [`WINDOW`], counted in one-second buckets.
pub(crate) struct ContentionRate {
    /// Bucket numbers are whole seconds since this instant.
    origin: Instant,
    per_perspective: Mutex<BTreeMap<String, Buckets>>,
}

/// One perspective's conflicts: per second that had any (oldest first), the count by SQLSTATE.
#[derive(Default)]
struct Buckets(VecDeque<(u64, BTreeMap<String, u64>)>);

impl Buckets {
    fn add(&mut self, second: u64, sqlstate: &str) {
        if self.0.back().is_none_or(|(s, _)| *s != second) {
            self.0.push_back((second, BTreeMap::new()));
        }
        if let Some((_, counts)) = self.0.back_mut() {
            *counts.entry(sqlstate.to_owned()).or_default() += 1;
        }
    }

    /// Drops the buckets of seconds before `first` (outside the window).
    fn expire(&mut self, first: u64) {
        while self.0.front().is_some_and(|(s, _)| *s < first) {
            self.0.pop_front();
        }
    }

    /// The total and the most frequent SQLSTATE (on a tie, the one that comes first).
    fn total(&self) -> Option<LockConflicts> {
        let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
        for (_, counts) in &self.0 {
            for (state, n) in counts {
                *by_state.entry(state).or_default() += n;
            }
        }
        let per_minute = by_state.values().sum();
        let sqlstate = by_state
            .iter()
            .rev()
            .max_by_key(|(_, n)| **n)
            .map(|(s, _)| (*s).to_owned())?;
        Some(LockConflicts {
            per_minute,
            sqlstate,
        })
    }
}

impl Default for ContentionRate {
    fn default() -> Self {
        ContentionRate {
            origin: Instant::now(),
            per_perspective: Mutex::new(BTreeMap::new()),
        }
    }
}

impl ContentionRate {
    /// One conflict of `perspective` ("*": a whole `wh_drain` call) with `sqlstate`, now.
    pub(crate) fn record(&self, perspective: &str, sqlstate: &str) {
        self.record_at(perspective, sqlstate, Instant::now());
    }

    /// The conflicts of the last [`WINDOW`] per perspective that had any, now.
    pub(crate) fn per_minute(&self) -> BTreeMap<String, LockConflicts> {
        self.per_minute_at(Instant::now())
    }

    fn second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.origin).as_secs()
    }

    /// The first second still inside the window that ends in second `now`.
    fn first_in_window(now: u64) -> u64 {
        (now + 1).saturating_sub(WINDOW.as_secs())
    }

    fn record_at(&self, perspective: &str, sqlstate: &str, at: Instant) {
        let second = self.second(at);
        let mut all = self
            .per_perspective
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !all.contains_key(perspective) {
            all.insert(perspective.to_owned(), Buckets::default());
        }
        let Some(buckets) = all.get_mut(perspective) else {
            return;
        };
        buckets.expire(Self::first_in_window(second));
        buckets.add(second, sqlstate);
    }

    fn per_minute_at(&self, now: Instant) -> BTreeMap<String, LockConflicts> {
        let first = Self::first_in_window(self.second(now));
        let mut all = self
            .per_perspective
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        all.retain(|_, b| {
            b.expire(first);
            !b.0.is_empty()
        });
        all.iter()
            .filter_map(|(name, b)| Some((name.clone(), b.total()?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_minute: u64, sqlstate: &str) -> LockConflicts {
        LockConflicts {
            per_minute,
            sqlstate: sqlstate.to_owned(),
        }
    }

    #[test]
    fn conflicts_count_for_a_minute_then_expire() {
        let r = ContentionRate::default();
        let t0 = r.origin;
        let at = |s: u64| t0 + Duration::from_millis(s * 1000 + 500);
        assert!(r.per_minute_at(t0).is_empty());
        for _ in 0..3 {
            r.record_at("customer_stats", "55P03", at(0));
        }
        r.record_at("customer_stats", "40P01", at(30));
        r.record_at("*", "55P03", at(30));
        let now = r.per_minute_at(at(59));
        assert_eq!(now["customer_stats"], rate(4, "55P03"));
        assert_eq!(now["*"], rate(1, "55P03"));
        // Second 0 has left the window; second 30 leaves it at second 90.
        assert_eq!(r.per_minute_at(at(60))["customer_stats"], rate(1, "40P01"));
        assert_eq!(r.per_minute_at(at(89)).len(), 2);
        assert!(r.per_minute_at(at(90)).is_empty(), "nothing left: no entry");
    }

    #[test]
    fn the_sqlstate_is_the_most_frequent_one() {
        let r = ContentionRate::default();
        let t = r.origin + Duration::from_secs(5);
        r.record_at("p", "55P03", t);
        r.record_at("p", "40P01", t + Duration::from_secs(1));
        r.record_at("p", "40P01", t + Duration::from_secs(2));
        assert_eq!(
            r.per_minute_at(t + Duration::from_secs(2))["p"],
            rate(3, "40P01")
        );
        // A tie: the first in order.
        let tie = ContentionRate::default();
        tie.record_at("p", "55P03", t);
        tie.record_at("p", "40001", t);
        assert_eq!(tie.per_minute_at(t)["p"], rate(2, "40001"));
    }

    #[test]
    fn a_busy_minute_keeps_one_bucket_per_second() {
        let r = ContentionRate::default();
        for ms in 0..120_000u64 {
            r.record_at("p", "55P03", r.origin + Duration::from_millis(ms));
        }
        let end = r.origin + Duration::from_millis(119_999);
        assert_eq!(r.per_minute_at(end)["p"].per_minute, 60_000);
        let all = r.per_perspective.lock().unwrap();
        assert_eq!(all["p"].0.len(), 60);
    }
}
