//! The live apply latency of the last second, by perspective: the worst append → applied time
//! of the events each perspective applied. The drain records it with every applied group; a
//! catch-up reads the worst among the perspectives it is not catching up, and slows down before
//! the users of the live read models wait (see `catchup::pace`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The window is two halves: the current one and the one before.
const HALF: Duration = Duration::from_millis(500);

/// Worst latency per perspective over the last second.
pub(crate) struct LiveLatency {
    /// Halves are numbered from this instant.
    origin: Instant,
    per_perspective: Mutex<HashMap<String, Window>>,
}

/// One perspective's worst latency (seconds) in its latest half and the half before it, and
/// whether it applied anything in them.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    half: u64,
    current: f64,
    previous: f64,
    applied: bool,
}

impl Window {
    /// The window as of half number `half`: older halves fall out.
    fn at(self, half: u64) -> Window {
        match half.saturating_sub(self.half) {
            0 => self,
            1 => Window {
                half,
                current: 0.0,
                previous: self.current,
                applied: self.applied,
            },
            _ => Window {
                half,
                ..Window::default()
            },
        }
    }

    fn worst(self) -> f64 {
        self.current.max(self.previous)
    }
}

impl Default for LiveLatency {
    fn default() -> Self {
        LiveLatency {
            origin: Instant::now(),
            per_perspective: Mutex::new(HashMap::new()),
        }
    }
}

impl LiveLatency {
    /// `perspective` applied events whose worst append → applied latency was `seconds`, now.
    pub(crate) fn record(&self, perspective: &str, seconds: f64) {
        self.record_at(perspective, seconds, Instant::now());
    }

    fn half(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.origin).as_millis() / HALF.as_millis()) as u64
    }

    fn record_at(&self, perspective: &str, seconds: f64, at: Instant) {
        let half = self.half(at);
        let mut map = self
            .per_perspective
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let window = match map.get_mut(perspective) {
            Some(w) => w,
            None => map.entry(perspective.to_owned()).or_default(),
        };
        *window = window.at(half);
        window.current = window.current.max(seconds);
        window.applied = true;
    }

    /// The worst latency of the last second among the perspectives `skip` rejects; None when
    /// none of them applied anything.
    pub(crate) fn worst_except(&self, skip: impl Fn(&str) -> bool) -> Option<Duration> {
        self.worst_except_at(skip, Instant::now())
    }

    fn worst_except_at(&self, skip: impl Fn(&str) -> bool, at: Instant) -> Option<Duration> {
        let half = self.half(at);
        let map = self
            .per_perspective
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.iter()
            .filter(|(p, _)| !skip(p))
            .map(|(_, w)| w.at(half))
            .filter(|w| w.applied)
            .map(|w| w.worst())
            .reduce(f64::max)
            .map(|worst| Duration::from_secs_f64(worst.max(0.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_of_the_last_second_counts_and_older_ones_fall_out() {
        let l = LiveLatency::default();
        let t = l.origin;
        l.record_at("orders", 0.020, t);
        l.record_at("orders", 0.300, t + Duration::from_millis(100));
        l.record_at("orders", 0.010, t + Duration::from_millis(600));
        let none = |_: &str| false;
        assert_eq!(
            l.worst_except_at(none, t + Duration::from_millis(700)),
            Some(Duration::from_millis(300)),
            "the half before counts"
        );
        assert_eq!(
            l.worst_except_at(none, t + Duration::from_millis(1100)),
            Some(Duration::from_millis(10)),
            "two halves later only the newer one counts"
        );
        assert_eq!(
            l.worst_except_at(none, t + Duration::from_millis(2600)),
            None,
            "nothing applied in the last second"
        );
    }

    #[test]
    fn the_perspectives_skipped_do_not_count() {
        let l = LiveLatency::default();
        let t = l.origin;
        l.record_at("orders", 0.040, t);
        l.record_at("orders__v2", 9.0, t);
        assert_eq!(
            l.worst_except_at(|p| p == "orders__v2", t),
            Some(Duration::from_millis(40))
        );
        assert_eq!(
            l.worst_except_at(|_| false, t),
            Some(Duration::from_secs(9))
        );
        assert_eq!(l.worst_except_at(|_| true, t), None, "none left");
    }
}
