//! What the live perspectives did lately: the worst append → applied time of the last second,
//! and how many events they applied a second over the last two. The drain records every applied
//! group; a catch-up reads them among the perspectives it is not catching up, and slows down
//! before the users of the live read models wait, or the producers whose appends feed them do
//! (see `catchup::pace`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The windows are made of halves of a second.
const HALF: Duration = Duration::from_millis(500);
/// The latency is the worst of the current half and the one before it (a second).
const LATENCY_HALVES: usize = 2;
/// The rate counts the current half and the three before it: two seconds, so a rate of a few
/// hundred events a second varies by a few percent from one window to the next, not tens.
const RATE_HALVES: usize = 4;

/// What the live perspectives applied lately, for a catch-up's pace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LiveMeasure {
    /// The worst append → applied latency of the last second.
    pub worst: Duration,
    /// Events applied a second, over the last two seconds.
    pub rate: f64,
}

/// Per perspective, its recent halves.
pub(crate) struct LiveApply {
    /// Halves are numbered from this instant.
    origin: Instant,
    per_perspective: Mutex<HashMap<String, Window>>,
}

/// One perspective's halves: `halves[0]` is half number `half`, `halves[1]` the one before...
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    half: u64,
    halves: [Half; RATE_HALVES],
}

/// One half: the worst latency (seconds) and the events applied in it.
#[derive(Debug, Clone, Copy, Default)]
struct Half {
    worst: f64,
    events: u64,
}

impl Window {
    /// The window as of half number `half`: older halves move down and fall out.
    fn at(self, half: u64) -> Window {
        let shift = half.saturating_sub(self.half) as usize;
        let mut halves = [Half::default(); RATE_HALVES];
        for (i, h) in self.halves.iter().enumerate() {
            if i + shift < RATE_HALVES {
                halves[i + shift] = *h;
            }
        }
        Window { half, halves }
    }

    /// The worst latency of the last second, if anything was applied in it.
    fn worst(&self) -> Option<f64> {
        let recent = &self.halves[..LATENCY_HALVES];
        recent
            .iter()
            .any(|h| h.events > 0)
            .then(|| recent.iter().map(|h| h.worst).fold(0.0, f64::max))
    }

    fn events(&self) -> u64 {
        self.halves.iter().map(|h| h.events).sum()
    }
}

impl Default for LiveApply {
    fn default() -> Self {
        LiveApply {
            origin: Instant::now(),
            per_perspective: Mutex::new(HashMap::new()),
        }
    }
}

impl LiveApply {
    /// `perspective` applied `events` events, the worst of them `seconds` after their append,
    /// now.
    pub(crate) fn record(&self, perspective: &str, seconds: f64, events: u64) {
        self.record_at(perspective, seconds, events, Instant::now());
    }

    fn half(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.origin).as_millis() / HALF.as_millis()) as u64
    }

    fn record_at(&self, perspective: &str, seconds: f64, events: u64, at: Instant) {
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
        let current = &mut window.halves[0];
        current.worst = current.worst.max(seconds);
        current.events += events;
    }

    /// The worst latency of the last second and the rate of the last two among the
    /// perspectives `skip` rejects; None when none of them applied anything in the last second.
    pub(crate) fn measure_except(&self, skip: impl Fn(&str) -> bool) -> Option<LiveMeasure> {
        self.measure_except_at(skip, Instant::now())
    }

    fn measure_except_at(&self, skip: impl Fn(&str) -> bool, at: Instant) -> Option<LiveMeasure> {
        let half = self.half(at);
        let map = self
            .per_perspective
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let windows: Vec<Window> = map
            .iter()
            .filter(|(p, _)| !skip(p))
            .map(|(_, w)| w.at(half))
            .collect();
        let worst = windows.iter().filter_map(Window::worst).reduce(f64::max)?;
        // The current half has run for only part of its length.
        let into_current = at.saturating_duration_since(self.origin) - HALF * half as u32;
        let span = HALF * (RATE_HALVES as u32 - 1) + into_current;
        let events: u64 = windows.iter().map(Window::events).sum();
        Some(LiveMeasure {
            worst: Duration::from_secs_f64(worst.max(0.0)),
            rate: events as f64 / span.as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_worst_of_the_last_second_counts_and_older_ones_fall_out() {
        let l = LiveApply::default();
        let t = l.origin;
        l.record_at("orders", 0.020, 1, t);
        l.record_at("orders", 0.300, 1, t + 100 * MS);
        l.record_at("orders", 0.010, 1, t + 600 * MS);
        let none = |_: &str| false;
        let worst = |at| l.measure_except_at(none, at).map(|m| m.worst);
        assert_eq!(
            worst(t + 700 * MS),
            Some(300 * MS),
            "the half before counts"
        );
        assert_eq!(
            worst(t + 1100 * MS),
            Some(10 * MS),
            "two halves later only the newer one counts"
        );
        assert_eq!(
            worst(t + 2600 * MS),
            None,
            "nothing applied in the last second"
        );
    }

    #[test]
    fn the_rate_counts_the_last_two_seconds() {
        let l = LiveApply::default();
        let t = l.origin;
        let none = |_: &str| false;
        // 100 events in each half from 0 to 2 s.
        for half in 0..4 {
            l.record_at("orders", 0.001, 60, t + half * 500 * MS);
            l.record_at("invoices", 0.001, 40, t + half * 500 * MS + 100 * MS);
        }
        let rate = |at| l.measure_except_at(none, at).unwrap().rate;
        // At 2.0 s the current half has just begun: 300 events in 1.5 s.
        assert_eq!(rate(t + 2000 * MS), 200.0);
        // At 1.75 s the fourth half is current, 250 ms in: 400 events in 1.75 s.
        assert!((rate(t + 1750 * MS) - 400.0 / 1.75).abs() < 1e-9);
        assert_eq!(
            l.measure_except_at(|p| p == "invoices", t + 2000 * MS)
                .unwrap()
                .rate,
            120.0,
            "a skipped perspective's events do not count"
        );
    }

    #[test]
    fn the_perspectives_skipped_do_not_count() {
        let l = LiveApply::default();
        let t = l.origin;
        l.record_at("orders", 0.040, 1, t);
        l.record_at("orders__v2", 9.0, 1, t);
        let worst = |skip: &dyn Fn(&str) -> bool| l.measure_except_at(skip, t).map(|m| m.worst);
        assert_eq!(worst(&|p| p == "orders__v2"), Some(40 * MS));
        assert_eq!(worst(&|_| false), Some(Duration::from_secs(9)));
        assert_eq!(worst(&|_| true), None, "none left");
    }
}
